"""Scaled dot-product attention, forward and backward, with masks, dropout and grouped-query heads."""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple, Optional

import numpy as np

from .._validate import as_float, as_rng, check_bool, check_grad, check_mask, check_prob


class AttentionCache(NamedTuple):
    """What ``scaled_dot_product_attention_backward`` needs.

    The probabilities are kept *unnormalised*, one row block at a time (see ``_row_blocks``):
    ``blocks[i]`` is ``E = exp(S - rowmax)`` for the query rows ``rows[i]`` (in the grouped layout,
    ``(..., Hk, G*Lq, Lk)``) and the keys ``0..cols[i]-1``, every key those rows may see; the
    softmax is ``P = E / l`` with ``l`` the row sums, kept as ``inv_l = 1 / l``.  ``keep`` is
    dropout's keep-mask ``(..., Hq, Lq, Lk)`` (None without dropout) and ``drop_scale`` its ``1/(1-p)``.
    ``weights`` assembles the full softmax probabilities ``(..., Hq, Lq, Lk)`` (before dropout).
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    rows: tuple
    cols: tuple
    blocks: tuple
    inv_l: np.ndarray
    keep: Optional[np.ndarray]
    drop_scale: float
    scale: float
    groups: int

    @property
    def weights(self):
        """``P = softmax(S)``, ``(..., Hq, Lq, Lk)``: zero where a query may not attend."""
        q, k = self.q, self.k
        lk = k.shape[-2]
        p = np.zeros(_grouped_shape(q.shape[:-1] + (lk,), self.groups), dtype=q.dtype)
        for rows, c1, e in zip(self.rows, self.cols, self.blocks):
            np.multiply(e, self.inv_l[..., rows, :], out=p[..., rows, :c1])
        return _ungrouped(p, self.groups, q.shape[:-1] + (lk,))


def _check_qkv(q, k, v, enable_gqa):
    """Validate and cast q, k, v; return them with the number of query heads per kv head."""
    q = as_float(q, "q")
    k = as_float(k, "k", q.dtype)
    v = as_float(v, "v", q.dtype)
    if q.ndim < 2:
        raise ValueError(f"q: expected shape (..., L, E) with at least 2 dimensions, got {q.shape}")
    for name, a in (("k", k), ("v", v)):
        if a.ndim != q.ndim:
            raise ValueError(f"{name}: expected {q.ndim} dimensions like q {q.shape}, got shape {a.shape}")
    if q.shape[-1] < 1:
        raise ValueError(f"q: expected an embedding dimension >= 1, got shape {q.shape}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k: expected last dimension {q.shape[-1]} (q's E), got shape {k.shape}")
    if v.shape[:-1] != k.shape[:-1]:
        raise ValueError(f"v: expected shape {k.shape[:-1]} + (Ev,) to match k {k.shape}, got {v.shape}")
    groups = 1
    if enable_gqa and q.ndim >= 3 and q.shape[-3] != k.shape[-3]:
        hq, hk = q.shape[-3], k.shape[-3]
        if hk == 0 or hq % hk:
            raise ValueError(
                f"k: with enable_gqa the number of query heads ({hq}) must be a multiple of the "
                f"number of key/value heads, got {hk} (q {q.shape}, k {k.shape})"
            )
        groups = hq // hk
        if q.shape[:-3] != k.shape[:-3]:
            raise ValueError(f"k: expected batch dimensions {q.shape[:-3]} like q {q.shape}, got shape {k.shape}")
    elif k.shape[:-2] != q.shape[:-2]:
        hint = " (pass enable_gqa=True for grouped-query attention)" if q.ndim >= 3 and q.shape[:-3] == k.shape[:-3] else ""
        raise ValueError(f"k: expected leading dimensions {q.shape[:-2]} like q {q.shape}, got shape {k.shape}{hint}")
    return q, k, v, groups


def _grouped_shape(shape, groups):
    """``(..., Hk*G, L, D) -> (..., Hk, G*L, D)``."""
    if groups == 1:
        return tuple(shape)
    return tuple(shape[:-3]) + (shape[-3] // groups, groups * shape[-2], shape[-1])


def _grouped(x, groups):
    """``(..., Hk*G, L, D) -> (..., Hk, G*L, D)``: query head ``h`` sits with kv head ``h // G``."""
    return x if groups == 1 else x.reshape(_grouped_shape(x.shape, groups))


def _ungrouped(x, groups, full_shape):
    return x if groups == 1 else x.reshape(full_shape)


# -- blocked causal attention ----------------------------------------------------------------------
# With ``is_causal`` the rows of a block of queries ``r0..r1-1`` see the keys ``0..r1-1`` only, so
# the scores are computed one block of query rows at a time, each only as wide as the keys its
# rows may see: the blocks above the diagonal (almost half of ``q k^T`` and of ``P v`` and of the
# four backward products) are never computed, never exponentiated and never stored.  Without
# ``is_causal`` a single block holds every row and every key.  The block height trades the work
# wasted on the masked half of each diagonal block against per-call overhead; measured on the
# GPT-2-small block (b=8, h=12, L=256, E=64) and at L=1024, 2 cores, OpenBLAS:
_CAUSAL_BLOCK = 64
_CAUSAL_BLOCK_LONG = 128   # from this many queries on
_LONG = 1024


def _row_blocks(lq, lk, groups, causal, block=None):
    """``[(rows, c1, r0), ...]``: the query rows of each block in the grouped layout (a slice of
    ``G*Lq`` rows that never straddles two query heads), the number of keys ``c1`` they may see,
    and ``r0``, the block's first query position.  Causal: query ``i`` sees keys ``0..i``."""
    if not causal:
        return [(slice(g * lq, (g + 1) * lq), lk, 0) for g in range(groups)] if lq else []
    if block is None:
        block = _CAUSAL_BLOCK_LONG if lq >= _LONG else _CAUSAL_BLOCK
    out = []
    for g in range(groups):
        for r0 in range(0, lq, block):
            r1 = min(r0 + block, lq)
            out.append((slice(g * lq + r0, g * lq + r1), min(r1, lk), r0))
    return out


def _heads_last_empty(shape, dtype, zero=False):
    """An array of ``shape (..., H, L, D)`` laid out in memory as ``(..., L, H, D)``: merging the
    heads back into features (``swapaxes(-2, -3)`` then ``reshape``) is then free, as in
    ``MultiHeadAttention``.  (Each ``(L, D)`` matrix is still a BLAS operand: rows are strided.)"""
    alloc = np.zeros if zero else np.empty
    if len(shape) < 3:
        return alloc(shape, dtype)
    return alloc(tuple(shape[:-3]) + (shape[-2], shape[-3], shape[-1]), dtype).swapaxes(-2, -3)


def _mask_rows(mask, groups, g, rows_in_head, c1):
    """The block ``[g, rows, :c1]`` of a mask broadcast to ``(..., Hq, Lq, Lk)``, in the grouped layout."""
    if groups == 1:
        return mask[..., rows_in_head, :c1]
    return mask[..., g, rows_in_head, :c1]


def scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=False, dropout_p=0.0,
                                 scale=None, rng=None, enable_gqa=False):
    """``out = dropout(softmax(q k^T * scale + mask)) v``, as ``torch.nn.functional.scaled_dot_product_attention``.

    Shapes: ``q (..., Hq, Lq, E)``, ``k (..., Hk, Lk, E)``, ``v (..., Hk, Lk, Ev)`` -> ``(..., Hq, Lq, Ev)``
    (inputs without a head axis, ``(batch, L, E)``, work too).  ``scale`` defaults to ``1/sqrt(E)``.

    * ``attn_mask``: bool (True = may attend) or float (added to the scaled scores), broadcastable
      to ``(..., Hq, Lq, Lk)``.  ``is_causal``: query ``i`` sees keys ``0..i`` (top-left aligned,
      also when ``Lq != Lk``); unlike torch, it may be combined with ``attn_mask`` (both apply).
    * A query row that may attend to no key gives output 0 (and gradient 0), never NaN.
    * ``dropout_p`` acts on the attention weights with a mask drawn from ``rng``.
    * ``enable_gqa``: ``Hq`` a multiple of ``Hk``; query head ``h`` uses kv head ``h // (Hq // Hk)``.
      Computed without copying k/v: query heads are grouped beside their kv head in one GEMM.

    How (the same numbers as the textbook formula, computed with less work):

    * the softmax of a row is ``P = E / l`` with ``E = exp(S - max S)`` and ``l = sum E``; the
      output is ``out = (E v) / l``, so ``E`` is never divided (one pass over ``(Lq, Lk)`` saved);
    * causal: the scores are formed block of query rows by block (``_row_blocks``), each block only
      as wide as the keys its rows may see: the masked half of the matrices is skipped.

    The output is laid out in memory as ``(..., Lq, Hq, Ev)`` (a transposed view; see
    ``_heads_last_empty``).  Returns ``(out, AttentionCache)``.
    """
    q, k, v, groups = _check_qkv(q, k, v, check_bool(enable_gqa, "enable_gqa"))
    is_causal = check_bool(is_causal, "is_causal")
    dropout_p = check_prob(dropout_p, "dropout_p")
    lq, lk = q.shape[-2], k.shape[-2]
    score_shape = q.shape[:-1] + (lk,)
    if attn_mask is not None:
        attn_mask = check_mask(attn_mask, "attn_mask", score_shape)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise TypeError(f"scale: expected a finite real number or None, got {scale!r}")
    scale = float(scale)
    rng = as_rng(rng) if dropout_p > 0.0 else None

    keep, drop_scale = None, 1.0
    if dropout_p > 0.0:
        keep = rng.random(score_shape) >= dropout_p
        drop_scale = 0.0 if dropout_p == 1.0 else 1.0 / (1.0 - dropout_p)

    # Everything below runs in the grouped layout (..., Hk, G*Lq, ...): one GEMM per kv head.
    # Masks are viewed as (..., Hk, G, Lq, Lk) so that a block of grouped rows finds its part.
    def split_groups(m):
        m = np.broadcast_to(m, score_shape)
        return m if groups == 1 else m.reshape(score_shape[:-3] + (k.shape[-3], groups) + score_shape[-2:])

    blocked = None if attn_mask is None or attn_mask.dtype != bool else split_groups(~attn_mask)
    additive = None if attn_mask is None or attn_mask.dtype == bool else split_groups(attn_mask)
    keep_g = None if keep is None else split_groups(keep)
    qs = _grouped(q * scale, groups)
    kt = k.swapaxes(-1, -2)
    out_shape = q.shape[:-1] + (v.shape[-1],)
    if groups == 1:
        out = _heads_last_empty(out_shape, q.dtype)
    else:
        out = np.empty(_grouped_shape(out_shape, groups), q.dtype)
    inv_l = np.empty(qs.shape[:-1] + (1,), q.dtype)
    blocks = _row_blocks(lq, lk, groups, is_causal)
    height = max((r.stop - r.start for r, _, _ in blocks), default=0)
    # within a block: row a (query r0 + a) must not see column r0 + b when b > a
    causal_above = np.triu(np.ones((height, height), dtype=bool), 1) if is_causal else None

    rows_, cols_, blocks_ = [], [], []
    for rows, c1, r0 in blocks:
        g, r1 = rows.start // lq if lq else 0, r0 + (rows.stop - rows.start)
        in_head = slice(r0, r1)
        # scores of this block: s = (q * scale) k^T over the keys 0..c1-1 its rows may see
        s = qs[..., rows, :] @ kt[..., :, :c1]
        if is_causal and r0 + 1 < c1:  # the diagonal part: key j > query i is in the future
            np.copyto(s[..., :, r0:c1], -np.inf, where=causal_above[: r1 - r0, : c1 - r0])
        if blocked is not None:
            np.copyto(s, -np.inf, where=_mask_rows(blocked, groups, g, in_head, c1))
        if additive is not None:
            s += _mask_rows(additive, groups, g, in_head, c1)
        # E = exp(s - rowmax), in place; rows with no visible key (max = -inf) end up all zero
        m = s.max(axis=-1, keepdims=True, initial=-np.inf)  # Lk = 0: no key, output 0
        m[~np.isfinite(m)] = 0.0
        s -= m
        np.exp(s, out=s)
        total = s.sum(axis=-1, keepdims=True)
        total[total == 0] = 1.0
        il = inv_l[..., rows, :]
        np.divide(1.0, total, out=il)
        # out = P' v = (E [* keep]) v / l [/ (1-p)]
        e_used = s if keep_g is None else s * _mask_rows(keep_g, groups, g, in_head, c1)
        o = out[..., rows, :]
        np.matmul(e_used, v[..., :c1, :], out=o)
        o *= il if keep is None else il * drop_scale
        rows_.append(rows)
        cols_.append(c1)
        blocks_.append(s)
    out = _ungrouped(out, groups, out_shape)
    cache = AttentionCache(q, k, v, tuple(rows_), tuple(cols_), tuple(blocks_), inv_l, keep, drop_scale,
                           scale, groups)
    return out, cache


def scaled_dot_product_attention_backward(dout, cache, *, out=None):
    """Backward of ``out = P' v`` with ``P' = dropout(P)``, ``P = softmax(S)``, ``S = scale q k^T + mask``:

    * ``dv = P'^T dout`` and ``dP' = dout v^T``;
    * through dropout, ``dP = dP' * keep / (1 - p)``;
    * through the row softmax, ``dS = P * (dP - sum_j dP * P)`` (masked entries have P = 0, so 0);
    * ``dq = scale dS k`` and ``dk = scale dS^T q`` (the mask is a constant).

    How, with the cache's unnormalised ``E`` (``P = E / l``, see the forward):

    * the row sums ``D_i = sum_j dP_ij P_ij = (sum_j dP_ij E_ij) / l_i`` in one ``einsum`` pass (not
      ``dout_i . out_i``, FlashAttention's shortcut: equal in exact arithmetic, but it rounds
      differently and would turn the exact zero gradient of a row that sees a single key into 1e-16);
    * ``dS = (E * (dP - D)) / l``: the row factor ``1/l`` goes onto ``dout`` for ``dv``, onto the
      rows of ``dq`` and onto the rows of ``q`` for ``dk``, never onto an ``(Lq, Lk)`` array;
    * causal: the same row blocks as the forward; ``dk`` and ``dv`` add up the blocks' parts.

    With grouped-query heads the products run in the grouped layout, which sums each kv head's
    gradient over the query heads that share it.  ``out``: optional ``(dq, dk, dv)`` arrays of the
    right shapes and dtype to write the gradients into (e.g. views of one fused buffer).
    Returns ``(dq, dk, dv)``.
    """
    q, k, v, rows_, cols_, blocks_, inv_l, keep, drop_scale, scale, groups = cache
    dout = check_grad(dout, q.shape[:-1] + (v.shape[-1],), q.dtype)
    lq = q.shape[-2]
    dog = _grouped(dout, groups)
    do_l = dog * (inv_l * drop_scale)  # dout / l [/(1-p)]: dv = E'^T (dout / l)
    q_l = _grouped(q, groups) * (inv_l * scale)  # scale * q / l: dk = (E * (dP - D))^T (scale q / l)
    if out is not None and groups == 1:
        dq, dk, dv = out
        dk[...] = 0
        dv[...] = 0
    else:
        dq = np.empty(_grouped_shape(q.shape, groups), q.dtype) if groups > 1 else _heads_last_empty(q.shape, q.dtype)
        dk = _heads_last_empty(k.shape, k.dtype, zero=True)
        dv = _heads_last_empty(v.shape, v.dtype, zero=True)
    keep_g = None
    if keep is not None:
        keep_g = keep if groups == 1 else keep.reshape(keep.shape[:-3] + (k.shape[-3], groups) + keep.shape[-2:])
    vt = v.swapaxes(-1, -2)
    for rows, c1, e in zip(rows_, cols_, blocks_):
        r0 = rows.start % lq if lq else 0
        kb = None if keep_g is None else _mask_rows(keep_g, groups, rows.start // lq, slice(r0, r0 + e.shape[-2]), c1)
        # dv += (E [* keep])^T (dout / l [/(1-p)])
        e_used = e if kb is None else e * kb
        dv[..., :c1, :] += e_used.swapaxes(-1, -2) @ do_l[..., rows, :]
        # dP' = dout v^T; through dropout; dS * l = E * (dP - D)
        ds = dog[..., rows, :] @ vt[..., :, :c1]
        if kb is not None:
            ds *= kb
            ds *= drop_scale
        ds -= np.einsum("...ij,...ij->...i", ds, e)[..., None] * inv_l[..., rows, :]  # D = sum_j dP P
        ds *= e
        # dq = scale dS k = (scale / l) (E * (dP - D)) k;  dk += scale dS^T q = (E * (dP - D))^T (scale q / l)
        dq_rows = dq[..., rows, :]
        np.matmul(ds, k[..., :c1, :], out=dq_rows)
        dq_rows *= inv_l[..., rows, :] * scale
        dk[..., :c1, :] += ds.swapaxes(-1, -2) @ q_l[..., rows, :]
    dq = _ungrouped(dq, groups, q.shape)
    if out is not None and groups > 1:
        for dst, src in zip(out, (dq, dk, dv)):
            np.copyto(dst, src)
        return tuple(out)
    return dq, dk, dv

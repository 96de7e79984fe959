"""Scaled dot-product attention, forward and backward, with masks, dropout and grouped-query heads."""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import numpy as np

from .._validate import as_rng, check_bool, check_grad, check_mask, check_prob
from ._blocks import check_qkv, check_scale
from ._blocks import scratch as _scratch

_check_qkv = check_qkv  # the name memory_efficient.py imports


class AttentionCache(NamedTuple):
    """What ``scaled_dot_product_attention_backward`` needs.

    Everything is in the grouped layout ``(..., Hk, G*Lq, ...)`` (``G`` query heads per kv head,
    1 without grouped-query attention).  The probabilities are kept *unnormalised* and by blocks
    of query rows (see ``_row_blocks``): ``e[i] = exp(S - rowmax)^T``, key-major ``(..., c1, n)``,
    for the ``n`` rows ``blocks[i][0]`` and the keys ``0..c1-1``, ``c1 = blocks[i][1]``, all those
    rows may see; the softmax is ``P = e^T / l`` with
    ``l`` the row sums, kept as ``inv_l = 1 / l``.  ``keep`` is dropout's keep-mask
    ``(..., Hq, Lq, Lk)`` (None without dropout) and ``drop_scale`` its ``1/(1-p)``.
    ``weights`` assembles the softmax probabilities ``(..., Hq, Lq, Lk)`` (before dropout).
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    e: tuple
    inv_l: np.ndarray
    blocks: tuple
    keep: Optional[np.ndarray]
    drop_scale: float
    scale: float
    groups: int

    @property
    def weights(self):
        """``P = softmax(S)``, ``(..., Hq, Lq, Lk)``: zero where a query may not attend."""
        score_shape = self.q.shape[:-1] + (self.k.shape[-2],)
        p = np.zeros(_grouped_shape(score_shape, self.groups), dtype=self.q.dtype)
        for (rows, c1, _), e in zip(self.blocks, self.e):
            np.multiply(e.swapaxes(-1, -2), self.inv_l[..., rows, :], out=p[..., rows, :c1])
        return _ungrouped(p, self.groups, score_shape)


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
# With ``is_causal`` query ``i`` sees keys ``0..i``, so the rows of a block of queries ``r0..r1-1``
# need the keys ``0..r1-1`` only.  The scores are therefore formed one block of query rows at a
# time, each only as wide as the keys its rows may see (``_row_blocks``): the blocks above the
# diagonal (almost half of ``q k^T``, ``P v`` and the four backward products) are never computed,
# exponentiated or stored.  Without ``is_causal`` there is one block of every row and key.
# Each block is its own compact array: its elementwise passes (max, exp, sum, ...) run on memory
# that is contiguous.  The block height trades the work wasted on the masked half of the diagonal
# blocks against per-call overhead and GEMM size (OpenBLAS splits each per-head GEMM over its
# threads, which pays only for larger ones).  Forward+backward, b=8, h=12, L=256 and b=2, h=12,
# L=1024 (E=64), 2 cores, OpenBLAS Haswell kernels, best of 7, ms:
#
#     height                  32     64    128    256    512    (one block, the old code:
#     L=256   float32       64.5   60.0   54.9   64.8       -     ~2x the blocked time)
#     L=256   float64      117.2  103.7   95.3  127.7       -
#     L=1024  float32          -  148.0  119.5  121.7  142.2
#     L=1024  float64          -  282.2  228.2  248.3  285.3
_CAUSAL_BLOCK = 128


def _block_height(causal):
    """Query rows per causal block (None: not causal, a single block)."""
    return _CAUSAL_BLOCK if causal else None


def _row_blocks(lq, lk, groups, height):
    """``[(rows, c1, r0), ...]``: the rows of each query block in the grouped layout (a slice of
    the ``G*Lq`` rows that never straddles two query heads), the number ``c1`` of keys they may
    see (keys ``0..c1-1``) and the block's first query position ``r0``."""
    if height is None:
        return [(slice(g * lq, (g + 1) * lq), lk, 0) for g in range(groups)] if lq else []
    return [(slice(g * lq + r0, g * lq + min(r0 + height, lq)), min(r0 + height, lq, lk), r0)
            for g in range(groups) for r0 in range(0, lq, height)]


def _heads_last_empty(shape, dtype):
    """An array of ``shape (..., H, L, D)`` laid out in memory as ``(..., L, H, D)``: merging the
    heads back into features (``swapaxes(-2, -3)`` then ``reshape``), as ``MultiHeadAttention``
    does, is then free.  (Each ``(L, D)`` matrix is still a BLAS operand: its rows are strided.)"""
    if len(shape) < 3:
        return np.empty(shape, dtype)
    return np.empty(tuple(shape[:-3]) + (shape[-2], shape[-3], shape[-1]), dtype).swapaxes(-2, -3)


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

    How (the textbook formula's numbers, with less work):

    * the softmax of a row is ``P = E / l`` with ``E = exp(S - max S)`` and ``l = sum E``, so
      ``out = (E v) / l``: the ``(Lq, Ev)`` output is divided, never the ``(Lq, Lk)`` matrix ``E``;
    * causal: one block of query rows at a time, only as wide as the keys those rows may see
      (``_row_blocks``): the masked half of the score matrix is skipped;
    * each block is held key-major, ``S^T = k q^T`` of shape ``(keys, queries)``: the same
      numbers, but OpenBLAS splits these ``K = E`` GEMMs over its threads this way round (about
      2x faster on 2 cores than ``q k^T``); the softmax then runs down the columns.

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
    scale = check_scale(scale, q.shape[-1])
    rng = as_rng(rng) if dropout_p > 0.0 else None

    keep, drop_scale = None, 1.0
    if dropout_p > 0.0:
        keep = rng.random(score_shape) >= dropout_p
        drop_scale = 0.0 if dropout_p == 1.0 else 1.0 / (1.0 - dropout_p)

    # Everything below runs in the grouped layout (..., Hk, G*Lq, ...): one GEMM per kv head.
    # A mask broadcast to (..., Hq, Lq, Lk) is viewed as (..., Hk, G, Lq, Lk) (no copy), and the
    # block of query rows r0..r1 of group g is then mask[..., g, r0:r1, :c1].
    def mask_view(m):
        m = np.broadcast_to(m, score_shape)
        return m if groups == 1 else m.reshape(score_shape[:-3] + (k.shape[-3], groups) + score_shape[-2:])

    def mask_block(m, rows, c1, r0):
        r1 = r0 + rows.stop - rows.start
        return m[..., r0:r1, :c1] if groups == 1 else m[..., rows.start // lq, r0:r1, :c1]

    hidden = None if attn_mask is None or attn_mask.dtype != bool else mask_view(~attn_mask)
    additive = None if attn_mask is None or attn_mask.dtype == bool else mask_view(attn_mask)
    keep_g = None if keep is None else _grouped(keep, groups)  # contiguous: a view
    qg = _grouped(q, groups)
    out_shape = q.shape[:-1] + (v.shape[-1],)
    out = _heads_last_empty(out_shape, q.dtype) if groups == 1 else np.empty(_grouped_shape(out_shape, groups), q.dtype)
    inv_l = np.empty(qg.shape[:-1] + (1,), q.dtype)
    height = _block_height(is_causal)
    blocks = _row_blocks(lq, lk, groups, height)
    # key-major diagonal block: key r0 + b is hidden from query r0 + a when b > a (strictly below)
    hide = np.tril(np.ones((height, height), dtype=bool), -1) if is_causal else None
    lead = qg.shape[:-2]
    qs_buf = np.empty(math.prod(lead) * max((r.stop - r.start for r, _, _ in blocks), default=0) * q.shape[-1], q.dtype)

    e = []
    for rows, c1, r0 in blocks:
        n = rows.stop - rows.start
        # scores of the block, key-major: t = s^T = k (q * scale)^T over the keys 0..c1-1 its rows
        # may see (the (c1, n) orientation: OpenBLAS runs these K=E GEMMs on both cores this way)
        qs = np.multiply(qg[..., rows, :], scale, out=_scratch(qs_buf, lead + (n, q.shape[-1])))
        t = k[..., :c1, :] @ qs.swapaxes(-1, -2)
        if is_causal and r0 + 1 < c1:  # the diagonal part: key r0 + b is hidden from query r0 + a when b > a
            np.copyto(t[..., r0:c1, :], -np.inf, where=hide[:c1 - r0, :n])
        if hidden is not None:
            np.copyto(t, -np.inf, where=mask_block(hidden, rows, c1, r0).swapaxes(-1, -2))
        if additive is not None:
            t += mask_block(additive, rows, c1, r0).swapaxes(-1, -2)
        # E = exp(s - max over keys), in place; a query with no visible key (max = -inf) gets zeros.
        # (fmax: max but for NaN, which it skips; as fast along this axis in float64 as max is not)
        m = np.fmax.reduce(t, axis=-2, keepdims=True, initial=-np.inf)  # Lk = 0: no key, output 0
        m[~np.isfinite(m)] = 0.0
        t -= m
        np.exp(t, out=t)
        total = t.sum(axis=-2)[..., None]  # (..., n, 1), as inv_l
        total[total == 0] = 1.0
        il = inv_l[..., rows, :]
        np.divide(1.0, total, out=il)
        # out = P' v = (E [* keep]) v / l [/ (1-p)]
        o = out[..., rows, :]
        used = t if keep_g is None else t * keep_g[..., rows, :c1].swapaxes(-1, -2)
        np.matmul(used.swapaxes(-1, -2), v[..., :c1, :], out=o)
        o *= il if keep is None else il * drop_scale
        e.append(t)
    out = _ungrouped(out, groups, out_shape)
    return out, AttentionCache(q, k, v, tuple(e), inv_l, tuple(blocks), keep, drop_scale, scale, groups)


def scaled_dot_product_attention_backward(dout, cache, *, out=None):
    """Backward of ``out = P' v`` with ``P' = dropout(P)``, ``P = softmax(S)``, ``S = scale q k^T + mask``:

    * ``dv = P'^T dout`` and ``dP' = dout v^T``;
    * through dropout, ``dP = dP' * keep / (1 - p)``;
    * through the row softmax, ``dS = P * (dP - sum_j dP * P)`` (masked entries have P = 0, so 0);
    * ``dq = scale dS k`` and ``dk = scale dS^T q`` (the mask is a constant).

    How, with the cache's unnormalised ``E`` (``P = E / l``, see the forward):

    * the row sums ``D_i = sum_j dP_ij P_ij = (sum_j dP_ij E_ij) / l_i``, one ``einsum`` pass (not
      FlashAttention's ``dout_i . out_i``: equal in exact arithmetic, but rounded differently it
      would turn the exact zero gradient of a row that sees a single key into 1e-16);
    * ``dS = (E * (dP - D)) / l``: the row factor ``1/l`` goes onto the rows of ``dq``, of
      ``dout`` (for ``dv``) and of ``q`` (for ``dk``), never onto an ``(Lq, Lk)`` array;
    * causal: the forward's row blocks, last (widest) first: its ``dk``, ``dv`` parts cover every
      key and are written, the narrower blocks' parts are added to them.

    With grouped-query heads the products run in the grouped layout, which sums each kv head's
    gradient over the query heads that share it.  ``out``: optional ``(dq, dk, dv)`` arrays of the
    right shapes and dtype to write the gradients into (e.g. views of one fused buffer).
    Returns ``(dq, dk, dv)``.
    """
    q, k, v, e_blocks, inv_l, blocks, keep, drop_scale, scale, groups = cache
    dout = check_grad(dout, q.shape[:-1] + (v.shape[-1],), q.dtype)
    dog = _grouped(dout, groups)
    keep_g = None if keep is None else _grouped(keep, groups)
    if out is not None and groups == 1:  # write straight into the caller's arrays
        dq, dk, dv = out
    elif groups == 1:
        dq, dk, dv = (_heads_last_empty(a.shape, a.dtype) for a in (q, k, v))
    else:
        dq = np.empty(_grouped_shape(q.shape, groups), q.dtype)
        dk, dv = np.empty(k.shape, k.dtype), np.empty(v.shape, v.dtype)
    # dk and dv add up the blocks' parts: the widest block comes first and is written, the
    # others are added to it (keys no query may see get zero)
    order = sorted(range(len(blocks)), key=lambda i: -blocks[i][1])
    widest = blocks[order[0]][1] if blocks else 0
    dk[..., widest:, :] = 0
    dv[..., widest:, :] = 0
    qg = _grouped(q, groups)
    # Scratch, allocated once at the largest block's size and reused by every block (memory
    # that stays in cache rather than fresh pages): dS, the rows of dout / l and scale q / l,
    # and the products added into dk and dv.
    lead = dog.shape[:-2]
    height = max((r.stop - r.start for r, _, _ in blocks), default=0)
    ds_buf = np.empty(math.prod(lead) * height * widest, q.dtype)
    do_buf = np.empty(math.prod(lead) * height * v.shape[-1], q.dtype)
    q_buf = np.empty(math.prod(lead) * height * q.shape[-1], q.dtype)
    prod_buf = np.empty(math.prod(lead) * widest * max(k.shape[-1], v.shape[-1]) if len(blocks) > 1 else 0, q.dtype)
    for n, i in enumerate(order):
        (rows, c1, _), e = blocks[i], e_blocks[i]  # e: E^T, key-major (c1, h) as in the forward
        h = rows.stop - rows.start
        il = inv_l[..., rows, :]
        kb = None if keep_g is None else keep_g[..., rows, :c1].swapaxes(-1, -2)
        # dv = P'^T dout = (E [* keep])^T (dout / l [/(1-p)])
        do_l = np.multiply(dog[..., rows, :], il if kb is None else il * drop_scale, out=_scratch(do_buf, lead + (h, v.shape[-1])))
        _write_or_add(e if kb is None else e * kb, do_l, dv[..., :c1, :], n > 0, prod_buf)
        # dP'^T = v dout^T;  dP = dP' * keep / (1 - p);  (l dS)^T = E^T * (dP - D)^T
        ds = _scratch(ds_buf, lead + (c1, h))
        np.matmul(v[..., :c1, :], dog[..., rows, :].swapaxes(-1, -2), out=ds)
        if kb is not None:
            ds *= kb
            ds *= drop_scale
        ds -= np.einsum("...ji,...ji->...i", ds, e)[..., None, :] * il.swapaxes(-1, -2)  # dP - D
        ds *= e
        # dq = scale dS k = (scale / l) (l dS) k;  dk = scale dS^T q = (l dS)^T (scale q / l)
        dq_rows = dq[..., rows, :]
        np.matmul(ds.swapaxes(-1, -2), k[..., :c1, :], out=dq_rows)
        il_s = il * scale
        dq_rows *= il_s
        q_l = np.multiply(qg[..., rows, :], il_s, out=_scratch(q_buf, lead + (h, q.shape[-1])))
        _write_or_add(ds, q_l, dk[..., :c1, :], n > 0, prod_buf)
    dq = _ungrouped(dq, groups, q.shape)
    if out is None:
        return dq, dk, dv
    for dst, src in zip(out, (dq, dk, dv)):
        if dst is not src:
            np.copyto(dst, src)
    return tuple(out)


def _write_or_add(a, b, acc, add, scratch):
    """``acc += a @ b`` (the product formed in ``scratch``) when ``add``, else ``acc[...] = a @ b``."""
    if add:
        prod = _scratch(scratch, acc.shape)
        np.matmul(a, b, out=prod)
        acc += prod
    else:
        np.matmul(a, b, out=acc)

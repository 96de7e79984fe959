"""The textbook tier: every pair of ``npattn.functional``, written as the formula.

Each op has the name and signature of its fast twin in ``npattn.functional`` and gives the same
numbers (the fast kernels are property-tested against this file to 1e-12 in float64), but is
written to be read: plain NumPy, whole arrays, no blocking, no scratch buffers, no ``out=``, no
threads and no input validation (pass what the fast op would accept; bad input gives whatever
numpy makes of it).  Each backward sits directly under its forward and derives itself line by
line: what the forward computed, so what the gradient is.  Shapes are noted where they help:
``B...`` leading (batch) dimensions, ``H`` heads, ``Lq``/``Lk`` query/key lengths, ``E`` the head
width, ``Ev`` the value width, ``C`` classes, ``D`` features.

Read this file to learn; call ``npattn.functional`` to compute (it validates its inputs and is
several times faster).  A cache is a plain tuple or ``NamedTuple`` of what the backward needs.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import numpy as np

from ._erf import erf
from ._random import draw_seed, keep_mask


def _sum_to(x, shape):
    """Undo numpy broadcasting: sum ``x`` down to ``shape`` (the leading axes broadcasting added,
    and the axes that were 1).  The gradient of an input that was broadcast is this sum."""
    x = x.sum(axis=tuple(range(x.ndim - len(shape))))
    return x.sum(axis=tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1), keepdims=True)


# == Attention ======================================================================================
# notebooks/01_self_attention.ipynb, section "Scaled dot-product attention" (the forward),
# notebooks/04_gradients_by_hand.ipynb, section "3. Attention: O = softmax(s QK^T + M) V" (the backward),
# notebooks/02_masks_and_dropout.ipynb (masks, fully masked rows, dropout),
# notebooks/03_multi_head_attention.ipynb, section "Grouped-query attention",
# notebooks/08_modern_attention.ipynb (the attention options: causal_align, window, ALiBi, softcap, sinks).


def _scores(q, kr, scale, attn_mask, is_causal, causal_align, window, alibi_slopes, softcap, cols=slice(None)):
    """The logits the softmax sees, for the keys ``cols`` (all of them by default):
    ``z = softcap(scale q k^T) + alibi + float mask``, ``-inf`` where a query may not look.

    ``q (B..., H, Lq, E)``, ``kr (B..., H, Lk, E)`` (kv heads already repeated for GQA).
    Returns ``(z (B..., H, Lq, n), tanh(s / softcap) or None)``, ``n`` the number of keys in ``cols``.
    """
    lq, lk = q.shape[-2], kr.shape[-2]
    s = scale * (q @ kr[..., cols, :].swapaxes(-1, -2))  # (B..., H, Lq, n): batch dims broadcast
    t = None
    if softcap is not None:  # -- option: softcap (before masks and biases)
        t = np.tanh(s / softcap)
        s = softcap * t
    # positions: query i sits at i (top-left) or i + Lk - Lq (bottom-right, KV-cache decoding); key j at j
    pos = np.arange(lq)[:, None] + (lk - lq if causal_align == "bottom_right" else 0)  # (Lq, 1)
    key = np.arange(lk)[None, cols]  # (1, n)
    visible = np.ones((lq, key.shape[1]), dtype=bool)
    if is_causal:
        visible &= key <= pos
    if window is not None:  # -- option: sliding window, p - left <= j <= p + right (-1: unbounded)
        left, right = window
        if left >= 0:
            visible &= key >= pos - left
        if right >= 0:
            visible &= key <= pos + right
    if alibi_slopes is not None:  # -- option: ALiBi, -slope_h |p - j|
        slopes = np.asarray(alibi_slopes, dtype=s.dtype)[..., None, None]  # (B..., H, 1, 1)
        s = s - slopes * np.abs(pos - key).astype(s.dtype)
    if attn_mask is not None:
        mask = np.asarray(attn_mask)[..., cols]
        if mask.dtype == bool:  # True = may attend
            visible = visible & mask
        else:  # float: added to the scores
            s = s + mask.astype(s.dtype)
    return np.where(visible, s, -np.inf).astype(s.dtype), t


def _gqa_groups(q, k, enable_gqa):
    """G, the number of query heads per kv head: query head h uses kv head h // G."""
    return q.shape[-3] // k.shape[-3] if enable_gqa and q.ndim >= 3 else 1


def _unrepeat(dx_rep, shape, groups):
    """The gradient of ``np.repeat(x, groups, axis=-3)`` (x of ``shape``, broadcast afterwards):
    sum out the broadcasting, then add up the ``groups`` query heads that shared each kv head."""
    rep_shape = tuple(shape[:-3]) + (shape[-3] * groups,) + tuple(shape[-2:]) if groups > 1 else shape
    d = _sum_to(dx_rep, rep_shape)
    if groups > 1:  # (B..., Hk*G, L, D) -> (B..., Hk, G, L, D), summed over G
        d = d.reshape(tuple(shape[:-3]) + (shape[-3], groups) + tuple(shape[-2:])).sum(axis=-3)
    return d


class AttentionCache(NamedTuple):
    """What ``scaled_dot_product_attention_backward`` needs (textbook: the whole weight matrix)."""

    q: np.ndarray  # (B..., Hq, Lq, E) as given
    k: np.ndarray  # (B..., Hk, Lk, E) as given
    v: np.ndarray  # (B..., Hk, Lk, Ev) as given
    p: np.ndarray  # (B..., Hq, Lq, Lk) softmax weights P, before dropout
    keep: Optional[np.ndarray]  # dropout's keep-mask, same shape as P, or None
    drop_scale: float  # 1 / (1 - p)
    scale: float
    groups: int
    tanh: Optional[np.ndarray]  # softcap's tanh(s / softcap), or None
    p_sink: Optional[np.ndarray]  # (B..., Hq, Lq, 1) the weight the sink took, or None
    mask_shape: Optional[tuple]  # the float mask's shape when mask_grad, else None
    softcap: Optional[float]


def scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=False, dropout_p=0.0, scale=None, rng=None,
                                 enable_gqa=False, *, causal_align="top_left", window=None, alibi_slopes=None,
                                 softcap=None, sinks=None, mask_grad=False):
    """``out = dropout(softmax(scale q k^T + mask)) v``, the textbook formula with every option.

    ``q (B..., Hq, Lq, E)``, ``k (B..., Hk, Lk, E)``, ``v (B..., Hk, Lk, Ev)`` -> ``(B..., Hq, Lq, Ev)``.
    See ``npattn.functional.scaled_dot_product_attention`` for the meaning of each argument.
    """
    g = _gqa_groups(q, k, enable_gqa)
    kr, vr = np.repeat(k, g, axis=-3), np.repeat(v, g, axis=-3)  # (B..., Hq, Lk, E): head h reads kv head h // G
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    z, t = _scores(q, kr, scale, attn_mask, is_causal, causal_align, window, alibi_slopes, softcap)
    # softmax over the keys, shifted by the row max (a fully masked row: max = -inf, use 0, all e = 0)
    m = z.max(axis=-1, keepdims=True, initial=-np.inf)  # (B..., Hq, Lq, 1)
    if sinks is not None:  # -- option: sinks, one more logit per head in every row's softmax
        sink = np.asarray(sinks, dtype=z.dtype)[:, None, None]  # (Hq, 1, 1)
        m = np.maximum(m, sink)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(z - m)  # (B..., Hq, Lq, Lk)
    total = e.sum(axis=-1, keepdims=True)  # (B..., Hq, Lq, 1)
    if sinks is not None:
        e_sink = np.exp(sink - m)
        total = total + e_sink
    total = np.where(total == 0, 1.0, total)  # no key at all: P = 0, so out = 0
    p = e / total  # (B..., Hq, Lq, Lk)
    p_sink = e_sink / total if sinks is not None else None
    keep, drop_scale = None, 1.0
    if dropout_p > 0.0:  # inverted dropout on the weights: P' = P * keep / (1 - p)
        keep = np.random.default_rng(rng).random(p.shape) >= dropout_p
        drop_scale = 0.0 if dropout_p == 1.0 else 1.0 / (1.0 - dropout_p)
    pd = p if keep is None else p * keep * drop_scale
    out = pd @ vr  # (B..., Hq, Lq, Ev)
    mask_shape = np.shape(attn_mask) if mask_grad else None
    return out, AttentionCache(q, k, v, p, keep, drop_scale, scale, g, t, p_sink, mask_shape, softcap)


def scaled_dot_product_attention_backward(dout, cache):
    """Backward of ``scaled_dot_product_attention``: ``(dq, dk, dv)``, then ``dmask`` (with
    ``mask_grad``), then ``dsinks`` (with ``sinks``)."""
    q, k, v, p, keep, drop_scale, scale, g, t, p_sink, mask_shape, softcap = cache
    kr, vr = np.repeat(k, g, axis=-3), np.repeat(v, g, axis=-3)
    # out = P' vr, a matrix product:  dvr = P'^T dout  and  dP' = dout vr^T
    pd = p if keep is None else p * keep * drop_scale
    dvr = pd.swapaxes(-1, -2) @ dout  # (B..., Hq, Lk, Ev)
    dpd = dout @ vr.swapaxes(-1, -2)  # (B..., Hq, Lq, Lk)
    # P' = P * keep / (1 - p) is elementwise in P:  dP = dP' * keep / (1 - p)
    dp = dpd if keep is None else dpd * keep * drop_scale
    # P = softmax(z) along each row: dP_ij/dz_il = P_ij (delta_jl - P_il), so
    # dz = P * (dP - D) with D_i = sum_j dP_ij P_ij (a masked entry has P = 0: its dz is 0)
    d = (dp * p).sum(axis=-1, keepdims=True)  # (B..., Hq, Lq, 1)
    dz = p * (dp - d)
    # z = s_capped + alibi + mask: the additive parts pass dz through unchanged
    # s_capped = softcap tanh(s / softcap):  ds = dz (1 - tanh^2)
    ds = dz if t is None else dz * (1.0 - t * t)
    # s = scale q kr^T:  dq = scale ds kr  and  dkr = scale ds^T q
    dq = _sum_to(scale * (ds @ kr), q.shape)
    dkr = scale * (ds.swapaxes(-1, -2) @ q)
    # kr = repeat(k, G) broadcast against q's batch: sum back to k's own shape (same for v)
    grads = [dq, _unrepeat(dkr, k.shape, g), _unrepeat(dvr, v.shape, g)]
    if mask_shape is not None:  # -- option: mask_grad, the mask was added to z, so dmask = dz
        grads.append(_sum_to(dz, mask_shape))
    if p_sink is not None:  # -- option: sinks. The sink is one more logit in the softmax, with value 0:
        # its dP is 0, so its dz is P_sink (0 - D); summed over every row that shared it
        grads.append(_sum_to(-p_sink * d, (p_sink.shape[-3], 1, 1)).reshape(-1))
    return tuple(grads)


class MemoryEfficientCache(NamedTuple):
    """What ``memory_efficient_attention_backward`` needs: inputs, output and one number per row."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    out: np.ndarray  # (B..., Hq, Lq, Ev)
    lse: np.ndarray  # (B..., Hq, Lq, 1) log-sum-exp of each row's logits (sink included); 0 if none
    keep: Optional[np.ndarray]
    drop_scale: float
    scale: float
    groups: int
    block_size: int
    options: dict  # attn_mask, is_causal, causal_align, window, alibi_slopes, softcap
    sinks: Optional[np.ndarray]
    mask_grad: bool


def memory_efficient_attention(q, k, v, attn_mask=None, is_causal=False, scale=None, block_size=None, *,
                               dropout_p=0.0, rng=None, enable_gqa=False, causal_align="top_left", window=None,
                               alibi_slopes=None, softcap=None, sinks=None, mask_grad=False):
    """FlashAttention's forward as a textbook loop: the online softmax over blocks of keys.

    The same result as ``scaled_dot_product_attention``.  Walking the key blocks, each query row
    keeps a running max ``m``, a running sum ``l = sum exp(z - m)`` and an accumulator
    ``acc = sum exp(z - m) v``; when ``m`` grows, ``l`` and ``acc`` are rescaled by
    ``exp(m_old - m_new)``.  At the end ``out = acc / l``, and only ``lse = m + log l`` is kept.
    (notebooks/06_efficient_attention.ipynb, sections "The online softmax, one query row" and
    "All rows at once, in a dozen lines".)
    """
    g = _gqa_groups(q, k, enable_gqa)
    kr, vr = np.repeat(k, g, axis=-3), np.repeat(v, g, axis=-3)  # textbook: repeated (the fast tier does not copy)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    block = 64 if block_size is None else block_size
    opts = dict(attn_mask=attn_mask, is_causal=is_causal, causal_align=causal_align, window=window,
                alibi_slopes=alibi_slopes, softcap=softcap)
    lq, lk = q.shape[-2], k.shape[-2]
    rows = np.broadcast_shapes(q.shape[:-2], kr.shape[:-2]) + (lq, 1)  # (B..., Hq, Lq, 1)
    keep, drop_scale = None, 1.0
    if dropout_p > 0.0:  # one seed per call; the mask of any block is a pure function of (seed, index)
        keep = keep_mask(draw_seed(np.random.default_rng(rng)), dropout_p, rows[:-1] + (lk,))
        drop_scale = 0.0 if dropout_p == 1.0 else 1.0 / (1.0 - dropout_p)
    m = np.full(rows, -np.inf, dtype=q.dtype)  # running max of each row
    total = np.zeros(rows, dtype=q.dtype)  # running sum of exp(z - m)
    acc = np.zeros(rows[:-1] + (v.shape[-1],), dtype=q.dtype)  # running sum of exp(z - m) v
    if sinks is not None:  # -- option: sinks, a first "key" with logit sink_h and value 0
        m = np.broadcast_to(np.asarray(sinks, dtype=q.dtype)[:, None, None], rows)
        total = np.ones(rows, dtype=q.dtype)
    for j0 in range(0, lk, block):
        cols = slice(j0, min(j0 + block, lk))
        z, _ = _scores(q, kr, scale, cols=cols, **opts)  # (B..., Hq, Lq, n)
        m_new = np.maximum(m, z.max(axis=-1, keepdims=True, initial=-np.inf))
        m_use = np.where(np.isfinite(m_new), m_new, 0.0)  # nothing seen yet: shift by 0, all e = 0
        alpha = np.exp(m - m_use)  # rescales what was summed against the old max
        e = np.exp(z - m_use)
        total = alpha * total + e.sum(axis=-1, keepdims=True)
        ed = e if keep is None else e * keep[..., cols] * drop_scale
        acc = alpha * acc + ed @ vr[..., cols, :]
        m = m_new
    seen = total > 0  # False for a row that may attend to no key (and has no sink): out 0, lse 0
    out = np.where(seen, acc / np.where(seen, total, 1.0), 0.0).astype(q.dtype)
    lse = np.where(seen, np.where(np.isfinite(m), m, 0.0) + np.log(np.where(seen, total, 1.0)), 0.0)
    return out, MemoryEfficientCache(q, k, v, out, lse.astype(q.dtype), keep, drop_scale, scale, g, block, opts,
                                     sinks, mask_grad)


def memory_efficient_attention_backward(dout, cache):
    """FlashAttention-2's backward: each block of weights recomputed from the saved ``lse``.

    ``P = exp(z - lse)`` exactly (``lse`` is the log of the softmax denominator), then the same
    chain rule as ``scaled_dot_product_attention_backward``, block by block, with the row sums
    ``D_i = sum_j dP_ij P_ij = dout_i . out_i`` (``out_i = sum_j P'_ij v_j`` and
    ``dP_ij = keep_ij/(1-p) dout_i . v_j``).  Returns ``(dq, dk, dv)``, then ``dmask``, then ``dsinks``.
    """
    q, k, v, out, lse, keep, drop_scale, scale, g, block, opts, sinks, mask_grad = cache
    kr, vr = np.repeat(k, g, axis=-3), np.repeat(v, g, axis=-3)
    d = (dout * out).sum(axis=-1, keepdims=True)  # (B..., Hq, Lq, 1)
    dq = np.zeros(dout.shape[:-1] + q.shape[-1:], dtype=q.dtype)
    dkr = np.zeros(dout.shape[:-2] + kr.shape[-2:], dtype=q.dtype)
    dvr = np.zeros(dout.shape[:-2] + vr.shape[-2:], dtype=q.dtype)
    dz_all = np.zeros(dout.shape[:-1] + (k.shape[-2],), dtype=q.dtype) if mask_grad else None
    for j0 in range(0, k.shape[-2], block):
        cols = slice(j0, min(j0 + block, k.shape[-2]))
        z, t = _scores(q, kr, scale, cols=cols, **opts)
        p = np.exp(z - lse)  # (B..., Hq, Lq, n): the forward's weights of these keys, recomputed
        pd = p if keep is None else p * keep[..., cols] * drop_scale
        dvr[..., cols, :] = pd.swapaxes(-1, -2) @ dout  # dv = P'^T dout
        dp = dout @ vr[..., cols, :].swapaxes(-1, -2)  # dP' = dout v^T
        if keep is not None:
            dp = dp * keep[..., cols] * drop_scale  # dP = dP' keep / (1 - p)
        dz = p * (dp - d)  # through the softmax
        if dz_all is not None:
            dz_all[..., cols] = dz
        ds = dz if t is None else dz * (1.0 - t * t)  # through softcap
        dq += scale * (ds @ kr[..., cols, :])
        dkr[..., cols, :] = scale * (ds.swapaxes(-1, -2) @ q)
    grads = [_sum_to(dq, q.shape), _unrepeat(dkr, k.shape, g), _unrepeat(dvr, v.shape, g)]
    if mask_grad:
        grads.append(_sum_to(dz_all, np.shape(opts["attn_mask"])))
    if sinks is not None:  # the sink's weight is exp(sink - lse); its dz is P_sink (0 - D)
        p_sink = np.exp(np.asarray(sinks, dtype=q.dtype)[:, None, None] - lse)
        grads.append(_sum_to(-p_sink * d, (len(sinks), 1, 1)).reshape(-1))
    return tuple(grads)

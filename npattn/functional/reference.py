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

Forward mode: each pair also has ``<op>_jvp(cache, *tangents)``, under its backward, deriving the
tangent of the output step by step along the forward.  Tangents come in the order the backward
returns gradients; ``None`` (or a trailing one left out) is zero.  When every tangent is None
and the cache does not record the output's shape (``rope``, ``dropout`` in eval mode), the
result is None.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Tuple, Union

import numpy as np

from .._docs import shared_doc
from ._blocks import AttentionOptions, gqa_groups, split_attention_tangents
from ._erf import erf
from ._random import draw_seed, keep_mask

Array = np.ndarray
RngLike = Union[np.random.Generator, int, None]  # a Generator, an int seed, or None


def _sum_to(x, shape):
    """Undo numpy broadcasting: sum ``x`` down to ``shape`` (the leading axes broadcasting added,
    and the axes that were 1).  The gradient of an input that was broadcast is this sum."""
    x = x.sum(axis=tuple(range(x.ndim - len(shape))))
    return x.sum(axis=tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1), keepdims=True)


def _padded(tangents, n):
    """The ``n`` tangents of a ``_jvp``, in the backward's order: the ones left out at the end are
    None (zero)."""
    return tuple(tangents) + (None,) * (n - len(tangents))


# == Attention ======================================================================================
# notebooks/01_self_attention.ipynb, section "Scaled dot-product attention" (the forward),
# notebooks/04_gradients_by_hand.ipynb, section "3. Attention: O = softmax(s QK^T + M) V" (the backward),
# notebooks/02_masks_and_dropout.ipynb (masks, fully masked rows, dropout),
# notebooks/03_multi_head_attention.ipynb, section "Grouped-query attention",
# notebooks/08_modern_attention.ipynb (the attention options: causal_align, window, ALiBi, softcap, sinks).
#
# The plain core is four lines: s = scale q k^T, P = softmax(s), P' = dropout(P), out = P' v.  Each
# option is one small step below, with its derivative beside it, and the core calls them in order:
#
#     s = _raw_scores          the scores                    ds -> dq, dk (a matrix product)
#     c = _softcap(s)          softcap                       dc/ds = 1 - tanh^2
#     visible = _band(...)     causal, causal_align, window  hides pairs: no derivative
#     z = c + _alibi(...)      ALiBi                         a constant: no derivative
#     z, visible = _mask(...)  bool / float attn_mask        dz/dM = 1 (mask_grad)
#     P = _softmax_with_sink   softmax, with the sink        the sink is one more logit
#     P' = _dropped(P)         dropout                       the same mask both ways
#     kr = _repeat_kv(k)       grouped-query heads           a copy: its gradient adds up
#
# The options are read by name from one ``AttentionOptions`` (``_blocks``, the fast tier's checked
# object too), held by the cache.


# -- the scores ------------------------------------------------------------------------------------------
def _raw_scores(q, kr, scale, cols=slice(None)):
    """``s = scale q kr^T`` for the keys ``cols``: ``q (B..., H, Lq, E)``, ``kr (B..., H, Lk, E)``
    -> ``(B..., H, Lq, n)`` (batch dims broadcast).  A matrix product: its gradient is
    ``dq = scale ds kr``, ``dkr = scale ds^T q``, its tangent ``ts = scale (tq kr^T + q tkr^T)``."""
    return scale * (q @ kr[..., cols, :].swapaxes(-1, -2))


def _score_tangent(q, kr, tq, tkr, scale, cols=slice(None)):
    """``ts = scale (tq kr^T + q tkr^T)`` (the product rule on ``_raw_scores``), or None when
    neither ``q`` nor ``k`` moves."""
    ts = None
    if tq is not None:
        ts = scale * (tq @ kr[..., cols, :].swapaxes(-1, -2))
    if tkr is not None:
        part = scale * (q @ tkr[..., cols, :].swapaxes(-1, -2))
        ts = part if ts is None else ts + part
    return ts


# -- option: softcap ---------------------------------------------------------------------------------
def _softcap(s, softcap):
    """Gemma 2's cap on the raw scores, before masks and biases: ``c = softcap tanh(s / softcap)``.
    Returns ``(c, T)`` with ``T = tanh(s / softcap)`` (kept: the derivatives need it), or
    ``(s, None)`` without softcap.

        dc/ds = softcap (1 / softcap) (1 - T^2) = 1 - T^2        (elementwise: its own transpose)
        d(1 - T^2) = -2 T dT = -2 T (1 - T^2) ds / softcap       (the second order's extra term)
    """
    if softcap is None:
        return s, None
    t = np.tanh(s / softcap)
    return softcap * t, t


# -- option: causal_align, is_causal, window ---------------------------------------------------------
def _positions(lq, lk, causal_align, cols=slice(None)):
    """Query ``i`` sits at position ``p = i`` (``"top_left"``) or ``i + Lk - Lq`` (``"bottom_right"``,
    KV-cache decoding), key ``j`` at ``j``: ``(p (Lq, 1), j (1, n))`` for the keys ``cols``.  The
    same positions serve causality, the window and ALiBi."""
    pos = np.arange(lq)[:, None] + (lk - lq if causal_align == "bottom_right" else 0)
    return pos, np.arange(lk)[None, cols]


def _band(pos, key, is_causal, window):
    """``(Lq, n)`` bool, the pairs the band leaves visible: causal ``j <= p``; the window
    ``p - left <= j <= p + right`` (``-1``: unbounded on that side).  A hidden pair's logit is
    ``-inf``, its weight ``P = 0``: it has no gradient and no tangent of its own (every derivative
    below is multiplied by ``P``)."""
    visible = np.ones((pos.shape[0], key.shape[1]), dtype=bool)
    if is_causal:
        visible &= key <= pos
    if window is not None:
        left, right = window
        if left >= 0:
            visible &= key >= pos - left
        if right >= 0:
            visible &= key <= pos + right
    return visible


# -- option: ALiBi -----------------------------------------------------------------------------------
def _alibi(slopes, pos, key, dtype):
    """``-slope_h |p - j|``, ``(B..., H, Lq, n)``: a bias of the positions only, so a constant of
    q, k, v: no gradient and no tangent (it moves ``P`` through the softmax, nothing else)."""
    slopes = np.asarray(slopes, dtype=dtype)[..., None, None]  # (B..., H, 1, 1)
    return -(slopes * np.abs(pos - key).astype(dtype))


# -- option: attn_mask (bool or float), mask_grad -----------------------------------------------------
def _mask(c, visible, attn_mask, cols=slice(None)):
    """A bool mask hides pairs (True = may attend): ``visible &= mask``, no derivative.  A float
    mask ``M`` is added, ``z = c + M``: ``dz/dM = 1``, so with ``mask_grad`` its gradient is
    ``dz`` summed to ``M``'s shape (``_sum_to``) and its tangent enters as ``tz += tM``.
    Returns ``(z, visible)``."""
    if attn_mask is None:
        return c, visible
    mask = np.asarray(_mask_cols(attn_mask, cols))
    if mask.dtype == bool:
        return c, visible & mask
    return c + mask.astype(c.dtype), visible


def _mask_grad_shape(attn_mask, opts):
    """The float mask's shape when its gradient is asked for (``mask_grad``), else None."""
    return np.shape(attn_mask) if opts.mask_grad and attn_mask is not None else None


def _logits(q, kr, scale, attn_mask, is_causal, opts, cols=slice(None)):
    """The logits the softmax sees, for the keys ``cols`` (all of them by default), each option one
    step: ``z = softcap(scale q k^T) + alibi + float mask``, ``-inf`` where the band or a bool mask
    hides the pair.  ``opts`` is the ``AttentionOptions``.  Returns ``(z (B..., H, Lq, n), T)``,
    ``T = tanh(s / softcap)`` (None without softcap)."""
    c, t = _softcap(_raw_scores(q, kr, scale, cols), opts.softcap)
    pos, key = _positions(q.shape[-2], kr.shape[-2], opts.causal_align, cols)
    visible = _band(pos, key, is_causal, opts.window)
    if opts.alibi_slopes is not None:
        c = c + _alibi(opts.alibi_slopes, pos, key, c.dtype)
    z, visible = _mask(c, visible, attn_mask, cols)
    return np.where(visible, z, -np.inf).astype(z.dtype), t


def _logit_tangent(ts, t, tmask):
    """The tangent of the logits ``z = softcap(s) + alibi + mask`` from ``ts``, the scores' tangent
    (``_score_tangent``), or None when nothing moves them:

        c = softcap tanh(s / softcap)  tc = (1 - T^2) ts
        z = c + alibi + mask           tz = tc + tmask        (ALiBi is a constant)

    ``-inf`` entries (hidden keys) get a finite tangent: their weight ``P`` is 0, and every use of
    ``tz`` is multiplied by ``P``.
    """
    if ts is not None and t is not None:  # -- option: softcap
        ts = ts * (1.0 - t * t)
    if tmask is not None:  # -- option: mask_grad, the float mask's own tangent
        ts = tmask if ts is None else ts + tmask
    return ts


# -- the softmax, option: sinks ------------------------------------------------------------------------
def _softmax_with_sink(z, sinks):
    """``P = softmax(z)`` over the keys, shifted by the row max; with ``sinks`` one more logit
    ``sink_h`` per head joins every row (a key of value 0).  Returns ``(P, P_sink)``
    (``P_sink (B..., H, Lq, 1)`` the weight the sink took, None without sinks).

    A row that may attend to no key has max ``-inf``: it is shifted by 0, all ``e = 0``, its
    total becomes 1, so ``P = 0`` and ``out = 0``, never NaN.  The sink is key "0" of an extended
    softmax: its gradient is the softmax's ``dz = P (dP - D)`` for that column with ``dP_sink = 0``
    (value 0), i.e. ``-P_sink D`` (``_sink_grad``); its tangent enters the softmax's mean.
    """
    m = z.max(axis=-1, keepdims=True, initial=-np.inf)  # (B..., H, Lq, 1)
    sink = None
    if sinks is not None:
        sink = np.asarray(sinks, dtype=z.dtype)[:, None, None]  # (H, 1, 1)
        m = np.maximum(m, sink)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(z - m)  # (B..., H, Lq, Lk)
    total = e.sum(axis=-1, keepdims=True)
    e_sink = None
    if sink is not None:
        e_sink = np.exp(sink - m)
        total = total + e_sink
    total = np.where(total == 0, 1.0, total)  # no key at all: P = 0, so out = 0
    return e / total, None if e_sink is None else e_sink / total


def _sink_grad(p_sink, d, sinks):
    """``dsink_h = sum over every row (and batch) of head h of P_sink (0 - D)``: the softmax's
    backward for the sink's column, whose value is 0 (``dP_sink = 0``)."""
    return _sum_to(-p_sink * d, (len(sinks), 1, 1)).reshape(-1)


# -- option: dropout -----------------------------------------------------------------------------------
def _dropout_keep(shape, dropout_p, rng):
    """The keep-mask ``rng.random(shape) >= p`` and the factor ``1 / (1 - p)`` (0 for ``p = 1``);
    ``(None, 1.0)`` without dropout."""
    if dropout_p <= 0.0:
        return None, 1.0
    keep = np.random.default_rng(rng).random(shape) >= dropout_p
    return keep, 0.0 if dropout_p == 1.0 else 1.0 / (1.0 - dropout_p)


def _dropped(a, keep, drop_scale):
    """``a * keep / (1 - p)``: inverted dropout with a fixed mask, linear and diagonal in ``a``, so
    the backward (``dP = dP' keep / (1 - p)``) and the tangent (``tP' = tP keep / (1 - p)``) apply
    the forward's own mask the same way."""
    return a if keep is None else a * keep * drop_scale


# -- option: grouped-query heads -----------------------------------------------------------------------
# Query head h reads kv head h // G, G = Hq / Hk counted by ``_blocks.gqa_groups`` (the one formula
# of every core).  The textbook tier repeats k and v explicitly (np.repeat) rather than folding the
# query heads beside their kv head (``_blocks.fold_heads``, the fast tier's no-copy view): after the
# repeat every head is plain attention, and the gradient of a copy, "add the copies back", is one
# reshape and sum (``_unrepeat``) that a reader can check against the forward by eye.
def _gqa_groups(q, k, v, enable_gqa):
    """G, the number of query heads per kv head: query head h uses kv head h // G (``Hq / Hk``
    with ``enable_gqa``, else 1; the one formula of every attention core, ``_blocks.gqa_groups``)."""
    return gqa_groups(q.shape, k.shape, v.shape, enable_gqa)


def _repeat_kv(k, v, groups):
    """k and v with each kv head repeated for the ``groups`` query heads that read it."""
    return (np.repeat(k, groups, axis=-3), np.repeat(v, groups, axis=-3)) if groups > 1 else (k, v)


def _repeated(a, groups):
    """``a`` (a kv tangent) with each head repeated for the ``groups`` query heads that read it."""
    return a if a is None or groups == 1 else np.repeat(a, groups, axis=-3)


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
    attn_mask: Optional[np.ndarray]  # as given
    options: AttentionOptions  # causal_align, window, alibi_slopes, softcap, sinks, mask_grad
    tanh: Optional[np.ndarray]  # softcap's tanh(s / softcap), or None
    p_sink: Optional[np.ndarray]  # (B..., Hq, Lq, 1) the weight the sink took, or None

    @property
    def weights(self) -> np.ndarray:
        """The attention weights ``P``, ``(B..., Hq, Lq, Lk)`` (before dropout; 0 where not visible)."""
        return self.p

    @property
    def mask_shape(self) -> Optional[tuple]:
        """The float mask's shape with ``mask_grad`` (the backward then returns ``dmask``), else None."""
        return _mask_grad_shape(self.attn_mask, self.options)


@shared_doc()
def scaled_dot_product_attention(
    q: Array,
    k: Array,
    v: Array,
    attn_mask: Optional[Array] = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    scale: Optional[float] = None,
    rng: RngLike = None,
    enable_gqa: bool = False,
    *,
    causal_align: str = "top_left",
    window: Optional[Tuple[int, int]] = None,
    alibi_slopes: Optional[Array] = None,
    softcap: Optional[float] = None,
    sinks: Optional[Array] = None,
    mask_grad: bool = False,
) -> Tuple[Array, AttentionCache]:
    """``out = dropout(softmax(scale q k^T + mask)) v``, the textbook formula with every option.

    ``q (B..., Hq, Lq, E)``, ``k (B..., Hk, Lk, E)``, ``v (B..., Hk, Lk, Ev)`` -> ``(B..., Hq, Lq, Ev)``.
    See ``npattn.functional.scaled_dot_product_attention`` for the meaning of each argument.

    <reference_examples>
    >>> q, k, v = (rng.standard_normal((2, 2, 5, 4)) for _ in range(3))
    >>> out, cache = R.scaled_dot_product_attention(q, k, v, is_causal=True, softcap=5.0)
    >>> fast_out, _ = F.scaled_dot_product_attention(q, k, v, is_causal=True, softcap=5.0)
    >>> bool(np.allclose(out, fast_out, rtol=0, atol=1e-12))
    True
    """
    opts = AttentionOptions(causal_align, window, alibi_slopes, softcap, sinks, mask_grad)
    g = _gqa_groups(q, k, v, enable_gqa)
    kr, vr = _repeat_kv(k, v, g)  # (B..., Hq, Lk, E): head h reads kv head h // G
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    z, t = _logits(q, kr, scale, attn_mask, is_causal, opts)  # (B..., Hq, Lq, Lk)
    p, p_sink = _softmax_with_sink(z, opts.sinks)
    keep, drop_scale = _dropout_keep(p.shape, dropout_p, rng)
    out = _dropped(p, keep, drop_scale) @ vr  # (B..., Hq, Lq, Ev)
    return out, AttentionCache(q, k, v, p, keep, drop_scale, scale, g, attn_mask, opts, t, p_sink)


def scaled_dot_product_attention_backward(dout: Array, cache: AttentionCache) -> Tuple[Array, ...]:
    """Backward of ``scaled_dot_product_attention``: ``(dq, dk, dv)``, then ``dmask`` (with
    ``mask_grad``), then ``dsinks`` (with ``sinks``).

    The forward computed, in order: ``s = scale q k^T``; ``z = softcap(s) + alibi + mask`` (``-inf``
    where hidden); ``P = softmax(z)`` over the keys (and the sink); ``P' = P * keep / (1 - p)``;
    ``out = P' v``.  The gradient walks back through the same steps, last first.
    (notebooks/04_gradients_by_hand.ipynb, section "3. Attention: O = softmax(s QK^T + M) V";
    the options in notebooks/08_modern_attention.ipynb.)
    """
    q, k, v, p, g, t, opts = cache.q, cache.k, cache.v, cache.p, cache.groups, cache.tanh, cache.options
    kr, vr = _repeat_kv(k, v, g)
    # out = P' vr, a matrix product:  dvr = P'^T dout  and  dP' = dout vr^T
    dvr = _dropped(p, cache.keep, cache.drop_scale).swapaxes(-1, -2) @ dout  # (B..., Hq, Lk, Ev)
    dpd = dout @ vr.swapaxes(-1, -2)  # (B..., Hq, Lq, Lk)
    # P' = P * keep / (1 - p) is elementwise in P:  dP = dP' * keep / (1 - p)
    dp = _dropped(dpd, cache.keep, cache.drop_scale)
    # P = softmax(z) along each row: dP_ij/dz_il = P_ij (delta_jl - P_il), so
    # dz = P * (dP - D) with D_i = sum_j dP_ij P_ij (a masked entry has P = 0: its dz is 0)
    d = (dp * p).sum(axis=-1, keepdims=True)  # (B..., Hq, Lq, 1)
    dz = p * (dp - d)
    # z = c + alibi + mask: the additive parts pass dz through unchanged
    # c = softcap tanh(s / softcap):  ds = dz (1 - tanh^2)
    ds = dz if t is None else dz * (1.0 - t * t)
    # s = scale q kr^T:  dq = scale ds kr  and  dkr = scale ds^T q
    dq = _sum_to(cache.scale * (ds @ kr), q.shape)
    dkr = cache.scale * (ds.swapaxes(-1, -2) @ q)
    # kr = repeat(k, G) broadcast against q's batch: sum back to k's own shape (same for v)
    grads = [dq, _unrepeat(dkr, k.shape, g), _unrepeat(dvr, v.shape, g)]
    if cache.mask_shape is not None:  # -- option: mask_grad, the mask was added to z, so dmask = dz
        grads.append(_sum_to(dz, cache.mask_shape))
    if opts.sinks is not None:  # -- option: sinks, one more logit of value 0 (_sink_grad)
        grads.append(_sink_grad(cache.p_sink, d, opts.sinks))
    return tuple(grads)


def scaled_dot_product_attention_jvp(cache: AttentionCache, *tangents: Optional[Array]) -> Array:
    """Forward mode of ``scaled_dot_product_attention``: the tangent of ``out`` when ``q, k, v``
    (and the float mask with ``mask_grad``, the sinks with ``sinks``) move along ``tq, tk, tv``
    (``tmask``, ``tsinks``), given in the backward's order; None is zero.

    The forward's steps, each with its tangent (``t`` for tangent), first to last:

        s = scale q k^T                 ts = scale (tq k^T + q tk^T)         (_score_tangent)
        z = softcap(s) + alibi + mask   tz = (1 - tanh^2) ts + tmask          (_logit_tangent)
        P = softmax(z, with the sink)   tP = P * (tz - mu),  mu_i = sum_j P_ij tz_ij + P_sink,i tsink
        P' = P * keep / (1 - p)         tP' = tP * keep / (1 - p)            (the same mask)
        out = P' v                      tout = tP' v + P' tv

    The softmax line is softmax's JVP, ``dP = P * (dS - rowsum(P * dS))``: with ``P_j = e^{z_j} / l``,
    ``l = sum_k e^{z_k} + e^{sink}``, ``tP_j = P_j tz_j - P_j (sum_k e^{z_k} tz_k + e^{sink} tsink) / l``.
    A hidden key (``-inf``, causal, window, bool mask) has ``P = 0``, so ``tP = 0``; a row that
    sees no key has ``P = 0`` everywhere and ``tout = 0``.  GQA: ``tk, tv`` are repeated as ``k, v``
    were.  (The backward is this map transposed.)
    """
    q, k, v, p, g = cache.q, cache.k, cache.v, cache.p, cache.groups
    has_mask_grad, has_sinks = cache.mask_shape is not None, cache.p_sink is not None
    tq, tk, tv, tmask, tsinks = split_attention_tangents(tangents, has_mask_grad, has_sinks)
    kr, vr = _repeat_kv(k, v, g)
    tkr, tvr = _repeated(tk, g), _repeated(tv, g)  # moved as k, v: repeated for GQA
    tout = np.zeros(p.shape[:-1] + v.shape[-1:], dtype=q.dtype)  # (B..., Hq, Lq, Ev)
    tz = _logit_tangent(_score_tangent(q, kr, tq, tkr, cache.scale), cache.tanh, tmask)
    if tz is not None or tsinks is not None:
        tp, _ = _softmax_tangent(p, cache.p_sink, tz, tsinks)
        tout = tout + _dropped(tp, cache.keep, cache.drop_scale) @ vr  # dropout: the same mask
    if tvr is not None:
        tout = tout + _dropped(p, cache.keep, cache.drop_scale) @ tvr
    return tout


def _softmax_tangent(p, p_sink, tz, tsinks):
    """The softmax's tangent with the sink, ``(tP, tP_sink)``: every logit of the row moves (the
    keys' by ``tz``, None for zero, the sink's by ``tsink_h``), and softmax's JVP gives

        tP = P * (tz - mu),   tP_sink = P_sink * (tsink - mu),   mu_i = sum_j P_ij tz_ij + P_sink,i tsink_h

    (``tP_sink`` None without sinks)."""
    mu = 0.0 if tz is None else (p * tz).sum(axis=-1, keepdims=True)  # (B..., H, Lq, 1)
    tsink = None if tsinks is None else np.asarray(tsinks)[:, None, None]
    if tsink is not None:  # -- option: sinks, the sink's logit moves by tsink_h
        mu = mu + p_sink * tsink
    tp = p * ((0.0 if tz is None else tz) - mu)
    tp_sink = None if p_sink is None else p_sink * ((0.0 if tsink is None else tsink) - mu)
    return tp, tp_sink


def scaled_dot_product_attention_backward_jvp(
    dout: Array, cache: AttentionCache, tangents, ddout: Optional[Array] = None
) -> Tuple[Tuple[Array, ...], Tuple[Array, ...]]:
    """Second order, forward over reverse: ``scaled_dot_product_attention_backward``'s gradients
    and their tangents when the inputs move along ``tangents = (tq, tk, tv[, tmask][, tsinks])``
    (``scaled_dot_product_attention_jvp``'s order; None or left out: zero) and ``dout`` along
    ``ddout`` (None: zero).  Returns ``(grads, grad_tangents)``, both in the backward's order.

    The forward's tangents first (``scaled_dot_product_attention_jvp``'s lines: ``ts``, ``tz``,
    ``tP`` and the sink's ``tP_sink``), then each line of the backward differentiated by the
    product rule, ``t`` for tangent, ``g = dout``:

        dv = P'^T g                  tdv = tP'^T g + P'^T tg
        dP' = g v^T                  tdP' = tg v^T + g tv^T
        dP = dP' keep / (1 - p)      tdP = tdP' keep / (1 - p)          (the forward's own mask)
        D = rowsum(dP P)             tD = rowsum(tdP P + dP tP)
        dz = P (dP - D)              tdz = tP (dP - D) + P (tdP - tD)    (softmax twice: softmax.md)
        ds = dz (1 - T^2)            tds = tdz (1 - T^2) - 2 dz T (1 - T^2) ts / softcap
        dq = scale ds k              tdq = scale (tds k + ds tk)
        dk = scale ds^T q            tdk = scale (tds^T q + ds^T tq)
        dmask = dz                   tdmask = tdz                        (summed to the mask's shape)
        dsink = -sum P_sink D        tdsink = -sum (tP_sink D + P_sink tD)

    GQA: ``k, v`` and their tangents repeated, the tangents of ``dk, dv`` summed back like the
    gradients (``_unrepeat`` and ``_sum_to`` are linear).  A hidden pair has ``P = 0``, hence
    ``tP = 0`` and every term above 0; a row that sees no key gives 0.  With ``tangents`` zero,
    ``grad_tangents`` is the backward of ``ddout``; with ``ddout`` zero, the Hessian of
    ``<dout, out>`` times the tangents.
    """
    q, k, v, p, g, t, opts = cache.q, cache.k, cache.v, cache.p, cache.groups, cache.tanh, cache.options
    keep, drop_scale, scale = cache.keep, cache.drop_scale, cache.scale
    has_mask_grad, has_sinks = cache.mask_shape is not None, opts.sinks is not None
    tq, tk, tv, tmask, tsinks = split_attention_tangents(tangents or (), has_mask_grad, has_sinks)
    grads = scaled_dot_product_attention_backward(dout, cache)
    kr, vr = _repeat_kv(k, v, g)
    tkr, tvr = _repeated(tk, g), _repeated(tv, g)
    tg = np.zeros_like(dout) if ddout is None else ddout
    # the forward's tangents: ts, tz, then tP (and the sink's) from the softmax's JVP
    ts = _score_tangent(q, kr, tq, tkr, scale)
    tp, tp_sink = _softmax_tangent(p, cache.p_sink, _logit_tangent(ts, t, tmask), tsinks)
    # dvr = P'^T g, a product of two moving factors
    tdvr = _dropped(tp, keep, drop_scale).swapaxes(-1, -2) @ dout + _dropped(p, keep, drop_scale).swapaxes(-1, -2) @ tg
    # dP' = g vr^T;  dP = dP' keep / (1 - p): the mask is a constant
    dp = _dropped(dout @ vr.swapaxes(-1, -2), keep, drop_scale)
    tdpd = tg @ vr.swapaxes(-1, -2)
    if tvr is not None:
        tdpd = tdpd + dout @ tvr.swapaxes(-1, -2)
    tdp = _dropped(tdpd, keep, drop_scale)
    # D = rowsum(dP P) and dz = P (dP - D): the softmax's backward, differentiated (softmax.md)
    d = (dp * p).sum(axis=-1, keepdims=True)
    td = (tdp * p + dp * tp).sum(axis=-1, keepdims=True)
    dz = p * (dp - d)
    tdz = tp * (dp - d) + p * (tdp - td)
    ds, tds = _softcap_backward_tangent(dz, tdz, t, ts, opts.softcap)
    # dq = scale ds kr, dkr = scale ds^T q: products of two moving factors
    tdq = scale * (tds @ kr)
    tdkr = scale * (tds.swapaxes(-1, -2) @ q)
    if tkr is not None:
        tdq = tdq + scale * (ds @ tkr)
    if tq is not None:
        tdkr = tdkr + scale * (ds.swapaxes(-1, -2) @ tq)
    grad_tangents = [_sum_to(tdq, q.shape), _unrepeat(tdkr, k.shape, g), _unrepeat(tdvr, v.shape, g)]
    if cache.mask_shape is not None:  # -- option: mask_grad, dmask = dz
        grad_tangents.append(_sum_to(tdz, cache.mask_shape))
    if opts.sinks is not None:  # -- option: sinks, dsink = -sum P_sink D
        grad_tangents.append(_sink_grad(tp_sink, d, opts.sinks) + _sink_grad(cache.p_sink, td, opts.sinks))
    return grads, tuple(grad_tangents)


def _softcap_backward_tangent(dz, tdz, t, ts, softcap):
    """``(ds, tds)``: the backward's line through softcap, ``ds = dz (1 - T^2)``, and its tangent.
    ``T = tanh(s / softcap)`` moves with ``s``: ``tT = (1 - T^2) ts / softcap``, so
    ``t(1 - T^2) = -2 T tT`` and

        tds = tdz (1 - T^2) - 2 dz T (1 - T^2) ts / softcap.

    Without softcap ``ds = dz`` and ``tds = tdz``; ``ts`` None: the scores do not move."""
    if t is None:
        return dz, tdz
    dcap = 1.0 - t * t
    ds, tds = dz * dcap, tdz * dcap
    if ts is not None:
        tds = tds - 2.0 * dz * t * dcap * ts / softcap
    return ds, tds


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
    attn_mask: Optional[np.ndarray]  # as given
    is_causal: bool
    options: AttentionOptions  # causal_align, window, alibi_slopes, softcap, sinks, mask_grad

    @property
    def mask_shape(self) -> Optional[tuple]:
        """The float mask's shape with ``mask_grad`` (the backward then returns ``dmask``), else None."""
        return _mask_grad_shape(self.attn_mask, self.options)

    def blocks(self) -> list:
        """The key blocks of the forward's loop (``_key_blocks``)."""
        return _key_blocks(self.k.shape[-2], self.block_size)

    def logits(self, kr, cols):
        """``(z, T)`` of the keys ``cols`` (``_logits`` with the forward's options)."""
        return _logits(self.q, kr, self.scale, self.attn_mask, self.is_causal, self.options, cols)


@shared_doc()
def memory_efficient_attention(
    q: Array,
    k: Array,
    v: Array,
    attn_mask: Optional[Array] = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    block_size: Optional[int] = None,
    *,
    dropout_p: float = 0.0,
    rng: RngLike = None,
    enable_gqa: bool = False,
    causal_align: str = "top_left",
    window: Optional[Tuple[int, int]] = None,
    alibi_slopes: Optional[Array] = None,
    softcap: Optional[float] = None,
    sinks: Optional[Array] = None,
    mask_grad: bool = False,
) -> Tuple[Array, MemoryEfficientCache]:
    """FlashAttention's forward as a textbook loop: the online softmax over blocks of keys.

    The same result as ``scaled_dot_product_attention``.  Walking the key blocks, each query row
    keeps a running max ``m``, a running sum ``l = sum exp(z - m)`` and an accumulator
    ``acc = sum exp(z - m) v``; when ``m`` grows, ``l`` and ``acc`` are rescaled by
    ``exp(m_old - m_new)``.  At the end ``out = acc / l``, and only ``lse = m + log l`` is kept.
    (notebooks/06_efficient_attention.ipynb, sections "The online softmax, one query row" and
    "All rows at once, in a dozen lines".)

    <reference_examples>
    >>> q, k, v = (rng.standard_normal((2, 2, 9, 4)) for _ in range(3))
    >>> out, cache = R.memory_efficient_attention(q, k, v, is_causal=True, block_size=4)
    >>> fast_out, _ = F.memory_efficient_attention(q, k, v, is_causal=True, block_size=4)
    >>> bool(np.allclose(out, fast_out, rtol=0, atol=1e-12))
    True
    """
    q = q.astype(np.result_type(q, k, v), copy=False)  # the running sums below take q's dtype: numpy's
    # promotion of q, k, v, as the plain formula's products give (not a check: the fast tier refuses mixed dtypes)
    opts = AttentionOptions(causal_align, window, alibi_slopes, softcap, sinks, mask_grad)
    g = _gqa_groups(q, k, v, enable_gqa)
    kr, vr = _repeat_kv(k, v, g)  # textbook: repeated (the fast tier does not copy)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    block = 64 if block_size is None else block_size
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
    for cols in _key_blocks(lk, block):
        z, _ = _logits(q, kr, scale, attn_mask, is_causal, opts, cols)  # (B..., Hq, Lq, n)
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
    return out, MemoryEfficientCache(
        q, k, v, out, lse.astype(q.dtype), keep, drop_scale, scale, g, block, attn_mask, is_causal, opts
    )


def _key_blocks(lk, block):
    """The key blocks of the online loops: ``slice(j0, j0 + block)`` for ``j0 = 0, block, ...``
    (the last one may be shorter)."""
    return [slice(j0, min(j0 + block, lk)) for j0 in range(0, lk, block)]


def memory_efficient_attention_backward(dout: Array, cache: MemoryEfficientCache) -> Tuple[Array, ...]:
    """FlashAttention-2's backward: each block of weights recomputed from the saved ``lse``.

    ``P = exp(z - lse)`` exactly (``lse`` is the log of the softmax denominator), then the same
    chain rule as ``scaled_dot_product_attention_backward``, block by block, with the row sums
    ``D_i = sum_j dP_ij P_ij = dout_i . out_i`` (``out_i = sum_j P'_ij v_j`` and
    ``dP_ij = keep_ij/(1-p) dout_i . v_j``).  Returns ``(dq, dk, dv)``, then ``dmask``, then ``dsinks``.
    (notebooks/06_efficient_attention.ipynb, section "What the backward keeps".)
    """
    q, k, v, lse, g, opts = cache.q, cache.k, cache.v, cache.lse, cache.groups, cache.options
    kr, vr = _repeat_kv(k, v, g)
    d = (dout * cache.out).sum(axis=-1, keepdims=True)  # (B..., Hq, Lq, 1)
    dq = np.zeros(dout.shape[:-1] + q.shape[-1:], dtype=q.dtype)
    dkr = np.zeros(dout.shape[:-2] + kr.shape[-2:], dtype=q.dtype)
    dvr = np.zeros(dout.shape[:-2] + vr.shape[-2:], dtype=q.dtype)
    dz_all = np.zeros(dout.shape[:-1] + (k.shape[-2],), dtype=q.dtype) if cache.mask_shape else None
    for cols in cache.blocks():
        z, t = cache.logits(kr, cols)
        p = np.exp(z - lse)  # (B..., Hq, Lq, n): the forward's weights of these keys, recomputed
        keep = None if cache.keep is None else cache.keep[..., cols]
        dvr[..., cols, :] = _dropped(p, keep, cache.drop_scale).swapaxes(-1, -2) @ dout  # dv = P'^T dout
        dp = _dropped(dout @ vr[..., cols, :].swapaxes(-1, -2), keep, cache.drop_scale)  # dP = (dout v^T) keep / (1-p)
        dz = p * (dp - d)  # through the softmax
        if dz_all is not None:
            dz_all[..., cols] = dz
        ds = dz if t is None else dz * (1.0 - t * t)  # through softcap
        dq += cache.scale * (ds @ kr[..., cols, :])
        dkr[..., cols, :] = cache.scale * (ds.swapaxes(-1, -2) @ q)
    grads = [_sum_to(dq, q.shape), _unrepeat(dkr, k.shape, g), _unrepeat(dvr, v.shape, g)]
    if dz_all is not None:
        grads.append(_sum_to(dz_all, cache.mask_shape))
    if opts.sinks is not None:  # the sink's weight is exp(sink - lse); its dz is P_sink (0 - D)
        grads.append(_sink_grad(_sink_weight(opts.sinks, lse), d, opts.sinks))
    return tuple(grads)


def _sink_weight(sinks, lse):
    """``P_sink = exp(sink_h - lse)``, the weight each row gave its sink, ``(B..., H, Lq, 1)``."""
    return np.exp(np.asarray(sinks, dtype=lse.dtype)[:, None, None] - lse)


def memory_efficient_attention_jvp(cache: MemoryEfficientCache, *tangents: Optional[Array]) -> Array:
    """Forward mode of ``memory_efficient_attention``, as an online loop over key blocks that
    mirrors the forward's (the tangents as in ``scaled_dot_product_attention_jvp``).

    Fix one query row.  With the running max ``m``, ``e_j = exp(z_j - m)``, ``l = sum_j e_j`` (plus
    the sink's ``exp(sink - m)``) and ``o = sum_j e_j keep_j v_j / l / (1 - p)``: ``e_j / l = P_j``, so

        to = sum_j P'_j (tz_j v_j + tv_j) - o mu,   mu = sum_j P_j tz_j + P_sink tsink
           = [sum_j e_j keep_j (tz_j v_j + tv_j) / (1 - p)  -  o (sum_j e_j tz_j + e_sink tsink)] / l.

    Both sums in brackets are over the keys, taken relative to ``m`` like ``l`` and ``acc``: walking
    the key blocks, ``tacc`` (width ``Ev``) and ``tl`` (one number) are rescaled by
    ``alpha = exp(m - m')`` whenever the max grows, exactly as ``acc`` and ``l``:

        tacc' = alpha tacc + (e_B keep_B tz_B) v_B + (e_B keep_B) tv_B,   tl' = alpha tl + rowsum(e_B tz_B),

    and at the end ``to = (tacc / (1 - p) - o tl) / l``.  Nothing of size ``(Lq, Lk)`` is needed.
    (The fast tier starts from the forward's ``lse`` instead, so its blocks need no rescaling;
    the numbers are the same.)
    """
    return _online_tangent(cache, tangents)[0]


def _online_tangent(cache: MemoryEfficientCache, tangents):
    """``(tout, mu)``: ``memory_efficient_attention_jvp``'s online loop, and the softmax's mean
    ``mu = tl / l`` of every row (``(B..., Hq, Lq, 1)``, what the tangent of a recomputed block
    of weights needs: ``tP = P (tz - mu)``)."""
    q, k, v, out, keep, g = cache.q, cache.k, cache.v, cache.out, cache.keep, cache.groups
    sinks = cache.options.sinks
    tq, tk, tv, tmask, tsinks = split_attention_tangents(tangents, cache.mask_shape is not None, sinks is not None)
    kr, vr = _repeat_kv(k, v, g)
    tkr, tvr = _repeated(tk, g), _repeated(tv, g)  # moved as k, v: repeated for GQA
    rows = out.shape[:-1] + (1,)  # (B..., Hq, Lq, 1)
    m = np.full(rows, -np.inf, dtype=q.dtype)  # the forward's running max, recomputed
    total = np.zeros(rows, dtype=q.dtype)  # l
    tacc = np.zeros(out.shape, dtype=q.dtype)  # sum e keep (tz v + tv), relative to m
    tl = np.zeros(rows, dtype=q.dtype)  # sum e tz, relative to m
    if sinks is not None:  # the sink starts the row: m = sink, l = 1, and its logit's tangent
        m = np.broadcast_to(np.asarray(sinks, dtype=q.dtype)[:, None, None], rows)
        total = np.ones(rows, dtype=q.dtype)
        if tsinks is not None:
            tl = tl + np.asarray(tsinks, dtype=q.dtype)[:, None, None]  # e_sink tsink with e_sink = 1
    for cols in cache.blocks():
        z, t = cache.logits(kr, cols)  # (B..., Hq, Lq, n)
        m_new = np.maximum(m, z.max(axis=-1, keepdims=True, initial=-np.inf))
        m_use = np.where(np.isfinite(m_new), m_new, 0.0)
        alpha = np.exp(m - m_use)
        e = np.exp(z - m_use)
        total = alpha * total + e.sum(axis=-1, keepdims=True)
        ed = e if keep is None else e * keep[..., cols]
        tz = _logit_tangent(_score_tangent(q, kr, tq, tkr, cache.scale, cols), t, _mask_cols(tmask, cols))
        tacc = alpha * tacc
        tl = alpha * tl
        if tz is not None:
            tacc = tacc + (ed * tz) @ vr[..., cols, :]
            tl = tl + (e * tz).sum(axis=-1, keepdims=True)
        if tvr is not None:
            tacc = tacc + ed @ tvr[..., cols, :]
        m = m_new
    seen = total > 0  # a row that saw no key (and has no sink): out 0, tangent 0
    tout = (tacc * cache.drop_scale - out * tl) / np.where(seen, total, 1.0)
    mu = np.where(seen, tl / np.where(seen, total, 1.0), 0.0)
    return np.where(seen, tout, 0.0).astype(q.dtype), mu


def memory_efficient_attention_backward_jvp(
    dout: Array, cache: MemoryEfficientCache, tangents, ddout: Optional[Array] = None
) -> Tuple[Tuple[Array, ...], Tuple[Array, ...]]:
    """Second order of ``memory_efficient_attention``, block by block: the backward's gradients
    and their tangents (arguments and lines as ``scaled_dot_product_attention_backward_jvp``).

    Nothing of size ``(Lq, Lk)``: each block of weights is recomputed as the backward does,
    ``P = exp(z - lse)``, and its tangent ``tP = P (tz - mu)`` needs one number per row, the
    softmax's mean ``mu = sum_j P_j tz_j + P_sink tsink``: the JVP's online loop gives it, and
    the output's tangent ``tout``, first (``_online_tangent``).  The backward's row sums
    ``D = dout . out`` move as a product,

        tD = ddout . out + dout . tout,

    (``D_i = sum_j dP_ij P_ij`` exactly, so this is the plain core's ``rowsum(tdP P + dP tP)``),
    and every other line is the plain core's, on one block of keys at a time.
    """
    q, k, v, out, lse, g, opts = cache.q, cache.k, cache.v, cache.out, cache.lse, cache.groups, cache.options
    drop_scale, scale = cache.drop_scale, cache.scale
    tangents = tangents or ()
    tq, tk, tv, tmask, tsinks = split_attention_tangents(tangents, cache.mask_shape is not None, opts.sinks is not None)
    grads = memory_efficient_attention_backward(dout, cache)
    tout, mu = _online_tangent(cache, tangents)  # (B..., Hq, Lq, Ev), (B..., Hq, Lq, 1)
    kr, vr = _repeat_kv(k, v, g)
    tkr, tvr = _repeated(tk, g), _repeated(tv, g)
    tg = np.zeros_like(dout) if ddout is None else ddout
    d = (dout * out).sum(axis=-1, keepdims=True)  # D = dout . out
    td = (tg * out + dout * tout).sum(axis=-1, keepdims=True)  # its tangent
    tdq = np.zeros(dout.shape[:-1] + q.shape[-1:], dtype=q.dtype)
    tdkr = np.zeros(dout.shape[:-2] + kr.shape[-2:], dtype=q.dtype)
    tdvr = np.zeros(dout.shape[:-2] + vr.shape[-2:], dtype=q.dtype)
    tdz_all = np.zeros(dout.shape[:-1] + (k.shape[-2],), dtype=q.dtype) if cache.mask_shape else None
    for cols in cache.blocks():
        z, t = cache.logits(kr, cols)
        p = np.exp(z - lse)  # the forward's weights of these keys, recomputed
        ts = _score_tangent(q, kr, tq, tkr, scale, cols)
        tz = _logit_tangent(ts, t, _mask_cols(tmask, cols))
        tp = p * ((0.0 if tz is None else tz) - mu)  # tP = P (tz - mu), mu from the online loop
        keep = None if cache.keep is None else cache.keep[..., cols]
        vc, tvc = vr[..., cols, :], None if tvr is None else tvr[..., cols, :]
        # dv = P'^T g;  dP = (g v^T) keep / (1 - p);  D, dz: each with its tangent
        tdvr[..., cols, :] = (
            _dropped(tp, keep, drop_scale).swapaxes(-1, -2) @ dout + _dropped(p, keep, drop_scale).swapaxes(-1, -2) @ tg
        )
        dp = _dropped(dout @ vc.swapaxes(-1, -2), keep, drop_scale)
        tdpd = tg @ vc.swapaxes(-1, -2)
        if tvc is not None:
            tdpd = tdpd + dout @ tvc.swapaxes(-1, -2)
        tdp = _dropped(tdpd, keep, drop_scale)
        dz = p * (dp - d)
        tdz = tp * (dp - d) + p * (tdp - td)
        if tdz_all is not None:
            tdz_all[..., cols] = tdz
        ds, tds = _softcap_backward_tangent(dz, tdz, t, ts, opts.softcap)
        tdq += scale * (tds @ kr[..., cols, :])
        tdkr[..., cols, :] = scale * (tds.swapaxes(-1, -2) @ q)
        if tkr is not None:
            tdq += scale * (ds @ tkr[..., cols, :])
        if tq is not None:
            tdkr[..., cols, :] += scale * (ds.swapaxes(-1, -2) @ tq)
    grad_tangents = [_sum_to(tdq, q.shape), _unrepeat(tdkr, k.shape, g), _unrepeat(tdvr, v.shape, g)]
    if tdz_all is not None:
        grad_tangents.append(_sum_to(tdz_all, cache.mask_shape))
    if opts.sinks is not None:  # P_sink = exp(sink - lse) moves as the softmax's: tP_sink = P_sink (tsink - mu)
        p_sink = _sink_weight(opts.sinks, lse)
        tsink = 0.0 if tsinks is None else np.asarray(tsinks)[:, None, None]
        tp_sink = p_sink * (tsink - mu)
        grad_tangents.append(_sink_grad(tp_sink, d, opts.sinks) + _sink_grad(p_sink, td, opts.sinks))
    return grads, tuple(grad_tangents)


def _mask_cols(tmask, cols):
    """The keys ``cols`` of a mask or its tangent (all of it when it is broadcast over the keys)."""
    if tmask is None or np.ndim(tmask) == 0 or np.shape(tmask)[-1] == 1:
        return tmask
    return np.asarray(tmask)[..., cols]


# == Linear and embedding ===========================================================================


@shared_doc()
def linear(x: Array, weight: Array, bias: Optional[Array] = None) -> Tuple[Array, tuple]:
    """``y = x W^T + b``: ``x (B..., in)``, ``W (out, in)``, ``b (out,)`` -> ``y (B..., out)``.

    <reference_examples>
    >>> x, w, b = rng.standard_normal((2, 5, 4)), rng.standard_normal((3, 4)), rng.standard_normal(3)
    >>> out, cache = R.linear(x, w, b)
    >>> fast_out, _ = F.linear(x, w, b)
    >>> bool(np.allclose(out, fast_out, rtol=0, atol=1e-12))
    True
    """
    y = x @ weight.T
    if bias is not None:
        y = y + bias
    return y, (x, weight, bias is not None)


def linear_backward(dout: Array, cache: tuple) -> Tuple[Array, Array, Optional[Array]]:
    """(notebooks/04_gradients_by_hand.ipynb, section "1. Linear: y = xW^T + b".)
    ``y_bo = sum_i x_bi W_oi + b_o``, so ``dx_bi = sum_o dy_bo W_oi``, ``dW_oi = sum_b dy_bo x_bi``
    and ``db_o = sum_b dy_bo``, ``b`` running over every leading (batch) index."""
    x, weight, has_bias = cache
    dx = dout @ weight  # (B..., in)
    n = math.prod(x.shape[:-1])  # every leading (batch) index as one row index
    dy, x = dout.reshape(n, weight.shape[0]), x.reshape(n, weight.shape[1])  # (N, out), (N, in)
    dweight = dy.T @ x  # (out, in)
    dbias = dy.sum(axis=0) if has_bias else None  # (out,)
    return dx, dweight, dbias


def linear_jvp(cache: tuple, *tangents: Optional[Array]) -> Array:
    """Forward mode: the tangent of ``y`` when ``(x, W, b)`` move along ``(tx, tW, tb)`` (None: not at all).

    ``y = x W^T + b`` is a product of ``x`` and ``W`` plus ``b``; the product rule gives
    ``ty = tx W^T + x tW^T + tb``."""
    tx, tweight, tbias = _padded(tangents, 3)
    x, weight, _ = cache
    ty = np.zeros(x.shape[:-1] + (weight.shape[0],), dtype=x.dtype)  # (B..., out)
    if tx is not None:
        ty = ty + tx @ weight.T  # x moves, W fixed
    if tweight is not None:
        ty = ty + x @ tweight.T  # W moves, x fixed
    if tbias is not None:
        ty = ty + tbias
    return ty


def linear_backward_jvp(dout: Array, cache: tuple, tangents, ddout: Optional[Array] = None):
    """Second order, forward over reverse: ``linear_backward``'s gradients and their tangents
    when ``(x, W, b)`` move along ``tangents = (tx, tW, tb)`` and ``dout`` along ``ddout`` (None:
    not at all).  Differentiate each line of the backward (the product rule; the backward does
    not read ``b``, so ``tb`` does not enter)::

        dx = dy W                 tdx = ddy W + dy tW
        dW = dy^T x               tdW = ddy^T x + dy^T tx
        db = sum_b dy             tdb = sum_b ddy

    Returns ``((dx, dW, db), (tdx, tdW, tdb))``, None for the bias without one."""
    tx, tweight, _ = _padded(tangents, 3)
    x, weight, has_bias = cache
    grads = linear_backward(dout, cache)
    ddy = np.zeros_like(dout) if ddout is None else ddout
    tdx = ddy @ weight  # dy moves, W fixed
    if tweight is not None:
        tdx = tdx + dout @ tweight  # W moves, dy fixed
    n = math.prod(x.shape[:-1])
    dy, ddy, x = dout.reshape(n, weight.shape[0]), ddy.reshape(n, weight.shape[0]), x.reshape(n, weight.shape[1])
    tdweight = ddy.T @ x  # dy moves, x fixed
    if tx is not None:
        tdweight = tdweight + dy.T @ tx.reshape(n, weight.shape[1])  # x moves, dy fixed
    tdbias = ddy.sum(axis=0) if has_bias else None
    return grads, (tdx, tdweight, tdbias)


@shared_doc()
def embedding(
    ids: Array,
    weight: Array,
    padding_idx: Optional[int] = None,
    max_norm: Optional[float] = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
) -> Tuple[Array, tuple]:
    """Row lookup ``out[...] = weight[ids[...]]``: ``ids`` integers of any shape, ``weight (num, D)``.

    With ``max_norm`` a looked-up row whose ``norm_type``-norm exceeds it is scaled by
    ``max_norm / (norm + 1e-7)`` in the output (as torch; the given ``weight`` is not modified).

    <reference_examples>
    >>> W = rng.standard_normal((10, 4))
    >>> out, cache = R.embedding(np.array([[1, 7, 1]]), W)
    >>> fast_out, _ = F.embedding(np.array([[1, 7, 1]]), W)
    >>> bool(np.allclose(out, fast_out, rtol=0, atol=1e-12))
    True
    """
    rows = weight[ids]  # (ids..., D)
    if max_norm is not None:
        norm = np.linalg.norm(rows, ord=norm_type, axis=-1, keepdims=True)
        rows = np.where(norm > max_norm, rows * (max_norm / (norm + 1e-7)), rows)
    if padding_idx is not None and padding_idx < 0:
        padding_idx += weight.shape[0]
    return rows, (ids, weight.shape, padding_idx, scale_grad_by_freq)


def embedding_backward(dout: Array, cache: tuple) -> Array:
    """A lookup copies rows, so its gradient adds them back: ``dW[r] = sum of dy where ids == r``.

    As torch: the ``max_norm`` rescaling is treated as a change of the weight made before the
    lookup (no gradient flows through it), the ``padding_idx`` row gets no gradient, and with
    ``scale_grad_by_freq`` each row's gradient is divided by how often its id occurs in ``ids``.
    (notebooks/05_encoder_block_and_training.ipynb, section "Training a small transformer on a toy task".)
    """
    ids, wshape, padding_idx, scale_grad_by_freq = cache
    ids, dy = ids.reshape(-1), dout.reshape(-1, wshape[1])  # (N,), (N, D)
    if scale_grad_by_freq:
        dy = dy / np.bincount(ids, minlength=wshape[0])[ids][:, None]
    dweight = np.zeros(wshape, dtype=dout.dtype)
    np.add.at(dweight, ids, dy)  # scatter-add: an id seen twice collects both gradients
    if padding_idx is not None:
        dweight[padding_idx] = 0.0
    return dweight


def embedding_jvp(cache: tuple, *tangents: Optional[Array]) -> Array:
    """The lookup is linear in ``W``: moving ``W`` along ``tW`` moves each looked-up row along the
    same row of ``tW``, so ``tout = tW[ids]``.  (``padding_idx`` and ``scale_grad_by_freq`` change
    only torch's backward, not the derivative; ``max_norm``'s rescaling is not differentiated,
    as in the backward and in torch.)  ``ids`` are integers: no tangent."""
    (tweight,) = _padded(tangents, 1)
    ids, wshape, _, _ = cache
    return np.zeros(ids.shape + (wshape[1],)) if tweight is None else tweight[ids]


def embedding_backward_jvp(dout: Array, cache: tuple, tangents, ddout: Optional[Array] = None):
    """Second order: the backward scatter-adds ``dy`` (divided by the counts with
    ``scale_grad_by_freq``, the ``padding_idx`` row zeroed) and never reads ``W``: it is linear
    in ``dy`` and constant in ``W``.  So ``tdW = embedding_backward(ddy)`` and ``tangents = (tW,)``
    does not enter.  Returns ``(dW, tdW)``."""
    _, wshape, _, _ = cache
    grads = embedding_backward(dout, cache)
    return grads, (np.zeros(wshape, dtype=dout.dtype) if ddout is None else embedding_backward(ddout, cache))


# == Nonlinearities =================================================================================


@shared_doc()
def softmax(x: Array, axis: int = -1) -> Tuple[Array, tuple]:
    """``y = exp(x - max) / sum(exp(x - max))`` along ``axis``; an all ``-inf`` slice gives 0, a 0-d x gives 1.
    (notebooks/01_self_attention.ipynb, section "Softmax: scores to weights".)

    <reference_examples>
    >>> x = rng.standard_normal((3, 6))
    >>> out, cache = R.softmax(x)
    >>> fast_out, _ = F.softmax(x)
    >>> bool(np.allclose(out, fast_out, rtol=0, atol=1e-12))
    True
    """
    y = np.reshape(x, np.shape(x) or (1,))  # a 0-d input is a softmax over one value
    m = y.max(axis=axis, keepdims=True, initial=-np.inf)
    e = np.exp(y - np.where(np.isfinite(m), m, 0.0))  # shifted: no overflow; all -inf: e = 0
    total = e.sum(axis=axis, keepdims=True)
    y = e / np.where(total == 0, 1.0, total)
    return y.reshape(np.shape(x)), (y, axis)


def softmax_backward(dout: Array, cache: tuple) -> Array:
    """(notebooks/04_gradients_by_hand.ipynb, section "2. Softmax".)  ``y_i = e^{x_i} / sum_k e^{x_k}``
    has Jacobian ``dy_i/dx_j = y_i (delta_ij - y_j)``, so ``dx_j = y_j (dy_j - sum_i dy_i y_i)``."""
    y, axis = cache
    dy = dout.reshape(y.shape)
    return (y * (dy - (dy * y).sum(axis=axis, keepdims=True))).reshape(np.shape(dout))


def softmax_jvp(cache: tuple, *tangents: Optional[Array]) -> Array:
    """With ``dy_i/dx_j = y_i (delta_ij - y_j)``, the tangent is
    ``ty_i = sum_j y_i (delta_ij - y_j) tx_j = y_i (tx_i - sum_j y_j tx_j)``:
    ``dP = P * (dS - rowsum(P * dS))`` in attention's names.  (The Jacobian is symmetric: the
    backward's formula with ``tx`` for ``dout``.)"""
    (tx,) = _padded(tangents, 1)
    y, axis = cache
    if tx is None:
        return np.zeros_like(y)
    t = np.reshape(tx, y.shape)
    return (y * (t - (y * t).sum(axis=axis, keepdims=True))).reshape(np.shape(tx))


def softmax_backward_jvp(dout: Array, cache: tuple, tangents, ddout: Optional[Array] = None):
    """Second order, the chain of softmax twice: the tangent of ``dx`` when ``x`` moves along
    ``tangents = (tx,)`` and ``dy`` along ``ddout``.  Differentiate each line of the backward::

        y = softmax(x)            ty = y (tx - sum(y tx))               (softmax_jvp)
        s = sum(dy y)             ts = sum(ddy y) + sum(dy ty)
        dx = y (dy - s)           tdx = ty (dy - s) + y (ddy - ts)

    (sums along the axis).  Written out, ``tdx = y (ddy - sum(ddy y)) + ty (dy - sum(dy y)) -
    y sum(dy ty)``: the backward of ``ddy``, plus the Hessian of ``<dy, softmax(x)>`` times ``tx``."""
    (tx,) = _padded(tangents, 1)
    y, axis = cache
    grads = softmax_backward(dout, cache)
    dy = np.reshape(dout, y.shape)  # a 0-d input was kept as one value
    ddy = np.zeros_like(y) if ddout is None else np.reshape(ddout, y.shape)
    ty = np.zeros_like(y) if tx is None else np.reshape(softmax_jvp(cache, tx), y.shape)
    s = (dy * y).sum(axis=axis, keepdims=True)
    ts = (ddy * y).sum(axis=axis, keepdims=True) + (dy * ty).sum(axis=axis, keepdims=True)
    tdx = ty * (dy - s) + y * (ddy - ts)
    return grads, tdx.reshape(np.shape(dout))


@shared_doc()
def relu(x: Array) -> Tuple[Array, Array]:
    """``y = max(x, 0)``.

    <reference_examples>
    >>> x = rng.standard_normal((3, 6))
    >>> out, cache = R.relu(x)
    >>> fast_out, _ = F.relu(x)
    >>> bool(np.allclose(out, fast_out, rtol=0, atol=1e-12))
    True
    """
    return np.maximum(x, 0), x


def relu_backward(dout: Array, cache: Array) -> Array:
    """``dy/dx`` is 1 where ``x > 0`` and 0 elsewhere (0 at ``x = 0``, as torch).
    (notebooks/05_encoder_block_and_training.ipynb, section "The feed-forward network".)"""
    return dout * (cache > 0)


def relu_jvp(cache: Array, *tangents: Optional[Array]) -> Array:
    """Elementwise: ``ty = [x > 0] tx`` (the derivative 0 at ``x = 0``, as the backward)."""
    (tx,) = _padded(tangents, 1)
    return np.zeros(np.shape(cache), np.asarray(cache).dtype) if tx is None else tx * (cache > 0)


def relu_backward_jvp(dout: Array, cache: Array, tangents, ddout: Optional[Array] = None):
    """Second order: ``dx = dy [x > 0]``; the mask is piecewise constant in ``x`` (derivative 0
    away from ``x = 0``), so ``tdx = ddy [x > 0]`` and ``tangents = (tx,)`` does not enter."""
    grads = relu_backward(dout, cache)
    return grads, (np.zeros_like(grads) if ddout is None else relu_backward(ddout, cache))


@shared_doc()
def relu2(x: Array) -> Tuple[Array, Array]:
    """Squared ReLU: ``y = max(x, 0)^2`` (Nemotron-H's MLP activation).

    <reference_examples>
    >>> x = rng.standard_normal((3, 6))
    >>> out, cache = R.relu2(x)
    >>> fast_out, _ = F.relu2(x)
    >>> bool(np.allclose(out, fast_out, rtol=0, atol=1e-12))
    True
    """
    r = np.maximum(x, 0)
    return r * r, x


def relu2_backward(dout: Array, cache: Array) -> Array:
    """``dy/dx = 2 max(x, 0)``: continuous, 0 at and below ``x = 0``."""
    return dout * (2 * np.maximum(cache, 0))


def relu2_jvp(cache: Array, *tangents: Optional[Array]) -> Array:
    """Elementwise: ``ty = 2 max(x, 0) tx``."""
    (tx,) = _padded(tangents, 1)
    return np.zeros(np.shape(cache), np.asarray(cache).dtype) if tx is None else relu2_backward(tx, cache)


def relu2_backward_jvp(dout: Array, cache: Array, tangents, ddout: Optional[Array] = None):
    """Second order: ``dx = 2 max(x, 0) dy``, so ``tdx = 2 max(x, 0) ddy + 2 [x > 0] dy tx``
    (the derivative of ``2 max(x, 0)`` is ``2 [x > 0]``, taken 0 at ``x = 0`` as relu's)."""
    (tx,) = _padded(tangents, 1)
    grads = relu2_backward(dout, cache)
    tdx = np.zeros_like(grads) if ddout is None else relu2_backward(ddout, cache)
    if tx is not None:
        tdx = tdx + 2 * dout * (cache > 0) * tx
    return grads, tdx


@shared_doc()
def clamp(x: Array, min: Optional[float] = None, max: Optional[float] = None) -> Tuple[Array, tuple]:
    """``y = min(max(x, min), max)`` (torch's ``clamp``; OLMo's ``clip_qkv``): each entry held
    inside ``[min, max]`` (a bound None: none on that side).

    <reference_examples>
    >>> x = rng.standard_normal((3, 6))
    >>> out, cache = R.clamp(x, -0.5, 0.5)
    >>> fast_out, _ = F.clamp(x, -0.5, 0.5)
    >>> bool(np.allclose(out, fast_out, rtol=0, atol=1e-12))
    True
    """
    lo = -np.inf if min is None else min
    hi = np.inf if max is None else max
    y = np.minimum(np.maximum(x, lo), hi)  # the lower bound first, then the upper one (torch's order)
    return y, (x, lo, hi)


def clamp_backward(dout: Array, cache: tuple) -> Array:
    """Piece by piece: ``y = lo`` below the range and ``hi`` above it (constants: ``dy/dx = 0``),
    ``y = x`` inside it (``dy/dx = 1``).  At a bound the two pieces meet and the slope has no one
    value; torch takes 1 there (its mask is ``lo <= x <= hi``), and so does this:
    ``dx = dy [lo <= x <= hi]``.  A NaN ``x`` compares False: gradient 0, as torch's."""
    x, lo, hi = cache
    return dout * ((x >= lo) & (x <= hi))


def clamp_jvp(cache: tuple, *tangents: Optional[Array]) -> Array:
    """Elementwise: ``ty = [lo <= x <= hi] tx`` (the same mask as the backward: the Jacobian is
    diagonal, so ``J tx = J^T tx``)."""
    (tx,) = _padded(tangents, 1)
    x = cache[0]
    return np.zeros(np.shape(x), np.asarray(x).dtype) if tx is None else clamp_backward(tx, cache)


def clamp_backward_jvp(dout: Array, cache: tuple, tangents, ddout: Optional[Array] = None):
    """Second order: ``dx = dy [lo <= x <= hi]``; the mask is piecewise constant in ``x``
    (derivative 0 away from the bounds), so ``tdx = ddy [lo <= x <= hi]`` and ``tangents =
    (tx,)`` does not enter."""
    grads = clamp_backward(dout, cache)
    return grads, (np.zeros_like(grads) if ddout is None else clamp_backward(ddout, cache))


def _softplus(a):
    """``log(1 + exp(a))``, computed as ``logaddexp(0, a)`` (no overflow for large ``a``)."""
    return np.logaddexp(0, a)


def _sigmoid(a):
    """``1 / (1 + exp(-a))``, the derivative of softplus (and ``sigmoid' = sigmoid (1 - sigmoid)``)."""
    return 1 / (1 + np.exp(-a))


@shared_doc()
def xielu(x: Array, alpha_p, alpha_n, beta: float = 0.5, eps: float = -1e-6) -> Tuple[Array, tuple]:
    """xIELU (Huang and Schlag, arXiv:2411.13010), Apertus's MLP activation, as transformers'
    ``XIELUActivation`` computes it.  Its two trained parameters are stored raw (the checkpoint's
    ``act_fn.alpha_p``, ``act_fn.alpha_n``, one number each) and made positive by softplus; ``beta``
    and ``eps`` are buffers (saved, not trained)::

        a_p = softplus(alpha_p)                 > 0: the positive branch's curvature
        a_n = beta + softplus(alpha_n)          > beta: the negative branch's scale
        m   = min(x, eps)                       expm1 follows x only below eps (eps ~ -1e-6)
        y   = a_p x^2 + beta x                  where x > 0   (a parabola through 0 of slope beta)
        y   = a_n (expm1(m) - x) + beta x       where x <= 0  (slope beta - a_n + a_n e^x: -> beta - a_n)

    <reference_examples>
    >>> x = rng.standard_normal((3, 6))
    >>> out, cache = R.xielu(x, np.array([0.3]), np.array([-0.2]), 0.4, -0.1)
    >>> fast_out, _ = F.xielu(x, np.array([0.3]), np.array([-0.2]), 0.4, -0.1)
    >>> bool(np.allclose(out, fast_out, rtol=0, atol=1e-12))
    True
    """
    a_p = _softplus(alpha_p)
    a_n = beta + _softplus(alpha_n)
    m = np.minimum(x, eps)
    y = np.where(x > 0, a_p * x * x + beta * x, a_n * (np.expm1(m) - x) + beta * x)
    return y, (x, alpha_p, alpha_n, beta, eps)


def _xielu_branches(cache):
    """What the derivatives of ``xielu`` read of ``x``, from its cache: ``x``, the branches ``P =
    [x > 0]`` and ``N = [x <= 0]``, ``e = d expm1(m) / dx = exp(m) [x < eps]`` (0 where ``m`` is the
    constant ``eps``) and ``q = dy/da_n = (expm1(m) - x) N``."""
    x, eps = cache[0], cache[4]
    m = np.minimum(x, eps)
    P, N = x > 0, x <= 0
    e = np.where(x < eps, np.exp(m), 0.0)
    q = np.where(N, np.expm1(m) - x, 0.0)
    return x, P, N, e, q


def _xielu_scales(cache):
    """What they read of the parameters: ``a_p``, ``a_n`` and the sigmoids ``s_p``, ``s_n`` (``d a_p
    / d alpha_p = s_p``, ``d a_n / d alpha_n = s_n``)."""
    alpha_p, alpha_n, beta = cache[1], cache[2], cache[3]
    return _softplus(alpha_p), beta + _softplus(alpha_n), _sigmoid(alpha_p), _sigmoid(alpha_n)


def xielu_backward(dout: Array, cache: tuple) -> Tuple[Array, Array, Array]:
    """Differentiate each branch of ``y``::

        dy/dx       = 2 a_p x + beta             where x > 0
                    = a_n (e - 1) + beta         where x <= 0   (d(expm1(m) - x)/dx = e - 1)
        dy/da_p     = x^2 P                      dy/da_n = q = (expm1(m) - x) N

    and chain through softplus (``d a_p / d alpha_p = sigmoid(alpha_p)``, likewise ``a_n``); each
    parameter is one number shared by every entry, so its gradient is a sum over all of them.
    Returns ``(dx, dalpha_p, dalpha_n)``."""
    x, P, N, e, q = _xielu_branches(cache)
    a_p, a_n, s_p, s_n = _xielu_scales(cache)
    beta = cache[3]
    alpha_p, alpha_n = cache[1], cache[2]
    slope = np.where(P, 2 * a_p * x, a_n * (e - 1)) + beta
    dx = dout * slope
    dalpha_p = np.reshape(np.sum(dout * x * x * P) * s_p, np.shape(alpha_p))
    dalpha_n = np.reshape(np.sum(dout * q) * s_n, np.shape(alpha_n))
    return dx, dalpha_p, dalpha_n


def xielu_jvp(cache: tuple, *tangents: Optional[Array]) -> Array:
    """The same partial derivatives along ``(tx, talpha_p, talpha_n)``::

        ty = (dy/dx) tx + x^2 P s_p talpha_p + q s_n talpha_n

    (``s_p``, ``s_n`` the sigmoids of the raw parameters: softplus' derivative)."""
    tx, talpha_p, talpha_n = _padded(tangents, 3)
    x, P, N, e, q = _xielu_branches(cache)
    a_p, a_n, s_p, s_n = _xielu_scales(cache)
    beta = cache[3]
    ty = np.zeros_like(x)
    if tx is not None:
        ty = ty + (np.where(P, 2 * a_p * x, a_n * (e - 1)) + beta) * tx
    if talpha_p is not None:
        ty = ty + x * x * P * np.sum(s_p * talpha_p)
    if talpha_n is not None:
        ty = ty + q * np.sum(s_n * talpha_n)
    return ty


def xielu_backward_jvp(dout: Array, cache: tuple, tangents, ddout: Optional[Array] = None):
    """Second order: move ``x``, ``alpha_p``, ``alpha_n`` along ``(tx, talpha_p, talpha_n)`` and
    ``dy`` along ``ddy`` in each line of the backward.  What moves with them: ``a_p`` by ``s_p
    talpha_p``, ``a_n`` by ``s_n talpha_n``, ``s_p`` by ``s_p (1 - s_p) talpha_p`` (sigmoid' = s (1 -
    s)), ``s_n`` likewise; ``x^2`` by ``2 x tx``, ``q`` by ``(e - 1) N tx``, ``e`` by ``e tx`` (``e =
    exp(x)`` where it is not 0); the branches and ``beta`` do not move::

        slope = 2 a_p x P + a_n (e - 1) N + beta
        tslope = (2 a_p tx + 2 x s_p talpha_p) P + (a_n e tx + (e - 1) s_n talpha_n) N
        dx = dy slope                         tdx = ddy slope + dy tslope
        dalpha_p = s_p sum(dy x^2 P)          tdalpha_p = s_p sum(ddy x^2 P + dy 2 x tx P)
                                                          + s_p (1 - s_p) talpha_p sum(dy x^2 P)
        dalpha_n = s_n sum(dy q)              tdalpha_n = s_n sum(ddy q + dy (e - 1) N tx)
                                                          + s_n (1 - s_n) talpha_n sum(dy q)
    """
    tx, talpha_p, talpha_n = _padded(tangents, 3)
    x, P, N, e, q = _xielu_branches(cache)
    a_p, a_n, s_p, s_n = _xielu_scales(cache)
    beta = cache[3]
    alpha_p, alpha_n = cache[1], cache[2]
    grads = xielu_backward(dout, cache)
    ddy = np.zeros_like(dout) if ddout is None else ddout
    tx = np.zeros_like(x) if tx is None else tx
    talpha_p = np.zeros(np.shape(alpha_p)) if talpha_p is None else talpha_p
    talpha_n = np.zeros(np.shape(alpha_n)) if talpha_n is None else talpha_n
    slope = np.where(P, 2 * a_p * x, a_n * (e - 1)) + beta
    tslope = np.where(P, 2 * a_p * tx + 2 * x * np.sum(s_p * talpha_p), a_n * e * tx + (e - 1) * np.sum(s_n * talpha_n))
    tdx = ddy * slope + dout * tslope
    tdalpha_p = s_p * np.sum(ddy * x * x * P + dout * 2 * x * tx * P) + s_p * (1 - s_p) * talpha_p * np.sum(
        dout * x * x * P
    )
    tdalpha_n = s_n * np.sum(ddy * q + dout * (e - 1) * N * tx) + s_n * (1 - s_n) * talpha_n * np.sum(dout * q)
    shapes = (np.shape(alpha_p), np.shape(alpha_n))
    return grads, (tdx, np.reshape(tdalpha_p, shapes[0]), np.reshape(tdalpha_n, shapes[1]))


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


@shared_doc()
def gelu(x: Array, approximate: str = "none") -> Tuple[Array, tuple]:
    """``"none"``: ``y = x Phi(x)``, ``Phi(x) = (1 + erf(x / sqrt 2)) / 2`` the normal CDF.
    ``"tanh"``: ``y = x/2 (1 + tanh(u))``, ``u = sqrt(2/pi) (x + 0.044715 x^3)``.

    <reference_examples>
    >>> x = rng.standard_normal((3, 6))
    >>> out, cache = R.gelu(x, "tanh")
    >>> fast_out, _ = F.gelu(x, "tanh")
    >>> bool(np.allclose(out, fast_out, rtol=0, atol=1e-12))
    True
    """
    if approximate == "none":
        return x * 0.5 * (1.0 + erf(x / math.sqrt(2.0))), (x, approximate)
    return 0.5 * x * (1.0 + np.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x**3))), (x, approximate)


def gelu_backward(dout: Array, cache: tuple) -> Array:
    """``"none"``: ``d(x Phi)/dx = Phi(x) + x phi(x)``, ``phi(x) = exp(-x^2/2) / sqrt(2 pi)`` the density.
    ``"tanh"``: with ``t = tanh(u)``, ``dy/dx = (1 + t)/2 + x/2 (1 - t^2) du/dx``,
    ``du/dx = sqrt(2/pi) (1 + 3 * 0.044715 x^2)``.
    (notebooks/05_encoder_block_and_training.ipynb, section "The feed-forward network".)"""
    x, approximate = cache
    if approximate == "none":
        return dout * (0.5 * (1.0 + erf(x / math.sqrt(2.0))) + x * np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi))
    t = np.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x**3))
    return dout * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * x * x))


def gelu_jvp(cache: tuple, *tangents: Optional[Array]) -> Array:
    """Elementwise, so the Jacobian is the diagonal ``dy/dx`` derived in ``gelu_backward`` (both
    forms), and ``J tx = J^T tx``: the backward's formula with ``tx`` for ``dout``."""
    (tx,) = _padded(tangents, 1)
    x, _ = cache
    return np.zeros(x.shape, x.dtype) if tx is None else gelu_backward(tx, cache)


def gelu_backward_jvp(dout: Array, cache: tuple, tangents, ddout: Optional[Array] = None):
    """Second order: ``dx = dy gelu'(x)``, so ``tdx = ddy gelu'(x) + dy gelu''(x) tx``.

    ``"none"``: ``gelu' = Phi + x phi`` with ``Phi' = phi`` and ``phi' = -x phi`` (the normal
    density), so ``gelu'' = phi + phi + x (-x phi) = phi (2 - x^2)``.
    ``"tanh"``: ``gelu' = (1 + t)/2 + x/2 (1 - t^2) u'`` with ``t = tanh(u)``, ``t' = (1 - t^2) u'``,
    ``u' = sqrt(2/pi) (1 + 3 * 0.044715 x^2)`` and ``u'' = sqrt(2/pi) 6 * 0.044715 x``; term by term::

        d/dx (1 + t)/2                 = (1 - t^2) u' / 2
        d/dx x/2 (1 - t^2) u'          = (1 - t^2) u' / 2 - x t (1 - t^2) u'^2 + x/2 (1 - t^2) u''
    """
    (tx,) = _padded(tangents, 1)
    x, approximate = cache
    grads = gelu_backward(dout, cache)
    tdx = np.zeros_like(grads) if ddout is None else gelu_backward(ddout, cache)  # dy moves: gelu'(x) ddy
    if tx is not None:
        if approximate == "none":
            phi = np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
            second = phi * (2.0 - x * x)
        else:
            t = np.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x**3))
            du = _SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * x * x)
            ddu = _SQRT_2_OVER_PI * 6.0 * 0.044715 * x
            second = (1.0 - t * t) * du / 2 + (1.0 - t * t) * du / 2 - x * t * (1.0 - t * t) * du**2
            second = second + 0.5 * x * (1.0 - t * t) * ddu
        tdx = tdx + dout * second * tx  # x moves: gelu''(x) tx dy
    return grads, tdx


@shared_doc()
def silu(x: Array) -> Tuple[Array, tuple]:
    """``y = x sigmoid(x)``, ``sigmoid(x) = 1 / (1 + e^{-x}) = (1 + tanh(x/2)) / 2`` (the tanh form never overflows).

    <reference_examples>
    >>> x = rng.standard_normal((3, 6))
    >>> out, cache = R.silu(x)
    >>> fast_out, _ = F.silu(x)
    >>> bool(np.allclose(out, fast_out, rtol=0, atol=1e-12))
    True
    """
    s = 0.5 * (1.0 + np.tanh(0.5 * x))
    return x * s, (x, s)


def silu_backward(dout: Array, cache: tuple) -> Array:
    """``sigmoid' = s (1 - s)``, so ``d(x s)/dx = s + x s (1 - s) = s (1 + x (1 - s))``.
    (notebooks/08_modern_attention.ipynb, SwiGLU.)"""
    x, s = cache
    return dout * s * (1.0 + x * (1.0 - s))


def silu_jvp(cache: tuple, *tangents: Optional[Array]) -> Array:
    """Elementwise: ``ty = s (1 + x (1 - s)) tx``, the derivative of ``silu_backward``."""
    (tx,) = _padded(tangents, 1)
    x, s = cache
    return np.zeros(x.shape, x.dtype) if tx is None else tx * s * (1.0 + x * (1.0 - s))


def silu_backward_jvp(dout: Array, cache: tuple, tangents, ddout: Optional[Array] = None):
    """Second order: ``dx = dy silu'(x)`` with ``silu' = s (1 + x (1 - s))``, ``s' = s (1 - s)``;
    the product rule gives ``silu'' = s' (1 + x (1 - s)) + s ((1 - s) - x s')``, and
    ``tdx = ddy silu'(x) + dy silu''(x) tx`` (``tangents = (tx,)``)."""
    (tx,) = _padded(tangents, 1)
    x, s = cache
    grads = silu_backward(dout, cache)
    tdx = np.zeros_like(grads) if ddout is None else silu_backward(ddout, cache)
    if tx is not None:
        ds = s * (1.0 - s)  # sigmoid'
        tdx = tdx + dout * (ds * (1.0 + x * (1.0 - s)) + s * ((1.0 - s) - x * ds)) * tx
    return grads, tdx


@shared_doc()
def dropout(x: Array, p: float, rng: RngLike = None, training: bool = True) -> Tuple[Array, tuple]:
    """Inverted dropout: ``y = x * keep / (1 - p)``, ``keep = rng.random(x.shape) >= p`` (kept with
    probability ``1 - p``).  ``p = 1`` gives zeros, ``training=False`` or ``p = 0`` the identity
    (neither draws).

    <reference_examples>
    >>> x = rng.standard_normal((3, 6))
    >>> out, cache = R.dropout(x, 0.25, rng=5)
    >>> fast_out, _ = F.dropout(x, 0.25, rng=5)
    >>> bool(np.array_equal(out, fast_out))
    True
    """
    if not training or p == 0.0:
        return np.array(x, copy=True), (None, 1.0)
    keep = np.zeros(np.shape(x), dtype=bool) if p == 1.0 else np.random.default_rng(rng).random(np.shape(x)) >= p
    scale = 0.0 if p == 1.0 else 1.0 / (1.0 - p)
    return x * keep * scale, (keep, scale)


def dropout_backward(dout: Array, cache: tuple) -> Array:
    """``y`` is linear in ``x`` with the same mask: ``dx = dy * keep / (1 - p)``.
    (notebooks/02_masks_and_dropout.ipynb, section "Dropout on the attention weights".)"""
    keep, scale = cache
    return np.array(dout, copy=True) if keep is None else dout * keep * scale


def dropout_jvp(cache: tuple, *tangents: Optional[Array]) -> Optional[Array]:
    """``y = x * keep / (1 - p)`` is linear in ``x`` with the forward's own mask, so
    ``ty = tx * keep / (1 - p)`` (the identity when the forward was)."""
    (tx,) = _padded(tangents, 1)
    keep, scale = cache
    if tx is None:
        return None if keep is None else np.zeros(keep.shape)
    return np.array(tx, copy=True) if keep is None else tx * keep * scale


def dropout_backward_jvp(dout: Array, cache: tuple, tangents, ddout: Optional[Array] = None):
    """Second order: ``dx = dy keep / (1 - p)`` is linear in ``dy`` and does not read ``x``:
    ``tdx = ddy keep / (1 - p)`` with the forward's mask; ``tangents = (tx,)`` does not enter."""
    grads = dropout_backward(dout, cache)
    return grads, (np.zeros_like(grads) if ddout is None else dropout_backward(ddout, cache))


# == Normalisation ==================================================================================


def _norm_axes(x, weight, normalized_shape):
    """The trailing axes normalised: ``len(normalized_shape)``, else ``weight.ndim``, else 1."""
    if normalized_shape is not None:
        n = 1 if np.ndim(normalized_shape) == 0 else len(normalized_shape)
    else:
        n = 1 if weight is None else np.ndim(weight)
    return tuple(range(x.ndim - n, x.ndim))


@shared_doc()
def layer_norm(
    x: Array,
    weight: Optional[Array] = None,
    bias: Optional[Array] = None,
    eps: float = 1e-5,
    *,
    normalized_shape: Union[int, Tuple[int, ...], None] = None,
) -> Tuple[Array, tuple]:
    """``y = (x - mean) / sqrt(var + eps) * weight + bias``, mean and biased variance over the
    trailing axes (``normalized_shape``).  (notebooks/05_encoder_block_and_training.ipynb,
    section "Layer normalisation".)

    <reference_examples>
    >>> x = rng.standard_normal((3, 6))
    >>> out, cache = R.layer_norm(x, np.ones(6), np.zeros(6))
    >>> fast_out, _ = F.layer_norm(x, np.ones(6), np.zeros(6))
    >>> bool(np.allclose(out, fast_out, rtol=0, atol=1e-12))
    True
    """
    axes = _norm_axes(x, weight, normalized_shape)
    mu = x.mean(axis=axes, keepdims=True)
    xc = x - mu
    var = (xc * xc).mean(axis=axes, keepdims=True)
    rstd = 1.0 / np.sqrt(var + eps)
    xhat = xc * rstd  # mean 0, variance 1 over the axes
    y = xhat if weight is None else xhat * weight
    if bias is not None:
        y = y + bias
    return y, (xhat, rstd, weight, bias is not None, axes)


def layer_norm_backward(dout: Array, cache: tuple) -> Tuple[Array, Optional[Array], Optional[Array]]:
    """(notebooks/04_gradients_by_hand.ipynb, section "4. Layer norm".)

    ``y = xhat * w + b``: ``dw = sum dy * xhat`` and ``db = sum dy`` over the leading axes; the
    gradient at ``xhat`` is ``g = dy * w``.  With ``N`` elements normalised together,
    ``xhat_i = (x_i - mu) r``, ``r = (var + eps)^(-1/2)``, ``dmu/dx_j = 1/N`` and
    ``dvar/dx_j = 2 (x_j - mu) / N``, so ``dr/dx_j = -r^3 (x_j - mu) / N = -r^2 xhat_j / N`` and

        dxhat_i/dx_j = r (delta_ij - 1/N) - xhat_i r xhat_j / N
        dx_j = sum_i g_i dxhat_i/dx_j = r (g_j - mean(g) - xhat_j mean(g xhat)).
    """
    xhat, rstd, weight, has_bias, axes = cache
    lead = tuple(range(dout.ndim - len(axes)))
    dweight = (dout * xhat).sum(axis=lead) if weight is not None else None
    dbias = dout.sum(axis=lead) if has_bias else None
    g = dout if weight is None else dout * weight
    dx = rstd * (g - g.mean(axis=axes, keepdims=True) - xhat * (g * xhat).mean(axis=axes, keepdims=True))
    return dx, dweight, dbias


def layer_norm_jvp(cache: tuple, *tangents: Optional[Array]) -> Array:
    """Forward mode: the tangent of ``y = xhat * w + b`` along ``(tx, tw, tb)``.

    Differentiate each step of the forward along ``tx`` (means over the normalised axes)::

        mu = mean(x)                       tmu = mean(tx)
        var = mean((x - mu)^2)             tvar = 2 mean((x - mu)(tx - tmu)) = 2 mean((x - mu) tx)
                                                  (x - mu has mean 0, so the tmu term vanishes)
        r = (var + eps)^(-1/2)             tr = -r^3 tvar / 2 = -r^2 mean(xhat tx)
        xhat = (x - mu) r                  txhat = (tx - tmu) r + (x - mu) tr
                                                 = r (tx - mean(tx) - xhat mean(xhat tx))
        y = xhat w + b                     ty = txhat w + xhat tw + tb

    (``txhat`` is the backward's ``dx`` formula with ``g = tx``: that linear map is symmetric.)"""
    tx, tweight, tbias = _padded(tangents, 3)
    xhat, rstd, weight, _, axes = cache
    ty = np.zeros_like(xhat)
    if tx is not None:
        txhat = rstd * (tx - tx.mean(axis=axes, keepdims=True) - xhat * (xhat * tx).mean(axis=axes, keepdims=True))
        ty = ty + (txhat if weight is None else txhat * weight)
    if tweight is not None:
        ty = ty + xhat * tweight
    if tbias is not None:
        ty = ty + tbias
    return ty


def layer_norm_backward_jvp(dout: Array, cache: tuple, tangents, ddout: Optional[Array] = None):
    """Second order: the tangents of ``(dx, dw, db)`` when ``(x, w, b)`` move along ``tangents =
    (tx, tw, tb)`` and ``dy`` along ``ddout``.  ``xhat`` and ``r`` move as ``layer_norm_jvp``
    derives (``tr = -r^2 mean(xhat tx)``, ``txhat = r (tx - mean(tx) - xhat mean(xhat tx))``); then
    differentiate each line of the backward (means over the normalised axes, sums over the rest)::

        dw = sum(dy xhat)         tdw = sum(ddy xhat + dy txhat)
        db = sum(dy)              tdb = sum(ddy)
        g = dy w                  tg = ddy w + dy tw
        m1 = mean(g)              tm1 = mean(tg)
        m2 = mean(g xhat)         tm2 = mean(tg xhat + g txhat)
        dx = r (g - m1 - xhat m2) tdx = tr (g - m1 - xhat m2) + r (tg - tm1 - txhat m2 - xhat tm2)

    (``b`` is not read by the backward: ``tb`` does not enter.)"""
    tx, tweight, _ = _padded(tangents, 3)
    xhat, rstd, weight, has_bias, axes = cache
    grads = layer_norm_backward(dout, cache)
    lead = tuple(range(dout.ndim - len(axes)))
    ddy = np.zeros_like(dout) if ddout is None else ddout
    tx = np.zeros_like(xhat) if tx is None else tx
    tr = -(rstd**2) * (xhat * tx).mean(axis=axes, keepdims=True)
    txhat = rstd * (tx - tx.mean(axis=axes, keepdims=True) - xhat * (xhat * tx).mean(axis=axes, keepdims=True))
    tdweight = (ddy * xhat + dout * txhat).sum(axis=lead) if weight is not None else None
    tdbias = ddy.sum(axis=lead) if has_bias else None
    g = dout if weight is None else dout * weight
    tg = ddy if weight is None else ddy * weight
    if tweight is not None:
        tg = tg + dout * tweight
    m1, m2 = g.mean(axis=axes, keepdims=True), (g * xhat).mean(axis=axes, keepdims=True)
    tm1, tm2 = tg.mean(axis=axes, keepdims=True), (tg * xhat + g * txhat).mean(axis=axes, keepdims=True)
    tdx = tr * (g - m1 - xhat * m2) + rstd * (tg - tm1 - txhat * m2 - xhat * tm2)
    return grads, (tdx, tdweight, tdbias)


@shared_doc()
def rms_norm(
    x: Array,
    weight: Optional[Array] = None,
    eps: Optional[float] = None,
    *,
    normalized_shape: Union[int, Tuple[int, ...], None] = None,
) -> Tuple[Array, tuple]:
    """``y = x / sqrt(mean(x^2) + eps) * weight`` over the trailing axes; ``eps=None`` is
    ``np.finfo(x.dtype).eps`` (as torch).

    <reference_examples>
    >>> x = rng.standard_normal((3, 6))
    >>> out, cache = R.rms_norm(x, np.ones(6))
    >>> fast_out, _ = F.rms_norm(x, np.ones(6))
    >>> bool(np.allclose(out, fast_out, rtol=0, atol=1e-12))
    True
    """
    axes = _norm_axes(x, weight, normalized_shape)
    eps = np.finfo(x.dtype).eps if eps is None else eps
    rstd = 1.0 / np.sqrt((x * x).mean(axis=axes, keepdims=True) + eps)
    xhat = x * rstd
    return (xhat if weight is None else xhat * weight), (xhat, rstd, weight, axes)


def rms_norm_backward(dout: Array, cache: tuple) -> Tuple[Array, Optional[Array]]:
    """As layer norm without the mean: ``xhat_i = x_i r``, ``r = (mean(x^2) + eps)^(-1/2)``,
    ``dr/dx_j = -r^3 x_j / N = -r^2 xhat_j / N``, so with ``g = dy * w``:
    ``dx_j = r (g_j - xhat_j mean(g xhat))`` and ``dw = sum dy * xhat`` over the leading axes.
    (Layer norm's derivation: notebooks/04_gradients_by_hand.ipynb, section "4. Layer norm"; RMSNorm in
    notebooks/08_modern_attention.ipynb.)"""
    xhat, rstd, weight, axes = cache
    dweight = (dout * xhat).sum(axis=tuple(range(dout.ndim - len(axes)))) if weight is not None else None
    g = dout if weight is None else dout * weight
    return rstd * (g - xhat * (g * xhat).mean(axis=axes, keepdims=True)), dweight


def rms_norm_jvp(cache: tuple, *tangents: Optional[Array]) -> Array:
    """As layer norm's without the mean: ``r = (mean(x^2) + eps)^(-1/2)``,
    ``tr = -r^3 mean(x tx) = -r^2 mean(xhat tx)``, ``xhat = x r``, so
    ``txhat = tx r + x tr = r (tx - xhat mean(xhat tx))`` and ``ty = txhat w + xhat tw``."""
    tx, tweight = _padded(tangents, 2)
    xhat, rstd, weight, axes = cache
    ty = np.zeros_like(xhat)
    if tx is not None:
        txhat = rstd * (tx - xhat * (xhat * tx).mean(axis=axes, keepdims=True))
        ty = ty + (txhat if weight is None else txhat * weight)
    if tweight is not None:
        ty = ty + xhat * tweight
    return ty


def rms_norm_backward_jvp(dout: Array, cache: tuple, tangents, ddout: Optional[Array] = None):
    """Second order: as ``layer_norm_backward_jvp`` without the means of ``g`` and ``tx`` and
    without a bias, ``tangents = (tx, tw)``.  ``tr = -r^2 mean(xhat tx)``, ``txhat = r (tx - xhat
    mean(xhat tx))`` (``rms_norm_jvp``), then line by line::

        dw = sum(dy xhat)         tdw = sum(ddy xhat + dy txhat)
        g = dy w                  tg = ddy w + dy tw
        m = mean(g xhat)          tm = mean(tg xhat + g txhat)
        dx = r (g - xhat m)       tdx = tr (g - xhat m) + r (tg - txhat m - xhat tm)
    """
    tx, tweight = _padded(tangents, 2)
    xhat, rstd, weight, axes = cache
    grads = rms_norm_backward(dout, cache)
    ddy = np.zeros_like(dout) if ddout is None else ddout
    tx = np.zeros_like(xhat) if tx is None else tx
    tr = -(rstd**2) * (xhat * tx).mean(axis=axes, keepdims=True)
    txhat = rstd * (tx - xhat * (xhat * tx).mean(axis=axes, keepdims=True))
    lead = tuple(range(dout.ndim - len(axes)))
    tdweight = (ddy * xhat + dout * txhat).sum(axis=lead) if weight is not None else None
    g = dout if weight is None else dout * weight
    tg = ddy if weight is None else ddy * weight
    if tweight is not None:
        tg = tg + dout * tweight
    m, tm = (g * xhat).mean(axis=axes, keepdims=True), (tg * xhat + g * txhat).mean(axis=axes, keepdims=True)
    tdx = tr * (g - xhat * m) + rstd * (tg - txhat * m - xhat * tm)
    return grads, (tdx, tdweight)


# == Loss ===========================================================================================


@shared_doc()
def cross_entropy(
    logits: Array,
    targets: Array,
    ignore_index: Optional[int] = None,
    *,
    weight: Optional[Array] = None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> Tuple[Array, tuple]:
    """Cross-entropy of ``softmax(logits)`` against ``targets``, classes on the **last** axis
    (torch puts them on axis 1).  ``targets``: integer class ids ``logits.shape[:-1]`` or class
    probabilities ``logits.shape``.  (notebooks/05_encoder_block_and_training.ipynb, section
    "Training a small transformer on a toy task".)

    Both kinds of target become one weighted target distribution ``t (..., C)`` per row:

    * ids: ``t = w[y] ((1 - ls) onehot(y) + ls / C)`` per class, with ``ls = label_smoothing``
      and the class weights ``w`` (ones by default); a row whose id is ``ignore_index`` gets ``t = 0``;
    * probabilities: ``t = w ((1 - ls) p + ls / C)``;

    the loss of a row is ``-sum_c t_c log softmax(logits)_c``.  ``reduction="none"`` returns the
    rows, ``"sum"`` their sum and ``"mean"`` their sum divided by ``sum w[y]`` over the counted
    rows (torch's weighted mean; the number of rows for probability targets; 0 if nothing counts).

    <reference_examples>
    >>> logits = rng.standard_normal((4, 5))
    >>> out, cache = R.cross_entropy(logits, np.array([0, 4, 2, 2]))
    >>> fast_out, _ = F.cross_entropy(logits, np.array([0, 4, 2, 2]))
    >>> bool(np.allclose(out, fast_out, rtol=0, atol=1e-12))
    True
    """
    c = logits.shape[-1]
    w = np.ones(c, dtype=logits.dtype) if weight is None else np.asarray(weight, dtype=logits.dtype)
    z = logits - logits.max(axis=-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))  # (..., C) log softmax, stably
    if np.issubdtype(np.asarray(targets).dtype, np.integer):
        counted = np.ones(targets.shape, dtype=bool) if ignore_index is None else targets != ignore_index
        onehot = np.arange(c) == np.where(counted, targets, 0)[..., None]  # (..., C)
        t = (
            (1.0 - label_smoothing) * onehot * w[np.where(counted, targets, 0)][..., None] + label_smoothing / c * w
        ) * counted[..., None]
        denominator = (w[np.where(counted, targets, 0)] * counted).sum()
    else:
        t = w * ((1.0 - label_smoothing) * targets + label_smoothing / c)
        denominator = math.prod(logits.shape[:-1])
    rows = -(t * logp).sum(axis=-1)  # (...,)
    scale = 1.0 if reduction != "mean" else 1.0 / (denominator if denominator != 0 else 1.0)
    loss = rows if reduction == "none" else np.asarray(rows.sum() * scale)
    return loss.astype(logits.dtype), (logp, t.astype(logits.dtype), reduction, scale)


def cross_entropy_backward(dout: Array, cache: tuple) -> Array:
    """A row's loss is ``-sum_c t_c logp_c`` with ``logp_c = z_c - log sum_k e^{z_k}``, and
    ``dlogp_c/dz_j = delta_cj - softmax_j``, so ``dloss/dz_j = softmax_j sum_c t_c - t_j`` (with a
    one-hot target: ``softmax - onehot``).  Then the reduction: ``"none"`` takes each row's
    ``dout``, ``"sum"`` the scalar ``dout``, ``"mean"`` ``dout`` times the mean's ``1 / denominator``.
    (notebooks/05_encoder_block_and_training.ipynb, section "Training a small transformer on a toy task".)"""
    logp, t, reduction, scale = cache
    drow = (dout if reduction == "none" else np.broadcast_to(dout * scale, logp.shape[:-1]))[..., None]
    return drow * (np.exp(logp) * t.sum(axis=-1, keepdims=True) - t)


def cross_entropy_jvp(cache: tuple, *tangents: Optional[Array]) -> Array:
    """A row's loss ``-sum_c t_c logp_c`` moves, when the logits move along ``tz``, by
    ``-sum_c t_c tlogp_c`` with ``tlogp_c = tz_c - sum_k softmax_k tz_k`` (the tangent of
    ``z_c - log sum_k e^{z_k}``), i.e. by ``sum_j (softmax_j sum_c t_c - t_j) tz_j``: the row's
    gradient dotted with ``tz``.  The reduction acts on the rows' tangents as on the rows
    (``"mean"``: the sum times the same ``1 / denominator``).  Targets have no tangent."""
    (tlogits,) = _padded(tangents, 1)
    logp, t, reduction, scale = cache
    if tlogits is None:
        tlogits = np.zeros_like(logp)
    rows = ((np.exp(logp) * t.sum(axis=-1, keepdims=True) - t) * tlogits).sum(axis=-1)  # (...,)
    return rows if reduction == "none" else np.asarray(rows.sum() * scale, dtype=logp.dtype)


def cross_entropy_backward_jvp(dout: Array, cache: tuple, tangents, ddout: Optional[Array] = None):
    """Second order: the tangent of ``dlogits`` when the logits move along ``tangents = (tz,)``
    and ``dout`` along ``ddout``.  The target rows ``t`` and the mean's ``1 / denominator`` are
    data; differentiate each line of the backward::

        drow = dout (per row, or times the mean's scale)    tdrow = ddout (likewise)
        p = softmax(z) = exp(logp)                          tp = p (tz - sum(p tz))
        dz = drow (p sum(t) - t)                            tdz = tdrow (p sum(t) - t) + drow sum(t) tp

    With ``dout = 1`` and no ``ddout`` this is the Hessian of the loss times ``tz``:
    ``sum(t) (diag(p) - p p^T) tz`` per row."""
    (tz,) = _padded(tangents, 1)
    logp, t, reduction, scale = cache
    grads = cross_entropy_backward(dout, cache)
    ddout = np.zeros_like(dout) if ddout is None else ddout
    rows = logp.shape[:-1]
    drow = (dout if reduction == "none" else np.broadcast_to(dout * scale, rows))[..., None]
    tdrow = (ddout if reduction == "none" else np.broadcast_to(ddout * scale, rows))[..., None]
    p = np.exp(logp)
    tp = np.zeros_like(p) if tz is None else p * (tz - (p * tz).sum(axis=-1, keepdims=True))
    mass = t.sum(axis=-1, keepdims=True)  # sum(t): the row's total target weight
    return grads, tdrow * (p * mass - t) + drow * mass * tp


# == Rotary position embedding =====================================================================


def _proportional_frequencies(dim: int, base: float, s: dict) -> Array:
    """Gemma 4's proportional RoPE: every pair of the head; the first ``int(p dim // 2)`` turn at
    ``base^(-2i/dim)`` (``p`` the ``partial_rotary_factor``), the others not at all (frequency 0);
    all divided by ``factor``."""
    turning = int(s.get("partial_rotary_factor", 1.0) * dim // 2)
    f = [base ** (-2 * i / dim) if i < turning else 0.0 for i in range(dim // 2)]
    return np.array(f, dtype=np.float64) / s.get("factor", 1.0)


def rope_frequencies(dim: int, base: float = 10000.0, scaling=None, *, seq_len=None) -> Tuple[Array, float]:
    """RoPE's inverse frequencies ``(R/2,)`` and attention factor, from a Hugging Face
    ``rope_scaling`` / ``rope_parameters`` dict (``scaling``; None: the original RoPE), pair by pair.

    ``R = int(dim * partial_rotary_factor)`` features rotate.  Unscaled, pair ``i`` turns by
    ``base^(-2i/R)`` per position.  A model trained on ``original`` positions sees, at pair ``i``,
    ``original * f_i / (2 pi)`` full turns; the scalings act on the pairs that turned too few times
    to have learnt their whole circle (long wavelengths):
    - linear: every ``f_i / factor`` (positions squeezed ``factor`` times);
    - dynamic (NTK): a longer sequence ``s > max_position_embeddings`` stretches the base to
      ``base (factor s / max - (factor - 1))^(R / (R - 2))`` (pair ``R/2 - 1`` then spans the new
      length as it spanned the old one);
    - ntk_alpha (Hunyuan): the same stretch by a fixed ``alpha``, ``base alpha^(R / (R - 2))``,
      whatever the length;
    - yarn: pair ``i`` is interpolated (``f_i / factor``) when it makes fewer than ``beta_slow``
      turns over ``original`` positions, kept when more than ``beta_fast``, blended linearly in the
      pair index between; cos and sin are scaled by ``0.1 ln(factor) + 1`` (or the ratio of the
      two ``mscale`` values, DeepSeek-V3) so the softmax's temperature is kept;
    - llama3: the wavelength ``2 pi / f_i`` decides: shorter than ``original / high_freq_factor``
      kept, longer than ``original / low_freq_factor`` divided by ``factor``, a blend between;
    - longrope (Phi-3): ``f_i / short_factor[i]`` for a sequence of at most
      ``original_max_position_embeddings`` tokens, ``f_i / long_factor[i]`` beyond; cos and sin
      scaled by ``attention_factor`` (default ``sqrt(1 + ln(factor) / ln(original))``, ``factor``
      the dict's or ``max_position_embeddings / original``; 1 for ``factor <= 1``);
    - proportional (Gemma 4): all ``dim / 2`` pairs, the first ``int(partial_rotary_factor dim // 2)``
      at ``base^(-2i/dim)``, the rest at 0 (not rotated), each divided by ``factor``.
    """
    s: dict = {} if scaling is None else {k: v for k, v in scaling.items() if v is not None}
    kind = s.get("rope_type", s.get("type", "default"))
    base = s.get("rope_theta", base)
    if kind == "proportional":
        return _proportional_frequencies(dim, base, s), 1.0
    r = int(dim * s.get("partial_rotary_factor", 1.0))
    max_pos = s.get("max_position_embeddings")
    original = s.get("original_max_position_embeddings", max_pos)
    factor = s.get("factor")
    if kind == "dynamic":
        m, fac = s["max_position_embeddings"], s["factor"]
        length = m if seq_len is None else max(seq_len, m)
        base = base * (fac * length / m - (fac - 1)) ** (r / (r - 2))
    if kind == "ntk_alpha":
        base = base * s["alpha"] ** (r / (r - 2))
    f = [base ** (-2 * i / r) for i in range(r // 2)]  # the unscaled frequency of each pair
    attention_factor = 1.0
    if kind == "linear":
        f = [fi / factor for fi in f]
    elif kind == "yarn":

        def mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if s.get("attention_factor") is not None:
            attention_factor = s["attention_factor"]
        elif s.get("mscale") and s.get("mscale_all_dim"):
            attention_factor = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)

        def pair_turning(turns):  # the (fractional) pair index making `turns` turns over `original`
            return r * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

        low, high = pair_turning(s.get("beta_fast") or 32), pair_turning(s.get("beta_slow") or 1)
        if s.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, r - 1)
        high = high + 0.001 if low == high else high
        keep = [1.0 - min(max((i - low) / (high - low), 0.0), 1.0) for i in range(r // 2)]
        f = [fi / factor * (1 - w) + fi * w for fi, w in zip(f, keep)]
    elif kind == "longrope":
        original = s["original_max_position_embeddings"]
        fac = factor if factor is not None else s["max_position_embeddings"] / original
        if s.get("attention_factor") is not None:
            attention_factor = s["attention_factor"]
        elif fac > 1:
            attention_factor = math.sqrt(1 + math.log(fac) / math.log(original))
        ext = s["long_factor"] if seq_len is not None and seq_len > original else s["short_factor"]
        f = [1.0 / (e * base ** (2 * i / r)) for i, e in enumerate(ext)]
    elif kind == "llama3":
        lo, hi = s["low_freq_factor"], s["high_freq_factor"]
        out = []
        for fi in f:
            wavelen = 2 * math.pi / fi
            if wavelen < original / hi:
                out.append(fi)
            elif wavelen > original / lo:
                out.append(fi / factor)
            else:
                t = (original / wavelen - lo) / (hi - lo)
                out.append((1 - t) * fi / factor + t * fi)
        f = out
    return np.array(f, dtype=np.float64), float(attention_factor)


@shared_doc()
def rope(
    x: Array,
    positions: Optional[Array] = None,
    *,
    base: float = 10000.0,
    interleaved: bool = False,
    scaling=None,
    rotary_dim: Optional[int] = None,
) -> Tuple[Array, tuple]:
    """Rotary position embedding (RoPE) of ``x (..., L, D)``.

    Pair ``i`` of the first ``R`` features (``rotary_dim``; default ``D``, or
    ``int(D * partial_rotary_factor)`` from ``scaling``), ``(x_i, x_{i+R/2})`` ("rotate half",
    GPT-NeoX/Llama) or, interleaved, ``(x_{2i}, x_{2i+1})``, is rotated by the angle
    ``p * f_i`` at position ``p`` (``positions`` broadcastable to ``(..., L)``, default
    ``arange(L)``; ``f`` from ``rope_frequencies``, ``f_i = base^(-2i/R)`` unscaled):
    ``(a, b) -> c (a cos - b sin, a sin + b cos)`` with ``c`` the attention factor (YaRN; else 1).
    The features after ``R`` pass through.

    <reference_examples>
    >>> x = rng.standard_normal((2, 5, 8))
    >>> out, cache = R.rope(x)
    >>> fast_out, _ = F.rope(x)
    >>> bool(np.allclose(out, fast_out, rtol=0, atol=1e-12))
    True
    """
    d = x.shape[-1]
    pos = np.arange(x.shape[-2]) if positions is None else np.asarray(positions)
    s = scaling or {}
    # "proportional" (Gemma 4) turns every pair, its factor choosing how many at a non-zero frequency
    whole = s.get("rope_type") == "proportional"
    r = rotary_dim or (d if whole else int(d * (s.get("partial_rotary_factor") or 1.0)))
    seq_len = pos.max() + 1 if pos.size else None  # what "dynamic" reads
    kept = s if whole else {k: v for k, v in s.items() if k != "partial_rotary_factor"}
    f, c = rope_frequencies(r, base, kept, seq_len=seq_len)
    angle = pos[..., None] * f  # (..., L, R/2)
    cos, sin = (c * np.cos(angle)).astype(x.dtype), (c * np.sin(angle)).astype(x.dtype)
    xr, xp = x[..., :r], x[..., r:]  # rotated, passed through
    a, b = (xr[..., 0::2], xr[..., 1::2]) if interleaved else (xr[..., : r // 2], xr[..., r // 2 :])
    y = np.concatenate([_pairs(a * cos - b * sin, a * sin + b * cos, interleaved), xp], axis=-1)
    return y, (cos, sin, interleaved)


def _pairs(a, b, interleaved):
    """Put the two halves of each pair back into one feature axis."""
    return np.stack([a, b], axis=-1).reshape(a.shape[:-1] + (-1,)) if interleaved else np.concatenate([a, b], -1)


def rope_backward(dout: Array, cache: tuple) -> Array:
    """Each pair is multiplied by ``c`` times the rotation matrix ``[[cos, -sin], [sin, cos]]``
    (cos and sin cached with ``c`` in them); the gradient is multiplied by its transpose, ``c``
    times the rotation by ``-angle``: ``(da, db) = (dy_a cos + dy_b sin, -dy_a sin + dy_b cos)``.
    Nothing flows through the angles: they depend on the positions and the configuration, not on
    ``x`` (``dynamic`` reads only the sequence length), and ``c`` is a constant.  The features
    past ``R`` passed through: their gradient is ``dout``'s.  (notebooks/08_modern_attention.ipynb, RoPE.)"""
    cos, sin, interleaved = cache
    r = 2 * cos.shape[-1]
    dr, dp = dout[..., :r], dout[..., r:]
    da, db = (dr[..., 0::2], dr[..., 1::2]) if interleaved else (dr[..., : r // 2], dr[..., r // 2 :])
    return np.concatenate([_pairs(da * cos + db * sin, -da * sin + db * cos, interleaved), dp], axis=-1)


def rope_jvp(cache: tuple, *tangents: Optional[Array]) -> Optional[Array]:
    """The rotation of each pair depends on the position only, so ``y`` is linear in ``x`` and the
    tangent is rotated as ``x`` was: ``(ta, tb) -> (ta cos - tb sin, ta sin + tb cos)``."""
    (tx,) = _padded(tangents, 1)
    cos, sin, interleaved = cache
    if tx is None:
        return None
    r = 2 * cos.shape[-1]  # the features that rotate (all of them unless partial); the rest pass through
    tr, tp = tx[..., :r], tx[..., r:]
    ta, tb = (tr[..., 0::2], tr[..., 1::2]) if interleaved else (tr[..., : r // 2], tr[..., r // 2 :])
    return np.concatenate([_pairs(ta * cos - tb * sin, ta * sin + tb * cos, interleaved), tp], axis=-1)


def rope_backward_jvp(dout: Array, cache: tuple, tangents, ddout: Optional[Array] = None):
    """Second order: the backward rotates ``dy`` back by angles that depend on the positions and
    the configuration only (every scaling, the attention factor, partial rotary), not on ``x``:
    it is linear in ``dy`` and constant in ``x``, so ``tdx = rope_backward(ddy)`` and
    ``tangents = (tx,)`` does not enter."""
    grads = rope_backward(dout, cache)
    return grads, (np.zeros_like(grads) if ddout is None else rope_backward(ddout, cache))


def _op_names(*ops: str) -> list:
    """Each op's four public names: ``op``, ``op_backward``, ``op_jvp``, ``op_backward_jvp``."""
    return [f"{op}{part}" for op in ops for part in ("", "_backward", "_jvp", "_backward_jvp")]


__all__ = _op_names(
    "linear",
    "embedding",
    "softmax",
    "relu",
    "relu2",
    "clamp",
    "xielu",
    "gelu",
    "silu",
    "dropout",
    "layer_norm",
    "rms_norm",
    "cross_entropy",
    "rope",
    "scaled_dot_product_attention",
    "memory_efficient_attention",
)


# == Gated DeltaNet: the delta rule, its short convolution and its norms ===========================
# Qwen3-Next's linear-attention layer (transformers' ``Qwen3NextGatedDeltaNet``): a short causal
# depthwise convolution over the projected q, k, v; L2-normalised q and k; the gated delta rule, a
# linear attention whose state ``S (Dk, Dv)`` is a fast-weight memory corrected by the delta rule;
# a gated RMSNorm on the way out.  Shapes: ``H`` heads, ``L`` steps, ``Dk``/``Dv`` key/value width,
# ``C`` channels, ``K`` the convolution's taps.


class GatedDeltaRuleCache(NamedTuple):
    """What ``gated_delta_rule_backward`` needs (textbook: every state ``S_0 .. S_{L-1}``)."""

    q: np.ndarray  # (B..., H, L, Dk) as used: l2-normalised (with use_qk_l2norm) and scaled
    k: np.ndarray  # (B..., H, L, Dk) as used: l2-normalised (with use_qk_l2norm)
    v: np.ndarray  # (B..., H, L, Dv)
    g: np.ndarray  # (B..., H, L) log decays
    beta: np.ndarray  # (B..., H, L) write strengths
    states: np.ndarray  # (B..., H, L, Dk, Dv) S_{t-1}, the state each step starts from
    scale: float
    q_norm: Optional[tuple]  # l2_norm's caches of q and k with use_qk_l2norm, else None
    k_norm: Optional[tuple]
    has_initial_state: bool
    final_state: Optional[np.ndarray]  # (B..., H, Dk, Dv) S_L with output_final_state, else None


def gated_delta_rule(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    beta: Array,
    *,
    scale: Optional[float] = None,
    initial_state: Optional[Array] = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
) -> Tuple[Array, GatedDeltaRuleCache]:
    """The gated delta rule, one step at a time (transformers' ``torch_recurrent_gated_delta_rule``).

    ``q, k (B..., H, L, Dk)``, ``v (B..., H, L, Dv)``, ``g, beta (B..., H, L)``.  With
    ``use_qk_l2norm`` q and k first become ``x / sqrt(sum x^2 + 1e-6)``; q is multiplied by
    ``scale`` (default ``1/sqrt(Dk)``).  From ``S_0 = initial_state`` (zeros if None), each step:

        S <- exp(g_t) S                       the old memory decays (g_t <= 0 in Qwen3-Next)
        u_t = beta_t (v_t - S^T k_t)          the delta: what the memory got wrong about v_t, scaled
        S <- S + k_t u_t^T                    write the correction under key k_t
        o_t = S^T q_t

    (a step of online regression: ``S <- S - beta_t k_t (k_t^T S - v_t^T)`` is one gradient
    step on ``||S^T k_t - v_t||^2 / 2`` with learning rate beta_t).  Returns ``(o (B..., H, L, Dv),
    cache)``; ``cache.final_state`` is ``S_L`` when ``output_final_state``.  ``chunk_size`` is the
    fast tier's (it changes nothing there either): the recurrence has no chunks.  The steps are
    both rules' (``_delta_rule``, the decay held per row of the state).
    """
    return _delta_rule(GatedDeltaRuleCache, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm)


def gated_delta_rule_backward(
    dout: Array, cache: GatedDeltaRuleCache, dfinal_state: Optional[Array] = None
) -> Tuple[Array, Array, Array, Array, Array, Optional[Array]]:
    """Backpropagation through time, with ``dS`` the adjoint of the state.

    Step t, starting from ``P = S_{t-1}``, computed ``A = e^{g_t} P``, ``u = beta_t (v_t - A^T k_t)``,
    ``S_t = A + k_t u^T`` and ``o_t = S_t^T q_t``.  Later steps see ``S_t`` only, so everything
    after step t reaches step t through one matrix ``dS = dL/dS_t`` (``dfinal_state`` at t = L,
    else 0), and walking t = L .. 1 backwards::

        o_t = S_t^T q_t:          dS += q_t do_t^T;          dq_t = S_t do_t
        S_t = A + k_t u^T:        dA  = dS;                  dk_t = dS u;  du = dS^T k_t
        u = beta_t (v_t - A^T k_t), with delta = v_t - A^T k_t (so u = beta_t delta):
                                  dbeta_t = du . delta;      dv_t = beta_t du
                                  dA -= k_t (beta_t du)^T;   dk_t -= A (beta_t du)
        A = e^{g_t} P:            dg_t = e^{g_t} <dA, P> = <dA, A>;   dS_{t-1} = e^{g_t} dA

    so ``dS_{t-1} = e^{g_t} (I - beta_t k_t k_t^T) (dS_t + q_t do_t^T)``: the adjoint runs the
    same (transposed) decay-and-erase map in reverse time, and ``dinitial_state = dS_0``.
    Then the chain rule through ``q = scale * l2(q_in)`` and ``k = l2(k_in)``.
    Returns ``(dq, dk, dv, dg, dbeta, dinitial_state)``, the last None without an initial state.
    The walk is both rules' (``_delta_rule_backward``, ``dg_t`` the sum of the rows of ``<dA, A>``).
    """
    return _delta_rule_backward(dout, cache, dfinal_state)


def gated_delta_rule_jvp(cache: GatedDeltaRuleCache, *tangents: Optional[Array]):
    """Forward mode: the tangent of the outputs along ``(tq, tk, tv, tg, tbeta, tinitial_state)``
    (the backward's order; None or left out = zero), one step at a time as the forward.

    With ``A = e^{g_t} P`` (``P = S_{t-1}``), ``delta = v_t - A^T k_t``, ``u = beta_t delta``,
    ``S_t = A + k_t u^T`` and ``o_t = S_t^T q_t``, the product rule gives

        tA = e^{g_t} (tg_t P + tP)
        tdelta = tv_t - tA^T k_t - A^T tk_t;      tu = tbeta_t delta + beta_t tdelta
        tS_t = tA + tk_t u^T + k_t tu^T;          to_t = tS_t^T q_t + S_t^T tq_t

    (``tq``, ``tk`` first through ``l2_norm``'s JVP and the scale).  Returns ``tout``, or
    ``(tout, tfinal_state)`` when the forward kept the final state.  The lines are both rules'
    (``_delta_rule_jvp``, the decay held per row of the state).
    """
    return _delta_rule_jvp(cache, tangents)


def gated_delta_rule_backward_jvp(
    dout: Array,
    cache: GatedDeltaRuleCache,
    tangents,
    ddout: Optional[Array] = None,
    dfinal_state: Optional[Array] = None,
    ddfinal_state: Optional[Array] = None,
):
    """Second order: ``gated_delta_rule_backward(dout, cache, dfinal_state)``'s gradients and
    their tangents when the inputs move along ``tangents = (tq, tk, tv, tg, tbeta,
    tinitial_state)`` (``gated_delta_rule_jvp``'s order; None or left out: zero), ``dout`` along
    ``ddout`` and ``dfinal_state`` along ``ddfinal_state`` (None: zero).

    First the forward's tangents (``gated_delta_rule_jvp``'s lines), keeping every ``tS_{t-1}``
    beside ``S_{t-1}``; then the backward's walk t = L .. 1, each line differentiated by the
    product rule, ``tdS`` starting at ``ddfinal_state``::

        A = e^{g_t} P                   tA = e^{g_t} (tg_t P + tP)
        delta = v_t - A^T k_t           tdelta = tv_t - tA^T k_t - A^T tk_t
        u = beta_t delta                tu = tbeta_t delta + beta_t tdelta
        S_t = A + k_t u^T               tS_t = tA + tk_t u^T + k_t tu^T
        dS += q_t do_t^T                tdS += tq_t do_t^T + q_t tdo_t^T
        dq_t = S_t do_t                 tdq_t = tS_t do_t + S_t tdo_t
        du = dS^T k_t                   tdu = tdS^T k_t + dS^T tk_t
        dk_t = dS u                     tdk_t = tdS u + dS tu
        dbeta_t = du . delta            tdbeta_t = tdu . delta + du . tdelta
        dv_t = beta_t du                tdv_t = tbeta_t du + beta_t tdu
        dA = dS - k_t (beta_t du)^T     tdA = tdS - tk_t (beta_t du)^T - k_t tdv_t^T
        dk_t -= A (beta_t du)           tdk_t -= tA (beta_t du) + A tdv_t
        dg_t = <dA, A>                  tdg_t = <tdA, A> + <dA, tA>
        dS_{t-1} = e^{g_t} dA           tdS_{t-1} = e^{g_t} (tg_t dA + tdA)

    then ``dq = scale dq``, ``tdq = scale tdq`` and, with ``use_qk_l2norm``, ``l2_norm``'s second
    order along the raw ``tq``, ``tk``.  Returns ``(grads, grad_tangents)``, both in the backward's
    order (``dinitial_state`` and its tangent None without an initial state).
    """
    grads = gated_delta_rule_backward(dout, cache, dfinal_state)
    return grads, _delta_rule_grad_tangents(
        gated_delta_rule_backward, dout, cache, tangents, ddout, dfinal_state, ddfinal_state
    )


def _delta_rule(cache_type, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm):
    """The steps of ``gated_delta_rule`` and, with ``g`` of q's shape (a log decay per key
    channel), of ``kimi_delta_attention``: the decay held per row of the state as the JVP and the
    second order hold it (``e^{g_t}`` of shape ``(B..., H, Dk, 1)``, one row that broadcasts over
    the ``Dk`` rows for the scalar rule).  Returns ``(out, cache_type(...))``."""
    q_norm = k_norm = None
    if use_qk_l2norm:
        q, q_norm = l2_norm(q, 1e-6)
        k, k_norm = l2_norm(k, 1e-6)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    q = q * scale
    rows = g if g.ndim == q.ndim else g[..., None]  # (B..., H, L, Dk) or (B..., H, L, 1): the log decay of each row
    lead, steps = q.shape[:-2], q.shape[-2]
    S = np.zeros(lead + (k.shape[-1], v.shape[-1]), q.dtype) if initial_state is None else initial_state
    out = np.zeros(v.shape, q.dtype)
    states = np.zeros(lead + (steps,) + S.shape[-2:], q.dtype)
    for t in range(steps):
        states[..., t, :, :] = S  # S_{t-1}, kept for the backward
        kt, vt, qt = k[..., t, :], v[..., t, :], q[..., t, :]  # (B..., H, Dk), (B..., H, Dv)
        S = np.exp(rows[..., t, :])[..., :, None] * S  # decay: row d times e^{g_td} (all rows alike: e^{g_t})
        u = beta[..., t, None] * (vt - np.einsum("...kv,...k->...v", S, kt))  # the delta, (B..., H, Dv)
        S = S + kt[..., :, None] * u[..., None, :]  # rank-1 write k_t u_t^T
        out[..., t, :] = np.einsum("...kv,...k->...v", S, qt)  # read with q_t
    return out, cache_type(
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        states=states,
        scale=scale,
        q_norm=q_norm,
        k_norm=k_norm,
        has_initial_state=initial_state is not None,
        final_state=S if output_final_state else None,
    )


def _delta_rule_backward(dout, cache, dfinal_state):
    """The backward walk of ``gated_delta_rule_backward`` and, with ``g`` of q's shape, of
    ``kimi_delta_attention_backward``: the decay per row of the state as ``_delta_rule`` holds it,
    its gradient the row sums of ``<dA, A>``, summed over the rows when the decay is one number."""
    q, k, v, g, beta = cache.q, cache.k, cache.v, cache.g, cache.beta  # as the forward used them
    states = cache.states  # S_{t-1} of every step
    steps = q.shape[-2]
    per_channel = g.ndim == q.ndim
    rows = g if per_channel else g[..., None]  # (B..., H, L, Dk) or (B..., H, L, 1): the log decay of each row
    dS = np.zeros(states.shape[:-3] + states.shape[-2:], q.dtype) if dfinal_state is None else dfinal_state
    dq, dk, dv = np.zeros(q.shape, q.dtype), np.zeros(k.shape, q.dtype), np.zeros(v.shape, q.dtype)
    drows, dbeta = np.zeros(rows.shape, q.dtype), np.zeros(beta.shape, q.dtype)
    for t in reversed(range(steps)):
        kt, vt, qt, do = k[..., t, :], v[..., t, :], q[..., t, :], dout[..., t, :]
        decay = np.exp(rows[..., t, :])[..., :, None]  # (B..., H, Dk or 1, 1) e^{g_t} per row of S
        A = decay * states[..., t, :, :]  # recomputed from S_{t-1}
        delta = vt - np.einsum("...kv,...k->...v", A, kt)
        u = beta[..., t, None] * delta
        St = A + kt[..., :, None] * u[..., None, :]
        dS = dS + qt[..., :, None] * do[..., None, :]  # o_t = S_t^T q_t
        dq[..., t, :] = np.einsum("...kv,...v->...k", St, do)
        du = np.einsum("...kv,...k->...v", dS, kt)  # S_t = A + k_t u^T
        dk[..., t, :] = np.einsum("...kv,...v->...k", dS, u)
        dbeta[..., t] = (du * delta).sum(-1)  # u = beta_t delta
        dv[..., t, :] = beta[..., t, None] * du
        bdu = beta[..., t, None] * du
        dA = dS - kt[..., :, None] * bdu[..., None, :]  # delta = v_t - A^T k_t
        dk[..., t, :] -= np.einsum("...kv,...v->...k", A, bdu)
        row = (dA * A).sum(-1)  # A = diag(e^{g_t}) S_{t-1}: row d of <dA, A>; one decay for all rows: their sum
        drows[..., t, :] = row if per_channel else row.sum(-1, keepdims=True)
        dS = decay * dA  # dS_{t-1}
    dq = dq * cache.scale
    if cache.q_norm is not None and cache.k_norm is not None:
        dq, dk = l2_norm_backward(dq, cache.q_norm), l2_norm_backward(dk, cache.k_norm)
    return dq, dk, dv, drows.reshape(g.shape), dbeta, (dS if cache.has_initial_state else None)


def _delta_rule_jvp(cache, tangents):
    """The lines of ``gated_delta_rule_jvp`` and, with ``g`` of q's shape (a log decay per key
    channel), of ``kimi_delta_attention_jvp``: the decay held per row of the state as
    ``_delta_rule_grad_tangents`` holds it (``e^{g_t}`` of shape ``(B..., H, Dk, 1)``, one row that
    broadcasts over the ``Dk`` rows for the scalar rule)."""
    q, k, v, g, beta = cache.q, cache.k, cache.v, cache.g, cache.beta  # as the forward used them
    states, q_norm, k_norm = cache.states, cache.q_norm, cache.k_norm
    tq, tk, tv, tg, tbeta, tS = _padded(tangents, 6)
    zero = np.zeros_like
    rows = g if g.ndim == q.ndim else g[..., None]  # (B..., H, L, Dk) or (B..., H, L, 1): the log decay of each row
    tq = zero(q) if tq is None else cache.scale * (tq if q_norm is None else l2_norm_jvp(q_norm, tq))
    tk = zero(k) if tk is None else (tk if k_norm is None else l2_norm_jvp(k_norm, tk))
    tv = zero(v) if tv is None else tv
    trows = zero(rows) if tg is None else tg.reshape(rows.shape)
    tbeta = zero(beta) if tbeta is None else tbeta
    tS = np.zeros(states.shape[:-3] + states.shape[-2:], q.dtype) if tS is None else tS
    tout = np.zeros(v.shape, q.dtype)
    for t in range(q.shape[-2]):
        P, decay = states[..., t, :, :], np.exp(rows[..., t, :])[..., :, None]  # per row of the state
        kt, qt = k[..., t, :], q[..., t, :]
        A = decay * P
        tA = decay * (trows[..., t, :, None] * P + tS)
        delta = v[..., t, :] - np.einsum("...kv,...k->...v", A, kt)
        tdelta = tv[..., t, :] - np.einsum("...kv,...k->...v", tA, kt) - np.einsum("...kv,...k->...v", A, tk[..., t, :])
        u = beta[..., t, None] * delta
        tu = tbeta[..., t, None] * delta + beta[..., t, None] * tdelta
        S = A + kt[..., :, None] * u[..., None, :]
        tS = tA + tk[..., t, :, None] * u[..., None, :] + kt[..., :, None] * tu[..., None, :]
        tout[..., t, :] = np.einsum("...kv,...k->...v", tS, qt) + np.einsum("...kv,...k->...v", S, tq[..., t, :])
    return tout if cache.final_state is None else (tout, tS)


def _delta_rule_grad_tangents(backward, dout, cache, tangents, ddout, dfinal_state, ddfinal_state):
    """The gradients' tangents of ``gated_delta_rule_backward_jvp`` and, with ``g`` of q's shape (a
    log decay per key channel), of ``kimi_delta_attention_backward_jvp``: the decay is held as
    ``e^{g_t}`` per row of the state, ``(B..., H, Dk, 1)`` (one row for the scalar rule,
    broadcasting over the ``Dk`` rows), its gradient as the row sums of ``<dA, A>``, summed over
    the rows when the decay is one number.  ``backward`` is the pair's own (the l2 step's input)."""
    q, k, v, g, beta = cache.q, cache.k, cache.v, cache.g, cache.beta  # as the forward used them
    q_norm, k_norm, scale = cache.q_norm, cache.k_norm, cache.scale
    tq_in, tk_in, tv, tg, tbeta, tS0 = _padded(tangents or (), 6)
    zero = np.zeros_like
    per_channel = g.ndim == q.ndim
    rows = g if per_channel else g[..., None]  # (B..., H, L, Dk) or (B..., H, L, 1): the log decay of each row
    # the used q, k's tangents: through l2_norm's JVP and the scale
    tq = zero(q) if tq_in is None else scale * (tq_in if q_norm is None else l2_norm_jvp(q_norm, tq_in))
    tk = zero(k) if tk_in is None else (tk_in if k_norm is None else l2_norm_jvp(k_norm, tk_in))
    tv = zero(v) if tv is None else tv
    trows = zero(rows) if tg is None else tg.reshape(rows.shape)
    tbeta = zero(beta) if tbeta is None else tbeta
    tstates = _delta_rule_tangent_states(cache, rows, tk, tv, trows, tbeta, tS0)
    state_shape = tstates.shape[:-3] + tstates.shape[-2:]
    tdo_all = zero(dout) if ddout is None else ddout
    # the backward's walk, each line with its tangent
    dS = np.zeros(state_shape, q.dtype) if dfinal_state is None else dfinal_state
    tdS = np.zeros(state_shape, q.dtype) if ddfinal_state is None else ddfinal_state
    tdq, tdk, tdv = zero(q), zero(k), zero(v)
    tdrows, tdbeta = zero(rows), zero(beta)
    for t in reversed(range(q.shape[-2])):
        kt, vt, qt, do = k[..., t, :], v[..., t, :], q[..., t, :], dout[..., t, :]
        tkt, tvt, tqt, tdo = tk[..., t, :], tv[..., t, :], tq[..., t, :], tdo_all[..., t, :]
        bt, tbt = beta[..., t, None], tbeta[..., t, None]
        P, tP = cache.states[..., t, :, :], tstates[..., t, :, :]
        decay, tgt = np.exp(rows[..., t, :])[..., :, None], trows[..., t, :, None]  # per row of the state
        # A = diag(e^{g_t}) P: both factors move
        A = decay * P
        tA = decay * (tgt * P + tP)
        # delta = v_t - A^T k_t, u = beta_t delta, S_t = A + k_t u^T
        delta = vt - np.einsum("...kv,...k->...v", A, kt)
        tdelta = tvt - np.einsum("...kv,...k->...v", tA, kt) - np.einsum("...kv,...k->...v", A, tkt)
        u = bt * delta
        tu = tbt * delta + bt * tdelta
        St = A + kt[..., :, None] * u[..., None, :]
        tSt = tA + tkt[..., :, None] * u[..., None, :] + kt[..., :, None] * tu[..., None, :]
        # dS += q_t do_t^T
        dS = dS + qt[..., :, None] * do[..., None, :]
        tdS = tdS + tqt[..., :, None] * do[..., None, :] + qt[..., :, None] * tdo[..., None, :]
        # dq_t = S_t do_t
        tdq[..., t, :] = np.einsum("...kv,...v->...k", tSt, do) + np.einsum("...kv,...v->...k", St, tdo)
        # du = dS^T k_t, dk_t = dS u
        du = np.einsum("...kv,...k->...v", dS, kt)
        tdu = np.einsum("...kv,...k->...v", tdS, kt) + np.einsum("...kv,...k->...v", dS, tkt)
        tdk_t = np.einsum("...kv,...v->...k", tdS, u) + np.einsum("...kv,...v->...k", dS, tu)
        # dbeta_t = du . delta, dv_t = beta_t du
        tdbeta[..., t] = (tdu * delta).sum(-1) + (du * tdelta).sum(-1)
        bdu = bt * du
        tbdu = tbt * du + bt * tdu
        tdv[..., t, :] = tbdu
        # dA = dS - k_t (beta_t du)^T, dk_t -= A (beta_t du)
        dA = dS - kt[..., :, None] * bdu[..., None, :]
        tdA = tdS - tkt[..., :, None] * bdu[..., None, :] - kt[..., :, None] * tbdu[..., None, :]
        tdk[..., t, :] = tdk_t - np.einsum("...kv,...v->...k", tA, bdu) - np.einsum("...kv,...v->...k", A, tbdu)
        # dg_td = sum_v dA_dv A_dv (row d of <dA, A>); one decay for all rows: the sum of the rows'
        trow = (tdA * A).sum(-1) + (dA * tA).sum(-1)
        tdrows[..., t, :] = trow if per_channel else trow.sum(-1, keepdims=True)
        # dS_{t-1} = diag(e^{g_t}) dA: both factors move
        tdS = decay * (tgt * dA + tdA)
        dS = decay * dA
    # dq = scale dq (the scale is a constant), then l2_norm's second order along the raw tangents,
    # at the gradients l2_norm_backward received (the backward's without its last step)
    tdq = scale * tdq
    if q_norm is not None and k_norm is not None:
        dq_pre, dk_pre = backward(dout, cache._replace(q_norm=None, k_norm=None), dfinal_state)[:2]
        tdq = l2_norm_backward_jvp(dq_pre, q_norm, (tq_in,), tdq)[1]
        tdk = l2_norm_backward_jvp(dk_pre, k_norm, (tk_in,), tdk)[1]
    return tdq, tdk, tdv, tdrows.reshape(g.shape), tdbeta, (tdS if cache.has_initial_state else None)


def _delta_rule_tangent_states(cache, rows, tk, tv, trows, tbeta, tS):
    """The forward's tangents ``tS_{t-1}`` of every step (the JVP's recurrence), ``rows`` the log
    decays per row of the state as ``_delta_rule_grad_tangents`` holds them."""
    k, v, beta, states = cache.k, cache.v, cache.beta, cache.states
    tS = np.zeros(states.shape[:-3] + states.shape[-2:], k.dtype) if tS is None else tS
    tstates = np.zeros(states.shape, k.dtype)
    for t in range(k.shape[-2]):
        tstates[..., t, :, :] = tS
        P, decay, kt = states[..., t, :, :], np.exp(rows[..., t, :])[..., :, None], k[..., t, :]
        A = decay * P
        tA = decay * (trows[..., t, :, None] * P + tS)
        delta = v[..., t, :] - np.einsum("...kv,...k->...v", A, kt)
        tdelta = tv[..., t, :] - np.einsum("...kv,...k->...v", tA, kt) - np.einsum("...kv,...k->...v", A, tk[..., t, :])
        tu = tbeta[..., t, None] * delta + beta[..., t, None] * tdelta
        tS = tA + tk[..., t, :, None] * (beta[..., t, None] * delta)[..., None, :] + kt[..., :, None] * tu[..., None, :]
    return tstates


@shared_doc()
def l2_norm(x: Array, eps: float = 1e-6) -> Tuple[Array, tuple]:
    """``y = x / sqrt(sum x^2 + eps)`` over the last axis (transformers' ``l2norm``, FLA's).

    <reference_examples>
    >>> x = rng.standard_normal((3, 6))
    >>> out, cache = R.l2_norm(x)
    >>> fast_out, _ = F.l2_norm(x)
    >>> bool(np.allclose(out, fast_out, rtol=0, atol=1e-12))
    True
    """
    r = 1.0 / np.sqrt((x * x).sum(axis=-1, keepdims=True) + eps)
    return x * r, (x * r, r)


def l2_norm_backward(dout: Array, cache: tuple) -> Array:
    """``y = x r``, ``r = (sum x^2 + eps)^(-1/2)``, ``dr/dx_j = -r^3 x_j``, so
    ``dx = r dy - x r^3 (x . dy) = r (dy - y (y . dy))``: the part of dy along y is removed."""
    y, r = cache
    return r * (dout - y * (y * dout).sum(axis=-1, keepdims=True))


def l2_norm_jvp(cache: tuple, *tangents: Optional[Array]) -> Array:
    """``ty = r (tx - y (y . tx))``: the Jacobian ``r (I - y y^T)`` is symmetric, so the JVP is
    the backward's formula with ``tx`` for ``dout``."""
    (tx,) = _padded(tangents, 1)
    return np.zeros_like(cache[0]) if tx is None else l2_norm_backward(tx, cache)


def l2_norm_backward_jvp(dout: Array, cache: tuple, tangents, ddout: Optional[Array] = None):
    """Second order: ``x`` moves along ``tangents = (tx,)`` and ``dy`` along ``ddout``.  With
    ``r = (sum x^2 + eps)^(-1/2)`` and ``y = x r``: ``tr = -r^3 (x . tx) = -r^2 (y . tx)`` and
    ``ty = r (tx - y (y . tx))`` (``l2_norm_jvp``); then the backward's one line::

        dx = r (dy - y (y . dy))
        tdx = tr (dy - y (y . dy)) + r (ddy - ty (y . dy) - y (ty . dy + y . ddy))
    """
    (tx,) = _padded(tangents, 1)
    y, r = cache
    grads = l2_norm_backward(dout, cache)
    ddy = np.zeros_like(dout) if ddout is None else ddout
    tx = np.zeros_like(y) if tx is None else tx
    tr = -(r**2) * (y * tx).sum(axis=-1, keepdims=True)
    ty = r * (tx - y * (y * tx).sum(axis=-1, keepdims=True))
    ydy = (y * dout).sum(axis=-1, keepdims=True)
    tydy = (ty * dout + y * ddy).sum(axis=-1, keepdims=True)
    return grads, tr * (dout - y * ydy) + r * (ddy - ty * ydy - y * tydy)


@shared_doc()
def rms_norm_gated(x: Array, gate: Array, weight: Array, eps: float = 1e-6) -> Tuple[Array, tuple]:
    """``y = x / sqrt(mean(x^2) + eps) * weight * silu(gate)`` over the last axis: RMSNorm, then
    the gate (transformers' ``Qwen3NextRMSNormGated``, "norm before gate").  That module upcasts
    to float32 for the norm and the gate; here every step runs in x's own dtype (the same numbers
    for float32 inputs, more exact ones for float64).

    <reference_examples>
    >>> x, gate = rng.standard_normal((3, 6)), rng.standard_normal((3, 6))
    >>> out, cache = R.rms_norm_gated(x, gate, np.ones(6))
    >>> fast_out, _ = F.rms_norm_gated(x, gate, np.ones(6))
    >>> bool(np.allclose(out, fast_out, rtol=0, atol=1e-12))
    True
    """
    n, norm_cache = rms_norm(x, weight, eps)  # (..., D) RMSNorm(x) * weight
    s, silu_cache = silu(gate)
    return n * s, (n, s, norm_cache, silu_cache)


def rms_norm_gated_backward(dout: Array, cache: tuple) -> Tuple[Array, Array, Optional[Array]]:
    """``y = n * s`` with ``n = RMSNorm(x) * weight`` and ``s = silu(gate)``: the gradient at n
    is ``dy * s`` (then rms_norm's backward gives dx and dweight), the gradient at s is ``dy * n``
    (then silu's gives dgate).  Returns ``(dx, dgate, dweight)``."""
    n, s, norm_cache, silu_cache = cache
    dx, dweight = rms_norm_backward(dout * s, norm_cache)
    return dx, silu_backward(dout * n, silu_cache), dweight


def rms_norm_gated_jvp(cache: tuple, *tangents: Optional[Array]) -> Array:
    """``y = n * s``: ``ty = tn * s + n * ts`` with ``tn`` rms_norm's JVP along ``(tx, tweight)``
    and ``ts`` silu's along ``tgate``; tangents in the backward's order ``(tx, tgate, tweight)``."""
    tx, tgate, tweight = _padded(tangents, 3)
    n, s, norm_cache, silu_cache = cache
    ty = np.zeros_like(n)
    if tx is not None or tweight is not None:
        ty = ty + rms_norm_jvp(norm_cache, tx, tweight) * s
    if tgate is not None:
        ty = ty + n * silu_jvp(silu_cache, tgate)
    return ty


def rms_norm_gated_backward_jvp(dout: Array, cache: tuple, tangents, ddout: Optional[Array] = None):
    """Second order: ``tangents = (tx, tgate, tweight)``.  The backward hands ``gn = dy s`` to
    rms_norm's backward and ``gs = dy n`` to silu's; along the tangents ``n`` and ``s`` move by
    ``tn`` (rms_norm's JVP along ``(tx, tweight)``) and ``ts`` (silu's along ``tgate``), so::

        gn = dy s                 tgn = ddy s + dy ts
        gs = dy n                 tgs = ddy n + dy tn

    and each backward is differentiated by its own second order: rms_norm's along ``((tx,
    tweight), tgn)``, silu's along ``((tgate,), tgs)``.  Returns ``((dx, dgate, dweight), (tdx,
    tdgate, tdweight))``."""
    tx, tgate, tweight = _padded(tangents, 3)
    n, s, norm_cache, silu_cache = cache
    ddy = np.zeros_like(dout) if ddout is None else ddout
    tn, ts = rms_norm_jvp(norm_cache, tx, tweight), silu_jvp(silu_cache, tgate)
    (dx, dweight), (tdx, tdweight) = rms_norm_backward_jvp(dout * s, norm_cache, (tx, tweight), ddy * s + dout * ts)
    dgate, tdgate = silu_backward_jvp(dout * n, silu_cache, (tgate,), ddy * n + dout * tn)
    return (dx, dgate, dweight), (tdx, tdgate, tdweight)


class CausalConv1dCache(NamedTuple):
    """What ``causal_conv1d_backward`` needs: every output's window of inputs, the filter."""

    windows: np.ndarray  # (B..., L, C, K) the K inputs z_t reads, the padded steps included
    weight: np.ndarray  # (C, K)
    has_bias: bool
    has_initial_state: bool
    act: Optional[tuple]  # silu's cache of z with activation="silu", else None
    final_state: Optional[np.ndarray]  # (B..., K - 1, C) the last K - 1 inputs with output_final_state


@shared_doc()
def causal_conv1d(
    x: Array,
    weight: Array,
    bias: Optional[Array] = None,
    *,
    activation: Optional[str] = None,
    initial_state: Optional[Array] = None,
    output_final_state: bool = False,
) -> Tuple[Array, CausalConv1dCache]:
    """Short causal depthwise convolution along the sequence, channel by channel.

    ``x (B..., L, C)`` (npattn's batch-first layout; transformers' ``causal_conv1d_fn`` takes the
    transpose ``(B, C, L)``), ``weight (C, K)`` (torch's ``Conv1d(C, C, K, groups=C).weight`` of
    shape ``(C, 1, K)`` without its middle axis), ``bias (C,)``.  Each output looks at its own
    step and the ``K - 1`` before it:

        z_t = bias + sum_j weight[:, j] * x_{t - K + 1 + j},     y_t = activation(z_t)

    where the steps before the first come from ``initial_state (B..., K - 1, C)`` (the last
    ``K - 1`` inputs of the previous call when decoding; zeros if None).  ``activation`` is None or
    ``"silu"``.  With ``output_final_state``, ``cache.final_state`` (its last item) is the last
    ``K - 1`` inputs (the state for the next call).  Returns ``(y (B..., L, C), cache)``.

    <reference_examples>
    >>> x, w = rng.standard_normal((2, 7, 3)), rng.standard_normal((3, 4))   # (batch, L, channels), (channels, taps)
    >>> out, cache = R.causal_conv1d(x, w, activation="silu")
    >>> fast_out, _ = F.causal_conv1d(x, w, activation="silu")
    >>> bool(np.allclose(out, fast_out, rtol=0, atol=1e-12))
    True
    """
    taps = weight.shape[-1]
    past = np.zeros(x.shape[:-2] + (taps - 1, x.shape[-1]), x.dtype) if initial_state is None else initial_state
    xp = np.concatenate([past, x], axis=-2)  # (B..., K - 1 + L, C)
    windows = np.lib.stride_tricks.sliding_window_view(xp, taps, axis=-2)  # (B..., L, C, K): z_t's inputs
    z = (windows * weight).sum(-1) + (0.0 if bias is None else bias)
    y, act_cache = silu(z) if activation == "silu" else (z, None)
    final = xp[..., xp.shape[-2] - (taps - 1) :, :] if output_final_state else None
    return y, CausalConv1dCache(windows, weight, bias is not None, initial_state is not None, act_cache, final)


def causal_conv1d_backward(
    dout: Array, cache: CausalConv1dCache
) -> Tuple[Array, Array, Optional[Array], Optional[Array]]:
    """``z_t = bias + sum_j w_j x_{t-K+1+j}`` (per channel): input ``x_s`` feeds ``z_t`` for
    ``t = s + K - 1 - j``, so ``dx_s = sum_j w_j dz_{s+K-1-j}`` (the filter run backwards over
    dz: a correlation becomes a convolution), ``dw_j = sum_t dz_t x_{t-K+1+j}`` over the batch and
    the steps, ``dbias = sum dz``.  The first ``K - 1`` padded inputs are the initial state: their
    gradient is ``dinitial_state``.  Returns ``(dx, dweight, dbias, dinitial_state)``, None where absent.
    """
    windows, weight = cache.windows, cache.weight
    dz = dout if cache.act is None else silu_backward(dout, cache.act)  # (B..., L, C)
    taps, steps = weight.shape[-1], dz.shape[-2]
    dweight = np.einsum("nck,nc->ck", windows.reshape((-1,) + windows.shape[-2:]), dz.reshape(-1, dz.shape[-1]))
    dxp = np.zeros(dz.shape[:-2] + (steps + taps - 1, dz.shape[-1]), dz.dtype)
    for j in range(taps):  # tap j read x_{t - K + 1 + j}, i.e. row t + j of the padded input
        dxp[..., j : j + steps, :] += dz * weight[:, j]
    dbias = dz.reshape(-1, dz.shape[-1]).sum(0) if cache.has_bias else None
    return dxp[..., taps - 1 :, :], dweight, dbias, (dxp[..., : taps - 1, :] if cache.has_initial_state else None)


def causal_conv1d_jvp(cache: CausalConv1dCache, *tangents: Optional[Array]) -> Array:
    """``z`` is bilinear in the (padded) input and the weight, plus the bias: ``tz_t = tbias +
    sum_j (tw_j x_{t-K+1+j} + w_j tx_{t-K+1+j})`` (the padded ``tx`` starts with
    ``tinitial_state``), then the activation's JVP.  Tangents ``(tx, tweight, tbias, tinitial_state)``."""
    tx, tweight, tbias, tstate = _padded(tangents, 4)
    windows, weight = cache.windows, cache.weight
    taps = weight.shape[-1]
    tz = np.zeros(windows.shape[:-1], windows.dtype)  # (B..., L, C)
    if tx is not None or tstate is not None:
        lead = windows.shape[:-3]
        tx = np.zeros(lead + windows.shape[-3:-1], windows.dtype) if tx is None else tx
        tstate = np.zeros(lead + (taps - 1, weight.shape[0]), windows.dtype) if tstate is None else tstate
        tz = tz + (
            np.lib.stride_tricks.sliding_window_view(np.concatenate([tstate, tx], -2), taps, axis=-2) * weight
        ).sum(-1)
    if tweight is not None:
        tz = tz + (windows * tweight).sum(-1)
    if tbias is not None:
        tz = tz + tbias
    return tz if cache.act is None else silu_jvp(cache.act, tz)


def causal_conv1d_backward_jvp(dout: Array, cache: CausalConv1dCache, tangents, ddout: Optional[Array] = None):
    """Second order: ``tangents = (tx, tweight, tbias, tinitial_state)``.  The pre-activation
    moves by ``tz`` (``causal_conv1d_jvp`` without the activation); then each line of the
    backward, with ``windows`` moving by the windows ``twindows`` of the padded ``tx``::

        dz = act'(z) dy                    tdz: silu's second order along (tz, ddy) (= ddy without act)
        dw_j = sum_t dz_t windows_tj       tdw_j = sum_t (tdz_t windows_tj + dz_t twindows_tj)
        dxp_{t+j} += dz_t w_j              tdxp_{t+j} += tdz_t w_j + dz_t tw_j
        dbias = sum dz                     tdbias = sum tdz
    """
    tx, tweight, tbias, tstate = _padded(tangents, 4)
    windows, weight, act_cache = cache.windows, cache.weight, cache.act
    has_bias, has_initial = cache.has_bias, cache.has_initial_state
    taps = weight.shape[-1]
    lead = windows.shape[:-3]
    tx = np.zeros(lead + windows.shape[-3:-1], windows.dtype) if tx is None else tx
    tstate = np.zeros(lead + (taps - 1, weight.shape[0]), windows.dtype) if tstate is None else tstate
    tweight = np.zeros_like(weight) if tweight is None else tweight
    twindows = np.lib.stride_tricks.sliding_window_view(np.concatenate([tstate, tx], -2), taps, axis=-2)
    tz = (twindows * weight).sum(-1) + (windows * tweight).sum(-1) + (0.0 if tbias is None else tbias)
    ddy = np.zeros_like(dout) if ddout is None else ddout
    dz, tdz = (dout, ddy) if act_cache is None else silu_backward_jvp(dout, act_cache, (tz,), ddy)
    steps = dz.shape[-2]
    flat = (-1,) + windows.shape[-2:]
    dweight = np.einsum("nck,nc->ck", windows.reshape(flat), dz.reshape(-1, dz.shape[-1]))
    tdweight = np.einsum("nck,nc->ck", windows.reshape(flat), tdz.reshape(-1, dz.shape[-1]))
    tdweight = tdweight + np.einsum("nck,nc->ck", twindows.reshape(flat), dz.reshape(-1, dz.shape[-1]))
    dxp = np.zeros(dz.shape[:-2] + (steps + taps - 1, dz.shape[-1]), dz.dtype)
    tdxp = np.zeros_like(dxp)
    for j in range(taps):
        dxp[..., j : j + steps, :] += dz * weight[:, j]
        tdxp[..., j : j + steps, :] += tdz * weight[:, j] + dz * tweight[:, j]
    rows = (-1, dz.shape[-1])
    dbias, tdbias = (dz.reshape(rows).sum(0), tdz.reshape(rows).sum(0)) if has_bias else (None, None)
    grads = (dxp[..., taps - 1 :, :], dweight, dbias, (dxp[..., : taps - 1, :] if has_initial else None))
    return grads, (tdxp[..., taps - 1 :, :], tdweight, tdbias, (tdxp[..., : taps - 1, :] if has_initial else None))


__all__ += _op_names("gated_delta_rule", "l2_norm", "rms_norm_gated", "causal_conv1d")


# == Mixture of experts: the top-k router and the experts ==========================================
# GPT-OSS, DeepSeek-V3, Qwen3-Next (transformers' ``*TopKRouter`` / ``*Experts``): each token
# ``x_n`` (``N`` tokens, width ``H``) goes to ``k`` of ``E`` experts,
#
#     y_n = sum_{j < k} w_nj expert_{i_nj}(x_n),
#
# the router giving the chosen experts ``i (N, k)`` and their weights ``w (N, k)`` from the logits
# ``z (N, E)``.  Written here one token, one chosen expert at a time.  The choice ``i`` is a
# piecewise-constant function of the logits: it changes only where two scores tie, so its
# derivative is zero almost everywhere (and undefined at a tie).  No gradient flows through
# *which* experts were chosen; it flows through the chosen weights ``w`` and the chosen experts'
# own computations.  A correction bias that only steers the choice (DeepSeek-V3) gets none.


def _moe_sigmoid(z):
    """``1 / (1 + e^{-z}) = (1 + tanh(z/2)) / 2`` (the tanh form never overflows)."""
    return 0.5 * (1.0 + np.tanh(0.5 * z))


def _largest(scores, k):
    """The indices of the ``k`` largest entries of a vector, the largest first, equal entries in
    index order.  A NaN counts as larger than every number (``torch.topk``'s order): an expert
    whose score is NaN is chosen first, and the NaN reaches the token's weights, as in
    transformers.  (``np.argsort`` alone puts NaN last, which would quietly drop it.)"""
    nan = np.isnan(scores)
    return np.lexsort((-np.where(nan, 0, scores), ~nan))[:k]  # by (not NaN, -score), stable


class TopKRouterCache(NamedTuple):
    """What ``topk_router_backward`` needs (textbook)."""

    indices: np.ndarray  # (N, k) the chosen experts
    src: np.ndarray  # (N, E) the scores the weights come from: p = softmax(z), z, or s = sigmoid(z)
    r: np.ndarray  # (N, k) the weights before the routed scaling factor
    denom: np.ndarray  # (N,) the renormalisation's denominator D (1 when there is none)
    variant: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    logits_shape: tuple  # (..., E)


def topk_router(
    logits: Array,
    top_k: int,
    *,
    variant: str = "softmax_topk",
    norm_topk_prob: bool = False,
    correction_bias: Optional[Array] = None,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
    norm_topk_eps: Optional[float] = None,
) -> Tuple[Tuple[Array, Array], TopKRouterCache]:
    """Per token (a row ``z`` of ``logits (..., E)``):

        "softmax_topk":  p = softmax(z);  chosen = top-k of p;          v = p_chosen
        "topk_softmax":                   chosen = top-k of z;          v = z_chosen
        "sigmoid":       s = sigmoid(z);  chosen = top-k of s + bias;   v = s_chosen

    then ``r = softmax(v)`` ("topk_softmax"), ``r = v / D`` with ``D = sum v`` (+ 1e-20 for
    "sigmoid"; + ``norm_topk_eps`` where given) when ``norm_topk_prob``, else ``r = v``; and
    ``w = routed_scaling_factor * r``.
    With ``n_group > 1`` the ``E`` experts form ``n_group`` consecutive groups, a group scores the
    sum of its two best choice scores, and only the experts of the ``topk_group`` best groups
    compete.  Returns ``((w (..., k), chosen (..., k) int64, the best first), cache)``.
    """
    E = logits.shape[-1]
    z = logits.reshape(-1, E)
    N = z.shape[0]
    indices = np.zeros((N, top_k), np.int64)
    src = np.zeros(z.shape, z.dtype)
    r = np.zeros((N, top_k), z.dtype)
    denom = np.ones(N, z.dtype)
    for n in range(N):
        if variant == "softmax_topk":
            e = np.exp(z[n] - z[n].max())
            src[n] = e / e.sum()
            choice = src[n]
        elif variant == "topk_softmax":
            src[n] = choice = z[n]
        else:
            src[n] = _moe_sigmoid(z[n])
            choice = src[n] if correction_bias is None else src[n] + correction_bias  # for the choice only
        if n_group > 1:
            size = E // n_group
            groups = choice.reshape(n_group, size)
            group_score = np.array([grp[_largest(grp, 2)].sum() for grp in groups])  # its two best
            allowed = np.full(E, -np.inf)
            for g in _largest(group_score, topk_group):
                allowed[g * size : (g + 1) * size] = choice[g * size : (g + 1) * size]
            choice = allowed
        chosen = _largest(choice, top_k)
        v = src[n, chosen]
        if variant == "topk_softmax":
            e = np.exp(v - v.max())
            r[n] = e / e.sum()
        elif norm_topk_prob:
            eps = (1e-20 if variant == "sigmoid" else 0.0) if norm_topk_eps is None else norm_topk_eps
            denom[n] = v.sum() + eps
            r[n] = v / denom[n]
        else:
            r[n] = v
        indices[n] = chosen
    w = routed_scaling_factor * r
    out = logits.shape[:-1] + (top_k,)
    cache = TopKRouterCache(indices, src, r, denom, variant, norm_topk_prob, routed_scaling_factor, logits.shape)
    return (w.reshape(out), indices.reshape(out)), cache


def topk_router_backward(dout: Array, cache: TopKRouterCache) -> Array:
    """``dlogits (..., E)`` from ``dweights (..., k)``.  The chosen set is a constant (see the
    section's head), so, per token, back through the forward's lines:

        w = c r                      dr = c dw
        r = softmax(v)               dv = r (dr - <dr, r>)               (softmax's backward)
        r = v / D,  D = sum v (+e)   dv_j = dr_j / D - sum_i dr_i v_i / D^2 = (dr_j - <dr, r>) / D
        r = v                        dv = dr
        v = src_chosen               dsrc = dv at the chosen, 0 elsewhere (a gather's backward scatters)
        src = z                      dz = dsrc
        src = sigmoid(z)             dz = dsrc s (1 - s)                 (sigmoid' = s (1 - s))
        src = softmax(z) = p         dz = p (dsrc - <dsrc, p>)           (softmax's backward)
    """
    indices, src, r, denom = cache.indices, cache.src, cache.r, cache.denom
    variant, norm, c, shape = cache.variant, cache.norm_topk_prob, cache.routed_scaling_factor, cache.logits_shape
    dw = dout.reshape(r.shape)
    dz = np.zeros(src.shape, src.dtype)
    for n in range(src.shape[0]):
        dr = c * dw[n]
        if variant == "topk_softmax":
            dv = r[n] * (dr - np.dot(dr, r[n]))
        elif norm:
            dv = (dr - np.dot(dr, r[n])) / denom[n]
        else:
            dv = dr
        dsrc = np.zeros(src.shape[1], src.dtype)
        dsrc[indices[n]] = dv
        if variant == "topk_softmax":
            dz[n] = dsrc
        elif variant == "sigmoid":
            dz[n] = dsrc * src[n] * (1.0 - src[n])
        else:
            dz[n] = src[n] * (dsrc - np.dot(dsrc, src[n]))
    return dz.reshape(shape)


def _router_source_tangent(variant: str, src: Array, tz: Array) -> Array:
    """One token's ``tsrc``, the tangent of the scores the choice reads (``topk_router_jvp``'s
    first lines): ``tz`` (``"topk_softmax"``), ``s (1 - s) tz`` (``"sigmoid"``), ``p (tz - <p,
    tz>)`` (``"softmax_topk"``)."""
    if variant == "topk_softmax":
        return tz
    if variant == "sigmoid":
        return src * (1.0 - src) * tz
    return src * (tz - np.dot(src, tz))


def topk_router_jvp(cache: TopKRouterCache, *tangents: Optional[Array]) -> Array:
    """``tweights (..., k)`` along ``tlogits (..., E)``: the forward's lines differentiated, per
    token (the chosen set is constant):

        src = z:           tsrc = tz
        src = sigmoid(z):  tsrc = s (1 - s) tz
        src = softmax(z):  tsrc = p (tz - <p, tz>)
        v = src_chosen:    tv = tsrc_chosen
        r = softmax(v):    tr = r (tv - <r, tv>)
        r = v / D:         tr = tv / D - v sum(tv) / D^2 = (tv - r sum tv) / D
        w = c r:           tw = c tr
    """
    (tz,) = _padded(tangents, 1)
    indices, src, r, denom = cache.indices, cache.src, cache.r, cache.denom
    variant, norm, c, shape = cache.variant, cache.norm_topk_prob, cache.routed_scaling_factor, cache.logits_shape
    tw = np.zeros(r.shape, r.dtype)
    if tz is None:
        return tw.reshape(shape[:-1] + r.shape[-1:])
    tz = tz.reshape(src.shape)
    for n in range(src.shape[0]):
        tsrc = _router_source_tangent(variant, src[n], tz[n])
        tv = tsrc[indices[n]]
        if variant == "topk_softmax":
            tr = r[n] * (tv - np.dot(r[n], tv))
        elif norm:
            tr = (tv - r[n] * tv.sum()) / denom[n]
        else:
            tr = tv
        tw[n] = c * tr
    return tw.reshape(shape[:-1] + r.shape[-1:])


def topk_router_backward_jvp(dout: Array, cache: TopKRouterCache, tangents, ddout: Optional[Array] = None):
    """Second order: ``topk_router_backward``'s ``dlogits`` and its tangent when the logits move
    along ``tangents = (tlogits,)`` and ``dweights`` along ``ddout`` (None: zero).  The choice is
    piecewise constant: a tangent does not move which experts are chosen (the derivative of the
    choice is zero away from ties), so ``indices`` stay, and only ``src``, ``v``, ``r``, ``D``
    move (``topk_router_jvp``'s lines give ``tsrc``, ``tv``, ``tr``; ``tD = sum tv``).  Each line
    of the backward differentiated by the product rule, per token, ``tdw = ddout``::

        dr = c dw                       tdr = c tdw
        dv = r (dr - <dr, r>)           tdv = tr (dr - <dr, r>) + r (tdr - <tdr, r> - <dr, tr>)
        dv = (dr - <dr, r>) / D         tdv = (tdr - <tdr, r> - <dr, tr>) / D - dv tD / D
        dv = dr                         tdv = tdr
        dsrc = scatter(dv)              tdsrc = scatter(tdv)                (linear, the choice fixed)
        dz = dsrc                       tdz = tdsrc
        dz = dsrc s (1 - s)             tdz = tdsrc s (1 - s) + dsrc (1 - 2 s) ts,   ts = s (1 - s) tz
        dz = p (dsrc - <dsrc, p>)       tdz = tp (dsrc - <dsrc, p>) + p (tdsrc - <tdsrc, p> - <dsrc, tp>)

    Returns ``(dlogits, tdlogits)``, both ``(..., E)``.
    """
    (tz,) = _padded(tangents or (), 1)
    indices, src, r, denom = cache.indices, cache.src, cache.r, cache.denom
    variant, norm, c, shape = cache.variant, cache.norm_topk_prob, cache.routed_scaling_factor, cache.logits_shape
    grads = topk_router_backward(dout, cache)
    dw = dout.reshape(r.shape)
    tdw = np.zeros(r.shape, r.dtype) if ddout is None else ddout.reshape(r.shape)
    tz = np.zeros(src.shape, src.dtype) if tz is None else tz.reshape(src.shape)
    tdz = np.zeros(src.shape, src.dtype)
    for n in range(src.shape[0]):
        # the forward's tangents (topk_router_jvp's lines)
        tsrc = _router_source_tangent(variant, src[n], tz[n])
        tv = tsrc[indices[n]]
        # dr = c dw: c is a constant
        dr, tdr = c * dw[n], c * tdw[n]
        if variant == "topk_softmax":  # dv = r (dr - <dr, r>): r and dr both move
            dv = r[n] * (dr - np.dot(dr, r[n]))
            tr = r[n] * (tv - np.dot(r[n], tv))
            tdv = tr * (dr - np.dot(dr, r[n])) + r[n] * (tdr - np.dot(tdr, r[n]) - np.dot(dr, tr))
        elif norm:  # dv = (dr - <dr, r>) / D: the quotient rule, tD = sum tv
            dv = (dr - np.dot(dr, r[n])) / denom[n]
            tr = (tv - r[n] * tv.sum()) / denom[n]
            tdv = (tdr - np.dot(tdr, r[n]) - np.dot(dr, tr)) / denom[n] - dv * tv.sum() / denom[n]
        else:  # dv = dr: linear
            dv, tdv = dr, tdr
        # dsrc = scatter(dv) at the chosen (fixed) experts: linear
        dsrc = np.zeros(src.shape[1], src.dtype)
        tdsrc = np.zeros(src.shape[1], src.dtype)
        dsrc[indices[n]] = dv
        tdsrc[indices[n]] = tdv
        if variant == "topk_softmax":  # dz = dsrc
            tdz[n] = tdsrc
        elif variant == "sigmoid":  # dz = dsrc s' with s' = s (1 - s): d(s') = (1 - 2 s) ts
            tdz[n] = tdsrc * src[n] * (1.0 - src[n]) + dsrc * (1.0 - 2.0 * src[n]) * tsrc
        else:  # dz = p (dsrc - <dsrc, p>): softmax's backward, p moving by tp = tsrc
            tdz[n] = tsrc * (dsrc - np.dot(dsrc, src[n])) + src[n] * (
                tdsrc - np.dot(tdsrc, src[n]) - np.dot(dsrc, tsrc)
            )
    return grads, tdz.reshape(shape)


def _expert_views(kind, e, gate_up, down, gate_up_bias=None, down_bias=None):
    """Expert ``e``'s ``(Wg (I, H), Wu (I, H), Wd (H, I), bg (I,), bu (I,), bd (H,))`` from the
    stacks ``(E, ...)``: views into the fused layouts (so the same views of a gradient array add
    into it), None for an absent bias.
    ``"swiglu"``: ``gate_up (2I, H)`` is the gate rows then the up rows, ``down (H, I)``.
    ``"gpt_oss"``: ``gate_up (H, 2I)`` has the gate in the even columns and the up in the odd ones,
    ``down (I, H)``.
    ``"plain"`` (not gated): ``gate_up (I, H)`` is the up rows alone, ``down (H, I)``; the gate's
    views have no rows (``Wg (0, H)``, ``bg (0,)``), so every gate term below is empty."""
    gate_up_e, down_e = gate_up[e], down[e]
    gate_up_bias_e = None if gate_up_bias is None else gate_up_bias[e]
    down_bias_e = None if down_bias is None else down_bias[e]
    if kind == "plain":
        Wg, Wu, Wd = gate_up_e[:0], gate_up_e, down_e
        bg, bu = (None, None) if gate_up_bias_e is None else (gate_up_bias_e[:0], gate_up_bias_e)
    elif kind == "swiglu":
        i = gate_up_e.shape[0] // 2
        Wg, Wu, Wd = gate_up_e[:i], gate_up_e[i:], down_e
        bg, bu = (None, None) if gate_up_bias_e is None else (gate_up_bias_e[:i], gate_up_bias_e[i:])
    else:
        Wg, Wu, Wd = gate_up_e[:, 0::2].T, gate_up_e[:, 1::2].T, down_e.T
        bg, bu = (None, None) if gate_up_bias_e is None else (gate_up_bias_e[0::2], gate_up_bias_e[1::2])
    return Wg, Wu, Wd, bg, bu, down_bias_e


def _plus(a, b):
    """``a + b``, ``b`` None meaning no term (an absent bias)."""
    return a if b is None else a + b


def _moe_act(activation):
    """A SwiGLU or plain expert's activation and its backward, from this file."""
    return {
        "silu": (silu, silu_backward),
        "gelu": (gelu, gelu_backward),
        "gelu_tanh": (lambda a: gelu(a, "tanh"), gelu_backward),
        "relu": (relu, relu_backward),
        "relu2": (relu2, relu2_backward),
    }[activation]


class MoeExpertsCache(NamedTuple):
    """What ``moe_experts_backward`` needs (textbook: every (token, slot) pair's intermediates)."""

    x: np.ndarray  # (N, H)
    indices: np.ndarray  # (N, k)
    weights: np.ndarray  # (N, k)
    h: np.ndarray  # (N, k, H) each pair's expert output
    pairs: list  # pairs[n][j]: the expert's intermediates (gate, up, and the activation's)
    params: tuple  # (gate_up, down, gate_up_bias, down_bias)
    kind: str
    activation: str
    alpha: float
    limit: float
    x_shape: tuple


def moe_experts(
    x: Array,
    indices: Array,
    weights: Array,
    gate_up: Array,
    down: Array,
    gate_up_bias: Optional[Array] = None,
    down_bias: Optional[Array] = None,
    *,
    kind: str = "swiglu",
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
) -> Tuple[Array, MoeExpertsCache]:
    """``y_n = sum_j w_nj expert_{i_nj}(x_n)``: a loop over the tokens and their chosen experts.

    Expert ``e`` (its weights viewed as ``Wg, Wu (I, H)``, ``Wd (H, I)``, see ``_expert_views``):

        gate = Wg x + bg,   up = Wu x + bu
        "swiglu":   m = act(gate) * up
        "gpt_oss":  g = min(gate, limit),  u = clamp(up, -limit, limit),  m = (u + 1) g sigmoid(alpha g)
        "plain":    m = act(up)              (no gate: Nemotron 3's experts, act relu2)
        expert_e(x) = Wd m + bd

    Returns ``(y (..., H), cache)``.
    """
    H, k = x.shape[-1], indices.shape[-1]
    X, I, W = x.reshape(-1, H), indices.reshape(-1, k), weights.reshape(-1, k)
    N = X.shape[0]
    y = np.zeros(X.shape, X.dtype)
    h = np.zeros((N, k, H), X.dtype)
    pairs: list = [[None] * k for _ in range(N)]
    for n in range(N):
        for j in range(k):
            e = I[n, j]
            Wg, Wu, Wd, bg, bu, bd = _expert_views(kind, e, gate_up, down, gate_up_bias, down_bias)
            gate, up = _plus(Wg @ X[n], bg), _plus(Wu @ X[n], bu)
            if kind == "plain":
                m, act_cache = _moe_act(activation)[0](up)
                pairs[n][j] = (gate, up, act_cache, m)
            elif kind == "swiglu":
                a, act_cache = _moe_act(activation)[0](gate)
                m = a * up
                pairs[n][j] = (gate, up, a, act_cache, m)
            else:
                g, u = np.minimum(gate, limit), np.clip(up, -limit, limit)
                s = _moe_sigmoid(alpha * g)
                m = (u + 1.0) * g * s
                pairs[n][j] = (gate, up, g, u, s, m)
            h[n, j] = _plus(Wd @ m, bd)
            y[n] += W[n, j] * h[n, j]
    cache = MoeExpertsCache(
        X, I, W, h, pairs, (gate_up, down, gate_up_bias, down_bias), kind, activation, alpha, limit, x.shape
    )
    return y.reshape(x.shape), cache


def moe_experts_backward(dout: Array, cache: MoeExpertsCache) -> Tuple[Optional[Array], ...]:
    """``(dx, dweights, dgate_up, ddown, dgate_up_bias, ddown_bias)`` (bias gradients None when
    absent; the indices are a constant: no gradient).  Per token n and slot j, back through the
    forward's lines (``h = expert_e(x_n)``, ``y_n += w_nj h``)::

        y_n += w h          dw_nj = <dy_n, h>,       dh = w_nj dy_n
        h = Wd m + bd       dm = Wd^T dh,            dWd += dh m^T,   dbd += dh
        "swiglu":  m = a up, a = act(gate):   dup = dm a,   dgate = act'(gate) (dm up)
        "plain":   m = act(up):               dup = act'(up) dm   (no gate)
        "gpt_oss": m = (u + 1) g s, s = sigmoid(alpha g):
                            du = dm g s,   dg = dm (u + 1) (s + g alpha s (1 - s))
                            (d(g s)/dg = s + g s' alpha, s' = s (1 - s));
                   the clamps: dup = du where -limit <= up <= limit, dgate = dg where gate <= limit
                            (0 outside, where the clamp is a constant; bounds included, as torch)
        gate = Wg x + bg    dWg += dgate x^T,   dbg += dgate,   dx_n += Wg^T dgate   (and so for up)

    A token chosen by several experts gathers the ``dx`` of each.
    """
    X, I, W, h, pairs = cache.x, cache.indices, cache.weights, cache.h, cache.pairs
    kind, activation, alpha, limit, x_shape = cache.kind, cache.activation, cache.alpha, cache.limit, cache.x_shape
    gate_up, down, gate_up_bias, down_bias = cache.params
    dy = dout.reshape(X.shape)
    N, k = I.shape
    dx, dw = np.zeros(X.shape, X.dtype), np.zeros(I.shape, X.dtype)
    dgate_up, ddown = np.zeros(gate_up.shape, X.dtype), np.zeros(down.shape, X.dtype)
    dgate_up_bias = None if gate_up_bias is None else np.zeros(gate_up_bias.shape, X.dtype)
    ddown_bias = None if down_bias is None else np.zeros(down_bias.shape, X.dtype)
    for n in range(N):
        for j in range(k):
            e = I[n, j]
            Wg, Wu, Wd, _, _, _ = _expert_views(kind, e, gate_up, down)
            dWg, dWu, dWd, dbg, dbu, dbd = _expert_views(kind, e, dgate_up, ddown, dgate_up_bias, ddown_bias)
            dw[n, j] = np.dot(dy[n], h[n, j])
            dh = W[n, j] * dy[n]
            if kind == "plain":
                gate, up, act_cache, m = pairs[n][j]
                dm = Wd.T @ dh
                dgate, dup = gate, _moe_act(activation)[1](dm, act_cache)  # gate: empty
            elif kind == "swiglu":
                gate, up, a, act_cache, m = pairs[n][j]
                dm = Wd.T @ dh
                dup = dm * a
                dgate = _moe_act(activation)[1](dm * up, act_cache)
            else:
                gate, up, g, u, s, m = pairs[n][j]
                dm = Wd.T @ dh
                du = dm * g * s
                dg = dm * (u + 1.0) * (s + g * alpha * s * (1.0 - s))
                dup = du * ((up >= -limit) & (up <= limit))
                dgate = dg * (gate <= limit)
            dWd += np.outer(dh, m)  # the views write into ddown[e] (and the others below)
            dWg += np.outer(dgate, X[n])
            dWu += np.outer(dup, X[n])
            if dbd is not None:
                dbd += dh
            if dbg is not None:
                dbg += dgate
                dbu += dup
            dx[n] += Wg.T @ dgate + Wu.T @ dup
    return dx.reshape(x_shape), dw.reshape(x_shape[:-1] + (k,)), dgate_up, ddown, dgate_up_bias, ddown_bias


def moe_experts_jvp(cache: MoeExpertsCache, *tangents: Optional[Array]) -> Array:
    """``ty (..., H)`` along ``(tx, tweights, tgate_up, tdown, tgate_up_bias, tdown_bias)`` (the
    backward's order; the indices have no tangent).  Per pair, the forward's lines differentiated::

        tgate = Wg tx + tWg x + tbg,   tup = Wu tx + tWu x + tbu
        "swiglu":  tm = act'(gate) tgate up + a tup
        "plain":   tm = act'(up) tup
        "gpt_oss": tg = tgate [gate <= limit],  tu = tup [-limit <= up <= limit],
                   tm = tu g s + (u + 1) tg (s + g alpha s (1 - s))
        th = Wd tm + tWd m + tbd
        ty_n += tw_nj h + w_nj th
    """
    tx, tweights, tgate_up, tdown, tgate_up_bias, tdown_bias = _padded(tangents, 6)
    X, I, W, h, pairs = cache.x, cache.indices, cache.weights, cache.h, cache.pairs
    kind, activation, alpha, limit, x_shape = cache.kind, cache.activation, cache.alpha, cache.limit, cache.x_shape
    gate_up, down, _, _ = cache.params
    N, k = I.shape
    TX = None if tx is None else tx.reshape(X.shape)
    TW = None if tweights is None else tweights.reshape(I.shape)
    TGU = np.zeros(gate_up.shape, X.dtype) if tgate_up is None else tgate_up  # read with a bias tangent alone too
    ty = np.zeros(X.shape, X.dtype)
    for n in range(N):
        for j in range(k):
            e = I[n, j]
            Wg, Wu, Wd, _, _, _ = _expert_views(kind, e, gate_up, down)
            tgate, tup, th = (
                np.zeros(Wg.shape[0], X.dtype),
                np.zeros(Wu.shape[0], X.dtype),
                np.zeros(Wd.shape[0], X.dtype),
            )
            if TX is not None:
                tgate, tup = tgate + Wg @ TX[n], tup + Wu @ TX[n]
            if tgate_up is not None or tgate_up_bias is not None:
                tWg, tWu, _, tbg, tbu, _ = _expert_views(kind, e, TGU, down, tgate_up_bias)
                tgate, tup = _plus(tgate + tWg @ X[n], tbg), _plus(tup + tWu @ X[n], tbu)
            if kind == "plain":
                gate, up, act_cache, m = pairs[n][j]
                tm = _moe_act(activation)[1](tup, act_cache)  # act' is diagonal
            elif kind == "swiglu":
                gate, up, a, act_cache, m = pairs[n][j]
                tm = _moe_act(activation)[1](tgate, act_cache) * up + a * tup  # act' is diagonal
            else:
                gate, up, g, u, s, m = pairs[n][j]
                tg = tgate * (gate <= limit)
                tu = tup * ((up >= -limit) & (up <= limit))
                tm = tu * g * s + (u + 1.0) * tg * (s + g * alpha * s * (1.0 - s))
            th = th + Wd @ tm
            if tdown is not None:
                th = th + _expert_views(kind, e, gate_up, tdown)[2] @ m
            if tdown_bias is not None:
                th = th + tdown_bias[e]
            ty[n] += W[n, j] * th
            if TW is not None:
                ty[n] += TW[n, j] * h[n, j]
    return ty.reshape(x_shape)


def _moe_act_second(activation):
    """A SwiGLU or plain expert's activation's second order (``<act>_backward_jvp``), from this file."""
    return {
        "silu": silu_backward_jvp,
        "gelu": gelu_backward_jvp,
        "gelu_tanh": gelu_backward_jvp,
        "relu2": relu2_backward_jvp,
    }.get(activation, relu_backward_jvp)


def _plain_second(pair, activation, tup, dm, tdm):
    """One token-expert pair of a plain (not gated) expert, second order: ``m = act(up)``, its
    tangent ``tm = act'(up) tup``, and ``dup = act'(up) dm`` with its tangent, the activation's own
    second order along ``(tup, tdm)``; the gate's are empty."""
    gate, up, act_cache, m = pair
    tm = _moe_act(activation)[1](tup, act_cache)  # act' is diagonal
    dup, tdup = _moe_act_second(activation)(dm, act_cache, (tup,), tdm)
    return tm, dup, tdup, gate, gate


def _swiglu_second(pair, activation, tgate, tup, dm, tdm):
    """One token-expert pair of a SwiGLU expert, second order: the tangent ``tm`` of the gated
    unit ``m = act(gate) up``, and ``dup``, ``dgate`` with their tangents."""
    gate, up, a, act_cache, m = pair
    backward = _moe_act(activation)[1]
    ta = backward(tgate, act_cache)  # act' is diagonal: its backward applied to tgate
    tm = ta * up + a * tup
    # dup = dm a: product rule
    dup = dm * a
    tdup = tdm * a + dm * ta
    # dgate = act'(gate) (dm up): the activation's second order along (tgate, d(dm up))
    dgate, tdgate = _moe_act_second(activation)(dm * up, act_cache, (tgate,), tdm * up + dm * tup)
    return tm, dup, tdup, dgate, tdgate


def _gpt_oss_second(pair, alpha, limit, tgate, tup, dm, tdm):
    """One token-expert pair of GPT-OSS's clamped SwiGLU, second order: ``m = (u + 1) phi(g)``,
    ``phi(g) = g sigmoid(alpha g)``, its tangent ``tm``, and ``dup``, ``dgate`` with their tangents."""
    gate, up, g, u, s, m = pair
    inside, below = (up >= -limit) & (up <= limit), gate <= limit  # the clamps' masks: constants
    tg, tu = tgate * below, tup * inside
    dphi = s + g * alpha * s * (1.0 - s)  # phi'(g), phi(g) = g sigmoid(alpha g)
    d2phi = alpha * s * (1.0 - s) * (2.0 + alpha * g * (1.0 - 2.0 * s))  # phi''(g)
    tm = tu * g * s + (u + 1.0) * dphi * tg
    # du = dm phi(g): tdu = tdm phi(g) + dm phi'(g) tg
    dup = dm * g * s * inside
    tdup = (tdm * g * s + dm * dphi * tg) * inside
    # dg = dm (u + 1) phi'(g): three moving factors
    dgate = dm * (u + 1.0) * dphi * below
    tdgate = (tdm * (u + 1.0) * dphi + dm * tu * dphi + dm * (u + 1.0) * d2phi * tg) * below
    return tm, dup, tdup, dgate, tdgate


def moe_experts_backward_jvp(dout: Array, cache: MoeExpertsCache, tangents, ddout: Optional[Array] = None):
    """Second order: ``moe_experts_backward``'s gradients and their tangents along ``tangents =
    (tx, tweights, tgate_up, tdown, tgate_up_bias, tdown_bias)`` (``moe_experts_jvp``'s order,
    None or left out: zero) and ``ddout`` (``tdy``; None: zero).  The indices are a constant (the
    choice is piecewise constant: no tangent).  Per pair, the forward's tangents first
    (``moe_experts_jvp``'s lines: ``tgate``, ``tup``, ``tm``, ``th``), then each line of the
    backward differentiated by the product rule::

        dw = <dy, h>             tdw = <tdy, h> + <dy, th>
        dh = w dy                tdh = tw dy + w tdy
        dm = Wd^T dh             tdm = tWd^T dh + Wd^T tdh
        dWd += dh m^T            tdWd += tdh m^T + dh tm^T,     tdbd += tdh
        "plain":   dup = act'(up) dm         tdup = act'(up) tdm + act''(up) tup dm  (the activation's
                                             own second order; no gate)
        "swiglu":  dup = dm a                tdup = tdm a + dm ta,   ta = act'(gate) tgate
                   dgate = act'(gate) dm up  tdgate = act'(gate) (tdm up + dm tup) + act''(gate) tgate dm up
                                             (the activation's own second order)
        "gpt_oss": phi(g) = g s, phi' = s + g alpha s (1 - s), phi'' = alpha s (1 - s) (2 + alpha g (1 - 2 s))
                   du = dm phi(g)            tdu = tdm phi(g) + dm phi' tg
                   dg = dm (u + 1) phi'      tdg = tdm (u + 1) phi' + dm tu phi' + dm (u + 1) phi'' tg
                   the clamps: constants masks, tdup = tdu [in], tdgate = tdg [gate <= limit]
                   (with tg, tu the clamped tangents, as in the JVP)
        dWg += dgate x^T         tdWg += tdgate x^T + dgate tx^T,   tdbg += tdgate     (and so for up)
        dx += Wg^T dgate + ...   tdx += tWg^T dgate + Wg^T tdgate + tWu^T dup + Wu^T tdup

    Returns ``(grads, grad_tangents)``, both in the backward's order (the bias entries None when
    the forward had no such bias).
    """
    tx, tweights, tgate_up, tdown, tgate_up_bias, tdown_bias = _padded(tangents or (), 6)
    X, I, W, h, pairs = cache.x, cache.indices, cache.weights, cache.h, cache.pairs
    kind, activation, alpha, limit, x_shape = cache.kind, cache.activation, cache.alpha, cache.limit, cache.x_shape
    gate_up, down, gate_up_bias, down_bias = cache.params
    grads = moe_experts_backward(dout, cache)
    dy = dout.reshape(X.shape)
    N, k = I.shape

    def zeros(a):
        return np.zeros(a.shape, X.dtype)

    tdy = zeros(X) if ddout is None else ddout.reshape(X.shape)
    TX = zeros(X) if tx is None else tx.reshape(X.shape)
    TW = np.zeros(I.shape, X.dtype) if tweights is None else tweights.reshape(I.shape)
    tgate_up = zeros(gate_up) if tgate_up is None else tgate_up
    tdown = zeros(down) if tdown is None else tdown
    tdx, tdw = zeros(X), np.zeros(I.shape, X.dtype)
    tdgate_up, tddown = zeros(gate_up), zeros(down)
    tdgate_up_bias = None if gate_up_bias is None else zeros(gate_up_bias)
    tddown_bias = None if down_bias is None else zeros(down_bias)
    for n in range(N):
        for j in range(k):
            e = I[n, j]
            Wg, Wu, Wd, _, _, _ = _expert_views(kind, e, gate_up, down)
            tWg, tWu, tWd, tbg, tbu, tbd = _expert_views(kind, e, tgate_up, tdown, tgate_up_bias, tdown_bias)
            tdWg, tdWu, tdWd, tdbg, tdbu, tdbd = _expert_views(kind, e, tdgate_up, tddown, tdgate_up_bias, tddown_bias)
            # the forward's tangents (moe_experts_jvp's lines)
            tgate, tup = _plus(Wg @ TX[n] + tWg @ X[n], tbg), _plus(Wu @ TX[n] + tWu @ X[n], tbu)
            # dh = w dy: both factors move
            dh = W[n, j] * dy[n]
            tdh = TW[n, j] * dy[n] + W[n, j] * tdy[n]
            # dm = Wd^T dh: both factors move
            dm = Wd.T @ dh
            tdm = tWd.T @ dh + Wd.T @ tdh
            if kind == "plain":
                m = pairs[n][j][-1]
                tm, dup, tdup, dgate, tdgate = _plain_second(pairs[n][j], activation, tup, dm, tdm)
            elif kind == "swiglu":
                m = pairs[n][j][-1]
                tm, dup, tdup, dgate, tdgate = _swiglu_second(pairs[n][j], activation, tgate, tup, dm, tdm)
            else:
                m = pairs[n][j][-1]
                tm, dup, tdup, dgate, tdgate = _gpt_oss_second(pairs[n][j], alpha, limit, tgate, tup, dm, tdm)
            th = _plus(Wd @ tm + tWd @ m, tbd)
            # dw = <dy, h>: both move
            tdw[n, j] = np.dot(tdy[n], h[n, j]) + np.dot(dy[n], th)
            # dWd += dh m^T, dbd += dh
            tdWd += np.outer(tdh, m) + np.outer(dh, tm)
            if tdbd is not None:
                tdbd += tdh
            # dWg += dgate x^T (and up), dbg += dgate
            tdWg += np.outer(tdgate, X[n]) + np.outer(dgate, TX[n])
            tdWu += np.outer(tdup, X[n]) + np.outer(dup, TX[n])
            if tdbg is not None:
                tdbg += tdgate
                tdbu += tdup
            # dx += Wg^T dgate + Wu^T dup
            tdx[n] += tWg.T @ dgate + Wg.T @ tdgate + tWu.T @ dup + Wu.T @ tdup
    tangents_out = (tdx.reshape(x_shape), tdw.reshape(x_shape[:-1] + (k,)), tdgate_up, tddown)
    return grads, tangents_out + (tdgate_up_bias, tddown_bias)


__all__ += _op_names("topk_router", "moe_experts")


# == Kimi Delta Attention: the gated delta rule with a decay per channel ============================
# Kimi Linear's linear-attention layer (transformers' ``KimiLinearDeltaAttention``, its
# ``recurrent_kimi_delta_attention``; FLA's ``naive_recurrent_kda``): the gated delta rule above,
# but the log decay of a step is a vector ``g_t (Dk,)``, one number per row of the state ``S (Dk,
# Dv)``: the memory forgets each key channel at its own rate, ``S <- diag(e^{g_t}) S``.  With
# ``g_t`` the same in every channel it is ``gated_delta_rule`` exactly.


class KimiDeltaAttentionCache(GatedDeltaRuleCache):
    """What ``kimi_delta_attention_backward`` needs (textbook: every state ``S_0 .. S_{L-1}``): the
    gated delta rule's fields, but ``g (B..., H, L, Dk)``, one log decay per key channel."""

    __slots__ = ()


def kimi_delta_attention(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    beta: Array,
    *,
    scale: Optional[float] = None,
    initial_state: Optional[Array] = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    chunk_size: int = 16,
) -> Tuple[Array, KimiDeltaAttentionCache]:
    """Kimi Delta Attention, one step at a time (transformers' ``recurrent_kimi_delta_attention``).

    ``q, k (B..., H, L, Dk)``, ``v (B..., H, L, Dv)``, ``g (B..., H, L, Dk)``, ``beta (B..., H,
    L)``.  With ``use_qk_l2norm`` q and k first become ``x / sqrt(sum x^2 + 1e-6)``; q is
    multiplied by ``scale`` (default ``1/sqrt(Dk)``).  From ``S_0 = initial_state`` (zeros if
    None), each step:

        S <- diag(e^{g_t}) S                  row d of the memory decays by e^{g_td} (g_t <= 0 in Kimi)
        u_t = beta_t (v_t - S^T k_t)          the delta: what the memory got wrong about v_t, scaled
        S <- S + k_t u_t^T                    write the correction under key k_t
        o_t = S^T q_t

    The decay is the only change from ``gated_delta_rule``: there ``e^{g_t}`` is one number, here
    a diagonal matrix, so a channel of the key space can keep its memory for long while another
    forgets within a few steps.  Returns ``(o (B..., H, L, Dv), cache)``; ``cache.final_state`` is
    ``S_L`` when ``output_final_state``.  ``chunk_size`` is the fast tier's (it changes nothing
    there either): the recurrence has no chunks.  The steps are both rules' (``_delta_rule``).

    Examples
    --------
    A decay the same in every channel is the gated delta rule:

    >>> import numpy as np
    >>> from npattn.functional import reference as R
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 2, 5, 3)) for _ in range(3))
    >>> g, beta = -rng.random((1, 2, 5)), rng.random((1, 2, 5))
    >>> out, _ = R.kimi_delta_attention(q, k, v, np.repeat(g[..., None], 3, -1), beta, use_qk_l2norm=True)
    >>> ref, _ = R.gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True)
    >>> bool(np.allclose(out, ref, rtol=0, atol=1e-14))
    True
    """
    return _delta_rule(
        KimiDeltaAttentionCache, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm
    )


def kimi_delta_attention_backward(
    dout: Array, cache: KimiDeltaAttentionCache, dfinal_state: Optional[Array] = None
) -> Tuple[Array, Array, Array, Array, Array, Optional[Array]]:
    """Backpropagation through time, with ``dS`` the adjoint of the state.

    Step t, starting from ``P = S_{t-1}``, computed ``A = diag(e^{g_t}) P`` (``A_dv = e^{g_td}
    P_dv``), ``u = beta_t (v_t - A^T k_t)``, ``S_t = A + k_t u^T`` and ``o_t = S_t^T q_t``.  Later
    steps see ``S_t`` only, so everything after step t reaches it through one matrix ``dS =
    dL/dS_t`` (``dfinal_state`` at t = L, else 0); walking t = L .. 1 backwards::

        o_t = S_t^T q_t:          dS += q_t do_t^T;          dq_t = S_t do_t
        S_t = A + k_t u^T:        dA  = dS;                  dk_t = dS u;  du = dS^T k_t
        u = beta_t (v_t - A^T k_t), with delta = v_t - A^T k_t (so u = beta_t delta):
                                  dbeta_t = du . delta;      dv_t = beta_t du
                                  dA -= k_t (beta_t du)^T;   dk_t -= A (beta_t du)
        A_dv = e^{g_td} P_dv:     dg_td = e^{g_td} sum_v dA_dv P_dv = sum_v dA_dv A_dv  (row d of <dA, A>)
                                  dS_{t-1} = diag(e^{g_t}) dA

    so ``dS_{t-1} = diag(e^{g_t}) (I - beta_t k_t k_t^T) (dS_t + q_t do_t^T)``: the adjoint runs
    the same decay-and-erase map, transposed, in reverse time (``diag(e^{g_t})`` is its own
    transpose); ``dinitial_state = dS_0``.  The scalar rule's ``dg_t = <dA, A>`` is the sum of
    these rows: a decay shared by the channels gets the sum of their gradients.  Then the chain
    rule through ``q = scale * l2(q_in)`` and ``k = l2(k_in)``.  Returns ``(dq, dk, dv, dg, dbeta,
    dinitial_state)``, the last None without an initial state.  The walk is both rules'
    (``_delta_rule_backward``).
    """
    return _delta_rule_backward(dout, cache, dfinal_state)


def kimi_delta_attention_jvp(cache: KimiDeltaAttentionCache, *tangents: Optional[Array]):
    """Forward mode: the tangent of the outputs along ``(tq, tk, tv, tg, tbeta, tinitial_state)``
    (the backward's order; None or left out = zero), one step at a time as the forward.

    With ``A = diag(e^{g_t}) P`` (``P = S_{t-1}``), ``delta = v_t - A^T k_t``, ``u = beta_t
    delta``, ``S_t = A + k_t u^T`` and ``o_t = S_t^T q_t``, the product rule gives

        tA = diag(e^{g_t}) (diag(tg_t) P + tP)     (row d: e^{g_td} (tg_td P_d + tP_d))
        tdelta = tv_t - tA^T k_t - A^T tk_t;      tu = tbeta_t delta + beta_t tdelta
        tS_t = tA + tk_t u^T + k_t tu^T;          to_t = tS_t^T q_t + S_t^T tq_t

    (``tq``, ``tk`` first through ``l2_norm``'s JVP and the scale).  Returns ``tout``, or
    ``(tout, tfinal_state)`` when the forward kept the final state.  The lines are both rules'
    (``_delta_rule_jvp``, the decay held per row of the state).
    """
    return _delta_rule_jvp(cache, tangents)


def kimi_delta_attention_backward_jvp(
    dout: Array,
    cache: KimiDeltaAttentionCache,
    tangents,
    ddout: Optional[Array] = None,
    dfinal_state: Optional[Array] = None,
    ddfinal_state: Optional[Array] = None,
):
    """Second order: ``kimi_delta_attention_backward(dout, cache, dfinal_state)``'s gradients and
    their tangents when the inputs move along ``tangents = (tq, tk, tv, tg, tbeta,
    tinitial_state)`` (``kimi_delta_attention_jvp``'s order; None or left out: zero), ``dout``
    along ``ddout`` and ``dfinal_state`` along ``ddfinal_state`` (None: zero).

    First the forward's tangents (``kimi_delta_attention_jvp``'s lines), keeping every
    ``tS_{t-1}`` beside ``S_{t-1}``; then the backward's walk t = L .. 1, each line differentiated
    by the product rule, ``tdS`` starting at ``ddfinal_state``; ``E = diag(e^{g_t})`` and ``tG =
    diag(tg_t)`` (diagonal: ``E tG = tG E``, each its own transpose)::

        A = E P                         tA = E (tG P + tP)
        delta = v_t - A^T k_t           tdelta = tv_t - tA^T k_t - A^T tk_t
        u = beta_t delta                tu = tbeta_t delta + beta_t tdelta
        S_t = A + k_t u^T               tS_t = tA + tk_t u^T + k_t tu^T
        dS += q_t do_t^T                tdS += tq_t do_t^T + q_t tdo_t^T
        dq_t = S_t do_t                 tdq_t = tS_t do_t + S_t tdo_t
        du = dS^T k_t                   tdu = tdS^T k_t + dS^T tk_t
        dk_t = dS u                     tdk_t = tdS u + dS tu
        dbeta_t = du . delta            tdbeta_t = tdu . delta + du . tdelta
        dv_t = beta_t du                tdv_t = tbeta_t du + beta_t tdu
        dA = dS - k_t (beta_t du)^T     tdA = tdS - tk_t (beta_t du)^T - k_t tdv_t^T
        dk_t -= A (beta_t du)           tdk_t -= tA (beta_t du) + A tdv_t
        dg_td = sum_v dA_dv A_dv        tdg_td = sum_v (tdA_dv A_dv + dA_dv tA_dv)     (row d)
        dS_{t-1} = E dA                 tdS_{t-1} = E (tG dA + tdA)

    the gated delta rule's walk (``gated_delta_rule_backward_jvp``) with the decay a diagonal
    matrix: both rules share it (``_delta_rule_grad_tangents``), the scalar rule's decay being
    one row that broadcasts over the ``Dk`` rows and its ``tdg_t`` the sum of the rows'.  Then
    ``dq = scale dq``, ``tdq = scale tdq`` and, with ``use_qk_l2norm``, ``l2_norm``'s second order
    along the raw ``tq``, ``tk``.  Returns ``(grads, grad_tangents)``, both in the backward's
    order (``dinitial_state`` and its tangent None without an initial state); ``tdg`` of g's
    shape ``(B..., H, L, Dk)``.
    """
    grads = kimi_delta_attention_backward(dout, cache, dfinal_state)
    tans = _delta_rule_grad_tangents(
        kimi_delta_attention_backward, dout, cache, tangents, ddout, dfinal_state, ddfinal_state
    )
    return grads, tans


__all__ += [
    "kimi_delta_attention",
    "kimi_delta_attention_backward",
    "kimi_delta_attention_jvp",
    "kimi_delta_attention_backward_jvp",
]


# == DeepSeek sparse attention (DSA) ==================================================================
# DeepSeek-V3.2's attention (transformers' ``deepseek_v32``, ``DeepseekV32Indexer`` and
# ``DeepseekV32Attention``): a small "lightning indexer" scores every (query, key) pair cheaply, each
# query keeps its ``topk`` best keys, and the main (MLA) attention runs over those keys only.  Three
# pairs: the indexer's scores, attention restricted to a given set of keys, and the indexer's own
# training loss (a KL divergence to the main attention's distribution).
#
# The choice of the top-k keys is piecewise constant: a small move of the scores leaves the chosen
# set as it is (away from ties), so its derivative is 0 wherever it exists.  No gradient reaches the
# indexer through the main attention; the indexer learns from its KL loss alone (DeepSeek detaches
# the indexer's input there, and transformers runs the indexer under ``no_grad``).


class LightningIndexerCache(NamedTuple):
    """What ``lightning_indexer_backward`` needs: the inputs and the scores before the ReLU."""

    q: np.ndarray  # (B..., H, Lq, D) indexer queries
    k: np.ndarray  # (B..., Lk, D) indexer keys, one per token shared by the heads
    weights: np.ndarray  # (B..., Lq, H) per-query head weights
    s: np.ndarray  # (B..., H, Lq, Lk) scale q k^T, before the ReLU
    scale: float


def lightning_indexer(
    q: Array, k: Array, weights: Array, *, scale: Optional[float] = None
) -> Tuple[Array, LightningIndexerCache]:
    """The lightning indexer's scores: ``I (B..., Lq, Lk)``,

        I[l, t] = sum_h weights[l, h] * relu(scale * q[h, l] . k[t])

    ``q (B..., H, Lq, D)`` (one indexer query per head), ``k (B..., Lk, D)`` (one indexer key per
    token, shared by the heads), ``weights (B..., Lq, H)`` (transformers: ``weights_proj(x) *
    H**-0.5``); ``scale`` defaults to ``1/sqrt(D)``.  No mask here: the caller hides keys before the
    top-k choice.  The scores are not a distribution (negative weights make negative scores).

    Examples
    --------
    >>> import numpy as np
    >>> from npattn.functional import reference as R
    >>> rng = np.random.default_rng(0)
    >>> q, k, w = rng.standard_normal((2, 3, 4)), rng.standard_normal((5, 4)), rng.standard_normal((3, 2))
    >>> out, _ = R.lightning_indexer(q, k, w)
    >>> one = sum(w[1, h] * max(q[h, 1] @ k[4] / 2.0, 0.0) for h in range(2))
    >>> bool(np.isclose(out[1, 4], one, rtol=0, atol=1e-14))
    True
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = scale * (q @ k[..., None, :, :].swapaxes(-1, -2))  # (B..., H, Lq, Lk): every head against the shared keys
    out = np.zeros(s.shape[:-3] + s.shape[-2:], s.dtype)
    for h in range(q.shape[-3]):  # a weighted sum of the heads' ReLU scores
        out = out + weights[..., :, h, None] * np.maximum(s[..., h, :, :], 0)
    return out, LightningIndexerCache(q, k, weights, s, scale)


def lightning_indexer_backward(dout: Array, cache: LightningIndexerCache) -> Tuple[Array, Array, Array]:
    """Backward of ``lightning_indexer``: ``(dq, dk, dweights)``.

    With ``s_h = scale q_h k^T``, ``r_h = relu(s_h)`` and ``I = sum_h w_h r_h`` (``w_h`` a column
    ``(Lq, 1)``, broadcast over the keys), line by line backwards::

        I = sum_h w_h r_h:       dw_h = sum_t dI r_h      (one number per query: summed over keys)
                                 dr_h = w_h dI
        r_h = relu(s_h):         ds_h = dr_h [s_h > 0]    (0 at the kink, as torch)
        s_h = scale q_h k^T:     dq_h = scale ds_h k;     dk = scale sum_h ds_h^T q_h

    The key is shared by the heads, so its gradient is the sum over the heads (a broadcast's
    adjoint is a sum)."""
    q, k, w, s, scale = cache.q, cache.k, cache.weights, cache.s, cache.scale
    r = np.maximum(s, 0)
    dw = np.zeros(w.shape, s.dtype)
    ds = np.zeros(s.shape, s.dtype)
    for h in range(q.shape[-3]):
        dw[..., :, h] = (dout * r[..., h, :, :]).sum(axis=-1)  # dw_h = sum_t dI r_h
        ds[..., h, :, :] = w[..., :, h, None] * dout * (s[..., h, :, :] > 0)  # ds_h = w_h dI [s_h > 0]
    dq = scale * (ds @ k[..., None, :, :])  # (B..., H, Lq, D)
    dk = scale * (ds.swapaxes(-1, -2) @ q).sum(axis=-3)  # (B..., Lk, D): the shared key, summed over heads
    return dq, dk, dw


def lightning_indexer_jvp(cache: LightningIndexerCache, *tangents: Optional[Array]) -> Array:
    """Forward mode along ``(tq, tk, tweights)``: by the product rule,

    ts_h = scale (tq_h k^T + q_h tk^T);    tI = sum_h (tw_h r_h + w_h [s_h > 0] ts_h)
    """
    q, k, w, s, scale = cache.q, cache.k, cache.weights, cache.s, cache.scale
    tq, tk, tw = _padded(tangents, 3)
    ts = np.zeros(s.shape, s.dtype)
    if tq is not None:
        ts = ts + scale * (tq @ k[..., None, :, :].swapaxes(-1, -2))
    if tk is not None:
        ts = ts + scale * (q @ tk[..., None, :, :].swapaxes(-1, -2))
    out = np.zeros(s.shape[:-3] + s.shape[-2:], s.dtype)
    for h in range(q.shape[-3]):
        out = out + w[..., :, h, None] * (s[..., h, :, :] > 0) * ts[..., h, :, :]
        if tw is not None:
            out = out + tw[..., :, h, None] * np.maximum(s[..., h, :, :], 0)
    return out


def lightning_indexer_backward_jvp(dout: Array, cache: LightningIndexerCache, tangents, ddout: Optional[Array] = None):
    """Second order: ``lightning_indexer_backward``'s gradients and their tangents along
    ``tangents = (tq, tk, tweights)`` and ``ddout``.  Each line of the backward by the product
    rule (the ReLU's mask is piecewise constant: its own tangent is 0)::

        dw_h = sum_t dI r_h                tdw_h = sum_t (tdI r_h + dI [s_h > 0] ts_h)
        ds_h = w_h dI [s_h > 0]            tds_h = (tw_h dI + w_h tdI) [s_h > 0]
        dq_h = scale ds_h k                tdq_h = scale (tds_h k + ds_h tk)
        dk = scale sum_h ds_h^T q_h        tdk = scale sum_h (tds_h^T q_h + ds_h^T tq_h)
    """
    q, k, w, s, scale = cache.q, cache.k, cache.weights, cache.s, cache.scale
    tq, tk, tw = _padded(tuple(tangents or ()), 3)
    grads = lightning_indexer_backward(dout, cache)
    tdout = np.zeros_like(dout) if ddout is None else ddout
    on = s > 0
    ts = np.zeros(s.shape, s.dtype)
    if tq is not None:
        ts = ts + scale * (tq @ k[..., None, :, :].swapaxes(-1, -2))
    if tk is not None:
        ts = ts + scale * (q @ tk[..., None, :, :].swapaxes(-1, -2))
    ds = np.zeros(s.shape, s.dtype)
    tds = np.zeros(s.shape, s.dtype)
    tdw = np.zeros(w.shape, s.dtype)
    for h in range(q.shape[-3]):
        r_h, on_h = np.maximum(s[..., h, :, :], 0), on[..., h, :, :]
        tdw[..., :, h] = (tdout * r_h + dout * on_h * ts[..., h, :, :]).sum(axis=-1)
        ds[..., h, :, :] = w[..., :, h, None] * dout * on_h
        tds_h = w[..., :, h, None] * tdout
        if tw is not None:
            tds_h = tds_h + tw[..., :, h, None] * dout
        tds[..., h, :, :] = tds_h * on_h
    tdq = scale * (tds @ k[..., None, :, :])
    tdk = scale * (tds.swapaxes(-1, -2) @ q).sum(axis=-3)
    if tk is not None:
        tdq = tdq + scale * (ds @ tk[..., None, :, :])
    if tq is not None:
        tdk = tdk + scale * (ds.swapaxes(-1, -2) @ tq).sum(axis=-3)
    return grads, (tdq, tdk, tdw)


def _selected(indices, lk):
    """The mask ``[t in S_l]`` of a top-k choice: ``indices (B..., Lq, K)`` (key positions, -1 for
    an empty slot) -> bool ``(B..., 1, Lq, Lk)`` (True = may attend; one head axis, shared)."""
    mask = np.zeros(indices.shape[:-1] + (lk,), bool)
    for slot in range(indices.shape[-1]):
        mask |= indices[..., slot, None] == np.arange(lk)
    return mask[..., None, :, :]


def sparse_attention(
    q: Array, k: Array, v: Array, indices: Array, *, scale: Optional[float] = None
) -> Tuple[Array, AttentionCache]:
    """Attention restricted to chosen keys: query ``l`` attends to the keys ``S_l = {indices[l, j]}``
    only (DeepSeek sparse attention's main attention, its keys chosen by the indexer's top-k),

        out[h, l] = sum_{t in S_l} softmax_{t in S_l}(scale q[h, l] . k[t]) v[t]

    ``q (B..., H, Lq, E)``, ``k (B..., Hk, Lk, E)``, ``v (B..., Hk, Lk, Ev)`` (``Hk`` divides ``H``:
    query head h reads kv head ``h // (H / Hk)``; MLA's absorbed form has ``Hk = 1``), ``indices
    (B..., Lq, K)`` integer key positions, distinct within a row, ``-1`` for an empty slot (a query
    with fewer than K keys to choose from); the same keys for every head.  A query with no key gets 0.

    Textbook form: restricting the softmax to ``S_l`` is attention with the boolean mask
    ``M[l, t] = [t in S_l]``, which is what this computes (``scaled_dot_product_attention`` with that
    mask; the cache is its cache).  The fast tier gathers the K keys instead and never forms an
    ``(Lq, Lk)`` array.

    Examples
    --------
    >>> import numpy as np
    >>> from npattn.functional import reference as R
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((1, 2, 3)), rng.standard_normal((1, 4, 3)), rng.standard_normal((1, 4, 2))
    >>> out, _ = R.sparse_attention(q, k, v, np.array([[1, 3], [0, -1]]))
    >>> s = q[0, 0] @ k[0, [1, 3]].T / np.sqrt(3)
    >>> p = np.exp(s) / np.exp(s).sum()
    >>> bool(np.allclose(out[0, 0], p @ v[0, [1, 3]], rtol=0, atol=1e-14))
    True
    """
    mask = _selected(indices, k.shape[-2])
    return scaled_dot_product_attention(q, k, v, mask, scale=scale, enable_gqa=True)


def sparse_attention_backward(dout: Array, cache: AttentionCache) -> Tuple[Array, ...]:
    """Backward of ``sparse_attention``: ``(dq, dk, dv)``; the indices get none.

    The chosen set enters as a constant mask: for fixed ``S`` the op is masked attention, so its
    gradient is masked attention's (``scaled_dot_product_attention_backward``: ``dz = P (dP -
    rowsum(dP P))`` with ``P = 0`` off ``S``, hence no gradient to a key no query chose).  The
    choice itself, made from the indexer's scores, is piecewise constant; its derivative is 0
    (and undefined at a tie), so nothing flows back to the indices."""
    return scaled_dot_product_attention_backward(dout, cache)[:3]


def sparse_attention_jvp(cache: AttentionCache, *tangents: Optional[Array]) -> Array:
    """Forward mode along ``(tq, tk, tv)``: masked attention's JVP, the mask fixed (``tP = 0`` off ``S``)."""
    return scaled_dot_product_attention_jvp(cache, *_padded(tangents, 3)[:3])


def sparse_attention_backward_jvp(dout: Array, cache: AttentionCache, tangents, ddout: Optional[Array] = None):
    """Second order: masked attention's (``scaled_dot_product_attention_backward_jvp``), the mask fixed."""
    grads, grad_tangents = scaled_dot_product_attention_backward_jvp(
        dout, cache, _padded(tuple(tangents or ()), 3)[:3], ddout
    )
    return grads[:3], grad_tangents[:3]


class IndexerKLCache(NamedTuple):
    """What ``indexer_kl_loss_backward`` needs: the indexer's distribution, the target and the weights."""

    p_index: np.ndarray  # (B..., Lq, Lk) softmax of the indexer's scores over the visible keys
    target: np.ndarray  # (B..., Lq, Lk) the main attention's distribution (heads summed, normalised)
    has_target: np.ndarray  # (B..., Lq, 1) 1 where the row's target has mass, else 0
    weight: float  # 1 (reduction "sum") or 1 / rows ("mean")


def indexer_kl_loss(
    scores: Array, attn: Array, *, mask: Optional[Array] = None, reduction: str = "sum"
) -> Tuple[Array, IndexerKLCache]:
    """The lightning indexer's training loss (DeepSeek-V3.2): for each query row,

        target = sum_h attn[h] restricted to the visible keys, normalised to sum 1   (held fixed)
        loss_l = KL(target_l || softmax(scores_l)) = sum_t target_lt (log target_lt - log softmax(scores_l)_t)

    summed over the rows (``reduction="sum"``, DeepSeek's formula) or averaged over them (``"mean"``).
    ``scores (B..., Lq, Lk)`` are the indexer's (``lightning_indexer``), ``attn (B..., H, Lq, Lk)``
    the main attention's weights; ``mask`` bool ``(B..., Lq, Lk)`` True = visible (causal, and in the
    sparse stage the chosen keys), None = all.  The softmax runs over the visible keys;
    ``0 log 0 = 0``; a row with no visible key or no target mass adds 0.  The target is a constant
    (DeepSeek detaches it: the main attention is not trained to follow the indexer), so the backward
    returns ``dscores`` alone.

    Examples
    --------
    A target equal to the indexer's own distribution costs nothing:

    >>> import numpy as np
    >>> from npattn.functional import reference as R
    >>> s = np.random.default_rng(0).standard_normal((3, 4))
    >>> p = np.exp(s) / np.exp(s).sum(-1, keepdims=True)
    >>> loss, _ = R.indexer_kl_loss(s, np.stack([p, p]))
    >>> bool(abs(loss) < 1e-14)
    True
    """
    visible = np.ones(scores.shape, bool) if mask is None else np.broadcast_to(mask, scores.shape)
    mass = np.where(visible, attn.sum(axis=-3), 0)  # the heads' weights summed, hidden keys dropped
    total = mass.sum(axis=-1, keepdims=True)
    has_target = (total > 0).astype(scores.dtype)
    target = mass / np.where(total > 0, total, 1)  # normalised: a distribution over the visible keys
    z = np.where(visible, scores, -np.inf)
    top = np.max(z, axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0)  # a row with no visible key: every weight 0 below
    e = np.where(visible, np.exp(z - top), 0)
    norm = e.sum(axis=-1, keepdims=True)
    p_index = e / np.where(norm > 0, norm, 1)
    log_p_index = z - top - np.log(np.where(norm > 0, norm, 1))
    # KL, with 0 log 0 = 0: only the keys the target weighs count
    pos = target > 0  # (then the key is visible and log_p_index finite)
    terms = np.where(pos, target * (np.log(np.where(pos, target, 1)) - np.where(pos, log_p_index, 0)), 0)
    rows = math.prod(scores.shape[:-1])
    weight = 1.0 if reduction == "sum" else 1.0 / max(rows, 1)
    loss = np.asarray(terms.sum() * weight, dtype=scores.dtype)
    return loss, IndexerKLCache(p_index, target, has_target, weight)


def indexer_kl_loss_backward(dout: Array, cache: IndexerKLCache) -> Array:
    """Backward of ``indexer_kl_loss``: ``dscores`` (the target is held fixed: no gradient).

    Per row, ``loss = sum_t p_t log p_t - sum_t p_t log q_t`` with ``q = softmax(scores)`` over the
    visible keys and ``p`` the target.  The first sum does not move with the scores; ``log q_t =
    s_t - logsumexp(s)`` gives ``d(log q_t)/ds_u = [t = u] - q_u``, so

        dloss/ds_u = -p_u + (sum_t p_t) q_u = q_u - p_u        (sum_t p_t = 1 where the row has a target)

    times ``dout`` and the reduction's weight; a hidden key has ``q_u = p_u = 0``; a row without
    target mass gets 0.  The same gradient as cross-entropy with soft labels: the indexer's
    distribution is pulled towards the main attention's."""
    return dout * cache.weight * (cache.has_target * cache.p_index - cache.target)


def indexer_kl_loss_jvp(cache: IndexerKLCache, *tangents: Optional[Array]) -> Array:
    """Forward mode along ``tscores`` (the target has no tangent: it is held fixed): the
    gradient's inner product, ``tloss = weight * sum (has_target q - p) * tscores``."""
    (ts,) = _padded(tangents, 1)
    if ts is None:
        return np.zeros((), cache.p_index.dtype)
    return np.asarray(cache.weight * ((cache.has_target * cache.p_index - cache.target) * ts).sum())


def indexer_kl_loss_backward_jvp(dout: Array, cache: IndexerKLCache, tangents, ddout: Optional[Array] = None):
    """Second order: ``dscores = dout w (h q - p)`` (``h`` = has_target, ``w`` the weight) moves
    with ``dout`` and with ``q = softmax(scores)``, whose tangent is softmax's JVP::

        tq = q (ts - sum_t q_t ts_t)
        tdscores = ddout w (h q - p) + dout w h tq

    (the Hessian of the loss in the scores is ``w h (diag(q) - q q^T)`` per row, softmax's Jacobian)."""
    (ts,) = _padded(tuple(tangents or ()), 1)
    q, w, h = cache.p_index, cache.weight, cache.has_target
    grads = (indexer_kl_loss_backward(dout, cache),)
    tgrad = np.zeros_like(q)
    if ddout is not None:
        tgrad = tgrad + ddout * w * (h * q - cache.target)
    if ts is not None:
        tq = q * (ts - (q * ts).sum(axis=-1, keepdims=True))
        tgrad = tgrad + dout * w * h * tq
    return grads, (tgrad,)


__all__ += _op_names("lightning_indexer", "sparse_attention", "indexer_kl_loss")


# == Mamba-2: the selective state-space scan ========================================================
# Granite 4.0's hybrid layers (transformers' ``GraniteMoeHybridMambaLayer``, whose ``torch_forward``
# runs ``mamba2_chunk_scan`` / ``mamba2_selective_state_update``): a linear recurrence whose state
# ``S (P, N)`` per head decays by one number a step.  Shapes: ``H`` heads of ``P`` channels, ``G``
# groups sharing ``B`` and ``C`` (head h reads group ``h // (H / G)``), ``N`` the state width,
# ``L`` steps.  Head-first, as the delta rules: ``x (B..., H, L, P)``, ``B, C (B..., G, L, N)``.


class Mamba2ScanCache(NamedTuple):
    """What ``mamba2_scan_backward`` needs (textbook: every state ``S_0 .. S_{L-1}``)."""

    x: np.ndarray  # (B..., H, L, P)
    dt: np.ndarray  # (B..., H, L) the step sizes as used: clip(softplus(dt + dt_bias), *time_step_limit)
    sig: np.ndarray  # (B..., H, L) d dt / d(dt + dt_bias): sigmoid where the clip lets dt through, else 0
    A: np.ndarray  # (H,)
    B: np.ndarray  # (B..., G, L, N)
    C: np.ndarray  # (B..., G, L, N)
    D: Optional[np.ndarray]  # (H,) or None
    states: np.ndarray  # (B..., H, L, P, N) S_{t-1}, the state each step starts from
    has_dt_bias: bool
    has_initial_state: bool
    final_state: Optional[np.ndarray]  # (B..., H, P, N) S_L with output_final_state, else None


def _mamba_heads(b, heads):
    """``B`` or ``C (B..., G, L, N)`` repeated for the heads of each group: ``(B..., H, L, N)``."""
    return np.repeat(b, heads // b.shape[-3], axis=-3)


def _mamba_groups(dh, groups):
    """The gradient of ``_mamba_heads``: the copies of a group added back, ``(B..., G, L, N)``."""
    return dh.reshape(dh.shape[:-3] + (groups, dh.shape[-3] // groups) + dh.shape[-2:]).sum(-3)


def mamba2_scan(
    x: Array,
    dt: Array,
    A: Array,
    B: Array,
    C: Array,
    D: Optional[Array] = None,
    dt_bias: Optional[Array] = None,
    *,
    time_step_limit: Tuple[float, float] = (0.0, math.inf),
    initial_state: Optional[Array] = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> Tuple[Array, Mamba2ScanCache]:
    """Mamba-2's selective scan, one step at a time (transformers' ``mamba2_chunk_scan``).

    ``x (B..., H, L, P)``, ``dt (B..., H, L)`` the raw step sizes, ``A (H,)`` (negative: Mamba's
    ``-exp(A_log)``), ``B, C (B..., G, L, N)`` shared by the ``H / G`` heads of each group, ``D,
    dt_bias (H,)`` (None: zero).  The step size is ``delta_t = clip(softplus(dt_t + dt_bias),
    *time_step_limit)`` (torch's softplus: the identity above 20); from ``S_0 = initial_state``
    (zeros if None, ``(B..., H, P, N)``) each step, head by head:

        a_t = exp(delta_t A)                      the state decays by one number
        S_t = a_t S_{t-1} + delta_t x_t B_t^T     write x_t under key B_t, weighted by the step
        y_t = S_t C_t + D x_t                     read with C_t, plus the skip connection

    Returns ``(y (B..., H, L, P), cache)``; ``cache.final_state`` is ``S_L`` when
    ``output_final_state``.  ``chunk_size`` is the fast tier's (it changes nothing there either):
    the recurrence has no chunks.
    """
    heads = x.shape[-3]
    u = dt if dt_bias is None else dt + dt_bias[:, None]  # (B..., H, L)
    big = u > 20.0  # torch's softplus is the identity above its threshold 20 (and its derivative 1)
    soft = np.where(big, u, np.logaddexp(0.0, np.minimum(u, 20.0)))  # softplus(u) = log(1 + e^u)
    lo, hi = time_step_limit
    free = (soft >= lo) & (soft <= hi)  # where the clip passes softplus through (torch.clamp's gradient: 1 there)
    delta = np.clip(soft, lo, hi)
    sig = np.where(big, 1.0, 0.5 * (1.0 + np.tanh(0.5 * u)))  # softplus' = sigmoid(u), without overflow
    sig = np.where(free, sig, 0.0)  # 0 where the clip holds delta fixed
    Bh, Ch = _mamba_heads(B, heads), _mamba_heads(C, heads)  # (B..., H, L, N)
    a = np.exp(delta * A[:, None])  # (B..., H, L)
    lead, steps = x.shape[:-2], x.shape[-2]
    S = np.zeros(lead + (x.shape[-1], B.shape[-1]), x.dtype) if initial_state is None else initial_state
    states = np.zeros(lead + (steps,) + S.shape[-2:], x.dtype)
    y = np.zeros(x.shape, x.dtype)
    for t in range(steps):
        states[..., t, :, :] = S  # S_{t-1}, kept for the backward
        write = (delta[..., t, None] * x[..., t, :])[..., :, None] * Bh[..., t, None, :]  # delta_t x_t B_t^T (P, N)
        S = a[..., t, None, None] * S + write
        y[..., t, :] = np.einsum("...pn,...n->...p", S, Ch[..., t, :])  # S_t C_t
    if D is not None:
        y = y + D[:, None, None] * x
    return y, Mamba2ScanCache(
        x=x,
        dt=delta,
        sig=sig,
        A=A,
        B=B,
        C=C,
        D=D,
        states=states,
        has_dt_bias=dt_bias is not None,
        has_initial_state=initial_state is not None,
        final_state=S if output_final_state else None,
    )


def _per_head(a, axis):
    """Sum ``a`` over every axis but the heads' (``axis``): the gradient of a per-head ``(H,)``."""
    return np.moveaxis(a, axis, -1).reshape(-1, a.shape[axis]).sum(0)


def mamba2_scan_backward(
    dout: Array, cache: Mamba2ScanCache, dfinal_state: Optional[Array] = None
) -> Tuple[Array, Array, Array, Array, Array, Optional[Array], Optional[Array], Optional[Array]]:
    """Backpropagation through time, with ``dS`` the adjoint of the state.

    Step t, from ``P = S_{t-1}``, computed ``S_t = a_t P + delta_t x_t B_t^T`` and ``y_t = S_t C_t
    + D x_t``.  Later steps see ``S_t`` only, so ``dS = dL/dS_t`` carries them (``dfinal_state`` at
    t = L, else 0); walking t = L .. 1::

        y_t = S_t C_t + D x_t:         dS += dy_t C_t^T;       dC_t = S_t^T dy_t
        S_t = a_t P + delta_t x_t B_t^T, with w = dS B_t (P,):
                                       da_t = <dS, P>;          ddelta_t = x_t . w
                                       dx_t = delta_t w;        dB_t = delta_t dS^T x_t
                                       dS_{t-1} = a_t dS

    then, off the walk: ``a = exp(delta A)``: ``ddelta += da a A``, ``dA = sum da a delta``; the skip:
    ``dx += D dy``, ``dD = sum dy . x``; ``delta = clip(softplus(u))``, ``u = dt + dt_bias``:
    ``du = ddelta sigmoid(u)`` where the clip lets it through (0 where it holds), ``ddt = du``,
    ``ddt_bias = sum du``; the heads' ``dB``, ``dC`` are added up per group.
    Returns ``(dx, ddt, dA, dB, dC, dD, ddt_bias, dinitial_state)``, None where the forward had none.
    """
    x, delta, sig, A = cache.x, cache.dt, cache.sig, cache.A  # as the forward used them
    B, C, D, states = cache.B, cache.C, cache.D, cache.states
    heads, groups = x.shape[-3], B.shape[-3]
    Bh, Ch = _mamba_heads(B, heads), _mamba_heads(C, heads)
    a = np.exp(delta * A[:, None])
    dS = np.zeros(states.shape[:-3] + states.shape[-2:], x.dtype) if dfinal_state is None else dfinal_state
    dx, ddelta, da = np.zeros(x.shape, x.dtype), np.zeros(delta.shape, x.dtype), np.zeros(delta.shape, x.dtype)
    dBh, dCh = np.zeros(Bh.shape, x.dtype), np.zeros(Ch.shape, x.dtype)
    for t in reversed(range(x.shape[-2])):
        P, xt, dt_, do = states[..., t, :, :], x[..., t, :], delta[..., t, None], dout[..., t, :]
        St = a[..., t, None, None] * P + (dt_ * xt)[..., :, None] * Bh[..., t, None, :]  # recomputed
        dS = dS + do[..., :, None] * Ch[..., t, None, :]  # y_t = S_t C_t
        dCh[..., t, :] = np.einsum("...pn,...p->...n", St, do)
        da[..., t] = (dS * P).sum((-2, -1))  # S_t = a_t P + ...
        w = np.einsum("...pn,...n->...p", dS, Bh[..., t, :])  # dS B_t
        ddelta[..., t] = (xt * w).sum(-1)
        dx[..., t, :] = dt_ * w
        dBh[..., t, :] = dt_ * np.einsum("...pn,...p->...n", dS, xt)
        dS = a[..., t, None, None] * dS  # dS_{t-1}
    dlog = da * a  # a = exp(delta A): d(delta A)
    ddelta = ddelta + dlog * A[:, None]
    dA = _per_head(dlog * delta, -2)
    dD = None
    if D is not None:  # y += D x
        dx = dx + D[:, None, None] * dout
        dD = _per_head(dout * x, -3)
    du = ddelta * sig  # delta = clip(softplus(u))
    ddt_bias = _per_head(du, -2) if cache.has_dt_bias else None
    dinit = dS if cache.has_initial_state else None
    return dx, du, dA, _mamba_groups(dBh, groups), _mamba_groups(dCh, groups), dD, ddt_bias, dinit


def mamba2_scan_jvp(cache: Mamba2ScanCache, *tangents: Optional[Array]):
    """Forward mode: the tangent of the outputs along ``(tx, tdt, tA, tB, tC, tD, tdt_bias,
    tinitial_state)`` (the backward's order; None or left out = zero), one step at a time.

    By the product rule, along the forward's lines::

        tdelta = sigmoid(u) (tdt + tdt_bias)      (0 where the clip holds delta)
        ta_t = a_t (tdelta_t A + delta_t tA)
        tS_t = ta_t S_{t-1} + a_t tS_{t-1} + (tdelta_t x_t + delta_t tx_t) B_t^T + delta_t x_t tB_t^T
        ty_t = tS_t C_t + S_t tC_t + tD x_t + D tx_t

    Returns ``ty``, or ``(ty, tfinal_state)`` when the forward kept the final state.
    """
    x, delta, A = cache.x, cache.dt, cache.A  # as the forward used them
    B, C, D, states = cache.B, cache.C, cache.D, cache.states
    tx, tdelta, ta, tBh, tCh, tD, tS = _mamba_tangents(cache, *tangents)
    Bh, Ch = _mamba_heads(B, x.shape[-3]), _mamba_heads(C, x.shape[-3])
    a = np.exp(delta * A[:, None])
    ty = np.zeros(x.shape, x.dtype)
    for t in range(x.shape[-2]):
        P, xt, dt_ = states[..., t, :, :], x[..., t, :], delta[..., t, None]
        S = a[..., t, None, None] * P + (dt_ * xt)[..., :, None] * Bh[..., t, None, :]
        tS = (
            ta[..., t, None, None] * P
            + a[..., t, None, None] * tS
            + (tdelta[..., t, None] * xt + dt_ * tx[..., t, :])[..., :, None] * Bh[..., t, None, :]
            + (dt_ * xt)[..., :, None] * tBh[..., t, None, :]
        )
        ty[..., t, :] = np.einsum("...pn,...n->...p", tS, Ch[..., t, :]) + np.einsum(
            "...pn,...n->...p", S, tCh[..., t, :]
        )
    if D is not None:
        ty = ty + D[:, None, None] * tx
    if tD is not None:
        ty = ty + tD[:, None, None] * x
    return ty if cache.final_state is None else (ty, tS)


def _mamba_tangents(cache, tx=None, tdt=None, tA=None, tB=None, tC=None, tD=None, tbias=None, tS=None):
    """The tangents the scan's lines use, zeros for None: ``(tx, tdelta, ta, tB, tC, tD, tS_0)``
    with ``tB``, ``tC`` repeated for the heads (``tD`` stays None for zero)."""
    x, delta, sig, A, B = cache.x, cache.dt, cache.sig, cache.A, cache.B
    heads = x.shape[-3]
    tu = np.zeros(delta.shape, x.dtype) if tdt is None else tdt
    if tbias is not None:
        tu = tu + tbias[:, None]
    tdelta = sig * tu  # delta = clip(softplus(u))
    tA = np.zeros(A.shape, x.dtype) if tA is None else tA
    ta = np.exp(delta * A[:, None]) * (tdelta * A[:, None] + delta * tA[:, None])  # a = exp(delta A)
    tx = np.zeros(x.shape, x.dtype) if tx is None else tx
    tBh = np.zeros(x.shape[:-3] + (heads,) + B.shape[-2:], x.dtype) if tB is None else _mamba_heads(tB, heads)
    tCh = np.zeros(tBh.shape, x.dtype) if tC is None else _mamba_heads(tC, heads)
    tS = np.zeros(cache.states.shape[:-3] + cache.states.shape[-2:], x.dtype) if tS is None else tS
    return tx, tdelta, ta, tBh, tCh, tD, tS


def mamba2_scan_backward_jvp(
    dout: Array,
    cache: Mamba2ScanCache,
    tangents,
    ddout: Optional[Array] = None,
    dfinal_state: Optional[Array] = None,
    ddfinal_state: Optional[Array] = None,
):
    """Second order: ``mamba2_scan_backward(dout, cache, dfinal_state)``'s gradients and their
    tangents when the inputs move along ``tangents = (tx, tdt, tA, tB, tC, tD, tdt_bias,
    tinitial_state)`` (``mamba2_scan_jvp``'s order; None or left out: zero), ``dout`` along
    ``ddout`` and ``dfinal_state`` along ``ddfinal_state`` (None: zero).

    First the forward's tangents ``tS_{t-1}`` of every step (``mamba2_scan_jvp``'s lines); then the
    backward's walk t = L .. 1, each line differentiated by the product rule, ``tdS`` starting at
    ``ddfinal_state``::

        dS += dy_t C_t^T              tdS += tdy_t C_t^T + dy_t tC_t^T
        dC_t = S_t^T dy_t             tdC_t = tS_t^T dy_t + S_t^T tdy_t
        da_t = <dS, P>                tda_t = <tdS, P> + <dS, tP>
        w = dS B_t                    tw = tdS B_t + dS tB_t
        ddelta_t = x_t . w            tddelta_t = tx_t . w + x_t . tw
        dx_t = delta_t w              tdx_t = tdelta_t w + delta_t tw
        v = dS^T x_t                  tv = tdS^T x_t + dS^T tx_t
        dB_t = delta_t v              tdB_t = tdelta_t v + delta_t tv
        dS_{t-1} = a_t dS             tdS_{t-1} = ta_t dS + a_t tdS

    and off the walk, with ``g = da a`` (``tg = tda a + da ta``)::

        ddelta += g A                 tddelta += tg A + g tA
        dA = sum g delta              tdA = sum tg delta + g tdelta
        dx += D dy                    tdx += tD dy + D tdy
        dD = sum dy . x               tdD = sum tdy . x + dy . tx
        du = ddelta s                 tdu = tddelta s + ddelta s (1 - s) tu

    (``s = sigmoid(u)`` where the clip lets ``delta`` through, whose derivative is ``s (1 - s)``;
    0 where it holds; 1 above torch's softplus threshold 20, where ``s (1 - s)`` is 0 too).
    Returns ``(grads, grad_tangents)``, both in the backward's order.
    """
    grads = mamba2_scan_backward(dout, cache, dfinal_state)
    x, delta, sig, A = cache.x, cache.dt, cache.sig, cache.A  # as the forward used them
    B, C, D, states = cache.B, cache.C, cache.D, cache.states
    heads, groups = x.shape[-3], B.shape[-3]
    tx, tdelta, ta, tBh, tCh, tD, tS = _mamba_tangents(cache, *tangents)
    given = _padded(tangents, 8)  # (tx, tdt, tA, tB, tC, tD, tdt_bias, tinitial_state)
    tu = (np.zeros(delta.shape, x.dtype) if given[1] is None else given[1]) + (
        0.0 if given[6] is None else given[6][:, None]
    )
    tA = np.zeros(A.shape, x.dtype) if given[2] is None else given[2]
    Bh, Ch = _mamba_heads(B, heads), _mamba_heads(C, heads)
    a = np.exp(delta * A[:, None])
    # the forward's tangents: tS_{t-1} of every step
    tstates = np.zeros(states.shape, x.dtype)
    for t in range(x.shape[-2]):
        tstates[..., t, :, :] = tS
        xt, dt_ = x[..., t, :], delta[..., t, None]
        tS = (
            ta[..., t, None, None] * states[..., t, :, :]
            + a[..., t, None, None] * tS
            + (tdelta[..., t, None] * xt + dt_ * tx[..., t, :])[..., :, None] * Bh[..., t, None, :]
            + (dt_ * xt)[..., :, None] * tBh[..., t, None, :]
        )
    tdy = np.zeros(dout.shape, x.dtype) if ddout is None else ddout
    # the backward's walk, each line with its tangent
    state = states.shape[:-3] + states.shape[-2:]
    dS = np.zeros(state, x.dtype) if dfinal_state is None else dfinal_state
    tdS = np.zeros(state, x.dtype) if ddfinal_state is None else ddfinal_state
    ddelta, da = np.zeros(delta.shape, x.dtype), np.zeros(delta.shape, x.dtype)
    tddelta, tda = np.zeros(delta.shape, x.dtype), np.zeros(delta.shape, x.dtype)
    tdx, tdBh, tdCh = np.zeros(x.shape, x.dtype), np.zeros(Bh.shape, x.dtype), np.zeros(Ch.shape, x.dtype)
    for t in reversed(range(x.shape[-2])):
        P, tP = states[..., t, :, :], tstates[..., t, :, :]
        xt, txt, do, tdo = x[..., t, :], tx[..., t, :], dout[..., t, :], tdy[..., t, :]
        dt_, tdt_ = delta[..., t, None], tdelta[..., t, None]
        at, tat = a[..., t, None, None], ta[..., t, None, None]
        Bt, tBt, Ct, tCt = Bh[..., t, :], tBh[..., t, :], Ch[..., t, :], tCh[..., t, :]
        St = at * P + (dt_ * xt)[..., :, None] * Bt[..., None, :]
        tSt = tat * P + at * tP + (tdt_ * xt + dt_ * txt)[..., :, None] * Bt[..., None, :]
        tSt = tSt + (dt_ * xt)[..., :, None] * tBt[..., None, :]
        # dS += dy_t C_t^T, dC_t = S_t^T dy_t
        dS = dS + do[..., :, None] * Ct[..., None, :]
        tdS = tdS + tdo[..., :, None] * Ct[..., None, :] + do[..., :, None] * tCt[..., None, :]
        tdCh[..., t, :] = np.einsum("...pn,...p->...n", tSt, do) + np.einsum("...pn,...p->...n", St, tdo)
        # da_t = <dS, P>
        da[..., t] = (dS * P).sum((-2, -1))
        tda[..., t] = (tdS * P).sum((-2, -1)) + (dS * tP).sum((-2, -1))
        # w = dS B_t: ddelta_t = x_t . w, dx_t = delta_t w
        w = np.einsum("...pn,...n->...p", dS, Bt)
        tw = np.einsum("...pn,...n->...p", tdS, Bt) + np.einsum("...pn,...n->...p", dS, tBt)
        ddelta[..., t] = (xt * w).sum(-1)
        tddelta[..., t] = (txt * w).sum(-1) + (xt * tw).sum(-1)
        tdx[..., t, :] = tdt_ * w + dt_ * tw
        # v = dS^T x_t: dB_t = delta_t v
        v = np.einsum("...pn,...p->...n", dS, xt)
        tv = np.einsum("...pn,...p->...n", tdS, xt) + np.einsum("...pn,...p->...n", dS, txt)
        tdBh[..., t, :] = tdt_ * v + dt_ * tv
        # dS_{t-1} = a_t dS
        tdS = tat * dS + at * tdS
        dS = at * dS
    # a = exp(delta A): g = da a
    g, tg = da * a, tda * a + da * ta
    ddelta = ddelta + g * A[:, None]
    tddelta = tddelta + tg * A[:, None] + g * tA[:, None]
    tdA = _per_head(tg * delta + g * tdelta, -2)
    tdD = None
    if D is not None:  # y += D x
        tdx = tdx + D[:, None, None] * tdy
        tdD = _per_head(tdy * x + dout * tx, -3)
    if tD is not None:
        tdx = tdx + tD[:, None, None] * dout
    # delta = clip(softplus(u)): du = ddelta s, s' = s (1 - s)
    tdu = tddelta * sig + ddelta * sig * (1.0 - sig) * tu
    tdbias = _per_head(tdu, -2) if cache.has_dt_bias else None
    tdinit = tdS if cache.has_initial_state else None
    tgrads = (tdx, tdu, tdA, _mamba_groups(tdBh, groups), _mamba_groups(tdCh, groups), tdD, tdbias, tdinit)
    return grads, tgrads


__all__ += _op_names("mamba2_scan")

"""Scaled dot-product attention, forward and backward: masks, dropout, grouped-query heads and the
attention options (``causal_align``, ``window``, ``alibi_slopes``, ``softcap``, ``sinks``, ``mask_grad``).

``scaled_dot_product_attention`` / ``scaled_dot_product_attention_backward`` are the public pair:
they validate and cast their arguments, then call the kernels ``scaled_dot_product_attention_kernel`` /
``scaled_dot_product_attention_backward_kernel`` (re-exported by ``npattn.functional.kernels``), which
take already checked arguments plus two layout extras for ``MultiHeadAttention``'s fused buffer.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import numpy as np

from .._docs import (
    ATTENTION_FORWARD,
    attention_backward_jvp_sections,
    attention_backward_sections,
    attention_jvp_sections,
    shared_doc,
)
from .._validate import (
    as_rng,
    check_backward_jvp,
    check_bool,
    check_cache,
    check_grad,
    check_mask,
    check_prob,
    check_tangents_as,
)
from ._blocks import (
    AttentionOptions,
    Band,
    Block,
    attention_tangent_specs,
    band,
    band_hidden,
    broadcast_qkv,
    broadcast_shapes,
    check_qkv,
    check_scale,
    default_scale,
    distance,
    fold_heads,
    gqa_groups,
    out_lead,
    row_blocks,
    scratch,
    split_attention_tangents,
    sum_to,
    with_ndim,
)
from ._workspace import empty as _empty

__all__ = [
    "AttentionCache",
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_backward",
    "scaled_dot_product_attention_jvp",
    "scaled_dot_product_attention_backward_jvp",
]


class AttentionCache(NamedTuple):
    """What ``scaled_dot_product_attention_backward`` needs.

    Everything is in the grouped layout ``(..., Hk, G*Lq, ...)`` (``G`` query heads per kv head,
    1 without grouped-query attention); ``q, k, v`` are the kernel's operands (the inputs viewed
    with their broadcast leading dimensions), ``shapes`` the inputs' own shapes.  The
    probabilities are kept by blocks of query rows (``blocks``, see ``_blocks.row_blocks``):
    ``p[i] = P^T``, key-major ``(..., c1 - c0, n)``, for the ``n`` rows ``blocks[i].rows`` and the
    keys ``c0..c1-1`` those rows may see (``P = softmax(S)``, the sink's share left out of the
    block).  ``keep`` is dropout's keep-mask ``(..., Hq, Lq, Lk)`` (None without
    dropout) and ``drop_scale`` its ``1/(1-p)``.  ``dcap[i]``: ``1 - tanh(s/softcap)^2`` of block
    ``i`` (softcap only); ``p_sink``: each row's sink probability (sinks only); ``mask``: the float
    mask as given (``mask_grad`` only).  ``weights`` assembles ``P`` ``(..., Hq, Lq, Lk)``.
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    p: tuple
    blocks: tuple
    keep: Optional[np.ndarray]
    drop_scale: float
    scale: float
    groups: int
    shapes: tuple = ()
    band: Band = Band(0, None, None)
    options: AttentionOptions = AttentionOptions()
    dcap: Optional[tuple] = None
    p_sink: Optional[np.ndarray] = None
    mask: Optional[np.ndarray] = None
    heads_last: bool = False

    @property
    def weights(self) -> np.ndarray:
        """``P = softmax(S)``, ``(..., Hq, Lq, Lk)``: zero where a query may not attend."""
        score_shape = self.q.shape[:-1] + (self.k.shape[-2],)
        p = np.zeros(_grouped_shape(score_shape, self.groups), dtype=self.q.dtype)
        for blk, pb in zip(self.blocks, self.p):
            p[..., blk.rows, blk.c0 : blk.c1] = pb.swapaxes(-1, -2)
        return _ungrouped(p, self.groups, score_shape)


def _grouped_shape(shape, groups):
    """``(..., Hk*G, L, D) -> (..., Hk, G*L, D)``."""
    if groups == 1:
        return tuple(shape)
    return tuple(shape[:-3]) + (shape[-3] // groups, groups * shape[-2], shape[-1])


def _grouped(x, groups):
    """``(..., Hk*G, L, D) -> (..., Hk, G*L, D)``: the shared scheme (``_blocks.fold_heads``, query
    head ``h = hk*G + g`` beside kv head ``hk``) with the ``G`` query heads of a kv head stacked
    along the rows, so that one GEMM per kv head serves them all."""
    return x if groups == 1 else fold_heads(x, groups).reshape(_grouped_shape(x.shape, groups))


def _ungrouped(x, groups, full_shape):
    return x if groups == 1 else x.reshape(full_shape)


def _mask_view(m, score_shape, groups):
    """A mask broadcast to the scores ``(..., Hq, Lq, Lk)``, viewed as ``(..., Hk, G, Lq, Lk)`` with
    grouped-query heads (``fold_heads``, no copy): the block of query rows ``r0..r1`` of group ``g``
    is then ``m[..., g, r0:r1, c0:c1]`` (``_mask_block``)."""
    return fold_heads(np.broadcast_to(m, score_shape), groups)


def _mask_block(m, blk, groups, lq):
    """The part of a ``_mask_view`` that the block ``blk`` of query rows covers, ``(..., n, keys)``."""
    r1 = blk.r0 + blk.n
    if groups == 1:
        return m[..., blk.r0 : r1, blk.c0 : blk.c1]
    return m[..., blk.rows.start // lq, blk.r0 : r1, blk.c0 : blk.c1]


def _per_group(a, lead, groups, g):
    """A per-head array ``a`` (broadcast to the scores' leading dims ``(..., Hq)``) for the query
    heads ``g, G + g, 2G + g, ...`` of group ``g``, shaped ``(..., Hk, 1, 1)`` to scale a block."""
    a = np.broadcast_to(with_ndim(a, len(lead)), lead)  # sinks (1,) of inputs without a head axis too
    if groups > 1:
        a = fold_heads(a, groups, -1)[..., g]
    return a[..., None, None]


# -- blocked causal and windowed attention ------------------------------------------------------------
# With ``is_causal`` query ``i`` sees keys ``0..i``, so the rows of a block of queries ``r0..r1-1``
# need the keys ``0..r1-1`` only; with a window they need the keys ``c0..c1-1`` of the band.  The
# scores are therefore formed one block of query rows at a time, each only as wide as the keys its
# rows may see (``_blocks.row_blocks``): the blocks outside the band (almost half of ``q k^T``,
# ``P v`` and the four backward products when causal; all but ``L * (window + height)`` scores
# with a window) are never computed, exponentiated or stored.  When every row sees every key there
# is one block of all rows.  Each block is its own compact array: its elementwise passes (max, exp,
# sum, ...) run on contiguous memory.  The height, 128 rows, was the fastest of 32 ... 512 measured
# with ``npattn bench`` (less work wasted on the diagonal blocks against per-call overhead and GEMMs
# large enough for OpenBLAS to split over its threads).
_CAUSAL_BLOCK = 128


def _block_height(b: Band):
    """Query rows per block (None: every key is visible to every row, a single block)."""
    return None if b.full else _CAUSAL_BLOCK


def _heads_last_empty(shape, dtype, workspace=None):
    """An array of ``shape (..., H, L, D)`` laid out in memory as ``(..., L, H, D)``: merging the
    heads back into features (``swapaxes(-2, -3)`` then ``reshape``), as ``MultiHeadAttention``
    does, is then free.  (Each ``(L, D)`` matrix is still a BLAS operand: its rows are strided.)"""
    if len(shape) < 3:
        return _empty(workspace, shape, dtype)
    return _empty(workspace, tuple(shape[:-3]) + (shape[-2], shape[-3], shape[-1]), dtype).swapaxes(-2, -3)


@shared_doc(**ATTENTION_FORWARD)
def scaled_dot_product_attention(
    q,
    k,
    v,
    attn_mask=None,
    is_causal=False,
    dropout_p=0.0,
    scale=None,
    rng=None,
    enable_gqa=False,
    *,
    causal_align="top_left",
    window=None,
    alibi_slopes=None,
    softcap=None,
    sinks=None,
    mask_grad=False,
) -> tuple[np.ndarray, AttentionCache]:
    """``out = dropout(softmax(q k^T * scale + mask)) v``, as ``torch.nn.functional.scaled_dot_product_attention``.

    Shapes: ``q (..., Hq, Lq, E)``, ``k (..., Hk, Lk, E)``, ``v (..., Hk, Lk, Ev)`` -> ``(..., Hq, Lq, Ev)``
    (inputs without a head axis, ``(batch, L, E)``, work too); the leading dimensions broadcast
    against each other as in torch (gradients are summed back to each input's own shape).
    ``scale`` defaults to ``1/sqrt(E)``.  q, k and v share one float dtype, float32 or float64
    (integer arrays take it); mixed float dtypes raise ``TypeError``, as in torch.

    * ``attn_mask``: bool (True = may attend) or float (added to the scaled scores), broadcastable
      to ``(..., Hq, Lq, Lk)``.  ``is_causal``: query ``i`` sees keys ``j <= i`` (positions per
      ``causal_align``); unlike torch, it may be combined with ``attn_mask`` (both apply).
    * A query row that may attend to no key gives output 0 (and gradient 0), never NaN.
    * ``dropout_p`` acts on the attention weights with the mask ``rng.random((..., Hq, Lq, Lk)) >= p``.
    * ``enable_gqa``: ``Hq`` a multiple of ``Hk``; query head ``h`` uses kv head ``h // (Hq // Hk)``.
      Computed without copying k/v: query heads are grouped beside their kv head in one GEMM.

    Attention options (keyword-only; each combinable with the others, masks, causal, GQA, dropout).
    Query ``i`` sits at position ``p = i`` (``causal_align="top_left"``) or ``p = i + Lk - Lq``
    (``"bottom_right"``, torch's ``causal_lower_right``, KV-cache decoding):

    * ``window=(left, right)``: query at ``p`` sees keys ``p - left <= j <= p + right`` (``-1``:
      unbounded on that side; with ``is_causal`` the right side is 0).  Only the band is computed:
      cost and memory grow with ``L * window``, not ``L^2`` (the dropout mask, if any, is still
      drawn for the whole ``(Lq, Lk)`` score array);
    * ``alibi_slopes`` broadcastable to ``(..., Hq)``: adds ``-slope_h * |p - j|`` to the scaled scores;
    * ``softcap > 0``: the scaled scores become ``softcap * tanh(s / softcap)`` before masks and biases;
    * ``sinks (Hq,)``: a logit per head joining each row's softmax as an extra key of value 0 (a
      row that sees no key puts all its weight on the sink: output 0); backward appends ``dsinks``;
    * ``mask_grad=True`` (float ``attn_mask`` only): backward appends ``dmask``, the gradient of the
      additive mask summed to the mask's own shape.

    How (the textbook formula's numbers, with less work):

    * the softmax of a row is ``P = E / l`` with ``E = exp(S - max S)`` and ``l = sum E``; the
      block of ``E`` is multiplied by ``1/l`` in place, a pass over contiguous memory (the rows of
      q, out and their gradients are strided views of the heads in ``MultiHeadAttention``'s
      layout, slow to pass over when the head dimension is small), and kept: the backward then
      needs no row factor at all (``dv = P^T dout``, ``dS = P (dP - D)``);
    * causal or windowed: one block of query rows at a time, only as wide as the keys those rows
      may see (``_blocks.row_blocks``): the masked part of the score matrix is skipped;
    * each block is held key-major, ``S^T = k q^T`` of shape ``(keys, queries)``: the same
      numbers, but OpenBLAS splits these ``K = E`` GEMMs over its threads this way round (about
      2x faster on 2 cores than ``q k^T``); the softmax then runs down the columns.

    Returns ``(out, AttentionCache)``; ``out`` is a C-contiguous array.

    Parameters
    ----------
    <attention_args>
    <attention_options>

    Returns
    -------
    out : ndarray
        ``(..., Hq, Lq, Ev)``, in q's dtype.
    cache : AttentionCache
        For ``scaled_dot_product_attention_backward`` and ``_jvp``.

    Raises
    ------
    <attention_raises>

    <examples>
    >>> from npattn.functional import reference as R
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 4, 6, 8)) for _ in range(3))   # (batch, heads, L, E)
    >>> out, cache = F.scaled_dot_product_attention(q, k, v, is_causal=True, window=(2, 0))
    >>> out.shape
    (2, 4, 6, 8)
    >>> dq, dk, dv = F.scaled_dot_product_attention_backward(rng.standard_normal(out.shape), cache)
    >>> ref, _ = R.scaled_dot_product_attention(q, k, v, is_causal=True, window=(2, 0))
    >>> bool(np.allclose(out, ref, rtol=0, atol=1e-12))   # the textbook formula's numbers
    True
    """
    enable_gqa = check_bool(enable_gqa, "enable_gqa")
    q, k, v, groups = check_qkv(q, k, v, enable_gqa)
    is_causal = check_bool(is_causal, "is_causal")
    dropout_p = check_prob(dropout_p, "dropout_p")
    score_shape = out_lead(q.shape, k.shape, v.shape, groups) + (q.shape[-2], k.shape[-2])
    if attn_mask is not None:
        attn_mask = check_mask(attn_mask, "attn_mask", score_shape)
    scale = check_scale(scale, q.shape[-1])
    rng = as_rng(rng) if dropout_p > 0.0 or rng is not None else None
    opts = AttentionOptions(causal_align, window, alibi_slopes, softcap, sinks, mask_grad)
    opts = opts.checked(score_shape, q.dtype, attn_mask)
    return scaled_dot_product_attention_kernel(
        q, k, v, attn_mask, is_causal, dropout_p, scale, rng, enable_gqa, options=opts
    )


def scaled_dot_product_attention_kernel(
    q,
    k,
    v,
    attn_mask=None,
    is_causal=False,
    dropout_p=0.0,
    scale=None,
    rng=None,
    enable_gqa=False,
    *,
    causal_align="top_left",
    window=None,
    alibi_slopes=None,
    softcap=None,
    sinks=None,
    mask_grad=False,
    heads_last=False,
    workspace=None,
    options: Optional[AttentionOptions] = None,
):
    """The kernel of ``scaled_dot_product_attention``: arguments already checked and cast (float
    arrays of one dtype, shapes that fit, a Generator ``rng`` when ``dropout_p > 0``).
    ``heads_last``: lay the output out in memory as ``(..., Lq, Hq, Ev)`` (``_heads_last_empty``;
    ``MultiHeadAttention`` then merges heads for free), and the backward's gradients likewise.
    ``workspace``: a ``_workspace.Workspace`` the output, the cached blocks and the scratch are
    taken from (a module's; it gives them back after the backward, ``cache_arrays``).
    ``options``: the checked ``AttentionOptions`` in one object (then the six option keywords
    are not read), as the public op passes them."""
    if options is None:
        options = AttentionOptions(causal_align, window, alibi_slopes, softcap, sinks, mask_grad)
    shapes = (q.shape, k.shape, v.shape)
    groups = gqa_groups(q.shape, k.shape, v.shape, enable_gqa)
    q, k, v = broadcast_qkv(q, k, v, groups)
    lq, lk = q.shape[-2], k.shape[-2]
    score_shape = q.shape[:-1] + (lk,)
    scale = default_scale(scale, q.shape[-1])
    bnd = band(lq, lk, is_causal, options.causal_align, options.window)
    keep, drop_scale = None, 1.0
    if dropout_p > 0.0:
        keep = rng.random(score_shape) >= dropout_p
        drop_scale = 0.0 if dropout_p == 1.0 else 1.0 / (1.0 - dropout_p)
    out_shape = q.shape[:-1] + (v.shape[-1],)
    if heads_last:  # grouped heads write their rows into the (..., Hk, G, Lq, Ev) view of it
        full = _heads_last_empty(out_shape, q.dtype, workspace)
        out = fold_heads(full, groups)
    else:
        out = full = _empty(workspace, _grouped_shape(out_shape, groups), q.dtype)
    blocks = row_blocks(lq, lk, groups, _block_height(bnd), bnd)
    p_blocks, dcap = [], []
    rows = None
    if _one_row_serves(lq, groups, workspace, keep, attn_mask, options):  # decoding: one pass for every group
        p_blocks = _one_row(q, k, v, groups, scale, blocks[0], out)  # no softcap: no dcap
    else:
        rows = _Rows(q, k, v, groups, scale, bnd, options, attn_mask, keep, drop_scale, workspace)
        for blk in blocks:
            t, cap = rows.scores(blk)
            rows.softmax(t, blk)
            rows.attend(t, blk, out)
            p_blocks.append(t)
            dcap.append(cap)
    cache = AttentionCache(
        q,
        k,
        v,
        tuple(p_blocks),
        tuple(blocks),
        keep,
        drop_scale,
        scale,
        groups,
        shapes,
        bnd,
        options,
        None if options.softcap is None else tuple(dcap),
        None if rows is None else rows.p_sink,
        attn_mask if options.mask_grad else None,
        heads_last,
    )
    return full if heads_last else _ungrouped(out, groups, out_shape), cache


class _Rows:
    """The forward of one call, block of query rows by block, in the grouped layout ``(..., Hk,
    G*Lq, ...)`` (one GEMM per kv head): each step of the scores (an option each), the softmax
    (with the sink) and the output.  Holds the call's operands and options."""

    def __init__(self, q, k, v, groups, scale, bnd, opts: AttentionOptions, attn_mask, keep, drop_scale, workspace):
        self.k, self.v, self.groups, self.scale, self.band, self.opts = k, v, groups, scale, bnd, opts
        self.qg = _grouped(q, groups)
        self.lq, self.lead, self.dt = q.shape[-2], q.shape[:-2], q.dtype
        score_shape = q.shape[:-1] + (k.shape[-2],)
        is_bool = attn_mask is not None and attn_mask.dtype == bool
        self.hidden = _mask_view(~attn_mask, score_shape, groups) if is_bool else None
        self.additive = _mask_view(attn_mask, score_shape, groups) if attn_mask is not None and not is_bool else None
        self.keep_g = None if keep is None else _grouped(keep, groups)  # contiguous: a view
        self.drop_scale, self.workspace = drop_scale, workspace
        self.p_sink = None if opts.sinks is None else np.empty(self.qg.shape[:-1] + (1,), q.dtype)
        self.tlead = broadcast_shapes(k.shape[:-2], self.qg.shape[:-2])
        self.masks: dict = {}  # the band's hidden pairs of each distinct block shape, built once per call

    def scores(self, blk: Block):
        """The final scores of the block, key-major: ``t = s^T = scale k q^T`` over the keys
        ``c0..c1-1`` its rows may see (the ``(keys, n)`` orientation: OpenBLAS runs these ``K = E``
        GEMMs on both cores this way; the scale goes onto the contiguous block, not onto q's
        strided rows), then softcap, the float mask, ALiBi, the band and the bool mask.  Returns
        ``(t, 1 - tanh^2)`` (the second None without softcap)."""
        c0, c1, n, opts = blk.c0, blk.c1, blk.n, self.opts
        t = _empty(self.workspace, self.tlead + (c1 - c0, n), self.dt)
        np.matmul(self.k[..., c0:c1, :], self.qg[..., blk.rows, :].swapaxes(-1, -2), out=t)
        dcap = None
        if opts.softcap is not None:  # s -> softcap tanh(s / softcap); keep its derivative 1 - tanh^2
            t *= self.scale / opts.softcap
            np.tanh(t, out=t)
            dcap = 1.0 - t * t
            t *= opts.softcap
        elif self.scale != 1.0:
            t *= self.scale
        if self.additive is not None:
            t += _mask_block(self.additive, blk, self.groups, self.lq).swapaxes(-1, -2)
        if opts.alibi_slopes is not None:  # - slope_h |p - j|
            slopes = _per_group(opts.alibi_slopes, self.lead, self.groups, self._group(blk))
            t -= slopes * distance(self.band, c0, c1 - c0, blk.r0, n, self.dt)
        cut = band_hidden(self.band, c0, c1 - c0, blk.r0, n, self.masks)  # causal diagonal / window edges
        if cut is not None:
            np.copyto(t, -np.inf, where=cut)
        if self.hidden is not None:
            np.copyto(t, -np.inf, where=_mask_block(self.hidden, blk, self.groups, self.lq).swapaxes(-1, -2))
        return t, dcap

    def _group(self, blk: Block) -> int:
        return blk.rows.start // self.lq if self.lq else 0

    def softmax(self, t, blk: Block):
        """``_softmax_keys`` of the block's scores ``t``, with the rows' sinks."""
        if self.opts.sinks is None or self.p_sink is None:
            return _softmax_keys(t)
        sink = _per_group(self.opts.sinks, self.lead, self.groups, self._group(blk))
        return _softmax_keys(t, sink, self.p_sink[..., blk.rows, :].swapaxes(-1, -2))

    def attend(self, p, blk: Block, out):
        """``out = P' v = (P [* keep / (1-p)]) v`` for the block's rows; ``out`` grouped
        ``(..., Hk, G*Lq, Ev)``, or ``(..., Hk, G, Lq, Ev)`` (``fold_heads`` of a heads-last output)."""
        used = p
        if self.keep_g is not None:
            used = p * self.keep_g[..., blk.rows, blk.c0 : blk.c1].swapaxes(-1, -2)
            used *= self.drop_scale
        if out.ndim > self.qg.ndim:  # (..., Hk, G, Lq, Ev): the block's group, its rows
            rows = out[..., self._group(blk), blk.r0 : blk.r0 + blk.n, :]
        else:
            rows = out[..., blk.rows, :]
        np.matmul(used.swapaxes(-1, -2), self.v[..., blk.c0 : blk.c1, :], out=rows)


def _softmax_keys(t, sink=None, p_sink=None, *, finite: bool = False):
    """``P = E / l`` in place over the keys of key-major scores ``t (..., keys, n)``, ``E = exp(S -
    max over keys)``, ``l = sum E``; a query with no visible key (max = -inf) gets zeros.  A sink
    joins the row: ``m = max(m, sink)`` (always finite), ``l`` includes ``exp(sink - m)`` and
    ``P_sink = exp(sink - m) / l`` is written into ``p_sink``.  ``finite``: the caller knows every
    query sees a key and every score is finite (a decoding step's), so neither guard for a row
    with no key is needed (the same numbers: a finite max is not changed by the first, and a
    total of at least ``exp(0) = 1`` by the second)."""
    # (fmax: max but for NaN, which it skips; as fast along this axis in float64 as max is not)
    m = np.fmax.reduce(t, axis=-2, keepdims=True, initial=-np.inf)  # Lk = 0: no key, output 0
    if sink is not None:
        m = np.maximum(m, sink)
    elif not finite:
        m[~np.isfinite(m)] = 0.0
    t -= m
    np.exp(t, out=t)
    total = t.sum(axis=-2, keepdims=True)  # l, (..., 1, n)
    if sink is not None:
        es = np.exp(sink - m)
        total += es
        np.divide(es, total, out=p_sink)
    elif not finite:
        total[total == 0] = 1.0
    t *= np.divide(1.0, total, out=total)  # P = E / l, in place


def decoding_attention(q, k, v, scale=None, groups=1):
    """``scaled_dot_product_attention_kernel(q, k, v, scale=scale, enable_gqa=True,
    heads_last=True)``'s output, bit for bit, for one query row ``q (..., Hk * G, 1, E)`` of
    ``groups = G > 1`` grouped heads that sees every key of ``k``, ``v (..., Hk, Lk >= 1, E)``
    (the same leading dimensions), with nothing but the scale in the scores and every score
    finite: a decoding step of a model, whose call keeps nothing.  The kernel's one-row pass
    (``_one_row_pass``) without its setup (shapes, options, band, blocks) or cache, and without the
    softmax's guards for a query that sees no key, which a step would pay in every layer."""
    qg = fold_heads(q, groups)[..., 0, :]  # (..., Hk, G, E)
    t = np.empty(qg.shape[:-1] + (k.shape[-2], 1), q.dtype)  # P, (..., Hk, G, keys, 1)
    full = _heads_last_empty(q.shape[:-1] + (v.shape[-1],), q.dtype)
    _one_row_pass(qg, k, v, default_scale(scale, q.shape[-1]), t, fold_heads(full, groups), finite=True)
    return full


def _one_row_serves(lq: int, groups: int, workspace, keep, attn_mask, options: AttentionOptions) -> bool:
    """One query row of grouped heads, nothing but the scale in the scores, no workspace: ``_one_row``."""
    plain = keep is None and attn_mask is None and options.scale_only
    return lq == 1 and groups > 1 and workspace is None and plain


def _one_row(q, k, v, groups: int, scale: float, blk: Block, out) -> list:
    """One query row (``Lq = 1``, a decoding step) of every group at once, scores with nothing but
    the scale (no mask, dropout, softcap, ALiBi or sinks): the ``G`` blocks of ``_Rows``' loop
    (``blk`` the first; each row sees the keys ``c0..c1-1``, the band hides none of them) as one
    batched product per stage instead of ``G`` passes of a dozen small operations each, without
    the loop's per-call setup.  Bit for bit the loop's: each (kv head, group) is the same
    matrix-vector product, and the softmax runs over ``G`` blocks laid out one after another in
    one array, each as contiguous as the loop's own (the block probabilities returned are those
    arrays).  ``out``: grouped ``(..., Hk, G, Ev)`` or ``(..., Hk, G, 1, Ev)`` (heads last)."""
    c0, c1 = blk.c0, blk.c1
    qg = _grouped(q, groups)  # (..., Hk, G, E)
    tlead = broadcast_shapes(k.shape[:-2], qg.shape[:-2])
    buf = np.empty((groups,) + tlead + (c1 - c0, 1), q.dtype)  # block g at buf[g]
    nd = buf.ndim
    t = buf.transpose(tuple(range(1, nd - 2)) + (0, nd - 2, nd - 1))  # (..., Hk, G, keys, 1)
    if out.ndim == qg.ndim:  # (..., Hk, G, Ev) -> (..., Hk, G, 1, Ev)
        out = out[..., None, :]
    _one_row_pass(qg, k[..., c0:c1, :], v[..., c0:c1, :], scale, t, out)
    return list(buf)


def _one_row_pass(qg, k, v, scale: float, t, out, *, finite: bool = False) -> None:
    """The one-row pass itself: ``qg (..., Hk, G, E)``, ``k``, ``v (..., Hk, keys, E)``; the
    probabilities ``P`` into ``t (..., Hk, G, keys, 1)`` (key-major, as the loop's blocks), ``P^T
    v`` into ``out (..., Hk, G, 1, Ev)``.  Every (kv head, group) is one matrix-vector product
    ``k q`` (the loop's own), each kv head broadcast over its ``G`` query heads (no copy).
    ``finite``: see ``_softmax_keys``."""
    np.matmul(k[..., None, :, :], qg[..., None], out=t)  # S, (..., Hk, 1, keys, E) @ (..., Hk, G, E, 1)
    if scale != 1.0:
        t *= scale
    _softmax_keys(t, finite=finite)
    np.matmul(t.swapaxes(-1, -2), v[..., None, :, :], out=out)  # (..., Hk, G, 1, keys) @ (..., Hk, 1, keys, Ev)


@shared_doc(attention_backward_sections=attention_backward_sections("scaled_dot_product_attention"))
def scaled_dot_product_attention_backward(dout, cache: AttentionCache) -> tuple:
    """Backward of ``out = P' v`` with ``P' = dropout(P)``, ``P = softmax(S)``, ``S = scale q k^T + mask``:

    * ``dv = P'^T dout`` and ``dP' = dout v^T``;
    * through dropout, ``dP = dP' * keep / (1 - p)``;
    * through the row softmax, ``dS = P * (dP - D)`` with ``D_i = sum_j dP_ij P_ij`` (masked
      entries have P = 0, so 0);
    * ``dq = scale dS k`` and ``dk = scale dS^T q``.

    The options enter at the scores (the textbook tier derives each line):

    * ``mask_grad``: the float mask is added to the scores, so ``dmask = dS`` (summed over the
      dimensions along which the mask was broadcast);
    * ``alibi_slopes``: a constant bias, no gradient of its own; ``window``/causal: hidden scores
      have P = 0, hence dS = 0;
    * ``softcap``: ``S = c tanh(s / c) + ...`` with ``s = scale q k^T``, so ``ds = dS (1 - tanh^2)``
      before it reaches ``dq`` and ``dk``;
    * ``sinks``: the sink is one more logit of the row's softmax with value 0, so ``dP_sink = 0`` and
      ``dsink_h = sum over the rows of head h of P_sink (0 - D)``.

    How, with the cache's blocks of ``P`` (see the forward):

    * ``D_i = sum_j dP_ij P_ij``, one ``einsum`` pass (not FlashAttention's ``dout_i . out_i``:
      equal in exact arithmetic, but rounded differently it would turn the exact zero gradient of
      a row that sees a single key into 1e-16);
    * ``dS = P * (dP - D)``, then ``* scale`` in place: ``dq`` and ``dk`` are plain products with
      ``k`` and ``q``, no factor on their (strided) rows;
    * row blocks as in the forward: ``dk``, ``dv`` parts of the blocks are written or added.

    With grouped-query heads the products run in the grouped layout, which sums each kv head's
    gradient over the query heads that share it.  Returns ``(dq, dk, dv)``, then ``dmask`` (with
    ``mask_grad``), then ``dsinks`` (with ``sinks``); each gradient has its input's shape.

    <attention_backward_sections>
    """
    check_cache(cache, AttentionCache, "scaled_dot_product_attention_backward")
    q, v = cache.q, cache.v
    dout = check_grad(dout, q.shape[:-1] + (v.shape[-1],), q.dtype)
    return scaled_dot_product_attention_backward_kernel(dout, cache)


def scaled_dot_product_attention_backward_kernel(dout, cache, out=None, workspace=None):
    """The kernel of ``scaled_dot_product_attention_backward`` (``dout`` already checked).
    ``out``: optional ``(dq, dk, dv)`` arrays of the right shapes and dtype to write the gradients
    into (e.g. views of ``MultiHeadAttention``'s fused buffer); they are returned in place of new ones.
    ``workspace``: where the scratch comes from (and goes back to at the end)."""
    back = _Backward(cache, dout, out, workspace)
    for j, i in enumerate(back.order):
        back.block(i, add=j > 0 or not back.from_zero)
    return back.finish()


class _Backward:
    """The backward of one call, block of query rows by block, in the forward's grouped layout:
    the gradients being filled (``dq``, ``dk``, ``dv``; ``dmask``, ``dsinks`` with their options)
    and the scratch every block reuses."""

    def __init__(self, cache: AttentionCache, dout, out, workspace):
        q, k, v, groups = cache.q, cache.k, cache.v, cache.groups
        self.cache, self.out, self.workspace = cache, out, workspace
        self.dog, self.qg = _grouped(dout, groups), _grouped(q, groups)
        self.keep_g = None if cache.keep is None else _grouped(cache.keep, groups)
        self.direct = out is not None and groups == 1 and all(o.shape == a.shape for o, a in zip(out, (q, k, v)))
        if self.direct:  # write straight into the caller's arrays
            self.dq, self.dk, self.dv = out
        elif groups == 1 and cache.heads_last:
            self.dq, self.dk, self.dv = (_heads_last_empty(a.shape, a.dtype) for a in (q, k, v))
        else:
            self.dq = np.empty(_grouped_shape(q.shape, groups), q.dtype)
            self.dk, self.dv = np.empty(k.shape, k.dtype), np.empty(v.shape, v.dtype)
        self.order, self.from_zero = self._zero_unseen(cache.blocks)
        self.kept: list | None = None  # the last block's dP^T, D, (dP - D)^T, ds when the second order asks
        self.kept_bufs: tuple = ()  # dP^T's and (dP - D)^T's scratch then, made at the first block
        glead = self.dog.shape[:-2]
        self.dsinks = None if cache.options.sinks is None else np.zeros(glead + (groups,), q.dtype)  # (..., Hk, G)
        self.dmask = None
        if cache.options.mask_grad and cache.mask is not None:
            m = cache.mask
            self.dmask = np.zeros((1,) * (len(q.shape) - m.ndim) + m.shape, q.dtype)
        # Scratch, allocated once at the largest block's size and reused by every block (memory
        # that stays in cache rather than fresh pages): dS, and the products added into dk and dv.
        height = max((b.n for b in cache.blocks), default=0)
        wmax = max((b.c1 - b.c0 for b in cache.blocks), default=0)
        self.ds_buf = _empty(workspace, (math.prod(glead) * height * wmax,), q.dtype)
        many = len(cache.blocks) > 1 or not self.from_zero
        width = max(k.shape[-1], v.shape[-1])
        self.prod_buf = _empty(workspace, (math.prod(glead) * wmax * width if many else 0,), q.dtype)

    def _zero_unseen(self, blocks):
        """dk and dv add up the blocks' parts.  Blocks that all start at key 0: the widest comes first
        and is written, the others are added to it (keys no query may see get zero).  Windowed
        blocks start anywhere: dk, dv start at zero and every block is added."""
        order = sorted(range(len(blocks)), key=lambda i: -blocks[i].c1)
        widest = blocks[order[0]].c1 if blocks else 0
        from_zero = all(b.c0 == 0 for b in blocks)
        if from_zero:
            self.dk[..., widest:, :] = 0
            self.dv[..., widest:, :] = 0
        else:
            self.dk[...] = 0
            self.dv[...] = 0
        return order, from_zero

    def block(self, i: int, add: bool):
        """Block ``i`` of query rows: ``dv = P'^T dout``, ``dS = P (dP - D)``, then ``dq = scale dS k``,
        ``dk = scale dS^T q`` (``dk``, ``dv`` written, or added when ``add``)."""
        cache = self.cache
        blk, p = cache.blocks[i], cache.p[i]  # p: P^T, key-major (c1 - c0, n) as in the forward
        rows, c0, c1 = blk.rows, blk.c0, blk.c1
        g = rows.start // cache.q.shape[-2]
        kb = None if self.keep_g is None else self.keep_g[..., rows, c0:c1].swapaxes(-1, -2)
        do = self.dog[..., rows, :]
        pk = p  # dv = P'^T dout with P' = P [* keep / (1-p)]
        if kb is not None:
            pk = p * kb
            pk *= cache.drop_scale
        _write_or_add(pk, do, self.dv[..., c0:c1, :], add, self.prod_buf)
        # dP'^T = v dout^T;  dP = dP' * keep / (1 - p);  dS^T = P^T * (dP - D)^T
        ds = scratch(self.ds_buf, self.dog.shape[:-2] + (c1 - c0, blk.n))
        # the second order reads dP^T, D and dP - D after this block: dP^T then in an array of its own
        if self.kept is not None and not self.kept_bufs:
            self.kept_bufs = tuple(_empty(self.workspace, self.ds_buf.shape, ds.dtype) for _ in range(2))
        dp = ds if self.kept is None else scratch(self.kept_bufs[0], ds.shape)
        np.matmul(cache.v[..., c0:c1, :], do.swapaxes(-1, -2), out=dp)
        if kb is not None:
            dp *= kb
            dp *= cache.drop_scale
        d = np.einsum("...ji,...ji->...i", dp, p)[..., None, :]  # D_i = sum_j dP_ij P_ij, (..., 1, n)
        if self.kept is None:
            ds -= d  # dP - D
            ds *= p
        else:  # [dP^T, D, (dP - D)^T, the gradient of the scores below] for the second order
            self.kept[:] = (dp, d, np.subtract(dp, d, out=scratch(self.kept_bufs[1], ds.shape)), ds)
            np.multiply(self.kept[2], p, out=ds)
        if self.dsinks is not None and cache.p_sink is not None:  # dsink_h -= sum_i P_sink_i D_i
            self.dsinks[..., g] -= np.einsum("...i,...i->...", cache.p_sink[..., rows, 0], d[..., 0, :])
        if self.dmask is not None:  # dmask = dS, summed to the mask's shape
            _add_mask_grad(self.dmask, ds, blk, cache.groups, g)
        if cache.dcap is not None:  # through softcap: ds = dS (1 - tanh^2)
            ds *= cache.dcap[i]
        if cache.scale != 1.0:
            ds *= cache.scale  # the gradient of q k^T
        # dq = (scale dS) k;  dk = (scale dS)^T q
        np.matmul(ds.swapaxes(-1, -2), cache.k[..., c0:c1, :], out=self.dq[..., rows, :])
        _write_or_add(ds, self.qg[..., rows, :], self.dk[..., c0:c1, :], add, self.prod_buf)

    def finish(self) -> tuple:
        """The gradients in their inputs' shapes (written into ``out`` if given), then ``dmask``,
        ``dsinks``; the scratch back to the workspace."""
        cache, out = self.cache, self.out
        if self.workspace is not None:
            self.workspace.give(self.ds_buf, self.prod_buf, *self.kept_bufs)
        grads = _qkv_shaped(cache, self.dq, self.dk, self.dv)
        if out is not None and not self.direct:
            for dst, src in zip(out, grads):
                np.copyto(dst, src)
        if out is not None:
            grads = list(out)
        return tuple(grads + _option_grads(cache, self.dmask, self.dsinks))


def _qkv_shaped(cache: AttentionCache, dq, dk, dv) -> list:
    """``[dq, dk, dv]`` from the grouped layout to the inputs' own shapes (summed over broadcast axes)."""
    grads = [_ungrouped(dq, cache.groups, cache.q.shape), dk, dv]
    return [sum_to(a, s) for a, s in zip(grads, cache.shapes)] if cache.shapes else grads


def _option_grads(cache: AttentionCache, dmask, dsinks) -> list:
    """``[dmask]`` in the mask's shape (with ``mask_grad``), then ``[dsinks]`` ``(Hq,)`` from the
    per-group sums ``(..., Hk, G)`` (``h = hk * G + g``)."""
    grads = []
    if dmask is not None and cache.mask is not None:
        grads.append(dmask.reshape(cache.mask.shape).astype(cache.mask.dtype, copy=False))
    if dsinks is not None:
        grads.append(dsinks.sum(axis=tuple(range(dsinks.ndim - 2))).reshape(-1))
    return grads


@shared_doc(attention_jvp_sections=attention_jvp_sections("scaled_dot_product_attention", "AttentionCache"))
def scaled_dot_product_attention_jvp(cache: AttentionCache, *tangents) -> np.ndarray:
    """Forward mode of ``scaled_dot_product_attention``: the tangent of ``out`` along the inputs' tangents.

    The forward computed ``s = scale q k^T``, ``z = softcap(s) + alibi + mask`` (``-inf`` where
    hidden), ``P = softmax(z)`` (with the sink's logit), ``P' = P * keep / (1 - p)``, ``out = P' v``.
    Differentiating each step along the tangents (``t`` for tangent):

    * ``ts = scale (tq k^T + q tk^T)`` (product rule);
    * ``tz = ts * (1 - tanh^2(s / softcap))`` (softcap; else ``tz = ts``) ``+ tmask`` (the mask is
      added, ALiBi is constant, hidden scores have ``P = 0`` and need no tangent);
    * the softmax: ``tP = P * (tz - mu)``, ``mu_i = sum_j P_ij tz_ij + P_sink,i tsink_h`` (the sink
      is one more logit of the row, with tangent ``tsink``);
    * dropout with the forward's mask: ``tP' = tP * keep / (1 - p)``;
    * ``tout = tP' v + P' tv``.

    Computed block by block from the cached ``P`` (the forward's row blocks: a causal or windowed
    call forms only its band), in the grouped layout for grouped-query heads (no copy of k, v).

    <attention_jvp_sections>

    <examples>
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 2, 5, 4)) for _ in range(3))
    >>> tq, tk, tv = (rng.standard_normal((1, 2, 5, 4)) for _ in range(3))
    >>> out, cache = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    >>> tout = F.scaled_dot_product_attention_jvp(cache, tq, tk, tv)
    >>> f = lambda s: F.scaled_dot_product_attention(q + s * tq, k + s * tk, v + s * tv, is_causal=True)[0]
    >>> fd = (f(1e-6) - f(-1e-6)) / 2e-6                # the central difference along the tangent
    >>> bool(np.allclose(tout, fd, rtol=1e-5, atol=1e-7))
    True
    """
    check_cache(cache, AttentionCache, "scaled_dot_product_attention_jvp")
    checked = check_tangents_as(tangents, "scaled_dot_product_attention_jvp", cache.q.dtype, _tangent_specs(cache))
    return scaled_dot_product_attention_jvp_kernel(
        cache, *split_attention_tangents(checked, cache.mask is not None, cache.options.sinks is not None)
    )


def scaled_dot_product_attention_jvp_kernel(cache, tq=None, tk=None, tv=None, tmask=None, tsinks=None, weights=None):
    """The kernel of ``scaled_dot_product_attention_jvp``: tangents checked (each of its input's
    own shape, q's dtype) or None (zero).  ``weights``: a list that gets, block by block, what the
    second order forms again from the same tangents (``weights_tangents`` of
    ``scaled_dot_product_attention_backward_jvp_kernel``): ``(tP^T, mu)``, the weights' tangent
    key-major and its row offsets, or None for a block without softcap-free, dropout-free ones."""
    q, k, v, groups = cache.q, cache.k, cache.v, cache.groups
    keep, drop_scale = cache.keep, cache.drop_scale
    lq = q.shape[-2]
    score_shape = q.shape[:-1] + (k.shape[-2],)
    lead = score_shape[:-2]
    dt = q.dtype
    # the tangents as the kernel's operands: broadcast like q, k, v; queries grouped beside their kv head
    tqg = None if tq is None else _grouped(np.broadcast_to(tq, q.shape), groups)
    tk = None if tk is None else np.broadcast_to(tk, k.shape)
    tv = None if tv is None else np.broadcast_to(tv, v.shape)
    tmask_g = None if tmask is None else _mask_view(tmask, score_shape, groups)
    qg = _grouped(q, groups)
    keep_g = None if keep is None else _grouped(keep, groups)
    tout = np.zeros(_grouped_shape(q.shape[:-1] + (v.shape[-1],), groups), dt)
    for i, blk in enumerate(cache.blocks):
        p = cache.p[i]  # P^T, key-major (c1 - c0, n)
        rows, c0, c1, r0 = blk
        g = rows.start // lq if lq else 0
        # tz^T, key-major like P^T: scale (k tq^T + tk q^T), through softcap, plus the mask's tangent
        tz = _logit_tangent(cache, i, _score_tangent(cache, blk, qg, tqg, tk), tmask_g)
        if tz is None and tsinks is not None:
            tz = np.zeros(p.shape, dt)
        pk = p
        if keep_g is not None:
            kb = keep_g[..., rows, c0:c1].swapaxes(-1, -2)
            pk = p * kb
            pk *= drop_scale
        if tz is not None:
            # tP = P (tz - mu),  mu_i = sum_j P_ij tz_ij + P_sink,i tsink
            mu = np.einsum("...ji,...ji->...i", tz, p)[..., None, :]  # (..., 1, n)
            if tsinks is not None:
                mu = mu + cache.p_sink[..., rows, :].swapaxes(-1, -2) * _per_group(tsinks, lead, groups, g)
            tz -= mu
            tz *= pk  # tP' = tP keep / (1 - p)
            tout[..., rows, :] += np.matmul(tz.swapaxes(-1, -2), v[..., c0:c1, :])
        if weights is not None:  # tP itself (tP' = tP without dropout), as the second order forms it
            weights.append(None if tz is None or keep_g is not None or cache.dcap is not None else (tz, mu))
        if tv is not None:
            tout[..., rows, :] += np.matmul(pk.swapaxes(-1, -2), tv[..., c0:c1, :])  # P' tv
    return _ungrouped(tout, groups, q.shape[:-1] + (v.shape[-1],))


@shared_doc(
    attention_backward_jvp_sections=attention_backward_jvp_sections("scaled_dot_product_attention", "AttentionCache"),
)
def scaled_dot_product_attention_backward_jvp(dout, cache: AttentionCache, tangents, ddout=None) -> tuple:
    """Second order, forward over reverse: ``(grads, grad_tangents)``.

    ``grads`` is ``scaled_dot_product_attention_backward(dout, cache)``; ``grad_tangents``, in the
    same order and shapes, are the directional derivatives of those gradients when the inputs move
    along ``tangents`` (``scaled_dot_product_attention_jvp``'s tangents as a tuple: ``tq, tk, tv``,
    then ``tmask`` with ``mask_grad``, then ``tsinks`` with sinks; None or left out: zero) and
    ``dout`` along ``ddout`` (None: zero).  With ``ddout`` zero it is the Hessian of
    ``<dout, out>`` times the tangents.

    Each line of the backward differentiated by the product rule (the textbook tier derives each
    line; ``t`` for tangent, ``tP = P (tz - mu)`` the forward's tangent of the weights from the
    JVP's ``tz`` and ``mu``):

    * ``tdv = tP'^T dout + P'^T ddout``;
    * ``tdP = (ddout v^T + dout tv^T) * keep / (1 - p)`` (the forward's own mask);
    * ``tD = rowsum(tdP P + dP tP)``, ``tdS = tP (dP - D) + P (tdP - tD)`` (softmax twice);
    * softcap: ``tds = tdS (1 - T^2) - 2 dS T (1 - T^2) ts / softcap`` (``T`` recomputed per
      block from ``q k^T``: the cache keeps only ``1 - T^2``);
    * ``tdq = scale (tds k + ds tk)``, ``tdk = scale (tds^T q + ds^T tq)``; ``tdmask = tdS``;
      ``tdsink = -sum (tP_sink D + P_sink tD)`` with ``tP_sink = P_sink (tsink - mu)``.

    Computed block by block from the cached ``P`` (the forward's row blocks, so a causal or
    windowed call forms only its band), in the grouped layout (no copy of k, v).

    <attention_backward_jvp_sections>

    <examples>
    >>> rng = np.random.default_rng(0)
    >>> q, k, v, tq, tk, tv, dy = (rng.standard_normal((1, 2, 4, 3)) for _ in range(7))
    >>> out, cache = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    >>> (dq, dk, dv), (tdq, tdk, tdv) = F.scaled_dot_product_attention_backward_jvp(dy, cache, (tq, tk, tv))
    >>> def moved(s):
    ...     _, c = F.scaled_dot_product_attention(q + s * tq, k + s * tk, v + s * tv, is_causal=True)
    ...     return F.scaled_dot_product_attention_backward(dy, c)
    >>> fd = (moved(1e-6)[0] - moved(-1e-6)[0]) / 2e-6      # the central difference of dq
    >>> bool(np.allclose(tdq, fd, rtol=1e-5, atol=1e-7))
    True
    """
    op = "scaled_dot_product_attention_backward_jvp"
    check_cache(cache, AttentionCache, op)
    q, v = cache.q, cache.v
    dout, tangents, ddout = check_backward_jvp(
        dout, tangents, ddout, op, q.shape[:-1] + (v.shape[-1],), q.dtype, _tangent_specs(cache)
    )
    return scaled_dot_product_attention_backward_jvp_kernel(dout, cache, tangents, ddout)


def _tangent_specs(cache: AttentionCache) -> tuple:
    """The tangents' specs (``_blocks.attention_tangent_specs``), the JVP's and the second order's."""
    sinks = cache.options.sinks
    return attention_tangent_specs(
        cache.shapes or (cache.q.shape, cache.k.shape, cache.v.shape),
        None if cache.mask is None else cache.mask.shape,  # kept with mask_grad only
        None if sinks is None else sinks.shape,
    )


def scaled_dot_product_attention_backward_jvp_kernel(
    dout, cache: AttentionCache, tangents=(), ddout=None, weights_tangents=None, out=None, tout=None, workspace=None
) -> tuple:
    """The kernel of ``scaled_dot_product_attention_backward_jvp``: ``dout`` (and ``ddout``, None
    for zero) checked, ``tangents`` checked in the backward's order (each None or of its input's
    own shape, q's dtype).  ``weights_tangents``: what ``scaled_dot_product_attention_jvp_kernel``
    put in its ``weights`` list along the same tangents from the same cache (read, not changed),
    so that a block's ``tP`` is not formed again (two score-sized products and four passes fewer);
    None, or None for a block: formed here.  ``out``, ``tout``: arrays of q's, k's and v's shapes
    (views of a fused projection's gradient, say) to write dq, dk, dv and their tangents into, as
    ``scaled_dot_product_attention_backward_kernel``'s ``out``; ``workspace``: where the blocks'
    scratch comes from and goes back to, as there."""
    tq, tk, tv, tmask, tsinks = split_attention_tangents(
        tangents, cache.mask is not None, cache.options.sinks is not None
    )
    # the backward block by block, each block's tangents right after it from the backward's own
    # dP and D (kept for that block only): the score-sized product v dout^T formed once
    back = _Backward(cache, dout, out, workspace)
    kept = back.kept = []
    second = _BackwardTangents(cache, dout, ddout, (tq, tk, tv, tmask, tsinks), tout, workspace)
    for j, i in enumerate(back.order):
        back.block(i, add=j > 0 or not back.from_zero)
        dp, d, r, ds = kept
        second.block(i, dp, d, r, ds, None if weights_tangents is None else weights_tangents[i])
    return back.finish(), second.finish()


class _BackwardTangents:
    """The tangents of the backward's gradients, block of query rows by block (the forward's
    blocks, grouped layout): the inputs' tangents as the kernel's operands, and the gradients'
    tangents being added up (``tdq``, ``tdk``, ``tdv``; ``tdmask``, ``tdsinks`` with their options)."""

    def __init__(self, cache: AttentionCache, dout, ddout, tangents, tout=None, workspace=None):
        q, k, v, groups = cache.q, cache.k, cache.v, cache.groups
        tq, tk, tv, tmask, tsinks = tangents
        score_shape = q.shape[:-1] + (k.shape[-2],)
        self.cache, self.lead, self.tsinks = cache, score_shape[:-2], tsinks
        self.qg, self.dog = _grouped(q, groups), _grouped(dout, groups)
        self.tdog = None if ddout is None else _grouped(ddout, groups)
        # the tangents broadcast like q, k, v; queries grouped beside their kv head
        self.tqg = None if tq is None else _grouped(np.broadcast_to(tq, q.shape), groups)
        self.tk = None if tk is None else np.broadcast_to(tk, k.shape)
        self.tv = None if tv is None else np.broadcast_to(tv, v.shape)
        self.tmask_g = None if tmask is None else _mask_view(tmask, score_shape, groups)
        self.keep_g = None if cache.keep is None else _grouped(cache.keep, groups)
        # tout: added up in place when it is the kernel's own layout (zeroed first), else copied to
        self.tout = tout
        if tout is not None and groups == 1 and all(o.shape == a.shape for o, a in zip(tout, (q, k, v))):
            for o in tout:
                o[...] = 0
            self.tdq, self.tdk, self.tdv = tout
        else:
            self.tdq = np.zeros(_grouped_shape(q.shape, groups), q.dtype)
            self.tdk, self.tdv = np.zeros(k.shape, q.dtype), np.zeros(v.shape, q.dtype)
        self.tdsinks = None if cache.options.sinks is None else np.zeros(self.dog.shape[:-2] + (groups,), q.dtype)
        self.tdmask = None
        if cache.mask is not None:  # kept with mask_grad only
            self.tdmask = np.zeros((1,) * (len(q.shape) - cache.mask.ndim) + cache.mask.shape, q.dtype)
        # Scratch for the products of a block, allocated once at the largest block's size and
        # reused by every block (as the backward's): two score-sized, three of a block's rows
        lead = math.prod(self.dog.shape[:-2])
        height = max((b.n for b in cache.blocks), default=0)
        wmax = max((b.c1 - b.c0 for b in cache.blocks), default=0)
        rows = lead * max(height, wmax) * max(q.shape[-1], k.shape[-1], v.shape[-1])
        self.workspace = workspace
        self.bufs = [_empty(workspace, (n,), q.dtype) for n in (lead * height * wmax,) * 2 + (rows,) * 3]

    def block(self, i: int, dp, d, r, ds_scaled, weights=None):
        """Block ``i``: the tangents of the backward's lines, key-major like the cached ``P^T``,
        from the backward's own ``dP^T`` (after dropout), ``D``, ``(dP - D)^T`` and ``ds =
        scale dS [(1 - T^2)]`` (read, not changed; ``r`` taken over as scratch), and the JVP's
        ``(tP^T, mu)`` of this block when given (``weights``, read); ``tdq`` of its rows, ``tdk``,
        ``tdv`` of its keys added."""
        cache, blk = self.cache, self.cache.blocks[i]
        p, rows, c0, c1 = cache.p[i], blk.rows, blk.c0, blk.c1
        g = rows.start // cache.q.shape[-2] if cache.q.shape[-2] else 0
        do, tdo = self.dog[..., rows, :], None if self.tdog is None else self.tdog[..., rows, :]
        p_sink = None if cache.p_sink is None else cache.p_sink[..., rows, :].swapaxes(-1, -2)  # (..., 1, n)
        tsink = None if self.tsinks is None else _per_group(self.tsinks, self.lead, cache.groups, g)
        if weights is None:
            ts, tp, mu = self._weights_tangent(i, p_sink, tsink)
        else:  # the JVP's along the same tangents (never with softcap: ts is not read again)
            ts, (tp, mu) = None, weights
        kb = None if self.keep_g is None else self.keep_g[..., rows, c0:c1].swapaxes(-1, -2) * cache.drop_scale
        pk, tpk = (p, tp) if kb is None else (p * kb, tp * kb)
        s1, s2, x1, x2, x3 = self.bufs
        # dv = P'^T dout:  tdv = tP'^T dout + P'^T ddout
        tdv = _product(x1, tpk, do)
        if tdo is not None:
            tdv += _product(x2, pk, tdo)
        self.tdv[..., c0:c1, :] += tdv
        # dP^T = (v dout^T) keep / (1-p):  tdP^T = (v ddout^T + tv dout^T) keep / (1-p)
        if tdo is None:
            tdp = scratch(s1, dp.shape)
            tdp[...] = 0
        else:
            tdp = _product(s1, cache.v[..., c0:c1, :], tdo.swapaxes(-1, -2))
        if self.tv is not None:
            tdp += _product(s2, self.tv[..., c0:c1, :], do.swapaxes(-1, -2))
        if kb is not None:
            tdp *= kb
        # D = rowsum(dP P), dS = P (dP - D): the softmax's backward and its tangent
        td = (np.einsum("...ji,...ji->...i", tdp, p) + np.einsum("...ji,...ji->...i", dp, tp))[..., None, :]
        softcap = cache.options.softcap if cache.dcap is not None else None
        ds = None if softcap is None else p * r  # dS itself, before softcap's factor and the scale
        tds = np.multiply(tp, r, out=r)  # tP (dP - D) + P (tdP - tD), the second in tdp's array
        tds += np.multiply(p, np.subtract(tdp, td, out=tdp), out=tdp)
        if self.tdsinks is not None and p_sink is not None:  # dsink = -sum P_sink D
            tp_sink = p_sink * ((0.0 if tsink is None else tsink) - mu)
            self.tdsinks[..., g] -= np.einsum("...ji,...ji->...", tp_sink, d) + np.einsum(
                "...ji,...ji->...", p_sink, td
            )
        if self.tdmask is not None:  # dmask = dS
            _add_mask_grad(self.tdmask, tds, blk, cache.groups, g)
        if softcap is not None and cache.dcap is not None:
            _, tds = self._through_softcap(i, ds, tds, ts, cache.dcap[i], softcap)
        # dq = ds k, dk = ds^T q (ds = scale dS, the backward's): products of two moving factors
        tdq = _product(x1, tds.swapaxes(-1, -2), cache.k[..., c0:c1, :])
        tdk = _product(x2, tds, self.qg[..., rows, :])
        tdq *= cache.scale
        tdk *= cache.scale
        if self.tk is not None:
            tdq += _product(x3, ds_scaled.swapaxes(-1, -2), self.tk[..., c0:c1, :])
        if self.tqg is not None:
            tdk += _product(x3, ds_scaled, self.tqg[..., rows, :])
        self.tdq[..., rows, :] += tdq
        self.tdk[..., c0:c1, :] += tdk

    def _weights_tangent(self, i: int, p_sink, tsink):
        """Block ``i``'s ``(ts^T, tP^T, mu)``: the scores' tangent (None when q and k do not move),
        the forward's tangent of the weights ``tP = P (tz - mu)`` and ``mu = rowsum(P tz) +
        P_sink tsink``, as the JVP forms them."""
        cache, blk = self.cache, self.cache.blocks[i]
        p = cache.p[i]
        ts = _score_tangent(cache, blk, self.qg, self.tqg, self.tk)
        # ts is read again only through softcap: a copy then, else tz (and tP) are formed in its array
        tz = _logit_tangent(cache, i, ts if ts is None or cache.dcap is None else ts.copy(), self.tmask_g)
        mu = (
            np.zeros(p.shape[:-2] + (1, p.shape[-1]), p.dtype)
            if tz is None
            else np.einsum("...ji,...ji->...i", tz, p)[..., None, :]
        )
        if tsink is not None:
            mu = mu + p_sink * tsink
        tp = p * (0.0 - mu) if tz is None else np.multiply(p, np.subtract(tz, mu, out=tz), out=tz)  # in place
        return ts, tp, mu

    def _through_softcap(self, i: int, ds, tds, ts, dcap, softcap: float):
        """``ds = dS (1 - T^2)`` and ``tds = tdS (1 - T^2) - 2 dS T (1 - T^2) ts / softcap``; ``T``
        from the block's scores again (the cache keeps ``dcap = 1 - T^2``, not ``T``'s sign)."""
        cache, blk = self.cache, self.cache.blocks[i]
        out = tds * dcap
        if ts is not None:
            s = np.matmul(cache.k[..., blk.c0 : blk.c1, :], self.qg[..., blk.rows, :].swapaxes(-1, -2))
            t = np.tanh(s * (cache.scale / softcap))
            out -= (2.0 / softcap) * ds * t * dcap * ts
        return ds * dcap, out

    def finish(self) -> tuple:
        """The gradients' tangents in their inputs' shapes (written into ``tout`` if given), then
        ``tdmask``, ``tdsinks``; the scratch back to the workspace."""
        if self.workspace is not None:
            self.workspace.give(*self.bufs)
        tans = _qkv_shaped(self.cache, self.tdq, self.tdk, self.tdv)
        if self.tout is not None:
            for dst, src in zip(self.tout, tans):
                if dst is not src:
                    np.copyto(dst, src)
            tans = list(self.tout)
        return tuple(tans + _option_grads(self.cache, self.tdmask, self.tdsinks))


def _product(buf, a, b):
    """``a @ b`` written on the start of the flat scratch ``buf`` (no allocation)."""
    shape = np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
    return np.matmul(a, b, out=scratch(buf, shape))


def _score_tangent(cache: AttentionCache, blk: Block, qg, tqg, tk):
    """``ts^T = scale (k tq^T + tk q^T)`` of one block, key-major ``(..., c1 - c0, n)`` (the product
    rule on the scores; ``qg``, ``tqg`` in the grouped layout), a new array, or None when neither
    q nor k moves."""
    rows, c0, c1 = blk.rows, blk.c0, blk.c1
    ts = None
    if tqg is not None:
        ts = np.matmul(cache.k[..., c0:c1, :], tqg[..., rows, :].swapaxes(-1, -2))
    if tk is not None:
        part = np.matmul(tk[..., c0:c1, :], qg[..., rows, :].swapaxes(-1, -2))
        ts = part if ts is None else np.add(ts, part, out=ts)
    if ts is not None and cache.scale != 1.0:
        ts *= cache.scale
    return ts


def _logit_tangent(cache: AttentionCache, i: int, ts, tmask_g):
    """``tz^T = ts^T (1 - tanh^2) + tmask^T`` of block ``i`` (softcap's derivative, the float
    mask's own tangent; ALiBi is a constant), in place in ``ts`` when given; None when nothing
    moves the logits."""
    blk = cache.blocks[i]
    if ts is not None and cache.dcap is not None:
        ts *= cache.dcap[i]  # d(c tanh(s / c)) = (1 - tanh^2) ds
    if tmask_g is not None:
        part = _mask_block(tmask_g, blk, cache.groups, cache.q.shape[-2]).swapaxes(-1, -2)
        shape = cache.p[i].shape
        ts = np.array(np.broadcast_to(part, shape), cache.q.dtype) if ts is None else np.add(ts, part, out=ts)
    return ts


def _add_mask_grad(dmask, ds_t, blk: Block, groups, g):
    """``dmask[heads of group g, rows, keys] += dS`` for one block (``ds_t`` key-major), summed over
    the dimensions along which the mask (``dmask``'s shape, padded to the scores' rank) broadcasts."""
    x = ds_t.swapaxes(-1, -2)  # (..., Hk, n, c1 - c0)
    mshape = dmask.shape
    if groups > 1 and mshape[-3] != 1:
        head = slice(g, None, groups)
    else:
        head = slice(None)
    rows = slice(None) if mshape[-2] == 1 else slice(blk.r0, blk.r0 + blk.n)
    cols = slice(None) if mshape[-1] == 1 else slice(blk.c0, blk.c1)
    target = dmask[..., head, rows, cols] if len(mshape) >= 3 else dmask[..., rows, cols]
    target += sum_to(x, target.shape)


def _write_or_add(a, b, acc, add, buf):
    """``acc += a @ b`` (the product formed in the scratch ``buf``) when ``add``, else ``acc[...] = a @ b``."""
    if add:
        prod = scratch(buf, acc.shape)
        np.matmul(a, b, out=prod)
        acc += prod
    else:
        np.matmul(a, b, out=acc)

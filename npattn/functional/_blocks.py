"""What both attention cores share: input checks, the option validator, and the block geometry.

``scaled_dot_product_attention`` (``attention.py``) and ``memory_efficient_attention``
(``memory_efficient.py``) both work on blocks of the score matrix held key-major, ``S^T`` of
shape ``(..., keys, queries)``.  This module holds the pieces they have in common:

* ``check_qkv`` (-> ``QKV``), ``check_scale``, ``AttentionOptions.checked``:
  validation and casting at the public edge (``ValueError``/``TypeError`` naming the argument,
  before any arithmetic); ``check_attention_tangents``: the tangents of a JVP
  (``attention_tangent_specs``, ``split_attention_tangents``: shared with the second order);
* ``gqa_groups``, ``fold_heads``/``fold_kv``: the one grouped-query formula and scheme (query
  head ``h = hk * G + g`` viewed at ``(hk, g)`` beside its kv head, no copy);
* ``out_lead``, ``broadcast_qkv``, ``pad_shape``, ``with_ndim``, ``sum_to``: torch's broadcasting
  of the leading (batch) dimensions of q, k, v (kernels, unchecked), and the reduction of a
  gradient back to its input's own shape;
* ``Band``, ``band``, ``key_range``, ``query_range``, ``band_width``, ``band_hidden``,
  ``causal_hidden``, ``distance``: which keys a query may see (causal, ``causal_align``,
  ``window``) and which queries a key, the hidden pairs of a key-major block (the causal diagonal
  mask is the band ``right = 0``) and the ALiBi distances ``|p - j|``;
* ``Block``, ``row_blocks``: the query-row blocks of the plain core, each spanning only the keys
  its rows may see;
* ``scratch``: a contiguous view on the front of a preallocated flat buffer.

Names: ``n`` rows of a block, ``h`` heads, ``e`` exponentials (never the head dimension).
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import NamedTuple, Optional

import numpy as np

from .._validate import (
    as_float,
    as_floats_of_one_dtype,
    check_bool,
    check_broadcastable,
    check_positive_float,
    check_tangents_as,
)

CAUSAL_ALIGNS = ("top_left", "bottom_right")


# -- q, k, v -----------------------------------------------------------------------------------------
class QKV(NamedTuple):
    """Validated q, k, v (one float dtype, shapes as given) and the number of query heads
    per key/value head (1 without grouped-query attention)."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    groups: int


def pad_shape(shape: tuple, ndim: int) -> tuple:
    """``shape`` with leading 1s up to ``ndim`` dimensions (numpy's broadcasting aligns on the right)."""
    return (1,) * (ndim - len(shape)) + tuple(shape)


def with_ndim(a: np.ndarray, ndim: int) -> np.ndarray:
    """``a`` viewed with ``ndim`` dimensions: leading 1s added (or dropped: they must be 1)."""
    if a.ndim > ndim:
        return a.reshape(a.shape[a.ndim - ndim :])
    return a if a.ndim == ndim else a.reshape(pad_shape(a.shape, ndim))


def check_qkv(q, k, v, enable_gqa: bool) -> QKV:
    """Validate and cast ``q (..., Hq, Lq, E)``, ``k (..., Hk, Lk, E)``, ``v (..., Hk, Lk, Ev)``.

    The leading dimensions (everything before ``(L, E)``) broadcast against each other as in
    torch (numpy's rules, aligned on the right).  With ``enable_gqa`` and ``Hq != Hk`` the head
    axis (``-3``) is grouped instead: ``Hk`` (k's and v's head counts broadcast together) must
    divide ``Hq``, and only the dimensions before the heads broadcast.  The arrays are returned
    with their own shapes; ``broadcast_qkv`` makes the views the kernels compute on.
    """
    q, k, v = as_floats_of_one_dtype(("q", q), ("k", k), ("v", v))  # mixed float dtypes: TypeError, as torch
    if q.ndim < 2:
        raise ValueError(f"q: expected shape (..., L, E) with at least 2 dimensions, got {q.shape}")
    for name, a in (("k", k), ("v", v)):
        if a.ndim < 2:
            raise ValueError(f"{name}: expected shape (..., L, E) with at least 2 dimensions, got {a.shape}")
    if q.shape[-1] < 1:
        raise ValueError(f"q: expected an embedding dimension >= 1, got shape {q.shape}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k: expected last dimension {q.shape[-1]} (q's E), got shape {k.shape}")
    if v.shape[-2] != k.shape[-2]:
        raise ValueError(f"v: expected {k.shape[-2]} keys (dimension -2) like k {k.shape}, got shape {v.shape}")
    try:
        kv_lead = np.broadcast_shapes(k.shape[:-2], v.shape[:-2])
    except ValueError:
        raise ValueError(
            f"v: expected leading dimensions broadcastable with k {k.shape}, got shape {v.shape}"
        ) from None
    nd = max(q.ndim, k.ndim, v.ndim)
    hq = pad_shape(q.shape[:-2], nd - 2)[-1] if nd >= 3 else 1
    hk = pad_shape(kv_lead, nd - 2)[-1] if nd >= 3 else 1
    if enable_gqa and nd >= 3 and hq != hk:
        if hk == 0 or hq % hk:
            raise ValueError(
                f"k: with enable_gqa the number of query heads ({hq}) must be a multiple of the "
                f"number of key/value heads, got {hk} (q {q.shape}, k {k.shape})"
            )
        groups = gqa_groups(q.shape, k.shape, v.shape, enable_gqa)
        try:
            np.broadcast_shapes(pad_shape(q.shape[:-2], nd - 2)[:-1], pad_shape(kv_lead, nd - 2)[:-1])
        except ValueError:
            raise ValueError(
                f"k: expected batch dimensions broadcastable with q {q.shape}, got shape {k.shape}"
            ) from None
        return QKV(q, k, v, groups)
    try:
        np.broadcast_shapes(q.shape[:-2], kv_lead)
    except ValueError:
        hint = (
            " (pass enable_gqa=True for grouped-query attention)"
            if nd >= 3 and hk and hq % hk == 0 and not enable_gqa
            else ""
        )
        raise ValueError(
            f"k: expected leading dimensions broadcastable with q {q.shape}, got shape {k.shape}{hint}"
        ) from None
    return QKV(q, k, v, 1)


def broadcast_shapes(*shapes: tuple) -> tuple:
    """``np.broadcast_shapes`` for shapes known to broadcast, without its cost (some microseconds,
    a noticeable part of a small attention call) when they are all equal, the usual case."""
    first = shapes[0]
    if shapes.count(first) == len(shapes):
        return tuple(first)
    return tuple(np.broadcast_shapes(*shapes))


def gqa_groups(q_shape: tuple, k_shape: tuple, v_shape: tuple, enable_gqa: bool) -> int:
    """``G``, the query heads per key/value head, for shapes ``check_qkv`` accepted (no checks):
    ``Hq / Hk`` with ``enable_gqa`` (head axis -3; k's and v's head counts broadcast together),
    else 1.  Query head ``h`` reads kv head ``h // G`` (``fold_heads``).  The one formula of
    every attention core, the textbook tier's included."""
    nd = max(len(q_shape), len(k_shape), len(v_shape))
    if not enable_gqa or nd < 3:
        return 1
    hq = pad_shape(q_shape[:-2], nd - 2)[-1]
    hk = broadcast_shapes(pad_shape(k_shape[:-2], nd - 2), pad_shape(v_shape[:-2], nd - 2))[-1]
    return 1 if hq == hk else hq // hk


def fold_heads(a: np.ndarray, groups: int, axis: int = -3) -> np.ndarray:
    """The one grouped-query scheme: ``a``'s query-head axis ``axis`` (``Hq = Hk * G``) viewed as
    ``(Hk, G)`` (a reshape, no copy): query head ``h = hk * G + g`` sits at ``(hk, g)`` beside
    kv head ``hk``.  A size-1 axis (an array broadcast over the heads) becomes ``(1, 1)``.  The
    kv side gets a size-1 group axis (``fold_kv``), so a batched product of the two broadcasts
    each kv head over its ``G`` query heads without repeating it; a kv gradient is then the sum
    over that axis."""
    if groups == 1:
        return a
    axis %= a.ndim
    n = a.shape[axis]
    return a.reshape(a.shape[:axis] + ((n // groups, groups) if n != 1 else (1, 1)) + a.shape[axis + 1 :])


def fold_kv(a: np.ndarray, groups: int) -> np.ndarray:
    """k or v ``(..., Hk, L, D)`` viewed as ``(..., Hk, 1, L, D)`` to meet ``fold_heads(q, groups)``."""
    return a if groups == 1 else a.reshape(a.shape[:-3] + (a.shape[-3], 1) + a.shape[-2:])


def out_lead(q_shape: tuple, k_shape: tuple, v_shape: tuple, groups: int) -> tuple:
    """The leading dimensions ``(..., Hq)`` of the scores and output for checked shapes."""
    nd = max(len(q_shape), len(k_shape), len(v_shape))
    ql = pad_shape(q_shape[:-2], nd - 2)
    kl = broadcast_shapes(pad_shape(k_shape[:-2], nd - 2), pad_shape(v_shape[:-2], nd - 2))
    if groups == 1:
        return broadcast_shapes(ql, kl)
    return broadcast_shapes(ql[:-1], kl[:-1]) + (ql[-1],)


def broadcast_qkv(q: np.ndarray, k: np.ndarray, v: np.ndarray, groups: int):
    """Views of q, k, v with the common leading dimensions ``(..., Hq)`` (k and v: ``(..., Hk)``);
    no copy when the shapes already agree."""
    lead = q.shape[:-2]
    if groups == 1 and k.shape[:-2] == lead and v.shape[:-2] == lead:  # the usual case: nothing to do
        return q, k, v
    lead = out_lead(q.shape, k.shape, v.shape, groups)
    kv_lead = lead[:-1] + (lead[-1] // groups,) if lead else lead

    def view(a, want):
        return a if a.shape[:-2] == want else np.broadcast_to(a, want + a.shape[-2:])

    return view(q, lead), view(k, kv_lead), view(v, kv_lead)


def sum_to(a: np.ndarray, shape: tuple) -> np.ndarray:
    """``a`` summed over the dimensions that broadcasting added or stretched, to ``shape``."""
    shape = tuple(shape)
    if a.shape == shape:
        return a
    extra = a.ndim - len(shape)
    axes = tuple(range(extra)) + tuple(extra + i for i, s in enumerate(shape) if s == 1 and a.shape[extra + i] != 1)
    return a.sum(axis=axes, keepdims=True).reshape(shape)


# -- scalars and options ----------------------------------------------------------------------------
def default_scale(scale, head_dim: int):
    """The scores' scale: ``scale`` as given, or ``1/sqrt(E)`` (a python float) when None."""
    return 1.0 / math.sqrt(head_dim) if scale is None else scale


def check_scale(scale, head_dim: int) -> float:
    """``scale`` or ``1/sqrt(E)`` as a python float (keeps float32 arrays float32).
    Non-real -> ``TypeError``; NaN or infinite -> ``ValueError``."""
    if scale is None:
        return default_scale(None, head_dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale: expected a finite real number or None, got {scale!r} ({type(scale).__name__})")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite real number or None, got {scale}")
    return scale


class AttentionOptions(NamedTuple):
    """The attention options, one object from the public edge to the kernels: as the user passed
    them, or validated by ``checked`` (which every public op calls before any arithmetic)."""

    causal_align: str = "top_left"
    window: Optional[tuple[int, int]] = None
    alibi_slopes: Optional[np.ndarray] = None  # (..., Hq), broadcastable to the scores' leading dims
    softcap: Optional[float] = None
    sinks: Optional[np.ndarray] = None  # (Hq,)
    mask_grad: bool = False

    @property
    def scale_only(self) -> bool:
        """True when nothing but the scale enters the scores (no ALiBi, softcap or sinks); which
        keys a row sees is the band's business (causal masking, ``window``)."""
        return self.alibi_slopes is None and self.softcap is None and self.sinks is None

    @property
    def plain(self) -> bool:
        """True when no option changes the plain computation (alignment alone changes nothing
        without causal masking, a window or ALiBi)."""
        return (
            self.window is None
            and self.alibi_slopes is None
            and self.softcap is None
            and self.sinks is None
            and not self.mask_grad
        )

    def checked(self, score_shape: tuple, dtype, attn_mask) -> AttentionOptions:
        """These options, as the user passed them, validated for scores of shape ``(..., Hq, Lq,
        Lk)`` in ``dtype``; ``attn_mask`` is the already checked mask (or None).

        * ``causal_align``: ``"top_left"`` or ``"bottom_right"``;
        * ``window``: None or ``(left, right)``, integers >= -1 (-1: unbounded on that side);
        * ``alibi_slopes``: None or a finite float array broadcastable to ``(..., Hq)``;
        * ``softcap``: None or a finite float > 0;
        * ``sinks``: None or a finite float array of shape ``(Hq,)`` (``Hq`` is 1 without a head axis);
        * ``mask_grad``: a bool; True needs a float ``attn_mask``.
        """
        causal_align, window, alibi_slopes, softcap, sinks, mask_grad = self
        if not isinstance(causal_align, str):
            got = f"{causal_align!r} ({type(causal_align).__name__})"
            raise TypeError(f"causal_align: expected 'top_left' or 'bottom_right', got {got}")
        if causal_align not in CAUSAL_ALIGNS:
            raise ValueError(f"causal_align: expected 'top_left' or 'bottom_right', got {causal_align!r}")
        if window is not None:
            if not isinstance(window, (tuple, list)):
                raise TypeError(
                    f"window: expected None or a pair (left, right) of ints, got {window!r} ({type(window).__name__})"
                )
            if len(window) != 2:
                raise ValueError(f"window: expected a pair (left, right), got {len(window)} values {tuple(window)!r}")
            for side, w in zip(("left", "right"), window):
                if isinstance(w, (bool, np.bool_)) or not isinstance(w, numbers.Integral):
                    raise TypeError(f"window: expected integer sizes, got {side} = {w!r} ({type(w).__name__})")
                if w < -1:
                    raise ValueError(f"window: expected sizes >= -1 (-1 = unbounded), got {side} = {w}")
            window = (int(window[0]), int(window[1]))
        lead = tuple(score_shape[:-2])
        if alibi_slopes is not None:
            alibi_slopes = _check_float_array(alibi_slopes, "alibi_slopes", dtype)
            check_broadcastable(alibi_slopes.shape, lead, "alibi_slopes", "..., Hq")
        if softcap is not None:
            softcap = check_positive_float(softcap, "softcap")
        if sinks is not None:
            sinks = _check_float_array(sinks, "sinks", dtype)
            hq = score_shape[-3] if len(score_shape) >= 3 else 1
            if sinks.shape != (hq,):
                raise ValueError(f"sinks: expected shape ({hq},) (one logit per query head), got {sinks.shape}")
        mask_grad = check_bool(mask_grad, "mask_grad")
        if mask_grad and (attn_mask is None or attn_mask.dtype == bool):
            got = "None" if attn_mask is None else "a bool mask"
            raise ValueError(f"mask_grad: True needs a float attn_mask (its gradient is returned), got {got}")
        return AttentionOptions(causal_align, window, alibi_slopes, softcap, sinks, mask_grad)


def _check_float_array(x, name: str, dtype) -> np.ndarray:
    a = as_float(x, name, dtype)
    if a.size and not np.isfinite(a).all():
        raise ValueError(f"{name}: expected finite values, got {'NaN' if np.isnan(a).any() else 'inf'}")
    return a


def attention_tangent_specs(qkv_shapes: tuple, mask_shape, sinks_shape) -> tuple:
    """The tangents an attention JVP or second order takes, as ``check_tangents_as`` specs in the
    backward's order of gradients: ``tq, tk, tv`` (of ``qkv_shapes``), then ``tmask`` (of
    ``mask_shape``; only with ``mask_grad``, else pass None), then ``tsinks`` (of ``sinks_shape``;
    only with sinks)."""
    specs = [("tq", qkv_shapes[0]), ("tk", qkv_shapes[1]), ("tv", qkv_shapes[2])]
    if mask_shape is not None:
        specs.append(("tmask", mask_shape))
    if sinks_shape is not None:
        specs.append(("tsinks", sinks_shape))
    return tuple(specs)


def split_attention_tangents(tangents: tuple, mask_grad: bool, has_sinks: bool) -> tuple:
    """``(tq, tk, tv, tmask, tsinks)`` from tangents in the backward's order (``tmask`` only with
    ``mask_grad``, ``tsinks`` only with sinks; those left out at the end are None, i.e. zero)."""
    tq, tk, tv, *rest = tuple(tangents) + (None,) * (3 + mask_grad + has_sinks - len(tangents))
    tmask = rest.pop(0) if mask_grad else None
    tsinks = rest.pop(0) if has_sinks else None
    return tq, tk, tv, tmask, tsinks


def check_attention_tangents(tangents: tuple, op: str, qkv_shapes: tuple, mask_shape, sinks_shape, dtype) -> tuple:
    """The tangents given to an attention JVP, checked (``check_tangents_as`` with
    ``attention_tangent_specs``), each cast to ``dtype``.  Returns ``(tq, tk, tv, tmask, tsinks)``,
    None for zero or absent."""
    specs = attention_tangent_specs(qkv_shapes, mask_shape, sinks_shape)
    return split_attention_tangents(
        check_tangents_as(tangents, op, dtype, specs), mask_shape is not None, sinks_shape is not None
    )


# -- which keys a query may see ------------------------------------------------------------------------
class Band(NamedTuple):
    """Query ``i`` sits at position ``p = i + offset`` and may see the keys ``j`` with
    ``p - left <= j <= p + right`` (None: unbounded on that side)."""

    offset: int
    left: Optional[int]
    right: Optional[int]

    @property
    def full(self) -> bool:
        return self.left is None and self.right is None


def band(
    lq: int, lk: int, is_causal: bool, causal_align: str = "top_left", window: Optional[tuple[int, int]] = None
) -> Band:
    """The band of visible keys: causal masking bounds ``right`` by 0, the window by its sides."""
    offset = lk - lq if causal_align == "bottom_right" else 0
    left = right = None
    if window is not None:
        left = None if window[0] == -1 else window[0]
        right = None if window[1] == -1 else window[1]
    if is_causal:
        right = 0 if right is None else min(right, 0)
    return Band(offset, left, right)


def key_range(b: Band, r0: int, r1: int, lk: int) -> tuple[int, int]:
    """``(c0, c1)``: the keys ``c0..c1-1`` some query of ``r0..r1-1`` may see (``c0 == c1``: none)."""
    if r1 <= r0:
        return 0, 0
    c0 = 0 if b.left is None else max(0, r0 + b.offset - b.left)
    c1 = lk if b.right is None else max(0, min(lk, r1 - 1 + b.offset + b.right + 1))
    c0 = min(c0, lk)
    return c0, max(c0, c1)


def band_hidden(b: Band, c0: int, nk: int, r0: int, nq: int, cache: Optional[dict] = None) -> Optional[np.ndarray]:
    """Key-major bool block ``(nk, nq)``: True where key ``c0 + a`` is hidden from query ``r0 + i``
    by the band; None when the band hides nothing in the block.  Small blocks (at most
    ``_SHARED_MASK_SIZE`` entries) are built once and kept, read-only, in a module-wide cache of at
    most ``_SHARED_MASKS`` (oldest dropped first), so that calls after the first find them; larger
    ones are built once per call in ``cache`` (a dict the caller keeps for one call), if given."""
    d0 = c0 - r0 - b.offset  # key minus query position at the block's corner
    # d = d0 + a - i ranges over [d0 - nq + 1, d0 + nk - 1]
    lo, hi = d0 - nq + 1, d0 + nk - 1
    need_right = b.right is not None and hi > b.right
    need_left = b.left is not None and lo < -b.left
    if not (need_right or need_left) or nk == 0 or nq == 0:
        return None
    key = (d0, nk, nq, b.left, b.right)
    store = _SHARED if nk * nq <= _SHARED_MASK_SIZE else cache
    m = None if store is None else store.get(key)
    if m is None:
        d = np.arange(d0, d0 + nk)[:, None] - np.arange(nq)[None, :]
        m = np.zeros((nk, nq), bool)
        if b.right is not None:
            m |= d > b.right
        if b.left is not None:
            m |= d < -b.left
        if store is _SHARED:
            m.flags.writeable = False
            while len(_SHARED) >= _SHARED_MASKS:
                _SHARED.pop(next(iter(_SHARED)), None)
        if store is not None:
            store[key] = m
    return m


_SHARED: dict = {}
_SHARED_MASKS = 64
_SHARED_MASK_SIZE = 128 * 128


def causal_hidden(nk: int, nq: int, offset: int) -> np.ndarray:
    """The causal diagonal mask, key-major ``(nk, nq)``: key ``j0 + a`` hidden from query ``i0 + i``
    iff ``j0 + a > i0 + i`` (``offset = i0 - j0``)."""
    m = band_hidden(Band(0, None, 0), -offset, nk, 0, nq)
    return np.zeros((nk, nq), bool) if m is None else m


def query_range(b: Band, c0: int, c1: int, lq: int) -> tuple[int, int]:
    """``(r0, r1)``: the queries ``r0..r1-1`` that may see some key of ``c0..c1-1`` (none: ``r0 == r1``);
    ``key_range`` read the other way.  Key ``j`` is seen by the positions ``j - right .. j + left``,
    i.e. the queries ``p - offset``."""
    if c1 <= c0:
        return 0, 0
    r0 = 0 if b.right is None else max(0, c0 - b.right - b.offset)
    r1 = lq if b.left is None else max(0, min(lq, c1 - 1 + b.left - b.offset + 1))
    r0 = min(r0, lq)
    return r0, max(r0, r1)


def band_width(b: Band, lk: int) -> int:
    """Keys a query may see at most."""
    if b.left is None or b.right is None:
        return lk
    return max(0, min(lk, b.left + b.right + 1))


def distance(b: Band, c0: int, nk: int, r0: int, nq: int, dtype, out: Optional[np.ndarray] = None) -> np.ndarray:
    """Key-major ``(nk, nq)`` block of ``|p - j|`` (query position minus key), for ALiBi: key
    ``c0 + a`` and query ``r0 + i`` are ``d0 + a - i`` apart with ``d0 = c0 - r0 - offset``.
    Written into ``out`` (an ``(nk, nq)`` array of ``dtype``) if given."""
    d = np.add(_key_minus_query(nk, nq, np.dtype(dtype)), c0 - r0 - b.offset, out=out)
    return np.abs(d, out=d)


@functools.lru_cache(maxsize=8)
def _key_minus_query(nk: int, nq: int, dtype: np.dtype) -> np.ndarray:
    """``a - i`` over a key-major ``(nk, nq)`` block, read-only (kept: every block of a call asks)."""
    grid = np.arange(nk, dtype=dtype)[:, None] - np.arange(nq, dtype=dtype)[None, :]
    grid.flags.writeable = False
    return grid


# -- query-row blocks of the plain core -------------------------------------------------------------
class Block(NamedTuple):
    """One block of query rows in the grouped layout ``(..., Hk, G*Lq, ...)``: ``rows`` (a slice
    that never straddles two query heads), the keys ``c0..c1-1`` its rows may see, and the
    block's first query index ``r0``."""

    rows: slice
    c0: int
    c1: int
    r0: int

    @property
    def n(self) -> int:
        return self.rows.stop - self.rows.start


@functools.lru_cache(maxsize=64)
def row_blocks(lq: int, lk: int, groups: int, height: Optional[int], b: Band) -> tuple[Block, ...]:
    """The query-row blocks (``height`` rows each, None: one block per group of all rows), each
    spanning only the keys its rows may see.  (Kept for the latest 64 geometries: a training loop
    asks for the same ones every step.)"""
    if lq == 0:
        return ()
    if height is None:
        c0, c1 = key_range(b, 0, lq, lk)
        return tuple(Block(slice(g * lq, (g + 1) * lq), c0, c1, 0) for g in range(groups))
    out = []
    for g in range(groups):
        for r0 in range(0, lq, height):
            r1 = min(r0 + height, lq)
            c0, c1 = key_range(b, r0, r1, lk)
            out.append(Block(slice(g * lq + r0, g * lq + r1), c0, c1, r0))
    return tuple(out)


# -- buffers -----------------------------------------------------------------------------------------
def scratch(buf: np.ndarray, shape: tuple) -> np.ndarray:
    """A C-contiguous array of ``shape`` on the start of the flat buffer ``buf`` (no allocation)."""
    return buf[: math.prod(shape)].reshape(shape)

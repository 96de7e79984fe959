"""Rotary position embedding (RoPE): ``rope`` and ``rope_backward``.

RoPE (Su et al., 2021) rotates pairs of features of a query or key by an angle proportional to
the token's position, so that the dot product of a rotated query at position ``p`` and a rotated
key at position ``s`` depends on ``p - s`` only.  With ``D`` features there are ``D/2`` pairs; pair
``i`` at position ``p`` turns by ``theta = p * base**(-2i/D)``:

    (a, b)  ->  (a cos(theta) - b sin(theta),  b cos(theta) + a sin(theta))

Two layouts of the pairs are in use: ``(i, i + D/2)`` ("rotate half", GPT-NeoX, Llama, Hugging Face
``apply_rotary_pos_emb``) and ``(2i, 2i + 1)`` (``interleaved=True``: the RoFormer paper, GPT-J,
Meta's original Llama code).
"""

from __future__ import annotations

import functools
import numbers
from typing import NamedTuple

import numpy as np

from .._docs import FD_CHECK, backward_jvp_sections, jvp_sections, shared_doc
from .._validate import (
    as_float,
    as_index,
    check_backward_jvp,
    check_bool,
    check_broadcastable,
    check_cache,
    check_grad,
    check_ndim,
    check_tangents_as,
)
from .rope_scaling import check_scaling, inverse_frequencies, resolve_base, resolve_rotary_dim

__all__ = ["RopeCache", "rope", "rope_backward", "rope_jvp", "rope_backward_jvp"]


class RopeCache(NamedTuple):
    cos: np.ndarray  # (..., L, D/2) broadcastable against x's pairs, x's dtype
    sin: np.ndarray
    interleaved: bool
    shape: tuple
    dtype: np.dtype


@shared_doc()
def rope(
    x: np.ndarray,
    positions=None,
    *,
    base: float = 10000.0,
    interleaved: bool = False,
    scaling=None,
    rotary_dim: int | None = None,
) -> tuple[np.ndarray, RopeCache]:
    """Rotary position embedding of ``x (..., L, D)``.

    Parameters
    ----------
    x : ndarray
        ``(..., L, D)``, float (integers are cast to float64).
    positions : array of int, optional
        Integers broadcastable to ``(..., L)`` (x's shape without the feature axis); default
        ``arange(L)``.  Pass ``arange(L) + t`` for new tokens after ``t`` cached ones (a KV
        cache), or a ``(batch, 1, L)`` array for per-sequence positions of ``(batch, heads, L, D)``.
    base : float
        A finite number > 0 (``rope_theta``); a ``rope_theta`` in ``scaling`` takes its place
        (``base`` then left at 10000 or equal to it).
    interleaved : bool
        Pairs ``(2i, 2i+1)`` instead of ``(i, i + R/2)`` (rotate half, as Hugging Face).
    scaling : mapping or None
        A Hugging Face ``rope_scaling`` / ``rope_parameters`` dict: ``rope_type`` (or ``type``)
        ``"default"``, ``"linear"``, ``"dynamic"``, ``"ntk_alpha"``, ``"yarn"``, ``"llama3"`` or
        ``"longrope"`` and its keys (see ``rope_frequencies``).  ``dynamic`` and ``longrope`` read the
        sequence length as the largest position + 1.
        YaRN's attention factor multiplies cos and sin (the rotated features only).
    rotary_dim : int, optional
        ``R``, the number of leading features of each head that rotate (even, at most ``D``); the
        other ``D - R`` pass through unchanged (GPT-NeoX, Qwen3-Next).  Default: ``D``, or
        ``int(D * partial_rotary_factor)`` when ``scaling`` has that key.

    Returns
    -------
    y : ndarray
        Like ``x``: pair ``i`` of the first ``R`` features at position ``p`` turned by
        ``p * inv_freq[i]`` (``base**(-2i/R)`` unscaled) and multiplied by the attention factor.
    cache : RopeCache
        For ``rope_backward``.

    Raises
    ------
    ValueError, TypeError
        Bad input, naming the argument (a bad ``scaling`` names its key).

    Notes
    -----
    The angles are computed in float64 and their cos/sin then cast to x's dtype (float32 stays
    float32).

    <examples>
    >>> x = np.random.default_rng(0).standard_normal((2, 5, 8))      # (batch, L, D)
    >>> y, cache = F.rope(x)
    >>> bool(np.allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1)))   # a rotation
    True
    >>> bool(np.allclose(F.rope_backward(y, cache), x))            # its transpose undoes it
    True
    """
    x = as_float(x, "x")
    check_ndim(x, "x", 2, "(..., L, D)")
    if positions is not None:
        positions = as_index(positions, "positions")
        check_broadcastable(positions.shape, x.shape[:-1], "positions", "x's shape without D")
    if isinstance(base, bool) or not isinstance(base, numbers.Real) or not np.isfinite(base) or base <= 0:
        kind = TypeError if isinstance(base, bool) or not isinstance(base, numbers.Real) else ValueError
        raise kind(f"base: expected a finite number > 0, got {base!r}")
    interleaved = check_bool(interleaved, "interleaved")
    params = check_scaling(scaling)
    if rotary_dim is None and "partial_rotary_factor" not in params and x.shape[-1] % 2:
        raise ValueError(f"x: expected an even feature size D (pairs of features rotate), got shape {x.shape}")
    base = resolve_base(base, params)
    rotary_dim = resolve_rotary_dim(x.shape[-1], rotary_dim, params)
    return rope_kernel(x, positions, base=base, interleaved=interleaved, scaling=params, rotary_dim=rotary_dim)


def _angles(positions, length, inv_freq):
    """``theta[..., l, i] = positions[..., l] * inv_freq[i]`` in float64, shape ``(..., L, R/2)``."""
    if positions is None:
        positions = np.arange(length)
    return positions.astype(np.float64)[..., None] * inv_freq


def _pairs(x, interleaved):
    """The two members ``(a, b)`` of every pair, each ``(..., L, R/2)`` (views)."""
    if interleaved:
        return x[..., 0::2], x[..., 1::2]
    h = x.shape[-1] // 2
    return x[..., :h], x[..., h:]


def _rotate(x, cos, sin, interleaved):
    """``(a, b) -> (a cos - b sin, b cos + a sin)`` for every pair of the first ``R = 2 *
    cos.shape[-1]`` features; the others are copied (partial rotary)."""
    return _turn(x, *_widened(cos, sin, interleaved), interleaved)


def _widened(cos, sin, interleaved):
    """``(c, s)`` over all ``R`` rotated features: ``c`` each pair's cos at both members, ``s`` its
    ``-sin`` at the first (``a``) and ``sin`` at the second (``b``)."""
    r = 2 * cos.shape[-1]
    c, s = np.empty(cos.shape[:-1] + (r,), cos.dtype), np.empty(sin.shape[:-1] + (r,), sin.dtype)
    ca, cb = _pairs(c, interleaved)
    sa, sb = _pairs(s, interleaved)
    ca[...], cb[...] = cos, cos
    np.negative(sin, out=sa)
    sb[...] = sin
    return c, s


def _turn(x, c, s, interleaved):
    """``_rotate`` with the widened tables (``_widened``): ``x c + swap(x) s`` over the first ``R``
    features at once, ``swap`` exchanging the members of each pair.  The same roundings as the
    pairwise form (``a cos + b (-sin)`` is ``a cos - b sin``, negation being exact): two half-row
    copies and three passes over whole rows, in place of six passes over half rows (whose short
    strided rows made the rotation the slower)."""
    r = c.shape[-1]
    xr = x[..., :r]
    y = np.empty_like(x)  # positions broadcast to x's shape without D: cos/sin never widen x
    swapped = np.empty(xr.shape, x.dtype)
    a, b = _pairs(xr, interleaved)
    wa, wb = _pairs(swapped, interleaved)
    wa[...], wb[...] = b, a
    swapped *= s
    np.multiply(xr, c, out=y[..., :r])
    y[..., :r] += swapped
    if r < x.shape[-1]:
        y[..., r:] = x[..., r:]
    return y


def _cos_sin(positions, length: int, r: int, base, params: dict, dtype):
    """cos and sin of the angles of ``positions`` (None: ``0..length-1``) for the ``r / 2`` pairs,
    times the attention factor (YaRN, LongRoPE), in ``dtype``: shape ``positions.shape + (r / 2,)``."""
    seq_len = None
    if params["rope_type"] in ("dynamic", "longrope"):  # they depend on the length seen (HF: max position + 1)
        seq_len = length if positions is None else (int(positions.max()) + 1 if positions.size else None)
    inv_freq, factor = inverse_frequencies(r, base, params, seq_len)
    theta = _angles(positions, length, inv_freq)
    cos, sin = np.cos(theta), np.sin(theta)
    if factor != 1.0:  # YaRN: cos and sin times a constant
        cos, sin = cos * factor, sin * factor
    return cos.astype(dtype), sin.astype(dtype)


def rope_kernel(x, positions=None, *, base=10000.0, interleaved=False, scaling=None, rotary_dim=None):
    """The kernel of ``rope``: ``scaling`` None or checked by ``check_scaling``, ``base`` resolved
    with it, ``rotary_dim`` None (all of D) or checked."""
    params = {"rope_type": "default"} if scaling is None else scaling
    r = x.shape[-1] if rotary_dim is None else rotary_dim
    cos, sin = _cos_sin(positions, x.shape[-2], r, base, params, x.dtype)
    return _rotate(x, cos, sin, interleaved), RopeCache(cos, sin, interleaved, x.shape, x.dtype)


def rope_run_kernel(x, start: int, *, base=10000.0, interleaved=False, scaling=None, rotary_dim=None):
    """``rope_kernel(x, arange(start, start + L)[:, None], ...)[0]`` for ``x (..., L, H, D)``, the
    heads of ``L`` tokens at consecutive positions from ``start`` (token-major, each token's heads
    turned alike): the output alone, with the widened angle tables of the last few runs
    remembered (``_run_table``, read-only), so that the layers of a decoding step, which rotate at
    the same position, make its tables once instead of once a layer."""
    r = x.shape[-1] if rotary_dim is None else rotary_dim
    tables = rope_run_tables(start, x.shape[-3], r, x.dtype, base=base, interleaved=interleaved, scaling=scaling)
    return rope_turn(x, tables, interleaved)


def rope_run_tables(start: int, length: int, r: int, dtype, *, base=10000.0, interleaved=False, scaling=None):
    """``rope_run_kernel``'s widened angle tables ``(c, s)``, each ``(length, r)``, of a run of
    ``length`` tokens at positions ``start..start+length-1`` rotating ``r`` features (the
    frequencies of ``dynamic`` and ``longrope`` from the whole run's length); the last few short
    runs' are remembered and read-only (``_run_table``)."""
    params = {"rope_type": "default"} if scaling is None else scaling
    key = _frozen(params)
    if key is None or length * r > _RUN_TABLE_MAX:  # unhashable options, or too long to keep
        return _run_tables(start, length, r, base, params, np.dtype(dtype), interleaved)
    return _run_table(start, length, r, base, key, np.dtype(dtype).char, interleaved)


def rope_turn(x, tables, interleaved=False, offset: int = 0):
    """``x (..., L, H, D)``, tokens ``offset..offset+L-1`` of the run whose ``rope_run_tables`` are
    ``tables``, rotated (a new array): the run's rotation a block of its tokens at a time."""
    c, s = tables
    rows = slice(offset, offset + x.shape[-3])
    return _turn(x, c[rows, None, :], s[rows, None, :], interleaved)


_RUN_TABLE_MAX = 1 << 16  # length * rotated features of a remembered table (512 tokens of 128: 256 KiB in float32)


def _frozen(params: dict):
    """``params`` as a hashable key (lists as tuples), or None when a value is not hashable."""
    items = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in params.items()))
    try:
        hash(items)
    except TypeError:
        return None
    return items


def _run_tables(start: int, length: int, r: int, base, params: dict, dtype, interleaved: bool):
    """The widened tables (``_widened``) of the positions ``start..start+length-1``."""
    cos, sin = _cos_sin(np.arange(start, start + length), length, r, base, params, dtype)
    return _widened(cos, sin, interleaved)


@functools.lru_cache(maxsize=8)
def _run_table(start: int, length: int, r: int, base, key: tuple, dtype: str, interleaved: bool):
    """``_run_tables`` remembered, read-only (shared by every caller)."""
    tables = _run_tables(start, length, r, base, dict(key), np.dtype(dtype), interleaved)
    for t in tables:
        t.flags.writeable = False
    return tables


def rope_again_kernel(x, cache: RopeCache):
    """``rope_kernel`` of ``x`` at the angles of an earlier call (``cache``: the same positions,
    frequencies and length, e.g. the queries' when the keys sit at the same positions): its cached
    ``cos``/``sin``, not computed again.  Returns ``(y, cache)`` as ``rope_kernel``."""
    return _rotate(x, cache.cos, cache.sin, cache.interleaved), cache._replace(shape=x.shape, dtype=x.dtype)


def rope_backward(dout: np.ndarray, cache: RopeCache) -> np.ndarray:
    """Each pair is multiplied by the rotation ``R(theta) = [[cos, -sin], [sin, cos]]``, a linear map,
    so ``d(a, b) = R(theta)^T d(ya, yb) = R(-theta) d(ya, yb)``: the gradient is rotated back,

        da = dya cos + dyb sin,   db = dyb cos - dya sin,

    i.e. the forward with ``sin`` negated.  Why a plain rotation back, whatever the scaling: the
    angles ``theta = p * inv_freq`` depend on the positions and the configuration only, never on
    ``x`` (``dynamic`` reads the sequence *length*, not the values), so there is no term through
    ``theta``; YaRN's attention factor ``a`` multiplies cos and sin, a constant, so the cached
    (scaled) cos/sin give ``a R(-theta)``; features past ``rotary_dim`` are the identity and their
    gradient passes through unchanged.  Returns ``dx``.

    Parameters
    ----------
    dout : ndarray
        The gradient of ``y``.
    cache : RopeCache
        The cache ``rope`` returned.

    Returns
    -------
    ndarray
        ``dx``.
    """
    check_cache(cache, RopeCache, "rope_backward")
    return rope_backward_kernel(check_grad(dout, cache.shape, cache.dtype), cache)


def rope_backward_kernel(dout, cache):
    return _rotate(dout, cache.cos, -cache.sin, cache.interleaved)


@shared_doc(jvp_sections=jvp_sections("rope", "RopeCache"), fd_check=FD_CHECK)
def rope_jvp(cache: RopeCache, *tangents) -> np.ndarray:
    """Forward mode of ``rope``: each pair is multiplied by a fixed rotation (the angles depend on
    the positions only), a linear map, so the tangent is the forward applied to ``tx``:
    ``(ta, tb) -> (ta cos - tb sin, tb cos + ta sin)``, from the cached ``cos``/``sin`` (whatever
    the frequencies, scaled or not).

    <jvp_sections>

    <examples>
    >>> rng = np.random.default_rng(0)
    >>> x, tx = rng.standard_normal((2, 4, 6)), rng.standard_normal((2, 4, 6))
    >>> out, cache = F.rope(x)
    >>> tout = F.rope_jvp(cache, tx)
    >>> f = lambda s: F.rope(x + s * tx)[0]
    <fd_check>
    """
    check_cache(cache, RopeCache, "rope_jvp")
    return rope_jvp_kernel(cache, *check_tangents_as(tangents, "rope_jvp", cache.dtype, (("tx", cache.shape),)))


def rope_jvp_kernel(cache, tx=None):
    """The kernel of ``rope_jvp`` (``tx`` checked, None = zero)."""
    if tx is None:
        return np.zeros(cache.shape, cache.dtype)
    return _rotate(tx, cache.cos, cache.sin, cache.interleaved)


@shared_doc(
    backward_jvp_sections=backward_jvp_sections(
        "rope",
        "RopeCache",
        tangents="``(tx,)`` as ``rope_jvp`` takes it; None or ``()``: zero.",
        grad_tangents="``tdx``, of ``x``'s shape.",
    )
)
def rope_backward_jvp(dout: np.ndarray, cache: RopeCache, tangents, ddout=None):
    """Second order of ``rope``: the backward rotates ``dout`` back by angles that depend on the
    positions and the configuration only (every scaling, YaRN's factor and partial rotary
    included, see ``rope_backward``), never on ``x``.  So it is linear in ``dout`` and constant in
    ``x``: ``tdx = rope_backward(ddout)``, whatever ``tx`` is.

    <backward_jvp_sections>
    """
    check_cache(cache, RopeCache, "rope_backward_jvp")
    dout, tangents, ddout = check_backward_jvp(
        dout, tangents, ddout, "rope_backward_jvp", cache.shape, cache.dtype, (("tx", cache.shape),)
    )
    return rope_backward_jvp_kernel(dout, cache, tangents, ddout)


def rope_backward_jvp_kernel(dout, cache, tangents=(None,), ddout=None):
    """The kernel of ``rope_backward_jvp``: ``tx`` does not enter."""
    grads = rope_backward_kernel(dout, cache)
    return grads, (np.zeros_like(grads) if ddout is None else rope_backward_kernel(ddout, cache))

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

import numbers
from typing import NamedTuple

import numpy as np

from .._validate import (
    as_float,
    as_index,
    check_bool,
    check_cache,
    check_grad,
    check_ndim,
    check_tangent,
    check_tangents,
)


class RopeCache(NamedTuple):
    cos: np.ndarray  # (..., L, D/2) broadcastable against x's pairs, x's dtype
    sin: np.ndarray
    interleaved: bool
    shape: tuple
    dtype: np.dtype


def rope(
    x: np.ndarray, positions=None, *, base: float = 10000.0, interleaved: bool = False
) -> tuple[np.ndarray, RopeCache]:
    """Rotary position embedding of ``x (..., L, D)``, ``D`` even.

    ``positions``: integers broadcastable to ``(..., L)`` (x's shape without the feature axis);
    default ``arange(L)``.  Pass ``arange(L) + t`` for new tokens after ``t`` cached ones (a KV
    cache), or a ``(batch, 1, L)`` array for per-sequence positions of ``(batch, heads, L, D)``.
    ``base``: a finite float > 0.  Pairs are ``(i, i + D/2)`` (rotate half), or ``(2i, 2i+1)``
    with ``interleaved=True``; pair ``i`` at position ``p`` rotates by ``p * base**(-2i/D)``.
    The angles are computed in float64 and their cos/sin then cast to x's dtype (float32 stays
    float32).  Returns ``(y, cache)``.
    """
    x = as_float(x, "x")
    check_ndim(x, "x", 2, "(..., L, D)")
    if x.shape[-1] % 2:
        raise ValueError(f"x: expected an even feature size D (pairs of features rotate), got shape {x.shape}")
    if positions is not None:
        positions = as_index(positions, "positions")
        try:
            ok = np.broadcast_shapes(positions.shape, x.shape[:-1]) == x.shape[:-1]
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(
                f"positions: expected a shape broadcastable to {x.shape[:-1]} (x's shape without D), "
                f"got {positions.shape}"
            )
    if isinstance(base, bool) or not isinstance(base, numbers.Real) or not np.isfinite(base) or base <= 0:
        kind = TypeError if isinstance(base, bool) or not isinstance(base, numbers.Real) else ValueError
        raise kind(f"base: expected a finite number > 0, got {base!r}")
    interleaved = check_bool(interleaved, "interleaved")
    return _rope(x, positions, base=float(base), interleaved=interleaved)


def _angles(positions, length, d, base):
    """``theta[..., l, i] = positions[..., l] * base**(-2i/D)`` in float64, shape ``(..., L, D/2)``."""
    if positions is None:
        positions = np.arange(length)
    inv_freq = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)  # (D/2,)
    return positions.astype(np.float64)[..., None] * inv_freq


def _pairs(x, interleaved):
    """The two members ``(a, b)`` of every pair, each ``(..., L, D/2)`` (views)."""
    if interleaved:
        return x[..., 0::2], x[..., 1::2]
    h = x.shape[-1] // 2
    return x[..., :h], x[..., h:]


def _rotate(x, cos, sin, interleaved):
    """``(a, b) -> (a cos - b sin, b cos + a sin)`` for every pair."""
    a, b = _pairs(x, interleaved)
    y = np.empty_like(x)  # positions broadcast to x's shape without D: cos/sin never widen x
    ya, yb = _pairs(y, interleaved)
    np.subtract(a * cos, b * sin, out=ya)
    np.add(b * cos, a * sin, out=yb)
    return y


def _rope(x, positions=None, *, base=10000.0, interleaved=False):
    theta = _angles(positions, x.shape[-2], x.shape[-1], base)
    cos, sin = np.cos(theta).astype(x.dtype), np.sin(theta).astype(x.dtype)
    return _rotate(x, cos, sin, interleaved), RopeCache(cos, sin, interleaved, x.shape, x.dtype)


def rope_backward(dout: np.ndarray, cache: RopeCache) -> np.ndarray:
    """Each pair is multiplied by the rotation ``R(theta) = [[cos, -sin], [sin, cos]]``, a linear map,
    so ``d(a, b) = R(theta)^T d(ya, yb) = R(-theta) d(ya, yb)``: the gradient is rotated back,

        da = dya cos + dyb sin,   db = dyb cos - dya sin,

    i.e. the forward with ``sin`` negated.  Returns ``dx``.
    """
    check_cache(cache, RopeCache, "rope_backward")
    return _rope_backward(check_grad(dout, cache.shape, cache.dtype), cache)


def _rope_backward(dout, cache):
    return _rotate(dout, cache.cos, -cache.sin, cache.interleaved)


def rope_jvp(cache: RopeCache, *tangents) -> np.ndarray:
    """Forward mode of ``rope``: each pair is multiplied by a fixed rotation (the angles depend on
    the positions only), a linear map, so the tangent is the forward applied to ``tx``:
    ``(ta, tb) -> (ta cos - tb sin, tb cos + ta sin)``, from the cached ``cos``/``sin`` (whatever
    the frequencies, scaled or not).

    Parameters
    ----------
    cache : RopeCache
        The cache ``rope`` returned.
    *tangents : ndarray or None
        ``tx``, of ``x``'s shape (None: zero).

    Returns
    -------
    ndarray
        ``ty``, of ``y``'s shape and dtype.

    Raises
    ------
    TypeError
        A cache from another op, more than one tangent, or a tangent that is not a real array.
    ValueError
        A tangent of the wrong shape.
    """
    check_cache(cache, RopeCache, "rope_jvp")
    (tx,) = check_tangents(tangents, ("tx",), "rope_jvp")
    return _rope_jvp(cache, check_tangent(tx, "tx", cache.shape, cache.dtype))


def _rope_jvp(cache, tx=None):
    """The kernel of ``rope_jvp`` (``tx`` checked, None = zero)."""
    if tx is None:
        return np.zeros(cache.shape, cache.dtype)
    return _rotate(tx, cache.cos, cache.sin, cache.interleaved)

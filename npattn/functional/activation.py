"""Element-wise and row-wise nonlinearities: ``relu``, ``gelu``, ``softmax``, ``dropout``."""
from __future__ import annotations

import math

import numpy as np

from .._validate import as_float, as_rng, check_axis, check_bool, check_grad, check_prob
from ._erf import erf

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
# |x| beyond which GELU's correction terms are exactly 0 in float32 and float64 (tanh(u) = +-1,
# exp(-x^2/2) = 0); clipping there keeps x^3 and x^2 from overflowing without changing a bit.
_GELU_CLIP = 1e4


def relu(x):
    """``y = max(x, 0)``.  Returns ``(y, cache)``; the cache is the mask ``x > 0``."""
    x = as_float(x, "x")
    return np.maximum(x, 0), (x > 0, x.dtype)


def relu_backward(dout, cache):
    """``dx = dy * [x > 0]`` (0 at x == 0, as torch)."""
    positive, dtype = cache
    dy = check_grad(dout, positive.shape, dtype)
    return dy * positive


def gelu(x, approximate="none"):
    """GELU.  ``"none"``: ``y = x Phi(x)`` with ``Phi(x) = (1 + erf(x / sqrt 2)) / 2``.
    ``"tanh"``: ``y = x/2 (1 + tanh(u))``, ``u = sqrt(2/pi) (x + 0.044715 x^3)`` (as torch)."""
    x = as_float(x, "x")
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate: expected 'none' or 'tanh', got {approximate!r}")
    if approximate == "none":
        cdf = 0.5 * (1.0 + erf(x * _INV_SQRT_2))
        return x * cdf, (x, cdf, approximate)
    xc = np.clip(x, -_GELU_CLIP, _GELU_CLIP)  # x**3 would overflow (RuntimeWarning) for huge |x|
    t = np.tanh(_SQRT_2_OVER_PI * (xc + 0.044715 * xc**3))
    return 0.5 * x * (1.0 + t), (x, t, approximate)


def gelu_backward(dout, cache):
    """``"none"``: ``dy/dx = Phi(x) + x phi(x)``, ``phi(x) = exp(-x^2/2) / sqrt(2 pi)``.
    ``"tanh"``: ``dy/dx = (1 + t)/2 + x/2 (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)``, ``t = tanh(u)``."""
    x, aux, approximate = cache
    dy = check_grad(dout, x.shape, x.dtype)
    xc = np.clip(x, -_GELU_CLIP, _GELU_CLIP)  # identical below the clip; no inf * 0 above it
    if approximate == "none":
        return dy * (aux + xc * (_INV_SQRT_2PI * np.exp(-0.5 * xc * xc)))
    t = aux
    du = _SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * xc * xc)
    return dy * (0.5 * (1.0 + t) + 0.5 * xc * (1.0 - t * t) * du)


def softmax(x, axis=-1):
    """``y = exp(x - max) / sum(exp(x - max))`` along ``axis``: stable for any finite input.

    A slice that is entirely ``-inf`` (every position masked) gives zeros, not NaN.
    Returns ``(y, cache)``; the cache is ``(y, axis)``.
    """
    x = as_float(x, "x")
    if x.ndim == 0:
        raise ValueError("x: expected at least 1 dimension, got a 0-d array")
    axis = check_axis(axis, x.ndim)
    m = x.max(axis=axis, keepdims=True, initial=-np.inf)  # empty axis allowed
    m[~np.isfinite(m)] = 0.0  # all -inf slice: exp(-inf) = 0 below
    y = np.exp(x - m)
    s = y.sum(axis=axis, keepdims=True)
    s[s == 0] = 1.0
    y /= s
    return y, (y, axis)


def softmax_backward(dout, cache):
    """Jacobian ``dy_i/dx_j = y_i (delta_ij - y_j)``, so ``dx = y * (dy - sum(dy * y))``."""
    y, axis = cache
    dy = check_grad(dout, y.shape, y.dtype)
    return y * (dy - (dy * y).sum(axis=axis, keepdims=True))


def dropout(x, p, rng=None, training=True):
    """Inverted dropout: keep each entry with probability ``1 - p`` and scale it by ``1/(1 - p)``.

    The keep-mask is ``rng.random(x.shape) >= p`` (float64 draws whatever the dtype, so a seed
    gives the same mask in float32 and float64).  ``p = 1`` gives zeros; ``training=False`` or
    ``p = 0`` is the identity (no random numbers drawn).  ``rng``: Generator, int seed or None.
    Returns ``(y, cache)``; the cache is ``(keep_mask or None, scale, shape, dtype)``.
    """
    x = as_float(x, "x")
    p = check_prob(p, "p")
    training = check_bool(training, "training")
    if not training or p == 0.0:
        as_rng(rng)  # still validate the argument
        return x.copy(), (None, 1.0, x.shape, x.dtype)
    rng = as_rng(rng)
    if p == 1.0:
        return np.zeros_like(x), (np.zeros(x.shape, dtype=bool), 0.0, x.shape, x.dtype)
    keep = rng.random(x.shape) >= p
    scale = 1.0 / (1.0 - p)
    return x * keep * scale, (keep, scale, x.shape, x.dtype)


def dropout_backward(dout, cache):
    """The forward is ``y = x * keep * s``, linear in x: ``dx = dy * keep * s`` (same mask)."""
    keep, scale, shape, dtype = cache
    dy = check_grad(dout, shape, dtype)
    if keep is None:
        return dy.copy()
    return dy * keep * scale

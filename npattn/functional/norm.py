"""Layer normalisation over the last axis."""
from __future__ import annotations

import numpy as np

from .._validate import as_float, check_grad, check_ndim, check_positive_float


def layer_norm(x, weight=None, bias=None, eps=1e-5):
    """``y = (x - mean) / sqrt(var + eps) * weight + bias`` over the last axis (biased variance).

    A row of zero variance (a constant row) gives ``y = bias`` and finite gradients; with ``eps=0``
    such a row would be ``0 / 0``: it is normalised to 0 instead of NaN (``y = bias``, ``dx = 0``).
    Returns ``(y, cache)``; the cache is ``(xhat, rstd, weight, has_bias)``.
    """
    x = as_float(x, "x")
    check_ndim(x, "x", 1, "(..., features)")
    eps = check_positive_float(eps, "eps", allow_zero=True)
    d = x.shape[-1]
    if d < 1:
        raise ValueError(f"x: expected at least 1 feature in the last dimension, got shape {x.shape}")
    if weight is not None:
        weight = as_float(weight, "weight", x.dtype)
        if weight.shape != (d,):
            raise ValueError(f"weight: expected shape ({d},) (x's last dimension), got {weight.shape}")
    if bias is not None:
        bias = as_float(bias, "bias", x.dtype)
        if bias.shape != (d,):
            raise ValueError(f"bias: expected shape ({d},) (x's last dimension), got {bias.shape}")
    mu = x.mean(axis=-1, keepdims=True)
    xc = x - mu
    var = np.mean(xc * xc, axis=-1, keepdims=True)
    std = np.sqrt(var + eps)
    if eps == 0.0:
        std[std == 0] = np.inf  # zero variance, no eps: rstd = 0, so xhat = 0 (not 0/0)
    rstd = 1.0 / std
    xhat = xc * rstd
    y = xhat * weight if weight is not None else xhat.copy()
    if bias is not None:
        y += bias
    return y, (xhat, rstd, weight, bias is not None)


def layer_norm_backward(dout, cache):
    """With ``xhat = (x - mu) * rstd`` and ``g = dy * weight`` (the gradient at xhat):

    ``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))`` (means over the last axis: the two
    terms are the gradients through ``mu`` and through ``var``), ``dweight = sum(dy * xhat)``,
    ``dbias = sum(dy)`` over all leading axes.  Returns ``(dx, dweight, dbias)``.
    """
    xhat, rstd, weight, has_bias = cache
    dy = check_grad(dout, xhat.shape, xhat.dtype)
    lead = tuple(range(dy.ndim - 1))
    dweight = (dy * xhat).sum(axis=lead) if weight is not None else None
    dbias = dy.sum(axis=lead) if has_bias else None
    g = dy * weight if weight is not None else dy
    dx = rstd * (g - g.mean(axis=-1, keepdims=True) - xhat * (g * xhat).mean(axis=-1, keepdims=True))
    return dx, dweight, dbias

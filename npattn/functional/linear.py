"""Affine maps and lookups: ``linear`` and ``embedding``."""
from __future__ import annotations

import math

import numpy as np

from .._validate import as_float, as_index, check_grad, check_ndim


def linear(x, weight, bias=None):
    """``y = x @ weight.T + bias`` with ``x (..., in)``, ``weight (out, in)``, ``bias (out,)``.

    Returns ``(y, cache)``; the cache holds ``(x, weight, has_bias)``.
    """
    x = as_float(x, "x")
    weight = as_float(weight, "weight", x.dtype)
    check_ndim(x, "x", 1, "(..., in_features)")
    if weight.ndim != 2:
        raise ValueError(f"weight: expected shape (out_features, in_features), got {weight.shape}")
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"weight: expected in_features {x.shape[-1]} (x's last dimension), "
            f"got weight of shape {weight.shape}"
        )
    if bias is not None:
        bias = as_float(bias, "bias", x.dtype)
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias: expected shape ({weight.shape[0]},), got {bias.shape}")
    y = x @ weight.T
    if bias is not None:
        y += bias
    return y, (x, weight, bias is not None)


def linear_backward(dout, cache):
    """With ``y = x W^T + b``:  ``dx = dy W``, ``dW = dy^T x`` (summed over all leading dims),
    ``db = sum(dy)`` over the leading dims.  Returns ``(dx, dweight, dbias)``."""
    x, weight, has_bias = cache
    dy = check_grad(dout, x.shape[:-1] + (weight.shape[0],), x.dtype)
    dx = dy @ weight
    n = math.prod(x.shape[:-1])  # not reshape(-1, ...): that fails when a feature size is 0
    dy2 = dy.reshape(n, dy.shape[-1])
    dweight = dy2.T @ x.reshape(n, x.shape[-1])
    dbias = dy2.sum(axis=0) if has_bias else None
    return dx, dweight, dbias


def embedding(ids, weight):
    """Row lookup ``out[...] = weight[ids[...]]``; ``ids`` integer of any shape, ``weight (num, dim)``.

    Returns ``(out (*ids.shape, dim), cache)``; ids outside ``[0, num)`` raise ``ValueError``.
    """
    ids = as_index(ids, "ids")
    weight = as_float(weight, "weight")
    if weight.ndim != 2:
        raise ValueError(f"weight: expected shape (num_embeddings, embedding_dim), got {weight.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= weight.shape[0]):
        bad = ids.min() if ids.min() < 0 else ids.max()
        raise ValueError(f"ids: expected values in [0, {weight.shape[0]}), got {bad}")
    return weight[ids], (ids, weight.shape, weight.dtype)


def embedding_backward(dout, cache):
    """A lookup copies rows, so its gradient scatter-adds: ``dW[i] = sum of dy where ids == i``.
    Returns ``dweight`` (ids have no gradient)."""
    ids, wshape, dtype = cache
    dy = check_grad(dout, ids.shape + (wshape[1],), dtype)
    dweight = np.zeros(wshape, dtype=dtype)
    np.add.at(dweight, ids.reshape(-1), dy.reshape(-1, wshape[1]))
    return dweight

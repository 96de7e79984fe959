"""Losses: ``cross_entropy``."""
from __future__ import annotations

import numbers

import numpy as np

from .._validate import as_float, as_index, check_grad, check_ndim


def cross_entropy(logits, targets, ignore_index=None):
    """Mean negative log-likelihood of ``targets`` under ``softmax(logits)``.

    ``logits (..., C)``, integer ``targets (...)``.  Targets equal to ``ignore_index`` are not
    counted; the mean is over the counted ones (0 with no counted target, never NaN).
    ``log softmax`` is computed stably as ``z - log(sum(exp(z)))`` with ``z = x - max(x)``.
    Returns ``(loss as a 0-d array, cache)``.
    """
    logits = as_float(logits, "logits")
    check_ndim(logits, "logits", 1, "(..., classes)")
    targets = as_index(targets, "targets")
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"targets: expected shape {logits.shape[:-1]} (logits without the class axis), got {targets.shape}")
    if ignore_index is not None and (isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral)):
        raise TypeError(f"ignore_index: expected an int or None, got {ignore_index!r}")
    counted = np.ones(targets.shape, dtype=bool) if ignore_index is None else targets != ignore_index
    c = logits.shape[-1]
    t = targets[counted]
    if t.size and (t.min() < 0 or t.max() >= c):
        bad = t.min() if t.min() < 0 else t.max()
        raise ValueError(f"targets: expected class indices in [0, {c}), got {bad}")
    z = logits - logits.max(axis=-1, keepdims=True)
    logsumexp = np.log(np.exp(z).sum(axis=-1, keepdims=True))
    logp = z - logsumexp
    safe_t = np.where(counted, targets, 0)
    picked = np.take_along_axis(logp, safe_t[..., None], axis=-1)[..., 0]
    n = int(counted.sum())
    loss = -(picked * counted).sum() / max(n, 1)
    return np.asarray(loss, dtype=logits.dtype), (logp, safe_t, counted, n)


def cross_entropy_backward(dout, cache):
    """``dlogits = (softmax(logits) - onehot(targets)) * counted / n * dloss``.  Returns ``dlogits``."""
    logp, safe_t, counted, n = cache
    g = check_grad(dout, (), logp.dtype)
    dx = np.exp(logp)
    np.put_along_axis(dx, safe_t[..., None], np.take_along_axis(dx, safe_t[..., None], axis=-1) - 1.0, axis=-1)
    dx *= (counted / max(n, 1))[..., None].astype(logp.dtype)
    dx *= g
    return dx

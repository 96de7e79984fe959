"""Scaled dot-product attention, forward and backward, with masks, dropout and grouped-query heads."""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple, Optional

import numpy as np

from .._validate import as_float, as_rng, check_bool, check_grad, check_mask, check_prob


class AttentionCache(NamedTuple):
    """What ``scaled_dot_product_attention_backward`` needs.

    ``weights`` are the softmax probabilities before dropout, ``(..., Hq, Lq, Lk)``; ``keep`` is
    dropout's keep-mask (None without dropout) and ``drop_scale`` its ``1/(1-p)``.
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    weights: np.ndarray
    keep: Optional[np.ndarray]
    drop_scale: float
    scale: float
    groups: int


def _check_qkv(q, k, v, enable_gqa):
    """Validate and cast q, k, v; return them with the number of query heads per kv head."""
    q = as_float(q, "q")
    k = as_float(k, "k", q.dtype)
    v = as_float(v, "v", q.dtype)
    if q.ndim < 2:
        raise ValueError(f"q: expected shape (..., L, E) with at least 2 dimensions, got {q.shape}")
    for name, a in (("k", k), ("v", v)):
        if a.ndim != q.ndim:
            raise ValueError(f"{name}: expected {q.ndim} dimensions like q {q.shape}, got shape {a.shape}")
    if q.shape[-1] < 1:
        raise ValueError(f"q: expected an embedding dimension >= 1, got shape {q.shape}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k: expected last dimension {q.shape[-1]} (q's E), got shape {k.shape}")
    if v.shape[:-1] != k.shape[:-1]:
        raise ValueError(f"v: expected shape {k.shape[:-1]} + (Ev,) to match k {k.shape}, got {v.shape}")
    groups = 1
    if enable_gqa and q.ndim >= 3 and q.shape[-3] != k.shape[-3]:
        hq, hk = q.shape[-3], k.shape[-3]
        if hk == 0 or hq % hk:
            raise ValueError(
                f"k: with enable_gqa the number of query heads ({hq}) must be a multiple of the "
                f"number of key/value heads, got {hk} (q {q.shape}, k {k.shape})"
            )
        groups = hq // hk
        if q.shape[:-3] != k.shape[:-3]:
            raise ValueError(f"k: expected batch dimensions {q.shape[:-3]} like q {q.shape}, got shape {k.shape}")
    elif k.shape[:-2] != q.shape[:-2]:
        hint = " (pass enable_gqa=True for grouped-query attention)" if q.ndim >= 3 and q.shape[:-3] == k.shape[:-3] else ""
        raise ValueError(f"k: expected leading dimensions {q.shape[:-2]} like q {q.shape}, got shape {k.shape}{hint}")
    return q, k, v, groups


def _grouped(x, groups):
    """``(..., Hk*G, L, D) -> (..., Hk, G*L, D)``: query head ``h`` sits with kv head ``h // G``."""
    if groups == 1:
        return x
    s = x.shape
    return x.reshape(s[:-3] + (s[-3] // groups, groups * s[-2], s[-1]))


def _ungrouped(x, groups, full_shape):
    return x if groups == 1 else x.reshape(full_shape)


def scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=False, dropout_p=0.0,
                                 scale=None, rng=None, enable_gqa=False):
    """``out = dropout(softmax(q k^T * scale + mask)) v``, as ``torch.nn.functional.scaled_dot_product_attention``.

    Shapes: ``q (..., Hq, Lq, E)``, ``k (..., Hk, Lk, E)``, ``v (..., Hk, Lk, Ev)`` -> ``(..., Hq, Lq, Ev)``
    (inputs without a head axis, ``(batch, L, E)``, work too).  ``scale`` defaults to ``1/sqrt(E)``.

    * ``attn_mask``: bool (True = may attend) or float (added to the scaled scores), broadcastable
      to ``(..., Hq, Lq, Lk)``.  ``is_causal``: query ``i`` sees keys ``0..i`` (top-left aligned,
      also when ``Lq != Lk``); unlike torch, it may be combined with ``attn_mask`` (both apply).
    * A query row that may attend to no key gives output 0 (and gradient 0), never NaN.
    * ``dropout_p`` acts on the attention weights with a mask drawn from ``rng``.
    * ``enable_gqa``: ``Hq`` a multiple of ``Hk``; query head ``h`` uses kv head ``h // (Hq // Hk)``.
      Computed without copying k/v: query heads are grouped beside their kv head in one GEMM.

    Returns ``(out, AttentionCache)``.
    """
    q, k, v, groups = _check_qkv(q, k, v, check_bool(enable_gqa, "enable_gqa"))
    is_causal = check_bool(is_causal, "is_causal")
    dropout_p = check_prob(dropout_p, "dropout_p")
    lq, lk = q.shape[-2], k.shape[-2]
    score_shape = q.shape[:-1] + (lk,)
    if attn_mask is not None:
        attn_mask = check_mask(attn_mask, "attn_mask", score_shape)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise TypeError(f"scale: expected a finite real number or None, got {scale!r}")
    scale = float(scale)
    rng = as_rng(rng) if dropout_p > 0.0 else None

    # scores s = (q * scale) k^T, in the grouped layout (one GEMM per kv head), viewed as (..., Hq, Lq, Lk)
    s = _grouped(q * scale, groups) @ k.swapaxes(-1, -2)
    s = _ungrouped(s, groups, score_shape)
    if is_causal:
        s[..., ~np.tri(lq, lk, dtype=bool)] = -np.inf
    if attn_mask is not None:
        if attn_mask.dtype == bool:
            np.copyto(s, -np.inf, where=~attn_mask)
        else:
            s += attn_mask
    # softmax in place; rows with no visible key (max = -inf) end up all zero
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)  # Lk = 0: no key, output 0
    m[~np.isfinite(m)] = 0.0
    s -= m
    np.exp(s, out=s)
    total = s.sum(axis=-1, keepdims=True)
    total[total == 0] = 1.0
    s /= total
    weights = s

    keep, drop_scale = None, 1.0
    if dropout_p > 0.0:
        keep = rng.random(weights.shape) >= dropout_p
        drop_scale = 0.0 if dropout_p == 1.0 else 1.0 / (1.0 - dropout_p)
        used = weights * keep * drop_scale
    else:
        used = weights
    out = _grouped(used, groups) @ v
    out = _ungrouped(out, groups, q.shape[:-1] + (v.shape[-1],))
    return out, AttentionCache(q, k, v, weights, keep, drop_scale, scale, groups)


def scaled_dot_product_attention_backward(dout, cache):
    """Backward of ``out = P' v`` with ``P' = dropout(P)``, ``P = softmax(S)``, ``S = scale q k^T + mask``:

    * ``dv = P'^T dout`` and ``dP' = dout v^T``;
    * through dropout, ``dP = dP' * keep / (1 - p)``;
    * through the row softmax, ``dS = P * (dP - sum_j dP * P)`` (masked entries have P = 0, so 0);
    * ``dq = scale dS k`` and ``dk = scale dS^T q`` (the mask is a constant).

    With grouped-query heads the products run in the grouped layout, which sums each kv head's
    gradient over the query heads that share it.  Returns ``(dq, dk, dv)``.
    """
    q, k, v, w, keep, drop_scale, scale, groups = cache
    dout = check_grad(dout, q.shape[:-1] + (v.shape[-1],), q.dtype)
    dog = _grouped(dout, groups)
    used = w if keep is None else w * keep * drop_scale
    dv = _grouped(used, groups).swapaxes(-1, -2) @ dog
    dp = _ungrouped(dog @ v.swapaxes(-1, -2), groups, w.shape)
    if keep is not None:
        dp *= keep
        dp *= drop_scale
    dp -= (dp * w).sum(axis=-1, keepdims=True)
    dp *= w
    ds = _grouped(dp, groups)
    dq = _ungrouped(ds @ k, groups, q.shape)
    dq *= scale
    dk = ds.swapaxes(-1, -2) @ _grouped(q, groups)
    dk *= scale
    return dq, dk, dv

"""The attention options as one explicit dense formula (numpy and torch), an oracle for the tests.

Written from the contract's words, sharing no code with ``npattn.functional``: every ``(Lq, Lk)``
matrix is formed in full, k and v heads are repeated for GQA, positions are explicit.
"""

import numpy as np


def positions(lq, lk, align):
    """Query positions ``(Lq, 1)`` and key positions ``(1, Lk)``."""
    p = np.arange(lq)[:, None] + (lk - lq if align == "bottom_right" else 0)
    return p, np.arange(lk)[None, :]


def visible(lq, lk, causal=False, align="top_left", window=None):
    """``(Lq, Lk)`` bool: the keys each query may see by causality and the window."""
    p, j = positions(lq, lk, align)
    vis = np.ones((lq, lk), bool)
    if causal:
        vis &= j <= p
    if window is not None:
        left, right = window
        if left >= 0:
            vis &= j >= p - left
        if right >= 0:
            vis &= j <= p + right
    return vis


def alibi_bias(slopes, lead, lq, lk, align):
    """``-slope_h |p - j|`` of shape ``lead + (Lq, Lk)``."""
    p, j = positions(lq, lk, align)
    return -np.broadcast_to(slopes, lead)[..., None, None] * np.abs(p - j)


def repeat_kv(q, k, v, gqa):
    if gqa and q.ndim >= 3 and k.ndim >= 3 and q.shape[-3] != k.shape[-3]:
        g = q.shape[-3] // k.shape[-3]
        k, v = np.repeat(k, g, axis=-3), np.repeat(v, g, axis=-3)
    return k, v


def dense(
    q,
    k,
    v,
    attn_mask=None,
    is_causal=False,
    dropout_p=0.0,
    scale=None,
    keep=None,
    enable_gqa=False,
    causal_align="top_left",
    window=None,
    alibi_slopes=None,
    softcap=None,
    sinks=None,
):
    """``out`` of attention with every option, in numpy (``keep``: the dropout keep-mask)."""
    k, v = repeat_kv(q, k, v, enable_gqa)
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ np.swapaxes(k, -1, -2)) * scale
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    lq, lk = s.shape[-2:]
    vis = visible(lq, lk, is_causal, causal_align, window)
    if attn_mask is not None and attn_mask.dtype == bool:
        vis = vis & attn_mask
    elif attn_mask is not None:
        s = s + attn_mask
    if alibi_slopes is not None:
        s = s + alibi_bias(alibi_slopes, s.shape[:-2], lq, lk, causal_align)
    s = np.where(vis, s, -np.inf)
    s = np.broadcast_to(s, np.broadcast_shapes(s.shape, vis.shape))
    if sinks is not None:  # one more column: the sink's logit, value 0
        col = np.broadcast_to(sinks.reshape(-1, 1, 1) if s.ndim >= 3 else sinks.reshape(1, 1), s.shape[:-1] + (1,))
        s = np.concatenate([s, col], axis=-1)
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    tot = e.sum(axis=-1, keepdims=True)
    w = e / np.where(tot == 0, 1.0, tot)
    if sinks is not None:
        w = w[..., :-1]
    if keep is not None:
        w = w * keep / (1 - dropout_p)
    return w @ v


def dense_torch(
    torch,
    q,
    k,
    v,
    attn_mask=None,
    is_causal=False,
    dropout_p=0.0,
    scale=None,
    keep=None,
    enable_gqa=False,
    causal_align="top_left",
    window=None,
    alibi_slopes=None,
    softcap=None,
    sinks=None,
):
    """The same formula in torch (float64 tensors), for autograd."""
    if enable_gqa and q.ndim >= 3 and k.ndim >= 3 and q.shape[-3] != k.shape[-3]:
        g = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(g, dim=-3), v.repeat_interleave(g, dim=-3)
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    lq, lk = s.shape[-2:]
    vis = torch.from_numpy(visible(lq, lk, is_causal, causal_align, window))
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        vis = vis & attn_mask
    elif attn_mask is not None:
        s = s + attn_mask
    if alibi_slopes is not None:
        p, j = positions(lq, lk, causal_align)
        dist = torch.from_numpy(np.abs(p - j).astype(np.float64))
        s = s - alibi_slopes.broadcast_to(s.shape[:-2])[..., None, None] * dist
    s = s.masked_fill(~vis, float("-inf"))
    s = s.broadcast_to(torch.broadcast_shapes(s.shape, vis.shape))
    if sinks is not None:
        col = (sinks.reshape(-1, 1, 1) if s.ndim >= 3 else sinks.reshape(1, 1)).broadcast_to(s.shape[:-1] + (1,))
        s = torch.cat([s, col], dim=-1)
    m = s.amax(dim=-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    tot = e.sum(dim=-1, keepdim=True)
    w = e / torch.where(tot == 0, torch.ones_like(tot), tot)
    if sinks is not None:
        w = w[..., :-1]
    if keep is not None:
        w = w * torch.from_numpy(keep) / (1 - dropout_p)
    return w @ v

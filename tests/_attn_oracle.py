"""The attention formula written out densely in torch (autograd gives every gradient): an oracle
for ``memory_efficient_attention`` with every option.  Test support only."""

import numpy as np

from npattn.functional._random import keep_mask


def torch_attention(
    torch,
    q,
    k,
    v,
    *,
    attn_mask=None,
    is_causal=False,
    scale=None,
    dropout_p=0.0,
    seed=0,
    enable_gqa=False,
    causal_align="top_left",
    window=None,
    alibi_slopes=None,
    softcap=None,
    sinks=None,
    dout=None,
):
    """``(out, grads)`` with ``grads = (dq, dk, dv[, dmask][, dsinks])`` for upstream ``dout``
    (a float ``attn_mask`` always gets a gradient here; callers pick what they compare)."""
    t = {
        name: (torch.tensor(np.asarray(a, dtype=np.float64), requires_grad=True) if a is not None else None)
        for name, a in (("q", q), ("k", k), ("v", v), ("sinks", sinks))
    }
    qt, kt, vt = t["q"], t["k"], t["v"]
    mt = None
    if attn_mask is not None and attn_mask.dtype != bool:
        mt = torch.tensor(np.asarray(attn_mask, dtype=np.float64), requires_grad=True)

    def keep(shape):  # the memory-efficient core's mask, regenerated from the seed
        return torch.tensor(keep_mask(seed, dropout_p, shape))

    out = attention_formula(
        torch,
        qt,
        kt,
        vt,
        mt if mt is not None else attn_mask,
        t["sinks"],
        is_causal=is_causal,
        scale=scale,
        dropout_p=dropout_p,
        keep=keep,
        enable_gqa=enable_gqa,
        causal_align=causal_align,
        window=window,
        alibi_slopes=alibi_slopes,
        softcap=softcap,
    )
    grads = ()
    if dout is not None:
        leaves = [qt, kt, vt] + ([mt] if mt is not None else []) + ([t["sinks"]] if t["sinks"] is not None else [])
        g = torch.autograd.grad(out, leaves, torch.tensor(dout), allow_unused=True)
        grads = tuple(np.zeros(x.shape) if gi is None else gi.numpy() for x, gi in zip(leaves, g))
    return out.detach().numpy(), grads


def attention_formula(
    torch,
    qt,
    kt,
    vt,
    mask=None,
    sinks=None,
    *,
    is_causal=False,
    scale=None,
    dropout_p=0.0,
    keep=None,
    enable_gqa=False,
    causal_align="top_left",
    window=None,
    alibi_slopes=None,
    softcap=None,
):
    """``out`` of the attention formula with every option, written densely in torch: a pure
    function of the tensors ``qt, kt, vt``, a float ``mask`` tensor (or a bool numpy mask, or
    None) and ``sinks`` (or None), for autograd and ``torch.func.jvp``.  ``keep``: dropout's
    keep-mask, a bool tensor of the scores' shape or a function of that shape returning one."""
    q_shape, k_shape, v_shape = tuple(qt.shape), tuple(kt.shape), tuple(vt.shape)
    lq, lk, e = q_shape[-2], k_shape[-2], q_shape[-1]
    scale = 1.0 / np.sqrt(e) if scale is None else scale
    kk, vv = kt, vt
    if enable_gqa and qt.ndim >= 3 and kt.ndim >= 3 and q_shape[-3] != k_shape[-3]:
        hk = max(k_shape[-3], v_shape[-3])
        g = q_shape[-3] // hk
        kk, vv = (a.expand(*a.shape[:-3], hk, *a.shape[-2:]).repeat_interleave(g, dim=-3) for a in (kt, vt))
    s = scale * (qt @ kk.transpose(-1, -2))
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    off = lk - lq if causal_align == "bottom_right" else 0
    pos_q = torch.arange(lq, dtype=torch.float64)[:, None] + off
    pos_k = torch.arange(lk, dtype=torch.float64)[None, :]
    if alibi_slopes is not None:
        sl = torch.tensor(np.asarray(alibi_slopes, dtype=np.float64))
        s = s - sl[..., None, None] * (pos_q - pos_k).abs()
    visible = torch.ones(lq, lk, dtype=torch.bool)
    left = right = None
    if window is not None:
        left = None if window[0] < 0 else window[0]
        right = None if window[1] < 0 else window[1]
    if is_causal:
        right = 0 if right is None else min(right, 0)
    if right is not None:
        visible &= pos_k <= pos_q + right
    if left is not None:
        visible &= pos_k >= pos_q - left
    if isinstance(mask, np.ndarray) and mask.dtype == bool:
        visible = visible & torch.tensor(mask)
    elif mask is not None:
        s = s + mask
    s = s.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        hq = s.shape[-3] if s.ndim >= 3 else 1
        col = (
            sinks.reshape(hq, 1, 1).expand(s.shape[:-1] + (1,))
            if s.ndim >= 3
            else sinks.reshape(1, 1).expand(s.shape[:-1] + (1,))
        )
        s = torch.cat([s, col], dim=-1)
    m = s.amax(dim=-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    ex = torch.exp(s - m)
    l = ex.sum(dim=-1, keepdim=True)  # noqa: E741
    p = ex / torch.where(l == 0, torch.ones_like(l), l)
    if sinks is not None:
        p = p[..., :-1]
    if dropout_p > 0:
        keep = keep(tuple(p.shape)) if callable(keep) else keep
        p = p * keep * (0.0 if dropout_p == 1 else 1.0 / (1.0 - dropout_p))
    return p @ vv

"""The tests' oracles: attention written out densely, and the one relative error.

* ``attention_formula`` -- THE torch attention oracle: every option of the attention cores (bool and
  float masks, causality with either alignment, windows, ALiBi, softcap, sinks, GQA, dropout through
  a given keep-mask) as the explicit formula on float64 tensors, so that torch autograd (and
  ``torch.func.jvp``) give every derivative, of the mask and the sinks included.
  ``torch_attention`` runs it on numpy inputs and returns ``(out, grads)``.
* ``dense`` -- the same formula in numpy, for the tests that run without torch.
* ``torch_delta_rule`` -- the gated delta rule (and, with a decay per key channel, Kimi Delta
  Attention) as the step-by-step recurrence in torch, for autograd and ``torch.func``.
* ``rel_err`` -- the relative error every comparison uses (its floor and its scale as parameters).

Written from the contract's words, sharing no code with ``npattn.functional``: every ``(Lq, Lk)``
matrix is formed in full, k and v heads are repeated for GQA, positions are explicit.  torch is
imported inside the functions that need it: a module importing this one collects without torch.
"""

import numpy as np

# -- positions, visibility and ALiBi distance (both formulas) ------------------------------------------------


def positions(lq, lk, align):
    """Query positions ``(Lq, 1)`` and key positions ``(1, Lk)`` (``bottom_right``: the last query
    sits at the last key)."""
    p = np.arange(lq)[:, None] + (lk - lq if align == "bottom_right" else 0)
    return p, np.arange(lk)[None, :]


def visible(lq, lk, causal=False, align="top_left", window=None):
    """``(Lq, Lk)`` bool: the keys each query may see by causality and the window ``(left, right)``
    (a negative side is unbounded)."""
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


def distance(lq, lk, align):
    """``|p - j|`` of shape ``(Lq, Lk)``, float64: what ALiBi's slope multiplies."""
    p, j = positions(lq, lk, align)
    return np.abs(p - j).astype(np.float64)


def alibi_bias(slopes, lead, lq, lk, align):
    """``-slope_h |p - j|`` of shape ``lead + (Lq, Lk)``."""
    return -np.broadcast_to(slopes, lead)[..., None, None] * distance(lq, lk, align)


# -- the torch oracle ------------------------------------------------------------------------------------------


def attention_formula(
    q,
    k,
    v,
    attn_mask=None,
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
    sinks=None,
):
    """``out`` of attention with every option, written densely in torch.

    A pure function of the float64 tensors ``q, k, v``, a float ``attn_mask`` and ``sinks`` (any of
    them may require grad; ``torch.func.jvp`` works too).  A bool ``attn_mask`` (numpy or torch)
    hides keys, a float one (tensor or numpy) is added to the scores; ``alibi_slopes`` is numpy or a
    tensor broadcasting against the scores' leading axes; ``sinks`` holds one logit per query head
    (an extra column of value 0).  ``keep``: dropout's keep-mask of the scores' shape (numpy or torch
    bool), or a function of that shape returning one; applied with ``1 / (1 - dropout_p)``.  A row
    that sees nothing (and has no sink) gives 0.
    """
    import torch

    lq, lk, e = q.shape[-2], k.shape[-2], q.shape[-1]
    if enable_gqa and q.ndim >= 3 and k.ndim >= 3 and q.shape[-3] != k.shape[-3]:
        hk = max(k.shape[-3], v.shape[-3])  # k or v may carry one head that broadcasts
        g = q.shape[-3] // hk
        k, v = (a.expand(*a.shape[:-3], hk, *a.shape[-2:]).repeat_interleave(g, dim=-3) for a in (k, v))
    scale = 1.0 / np.sqrt(e) if scale is None else scale
    s = scale * (q @ k.transpose(-1, -2))
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    vis = torch.from_numpy(visible(lq, lk, is_causal, causal_align, window))
    if attn_mask is not None and _is_bool(attn_mask):
        vis = vis & torch.as_tensor(attn_mask)
    elif attn_mask is not None:
        s = s + (attn_mask if isinstance(attn_mask, torch.Tensor) else torch.as_tensor(attn_mask, dtype=torch.float64))
    if alibi_slopes is not None:
        slopes = torch.as_tensor(alibi_slopes, dtype=torch.float64)
        s = s - slopes[..., None, None] * torch.from_numpy(distance(lq, lk, causal_align))
    s = torch.where(vis, s, float("-inf"))
    if sinks is not None:  # one more column: the sink's logit, value 0
        col = sinks.reshape(-1, 1, 1) if s.ndim >= 3 else sinks.reshape(1, 1)
        s = torch.cat([s, col.expand(s.shape[:-1] + (1,))], dim=-1)
    m = s.amax(dim=-1, keepdim=True).detach()  # any constant per row; detached, it is not differentiated
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    ex = torch.exp(s - m)
    tot = ex.sum(dim=-1, keepdim=True)
    p = ex / torch.where(tot == 0, torch.ones_like(tot), tot)
    if sinks is not None:
        p = p[..., :-1]
    if dropout_p > 0:
        if keep is None:
            raise ValueError("attention_formula: dropout_p > 0 needs the keep-mask")
        keep = keep(tuple(p.shape)) if callable(keep) else keep
        p = p * torch.as_tensor(keep) * (0.0 if dropout_p == 1 else 1.0 / (1.0 - dropout_p))
    return p @ v


def torch_attention(q, k, v, attn_mask=None, *, dout=None, mask_grad=False, sinks=None, **options):
    """``(out, grads)`` of ``attention_formula`` on numpy inputs, as numpy float64.

    ``grads`` is ``()`` without ``dout``; with it, torch autograd's ``(dq, dk, dv[, dmask][, dsinks])``
    for the upstream gradient ``dout``: ``dmask`` for a float ``attn_mask`` with ``mask_grad``,
    ``dsinks`` with ``sinks`` (npattn's order).  ``options``: those of ``attention_formula``.
    """
    import torch

    def leaf(a):
        return torch.tensor(np.asarray(a, dtype=np.float64), requires_grad=True)

    leaves = [leaf(q), leaf(k), leaf(v)]
    if mask_grad:
        assert attn_mask is not None and not _is_bool(attn_mask), "mask_grad needs a float attn_mask"
        attn_mask = leaf(attn_mask)
        leaves.append(attn_mask)
    if sinks is not None:
        sinks = leaf(sinks)
        leaves.append(sinks)
    out = attention_formula(*leaves[:3], attn_mask, sinks=sinks, **options)
    grads = ()
    if dout is not None:
        g = torch.autograd.grad(out, leaves, torch.as_tensor(np.asarray(dout, dtype=np.float64)), allow_unused=True)
        grads = tuple(np.zeros(x.shape) if gi is None else gi.numpy() for x, gi in zip(leaves, g))
    return out.detach().numpy(), grads


def _is_bool(mask):
    return str(mask.dtype) in ("bool", "torch.bool")


# -- the numpy formula (no torch) ------------------------------------------------------------------------------


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
    """``out`` of ``attention_formula``, in numpy (``keep``: the dropout keep-mask)."""
    if enable_gqa and q.ndim >= 3 and k.ndim >= 3 and q.shape[-3] != k.shape[-3]:
        g = q.shape[-3] // k.shape[-3]
        k, v = np.repeat(k, g, axis=-3), np.repeat(v, g, axis=-3)
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


# -- the delta rules, step by step ---------------------------------------------------------------------------


def torch_delta_rule(t, q, k, v, g, beta, s0=None, *, l2, final=False):
    """The gated delta rule step by step (the contract's recurrence) in torch ``t``; ``g`` of q's
    shape (a log decay per key channel) makes it Kimi Delta Attention: row d of the state decays
    by ``exp(g_td)``."""
    if l2:
        q, k = (x / t.sqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    q = q / q.shape[-1] ** 0.5
    S = t.zeros(q.shape[:-2] + (k.shape[-1], v.shape[-1]), dtype=q.dtype) if s0 is None else s0
    outs = []
    for i in range(q.shape[-2]):
        decay = t.exp(g[..., i, :])[..., :, None] if g.ndim == q.ndim else t.exp(g[..., i])[..., None, None]
        S = decay * S
        u = beta[..., i, None] * (v[..., i, :] - t.einsum("...kv,...k->...v", S, k[..., i, :]))
        S = S + k[..., i, :, None] * u[..., None, :]
        outs.append(t.einsum("...kv,...k->...v", S, q[..., i, :]))
    out = t.stack(outs, -2)
    return (out, S) if final else out


# -- the relative error ------------------------------------------------------------------------------------------


def rel_err(a, b, floor=1e-3, *, relative_to="both", match_nonfinite=False):
    """The relative error of ``a`` against the reference ``b`` (numpy arrays, torch tensors or
    numbers, of one shape); 0 for empty arrays.

    ``relative_to="both"``: ``max_i |a_i - b_i| / max(|a_i|, |b_i|, floor)`` (each entry on its own
    scale); ``"b"``: ``max_i |a_i - b_i| / max(|b_i|, floor)``; ``"max_b"``:
    ``max_i |a_i - b_i| / max(max_j |b_j|, floor)`` (the tensor's scale).  Every entry must be
    finite, unless ``match_nonfinite``: then each non-finite entry of ``b`` must be repeated in ``a``
    (the same infinity, NaN for NaN) and is left out.
    """
    a, b = (np.asarray(x.detach().cpu().numpy() if hasattr(x, "detach") else x, dtype=np.float64) for x in (a, b))
    assert a.shape == b.shape, (a.shape, b.shape)
    fin = np.isfinite(b)
    if match_nonfinite:
        assert np.array_equal(a[~fin], b[~fin], equal_nan=True), "non-finite entries differ"
        a, b = a[fin], b[fin]
    else:
        assert fin.all(), "non-finite entries in the reference"
    assert np.isfinite(a).all(), "non-finite entries"
    if a.size == 0:
        return 0.0
    diff = np.abs(a - b)
    if relative_to == "max_b":
        return float(np.max(diff) / max(np.max(np.abs(b)), floor))
    if relative_to == "b":
        return float(np.max(diff / np.maximum(np.abs(b), floor)))
    assert relative_to == "both", relative_to
    return float(np.max(diff / np.maximum(np.maximum(np.abs(a), np.abs(b)), floor)))

"""The ``mla_decode`` case: decoding with multi-head latent attention (``MultiHeadLatentAttention``).

One layer decodes hidden states one at a time after a prefill, three ways in npattn (the latent
cache in the absorbed form, the latent cache expanded by ``kv_b_proj`` at every step, no cache) and
one in torch (an eager twin of the expanded form, as transformers' ``DeepseekV3Attention`` runs);
the rows go into the decode section (``decode.py``), with the cache's bytes per token against MHA
and GQA with the same heads.
"""

from __future__ import annotations

import numpy as np

from .cases import Built, _inputs, rel_diff

__all__ = ["mla_decode", "mla_decode_flops", "torch_twin"]


def mla_decode(dtype, torch, *, cfg, prompt_len=16, new_tokens=112, batch=1):
    """One ``MultiHeadLatentAttention(**cfg)`` layer decoding ``new_tokens`` hidden states one at a
    time after a ``prompt_len``-token prefill: with the latent cache in the absorbed form (queries
    through ``W_uk``, attention over the cached latents, then ``W_uv``), with the latent cache
    expanded by ``kv_b_proj`` at every step (``absorb=False``: what transformers'
    ``DeepseekV3Attention`` does), and without a cache (every step re-encodes the prefix); torch's
    eager twin of the expanded form (``torch_twin``), same weights.  ``check``: the largest
    relative difference of each run's outputs to the absorbed run's."""
    from ...nn import MultiHeadLatentAttention, no_grad

    cfg = dict(cfg)
    hidden = cfg.pop("hidden_size")
    heads = cfg.pop("num_heads")
    m = MultiHeadLatentAttention(hidden, heads, rng=0, dtype=dtype, **cfg)
    total = prompt_len + new_tokens
    (x,) = _inputs(dtype, (batch, total, hidden))

    def cached(absorb):
        def run():
            m.reset_kv_cache()
            with no_grad():
                outs = [m(x[:, :prompt_len], use_cache=True, absorb=absorb)]
                outs += [m(x[:, t : t + 1], use_cache=True, absorb=absorb) for t in range(prompt_len, total)]
            return np.concatenate(outs, axis=1)

        return run

    def recompute():
        with no_grad():
            outs = [m(x[:, :prompt_len])] + [m(x[:, : t + 1])[:, -1:] for t in range(prompt_len, total)]
        return np.concatenate(outs, axis=1)

    fns = {
        "npattn, absorbed latent cache": cached(True),
        "npattn, latent cache expanded": cached(False),
        "npattn, no cache": recompute,
    }
    torch_fns = {}
    if torch is not None:  # pragma: needs torch
        torch_fns["torch eager, latent cache expanded"] = torch_twin(torch, m, x, prompt_len)

    def check():
        want = fns["npattn, absorbed latent cache"]()
        runs = {**fns, **torch_fns}
        return {"max_rel_diff_vs_absorbed": {k: rel_diff(np.asarray(f()), want) for k, f in runs.items()}}

    shape = {"batch": batch, "prompt": prompt_len, "new_tokens": new_tokens, "hidden_size": hidden, "num_heads": heads}
    shape.update(cfg)
    shape["cache_bytes_per_token"] = m.cache_comparison()
    return Built("mla_decode", shape, fns, torch_fns, check)


def mla_decode_flops(*, cfg, prompt_len=16, new_tokens=112, batch=1):
    """Roughly: the absorbed run's projections (2 FLOPs per weight and token) and its attention
    over the latents (``r + dr`` features per score, ``r`` per value, per head)."""
    h, d, r = cfg["num_heads"], cfg["hidden_size"], cfg["kv_lora_rank"]
    dn, dr, dv, ql = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg.get("q_lora_rank")
    q = d * h * (dn + dr) if ql is None else ql * (d + h * (dn + dr))
    weights = q + d * (r + dr) + h * (dn + dv) * r + h * dv * d
    total = prompt_len + new_tokens
    attn = sum(2 * h * t * (2 * r + dr) for t in range(prompt_len, total + 1))
    return batch * (2 * weights * total + attn)


def torch_twin(torch, m, x, prompt_len):  # pragma: needs torch
    """A callable decoding ``x`` as ``m`` does with a latent cache expanded at every step, in torch
    eager (``no_grad``), with ``m``'s weights: the layer of transformers' ``DeepseekV3Attention``
    (RMSNorm, RoPE on the shared key, ``kv_b_proj`` over every cached latent, softmax attention);
    it returns the outputs ``(batch, L, hidden)``."""
    from ...functional import rope_frequencies

    F = torch.nn.functional
    w = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in m.state_dict().items()}
    H, dn, dr, dv, r = m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
    inv_freq, factor = rope_frequencies(dr, m.rope_theta, m.rope_scaling)
    angles = np.arange(x.shape[1])[:, None] * inv_freq  # (L, dr/2)
    cos = torch.from_numpy((np.cos(angles) * factor).astype(x.dtype))
    sin = torch.from_numpy((np.sin(angles) * factor).astype(x.dtype))
    xt = torch.from_numpy(x)

    def lin(t, name):
        return F.linear(t, w[name + ".weight"], w.get(name + ".bias"))

    def rms(t, name):
        return w[name + ".weight"] * t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + m.rms_norm_eps)

    def rope(t, c, s):  # t (..., n, dr); c, s (n, dr/2)
        a, b = (t[..., 0::2], t[..., 1::2]) if m.rope_interleave else (t[..., : dr // 2], t[..., dr // 2 :])
        return torch.cat([a * c - b * s, b * c + a * s], dim=-1)

    def step(h, start, cache):
        B, n, _ = h.shape
        q = lin(h, "q_proj") if m.q_lora_rank is None else lin(rms(lin(h, "q_a_proj"), "q_a_layernorm"), "q_b_proj")
        q = q.view(B, n, H, dn + dr).transpose(1, 2)
        c, k_pe = lin(h, "kv_a_proj_with_mqa").split([r, dr], dim=-1)
        cs, sn = cos[start : start + n], sin[start : start + n]
        cache.append((rms(c, "kv_a_layernorm"), rope(k_pe, cs, sn)))
        c_all = torch.cat([e[0] for e in cache], dim=1)
        k_pe_all = torch.cat([e[1] for e in cache], dim=1)
        T = c_all.shape[1]
        kv = lin(c_all, "kv_b_proj").view(B, T, H, dn + dv).transpose(1, 2)
        key = torch.cat([kv[..., :dn], k_pe_all[:, None].expand(B, H, T, dr)], dim=-1)
        query = torch.cat([q[..., :dn], rope(q[..., dn:], cs, sn)], dim=-1)
        scores = query @ key.transpose(-1, -2) * m.scaling
        if n > 1:
            scores = scores.masked_fill(torch.ones(n, T, dtype=torch.bool).triu(T - n + 1), float("-inf"))
        o = torch.softmax(scores, dim=-1) @ kv[..., dn:]
        return lin(o.transpose(1, 2).reshape(B, n, H * dv), "o_proj")

    def run():
        cache: list = []
        with torch.no_grad():
            outs = [step(xt[:, :prompt_len], 0, cache)]
            outs += [step(xt[:, t : t + 1], t, cache) for t in range(prompt_len, xt.shape[1])]
        return torch.cat(outs, dim=1).numpy()

    return run

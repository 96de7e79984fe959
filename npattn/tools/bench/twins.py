"""torch's twins of the cases: the same computation with the same weights (imported only where torch is).

Each function takes the ``torch`` module and npattn's object (or arrays) and returns torch's side;
the ``*_step`` helpers return a zero-argument callable that runs one forward+backward.
"""

from __future__ import annotations

import importlib
import math

import numpy as np

__all__ = [
    "sdpa",
    "sdpa_forward",
    "module_step",
    "mha",
    "encoder",
    "demo",
    "demo_step",
    "book_gpt",
    "book_gpt_greedy",
    "TORCH_DELTA_RULES",
    "delta_rule",
]


def _dtype(torch, dtype):
    return torch.float32 if np.dtype(dtype) == np.float32 else torch.float64


def _t(torch, a):
    return torch.from_numpy(np.ascontiguousarray(a))


def sdpa(torch, q, k, v, dout, causal):
    """``F.scaled_dot_product_attention`` forward+backward (its CPU flash kernel for these inputs):
    ``(run, tq)``; ``run()`` returns the output, ``tq.grad`` holds dq after it."""
    tq, tk, tv = (torch.from_numpy(a.copy()).requires_grad_() for a in (q, k, v))
    tdout = torch.from_numpy(dout)
    sdpa_ = torch.nn.functional.scaled_dot_product_attention
    sdpa_(tq[..., :2, :], tk[..., :2, :], tv[..., :2, :], is_causal=causal).sum().backward()  # load the kernels

    def run():
        for t in (tq, tk, tv):
            t.grad = None
        out = sdpa_(tq, tk, tv, is_causal=causal)
        out.backward(tdout)
        return out

    for t in (tq, tk, tv):
        t.grad = None
    return run, tq


def sdpa_forward(torch, q, k, v, causal):
    """``F.scaled_dot_product_attention`` forward only (no autograd): ``run``."""
    tq, tk, tv = (torch.from_numpy(a.copy()) for a in (q, k, v))
    sdpa_ = torch.nn.functional.scaled_dot_product_attention
    sdpa_(tq[..., :2, :], tk[..., :2, :], tv[..., :2, :], is_causal=causal)  # load the kernel

    def run():
        with torch.no_grad():
            return sdpa_(tq, tk, tv, is_causal=causal)

    return run


def module_step(torch, tmodule, x, dy):
    """One forward+backward of ``tmodule`` on ``x`` with upstream ``dy``: ``(run, tx)``."""
    tx = torch.from_numpy(x.copy()).requires_grad_()
    tdy = torch.from_numpy(dy)
    params = list(tmodule.parameters())

    def run():
        tx.grad = None
        for p in params:
            p.grad = None
        out = tmodule(tx)
        out.backward(tdy)
        return out

    return run, tx


def mha(torch, m):
    """torch's fastest eager MHA with the weights of npattn's ``m`` (no qkv bias): one fused
    ``nn.Linear`` for q, k, v, ``F.scaled_dot_product_attention``, the output ``nn.Linear``."""
    nn = torch.nn
    d, h = m.d_out, m.num_heads

    class TorchMHA(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(m.d_in, 3 * d, bias=False)
            self.out_proj = nn.Linear(d, d, bias=m.out_proj.bias is not None)

        def forward(self, x):
            b, L, _ = x.shape
            q, k, v = self.qkv(x).view(b, L, 3, h, d // h).permute(2, 0, 3, 1, 4)
            ctx = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=m.causal)
            return self.out_proj(ctx.transpose(1, 2).reshape(b, L, d))

    tm = TorchMHA().to(_dtype(torch, m.dtype))
    with torch.no_grad():
        tm.qkv.weight.copy_(
            _t(torch, np.concatenate([m.W_query.weight.data, m.W_key.weight.data, m.W_value.weight.data]))
        )
        tm.out_proj.weight.copy_(_t(torch, m.out_proj.weight.data))
        if m.out_proj.bias is not None:
            tm.out_proj.bias.copy_(_t(torch, m.out_proj.bias.data))
    return tm


def encoder(torch, block, L):
    """``nn.TransformerEncoderLayer`` with the weights of npattn's ``block`` and a causal mask."""
    mha_, ffn = block.mha, block.ffn
    d, h = mha_.d_out, mha_.num_heads
    layer = torch.nn.TransformerEncoderLayer(
        d, h, ffn.linear1.out_features, dropout=0.0, batch_first=True, norm_first=block.norm_first
    )
    dt = _dtype(torch, block.dtype)
    layer.to(dt)
    with torch.no_grad():
        attn = layer.self_attn
        attn.in_proj_weight.copy_(
            _t(torch, np.concatenate([mha_.W_query.weight.data, mha_.W_key.weight.data, mha_.W_value.weight.data]))
        )
        if mha_.W_query.bias is None:  # qkv_bias=False: torch's layer always has one, kept at zero
            attn.in_proj_bias.zero_()
        else:
            attn.in_proj_bias.copy_(
                _t(torch, np.concatenate([mha_.W_query.bias.data, mha_.W_key.bias.data, mha_.W_value.bias.data]))
            )
        attn.out_proj.weight.copy_(_t(torch, mha_.out_proj.weight.data))
        attn.out_proj.bias.copy_(_t(torch, mha_.out_proj.bias.data))
        for tl, nl in (
            (layer.linear1, ffn.linear1),
            (layer.linear2, ffn.linear2),
            (layer.norm1, block.layernorm1),
            (layer.norm2, block.layernorm2),
        ):
            tl.weight.copy_(_t(torch, nl.weight.data))
            tl.bias.copy_(_t(torch, nl.bias.data))
    mask = torch.nn.Transformer.generate_square_subsequent_mask(L, dtype=dt)

    class Causal(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, x):
            return self.layer(x, src_mask=mask, is_causal=True)

    return Causal()


def demo(torch, model, L):
    """torch's eager equivalent of a ``TinyTransformer`` (pre-norm causal blocks), same weights."""
    nn = torch.nn
    layers = [encoder(torch, blk, L) for blk in model.blocks]

    class TorchTiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(*model.tok_emb.weight.data.shape)
            self.pos = nn.Embedding(*model.pos_emb.weight.data.shape)
            self.blocks = nn.ModuleList(layers)
            self.norm = nn.LayerNorm(model.norm.weight.data.shape[0])
            self.head = nn.Linear(*model.head.weight.data.shape[::-1])

        def forward(self, ids):
            x = self.tok(ids) + self.pos(torch.arange(ids.shape[-1]))
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.norm(x))

    tm = TorchTiny().to(_dtype(torch, model.dtype))
    with torch.no_grad():
        for tl, nl in ((tm.tok, model.tok_emb), (tm.pos, model.pos_emb), (tm.norm, model.norm), (tm.head, model.head)):
            tl.weight.copy_(_t(torch, nl.weight.data))
            if getattr(nl, "bias", None) is not None:
                tl.bias.copy_(_t(torch, nl.bias.data))
    return tm


def demo_step(torch, tm, ids, targets, ignore_index):
    """One training step of ``demo``'s torch model: forward, mean cross-entropy, backward."""
    tids, ttargets = torch.from_numpy(ids), torch.from_numpy(targets)
    params = list(tm.parameters())

    def run():
        for p in params:
            p.grad = None
        logits = tm(tids)
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), ttargets.reshape(-1), ignore_index=ignore_index
        )
        loss.backward()
        return loss

    return run


def book_gpt(torch, cfg):
    """The book's chapter-4 GPTModel in torch (eager, no cache), as ``tests/book/chapter4_torch.py``."""
    nn = torch.nn

    class LayerNorm(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.scale, self.shift = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))

        def forward(self, x):
            mean, var = x.mean(-1, keepdim=True), x.var(-1, keepdim=True, unbiased=False)
            return self.scale * (x - mean) / torch.sqrt(var + 1e-5) + self.shift

    class GELU(nn.Module):
        def forward(self, x):
            return 0.5 * x * (1 + torch.tanh((2.0 / math.pi) ** 0.5 * (x + 0.044715 * x**3)))

    class MHA(nn.Module):
        def __init__(self):
            super().__init__()
            d = cfg["emb_dim"]
            self.W_query, self.W_key, self.W_value = (nn.Linear(d, d, bias=cfg["qkv_bias"]) for _ in range(3))
            self.out_proj = nn.Linear(d, d)
            self.register_buffer("mask", torch.triu(torch.ones(cfg["context_length"], cfg["context_length"]), 1))

        def forward(self, x):
            b, n, d = x.shape
            h = cfg["n_heads"]
            q, k, v = (W(x).view(b, n, h, d // h).transpose(1, 2) for W in (self.W_query, self.W_key, self.W_value))
            s = (q @ k.transpose(2, 3)).masked_fill(self.mask.bool()[:n, :n], -torch.inf)
            w = torch.softmax(s / k.shape[-1] ** 0.5, dim=-1)
            return self.out_proj((w @ v).transpose(1, 2).reshape(b, n, d))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            d = cfg["emb_dim"]
            self.att = MHA()
            self.ff = nn.Module()
            self.ff.layers = nn.Sequential(nn.Linear(d, 4 * d), GELU(), nn.Linear(4 * d, d))
            self.norm1, self.norm2 = LayerNorm(d), LayerNorm(d)

        def forward(self, x):
            x = x + self.att(self.norm1(x))
            return x + self.ff.layers(self.norm2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_emb = nn.Embedding(cfg["vocab_size"], cfg["emb_dim"])
            self.pos_emb = nn.Embedding(cfg["context_length"], cfg["emb_dim"])
            self.trf_blocks = nn.Sequential(*[Block() for _ in range(cfg["n_layers"])])
            self.final_norm = LayerNorm(cfg["emb_dim"])
            self.out_head = nn.Linear(cfg["emb_dim"], cfg["vocab_size"], bias=False)

        def forward(self, idx):
            x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1]))
            return self.out_head(self.final_norm(self.trf_blocks(x)))

    return GPT()


def book_gpt_greedy(torch, cfg, state_dict, prompt, new):
    """A callable decoding ``new`` tokens greedily from ``prompt`` with ``book_gpt(cfg)`` loaded with
    ``state_dict`` (npattn's ``GPTModel.state_dict()``), no cache; it returns the tokens."""
    dtype = state_dict["tok_emb.weight"].dtype
    tm = book_gpt(torch, cfg).to(_dtype(torch, dtype)).eval()
    tm.load_state_dict({k: _t(torch, v) for k, v in state_dict.items()})
    ctx = cfg["context_length"]

    def run():
        idx = torch.from_numpy(prompt)
        with torch.no_grad():
            for _ in range(new):
                nxt = tm(idx[:, -ctx:])[:, -1].argmax(-1, keepdim=True)
                idx = torch.cat([idx, nxt], dim=1)
        return idx.numpy()

    return run


# transformers' torch path of each delta rule: (module under transformers.models, function name)
TORCH_DELTA_RULES = {
    "gated_delta_rule": ("qwen3_next.modeling_qwen3_next", "torch_chunk_gated_delta_rule"),
    "kimi_delta_attention": ("kimi_linear.modeling_kimi_linear", "chunk_kimi_delta_attention"),
}


def delta_rule(torch, rule, q, k, v, g, beta, dout):
    """transformers' torch implementation of ``rule`` (chunks of 64): for ``"gated_delta_rule"``
    ``torch_chunk_gated_delta_rule`` (Qwen3-Next's torch path), for ``"kimi_delta_attention"``
    ``chunk_kimi_delta_attention`` (Kimi Linear's; its torch fallback when FLA is not installed),
    with ``use_qk_l2norm_in_kernel`` forward+backward through autograd, on npattn's ``(b, h, L,
    ...)`` arrays (its layout is ``(b, L, h, ...)``): ``run`` returning the output in npattn's
    layout, or None when transformers is not importable."""
    module, name = TORCH_DELTA_RULES[rule]
    try:
        fn = getattr(importlib.import_module(f"transformers.models.{module}"), name)
    except ImportError:
        return None
    leaves = [_t(torch, np.swapaxes(a, 1, 2)).requires_grad_() for a in (q, k, v, g, beta)]
    tdout = _t(torch, np.swapaxes(dout, 1, 2))

    def run():
        for t in leaves:
            t.grad = None
        out, _ = fn(*leaves, use_qk_l2norm_in_kernel=True)
        out.backward(tdout)
        return out.detach().numpy().swapaxes(1, 2)

    return run

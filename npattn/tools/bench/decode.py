"""The decode section (``npattn bench --decode``): greedy decoding tokens/s with and without the KV cache.

``npattn.book.GPTModel`` decodes greedily from a 16-token prompt until its context is full, with
the KV cache (one token per step) and without (every step re-encodes the whole sequence), and
torch's eager book model (no cache) with the same weights (``cases.decode``), taking turns; with
torch present npattn's side runs in a child process without torch.

Multi-head latent attention (``latent.mla_decode``): one DeepSeek-shaped ``MultiHeadLatentAttention``
layer decodes one token at a time with its latent cache in the absorbed form, with the latent cache
expanded by ``kv_b_proj`` at every step, and without a cache, against torch's eager twin of the
expanded form; the rows (``"name": "mla_decode"``) say the cache's bytes per token against MHA and
GQA with the same heads.
"""

from __future__ import annotations

import numpy as np

from .cases import KINDS
from .runner import Step, run_steps, time_case
from .text import table

__all__ = [
    "DECODE",
    "DECODE_QUICK",
    "MLA_DECODE",
    "MLA_DECODE_QUICK",
    "bench_decode",
    "bench_mla_decode",
    "collect",
    "format_decode",
    "format_mla_decode",
    "format_section",
]


DECODE = {
    "vocab_size": 512,
    "context_length": 96,  # 80 new tokens: about half a minute a dtype on 2 idle cores
    "emb_dim": 256,
    "n_heads": 4,
    "n_layers": 4,
    "drop_rate": 0.0,
    "qkv_bias": False,
}
DECODE_QUICK = {
    "vocab_size": 64,
    "context_length": 32,
    "emb_dim": 32,
    "n_heads": 2,
    "n_layers": 2,
    "drop_rate": 0.0,
    "qkv_bias": False,
}


MLA_DECODE = {
    "hidden_size": 512,
    "num_heads": 16,
    "q_lora_rank": 192,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
}
MLA_DECODE_QUICK = {
    "hidden_size": 32,
    "num_heads": 2,
    "q_lora_rank": 12,
    "kv_lora_rank": 8,
    "qk_nope_head_dim": 4,
    "qk_rope_head_dim": 4,
    "v_head_dim": 4,
}


def bench_decode(cfg=None, dtype=np.float32, *, prompt_len=16, batch=1, use_torch=True, repeats=3, own_process=False):
    """Greedy decoding of ``npattn.book.GPTModel(cfg)`` from a ``prompt_len``-token prompt until the
    context is full (``context_length - prompt_len`` new tokens), with the KV cache and without,
    and torch's eager book model (no cache) with the same weights.  Rows: ``{"name": "decode",
    "impl", "tokens_per_s", "seconds", "same_tokens", ...}``; ``same_tokens`` says whether each run
    produced the cached run's tokens."""
    params = {"cfg": dict(DECODE if cfg is None else cfg), "prompt_len": prompt_len, "batch": batch}
    return _rows("decode", params, dtype, "same_tokens", use_torch=use_torch, own_process=own_process, repeats=repeats)


def bench_mla_decode(
    cfg=None, dtype=np.float32, *, prompt_len=16, new_tokens=112, batch=1, use_torch=True, repeats=3, own_process=False
):
    """One ``MultiHeadLatentAttention(**cfg)`` layer (default ``MLA_DECODE``) decoding ``new_tokens``
    hidden states after a ``prompt_len``-token prefill (``latent.mla_decode``): absorbed latent
    cache, expanded latent cache, no cache, and torch's eager expanded twin.  Rows: ``{"name":
    "mla_decode", "impl", "tokens_per_s", "seconds", "max_rel_diff_vs_absorbed", "shape"}``;
    ``shape["cache_bytes_per_token"]`` is ``MultiHeadLatentAttention.cache_comparison()``."""
    params = {"cfg": dict(MLA_DECODE if cfg is None else cfg), "prompt_len": prompt_len, "new_tokens": new_tokens}
    params["batch"] = batch
    return _rows(
        "mla_decode",
        params,
        dtype,
        "max_rel_diff_vs_absorbed",
        use_torch=use_torch,
        own_process=own_process,
        repeats=repeats,
    )


def _rows(name, params, dtype, fact, **timing):
    """``time_case(name, ...)`` as one row per implementation: ``batch * new_tokens`` decoded tokens
    (the built case's shape) per run, and the check's per-implementation ``fact``."""
    built, times, facts = time_case(name, params, dtype, **timing)
    tokens = params["batch"] * built.shape["new_tokens"]
    return [
        {
            "name": name,
            "impl": impl,
            "shape": built.shape,
            "dtype": np.dtype(dtype).name,
            "seconds": t,
            "tokens_per_s": tokens / t,
            fact: facts[fact][impl],
        }
        for impl, t in times.items()
    ]


def collect(quick=False, progress=True):
    cfg, prompt_len, repeats = (DECODE_QUICK, 4, 1) if quick else (DECODE, 16, 2)
    # rough seconds: warm-up, the check and two calls a turn, of the no-cache runs (npattn's and torch's,
    # re-encoding every prefix) and the cached one (a few milliseconds a token)
    no_cache = KINDS["decode"].flops(cfg=cfg, prompt_len=prompt_len) / 15e9
    guess = (2 * repeats + 3) * (2 * no_cache + (cfg["context_length"] - prompt_len) * 4e-3)
    steps = [
        Step(
            f"decode {dtype}",
            guess,
            lambda dtype=dtype: bench_decode(cfg, dtype, prompt_len=prompt_len, repeats=repeats, own_process=not quick),
        )
        for dtype in ("float32", "float64")
    ]
    mla, (mla_prompt, mla_new) = (MLA_DECODE_QUICK, (4, 12)) if quick else (MLA_DECODE, (16, 112))
    steps += [
        Step(
            f"mla decode {dtype}",
            mla_new * (0.002 if quick else 0.03) * (repeats + 3),
            lambda dtype=dtype: bench_mla_decode(
                mla, dtype, prompt_len=mla_prompt, new_tokens=mla_new, repeats=repeats, own_process=not quick
            ),
        )
        for dtype in ("float32", "float64")
    ]
    rows = run_steps("decode", steps, progress=progress, note=lambda rows: "; ".join(_line(r) for r in rows))
    return {"decode": [r for part in rows for r in part]}


def _line(r):
    return f"{r['impl']} {r['tokens_per_s']:.0f} tokens/s"


def format_decode(rows):
    """The book GPT's decode rows as lines of text."""
    rows = [r for r in rows if r["name"] == "decode"]
    if not rows:
        return []
    s = rows[0]["shape"]
    cells = [
        [r["impl"], r["dtype"], f"{r['seconds']:.2f}", f"{r['tokens_per_s']:.1f}", "yes" if r["same_tokens"] else "no"]
        for r in rows
    ]
    columns = [("implementation", "<"), ("dtype", "<"), ("seconds", ">"), ("tokens/s", ">"), ("same tokens", ">")]
    return [
        f"greedy decoding of npattn.book.GPTModel (emb {s['emb_dim']}, {s['n_layers']} layers, {s['n_heads']} "
        f"heads, vocab {s['vocab_size']}): a {s['prompt']}-token prompt to the full context of "
        f"{s['context_length']}, batch {s['batch']}"
    ] + table(columns, cells)


def format_mla_decode(rows):
    """The multi-head latent attention decode rows as lines of text, with the cache's size."""
    rows = [r for r in rows if r["name"] == "mla_decode"]
    if not rows:
        return []
    s = rows[0]["shape"]
    c = s["cache_bytes_per_token"]
    itemsize = np.dtype(rows[0]["dtype"]).itemsize  # the cache sizes below are per element of this dtype
    per = {k: c[k] // itemsize for k in ("mla", "mha", "gqa")}
    cells = [
        [r["impl"], r["dtype"], f"{r['seconds']:.3f}", f"{r['tokens_per_s']:.1f}"]
        + [f"{r['max_rel_diff_vs_absorbed']:.1e}"]
        for r in rows
    ]
    columns = [
        ("implementation", "<"),
        ("dtype", "<"),
        ("seconds", ">"),
        ("tokens/s", ">"),
        ("max rel diff", ">"),
    ]
    return [
        "",
        f"decoding with one MultiHeadLatentAttention layer (hidden {s['hidden_size']}, {s['num_heads']} heads, "
        f"kv_lora_rank {s['kv_lora_rank']}, q_lora_rank {s.get('q_lora_rank')}, qk {s['qk_nope_head_dim']}+"
        f"{s['qk_rope_head_dim']}, v {s['v_head_dim']}): a {s['prompt']}-token prefill, then {s['new_tokens']} "
        f"tokens one at a time, batch {s['batch']}",
        f"cache per token and layer: latent {per['mla']} numbers, MHA with the same heads {per['mha']} "
        f"({c['mha_over_mla']:.1f}x), GQA with {c['gqa_kv_heads']} kv heads {per['gqa']} ({c['gqa_over_mla']:.1f}x)",
    ] + table(columns, cells)


def format_section(report):
    rows = report.get("decode") or []
    return [""] + format_decode(rows) + format_mla_decode(rows) if rows else []

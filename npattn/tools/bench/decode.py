"""The decode section (``npattn bench --decode``): greedy decoding tokens/s with and without the KV cache.

``npattn.book.GPTModel`` decodes greedily from a 16-token prompt until its context is full, with
the KV cache (one token per step) and without (every step re-encodes the whole sequence), and
torch's eager book model (no cache) with the same weights (``cases.decode``), taking turns; with
torch present npattn's side runs in a child process without torch.
"""

from __future__ import annotations

import numpy as np

from .runner import Step, run_steps, time_case
from .text import table

DECODE = {
    "vocab_size": 512,
    "context_length": 128,
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


def bench_decode(cfg=None, dtype=np.float32, *, prompt_len=16, batch=1, use_torch=True, repeats=3, own_process=False):
    """Greedy decoding of ``npattn.book.GPTModel(cfg)`` from a ``prompt_len``-token prompt until the
    context is full (``context_length - prompt_len`` new tokens), with the KV cache and without,
    and torch's eager book model (no cache) with the same weights.  Rows: ``{"name": "decode",
    "impl", "tokens_per_s", "seconds", "same_tokens", ...}``; ``same_tokens`` says whether each run
    produced the cached run's tokens."""
    params = {"cfg": dict(DECODE if cfg is None else cfg), "prompt_len": prompt_len, "batch": batch}
    built, times, facts = time_case(
        "decode", params, dtype, use_torch=use_torch, own_process=own_process, repeats=repeats
    )
    new = built.shape["new_tokens"]
    return [
        {
            "name": "decode",
            "impl": impl,
            "shape": built.shape,
            "dtype": np.dtype(dtype).name,
            "seconds": t,
            "tokens_per_s": batch * new / t,
            "same_tokens": facts["same_tokens"][impl],
        }
        for impl, t in times.items()
    ]


def collect(quick=False, progress=True):
    cfg, prompt_len, repeats = (DECODE_QUICK, 4, 1) if quick else (DECODE, 16, 2)
    per_token = 2 * cfg["n_layers"] * 12 * cfg["emb_dim"] ** 2 / 5e9 + 2e-3  # rough seconds per cached step
    guess = (cfg["context_length"] - prompt_len) * per_token * 6 * (repeats + 3)
    steps = [
        Step(
            f"decode {dtype}",
            guess,
            lambda dtype=dtype: bench_decode(cfg, dtype, prompt_len=prompt_len, repeats=repeats, own_process=not quick),
        )
        for dtype in ("float32", "float64")
    ]
    rows = run_steps("decode", steps, progress=progress, note=lambda rows: "; ".join(_line(r) for r in rows))
    return {"decode": [r for part in rows for r in part]}


def _line(r):
    return f"{r['impl']} {r['tokens_per_s']:.0f} tokens/s"


def format_decode(rows):
    """The decode rows as lines of text."""
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


def format_section(report):
    return [""] + format_decode(report["decode"]) if report.get("decode") else []

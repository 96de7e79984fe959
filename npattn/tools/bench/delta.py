"""The delta-rule section (``npattn bench --delta``): gated DeltaNet's delta rule against sequence length.

``gated_delta_rule`` forward+backward with ``use_qk_l2norm`` (as Qwen3-Next), b=1, h=4, Dk=Dv=64,
float32, L = 256, 1024, 4096 (``--quick``: 32, 64, 128): npattn's chunked form (chunks of 64, work
linear in L), npattn's textbook recurrence (one step at a time), and transformers' own torch
implementation of the same layer, ``torch_chunk_gated_delta_rule`` (Qwen3-Next's torch path), with
autograd.  The three take turns (``runner.time_case``; npattn's side in a child process without
torch); each row gives seconds, milliseconds per 1000 steps (constant when the work is linear in
L), the recurrence's and torch's time over the chunked one's, and the largest relative difference
of their outputs to the chunked one's.  Calls of seconds each: one warm-up and two timed turns
(one at the longest length).
"""

from __future__ import annotations

from .runner import Step, run_steps, time_case, torch_or_none
from .text import table

__all__ = [
    "SHAPE",
    "LENGTHS",
    "QUICK_LENGTHS",
    "IMPLS",
    "delta_one",
    "delta_table",
    "collect",
    "format_delta",
    "format_section",
]


SHAPE = {"b": 1, "h": 4, "D": 64}
LENGTHS = (256, 1024, 4096)
QUICK_LENGTHS = (32, 64, 128)
IMPLS = ("chunked", "recurrence")


def delta_one(L, *, shape=SHAPE, repeats=2, use_torch=True):
    """One length: ``{"seq", "seconds": {side: s}, "ms_per_1k_steps": {side: ms}, "max_rel_diff"}``
    for the chunked form, the recurrence and (with torch and transformers) torch's chunked form."""
    params = dict(shape, L=L)
    built, times, facts = time_case(
        "delta_rule", params, "float32", use_torch=use_torch, own_process=True, warmup=1, repeats=repeats, pause=0.12
    )
    return {
        "seq": L,
        "shape": built.shape,
        "seconds": times,
        "ms_per_1k_steps": {k: 1e6 * s / L for k, s in times.items()},
        **facts,
    }


def delta_table(lengths=LENGTHS, progress=True, use_torch=True):
    """The chunked delta rule, the recurrence and torch's, against sequence length."""
    with_torch = use_torch and torch_or_none() is not None
    steps = [
        Step(
            f"gated_delta_rule L={L}",
            (3 if L < max(lengths) else 2) * (1e-4 + 7e-4 + (6e-3 * L / 1024 if with_torch else 0.0)) * L,
            lambda L=L: delta_one(L, repeats=1 if L == max(lengths) and L > 1024 else 2, use_torch=use_torch),
        )
        for L in lengths
    ]
    return run_steps("delta", steps, progress=progress, note=lambda r: " ".join(_cells(r)))


def collect(quick=False, progress=True):
    return {"delta": delta_table(QUICK_LENGTHS if quick else LENGTHS, progress=progress)}


def _cells(r):
    if r is None or "error" in r:
        return ["error"] + ["-"] * 6
    s = r["seconds"]
    chunked, rec, torch = s.get("chunked"), s.get("recurrence"), s.get("torch")
    diff = r.get("max_rel_diff", {}).get("torch")
    return [
        f"{chunked:.3f}",
        f"{r['ms_per_1k_steps']['chunked']:.1f}",
        f"{rec:.3f}" if rec else "-",
        f"{rec / chunked:.1f}x" if rec else "-",
        f"{torch:.3f}" if torch else "-",
        f"{torch / chunked:.1f}x" if torch else "-",
        f"{diff:.1e}" if diff is not None else "-",
    ]


def format_delta(rows):
    """The sweep as text: per length, each side's seconds and the ratios to the chunked form."""
    shape = rows[0]["shape"] if rows and "shape" in rows[0] else dict(SHAPE)
    columns = [("L", ">"), ("chunked s", ">"), ("ms/1k steps", ">"), ("recurrence s", ">"), ("x", ">")]
    columns += [("torch s", ">"), ("x", ">"), ("rel diff", ">")]
    lines = [
        f"gated delta rule, use_qk_l2norm (b={shape['b']}, h={shape['h']}, Dk=Dv={shape['D']}, float32), "
        "forward+backward, median of turns; x = time / chunked time; torch = transformers' "
        "torch_chunk_gated_delta_rule with autograd:"
    ]
    lines += table(columns, [[str(r["seq"] if r else "?")] + _cells(r) for r in rows])
    return "\n".join(lines)


def format_section(report):
    return ["", format_delta(report["delta"])] if report.get("delta") else []

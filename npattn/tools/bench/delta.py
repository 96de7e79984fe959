"""The delta-rule section (``npattn bench --delta``): the linear attentions' delta rules against sequence length.

Two rules, each forward+backward with ``use_qk_l2norm``, b=1, h=4, Dk=Dv=64, float32, L = 256,
1024, 4096 (``--quick``: 32, 64, 128): ``gated_delta_rule`` (Qwen3-Next's gated DeltaNet, a scalar
decay per step) and ``kimi_delta_attention`` (Kimi Linear's KDA, a decay per step and key channel,
``g`` shaped like ``k``).  For each: npattn's chunked form (work linear in L; chunks of 64 for the
gated delta rule, 16 for KDA, ``cases.DELTA_RULES``), npattn's textbook recurrence
(``npattn.functional.reference``, one step at a time), and transformers' own torch implementation
of the same layer with autograd (``torch_chunk_gated_delta_rule``, Qwen3-Next's torch path;
``chunk_kimi_delta_attention``, Kimi Linear's torch fallback; the row has no torch side without
torch or transformers).  The three take turns (``runner.time_case``; npattn's side in a child
process without torch); each row (``"rule"``, ``"seq"``) gives seconds, milliseconds per 1000
steps (constant when the work is linear in L), and the largest relative difference of the
recurrence's and torch's outputs to the chunked one's; the text has a table per rule.  Calls of
seconds each: one warm-up and two timed turns (one at the longest length).
"""

from __future__ import annotations

from .cases import DELTA_RULES
from .runner import Step, run_steps, time_case, torch_or_none
from .text import table

__all__ = [
    "SHAPE",
    "LENGTHS",
    "QUICK_LENGTHS",
    "IMPLS",
    "RULES",
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
RULES = tuple(DELTA_RULES)  # gated_delta_rule, kimi_delta_attention
# per rule: the header of its table, and rough seconds per step for the progress line's guess
# (npattn's two sides, torch's; one forward+backward)
_TITLES = {
    "gated_delta_rule": ("gated delta rule", "torch_chunk_gated_delta_rule"),
    "kimi_delta_attention": ("Kimi Delta Attention (per-channel decay)", "chunk_kimi_delta_attention"),
}
_GUESS = {"gated_delta_rule": (8e-4, 2e-3), "kimi_delta_attention": (6e-4, 6e-3)}


def delta_one(L, *, rule="gated_delta_rule", shape=SHAPE, repeats=2, use_torch=True):
    """One rule at one length: ``{"rule", "seq", "seconds": {side: s}, "ms_per_1k_steps": {side: ms},
    "max_rel_diff"}`` for the chunked form, the recurrence and (with torch and transformers) torch's
    chunked form."""
    params = dict(shape, L=L, rule=rule)
    built, times, facts = time_case(
        "delta_rule", params, "float32", use_torch=use_torch, own_process=True, warmup=1, repeats=repeats, pause=0.12
    )
    return {
        "rule": rule,
        "seq": L,
        "shape": built.shape,
        "seconds": times,
        "ms_per_1k_steps": {k: 1e6 * s / L for k, s in times.items()},
        **facts,
    }


def delta_table(lengths=LENGTHS, progress=True, use_torch=True, rules=RULES):
    """Each rule's chunked form, its recurrence and torch's, against sequence length."""
    with_torch = use_torch and torch_or_none() is not None
    longest = max(lengths)

    def step(rule, L):
        npattn_s, torch_s = _GUESS[rule]
        guess = (3 if L < longest else 2) * (npattn_s + (torch_s if with_torch else 0.0)) * L
        repeats = 1 if L == longest and L > 1024 else 2
        return Step(f"{rule} L={L}", guess, lambda: delta_one(L, rule=rule, repeats=repeats, use_torch=use_torch))

    steps = [step(rule, L) for rule in rules for L in lengths]
    return run_steps("delta", steps, progress=progress, note=lambda r: " ".join(_cells(r)))


def collect(quick=False, progress=True):
    return {"delta": delta_table(QUICK_LENGTHS if quick else LENGTHS, progress=progress)}


def _cells(r):
    """A row's cells: each side's milliseconds per 1000 steps, its time over the chunked form's, and
    the recurrence's and torch's largest relative difference to the chunked output."""
    if r is None or "error" in r:
        return ["error"] + ["-"] * 6
    ms, diff = r["ms_per_1k_steps"], r.get("max_rel_diff", {})
    cells = [f"{ms['chunked']:.1f}"]
    for side in ("recurrence", "torch"):
        cells += [f"{ms[side]:.1f}", f"{ms[side] / ms['chunked']:.1f}x"] if ms.get(side) else ["-", "-"]
    return cells + [f"{diff[side]:.1e}" if diff.get(side) is not None else "-" for side in ("recurrence", "torch")]


def format_delta(rows):
    """The sweep as text, a table per rule: per length, each side's seconds and the ratios to the
    chunked form (rows without a rule are the gated delta rule's)."""
    lines = []
    for rule in RULES:
        mine = [r for r in rows if (r or {}).get("rule", RULES[0]) == rule]
        if not mine:
            continue
        shape = next((r["shape"] for r in mine if r and "shape" in r), SHAPE)
        title, twin = _TITLES[rule]
        columns = [("L", ">"), ("chunked", ">"), ("recurrence", ">"), ("x", ">"), ("torch", ">"), ("x", ">")]
        columns += [("rec. diff", ">"), ("torch diff", ">")]
        lines.append(
            f"{title}, use_qk_l2norm (b={shape['b']}, h={shape['h']}, Dk=Dv={shape['D']}, float32), "
            "forward+backward, ms per 1000 steps (median of turns; flat in L when the work is "
            f"linear in L); x = time / chunked time; torch = transformers' {twin} with autograd; "
            "diff = largest relative difference of the output to the chunked one's:"
        )
        lines += table(columns, [[str(r["seq"] if r else "?")] + _cells(r) for r in mine])
    return "\n".join(lines)


def format_section(report):
    return ["", format_delta(report["delta"])] if report.get("delta") else []

"""The timing section (``npattn bench``): forward+backward of the main layers against torch.

Each case is timed as one forward and one backward producing the input gradient and every
parameter gradient: the median over several turns, npattn and torch taking turns after warm-up
(``runner.time_interleaved``); npattn's side runs in a child process that never imports torch
(``runner.Child``).  FLOP rates count the *useful* multiply-adds of the GEMMs (``cases.py``) and are
compared with numpy's own GEMM rate measured in the same run (``machine.gemm_peak``, a
``2048 x 2048`` matmul, at the start and again at the end, the better kept: one slow spell of a
shared machine would otherwise inflate every row's share of the peak).

The cases are the data below: ``TABLE`` (``QUICK`` for ``--quick``), each in float32 and float64.
The larger shapes are sections of their own, so that each takes about a minute at its default
size: ``--large`` (``LARGE``: GPT-2 small's block and MultiHeadAttention at L = 1024, both dtypes)
and ``--long`` (``LONG``: the memory-efficient core at L = 4096, its forward alone and forward +
JVP, float32, with the peak memory of each kernel).
"""

from __future__ import annotations

import numpy as np

from .cases import KINDS, SHORT
from .runner import BATCH_SECONDS, PAUSE, Step, fresh, run_steps, time_case, torch_or_none
from .text import fmt, shape_str, table

__all__ = [
    "SMALL",
    "GPT2",
    "SEQ1024",
    "MEM_EFF",
    "core_at",
    "TABLE",
    "QUICK",
    "DTYPES",
    "LARGE",
    "LARGE_QUICK",
    "LONG",
    "LONG_QUICK",
    "row",
    "collect",
    "COLUMNS",
    "format_row",
    "format_results",
    "format_section",
    "Extra",
    "LARGE_SECTION",
    "LONG_SECTION",
]


SMALL = dict(b=4, L=64, d=128, h=4)  # MHA(128, 4) and EncoderBlock(128, 4, 512) at batch 4, seq 64
GPT2 = dict(b=8, L=256, d=768, h=12)  # GPT-2 small's block at batch 8, seq 256
SEQ1024 = dict(b=2, L=1024, d=768, h=12)  # MultiHeadAttention at batch 2, seq 1024
MEM_EFF = dict(b=1, h=12, L=4096, E=64, impl="memory_efficient_attention")  # against torch's CPU flash kernel


def core_at(size):
    """The attention core's q, k, v sizes inside the module of ``size``."""
    return dict(b=size["b"], h=size["h"], L=size["L"], E=size["d"] // size["h"])


TABLE = [  # (kind in cases.KINDS, its sizes): the default section
    ("attention", core_at(SMALL)),
    ("attention", core_at(GPT2)),
    ("mha", SMALL),
    ("mha", GPT2),
    ("encoder", SMALL),
    ("demo", {}),
]
QUICK = [
    ("attention", dict(b=2, h=2, L=32, E=16)),
    ("mha", dict(b=2, L=32, d=32, h=4)),
    ("encoder", dict(b=2, L=32, d=32, h=4)),
    ("demo", dict(b=2, L=8, d=16, h=2, layers=1, d_ff=32)),
]
DTYPES = ("float32", "float64")
LARGE = [("mha", SEQ1024), ("encoder", GPT2)]  # --large, both dtypes
LARGE_QUICK = [("mha", dict(b=1, L=48, d=32, h=4)), ("encoder", dict(b=1, L=32, d=32, h=4))]
LONG = [  # --long, float32 (seconds per call: fewer turns)
    ("attention", MEM_EFF),  # also gives the peak memory of both kernels
    ("attention_jvp", dict(MEM_EFF, jvp=False)),  # forward mode at L = 4096: the forward alone ...
    ("attention_jvp", MEM_EFF),  # ... and forward + JVP (time and peak memory of each)
]
_TINY_MEM_EFF = dict(MEM_EFF, b=1, h=2, L=64, E=16)
LONG_QUICK = [
    ("attention", _TINY_MEM_EFF),
    ("attention_jvp", dict(_TINY_MEM_EFF, jvp=False)),
    ("attention_jvp", _TINY_MEM_EFF),
]


def row(kind, params, dtype, *, use_torch=True, peak=None, warmup=1, repeats=5, pause=PAUSE, own_process=False):
    """One timed case as a report row: seconds of each side, their ratio, GFLOP/s, the share of
    numpy's GEMM ``peak`` and the largest relative difference to torch's outputs and gradients."""
    built, times, facts = time_case(
        kind, params, dtype, use_torch=use_torch, own_process=own_process, warmup=warmup, repeats=repeats, pause=pause
    )
    flops = KINDS[kind].flops(**params)
    t_np, t_torch = times["npattn"], times.get("torch")
    return {
        "name": built.name,
        "shape": built.shape,
        "dtype": np.dtype(dtype).name,
        "npattn_s": t_np,
        "torch_s": t_torch,
        "ratio": (t_np / t_torch) if t_torch else None,
        "gflop": flops / 1e9,
        "npattn_gflops": flops / t_np / 1e9,
        "torch_gflops": (flops / t_torch / 1e9) if t_torch else None,
        "gemm_peak_gflops": peak,
        "fraction_of_gemm_peak": (flops / t_np / 1e9 / peak) if peak else None,
        **facts,
    }


def _guess(kind, params, dtype, repeats, pause, sides, own_process):
    """Rough seconds of one case (for the progress estimate): warm-up, check and turns of each side."""
    call = KINDS[kind].flops(**params) / (60e9 if dtype == "float32" else 30e9) + 2e-4  # 2 cores, AVX-512
    turn = pause + call + max(call, BATCH_SECONDS)
    return 0.3 + (1.0 if own_process else 0.0) + sides * (2 * call + repeats * turn)


def collect(
    quick=False, progress=True, use_torch=True, repeats=None, memory=None, *, cases=None, dtypes=DTYPES, title="timing"
):
    """Timed cases (default: ``TABLE``, or ``QUICK`` with ``quick``) in each of ``dtypes``:
    ``{"gemm_peak_gflops", "gemm_peak_samples", "gemm_n", "repeats", "results"}``.  ``memory``
    (default: not ``quick``) adds the peak extra MiB of the memory-efficient rows' kernels (float32)."""
    return _collect(quick, progress, use_torch, repeats, memory, cases=cases, dtypes=dtypes, title=title)


def _collect(quick, progress, use_torch, repeats, memory, *, cases, dtypes, title):
    """``collect``'s work (also the ``--large``/``--long`` sections', which do not go through the
    default section's entry point)."""
    from .machine import gemm_peaks

    memory = (not quick) if memory is None else memory
    repeats = repeats or (3 if quick else 5)
    pause = 0.0 if quick else PAUSE
    gemm_n = 512 if quick else 2048
    sides = 2 if use_torch and torch_or_none() is not None else 1
    peaks = {}

    def case_step(kind, params, dtype):
        def run():
            r = row(
                kind,
                params,
                dtype,
                use_torch=use_torch,
                peak=peaks["start"][dtype],
                repeats=repeats,
                pause=pause,
                own_process=not quick,
            )
            if (
                memory
                and params.get("impl") == MEM_EFF["impl"]
                and dtype == "float32"
                and kind in ("attention", "attention_jvp")
            ):
                r["npattn_extra_mib"] = fresh(kind, params).get("extra_mib")
                r["torch_extra_mib"] = fresh(kind, params, side="torch").get("extra_mib") if sides == 2 else None
            return r

        name = SHORT[params.get("impl", "scaled_dot_product_attention")] if kind.startswith("attention") else kind
        label = " ".join(x for x in (name, shape_str(_named(params)), dtype) if x)
        return Step(label, _guess(kind, params, dtype, repeats, pause, sides, not quick), run)

    steps = [Step("numpy GEMM peak", 1.0, lambda: peaks.__setitem__("start", gemm_peaks(gemm_n)))]
    cases = cases if cases is not None else (QUICK if quick else TABLE)
    steps += [case_step(kind, params, dt) for kind, params in cases for dt in dtypes]
    steps.append(Step("numpy GEMM peak again", 1.0, lambda: peaks.__setitem__("end", gemm_peaks(gemm_n))))
    results = [
        r
        for r in run_steps(title, steps, progress=progress, note=lambda r: format_row(r) if r else "")
        if r is not None
    ]
    best = {name: max(peaks["start"][name], peaks["end"][name]) for name in DTYPES}
    for r in results:
        r["gemm_peak_gflops"] = best[r["dtype"]]
        r["fraction_of_gemm_peak"] = r["npattn_gflops"] / best[r["dtype"]]
    return {
        "gemm_peak_gflops": best,
        "gemm_peak_samples": peaks,
        "gemm_n": gemm_n,
        "repeats": repeats,
        "results": results,
    }


def _named(params):
    """A case's sizes under the report's shape names (for the progress label)."""
    names = {
        "b": "batch",
        "h": "heads",
        "L": "seq",
        "E": "head_dim",
        "d": "d_model",
        "d_ff": "d_ff",
        "layers": "layers",
    }
    return {names[k]: v for k, v in params.items() if k in names}


COLUMNS = [
    ("op", "<"),
    ("shape", "<"),
    ("dtype", "<"),
    ("npattn ms", ">"),
    ("torch ms", ">"),
    ("ratio", ">"),
    ("GFLOP/s", ">"),
    ("torch", ">"),
    ("%peak", ">"),
    ("rel.diff", ">"),
]


def _cells(r):
    t, frac = r["torch_s"], r["fraction_of_gemm_peak"]
    return [
        r["name"],
        shape_str(r["shape"]),
        r["dtype"],
        f"{r['npattn_s'] * 1e3:.2f}",
        fmt(t and t * 1e3, ".2f"),
        fmt(r["ratio"], ".2f"),
        f"{r['npattn_gflops']:.1f}",
        fmt(r["torch_gflops"], ".1f"),
        fmt(frac and 100 * frac, ".0f") + ("%" if frac else ""),
        fmt(r.get("max_rel_diff_vs_torch"), ".1e"),
    ]


def format_row(r):
    """One row as a line (progress notes)."""
    return "  ".join(c for c in _cells(r))


def format_results(report):
    """The timing rows of ``report`` (or of one of its ``variants``) as lines of text."""
    lines = [
        f"numpy GEMM peak ({report.get('gemm_n', 2048)}^2 matmul, best at the start or end of this run): "
        + ", ".join(f"{k} {v:.1f} GFLOP/s" for k, v in report["gemm_peak_gflops"].items()),
        f"forward+backward (input and parameter gradients), median over {report['repeats']} interleaved turns"
        " (short calls: batches of consecutive calls);"
        " GFLOP/s count useful FLOPs (causal: visible pairs only); ratio = npattn / torch;"
        " 'fwd' / 'jvp' rows: the forward alone / forward + JVP (forward mode; torch has none on CPU)",
        "",
    ]
    lines += table(COLUMNS, [_cells(r) for r in report["results"]])
    for r in report["results"]:
        if r.get("npattn_extra_mib") is not None:
            lines.append(
                f"{r['name']} {shape_str(r['shape'])} {r['dtype']}: peak extra memory npattn "
                f"{r['npattn_extra_mib']:.0f} MiB, torch {fmt(r.get('torch_extra_mib'), '.0f')} MiB "
                "(one call as timed, above the inputs, a fresh process each)"
            )
    return lines


def format_section(report):
    """The section's lines in the full report (the variant, if any, after this machine's own)."""
    if "results" not in report:
        return []
    lines = ["", "this machine's own settings:"] + format_results(report)
    for var in report.get("variants") or []:
        lines += ["", f"VARIANT, not this machine's settings: {var['label']}"] + format_results(var)
    return lines


class Extra:
    """A timing section beyond the default table, with its own flag: ``cases`` (``quick_cases`` with
    ``--quick``) in ``dtypes``, ``repeats`` turns, reported under ``key`` with the table's columns."""

    def __init__(self, key, title, cases, quick_cases, dtypes=DTYPES, repeats=None):
        self.key, self.title, self.cases, self.quick_cases = key, title, cases, quick_cases
        self.dtypes, self.repeats = dtypes, repeats

    def collect(self, quick=False, progress=True, use_torch=True):
        """``{key: the section's report}`` (as ``collect``'s)."""
        cases = self.quick_cases if quick else self.cases
        repeats = None if quick else self.repeats
        return {
            self.key: _collect(
                quick, progress, use_torch, repeats, None, cases=cases, dtypes=self.dtypes, title=self.key
            )
        }

    def format_section(self, report):
        """The section's lines in the full report (none when it did not run)."""
        if self.key not in report:
            return []
        return ["", self.title + ":"] + format_results(report[self.key])


LARGE_SECTION = Extra(
    "large", "larger shapes (GPT-2 small's block, MultiHeadAttention at L = 1024)", LARGE, LARGE_QUICK
)
LONG_SECTION = Extra(
    "long",
    "long sequences (the memory-efficient core at L = 4096: forward+backward, the forward alone, forward + JVP)",
    LONG,
    LONG_QUICK,
    dtypes=("float32",),
    repeats=3,
)

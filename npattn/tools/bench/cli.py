"""``npattn bench``: choose the sections, collect their reports, print a table or JSON.

``SECTIONS`` is the list of sections, in the order the report shows them; each is a module with
``collect(quick, progress) -> dict`` (its entries of the JSON report) and ``format_section(report)
-> lines``.  The command line's flags (``--memory`` ...) come from this list.
"""

from __future__ import annotations

import json
import os
import sys
from typing import NamedTuple

from . import decode, decode_large, delta, families, memory, second_order, timing, window
from .machine import ENV_KEYS, SLOW_ENV, machine_info, probe_openblas_env
from .runner import call_in_child

__all__ = ["Section", "SECTIONS", "selected", "format_table", "timing_variant", "main"]


class Section(NamedTuple):
    name: str  # the flag --name and what the progress lines call it
    help: str
    module: object  # collect(quick, progress) and format_section(report)

    @property
    def dest(self) -> str:
        """The attribute argparse gives the flag ``--name`` (``second-order``: ``second_order``)."""
        return self.name.replace("-", "_")


SECTIONS = [
    Section("timing", "forward+backward timings of the main layers against torch (the default)", timing),
    Section(
        "large",
        "the timing table's larger shapes: GPT-2 small's block, MultiHeadAttention at L = 1024",
        timing.LARGE_SECTION,
    ),
    Section(
        "long",
        "the memory-efficient core at L = 4096: forward+backward, forward alone, forward + JVP, peak memory",
        timing.LONG_SECTION,
    ),
    Section("decode", "greedy decoding tokens/s of the book's GPT with and without the KV cache (and torch's)", decode),
    Section("memory", "peak memory of forward+backward of both attention cores against sequence length", memory),
    Section("window", "windowed attention (window=(256, 0)) of both cores against L = 1k ... 16k", window),
    Section(
        "delta",
        "the chunked delta rule (gated DeltaNet) against its recurrence and transformers' torch one, L = 256 ... 4096",
        delta,
    ),
    Section(
        "families",
        "CausalLM of each open-model family against transformers (eager): forward+backward and decoding tokens/s",
        families,
    ),
    Section(
        "second-order",
        "a Hessian-vector product against forward+backward (MHA, CausalLM.loss_hvp) and the memory-efficient "
        "core's backward_jvp memory at L = 4096 against its backward's",
        second_order,
    ),
    Section(
        "decode-large",
        "decoding a Qwen3-0.6B-shaped model (float32 and bfloat16 storage) against the GEMV bandwidth limit and "
        "transformers, prefill of 512 tokens, the peak memory of loading a bfloat16 checkpoint",
        decode_large,
    ),
]


def selected(args):
    """The sections named by ``args`` (``--timing``, ``--memory`` ...), or the timing section alone."""
    chosen = [s for s in SECTIONS if getattr(args, s.dest, False)]
    return chosen or [SECTIONS[0]]


def format_table(report):
    """The report as plain text: the machine, then each section present in it."""
    m = report["machine"]
    blas = ", ".join(
        f"{b['internal_api']} {b['version']} {b['architecture']} x{b['num_threads']}" for b in (m.get("blas") or [])
    )
    env = ", ".join(f"{k}={v}" for k, v in m["env"].items() if v is not None) or "none of " + ", ".join(ENV_KEYS)
    load, idle = m.get("loadavg"), m.get("idle_at_start")
    lines = [
        f"machine: {m['cpu']} ({m['cpus']} cpus); python {m['python']}, numpy {m['numpy']}"
        f"{' (' + blas + ')' if blas else ''}, torch {m['torch'] or 'not installed'}"
        f"{'' if m['torch_threads'] is None else ' (' + str(m['torch_threads']) + ' threads)'}",
        "cpu flags (SIMD): " + (" ".join(m.get("cpu_flags") or []) or "none found"),
        f"environment: {env}"
        + (f"; load average {load[0]:.2f}" if load else "")
        + (f", {100 * idle:.0f}% idle at start" if idle is not None else ""),
    ]
    probe = report.get("openblas_env_probe")
    if probe and "gemm_peak_gflops" in probe:
        p = probe["gemm_peak_gflops"]
        lines.append(
            "OpenBLAS probe, GEMM GFLOP/s with "
            + ", ".join(f"{k}={v}" for k, v in probe["vars"].items())
            + f": float32 {p['as_set']['float32']:.0f}, float64 {p['as_set']['float64']:.0f}; without: "
            f"float32 {p['unset']['float32']:.0f}, float64 {p['unset']['float64']:.0f}"
            + (" -> a variant section below, without them" if probe["unset"] else "")
        )
    for section in SECTIONS:
        lines += section.module.format_section(report)
    return "\n".join(lines)


def timing_variant(quick):
    """The timing section's report (in the variant child, see ``main``)."""
    return timing.collect(quick=quick, progress=True, memory=False)


def _variant(quick, probe):
    """The timing section again in a child process without ``SLOW_ENV``: a labelled variant."""
    print(
        f"numpy's GEMM is faster without {' and '.join(SLOW_ENV)}: the timing cases again, in a "
        "subprocess without them (a labelled variant)",
        file=sys.stderr,
    )
    variant = call_in_child("cli:timing_variant", {"quick": quick}, unset=SLOW_ENV, show_stderr=True)
    if "error" in variant:
        print(f"npattn bench: the variant subprocess failed ({variant['error']})", file=sys.stderr)
        return []
    variant["label"] = "without " + " and ".join(f"{k}={probe['vars'][k]}" for k in SLOW_ENV if probe["vars"].get(k))
    variant["unset"] = list(SLOW_ENV)
    return [variant]


def main(args):
    """``npattn bench [--json] [--quick] [--timing] [--decode] [--memory] [--window] ...``: run the chosen
    sections (default: timing), print the table (or the JSON report); progress goes to stderr.

    Everything is measured under this machine's own environment.  When its ``OPENBLAS_CORETYPE``/
    ``OPENBLAS_L2_SIZE`` are measured to slow numpy's GEMM (``probe_openblas_env``), the timing cases
    run a second time in a subprocess without them: ``report["variants"]``, a second labelled
    section.  Never with ``--quick`` or ``NPATTN_BENCH_KEEP_ENV=1``.
    """
    quick = bool(getattr(args, "quick", False))
    report: dict = {"machine": machine_info()}
    sections = selected(args)
    for section in sections:
        report.update(section.module.collect(quick=quick, progress=True))
    if SECTIONS[0] in sections:
        probe = None
        if not quick and os.environ.get("NPATTN_BENCH_KEEP_ENV") != "1":
            probe = probe_openblas_env(lambda msg: print(msg, file=sys.stderr, flush=True))
        report["openblas_env_probe"] = probe
        report["variants"] = _variant(quick, probe) if probe and probe.get("unset") else []
    print(json.dumps(report, indent=2) if getattr(args, "json", False) else format_table(report))
    return 0

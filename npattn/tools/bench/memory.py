"""The memory section (``npattn bench --memory``): peak memory of the two attention cores against L.

One forward+backward of ``scaled_dot_product_attention`` and of ``memory_efficient_attention``
(b=1, h=12, E=64, float32, causal) per sequence length, each in a fresh process
(``runner.fresh``): the peak resident memory (``VmHWM``) minus the process's resident size just
before the call (after numpy, npattn and the inputs are loaded).
"""

from __future__ import annotations

from .runner import Step, fresh, run_steps
from .text import table

__all__ = [
    "IMPLS",
    "SHAPE",
    "LENGTHS",
    "QUICK_LENGTHS",
    "memory_one",
    "memory_torch",
    "memory_table",
    "collect",
    "format_section",
]


IMPLS = ("scaled_dot_product_attention", "memory_efficient_attention")
SHAPE = dict(b=1, h=12, E=64)
LENGTHS = (512, 1024, 2048, 4096)
QUICK_LENGTHS = (256, 512)


def memory_one(impl, L):
    """Peak memory of one forward+backward of ``impl`` (a ``npattn.functional`` core) at sequence
    length ``L`` in a fresh process: ``{"impl", "seq", "peak_mib", "extra_mib", "seconds"}``
    (``missing: True`` when npattn has no such core, ``error`` when it failed)."""
    return {"impl": impl, "seq": L, **fresh("attention", dict(SHAPE, L=L, impl=impl))}


def memory_torch(L):  # pragma: needs torch
    """As ``memory_one`` for torch's ``F.scaled_dot_product_attention`` (its CPU flash kernel here)."""
    return {"impl": "torch", "seq": L, **fresh("attention", dict(SHAPE, L=L), side="torch")}


def _guess(L):
    return 0.6 + 3e-9 * 12 * L * L  # start-up, and the (L, L) scores of 12 heads


def memory_table(lengths=LENGTHS, progress=True):
    """Peak-memory rows of both cores at each length in ``lengths``."""
    steps = [
        Step(f"memory {impl} L={L}", _guess(L), lambda i=impl, L=L: memory_one(i, L)) for L in lengths for impl in IMPLS
    ]
    return run_steps("memory", steps, progress=progress, note=_note)


def _note(r):
    mib, seconds = _cells(r, ("extra_mib", "seconds"))
    return mib if mib in ("missing", "error") else f"{mib} MiB above the inputs, {seconds} s"


def collect(quick=False, progress=True):
    return {"memory": memory_table(QUICK_LENGTHS if quick else LENGTHS, progress)}


def _cells(r, keys):
    if r is None or r.get("missing"):
        return ["missing"] * len(keys)
    if "error" in r:
        return ["error"] * len(keys)
    return [format(r[k], ".0f" if k == "extra_mib" else ".2f") for k in keys]


def format_section(report):
    if not report.get("memory"):
        return []
    by: dict = {}
    for r in report["memory"]:
        by.setdefault(r["seq"], {})[r["impl"]] = r
    rows = []
    for L, d in sorted(by.items()):
        a, b = d.get(IMPLS[0]), d.get(IMPLS[1])
        mib = _cells(a, ("extra_mib",)) + _cells(b, ("extra_mib",))
        rows.append([str(L)] + mib + _cells(a, ("seconds",)) + _cells(b, ("seconds",)))
    columns = [("L", ">"), ("sdpa MiB", ">"), ("mem-eff MiB", ">"), ("sdpa s", ">"), ("mem-eff s", ">")]
    return [
        "",
        "peak memory of forward+backward (b=1, h=12, E=64, float32, causal): MiB above the inputs, seconds",
    ] + table(columns, rows)

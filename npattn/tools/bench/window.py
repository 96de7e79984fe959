"""The window section (``npattn bench --window``): windowed attention against sequence length.

``window=(256, 0)``, causal, b=1, h=4, E=64, float32, both cores, L = 1k ... 16k (``--quick``:
256 ... 1024): the best of 2 forward+backward runs in a fresh process (``runner.fresh``):
seconds, milliseconds per 1000 query rows (constant when the work is linear in L) and peak extra
MiB.  A core without the ``window`` option is reported as missing.
"""

from __future__ import annotations

from .memory import IMPLS
from .runner import Step, fresh, run_steps
from .text import table

__all__ = [
    "WINDOW",
    "WINDOW_SHAPE",
    "LENGTHS",
    "QUICK_LENGTHS",
    "window_one",
    "window_table",
    "collect",
    "format_window",
    "format_section",
]


WINDOW = (256, 0)
WINDOW_SHAPE = {"batch": 1, "heads": 4, "head_dim": 64}
LENGTHS = (1024, 2048, 4096, 8192, 16384)
QUICK_LENGTHS = (256, 512, 1024)


def window_one(impl, L, window=WINDOW, heads=WINDOW_SHAPE["heads"], head_dim=WINDOW_SHAPE["head_dim"], repeats=2):
    """The best of ``repeats`` windowed, causal forward+backward runs of ``impl`` (b=1, float32) at
    sequence length ``L`` and the peak memory above the inputs, in a fresh process:
    ``{"impl", "seq", "seconds", "ms_per_1k_rows", "extra_mib"}`` (``missing: True`` when
    ``impl`` has no ``window`` option)."""
    params = dict(b=1, h=heads, L=L, E=head_dim, impl=impl, window=list(window))
    r = fresh("attention", params, repeats=repeats)
    if "seconds" in r:
        r = {"seconds": r["seconds"], "ms_per_1k_rows": 1e6 * r["seconds"] / L, "extra_mib": r["extra_mib"]}
    return {"impl": impl, "seq": L, **r}


def window_table(lengths=LENGTHS, window=WINDOW, progress=True, repeats=2):
    """Windowed attention against sequence length, both cores: with the work limited to the band,
    time and memory per query row stay roughly constant (linear in ``L``)."""
    steps = [
        Step(
            f"window {tuple(window)} {impl} L={L}",
            0.6 + repeats * 2.5e-5 * L,
            lambda i=impl, L=L: window_one(i, L, window, repeats=repeats),
        )
        for L in lengths
        for impl in IMPLS
    ]
    return run_steps("window", steps, progress=progress, note=_note)


def _note(r):
    seconds, per_rows, mib = _cells(r)
    return seconds if mib == "-" else f"{seconds} s, {per_rows} ms per 1000 rows, {mib} MiB"


def collect(quick=False, progress=True):
    return {"window": window_table(QUICK_LENGTHS if quick else LENGTHS, progress=progress)}


def _cells(r):
    if r is None or r.get("missing"):
        return ["missing", "-", "-"]
    if "error" in r:
        return ["error", "-", "-"]
    return [f"{r['seconds']:.2f}", f"{r['ms_per_1k_rows']:.1f}", f"{r['extra_mib']:.0f}"]


def format_window(rows, window=WINDOW):
    """The windowed sweep as text: per core, seconds, milliseconds per 1000 query rows, MiB."""
    shape = WINDOW_SHAPE
    by: dict = {}
    for r in rows:
        by.setdefault(r["seq"], {})[r["impl"]] = r
    columns = [("L", ">"), ("sdpa s", ">"), ("ms/1k rows", ">"), ("MiB", ">")]
    columns += [("mem-eff s", ">"), ("ms/1k rows", ">"), ("MiB", ">")]
    lines = [
        f"windowed attention, window={tuple(window)}, causal (b={shape['batch']}, h={shape['heads']}, "
        f"E={shape['head_dim']}, float32), forward+backward in a fresh process, best of 2:"
    ]
    lines += table(
        columns, [[str(L)] + _cells(d.get(IMPLS[0])) + _cells(d.get(IMPLS[1])) for L, d in sorted(by.items())]
    )
    return "\n".join(lines)


def format_section(report):
    return ["", format_window(report["window"])] if report.get("window") else []

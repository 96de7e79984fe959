"""What the numbers were measured on: the machine, its BLAS, how busy it was, numpy's GEMM rate,
and the OpenBLAS environment probe.

Environment: the numbers are measured under this machine's own BLAS settings, always.  Some
machines set ``OPENBLAS_CORETYPE`` (e.g. forcing OpenBLAS's Haswell/AVX2 kernels on a CPU that has
AVX-512) and ``OPENBLAS_L2_SIZE``; when they are set, ``probe_openblas_env`` measures numpy's GEMM
peak with and without them (fresh subprocesses, this process's environment untouched) and the
timing section then runs a second time without them when that is faster: a second, labelled
section, never the default.
"""

from __future__ import annotations

import ctypes
import math
import os
import platform
import time

import numpy as np

from .._blas import openblas_functions
from .runner import call_in_child, torch_or_none

__all__ = ["ENV_KEYS", "SLOW_ENV", "SIMD_FLAGS", "gemm_peak", "gemm_peaks", "machine_info", "probe_openblas_env"]


ENV_KEYS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")
SLOW_ENV = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
SIMD_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "asimd",
    "sve",
)


def gemm_peak(dtype, n=2048, repeats=5):
    """numpy's GEMM rate in GFLOP/s: the best of ``repeats`` ``(n, n) @ (n, n)`` into a buffer, the
    ceiling of anything built on it."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n)).astype(dtype)
    b = rng.standard_normal((n, n)).astype(dtype)
    c = np.empty((n, n), dtype)
    np.matmul(a, b, out=c)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.matmul(a, b, out=c)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best / 1e9


def gemm_peaks(n=2048):
    """``gemm_peak`` of float32 and float64, by dtype name."""
    return {d: gemm_peak(d, n=n) for d in ("float32", "float64")}


def _blas_info():
    """The BLAS numpy uses: name, version, kernel core type, threads (threadpoolctl when installed,
    else OpenBLAS's own ``get_config``/``get_corename``/``get_num_threads``)."""
    try:
        import threadpoolctl
    except ImportError:
        threadpoolctl = None
    if threadpoolctl is not None:
        found = [
            {k: i.get(k) for k in ("internal_api", "architecture", "num_threads", "version")}
            for i in threadpoolctl.threadpool_info()
            if i.get("user_api") == "blas"
        ]
        if found:
            return found
    fns = openblas_functions("get_config", "get_corename", "get_num_threads")
    if fns is None:
        return None
    fns[0].restype = fns[1].restype = ctypes.c_char_p
    fns[2].restype = ctypes.c_int
    config = fns[0]().decode(errors="replace")
    words = config.split()
    return [
        {
            "internal_api": "openblas",
            "version": words[1] if len(words) > 1 else None,
            "architecture": fns[1]().decode(errors="replace"),
            "num_threads": fns[2](),
            "config": config,
        }
    ]


def _cpu_flags():
    """The CPU's SIMD flags that matter to a GEMM kernel (Linux ``/proc/cpuinfo``; [] elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    have = set(line.split(":", 1)[1].split())
                    return [flag for flag in SIMD_FLAGS if flag in have]
    except OSError:
        pass
    return []


def _idle_fraction(seconds=0.5):
    """Fraction of all CPUs' time spent idle over ``seconds`` (Linux ``/proc/stat``; None elsewhere)."""

    def snap():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return v[3] + v[4], sum(v)

    try:
        i0, t0 = snap()
        time.sleep(seconds)
        i1, t1 = snap()
    except (OSError, ValueError, IndexError):
        return None
    return (i1 - i0) / max(t1 - t0, 1)


def _cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(use_torch=True):
    """Versions, CPU, the OpenBLAS kernel in use, the relevant environment and how busy the machine is."""
    torch = torch_or_none() if use_torch else None
    return {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": torch.__version__ if torch is not None else None,
        "torch_threads": torch.get_num_threads() if torch is not None else None,
        "cpu": _cpu_name(),
        "cpus": os.cpu_count(),
        "cpu_flags": _cpu_flags(),
        "blas": _blas_info(),
        "env": {k: os.environ.get(k) for k in ENV_KEYS},
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "idle_at_start": _idle_fraction(),
    }


def probe_openblas_env(progress=None):
    """numpy's GEMM peak with this machine's ``OPENBLAS_CORETYPE``/``OPENBLAS_L2_SIZE`` and with both
    unset, each in a fresh subprocess (OpenBLAS reads them when it loads).  None when neither is
    set; else a dict with both peaks and ``unset``: True when the run without them is faster by
    more than 10% in both float32 and float64."""
    if not any(os.environ.get(k) for k in SLOW_ENV):
        return None
    peaks = {}
    for label, unset in (("as_set", ()), ("unset", SLOW_ENV)):
        if progress:
            progress(f"numpy GEMM peak with the OpenBLAS variables {label.replace('_', ' ')}")
        r = call_in_child("machine:gemm_peaks", unset=unset)
        if "error" in r:
            return {"error": r["error"], "unset": False}
        peaks[label] = r
    faster = all(peaks["unset"][d] > 1.1 * peaks["as_set"][d] for d in peaks["as_set"])
    return {"vars": {k: os.environ.get(k) for k in SLOW_ENV}, "gemm_peak_gflops": peaks, "unset": faster}

"""The OpenBLAS that numpy loaded, reached directly (read-only: its configuration, never its settings).

``openblas_functions(*names)``: those functions of the first loaded OpenBLAS that has them all,
whatever prefix and suffix its build uses (``scipy_openblas_...64_``, ``openblas_...64_``, plain).
``single_thread_gemm_mnk()``: the largest ``m * n * k`` of a product numpy's BLAS is known to run
on the calling thread (the block sizes of ``functional.memory_efficient`` stay under it).
"""

from __future__ import annotations

import ctypes
import functools

__all__ = ["openblas_functions", "single_thread_gemm_mnk"]

_PREFIXES = (("scipy_openblas_", "64_"), ("openblas_", "64_"), ("openblas_", ""))


def _loaded_openblas_paths():
    try:
        with open("/proc/self/maps") as f:
            return sorted({line.split()[-1] for line in f if "openblas" in line.lower() and "/" in line})
    except OSError:
        return []


def openblas_functions(*names):
    """``[f_1, ...]`` for OpenBLAS's ``get_config``-style ``names`` (without prefix and suffix) in the
    OpenBLAS numpy loaded (found in ``/proc/self/maps``), or None (another BLAS, or not Linux)."""
    for path in _loaded_openblas_paths():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix, suffix in _PREFIXES:
            fns = [getattr(lib, f"{prefix}{name}{suffix}", None) for name in names]
            if all(fn is not None for fn in fns):
                return fns
    return None


# OpenBLAS runs a GEMM on its own threads once m*n*k > SMP_THRESHOLD_MIN * GEMM_MULTITHREAD_THRESHOLD
# (65536 * 4), unless its small-matrix kernels take the product first: the cores below have them
# (kernel/x86_64/KERNEL.SKYLAKEX, which Cooperlake and Sapphire Rapids include), and take products
# up to 100^3 multiply-adds.  Measured on such a core (AVX-512 Zen 4, OpenBLAS 0.3.31 DYNAMIC_ARCH:
# SkylakeX; calling-thread vs process CPU time, each shape after a pause so that no earlier product's
# threads still spin): products of 240 x 64 x 65 (998400; A @ B, A^T @ B, A @ B with strided rows,
# float32 and float64) stay on the calling thread, 256 x 64 x 65 (1064960) and 128 x 128 x 65 do not.
_THREADED_ABOVE = 1 << 18
_SMALL_KERNEL_ABOVE = 100**3
_SMALL_KERNEL_CORES = ("skylakex", "cooperlake", "sapphirerapids")


@functools.lru_cache(maxsize=None)
def single_thread_gemm_mnk() -> int:
    """``100**3`` when numpy's BLAS is an OpenBLAS whose core (``openblas_get_corename``) has the
    small-matrix kernels, else ``1 << 18`` (OpenBLAS's threading threshold; the conservative answer
    for any other BLAS or when the core cannot be read).  Fixed for the process (the core is)."""
    fns = openblas_functions("get_corename")
    if fns is None:
        return _THREADED_ABOVE
    get_corename = fns[0]
    get_corename.restype = ctypes.c_char_p
    try:
        core = (get_corename() or b"").decode("ascii", "replace").strip().lower()
    except (OSError, ValueError):  # pragma: no cover - a foreign library under the name
        return _THREADED_ABOVE
    return _SMALL_KERNEL_ABOVE if core in _SMALL_KERNEL_CORES else _THREADED_ABOVE

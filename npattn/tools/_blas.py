"""The OpenBLAS that numpy loaded, reached directly (for the tools only; threadpoolctl when installed).

``openblas_functions(*names)``: those functions of the first loaded OpenBLAS that has them all,
whatever prefix and suffix its build uses (``scipy_openblas_...64_``, ``openblas_...64_``, plain).
``single_blas_thread()``: a context with one BLAS thread.
"""

from __future__ import annotations

import contextlib
import ctypes

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


@contextlib.contextmanager
def single_blas_thread():
    """Run the block with one BLAS thread (best effort: threadpoolctl if installed, else the
    OpenBLAS numpy ships with, else nothing).

    The demos' matrices are tiny (at most 1024 x 256): a second BLAS thread saves little on an
    idle machine and, when the cores are busy with anything else, its spin-waiting makes every
    product 10 to 20 times slower.
    """
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        fns = openblas_functions("get_num_threads", "set_num_threads")
        if fns is None:
            yield
            return
        get, set_ = fns
        get.restype, set_.argtypes = ctypes.c_int, [ctypes.c_int]
        before = get()
        set_(1)
        try:
            yield
        finally:
            set_(before)
    else:
        with threadpool_limits(limits=1, user_api="blas"):
            yield

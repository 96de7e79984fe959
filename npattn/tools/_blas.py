"""The OpenBLAS that numpy loaded, for the tools (threadpoolctl when installed).

``openblas_functions(*names)``: ``npattn._blas``'s (the functions of the loaded OpenBLAS by their
unprefixed names), re-exported for the bench.  ``single_blas_thread()``: a context with one BLAS thread.
"""

from __future__ import annotations

import contextlib
import ctypes

from .._blas import openblas_functions

__all__ = ["openblas_functions", "single_blas_thread"]


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

"""bfloat16 storage: weights kept as their 16 bits, used as float32.

A bfloat16 is the upper half of a float32 (1 sign, 8 exponent, 7 mantissa bits), so a weight
matrix kept as ``uint16`` bit patterns holds half the bytes of its float32 form and widens
exactly::

    float32 bits = uint32(bfloat16 bits) << 16          (the lower 16 mantissa bits are 0)

NumPy has no bfloat16 dtype, and its own float16 conversion would be slow and wrong here (float16
is another format), so the widening is written with integer shifts, ``(bits.astype(np.uint32) <<
16).view(np.float32)``, into a reused buffer.

``BFloat16Array`` is what a ``Parameter`` holds as ``.data`` when a model was loaded with
``weights_dtype="bfloat16"``.  It is not an ndarray, on purpose: code that would do arithmetic on
the raw ``uint16`` bits (and silently compute with integers) cannot; every NumPy function that
takes it converts it through ``__array__`` to the exact float32 values (a new array), indexing
(``w[ids]``, ``w[e]``) widens the selected rows or experts only, and Python operators it does not
define (``w + 1``, ``w.T``) raise ``TypeError``/``AttributeError``.  The fast path is
``matmul_t``: ``linear``'s kernel computes ``x @ W.T`` block by block, each block of rows of
``W`` widened into a buffer of about 2 MB that stays in the cache and is reused by every call,
so a matrix-vector product (decoding) reads 2 bytes per weight from memory instead of 4.

Rounding to bfloat16 (``to_bfloat16_bits``) is round-to-nearest-even, as torch's
``tensor.to(torch.bfloat16)`` (c10's ``round_to_nearest_even``): add ``0x7FFF`` plus the lowest
kept bit, drop the 16 low bits; a NaN becomes ``0xFFFF`` (a NaN), as torch's tensor conversion
(its vectorised ``cvtfp32_bf16``) writes every NaN.
"""

from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

__all__ = ["BFloat16Array", "to_bfloat16_bits", "widen_into", "widened", "matmul_t"]

_CHUNK = 1 << 20  # elements rounded at a time (bounds the uint32 temporaries)
BLOCK = 1 << 19  # float32 elements of one widened block of rows in matmul_t (2 MB)
# n * in * rows of a decoding block: below OpenBLAS's threading threshold for a GEMM
# (SMP_THRESHOLD_MIN * GEMM_MULTITHREAD_THRESHOLD = 65536 * 4), so each product stays on its thread
GEMV_ELEMS = 196608
PAIR_ELEMS = 1 << 19  # float32 elements of one block of rows when decoding (_pairs_into)
# OpenBLAS runs a matrix-vector product of fewer than 2304 * GEMM_MULTITHREAD_THRESHOLD (4) elements
# on the calling thread (interface/gemv.c); larger ones start its own threads
SMALL_GEMV = 9216
_HIGH, _SIXTEEN = np.uint32(0xFFFF0000), np.uint32(16)
_local = threading.local()


def to_bfloat16_bits(x, out: np.ndarray | None = None) -> np.ndarray:
    """The bfloat16 bit patterns (``uint16``) of ``x``'s values rounded to nearest even, as
    torch's ``.to(torch.bfloat16)``; ``x`` is read as float32 (float64 is rounded to float32
    first, as torch does).  ``out``: a C-contiguous ``uint16`` array of ``x``'s shape to write
    into.  Works ``_CHUNK`` elements at a time, so no full-size temporary is made.

    Examples
    --------
    >>> import numpy as np
    >>> from npattn.functional._bfloat16 import to_bfloat16_bits
    >>> [hex(b) for b in to_bfloat16_bits(np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, np.nan], np.float32))]
    ['0x3f80', '0x3f80', '0x3f82', '0xffff']
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    if out is None:
        out = np.empty(x.shape, np.uint16)
    elif out.dtype != np.uint16 or out.shape != x.shape or not out.flags.c_contiguous:
        raise ValueError(f"out: expected a C-contiguous uint16 array of shape {x.shape}, got {out.dtype} {out.shape}")
    flat_in, flat_out = x.reshape(-1).view(np.uint32), out.reshape(-1)
    for i in range(0, flat_in.size, _CHUNK):
        c = flat_in[i : i + _CHUNK]
        r = (c + (np.uint32(0x7FFF) + ((c >> 16) & np.uint32(1)))) >> 16  # a NaN's sum may wrap: replaced below
        r[(c & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)] = 0xFFFF
        flat_out[i : i + _CHUNK] = r
    return out


def widen_into(bits: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out[...] = (bits.astype(np.uint32) << 16).view(np.float32)`` without a temporary:
    ``out`` (float32, ``bits``' shape, C-contiguous) seen as ``uint32`` takes the bits, then
    shifts them in place.  Exact.  Returns ``out``."""
    u = out.view(np.uint32)
    np.copyto(u, bits, casting="safe")
    u <<= 16
    return out


def widened(bits: np.ndarray) -> np.ndarray:
    """``bits`` as a new float32 array (exact)."""
    return widen_into(bits, np.empty(np.shape(bits), np.float32))


def _buffer(size: int) -> np.ndarray:
    """The calling thread's reused float32 scratch of at least ``size`` elements (flat)."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.size < size:
        buf = _local.buf = np.empty(max(size, BLOCK), np.float32)
    return buf


def _threads() -> int:
    """How many threads the decoding product splits its rows over: the BLAS's own setting where
    the environment gives one (``OPENBLAS_NUM_THREADS``, ``OMP_NUM_THREADS``), else the CPUs this
    process may run on."""
    for key in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        value = os.environ.get(key, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


_pool: list = []  # [ThreadPoolExecutor, its size, the process it was made in], made on first use


def _executor(n: int) -> ThreadPoolExecutor:
    """The pool of ``n`` threads; made again in a forked child (whose copy has no threads)."""
    if not _pool or _pool[1] != n or _pool[2] != os.getpid():
        if _pool and _pool[2] == os.getpid():
            _pool[0].shutdown(wait=False)
        _pool[:] = [ThreadPoolExecutor(n, thread_name_prefix="npattn-bf16"), n, os.getpid()]
    return _pool[0]


def _rows_into(x2: np.ndarray, bits: np.ndarray, y: np.ndarray, lo: int, hi: int, r: int) -> None:
    """``y[:, lo:hi] = x2 @ widened(bits[lo:hi]).T``, ``r`` rows of ``bits`` widened at a time into
    this thread's buffer.  One row of ``x2`` (decoding) goes through ``_pairs_into``; more rows
    make one BLAS call per block."""
    n, cols = x2.shape
    if n == 1 and _pairs_fit(bits):
        r = max(r, PAIR_ELEMS // cols)
        return _pairs_into(x2[0], bits, y[0], [(i, min(r, hi - i)) for i in range(lo, hi, r)])
    buf = _buffer(r * cols)
    for i in range(lo, hi, r):
        k = min(r, hi - i)
        y[:, i : i + k] = x2 @ widen_into(bits[i : i + k], buf[: k * cols].reshape(k, cols)).T


def _pairs_fit(bits: np.ndarray) -> bool:
    """Whether ``bits``' rows can be read as pairs of bfloat16s (``_pairs_into``)."""
    cols = bits.shape[1]
    return cols % 2 == 0 and bits.strides[-1] == 2 and bits.strides[0] == 2 * cols


def _pairs_into(x: np.ndarray, bits: np.ndarray, y: np.ndarray, blocks) -> None:
    """``y[i:i+k] = widened(bits[i:i+k]) @ x`` for each block ``(i, k)`` of ``blocks`` and one
    vector ``x`` (decoding), in one pass per half.  Two neighbouring bfloat16s ``a = bits[i, 2j]``,
    ``b = bits[i, 2j+1]`` are the two halves of one little-endian ``uint32`` ``p = b << 16 | a``, so::

        float32 of b = p & 0xFFFF0000        float32 of a = p << 16

    Each block of rows becomes two contiguous matrices, the b's and the a's (each pass writes one
    array straight through: twice the speed of interleaved halves), and ``y = b's @ x_odd + a's @
    x_even``: the same products as ``widened(bits) @ x``, summed in another order (float32 rounding
    apart, the same dot products).  The products go through ``_gemv_into``'s matrices, both halves
    in one ``np.matmul`` where the block is whole ``g``-row matrices.  ``blocks`` may be an
    iterator the pool's threads share (each takes the next block: ``_split``)."""
    half = bits.shape[1] // 2
    p = bits.view(np.uint32)  # (rows, cols / 2)
    xs = np.empty((2, half), np.float32)
    xs[0], xs[1] = x[1::2], x[0::2]  # the b's vector, the a's
    x4 = xs.reshape(2, 1, half, 1)
    views: dict = {}  # block height -> this thread's scratch seen as that block's arrays
    for i, k in blocks:
        b, a, f, yy, stacked = views.get(k) or views.setdefault(k, _pair_views(k, half))
        pk = p[i : i + k]
        np.bitwise_and(pk, _HIGH, out=b)
        np.left_shift(pk, _SIXTEEN, out=a)
        if stacked:  # (2, m / g, g, half) @ (2, 1, half, 1): _gemv_into's products of both halves, one call
            np.matmul(stacked[0], x4, out=stacked[1])
            m = stacked[0].shape[1] * stacked[0].shape[2]
            if m < k:  # _gemv_into's last rows: NumPy's own loop
                np.einsum("ij,j->i", f[0, m:], xs[0], out=yy[0, m:])
                np.einsum("ij,j->i", f[1, m:], xs[1], out=yy[1, m:])
        else:
            _gemv_into(f[0], xs[0], yy[0])
            _gemv_into(f[1], xs[1], yy[1])
        np.add(yy[0], yy[1], out=y[i : i + k])


def _pair_views(k: int, half: int) -> tuple:
    """This thread's scratch for a block of ``k`` rows of ``half`` pairs: ``(b, a, f, yy, stacked)``,
    ``b`` and ``a`` the b's and a's (``uint32 (k, half)`` each), ``f`` both as float32 ``(2, k,
    half)``, ``yy`` their products (``(2, k)``), ``stacked`` the first ``m = k // g * g`` rows of
    ``f`` and ``yy`` as ``_gemv_into``'s stacks of ``g``-row matrices (empty where it cuts the
    rows into segments or ``m`` is 0)."""
    buf = _buffer(2 * k * half + 2 * k)
    f, yy = buf[: 2 * k * half].reshape(2, k, half), buf[2 * k * half : 2 * k * half + 2 * k].reshape(2, k)
    g, n = _group(half)
    m = k // g * g
    stacked = (f[:, :m].reshape(2, m // g, g, half), yy[:, :m].reshape(2, m // g, g, 1)) if n == 1 and m else ()
    u = f.view(np.uint32)
    return u[0], u[1], f, yy, stacked


def _group(c: int) -> tuple:
    """``(g, n)`` of ``_gemv_into`` for rows of ``c`` values: ``g`` rows a matrix, each row cut into
    ``n`` segments (``n = 1``: whole rows)."""
    if c < SMALL_GEMV and ((SMALL_GEMV - 1) // c).bit_length() >= 3:  # a power of 2, at least 4, rows a matrix
        return 1 << ((SMALL_GEMV - 1) // c).bit_length() - 1, 1
    return 8, next(n for n in range(1, c + 1) if c % n == 0 and 8 * (c // n) < SMALL_GEMV)


def _gemv_into(a: np.ndarray, x: np.ndarray, y: np.ndarray) -> None:
    """``y = a @ x`` for a C-contiguous ``a (k, c)`` (float32), as BLAS matrix-vector products
    small enough (``g * c < SMALL_GEMV`` elements each) that OpenBLAS runs each on the calling
    thread: one ``np.matmul`` over a stack of ``g``-row matrices (NumPy loops over the stack in C).
    The pool's threads each run their own products side by side; a larger product would start the
    BLAS's own threads from every pool thread at once (measured: half the speed), and NumPy's own
    loop (``einsum``) reads the cache at a third of the BLAS's speed.  Rows of more than
    ``SMALL_GEMV / 4`` values are cut into ``n`` segments of ``c / n`` (``y`` sums the segments'
    products: 8-row matrices either way).  A block of rows leaves none over when ``k`` is a
    multiple of ``g`` (a power of 2)."""
    k, c = a.shape
    g, n = _group(c)
    if n == 1:  # whole rows
        m = k // g * g
        np.matmul(a[:m].reshape(m // g, g, c), x, out=y[:m].reshape(m // g, g))
    else:  # 8-row matrices of one segment of each row
        m = k // g * g if c // n >= 64 else 0  # no short segments (a prime c): NumPy's loop below
        parts = np.matmul(a[:m].reshape(m // g, g, n, c // n).transpose(0, 2, 1, 3), x.reshape(n, c // n, 1))
        np.add.reduce(parts[..., 0], axis=1, out=y[:m].reshape(m // g, g))
    if m < k:  # the last rows (fewer than g): NumPy's own loop
        np.einsum("ij,j->i", a[m:], x, out=y[m:])


def matmul_t(x2: np.ndarray, w: BFloat16Array, out: np.ndarray | None = None) -> np.ndarray:
    """``x2 (n, in) @ w.T`` in float32 for ``w (out, in)`` kept as bfloat16: each block of ``w``'s
    rows is widened into a reused per-thread buffer and multiplied (one BLAS call per block), so
    ``w`` is never widened whole.  ``out``: an ``(n, out)`` float32 C-contiguous array to write into.

    Decoding (``n * in * rows of a block`` below ``GEMV_ELEMS``): ``_threads()`` threads (this one
    and a pool) widen and multiply the blocks of rows, one vector taking them one by one from a
    shared list (``_blocks``, ``_pairs_into``), more rows a share each (``_split``), so that the
    widening, NumPy's and one core per call, runs on every core.  Larger ``n`` (a prompt): blocks
    of ``BLOCK`` elements on the calling thread, each product a GEMM the BLAS threads itself."""
    bits = w.bits
    rows, cols = bits.shape
    y = np.empty((x2.shape[0], rows), np.float32) if out is None else out
    if not _split(x2, bits, y):
        _rows_into(x2, bits, y, 0, rows, max(1, min(rows, BLOCK // max(cols, 1))))
    return y


@functools.lru_cache(maxsize=256)
def _blocks(rows: int, cols: int, threads: int) -> tuple:
    """The blocks ``(i, k)`` of one vector's product (``_split``): the rows cut into ``threads``
    shares and each share into blocks of ``r`` rows, the power of 2 at or above ``max(GEMV_ELEMS,
    PAIR_ELEMS) / cols``, as one thread a share would take them (which rows go through which
    products does not depend on the thread that takes a block).  A power of 2 is a multiple of
    ``_group``'s ``g``, so that every row of a block goes through the stacked products, and divides
    a share of a power-of-2 height into whole blocks: Qwen3-0.6B's down projection (3072 columns)
    cut into 170 rows left 2 rows a share to NumPy's own loop and read its weights at 7.5 GB/s in a
    decoding step on the machine of issue 32; 256 rows, 10.0."""
    share, r = -(-rows // threads), 1 << ((max(GEMV_ELEMS, PAIR_ELEMS) - 1) // cols).bit_length()
    return tuple(
        (i, min(r, hi - i)) for lo in range(0, rows, share) for hi in [min(rows, lo + share)] for i in range(lo, hi, r)
    )


def _split(x2: np.ndarray, bits: np.ndarray, y: np.ndarray) -> bool:
    """``y = x2 @ widened(bits).T`` over the pool, when decoding (see ``matmul_t``); False
    (nothing done) otherwise.  One vector: every thread takes the next block of ``_blocks``
    until none is left (a thread that starts late or that the machine keeps waiting takes
    fewer: nobody waits for a share), and a pool job not started when this thread is done is
    cancelled.  More rows: shares of rows, one a thread."""
    rows, cols = bits.shape
    n = x2.shape[0]
    r = GEMV_ELEMS // max(cols * n, 1)
    threads = _threads()
    if r < 16 or threads < 2 or rows < 4 * r:
        return False
    pool = _executor(threads - 1)
    if n == 1 and _pairs_fit(bits):
        # one iterator the threads share: a tuple iterator's next is one step under the GIL (and
        # without it, a race could hand a block out twice, both writing the same values, never skip one)
        blocks = iter(_blocks(rows, cols, threads))
        jobs = [pool.submit(_pairs_into, x2[0], bits, y[0], blocks) for _ in range(threads - 1)]
        _pairs_into(x2[0], bits, y[0], blocks)
        jobs = [job for job in jobs if not job.cancel()]  # a job not started has no block left to take
    else:
        share = -(-rows // threads)
        starts = range(0, rows, share)
        jobs = [pool.submit(_rows_into, x2, bits, y, lo, min(rows, lo + share), r) for lo in starts[1:]]
        _rows_into(x2, bits, y, 0, min(rows, share), r)  # the first share on this thread, the others in the pool
    for job in jobs:
        job.result()
    return True


class BFloat16Array:
    """A float32 array kept as bfloat16 bits (``bits``, ``uint16``): half the bytes, used as float32.

    ``shape``, ``ndim``, ``size`` are the array's; ``nbytes`` its stored bytes (``bits.nbytes``);
    ``dtype`` float32, the dtype of its values wherever they are used.  ``np.asarray(a)`` (and any
    NumPy function given ``a``) is the exact float32 array, a new one; ``a[index]`` widens the
    indexed part only (embedding rows, one expert); ``a.part(index)`` and ``a.reshape(...)`` are
    ``BFloat16Array`` views of the same bits; ``a.astype(dtype)`` the values in ``dtype``.  NumPy
    ufuncs (``x @ a``, ``np.add(a, 1)``) compute on those values; Python's operators on ``a``
    itself (``a + 1``, ``a.T``) and item assignment are not defined (see the module docstring).

    Examples
    --------
    >>> import numpy as np
    >>> from npattn.functional._bfloat16 import BFloat16Array, to_bfloat16_bits
    >>> a = BFloat16Array(to_bfloat16_bits(np.array([[1.0, -2.5], [3.0, 0.1]])))
    >>> a.shape, a.nbytes, np.asarray(a)[1, 1]
    ((2, 2), 8, 0.100097656)
    >>> a[1]
    array([3.       , 0.10009766], dtype=float32)
    """

    __slots__ = ("bits", "base")
    dtype = np.dtype(np.float32)

    def __init__(self, bits: np.ndarray, base: BFloat16Array | None = None):
        if not isinstance(bits, np.ndarray) or bits.dtype != np.uint16:
            got = bits.dtype if isinstance(bits, np.ndarray) else type(bits).__name__
            raise TypeError(f"bits: expected a uint16 ndarray of bfloat16 bit patterns, got {got}")
        self.bits, self.base = bits, base

    shape = property(lambda self: self.bits.shape, doc="The array's shape.")
    ndim = property(lambda self: self.bits.ndim, doc="The number of axes.")
    size = property(lambda self: self.bits.size, doc="The number of values.")
    nbytes = property(lambda self: self.bits.nbytes, doc="The bytes stored (2 a value).")

    def __len__(self) -> int:
        return len(self.bits)

    def __array__(self, dtype=None, copy=None):
        v = widened(self.bits)
        return v if dtype is None else v.astype(dtype, copy=False)

    def __getitem__(self, index) -> np.ndarray:
        return widened(self.bits[index])

    def part(self, index) -> BFloat16Array:
        """``bits[index]`` as a ``BFloat16Array`` (a view of the same bits)."""
        return BFloat16Array(self.bits[index], base=self)

    def reshape(self, *shape) -> BFloat16Array:
        return BFloat16Array(self.bits.reshape(*shape), base=self)

    def astype(self, dtype, copy: bool = True) -> np.ndarray:
        return widened(self.bits).astype(dtype, copy=False)

    def copy(self) -> BFloat16Array:
        return BFloat16Array(self.bits.copy())

    def __repr__(self):
        return f"BFloat16Array(shape={self.shape})"

    # NumPy's ufuncs (also ndarray's operators with this on the right) compute on the float32
    # values; none may write into the bits
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        args = [np.asarray(a) if isinstance(a, BFloat16Array) else a for a in inputs]
        if any(isinstance(a, BFloat16Array) for a in kwargs.get("out", ())):
            raise TypeError("BFloat16Array: cannot be written into (it holds bfloat16 bits)")
        return getattr(ufunc, method)(*args, **kwargs)

"""Memory-efficient (FlashAttention-style) scaled dot-product attention, forward and backward.

The plain ``scaled_dot_product_attention`` materialises the score matrix ``S = scale q k^T`` and
the weights ``P = softmax(S)``, both ``(..., H, Lq, Lk)``: at ``H=12, L=4096`` in float32 that is
768 MiB each.  Here the same result is computed block by block and no ``(Lq, Lk)`` array is ever
held:

* **forward** (FlashAttention, Dao et al. 2022): for each block of query rows, walk over the key
  blocks keeping, per query row, a running maximum ``m`` and a running sum ``l`` of the
  exponentials (the *online softmax*); the output accumulator is rescaled whenever ``m`` grows.
  The only statistics kept for backward are the per-row log-sum-exp ``lse = m + log l``: O(L).
* **backward** (FlashAttention-2, Dao 2023): recompute each block of ``P`` exactly from the saved
  ``lse`` as ``P = exp(S - lse)`` and push the gradient through it block by block, using
  ``D = rowsum(dout * out)`` in place of the row sums of ``dP * P``.

Everything is vectorised over all leading (batch, head) dimensions at once: each block operation
is one batched matmul or ufunc over ``(..., H)``; the only Python loops run over blocks.

Three implementation choices, all about speed on a CPU, none changing the mathematics:

* **Score blocks are held transposed**, ``S^T`` of shape ``(..., block_k, block_q)``: keys down,
  queries across.  Per-query statistics (max, sum, ``lse``, ``D``) then reduce over axis -2 and
  broadcast as rows ``(..., 1, block_q)``; numpy does such reductions as vectorised elementwise
  ``maximum``/``add`` of whole rows, several times faster than reducing many short rows along the
  last axis.  The matmuls do not care: BLAS reads a transposed operand for free.
* **Blocks are small and the block loop runs on a few threads.**  numpy's ufuncs are
  single-threaded, and a batched matmul is a Python-free loop of small GEMMs; for small GEMMs a
  multi-threaded BLAS spends its time waking and synchronising its threads (and collapses when
  other processes share the cores).  So each worker thread takes a fixed share of the blocks and
  calls BLAS on GEMMs small enough that OpenBLAS (numpy's) runs them on the calling thread;
  numpy releases the GIL inside matmul and ufunc loops, so the workers run in parallel,
  elementwise work included.  The share of each worker is fixed (not first come, first served),
  so a given machine reproduces its results bit for bit.  Small problems run inline.
* **Preallocated buffers, ``out=`` everywhere**: each worker owns one set of block buffers and
  reuses them for every block; ``scale`` multiplies ``q`` (once per query block in the forward,
  once in all in the backward), never the larger score blocks; only the blocks straddling the
  causal diagonal pay for the causal mask.
"""
from __future__ import annotations

import math
import numbers
import os
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple, Optional, Tuple

import numpy as np

from .._validate import check_bool, check_grad, check_mask, check_size
from .attention import _check_qkv

# Default block size (rows and columns of a score block), picked by measurement: see
# ``_block_sizes`` for the numbers and the reasons.
_DEFAULT_BLOCK = 64
_MIN_DEFAULT_BLOCK = 16
# With very many (batch x head) matrices the default block shrinks so that one block buffer
# stays near this many elements (4 MiB in float32): the point of this function is memory.
_DEFAULT_BLOCK_ELEMENTS = 1 << 20
# OpenBLAS runs a GEMM on the calling thread when m*n*k <= 4 * 65536 (its
# GEMM_MULTITHREAD_THRESHOLD times SMP_THRESHOLD_MIN); beyond that it uses its own threads.
_BLAS_SINGLE_THREAD_MNK = 1 << 18
# Problems with fewer score elements than this (summed over batch and heads) run on one thread.
_PARALLEL_MIN_SCORES = 1 << 20
_MAX_WORKERS = 8


class MemoryEfficientCache(NamedTuple):
    """What ``memory_efficient_attention_backward`` needs: O(L) beside the inputs and output.

    ``lse`` is the per-row log-sum-exp of the masked scaled scores, ``(..., H, Lq)`` (0 for a
    query row that may attend to no key); ``attn_mask`` is the mask exactly as the caller gave it
    (never expanded or copied); ``block_q``/``block_k`` are the block sizes used.
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    out: np.ndarray
    lse: np.ndarray
    attn_mask: Optional[np.ndarray]
    is_causal: bool
    scale: float
    block_q: int
    block_k: int


def _block_sizes(block_size, n_mats: int, lq: int, lk: int, width: int) -> Tuple[int, int]:
    """``(block_q, block_k)``, both clipped to the sequence lengths (so buffers never exceed them).

    ``width`` is ``max(E, Ev)``.  The default, 64 x 64 for ``E <= 64``, was picked by measurement
    on the target shape of issue 5 (b=1, h=12, L=4096, E=64, float32, causal, forward+backward,
    2 cores, OpenBLAS with AVX2 kernels), as the median over 7-9 rounds of our time divided by
    that of torch's CPU flash kernel run in the same round (torch.set_num_threads(2), about
    0.65 s; the machine was shared, so rounds interleave the two):

        block                 32      64      64 (1 thread)   128     256     512
        time / torch          1.62    1.18    2.03            2.11    1.55    1.56

    Below 64, per-call overhead dominates (each numpy call costs microseconds of Python and
    dispatch, a batched matmul is H tiny GEMMs, and the ragged diagonal blocks multiply).  Above
    it, OpenBLAS splits every GEMM over its own threads (it does so once m*n*k > 4 * 65536 =
    64 * 64 * 64), so the blocks are no longer spread over our worker threads (see
    ``_n_workers``; forcing both levels of threads at 128 measured 2.39), elementwise work runs on
    one core, and a BLAS that synchronises its threads on every GEMM suffers most when other
    processes share the cores.  At 64 every GEMM runs on its calling worker thread, both cores
    do GEMM and elementwise work, and it is also the least sensitive to a busy machine.
    For wider heads ``block_k`` shrinks to stay under the BLAS limit, and with very many
    batch x head matrices both shrink so that a block buffer stays near
    ``_DEFAULT_BLOCK_ELEMENTS``: the point of this function is memory.
    """
    if block_size is None:
        bq = bk = _DEFAULT_BLOCK
        while bk > _MIN_DEFAULT_BLOCK and bq * bk * width > _BLAS_SINGLE_THREAD_MNK:
            bk //= 2
        while bq > _MIN_DEFAULT_BLOCK and n_mats * bq * bk > _DEFAULT_BLOCK_ELEMENTS:
            bq //= 2
            bk = max(_MIN_DEFAULT_BLOCK, bk // 2)
    else:
        bq = bk = check_size(block_size, "block_size")
    return max(1, min(bq, lq)), max(1, min(bk, lk))


def _n_workers(n_scores: int, n_blocks: int, gemm_mnk: int) -> int:
    """Worker threads for the block loop: 1 for small problems, or when the block GEMMs are big
    enough for BLAS to thread them itself (two levels of threads only fight)."""
    if n_scores < _PARALLEL_MIN_SCORES or n_blocks < 2 or gemm_mnk > _BLAS_SINGLE_THREAD_MNK:
        return 1
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, _MAX_WORKERS, n_blocks))


def _shares(blocks, n: int):
    """Deal ``blocks`` to ``n`` workers in snake order (0..n-1, n-1..0, ...), balancing the
    triangular work of causal attention; each worker's share is fixed, so results are reproducible."""
    shares = [[] for _ in range(n)]
    for idx, b in enumerate(blocks):
        r = idx % (2 * n)
        shares[r if r < n else 2 * n - 1 - r].append(b)
    return shares


def _run(worker, shares):
    """``worker(share)`` for every share, on threads when there is more than one."""
    if len(shares) == 1:
        return [worker(shares[0])]
    with ThreadPoolExecutor(max_workers=len(shares)) as ex:
        return list(ex.map(worker, shares))


def _buffer(flat: np.ndarray, shape) -> np.ndarray:
    """A C-contiguous ``shape`` view on the front of the preallocated 1-d buffer ``flat``.

    Blocks at the ragged end of a sequence are smaller than the buffer; taking the view this
    way (instead of slicing a 2-d buffer) keeps it contiguous, which BLAS and ``out=`` like.
    """
    return flat[: math.prod(shape)].reshape(shape)


def _blocks(n: int, size: int, start: int = 0):
    return [(a, min(a + size, n)) for a in range(start, n, size)]


def _full_ndim(mask, ndim):
    """The mask viewed with ``ndim`` dimensions (leading 1s), so its blocks broadcast."""
    if mask is None:
        return None
    return mask.reshape((1,) * (ndim - mask.ndim) + mask.shape)


def _apply_mask_t(st: np.ndarray, mask: np.ndarray, i0: int, i1: int, j0: int, j1: int) -> bool:
    """Apply ``attn_mask`` (rows ``i0:i1``, columns ``j0:j1``) to the *transposed* score block
    ``st`` (keys x queries) in place.  Returns False when every entry of the block is masked."""
    rows = slice(None) if mask.shape[-2] == 1 else slice(i0, i1)
    cols = slice(None) if mask.shape[-1] == 1 else slice(j0, j1)
    mb = mask[..., rows, cols].swapaxes(-1, -2)
    if mb.dtype == bool:
        if not mb.any():
            return False
        np.copyto(st, -np.inf, where=~mb)
    else:
        st += mb.astype(st.dtype, copy=False)
    return True


class _CausalMasks:
    """``hidden(nk, nq, i0 - j0)``: the bool block, keys x queries, of the pairs causality hides.

    Key ``j0 + c`` is hidden from query ``i0 + r`` iff ``j0 + c > i0 + r``, i.e.
    ``c - r >= i0 - j0 + 1``: the part of ``np.tri(nk, nq, j0 - i0 - 1)``.  The few distinct
    diagonal-block shapes are built once per call and reused.
    """

    def __init__(self):
        self._cache = {}

    def hidden(self, nk: int, nq: int, offset: int) -> np.ndarray:
        key = (nk, nq, offset)
        m = self._cache.get(key)
        if m is None:
            m = self._cache[key] = np.tri(nk, nq, -offset - 1, dtype=bool)
        return m


def memory_efficient_attention(q, k, v, attn_mask=None, is_causal=False, scale=None, block_size=None):
    """``softmax(q k^T * scale + mask) v`` computed in blocks, never holding an ``(Lq, Lk)`` array.

    The same result as ``scaled_dot_product_attention(q, k, v, attn_mask, is_causal, scale=scale)``
    (no dropout, no grouped-query heads): ``q (..., H, Lq, E)``, ``k (..., H, Lk, E)``,
    ``v (..., H, Lk, Ev)`` -> ``(..., H, Lq, Ev)``; inputs without a head axis and any number of
    leading batch dimensions work.  ``scale`` defaults to ``1/sqrt(E)``.  ``attn_mask``: bool
    (True = may attend) or float (added to the scaled scores), broadcastable to
    ``(..., H, Lq, Lk)``; ``is_causal``: query ``i`` sees keys ``0..i`` (top-left aligned, also when
    ``Lq != Lk``), and may be combined with ``attn_mask``.  A query row that may attend to no key
    gives output 0 (and gradient 0), never NaN.  ``block_size``: query rows and key columns per
    block (an int >= 1; need not divide ``L``), or None for a measured default (64; smaller when
    there are very many batch x head matrices).

    **The online softmax.**  Fix one query row with scores ``s_1..s_n`` split into key blocks.
    The output is ``o = sum_j exp(s_j) v_j / sum_j exp(s_j)``; for stability every exponential is
    taken relative to a shift ``m`` (any ``m`` gives the same ratio; the row maximum keeps each
    ``exp(s_j - m) <= 1``).  Walking the blocks we keep

        m = max of the scores seen so far,
        l = sum over those keys of exp(s_j - m),
        a = sum over those keys of exp(s_j - m) v_j          (an unnormalised output row).

    A new block ``B`` raises the maximum to ``m' = max(m, max_{j in B} s_j)``; the old sums were
    taken relative to ``m``, so multiplying them by ``alpha = exp(m - m')`` re-bases them on ``m'``:

        P_B = exp(s_B - m'),   l' = alpha l + rowsum(P_B),   a' = alpha a + P_B v_B.

    After the last block ``o = a / l``, exactly the softmax-weighted sum.  We also keep the
    log-sum-exp ``lse = m + log l = log sum_j exp(s_j)``, all backward needs to rebuild any block of
    weights as ``P = exp(s - lse)``.  Masked scores are ``-inf`` and contribute ``exp(-inf) = 0``;
    a row that has seen only masked keys has ``m = -inf``, and we shift by 0 instead to avoid
    ``-inf - (-inf)``; a row that never sees a key ends with ``l = 0``: output 0, ``lse`` 0.

    **Blocks and cost.**  Query blocks of ``block_q`` rows run over key blocks of ``block_k``
    columns; each step is two batched GEMMs (``S^T = k_j (scale q_i)^T`` and ``P v_j``) and a few
    elementwise passes over one ``(..., block_k, block_q)`` buffer.  With ``is_causal`` the key
    loop stops at the diagonal, so blocks wholly above it are never computed; key blocks entirely
    hidden by a bool ``attn_mask`` are skipped.  Memory: the output, ``lse`` and per-thread block
    buffers; the cache keeps ``q, k, v, out, lse``, the mask as given, and scalars.

    Returns ``(out, MemoryEfficientCache)``.
    """
    q, k, v, _ = _check_qkv(q, k, v, False)
    is_causal = check_bool(is_causal, "is_causal")
    lq, lk, e, ev = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    lead = q.shape[:-2]
    if attn_mask is not None:
        attn_mask = check_mask(attn_mask, "attn_mask", lead + (lq, lk))
    if scale is None:
        scale = 1.0 / math.sqrt(e)
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise TypeError(f"scale: expected a finite real number or None, got {scale!r}")
    scale = float(scale)  # a python float: keeps float32 arrays float32
    n_mats = math.prod(lead)
    bq, bk = _block_sizes(block_size, n_mats, lq, lk, max(e, ev))

    dt = q.dtype
    mask = _full_ndim(attn_mask, len(lead) + 2)
    out = np.empty(lead + (lq, ev), dt)
    lse = np.empty(lead + (lq,), dt)
    causal = _CausalMasks()

    def rows(share):
        """Forward for the query blocks in ``share``, with this worker's own buffers."""
        qs_buf = np.empty(n_mats * bq * e, dt)
        s_buf = np.empty(n_mats * bk * bq, dt)
        acc_buf = np.empty(n_mats * ev * bq, dt)
        pv_buf = np.empty(n_mats * ev * bq, dt)
        m_buf, mnew_buf, alpha_buf, l_buf, rsum_buf = (np.empty(n_mats * bq, dt) for _ in range(5))
        for i0, i1 in share:
            nq = i1 - i0
            row = lead + (1, nq)                      # per-query statistics, as rows
            qs = _buffer(qs_buf, lead + (nq, e))
            np.multiply(q[..., i0:i1, :], scale, out=qs)
            qs_t = qs.swapaxes(-1, -2)
            m, m_new, alpha, l, rsum = (_buffer(b, row) for b in (m_buf, mnew_buf, alpha_buf, l_buf, rsum_buf))
            m.fill(-np.inf)
            l.fill(0.0)
            acc_t = _buffer(acc_buf, lead + (ev, nq))  # a^T, transposed like the scores
            acc_t.fill(0.0)
            pv_t = _buffer(pv_buf, lead + (ev, nq))
            k_end = min(lk, i1) if is_causal else lk  # keys >= i1 are hidden from the whole block
            for j0, j1 in _blocks(k_end, bk):
                nk = j1 - j0
                st = _buffer(s_buf, lead + (nk, nq))  # S^T: keys down, queries across
                np.matmul(k[..., j0:j1, :], qs_t, out=st)
                if is_causal and j1 - 1 > i0:         # straddles the diagonal
                    np.copyto(st, -np.inf, where=causal.hidden(nk, nq, i0 - j0))
                if mask is not None and not _apply_mask_t(st, mask, i0, i1, j0, j1):
                    continue                          # every score of this block is masked
                np.max(st, axis=-2, keepdims=True, out=m_new)
                np.maximum(m_new, m, out=m_new)       # m' = max(m, max_B s)
                shift = m_new
                if mask is not None:                  # rows that saw only masked keys: shift by 0
                    shift = np.where(m_new == -np.inf, 0.0, m_new).astype(dt, copy=False)
                np.subtract(m, shift, out=alpha)
                np.exp(alpha, out=alpha)              # alpha = exp(m - m'): 0 on a row's first block
                np.subtract(st, shift, out=st)
                np.exp(st, out=st)                    # P_B^T = exp(s_B - m')
                np.sum(st, axis=-2, keepdims=True, out=rsum)
                l *= alpha
                l += rsum                             # l' = alpha l + rowsum(P_B)
                np.matmul(v[..., j0:j1, :].swapaxes(-1, -2), st, out=pv_t)
                acc_t *= alpha
                acc_t += pv_t                         # a' = alpha a + P_B v_B  (transposed)
                m, m_new = m_new, m                   # m <- m' (swap the two buffers, no copy)
            # o = a / l and lse = m + log l; rows that saw no key (l = 0) keep o = 0, get lse = 0
            empty = l == 0
            if empty.any():
                l[empty] = 1.0
                m[empty] = 0.0
            np.divide(acc_t, l, out=out[..., i0:i1, :].swapaxes(-1, -2))
            np.log(l, out=l)
            np.add(m, l, out=lse[..., None, i0:i1])

    q_blocks = _blocks(lq, bq)
    workers = _n_workers(n_mats * lq * lk, len(q_blocks), bq * bk * max(e, ev))
    _run(rows, _shares(q_blocks, workers))
    return out, MemoryEfficientCache(q, k, v, out, lse, attn_mask, is_causal, scale, bq, bk)


def memory_efficient_attention_backward(dout, cache):
    """Gradients ``(dq, dk, dv)`` of ``memory_efficient_attention``, block by block (FlashAttention-2).

    With ``S = scale q k^T + mask``, ``P = softmax(S)`` row-wise and ``O = P V``, the plain
    backward (see ``scaled_dot_product_attention_backward``) is

        dV = P^T dO,   dP = dO V^T,   dS = P * (dP - rowsum(dP * P)),
        dQ = scale dS K,   dK = scale dS^T Q.

    Two observations make it blockwise with O(L) extra memory:

    1. Any block of ``P`` can be rebuilt exactly from the saved log-sum-exp, since
       ``P_ij = exp(S_ij) / sum_j exp(S_ij) = exp(S_ij - lse_i)``: recompute ``S`` for the block
       (one GEMM), subtract ``lse`` and exponentiate.  Masked entries are ``-inf`` again, so 0.
    2. The row sum ``rowsum(dP * P)`` needs a whole row, but it equals
       ``D_i = sum_j dP_ij P_ij = sum_j (sum_e dO_ie V_je) P_ij = sum_e dO_ie O_ie``,
       i.e. ``D = rowsum(dO * O)``: O(L) work on arrays we already have, computed once up front.

    Then for every (key block ``j``, query block ``i``) pair that is not wholly masked:

        P = exp(S_ij - lse_i),   dV_j += P^T dO_i,   dP = dO_i V_j^T,   dS = P * (dP - D_i),
        dQ_i += scale dS K_j,   dK_j += scale dS^T Q_i.

    As in FlashAttention-2 the outer loop runs over key blocks, so ``dK_j`` and ``dV_j`` are
    finished one block at a time, and the inner loop over query blocks adds into ``dQ``.  The
    blocks are held transposed as in the forward (``P^T``, ``dP^T``, ``dS^T``: keys x queries),
    which turns the products above into ``dV_j += P^T dO_i``, ``dP^T = V_j dO_i^T``,
    ``dQ_i += (dS^T)^T K_j``, ``dK_j += dS^T (scale Q_i)``.  ``scale`` is folded into ``q`` once, up
    front (giving ``scale dS^T Q`` directly), and applied to ``dQ`` once at the end.  Worker
    threads own disjoint key blocks, hence disjoint rows of ``dK``, ``dV``; each adds ``dQ`` into
    its own accumulator, summed at the end in a fixed order.  With ``is_causal`` the inner loop
    starts at query row ``j0`` (earlier rows see nothing of key block ``j``), so blocks above the
    diagonal cost nothing.  A query row that saw no key has ``P = 0`` in every block, hence
    ``dS = 0``: gradient 0.  The mask is a constant and gets no gradient.

    Returns ``(dq, dk, dv)``, in ``q``'s dtype.
    """
    q, k, v, out, lse, attn_mask, is_causal, scale, bq, bk = cache
    dout = check_grad(dout, out.shape, q.dtype)
    lq, lk, e, ev = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    lead = q.shape[:-2]
    dt = q.dtype
    n_mats = math.prod(lead)
    mask = _full_ndim(attn_mask, len(lead) + 2)
    causal = _CausalMasks()

    # D_i = rowsum(dO * O) and lse, as rows (..., 1, Lq) to broadcast over the transposed blocks
    d_row = np.einsum("...e,...e->...", dout, out)[..., None, :]
    lse_row = lse[..., None, :]
    qs_all = q * scale  # scale folded into q once (O(L) memory), so dK_j += dS^T qs is scaled
    dk = np.empty(k.shape, dt)
    dv = np.empty(v.shape, dt)

    def columns(share, dq):
        """Backward for the key blocks in ``share``; adds this worker's dQ terms into ``dq``."""
        s_buf = np.empty(n_mats * bk * bq, dt)
        dp_buf = np.empty(n_mats * bk * bq, dt)
        dq_buf = np.empty(n_mats * bq * e, dt)
        dk_buf = np.empty(n_mats * bk * e, dt)
        dv_buf = np.empty(n_mats * bk * ev, dt)
        for j0, j1 in share:
            nk = j1 - j0
            k_j, v_j = k[..., j0:j1, :], v[..., j0:j1, :]
            dk_j, dv_j = dk[..., j0:j1, :], dv[..., j0:j1, :]
            dk_j.fill(0.0)
            dv_j.fill(0.0)
            dk_tmp = _buffer(dk_buf, lead + (nk, e))
            dv_tmp = _buffer(dv_buf, lead + (nk, ev))
            # causal: query rows < j0 see nothing of this key block, so start the query blocks at j0
            for i0, i1 in _blocks(lq, bq, j0 if is_causal else 0):
                nq = i1 - i0
                qs = qs_all[..., i0:i1, :]
                st = _buffer(s_buf, lead + (nk, nq))
                np.matmul(k_j, qs.swapaxes(-1, -2), out=st)          # S^T = k_j (scale q_i)^T
                if is_causal and j1 - 1 > i0:
                    np.copyto(st, -np.inf, where=causal.hidden(nk, nq, i0 - j0))
                if mask is not None and not _apply_mask_t(st, mask, i0, i1, j0, j1):
                    continue
                np.subtract(st, lse_row[..., i0:i1], out=st)
                pt = np.exp(st, out=st)                               # P^T = exp(S^T - lse)
                do_i = dout[..., i0:i1, :]
                np.matmul(pt, do_i, out=dv_tmp)
                dv_j += dv_tmp                                        # dV_j += P^T dO_i
                dpt = _buffer(dp_buf, lead + (nk, nq))
                np.matmul(v_j, do_i.swapaxes(-1, -2), out=dpt)        # dP^T = V_j dO_i^T
                np.subtract(dpt, d_row[..., i0:i1], out=dpt)
                dst = np.multiply(dpt, pt, out=dpt)                   # dS^T = P^T * (dP^T - D)
                dq_tmp = _buffer(dq_buf, lead + (nq, e))
                np.matmul(dst.swapaxes(-1, -2), k_j, out=dq_tmp)
                dq[..., i0:i1, :] += dq_tmp                           # dQ_i += dS K_j (scaled below)
                np.matmul(dst, qs, out=dk_tmp)
                dk_j += dk_tmp                                        # dK_j += dS^T (scale Q_i)

    k_blocks = _blocks(lk, bk)
    shares = _shares(k_blocks, _n_workers(n_mats * lq * lk, len(k_blocks), bq * bk * max(e, ev)))
    dqs = [np.zeros(q.shape, dt) for _ in shares]
    _run(lambda i: columns(shares[i], dqs[i]), list(range(len(shares))))
    dq = dqs[0]
    for extra in dqs[1:]:
        dq += extra
    dq *= scale
    return dq, dk, dv

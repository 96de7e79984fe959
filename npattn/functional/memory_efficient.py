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

The same loop carries every option without ever widening what is held:

* **grouped-query heads and broadcast batches** by *views*: q's heads are seen as ``(Hk, G)`` and
  k, v get a size-1 group axis, so a batched matmul reuses each kv block for its G query heads
  (k and v are never repeated); gradients are summed back over the broadcast axes block by block;
* **dropout** by *regeneration*: one seed per call, and the keep-mask of a block is a pure function
  of the seed and the block's flat score indices (``_random``), formed in the forward and again
  in the backward; never stored, identical whatever the block sizes or threads;
* **causal_align, window** by *skipping*: each query block runs only over the key blocks of its
  band of visible keys (and each key block of the backward only over the query blocks of its
  band), so cost and memory grow with ``L * window``; only blocks straddling the band's edges
  pay for a mask;
* **softcap, ALiBi, masks** by *rewriting the score block* in place (``_Scores``), identically in
  both passes; **sinks** by *initialising* the online softmax (``m = sink``, ``l = 1``);
  **mask_grad** by summing each block's ``dS`` into the mask's own (broadcast) shape.

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
  reuses them for every block; ``scale`` multiplies ``q`` (once per query block), never the larger
  score blocks; only the blocks straddling the causal diagonal pay for the causal mask; the
  backward packs each block it multiplies (contiguous, with one more row or column that makes its
  products subtract ``lse`` and ``D``, ``_BackwardWorker``).
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple, Optional, Tuple

import numpy as np

from .._blas import single_thread_gemm_mnk
from .._docs import (
    ATTENTION_FORWARD,
    attention_backward_jvp_sections,
    attention_backward_sections,
    attention_jvp_sections,
    shared_doc,
)
from .._validate import (
    as_rng,
    check_backward_jvp,
    check_bool,
    check_cache,
    check_grad,
    check_mask,
    check_prob,
    check_size,
    check_tangents_as,
)
from ._blocks import (
    AttentionOptions,
    Band,
    attention_tangent_specs,
    band,
    band_hidden,
    band_width,
    check_qkv,
    check_scale,
    default_scale,
    distance,
    fold_heads,
    fold_kv,
    gqa_groups,
    key_range,
    out_lead,
    query_range,
    scratch,
    split_attention_tangents,
    sum_to,
    with_ndim,
)
from ._random import draw_seed, keep_into

__all__ = [
    "MemoryEfficientCache",
    "memory_efficient_attention",
    "memory_efficient_attention_backward",
    "memory_efficient_attention_jvp",
    "memory_efficient_attention_backward_jvp",
]


# Default block size (rows and columns of a score block), picked by measurement: see
# ``_block_sizes`` for the numbers and the reasons.
_DEFAULT_BLOCK = 64
_MIN_DEFAULT_BLOCK = 16
# With very many (batch x head) matrices the default block shrinks so that one block buffer
# stays near this many elements (4 MiB in float32): the point of this function is memory.
_DEFAULT_BLOCK_ELEMENTS = 1 << 20
# OpenBLAS runs a GEMM on the calling thread when m*n*k <= 4 * 65536 (its
# GEMM_MULTITHREAD_THRESHOLD times SMP_THRESHOLD_MIN); beyond that it uses its own threads, unless
# its small-matrix kernels take the product (``npattn._blas.single_thread_gemm_mnk``).
_BLAS_SINGLE_THREAD_MNK = 1 << 18
# Problems with fewer score elements than this (summed over batch and heads) run on one thread.
_PARALLEL_MIN_SCORES = 1 << 20
_MAX_WORKERS = 8
# The forward's key blocks (default block size only) are as long as a score block of this many
# bytes per worker allows (summed over the matrices): see ``_forward_key_block``.
_FORWARD_BLOCK_BYTES = 1 << 20


class MemoryEfficientCache(NamedTuple):
    """What ``memory_efficient_attention_backward`` needs: O(L) beside the inputs and output.

    ``q, k, v`` as given (after casting; never broadcast or repeated), ``out`` the output;
    ``lse`` is the per-row log-sum-exp of the final scores (sinks included), ``(..., Hq, Lq)``
    (0 for a query row that may attend to no key and has no sink); ``attn_mask`` is the mask
    exactly as the caller gave it (never expanded or copied); ``block_q``/``block_k`` are the
    block sizes used (``block_q_backward``: the backward's query block, 0 for ``block_q``, see
    ``_backward_query_block``).  Dropout keeps only ``dropout_p`` and the ``seed`` its blocks are
    regenerated from; ``options`` are the attention options as checked (``AttentionOptions``).
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
    dropout_p: float = 0.0
    seed: int = 0
    groups: int = 1
    options: AttentionOptions = AttentionOptions()
    block_q_backward: int = 0


def _block_sizes(block_size, n_mats: int, lq: int, lk: int, width: int) -> Tuple[int, int]:
    """``(block_q, block_k)``, both clipped to the sequence lengths (so buffers never exceed them).

    ``width`` is ``max(E, Ev)``.  The default, 64 x 64 for ``E <= 64``, is the measured best of
    32..512 on 2 cores (``npattn bench``): below 64 per-call overhead dominates; above it OpenBLAS
    splits every GEMM over its own threads (it does so once ``m*n*k > 4 * 65536 = 64 * 64 * 64``),
    so the blocks are no longer spread over our worker threads (see ``_n_workers``), elementwise
    work runs on one core, and a BLAS that synchronises its threads on every GEMM suffers most when
    other processes share the cores.  For wider heads ``block_k`` shrinks to stay under the BLAS
    limit, and with very many batch x head matrices both shrink so that a block buffer stays near
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


def _forward_key_block(block_size, n_mats: int, bq: int, bk: int, lk: int, itemsize: int) -> int:
    """The forward's key block: with the default block size, as many keys as a score block of
    ``_FORWARD_BLOCK_BYTES`` per worker allows, in whole GEMM slices of ``bk`` keys (at least ``bk``,
    at most ``Lk``).

    Per key block the online softmax makes about ten elementwise passes (max, shift, exp, sum,
    rescaling ``l`` and the accumulator) beside its two GEMMs; at 64 x 64 blocks they took about
    half the forward's time.  With one long key block a query block needs one max, one exp, one
    sum and no rescaling at all, while the memory stays ``O(block_q * key block)``, never
    ``(Lq, Lk)``.  The GEMMs still run in ``bk``-key slices (``_ForwardWorker``, ``_forward_gemm_keys``),
    under OpenBLAS's threading limit, so the workers keep both cores busy.  An explicit ``block_size``
    is kept.
    """
    if block_size is not None:
        return bk
    return max(bk, min(lk, _FORWARD_BLOCK_BYTES // (itemsize * max(1, n_mats * bq)) // bk * bk))


def _forward_gemm_keys(block_size, bq: int, bk: int, width: int) -> int:
    """The keys of one of the forward's products beside ``bq`` query rows: with the default block
    size, the most (a multiple of 8) whose products, ``keys x bq x (width + 1)`` multiply-adds (the
    bounded forward's packed values carry a column of ones, ``_ForwardWorker.bounded_rows``), numpy's
    BLAS runs on the calling thread (``npattn._blas.single_thread_gemm_mnk``): 120 beside 128 rows on
    the OpenBLAS cores with small-matrix kernels, 56 beside 64 elsewhere.  Fewer, longer products
    mean fewer calls and fewer additions into the accumulator.  An explicit ``block_size`` is kept."""
    if block_size is not None:
        return bk
    return max(8, single_thread_gemm_mnk() // max(1, bq * (width + 1)) // 8 * 8)


def _tall_query_block(block_size, bq: int, bk: int, width: int, lq: int) -> int:
    """The forward's query block: with the default block size, ``2 * bq`` (128 beside 64 keys) when
    numpy's BLAS runs products of ``2 * bq * bk * width`` on the calling thread
    (``npattn._blas.single_thread_gemm_mnk``: OpenBLAS cores with small-matrix kernels), else ``bq``.

    Taller query blocks halve the forward's products (``k_j (scale q_i)^T`` and ``P v_j`` in key
    slices, ``_forward_gemm_keys``), their per-call overhead and the reads of each key block (the
    backward's query block was first measured this way: -7 to -10 % CPU time at L = 4096, AVX-512
    Zen 4, 2 cores; ``_backward_query_block``).  On a BLAS that would thread such products inside
    the worker threads the blocks stay ``bq``.  An explicit ``block_size`` is kept.
    """
    if block_size is not None or 2 * bq * bk * width > single_thread_gemm_mnk():
        return bq
    return max(bq, min(2 * bq, lq))  # bq is already clipped to Lq (and at least 1)


def _backward_query_block(block_size, bq: int, bk: int, width: int, lq: int, n_mats: int) -> int:
    """The backward's query block: with the default block size, the tallest multiple of ``bk`` (else of
    8) whose products beside ``bk`` keys, ``m x bk x (width + 1)`` multiply-adds (the packed blocks
    carry one more row or column, ``_BackwardWorker``), numpy's BLAS runs on the calling thread
    (``npattn._blas.single_thread_gemm_mnk``): 192 beside 64 keys on the OpenBLAS cores with
    small-matrix kernels, 56 elsewhere; no taller than a block buffer of ``_DEFAULT_BLOCK_ELEMENTS``
    allows (or ``bq``) and than ``Lq``.  An explicit ``block_size`` is kept.

    Each (key block, query block) pair makes five products and adds three of them into ``dV``,
    ``dQ`` and ``dK`` (numpy's matmul cannot accumulate), a dozen numpy calls with their overhead;
    taller query blocks mean fewer pairs, fewer calls and fewer additions into ``dK``/``dV``.  A
    multiple of ``bk`` starts every query block on a key block's edge, so a causal diagonal crosses
    as few key blocks as it can (each one pays for a mask).  Measured at L = 4096 (AVX-512 Zen 4, 2
    cores, float32 causal, backward CPU time against 240 rows): 192 rows -2 to -4 %, 128 rows about
    the same as 240; 256 rows (past the BLAS's limit: threaded products) +150 %.
    """
    if block_size is not None:
        return bq
    fit = single_thread_gemm_mnk() // max(1, bk * (width + 1))
    fit = fit // bk * bk if fit >= bk else max(8, fit // 8 * 8)
    cap = max(bq, _DEFAULT_BLOCK_ELEMENTS // max(1, n_mats * bk))
    return max(1, min(fit, cap, lq))


def _n_workers(n_scores: int, n_blocks: int, gemm_mnk: int) -> int:
    """Worker threads for the block loop: 1 for small problems, or when the block GEMMs are big
    enough for BLAS to thread them itself (two levels of threads only fight)."""
    if n_scores < _PARALLEL_MIN_SCORES or n_blocks < 2 or gemm_mnk > single_thread_gemm_mnk():
        return 1
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, _MAX_WORKERS, n_blocks))


def _shares(blocks, n: int):
    """Deal ``blocks`` to ``n`` workers in snake order (0..n-1, n-1..0, ...), balancing the
    triangular work of causal attention; each worker's share is fixed, so results are reproducible."""
    shares: list = [[] for _ in range(n)]
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


def _spans(n: int, size: int, start: int = 0):
    """The blocks ``(a, b)`` of ``start..n-1``, ``size`` long (the last one may be shorter)."""
    return [(a, min(a + size, n)) for a in range(start, n, size)]


# -- the working layout -----------------------------------------------------------------------------
# Every block operation is one batched numpy call over all leading dimensions.  So that it
# broadcasts instead of copying, each array is *viewed* (reshape that splits or inserts axes: no
# copy) with the same number of leading dimensions ``lead``:
#
# * grouped-query attention by the shared scheme (``_blocks.fold_heads``): the ``Hq`` query heads
#   split as ``(Hk, G)`` (query head ``h = hk*G + g`` uses kv head ``hk = h // G``) and k and v get
#   a head axis ``(Hk, 1)``: a batched matmul of a ``(..., Hk, 1, n, E)`` key block with
#   ``(..., Hk, G, E, m)`` queries reuses each kv head for its G query heads without repeating it;
# * leading (batch) dimensions of q, k, v broadcast against each other as in torch; gradients are
#   summed back over the dimensions an input was broadcast along (``_blocks.sum_to``);
# * a mask, ALiBi slopes and sinks are viewed the same way (their head axis split like q's).
#
# ``lead`` flattened in C order is exactly the output's leading shape ``(..., Hq)`` flattened
# (``h = hk*G + g``), so the output, ``lse`` and dropout's flat score index are those of the
# ungrouped ``(..., Hq, Lq, Lk)`` score array.


class _Layout(NamedTuple):
    q: np.ndarray  # (*lead_q, Lq, E)     every lead_x broadcasts to ``lead``
    k: np.ndarray  # (*lead_k, Lk, E)
    v: np.ndarray  # (*lead_k, Lk, Ev)
    lead: tuple  # the working leading shape (..., Hk, G) or (..., H)
    out_lead: tuple  # the output's leading shape (..., Hq)
    mask: Optional[np.ndarray]  # (*lead_m, Lq or 1, Lk or 1)
    slopes: Optional[np.ndarray]  # (*lead_s, 1, 1)
    sinks: Optional[np.ndarray]  # (*lead_s, 1, 1)


def _layout(q, k, v, groups, attn_mask, alibi_slopes, sinks) -> _Layout:
    nd = max(q.ndim, k.ndim, v.ndim)
    q = fold_heads(with_ndim(q, nd), groups)
    k, v = (fold_kv(with_ndim(a, nd), groups) for a in (k, v))  # (Hk or 1, 1)
    lead = tuple(np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))
    out_lead = lead[:-2] + (lead[-2] * lead[-1],) if groups > 1 else lead
    n = len(out_lead)

    def view(a, tail):  # leading (..., Hq) + tail -> leading (..., Hk, G) + tail
        return fold_heads(with_ndim(a, n + tail), groups, n - 1)

    mask = None if attn_mask is None else view(attn_mask, 2)
    slopes = None if alibi_slopes is None else view(alibi_slopes, 0)[..., None, None]
    sink = None if sinks is None else view(sinks, 0)[..., None, None]
    return _Layout(q, k, v, lead, out_lead, mask, slopes, sink)


# -- which keys a query sees -------------------------------------------------------------------------
# ``_blocks.band``: query ``i`` sits at position ``p = i + offset`` (``offset = Lk - Lq`` for
# ``causal_align="bottom_right"``, else 0) and may see key ``j`` iff ``p - left <= j <= p + right``
# (``window``; causal makes ``right = 0``).  A block of queries needs only the keys of one band
# (``_blocks.key_range``), a block of keys only the queries of one band (``_blocks.query_range``):
# the blocks outside are never formed; inside a block, ``_blocks.band_hidden`` gives the pairs the
# band hides.


class _Dropout:
    """Dropout's keep-mask of any score block, regenerated from the call's seed and the block's
    position: score ``(m, i, j)`` (matrix ``m`` of the flattened ``(..., Hq)``) has the flat index
    ``m*Lq*Lk + i*Lk + j`` in the C-ordered ``(..., Hq, Lq, Lk)`` array and is kept iff
    ``uniform(seed, index) >= p`` (``npattn.functional._random``): the same numbers as
    ``keep_mask(seed, p, score_shape)[..., i0:i1, j0:j1]``, whatever the block sizes.  Blocks are
    transposed like the scores, ``(..., nk, nq)``.  ``scale``: the kept weights' ``1/(1-p)``."""

    def __init__(self, seed: int, p: float, lead: tuple, lq: int, lk: int):
        self.seed, self.p, self.lead, self.lq, self.lk = seed, p, lead, lq, lk
        self.scale = 0.0 if p == 1.0 else 1.0 / (1.0 - p)
        n = math.prod(lead)
        self.mats = (np.arange(n, dtype=np.uint64) * np.uint64(lq * lk)).reshape(lead + (1, 1))

    def buffers(self, bk: int, bq: int):
        """Per-worker scratch: two uint64 blocks, the bool mask, the (keys, queries) offsets."""
        n = self.mats.size * bk * bq
        return np.empty(n, np.uint64), np.empty(n, np.uint64), np.empty(n, bool), np.empty(bk * bq, np.uint64)

    def keep_t(self, i0: int, i1: int, j0: int, j1: int, bufs) -> np.ndarray:
        z_buf, work_buf, keep_buf, off_buf = bufs
        nk, nq = j1 - j0, i1 - i0
        shape = self.lead + (nk, nq)
        off = scratch(off_buf, (nk, nq))  # j + i * Lk, keys down
        np.add(
            np.arange(j0, j1, dtype=np.uint64)[:, None],
            np.arange(i0, i1, dtype=np.uint64) * np.uint64(self.lk),
            out=off,
        )
        z = scratch(z_buf, shape)
        np.add(self.mats, off, out=z)
        return keep_into(self.seed, self.p, z, scratch(work_buf, shape), scratch(keep_buf, shape))


class _Scores:
    """Turns a block of raw scores ``S^T = k_j (scale q_i)^T`` (keys x queries) into the final
    scores in place: softcap, ALiBi, the band (causal/window) and the mask, in that order."""

    def __init__(self, lay: _Layout, band: Band, softcap: Optional[float], dt):
        self.lay, self.band, self.softcap, self.dt = lay, band, softcap, dt
        self.mask = lay.mask
        self.slopes = lay.slopes
        if self.slopes is not None:
            self._bias_lead = np.broadcast_shapes(self.slopes.shape[:-2], (1,) * len(lay.lead))

    def buffers(self, bk: int, bq: int):
        """Per-worker scratch: the distance block and the bias block (ALiBi only)."""
        if self.slopes is None:
            return None
        return np.empty(bk * bq, self.dt), np.empty(math.prod(self._bias_lead) * bk * bq, self.dt)

    def apply(self, st, i0, i1, j0, j1, bufs, tanh_out=None) -> bool:
        """Final scores of the block in ``st``; False when every score of it is masked (skip it).
        With ``tanh_out`` (softcap), ``tanh(raw / softcap)`` is written there for the backward."""
        nk, nq = st.shape[-2], st.shape[-1]
        if self.softcap is not None:
            # S = softcap * tanh(S_raw / softcap), before biases and masks
            np.multiply(st, 1.0 / self.softcap, out=st)
            np.tanh(st, out=st)
            if tanh_out is not None:
                np.copyto(tanh_out, st)
            st *= self.softcap
        if self.slopes is not None:  # ALiBi: S -= slope * |p - j|
            dist_buf, bias_buf = bufs
            dist = distance(self.band, j0, nk, i0, nq, self.dt, out=scratch(dist_buf, (nk, nq)))
            bias = scratch(bias_buf, self._bias_lead + (nk, nq))
            np.multiply(self.slopes, dist, out=bias)
            st -= bias
        hidden = band_hidden(self.band, j0, nk, i0, nq)
        if hidden is not None:
            np.copyto(st, -np.inf, where=hidden)
        mask = self.mask
        if mask is not None:
            mb = _mask_block(mask, i0, i1, j0, j1)
            if mb.dtype == bool:
                if not mb.any():
                    return False
                np.copyto(st, -np.inf, where=~mb)
            else:
                st += mb.astype(st.dtype, copy=False)
        return True


def _mask_block(mask, i0, i1, j0, j1):
    """The key-major block ``(..., keys, queries)`` of a working-layout mask (or its tangent,
    or its gradient) for the queries ``i0..i1-1`` and keys ``j0..j1-1`` (a size-1 axis: all)."""
    rows = slice(None) if mask.shape[-2] == 1 else slice(i0, i1)
    cols = slice(None) if mask.shape[-1] == 1 else slice(j0, j1)
    return mask[..., rows, cols].swapaxes(-1, -2)


class _Geometry(NamedTuple):
    """What the forward, the backward and the JVP of one call share: the working layout, the band
    of visible keys, the score rewriter, dropout's regenerator (None without dropout), the block
    sizes and the dtype."""

    lay: _Layout
    band: Band
    scores: _Scores
    dropout: Optional[_Dropout]
    bq: int
    bk: int
    dt: np.dtype

    @property
    def lq(self) -> int:
        return self.lay.q.shape[-2]

    @property
    def lk(self) -> int:
        return self.lay.k.shape[-2]

    def buffer(self, *per_matrix: int) -> np.ndarray:
        """A flat scratch buffer of ``per_matrix`` elements for each of the working layout's matrices."""
        return np.empty(math.prod(self.lay.lead) * math.prod(per_matrix), self.dt)

    def shares(self, blocks: list) -> list:
        """``blocks`` dealt to the workers (one share, inline, for small problems)."""
        width = max(self.lay.q.shape[-1], self.lay.v.shape[-1])
        n_scores = math.prod(self.lay.lead) * self.lq * band_width(self.band, self.lk)
        return _shares(blocks, _n_workers(n_scores, len(blocks), self.bq * self.bk * width)) if blocks else [[]]


def _geometry(q, k, v, attn_mask, is_causal, groups, opts: AttentionOptions, bq, bk, dropout_p, seed) -> _Geometry:
    lay = _layout(q, k, v, groups, attn_mask, opts.alibi_slopes, opts.sinks)
    lq, lk = q.shape[-2], k.shape[-2]
    bnd = band(lq, lk, is_causal, opts.causal_align, opts.window)
    dropout = _Dropout(seed, dropout_p, lay.lead, lq, lk) if dropout_p > 0.0 else None
    return _Geometry(lay, bnd, _Scores(lay, bnd, opts.softcap, q.dtype), dropout, bq, bk, q.dtype)


def _cached_geometry(cache: MemoryEfficientCache) -> _Geometry:
    """The forward's geometry again, from its cache (the backward and the JVP rebuild the blocks)."""
    return _geometry(
        cache.q,
        cache.k,
        cache.v,
        cache.attn_mask,
        cache.is_causal,
        cache.groups,
        cache.options,
        cache.block_q,
        cache.block_k,
        cache.dropout_p,
        cache.seed,
    )


@shared_doc(**ATTENTION_FORWARD)
def memory_efficient_attention(
    q,
    k,
    v,
    attn_mask=None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    block_size: Optional[int] = None,
    *,
    dropout_p: float = 0.0,
    rng=None,
    enable_gqa: bool = False,
    causal_align: str = "top_left",
    window: Optional[Tuple[int, int]] = None,
    alibi_slopes=None,
    softcap: Optional[float] = None,
    sinks=None,
    mask_grad: bool = False,
) -> Tuple[np.ndarray, MemoryEfficientCache]:
    """``dropout(softmax(q k^T * scale + mask)) v`` computed in blocks, never holding an ``(Lq, Lk)`` array.

    The same result as ``scaled_dot_product_attention`` with the same arguments (the dropout mask
    aside, see below): ``q (..., Hq, Lq, E)``, ``k (..., Hk, Lk, E)``, ``v (..., Hk, Lk, Ev)`` ->
    ``(..., Hq, Lq, Ev)``; inputs without a head axis and any number of leading batch dimensions
    work, and the leading dimensions of q, k, v broadcast against each other as in torch; they
    share one float dtype (integer arrays take it; mixed float dtypes raise ``TypeError``).
    ``scale`` defaults to ``1/sqrt(E)``.  ``attn_mask``: bool (True = may attend) or float (added
    to the scaled scores), broadcastable to ``(..., Hq, Lq, Lk)``; ``is_causal``: query ``i`` sees
    keys ``0..i`` (aligned by ``causal_align``), and may be combined with ``attn_mask``.  A query row
    that may attend to no key gives output 0 and gradient 0, never NaN, under every option.
    ``block_size``: query rows and key columns per block (an int >= 1; need not divide ``L``), or
    None for a measured default (64; smaller when there are very many batch x head matrices).

    * ``dropout_p``/``rng``: dropout on the attention weights, kept weights scaled by ``1/(1-p)``.
      One seed is drawn from ``rng`` per call; the keep-mask of a block is regenerated from it and
      the block's position (``npattn.functional._random.keep_mask``: score ``(..., h, i, j)`` is kept
      iff ``uniform(seed, its flat index in (..., Hq, Lq, Lk)) >= p``), in the forward and again in the
      backward, so no mask is ever stored.  (``scaled_dot_product_attention`` draws its mask
      differently: same ``rng``, different mask.)
    * ``enable_gqa``: ``Hq`` a multiple of ``Hk``; query head ``h`` uses kv head ``h // (Hq // Hk)``,
      without copying k or v (a kv block is broadcast over its query heads inside the matmul).
    * ``causal_align="bottom_right"``: query ``i`` sits at position ``i + Lk - Lq`` (KV-cache decoding);
      ``window=(left, right)``: the query at position ``p`` sees keys ``p - left .. p + right`` (``-1`` =
      unbounded; with ``is_causal`` right is 0); blocks outside the band are never formed, so time and
      memory grow with ``L * window``.  ``alibi_slopes`` (broadcastable to ``(..., Hq)``) adds
      ``-slope_h * |p - j|``; ``softcap`` replaces the scaled scores ``s`` by ``softcap * tanh(s / softcap)``
      before masks and biases; ``sinks`` ``(Hq,)``: one extra logit per head in every row's softmax, with
      value 0; ``mask_grad``: with a float ``attn_mask``, the backward also returns ``dmask``.

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
    a row that has seen only masked keys has ``m = -inf``, and we shift by a finite number instead
    to avoid ``-inf - (-inf)``; a row that never sees a key ends with ``l = 0``: output 0, ``lse`` 0.

    *Dropout* changes only what is summed into ``a``: ``a' = alpha a + (P_B * keep_B) v_B`` while
    ``l`` keeps the sum of all weights (the softmax is taken before dropout); at the end
    ``o = a / l / (1-p)``.  *A sink* ``z`` is a key whose score is ``z`` and whose value is 0: it only
    adds ``exp(z)`` to the denominator, so it is simply the starting point, ``m = z``, ``l = 1``,
    ``a = 0``; a row whose keys are all masked then has ``lse = z`` and output 0.

    *A fixed shift.*  Any shift gives the same ratio, and one that bounds every score of the row
    needs no maximum and no rescaling: without a mask, ALiBi, softcap, sinks or dropout each row is
    first shifted by ``m = scale |q_i| max_j |k_j| >= s_j`` (Cauchy-Schwarz), ``l`` and ``a`` are plain
    sums.  Only the precision differs (``exp(s - m)`` rounds ``s - m``); a query block keeps the
    result when every row's ``l >= n exp(-16)`` for its ``n`` keys (the bound within ~16 of the
    row's scores, nothing underflowed), and is otherwise computed again with the online softmax.

    **Blocks and cost.**  Query blocks of ``block_q`` rows run over key blocks of ``block_k``
    columns (with the default ``block_size``, over longer key blocks, up to a 1 MiB score block per
    thread: fewer online-softmax steps, the GEMMs in slices the BLAS keeps on one thread); each step is two
    batched GEMMs (``S^T = k_j (scale q_i)^T`` and ``P v_j``) and a few elementwise passes over one
    ``(..., keys, block_q)`` buffer.  The key loop covers only the
    band a query block may see (``is_causal`` stops it at the diagonal, ``window`` bounds both
    ends), so blocks outside are never computed; key blocks entirely hidden by a bool
    ``attn_mask`` are skipped.  Memory: the output, ``lse`` and per-thread block buffers; the cache
    keeps ``q, k, v, out, lse``, the mask as given, the dropout seed and the options.

    Returns ``(out, MemoryEfficientCache)``.

    Parameters
    ----------
    <attention_args>
    block_size : int, optional
        Query rows and key columns per block (default: measured).
    <attention_options>

    Returns
    -------
    out : ndarray
        ``(..., Hq, Lq, Ev)``, in q's dtype.
    cache : MemoryEfficientCache
        For ``memory_efficient_attention_backward`` and ``_jvp`` (q, k, v, out and the row
        log-sum-exps: no ``(Lq, Lk)`` array).

    Raises
    ------
    <attention_raises>

    <examples>
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 2, 40, 8)) for _ in range(3))
    >>> out, cache = F.memory_efficient_attention(q, k, v, is_causal=True, block_size=16)
    >>> full, _ = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    >>> bool(np.allclose(out, full, rtol=0, atol=1e-12))
    True
    >>> dq, dk, dv = F.memory_efficient_attention_backward(rng.standard_normal(out.shape), cache)
    >>> dq.shape, dk.shape, dv.shape
    ((1, 2, 40, 8), (1, 2, 40, 8), (1, 2, 40, 8))
    """
    enable_gqa = check_bool(enable_gqa, "enable_gqa")
    q, k, v, groups = check_qkv(q, k, v, enable_gqa)
    is_causal = check_bool(is_causal, "is_causal")
    dropout_p = check_prob(dropout_p, "dropout_p")
    if rng is not None or dropout_p > 0.0:
        rng = as_rng(rng)
    score_shape = out_lead(q.shape, k.shape, v.shape, groups) + (q.shape[-2], k.shape[-2])
    if attn_mask is not None:
        attn_mask = check_mask(attn_mask, "attn_mask", score_shape)
    scale = check_scale(scale, q.shape[-1])
    if block_size is not None:
        check_size(block_size, "block_size")
    options = AttentionOptions(causal_align, window, alibi_slopes, softcap, sinks, mask_grad)
    options = options.checked(score_shape, q.dtype, attn_mask)
    return memory_efficient_attention_kernel(
        q,
        k,
        v,
        attn_mask,
        is_causal,
        scale,
        block_size,
        dropout_p=dropout_p,
        rng=rng,
        enable_gqa=enable_gqa,
        options=options,
    )


@shared_doc(attention_backward_sections=attention_backward_sections("memory_efficient_attention"))
def memory_efficient_attention_backward(dout, cache: MemoryEfficientCache) -> Tuple[np.ndarray, ...]:
    """Gradients of ``memory_efficient_attention``, block by block (FlashAttention-2):
    ``(dq, dk, dv)``, then ``dmask`` (with ``mask_grad``), then ``dsinks`` (with ``sinks``).

    With ``S = softcap(scale q k^T) + bias + mask`` (bias: ALiBi; masked entries ``-inf``),
    ``P = softmax(S)`` row-wise (sinks included), ``P' = P * keep / (1-p)`` and ``O = P' V``, the
    plain backward (see ``scaled_dot_product_attention_backward``) is

        dV = P'^T dO,   dP' = dO V^T,   dP = dP' * keep / (1-p),   dS = P * (dP - rowsum(dP * P)),
        dS_raw = dS * (1 - tanh^2(scale q k^T / softcap))          (softcap; else dS_raw = dS),
        dQ = scale dS_raw K,   dK = scale dS_raw^T Q,   dmask = dS (summed to the mask's shape).

    Two observations make it blockwise with O(L) extra memory:

    1. Any block of ``P`` can be rebuilt exactly from the saved log-sum-exp, since
       ``P_ij = exp(S_ij) / sum_j exp(S_ij) = exp(S_ij - lse_i)``: recompute ``S`` for the block
       (one GEMM and the same options as the forward), subtract ``lse`` and exponentiate.  Masked
       entries are ``-inf`` again, so 0; dropout's keep-mask is regenerated from the seed.
    2. The row sum ``rowsum(dP * P)`` needs a whole row, but it equals
       ``D_i = sum_j dP_ij P_ij = sum_j dP'_ij P'_ij = sum_j (sum_e dO_ie V_je) P'_ij = sum_e dO_ie O_ie``,
       i.e. ``D = rowsum(dO * O)``: O(L) work on arrays we already have, computed once up front
       (dropout included: ``keep / (1-p)`` moves from ``dP`` onto ``P``; a sink adds no term, its
       value is 0).

    Then for every (key block ``j``, query block ``i``) pair inside the band and not wholly masked:

        P = exp(S_ij - lse_i),   dV_j += P'^T dO_i,   dP = (dO_i V_j^T) [* keep / (1-p)],
        dS = P * (dP - D_i),   dQ_i += scale dS_raw K_j,   dK_j += scale dS_raw^T Q_i.

    As in FlashAttention-2 the key blocks are dealt to the worker threads, so each owns disjoint
    rows of ``dK``, ``dV`` and adds ``dQ`` into its own accumulator (summed at the end in a fixed
    order); a worker runs over the query blocks and, inside, over those of its key blocks that a
    query of the block may see (the band).  The blocks are held transposed as in the forward
    (``P^T``, ``dP^T``, ``dS^T``: keys x queries); each query block's ``scale q`` and ``dO`` are
    packed transposed with one more row, ``lse`` and ``D``, and each key block's k and v with one
    more column of -1, so that every product is a plain one for BLAS on contiguous blocks and two of
    them give ``S - lse`` and ``dP - D`` with no elementwise pass (``_BackwardWorker``).  ``scale`` is
    applied to ``dQ`` and ``dK`` once at the end; with dropout ``1/(1-p)`` is folded into ``dO``
    once.  With grouped-query heads or broadcast
    batch dimensions, each gradient is summed over the axes its input was broadcast along.

    **Sinks.**  The sink of head ``h`` is one more logit ``z_h`` in each row's softmax, with weight
    ``P_sink,i = exp(z_h - lse_i)`` and value 0.  Its score enters nowhere else, so
    ``dz_h = sum_i dS_sink,i`` with ``dS_sink,i = P_sink,i (dP_sink,i - D_i)`` (the softmax backward
    for that column) and ``dP_sink,i = dO_i . 0 = 0``: ``dsinks_h = -sum_i P_sink,i D_i`` over every
    query row (and batch) of the head.  ``D`` is the same ``rowsum(dO * O)``.

    A query row that saw no key has ``P = 0`` in every block, hence ``dS = 0``, and ``O = 0``,
    hence ``D = 0``: gradient exactly 0.  Returns the gradients in ``q``'s dtype.

    <attention_backward_sections>
    """
    check_cache(cache, MemoryEfficientCache, "memory_efficient_attention_backward")
    dout = check_grad(dout, cache.out.shape, cache.q.dtype)
    return memory_efficient_attention_backward_kernel(dout, cache)


def memory_efficient_attention_kernel(
    q,
    k,
    v,
    attn_mask=None,
    is_causal=False,
    scale=None,
    block_size=None,
    *,
    dropout_p=0.0,
    rng=None,
    enable_gqa=False,
    causal_align="top_left",
    window=None,
    alibi_slopes=None,
    softcap=None,
    sinks=None,
    mask_grad=False,
    options: Optional[AttentionOptions] = None,
) -> Tuple[np.ndarray, MemoryEfficientCache]:
    """The kernel of ``memory_efficient_attention``: the same signature and numbers, no input checks.

    Its arguments must already be what the public op makes of them: ``q, k, v`` float arrays of
    one dtype whose shapes fit (``enable_gqa`` as checked), a mask that broadcasts, ``rng`` a
    ``np.random.Generator`` when ``dropout_p > 0``, options as checked (``window`` a pair of ints,
    ``alibi_slopes``/``sinks`` arrays of q's dtype); ``scale``/``block_size`` may be None.
    ``options``: the checked ``AttentionOptions`` in one object (then the six option keywords
    are not read), as the public op passes them.
    """
    if options is None:
        options = AttentionOptions(causal_align, window, alibi_slopes, softcap, sinks, mask_grad)
    groups = gqa_groups(q.shape, k.shape, v.shape, enable_gqa)
    scale = float(default_scale(scale, q.shape[-1]))  # a python float: keeps float32 float32
    n_mats = math.prod(out_lead(q.shape, k.shape, v.shape, groups))
    bq, bk = _block_sizes(block_size, n_mats, q.shape[-2], k.shape[-2], max(q.shape[-1], v.shape[-1]))
    seed = draw_seed(rng) if dropout_p > 0.0 else 0
    geo = _geometry(q, k, v, attn_mask, is_causal, groups, options, bq, bk, dropout_p, seed)
    lead, lq, ev = geo.lay.lead, geo.lq, v.shape[-1]
    out = np.empty(lead + (lq, ev), q.dtype)
    lse = np.empty(lead + (lq,), q.dtype)
    tall = _tall_query_block(block_size, bq, bk, max(q.shape[-1], v.shape[-1]), lq)
    gk = max(1, min(_forward_gemm_keys(block_size, tall, bk, max(q.shape[-1], v.shape[-1])), geo.lk))
    fbk = _forward_key_block(block_size, n_mats, tall, gk, geo.lk, geo.dt.itemsize)
    fgeo = geo._replace(bq=tall, bk=fbk)  # the forward's blocks; the cache keeps bq, bk
    bound = _score_bound(geo, scale, options, dropout_p)
    v_log2 = 0.0 if bound is None else _log2_max_abs(geo.lay.v)
    worker = lambda share: _ForwardWorker(fgeo, scale, gk, bound, v_log2).rows(share, out, lse)  # noqa: E731
    _run(worker, geo._replace(bq=tall).shares(_spans(lq, tall)))  # GEMMs of tall x bk x width
    out = out.reshape(geo.lay.out_lead + (lq, ev))
    lse = lse.reshape(geo.lay.out_lead + (lq,))
    bq_backward = _backward_query_block(block_size, bq, bk, max(q.shape[-1], v.shape[-1]), lq, n_mats)
    return out, MemoryEfficientCache(
        q, k, v, out, lse, attn_mask, is_causal, scale, bq, bk, dropout_p, seed, groups, options, bq_backward
    )


class _ForwardWorker:
    """One worker's share of the forward: its own buffers, the query blocks of its share, and the
    online softmax's step for one key block (``geo.bk`` keys; its GEMMs in slices of ``gemm_keys``)."""

    def __init__(
        self, geo: _Geometry, scale: float, gemm_keys: int, bound: Optional[np.ndarray] = None, v_log2: float = 0.0
    ):
        self.geo, self.scale, self.gemm_keys, self.bound, self.v_log2 = geo, scale, gemm_keys, bound, v_log2
        bq, bk, e, ev = geo.bq, geo.bk, geo.lay.q.shape[-1], geo.lay.v.shape[-1]
        # the bounded forward's values, a GEMM slice at a time, with a column of ones: [v_j, 1]
        self.va_buf = None if bound is None else np.ones(geo.lay.v.shape[:-2] + (gemm_keys, ev + 1), geo.dt)
        self.qs_buf = np.empty(math.prod(geo.lay.q.shape[:-2]) * bq * e, geo.dt)
        self.s_buf, self.acc_buf, self.pv_buf = geo.buffer(bk, bq), geo.buffer(ev + 1, bq), geo.buffer(ev + 1, bq)
        self.stat_bufs = [geo.buffer(bq) for _ in range(6)]
        self.max_buf = geo.buffer((geo.bk + 1) // 2, bq)
        self.bias_bufs = geo.scores.buffers(bk, bq)
        self.drop_bufs = None if geo.dropout is None else geo.dropout.buffers(bk, bq)

    def rows(self, share, out, lse):
        """``out`` and ``lse`` (working layout) of the query blocks in ``share``."""
        geo, lay = self.geo, self.geo.lay
        lead, ev = lay.lead, lay.v.shape[-1]
        for i0, i1 in share:
            nq = i1 - i0
            if self.bound is not None:  # scores in base-2 units (_LOG2E)
                qs2_t = _scaled_rows_t(lay.q, i0, i1, self.scale * _LOG2E, self.qs_buf)
                if self.bounded_rows(i0, i1, qs2_t, out, lse):
                    continue
            qs_t = _scaled_rows_t(lay.q, i0, i1, self.scale, self.qs_buf)
            stat_rows = [scratch(b, lead + (1, nq)) for b in self.stat_bufs]
            stats = _OnlineSoftmax(stat_rows, self.max_buf, lay.sinks, geo.dt)
            acc_t = scratch(self.acc_buf, lead + (ev, nq))  # a^T, transposed like the scores
            acc_t.fill(0.0)
            pv_t = scratch(self.pv_buf, lead + (ev, nq))
            c0, c1 = key_range(geo.band, i0, i1, geo.lk)  # the keys some query of the block may see
            for j0, j1 in _spans(c1, geo.bk, c0):
                st = scratch(self.s_buf, lead + (j1 - j0, nq))  # S^T: keys down, queries across
                for a, b in _spans(j1 - j0, self.gemm_keys):
                    np.matmul(lay.k[..., j0 + a : j0 + b, :], qs_t, out=st[..., a:b, :])
                if not geo.scores.apply(st, i0, i1, j0, j1, self.bias_bufs):
                    continue  # every score of this block is masked
                keep = None if geo.dropout is None else geo.dropout.keep_t(i0, i1, j0, j1, self.drop_bufs)
                stats.add_block(st, keep, lay.v[..., j0:j1, :], acc_t, pv_t, self.gemm_keys)
            drop_scale = None if geo.dropout is None else geo.dropout.scale
            stats.finish(acc_t, drop_scale, out[..., i0:i1, :].swapaxes(-1, -2), lse[..., None, i0:i1])

    def bounded_rows(self, i0, i1, qs_t, out, lse) -> bool:
        """``out`` and ``lse`` of the query rows ``i0..i1-1`` with one fixed shift per row, the bound
        ``m >= every score of the row`` (``_score_bound``): ``l = sum_j exp(s_j - m)``, ``a = sum_j
        exp(s_j - m) v_j``, ``o = a / l``, ``lse = m + log l``; no maximum, no rescaling.  Scores and
        ``m`` in base-2 units (``qs_t`` is ``scale log2(e) q^T``): ``exp(s - m) = 2^(s2 - m2)``, ``lse =
        (m2 + log2 l) ln 2``.  When ``n 2^m2 max(1, max|v|)`` is far from overflowing (``n`` keys: ``l``
        and the accumulator ``a`` both stay finite; ``v_log2``), not even the shift
        is taken: ``a / l`` is the same ratio, ``exp2(s2)`` rounds only ``s2``, ``lse = log2(l) ln 2``.
        False (and nothing written) when a row's ``l 2^-m2`` is below ``n exp(-_BOUND_SLACK)``: the
        bound may then sit too far above the row's scores for the exponentials' precision (or they
        underflowed, or the row sees no key); the online softmax takes the block.

        The values go through the products packed a slice at a time with a column of ones, ``[v_j,
        1]``: ``[v_j, 1]^T P^T`` gives ``a^T`` and the key sums ``l`` in one product, one addition."""
        geo, lay, bound, va_buf = self.geo, self.geo.lay, self.bound, self.va_buf
        assert bound is not None and va_buf is not None  # rows() calls this only with a bound
        lead, ev, nq = lay.lead, lay.v.shape[-1], i1 - i0
        m = bound[..., i0:i1]
        acc_t = scratch(self.acc_buf, lead + (ev + 1, nq))  # [a^T; l], transposed like the scores
        acc_t.fill(0.0)
        l_row = acc_t[..., ev:, :]
        pv_t = scratch(self.pv_buf, lead + (ev + 1, nq))
        c0, c1 = key_range(geo.band, i0, i1, geo.lk)
        n = max(c1 - c0, 1)
        shift = not float(np.max(m)) + self.v_log2 < np.finfo(geo.dt).maxexp - 2 - math.log2(n)  # NaN: shift
        for j0, j1 in _spans(c1, geo.bk, c0):
            st = scratch(self.s_buf, lead + (j1 - j0, nq))
            for a, b in _spans(j1 - j0, self.gemm_keys):
                np.matmul(lay.k[..., j0 + a : j0 + b, :], qs_t, out=st[..., a:b, :])
            geo.scores.apply(st, i0, i1, j0, j1, None)  # the band only (no mask, bias or softcap here)
            if shift:
                np.subtract(st, m, out=st)
            np.exp2(st, out=st)  # 2^(s2 - m2) <= 1, or 2^s2 <= 2^m2
            for a, b in _spans(j1 - j0, self.gemm_keys):
                va = va_buf[..., : b - a, :]
                np.copyto(va[..., :ev], lay.v[..., j0 + a : j0 + b, :])
                np.matmul(va.swapaxes(-1, -2), st[..., a:b, :], out=pv_t)
                acc_t += pv_t  # [a^T; l] += [v_j, 1]^T P^T: the key sums as a product, no pass of numpy's
        floor = n * math.exp(-_BOUND_SLACK)
        if not np.all(l_row >= (floor if shift else np.exp2(m) * floor)):
            return False
        np.divide(acc_t[..., :ev, :], l_row, out=out[..., i0:i1, :].swapaxes(-1, -2))
        np.log2(l_row, out=l_row)
        if shift:
            np.add(m, l_row, out=l_row)
        np.multiply(l_row, _LN2, out=lse[..., None, i0:i1])
        return True


# The bounded forward (``_ForwardWorker.bounded_rows``) keeps a row when its exponentials' sum shows the
# bound at most this far above the row's largest score: each exponent ``s - m`` then carries a rounding
# of at most ~_BOUND_SLACK ulp of 1 more than with the row's maximum as the shift.
_BOUND_SLACK = 16.0
# Base-2 exponentials: exp(x) = 2^(x log2 e), with log2 e folded into the scale of q (and into lse in
# the backward).  numpy's float32 exp2 takes half exp's time (0.22 against 0.47 ns an element,
# AVX-512) and rounds no worse (max relative error 1.0e-7 against 2.1e-7 over [-80, 0]).
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


def _score_bound(geo: _Geometry, scale: float, options: AttentionOptions, dropout_p: float):
    """Per query row an upper bound of its scores, ``|scale| |q_i| max_j |k_j|`` (Cauchy-Schwarz;
    ``|scale|``: a negative scale, which torch allows too, flips the scores' sign, not their size),
    ``(lead, 1, Lq)``, times ``log2(e)`` (the bounded forward's base-2 units); None when the scores
    are more than ``scale q k^T`` and the band (a mask, ALiBi, softcap, sinks or dropout: the online
    softmax serves those).

    The online softmax needs, per key block, the maximum of the block's scores (a pass over the
    block), a rescaling of ``l`` and of the accumulator, and long key blocks to make those rare; a
    shift that bounds every score of the row needs none of them, and any shift gives the same
    softmax.  Only the precision differs: ``exp(s - m)`` rounds ``s - m``, so a bound far above the
    row's scores costs digits, and one more than ~87 (float32) above them underflows; the rows' sums
    show both (``bounded_rows``), and such query blocks take the online softmax.  For scores of
    random q, k (E = 64) the bound sits ~9 above the largest score; float32 outputs against float64:
    relative error 2.5e-7 (max) and 3.8e-7 (rms), against 2.1e-7 and 2.8e-7 with the maximum.
    """
    lay = geo.lay
    if lay.mask is not None or lay.slopes is not None or lay.sinks is not None:
        return None
    if geo.lk == 0 or geo.lq == 0 or math.prod(lay.lead) == 0:  # nothing to bound
        return None
    if options.softcap is not None or dropout_p > 0.0:
        return None
    k_norm = np.sqrt(np.max(np.einsum("...je,...je->...j", lay.k, lay.k), axis=-1))[..., None, None]
    q_norm = np.sqrt(np.einsum("...ie,...ie->...i", lay.q, lay.q))[..., None, :]
    return np.broadcast_to(q_norm * (k_norm * (abs(scale) * _LOG2E)), lay.lead + (1, geo.lq))


def _log2_max_abs(v: np.ndarray) -> float:
    """``log2(max(1, max|v|))`` without a copy of ``v`` (NaN when ``v`` holds one): unshifted, the
    bounded forward's accumulator ``a = sum_j 2^(s2_j) v_j`` reaches ``n 2^m2 max|v|``."""
    big = max(float(np.max(v, initial=0.0)), -float(np.min(v, initial=0.0)))
    return math.log2(big) if big > 1.0 else (0.0 if big >= 0.0 else math.nan)


def _key_max(st, tmp, out):
    """``max(st, axis=-2)`` into ``out`` (..., 1, nq) by halving: ``max(x[:h], x[n-h:])`` with
    ``h = ceil(n/2)`` (an overlap compares a row with itself, harmless for a maximum), then the
    same on ``tmp`` until one row is left.  The same numbers as ``np.max`` (a maximum is exact),
    about twice as fast on key-major blocks, whose reduction ``np.max`` runs along the strided
    axis.  ``tmp``: a flat buffer of at least ``ceil(n/2) * st.size // n`` elements."""
    n = st.shape[-2]
    if n == 1:
        np.copyto(out, st)
        return out
    h = (n + 1) // 2
    x = scratch(tmp, st.shape[:-2] + (h, st.shape[-1]))
    np.maximum(st[..., :h, :], st[..., n - h :, :], out=x)
    while h > 1:
        h2 = (h + 1) // 2
        np.maximum(x[..., :h2, :], x[..., h - h2 : h, :], out=x[..., :h2, :])
        h = h2
    np.copyto(out, x[..., :1, :])
    return out


def _scaled_rows_t(qw, i0, i1, scale, buf):
    """``(scale q)^T`` for the query rows ``i0..i1-1``, ``(..., E, nq)`` C-contiguous in ``buf`` (scale
    goes on q, never on the larger score blocks; transposed so that ``S^T = k_j (scale q_i)^T`` is a
    plain product: OpenBLAS runs ``A @ B^T`` through its packing path, about 1.6x slower than ``A @
    B`` at the block sizes used here, its small-matrix kernels take only the other layouts)."""
    qs_t = scratch(buf, qw.shape[:-2] + (qw.shape[-1], i1 - i0))
    return np.multiply(qw[..., i0:i1, :].swapaxes(-1, -2), scale, out=qs_t)


class _OnlineSoftmax:
    """The running statistics of one block of query rows, as rows ``(..., 1, nq)``: the maximum
    ``m`` of the scores seen so far and the sum ``l`` of their exponentials relative to it (see
    ``memory_efficient_attention``); a sink starts them at ``m = sink``, ``l = exp(0) = 1``."""

    def __init__(self, bufs, max_buf, sinks, dt):
        self.m, self.m_new, self.shift, self.alpha, self.l, self.rsum = bufs
        self.max_buf = max_buf  # scratch for ``_key_max``
        self.floor = np.finfo(dt).min
        if sinks is None:
            self.m.fill(-np.inf)
            self.l.fill(0.0)
        else:  # the sink joins first: m = sink, l = exp(0)
            np.copyto(self.m, sinks)
            self.l.fill(1.0)

    def add_block(self, st, keep, v_j, acc_t, pv_t, gemm_keys):
        """One key block of final scores ``st`` (key-major, overwritten by its weights): ``m' =
        max(m, max_B s)``, ``alpha = exp(m - m')``, ``l' = alpha l + rowsum(P_B)`` and ``a' = alpha a
        + (P_B [* keep]) v_B`` (``a`` transposed, ``acc_t``; dropout sums the kept weights only);
        ``P_B v_B`` is summed over slices of ``gemm_keys`` keys."""
        m, m_new, shift, alpha, rsum = self.m, self.m_new, self.shift, self.alpha, self.rsum
        _key_max(st, self.max_buf, m_new)
        np.maximum(m_new, m, out=m_new)  # m' = max(m, max_B s)
        np.maximum(m_new, self.floor, out=shift)  # a row that saw only -inf shifts by a finite number
        np.subtract(m, shift, out=alpha)
        np.exp(alpha, out=alpha)  # alpha = exp(m - m'): 0 on a row's first block
        np.subtract(st, shift, out=st)
        np.exp(st, out=st)  # P_B^T = exp(s_B - m')
        np.sum(st, axis=-2, keepdims=True, out=rsum)
        self.l *= alpha
        self.l += rsum  # l' = alpha l + rowsum(P_B)
        if keep is not None:  # a' sums the kept weights only
            st *= keep
        acc_t *= alpha
        for a, b in _spans(st.shape[-2], gemm_keys):
            np.matmul(v_j[..., a:b, :].swapaxes(-1, -2), st[..., a:b, :], out=pv_t)
            acc_t += pv_t  # a' = alpha a + P_B v_B  (transposed)
        self.m, self.m_new = m_new, m  # m <- m' (swap the two buffers, no copy)

    def finish(self, acc_t, drop_scale, o_t, lse_row):
        """``o = a / l [/ (1-p)]`` into ``o_t`` and ``lse = m + log l`` into ``lse_row``; rows that saw
        no key (``l = 0``) keep ``o = 0``, ``lse = 0``."""
        m, l = self.m, self.l
        empty = l == 0
        if empty.any():
            l[empty] = 1.0
            m[empty] = 0.0
        np.divide(acc_t, l, out=o_t)
        if drop_scale is not None:
            o_t *= drop_scale
        np.log(l, out=l)
        np.add(m, l, out=lse_row)


def memory_efficient_attention_backward_kernel(dout, cache: MemoryEfficientCache) -> Tuple[np.ndarray, ...]:
    """The kernel of ``memory_efficient_attention_backward``: ``dout`` already checked (the
    output's shape, ``q``'s dtype) and ``cache`` a ``MemoryEfficientCache``."""
    geo = _cached_geometry(cache)
    if cache.block_q_backward:
        geo = geo._replace(bq=cache.block_q_backward)
    lay, opts = geo.lay, cache.options
    # base-2 exponentials when the scores are only scale q k^T, a band and a bool mask (-inf in any units)
    base2 = opts.softcap is None and lay.slopes is None and lay.sinks is None
    up = _upstream(geo, dout, cache, base2=base2 and (lay.mask is None or lay.mask.dtype == bool))
    dk, dv = np.zeros(lay.k.shape, geo.dt), np.zeros(lay.v.shape, geo.dt)
    dmask = None
    if opts.mask_grad and lay.mask is not None and cache.attn_mask is not None:
        dmask = _MaskGrad(lay.mask, cache.attn_mask.shape, geo.lk, geo.dt)
    k_blocks = [(j0, j1) for j0, j1 in _spans(geo.lk, geo.bk) if (r := query_range(geo.band, j0, j1, geo.lq))[0] < r[1]]
    shares = geo.shares(k_blocks)
    dqs = [np.zeros(lay.q.shape, geo.dt) for _ in shares]
    dmasks = [None if dmask is None else dmask.for_worker() for _ in shares]
    _run(lambda i: _BackwardWorker(geo, up, dk, dv).columns(shares[i], dqs[i], dmasks[i]), list(range(len(shares))))
    dq = dqs[0]
    for extra in dqs[1:]:
        dq += extra
    dq *= cache.scale
    dk *= cache.scale
    grads: tuple = (dq.reshape(cache.q.shape), dk.reshape(cache.k.shape), dv.reshape(cache.v.shape))
    if dmask is not None:
        grads += (dmask.total(dmasks),)
    if opts.sinks is not None and lay.sinks is not None:
        # The sink is one more logit in each row's softmax, P_sink = exp(sink - lse), with value 0:
        # dP_sink = dO . 0 = 0, so dS_sink = P_sink (dP_sink - D) = -P_sink D, summed over every row
        # (and batch) of its head.
        p_sink = np.exp(lay.sinks - up.lse_row)  # (..., 1, Lq)
        grads += (sum_to(-(p_sink * up.d_row), lay.sinks.shape).reshape(opts.sinks.shape),)
    return grads


class _Upstream(NamedTuple):
    """What every worker of the backward reads, in the working layout: ``dout`` (times ``1/(1-p)``
    with dropout), the rows ``D = rowsum(dO * O)`` and ``lse`` ``(..., 1, Lq)``, and the factor
    ``q_scale`` of ``q`` in the blocks of ``scale q`` the workers pack per query block (``scale``,
    times ``log2(e)`` in base 2); no ``(L, E)``-sized copy."""

    dout: np.ndarray
    d_row: np.ndarray
    lse_row: np.ndarray
    exp: np.ufunc = np.exp  # np.exp2 when q_scale and lse_row are in base-2 units
    q_scale: float = 1.0


def _upstream(geo: _Geometry, dout, cache: MemoryEfficientCache, base2=False) -> _Upstream:
    """``base2``: ``scale q`` and ``lse`` times ``log2(e)``, and ``exp`` is ``np.exp2`` (see ``_LOG2E``);
    only for scores that are ``scale q k^T`` with a band or a bool mask."""
    lead, lq, ev = geo.lay.lead, geo.lq, cache.v.shape[-1]
    dout = dout.reshape(lead + (lq, ev))
    out = cache.out.reshape(lead + (lq, ev))
    # D_i = rowsum(dO * O): O(L) work on arrays we already have; it equals rowsum(dP * P) (see the public op)
    d_row = np.einsum("...e,...e->...", dout, out)[..., None, :]
    if geo.dropout is not None:
        # O = (P * keep / (1-p)) V: fold 1/(1-p) into dO once, for dV = P'^T dO and dP = dP' * keep / (1-p)
        dout = dout * geo.dropout.scale
    lse_row = cache.lse.reshape(lead + (1, lq))
    q_scale = cache.scale * _LOG2E if base2 else cache.scale
    if base2:
        lse_row = lse_row * _LOG2E
    return _Upstream(dout, d_row, lse_row, np.exp2 if base2 else np.exp, q_scale)


class _MaskGrad:
    """``dmask = dS`` summed to the mask's own (broadcast) working-layout shape, returned in the
    caller's ``given`` shape.  Workers own disjoint key blocks, so when the mask has a full key
    axis they write disjoint columns of one array; otherwise each has its own, summed at the end
    in a fixed order."""

    def __init__(self, mask: np.ndarray, given: tuple, lk: int, dt):
        self.shape, self.given, self.dt = mask.shape, given, dt
        self.shared = np.zeros(mask.shape, dt) if mask.shape[-1] == lk and lk > 1 else None

    def for_worker(self) -> np.ndarray:
        return self.shared if self.shared is not None else np.zeros(self.shape, self.dt)

    def total(self, parts: list) -> np.ndarray:
        total = self.shared if self.shared is not None else parts[0]
        for extra in [] if self.shared is not None else parts[1:]:
            total += extra
        return total.reshape(self.given)


class _QueryBlock(NamedTuple):
    """What the backward's pairs of one query block ``i0..i1-1`` read: views of the upstream arrays
    (``lse`` and ``D`` as rows ``(..., 1, nq)``) and of the worker's ``dq``, and the block packed
    (``_BackwardWorker.query_block``): ``qa = [scale q_i^T; lse_i]`` ``(..., E+1, nq)`` and ``da =
    [dO_i^T; D_i]`` ``(..., Ev+1, nq)`` (their last rows 0 where the backward does not fold)."""

    i0: int
    i1: int
    qa: np.ndarray
    q: np.ndarray
    dout: np.ndarray
    da: np.ndarray
    dq: np.ndarray
    lse: np.ndarray
    d: np.ndarray


class _BackwardWorker:
    """One worker's share of the backward: its own buffers, the key blocks of its share (disjoint
    rows of ``dK``, ``dV``: no other worker writes them), and the step for one (key block, query
    block) pair.  Query blocks run outside, the share's key blocks inside.

    Blocks are packed, contiguous, in the worker's buffers: a query block's ``scale q`` and ``dO``
    transposed, each with one more row (``lse``, ``D``), once per query block; a key block's k and
    v with one more column of -1, once per pair.  Then ``[k_j, -1] [scale q_i^T; lse_i] = S^T -
    lse`` and ``[v_j, -1] [dO_i^T; D_i] = dP'^T - D``: the products give the shifted blocks
    (bit for bit the subtraction's result: the extra term is the last fused multiply-add), and no
    elementwise pass subtracts ``lse`` or ``D``; every product reads hot, contiguous blocks.  The
    shift is folded unless softcap needs the raw scores (``fold_lse``), ``D`` unless dropout's
    keep-mask multiplies ``dP'`` first (``fold_d``); the ALiBi bias and the masks are added or
    set after the shift (a sum: the same scores).
    """

    def __init__(self, geo: _Geometry, up: _Upstream, dk: np.ndarray, dv: np.ndarray):
        self.geo, self.up, self.dk, self.dv = geo, up, dk, dv
        lay, bq, bk, dt = geo.lay, geo.bq, geo.bk, geo.dt
        e, ev = lay.q.shape[-1], lay.v.shape[-1]
        self.fold_lse, self.fold_d = geo.scores.softcap is None, geo.dropout is None
        self.s_buf, self.dp_buf = geo.buffer(bk, bq), geo.buffer(bk, bq)
        self.t_buf = geo.buffer(bk, bq) if geo.scores.softcap is not None else None
        # the products dV_j, dQ_i, dK_j of a pair, one after the other
        self.prod_buf = geo.buffer(max(bq, bk), max(e, ev))
        self.qa_buf, self.da_buf = np.zeros(lay.lead + (e + 1, bq), dt), np.zeros(lay.lead + (ev + 1, bq), dt)
        self.ka_buf = np.full(lay.k.shape[:-2] + (bk, e + 1), -1.0, dt)  # columns :E filled per pair
        self.va_buf = np.full(lay.v.shape[:-2] + (bk, ev + 1), -1.0, dt)
        self.bias_bufs = geo.scores.buffers(bk, bq)
        self.drop_bufs = None if geo.dropout is None else geo.dropout.buffers(bk, bq)
        self.pk_buf = None if geo.dropout is None else geo.buffer(bk, bq)

    def columns(self, share, dq, dmask):
        """The key blocks of ``share``: ``dK_j``, ``dV_j`` finished (this worker's own rows of ``dk``,
        ``dv``); ``dQ`` (and ``dmask``) terms added into this worker's ``dq`` (and ``dmask``)."""
        geo = self.geo
        # the queries that see some key of each block (outside the band they see nothing of it)
        cols = [(j0, j1) + query_range(geo.band, j0, j1, geo.lq) for j0, j1 in share]
        for i0, i1 in _spans(geo.lq, geo.bq):
            seen = [(j0, j1) for j0, j1, r0, r1 in cols if r0 < i1 and i0 < r1]
            if seen:
                rows = self.query_block(i0, i1, dq)
                for j0, j1 in seen:
                    self.pair(rows, j0, j1, dmask)

    def query_block(self, i0: int, i1: int, dq) -> _QueryBlock:
        """The block's views, and ``qa``, ``da`` packed (last rows ``lse``, ``D`` where folded, else 0)."""
        up, lay, nq = self.up, self.geo.lay, i1 - i0
        e, ev = lay.q.shape[-1], lay.v.shape[-1]
        qa, da = self.qa_buf[..., :nq], self.da_buf[..., :nq]
        np.multiply(lay.q[..., i0:i1, :].swapaxes(-1, -2), up.q_scale, out=qa[..., :e, :])
        np.copyto(da[..., :ev, :], up.dout[..., i0:i1, :].swapaxes(-1, -2))
        lse, d = up.lse_row[..., i0:i1], up.d_row[..., i0:i1]
        if self.fold_lse:
            np.copyto(qa[..., e:, :], lse)
        if self.fold_d:
            np.copyto(da[..., ev:, :], d)
        return _QueryBlock(i0, i1, qa, lay.q[..., i0:i1, :], up.dout[..., i0:i1, :], da, dq[..., i0:i1, :], lse, d)

    def pair(self, rows: _QueryBlock, j0, j1, dmask):
        """Key block ``j`` against query block ``i``: ``P`` rebuilt from ``lse``, then ``dV_j += P'^T dO_i``,
        ``dS``, ``dQ_i += dS K_j`` and ``dK_j += dS^T Q_i`` (and ``dmask += dS``); k and v broadcast
        over grouped heads or batches have each product summed to their own shape."""
        geo, lay, i0, i1 = self.geo, self.geo.lay, rows.i0, rows.i1
        lead, nk, nq = lay.lead, j1 - j0, i1 - i0
        e, ev = lay.q.shape[-1], lay.v.shape[-1]
        ka, va = self.ka_buf[..., :nk, :], self.va_buf[..., :nk, :]
        np.copyto(ka[..., :e], lay.k[..., j0:j1, :])
        np.copyto(va[..., :ev], lay.v[..., j0:j1, :])
        st = scratch(self.s_buf, lead + (nk, nq))
        np.matmul(ka, rows.qa, out=st)  # S^T - lse = [k_j, -1] [scale q_i^T; lse_i]  (S^T with softcap)
        t = None if self.t_buf is None else scratch(self.t_buf, lead + (nk, nq))
        if not geo.scores.apply(st, i0, i1, j0, j1, self.bias_bufs, tanh_out=t):
            return
        if not self.fold_lse:
            np.subtract(st, rows.lse, out=st)
        pt = self.up.exp(st, out=st)  # P^T = exp(S^T - lse)
        dpt = scratch(self.dp_buf, lead + (nk, nq))
        np.matmul(va, rows.da, out=dpt)  # dP'^T - D = [v_j, -1] [dO_i^T; D_i]  (dP'^T with dropout)
        prod = scratch(self.prod_buf, lead + (nk, ev))
        if geo.dropout is not None and self.pk_buf is not None:
            keep = geo.dropout.keep_t(i0, i1, j0, j1, self.drop_bufs)
            dpt *= keep  # dP = dP' * keep / (1-p)
            np.subtract(dpt, rows.d, out=dpt)
            pk = np.multiply(pt, keep, out=scratch(self.pk_buf, st.shape))
            np.matmul(pk, rows.dout, out=prod)  # dV_j += (P * keep)^T dO_i / (1-p)
        else:
            np.matmul(pt, rows.dout, out=prod)  # dV_j += P^T dO_i
        dv_j, dk_j = self.dv[..., j0:j1, :], self.dk[..., j0:j1, :]
        dv_j += sum_to(prod, dv_j.shape)
        dst = np.multiply(dpt, pt, out=dpt)  # dS^T = P^T * (dP^T - D)
        if dmask is not None:  # the mask is added to S: dmask = dS
            dm = _mask_block(dmask, i0, i1, j0, j1)
            dm += sum_to(dst, dm.shape)
        if t is not None:  # through softcap * tanh(S_raw / softcap)
            np.multiply(t, t, out=t)
            np.subtract(1.0, t, out=t)
            dst *= t  # dS_raw = dS * (1 - tanh^2)
        prod = scratch(self.prod_buf, lead + (nq, e))
        np.matmul(dst.swapaxes(-1, -2), ka[..., :e], out=prod)
        dq_i = rows.dq
        dq_i += sum_to(prod, dq_i.shape)  # dQ_i += dS K_j (scaled at the end)
        prod = scratch(self.prod_buf, lead + (nk, e))
        np.matmul(dst, rows.q, out=prod)
        dk_j += sum_to(prod, dk_j.shape)  # dK_j += dS^T Q_i (scaled at the end)


@shared_doc(
    attention_jvp_sections=attention_jvp_sections("memory_efficient_attention", "MemoryEfficientCache"),
)
def memory_efficient_attention_jvp(cache: MemoryEfficientCache, *tangents) -> np.ndarray:
    """Forward mode of ``memory_efficient_attention``, block by block: never an ``(Lq, Lk)`` array.

    With ``S = softcap(scale q k^T) + bias + mask`` (``-inf`` where hidden), ``P = softmax(S)`` (the
    sink's logit included), ``P' = P * keep / (1-p)`` and ``O = P' V``, the tangent along ``(tq, tk,
    tv, tmask, tsinks)`` is (see ``scaled_dot_product_attention_jvp`` for each step)

        tS = scale (tq K^T + Q tk^T) [* (1 - tanh^2)] + tmask,
        tP = P * (tS - mu),   mu_i = sum_j P_ij tS_ij + P_sink,i tsink_h,
        tO = tP' V + P' tV  =  sum_j P'_ij (tS_ij V_j + tV_j) - O_i mu_i,

    the last line because ``sum_j P'_ij V_j = O_i``.  That is the online form: per query row, two
    sums over the keys, ``a = sum_j P'_ij (tS_ij V_j + tV_j)`` (a vector of width ``Ev``) and
    ``mu`` (one number), each a sum of one term per key block.  In the forward the weights of a
    block were not known until the last block had raised the running maximum ``m`` (hence its
    rescaling by ``exp(m - m')``); here the forward's log-sum-exp ``lse`` is known, so every
    block's weights are exact at once, ``P = exp(S - lse)`` (as in the backward), and the sums
    need no rescaling: ``a += (P' * tS) V_j + P'^T tV_j``, ``mu += rowsum(P * tS)`` per block, and
    at the end ``tO = a - O mu``.  (Unnormalised, with ``e = exp(S - m)``, ``l = sum e``: ``tO =
    sum e (tS V + tV) / l - O sum e tS / l``, the forward's accumulators with the same
    rescaling; dividing by ``l = exp(lse - m)`` turns ``e / l`` into ``P``.)

    Per (query block, key block) of the band: three GEMMs of the forward's size (``S``, ``tS`` from
    ``tq`` and from ``tk``) and two for ``a``; dropout's keep-mask is regenerated from the seed as
    in the backward; grouped-query heads and broadcast batches are views (k, v never repeated).
    Memory: the tangent, the inputs' tangents and per-thread block buffers.

    <attention_jvp_sections>

    <examples>
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 2, 5, 4)) for _ in range(3))
    >>> tq, tk, tv = (rng.standard_normal((1, 2, 5, 4)) for _ in range(3))
    >>> out, cache = F.memory_efficient_attention(q, k, v, is_causal=True, block_size=2)
    >>> tout = F.memory_efficient_attention_jvp(cache, tq, tk, tv)
    >>> f = lambda s: F.memory_efficient_attention(q + s * tq, k + s * tk, v + s * tv, is_causal=True, block_size=2)[0]
    >>> fd = (f(1e-6) - f(-1e-6)) / 2e-6                # the central difference along the tangent
    >>> bool(np.allclose(tout, fd, rtol=1e-5, atol=1e-7))
    True
    """
    check_cache(cache, MemoryEfficientCache, "memory_efficient_attention_jvp")
    checked = check_tangents_as(tangents, "memory_efficient_attention_jvp", cache.q.dtype, _tangent_specs(cache))
    has_mask_grad = cache.options.mask_grad and cache.attn_mask is not None
    return memory_efficient_attention_jvp_kernel(
        cache, *split_attention_tangents(checked, has_mask_grad, cache.options.sinks is not None)
    )


def memory_efficient_attention_jvp_kernel(
    cache: MemoryEfficientCache, tq=None, tk=None, tv=None, tmask=None, tsinks=None
):
    """The kernel of ``memory_efficient_attention_jvp``: tangents checked (each of its input's own
    shape, q's dtype) or None (zero)."""
    geo = _cached_geometry(cache)
    tout, _ = _tangent_and_mean(geo, cache, _tangent_layout(cache, tq, tk, tv, tmask, tsinks))
    return tout.reshape(geo.lay.out_lead + (geo.lq, cache.v.shape[-1]))


class _Tangents(NamedTuple):
    """The tangents in the forward's working layout (views), None for zero."""

    q: Optional[np.ndarray]
    k: Optional[np.ndarray]
    v: Optional[np.ndarray]
    mask: Optional[np.ndarray]
    sinks: Optional[np.ndarray]


def _tangent_layout(cache: MemoryEfficientCache, tq, tk, tv, tmask, tsinks) -> _Tangents:
    """The tangents viewed as their inputs are (a None tangent borrows its input's place, unused)."""
    tlay = _layout(
        cache.q if tq is None else tq,
        cache.k if tk is None else tk,
        cache.v if tv is None else tv,
        cache.groups,
        cache.attn_mask if tmask is None else tmask,
        None,
        cache.options.sinks if tsinks is None else tsinks,
    )
    given = (tq, tk, tv, tmask, tsinks)
    viewed = (tlay.q, tlay.k, tlay.v, tlay.mask, tlay.sinks)
    return _Tangents(*(None if t is None else w for t, w in zip(given, viewed)))


class _JvpWorker:
    """One worker's share of the JVP: its own buffers, the query blocks of its share, and the step
    for one key block (the sums ``a`` and ``mu`` of ``memory_efficient_attention_jvp``)."""

    def __init__(self, geo: _Geometry, scale: float, tan: _Tangents):
        self.geo, self.scale, self.tan = geo, scale, tan
        lay, bq, bk, dt = geo.lay, geo.bq, geo.bk, geo.dt
        e, ev = lay.q.shape[-1], lay.v.shape[-1]
        self.has_ts = tan.q is not None or tan.k is not None  # tS from the scores' inputs
        self.has_tz = self.has_ts or tan.mask is not None  # any tangent of the logits
        self.qs_buf = np.empty(math.prod(lay.q.shape[:-2]) * bq * e, dt)
        self.tqs_buf = None if tan.q is None else np.empty(math.prod(tan.q.shape[:-2]) * bq * e, dt)
        self.s_buf = geo.buffer(bk, bq)
        self.tz_buf = geo.buffer(bk, bq) if self.has_tz else None
        self.part_buf = geo.buffer(bk, bq) if tan.q is not None and tan.k is not None else None
        self.t_buf = geo.buffer(bk, bq) if geo.scores.softcap is not None and self.has_ts else None
        self.acc_buf, self.pv_buf = geo.buffer(ev, bq), geo.buffer(ev, bq)
        self.mu_buf, self.rsum_buf = geo.buffer(bq), geo.buffer(bq)
        self.bias_bufs = geo.scores.buffers(bk, bq)
        self.drop_bufs = None if geo.dropout is None else geo.dropout.buffers(bk, bq)

    def rows(self, share, out_w, lse_row, tout, mu_out=None):
        """``tout`` (working layout) of the query blocks in ``share``: ``tO = a [/ (1-p)] - O mu``;
        ``mu`` of each row into ``mu_out`` ``(..., 1, Lq)`` if given (the second order needs it)."""
        geo, lay, tan = self.geo, self.geo.lay, self.tan
        lead, ev = lay.lead, lay.v.shape[-1]
        for i0, i1 in share:
            nq = i1 - i0
            qs_t = _scaled_rows_t(lay.q, i0, i1, self.scale, self.qs_buf)
            tqs_t = None if tan.q is None else _scaled_rows_t(tan.q, i0, i1, self.scale, self.tqs_buf)
            acc_t = scratch(self.acc_buf, lead + (ev, nq))  # a^T, transposed like the scores
            acc_t.fill(0.0)
            pv_t = scratch(self.pv_buf, lead + (ev, nq))
            mu = scratch(self.mu_buf, lead + (1, nq))
            mu.fill(0.0)
            c0, c1 = key_range(geo.band, i0, i1, geo.lk)
            for j0, j1 in _spans(c1, geo.bk, c0):
                self.pair(i0, i1, j0, j1, qs_t, tqs_t, lse_row, acc_t, pv_t, mu)
            if tan.sinks is not None:  # the sink's logit moves too: mu += P_sink tsink
                mu += np.exp(lay.sinks - lse_row[..., i0:i1]) * tan.sinks
            if mu_out is not None:
                np.copyto(mu_out[..., i0:i1], mu)
            # tO = a [/ (1-p)] - O mu; a row that saw no key has a = 0 and O = 0
            to_t = tout[..., i0:i1, :].swapaxes(-1, -2)
            if geo.dropout is not None:
                np.multiply(acc_t, geo.dropout.scale, out=to_t)
            else:
                np.copyto(to_t, acc_t)
            np.multiply(out_w[..., i0:i1, :].swapaxes(-1, -2), mu, out=pv_t)
            to_t -= pv_t

    def pair(self, i0, i1, j0, j1, qs_t, tqs_t, lse_row, acc_t, pv_t, mu):
        """Query block ``i`` against key block ``j``: ``P = exp(S - lse)`` (exact), then ``a += (P' *
        tS) V_j + P'^T tV_j`` and ``mu += rowsum(P * tS)``."""
        geo, lay, tan = self.geo, self.geo.lay, self.tan
        nk, nq = j1 - j0, i1 - i0
        st = scratch(self.s_buf, lay.lead + (nk, nq))  # S^T: keys down, queries across
        np.matmul(lay.k[..., j0:j1, :], qs_t, out=st)
        t = None if self.t_buf is None else scratch(self.t_buf, st.shape)
        if not geo.scores.apply(st, i0, i1, j0, j1, self.bias_bufs, tanh_out=t):
            return  # every score of this block is masked: P = 0
        np.subtract(st, lse_row[..., i0:i1], out=st)
        pt = np.exp(st, out=st)  # P^T = exp(S^T - lse), exact
        tz = self._weighted_logit_tangent(i0, i1, j0, j1, qs_t, tqs_t, t, pt, mu) if self.has_tz else None
        if geo.dropout is not None:  # a sums the kept weights only (1/(1-p) at the end)
            keep = geo.dropout.keep_t(i0, i1, j0, j1, self.drop_bufs)
            pt *= keep
            if tz is not None:
                tz *= keep
        if tz is not None:
            np.matmul(lay.v[..., j0:j1, :].swapaxes(-1, -2), tz, out=pv_t)
            acc_t += pv_t  # a += (P' * tS) V_j  (transposed)
        if tan.v is not None:
            np.matmul(tan.v[..., j0:j1, :].swapaxes(-1, -2), pt, out=pv_t)
            acc_t += pv_t  # a += P'^T tV_j

    def _weighted_logit_tangent(self, i0, i1, j0, j1, qs_t, tqs_t, t, pt, mu):
        """``P * tS`` of the block (key-major, in this worker's buffer), its row sums added to ``mu``:
        ``tS = (K (scale tq)^T + tK (scale q)^T) [* (1 - tanh^2)] + tmask``."""
        kw, tan = self.geo.lay.k, self.tan
        tz = scratch(self.tz_buf, pt.shape)  # tS^T
        if tqs_t is not None:
            np.matmul(kw[..., j0:j1, :], tqs_t, out=tz)  # K (scale tq)^T
        if tan.k is not None:
            if tqs_t is None:
                np.matmul(tan.k[..., j0:j1, :], qs_t, out=tz)
            else:
                tz += np.matmul(tan.k[..., j0:j1, :], qs_t, out=scratch(self.part_buf, tz.shape))
        if t is not None:  # through softcap: (1 - tanh^2)
            np.multiply(t, t, out=t)
            np.subtract(1.0, t, out=t)
            tz *= t
        if tan.mask is not None:
            mb = _mask_block(tan.mask, i0, i1, j0, j1)
            if self.has_ts:
                tz += mb
            else:
                np.copyto(tz, np.broadcast_to(mb, tz.shape))
        tz *= pt  # P * tS
        rsum = scratch(self.rsum_buf, mu.shape)
        np.sum(tz, axis=-2, keepdims=True, out=rsum)
        mu += rsum  # mu += rowsum(P * tS)
        return tz


@shared_doc(
    attention_backward_jvp_sections=attention_backward_jvp_sections(
        "memory_efficient_attention", "MemoryEfficientCache"
    ),
)
def memory_efficient_attention_backward_jvp(dout, cache: MemoryEfficientCache, tangents, ddout=None) -> tuple:
    """Second order of ``memory_efficient_attention``, block by block: never an ``(Lq, Lk)`` array.

    Returns ``(grads, grad_tangents)``: ``grads`` is ``memory_efficient_attention_backward(dout,
    cache)``, ``grad_tangents`` their directional derivatives when the inputs move along
    ``tangents`` and ``dout`` along ``ddout`` (arguments and lines as
    ``scaled_dot_product_attention_backward_jvp``).

    The backward's lines need, per (key block, query block) pair, ``P = exp(S - lse)`` (recomputed
    as the backward does) and its tangent ``tP = P (tS - mu)``, where ``mu_i = sum_j P_ij tS_ij +
    P_sink,i tsink`` needs a whole row: the JVP's pass gives it, with the output's tangent ``tO``,
    first (O(L) each).  The row sums of the backward, ``D = rowsum(dO * O)``, then move as a
    product, ``tD = rowsum(ddO * O + dO * tO)`` (O(L) again), and every pair adds

        tdV_j += tP'^T dO_i + P'^T ddO_i,   tdP = (ddO_i V_j^T + dO_i tV_j^T) [* keep / (1-p)],
        tdS = tP (dP - D_i) + P (tdP - tD_i),
        tds = tdS (1 - T^2) - 2 dS T (1 - T^2) tS_raw / softcap     (softcap; else tds = tdS),
        tdQ_i += scale (tds K_j + ds tK_j),   tdK_j += scale (tds^T Q_i + ds^T tQ_i),   tdmask += tdS,

    and ``tdsinks = -sum (tP_sink D + P_sink tD)`` with ``tP_sink = P_sink (tsink - mu)``.
    Dropout's keep-mask is regenerated from the seed; grouped-query heads and broadcast batches
    are views.  Memory: the gradients, their tangents, O(L) rows and per-thread blocks.

    <attention_backward_jvp_sections>

    <examples>
    >>> rng = np.random.default_rng(0)
    >>> q, k, v, tq, tk, tv, dy = (rng.standard_normal((1, 2, 5, 3)) for _ in range(7))
    >>> out, cache = F.memory_efficient_attention(q, k, v, is_causal=True, block_size=2)
    >>> grads, tangents = F.memory_efficient_attention_backward_jvp(dy, cache, (tq, tk, tv))
    >>> _, plain = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    >>> want = F.scaled_dot_product_attention_backward_jvp(dy, plain, (tq, tk, tv))[1]
    >>> all(np.allclose(a, b, rtol=0, atol=1e-12) for a, b in zip(tangents, want))
    True
    """
    op = "memory_efficient_attention_backward_jvp"
    check_cache(cache, MemoryEfficientCache, op)
    dout, tangents, ddout = check_backward_jvp(
        dout, tangents, ddout, op, cache.out.shape, cache.q.dtype, _tangent_specs(cache)
    )
    return memory_efficient_attention_backward_jvp_kernel(dout, cache, tangents, ddout)


def _tangent_specs(cache: MemoryEfficientCache) -> tuple:
    """The tangents' specs (``_blocks.attention_tangent_specs``), the JVP's and the second order's."""
    mask = cache.attn_mask if cache.options.mask_grad else None
    return attention_tangent_specs(
        (cache.q.shape, cache.k.shape, cache.v.shape),
        None if mask is None else mask.shape,
        None if cache.options.sinks is None else cache.options.sinks.shape,
    )


def memory_efficient_attention_backward_jvp_kernel(dout, cache: MemoryEfficientCache, tangents=(), ddout=None) -> tuple:
    """The kernel of ``memory_efficient_attention_backward_jvp``: ``dout`` (``ddout``, None for zero)
    and ``tangents`` (the backward's order, each None or of its input's own shape) checked."""
    opts = cache.options
    has_mask_grad = opts.mask_grad and cache.attn_mask is not None
    tq, tk, tv, tmask, tsinks = split_attention_tangents(tangents, has_mask_grad, opts.sinks is not None)
    grads = memory_efficient_attention_backward_kernel(dout, cache)
    geo = _cached_geometry(cache)
    lay, lead, lq, ev = geo.lay, geo.lay.lead, geo.lq, cache.v.shape[-1]
    tan = _tangent_layout(cache, tq, tk, tv, tmask, tsinks)
    tout, mu = _tangent_and_mean(geo, cache, tan)  # (lead, Lq, Ev), (lead, 1, Lq)
    up = _upstream(geo, dout, cache)
    ddo = None if ddout is None else ddout.reshape(lead + (lq, ev))
    # tD = rowsum(ddO * O + dO * tO): the tangent of D = rowsum(dO * O)
    td = np.einsum("...e,...e->...", dout.reshape(lead + (lq, ev)), tout)
    if ddo is not None:
        td += np.einsum("...e,...e->...", ddo, cache.out.reshape(lead + (lq, ev)))
    if ddo is not None and geo.dropout is not None:
        ddo = ddo * geo.dropout.scale  # folded as dO is (_upstream)
    del tout  # only tD needs it: not held through the key blocks (the peak memory)
    rows = _TangentRows(ddo, td[..., None, :], mu, tan.q, cache.scale)
    tdk, tdv = np.zeros(lay.k.shape, geo.dt), np.zeros(lay.v.shape, geo.dt)
    tdmask = None
    if has_mask_grad and lay.mask is not None and cache.attn_mask is not None:
        tdmask = _MaskGrad(lay.mask, cache.attn_mask.shape, geo.lk, geo.dt)
    k_blocks = [(j0, j1) for j0, j1 in _spans(geo.lk, geo.bk) if (r := query_range(geo.band, j0, j1, lq))[0] < r[1]]
    shares = geo.shares(k_blocks)
    tdqs = [np.zeros(lay.q.shape, geo.dt) for _ in shares]
    tdmasks = [None if tdmask is None else tdmask.for_worker() for _ in shares]
    worker = _BackwardJvpWorker(geo, up, rows, tan, tdk, tdv)
    _run(lambda i: worker.columns(shares[i], tdqs[i], tdmasks[i]), list(range(len(shares))))
    tdq = tdqs[0]
    for extra in tdqs[1:]:
        tdq += extra
    tdq *= cache.scale
    out: tuple = (tdq.reshape(cache.q.shape), tdk.reshape(cache.k.shape), tdv.reshape(cache.v.shape))
    if tdmask is not None:
        out += (tdmask.total(tdmasks),)
    if opts.sinks is not None and lay.sinks is not None:
        # dsink = -sum P_sink D with P_sink = exp(sink - lse): tdsink = -sum (tP_sink D + P_sink tD),
        # tP_sink = P_sink (tsink - mu) (the sink's logit is one more of the softmax)
        p_sink = np.exp(lay.sinks - up.lse_row)
        tp_sink = p_sink * ((0.0 if tan.sinks is None else tan.sinks) - mu)
        out += (sum_to(-(tp_sink * up.d_row + p_sink * rows.td), lay.sinks.shape).reshape(opts.sinks.shape),)
    return grads, out


def _tangent_and_mean(geo: _Geometry, cache: MemoryEfficientCache, tan: _Tangents):
    """The JVP's pass in the working layout: ``(tO (lead, Lq, Ev), mu (lead, 1, Lq))``, ``mu`` the
    softmax's mean ``rowsum(P tS) + P_sink tsink`` of every row."""
    lead, lq, ev = geo.lay.lead, geo.lq, cache.v.shape[-1]
    out_w = cache.out.reshape(lead + (lq, ev))
    lse_row = cache.lse.reshape(lead + (1, lq))
    tout = np.empty(lead + (lq, ev), geo.dt)
    mu = np.empty(lead + (1, lq), geo.dt)
    worker = lambda share: _JvpWorker(geo, cache.scale, tan).rows(share, out_w, lse_row, tout, mu)  # noqa: E731
    _run(worker, geo.shares(_spans(lq, geo.bq)))
    return tout, mu


class _TangentRows(NamedTuple):
    """What every worker of the second order reads beside ``_Upstream``, in the working layout:
    ``ddO`` (times ``1/(1-p)`` with dropout; None for zero), the rows ``tD`` and ``mu``
    ``(..., 1, Lq)``, and ``tq`` (None for zero) with the ``scale`` each block of its rows is
    multiplied by (``scale tq`` block by block, not a second q-sized array)."""

    ddout: Optional[np.ndarray]
    td: np.ndarray
    mu: np.ndarray
    tq: Optional[np.ndarray]
    scale: float


class _BackwardJvpWorker:
    """The second order's key blocks (a worker's share): per key block ``j``, ``tdK_j``, ``tdV_j``
    finished; per (key block, query block) pair the backward's lines and their tangents
    (``memory_efficient_attention_backward_jvp``), ``tdQ`` (and ``tdmask``) terms added into the
    worker's own arrays.  Blocks are key-major, as in the backward."""

    def __init__(self, geo: _Geometry, up: _Upstream, rows: _TangentRows, tan: _Tangents, tdk, tdv):
        self.geo, self.up, self.rows, self.tan, self.tdk, self.tdv = geo, up, rows, tan, tdk, tdv

    def columns(self, share, tdq, tdmask):
        geo, lead = self.geo, self.geo.lay.lead
        e, ev = geo.lay.q.shape[-1], geo.lay.v.shape[-1]
        for j0, j1 in share:
            tdk_j, tdv_j = np.zeros(lead + (j1 - j0, e), geo.dt), np.zeros(lead + (j1 - j0, ev), geo.dt)
            i_lo, i_hi = query_range(geo.band, j0, j1, geo.lq)
            for i0, i1 in _spans(i_hi, geo.bq, i_lo):
                self.pair(i0, i1, j0, j1, tdk_j, tdv_j, tdq, tdmask)
            tdk_j *= self.rows.scale
            dk_s, dv_s = self.tdk[..., j0:j1, :], self.tdv[..., j0:j1, :]
            dk_s += sum_to(tdk_j, dk_s.shape)
            dv_s += sum_to(tdv_j, dv_s.shape)

    def pair(self, i0, i1, j0, j1, tdk_j, tdv_j, tdq, tdmask):
        geo, up, rows, tan, lay = self.geo, self.up, self.rows, self.tan, self.geo.lay
        k_j, v_j = lay.k[..., j0:j1, :], lay.v[..., j0:j1, :]
        qs_t = _scaled_rows_t(
            lay.q, i0, i1, up.q_scale, np.empty(math.prod(lay.lead) * (i1 - i0) * lay.q.shape[-1], geo.dt)
        )
        st = np.matmul(k_j, qs_t)  # S^T = k_j (scale q_i)^T
        t = None if geo.scores.softcap is None else np.empty(st.shape, geo.dt)
        if not geo.scores.apply(st, i0, i1, j0, j1, geo.scores.buffers(j1 - j0, i1 - i0), tanh_out=t):
            return
        p = np.exp(st - up.lse_row[..., i0:i1])  # P^T = exp(S^T - lse)
        ts = None  # tS_raw^T = K_j (scale tq_i)^T + tK_j (scale q_i)^T
        tqs = None if rows.tq is None else rows.tq[..., i0:i1, :] * rows.scale
        if tqs is not None:
            ts = np.matmul(k_j, tqs.swapaxes(-1, -2))
        if tan.k is not None:
            part = np.matmul(tan.k[..., j0:j1, :], qs_t)
            ts = part if ts is None else ts + part
        dcap = None if t is None else 1.0 - t * t
        tz = None if ts is None else (ts if dcap is None else ts * dcap)
        if tan.mask is not None:
            mb = _mask_block(tan.mask, i0, i1, j0, j1)
            tz = mb if tz is None else tz + mb
        tp = p * ((0.0 if tz is None else tz) - rows.mu[..., i0:i1])  # tP = P (tS - mu)
        do = up.dout[..., i0:i1, :]
        ddo = None if rows.ddout is None else rows.ddout[..., i0:i1, :]
        keep = (
            None if geo.dropout is None else geo.dropout.keep_t(i0, i1, j0, j1, geo.dropout.buffers(j1 - j0, i1 - i0))
        )
        pk, tpk = (p, tp) if keep is None else (p * keep, tp * keep)
        tdv_j += np.matmul(tpk, do)  # tdV_j += tP'^T dO_i + P'^T ddO_i (1/(1-p) folded into dO)
        dp = np.matmul(v_j, do.swapaxes(-1, -2))
        tdp = np.zeros_like(dp)
        if ddo is not None:
            tdv_j += np.matmul(pk, ddo)
            tdp += np.matmul(v_j, ddo.swapaxes(-1, -2))
        if tan.v is not None:
            tdp += np.matmul(tan.v[..., j0:j1, :], do.swapaxes(-1, -2))
        if keep is not None:
            dp, tdp = dp * keep, tdp * keep
        d, td = up.d_row[..., i0:i1], rows.td[..., i0:i1]
        ds = p * (dp - d)  # dS^T = P^T (dP^T - D)
        tds = tp * (dp - d) + p * (tdp - td)
        if tdmask is not None:  # dmask = dS
            dm = _mask_block(tdmask, i0, i1, j0, j1)
            dm += sum_to(tds, dm.shape)
        if dcap is not None and t is not None:  # through softcap, T = tanh(S_raw / softcap)
            if ts is not None:
                tds = tds * dcap - (2.0 / geo.scores.softcap) * ds * t * dcap * ts
            else:
                tds = tds * dcap
            ds = ds * dcap
        tdq_i = np.matmul(tds.swapaxes(-1, -2), k_j)  # tdQ_i += tds K_j + ds tK_j (scaled at the end)
        tdk_j += np.matmul(tds, lay.q[..., i0:i1, :])  # tdK_j += tds^T Q_i + ds^T tQ_i (scaled per key block)
        if tan.k is not None:
            tdq_i += np.matmul(ds.swapaxes(-1, -2), tan.k[..., j0:j1, :])
        if rows.tq is not None:
            tdk_j += np.matmul(ds, rows.tq[..., i0:i1, :])
        dq_i = tdq[..., i0:i1, :]
        dq_i += sum_to(tdq_i, dq_i.shape)

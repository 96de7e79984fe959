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
  reuses them for every block; ``scale`` multiplies ``q`` (once per query block in the forward,
  once in all in the backward), never the larger score blocks; only the blocks straddling the
  causal diagonal pay for the causal mask.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, Optional, Tuple

import numpy as np

from .._validate import (
    as_rng,
    check_bool,
    check_cache,
    check_grad,
    check_mask,
    check_prob,
    check_size,
)
from ._blocks import (
    Band,
    band,
    band_hidden,
    check_attention_tangents,
    check_options,
    check_qkv,
    check_scale,
    key_range,
    out_lead,
)
from ._random import draw_seed, keep_into

__all__ = [
    "MemoryEfficientCache",
    "memory_efficient_attention",
    "memory_efficient_attention_backward",
    "memory_efficient_attention_jvp",
]


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

    ``q, k, v`` as given (after casting; never broadcast or repeated), ``out`` the output;
    ``lse`` is the per-row log-sum-exp of the final scores (sinks included), ``(..., Hq, Lq)``
    (0 for a query row that may attend to no key and has no sink); ``attn_mask`` is the mask
    exactly as the caller gave it (never expanded or copied); ``block_q``/``block_k`` are the
    block sizes used.  Dropout keeps only ``dropout_p`` and the ``seed`` its blocks are
    regenerated from; the options are kept as checked.
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
    causal_align: str = "top_left"
    window: Optional[Tuple[int, int]] = None
    alibi_slopes: Optional[np.ndarray] = None
    softcap: Optional[float] = None
    sinks: Optional[np.ndarray] = None
    mask_grad: bool = False


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


def _buffer(flat: np.ndarray, shape) -> np.ndarray:
    """A C-contiguous ``shape`` view on the front of the preallocated 1-d buffer ``flat``.

    Blocks at the ragged end of a sequence are smaller than the buffer; taking the view this
    way (instead of slicing a 2-d buffer) keeps it contiguous, which BLAS and ``out=`` like.
    """
    return flat[: math.prod(shape)].reshape(shape)


def _blocks(n: int, size: int, start: int = 0):
    return [(a, min(a + size, n)) for a in range(start, n, size)]


# -- the working layout -----------------------------------------------------------------------------
# Every block operation is one batched numpy call over all leading dimensions.  So that it
# broadcasts instead of copying, each array is *viewed* (reshape that splits or inserts axes: no
# copy) with the same number of leading dimensions ``lead``:
#
# * grouped-query attention splits the ``Hq`` query heads as ``(Hk, G)`` (query head ``h = hk*G + g``
#   uses kv head ``hk = h // G``) and gives k and v a head axis ``(Hk, 1)``: a batched matmul of a
#   ``(..., Hk, 1, n, E)`` key block with ``(..., Hk, G, E, m)`` queries reuses each kv head for its
#   G query heads without repeating it;
# * leading (batch) dimensions of q, k, v broadcast against each other as in torch; gradients are
#   summed back over the dimensions an input was broadcast along;
# * a mask, ALiBi slopes and sinks are viewed the same way (their head axis split like q's).
#
# ``lead`` flattened in C order is exactly the output's leading shape ``(..., Hq)`` flattened
# (``h = hk*G + g``), so the output, ``lse`` and dropout's flat score index are those of the
# ungrouped ``(..., Hq, Lq, Lk)`` score array.


def _pad(a: np.ndarray, n: int) -> np.ndarray:
    """``a`` viewed with ``n`` dimensions: leading 1s added (or dropped: they must be 1)."""
    if a.ndim < n:
        return a.reshape((1,) * (n - a.ndim) + a.shape)
    if a.ndim > n:
        return a.reshape(a.shape[a.ndim - n :])
    return a


def _split_head(a: np.ndarray, axis: int, groups: int) -> np.ndarray:
    """Axis ``axis`` of ``a`` (``Hq`` query heads, or 1) viewed as ``(Hk, G)`` (or ``(1, 1)``)."""
    if groups == 1:
        return a
    n = a.shape[axis]
    axis %= a.ndim
    return a.reshape(a.shape[:axis] + ((n // groups, groups) if n != 1 else (1, 1)) + a.shape[axis + 1 :])


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
    q, k, v = _pad(q, nd), _pad(k, nd), _pad(v, nd)
    if groups > 1:
        q = _split_head(q, -3, groups)
        k, v = (a.reshape(a.shape[:-3] + (a.shape[-3], 1) + a.shape[-2:]) for a in (k, v))  # (Hk or 1, 1)
    lead = tuple(np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))
    out_lead = lead[:-2] + (lead[-2] * lead[-1],) if groups > 1 else lead
    n = len(out_lead)

    def view(a, tail):  # leading (..., Hq) + tail -> leading (..., Hk, G) + tail
        a = _pad(a, n + tail)
        return _split_head(a, n - 1, groups) if groups > 1 else a

    mask = None if attn_mask is None else view(attn_mask, 2)
    slopes = None if alibi_slopes is None else view(alibi_slopes, 0)[..., None, None]
    sink = None if sinks is None else view(sinks, 0)[..., None, None]
    return _Layout(q, k, v, lead, out_lead, mask, slopes, sink)


def _reduce_axes(shape, lead) -> tuple:
    """The leading axes along which an array of leading shape ``shape`` was broadcast to ``lead``."""
    return tuple(i for i, (a, b) in enumerate(zip(shape, lead)) if a == 1 and b != 1)


def _add_reduced(acc: np.ndarray, x: np.ndarray, axes: tuple) -> None:
    """``acc += x`` summed over ``axes`` (the broadcast ones), kept as size-1 axes."""
    if axes:
        acc += x.sum(axis=axes, keepdims=True)
    else:
        acc += x


# -- which keys a query sees -------------------------------------------------------------------------
# ``_blocks.band``: query ``i`` sits at position ``p = i + offset`` (``offset = Lk - Lq`` for
# ``causal_align="bottom_right"``, else 0) and may see key ``j`` iff ``p - left <= j <= p + right``
# (``window``; causal makes ``right = 0``).  A block of queries needs only the keys of one band
# (``_blocks.key_range``), a block of keys only the queries of one band (``_query_range``): the blocks
# outside are never formed; inside a block, ``_blocks.band_hidden`` gives the pairs the band hides.


def _query_range(b: Band, c0: int, c1: int, lq: int) -> Tuple[int, int]:
    """``(r0, r1)``: the queries ``r0..r1-1`` that may see some key of ``c0..c1-1`` (none: ``r0 == r1``).
    Key ``j`` is seen by the positions ``j - right .. j + left``, i.e. the queries ``p - offset``."""
    if c1 <= c0:
        return 0, 0
    r0 = 0 if b.right is None else max(0, c0 - b.right - b.offset)
    r1 = lq if b.left is None else max(0, min(lq, c1 - 1 + b.left - b.offset + 1))
    r0 = min(r0, lq)
    return r0, max(r0, r1)


def _band_width(b: Band, lk: int) -> int:
    """Keys a query may see at most."""
    if b.left is None or b.right is None:
        return lk
    return max(0, min(lk, b.left + b.right + 1))


class _Dropout:
    """Dropout's keep-mask of any score block, regenerated from the call's seed and the block's
    position: score ``(m, i, j)`` (matrix ``m`` of the flattened ``(..., Hq)``) has the flat index
    ``m*Lq*Lk + i*Lk + j`` in the C-ordered ``(..., Hq, Lq, Lk)`` array and is kept iff
    ``uniform(seed, index) >= p`` (``npattn.functional._random``): the same numbers as
    ``keep_mask(seed, p, score_shape)[..., i0:i1, j0:j1]``, whatever the block sizes.  Blocks are
    transposed like the scores, ``(..., nk, nq)``."""

    def __init__(self, seed: int, p: float, lead: tuple, lq: int, lk: int):
        self.seed, self.p, self.lead, self.lq, self.lk = seed, p, lead, lq, lk
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
        off = _buffer(off_buf, (nk, nq))  # j + i * Lk, keys down
        np.add(
            np.arange(j0, j1, dtype=np.uint64)[:, None],
            np.arange(i0, i1, dtype=np.uint64) * np.uint64(self.lk),
            out=off,
        )
        z = _buffer(z_buf, shape)
        np.add(self.mats, off, out=z)
        return keep_into(self.seed, self.p, z, _buffer(work_buf, shape), _buffer(keep_buf, shape))


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
        # c - r over the largest block: |base + c - r| is the distance of key and query
        diff = (np.arange(bk)[:, None] - np.arange(bq)[None, :]).astype(self.dt)
        return diff, np.empty(bk * bq, self.dt), np.empty(math.prod(self._bias_lead) * bk * bq, self.dt)

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
        if self.slopes is not None:
            # ALiBi: S -= slope * |p - j|, with j - p = base + (c - r)
            diff, dist_buf, bias_buf = bufs
            dist = _buffer(dist_buf, (nk, nq))
            np.add(diff[:nk, :nq], j0 - i0 - self.band.offset, out=dist)
            np.abs(dist, out=dist)
            bias = _buffer(bias_buf, self._bias_lead + (nk, nq))
            np.multiply(self.slopes, dist, out=bias)
            st -= bias
        hidden = band_hidden(self.band, j0, nk, i0, nq)
        if hidden is not None:
            np.copyto(st, -np.inf, where=hidden)
        mask = self.mask
        if mask is not None:
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

    **Blocks and cost.**  Query blocks of ``block_q`` rows run over key blocks of ``block_k``
    columns; each step is two batched GEMMs (``S^T = k_j (scale q_i)^T`` and ``P v_j``) and a few
    elementwise passes over one ``(..., block_k, block_q)`` buffer.  The key loop covers only the
    band a query block may see (``is_causal`` stops it at the diagonal, ``window`` bounds both
    ends), so blocks outside are never computed; key blocks entirely hidden by a bool
    ``attn_mask`` are skipped.  Memory: the output, ``lse`` and per-thread block buffers; the cache
    keeps ``q, k, v, out, lse``, the mask as given, the dropout seed and the options.

    Returns ``(out, MemoryEfficientCache)``.

    Parameters
    ----------
    q : array_like
        ``(..., Hq, Lq, E)`` (or ``(..., Lq, E)``), float32 or float64.
    k : array_like
        ``(..., Hk, Lk, E)``.
    v : array_like
        ``(..., Hk, Lk, Ev)``.
    attn_mask : array_like, optional
        Bool (True = may attend) or float (added to the scaled scores), broadcastable to
        ``(..., Hq, Lq, Lk)``.
    is_causal : bool
        Query ``i`` sees keys at positions ``<= i`` (aligned by ``causal_align``).
    dropout_p : float
        Dropout on the attention weights, in ``[0, 1]``.
    scale : float, optional
        Default ``1 / sqrt(E)``.
    block_size : int, optional
        Query rows and key columns per block (default: measured).
    rng : numpy.random.Generator, int or None
        For dropout.
    enable_gqa : bool
        Grouped-query attention: ``Hq`` a multiple of ``Hk``.
    causal_align : {"top_left", "bottom_right"}
    window : tuple of two int, optional
        ``(left, right)``, -1 = unbounded.
    alibi_slopes : array_like, optional
        Broadcastable to ``(..., Hq)``.
    softcap : float, optional
        > 0.
    sinks : array_like, optional
        ``(Hq,)``.
    mask_grad : bool
        With a float mask: the backward also returns ``dmask``.

    Returns
    -------
    out : ndarray
        ``(..., Hq, Lq, Ev)``, in q's dtype.
    cache : MemoryEfficientCache
        For ``memory_efficient_attention_backward`` and ``_jvp`` (q, k, v, out and the row
        log-sum-exps: no ``(Lq, Lk)`` array).

    Raises
    ------
    TypeError
        Non-numeric or mixed float dtypes of q, k, v, an integer mask, a non-bool flag.
    ValueError
        Shapes that do not match or broadcast, heads that do not divide, ``dropout_p`` outside
        ``[0, 1]``, a bad ``window``/``causal_align``/``softcap``/``sinks``, ``+inf`` or NaN in a
        float mask, ``mask_grad`` without a float mask.

    Examples
    --------
    >>> import numpy as np
    >>> from npattn import functional as F
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
    q, k, v, groups = check_qkv(q, k, v, check_bool(enable_gqa, "enable_gqa"))
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
    causal_align, window, alibi_slopes, softcap, sinks, mask_grad = check_options(
        score_shape, q.dtype, attn_mask, causal_align, window, alibi_slopes, softcap, sinks, mask_grad
    )
    return _memory_efficient_attention(
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
        causal_align=causal_align,
        window=window,
        alibi_slopes=alibi_slopes,
        softcap=softcap,
        sinks=sinks,
        mask_grad=mask_grad,
    )


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

    As in FlashAttention-2 the outer loop runs over key blocks, so ``dK_j`` and ``dV_j`` are
    finished one block at a time, and the inner loop over query blocks (only those inside the
    band) adds into ``dQ``.  The blocks are held transposed as in the forward (``P^T``, ``dP^T``,
    ``dS^T``: keys x queries).  ``scale`` is folded into ``q`` once, up front, and applied to ``dQ``
    once at the end; with dropout ``1/(1-p)`` is folded into ``dO`` once.  Worker threads own
    disjoint key blocks, hence disjoint rows of ``dK``, ``dV``; each adds ``dQ`` into its own
    accumulator, summed at the end in a fixed order.  With grouped-query heads or broadcast
    batch dimensions, each gradient is summed over the axes its input was broadcast along.

    **Sinks.**  The sink of head ``h`` is one more logit ``z_h`` in each row's softmax, with weight
    ``P_sink,i = exp(z_h - lse_i)`` and value 0.  Its score enters nowhere else, so
    ``dz_h = sum_i dS_sink,i`` with ``dS_sink,i = P_sink,i (dP_sink,i - D_i)`` (the softmax backward
    for that column) and ``dP_sink,i = dO_i . 0 = 0``: ``dsinks_h = -sum_i P_sink,i D_i`` over every
    query row (and batch) of the head.  ``D`` is the same ``rowsum(dO * O)``.

    A query row that saw no key has ``P = 0`` in every block, hence ``dS = 0``, and ``O = 0``,
    hence ``D = 0``: gradient exactly 0.  Returns the gradients in ``q``'s dtype.

    Parameters
    ----------
    dout : array_like
        The upstream gradient, of the output's shape.
    cache : tuple
        The cache ``memory_efficient_attention`` returned (only that op's cache is accepted).

    Returns
    -------
    dq, dk, dv : ndarray
        Each of its input's shape.
    dmask : ndarray
        With ``mask_grad``: of the mask's shape.
    dsinks : ndarray
        With ``sinks``: ``(Hq,)``.

    Raises
    ------
    TypeError
        A cache from another op, or ``dout`` not a real array.
    ValueError
        ``dout`` of the wrong shape.
    """
    check_cache(cache, MemoryEfficientCache, "memory_efficient_attention_backward")
    dout = check_grad(dout, cache.out.shape, cache.q.dtype)
    return _memory_efficient_attention_backward(dout, cache)


def _memory_efficient_attention(
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
) -> Tuple[np.ndarray, MemoryEfficientCache]:
    """The kernel of ``memory_efficient_attention``: the same signature and numbers, no input checks.

    Its arguments must already be what the public op makes of them: ``q, k, v`` float arrays of
    one dtype whose shapes fit (``enable_gqa`` as checked), a mask that broadcasts, ``rng`` a
    ``np.random.Generator`` when ``dropout_p > 0``, options as checked (``window`` a pair of ints,
    ``alibi_slopes``/``sinks`` arrays of q's dtype); ``scale``/``block_size`` may be None.
    """
    groups = 1
    if enable_gqa and q.ndim >= 3 and q.shape[-3] != k.shape[-3]:
        groups = q.shape[-3] // k.shape[-3]
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    scale = float(scale)  # a python float: keeps float32 arrays float32
    lay = _layout(q, k, v, groups, attn_mask, alibi_slopes, sinks)
    lq, lk, head_dim, head_dim_v = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    lead = lay.lead
    n_mats = math.prod(lead)
    bq, bk = _block_sizes(block_size, n_mats, lq, lk, max(head_dim, head_dim_v))
    seed = draw_seed(rng) if dropout_p > 0.0 else 0
    bnd = band(lq, lk, is_causal, causal_align, window)
    scores = _Scores(lay, bnd, softcap, q.dtype)
    dropout = _Dropout(seed, dropout_p, lay.lead, lq, lk) if dropout_p > 0.0 else None

    dt = q.dtype
    qw, kw, vw = lay.q, lay.k, lay.v
    qlead = qw.shape[:-2]
    out = np.empty(lead + (lq, head_dim_v), dt)
    lse = np.empty(lead + (lq,), dt)
    drop_scale = 0.0 if dropout_p == 1.0 else 1.0 / (1.0 - dropout_p)
    floor = np.finfo(dt).min

    def rows(share):
        """Forward for the query blocks in ``share``, with this worker's own buffers."""
        qs_buf = np.empty(math.prod(qlead) * bq * head_dim, dt)
        s_buf = np.empty(n_mats * bk * bq, dt)
        acc_buf = np.empty(n_mats * head_dim_v * bq, dt)
        pv_buf = np.empty(n_mats * head_dim_v * bq, dt)
        stat_bufs = [np.empty(n_mats * bq, dt) for _ in range(6)]
        bias_bufs = scores.buffers(bk, bq)
        drop_bufs = None if dropout is None else dropout.buffers(bk, bq)
        for i0, i1 in share:
            nq = i1 - i0
            row = lead + (1, nq)  # per-query statistics, as rows
            qs = _buffer(qs_buf, qlead + (nq, head_dim))
            np.multiply(qw[..., i0:i1, :], scale, out=qs)
            qs_t = qs.swapaxes(-1, -2)
            m, m_new, shift, alpha, l, rsum = (_buffer(b, row) for b in stat_bufs)
            if lay.sinks is None:
                m.fill(-np.inf)
                l.fill(0.0)
            else:  # the sink joins first: m = sink, l = exp(0)
                np.copyto(m, lay.sinks)
                l.fill(1.0)
            acc_t = _buffer(acc_buf, lead + (head_dim_v, nq))  # a^T, transposed like the scores
            acc_t.fill(0.0)
            pv_t = _buffer(pv_buf, lead + (head_dim_v, nq))
            c0, c1 = key_range(bnd, i0, i1, lk)  # the keys some query of the block may see
            for j0, j1 in _blocks(c1, bk, c0):
                nk = j1 - j0
                st = _buffer(s_buf, lead + (nk, nq))  # S^T: keys down, queries across
                np.matmul(kw[..., j0:j1, :], qs_t, out=st)
                if not scores.apply(st, i0, i1, j0, j1, bias_bufs):
                    continue  # every score of this block is masked
                np.max(st, axis=-2, keepdims=True, out=m_new)
                np.maximum(m_new, m, out=m_new)  # m' = max(m, max_B s)
                np.maximum(m_new, floor, out=shift)  # a row that saw only -inf shifts by a finite number
                np.subtract(m, shift, out=alpha)
                np.exp(alpha, out=alpha)  # alpha = exp(m - m'): 0 on a row's first block
                np.subtract(st, shift, out=st)
                np.exp(st, out=st)  # P_B^T = exp(s_B - m')
                np.sum(st, axis=-2, keepdims=True, out=rsum)
                l *= alpha
                l += rsum  # l' = alpha l + rowsum(P_B)
                if dropout is not None:  # a' sums the kept weights only
                    st *= dropout.keep_t(i0, i1, j0, j1, drop_bufs)
                np.matmul(vw[..., j0:j1, :].swapaxes(-1, -2), st, out=pv_t)
                acc_t *= alpha
                acc_t += pv_t  # a' = alpha a + P_B v_B  (transposed)
                m, m_new = m_new, m  # m <- m' (swap the two buffers, no copy)
            # o = a / l [/ (1-p)] and lse = m + log l; rows that saw no key (l = 0) keep o = 0, lse = 0
            empty = l == 0
            if empty.any():
                l[empty] = 1.0
                m[empty] = 0.0
            o_t = out[..., i0:i1, :].swapaxes(-1, -2)
            np.divide(acc_t, l, out=o_t)
            if dropout_p > 0.0:
                o_t *= drop_scale
            np.log(l, out=l)
            np.add(m, l, out=lse[..., None, i0:i1])

    q_blocks = _blocks(lq, bq)
    workers = _n_workers(n_mats * lq * _band_width(bnd, lk), len(q_blocks), bq * bk * max(head_dim, head_dim_v))
    _run(rows, _shares(q_blocks, workers))
    out = out.reshape(lay.out_lead + (lq, head_dim_v))
    lse = lse.reshape(lay.out_lead + (lq,))
    return out, MemoryEfficientCache(
        q,
        k,
        v,
        out,
        lse,
        attn_mask,
        is_causal,
        scale,
        bq,
        bk,
        dropout_p,
        seed,
        groups,
        causal_align,
        window,
        alibi_slopes,
        softcap,
        sinks,
        mask_grad,
    )


def _memory_efficient_attention_backward(dout, cache: MemoryEfficientCache) -> Tuple[np.ndarray, ...]:
    """The kernel of ``memory_efficient_attention_backward``: ``dout`` already checked (the
    output's shape, ``q``'s dtype) and ``cache`` a ``MemoryEfficientCache``."""
    (
        q,
        k,
        v,
        out,
        lse,
        attn_mask,
        is_causal,
        scale,
        bq,
        bk,
        dropout_p,
        seed,
        groups,
        causal_align,
        window,
        alibi_slopes,
        softcap,
        sinks,
        mask_grad,
    ) = cache
    lay = _layout(q, k, v, groups, attn_mask, alibi_slopes, sinks)
    lq, lk, head_dim, head_dim_v = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    lead = lay.lead
    dt = q.dtype
    n_mats = math.prod(lead)
    bnd = band(lq, lk, is_causal, causal_align, window)
    scores = _Scores(lay, bnd, softcap, dt)
    dropout = _Dropout(seed, dropout_p, lead, lq, lk) if dropout_p > 0.0 else None
    qw, kw, vw = lay.q, lay.k, lay.v
    q_axes, k_axes, v_axes = (_reduce_axes(a.shape[:-2], lead) for a in (qw, kw, vw))

    dout = dout.reshape(lead + (lq, head_dim_v))
    out = out.reshape(lead + (lq, head_dim_v))
    lse_row = lse.reshape(lead + (1, lq))
    # D_i = rowsum(dO * O): O(L) work on arrays we already have; it equals rowsum(dP * P) (below)
    d_row = np.einsum("...e,...e->...", dout, out)[..., None, :]
    if dropout_p > 0.0:
        # O = (P * keep / (1-p)) V: fold 1/(1-p) into dO once, for dV = P'^T dO and dP = dP' * keep / (1-p)
        dout = dout * (0.0 if dropout_p == 1.0 else 1.0 / (1.0 - dropout_p))
    qs_all = qw * scale  # scale folded into q once (O(L) memory), so dK_j += dS^T qs is scaled
    dk = np.zeros(kw.shape, dt)
    dv = np.zeros(vw.shape, dt)

    # dmask: summed to the mask's own (broadcast) shape.  Workers own disjoint key blocks, so when
    # the mask has a full key axis they write disjoint columns of one array; otherwise each has its own.
    mask = lay.mask
    mshape: tuple = () if mask is None else mask.shape  # the working view's shape
    mask_shape: tuple = () if attn_mask is None else attn_mask.shape  # the caller's
    want_dmask = bool(mask_grad) and mask is not None
    shared_dmask = want_dmask and mshape[-1] == lk and lk > 1
    m_axes: tuple = ()
    if want_dmask:  # the broadcast leading axes, then keys (-2) / queries (-1) of the transposed block
        m_axes = _reduce_axes(mshape[:-2], lead) + tuple(ax for ax, n in ((-2, mshape[-1]), (-1, mshape[-2])) if n == 1)
    dmask_shared: Any = np.zeros(mshape, dt) if shared_dmask else None

    def columns(share, dq, dmask):
        """Backward for the key blocks in ``share``; adds this worker's dQ (and dmask) terms."""
        s_buf = np.empty(n_mats * bk * bq, dt)
        dp_buf = np.empty(n_mats * bk * bq, dt)
        t_buf = np.empty(n_mats * bk * bq, dt) if softcap is not None else None
        dq_buf = np.empty(n_mats * bq * head_dim, dt)
        dk_buf = np.empty(n_mats * bk * head_dim, dt)
        dv_buf = np.empty(n_mats * bk * head_dim_v, dt)
        dkacc_buf = np.empty(n_mats * bk * head_dim, dt) if k_axes else None
        dvacc_buf = np.empty(n_mats * bk * head_dim_v, dt) if v_axes else None
        bias_bufs = scores.buffers(bk, bq)
        drop_bufs = None if dropout is None else dropout.buffers(bk, bq)
        pk_buf = None if dropout is None else np.empty(n_mats * bk * bq, dt)
        for j0, j1 in share:
            nk = j1 - j0
            k_j, v_j = kw[..., j0:j1, :], vw[..., j0:j1, :]
            # dK_j, dV_j accumulate over the query blocks in the full working layout, then are
            # summed over the axes k/v were broadcast along (GQA: the G query heads of a kv head)
            dk_j = _buffer(dkacc_buf, lead + (nk, head_dim)) if k_axes else dk[..., j0:j1, :]
            dv_j = _buffer(dvacc_buf, lead + (nk, head_dim_v)) if v_axes else dv[..., j0:j1, :]
            dk_j.fill(0.0)
            dv_j.fill(0.0)
            dk_tmp = _buffer(dk_buf, lead + (nk, head_dim))
            dv_tmp = _buffer(dv_buf, lead + (nk, head_dim_v))
            i_lo, i_hi = _query_range(bnd, j0, j1, lq)  # queries outside the band see nothing of this key block
            for i0, i1 in _blocks(i_hi, bq, i_lo):
                nq = i1 - i0
                qs = qs_all[..., i0:i1, :]
                st = _buffer(s_buf, lead + (nk, nq))
                np.matmul(k_j, qs.swapaxes(-1, -2), out=st)  # S^T = k_j (scale q_i)^T
                t = None if t_buf is None else _buffer(t_buf, lead + (nk, nq))
                if not scores.apply(st, i0, i1, j0, j1, bias_bufs, tanh_out=t):
                    continue
                np.subtract(st, lse_row[..., i0:i1], out=st)
                pt = np.exp(st, out=st)  # P^T = exp(S^T - lse)
                do_i = dout[..., i0:i1, :]
                dpt = _buffer(dp_buf, lead + (nk, nq))
                np.matmul(v_j, do_i.swapaxes(-1, -2), out=dpt)  # dP'^T = V_j dO_i^T
                if dropout is not None:
                    keep = dropout.keep_t(i0, i1, j0, j1, drop_bufs)
                    dpt *= keep  # dP = dP' * keep / (1-p)
                    pk = np.multiply(pt, keep, out=_buffer(pk_buf, st.shape))
                    np.matmul(pk, do_i, out=dv_tmp)  # dV_j += (P * keep)^T dO_i / (1-p)
                else:
                    np.matmul(pt, do_i, out=dv_tmp)  # dV_j += P^T dO_i
                dv_j += dv_tmp
                np.subtract(dpt, d_row[..., i0:i1], out=dpt)
                dst = np.multiply(dpt, pt, out=dpt)  # dS^T = P^T * (dP^T - D)
                if want_dmask:  # the mask is added to S: dmask = dS
                    rows = slice(None) if mshape[-2] == 1 else slice(i0, i1)
                    cols = slice(None) if mshape[-1] == 1 else slice(j0, j1)
                    dm = (dmask_shared if shared_dmask else dmask)[..., rows, cols].swapaxes(-1, -2)
                    _add_reduced(dm, dst, m_axes)
                if t is not None:  # through softcap * tanh(S_raw / softcap)
                    np.multiply(t, t, out=t)
                    np.subtract(1.0, t, out=t)
                    dst *= t  # dS_raw = dS * (1 - tanh^2)
                dq_tmp = _buffer(dq_buf, lead + (nq, head_dim))
                np.matmul(dst.swapaxes(-1, -2), k_j, out=dq_tmp)
                _add_reduced(dq[..., i0:i1, :], dq_tmp, q_axes)  # dQ_i += dS K_j (scaled below)
                np.matmul(dst, qs, out=dk_tmp)
                dk_j += dk_tmp  # dK_j += dS^T (scale Q_i)
            if k_axes:
                _add_reduced(dk[..., j0:j1, :], dk_j, k_axes)
            if v_axes:
                _add_reduced(dv[..., j0:j1, :], dv_j, v_axes)

    k_blocks = [(j0, j1) for j0, j1 in _blocks(lk, bk) if (r := _query_range(bnd, j0, j1, lq))[0] < r[1]]
    workers = _n_workers(n_mats * lq * _band_width(bnd, lk), len(k_blocks), bq * bk * max(head_dim, head_dim_v))
    shares = _shares(k_blocks, workers) if k_blocks else [[]]
    dqs = [np.zeros(qw.shape, dt) for _ in shares]
    dmasks: list = [None if (not want_dmask or shared_dmask) else np.zeros(mshape, dt) for _ in shares]
    _run(lambda i: columns(shares[i], dqs[i], dmasks[i]), list(range(len(shares))))
    dq = dqs[0]
    for extra in dqs[1:]:
        dq += extra
    dq *= scale
    grads: tuple = (dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape))
    if want_dmask:
        dmask = dmask_shared if shared_dmask else dmasks[0]
        for extra in [] if shared_dmask else dmasks[1:]:
            dmask += extra
        grads += (dmask.reshape(mask_shape),)
    if sinks is not None and lay.sinks is not None:
        # The sink is one more logit in each row's softmax, P_sink = exp(sink - lse), with value 0:
        # dP_sink = dO . 0 = 0, so dS_sink = P_sink (dP_sink - D) = -P_sink D, summed over every row
        # (and batch) of its head.
        p_sink = np.exp(lay.sinks - lse_row)  # (..., 1, Lq)
        ds = -(p_sink * d_row)
        s_axes = _reduce_axes(lay.sinks.shape[:-2], lead) + (-2, -1)
        grads += (ds.sum(axis=s_axes, keepdims=True).reshape(sinks.shape),)
    return grads


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

    Parameters
    ----------
    cache : MemoryEfficientCache
        The cache ``memory_efficient_attention`` returned.
    *tangents : ndarray or None
        In the order the backward returns gradients: ``tq``, ``tk``, ``tv`` (each of its input's
        own shape), then ``tmask`` (the float mask's shape; only with ``mask_grad``), then
        ``tsinks`` (``(Hq,)``; only with ``sinks``).  None, or left out at the end, is zero.

    Returns
    -------
    ndarray
        ``tout``, of ``out``'s shape ``(..., Hq, Lq, Ev)`` and dtype.

    Raises
    ------
    TypeError
        A cache from another op, too many tangents, or a tangent that is not a real array.
    ValueError
        A tangent of the wrong shape.

    Examples
    --------
    >>> import numpy as np
    >>> from npattn import functional as F
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
    mask = cache.attn_mask if cache.mask_grad else None
    return _memory_efficient_attention_jvp(
        cache,
        *check_attention_tangents(
            tangents,
            "memory_efficient_attention_jvp",
            (cache.q.shape, cache.k.shape, cache.v.shape),
            None if mask is None else mask.shape,
            None if cache.sinks is None else cache.sinks.shape,
            cache.q.dtype,
        ),
    )


def _memory_efficient_attention_jvp(cache: MemoryEfficientCache, tq=None, tk=None, tv=None, tmask=None, tsinks=None):
    """The kernel of ``memory_efficient_attention_jvp``: tangents checked (each of its input's own
    shape, q's dtype) or None (zero)."""
    q, k, v, out, lse, attn_mask = cache.q, cache.k, cache.v, cache.out, cache.lse, cache.attn_mask
    scale, bq, bk, dropout_p, groups, sinks = (
        cache.scale,
        cache.block_q,
        cache.block_k,
        cache.dropout_p,
        cache.groups,
        cache.sinks,
    )
    lay = _layout(q, k, v, groups, attn_mask, cache.alibi_slopes, sinks)
    # the tangents in the same working layout (views; a None tangent borrows its input's place, unused)
    tlay = _layout(
        q if tq is None else tq,
        k if tk is None else tk,
        v if tv is None else tv,
        groups,
        attn_mask if tmask is None else tmask,
        None,
        sinks if tsinks is None else tsinks,
    )
    tqw = None if tq is None else tlay.q
    tkw = None if tk is None else tlay.k
    tvw = None if tv is None else tlay.v
    tmw = None if tmask is None else tlay.mask
    tsw = None if tsinks is None else tlay.sinks
    lq, lk, head_dim, head_dim_v = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    lead, dt = lay.lead, q.dtype
    n_mats = math.prod(lead)
    bnd = band(lq, lk, cache.is_causal, cache.causal_align, cache.window)
    scores = _Scores(lay, bnd, cache.softcap, dt)
    dropout = _Dropout(cache.seed, dropout_p, lead, lq, lk) if dropout_p > 0.0 else None
    drop_scale = 0.0 if dropout_p == 1.0 else 1.0 / (1.0 - dropout_p)
    qw, kw, vw = lay.q, lay.k, lay.v
    qlead = qw.shape[:-2]
    out_w = out.reshape(lead + (lq, head_dim_v))
    lse_row = lse.reshape(lead + (1, lq))
    tout = np.empty(lead + (lq, head_dim_v), dt)
    has_ts = tqw is not None or tkw is not None  # tS from the scores' inputs
    has_tz = has_ts or tmw is not None  # any tangent of the logits

    def rows(share):
        """The tangent of the query blocks in ``share``, with this worker's own buffers."""
        qs_buf = np.empty(math.prod(qlead) * bq * head_dim, dt)
        tqs_buf = None if tqw is None else np.empty(math.prod(tqw.shape[:-2]) * bq * head_dim, dt)
        s_buf = np.empty(n_mats * bk * bq, dt)
        tz_buf = np.empty(n_mats * bk * bq, dt) if has_tz else None
        part_buf = np.empty(n_mats * bk * bq, dt) if tqw is not None and tkw is not None else None
        t_buf = np.empty(n_mats * bk * bq, dt) if cache.softcap is not None and has_ts else None
        acc_buf = np.empty(n_mats * head_dim_v * bq, dt)
        pv_buf = np.empty(n_mats * head_dim_v * bq, dt)
        mu_buf, rsum_buf = np.empty(n_mats * bq, dt), np.empty(n_mats * bq, dt)
        bias_bufs = scores.buffers(bk, bq)
        drop_bufs = None if dropout is None else dropout.buffers(bk, bq)
        for i0, i1 in share:
            nq = i1 - i0
            qs = _buffer(qs_buf, qlead + (nq, head_dim))
            np.multiply(qw[..., i0:i1, :], scale, out=qs)
            qs_t = qs.swapaxes(-1, -2)
            tqs_t = None
            if tqw is not None:
                tqs = _buffer(tqs_buf, tqw.shape[:-2] + (nq, head_dim))
                np.multiply(tqw[..., i0:i1, :], scale, out=tqs)
                tqs_t = tqs.swapaxes(-1, -2)
            acc_t = _buffer(acc_buf, lead + (head_dim_v, nq))  # a^T, transposed like the scores
            acc_t.fill(0.0)
            pv_t = _buffer(pv_buf, lead + (head_dim_v, nq))
            mu = _buffer(mu_buf, lead + (1, nq))
            mu.fill(0.0)
            rsum = _buffer(rsum_buf, lead + (1, nq))
            c0, c1 = key_range(bnd, i0, i1, lk)
            for j0, j1 in _blocks(c1, bk, c0):
                nk = j1 - j0
                st = _buffer(s_buf, lead + (nk, nq))  # S^T: keys down, queries across
                np.matmul(kw[..., j0:j1, :], qs_t, out=st)
                t = None if t_buf is None else _buffer(t_buf, lead + (nk, nq))
                if not scores.apply(st, i0, i1, j0, j1, bias_bufs, tanh_out=t):
                    continue  # every score of this block is masked: P = 0
                np.subtract(st, lse_row[..., i0:i1], out=st)
                pt = np.exp(st, out=st)  # P^T = exp(S^T - lse), exact
                if has_tz:
                    tz = _buffer(tz_buf, lead + (nk, nq))  # tS^T
                    if tqs_t is not None:
                        np.matmul(kw[..., j0:j1, :], tqs_t, out=tz)  # K (scale tq)^T
                    if tkw is not None:
                        if tqs_t is None:
                            np.matmul(tkw[..., j0:j1, :], qs_t, out=tz)
                        else:
                            tz += np.matmul(tkw[..., j0:j1, :], qs_t, out=_buffer(part_buf, tz.shape))
                    if t is not None:  # through softcap: (1 - tanh^2)
                        np.multiply(t, t, out=t)
                        np.subtract(1.0, t, out=t)
                        tz *= t
                    if tmw is not None:
                        rws = slice(None) if tmw.shape[-2] == 1 else slice(i0, i1)
                        cls = slice(None) if tmw.shape[-1] == 1 else slice(j0, j1)
                        mb = tmw[..., rws, cls].swapaxes(-1, -2)
                        if has_ts:
                            tz += mb
                        else:
                            np.copyto(tz, np.broadcast_to(mb, tz.shape))
                    tz *= pt  # P * tS
                    np.sum(tz, axis=-2, keepdims=True, out=rsum)
                    mu += rsum  # mu += rowsum(P * tS)
                if dropout is not None:  # a sums the kept weights only (1/(1-p) at the end)
                    keep = dropout.keep_t(i0, i1, j0, j1, drop_bufs)
                    pt *= keep
                    if has_tz:
                        tz *= keep
                if has_tz:
                    np.matmul(vw[..., j0:j1, :].swapaxes(-1, -2), tz, out=pv_t)
                    acc_t += pv_t  # a += (P' * tS) V_j  (transposed)
                if tvw is not None:
                    np.matmul(tvw[..., j0:j1, :].swapaxes(-1, -2), pt, out=pv_t)
                    acc_t += pv_t  # a += P'^T tV_j
            if tsw is not None:  # the sink's logit moves too: mu += P_sink tsink
                mu += np.exp(lay.sinks - lse_row[..., i0:i1]) * tsw
            # tO = a [/ (1-p)] - O mu; a row that saw no key has a = 0 and O = 0
            to_t = tout[..., i0:i1, :].swapaxes(-1, -2)
            np.multiply(acc_t, drop_scale, out=to_t) if dropout is not None else np.copyto(to_t, acc_t)
            np.multiply(out_w[..., i0:i1, :].swapaxes(-1, -2), mu, out=pv_t)
            to_t -= pv_t

    q_blocks = _blocks(lq, bq)
    workers = _n_workers(n_mats * lq * _band_width(bnd, lk), len(q_blocks), bq * bk * max(head_dim, head_dim_v))
    _run(rows, _shares(q_blocks, workers))
    return tout.reshape(lay.out_lead + (lq, head_dim_v))

"""memory_efficient_attention: the blockwise (FlashAttention-style) forward and backward must agree
with the plain scaled_dot_product_attention, hold no (Lq, Lk) array, and validate like it."""

import math
import os
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import npattn.functional.memory_efficient as flash
from npattn.functional import reference
from npattn.functional.attention import scaled_dot_product_attention, scaled_dot_product_attention_backward
from npattn.functional.memory_efficient import (
    MemoryEfficientCache,
    memory_efficient_attention,
    memory_efficient_attention_backward,
)


def _assert_close(got, ref, rtol, what=""):
    """Max abs error within ``rtol`` of the reference's magnitude (floored at 1: inputs are O(1))."""
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    assert np.all(np.isfinite(got)), what
    if ref.size:
        err = np.max(np.abs(got - ref))
        assert err <= rtol * max(1.0, float(np.max(np.abs(ref)))), (what, err)


def _reference(q, k, v, mask, causal, scale, dout):
    out, cache = scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
    return (out,) + tuple(scaled_dot_product_attention_backward(dout, cache))


def _flash(q, k, v, mask, causal, scale, dout, block_size):
    out, cache = memory_efficient_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, block_size=block_size
    )
    return (out,) + tuple(memory_efficient_attention_backward(dout, cache))


@st.composite
def attention_cases(draw):
    """Random shapes (0-2 batch dims, with or without a head axis, Lq != Lk, E != Ev), masks of
    every kind with broadcast shapes and fully masked rows, causal or not, any block size."""
    lead = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=3)))
    lq, lk = draw(st.integers(1, 13)), draw(st.integers(1, 13))
    e, ev = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    causal = draw(st.booleans())
    mask_kind = draw(st.sampled_from(["none", "bool", "float"]))
    block = draw(st.one_of(st.none(), st.integers(1, 6), st.integers(14, 40)))
    scale = draw(st.one_of(st.none(), st.floats(0.1, 2.0), st.floats(-2.0, -0.1)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q = rng.standard_normal(lead + (lq, e))
    k = rng.standard_normal(lead + (lk, e))
    v = rng.standard_normal(lead + (lk, ev))
    dout = rng.standard_normal(lead + (lq, ev))
    mask = None
    if mask_kind != "none":
        full = lead + (lq, lk)
        # a broadcastable shape: some axes kept, others 1, some leading axes dropped
        shape = tuple(n if draw(st.booleans()) else 1 for n in full)
        shape = shape[draw(st.integers(0, len(lead))) :]
        if mask_kind == "bool":
            mask = rng.random(shape) < draw(st.sampled_from([0.3, 0.7, 1.0]))
        else:
            mask = rng.standard_normal(shape)
            mask[rng.random(shape) < draw(st.sampled_from([0.0, 0.3]))] = -np.inf
        if draw(st.booleans()) and shape[-2] > 1:  # a query row that may attend to no key
            mask[..., rng.integers(shape[-2]), :] = False if mask_kind == "bool" else -np.inf
    return q, k, v, mask, causal, scale, dout, block


@settings(deadline=None, max_examples=150)
@given(attention_cases())
def test_matches_scaled_dot_product_attention_float64(case):
    q, k, v, mask, causal, scale, dout, block = case
    ref = _reference(q, k, v, mask, causal, scale, dout)
    got = _flash(q, k, v, mask, causal, scale, dout, block)
    for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref):
        assert g.dtype == np.float64
        _assert_close(g, r, 1e-10, name)


@settings(deadline=None, max_examples=25)
@given(attention_cases())
def test_threaded_path_matches(case):
    """The block loop spread over worker threads (forced here on small inputs) changes nothing."""
    q, k, v, mask, causal, scale, dout, block = case
    single = _flash(q, k, v, mask, causal, scale, dout, block)
    old = flash._PARALLEL_MIN_SCORES
    flash._PARALLEL_MIN_SCORES = 0
    try:
        threaded = _flash(q, k, v, mask, causal, scale, dout, block)
    finally:
        flash._PARALLEL_MIN_SCORES = old
    for a, b in zip(threaded, single):
        _assert_close(a, b, 1e-12)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block", [None, 7, 64, 1000])
def test_larger_case_threads_and_ragged_blocks(causal, block):
    """Big enough to run on worker threads by default (with small blocks); L = 450 is not a
    multiple of the block size; block 1000 is clipped to L (and runs on one thread)."""
    rng = np.random.default_rng(3)
    L = 450
    q = rng.standard_normal((2, 3, L, 8))
    k = rng.standard_normal((2, 3, L, 8))
    v = rng.standard_normal((2, 3, L, 5))
    dout = rng.standard_normal((2, 3, L, 5))
    mask = rng.random((L,)) < 0.9  # key padding, broadcast
    if block in (None, 7, 64) and len(os.sched_getaffinity(0)) > 1:
        assert flash._n_workers(6 * L * L, L // (block or 64), (block or 64) ** 2 * 8) > 1
    ref = _reference(q, k, v, mask, causal, None, dout)
    got = _flash(q, k, v, mask, causal, None, dout, block)
    for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref):
        _assert_close(g, r, 1e-10, name)


def test_causal_top_left_when_lq_differs_from_lk():
    rng = np.random.default_rng(0)
    for lq, lk in [(3, 9), (9, 3)]:
        q, k, v = rng.standard_normal((lq, 4)), rng.standard_normal((lk, 4)), rng.standard_normal((lk, 2))
        out, _ = memory_efficient_attention(q, k, v, is_causal=True, block_size=2)
        # query 0 sees key 0 only
        np.testing.assert_allclose(out[0], v[0], rtol=1e-12)
        ref, _ = scaled_dot_product_attention(q, k, v, is_causal=True)
        _assert_close(out, ref, 1e-12)


def test_fully_masked_rows_give_zero_output_and_gradient():
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((2, 6, 3)), rng.standard_normal((2, 5, 3)), rng.standard_normal((2, 5, 4))
    mask = np.ones((6, 5), bool)
    mask[2] = False
    fmask = np.where(mask, 0.0, -np.inf)
    for m in (mask, fmask):
        for causal in (False, True):
            with np.errstate(all="raise"):
                out, cache = memory_efficient_attention(q, k, v, attn_mask=m, is_causal=causal, block_size=2)
                dq, dk, dv = memory_efficient_attention_backward(np.ones_like(out), cache)
            assert np.all(out[:, 2] == 0) and np.all(dq[:, 2] == 0)
            assert np.all(np.isfinite(dk)) and np.all(np.isfinite(dv))
    # everything masked
    out, cache = memory_efficient_attention(q, k, v, attn_mask=np.zeros((6, 5), bool))
    grads = memory_efficient_attention_backward(np.ones_like(out), cache)
    assert np.all(out == 0) and all(np.all(g == 0) for g in grads)


def test_masked_blocks_are_skipped_and_still_correct():
    rng = np.random.default_rng(2)
    q, k, v = rng.standard_normal((3, 16, 4)), rng.standard_normal((3, 16, 4)), rng.standard_normal((3, 16, 4))
    mask = np.zeros((16, 16), bool)
    mask[:, :4] = True  # key blocks 1..3 (block size 4) are entirely hidden
    dout = rng.standard_normal((3, 16, 4))
    ref = _reference(q, k, v, mask, False, None, dout)
    got = _flash(q, k, v, mask, False, None, dout, 4)
    for g, r in zip(got, ref):
        _assert_close(g, r, 1e-12)


def test_float32_stays_float32_and_is_close_to_float64():
    rng = np.random.default_rng(4)
    q, k, v, dout = (rng.standard_normal((2, 2, 70, 16)) for _ in range(4))
    mask = rng.standard_normal((70, 70))
    for causal, m in [(True, None), (False, mask), (True, mask > 0)]:
        ref = _flash(q, k, v, m, causal, None, dout, 16)
        m32 = m.astype(np.float32) if m is not None and m.dtype != bool else m
        got = _flash(*(a.astype(np.float32) for a in (q, k, v)), m32, causal, None, dout.astype(np.float32), 16)
        for g, r in zip(got, ref):
            assert g.dtype == np.float32
            _assert_close(g, r, 2e-5)
    # the cache statistics are float32 too
    _, cache = memory_efficient_attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32))
    assert cache.lse.dtype == np.float32 and cache.out.dtype == np.float32


def test_gradient_matches_central_differences():
    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((2, 3, 2)), rng.standard_normal((2, 4, 2)), rng.standard_normal((2, 4, 3))
    mask = rng.standard_normal((3, 4))
    g = rng.standard_normal((2, 3, 3))  # random upstream gradient
    kwargs = dict(attn_mask=mask, is_causal=True, block_size=2)

    def loss(q_, k_, v_):
        return float(np.sum(memory_efficient_attention(q_, k_, v_, **kwargs)[0] * g))

    _, cache = memory_efficient_attention(q, k, v, **kwargs)
    grads = memory_efficient_attention_backward(g, cache)
    eps = 1e-6
    args = [q, k, v]
    for which, grad in enumerate(grads):
        num = np.zeros_like(args[which])
        for idx in np.ndindex(num.shape):
            plus = [a.copy() for a in args]
            minus = [a.copy() for a in args]
            plus[which][idx] += eps
            minus[which][idx] -= eps
            num[idx] = (loss(*plus) - loss(*minus)) / (2 * eps)
        np.testing.assert_allclose(grad, num, rtol=1e-6, atol=1e-8)


def test_cache_holds_only_linear_statistics():
    rng = np.random.default_rng(6)
    lq, lk = 40, 33
    q, k, v = rng.standard_normal((2, 3, lq, 8)), rng.standard_normal((2, 3, lk, 8)), rng.standard_normal((2, 3, lk, 6))
    pad = rng.random(lk) < 0.8
    for mask in (None, pad):
        out, cache = memory_efficient_attention(q, k, v, attn_mask=mask, is_causal=True, block_size=8)
        assert isinstance(cache, MemoryEfficientCache)
        arrays = [x for x in cache if isinstance(x, np.ndarray)]
        assert arrays and all(a.shape[-2:] != (lq, lk) for a in arrays)
        assert all(a.size <= max(q.size, k.size, v.size, out.size) for a in arrays)
        assert cache.lse.shape == (2, 3, lq)
        assert cache.attn_mask is mask  # kept as given, not expanded or copied


def test_peak_memory_is_far_below_a_score_matrix():
    """numpy reports its allocations to tracemalloc: forward+backward never allocate anything of
    the size of one (H, Lq, Lk) score array."""
    rng = np.random.default_rng(7)
    h, L, E = 2, 1024, 16
    q, k, v, dout = (rng.standard_normal((h, L, E)) for _ in range(4))
    score_bytes = h * L * L * 8
    tracemalloc.start()
    try:
        out, cache = memory_efficient_attention(q, k, v, is_causal=True, block_size=64)
        grads = memory_efficient_attention_backward(dout, cache)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    del out, cache, grads
    io_bytes = 6 * q.nbytes  # out, dq, dk, dv, scaled q, a worker's dq
    assert peak < io_bytes + score_bytes / 8, (peak, score_bytes)


def test_inputs_are_not_modified():
    rng = np.random.default_rng(8)
    q, k, v = rng.standard_normal((2, 9, 3)), rng.standard_normal((2, 7, 3)), rng.standard_normal((2, 7, 2))
    mask = rng.standard_normal((9, 7))
    dout = rng.standard_normal((2, 9, 2))
    copies = [a.copy() for a in (q, k, v, mask, dout)]
    out, cache = memory_efficient_attention(q, k, v, attn_mask=mask, is_causal=True, block_size=2)
    out_copy = out.copy()
    memory_efficient_attention_backward(dout, cache)
    for a, c in zip((q, k, v, mask, dout), copies):
        np.testing.assert_array_equal(a, c)
    np.testing.assert_array_equal(out, out_copy)


def test_non_contiguous_and_integer_inputs():
    rng = np.random.default_rng(9)
    q = rng.standard_normal((6, 2, 5)).swapaxes(0, 1)  # (2, 6, 5), not contiguous
    k = rng.standard_normal((5, 8, 2)).T  # (2, 8, 5)
    v = np.arange(2 * 8 * 3).reshape(2, 8, 3) % 5  # integers become float64
    ref = scaled_dot_product_attention(q, k, v, is_causal=True)[0]
    out, _ = memory_efficient_attention(q, k, v, is_causal=True, block_size=3)
    assert out.dtype == np.float64
    _assert_close(out, ref, 1e-12)


def test_exported_from_functional():
    import npattn.functional as F

    assert F.memory_efficient_attention is memory_efficient_attention
    assert F.memory_efficient_attention_backward is memory_efficient_attention_backward


def test_default_block_size():
    rng = np.random.default_rng(10)
    q = rng.standard_normal((1, 2, 100, 8))
    _, cache = memory_efficient_attention(q, q, q)
    assert (cache.block_q, cache.block_k) == (64, 64)
    _, cache = memory_efficient_attention(q[..., :10, :], q, q, block_size=50)
    assert (cache.block_q, cache.block_k) == (10, 50)  # clipped to the lengths


@pytest.mark.parametrize("limit, tall", [(100**3, 192), (1 << 19, 64), (1 << 18, 56)])
def test_backward_query_block_is_the_tallest_the_blas_keeps_on_the_thread(monkeypatch, limit, tall):
    """With the default block size the backward's query block is the tallest multiple of the key
    block (else of 8) whose packed products beside 64 keys, ``m x 64 x (E + 1)``, numpy's BLAS runs
    on the calling thread (``_blas.single_thread_gemm_mnk``); its gradients equal the 64-row ones up
    to summation order; an explicit ``block_size`` is kept."""
    rng = np.random.default_rng(13)
    q, k, v, dout = (rng.standard_normal((1, 2, 300, 64)) for _ in range(4))
    monkeypatch.setattr(flash, "single_thread_gemm_mnk", lambda: limit)
    _, cache = memory_efficient_attention(q, k, v, is_causal=True)
    assert (cache.block_q, cache.block_k, cache.block_q_backward) == (64, 64, tall)
    step = 64 if tall >= 64 else 8
    assert tall * 64 * 65 <= limit < (tall + step) * 64 * 65
    grads = memory_efficient_attention_backward(dout, cache)
    ref = memory_efficient_attention_backward(dout, cache._replace(block_q_backward=0))
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref):
        _assert_close(got, want, 1e-13, name)
    _, cache = memory_efficient_attention(q, k, v, is_causal=True, block_size=64)
    assert cache.block_q_backward == 64


@pytest.mark.parametrize(
    "bad, exc", [(0, ValueError), (-3, ValueError), (1.5, TypeError), (True, TypeError), ("8", TypeError)]
)
def test_bad_block_size(bad, exc):
    x = np.ones((2, 4, 3))
    with pytest.raises(exc, match="block_size") as info:
        memory_efficient_attention(x, x, x, block_size=bad)
    assert repr(bad) in str(info.value) or str(bad) in str(info.value)


def test_bad_inputs_name_the_argument():
    rng = np.random.default_rng(11)
    q, k, v = rng.standard_normal((2, 4, 3)), rng.standard_normal((2, 5, 3)), rng.standard_normal((2, 5, 2))
    with pytest.raises(ValueError, match=r"^k: .*\(2, 5, 4\)"):
        memory_efficient_attention(q, rng.standard_normal((2, 5, 4)), v)
    with pytest.raises(ValueError, match=r"^v: "):
        memory_efficient_attention(q, k, rng.standard_normal((2, 6, 2)))
    with pytest.raises(ValueError, match=r"^k: "):
        memory_efficient_attention(q, rng.standard_normal((3, 5, 3)), rng.standard_normal((3, 5, 2)))
    with pytest.raises(TypeError, match=r"^attn_mask: .*int"):
        memory_efficient_attention(q, k, v, attn_mask=np.ones((4, 5), dtype=np.int64))
    with pytest.raises(ValueError, match=r"^attn_mask: .*\(2, 4, 5\).*\(4, 4\)"):
        memory_efficient_attention(q, k, v, attn_mask=np.ones((4, 4), bool))
    with pytest.raises(TypeError, match=r"^q: "):
        memory_efficient_attention(q > 0, k, v)
    with pytest.raises(TypeError, match=r"^is_causal: "):
        memory_efficient_attention(q, k, v, is_causal=1)
    with pytest.raises(TypeError, match=r"^scale: "):
        memory_efficient_attention(q, k, v, scale="x")
    out, cache = memory_efficient_attention(q, k, v)
    with pytest.raises(ValueError, match=r"^dout: .*\(2, 4, 2\).*\(2, 4, 3\)"):
        memory_efficient_attention_backward(np.ones((2, 4, 3)), cache)
    with pytest.raises(TypeError, match=r"^dout: "):
        memory_efficient_attention_backward(np.ones((2, 4, 2), bool), cache)


def test_scale_default_is_inverse_sqrt_e():
    rng = np.random.default_rng(12)
    q, k, v = (rng.standard_normal((5, 7)) for _ in range(3))
    a, _ = memory_efficient_attention(q, k, v)
    b, _ = memory_efficient_attention(q, k, v, scale=1 / math.sqrt(7))
    np.testing.assert_array_equal(a, b)


def test_key_max_equals_numpy_max():
    """The forward's halving maximum over the key axis: exactly ``np.max`` for odd and even key
    counts, with -inf rows and NaN."""
    rng = np.random.default_rng(11)
    for n in (1, 2, 3, 5, 64, 77, 341):
        st = rng.standard_normal((2, 3, n, 7))
        st[0, 1, :, 2] = -np.inf
        st[1, 2, n // 2, 4] = np.nan
        tmp = np.empty(2 * 3 * ((n + 1) // 2) * 7)
        out = np.empty((2, 3, 1, 7))
        flash._key_max(st, tmp, out)
        np.testing.assert_array_equal(out, np.max(st, axis=-2, keepdims=True))


def test_long_forward_key_blocks_match_short_ones():
    """With the default block size the forward runs long key blocks (``_forward_key_block``); its
    output and lse equal the 64 x 64 blocked forward's up to summation order, with a float mask,
    sinks and ALiBi."""
    rng = np.random.default_rng(12)
    h, L, E = 3, 700, 16
    q, k, v = (rng.standard_normal((h, L, E)) for _ in range(3))
    mask = rng.standard_normal((L, L))
    opts = dict(attn_mask=mask, is_causal=True, sinks=rng.standard_normal(h), alibi_slopes=rng.random(h))
    assert flash._forward_key_block(None, h, 64, 64, L, 8) > 64
    out, cache = memory_efficient_attention(q, k, v, **opts)
    ref, ref_cache = memory_efficient_attention(q, k, v, block_size=64, **opts)
    assert cache.block_k == 64
    _assert_close(out, ref, 1e-13, "out")
    _assert_close(cache.lse, ref_cache.lse, 1e-13, "lse")


@pytest.mark.parametrize(
    "opts",
    [
        dict(is_causal=True),
        dict(),
        dict(is_causal=True, window=(40, -1)),
        dict(window=(30, 20)),
        dict(is_causal=True, causal_align="bottom_right"),
    ],
)
def test_bounded_forward_equals_the_online_softmax(monkeypatch, opts):
    """The forward's fixed shift per row (``_score_bound``, no maximum, no rescaling) gives the
    online softmax's output and lse up to rounding, float64 and float32, with grouped-query heads
    and bands; the bound is above every score and no block needed the fallback."""
    rng = np.random.default_rng(14)
    for dt, tol in ((np.float64, 1e-13), (np.float32, 2e-6)):
        q = rng.standard_normal((2, 4, 300, 16)).astype(dt)
        lk = 260 if "causal_align" in opts else 300  # bottom_right with Lq > Lk: rows that see no key
        k, v = (rng.standard_normal((2, 2, lk, 16)).astype(dt) for _ in range(2))
        taken = []
        bounded_rows = flash._ForwardWorker.bounded_rows
        monkeypatch.setattr(
            flash._ForwardWorker, "bounded_rows", lambda self, *a: taken.append(bounded_rows(self, *a)) or taken[-1]
        )
        out, cache = memory_efficient_attention(q, k, v, enable_gqa=True, **opts)
        monkeypatch.setattr(flash, "_score_bound", lambda *a: None)
        ref, ref_cache = memory_efficient_attention(q, k, v, enable_gqa=True, **opts)
        monkeypatch.undo()
        assert taken and all(taken) == ("causal_align" not in opts)  # those rows' blocks fall back
        _assert_close(out, ref, tol, f"out {dt}")
        _assert_close(cache.lse, ref_cache.lse, tol, f"lse {dt}")


@pytest.mark.parametrize("dt", [np.float64, np.float32])
def test_bounded_forward_falls_back_when_the_bound_is_far(dt):
    """One key of huge norm orthogonal to every query puts the Cauchy-Schwarz bound far above the
    scores (exp(s - m) would underflow in float32, and lose digits in float64): those query blocks
    take the online softmax, and the result is the plain attention's."""
    rng = np.random.default_rng(15)
    q, k, v = (rng.standard_normal((1, 2, 200, 8)) for _ in range(3))
    q[..., 0] = 0.0
    k[:, :, 7] = 0.0
    k[:, :, 7, 0] = 1e4  # |k_7| = 1e4, q . k_7 = 0
    geo_bound = flash._score_bound(
        flash._geometry(q, k, v, None, True, 1, flash.AttentionOptions(), 64, 64, 0.0, 0),
        1.0,
        flash.AttentionOptions(),
        0.0,
    )
    assert float(np.min(geo_bound)) > 1e3
    out, cache = memory_efficient_attention(q.astype(dt), k.astype(dt), v.astype(dt), is_causal=True)
    ref, _ = scaled_dot_product_attention(q, k, v, is_causal=True)
    _assert_close(out, ref, 1e-13 if dt == np.float64 else 1e-5, "out")


@pytest.mark.parametrize("dt", [np.float64, np.float32])
def test_bounded_forward_shifts_large_bounds(monkeypatch, dt):
    """Scores near the bound and the bound large (queries and keys nearly parallel, s ~ 110):
    ``exp2(s log2 e)`` unshifted would overflow float32, so its blocks shift by the bound (float64's
    do not); no block fell back, and the result is the online softmax's (float64: to 1e-13; float32,
    where scores of ~110 carry roundings of ~1e-5: within a few eps |s| of float64's, as it is)."""
    rng = np.random.default_rng(16)
    u = rng.standard_normal(16)
    q, k = (6.0 * u + 0.05 * rng.standard_normal((1, 2, 150, 16)) for _ in range(2))
    v = rng.standard_normal((1, 2, 150, 16))
    taken = []
    bounded_rows = flash._ForwardWorker.bounded_rows
    monkeypatch.setattr(
        flash._ForwardWorker, "bounded_rows", lambda self, *a: taken.append(bounded_rows(self, *a)) or taken[-1]
    )
    out, cache = memory_efficient_attention(q.astype(dt), k.astype(dt), v.astype(dt), is_causal=True)
    assert taken and all(taken) and float(np.max(cache.lse)) > 100  # 2^(lse log2 e) overflows float32
    monkeypatch.setattr(flash, "_score_bound", lambda *a: None)
    ref, ref_cache = memory_efficient_attention(q.astype(dt), k.astype(dt), v.astype(dt), is_causal=True)
    if dt == np.float64:
        _assert_close(out, ref, 1e-13, "out")
        _assert_close(cache.lse, ref_cache.lse, 1e-13, "lse")
    else:
        # scores s carry roundings of ~eps |s|, and so do the weights exp(s - lse): both forwards stay
        # within a few eps |s| of float64's (online 0.6, bounded 1.6 on this case: base 2 has half
        # a bit less in s once |s log2 e| crosses a binade)
        truth, _ = memory_efficient_attention(q, k, v, is_causal=True)
        limit = 3 * np.finfo(np.float32).eps * float(np.max(cache.lse))
        assert np.max(np.abs(out - truth)) <= limit and np.max(np.abs(ref - truth)) <= limit


@pytest.mark.parametrize("v_scale", [1.0, 1e4, 1e30])
def test_bounded_forward_keeps_the_accumulator_finite(v_scale):
    """Unshifted, the bounded forward's accumulator ``a = sum_j 2^(s2_j) v_j`` reaches ``n 2^m2
    max|v|``: with every score at the bound (queries equal to the keys, s = 78 in float32, where
    ``n 2^m2`` alone stays finite) and large values it overflowed to inf (then NaN outputs) before
    the shift counted ``max|v|``.  Every score equal, so each row's output is the mean of the values
    it sees (float64 truth; float32 within 1e-5)."""
    rng = np.random.default_rng(17)
    u = rng.standard_normal(64)
    u *= math.sqrt(78.0 * 8.0) / np.linalg.norm(u)  # scale |q| |k| = 78 with scale 1/8
    q = np.broadcast_to(u, (1, 1, 512, 64)).astype(np.float32)
    v = v_scale * rng.standard_normal((1, 1, 512, 64))
    out, _ = memory_efficient_attention(q, q, v.astype(np.float32), is_causal=True)
    truth = np.cumsum(v.astype(np.float32).astype(np.float64), axis=-2) / np.arange(1, 513)[:, None]
    assert np.all(np.isfinite(out))
    _assert_close(out, truth, 1e-5, "out")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("scale", [-1.0, -0.05])
def test_bounded_forward_with_a_negative_scale(scale, dtype):
    """A negative scale (torch's ``scale`` allows one) flips the scores' sign: the bound must be
    ``|scale| |q| max|k|``.  With ``scale |q| |k|`` it was a lower bound, ``2^(s2 - m2)``
    overflowed and the outputs were NaN (float32 at |scale| 0.05, float64 at 1; scores up to ~3600
    here).  Float64 truth from the textbook tier."""
    rng = np.random.default_rng(3)
    q, k = (30 * rng.standard_normal((1, 2, 9, 4)) for _ in range(2))
    v = rng.standard_normal((1, 2, 9, 4))
    out, cache = memory_efficient_attention(*(a.astype(dtype) for a in (q, k, v)), scale=scale)
    truth, _ = reference.scaled_dot_product_attention(q, k, v, scale=scale)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(cache.lse))
    _assert_close(out, truth, 1e-12 if dtype == np.float64 else 1e-5, "out")


@pytest.mark.parametrize("shape", [(0, 1, 1), (0, 2, 5, 3), (2, 0, 4, 3)])
def test_bounded_forward_with_no_matrices(shape):
    """A zero-size batch or head axis: no bound to take (no maximum over zero rows), an empty result
    and empty gradients, as before the bounded forward."""
    x = np.ones(shape)
    out, cache = memory_efficient_attention(x, x, x, is_causal=True)
    assert out.shape == shape
    grads = memory_efficient_attention_backward(np.ones(shape), cache)
    assert [g.shape for g in grads] == [shape] * 3


def test_second_order_holds_no_copy_of_q_or_dout():
    """The second order's peak above the backward's is its three tangent outputs (tdq, tdk, tdv) and
    little more: no ``(L, E)``-sized transposed copies of ``scale q`` and ``dout`` (9fc4747: they
    were 2 q's more, 4.6 q's above the backward's peak here against 2.7 now, and read ``bench
    --second-order``'s memory ratio above its goal of 2x at L = 4096).  Both peaks count the same
    per-worker copies of dq, so the difference does not depend on the number of cores."""
    rng = np.random.default_rng(21)
    q, k, v, dout = (rng.standard_normal((1, 4, 2048, 64)).astype(np.float32) for _ in range(4))
    tangents = [rng.standard_normal(q.shape).astype(np.float32) for _ in range(3)]
    _, cache = memory_efficient_attention(q, k, v, is_causal=True)
    peaks = []
    for call in (
        lambda: memory_efficient_attention_backward(dout, cache),
        lambda: flash.memory_efficient_attention_backward_jvp(dout, cache, tangents),
    ):
        tracemalloc.start()
        try:
            call()
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
    assert peaks[1] - peaks[0] <= 3.5 * q.nbytes, [p / q.nbytes for p in peaks]

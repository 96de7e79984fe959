"""memory_efficient_attention with every attention option, dropout, grouped-query heads and
broadcast batch dimensions: equal to the dense formula (torch autograd as the oracle for every
gradient, 1e-10 in float64), to finite differences, exact zeros for rows that see no key, and no
(Lq, Lk) array with dropout or windows."""

import tracemalloc

import numpy as np
import pytest
from _fd import fd_check
from _oracles import torch_attention
from hypothesis import given, settings
from hypothesis import strategies as st

import npattn.functional.kernels as kernels
import npattn.functional.memory_efficient as me
from npattn.functional._random import draw_seed, keep_mask
from npattn.functional.attention import scaled_dot_product_attention
from npattn.functional.memory_efficient import (
    MemoryEfficientCache,
    memory_efficient_attention,
    memory_efficient_attention_backward,
)
from npattn.testing.gradcheck import gradcheck

MEA = memory_efficient_attention
MEB = memory_efficient_attention_backward


def _close(got, ref, tol=1e-10, what=""):
    got, ref = np.asarray(got), np.asarray(ref)
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    assert np.all(np.isfinite(got)), what
    if ref.size:
        err = float(np.max(np.abs(got - ref)))
        assert err <= tol * max(1.0, float(np.max(np.abs(ref)))), (what, err)


def _inputs(rng, b=2, hq=4, hk=2, lq=7, lk=9, e=3, ev=2):
    q = rng.standard_normal((b, hq, lq, e))
    k = rng.standard_normal((b, hk, lk, e))
    v = rng.standard_normal((b, hk, lk, ev))
    dout = rng.standard_normal((b, hq, lq, ev))
    return q, k, v, dout


def _run(q, k, v, dout, **kw):
    out, cache = MEA(q, k, v, **kw)
    return out, cache, MEB(dout, cache)


def _compare_with_torch(torch, q, k, v, dout, **kw):
    out, cache, grads = _run(q, k, v, dout, **kw)
    ref_kw = {key: val for key, val in kw.items() if key not in ("rng", "block_size")}
    p = kw.get("dropout_p", 0.0)
    ref_out, ref_grads = torch_attention(
        q, k, v, dout=dout, keep=lambda shape: keep_mask(cache.seed, p, shape), **ref_kw
    )  # the core's mask, regenerated from its seed
    _close(out, ref_out, what="out")
    assert len(grads) == len(ref_grads)
    for name, g, r in zip(("dq", "dk", "dv", "dmask/dsinks", "dsinks"), grads, ref_grads):
        assert g.dtype == np.float64
        _close(g, r, what=name)
    return out, cache, grads


OPTION_CASES = [
    dict(),
    dict(is_causal=True),
    dict(is_causal=True, causal_align="bottom_right"),
    dict(causal_align="bottom_right", window=(2, 1)),
    dict(window=(3, 0)),
    dict(window=(-1, 2)),
    dict(window=(1, -1), is_causal=True),
    dict(window=(0, 0)),
    dict(alibi_slopes="heads"),
    dict(alibi_slopes="batch_heads", is_causal=True),
    dict(softcap=0.8),
    dict(softcap=3.0, is_causal=True, window=(2, 0)),
    dict(sinks=True),
    dict(sinks=True, is_causal=True, causal_align="bottom_right"),
    dict(attn_mask="float", mask_grad=True),
    dict(attn_mask="float_rows", mask_grad=True, is_causal=True),
    dict(attn_mask="float_full", mask_grad=True, window=(2, 2)),
    dict(attn_mask="float"),
    dict(attn_mask="bool", sinks=True),
    dict(dropout_p=0.3, rng=1),
    dict(dropout_p=0.5, rng=2, is_causal=True, sinks=True),
    dict(
        dropout_p=0.25,
        rng=3,
        attn_mask="float",
        mask_grad=True,
        softcap=1.5,
        alibi_slopes="heads",
        sinks=True,
        window=(3, 1),
        is_causal=True,
        causal_align="bottom_right",
    ),
    dict(attn_mask="float_full", mask_grad=True, softcap=0.9, alibi_slopes="heads", sinks=True, window=(4, 2)),
]


def _materialise(case, rng, hq=4, lq=7, lk=9, b=2):
    kw = dict(case)
    if kw.get("alibi_slopes") == "heads":
        kw["alibi_slopes"] = rng.random(hq)
    elif kw.get("alibi_slopes") == "batch_heads":
        kw["alibi_slopes"] = rng.random((b, hq))
    if kw.get("sinks") is True:
        kw["sinks"] = rng.standard_normal(hq)
    m = kw.get("attn_mask")
    if m == "float":
        kw["attn_mask"] = rng.standard_normal((hq, 1, lk))
        kw["attn_mask"][1, 0, 2] = -np.inf
    elif m == "float_rows":
        kw["attn_mask"] = rng.standard_normal((lq, 1))
    elif m == "float_full":
        kw["attn_mask"] = rng.standard_normal((b, hq, lq, lk))
    elif m == "bool":
        kw["attn_mask"] = rng.random((lq, lk)) < 0.7
    return kw


@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("block_size", [None, 3])
@pytest.mark.parametrize("case", OPTION_CASES, ids=lambda c: "-".join(c) or "plain")
def test_equals_dense_formula_with_torch_autograd(case, block_size, gqa):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(len(case) * 7 + (block_size or 0) + gqa)
    q, k, v, dout = _inputs(rng, hk=2 if gqa else 4)
    kw = _materialise(case, rng)
    _compare_with_torch(torch, q, k, v, dout, block_size=block_size, enable_gqa=gqa, **kw)


@pytest.mark.parametrize("lq, lk", [(3, 11), (11, 3), (1, 6), (6, 1)])
@pytest.mark.parametrize(
    "case",
    [
        dict(is_causal=True, causal_align="bottom_right"),
        dict(window=(2, 0), causal_align="bottom_right", alibi_slopes="heads"),
        dict(window=(0, 1), sinks=True),
        dict(is_causal=True, causal_align="bottom_right", sinks=True, dropout_p=0.4, rng=0),
    ],
    ids=str,
)
def test_lq_differs_from_lk(case, lq, lk):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(lq * 13 + lk)
    q, k, v, dout = _inputs(rng, lq=lq, lk=lk)
    kw = _materialise(case, rng, lq=lq, lk=lk)
    _compare_with_torch(torch, q, k, v, dout, block_size=2, enable_gqa=True, **kw)


# -- dropout ---------------------------------------------------------------------------------------
def _dense_dropout(q, k, v, p, seed, is_causal=False):
    """The explicit formula with the same counter-based keep-mask, formed whole."""
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if is_causal:
        s = np.where(np.tri(s.shape[-2], s.shape[-1], dtype=bool), s, -np.inf)
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    w /= w.sum(axis=-1, keepdims=True)
    keep = keep_mask(seed, p, w.shape)
    return (w * keep / (1 - p)) @ v


@pytest.mark.parametrize("block_size", [None, 1, 4, 100])
def test_dropout_equals_the_dense_formula_with_the_same_keep_mask(block_size):
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((2, 3, 10, 4)), rng.standard_normal((2, 3, 12, 4)), rng.standard_normal((2, 3, 12, 5))
    out, cache = MEA(q, k, v, dropout_p=0.3, rng=np.random.default_rng(42), block_size=block_size, is_causal=True)
    assert cache.seed == draw_seed(np.random.default_rng(42))  # one draw per call
    _close(out, _dense_dropout(q, k, v, 0.3, cache.seed, is_causal=True), 1e-12)


def test_dropout_mask_does_not_depend_on_blocks_or_threads():
    rng = np.random.default_rng(1)
    q, k, v, dout = _inputs(rng, lq=30, lk=33)
    runs = []
    for bs in (None, 2, 7):
        for threads in (False, True):
            old = me._PARALLEL_MIN_SCORES
            me._PARALLEL_MIN_SCORES = 0 if threads else old
            try:
                runs.append(_run(q, k, v, dout, dropout_p=0.4, rng=9, block_size=bs, enable_gqa=True))
            finally:
                me._PARALLEL_MIN_SCORES = old
    for out, _, grads in runs[1:]:
        _close(out, runs[0][0], 1e-12)
        for g, r in zip(grads, runs[0][2]):
            _close(g, r, 1e-12)


def test_dropout_one_gives_zeros_and_zero_gradients():
    rng = np.random.default_rng(2)
    q, k, v, dout = _inputs(rng)
    out, _, grads = _run(q, k, v, dout, dropout_p=1.0, rng=0, enable_gqa=True, sinks=np.ones(4))
    assert np.all(out == 0)
    assert all(np.all(g == 0) for g in grads)


def test_dropout_same_seed_same_result_and_rng_advances_once():
    rng = np.random.default_rng(3)
    q, k, v, _ = _inputs(rng, hk=4)
    a, _ = MEA(q, k, v, dropout_p=0.5, rng=7)
    b, _ = MEA(q, k, v, dropout_p=0.5, rng=7)
    np.testing.assert_array_equal(a, b)
    g = np.random.default_rng(5)
    c1, _ = MEA(q, k, v, dropout_p=0.5, rng=g)
    c2, _ = MEA(q, k, v, dropout_p=0.5, rng=g)
    assert not np.array_equal(c1, c2)
    # the mean over many masks is the undropped output (inverted dropout is unbiased)
    ref, _ = MEA(q, k, v)
    mean = np.mean([MEA(q, k, v, dropout_p=0.5, rng=s)[0] for s in range(400)], axis=0)
    assert np.max(np.abs(mean - ref)) < 0.25


def test_dropout_never_allocates_a_score_matrix():
    """tracemalloc sees numpy's allocations: with dropout, forward + backward stay far below one
    (H, Lq, Lk) float64 array (the keep-mask of a block is formed from its position)."""
    rng = np.random.default_rng(4)
    h, L, E = 2, 2048, 16
    q, k, v, dout = (rng.standard_normal((h, L, E)) for _ in range(4))
    score_bytes = h * L * L * 8  # 64 MiB; q is 0.5 MiB
    tracemalloc.start()
    try:
        out, cache = MEA(q, k, v, dropout_p=0.2, rng=0, block_size=64)
        grads = MEB(dout, cache)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    del out, cache, grads
    assert peak < 12 * q.nbytes + score_bytes / 32, (peak, score_bytes)


# -- grouped-query heads and broadcast batch dimensions ---------------------------------------------
def test_gqa_does_not_copy_k_or_v():
    rng = np.random.default_rng(5)
    hq, hk, L, E = 8, 1, 512, 32
    q = rng.standard_normal((hq, L, E))
    k, v, dout = rng.standard_normal((hk, L, E)), rng.standard_normal((hk, L, E)), rng.standard_normal((hq, L, E))
    out, cache = MEA(q, k, v, enable_gqa=True)
    assert cache.k is k and cache.v is v
    tracemalloc.start()
    try:
        # 64 x 64 blocks given: the bound counts copies of k and v, not the block buffers (the default
        # backward's query block may be twice as tall, ``_tall_query_block``)
        out, cache = MEA(q, k, v, enable_gqa=True, is_causal=True, block_size=64)
        grads = MEB(dout, cache)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # out, dq and its worker copies, scaled q, D, lse ... but nothing like k repeated 8 times twice
    # on top of that; a repeat of k and v alone would add 2 * hq * k.nbytes
    assert peak < 6 * q.nbytes + hq * k.nbytes, (peak, q.nbytes)
    assert grads[1].shape == k.shape and grads[2].shape == v.shape


@pytest.mark.parametrize(
    "shapes",
    [
        ((1, 4, 7, 3), (2, 1, 9, 3), (2, 4, 9, 2)),  # q broadcast over the batch, k over the heads
        ((4, 7, 3), (2, 4, 9, 3), (2, 4, 9, 2)),  # q without the batch axis
        ((2, 4, 7, 3), (9, 3), (9, 2)),  # one k, v for everything
        ((3, 2, 4, 7, 3), (2, 1, 9, 3), (1, 1, 9, 2)),
    ],
)
def test_batch_dimensions_broadcast_like_torch(shapes):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal(s) for s in shapes)
    lead = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    dout = rng.standard_normal(lead + (7, 2))
    out, _, grads = _compare_with_torch(torch, q, k, v, dout, block_size=3, is_causal=True, sinks=None)
    assert out.shape == lead + (7, 2)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


def test_gqa_with_broadcast_batch_and_every_option():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    q = rng.standard_normal((3, 1, 6, 5, 4))
    k = rng.standard_normal((1, 2, 2, 8, 4))
    v = rng.standard_normal((3, 2, 1, 8, 3))
    dout = rng.standard_normal((3, 2, 6, 5, 3))
    mask = rng.standard_normal((2, 6, 5, 8))
    _compare_with_torch(
        torch,
        q,
        k,
        v,
        dout,
        block_size=3,
        enable_gqa=True,
        attn_mask=mask,
        mask_grad=True,
        sinks=rng.standard_normal(6),
        alibi_slopes=rng.random((3, 1, 6)),
        softcap=2.0,
        window=(3, 2),
        dropout_p=0.2,
        rng=1,
    )


# -- rows that see no key ---------------------------------------------------------------------------
@pytest.mark.parametrize("case", OPTION_CASES, ids=lambda c: "-".join(c) or "plain")
def test_fully_masked_rows_are_exact_zeros(case):
    rng = np.random.default_rng(8)
    q, k, v, dout = _inputs(rng)
    kw = _materialise(case, rng)
    m = kw.get("attn_mask")
    if m is None or m.dtype == bool:
        hide = np.ones((7, 9), bool)
        hide[3] = False
        kw["attn_mask"] = hide if m is None else (np.broadcast_to(m, (7, 9)) & hide)
    else:
        m = np.array(np.broadcast_to(m, np.broadcast_shapes(m.shape, (7, 9))))
        m[..., 3, :] = -np.inf
        kw["attn_mask"] = m
    with np.errstate(all="raise"):
        out, cache, grads = _run(q, k, v, dout, block_size=3, enable_gqa=True, **kw)
    assert np.all(out[..., 3, :] == 0)
    assert np.all(grads[0][..., 3, :] == 0)
    if kw.get("mask_grad"):
        assert np.all(grads[3][..., 3, :] == 0)
    for g in grads:
        assert np.all(np.isfinite(g))
    # the row contributes nothing to dk, dv, dsinks: same as with the row's upstream gradient zeroed
    dout0 = dout.copy()
    dout0[..., 3, :] = 0
    for g, g0 in zip(grads, MEB(dout0, cache)):
        np.testing.assert_array_equal(g, g0) if g.shape == q.shape else _close(g, g0, 1e-14)


@pytest.mark.parametrize(
    "kw",
    [
        dict(is_causal=True, causal_align="bottom_right"),
        dict(window=(0, 0), causal_align="bottom_right"),
        dict(window=(1, -1), is_causal=True, causal_align="bottom_right", sinks=np.ones(4)),
    ],
    ids=str,
)
def test_rows_before_the_first_key_are_exact_zeros(kw):
    """Bottom-right alignment with Lq > Lk puts the first queries before every key."""
    rng = np.random.default_rng(9)
    q, k, v, dout = _inputs(rng, lq=9, lk=4)
    with np.errstate(all="raise"):
        out, cache, grads = _run(q, k, v, dout, block_size=2, enable_gqa=True, **kw)
    n = 5 if kw.get("is_causal") or kw.get("window") == (0, 0) else 0
    assert n and np.all(out[..., :n, :] == 0) and np.all(grads[0][..., :n, :] == 0)
    assert np.all(np.isfinite(out)) and all(np.all(np.isfinite(g)) for g in grads)


def test_everything_masked_with_every_option():
    rng = np.random.default_rng(10)
    q, k, v, dout = _inputs(rng)
    mask = np.full((7, 9), -np.inf)
    out, cache, grads = _run(
        q,
        k,
        v,
        dout,
        attn_mask=mask,
        mask_grad=True,
        sinks=rng.standard_normal(4),
        alibi_slopes=np.ones(4),
        softcap=1.0,
        dropout_p=0.5,
        rng=0,
        enable_gqa=True,
    )
    assert np.all(out == 0)
    assert all(np.all(g == 0) for g in grads)


# -- windows: work grows with L * window ------------------------------------------------------------
def _count_blocks(monkeypatch, **kw):
    calls = []
    apply = me._Scores.apply

    def counting(self, st, i0, i1, j0, j1, *a, **k):
        calls.append((i0, i1, j0, j1))
        return apply(self, st, i0, i1, j0, j1, *a, **k)

    monkeypatch.setattr(me._Scores, "apply", counting)
    rng = np.random.default_rng(11)
    L = kw.pop("L")
    q, k, v = (rng.standard_normal((1, L, 8)) for _ in range(3))
    out, cache = MEA(q, k, v, block_size=16, **kw)
    n_fwd = len(calls)
    MEB(rng.standard_normal(out.shape), cache)
    monkeypatch.undo()
    return n_fwd, len(calls) - n_fwd, calls


@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
def test_window_forms_only_the_blocks_of_the_band(monkeypatch, align):
    counts = {}
    for L in (128, 256, 512):
        n_fwd, n_bwd, calls = _count_blocks(monkeypatch, L=L, is_causal=True, window=(32, 0), causal_align=align)
        counts[L] = (n_fwd, n_bwd)
        for i0, i1, j0, j1 in calls:  # every formed block holds a visible pair
            assert j0 <= i1 - 1 and j1 - 1 >= i0 - 32
    # linear in L: doubling L doubles the blocks (up to the first band's edge effects)
    for a, b in ((128, 256), (256, 512)):
        for f in (0, 1):
            assert counts[b][f] <= 2 * counts[a][f] + 4
    assert counts[512][0] <= (512 // 16) * 4  # a query block of 16 meets at most 4 key blocks of the band
    full_fwd, _, _ = _count_blocks(monkeypatch, L=512, is_causal=True)
    assert counts[512][0] * 3 < full_fwd


def test_window_at_long_length_uses_little_memory():
    rng = np.random.default_rng(12)
    L, E = 8192, 16
    q, k, v, dout = (rng.standard_normal((1, L, E)).astype(np.float32) for _ in range(4))
    tracemalloc.start()
    try:
        out, cache = MEA(q, k, v, is_causal=True, window=(64, 0))
        grads = MEB(dout, cache)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 12 * q.nbytes, (peak, q.nbytes)
    band = np.tri(300, 364, 64, dtype=bool) & ~np.tri(300, 364, -1, dtype=bool)  # the last 300 queries
    ref, _ = scaled_dot_product_attention(q[:, -300:], k[:, -364:], v[:, -364:], attn_mask=band)
    _close(out[:, -300:], ref, 1e-5)
    assert all(g.dtype == np.float32 for g in grads)


# -- finite differences -----------------------------------------------------------------------------
FD_CASES = [
    dict(is_causal=True, causal_align="bottom_right"),
    dict(window=(1, 1)),
    dict(alibi_slopes=np.array([0.5, 0.25])),
    dict(softcap=0.7),
    dict(dropout_p=0.4, rng=3),
    dict(is_causal=True, window=(2, 0), alibi_slopes=np.array([0.3, 0.6]), softcap=1.2, dropout_p=0.3, rng=5),
]


@pytest.mark.parametrize("kw", FD_CASES, ids=lambda c: "-".join(c))
def test_gradients_match_finite_differences(kw):
    rng = np.random.default_rng(13)
    q = rng.standard_normal((1, 2, 4, 3))
    k, v = rng.standard_normal((1, 1, 5, 3)), rng.standard_normal((1, 1, 5, 2))
    opts = dict(kw, enable_gqa=True, block_size=2)
    rep = gradcheck(MEA, q, k, v, **opts)
    assert rep.ok, str(rep)
    if "rng" in opts:  # the independent helper needs the same mask every call: a fixed int seed
        assert isinstance(opts["rng"], int)
    errs = fd_check(MEA, MEB, [q, k, v], rng.standard_normal((1, 2, 4, 2)), **opts)
    assert max(errs) < 1e-6, errs


def _with_mask_and_sinks(q, k, v, attn_mask, sinks, **kw):
    return MEA(q, k, v, attn_mask=attn_mask, sinks=sinks, mask_grad=True, **kw)


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(is_causal=True, softcap=0.9, alibi_slopes=np.array([0.2, 0.4])),
        dict(window=(1, 0), dropout_p=0.3, rng=4, causal_align="bottom_right"),
    ],
    ids=str,
)
@pytest.mark.parametrize("mask_shape", [(2, 4, 5), (4, 1), (1, 5), (2, 1, 1)])
def test_dmask_and_dsinks_match_finite_differences(kw, mask_shape):
    rng = np.random.default_rng(14)
    q = rng.standard_normal((2, 4, 3))
    k, v = rng.standard_normal((2, 5, 3)), rng.standard_normal((2, 5, 2))
    mask = rng.standard_normal(mask_shape)
    sinks = rng.standard_normal(2)
    opts = dict(kw, block_size=2)
    rep = gradcheck((_with_mask_and_sinks, MEB), q, k, v, mask, sinks, **opts)
    assert rep.ok, str(rep)
    errs = fd_check(_with_mask_and_sinks, MEB, [q, k, v, mask, sinks], rng.standard_normal((2, 4, 2)), **opts)
    assert max(errs) < 1e-6, errs
    grads = MEB(rng.standard_normal((2, 4, 2)), _with_mask_and_sinks(q, k, v, mask, sinks, **opts)[1])
    assert grads[3].shape == mask_shape and grads[4].shape == (2,)


# -- hypothesis: any combination equals the dense formula --------------------------------------------
@st.composite
def option_cases(draw):
    gqa = draw(st.booleans())
    hk = draw(st.integers(1, 2))
    hq = hk * (draw(st.integers(1, 3)) if gqa else 1)
    b = draw(st.integers(1, 2))
    lq, lk = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    e, ev = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, hq, lq, e))
    k = rng.standard_normal((b, hk, lk, e))
    v = rng.standard_normal((b, hk, lk, ev))
    dout = rng.standard_normal((b, hq, lq, ev))
    kw = dict(
        enable_gqa=gqa,
        block_size=draw(st.sampled_from([None, 1, 2, 3, 5])),
        is_causal=draw(st.booleans()),
        causal_align=draw(st.sampled_from(["top_left", "bottom_right"])),
    )
    if draw(st.booleans()):
        kw["window"] = (draw(st.integers(-1, 4)), draw(st.integers(-1, 4)))
    if draw(st.booleans()):
        kw["alibi_slopes"] = rng.random(hq)
    if draw(st.booleans()):
        kw["softcap"] = draw(st.floats(0.5, 5.0))
    if draw(st.booleans()):
        kw["sinks"] = rng.standard_normal(hq)
    if draw(st.booleans()):
        kw["dropout_p"], kw["rng"] = draw(st.sampled_from([0.2, 0.5])), int(seed % 1000)
    mask_kind = draw(st.sampled_from(["none", "bool", "float"]))
    if mask_kind != "none":
        shape = tuple(n if draw(st.booleans()) else 1 for n in (b, hq, lq, lk))[draw(st.integers(0, 2)) :]
        if mask_kind == "bool":
            kw["attn_mask"] = rng.random(shape) < 0.7
        else:
            kw["attn_mask"] = rng.standard_normal(shape)
            kw["attn_mask"][rng.random(shape) < 0.2] = -np.inf
            kw["mask_grad"] = draw(st.booleans())
    return q, k, v, dout, kw


@settings(deadline=None, max_examples=120)
@given(option_cases())
def test_any_combination_equals_the_dense_formula(case):
    torch = pytest.importorskip("torch")
    q, k, v, dout, kw = case
    _compare_with_torch(torch, q, k, v, dout, **kw)


@settings(deadline=None, max_examples=40)
@given(option_cases())
def test_block_size_and_threads_change_nothing(case):
    q, k, v, dout, kw = case
    kw.pop("block_size")
    _, _, ref = _run(q, k, v, dout, block_size=2, **kw)
    old = me._PARALLEL_MIN_SCORES
    me._PARALLEL_MIN_SCORES = 0
    try:
        _, _, got = _run(q, k, v, dout, block_size=3, **kw)
    finally:
        me._PARALLEL_MIN_SCORES = old
    for g, r in zip(got, ref):
        _close(g, r, 1e-12)


# -- dtype, kernels, inputs untouched -----------------------------------------------------------------
def test_float32_stays_float32_with_options():
    rng = np.random.default_rng(15)
    q, k, v, dout = (a.astype(np.float32) for a in _inputs(rng))
    kw = dict(
        attn_mask=rng.standard_normal((7, 9)),
        mask_grad=True,
        sinks=rng.standard_normal(4),
        alibi_slopes=rng.random(4),
        softcap=2.0,
        window=(3, 1),
        dropout_p=0.2,
        rng=0,
        enable_gqa=True,
    )
    out, cache, grads = _run(q, k, v, dout, **kw)
    assert out.dtype == np.float32 and cache.lse.dtype == np.float32
    assert all(g.dtype == np.float32 for g in grads)
    out64, _, grads64 = _run(*(a.astype(np.float64) for a in (q, k, v, dout)), **kw)
    _close(out, out64, 1e-5)
    for g, r in zip(grads, grads64):
        _close(g, r, 1e-4)


def test_kernels_reexport_the_unchecked_pair():
    assert kernels.memory_efficient_attention is me.memory_efficient_attention_kernel
    assert kernels.memory_efficient_attention_backward is me.memory_efficient_attention_backward_kernel
    rng = np.random.default_rng(16)
    q, k, v, dout = _inputs(rng)
    kw = dict(is_causal=True, enable_gqa=True, sinks=rng.standard_normal(4), window=(2, 0))
    out, cache = MEA(q, k, v, **kw)
    out2, cache2 = kernels.memory_efficient_attention(q, k, v, **kw)
    np.testing.assert_array_equal(out, out2)
    for a, b in zip(MEB(dout, cache), kernels.memory_efficient_attention_backward(dout, cache2)):
        np.testing.assert_array_equal(a, b)


def test_inputs_are_not_modified_with_options():
    rng = np.random.default_rng(17)
    q, k, v, dout = _inputs(rng)
    mask, sinks, slopes = rng.standard_normal((4, 7, 9)), rng.standard_normal(4), rng.random(4)
    arrays = (q, k, v, dout, mask, sinks, slopes)
    copies = [a.copy() for a in arrays]
    _run(
        q,
        k,
        v,
        dout,
        attn_mask=mask,
        mask_grad=True,
        sinks=sinks,
        alibi_slopes=slopes,
        softcap=1.0,
        enable_gqa=True,
        dropout_p=0.1,
        rng=0,
    )
    for a, c in zip(arrays, copies):
        np.testing.assert_array_equal(a, c)


def test_cache_keeps_only_linear_statistics_with_options():
    rng = np.random.default_rng(18)
    q, k, v, _ = _inputs(rng, lq=20, lk=24)
    mask = rng.random((24,)) < 0.8
    out, cache = MEA(q, k, v, attn_mask=mask, dropout_p=0.5, rng=0, enable_gqa=True, window=(3, 3))
    assert isinstance(cache, MemoryEfficientCache)
    arrays = [x for x in cache if isinstance(x, np.ndarray)]
    assert all(a.shape[-2:] != (20, 24) and a.size <= max(q.size, out.size) for a in arrays)
    assert cache.attn_mask is mask


# -- bad input ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (dict(dropout_p=1.5), ValueError, "^dropout_p: "),
        (dict(dropout_p="0.1"), TypeError, "^dropout_p: "),
        (dict(dropout_p=0.1, rng="seed"), TypeError, "^rng: "),
        (dict(rng=1.5), TypeError, "^rng: "),  # checked even without dropout
        (dict(rng=-1), ValueError, "^rng: "),
        (dict(enable_gqa=1), TypeError, "^enable_gqa: "),
        (dict(causal_align="bottom"), ValueError, "^causal_align: "),
        (dict(causal_align=None), TypeError, "^causal_align: "),
        (dict(window=3), TypeError, "^window: "),
        (dict(window=(1, 2, 3)), ValueError, "^window: "),
        (dict(window=(1.5, 0)), TypeError, "^window: "),
        (dict(window=(-2, 0)), ValueError, "^window: "),
        (dict(alibi_slopes=np.ones(3)), ValueError, "^alibi_slopes: .*\\(3,\\)"),
        (dict(alibi_slopes=np.array([1.0, np.nan, 1, 1])), ValueError, "^alibi_slopes: "),
        (dict(alibi_slopes=np.ones(4, bool)), TypeError, "^alibi_slopes: "),
        (dict(softcap=0.0), ValueError, "^softcap: "),
        (dict(softcap=-1.0), ValueError, "^softcap: "),
        (dict(softcap="1"), TypeError, "^softcap: "),
        (dict(sinks=np.ones(3)), ValueError, "^sinks: .*\\(4,\\).*\\(3,\\)"),
        (dict(sinks=np.ones((1, 4))), ValueError, "^sinks: "),
        (dict(sinks=np.array([1.0, np.inf, 0, 0])), ValueError, "^sinks: "),
        (dict(mask_grad=True), ValueError, "^mask_grad: "),
        (dict(mask_grad=True, attn_mask=np.ones((7, 9), bool)), ValueError, "^mask_grad: "),
        (dict(mask_grad="yes", attn_mask=np.ones((7, 9))), TypeError, "^mask_grad: "),
    ],
)
def test_bad_options_raise_named_errors(kw, exc, match):
    rng = np.random.default_rng(19)
    q, k, v, _ = _inputs(rng)
    with pytest.raises(exc, match=match):
        MEA(q, k, v, enable_gqa=kw.pop("enable_gqa", True), **kw)


def test_gqa_head_mismatch_is_refused():
    rng = np.random.default_rng(20)
    q, k, v, _ = _inputs(rng, hq=4, hk=3)
    with pytest.raises(ValueError, match="^k: .*multiple"):
        MEA(q, k, v, enable_gqa=True)
    with pytest.raises(ValueError, match="^k: .*enable_gqa"):
        MEA(q, k[:, :2], v[:, :2])


def test_backward_refuses_another_cache():
    rng = np.random.default_rng(21)
    q, k, v, dout = _inputs(rng, hk=4)
    _, sdpa_cache = scaled_dot_product_attention(q, k, v)
    with pytest.raises(
        TypeError,
        match="^cache: memory_efficient_attention_backward expected a MemoryEfficientCache.*got AttentionCache$",
    ):
        MEB(dout, sdpa_cache)
    with pytest.raises(TypeError, match="^cache: .*got tuple"):
        MEB(dout, tuple(MEA(q, k, v)[1]))
    with pytest.raises(TypeError, match="^cache: .*got NoneType"):
        MEB(dout, None)


@pytest.mark.parametrize("p", [0.0, 1e-9, 0.1, 0.5, 0.999, 1.0])
def test_block_keep_masks_are_the_keep_mask_blocks(p):
    """The in-place block generator is bit for bit ``keep_mask`` on the same block, transposed."""
    drop = me._Dropout(987654321, p, (2, 3), 17, 23)
    bufs = drop.buffers(8, 8)
    full = keep_mask(987654321, p, (2, 3, 17, 23))
    for i0, i1, j0, j1 in [(0, 8, 0, 8), (9, 17, 16, 23), (3, 5, 7, 8), (16, 17, 0, 1)]:
        np.testing.assert_array_equal(drop.keep_t(i0, i1, j0, j1, bufs), full[..., i0:i1, j0:j1].swapaxes(-1, -2))


def test_inputs_without_a_head_axis_take_every_option():
    """``(L, E)`` inputs: one head, so ``sinks`` is ``(1,)`` and ``alibi_slopes`` a scalar."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(22)
    q, k, v, dout = (
        rng.standard_normal((6, 3)),
        rng.standard_normal((8, 3)),
        rng.standard_normal((8, 2)),
        rng.standard_normal((6, 2)),
    )
    _compare_with_torch(
        torch,
        q,
        k,
        v,
        dout,
        block_size=3,
        sinks=np.array([0.3]),
        alibi_slopes=np.array(0.5),
        softcap=1.5,
        window=(2, 1),
        causal_align="bottom_right",
        attn_mask=rng.standard_normal((6, 8)),
        mask_grad=True,
        dropout_p=0.3,
        rng=2,
    )


def test_empty_sequences():
    rng = np.random.default_rng(23)
    for lq, lk in [(0, 5), (4, 0), (0, 0)]:
        q, k, v = rng.standard_normal((2, lq, 3)), rng.standard_normal((2, lk, 3)), rng.standard_normal((2, lk, 2))
        out, cache = MEA(q, k, v, sinks=np.ones(2), dropout_p=0.5, rng=0, window=(1, 1), is_causal=True)
        grads = MEB(np.ones(out.shape), cache)
        assert out.shape == (2, lq, 2) and np.all(out == 0)
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape, (2,)]
        assert all(np.all(g == 0) for g in grads)


def test_bench_window_sweep_measures_the_memory_efficient_core():
    import npattn.tools.bench as B

    r = B.window_one("memory_efficient_attention", 256, (32, 0), heads=2, head_dim=16)
    assert "error" not in r and not r.get("missing"), r
    assert r["seconds"] > 0 and r["extra_mib"] >= 0

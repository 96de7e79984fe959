"""The attention options of ``scaled_dot_product_attention``: equal to the explicit dense formula
(``tests/_oracles.py``), gradients equal to central differences (``npattn.gradcheck`` and the
independent ``tests/_fd.py``), every block geometry equal to one block, exact zeros for rows that
see no key, batch broadcasting, and windowed work that grows with ``L * window``."""

import zlib

import numpy as np
import pytest
from _fd import fd_check, fd_gradients
from _oracles import dense, visible
from hypothesis import given, settings
from hypothesis import strategies as st

import npattn.functional as F
import npattn.functional.attention as A
import npattn.functional.kernels as K
import npattn.functional.reference as R
from npattn.testing import gradcheck

sdpa, sdpa_bw = F.scaled_dot_product_attention, F.scaled_dot_product_attention_backward

# combination classes: each option alone, then mixtures, then everything at once
COMBOS = {
    "plain": {},
    "causal": {"is_causal": True},
    "causal-br": {"is_causal": True, "causal_align": "bottom_right"},
    "window": {"window": (2, 1)},
    "window-left": {"window": (2, -1)},
    "window-right": {"window": (-1, 1)},
    "window-0": {"window": (0, 0)},
    "window-causal": {"window": (2, 0), "is_causal": True},
    "window-causal-right": {"window": (1, 3), "is_causal": True},
    "window-br": {"window": (1, 2), "causal_align": "bottom_right"},
    "alibi": {"alibi": True},
    "alibi-br-causal": {"alibi": True, "causal_align": "bottom_right", "is_causal": True},
    "softcap": {"softcap": 0.7},
    "sinks": {"sinks": True},
    "mask_grad": {"mask": "float", "mask_grad": True},
    "bool-mask": {"mask": "bool"},
    "dropout": {"dropout_p": 0.3},
    "gqa": {"gqa": True},
    "gqa-window-causal": {"gqa": True, "window": (2, 0), "is_causal": True},
    "window-alibi-br": {"window": (3, 1), "alibi": True, "causal_align": "bottom_right"},
    "softcap-sinks-window": {"softcap": 1.5, "sinks": True, "window": (1, 1)},
    "mask_grad-window-causal": {"mask": "float", "mask_grad": True, "window": (3, 0), "is_causal": True},
    "sinks-dropout-gqa": {"sinks": True, "dropout_p": 0.25, "gqa": True},
    "softcap-alibi-mask": {"softcap": 2.0, "alibi": True, "mask": "float", "mask_grad": True},
    "everything": {
        "gqa": True,
        "is_causal": True,
        "causal_align": "bottom_right",
        "window": (2, 0),
        "alibi": True,
        "softcap": 1.2,
        "sinks": True,
        "mask": "float",
        "mask_grad": True,
        "dropout_p": 0.2,
    },
    "everything-bool": {
        "gqa": True,
        "window": (1, 2),
        "alibi": True,
        "softcap": 0.9,
        "sinks": True,
        "mask": "bool",
        "dropout_p": 0.2,
    },
}


def make(combo, lq=6, lk=8, b=2, hk=2, e=3, ev=2, seed=0, dtype=np.float64):
    """Inputs and keyword arguments of one combination class."""
    rng = np.random.default_rng(zlib.crc32(repr((sorted(combo.items()), lq, lk, seed)).encode()))
    hq = 2 * hk if combo.get("gqa") else hk
    q = rng.standard_normal((b, hq, lq, e)).astype(dtype)
    k = rng.standard_normal((b, hk, lk, e)).astype(dtype)
    v = rng.standard_normal((b, hk, lk, ev)).astype(dtype)
    kw = {
        key: combo[key]
        for key in ("is_causal", "causal_align", "window", "softcap", "dropout_p", "mask_grad")
        if key in combo
    }
    kw["enable_gqa"] = bool(combo.get("gqa"))
    if combo.get("alibi"):
        kw["alibi_slopes"] = rng.uniform(0.1, 1.0, (hq,))
    if combo.get("sinks"):
        kw["sinks"] = rng.standard_normal(hq)
    if combo.get("mask") == "float":
        kw["attn_mask"] = rng.standard_normal((hq, lq, lk)).astype(dtype)
    elif combo.get("mask") == "bool":
        kw["attn_mask"] = rng.random((b, 1, lq, lk)) > 0.3
    if "dropout_p" in combo:
        kw["rng"] = 7
    return q, k, v, kw


def grad_inputs(q, k, v, kw):
    """The differentiable inputs: q, k, v, then the mask (mask_grad), then the sinks."""
    xs = [q, k, v]
    if kw.get("mask_grad"):
        xs.append(kw["attn_mask"])
    if kw.get("sinks") is not None:
        xs.append(kw["sinks"])
    return xs


def pair(kw):
    """``(forward, backward)`` taking every differentiable input positionally."""
    fixed = {key: val for key, val in kw.items() if key != "sinks" and not (key == "attn_mask" and kw.get("mask_grad"))}

    def forward(q, k, v, *rest):
        extra = dict(fixed)
        rest = list(rest)
        if kw.get("mask_grad"):
            extra["attn_mask"] = rest.pop(0)
        if kw.get("sinks") is not None:
            extra["sinks"] = rest.pop(0)
        return sdpa(q, k, v, **extra)

    return forward, sdpa_bw


@pytest.fixture(params=[2, 3, 128], ids=lambda h: f"height{h}")
def height(request, monkeypatch):
    monkeypatch.setattr(A, "_CAUSAL_BLOCK", request.param)
    return request.param


# -- the forward equals the dense formula ------------------------------------------------------------------
@pytest.mark.parametrize("name", list(COMBOS))
@pytest.mark.parametrize("lq,lk", [(7, 7), (5, 8), (8, 5)])
def test_forward_equals_dense_formula(name, lq, lk, height):
    q, k, v, kw = make(COMBOS[name], lq, lk)
    out, cache = sdpa(q, k, v, **kw)
    want = dense(q, k, v, keep=cache.keep, **{key: val for key, val in kw.items() if key not in ("mask_grad", "rng")})
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-13)
    assert out.flags.c_contiguous and out.dtype == q.dtype


# -- the textbook tier: the same numbers, forward and every gradient ------------------------------------------
@pytest.mark.parametrize("name", list(COMBOS))
@pytest.mark.parametrize("lq,lk", [(7, 7), (5, 8), (8, 5)])
def test_equals_the_textbook_tier(name, lq, lk, height):
    q, k, v, kw = make(COMBOS[name], lq, lk)
    out, cache = sdpa(q, k, v, **kw)
    rout, rcache = R.scaled_dot_product_attention(q, k, v, **kw)
    np.testing.assert_allclose(out, rout, rtol=1e-12, atol=1e-12)
    g = np.random.default_rng(6).standard_normal(out.shape)
    grads, rgrads = sdpa_bw(g, cache), R.scaled_dot_product_attention_backward(g, rcache)
    assert len(grads) == len(rgrads)
    for a, b_ in zip(grads, rgrads):
        np.testing.assert_allclose(a, b_, rtol=1e-12, atol=1e-12)


# -- gradients: central differences, twice ------------------------------------------------------------------
@pytest.mark.parametrize("name", list(COMBOS))
def test_gradients_equal_finite_differences(name, monkeypatch):
    monkeypatch.setattr(A, "_CAUSAL_BLOCK", 2)  # several blocks, windowed ones starting past key 0
    q, k, v, kw = make(COMBOS[name], 5, 6, b=1, hk=2, e=2, ev=2)
    xs = grad_inputs(q, k, v, kw)
    fwd, bwd = pair(kw)
    report = gradcheck((fwd, bwd), *xs, seed=3)
    assert report.ok, str(report)
    out, _ = fwd(*xs)
    g = np.random.default_rng(11).standard_normal(out.shape)
    errs = fd_check(fwd, bwd, xs, g)
    assert max(errs) <= 1e-6, errs


def test_gradient_tuple_order():
    q, k, v, kw = make(COMBOS["everything"])
    out, cache = sdpa(q, k, v, **kw)
    grads = sdpa_bw(np.ones_like(out), cache)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape, kw["attn_mask"].shape, kw["sinks"].shape]
    q, k, v, kw = make(COMBOS["sinks"])
    assert len(sdpa_bw(np.ones((2, 2, 6, 2)), sdpa(q, k, v, **kw)[1])) == 4


@pytest.mark.parametrize("shape", [(6, 8), (1, 6, 8), (2, 1, 1, 8), (1, 8), (6, 1), (2, 1, 6, 8)])
def test_dmask_is_summed_to_the_masks_own_shape(shape):
    rng = np.random.default_rng(5)
    q, k, v, kw = make({"gqa": True, "window": (3, 1)})
    mask = rng.standard_normal(shape)
    fwd = lambda m: sdpa(q, k, v, attn_mask=m, mask_grad=True, **kw)  # noqa: E731
    out, cache = fwd(mask)
    g = rng.standard_normal(out.shape)
    dmask = sdpa_bw(g, cache)[3]
    assert dmask.shape == mask.shape
    (num,) = fd_gradients(lambda m: np.sum(fwd(m)[0] * g), [mask])
    np.testing.assert_allclose(dmask, num, rtol=1e-6, atol=1e-8)  # (6, 1): a row shift, gradient 0


# -- every block geometry gives the same numbers -----------------------------------------------------------
@pytest.mark.parametrize("name", [n for n in COMBOS if n != "plain"])
@pytest.mark.parametrize("h", [1, 2, 3])
def test_blocks_equal_one_block(name, h, monkeypatch):
    q, k, v, kw = make(COMBOS[name], 9, 11)
    g = np.random.default_rng(2).standard_normal((2, q.shape[1], 9, 2))
    monkeypatch.setattr(A, "_CAUSAL_BLOCK", 10**6)
    out1, c1 = sdpa(q, k, v, **kw)
    grads1 = sdpa_bw(g, c1)
    monkeypatch.setattr(A, "_CAUSAL_BLOCK", h)
    out2, c2 = sdpa(q, k, v, **kw)
    np.testing.assert_allclose(out2, out1, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(c2.weights, c1.weights, rtol=1e-12, atol=1e-14)
    for a, b_ in zip(sdpa_bw(g, c2), grads1):
        np.testing.assert_allclose(a, b_, rtol=1e-11, atol=1e-13)


def test_weights_are_the_dense_softmax():
    q, k, v, kw = make(COMBOS["window-alibi-br"], 7, 9)
    _, cache = sdpa(q, k, v, **kw)
    w = cache.weights
    assert np.all(w[..., ~visible(7, 9, False, "bottom_right", (3, 1))] == 0)
    np.testing.assert_allclose(w @ v, sdpa(q, k, v, **kw)[0], rtol=1e-12, atol=1e-14)


# -- rows that see no key: exact zeros ----------------------------------------------------------------------
DEAD = {  # options under which the first rows (or the last) of q see no key
    "bool": dict(attn_mask=np.arange(6)[:, None] >= 2),
    "float-inf": dict(attn_mask=np.where(np.arange(6)[:, None] < 2, -np.inf, 0.0) * np.ones((6, 4))),
    "causal-br": dict(is_causal=True, causal_align="bottom_right"),  # Lq > Lk: rows 0, 1 see nothing
    "window-past-end": dict(window=(0, 0)),  # top-left, Lq > Lk: rows 4, 5 see nothing
    "window-br-causal": dict(window=(1, 0), is_causal=True, causal_align="bottom_right"),
}
EXTRAS = {
    "none": {},
    "softcap": dict(softcap=1.0),
    "alibi": dict(alibi_slopes=np.array([0.5, 0.25])),
    "sinks": dict(sinks=np.array([0.3, -1.0])),
    "dropout": dict(dropout_p=0.3, rng=1),
}


@pytest.mark.parametrize("dead", list(DEAD))
@pytest.mark.parametrize("extra", list(EXTRAS))
def test_rows_that_see_no_key_are_exactly_zero(dead, extra, height):
    rng = np.random.default_rng(4)
    q, k, v = rng.standard_normal((2, 2, 6, 3)), rng.standard_normal((2, 2, 4, 3)), rng.standard_normal((2, 2, 4, 3))
    kw = {**DEAD[dead], **EXTRAS[extra]}
    out, cache = sdpa(q, k, v, **kw)
    vis = (
        np.ones((6, 4), bool)
        if "attn_mask" not in kw
        else (kw["attn_mask"] if kw["attn_mask"].dtype == bool else np.isfinite(kw["attn_mask"]))
    )
    vis = vis & visible(6, 4, kw.get("is_causal", False), kw.get("causal_align", "top_left"), kw.get("window"))
    dead_rows = ~vis.any(axis=-1)
    assert dead_rows.any()
    assert np.all(out[..., dead_rows, :] == 0) and not np.isnan(out).any()
    grads = sdpa_bw(rng.standard_normal(out.shape), cache)
    assert np.all(grads[0][..., dead_rows, :] == 0)
    assert all(np.isfinite(g).all() for g in grads)
    want = dense(q, k, v, keep=cache.keep, **{key: val for key, val in kw.items() if key != "rng"})
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-14)
    if extra == "sinks":  # a dead row puts all its weight on the sink and adds nothing to dsinks
        g = np.zeros(out.shape)
        g[..., dead_rows, :] = rng.standard_normal(g[..., dead_rows, :].shape)
        assert np.all(sdpa_bw(g, cache)[3] == 0)


# -- batch broadcasting ------------------------------------------------------------------------------------
BROADCAST = [  # q, k, v shapes, enable_gqa
    ((2, 3, 4), (5, 4), (5, 6), False),
    ((2, 3, 4), (2, 5, 4), (5, 4), False),
    ((2, 2, 3, 4), (2, 2, 5, 4), (2, 1, 5, 4), False),
    ((3, 4), (2, 5, 4), (2, 5, 6), False),
    ((4, 3, 4), (2, 4, 5, 4), (2, 4, 5, 6), False),
    ((1, 4, 3, 4), (2, 2, 5, 4), (2, 2, 5, 4), True),
    ((4, 3, 4), (2, 2, 5, 4), (2, 2, 5, 4), True),
    ((2, 4, 3, 4), (2, 5, 4), (2, 5, 4), True),
    ((2, 4, 3, 4), (2, 1, 5, 4), (2, 1, 5, 4), True),
]


def _explicit(qs, ks, vs, gqa):
    """Shapes broadcast by hand: the leading dims of q, k, v made equal (GQA: all but the heads)."""
    nd = max(len(qs), len(ks), len(vs))
    pad = [(1,) * (nd - len(s)) + s for s in (qs, ks, vs)]
    if gqa:
        batch = np.broadcast_shapes(*(p[:-3] for p in pad))
        hk = max(pad[1][-3], pad[2][-3])
        return batch + pad[0][-3:], batch + (hk,) + pad[1][-2:], batch + (hk,) + pad[2][-2:]
    lead = np.broadcast_shapes(*(p[:-2] for p in pad))
    return tuple(lead + p[-2:] for p in pad)


@pytest.mark.parametrize("qs,ks,vs,gqa", BROADCAST)
@pytest.mark.parametrize("opts", [{}, {"is_causal": True, "window": (1, 0), "softcap": 1.0}], ids=["plain", "opts"])
def test_batch_broadcasting(qs, ks, vs, gqa, opts):
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal(s) for s in (qs, ks, vs))
    out, cache = sdpa(q, k, v, enable_gqa=gqa, **opts)
    eq, ek, ev = _explicit(qs, ks, vs, gqa)
    Q, Kb, V = np.broadcast_to(q, eq).copy(), np.broadcast_to(k, ek).copy(), np.broadcast_to(v, ev).copy()
    want, wcache = sdpa(Q, Kb, V, enable_gqa=gqa, **opts)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-14)
    g = rng.standard_normal(out.shape)
    got, full = sdpa_bw(g, cache), sdpa_bw(g, wcache)
    for a, b_, x in zip(got, full, (q, k, v)):
        assert a.shape == x.shape
        red = b_.sum(axis=tuple(range(b_.ndim - x.ndim))) if b_.ndim > x.ndim else b_
        red = red.sum(axis=tuple(i for i, s in enumerate(x.shape) if s == 1 and red.shape[i] != 1), keepdims=True)
        np.testing.assert_allclose(a, red, rtol=1e-11, atol=1e-13)
    errs = fd_check(lambda *xs: sdpa(*xs, enable_gqa=gqa, **opts), sdpa_bw, [q, k, v], g)
    assert max(errs) < 1e-6, errs


# -- dtype, layout and kernels -----------------------------------------------------------------------------
def test_float32_stays_float32_with_every_option():
    q, k, v, kw = make(COMBOS["everything"], dtype=np.float32)
    out, cache = sdpa(q, k, v, **kw)
    assert out.dtype == np.float32
    grads = sdpa_bw(np.ones(out.shape, np.float32), cache)
    assert all(g.dtype == np.float32 for g in grads)
    q64, k64, v64, kw64 = make(COMBOS["everything"])
    np.testing.assert_allclose(out, sdpa(q64, k64, v64, **kw64)[0], rtol=2e-4, atol=2e-5)


def test_kernel_heads_last_layout_and_out_buffers():
    q, k, v, kw = make(COMBOS["window-causal"])
    out, cache = sdpa(q, k, v, **kw)
    kout, kcache = K.scaled_dot_product_attention(q, k, v, heads_last=True, **kw)
    assert out.flags.c_contiguous and not kout.flags.c_contiguous
    assert kout.swapaxes(-2, -3).flags.c_contiguous  # (..., L, H, Ev) in memory
    np.testing.assert_array_equal(out, kout)
    g = np.random.default_rng(0).standard_normal(out.shape)
    want = sdpa_bw(g, cache)
    bufs = tuple(np.full(a.shape, np.nan) for a in (q, k, v))
    got = K.scaled_dot_product_attention_backward(g, kcache, out=bufs)
    assert all(a is b_ for a, b_ in zip(got, bufs))
    for a, b_ in zip(got, want):
        np.testing.assert_allclose(a, b_, rtol=1e-13, atol=1e-15)


def test_inputs_are_not_modified():
    q, k, v, kw = make(COMBOS["everything"])
    copies = [a.copy() for a in (q, k, v, kw["attn_mask"], kw["sinks"], kw["alibi_slopes"])]
    out, cache = sdpa(q, k, v, **kw)
    g = np.random.default_rng(1).standard_normal(out.shape)
    g0 = g.copy()
    sdpa_bw(g, cache)
    for a, b_ in zip((q, k, v, kw["attn_mask"], kw["sinks"], kw["alibi_slopes"]), copies):
        np.testing.assert_array_equal(a, b_)
    np.testing.assert_array_equal(g, g0)


# -- windowed work grows with L * window -------------------------------------------------------------------
def test_windowed_blocks_grow_linearly_with_length():
    def formed(L):
        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal((1, 1, L, 4)) for _ in range(3))
        _, cache = sdpa(q, k, v, is_causal=True, window=(32, 0))
        return sum(e.shape[-1] * e.shape[-2] for e in cache.p)

    a, b_ = formed(1024), formed(2048)
    assert b_ <= 2.05 * a  # linear, not quadratic
    assert a <= 1024 * (32 + 1 + A._CAUSAL_BLOCK)


# -- properties over generated option combinations ---------------------------------------------------------
@st.composite
def option_cases(draw):
    lq, lk = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    gqa = draw(st.booleans())
    hk = draw(st.integers(1, 2))
    hq = hk * (draw(st.integers(1, 3)) if gqa else 1)
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, hq, lq, 3))
    k = rng.standard_normal((2, hk, lk, 3))
    v = rng.standard_normal((2, hk, lk, 2))
    kw = dict(
        enable_gqa=gqa, is_causal=draw(st.booleans()), causal_align=draw(st.sampled_from(["top_left", "bottom_right"]))
    )
    if draw(st.booleans()):
        kw["window"] = (draw(st.integers(-1, 4)), draw(st.integers(-1, 4)))
    if draw(st.booleans()):
        kw["alibi_slopes"] = rng.uniform(0, 1, (hq,))
    if draw(st.booleans()):
        kw["softcap"] = draw(st.floats(0.5, 5.0))
    if draw(st.booleans()):
        kw["sinks"] = rng.standard_normal(hq)
    mask = draw(st.sampled_from(["none", "bool", "float"]))
    if mask == "bool":
        kw["attn_mask"] = rng.random((hq, lq, lk)) > 0.3
    elif mask == "float":
        kw["attn_mask"] = rng.standard_normal((lq, lk))
        kw["mask_grad"] = draw(st.booleans())
    if draw(st.booleans()):
        kw["dropout_p"], kw["rng"] = 0.2, seed
    return q, k, v, kw, draw(st.integers(1, 4))


@settings(max_examples=60)
@given(option_cases())
def test_property_options_equal_dense_and_directional_derivative(case):
    q, k, v, kw, h = case
    old = A._CAUSAL_BLOCK
    A._CAUSAL_BLOCK = h
    try:
        out, cache = sdpa(q, k, v, **kw)
        dense_kw = {key: val for key, val in kw.items() if key not in ("mask_grad", "rng")}
        np.testing.assert_allclose(out, dense(q, k, v, keep=cache.keep, **dense_kw), rtol=1e-11, atol=1e-12)
        xs = grad_inputs(q, k, v, kw)
        fwd, bwd = pair(kw)
        rng = np.random.default_rng(1)
        g = rng.standard_normal(out.shape)
        grads = bwd(g, cache)
        assert len(grads) == len(xs)
        rout, rcache = R.scaled_dot_product_attention(q, k, v, **kw)  # the textbook tier
        np.testing.assert_allclose(out, rout, rtol=1e-11, atol=1e-12)
        for a, b_ in zip(grads, R.scaled_dot_product_attention_backward(g, rcache)):
            np.testing.assert_allclose(a, b_, rtol=1e-10, atol=1e-11)
        # <backward(g), u> against the central difference of <forward, g> along u
        us = [rng.standard_normal(np.shape(x)) for x in xs]
        eps = 1e-6
        up = np.sum(fwd(*[x + eps * u for x, u in zip(xs, us)])[0] * g)
        down = np.sum(fwd(*[x - eps * u for x, u in zip(xs, us)])[0] * g)
        num = (up - down) / (2 * eps)
        ana = sum(np.sum(a * u) for a, u in zip(grads, us))
        assert abs(ana - num) <= 1e-6 * max(1.0, abs(num)), (ana, num)
    finally:
        A._CAUSAL_BLOCK = old


@pytest.mark.parametrize("lq,lk", [(0, 4), (4, 0), (0, 0)])
def test_empty_sequences_with_every_option(lq, lk):
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((2, 2, lq, 3)), rng.standard_normal((2, 1, lk, 3)), rng.standard_normal((2, 1, lk, 2))
    kw = dict(
        sinks=np.ones(2),
        softcap=1.0,
        alibi_slopes=np.ones(2),
        attn_mask=np.zeros((lq, lk)),
        mask_grad=True,
        causal_align="bottom_right",
        window=(2, 2),
        is_causal=True,
        dropout_p=0.5,
        rng=0,
        enable_gqa=True,
    )
    out, cache = sdpa(q, k, v, **kw)
    assert out.shape == (2, 2, lq, 2) and np.all(out == 0)
    grads = sdpa_bw(np.ones(out.shape), cache)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape, (lq, lk), (2,)]
    assert all(np.all(g == 0) for g in grads)

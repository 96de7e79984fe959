"""The fast tier equals the textbook tier: every pair of ``npattn.functional`` against its twin in
``npattn.functional.reference``, to 1e-12 in float64, outputs and every gradient, over generated
shapes and options (hypothesis, the profiles of ``tests/conftest.py``).  Dropout draws from the same
seed in both tiers, so the same weights are dropped."""

import inspect

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import npattn.functional as F  # noqa: E402
from npattn.functional import reference as R  # noqa: E402
from npattn.testing.strategies import attention_configs  # noqa: E402

TOL = 1e-12


def _same(got, want, what=""):
    """``|got - want| <= 1e-12 * max(1, max |want|)``, equal shapes and dtypes, None with None."""
    if want is None or got is None:
        assert got is None and want is None, what
        return
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
    if want.size:
        scale = max(1.0, float(np.abs(want).max()))
        assert float(np.abs(got - want).max()) <= TOL * scale, (what, float(np.abs(got - want).max()))


def _pairs_equal(fast, slow, args, kwargs=None, dout_seed=0, fast_kwargs=None):
    """Run both pairs on the same arguments (fresh copies, so rngs given as ints replay) and
    compare the outputs and every gradient for one random upstream gradient."""
    kwargs = kwargs or {}
    out_f, cache_f = fast(*args, **kwargs, **(fast_kwargs or {}))
    out_r, cache_r = slow(*args, **kwargs)
    _same(out_f, out_r, "out")
    dout = np.random.default_rng(dout_seed).standard_normal(np.shape(out_r)).astype(np.asarray(out_r).dtype)
    g_f = getattr(F, fast.__name__ + "_backward")(dout, cache_f)
    g_r = getattr(R, slow.__name__ + "_backward")(dout, cache_r)
    g_f = g_f if isinstance(g_f, tuple) else (g_f,)
    g_r = g_r if isinstance(g_r, tuple) else (g_r,)
    assert len(g_f) == len(g_r)
    for i, (a, b) in enumerate(zip(g_f, g_r)):
        _same(a, b, f"gradient {i}")


def _lead_shapes(max_dims=2, max_side=3):
    return st.lists(st.integers(1, max_side), max_size=max_dims).map(tuple)


# -- attention ---------------------------------------------------------------------------------------

ATTENTION_OPTIONS = ("causal_align", "window", "alibi_slopes", "softcap", "sinks", "mask_grad")


@st.composite
def _attention_calls(draw, options=False, broadcast=False, dropout=True):
    """``(q, k, v, kwargs)``: masks, causal, GQA, scale, dropout (an int seed) and, with ``options``,
    every attention option; with ``broadcast``, k and v keep only some of q's batch axes."""
    cfg = draw(attention_configs(dropout=dropout))
    q, k, v = cfg.q, cfg.k, cfg.v
    kw = cfg.kwargs()
    nb = len(cfg.batch)
    if broadcast and nb:
        cut = draw(st.integers(0, nb))  # k, v lose their first `cut` batch axes or keep them as 1
        ones = draw(st.booleans())
        k, v = (a[(0,) * cut] for a in (k, v)) if not ones else (a[:1] for a in (k, v))
    if options:
        kw["causal_align"] = draw(st.sampled_from(["top_left", "bottom_right"]))
        kw["window"] = draw(st.one_of(st.none(), st.tuples(st.integers(-1, 3), st.integers(-1, 3))))
        kw["softcap"] = draw(st.one_of(st.none(), st.floats(0.5, 3.0)))
        if cfg.heads is not None:
            hq = cfg.heads[0]
            rng = np.random.default_rng(cfg.seed + 7)
            kw["alibi_slopes"] = draw(st.sampled_from([None, rng.uniform(0.0, 1.0, hq)]))
            kw["sinks"] = draw(st.sampled_from([None, rng.standard_normal(hq)]))
        m = kw["attn_mask"]
        kw["mask_grad"] = m is not None and m.dtype != bool and draw(st.booleans())
    return q, k, v, kw


def _mem_args(q, k, v, kw, block):
    kw = dict(kw)
    return (q, k, v, kw.pop("attn_mask"), kw.pop("is_causal"), kw.pop("scale"), block), kw


@given(_attention_calls())
def test_scaled_dot_product_attention(call):
    q, k, v, kw = call
    _pairs_equal(F.scaled_dot_product_attention, R.scaled_dot_product_attention, (q, k, v), kw)


@given(_attention_calls(broadcast=True, dropout=False))
def test_scaled_dot_product_attention_batch_broadcasting(call):
    q, k, v, kw = call
    _pairs_equal(F.scaled_dot_product_attention, R.scaled_dot_product_attention, (q, k, v), kw)


@given(_attention_calls(options=True, broadcast=True))
def test_scaled_dot_product_attention_options(call):
    q, k, v, kw = call
    _pairs_equal(F.scaled_dot_product_attention, R.scaled_dot_product_attention, (q, k, v), kw)


@given(_attention_calls(), st.sampled_from([None, 1, 2, 3, 64]))
def test_memory_efficient_attention(call, block):
    q, k, v, kw = call
    args, kw = _mem_args(q, k, v, kw, block)
    _pairs_equal(F.memory_efficient_attention, R.memory_efficient_attention, args, kw)


@given(_attention_calls(options=True, broadcast=True), st.sampled_from([None, 1, 2, 3, 64]))
def test_memory_efficient_attention_options(call, block):
    q, k, v, kw = call
    args, kw = _mem_args(q, k, v, kw, block)
    _pairs_equal(F.memory_efficient_attention, R.memory_efficient_attention, args, kw)


# -- the other pairs -----------------------------------------------------------------------------------


@st.composite
def _arrays(draw, min_dims=1, max_dims=3, max_side=4, scale=2.0):
    shape = tuple(draw(st.lists(st.integers(1, max_side), min_size=min_dims, max_size=max_dims)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return rng.standard_normal(shape) * scale


@given(_arrays(min_dims=1), st.integers(1, 4), st.booleans())
def test_linear(x, n_out, bias):
    rng = np.random.default_rng(x.size)
    w = rng.standard_normal((n_out, x.shape[-1]))
    _pairs_equal(F.linear, R.linear, (x, w, rng.standard_normal(n_out) if bias else None))


@given(_arrays(min_dims=0), st.data())
def test_softmax(x, data):
    axis = data.draw(st.integers(-max(x.ndim, 1), max(x.ndim, 1) - 1)) if x.ndim else -1
    if x.ndim and data.draw(st.booleans()):
        x = x.copy()
        x[(0,) * x.ndim] = -np.inf  # masked entries (a whole slice now and then)
    _pairs_equal(F.softmax, R.softmax, (x,), {"axis": axis})


@given(_arrays(), st.sampled_from(["relu", "gelu", "gelu_tanh", "silu"]))
def test_activations(x, op):
    name, kw = ("gelu", {"approximate": "tanh"}) if op == "gelu_tanh" else (op, {})
    _pairs_equal(getattr(F, name), getattr(R, name), (x,), kw)


@given(_arrays(scale=3.0), st.sampled_from([None, -1.0, -0.5, 0.0]), st.sampled_from([None, 0.0, 0.5, 2.0]))
def test_clamp(x, lo, hi):
    """clamp's fast tier is its textbook twin, with entries exactly at the bounds (whose gradient
    both take as 1, torch's convention) and one-sided bounds."""
    if lo is None and hi is None:
        hi = 1.0
    x = x.copy()
    x.reshape(-1)[:2] = [0.0 if lo is None else lo, 0.0 if hi is None else hi][: x.size]
    _pairs_equal(F.clamp, R.clamp, (x, lo, hi))


@given(
    _arrays(scale=3.0),
    st.floats(-3, 3),
    st.floats(-3, 3),
    st.floats(-1, 1),
    st.sampled_from([-1e-6, -0.5, 0.0, 0.3]),
    st.sampled_from([(), (1,)]),
)
def test_xielu(x, alpha_p, alpha_n, beta, eps, shape):
    """xIELU's fast tier is its textbook twin over drawn inputs, parameters (one number, of shape
    () or (1,)), beta and eps (between the negative entries: the expm1 branch held at eps)."""
    params = (np.full(shape, alpha_p, x.dtype), np.full(shape, alpha_n, x.dtype))
    _pairs_equal(F.xielu, R.xielu, (x, *params, beta, eps))


@given(_arrays(), st.sampled_from([0.0, 0.1, 0.5, 1.0]), st.integers(0, 1000), st.booleans())
def test_dropout(x, p, seed, training):
    _pairs_equal(F.dropout, R.dropout, (x, p, seed, training))


@st.composite
def _norm_calls(draw, rms=False):
    x = draw(_arrays(min_dims=1, max_dims=4, scale=3.0))
    n = draw(st.integers(1, x.ndim))
    nshape = x.shape[x.ndim - n :]
    rng = np.random.default_rng(x.size + n)
    kw = {"normalized_shape": nshape}
    weight = rng.standard_normal(nshape) if draw(st.booleans()) else None
    if rms:
        eps = draw(st.sampled_from([None, 1e-6, 0.1]))
        return (x, weight, eps), kw
    bias = rng.standard_normal(nshape) if draw(st.booleans()) else None
    return (x, weight, bias, draw(st.sampled_from([1e-5, 0.1]))), kw


@given(_norm_calls())
def test_layer_norm(call):
    args, kw = call
    _pairs_equal(F.layer_norm, R.layer_norm, args, kw)


@given(_norm_calls(rms=True))
def test_rms_norm(call):
    args, kw = call
    _pairs_equal(F.rms_norm, R.rms_norm, args, kw)


@given(
    _arrays(min_dims=2, max_dims=4),
    st.booleans(),
    st.sampled_from([None, "offset", "batch"]),
    st.sampled_from([10000.0, 50.0]),
)
def test_rope(x, interleaved, positions, base):
    x = np.concatenate([x, x], axis=-1)  # D even
    lead, lq = x.shape[:-2], x.shape[-2]
    rng = np.random.default_rng(x.size)
    pos = {None: None, "offset": np.arange(lq) + 5, "batch": rng.integers(0, 40, size=lead + (lq,))}[positions]
    _pairs_equal(F.rope, R.rope, (x, pos), {"base": base, "interleaved": interleaved})


@st.composite
def _embedding_calls(draw, options):
    num, dim = draw(st.integers(1, 6)), draw(st.integers(1, 4))
    rng = np.random.default_rng(draw(st.integers(0, 1000)))
    w = rng.standard_normal((num, dim))
    ids = rng.integers(0, num, size=tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=2))))
    kw = {}
    if options:
        kw["padding_idx"] = draw(st.one_of(st.none(), st.integers(-num, num - 1)))
        kw["max_norm"] = draw(st.one_of(st.none(), st.floats(0.3, 2.0)))
        kw["norm_type"] = draw(st.sampled_from([1.0, 2.0, 3.0, float("inf")]))
        kw["scale_grad_by_freq"] = draw(st.booleans())
    return (ids, w), kw


@given(_embedding_calls(options=False))
def test_embedding(call):
    args, kw = call
    _pairs_equal(F.embedding, R.embedding, args, kw)


@given(_embedding_calls(options=True))
def test_embedding_options(call):
    args, kw = call
    _pairs_equal(F.embedding, R.embedding, args, kw)


@st.composite
def _cross_entropy_calls(draw, options):
    lead = draw(_lead_shapes())
    c = draw(st.integers(1, 5))
    rng = np.random.default_rng(draw(st.integers(0, 1000)))
    logits = rng.standard_normal(lead + (c,)) * 2
    probs = options and draw(st.booleans())
    if probs:
        targets = rng.dirichlet(np.ones(c), size=lead) if lead else rng.dirichlet(np.ones(c))
    else:
        targets = rng.integers(0, c, size=lead)
    kw = {}
    if not probs:
        kw["ignore_index"] = draw(st.one_of(st.none(), st.integers(0, c - 1), st.just(-100)))
    if options:
        kw["weight"] = draw(st.sampled_from([None, rng.uniform(0.2, 2.0, c)]))
        kw["reduction"] = draw(st.sampled_from(["mean", "sum", "none"]))
        kw["label_smoothing"] = draw(st.sampled_from([0.0, 0.1, 0.5]))
    return (logits, targets), kw


@given(_cross_entropy_calls(options=False))
def test_cross_entropy(call):
    args, kw = call
    _pairs_equal(F.cross_entropy, R.cross_entropy, args, kw)


@given(_cross_entropy_calls(options=True))
def test_cross_entropy_options(call):
    args, kw = call
    _pairs_equal(F.cross_entropy, R.cross_entropy, args, kw)


def test_every_fast_pair_has_a_textbook_twin():
    """The same public pairs, with the same signatures (parameter names, kinds and defaults)."""
    fast = {
        n for n in F.__all__ if callable(getattr(F, n)) and (n.endswith("_backward") or hasattr(F, n + "_backward"))
    }
    assert fast <= set(R.__all__), sorted(fast - set(R.__all__))
    for name in R.__all__:
        if name.endswith("_backward"):
            continue
        ref = inspect.signature(getattr(R, name)).parameters
        for pname, p in inspect.signature(getattr(F, name)).parameters.items():
            assert pname in ref, (name, pname)
            assert (ref[pname].kind, ref[pname].default) == (p.kind, p.default), (name, pname)

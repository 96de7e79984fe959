"""Fuzzing invalid calls: hypothesis throws garbage at the public API (random shapes and dtypes,
bool/complex/object/str arrays, ragged lists, masks of random shapes and dtypes, probabilities
that are NaN/inf/negative, random head counts).  Only npattn's own ``ValueError``/``TypeError``
may escape, with a ``"<argument>: ..."`` message from an explicit ``raise`` in npattn: never
IndexError, AttributeError, ZeroDivisionError, numpy's AxisError (a ValueError *and* IndexError
subclass: the exact-type check rejects it), FloatingPointError, or a RuntimeWarning (warnings
are errors here).  A call that succeeds returns finite numbers and its backward succeeds too.
"""

import warnings

import numpy as np
from _hardening import assert_own_error
from hypothesis import event, given, settings
from hypothesis import strategies as st

import npattn
import npattn.functional as F

SEEDS = st.integers(0, 2**32 - 1)
ARRAY_DTYPES = ["float64", "float32", "float16", "int64", "int8", "uint8", "bool", "complex128", "object", "str"]
SHAPES = st.lists(st.integers(0, 4), min_size=0, max_size=4).map(tuple)


def _build(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    if dtype == "str":
        return np.full(shape, "a")
    if dtype == "object":
        a = np.empty(shape, object)
        a[...] = None if seed % 2 else 1.0
        return a
    if dtype == "bool":
        return rng.random(shape) < 0.5
    if dtype == "complex128":
        return rng.uniform(-1, 1, shape) + 1j
    if dtype.startswith(("int", "uint")):
        return rng.integers(0, 3, shape).astype(dtype)
    return rng.uniform(-3, 3, shape).astype(dtype)


def arrays(shape=SHAPES, dtypes=ARRAY_DTYPES):
    return st.builds(
        _build, shape if isinstance(shape, st.SearchStrategy) else st.just(shape), st.sampled_from(dtypes), SEEDS
    )


NON_ARRAYS = st.sampled_from([None, 1.5, 0, "abc", [], [[1.0], [1.0, 2.0]], {"a": 1}, (1, 2), object()])


def garbage(shape=SHAPES, dtypes=ARRAY_DTYPES):
    """Mostly arrays of random shape and dtype, sometimes not an array at all."""
    return st.one_of(arrays(shape, dtypes), arrays(shape, dtypes), arrays(shape, dtypes), NON_ARRAYS)


@st.composite
def mostly(draw, good, bad, one_in=5):
    """``good`` most of the time, ``bad`` one time in ``one_in``: invalid calls then fail at
    every check in turn, not only at the first argument."""
    return draw(bad) if draw(st.integers(0, one_in - 1)) == one_in - 1 else draw(good)  # 0, the simplest: good


@st.composite
def masks(draw, shape):
    """None, or a mask of a plausible (or random) shape and dtype; float masks may hold -inf
    (allowed), +inf or NaN (refused)."""
    kind = draw(st.sampled_from(["none", "bool", "bool", "float", "float", "garbage"]))
    if kind == "none":
        return None
    if kind == "garbage":
        return draw(garbage())
    s = draw(st.sampled_from([shape[-2:], shape, shape[-1:], None]))
    if s is None:
        s = draw(SHAPES)
    rng = np.random.default_rng(draw(SEEDS))
    if kind == "bool":
        return rng.random(s) < draw(st.sampled_from([0.0, 0.3, 0.7, 1.0]))
    m = rng.uniform(-2, 2, s).astype(draw(st.sampled_from(["float64", "float32"])))
    for v in draw(st.lists(st.sampled_from([-np.inf, -np.inf, np.inf, np.nan]), max_size=2)):
        if m.size:
            m.flat[rng.integers(m.size)] = v
    return m


PROBS = mostly(
    st.one_of(st.floats(0, 1), st.sampled_from([0.0, 1.0])),
    st.sampled_from([-0.1, 1.5, float("nan"), float("inf"), -float("inf"), True, "0.5", None, 1]),
)
FLAGS = mostly(st.booleans(), st.sampled_from([1, 0, None, "yes", np.bool_(True)]))
SIZES = mostly(st.integers(1, 4), st.sampled_from([0, -1, 2.0, 1.5, True, None, "4", np.int64(2)]))


def attempt(fn, *args, **kwargs):
    """Run ``fn``: success returns its result; ValueError/TypeError must be npattn's own; any
    other exception and any warning fail the test (they propagate)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            res = fn(*args, **kwargs)
        except (ValueError, TypeError) as e:
            assert_own_error(e)
            event(f"{type(e).__name__} {str(e).split(':')[0]}")
            return None
    event("success")
    return res


def finite_arrays(result):
    outs = result if isinstance(result, tuple) else (result,)
    for a in outs:
        if isinstance(a, np.ndarray) and a.dtype.kind == "f":
            assert np.all(np.isfinite(a))


def then_backward(res, backward):
    """A forward that succeeded: its output is finite and its backward runs cleanly too."""
    if res is None:
        return
    out, cache = res
    finite_arrays(out)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        finite_arrays(backward(np.ones(np.shape(out)), cache))


@st.composite
def attention_args(draw):
    """q, k, v that are mostly consistent (so that the later checks and the arithmetic are
    reached), with one axis perturbed or an argument replaced by garbage now and then."""
    b, hk, g, lq, lk, e, ev = (
        draw(st.integers(lo, hi)) for lo, hi in ((0, 2), (1, 2), (1, 2), (0, 4), (0, 4), (1, 3), (1, 3))
    )
    heads = draw(st.booleans())
    qs = (b, hk * g, lq, e) if heads else (b, lq, e)
    ks = (b, hk, lk, e) if heads else (b, lk, e)
    vs = (b, hk, lk, ev) if heads else (b, lk, ev)

    def one(shape):
        s = list(shape)
        if draw(st.integers(0, 5)) == 5:  # perturb one axis
            s[draw(st.integers(0, len(s) - 1))] = draw(st.integers(0, 4))
        return draw(mostly(arrays(tuple(s), ["float64", "float32", "float64", "int64"]), garbage(), one_in=8))

    return one(qs), one(ks), one(vs), qs


@settings(max_examples=200)
@given(attention_args(), st.data())
def test_fuzz_scaled_dot_product_attention(args, data):
    q, k, v, base = args
    kw = dict(
        attn_mask=data.draw(masks(base)),
        is_causal=data.draw(FLAGS),
        dropout_p=data.draw(PROBS),
        scale=data.draw(mostly(st.one_of(st.none(), st.floats(-4, 4)), st.sampled_from([float("nan"), "2", True]))),
        rng=data.draw(mostly(st.sampled_from([0, None, np.random.default_rng(0)]), st.sampled_from([-1, 1.5]))),
        enable_gqa=data.draw(FLAGS),
    )
    then_backward(attempt(F.scaled_dot_product_attention, q, k, v, **kw), F.scaled_dot_product_attention_backward)


@settings(max_examples=200)
@given(attention_args(), st.data())
def test_fuzz_memory_efficient_attention(args, data):
    q, k, v, base = args
    kw = dict(
        attn_mask=data.draw(masks(base)),
        is_causal=data.draw(FLAGS),
        scale=data.draw(mostly(st.one_of(st.none(), st.floats(-4, 4)), st.sampled_from([float("inf"), "2"]))),
        block_size=data.draw(st.one_of(st.none(), SIZES)),
    )
    then_backward(attempt(F.memory_efficient_attention, q, k, v, **kw), F.memory_efficient_attention_backward)


FLOATS = ["float64", "float32", "float64", "int64"]


@st.composite
def linear_args(draw):
    lead, n_in, n_out = (
        draw(st.lists(st.integers(0, 3), max_size=2).map(tuple)),
        draw(st.integers(0, 3)),
        draw(st.integers(1, 3)),
    )
    x = draw(mostly(arrays(lead + (n_in,), FLOATS), garbage()))
    w = draw(mostly(arrays(draw(mostly(st.just((n_out, n_in)), SHAPES)), FLOATS), garbage()))
    b = draw(st.one_of(st.none(), mostly(arrays(draw(mostly(st.just((n_out,)), SHAPES)), FLOATS), garbage())))
    return x, w, b


@given(linear_args())
def test_fuzz_linear(args):
    then_backward(attempt(F.linear, *args), F.linear_backward)


@st.composite
def layer_norm_args(draw):
    shape = draw(SHAPES)
    d = shape[-1:] if shape else (3,)
    x = draw(mostly(arrays(shape, FLOATS), garbage()))
    w = draw(st.one_of(st.none(), mostly(arrays(draw(mostly(st.just(d), SHAPES)), FLOATS), garbage())))
    b = draw(st.one_of(st.none(), mostly(arrays(draw(mostly(st.just(d), SHAPES)), FLOATS), garbage())))
    eps = draw(
        mostly(
            st.sampled_from([1e-5, 0.0, 1.0]), st.sampled_from([-1.0, float("nan"), float("inf"), "eps", None, True])
        )
    )
    if draw(st.booleans()) and isinstance(x, np.ndarray) and x.dtype.kind == "f" and x.ndim:
        x = np.broadcast_to(x[..., :1], x.shape).copy()  # constant rows: variance 0
    return x, w, b, eps


@given(layer_norm_args())
def test_fuzz_layer_norm(args):
    then_backward(attempt(F.layer_norm, *args), F.layer_norm_backward)


@given(
    mostly(arrays(SHAPES, FLOATS), garbage()),
    mostly(st.integers(-4, 3), st.sampled_from([5, -6, 1.0, None, True, "0", (0, 1)])),
)
def test_fuzz_softmax(x, axis):
    then_backward(attempt(F.softmax, x, axis=axis), F.softmax_backward)


@given(
    mostly(arrays(SHAPES, FLOATS), garbage()),
    PROBS,
    mostly(st.sampled_from([0, None, np.random.default_rng(1)]), st.sampled_from([-3, 2.5, "seed"])),
    FLAGS,
)
def test_fuzz_dropout(x, p, rng, training):
    then_backward(attempt(F.dropout, x, p, rng, training), F.dropout_backward)


@st.composite
def mha_args(draw):
    """``(d_in, d_out, num_heads, kwargs)``: mostly a valid configuration, now and then not."""
    heads, kv_div = draw(st.integers(1, 4)), draw(st.sampled_from([1, 2]))
    good = dict(d_in=draw(st.integers(1, 5)), d_out=heads * draw(st.integers(1, 2)), num_heads=heads)
    args = [draw(mostly(st.just(good[n]), SIZES, one_in=6)) for n in ("d_in", "d_out", "num_heads")]
    kw = {}
    for name, strat in [
        ("dropout", PROBS),
        ("qkv_bias", FLAGS),
        ("out_bias", FLAGS),
        ("causal", FLAGS),
        ("kdim", SIZES),
        ("vdim", SIZES),
        ("memory_efficient", FLAGS),
        ("num_kv_heads", mostly(st.just(heads // kv_div if heads % kv_div == 0 else heads), SIZES)),
        ("rng", mostly(st.sampled_from([0, None]), st.sampled_from([-1, 2.5, "x"]))),
        (
            "dtype",
            mostly(
                st.sampled_from([np.float32, np.float64, "float32", None]),
                st.sampled_from([np.float16, np.int32, "banana", complex]),
            ),
        ),
    ]:
        if draw(st.booleans()):
            kw[name] = draw(strat)
    if kw.get("memory_efficient") is True and draw(st.booleans()):
        kw["dropout"] = 0.0
    return (*args, kw)


@settings(max_examples=200)
@given(mha_args(), st.data())
def test_fuzz_multi_head_attention(args, data):
    *sizes, kw = args
    m = attempt(npattn.MultiHeadAttention, *sizes, **kw)
    if m is None:
        return
    b, lq, lk = data.draw(st.integers(0, 2)), data.draw(st.integers(0, 4)), data.draw(st.integers(0, 4))
    cross = data.draw(st.booleans())
    query = data.draw(mostly(arrays((b, lq, m.d_in), FLOATS), garbage()))
    key = value = None
    if cross:
        key = data.draw(mostly(arrays((b, lk, m.kdim), FLOATS), garbage()))
        value = data.draw(mostly(arrays((b, lk, m.vdim), FLOATS), st.one_of(garbage(), st.none())))
    lk_ = lk if cross else lq
    fkw = dict(
        attn_mask=data.draw(masks((b, m.num_heads, lq, lk_))),
        key_padding_mask=data.draw(
            st.one_of(st.none(), mostly(arrays((b, lk_), ["bool", "bool", "float64"]), garbage()))
        ),
        need_weights=data.draw(mostly(st.just(False), FLAGS)),
    )
    y = attempt(m, query, key, value, **fkw)
    if y is None:
        assert m._cache is None  # a failed forward leaves no half-built state behind
        return
    finite_arrays(y)
    out = y[0] if isinstance(y, tuple) else y
    assert out.dtype == m.dtype
    dy = data.draw(mostly(st.just(np.ones(out.shape)), garbage()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            g = m.backward(dy)
        except (ValueError, TypeError) as e:
            assert_own_error(e, name="dy: ")
            event(f"backward {type(e).__name__}")
            return
    event("backward success")
    finite_arrays(g)

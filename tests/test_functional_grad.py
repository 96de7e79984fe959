"""Every functional backward matches central finite differences (float64, random upstream gradient).

Each property checks twice: with ``npattn.gradcheck`` and with the independent ``tests/_fd.py``.
"""

import numpy as np
from _fd import fd_check
from hypothesis import given
from hypothesis import strategies as st

import npattn.functional as F
from npattn.testing import arrays, attention_configs, gradcheck, layer_norm_inputs, relu_safe_arrays, seeds, shapes

RTOL = 1e-5


def upstream(shape, seed):
    return np.random.default_rng(seed + 12345).standard_normal(shape)


def assert_fd(forward, backward, arrs, seed, **kwargs):
    out, _ = forward(*arrs, **kwargs)
    errs = fd_check(forward, backward, arrs, upstream(np.shape(out), seed), **kwargs)
    assert max(errs) <= RTOL, errs


def assert_gc(target, *inputs, expect=None, **kwargs):
    report = gradcheck(target, *inputs, **kwargs)
    assert report.ok, str(report)
    if expect is not None:
        assert [r.name for r in report.rows] == expect, str(report)
    return report


@given(shapes(0, 2, 1, 3), st.integers(1, 4), st.integers(1, 4), st.booleans(), seeds())
def test_linear(lead, n_in, n_out, with_bias, seed):
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, lead + (n_in,))
    w = rng.uniform(-1, 1, (n_out, n_in))
    b = rng.uniform(-1, 1, n_out) if with_bias else None
    arrs = [x, w] + ([b] if with_bias else [])
    assert_gc(F.linear, *arrs, expect=["x", "weight"] + (["bias"] if with_bias else []), seed=seed)
    assert_fd(F.linear, F.linear_backward, arrs, seed)


@given(shapes(1, 2, 1, 4), st.integers(1, 4), st.integers(1, 3), seeds())
def test_embedding(ids_shape, num, dim, seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, num, ids_shape)  # small vocabulary: repeated ids accumulate
    w = rng.uniform(-1, 1, (num, dim))
    assert_gc(F.embedding, ids, w, expect=["weight"], seed=seed)
    assert_fd(lambda w_: F.embedding(ids, w_), F.embedding_backward, [w], seed)


@st.composite
def array_and_axis(draw):
    x = draw(arrays(shapes(1, 3, 2, 4), scale=3.0))
    return x, draw(st.integers(-x.ndim, x.ndim - 1))


@given(array_and_axis(), seeds())
def test_softmax(xa, seed):
    x, axis = xa
    assert_gc(F.softmax, x, axis=axis, seed=seed)
    assert_fd(F.softmax, F.softmax_backward, [x], seed, axis=axis)


@given(relu_safe_arrays(shapes(1, 3, 1, 4), scale=2.0), seeds())
def test_relu(x, seed):
    assert_gc(F.relu, x, seed=seed)
    assert_fd(F.relu, F.relu_backward, [x], seed)


@given(arrays(shapes(1, 3, 1, 4), scale=4.0), st.sampled_from(["none", "tanh"]), seeds())
def test_gelu(x, approximate, seed):
    assert_gc(F.gelu, x, approximate=approximate, seed=seed)
    assert_fd(F.gelu, F.gelu_backward, [x], seed, approximate=approximate)


@given(layer_norm_inputs(), seeds())
def test_layer_norm(case, seed):
    expect = ["x"] + (["weight"] if case.weight is not None else []) + (["bias"] if case.bias is not None else [])
    assert_gc(F.layer_norm, *case.args(), expect=expect, seed=seed)
    w, b = case.weight, case.bias
    arrs = [a for a in (case.x, w, b) if a is not None]

    def fwd(*xs):
        it = iter(xs)
        x_ = next(it)
        w_ = next(it) if w is not None else None
        b_ = next(it) if b is not None else None
        return F.layer_norm(x_, w_, b_, case.eps)

    assert_fd(fwd, F.layer_norm_backward, arrs, seed)


@given(arrays(shapes(1, 3, 1, 4)), st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0]), seeds(), st.booleans())
def test_dropout(x, p, seed, training):
    # a Generator is snapshotted by gradcheck; an int seed gives the same mask at every call
    report = assert_gc(F.dropout, x, p, seed=seed, rng=np.random.default_rng(seed), training=training)
    assert_fd(F.dropout, F.dropout_backward, [x], seed, p=p, rng=seed, training=training)
    # the mask is known: keep = rng.random(shape) >= p, scaled by 1/(1-p)
    g = np.random.default_rng(seed).standard_normal(x.shape)
    if not training or p == 0.0:
        expected = g
    elif p == 1.0:
        expected = np.zeros_like(g)
    else:
        expected = g * (np.random.default_rng(seed).random(x.shape) >= p) / (1.0 - p)
    np.testing.assert_allclose(report.analytic["x"], expected, rtol=1e-15, atol=0)


@given(attention_configs(dropout=True), seeds())
def test_scaled_dot_product_attention(cfg, seed):
    kw = cfg.kwargs(rng=np.random.default_rng(cfg.seed))
    assert_gc(F.scaled_dot_product_attention, cfg.q, cfg.k, cfg.v, expect=["q", "k", "v"], seed=seed, **kw)
    assert_fd(
        F.scaled_dot_product_attention,
        F.scaled_dot_product_attention_backward,
        [cfg.q, cfg.k, cfg.v],
        seed,
        **cfg.kwargs(),
    )


@given(shapes(0, 2, 1, 3), st.integers(2, 5), st.sampled_from([None, -100, 0, 2]), st.floats(0.0, 1.0), seeds())
def test_cross_entropy(lead, classes, ignore_index, frac_ignored, seed):
    rng = np.random.default_rng(seed)
    logits = rng.uniform(-3, 3, lead + (classes,))
    targets = rng.integers(0, classes, lead)
    if ignore_index is not None:
        targets = np.where(rng.random(lead) < frac_ignored, ignore_index, targets)
    assert_gc(F.cross_entropy, logits, targets, ignore_index=ignore_index, expect=["logits"], seed=seed)
    assert_fd(lambda z: F.cross_entropy(z, targets, ignore_index), F.cross_entropy_backward, [logits], seed)

"""The new options of the non-attention functional ops: finite differences (``npattn.gradcheck``
and the independent ``tests/_fd.py``), hypothesis properties, float32, the unvalidated kernels,
each backward's own cache type, and bad input for every new argument (clear error, nothing modified)."""

import numpy as np
import pytest
from _fd import fd_check
from hypothesis import given, settings
from hypothesis import strategies as st

import npattn.functional as F
from npattn.functional import kernels
from npattn.testing import gradcheck, seeds

RTOL = 1e-5


def upstream(shape, seed):
    return np.random.default_rng(seed + 12345).standard_normal(shape)


def assert_fd(forward, backward, arrs, seed, **kwargs):
    out, _ = forward(*arrs, **kwargs)
    errs = fd_check(forward, backward, arrs, upstream(np.shape(out), seed), **kwargs)
    assert max(errs) <= RTOL, errs


def as_tuple(g):
    return g if isinstance(g, tuple) else (g,)


def assert_gc(target, *inputs, **kwargs):
    report = gradcheck(target, *inputs, **kwargs)
    assert report.ok, str(report)
    return report


@st.composite
def trailing(draw, min_last=3):
    """``(x shape, normalized_shape)``: 0-2 leading axes, 1-2 normalised trailing axes."""
    lead = tuple(draw(st.lists(st.integers(1, 2), min_size=0, max_size=2)))
    ns = tuple(draw(st.lists(st.integers(1, 2), min_size=0, max_size=1))) + (draw(st.integers(min_last, 4)),)
    return lead + ns, ns  # small: the central difference of sum(out * g) stays far above round-off


# ------------------------------------------------------------------------------ finite differences


@settings(max_examples=60)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=3), st.sampled_from([1.0, 5.0]), seeds())
def test_silu_fd(shape, scale, seed):
    x = np.random.default_rng(seed).standard_normal(shape) * scale
    assert_gc(F.silu, x, seed=seed)
    assert_fd(F.silu, F.silu_backward, [x], seed)


@settings(max_examples=60)
@given(trailing(), st.booleans(), st.sampled_from([None, 1e-5, 0.3]), seeds())
def test_rms_norm_fd(case, with_weight, eps, seed):
    shape, ns = case
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    arrs = [x] + ([rng.standard_normal(ns)] if with_weight else [])
    fwd = lambda *a: F.rms_norm(a[0], a[1] if len(a) > 1 else None, eps, normalized_shape=ns)  # noqa: E731
    report = assert_gc((fwd, F.rms_norm_backward), *arrs, seed=seed)
    assert len(report.rows) == len(arrs)
    assert_fd(fwd, F.rms_norm_backward, arrs, seed)


@settings(max_examples=60)
@given(trailing(), st.booleans(), st.booleans(), seeds())
def test_layer_norm_several_axes_fd(case, with_weight, with_bias, seed):
    shape, ns = case
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    w = rng.standard_normal(ns) if with_weight else None
    b = rng.standard_normal(ns) if with_bias else None
    arrs = [a for a in (x, w, b) if a is not None]

    def fwd(*a):
        it = iter(a[1:])
        return F.layer_norm(
            a[0], next(it) if with_weight else None, next(it) if with_bias else None, normalized_shape=ns
        )

    report = assert_gc((fwd, F.layer_norm_backward), *arrs, seed=seed)
    assert len(report.rows) == len(arrs)
    assert_fd(fwd, F.layer_norm_backward, arrs, seed)


@st.composite
def ce_cases(draw):
    c = draw(st.integers(1, 4))
    lead = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
    rng = np.random.default_rng(draw(seeds()))
    probs = draw(st.booleans())
    if probs:
        targets = rng.dirichlet(np.ones(c), lead) if c > 1 else np.ones(lead + (1,))
    else:
        targets = rng.integers(0, c, lead)
        if targets.size and draw(st.booleans()):
            targets.reshape(-1)[0] = -1  # ignored
    weight = rng.uniform(0.2, 2.0, c) if draw(st.booleans()) else None
    kw = dict(
        weight=weight,
        reduction=draw(st.sampled_from(["mean", "sum", "none"])),
        label_smoothing=draw(st.sampled_from([0.0, 0.25, 1.0])),
    )
    return rng.standard_normal(lead + (c,)) * 2, targets, None if probs else -1, kw, rng


@settings(max_examples=80)
@given(ce_cases())
def test_cross_entropy_options_fd(case):
    logits, targets, ignore_index, kw, rng = case

    def fwd(z):
        return F.cross_entropy(z, targets, ignore_index, **kw)

    assert_gc((fwd, F.cross_entropy_backward), logits)
    out, _ = fwd(logits)
    (err,) = fd_check(fwd, F.cross_entropy_backward, [logits], rng.standard_normal(np.shape(out)))
    assert err <= RTOL


def test_softmax_0d_gradcheck():
    assert_gc(F.softmax, np.array(0.3))
    (err,) = fd_check(F.softmax, F.softmax_backward, [np.array(0.3)], np.array(1.7))
    assert err == 0.0


# ------------------------------------------------------------------------------------------- embedding


@st.composite
def emb_cases(draw):
    num, dim = draw(st.integers(1, 6)), draw(st.integers(1, 4))
    rng = np.random.default_rng(draw(seeds()))
    ids = rng.integers(0, num, tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=2))))
    return rng.standard_normal((num, dim)) * 2, ids, draw(st.integers(-num, num - 1)), rng


def test_embedding_plain_fd():
    rng = np.random.default_rng(3)
    w, ids = rng.standard_normal((5, 3)), np.array([[0, 2, 2], [4, 0, 1]])
    fwd = lambda weight: F.embedding(ids, weight)  # noqa: E731
    assert_gc((fwd, F.embedding_backward), w)
    assert_fd(fwd, F.embedding_backward, [w], 0)


@given(emb_cases())
def test_embedding_gradient_rules(case):
    """padding row: 0; scale_grad_by_freq: the plain gradient / count; max_norm: not differentiated."""
    w, ids, padding_idx, rng = case
    dy = rng.standard_normal(ids.shape + (w.shape[1],))
    plain = F.embedding_backward(dy, F.embedding(ids, w)[1])
    counts = np.bincount(ids.reshape(-1), minlength=w.shape[0])
    pad = padding_idx % w.shape[0]
    got = F.embedding_backward(dy, F.embedding(ids, w, padding_idx=padding_idx)[1])
    np.testing.assert_array_equal(got[pad], 0)
    np.testing.assert_array_equal(np.delete(got, pad, 0), np.delete(plain, pad, 0))
    got = F.embedding_backward(dy, F.embedding(ids, w, scale_grad_by_freq=True)[1])
    np.testing.assert_allclose(got * np.maximum(counts, 1)[:, None], plain, rtol=1e-12, atol=1e-14)
    got = F.embedding_backward(dy, F.embedding(ids, w, max_norm=0.5)[1])
    np.testing.assert_array_equal(got, plain)


@given(emb_cases(), st.sampled_from([0.1, 1.0, 3.0]), st.sampled_from([1.0, 2.0, 3.0, float("inf")]))
def test_embedding_max_norm_output(case, max_norm, norm_type):
    w, ids, _, _ = case
    before = w.copy()
    out, _ = F.embedding(ids, w, max_norm=max_norm, norm_type=norm_type)
    np.testing.assert_array_equal(w, before)  # the given weight is never modified
    plain = w[ids]
    norms = np.linalg.norm(plain, ord=norm_type, axis=-1)
    small = norms <= max_norm
    np.testing.assert_array_equal(out[small], plain[small])  # rows within the bound: untouched
    big = ~small
    expected = max_norm * norms[big] / (norms[big] + 1e-7)  # torch's scale max_norm / (norm + 1e-7)
    np.testing.assert_allclose(np.linalg.norm(out[big], ord=norm_type, axis=-1), expected, rtol=1e-12)
    np.testing.assert_allclose(
        out[big] / np.linalg.norm(out[big], ord=norm_type, axis=-1)[:, None],
        plain[big] / norms[big][:, None],
        rtol=1e-12,
        atol=1e-15,
    )  # same direction


# ------------------------------------------------------------------------------------------ properties


@given(trailing(min_last=2), st.floats(0.01, 100.0), seeds())
def test_rms_norm_properties(case, c, seed):
    shape, ns = case
    x = np.random.default_rng(seed).standard_normal(shape)
    y, _ = F.rms_norm(x, None, 0.0, normalized_shape=ns)
    axes = tuple(range(x.ndim - len(ns), x.ndim))
    np.testing.assert_allclose(np.mean(y * y, axis=axes), 1.0, rtol=1e-12)  # unit rms
    np.testing.assert_allclose(F.rms_norm(c * x, None, 0.0, normalized_shape=ns)[0], y, rtol=1e-12, atol=1e-14)
    z, _ = F.rms_norm(np.zeros(shape), None, 0.0, normalized_shape=ns)  # 0/0 -> 0, not NaN
    np.testing.assert_array_equal(z, 0.0)


@given(trailing(min_last=2), st.booleans(), seeds())
def test_several_axes_equal_one_flattened_axis(case, rms, seed):
    """Normalising (a, b) trailing axes is normalising one axis of a*b values."""
    shape, ns = case
    rng = np.random.default_rng(seed)
    x, w, b = rng.standard_normal(shape), rng.standard_normal(ns), rng.standard_normal(ns)
    flat = shape[: len(shape) - len(ns)] + (int(np.prod(ns)),)
    dy = rng.standard_normal(shape)
    if rms:
        y, c = F.rms_norm(x, w, normalized_shape=ns)
        yf, cf = F.rms_norm(x.reshape(flat), w.reshape(-1))
        grads, gradsf = F.rms_norm_backward(dy, c), F.rms_norm_backward(dy.reshape(flat), cf)
    else:
        y, c = F.layer_norm(x, w, b, normalized_shape=ns)
        yf, cf = F.layer_norm(x.reshape(flat), w.reshape(-1), b.reshape(-1))
        grads, gradsf = F.layer_norm_backward(dy, c), F.layer_norm_backward(dy.reshape(flat), cf)
    np.testing.assert_allclose(y.reshape(flat), yf, rtol=1e-12, atol=1e-13)
    for g, gf in zip(grads, gradsf):
        np.testing.assert_allclose(g.reshape(gf.shape), gf, rtol=1e-12, atol=1e-13)


@given(st.lists(st.floats(-30, 30), min_size=1, max_size=8))
def test_silu_properties(values):
    x = np.array(values)
    y, _ = F.silu(x)
    np.testing.assert_allclose(y, x / (1.0 + np.exp(-x)), rtol=1e-13, atol=1e-300)
    np.testing.assert_allclose(y - F.silu(-x)[0], x, rtol=1e-12, atol=1e-13)  # silu(x) - silu(-x) = x


def test_silu_extremes_are_finite_without_warnings():
    x = np.array([-1e308, -800.0, -50.0, 0.0, 50.0, 800.0, 1e308])
    with np.errstate(over="raise", invalid="raise", divide="raise"):  # exp(-1e308) may underflow to 0
        y, cache = F.silu(x)
        dx = F.silu_backward(np.ones_like(x), cache)
    assert np.isfinite(y).all() and np.isfinite(dx).all()
    np.testing.assert_array_equal(y[[3, 5, 6]], x[[3, 5, 6]] * [0.5, 1, 1])


@given(ce_cases())
def test_cross_entropy_reductions_agree(case):
    logits, targets, ignore_index, kw, _ = case
    kw = dict(kw, reduction="none")
    none, _ = F.cross_entropy(logits, targets, ignore_index, **kw)
    assert none.shape == logits.shape[:-1] and not np.signbit(none[none == 0]).any()
    total, _ = F.cross_entropy(logits, targets, ignore_index, **dict(kw, reduction="sum"))
    mean, _ = F.cross_entropy(logits, targets, ignore_index, **dict(kw, reduction="mean"))
    np.testing.assert_allclose(total, none.sum(), rtol=1e-12, atol=1e-12)
    if targets.dtype.kind == "f":
        denom = none.size
    else:
        counted = targets != ignore_index
        w = kw["weight"] if kw["weight"] is not None else np.ones(logits.shape[-1])
        denom = w[np.where(counted, targets, 0)][counted].sum()
    np.testing.assert_allclose(mean, none.sum() / denom if denom else 0.0, rtol=1e-12, atol=1e-12)


@given(ce_cases())
def test_cross_entropy_class_ids_equal_one_hot_probabilities(case):
    """Class ids with label smoothing = probabilities (1 - eps) onehot + eps/C (per element and summed)."""
    logits, targets, ignore_index, kw, _ = case
    if targets.dtype.kind == "f":
        return
    keep = targets != ignore_index  # an ignored element has no probability-target counterpart
    logits, targets = logits[keep], targets[keep]
    onehot = np.eye(logits.shape[-1])[targets]
    for reduction in ("none", "sum"):
        kw2 = dict(kw, reduction=reduction)
        ids_loss, ids_cache = F.cross_entropy(logits, targets, ignore_index, **kw2)
        prob_loss, prob_cache = F.cross_entropy(logits, onehot, **kw2)
        if reduction == "none":
            np.testing.assert_allclose(ids_loss, prob_loss, rtol=1e-12, atol=1e-12)
        else:
            dl = np.float64(0.7)
            np.testing.assert_allclose(ids_loss, prob_loss, rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(
                F.cross_entropy_backward(dl, ids_cache),
                F.cross_entropy_backward(dl, prob_cache),
                rtol=1e-12,
                atol=1e-12,
            )


def test_cross_entropy_mean_over_nothing_is_positive_zero():
    logits = np.random.default_rng(0).standard_normal((2, 3))
    for targets, kw in (
        (np.array([-1, -1]), {}),
        (np.array([-1, -1]), {"label_smoothing": 0.5}),
        (np.array([0, 1]), {"weight": np.array([0.0, 0.0, 1.0])}),
        (np.zeros((0,), int), {}),
        (np.zeros((0, 3)), {}),
    ):
        loss, cache = F.cross_entropy(logits[: len(targets)], targets, -1 if targets.dtype.kind == "i" else None, **kw)
        assert loss.shape == () and loss == 0.0 and not np.signbit(loss), (targets, kw)
        dx = F.cross_entropy_backward(np.float64(1.0), cache)
        np.testing.assert_array_equal(dx, 0.0)
        assert not np.isnan(dx).any()


# -------------------------------------------------------------------------- dtype, kernels, inputs kept


def test_float32_stays_float32():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    w = rng.standard_normal((3, 4)).astype(np.float32)
    for out, cache, bw in (
        (*F.silu(x), F.silu_backward),
        (*F.rms_norm(x, w), F.rms_norm_backward),
        (*F.layer_norm(x, w, w), F.layer_norm_backward),
    ):
        assert out.dtype == np.float32
        for g in as_tuple(bw(np.ones_like(out), cache)):
            assert g.dtype == np.float32
    emb = rng.standard_normal((5, 4)).astype(np.float32) * 3
    out, cache = F.embedding(np.array([[0, 1, 4]]), emb, padding_idx=1, max_norm=1.0, scale_grad_by_freq=True)
    assert out.dtype == np.float32 and F.embedding_backward(np.ones_like(out), cache).dtype == np.float32
    logits = x.reshape(6, 4)
    for targets in (np.array([0, 1, 2, 3, 0, 1]), np.full((6, 4), 0.25, np.float32)):
        for red in ("mean", "none"):
            loss, cache = F.cross_entropy(logits, targets, weight=np.arange(1, 5), reduction=red, label_smoothing=0.1)
            assert loss.dtype == np.float32
            assert F.cross_entropy_backward(np.ones_like(loss), cache).dtype == np.float32


RNG = object()  # stands for a fresh Generator(seed 0) in each call


def test_kernels_equal_the_public_ops():
    rng = np.random.default_rng(5)
    x, w, b = rng.standard_normal((2, 3, 4)), rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    ids, emb = np.array([[0, 3, 3]]), rng.standard_normal((4, 4)) * 2
    logits, t = rng.standard_normal((5, 4)), np.array([0, 3, -1, 2, 2])
    cases = [
        ("silu", (x,), {}),
        ("relu", (x,), {}),
        ("gelu", (x, "tanh"), {}),
        ("softmax", (x, 1), {}),
        ("softmax", (np.array(2.0),), {}),
        ("dropout", (x, 0.3, RNG), {}),
        ("linear", (x, w), {}),
        ("layer_norm", (x, w, b, 1e-5), {"normalized_shape": (3, 4)}),
        ("rms_norm", (x, w, None), {"normalized_shape": (3, 4)}),
        ("embedding", (ids, emb, 1, 1.0, 2.0, True), {}),
        ("cross_entropy", (logits, t, -1), {"weight": np.arange(1.0, 5.0), "label_smoothing": 0.2}),
    ]
    for name, args, kw in cases:
        fresh = lambda: [np.random.default_rng(0) if a is RNG else a for a in args]  # noqa: E731
        pub_out, pub_cache = getattr(F, name)(*fresh(), **kw)
        ker_out, ker_cache = getattr(kernels, name)(*fresh(), **kw)
        np.testing.assert_array_equal(ker_out, pub_out, err_msg=name)
        dy = rng.standard_normal(np.shape(pub_out))
        pub_g = getattr(F, name + "_backward")(dy, pub_cache)
        ker_g = getattr(kernels, name + "_backward")(dy, ker_cache)
        for a, k in zip(as_tuple(pub_g), as_tuple(ker_g)):
            if a is None:
                assert k is None
            else:
                np.testing.assert_array_equal(k, a, err_msg=name)


# ---------------------------------------------------------------------------------- wrong cache type


def _caches():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 4))
    return {
        "linear_backward": (F.linear_backward, F.linear(x, rng.standard_normal((2, 4)))),
        "embedding_backward": (F.embedding_backward, F.embedding(np.array([0, 1]), rng.standard_normal((3, 4)))),
        "softmax_backward": (F.softmax_backward, F.softmax(x)),
        "relu_backward": (F.relu_backward, F.relu(x)),
        "gelu_backward": (F.gelu_backward, F.gelu(x)),
        "silu_backward": (F.silu_backward, F.silu(x)),
        "dropout_backward": (F.dropout_backward, F.dropout(x, 0.5, 0)),
        "layer_norm_backward": (F.layer_norm_backward, F.layer_norm(x)),
        "rms_norm_backward": (F.rms_norm_backward, F.rms_norm(x)),
        "rope_backward": (F.rope_backward, F.rope(x)),
        "cross_entropy_backward": (F.cross_entropy_backward, F.cross_entropy(x, np.zeros((2, 3), int))),
    }


@pytest.mark.parametrize("name", sorted(_caches()))
def test_backward_refuses_another_ops_cache(name):
    caches = _caches()
    backward, (out, cache) = caches[name]
    expected = type(cache).__name__
    sdpa_cache = F.scaled_dot_product_attention(*np.random.default_rng(1).standard_normal((3, 2, 3, 4)))[1]
    others = [sdpa_cache, tuple(cache)] + [c for n, (_, (_, c)) in caches.items() if n != name]
    for wrong in others:
        with pytest.raises(TypeError, match="^cache: ") as info:
            backward(np.ones(np.shape(out)), wrong)
        msg = str(info.value)
        assert name in msg and expected in msg and type(wrong).__name__ in msg, msg
    backward(np.ones(np.shape(out)), cache)  # its own cache works


# --------------------------------------------------------------------------------------- bad input


def raises(exc, name, fn, *parts):
    with pytest.raises(exc, match=f"^{name}:") as info:
        fn()
    for p in parts:
        assert p in str(info.value), (p, str(info.value))


R = np.random.default_rng(7)
X, W3 = R.standard_normal((2, 3, 4)), R.standard_normal((3, 4))


@pytest.mark.parametrize("op", [F.layer_norm, F.rms_norm])
def test_norm_bad_normalized_shape_and_weight(op):
    raises(ValueError, "normalized_shape", lambda: op(X, normalized_shape=(3,)), "(2, 3, 4)", "(3,)")
    raises(ValueError, "normalized_shape", lambda: op(X, normalized_shape=(1, 2, 3, 4)), "(1, 2, 3, 4)")
    raises(ValueError, "normalized_shape", lambda: op(X, normalized_shape=()), "()")
    raises(ValueError, "normalized_shape", lambda: op(X, normalized_shape=5), "(5,)")
    for bad in (4.0, "4", (4.0,), True, (True,), None.__class__):
        raises(TypeError, "normalized_shape", lambda: op(X, normalized_shape=bad))
    raises(ValueError, "weight", lambda: op(X, W3, normalized_shape=4), "(4,)", "(3, 4)")
    raises(ValueError, "weight", lambda: op(X, R.standard_normal((2, 4))), "(2, 4)", "(2, 3, 4)")
    raises(ValueError, "weight", lambda: op(X, R.standard_normal((1, 2, 3, 4))), "(1, 2, 3, 4)")
    raises(ValueError, "weight", lambda: op(X, np.float64(1.0)), "()")
    raises(TypeError, "weight", lambda: op(X, np.ones(4, dtype=bool)))
    raises(ValueError, "x", lambda: op(np.zeros((2, 0))), "(2, 0)")
    raises(ValueError, "x", lambda: op(np.float64(1.0)), "()")


def test_layer_norm_bad_bias_with_several_axes():
    raises(ValueError, "bias", lambda: F.layer_norm(X, W3, np.zeros(4)), "(3, 4)", "(4,)")
    raises(ValueError, "bias", lambda: F.layer_norm(X, None, np.zeros(4), normalized_shape=(3, 4)), "(3, 4)", "(4,)")


def test_rms_norm_bad_eps():
    for bad in (-1.0, float("nan"), float("inf")):
        raises(ValueError, "eps", lambda: F.rms_norm(X, None, bad), str(bad))
    for bad in ("small", True, [1e-5]):
        raises(TypeError, "eps", lambda: F.rms_norm(X, None, bad))
    _, cache = F.rms_norm(X)
    raises(ValueError, "dout", lambda: F.rms_norm_backward(np.zeros((2, 3)), cache), "(2, 3, 4)", "(2, 3)")


def test_softmax_0d_axis():
    for axis in (0, -1):
        assert F.softmax(np.float64(2.0), axis=axis)[0] == 1.0
    raises(ValueError, "axis", lambda: F.softmax(np.float64(2.0), axis=1), "0-d", "got 1")
    raises(TypeError, "axis", lambda: F.softmax(np.float64(2.0), axis=None))
    raises(TypeError, "axis", lambda: F.softmax(np.float64(2.0), axis=True))


def test_silu_bad_input():
    raises(TypeError, "x", lambda: F.silu(np.ones(3, dtype=bool)), "bool")
    raises(TypeError, "x", lambda: F.silu(np.ones(3, dtype=complex)))
    _, cache = F.silu(np.ones((2, 3)))
    raises(ValueError, "dout", lambda: F.silu_backward(np.ones(3), cache), "(2, 3)", "(3,)")


def test_embedding_bad_options_leave_weight_untouched():
    w = R.standard_normal((4, 3))
    ids = np.array([[0, 3, 1]])
    before = w.copy()
    raises(ValueError, "padding_idx", lambda: F.embedding(ids, w, padding_idx=4), "[-4, 4)", "got 4")
    raises(ValueError, "padding_idx", lambda: F.embedding(ids, w, padding_idx=-5), "[-4, 4)", "got -5")
    for bad in (1.0, True, "0", np.array([1])):
        raises(TypeError, "padding_idx", lambda: F.embedding(ids, w, padding_idx=bad))
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        raises(ValueError, "max_norm", lambda: F.embedding(ids, w, max_norm=bad))
    for bad in ("1", True, [1.0]):
        raises(TypeError, "max_norm", lambda: F.embedding(ids, w, max_norm=bad))
    for bad in (0.0, -2.0, float("nan")):
        raises(ValueError, "norm_type", lambda: F.embedding(ids, w, max_norm=1.0, norm_type=bad))
    for bad in ("fro", None, True):
        raises(TypeError, "norm_type", lambda: F.embedding(ids, w, max_norm=1.0, norm_type=bad))
    for bad in (1, "yes", None):
        raises(TypeError, "scale_grad_by_freq", lambda: F.embedding(ids, w, scale_grad_by_freq=bad))
    np.testing.assert_array_equal(w, before)
    F.embedding(ids, w, padding_idx=-1, max_norm=0.1, norm_type=float("inf"), scale_grad_by_freq=True)
    np.testing.assert_array_equal(w, before)


def test_cross_entropy_bad_options():
    logits, t = R.standard_normal((2, 3)), np.array([0, 2])
    before = logits.copy()
    raises(ValueError, "weight", lambda: F.cross_entropy(logits, t, weight=np.ones(2)), "(3,)", "(2,)")
    raises(ValueError, "weight", lambda: F.cross_entropy(logits, t, weight=np.ones((1, 3))), "(3,)", "(1, 3)")
    raises(ValueError, "weight", lambda: F.cross_entropy(logits, t, weight=np.array([1.0, np.nan, 1.0])), "NaN")
    raises(TypeError, "weight", lambda: F.cross_entropy(logits, t, weight=np.ones(3, dtype=bool)))
    raises(ValueError, "reduction", lambda: F.cross_entropy(logits, t, reduction="avg"), "'avg'")
    for bad in (None, 1, ("mean",)):
        raises(TypeError, "reduction", lambda: F.cross_entropy(logits, t, reduction=bad))
    for bad in (-0.1, 1.5, float("nan")):
        raises(ValueError, "label_smoothing", lambda: F.cross_entropy(logits, t, label_smoothing=bad))
    for bad in ("0.1", None, True):
        raises(TypeError, "label_smoothing", lambda: F.cross_entropy(logits, t, label_smoothing=bad))
    # probability targets
    raises(ValueError, "targets", lambda: F.cross_entropy(logits, np.full((2, 4), 0.25)), "(2, 3)", "(2, 4)")
    raises(TypeError, "targets", lambda: F.cross_entropy(logits, np.array([0.0, 2.0])), "(2,)", "(2, 3)")
    raises(ValueError, "targets", lambda: F.cross_entropy(logits, np.array([[0.5, np.nan, 0.5]] * 2)), "NaN")
    raises(TypeError, "targets", lambda: F.cross_entropy(logits, np.ones(2, dtype=bool)), "bool")
    raises(TypeError, "targets", lambda: F.cross_entropy(logits, np.full((2, 3), 0.5, np.float16)), "float32")
    raises(ValueError, "ignore_index", lambda: F.cross_entropy(logits, np.full((2, 3), 1 / 3), 0), "probability")
    F.cross_entropy(logits, np.full((2, 3), 1 / 3), -100)  # a negative ignore_index has no effect, as torch
    _, cache = F.cross_entropy(logits, t, reduction="none")
    raises(ValueError, "dout", lambda: F.cross_entropy_backward(np.float64(1.0), cache), "(2,)", "()")
    _, cache = F.cross_entropy(logits, t, reduction="sum")
    raises(ValueError, "dout", lambda: F.cross_entropy_backward(np.ones(2), cache), "()", "(2,)")
    np.testing.assert_array_equal(logits, before)

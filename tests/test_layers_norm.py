"""LayerNorm over several trailing axes and RMSNorm: torch parity (float64), finite differences,
properties, bad input; the modules call the unvalidated kernels (validation once, at the edge)."""

import copy

import numpy as np
import pytest
from _fd import fd_gradients
from _oracles import rel_err
from hypothesis import given, settings
from hypothesis import strategies as st

import npattn
from npattn import LayerNorm, RMSNorm

seeds = st.integers(0, 2**31 - 1)


def assert_same(a, b, what=""):
    b = b.detach().numpy() if hasattr(b, "detach") else np.asarray(b)
    a = np.asarray(a, dtype=np.float64)
    assert a.shape == b.shape, (what, a.shape, b.shape)
    err = float(np.abs(a - b).max(initial=0.0) / max(np.abs(b).max(initial=0.0), 1e-3))
    assert err <= 1e-10, f"{what}: relative error {err:.3e}"


shapes = st.lists(st.integers(1, 3), min_size=1, max_size=3).map(tuple)
leads = st.sampled_from([(), (2,), (2, 1)])


def _random_affine(m, rng):
    for p in m.parameters():
        p.data = rng.uniform(0.5, 1.5, p.shape) if p is getattr(m, "weight") else rng.uniform(-1, 1, p.shape)


# ------------------------------------------------------------------- torch parity


@settings(max_examples=40, deadline=None)
@given(
    ns=shapes,
    lead=leads,
    affine=st.booleans(),
    bias=st.booleans(),
    eps=st.sampled_from([1e-5, 0.1]),
    as_int=st.booleans(),
    seed=seeds,
)
def test_layernorm_matches_torch(ns, lead, affine, bias, eps, as_int, seed):
    torch = pytest.importorskip("torch")
    if np.prod(ns) == 1:
        ns = ns[:-1] + (2,)
    rng = np.random.default_rng(seed)
    arg = ns[0] if (as_int and len(ns) == 1) else ns
    m = LayerNorm(arg, eps=eps, elementwise_affine=affine, bias=bias)
    _random_affine(m, rng)
    tm = torch.nn.LayerNorm(list(ns), eps=eps, elementwise_affine=affine, bias=bias, dtype=torch.float64)
    with torch.no_grad():
        for n, p in m.named_parameters():
            getattr(tm, n).copy_(torch.tensor(p.data))
    x = rng.standard_normal(lead + ns)
    dy = rng.standard_normal(x.shape)
    tx = torch.tensor(x, requires_grad=True)
    ty = tm(tx)
    ty.backward(torch.tensor(dy))
    assert_same(m(x), ty, "output")
    assert_same(m.backward(dy), tx.grad, "dx")
    for n, p in m.named_parameters():
        assert_same(p.grad, getattr(tm, n).grad, n)


@settings(max_examples=40, deadline=None)
@given(ns=shapes, lead=leads, affine=st.booleans(), eps=st.sampled_from([None, 1e-6, 0.1]), seed=seeds)
def test_rmsnorm_matches_torch(ns, lead, affine, eps, seed):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(seed)
    m = RMSNorm(ns, eps=eps, elementwise_affine=affine)
    if affine:
        m.weight.data = rng.uniform(0.5, 1.5, ns)
    tm = torch.nn.RMSNorm(list(ns), eps=eps, elementwise_affine=affine, dtype=torch.float64)
    if affine:
        with torch.no_grad():
            tm.weight.copy_(torch.tensor(m.weight.data))
    x = rng.standard_normal(lead + ns)
    dy = rng.standard_normal(x.shape)
    tx = torch.tensor(x, requires_grad=True)
    ty = tm(tx)
    ty.backward(torch.tensor(dy))
    assert_same(m(x), ty, "output")
    assert_same(m.backward(dy), tx.grad, "dx")
    if affine:
        assert_same(m.weight.grad, tm.weight.grad, "weight")
    else:
        assert list(m.parameters()) == []


def test_rmsnorm_eps_none_is_the_dtype_epsilon():
    x = np.full((1, 3), 1e-5)  # mean(x^2) = 1e-10: eps matters
    for dt in (np.float64, np.float32):
        m = RMSNorm(3, dtype=dt)
        expected = x / np.sqrt(1e-10 + np.finfo(dt).eps)
        np.testing.assert_allclose(m(x.astype(dt)), expected, rtol=1e-5 if dt == np.float32 else 1e-12)
        assert m(x).dtype == dt


# ------------------------------------------------------------------- finite differences


@pytest.mark.parametrize(
    "cls,kw", [(LayerNorm, {}), (LayerNorm, {"bias": False}), (RMSNorm, {}), (RMSNorm, {"eps": 1e-3})]
)
def test_gradcheck_over_two_axes(cls, kw):
    rng = np.random.default_rng(0)
    m = cls((3, 2), **kw)
    _random_affine(m, rng)
    x = rng.standard_normal((2, 3, 2))
    report = npattn.gradcheck(m, x)
    assert report.ok, str(report)
    dy = rng.standard_normal(x.shape)
    (num,) = fd_gradients(lambda xx: np.sum(copy.deepcopy(m)(xx) * dy), [x])
    m(x)
    assert rel_err(m.backward(dy), num) < 1e-6


def test_unbatched_input():
    rng = np.random.default_rng(1)
    for m in (LayerNorm(4), RMSNorm(4), LayerNorm((3, 4)), RMSNorm((3, 4))):
        x = rng.standard_normal((3, 4))
        np.testing.assert_allclose(m(x), m(x[None])[0], rtol=0, atol=1e-15)


# ------------------------------------------------------------------- properties


@settings(max_examples=50, deadline=None)
@given(ns=st.lists(st.integers(2, 3), min_size=1, max_size=3).map(tuple), seed=seeds)
def test_property_multi_axis_equals_flattened(ns, seed):
    """Normalising over k trailing axes is normalising over their flattening (values and gradients)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2,) + ns)
    dy = rng.standard_normal(x.shape)
    d = int(np.prod(ns))
    for cls in (LayerNorm, RMSNorm):
        m, flat = cls(ns), cls(d)
        w = rng.uniform(0.5, 1.5, ns)
        m.weight.data, flat.weight.data = w, w.reshape(d)
        np.testing.assert_allclose(m(x), flat(x.reshape(2, d)).reshape(x.shape), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(
            m.backward(dy), flat.backward(dy.reshape(2, d)).reshape(x.shape), rtol=1e-10, atol=1e-12
        )
        np.testing.assert_allclose(m.weight.grad, flat.weight.grad.reshape(ns), rtol=1e-10, atol=1e-12)


@settings(max_examples=50, deadline=None)
@given(ns=st.lists(st.integers(2, 4), min_size=1, max_size=2).map(tuple), seed=seeds, scale=st.floats(0.5, 20.0))
def test_property_statistics(ns, seed, scale):
    """eps=0: LayerNorm gives mean 0 and variance 1 over the axes; RMSNorm mean square 1;
    both invariant to a positive scale of the input."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((3,) + ns) + rng.uniform(-2, 2, (3,) + (1,) * len(ns))
    axes = tuple(range(1, 1 + len(ns)))
    y = LayerNorm(ns, eps=0.0)(x)
    np.testing.assert_allclose(y.mean(axis=axes), 0.0, atol=1e-12)
    np.testing.assert_allclose(y.var(axis=axes), 1.0, rtol=1e-10)
    np.testing.assert_allclose(LayerNorm(ns, eps=0.0)(scale * x), y, rtol=1e-9, atol=1e-11)
    r = RMSNorm(ns, eps=0.0)(x)
    np.testing.assert_allclose((r * r).mean(axis=axes), 1.0, rtol=1e-10)
    np.testing.assert_allclose(RMSNorm(ns, eps=0.0)(scale * x), r, rtol=1e-9, atol=1e-11)


# ------------------------------------------------------------------- bad input


@pytest.mark.parametrize("cls", [LayerNorm, RMSNorm])
@pytest.mark.parametrize(
    "arg,exc",
    [
        ((), ValueError),
        ((2, 0), ValueError),
        (0, ValueError),
        (2.5, TypeError),
        ((2, "a"), TypeError),
        ((2, True), TypeError),
    ],
)
def test_bad_normalized_shape(cls, arg, exc):
    with pytest.raises(exc, match="normalized_shape"):
        cls(arg)


@pytest.mark.parametrize("cls", [LayerNorm, RMSNorm])
def test_bad_options(cls):
    with pytest.raises(ValueError, match="eps"):
        cls(3, eps=-1.0)
    with pytest.raises(TypeError, match="eps"):
        cls(3, eps="small")
    with pytest.raises(TypeError, match="elementwise_affine"):
        cls(3, elementwise_affine=1)
    with pytest.raises(TypeError, match="dtype"):
        cls(3, dtype=np.float16)


@pytest.mark.parametrize("cls", [LayerNorm, RMSNorm])
@pytest.mark.parametrize(
    "bad,exc",
    [
        (np.ones((2, 4, 3)), ValueError),
        (np.ones(3), ValueError),
        (np.ones((3, 4), bool), TypeError),
        (np.ones((3, 4), np.float16), TypeError),
    ],
)
def test_bad_input_names_x_and_keeps_state(cls, bad, exc):
    m = cls((3, 4))
    x = np.random.default_rng(0).standard_normal((2, 3, 4))
    y = m(x)
    ref = copy.deepcopy(m)
    with pytest.raises(exc, match="x"):
        m(bad)
    dy = np.random.default_rng(1).standard_normal(y.shape)
    np.testing.assert_array_equal(m.backward(dy), (ref.backward(dy)))


def test_float32_stays_float32():
    for m in (LayerNorm((2, 3), dtype=np.float32), RMSNorm((2, 3), dtype=np.float32)):
        y = m(np.ones((4, 2, 3)) + np.arange(6).reshape(2, 3))
        assert y.dtype == np.float32
        assert m.backward(np.ones(y.shape)).dtype == np.float32
        assert m.weight.grad.dtype == np.float32


def test_modules_call_the_unvalidated_kernels(monkeypatch):
    """The checked public ops are not called by the modules: validation runs once."""
    import importlib

    act, emb, lin, norm = (
        importlib.import_module(f"npattn.functional.{n}") for n in ("activation", "embedding", "linear", "norm")
    )  # the files, not the ops

    def refuse(*a, **k):
        raise AssertionError("a module called a checked functional op")

    for mod, names in (
        (norm, ("layer_norm", "layer_norm_backward", "rms_norm", "rms_norm_backward")),
        (
            act,
            ("relu", "relu_backward", "gelu", "gelu_backward", "silu", "silu_backward", "dropout", "dropout_backward"),
        ),
        (lin, ("linear", "linear_backward")),
        (emb, ("embedding", "embedding_backward")),
    ):
        for n in names:
            monkeypatch.setattr(mod, n, refuse)
            monkeypatch.setattr(npattn.functional, n, refuse)  # the re-exported names too
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 4))
    for m in (
        LayerNorm(4),
        RMSNorm((3, 4)),
        npattn.FeedForward(4, 5, activation="swiglu", dropout=0.5, rng=0),
        npattn.FeedForward(4, 5, activation="gelu", rng=0),
        npattn.Dropout(0.3, rng=0),
    ):
        y = m(x)
        m.backward(rng.standard_normal(y.shape))
    for m, ids in (
        (npattn.Embedding(5, 4, padding_idx=0, max_norm=1.0, scale_grad_by_freq=True, rng=0), [[1, 0, 1]]),
        (npattn.Linear(4, 2, rng=0), x),
    ):
        y = m(ids)
        m.backward(rng.standard_normal(y.shape))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("affine", [True, False])
def test_rms_norm_without_grad_is_the_kept_path_bit_for_bit(affine, dtype):
    """Under no_grad RMSNorm keeps no xhat and forms y in place (issue 32, item 5): the same
    roundings, ``(x rstd) weight``, as the forward that keeps its cache."""
    rng = np.random.default_rng(4)
    m = RMSNorm(16, elementwise_affine=affine, dtype=dtype)
    if affine:
        m.weight.data[...] = rng.standard_normal(16)
    x = rng.standard_normal((3, 5, 16)).astype(dtype)
    kept = m(x)
    m.clear_saved()
    with npattn.no_grad():
        free = m(x)
    assert free.dtype == dtype and np.array_equal(free, kept)
    from npattn.functional import kernels as K

    xs = x.swapaxes(0, 1)  # a strided input too
    w = m.weight.data if affine else None
    assert np.array_equal(K.rms_norm(xs, w, 1e-6, keep=False)[0], K.rms_norm(xs, w, 1e-6)[0])
    assert K.rms_norm(xs, w, 1e-6, keep=False)[1] is None


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from([np.float32, np.float64]),
    st.sampled_from([(1, 1, 8), (1, 1, 1024), (1, 37), (2, 4), (1, 1, 2, 3)]),
    st.integers(-30, 30),
    st.sampled_from([0.0, 1e-6, 1e-5, None]),
    st.booleans(),
    st.integers(0, 2**16),
)
def test_rms_norm_of_one_slice_without_state_is_the_array_path_bit_for_bit(dtype, shape, power, eps, zeros, seed):
    """A single slice kept nowhere (a decoding step's hidden state) takes its rstd as a scalar
    (``_one_rstd``); its output equals the kept forward's, which runs the array path, bit for
    bit: values around 2^power for powers from -30 to 30 (the mean square near float32's ends), a
    slice of zeros with and without eps, the last axis or the last two (``normalized_shape``).
    Forty slices an example: a rounding taken differently (the reciprocal in double, say) shows in
    about a quarter of them."""
    rng = np.random.default_rng(seed)
    ns = shape[-2:] if len(shape) == 4 else None
    w = rng.standard_normal(shape[-2:] if ns else shape[-1:]).astype(dtype)
    from npattn.functional import kernels as K

    for _ in range(40):
        x = (rng.standard_normal(shape) * 2.0**power).astype(dtype)
        if zeros:
            x[...] = 0.0
        free = K.rms_norm(x, w, eps, normalized_shape=ns, keep=False)[0]
        kept = K.rms_norm(x, w, eps, normalized_shape=ns)[0]
        assert free.dtype == dtype and np.array_equal(free, kept, equal_nan=True)

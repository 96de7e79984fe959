"""Embedding options (padding_idx, max_norm + norm_type, scale_grad_by_freq): torch parity
(output, the module's own rows renormalised in place, weight gradient), finite differences,
properties, bad input."""

import numpy as np
import pytest
from _fd import fd_gradients
from _oracles import rel_err
from hypothesis import given, settings
from hypothesis import strategies as st

import npattn
from npattn import Embedding

seeds = st.integers(0, 2**31 - 1)


def assert_same(a, b, what=""):
    b = b.detach().numpy() if hasattr(b, "detach") else np.asarray(b)
    a = np.asarray(a, dtype=np.float64)
    assert a.shape == b.shape, (what, a.shape, b.shape)
    err = float(np.abs(a - b).max(initial=0.0) / max(np.abs(b).max(initial=0.0), 1e-3))
    assert err <= 1e-10, f"{what}: relative error {err:.3e}"


@settings(max_examples=50, deadline=None)
@given(
    num=st.integers(2, 6),
    dim=st.integers(1, 4),
    ids_shape=st.sampled_from([(), (4,), (2, 3)]),
    padding_idx=st.sampled_from([None, 0, 1, -1]),
    max_norm=st.sampled_from([None, 0.5, 1.5]),
    norm_type=st.sampled_from([1.0, 2.0, 3.0, float("inf")]),
    freq=st.booleans(),
    seed=seeds,
)
def test_matches_torch(num, dim, ids_shape, padding_idx, max_norm, norm_type, freq, seed):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(seed)
    m = Embedding(num, dim, padding_idx, max_norm, norm_type, freq, rng=seed)
    m.weight.data = rng.standard_normal((num, dim)) * 1.5  # the padding row too: torch reads it as it is
    tm = torch.nn.Embedding(
        num,
        dim,
        padding_idx=padding_idx,
        max_norm=max_norm,
        norm_type=norm_type,
        scale_grad_by_freq=freq,
        dtype=torch.float64,
    )
    with torch.no_grad():
        tm.weight.copy_(torch.tensor(m.weight.data))
    ids = rng.integers(0, num, ids_shape)
    dy = rng.standard_normal(ids_shape + (dim,))
    ty = tm(torch.tensor(ids))
    ty.backward(torch.tensor(dy))
    y = m(ids)
    assert_same(y, ty, "output")
    assert_same(m.weight.data, tm.weight, "weight after the forward (renormalised rows)")
    assert m.backward(dy) is None
    assert_same(m.weight.grad, tm.weight.grad, "weight.grad")


def test_padding_idx_row_is_zero_at_start_and_gets_no_gradient():
    m = Embedding(5, 3, padding_idx=-2, rng=0)
    assert m.padding_idx == 3
    np.testing.assert_array_equal(m.weight.data[3], 0.0)
    assert np.abs(m.weight.data[[0, 1, 2, 4]]).min() > 0
    # the other rows are torch's draw order: the same as without padding_idx
    np.testing.assert_array_equal(np.delete(m.weight.data, 3, 0), np.delete(Embedding(5, 3, rng=0).weight.data, 3, 0))
    ids = np.array([[3, 1, 3], [0, 3, 4]])
    m(ids)
    m.backward(np.random.default_rng(1).standard_normal((2, 3, 3)))
    np.testing.assert_array_equal(m.weight.grad[3], 0.0)
    assert np.abs(m.weight.grad[[0, 1, 4]]).min() > 0


def test_max_norm_renormalises_the_module_rows_in_place():
    m = Embedding(4, 2, max_norm=1.0, rng=0)
    m.weight.data = np.array([[3.0, 4.0], [0.3, 0.4], [6.0, 8.0], [1.0, 0.0]])
    before = m.weight._version
    y = m(np.array([0, 1, 0]))
    w = m.weight.data
    np.testing.assert_allclose(w[0], np.array([3.0, 4.0]) / (5.0 + 1e-7), rtol=1e-15)
    np.testing.assert_array_equal(w[1], [0.3, 0.4])  # within max_norm: untouched
    np.testing.assert_array_equal(w[2], [6.0, 8.0])  # not looked up: untouched
    np.testing.assert_array_equal(y, w[[0, 1, 0]])
    assert m.weight._version == before + 1  # written in place: a state kept elsewhere is stale
    dy = np.random.default_rng(0).standard_normal(y.shape)
    m.backward(dy)  # its own state was taken after the renorm: backward works
    np.testing.assert_allclose(m.weight.grad[0], dy[0] + dy[2], rtol=1e-15)
    m.zero_grad()
    y = m(np.array([1, 3]))  # nothing to renormalise: no version bump
    assert m.weight._version == before + 1


def test_scale_grad_by_freq_and_gradcheck():
    rng = np.random.default_rng(0)
    ids = np.array([[1, 2, 1], [1, 0, 4]])
    for kw in ({}, {"scale_grad_by_freq": True}, {"padding_idx": 1}, {"padding_idx": 0, "scale_grad_by_freq": True}):
        m = Embedding(5, 3, rng=1, **kw)
        if not kw:  # with the options the gradient is torch's, on purpose not the lookup's derivative
            report = npattn.gradcheck(m, ids)
            assert report.ok, str(report)
        dy = rng.standard_normal((2, 3, 3))
        (num,) = fd_gradients(lambda w: np.sum(w[ids] * dy), [m.weight.data])  # the lookup's derivative
        if kw.get("scale_grad_by_freq"):  # not the derivative of the lookup: torch's scaled gradient
            counts = np.bincount(ids.ravel(), minlength=5)[:, None]
            num = num / np.maximum(counts, 1)
        if "padding_idx" in kw:
            num[kw["padding_idx"]] = 0.0
        m.zero_grad()
        m(ids)
        m.backward(dy)
        assert rel_err(m.weight.grad, num) < 1e-6, kw


@settings(max_examples=50, deadline=None)
@given(seed=seeds, max_norm=st.floats(0.1, 3.0), norm_type=st.sampled_from([1.0, 2.0, float("inf")]))
def test_property_max_norm_bounds_every_looked_up_row(seed, max_norm, norm_type):
    rng = np.random.default_rng(seed)
    m = Embedding(6, 3, max_norm=max_norm, norm_type=norm_type, rng=seed)
    ids = rng.integers(0, 6, (2, 4))
    untouched = np.setdiff1d(np.arange(6), ids)
    w0 = m.weight.data.copy()
    y = m(ids)
    assert (np.linalg.norm(y, ord=norm_type, axis=-1) <= max_norm * (1 + 1e-12)).all()
    np.testing.assert_array_equal(m.weight.data[untouched], w0[untouched])
    np.testing.assert_array_equal(m(ids), y)  # idempotent: a second lookup changes nothing


@settings(max_examples=50, deadline=None)
@given(seed=seeds)
def test_property_scale_grad_by_freq_divides_by_counts(seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 5, (3, 4))
    dy = rng.standard_normal((3, 4, 2))
    plain, scaled = Embedding(5, 2, rng=seed), Embedding(5, 2, scale_grad_by_freq=True, rng=seed)
    plain(ids), scaled(ids)
    plain.backward(dy), scaled.backward(dy)
    counts = np.maximum(np.bincount(ids.ravel(), minlength=5), 1)[:, None]
    np.testing.assert_allclose(scaled.weight.grad * counts, plain.weight.grad, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize(
    "kw,exc,name",
    [
        (dict(padding_idx=5), ValueError, "padding_idx"),
        (dict(padding_idx=-6), ValueError, "padding_idx"),
        (dict(padding_idx=1.0), TypeError, "padding_idx"),
        (dict(padding_idx=True), TypeError, "padding_idx"),
        (dict(max_norm=0.0), ValueError, "max_norm"),
        (dict(max_norm=-1.0), ValueError, "max_norm"),
        (dict(max_norm=float("nan")), ValueError, "max_norm"),
        (dict(max_norm="1"), TypeError, "max_norm"),
        (dict(norm_type=0.0), ValueError, "norm_type"),
        (dict(norm_type=float("nan")), ValueError, "norm_type"),
        (dict(norm_type="2"), TypeError, "norm_type"),
        (dict(scale_grad_by_freq=1), TypeError, "scale_grad_by_freq"),
    ],
)
def test_bad_options(kw, exc, name):
    with pytest.raises(exc, match=name):
        Embedding(5, 2, **kw)


@pytest.mark.parametrize(
    "bad,exc",
    [
        (np.array([0, 5]), ValueError),
        (np.array([-1, 0]), ValueError),
        (np.array([0.0, 1.0]), TypeError),
        (np.array([True]), TypeError),
    ],
)
def test_bad_ids_change_nothing(bad, exc):
    m = Embedding(5, 2, max_norm=0.5, rng=0)
    y = m(np.array([1, 2]))
    w = m.weight.data.copy()
    v = m.weight._version
    with pytest.raises(exc, match="ids"):
        m(bad)
    np.testing.assert_array_equal(m.weight.data, w)  # no row renormalised by a refused call
    assert m.weight._version == v
    m.backward(np.ones_like(y))  # the first forward's state is still there


def test_float32_and_unbatched():
    m = Embedding(5, 3, padding_idx=0, max_norm=1.0, rng=0, dtype=np.float32)
    y = m(np.array([0, 3, 3]))
    assert y.dtype == np.float32 and y.shape == (3, 3)
    m.backward(np.ones((3, 3)))
    assert m.weight.grad.dtype == np.float32
    assert m(np.array(2)).shape == (3,)

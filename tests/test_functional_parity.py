"""Parity with PyTorch (the oracle, CPU, float64, <= 1e-10) for the options torch users pass:
``silu``, ``rms_norm``, ``layer_norm`` over several axes, ``embedding``'s ``padding_idx`` /
``max_norm`` / ``norm_type`` / ``scale_grad_by_freq``, ``cross_entropy``'s ``weight`` /
``reduction`` / ``label_smoothing`` / probability targets, ``softmax`` of a 0-d input.
Outputs and every gradient (inputs and weights) are compared."""

import numpy as np
import pytest
from _oracles import rel_err
from hypothesis import given
from hypothesis import strategies as st

import npattn.functional as F
from npattn.testing import seeds

torch = pytest.importorskip("torch")
TF = torch.nn.functional

TOL = 1e-10
# tensor-wise: max|ours - torch| / max|torch| (floor 1e-12), the same non-finite entries
REL = dict(floor=1e-12, relative_to="max_b", match_nonfinite=True)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def T(a, grad=True):
    t = torch.from_numpy(np.array(a, copy=True))
    return t.requires_grad_(grad) if t.dtype.is_floating_point else t


def upstream(shape, seed):
    return np.random.default_rng(seed + 99).standard_normal(shape)


def backward_torch(out, dout):
    out.backward(torch.from_numpy(np.array(dout, copy=True)))


# ------------------------------------------------------------------------------------------ silu


@given(st.lists(st.integers(1, 4), min_size=1, max_size=3), seeds(), st.sampled_from([1.0, 10.0, 800.0]))
def test_silu(shape, seed, scale):
    x = np.random.default_rng(seed).standard_normal(shape) * scale  # 800: exp(-x) would overflow
    y, cache = F.silu(x)
    dy = upstream(y.shape, seed)
    dx = F.silu_backward(dy, cache)
    tx = T(x)
    ty = TF.silu(tx)
    backward_torch(ty, dy)
    assert rel_err(y, ty, **REL) <= TOL and rel_err(dx, tx.grad, **REL) <= TOL


# -------------------------------------------------------------------------------- norms, several axes


@st.composite
def norm_cases(draw):
    """x of 1..4 dims, normalised over its trailing k axes (1 <= k <= ndim), with/without weight."""
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=0, max_size=3))) + (draw(st.integers(3, 5)),)
    k = draw(st.integers(1, len(shape)))  # >= 3 values per slice (2 make xhat = +-1: dx cancels to ~eps)
    return shape, shape[len(shape) - k :], draw(st.booleans()), draw(st.booleans()), draw(seeds())


@given(norm_cases(), st.sampled_from([1e-5, 0.1]))
def test_layer_norm_trailing_axes(case, eps):
    shape, ns, with_weight, with_bias, seed = case
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    w = rng.standard_normal(ns) if with_weight else None
    b = rng.standard_normal(ns) if with_bias else None
    y, cache = F.layer_norm(x, w, b, eps, normalized_shape=ns)
    dy = upstream(y.shape, seed)
    dx, dw, db = F.layer_norm_backward(dy, cache)
    tx, tw, tb = T(x), None if w is None else T(w), None if b is None else T(b)
    ty = TF.layer_norm(tx, ns, tw, tb, eps)
    backward_torch(ty, dy)
    assert rel_err(y, ty, **REL) <= TOL and rel_err(dx, tx.grad, **REL) <= TOL
    assert (dw is None) == (w is None) and (db is None) == (b is None)
    if w is not None:
        assert rel_err(dw, tw.grad, **REL) <= TOL
        # the default normalised axes are weight.shape: the same result without normalized_shape
        y2, _ = F.layer_norm(x, w, b, eps)
        np.testing.assert_array_equal(y2, y)
    if b is not None:
        assert rel_err(db, tb.grad, **REL) <= TOL


@given(norm_cases(), st.sampled_from([None, 1e-6, 0.5]))
def test_rms_norm(case, eps):
    shape, ns, with_weight, _, seed = case
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    w = rng.standard_normal(ns) if with_weight else None
    y, cache = F.rms_norm(x, w, eps, normalized_shape=ns)
    dy = upstream(y.shape, seed)
    dx, dw = F.rms_norm_backward(dy, cache)
    tx, tw = T(x), None if w is None else T(w)
    ty = TF.rms_norm(tx, ns, tw, eps)
    backward_torch(ty, dy)
    assert rel_err(y, ty, **REL) <= TOL and rel_err(dx, tx.grad, **REL) <= TOL
    assert (dw is None) == (w is None)
    if w is not None:
        assert rel_err(dw, tw.grad, **REL) <= TOL


def test_rms_norm_default_eps_is_the_dtype_eps_as_torch():
    # a tiny input makes eps dominate: the default must be finfo(dtype).eps in both dtypes
    for dt, tdt in ((np.float64, torch.float64), (np.float32, torch.float32)):
        x = np.array([[1e-9, -2e-9, 3e-9]], dtype=dt)
        y, _ = F.rms_norm(x)
        ty = TF.rms_norm(torch.from_numpy(x.copy()).to(tdt), (3,))
        assert y.dtype == dt
        np.testing.assert_allclose(y, ty.numpy(), rtol=1e-5 if dt == np.float32 else 1e-12)


# ------------------------------------------------------------------------------------------ softmax


def test_softmax_0d():
    x = np.float64(3.7)
    y, cache = F.softmax(x)
    tx = T(np.array(x))
    ty = torch.softmax(tx, dim=0)
    ty.backward(torch.tensor(2.5, dtype=torch.float64))
    assert y.shape == () and y == 1.0 and rel_err(y, ty, **REL) == 0.0
    dx = F.softmax_backward(np.float64(2.5), cache)
    assert dx.shape == () and dx == 0.0 and float(tx.grad) == 0.0


# ---------------------------------------------------------------------------------------- embedding


@st.composite
def embedding_cases(draw):
    num = draw(st.integers(1, 6))
    dim = draw(st.integers(1, 4))
    ids_shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    padding_idx = draw(st.one_of(st.none(), st.integers(-num, num - 1)))
    max_norm = draw(st.one_of(st.none(), st.sampled_from([0.3, 1.0, 2.5])))
    norm_type = draw(st.sampled_from([2.0, 1.0, 3.0, float("inf")]))
    freq = draw(st.booleans())
    return (
        num,
        dim,
        ids_shape,
        dict(padding_idx=padding_idx, max_norm=max_norm, norm_type=norm_type, scale_grad_by_freq=freq),
        draw(seeds()),
    )


@given(embedding_cases())
def test_embedding_options(case):
    num, dim, ids_shape, kw, seed = case
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((num, dim)) * 1.5
    ids = rng.integers(0, num, ids_shape)
    before = w.copy()
    out, cache = F.embedding(ids, w, **kw)
    np.testing.assert_array_equal(w, before)  # the given weight is never modified (torch's is)
    dy = upstream(out.shape, seed)
    dw = F.embedding_backward(dy, cache)
    tw = T(w)
    tout = TF.embedding(T(ids), tw, **kw)
    backward_torch(tout, dy)
    assert rel_err(out, tout, **REL) <= TOL and rel_err(dw, tw.grad, **REL) <= TOL


# ------------------------------------------------------------------------------------ cross entropy


@st.composite
def ce_cases(draw):
    c = draw(st.integers(1, 5))
    lead = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
    return (
        c,
        lead,
        draw(st.booleans()),
        draw(st.booleans()),
        draw(st.sampled_from(["mean", "sum", "none"])),
        draw(st.sampled_from([0.0, 0.1, 0.7])),
        draw(st.booleans()),
        draw(seeds()),
    )


def _torch_ce(logits, targets, **kw):
    """torch puts classes on axis 1: move npattn's last axis there (and back for "none")."""
    tl = T(logits)
    moved = tl if tl.ndim == 1 else tl.movedim(-1, 1)
    tt = T(targets, grad=False)
    if tt.dtype.is_floating_point and tt.ndim > 1:
        tt = tt.movedim(-1, 1)
    return tl, TF.cross_entropy(moved, tt, **kw)


@given(ce_cases())
def test_cross_entropy_options(case):
    c, lead, probs, weighted, reduction, smoothing, ignore, seed = case
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal(lead + (c,)) * 2
    w = rng.uniform(0.2, 2.0, c) if weighted else None
    if probs:
        targets = rng.dirichlet(np.ones(c), lead) if c > 1 else np.ones(lead + (1,))
        ignore_index = None
    else:
        targets = rng.integers(0, c, lead)
        ignore_index = -100
        if ignore and targets.size:
            targets.reshape(-1)[0] = -100  # at least one ignored element
    kw = dict(weight=w, reduction=reduction, label_smoothing=smoothing)
    loss, cache = F.cross_entropy(logits, targets, ignore_index, **kw)
    dout = upstream(np.shape(loss), seed)
    dx = F.cross_entropy_backward(dout, cache)
    tkw = dict(kw, weight=None if w is None else T(w, grad=False))
    if ignore_index is not None:
        tkw["ignore_index"] = ignore_index
    tl, tloss = _torch_ce(logits, targets, **tkw)
    if not probs and reduction == "mean" and not (targets != -100).any():
        return  # torch: nan (0/0); npattn: 0.0 (test_cross_entropy_nothing_counted)
    backward_torch(tloss, dout)
    assert rel_err(loss, tloss, **REL) <= TOL and rel_err(dx, tl.grad, **REL) <= TOL


def test_cross_entropy_nothing_counted_is_positive_zero_where_torch_gives_nan():
    logits = np.random.default_rng(0).standard_normal((3, 4))
    targets = np.full(3, -100)
    tl, tloss = _torch_ce(logits, targets)
    assert torch.isnan(tloss)
    for kw in ({}, {"weight": np.ones(4)}, {"label_smoothing": 0.2}):
        loss, cache = F.cross_entropy(logits, targets, -100, **kw)
        assert loss == 0.0 and not np.signbit(loss)
        np.testing.assert_array_equal(F.cross_entropy_backward(np.float64(1.5), cache), np.zeros((3, 4)))
    none, _ = F.cross_entropy(logits, targets, -100, reduction="none")
    assert not np.signbit(none).any()

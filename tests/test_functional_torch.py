"""Parity with PyTorch (the oracle, CPU, float64): every op, forward and backward, relative error <= 1e-10."""

import numpy as np
import pytest
from _oracles import rel_err
from hypothesis import given
from hypothesis import strategies as st

import npattn.functional as F
from npattn.testing import arrays, attention_configs, layer_norm_inputs, seeds, shapes

torch = pytest.importorskip("torch")
TF = torch.nn.functional

TOL = 1e-10
# tensor-wise: max|ours - torch| / max|torch| (floor 1e-12), the same non-finite entries
REL = dict(floor=1e-12, relative_to="max_b", match_nonfinite=True)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Tiny tensors: thread start-up costs more than it saves (and the machine has 2 cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def T(a, grad=True):
    t = torch.from_numpy(np.array(a, copy=True))
    return t.requires_grad_(grad) if t.dtype.is_floating_point else t


def check(ours_out, ours_grads, torch_out, torch_inputs, dout):
    assert rel_err(ours_out, torch_out, **REL) <= TOL
    torch_out.backward(torch.from_numpy(np.array(dout, copy=True)))
    for g, t in zip(ours_grads, torch_inputs):
        assert rel_err(g, t.grad, **REL) <= TOL


def dout_for(shape, seed):
    return np.random.default_rng(seed + 99).standard_normal(shape)


@given(shapes(0, 2, 1, 3), st.integers(1, 5), st.integers(1, 5), st.booleans(), seeds())
def test_linear(lead, n_in, n_out, with_bias, seed):
    rng = np.random.default_rng(seed)
    x, w = rng.uniform(-1, 1, lead + (n_in,)), rng.uniform(-1, 1, (n_out, n_in))
    b = rng.uniform(-1, 1, n_out) if with_bias else None
    out, cache = F.linear(x, w, b)
    dout = dout_for(out.shape, seed)
    grads = [g for g in F.linear_backward(dout, cache) if g is not None]
    ts = [T(x), T(w)] + ([T(b)] if with_bias else [])
    check(out, grads, TF.linear(*ts), ts, dout)


@given(shapes(1, 2, 1, 4), st.integers(1, 5), st.integers(1, 3), seeds())
def test_embedding(ids_shape, num, dim, seed):
    rng = np.random.default_rng(seed)
    ids, w = rng.integers(0, num, ids_shape), rng.uniform(-1, 1, (num, dim))
    out, cache = F.embedding(ids, w)
    dout = dout_for(out.shape, seed)
    tw = T(w)
    check(out, [F.embedding_backward(dout, cache)], TF.embedding(T(ids), tw), [tw], dout)


# logits within [-4, 4]: a softmax saturated to 1e-8 has gradients made of pure cancellation
@given(arrays(shapes(1, 3, 1, 5), scale=4.0), st.data(), seeds())
def test_softmax(x, data, seed):
    axis = data.draw(st.integers(-x.ndim, x.ndim - 1), label="axis")
    out, cache = F.softmax(x, axis=axis)
    dout = dout_for(out.shape, seed)
    tx = T(x)
    check(out, [F.softmax_backward(dout, cache)], torch.softmax(tx, dim=axis), [tx], dout)


@given(arrays(shapes(1, 3, 1, 5), scale=4.0), st.sampled_from(["relu", "none", "tanh"]), seeds())
def test_activations(x, kind, seed):
    x = x.copy()
    x.flat[0] = 0.0  # the kink / the origin: torch's relu gradient at 0 is 0
    if kind == "relu":
        out, cache = F.relu(x)
        dout = dout_for(out.shape, seed)
        tx = T(x)
        check(out, [F.relu_backward(dout, cache)], torch.relu(tx), [tx], dout)
    else:
        out, cache = F.gelu(x, approximate=kind)
        dout = dout_for(out.shape, seed)
        tx = T(x)
        check(out, [F.gelu_backward(dout, cache)], TF.gelu(tx, approximate=kind), [tx], dout)


# D >= 3: with D = 2 the normalised row is always (-1, 1) and dx is O(eps), pure cancellation
@given(layer_norm_inputs(min_features=3, max_features=6), st.sampled_from([1e-5, 1e-3, 0.1]), seeds())
def test_layer_norm(case, eps, seed):
    out, cache = F.layer_norm(case.x, case.weight, case.bias, eps)
    dout = dout_for(out.shape, seed)
    grads = [g for g in F.layer_norm_backward(dout, cache) if g is not None]
    tx = T(case.x)
    tw = None if case.weight is None else T(case.weight)
    tb = None if case.bias is None else T(case.bias)
    ts = [t for t in (tx, tw, tb) if t is not None]
    check(out, grads, TF.layer_norm(tx, (case.x.shape[-1],), tw, tb, eps), ts, dout)


@given(shapes(0, 2, 1, 4), st.integers(2, 6), st.sampled_from([None, 0, -100, 3]), st.floats(0, 0.9), seeds())
def test_cross_entropy(lead, classes, ignore_index, frac, seed):
    rng = np.random.default_rng(seed)
    logits = rng.uniform(-5, 5, lead + (classes,))
    targets = rng.integers(0, classes, lead)
    if ignore_index is not None:
        targets = np.where(rng.random(lead) < frac, ignore_index, targets)
    loss, cache = F.cross_entropy(logits, targets, ignore_index=ignore_index)
    counted = targets.size if ignore_index is None else int((targets != ignore_index).sum())
    if counted == 0:  # torch gives NaN (0/0); npattn gives 0 and zero gradients
        assert loss == 0.0 and np.all(F.cross_entropy_backward(1.0, cache) == 0)
        return
    dout = np.asarray(dout_for((), seed))
    tz = T(logits)
    tl = TF.cross_entropy(
        tz.reshape(-1, classes), T(targets.reshape(-1)), ignore_index=-100 if ignore_index is None else ignore_index
    )
    check(loss, [F.cross_entropy_backward(dout, cache)], tl, [tz], dout)


def test_dropout_semantics_match_torch():
    x = np.random.default_rng(0).uniform(0.5, 1.5, (50, 40))
    tx = torch.from_numpy(x)
    for p in (0.0, 0.3, 1.0):
        ty = TF.dropout(tx, p, training=True).numpy()
        y, _ = F.dropout(x, p, 0)
        # same scaling of the kept values (the masks come from different generators)
        np.testing.assert_allclose(y[y != 0], x[y != 0] / (1 - p))
        np.testing.assert_allclose(ty[ty != 0], x[ty != 0] / (1 - p))
        assert (p < 1) or (np.all(y == 0) and np.all(ty == 0))
    np.testing.assert_array_equal(F.dropout(x, 0.5, 0, training=False)[0], TF.dropout(tx, 0.5, training=False).numpy())


# ------------------------------------------------------------------------------ attention


@given(attention_configs(), seeds())
def test_scaled_dot_product_attention(cfg, seed):
    """Against torch's own ``scaled_dot_product_attention`` (the explicit formula's oracle is
    ``tests/_oracles.py``, checked in ``test_reference_attention``)."""
    out, cache = F.scaled_dot_product_attention(cfg.q, cfg.k, cfg.v, **cfg.kwargs())
    dout = dout_for(out.shape, seed)
    grads = F.scaled_dot_product_attention_backward(dout, cache)
    ts = [T(cfg.q), T(cfg.k), T(cfg.v)]
    mask, is_causal = cfg.attn_mask, cfg.is_causal
    if mask is not None and is_causal:  # torch refuses both: fold causality into the mask (top-left)
        tri = np.tri(cfg.lq, cfg.lk, dtype=bool)
        mask = (mask & tri) if mask.dtype == bool else np.where(tri, mask, -np.inf)
        is_causal = False
    kw = dict(
        attn_mask=None if mask is None else torch.from_numpy(np.array(mask)), is_causal=is_causal, scale=cfg.scale
    )
    if cfg.enable_gqa:
        kw["enable_gqa"] = True
    check(out, grads, TF.scaled_dot_product_attention(*ts, **kw), ts, dout)


@pytest.mark.parametrize("lq, lk", [(2, 5), (5, 2), (3, 3)])
def test_is_causal_is_top_left_as_torch(lq, lk):
    rng = np.random.default_rng(lq * 10 + lk)
    q, k, v = rng.uniform(-1, 1, (2, lq, 4)), rng.uniform(-1, 1, (2, lk, 4)), rng.uniform(-1, 1, (2, lk, 3))
    out, _ = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    t_out = TF.scaled_dot_product_attention(*(torch.from_numpy(a) for a in (q, k, v)), is_causal=True)
    assert rel_err(out, t_out, **REL) <= TOL
    tri = torch.ones(lq, lk, dtype=torch.bool).tril()  # top-left alignment, what torch documents
    t_ref = TF.scaled_dot_product_attention(*(torch.from_numpy(a) for a in (q, k, v)), attn_mask=tri)
    assert rel_err(out, t_ref, **REL) <= TOL


def test_fully_masked_rows_match_torch_zeros():
    rng = np.random.default_rng(3)
    q, k, v = rng.uniform(-1, 1, (2, 2, 3, 4)), rng.uniform(-1, 1, (2, 2, 4, 4)), rng.uniform(-1, 1, (2, 2, 4, 3))
    mask = rng.random((2, 1, 3, 4)) < 0.6
    mask[:, :, 1] = False
    out, cache = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ts = [T(a) for a in (q, k, v)]
    t_out = TF.scaled_dot_product_attention(*ts, attn_mask=torch.from_numpy(mask))
    assert np.all(out[:, :, 1] == 0)
    if not torch.isfinite(t_out).all():  # older torch: NaN rows; compare the visible rows only
        live = mask.any(axis=-1)[..., None] & np.ones(out.shape, dtype=bool)
        np.testing.assert_allclose(out[live], t_out.detach().numpy()[live], rtol=1e-10)
        return
    dout = dout_for(out.shape, 0)
    check(out, F.scaled_dot_product_attention_backward(dout, cache), t_out, ts, dout)


def test_no_keys_matches_torch():
    q, k, v = np.ones((2, 3, 4)), np.zeros((2, 0, 4)), np.zeros((2, 0, 5))
    out, _ = F.scaled_dot_product_attention(q, k, v)
    t = TF.scaled_dot_product_attention(*(torch.from_numpy(a) for a in (q, k, v)))
    np.testing.assert_array_equal(out, t.numpy())

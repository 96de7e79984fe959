"""Properties of the functional ops beyond their gradients: invariants, masking, dtype, purity."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import npattn.functional as F
from npattn.testing import arrays, attention_configs, layer_norm_inputs, make_mask, seeds, shapes

# ---------------------------------------------------------------------------------- softmax


@st.composite
def array_and_axis(draw, scale=5.0):
    x = draw(arrays(shapes(1, 3, 1, 5), scale=scale))
    return x, draw(st.integers(-x.ndim, x.ndim - 1))


@given(array_and_axis(), seeds())
def test_softmax_sums_to_one_and_is_shift_invariant(xa, seed):
    x, axis = xa
    y, _ = F.softmax(x, axis=axis)
    assert np.all(y >= 0) and np.all(y <= 1)
    np.testing.assert_allclose(y.sum(axis=axis), 1.0, rtol=0, atol=1e-14)
    shape = list(x.shape)
    shape[axis] = 1
    shift = np.random.default_rng(seed).uniform(-50, 50, shape)
    np.testing.assert_allclose(F.softmax(x + shift, axis=axis)[0], y, rtol=1e-12, atol=1e-15)


@given(arrays(shapes(2, 2, 1, 6), dtype=np.float32), st.sampled_from([1e4, -1e4, 3e4]))
def test_softmax_is_stable_for_huge_float32_logits(x, big):
    z = (x * np.float32(abs(big)) + np.float32(big)).astype(np.float32)
    y, cache = F.softmax(z)
    assert y.dtype == np.float32 and np.all(np.isfinite(y))
    np.testing.assert_allclose(y.sum(axis=-1), 1.0, atol=1e-5)
    dx = F.softmax_backward(np.ones_like(z), cache)
    assert dx.dtype == np.float32 and np.all(np.isfinite(dx))


def test_softmax_all_minus_inf_row_gives_zeros():
    x = np.array([[0.5, -np.inf, 1.0], [-np.inf, -np.inf, -np.inf]])
    y, cache = F.softmax(x)
    assert np.all(np.isfinite(y))
    np.testing.assert_array_equal(y[1], 0.0)
    assert y[0, 1] == 0.0 and y[0].sum() == pytest.approx(1.0)
    dx = F.softmax_backward(np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), cache)
    np.testing.assert_array_equal(dx[1], 0.0)
    y0, _ = F.softmax(x, axis=0)  # columns: the middle one is all -inf
    np.testing.assert_array_equal(y0[:, 1], 0.0)


# ---------------------------------------------------------------------------------- attention


def sdpa(cfg, q=None, k=None, v=None, **over):
    kw = cfg.kwargs()
    kw.update(over)
    return F.scaled_dot_product_attention(
        cfg.q if q is None else q, cfg.k if k is None else k, cfg.v if v is None else v, **kw
    )


@given(attention_configs(causal=True, mask_kinds=["none", "random", "float"], dropout=True), st.data())
def test_causal_output_ignores_future_keys(cfg, data):
    # query i sees keys 0..i (top-left): rows 0..t cannot depend on keys t+1.. (also with Lq != Lk)
    t = data.draw(st.integers(0, cfg.lk - 1), label="t")
    out, _ = sdpa(cfg)
    k2, v2 = cfg.k.copy(), cfg.v.copy()
    rng = np.random.default_rng(1)
    k2[..., t + 1 :, :] = rng.uniform(-5, 5, k2[..., t + 1 :, :].shape)
    v2[..., t + 1 :, :] = rng.uniform(-5, 5, v2[..., t + 1 :, :].shape)
    out2, _ = sdpa(cfg, k=k2, v=v2)
    rows = min(t + 1, cfg.lq)
    np.testing.assert_array_equal(out2[..., :rows, :], out[..., :rows, :])
    if t + 1 < min(cfg.lq, cfg.lk) and cfg.attn_mask is None and cfg.dropout_p == 0:
        assert not np.array_equal(out2[..., t + 1 :, :], out[..., t + 1 :, :])


@given(attention_configs(head_axis=True, gqa=True, max_groups=3, dropout=True), seeds())
def test_gqa_equals_repeated_kv_heads(cfg, seed):
    g = cfg.groups
    kw = cfg.kwargs()
    kw["enable_gqa"] = True
    out, cache = F.scaled_dot_product_attention(cfg.q, cfg.k, cfg.v, **kw)
    kr, vr = np.repeat(cfg.k, g, axis=-3), np.repeat(cfg.v, g, axis=-3)
    kw["enable_gqa"] = False
    out_r, cache_r = F.scaled_dot_product_attention(cfg.q, kr, vr, **kw)
    np.testing.assert_allclose(out, out_r, rtol=1e-13, atol=1e-15)
    dout = np.random.default_rng(seed).standard_normal(out.shape)
    dq, dk, dv = F.scaled_dot_product_attention_backward(dout, cache)
    dq_r, dk_r, dv_r = F.scaled_dot_product_attention_backward(dout, cache_r)
    np.testing.assert_allclose(dq, dq_r, rtol=1e-12, atol=1e-14)

    def group_sum(a):  # (..., Hk*G, L, D) -> (..., Hk, L, D), summing each group
        return a.reshape(a.shape[:-3] + (a.shape[-3] // g, g) + a.shape[-2:]).sum(axis=-3)

    np.testing.assert_allclose(dk, group_sum(dk_r), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(dv, group_sum(dv_r), rtol=1e-12, atol=1e-14)


@given(attention_configs(mask_kinds=["random", "fully_masked", "padding", "causal"]), seeds())
def test_float_minus_inf_mask_equals_bool_mask(cfg, seed):
    fmask = np.where(cfg.attn_mask, 0.0, -np.inf)
    out_b, cache_b = sdpa(cfg)
    out_f, cache_f = sdpa(cfg, attn_mask=fmask)
    np.testing.assert_array_equal(out_f, out_b)
    dout = np.random.default_rng(seed).standard_normal(out_b.shape)
    for gb, gf in zip(
        F.scaled_dot_product_attention_backward(dout, cache_b), F.scaled_dot_product_attention_backward(dout, cache_f)
    ):
        np.testing.assert_array_equal(gf, gb)


@given(attention_configs(mask_kinds=["fully_masked"], dropout=True), seeds())
def test_fully_masked_rows_give_exact_zeros(cfg, seed):
    dead = ~cfg.visible().any(axis=-1)  # (..., Hq, Lq)
    assert dead.any()
    out, cache = sdpa(cfg)
    assert np.all(np.isfinite(out))
    assert np.all(out[dead] == 0.0)
    dout = np.random.default_rng(seed).standard_normal(out.shape)
    dq, dk, dv = F.scaled_dot_product_attention_backward(dout, cache)
    assert all(np.all(np.isfinite(a)) for a in (dq, dk, dv))
    assert np.all(dq[dead] == 0.0)
    # the dead rows' upstream gradient reaches nothing: zeroing it changes no gradient
    dout2 = dout.copy()
    dout2[dead] = 0.0
    for a, b in zip((dq, dk, dv), F.scaled_dot_product_attention_backward(dout2, cache)):
        np.testing.assert_array_equal(a, b)


@given(attention_configs(max_batch_dims=1, head_axis=False, dropout=True), seeds())
def test_inputs_without_head_axis(cfg, seed):
    out, cache = sdpa(cfg)
    assert out.shape == cfg.q.shape[:-1] + (cfg.v.shape[-1],)
    m = cfg.attn_mask
    m1 = None if m is None else m[..., None, :, :]
    q1, k1, v1 = (a[..., None, :, :] for a in (cfg.q, cfg.k, cfg.v))
    out1, cache1 = sdpa(cfg, q1, k1, v1, attn_mask=m1)
    np.testing.assert_allclose(out1[..., 0, :, :], out, rtol=1e-14, atol=1e-15)
    dout = np.random.default_rng(seed).standard_normal(out.shape)
    grads = F.scaled_dot_product_attention_backward(dout, cache)
    grads1 = F.scaled_dot_product_attention_backward(dout[..., None, :, :], cache1)
    for a, b in zip(grads, grads1):
        np.testing.assert_allclose(b[..., 0, :, :], a, rtol=1e-13, atol=1e-15)


def test_attention_known_values():
    # one query, two keys: weights softmax([0, 1 * scale]) with scale 1
    q = np.array([[1.0, 0.0]])
    k = np.array([[0.0, 0.0], [1.0, 0.0]])
    v = np.array([[1.0], [3.0]])
    out, _ = F.scaled_dot_product_attention(q, k, v, scale=1.0)
    w = np.exp([0.0, 1.0]) / np.exp([0.0, 1.0]).sum()
    np.testing.assert_allclose(out, [[w @ [1.0, 3.0]]], rtol=1e-15)
    out_c, _ = F.scaled_dot_product_attention(np.vstack([q, q]), k, v, is_causal=True, scale=1.0)
    np.testing.assert_allclose(out_c, [[1.0], [w @ [1.0, 3.0]]], rtol=1e-15)


# ---------------------------------------------------------------------------------- layer norm


@given(layer_norm_inputs(affine=False, max_features=8))
def test_layer_norm_normalises_before_affine(case):
    y, _ = F.layer_norm(case.x, eps=case.eps)
    np.testing.assert_allclose(y.mean(axis=-1), 0.0, atol=1e-14)
    var = case.x.var(axis=-1)
    np.testing.assert_allclose(y.var(axis=-1), var / (var + case.eps), rtol=1e-12)
    assert np.all(np.abs(y.var(axis=-1) - 1.0) < 1e-4)


@given(layer_norm_inputs(affine=True))
def test_layer_norm_affine_is_applied_after(case):
    y, _ = F.layer_norm(case.x, case.weight, case.bias, case.eps)
    y0, _ = F.layer_norm(case.x, eps=case.eps)
    np.testing.assert_allclose(y, y0 * case.weight + case.bias, rtol=1e-14, atol=1e-15)


# ---------------------------------------------------------------------------------- dropout

N_DROP = 20000


@given(st.floats(0.05, 0.95), seeds())
def test_dropout_keeps_about_one_minus_p_and_rescales(p, seed):
    x = np.random.default_rng(seed).uniform(0.5, 1.5, N_DROP)  # no zeros: y == 0 iff dropped
    y, cache = F.dropout(x, p, np.random.default_rng(seed))
    kept = y != 0
    sigma = np.sqrt(N_DROP * p * (1 - p))
    assert abs(kept.sum() - N_DROP * (1 - p)) <= 6 * sigma  # ~1e-9 chance of a false alarm
    np.testing.assert_allclose(y[kept], x[kept] / (1 - p), rtol=1e-15)
    dy = np.random.default_rng(seed + 1).standard_normal(N_DROP)
    dx = F.dropout_backward(dy, cache)
    np.testing.assert_allclose(dx, np.where(kept, dy / (1 - p), 0.0), rtol=1e-15)


@given(arrays(shapes(1, 3, 1, 5)), st.floats(0.0, 1.0), seeds())
def test_dropout_same_seed_same_mask_and_special_cases(x, p, seed):
    y1, _ = F.dropout(x, p, seed)
    y2, _ = F.dropout(x, p, np.random.default_rng(seed))
    np.testing.assert_array_equal(y1, y2)
    y3, _ = F.dropout(x.astype(np.float32), p, seed)  # float64 draws: same mask in float32
    np.testing.assert_array_equal(y3 != 0, y1 != 0)
    yi, ci = F.dropout(x, p, seed, training=False)
    np.testing.assert_array_equal(yi, x)
    assert yi is not x
    np.testing.assert_array_equal(F.dropout_backward(x, ci), x)
    y1p, c1p = F.dropout(x, 1.0, seed)
    assert np.all(y1p == 0) and np.all(F.dropout_backward(x, c1p) == 0)
    y0, _ = F.dropout(x, 0.0, seed)
    np.testing.assert_array_equal(y0, x)


def test_dropout_generator_advances():
    gen = np.random.default_rng(0)
    x = np.ones(1000)
    a, _ = F.dropout(x, 0.5, gen)
    b, _ = F.dropout(x, 0.5, gen)
    assert not np.array_equal(a, b)


# ---------------------------------------------------------------------------------- all ops: dtype and purity


def _op_cases(rng, dtype):
    """name -> (forward(*arrays) -> (out, cache), backward, float arrays, constant arrays)."""

    def u(*shape, s=1.0):
        return rng.uniform(-s, s, shape).astype(dtype)

    ids = rng.integers(0, 4, (2, 3))
    targets = rng.integers(0, 5, (2, 3))
    targets[0, 0] = -100
    ln_x = u(2, 3, 5) + np.linspace(-1, 1, 5).astype(dtype)
    mask = make_mask(3, 4, "fully_masked", seed=int(rng.integers(1000)))
    fmask = make_mask(3, 4, "float", seed=int(rng.integers(1000))).astype(dtype)
    return {
        "linear": (F.linear, F.linear_backward, [u(2, 3, 4), u(5, 4), u(5)], []),
        "linear_nobias": (F.linear, F.linear_backward, [u(2, 3, 4), u(5, 4)], []),
        "embedding": (lambda w: F.embedding(ids, w), F.embedding_backward, [u(4, 3)], [ids]),
        "softmax": (lambda x: F.softmax(x, axis=1), F.softmax_backward, [u(2, 3, 4, s=4)], []),
        "relu": (F.relu, F.relu_backward, [u(2, 3, 4)], []),
        "gelu": (F.gelu, F.gelu_backward, [u(2, 3, 4, s=3)], []),
        "gelu_tanh": (lambda x: F.gelu(x, "tanh"), F.gelu_backward, [u(2, 3, 4, s=3)], []),
        "layer_norm": (F.layer_norm, F.layer_norm_backward, [ln_x, u(5) + 1, u(5)], []),
        "dropout": (lambda x: F.dropout(x, 0.3, 5), F.dropout_backward, [u(2, 3, 4)], []),
        "sdpa_mask": (
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.2, rng=3),
            F.scaled_dot_product_attention_backward,
            [u(2, 2, 3, 4), u(2, 2, 4, 4), u(2, 2, 4, 3)],
            [mask],
        ),
        "sdpa_gqa_float_mask": (
            lambda q, k, v: F.scaled_dot_product_attention(
                q, k, v, attn_mask=fmask, is_causal=True, enable_gqa=True, scale=0.7
            ),
            F.scaled_dot_product_attention_backward,
            [u(2, 4, 3, 4), u(2, 2, 4, 4), u(2, 2, 4, 2)],
            [fmask],
        ),
        "cross_entropy": (
            lambda z: F.cross_entropy(z, targets, ignore_index=-100),
            F.cross_entropy_backward,
            [u(2, 3, 5, s=3)],
            [targets],
        ),
    }


OPS = sorted(_op_cases(np.random.default_rng(0), np.float64))


def _grads(backward, dout, cache):
    g = backward(dout, cache)
    return [a for a in (g if isinstance(g, tuple) else (g,)) if a is not None]


@pytest.mark.parametrize("op", OPS)
@given(seed=seeds())
def test_float32_stays_float32_and_is_close_to_float64(op, seed):
    fwd, bwd, xs32, _ = _op_cases(np.random.default_rng(seed), np.float32)[op]
    xs64 = [a.astype(np.float64) for a in xs32]
    out32, c32 = fwd(*xs32)
    out64, c64 = fwd(*xs64)
    assert out32.dtype == np.float32 and out64.dtype == np.float64
    np.testing.assert_allclose(out32, out64, rtol=1e-5, atol=1e-5)
    dout = np.random.default_rng(seed).standard_normal(out64.shape)
    g32 = _grads(bwd, dout.astype(np.float32), c32)
    g64 = _grads(bwd, dout, c64)
    assert len(g32) == len(xs32)
    for a, b, x in zip(g32, g64, xs32):
        assert a.dtype == np.float32 and a.shape == x.shape
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # a float64 upstream gradient on a float32 forward still gives float32 gradients
    assert all(a.dtype == np.float32 for a in _grads(bwd, dout, fwd(*xs32)[1]))


@pytest.mark.parametrize("op", OPS)
@given(seed=seeds(), read_only=st.booleans())
def test_inputs_are_not_modified(op, seed, read_only):
    fwd, bwd, xs, consts = _op_cases(np.random.default_rng(seed), np.float64)[op]
    before = [a.copy() for a in xs + consts]
    for a in xs + consts:
        a.setflags(write=not read_only)
    out, cache = fwd(*xs)
    dout = np.random.default_rng(seed).standard_normal(np.shape(out))
    dout.setflags(write=not read_only)
    dout_before = dout.copy()
    _grads(bwd, dout, cache)
    _grads(bwd, dout, cache)  # a cache can be used twice: backward does not consume it in place
    for a, b in zip(xs + consts, before):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(dout, dout_before)
    assert all(not np.shares_memory(out, a) for a in xs)


@pytest.mark.parametrize("op", OPS)
def test_backward_is_repeatable(op):
    fwd, bwd, xs, _ = _op_cases(np.random.default_rng(0), np.float64)[op]
    out, cache = fwd(*xs)
    dout = np.random.default_rng(1).standard_normal(np.shape(out))
    for a, b in zip(_grads(bwd, dout, cache), _grads(bwd, dout, cache)):
        np.testing.assert_array_equal(a, b)


def test_no_keys_at_all_gives_zeros():
    # Lk = 0: every query row attends to no key -> output 0, gradients 0 (torch returns zeros too)
    q, k, v = np.ones((2, 3, 4)), np.zeros((2, 0, 4)), np.zeros((2, 0, 5))
    out, cache = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.shape == (2, 3, 5) and np.all(out == 0)
    dq, dk, dv = F.scaled_dot_product_attention_backward(np.ones(out.shape), cache)
    assert dq.shape == q.shape and np.all(dq == 0) and dk.shape == k.shape and dv.shape == v.shape
    y, cache = F.softmax(np.zeros((2, 0)))
    assert y.shape == (2, 0) and F.softmax_backward(np.zeros((2, 0)), cache).shape == (2, 0)

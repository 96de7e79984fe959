"""No mutation, numerics and dtypes across the public API.

* nothing writes into what it is given (inputs, masks, upstream gradients; read-only arrays work)
  and no output aliases an input;
* query rows that may attend to no key, and batch elements whose keys are all padding, give exact
  zeros in the attention core (``out_proj.bias`` out of ``MultiHeadAttention``) and zero gradients;
* logits of +-1e4 in float32 stay finite (softmax, sdpa, memory-efficient attention, cross-entropy);
* constant rows in layer norm (variance 0) give ``bias`` and finite gradients;
* float32 modules stay float32 everywhere, the arrays they keep for backward included;
* non-contiguous, transposed and Fortran-ordered inputs give the results of C-contiguous copies.
"""

import numpy as np
import pytest
from _hardening import MODULES, build_case, cache_arrays, walk_arrays
from hypothesis import given, settings
from hypothesis import strategies as st

import npattn
import npattn.functional as F

SEEDS = st.integers(0, 2**32 - 1)
MHA, ENC = npattn.MultiHeadAttention, npattn.EncoderBlock


def _first(y):
    return y[0] if isinstance(y, tuple) else y


def _tuple(g):
    return g if isinstance(g, tuple) else (g,)


# ----------------------------------------------------------------------------------- no mutation
@pytest.mark.parametrize("name", sorted(MODULES))
@settings(max_examples=8)
@given(seed=SEEDS, read_only=st.booleans())
def test_modules_never_modify_inputs_masks_or_dy(name, seed, read_only):
    m, inputs, kw = build_case(name, seed)
    given_arrays = list(inputs) + [v for v in kw.values() if isinstance(v, np.ndarray)]
    copies = [a.copy() for a in given_arrays]
    for a in given_arrays:
        a.setflags(write=not read_only)
    y = _first(m(*inputs, **kw))
    for a in inputs:
        assert not np.shares_memory(y, a), "the output aliases an input"
    dy = np.random.default_rng(seed + 1).standard_normal(y.shape)
    dy.setflags(write=not read_only)
    dy_copy = dy.copy()
    grads = [g for g in _tuple(m.backward(dy)) if g is not None]
    for g in grads:
        assert not np.shares_memory(g, dy), "an input gradient aliases dy"
    for a, c in zip(given_arrays + [dy], copies + [dy_copy]):
        np.testing.assert_array_equal(a, c)


@settings(max_examples=30)
@given(seed=SEEDS, read_only=st.booleans(), causal=st.booleans(), block=st.sampled_from([None, 1, 2, 3]))
def test_memory_efficient_attention_never_modifies_its_arguments(seed, read_only, causal, block):
    rng = np.random.default_rng(seed)
    q, k, v = rng.standard_normal((2, 2, 5, 3)), rng.standard_normal((2, 2, 6, 3)), rng.standard_normal((2, 2, 6, 4))
    mask = rng.standard_normal((5, 6))
    mask[rng.random((5, 6)) < 0.3] = -np.inf
    args = [q, k, v, mask]
    copies = [a.copy() for a in args]
    for a in args:
        a.setflags(write=not read_only)
    out, cache = F.memory_efficient_attention(q, k, v, attn_mask=mask, is_causal=causal, block_size=block)
    dout = rng.standard_normal(out.shape)
    dout.setflags(write=not read_only)
    dcopy = dout.copy()
    g1 = F.memory_efficient_attention_backward(dout, cache)
    g2 = F.memory_efficient_attention_backward(dout, cache)  # a cache can be used twice
    for a, b in zip(g1, g2):
        np.testing.assert_array_equal(a, b)
    for a, c in zip(args + [dout], copies + [dcopy]):
        np.testing.assert_array_equal(a, c)
    assert not any(np.shares_memory(out, a) for a in args)


# ----------------------------------------------------------------------------------- masked rows
@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(causal=True),
        dict(num_kv_heads=1),
        dict(dropout=0.5, rng=3),
        dict(memory_efficient=True),
        dict(memory_efficient=True, causal=True, num_kv_heads=1),
    ],
    ids=["plain", "causal", "gqa", "dropout", "memeff", "memeff-causal-gqa"],
)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_all_padding_batch_element_gives_out_proj_bias_and_zero_gradients(kw, dtype):
    rng = np.random.default_rng(0)
    kw = dict(dict(rng=0), **kw)
    m = MHA(6, 8, 2, qkv_bias=True, dtype=dtype, **kw)
    x = rng.standard_normal((3, 5, 6)).astype(dtype)
    kpm = rng.random((3, 5)) < 0.3
    kpm[:, 0] = False
    kpm[1] = True  # batch element 1: every key is padding
    y = m(x, key_padding_mask=kpm)
    assert np.all(np.isfinite(y))
    np.testing.assert_array_equal(y[1], np.broadcast_to(m.out_proj.bias.data, (5, 8)))  # exactly
    dy = rng.standard_normal(y.shape).astype(dtype)
    dx = m.backward(dy)
    assert np.all(np.isfinite(dx)) and np.all(dx[1] == 0)
    grads = {n: p.grad.copy() for n, p in m.named_parameters()}
    assert all(np.all(np.isfinite(g)) for g in grads.values())
    if "dropout" in kw:
        return
    # the padded element adds nothing to the projections' gradients: the same as without it
    m.zero_grad()
    keep = [0, 2]
    m(x[keep], key_padding_mask=kpm[keep])
    m.backward(dy[keep])
    tol = 1e-12 if dtype == np.float64 else 1e-5
    for n, p in m.named_parameters():
        if n.startswith(("W_query", "W_key", "W_value")) or n == "out_proj.weight":
            np.testing.assert_allclose(grads[n], p.grad, rtol=tol, atol=tol, err_msg=n)


@pytest.mark.parametrize("memory_efficient", [False, True])
def test_fully_masked_query_row_gives_out_proj_bias(memory_efficient):
    rng = np.random.default_rng(1)
    m = MHA(6, 8, 2, memory_efficient=memory_efficient, rng=0)
    x = rng.standard_normal((2, 5, 6))
    for mask in (np.ones((5, 5), bool), np.zeros((5, 5))):
        if mask.dtype == bool:
            mask[3] = False
        else:
            mask[3] = -np.inf
        y = m(x, attn_mask=mask)
        np.testing.assert_array_equal(y[:, 3], np.broadcast_to(m.out_proj.bias.data, (2, 8)))
        assert np.all(np.isfinite(m.backward(np.ones(y.shape))))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block", [None, 1, 3])
def test_memory_efficient_attention_fully_masked_rows_give_exact_zeros(causal, block):
    rng = np.random.default_rng(2)
    q, k, v = rng.standard_normal((2, 2, 6, 3)), rng.standard_normal((2, 2, 7, 3)), rng.standard_normal((2, 2, 7, 4))
    mask = rng.random((2, 1, 6, 7)) < 0.5
    mask[0, :, 2] = False
    mask[1, :, 5] = False
    out, cache = F.memory_efficient_attention(q, k, v, attn_mask=mask, is_causal=causal, block_size=block)
    dead = ~(mask & np.tri(6, 7, dtype=bool) if causal else mask).any(axis=-1)  # (2, 1, 6)
    dead = np.broadcast_to(dead, (2, 2, 6))
    assert dead.any() and np.all(np.isfinite(out))
    assert np.all(out[dead] == 0.0)
    dout = rng.standard_normal(out.shape)
    dq, dk, dv = F.memory_efficient_attention_backward(dout, cache)
    assert all(np.all(np.isfinite(g)) for g in (dq, dk, dv))
    assert np.all(dq[dead] == 0.0)
    dout2 = dout.copy()
    dout2[dead] = 0.0  # the dead rows' upstream gradient reaches nothing
    for a, b in zip((dq, dk, dv), F.memory_efficient_attention_backward(dout2, cache)):
        np.testing.assert_array_equal(a, b)


def test_encoder_block_and_model_with_all_padding_stay_finite():
    rng = np.random.default_rng(3)
    kpm = np.zeros((2, 5), bool)
    kpm[0] = True
    for norm_first in (False, True):
        e = ENC(6, 2, 10, norm_first=norm_first, dropout=0.0, rng=0)
        y = e(rng.standard_normal((2, 5, 6)), key_padding_mask=kpm)
        assert np.all(np.isfinite(y))
        assert np.all(np.isfinite(e.backward(rng.standard_normal(y.shape))))
        assert all(np.all(np.isfinite(p.grad)) for p in e.parameters())


# ----------------------------------------------------------------------------------- large logits
@pytest.mark.parametrize("big", [1e4, -1e4])
@given(seed=SEEDS)
@settings(max_examples=20)
def test_float32_logits_of_1e4_stay_finite(big, seed):
    rng = np.random.default_rng(seed)
    f32 = np.float32
    z = (rng.uniform(-1, 1, (3, 4, 9)) * big).astype(f32)
    y, c = F.softmax(z)
    assert y.dtype == f32 and np.all(np.isfinite(y))
    np.testing.assert_allclose(y.sum(-1), 1.0, atol=1e-5)
    assert np.all(np.isfinite(F.softmax_backward(np.ones_like(z), c)))
    targets = rng.integers(0, 9, (3, 4))
    loss, c = F.cross_entropy(z, targets)
    assert loss.dtype == f32 and np.isfinite(loss)
    g = F.cross_entropy_backward(np.ones((), f32), c)
    assert g.dtype == f32 and np.all(np.isfinite(g))
    # attention whose scaled scores reach |1e4|: q.k = 100 * 100 per unit scale
    q = (rng.uniform(-1, 1, (2, 2, 5, 4)) * 100).astype(f32)
    k = (rng.uniform(-1, 1, (2, 2, 6, 4)) * np.sign(big) * 100).astype(f32)
    v = rng.uniform(-1, 1, (2, 2, 6, 3)).astype(f32)
    mask = rng.random((5, 6)) < 0.7
    for is_causal in (False, True):
        for fwd, bwd, kw in (
            (F.scaled_dot_product_attention, F.scaled_dot_product_attention_backward, {}),
            (F.memory_efficient_attention, F.memory_efficient_attention_backward, {"block_size": 2}),
        ):
            out, cache = fwd(q, k, v, attn_mask=mask, is_causal=is_causal, scale=1.0, **kw)
            assert out.dtype == f32 and np.all(np.isfinite(out))
            assert np.abs(out).max() <= np.abs(v).max() * (1 + 1e-5)  # a convex combination of the values
            for g in bwd(rng.standard_normal(out.shape).astype(f32), cache):
                assert g.dtype == f32 and np.all(np.isfinite(g))


# ----------------------------------------------------------------------------------- layer norm
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("eps", [1e-5, 0.0])
def test_layer_norm_constant_rows(dtype, eps):
    rng = np.random.default_rng(4)
    w, b = rng.standard_normal(6).astype(dtype), rng.standard_normal(6).astype(dtype)
    # exactly representable constants: mean == value, so x - mean == 0 and y == bias exactly
    x = np.repeat(np.array([0.0, 0.5, -3.0, 1024.0], dtype)[:, None], 6, axis=1)
    y, c = F.layer_norm(x, w, b, eps)
    assert y.dtype == dtype
    np.testing.assert_array_equal(y, np.broadcast_to(b, x.shape))
    dx, dw, db = F.layer_norm_backward(rng.standard_normal(x.shape).astype(dtype), c)
    assert all(a.dtype == dtype and np.all(np.isfinite(a)) for a in (dx, dw, db))
    if eps == 0.0:
        assert np.all(dx == 0)
    # any constant: finite, and y == bias up to the rounding of the mean
    x = np.repeat(rng.uniform(-100, 100, (5, 1)).astype(dtype), 6, axis=1)
    y, c = F.layer_norm(x, w, b, eps)
    tol = 1e-9 if dtype == np.float64 else 2e-2
    np.testing.assert_allclose(y, np.broadcast_to(b, x.shape), atol=tol * (1 if eps else 1e5))
    assert all(np.all(np.isfinite(a)) for a in F.layer_norm_backward(np.ones(x.shape, dtype), c))
    ln = npattn.LayerNorm(6, eps=eps, dtype=dtype)
    y = ln(np.full((2, 3, 6), 7.0))
    np.testing.assert_array_equal(y, 0.0)
    assert np.all(np.isfinite(ln.backward(np.ones(y.shape))))


# ----------------------------------------------------------------------------------- float32 end to end
@pytest.mark.parametrize("name", sorted(MODULES))
def test_float32_modules_stay_float32_caches_included(name):
    m, inputs, kw = build_case(name, 5, np.float32)
    kw = {
        k: (v.astype(np.float64) if isinstance(v, np.ndarray) and v.dtype.kind == "f" else v) for k, v in kw.items()
    }  # float64 masks must not drag a float32 module to float64
    y = _first(m(*inputs, **kw))
    assert y.dtype == np.float32
    wide = [(path, a.dtype, a.shape) for path, a in cache_arrays(m) if a.dtype.kind == "f" and a.dtype != np.float32]
    assert not wide, f"float64 arrays kept for backward: {wide}"
    grads = _tuple(m.backward(np.ones(y.shape)))  # a float64 dy is cast, not followed
    assert all(g is None or g.dtype == np.float32 for g in grads)
    for n, p in m.named_parameters():
        assert p.data.dtype == np.float32 and p.grad.dtype == np.float32, n
    sd = m.state_dict()
    assert all(a.dtype == np.float32 for a in sd.values())


def test_float32_functional_ops_keep_float32_in_their_caches():
    rng = np.random.default_rng(6)
    f = np.float32

    def r(*s):
        return rng.standard_normal(s).astype(f)

    mask64 = rng.standard_normal((4, 5))
    calls = [
        F.linear(r(2, 3), r(4, 3), r(4)),
        F.softmax(r(2, 3)),
        F.layer_norm(r(2, 3), r(3), r(3)),
        F.gelu(r(2, 3)),
        F.gelu(r(2, 3), "tanh"),
        F.relu(r(2, 3)),
        F.dropout(r(2, 3), 0.5, 0),
        F.cross_entropy(r(2, 3), np.array([0, 1])),
        F.embedding(np.array([0, 1]), r(3, 2)),
        F.scaled_dot_product_attention(
            r(2, 4, 3), r(2, 5, 3), r(2, 5, 2), attn_mask=mask64.astype(f), dropout_p=0.2, rng=0, is_causal=True
        ),
        F.memory_efficient_attention(r(2, 4, 3), r(2, 5, 3), r(2, 5, 2), block_size=2),
    ]
    for out, cache in calls:
        assert np.asarray(out).dtype == f
        wide = [(p, a.dtype) for p, a in walk_arrays(cache) if a.dtype.kind == "f" and a.dtype != f]
        assert not wide, wide


# ----------------------------------------------------------------------------------- memory layout
def _layouts(a):
    """The same values as ``a`` in other memory layouts."""
    yield "strided", np.repeat(a, 2, axis=-1)[..., ::2]
    if a.ndim >= 2:
        yield "fortran", np.asfortranarray(a)
        yield "transposed", np.ascontiguousarray(a.swapaxes(-1, -2)).swapaxes(-1, -2)
    if a.ndim >= 3:
        yield "batch-reversed", np.ascontiguousarray(a[::-1])[::-1]
    b = np.empty(a.shape[:-1] + (a.shape[-1] + 1,), a.dtype)[..., 1:]  # unaligned-start rows
    b[...] = a
    yield "offset", b


def _assert_same(a, b, what):
    if a is None:
        assert b is None
        return
    np.testing.assert_allclose(b, a, rtol=1e-15, atol=1e-15, err_msg=what)


FUNCS = {
    "linear": (lambda x, w, b: F.linear(x, w, b), F.linear_backward, [(3, 4, 5), (6, 5), (6,)]),
    "softmax": (lambda x: F.softmax(x, axis=1), F.softmax_backward, [(3, 4, 5)]),
    "layer_norm": (F.layer_norm, F.layer_norm_backward, [(3, 4, 5), (5,), (5,)]),
    "gelu": (F.gelu, F.gelu_backward, [(3, 4, 5)]),
    "sdpa": (
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        F.scaled_dot_product_attention_backward,
        [(2, 2, 5, 4), (2, 2, 6, 4), (2, 2, 6, 3)],
    ),
    "sdpa-gqa-dropout": (
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True, dropout_p=0.3, rng=1),
        F.scaled_dot_product_attention_backward,
        [(2, 4, 5, 4), (2, 2, 6, 4), (2, 2, 6, 3)],
    ),
    "memory_efficient": (
        lambda q, k, v: F.memory_efficient_attention(q, k, v, is_causal=True, block_size=2),
        F.memory_efficient_attention_backward,
        [(2, 2, 5, 4), (2, 2, 6, 4), (2, 2, 6, 3)],
    ),
    "cross_entropy": (
        lambda z: F.cross_entropy(z, np.array([[0, 1, 2, 3]] * 3)),
        F.cross_entropy_backward,
        [(3, 4, 5)],
    ),
}


@pytest.mark.parametrize("op", sorted(FUNCS))
def test_non_contiguous_inputs_give_the_contiguous_results(op):
    fwd, bwd, shapes = FUNCS[op]
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal(s) for s in shapes]
    out, cache = fwd(*xs)
    dout = rng.standard_normal(np.shape(out))
    ref = _tuple(bwd(dout, cache))
    for i, x in enumerate(xs):
        for layout, xl in _layouts(x):
            assert not xl.flags.c_contiguous or layout == "offset"
            args = list(xs)
            args[i] = xl
            out2, cache2 = fwd(*args)
            _assert_same(out, out2, f"{op} out, input {i} {layout}")
            for _, dl in _layouts(dout) if np.ndim(dout) >= 2 else [("same", dout)]:
                for a, b in zip(ref, _tuple(bwd(dl, cache2))):
                    _assert_same(a, b, f"{op} grad, input {i} {layout}")


@pytest.mark.parametrize(
    "name", ["Linear", "LayerNorm", "FeedForward", "MHA-causal-gqa", "MHA-memeff", "EncoderBlock-prenorm", "BookMHA"]
)
def test_modules_non_contiguous_inputs(name):
    m, inputs, kw = build_case(name, 8)
    m.eval()
    (x,) = inputs
    y = m(x, **kw)
    dy = np.random.default_rng(9).standard_normal(y.shape)
    dx = m.backward(dy)
    for layout, xl in _layouts(x):
        _assert_same(y, m(xl, **kw), f"{name} {layout}")
        _assert_same(dx, m.backward(np.asfortranarray(dy)), f"{name} dx {layout}")

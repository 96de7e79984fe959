"""Equivalences between modules, float32 vs float64, and dropout semantics."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import npattn
from npattn import book

seeds = st.integers(0, 2**32 - 1)


def run(m, inputs, dy_seed=123, **fwd):
    """Forward, a random upstream gradient, backward.  Returns (out, input grads tuple, {name: grad})."""
    m.zero_grad()
    out = m(*inputs, **fwd)
    if isinstance(out, tuple):
        out = out[0]
    dy = np.random.default_rng(dy_seed).standard_normal(out.shape)
    g = m.backward(dy)
    g = g if isinstance(g, tuple) else (g,)
    return out, g, {n: p.grad.copy() for n, p in m.named_parameters()}


def close(a, b, tol=1e-12):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


def rand(seed, shape):
    return np.random.default_rng(seed).uniform(-1, 1, shape)


# ------------------------------------------------------------------------------ book wrappers


@settings(max_examples=25)
@given(seed=seeds, batched=st.booleans(), qkv_bias=st.booleans(), T=st.integers(2, 5))
def test_wrapper_one_head_equals_causal_attention(seed, batched, qkv_bias, T):
    ca = book.CausalAttention(3, 2, 5, 0.0, qkv_bias, rng=seed)
    w = book.MultiHeadAttentionWrapper(3, 2, 5, 0.0, 1, qkv_bias, rng=seed + 1)
    w.load_state_dict({f"heads.0.{k}": v for k, v in ca.state_dict().items()})
    x = rand(seed, ((2,) if batched else ()) + (T, 3))
    o1, g1, p1 = run(ca, (x,))
    o2, g2, p2 = run(w, (x,))
    close(o1, o2)
    close(g1[0], g2[0])
    assert {f"heads.0.{k}" for k in p1} == set(p2)
    for k in p1:
        close(p1[k], p2[f"heads.0.{k}"])


@settings(max_examples=25)
@given(
    seed=seeds,
    heads=st.integers(1, 3),
    d_out=st.integers(1, 3),
    qkv_bias=st.booleans(),
    batched=st.booleans(),
    T=st.integers(2, 5),
)
def test_wrapper_equals_batched_mha_with_stacked_weights(seed, heads, d_out, qkv_bias, batched, T):
    d_in = 3
    w = book.MultiHeadAttentionWrapper(d_in, d_out, 5, 0.0, heads, qkv_bias, rng=seed)
    m = book.MultiHeadAttention(d_in, heads * d_out, 5, 0.0, heads, qkv_bias, rng=seed + 1)
    sd = {}
    for name in ("W_query", "W_key", "W_value"):
        sd[f"{name}.weight"] = np.concatenate([getattr(h, name).weight.data for h in w.heads], axis=0)
        if qkv_bias:
            sd[f"{name}.bias"] = np.concatenate([getattr(h, name).bias.data for h in w.heads])
    sd["out_proj.weight"] = np.eye(heads * d_out)
    sd["out_proj.bias"] = np.zeros(heads * d_out)
    sd["mask"] = m.mask
    m.load_state_dict(sd)
    x = rand(seed, ((2,) if batched else ()) + (T, d_in))
    o1, g1, p1 = run(w, (x,))
    o2, g2, p2 = run(m, (x,))
    close(o1, o2)
    close(g1[0], g2[0])
    for name in ("W_query", "W_key", "W_value"):
        close(np.concatenate([p1[f"heads.{i}.{name}.weight"] for i in range(heads)]), p2[f"{name}.weight"])
        if qkv_bias:
            close(np.concatenate([p1[f"heads.{i}.{name}.bias"] for i in range(heads)]), p2[f"{name}.bias"])


# ------------------------------------------------------------------------------ grouped-query


def _mha_inputs(seed, lead, lq, lk, d_in, cross):
    x = rand(seed, lead + (lq, d_in))
    if not cross:
        return (x,)
    return x, rand(seed + 1, lead + (lk, d_in)), rand(seed + 2, lead + (lk, d_in))


@settings(max_examples=25)
@given(
    seed=seeds,
    heads=st.integers(1, 3),
    hd=st.integers(1, 2),
    qkv_bias=st.booleans(),
    causal=st.booleans(),
    cross=st.booleans(),
    lead=st.sampled_from([(), (2,), (2, 1)]),
)
def test_gqa_with_all_kv_heads_equals_mha(seed, heads, hd, qkv_bias, causal, cross, lead):
    kw = dict(qkv_bias=qkv_bias, causal=causal)
    a = npattn.MultiHeadAttention(3, heads * hd, heads, num_kv_heads=heads, rng=seed, **kw)
    b = npattn.MultiHeadAttention(3, heads * hd, heads, rng=seed + 1, **kw)
    b.load_state_dict(a.state_dict())
    inputs = _mha_inputs(seed, lead, 3, 2, 3, cross)
    mask = np.random.default_rng(seed).random((3, 2 if cross else 3)) < 0.8
    oa, ga, pa = run(a, inputs, attn_mask=mask)
    ob, gb, pb = run(b, inputs, attn_mask=mask)
    close(oa, ob)
    for u, v in zip(ga, gb):
        close(u, v)
    for k in pa:
        close(pa[k], pb[k])


def _repeat_kv(w, kv, groups, hd):
    """kv head j serves query heads j*G .. j*G+G-1: repeat each head block G times."""
    blocks = w.reshape((kv, hd) + w.shape[1:])
    return np.repeat(blocks, groups, axis=0).reshape((kv * groups * hd,) + w.shape[1:])


@settings(max_examples=30)
@given(
    seed=seeds,
    kv=st.integers(1, 2),
    groups=st.integers(2, 3),
    hd=st.integers(1, 2),
    qkv_bias=st.booleans(),
    causal=st.booleans(),
    cross=st.booleans(),
    lead=st.sampled_from([(), (2,), (1, 2)]),
    need_weights=st.booleans(),
)
def test_gqa_equals_mha_with_repeated_kv_weights(seed, kv, groups, hd, qkv_bias, causal, cross, lead, need_weights):
    heads = kv * groups
    kw = dict(qkv_bias=qkv_bias, causal=causal)
    g = npattn.MultiHeadAttention(3, heads * hd, heads, num_kv_heads=kv, rng=seed, **kw)
    assert g.W_key.weight.shape == (kv * hd, 3)
    m = npattn.MultiHeadAttention(3, heads * hd, heads, rng=seed + 1, **kw)
    sd = g.state_dict()
    for name in ("W_key", "W_value"):
        sd[f"{name}.weight"] = _repeat_kv(sd[f"{name}.weight"], kv, groups, hd)
        if qkv_bias:
            sd[f"{name}.bias"] = _repeat_kv(sd[f"{name}.bias"], kv, groups, hd)
    m.load_state_dict(sd)
    inputs = _mha_inputs(seed, lead, 3, 4, 3, cross)
    kpm = np.random.default_rng(seed).random(lead + (4 if cross else 3,)) < 0.3
    fwd = dict(key_padding_mask=kpm, need_weights=need_weights)
    if need_weights:
        close(g(*inputs, **fwd)[1], m(*inputs, **fwd)[1])
    og, gg, pg = run(g, inputs, **fwd)
    om, gm, pm = run(m, inputs, **fwd)
    close(og, om)
    for u, v in zip(gg, gm):
        close(u, v)
    close(pg["W_query.weight"], pm["W_query.weight"])
    close(pg["out_proj.weight"], pm["out_proj.weight"])
    for name in ("W_key", "W_value"):
        # the shared kv head's gradient is the sum over its group's copies
        w = pm[f"{name}.weight"].reshape(kv, groups, hd, -1).sum(axis=1).reshape(kv * hd, -1)
        close(pg[f"{name}.weight"], w)
        if qkv_bias:
            close(pg[f"{name}.bias"], pm[f"{name}.bias"].reshape(kv, groups, hd).sum(axis=1).reshape(-1))


# ------------------------------------------------------------------------------ float32 vs float64


def _builders():
    """(name, factory(dtype) -> module, inputs, forward kwargs)."""
    r = np.random.default_rng(0)
    x3 = r.uniform(-1, 1, (2, 3, 4))
    ids = r.integers(0, 5, (2, 3))
    kpm = np.array([[False, False, True], [False, False, False]])
    fmask = r.uniform(-1, 1, (3, 3))
    xq, xk, xv = r.uniform(-1, 1, (2, 3, 4)), r.uniform(-1, 1, (2, 5, 3)), r.uniform(-1, 1, (2, 5, 2))
    xb = r.uniform(-1, 1, (2, 4, 3))
    return [
        ("linear", lambda dt: npattn.Linear(4, 3, rng=1, dtype=dt), (x3,), {}),
        ("layernorm", lambda dt: npattn.LayerNorm(4, dtype=dt), (x3,), {}),
        ("embedding", lambda dt: npattn.Embedding(5, 3, rng=1, dtype=dt), (ids,), {}),
        ("ffn_relu", lambda dt: npattn.FeedForward(4, 6, rng=1, dtype=dt), (x3,), {}),
        ("ffn_gelu", lambda dt: npattn.FeedForward(4, 6, activation="gelu", dropout=0.3, rng=1, dtype=dt), (x3,), {}),
        ("ffn_gelu_tanh", lambda dt: npattn.FeedForward(4, 6, activation="gelu_tanh", rng=1, dtype=dt), (x3,), {}),
        (
            "mha",
            lambda dt: npattn.MultiHeadAttention(4, 4, 2, qkv_bias=True, causal=True, dropout=0.2, rng=1, dtype=dt),
            (x3,),
            dict(key_padding_mask=kpm, attn_mask=fmask, need_weights=True),
        ),
        (
            "mha_cross_gqa",
            lambda dt: npattn.MultiHeadAttention(4, 8, 4, num_kv_heads=2, kdim=3, vdim=2, rng=1, dtype=dt),
            (xq, xk, xv),
            {},
        ),
        (
            "encoder_post",
            lambda dt: npattn.EncoderBlock(4, 2, 6, dropout=0.2, rng=1, dtype=dt),
            (x3,),
            dict(key_padding_mask=kpm),
        ),
        (
            "encoder_pre",
            lambda dt: npattn.EncoderBlock(
                4, 2, 6, activation="gelu", norm_first=True, causal=True, qkv_bias=True, dropout=0.0, rng=1, dtype=dt
            ),
            (x3,),
            {},
        ),
        ("sa_v1", lambda dt: book.SelfAttention_v1(3, 2, rng=1, dtype=dt), (xb[0],), {}),
        ("sa_v2", lambda dt: book.SelfAttention_v2(3, 2, True, rng=1, dtype=dt), (xb[0],), {}),
        ("ca", lambda dt: book.CausalAttention(3, 2, 4, 0.3, rng=1, dtype=dt), (xb,), {}),
        ("mhaw", lambda dt: book.MultiHeadAttentionWrapper(3, 2, 4, 0.3, 2, rng=1, dtype=dt), (xb,), {}),
        ("book_mha", lambda dt: book.MultiHeadAttention(3, 4, 4, 0.3, 2, True, rng=1, dtype=dt), (xb,), {}),
    ]


@pytest.mark.parametrize("name,factory,inputs,fwd", _builders(), ids=[b[0] for b in _builders()])
@pytest.mark.parametrize("input_dtype", [np.float64, np.float32])
def test_float32_close_to_float64_and_stays_float32(name, factory, inputs, fwd, input_dtype):
    m64, m32 = factory(np.float64), factory(np.float32)
    for (n, p64), (_, p32) in zip(m64.named_parameters(), m32.named_parameters()):
        assert p32.data.dtype == p32.grad.dtype == np.float32, n
        np.testing.assert_allclose(p32.data, p64.data, rtol=1e-6, atol=1e-7)  # same seed, same values
    inputs32 = tuple(x.astype(input_dtype) if x.dtype.kind == "f" else x for x in inputs)
    for m, xs in ((m64, inputs), (m32, inputs32)):  # both advance their generators alike
        raw = m(*xs, **fwd)
        if fwd.get("need_weights"):
            assert raw[1].dtype == m.W_query.weight.dtype
        m.backward(np.zeros(np.shape(raw[0] if isinstance(raw, tuple) else raw)))  # release the state
    o64, g64, p64 = run(m64, inputs, **fwd)
    o32, g32, p32 = run(m32, inputs32, **fwd)
    assert o32.dtype == np.float32
    np.testing.assert_allclose(o32, o64, atol=1e-4, rtol=0)
    for a, b in zip(g32, g64):
        if b is None:
            assert a is None
            continue
        assert a.dtype == np.float32
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)
    for k in p64:
        assert p32[k].dtype == np.float32, k
        np.testing.assert_allclose(p32[k], p64[k], atol=1e-4, rtol=0, err_msg=k)


def test_integer_input_cast_to_module_dtype():
    x = np.arange(12).reshape(2, 3, 2) % 3
    for dt in (np.float32, np.float64):
        m = npattn.MultiHeadAttention(2, 2, 1, rng=0, dtype=dt)
        y = m(x)
        assert y.dtype == dt
        close(y, m(x.astype(np.float64)), 1e-6)
        lin = npattn.Linear(2, 3, rng=0, dtype=dt)
        assert lin(x).dtype == dt


def test_to_casts_params_and_buffers():
    m = book.MultiHeadAttention(3, 4, 4, 0.0, 2, rng=0)
    x = rand(0, (2, 4, 3))
    y64 = m(x)
    m.to(np.float32)
    assert all(p.data.dtype == p.grad.dtype == np.float32 for p in m.parameters())
    assert m.mask.dtype == np.float32
    y32 = m(x)
    assert y32.dtype == np.float32
    np.testing.assert_allclose(y32, y64, atol=1e-5)


# ------------------------------------------------------------------------------ dropout


def test_dropout_module_training_and_eval():
    x = rand(0, (4, 50))
    d = npattn.Dropout(0.5, rng=3)
    assert d.training
    y = d(x)
    kept = y != 0
    assert 0.3 < kept.mean() < 0.7
    close(y[kept], 2 * x[kept])
    d.eval()
    assert not d.training
    close(d(x), x, 0)
    dy = rand(1, x.shape)
    close(d.backward(dy), dy, 0)
    d.train()
    y1, y2 = d(x), d(x)
    assert not np.array_equal(y1 != 0, y2 != 0)  # a fresh mask each call
    dy = rand(2, x.shape)
    close(d.backward(dy), dy * (y2 != 0) * 2)  # the latest forward's mask


@pytest.mark.parametrize(
    "factory,x",
    [
        (lambda: npattn.Dropout(0.4, rng=7), rand(0, (3, 4, 5))),
        (lambda: npattn.FeedForward(4, 8, dropout=0.4, rng=7), rand(0, (3, 4, 4))),
        (lambda: npattn.MultiHeadAttention(4, 4, 2, dropout=0.4, rng=7), rand(0, (3, 4, 4))),
        (lambda: npattn.EncoderBlock(4, 2, 8, dropout=0.4, rng=7), rand(0, (3, 4, 4))),
        (lambda: book.CausalAttention(4, 3, 4, 0.4, rng=7), rand(0, (3, 4, 4))),
        (lambda: book.MultiHeadAttentionWrapper(4, 3, 4, 0.4, 2, rng=7), rand(0, (3, 4, 4))),
        (lambda: book.MultiHeadAttention(4, 4, 4, 0.4, 2, rng=7), rand(0, (3, 4, 4))),
    ],
    ids=["Dropout", "FeedForward", "MHA", "EncoderBlock", "CausalAttention", "Wrapper", "BookMHA"],
)
def test_dropout_seeded_training_only(factory, x):
    a, b = factory(), factory()
    ya1, yb1 = a(x), b(x)
    close(ya1, yb1, 0)  # same seed -> same masks
    ya2, yb2 = a(x), b(x)
    close(ya2, yb2, 0)
    assert not np.allclose(ya1, ya2)  # masks advance
    a.eval()
    e1, e2 = a(x), a(x)
    close(e1, e2, 0)
    assert not np.allclose(e1, ya1)
    # eval = the same module with dropout switched off
    c = factory()
    c.eval()
    close(c(x), e1, 0)


def test_mha_gradient_uses_the_forward_dropout_mask():
    import copy

    from npattn.testing import numerical_gradient

    x = rand(0, (2, 4, 4))
    dy = rand(5, (2, 4, 4))
    m = npattn.MultiHeadAttention(4, 4, 2, dropout=0.5, rng=11)
    m(x)
    replay = copy.deepcopy(m)  # generator state right before forward #2
    state = copy.deepcopy(replay.rng.bit_generator.state)
    y2, w2 = m(x, need_weights=True)
    dx = m.backward(dy)

    def f(xx):
        replay.rng.bit_generator.state = copy.deepcopy(state)  # forward #2's mask every time
        with npattn.no_grad():  # forwards whose backward never comes keep no state
            return float(np.sum(replay(xx) * dy))

    num = numerical_gradient(f, x.copy())
    np.testing.assert_allclose(dx, num, rtol=1e-6, atol=1e-8)
    # the returned weights are the dropped-out ones: zero where dropped, scaled by 2 elsewhere
    m.eval()
    _, w_eval = m(x, need_weights=True)
    kept = w2 != 0
    assert (~kept).any() and kept.any()
    close(w2[kept], 2 * w_eval[kept])


def test_dropout_backward_uses_forward_mask_in_encoder():
    """Backward after forward #2 gives forward #2's gradient, not forward #1's."""
    x = rand(0, (2, 3, 4))
    a = npattn.EncoderBlock(4, 2, 6, dropout=0.3, rng=5)
    b = npattn.EncoderBlock(4, 2, 6, dropout=0.3, rng=5)
    a(x)
    a(x)
    b(x)  # b: advance its generators the same way, keep the same forward #2
    dy = rand(1, (2, 3, 4))
    b.zero_grad()
    b(x)
    gb = b.backward(dy)
    ga = a.backward(dy)
    close(ga, gb, 0)
    c = npattn.EncoderBlock(4, 2, 6, dropout=0.3, rng=5)
    c(x)
    gc = c.backward(dy)  # forward #1's mask: a different gradient
    assert not np.allclose(gc, ga)


@settings(max_examples=30)
@given(
    seed=seeds,
    kv=st.integers(1, 2),
    groups=st.integers(1, 3),
    hd=st.integers(1, 2),
    qkv_bias=st.booleans(),
    causal=st.booleans(),
    cross=st.booleans(),
    lead=st.sampled_from([(), (2,), (1, 2)]),
    mask=st.sampled_from(["none", "bool", "float"]),
    kpm=st.booleans(),
)
def test_memory_efficient_mha_equals_plain(seed, kv, groups, hd, qkv_bias, causal, cross, lead, mask, kpm):
    if not hasattr(npattn.functional, "memory_efficient_attention"):
        pytest.skip("memory_efficient_attention not available")
    heads = kv * groups
    kw = dict(num_kv_heads=kv, qkv_bias=qkv_bias, causal=causal)
    a = npattn.MultiHeadAttention(3, heads * hd, heads, rng=seed, **kw)
    b = npattn.MultiHeadAttention(3, heads * hd, heads, memory_efficient=True, rng=seed, **kw)
    b.load_state_dict(a.state_dict())
    lk = 4 if cross else 3
    inputs = _mha_inputs(seed, lead, 3, lk, 3, cross)
    rng = np.random.default_rng(seed)
    fwd = {}
    if mask == "bool":
        fwd["attn_mask"] = rng.random((3, lk)) < 0.6  # fully masked rows possible
    elif mask == "float":
        fwd["attn_mask"] = rng.uniform(-2, 2, (3, lk))
    if kpm:
        fwd["key_padding_mask"] = rng.random(lead + (lk,)) < 0.3
    oa, ga, pa = run(a, inputs, **fwd)
    ob, gb, pb = run(b, inputs, **fwd)
    close(oa, ob, 1e-11)
    for u, v in zip(ga, gb):
        close(u, v, 1e-11)
    for k in pa:
        close(pa[k], pb[k], 1e-11)

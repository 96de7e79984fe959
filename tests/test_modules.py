"""Property tests: every module's hand-written backward (inputs and every parameter) matches
central finite differences, via ``npattn.gradcheck``, across generated configurations.

Shapes are tiny (the checker perturbs one element at a time) and everything runs in float64.
Upstream gradients are random (gradcheck draws them), sequences have >= 2 tokens.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import npattn
from npattn import book

N = 30  # examples per module-level property

seeds = st.integers(0, 2**32 - 1)
leads = st.sampled_from([(), (2,), (1, 2), (2, 1)])


def assert_ok(report):
    assert report.ok, str(report)
    assert len(report.rows) > 0


def _x(seed, shape, scale=1.0):
    return np.random.default_rng(seed).uniform(-scale, scale, shape)


# ------------------------------------------------------------------------------ basic layers


@settings(max_examples=N)
@given(lead=leads, n_in=st.integers(1, 4), n_out=st.integers(1, 4), bias=st.booleans(), seed=seeds)
def test_linear_gradcheck(lead, n_in, n_out, bias, seed):
    m = npattn.Linear(n_in, n_out, bias, rng=seed)
    rep = npattn.gradcheck(m, _x(seed, lead + (3, n_in)))
    assert_ok(rep)
    names = {r.name for r in rep.rows}
    assert names == {"input", "weight"} | ({"bias"} if bias else set())


@settings(max_examples=N)
@given(lead=leads, d=st.integers(2, 5), affine=st.booleans(), bias=st.booleans(), seed=seeds)
def test_layernorm_gradcheck(lead, d, affine, bias, seed):
    m = npattn.LayerNorm(d, elementwise_affine=affine, bias=bias)
    rng = np.random.default_rng(seed)
    if affine:  # move away from the ones/zeros start so the weight matters
        m.weight.data[...] = rng.uniform(0.5, 1.5, d) * rng.choice([-1, 1], d)
        if bias:
            m.bias.data[...] = rng.uniform(-1, 1, d)
    # rows with a variance bounded away from zero
    x = rng.standard_normal(lead + (2, d))
    x -= x.mean(-1, keepdims=True)
    x /= np.sqrt((x * x).mean(-1, keepdims=True))
    x = x * rng.uniform(0.5, 2.0, lead + (2, 1)) + rng.uniform(-1, 1, lead + (2, 1))
    rep = npattn.gradcheck(m, x)
    assert_ok(rep)
    expected = {"input"} | ({"weight"} if affine else set()) | ({"bias"} if affine and bias else set())
    assert {r.name for r in rep.rows} == expected


@settings(max_examples=N)
@given(lead=leads, p=st.sampled_from([0.0, 0.2, 0.5, 0.9, 1.0]), training=st.booleans(), seed=seeds)
def test_dropout_gradcheck(lead, p, training, seed):
    m = npattn.Dropout(p, rng=seed)
    m.train(training)
    assert_ok(npattn.gradcheck(m, _x(seed, lead + (3, 4))))


@settings(max_examples=N)
@given(lead=leads, num=st.integers(1, 5), dim=st.integers(1, 3), seed=seeds)
def test_embedding_gradcheck(lead, num, dim, seed):
    m = npattn.Embedding(num, dim, rng=seed)
    ids = np.random.default_rng(seed).integers(0, num, lead + (4,))  # repeated ids likely
    rep = npattn.gradcheck(m, ids)
    assert_ok(rep)
    assert [r.name for r in rep.rows] == ["weight"]


@settings(max_examples=N)
@given(
    lead=leads,
    d=st.integers(1, 3),
    d_ff=st.integers(1, 4),
    activation=st.sampled_from(["relu", "relu2", "xielu", "gelu", "gelu_tanh"]),
    dropout=st.sampled_from([0.0, 0.3]),
    seed=seeds,
)
def test_feedforward_gradcheck(lead, d, d_ff, activation, dropout, seed):
    m = npattn.FeedForward(d, d_ff, activation=activation, dropout=dropout, rng=seed)
    rep = npattn.gradcheck(m, _x(seed, lead + (2, d)))
    assert_ok(rep)
    names = {"input", "linear1.weight", "linear1.bias", "linear2.weight", "linear2.bias"}
    if activation == "xielu":  # its two trained numbers (beta, eps: buffers)
        names |= {"act_fn.alpha_p", "act_fn.alpha_n"}
    assert {r.name for r in rep.rows} == names


# ------------------------------------------------------------------------------ attention


@st.composite
def mha_cases(draw):
    kv = draw(st.integers(1, 2))
    groups = draw(st.integers(1, 2))
    heads = kv * groups
    hd = draw(st.integers(1, 2))
    d_in = draw(st.integers(1, 3))
    cross = draw(st.booleans())
    kdim = draw(st.integers(1, 3)) if cross else None
    vdim = draw(st.integers(1, 3)) if cross else None
    lead = draw(leads)
    lq = draw(st.integers(2, 3))
    lk = draw(st.integers(2, 4)) if cross else lq
    seed = draw(seeds)
    mask_kind = draw(st.sampled_from(["none", "bool", "float"]))
    full_mask = draw(st.booleans())
    use_kpm = draw(st.booleans())
    training = draw(st.booleans())
    kwargs = dict(
        num_kv_heads=kv if draw(st.booleans()) or kv != heads else None,
        qkv_bias=draw(st.booleans()),
        out_bias=draw(st.booleans()),
        causal=draw(st.booleans()),
        dropout=draw(st.sampled_from([0.0, 0.0, 0.3])),
        kdim=kdim,
        vdim=vdim,
        rng=seed,
    )
    rng = np.random.default_rng(seed)
    query = rng.uniform(-1, 1, lead + (lq, d_in))
    inputs = (query,)
    if cross:
        inputs += (rng.uniform(-1, 1, lead + (lk, kdim)), rng.uniform(-1, 1, lead + (lk, vdim)))
    mshape = (lead + (heads,) if full_mask else ()) + (lq, lk)
    attn_mask = None
    if mask_kind == "bool":
        attn_mask = rng.random(mshape) < 0.7  # some rows may be fully masked
    elif mask_kind == "float":
        attn_mask = rng.uniform(-2, 2, mshape)
        attn_mask[rng.random(mshape) < 0.2] = -np.inf
    kpm = (rng.random(lead + (lk,)) < 0.3) if use_kpm else None
    fwd = dict(attn_mask=attn_mask, key_padding_mask=kpm, need_weights=draw(st.booleans()))
    return (d_in, heads * hd, heads), kwargs, inputs, fwd, training


@settings(max_examples=50)
@given(case=mha_cases())
def test_mha_gradcheck(case):
    args, kwargs, inputs, fwd, training = case
    m = npattn.MultiHeadAttention(*args, **kwargs)
    m.train(training)
    rep = npattn.gradcheck(m, *inputs, **fwd)
    assert_ok(rep)
    names = {r.name for r in rep.rows}
    assert {n for n, _ in m.named_parameters()} <= names
    assert ({"query", "key", "value"} if len(inputs) == 3 else {"input"}) <= names


def test_mha_gradcheck_not_vacuous():
    """The checker does see a wrong backward: scale one parameter gradient and it fails."""
    m = npattn.MultiHeadAttention(3, 4, 2, qkv_bias=True, rng=0)

    class Broken(npattn.MultiHeadAttention):
        def backward(self, dy):
            dx = super().backward(dy)
            self.W_key.weight.grad *= 1.01
            return dx

    b = Broken(3, 4, 2, qkv_bias=True, rng=0)
    x = _x(1, (2, 3, 3))
    assert npattn.gradcheck(m, x).ok
    rep = npattn.gradcheck(b, x)
    assert rep.failed == ["W_key.weight"]


@st.composite
def encoder_cases(draw):
    heads = draw(st.integers(1, 2))
    d_model = heads * draw(st.integers(1, 2))
    d_model = max(d_model, 2)
    if d_model % heads:
        d_model = heads * 2
    d_ff = draw(st.integers(1, 4))
    lead = draw(leads)
    L = draw(st.integers(2, 3))
    seed = draw(seeds)
    kwargs = dict(
        dropout=draw(st.sampled_from([0.0, 0.2])),
        activation=draw(st.sampled_from(["relu", "gelu", "gelu_tanh"])),
        norm_first=draw(st.booleans()),
        causal=draw(st.booleans()),
        qkv_bias=draw(st.booleans()),
        rng=seed,
    )
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(lead + (L, d_model))
    kind = draw(st.sampled_from(["none", "bool", "float"]))
    attn_mask = None
    if kind == "bool":
        attn_mask = rng.random((L, L)) < 0.7
    elif kind == "float":
        attn_mask = rng.uniform(-1, 1, (L, L))
    kpm = (rng.random(lead + (L,)) < 0.3) if draw(st.booleans()) else None
    return (d_model, heads, d_ff), kwargs, x, dict(attn_mask=attn_mask, key_padding_mask=kpm), draw(st.booleans())


@settings(max_examples=40)
@given(case=encoder_cases())
def test_encoder_block_gradcheck(case):
    args, kwargs, x, fwd, training = case
    m = npattn.EncoderBlock(*args, **kwargs)
    m.train(training)
    rng = np.random.default_rng(0)
    for ln in (m.layernorm1, m.layernorm2):  # non-trivial affine parameters
        ln.weight.data[...] = rng.uniform(0.5, 1.5, ln.weight.shape)
        ln.bias.data[...] = rng.uniform(-0.5, 0.5, ln.bias.shape)
    rep = npattn.gradcheck(m, x, **fwd)
    assert_ok(rep)
    assert {n for n, _ in m.named_parameters()} | {"input"} == {r.name for r in rep.rows}


# ------------------------------------------------------------------------------ book classes


@st.composite
def book_cases(draw):
    d_in = draw(st.integers(1, 3))
    d_out = draw(st.integers(1, 3))
    ctx = draw(st.integers(2, 5))
    T = draw(st.integers(2, ctx))
    batched = draw(st.booleans())
    seed = draw(seeds)
    x = np.random.default_rng(seed).uniform(-1, 1, ((2,) if batched else ()) + (T, d_in))
    return d_in, d_out, ctx, x, seed, draw(st.booleans()), draw(st.sampled_from([0.0, 0.4])), draw(st.booleans())


@settings(max_examples=N)
@given(case=book_cases(), which=st.sampled_from(["v1", "v2", "ca", "mhaw", "mha"]), num_heads=st.integers(1, 2))
def test_book_gradcheck(case, which, num_heads):
    d_in, d_out, ctx, x, seed, qkv_bias, dropout, training = case
    if which == "v1":
        m = book.SelfAttention_v1(d_in, d_out, rng=seed)
    elif which == "v2":
        m = book.SelfAttention_v2(d_in, d_out, qkv_bias, rng=seed)
    elif which == "ca":
        m = book.CausalAttention(d_in, d_out, ctx, dropout, qkv_bias, rng=seed)
    elif which == "mhaw":
        m = book.MultiHeadAttentionWrapper(d_in, d_out, ctx, dropout, num_heads, qkv_bias, rng=seed)
    else:
        m = book.MultiHeadAttention(d_in, d_out * num_heads, ctx, dropout, num_heads, qkv_bias, rng=seed)
    m.train(training)
    rep = npattn.gradcheck(m, x)
    assert_ok(rep)
    assert {n for n, _ in m.named_parameters()} | {"input"} == {r.name for r in rep.rows}


@settings(max_examples=30)
@given(case=mha_cases())
def test_mha_memory_efficient_gradcheck(case):
    if not hasattr(npattn.functional, "memory_efficient_attention"):
        pytest.skip("memory_efficient_attention not available")
    args, kwargs, inputs, fwd, training = case
    kwargs = dict(kwargs, dropout=0.0, memory_efficient=True)
    fwd = dict(fwd, need_weights=False)
    m = npattn.MultiHeadAttention(*args, **kwargs)
    m.train(training)
    assert_ok(npattn.gradcheck(m, *inputs, **fwd))

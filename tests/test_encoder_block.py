"""EncoderBlock: every input validated before any sublayer runs, ``bias=False``,
``from_torch_state_dict`` and unbatched input (torch parity in float64)."""

import copy

import numpy as np
import pytest
from _fd import fd_gradients
from _oracles import rel_err
from hypothesis import given, settings
from hypothesis import strategies as st

import npattn

seeds = st.integers(0, 2**31 - 1)


def assert_same(a, b, what=""):
    """float64 parity with torch: max |a - b| / max(max |b|, 1e-3) <= 1e-10."""
    b = b.detach().numpy() if hasattr(b, "detach") else np.asarray(b)
    a = np.asarray(a, dtype=np.float64)
    assert a.shape == b.shape, (what, a.shape, b.shape)
    assert np.isfinite(a).all() and np.isfinite(b).all(), what
    err = float(np.abs(a - b).max(initial=0.0) / max(np.abs(b).max(initial=0.0), 1e-3))
    assert err <= 1e-10, f"{what}: relative error {err:.3e}"


def _grads(m):
    return {n: p.grad.copy() for n, p in m.named_parameters()}


def _caches(m):
    return {n: sub._cache for n, sub in m.named_modules()}


# ------------------------------------------------------------------- a refused call changes nothing

BAD_CALLS = [
    ("key_padding_mask", dict(key_padding_mask=np.zeros((5, 3), bool)), ValueError),
    ("key_padding_mask", dict(key_padding_mask=np.zeros((2, 3), np.int64)), TypeError),
    ("attn_mask", dict(attn_mask=np.ones((4, 4), bool)), ValueError),
    ("attn_mask", dict(attn_mask=np.ones((3, 3), np.int32)), TypeError),
    ("attn_mask", dict(attn_mask=np.full((3, 3), np.nan)), ValueError),
]


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("name,kwargs,exc", BAD_CALLS)
def test_refused_forward_changes_no_state(norm_first, name, kwargs, exc):
    """forward(x1), a refused forward(x2, bad mask), backward(dy) == forward(x1), backward(dy)."""
    rng = np.random.default_rng(0)
    m = npattn.EncoderBlock(4, 2, 8, dropout=0.0, norm_first=norm_first, qkv_bias=True, rng=0)
    ref = copy.deepcopy(m)
    x1, x2 = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 3, 4))
    dy = rng.standard_normal((2, 3, 4))
    y = m(x1)
    before = _caches(m)
    with pytest.raises(exc, match=name):
        m(x2, **kwargs)
    after = _caches(m)
    assert all(before[k] is after[k] for k in before), "a sublayer's forward state changed"
    dx = m.backward(dy)
    np.testing.assert_array_equal(y, ref(x1))
    np.testing.assert_array_equal(dx, ref.backward(dy))
    g, g_ref = _grads(m), _grads(ref)
    for n in g:
        np.testing.assert_array_equal(g[n], g_ref[n], err_msg=n)


@pytest.mark.parametrize("bad", [np.ones((2, 3, 5)), np.ones((3,)), np.ones((2, 3, 4), bool), "x"])
def test_refused_input_changes_no_state(bad):
    m = npattn.EncoderBlock(4, 2, 8, dropout=0.0, norm_first=True, rng=0)
    x = np.random.default_rng(1).standard_normal((2, 3, 4))
    m(x)
    before = _caches(m)
    with pytest.raises((TypeError, ValueError), match="x"):
        m(bad)
    assert all(before[k] is after for k, after in _caches(m).items())


def test_bad_options():
    with pytest.raises(TypeError, match="bias"):
        npattn.EncoderBlock(4, 2, 8, bias=1)
    with pytest.raises(ValueError, match="qkv_bias"):
        npattn.EncoderBlock(4, 2, 8, bias=False, qkv_bias=True)
    with pytest.raises(ValueError, match="activation"):
        npattn.EncoderBlock(4, 2, 8, activation="tanh")


# ------------------------------------------------------------------- bias=False, unbatched: gradients


@pytest.mark.parametrize("norm_first", [False, True])
def test_bias_false_has_no_bias_and_gradchecks(norm_first):
    m = npattn.EncoderBlock(4, 2, 6, dropout=0.2, norm_first=norm_first, bias=False, rng=3)
    names = [n for n, _ in m.named_parameters()]
    assert not [n for n in names if n.endswith("bias")], names
    assert set(names) == {
        "mha.W_query.weight",
        "mha.W_key.weight",
        "mha.W_value.weight",
        "mha.out_proj.weight",
        "ffn.linear1.weight",
        "ffn.linear2.weight",
        "layernorm1.weight",
        "layernorm2.weight",
    }
    x = np.random.default_rng(4).standard_normal((2, 3, 4))
    mask = np.random.default_rng(5).random((3, 3)) < 0.7
    mask[:, 0] = True
    report = npattn.gradcheck(m, x, attn_mask=mask)
    assert report.ok, str(report)


def test_unbatched_equals_batch_of_one_and_fd():
    m = npattn.EncoderBlock(4, 2, 6, dropout=0.3, norm_first=True, rng=7)
    rng = np.random.default_rng(8)
    x = rng.standard_normal((3, 4))
    kpm = np.array([False, True, False])
    dy = rng.standard_normal((3, 4))
    m1, m2 = copy.deepcopy(m), copy.deepcopy(m)
    y = m1(x, key_padding_mask=kpm)
    yb = m2(x[None], key_padding_mask=kpm[None])
    np.testing.assert_allclose(y, yb[0], rtol=0, atol=1e-14)
    dx, dxb = m1.backward(dy), m2.backward(dy[None])
    np.testing.assert_allclose(dx, dxb[0], rtol=0, atol=1e-14)
    report = npattn.gradcheck(m, x, key_padding_mask=kpm)
    assert report.ok, str(report)

    gen = m.dropout1.rng  # one generator shared by every dropout of the block
    state = gen.bit_generator.state

    def f(xx):
        gen.bit_generator.state = state
        return np.sum(m(xx, key_padding_mask=kpm) * dy)

    (num,) = fd_gradients(f, [x])
    gen.bit_generator.state = state
    m(x, key_padding_mask=kpm)
    assert rel_err(m.backward(dy), num) < 1e-6


# ------------------------------------------------------------------- torch parity

torch_cases = dict(
    H=st.integers(1, 2),
    hd=st.integers(1, 3),
    d_ff=st.integers(1, 5),
    norm_first=st.booleans(),
    bias=st.booleans(),
    activation=st.sampled_from(["relu", "gelu", "gelu_tanh", "silu"]),
    L=st.integers(2, 4),
    lead=st.sampled_from([(), (1,), (2,)]),
    mask=st.sampled_from(["none", "bool", "float", "causal"]),
    kpm=st.booleans(),
    seed=seeds,
)


def _torch_encoder(E, H, d_ff, norm_first, bias, activation, seed):
    torch = pytest.importorskip("torch")
    import torch.nn.functional as TF

    act = {"relu": "relu", "gelu": "gelu", "gelu_tanh": lambda t: TF.gelu(t, approximate="tanh"), "silu": TF.silu}[
        activation
    ]
    torch.manual_seed(seed)
    tm = torch.nn.TransformerEncoderLayer(
        E, H, d_ff, dropout=0.0, activation=act, batch_first=True, norm_first=norm_first, bias=bias, dtype=torch.float64
    )
    with torch.no_grad():
        for p in tm.parameters():
            p.uniform_(-0.8, 0.8)
        tm.norm1.weight.add_(1.0)
        tm.norm2.weight.add_(1.0)
    tm.train()  # dropout 0; keeps torch off its inference fast path
    return tm


def _encoder_param_grads(tm, m):
    """npattn parameter name -> torch gradient (the packed in_proj split into q, k, v)."""
    E = tm.self_attn.embed_dim
    tp = dict(tm.named_parameters())
    out = {}
    for n, _ in m.named_parameters():
        for i, w in enumerate(("W_query", "W_key", "W_value")):
            if n == f"mha.{w}.weight":
                out[n] = tp["self_attn.in_proj_weight"].grad[i * E : (i + 1) * E]
            elif n == f"mha.{w}.bias":
                out[n] = tp["self_attn.in_proj_bias"].grad[i * E : (i + 1) * E]
        if n not in out:
            t = n.replace("mha.", "self_attn.").replace("ffn.", "").replace("layernorm", "norm")
            out[n] = tp[t].grad
    n_in_proj = sum(k.startswith("self_attn.in_proj") for k in tp)
    assert len(out) == len(tp) + 2 * n_in_proj  # every torch parameter accounted for
    return out


@settings(max_examples=30, deadline=None)
@given(**torch_cases)
def test_from_torch_state_dict_matches_torch(H, hd, d_ff, norm_first, bias, activation, L, lead, mask, kpm, seed):
    torch = pytest.importorskip("torch")
    E = max(H * hd, 2 * H)
    tm = _torch_encoder(E, H, d_ff, norm_first, bias, activation, seed)
    m = npattn.EncoderBlock.from_torch_state_dict(
        tm.state_dict(), H, dropout=0.0, activation=activation, norm_first=norm_first, causal=mask == "causal", rng=seed
    )
    assert m.dtype == np.float64
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(lead + (L, E))
    np_kw, t_kw = {}, {}
    if mask == "bool":
        allowed = rng.random((L, L)) < 0.6
        allowed[:, 0] = True
        np_kw["attn_mask"], t_kw["src_mask"] = allowed, torch.tensor(~allowed)
    elif mask == "float":
        f = rng.uniform(-2, 2, (L, L))
        np_kw["attn_mask"], t_kw["src_mask"] = f, torch.tensor(f)
    elif mask == "causal":
        t_kw["src_mask"] = torch.tensor(~np.tri(L, dtype=bool))
    if kpm:
        pad = rng.random(lead + (L,)) < 0.4
        pad[..., 0] = False
        np_kw["key_padding_mask"] = pad
        t_kw["src_key_padding_mask"] = torch.tensor(np.where(pad, -np.inf, 0.0) if mask == "float" else pad)
    dy = rng.standard_normal(x.shape)
    tx = torch.tensor(x, requires_grad=True)
    ty = tm(tx, **t_kw)
    ty.backward(torch.tensor(dy))
    y = m(x, **np_kw)
    assert_same(y, ty, "output")
    assert_same(m.backward(dy), tx.grad, "dx")
    tgrads = _encoder_param_grads(tm, m)
    for n, p in m.named_parameters():
        assert_same(p.grad, tgrads[n], n)


def test_from_torch_state_dict_keys_and_errors():
    torch = pytest.importorskip("torch")
    tm = _torch_encoder(4, 2, 6, False, True, "relu", 0)
    sd = tm.state_dict()
    m = npattn.EncoderBlock.from_torch_state_dict(sd, 2, dropout=0.0)
    np.testing.assert_array_equal(m.mha.W_key.weight.data, sd["self_attn.in_proj_weight"][4:8].numpy())
    np.testing.assert_array_equal(m.layernorm2.bias.data, sd["norm2.bias"].numpy())
    # float32 tensors build a float32 block unless dtype is given
    sd32 = {k: v.float() for k, v in sd.items()}
    assert npattn.EncoderBlock.from_torch_state_dict(sd32, 2).dtype == np.float32
    assert npattn.EncoderBlock.from_torch_state_dict(sd32, 2, dtype=np.float64).dtype == np.float64
    with pytest.raises(ValueError, match="unexpected key.*'extra.weight'"):
        npattn.EncoderBlock.from_torch_state_dict({**sd, "extra.weight": torch.zeros(3)}, 2)
    missing = dict(sd)
    del missing["linear2.weight"]
    with pytest.raises(ValueError, match="linear2.weight"):
        npattn.EncoderBlock.from_torch_state_dict(missing, 2)
    with pytest.raises(ValueError, match="num_heads"):
        npattn.EncoderBlock.from_torch_state_dict(sd, 3)
    with pytest.raises(TypeError, match="state_dict"):
        npattn.EncoderBlock.from_torch_state_dict([1, 2], 2)
    # only some of the biases: not a block torch can build
    partial = dict(sd)
    del partial["linear1.bias"]
    with pytest.raises(ValueError, match="linear1.bias"):
        npattn.EncoderBlock.from_torch_state_dict(partial, 2)
    bad = dict(sd)
    bad["linear1.weight"] = torch.zeros(6, 5)
    with pytest.raises(ValueError, match="linear1.weight"):
        npattn.EncoderBlock.from_torch_state_dict(bad, 2)


def test_from_torch_state_dict_without_bias():
    pytest.importorskip("torch")
    tm = _torch_encoder(4, 2, 6, True, False, "relu", 1)
    m = npattn.EncoderBlock.from_torch_state_dict(tm.state_dict(), 2, norm_first=True)
    assert not [n for n, _ in m.named_parameters() if n.endswith("bias")]


@settings(max_examples=30, deadline=None)
@given(
    seed=seeds,
    lead=st.sampled_from([(), (2,)]),
    L=st.integers(2, 4),
    activation=st.sampled_from(["relu", "gelu", "silu", "swiglu"]),
)
def test_property_post_norm_without_bias_is_centred(seed, lead, L, activation):
    """bias=False, post-norm: the last layer norm has no bias, so every output row has mean 0 and
    (weight 1 at start) variance var / (var + eps); with bias=True the bias shifts the mean."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(lead + (L, 4)) * 3
    for block in (
        npattn.EncoderBlock(4, 2, 5, bias=False, activation=activation, rng=seed),
        npattn.DecoderBlock(4, 2, 5, bias=False, activation=activation, rng=seed),
    ):
        args = (x,) if isinstance(block, npattn.EncoderBlock) else (x, rng.standard_normal(lead + (3, 4)))
        y = block(*args)
        np.testing.assert_allclose(y.mean(axis=-1), 0.0, atol=1e-12)
        assert (y.var(axis=-1) <= 1.0).all() and (y.var(axis=-1) > 0.5).all()
    with_bias = npattn.EncoderBlock(4, 2, 5, rng=seed)
    with_bias.layernorm2.bias.data = np.full(4, 0.5)
    np.testing.assert_allclose(with_bias(x).mean(axis=-1), 0.5, atol=1e-12)

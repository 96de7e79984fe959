"""Parity with PyTorch (an oracle only): outputs, input gradients and parameter gradients of
every module equal torch's in float64 to a relative error of 1e-10.

* book classes against the reference classes in ``tests/book/chapter3_torch.py`` (random
  weights from ``torch.manual_seed``, loaded through identical state-dict keys);
* ``MultiHeadAttention.from_torch_state_dict`` against ``torch.nn.MultiheadAttention``;
* ``EncoderBlock`` against ``torch.nn.TransformerEncoderLayer``;
* Linear / LayerNorm / Embedding / FeedForward against their torch equivalents.
"""

import importlib.util
import os

import numpy as np
import pytest
from _oracles import rel_err
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
import torch.nn.functional as TF  # noqa: E402

import npattn  # noqa: E402
from npattn import book  # noqa: E402

_spec = importlib.util.spec_from_file_location(
    "chapter3_torch", os.path.join(os.path.dirname(__file__), "book", "chapter3_torch.py")
)
ref = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ref)

RTOL = 1e-10
seeds = st.integers(0, 2**31 - 1)


def assert_same(a, b, what=""):
    # floor 1e-3: a gradient that is exactly 0 in theory (e.g. a key bias, which softmax ignores)
    # comes out as rounding noise ~1e-17 in both; compare it absolutely (1e-13)
    err = rel_err(a, b, floor=1e-3, relative_to="max_b")
    assert err <= RTOL, f"{what}: relative error {err:.3e}"


def leaf(a):
    return torch.tensor(a, dtype=torch.float64, requires_grad=True)


def as_tuple(g):
    return g if isinstance(g, tuple) else (g,)


def compare_module(npm, tm, inputs, dy, t_inputs=None, t_call=None, name_map=None, **fwd):
    """Run both, compare out, input grads and every parameter grad (by name)."""
    ts = [leaf(x) for x in inputs] if t_inputs is None else t_inputs
    t_out = tm(*ts) if t_call is None else t_call(*ts)
    t_out = t_out[0] if isinstance(t_out, tuple) else t_out
    t_out.backward(torch.tensor(dy))
    npm.zero_grad()
    out = npm(*inputs, **fwd)
    out = out[0] if isinstance(out, tuple) else out
    assert_same(out, t_out, "output")
    grads = as_tuple(npm.backward(dy))
    for i, (g, t) in enumerate(zip(grads, ts)):
        if t.requires_grad:
            assert_same(g, t.grad, f"input grad {i}")
    tparams = dict(tm.named_parameters())
    name_map = name_map or {}
    for n, p in npm.named_parameters():
        tg = name_map[n](tparams) if n in name_map else tparams[n].grad
        assert_same(p.grad, tg, n)
    return out


# ------------------------------------------------------------------------------ book classes

BOOK_CLASSES = [
    "SelfAttention_v1",
    "SelfAttention_v2",
    "CausalAttention",
    "MultiHeadAttentionWrapper",
    "MultiHeadAttention",
]


def _book_pair(cls, d_in, d_out, ctx, heads, qkv_bias, seed):
    torch.manual_seed(seed)
    if cls == "SelfAttention_v1":
        args = (d_in, d_out)
    elif cls == "SelfAttention_v2":
        args = (d_in, d_out, qkv_bias)
    elif cls == "CausalAttention":
        args = (d_in, d_out, ctx, 0.0, qkv_bias)
    elif cls == "MultiHeadAttentionWrapper":
        args = (d_in, d_out, ctx, 0.0, heads, qkv_bias)
    else:
        args = (d_in, d_out * heads, ctx, 0.0, heads, qkv_bias)
    tm = getattr(ref, cls)(*args).double()
    if cls != "SelfAttention_v1":  # default init leaves zero-ish biases: make every tensor random
        with torch.no_grad():
            for p in tm.parameters():
                p.uniform_(-1, 1)
    npm = getattr(book, cls)(*args, rng=seed)
    sd = tm.state_dict()
    assert list(sd) == list(npm.state_dict()), "state-dict keys must be identical (mask included)"
    npm.load_state_dict(sd)
    return npm, tm


@settings(max_examples=40)
@given(
    cls=st.sampled_from(BOOK_CLASSES),
    d_in=st.integers(1, 4),
    d_out=st.integers(1, 3),
    heads=st.integers(1, 3),
    qkv_bias=st.booleans(),
    T=st.integers(2, 5),
    b=st.integers(1, 2),
    training=st.booleans(),
    seed=seeds,
)
def test_book_classes_match_torch(cls, d_in, d_out, heads, qkv_bias, T, b, training, seed):
    npm, tm = _book_pair(cls, d_in, d_out, 6, heads, qkv_bias, seed)
    npm.train(training)
    tm.train(training)  # dropout 0.0: training mode must change nothing
    rng = np.random.default_rng(seed)
    shape = (T, d_in) if cls.startswith("SelfAttention") else (b, T, d_in)
    x = rng.uniform(-1, 1, shape)
    out_shape = tuple(tm(torch.tensor(x)).shape)
    dy = rng.standard_normal(out_shape)
    compare_module(npm, tm, (x,), dy)


def test_book_mha_state_dict_round_trips_into_torch():
    npm = book.MultiHeadAttention(3, 4, 5, 0.0, 2, qkv_bias=True, rng=3)
    tm = ref.MultiHeadAttention(3, 4, 5, 0.0, 2, qkv_bias=True).double()
    tm.load_state_dict({k: torch.tensor(v) for k, v in npm.state_dict().items()})
    x = np.random.default_rng(0).uniform(-1, 1, (2, 5, 3))
    assert_same(npm(x), tm(torch.tensor(x)), "output")


# ------------------------------------------------------------------------------ torch.nn.MultiheadAttention


def _torch_mha(E, H, seed, bias=True, kdim=None, vdim=None):
    torch.manual_seed(seed)
    tm = torch.nn.MultiheadAttention(E, H, bias=bias, kdim=kdim, vdim=vdim, batch_first=True, dtype=torch.float64)
    with torch.no_grad():
        for p in tm.parameters():  # torch initialises the biases to 0
            p.uniform_(-0.7, 0.7)
    return tm


def _mha_name_map(E, packed):
    """npattn parameter -> torch gradient."""
    if packed:
        m = {
            "W_query.weight": lambda t: t["in_proj_weight"].grad[:E],
            "W_key.weight": lambda t: t["in_proj_weight"].grad[E : 2 * E],
            "W_value.weight": lambda t: t["in_proj_weight"].grad[2 * E :],
        }
    else:
        m = {
            "W_query.weight": lambda t: t["q_proj_weight"].grad,
            "W_key.weight": lambda t: t["k_proj_weight"].grad,
            "W_value.weight": lambda t: t["v_proj_weight"].grad,
        }
    m.update(
        {
            "W_query.bias": lambda t: t["in_proj_bias"].grad[:E],
            "W_key.bias": lambda t: t["in_proj_bias"].grad[E : 2 * E],
            "W_value.bias": lambda t: t["in_proj_bias"].grad[2 * E :],
        }
    )
    return m


@st.composite
def torch_mha_cases(draw):
    H = draw(st.integers(1, 3))
    E = H * draw(st.integers(1, 2))
    layout = draw(st.sampled_from(["self", "cross_packed", "cross_separate"]))
    b = draw(st.integers(1, 3))
    lq = draw(st.integers(2, 4))
    lk = lq if layout == "self" else draw(st.integers(2, 4))
    kdim = draw(st.integers(1, 4)) if layout == "cross_separate" else None
    vdim = draw(st.integers(1, 4)) if layout == "cross_separate" else None
    mask = draw(st.sampled_from(["none", "bool2d", "bool3d", "float2d", "float3d", "causal"]))
    return dict(
        H=H,
        E=E,
        layout=layout,
        b=b,
        lq=lq,
        lk=lk,
        kdim=kdim,
        vdim=vdim,
        mask=mask,
        kpm=draw(st.booleans()),
        bias=draw(st.booleans()),
        need_weights=draw(st.booleans()),
        seed=draw(seeds),
    )


# a float attn_mask beside a bool key_padding_mask is one of the drawn cases (npattn takes both; torch
# still does, and warns that it may stop)
@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask and attn_mask:UserWarning")
@settings(max_examples=60)
@given(case=torch_mha_cases())
def test_mha_from_torch_state_dict_matches_torch(case):
    c = case
    H, E, b, lq, lk = c["H"], c["E"], c["b"], c["lq"], c["lk"]
    tm = _torch_mha(E, H, c["seed"], c["bias"], c["kdim"], c["vdim"])
    m = npattn.MultiHeadAttention.from_torch_state_dict(tm.state_dict(), H)
    assert m.dtype == np.float64 and m.num_heads == H
    rng = np.random.default_rng(c["seed"])
    q = rng.uniform(-1, 1, (b, lq, E))
    if c["layout"] == "self":
        inputs = (q,)
    else:
        inputs = (q, rng.uniform(-1, 1, (b, lk, c["kdim"] or E)), rng.uniform(-1, 1, (b, lk, c["vdim"] or E)))
    # masks: avoid fully masked rows (torch gives NaN there, see below); key 0 always visible
    np_kw, t_kw = {}, {}
    if c["mask"] in ("bool2d", "bool3d"):
        shape = (lq, lk) if c["mask"] == "bool2d" else (b * H, lq, lk)
        allowed = rng.random(shape) < 0.6
        allowed[..., 0] = True
        np_kw["attn_mask"] = allowed
        t_kw["attn_mask"] = torch.tensor(~allowed)  # torch's nn.MultiheadAttention: True = masked
    elif c["mask"] in ("float2d", "float3d"):
        shape = (lq, lk) if c["mask"] == "float2d" else (b * H, lq, lk)
        f = rng.uniform(-2, 2, shape)
        np_kw["attn_mask"] = f
        t_kw["attn_mask"] = torch.tensor(f)
    elif c["mask"] == "causal":
        m = npattn.MultiHeadAttention.from_torch_state_dict(tm.state_dict(), H, causal=True)
        t_kw["attn_mask"] = torch.tensor(~np.tri(lq, lk, dtype=bool))
    if c["kpm"]:
        pad = rng.random((b, lk)) < 0.4
        pad[:, 0] = False
        np_kw["key_padding_mask"] = pad
        t_kw["key_padding_mask"] = torch.tensor(pad)
    ts = [leaf(x) for x in inputs]
    tq, tk, tv = (ts * 3) if len(ts) == 1 else ts
    t_out, t_w = tm(tq, tk, tv, need_weights=True, average_attn_weights=False, **t_kw)
    out, w = m(*inputs, need_weights=True, **np_kw)
    assert_same(w, t_w, "per-head weights")
    assert w.shape == (b, H, lq, lk)
    dy = rng.standard_normal(t_out.shape)
    t_out.backward(torch.tensor(dy))
    m.zero_grad()
    out = m(*inputs, need_weights=c["need_weights"], **np_kw)
    out = out[0] if isinstance(out, tuple) else out
    assert_same(out, t_out, "output")
    grads = as_tuple(m.backward(dy))
    assert len(grads) == len(ts)
    for i, (g, t) in enumerate(zip(grads, ts)):
        assert_same(g, t.grad, f"input grad {i}")
    tparams = dict(tm.named_parameters())
    nmap = _mha_name_map(E, "in_proj_weight" in tparams)
    names = [n for n, _ in m.named_parameters()]
    assert ("W_query.bias" in names) == c["bias"] and ("out_proj.bias" in names) == c["bias"]
    for n, p in m.named_parameters():
        assert_same(p.grad, nmap[n](tparams) if n in nmap else tparams[n].grad, n)


def test_mha_from_torch_state_dict_float32_and_torch_tensors():
    torch.manual_seed(0)
    tm = torch.nn.MultiheadAttention(4, 2, batch_first=True)  # float32 parameters, requires_grad
    m = npattn.MultiHeadAttention.from_torch_state_dict(tm.state_dict(), 2)
    assert m.dtype == np.float32
    x = np.random.default_rng(0).uniform(-1, 1, (2, 3, 4)).astype(np.float32)
    out = m(x)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, tm(*[torch.tensor(x)] * 3)[0].detach().numpy(), atol=1e-6)
    m64 = npattn.MultiHeadAttention.from_torch_state_dict(dict(tm.named_parameters()), 2, dtype=np.float64)
    assert m64.dtype == np.float64
    np.testing.assert_allclose(m64(x), out, atol=1e-6)


def test_mha_from_torch_state_dict_bad_input():
    with pytest.raises(ValueError, match="out_proj.weight"):
        npattn.MultiHeadAttention.from_torch_state_dict({"in_proj_weight": np.zeros((12, 4))}, 2)
    with pytest.raises(ValueError, match="in_proj_weight"):
        npattn.MultiHeadAttention.from_torch_state_dict(
            {"in_proj_weight": np.zeros((12, 3)), "out_proj.weight": np.zeros((4, 4))}, 2
        )
    with pytest.raises(ValueError, match="k_proj_weight"):
        npattn.MultiHeadAttention.from_torch_state_dict(
            {"q_proj_weight": np.zeros((4, 4)), "out_proj.weight": np.zeros((4, 4))}, 2
        )
    sd = dict(torch.nn.MultiheadAttention(4, 2, add_bias_kv=True).state_dict())
    sd["unknown"] = torch.zeros(1)
    with pytest.raises(ValueError, match="unknown"):
        npattn.MultiHeadAttention.from_torch_state_dict(sd, 2)
    with pytest.raises(ValueError, match="d_out"):
        npattn.MultiHeadAttention.from_torch_state_dict(torch.nn.MultiheadAttention(6, 2).state_dict(), 4)


def test_fully_masked_rows_npattn_zero_torch_nan():
    H, E = 2, 4
    tm = _torch_mha(E, H, 0)
    m = npattn.MultiHeadAttention.from_torch_state_dict(tm.state_dict(), H)
    x = np.random.default_rng(0).uniform(-1, 1, (2, 3, E))
    allowed = np.ones((3, 3), bool)
    allowed[1] = False  # query 1 may attend to nothing
    out, w = m(x, attn_mask=allowed, need_weights=True)
    assert np.isfinite(out).all()
    assert (w[:, :, 1] == 0).all()
    np.testing.assert_allclose(out[:, 1], np.broadcast_to(m.out_proj.bias.data, (2, E)), rtol=0, atol=1e-15)
    dx = m.backward(np.random.default_rng(1).standard_normal(out.shape))
    assert np.isfinite(dx).all()
    assert all(np.isfinite(p.grad).all() for p in m.parameters())
    # torch (documented behaviour of this version): NaN on that row; the other rows agree
    t_out, _ = tm(*[torch.tensor(x)] * 3, attn_mask=torch.tensor(~allowed))
    t_out = t_out.detach().numpy()
    assert np.isnan(t_out[:, 1]).all()
    assert_same(out[:, [0, 2]], t_out[:, [0, 2]], "unmasked rows")
    # and a fully padded batch element through key_padding_mask
    pad = np.array([[True, True, True], [False, True, False]])
    out = m(x, key_padding_mask=pad)
    np.testing.assert_allclose(out[0], np.broadcast_to(m.out_proj.bias.data, (3, E)), rtol=0, atol=1e-15)
    t_out, _ = tm(*[torch.tensor(x)] * 3, key_padding_mask=torch.tensor(pad))
    assert np.isnan(t_out[0].detach().numpy()).all()
    assert_same(out[1], t_out[1], "unpadded batch element")


@settings(max_examples=20)
@given(
    kv=st.integers(1, 2),
    groups=st.integers(1, 3),
    hd=st.integers(1, 2),
    lq=st.integers(2, 4),
    lk=st.integers(2, 4),
    causal=st.booleans(),
    seed=seeds,
)
def test_gqa_matches_torch_sdpa_enable_gqa(kv, groups, hd, lq, lk, causal, seed):
    H = kv * groups
    m = npattn.MultiHeadAttention(3, H * hd, H, num_kv_heads=kv, qkv_bias=True, causal=causal, rng=seed)
    rng = np.random.default_rng(seed)
    xq, xk, xv = rng.uniform(-1, 1, (2, lq, 3)), rng.uniform(-1, 1, (2, lk, 3)), rng.uniform(-1, 1, (2, lk, 3))
    P = {n: torch.tensor(p.data, requires_grad=True) for n, p in m.named_parameters()}
    tq, tk, tv = leaf(xq), leaf(xk), leaf(xv)

    def heads(t, n):
        return t.view(t.shape[0], t.shape[1], n, hd).transpose(1, 2)

    q = heads(TF.linear(tq, P["W_query.weight"], P["W_query.bias"]), H)
    k = heads(TF.linear(tk, P["W_key.weight"], P["W_key.bias"]), kv)
    v = heads(TF.linear(tv, P["W_value.weight"], P["W_value.bias"]), kv)
    ctx = TF.scaled_dot_product_attention(
        q,
        k,
        v,
        is_causal=False,
        enable_gqa=True,
        attn_mask=torch.tensor(np.tri(lq, lk, dtype=bool)) if causal else None,
    )
    ctx = ctx.transpose(1, 2).reshape(2, lq, H * hd)
    t_out = TF.linear(ctx, P["out_proj.weight"], P["out_proj.bias"])
    dy = rng.standard_normal(t_out.shape)
    t_out.backward(torch.tensor(dy))
    out = m(xq, xk, xv)
    assert_same(out, t_out, "output")
    for g, t in zip(m.backward(dy), (tq, tk, tv)):
        assert_same(g, t.grad, "input grad")
    for n, p in m.named_parameters():
        assert_same(p.grad, P[n].grad, n)


# ------------------------------------------------------------------------------ EncoderBlock

ENC_MAP = {
    "mha.out_proj.weight": "self_attn.out_proj.weight",
    "mha.out_proj.bias": "self_attn.out_proj.bias",
    "ffn.linear1.weight": "linear1.weight",
    "ffn.linear1.bias": "linear1.bias",
    "ffn.linear2.weight": "linear2.weight",
    "ffn.linear2.bias": "linear2.bias",
    "layernorm1.weight": "norm1.weight",
    "layernorm1.bias": "norm1.bias",
    "layernorm2.weight": "norm2.weight",
    "layernorm2.bias": "norm2.bias",
}


def _encoder_state(tm, E):
    sd = {k: v.detach().numpy() for k, v in tm.state_dict().items()}
    out = {mine: sd[theirs] for mine, theirs in ENC_MAP.items()}
    for i, n in enumerate(("W_query", "W_key", "W_value")):
        out[f"mha.{n}.weight"] = sd["self_attn.in_proj_weight"][i * E : (i + 1) * E]
        out[f"mha.{n}.bias"] = sd["self_attn.in_proj_bias"][i * E : (i + 1) * E]
    return out


def _encoder_grad_map(E):
    m = {mine: (lambda t, th=theirs: t[th].grad) for mine, theirs in ENC_MAP.items()}
    for i, n in enumerate(("W_query", "W_key", "W_value")):
        m[f"mha.{n}.weight"] = lambda t, i=i: t["self_attn.in_proj_weight"].grad[i * E : (i + 1) * E]
        m[f"mha.{n}.bias"] = lambda t, i=i: t["self_attn.in_proj_bias"].grad[i * E : (i + 1) * E]
    return m


@settings(max_examples=30)
@given(
    H=st.integers(1, 2),
    hd=st.integers(1, 3),
    d_ff=st.integers(1, 5),
    norm_first=st.booleans(),
    activation=st.sampled_from(["relu", "gelu", "gelu_tanh"]),
    L=st.integers(2, 4),
    b=st.integers(1, 2),
    mask=st.sampled_from(["none", "bool", "float", "causal"]),
    kpm=st.booleans(),
    seed=seeds,
)
def test_encoder_block_matches_torch(H, hd, d_ff, norm_first, activation, L, b, mask, kpm, seed):
    E = H * hd
    if E == 1:  # layer norm over one feature is constant: nothing to compare
        E, hd = 2 * H, 2
    act = {"relu": "relu", "gelu": "gelu", "gelu_tanh": lambda t: TF.gelu(t, approximate="tanh")}[activation]
    torch.manual_seed(seed)
    tm = torch.nn.TransformerEncoderLayer(
        E, H, d_ff, dropout=0.0, activation=act, batch_first=True, norm_first=norm_first, dtype=torch.float64
    )
    with torch.no_grad():
        for p in tm.parameters():
            p.uniform_(-0.8, 0.8)
        tm.norm1.weight.add_(1.0)
        tm.norm2.weight.add_(1.0)
    tm.train()  # dropout 0; also keeps torch off its inference fast path
    m = npattn.EncoderBlock(
        E,
        H,
        d_ff,
        dropout=0.0,
        activation=activation,
        norm_first=norm_first,
        causal=mask == "causal",
        qkv_bias=True,
        rng=seed,
    )
    m.load_state_dict(_encoder_state(tm, E))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((b, L, E))
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
        pad = rng.random((b, L)) < 0.4
        pad[:, 0] = False
        np_kw["key_padding_mask"] = pad
        # torch wants both masks of one kind: give it the padding as float when src_mask is float
        t_kw["src_key_padding_mask"] = torch.tensor(np.where(pad, -np.inf, 0.0) if mask == "float" else pad)
    dy = rng.standard_normal((b, L, E))
    tx = leaf(x)
    compare_module(
        m, tm, (x,), dy, t_inputs=[tx], t_call=lambda t: tm(t, **t_kw), name_map=_encoder_grad_map(E), **np_kw
    )


# ------------------------------------------------------------------------------ basic layers


@settings(max_examples=25)
@given(
    n_in=st.integers(1, 4),
    n_out=st.integers(1, 4),
    bias=st.booleans(),
    lead=st.sampled_from([(), (3,), (2, 3)]),
    seed=seeds,
)
def test_linear_matches_torch(n_in, n_out, bias, lead, seed):
    torch.manual_seed(seed)
    tm = torch.nn.Linear(n_in, n_out, bias=bias, dtype=torch.float64)
    m = npattn.Linear(n_in, n_out, bias, rng=seed)
    m.load_state_dict(tm.state_dict())
    rng = np.random.default_rng(seed)
    compare_module(m, tm, (rng.standard_normal(lead + (n_in,)),), rng.standard_normal(lead + (n_out,)))


@settings(max_examples=25)
@given(
    d=st.integers(2, 5),
    affine=st.booleans(),
    bias=st.booleans(),
    eps=st.sampled_from([1e-5, 1e-3, 0.1]),
    lead=st.sampled_from([(3,), (2, 3)]),
    seed=seeds,
)
def test_layernorm_matches_torch(d, affine, bias, eps, lead, seed):
    tm = torch.nn.LayerNorm(d, eps=eps, elementwise_affine=affine, bias=bias, dtype=torch.float64)
    with torch.no_grad():
        for p in tm.parameters():
            p.uniform_(-1.5, 1.5)
    m = npattn.LayerNorm(d, eps=eps, elementwise_affine=affine, bias=bias)
    m.load_state_dict(tm.state_dict())
    rng = np.random.default_rng(seed)
    compare_module(m, tm, (rng.standard_normal(lead + (d,)) * 2 + 1,), rng.standard_normal(lead + (d,)))


@settings(max_examples=20)
@given(num=st.integers(1, 6), dim=st.integers(1, 3), lead=st.sampled_from([(4,), (2, 3)]), seed=seeds)
def test_embedding_matches_torch(num, dim, lead, seed):
    torch.manual_seed(seed)
    tm = torch.nn.Embedding(num, dim, dtype=torch.float64)
    m = npattn.Embedding(num, dim, rng=seed)
    m.load_state_dict(tm.state_dict())
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, num, lead)
    compare_module(m, tm, (ids,), rng.standard_normal(lead + (dim,)), t_inputs=[torch.tensor(ids)])


@settings(max_examples=25)
@given(
    d=st.integers(1, 4), d_ff=st.integers(1, 5), activation=st.sampled_from(["relu", "gelu", "gelu_tanh"]), seed=seeds
)
def test_feedforward_matches_torch(d, d_ff, activation, seed):
    torch.manual_seed(seed)
    act = {"relu": torch.nn.ReLU(), "gelu": torch.nn.GELU(), "gelu_tanh": torch.nn.GELU(approximate="tanh")}
    tm = torch.nn.Sequential()
    tm.add_module("linear1", torch.nn.Linear(d, d_ff, dtype=torch.float64))
    tm.add_module("act", act[activation])
    tm.add_module("linear2", torch.nn.Linear(d_ff, d, dtype=torch.float64))
    m = npattn.FeedForward(d, d_ff, activation=activation, rng=seed)
    m.load_state_dict(tm.state_dict())
    rng = np.random.default_rng(seed)
    compare_module(m, tm, (rng.standard_normal((2, 3, d)),), rng.standard_normal((2, 3, d)))


def test_dropout_matches_torch_semantics():
    x = np.random.default_rng(0).standard_normal((4, 100))
    for p in (0.0, 1.0):
        td = torch.nn.Dropout(p)
        d = npattn.Dropout(p, rng=0)
        np.testing.assert_array_equal(d(x), td(torch.tensor(x)).numpy())
    td, d = torch.nn.Dropout(0.3).eval(), npattn.Dropout(0.3, rng=0).eval()
    np.testing.assert_array_equal(d(x), td(torch.tensor(x)).numpy())
    d.train()
    y = d(x)
    kept = y != 0
    np.testing.assert_allclose(y[kept], x[kept] / 0.7, rtol=1e-15)  # torch's inverted scaling

"""DecoderBlock: torch parity (outputs, dx, dmemory, every parameter gradient; post- and pre-norm,
masks, bias=False), finite differences with masks and dropout, refused input changes nothing."""

import copy

import numpy as np
import pytest
from _fd import fd_gradients
from _oracles import rel_err
from hypothesis import given, settings
from hypothesis import strategies as st

import npattn
from npattn import DecoderBlock

seeds = st.integers(0, 2**31 - 1)


def assert_same(a, b, what=""):
    """float64 parity with torch: max |a - b| / max(max |b|, 1e-3) <= 1e-10."""
    b = b.detach().numpy() if hasattr(b, "detach") else np.asarray(b)
    a = np.asarray(a, dtype=np.float64)
    assert a.shape == b.shape, (what, a.shape, b.shape)
    assert np.isfinite(a).all() and np.isfinite(b).all(), what
    err = float(np.abs(a - b).max(initial=0.0) / max(np.abs(b).max(initial=0.0), 1e-3))
    assert err <= 1e-10, f"{what}: relative error {err:.3e}"


def _torch_decoder(E, H, d_ff, norm_first, bias, activation, seed):
    torch = pytest.importorskip("torch")
    import torch.nn.functional as TF

    act = {"relu": "relu", "gelu": "gelu", "gelu_tanh": lambda t: TF.gelu(t, approximate="tanh"), "silu": TF.silu}[
        activation
    ]
    torch.manual_seed(seed)
    tm = torch.nn.TransformerDecoderLayer(
        E, H, d_ff, dropout=0.0, activation=act, batch_first=True, norm_first=norm_first, bias=bias, dtype=torch.float64
    )
    with torch.no_grad():
        for n, p in tm.named_parameters():
            p.uniform_(-0.8, 0.8)
            if n.startswith("norm") and n.endswith("weight"):
                p.add_(1.0)
    tm.train()  # dropout 0; keeps torch off its inference fast path
    return tm


def _torch_grad(tp, name, E):
    """The torch gradient of npattn parameter ``name`` (q, k, v split out of the packed in_proj)."""
    head, rest = name.split(".", 1)
    if head in ("self_attn", "cross_attn"):
        th = "self_attn" if head == "self_attn" else "multihead_attn"
        for i, w in enumerate(("W_query", "W_key", "W_value")):
            if rest.startswith(w):
                kind = rest.split(".")[1]
                return tp[f"{th}.in_proj_{kind}"].grad[i * E : (i + 1) * E]
        return tp[f"{th}.{rest}"].grad
    if head == "ffn":
        return tp[rest].grad
    return tp[name.replace("layernorm", "norm")].grad


def _mask(kind, rng, L, S, torch):
    """(npattn mask, torch mask) of one kind; bool masks keep column 0 visible (no empty rows)."""
    if kind == "bool":
        allowed = rng.random((L, S)) < 0.6
        allowed[:, 0] = True
        return allowed, torch.tensor(~allowed)
    if kind == "float":
        f = rng.uniform(-2, 2, (L, S))
        return f, torch.tensor(f)
    return None, None


def _padding(rng, shape, float_form, torch):
    pad = rng.random(shape) < 0.4
    pad[..., 0] = False
    return pad, torch.tensor(np.where(pad, -np.inf, 0.0) if float_form else pad)


@settings(max_examples=40, deadline=None)
@given(
    H=st.integers(1, 2),
    hd=st.integers(1, 3),
    d_ff=st.integers(1, 5),
    norm_first=st.booleans(),
    bias=st.booleans(),
    activation=st.sampled_from(["relu", "gelu", "gelu_tanh", "silu"]),
    L=st.integers(2, 4),
    S=st.integers(1, 4),
    lead=st.sampled_from([(), (1,), (2,)]),
    tgt=st.sampled_from(["none", "bool", "float", "causal", "causal_flag"]),
    mem=st.sampled_from(["none", "bool", "float"]),
    tkpm=st.booleans(),
    mkpm=st.booleans(),
    seed=seeds,
)
def test_matches_torch(H, hd, d_ff, norm_first, bias, activation, L, S, lead, tgt, mem, tkpm, mkpm, seed):
    torch = pytest.importorskip("torch")
    E = max(H * hd, 2 * H)  # layer norm over one feature is constant
    tm = _torch_decoder(E, H, d_ff, norm_first, bias, activation, seed)
    m = DecoderBlock.from_torch_state_dict(
        tm.state_dict(),
        H,
        dropout=0.0,
        activation=activation,
        norm_first=norm_first,
        causal=tgt == "causal_flag",
        rng=seed,
    )
    rng = np.random.default_rng(seed)
    x, memory = rng.standard_normal(lead + (L, E)), rng.standard_normal(lead + (S, E))
    np_kw, t_kw = {}, {}
    if tgt in ("causal", "causal_flag"):
        if tgt == "causal":
            np_kw["tgt_mask"] = np.tri(L, dtype=bool)
        t_kw["tgt_mask"] = torch.tensor(~np.tri(L, dtype=bool))
    else:
        np_kw["tgt_mask"], t_kw["tgt_mask"] = _mask(tgt, rng, L, L, torch)
    np_kw["memory_mask"], t_kw["memory_mask"] = _mask(mem, rng, L, S, torch)
    if tkpm:
        np_kw["tgt_key_padding_mask"], t_kw["tgt_key_padding_mask"] = _padding(rng, lead + (L,), tgt == "float", torch)
    if mkpm:
        np_kw["memory_key_padding_mask"], t_kw["memory_key_padding_mask"] = _padding(
            rng, lead + (S,), mem == "float", torch
        )
    dy = rng.standard_normal(x.shape)
    tx, tmem = torch.tensor(x, requires_grad=True), torch.tensor(memory, requires_grad=True)
    ty = tm(tx, tmem, **t_kw)
    ty.backward(torch.tensor(dy))
    y = m(x, memory, **np_kw)
    assert y.shape == x.shape
    assert_same(y, ty, "output")
    dx, dmem = m.backward(dy)
    assert_same(dx, tx.grad, "dx")
    assert_same(dmem, tmem.grad, "dmemory")
    tp = dict(tm.named_parameters())
    names = [n for n, _ in m.named_parameters()]
    assert len(names) == len(tp) + 4 * sum(k.endswith("in_proj_weight") or k.endswith("in_proj_bias") for k in tp) // 2
    for n, p in m.named_parameters():
        assert_same(p.grad, _torch_grad(tp, n, E), n)


def test_keys():
    m = DecoderBlock(4, 2, 6, rng=0)
    names = [n for n, _ in m.named_parameters()]
    for att in ("self_attn", "cross_attn"):
        for w in ("W_query", "W_key", "W_value", "out_proj"):
            assert f"{att}.{w}.weight" in names and f"{att}.{w}.bias" in names
    assert names[-6:] == [
        "layernorm1.weight",
        "layernorm1.bias",
        "layernorm2.weight",
        "layernorm2.bias",
        "layernorm3.weight",
        "layernorm3.bias",
    ]
    assert {"ffn.linear1.weight", "ffn.linear1.bias", "ffn.linear2.weight", "ffn.linear2.bias"} <= set(names)
    assert len(names) == 16 + 4 + 6
    nb = DecoderBlock(4, 2, 6, bias=False, rng=0)
    assert [n for n, _ in nb.named_parameters() if "bias" in n] == []
    assert len(list(nb.parameters())) == 8 + 2 + 3
    sw = DecoderBlock(4, 2, 6, activation="swiglu", rng=0)
    assert sw.ffn.linear3.weight.shape == (6, 4)


# ------------------------------------------------------------------- finite differences


def _inputs(seed, lead=(2,), L=3, S=4, E=4):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(lead + (L, E)), rng.standard_normal(lead + (S, E)), rng


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_gradcheck_with_masks_and_dropout(norm_first, bias):
    x, memory, rng = _inputs(1)
    m = DecoderBlock(4, 2, 5, dropout=0.25, norm_first=norm_first, bias=bias, causal=True, rng=3)
    mem_mask = rng.random((3, 4)) < 0.7
    mem_mask[:, 0] = True
    tgt_kpm = np.array([[False, False, True], [False, True, False]])
    mem_kpm = rng.uniform(-1.0, 0.0, (2, 4))  # float padding: added to the scores
    kw = dict(memory_mask=mem_mask, tgt_key_padding_mask=tgt_kpm, memory_key_padding_mask=mem_kpm)
    report = npattn.gradcheck(m, x, memory, **kw)
    assert report.ok, str(report)
    assert {"x", "memory"} <= {r.name for r in report.rows}


def test_independent_finite_differences_with_dropout():
    """dx and dmemory against tests/_fd.py, the dropout masks fixed by restoring the rng."""
    x, memory, rng = _inputs(2, lead=())
    m = DecoderBlock(4, 2, 5, dropout=0.3, activation="swiglu", rng=4)
    tgt_mask = rng.uniform(-1, 1, (3, 3))
    gen = m.dropout1.rng  # one generator shared by every dropout of the block
    state = copy.deepcopy(gen.bit_generator.state)
    dy = rng.standard_normal(x.shape)

    def f(xx, mm):
        gen.bit_generator.state = copy.deepcopy(state)
        return np.sum(m(xx, mm, tgt_mask=tgt_mask) * dy)

    num_x, num_m = fd_gradients(f, [x, memory])
    gen.bit_generator.state = copy.deepcopy(state)
    m(x, memory, tgt_mask=tgt_mask)
    dx, dmem = m.backward(dy)
    assert rel_err(dx, num_x) < 1e-6
    assert rel_err(dmem, num_m) < 1e-6
    assert np.abs(num_m).max() > 1e-3  # memory really reaches the output


def test_unbatched_equals_batch_of_one():
    x, memory, rng = _inputs(5, lead=())
    m = DecoderBlock(4, 2, 5, dropout=0.0, norm_first=True, rng=6)
    tkpm, mkpm = np.array([False, True, False]), np.array([False, False, True, False])
    dy = rng.standard_normal(x.shape)
    a, b = copy.deepcopy(m), copy.deepcopy(m)
    y = a(x, memory, tgt_key_padding_mask=tkpm, memory_key_padding_mask=mkpm)
    yb = b(x[None], memory[None], tgt_key_padding_mask=tkpm[None], memory_key_padding_mask=mkpm[None])
    np.testing.assert_allclose(y, yb[0], rtol=0, atol=1e-14)
    (dx, dm), (dxb, dmb) = a.backward(dy), b.backward(dy[None])
    np.testing.assert_allclose(dx, dxb[0], rtol=0, atol=1e-14)
    np.testing.assert_allclose(dm, dmb[0], rtol=0, atol=1e-14)


def test_causal_flag_equals_causal_mask_and_eval_is_deterministic():
    x, memory, _ = _inputs(7)
    m = DecoderBlock(4, 2, 5, dropout=0.5, causal=True, rng=8)
    ref = DecoderBlock(4, 2, 5, dropout=0.5, rng=8)
    m.eval()
    ref.eval()
    np.testing.assert_array_equal(m(x, memory), ref(x, memory, tgt_mask=np.tri(3, dtype=bool)))
    np.testing.assert_array_equal(m(x, memory), m(x, memory))


def test_float32_stays_float32():
    x, memory, rng = _inputs(9)
    m = DecoderBlock(4, 2, 5, dropout=0.1, rng=0, dtype=np.float32)
    y = m(x.astype(np.float32), memory)
    assert y.dtype == np.float32
    dx, dm = m.backward(rng.standard_normal(y.shape))
    assert dx.dtype == dm.dtype == np.float32
    assert all(p.grad.dtype == np.float32 for p in m.parameters())


# ------------------------------------------------------------------- refused input changes nothing


def _bad_calls():
    x, memory, _ = _inputs(0)
    return [
        ("x", (x[..., :3], memory), {}, ValueError),
        ("x", (x.astype(bool), memory), {}, TypeError),
        ("memory", (x, memory[..., :3]), {}, ValueError),
        ("memory", (x, memory[:1]), {}, ValueError),
        ("memory", (x, memory.astype(complex)), {}, TypeError),
        ("tgt_mask", (x, memory), dict(tgt_mask=np.ones((3, 4), bool)), ValueError),
        ("tgt_mask", (x, memory), dict(tgt_mask=np.ones((3, 3), np.int64)), TypeError),
        ("memory_mask", (x, memory), dict(memory_mask=np.ones((3, 3), bool)), ValueError),
        ("memory_mask", (x, memory), dict(memory_mask=np.full((3, 4), np.inf)), ValueError),
        ("tgt_key_padding_mask", (x, memory), dict(tgt_key_padding_mask=np.zeros((2, 4), bool)), ValueError),
        ("tgt_key_padding_mask", (x, memory), dict(tgt_key_padding_mask=np.zeros((2, 3), np.int8)), TypeError),
        ("memory_key_padding_mask", (x, memory), dict(memory_key_padding_mask=np.zeros((2, 3), bool)), ValueError),
        ("memory_key_padding_mask", (x, memory), dict(memory_key_padding_mask=np.full((2, 4), np.nan)), ValueError),
    ]


BAD = _bad_calls()


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("i", range(len(BAD)), ids=[f"{b[0]}-{j}" for j, b in enumerate(BAD)])
def test_refused_forward_changes_no_state(norm_first, i):
    name, args, kwargs, exc = BAD[i]
    x1, mem1, rng = _inputs(11)
    m = DecoderBlock(4, 2, 5, dropout=0.2, norm_first=norm_first, rng=0)
    ref = copy.deepcopy(m)
    dy = rng.standard_normal(x1.shape)
    m(x1, mem1)
    caches = {n: sub._cache for n, sub in m.named_modules()}
    rng_state = copy.deepcopy(m.dropout1.rng.bit_generator.state)
    with pytest.raises(exc, match=name):
        m(*args, **kwargs)
    assert all(caches[n] is sub._cache for n, sub in m.named_modules()), "a sublayer's state changed"
    assert m.dropout1.rng.bit_generator.state == rng_state, "a refused call drew random numbers"
    dx, dm = m.backward(dy)
    ref(x1, mem1)
    rdx, rdm = ref.backward(dy)
    np.testing.assert_array_equal(dx, rdx)
    np.testing.assert_array_equal(dm, rdm)
    for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
        np.testing.assert_array_equal(p.grad, q.grad, err_msg=n)


def test_bad_constructor_arguments_and_dy():
    with pytest.raises(ValueError, match="d_model"):
        DecoderBlock(5, 2, 4)
    with pytest.raises(TypeError, match="bias"):
        DecoderBlock(4, 2, 4, bias="no")
    with pytest.raises(TypeError, match="causal"):
        DecoderBlock(4, 2, 4, causal=None)
    with pytest.raises(ValueError, match="dropout"):
        DecoderBlock(4, 2, 4, dropout=1.5)
    with pytest.raises(ValueError, match="activation"):
        DecoderBlock(4, 2, 4, activation="tanh")
    with pytest.raises(TypeError, match="dtype"):
        DecoderBlock(4, 2, 4, dtype=np.float16)
    m = DecoderBlock(4, 2, 4, rng=0)
    x, memory, _ = _inputs(0)
    with pytest.raises(RuntimeError):
        m.backward(np.ones(x.shape))
    y = m(x, memory)
    with pytest.raises(ValueError, match="dy"):
        m.backward(np.ones((2, 3, 5)))
    m.backward(np.ones_like(y))  # the state survived the refused dy
    with pytest.raises(RuntimeError):
        m.backward(np.ones_like(y))


@settings(max_examples=25, deadline=None)
@given(
    seed=seeds,
    norm_first=st.booleans(),
    which=st.sampled_from(["tgt_mask", "memory_mask", "tgt_key_padding_mask", "memory_key_padding_mask"]),
    extra=st.integers(1, 3),
)
def test_property_wrong_mask_shape_refused_without_state_change(seed, norm_first, which, extra):
    x, memory, rng = _inputs(seed)
    m = DecoderBlock(4, 2, 5, dropout=0.0, norm_first=norm_first, rng=seed)
    y = m(x, memory)
    before = {n: sub._cache for n, sub in m.named_modules()}
    shape = {
        "tgt_mask": (3, 3 + extra),
        "memory_mask": (3 + extra, 4),
        "tgt_key_padding_mask": (2, 3 + extra),
        "memory_key_padding_mask": (2 + extra, 4),
    }[which]
    with pytest.raises(ValueError, match=which):
        m(x + 1.0, memory, **{which: np.zeros(shape, bool)})
    assert all(before[n] is sub._cache for n, sub in m.named_modules())
    m.backward(rng.standard_normal(y.shape))


# ------------------------------------------------------------------- from_torch_state_dict


def test_from_torch_state_dict_keys_and_errors():
    torch = pytest.importorskip("torch")
    tm = _torch_decoder(4, 2, 6, False, True, "relu", 0)
    sd = tm.state_dict()
    m = DecoderBlock.from_torch_state_dict(sd, 2, dropout=0.0)
    np.testing.assert_array_equal(m.cross_attn.W_value.weight.data, sd["multihead_attn.in_proj_weight"][8:].numpy())
    np.testing.assert_array_equal(m.layernorm3.weight.data, sd["norm3.weight"].numpy())
    assert DecoderBlock.from_torch_state_dict({k: v.float() for k, v in sd.items()}, 2).dtype == np.float32
    with pytest.raises(TypeError, match="dtype"):
        DecoderBlock.from_torch_state_dict(sd, 2, dtype="junk")
    with pytest.raises(ValueError, match="unexpected key.*'norm4.weight'"):
        DecoderBlock.from_torch_state_dict({**sd, "norm4.weight": torch.ones(4)}, 2)
    for key in ("multihead_attn.out_proj.weight", "norm3.bias"):
        partial = dict(sd)
        del partial[key]
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            DecoderBlock.from_torch_state_dict(partial, 2)
    bad = dict(sd)
    bad["multihead_attn.in_proj_weight"] = torch.zeros(9, 4)
    with pytest.raises(ValueError, match="multihead_attn.in_proj_weight"):
        DecoderBlock.from_torch_state_dict(bad, 2)
    with pytest.raises(TypeError, match="bias"):
        DecoderBlock.from_torch_state_dict(sd, 2, bias=False)
    nob = _torch_decoder(4, 2, 6, True, False, "gelu", 1)
    m = DecoderBlock.from_torch_state_dict(nob.state_dict(), 2, norm_first=True, activation="gelu")
    assert not [n for n, _ in m.named_parameters() if n.endswith("bias")]

"""``MultiHeadAttention`` against ``torch.nn.MultiheadAttention(batch_first=True)`` in float64:
``add_bias_kv``, ``add_zero_attn``, ``average_attn_weights``, unbatched inputs, masks, and
``from_torch_state_dict`` (keys, dtype, errors).  Outputs, returned weights, input gradients and
every parameter gradient to 1e-10."""

import itertools

import numpy as np
import pytest
from _oracles import rel_err

torch = pytest.importorskip("torch")

import npattn  # noqa: E402

RTOL = 1e-10
pytestmark = pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")


def assert_same(a, b, what=""):
    err = rel_err(a, b, floor=1e-3, relative_to="max_b")
    assert err <= RTOL, f"{what}: relative error {err:.3e}"


def torch_mha(E, H, seed, *, bias=True, add_bias_kv=False, add_zero_attn=False, kdim=None, vdim=None):
    torch.manual_seed(seed)
    tm = torch.nn.MultiheadAttention(
        E,
        H,
        bias=bias,
        add_bias_kv=add_bias_kv,
        add_zero_attn=add_zero_attn,
        kdim=kdim,
        vdim=vdim,
        batch_first=True,
        dtype=torch.float64,
    )
    with torch.no_grad():
        for p in tm.parameters():  # torch initialises the biases to 0
            p.uniform_(-0.7, 0.7)
    return tm


def torch_grad(tparams, name, E):
    """The torch gradient matching npattn's parameter ``name``."""
    if name.startswith("W_"):
        i = {"W_query": 0, "W_key": 1, "W_value": 2}[name.split(".")[0]]
        if name.endswith("bias"):
            return tparams["in_proj_bias"].grad[i * E : (i + 1) * E]
        if "in_proj_weight" in tparams:
            return tparams["in_proj_weight"].grad[i * E : (i + 1) * E]
        return tparams[["q_proj_weight", "k_proj_weight", "v_proj_weight"][i]].grad
    return tparams[name].grad


def run_pair(tm, m, inputs, E, seed, np_kw=None, t_kw=None, average=False):
    np_kw, t_kw = np_kw or {}, t_kw or {}
    ts = [torch.tensor(x, requires_grad=True) for x in inputs]
    tq, tk, tv = (ts * 3) if len(ts) == 1 else ts
    t_out, t_w = tm(tq, tk, tv, need_weights=True, average_attn_weights=average, **t_kw)
    dy = np.random.default_rng(seed + 1).standard_normal(t_out.shape)
    t_out.backward(torch.tensor(dy))
    m.zero_grad()
    out, w = m(*inputs, need_weights=True, average_attn_weights=average, **np_kw)
    assert_same(out, t_out, "output")
    assert_same(w, t_w, "weights")
    grads = m.backward(dy)
    grads = grads if isinstance(grads, tuple) else (grads,)
    assert len(grads) == len(ts)
    for i, (g, t) in enumerate(zip(grads, ts)):
        assert g.shape == inputs[i].shape
        assert_same(g, t.grad, f"input grad {i}")
    tparams = dict(tm.named_parameters())
    names = [n for n, _ in m.named_parameters()]
    assert ("bias_k" in names) == ("bias_k" in tparams)
    for n, p in m.named_parameters():
        assert_same(p.grad, torch_grad(tparams, n, E), n)
    return out, w


CASES = list(itertools.product([False, True], [False, True], ["self", "cross", "cross_kdim"], [False, True]))


@pytest.mark.parametrize("bias_kv, zero_attn, layout, batched", CASES)
def test_bias_kv_zero_attn_match_torch(bias_kv, zero_attn, layout, batched):
    H, E, b, lq, lk = 2, 4, 3, 4, 5
    seed = 7 * bias_kv + 3 * zero_attn + len(layout)
    kdim = vdim = 3 if layout == "cross_kdim" else None
    tm = torch_mha(E, H, seed, add_bias_kv=bias_kv, add_zero_attn=zero_attn, kdim=kdim, vdim=vdim)
    m = npattn.MultiHeadAttention.from_torch_state_dict(tm.state_dict(), H, add_zero_attn=zero_attn)
    assert m.add_bias_kv == bias_kv and m.add_zero_attn == zero_attn
    rng = np.random.default_rng(seed)
    lead = (b,) if batched else ()
    q = rng.uniform(-1, 1, lead + (lq, E))
    if layout == "self":
        inputs, lk = (q,), lq
    else:
        inputs = (q, rng.uniform(-1, 1, lead + (lk, kdim or E)), rng.uniform(-1, 1, lead + (lk, vdim or E)))
    out, w = run_pair(tm, m, inputs, E, seed)
    assert out.shape == lead + (lq, E)
    assert w.shape == lead + (H, lq, lk + bias_kv + zero_attn)


@pytest.mark.parametrize("mask", ["bool2d", "bool3d", "float2d", "float3d"])
@pytest.mark.parametrize("kpm", [False, True])
@pytest.mark.parametrize("bias_kv, zero_attn", [(True, False), (False, True), (True, True)])
def test_masks_extended_for_extra_keys_as_torch(mask, kpm, bias_kv, zero_attn):
    H, E, b, L = 2, 4, 2, 4
    seed = 11
    tm = torch_mha(E, H, seed, add_bias_kv=bias_kv, add_zero_attn=zero_attn)
    m = npattn.MultiHeadAttention.from_torch_state_dict(tm.state_dict(), H, add_zero_attn=zero_attn)
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, (b, L, E))
    np_kw, t_kw = {}, {}
    shape = (L, L) if mask.endswith("2d") else (b * H, L, L)
    if mask.startswith("bool"):
        allowed = rng.random(shape) < 0.5
        allowed[..., 0] = True
        if kpm:
            allowed[..., 1] = False  # a fully masked row is possible once padding joins: the extra keys save it
        np_kw["attn_mask"], t_kw["attn_mask"] = allowed, torch.tensor(~allowed)
    else:
        f = rng.uniform(-2, 2, shape)
        np_kw["attn_mask"], t_kw["attn_mask"] = f, torch.tensor(f)
    if kpm:
        pad = np.zeros((b, L), bool)
        pad[:, 0] = True  # key 0 padded everywhere: with the bool mask some rows see only the extra keys
        np_kw["key_padding_mask"], t_kw["key_padding_mask"] = pad, torch.tensor(pad)
    run_pair(tm, m, (x,), E, seed, np_kw, t_kw)


@pytest.mark.parametrize("average", [False, True])
@pytest.mark.parametrize("batched", [False, True])
def test_average_attn_weights_matches_torch(average, batched):
    H, E, L = 3, 6, 4
    tm = torch_mha(E, H, 5)
    m = npattn.MultiHeadAttention.from_torch_state_dict(tm.state_dict(), H)
    lead = (2,) if batched else ()
    x = np.random.default_rng(5).uniform(-1, 1, lead + (L, E))
    _, w = run_pair(tm, m, (x,), E, 5, average=average)
    assert w.shape == lead + ((L, L) if average else (H, L, L))
    # the average is over heads, not a copy of one head
    _, w_heads = m(x, need_weights=True)
    np.testing.assert_allclose(w_heads.mean(axis=-3) if average else w_heads, w, rtol=0, atol=1e-15)


def test_average_attn_weights_default_is_per_head():
    m = npattn.MultiHeadAttention(4, 4, 2, rng=0)
    _, w = m(np.ones((3, 4)), need_weights=True)
    assert w.shape == (2, 3, 3)


@pytest.mark.parametrize("layout", ["self", "cross"])
def test_unbatched_masks_match_torch(layout):
    H, E, lq, lk = 2, 4, 3, 5
    tm = torch_mha(E, H, 3, add_bias_kv=True)
    m = npattn.MultiHeadAttention.from_torch_state_dict(tm.state_dict(), H)
    rng = np.random.default_rng(3)
    q = rng.uniform(-1, 1, (lq, E))
    if layout == "self":
        inputs, lk = (q,), lq
    else:
        inputs = (q, rng.uniform(-1, 1, (lk, E)), rng.uniform(-1, 1, (lk, E)))
    allowed = rng.random((H, lq, lk)) < 0.6
    allowed[..., -1] = True
    pad = np.zeros(lk, bool)
    pad[0] = True
    run_pair(
        tm,
        m,
        inputs,
        E,
        3,
        {"attn_mask": allowed, "key_padding_mask": pad},
        {"attn_mask": torch.tensor(~allowed), "key_padding_mask": torch.tensor(pad)},
    )


def test_bias_kv_zero_attn_with_dropout_masks_are_the_same_columns():
    """Dropout acts on the weights over the extended keys: with a known rng, the returned
    weights are the dropped ones and backward agrees with finite differences (see gradcheck
    tests); here: the zero key's value is zero, so the output ignores its column."""
    m = npattn.MultiHeadAttention(4, 4, 2, add_zero_attn=True, rng=0)
    x = np.random.default_rng(0).standard_normal((2, 3, 4))
    _out, w = m(x, need_weights=True)
    assert w.shape == (2, 2, 3, 4)
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=0, atol=1e-14)
    assert (w[..., -1] > 0).all()


# ---------------------------------------------------------------------------------- state dicts


def test_from_torch_state_dict_reads_bias_kv():
    tm = torch_mha(4, 2, 0, add_bias_kv=True)
    m = npattn.MultiHeadAttention.from_torch_state_dict(tm.state_dict(), 2)
    sd = m.state_dict()
    assert sd["bias_k"].shape == (1, 1, 4) and sd["bias_v"].shape == (1, 1, 4)
    np.testing.assert_array_equal(sd["bias_k"], tm.bias_k.detach().numpy())
    np.testing.assert_array_equal(sd["bias_v"], tm.bias_v.detach().numpy())


def test_from_torch_state_dict_unknown_keys_raise():
    sd = dict(torch_mha(4, 2, 0).state_dict())
    sd["extra.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match="extra.weight"):
        npattn.MultiHeadAttention.from_torch_state_dict(sd, 2)
    sd = dict(torch_mha(4, 2, 0, add_bias_kv=True).state_dict())
    del sd["bias_v"]
    with pytest.raises(ValueError, match="bias_v"):
        npattn.MultiHeadAttention.from_torch_state_dict(sd, 2)


@pytest.mark.parametrize("dtype", [np.float32, "float32", np.dtype(np.float32)])
def test_from_torch_state_dict_dtype_float32(dtype):
    tm = torch_mha(4, 2, 0)  # float64 parameters
    m = npattn.MultiHeadAttention.from_torch_state_dict(tm.state_dict(), 2, dtype=dtype)
    assert m.dtype == np.float32
    assert all(p.data.dtype == np.float32 for p in m.parameters())
    x = np.random.default_rng(0).uniform(-1, 1, (2, 3, 4)).astype(np.float32)
    out = m(x)
    assert out.dtype == np.float32
    ref = tm(*[torch.tensor(x.astype(np.float64))] * 3)[0].detach().numpy()
    np.testing.assert_allclose(out, ref, atol=1e-5)


@pytest.mark.parametrize("dtype", ["junk", np.float16, "float16", np.int64])
def test_from_torch_state_dict_bad_dtype_raises(dtype):
    with pytest.raises(TypeError, match="dtype"):
        npattn.MultiHeadAttention.from_torch_state_dict(torch_mha(4, 2, 0).state_dict(), 2, dtype=dtype)


def test_from_torch_state_dict_float16_state_dict_refused():
    """float16 is refused everywhere (the package's float policy), state dicts included."""
    sd = {k: v.to(torch.float16) for k, v in torch_mha(4, 2, 0).state_dict().items()}
    with pytest.raises(TypeError, match="float32"):
        npattn.MultiHeadAttention.from_torch_state_dict(sd, 2)


def test_from_torch_state_dict_add_bias_kv_kwarg_must_agree():
    sd = torch_mha(4, 2, 0).state_dict()
    with pytest.raises(ValueError, match="add_bias_kv"):
        npattn.MultiHeadAttention.from_torch_state_dict(sd, 2, add_bias_kv=True)
    with pytest.raises(TypeError, match="add_bias_kv"):
        npattn.MultiHeadAttention.from_torch_state_dict(sd, 2, add_bias_kv=1)
    assert not npattn.MultiHeadAttention.from_torch_state_dict(sd, 2, add_bias_kv=False).add_bias_kv
    sd = torch_mha(4, 2, 0, add_bias_kv=True).state_dict()
    assert npattn.MultiHeadAttention.from_torch_state_dict(sd, 2, add_bias_kv=True).add_bias_kv
    with pytest.raises(ValueError, match="add_bias_kv"):
        npattn.MultiHeadAttention.from_torch_state_dict(sd, 2, add_bias_kv=False)


def test_from_torch_state_dict_takes_the_modern_options():
    tm = torch_mha(4, 2, 0)
    m = npattn.MultiHeadAttention.from_torch_state_dict(tm.state_dict(), 2, sinks=True, causal=True)
    assert m.sinks is not None and m.causal
    x = np.random.default_rng(0).uniform(-1, 1, (2, 3, 4))
    # zero sinks: one extra exp(0) in every softmax row, so the output differs from torch's
    t_out = tm(*[torch.tensor(x)] * 3, attn_mask=torch.tensor(~np.tri(3, dtype=bool)))[0].detach().numpy()
    m.sinks.data[...] = -1e9
    m.sinks.bump_version()
    np.testing.assert_allclose(m(x), t_out, rtol=0, atol=1e-12)

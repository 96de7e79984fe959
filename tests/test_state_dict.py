"""The module protocol (gradient accumulation, released state, no_grad) and state dicts
(names, copies, atomic loading, array-likes, strict=False, .npz round trip, repr)."""

import numpy as np
import pytest

import npattn
from npattn import book, data

BOOK = data.load("chapter3")


def rand(seed, shape):
    return np.random.default_rng(seed).uniform(-1, 1, shape)


X = rand(0, (2, 3, 4))
XB = rand(1, (2, 3, 3))
IDS = np.array([[0, 1, 1], [4, 0, 2]])

# name, factory, inputs, forward kwargs, contract state-dict keys (in order)
CASES = [
    ("Linear", lambda: npattn.Linear(4, 3, rng=0), (X,), {}, ["weight", "bias"]),
    ("Linear_nobias", lambda: npattn.Linear(4, 3, bias=False, rng=0), (X,), {}, ["weight"]),
    ("LayerNorm", lambda: npattn.LayerNorm(4), (X,), {}, ["weight", "bias"]),
    ("LayerNorm_nobias", lambda: npattn.LayerNorm(4, bias=False), (X,), {}, ["weight"]),
    ("LayerNorm_plain", lambda: npattn.LayerNorm(4, elementwise_affine=False), (X,), {}, []),
    ("Dropout", lambda: npattn.Dropout(0.3, rng=0), (X,), {}, []),
    ("Embedding", lambda: npattn.Embedding(5, 2, rng=0), (IDS,), {}, ["weight"]),
    (
        "FeedForward",
        lambda: npattn.FeedForward(4, 6, activation="gelu", rng=0),
        (X,),
        {},
        ["linear1.weight", "linear1.bias", "linear2.weight", "linear2.bias"],
    ),
    (
        "MHA",
        lambda: npattn.MultiHeadAttention(4, 4, 2, rng=0),
        (X,),
        {},
        ["W_query.weight", "W_key.weight", "W_value.weight", "out_proj.weight", "out_proj.bias"],
    ),
    (
        "MHA_cross_bias",
        lambda: npattn.MultiHeadAttention(
            4, 4, 2, qkv_bias=True, out_bias=False, num_kv_heads=1, kdim=3, vdim=2, dropout=0.2, rng=0
        ),
        (X, rand(2, (2, 5, 3)), rand(3, (2, 5, 2))),
        dict(key_padding_mask=np.zeros((2, 5), bool)),
        [
            "W_query.weight",
            "W_query.bias",
            "W_key.weight",
            "W_key.bias",
            "W_value.weight",
            "W_value.bias",
            "out_proj.weight",
        ],
    ),
    (
        "EncoderBlock",
        lambda: npattn.EncoderBlock(4, 2, 6, rng=0),
        (X,),
        {},
        [
            "mha.W_query.weight",
            "mha.W_key.weight",
            "mha.W_value.weight",
            "mha.out_proj.weight",
            "mha.out_proj.bias",
            "ffn.linear1.weight",
            "ffn.linear1.bias",
            "ffn.linear2.weight",
            "ffn.linear2.bias",
            "layernorm1.weight",
            "layernorm1.bias",
            "layernorm2.weight",
            "layernorm2.bias",
        ],
    ),
    (
        "EncoderBlock_prenorm",
        lambda: npattn.EncoderBlock(4, 2, 6, norm_first=True, qkv_bias=True, rng=0),
        (X,),
        {},
        [
            "mha.W_query.weight",
            "mha.W_query.bias",
            "mha.W_key.weight",
            "mha.W_key.bias",
            "mha.W_value.weight",
            "mha.W_value.bias",
            "mha.out_proj.weight",
            "mha.out_proj.bias",
            "ffn.linear1.weight",
            "ffn.linear1.bias",
            "ffn.linear2.weight",
            "ffn.linear2.bias",
            "layernorm1.weight",
            "layernorm1.bias",
            "layernorm2.weight",
            "layernorm2.bias",
        ],
    ),
    ("SelfAttention_v1", lambda: book.SelfAttention_v1(3, 2, rng=0), (XB[0],), {}, ["W_query", "W_key", "W_value"]),
    (
        "SelfAttention_v2",
        lambda: book.SelfAttention_v2(3, 2, rng=0),
        (XB[0],),
        {},
        ["W_query.weight", "W_key.weight", "W_value.weight"],
    ),
    (
        "CausalAttention",
        lambda: book.CausalAttention(3, 2, 4, 0.1, rng=0),
        (XB,),
        {},
        ["mask", "W_query.weight", "W_key.weight", "W_value.weight"],
    ),
    (
        "Wrapper",
        lambda: book.MultiHeadAttentionWrapper(3, 2, 4, 0.1, 2, qkv_bias=True, rng=0),
        (XB,),
        {},
        [
            f"heads.{i}.{k}"
            for i in range(2)
            for k in [
                "mask",
                "W_query.weight",
                "W_query.bias",
                "W_key.weight",
                "W_key.bias",
                "W_value.weight",
                "W_value.bias",
            ]
        ],
    ),
    (
        "BookMHA",
        lambda: book.MultiHeadAttention(3, 4, 4, 0.1, 2, rng=0),
        (XB,),
        {},
        ["mask", "W_query.weight", "W_key.weight", "W_value.weight", "out_proj.weight", "out_proj.bias"],
    ),
]
IDS_ = [c[0] for c in CASES]
BUFFERS = {"mask"}


def _grads(g):
    return g if isinstance(g, tuple) else (g,)


def _out(y):
    return y[0] if isinstance(y, tuple) else y


@pytest.mark.parametrize("name,factory,inputs,fwd,keys", CASES, ids=IDS_)
def test_names_match_contract_keys(name, factory, inputs, fwd, keys):
    m = factory()
    assert list(m.state_dict()) == keys
    pnames = [n for n, _ in m.named_parameters()]
    assert pnames == [k for k in keys if k.rsplit(".", 1)[-1] not in BUFFERS]
    assert pnames == [n for n, _ in m.named_parameters()]  # stable
    assert len(list(m.parameters())) == len(pnames)
    for n, p in m.named_parameters():
        assert p.grad.shape == p.data.shape and p.grad.dtype == p.data.dtype, n
        assert not p.grad.any(), n


def test_book_keys_match_torch_export():
    for prefix, m in [
        ("sa_v1", book.SelfAttention_v1(3, 2)),
        ("sa_v2", book.SelfAttention_v2(3, 2)),
        ("ca", book.CausalAttention(3, 2, 6, 0.0)),
        ("mhaw", book.MultiHeadAttentionWrapper(3, 2, 6, 0.0, 2)),
        ("mha", book.MultiHeadAttention(3, 2, 6, 0.0, 2)),
    ]:
        exported = [k[len(prefix) + 1 :] for k in BOOK if k.startswith(prefix + ".")]
        assert list(m.state_dict()) == exported, prefix
        for k, v in m.state_dict().items():
            assert v.shape == BOOK[f"{prefix}.{k}"].shape, (prefix, k)


def test_mha_parameter_shapes_follow_contract():
    m = npattn.MultiHeadAttention(5, 6, 3, num_kv_heads=1, kdim=4, vdim=2, qkv_bias=True)
    shapes = {k: v.shape for k, v in m.state_dict().items()}
    assert shapes == {
        "W_query.weight": (6, 5),
        "W_query.bias": (6,),
        "W_key.weight": (2, 4),
        "W_key.bias": (2,),
        "W_value.weight": (2, 2),
        "W_value.bias": (2,),
        "out_proj.weight": (6, 6),
        "out_proj.bias": (6,),
    }


# ------------------------------------------------------------------------------ protocol


@pytest.mark.parametrize("name,factory,inputs,fwd,keys", CASES, ids=IDS_)
def test_backward_accumulates_and_zero_grad(name, factory, inputs, fwd, keys):
    m = factory()
    m.eval()  # deterministic forwards
    y = _out(m(*inputs, **fwd))
    dy = rand(9, y.shape)
    g1 = _grads(m.backward(dy))
    once = {n: p.grad.copy() for n, p in m.named_parameters()}
    assert all(v.any() for v in once.values()) or not once
    m(*inputs, **fwd)
    g2 = _grads(m.backward(dy))
    for n, p in m.named_parameters():
        np.testing.assert_allclose(p.grad, 2 * once[n], rtol=1e-12, atol=1e-15, err_msg=n)
    for a, b in zip(g1, g2):
        if a is None:
            assert b is None
        else:
            np.testing.assert_array_equal(a, b)  # input grads are returned, not accumulated
    m.zero_grad()
    for n, p in m.named_parameters():
        assert not p.grad.any(), n
        assert p.grad.shape == p.data.shape


@pytest.mark.parametrize("name,factory,inputs,fwd,keys", CASES, ids=IDS_)
def test_backward_needs_a_fresh_forward(name, factory, inputs, fwd, keys):
    m = factory()
    dy = rand(9, _out(factory()(*inputs, **fwd)).shape)
    with pytest.raises(RuntimeError, match="forward"):
        m.backward(dy)  # before any forward
    m(*inputs, **fwd)
    m.backward(dy)
    with pytest.raises(RuntimeError, match="forward"):
        m.backward(dy)  # the state was released
    for _, sub in m.named_modules():
        assert sub._cache is None
    m(*inputs, **fwd)
    m.backward(dy)  # a new forward allows one more


@pytest.mark.parametrize("name,factory,inputs,fwd,keys", CASES, ids=IDS_)
def test_no_grad_keeps_nothing(name, factory, inputs, fwd, keys):
    m = factory()
    m.eval()
    ref = _out(m(*inputs, **fwd))
    dy = rand(9, ref.shape)
    m.backward(dy)
    assert npattn.is_grad_enabled()
    with npattn.no_grad():
        assert not npattn.is_grad_enabled()
        y = _out(m(*inputs, **fwd))
        for sub_name, sub in m.named_modules():
            assert sub._cache is None, sub_name
    assert npattn.is_grad_enabled()
    np.testing.assert_allclose(y, ref, rtol=1e-12, atol=1e-15)
    with pytest.raises(RuntimeError, match="no_grad"):
        m.backward(dy)
    # a grad-enabled forward after no_grad works again
    m(*inputs, **fwd)
    m.backward(dy)


def test_no_grad_is_reentrant_and_restores_on_error():
    with npattn.no_grad():
        with npattn.no_grad():
            pass
        assert not npattn.is_grad_enabled()
    assert npattn.is_grad_enabled()
    with pytest.raises(KeyError):
        with npattn.no_grad():
            raise KeyError("x")
    assert npattn.is_grad_enabled()


def test_train_eval_flags_propagate():
    m = npattn.EncoderBlock(4, 2, 6)
    assert all(s.training for _, s in m.named_modules())
    assert m.eval() is m
    assert not any(s.training for _, s in m.named_modules())
    m.train()
    assert all(s.training for _, s in m.named_modules())


# ------------------------------------------------------------------------------ state dicts


def _snapshot(m):
    return {k: v.copy() for k, v in m.state_dict().items()}


def _same(m, snap):
    sd = m.state_dict()
    assert list(sd) == list(snap)
    for k in snap:
        np.testing.assert_array_equal(sd[k], snap[k], err_msg=k)


@pytest.mark.parametrize("name,factory,inputs,fwd,keys", CASES, ids=IDS_)
def test_state_dict_is_a_copy(name, factory, inputs, fwd, keys):
    m = factory()
    snap = _snapshot(m)
    sd = m.state_dict()
    for v in sd.values():
        v[...] = 42.0
    _same(m, snap)
    for n, p in m.named_parameters():
        assert sd[n] is not p.data
        assert sd[n].dtype == p.data.dtype


@pytest.mark.parametrize("name,factory,inputs,fwd,keys", [c for c in CASES if c[4]], ids=[c[0] for c in CASES if c[4]])
def test_load_state_dict_round_trip(name, factory, inputs, fwd, keys):
    src, dst = factory(), factory()
    rng = np.random.default_rng(5)
    new = {k: (v if k.endswith("mask") else rng.standard_normal(v.shape)) for k, v in src.state_dict().items()}
    src.load_state_dict(new)
    missing, unexpected = dst.load_state_dict(src.state_dict())
    assert missing == [] and unexpected == []
    _same(dst, src.state_dict())
    for k, v in new.items():
        v[...] = 0  # the module copied the values
    _same(dst, src.state_dict())
    src.eval(), dst.eval()
    np.testing.assert_array_equal(_out(src(*inputs, **fwd)), _out(dst(*inputs, **fwd)))


def _bad_variants(m):
    """(label, bad state dict, key that must be named); every bad dict also changes every other value."""
    sd = m.state_dict()
    changed = {k: v + 1.0 for k, v in sd.items()}
    first, last = list(sd)[0], list(sd)[-1]
    out = []
    d = dict(changed)
    del d[last]
    out.append(("missing", d, last))
    d = dict(changed)
    d["not.a.key"] = np.zeros(3)
    out.append(("unexpected", d, "not.a.key"))
    d = dict(changed)
    d[first] = np.zeros(sd[first].shape + (1,))
    out.append(("shape", d, first))
    d = dict(changed)
    d[last] = np.zeros((sd[last].size + 1,))
    out.append(("shape_last", d, last))
    return out


@pytest.mark.parametrize("name,factory,inputs,fwd,keys", [c for c in CASES if c[4]], ids=[c[0] for c in CASES if c[4]])
def test_load_state_dict_is_atomic(name, factory, inputs, fwd, keys):
    m = factory()
    snap = _snapshot(m)
    for label, bad, key in _bad_variants(m):
        with pytest.raises(ValueError, match=__import__("re").escape(repr(key))):
            m.load_state_dict(bad)
        _same(m, snap)


def test_load_state_dict_bad_value_is_atomic():
    m = npattn.EncoderBlock(4, 2, 6, rng=0)
    snap = _snapshot(m)
    sd = {k: v + 1 for k, v in m.state_dict().items()}
    sd["ffn.linear2.bias"] = np.array(["a", "b", "c", "d"])
    with pytest.raises(ValueError, match="ffn.linear2.bias"):
        m.load_state_dict(sd)
    _same(m, snap)
    with pytest.raises(TypeError, match="state_dict"):
        m.load_state_dict([("mha.W_query.weight", np.zeros((4, 4)))])
    _same(m, snap)


def test_load_state_dict_strict_false():
    m = npattn.EncoderBlock(4, 2, 6, rng=0)
    snap = _snapshot(m)
    part = {"ffn.linear1.bias": np.arange(6.0), "extra.thing": np.zeros(2)}
    missing, unexpected = m.load_state_dict(part, strict=False)
    assert unexpected == ["extra.thing"]
    assert set(missing) == set(snap) - {"ffn.linear1.bias"}
    np.testing.assert_array_equal(m.ffn.linear1.bias.data, np.arange(6.0))
    for k in snap:
        if k != "ffn.linear1.bias":
            np.testing.assert_array_equal(m.state_dict()[k], snap[k])
    snap = _snapshot(m)
    with pytest.raises(ValueError, match="ffn.linear1.bias"):  # shapes are still checked
        m.load_state_dict({"ffn.linear1.bias": np.zeros(5), "layernorm1.bias": np.ones(4)}, strict=False)
    _same(m, snap)


def test_load_state_dict_accepts_lists_and_keeps_dtype():
    m = npattn.Linear(2, 3, rng=0, dtype=np.float32)
    w = m.weight
    m.load_state_dict({"weight": [[1, 2], [3, 4], [5, 6]], "bias": [0.5, 0.25, 0.125]})
    assert m.weight is w  # parameters are updated in place (optimisers keep their references)
    assert m.weight.data.dtype == np.float32 and m.bias.data.dtype == np.float32
    np.testing.assert_array_equal(m.weight.data, [[1, 2], [3, 4], [5, 6]])
    np.testing.assert_array_equal(m(np.array([[1.0, 1.0]])), [[3.5, 7.25, 11.125]])


def test_load_state_dict_accepts_torch_tensors():
    torch = pytest.importorskip("torch")
    m = book.CausalAttention(3, 2, 4, 0.0, rng=0)
    sd = {k: torch.tensor(v, dtype=torch.float32) for k, v in m.state_dict().items()}
    sd["W_query.weight"] = torch.randn(2, 3, requires_grad=True)
    sd["W_key.weight"] = torch.nn.Parameter(torch.randn(2, 3, dtype=torch.float64))
    m.load_state_dict(sd)
    np.testing.assert_allclose(m.W_query.weight.data, sd["W_query.weight"].detach().numpy(), rtol=1e-7)
    np.testing.assert_array_equal(m.W_key.weight.data, sd["W_key.weight"].detach().numpy())
    assert m.W_query.weight.data.dtype == np.float64


@pytest.mark.parametrize("name,factory,inputs,fwd,keys", [c for c in CASES if c[4]], ids=[c[0] for c in CASES if c[4]])
def test_save_load_npz(tmp_path, name, factory, inputs, fwd, keys):
    a = factory()
    rng = np.random.default_rng(3)
    a.load_state_dict(
        {k: (v if k.endswith("mask") else rng.standard_normal(v.shape)) for k, v in a.state_dict().items()}
    )
    path = tmp_path / "m.npz"
    a.save(path)
    with np.load(path) as f:
        assert sorted(f.files) == sorted(keys)
    b = factory()
    assert b.load(path) == ([], [])
    _same(b, a.state_dict())
    a.eval(), b.eval()
    np.testing.assert_array_equal(_out(a(*inputs, **fwd)), _out(b(*inputs, **fwd)))


def test_load_npz_with_bad_key_changes_nothing(tmp_path):
    a = npattn.FeedForward(4, 6, rng=0)
    sd = a.state_dict()
    sd["linear2.weight"] = np.zeros((4, 5))
    np.savez(tmp_path / "bad.npz", **sd)
    b = npattn.FeedForward(4, 6, rng=1)
    snap = _snapshot(b)
    with pytest.raises(ValueError, match="linear2.weight"):
        b.load(tmp_path / "bad.npz")
    _same(b, snap)


def test_repr_is_readable():
    r = repr(npattn.EncoderBlock(4, 2, 6))
    for part in (
        "EncoderBlock",
        "(mha): MultiHeadAttention",
        "d_in=4",
        "num_heads=2",
        "(ffn): FeedForward",
        "(linear1): Linear(in_features=4, out_features=6",
        "(layernorm1): LayerNorm",
        "Dropout(p=0.1)",
    ):
        assert part in r, (part, r)
    assert "Linear(in_features=3, out_features=2, bias=False)" == repr(npattn.Linear(3, 2, bias=False))
    r = repr(book.MultiHeadAttentionWrapper(3, 2, 4, 0.0, 2))
    assert "(heads): ModuleList" in r and "(0): CausalAttention" in r and "(1): CausalAttention" in r
    assert repr(npattn.Linear(2, 2).weight) == "Parameter(shape=(2, 2), dtype=float64)"
    assert "num_kv_heads=1" in repr(npattn.MultiHeadAttention(4, 4, 2, num_kv_heads=1))

"""Regression tests for defects found by trying npattn adversarially (each failed before its fix).

float16/longdouble policy, weights changed between forward and backward, ``p.grad = None``,
a rejected ``dy`` after ``m.forward(x)``, ``TinyTransformer(embedding_std=...)``, optimizer
hyper-parameters and state dicts, ``save``/``load`` paths, ``load_state_dict`` values, and the
moving average of ``npattn.viz.plot_loss``.
"""

import copy
import os
import warnings

import numpy as np
import pytest

import npattn
from npattn import book, masks
from npattn import functional as F
from npattn.optim import SGD, Adam, AdamW

RNG = np.random.default_rng(0)
BAD_DTYPES = [np.float16, np.longdouble] if np.dtype(np.longdouble) != np.dtype(np.float64) else [np.float16]


def _modules():
    """(name, module, input) for every module class, small sizes, float64."""
    x = RNG.standard_normal((2, 3, 4))
    return [
        ("Linear", npattn.Linear(4, 3, rng=0), x),
        ("LayerNorm", npattn.LayerNorm(4), x),
        ("FeedForward", npattn.FeedForward(4, 6, rng=0), x),
        ("MultiHeadAttention", npattn.MultiHeadAttention(4, 4, 2, rng=0), x),
        ("EncoderBlock", npattn.EncoderBlock(4, 2, 6, dropout=0.0, rng=0), x),
        ("EncoderBlock-pre", npattn.EncoderBlock(4, 2, 6, dropout=0.0, norm_first=True, rng=0), x),
        ("SelfAttention_v1", book.SelfAttention_v1(4, 3, rng=0), x),
        ("SelfAttention_v2", book.SelfAttention_v2(4, 3, rng=0), x),
        ("CausalAttention", book.CausalAttention(4, 3, 5, 0.0, rng=0), x),
        ("MultiHeadAttentionWrapper", book.MultiHeadAttentionWrapper(4, 2, 5, 0.0, 2, rng=0), x),
        ("book.MultiHeadAttention", book.MultiHeadAttention(4, 4, 5, 0.0, 2, rng=0), x),
        ("TinyTransformer", npattn.TinyTransformer(7, 5, 4, 2, 1, 6, rng=0), RNG.integers(0, 7, (2, 3))),
    ]


MODULES = _modules()
MODULE_IDS = [n for n, _, _ in MODULES]


def _fresh(i):
    name, m, x = MODULES[i]
    return copy.deepcopy(m), x


# -- 1. float16 / longdouble ---------------------------------------------------------------------
@pytest.mark.parametrize("dt", BAD_DTYPES)
def test_float16_refused_by_functional_ops(dt):
    x = np.array([300.0, 0.0, -300.0], dtype=dt)
    for fn, args in ((F.layer_norm, ()), (F.gelu, ("tanh",)), (F.gelu, ()), (F.softmax, ()), (F.relu, ())):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no overflow warning: refused before any arithmetic
            with pytest.raises(TypeError, match=r"x: .*(float16|float128|longdouble).*float32"):
                fn(x, *args)
    q = np.ones((2, 3, 4), dtype=dt)
    with pytest.raises(TypeError, match=r"q: .*float32"):
        F.scaled_dot_product_attention(q, q, q)
    with pytest.raises(TypeError, match=r"k: .*float32"):
        F.scaled_dot_product_attention(q.astype(np.float64), q, q)


@pytest.mark.parametrize("dt", BAD_DTYPES)
def test_float16_message_names_argument_and_suggests_float32(dt):
    with pytest.raises(TypeError) as e:
        F.layer_norm(np.ones((2, 3), dt))
    msg = str(e.value)
    assert msg.startswith("x: ") and "astype(np.float32)" in msg and "not supported" in msg


@pytest.mark.parametrize("dt", BAD_DTYPES)
@pytest.mark.parametrize("i", range(len(MODULES)), ids=MODULE_IDS)
def test_float16_refused_by_modules_without_state_change(i, dt):
    m, x = _fresh(i)
    if x.dtype.kind == "i":
        pytest.skip("token ids")
    before = m.state_dict()
    with pytest.raises(TypeError, match="float32"):
        m(x.astype(dt))
    with pytest.raises(RuntimeError):
        m.backward(np.ones(1))  # nothing was kept
    for k, v in m.state_dict().items():
        np.testing.assert_array_equal(v, before[k])


@pytest.mark.parametrize("dt", BAD_DTYPES)
def test_float16_refused_for_parameters_dtypes_masks_and_dy(dt):
    with pytest.raises(TypeError, match="float32"):
        npattn.Parameter(np.ones(3, dt))
    with pytest.raises(TypeError, match="float32"):
        npattn.Linear(2, 2, dtype=dt)
    q = np.ones((1, 2, 3, 4))
    with pytest.raises(TypeError, match="attn_mask: .*float32"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=np.zeros((3, 3), dt))
    with pytest.raises(TypeError, match="key_padding_mask: .*float32"):
        masks.from_key_padding_mask(np.zeros((1, 3), dt))
    mha = npattn.MultiHeadAttention(4, 4, 2, rng=0)
    with pytest.raises(TypeError, match="float32"):
        mha(np.ones((1, 3, 4)), key_padding_mask=np.zeros((1, 3), dt))
    lin = npattn.Linear(4, 2, rng=0)
    y = lin(np.ones((3, 4)))
    with pytest.raises(TypeError, match="dy: .*float32"):
        lin.backward(np.ones(y.shape, dt))
    lin.backward(np.ones(y.shape))  # the state survived


@pytest.mark.parametrize("dt", BAD_DTYPES)
def test_float16_refused_by_load_state_dict_atomically(dt):
    m = npattn.Linear(3, 2, rng=0)
    before = m.state_dict()
    sd = {k: v.astype(dt) for k, v in before.items()}
    with pytest.raises(TypeError, match=r"weight.*float32"):
        m.load_state_dict(sd)
    for k, v in m.state_dict().items():
        np.testing.assert_array_equal(v, before[k])


def test_float32_and_float64_still_fine():
    for dt in (np.float32, np.float64):
        y, _ = F.layer_norm(np.array([300.0, 0.0, -300.0], dt))
        assert y.dtype == dt and np.abs(y).max() > 1.0


# -- 3. weights changed between forward and backward -----------------------------------------------
def _changes():
    def assign(m):
        p = next(iter(m.parameters()))
        p.data = p.data + 1.0

    def sgd(m):
        m.zero_grad()
        for p in m.parameters():
            p.grad[...] = 1.0
        SGD(m, lr=0.1).step()

    def adam(m):
        for p in m.parameters():
            p.grad[...] = 1.0
        Adam(m, lr=0.1).step()

    def load(m):
        m.load_state_dict({k: v + 1.0 for k, v in m.state_dict().items()})

    def to(m):
        m.to(np.float64)

    return {"assign": assign, "sgd": sgd, "adam": adam, "load_state_dict": load, "to": to}


CHANGES = _changes()


@pytest.mark.parametrize("change", sorted(CHANGES))
@pytest.mark.parametrize("i", range(len(MODULES)), ids=MODULE_IDS)
def test_backward_after_weights_changed_raises(i, change):
    m, x = _fresh(i)
    if not list(m.parameters()):
        pytest.skip("no parameters")
    y = m(x)
    CHANGES[change](m)
    if change == "to":  # Module.to releases every forward state: the protocol's error
        with pytest.raises(RuntimeError):
            m.backward(np.ones_like(y))
        return
    grads = [p.grad.copy() for p in m.parameters()]
    with pytest.raises(RuntimeError, match="modified"):
        m.backward(np.ones_like(y))
    for p, g in zip(m.parameters(), grads):
        np.testing.assert_array_equal(p.grad, g)  # nothing accumulated


def test_weights_changed_message_names_parameter():
    m = npattn.EncoderBlock(4, 2, 6, dropout=0.0, rng=0)
    y = m(RNG.standard_normal((1, 3, 4)))
    m.mha.out_proj.weight.data = m.mha.out_proj.weight.data * 2
    with pytest.raises(RuntimeError, match=r"mha\.out_proj\.weight"):
        m.backward(np.ones_like(y))


def test_zero_grad_and_new_forward_do_not_trip_the_version_check():
    m = npattn.MultiHeadAttention(4, 4, 2, rng=0)
    x = RNG.standard_normal((1, 3, 4))
    opt = AdamW(m, lr=0.01)
    for _ in range(3):
        opt.zero_grad()
        y = m(x)
        m.zero_grad()
        m.backward(np.ones_like(y))
        opt.step()
    m.load_state_dict(m.state_dict())
    y = m(x)
    m.backward(np.ones_like(y))


def test_parameter_version_counter():
    p = npattn.Parameter(np.ones(3))
    v0 = p._version
    p.zero_grad()
    p.grad = None
    assert p._version == v0
    p.data = np.zeros(3)
    assert p._version == v0 + 1


# -- 5. p.grad = None ------------------------------------------------------------------------------
@pytest.mark.parametrize("i", range(len(MODULES)), ids=MODULE_IDS)
def test_grad_none_backward_creates_the_gradient(i):
    m, x = _fresh(i)
    ref = copy.deepcopy(m)
    for p in m.parameters():
        p.grad = None
    y = m(x)
    dy = np.random.default_rng(1).standard_normal(y.shape)
    m.backward(dy)
    ref(x)
    ref.backward(dy)
    for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
        assert p.grad is not None and p.grad.dtype == p.data.dtype, n
        np.testing.assert_array_equal(p.grad, q.grad, err_msg=n)


def test_grad_none_zero_grad_to_and_gradcheck():
    m = npattn.Linear(3, 2, rng=0)
    m.weight.grad = None
    m.zero_grad()
    np.testing.assert_array_equal(m.weight.grad, np.zeros((2, 3)))
    m.bias.grad = None
    m.to(np.float32)
    assert m.bias.grad is None and m.weight.grad.dtype == np.float32
    m.to(np.float64)
    m.weight.grad = None
    rep = npattn.gradcheck(m, RNG.standard_normal((2, 3)))
    assert rep.ok
    p = npattn.Parameter(np.ones(2))
    p.grad = None
    p.zero_grad()
    np.testing.assert_array_equal(p.grad, np.zeros(2))


# -- 7. a rejected dy after m.forward(x) keeps the state ---------------------------------------------
@pytest.mark.parametrize("i", range(len(MODULES)), ids=MODULE_IDS)
def test_rejected_dy_after_forward_method_keeps_state(i):
    m, x = _fresh(i)
    ref = copy.deepcopy(m)
    y = m.forward(x)
    y = y[0] if isinstance(y, tuple) else y
    with pytest.raises(ValueError, match="dy|dlogits"):
        m.backward(np.ones(y.shape[:-1] + (y.shape[-1] + 1,)))
    with pytest.raises(TypeError):
        m.backward(np.ones(y.shape, dtype=bool))
    dy = np.random.default_rng(2).standard_normal(y.shape)
    dx = m.backward(dy)  # retry with the right dy
    ref_dx = (ref(x), ref.backward(dy))[1]
    if dx is None:
        assert ref_dx is None
    else:
        np.testing.assert_array_equal(dx, ref_dx)
    for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
        np.testing.assert_array_equal(p.grad, q.grad, err_msg=n)


# -- 8. TinyTransformer(embedding_std=...) -----------------------------------------------------------
def test_embedding_std_values():
    kw = dict(vocab_size=5, context_length=4, d_model=4, num_heads=2, num_layers=1, d_ff=4, rng=0)
    a = npattn.TinyTransformer(embedding_std=np.float32(0.02), **kw)
    b = npattn.TinyTransformer(embedding_std=0.02, **kw)
    np.testing.assert_allclose(a.tok_emb.weight.data, b.tok_emb.weight.data, rtol=1e-7)
    npattn.TinyTransformer(embedding_std=np.float64(1.0), **kw)
    npattn.TinyTransformer(embedding_std=1, **kw)
    for bad in (True, np.bool_(True), "0.02", None, [0.02]):
        with pytest.raises(TypeError, match="embedding_std"):
            npattn.TinyTransformer(embedding_std=bad, **kw)
    for bad in (np.inf, -np.inf, np.nan, 0.0, -0.1, np.float32(np.inf)):
        with pytest.raises(ValueError, match="embedding_std"):
            npattn.TinyTransformer(embedding_std=bad, **kw)


# -- 10. optimizers ---------------------------------------------------------------------------------
def _params():
    return [npattn.Parameter(np.ones(3))]


@pytest.mark.parametrize(
    "make, name, bad, exc",
    [
        (lambda: SGD(_params(), lr=0.1, momentum=0.5), "momentum", 5.0, ValueError),
        (lambda: SGD(_params(), lr=0.1, momentum=0.5), "momentum", "0.5", TypeError),
        (lambda: SGD(_params(), lr=0.1), "weight_decay", -1.0, ValueError),
        (lambda: SGD(_params(), lr=0.1), "nesterov", 1, TypeError),
        (lambda: SGD(_params(), lr=0.1), "nesterov", True, ValueError),  # momentum is 0
        (lambda: SGD(_params(), lr=0.1, momentum=0.9, nesterov=True), "momentum", 0.0, ValueError),
        (lambda: Adam(_params()), "betas", (2.0, 0.5), ValueError),
        (lambda: Adam(_params()), "betas", 0.9, TypeError),
        (lambda: AdamW(_params()), "eps", 0.0, ValueError),
        (lambda: AdamW(_params()), "weight_decay", float("nan"), ValueError),
        (lambda: AdamW(_params()), "lr", -1.0, ValueError),
    ],
)
def test_optimizer_hyper_validated_on_assignment(make, name, bad, exc):
    opt = make()
    before = getattr(opt, name)
    with pytest.raises(exc, match=name):
        setattr(opt, name, bad)
    assert getattr(opt, name) == before


def test_optimizer_assignment_stores_validated_values():
    opt = Adam(_params())
    opt.betas = [np.float32(0.5), 0.25]
    assert opt.betas == (0.5, 0.25) and type(opt.betas[0]) is float
    sgd = SGD(_params(), lr=0.1)
    sgd.momentum = np.float64(0.9)
    assert type(sgd.momentum) is float


def test_sgd_load_state_dict_refuses_nesterov_without_momentum():
    opt = SGD(_params(), lr=0.1)
    sd = opt.state_dict()
    sd["hyper"]["nesterov"] = True
    with pytest.raises(ValueError, match="nesterov"):
        opt.load_state_dict(sd)
    assert opt.nesterov is False


@pytest.mark.parametrize(
    "sd",
    [
        {"hyper": 5, "state": {}},
        {"hyper": {"lr": 0.1}, "state": 5},
        {"hyper": {"lr": 0.1}, "state": {0: 5}},
        {"hyper": {"lr": 0.1}, "state": {0: {"step": 1, "exp_avg": None, "exp_avg_sq": np.zeros(3)}}},
        {"hyper": {"lr": 0.1}, "state": {0: {"step": 1, "exp_avg": "abc", "exp_avg_sq": np.zeros(3)}}},
        {"hyper": {"lr": 0.1}, "state": {0: {"step": 1.5, "exp_avg": np.zeros(3), "exp_avg_sq": np.zeros(3)}}},
        {"hyper": {"lr": 0.1}, "state": {0: {"step": 1, "exp_avg": [[1, 2], [3]], "exp_avg_sq": np.zeros(3)}}},
        {"hyper": [("lr", 0.1, 3)], "state": {}},
        {"hyper": {"lr": 0.1}, "state": {None: {}}},
        {"hyper": {"lr": 0.1}, "state": {0: {"step": 1, "exp_avg": np.zeros(3) + np.nan, "exp_avg_sq": np.zeros(3)}}},
    ],
)
def test_optimizer_malformed_state_dict_clear_error(sd):
    opt = Adam(_params(), lr=0.5)
    p = opt.params[0]
    p.grad = np.ones(3)
    opt.step()
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises((ValueError, TypeError), match="state_dict|load_state_dict"):
        opt.load_state_dict(sd)
    after = opt.state_dict()
    assert after["hyper"] == before["hyper"]
    np.testing.assert_array_equal(after["state"][0]["exp_avg"], before["state"][0]["exp_avg"])


# -- 11. save / load paths ---------------------------------------------------------------------------
def test_save_load_without_extension(tmp_path):
    m = npattn.Linear(3, 2, rng=0)
    m.save(str(tmp_path / "model"))
    assert (tmp_path / "model.npz").exists()
    m2 = npattn.Linear(3, 2, rng=1)
    m2.load(str(tmp_path / "model"))
    np.testing.assert_array_equal(m2.weight.data, m.weight.data)
    m3 = npattn.Linear(3, 2, rng=2)
    m3.load(tmp_path / "model.npz")  # pathlib too
    np.testing.assert_array_equal(m3.weight.data, m.weight.data)


def test_save_into_a_directory_raises(tmp_path):
    m = npattn.Linear(3, 2, rng=0)
    with pytest.raises((ValueError, IsADirectoryError), match="directory"):
        m.save(str(tmp_path))
    assert not os.path.exists(str(tmp_path) + ".npz")
    with pytest.raises((ValueError, IsADirectoryError), match="directory"):
        m.load(str(tmp_path))


def test_load_corrupt_or_missing_file(tmp_path):
    m = npattn.Linear(3, 2, rng=0)
    before = m.state_dict()
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"this is not a zip archive at all")
    with pytest.raises(ValueError, match="bad.npz") as e:
        m.load(str(bad))
    assert "pickle" not in str(e.value)
    with pytest.raises(FileNotFoundError, match="nothere"):
        m.load(str(tmp_path / "nothere"))
    np.testing.assert_array_equal(m.weight.data, before["weight"])


# -- 12. load_state_dict values ---------------------------------------------------------------------
def test_load_state_dict_refuses_bool_arrays():
    m = npattn.Linear(2, 2, rng=0)
    before = m.state_dict()
    sd = dict(before)
    sd["weight"] = np.ones((2, 2), dtype=bool)
    with pytest.raises(TypeError, match="weight.*bool"):
        m.load_state_dict(sd)
    np.testing.assert_array_equal(m.weight.data, before["weight"])


def test_load_state_dict_out_of_float32_range():
    m = npattn.Linear(2, 2, rng=0, dtype=np.float32)
    before = m.state_dict()
    sd = {k: v.astype(np.float64) for k, v in before.items()}
    sd["bias"] = np.array([1e300, 0.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="bias.*float32"):
            m.load_state_dict(sd)
    np.testing.assert_array_equal(m.bias.data, before["bias"])
    sd["bias"] = np.array([np.inf, np.nan])  # non-finite values stay loadable as they are
    m.load_state_dict(sd)
    assert np.isinf(m.bias.data[0]) and np.isnan(m.bias.data[1])


# -- 4. viz moving average ---------------------------------------------------------------------------
def test_moving_average_is_local():
    from npattn.viz import _smooth

    y = np.arange(20, dtype=np.float64)
    y[5] = np.nan
    s = _smooth(y, 3)
    assert np.isnan(s[5:8]).all()
    np.testing.assert_allclose(s[8:], [(i - 2 + i - 1 + i) / 3 for i in range(8, 20)])
    np.testing.assert_allclose(s[:5], [0, 0.5, 1, 2, 3])
    y = np.ones(30)
    y[3] = 1e300
    s = _smooth(y, 4)
    np.testing.assert_array_equal(s[7:], np.ones(23))
    y[3] = np.inf
    s = _smooth(y, 4)
    assert np.isinf(s[3:7]).all()
    np.testing.assert_array_equal(s[7:], np.ones(23))
    y = np.ones(10)
    y[2], y[3] = np.inf, -np.inf
    s = _smooth(y, 2)
    assert np.isnan(s[3]) and np.isinf(s[2]) and np.isinf(s[4])
    np.testing.assert_array_equal(s[5:], np.ones(5))


@pytest.mark.parametrize("dt", BAD_DTYPES)
def test_float16_refused_by_mask_helpers(dt):
    with pytest.raises(TypeError, match="float32"):
        masks.to_additive(np.ones((2, 2), bool), dtype=dt)
    with pytest.raises(TypeError, match="mask: .*float32"):
        masks.to_additive(np.zeros((2, 2), dt))
    with pytest.raises(TypeError, match="masks: .*float32"):
        masks.combine(np.ones((2, 2), bool), np.zeros((2, 2), dt))


def test_demo_smoothing_is_local():
    from npattn.tools._train import smooth as _smooth

    y = np.ones(12)
    y[2] = np.nan
    y[6] = 1e300
    s = _smooth(y, 3)
    assert np.isnan(s[:3]).all()
    np.testing.assert_array_equal(s[7:], np.ones(3))


def _op_calls(dt):
    x = np.ones((2, 3, 4), dt)
    f64 = np.ones((2, 3, 4))
    calls = {
        "softmax": lambda: F.softmax(x),
        "relu": lambda: F.relu(x),
        "gelu": lambda: F.gelu(x),
        "layer_norm": lambda: F.layer_norm(x),
        "dropout": lambda: F.dropout(x, 0.5, 0),
        "linear-weight": lambda: F.linear(f64, np.ones((3, 4), dt)),
        "layer_norm-weight": lambda: F.layer_norm(f64, np.ones(4, dt)),
        "embedding-weight": lambda: F.embedding(np.array([0, 1]), np.ones((3, 4), dt)),
        "cross_entropy": lambda: F.cross_entropy(x, np.zeros((2, 3), int)),
        "sdpa": lambda: F.scaled_dot_product_attention(x, x, x),
        "sdpa-v": lambda: F.scaled_dot_product_attention(f64, f64, x),
        "mea": lambda: F.memory_efficient_attention(x, x, x),
    }
    for name in ("silu", "rms_norm", "rope"):
        if hasattr(F, name):
            calls[name] = (lambda fn: lambda: fn(x))(getattr(F, name))
    return calls


@pytest.mark.parametrize("dt", BAD_DTYPES)
def test_float16_refused_by_every_functional_op(dt):
    for name, call in _op_calls(dt).items():
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(TypeError, match="is not supported.*float32"):
                call()


def test_exponential_average_skips_non_finite_losses():
    from npattn.viz import _smooth

    y = np.linspace(1.0, 2.0, 20)
    ref = _smooth(np.delete(y, 3), 0.9)
    y[3] = np.nan
    s = _smooth(y, 0.9)
    assert np.isnan(s[3])
    np.testing.assert_allclose(np.delete(s, 3), ref, rtol=1e-15)
    y[3] = np.inf
    assert np.isinf(_smooth(y, 0.9)[3]) and np.isfinite(np.delete(_smooth(y, 0.9), 3)).all()


def test_optimizer_state_out_of_float32_range():
    p = npattn.Parameter(np.ones(3, np.float32))
    opt = Adam([p])
    p.grad = np.ones(3, np.float32)
    opt.step()
    sd = opt.state_dict()
    sd["state"][0]["exp_avg_sq"] = np.full(3, 1e300)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="exp_avg_sq.*float32"):
            opt.load_state_dict(sd)
    assert opt.state[0]["exp_avg_sq"].max() < 1.0


@pytest.mark.parametrize("bad", [np.zeros(3), np.zeros((4, 3), int), [0.0] * 12, "grad", "readonly"])
def test_unusable_grad_refused_before_anything_accumulates(bad):
    m = npattn.FeedForward(3, 4, rng=0)
    y = m(RNG.standard_normal((2, 3)))
    if isinstance(bad, str) and bad == "readonly":
        bad = np.zeros((4, 3))
        bad.flags.writeable = False
    m.linear1.weight.grad = bad
    before = {n: np.array(p.grad, copy=True) for n, p in m.named_parameters() if n != "linear1.weight"}
    with pytest.raises(TypeError, match=r"'linear1\.weight' has a grad"):
        m.backward(np.ones_like(y))
    for n, p in m.named_parameters():
        if n != "linear1.weight":
            np.testing.assert_array_equal(p.grad, before[n])
    m.linear1.weight.grad = None
    m.backward(np.ones_like(y))  # the state was kept

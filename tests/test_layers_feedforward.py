"""FeedForward activations (relu, gelu, gelu_tanh, silu, swiglu) and bias=False: torch parity
(float64, autograd on the explicit formula), finite differences with dropout, properties, bad input."""

import copy

import numpy as np
import pytest
from _fd import fd_gradients
from _oracles import rel_err
from hypothesis import given, settings
from hypothesis import strategies as st

import npattn
from npattn import FeedForward

seeds = st.integers(0, 2**31 - 1)
ACTS = ["relu", "gelu", "gelu_tanh", "silu", "swiglu"]


def assert_same(a, b, what=""):
    b = b.detach().numpy() if hasattr(b, "detach") else np.asarray(b)
    a = np.asarray(a, dtype=np.float64)
    assert a.shape == b.shape, (what, a.shape, b.shape)
    err = float(np.abs(a - b).max(initial=0.0) / max(np.abs(b).max(initial=0.0), 1e-3))
    assert err <= 1e-10, f"{what}: relative error {err:.3e}"


def _torch_ffn(m, torch):
    """torch parameters with m's values and the explicit formula of m's activation."""
    import torch.nn.functional as TF

    P = {n: torch.tensor(p.data, requires_grad=True) for n, p in m.named_parameters()}

    def lin(i, h):
        return TF.linear(h, P[f"linear{i}.weight"], P.get(f"linear{i}.bias"))

    def f(x):
        a = lin(1, x)
        h = {
            "relu": TF.relu,
            "gelu": TF.gelu,
            "gelu_tanh": lambda t: TF.gelu(t, approximate="tanh"),
            "silu": TF.silu,
            "swiglu": TF.silu,
        }[m.activation](a)
        if m.activation == "swiglu":
            h = h * lin(3, x)
        return lin(2, h)

    return f, P


@settings(max_examples=40, deadline=None)
@given(
    act=st.sampled_from(ACTS),
    bias=st.booleans(),
    d=st.integers(1, 4),
    d_ff=st.integers(1, 5),
    lead=st.sampled_from([(), (3,), (2, 3)]),
    seed=seeds,
)
def test_matches_torch(act, bias, d, d_ff, lead, seed):
    torch = pytest.importorskip("torch")
    m = FeedForward(d, d_ff, activation=act, bias=bias, rng=seed)
    f, P = _torch_ffn(m, torch)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(lead + (d,)) * 2
    dy = rng.standard_normal(x.shape)
    tx = torch.tensor(x, requires_grad=True)
    ty = f(tx)
    ty.backward(torch.tensor(dy))
    assert_same(m(x), ty, "output")
    assert_same(m.backward(dy), tx.grad, "dx")
    assert set(P) == {n for n, _ in m.named_parameters()}
    for n, p in m.named_parameters():
        assert_same(p.grad, P[n].grad, n)


def test_keys_and_shapes():
    sw = FeedForward(4, 6, activation="swiglu", rng=0)
    assert [(n, p.shape) for n, p in sw.named_parameters()] == [
        ("linear1.weight", (6, 4)),
        ("linear1.bias", (6,)),
        ("linear2.weight", (4, 6)),
        ("linear2.bias", (4,)),
        ("linear3.weight", (6, 4)),
        ("linear3.bias", (6,)),
    ]
    nb = FeedForward(4, 6, activation="silu", bias=False, rng=0)
    assert [n for n, _ in nb.named_parameters()] == ["linear1.weight", "linear2.weight"]
    # the same seed draws linear1 and linear2 as before linear3 existed
    relu = FeedForward(4, 6, rng=0)
    np.testing.assert_array_equal(sw.linear2.weight.data, relu.linear2.weight.data)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("bias", [True, False])
def test_gradcheck_with_dropout(act, bias):
    rng = np.random.default_rng(0)
    m = FeedForward(3, 4, activation=act, dropout=0.3, bias=bias, rng=1)
    x = rng.standard_normal((2, 3)) + 0.1  # unbatched (L, d); away from relu's kink
    report = npattn.gradcheck(m, x)
    assert report.ok, str(report)


def test_swiglu_independent_finite_differences():
    rng = np.random.default_rng(2)
    m = FeedForward(3, 4, activation="swiglu", dropout=0.4, rng=3)
    x = rng.standard_normal((2, 2, 3))
    dy = rng.standard_normal(x.shape)
    gen = m.dropout.rng
    state = copy.deepcopy(gen.bit_generator.state)

    def f(xx):
        gen.bit_generator.state = copy.deepcopy(state)
        return np.sum(m(xx) * dy)

    (num,) = fd_gradients(f, [x])
    gen.bit_generator.state = copy.deepcopy(state)
    m(x)
    assert rel_err(m.backward(dy), num) < 1e-6


@settings(max_examples=50, deadline=None)
@given(seed=seeds, d=st.integers(1, 4), d_ff=st.integers(1, 5))
def test_property_swiglu_is_the_gated_formula(seed, d, d_ff):
    rng = np.random.default_rng(seed)
    m = FeedForward(d, d_ff, activation="swiglu", rng=seed)
    x = rng.standard_normal((3, d))
    w1, b1, w2, b2, w3, b3 = (p.data for p in m.parameters())
    a = x @ w1.T + b1
    expected = ((a / (1 + np.exp(-a))) * (x @ w3.T + b3)) @ w2.T + b2
    np.testing.assert_allclose(m(x), expected, rtol=1e-12, atol=1e-13)


@settings(max_examples=50, deadline=None)
@given(seed=seeds, c=st.floats(0.1, 10.0), act=st.sampled_from(["relu", "silu", "swiglu"]))
def test_property_bias_false(seed, c, act):
    """Without biases a zero input gives a zero output; relu's block is positively homogeneous."""
    rng = np.random.default_rng(seed)
    m = FeedForward(3, 4, activation=act, bias=False, rng=seed)
    np.testing.assert_array_equal(m(np.zeros((2, 3))), 0.0)
    if act == "relu":
        x = rng.standard_normal((2, 3))
        np.testing.assert_allclose(m(c * x), c * m(x), rtol=1e-12, atol=1e-12)


def test_bad_arguments():
    with pytest.raises(ValueError, match="activation"):
        FeedForward(4, 6, activation="swish")
    with pytest.raises(ValueError, match="activation"):
        FeedForward(4, 6, activation="SwiGLU")
    with pytest.raises(TypeError, match="bias"):
        FeedForward(4, 6, bias=None)
    m = FeedForward(4, 6, activation="swiglu", rng=0)
    x = np.random.default_rng(0).standard_normal((2, 4))
    y = m(x)
    ref = copy.deepcopy(m)
    with pytest.raises(ValueError, match="x"):
        m(np.ones((2, 5)))
    with pytest.raises(TypeError, match="x"):
        m(np.ones((2, 4), bool))
    dy = np.ones_like(y)
    np.testing.assert_array_equal(m.backward(dy), ref.backward(dy))
    for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
        np.testing.assert_array_equal(p.grad, q.grad, err_msg=n)


def test_float32_stays_float32():
    m = FeedForward(3, 4, activation="swiglu", dropout=0.2, rng=0, dtype=np.float32)
    y = m(np.ones((2, 3)))
    assert y.dtype == np.float32
    assert m.backward(np.ones((2, 3))).dtype == np.float32
    assert all(p.grad.dtype == np.float32 for p in m.parameters())


@pytest.mark.parametrize("block", [None, 24, 72])  # SiLU's block of rows: whole, one row, three (of 10)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("which", ["feedforward swiglu", "gated silu", "gated gelu_pytorch_tanh", "gated relu"])
def test_gated_unit_without_grad_is_the_kept_path_bit_for_bit(which, dtype, block, monkeypatch):
    """Under no_grad the gated unit forms act(a) * b in the gate's own array (issue 32, item 5),
    SiLU's a block of rows at a time (``silu_mul_``): the same roundings as the forward that
    keeps its state, FeedForward's and GatedMLP's alike."""
    from npattn.functional import activation
    from npattn.nn.moe import GatedMLP

    if block is not None:
        monkeypatch.setattr(activation, "SILU_BLOCK", block)

    kind, act = which.split()
    if kind == "feedforward":
        m = FeedForward(8, 24, activation=act, rng=1, dtype=dtype)
    else:
        m = GatedMLP(8, 24, act, rng=1, dtype=dtype)
    x = np.random.default_rng(3).standard_normal((2, 5, 8)).astype(dtype)
    x[1, 2] *= 200.0  # gates far on both sides of 0: the sigmoid's two branches, exp(-|a|) underflowing
    kept = m(x)
    m.clear_saved()
    with npattn.no_grad():
        free = m(x)
    assert free.dtype == dtype and np.abs(kept).max() > 0
    assert np.array_equal(free, kept)
    assert np.array_equal(m(x), kept)  # and the kept path after it is unchanged


@pytest.mark.parametrize("storage", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["feedforward", "gated"])
def test_gated_unit_without_grad_multiplies_gate_and_up_as_one_matrix(kind, storage):
    """Under no_grad the gate and up weights are row blocks of one array (``fused_linears``), one
    GEMM for both (one GEMV when decoding) (issue 32, item 5): each output element is the same dot
    product, so in float64 the output is the kept path's bit for bit, at a size OpenBLAS threads
    and for one row; in float32 to its rounding (the stack is column-major, and BLAS's
    single-precision kernels sum the last few outputs of a block in another order when the matrix
    is wider; bfloat16 storage likewise); the parameters keep their values and versions; a weight
    assigned afterwards is used."""
    from npattn.models.causal_lm import store_bfloat16
    from npattn.nn.moe import GatedMLP

    dtype = np.float64 if storage == "float64" else np.float32
    if kind == "feedforward":
        m = FeedForward(96, 200, activation="swiglu", bias=True, rng=1, dtype=dtype)
        gate, up = m.linear1, m.linear3
    else:
        m = GatedMLP(96, 200, rng=1, dtype=dtype)
        gate, up = m.gate_proj, m.up_proj
    if storage == "bfloat16":
        store_bfloat16(m)
    rng = np.random.default_rng(4)
    versions = [p._version for p in m.parameters()]

    def same(free, kept):
        return np.array_equal(free, kept) if dtype == np.float64 else rel_err(free, kept) < 1e-5

    for shape in [(2, 40, 96), (1, 1, 96)]:
        x = rng.standard_normal(shape).astype(dtype)
        kept = m(x) if storage != "bfloat16" else None
        m.clear_saved()
        with npattn.no_grad():
            before = gate(x), up(x)
            free = m(x)
        if kept is not None:
            assert same(free, kept) and np.abs(kept).max() > 0
        fused = m._fused[0]
        # 400 stacked rows of 96: wider than twice the input, so stored column by column (_stacked)
        assert storage == "bfloat16" or (fused.flags.f_contiguous and not fused.flags.c_contiguous)
        for lin, y in zip((gate, up), before):
            data = lin.weight.data
            assert (data.base is fused) and data.shape == (200, 96)
            with npattn.no_grad():
                assert np.array_equal(lin(x), y)  # the same values in the stacked array
        if kept is None:  # bfloat16 storage keeps no state: the products apart are the reference, to
            # float32's rounding (its decoding product splits the rows by the matrix's height)
            with npattn.no_grad():
                h = npattn.functional.silu(before[0])[0] * before[1]
                ref = m.linear2(h) if kind == "feedforward" else m.down_proj(h)
            assert rel_err(free, ref) < 1e-5 and np.abs(ref).max() > 0
    assert [p._version for p in m.parameters()] == versions
    if storage != "bfloat16":
        up.weight.data = up.weight.data * 2  # a new array: the next call stacks the weights again
        x = rng.standard_normal((3, 96)).astype(dtype)
        kept = m(x)
        m.clear_saved()
        with npattn.no_grad():
            assert same(m(x), kept)
        assert up.weight.data.base is m._fused[0] is not fused


@pytest.mark.parametrize("heights, order", [((30, 20), "F"), ((20, 20), "C"), ((5, 5, 5), "C"), ((16, 16, 16), "F")])
def test_stacked_weights_are_column_major_where_wider_than_twice_the_input(heights, order):
    """``nn.layers._stacked``: N stacked rows of K inputs are stored column by column when N > 2 K
    (a decoding product then streams K long columns), else row by row; the values are the rows'."""
    from npattn.nn.layers import _stacked

    rng = np.random.default_rng(0)
    datas = [rng.standard_normal((n, 20)) for n in heights]
    W = _stacked(datas)
    assert W.flags[f"{order}_CONTIGUOUS"] and W.shape == (sum(heights), 20)
    np.testing.assert_array_equal(W, np.concatenate(datas))

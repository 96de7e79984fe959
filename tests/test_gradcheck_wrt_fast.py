"""``gradcheck(..., wrt=..., fast=...)``: naming what to check, and one random direction per tensor."""

import pickle
import re

import numpy as np
import pytest

import npattn
import npattn.book
import npattn.functional as F
from npattn.testing import GradcheckRow, gradcheck

RNG = np.random.default_rng(7)
X = RNG.uniform(-1, 1, (2, 3, 4))
W = RNG.uniform(-1, 1, (5, 4))
B = RNG.uniform(-1, 1, 5)


def _linear_bad_weight(dout, cache):
    dx, dw, db = F.linear_backward(dout, cache)
    dw = dw.copy()
    dw[0, 0] += 1e-3  # one wrong element
    return dx, dw, db


# -- wrt ---------------------------------------------------------------------------------------------
def test_wrt_selects_rows_functional():
    assert [r.name for r in gradcheck(F.linear, X, W, B, wrt="weight").rows] == ["weight"]
    assert [r.name for r in gradcheck(F.linear, X, W, B, wrt=["bias", "x"]).rows] == ["x", "bias"]
    rep = gradcheck((F.linear, _linear_bad_weight), X, W, B, wrt=("x", "bias"))
    assert rep.ok  # the broken weight gradient is not checked
    assert not gradcheck((F.linear, _linear_bad_weight), X, W, B, wrt="weight").ok


def test_wrt_unknown_names_list_the_valid_ones():
    with pytest.raises(ValueError, match=re.escape("valid names: ['x', 'weight', 'bias']")) as e:
        gradcheck(F.linear, X, W, B, wrt=["weight", "w"])
    assert "['w']" in str(e.value)
    m = npattn.Linear(4, 5, rng=0)
    with pytest.raises(ValueError, match=re.escape("valid names: ['input', 'weight', 'bias']")):
        gradcheck(m, X, wrt="W")
    with pytest.raises(TypeError, match="wrt"):
        gradcheck(F.linear, X, W, B, wrt=3)
    with pytest.raises(TypeError, match="wrt"):
        gradcheck(F.linear, X, W, B, wrt=["x", 3])
    with pytest.raises(ValueError, match="wrt"):
        gradcheck(F.linear, X, W, B, wrt=[])
    with pytest.raises(TypeError, match="fast"):
        gradcheck(F.linear, X, W, B, fast="yes")


def test_wrt_modules_inputs_and_parameters():
    m = npattn.MultiHeadAttention(4, 4, 2, qkv_bias=True, rng=0)
    rep = gradcheck(m, X, wrt=["out_proj.weight", "input", "W_key.bias"])
    assert rep.ok and [r.name for r in rep.rows] == ["input", "W_key.bias", "out_proj.weight"]
    q, kv = RNG.uniform(-1, 1, (2, 3, 4)), RNG.uniform(-1, 1, (2, 5, 4))
    rep = gradcheck(m, q, kv, kv.copy(), wrt="key")
    assert rep.ok and [r.name for r in rep.rows] == ["key"]


# -- keyword inputs with a gradient appended by the backward --------------------------------------
def _scaled(x, *, gain=None, shift=None):
    return x * gain + (0.0 if shift is None else shift), (x, gain)


def _scaled_backward(dout, cache):
    x, gain = cache
    return dout * gain, (dout * x).sum(axis=tuple(range(dout.ndim - gain.ndim)))


def _scaled_backward_wrong(dout, cache):
    dx, dgain = _scaled_backward(dout, cache)
    return dx, dgain * 1.01


def test_keyword_input_gradient_appended_by_the_backward():
    gain = RNG.uniform(0.5, 1.5, 4)
    rep = gradcheck((_scaled, _scaled_backward), X, gain=gain)
    assert rep.ok and [r.name for r in rep.rows] == ["x", "gain"]
    rep = gradcheck((_scaled, _scaled_backward_wrong), X, gain=gain)
    assert rep.failed == ["gain"]
    assert gradcheck((_scaled, _scaled_backward_wrong), X, gain=gain, wrt="x").ok
    # two float keyword arrays, one gradient: ambiguous unless wrt names the one
    shift = RNG.uniform(-1, 1, 4)
    with pytest.raises(ValueError, match="cannot tell"):
        gradcheck((_scaled, _scaled_backward), X, gain=gain, shift=shift)
    rep = gradcheck((_scaled, _scaled_backward), X, gain=gain, shift=shift, wrt=["x", "gain"])
    assert rep.ok and [r.name for r in rep.rows] == ["x", "gain"]
    with pytest.raises(ValueError, match=r"no gradient for \['gain'\]"):
        gradcheck((_scaled, lambda d, c: _scaled_backward(d, c)[0]), X, gain=gain, wrt=["x", "gain"])
    # a keyword bias: linear's backward returns db as its third value, paired with the keyword
    rep = gradcheck(F.linear, X, W, bias=B)
    assert rep.ok and [r.name for r in rep.rows] == ["x", "weight", "bias"]
    assert gain.dtype == np.float64 and np.isfinite(gain).all()


def test_keyword_input_float32_is_checked_in_float64_and_left_alone():
    gain = RNG.uniform(0.5, 1.5, 4).astype(np.float32)
    before = gain.copy()
    assert gradcheck((_scaled, _scaled_backward), X, gain=gain).ok
    np.testing.assert_array_equal(gain, before)


# -- fast --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "target, args, kwargs",
    [
        (F.softmax, (X,), {"axis": 1}),
        (F.linear, (X, W, B), {}),
        (F.layer_norm, (X, RNG.uniform(0.5, 1.5, 4), RNG.uniform(-1, 1, 4)), {}),
        (
            F.scaled_dot_product_attention,
            (X, RNG.uniform(-1, 1, (2, 5, 4)), RNG.uniform(-1, 1, (2, 5, 3))),
            {"is_causal": True},
        ),
        (F.gelu, (X,), {"approximate": "tanh"}),
    ],
)
def test_fast_passes_correct_backwards(target, args, kwargs):
    rep = gradcheck(target, *args, fast=True, **kwargs)
    assert rep.ok, str(rep)
    assert all(r.mode == "direction" for r in rep.rows)
    assert rep.modes == ["direction"] * len(rep.rows)
    for name in rep.analytic:
        assert np.ndim(rep.analytic[name]) == 0 and np.ndim(rep.numerical[name]) == 0


@pytest.mark.parametrize(
    "module",
    [
        npattn.Linear(4, 3, rng=0),
        npattn.MultiHeadAttention(4, 4, 2, dropout=0.3, rng=1),
        npattn.EncoderBlock(4, 2, 6, dropout=0.2, norm_first=True, rng=2),
        npattn.book.CausalAttention(4, 3, 5, 0.2, rng=3),
    ],
)
def test_fast_passes_modules(module):
    rep = gradcheck(module, X, fast=True)
    assert rep.ok, str(rep)
    assert [r.name for r in rep.rows] == ["input"] + [n for n, _ in module.named_parameters()]


def _sdpa_without_scale(dout, cache):
    dq, dk, dv = F.scaled_dot_product_attention_backward(dout, cache)
    return dq / cache.scale, dk / cache.scale, dv


def _softmax_no_sum(dout, cache):
    y = cache[0] if isinstance(cache, tuple) else cache.y
    return y * dout


def test_fast_catches_wrong_backwards():
    rep = gradcheck((F.linear, _linear_bad_weight), X, W, B, fast=True)
    assert rep.failed == ["weight"]
    q, k, v = RNG.uniform(-1, 1, (2, 3, 4)), RNG.uniform(-1, 1, (2, 5, 4)), RNG.uniform(-1, 1, (2, 5, 3))
    rep = gradcheck((F.scaled_dot_product_attention, _sdpa_without_scale), q, k, v, fast=True)
    assert rep.failed == ["q", "k"]
    for seed in range(5):  # whatever the direction
        assert gradcheck((F.linear, _linear_bad_weight), X, W, B, fast=True, seed=seed).failed == ["weight"]


def test_fast_agrees_with_the_elementwise_gradient():
    """The directional row's analytic value is <elementwise analytic gradient, u>."""
    full = gradcheck(F.linear, X, W, B)
    fast = gradcheck(F.linear, X, W, B, fast=True)
    u_rng = np.random.default_rng([0, 1])
    for name in ("x", "weight", "bias"):
        u = u_rng.standard_normal(full.analytic[name].shape)
        # the direction actually taken is (x + h u) - (x - h u) over 2h: u to rounding
        assert float(fast.analytic[name]) == pytest.approx(float(np.sum(full.analytic[name] * u)), rel=1e-9)
        assert float(fast.numerical[name]) == pytest.approx(float(np.sum(full.numerical[name] * u)), rel=1e-6)


def test_fast_costs_two_forwards_per_tensor():
    calls = []

    def counted(x, weight, bias):
        calls.append(1)
        return F.linear(x, weight, bias)

    gradcheck((counted, F.linear_backward), X, W, B, fast=True)
    assert len(calls) == 2 + 2 * 3  # the analytic forward, the determinism check, two per tensor
    calls.clear()
    gradcheck((counted, F.linear_backward), X, W, B)
    assert len(calls) == 2 + 2 * (X.size + W.size + B.size)
    calls.clear()
    gradcheck((counted, F.linear_backward), X, W, B, fast=True, wrt="bias")
    assert len(calls) == 2 + 2


def test_fast_restores_inputs_and_report_table():
    w = W.copy()
    rep = gradcheck((F.linear, _linear_bad_weight), X, w, B, fast=True)
    np.testing.assert_array_equal(w, W)
    lines = str(rep).splitlines()
    assert "one random direction per tensor" in lines[0] and lines[0].startswith("gradcheck linear: FAILED")
    assert re.fullmatch(r"name\s+\| max abs err \| max rel err \| err/tol \| worst at \| ok\s+\| mode", lines[1])
    assert all(line.rstrip().endswith("direction") for line in lines[3:-1])
    assert lines[-1].startswith("FAILED at weight (direction)")
    elem = str(gradcheck(F.linear, X, W, B)).splitlines()
    assert "per element" in elem[0] and "mode" not in elem[1]


def test_rows_unpack_as_four_and_keep_their_mode():
    row = GradcheckRow("x", 1e-9, 1e-7, True, mode="direction")
    name, a, r, ok = row
    assert (name, a, r, ok) == ("x", 1e-9, 1e-7, True) and row.mode == "direction"
    assert GradcheckRow("x", 0.0, 0.0, True).mode == "element"
    back = pickle.loads(pickle.dumps(row))
    assert back == row and back.mode == "direction"
    assert "direction" in repr(row)


def test_numerical_gradient_refuses_float16():
    from npattn.testing import numerical_gradient

    with pytest.raises(TypeError, match="float16 is not supported"):
        numerical_gradient(lambda a: float(a.sum()), np.ones(3, np.float16))

"""``npattn.gradcheck`` itself: it passes correct backwards and, above all, it can fail."""

import re

import numpy as np
import pytest
from _fd import fd_gradients

import npattn.functional as F
from npattn.nn.module import Module, Parameter
from npattn.testing import GradcheckReport, GradcheckRow, gradcheck, numerical_gradient

RNG = np.random.default_rng(2024)
X = RNG.uniform(-1, 1, (2, 3, 4))


# ------------------------------------------------------------------ functional targets


def softmax_backward_no_sum(dout, cache):
    y, axis = cache
    return y * dout  # forgets the "- sum(dy * y)" term


def test_correct_softmax_passes_and_rows_are_named():
    report = gradcheck(F.softmax, X, axis=1)
    assert report.ok and report.failed == []
    assert [r.name for r in report.rows] == ["x"]
    row = report.rows[0]
    assert isinstance(row, GradcheckRow) and row.ok
    assert row.max_abs_err < 1e-8 and row.max_rel_err < 1e-5


def test_softmax_backward_missing_sum_term_fails():
    report = gradcheck((F.softmax, softmax_backward_no_sum), X)
    assert not report.ok
    assert report.failed == ["x"]
    assert report["x"].max_rel_err > 1e-2


def _sdpa_backward_without_scale(dout, cache):
    dq, dk, dv = F.scaled_dot_product_attention_backward(dout, cache)
    return dq / cache.scale, dk / cache.scale, dv


def test_attention_backward_without_scale_fails_on_q_and_k_only():
    q, k, v = RNG.uniform(-1, 1, (2, 3, 4)), RNG.uniform(-1, 1, (2, 5, 4)), RNG.uniform(-1, 1, (2, 5, 3))
    assert gradcheck(F.scaled_dot_product_attention, q, k, v).ok
    report = gradcheck((F.scaled_dot_product_attention, _sdpa_backward_without_scale), q, k, v)
    assert not report.ok
    assert report.failed == ["q", "k"]
    assert report["v"].ok


def test_linear_wrong_bias_gradient_fails_on_bias_only():
    w, b = RNG.uniform(-1, 1, (5, 4)), RNG.uniform(-1, 1, 5)

    def backward(dout, cache):
        dx, dw, db = F.linear_backward(dout, cache)
        return dx, dw, db + 1e-3

    report = gradcheck((F.linear, backward), X, w, b)
    assert [r.name for r in report.rows] == ["x", "weight", "bias"]
    assert report.failed == ["bias"]


def test_transposed_weight_gradient_fails():
    w = RNG.uniform(-1, 1, (4, 4))

    def backward(dout, cache):
        dx, dw, db = F.linear_backward(dout, cache)
        return dx, dw.T, db

    assert gradcheck((F.linear, backward), X, w).failed == ["weight"]


@pytest.mark.parametrize("factor, ok", [(1 + 3e-6, True), (1 + 3e-5, False)])
def test_relative_tolerance_is_the_boundary(factor, ok):
    def backward(dout, cache):
        return F.gelu_backward(dout, cache) * factor

    report = gradcheck((F.gelu, backward), X + 2.0)  # gradients well away from 0
    assert report.ok is ok
    row = report.rows[0]
    assert (row.max_rel_err <= report.rtol) is row.ok
    assert row.max_rel_err == pytest.approx(abs(factor - 1) / factor, rel=0.05)


def test_small_gradients_use_the_absolute_floor():
    # the true gradient is exactly 0 and the outputs never move: by default any analytic value
    # beyond the float64 resolution of the gradient fails; an explicit atol is honoured
    def backward(dout, cache):
        return F.relu_backward(dout, cache) + 5e-9

    x = np.array([[-1.0, -2.0, -0.5]])
    assert not gradcheck((F.relu, backward), x).ok
    report = gradcheck((F.relu, backward), x, atol=1e-8)
    assert report.ok
    assert report.rows[0].max_rel_err == pytest.approx(5e-9 / (1e-8 / 1e-5), rel=1e-3)
    assert report.rows[0].tol == pytest.approx(1e-8)  # nothing moved: no rounding allowance
    assert not gradcheck((F.relu, backward), x, atol=1e-9).ok


def test_nan_gradient_fails():
    def backward(dout, cache):
        d = F.relu_backward(dout, cache).copy()
        d.flat[0] = np.nan
        return d

    report = gradcheck((F.relu, backward), X + 2)
    assert not report.ok and report.rows[0].max_abs_err == np.inf


def test_lookup_of_backward_by_name_and_missing_backward():
    def op_without_backward(x):
        return x * 2, None

    with pytest.raises(ValueError, match="op_without_backward_backward"):
        gradcheck(op_without_backward, X)


def cube(x):
    return x**3, x


def cube_backward(dout, cache):
    return 3 * cache**2 * dout


def test_backward_found_next_to_a_forward_in_any_module():
    report = gradcheck(cube, X)
    assert report.ok and report.target == "cube"


# ------------------------------------------------------------------ inputs and pairing


def test_integer_and_bool_inputs_pass_through_untouched():
    ids = np.array([[0, 2, 2], [1, 0, 2]])
    w = RNG.uniform(-1, 1, (3, 2))
    report = gradcheck(F.embedding, ids, w)
    assert report.ok and [r.name for r in report.rows] == ["weight"]
    q, k, v = RNG.uniform(-1, 1, (2, 3, 4)), RNG.uniform(-1, 1, (2, 5, 4)), RNG.uniform(-1, 1, (2, 5, 3))
    mask = RNG.random((3, 5)) < 0.6
    report = gradcheck(F.scaled_dot_product_attention, q, k, v, mask)  # positional bool mask
    assert report.ok and [r.name for r in report.rows] == ["q", "k", "v"]


def test_float32_inputs_are_checked_in_float64_and_left_alone():
    x32 = X.astype(np.float32)
    before = x32.copy()
    report = gradcheck(F.softmax, x32)
    assert report.ok and report.analytic["x"].dtype == np.float64
    assert x32.dtype == np.float32 and np.array_equal(x32, before)


def test_lists_of_floats_are_checked():
    report = gradcheck(F.softmax, [[0.5, -1.0, 2.0], [0.0, 0.1, 0.2]])
    assert report.ok and [r.name for r in report.rows] == ["x"]
    assert report.analytic["x"].shape == (2, 3)


def test_read_only_inputs_work():
    x = X.copy()
    x.setflags(write=False)
    assert gradcheck(F.gelu, x).ok


def test_positional_float_constant_is_ambiguous():
    q, k, v = RNG.uniform(-1, 1, (2, 3, 4)), RNG.uniform(-1, 1, (2, 5, 4)), RNG.uniform(-1, 1, (2, 5, 3))
    fmask = RNG.uniform(-1, 1, (3, 5))
    with pytest.raises(ValueError, match="by keyword"):
        gradcheck(F.scaled_dot_product_attention, q, k, v, fmask)
    assert gradcheck(F.scaled_dot_product_attention, q, k, v, attn_mask=fmask).ok


def test_positional_pairing_with_none_gradients():
    d = X.shape[-1]
    b = RNG.uniform(-1, 1, d)
    report = gradcheck(F.layer_norm, X, None, b)
    assert report.ok and [r.name for r in report.rows] == ["x", "bias"]


def test_wrong_gradient_shape_raises():
    def backward(dout, cache):
        return F.relu_backward(dout, cache)[0]

    with pytest.raises(ValueError, match=r"shape \(3, 4\).*\(2, 3, 4\)"):
        gradcheck((F.relu, backward), X)


def test_too_many_gradients_raise():
    def backward(dout, cache):
        g = F.relu_backward(dout, cache)
        return g, g

    with pytest.raises(ValueError, match="cannot tell"):
        gradcheck((F.relu, backward), X)


def test_bad_target_and_tolerances():
    with pytest.raises(TypeError, match="target"):
        gradcheck(42, X)
    with pytest.raises(TypeError, match="instantiate"):
        gradcheck(Module, X)
    with pytest.raises(ValueError, match="eps"):
        gradcheck(F.relu, X, eps=0.0)
    with pytest.raises(ValueError, match="rtol"):
        gradcheck(F.relu, X, rtol=-1.0)


def test_forward_that_modifies_its_input_is_refused():
    def sneaky(x):
        x *= 2
        return x.copy(), None

    def sneaky_backward(dout, cache):
        return dout * 2

    with pytest.raises(RuntimeError, match="modified its input 'x'"):
        gradcheck((sneaky, sneaky_backward), X)


# ------------------------------------------------------------------ randomness


def test_generator_kwargs_are_snapshotted():
    gen = np.random.default_rng(7)
    state = gen.bit_generator.state
    report = gradcheck(F.dropout, X, 0.5, rng=gen)
    assert report.ok
    assert gen.bit_generator.state == state  # the caller's generator is not advanced
    expected = np.random.default_rng(0).standard_normal(X.shape) * (np.random.default_rng(7).random(X.shape) >= 0.5) * 2
    np.testing.assert_allclose(report.analytic["x"], expected, rtol=0, atol=0)


def test_attention_dropout_with_a_generator():
    q, k, v = RNG.uniform(-1, 1, (2, 2, 3, 4)), RNG.uniform(-1, 1, (2, 2, 4, 4)), RNG.uniform(-1, 1, (2, 2, 4, 2))
    report = gradcheck(F.scaled_dot_product_attention, q, k, v, dropout_p=0.4, rng=np.random.default_rng(3))
    assert report.ok, str(report)


def test_uncontrolled_randomness_is_reported():
    with pytest.raises(RuntimeError, match="different outputs"):
        gradcheck(F.dropout, X, 0.5)


def test_positional_generator_is_snapshotted_too():
    gen = np.random.default_rng(1)
    state = gen.bit_generator.state
    assert gradcheck(F.dropout, X, 0.3, gen).ok
    assert gen.bit_generator.state == state


# ------------------------------------------------------------------ report


def test_report_table_format():
    w, b = RNG.uniform(-1, 1, (5, 4)), RNG.uniform(-1, 1, 5)

    def backward(dout, cache):
        dx, dw, db = F.linear_backward(dout, cache)
        return dx, dw * 1.5, db

    report = gradcheck((F.linear, backward), X, w, b)
    assert isinstance(report, GradcheckReport)
    lines = str(report).splitlines()
    assert lines[0].startswith("gradcheck linear: FAILED") and "rtol=1e-05" in lines[0]
    assert "eps=auto" in lines[0] and "atol=auto" in lines[0]
    assert re.fullmatch(r"name\s+\| max abs err \| max rel err \| err/tol \| worst at\s+\| ok", lines[1])
    assert re.fullmatch(r"[-+]+", lines[2])
    assert len(lines) == 7
    bars = {line.index("|") for line in lines[1:2] + lines[3:6]}
    assert len(bars) == 1  # columns aligned
    cells = {line.split("|")[0].strip(): [c.strip() for c in line.split("|")[1:]] for line in lines[3:6]}
    assert set(cells) == {"x", "weight", "bias"}
    assert cells["weight"][4] == "NO" and cells["x"][4] == "yes" and cells["bias"][4] == "yes"
    for name, (abs_s, rel_s, ratio_s, at_s, _) in cells.items():
        assert float(abs_s) == pytest.approx(report[name].max_abs_err, rel=1e-3)
        assert float(rel_s) == pytest.approx(report[name].max_rel_err, rel=1e-3)
        assert float(ratio_s) == pytest.approx(report[name].ratio, rel=0.05)
        assert at_s == str(report[name].at)
    # the last line points at the worst element: the weight row, where dw is 1.5 times too big
    row = report["weight"]
    assert report.worst is row and lines[6].startswith("FAILED at weight[")
    assert row.analytic_value == pytest.approx(1.5 * row.numerical_value, rel=1e-6)
    i, j = row.at
    assert row.analytic_value == report.analytic["weight"][i, j]
    assert report.failed == ["weight"]
    assert "weight" in repr(report)
    with pytest.raises(TypeError, match="report.ok"):
        bool(report)
    assert len(report) == 3 and [r.name for r in report] == ["x", "weight", "bias"]
    with pytest.raises(KeyError):
        report["nope"]


def test_numerical_gradient_helper():
    x = RNG.uniform(-1, 1, (3, 2))
    before = x.copy()
    g = numerical_gradient(lambda a: np.sum(np.sin(a) * a), x, 1e-6)
    np.testing.assert_allclose(g, np.cos(x) * x + np.sin(x), rtol=1e-8, atol=1e-10)
    assert np.array_equal(x, before)
    with pytest.raises(TypeError):
        numerical_gradient(lambda a: 0.0, np.arange(3), 1e-6)


def test_gradcheck_agrees_with_independent_fd():
    q, k, v = RNG.uniform(-1, 1, (2, 3, 4)), RNG.uniform(-1, 1, (2, 5, 4)), RNG.uniform(-1, 1, (2, 5, 3))
    report = gradcheck(F.scaled_dot_product_attention, q, k, v, is_causal=True, seed=5)
    g = np.random.default_rng(5).standard_normal((2, 3, 3))
    fd = fd_gradients(lambda a, b, c: np.sum(F.scaled_dot_product_attention(a, b, c, is_causal=True)[0] * g), [q, k, v])
    for name, n in zip("qkv", fd):
        np.testing.assert_allclose(report.numerical[name], n, rtol=0, atol=1e-9)  # summation order differs


# ------------------------------------------------------------------ module targets


class TinyLinear(Module):
    """``y = dropout(x W^T + b)``, with its own Generator."""

    def __init__(self, n_in=4, n_out=3, p=0.0, dtype=np.float32, broken=None):
        super().__init__()
        rng = np.random.default_rng(0)
        self.weight = Parameter(rng.uniform(-1, 1, (n_out, n_in)), dtype=dtype)
        self.bias = Parameter(rng.uniform(-1, 1, n_out), dtype=dtype)
        self.p = p
        self.rng = np.random.default_rng(11)
        self.broken = broken
        self._dtype = np.dtype(dtype)

    def forward(self, x, return_weights=False):
        x = np.asarray(x, dtype=self.weight.dtype)
        y, c1 = F.linear(x, self.weight.data, self.bias.data)
        y, c2 = F.dropout(y, self.p, self.rng, training=self.training)
        self.save_for_backward((c1, c2))
        return (y, "extra") if return_weights else y

    def backward(self, dy):
        c1, c2 = self.pop_saved()
        dy = F.dropout_backward(dy, c2)
        dx, dw, db = F.linear_backward(dy, c1)
        if self.broken == "bias":
            db = db * 0.5
        if self.broken == "input":
            dx = dx.T.T * 1.01
        self.accumulate_grad(self.weight, dw)
        self.accumulate_grad(self.bias, db)
        return dx


class TwoInputs(Module):
    """``y = linear(query) * key`` elementwise: two inputs and one parameter."""

    def __init__(self):
        super().__init__()
        self.proj = TinyLinear(3, 3, dtype=np.float64)

    def forward(self, query, key):
        h = self.proj(query)
        self.save_for_backward((h, key))
        return h * key, None

    def backward(self, dy):
        h, key = self.pop_saved()
        dquery = self.proj.backward(dy * key)
        return dquery, dy * h


def test_module_target_passes():
    m = TinyLinear()
    report = gradcheck(m, X.astype(np.float32))
    assert report.ok, str(report)
    assert [r.name for r in report.rows] == ["input", "weight", "bias"]


def test_module_with_dropout_generator_attribute():
    m = TinyLinear(p=0.5)
    state = m.rng.bit_generator.state
    report = gradcheck(m, X)
    assert report.ok, str(report)
    assert m.rng.bit_generator.state == state


@pytest.mark.parametrize("broken, failed", [("bias", ["bias"]), ("input", ["input"])])
def test_broken_module_fails(broken, failed):
    report = gradcheck(TinyLinear(broken=broken), X)
    assert report.failed == failed


def test_module_tuple_output_and_forward_kwargs():
    assert gradcheck(TinyLinear(), X, return_weights=True).ok


def test_module_with_submodule_and_two_inputs():
    query, key = RNG.uniform(-1, 1, (2, 3)), RNG.uniform(-1, 1, (2, 3))
    report = gradcheck(TwoInputs(), query, key)
    assert report.ok, str(report)
    assert [r.name for r in report.rows] == ["query", "key", "proj.weight", "proj.bias"]


def test_user_module_is_not_modified():
    m = TinyLinear(p=0.3, dtype=np.float32)
    m.weight.grad[...] = 0.25
    before = m.state_dict()
    grad_before = m.weight.grad.copy()
    rng_state = m.rng.bit_generator.state
    report = gradcheck(m, X)
    assert report.ok
    assert m.weight.dtype == np.float32 and m.weight.grad.dtype == np.float32 and m.dtype == np.float32
    after = m.state_dict()
    assert all(np.array_equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before)
    assert np.array_equal(m.weight.grad, grad_before)
    assert m.rng.bit_generator.state == rng_state
    assert m._cache is None
    with pytest.raises(RuntimeError):
        m.backward(np.ones((2, 3, 3)))  # no forward state was left behind on the user's module

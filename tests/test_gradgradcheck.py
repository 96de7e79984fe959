"""``npattn.testing.gradgradcheck``: second order (``backward_jvp``) against central differences of
the backward, and ``<u, Hv> = <Hu, v>`` (issue 31, item 4).

* Every pair with a second order, in both tiers, passes at every scale: inputs times 1e-3 ... 1e3
  and one element of 1e6 among O(1) ones (each tensor moved by its typical element's step, as
  gradcheck's forward mode moves it).
* Planted bugs fail: one grad_tangent element off by 1e-3 of its largest element (the report
  names that element), a grad_tangent scaled by 1 + 1e-3, a wrong ``ddout`` term, and a backward
  whose "Hessian" is not symmetric (its tangents right for it) in the symmetry row alone.
* The targets gradcheck takes: a functional forward whose ``_backward`` and ``_backward_jvp`` are
  found by name, the ``(forward, backward, backward_jvp)`` tuple, a module through its public
  ``backward_jvp`` (a user module here; a module without one is a TypeError naming it).
"""

from __future__ import annotations

import numpy as np
import pytest
from test_backward_jvp_ops import make_cases

import npattn
import npattn.functional as F
import npattn.functional.reference as R
from npattn.testing import GradcheckError, GradcheckReport, gradgradcheck

CASES = [c.name for c in make_cases(np.random.default_rng(1))]
SCALES = (1e-3, 1e-1, 1.0, 10.0, 1e3, "spike")


def _tuple(x):
    return x if isinstance(x, tuple) else (x,)


def _target(tier, case, bug=None):
    """``(forward, backward, backward_jvp)`` of ``case`` in ``tier``; ``bug(grad_tangents, cache,
    ddout) -> grad_tangents`` changes what backward_jvp returns."""
    backward = getattr(tier, case.op + "_backward")
    backward_jvp = getattr(tier, case.op + "_backward_jvp")

    def forward(*primals):
        return case.call(tier, *primals)

    def planted(dout, cache, tangents, ddout=None):
        grads, grad_tangents = backward_jvp(dout, cache, tangents, ddout)
        if bug is None:
            return grads, grad_tangents
        changed = bug(
            [None if t is None else np.array(t, dtype=np.float64) for t in _tuple(grad_tangents)], cache, ddout
        )
        return grads, tuple(changed) if isinstance(grad_tangents, tuple) else changed[0]

    forward.__name__ = case.name
    return forward, backward, planted


def _inputs(case, scale):
    primals = [np.array(p, dtype=np.float64) for p in case.primals]
    if scale == "spike":  # one element of 1e6 among O(1) ones
        primals[0].reshape(-1)[1] = 1e6
        return primals
    return [p * scale for p in primals]


def _case(name):
    return next(c for c in make_cases(np.random.default_rng(1)) if c.name == name)


# -------------------------------------------------------------------- no false failures


@pytest.mark.parametrize("name", CASES)
def test_correct_pairs_pass_at_every_scale(name):
    """Both tiers, every scale: every row passes, and every row checked something (the moved
    tensors are the inputs and dout, the gradients every result of the backward)."""
    case = _case(name)
    for tier in (F, R):
        for scale in SCALES:
            report = gradgradcheck(_target(tier, case), *_inputs(case, scale))
            assert report.ok, f"{tier.__name__} scale {scale}\n{report}"
            n = len(case.primals)
            assert report.modes == ["backward_jvp"] * (n * (n + 1)) + ["symmetry"], report
            assert str(report).startswith(f"gradgradcheck {name}: ok"), report


@pytest.mark.parametrize("seed", range(4))
def test_correct_pairs_pass_for_other_seeds(seed):
    """Other upstream gradients and tangents (``seed``) and other inputs: no false failure."""
    for case in make_cases(np.random.default_rng(100 + seed)):
        report = gradgradcheck(_target(F, case), *case.primals, seed=seed)
        assert report.ok, report


def test_functional_forward_finds_its_pairs_by_name():
    x = np.random.default_rng(0).standard_normal((3, 4))
    for tier in (F, R):
        report = gradgradcheck(tier.softmax, x, axis=0)
        assert report.ok, report
        assert [r.name for r in report.rows] == ["dx along x", "dx along dout", "hessian"]
    w, b = np.random.default_rng(1).standard_normal((2, 4)), np.random.default_rng(2).standard_normal(2)
    report = gradgradcheck(F.linear, x, w, b)
    assert report.ok, report
    assert report["dweight along x"].mode == "backward_jvp"
    assert {r.name for r in report.rows} >= {"dx along weight", "dbias along dout", "hessian"}


def test_scalar_loss_hessian_is_symmetric():
    """cross_entropy with reduction mean: a scalar loss, H its Hessian."""
    rng = np.random.default_rng(3)
    logits, targets = rng.standard_normal((5, 7)), rng.integers(0, 7, 5)
    report = gradgradcheck(F.cross_entropy, logits, targets, label_smoothing=0.1)
    assert report.ok, report
    row = report.row("hessian", "symmetry")
    assert row.ok and abs(row.analytic_value) > 1e-3  # <u, Hv>: a real number, not a zero checked
    assert abs(row.analytic_value - row.numerical_value) <= row.tol


def test_inputs_untouched():
    rng = np.random.default_rng(4)
    x, w = rng.standard_normal((2, 3)), rng.standard_normal((4, 3))
    x0, w0 = x.copy(), w.copy()
    assert gradgradcheck(F.linear, x, w).ok
    assert np.array_equal(x, x0) and np.array_equal(w, w0)


# -------------------------------------------------------------------- planted bugs

# where the point leaves nothing to resolve: every softmax row saturated at 1e3 (gradients and
# their tangents of 1e-65, far below the rounding of the terms y g that the backward adds up;
# gradcheck cannot see a wrong gradient there either); everything ignored (ce_all_ignored_mean:
# the gradient and its tangent are exactly zero) is left out of the test; xielu at 1e3: its raw
# alpha_n near -460 leaves softplus' sigmoid at 0 to the last digit, so alpha_n's gradient and its
# tangents are 0 and no planted error in them shows; xielu's spike: x^2 of 1e12 sets the check's
# tolerance (atol=auto) far above alpha_n's terms, whose rows are of 1e-2; clamp to [-0.3, 0.3] at 10
# and 1e3: every entry lies outside the bounds, where the gradient and its tangents are exactly 0
# (clamp_max keeps its negative entries, inside, at every scale)
UNRESOLVED = {("softmax", 1e3), ("softmax_axis0", 1e3), ("softmax_inf", 1e3), ("xielu", 1e3), ("xielu", "spike")}
UNRESOLVED |= {("clamp", 10.0), ("clamp", 1e3)}


def _element_bug(part, index):
    def bug(tangents, cache, ddout):
        t = tangents[part % len([t for t in tangents if t is not None])]
        t.reshape(-1)[index % t.size] += 1e-3 * np.max(np.abs(t))
        return tangents

    return bug


def _scale_bug(part):
    def bug(tangents, cache, ddout):
        k = part % len(tangents)
        tangents[k] = tangents[k] * (1 + 1e-3)
        return tangents

    return bug


def _ddout_bug(tier, case, part):
    """The ``ddout`` term (``backward(ddout)``, the backward being linear in dout) 1e-3 too large."""

    def bug(tangents, cache, ddout):
        if ddout is not None:
            k = part % len(tangents)
            tangents[k] = tangents[k] + 1e-3 * np.asarray(_tuple(getattr(tier, case.op + "_backward")(ddout, cache))[k])
        return tangents

    return bug


@pytest.mark.parametrize("name", [n for n in CASES if n != "ce_all_ignored_mean"])
def test_planted_bugs_fail(name):
    case = _case(name)
    n = len(case.primals)
    for tier in (F, R):
        for scale in SCALES:
            if (name, scale) in UNRESOLVED:
                continue
            inputs = _inputs(case, scale)
            for part in range(n):
                for bug in (_element_bug(part, 7), _scale_bug(part), _ddout_bug(tier, case, part)):
                    report = gradgradcheck(_target(tier, case, bug), *inputs)
                    assert not report.ok, f"{tier.__name__} scale {scale} part {part}\n{report}"
                    assert "FAILED" in str(report).splitlines()[0]


def test_wrong_element_is_named():
    """The failing row is the gradient whose tangent is wrong, its worst element the planted one."""
    case = _case("layer_norm")
    x, w, b = case.primals
    index = 3
    report = gradgradcheck(_target(F, case, _element_bug(1, index)), x, w, b)  # dweight's tangent
    failed = [r for r in report.rows if not r.ok and r.mode == "backward_jvp"]
    assert failed and all(r.name.startswith("dinput1 along") for r in failed), report
    assert not report["hessian"].ok  # a tangent changed in one place: H no longer symmetric
    assert all(r.at == np.unravel_index(index, w.shape) for r in failed), report
    where = max(failed, key=lambda r: r.ratio).where()
    assert where.startswith(f"dinput1[{index}] along input") and "(backward_jvp): backward_jvp " in where, where
    assert f"FAILED at {report.worst.where()}" in str(report)
    with pytest.raises(GradcheckError) as e:
        gradgradcheck(_target(F, case, _element_bug(1, index)), x, w, b, raise_exception=True)
    assert e.value.report.failed == report.failed


def test_wrong_ddout_term_fails_along_dout_only():
    case = _case("softmax")
    report = gradgradcheck(_target(F, case, _ddout_bug(F, case, 0)), *case.primals)
    assert report.failed == ["dinput0 along dout"], report


def _quadratic(skew):
    """``f(x) = x^T A x / 2`` (A symmetric) whose backward returns ``dout B x``, ``B = A + skew
    max|A| K`` (K antisymmetric, max|K| = 1): with ``skew`` != 0 no gradient of anything, but
    ``backward_jvp`` is right for that backward."""
    rng = np.random.default_rng(5)
    a = rng.standard_normal((6, 6))
    a = a + a.T
    k = rng.standard_normal((6, 6))
    b = a + skew * np.max(np.abs(a)) * (k - k.T) / np.max(np.abs(k - k.T))

    def quadratic(x):
        return 0.5 * x @ a @ x, x

    def quadratic_backward(dout, x):
        return dout * (b @ x)

    def quadratic_backward_jvp(dout, x, tangents, ddout=None):
        (tx,) = tangents
        grad = dout * (b @ x)
        tangent = (0 if tx is None else dout * (b @ tx)) + (0 if ddout is None else ddout * (b @ x))
        return grad, np.asarray(tangent, dtype=np.float64) * np.ones(6)

    return (quadratic, quadratic_backward, quadratic_backward_jvp), rng.standard_normal(6)


def test_symmetry_catches_a_backward_that_is_no_gradient():
    target, x = _quadratic(0.0)
    report = gradgradcheck(target, x)
    assert report.ok, report
    target, x = _quadratic(1e-3)
    report = gradgradcheck(target, x)
    assert report.failed == ["hessian"], report
    row = report["hessian"]
    assert row.mode == "symmetry" and row.where().startswith("hessian (symmetry): <u, Hv> ")


# -------------------------------------------------------------------- modules


class _P(npattn.Parameter):
    """A parameter that can hold ``grad_tangent`` (until Parameter has it)."""


class TanhLinear(npattn.Module):
    """``y = tanh(x W^T)`` (``reduce=True``: its mean, a scalar loss) with the contract's
    ``backward_jvp(dy, *input_tangents, param_tangents=None, ddy=None) -> (dx, dx_tangent)``."""

    def __init__(self, d_in, d_out, reduce=False, bug=None):
        super().__init__()
        self.weight = _P(np.random.default_rng(7).standard_normal((d_out, d_in)) / np.sqrt(d_in))
        self.reduce, self.bug = reduce, bug

    def forward(self, x):
        y = np.tanh(x @ self.weight.data.T)
        self.save_for_backward((x, y))
        return y.mean() if self.reduce else y

    def _dz(self, dy, y):
        return (np.broadcast_to(dy / y.size, y.shape) if self.reduce else dy) * (1 - y * y)

    def backward(self, dy):
        x, y = self.pop_saved()
        dz = self._dz(dy, y)
        self.accumulate_grad(self.weight, dz.T @ x)
        return dz @ self.weight.data

    def backward_jvp(self, dy, tx=None, param_tangents=None, ddy=None):
        x, y = self.pop_saved()
        w = self.weight.data
        tw = (param_tangents or {}).get("weight")
        tz = (0 if tx is None else tx @ w.T) + (0 if tw is None else x @ tw.T)
        dz = self._dz(dy, y)
        # dz = dy' (1 - y^2): its tangent is ddy' (1 - y^2) - 2 dy' y ty, ty = (1 - y^2) tz
        tdz = -2 * self._dz(dy, y) * y * tz + (0 if ddy is None else self._dz(ddy, y))
        tdz = np.broadcast_to(tdz, y.shape)
        dw_t = tdz.T @ x + (0 if tx is None else dz.T @ tx)
        if self.bug == "weight":
            dw_t = dw_t * (1 + 1e-3)
        self.accumulate_grad(self.weight, dz.T @ x)
        p = self.weight
        p.grad_tangent = dw_t if getattr(p, "grad_tangent", None) is None else p.grad_tangent + dw_t
        dx_t = tdz @ w + (0 if tw is None else dz @ tw)
        return dz @ w, dx_t


def test_module_through_its_backward_jvp():
    x = np.random.default_rng(8).standard_normal((4, 3))
    for reduce in (False, True):
        m = TanhLinear(3, 5, reduce=reduce)
        w0 = m.weight.data.copy()
        report = gradgradcheck(m, x)
        assert report.ok, report
        assert {r.name for r in report.rows} == {
            "dinput along input",
            "dweight along input",
            "dinput along weight",
            "dweight along weight",
            "dinput along dy",
            "dweight along dy",
            "hessian",
        }
        assert np.array_equal(m.weight.data, w0) and getattr(m.weight, "grad_tangent", None) is None
    assert gradgradcheck(m, x, wrt="dy").modes == ["backward_jvp"] * 2  # no input moved: no symmetry row


def test_module_planted_bug_in_grad_tangent():
    x = np.random.default_rng(9).standard_normal((4, 3))
    report = gradgradcheck(TanhLinear(3, 5, bug="weight"), x)
    assert set(report.failed) == {"dweight along input", "dweight along weight", "dweight along dy", "hessian"}, report


class Doubling(npattn.Module):
    """First order only (``Module.backward_jvp``, where the base class has it, finds no hook)."""

    def forward(self, x):
        self.save_for_backward(None)
        return 2 * x

    def backward(self, dy):
        self.pop_saved()
        return 2 * dy


class NoSecondOrder(Doubling):
    backward_jvp = None  # no method at all


class Unfinished(Doubling):
    def backward_jvp(self, dy, *input_tangents, param_tangents=None, ddy=None):
        raise NotImplementedError("Unfinished has no _backward_jvp")


def test_module_without_second_order_is_a_type_error():
    x = np.ones((2, 3))
    for m in (NoSecondOrder(), Unfinished()):
        with pytest.raises(TypeError, match=rf"target: {type(m).__name__}.*backward_jvp\(dy, \*input_tangents"):
            gradgradcheck(m, x)
    with pytest.raises(TypeError, match=r"target: Doubling.*backward_jvp"):
        gradgradcheck(Doubling(), x)


# -------------------------------------------------------------------- the targets and errors


def square(x):
    return x * x, x


def square_backward(dout, x):
    return 2 * dout * x


def test_function_without_backward_jvp_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="no 'square_backward_jvp' next to 'square'"):
        gradgradcheck(square, np.ones(3))


def test_pair_form():
    def square_backward_jvp(dout, x, tangents, ddout=None):
        (tx,) = tangents
        tangent = (0 if tx is None else 2 * dout * tx) + (0 if ddout is None else 2 * ddout * x)
        return square_backward(dout, x), tangent * np.ones_like(x)

    x = np.random.default_rng(10).standard_normal(5)
    report = gradgradcheck((square, square_backward, square_backward_jvp), x)
    assert report.ok and isinstance(report, GradcheckReport), report
    assert report.failed == [] and len(report) == 3
    with pytest.raises(TypeError, match=r"\(forward, backward, backward_jvp\).*needs backward_jvp"):
        gradgradcheck((square, square_backward), x)


def test_argument_errors():
    x = np.ones(3)
    with pytest.raises(TypeError, match="got the class Linear"):
        gradgradcheck(npattn.Linear, x)
    with pytest.raises(TypeError, match="target: expected a forward function"):
        gradgradcheck(3, x)
    with pytest.raises(ValueError, match="seed"):
        gradgradcheck(F.softmax, x, seed=-1)
    with pytest.raises(ValueError, match="inputs: expected at least one"):
        gradgradcheck(F.softmax)
    with pytest.raises(ValueError, match="eps"):
        gradgradcheck(F.softmax, x, eps=0.0)
    with pytest.raises(TypeError, match="raise_exception"):
        gradgradcheck(F.softmax, x, raise_exception="yes")
    with pytest.raises(ValueError, match=r"wrt: unknown name\(s\) \['y'\]"):
        gradgradcheck(F.softmax, x, wrt=["y"])


def test_wrt_picks_the_moved_tensors():
    rng = np.random.default_rng(11)
    x, w = rng.standard_normal((2, 3)), rng.standard_normal((4, 3))
    assert [r.name for r in gradgradcheck(F.linear, x, w, wrt="dout").rows] == ["dx along dout", "dweight along dout"]
    assert [r.name for r in gradgradcheck(F.linear, x, w, wrt=["weight"]).rows] == [
        "dx along weight",
        "dweight along weight",
        "hessian",
    ]


def test_bad_backward_jvp_results():
    x = np.ones(3)

    def not_a_pair(dout, cache, tangents, ddout=None):
        return F.relu_backward(dout, cache)

    with pytest.raises(TypeError, match=r"not_a_pair: expected it to return \(grads, grad_tangents\)"):
        gradgradcheck((F.relu, F.relu_backward, not_a_pair), x)

    def wrong_shape(dout, cache, tangents, ddout=None):
        return F.relu_backward(dout, cache), np.zeros(4)

    with pytest.raises(ValueError, match=r"wrong_shape: the tangent of the gradient of 'x' has shape \(4,\), expected"):
        gradgradcheck((F.relu, F.relu_backward, wrong_shape), x)

    def too_many(dout, cache, tangents, ddout=None):
        return F.relu_backward(dout, cache), (np.zeros(3), np.zeros(3))

    with pytest.raises(ValueError, match=r"too_many returned 2 grad_tangent\(s\), expected 1"):
        gradgradcheck((F.relu, F.relu_backward, too_many), x)

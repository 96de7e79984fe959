"""``gradcheck``'s forward mode (``mode="fwd"/"both"``), float32 mode, ``raise_exception`` and
the report's pointer at the worst element: each can fail, and fails where the bug is."""

import pickle

import numpy as np
import pytest

import npattn
import npattn.functional as F
from npattn.testing import GradcheckError, GradcheckRow, gradcheck

RNG = np.random.default_rng(7)
X = RNG.standard_normal((3, 4))


# a tiny op with all three derivatives written by hand: y = x**3 * w (w broadcast over rows)
def cubew(x, w):
    return x**3 * w, (x, w)


def cubew_backward(dout, cache):
    x, w = cache
    return 3 * x**2 * w * dout, np.sum(x**3 * dout, axis=0)


def cubew_jvp(cache, tx=None, tw=None):
    x, w = cache
    t = np.zeros_like(x)
    if tx is not None:
        t = t + 3 * x**2 * w * tx
    if tw is not None:
        t = t + x**3 * tw
    return t


W = RNG.uniform(0.5, 1.5, 4)


@pytest.mark.parametrize("mode", ["rev", "fwd", "both"])
def test_a_local_op_passes_in_every_mode(mode):
    rep = gradcheck(cubew, X, W, mode=mode)
    assert rep.ok, str(rep)
    expected = {"rev": ["element"], "fwd": ["jvp"], "both": ["element", "jvp", "transpose"]}[mode]
    assert rep.modes == expected * 2 and [r.name for r in rep.rows] == ["x"] * len(expected) + ["w"] * len(expected)
    if mode != "rev":
        jrow = rep.row("x", "jvp")
        assert len(jrow.at) == 2  # an index into the output


def test_fwd_catches_a_wrong_jvp_and_both_catches_the_mismatch_with_backward():
    def jvp_missing_w_term(cache, tx=None, tw=None):
        return cubew_jvp(cache, tx, None)

    def jvp_scaled(cache, tx=None, tw=None):
        return cubew_jvp(cache, tx, tw) * (1 + 1e-3)

    rep = gradcheck((cubew, cubew_backward, jvp_missing_w_term), X, W, mode="fwd")
    assert rep.failed == ["w"] and rep.worst.mode == "jvp" and rep.worst.name == "w"
    rep = gradcheck((cubew, cubew_backward, jvp_scaled), X, W, mode="both")
    assert not rep.row("x", "jvp").ok and not rep.row("x", "transpose").ok
    assert rep.row("x", "element").ok  # the backward is right


def test_transposition_is_exact_enough_to_see_a_tiny_error():
    """FD cannot see a 1e-9 relative error; <g, Jv> = <J^T g, v> can."""

    def jvp_tiny(cache, tx=None, tw=None):
        return cubew_jvp(cache, tx, tw) * (1 + 1e-9)

    rep = gradcheck((cubew, cubew_backward, jvp_tiny), X, W, mode="both")
    assert rep.row("x", "jvp").ok and rep.row("w", "jvp").ok
    assert rep.failed == ["x", "w"] and {r.mode for r in rep.rows if not r.ok} == {"transpose"}


def double(x):
    return x * 2, None


def double_backward(dout, cache):
    return dout * 2


def test_fwd_needs_a_jvp():
    with pytest.raises(ValueError, match="double_jvp"):
        gradcheck(double, X, mode="fwd")
    with pytest.raises(ValueError, match="forward, backward, jvp"):
        gradcheck((double, double_backward), X, mode="both")
    assert gradcheck(double, X).ok  # rev needs none


@pytest.mark.parametrize(
    "op, args, kwargs",
    [
        (F.softmax, (X,), {}),
        (F.layer_norm, (RNG.standard_normal((2, 3, 8)), RNG.standard_normal(8), RNG.standard_normal(8)), {}),
        (F.rms_norm, (RNG.standard_normal((2, 3, 8)), RNG.standard_normal(8)), {}),
        (F.linear, (RNG.standard_normal((2, 3)), RNG.standard_normal((4, 3)), RNG.standard_normal(4)), {}),
        (F.rope, (RNG.standard_normal((2, 3, 6)),), {}),
        (F.gelu, (X,), {}),
        (F.silu, (X,), {}),
        (F.embedding, (np.array([[0, 2], [1, 1]]), RNG.standard_normal((3, 4))), {}),
        (F.cross_entropy, (RNG.standard_normal((4, 5)), np.array([0, 4, 2, 2])), {}),
        (F.dropout, (X, 0.3, np.random.default_rng(1)), {}),
    ],
    ids=lambda v: getattr(v, "__name__", None),
)
def test_functional_pairs_pass_both_modes(op, args, kwargs):
    rep = gradcheck(op, *args, mode="both", **kwargs)
    assert rep.ok, str(rep)
    assert "transpose" in rep.modes


def test_attention_passes_both_modes():
    q, k, v = RNG.standard_normal((2, 3, 4)), RNG.standard_normal((2, 5, 4)), RNG.standard_normal((2, 5, 3))
    for op in (F.scaled_dot_product_attention, F.memory_efficient_attention):
        rep = gradcheck(op, q, k, v, mode="both", fast=True)
        assert rep.ok, str(rep)


@pytest.mark.parametrize(
    "make, x",
    [
        (lambda: npattn.Linear(4, 3, rng=0), X),
        (lambda: npattn.LayerNorm(4), X),
        (lambda: npattn.RMSNorm(4), X),
        (lambda: npattn.Dropout(0.3, rng=2), X),
        (lambda: npattn.FeedForward(4, 6, activation="swiglu", dropout=0.2, rng=1), X),
        (lambda: npattn.FeedForward(4, 6, activation="gelu", rng=1), X),
        (lambda: npattn.Embedding(5, 3, padding_idx=1, rng=0), np.array([[0, 0, 4], [2, 2, 3]])),
        (lambda: npattn.Sequential(npattn.Linear(4, 4, rng=0), npattn.LayerNorm(4), npattn.Linear(4, 2, rng=1)), X),
    ],
    ids=["Linear", "LayerNorm", "RMSNorm", "Dropout", "FFN-swiglu", "FFN-gelu", "Embedding", "Sequential"],
)
def test_modules_pass_both_modes(make, x):
    rep = gradcheck(make(), x, mode="both")
    assert rep.ok, str(rep)
    assert set(rep.modes) == {"element", "jvp", "transpose"}


class _Square(npattn.Module):
    """A user module with a backward and no forward mode."""

    def forward(self, x):
        self.save_for_backward(x)
        return x * x

    def backward(self, dy):
        return 2 * self.pop_saved() * dy


def test_module_without_jvp_says_so():
    with pytest.raises(NotImplementedError, match="_Square has no forward mode"):
        gradcheck(_Square(), X, mode="fwd")
    assert gradcheck(_Square(), X).ok


# ----------------------------------------------------------------------------- float32 mode


@pytest.mark.parametrize(
    "target, args",
    [
        (F.softmax, (X * 5,)),
        (F.layer_norm, (RNG.standard_normal((2, 3, 16)) * 3, RNG.standard_normal(16), RNG.standard_normal(16))),
        (F.scaled_dot_product_attention, tuple(RNG.standard_normal((2, n, 8)) for n in (3, 5, 5))),
        (npattn.FeedForward(4, 8, activation="gelu", rng=0), (X,)),
        (npattn.MultiHeadAttention(4, 4, 2, rng=0), (RNG.standard_normal((2, 3, 4)),)),
    ],
    ids=["softmax", "layer_norm", "sdpa", "FeedForward", "MHA"],
)
def test_float32_path_agrees_with_float64(target, args):
    rep = gradcheck(target, *args, dtype=np.float32)
    assert rep.ok, str(rep)
    assert rep.rows[0].name == "output" and set(rep.modes) == {"float32"}
    assert rep.dtype == "float32" and "float32 against float64" in str(rep)
    assert rep.rtol == 64 * np.finfo(np.float32).eps


def test_float32_mode_with_jvps():
    rep = gradcheck(npattn.LayerNorm(6), RNG.standard_normal((2, 6)), dtype=np.float32, mode="both")
    assert rep.ok, str(rep)
    assert [r.name for r in rep.rows] == ["output", "input", "jvp input", "weight", "jvp weight", "bias", "jvp bias"]


def test_float32_mode_catches_a_lossy_path():
    def softmax_fp16(x, axis=-1):  # a float32 path that secretly rounds to half precision
        y, cache = F.softmax(x, axis)
        return (y.astype(np.float16).astype(y.dtype) if y.dtype == np.float32 else y), cache

    def softmax_fp16_backward(dout, cache):
        return F.softmax_backward(dout, cache)

    rep = gradcheck((softmax_fp16, softmax_fp16_backward), X, dtype=np.float32)
    assert rep.failed == ["output"]


def test_float32_mode_catches_a_float64_leak():
    def leaky(x):
        y, cache = F.silu(x)
        return y.astype(np.float64), cache  # not float32 end to end

    def leaky_backward(dout, cache):
        return F.silu_backward(dout.astype(np.float32), cache)

    rep = gradcheck((leaky, leaky_backward), X, dtype=np.float32)
    assert rep.failed == ["output"] and "expected float32" in rep["output"].note
    assert "expected float32" in str(rep)


def test_float32_mode_catches_a_gradient_bug_of_the_float32_path():
    def backward(dout, cache):
        dx = F.gelu_backward(dout, cache)
        return dx * np.float32(1 + 1e-4) if dx.dtype == np.float32 else dx

    assert gradcheck((F.gelu, backward), X, dtype=np.float32).failed == ["x"]
    # a bug shared by both paths fails too: the float32 gradient is compared with central
    # differences of the float64 forward, not with the float64 path's gradient
    assert gradcheck((F.gelu, lambda d, c: F.gelu_backward(d, c) * 1.1), X, dtype=np.float32).failed == ["x"]


# ----------------------------------------------------------------------------- report, raise


def test_raise_exception_carries_the_report():
    def backward(dout, cache):
        d = F.softmax_backward(dout, cache).copy()
        d[1, 2] += 1e-3 * np.abs(d).max()
        return d

    with pytest.raises(GradcheckError) as info:
        gradcheck((F.softmax, backward), X, raise_exception=True)
    rep = info.value.report
    assert not rep.ok and rep.worst.at == (1, 2) and "FAILED at x[1, 2]" in str(info.value)
    assert isinstance(info.value, AssertionError)
    assert gradcheck(F.softmax, X, raise_exception=True).ok  # nothing raised when right


def test_worst_row_and_where():
    rep = gradcheck(F.softmax, X)
    w = rep.worst
    assert w is rep.rows[0] and w.ratio <= 1 and rep.ok
    assert w.where().startswith("x[") and "analytic" in w.where() and "numerical" in w.where()
    assert str(rep).splitlines()[-1] == "worst: " + w.where()


def test_row_fields_and_pickling():
    row = GradcheckRow("x", 1e-9, 1e-7, True, mode="jvp", at=(1, 2), analytic_value=1.0, numerical_value=1.0, tol=2e-9)
    assert tuple(row) == ("x", 1e-9, 1e-7, True)
    back = pickle.loads(pickle.dumps(row))
    assert back.at == (1, 2) and back.mode == "jvp" and back.tol == 2e-9
    with pytest.raises(TypeError, match="unknown field"):
        GradcheckRow("x", 0.0, 0.0, True, colour="red")
    rep = gradcheck(cubew, X, W, mode="both")
    with pytest.raises(KeyError, match="no row"):
        rep.row("x", "float32")


@pytest.mark.parametrize(
    "kw, err, match",
    [
        (dict(mode="backward"), ValueError, "mode"),
        (dict(mode=None), ValueError, "mode"),
        (dict(dtype=np.float16), ValueError, "dtype"),
        (dict(dtype="nope"), TypeError, "dtype"),
        (dict(raise_exception="yes"), TypeError, "raise_exception"),
        (dict(eps=0.0), ValueError, "eps"),
        (dict(rtol=-1.0), ValueError, "rtol"),
        (dict(atol="1"), TypeError, "atol"),
    ],
)
def test_bad_options(kw, err, match):
    with pytest.raises(err, match=match):
        gradcheck(F.softmax, X, **kw)


def test_explicit_step_is_honoured():
    rep = gradcheck(F.softmax, X, eps=1e-4)
    assert rep.ok and rep.rows[0].step == 1e-4 and "eps=0.0001" in str(rep)
    auto = gradcheck(F.softmax, X * 8)
    assert auto.rows[0].step == 2.0 ** round(np.log2(2.0 ** (-52 / 3) * np.sqrt(np.mean((X * 8) ** 2))))


def test_jvp_of_the_wrong_shape_is_refused():
    def bad_jvp(cache, tx=None, tw=None):
        return cubew_jvp(cache, tx, tw)[:1]

    with pytest.raises(ValueError, match="JVP along 'x' has shape"):
        gradcheck((cubew, cubew_backward, bad_jvp), X, W, mode="fwd")


def test_float32_mode_needs_a_jvp_for_fwd():
    with pytest.raises(ValueError, match="forward mode"):
        gradcheck((double, double_backward), X, dtype=np.float32, mode="fwd")
    rep = gradcheck(double, X, dtype=np.float32)  # rev needs none
    assert rep.ok and [r.name for r in rep.rows] == ["output", "x"]


def test_empty_inputs_and_an_empty_report():
    rep = gradcheck(F.softmax, np.zeros((0, 3)))
    assert rep.ok and rep.rows[0].max_abs_err == 0.0
    empty = npattn.GradcheckReport([])
    assert empty.ok and empty.worst is None and empty.modes == [] and len(empty) == 0
    rep = gradcheck(cubew, X, W, mode="both")
    assert rep[1] is rep.rows[1] and rep.modes[:3] == ["element", "jvp", "transpose"]
    assert "err/tol" in str(rep) and "mode" in str(rep).splitlines()[1]


def test_infinite_mask_entries_are_not_stepped():
    q, k, v = RNG.standard_normal((1, 2, 3)), RNG.standard_normal((1, 3, 3)), RNG.standard_normal((1, 3, 2))
    mask = np.array([[0.0, -np.inf, 0.5], [0.2, 0.0, -np.inf]])
    for fast in (False, True):
        rep = gradcheck(F.scaled_dot_product_attention, q, k, v, attn_mask=mask, mask_grad=True, fast=fast)
        assert rep.ok and [r.name for r in rep.rows] == ["q", "k", "v", "attn_mask"], str(rep)


@pytest.mark.parametrize("fast", [False, True])
def test_a_coarse_step_is_rescued_by_the_second_look_but_a_bug_is_not(fast):
    """With eps=3e-3 the truncation error (~1e-6 relative) exceeds rtol; the second look at half
    the step sees the two estimates differ by three times the smaller step's error and allows it.
    A wrong gradient agrees with itself at both steps and still fails."""
    x = X * 2
    rep = gradcheck(F.gelu, x, eps=3e-3, fast=fast)
    assert rep.ok, str(rep)
    assert rep.rows[0].step == 3e-3
    bad = gradcheck((F.gelu, lambda d, c: F.gelu_backward(d, c) * (1 + 1e-3)), x, eps=3e-3, fast=fast)
    assert not bad.ok


def test_a_kink_within_a_step_is_passed_over_by_the_third_look():
    """relu at x = 1e-6: the automatic step (2**-17 for inputs of unit scale) and its half both
    straddle the kink, a step 64 times smaller does not."""
    x = np.array([[0.9, -1.2, 1e-6], [-0.7, 1.1, -1e-6]])
    x = x / np.sqrt(np.mean(x**2))  # unit scale: h = 2**-17
    assert gradcheck(F.relu, x).rows[0].step == 2.0**-17
    for fast in (False, True):
        rep = gradcheck(F.relu, x, fast=fast)
        assert rep.ok, str(rep)
    rep = gradcheck(F.relu, x, mode="fwd")
    assert rep.ok, str(rep)

    def off_at_the_kink(dout, cache):
        d = F.relu_backward(dout, cache).copy()
        d[0, 2] *= 1 + 1e-3
        return d

    rep = gradcheck((F.relu, off_at_the_kink), x)
    assert not rep.ok and rep.worst.at == (0, 2)

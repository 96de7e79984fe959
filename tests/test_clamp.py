"""``functional.clamp`` (torch's ``clamp``; OLMo's and OLMoE's ``clip_qkv``): values, the gradient's
convention at the bounds (1 there, as torch: the mask is ``min <= x <= max``) against torch, the
backward, forward mode and second order against central differences in both tiers, the kernels,
and bad input refused by name."""

import numpy as np
import pytest

import npattn.functional as F
import npattn.functional.reference as R
from npattn.functional import kernels as K
from npattn.testing import gradcheck, gradgradcheck

LO, HI = -0.4, 0.6


def _x(seed, shape=(3, 5)):
    """Entries on both sides of both bounds, none within 0.05 of one (the kinks)."""
    x = np.random.default_rng(seed).uniform(-1.5, 1.5, shape)
    near = (np.abs(x - LO) < 0.05) | (np.abs(x - HI) < 0.05)
    return np.where(near, 0.1, x)


_CLAMP = (lambda x: F.clamp(x, LO, HI), F.clamp_backward, F.clamp_jvp)
_CLAMP_SECOND = (_CLAMP[0], F.clamp_backward, F.clamp_backward_jvp)


def test_values_cache_and_gradient_at_the_bounds():
    x = np.array([-2.0, LO, 0.1, HI, 3.0, np.nan])
    for M in (F, R):
        y, cache = M.clamp(x, LO, HI)
        np.testing.assert_array_equal(y, [LO, LO, 0.1, HI, HI, np.nan])
        # the bounds themselves pass the gradient (torch's convention); NaN does not
        np.testing.assert_array_equal(M.clamp_backward(np.full(6, 3.0), cache), [0, 3, 3, 3, 0, 0])
        np.testing.assert_array_equal(M.clamp_jvp(cache, np.full(6, 2.0)), [0, 2, 2, 2, 0, 0])
        grads, tdx = M.clamp_backward_jvp(np.full(6, 3.0), cache, (np.ones(6),), np.full(6, 5.0))
        np.testing.assert_array_equal(grads, [0, 3, 3, 3, 0, 0])
        np.testing.assert_array_equal(tdx, [0, 5, 5, 5, 0, 0])
    y32, c32 = F.clamp(np.ones(3, np.float32) * 2, None, 1.0)
    assert y32.dtype == np.float32 and F.clamp_backward(np.ones(3, np.float32), c32).dtype == np.float32
    np.testing.assert_array_equal(F.clamp(np.array([-3.0, 3.0]), -1.0)[0], [-1.0, 3.0])  # min only


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_first_and_forward_mode_against_finite_differences(seed):
    for op in (_CLAMP, (lambda x: R.clamp(x, LO, HI), R.clamp_backward, R.clamp_jvp)):
        report = gradcheck(op, _x(seed), mode="both", seed=seed)
        assert report.ok, str(report)


@pytest.mark.parametrize("seed", [0, 1])
def test_second_order_against_finite_differences(seed):
    report = gradgradcheck(_CLAMP_SECOND, _x(seed), seed=seed)
    assert report.ok, str(report)


def test_kernels_are_the_public_ops():
    x, rng = _x(3), np.random.default_rng(4)
    dy, tx, ddy = rng.standard_normal(x.shape), rng.standard_normal(x.shape), rng.standard_normal(x.shape)
    y, cache = F.clamp(x, LO, HI)
    ky, kc = K.clamp(x, LO, HI)
    np.testing.assert_array_equal(ky, y)
    np.testing.assert_array_equal(K.clamp_backward(dy, kc), F.clamp_backward(dy, cache))
    np.testing.assert_array_equal(K.clamp_jvp(kc, tx), F.clamp_jvp(cache, tx))
    np.testing.assert_array_equal(F.clamp_jvp(cache), np.zeros_like(x))
    for a, b in zip(K.clamp_backward_jvp(dy, kc, (tx,), ddy), F.clamp_backward_jvp(dy, cache, (tx,), ddy)):
        np.testing.assert_array_equal(a, b)
    out = x.copy()
    assert K.clamp(out, LO, HI, out=out)[0] is out and np.array_equal(out, y)  # in place: the mask first


def test_against_torch_at_and_around_the_bounds():
    torch = pytest.importorskip("torch")
    x = np.concatenate([_x(5).reshape(-1), [LO, HI, LO, HI]])  # some entries exactly at the bounds
    dy = np.random.default_rng(6).standard_normal(x.shape)
    for lo, hi in ((LO, HI), (None, HI), (LO, None)):
        t = torch.tensor(x, requires_grad=True)
        y = torch.clamp(t, lo, hi)
        (g,) = torch.autograd.grad(y, t, torch.tensor(dy))
        for M in (F, R):
            ours, cache = M.clamp(x, lo, hi)
            np.testing.assert_array_equal(ours, y.detach().numpy())
            np.testing.assert_array_equal(M.clamp_backward(dy, cache), g.numpy())
            np.testing.assert_array_equal(M.clamp_jvp(cache, dy), g.numpy())  # a diagonal Jacobian


def test_bad_input():
    with pytest.raises(TypeError):
        F.clamp(np.array(["a"]), 0.0, 1.0)
    with pytest.raises(ValueError, match="min <= max"):
        F.clamp(np.ones(2), 1.0, 0.0)
    with pytest.raises(ValueError, match="at least one"):
        F.clamp(np.ones(2))
    for bad in (float("nan"), True, "1", np.ones(2)):
        with pytest.raises(ValueError, match="max"):
            F.clamp(np.ones(2), 0.0, bad)
        with pytest.raises(ValueError, match="min"):
            F.clamp(np.ones(2), bad, 1.0)
    _, cache = F.clamp(np.ones((2, 3)), 0.0, 1.0)
    with pytest.raises(ValueError):
        F.clamp_backward(np.ones((3, 2)), cache)
    _, other = F.relu(np.ones((2, 3)))
    with pytest.raises(TypeError):
        F.clamp_backward(np.ones((2, 3)), other)

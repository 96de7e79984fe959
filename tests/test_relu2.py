"""``functional.relu2`` (squared ReLU, Hugging Face's ``"relu2"``): its backward, forward mode and
second order against central differences (``npattn.gradcheck`` / ``gradgradcheck``) and against
torch's ``relu(x)**2`` under autograd, its kernels, and bad input."""

import numpy as np
import pytest

import npattn.functional as F
from npattn.functional import kernels as K
from npattn.testing import gradcheck, gradgradcheck


def _x(seed, shape=(3, 5)):
    x = np.random.default_rng(seed).standard_normal(shape) * 2.0
    return np.where(np.abs(x) < 0.05, 0.5, x)  # away from the kink of relu2''


def test_values_and_cache():
    y, cache = F.relu2(np.array([-2.0, 0.0, 0.5, 3.0]))
    np.testing.assert_array_equal(y, [0.0, 0.0, 0.25, 9.0])
    np.testing.assert_array_equal(cache.r, [0.0, 0.0, 0.5, 3.0])
    y32, _ = F.relu2(np.ones(3, np.float32))
    assert y32.dtype == np.float32


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_first_and_forward_mode_against_finite_differences(seed):
    report = gradcheck(F.relu2, _x(seed), mode="both", seed=seed)
    assert report.ok, str(report)


@pytest.mark.parametrize("seed", [0, 1])
def test_second_order_against_finite_differences(seed):
    report = gradgradcheck(F.relu2, _x(seed), seed=seed)
    assert report.ok, str(report)


def test_second_order_formula():
    x, rng = _x(3), np.random.default_rng(4)
    dy, tx, ddy = rng.standard_normal(x.shape), rng.standard_normal(x.shape), rng.standard_normal(x.shape)
    _, cache = F.relu2(x)
    dx, tdx = F.relu2_backward_jvp(dy, cache, (tx,), ddy)
    r = np.maximum(x, 0)
    np.testing.assert_allclose(dx, 2 * r * dy, rtol=1e-15)
    np.testing.assert_allclose(tdx, 2 * r * ddy + 2 * (x > 0) * dy * tx, rtol=1e-15)
    np.testing.assert_allclose(F.relu2_jvp(cache, tx), 2 * r * tx, rtol=1e-15)
    np.testing.assert_array_equal(F.relu2_jvp(cache), np.zeros_like(x))
    kx, kc = K.relu2(x)
    np.testing.assert_array_equal(kx, r * r)
    np.testing.assert_array_equal(K.relu2_backward(dy, kc), dx)


def test_against_torch():
    torch = pytest.importorskip("torch")
    x = _x(5)
    dy = np.random.default_rng(6).standard_normal(x.shape)
    t = torch.tensor(x, requires_grad=True)
    y = torch.relu(t) ** 2
    (g,) = torch.autograd.grad(y, t, torch.tensor(dy), create_graph=True)
    ours, cache = F.relu2(x)
    np.testing.assert_allclose(ours, y.detach().numpy(), rtol=1e-15)
    np.testing.assert_allclose(F.relu2_backward(dy, cache), g.detach().numpy(), rtol=1e-15)


def test_bad_input():
    with pytest.raises(TypeError):
        F.relu2(np.array(["a"]))
    _, cache = F.relu2(np.ones((2, 3)))
    with pytest.raises(ValueError):
        F.relu2_backward(np.ones((3, 2)), cache)
    _, other = F.relu(np.ones((2, 3)))
    with pytest.raises(TypeError):
        F.relu2_backward(np.ones((2, 3)), other)

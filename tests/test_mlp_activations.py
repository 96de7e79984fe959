"""The activations of the families' plain MLPs: ``functional.relu2`` (squared ReLU, Hugging Face's
``"relu2"``: Nemotron-H, Arcee) and ``functional.xielu`` (``"xielu"``: Apertus, with its two trained
parameters): their backward, forward mode and second order against central differences
(``npattn.gradcheck`` / ``gradgradcheck``) and against torch under autograd (xIELU: transformers'
own ``XIELUActivation``), their kernels, and bad input."""

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


# -- xIELU: y = a_p x^2 + beta x (x > 0), a_n (expm1(min(x, eps)) - x) + beta x (x <= 0),
# a_p = softplus(alpha_p), a_n = beta + softplus(alpha_n); the gradients of x, alpha_p and alpha_n

# (beta, eps): the default; an eps of -0.3 (entries between it and 0: expm1 held at eps); eps > 0
_XIELU = [(0.5, -1e-6), (0.4, -0.3), (-0.2, 0.2)]


def _xielu(beta, eps):
    """xielu as a (forward, backward, jvp, backward_jvp) of (x, alpha_p, alpha_n), beta and eps fixed."""
    return lambda x, ap, an: F.xielu(x, ap, an, beta, eps)


def _params(seed):
    rng = np.random.default_rng(seed)
    return rng.uniform(-1.5, 1.5, 1), rng.uniform(-1.5, 1.5, 1)


@pytest.mark.parametrize("beta, eps", _XIELU)
@pytest.mark.parametrize("seed", [0, 1])
def test_xielu_first_and_forward_mode_against_finite_differences(seed, beta, eps):
    """dx, dalpha_p, dalpha_n and the JVP along all three, against central differences."""
    x = _x(seed)
    x = np.where(np.abs(x - eps) < 0.05, eps - 0.1, x)  # away from min(x, eps)'s kink
    report = gradcheck((_xielu(beta, eps), F.xielu_backward, F.xielu_jvp), x, *_params(seed), mode="both", seed=seed)
    assert report.ok, str(report)


@pytest.mark.parametrize("beta, eps", _XIELU)
@pytest.mark.parametrize("seed", [0, 1])
def test_xielu_second_order_against_finite_differences(seed, beta, eps):
    x = _x(seed + 2)
    x = np.where(np.abs(x - eps) < 0.05, eps - 0.1, x)
    op = (_xielu(beta, eps), F.xielu_backward, F.xielu_backward_jvp)
    report = gradgradcheck(op, x, *_params(seed + 2), seed=seed)
    assert report.ok, str(report)


def test_xielu_values_kernels_and_shapes():
    """The formula at known points (a_p = 0.8, a_n = 0.8, beta 0.5), the parameters' gradients of
    their own shapes (() or (1,)), float32 kept, the kernels the public ops, no tangent a zero JVP."""
    ap, an = np.log(np.expm1(0.8)), np.log(np.expm1(0.3))
    x = np.array([-1.0, -1e-7, 0.5, 2.0])
    y, cache = F.xielu(x, ap, an)
    want = [0.8 * (np.expm1(-1.0) + 1.0) - 0.5, 0.8 * (np.expm1(-1e-6) + 1e-7) - 0.5e-7, 0.45, 4.2]
    np.testing.assert_allclose(y, want, rtol=1e-14)
    dx, dap, dan = F.xielu_backward(np.ones(4), cache)
    # at -1e-7 (above eps): expm1 is held at eps, the slope is beta - a_n
    np.testing.assert_allclose(dx, [0.8 * np.exp(-1.0) - 0.3, -0.3, 1.3, 3.7], rtol=1e-14)
    assert dap.shape == () and dan.shape == ()
    np.testing.assert_allclose(dap, (0.25 + 4.0) / (1 + np.exp(-ap)), rtol=1e-14)
    _, c1 = F.xielu(x, np.array([ap]), np.array([an]))
    assert [g.shape for g in F.xielu_backward(np.ones(4), c1)[1:]] == [(1,), (1,)]
    y32, c32 = F.xielu(x.astype(np.float32), ap, an)
    assert y32.dtype == np.float32 and F.xielu_backward(np.ones(4, np.float32), c32)[0].dtype == np.float32
    ky, kc = K.xielu(x, np.asarray(ap), np.asarray(an))
    np.testing.assert_array_equal(ky, y)
    for a, b in zip(K.xielu_backward(np.ones(4), kc), (dx, dap, dan)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(F.xielu_jvp(cache), np.zeros(4))


def test_xielu_second_order_formula():
    """The second order's parts one by one: along tx alone (the slope's derivative 2 a_p, a_n e),
    along talpha_p and talpha_n alone (softplus' second derivative in the parameters' own tangent)."""
    rng = np.random.default_rng(3)
    x, (ap, an) = _x(3), _params(3)
    dy, tx = rng.standard_normal(x.shape), rng.standard_normal(x.shape)
    beta, eps = 0.4, -0.3
    _, cache = F.xielu(x, ap, an, beta, eps)
    a_p, a_n = np.logaddexp(0, ap), beta + np.logaddexp(0, an)
    s_p, s_n = 1 / (1 + np.exp(-ap)), 1 / (1 + np.exp(-an))
    P, e = x > 0, np.where((x <= 0) & (x < eps), np.exp(np.minimum(x, eps)), 0)
    q = np.where(P, 0, np.expm1(np.minimum(x, eps)) - x)
    _, (tdx, tdap, tdan) = F.xielu_backward_jvp(dy, cache, (tx,))
    np.testing.assert_allclose(tdx, dy * np.where(P, 2 * a_p, a_n * e) * tx, rtol=1e-13)
    np.testing.assert_allclose(tdap, s_p * np.sum(2 * dy * x * P * tx), rtol=1e-13)
    np.testing.assert_allclose(tdan, s_n * np.sum(dy * (e - 1) * ~P * tx), rtol=1e-13)
    t = np.array([0.7])
    _, (tdx, tdap, tdan) = F.xielu_backward_jvp(dy, cache, (None, t))
    np.testing.assert_allclose(tdx, dy * 2 * x * P * s_p * t, rtol=1e-13)
    np.testing.assert_allclose(tdap, np.sum(dy * x * x * P) * s_p * (1 - s_p) * t, rtol=1e-13)
    np.testing.assert_array_equal(tdan, 0)
    _, (tdx, tdap, tdan) = F.xielu_backward_jvp(dy, cache, (None, None, t))
    np.testing.assert_allclose(tdx, dy * (e - 1) * ~P * s_n * t, rtol=1e-13)
    np.testing.assert_allclose(tdan, np.sum(dy * q) * s_n * (1 - s_n) * t, rtol=1e-13)


@pytest.mark.parametrize("beta, eps", _XIELU)
def test_xielu_against_transformers(beta, eps):
    """transformers' XIELUActivation (float64; its alpha_p, alpha_n parameters and beta, eps
    buffers set): the values, dx and both parameters' gradients under autograd, and the second
    order (torch's double backward along tangents of x, alpha_p, alpha_n and dy)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.activations import XIELUActivation

    rng = np.random.default_rng(7)
    x, (ap, an) = _x(7), _params(7)
    dy, ddy, tx = (rng.standard_normal(x.shape) for _ in range(3))
    tap, tan = rng.standard_normal(1), rng.standard_normal(1)
    m = XIELUActivation(dtype=torch.float64)
    with torch.no_grad():
        m.alpha_p.copy_(torch.tensor(ap)), m.alpha_n.copy_(torch.tensor(an))
        m.beta.fill_(beta), m.eps.fill_(eps)
    t = torch.tensor(x, requires_grad=True)
    g = torch.tensor(dy, requires_grad=True)
    y = m(t)
    grads = torch.autograd.grad(y, [t, m.alpha_p, m.alpha_n], g, create_graph=True)
    inner = sum((a * torch.tensor(b)).sum() for a, b in zip(grads, (tx, tap, tan)))
    hv = torch.autograd.grad(inner, [t, m.alpha_p, m.alpha_n, g])
    ours, cache = F.xielu(x, ap, an, beta, eps)
    np.testing.assert_allclose(ours, y.detach().numpy(), rtol=1e-14, atol=1e-15)
    (dx, dap, dan), (tdx, tdap, tdan) = F.xielu_backward_jvp(dy, cache, (tx, tap, tan), ddy)
    for a, b in zip((dx, dap, dan), grads):
        np.testing.assert_allclose(a, b.detach().numpy(), rtol=1e-13, atol=1e-14)
    # the gradient of <grads, tangents> in (x, alpha_p, alpha_n) is the Hessian along the tangents
    # (the tangent of the gradients when dy stays), in dy the JVP; ddy adds the backward of ddy
    along_ddy = F.xielu_backward(ddy, cache)
    for ours_t, theirs, extra in zip((tdx, tdap, tdan), hv[:3], along_ddy):
        np.testing.assert_allclose(ours_t, theirs.numpy() + extra, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(F.xielu_jvp(cache, tx, tap, tan), hv[3].numpy(), rtol=1e-12, atol=1e-13)


def test_xielu_bad_input():
    with pytest.raises(TypeError):
        F.xielu(np.array(["a"]), 0.0, 0.0)
    with pytest.raises(ValueError, match=r"alpha_p: expected one number \(shape \(\) or \(1,\)\), got shape \(2,\)"):
        F.xielu(np.ones(3), np.ones(2), 0.0)
    with pytest.raises(ValueError, match=r"eps: expected a finite real number, got nan"):
        F.xielu(np.ones(3), 0.0, 0.0, 0.5, float("nan"))
    with pytest.raises(ValueError, match=r"beta: expected a finite real number, got True"):
        F.xielu(np.ones(3), 0.0, 0.0, True)
    _, cache = F.xielu(np.ones((2, 3)), 0.0, 0.0)
    with pytest.raises(ValueError):
        F.xielu_backward(np.ones((3, 2)), cache)
    with pytest.raises(ValueError, match="talpha_p"):
        F.xielu_jvp(cache, None, np.ones(3))
    _, other = F.relu2(np.ones((2, 3)))
    with pytest.raises(TypeError):
        F.xielu_backward(np.ones((2, 3)), other)


def test_xielu_module_parameters_buffers_and_refusals():
    """``nn.layers.XIELU``: transformers' initialisation (a_p = 0.8, a_n = 0.8 through the raw
    parameters), alpha_p and alpha_n trained (shape (1,)), beta and eps 0-d buffers in the state
    dict; its output is functional.xielu's; bad initial values refused by name."""
    from npattn.nn.layers import XIELU

    m = XIELU()
    assert sorted(dict(m.named_parameters())) == ["alpha_n", "alpha_p"]
    sd = m.state_dict()
    assert list(sd) == ["alpha_p", "alpha_n", "beta", "eps"] and sd["beta"].shape == sd["eps"].shape == ()
    np.testing.assert_allclose(np.logaddexp(0, sd["alpha_p"]), [0.8], rtol=1e-15)
    np.testing.assert_allclose(0.5 + np.logaddexp(0, sd["alpha_n"]), [0.8], rtol=1e-15)
    x = _x(9)
    np.testing.assert_array_equal(m(x), F.xielu(x, sd["alpha_p"], sd["alpha_n"], 0.5, -1e-6)[0])
    assert "beta=0.5" in repr(m)
    with pytest.raises(ValueError, match=r"expected alpha_p_init > 0 and alpha_n_init > beta"):
        XIELU(alpha_n_init=0.4)
    with pytest.raises(ValueError, match=r"eps: expected a finite real number, got nan"):
        XIELU(eps=float("nan"))


def test_xielu_module_initialisation_is_transformers():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.activations import XIELUActivation

    from npattn.nn.layers import XIELU

    theirs = {k: v.numpy() for k, v in XIELUActivation(dtype=torch.float64).state_dict().items()}
    ours = XIELU().state_dict()
    assert list(ours) == list(theirs)
    for k, v in theirs.items():
        np.testing.assert_allclose(ours[k], v, rtol=1e-15, err_msg=k)
        assert ours[k].shape == v.shape, k

"""Tests for npattn.optim: hand-computed steps, torch parity, dtypes, in-place updates, checks."""

import math

import numpy as np
import pytest

from npattn.nn.module import Module, Parameter
from npattn.optim import SGD, Adam, AdamW, Optimizer, WarmupCosine, clip_grad_norm_


def _param(values, dtype=np.float64):
    return Parameter(np.asarray(values, dtype=dtype))


def _set_grad(p, g):
    p.grad[...] = g


# -- SGD by hand ---------------------------------------------------------------------------
def test_sgd_plain_two_steps():
    p = _param([1.0, -2.0])
    g1, g2 = np.array([0.5, 0.25]), np.array([-1.0, 2.0])
    opt = SGD([p], lr=0.1)
    _set_grad(p, g1)
    opt.step()
    np.testing.assert_allclose(p.data, [1.0 - 0.05, -2.0 - 0.025], rtol=0, atol=1e-15)
    _set_grad(p, g2)
    opt.step()
    np.testing.assert_allclose(p.data, [0.95 + 0.1, -2.025 - 0.2], rtol=0, atol=1e-15)


def test_sgd_momentum_weight_decay_literal_numbers():
    # step 1: d = 0.5 + 0.1*1.0 = 0.6, buf = 0.6,               p = 1 - 0.1*0.6 = 0.94
    # step 2: d = 0.5 + 0.1*0.94 = 0.594, buf = 0.9*0.6 + 0.594 = 1.134, p = 0.94 - 0.1134 = 0.8266
    p = _param([1.0])
    opt = SGD([p], lr=0.1, momentum=0.9, weight_decay=0.1)
    _set_grad(p, [0.5])
    opt.step()
    assert p.data[0] == pytest.approx(0.94, abs=1e-15)
    _set_grad(p, [0.5])
    opt.step()
    assert p.data[0] == pytest.approx(0.8266, abs=1e-15)
    assert opt.state[0]["momentum_buffer"][0] == pytest.approx(1.134, abs=1e-15)


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_sgd_momentum_two_steps_formula(nesterov, wd):
    lr, mu = 0.2, 0.9
    p0 = np.array([1.0, -2.0, 0.5])
    g1, g2 = np.array([0.3, -0.1, 0.7]), np.array([-0.2, 0.4, 0.1])
    p = _param(p0)
    opt = SGD([p], lr=lr, momentum=mu, weight_decay=wd, nesterov=nesterov)

    d1 = g1 + wd * p0
    buf = d1
    step1 = d1 + mu * buf if nesterov else buf
    p1 = p0 - lr * step1
    _set_grad(p, g1)
    opt.step()
    np.testing.assert_allclose(p.data, p1, rtol=1e-15, atol=1e-15)

    d2 = g2 + wd * p1
    buf = mu * buf + d2
    step2 = d2 + mu * buf if nesterov else buf
    p2 = p1 - lr * step2
    _set_grad(p, g2)
    opt.step()
    np.testing.assert_allclose(p.data, p2, rtol=1e-15, atol=1e-15)


# -- Adam / AdamW by hand ------------------------------------------------------------------
def _adam_reference(p0, grads, lr, b1, b2, eps, wd, decoupled):
    p, m, v = p0.copy(), np.zeros_like(p0), np.zeros_like(p0)
    out = []
    for t, g in enumerate(grads, start=1):
        if decoupled:
            p = p * (1 - lr * wd)
        else:
            g = g + wd * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat = m / (1 - b1**t)
        denom = np.sqrt(v) / np.sqrt(1 - b2**t) + eps
        p = p - lr * m_hat / denom
        out.append(p.copy())
    return out


@pytest.mark.parametrize("cls", [Adam, AdamW])
def test_adam_first_step_is_sign_step(cls):
    # after one step m_hat = g and sqrt(v_hat) = |g|, so p moves by lr * g / (|g| + eps)
    p0 = np.array([1.0, -2.0, 0.5])
    g = np.array([0.3, -4.0, 1e-3])
    lr, wd, eps = 0.01, 0.1, 1e-8
    p = _param(p0)
    opt = cls([p], lr=lr, weight_decay=wd, eps=eps)
    _set_grad(p, g)
    opt.step()
    if cls is AdamW:
        expected = p0 * (1 - lr * wd) - lr * g / (np.abs(g) + eps)
    else:
        ge = g + wd * p0
        expected = p0 - lr * ge / (np.abs(ge) + eps)
    np.testing.assert_allclose(p.data, expected, rtol=1e-13, atol=1e-15)
    assert opt.state[0]["step"] == 1


@pytest.mark.parametrize("cls", [Adam, AdamW])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_adam_two_steps_formula(cls, wd):
    p0 = np.array([1.0, -2.0, 0.5])
    grads = [np.array([0.3, -0.1, 0.7]), np.array([-0.2, 0.4, 0.1])]
    lr, b1, b2, eps = 0.05, 0.8, 0.95, 1e-6
    expected = _adam_reference(p0, grads, lr, b1, b2, eps, wd, decoupled=cls is AdamW)
    p = _param(p0)
    opt = cls([p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    for g, e in zip(grads, expected):
        _set_grad(p, g)
        opt.step()
        np.testing.assert_allclose(p.data, e, rtol=1e-14, atol=1e-15)


def test_adamw_default_weight_decay_and_adam_zero():
    p = _param([1.0])
    assert AdamW([p]).weight_decay == 0.01
    assert Adam([p]).weight_decay == 0.0
    assert AdamW([p]).lr == 1e-3 and AdamW([p]).betas == (0.9, 0.999) and AdamW([p]).eps == 1e-8


# -- torch parity --------------------------------------------------------------------------
def _run_parity(np_cls, torch_cls, kwargs, steps=10, seed=0, lr_change=None):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(seed)
    shapes = [(3, 4), (5,), (2, 1, 3)]
    inits = [rng.standard_normal(s) for s in shapes]
    ps = [_param(a) for a in inits]
    ts = [torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in inits]
    opt = np_cls(ps, **kwargs)
    topt = torch_cls(ts, **kwargs)
    for step in range(steps):
        if lr_change is not None and step == steps // 2:
            opt.lr = lr_change
            for group in topt.param_groups:
                group["lr"] = lr_change
        for p, t in zip(ps, ts):
            g = rng.standard_normal(p.shape)
            _set_grad(p, g)
            t.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
        topt.step()
        for p, t in zip(ps, ts):
            np.testing.assert_allclose(p.data, t.detach().numpy(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(lr=0.1),
        dict(lr=0.1, weight_decay=0.01),
        dict(lr=0.05, momentum=0.9),
        dict(lr=0.05, momentum=0.9, nesterov=True),
        dict(lr=0.05, momentum=0.5, weight_decay=0.1, nesterov=True),
        dict(lr=0.05, momentum=0.8, weight_decay=0.1),
    ],
)
def test_sgd_matches_torch(kwargs):
    torch = pytest.importorskip("torch")
    _run_parity(SGD, torch.optim.SGD, kwargs, lr_change=0.01)


ADAM_CONFIGS = [
    dict(lr=1e-3),
    dict(lr=1e-2, weight_decay=0.1),
    dict(lr=3e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05),
    dict(lr=1e-2, betas=(0.0, 0.5), eps=1e-3),
]


@pytest.mark.parametrize("kwargs", ADAM_CONFIGS)
def test_adam_matches_torch(kwargs):
    torch = pytest.importorskip("torch")
    _run_parity(Adam, torch.optim.Adam, kwargs, lr_change=5e-3)


@pytest.mark.parametrize("kwargs", ADAM_CONFIGS + [dict()])
def test_adamw_matches_torch(kwargs):
    torch = pytest.importorskip("torch")
    _run_parity(AdamW, torch.optim.AdamW, kwargs, lr_change=5e-3)


# -- dtype and in-place --------------------------------------------------------------------
@pytest.mark.parametrize(
    "make",
    [
        lambda ps: SGD(ps, lr=np.float64(0.1), momentum=np.float64(0.9), weight_decay=0.01, nesterov=True),
        lambda ps: Adam(ps, lr=np.float64(1e-2), betas=(np.float64(0.9), 0.99), weight_decay=0.1),
        lambda ps: AdamW(ps, lr=np.float64(1e-2), eps=np.float64(1e-6), weight_decay=np.float64(0.1)),
    ],
)
def test_float32_stays_float32_and_updates_in_place(make):
    rng = np.random.default_rng(1)
    ps = [_param(rng.standard_normal((4, 3)), np.float32), _param(rng.standard_normal(7), np.float32)]
    data_ids = [id(p.data) for p in ps]
    grad_ids = [id(p.grad) for p in ps]
    before = [p.data.copy() for p in ps]
    opt = make(ps)
    sched = WarmupCosine(opt, warmup_steps=2, total_steps=5)
    for _ in range(4):
        for p in ps:
            _set_grad(p, rng.standard_normal(p.shape).astype(np.float32))
        clip_grad_norm_(ps, 0.5)
        opt.step()
        sched.step()
        opt.zero_grad()
    for p, d_id, g_id, b in zip(ps, data_ids, grad_ids, before):
        assert p.data.dtype == np.float32 and p.grad.dtype == np.float32
        assert id(p.data) == d_id and id(p.grad) == g_id
        assert not np.array_equal(p.data, b)
        assert np.all(p.grad == 0)
    for s in opt.state:
        for v in s.values():
            if isinstance(v, np.ndarray):
                assert v.dtype == np.float32
    assert type(opt.lr) is float


def test_update_visible_through_held_reference():
    p = _param([1.0, 2.0])
    held = p.data
    opt = SGD([p], lr=0.5)
    _set_grad(p, [1.0, 1.0])
    opt.step()
    np.testing.assert_array_equal(held, [0.5, 1.5])
    assert held is p.data


def test_accepts_module_and_dedupes_tied_parameters():
    class Tiny(Module):
        def __init__(self):
            super().__init__()
            self.w = Parameter(np.ones((2, 2)))
            self.b = Parameter(np.zeros(2))

    class Outer(Module):
        def __init__(self):
            super().__init__()
            self.a = Tiny()
            self.c = Tiny()
            self.c.w = self.a.w  # tied weight

    m = Outer()
    opt = SGD(m, lr=1.0)
    assert len(opt.params) == 3
    m.a.w.grad[...] = 1.0
    opt.step()  # the tied weight is stepped once, not twice
    np.testing.assert_array_equal(m.a.w.data, np.zeros((2, 2)))


def test_none_grad_is_skipped_and_zero_grad_restores_array():
    p, q = _param([1.0]), _param([2.0])
    opt = Adam([p, q], lr=0.1)
    q.grad = None
    _set_grad(p, [1.0])
    opt.step()
    assert q.data[0] == 2.0 and not opt.state[1]
    opt.zero_grad()
    assert isinstance(q.grad, np.ndarray) and q.grad.shape == (1,) and q.grad[0] == 0


def test_zero_grad_in_place():
    p = _param([1.0, 2.0])
    g = p.grad
    g[...] = 3.0
    SGD([p], lr=0.1).zero_grad()
    assert p.grad is g and np.all(g == 0)


@pytest.mark.parametrize("make", [SGD, Adam, AdamW])
def test_zero_grad_zeroes_grad_tangent_as_module_zero_grad_does(make):
    """backward_jvp accumulates into p.grad_tangent: the optimizer's zero_grad clears it in place
    (as Parameter.zero_grad and Module.zero_grad), a None one stays None."""
    p, q = _param([1.0, 2.0]), _param([3.0])
    p.grad_tangent = np.array([4.0, -5.0])
    t = p.grad_tangent
    q.grad_tangent = None
    make([p, q], lr=0.1).zero_grad()
    assert p.grad_tangent is t and np.all(t == 0)
    assert q.grad_tangent is None
    assert np.all(p.grad == 0) and np.all(q.grad == 0)


# -- state dicts ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "make",
    [
        lambda ps: SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
        lambda ps: Adam(ps, lr=1e-2, weight_decay=0.01),
        lambda ps: AdamW(ps, lr=1e-2, betas=(0.8, 0.9)),
    ],
)
def test_state_dict_round_trip(make):
    rng = np.random.default_rng(2)
    init = [rng.standard_normal((3, 2)), rng.standard_normal(4)]
    a = [_param(x) for x in init]
    opt_a = make(a)
    grads = [[rng.standard_normal(x.shape) for x in init] for _ in range(6)]
    for gs in grads[:3]:
        for p, g in zip(a, gs):
            _set_grad(p, g)
        opt_a.step()
    sd = opt_a.state_dict()
    # plain dicts of numpy arrays / python numbers, copied
    for s in sd["state"].values():
        for k, v in s.items():
            assert isinstance(v, (np.ndarray, int))
    b = [_param(p.data) for p in a]
    opt_b = make(b)
    opt_b.lr = 123.0
    opt_b.load_state_dict(sd)
    assert opt_b.lr == opt_a.lr
    for gs in grads[3:]:
        for pa, pb, g in zip(a, b, gs):
            _set_grad(pa, g)
            _set_grad(pb, g)
        opt_a.step()
        opt_b.step()
    for pa, pb in zip(a, b):
        np.testing.assert_array_equal(pa.data, pb.data)


def test_state_dict_is_a_copy_and_load_is_atomic():
    p = _param([1.0, 2.0])
    opt = Adam([p], lr=0.1)
    _set_grad(p, [1.0, -1.0])
    opt.step()
    sd = opt.state_dict()
    sd["state"][0]["exp_avg"][...] = 99.0
    assert not np.any(opt.state[0]["exp_avg"] == 99.0)

    good = opt.state_dict()
    bad = {"hyper": {"lr": 0.5}, "state": {0: dict(good["state"][0], exp_avg=np.zeros(3))}}
    with pytest.raises(ValueError, match="exp_avg"):
        opt.load_state_dict(bad)
    assert opt.lr == 0.1  # nothing changed
    np.testing.assert_array_equal(opt.state[0]["exp_avg"], good["state"][0]["exp_avg"])
    with pytest.raises(ValueError, match="out of range"):
        opt.load_state_dict({"hyper": {}, "state": {5: good["state"][0]}})
    with pytest.raises(ValueError, match="betas"):
        opt.load_state_dict({"hyper": {"betas": (1.5, 0.9)}, "state": {}})
    with pytest.raises(TypeError, match="state_dict"):
        opt.load_state_dict([1, 2])


# -- clip_grad_norm_ -----------------------------------------------------------------------
def test_clip_grad_norm_by_hand():
    p, q = _param([0.0, 0.0]), _param([0.0])
    _set_grad(p, [3.0, 4.0])
    _set_grad(q, [12.0])
    g_p = p.grad
    total = clip_grad_norm_([p, q], max_norm=6.5)
    assert type(total) is float and total == pytest.approx(13.0, abs=1e-12)
    coef = 6.5 / (13.0 + 1e-6)
    np.testing.assert_allclose(p.grad, [3.0 * coef, 4.0 * coef], rtol=1e-15)
    np.testing.assert_allclose(q.grad, [12.0 * coef], rtol=1e-15)
    assert p.grad is g_p  # in place
    new_norm = math.sqrt(np.sum(p.grad**2) + np.sum(q.grad**2))
    assert new_norm == pytest.approx(6.5, rel=1e-6)


def test_clip_grad_norm_no_clip_below_threshold_and_module():
    class Tiny(Module):
        def __init__(self):
            super().__init__()
            self.w = Parameter(np.zeros(2))

    m = Tiny()
    m.w.grad[...] = [0.6, 0.8]
    total = clip_grad_norm_(m, max_norm=2.0)
    assert total == pytest.approx(1.0)
    np.testing.assert_array_equal(m.w.grad, [0.6, 0.8])


def test_clip_grad_norm_float32_and_nonfinite():
    p = _param(np.zeros(3), np.float32)
    _set_grad(p, np.array([10.0, 0.0, 0.0], np.float32))
    clip_grad_norm_([p], 1.0)
    assert p.grad.dtype == np.float32
    np.testing.assert_allclose(p.grad, [1.0, 0.0, 0.0], rtol=1e-5)

    _set_grad(p, np.array([np.inf, 1.0, 0.0], np.float32))
    assert clip_grad_norm_([p], 1.0) == math.inf
    assert p.grad[1] == 1.0  # left untouched
    with pytest.raises(RuntimeError, match="inf"):
        clip_grad_norm_([p], 1.0, error_if_nonfinite=True)


@pytest.mark.parametrize("max_norm", [0.1, 1.0, 5.0, 100.0])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_clip_grad_norm_matches_torch(max_norm, dtype):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    grads = [rng.standard_normal(s).astype(dtype) for s in [(4, 3), (6,), (2, 2, 2)]]
    ps = [_param(np.zeros_like(g), dtype) for g in grads]
    for p, g in zip(ps, grads):
        _set_grad(p, g)
    ts = [torch.zeros(g.shape, dtype=torch.from_numpy(g).dtype, requires_grad=True) for g in grads]
    for t, g in zip(ts, grads):
        t.grad = torch.from_numpy(g.copy())
    total = clip_grad_norm_(ps, max_norm)
    t_total = torch.nn.utils.clip_grad_norm_(ts, max_norm)
    rtol = 1e-12 if dtype == np.float64 else 1e-5
    assert total == pytest.approx(float(t_total), rel=rtol)
    for p, t in zip(ps, ts):
        assert p.grad.dtype == dtype
        np.testing.assert_allclose(p.grad, t.grad.numpy(), rtol=rtol, atol=1e-7 if dtype == np.float32 else 0)


# -- WarmupCosine --------------------------------------------------------------------------
def test_warmup_cosine_values():
    p = _param([0.0])
    opt = SGD([p], lr=1.0)
    sched = WarmupCosine(opt, warmup_steps=10, total_steps=110, min_lr=0.1)
    assert opt.lr == pytest.approx(0.1)  # constructor sets lr(0) = base / W
    assert sched.get_lr(0) == pytest.approx(0.1)
    assert sched.get_lr(4) == pytest.approx(0.5)
    assert sched.get_lr(9) == pytest.approx(1.0)  # end of warm-up
    assert sched.get_lr(10) == pytest.approx(1.0)  # cosine starts at base_lr
    assert sched.get_lr(60) == pytest.approx(0.1 + 0.9 * 0.5)  # midway
    assert sched.get_lr(35) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert sched.get_lr(110) == pytest.approx(0.1)  # end
    assert sched.get_lr(1000) == pytest.approx(0.1)  # constant after
    # step() walks the same curve and drives the optimizer
    seen = [opt.lr] + [sched.step() for _ in range(120)]
    assert seen == [sched.get_lr(t) for t in range(121)]
    assert opt.lr == pytest.approx(0.1)
    assert sched.t == 120


def test_warmup_cosine_no_warmup_and_optimizer_uses_new_lr():
    p = _param([1.0])
    opt = SGD([p], lr=0.5)
    sched = WarmupCosine(opt, warmup_steps=0, total_steps=4)
    assert opt.lr == 0.5
    expected = [0.5 * 0.5 * (1 + math.cos(math.pi * t / 4)) for t in range(5)]
    assert [sched.get_lr(t) for t in range(5)] == pytest.approx(expected)
    x = 1.0
    for t in range(5):
        _set_grad(p, [1.0])
        opt.step()
        x -= expected[t]
        sched.step()
    assert p.data[0] == pytest.approx(x)


def test_warmup_cosine_state_dict():
    opt = AdamW([_param([1.0])], lr=1e-3)
    s = WarmupCosine(opt, 5, 20, min_lr=1e-5)
    for _ in range(7):
        s.step()
    opt2 = AdamW([_param([1.0])], lr=1e-3)
    s2 = WarmupCosine(opt2, 1, 2)
    s2.load_state_dict(s.state_dict())
    assert s2.t == 7 and opt2.lr == opt.lr
    assert [s2.get_lr(t) for t in range(30)] == [s.get_lr(t) for t in range(30)]


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(warmup_steps=-1, total_steps=10), ValueError, "warmup_steps"),
        (dict(warmup_steps=1.5, total_steps=10), TypeError, "warmup_steps"),
        (dict(warmup_steps=0, total_steps=0), ValueError, "total_steps"),
        (dict(warmup_steps=11, total_steps=10), ValueError, "warmup_steps"),
        (dict(warmup_steps=1, total_steps=10, min_lr=-0.1), ValueError, "min_lr"),
        (dict(warmup_steps=1, total_steps=10, min_lr=2.0), ValueError, "min_lr"),
    ],
)
def test_warmup_cosine_bad_arguments(kwargs, exc, match):
    opt = SGD([_param([1.0])], lr=1.0)
    with pytest.raises(exc, match=match):
        WarmupCosine(opt, **kwargs)
    assert opt.lr == 1.0


def test_warmup_cosine_needs_optimizer_and_int_step():
    with pytest.raises(TypeError, match="optimizer"):
        WarmupCosine(object(), 1, 10)
    s = WarmupCosine(SGD([_param([1.0])], lr=1.0), 1, 10)
    with pytest.raises(ValueError, match="t"):
        s.get_lr(-1)


# -- argument validation -------------------------------------------------------------------
def _p():
    return [_param([1.0, 2.0])]


@pytest.mark.parametrize(
    "build, exc, match",
    [
        (lambda: SGD(_p(), lr=-0.1), ValueError, r"lr: .*-0\.1"),
        (lambda: SGD(_p(), lr=float("nan")), ValueError, "lr"),
        (lambda: SGD(_p(), lr="0.1"), TypeError, "lr"),
        (lambda: SGD(_p(), lr=0.1, momentum=1.0), ValueError, r"momentum: .*\[0, 1\).*1\.0"),
        (lambda: SGD(_p(), lr=0.1, momentum=-0.5), ValueError, "momentum"),
        (lambda: SGD(_p(), lr=0.1, weight_decay=-1.0), ValueError, "weight_decay"),
        (lambda: SGD(_p(), lr=0.1, nesterov=True), ValueError, "nesterov"),
        (lambda: SGD(_p(), lr=0.1, momentum=0.9, nesterov="yes"), TypeError, "nesterov"),
        (lambda: Adam(_p(), lr=-1.0), ValueError, "lr"),
        (lambda: Adam(_p(), betas=(1.0, 0.999)), ValueError, r"betas\[0\]"),
        (lambda: Adam(_p(), betas=(0.9, -0.1)), ValueError, r"betas\[1\]"),
        (lambda: AdamW(_p(), betas=(0.9, 1.5)), ValueError, r"betas\[1\].*1\.5"),
        (lambda: AdamW(_p(), betas=(0.9,)), ValueError, "betas"),
        (lambda: AdamW(_p(), betas=0.9), TypeError, "betas"),
        (lambda: AdamW(_p(), eps=0.0), ValueError, r"eps: .*0\.0"),
        (lambda: Adam(_p(), eps=-1e-8), ValueError, "eps"),
        (lambda: AdamW(_p(), weight_decay=-0.01), ValueError, "weight_decay"),
        (lambda: SGD([], lr=0.1), ValueError, "params.*empty"),
        (lambda: AdamW(iter(())), ValueError, "params.*empty"),
        (lambda: SGD([np.zeros(3)], lr=0.1), TypeError, r"params: element 0 is ndarray"),
        (lambda: Adam(_p() + ["w"]), TypeError, r"params: element 1 is str"),
        (lambda: SGD(_param([1.0]), lr=0.1), TypeError, "params.*single Parameter"),
        (lambda: SGD(3, lr=0.1), TypeError, "params"),
    ],
)
def test_bad_hyper_parameters(build, exc, match):
    with pytest.raises(exc, match=match):
        build()


def test_lr_assignment_is_validated():
    opt = SGD(_p(), lr=0.1)
    with pytest.raises(ValueError, match="lr"):
        opt.lr = -1.0
    assert opt.lr == 0.1
    opt.lr = np.float64(0.2)
    assert type(opt.lr) is float and opt.lr == 0.2


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(max_norm=-1.0), ValueError, "max_norm"),
        (dict(max_norm=0.0), ValueError, "max_norm"),
        (dict(max_norm="1"), TypeError, "max_norm"),
        (dict(max_norm=1.0, eps=-1.0), ValueError, "eps"),
    ],
)
def test_clip_grad_norm_bad_arguments(kwargs, exc, match):
    ps = _p()
    _set_grad(ps[0], [3.0, 4.0])
    with pytest.raises(exc, match=match):
        clip_grad_norm_(ps, **kwargs)
    np.testing.assert_array_equal(ps[0].grad, [3.0, 4.0])


def test_base_optimizer_step_is_abstract():
    with pytest.raises(NotImplementedError):
        Optimizer(_p(), lr=0.1).step()

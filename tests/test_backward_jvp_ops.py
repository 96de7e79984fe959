"""Second order (``<op>_backward_jvp``) of the functional pairs other than attention, in both tiers.

``<op>_backward_jvp(dout, cache, tangents, ddout)`` returns ``(grads, grad_tangents)``: ``grads``
exactly ``<op>_backward(dout, cache)``, ``grad_tangents`` the directional derivative of those
gradients when the inputs move along ``tangents`` and ``dout`` along ``ddout``.  Each is checked
against central differences of the backward along ``(tangents, ddout)``, against the other tier
(1e-12), against ``torch.func.jvp`` of ``torch.func.vjp`` of the op's formula in torch (float64),
over hypothesis-drawn shapes and options; bad arguments are refused naming them.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import numpy as np
import pytest
from _oracles import rel_err
from hypothesis import given
from hypothesis import strategies as st

import npattn.functional as F
import npattn.functional.reference as R
from npattn.testing import rope_scalings, seeds, shapes


class Case(NamedTuple):
    """One forward call: ``op`` names the pair; ``primals`` the differentiable inputs in the
    tangents' (the backward's) order; ``call(M, *primals) -> (out, cache)`` with ``M`` either
    tier; ``torch_fn(torch, *tensors)`` the formula in torch (None: no oracle)."""

    name: str
    op: str
    primals: tuple
    call: Callable
    torch_fn: Optional[Callable]


def make_cases(rng, lead=(2, 3), length=3) -> list:
    """Every pair with its options at small random float64 shapes: leading axes ``lead``, a
    sequence of ``length`` (>= 2) where the op has one (rope, causal_conv1d)."""
    lead = tuple(lead)

    def u(*shape, scale=1.0):
        return rng.uniform(-scale, scale, shape)

    d, o, c, L = 4, 3, 5, length
    cases = []
    # -- linear
    x, w, b = u(*lead, d), u(o, d), u(o)
    cases.append(
        Case("linear", "linear", (x, w, b), lambda M, x, w, b: M.linear(x, w, b), lambda t, x, w, b: x @ w.T + b)
    )
    cases.append(Case("linear_nobias", "linear", (x, w), lambda M, x, w: M.linear(x, w), lambda t, x, w: x @ w.T))
    # -- embedding (its backward does not read the weight: the tangent comes from ddout alone)
    n = 6
    ids = rng.integers(0, n, lead)
    ew = u(n, d)
    for label, kw in (
        ("embedding", {}),
        ("embedding_pad_freq", dict(padding_idx=int(ids.reshape(-1)[0]), scale_grad_by_freq=True)),
    ):
        cases.append(
            Case(
                label,
                "embedding",
                (ew,),
                lambda M, w, kw=kw: M.embedding(ids, w, **kw),
                lambda t, w, kw=kw: t.nn.functional.embedding(t.tensor(ids), w, **kw),
            )
        )
    cases.append(Case("embedding_max_norm", "embedding", (ew,), lambda M, w: M.embedding(ids, w, max_norm=0.5), None))
    # -- activations
    sx = u(*lead, c, scale=3.0)
    sx_inf = sx.copy()
    sx_inf[..., 0] = -np.inf  # a masked column: weight 0, gradient 0, tangent 0
    cases.append(Case("softmax", "softmax", (sx,), lambda M, x: M.softmax(x), lambda t, x: t.softmax(x, -1)))
    cases.append(Case("softmax_axis0", "softmax", (sx,), lambda M, x: M.softmax(x, 0), lambda t, x: t.softmax(x, 0)))
    cases.append(Case("softmax_inf", "softmax", (sx_inf,), lambda M, x: M.softmax(x), lambda t, x: t.softmax(x, -1)))
    rx = u(*lead, c)
    rx = np.where(np.abs(rx) < 0.05, 0.5, rx)  # away from the kink
    cases.append(Case("relu", "relu", (rx,), lambda M, x: M.relu(x), lambda t, x: t.relu(x)))
    cases.append(Case("relu2", "relu2", (rx,), lambda M, x: M.relu2(x), lambda t, x: t.relu(x) ** 2))
    gx = u(*lead, c, scale=3.0)
    for approx in ("none", "tanh"):
        cases.append(
            Case(
                f"gelu_{approx}",
                "gelu",
                (gx,),
                lambda M, x, a=approx: M.gelu(x, approximate=a),
                lambda t, x, a=approx: t.nn.functional.gelu(x, approximate=a),
            )
        )
    cases.append(Case("silu", "silu", (gx,), lambda M, x: M.silu(x), lambda t, x: t.nn.functional.silu(x)))
    seed = int(rng.integers(0, 2**31))
    keep = np.random.default_rng(seed).random(gx.shape) >= 0.3
    cases.append(
        Case("dropout", "dropout", (gx,), lambda M, x: M.dropout(x, 0.3, seed), lambda t, x: x * t.tensor(keep) / 0.7)
    )
    cases.append(
        Case("dropout_eval", "dropout", (gx,), lambda M, x: M.dropout(x, 0.3, seed, False), lambda t, x: x * 1.0)
    )
    # -- norms
    lx = u(*lead, c, scale=2.0)
    lw, lb = u(c) + 1.5, u(c)

    def t_ln(t, shape, x, w=None, b=None):
        return t.nn.functional.layer_norm(x, shape, w, b, 1e-5)

    cases.append(
        Case(
            "layer_norm",
            "layer_norm",
            (lx, lw, lb),
            lambda M, x, w, b: M.layer_norm(x, w, b),
            lambda t, x, w, b: t_ln(t, (c,), x, w, b),
        )
    )
    cases.append(
        Case("layer_norm_plain", "layer_norm", (lx,), lambda M, x: M.layer_norm(x), lambda t, x: t_ln(t, (c,), x))
    )
    ns = (lead[-1], c)
    lw2 = u(*ns) + 1.5
    cases.append(
        Case(
            "layer_norm_2axes",
            "layer_norm",
            (lx, lw2),
            lambda M, x, w: M.layer_norm(x, w, normalized_shape=ns),
            lambda t, x, w: t_ln(t, ns, x, w),
        )
    )
    cases.append(
        Case(
            "rms_norm",
            "rms_norm",
            (lx, lw),
            lambda M, x, w: M.rms_norm(x, w, 1e-6),
            lambda t, x, w: t.nn.functional.rms_norm(x, (c,), w, 1e-6),
        )
    )
    cases.append(
        Case(
            "rms_norm_plain",
            "rms_norm",
            (lx,),
            lambda M, x: M.rms_norm(x),
            lambda t, x: t.nn.functional.rms_norm(x, (c,)),
        )
    )
    # -- rope (the angles do not depend on x: any scaling and partial rotary)
    D = 6
    px = u(*lead, L, D)
    pos = rng.integers(0, 50, L)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}  # attention factor != 1
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    for label, kw in (
        ("rope", dict(positions=None)),
        ("rope_interleaved_pos", dict(positions=pos, interleaved=True)),
        ("rope_yarn", dict(positions=pos, scaling=yarn)),
        ("rope_partial_llama3", dict(positions=pos, rotary_dim=4, scaling=llama3)),
    ):
        cases.append(
            Case(label, "rope", (px,), lambda M, x, kw=kw: M.rope(x, **kw), lambda t, x, kw=kw: _torch_rope(t, x, **kw))
        )
    # -- cross_entropy: every option
    z = u(*lead, c, scale=2.0)
    tgt = rng.integers(0, c, lead)
    ign = tgt.copy()
    ign.reshape(-1)[0] = -100
    cw = rng.uniform(0.5, 2.0, c)
    probs = rng.dirichlet(np.ones(c), lead)

    def t_ce(t, x, target, **kw):  # classes on torch's axis 1
        out = t.nn.functional.cross_entropy(x.reshape(-1, c), target, **kw)
        return out.reshape(lead) if kw.get("reduction") == "none" else out

    for red in ("mean", "sum", "none"):
        cases.append(
            Case(
                f"ce_{red}",
                "cross_entropy",
                (z,),
                lambda M, x, red=red: M.cross_entropy(x, tgt, reduction=red),
                lambda t, x, red=red: t_ce(t, x, t.tensor(tgt.reshape(-1)), reduction=red),
            )
        )
        cases.append(
            Case(
                f"ce_weight_smooth_ignore_{red}",
                "cross_entropy",
                (z,),
                lambda M, x, red=red: M.cross_entropy(x, ign, -100, weight=cw, label_smoothing=0.2, reduction=red),
                lambda t, x, red=red: t_ce(
                    t,
                    x,
                    t.tensor(ign.reshape(-1)),
                    ignore_index=-100,
                    weight=t.tensor(cw),
                    label_smoothing=0.2,
                    reduction=red,
                ),
            )
        )
        cases.append(
            Case(
                f"ce_probs_{red}",
                "cross_entropy",
                (z,),
                lambda M, x, red=red: M.cross_entropy(x, probs, weight=cw, label_smoothing=0.1, reduction=red),
                lambda t, x, red=red: t_ce(
                    t, x, t.tensor(probs.reshape(-1, c)), weight=t.tensor(cw), label_smoothing=0.1, reduction=red
                ),
            )
        )
    all_ignored = np.full(lead, -100)
    cases.append(
        Case(
            "ce_all_ignored_mean",  # nothing counted: loss 0 (torch: NaN), gradient and tangent 0
            "cross_entropy",
            (z,),
            lambda M, x: M.cross_entropy(x, all_ignored, -100),
            None,
        )
    )
    # -- the Gated DeltaNet norms and convolution
    qx, gate, gw = u(*lead, d, scale=2.0), u(*lead, d, scale=2.0), u(d) + 1.5
    cases.append(
        Case(
            "l2_norm",
            "l2_norm",
            (qx,),
            lambda M, x: M.l2_norm(x),
            lambda t, x: x / t.sqrt((x * x).sum(-1, keepdim=True) + 1e-6),
        )
    )
    cases.append(
        Case(
            "rms_norm_gated",
            "rms_norm_gated",
            (qx, gate, gw),
            lambda M, x, g, w: M.rms_norm_gated(x, g, w, 1e-6),
            lambda t, x, g, w: x * t.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w * t.nn.functional.silu(g),
        )
    )
    taps, ch = 3, 2
    cx, cwt, cb, cs = u(*lead[:-1], L, ch), u(ch, taps), u(ch), u(*lead[:-1], taps - 1, ch)
    cases.append(
        Case(
            "conv_silu_bias_state",
            "causal_conv1d",
            (cx, cwt, cb, cs),
            lambda M, x, w, b, s: M.causal_conv1d(x, w, b, activation="silu", initial_state=s),
            lambda t, x, w, b, s: _torch_conv(t, x, w, b, s, silu=True),
        )
    )
    cases.append(
        Case(
            "conv_plain",
            "causal_conv1d",
            (cx, cwt),
            lambda M, x, w: M.causal_conv1d(x, w),
            lambda t, x, w: _torch_conv(t, x, w, None, None, silu=False),
        )
    )
    cases.append(
        Case(
            "conv_bias",  # LFM2's short convolution: a bias, no activation
            "causal_conv1d",
            (cx, cwt, cb),
            lambda M, x, w, b: M.causal_conv1d(x, w, b),
            lambda t, x, w, b: _torch_conv(t, x, w, b, None, silu=False),
        )
    )
    # xIELU (last: its draws leave every earlier case's as they were): relu's x and its two raw
    # parameters (softplus-parametrised), beta and eps constants (buffers); eps -0.1 so that some
    # entries sit between it and 0 (the expm1 branch held at eps)
    xa_p, xa_n = u(1), u(1)

    def t_xielu(t, x, ap, an, beta=0.4, eps=-0.1):
        a_p, a_n = t.nn.functional.softplus(ap), beta + t.nn.functional.softplus(an)
        neg = (t.expm1(t.clamp(x, max=eps)) - x) * a_n + beta * x
        return t.where(x > 0, a_p * x * x + beta * x, neg)

    cases.append(Case("xielu", "xielu", (rx, xa_p, xa_n), lambda M, x, ap, an: M.xielu(x, ap, an, 0.4, -0.1), t_xielu))
    # clamp (OLMo's clip_qkv) to [-0.3, 0.3]: entries on both sides of each bound, none within 0.05
    # of one (the mask's kinks); and one-sided
    kx = u(*lead, c)
    kx = np.where(np.abs(np.abs(kx) - 0.3) < 0.05, 0.1, kx)
    for label, lo in (("clamp", -0.3), ("clamp_max", None)):
        ours, theirs = (lambda M, x, lo=lo: M.clamp(x, lo, 0.3)), (lambda t, x, lo=lo: t.clamp(x, lo, 0.3))
        cases.append(Case(label, "clamp", (kx,), ours, theirs))
    return cases


def _torch_rope(t, x, positions=None, interleaved=False, scaling=None, rotary_dim=None):
    """RoPE in torch: the frequencies (a constant of the configuration) from npattn's
    ``rope_frequencies``, the rotation of each pair written out."""
    d = x.shape[-1]
    r = rotary_dim or d
    pos = np.arange(x.shape[-2]) if positions is None else positions
    inv_freq, factor = F.rope_frequencies(r, 10000.0, scaling, seq_len=int(pos.max()) + 1)
    ang = t.tensor(pos, dtype=t.float64)[..., None] * t.tensor(inv_freq)
    cos, sin = factor * t.cos(ang), factor * t.sin(ang)
    xr = x[..., :r]
    a, b = (xr[..., 0::2], xr[..., 1::2]) if interleaved else (xr[..., : r // 2], xr[..., r // 2 :])
    ya, yb = a * cos - b * sin, b * cos + a * sin
    y = t.stack([ya, yb], -1).reshape(xr.shape) if interleaved else t.cat([ya, yb], -1)
    return t.cat([y, x[..., r:]], -1)


def _torch_conv(t, x, w, b, s, silu):
    """``z_t = b + sum_j w_j xp_{t+j}`` over the input padded with the initial state (zeros)."""
    taps, steps = w.shape[1], x.shape[-2]
    past = t.zeros(x.shape[:-2] + (taps - 1, x.shape[-1]), dtype=x.dtype) if s is None else s
    xp = t.cat([past, x], -2)
    z = sum(xp[..., j : j + steps, :] * w[:, j] for j in range(taps))
    if b is not None:
        z = z + b
    return t.nn.functional.silu(z) if silu else z


CASE_NAMES = [c.name for c in make_cases(np.random.default_rng(0))]


def _case(name, seed=0, lead=(2, 3), length=3):
    return next(c for c in make_cases(np.random.default_rng(seed), lead, length) if c.name == name)


def _draws(case, rng):
    """Random ``dout``, ``ddout`` (never ones) and tangents (one per primal) for ``case``."""
    out, _ = case.call(F, *case.primals)
    tangents = tuple(rng.standard_normal(np.shape(p)) for p in case.primals)
    return rng.standard_normal(np.shape(out)), tangents, rng.standard_normal(np.shape(out))


def _tuple(g):
    return g if isinstance(g, tuple) else (g,)


def _backward_jvp(module, case, dout, tangents, ddout):
    _, cache = case.call(module, *case.primals)
    return getattr(module, case.op + "_backward_jvp")(dout, cache, tangents, ddout)


def _central(module, case, dout, tangents, ddout, h=1e-6):
    """``(backward(dout + h ddout, cache(x + h t)) - backward(dout - h ddout, cache(x - h t))) / 2h``."""
    backward = getattr(module, case.op + "_backward")

    def at(sign):
        moved = [p + sign * h * t for p, t in zip(case.primals, tangents)]
        return _tuple(backward(dout + sign * h * ddout, case.call(module, *moved)[1]))

    return [None if a is None else (a - b) / (2 * h) for a, b in zip(at(1), at(-1))]


def _check(case, seed, tiers=(F, R)):
    """(a) grads equal the backward's, (b) grad_tangents against central differences of the
    backward, (c) the two tiers agree to 1e-12."""
    dout, tangents, ddout = _draws(case, np.random.default_rng(seed))
    results = {}
    for module in tiers:
        grads, tans = _backward_jvp(module, case, dout, tangents, ddout)
        _, cache = case.call(module, *case.primals)
        want = _tuple(getattr(module, case.op + "_backward")(dout, cache))
        grads, tans = _tuple(grads), _tuple(tans)
        assert len(grads) == len(tans) == len(want), case.name
        for g, w, t in zip(grads, want, tans):  # (a): exactly the backward's gradients
            assert (g is None) == (w is None) == (t is None), case.name
            if g is not None:
                np.testing.assert_array_equal(g, w)
                assert t.shape == g.shape and t.dtype == g.dtype, case.name
        num = _central(module, case, dout, tangents, ddout)  # (b)
        for t, n in zip(tans, num):
            if t is not None:
                assert rel_err(t, n, floor=1.0, relative_to="max_b") < 1e-6, (case.name, module.__name__)
        results[module] = (grads, tans)
    if len(tiers) == 2:  # (c)
        for a, b in zip(results[F][0] + results[F][1], results[R][0] + results[R][1]):
            if a is not None:
                assert rel_err(a, b, floor=1.0, relative_to="max_b") < 1e-12, case.name


@pytest.mark.parametrize("name", CASE_NAMES)
def test_grads_and_tangents(name):
    _check(_case(name, seed=1), seed=2)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_matches_torch_jvp_of_vjp(name, torch_or_skip):
    """(d) ``torch.func.jvp`` of ``torch.func.vjp`` of the op's formula, float64."""
    torch = torch_or_skip
    case = _case(name, seed=3)
    if case.torch_fn is None:
        pytest.skip("no torch formula (max_norm's renormalisation and an all-ignored mean are not differentiated)")
    dout, tangents, ddout = _draws(case, np.random.default_rng(4))
    k = len(case.primals)

    def grads_of(*args):
        primals, dy = args[:k], args[k]
        _, vjp = torch.func.vjp(lambda *p: case.torch_fn(torch, *p), *primals)
        return vjp(dy)

    args = tuple(torch.tensor(np.asarray(a, np.float64)) for a in case.primals + (dout,))
    targs = tuple(torch.tensor(a) for a in tangents + (ddout,))
    want_grads, want_tans = torch.func.jvp(grads_of, args, targs)
    for module in (F, R):
        grads, tans = (_tuple(r) for r in _backward_jvp(module, case, dout, tangents, ddout))
        grads, tans = [g for g in grads if g is not None], [t for t in tans if t is not None]
        assert len(grads) == len(want_grads) == len(tans), name
        for g, t, wg, wt in zip(grads, tans, want_grads, want_tans):
            assert rel_err(g, wg, floor=1.0, relative_to="max_b") < 1e-10, (name, module.__name__)
            assert rel_err(t, wt, floor=1.0, relative_to="max_b") < 1e-10, (name, module.__name__)


@given(st.sampled_from(CASE_NAMES), seeds(), shapes(1, 2, 1, 3), st.integers(2, 5))
def test_property_over_shapes_and_options(name, seed, lead, length):
    """(e) every case at hypothesis-drawn leading shapes and sequence lengths (L >= 2)."""
    _check(_case(name, seed, lead, length), seed + 1)


@given(rope_scalings(), seeds(), st.integers(2, 6), st.sampled_from([None, 2, 4]), st.booleans())
def test_property_rope_scalings(scaling, seed, length, rotary_dim, interleaved):
    """(e) rope's second order under every scaling Hugging Face configures, partial rotary too."""
    if rotary_dim == 2 and scaling and "dynamic" in scaling.values():
        rotary_dim = 4  # dynamic's base stretch has the exponent R / (R - 2)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, length, 6))
    pos = rng.integers(0, 20, length)
    kw = dict(positions=pos, scaling=scaling, rotary_dim=rotary_dim, interleaved=interleaved)
    _check(Case("rope", "rope", (x,), lambda M, x: M.rope(x, **kw), None), seed + 1)


@given(
    seeds(),
    shapes(1, 2, 1, 3),
    st.sampled_from(["mean", "sum", "none"]),
    st.sampled_from([0.0, 0.1, 1.0]),
    st.booleans(),
    st.sampled_from(["ids", "ignore", "probs"]),
)
def test_property_cross_entropy_options(seed, lead, reduction, smoothing, weighted, targets):
    """(e) cross_entropy's second order over every option."""
    rng = np.random.default_rng(seed)
    c = 4
    z = rng.standard_normal(lead + (c,)) * 2
    w = rng.uniform(0.5, 2.0, c) if weighted else None
    if targets == "probs":
        tgt, ignore = rng.dirichlet(np.ones(c), lead), None
    else:
        tgt = rng.integers(0, c, lead)
        ignore = None if targets == "ids" else -1
        if ignore is not None:
            tgt = np.where(rng.random(lead) < 0.3, -1, tgt)
    kw = dict(weight=w, reduction=reduction, label_smoothing=smoothing)
    _check(Case("ce", "cross_entropy", (z,), lambda M, x: M.cross_entropy(x, tgt, ignore, **kw), None), seed + 1)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_none_is_zero_and_partial_tangents(name):
    """No tangent and no ddout: the tangents are zero (None where the gradient is None); a
    tangent left out at the end is zero, as in ``<op>_jvp``; float32 stays float32."""
    case = _case(name, seed=5)
    dout, tangents, ddout = _draws(case, np.random.default_rng(6))
    for module in (F, R):
        for none in ((), None) if module is F else ((),):
            grads, tans = (_tuple(r) for r in _backward_jvp(module, case, dout, none, None))
            for g, t in zip(grads, tans):
                assert (g is None) == (t is None)
                if t is not None:
                    assert t.shape == g.shape and not np.any(t), (name, module.__name__)
        if len(tangents) > 1:
            short = _tuple(_backward_jvp(module, case, dout, tangents[:1], ddout)[1])
            padded = tangents[:1] + tuple(np.zeros_like(t) for t in tangents[1:])
            full = _tuple(_backward_jvp(module, case, dout, padded, ddout)[1])
            for a, b in zip(short, full):
                if a is not None:
                    np.testing.assert_allclose(a, b, rtol=0, atol=1e-15)
    prim32 = tuple(np.asarray(p, np.float32) for p in case.primals)
    case32 = case._replace(primals=prim32)
    grads, tans = _backward_jvp(F, case32, dout.astype(np.float32), tangents, ddout.astype(np.float32))
    assert all(t.dtype == np.float32 for t in _tuple(tans) if t is not None), name


def test_softmax_zero_d():
    """A 0-d softmax is constant (y = 1): gradient and tangent 0 in both tiers."""
    for module in (F, R):
        _, cache = module.softmax(np.array(0.3))
        grads, tans = module.softmax_backward_jvp(np.array(1.7), cache, (np.array(0.4),), np.array(-0.2))
        assert np.shape(grads) == () and np.shape(tans) == () and grads == 0 and tans == 0


def test_cross_entropy_hessian_vector_product():
    """With ``dout = 1`` the tangent is the Hessian of the loss times ``tz``: for one row and a
    class id, ``(diag(p) - p p^T) tz`` (the softmax's Jacobian)."""
    rng = np.random.default_rng(7)
    z, tz = rng.standard_normal((1, 5)), rng.standard_normal((1, 5))
    p = np.exp(z[0]) / np.exp(z[0]).sum()
    for module in (F, R):
        _, cache = module.cross_entropy(z, np.array([2]))
        _, hv = module.cross_entropy_backward_jvp(np.array(1.0), cache, (tz,))
        np.testing.assert_allclose(hv[0], (np.diag(p) - np.outer(p, p)) @ tz[0], rtol=1e-12, atol=1e-15)


# -- (f) validation ------------------------------------------------------------------------------------

_NAMES = {
    "linear": ("tx", "tweight", "tbias"),
    "layer_norm": ("tx", "tweight", "tbias"),
    "rms_norm": ("tx", "tweight"),
    "embedding": ("tweight",),
    "cross_entropy": ("tlogits",),
    "rms_norm_gated": ("tx", "tgate", "tweight"),
    "causal_conv1d": ("tx", "tweight", "tbias", "tinitial_state"),
    "xielu": ("tx", "talpha_p", "talpha_n"),
}


@pytest.mark.parametrize("name", CASE_NAMES)
def test_bad_arguments_are_refused_naming_them(name):
    case = _case(name)
    _, cache = case.call(F, *case.primals)
    fn = getattr(F, case.op + "_backward_jvp")
    dout, tangents, ddout = _draws(case, np.random.default_rng(8))
    names = _NAMES.get(case.op, ("tx",))
    for i in range(len(tangents)):
        for bad, kind in ((np.zeros(np.shape(tangents[i]) + (2,)), ValueError), (tangents[i] > 0, TypeError)):
            wrong = list(tangents)
            wrong[i] = bad
            with pytest.raises(kind, match=names[i]):
                fn(dout, cache, tuple(wrong), ddout)
    with pytest.raises(TypeError, match="at most"):
        fn(dout, cache, tuple(tangents) + (None,) * (len(names) - len(tangents)) + (tangents[0],), ddout)
    with pytest.raises(TypeError, match="tangents"):
        fn(dout, cache, tangents[0], ddout)  # a bare array, not a tuple
    with pytest.raises(ValueError, match="ddout"):
        fn(dout, cache, tangents, np.zeros(np.shape(ddout) + (2,)))
    with pytest.raises(TypeError, match="ddout"):
        fn(dout, cache, tangents, np.ones(np.shape(ddout), bool))
    with pytest.raises(ValueError, match="dout"):
        fn(np.zeros(np.shape(dout) + (2,)), cache, tangents, ddout)
    with pytest.raises(TypeError, match="cache"):
        fn(dout, (1, 2), tangents, ddout)
    # integer arrays are cast, as every array argument
    ints = tuple(np.ones(np.shape(t), np.int64) for t in tangents)
    a = _tuple(fn(dout, cache, ints, np.ones(np.shape(ddout), np.int64))[1])
    b = _tuple(fn(dout, cache, tuple(np.ones(np.shape(t)) for t in tangents), np.ones(np.shape(ddout)))[1])
    for x, y in zip(a, b):
        if x is not None:
            np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize(
    "op,call,n",
    [
        ("linear", lambda: F.linear(np.ones((2, 3)), np.ones((4, 3))), 3),
        ("layer_norm", lambda: F.layer_norm(np.arange(6.0).reshape(2, 3)), 3),
        ("rms_norm", lambda: F.rms_norm(np.arange(6.0).reshape(2, 3)), 2),
        ("causal_conv1d", lambda: F.causal_conv1d(np.ones((1, 3, 2)), np.ones((2, 2))), 3),
    ],
)
def test_tangent_of_an_absent_input_is_refused(op, call, n):
    out, cache = call()
    args = [None] * n
    args[-1] = np.ones(4 if op == "linear" else 2 if op == "causal_conv1d" else 3)
    with pytest.raises(ValueError, match="expected None"):
        getattr(F, op + "_backward_jvp")(np.ones(out.shape), cache, tuple(args))


def test_arguments_are_not_modified():
    for case in make_cases(np.random.default_rng(9)):
        dout, tangents, ddout = _draws(case, np.random.default_rng(10))
        copies = [a.copy() for a in (dout, ddout) + tangents]
        for module in (F, R):
            _backward_jvp(module, case, dout, tangents, ddout)
        for a, c in zip((dout, ddout) + tangents, copies):
            np.testing.assert_array_equal(a, c)


def test_every_pair_has_its_second_order_in_both_tiers():
    ops = {c.op for c in make_cases(np.random.default_rng(0))}
    assert len(ops) == 17, sorted(ops)
    for op in ops:
        for module in (F, R):
            assert op + "_backward_jvp" in module.__all__, (op, module.__name__)

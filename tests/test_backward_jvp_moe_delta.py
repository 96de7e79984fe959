"""Second order (``<op>_backward_jvp``) of the mixture-of-experts pairs and the delta rules, both tiers.

``<op>_backward_jvp(dout, cache, tangents, ddout)`` returns ``(grads, grad_tangents)``: ``grads``
exactly ``<op>_backward(dout, cache)``, ``grad_tangents`` the directional derivative of those
gradients when the inputs move along ``tangents`` and ``dout`` along ``ddout``.  Each case is
checked against central differences of the backward along ``(tangents, ddout)`` in float64 with
random ``dout``, ``ddout`` and tangents, the fast tier against the textbook one (1e-12), and
against ``torch.func.jvp`` of ``torch.func.vjp`` of the explicit formula (skipped without torch).

The router's choice of experts is piecewise constant: the cases draw well-separated scores, so
that no step of the central differences flips the choice.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import numpy as np
import pytest
from _oracles import rel_err, torch_delta_rule

import npattn.functional as F
import npattn.functional.reference as R


class Case(NamedTuple):
    """One forward call: ``op`` names the pair; ``primals`` the differentiable inputs in the
    tangents' order; ``call(M, *primals) -> (out, cache)`` with ``M`` either tier; ``torch_fn(torch,
    *tensors)`` the formula in torch (None: no oracle); ``out_of`` picks the differentiated output."""

    name: str
    op: str
    primals: tuple
    call: Callable
    torch_fn: Optional[Callable]
    out_of: Callable = lambda out: out


def _separated_logits(rng, lead, e, gap=0.4):
    """Logits whose entries in each row differ by at least ``gap`` / 2 (a shuffled ladder plus small
    noise): neither the top-k nor the groups' ranking flips under a step of 1e-6."""
    ladder = np.arange(e) * gap - e * gap / 2
    rows = np.stack([rng.permutation(ladder) for _ in range(int(np.prod(lead)))]).reshape(lead + (e,))
    return rows + rng.uniform(-gap / 4, gap / 4, rows.shape)


def _torch_router(t, z, idx, variant, norm, c):
    """The router's formula with the choice ``idx`` (int64) a constant."""
    if variant == "softmax_topk":
        v = t.gather(t.softmax(z, -1), -1, idx)
    elif variant == "sigmoid":
        v = t.gather(t.sigmoid(z), -1, idx)
    else:
        v = t.softmax(t.gather(z, -1, idx), -1)
    if norm:
        v = v / (v.sum(-1, keepdim=True) + (1e-20 if variant == "sigmoid" else 0.0))
    return c * v


def router_cases(rng, lead=(2, 3)) -> list:
    e, cases = 8, []
    z = _separated_logits(rng, tuple(lead), e)
    options = [
        ("router_softmax_topk", dict(variant="softmax_topk")),
        ("router_softmax_topk_norm", dict(variant="softmax_topk", norm_topk_prob=True)),
        ("router_topk_softmax", dict(variant="topk_softmax")),
        ("router_sigmoid", dict(variant="sigmoid")),
        ("router_sigmoid_norm_scaled", dict(variant="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5)),
        (
            "router_sigmoid_grouped",
            dict(
                variant="sigmoid",
                norm_topk_prob=True,
                correction_bias=rng.uniform(-0.05, 0.05, e),
                n_group=4,
                topk_group=2,
                routed_scaling_factor=1.5,
            ),
        ),
    ]
    for name, kw in options:
        (_, idx), _ = F.topk_router(z, 3, **kw)
        norm, c = kw.get("norm_topk_prob", False), kw.get("routed_scaling_factor", 1.0)
        cases.append(
            Case(
                name,
                "topk_router",
                (z,),
                lambda M, z, kw=kw: M.topk_router(z, 3, **kw),
                lambda t, z, idx=idx, v=kw["variant"], n=norm, c=c: _torch_router(t, z, t.tensor(idx), v, n, c),
                lambda out: out[0],
            )
        )
    return cases


def _torch_experts(t, x, w, gate_up, down, gub=None, db=None, *, idx, kind, activation, alpha, limit):
    """``y_n = sum_j w_nj expert_{i_nj}(x_n)`` with the fused weights gathered per pair."""
    h, k = x.shape[-1], idx.shape[-1]
    X, I, W = x.reshape(-1, h), t.tensor(idx.reshape(-1, k)), w.reshape(-1, k)
    act = {
        "silu": t.nn.functional.silu,
        "gelu": t.nn.functional.gelu,
        "gelu_tanh": lambda a: t.nn.functional.gelu(a, approximate="tanh"),
        "relu": t.relu,
        "relu2": lambda a: t.relu(a) ** 2,
    }[activation]
    if kind in ("swiglu", "plain"):
        gu = t.einsum("nkih,nh->nki", gate_up[I], X) + (0.0 if gub is None else gub[I])
        i = gu.shape[-1] // 2
        m = act(gu) if kind == "plain" else act(gu[..., :i]) * gu[..., i:]
        out = t.einsum("nkhi,nki->nkh", down[I], m)
    else:
        gu = t.einsum("nkhi,nh->nki", gate_up[I], X) + (0.0 if gub is None else gub[I])
        g, u = t.clamp(gu[..., ::2], max=limit), t.clamp(gu[..., 1::2], -limit, limit)
        m = (u + 1.0) * g * t.sigmoid(alpha * g)
        out = t.einsum("nkih,nki->nkh", down[I], m)
    out = out + (0.0 if db is None else db[I])
    return (W[..., None] * out).sum(1).reshape(x.shape)


def expert_cases(rng, lead=(2, 3)) -> list:
    lead = tuple(lead)
    e, k, hid, inter = 4, 2, 5, 3
    x = rng.standard_normal(lead + (hid,))
    idx = rng.integers(0, e - 1, lead + (k,))  # the last expert has no token
    w = rng.uniform(0.2, 1.0, lead + (k,))
    cases = []
    acts = {"swiglu": ("silu", "gelu", "gelu_tanh", "relu"), "gpt_oss": ("silu",), "plain": ("relu2", "silu")}
    for kind, activations in acts.items():
        for activation in activations:
            for bias in (True, False):
                if kind == "swiglu":
                    gate_up, down = rng.standard_normal((e, 2 * inter, hid)), rng.standard_normal((e, hid, inter))
                elif kind == "plain":  # not gated: the up rows alone (relu2: pre-activations of both signs)
                    gate_up, down = rng.standard_normal((e, inter, hid)), rng.standard_normal((e, hid, inter))
                else:
                    gate_up, down = rng.standard_normal((e, hid, 2 * inter)), rng.standard_normal((e, inter, hid))
                units = inter if kind == "plain" else 2 * inter
                biases = (rng.standard_normal((e, units)), rng.standard_normal((e, hid))) if bias else ()
                kw = dict(kind=kind, activation=activation, alpha=1.702, limit=1.5)  # the clamps active
                name = f"experts_{kind}" + (f"_{activation}" if kind != "gpt_oss" else "") + ("_bias" if bias else "")
                cases.append(
                    Case(
                        name,
                        "moe_experts",
                        (x, w, gate_up, down) + biases,
                        lambda M, x, w, gu, d, *b, kw=kw: M.moe_experts(x, idx, w, gu, d, *b, **kw),
                        lambda t, *a, kw=kw: _torch_experts(t, *a, idx=idx, **kw),
                    )
                )
    return cases


def delta_cases(rng, lead=(2, 2), length=4) -> list:
    lead = tuple(lead)
    dk, dv = 3, 2
    q, k = rng.standard_normal(lead + (length, dk)), rng.standard_normal(lead + (length, dk))
    v = rng.standard_normal(lead + (length, dv))
    g, beta = -rng.uniform(0.1, 1.0, lead + (length,)), rng.uniform(0.2, 0.9, lead + (length,))
    s0 = rng.standard_normal(lead + (dk, dv))
    return [
        Case(
            "delta_rule",
            "gated_delta_rule",
            (q, k, v, g, beta),
            lambda M, *a: M.gated_delta_rule(*a),
            lambda t, *a: torch_delta_rule(t, *a, l2=False),
        ),
        Case(
            "delta_rule_l2_initial_state",
            "gated_delta_rule",
            (q, k, v, g, beta, s0),
            lambda M, *a: M.gated_delta_rule(*a[:5], initial_state=a[5], use_qk_l2norm=True),
            lambda t, *a: torch_delta_rule(t, *a, l2=True),
        ),
    ]


CASES = {
    c.name: c
    for c in router_cases(np.random.default_rng(0))
    + expert_cases(np.random.default_rng(0))
    + delta_cases(np.random.default_rng(0))
}
# the pairs whose fast tier has no second order yet: checked in the textbook tier only
TEXTBOOK_ONLY: tuple = ()


def _case(name, seed=0):
    make = router_cases if name.startswith("router") else expert_cases if name.startswith("experts") else delta_cases
    return next(c for c in make(np.random.default_rng(seed)) if c.name == name)


def _tiers(case):
    return (R,) if case.op in TEXTBOOK_ONLY else (F, R)


def _tuple(g):
    return g if isinstance(g, tuple) else (g,)


def _draws(case, rng):
    """Random ``dout``, ``ddout`` (never ones) and tangents (one per primal) for ``case``."""
    out = case.out_of(case.call(F, *case.primals)[0])
    tangents = tuple(rng.standard_normal(np.shape(p)) for p in case.primals)
    return rng.standard_normal(np.shape(out)), tangents, rng.standard_normal(np.shape(out))


def _backward_jvp(module, case, dout, tangents, ddout, **kw):
    _, cache = case.call(module, *case.primals)
    return getattr(module, case.op + "_backward_jvp")(dout, cache, tangents, ddout, **kw)


def _central(module, case, dout, tangents, ddout, h=1e-6):
    """``(backward(dout + h ddout, cache(x + h t)) - backward(dout - h ddout, cache(x - h t))) / 2h``."""
    backward = getattr(module, case.op + "_backward")

    def at(sign):
        moved = [p + sign * h * t for p, t in zip(case.primals, tangents)]
        return _tuple(backward(dout + sign * h * ddout, case.call(module, *moved)[1]))

    return [None if a is None else (a - b) / (2 * h) for a, b in zip(at(1), at(-1))]


def _check(case, seed):
    """(a) grads equal the backward's, (b) grad_tangents against central differences of the
    backward, (c) the two tiers agree to 1e-12."""
    dout, tangents, ddout = _draws(case, np.random.default_rng(seed))
    results = {}
    for module in _tiers(case):
        grads, tans = (_tuple(r) for r in _backward_jvp(module, case, dout, tangents, ddout))
        _, cache = case.call(module, *case.primals)
        want = _tuple(getattr(module, case.op + "_backward")(dout, cache))
        assert len(grads) == len(tans) == len(want), case.name
        for g, w, t in zip(grads, want, tans):  # (a)
            assert (g is None) == (w is None) == (t is None), case.name
            if g is not None:
                np.testing.assert_array_equal(g, w)
                assert t.shape == g.shape and t.dtype == g.dtype, case.name
        for t, n in zip(tans, _central(module, case, dout, tangents, ddout)):  # (b)
            if t is not None:
                assert np.any(n), case.name  # a case whose tangent is zero proves nothing
                assert rel_err(t, n, floor=1.0, relative_to="max_b") < 1e-6, (case.name, module.__name__)
        results[module] = grads + tans
    for a, b in zip(results.get(F, ()), results[R]):  # (c)
        if a is not None:
            assert rel_err(a, b, floor=1.0, relative_to="max_b") < 1e-12, case.name


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("seed", [1, 2])
def test_grads_and_tangents(name, seed):
    _check(_case(name, seed), seed + 10)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_torch_jvp_of_vjp(name, torch_or_skip):
    """(d) ``torch.func.jvp`` of ``torch.func.vjp`` of the explicit formula, float64."""
    torch = torch_or_skip
    case = _case(name, seed=3)
    dout, tangents, ddout = _draws(case, np.random.default_rng(4))
    k = len(case.primals)

    def grads_of(*args):
        _, vjp = torch.func.vjp(lambda *p: case.torch_fn(torch, *p), *args[:k])
        return vjp(args[k])

    args = tuple(torch.tensor(np.asarray(a, np.float64)) for a in case.primals + (dout,))
    targs = tuple(torch.tensor(a) for a in tangents + (ddout,))
    want_grads, want_tans = torch.func.jvp(grads_of, args, targs)
    for module in _tiers(case):
        grads, tans = (_tuple(r) for r in _backward_jvp(module, case, dout, tangents, ddout))
        grads, tans = [g for g in grads if g is not None], [t for t in tans if t is not None]
        assert len(grads) == len(want_grads) == len(tans), name
        for g, t, wg, wt in zip(grads, tans, want_grads, want_tans):
            assert rel_err(g, wg, floor=1.0, relative_to="max_b") < 1e-10, (name, module.__name__)
            assert rel_err(t, wt, floor=1.0, relative_to="max_b") < 1e-10, (name, module.__name__)


@pytest.mark.parametrize("name", list(CASES))
def test_none_is_zero(name):
    """No tangent and no ddout: zero tangents; float32 stays float32."""
    case = _case(name, seed=5)
    dout, tangents, ddout = _draws(case, np.random.default_rng(6))
    for module in _tiers(case):
        grads, tans = (_tuple(r) for r in _backward_jvp(module, case, dout, (), None))
        for g, t in zip(grads, tans):
            assert (g is None) == (t is None)
            if t is not None:
                assert t.shape == g.shape and not np.any(t), (name, module.__name__)
    if F not in _tiers(case):
        return  # the textbook tier does no casting
    case32 = case._replace(primals=tuple(np.asarray(p, np.float32) for p in case.primals))
    _, tans = _backward_jvp(F, case32, dout.astype(np.float32), tangents, ddout.astype(np.float32))
    assert all(t.dtype == np.float32 for t in _tuple(tans) if t is not None), name


def test_router_choice_does_not_move():
    """The choice is piecewise constant: ``tdlogits`` is zero outside the chosen experts for the
    selection-only variants, and the tangent is the same whether or not the chosen indices would
    flip a finite step away (it is the derivative at the point)."""
    rng = np.random.default_rng(7)
    z = _separated_logits(rng, (4,), 6)
    (_, idx), cache = F.topk_router(z, 2, variant="topk_softmax")
    dout, tz, ddout = rng.standard_normal((4, 2)), rng.standard_normal((4, 6)), rng.standard_normal((4, 2))
    for module in (F, R):
        _, cache = module.topk_router(z, 2, variant="topk_softmax")
        _, tdz = module.topk_router_backward_jvp(dout, cache, (tz,), ddout)
        chosen = np.zeros(z.shape, bool)
        np.put_along_axis(chosen, idx, True, -1)
        assert np.all(tdz[~chosen] == 0) and np.any(tdz[chosen])


def test_router_bad_arguments_are_refused_naming_them():
    z = _separated_logits(np.random.default_rng(8), (3,), 5)
    (_, _), cache = F.topk_router(z, 2)
    dout = np.ones((3, 2)) * 0.3
    with pytest.raises(ValueError, match="tlogits"):
        F.topk_router_backward_jvp(dout, cache, (np.zeros((3, 4)),))
    with pytest.raises(TypeError, match="at most 1"):
        F.topk_router_backward_jvp(dout, cache, (z, z))
    with pytest.raises(ValueError, match="ddout"):
        F.topk_router_backward_jvp(dout, cache, (z,), np.zeros((3, 5)))
    with pytest.raises(ValueError, match="dout"):
        F.topk_router_backward_jvp(np.zeros((3, 5)), cache, (z,))
    with pytest.raises(TypeError, match="cache"):
        F.topk_router_backward_jvp(dout, (1, 2), (z,))


def test_experts_bad_arguments_are_refused_naming_them():
    case = _case("experts_swiglu_silu")  # no biases
    _, cache = case.call(F, *case.primals)
    dout, tangents, ddout = _draws(case, np.random.default_rng(9))
    fn = F.moe_experts_backward_jvp
    for i, name in enumerate(("tx", "tweights", "tgate_up", "tdown")):
        wrong = list(tangents)
        wrong[i] = np.zeros(np.shape(tangents[i]) + (2,))
        with pytest.raises(ValueError, match=name):
            fn(dout, cache, tuple(wrong), ddout)
    with pytest.raises(ValueError, match="tgate_up_bias.*expected None"):
        fn(dout, cache, tangents + (np.zeros((4, 6)),), ddout)
    with pytest.raises(TypeError, match="at most 6"):
        fn(dout, cache, tangents + (None, None, tangents[0]), ddout)
    with pytest.raises(ValueError, match="ddout"):
        fn(dout, cache, tangents, np.zeros(np.shape(ddout) + (2,)))
    with pytest.raises(TypeError, match="cache"):
        fn(dout, (1, 2), tangents, ddout)
    copies = [a.copy() for a in (dout, ddout) + tangents]
    for module in (F, R):
        _backward_jvp(module, case, dout, tangents, ddout)
    for a, c in zip((dout, ddout) + tangents, copies):
        np.testing.assert_array_equal(a, c)


def _assert_bitwise(got, want):
    """Each array of ``got`` bit for bit the one of ``want`` (None where it is None)."""
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if a is not None:
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("experts")])
def test_experts_kernels_take_the_forward_tangents_once(name):
    """``Experts``' shortcut: ``experts_tangents`` once, handed to the JVP's and the second order's
    kernels (``forward=``): bit for bit what the public pair gives, which computes them itself."""
    from npattn.functional import kernels as K
    from npattn.functional.moe import experts_tangents

    case = _case(name, seed=5)
    dout, tangents, ddout = _draws(case, np.random.default_rng(6))
    _, cache = case.call(F, *case.primals)
    tangents = tuple(tangents) + (None,) * (6 - len(tangents))
    tx, _, tgu, tdown, tgub, tdb = tangents
    forward = experts_tangents(cache, tx, tgu, tdown, tgub, tdb)
    np.testing.assert_array_equal(
        K.moe_experts_jvp(cache, *tangents, forward=forward), F.moe_experts_jvp(cache, *tangents)
    )
    got = K.moe_experts_backward_jvp(dout, cache, tangents, ddout, forward=forward)
    want = F.moe_experts_backward_jvp(dout, cache, tangents, ddout)
    _assert_bitwise(got[0] + got[1], want[0] + want[1])
    _assert_bitwise(got[0], F.moe_experts_backward(dout, cache))  # the gradients: the backward's own


@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("moved", ["x", "weight", "both", "none"])
def test_conv_second_order_takes_the_jvp_s_tangents(activation, moved):
    """``GatedDeltaNet``'s shortcut for its convolution: the JVP keeps the pre-activation's and the
    padded input's tangents (``keep=True``), the second order takes them (``forward=``): bit for
    bit the public pair's JVP, gradients and tangents (which compute them again)."""
    from npattn.functional import kernels as K

    rng = np.random.default_rng(7)
    x, w, s0 = rng.standard_normal((2, 6, 5)), rng.standard_normal((5, 3)), rng.standard_normal((2, 2, 5))
    _, cache = F.causal_conv1d(x, w, rng.standard_normal(5), activation=activation, initial_state=s0)
    tx = rng.standard_normal(x.shape) if moved in ("x", "both") else None
    tw = rng.standard_normal(w.shape) if moved in ("weight", "both") else None
    tangents = (tx, tw, None, rng.standard_normal(s0.shape) if moved == "x" else None)
    dout, ddout = rng.standard_normal(x.shape), rng.standard_normal(x.shape)
    ty, forward = K.causal_conv1d_jvp(cache, *tangents, keep=True)
    np.testing.assert_array_equal(ty, F.causal_conv1d_jvp(cache, *tangents))
    got = K.causal_conv1d_backward_jvp(dout, cache, tangents, ddout, forward=forward)
    want = F.causal_conv1d_backward_jvp(dout, cache, tangents, ddout)
    _assert_bitwise(got[0] + got[1], want[0] + want[1])


def test_loss_hvp_scans_and_runs_the_experts_forward_tangents_once(monkeypatch):
    """In ``loss_hvp`` of a Qwen3-Next (DeltaNet and MoE layers), the delta rule's tangent scan and
    its terms' tangents run once per DeltaNet layer (its JVP; the second order takes the states'
    tangents and the last block's terms it kept: one block at these sizes) and the experts' forward
    tangents are computed once per MoE layer (the JVP's, then the second order's); the numbers are
    those of the public pairs, which compute them again (checked above)."""
    import npattn.functional.delta_rule as D
    import npattn.functional.moe as M
    import npattn.nn.moe as NM
    from npattn.models import CausalLM
    from npattn.models.tiny import tiny_config

    m = CausalLM(tiny_config("qwen3_next"), rng=0)
    rng = np.random.default_rng(1)
    ids, targets = rng.integers(0, m.config.vocab_size, (2, 2, 7))
    v = {n: rng.standard_normal(p.data.shape) for n, p in m.named_parameters()}
    counts = {"scan": 0, "experts": 0, "term_tangents": 0}

    def counted(module, attr, key):
        original = getattr(module, attr)

        def wrapper(*args, **kwargs):
            counts[key] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(module, attr, wrapper)

    counted(D, "tangent_scan", "scan")
    counted(D, "_term_tangents", "term_tangents")
    monkeypatch.setattr(D, "_RULE", D._RULE._replace(term_tangents=D._term_tangents))
    counted(M, "experts_tangents", "experts")
    counted(NM, "experts_tangents", "experts")
    m.loss_hvp(ids, targets, v)
    kinds = m.config.layer_types
    assert counts["scan"] == counts["term_tangents"] == sum(k == "linear_attention" for k in kinds) > 0
    assert counts["experts"] == sum(k == "moe" for k in m.config.mlp_types) > 0


def test_delta_rule_with_the_final_state():
    """``dfinal_state`` moves along ``ddfinal_state``: central differences of the backward along
    (tangents, ddout, ddfinal_state), and torch's jvp of vjp of the recurrence returning the state."""
    rng = np.random.default_rng(11)
    q, k, v, g, beta, s0 = delta_cases(rng)[1].primals
    primals = (q, k, v, g, beta, s0)
    kw = dict(use_qk_l2norm=True, output_final_state=True)
    tangents = tuple(rng.standard_normal(p.shape) for p in primals)
    dout, ddout = rng.standard_normal(v.shape), rng.standard_normal(v.shape)
    dfin, ddfin = rng.standard_normal(s0.shape), rng.standard_normal(s0.shape)

    def cache_at(*p):
        return R.gated_delta_rule(*p[:5], initial_state=p[5], **kw)[1]

    grads, tans = R.gated_delta_rule_backward_jvp(dout, cache_at(*primals), tangents, ddout, dfin, ddfin)
    for a, b in zip(grads, R.gated_delta_rule_backward(dout, cache_at(*primals), dfin)):
        np.testing.assert_array_equal(a, b)
    h = 1e-6

    def at(sign):
        moved = [p + sign * h * t for p, t in zip(primals, tangents)]
        return R.gated_delta_rule_backward(dout + sign * h * ddout, cache_at(*moved), dfin + sign * h * ddfin)

    for t, a, b in zip(tans, at(1), at(-1)):
        assert rel_err(t, (a - b) / (2 * h), floor=1.0, relative_to="max_b") < 1e-6
    torch = pytest.importorskip("torch")

    def grads_of(*args):
        _, vjp = torch.func.vjp(lambda *p: torch_delta_rule(torch, *p, l2=True, final=True), *args[:6])
        return vjp((args[6], args[7]))

    args = tuple(torch.tensor(a) for a in primals + (dout, dfin))
    want_grads, want_tans = torch.func.jvp(grads_of, args, tuple(torch.tensor(a) for a in tangents + (ddout, ddfin)))
    for g_, t_, wg, wt in zip(grads, tans, want_grads, want_tans):
        assert rel_err(g_, wg, floor=1.0, relative_to="max_b") < 1e-10
        assert rel_err(t_, wt, floor=1.0, relative_to="max_b") < 1e-10


@pytest.mark.parametrize("chunk", [1, 2, 3, 64])
@pytest.mark.parametrize("l2", [False, True])
@pytest.mark.parametrize("with_state", [False, True])
def test_delta_rule_chunked_equals_textbook_and_central_differences(chunk, l2, with_state):
    """The chunked tier's second order over chunk sizes (7 steps: a partial last chunk but for
    C = 1 and 64), with and without q/k normalisation, initial state and dfinal_state/ddfinal_state:
    the gradients are exactly the chunked backward's, the tangents the textbook tier's to 1e-12
    and central differences of the chunked backward's."""
    rng = np.random.default_rng(20 + chunk)
    lead, length, dk, dv = (2, 2), 7, 3, 2
    q, k = rng.standard_normal(lead + (length, dk)), rng.standard_normal(lead + (length, dk))
    v = rng.standard_normal(lead + (length, dv))
    g, beta = -rng.uniform(0.1, 1.0, lead + (length,)), rng.uniform(0.2, 0.9, lead + (length,))
    primals = (q, k, v, g, beta) + ((rng.standard_normal(lead + (dk, dv)),) if with_state else ())
    tangents = tuple(rng.standard_normal(p.shape) for p in primals)
    dout, ddout = rng.standard_normal(v.shape), rng.standard_normal(v.shape)
    dfin, ddfin = (rng.standard_normal(lead + (dk, dv)) for _ in range(2)) if with_state else (None, None)

    def cache_at(module, *p, **extra):
        kw = dict(initial_state=p[5] if with_state else None, use_qk_l2norm=l2, output_final_state=with_state)
        return module.gated_delta_rule(*p[:5], **kw, **extra)[1]

    fast = cache_at(F, *primals, chunk_size=chunk)
    grads, tans = F.gated_delta_rule_backward_jvp(dout, fast, tangents, ddout, dfin, ddfin)
    for a, b in zip(grads, F.gated_delta_rule_backward(dout, fast, dfin)):
        assert (a is None) == (b is None) == (not with_state and a is None)
        if a is not None:
            np.testing.assert_array_equal(a, b)
    _assert_kept_forward_tangents_change_nothing(fast, tangents, dout, ddout, dfin, ddfin, (grads, tans))
    want = R.gated_delta_rule_backward_jvp(dout, cache_at(R, *primals), tangents, ddout, dfin, ddfin)[1]
    for t, w in zip(tans, want):
        assert (t is None) == (w is None)
        if t is not None:
            assert t.shape == w.shape and rel_err(t, w, floor=1.0, relative_to="max_b") < 1e-12
    h = 1e-6

    def at(sign):
        moved = [p + sign * h * t for p, t in zip(primals, tangents)]
        dfin_moved = None if dfin is None else dfin + sign * h * ddfin
        return F.gated_delta_rule_backward(dout + sign * h * ddout, cache_at(F, *moved, chunk_size=chunk), dfin_moved)

    for t, a, b in zip(tans, at(1), at(-1)):
        if t is not None:
            assert np.any(t) and rel_err(t, (a - b) / (2 * h), floor=1.0, relative_to="max_b") < 1e-6


def test_delta_rule_chunked_second_order_long_float32():
    """A long float32 sequence (2000 steps in chunks of 4, several blocks of chunks): finite
    tangents that stay float32, no tinitial_state's without an initial state."""
    rng = np.random.default_rng(30)
    q, k = rng.standard_normal((1, 1, 2000, 4)), rng.standard_normal((1, 1, 2000, 4))
    v, g, beta = rng.standard_normal((1, 1, 2000, 3)), -rng.uniform(0, 1, (1, 1, 2000)), rng.uniform(0, 1, (1, 1, 2000))
    args = tuple(a.astype(np.float32) for a in (q, k, v, g, beta))
    _, cache = F.gated_delta_rule(*args, use_qk_l2norm=True, chunk_size=4)
    tangents = tuple(rng.standard_normal(a.shape) for a in args)
    dout = rng.standard_normal(v.shape).astype(np.float32)
    grads, tans = F.gated_delta_rule_backward_jvp(dout, cache, tangents, dout[..., ::-1].copy())
    assert all(t.dtype == np.float32 and np.isfinite(t).all() for t in tans[:5]) and tans[5] is None
    tangents32 = tuple(t.astype(np.float32) for t in tangents)
    _assert_kept_forward_tangents_change_nothing(cache, tangents32, dout, dout[..., ::-1].copy(), None, None, None)


def _assert_kept_forward_tangents_change_nothing(cache, tangents, dout, ddout, dfin, ddfin, want):
    """The kernels' shortcut (``GatedDeltaNet``'s): the JVP keeps the states' tangents
    (``keep=True``) and the second order along the same tangents takes them (``forward=``)
    instead of its first pass; bit for bit the same JVP, gradients and tangents (``want``: the
    public second order's, None: computed here)."""
    from npattn.functional import kernels as K

    if want is None:
        want = F.gated_delta_rule_backward_jvp(dout, cache, tangents, ddout, dfin, ddfin)
    out, kept = K.gated_delta_rule_jvp(cache, *tangents, keep=True)
    for a, b in zip(_tuple(out), _tuple(F.gated_delta_rule_jvp(cache, *tangents))):
        np.testing.assert_array_equal(a, b)
    got = K.gated_delta_rule_backward_jvp(dout, cache, tangents, ddout, dfin, ddfin, forward=kept)
    _assert_bitwise(got[0] + got[1], want[0] + want[1])


def test_delta_rule_chunked_bad_arguments_are_refused_naming_them():
    case = _case("delta_rule")
    _, cache = case.call(F, *case.primals)
    dout, tangents, ddout = _draws(case, np.random.default_rng(12))
    fn = F.gated_delta_rule_backward_jvp
    with pytest.raises(ValueError, match="tinitial_state.*expected None"):
        fn(dout, cache, tangents + (np.zeros((2, 2, 3, 2)),), ddout)
    with pytest.raises(ValueError, match="tg"):
        fn(dout, cache, (None, None, None, np.zeros((2, 2, 5))), ddout)
    with pytest.raises(ValueError, match="ddfinal_state"):
        fn(dout, cache, tangents, ddout, None, np.zeros((2, 2, 3)))
    with pytest.raises(ValueError, match="ddout"):
        fn(dout, cache, tangents, np.zeros((2, 2, 5, 2)))
    with pytest.raises(TypeError, match="cache"):
        fn(dout, (1, 2), tangents, ddout)

"""Mixture of experts (npattn.nn.moe) without torch: the sorting dispatch against a dense textbook
reference (every expert on every token, per-token routing loops), gradients against central
differences of that independent reference and through ``npattn.gradcheck``, router statistics,
dtypes, and bad arguments refused by name.  The Hugging Face oracles are in test_moe_hf.py."""

import math

import numpy as np
import pytest
from _fd import fd_gradients
from _oracles import rel_err
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import npattn
from npattn.nn import moe
from npattn.nn.moe import Experts, GatedMLP, GptOssExperts, MoE, PlainExperts, SparseMoeBlock, TopKRouter
from npattn.testing import gradcheck, moe_configs

# ------------------------------------------------------------------------ the textbook reference

_erf = np.vectorize(math.erf)


def _act(name, a):
    if name in ("silu", "swish"):
        return a / (1.0 + np.exp(-a))
    if name == "gelu":
        return 0.5 * a * (1.0 + _erf(a / math.sqrt(2.0)))
    if name in ("gelu_pytorch_tanh", "gelu_new"):
        return 0.5 * a * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (a + 0.044715 * a**3)))
    if name == "relu2":
        return np.maximum(a, 0.0) ** 2
    assert name == "relu"
    return np.maximum(a, 0.0)


def _sig(a):
    return 1.0 / (1.0 + np.exp(-a))


def ref_route(r, x, p):
    """Per-token loops: ``(dense weights (N, E), margin)``; ``margin`` is the smallest gap between
    the last chosen and the first refused choice score (and group score): finite differences
    smaller than it never change the choice.  ``p``: the router's parameters by name."""
    z = x @ p["weight"].T + (p["bias"] if "bias" in p else 0.0)
    n_tok, e = z.shape
    dense = np.zeros((n_tok, e))
    margin = np.inf
    for n in range(n_tok):
        zn = z[n]
        if r.variant == "softmax_topk":
            src = np.exp(zn - zn.max()) / np.exp(zn - zn.max()).sum()
            choice = src
        elif r.variant == "topk_softmax":
            src = choice = zn
        else:
            src = _sig(zn)
            choice = src + r.e_score_correction_bias
        allowed = list(range(e))
        if r.n_group > 1:
            size = e // r.n_group
            gscore = [sum(sorted(choice[j * size : (j + 1) * size])[-2:]) for j in range(r.n_group)]
            order = sorted(range(r.n_group), key=lambda j: -gscore[j])
            if r.topk_group < r.n_group:
                margin = min(margin, gscore[order[r.topk_group - 1]] - gscore[order[r.topk_group]])
            allowed = [i for j in order[: r.topk_group] for i in range(j * size, (j + 1) * size)]
        cand = sorted(allowed, key=lambda i: -choice[i])
        chosen = cand[: r.top_k]
        if r.top_k < len(cand):
            margin = min(margin, choice[cand[r.top_k - 1]] - choice[cand[r.top_k]])
        v = src[chosen]
        if r.variant == "topk_softmax":
            w = np.exp(v - v.max()) / np.exp(v - v.max()).sum()
        elif r.norm_topk_prob:
            w = v / (v.sum() + (1e-20 if r.variant == "sigmoid" else 0.0))
        else:
            w = v
        dense[n, chosen] = w * r.routed_scaling_factor
    return dense, margin


def ref_experts(ex, x, p):
    """Every expert on every token: ``(outputs (N, E, H), clamp margin)``."""
    if isinstance(ex, GptOssExperts):
        gu = np.einsum("nh,eho->neo", x, p["gate_up_proj"]) + p["gate_up_proj_bias"]
        gate, up = gu[..., ::2], gu[..., 1::2]
        lim = ex.limit
        g = np.minimum(gate, lim)
        h = (np.clip(up, -lim, lim) + 1.0) * g * _sig(ex.alpha * g)
        out = np.einsum("nei,eih->neh", h, p["down_proj"]) + p["down_proj_bias"]
        margin = min(np.abs(gate - lim).min(), np.abs(np.abs(up) - lim).min())
        return out, margin
    if isinstance(ex, PlainExperts):  # not gated: down(act(up x)) (transformers' NemotronHExperts)
        up = np.einsum("nh,eoh->neo", x, p["up_proj"])
        return np.einsum("nei,ehi->neh", _act(ex.hidden_act, up), p["down_proj"]), np.inf
    gu = np.einsum("nh,eoh->neo", x, p["gate_up_proj"])
    i = ex.intermediate_size
    h = _act(ex.hidden_act, gu[..., :i]) * gu[..., i:]
    return np.einsum("nei,ehi->neh", h, p["down_proj"]), np.inf


def _sub(params, prefix):
    return {k[len(prefix) + 1 :]: v for k, v in params.items() if k.startswith(prefix + ".")}


def ref_block(m, x, params=None):
    """The block's output from its parameters (``params`` overrides ``m.state_dict()``), dense:
    ``(y (..., H), margin)``."""
    p = dict(m.state_dict())
    p.update(params or {})
    x2 = x.reshape(-1, m.hidden_size)
    dense, margin = ref_route(m.router_module, x2, _sub(p, m._router_name))

    def lin(name, a):
        return a @ p[f"{name}.weight"].T + p.get(f"{name}.bias", 0.0)

    xl = x2 if m.latent_size is None else lin("fc1_latent_proj", x2)  # the experts' latent width
    outs, clamp = ref_experts(m.experts, xl, _sub(p, "experts"))
    y = np.einsum("ne,neh->nh", dense, outs)
    y = y if m.latent_size is None else lin("fc2_latent_proj", y)
    sh = m.shared_module
    if isinstance(sh, npattn.FeedForward):  # beside plain experts: not gated
        q = _sub(p, m._shared_name)
        s = _act(m.experts.hidden_act, x2 @ q["linear1.weight"].T) @ q["linear2.weight"].T
        if m.shared_gate_module is not None:
            s = _sig(x2 @ p["shared_expert_gate.weight"].T) * s
        y = y + s
    elif sh is not None:
        q = _sub(p, m._shared_name)
        s = (_act(sh.hidden_act, x2 @ q["gate_proj.weight"].T) * (x2 @ q["up_proj.weight"].T)) @ q["down_proj.weight"].T
        if m.shared_gate_module is not None:
            s = _sig(x2 @ p["shared_expert_gate.weight"].T) * s
        y = y + s
    return y.reshape(x.shape), min(margin, clamp)


# ------------------------------------------------------------------------------ fixed cases

FAMILIES = {
    "qwen3_next": dict(model_type="qwen3_next", hidden_size=5, num_experts=6, num_experts_per_tok=2,
                       moe_intermediate_size=3, shared_expert_intermediate_size=4, norm_topk_prob=True),
    "deepseek_v3": dict(model_type="deepseek_v3", hidden_size=5, n_routed_experts=8, num_experts_per_tok=3,
                        moe_intermediate_size=3, n_shared_experts=2, n_group=4, topk_group=2,
                        routed_scaling_factor=2.5, norm_topk_prob=True, hidden_act="silu"),
    "gpt_oss": dict(model_type="gpt_oss", hidden_size=5, num_local_experts=4, num_experts_per_tok=2,
                    intermediate_size=3, swiglu_limit=0.8),
}  # fmt: skip


def _family_block(name, seed=0, dtype=np.float64):
    m = SparseMoeBlock.from_hf_config(FAMILIES[name], rng=seed, dtype=dtype)
    if m.router_module.variant == "sigmoid":
        m.router_module.e_score_correction_bias[...] = np.random.default_rng(seed + 7).uniform(-0.3, 0.3, 8)
    return m


def _x(shape, seed=1, scale=1.5):
    return np.random.default_rng(seed).uniform(-scale, scale, shape)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_forward_equals_dense_reference(family):
    m = _family_block(family)
    x = _x((2, 7, 5))
    y = m(x)
    ref, margin = ref_block(m, x)
    assert margin > 1e-4
    assert y.shape == x.shape
    assert rel_err(y, ref, floor=1e-12) < 1e-12


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_gradients_against_fd_of_the_reference(family):
    """Every parameter's and the input's gradient against central differences of the independent
    dense reference (not of the module's own forward)."""
    m = _family_block(family)
    x = _x((2, 3, 5), seed=2)
    dy = np.random.default_rng(3).standard_normal(x.shape)
    assert ref_block(m, x)[1] > 1e-4  # away from ties and clamp kinks
    m(x)
    dx = m.backward(dy)
    names = [n for n, _ in m.named_parameters()]
    params = [p.data for _, p in m.named_parameters()]

    def f(x_, *ps):
        return np.sum(ref_block(m, x_, dict(zip(names, ps)))[0] * dy)

    num = fd_gradients(f, [x, *params])
    assert rel_err(dx, num[0]) < 1e-6
    for (name, p), g in zip(m.named_parameters(), num[1:]):
        assert rel_err(p.grad, g) < 1e-6, name
        assert np.abs(g).max() > 1e-6, name  # every parameter matters (the check can fail)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_gradcheck(family):
    report = gradcheck(_family_block(family), _x((3, 5), seed=4))
    assert report.ok, str(report)


def test_correction_bias_steers_the_choice_only():
    """The correction bias changes which experts are chosen, not the chosen weights' values; so
    the output's derivative with respect to it is zero (it is a buffer: no gradient)."""
    m = _family_block("deepseek_v3")
    r = m.router_module
    assert "gate.e_score_correction_bias" in m.state_dict()
    assert "gate.e_score_correction_bias" not in dict(m.named_parameters())
    x = _x((12, 5), seed=5)
    y = m(x)
    (g,) = fd_gradients(
        lambda b: np.sum(ref_block(m, x, {"gate.e_score_correction_bias": b})[0]), [r.e_score_correction_bias]
    )
    assert np.all(g == 0.0)
    # without the bias the choice differs for some token (the bias is not a no-op)
    idx = r.last_indices.copy()
    r.e_score_correction_bias[...] = 0.0
    y0 = m(x)
    assert any(set(a) != set(b) for a, b in zip(idx, r.last_indices))
    assert not np.allclose(y, y0)


# ----------------------------------------------------------------------- property tests


def _block_and_margin(case):
    m = case.block()
    ref, margin = ref_block(m, case.x.astype(np.float64))
    return m, ref, margin


@given(moe_configs())
def test_sorting_dispatch_equals_dense_reference(case):
    m, ref, _ = _block_and_margin(case)
    y = m(case.x)
    assert rel_err(y, ref, floor=1e-12) < 1e-11
    counts = m.tokens_per_expert
    n_tok = case.x.size // case.hidden_size
    assert counts.sum() == n_tok * case.top_k
    np.testing.assert_array_equal(counts, np.bincount(m.router_module.last_indices.ravel(), minlength=case.num_experts))
    assert m.router_module.last_indices.shape == case.x.shape[:-1] + (case.top_k,)


@settings(max_examples=60)
@given(moe_configs())
def test_property_gradients_fd(case):
    m, _, margin = _block_and_margin(case)
    assume(margin > 1e-4)
    report = gradcheck(m, case.x, fast=True, seed=case.seed % 1000)
    assert report.ok, str(report)


@settings(max_examples=40)
@given(moe_configs(), st.integers(0, 2**16))
def test_experts_module_against_dense(case, seed):
    """The experts alone, on any routing (repeats allowed): output and ``dtop_k_weights``."""
    ex = case.block().experts
    rng = np.random.default_rng(seed)
    x2 = case.x.reshape(-1, case.hidden_size)
    if ex.hidden_size != case.hidden_size:  # experts in a latent width
        x2 = rng.uniform(-1.5, 1.5, (x2.shape[0], ex.hidden_size))
    idx = rng.integers(0, case.num_experts, (x2.shape[0], case.top_k))
    w = rng.uniform(-1, 1, idx.shape)
    y = ex(x2, idx, w)
    outs, clamp_margin = ref_experts(ex, x2, dict(ex.state_dict()))
    assume(clamp_margin > 1e-4)  # finite differences away from the clamps' kinks
    ref = np.einsum("nk,nkh->nh", w, np.take_along_axis(outs, idx[..., None], 1))
    assert rel_err(y, ref, floor=1e-12) < 1e-11
    dy = rng.standard_normal(y.shape)
    dx, dw = ex.backward(dy)
    np.testing.assert_allclose(dw, np.einsum("nh,nkh->nk", dy, np.take_along_axis(outs, idx[..., None], 1)), rtol=1e-10)
    with npattn.no_grad():  # the difference quotients' forwards have no backward: they keep no state
        (num_dx,) = fd_gradients(lambda a: np.sum(ex(a, idx, w) * dy), [x2])
    assert rel_err(dx, num_dx) < 1e-6


@settings(max_examples=60)
@given(moe_configs(variants=("softmax_topk", "sigmoid")))
def test_renormalised_weights_sum_to_the_scaling_factor(case):
    m = case.block()
    r = m.router_module
    w, idx = r(case.x)
    if r.norm_topk_prob:
        np.testing.assert_allclose(w.sum(-1), r.routed_scaling_factor, rtol=1e-12)
    assert np.all(w > 0)
    assert all(len(set(row)) == case.top_k for row in idx.reshape(-1, case.top_k))


# ------------------------------------------------------------------------------ behaviour


def test_topk_softmax_weights_sum_to_one_and_follow_the_logits():
    r = TopKRouter(4, 6, 3, variant="topk_softmax", bias=True, rng=0)
    x = _x((5, 4))
    w, idx = r(x)
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-12)
    z = r.last_logits
    np.testing.assert_array_equal(idx, np.argsort(-z, axis=-1)[:, :3])  # largest first


def test_unbatched_and_batched_agree():
    m = _family_block("qwen3_next")
    x = _x((2, 4, 5))
    y = m(x)
    np.testing.assert_allclose(m(x[1]), y[1], rtol=1e-13)
    np.testing.assert_allclose(m(x.reshape(8, 5)).reshape(x.shape), y, rtol=1e-13)


def test_float32_stays_float32():
    for family in FAMILIES:
        m = _family_block(family, dtype=np.float32)
        x = _x((3, 5)).astype(np.float32)
        y = m(x)
        dx = m.backward(np.ones_like(y) * 0.5)
        assert y.dtype == dx.dtype == np.float32
        for name, p in m.named_parameters():
            assert p.data.dtype == p.grad.dtype == np.float32, name
        m64 = _family_block(family)
        assert rel_err(y, m64(x.astype(np.float64)), floor=1e-3) < 1e-4


def test_gradients_accumulate_and_none_grads_are_recreated():
    m = _family_block("gpt_oss")
    x = _x((4, 5))
    dy = np.random.default_rng(9).standard_normal(x.shape)
    m(x)
    m.backward(dy)
    first = {n: p.grad.copy() for n, p in m.named_parameters()}
    for _, p in m.named_parameters():
        p.grad = None
    m(x)
    m.backward(dy)
    m(x)
    m.backward(dy)
    for n, p in m.named_parameters():
        np.testing.assert_allclose(p.grad, 2 * first[n], rtol=1e-13, err_msg=n)


def test_no_grad_keeps_no_state_but_counts():
    m = _family_block("deepseek_v3")
    with npattn.no_grad():
        y = m(_x((6, 5)))
    assert m.tokens_per_expert.sum() == 6 * 3
    assert y.shape == (6, 5)
    with pytest.raises(RuntimeError, match="no_grad"):
        m.backward(np.ones_like(y))


def test_an_expert_without_tokens_gets_zero_gradient():
    ex = Experts(4, 3, 2, rng=0)
    x = _x((5, 3))
    idx = np.array([[0, 2]] * 5)
    ex(x, idx, np.full((5, 2), 0.5))
    ex.backward(np.random.default_rng(0).standard_normal((5, 3)))
    assert np.all(ex.gate_up_proj.grad[[1, 3]] == 0) and np.all(ex.down_proj.grad[[1, 3]] == 0)
    assert np.abs(ex.gate_up_proj.grad[[0, 2]]).min() > 0


def test_gpt_oss_clamp_gradient_is_zero_outside_the_limits():
    """Gates far above the limit are clamped: no gradient reaches the gate columns; the up
    columns, inside the limits, get theirs."""
    ex = GptOssExperts(2, 3, 2, limit=0.5, rng=0)
    ex.gate_up_proj_bias.data = np.tile([5.0, 0.0], (2, 2))  # gates far above the limit
    x = _x((4, 3), scale=0.01)
    ex(x, np.array([[0], [1], [0], [1]]), np.ones((4, 1)))
    ex.backward(np.random.default_rng(0).standard_normal((4, 3)))
    assert np.all(ex.gate_up_proj.grad[..., ::2] == 0) and np.all(ex.gate_up_proj_bias.grad[..., ::2] == 0)
    assert np.abs(ex.gate_up_proj_bias.grad[..., 1::2]).max() > 0


def test_gated_mlp_matches_reference_and_fd():
    m = GatedMLP(4, 3, "gelu", rng=0)
    x = _x((2, 3, 4))
    p = m.state_dict()
    ref = (_act("gelu", x @ p["gate_proj.weight"].T) * (x @ p["up_proj.weight"].T)) @ p["down_proj.weight"].T
    np.testing.assert_allclose(m(x), ref, rtol=1e-12)
    report = gradcheck(GatedMLP(4, 3, "relu", bias=True, rng=1), _x((3, 4)))
    assert report.ok, str(report)


def test_public_names_and_alias():
    assert MoE is SparseMoeBlock
    for name in ("TopKRouter", "Experts", "GptOssExperts", "GatedMLP", "SparseMoeBlock", "MoE"):
        assert getattr(npattn.nn, name) is getattr(moe, name)
        assert getattr(npattn, name) is getattr(moe, name)
    assert "router_module" not in repr(_family_block("deepseek_v3"))
    assert "n_group=4" in repr(_family_block("deepseek_v3"))
    assert "limit=0.8" in repr(_family_block("gpt_oss")) and "hidden_act='silu'" in repr(_family_block("qwen3_next"))


def test_router_without_the_correction_bias_and_with_its_own_eps():
    """LFM2-MoE's router: no e_score_correction_bias where correction_bias is false (the top k of
    the sigmoid scores themselves), the renormalisation's eps shown and used."""
    plain = TopKRouter(4, 5, 2, variant="sigmoid", norm_topk_prob=True, norm_topk_eps=0.5, correction_bias=False, rng=0)
    assert "e_score_correction_bias" not in dict(plain.named_buffers())
    assert "norm_topk_eps=0.5" in repr(plain) and "correction_bias=False" in repr(plain)
    x = np.random.default_rng(1).standard_normal((3, 4))
    w, idx = plain(x)
    s = 1.0 / (1.0 + np.exp(-(x @ plain.weight.data.T)))
    assert np.array_equal(idx, np.argsort(-s, axis=-1, kind="stable")[:, :2])
    v = np.take_along_axis(s, idx, -1)
    np.testing.assert_allclose(w, v / (v.sum(-1, keepdims=True) + 0.5), rtol=1e-14)
    biased = TopKRouter(4, 5, 2, variant="sigmoid", rng=0)
    assert "e_score_correction_bias" in dict(biased.named_buffers()) and "correction_bias" not in repr(biased)
    # a softmax router has no correction bias whatever the flag says
    assert not dict(TopKRouter(4, 5, 2, correction_bias=True, rng=0).named_buffers())


# ----------------------------------------------------------------- Hugging Face names (no torch)


def test_state_dict_names_and_shapes_per_family():
    shapes = {
        "gpt_oss": {
            "router.weight": (4, 5),
            "router.bias": (4,),
            "experts.gate_up_proj": (4, 5, 6),
            "experts.gate_up_proj_bias": (4, 6),
            "experts.down_proj": (4, 3, 5),
            "experts.down_proj_bias": (4, 5),
        },
        "deepseek_v3": {
            "experts.gate_up_proj": (8, 6, 5),
            "experts.down_proj": (8, 5, 3),
            "gate.weight": (8, 5),
            "gate.e_score_correction_bias": (8,),
            "shared_experts.gate_proj.weight": (6, 5),
            "shared_experts.up_proj.weight": (6, 5),
            "shared_experts.down_proj.weight": (5, 6),
        },
        "qwen3_next": {
            "gate.weight": (6, 5),
            "experts.gate_up_proj": (6, 6, 5),
            "experts.down_proj": (6, 5, 3),
            "shared_expert.gate_proj.weight": (4, 5),
            "shared_expert.up_proj.weight": (4, 5),
            "shared_expert.down_proj.weight": (5, 4),
            "shared_expert_gate.weight": (1, 5),
        },
    }
    for family, expected in shapes.items():
        got = [(k, v.shape) for k, v in _family_block(family).state_dict().items()]
        assert got == list(expected.items()), family  # transformers' order too


def test_from_hf_config_reads_the_fields():
    m = _family_block("deepseek_v3")
    r = m.router_module
    assert (r.variant, r.n_group, r.topk_group, r.routed_scaling_factor, r.norm_topk_prob, r.top_k) == (
        "sigmoid", 4, 2, 2.5, True, 3,
    )  # fmt: skip
    g = _family_block("gpt_oss")
    assert (g.router_module.variant, g.experts.limit, g.experts.alpha) == ("topk_softmax", 0.8, 1.702)

    class Cfg:  # a config object with to_dict(), as transformers' PretrainedConfig
        def to_dict(self):
            return dict(FAMILIES["qwen3_next"], norm_topk_prob=False, hidden_act="gelu")

    q = SparseMoeBlock.from_hf_config(Cfg())
    assert q.router_module.norm_topk_prob is False and q.experts.hidden_act == "gelu"
    assert q.shared_gate_module is not None
    no_shared = SparseMoeBlock.from_hf_config(dict(FAMILIES["deepseek_v3"], n_shared_experts=0))
    assert no_shared.shared_module is None


# -------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, exc, name",
    [
        (dict(hidden_size=0), ValueError, "hidden_size"),
        (dict(num_experts=2.0), TypeError, "num_experts"),
        (dict(top_k=5), ValueError, "top_k"),
        (dict(top_k=0), ValueError, "top_k"),
        (dict(variant="softmax"), ValueError, "variant"),
        (dict(norm_topk_prob=1), TypeError, "norm_topk_prob"),
        (dict(variant="topk_softmax", norm_topk_prob=True), ValueError, "norm_topk_prob"),
        (dict(bias="yes"), TypeError, "bias"),
        (dict(routed_scaling_factor=0.0), ValueError, "routed_scaling_factor"),
        (dict(routed_scaling_factor="2"), TypeError, "routed_scaling_factor"),
        (dict(n_group=3), ValueError, "n_group"),
        (dict(n_group=4), ValueError, "n_group"),
        (dict(n_group=0), ValueError, "n_group"),
        (dict(n_group=2, topk_group=3), ValueError, "topk_group"),
        (dict(n_group=2, topk_group=0), ValueError, "topk_group"),
        (dict(n_group=2, topk_group=1, top_k=3), ValueError, "top_k"),
        (dict(dtype=np.int64), TypeError, "dtype"),
        (dict(rng="seed"), TypeError, "rng"),
        (dict(variant="sigmoid", correction_bias=1), TypeError, "correction_bias"),
        (dict(variant="sigmoid", norm_topk_eps=-1.0), ValueError, "norm_topk_eps"),
    ],
)
def test_router_refuses_bad_arguments(kwargs, exc, name):
    args = dict(hidden_size=3, num_experts=4, top_k=2)
    args.update(kwargs)
    with pytest.raises(exc, match=name):
        TopKRouter(args.pop("hidden_size"), args.pop("num_experts"), args.pop("top_k"), **args)


@pytest.mark.parametrize(
    "cls, kwargs, exc, name",
    [
        (Experts, dict(num_experts=0), ValueError, "num_experts"),
        (Experts, dict(hidden_size=True), TypeError, "hidden_size"),
        (Experts, dict(intermediate_size=-1), ValueError, "intermediate_size"),
        (Experts, dict(hidden_act="tanh"), ValueError, "hidden_act"),
        (Experts, dict(hidden_act=None), ValueError, "hidden_act"),
        (Experts, dict(dtype=np.float16), TypeError, "dtype"),
        (GptOssExperts, dict(alpha=float("nan")), ValueError, "alpha"),
        (GptOssExperts, dict(alpha=float("-inf")), ValueError, "alpha"),
        (GptOssExperts, dict(alpha="1.7"), TypeError, "alpha"),
        (GptOssExperts, dict(limit=0.0), ValueError, "limit"),
        (GptOssExperts, dict(limit=float("inf")), ValueError, "limit"),
    ],
)
def test_experts_refuse_bad_arguments(cls, kwargs, exc, name):
    args = dict(num_experts=3, hidden_size=4, intermediate_size=2)
    args.update(kwargs)
    with pytest.raises(exc, match=name):
        cls(args.pop("num_experts"), args.pop("hidden_size"), args.pop("intermediate_size"), **args)


@pytest.mark.parametrize(
    "kwargs, exc, name",
    [
        (dict(experts="dense"), ValueError, "experts"),
        (dict(router="sparse"), ValueError, "variant"),
        (dict(router_name="route"), ValueError, "router_name"),
        (dict(experts_first="yes"), TypeError, "experts_first"),
        (dict(shared_name="shared"), ValueError, "shared_name"),
        (dict(shared_expert_gate=True), ValueError, "shared_expert_gate"),
        (dict(shared_expert_gate=1, shared_intermediate_size=2), TypeError, "shared_expert_gate"),
        (dict(shared_intermediate_size=0), ValueError, "shared_intermediate_size"),
        (dict(shared_intermediate_size=2.5), TypeError, "shared_intermediate_size"),
        (dict(hidden_act="swiglu"), ValueError, "hidden_act"),
        (dict(experts="gpt_oss", swiglu_limit=-1.0), ValueError, "limit"),
        (dict(intermediate_size=0), ValueError, "intermediate_size"),
    ],
)
def test_block_refuses_bad_arguments(kwargs, exc, name):
    args = dict(hidden_size=3, num_experts=4, top_k=2, intermediate_size=2)
    args.update(kwargs)
    pos = [args.pop(k) for k in ("hidden_size", "num_experts", "top_k", "intermediate_size")]
    with pytest.raises(exc, match=name):
        SparseMoeBlock(*pos, **args)


def test_gated_mlp_refuses_bad_arguments():
    with pytest.raises(ValueError, match="intermediate_size"):
        GatedMLP(3, 0)
    with pytest.raises(ValueError, match="hidden_act"):
        GatedMLP(3, 2, "mish")
    with pytest.raises(TypeError, match="bias"):
        GatedMLP(3, 2, bias=None)
    with pytest.raises(ValueError, match=r"x: expected shape \(\.\.\., 3\)"):
        GatedMLP(3, 2)(np.ones((2, 4)))


def test_forward_and_backward_refuse_bad_inputs():
    m = _family_block("qwen3_next")
    with pytest.raises(ValueError, match=r"x: expected shape \(\.\.\., 5\)"):
        m(np.ones((2, 4)))
    with pytest.raises(TypeError, match="x"):
        m(np.ones((2, 5), bool))
    with pytest.raises(TypeError, match="x"):
        m(np.ones((2, 5), np.float16))
    y = m(np.ones((2, 5)))
    with pytest.raises(ValueError, match="dy: expected shape"):
        m.backward(np.ones((2, 4)))
    m.backward(np.ones_like(y))  # the refused dy lost nothing
    r = m.router_module
    with pytest.raises(ValueError, match=r"x: expected shape \(\.\.\., 5\)"):
        r(np.ones(4))
    w, _ = r(np.ones((3, 5)))
    with pytest.raises(ValueError, match="dweights: expected shape"):
        r.backward(np.ones((3, 3)))
    with pytest.raises(TypeError, match="dweights"):
        r.backward(np.ones_like(w, dtype=complex))
    assert r.backward(np.ones_like(w)).shape == (3, 5)


def test_experts_forward_refuses_bad_routing():
    ex = Experts(4, 3, 2, rng=0)
    x = np.ones((5, 3))
    idx = np.zeros((5, 2), int)
    w = np.ones((5, 2))
    with pytest.raises(ValueError, match=r"x: expected shape \(\.\.\., 3\)"):
        ex(np.ones((5, 2)), idx, w)
    with pytest.raises(TypeError, match="top_k_index"):
        ex(x, idx.astype(float), w)
    with pytest.raises(ValueError, match="top_k_index: expected shape"):
        ex(x, np.zeros((4, 2), int), w)
    with pytest.raises(ValueError, match="top_k_index: expected shape"):
        ex(x, np.zeros((5, 0), int), np.ones((5, 0)))
    with pytest.raises(ValueError, match=r"top_k_index: expected values in \[0, 4\), got 4"):
        ex(x, idx + 4, w)
    with pytest.raises(ValueError, match=r"top_k_index: expected values in \[0, 4\), got -1"):
        ex(x, idx - 1, w)
    with pytest.raises(ValueError, match="top_k_weights: expected shape"):
        ex(x, idx, np.ones((5, 3)))
    with pytest.raises(TypeError, match="top_k_weights"):
        ex(x, idx, np.ones((5, 2), bool))
    ex(x, idx, w)
    with pytest.raises(ValueError, match="dy: expected shape"):
        ex.backward(np.ones((5, 2)))


@pytest.mark.parametrize(
    "config, exc, match",
    [
        ("gpt_oss", TypeError, "config"),
        (dict(model_type="llama", hidden_size=4), ValueError, "model_type"),
        (dict(hidden_size=4), ValueError, "model_type"),
        ({k: v for k, v in FAMILIES["gpt_oss"].items() if k != "num_local_experts"}, ValueError, "num_local_experts"),
        ({k: v for k, v in FAMILIES["qwen3_next"].items() if k != "hidden_size"}, ValueError, "hidden_size"),
        (
            {k: v for k, v in FAMILIES["deepseek_v3"].items() if k != "moe_intermediate_size"},
            ValueError,
            "moe_intermediate_size",
        ),
        (dict(FAMILIES["deepseek_v3"], n_shared_experts=1.5), TypeError, "n_shared_experts"),
        (dict(FAMILIES["deepseek_v3"], n_group=3), ValueError, "n_group"),
        (
            dict(
                model_type="mixtral",
                hidden_size=4,
                num_local_experts=4,
                num_experts_per_tok=2,
                intermediate_size=3,
                router_jitter_noise=0.1,
            ),
            ValueError,
            "router_jitter_noise",
        ),
        (
            dict(model_type="qwen3_moe", hidden_size=4, num_experts_per_tok=2, moe_intermediate_size=3),
            ValueError,
            "num_experts",
        ),
        (dict(FAMILIES["qwen3_next"], hidden_act="quick_gelu"), ValueError, "hidden_act"),
        (
            dict(FAMILIES["qwen3_next"], shared_expert_intermediate_size=None),
            ValueError,
            "shared_expert_intermediate_size",
        ),
    ],
)
def test_from_hf_config_refuses_bad_configs(config, exc, match):
    with pytest.raises(exc, match=match):
        SparseMoeBlock.from_hf_config(config)


def test_sigmoid_renormalisation_keeps_deepseeks_epsilon():
    """Scores that underflow (logits near -50): ``w = s / (sum s + 1e-20)`` stays far below 1."""
    r = TopKRouter(2, 4, 2, variant="sigmoid", norm_topk_prob=True, rng=0)
    r.weight.data = np.full((4, 2), -25.0) + np.arange(4)[:, None] * 0.1
    x = np.ones((1, 2))
    w, _ = r(x)
    ref, _ = ref_route(r, x, dict(r.state_dict()))
    np.testing.assert_allclose(np.sort(w[0]), np.sort(ref[0][ref[0] > 0]), rtol=1e-12)
    assert w.sum() < 0.5


def test_npattn_check_covers_the_moe_blocks():
    from npattn.tools.check import cases

    found = {name: thunk for name, thunk in cases(0) if name.startswith("SparseMoeBlock")}
    assert len(found) == 3
    for name, thunk in found.items():
        assert thunk().ok, name


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_no_tokens(family):
    m = _family_block(family)
    y = m(np.zeros((2, 0, 5)))
    dx = m.backward(np.zeros((2, 0, 5)))
    assert y.shape == dx.shape == (2, 0, 5)
    assert not m.tokens_per_expert.any()
    assert m.router_module.last_indices.shape == (2, 0, m.router_module.top_k)
    assert all(not p.grad.any() for p in m.parameters())


# --------------------------------------------------------------------------------- forward mode


def _directional(m, x, tx, tparams, eps=1e-6):
    """Central difference of the block's output along (tx, tparams)."""
    params = dict(m.named_parameters())

    def at(sign):
        shifted = {n: params[n].data + sign * eps * t for n, t in tparams.items()}
        return ref_block(m, x + sign * eps * tx, shifted)[0]

    return (at(1) - at(-1)) / (2 * eps)


@settings(max_examples=40)
@given(moe_configs(), st.integers(0, 2**16))
def test_jvp_against_central_differences_and_backward(case, seed):
    """``m.jvp`` along a random input and parameter direction: equal to the central difference of
    the dense reference, and ``<dy, J t> = <J^T dy, t>`` with the backward."""
    m, _, margin = _block_and_margin(case)
    assume(margin > 1e-4)
    rng = np.random.default_rng(seed)
    x = case.x
    tx = rng.standard_normal(x.shape)
    tparams = {n: rng.standard_normal(p.shape) for n, p in m.named_parameters()}
    y = m(x)
    ty = m.jvp(tx, param_tangents=tparams)
    assert ty.shape == y.shape
    assert rel_err(ty, _directional(m, x, tx, tparams)) < 1e-6
    dx = m.backward(case.dy)  # the jvp kept the state
    lhs = np.sum(case.dy * ty)
    rhs = np.sum(dx * tx) + sum(np.sum(p.grad * tparams[n]) for n, p in m.named_parameters())
    assert abs(lhs - rhs) <= 1e-10 * max(1.0, abs(lhs))


def test_jvp_of_router_and_experts_alone():
    m = _family_block("deepseek_v3")
    r, ex = m.router_module, m.experts
    rng = np.random.default_rng(0)
    x = _x((2, 3, 5))
    w, idx = r(x)
    tx, tW = rng.standard_normal(x.shape), rng.standard_normal(r.weight.shape)
    tw = r.jvp(tx, param_tangents={"weight": tW})
    eps = 1e-6

    def route(s):
        p = {"weight": r.weight.data + s * eps * tW, "e_score_correction_bias": r.e_score_correction_bias}
        dense, _ = ref_route(r, (x + s * eps * tx).reshape(-1, 5), p)
        return np.take_along_axis(dense, idx.reshape(-1, 3), -1).reshape(w.shape)

    assert rel_err(tw, (route(1) - route(-1)) / (2 * eps)) < 1e-6
    ex(x, idx, w)
    tgu = rng.standard_normal(ex.gate_up_proj.shape)
    ty = ex.jvp(tx, None, tw, param_tangents={"gate_up_proj": tgu})

    def experts(s):
        p = {"gate_up_proj": ex.gate_up_proj.data + s * eps * tgu, "down_proj": ex.down_proj.data}
        outs, _ = ref_experts(ex, (x + s * eps * tx).reshape(-1, 5), p)
        chosen = np.take_along_axis(outs, idx.reshape(-1, 3)[..., None], 1)
        return np.einsum("nk,nkh->nh", (w + s * eps * tw).reshape(-1, 3), chosen).reshape(x.shape)

    assert rel_err(ty, (experts(1) - experts(-1)) / (2 * eps)) < 1e-6
    with pytest.raises(TypeError, match="top_k_index"):
        ex.jvp(tx, np.ones(idx.shape), tw)
    with pytest.raises(TypeError, match="at most 3"):
        ex.jvp(tx, None, tw, tw)
    with pytest.raises(ValueError, match="ttop_k_weights"):
        ex.jvp(tx, None, tw[..., :2])
    with pytest.raises(ValueError, match="tx"):
        r.jvp(tx[..., :4])
    with pytest.raises(ValueError, match="tx"):
        m(x)
        m.jvp(tx[0])
    g = GatedMLP(5, 3, rng=0)
    g(x)
    with pytest.raises(ValueError, match="tx"):
        g.jvp(tx[0])
    assert np.all(m.jvp(None) == 0) and np.all(g.jvp() == 0)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_gradcheck_both_modes(family):
    report = gradcheck(_family_block(family), _x((3, 5), seed=6), mode="both")
    assert report.ok, str(report)


@pytest.mark.parametrize(
    "make",
    [
        lambda: TopKRouter(4, 6, 2, variant="softmax_topk", norm_topk_prob=True, rng=0),
        lambda: TopKRouter(4, 6, 3, variant="topk_softmax", bias=True, rng=1),
        lambda: TopKRouter(4, 6, 2, variant="sigmoid", norm_topk_prob=True, n_group=3, topk_group=2, rng=2),
        lambda: GatedMLP(4, 3, "gelu_pytorch_tanh", rng=3),
    ],
    ids=["router-softmax_topk", "router-topk_softmax", "router-sigmoid-groups", "gated_mlp"],
)
def test_submodules_gradcheck_both_modes(make):
    report = gradcheck(make(), _x((2, 3, 4), seed=7), mode="both")
    assert report.ok, str(report)


@pytest.mark.parametrize("cls", [Experts, GptOssExperts])
def test_experts_gradcheck_both_modes_with_given_routing(cls):
    """The experts alone as a module of ``(x, top_k_index, top_k_weights)``: the weights' gradient
    and tangent too (the indices are integers: none)."""
    rng = np.random.default_rng(8)
    idx = rng.integers(0, 5, (2, 3, 2))
    report = gradcheck(cls(5, 4, 3, rng=0), _x((2, 3, 4), seed=9), idx, rng.uniform(0, 1, idx.shape), mode="both")
    assert report.ok, str(report)


def test_gated_mlp_multipliers_match_reference_gradcheck_and_no_grad():
    """``gate_multiplier`` scales ``gate_proj(x)`` before the activation and ``down_multiplier`` the
    output (Falcon-H1's ``mlp_multipliers``): the formula, ``gradcheck`` (backward and JVP along
    the input and every parameter), and the fused path without grad equal to the kept one."""
    m = GatedMLP(4, 3, "silu", bias=True, gate_multiplier=0.55, down_multiplier=1.7, rng=0)
    x = _x((2, 3, 4))
    p = m.state_dict()
    a = 0.55 * (x @ p["gate_proj.weight"].T + p["gate_proj.bias"])
    h = _act("silu", a) * (x @ p["up_proj.weight"].T + p["up_proj.bias"])
    ref = 1.7 * (h @ p["down_proj.weight"].T + p["down_proj.bias"])
    kept = m(x)
    np.testing.assert_allclose(kept, ref, rtol=1e-12)
    m.clear_saved()
    with npattn.no_grad():
        np.testing.assert_allclose(m(x), kept, rtol=1e-14)
    report = gradcheck(m, x, mode="both")
    assert report.ok, str(report)
    assert "gate_multiplier=0.55" in repr(m)
    for kw in (dict(gate_multiplier=0.0), dict(down_multiplier=math.inf)):
        with pytest.raises(ValueError, match=next(iter(kw))):
            GatedMLP(3, 2, **kw)

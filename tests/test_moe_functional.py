"""The mixture-of-experts pairs ``topk_router`` and ``moe_experts``: the fast tier (sorted dispatch,
``npattn.functional``) equals the textbook tier (per-token loops, ``npattn.functional.reference``)
to 1e-12, both match finite differences away from ties and clamp edges (``gradcheck``, both
modes) and torch autograd of the explicit formula, and bad input is refused naming the argument."""

import math

import numpy as np
import pytest
from _fd import fd_gradients
from _oracles import rel_err
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import npattn.functional as F
from npattn.functional import reference as R
from npattn.nn.moe import HIDDEN_ACTS, GptOssExperts, PlainExperts
from npattn.testing import gradcheck, moe_configs

TOL = 1e-12
MARGIN = 1e-4  # finite differences (steps ~1e-5) must not move a choice or cross a clamp


def _same(got, want, what=""):
    if want is None or got is None:
        assert got is None and want is None, what
        return
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype)
    if want.size:
        scale = max(1.0, float(np.abs(want).max()))
        assert float(np.abs(got - want).max()) <= TOL * scale, (what, float(np.abs(got - want).max()))


# -- the calls, from npattn.testing's MoE strategy ----------------------------------------------------


def _router_call(case):
    """``(logits, top_k, kwargs)`` of the router of a ``MoeCase``'s block."""
    r = case.block().router_module
    logits = case.x @ r.weight.data.T + (0.0 if r.bias is None else r.bias.data)
    kw = dict(
        variant=r.variant,
        norm_topk_prob=r.norm_topk_prob,
        n_group=r.n_group,
        topk_group=r.topk_group,
        routed_scaling_factor=r.routed_scaling_factor,
    )
    if r.variant == "sigmoid":
        kw["correction_bias"] = r.e_score_correction_bias.copy()
    return logits, r.top_k, kw


def _experts_call(case, bias_seed=None):
    """``(args, kwargs)`` of ``moe_experts`` for a ``MoeCase``: its block's experts, random routing
    (repeats allowed, some experts idle); ``bias_seed`` adds biases to SwiGLU and plain experts.
    Experts in a latent width take the tokens through the block's ``fc1_latent_proj``."""
    block = case.block()
    ex = block.experts
    rng = np.random.default_rng(case.seed + 2)
    x = case.x if block.latent_size is None else case.x @ block.fc1_latent_proj.weight.data.T
    lead = x.shape[:-1]
    idx = rng.integers(0, case.num_experts, lead + (case.top_k,))
    w = rng.uniform(0.1, 1.0, idx.shape)
    if isinstance(ex, GptOssExperts):
        params = [ex.gate_up_proj.data, ex.down_proj.data, ex.gate_up_proj_bias.data, ex.down_proj_bias.data]
        kw = dict(kind="gpt_oss", alpha=ex.alpha, limit=ex.limit)
    elif isinstance(ex, PlainExperts):
        params = [ex.up_proj.data, ex.down_proj.data]
        if bias_seed is not None:
            b = np.random.default_rng(bias_seed)
            params += [
                b.standard_normal((case.num_experts, ex.intermediate_size)),
                b.standard_normal((case.num_experts, x.shape[-1])),
            ]
        kw = dict(kind="plain", activation=HIDDEN_ACTS[ex.hidden_act])
    else:
        params = [ex.gate_up_proj.data, ex.down_proj.data]
        if bias_seed is not None:
            b = np.random.default_rng(bias_seed)
            params += [
                b.standard_normal((case.num_experts, 2 * ex.intermediate_size)),
                b.standard_normal((case.num_experts, case.hidden_size)),
            ]
        kw = dict(kind="swiglu", activation=HIDDEN_ACTS[ex.hidden_act])
    return [x, idx, w] + [p.copy() for p in params], kw


def _experts_dy(case, args):
    """The case's upstream gradient, or one of the experts' latent width (``latent_size``)."""
    return (
        case.dy
        if case.dy.shape == args[0].shape
        else np.random.default_rng(case.seed + 6).standard_normal(args[0].shape)
    )


def _router_margin(logits, top_k, kw):
    """The smallest gap between the last chosen and the first refused choice score (and group
    score): moves smaller than it never change the choice."""
    z = logits.reshape(-1, logits.shape[-1])
    variant = kw["variant"]
    if variant == "softmax_topk":
        scores = np.exp(z - z.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
    elif variant == "topk_softmax":
        scores = z
    else:
        scores = 1.0 / (1.0 + np.exp(-z)) + kw.get("correction_bias", 0.0)
    margin = np.inf
    g, tg = kw.get("n_group", 1), kw.get("topk_group", 1)
    for row in scores:
        allowed = row
        if g > 1:
            grouped = row.reshape(g, -1)
            gs = np.sort(np.sort(grouped, -1)[:, -2:].sum(-1))[::-1]
            if tg < g:
                margin = min(margin, gs[tg - 1] - gs[tg])
            keep = np.argsort(-np.sort(grouped, -1)[:, -2:].sum(-1), kind="stable")[:tg]
            allowed = grouped[keep].reshape(-1)
        srt = np.sort(allowed)[::-1]
        if top_k < srt.size:
            margin = min(margin, srt[top_k - 1] - srt[top_k])
    return margin


def _clamp_margin(args, kw):
    """How far GPT-OSS's gate and up pre-activations stay from the clamps' edges, and relu2's from
    its second derivative's jump at 0 (inf for the others)."""
    if kw["kind"] == "plain" and kw["activation"] == "relu2":
        return float(np.abs(F.moe_experts(*args, **kw)[1].gu).min(initial=np.inf))
    if kw["kind"] != "gpt_oss":
        return np.inf
    _, cache = F.moe_experts(*args, **kw)
    gate, up = cache.gu[:, ::2], cache.gu[:, 1::2]
    lim = kw["limit"]
    return float(min(np.abs(gate - lim).min(initial=np.inf), np.abs(np.abs(up) - lim).min(initial=np.inf)))


# -- both tiers equal --------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(moe_configs(max_tokens=4))
def test_router_tiers_equal(case):
    logits, k, kw = _router_call(case)
    (w_f, i_f), c_f = F.topk_router(logits, k, **kw)
    (w_r, i_r), c_r = R.topk_router(logits, k, **kw)
    assert np.array_equal(i_f, i_r) and i_f.dtype == i_r.dtype == np.int64
    assert i_f.shape == logits.shape[:-1] + (k,)
    _same(w_f, w_r, "weights")
    rng = np.random.default_rng(case.seed + 3)
    dw = rng.standard_normal(w_f.shape)
    _same(F.topk_router_backward(dw, c_f), R.topk_router_backward(dw, c_r), "dlogits")
    tz = rng.standard_normal(logits.shape)
    _same(F.topk_router_jvp(c_f, tz), R.topk_router_jvp(c_r, tz), "tweights")
    _same(F.topk_router_jvp(c_f), R.topk_router_jvp(c_r), "zero tangent")


@settings(max_examples=60, deadline=None)
@given(moe_configs(max_tokens=4), st.booleans())
def test_experts_tiers_equal(case, biases):
    args, kw = _experts_call(case, case.seed + 5 if biases else None)
    y_f, c_f = F.moe_experts(*args, **kw)
    y_r, c_r = R.moe_experts(*args, **kw)
    _same(y_f, y_r, "y")
    dy = _experts_dy(case, args)
    g_f, g_r = F.moe_experts_backward(dy, c_f), R.moe_experts_backward(dy, c_r)
    assert len(g_f) == len(g_r) == 6
    for i, (a, b) in enumerate(zip(g_f, g_r)):
        _same(a, b, f"gradient {i}")
    rng = np.random.default_rng(case.seed + 4)
    floats = [args[0], args[2]] + args[3:]
    tangents = [rng.standard_normal(a.shape) for a in floats] + [None] * (6 - len(floats))
    _same(F.moe_experts_jvp(c_f, *tangents), R.moe_experts_jvp(c_r, *tangents), "ty")
    for j in range(6):  # one tangent at a time: each term on its own
        one = [t if i == j else None for i, t in enumerate(tangents)]
        _same(F.moe_experts_jvp(c_f, *one), R.moe_experts_jvp(c_r, *one), f"ty along tangent {j}")


def test_the_module_is_the_pair():
    """``SparseMoeBlock``'s routed part computes exactly the pairs (no second copy of the math)."""
    from npattn.nn.moe import SparseMoeBlock

    m = SparseMoeBlock(4, 6, 2, 3, router="sigmoid", norm_topk_prob=True, n_group=3, topk_group=2, rng=0)
    m.router_module.e_score_correction_bias[...] = np.random.default_rng(1).uniform(-0.3, 0.3, 6)
    x = np.random.default_rng(2).standard_normal((2, 3, 4))
    w, idx = m.router_module(x)
    logits = x @ m.router_module.weight.data.T
    (w2, idx2), _ = F.topk_router(
        logits, 2, variant="sigmoid", norm_topk_prob=True, n_group=3, topk_group=2,
        correction_bias=m.router_module.e_score_correction_bias,
    )  # fmt: skip
    assert np.array_equal(idx, idx2) and np.array_equal(w, w2)
    ex = m.experts
    y = ex(x, idx, w)
    y2, _ = F.moe_experts(x, idx, w, ex.gate_up_proj.data, ex.down_proj.data)
    assert np.array_equal(y, y2)


# -- finite differences, away from ties ----------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(moe_configs(max_tokens=3, max_experts=6, max_hidden=3))
def test_router_gradcheck_both_modes(case):
    logits, k, kw = _router_call(case)
    assume(_router_margin(logits, k, kw) > MARGIN)
    for tier in (F, R):

        def fwd(z, tier=tier):
            (w, _), cache = tier.topk_router(z, k, **kw)
            return w, cache

        target = (fwd, tier.topk_router_backward, tier.topk_router_jvp)
        report = gradcheck(target, logits, mode="both", seed=case.seed % 1000)
        assert report.ok, str(report)


@settings(max_examples=20, deadline=None)
@given(moe_configs(max_tokens=3, max_experts=5, max_hidden=3), st.booleans())
def test_experts_gradcheck_both_modes(case, biases):
    args, kw = _experts_call(case, case.seed + 5 if biases else None)
    assume(_clamp_margin(args, kw) > MARGIN)
    report = gradcheck(F.moe_experts, *args, mode="both", seed=case.seed % 1000, **kw)
    assert report.ok, str(report)
    report = gradcheck(
        (R.moe_experts, R.moe_experts_backward, R.moe_experts_jvp), *args, mode="both", seed=1, fast=True, **kw
    )
    assert report.ok, str(report)


@pytest.mark.parametrize(
    "kw",
    [
        dict(variant="sigmoid", norm_topk_prob=True, norm_topk_eps=0.5, routed_scaling_factor=1.5),
        dict(variant="sigmoid", norm_topk_prob=True, norm_topk_eps=1e-6),
        dict(variant="softmax_topk", norm_topk_prob=True, norm_topk_eps=0.25),
        dict(variant="sigmoid", norm_topk_prob=True, norm_topk_eps=0.0),
    ],
)
def test_router_renormalisation_eps(kw):
    """``norm_topk_eps`` (LFM2-MoE's ``w / (sum w + 1e-6)``): the weights are the chosen scores
    over their sum plus ``eps`` (a large ``eps`` makes it plain), both tiers equal, and the
    backward, JVP (finite differences, both modes) and second order follow it."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((2, 3, 6)) * 2.0
    bias = rng.uniform(-0.3, 0.3, 6) if kw["variant"] == "sigmoid" else None
    kw = dict(kw, correction_bias=bias)
    assert _router_margin(logits, 3, kw) > MARGIN
    (w, idx), cache = F.topk_router(logits, 3, **kw)
    scores = 1.0 / (1.0 + np.exp(-logits)) if kw["variant"] == "sigmoid" else np.exp(logits)
    if kw["variant"] != "sigmoid":
        scores = scores / scores.sum(-1, keepdims=True)
    v = np.take_along_axis(scores, idx, -1)
    want = v / (v.sum(-1, keepdims=True) + kw["norm_topk_eps"]) * kw.get("routed_scaling_factor", 1.0)
    assert rel_err(w, want, floor=1e-300) < 1e-14
    (w_r, idx_r), cache_r = R.topk_router(logits, 3, **kw)
    assert np.array_equal(idx, idx_r)
    _same(w, w_r, "weights")
    for tier in (F, R):

        def fwd(z, tier=tier):
            (out, _), c = tier.topk_router(z, 3, **kw)
            return out, c

        report = gradcheck((fwd, tier.topk_router_backward, tier.topk_router_jvp), logits, mode="both", seed=3)
        assert report.ok, str(report)
    # second order: the backward's tangent along tlogits against the difference of two backwards
    dw, tz, eps = rng.standard_normal(w.shape), rng.standard_normal(logits.shape), 1e-6
    dz, tdz = F.topk_router_backward_jvp(dw, cache, (tz,))

    def back(z):
        return F.topk_router_backward(dw, F.topk_router(z, 3, **kw)[1])

    numeric = (back(logits + eps * tz) - back(logits - eps * tz)) / (2 * eps)
    assert rel_err(tdz, numeric, floor=1e-300, relative_to="max_b") < 1e-7
    _same(dz, F.topk_router_backward(dw, cache), "dlogits")


def test_router_and_experts_independent_finite_differences():
    """The composite ``sum(dy * moe_experts(x, *topk_router(x W^T)))`` against tests/_fd.py's own
    central differences, for each router variant (away from ties: the margin is checked)."""
    rng = np.random.default_rng(7)
    n, h, e, k, i = 5, 4, 6, 2, 3
    x = rng.standard_normal((n, h))
    wr = rng.standard_normal((e, h))
    gu, dn = rng.standard_normal((e, 2 * i, h)) / 2, rng.standard_normal((e, h, i)) / 2
    dy = rng.standard_normal((n, h))
    for kw in (
        dict(variant="softmax_topk", norm_topk_prob=True),
        dict(variant="topk_softmax"),
        dict(variant="sigmoid", norm_topk_prob=True, correction_bias=rng.uniform(-0.3, 0.3, e), n_group=3, topk_group=2,
             routed_scaling_factor=2.5),
    ):  # fmt: skip
        assert _router_margin(x @ wr.T, k, kw) > 1e-3

        def loss(x, wr, gu, dn, kw=kw):
            (w, idx), _ = F.topk_router(x @ wr.T, k, **kw)
            return np.sum(dy * F.moe_experts(x, idx, w, gu, dn)[0])

        (w, idx), rc = F.topk_router(x @ wr.T, k, **kw)
        _, ec = F.moe_experts(x, idx, w, gu, dn)
        dx, dw, dgu, ddn, _, _ = F.moe_experts_backward(dy, ec)
        dz = F.topk_router_backward(dw, rc)
        dx = dx + dz @ wr
        dwr = dz.T @ x
        num = fd_gradients(loss, [x, wr, gu, dn])
        for got, want in zip((dx, dwr, dgu, ddn), num):
            assert rel_err(got, want) < 1e-6


def test_choice_carries_no_gradient_and_ties_are_where_it_jumps():
    """Moving the logits within a margin keeps the choice (the derivative of the choice is 0);
    crossing a tie swaps it (a jump: no derivative there)."""
    z = np.array([[0.3, 1.0, -0.5, 0.9]])
    (_, idx), cache = F.topk_router(z, 2, variant="topk_softmax")
    assert idx.tolist() == [[1, 3]]
    (_, idx2), _ = F.topk_router(z + np.array([[0.0, 0.0, 0.0, 1e-3]]), 2, variant="topk_softmax")
    assert idx2.tolist() == [[1, 3]]
    dz = F.topk_router_backward(np.array([[0.7, -0.2]]), cache)
    assert dz[0, 0] == 0.0 and dz[0, 2] == 0.0  # the refused experts get nothing
    (_, idx3), _ = F.topk_router(z + np.array([[0.0, 0.0, 0.0, 0.2]]), 2, variant="topk_softmax")
    assert idx3.tolist() == [[3, 1]]
    (_, idx4), _ = F.topk_router(z + np.array([[0.7, 0.0, 0.0, 0.0]]), 2, variant="topk_softmax")
    assert idx4.tolist() == [[0, 1]]


# -- torch autograd of the explicit formula ------------------------------------------------------------


def _torch_router(torch, z, k, variant, norm_topk_prob=False, correction_bias=None, n_group=1, topk_group=1,
                  routed_scaling_factor=1.0):  # fmt: skip
    """The formula as transformers writes it (DeepSeek-V3's group mask, GPT-OSS's top-k softmax)."""
    if variant == "softmax_topk":
        src = torch.softmax(z, -1)
        choice = src
    elif variant == "topk_softmax":
        src = choice = z
    else:
        src = torch.sigmoid(z)
        choice = src + torch.as_tensor(correction_bias)
    choice = choice.detach()
    if n_group > 1:
        n, e = choice.shape
        gs = choice.view(n, n_group, -1).topk(2, dim=-1)[0].sum(-1)
        gidx = torch.topk(gs, k=topk_group, dim=-1, sorted=False)[1]
        gmask = torch.zeros_like(gs).scatter_(1, gidx, 1)
        smask = gmask.unsqueeze(-1).expand(n, n_group, e // n_group).reshape(n, -1)
        choice = choice.masked_fill(~smask.bool(), float("-inf"))
    idx = torch.topk(choice, k, dim=-1, sorted=True)[1]
    v = src.gather(1, idx)
    if variant == "topk_softmax":
        w = torch.softmax(v, -1)
    elif norm_topk_prob:
        w = v / (v.sum(-1, keepdim=True) + (1e-20 if variant == "sigmoid" else 0.0))
    else:
        w = v
    return w * routed_scaling_factor, idx


@pytest.mark.parametrize(
    "kw",
    [
        dict(variant="softmax_topk"),
        dict(variant="softmax_topk", norm_topk_prob=True, routed_scaling_factor=1.5),
        dict(variant="topk_softmax"),
        dict(variant="sigmoid", norm_topk_prob=True, n_group=4, topk_group=2, routed_scaling_factor=2.5),
        dict(variant="sigmoid", norm_topk_prob=False),
    ],
    ids=["softmax_topk", "softmax_topk-norm", "topk_softmax", "sigmoid-groups", "sigmoid"],
)
def test_router_matches_torch_autograd(torch_or_skip, kw):
    torch = torch_or_skip
    rng = np.random.default_rng(11)
    z = rng.standard_normal((2, 3, 8))
    kw = dict(kw)
    if kw["variant"] == "sigmoid":
        kw["correction_bias"] = rng.uniform(-0.3, 0.3, 8)
    k = 3
    (w, idx), cache = F.topk_router(z, k, **kw)
    zt = torch.tensor(z.reshape(-1, 8), requires_grad=True)
    wt, it = _torch_router(torch, zt, k, **kw)
    assert np.array_equal(idx.reshape(-1, k), it.numpy())
    assert rel_err(w.reshape(-1, k), wt.detach().numpy()) < 1e-12
    dw = rng.standard_normal(w.shape)
    wt.backward(torch.tensor(dw.reshape(-1, k)))
    assert rel_err(F.topk_router_backward(dw, cache).reshape(-1, 8), zt.grad.numpy()) < 1e-10
    (_, _), rcache = R.topk_router(z, k, **kw)
    assert rel_err(R.topk_router_backward(dw, rcache).reshape(-1, 8), zt.grad.numpy()) < 1e-10


def _torch_experts(torch, x, idx, w, gate_up, down, gub, db, kind, activation, alpha, limit):
    """Each expert on the tokens that chose it, written as transformers' experts loop."""
    act = {
        "silu": torch.nn.functional.silu,
        "gelu": torch.nn.functional.gelu,
        "gelu_tanh": lambda a: torch.nn.functional.gelu(a, approximate="tanh"),
        "relu": torch.relu,
        "relu2": lambda a: torch.relu(a) ** 2,
    }[activation]
    y = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        tok, slot = torch.nonzero(idx == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        xe = x[tok]
        if kind == "plain":  # transformers' NemotronHExperts: down(act(up x)), no gate
            out = act(xe @ gate_up[e].T + (0 if gub is None else gub[e])) @ down[e].T + (0 if db is None else db[e])
        elif kind == "swiglu":
            gu = xe @ gate_up[e].T + (0 if gub is None else gub[e])
            gate, up = gu.chunk(2, dim=-1)
            out = (act(gate) * up) @ down[e].T + (0 if db is None else db[e])
        else:
            gu = xe @ gate_up[e] + gub[e]
            gate, up = gu[..., ::2], gu[..., 1::2]
            gate = gate.clamp(max=limit)
            up = up.clamp(min=-limit, max=limit)
            out = ((up + 1) * gate * torch.sigmoid(gate * alpha)) @ down[e] + db[e]
        y = y.index_add(0, tok, out * w[tok, slot, None])
    return y


@pytest.mark.parametrize(
    "kind, activation, biases",
    [("swiglu", "silu", False), ("swiglu", "gelu", True), ("swiglu", "gelu_tanh", False), ("swiglu", "relu", False),
     ("gpt_oss", "silu", True), ("plain", "relu2", False), ("plain", "relu2", True)],
)  # fmt: skip
def test_experts_match_torch_autograd(torch_or_skip, kind, activation, biases):
    torch = torch_or_skip
    rng = np.random.default_rng(13)
    n, h, e, i, k = 7, 4, 5, 3, 3
    x = rng.standard_normal((n, h))
    idx = rng.integers(0, e, (n, k))
    idx[0] = [2, 2, 4]  # a repeated expert
    idx[idx == 3] = 1  # an idle expert
    w = rng.uniform(0.1, 1, (n, k))
    units = i if kind == "plain" else 2 * i
    gate_up = rng.standard_normal((e, units, h) if kind != "gpt_oss" else (e, h, units))
    down = rng.standard_normal((e, h, i) if kind != "gpt_oss" else (e, i, h))
    gub, db = (rng.standard_normal((e, units)), rng.standard_normal((e, h))) if biases else (None, None)
    opts = dict(kind=kind, activation=activation, alpha=1.702, limit=1.5)
    arrays = [x, w, gate_up, down] + ([gub, db] if biases else [])
    ts = [torch.tensor(a, requires_grad=True) for a in arrays]
    tb = ts[4:] if biases else [None, None]
    yt = _torch_experts(torch, ts[0], torch.tensor(idx), ts[1], ts[2], ts[3], *tb, **opts)
    dy = rng.standard_normal((n, h))
    yt.backward(torch.tensor(dy))
    for tier in (F, R):
        y, cache = tier.moe_experts(x, idx, w, gate_up, down, gub, db, **opts)
        assert rel_err(y, yt.detach().numpy()) < 1e-12
        grads = [g for g in tier.moe_experts_backward(dy, cache) if g is not None]
        assert len(grads) == len(ts)
        for g, t in zip(grads, ts):
            assert rel_err(g, t.grad.numpy()) < 1e-10
    _, cache = F.moe_experts(x, idx, w, gate_up, down, gub, db, **opts)
    assert np.all(F.moe_experts_backward(dy, cache)[2][3] == 0)  # the idle expert learns nothing


@pytest.mark.parametrize("tier", [F, R], ids=["fast", "textbook"])
def test_float32_stays_float32(tier):
    rng = np.random.default_rng(3)
    z = rng.standard_normal((4, 6)).astype(np.float32)
    bias = np.zeros(6, np.float32)
    (w, _), c = tier.topk_router(z, 2, variant="sigmoid", norm_topk_prob=True, correction_bias=bias, n_group=2)
    assert w.dtype == np.float32 and tier.topk_router_backward(np.ones_like(w), c).dtype == np.float32
    assert tier.topk_router_jvp(c, np.ones_like(z)).dtype == np.float32
    x = rng.standard_normal((4, 3)).astype(np.float32)
    gu, dn = rng.standard_normal((6, 3, 4)).astype(np.float32), rng.standard_normal((6, 2, 3)).astype(np.float32)
    y, c = tier.moe_experts(x, np.zeros((4, 2), int), np.ones((4, 2), np.float32), gu, dn, kind="gpt_oss")
    assert y.dtype == np.float32
    assert all(g is None or g.dtype == np.float32 for g in tier.moe_experts_backward(np.ones_like(y), c))
    assert tier.moe_experts_jvp(c, np.ones_like(x)).dtype == np.float32


def test_float32_gradcheck_against_float64():
    rng = np.random.default_rng(4)
    x, idx, w = rng.standard_normal((3, 4)), rng.integers(0, 5, (3, 2)), rng.uniform(0.1, 1, (3, 2))
    gu, dn = rng.standard_normal((5, 6, 4)), rng.standard_normal((5, 4, 3))
    assert gradcheck(F.moe_experts, x, idx, w, gu, dn, activation="gelu", dtype=np.float32, mode="both").ok


@pytest.mark.parametrize("tier", [F, R], ids=["fast", "textbook"])
def test_one_token_without_leading_axes(tier):
    z = np.array([0.3, 1.0, -0.5, 0.9])
    (w, idx), c = tier.topk_router(z, 2, variant="softmax_topk", norm_topk_prob=True)
    assert idx.tolist() == [1, 3] and w.shape == (2,)
    np.testing.assert_allclose(w, np.exp([1.0, 0.9]) / np.exp([1.0, 0.9]).sum(), rtol=1e-14)
    assert tier.topk_router_backward(np.array([0.5, -1.0]), c).shape == (4,)
    x = np.array([0.5, -1.0, 2.0])
    y, c = tier.moe_experts(x, idx, w, np.ones((4, 4, 3)), np.ones((4, 3, 2)))
    dx, dw, *_ = tier.moe_experts_backward(np.array([1.0, 2.0, -1.0]), c)
    assert y.shape == dx.shape == (3,) and dw.shape == (2,)


# -- bad input, every argument ------------------------------------------------------------------------


def _router_ok():
    return np.random.default_rng(0).standard_normal((3, 6))


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(logits=np.ones((3, 6), complex)), TypeError, "logits"),
        (dict(logits=np.ones((3, 0))), ValueError, r"logits: expected shape \(\.\.\., E\)"),
        (dict(logits=np.float64(1.0)), ValueError, "logits"),
        (dict(top_k=0), ValueError, "top_k"),
        (dict(top_k=2.0), TypeError, "top_k"),
        (dict(top_k=7), ValueError, r"top_k: expected at most num_experts \(6\)"),
        (dict(variant="softmax"), ValueError, "variant"),
        (dict(norm_topk_prob=1), TypeError, "norm_topk_prob"),
        (dict(variant="topk_softmax", norm_topk_prob=True), ValueError, "norm_topk_prob"),
        (dict(correction_bias=np.zeros(6)), ValueError, "correction_bias: expected None with variant 'softmax_topk'"),
        (dict(variant="sigmoid", correction_bias=np.zeros(5)), ValueError, r"correction_bias: expected shape \(6,\)"),
        (dict(variant="sigmoid", correction_bias=np.zeros(6, bool)), TypeError, "correction_bias"),
        (dict(n_group=4), ValueError, "n_group: expected a divisor"),
        (dict(n_group=0), ValueError, "n_group"),
        (dict(n_group=3, topk_group=4), ValueError, r"topk_group: expected at most n_group \(3\)"),
        (dict(n_group=3, topk_group=1, top_k=3), ValueError, "top_k: expected at most topk_group"),
        (dict(topk_group=True), TypeError, "topk_group"),
        (dict(routed_scaling_factor=0.0), ValueError, "routed_scaling_factor"),
        (dict(routed_scaling_factor="2"), TypeError, "routed_scaling_factor"),
        (dict(norm_topk_eps=-1e-6), ValueError, "norm_topk_eps: expected a number >= 0"),
        (dict(norm_topk_eps="1e-6"), TypeError, "norm_topk_eps"),
        (dict(norm_topk_eps=float("nan")), ValueError, "norm_topk_eps"),
        (dict(variant="topk_softmax", norm_topk_eps=1e-6), ValueError, "norm_topk_eps: expected None"),
    ],
)
def test_router_refuses_bad_arguments(kwargs, exc, match):
    call = dict(logits=_router_ok(), top_k=2)
    call.update(kwargs)
    logits, k = call.pop("logits"), call.pop("top_k")
    with pytest.raises(exc, match=match):
        F.topk_router(logits, k, **call)


def test_router_backward_and_jvp_refuse_bad_arguments():
    (w, _), cache = F.topk_router(_router_ok(), 2)
    with pytest.raises(ValueError, match=r"dout: expected shape \(3, 2\)"):
        F.topk_router_backward(np.ones((3, 3)), cache)
    with pytest.raises(TypeError, match="dout"):
        F.topk_router_backward(np.ones((3, 2), complex), cache)
    with pytest.raises(TypeError, match="cache: topk_router_backward expected a TopKRouterCache"):
        F.topk_router_backward(w, (1, 2))
    with pytest.raises(TypeError, match="cache: topk_router_jvp"):
        F.topk_router_jvp((1, 2), None)
    with pytest.raises(ValueError, match=r"tlogits: expected shape \(3, 6\)"):
        F.topk_router_jvp(cache, np.ones((3, 5)))
    with pytest.raises(TypeError, match="at most 1 tangents"):
        F.topk_router_jvp(cache, None, None)
    assert np.array_equal(F.topk_router_jvp(cache), np.zeros((3, 2)))


def _experts_ok(kind="swiglu"):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 4))
    idx = rng.integers(0, 5, (2, 3, 2))
    w = rng.standard_normal((2, 3, 2))
    gu = rng.standard_normal((5, 6, 4) if kind == "swiglu" else (5, 4, 6))
    dn = rng.standard_normal((5, 4, 3) if kind == "swiglu" else (5, 3, 4))
    return dict(x=x, indices=idx, weights=w, gate_up=gu, down=dn)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(x=np.ones((2, 3, 4), bool)), TypeError, "x"),
        (dict(x=np.float64(1.0)), ValueError, r"x: expected shape \(\.\.\., H\)"),
        (dict(indices=np.zeros((2, 3, 2))), TypeError, "indices: expected an integer array"),
        (dict(indices=np.zeros((2, 2, 2), int)), ValueError, "indices: expected shape"),
        (dict(indices=np.zeros((2, 3, 0), int)), ValueError, "indices: expected shape"),
        (
            dict(indices=np.full((2, 3, 2), 5)),
            ValueError,
            r"indices: expected values in \[0, 5\) \(gate_up's E\), got 5",
        ),
        (dict(indices=np.full((2, 3, 2), -1)), ValueError, r"indices: expected values in \[0, 5\).*got -1"),
        (dict(weights=np.ones((2, 3, 3))), ValueError, r"weights: expected shape \(2, 3, 2\)"),
        (dict(weights=np.ones((2, 3, 2), complex)), TypeError, "weights"),
        (dict(gate_up=np.ones((5, 6, 3))), ValueError, r"gate_up: expected shape \(E, 2I, H\) with H = 4"),
        (dict(gate_up=np.ones((5, 5, 4))), ValueError, "gate_up: expected shape"),
        (dict(gate_up=np.ones((6, 4))), ValueError, "gate_up: expected shape"),
        (dict(gate_up=np.ones((5, 6, 4), bool)), TypeError, "gate_up"),
        (dict(down=np.ones((5, 3, 4))), ValueError, r"down: expected shape \(5, 4, 3\)"),
        (dict(down=np.ones((5, 4, 3), object)), TypeError, "down"),
        (dict(gate_up_bias=np.ones((5, 5))), ValueError, r"gate_up_bias: expected shape \(5, 6\)"),
        (dict(gate_up_bias=np.ones((5, 6), complex)), TypeError, "gate_up_bias"),
        (dict(down_bias=np.ones((5, 3))), ValueError, r"down_bias: expected shape \(5, 4\)"),
        (dict(down_bias=np.ones((5, 4), bool)), TypeError, "down_bias"),
        (dict(kind="moe"), ValueError, "kind: expected one of"),
        (dict(activation="tanh"), ValueError, "activation: expected one of"),
        (dict(alpha=math.nan), ValueError, "alpha"),
        (dict(alpha="1"), TypeError, "alpha"),
        (dict(limit=0.0), ValueError, "limit"),
        (dict(limit=None), TypeError, "limit"),
    ],
)
def test_experts_refuse_bad_arguments(kwargs, exc, match):
    call = _experts_ok()
    call.update(kwargs)
    args = [call.pop(n) for n in ("x", "indices", "weights", "gate_up", "down")]
    with pytest.raises(exc, match=match):
        F.moe_experts(*args, **call)


def test_gpt_oss_layout_is_checked_as_its_own():
    ok = _experts_ok("gpt_oss")
    F.moe_experts(*ok.values(), kind="gpt_oss")
    with pytest.raises(ValueError, match=r"gate_up: expected shape \(E, H, 2I\)"):
        F.moe_experts(*_experts_ok("swiglu").values(), kind="gpt_oss")
    args = list(ok.values())
    args[4] = np.ones((5, 4, 3))
    with pytest.raises(ValueError, match=r"down: expected shape \(5, 3, 4\)"):
        F.moe_experts(*args, kind="gpt_oss")


def test_experts_backward_and_jvp_refuse_bad_arguments():
    ok = _experts_ok()
    y, cache = F.moe_experts(*ok.values(), down_bias=np.zeros((5, 4)))
    with pytest.raises(ValueError, match=r"dout: expected shape \(2, 3, 4\)"):
        F.moe_experts_backward(np.ones((2, 3, 3)), cache)
    with pytest.raises(TypeError, match="cache: moe_experts_backward expected a MoeExpertsCache"):
        F.moe_experts_backward(y, None)
    with pytest.raises(TypeError, match="cache: moe_experts_jvp"):
        F.moe_experts_jvp(None)
    textbook = R.moe_experts(*ok.values())[1]  # the same class name in the other tier: named by module
    with pytest.raises(
        TypeError,
        match=r"cache: moe_experts_backward expected a npattn\.functional\.moe\.MoeExpertsCache .*"
        r"got npattn\.functional\.reference\.MoeExpertsCache$",
    ):
        F.moe_experts_backward(y, textbook)
    with pytest.raises(TypeError, match="at most 6 tangents"):
        F.moe_experts_jvp(cache, *([None] * 7))
    with pytest.raises(ValueError, match=r"tx: expected shape \(2, 3, 4\)"):
        F.moe_experts_jvp(cache, np.ones((2, 3)))
    with pytest.raises(ValueError, match=r"tweights: expected shape \(2, 3, 2\)"):
        F.moe_experts_jvp(cache, None, np.ones((2, 3)))
    with pytest.raises(ValueError, match=r"tgate_up: expected shape \(5, 6, 4\)"):
        F.moe_experts_jvp(cache, None, None, np.ones((5, 4, 6)))
    with pytest.raises(ValueError, match=r"tdown: expected shape \(5, 4, 3\)"):
        F.moe_experts_jvp(cache, None, None, None, np.ones((5, 3, 4)))
    with pytest.raises(ValueError, match="tgate_up_bias: expected None"):
        F.moe_experts_jvp(cache, None, None, None, None, np.ones((5, 6)))
    with pytest.raises(ValueError, match=r"tdown_bias: expected shape \(5, 4\)"):
        F.moe_experts_jvp(cache, None, None, None, None, None, np.ones((5, 3)))
    assert np.array_equal(F.moe_experts_jvp(cache), np.zeros((2, 3, 4)))


def test_npattn_check_covers_the_pairs():
    from npattn.tools.check import cases

    found = {name: thunk for name, thunk in cases(0) if name.startswith(("topk_router", "moe_experts"))}
    assert sorted(found) == ["moe_experts (gpt_oss)", "moe_experts (swiglu)", "topk_router (sigmoid, groups)"]
    for name, thunk in found.items():
        report = thunk()
        assert report.ok and any(row.mode == "transpose" for row in report.rows), name

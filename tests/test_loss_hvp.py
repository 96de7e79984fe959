"""CausalLM.loss_hvp: the mean cross-entropy, its gradient and its Hessian-vector product along
parameter tangents (forward over reverse through every layer), for each family (Kimi Linear's KDA
layers included): against central differences of the gradient, symmetric (<u, H v> = <H u, v>)
and linear in the direction, its loss and gradient those of ``loss`` + ``backward``, the model's
gradients left as they were, and a tiny Llama, Qwen3-Next, Qwen3.5 and Kimi Linear against torch's
double backward through transformers' own models (float64, transformers' float32 casts made
float64, 1e-8)."""

from __future__ import annotations

import numpy as np
import pytest
from _oracles import rel_err

from npattn.models import CausalLM
from npattn.models.tiny import TINY_CONFIGS, tiny_config

FAMILIES = ["llama", "qwen3", "gemma3_text", "gpt_oss", "deepseek_v3", "olmo3", "qwen3_next", "qwen3_5_text"]
FAMILIES += ["gemma4_text"]  # cross-layer KV sharing: the reusing layers' second order sent home
FAMILIES += ["deepseek_v32"]  # MLA restricted to the indexer's choice (a constant mask)
FAMILIES += ["kimi_linear"]  # KDA layers (the chunked kimi_delta_attention_backward_jvp) beside MLA and MoE
FAMILIES += ["mixtral", "qwen2_moe"]  # routed experts alone; beside a gated shared expert (olmoe: test_moe_families)
FAMILIES += ["granite", "granitemoe"]  # the embedding, residual and logit multipliers (and top-k-softmax experts)
FAMILIES += ["granitemoeshared", "granitemoehybrid"]  # the shared MLP beside the experts; alone (Granite 4.0)
FAMILIES += ["lfm2"]  # LFM2: ShortConv layers (causal_conv1d_backward_jvp without an activation) beside attention
FAMILIES += ["exaone4"]  # post-norm layers, per-head QK-norm, a sliding RoPE layer beside a full NoPE one
FAMILIES += ["ernie4_5"]  # RoPE on interleaved pairs (2i, 2i+1) in the second-order step, all seven biases
FAMILIES += ["arcee"]  # the plain relu2 MLP with its biases under YaRN in the second-order step
FAMILIES += ["apertus"]  # the xIELU MLP (its two parameters in the second order), per-head q/k norms
FAMILIES += ["ministral3"]  # the queries' scale by position in the second-order step (YaRN over 2 positions)
FAMILIES += ["lfm2_moe"]  # sigmoid routing renormalised by sum + 1e-6, the expert bias steering the choice
FAMILIES += ["falcon_h1"]  # attention and Mamba-2 side by side (ParallelSum), every muP factor
FAMILIES += ["nemotron_h"]  # blocks of one sublayer (Mamba-2, attention, a relu2 MLP), the layers without the other
FAMILIES += ["glm4"]  # partial RoPE on interleaved pairs, plain norms after both sublayers (second order through them)
FAMILIES += ["cohere2", "cohere"]  # attention and MLP side by side on one bias-free LayerNorm, the logits' scale
FAMILIES += ["nemotron_h_moe"]  # experts that are not gated (relu2) in a latent width, a relu2 shared expert
FAMILIES += ["hunyuan_v1_dense"]  # the QK-norm after RoPE in the second-order step, NTK-alpha RoPE
FAMILIES += ["gpt_neox"]  # the parallel residual (two LayerNorms with biases of the layer's input), partial RoPE
FAMILIES += ["phi"]  # attention and the plain MLP side by side on one LayerNorm with a bias, the head's bias
FAMILIES += ["starcoder2"]  # the plain MLP with biases after a sliding-window attention, LayerNorms with biases
FAMILIES += ["mamba2"]  # blocks of a Mamba-2 mixer alone (no attention, no MLP), its conv bias, two groups
FAMILIES += ["stablelm"]  # a LayerNorm of each head's q and k with a weight row a head, beside the parallel MLP
FAMILIES += ["gpt2"]  # the learned positions' table (its rows' second order), Conv1D layers, no RoPE
IGNORE = -1


def _setup(name, seed=0, shape=(2, 5)):
    m = CausalLM(TINY_CONFIGS[name], rng=seed)
    rng = np.random.default_rng(seed + 1)
    v = m.config.vocab_size
    ids = rng.integers(0, v, shape)
    targets = rng.integers(0, v, shape)
    targets[0, 1] = IGNORE  # one position not counted
    return m, ids, targets, rng


def _direction(m, rng, scale=0.1):
    return {n: scale * rng.standard_normal(p.data.shape) for n, p in m.named_parameters()}


def _grads(m, ids, targets, v=None, s=0.0):
    """loss and every gradient (fresh) at the parameters moved by s v, by loss + backward."""
    params = dict(m.named_parameters())
    saved = {n: p.data for n, p in params.items()}
    for n, p in params.items():
        p.data = saved[n] + (s * v[n] if v is not None else 0)
        p.grad = None
    try:
        loss, dlogits = m.loss(ids, targets, ignore_index=IGNORE)
        m.backward(dlogits)
        return loss, {n: p.grad.copy() for n, p in params.items()}
    finally:
        for n, p in params.items():
            p.data = saved[n]


def _flat(d, names):
    return np.concatenate([d[n].ravel() for n in names])


def _no_state(m):
    return all(not mod._states for mod in m.modules())


@pytest.mark.parametrize("name", FAMILIES)
def test_hvp_is_the_central_difference_of_the_gradient(name):
    m, ids, targets, rng = _setup(name)
    v = _direction(m, rng)
    loss, grads, hvp = m.loss_hvp(ids, targets, v, ignore_index=IGNORE)
    names = list(dict(m.named_parameters()))
    assert set(grads) == set(hvp) == set(names)
    eps = 1e-5
    _, gp = _grads(m, ids, targets, v, eps)
    _, gm = _grads(m, ids, targets, v, -eps)
    numeric = (_flat(gp, names) - _flat(gm, names)) / (2 * eps)
    assert np.abs(numeric).max() > 1e-3  # a direction that moves the gradient
    assert rel_err(_flat(hvp, names), numeric, floor=1e-300, relative_to="max_b") < 1e-6
    for n in names:  # each parameter's block on its own scale too
        num = (gp[n] - gm[n]) / (2 * eps)
        assert rel_err(hvp[n], num, floor=1e-6 * np.abs(numeric).max(), relative_to="max_b") < 1e-5, n
    assert _no_state(m)


@pytest.mark.parametrize("name", FAMILIES)
def test_hessian_is_symmetric(name):
    m, ids, targets, rng = _setup(name, seed=3)
    u, v = _direction(m, rng), _direction(m, rng)
    names = list(u)
    _, _, hu = m.loss_hvp(ids, targets, u, ignore_index=IGNORE)
    _, _, hv = m.loss_hvp(ids, targets, v, ignore_index=IGNORE)
    uhv, vhu = _flat(u, names) @ _flat(hv, names), _flat(v, names) @ _flat(hu, names)
    scale = np.linalg.norm(_flat(u, names)) * np.linalg.norm(_flat(hv, names))
    assert abs(uhv - vhu) < 1e-12 * scale, (uhv, vhu)
    # linear in the direction: H(u + 2v) = Hu + 2 Hv
    _, _, hw = m.loss_hvp(ids, targets, {n: u[n] + 2 * v[n] for n in names}, ignore_index=IGNORE)
    assert rel_err(_flat(hw, names), _flat(hu, names) + 2 * _flat(hv, names), floor=1e-300, relative_to="max_b") < 1e-12


@pytest.mark.parametrize("name", FAMILIES)
def test_loss_and_grads_are_loss_and_backward_and_the_model_is_left_as_it_was(name):
    m, ids, targets, rng = _setup(name, seed=5)
    v = _direction(m, rng)
    ref_loss, ref_grads = _grads(m, ids, targets)
    params = dict(m.named_parameters())
    before = {n: (p.grad, None if p.grad is None else p.grad.copy(), p.grad_tangent) for n, p in params.items()}
    some = next(iter(params.values()))
    some.grad_tangent = np.full(some.data.shape, 7.0)  # a user's own buffer, left alone
    kept_tangent = some.grad_tangent
    loss, grads, hvp = m.loss_hvp(ids, targets, v, ignore_index=IGNORE)
    assert loss == pytest.approx(ref_loss, rel=1e-14)
    for n in params:
        assert rel_err(grads[n], ref_grads[n], floor=1e-300, relative_to="max_b") < 1e-12, n
        p = params[n]
        assert p.grad is before[n][0]  # the same array, the same values
        np.testing.assert_array_equal(p.grad, before[n][1])
        assert grads[n] is not p.grad and hvp[n] is not p.grad_tangent
    assert some.grad_tangent is kept_tangent and (kept_tangent == 7.0).all()
    assert all(p.grad_tangent is None for p in params.values() if p is not some)
    assert _no_state(m)


def test_missing_names_are_zero_and_a_zero_direction_gives_zero():
    m, ids, targets, rng = _setup("llama", seed=7)
    v = _direction(m, rng)
    part = {n: t for i, (n, t) in enumerate(v.items()) if i % 3 == 0}
    full = {n: part.get(n, np.zeros_like(t)) for n, t in v.items()}
    _, g1, h1 = m.loss_hvp(ids, targets, part, ignore_index=IGNORE)
    _, g2, h2 = m.loss_hvp(ids, targets, full, ignore_index=IGNORE)
    for n in v:
        np.testing.assert_allclose(h1[n], h2[n], rtol=0, atol=1e-14)
        np.testing.assert_array_equal(g1[n], g2[n])
    _, _, h0 = m.loss_hvp(ids, targets, {}, ignore_index=IGNORE)
    assert all(not h.any() for h in h0.values())


def test_refusals_compute_nothing():
    m, ids, targets, rng = _setup("llama")
    v = _direction(m, rng)
    with pytest.raises(ValueError, match="unknown parameter 'nope'"):
        m.loss_hvp(ids, targets, {"nope": np.zeros(3)}, ignore_index=IGNORE)
    with pytest.raises(ValueError, match=r"param_tangents\['model.norm.weight'\]: expected shape"):
        m.loss_hvp(ids, targets, {"model.norm.weight": np.zeros(3)}, ignore_index=IGNORE)
    with pytest.raises(ValueError, match="targets: expected ids' shape"):
        m.loss_hvp(ids, targets[:, :-1], v, ignore_index=IGNORE)
    with pytest.raises(ValueError, match=r"targets: expected values in \[0, "):
        m.loss_hvp(ids, targets, v)  # IGNORE without ignore_index
    with pytest.raises(ValueError, match="ids: "):
        m.loss_hvp(ids + 1000, targets, v, ignore_index=IGNORE)
    assert _no_state(m)
    assert all(p.grad_tangent is None for p in m.parameters())


def test_tied_head_takes_one_tangent_by_the_embedding_name():
    m, ids, targets, rng = _setup("qwen3")
    names = dict(m.named_parameters())
    assert "lm_head.weight" not in names
    with pytest.raises(ValueError, match="lm_head.weight"):
        m.loss_hvp(
            ids,
            targets,
            ignore_index=IGNORE,
            param_tangents={"lm_head.weight": rng.standard_normal(names["model.embed_tokens.weight"].shape)},
        )


# -- against transformers' own model ---------------------------------------------------------------

LLAMAS = {
    "untied": dict(
        vocab_size=29,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_bias=True,
        mlp_bias=True,
        rope_theta=500.0,
    ),
    "tied": dict(
        vocab_size=29,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=True,
    ),
}


def _kwargs(family: str, **changes) -> dict:
    d = tiny_config(family, **changes)
    d.pop("model_type")
    return d


# each case: (config class, model class, the config's keyword arguments, (batch, length)); the
# GatedDeltaNet and KDA families run transformers' torch fallback of the chunked delta rules (no fla
# kernels), a torch graph differentiable twice; 70 tokens run it over two chunks of 64 on both sides
# (KDA's over five chunks of 16 here, npattn's default, and two of 64 in transformers)
CASES = {
    "llama_untied": ("LlamaConfig", "LlamaForCausalLM", LLAMAS["untied"], (2, 6)),
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", LLAMAS["tied"], (2, 6)),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", _kwargs("qwen3_next", mlp_only_layers=[1]), (2, 6)),
    "qwen3_next_two_chunks": ("Qwen3NextConfig", "Qwen3NextForCausalLM", _kwargs("qwen3_next"), (1, 70)),
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", _kwargs("qwen3_5_text"), (2, 6)),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", _kwargs("qwen3_5_moe_text"), (2, 6)),
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM", _kwargs("kimi_linear"), (2, 6)),
    "kimi_linear_chunks": ("KimiLinearConfig", "KimiLinearForCausalLM", _kwargs("kimi_linear"), (1, 70)),
}


def _torch_fallbacks(monkeypatch, hf):
    """transformers' torch implementations of the delta rule and the short convolution, even where
    flash-linear-attention or causal-conv1d is installed (its kernels are float32/GPU, and the
    oracle is torch's own graph): the module's names rebound to the functions its decorator wraps."""
    import sys

    modeling = sys.modules[type(hf).__module__]
    for name in ("torch_chunk_gated_delta_rule", "chunk_kimi_delta_attention", "causal_conv1d_fn"):
        wrapped = getattr(getattr(modeling, name, None), "__wrapped__", None)
        if wrapped is not None:
            monkeypatch.setattr(modeling, name, wrapped)


def _torch_loss_grads_hvp(torch, hf, ids, targets, v):
    """torch's mean cross-entropy of transformers' logits, its gradient (``create_graph``) and the
    gradient of ``<grad, v>``: double backward, transformers' float32 casts made float64."""
    from _hf64 import float64_reference

    params = dict(hf.named_parameters())
    names = list(params)
    with float64_reference():
        logits = hf(input_ids=torch.from_numpy(ids), use_cache=False).logits
        vocab = logits.shape[-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), torch.from_numpy(targets).reshape(-1))
        grads = torch.autograd.grad(loss, [params[n] for n in names], create_graph=True)
        gv = sum((g * torch.from_numpy(v[n])).sum() for g, n in zip(grads, names))
        hvps = torch.autograd.grad(gv, [params[n] for n in names])
    grads_np = {n: g.detach().numpy() for n, g in zip(names, grads)}
    return loss.item(), grads_np, {n: h.detach().numpy() for n, h in zip(names, hvps)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_against_torch_double_backward_through_transformers(monkeypatch, name):
    torch = pytest.importorskip("torch")
    T = pytest.importorskip("transformers")
    from _hf64 import build, state_dict

    cfg_cls, model_cls, kwargs, shape = CASES[name]
    hf, cfg = build(getattr(T, cfg_cls), getattr(T, model_cls), seed=2, **kwargs)
    _torch_fallbacks(monkeypatch, hf)
    m = CausalLM.from_hf(state_dict(hf), cfg)
    rng = np.random.default_rng(4)
    vocab = cfg["vocab_size"]
    ids = rng.integers(0, vocab, shape)
    targets = rng.integers(0, vocab, shape)
    targets[0, 2] = -100  # torch's default ignore_index
    v = {n: rng.standard_normal(p.shape) for n, p in hf.named_parameters()}
    assert set(v) == set(dict(m.named_parameters()))
    ref_loss, ref_g, ref_h = _torch_loss_grads_hvp(torch, hf, ids, targets, v)

    mine_loss, mine_g, mine_h = m.loss_hvp(ids, targets, v, ignore_index=-100)
    assert mine_loss == pytest.approx(ref_loss, rel=1e-12)
    for n in v:
        assert np.abs(ref_h[n]).max() > 0, n  # every parameter's block is compared, none is zero
        assert rel_err(mine_g[n], ref_g[n], floor=1e-300, relative_to="max_b") < 1e-8, n
        assert rel_err(mine_h[n], ref_h[n], floor=1e-300, relative_to="max_b") < 1e-8, n


# -- each forward tangent computed once ------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
def test_loss_hvp_computes_each_layers_forward_tangents_once(monkeypatch, name):
    """loss_hvp's jvp (the logits' tangent) and backward_jvp (every layer's input tangent, then each
    module's own stages) share the forward tangents: each attention / DeltaNet layer's stages and
    each module's output tangent are computed once per call, not once per pass."""
    from npattn.nn.attention_core import MultiHeadAttentionCore
    from npattn.nn.delta_net import GatedDeltaNet
    from npattn.nn.module import Module

    m, ids, targets, rng = _setup(name, seed=9)
    v = _direction(m, rng)
    want = m.loss_hvp(ids, targets, v, ignore_index=IGNORE)
    calls: dict = {}

    def counted(cls, attr):
        original = getattr(cls, attr)

        def wrapper(self, *args, **kwargs):
            key = (attr, type(self).__name__, id(self), id(args[0]))  # the module and its saved state
            calls[key] = calls.get(key, 0) + 1
            return original(self, *args, **kwargs)

        monkeypatch.setattr(cls, attr, wrapper)

    counted(MultiHeadAttentionCore, "_forward_tangents")
    counted(GatedDeltaNet, "_forward_tangents")
    for cls in {type(mod) for mod in m.modules()}:
        if "_jvp" in vars(cls):
            counted(cls, "_jvp")
    got = m.loss_hvp(ids, targets, v, ignore_index=IGNORE)
    stages = [k for k in calls if k[0] == "_forward_tangents"]
    assert len(stages) == m.config.num_hidden_layers  # one attention or DeltaNet layer each
    assert all(n == 1 for n in calls.values()), [(k[:2], n) for k, n in calls.items() if n > 1]
    assert got[0] == want[0]
    for n in v:
        np.testing.assert_array_equal(got[1][n], want[1][n])
        np.testing.assert_array_equal(got[2][n], want[2][n])
    assert isinstance(m, Module)


def test_jvp_then_backward_jvp_outside_loss_hvp_remembers_nothing():
    """A user's jvp then backward_jvp (the curvature guide's recipe) computes the forward tangents
    again from the tangents as they are then: changed in place in between, the product follows."""
    import npattn

    rng = np.random.default_rng(3)
    mha = npattn.MultiHeadAttention(8, 8, 2, causal=True, rope=True, rng=0)
    x, t = rng.standard_normal((2, 5, 8)), rng.standard_normal((2, 5, 8))
    v = {n: rng.standard_normal(p.data.shape) for n, p in mha.named_parameters()}

    def hvp(tangents, scale_after_jvp=1.0):
        mha.zero_grad()
        for p in mha.parameters():
            p.grad_tangent = None
        y = mha(x)
        ty = mha.jvp(param_tangents=tangents)
        for a in tangents.values():
            a *= scale_after_jvp  # in place, between the two calls
        mha.backward_jvp(y - t, param_tangents=tangents, ddy=ty * scale_after_jvp)
        return {n: p.grad_tangent.copy() for n, p in mha.named_parameters()}

    doubled = hvp({n: a.copy() for n, a in v.items()}, scale_after_jvp=2.0)
    want = hvp({n: 2 * a for n, a in v.items()})
    for n in v:
        assert rel_err(doubled[n], want[n], floor=1e-300, relative_to="max_b") < 1e-12, n


@pytest.mark.parametrize("name", FAMILIES)
def test_model_backward_jvp_gives_every_parameter_its_gradient_tangent(name):
    """After ``m(ids)`` and ``m.backward_jvp``, every parameter that got a gradient got its
    gradient's tangent (DeepSeek-V3.2's indexer: zero for both, its choice being piecewise constant)."""
    m, ids, _, rng = _setup(name, seed=7)
    v = _direction(m, rng)
    m.zero_grad()
    logits = m(ids)
    m.backward_jvp(rng.standard_normal(logits.shape), param_tangents=v)
    for n, p in m.named_parameters():
        assert p.grad is not None and p.grad_tangent is not None, n
        if ".indexer." in n:
            assert not p.grad.any() and not p.grad_tangent.any(), n

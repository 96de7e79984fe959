"""OLMo's and OLMoE's ``clip_qkv``: ``MultiHeadAttention``'s ``qkv_clip`` clamps q, k and v to
``[-qkv_clip, qkv_clip]`` after the projections (and after a QK-norm that precedes RoPE, as
OLMoE's), right before RoPE.  The option on the module: every forward path the same numbers, the
backward, forward mode and second order against central differences (self- and cross-attention,
both cores, with QK-norm before or after RoPE); the configs' ``clip_qkv`` read into
``CausalLMConfig.qkv_clip``; OLMo and OLMoE with a small ``clip_qkv`` (some of q, k and v clamped
in every layer) against transformers' own classes in float64: logits, every gradient under a
random upstream gradient, cached decoding; and the family-wide padded-batch and Hessian-vector
suites run on OLMo and OLMoE whose clamps hold part of q, k and v."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from _hf64 import transformers_or_none
from _oracles import rel_err

import npattn
from npattn import no_grad
from npattn.models import CausalLM, config_from_hf
from npattn.models.tiny import tiny_config

T = transformers_or_none()
needs_transformers = pytest.mark.skipif(T is None, reason="needs torch and transformers")

CLIP = 0.6


def _mha(clip=CLIP, **kw):
    opts = dict(num_kv_heads=2, causal=True, rope=True, qkv_bias=True, rng=0, dtype=np.float64)
    return npattn.MultiHeadAttention(16, 16, 4, qkv_clip=clip, **{**opts, **kw})


def _clamped_fractions(m, *inputs):
    """The fraction of q's, k's and v's entries the clamp held at a bound in a forward of ``m``."""
    m(*inputs)
    pos = m.pop_saved().position
    return [1.0 - float(c.inside.mean()) for c in (pos.q_clip, pos.k_clip, pos.v_clip)]


def test_the_clamp_holds_q_k_and_v_before_rope():
    """The output is that of the projections clamped, then rotated, attended and projected out,
    written with the functional ops; some entries of each of q, k and v are clamped (and not all);
    without the option the output differs."""
    F = npattn.functional
    m = _mha()
    x = np.random.default_rng(0).standard_normal((2, 5, 16))
    fractions = _clamped_fractions(m, x)
    assert all(0.1 < f < 0.9 for f in fractions), fractions
    W = {n: p.data for n, p in m.named_parameters()}

    def heads(name, n):
        y = F.clamp(x @ W[f"W_{name}.weight"].T + W[f"W_{name}.bias"], -CLIP, CLIP)[0]
        return y.reshape(2, 5, n, 4).swapaxes(1, 2)

    q, k, v = heads("query", 4), heads("key", 2), heads("value", 2)
    pos = np.arange(5)
    q, k = F.rope(q, pos)[0], F.rope(k, pos)[0]
    ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)[0]
    want = ctx.swapaxes(1, 2).reshape(2, 5, 16) @ W["out_proj.weight"].T + W["out_proj.bias"]
    with no_grad():
        got = m(x)
        assert rel_err(got, want, floor=1e-300) < 1e-12
        assert rel_err(_mha(None)(x), want, floor=1e-300) > 1e-3


def test_every_path_clamps():
    """The forward kept for a backward, a whole pass that keeps nothing, the cached decoding of a
    prompt then one token at a time, and given positions (a padded batch's) give the same numbers."""
    x = np.random.default_rng(1).standard_normal((2, 7, 16))
    for kw in ({}, dict(qk_norm=True), dict(qk_norm=True, qk_norm_scope="all_heads"), dict(memory_efficient=True)):
        m = _mha(**kw)
        full = m(x)
        m.clear_saved()
        with no_grad():
            assert rel_err(m(x), full, floor=1e-300) < 1e-12, kw
            steps = [m(x[:, :3], use_cache=True)] + [m(x[:, t : t + 1], use_cache=True) for t in range(3, 7)]
            assert rel_err(np.concatenate(steps, axis=1), full, floor=1e-300) < 1e-12, kw
            m.reset_kv_cache()
            m(x[:, :2], use_cache=True)
            rest = m(x[:, 2:], use_cache=True, positions=np.broadcast_to(np.arange(2, 7), (2, 5)))
        assert rel_err(rest, full[:, 2:], floor=1e-300) < 1e-12, kw


_VARIANTS = {
    "rope": {},
    "qk_norm_all_heads": dict(qk_norm=True, qk_norm_scope="all_heads"),  # OLMoE's
    "qk_norm_after_rope": dict(qk_norm=True, qk_norm_after_rope=True),
    "memory_efficient": dict(memory_efficient=True),
    "cross": dict(causal=False, kdim=12, vdim=10),
}


def _inputs(name, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 5, 16))
    return (x,) if name != "cross" else (x, rng.standard_normal((2, 6, 12)), rng.standard_normal((2, 6, 10)))


def _randomize(m, seed=9):
    """Norm weights away from 1, so that a wrong order of norm and clamp shows."""
    rng = np.random.default_rng(seed)
    for n, p in m.named_parameters():
        if "norm" in n:
            p.data = p.data + 0.3 * rng.standard_normal(p.data.shape)


@pytest.mark.parametrize("name", list(_VARIANTS))
def test_backward_and_jvp_against_central_differences(name):
    """npattn.gradcheck (central differences, reverse and forward mode) of modules whose clamps
    hold some entries of q, k and v (the inputs away from the bounds by chance: no entry within
    a step of one)."""
    m = _mha(**_VARIANTS[name])
    _randomize(m)
    inputs = _inputs(name, 2)
    assert all(0.05 < f < 0.95 for f in _clamped_fractions(m, *inputs))
    report = npattn.gradcheck(m, *inputs, mode="both")
    assert report.ok, str(report)


@pytest.mark.parametrize("name", list(_VARIANTS))
def test_second_order_against_central_differences(name):
    """backward_jvp against central differences of the backward along the inputs, the parameters
    and the upstream gradient (npattn.gradgradcheck), and the Hessian's symmetry."""
    m = _mha(**_VARIANTS[name])
    _randomize(m)
    report = npattn.gradgradcheck(m, *_inputs(name, 3))
    assert report.ok, str(report)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf")])
def test_the_option_is_checked(bad):
    with pytest.raises(ValueError, match="qkv_clip: expected a finite number > 0"):
        npattn.MultiHeadAttention(16, 16, 4, qkv_clip=bad)
    for wrong in ("1", True):
        with pytest.raises(TypeError, match="qkv_clip"):
            npattn.MultiHeadAttention(16, 16, 4, qkv_clip=wrong)
    assert "qkv_clip=0.6" in repr(_mha()) and "qkv_clip" not in repr(_mha(None))


# -- the configs --------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["olmo", "olmoe"])
def test_the_configs_read_clip_qkv(family):
    """clip_qkv (OLMo-7B-0424's 8.0) reaches the attention as qkv_clip; null or absent: none;
    zero, a negative number or a non-number is refused naming the key."""
    c = config_from_hf(tiny_config(family, clip_qkv=8))
    assert c.qkv_clip == 8.0 and c.attention_config("full_attention").qkv_clip == 8.0
    assert CausalLM(c, rng=0).model.layers[0].self_attn.qkv_clip == 8.0
    assert config_from_hf(tiny_config(family, clip_qkv=None)).qkv_clip is None
    assert config_from_hf({k: v for k, v in tiny_config(family).items() if k != "clip_qkv"}).qkv_clip is None
    for bad in (0, -8.0, "8", True, float("nan"), [8.0]):
        with pytest.raises(ValueError, match=r"config\['clip_qkv'\]: expected a finite number > 0"):
            config_from_hf(tiny_config(family, clip_qkv=bad))


# -- against transformers ------------------------------------------------------------------------------
def _families():
    return {"olmo": (T.OlmoConfig, T.OlmoForCausalLM), "olmoe": (T.OlmoeConfig, T.OlmoeForCausalLM)}


@needs_transformers
@pytest.mark.parametrize("family", ["olmo", "olmoe"])
def test_against_transformers_with_the_clamp_active(tmp_path, family):
    """OlmoForCausalLM / OlmoeForCausalLM with clip_qkv = 0.6 in float64 (transformers' own
    save_pretrained directory, loaded by from_pretrained): in every layer some entries of q, of k
    and of v are clamped (and most are not); the logits to 1e-9, every gradient to 1e-8 under a
    random upstream gradient, and cached decoding to 1e-10."""
    from _hf64 import build, check_cached_decoding, check_logits_and_grads

    config_cls, model_cls = _families()[family]
    cfg = dict(tiny_config(family), clip_qkv=CLIP)
    hf, _ = build(config_cls, model_cls, **{k: v for k, v in cfg.items() if k != "model_type"})
    hf.save_pretrained(tmp_path)
    m = CausalLM.from_pretrained(tmp_path, dtype=np.float64)
    assert m.config.qkv_clip == CLIP
    ids = np.array([[1, 5, 7, 0, 9, 3, 11], [4, 4, 8, 0, 1, 2, 30]])
    m(ids)
    for i, layer in enumerate(m.model.layers):
        pos = layer.self_attn.pop_saved().position
        fractions = [1.0 - float(c.inside.mean()) for c in (pos.q_clip, pos.k_clip, pos.v_clip)]
        assert all(0.1 < f < 0.9 for f in fractions), (i, fractions)
    m.clear_saved()
    dlogits = np.random.default_rng(2).standard_normal(ids.shape + (cfg["vocab_size"],))
    check_logits_and_grads(m, hf, ids, dlogits)
    check_cached_decoding(m, hf, ids)


# -- the family-wide suites on clamped models -----------------------------------------------------------
# the tiny entries with a clip_qkv that holds a fair part of q, k and v at a bound under npattn's own
# initialisation (rng=0), run through the padded-batch and second-order suites of every family
_CLAMPED = {"olmo": 0.5, "olmoe": 0.7}
_SUITES = {  # name: (test module, test function of a family's name)
    "padded_rows": ("test_padded_batches", "test_each_row_equals_its_prompt_alone"),
    "padded_decoding": ("test_padded_batches", "test_cached_decoding_after_a_padded_prompt_equals_each_row_alone"),
    "padded_grads_jvp": ("test_padded_batches", "test_gradients_and_jvp_of_each_row_equal_the_row_alone"),
    "padded_unbatched": ("test_padded_batches", "test_one_padded_sequence_without_a_batch_axis"),
    "hvp": ("test_loss_hvp", "test_hvp_is_the_central_difference_of_the_gradient"),
    "hessian_symmetric": ("test_loss_hvp", "test_hessian_is_symmetric"),
}


@pytest.mark.parametrize("suite", list(_SUITES))
@pytest.mark.parametrize("family", list(_CLAMPED))
def test_the_family_suites_pass_with_the_clamp_active(monkeypatch, family, suite):
    """Padded batches (each row, its cached decoding, gradients and JVP equal to the row alone; one
    sequence without a batch axis) and the loss's Hessian-vector product (central differences of
    the gradient, symmetry) on OLMo and OLMoE whose clamps hold 10 % to 90 % of q, k and v."""
    import _families

    from npattn.models.tiny import TINY_CONFIGS

    cfg = tiny_config(family, clip_qkv=_CLAMPED[family])
    m = CausalLM(cfg, rng=0)
    m(np.random.default_rng(0).integers(0, cfg["vocab_size"], (2, 5)))
    for layer in m.model.layers:
        pos = layer.self_attn.pop_saved().position
        held = [1.0 - float(c.inside.mean()) for c in (pos.q_clip, pos.k_clip, pos.v_clip)]
        assert all(0.1 < f < 0.9 for f in held), held
    m.clear_saved()
    monkeypatch.setitem(TINY_CONFIGS, family, cfg)
    monkeypatch.setitem(_families.FAMILIES, family, cfg)
    module, test = _SUITES[suite]
    getattr(importlib.import_module(module), test)(family)


@pytest.mark.parametrize("family", ["deepseek_v3", "gemma4_text", "qwen3_next"])
def test_a_clamp_the_layers_cannot_apply_is_refused(family):
    """Only MultiHeadAttention clamps: a config asking it of latent attention (DeepSeek-V3), Gemma 4's
    shared keys and values or linear-attention layers (Qwen3-Next) is refused, not ignored."""
    import dataclasses

    cfg = dataclasses.replace(config_from_hf(tiny_config(family)), qkv_clip=1.0)
    with pytest.raises(ValueError, match=r"qkv_clip: not supported with"):
        CausalLM(cfg, rng=0)

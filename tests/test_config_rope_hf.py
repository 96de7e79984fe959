"""RoPE keys of a config read as transformers 5 reads them, checked against transformers' own models
(float64, eager): ``rope_scaling`` beside ``rope_parameters`` (the older key wins, as in
``convert_rope_params_to_dict``; Gemma 3 merges it into the full-attention layers' dict), the
family defaults (GPT-OSS's YaRN with only ``rope_theta`` given), ``dynamic`` NTK within and beyond
``max_position_embeddings``, and ``yarn`` / ``llama3`` whose ``original_max_position_embeddings``
comes from ``max_position_embeddings``.  npattn is given the raw dict (not transformers'
standardized ``to_dict()``), so it must do the standardizing itself.  Skipped without
torch/transformers."""

from __future__ import annotations

import copy

import numpy as np
import pytest

pytest.importorskip("torch")
T = pytest.importorskip("transformers")

from _hf64 import build, float64_reference, state_dict  # noqa: E402
from _oracles import rel_err  # noqa: E402

from npattn import no_grad  # noqa: E402
from npattn.models import CausalLM, config_from_hf  # noqa: E402

TINY = dict(vocab_size=37, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4)

# (name, config class, model class, model_type, the config's keys)
CASES = [
    # rope_scaling replaces rope_parameters altogether: its type, and rope_theta from beside (700)
    (
        "llama_scaling_beside_parameters",
        "LlamaConfig",
        "LlamaForCausalLM",
        "llama",
        dict(
            TINY,
            num_key_value_heads=2,
            rope_theta=700.0,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0},
            rope_scaling={"rope_type": "linear", "factor": 2.0},
        ),
    ),
    (
        "llama_old_type_key",
        "LlamaConfig",
        "LlamaForCausalLM",
        "llama",
        dict(TINY, rope_parameters={"rope_type": "default"}, rope_scaling={"type": "linear", "factor": 3.0}),
    ),
    (
        "qwen3_next_scaling_keeps_partial_rotary",
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        "qwen3_next",
        dict(
            TINY,
            num_key_value_heads=2,
            head_dim=8,
            layer_types=["linear_attention", "full_attention"],
            linear_conv_kernel_dim=3,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=12,
            shared_expert_intermediate_size=16,
            partial_rotary_factor=0.5,
            rope_parameters={"rope_type": "default", "rope_theta": 50.0},
            rope_scaling={"rope_type": "linear", "factor": 4.0},
        ),
    ),
    (
        "deepseek_v3_scaling_beside_parameters",
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        "deepseek_v3",
        dict(
            TINY,
            num_key_value_heads=4,
            moe_intermediate_size=12,
            first_k_dense_replace=1,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            q_lora_rank=16,
            kv_lora_rank=12,
            qk_nope_head_dim=6,
            qk_rope_head_dim=4,
            v_head_dim=8,
            max_position_embeddings=64,
            rope_parameters={"rope_type": "default", "rope_theta": 50.0},
            # no original_max_position_embeddings: filled from max_position_embeddings
            rope_scaling={"type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.8},
        ),
    ),
    (
        "gemma3_scaling_merged_into_full_attention",
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        "gemma3_text",
        dict(
            TINY,
            num_key_value_heads=2,
            head_dim=8,
            query_pre_attn_scalar=8,
            sliding_window=3,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 300.0}},
            rope_scaling={"rope_type": "linear", "factor": 2.5},
            rope_local_base_freq=70.0,
        ),
    ),
    (
        "gpt_oss_theta_only_keeps_its_yarn",
        "GptOssConfig",
        "GptOssForCausalLM",
        "gpt_oss",
        dict(
            TINY,
            num_key_value_heads=2,
            head_dim=8,
            sliding_window=3,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=64,
            rope_theta=900.0,
        ),
    ),
    # 7: yarn and llama3 without original_max_position_embeddings
    (
        "llama_yarn_without_original",
        "LlamaConfig",
        "LlamaForCausalLM",
        "llama",
        dict(
            TINY,
            max_position_embeddings=8,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 100.0},
        ),
    ),
    (
        "llama_llama3_without_original",
        "LlamaConfig",
        "LlamaForCausalLM",
        "llama",
        dict(
            TINY,
            max_position_embeddings=8,
            rope_parameters={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "rope_theta": 100.0,
            },
        ),
    ),
    (
        "qwen3_dynamic",
        "Qwen3Config",
        "Qwen3ForCausalLM",
        "qwen3",
        dict(
            TINY,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=8,
            rope_parameters={"rope_type": "dynamic", "factor": 3.0, "rope_theta": 100.0},
        ),
    ),
]
IDS = [c[0] for c in CASES]


def _pair(case):
    """(transformers' model, npattn's model from the raw config dict)."""
    _, cfg_cls, model_cls, model_type, keys = case
    hf, _ = build(getattr(T, cfg_cls), getattr(T, model_cls), **copy.deepcopy(keys))  # transformers edits dicts
    raw = dict(copy.deepcopy(keys), model_type=model_type)
    return hf, CausalLM.from_hf(state_dict(hf), raw)


def _hf_logits(hf, ids):
    import torch

    with float64_reference(), torch.no_grad():
        return hf(input_ids=torch.from_numpy(ids), use_cache=False).logits.numpy()


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_logits_equal_transformers_from_the_raw_config(case):
    hf, m = _pair(case)
    ids = np.random.default_rng(0).integers(0, TINY["vocab_size"], (2, 11))
    with no_grad():
        ours = m(ids)
    assert rel_err(ours, _hf_logits(hf, ids), floor=1e-300, relative_to="max_b") < 1e-9


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_the_rope_dict_is_the_one_transformers_standardizes(case):
    """The dict npattn builds from equals transformers' standardized one (plus the length that
    npattn's dynamic NTK reads from its own dict)."""
    _, cfg_cls, _, model_type, keys = case
    hf_cfg = getattr(T, cfg_cls)(**copy.deepcopy(keys))
    ours = config_from_hf(dict(copy.deepcopy(keys), model_type=model_type)).rope
    theirs = hf_cfg.rope_parameters
    if model_type != "gemma3_text":
        theirs = {"default": theirs}
    for kind, params in theirs.items():
        expected = {k: v for k, v in params.items() if k != "type"}
        if expected["rope_type"] == "dynamic":
            expected["max_position_embeddings"] = hf_cfg.max_position_embeddings
        assert ours[kind] == expected, kind


def test_the_old_key_beside_the_new_changed_the_model():
    """Guards the oracle: without rope_scaling the logits differ (the case is not vacuous)."""
    case = CASES[0]
    keys = {k: v for k, v in case[4].items() if k != "rope_scaling"}
    _, m_plain = _pair((case[0], case[1], case[2], case[3], keys))
    hf, m = _pair(case)
    ids = np.random.default_rng(0).integers(0, TINY["vocab_size"], (1, 11))
    with no_grad():
        assert rel_err(m_plain(ids), m(ids), floor=1e-300, relative_to="max_b") > 1e-6


DYNAMIC = next(c for c in CASES if c[0] == "qwen3_dynamic")


def test_dynamic_ntk_within_and_beyond_max_position_embeddings():
    """transformers' dynamic RoPE: up to max_position_embeddings (8) the plain frequencies, beyond
    them a base stretched for the sequence's length; a sequence shorter than 8 after a long one
    goes back to the plain frequencies.  One model of each, calls in the same order."""
    hf, m = _pair(DYNAMIC)
    rng = np.random.default_rng(1)
    for length in (5, 8, 13, 21, 6):
        ids = rng.integers(0, TINY["vocab_size"], (2, length))
        with no_grad():
            ours = m(ids)
        assert rel_err(ours, _hf_logits(hf, ids), floor=1e-300, relative_to="max_b") < 1e-9, length
    # the guard: beyond 8 the stretched base does change the logits
    plain = dict(DYNAMIC[4], rope_parameters={"rope_type": "default", "rope_theta": 100.0})
    _, m_plain = _pair(DYNAMIC[:4] + (plain,))
    ids = rng.integers(0, TINY["vocab_size"], (1, 13))
    with no_grad():
        assert rel_err(m_plain(ids)[:, :8], m(ids)[:, :8], floor=1e-300, relative_to="max_b") > 1e-6


def test_dynamic_ntk_cached_decoding_past_max_position_embeddings():
    """Decoding one token at a time from 5 to 12 tokens with each side's KV cache: every step past
    max_position_embeddings rotates its new query and key with the frequencies of its own length,
    the cached keys keeping theirs, in both."""
    import torch

    hf, m = _pair(DYNAMIC)
    ids = np.random.default_rng(2).integers(0, TINY["vocab_size"], (1, 12))
    with no_grad():
        ours = [m(ids[:, :5], use_cache=True)] + [m(ids[:, t : t + 1], use_cache=True) for t in range(5, 12)]
    theirs = []
    with float64_reference(), torch.no_grad():
        out = hf(input_ids=torch.from_numpy(ids[:, :5]), use_cache=True)
        theirs.append(out.logits.numpy())
        for t in range(5, 12):
            out = hf(input_ids=torch.from_numpy(ids[:, t : t + 1]), cache=out.cache, use_cache=True)
            theirs.append(out.logits.numpy())
    assert (
        rel_err(np.concatenate(ours, axis=1), np.concatenate(theirs, axis=1), floor=1e-300, relative_to="max_b") < 1e-9
    )

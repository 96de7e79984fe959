"""CausalLM against transformers' own models (eager attention, float64): logits to 1e-9, every
parameter's gradient to 1e-8 under its Hugging Face name, and KV-cache decoding equal to the full
pass, for each family.  Skipped without torch/transformers."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from _hf64 import build, check_logits_and_grads, state_dict  # noqa: E402
from _oracles import rel_err  # noqa: E402

from npattn import no_grad  # noqa: E402
from npattn.models import CausalLM, config_from_hf  # noqa: E402

T = pytest.importorskip("transformers")

# tiny configs of each family, exercising its options (windows shorter than the sequence,
# grouped-query attention, biases, tied heads, softcapping...)
FAMILIES = {
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            vocab_size=61,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            attention_bias=True,
            mlp_bias=True,
            rope_theta=500.0,
        ),
    ),
    "llama_tied": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            vocab_size=61,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            tie_word_embeddings=True,
            pad_token_id=0,
        ),
    ),
    "llama3_rope_scaling": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            vocab_size=61,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=64,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 5000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8,
            },
        ),
    ),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(
            vocab_size=61,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=3,
            rope_theta=1e6,
        ),
    ),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            vocab_size=61,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            query_pre_attn_scalar=16,
            sliding_window=3,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=20.0,
            pad_token_id=0,
        ),
    ),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(
            vocab_size=61,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=3,
            max_window_layers=1,
            rms_norm_eps=1e-5,
        ),
    ),
    # SmolLM3: the default NoPE layer (every fourth: the last of four) sliding through a window of 3
    # keys (use_sliding_window), biases on the MLP, untied (attention_bias: tests/test_smollm3.py, as
    # a NoPE layer's k_proj.bias has a gradient of exactly zero, which a relative comparison cannot take)
    "smollm3": (
        "SmolLM3Config",
        "SmolLM3ForCausalLM",
        dict(
            vocab_size=61,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=3,
            mlp_bias=True,
            tie_word_embeddings=False,
            rope_theta=500.0,
            pad_token_id=0,
        ),
    ),
    # SmolLM3 with its own no_rope_layers (the first and last layers NoPE: no interval gives that),
    # every layer full, one key/value head, a tied head
    "smollm3_no_rope_layers": (
        "SmolLM3Config",
        "SmolLM3ForCausalLM",
        dict(
            vocab_size=61,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=1,
            no_rope_layers=[0, 1, 1, 0],
            rope_parameters={"rope_type": "default", "rope_theta": 300.0},
            pad_token_id=0,
        ),
    ),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(
            vocab_size=61,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            use_sliding_window=True,
            sliding_window=3,
            max_window_layers=1,
            tie_word_embeddings=True,
            rms_norm_eps=1e-5,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            vocab_size=61,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=12,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=12,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            rms_norm_eps=1e-5,
        ),
    ),
    "qwen3_moe_window_unnormalised": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            vocab_size=61,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=12,
            decoder_sparse_step=2,
            use_sliding_window=True,
            sliding_window=3,
            tie_word_embeddings=True,
        ),
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            vocab_size=61,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            query_pre_attn_scalar=8,
            sliding_window=3,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            attn_logit_softcapping=20.0,
            final_logit_softcapping=15.0,
            pad_token_id=0,
        ),
    ),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            vocab_size=61,
            hidden_size=32,
            intermediate_size=24,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            sliding_window=3,
            num_local_experts=4,
            num_experts_per_tok=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
        ),
    ),
    "gpt_oss_yarn": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            vocab_size=61,
            hidden_size=32,
            intermediate_size=24,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            sliding_window=3,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=256,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 8.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 32,
                "rope_theta": 1000.0,
            },
        ),
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            vocab_size=61,
            hidden_size=32,
            intermediate_size=40,
            moe_intermediate_size=12,
            num_hidden_layers=3,
            first_k_dense_replace=1,
            num_attention_heads=4,
            num_key_value_heads=4,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
            q_lora_rank=16,
            kv_lora_rank=12,
            qk_nope_head_dim=6,
            qk_rope_head_dim=4,
            v_head_dim=8,
        ),
    ),
    "deepseek_v3_yarn": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            vocab_size=61,
            hidden_size=32,
            intermediate_size=40,
            moe_intermediate_size=12,
            num_hidden_layers=2,
            first_k_dense_replace=1,
            num_attention_heads=4,
            num_key_value_heads=4,
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
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    "deepseek_v3_no_q_lora": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            vocab_size=61,
            hidden_size=32,
            intermediate_size=40,
            moe_intermediate_size=12,
            num_hidden_layers=2,
            first_k_dense_replace=0,
            num_attention_heads=4,
            num_key_value_heads=4,
            n_routed_experts=4,
            n_shared_experts=2,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            norm_topk_prob=False,
            q_lora_rank=None,
            kv_lora_rank=12,
            qk_nope_head_dim=6,
            qk_rope_head_dim=4,
            v_head_dim=8,
            rope_interleave=False,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3_next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        dict(
            vocab_size=61,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            linear_conv_kernel_dim=3,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=12,
            shared_expert_intermediate_size=16,
            mlp_only_layers=[1],
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            partial_rotary_factor=0.5,
        ),
    ),
    # LFM2: short convolutions (4 taps, biases on them and their projections) around an attention
    # layer, the MLP's width adjusted (int(1.5 * int(2 * 40 / 3)) = 39, rounded up to 40), untied
    "lfm2": (
        "Lfm2Config",
        "Lfm2ForCausalLM",
        dict(
            vocab_size=61,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            layer_types=["conv", "full_attention", "conv"],
            conv_L_cache=4,
            conv_bias=True,
            block_multiple_of=8,
            block_ffn_dim_multiplier=1.5,
            tie_word_embeddings=False,
            norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
        ),
    ),
    # LFM2 from full_attn_idxs, the MLP's width not adjusted, a tied head
    "lfm2_full_attn_idxs": (
        "Lfm2Config",
        "Lfm2ForCausalLM",
        dict(
            vocab_size=61,
            hidden_size=32,
            intermediate_size=24,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=1,
            full_attn_idxs=[0, 2],
            block_auto_adjust_ff_dim=False,
            pad_token_id=0,
        ),
    ),
    # Granite 3.x: Llama's layer with its four numbers away from 1 (the embeddings times 6, each
    # residual branch times 0.3, the scores times 0.2 instead of 1/sqrt(8), the logits over 4),
    # biases, grouped heads, untied
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        dict(
            vocab_size=61,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            attention_bias=True,
            mlp_bias=True,
            embedding_multiplier=6.0,
            residual_multiplier=0.3,
            attention_multiplier=0.2,
            logits_scaling=4.0,
            rope_theta=500.0,
        ),
    ),
    "granite_tied": (
        "GraniteConfig",
        "GraniteForCausalLM",
        dict(
            vocab_size=61,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=6,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.015625,
            logits_scaling=8.0,
            tie_word_embeddings=True,
            pad_token_id=0,
        ),
    ),
    # Granite MoE: the same numbers, 3 of 5 routed experts per token (the top 3 logits softmaxed
    # among themselves), attention biases, untied
    "granitemoe": (
        "GraniteMoeConfig",
        "GraniteMoeForCausalLM",
        dict(
            vocab_size=61,
            hidden_size=32,
            intermediate_size=12,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=5,
            num_experts_per_tok=3,
            attention_bias=True,
            embedding_multiplier=5.0,
            residual_multiplier=0.4,
            attention_multiplier=0.25,
            logits_scaling=3.0,
            rope_theta=500.0,
        ),
    ),
    # EXAONE 4.0-32B's hybrid at four layers: three sliding layers (a window of 3, RoPE) then a full
    # one without RoPE (layer_types, beside its "LLLG" pattern), grouped heads, Llama 3's RoPE
    # scaling (pairs kept, divided, in between), untied
    "exaone4": (
        "Exaone4Config",
        "Exaone4ForCausalLM",
        dict(
            vocab_size=61,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=3,
            sliding_window_pattern="LLLG",
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 1000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    # EXAONE 4.0-1.2B's shape: no window, every layer full and rotating, a tied head
    "exaone4_1_2b": (
        "Exaone4Config",
        "Exaone4ForCausalLM",
        dict(
            vocab_size=61,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            sliding_window=None,
            layer_types=["full_attention"] * 2,
            tie_word_embeddings=True,
            rope_theta=500.0,
            pad_token_id=0,
        ),
    ),
    # ERNIE 4.5: RoPE on interleaved pairs (2i, 2i+1), use_bias on the seven projections, grouped
    # heads wider than hidden / heads, untied
    "ernie4_5": (
        "Ernie4_5Config",
        "Ernie4_5ForCausalLM",
        dict(
            vocab_size=61,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=12,
            use_bias=True,
            tie_word_embeddings=False,
            rope_theta=500.0,
        ),
    ),
    # ERNIE 4.5 as released: no biases, one KV head, the tied head, the 500000 base, a pad row; and
    # its interleaved pairs under YaRN's scaled frequencies and attention factor
    "ernie4_5_tied": (
        "Ernie4_5Config",
        "Ernie4_5ForCausalLM",
        dict(
            vocab_size=61,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=8,
            pad_token_id=0,
        ),
    ),
    # Ministral 3: YaRN over 3 original positions, the queries scaled by 1 + 0.3 log(1 + floor(p / 3))
    # (1 up to position 2, then larger: the 9 positions of the tests cross two steps); grouped
    # heads wider than hidden / heads; and with a window of 3 keys on every layer (sliding_window)
    "ministral3": (
        "Ministral3Config",
        "Ministral3ForCausalLM",
        dict(
            vocab_size=61,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=12,
            max_position_embeddings=64,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 1000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 3,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "llama_4_scaling_beta": 0.3,
            },
        ),
    ),
    "ministral3_window": (
        "Ministral3Config",
        "Ministral3ForCausalLM",
        dict(
            vocab_size=61,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=8,
            sliding_window=3,
            max_position_embeddings=32,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 500.0,
                "factor": 8.0,
                "original_max_position_embeddings": 2,
                "llama_4_scaling_beta": 1.0,
            },
        ),
    ),
    # Ministral (8B-2410): layer_types naming a sliding layer (a window of 3) and a full one
    "ministral": (
        "MinistralConfig",
        "MinistralForCausalLM",
        dict(
            vocab_size=61,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=12,
            sliding_window=3,
            layer_types=["full_attention", "sliding_attention"],
            rope_theta=500.0,
        ),
    ),
    # Arcee: Llama's layers with the non-gated relu2 MLP (its biases), grouped heads wider than
    # hidden / heads, YaRN; and as AFM-4.5B is released: rope_scaling with the older "type", mscale,
    # no biases, one KV head
    "arcee": (
        "ArceeConfig",
        "ArceeForCausalLM",
        dict(
            vocab_size=61,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=12,
            attention_bias=True,
            mlp_bias=True,
            max_position_embeddings=64,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 1000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 4,
            },
        ),
    ),
    "arcee_released": (
        "ArceeConfig",
        "ArceeForCausalLM",
        dict(
            vocab_size=61,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=64,
            rope_scaling={
                "type": "yarn",
                "rope_type": "yarn",
                "factor": 20.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "original_max_position_embeddings": 4,
            },
            rope_theta=10000.0,
        ),
    ),
    # Command R7B: a full layer (no RoPE) before a sliding one (interleaved RoPE, a window of 3),
    # one KV head, the logits times 0.7, an untied head
    "cohere2": (
        "Cohere2Config",
        "Cohere2ForCausalLM",
        dict(
            vocab_size=61,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            sliding_window=3,
            layer_types=["full_attention", "sliding_attention"],
            logit_scale=0.7,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        ),
    ),
    # Command R (R+'s q/k norms): head_dim 6 (not hidden / heads), attention biases, the logits times
    # 0.2, a tied head
    "cohere": (
        "CohereConfig",
        "CohereForCausalLM",
        dict(
            vocab_size=61,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=6,
            attention_bias=True,
            use_qk_norm=True,
            logit_scale=0.2,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        ),
    ),
    # Apertus: per-head q/k norms, biases on q, k, v, o, the xIELU MLP (its two parameters and, drawn
    # at random, its beta and eps buffers), grouped heads of 12, Llama 3's scaling; and ApertusConfig's
    # default RoPE (llama3 at base 12e6), one KV head, no biases
    "apertus": (
        "ApertusConfig",
        "ApertusForCausalLM",
        dict(
            vocab_size=61,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=12,
            attention_bias=True,
            max_position_embeddings=64,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 1000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 4,
                "low_freq_factor": 1.0,
                "high_freq_factor": 2.0,
            },
        ),
    ),
    "apertus_default_rope": (
        "ApertusConfig",
        "ApertusForCausalLM",
        dict(
            vocab_size=61,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
        ),
    ),
    "ernie4_5_yarn": (
        "Ernie4_5Config",
        "Ernie4_5ForCausalLM",
        dict(
            vocab_size=61,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=64,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 1000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 4,
            },
        ),
    ),
    # Hunyuan dense: RoPE, then the QK-norm of each rotated head; NTK-alpha RoPE as the releases
    # write it ("dynamic" with an alpha, YaRN's keys beside it unread), grouped heads wider than
    # hidden / heads, the attention's biases; and without biases under the default RoPE, tied
    "hunyuan_v1_dense": (
        "HunYuanDenseV1Config",
        "HunYuanDenseV1ForCausalLM",
        dict(
            vocab_size=61,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=12,
            attention_bias=True,
            rope_parameters={
                "rope_type": "dynamic",
                "alpha": 1000.0,
                "factor": 1.0,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "rope_theta": 10000.0,
            },
        ),
    ),
    "hunyuan_v1_dense_tied": (
        "HunYuanDenseV1Config",
        "HunYuanDenseV1ForCausalLM",
        dict(
            vocab_size=61,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=8,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        ),
    ),
}


def _family(name):
    cfg_cls, model_cls, kwargs = FAMILIES[name]
    hf, cfg = build(getattr(T, cfg_cls), getattr(T, model_cls), **kwargs)
    return hf, cfg


def _ids(vocab, shape=(2, 7), seed=0):
    ids = np.random.default_rng(seed).integers(0, vocab, shape)
    ids[0, 1] = 0  # the padding row (when there is one) is looked up too
    return ids


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_logits_and_every_gradient_match_transformers(name):
    hf, cfg = _family(name)
    m = CausalLM.from_hf(state_dict(hf), cfg)
    assert m.dtype == np.float64
    ids = _ids(cfg["vocab_size"])
    check_logits_and_grads(m, hf, ids, np.random.default_rng(1).standard_normal(ids.shape + (cfg["vocab_size"],)))


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_cached_decoding_gives_the_full_pass(name):
    hf, cfg = _family(name)
    m = CausalLM.from_hf(state_dict(hf), cfg)
    ids = _ids(cfg["vocab_size"], (2, 9), seed=3)
    with no_grad():
        full = m(ids)
    m.reset_kv_cache()
    parts = [m(ids[:, :4], use_cache=True)] + [m(ids[:, t : t + 1], use_cache=True) for t in range(4, 9)]
    assert rel_err(np.concatenate(parts, axis=1), full, floor=1e-300, relative_to="max_b") < 1e-12
    m.reset_kv_cache()
    again = m(ids[:, :2], use_cache=True)
    assert rel_err(again, full[:, :2], floor=1e-300, relative_to="max_b") < 1e-12


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_state_dict_round_trip_uses_hf_names(name):
    hf, cfg = _family(name)
    sd = state_dict(hf)
    m = CausalLM.from_hf(sd, cfg)
    mine = m.state_dict()
    if cfg.get("tie_word_embeddings"):
        sd.pop("lm_head.weight")  # listed once, as save_pretrained does
    assert set(mine) == set(sd)
    for k, v in sd.items():
        np.testing.assert_array_equal(mine[k], v)


@pytest.mark.parametrize(
    "name",
    [
        "llama",
        "mistral",
        "qwen2",
        "gemma2",
        "olmo2",
        "smollm3",
        "granite",
        "granitemoe",
        "lfm2",
        "lfm2_moe",
        "falcon_h1",
        "nemotron_h",
        "nemotron_h_moe",
        "mamba2",
        "exaone4",
        "ernie4_5",
        "arcee",
        "glm4",
        "apertus",
        "ministral3",
        "ministral",
        "hunyuan_v1_dense",
        "qwen3",
        "gemma3_text",
        "gpt_oss",
        "deepseek_v3",
        "qwen3_next",
        "cohere2",
        "cohere",
    ],
)
def test_short_config_dicts_mean_what_they_mean_to_transformers(name):
    """A hand-written dict that leaves keys out reads as transformers reads it: the same
    CausalLMConfig as the full to_dict() of transformers' config built from it."""
    from _families import FAMILIES as SHORT

    short = SHORT[name]
    full = T.AutoConfig.for_model(**short).to_dict()
    meta = dict(bos_token_id=None, eos_token_id=None, max_position_embeddings=None)  # not the network
    a, b = config_from_hf(short), config_from_hf(full)
    assert a.replace(**meta) == b.replace(**meta)
    for key in ("routed_scaling_factor", "norm_topk_prob", "n_group", "swiglu_limit", "linear_conv_kernel_dim"):
        if key in full:
            assert a.hf[key] == full[key], key


def test_qwen3_next_over_several_delta_rule_chunks():
    """70 tokens: both sides run the chunked delta rule over two chunks of 64."""
    hf, cfg = _family("qwen3_next")
    m = CausalLM.from_hf(state_dict(hf), cfg)
    ids = _ids(cfg["vocab_size"], (1, 70), seed=5)
    check_logits_and_grads(m, hf, ids, np.random.default_rng(6).standard_normal(ids.shape + (cfg["vocab_size"],)))

"""CausalLM.from_gguf: tiny GGUF files written with gguf's own GGUFWriter (quantized by
gguf.quants.quantize, or raw random blocks for the K-quants it cannot quantize) load with the
source model's weights as llama.cpp's converter wrote them (its q/k permutation undone) and the
source model's logits."""

from __future__ import annotations

import functools
import json
import math
import sys

import numpy as np
import pytest
from _families import FAMILIES
from _hf64 import transformers_or_none
from test_causal_lm_io import _model

from npattn import no_grad
from npattn.models import CausalLM

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
T = transformers_or_none()  # the oracle tests marked one by one (the others run without torch)

# hidden and intermediate sizes of 256: a K-quant block is 256 values of a row
LLAMA = dict(FAMILIES["llama"], hidden_size=256, intermediate_size=256, attention_bias=False, num_attention_heads=4)
QWEN3 = dict(FAMILIES["qwen3"], hidden_size=256, intermediate_size=256, head_dim=64, use_sliding_window=False)
QWEN3.pop("sliding_window"), QWEN3.pop("max_window_layers")
# Qwen2/2.5: biases on q, k and v (llama.cpp's qwen2 files hold them), none on o
QWEN2 = dict(FAMILIES["qwen2"], hidden_size=256, intermediate_size=256, use_sliding_window=False)
QWEN2.pop("sliding_window"), QWEN2.pop("max_window_layers")
# every layer routed (llama.cpp's qwen3moe), the experts' rows 256 wide too
QWEN3_MOE = dict(FAMILIES["qwen3_moe"], hidden_size=256, intermediate_size=256, head_dim=64, moe_intermediate_size=256)
QWEN3_MOE.pop("mlp_only_layers")
# Mixtral: a llama file with experts (q/k permuted, every layer routed, the top 2 of 4 renormalised)
MIXTRAL = dict(FAMILIES["mixtral"], hidden_size=256, intermediate_size=256, head_dim=64, rms_norm_eps=1e-5)
MIXTRAL.pop("sliding_window")
# Qwen1.5-MoE / Qwen2-MoE: every layer routed beside the gated shared expert (llama.cpp's qwen2moe has
# no dense layers), the top k unnormalised, biases on q, k and v
QWEN2_MOE = dict(
    FAMILIES["qwen2_moe"],
    hidden_size=256,
    intermediate_size=256,
    moe_intermediate_size=256,
    shared_expert_intermediate_size=256,
    use_sliding_window=False,
)
for _key in ("mlp_only_layers", "sliding_window", "max_window_layers"):
    QWEN2_MOE.pop(_key)
# OLMoE: q/k norms over the whole projection (llama.cpp's are hidden_size wide: as many kv heads
# as heads), no biases (llama.cpp's olmoe has none on o), the top 2 of 4 unnormalised
OLMOE = dict(
    FAMILIES["olmoe"],
    hidden_size=256,
    intermediate_size=256,
    num_key_value_heads=4,
    attention_bias=False,
    rms_norm_eps=1e-5,
)
# six layers: llama.cpp's pattern makes the sixth full and the others sliding; linear RoPE scaling
# on the full layers, the sliding layers' own base
GEMMA3 = dict(
    FAMILIES["gemma3_text"],
    hidden_size=256,
    intermediate_size=256,
    num_hidden_layers=6,
    head_dim=64,
    query_pre_attn_scalar=64,
    rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 300.0},
    },
)
GEMMA3.pop("layer_types")
# Gemma 2: four layers (llama.cpp's alternation), a score softcap, Gemma's 1 + w norms
GEMMA2 = dict(
    FAMILIES["gemma2"],
    hidden_size=256,
    intermediate_size=256,
    num_hidden_layers=4,
    head_dim=64,
    query_pre_attn_scalar=64,
    attn_logit_softcapping=20.0,
    final_logit_softcapping=35.0,
)

# SmolLM3: four layers, the fourth NoPE (llama.cpp's fixed step of 4, SmolLM3Config's default);
# a llama file (q/k permuted), the head tied
SMOLLM3 = dict(FAMILIES["smollm3"], hidden_size=256, intermediate_size=256, use_sliding_window=False)
SMOLLM3.pop("no_rope_layer_interval"), SMOLLM3.pop("sliding_window")

# Phi-3 (Phi-4-mini's shape: the head tied, no window): LongRoPE over three quarters of each head
# (24 pairs), its switch at 4 positions (the tests' sequences of 6 and 7 cross it), q/k/v and
# gate/up fused in the file as in the checkpoint
PHI3 = dict(
    FAMILIES["phi3"],
    hidden_size=256,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_scaling={
        "rope_type": "longrope",
        "short_factor": [1.0 + i / 32 for i in range(24)],  # float32 numbers: the converter's tensors
        "long_factor": [1.5 + i / 4 for i in range(24)],
    },
)

# Phi-3-mini's shape: an untied head, a window on every layer (llama.cpp turns it off; transformers,
# and so npattn, masks with it)
PHI3_MINI = dict(PHI3, tie_word_embeddings=False, sliding_window=3)

# Granite 3.x: a llama file (q/k rows and biases permuted, the MLP's biases) with Granite's four
# numbers, each one float32 holds exactly (the file stores float32); the head tied
GRANITE = dict(
    FAMILIES["granite"],
    hidden_size=256,
    intermediate_size=256,
    embedding_multiplier=3.0,
    residual_multiplier=0.5,
    attention_multiplier=0.375,
    logits_scaling=2.5,
)
# Granite MoE: every layer 2 of 4 routed experts 256 wide; the released checkpoint's fused
# input_linear split by the converter into ffn_gate_exps and ffn_up_exps; the head untied
GRANITE_MOE = dict(
    FAMILIES["granitemoe"],
    hidden_size=256,
    intermediate_size=256,
    residual_multiplier=0.75,
    attention_multiplier=0.4375,
    tie_word_embeddings=False,
)
# GraniteMoeShared: Granite MoE's experts (2 of 4) and a shared MLP 256 wide, which the converter
# writes as ffn_gate_shexp / ffn_up_shexp (input_linear's halves) and ffn_down_shexp in a granitemoe file
GRANITE_SHARED = dict(
    FAMILIES["granitemoeshared"],
    hidden_size=256,
    intermediate_size=256,
    shared_intermediate_size=256,
    embedding_multiplier=1.25,
    residual_multiplier=0.75,
    attention_multiplier=0.4375,
)
# Granite 4.0 without Mamba layers (granite-4.0-micro's kind): GraniteHybridModel writes a granite
# file, the shared MLP as ffn_gate / ffn_up / ffn_down, with the Mamba keys and a head_count_kv per layer
GRANITE4 = dict(
    {k: v for k, v in FAMILIES["granitemoehybrid"].items() if not k.startswith("mamba_")},  # the tiny one is hybrid
    layer_types=["attention", "attention"],
    position_embedding_type="rope",
    num_local_experts=0,
    num_experts_per_tok=0,
    mamba_n_heads=8,
    hidden_size=256,
    intermediate_size=256,
    shared_intermediate_size=256,
    attention_multiplier=0.375,
    residual_multiplier=0.5,
)
# ... and with experts (2 of 3): a granitemoe file with the shared MLP as ffn_*_shexp
GRANITE4_MOE = dict(GRANITE4, num_local_experts=3, num_experts_per_tok=2, tie_word_embeddings=False)
# Granite 4.0's hybrids (granite-4.0-h-*): a Mamba-2 layer (8 heads of 64 over the inner width 512,
# 2 groups of B, C of 16, 4 taps, the convolution's bias) then an attention layer, no RoPE, 2 of 4
# routed experts beside the shared MLP; GraniteHybridModel writes a granitehybrid file (head_count_kv
# 0 on the Mamba-2 layer, its sizes ssm.*), the chunk size none (transformers' 256 read back)
GRANITE4_HYBRID = dict(
    FAMILIES["granitemoehybrid"],
    hidden_size=256,
    intermediate_size=256,
    shared_intermediate_size=256,
    mamba_n_heads=8,
    mamba_d_head=64,
    mamba_n_groups=2,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_chunk_size=256,
    attention_multiplier=0.375,  # numbers float32 holds exactly (the file's)
    residual_multiplier=0.5,
)
# ... an attention layer first (with biases: q/k's permuted) then two Mamba-2 layers with the
# projections' biases and no convolution bias (the converter's ssm_in.bias, ssm_out.bias), RoPE,
# the shared MLP alone: a granitehybrid file too
GRANITE4_HYBRID_BIASES = dict(
    GRANITE4_HYBRID,
    num_hidden_layers=3,
    layer_types=["attention", "mamba", "mamba"],
    attention_bias=True,
    mamba_proj_bias=True,
    mamba_conv_bias=False,
    position_embedding_type="rope",
    num_local_experts=0,
    num_experts_per_tok=0,
    tie_word_embeddings=False,
)
# LFM2: a short convolution (3 taps), an attention layer, another convolution; the MLP's width
# adjusted (int(2 * 384 / 3) = 256), which the file stores as its feed_forward_length; tied
LFM2 = dict(
    FAMILIES["lfm2"],
    hidden_size=256,
    intermediate_size=384,
    num_hidden_layers=3,
    layer_types=["conv", "full_attention", "conv"],
)
# LFM2-MoE: a short convolution with a dense MLP, then routed experts (2 of 4, sigmoid scores
# through the expert bias) after an attention layer and a convolution; tied (gguf's lfm2moe
# tensors have no output.weight: the converter writes LFM2-8B-A1B's tied head only)
LFM2_MOE = dict(
    FAMILIES["lfm2_moe"],
    hidden_size=256,
    intermediate_size=256,
    moe_intermediate_size=256,
    num_hidden_layers=3,
    layer_types=["conv", "full_attention", "conv"],
    routed_scaling_factor=1.0,  # llama.cpp's lfm2moe never scales the weights
)
# OLMo 2: post-norm layers, q/k norms over the whole projection, no biases (llama.cpp's olmo2 has
# none), an untied head
OLMO2 = dict(
    FAMILIES["olmo2"],
    hidden_size=256,
    intermediate_size=256,
    attention_bias=False,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
# OLMo 2 with YaRN on every layer (no window: llama.cpp's olmo2 scales every layer's RoPE)
OLMO2_YARN = dict(
    OLMO2,
    rope_scaling={
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "attention_factor": 1.25,
        "beta_fast": 8.0,
        "beta_slow": 0.5,
    },
)
# OLMo 3 (an olmo2 file with a window): four layers whose pattern is not llama.cpp's period of 4
# (the file's booleans are read), YaRN on the full layer over a ramp of kept, mixed and
# interpolated pairs, the sliding layers' plain RoPE of the same base (the converter writes one)
OLMO3 = dict(
    FAMILIES["olmo3"],
    hidden_size=256,
    intermediate_size=256,
    attention_bias=False,
    rms_norm_eps=1e-5,
    num_hidden_layers=4,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
    rope_parameters={
        "full_attention": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "attention_factor": 1.25,
            "beta_fast": 8.0,
            "beta_slow": 0.5,
            "rope_theta": 5000.0,
        },
        "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0},
    },
)

# EXAONE 4.0: four layers, the fourth full and without RoPE (sliding_window_pattern 4, the 32B's),
# the others sliding through a window of 3; Llama 3's scaling of the releases (factor 16) stored as
# rope_freqs.weight; tied.  And the 1.2B's kind: no window, every layer full and rotating
EXAONE4 = dict(
    {k: v for k, v in FAMILIES["exaone4"].items() if k != "rope_parameters"},
    hidden_size=256,
    intermediate_size=256,
    head_dim=64,
    num_hidden_layers=4,
    sliding_window_pattern=4,
    rms_norm_eps=1e-5,
    rope_theta=1000000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 16.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)
EXAONE4_1_2B = dict(EXAONE4, num_hidden_layers=2, sliding_window=None, layer_types=["full_attention"] * 2)
# ERNIE 4.5: RoPE on the pairs (2i, 2i+1), llama.cpp's own (the converter does not permute), heads
# of 128 (ERNIE-4.5-0.3B's: wider than hidden / heads, the file's key_length), no biases, tied
ERNIE4_5 = dict(
    FAMILIES["ernie4_5"], hidden_size=256, intermediate_size=256, head_dim=128, use_bias=False, rms_norm_eps=1e-5
)
# Arcee (AFM-4.5B): llama rows (permuted), the non-gated relu2 MLP (ffn_up, ffn_down; llama.cpp's
# arcee reads no biases), YaRN of factor 4 over 8 original positions at base 1000 (its betas the
# defaults, which the converter does not write); untied
# GPT-NeoX (Pythia): 64-wide heads, a quarter rotating; the converter writes no RoPE base (llama.cpp's 10000)
GPTNEOX = dict(
    FAMILIES["gpt_neox"], hidden_size=256, intermediate_size=256, rotary_pct=0.25, rotary_emb_base=10000.0,
    layer_norm_eps=2**-17,
)  # fmt: skip
# Phi-2: 64-wide heads, half of each rotating, the MLP 4 * hidden wide (the converter's feed_forward_length),
# as many key/value heads as heads (its head_count_kv) and the base 10000 (it writes none)
PHI2 = dict(
    FAMILIES["phi"], hidden_size=256, intermediate_size=1024, layer_norm_eps=2**-17, num_key_value_heads=None,
    rope_theta=10000.0,
)  # fmt: skip
# StarCoder2: 4 heads of 64 over 2 key/value heads, biases everywhere, the plain tanh-GELU MLP, a
# tied head; no window (the converter writes none: llama.cpp's starcoder2 attends to the whole past)
STARCODER2 = dict(
    FAMILIES["starcoder2"], hidden_size=256, intermediate_size=512, norm_epsilon=2**-17, rope_theta=10000.0,
    sliding_window=None,
)  # fmt: skip
# StableLM 2 1.6B: heads of 64 (as many key/value heads), a quarter rotating, q/k/v biases, the
# sequential residual; the converter writes no RoPE base (llama.cpp's 10000)
STABLELM2 = dict(
    FAMILIES["stablelm"], hidden_size=256, intermediate_size=256, num_key_value_heads=4, partial_rotary_factor=0.25,
    rope_theta=10000.0, layer_norm_eps=2**-17, use_qkv_bias=True, qk_layernorm=False, use_parallel_residual=False,
)  # fmt: skip
# StableLM 2 12B: 8 heads of 32 over 2 key/value heads, the per-head q/k LayerNorms (attn_q_norm (8, 32),
# attn_k_norm (2, 32): heads and width differ), the parallel residual (no ffn_norm), no biases; half of
# each head rotating (not StableLmConfig's default quarter: the file's rope.dimension_count says it)
STABLELM2_12B = dict(
    STABLELM2, num_attention_heads=8, num_key_value_heads=2, use_qkv_bias=False, qk_layernorm=True,
    use_parallel_residual=True, partial_rotary_factor=0.5,
)  # fmt: skip
# GPT-2: 64-wide heads, the MLP 4 * hidden wide (the converter's feed_forward_length), 128 positions
GPT2 = dict(FAMILIES["gpt2"], hidden_size=256, n_inner=1024, layer_norm_epsilon=2**-17)
ARCEE = dict(
    FAMILIES["arcee"], hidden_size=256, intermediate_size=256, head_dim=64, mlp_bias=False, rms_norm_eps=2.0**-17
)
ARCEE["rope_parameters"] = {k: v for k, v in ARCEE["rope_parameters"].items() if not k.startswith("beta")}
# The first OLMo: llama rows (permuted), LayerNorms without weight or bias (no norm tensor; eps
# 1e-5 as OlmoModel writes it), no biases (the converter permutes q/k weights, not biases), GQA, untied
OLMO = dict(
    FAMILIES["olmo"],
    hidden_size=256,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    attention_bias=False,
    tie_word_embeddings=False,
)
# OLMo-7B-0424's clip_qkv, written as olmo.attention.clamp_kqv: at 2 it holds about a quarter of q, k
# and v at a bound on these weights (the released 8.0 would hold none here)
OLMO_CLIP = dict(OLMO, clip_qkv=2.0)
# Apertus: q/k rows as the checkpoint's (ApertusModel's undo_permute False), per-head q/k norms, biases on
# q, k, v and o, the xIELU MLP whose raw alpha_p, alpha_n and beta, eps the converter writes as the
# per-layer arrays xielu.* (drawn apart per layer here); plain RoPE at base 1000 (a llama3 scaling
# would be rope_freqs.weight, read as for llama); untied (llama.cpp's apertus requires output.weight)
APERTUS = dict(
    FAMILIES["apertus"],
    hidden_size=256,
    intermediate_size=256,
    head_dim=64,
    rms_norm_eps=2.0**-17,
    rope_theta=1000.0,
    rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
)
# Ministral 3: llama rows (permuted), YaRN over 2 original positions and the queries' scale by
# position (attention.temperature_scale 0.5), so that the 7 positions of the tests cross it; untied
# GLM-4: heads of 64 (key_length), half of each rotating (rope.dimension_count 32) on interleaved
# pairs (not permuted), q/k/v biases, the norms after both sublayers, gate and up fused in ffn_up;
# an eps float32 holds (the file's)
GLM4 = dict(FAMILIES["glm4"], hidden_size=256, intermediate_size=256, head_dim=64, rms_norm_eps=2**-17)
MINISTRAL3 = dict(FAMILIES["ministral3"], hidden_size=256, intermediate_size=256, head_dim=64, rms_norm_eps=1e-5)
# Hunyuan dense: the QK-norm after RoPE; the releases' RoPE dict ("dynamic", alpha 1000 over base
# 10000, 32K positions: what the converter's HunYuanModel asserts), whose NTK-alpha base the file
# holds as rope.freq_base; biases on the attention's projections (llama.cpp's bq, bk, bv, bo)
HUNYUAN = dict(
    FAMILIES["hunyuan_v1_dense"],
    hidden_size=256,
    intermediate_size=256,
    head_dim=64,
    rms_norm_eps=1e-5,
    max_position_embeddings=32768,
    rope_parameters={"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0},
)
# Falcon-H1: attention (4 heads of 64, 2 key/value heads) and Mamba-2 (8 heads of 64 over the inner
# width 512, 2 groups of B, C of 16, 4 taps) side by side, the gated norm after the gate (llama.cpp's
# order), no projection biases (llama.cpp reads none); muP multipliers that are powers of two, which
# the converter's folds multiply in exactly (FalconH1Model.modify_tensors: _falcon_h1_folded)
FALCON_H1 = dict(
    FAMILIES["falcon_h1"],
    hidden_size=256,
    intermediate_size=256,
    head_dim=64,
    mamba_d_ssm=512,
    mamba_n_heads=8,
    mamba_d_head=64,
    mamba_n_groups=2,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_chunk_size=256,
    mamba_norm_before_gate=False,
    projectors_bias=False,
    rms_norm_eps=2.0**-17,  # one float32 holds (the file's)
    embedding_multiplier=2.0,
    lm_head_multiplier=0.25,
    key_multiplier=0.5,
    attention_in_multiplier=2.0,
    attention_out_multiplier=0.5,
    ssm_in_multiplier=0.25,
    ssm_out_multiplier=2.0,
    mlp_multipliers=[0.5, 4.0],
    ssm_multipliers=[0.5, 2.0, 0.25, 4.0, 0.125],
)
# ... with multipliers as the released checkpoints' (no powers of two: each fold one float32 rounding
# from the exact product), the MLP's biases (multiplied too), no gated norm, no convolution bias
# Nemotron-H (NVIDIA-Nemotron-Nano-9B-v2's kind): a Mamba-2 block (4 heads of 64, 2 groups of B, C of
# 16, 4 taps, the convolution's bias), an MLP block (relu2), an attention block (4 heads of 64, 2
# key/value heads, no RoPE: q/k permuted all the same), another Mamba-2 block; the chunk size the
# file's none (transformers' 256 read back), no step clipped (llama.cpp's scan: time_step_min 0)
NEMOTRON_H = dict(
    FAMILIES["nemotron_h"],
    vocab_size=48,
    hidden_size=256,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    hybrid_override_pattern="M-*M",
    mamba_num_heads=4,
    mamba_head_dim=64,
    n_groups=2,
    ssm_state_size=16,
    conv_kernel=4,
    chunk_size=256,
    time_step_min=0.0,
)
# Mamba-2 (mamba2-130m's kind): two blocks of a Mamba-2 mixer alone (4 heads of 128 in 2 groups of B, C
# of 16, 4 taps with their bias, expand 2 as the converter asserts), an untied head; the chunk size the
# file's none (transformers' 256 read back), no step clipped (llama.cpp's scan, transformers' default)
MAMBA2 = dict(
    FAMILIES["mamba2"],
    vocab_size=48,
    hidden_size=256,
    num_heads=4,
    head_dim=128,
    n_groups=2,
    state_size=16,
    conv_kernel=4,
    chunk_size=256,
)
# Nemotron 3 (Nano 30B-A3B's kind): NEMOTRON_H's Mamba-2 and attention blocks with two routed-experts
# blocks ("E": 2 of 4 relu2 experts, not gated, 256 wide, sigmoid scores with the choice bias, renormalised
# and scaled by 2.5, one group as the released model's) within a latent width of 512 (not the hidden
# 256: both latent projections rectangular), the relu2 shared expert; no dense MLP block (a
# nemotron_h_moe file's widths are experts' blocks)
NEMOTRON_H_MOE = dict(
    NEMOTRON_H,
    hybrid_override_pattern="ME*E",
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=256,
    moe_shared_expert_intermediate_size=256,
    moe_latent_size=512,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
)
# Command R7B: four layers, llama.cpp's period of 4 (three sliding, RoPE on those only, a window of
# 3; Cohere2Config's default pattern), heads of 64, interleaved RoPE pairs (not permuted), one
# bias-free LayerNorm a layer, the logits times 0.375 (float32 holds it and the epsilon), tied
COHERE2 = dict(
    FAMILIES["cohere2"],
    hidden_size=256,
    intermediate_size=256,
    num_hidden_layers=4,
    sliding_window_pattern=4,
    logit_scale=0.375,
    layer_norm_eps=2.0**-14,
)
# Command R+: every layer rotating, a LayerNorm of each head's q and k (attn_q_norm (4, 64),
# attn_k_norm (2, 64)), attention biases (the converter keeps them), the head tied (gguf's command-r
# has no output tensor: the converter cannot map an untied lm_head, llama.cpp reads none)
COMMAND_R_PLUS = dict(
    FAMILIES["cohere"],
    hidden_size=256,
    intermediate_size=256,
    logit_scale=0.25,
    layer_norm_eps=2.0**-14,
    tie_word_embeddings=True,
)
# Command R: no q/k norms, no biases
COMMAND_R = dict(COMMAND_R_PLUS, use_qk_norm=False, attention_bias=False)
FALCON_H1_ROUNDED = dict(
    FALCON_H1,
    embedding_multiplier=5.656854249492381,
    lm_head_multiplier=0.0390625 * 1.1,
    key_multiplier=0.390625 * 1.3,
    attention_in_multiplier=1.1,
    attention_out_multiplier=0.9375 * 1.05,
    ssm_in_multiplier=1.25 * 1.07,
    ssm_out_multiplier=0.2357,
    mlp_multipliers=[0.8838834764831844, 0.5859375 * 1.1],
    ssm_multipliers=[0.3535533905932738, 0.25 * 1.3, 0.3535533905932738, 0.5, 0.3535533905932738],
    mlp_bias=True,
    mamba_rms_norm=False,
    mamba_conv_bias=False,
)
# the multipliers FalconH1Model.modify_tensors multiplies into the weights (none in the metadata)
_FALCON_H1_MULTIPLIERS = (
    "embedding_multiplier",
    "lm_head_multiplier",
    "key_multiplier",
    "attention_in_multiplier",
    "attention_out_multiplier",
    "ssm_in_multiplier",
    "ssm_out_multiplier",
    "mlp_multipliers",
    "ssm_multipliers",
)

_GEMMAS = ("gemma2", "gemma3")  # the converter stores their norms as 1 + w
_COHERES = ("command-r", "cohere2")  # LayerNorms (attention.layer_norm_epsilon), the logits' scale
_MAMBA = ("mamba", "linear_attention")  # Granite 4.0's Mamba-2 layers (transformers 4's name and 5's)
_GRANITES = ("granite", "granitemoe", "granitehybrid")
# the model types whose checkpoints name the MoE block's tensors as the released granitemoe ones
_GRANITE_MOES = ("granitemoe", "granitemoeshared", "granitemoehybrid")
# the converter permutes their q/k rows and biases (LlamaModel.permute)
_PERMUTED = ("llama", "smollm3", "mistral3", "nemotron_h", "nemotron_h_moe", "arcee", "olmo", *_GRANITES)
_QK = ("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")
# the model's names and the released checkpoint's (transformers' conversion_mapping for granitemoe)
_GRANITEMOE_NAMES = (
    ("block_sparse_moe.router.weight", "block_sparse_moe.router.layer.weight"),
    ("block_sparse_moe.experts.gate_up_proj", "block_sparse_moe.input_linear.weight"),
    ("block_sparse_moe.experts.down_proj", "block_sparse_moe.output_linear.weight"),
)


def _granitemoe_name(key: str, back: bool = False) -> str:
    """``key`` under the released checkpoint's name (``back``: the model's again)."""
    for model, checkpoint in _GRANITEMOE_NAMES:
        old, new = (checkpoint, model) if back else (model, checkpoint)
        if key.endswith(old):
            return key[: -len(old)] + new
    return key


def _granite_shared(key: str, config: dict):
    """The GGUF tensor of a shared-MLP part (GraniteMoeModel.modify_tensors: input_linear's gate and
    up halves, output_linear), or None: ffn_*_shexp beside experts, ffn_* without."""
    parts = {"gate_proj": "GATE", "up_proj": "UP", "output_linear": "DOWN"}
    if ".shared_mlp." not in key:
        return None
    part = key.split(".")[-2]
    kind = parts[part] + ("_SHEXP" if config.get("num_local_experts") else "")
    return gguf.TENSOR_NAMES[getattr(gguf.MODEL_TENSOR, "FFN_" + kind)].format(bid=int(key.split(".")[2])) + ".weight"


def _granite_checkpoint(sd: dict) -> dict:
    """npattn's state dict under transformers' names: each shared MLP's gate and up rows as input_linear."""
    out = {}
    for key, value in sd.items():
        if key.endswith("shared_mlp.gate_proj.weight"):
            prefix = key[: -len("gate_proj.weight")]
            out[prefix + "input_linear.weight"] = np.concatenate([value, sd[prefix + "up_proj.weight"]])
        elif not key.endswith("shared_mlp.up_proj.weight"):
            out[key] = value
    return out


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute (convert_hf_to_gguf.py): rotate-half rows -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# where a block of each type gguf cannot quantize keeps its float16 scale(s) (ggml-common.h's
# block structs): random bytes there could be inf or NaN, so small normal values go there
_F16_SCALES = {
    "Q2_K": (80, 84),
    "Q3_K": (108, 110),
    "Q4_K": (0, 4),
    "Q5_K": (0, 4),
    "Q6_K": (208, 210),
    **{k: (0, 2) for k in ("IQ1_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS")},
}


# the K-quants whose 6-bit sub-block scales multiply d (and dmin): with d up to 1e-2 a Q5_K weight
# reaches 19, and Nemotron 3's relu2 experts overflow float32 (every logit 0: nothing compared); these
# keep the weights below about 1, as a model's
_SCALE_RANGES = {"Q4_K": (1e-4, 1e-3), "Q5_K": (1e-4, 5e-4)}


def _raw_blocks(qtype, shape, rng) -> np.ndarray:
    """Random bytes of a tensor of ``shape`` (..., cols) in a type gguf cannot quantize, its scales
    sane: the float16 ones (``_F16_SCALES``), IQ1_M's float16 spread over the top nibbles of its
    four 16-bit block scales, NVFP4's four FP8 (unsigned E4M3) scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (*shape[:-1], shape[-1] // block, size), dtype=np.uint8)
    lead = raw.shape[:-1]
    if qtype.name in _F16_SCALES:
        a, b = _F16_SCALES[qtype.name]
        lo, hi = _SCALE_RANGES.get(qtype.name, (1e-3, 1e-2))
        raw[..., a:b] = rng.uniform(lo, hi, (*lead, (b - a) // 2)).astype(np.float16).view(np.uint8)
    elif qtype.name == "IQ1_M":
        d = rng.uniform(1e-3, 1e-2, (*lead, 1)).astype(np.float16).view(np.uint16)
        scales = raw[..., 48:56].copy().view(np.uint16)  # (..., 4), little-endian
        nibbles = (d >> np.arange(0, 16, 4, dtype=np.uint16)) & np.uint16(0xF)
        raw[..., 48:56] = ((scales & np.uint16(0x0FFF)) | (nibbles << np.uint16(12))).view(np.uint8)
    elif qtype.name == "NVFP4":
        raw[..., :4] = rng.integers(0x10, 0x20, (*lead, 4), dtype=np.uint8)
    return raw.reshape(*shape[:-1], -1)


def _quantized(value, qtype, rng) -> np.ndarray:
    """``value`` in ``qtype``: quantized by gguf where it can, else random blocks (``_raw_blocks``)."""
    try:
        return gguf.quants.quantize(value, qtype)
    except NotImplementedError:
        return _raw_blocks(qtype, value.shape, rng)


def _phi3_metadata(w, config):
    """What llama.cpp's ``Phi3MiniModel.set_gguf_parameters`` writes: no key/value length, the
    rotated features ``int(partial_rotary_factor * hidden) // heads``, the context lengths, the
    window (0 for none) and, with LongRoPE, its attention factor (computed as transformers does)."""
    H, heads = config["hidden_size"], config["num_attention_heads"]
    longest, original = config["max_position_embeddings"], config["original_max_position_embeddings"]
    w.add_context_length(longest)
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_embedding_length(H)
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_head_count(heads)
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-5))  # Phi3Config's default
    w.add_rope_dimension_count(int(config.get("partial_rotary_factor", 1.0) * H) // heads)
    w.add_rope_freq_base(config["rope_theta"])
    w.add_sliding_window(config.get("sliding_window") or 0)
    if config.get("rope_scaling"):
        scale = longest / original
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0)


def _phi3_factors(config) -> list:
    """The converter's ``rope_factors_long.weight`` and ``rope_factors_short.weight`` (float32)."""
    rs = config.get("rope_scaling") or {}
    if not rs.get("long_factor"):
        return []
    return [
        ("rope_factors_long.weight", np.asarray(rs["long_factor"], np.float32)),
        ("rope_factors_short.weight", np.asarray(rs["short_factor"], np.float32)),
    ]


# Phi-3's checkpoint: the fused tensor of each of npattn's projections, its parts' rows in order
_PHI3_FUSED = {
    "self_attn": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
    "mlp": ("gate_up_proj", ("gate_proj", "up_proj")),
}


def _phi3_checkpoint(sd: dict, fusions: dict = _PHI3_FUSED) -> dict:
    """npattn's (split) state dict as Phi-3's checkpoint holds it: q/k/v and gate/up fused (GLM-4's:
    gate/up only, ``fusions`` ``_GLM4_FUSED``)."""
    out = {}
    for key, value in sd.items():
        prefix, module, part, _ = (key.rsplit(".", 3) + [""] * 4)[:4] if key.count(".") >= 3 else ("", "", "", "")
        fused, parts = fusions.get(module, (None, ()))
        if part not in parts:
            out[key] = value
        elif part == parts[0]:
            out[f"{prefix}.{module}.{fused}.weight"] = np.concatenate(
                [sd[f"{prefix}.{module}.{p}.weight"] for p in parts]
            )
    return out


# GLM-4's checkpoint: gate_up_proj (q, k and v apart)
_GLM4_FUSED = {"mlp": _PHI3_FUSED["mlp"]}


def _phi3_split(values: dict, config: dict) -> dict:
    """The inverse of ``_phi3_checkpoint`` (rows by the config's head counts and width)."""
    hd = config["hidden_size"] // config["num_attention_heads"]
    rows = {
        "qkv_proj": [config["num_attention_heads"] * hd] + [config["num_key_value_heads"] * hd] * 2,
        "gate_up_proj": [config["intermediate_size"]] * 2,
    }
    out = {}
    for key, value in values.items():
        prefix, module, fused, _ = (key.rsplit(".", 3) + [""] * 4)[:4] if key.count(".") >= 3 else ("", "", "", "")
        if module in _PHI3_FUSED and fused == _PHI3_FUSED[module][0]:
            for p, v in zip(_PHI3_FUSED[module][1], np.split(value, np.cumsum(rows[fused])[:-1])):
                out[f"{prefix}.{module}.{p}.weight"] = v
        else:
            out[key] = value
    return out


def _lfm2_metadata(w, config):
    """``LFM2Model.set_gguf_parameters``: head_count_kv per layer (0 on a convolution), the MLP's
    adjusted width, norm_eps, the convolution's taps."""
    from npattn.models import config_from_hf

    cfg = config_from_hf(config)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(64)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv([cfg.num_key_value_heads if t != "conv" else 0 for t in cfg.layer_types])
    w.add_rope_freq_base(cfg.rope["default"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_shortconv_l_cache(cfg.short_conv.conv_L_cache)
    if cfg.moe is not None:  # LFM2MoeModel.set_gguf_parameters
        w.add_expert_count(cfg.moe.num_experts)
        w.add_expert_used_count(cfg.moe.top_k)
        w.add_expert_feed_forward_length(cfg.moe.intermediate_size)
        w.add_leading_dense_block_count(cfg.mlp_types.index("moe"))
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)


def _nemotron_h_metadata(w, config, arch="nemotron_h"):
    """``NemotronHModel.set_gguf_parameters`` (GraniteHybridModel's, GraniteModel's without
    ``head_dim``, TextModel's): one ``head_count_kv`` and one ``feed_forward_length`` per block
    (0 where it is not attention, 0 where it is not an MLP), RoPE off (``rope.scaling.finetuned``
    false, context 2**20) with GraniteModel's ``rope.dimension_count`` (hidden / heads), the key and
    value length ``head_dim``, the ``ssm.*`` keys (inner width heads * head_dim), both epsilons."""
    from npattn.models import config_from_hf

    cfg = config_from_hf(config)
    H, heads, n = config["hidden_size"], config["num_attention_heads"], cfg.num_hidden_layers
    attn = [t == "full_attention" for t in cfg.layer_types]
    mlp = [t in ("plain", "moe") for t in cfg.mlp_types]
    width = config["moe_intermediate_size"] if arch == "nemotron_h_moe" else config["intermediate_size"]
    w.add_block_count(n)
    w.add_context_length(2**20)
    w.add_embedding_length(H)
    w.add_feed_forward_length([width if m else 0 for m in mlp])
    w.add_head_count(heads)
    w.add_head_count_kv([config["num_key_value_heads"] if a else 0 for a in attn])
    w.add_layer_norm_rms_eps(config["layer_norm_epsilon"])
    w.add_layer_norm_eps(config["layer_norm_epsilon"])
    w.add_vocab_size(config["vocab_size"])
    w.add_rope_dimension_count(H // heads)
    w.add_ssm_conv_kernel(config["conv_kernel"])
    w.add_ssm_state_size(config["ssm_state_size"])
    w.add_ssm_group_count(config["n_groups"])
    w.add_ssm_inner_size(config["mamba_num_heads"] * config["mamba_head_dim"])
    w.add_ssm_time_step_rank(config["mamba_num_heads"])
    w.add_rope_scaling_finetuned(False)
    w.add_key_length(config["head_dim"])
    w.add_value_length(config["head_dim"])
    if arch == "nemotron_h_moe":  # is_moe: the experts' keys (expert_used_count twice, as the converter)
        w.add_expert_used_count(config["num_experts_per_tok"])
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(config["moe_shared_expert_intermediate_size"])
        w.add_expert_count(config["n_routed_experts"])
        w.add_expert_shared_count(config.get("n_shared_experts", 1))
        w.add_expert_weights_norm(config["norm_topk_prob"])
        w.add_expert_weights_scale(config["routed_scaling_factor"])
        w.add_expert_group_count(config["n_group"])
        if config.get("moe_latent_size") is not None:
            w.add_moe_latent_size(config["moe_latent_size"])


def _falcon_h1_metadata(w, config):
    """``FalconH1Model.set_gguf_parameters`` after ``Mamba2Model``'s: the sizes, the ``ssm.*`` keys
    (``time_step_rank``: the inner width over ``mamba_d_head``), no multiplier, no RoPE width."""
    H = config["hidden_size"]
    w.add_context_length(64)
    w.add_embedding_length(H)
    w.add_block_count(config["num_hidden_layers"])
    w.add_ssm_conv_kernel(config["mamba_d_conv"])
    w.add_ssm_inner_size(config["mamba_d_ssm"])
    w.add_ssm_state_size(config["mamba_d_state"])
    w.add_ssm_time_step_rank(config["mamba_d_ssm"] // config["mamba_d_head"])
    w.add_ssm_group_count(config["mamba_n_groups"])
    w.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-5))
    w.add_vocab_size(config["vocab_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_key_length(config["head_dim"])
    w.add_value_length(config["head_dim"])
    w.add_rope_freq_base(config.get("rope_theta", 10000.0))


def _falcon_h1_folded(sd: dict, config: dict) -> dict:
    """``sd`` with the multipliers ``FalconH1Model.modify_tensors`` multiplies into the weights (and
    biases), in its order and in float32 (its torch products of float32 tensors), matched by name
    as it matches them; any other config's ``sd`` as it is."""
    if config["model_type"] != "falcon_h1":
        return sd
    c, f = config, np.float32
    mlp, ssm = c.get("mlp_multipliers") or [1.0, 1.0], c.get("ssm_multipliers") or [1.0] * 5
    inner, gn = c["mamba_d_ssm"], c["mamba_n_groups"] * c["mamba_d_state"]
    bounds = [0, inner, 2 * inner, 2 * inner + gn, 2 * inner + 2 * gn, None]
    out = {}
    for key, v in sd.items():
        v = np.asarray(v, np.float32)
        if "down_proj" in key:
            v = v * f(mlp[1])
        elif "gate_proj" in key:
            v = v * f(mlp[0])
        elif "k_proj" in key:
            v = v * f(c["key_multiplier"]) * f(c["attention_in_multiplier"])
        elif "q_proj" in key or "v_proj" in key:
            v = v * f(c["attention_in_multiplier"])
        elif "o_proj" in key:
            v = v * f(c["attention_out_multiplier"])
        elif "out_proj" in key:
            v = v * f(c["ssm_out_multiplier"])
        elif "in_proj" in key:  # then z, x, B, C and dt's rows each by its own
            v = v * f(c["ssm_in_multiplier"])
            for i in range(5):
                v[bounds[i] : bounds[i + 1]] *= f(ssm[i])
        elif "lm_head" in key:
            v = v * f(c["lm_head_multiplier"])
        elif "embed_tokens" in key:
            v = v * f(c["embedding_multiplier"])
        out[key] = v
    return out


def _hunyuan_base(config: dict) -> float:
    """``HunYuanModel.set_gguf_parameters``' ``rope.freq_base`` of a ``"dynamic"`` RoPE dict: the
    NTK-alpha base ``rope_theta * alpha ** (head_dim / (head_dim - 2))`` (alpha 50 where absent),
    as the float32 the file holds."""
    rp, dim = config["rope_parameters"], config["head_dim"]
    return float(np.float32(rp.get("rope_theta", 10000.0) * rp.get("alpha", 50) ** (dim / (dim - 2))))


def _hunyuan_metadata(w, config):
    """``HunYuanModel.set_gguf_parameters``: for a ``"dynamic"`` dict the NTK-alpha base as
    ``rope.freq_base``, no scaling type, factor 1, and 256K as the original context length."""
    if config["rope_parameters"].get("rope_type") == "dynamic":
        w.add_rope_freq_base(_hunyuan_base(config))
        w.add_rope_scaling_type(gguf.RopeScalingType.NONE)
        w.add_rope_scaling_factor(1)
        w.add_rope_scaling_orig_ctx_len(256 * 1024)
    else:
        w.add_rope_freq_base(config["rope_parameters"].get("rope_theta", 10000.0))


def _file_config(config: dict) -> dict:
    """The config of the model a file of ``config``'s model holds: a Falcon-H1's multipliers folded
    into its weights (``_falcon_h1_folded``), so none (all 1); a Hunyuan model's NTK-alpha RoPE the
    default RoPE of the file's base (``_hunyuan_base``); any other config as it is."""
    if config["model_type"] == "hunyuan_v1_dense" and config["rope_parameters"].get("rope_type") == "dynamic":
        rest = {k: v for k, v in config.items() if k != "rope_parameters"}
        return dict(rest, rope_parameters={"rope_type": "default", "rope_theta": _hunyuan_base(config)})
    if config["model_type"] != "falcon_h1":  # (Granite's multipliers of the same names are metadata)
        return config
    return {k: v for k, v in config.items() if k not in _FALCON_H1_MULTIPLIERS}


def _exaone4_metadata(w, config):
    """``Exaone4Model.set_gguf_parameters``: the vocabulary's size and, where the config (with its
    class defaults) has a window, the window and one flag per layer, true where it slides."""
    from npattn.models import config_from_hf
    from npattn.models.configs import with_defaults

    w.add_vocab_size(config["vocab_size"])
    if with_defaults(config).get("sliding_window") is not None:
        w.add_sliding_window(with_defaults(config)["sliding_window"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in config_from_hf(config).layer_types])


def _cohere_metadata(w, config, arch):
    """``CommandR2Model.set_gguf_parameters`` and ``Cohere2Model.set_gguf_parameters`` beyond
    TextModel's keys: ``logit_scale``, RoPE scaling "none"; Cohere2's window, vocabulary size and
    ``rope.dimension_count`` = ``rotary_pct * hidden_size / heads`` (no pattern: llama.cpp's 4)."""
    from npattn.models.configs import with_defaults

    c = with_defaults(config)
    w.add_logit_scale(c["logit_scale"])
    if arch == "cohere2":
        w.add_sliding_window(c["sliding_window"])
        w.add_vocab_size(c["vocab_size"])
    w.add_rope_scaling_type(gguf.RopeScalingType.NONE)


def _phi2_metadata(w, config):
    """``Phi2Model.set_gguf_parameters``: no RoPE base, ``head_count_kv`` the head count, the MLP
    ``4 * hidden`` wide, the rotated features ``int(partial_rotary_factor * hidden) // heads``."""
    H, heads = config["hidden_size"], config["num_attention_heads"]
    w.add_context_length(64)
    w.add_embedding_length(H)
    w.add_feed_forward_length(4 * H)
    w.add_block_count(config["num_hidden_layers"])
    w.add_head_count(heads)
    w.add_head_count_kv(heads)
    w.add_layer_norm_eps(config["layer_norm_eps"])
    w.add_rope_dimension_count(int(config.get("partial_rotary_factor", 0.5) * H) // heads)
    w.add_add_bos_token(False)


def _gpt2_metadata(w, config, *, context=True, head_count_kv=None, key_length=None, ffn=None):
    """``GPT2Model.set_gguf_parameters``: the context length (its ``n_ctx``, GPT-2's configs'
    ``n_positions``), no key/value heads, the MLP ``4 * n_embd`` wide, the LayerNorms' epsilon
    (the keywords: a file the converter would not write)."""
    H = config["hidden_size"]
    w.add_block_count(config["num_hidden_layers"])
    if context:
        w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(H)
    w.add_feed_forward_length(ffn or 4 * H)
    w.add_head_count(config["num_attention_heads"])
    if head_count_kv is not None:
        w.add_head_count_kv(head_count_kv)
    if key_length is not None:
        w.add_key_length(key_length)
    w.add_layer_norm_eps(config["layer_norm_epsilon"])


_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def _gpt2_checkpoint(sd: dict) -> dict:
    """GPT2LMHeadModel's checkpoint of a model's state dict: ``transformer.h.{i}.*``, the q, k and v
    rows (weight and bias) stacked into ``attn.c_attn``, the four Conv1D weights stored (in, out)."""
    out = {}
    for k, v in sd.items():
        if ".attn.k_proj." in k or ".attn.v_proj." in k:
            continue
        if ".attn.q_proj." in k:
            v = np.concatenate([sd[k.replace("q_proj", p)] for p in ("q_proj", "k_proj", "v_proj")])
            k = k.replace("q_proj", "c_attn")
        k = k.replace("model.layers.", "transformer.h.", 1).replace("model.", "transformer.", 1)
        out[k] = np.ascontiguousarray(np.asarray(v).T) if k.endswith(_CONV1D) else v
    return out


def _gpt2_converted(sd: dict) -> dict:
    """``GPT2Model.modify_tensors``: the attn.bias / attn.masked_bias buffers dropped, the Conv1D
    weights transposed to (out, in)."""
    drop = (".attn.bias", ".attn.masked_bias")
    return {k: np.ascontiguousarray(v.T) if k.endswith(_CONV1D) else v for k, v in sd.items() if not k.endswith(drop)}


def _gpt2_split(values: dict) -> dict:
    """A file's values under the checkpoint's names (``attn_qkv`` [q; k; v]) back under the model's."""
    out = {}
    for k, v in values.items():
        k = k.replace("transformer.h.", "model.layers.", 1).replace("transformer.", "model.", 1)
        if ".c_attn." in k:
            for p, part in zip(_QKV, np.split(v, 3, axis=0)):
                out[k.replace("c_attn", p)] = part
        else:
            out[k] = v
    return out


def _starcoder2_metadata(w, config):
    """``StarCoder2Model`` (TextModel's ``set_gguf_parameters`` alone): the sizes, ``head_count_kv``,
    the base ``rope.freq_base`` and ``norm_epsilon`` as the LayerNorms' epsilon; no window, no
    key/value length (the config has no ``head_dim``)."""
    w.add_context_length(64)
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_rope_freq_base(config.get("rope_theta", 10000.0))
    w.add_layer_norm_eps(config["norm_epsilon"])


def _gptneox_metadata(w, config):
    """``GPTNeoXModel.set_gguf_parameters``: no RoPE base, no key/value heads, the rotated features
    ``int(rotary_pct * hidden / heads)``, ``use_parallel_residual`` and the LayerNorms' epsilon."""
    H, heads = config["hidden_size"], config["num_attention_heads"]
    w.add_context_length(64)
    w.add_embedding_length(H)
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_rope_dimension_count(int(config["rotary_pct"] * (H // heads)))
    w.add_head_count(heads)
    w.add_parallel_residual(config.get("use_parallel_residual", True))
    w.add_layer_norm_eps(config["layer_norm_eps"])


_QKV = ("q_proj", "k_proj", "v_proj")


def _gptneox_checkpoint(sd: dict, heads: int) -> dict:
    """The model's state dict as GPT-NeoX's checkpoint: ``gpt_neox.*`` (the head ``lm_head``, as
    transformers' conversion mapping names ``embed_out``; gguf's map knows both), and each
    layer's ``query_key_value`` holding every head's q, k, v rows in turn (``(heads, 3, D)``)."""
    out = {}
    for k, v in sd.items():
        part = next((p for p in _QKV if f".attention.{p}." in k), None)
        if part is None:
            out[k.replace("model.", "gpt_neox.", 1)] = v
        elif part == "q_proj":
            qkv = [np.asarray(sd[k.replace("q_proj", p)]) for p in _QKV]
            grouped = np.stack([x.reshape(heads, -1, *x.shape[1:]) for x in qkv], axis=1)
            name = k.replace("model.", "gpt_neox.", 1).replace("q_proj", "query_key_value")
            out[name] = grouped.reshape(-1, *qkv[0].shape[1:])
    return out


def _gptneox_converted(sd: dict, heads: int) -> dict:
    """``GPTNeoXModel.modify_tensors``: each ``query_key_value`` (weight and bias) reshaped to
    ``(heads, 3, D, ...)`` and its q, k, v rows of every head concatenated, [q; k; v]."""
    out = dict(sd)
    for k, v in sd.items():
        if ".query_key_value." in k:
            g = v.reshape(heads, 3, -1, *v.shape[1:])
            out[k] = np.concatenate([g[:, i].reshape(-1, *v.shape[1:]) for i in range(3)], axis=0)
    return out


def _gptneox_split(values: dict) -> dict:
    """A file's [q; k; v] ``query_key_value`` rows (under the checkpoint's names) back under the
    model's names, q, k and v apart (thirds: as many key/value heads as heads)."""
    out = {}
    for k, v in values.items():
        k = k.replace("gpt_neox.", "model.", 1)
        if ".query_key_value." in k:
            for p, part in zip(_QKV, np.split(v, 3, axis=0)):
                out[k.replace("query_key_value", p)] = part
        else:
            out[k] = v
    return out


def _stablelm_metadata(w, config):
    """``StableLMModel.set_gguf_parameters``: no RoPE base, no key/value length, the rotated features
    ``int(partial_rotary_factor * (hidden // heads))``, ``use_parallel_residual`` (true where the
    config has no such key) and the LayerNorms' epsilon."""
    H, heads = config["hidden_size"], config["num_attention_heads"]
    w.add_context_length(64)
    w.add_embedding_length(H)
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_rope_dimension_count(int(config.get("partial_rotary_factor", 0.25) * (H // heads)))
    w.add_head_count(heads)
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_parallel_residual(config.get("use_parallel_residual", True))
    w.add_layer_norm_eps(config["layer_norm_eps"])


def _stablelm_converted(sd: dict) -> dict:
    """``StableLMModel.modify_tensors`` on the checkpoint: each layer's ``q_layernorm.norms.{h}.weight``
    (``StableLmLayerNormPerHead``'s rows, the model's ``q_norm.weight`` apart: ``CheckpointLayout.per_row``),
    stacked in head order as ``q_layernorm.weight`` (``_stack_qk_norm``); k's alike."""
    out = {}
    for k, v in sd.items():
        for part in ("q", "k"):
            if k.endswith(f"self_attn.{part}_norm.weight"):
                rows = [v[h] for h in range(v.shape[0])]  # norms.0.weight, norms.1.weight, ...
                k, v = k.replace(f"{part}_norm.", f"{part}_layernorm."), np.stack(rows, axis=0)
        out[k] = v
    return out


def _stablelm_checkpoint(values: dict) -> dict:
    """The model's tensors under StableLM's checkpoint names: each ``q_norm.weight`` / ``k_norm.weight``
    row a head's ``q_layernorm.norms.{h}.weight`` (``StableLmLayerNormPerHead``)."""
    out = {}
    for k, v in values.items():
        if k.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
            stem = k[: -len("_norm.weight")] + "_layernorm.norms"
            out.update({f"{stem}.{h}.weight": row for h, row in enumerate(v)})
        else:
            out[k] = v
    return out


def _mamba2_metadata(w, config):
    """``Mamba2Model.set_gguf_parameters`` (not TextModel's): context 2**20, feed_forward_length and
    head_count 0 ("seemingly required when loading"), the ``ssm.*`` keys (time_step_rank the inner
    width over head_dim: the heads), the RMS epsilon; no vocab_size (set_vocab pads the tokenizer's)."""
    w.add_context_length(2**20)
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_block_count(config["num_hidden_layers"])
    inner = config["expand"] * config["hidden_size"]
    w.add_ssm_conv_kernel(config["conv_kernel"])
    w.add_ssm_inner_size(inner)
    w.add_ssm_state_size(config["state_size"])
    w.add_ssm_time_step_rank(inner // config["head_dim"])
    w.add_ssm_group_count(config["n_groups"])
    w.add_layer_norm_rms_eps(config["layer_norm_epsilon"])


def _metadata(w, config, arch):
    """The metadata llama.cpp's converter writes for ``config`` (``TextModel.set_gguf_parameters``
    and the architecture's own keys)."""
    if arch == "mamba2":
        return _mamba2_metadata(w, config)
    if arch == "phi3":
        return _phi3_metadata(w, config)
    if arch == "gptneox":
        return _gptneox_metadata(w, config)
    if arch == "phi2":
        return _phi2_metadata(w, config)
    if arch == "starcoder2":
        return _starcoder2_metadata(w, config)
    if arch == "stablelm":
        return _stablelm_metadata(w, config)
    if arch == "gpt2":
        return _gpt2_metadata(w, config)
    if arch == "falcon-h1":
        return _falcon_h1_metadata(w, config)
    if arch in ("nemotron_h", "nemotron_h_moe"):
        return _nemotron_h_metadata(w, config, arch)
    if arch in ("lfm2", "lfm2moe"):
        return _lfm2_metadata(w, config)
    H, heads = config["hidden_size"], config["num_attention_heads"]
    hd = config.get("head_dim", H // heads)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(64)
    w.add_embedding_length(H)
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    if config["model_type"] == "granitemoehybrid":  # GraniteHybridModel: one per layer (0: Mamba-2)
        kinds = config.get("layer_types") or ["mamba"] * config["num_hidden_layers"]
        w.add_head_count_kv([0 if t in _MAMBA else config["num_key_value_heads"] for t in kinds])
        w.add_rope_scaling_finetuned(config.get("position_embedding_type") == "rope")
        # the ssm.* keys from the mamba_* ones (GraniteMoeHybridConfig's defaults where absent)
        w.add_ssm_conv_kernel(config.get("mamba_d_conv", 4)), w.add_ssm_state_size(config.get("mamba_d_state", 256))
        w.add_ssm_group_count(config.get("mamba_n_groups", 1))
        w.add_ssm_inner_size(config.get("mamba_expand", 2) * H)
        w.add_ssm_time_step_rank(config.get("mamba_n_heads", 128))
    else:
        w.add_head_count_kv(config["num_key_value_heads"])
    if arch in _COHERES:  # TextModel: layer_norm_eps as the LayerNorms' epsilon
        w.add_layer_norm_eps(config["layer_norm_eps"])
        _cohere_metadata(w, config, arch)
    elif arch == "olmo":  # OlmoModel.set_gguf_parameters: its fixed 1e-5, clamp_kqv where clip_qkv is set
        w.add_layer_norm_eps(1e-5)
        if config.get("clip_qkv") is not None:
            w.add_clamp_kqv(config["clip_qkv"])
    else:
        w.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-6))
    if arch not in _GRANITES:  # GraniteModel drops head_dim: no key/value length
        w.add_key_length(hd)
        w.add_value_length(hd)
    # Glm4Model.set_gguf_parameters: the rotated features int(head_dim * partial_rotary_factor)
    w.add_rope_dimension_count(int(hd * config.get("partial_rotary_factor", 0.5)) if arch == "glm4" else hd)
    if arch == "gemma3":  # Gemma3Model.set_gguf_parameters: the global base, the window, the softcap
        full, local = config["rope_parameters"]["full_attention"], config["rope_parameters"]["sliding_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        w.add_rope_freq_base_swa(local["rope_theta"])
        w.add_rope_scaling_type(gguf.RopeScalingType(full["rope_type"]))
        w.add_rope_scaling_factor(full["factor"])
        w.add_sliding_window(config["sliding_window"])
        w.add_final_logit_softcapping(config["final_logit_softcapping"])
    elif arch == "gemma2":  # Gemma2Model.set_gguf_parameters: both softcaps and the window, no base
        w.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        w.add_final_logit_softcapping(config["final_logit_softcapping"])
        w.add_sliding_window(config["sliding_window"])
    elif arch == "olmo2":
        _olmo2_metadata(w, config)
    elif arch == "mistral3":
        _mistral3_metadata(w, config)
    elif arch == "arcee":
        _arcee_metadata(w, config)
    elif arch == "hunyuan-dense":
        _hunyuan_metadata(w, config)
    else:
        w.add_rope_freq_base(config.get("rope_theta", 10000.0))
    if arch in _GRANITES:  # GraniteModel.set_gguf_parameters: each number where it is not 0
        for key, add in (
            ("attention_multiplier", w.add_attention_scale),
            ("embedding_multiplier", w.add_embedding_scale),
            ("residual_multiplier", w.add_residual_scale),
            ("logits_scaling", w.add_logit_scale),
        ):
            if config.get(key):
                add(config[key])
    if arch == "exaone4":  # Exaone4Model.set_gguf_parameters: the window and its per-layer pattern
        _exaone4_metadata(w, config)
    if config["model_type"] in (
        "qwen3_moe",
        "qwen2_moe",
        "mixtral",
        "olmoe",
        *_GRANITE_MOES,
    ):  # TextModel's (Granite 4.0's counts of 0 too), Qwen2MoeModel's
        w.add_expert_count(config.get("num_experts", config.get("num_local_experts")))
        w.add_expert_used_count(config["num_experts_per_tok"])
    if arch in ("qwen3moe", "qwen2moe"):
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    if config.get("shared_intermediate_size"):  # GraniteMoeModel.set_gguf_parameters
        w.add_expert_shared_feed_forward_length(config["shared_intermediate_size"])


def _olmo2_metadata(w, config, old_attn_factor=False):
    """``Olmo2Model.set_gguf_parameters`` beyond ``_metadata``'s common keys: the full layers' base
    and YaRN (TextModel's keys; ``old_attn_factor``: the attention factor as an older Olmo2Model
    wrote it, ``rope.scaling.attn_factor``), an OLMo 3 config's window and one boolean per layer
    (true: sliding); ``rope.freq_base_swa`` only where the sliding layers' base differs (no
    converter writes it: llama.cpp then takes ``rope.freq_base``)."""
    rp = config.get("rope_parameters")
    full = rp["full_attention"] if rp else dict(config.get("rope_scaling") or {}, rope_theta=config["rope_theta"])
    w.add_rope_freq_base(full["rope_theta"])
    if rp and rp["sliding_attention"]["rope_theta"] != full["rope_theta"]:
        w.add_rope_freq_base_swa(rp["sliding_attention"]["rope_theta"])
    if full.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(full["factor"])
        w.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
        if old_attn_factor:
            w.add_rope_scaling_attn_factors(full["attention_factor"])
        else:
            w.add_rope_scaling_yarn_attn_factor(full["attention_factor"])
            w.add_rope_scaling_yarn_beta_fast(full["beta_fast"])
            w.add_rope_scaling_yarn_beta_slow(full["beta_slow"])
    if "sliding_window" in config:
        w.add_sliding_window(config["sliding_window"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in config["layer_types"]])


def _arcee_metadata(w, config):
    """``ArceeModel.set_gguf_parameters``: the base, and where the config's RoPE is YaRN (its
    ``rope_scaling``'s or ``rope_parameters``' type) its type, factor and original context length;
    not the betas (left out: llama.cpp's defaults, transformers' too)."""
    rp = config.get("rope_scaling") or config.get("rope_parameters") or {}
    w.add_rope_freq_base(rp.get("rope_theta", config.get("rope_theta", 10000.0)))
    if rp.get("rope_type", rp.get("type")) == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rp["factor"])
        w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])


def _mistral3_metadata(w, config):
    """``Mistral3Model.set_gguf_parameters`` for a ``ministral3`` config: TextModel's base and YaRN
    keys (the betas where the config has them), ``mscale_all_dim`` as the YaRN log multiplier and
    ``llama_4_scaling_beta`` as ``attention.temperature_scale``."""
    rp = config["rope_parameters"]
    w.add_rope_freq_base(rp["rope_theta"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rp["factor"])
    w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
    if "beta_fast" in rp:
        w.add_rope_scaling_yarn_beta_fast(rp["beta_fast"])
    if "beta_slow" in rp:
        w.add_rope_scaling_yarn_beta_slow(rp["beta_slow"])
    w.add_rope_scaling_yarn_log_mul(rp["mscale_all_dim"])
    w.add_attn_temperature_scale(rp["llama_4_scaling_beta"])


@functools.lru_cache(maxsize=None)
def _name_map(arch: str):
    """gguf's map of Hugging Face names onto ``arch``'s (64 blocks), made once per architecture:
    gguf expands every block's names each time (20-30 ms, twice per file written); only read."""
    return gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], 64)


_STATES: dict = {}


def _state(config: dict) -> dict:
    """``_model(config).state_dict()``, the model made once per config (the same seed, so the same
    values every time); a copy of its arrays each call (a test may change them).  xIELU's numbers
    (Apertus) drawn apart per layer: each layer's must be its own."""
    key = json.dumps(config, sort_keys=True)
    if key not in _STATES:
        sd = _model(config).state_dict()
        rng = np.random.default_rng(11)
        for k in sd:
            if ".act_fn." in k:
                sd[k] = (sd[k] + rng.uniform(-0.3, 0.3, sd[k].shape)).astype(sd[k].dtype)
        _STATES[key] = sd
    return {k: v.copy() for k, v in _STATES[key].items()}


_SOURCE_LOGITS: dict = {}


def _source_logits(config: dict) -> np.ndarray:
    """The logits of the source model (``_state(config)``) on the ids of
    test_quantized_file_is_its_dequantized_model, computed once per config (a copy each call)."""
    key = json.dumps(config, sort_keys=True)
    if key not in _SOURCE_LOGITS:
        ids = np.random.default_rng(1).integers(0, config["vocab_size"], (2, 6))
        _SOURCE_LOGITS[key] = _logits(CausalLM.from_hf(_state(config), config), ids)
    return _SOURCE_LOGITS[key].copy()


def _as_gguf(sd: dict, config: dict, arch: str) -> dict:
    """{(HF name, GGUF name): values} as llama.cpp's converter writes them: the experts' fused
    gate_up_proj split into ffn_gate_exps and ffn_up_exps, a llama model's q/k rows permuted,
    Gemma's norms plus one."""
    names = _name_map(arch)
    out = {}
    if arch == "phi3":  # the converter reads the checkpoint's fused qkv_proj and gate_up_proj
        sd = _phi3_checkpoint(sd)
    if arch == "glm4":  # and GLM-4's gate_up_proj
        sd = _phi3_checkpoint(sd, _GLM4_FUSED)
    if arch == "gpt2":  # the checkpoint's Conv1D weights, transposed back by the converter
        sd = _gpt2_converted(_gpt2_checkpoint(sd))
    if arch == "gptneox":  # the checkpoint's per-head query_key_value, reordered by the converter
        sd = _gptneox_converted(_gptneox_checkpoint(sd, config["num_attention_heads"]), config["num_attention_heads"])
    if arch == "stablelm":  # the checkpoint's per-head norms, stacked by the converter
        sd = _stablelm_converted(sd)
    if config["model_type"] in _GRANITE_MOES:  # the released checkpoint's names, which the converter reads
        sd = {_granitemoe_name(k): v for k, v in sd.items()}
    sd = _falcon_h1_folded(sd, config)  # FalconH1Model: the multipliers into the weights
    for key, value in sd.items():
        value = np.asarray(value, np.float32)
        if ".act_fn." in key:  # ApertusModel.modify_tensors: xIELU's numbers into the metadata (_xielu_metadata)
            continue
        if _granite_shared(key, config):  # the shared MLP: input_linear's halves, output_linear
            out[key, _granite_shared(key, config)] = value
            continue
        if key.endswith("block_sparse_moe.input_linear.weight"):  # GraniteMoeModel.modify_tensors: split
            bid, half = int(key.split(".")[2]), value.shape[1] // 2
            for t, v in (
                (gguf.MODEL_TENSOR.FFN_GATE_EXP, value[:, :half]),
                (gguf.MODEL_TENSOR.FFN_UP_EXP, value[:, half:]),
            ):
                out[key, gguf.TENSOR_NAMES[t].format(bid=bid) + ".weight"] = np.ascontiguousarray(v)
            continue
        if key.endswith("experts.gate_up_proj"):
            half = value.shape[1] // 2
            if arch == "lfm2moe":  # LFM2MoeModel.modify_tensors: the experts' w1 and w3 stacked
                bid = int(key.split(".")[2])
                for t, v in (
                    (gguf.MODEL_TENSOR.FFN_GATE_EXP, value[:, :half]),
                    (gguf.MODEL_TENSOR.FFN_UP_EXP, value[:, half:]),
                ):
                    out[key, gguf.TENSOR_NAMES[t].format(bid=bid) + ".weight"] = np.ascontiguousarray(v)
                continue
            for part, v in (("gate_proj", value[:, :half]), ("up_proj", value[:, half:])):
                out[key, names.get_name(key.replace("gate_up_proj", part)) + ".weight"] = np.ascontiguousarray(v)
            continue
        if key.endswith(("mixer.experts.up_proj", "mixer.experts.down_proj")):  # NemotronHModel: stacked, renamed
            bid, part = int(key.split(".")[2]), key.split(".")[-1]
            out[key, names.get_name(f"model.layers.{bid}.mlp.experts.{part}") + ".weight"] = value
            continue
        if key.endswith("feed_forward.expert_bias"):  # LFM2MoeModel.filter_tensors: expert_bias.bias
            out[key, f"blk.{int(key.split('.')[2])}.exp_probs_b.bias"] = value
            continue
        if arch in _PERMUTED and key.endswith(_QK):
            kv = config["num_key_value_heads"]
            value = _permute(value, config["num_attention_heads"] if "q_proj" in key else kv)
        if arch in _GEMMAS and key.endswith("norm.weight"):
            value = value + np.float32(1.0)
        if key.endswith(("conv.conv.weight", "mamba.conv1d.weight", "mixer.conv1d.weight")):  # LFM2Model's and
            value = value[:, 0, :]  # Mamba2Model.modify_tensors: (D, 1, K) squeezed to (D, K)
        if key.endswith(("mamba.A_log", "mixer.A_log")):  # Mamba2Model.modify_tensors: A = -exp(A_log), as (H, 1)
            value = -np.exp(value)[:, None]
        if key.endswith(("mamba.D", "mixer.D")):  # (H, 1)
            value = value[:, None]
        if key.endswith(("mamba.norm.weight", "mixer.norm.weight")):  # per group: (n_group, I / n_group)
            value = value.reshape(config.get("mamba_n_groups") or config["n_groups"], -1)
        # Mamba2Model.filter_tensors: dt_bias as dt_proj.bias (ssm_dt.bias)
        mapped = key[: -len("dt_bias")] + "dt_proj.bias" if key.endswith(".dt_bias") else key
        if arch in ("nemotron_h", "nemotron_h_moe", "mamba2"):  # the released checkpoint's names (backbone.*), mapped
            mapped = "backbone." + mapped[len("model.") :] if mapped.startswith("model.") else mapped
            mapped = mapped.replace(".e_score_correction_bias", ".e_score_correction.bias")
        name = names.get_name(mapped, try_suffixes=(".weight", ".bias"))
        out[key, name if mapped.endswith((".weight", ".bias", ".A_log", ".D")) else name + ".weight"] = value
    return out


def _experts_apart(items: dict) -> dict:
    """``_as_gguf``'s tensors as early Mixtral files held the experts: each stacked
    ``blk.N.ffn_{gate,up,down}_exps.weight`` (E, rows, cols) as E matrices ``blk.N.ffn_{kind}.{x}.weight``."""
    out = {}
    for (key, name), value in items.items():
        if name.endswith("_exps.weight"):
            for x, v in enumerate(value):
                out[key, name[: -len("_exps.weight")] + f".{x}.weight"] = np.ascontiguousarray(v)
        else:
            out[key, name] = value
    return out


def _write(path, config, sd, qtype, arch, extra=(), apart=False):
    """``sd`` (Hugging Face names) as a GGUF file of ``arch``, 2-D and 3-D weights in ``qtype``
    (the router and the norms float32, as the converter keeps them), then the ``(name, values)``
    of ``extra`` as they are; ``apart``: the experts one tensor each (``_experts_apart``); returns
    {GGUF name: the float32 values the file holds, in llama.cpp's row order} (``sd``'s)."""
    rng = np.random.default_rng(7)
    w = gguf.GGUFWriter(str(path), arch)
    _metadata(w, config, arch)
    held = {}
    if arch == "phi3":
        extra = (*_phi3_factors(config), *extra)
    if arch == "exaone4" and config.get("rope_scaling"):  # Exaone4Model.generate_extra_tensors
        extra = (("rope_freqs.weight", _rope_freqs(config)), *extra)
    for name, value in extra:
        w.add_tensor(name, value)
    if arch == "apertus":
        _xielu_metadata(w, sd, config)
    items = _as_gguf(sd, config, arch)
    for (key, name), value in (_experts_apart(items) if apart else items).items():
        # rows of fewer values than a block (LFM2's 3 taps) stay float32, as llama.cpp keeps them; so do
        # the norms and the tensors not named .weight (the converter's prepare_tensors: Mamba-2's ssm_a, ssm_d)
        gate = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "shortconv.conv.weight", "ssm_conv1d.weight")
        f32 = name.endswith(gate) or name.endswith("_norm.weight") or not name.endswith(".weight")
        f32 = f32 or name == "position_embd.weight"  # POS_EMBD: float32 always (the converter, llama-quantize)
        if value.ndim == 1 or qtype == Q.F32 or f32:
            w.add_tensor(name, value)
            held[name] = value
        elif qtype == Q.F16:
            w.add_tensor(name, value.astype(np.float16))
            held[name] = value.astype(np.float16).astype(np.float32)
        else:
            data = _quantized(value, qtype, rng)
            w.add_tensor(name, data, raw_dtype=qtype)
            try:
                held[name] = gguf.quants.dequantize(data, qtype).reshape(value.shape)
            except NotImplementedError:  # a type gguf does not dequantize (npattn refuses it)
                held[name] = None
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


def _xielu_metadata(w, sd: dict, config: dict) -> None:
    """``ApertusModel.modify_tensors``: each layer's xIELU alpha_n, alpha_p, beta and eps (as
    floats, ``.float().item()``) gathered into the arrays ``xielu.*``, layer by layer."""
    n = config["num_hidden_layers"]
    for name, add in (("alpha_n", w.add_xielu_alpha_n), ("alpha_p", w.add_xielu_alpha_p)):
        add([float(np.float32(sd[f"model.layers.{i}.mlp.act_fn.{name}"]).reshape(-1)[0]) for i in range(n)])
    for name, add in (("beta", w.add_xielu_beta), ("eps", w.add_xielu_eps)):
        add([float(np.float32(sd[f"model.layers.{i}.mlp.act_fn.{name}"])) for i in range(n)])


def _hf_values(held: dict, sd: dict, config: dict, arch: str) -> dict:
    """The file's values under Hugging Face's names and conventions: llama.cpp's permutation
    (llama files) inverted as a row index, Gemma's norms minus one, the experts' gate and up
    joined again."""
    names = {name: key for key, name in _as_gguf(sd, config, arch)}
    out: dict = {}
    for name, v in held.items():
        if name not in names:  # an extra tensor (LongRoPE's factors): read into the config
            continue
        key = names[name]
        if arch in _PERMUTED and key.endswith(_QK):
            n = config["num_attention_heads"] if "q_proj" in key else config["num_key_value_heads"]
            v = v[np.argsort(_permute(np.arange(v.shape[0]), n))]
        if arch in _GEMMAS and key.endswith("norm.weight"):
            v = v - np.float32(1.0)
        if key.endswith(("conv.conv.weight", "mamba.conv1d.weight", "mixer.conv1d.weight")):
            v = v[:, None, :]
        if key.endswith(("mamba.A_log", "mixer.A_log")):  # log(-A) in float64, as read
            v = np.log(-v[:, 0].astype(np.float64))
        if key.endswith(("mamba.D", "mamba.norm.weight", "mixer.D", "mixer.norm.weight")):
            v = v.reshape(-1)
        out[key] = np.concatenate([out[key], v], axis=1) if key in out else v
    if config["model_type"] in _GRANITE_MOES:  # back to the model's names
        out = {_granitemoe_name(k, back=True): v for k, v in out.items()}
    out.update({k: np.asarray(v, np.float32) for k, v in sd.items() if ".act_fn." in k})  # the metadata's float32
    if arch == "gptneox":
        return _gptneox_split(out)
    if arch == "stablelm":  # the stacked per-head norms under the model's names
        return {k.replace("q_layernorm.", "q_norm.").replace("k_layernorm.", "k_norm."): v for k, v in out.items()}
    if arch == "gpt2":
        return _gpt2_split(out)
    return _phi3_split(out, config) if arch in ("phi3", "glm4") else out


def _assert_holds(loaded, want: dict) -> None:
    """``loaded``'s tensors are ``want``'s (``_hf_values`` of the file), bit for bit, none missing
    (Mamba-2's ``A_log``, computed in float64, rounded to the model's dtype)."""
    assert set(loaded.state_dict()) == set(want)
    for k, v in loaded.state_dict().items():
        np.testing.assert_array_equal(v, want[k].astype(v.dtype), err_msg=k)


def _logits(m, ids):
    with no_grad():
        return m(ids)


CASES = [
    (LLAMA, "llama"),
    (QWEN2, "qwen2"),
    (QWEN3, "qwen3"),
    (QWEN3_MOE, "qwen3moe"),
    (MIXTRAL, "llama"),
    (QWEN2_MOE, "qwen2moe"),
    (OLMOE, "olmoe"),
    (GEMMA2, "gemma2"),
    (GEMMA3, "gemma3"),
    (SMOLLM3, "smollm3"),
    (PHI3, "phi3"),
    (GRANITE, "granite"),
    (GRANITE_MOE, "granitemoe"),
    (GRANITE_SHARED, "granitemoe"),
    (GRANITE4, "granite"),
    (GRANITE4_MOE, "granitemoe"),
    (GRANITE4_HYBRID, "granitehybrid"),
    (LFM2, "lfm2"),
    (LFM2_MOE, "lfm2moe"),
    (OLMO2, "olmo2"),
    (OLMO3, "olmo2"),
    (EXAONE4, "exaone4"),
    (ERNIE4_5, "ernie4_5"),
    (GLM4, "glm4"),
    (MINISTRAL3, "mistral3"),
    (ARCEE, "arcee"),
    (OLMO, "olmo"),
    (OLMO_CLIP, "olmo"),
    (APERTUS, "apertus"),
    (FALCON_H1, "falcon-h1"),
    (FALCON_H1_ROUNDED, "falcon-h1"),
    (NEMOTRON_H, "nemotron_h"),
    (NEMOTRON_H_MOE, "nemotron_h_moe"),
    (MAMBA2, "mamba2"),
    (COHERE2, "cohere2"),
    (COMMAND_R, "command-r"),
    (COMMAND_R_PLUS, "command-r"),
    (HUNYUAN, "hunyuan-dense"),
    (GPTNEOX, "gptneox"),
    (PHI2, "phi2"),
    (STABLELM2, "stablelm"),
    (STABLELM2_12B, "stablelm"),
    (GPT2, "gpt2"),
    (STARCODER2, "starcoder2"),
]


# each case's name: its architecture, or the family where one architecture holds two (Mixtral's llama
# files, OLMo 3's olmo2 files, GraniteMoeShared's and Granite 4.0's granite and granitemoe files)
_CASE_NAMES = {"mixtral": "mixtral", "olmo3": "olmo3", "granitemoeshared": "granitemoeshared"}
IDS = [
    _CASE_NAMES.get(c["model_type"], a if c["model_type"] != "granitemoehybrid" else f"granite4-{a}")
    + ("-rounded" if c is FALCON_H1_ROUNDED else "")
    + ("-plus" if c is COMMAND_R_PLUS else "")
    + ("-12b" if c is STABLELM2_12B else "")
    + ("-clip" if c is OLMO_CLIP else "")
    for c, a in CASES
]


def _cases(*names):
    """The ``CASES`` of these names (``IDS``; an index would move as families are added)."""
    by = dict(zip(IDS, CASES))
    return pytest.mark.parametrize("config, arch", [by[a] for a in names], ids=list(names))


@pytest.mark.parametrize("config, arch", CASES, ids=IDS)
def test_f32_file_is_the_source_model(tmp_path, config, arch):
    _write(tmp_path / "m.gguf", config, _state(config), Q.F32, arch)
    loaded = CausalLM.from_gguf(tmp_path / "m.gguf")
    want = _falcon_h1_folded(_state(config), config)  # a Falcon-H1's multipliers in its weights, as written
    if arch in _GEMMAS:  # (w + 1) - 1 in float32: w to within a rounding of 1
        for k in want:
            if k.endswith("norm.weight"):
                np.testing.assert_allclose(loaded.state_dict()[k], want[k], rtol=0, atol=2**-23, err_msg=k)
                want[k] = (want[k] + np.float32(1)) - np.float32(1)
    for k in want:
        if k.endswith(("mamba.A_log", "mixer.A_log")):  # log(-(-exp(a))) in float32: a to within a few roundings
            np.testing.assert_allclose(loaded.state_dict()[k], want[k], rtol=2**-21, atol=2**-22, err_msg=k)
            want[k] = np.log(np.exp(want[k]).astype(np.float64)).astype(np.float32)
    assert set(loaded.state_dict()) == set(want)
    for k, v in want.items():
        np.testing.assert_array_equal(loaded.state_dict()[k], v, err_msg=k)
    ids = np.random.default_rng(1).integers(0, config["vocab_size"], (2, 6))
    np.testing.assert_array_equal(_logits(loaded, ids), _logits(CausalLM.from_hf(want, _file_config(config)), ids))
    if arch == "smollm3":  # llama.cpp's NoPE layers: every fourth
        assert loaded.config.rope_layers == (True, True, True, False)
    if arch == "gemma2":  # the file's softcaps, not Gemma2Config's defaults (50, 30)
        assert (loaded.config.attn_logit_softcapping, loaded.config.final_logit_softcapping) == (20.0, 35.0)


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
@pytest.mark.parametrize("config, arch", CASES, ids=IDS)
def test_quantized_file_is_its_dequantized_model(tmp_path, config, arch, qtype):
    sd = _state(config)
    held = _write(tmp_path / "m.gguf", config, sd, qtype, arch)
    want = _hf_values(held, sd, config, arch)
    loaded = CausalLM.from_gguf(tmp_path / "m.gguf")
    _assert_holds(loaded, want)
    if arch in _PERMUTED:  # the permutation matters: the file's rows are not Hugging Face's
        i = min(int(n.split(".")[1]) for n in held if n.endswith("attn_q.weight"))  # (a hybrid's first attention)
        q = next(k for k in want if k.startswith(f"model.layers.{i}.") and k.endswith("q_proj.weight"))
        assert not np.array_equal(held[f"blk.{i}.attn_q.weight"], want[q])
    ids = np.random.default_rng(1).integers(0, config["vocab_size"], (2, 6))
    got = _logits(loaded, ids)
    assert np.isfinite(got).all() and np.abs(got).max() > 0, "the model overflowed: equal logits would say nothing"
    np.testing.assert_array_equal(got, _logits(CausalLM.from_hf(want, _file_config(config)), ids))
    # close to the source model too (a router's near-tie may pick another expert after rounding: no such
    # bound for the MoE models; SmolLM3's four layers and tied head, logits up to 55, take Q8_0's to 5%,
    # Phi-3's tied head, logits up to 64, to 4%, LFM2's, logits up to 55, to 3.1%, OLMo's, logits up
    # to 6, to 4.5%, GPT-NeoX's, logits up to 5, to 3.4%, and StableLM 2's, logits up to 5, to 3.1%; Nemotron-H's relu2
    # squares and Mamba-2 steps take BF16's and Q8_0's roundings to 5% and 14%: F16's alone, 0.8%; Mamba-2's
    # blocks alone, logits up to 6, Q8_0's to 5.7%)
    moe = config["model_type"] in ("qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "lfm2_moe", *_GRANITE_MOES)
    moe = moe or "n_routed_experts" in config  # (Nemotron 3's)
    coarse = arch in ("nemotron_h", "nemotron_h_moe") and qtype != Q.F16
    if (
        not moe
        and not coarse
        and (
            qtype in (Q.F16, Q.BF16)
            or (qtype == Q.Q8_0 and arch not in ("smollm3", "phi3", "lfm2", "olmo", "gptneox", "stablelm", "mamba2"))
        )
    ):
        ref = _source_logits(config)
        assert np.abs(got - ref).max() <= 0.03 * np.abs(ref).max()


# the types of GGUF_TYPES beyond the first eight, each on a model whose q/k rows llama.cpp permutes
# and on one whose experts' gate and up are joined again (present in the installed gguf: NVFP4 is newer)
_MORE_TYPES = [
    getattr(Q, n)
    for n in ("Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S")
    + ("IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4", "NVFP4")
    if hasattr(Q, n)
]


@pytest.mark.parametrize("qtype", _MORE_TYPES, ids=lambda q: q.name)
@_cases("llama", "qwen3moe", "qwen2moe")
def test_every_type_of_the_released_mixes_is_gguf_s_dequantization(tmp_path, config, arch, qtype):
    """Q3_K_M, IQ4_XS, MXFP4_MOE, ... files: each tensor is what gguf.quants.dequantize makes of
    the file's blocks (bit for bit), the model's logits those of its dequantized weights."""
    from npattn.models.gguf import GGUF_TYPES, _dequantizes

    assert qtype.name in GGUF_TYPES
    if not _dequantizes(qtype.name):
        pytest.skip(f"the installed gguf does not dequantize {qtype.name}")
    sd = _state(config)
    held = _write(tmp_path / "m.gguf", config, sd, qtype, arch)
    want = _hf_values(held, sd, config, arch)
    loaded = CausalLM.from_gguf(tmp_path / "m.gguf")
    _assert_holds(loaded, want)
    ids = np.random.default_rng(1).integers(0, config["vocab_size"], (2, 6))
    got = _logits(loaded, ids)
    assert np.isfinite(got).all()  # the scales are sane: the comparison below compares numbers
    np.testing.assert_array_equal(got, _logits(CausalLM.from_hf(want, config), ids))


def test_a_type_the_installed_gguf_cannot_dequantize_is_refused_by_name(tmp_path, monkeypatch):
    from npattn.models import gguf as G

    _write(tmp_path / "q4k.gguf", LLAMA, _model(LLAMA).state_dict(), Q.Q4_K, "llama")
    real = gguf.quants.dequantize

    def older(data, qtype):  # as a gguf release from before Q4_K's numpy dequantization
        if qtype == Q.Q4_K:
            raise NotImplementedError("Dequantization for Q4_K is not yet implemented")
        return real(data, qtype)

    G._dequantizes.cache_clear()
    try:
        with monkeypatch.context() as mp:
            mp.setattr(gguf.quants, "dequantize", older)
            with pytest.raises(ValueError, match=r"tensor '\S+' has type Q4_K, which the installed gguf does not"):
                CausalLM.from_gguf(tmp_path / "q4k.gguf")
    finally:
        G._dequantizes.cache_clear()
    assert G._dequantizes("Q4_K")


def test_unknown_type_and_architecture_are_refused(tmp_path):
    src = _model(LLAMA)
    _write(tmp_path / "q81.gguf", LLAMA, src.state_dict(), Q.Q8_1, "llama")  # gguf has no dequantization of it
    with pytest.raises(ValueError, match=r"tensor 'token_embd.weight' has type Q8_1, which npattn does not read"):
        CausalLM.from_gguf(tmp_path / "q81.gguf")
    w = gguf.GGUFWriter(str(tmp_path / "bloom.gguf"), "bloom")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"general.architecture 'bloom' is not supported"):
        CausalLM.from_gguf(tmp_path / "bloom.gguf")
    (tmp_path / "not.gguf").write_bytes(b"GGUX" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        CausalLM.from_gguf(tmp_path / "not.gguf")
    with pytest.raises(FileNotFoundError):
        CausalLM.from_gguf(tmp_path / "missing.gguf")


def test_a_split_file_is_refused_as_one_part_of_several(tmp_path, monkeypatch):
    """llama.cpp's gguf-split spreads a model's tensors over name-00001-of-0000N.gguf files (the
    metadata in the first); each part is refused as such (they read as a model missing most of
    its tensors, or as one of no architecture)."""
    real = gguf.GGUFWriter.__init__
    monkeypatch.setattr(gguf.GGUFWriter, "__init__", lambda self, *a, **k: real(self, *a, **k, split_max_tensors=10))
    _write(tmp_path / "m.gguf", QWEN3, _model(QWEN3).state_dict(), Q.F32, "qwen3")
    parts = sorted(p.name for p in tmp_path.iterdir())
    assert parts == [f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    for i, name in enumerate(parts):
        with pytest.raises(ValueError, match=rf"{name}: part {i + 1} of 3 of a split GGUF model.*--merge"):
            CausalLM.from_gguf(tmp_path / name)


@pytest.mark.parametrize("qtype", [Q.F32, Q.BF16, Q.Q8_0, Q.Q4_K], ids=lambda q: q.name)
@pytest.mark.parametrize(
    "config, arch, classes",
    [
        (QWEN2, "qwen2", ("Qwen2Config", "Qwen2ForCausalLM")),
        (QWEN3_MOE, "qwen3moe", ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")),
        (MIXTRAL, "llama", ("MixtralConfig", "MixtralForCausalLM")),
        (QWEN2_MOE, "qwen2moe", ("Qwen2MoeConfig", "Qwen2MoeForCausalLM")),
        (OLMOE, "olmoe", ("OlmoeConfig", "OlmoeForCausalLM")),
        (GEMMA2, "gemma2", ("Gemma2Config", "Gemma2ForCausalLM")),
        (GEMMA3, "gemma3", ("Gemma3TextConfig", "Gemma3ForCausalLM")),
        (SMOLLM3, "smollm3", ("SmolLM3Config", "SmolLM3ForCausalLM")),
        (PHI3, "phi3", ("Phi3Config", "Phi3ForCausalLM")),
        (PHI3_MINI, "phi3", ("Phi3Config", "Phi3ForCausalLM")),
        (GRANITE, "granite", ("GraniteConfig", "GraniteForCausalLM")),
        (GRANITE_MOE, "granitemoe", ("GraniteMoeConfig", "GraniteMoeForCausalLM")),
        (GRANITE_SHARED, "granitemoe", ("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM")),
        (GRANITE4, "granite", ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM")),
        (GRANITE4_MOE, "granitemoe", ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM")),
        (GRANITE4_HYBRID, "granitehybrid", ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM")),
        (GRANITE4_HYBRID_BIASES, "granitehybrid", ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM")),
        (LFM2, "lfm2", ("Lfm2Config", "Lfm2ForCausalLM")),
        (LFM2_MOE, "lfm2moe", ("Lfm2MoeConfig", "Lfm2MoeForCausalLM")),
        (OLMO2, "olmo2", ("Olmo2Config", "Olmo2ForCausalLM")),
        (OLMO2_YARN, "olmo2", ("Olmo2Config", "Olmo2ForCausalLM")),
        (OLMO3, "olmo2", ("Olmo3Config", "Olmo3ForCausalLM")),
        (EXAONE4, "exaone4", ("Exaone4Config", "Exaone4ForCausalLM")),
        (EXAONE4_1_2B, "exaone4", ("Exaone4Config", "Exaone4ForCausalLM")),
        (ERNIE4_5, "ernie4_5", ("Ernie4_5Config", "Ernie4_5ForCausalLM")),
        (GLM4, "glm4", ("Glm4Config", "Glm4ForCausalLM")),
        (MINISTRAL3, "mistral3", ("Ministral3Config", "Ministral3ForCausalLM")),
        (ARCEE, "arcee", ("ArceeConfig", "ArceeForCausalLM")),
        (OLMO, "olmo", ("OlmoConfig", "OlmoForCausalLM")),
        (OLMO_CLIP, "olmo", ("OlmoConfig", "OlmoForCausalLM")),
        (APERTUS, "apertus", ("ApertusConfig", "ApertusForCausalLM")),
        (FALCON_H1, "falcon-h1", ("FalconH1Config", "FalconH1ForCausalLM")),
        (FALCON_H1_ROUNDED, "falcon-h1", ("FalconH1Config", "FalconH1ForCausalLM")),
        (NEMOTRON_H, "nemotron_h", ("NemotronHConfig", "NemotronHForCausalLM")),
        (NEMOTRON_H_MOE, "nemotron_h_moe", ("NemotronHConfig", "NemotronHForCausalLM")),
        (MAMBA2, "mamba2", ("Mamba2Config", "Mamba2ForCausalLM")),
        (COHERE2, "cohere2", ("Cohere2Config", "Cohere2ForCausalLM")),
        (COMMAND_R, "command-r", ("CohereConfig", "CohereForCausalLM")),
        (COMMAND_R_PLUS, "command-r", ("CohereConfig", "CohereForCausalLM")),
        (HUNYUAN, "hunyuan-dense", ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM")),
        (GPTNEOX, "gptneox", ("GPTNeoXConfig", "GPTNeoXForCausalLM")),
        (PHI2, "phi2", ("PhiConfig", "PhiForCausalLM")),
        (STABLELM2, "stablelm", ("StableLmConfig", "StableLmForCausalLM")),
        (STABLELM2_12B, "stablelm", ("StableLmConfig", "StableLmForCausalLM")),
        (GPT2, "gpt2", ("GPT2Config", "GPT2LMHeadModel")),
        (STARCODER2, "starcoder2", ("Starcoder2Config", "Starcoder2ForCausalLM")),
    ],
    ids=[
        "qwen2",
        "qwen3moe",
        "mixtral",
        "qwen2moe",
        "olmoe",
        "gemma2",
        "gemma3",
        "smollm3",
        "phi3",
        "phi3-window",
        "granite",
        "granitemoe",
        "granitemoeshared",
        "granite4-granite",
        "granite4-granitemoe",
        "granite4-granitehybrid",
        "granite4-granitehybrid-biases",
        "lfm2",
        "lfm2moe",
        "olmo2",
        "olmo2-yarn",
        "olmo3",
        "exaone4",
        "exaone4-1.2b",
        "ernie4_5",
        "glm4",
        "ministral3",
        "arcee",
        "olmo",
        "olmo-clip",
        "apertus",
        "falcon-h1",
        "falcon-h1-rounded",
        "nemotron_h",
        "nemotron_h_moe",
        "mamba2",
        "cohere2",
        "command-r",
        "command-r-plus",
        "hunyuan-dense",
        "gptneox",
        "phi2",
        "stablelm",
        "stablelm-12b",
        "gpt2",
        "starcoder2",
    ],
)
def test_logits_equal_transformers_on_the_dequantized_weights(tmp_path, config, arch, classes, qtype):
    """The file read in float64 is transformers' model (float64, eager) whose weights are the
    values the file holds, in Hugging Face's conventions (its config the source's, a Falcon-H1's
    without the multipliers its converter folded into those values; Phi-3's checkpoint fused).
    Sequences of 7: past Phi-3's switch to the long factors (at 4)."""
    torch = pytest.importorskip("torch")
    T = pytest.importorskip("transformers")
    from _hf64 import hf_logits
    from _oracles import rel_err

    sd = _state(config)
    want = _hf_values(_write(tmp_path / "m.gguf", config, sd, qtype, arch), sd, config, arch)
    hf = _hf_model(T, classes, _file_config(config))
    checkpoint = {
        "phi3": _phi3_checkpoint,
        "glm4": lambda v: _phi3_checkpoint(v, _GLM4_FUSED),
        "gptneox": lambda v: _gptneox_checkpoint(v, config["num_attention_heads"]),
        "stablelm": _stablelm_checkpoint,
        "gpt2": _gpt2_checkpoint,
        "mamba2": lambda v: {k.replace("model.", "backbone.", 1): x for k, x in v.items()},  # Mamba2Model's names
    }.get(arch, _granite_checkpoint)(want)
    missing, unexpected = hf.load_state_dict(
        {k: torch.from_numpy(v.astype(np.float64)) for k, v in checkpoint.items()}, strict=False
    )
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # Gemma's head is the embedding
    if missing:  # then tied: every parameter the file's (none left from the build or an earlier case)
        assert hf.get_output_embeddings().weight is hf.get_input_embeddings().weight
    loaded = CausalLM.from_gguf(tmp_path / "m.gguf", dtype=np.float64)
    ids = np.random.default_rng(1).integers(0, config["vocab_size"], (2, 7))
    assert rel_err(_logits(loaded, ids), hf_logits(hf, ids), floor=1e-300, relative_to="max_b") < 1e-9


_HF: list = []  # [(key, model)]: the last model _hf_model built


def _hf_model(T, classes, config):
    """transformers' float64 eager model of ``config`` (``_hf64.build``), the last one kept for the
    next case: a config's cases come in a row, and each loads every parameter before use (its
    random weights are never compared: building them is most of a case's time).  A Nemotron-H
    of ``time_step_min`` 0 (llama.cpp's scan, which clips no step) is built with a positive one
    (NemotronHPreTrainedModel's initialisation takes its log), then its mixers' clip set to 0."""
    from _hf64 import build

    key = (classes, json.dumps(config, sort_keys=True))
    if not _HF or _HF[0][0] != key:
        kwargs = {k: v for k, v in config.items() if k != "model_type"}
        unclipped = config["model_type"] == "nemotron_h" and config.get("time_step_min") == 0
        if unclipped:
            kwargs["time_step_min"] = 1e-300
        hf = build(getattr(T, classes[0]), getattr(T, classes[1]), **kwargs)[0]
        if unclipped:
            for module in hf.modules():
                if hasattr(module, "time_step_limit"):
                    module.time_step_limit = (0.0, math.inf)
        _HF[:] = [(key, hf)]
    return _HF[0][1]


def _rope_freqs(config) -> np.ndarray:
    """``rope_freqs.weight`` as llama.cpp's converter computes it from a Llama 3 ``rope_scaling``
    (``LlamaModel.generate_extra_tensors``): float32 frequencies, one divisor per pair."""
    rs, dim = config["rope_scaling"], config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    freqs = 1.0 / (config["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    old = rs["original_max_position_embeddings"]
    low, high = old / rs["low_freq_factor"], old / rs["high_freq_factor"]
    divisors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high:
            divisors.append(1)
        elif wavelen > low:
            divisors.append(rs["factor"])
        else:
            smooth = (old / wavelen - rs["low_freq_factor"]) / (rs["high_freq_factor"] - rs["low_freq_factor"])
            divisors.append(1 / ((1 - smooth) / rs["factor"] + smooth))
    return np.array(divisors, np.float32)


def _llama3(factor: float) -> dict:
    """A llama config with Llama 3's RoPE scaling (3.1's factor 8, 3.2's 32), a base at which its
    64-dimensional heads have pairs of all three kinds: kept, divided by the factor, in between."""
    scaling = dict(rope_type="llama3", factor=factor, low_freq_factor=1.0, high_freq_factor=4.0)
    return dict(LLAMA, rope_theta=500000.0, rope_scaling=dict(scaling, original_max_position_embeddings=8192))


@pytest.mark.parametrize("factor", [8.0, 32.0])
def test_llama3_rope_freqs_are_its_rope_scaling(tmp_path, factor):
    """Llama 3.x files carry their RoPE scaling as the tensor rope_freqs.weight (no metadata):
    read as the config's rope_scaling, the file is the source model, logits bit for bit, and
    transformers' (float64) on the same weights; the saved directory has that rope_scaling."""
    config = _llama3(factor)
    divisors = _rope_freqs(config)
    assert len(set(divisors.tolist())) > 3  # kept, divided and in-between pairs
    src = _model(config)
    _write(tmp_path / "m.gguf", config, src.state_dict(), Q.F32, "llama", [("rope_freqs.weight", divisors)])
    loaded = CausalLM.from_gguf(tmp_path / "m.gguf")
    ids = np.random.default_rng(1).integers(0, config["vocab_size"], (2, 6))
    np.testing.assert_array_equal(_logits(loaded, ids), _logits(src, ids))
    loaded.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert {k: saved["rope_scaling"][k] for k in config["rope_scaling"]} == config["rope_scaling"]
    torch = pytest.importorskip("torch")
    T = pytest.importorskip("transformers")
    from _hf64 import build, hf_logits
    from _oracles import rel_err

    hf, _ = build(T.LlamaConfig, T.LlamaForCausalLM, **{k: v for k, v in config.items() if k != "model_type"})
    hf.load_state_dict({k: torch.from_numpy(v.astype(np.float64)) for k, v in src.state_dict().items()})
    ref = hf_logits(hf, ids)
    got = _logits(CausalLM.from_gguf(tmp_path / "m.gguf", dtype=np.float64), ids)
    assert rel_err(got, ref, floor=1e-300, relative_to="max_b") < 1e-9


def test_rope_freqs_of_no_llama3_scaling_are_refused_by_name(tmp_path):
    """Divisors Llama 3's converter would not write (one pair moved by 1 %, or too few) are refused
    naming the tensor, not read as another network."""
    config = _llama3(8.0)
    sd = _model(config).state_dict()
    moved = _rope_freqs(config)
    moved[20] *= 1.01
    for i, divisors in enumerate((moved, _rope_freqs(config)[:-1])):
        _write(tmp_path / f"{i}.gguf", config, sd, Q.F32, "llama", [("rope_freqs.weight", divisors)])
        with pytest.raises(ValueError, match=r"tensor 'rope_freqs.weight' holds RoPE divisors that are not Llama 3"):
            CausalLM.from_gguf(tmp_path / f"{i}.gguf")


def test_what_llama_cpp_derives_rather_than_reads():
    """Gemma 3: no sliding window means every layer full; the 62-layer (27B) model scales its
    scores by hidden/heads (Gemma's query_pre_attn_scalar of 168), the others by head_dim; an
    unknown RoPE scaling is refused by name.  Qwen3-MoE: no expert count is refused by name, and
    the experts' width defaults to feed_forward_length / expert_used_count (llama.cpp's)."""
    from npattn.models.configs import GGUF_FAMILIES

    gemma = GGUF_FAMILIES["gemma3"].derive
    c = dict(num_hidden_layers=62, hidden_size=5376, num_attention_heads=32, head_dim=128, rope_theta=1e6)
    gemma(c, {"attention.sliding_window": 1024})
    assert c["query_pre_attn_scalar"] == 168 and c["sliding_window"] == 1024
    assert c["layer_types"][4:7] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert c["rope_parameters"] == {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    }
    c = dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=2, head_dim=16)
    gemma(c, {})
    assert c["layer_types"] == ["full_attention"] * 4 and "sliding_window" not in c
    assert c["query_pre_attn_scalar"] == 16
    with pytest.raises(ValueError, match=r"'gemma3.rope.scaling.type' 'yarn' is not supported"):
        gemma(dict(c), {"rope.scaling.type": "yarn"})
    with pytest.raises(ValueError, match=r"'gemma3.rope.scaling.factor' missing"):
        gemma(dict(c), {"rope.scaling.type": "linear"})
    gemma2 = GGUF_FAMILIES["gemma2"].derive  # the 46-layer (27B) model: hidden/heads = 144
    c = dict(num_hidden_layers=46, hidden_size=4608, num_attention_heads=32, head_dim=128)
    gemma2(c, {})
    assert c["query_pre_attn_scalar"] == 144 and c["sliding_window"] == 4096
    assert c["layer_types"][:3] == ["sliding_attention", "full_attention", "sliding_attention"]
    c = dict(num_hidden_layers=26, hidden_size=2304, num_attention_heads=8, head_dim=256)
    gemma2(c, {"attention.sliding_window": 512})
    assert c["query_pre_attn_scalar"] == 256 and c["sliding_window"] == 512
    moe = GGUF_FAMILIES["qwen3moe"].derive
    with pytest.raises(ValueError, match=r"'qwen3moe.expert_count' missing or 0 \(the model's num_experts\)"):
        moe(dict(intermediate_size=64, num_experts_per_tok=2), {})
    c = dict(intermediate_size=64, num_experts=8, num_experts_per_tok=2)
    moe(c, {})
    assert c["moe_intermediate_size"] == 32


def test_what_llama_cpp_derives_for_its_moe_files():
    """llama.cpp's qwen2moe: no expert count refused by name, the experts' width
    feed_forward_length / expert_used_count and the shared expert's feed_forward_length where the
    file gives none, q/k/v biases as Qwen2MoeConfig's qkv_bias.  olmoe: no expert count refused.
    llama: with expert_count a Mixtral model (without, Llama's), its biases refused by name."""
    from npattn.models.configs import GGUF_FAMILIES

    qwen = GGUF_FAMILIES["qwen2moe"].derive
    with pytest.raises(ValueError, match=r"'qwen2moe.expert_count' missing or 0 \(the model's num_experts\)"):
        qwen(dict(intermediate_size=64, num_experts_per_tok=2, attention_bias=True), {})
    c = dict(intermediate_size=64, num_experts=8, num_experts_per_tok=4, attention_bias=True)
    qwen(c, {})
    assert (c["moe_intermediate_size"], c["shared_expert_intermediate_size"], c["qkv_bias"]) == (16, 64, True)
    assert "attention_bias" not in c
    with pytest.raises(ValueError, match=r"'olmoe.expert_used_count' missing or 0 \(the model's num_experts_per_tok\)"):
        GGUF_FAMILIES["olmoe"].derive(dict(num_experts=8, num_experts_per_tok=0), {})
    llama = GGUF_FAMILIES["llama"].derive
    c = dict(model_type="llama", attention_bias=False)
    llama(c, {"expert_count": 0})
    assert c == dict(model_type="llama", attention_bias=False)
    llama(c, {"expert_count": 8, "expert_used_count": 2})
    assert c == dict(model_type="mixtral", num_local_experts=8, num_experts_per_tok=2)
    with pytest.raises(ValueError, match=r"'llama.expert_used_count' missing or 0"):
        llama(dict(model_type="llama", attention_bias=False), {"expert_count": 8})


@pytest.mark.parametrize("name", ["mixtral", "qwen2moe", "olmoe"])
def test_moe_files_read_as_llama_cpp_routes_them(tmp_path, name):
    """The family each file is, and llama.cpp's routing: Mixtral's top k renormalised, Qwen2-MoE's
    and OLMoE's not (whatever the source config said: llama.cpp has no such key), every layer
    routed; a Mixtral file with attention biases is refused by name."""
    config, arch = dict(zip(IDS, CASES))[name]
    _write(tmp_path / "m.gguf", config, _model(config).state_dict(), Q.F32, arch)
    cfg = CausalLM.from_gguf(tmp_path / "m.gguf").config
    assert cfg.model_type == config["model_type"] and set(cfg.mlp_types) == {"moe"}
    assert cfg.moe.norm_topk_prob == (name == "mixtral")
    assert (cfg.moe.shared_intermediate_size is not None) == (name == "qwen2moe")
    if name == "mixtral":
        sd = _model(config).state_dict()
        for i in range(config["num_hidden_layers"]):
            for p in ("q", "k", "v", "o"):
                rows = sd[f"model.layers.{i}.self_attn.{p}_proj.weight"].shape[0]
                sd[f"model.layers.{i}.self_attn.{p}_proj.bias"] = np.ones(rows, np.float32)
        _write(tmp_path / "b.gguf", config, sd, Q.F32, arch)
        with pytest.raises(
            ValueError, match=r"b.gguf: tensor 'blk.0.attn_q.bias' in a llama file with experts: Mixtral's"
        ):
            CausalLM.from_gguf(tmp_path / "b.gguf")


def test_a_shared_expert_gate_kept_as_a_vector_is_the_same_model(tmp_path, monkeypatch):
    """llama.cpp reads ffn_gate_inp_shexp as {n_embd}: a file that keeps it 1-D (H,) rather than
    the checkpoint's (1, H) loads into the same model."""
    sd = _model(QWEN2_MOE).state_dict()
    _write(tmp_path / "row.gguf", QWEN2_MOE, sd, Q.F32, "qwen2moe")
    real = gguf.GGUFWriter.add_tensor

    def flat(self, name, value, *args, **kwargs):
        return real(
            self, name, value.reshape(-1) if name.endswith("ffn_gate_inp_shexp.weight") else value, *args, **kwargs
        )

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", flat)
    _write(tmp_path / "vec.gguf", QWEN2_MOE, sd, Q.F32, "qwen2moe")
    monkeypatch.undo()
    shapes = {t.name: tuple(t.shape) for t in gguf.GGUFReader(str(tmp_path / "vec.gguf")).tensors}
    assert shapes["blk.0.ffn_gate_inp_shexp.weight"] == (256,)
    row, vec = CausalLM.from_gguf(tmp_path / "row.gguf"), CausalLM.from_gguf(tmp_path / "vec.gguf")
    for k, v in row.state_dict().items():
        np.testing.assert_array_equal(vec.state_dict()[k], v, err_msg=k)


_GRANITE_DIRECTORIES = {
    **{n: c for n, c in zip(IDS, CASES) if n in ("granitemoeshared", "granite4-granite", "granite4-granitemoe")},
    "granite4-granitehybrid": (GRANITE4_HYBRID, "granitehybrid"),
    "granite4-granitehybrid-biases": (GRANITE4_HYBRID_BIASES, "granitehybrid"),
}


@pytest.mark.parametrize("config, arch", _GRANITE_DIRECTORIES.values(), ids=_GRANITE_DIRECTORIES.keys())
def test_a_granite_file_is_its_model_s_directory(tmp_path, config, arch):
    """The file and the source model's own directory (save_pretrained: the shared MLP fused as
    input_linear, the experts under the released names; read back by from_pretrained) are one
    model: the same config, tensors and logits (an epsilon float32 holds exactly: the file's is
    float32).  A Mamba-2 layer's A_log is the file's -exp(A_log) read back (log(-A)): to within
    a few float32 roundings, the logits those of the directory's model holding it."""
    _file_is_its_directory(tmp_path, dict(config, rms_norm_eps=2.0**-20), arch)


def _file_is_its_directory(tmp_path, config: dict, arch: str):
    """A float32 file of a model of ``config`` and the model's own directory, read back: the same
    config (but the metadata), state-dict keys, tensors (a Mamba-2 layer's ``A_log`` to within a
    few float32 roundings: the file's ``-exp(A_log)`` read back) and logits (the directory's model
    holding the file's ``A_log``).  Returns ``(the file's model, the ids, the metadata not compared)``."""
    src = _model(config)
    _write(tmp_path / "m.gguf", config, src.state_dict(), Q.F32, arch)
    src.save_pretrained(tmp_path / "dir")
    g, d = CausalLM.from_gguf(tmp_path / "m.gguf"), CausalLM.from_pretrained(tmp_path / "dir")
    meta = dict(hf={}, bos_token_id=None, eos_token_id=None, max_position_embeddings=None, pad_token_id=None)
    assert g.config.replace(**meta) == d.config.replace(**meta)
    assert set(g.state_dict()) == set(d.state_dict())
    held = d.state_dict()
    for k, v in d.state_dict().items():
        if k.endswith(".A_log"):
            np.testing.assert_allclose(g.state_dict()[k], v, rtol=2**-21, atol=2**-22, err_msg=k)
            held[k] = g.state_dict()[k]
        else:
            np.testing.assert_array_equal(g.state_dict()[k], v, err_msg=k)
    d.load_state_dict(held)
    ids = np.random.default_rng(1).integers(0, config["vocab_size"], (2, 6))
    np.testing.assert_array_equal(_logits(g, ids), _logits(d, ids))
    return g, ids, meta


def test_granite_numbers_as_llama_cpp_reads_them():
    """llama.cpp's granite/granitemoe: logit_scale required (> 0); embedding_scale and
    residual_scale absent or 0 mean 1; attention.scale absent or 0 means 1/sqrt(head_dim) (not
    GraniteConfig's 1); rope.scaling.finetuned false (no RoPE) refused; a granitemoe file without
    its experts' counts refused, each by name."""
    from npattn.models.configs import GGUF_FAMILIES

    derive = GGUF_FAMILIES["granite"].derive
    c = dict(model_type="granite", num_hidden_layers=2, head_dim=64, logits_scaling=8.0, residual_multiplier=0.0)
    derive(c, {"rope.scaling.finetuned": True})
    assert (c["embedding_multiplier"], c["residual_multiplier"], c["attention_multiplier"]) == (1.0, 1.0, 0.125)
    c = dict(model_type="granite", num_hidden_layers=2, head_dim=64, logits_scaling=8.0, attention_multiplier=0.015625)
    derive(c, {})
    assert c["attention_multiplier"] == 0.015625
    with pytest.raises(ValueError, match=r"metadata 'granite.logit_scale' missing \(the model's logits_scaling"):
        derive(dict(model_type="granite", num_hidden_layers=2, head_dim=64), {})
    with pytest.raises(ValueError, match=r"metadata 'granitemoe.logit_scale': expected a finite number > 0, got 0"):
        derive(dict(model_type="granitemoe", num_hidden_layers=2, head_dim=64, logits_scaling=0.0), {})
    with pytest.raises(ValueError, match=r"metadata 'granite.rope.scaling.finetuned' = False"):
        derive(
            dict(model_type="granite", num_hidden_layers=2, head_dim=64, logits_scaling=8.0),
            {"rope.scaling.finetuned": False},
        )
    moe = dict(model_type="granitemoe", num_hidden_layers=2, head_dim=64, logits_scaling=8.0, num_experts_per_tok=2)
    with pytest.raises(ValueError, match=r"'granitemoe.expert_count' missing or 0 \(the model's num_local_experts\)"):
        GGUF_FAMILIES["granitemoe"].derive(moe, {})


def test_granite_file_without_the_optional_numbers_is_llama_cpp_s_model(tmp_path, monkeypatch):
    """A granite file whose converter wrote no attention.scale, embedding_scale or residual_scale
    (their values 0 in the config) is read as llama.cpp builds it: the scores scaled by
    1/sqrt(head_dim), no embedding or residual factor; one without logit_scale is refused, naming
    the file."""
    config = dict(GRANITE, embedding_multiplier=0.0, residual_multiplier=0.0, attention_multiplier=0.0)
    sd = _model(GRANITE).state_dict()
    _write(tmp_path / "m.gguf", config, sd, Q.F32, "granite")
    loaded = CausalLM.from_gguf(tmp_path / "m.gguf")
    c = loaded.config
    assert (c.embed_scale, c.residual_multiplier, c.attention_scale, c.logits_scaling) == (False, 1.0, 0.125, 2.5)
    same = dict(GRANITE, embedding_multiplier=1.0, residual_multiplier=1.0, attention_multiplier=0.125)
    ids = np.random.default_rng(1).integers(0, config["vocab_size"], (2, 6))
    np.testing.assert_array_equal(_logits(loaded, ids), _logits(CausalLM.from_hf(loaded.state_dict(), same), ids))
    _write(tmp_path / "no.gguf", dict(GRANITE, logits_scaling=0.0), sd, Q.F32, "granite")
    with pytest.raises(ValueError, match=r"no.gguf: metadata 'granite.logit_scale' missing"):
        CausalLM.from_gguf(tmp_path / "no.gguf")


def test_which_granite_model_a_file_holds():
    """GraniteMoeModel's granitemoe file with a shared width is GraniteMoeShared; GraniteHybridModel's
    granite / granitemoe files (its ssm.* keys, head_count_kv per layer, expert counts of 0 in a
    granite file) are Granite 4.0 with RoPE; its granitehybrid file without Mamba layers is
    Granite 4.0 with RoPE where rope.scaling.finetuned, without where not."""
    from npattn.models.configs import GGUF_FAMILIES

    base = dict(num_hidden_layers=2, head_dim=64, logits_scaling=8.0, num_key_value_heads=[2, 2])
    ssm = {"ssm.conv_kernel": 4, "ssm.inner_size": 512, "rope.scaling.finetuned": True}
    c = dict(base, model_type="granitemoe", num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64)
    GGUF_FAMILIES["granitemoe"].derive(c, {})
    assert (c["model_type"], c["num_key_value_heads"]) == ("granitemoeshared", 2)
    c = dict(base, model_type="granite", num_local_experts=0, num_experts_per_tok=0, shared_intermediate_size=64)
    GGUF_FAMILIES["granite"].derive(c, ssm)
    assert (c["model_type"], c["layer_types"], c["position_embedding_type"]) == (
        "granitemoehybrid",
        ["attention"] * 2,
        "rope",
    )
    assert (c["num_local_experts"], c["num_experts_per_tok"], c["num_key_value_heads"]) == (0, 0, 2)
    c = dict(base, model_type="granitemoe", num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64)
    GGUF_FAMILIES["granitemoe"].derive(c, ssm)
    assert (c["model_type"], c["num_local_experts"]) == ("granitemoehybrid", 4)
    hybrid = GGUF_FAMILIES["granitehybrid"]
    c = dict(base, model_type="granitemoehybrid", shared_intermediate_size=64)
    hybrid.derive(c, {"rope.scaling.finetuned": False})
    assert (c["position_embedding_type"], c["num_local_experts"], c["logits_scaling"]) == ("nope", 0, 8.0)
    c = dict(base, model_type="granitemoehybrid", shared_intermediate_size=64)
    hybrid.derive(c, {})
    assert c["position_embedding_type"] == "rope"
    with pytest.raises(ValueError, match=r"metadata 'granitehybrid.logit_scale' missing"):
        hybrid.derive(dict(base, model_type="granitemoehybrid", shared_intermediate_size=64, logits_scaling=None), {})


@pytest.mark.parametrize(
    "family, changes, match",
    [
        (
            "granitemoe",
            dict(num_key_value_heads=[0, 2, 0], num_local_experts=4, num_experts_per_tok=2),
            r"metadata 'granitemoe.attention.head_count_kv' \[0, 2, 0\]: layers \[0, 2\] are Mamba-2 layers "
            r"\(head_count_kv 0\), which llama.cpp reads only from a granitehybrid file",
        ),
        (
            "granite",
            dict(num_key_value_heads=[2, 0, 2]),
            r"'granite.attention.head_count_kv' \[2, 0, 2\]: layers \[1\]",
        ),
        (
            "granitehybrid",
            dict(num_key_value_heads=0),  # every layer Mamba-2: then the ssm.* keys are needed
            r"metadata 'granitehybrid.ssm.conv_kernel': expected an integer >= 1 \(the Mamba-2 layers' "
            r"mamba_d_conv\), got None",
        ),
        ("granitehybrid", dict(num_key_value_heads=[2, 2]), r"\[2, 2\]: expected 3 counts \(block_count\)"),
        ("granitehybrid", dict(num_key_value_heads=[2, 1, 2]), r"\[2, 1, 2\]: the attention layers' counts differ"),
        (
            "granitehybrid",
            dict(shared_intermediate_size=0),
            r"metadata 'granitehybrid.expert_shared_feed_forward_length' missing or 0",
        ),
        ("granite", dict(num_local_experts=4), r"metadata 'granite.expert_count' = 4: a granite file has no experts"),
        ("granitehybrid", dict(num_local_experts=4), r"'granitehybrid.expert_used_count' missing or 0"),
    ],
)
def test_granite_files_refused_by_name(family, changes, match):
    """A Mamba-2 layer (head_count_kv 0: llama.cpp's recurrent layers) in a granite or granitemoe
    file, or without its sizes, per-layer counts that are not one per layer or differ, Granite 4.0
    without its shared width, experts in a granite file or without their top k."""
    from npattn.models.configs import GGUF_FAMILIES

    spec = GGUF_FAMILIES[family]
    c = dict(
        model_type=spec.model_type,
        num_hidden_layers=3,
        hidden_size=256,
        num_attention_heads=4,
        head_dim=64,
        logits_scaling=8.0,
        num_key_value_heads=[2, 2, 2],
        shared_intermediate_size=64,
    )
    c.update(changes)
    meta = {"ssm.inner_size": 512, "expert_count": changes.get("num_local_experts")}
    with pytest.raises(ValueError, match=match):
        spec.derive(c, meta)


@pytest.mark.parametrize("position", ["rope", "nope"])
def test_a_granitehybrid_file_without_mamba_layers_is_read(tmp_path, position):
    """GraniteHybridModel's own architecture (an older converter's all-attention file, or one
    written so): the source model, with RoPE or without as rope.scaling.finetuned says."""
    config = dict(GRANITE4_MOE, position_embedding_type=position)
    src = _model(config)
    _write(tmp_path / "m.gguf", config, src.state_dict(), Q.F32, "granitehybrid")
    loaded = CausalLM.from_gguf(tmp_path / "m.gguf")
    assert loaded.config.model_type == "granitemoehybrid"
    assert loaded.config.rope_layers == (None if position == "rope" else (False, False))
    for k, v in src.state_dict().items():
        np.testing.assert_array_equal(loaded.state_dict()[k], v, err_msg=k)
    ids = np.random.default_rng(1).integers(0, config["vocab_size"], (2, 6))
    np.testing.assert_array_equal(_logits(loaded, ids), _logits(src, ids))


_SSM = {
    "ssm.conv_kernel": 4,
    "ssm.state_size": 16,
    "ssm.group_count": 2,
    "ssm.inner_size": 512,
    "ssm.time_step_rank": 8,
    "rope.scaling.finetuned": False,
}


def _hybrid(**changes) -> dict:
    return dict(
        model_type="granitemoehybrid",
        num_hidden_layers=3,
        hidden_size=256,
        num_attention_heads=4,
        head_dim=64,
        logits_scaling=8.0,
        shared_intermediate_size=64,
        **changes,
    )


def test_a_granitehybrid_file_s_mamba2_layers_are_its_ssm_keys():
    """GraniteHybridModel's granitehybrid file: head_count_kv 0 marks a Mamba-2 layer, the others
    attention layers of that count (all Mamba-2: the query heads' count, read by no layer); the
    ssm.* keys are the mamba_* ones (time_step_rank the heads, inner_size mamba_expand *
    hidden_size = mamba_n_heads * mamba_d_head), the chunk size transformers' default."""
    from npattn.models.configs import GGUF_FAMILIES

    derive = GGUF_FAMILIES["granitehybrid"].derive
    c = _hybrid(num_key_value_heads=[0, 2, 0])
    derive(c, _SSM)
    assert c["layer_types"] == ["mamba", "attention", "mamba"] and c["num_key_value_heads"] == 2
    mamba = {k: v for k, v in c.items() if k.startswith("mamba_")}
    assert mamba == dict(
        mamba_d_conv=4,
        mamba_d_state=16,
        mamba_n_groups=2,
        mamba_n_heads=8,
        mamba_expand=2,
        mamba_d_head=64,
        mamba_chunk_size=256,
    )
    assert c["position_embedding_type"] == "nope"
    c = _hybrid(num_key_value_heads=[0, 0, 0])
    derive(c, _SSM)
    assert c["layer_types"] == ["mamba"] * 3 and c["num_key_value_heads"] == 4


@pytest.mark.parametrize(
    "meta, match",
    [
        ({"ssm.inner_size": 500}, r"'granitehybrid.ssm.inner_size' 500: expected a multiple of embedding_length 256"),
        (
            {"ssm.inner_size": 768, "ssm.time_step_rank": 5},
            r"'granitehybrid.ssm.inner_size' 768: expected a multiple of ssm.time_step_rank 5",
        ),
        ({"ssm.group_count": 3}, r"'granitehybrid.ssm.group_count' 3: expected a divisor of ssm.time_step_rank 8"),
        ({"ssm.state_size": 0}, r"'granitehybrid.ssm.state_size': expected an integer >= 1 \(the Mamba-2 layers' "),
        ({"ssm.time_step_rank": True}, r"'granitehybrid.ssm.time_step_rank': expected an integer >= 1"),
    ],
)
def test_inconsistent_mamba2_sizes_are_refused_by_name(meta, match):
    from npattn.models.configs import GGUF_FAMILIES

    with pytest.raises(ValueError, match=match):
        GGUF_FAMILIES["granitehybrid"].derive(_hybrid(num_key_value_heads=[0, 2, 0]), dict(_SSM, **meta))


def _flip_a(self, name, value, *args, **kwargs):
    """GGUFWriter.add_tensor writing one A of blk.0.ssm_a positive."""
    if name == "blk.0.ssm_a":
        value = value.copy()
        value[3] = -value[3]
    return _REAL_ADD_TENSOR(self, name, value, *args, **kwargs)


_REAL_ADD_TENSOR = gguf.GGUFWriter.add_tensor


def test_mamba2_tensors_that_are_not_the_metadata_s_are_refused_by_name(tmp_path, monkeypatch):
    """A file whose ssm.group_count is not its tensors' (in_proj's rows are 2 * inner + 2 *
    groups * state + heads) is refused naming the tensor and both shapes; an ssm_a holding an
    A that is not negative (no A_log has it) is refused naming it; and a granitehybrid file
    written without a Mamba-2 layer's dt bias names what is missing."""
    config = GRANITE4_HYBRID
    sd = _state(config)
    real = gguf.GGUFWriter.add_ssm_group_count
    monkeypatch.setattr(gguf.GGUFWriter, "add_ssm_group_count", lambda self, n: real(self, 4))
    _write(tmp_path / "g.gguf", config, sd, Q.F32, "granitehybrid")
    with pytest.raises(ValueError, match=r"in_proj.weight'\]: expected shape \(1160, 256\), got \(1096, 256\)"):
        CausalLM.from_gguf(tmp_path / "g.gguf")
    monkeypatch.undo()
    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", _flip_a)
    _write(tmp_path / "a.gguf", config, sd, Q.F32, "granitehybrid")
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"a.gguf: tensor 'blk.0.ssm_a': Mamba-2's A = -exp\(A_log\) must be negative"):
        CausalLM.from_gguf(tmp_path / "a.gguf")
    monkeypatch.setattr(
        gguf.GGUFWriter,
        "add_tensor",
        lambda self, name, *a, **k: None if name == "blk.0.ssm_dt.bias" else _REAL_ADD_TENSOR(self, name, *a, **k),
    )
    _write(tmp_path / "dt.gguf", config, sd, Q.F32, "granitehybrid")
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"no tensor 'blk.0.ssm_dt.bias' \(the model's '[a-z.0-9]*mamba.dt_bias'\)"):
        CausalLM.from_gguf(tmp_path / "dt.gguf")


def test_ernie4_5_rows_are_read_as_written_and_biases_refused(tmp_path):
    """An ernie4_5 file's q/k rows are the checkpoint's (its pairs (2i, 2i+1) are llama.cpp's
    normal RoPE: nothing to undo), and its heads are key_length wide (128 here, not 256 / 4): the
    model of the same weights saved as a Hugging Face directory and read back (its config.json),
    logits bit for bit.  A file with biases (ERNIE 4.5's use_bias, which llama.cpp's graph applies
    to q, k, v only) is refused naming the file and the tensor."""
    src = _model(ERNIE4_5)
    sd = src.state_dict()
    _write(tmp_path / "m.gguf", ERNIE4_5, sd, Q.F32, "ernie4_5")
    loaded = CausalLM.from_gguf(tmp_path / "m.gguf")
    c = loaded.config
    assert c.head_dim == 128 and c.rope_interleaved and c.tie_word_embeddings
    assert not (c.mlp_bias or c.attention_bias)
    src.save_pretrained(tmp_path / "dir")
    directory = CausalLM.from_pretrained(tmp_path / "dir")
    shape = ("head_dim", "num_key_value_heads", "rope", "rope_interleaved", "tie_word_embeddings")
    assert {k: getattr(c, k) for k in shape} == {k: getattr(directory.config, k) for k in shape}
    assert np.float32(c.rms_norm_eps) == np.float32(directory.config.rms_norm_eps)  # the file's float32
    ids = np.random.default_rng(1).integers(1, ERNIE4_5["vocab_size"], (2, 7))
    np.testing.assert_array_equal(_logits(loaded, ids), _logits(directory, ids))
    np.testing.assert_array_equal(
        loaded.state_dict()["model.layers.1.self_attn.k_proj.weight"], sd["model.layers.1.self_attn.k_proj.weight"]
    )
    biased = dict(ERNIE4_5, use_bias=True)
    _write(tmp_path / "b.gguf", biased, _model(biased).state_dict(), Q.F32, "ernie4_5")
    with pytest.raises(ValueError, match=r"b.gguf: tensor 'blk.0.attn_q.bias' in an ernie4_5 file: llama.cpp's"):
        CausalLM.from_gguf(tmp_path / "b.gguf")
    from npattn.models.configs import GGUF_FAMILIES

    with pytest.raises(ValueError, match=r"tensor 'blk.0.ffn_up.bias' in an ernie4_5 file"):
        GGUF_FAMILIES["ernie4_5"].derive(dict(model_type="ernie4_5", attention_bias=False, mlp_bias=True), {})


def test_an_arcee_file_is_its_model_s_directory(tmp_path):
    """An arcee file (q/k permuted, the plain relu2 MLP, the file's YaRN) and the source model's
    own directory (save_pretrained, read back by from_pretrained) are one model: the same config
    (YaRN's factor, original length and base), tensors bit for bit and logits over positions past
    the original length.  Without YaRN's metadata the file is Llama's plain RoPE at its base."""
    g, _, _ = _file_is_its_directory(tmp_path, ARCEE, "arcee")
    rope = g.config.attention_config("full_attention").rope_scaling
    assert (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"]) == ("yarn", 4.0, 8)
    assert g.config.mlp_types == ("plain", "plain") and g.config.hidden_act == "relu2"
    plain = dict(ARCEE, rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    (tmp_path / "plain").mkdir()
    g, _, _ = _file_is_its_directory(tmp_path / "plain", plain, "arcee")
    assert g.config.attention_config("full_attention").rope_scaling == {"rope_type": "default", "rope_theta": 1000.0}


def test_arcee_metadata_and_biases_as_llama_cpp_reads_them(tmp_path):
    """llama.cpp's arcee: the file's YaRN (type, factor, original length; betas and attention
    factor where written), none without the type; a YaRN key without the type, another scaling
    type, and biases (its loader reads none: not q/k/v's beside transformers' o bias, nor the MLP's)
    refused by name; rope_freqs.weight beside YaRN refused."""
    from npattn.models.configs import GGUF_FAMILIES

    derive = GGUF_FAMILIES["arcee"].derive
    c = dict(model_type="arcee", attention_bias=False, mlp_bias=False)
    derive(c, {})
    assert c == dict(model_type="arcee")
    yarn = {"rope.scaling.type": "yarn", "rope.scaling.factor": 20.0, "rope.scaling.original_context_length": 4096}
    derive(c, dict(yarn, **{"rope.scaling.yarn_beta_fast": 16.0}))
    assert c["rope_scaling"] == dict(
        rope_type="yarn", factor=20.0, original_max_position_embeddings=4096, beta_fast=16.0
    )
    for meta, match in [
        ({"rope.scaling.factor": 2.0}, r"'arcee.rope.scaling.factor' without 'arcee.rope.scaling.type' 'yarn'"),
        ({**yarn, "rope.scaling.type": "linear"}, r"'arcee.rope.scaling.type' 'linear' is not supported"),
    ]:
        with pytest.raises(ValueError, match=match):
            derive(dict(model_type="arcee"), meta)
    for key, where in (("attention_bias", "attn_q"), ("mlp_bias", "ffn_up")):
        with pytest.raises(ValueError, match=rf"tensor 'blk.0.{where}.bias' in an arcee file: llama.cpp's arcee"):
            derive(dict(model_type="arcee", **{key: True}), {})
    biased = dict(ARCEE, mlp_bias=True)
    _write(tmp_path / "b.gguf", biased, _model(biased).state_dict(), Q.F32, "arcee")
    with pytest.raises(ValueError, match=r"b.gguf: tensor 'blk.0.ffn_up.bias' in an arcee file"):
        CausalLM.from_gguf(tmp_path / "b.gguf")
    llama3 = np.ones(32, np.float32)
    _write(tmp_path / "f.gguf", ARCEE, _state(ARCEE), Q.F32, "arcee", extra=[("rope_freqs.weight", llama3)])
    with pytest.raises(ValueError, match=r"f.gguf: tensor 'rope_freqs.weight' beside the file's YaRN"):
        CausalLM.from_gguf(tmp_path / "f.gguf")


def test_an_apertus_file_is_its_model_s_directory(tmp_path):
    """An apertus file (q/k rows as written, each layer's xIELU numbers from the xielu.* arrays) and
    the source model's own directory (save_pretrained: act_fn's four tensors; read back) are one
    model: config, tensors bit for bit (each layer its own numbers), logits."""
    g, _, _ = _file_is_its_directory(tmp_path, APERTUS, "apertus")
    sd = g.state_dict()
    assert sd["model.layers.0.mlp.act_fn.alpha_p"] != sd["model.layers.1.mlp.act_fn.alpha_p"]
    assert sd["model.layers.1.mlp.act_fn.eps"].shape == () and g.config.hidden_act == "xielu"


def test_an_apertus_file_with_llama3_rope_freqs_is_the_released_rope(tmp_path):
    """The released Apertus's Llama 3 scaling (factor 8, 1, 4, 8192 at base 12e6) is the file's
    rope_freqs.weight (LlamaModel.generate_extra_tensors): read as that rope_scaling, the file is
    the source model, logits bit for bit."""
    config = dict(APERTUS, rope_theta=12000000.0)
    config.pop("rope_parameters")  # ApertusConfig's default: llama3 at 12e6
    config["rope_scaling"] = dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    )
    src = CausalLM.from_hf(_state(config), config)
    rope = src.config.attention_config("full_attention").rope_scaling
    assert rope["rope_type"] == "llama3" and rope["rope_theta"] == 12000000.0
    _write(
        tmp_path / "m.gguf", config, src.state_dict(), Q.F32, "apertus", [("rope_freqs.weight", _rope_freqs(config))]
    )
    loaded = CausalLM.from_gguf(tmp_path / "m.gguf")
    assert loaded.config.attention_config("full_attention").rope_scaling == rope
    ids = np.random.default_rng(1).integers(0, config["vocab_size"], (2, 6))
    np.testing.assert_array_equal(_logits(loaded, ids), _logits(src, ids))


def test_apertus_xielu_metadata_as_llama_cpp_reads_it(tmp_path, monkeypatch):
    """llama.cpp's get_key_or_arr: one number for every layer is broadcast; an array of another
    length, a missing key and a file without output.weight (a tied head) are refused by name."""
    sd = _state(APERTUS)
    for i in range(2):  # every layer the same numbers: the file may hold one of each
        for name in ("alpha_p", "alpha_n", "beta", "eps"):
            sd[f"model.layers.{i}.mlp.act_fn.{name}"] = sd[f"model.layers.0.mlp.act_fn.{name}"]
    real = gguf.GGUFWriter.add_array

    def one(self, key, values):
        return self.add_float32(key, values[0]) if key.startswith("xielu.") else real(self, key, values)

    monkeypatch.setattr(gguf.GGUFWriter, "add_array", one)
    _write(tmp_path / "one.gguf", APERTUS, sd, Q.F32, "apertus")
    loaded = CausalLM.from_gguf(tmp_path / "one.gguf")
    for k, v in sd.items():
        np.testing.assert_array_equal(loaded.state_dict()[k], v, err_msg=k)
    monkeypatch.setattr(
        gguf.GGUFWriter,
        "add_array",
        lambda self, key, values: real(self, key, list(values) * 2 if key == "xielu.beta" else values),
    )
    _write(tmp_path / "long.gguf", APERTUS, sd, Q.F32, "apertus")
    with pytest.raises(ValueError, match=r"long.gguf: metadata 'xielu.beta': expected one number or 2 \(block_count\)"):
        CausalLM.from_gguf(tmp_path / "long.gguf")
    monkeypatch.setattr(gguf.GGUFWriter, "add_array", real)
    monkeypatch.setattr(gguf.GGUFWriter, "add_xielu_eps", lambda self, values: None)
    _write(tmp_path / "none.gguf", APERTUS, sd, Q.F32, "apertus")
    with pytest.raises(
        ValueError, match=r"none.gguf: no metadata 'xielu.eps' \(the model's 'model.layers.0.mlp.act_fn.eps'\)"
    ):
        CausalLM.from_gguf(tmp_path / "none.gguf")
    from npattn.models.configs import GGUF_FAMILIES

    with pytest.raises(ValueError, match=r"no tensor 'output.weight': llama.cpp's apertus requires it"):
        GGUF_FAMILIES["apertus"].derive(dict(model_type="apertus", tie_word_embeddings=True), {})


# Falcon-H1 files: the multipliers powers of two (folded exactly), as the released checkpoints'
# (each fold one float32 rounding), and tied (no output tensor: llama.cpp's head the folded embedding)
_FALCON_FILES = {
    "falcon-h1": FALCON_H1,
    "falcon-h1-rounded": FALCON_H1_ROUNDED,
    "falcon-h1-tied": dict(FALCON_H1, tie_word_embeddings=True),
}
# the logits' relative distance from the checkpoint's network: none but float64's where the folds are
# exact, a few float32 roundings of the weights where not
_FALCON_TOLERANCE = {"falcon-h1": 1e-12, "falcon-h1-rounded": 1e-6, "falcon-h1-tied": 1e-12}


def _falcon_h1_file(tmp_path, config):
    """``(the F32 file's model in float64, the source's state with the file's A_log, the ids, the
    factor from the source's logits to llama.cpp's)``: a tied file's head is the embedding times
    ``embedding_multiplier`` where transformers multiplies ``lm_head_multiplier``."""
    sd = _state(config)
    _write(tmp_path / "m.gguf", config, sd, Q.F32, "falcon-h1")
    g = CausalLM.from_gguf(tmp_path / "m.gguf", dtype=np.float64)
    held = {k: g.state_dict()[k] if k.endswith("mamba.A_log") else v.astype(np.float64) for k, v in sd.items()}
    tied = config.get("tie_word_embeddings")
    factor = config["embedding_multiplier"] / config["lm_head_multiplier"] if tied else 1.0
    return g, held, np.random.default_rng(1).integers(0, config["vocab_size"], (2, 7)), factor


@pytest.mark.parametrize("name", _FALCON_FILES)
def test_a_falcon_h1_file_is_the_checkpoint_s_network(tmp_path, name):
    """FalconH1Model folds every muP multiplier into the weights and writes none: the file's model
    (every multiplier 1, the folded weights) computes the source model's logits (its multipliers,
    its weights; A_log the file's log(-A)), to float64's precision where the multipliers are powers
    of two, to a few float32 roundings where not; a tied file's are llama.cpp's, the source's times
    embedding_multiplier / lm_head_multiplier.  The multipliers are all 1 in the model read."""
    from _oracles import rel_err

    config = _FALCON_FILES[name]
    g, held, ids, factor = _falcon_h1_file(tmp_path, config)
    c = g.config
    assert (c.embed_scale, c.logits_scaling, c.attention_scale) == (False, 1.0, 1 / 8)
    assert c.hybrid_multipliers == (1.0,) * 4 and c.mlp_multipliers == (1.0, 1.0)
    assert c.linear_attention.proj_multipliers is None and c.tie_word_embeddings == bool(factor != 1.0)
    ref = _logits(CausalLM.from_hf(held, config, dtype=np.float64), ids) * factor
    err = rel_err(_logits(g, ids), ref, floor=1e-300, relative_to="max_b")
    assert err < _FALCON_TOLERANCE[name]
    if name == "falcon-h1-rounded":  # the folds' roundings are there (the tolerance is not slack)
        assert err > 1e-12


@pytest.mark.skipif(T is None, reason="needs torch and transformers")
@pytest.mark.parametrize("name", _FALCON_FILES)
def test_a_falcon_h1_file_is_transformers_checkpoint(tmp_path, name):
    """The file read in float64 against transformers' FalconH1ForCausalLM of the source config (its
    multipliers) and weights (A_log the file's): 1e-9 where the folds are exact, a tied file's
    logits llama.cpp's (the source's times embedding_multiplier / lm_head_multiplier)."""
    import torch
    from _hf64 import hf_logits
    from _oracles import rel_err

    config = _FALCON_FILES[name]
    g, held, ids, factor = _falcon_h1_file(tmp_path, config)
    hf = _hf_model(T, ("FalconH1Config", "FalconH1ForCausalLM"), config)
    missing, unexpected = hf.load_state_dict({k: torch.from_numpy(v) for k, v in held.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    err = rel_err(_logits(g, ids), hf_logits(hf, ids) * factor, floor=1e-300, relative_to="max_b")
    assert err < max(1e-9, _FALCON_TOLERANCE[name])


@pytest.mark.parametrize("name", ["falcon-h1", "falcon-h1-rounded"])
def test_a_falcon_h1_file_is_its_directory(tmp_path, name):
    """save_pretrained of a Falcon-H1 file's model writes the folded weights and no multiplier (all
    1): from_pretrained reads the same model (config, tensors, logits), and transformers'
    FalconH1ForCausalLM reads it with the file's logits (float64, 1e-9)."""
    config = _FALCON_FILES[name]
    _write(tmp_path / "m.gguf", config, _state(config), Q.F32, "falcon-h1")
    g = CausalLM.from_gguf(tmp_path / "m.gguf", dtype=np.float64)
    g.save_pretrained(tmp_path / "dir")
    d = CausalLM.from_pretrained(tmp_path / "dir")
    assert d.config.replace(hf={}) == g.config.replace(hf={})
    assert set(d.state_dict()) == set(g.state_dict())
    for k, v in g.state_dict().items():
        np.testing.assert_array_equal(d.state_dict()[k], v, err_msg=k)
    ids = np.random.default_rng(1).integers(0, config["vocab_size"], (2, 7))
    np.testing.assert_array_equal(_logits(d, ids), _logits(g, ids))
    if T is None:
        return
    import torch
    from _hf64 import float64_reference
    from _oracles import rel_err

    read = T.AutoModelForCausalLM.from_pretrained(tmp_path / "dir", attn_implementation="eager")
    with float64_reference():  # the model of the config read, its RoPE frequencies made in float64 too
        hf = type(read)(read.config).double().eval()
    hf.load_state_dict(read.state_dict())
    assert read.dtype == torch.float64 and type(hf).__name__ == "FalconH1ForCausalLM"
    hc = hf.config
    assert (hc.embedding_multiplier, hc.lm_head_multiplier, hc.key_multiplier, hc.ssm_multipliers) == (1, 1, 1, [1] * 5)
    assert (hc.mamba_norm_before_gate, hc.mamba_rms_norm) == (False, name == "falcon-h1")
    with torch.no_grad(), float64_reference():
        ref = hf(input_ids=torch.from_numpy(ids)).logits.numpy()
    assert rel_err(_logits(g, ids), ref, floor=1e-300, relative_to="max_b") < 1e-9


def test_falcon_h1_files_llama_cpp_cannot_compute_are_refused_by_name(tmp_path):
    """llama.cpp's falcon-h1 reads no bias of ssm_in or ssm_out (a file with one is refused naming
    the tensor) and drops attn_output's while adding q/k/v's times attention_in_multiplier (a file
    with attention biases is refused); a source whose norm comes before its gate is read as
    llama.cpp computes it, gate first."""
    for changes, tensor in ((dict(projectors_bias=True), "ssm_out.bias"), (dict(mamba_proj_bias=True), "ssm_in.bias")):
        config = dict(FALCON_H1, **changes)
        _write(tmp_path / "b.gguf", config, _state(config), Q.F32, "falcon-h1")
        with pytest.raises(ValueError, match=rf"tensor 'blk.0.{tensor}' is not part of the falcon-h1 model"):
            CausalLM.from_gguf(tmp_path / "b.gguf")
    config = dict(FALCON_H1, attention_bias=True)
    _write(tmp_path / "q.gguf", config, _state(config), Q.F32, "falcon-h1")
    with pytest.raises(ValueError, match=r"q.gguf: tensors 'blk.\*.attn_q.bias': attention biases in a falcon-h1"):
        CausalLM.from_gguf(tmp_path / "q.gguf")
    config = dict(FALCON_H1, mamba_norm_before_gate=True)
    _write(tmp_path / "n.gguf", config, _state(config), Q.F32, "falcon-h1")
    assert CausalLM.from_gguf(tmp_path / "n.gguf").config.linear_attention.gated_norm == "gate_first"


_FALCON_SSM = {"ssm.conv_kernel": 4, "ssm.state_size": 16, "ssm.group_count": 2, "ssm.inner_size": 512}


@pytest.mark.parametrize(
    "meta, match",
    [
        ({"ssm.time_step_rank": 8}, None),
        ({"ssm.time_step_rank": 8, "ssm.inner_size": 300}, r"'falcon-h1.ssm.inner_size' 300: expected a multiple of "),
        (
            {"ssm.time_step_rank": 8, "ssm.group_count": 3},
            r"'falcon-h1.ssm.group_count' 3: expected a divisor of ssm.time_step_rank 8",
        ),
        ({}, r"metadata 'falcon-h1.ssm.time_step_rank': expected an integer >= 1 \(the Mamba-2 layers' mamba_n_heads"),
        ({"ssm.time_step_rank": 8, "ssm.state_size": 0.5}, r"'falcon-h1.ssm.state_size': expected an integer >= 1"),
    ],
)
def test_falcon_h1_mamba2_sizes_are_its_ssm_keys(meta, match):
    """FalconH1Model's ssm.* keys: the inner width mamba_d_ssm (not a multiple of the hidden size:
    Granite 4.0's check is not Falcon-H1's), time_step_rank heads of inner / heads; inconsistent
    or missing sizes are refused naming the key."""
    from npattn.models.configs import GGUF_FAMILIES

    derive = GGUF_FAMILIES["falcon-h1"].derive
    config = {"model_type": "falcon_h1", "hidden_size": 384}
    if match is None:
        derive(config, dict(_FALCON_SSM, **meta))
        assert config == dict(
            model_type="falcon_h1",
            hidden_size=384,
            mamba_d_conv=4,
            mamba_d_state=16,
            mamba_n_groups=2,
            mamba_n_heads=8,
            mamba_d_ssm=512,
            mamba_d_head=64,
            mamba_chunk_size=256,
        )
        return
    with pytest.raises(ValueError, match=match):
        derive(config, dict(_FALCON_SSM, **meta))


def test_mistral3_file_is_the_directory_s_model(tmp_path):
    """A mistral3 file with attention.temperature_scale is Ministral 3's: the queries' scale by
    position (beta 0.5, the length YaRN's original context, 2), YaRN with the file's betas and an
    attention factor of 1, no window; the model of the same weights saved as a Hugging Face
    directory and read back, logits bit for bit over positions past the length."""
    src = _model(MINISTRAL3)
    _write(tmp_path / "m.gguf", MINISTRAL3, src.state_dict(), Q.F32, "mistral3")
    loaded = CausalLM.from_gguf(tmp_path / "m.gguf")
    c = loaded.config
    assert c.model_type == "ministral3" and c.query_scale_by_position == (0.5, 2) and c.sliding_window is None
    src.save_pretrained(tmp_path / "dir")
    directory = CausalLM.from_pretrained(tmp_path / "dir")
    assert c.rope == directory.config.rope and not c.tie_word_embeddings
    ids = np.random.default_rng(1).integers(1, MINISTRAL3["vocab_size"], (2, 7))
    np.testing.assert_array_equal(_logits(loaded, ids), _logits(directory, ids))


_MISTRAL3_YARN = {
    "rope.scaling.type": "yarn",
    "rope.scaling.factor": 4.0,
    "rope.scaling.original_context_length": 2,
    "rope.scaling.yarn_log_multiplier": 1.0,
}


@pytest.mark.parametrize(
    "meta, match",
    [
        ({"attention.temperature_scale": 0.1}, r"'mistral3.attention.temperature_scale' without .*'yarn'"),
        ({**_MISTRAL3_YARN, "rope.scaling.yarn_log_multiplier": 0.1}, r"yarn_log_multiplier' 0.1: npattn reads 1"),
        ({k: v for k, v in _MISTRAL3_YARN.items() if "log" not in k}, r"yarn_log_multiplier' None: npattn reads 1"),
        ({"rope.scaling.yarn_log_multiplier": 1.0}, r"yarn_log_multiplier' without 'mistral3.rope.scaling.type'"),
        ({"rope.scaling.type": "linear"}, r"'mistral3.rope.scaling.type' 'linear' is not supported"),
    ],
)
def test_mistral3_metadata_refusals_name_the_key(meta, match):
    from npattn.models.configs import GGUF_FAMILIES

    with pytest.raises(ValueError, match=match):
        GGUF_FAMILIES["mistral3"].derive(dict(model_type="ministral3", rope_theta=1e4, attention_bias=False), meta)


def test_mistral3_file_without_the_query_scale_is_mistral_s():
    """Without attention.temperature_scale a mistral3 file is the text model of a mistral
    checkpoint (Mistral Small 3.x): llama.cpp's graph masks no window (MistralConfig's default is
    4096), its YaRN kept where the file has it; biases are refused by name."""
    from npattn.models.configs import GGUF_FAMILIES

    derive = GGUF_FAMILIES["mistral3"].derive
    c = dict(model_type="ministral3", rope_theta=1e4, attention_bias=False)
    derive(c, {})
    default = {"rope_type": "default", "rope_theta": 1e4}
    assert c == dict(model_type="mistral", sliding_window=None, rope_parameters=default)
    c = dict(model_type="ministral3", rope_theta=1e4, attention_bias=False)
    derive(c, _MISTRAL3_YARN)
    assert c["model_type"] == "mistral" and c["rope_parameters"]["mscale_all_dim"] == 1.0
    with pytest.raises(ValueError, match=r"tensor 'blk.0.attn_q.bias' in a mistral3 file"):
        derive(dict(model_type="ministral3", rope_theta=1e4, attention_bias=True), {})


# the optional metadata llama.cpp fills in itself (llm_load_hparams), each left out of a file
_OPTIONAL_KEYS = ("head_count_kv", "key_length", "value_length", "rope_dimension_count", "rope_freq_base")


# LFM2's head_count_kv is not optional: its zeros say which layers are convolutions (without it
# llama.cpp, and npattn, take every layer for attention and find no attention tensors in layer 0)
def _nemotron_h_derived(**changes) -> dict:
    """The config ``nemotron_h``'s derive makes of a file's entries (four blocks by default:
    Mamba-2, MLP, attention, Mamba-2) and ``_NEMOTRON_SSM``'s sizes."""
    from npattn.models.configs import GGUF_FAMILIES

    c = dict(
        model_type="nemotron_h",
        num_hidden_layers=4,
        hidden_size=256,
        num_attention_heads=4,
        rms_norm_eps=2.0**-20,
        rope_theta=10000.0,
        num_key_value_heads=[0, 0, 2, 0],
        intermediate_size=[0, 96, 0, 0],
    )
    c.update(changes)
    GGUF_FAMILIES["nemotron_h"].derive(c, _NEMOTRON_SSM)
    return c


_NEMOTRON_SSM = {
    "ssm.conv_kernel": 4,
    "ssm.state_size": 16,
    "ssm.group_count": 2,
    "ssm.inner_size": 256,
    "ssm.time_step_rank": 4,
}


def test_a_nemotron_h_file_s_blocks_are_its_per_layer_counts():
    """NemotronHModel's file records each block's kind as llama.cpp reads it: head_count_kv and
    feed_forward_length both 0, Mamba-2 (its sizes ssm.*: time_step_rank the heads, inner_size
    heads * head_dim, transformers' chunk size, no step clipped); a head count, attention; a width,
    the MLP; one integer for every layer as llama.cpp's get_key_or_arr takes it.  The epsilon is
    the RMS one; no RoPE base is kept (no layer rotates)."""
    c = _nemotron_h_derived()
    assert c["layers_block_type"] == ["linear_attention", "mlp", "full_attention", "linear_attention"]
    assert (c["num_key_value_heads"], c["intermediate_size"], c["layer_norm_epsilon"]) == (2, 96, 2.0**-20)
    assert "rope_theta" not in c and "rms_norm_eps" not in c
    mamba = {k: c[k] for k in ("conv_kernel", "ssm_state_size", "n_groups", "mamba_num_heads", "mamba_head_dim")}
    assert mamba == dict(conv_kernel=4, ssm_state_size=16, n_groups=2, mamba_num_heads=4, mamba_head_dim=64)
    assert (c["chunk_size"], c["time_step_min"]) == (256, 0.0)
    assert not any(k.startswith("mamba_") and k not in ("mamba_num_heads", "mamba_head_dim") for k in c)
    c = _nemotron_h_derived(num_key_value_heads=2, intermediate_size=0)  # scalars: every layer attention
    assert c["layers_block_type"] == ["full_attention"] * 4 and "conv_kernel" not in c


@pytest.mark.parametrize(
    "changes, match",
    [
        (
            dict(num_key_value_heads=[0, 0, 2]),
            r"'nemotron_h.attention.head_count_kv' \[0, 0, 2\]: expected 4 counts \(block_count\)",
        ),
        (dict(intermediate_size=[0, -1, 0, 0]), r"'nemotron_h.feed_forward_length' \[0, -1, 0, 0\]: expected 4 counts"),
        (dict(intermediate_size=[0, 96, 96, 0]), r"feed_forward_length' \[0, 96, 96, 0\]: layers \[2\] have both"),
        (
            dict(num_key_value_heads=[2, 0, 1, 0], intermediate_size=0),
            r"head_count_kv' \[2, 0, 1, 0\]: the layers' counts",
        ),
        (
            dict(intermediate_size=[0, 96, 0, 64]),
            r"'nemotron_h.feed_forward_length' \[0, 96, 0, 64\]: the layers' counts",
        ),
    ],
)
def test_inconsistent_nemotron_h_blocks_are_refused_by_name(changes, match):
    with pytest.raises(ValueError, match=match):
        _nemotron_h_derived(**changes)


def test_nemotron_h_mamba2_sizes_are_refused_by_name():
    """The Mamba-2 blocks' ssm.* keys: each required where a block is Mamba-2, its heads dividing
    the inner width."""
    from npattn.models.configs import GGUF_FAMILIES

    derive = GGUF_FAMILIES["nemotron_h"].derive
    base = dict(model_type="nemotron_h", num_hidden_layers=2, hidden_size=256, num_attention_heads=4, rms_norm_eps=1e-5)
    with pytest.raises(
        ValueError,
        match=r"metadata 'nemotron_h.ssm.conv_kernel': expected an integer >= 1 \(the Mamba-2 layers' conv_kernel\)",
    ):
        derive(dict(base, num_key_value_heads=[0, 2], intermediate_size=0), {})
    for suffix, key in (("ssm.time_step_rank", "mamba_num_heads"), ("ssm.group_count", "n_groups")):
        with pytest.raises(
            ValueError, match=rf"'nemotron_h.{suffix}': expected an integer >= 1 \(the Mamba-2 layers' {key}\)"
        ):
            derive(dict(base, num_key_value_heads=[0, 2], intermediate_size=0), dict(_NEMOTRON_SSM, **{suffix: 0}))
    with pytest.raises(ValueError, match=r"'nemotron_h.ssm.inner_size' 250: expected a multiple of ssm.time_step_rank"):
        derive(
            dict(base, num_key_value_heads=[0, 2], intermediate_size=0), dict(_NEMOTRON_SSM, **{"ssm.inner_size": 250})
        )
    derive(dict(base, num_key_value_heads=[0, 2], intermediate_size=0), dict(_NEMOTRON_SSM, **{"ssm.inner_size": 100}))


_NEMOTRON_MOE_META = {
    "expert_count": 8,
    "expert_used_count": 2,
    "expert_feed_forward_length": 64,
    "expert_shared_feed_forward_length": 96,
    "expert_shared_count": 1,
    "expert_group_count": 1,
}


def _nemotron_h_moe_derived(meta=None, **changes) -> dict:
    """The config ``nemotron_h_moe``'s derive makes of a file's entries (Mamba-2, experts,
    attention, experts) and ``meta`` (``_NEMOTRON_SSM`` and ``_NEMOTRON_MOE_META`` by default)."""
    from npattn.models.configs import GGUF_FAMILIES

    c = dict(
        model_type="nemotron_h",
        num_hidden_layers=4,
        hidden_size=256,
        num_attention_heads=4,
        rms_norm_eps=2.0**-20,
        num_key_value_heads=[0, 0, 2, 0],
        intermediate_size=[0, 64, 0, 64],
    )
    c.update(changes)
    GGUF_FAMILIES["nemotron_h_moe"].derive(c, {**_NEMOTRON_SSM, **_NEMOTRON_MOE_META} if meta is None else meta)
    return c


def test_a_nemotron_h_moe_file_s_experts_are_llama_cpp_s():
    """NemotronHModel's is_moe file: a width marks a routed-experts block (never a dense MLP), the
    experts' keys read as llama.cpp's graph takes them: not renormalised and not scaled where
    expert_weights_norm / expert_weights_scale are missing (llama.cpp's defaults), no latent width
    where moe_latent_size is missing or 0, one group; the experts' width feed_forward_length /
    expert_used_count without expert_feed_forward_length."""
    c = _nemotron_h_moe_derived()
    assert c["layers_block_type"] == ["linear_attention", "moe", "full_attention", "moe"]
    got = {k: c[k] for k in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_group")}
    assert got == dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, n_group=1)
    assert c["moe_shared_expert_intermediate_size"] == 96
    assert (c["norm_topk_prob"], c["routed_scaling_factor"], c["topk_group"]) == (False, 1.0, 1)
    assert "moe_latent_size" not in c
    meta = {
        **_NEMOTRON_SSM,
        **_NEMOTRON_MOE_META,
        **{"expert_weights_norm": True, "expert_weights_scale": 2.5, "moe_latent_size": 512},
        **{"expert_group_count": 4, "expert_group_used_count": 2},
    }
    del meta["expert_feed_forward_length"]
    c = _nemotron_h_moe_derived(meta)
    assert (c["norm_topk_prob"], c["routed_scaling_factor"], c["moe_latent_size"]) == (True, 2.5, 512)
    assert (c["n_group"], c["topk_group"], c["moe_intermediate_size"]) == (4, 2, 32)
    c = _nemotron_h_moe_derived(meta, num_key_value_heads=2, intermediate_size=0)  # no experts' block
    assert c["layers_block_type"] == ["full_attention"] * 4 and "n_routed_experts" not in c


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(expert_count=None), r"'nemotron_h_moe.expert_count': expected an integer >= 1 \(the model's n_routed"),
        (dict(expert_used_count=0), r"'nemotron_h_moe.expert_used_count': expected an integer >= 1"),
        (
            dict(expert_shared_feed_forward_length=None),
            r"'nemotron_h_moe.expert_shared_feed_forward_length': expected an integer >= 1 \(the model's moe_shared",
        ),
        (dict(expert_group_count=2), r"'nemotron_h_moe.expert_group_used_count' None: expected an integer from 1 to"),
        (dict(nextn_predict_layers=1), r"'nemotron_h_moe.nextn_predict_layers' 1 is not supported by npattn"),
    ],
)
def test_nemotron_h_moe_metadata_is_refused_by_name(changes, match):
    meta = {**_NEMOTRON_SSM, **_NEMOTRON_MOE_META, **changes}
    meta = {k: v for k, v in meta.items() if v is not None}
    with pytest.raises(ValueError, match=match):
        _nemotron_h_moe_derived(meta)
    with pytest.raises(ValueError, match=r"'nemotron_h_moe.feed_forward_length' \[0, 64, 0, 32\]: the layers'"):
        _nemotron_h_moe_derived(intermediate_size=[0, 64, 0, 32])


def test_a_nemotron_h_moe_file_is_its_model_s_directory(tmp_path):
    """A nemotron_h_moe file and the source model's directory are one model (routed experts within
    the latent width, the shared expert, the choice bias), both ways; and without a latent width."""
    config = dict(NEMOTRON_H_MOE, layer_norm_epsilon=2.0**-20)
    g, ids, meta = _file_is_its_directory(tmp_path, config, "nemotron_h_moe")
    assert g.config.moe.latent_size == 512 and g.config.moe.routed_scaling_factor == 2.5
    g.save_pretrained(tmp_path / "g")
    back = CausalLM.from_pretrained(tmp_path / "g")
    assert back.config.replace(**meta) == g.config.replace(**meta)
    np.testing.assert_array_equal(_logits(back, ids), _logits(g, ids))
    plain = {k: v for k, v in config.items() if k != "moe_latent_size"}
    (tmp_path / "plain").mkdir()
    g, _, _ = _file_is_its_directory(tmp_path / "plain", plain, "nemotron_h_moe")
    assert g.config.moe.latent_size is None


def test_a_nemotron_h_file_is_its_model_s_directory(tmp_path):
    """The file and the source model's own directory (save_pretrained: the backbone.* names; read
    back by from_pretrained) are one model: the same config (an epsilon float32 holds exactly),
    tensors and logits, A_log to within a few float32 roundings (the file's -exp(A_log) read
    back); the file's model saved and read back is itself."""
    g, ids, meta = _file_is_its_directory(tmp_path, dict(NEMOTRON_H, layer_norm_epsilon=2.0**-20), "nemotron_h")
    g.save_pretrained(tmp_path / "g")
    back = CausalLM.from_pretrained(tmp_path / "g")
    assert back.config.replace(**meta) == g.config.replace(**meta)
    np.testing.assert_array_equal(_logits(back, ids), _logits(g, ids))


@pytest.mark.parametrize("changes", [dict(), dict(tie_word_embeddings=True)])
def test_a_mamba2_file_is_its_model_s_directory(tmp_path, changes):
    """The file and the source model's own directory (save_pretrained: the backbone.* names) are one
    model: the same config, tensors and logits (A_log to within a few float32 roundings); a tied head
    (no ``output`` in the file); the file's model saved and read back is itself."""
    g, ids, meta = _file_is_its_directory(tmp_path, dict(MAMBA2, layer_norm_epsilon=2.0**-20, **changes), "mamba2")
    assert g.config.tie_word_embeddings == bool(changes) and not g.config.hf["use_bias"]
    assert g.config.linear_attention.conv_bias
    g.save_pretrained(tmp_path / "g")
    back = CausalLM.from_pretrained(tmp_path / "g")
    assert back.config.replace(**meta) == g.config.replace(**meta)
    np.testing.assert_array_equal(_logits(back, ids), _logits(g, ids))


@pytest.mark.parametrize(
    "changes, drop, match",
    [
        (dict(use_conv_bias=False), "-", r"no tensor 'blk.0.ssm_conv1d.bias': llama.cpp's mamba2 requires it"),
        (dict(use_bias=True), "-", r"tensor 'blk.0.ssm_in.bias' in a mamba2 file: llama.cpp's mamba2 reads no"),
        (dict(use_bias=True), "in_proj.bias", r"tensor 'blk.0.ssm_out.bias' is not part of the mamba2 model"),
    ],
)
def test_mamba2_biases_llama_cpp_cannot_load_are_refused_by_name(tmp_path, changes, drop, match):
    """llama.cpp's mamba2 loader requires ``ssm_conv1d.bias`` and loads no ``ssm_in.bias`` or
    ``ssm_out.bias``: a file without the convolution's bias (Mamba2Config's use_conv_bias false), or
    with in_proj's and out_proj's (use_bias), or with out_proj's alone, is refused by name."""
    config = dict(MAMBA2, **changes)
    sd = {k: v for k, v in _state(config).items() if drop not in k}
    _write(tmp_path / "m.gguf", config, sd, Q.F32, "mamba2")
    with pytest.raises(ValueError, match=match):
        CausalLM.from_gguf(tmp_path / "m.gguf")


_MAMBA2_SSM = {
    "ssm.conv_kernel": 4,
    "ssm.state_size": 16,
    "ssm.group_count": 2,
    "ssm.inner_size": 512,
    "ssm.time_step_rank": 4,
}


def test_mamba2_metadata_as_llama_cpp_reads_it(tmp_path, monkeypatch):
    """``Mamba2Model.set_gguf_parameters``: the ``ssm.*`` keys as Mamba2Config's (heads
    ``time_step_rank``, head_dim the inner width over them, expand the inner width over
    ``embedding_length``), the RMS epsilon as ``layer_norm_epsilon``, the chunk size transformers'
    256, no attention key left; a missing size names Mamba-2's key, an inner width that is no
    multiple of the hidden one names expand, a head_count other than 0 is refused by name."""
    from npattn.models.configs import GGUF_FAMILIES, config_from_hf

    derive = GGUF_FAMILIES["mamba2"].derive
    base = dict(model_type="mamba2", num_hidden_layers=2, hidden_size=256, num_attention_heads=1, rms_norm_eps=1e-5)
    base.update(num_key_value_heads=1, head_dim=256, rope_theta=1e4, intermediate_size=0, attention_bias=False)
    c = dict(base)
    derive(c, _MAMBA2_SSM)
    assert c == dict(
        model_type="mamba2", num_hidden_layers=2, hidden_size=256, layer_norm_epsilon=1e-5, num_heads=4, head_dim=128,
        n_groups=2, state_size=16, conv_kernel=4, expand=2, chunk_size=256,
    )  # fmt: skip
    m = config_from_hf(c).linear_attention
    assert (m.num_heads, m.head_dim, m.time_step_limit) == (4, 128, (0.0, math.inf))
    for suffix, key in (("ssm.time_step_rank", "num_heads"), ("ssm.group_count", "n_groups")):
        with pytest.raises(
            ValueError, match=rf"'mamba2.{suffix}': expected an integer >= 1 \(the Mamba-2 layers' {key}\)"
        ):
            derive(dict(base), dict(_MAMBA2_SSM, **{suffix: 0}))
    with pytest.raises(
        ValueError, match=r"'mamba2.ssm.state_size': expected an integer >= 1 \(the Mamba-2 layers' state_size"
    ):
        derive(dict(base), {k: v for k, v in _MAMBA2_SSM.items() if k != "ssm.state_size"})
    with pytest.raises(
        ValueError,
        match=r"'mamba2.ssm.inner_size' 384: expected a multiple of embedding_length 256 \(the inner width is expand",
    ):
        derive(dict(base), dict(_MAMBA2_SSM, **{"ssm.inner_size": 384}))
    monkeypatch.setattr(
        gguf.GGUFWriter, "add_head_count", lambda self, value: self.add_uint32("mamba2.attention.head_count", 4)
    )
    _write(tmp_path / "heads.gguf", MAMBA2, _state(MAMBA2), Q.F32, "mamba2")
    with pytest.raises(
        ValueError,
        match=r"heads.gguf: metadata .mamba2.attention.head_count.: expected 0 \(a mamba2 model has no attention\)",
    ):
        CausalLM.from_gguf(tmp_path / "heads.gguf")


_WITHOUT_OPTIONAL = ("lfm2", "lfm2moe", "granitehybrid", "falcon-h1", "nemotron_h", "nemotron_h_moe", "gptneox")
_WITHOUT_OPTIONAL += ("gpt2", "mamba2")
_WITH_OPTIONAL = [
    (i, c) for i, c in zip(IDS, CASES) if c[1] not in _WITHOUT_OPTIONAL
]  # (GPTNeoXModel writes none of those keys but rope.dimension_count: test_gptneox_metadata_as_llama_cpp_reads_it;
# GPT2Model none of them: test_gpt2_files_llama_cpp_cannot_read_are_refused_by_name;
# Mamba2Model writes no attention key: test_mamba2_metadata_as_llama_cpp_reads_it)


@pytest.mark.parametrize("config, arch", [c for _, c in _WITH_OPTIONAL], ids=[i for i, _ in _WITH_OPTIONAL])
def test_optional_metadata_left_out_means_llama_cpp_s_defaults(tmp_path, monkeypatch, config, arch):
    """A file without head_count_kv, key_length, value_length, rope.dimension_count or
    rope.freq_base is the model llama.cpp builds from it: as many key/value heads as heads, heads
    of embedding_length / head_count, a RoPE base of 10000; not the Hugging Face family's
    defaults (Qwen3's head_dim 128, Gemma 3's 256 and its 4 key/value heads: the file's tensors
    would then be refused).  Eight heads of 32: none of those defaults holds by chance.  A
    head_count of 0 is refused by name."""
    config = dict(config, num_attention_heads=8, num_key_value_heads=8, rope_theta=10000.0)
    if arch == "phi3":  # without rope.dimension_count every feature rotates (n_rot = head_dim): no partial
        config = {k: v for k, v in config.items() if k not in ("partial_rotary_factor", "rope_scaling")}
    if arch in ("glm4", "phi2", "stablelm"):  # the same: the whole head (not the config's default half or quarter)
        config["partial_rotary_factor"] = 1.0
    if "head_dim" in config or arch != "llama":
        config.update(head_dim=32)
    if arch == "gemma3":
        config.update(query_pre_attn_scalar=32)
        config["rope_parameters"] = dict(
            config["rope_parameters"], full_attention=dict(config["rope_parameters"]["full_attention"], rope_theta=1e4)
        )
    if config["model_type"] == "olmo3":  # both layer types rotate by rope.freq_base (not Olmo3Config's 500000)
        config["rope_parameters"] = {t: dict(v, rope_theta=1e4) for t, v in config["rope_parameters"].items()}
    if arch in ("mistral3", "arcee"):  # their YaRN dict's base is rope.freq_base
        config["rope_parameters"] = dict(config["rope_parameters"], rope_theta=1e4)
    if arch == "hunyuan-dense":  # its NTK-alpha base is rope.freq_base: here the default's
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e4}
    sd = _model(config).state_dict()
    _write(tmp_path / "full.gguf", config, sd, Q.F32, arch)
    for key in _OPTIONAL_KEYS:
        monkeypatch.setattr(gguf.GGUFWriter, f"add_{key}", lambda self, value: None)
    _write(tmp_path / "bare.gguf", config, sd, Q.F32, arch)
    full, bare = CausalLM.from_gguf(tmp_path / "full.gguf"), CausalLM.from_gguf(tmp_path / "bare.gguf")
    assert {k: bare.config.hf.get(k) for k in ("num_key_value_heads", "head_dim")} == {
        "num_key_value_heads": 8,
        "head_dim": 32,
    }
    ids = np.random.default_rng(1).integers(0, config["vocab_size"], (2, 6))
    np.testing.assert_array_equal(_logits(bare, ids), _logits(full, ids))
    monkeypatch.setattr(
        gguf.GGUFWriter, "add_head_count", lambda self, value: self.add_uint32(f"{arch}.attention.head_count", 0)
    )
    _write(tmp_path / "none.gguf", config, sd, Q.F32, arch)
    with pytest.raises(
        ValueError, match=rf"none.gguf: metadata '{arch}.attention.head_count': expected an integer >= 1, got 0"
    ):
        CausalLM.from_gguf(tmp_path / "none.gguf")


def test_a_refused_entry_names_the_file(tmp_path):
    config = dict(GEMMA3, rope_parameters=dict(GEMMA3["rope_parameters"]))
    config["rope_parameters"]["full_attention"] = dict(config["rope_parameters"]["full_attention"], rope_type="yarn")
    path = tmp_path / "g.gguf"
    _write(path, config, _model(GEMMA3).state_dict(), Q.F32, "gemma3")
    with pytest.raises(ValueError, match=r"g.gguf: metadata 'gemma3.rope.scaling.type' 'yarn' is not supported"):
        CausalLM.from_gguf(path)


# -- the tokenizer of a GGUF file ---------------------------------------------------------------------
# DeepSeek LLM's letters: the cased letters (Lu, Ll, Lt), run by run
_DEEPSEEK_LETTERS = [
    (0x41, 0x5A), (0x61, 0x7A), (0xB5, 0xB5), (0xC0, 0xD6), (0xD8, 0xF6), (0xF8, 0x1BA), (0x1BC, 0x1BF),
    (0x1C4, 0x293), (0x295, 0x2AF), (0x370, 0x373), (0x376, 0x376), (0x377, 0x377), (0x37B, 0x37D),
    (0x37F, 0x37F), (0x386, 0x386), (0x388, 0x38A), (0x38C, 0x38C), (0x38E, 0x3A1), (0x3A3, 0x3F5),
    (0x3F7, 0x481), (0x48A, 0x52F), (0x531, 0x556), (0x10A0, 0x10C5), (0x13A0, 0x13F5), (0x13F8, 0x13FD),
    (0x1C90, 0x1CBA), (0x1CBD, 0x1CBF), (0x1D00, 0x1D2B), (0x1D6B, 0x1D77), (0x1D79, 0x1D9A), (0x1E00, 0x1F15),
    (0x1F18, 0x1F1D), (0x1F20, 0x1F45), (0x1F48, 0x1F4D), (0x1F50, 0x1F57), (0x1F59, 0x1F59), (0x1F5B, 0x1F5B),
    (0x1F5D, 0x1F5D), (0x1F5F, 0x1F7D), (0x1F80, 0x1FB4), (0x1FB6, 0x1FBC), (0x1FBE, 0x1FBE), (0x1FC2, 0x1FC4),
    (0x1FC6, 0x1FCC), (0x1FD0, 0x1FD3), (0x1FD6, 0x1FDB), (0x1FE0, 0x1FEC), (0x1FF2, 0x1FF4), (0x1FF6, 0x1FFC),
    (0x2102, 0x2102), (0x2107, 0x2107), (0x210A, 0x2113), (0x2115, 0x2115), (0x2119, 0x211D), (0x2124, 0x2124),
    (0x2126, 0x2126), (0x2128, 0x2128), (0x212A, 0x212D), (0x212F, 0x2134), (0x2139, 0x2139), (0x213C, 0x213F),
    (0x2145, 0x2149), (0x214E, 0x214E), (0x2183, 0x2183), (0x2184, 0x2184), (0x2C00, 0x2C7B), (0x2C7E, 0x2CE4),
    (0x2CEB, 0x2CEE), (0x2CF2, 0x2CF2), (0x2CF3, 0x2CF3), (0xA640, 0xA66D), (0xA680, 0xA69B), (0xA722, 0xA76F),
    (0xA771, 0xA787), (0xA78B, 0xA78E), (0xAB70, 0xABBF), (0xFB00, 0xFB06), (0xFB13, 0xFB17), (0xFF21, 0xFF3A),
    (0xFF41, 0xFF5A), (0x10400, 0x1044F), (0x104B0, 0x104D3), (0x104D8, 0x104FB), (0x10C80, 0x10CB2),
    (0x10CC0, 0x10CF2), (0x118A0, 0x118DF), (0x1E900, 0x1E943),
]  # fmt: skip
# DeepSeek's CJK runs and DeepSeek LLM's punctuation
_DEEPSEEK_OTHER_RUNS = [
    (0x4E00, 0x9FA5), (0x800, 0x4E00), (0xAC00, 0xD7FF), (0x21, 0x2F), (0x3A, 0x7E), (0xFF01, 0xFF0F),
    (0xFF1A, 0xFF5E), (0x2018, 0x201F), (0x3000, 0x3002),
]  # fmt: skip
# where the pre-tokenizers differ: digit runs, CJK and Korean runs, case changes inside a word, ASCII
# and full-width punctuation before letters, slashes before a newline, Greek, the Ohm and Kelvin signs
# and U+1FBE inside words (DeepSeek LLM's letters: not their NFC forms), letters that are not cased
# (kana, Hebrew, Arabic), trailing spaces after them
_CORPUS = [
    "我想在apple工作1314151天～ 3333333 33 333 3.3 한국어 텍스트",
    "camelCaseWord HTTPServer getHTTPResponse ÉCOLE école",
    "path/to/file//\n\n'quoted' \"x\" ...!!! ,hello ；你好！ Ｈｅｌｌｏ",
    "Ωmega x\u2126y ΚΑΛΗΜΕΡΑ καλημέρα \u212aelvin ab\u1fbecd",
    "a 東京タワー テスト שלום עולם مرحبا   ",
    "שלום \u1fbe עולם \u2126 مرحبا \u1f7d",  # a space goes with DeepSeek LLM's letters, not the Hebrew
]
TEXTS = [
    "Hello world",
    "the cat's  hat\n\n  sat on\tthe mat",
    "numbers 12345 and 6789, ünïcödé: café",
    "<|im_start|>user\nhi there<|im_end|>",
    "a<think>b</think>  c!!",
    "   leading and trailing   ",
    "(hello) [world] DON'T WE'LL 2024\n\n\n  x",
    "cafe\u0301 = café",  # NFC (Qwen2's normalizer) makes the first e + accent the second's é
    "a zebra sat",
    *_CORPUS,
    "3.14159 × 2 = 6.28; 1234567890",
    "HelloWorld ΔΕΛΤΑ δέλτα 東京タワー 서울 ",
    "a/b\n//c  \n  ",
    # each end of each run of DeepSeek LLM's letters, punctuation and CJK and the character past it,
    # after a space
    "".join(
        f"\u05d0 {chr(c)}"
        for a, b in _DEEPSEEK_LETTERS + _DEEPSEEK_OTHER_RUNS
        for c in (a - 1, a, b, b + 1)
        if not 0xD800 <= c < 0xE000
    ),
]
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
    r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
_DEEPSEEK_CJK = "[一-龥ࠀ-一가-퟿]+"


def _split(regex):
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


def _byte_level(use_regex):
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": use_regex}


_DIGITS = {"type": "Digits", "individual_digits": True}
# StableLM 2's tokenizer.json (stabilityai/stablelm-2-1_6b, -12b, -zephyr-1_6b): the regex's matches kept,
# the gaps between them removed, its \r and \n literal characters (as JSON's escapes decode)
_STABLELM2_SPLIT = {
    "type": "Split",
    "pattern": {
        "Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\r\n]*|"
        "\\s*[\r\n]+|\\s+(?!\\S)|\\s+"
    },
    "behavior": "Removed",
    "invert": True,
}
# the originals' tokenizer.json: (pre_tokenizer steps, the BPE's ignore_merges, NFC normalizer)
_ORIGINALS = {
    "gpt-2": ([_byte_level(True)], False, False),  # GPT-2's
    "phi-2": ([_byte_level(True)], False, False),  # Phi-2's (CodeGen's GPT-2 BPE)
    "llama-bpe": ([_split(_LLAMA3), _byte_level(False)], True, False),  # Llama 3's
    "qwen2": ([_split(_QWEN2), _byte_level(False)], False, True),  # Qwen2's
    "stablelm2": ([_STABLELM2_SPLIT, _byte_level(False)], False, False),  # StableLM 2's (Arcade100k)
    "glm4": ([_split(_LLAMA3), _byte_level(False)], False, False),  # GLM-4's, as llama.cpp's CHATGLM4 reads it
    "tekken": ([_split(_TEKKEN), _byte_level(False)], True, False),  # Mistral Nemo's
    "smollm": ([_DIGITS, _byte_level(True)], False, False),  # SmolLM's
    "command-r": ([_DIGITS, _byte_level(True)], False, True),  # transformers' CohereTokenizer's
    "starcoder": ([_DIGITS, _byte_level(True)], False, False),  # StarCoder2's
    "olmo": ([_byte_level(True)], False, True),  # GPT-NeoX-20B's and Pythia's
    "deepseek-llm": (  # DeepSeek LLM's
        [
            _split("[\r\n]"),
            _split(r"\s?[" + "".join(chr(a) if a == b else f"{chr(a)}-{chr(b)}" for a, b in _DEEPSEEK_LETTERS) + "]+"),
            _split(r"\s?[!-/:-~！-／：-～‘-‟　-。]+"),
            _split(r"\s+$"),
            _split(_DEEPSEEK_CJK),
            _DIGITS,
            _byte_level(False),
        ],
        False,
        False,
    ),
    "deepseek-coder": (  # DeepSeek Coder's
        [
            _split("[\r\n]"),
            _split(r"\s?\p{L}+"),
            _split(r"\s?\p{P}+"),
            _split(_DEEPSEEK_CJK),
            _DIGITS,
            _byte_level(False),
        ],
        False,
        False,
    ),
}


def _bpe_tokenizer(pre: str):
    """A tiny byte-level BPE with the pre-tokenizer, normalizer and ignore_merges of the original's
    tokenizer.json (``_ORIGINALS``): three special tokens and one added non-special token.  Its
    merges are trained on unsplit text, so they cross every boundary a pre-tokenizer may draw: one
    that splits where the original does not, or not where it does, encodes differently."""
    tk = pytest.importorskip("tokenizers")
    steps, ignore_merges, nfc = _ORIGINALS[pre]
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": {"type": "NFC"} if nfc else None,
        "pre_tokenizer": _byte_level(False),
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "vocab": {}, "merges": []},
    }
    tok = tk.Tokenizer.from_str(json.dumps(spec))
    trainer = tk.trainers.BpeTrainer(
        vocab_size=2000,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["the cat sat on the mat; the dog's hat, 123 4567 89!", "Hello world, hello there: café ünïcödé"] * 20
    corpus += ["(hello) [world] DON'T WE'LL 2024 \n\n\n  x"] * 20  # where the three splits differ
    tok.train_from_iterator(corpus + _CORPUS * 20, trainer)
    # a word in the vocabulary that no merge makes: an ignore_merges BPE (Llama 3's) takes it whole
    spec = json.loads(tok.to_str())
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": steps}
    spec["model"]["ignore_merges"] = ignore_merges
    spec["model"]["vocab"]["\u0120zebra"] = len(spec["model"]["vocab"])
    tok = tk.Tokenizer.from_str(json.dumps(spec))
    tok.add_tokens([tk.AddedToken("<think>", special=False, normalized=False)])
    return tok


def _write_tokenizer(w, tok, pre: str, directory, chat_template=None):
    """The tokenizer metadata as llama.cpp's converter writes it (``TextModel._set_vocab_gpt2``:
    the tokens by id, CONTROL for special added tokens, USER_DEFINED for the other added ones,
    NORMAL for the rest; the merges by ``gguf.SpecialVocab`` from tokenizer.json)."""
    vocab = tok.get_vocab(with_added_tokens=True)
    added = tok.get_added_tokens_decoder()
    by_id = {i: t for t, i in vocab.items()}
    tokens = [by_id[i] for i in range(len(by_id))]
    types = [
        (gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        if i in added
        else gguf.TokenType.NORMAL
        for i in range(len(tokens))
    ]
    tok.save(str(directory / "tokenizer.json"))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    gguf.SpecialVocab(directory, load_merges=True).add_to_gguf(w)
    w.add_bos_token_id(vocab["<|endoftext|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    if chat_template is not None:
        w.add_chat_template(chat_template)
    return tokens


def _pieces(tok, text):
    """The pieces ``tok`` pre-tokenizes ``text`` into (normalized first)."""
    text = tok.normalizer.normalize_str(text) if tok.normalizer is not None else text
    return [piece for piece, _ in tok.pre_tokenizer.pre_tokenize_str(text)]


@pytest.mark.parametrize("pre", sorted(_ORIGINALS))
def test_tokenizer_from_the_metadata_encodes_as_the_original(tmp_path, pre):
    from npattn.models.gguf import gguf_tokenizer

    tok = _bpe_tokenizer(pre)
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "qwen3")
    _write_tokenizer(w, tok, pre, tmp_path)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    got = gguf_tokenizer(tmp_path / "t.gguf")
    assert got.get_vocab(with_added_tokens=True) == tok.get_vocab(with_added_tokens=True)
    for text in TEXTS:
        ids = tok.encode(text).ids
        assert len(ids) >= 2
        assert got.encode(text).ids == ids, text
        assert _pieces(got, text) == _pieces(tok, text), text  # where no merge would show a cut
        for skip in (True, False):
            assert got.decode(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip), text


def test_tokenizer_adds_bos_where_the_file_says(tmp_path):
    from npattn.models.gguf import gguf_tokenizer

    tok = _bpe_tokenizer("qwen2")
    path = tmp_path / "b.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3")
    _write_tokenizer(w, tok, "qwen2", tmp_path)
    w.add_add_bos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    got = gguf_tokenizer(path)
    bos = tok.token_to_id("<|endoftext|>")
    assert got.encode("Hello world").ids == [bos, *tok.encode("Hello world").ids]
    assert got.encode("Hello world", add_special_tokens=False).ids == tok.encode("Hello world").ids


def _tokenizer_file(path, metadata):
    w = gguf.GGUFWriter(str(path), "qwen3")
    metadata(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_tokenizers_npattn_does_not_build_are_refused_by_name(tmp_path):
    from npattn.models.gguf import gguf_tokenizer

    def t5(w):
        w.add_tokenizer_model("t5")
        w.add_token_list(["<unk>", "a"])

    with pytest.raises(ValueError, match=r"t.gguf: tokenizer.ggml.model 't5' is not a tokenizer npattn builds"):
        gguf_tokenizer(_tokenizer_file(tmp_path / "t.gguf", t5))

    def spm_without_scores(w):
        w.add_tokenizer_model("llama")
        w.add_token_list(["<unk>", "a"])

    with pytest.raises(ValueError, match=r"s.gguf: tokenizer.ggml.scores: expected one number per token, got None"):
        gguf_tokenizer(_tokenizer_file(tmp_path / "s.gguf", spm_without_scores))

    def other_pre(w):
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("deepseek-r1-qwen")
        w.add_token_list(["a", "b"])
        w.add_token_merges([])

    with pytest.raises(ValueError, match=r"tokenizer.ggml.pre 'deepseek-r1-qwen' is not a pre-tokenizer npattn knows"):
        gguf_tokenizer(_tokenizer_file(tmp_path / "p.gguf", other_pre))

    def bad_merge(w):
        w.add_tokenizer_model("gpt2")
        w.add_token_list(["a", "b", "ab"])
        w.add_token_merges(["a b", "ab"])

    with pytest.raises(ValueError, match=r"tokenizer.ggml.merges\[1\] 'ab' is not two tokens"):
        gguf_tokenizer(_tokenizer_file(tmp_path / "m.gguf", bad_merge))


def test_npattn_generate_runs_a_gguf_file(tmp_path, capsys, monkeypatch):
    """The CLI on a GGUF file: the model by from_gguf, the prompt encoded by the file's tokenizer,
    the greedy completion printed; --chat renders the file's chat template."""
    from npattn.__main__ import main

    tok = _bpe_tokenizer("qwen2")
    config = dict(QWEN3, vocab_size=tok.get_vocab_size(), eos_token_id=None)
    src = _model(config)
    for p in src.parameters():
        p.data[...] = p.data * 4  # a peaked distribution: greedy is stable
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3")
    _metadata(w, config, "qwen3")
    _write_tokenizer(w, tok, "qwen2", tmp_path, chat_template="<|im_start|>{{ messages[0]['content'] }}<|im_end|>")
    for (key, name), value in _as_gguf(src.state_dict(), config, "qwen3").items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    loaded = CausalLM.from_gguf(path)
    prompt = "the cat sat"
    ids = tok.encode(prompt).ids
    eos = tok.token_to_id("<|im_end|>")
    expect = loaded.generate(np.array([ids]), 5, eos_token_id=eos)[0, len(ids) :].tolist()
    if eos in expect:
        expect = expect[: expect.index(eos) + 1]
    assert main(["generate", str(path), prompt, "--max-new-tokens", "5"]) == 0
    first, last = capsys.readouterr().out.rstrip("\n").rsplit("\n", 1)
    assert first == prompt + tok.decode(expect)
    assert last.startswith(f"[{len(expect)} tokens in ")
    small = CausalLM.from_gguf(path, weights_dtype="bfloat16")  # --bfloat16: the model so loaded
    expect16 = small.generate(np.array([ids]), 5, eos_token_id=eos)[0, len(ids) :].tolist()
    if eos in expect16:
        expect16 = expect16[: expect16.index(eos) + 1]
    made = []
    real = CausalLM.from_gguf.__func__
    with monkeypatch.context() as mp:
        mp.setattr(CausalLM, "from_gguf", classmethod(lambda cls, *a, **k: made.append(real(cls, *a, **k)) or made[-1]))
        assert main(["generate", str(path), prompt, "--max-new-tokens", "5", "--bfloat16"]) == 0
    assert capsys.readouterr().out.rstrip("\n").rsplit("\n", 1)[0] == prompt + tok.decode(expect16)
    assert [m.weights_dtype for m in made] == ["bfloat16"]
    chat_ids = tok.encode("<|im_start|>hi<|im_end|>", add_special_tokens=False).ids
    expect = loaded.generate(np.array([chat_ids]), 3, eos_token_id=eos)[0, len(chat_ids) :].tolist()
    if eos in expect:
        expect = expect[: expect.index(eos) + 1]
    opened = []
    from npattn.models import gguf as G

    reader = G._reader_class()
    monkeypatch.setattr(G, "_reader_class", lambda: lambda p, *a: opened.append(p) or reader(p, *a))
    path.touch()  # a new modification time: read again, once for the model, the tokenizer and the template
    assert main(["generate", str(path), "hi", "--max-new-tokens", "3", "--chat"]) == 0
    assert capsys.readouterr().out.rstrip("\n").rsplit("\n", 1)[0] == tok.decode(expect)
    assert opened == [str(path)]
    assert main(["generate", str(tmp_path / "none.gguf"), "hi"]) == 2
    assert "no such directory or GGUF file" in capsys.readouterr().err


# -- SentencePiece (tokenizer.ggml.model "llama": Llama 2's, Gemma's) --------------------------------
SPM_TEXTS = [
    "Hello world",
    "the cat sat on the mat",
    "  two  spaces, then € and 日本 outside the vocabulary",
    "tabs\tand\nnew lines",
    "<start_of_turn>user\nhi<end_of_turn>",
]


def _llama_cpp_spm(text: str, tokens: list, scores: list, types: list, prefix: bool) -> list:
    """llama.cpp's SentencePiece tokenization (``llama_vocab::tokenize``, ``llm_tokenizer_spm``),
    written out: special and user-defined tokens matched whole first; in each stretch of text
    between them a space put first (with ``add_space_prefix``), spaces as ``▁``, then the adjacent
    pair whose joint piece is in the vocabulary and scores highest (the leftmost of equals) merged
    until none is; a piece outside the vocabulary as its UTF-8 bytes ``<0xXX>``."""
    import re

    vocab = {t: i for i, t in reversed(list(enumerate(tokens)))}
    whole = sorted((t for t, k in zip(tokens, types) if k in (3, 4)), key=len, reverse=True)
    parts = re.split("(" + "|".join(map(re.escape, whole)) + ")", text) if whole else [text]
    ids: list = []
    for n, part in enumerate(parts):
        if n % 2:
            ids.append(vocab[part])
            continue
        if not part:
            continue
        symbols = list((" " + part if prefix else part).replace(" ", "\u2581"))
        while True:
            best = None
            for i in range(len(symbols) - 1):
                j = vocab.get(symbols[i] + symbols[i + 1])
                if j is not None and (best is None or scores[j] > best[0]):
                    best = (scores[j], i)
            if best is None:
                break
            i = best[1]
            symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
        for sym in symbols:
            ids += [vocab[sym]] if sym in vocab else [vocab[f"<0x{b:02X}>"] for b in sym.encode()]
    return ids


def _spm_file(path, prefix: bool):
    """A SentencePiece-shaped vocabulary as llama.cpp's converter writes one (``_set_vocab_sentencepiece``):
    <unk>, <bos>, <eos>, the 256 byte tokens, the characters and pieces of a BPE trained here on
    ``▁`` for spaces, each scored by its rank (later pieces lower), two turn markers."""
    tk = pytest.importorskip("tokenizers")
    bpe = tk.Tokenizer(tk.models.BPE())
    bpe.normalizer = tk.normalizers.Replace(" ", "\u2581")
    corpus = ["the cat sat on the mat and the dog sat on the hat", "Hello world, hello there"] * 20
    bpe.train_from_iterator(corpus, tk.trainers.BpeTrainer(vocab_size=120))
    pieces = sorted(bpe.get_vocab(), key=bpe.get_vocab().get)
    tokens = ["<unk>", "<bos>", "<eos>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    tokens += ["<start_of_turn>", "<end_of_turn>"]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces) + [3, 4]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [0.0, 0.0]
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_space_prefix(prefix)
    w.add_add_bos_token(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tokens, scores, types


@pytest.mark.parametrize("prefix", [False, True], ids=["gemma", "llama2"])
def test_sentencepiece_tokenizer_encodes_as_llama_cpp(tmp_path, prefix):
    from npattn.models.gguf import gguf_tokenizer

    tokens, scores, types = _spm_file(tmp_path / "s.gguf", prefix)
    got = gguf_tokenizer(tmp_path / "s.gguf")
    for text in SPM_TEXTS:
        want = _llama_cpp_spm(text, tokens, scores, types, prefix)
        assert got.encode(text).ids == want, text
        if "<" not in text:  # the text back, the bytes of the characters outside the vocabulary joined
            assert got.decode(want) == text
    assert len(_llama_cpp_spm(SPM_TEXTS[1], tokens, scores, types, prefix)) < len(SPM_TEXTS[1]) // 2  # merged


# Phi-3 / Phi-3.5's chat template (tokenizer_config.json), its turn markers added tokens
_PHI3_CHAT = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>' + '\\n' + message['content'] + '<|end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' + '\\n' }}{% endif %}"
)


def _phi3_spm_file(path, config):
    """A phi3 file with a SentencePiece vocabulary as llama.cpp's converter writes Phi-3's and
    Phi-3.5's (``Phi3MiniModel.set_vocab``): tokenizer.model's pieces (<unk>, <s>, </s>, the bytes,
    the pieces of a BPE trained here, scored by rank), the added tokens after them scored -1000
    (special: CONTROL, else USER_DEFINED), the rest of the embedding's rows ``[PAD{i}]`` UNUSED
    at -10000; tokenizer.ggml.pre "default", no add_space_prefix key (llama.cpp's default:
    true); the model's weights in float32 (peaked, so that greedy decoding is stable).  Returns
    ``(model, tokens, scores, types)``."""
    tk = pytest.importorskip("tokenizers")
    bpe = tk.Tokenizer(tk.models.BPE())
    bpe.normalizer = tk.normalizers.Replace(" ", "\u2581")
    corpus = ["the cat sat on the mat and the dog sat on the hat", "Hello world, hello there"] * 20
    bpe.train_from_iterator(corpus, tk.trainers.BpeTrainer(vocab_size=120))
    pieces = sorted(bpe.get_vocab(), key=bpe.get_vocab().get)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    added = [("<|endoftext|>", 3), ("<|assistant|>", 3), ("<|placeholder1|>", 4), ("<|end|>", 3), ("<|user|>", 3)]
    tokens += [t for t, _ in added]
    types += [k for _, k in added]
    scores += [-1000.0] * len(added)
    pads = 7
    tokens += [f"[PAD{len(tokens) + i}]" for i in range(pads)]
    types += [5] * pads
    scores += [-10000.0] * pads
    config = dict(config, vocab_size=len(tokens), bos_token_id=1, eos_token_id=tokens.index("<|endoftext|>"))
    src = _model(config)
    for p in src.parameters():
        p.data[...] = p.data * 4
    w = gguf.GGUFWriter(str(path), "phi3")
    _metadata(w, config, "phi3")
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(config["eos_token_id"])
    w.add_chat_template(_PHI3_CHAT)
    for name, value in _phi3_factors(config):
        w.add_tensor(name, value)
    for (_, name), value in _as_gguf(src.state_dict(), config, "phi3").items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return CausalLM.from_gguf(path), tokens, scores, types


def test_phi3_sentencepiece_file_end_to_end(tmp_path, capsys, monkeypatch):
    """A Phi-3 / Phi-3.5 GGUF file (tokenizer.ggml.model "llama"): its tokenizer encodes as
    llama.cpp does (the bos first, the turn markers whole, no ``[PAD]`` row reached), and
    ``npattn generate`` prints the prompt and the model's greedy continuation (each word's
    space kept), and with ``--chat`` the reply to the file's chat template."""
    from npattn.__main__ import main
    from npattn.models.gguf import gguf_tokenizer

    path = tmp_path / "phi3.gguf"
    model, tokens, scores, types = _phi3_spm_file(path, PHI3_MINI)
    tok = gguf_tokenizer(path)
    chat = "<|user|>\nthe cat sat<|end|>\n<|assistant|>\n"
    for text in [*SPM_TEXTS[:4], chat, "<|placeholder1|>the hat"]:
        want = [1] + _llama_cpp_spm(text, tokens, scores, types, True)
        assert tok.encode(text).ids == want, text
        assert all(types[i] != 5 for i in want), text
    eos = tokens.index("<|endoftext|>")
    for prompt, args in (("the cat sat", []), ("the dog", ["--chat"])):
        text = chat.replace("the cat sat", prompt) if args else prompt
        ids = tok.encode(text, add_special_tokens=not args).ids
        new = model.generate(np.array([ids]), 5, eos_token_id=eos)[0, len(ids) :].tolist()
        new = new[: new.index(eos) + 1] if eos in new else new
        assert main(["generate", str(path), prompt, "--max-new-tokens", "5", *args]) == 0
        printed = capsys.readouterr().out.rstrip("\n").rsplit("\n", 1)[0]
        whole = tok.decode(ids + new, skip_special_tokens=True)
        if args:  # the reply alone
            assert printed == tok.decode(new, skip_special_tokens=True)
        else:  # the prompt, then the continuation as the whole sequence decodes it
            assert printed == whole, (printed, whole)
    # a continuation of words: each one's space kept (a SentencePiece decoder strips the first
    # space of a text: "▁the" alone decodes as "the")
    from npattn.tools import generate as G

    words = [tokens.index(w) for w in ("\u2581the", "\u2581wor", "\u2581there")]
    monkeypatch.setattr(G, "stream", lambda *a, **k: iter(words))
    assert main(["generate", str(path), "the cat", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.split("\n")[0] == "the cat the wor there"


def test_the_padding_id_is_generates_not_the_embeddings(tmp_path):
    """tokenizer.ggml.padding_token_id pads generate's finished rows (the model's generation
    config, with the file's eos); the config's pad_token_id, which would freeze an embedding row
    in training, stays the family's (none for Qwen3)."""
    config = dict(QWEN3, eos_token_id=None)
    src = _model(config)
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3")
    _metadata(w, config, "qwen3")
    free = src.generate(np.array([[1, 2, 3]]), 6, eos_token_id=[])[0, 3:].tolist()
    k = next(k for k in range(1, 6) if free[k] not in free[:k])  # the eos: a token first produced at step k
    eos, pad = free[k], next(t for t in range(config["vocab_size"]) if t not in free[: k + 1])
    w.add_eos_token_id(eos)
    w.add_pad_token_id(pad)
    for (key, name), value in _as_gguf(src.state_dict(), config, "qwen3").items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    m = CausalLM.from_gguf(path)
    assert m.config.pad_token_id is None
    assert m.generation_defaults == {"eos_token_id": eos, "pad_token_id": pad, "repetition_penalty": None}
    out = m.generate(np.array([[1, 2, 3]]), 6)[0, 3:].tolist()
    assert out == free[: k + 1] + [pad] * (5 - k)


@pytest.mark.parametrize("rows_at_a_time", [None, 3])
@pytest.mark.parametrize(
    "config, arch, qtype",
    [
        (QWEN3, "qwen3", Q.Q4_K),
        (QWEN3, "qwen3", Q.BF16),
        (LLAMA, "llama", Q.Q8_0),
        (PHI3, "phi3", Q.Q4_K),
        (QWEN2_MOE, "qwen2moe", Q.Q4_K),
        (GRANITE4_HYBRID, "granitehybrid", Q.Q8_0),
        (FALCON_H1, "falcon-h1", Q.Q4_K),
    ],
)
def test_bfloat16_storage_of_a_gguf_file(tmp_path, monkeypatch, config, arch, qtype, rows_at_a_time):
    """``weights_dtype="bfloat16"``: each large matrix the file's dequantized values rounded to
    bfloat16 (a BF16 file's own bits), block of rows by block of rows (``rows_at_a_time``; no
    float32 copy of a whole matrix), the rest as the float32 model's; the logits, cached
    decoding too, those of the float32 model with those matrices so rounded; half its bytes."""
    from _oracles import rel_err

    from npattn.functional._bfloat16 import BFloat16Array, to_bfloat16_bits, widened
    from npattn.models import gguf as G

    _write(tmp_path / "m.gguf", config, _model(config).state_dict(), qtype, arch)
    ref = CausalLM.from_gguf(tmp_path / "m.gguf")
    if rows_at_a_time:
        monkeypatch.setattr(G, "_DEQUANTIZE_VALUES", rows_at_a_time * config["hidden_size"])
    rounded: list = []
    real = G.to_bfloat16_bits
    monkeypatch.setattr(G, "to_bfloat16_bits", lambda x, out=None: rounded.append(x.shape) or real(x, out=out))
    m = CausalLM.from_gguf(tmp_path / "m.gguf", weights_dtype="bfloat16")
    assert rounded  # rounded as read, into the bits
    # (llama's and granitehybrid's q/k rows are permuted whole first; each part of Phi-3's fused q/k/v
    # and gate/up is read block of rows by block of rows, as any tensor)
    if rows_at_a_time and arch not in _PERMUTED:
        assert max(shape[0] for shape in rounded if len(shape) == 2) == rows_at_a_time
    assert m.weights_dtype == "bfloat16" and m.dtype == np.float32
    nf = sum(p.data.nbytes for p in ref.parameters())
    refs = dict(ref.named_parameters())
    for name, p in m.named_parameters():
        if isinstance(p.data, BFloat16Array):
            np.testing.assert_array_equal(p.data.bits, to_bfloat16_bits(refs[name].data), err_msg=name)
            refs[name].data = widened(p.data.bits)
        else:
            np.testing.assert_array_equal(p.data, refs[name].data, err_msg=name)
    assert sum(p.data.nbytes for p in m.parameters()) < 0.56 * nf
    ids = np.random.default_rng(1).integers(0, config["vocab_size"], (2, 6))
    with no_grad():  # the same weights (checked above) in another summation order (the bfloat16
        # product runs block by block): float32 roundings over sums of 256 terms, layer after layer
        assert rel_err(m(ids), ref(ids), relative_to="max_b") < 1e-5
    np.testing.assert_array_equal(m.generate(ids, 4), ref.generate(ids, 4))


def test_a_bad_weights_dtype_is_refused_before_the_file_is_read(tmp_path):
    with pytest.raises(ValueError, match="weights_dtype: expected None or 'bfloat16', got 'float16'"):
        CausalLM.from_gguf(tmp_path / "missing.gguf", weights_dtype="float16")
    with pytest.raises(ValueError, match="dtype"):
        CausalLM.from_gguf(tmp_path / "missing.gguf", dtype=np.float64, weights_dtype="bfloat16")


def test_the_reader_parses_what_gguf_s_own_does_through_a_plain_view(tmp_path):
    """``_reader_class``: every field (arrays of strings, floats, ints) and tensor as
    ``gguf.GGUFReader`` parses them, its slices plain ndarrays (a slice of a memmap runs
    memmap's Python-level hooks: the cost of opening a big vocabulary)."""
    from npattn.models.gguf import _reader_class

    path = tmp_path / "v.gguf"
    _write(path, QWEN3, _model(QWEN3).state_dict(), Q.Q8_0, "qwen3")
    w = gguf.GGUFWriter(str(tmp_path / "vocab.gguf"), "qwen3")
    n = 3000
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"tok{i}" for i in range(n)])
    w.add_token_scores([float(-i) for i in range(n)])
    w.add_token_types([1 + i % 3 for i in range(n)])
    w.add_token_merges([f"t ok{i}" for i in range(n)])
    w.add_tensor("token_embd.weight", np.arange(32, dtype=np.float32).reshape(4, 8))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for p in (path, tmp_path / "vocab.gguf"):
        ours, theirs = _reader_class()(str(p)), gguf.GGUFReader(str(p))
        assert type(ours.data) is np.ndarray and isinstance(theirs.data, np.memmap)
        assert list(ours.fields) == list(theirs.fields)
        for key, field in theirs.fields.items():
            assert ours.fields[key].types == field.types, key
            assert ours.fields[key].contents() == field.contents(), key
        assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
        for a, b in zip(ours.tensors, theirs.tensors):
            assert (a.tensor_type, list(a.shape)) == (b.tensor_type, list(b.shape)) and type(a.data) is np.ndarray
            np.testing.assert_array_equal(a.data, b.data)


@pytest.mark.parametrize("qtype", [Q.F16, Q.Q8_0, Q.Q4_K], ids=lambda q: q.name)
@_cases("llama", "qwen3moe", "gemma3", "granite4-granitehybrid")
def test_dequantized_a_few_rows_at_a_time_as_a_whole(tmp_path, monkeypatch, config, arch, qtype):
    """``_dequantize_into`` three rows at a time (the last block of rows shorter, each expert of a
    stacked tensor apart): the values of the whole tensor's dequantization, the permuted q/k
    rows (llama), the joined experts (qwen3moe), the shifted norms (gemma3) and Mamba-2's A and
    per-group norm (granitehybrid: (H, 1) and (G, I/G) in the file) included."""
    from npattn.models import gguf as G

    sd = _state(config)
    want = _hf_values(_write(tmp_path / "m.gguf", config, sd, qtype, arch), sd, config, arch)
    calls = []
    real = gguf.quants.dequantize
    monkeypatch.setattr(G, "_DEQUANTIZE_VALUES", 3 * config["hidden_size"] + 5)
    monkeypatch.setattr(gguf.quants, "dequantize", lambda data, q: calls.append(data.shape) or real(data, q))
    _assert_holds(CausalLM.from_gguf(tmp_path / "m.gguf"), want)
    assert any(len(s) == 2 and s[0] == 3 for s in calls) and any(len(s) == 2 and s[0] < 3 for s in calls)


@_cases("qwen3moe", "phi3")
def test_each_tensor_s_file_pages_are_released_once_read(tmp_path, monkeypatch, config, arch):
    """Loading releases (``MADV_DONTNEED``) every byte of every tensor once dequantized, block of
    rows by block of rows (each part of Phi-3's fused tensors its own rows' bytes): the process
    holds the model, not the model plus the file."""
    from npattn.models import gguf as G
    from npattn.models.hf import _Mapping

    path = tmp_path / "m.gguf"
    _write(path, config, _model(config).state_dict(), Q.Q8_0, arch)
    released: list = []
    real = _Mapping.release
    monkeypatch.setattr(_Mapping, "release", lambda self, b, e: released.append((b, e)) or real(self, b, e))
    monkeypatch.setattr(G, "_DEQUANTIZE_VALUES", 5 * config["hidden_size"])
    CausalLM.from_gguf(path)
    covered = np.zeros(path.stat().st_size, np.int64)
    for b, e in released:
        covered[b:e] += 1
    tensors = G._read(path).reader.tensors
    factors = ("rope_factors_long.weight", "rope_factors_short.weight")  # read into the config, not released
    assert all(
        (covered[t.data_offset : t.data_offset + t.n_bytes] == 1).all() for t in tensors if t.name not in factors
    )
    assert len(released) > len(tensors)  # block by block


# -- Phi-3 (llama.cpp's phi3) -------------------------------------------------------------------
def _phi3_hf(config, want: dict):
    """transformers' Phi3ForCausalLM (float64, eager) of ``config`` holding ``want`` (npattn's names)."""
    torch = pytest.importorskip("torch")
    T = pytest.importorskip("transformers")
    from _hf64 import build

    hf, _ = build(T.Phi3Config, T.Phi3ForCausalLM, **{k: v for k, v in config.items() if k != "model_type"})
    sd = {k: torch.from_numpy(v.astype(np.float64)) for k, v in _phi3_checkpoint(want).items()}
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return hf


@pytest.mark.parametrize("length", [3, 4, 5, 9])  # the switch at 4: short, short, long, long
@pytest.mark.parametrize("config", [PHI3, PHI3_MINI], ids=["tied", "untied-window"])
def test_phi3_file_is_transformers_phi3_on_both_sides_of_longrope(tmp_path, config, length):
    """A Q4_K phi3 file (fused attn_qkv, gate and up in ffn_up, LongRoPE's factors as tensors) is
    transformers' Phi-3 of the source config on its dequantized weights, to 1e-9, on both sides of
    LongRoPE's switch (transformers', per call: llama.cpp picks the factors once, from the
    context size); the config read back is the source's (partial rotary, factors, original
    length, window, tied head)."""
    from _hf64 import hf_logits
    from _oracles import rel_err

    sd = _model(config).state_dict()
    held = _write(tmp_path / "m.gguf", config, sd, Q.Q4_K, "phi3")
    assert "blk.0.attn_qkv.weight" in held and "blk.0.ffn_gate.weight" not in held
    assert ("output.weight" in held) == (not config["tie_word_embeddings"])
    want = _hf_values(held, sd, config, "phi3")
    loaded = CausalLM.from_gguf(tmp_path / "m.gguf", dtype=np.float64)
    hf_cfg = loaded.config.hf
    for key in ("partial_rotary_factor", "original_max_position_embeddings", "max_position_embeddings"):
        assert hf_cfg[key] == config[key], key
    assert hf_cfg["rope_scaling"] == {
        k: config["rope_scaling"][k] for k in ("rope_type", "short_factor", "long_factor")
    }
    assert hf_cfg.get("sliding_window") == config.get("sliding_window")
    assert loaded.config.tie_word_embeddings == config["tie_word_embeddings"]
    ids = np.random.default_rng(length).integers(0, config["vocab_size"], (2, length))
    hf = _phi3_hf(config, want)
    assert rel_err(_logits(loaded, ids), hf_logits(hf, ids), floor=1e-300, relative_to="max_b") < 1e-9


def test_phi3_split_qkv_is_the_fused_file_s_model(tmp_path):
    """llama.cpp's phi3 loader takes attn_q / attn_k / attn_v where a file has no attn_qkv
    (create_tensor_qkv): such a file is the fused one's model, its q and k rows unpermuted
    (rotate-half RoPE: the converter permutes no phi3 row)."""
    sd = _model(PHI3).state_dict()
    _write(tmp_path / "fused.gguf", PHI3, sd, Q.F32, "phi3")
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v"}
    split = [
        (f"blk.{k.split('.')[2]}.{names[k.split('.')[-2]]}.weight", np.asarray(v, np.float32))
        for k, v in sd.items()
        if k.split(".")[-2] in names
    ]
    rest = {k: v for k, v in sd.items() if k.split(".")[-2] not in names}
    w = gguf.GGUFWriter(str(tmp_path / "split.gguf"), "phi3")
    _metadata(w, PHI3, "phi3")
    for name, value in (*_phi3_factors(PHI3), *split):
        w.add_tensor(name, value)
    for (_, name), value in _as_gguf(rest, PHI3, "phi3").items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    fused, loaded = CausalLM.from_gguf(tmp_path / "fused.gguf"), CausalLM.from_gguf(tmp_path / "split.gguf")
    for k, v in sd.items():
        np.testing.assert_array_equal(loaded.state_dict()[k], v, err_msg=k)
    ids = np.random.default_rng(1).integers(0, PHI3["vocab_size"], (2, 6))
    np.testing.assert_array_equal(_logits(loaded, ids), _logits(fused, ids))


@pytest.mark.parametrize(
    "qtype, weights_dtype",
    [(q, None) for q in (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)]
    + [(Q.Q4_K, "bfloat16"), (Q.BF16, "bfloat16")],
    ids=lambda v: getattr(v, "name", None) or str(v),
)
def test_phi3_fused_tensors_are_dequantized_part_by_part(tmp_path, monkeypatch, qtype, weights_dtype):
    """Each part of a fused attn_qkv / ffn_up (q, k, v; gate, up) dequantizes its own rows'
    blocks (``_GGUFTensor.rows``): every byte of every tensor of the file goes through
    ``gguf.quants.dequantize`` once (not once per part), no read is of a whole fused tensor,
    and the values are the whole tensor's dequantization, bit for bit."""
    from npattn.functional._bfloat16 import BFloat16Array, to_bfloat16_bits
    from npattn.models import gguf as G

    path = tmp_path / "m.gguf"
    sd = _model(PHI3).state_dict()
    want = _hf_values(_write(path, PHI3, sd, qtype, "phi3"), sd, PHI3, "phi3")
    f = G._read(path)
    base, size = f.reader.data.__array_interface__["data"][0], f.reader.data.size
    times = np.zeros(size, np.int64)
    real = gguf.quants.dequantize

    def spy(data, q):
        at = data.__array_interface__["data"][0] - base
        if 0 <= at < size:  # a view of the file (not _dequantizes' probe)
            times[at : at + data.nbytes] += 1
        return real(data, q)

    reads: list = []
    read_into = G._GGUFTensor.read_into
    monkeypatch.setattr(gguf.quants, "dequantize", spy)
    monkeypatch.setattr(G._GGUFTensor, "read_into", lambda self, out: reads.append(self.shape) or read_into(self, out))
    loaded = CausalLM.from_gguf(path, weights_dtype=weights_dtype)
    for t in f.reader.tensors:
        np.testing.assert_array_equal(times[t.data_offset : t.data_offset + t.n_bytes], 1, err_msg=t.name)
    H, hd = PHI3["hidden_size"], PHI3["hidden_size"] // PHI3["num_attention_heads"]
    fused = {(H + 2 * PHI3["num_key_value_heads"] * hd, H), (2 * PHI3["intermediate_size"], H)}
    assert not fused & set(reads)
    assert (H, H) in reads and (PHI3["intermediate_size"], H) in reads  # q rows; gate rows, up rows
    if weights_dtype is None:
        _assert_holds(loaded, want)
    else:
        for k, p in loaded.named_parameters():
            rounded = isinstance(p.data, BFloat16Array)
            np.testing.assert_array_equal(
                p.data.bits if rounded else p.data, to_bfloat16_bits(want[k]) if rounded else want[k], k
            )


def test_phi3_attention_factor_is_carried_only_where_it_is_not_transformers(tmp_path, monkeypatch):
    """The file's rope.scaling.attn_factor is float32 of the factor transformers computes from
    context_length / original_context_length: then transformers' own (float64) is used, no
    attention_factor in the config; a file whose factor is another (the converter's 'yarn'
    formula) keeps it as LongRoPE's attention_factor, and its logits are transformers' with it."""
    sd = _model(PHI3).state_dict()
    _write(tmp_path / "m.gguf", PHI3, sd, Q.F32, "phi3")
    assert "attention_factor" not in CausalLM.from_gguf(tmp_path / "m.gguf").config.hf["rope_scaling"]
    scale = PHI3["max_position_embeddings"] / PHI3["original_max_position_embeddings"]
    yarn = 0.1 * math.log(scale) + 1.0  # Phi3MiniModel's factor for a rope type 'yarn'
    monkeypatch.setattr(
        gguf.GGUFWriter,
        "add_rope_scaling_attn_factors",
        lambda self, v: self.add_float32("phi3.rope.scaling.attn_factor", yarn),
    )
    _write(tmp_path / "yarn.gguf", PHI3, sd, Q.F32, "phi3")
    loaded = CausalLM.from_gguf(tmp_path / "yarn.gguf", dtype=np.float64)
    got = loaded.config.hf["rope_scaling"]["attention_factor"]
    assert got == float(np.float32(yarn))
    config = dict(PHI3, rope_scaling=dict(PHI3["rope_scaling"], attention_factor=got))
    ids = np.random.default_rng(1).integers(0, PHI3["vocab_size"], (2, 7))
    ref = _logits(CausalLM.from_hf(sd, config, dtype=np.float64), ids)
    np.testing.assert_allclose(_logits(loaded, ids), ref, rtol=0, atol=1e-12 * np.abs(ref).max())
    assert np.abs(_logits(loaded, ids) - _logits(CausalLM.from_hf(sd, PHI3, dtype=np.float64), ids)).max() > 1e-3


def _phi3_file(path, extra=(), metadata=None, drop=()):
    """A PHI3 F32 file, its LongRoPE factors replaced by those of ``extra`` (by name) and without the
    tensors named in ``drop``, ``metadata`` ((key, value) pairs, float32) added."""
    sd = _model(PHI3).state_dict()
    w = gguf.GGUFWriter(str(path), "phi3")
    _metadata(w, PHI3, "phi3")
    for key, value in metadata or ():
        w.add_float32(key, value)
    tensors = dict(_phi3_factors(PHI3)) | dict(extra)
    tensors |= {name: value for (_, name), value in _as_gguf(sd, PHI3, "phi3").items()}
    for name, value in tensors.items():
        if name not in drop:
            w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    "extra, metadata, drop, match",
    [
        (
            [("rope_factors_long.weight", np.ones(23, np.float32))],
            (),
            (),
            r"tensor 'rope_factors_long.weight' holds 23 numbers; LongRoPE's long_factor is 24 positive numbers",
        ),
        (
            [("rope_factors_short.weight", np.zeros(24, np.float32))],
            (),
            (),
            r"tensor 'rope_factors_short.weight' holds 24 numbers; LongRoPE's short_factor is 24 positive",
        ),
        ((), (), ("rope_factors_short.weight",), r"no tensor 'rope_factors_short.weight' \(LongRoPE's factors"),
        ((), [("phi3.rope.scaling.factor", 8.0)], (), r"metadata 'phi3.rope.scaling.factor' is not supported"),
        (
            [("blk.0.ffn_gate.weight", np.zeros((256, 256), np.float32))],
            (),
            (),
            r"tensor 'blk.0.ffn_gate.weight' is not part of the phi3 model",
        ),
        (
            [("blk.0.attn_q.weight", np.zeros((256, 256), np.float32))],
            (),
            (),
            r"tensor 'blk.0.attn_q.weight' is not part of the phi3 model",
        ),
    ],
    ids=["long-length", "short-zero", "one-factor", "unknown-key", "extra-gate", "qkv-and-q"],
)
def test_phi3_inconsistent_files_are_refused_by_name(tmp_path, extra, metadata, drop, match):
    with pytest.raises(ValueError, match=match):
        CausalLM.from_gguf(_phi3_file(tmp_path / "m.gguf", extra, metadata, drop))


def test_longrope_factors_in_another_architecture_are_refused_by_name(tmp_path):
    factors = _phi3_factors(PHI3)
    _write(tmp_path / "m.gguf", QWEN3, _model(QWEN3).state_dict(), Q.F32, "qwen3", extra=factors)
    with pytest.raises(ValueError, match=r"'rope_factors_long.weight' \(LongRoPE\) is not supported in a qwen3 file"):
        CausalLM.from_gguf(tmp_path / "m.gguf")


def test_phi3_rotated_features_give_transformers_own_count():
    """rope.dimension_count d of heads of h: partial_rotary_factor d / h, or the next float up
    where transformers' int(h * factor) would give d - 1 (d = 6, h = 98)."""
    from npattn.models.configs import _gguf_phi3

    for h in range(2, 257, 2):
        for d in range(2, h, 2):
            config = {"head_dim": h}
            _gguf_phi3(config, {"rope.dimension_count": d})
            assert int(h * config["partial_rotary_factor"]) == d, (h, d)
    with pytest.raises(ValueError, match=r"'phi3.rope.dimension_count' 7: expected an even number"):
        _gguf_phi3({"head_dim": 8}, {"rope.dimension_count": 7})


@pytest.mark.parametrize(
    "counts, match",
    [
        (None, None),
        ([2, 2], r"head_count_kv' \[2, 2\]: expected 3 counts \(block_count\)"),
        ([0, 2, 1], r"head_count_kv' \[0, 2, 1\]: attention layers' counts differ"),
    ],
)
def test_lfm2_layer_types_and_width_are_the_file_s(tmp_path, monkeypatch, counts, match):
    """llama.cpp's lfm2 files: the layer types are head_count_kv's zeros, the MLP's width the
    file's feed_forward_length (adjusted once, by the converter), the convolution's weight stored
    (D, K) read back as (D, 1, K); per-layer counts that do not fit are refused by name.  A width
    of 768 (int(2 * 1152 / 3)): adjusted again with LFM2's defaults it would be 512."""
    config = dict(LFM2, intermediate_size=1152)
    sd = _model(config).state_dict()
    if counts is not None:
        add = gguf.GGUFWriter.add_head_count_kv
        monkeypatch.setattr(gguf.GGUFWriter, "add_head_count_kv", lambda self, value: add(self, counts))
    held = _write(tmp_path / "m.gguf", config, sd, Q.F32, "lfm2")
    if match is not None:
        with pytest.raises(ValueError, match=match):
            CausalLM.from_gguf(tmp_path / "m.gguf")
        return
    assert held["blk.0.shortconv.conv.weight"].shape == (256, 3)
    m = CausalLM.from_gguf(tmp_path / "m.gguf")
    assert m.config.layer_types == ("conv", "full_attention", "conv")
    assert m.config.intermediate_size == 768 and m.config.short_conv.conv_L_cache == 3
    assert m.config.num_key_value_heads == LFM2["num_key_value_heads"] and m.config.tie_word_embeddings
    np.testing.assert_array_equal(
        m.state_dict()["model.layers.2.conv.conv.weight"], sd["model.layers.2.conv.conv.weight"]
    )


def test_lfm2moe_routing_is_the_file_s():
    """llama.cpp's lfm2moe files: the dense layers leading_dense_block_count (llama.cpp's default
    0 where the file leaves it out, not Lfm2MoeConfig's 2), the experts' counts and width, sigmoid
    routing through the expert bias exp_probs_b.bias, renormalised and never scaled (llama.cpp's
    build_moe_ffn); a softmax gating, a missing expert width and a missing bias refused by name."""
    from npattn.models.configs import _gguf_lfm2moe

    base = dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=[0, 2, 0], rms_norm_eps=1e-5)
    experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
    config = dict(base, **experts)
    _gguf_lfm2moe(config, {"expert_gating_func": 2})
    assert config["layer_types"] == ["conv", "full_attention", "conv"] and config["num_key_value_heads"] == 2
    assert config["num_dense_layers"] == 0 and config["norm_eps"] == 1e-5 and "rms_norm_eps" not in config
    assert (config["norm_topk_prob"], config["routed_scaling_factor"], config["use_expert_bias"]) == (True, 1.0, True)
    kept = dict(base, **experts, num_dense_layers=1)
    _gguf_lfm2moe(kept, {})  # no gating key: sigmoid, the only one the converter writes
    assert kept["num_dense_layers"] == 1
    one = dict(base, **experts, num_key_value_heads=2)  # one count: every layer attends, as llama.cpp reads it
    _gguf_lfm2moe(one, {})
    assert one["layer_types"] == ["full_attention"] * 3 and one["num_key_value_heads"] == 2
    with pytest.raises(ValueError, match=r"'lfm2moe.expert_gating_func' 1 is not supported"):
        _gguf_lfm2moe(dict(base, **experts), {"expert_gating_func": 1})
    with pytest.raises(ValueError, match=r"'lfm2moe.expert_feed_forward_length' missing"):
        _gguf_lfm2moe(dict(base, num_experts=4, num_experts_per_tok=2), {})
    with pytest.raises(ValueError, match=r"'lfm2moe.expert_count' missing"):
        _gguf_lfm2moe(dict(base, num_experts_per_tok=2, moe_intermediate_size=8), {})


def test_lfm2moe_file_without_the_expert_bias_is_refused_by_name(tmp_path):
    sd = _model(LFM2_MOE).state_dict()
    sd = {k: v for k, v in sd.items() if not k.endswith("expert_bias")}
    _write(tmp_path / "m.gguf", LFM2_MOE, sd, Q.F32, "lfm2moe")
    with pytest.raises(ValueError, match=r"no tensor 'blk.1.exp_probs_b.bias'"):
        CausalLM.from_gguf(tmp_path / "m.gguf")


def test_olmo2_files_as_llama_cpp_reads_them():
    """llama.cpp's olmo2: no window (or 0) is OLMo 2 (YaRN on every layer); a window is OLMo 3,
    its layers the file's booleans, else llama.cpp's period (set_swa_pattern: layer i sliding
    where i % p < p - 1; 0 every layer; absent 4), the full layers' YaRN and base, the sliding
    layers' plain RoPE of rope.freq_base_swa or rope.freq_base; the YaRN attention factor under
    either converter's key; biases, another scaling type, a scaling key without its type, a
    factorless YaRN, differing attention factors and malformed windows or patterns refused by name."""
    from npattn.models.configs import GGUF_FAMILIES

    derive = GGUF_FAMILIES["olmo2"].derive
    yarn = {"rope.scaling.type": "yarn", "rope.scaling.factor": 8.0, "rope.scaling.original_context_length": 8192}

    def config(**kw):
        return dict(model_type="olmo2", num_hidden_layers=8, rope_theta=5e5, attention_bias=False, **kw)

    c = config()
    derive(c, {"attention.sliding_window": 0})
    assert c == dict(model_type="olmo2", num_hidden_layers=8, rope_theta=5e5)
    c = config()
    derive(c, dict(yarn, **{"rope.scaling.attn_factor": 1.25}))
    assert c["model_type"] == "olmo2" and c["rope_scaling"] == {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 8192,
        "attention_factor": 1.25,
    }
    sliding, full = "sliding_attention", "full_attention"
    c = config()
    derive(c, dict(yarn, **{"attention.sliding_window": 4096, "rope.scaling.yarn_beta_fast": 16.0}))
    assert c["model_type"] == "olmo3" and c["sliding_window"] == 4096 and "rope_theta" not in c
    assert c["layer_types"] == [sliding, sliding, sliding, full] * 2  # llama.cpp's period of 4
    assert c["rope_parameters"] == {
        full: {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 8192,
            "beta_fast": 16.0,
            "rope_theta": 5e5,
        },
        sliding: {"rope_type": "default", "rope_theta": 5e5},
    }
    for pattern, types in (
        (2, [sliding, full] * 4),
        (1, [full] * 8),
        (0, [sliding] * 8),
        ([True, False] * 4, [sliding, full] * 4),
    ):
        c = config()
        window = {"attention.sliding_window": 16, "attention.sliding_window_pattern": pattern}
        derive(c, dict(window, **{"rope.freq_base_swa": 1e4}))
        assert c["layer_types"] == types, pattern
        assert c["rope_parameters"] == {
            full: {"rope_type": "default", "rope_theta": 5e5},
            sliding: {"rope_type": "default", "rope_theta": 1e4},
        }
    for meta, match in (
        ({"attention.sliding_window": -1}, r"'olmo2.attention.sliding_window' -1: expected an integer >= 0"),
        ({"attention.sliding_window_pattern": [True] * 8}, r"'olmo2.attention.sliding_window_pattern' without"),
        (
            {"attention.sliding_window": 16, "attention.sliding_window_pattern": [True] * 7},
            r"'olmo2.attention.sliding_window_pattern' \[.*\]: expected 8 booleans",
        ),
        (
            {"attention.sliding_window": 16, "attention.sliding_window_pattern": -2},
            r"'olmo2.attention.sliding_window_pattern' -2: expected one boolean per layer or a period",
        ),
        ({"rope.scaling.type": "linear"}, r"'olmo2.rope.scaling.type' 'linear' is not supported"),
        ({"rope.scaling.factor": 8.0}, r"'olmo2.rope.scaling.factor' without 'olmo2.rope.scaling.type' 'yarn'"),
        ({"rope.scaling.type": "yarn"}, r"'olmo2.rope.scaling.factor' missing"),
        (
            dict(yarn, **{"rope.scaling.attn_factor": 1.25, "rope.scaling.yarn_attn_factor": 1.5}),
            r"'olmo2.rope.scaling.attn_factor' 1.25 and 'olmo2.rope.scaling.yarn_attn_factor' 1.5 differ",
        ),
    ):
        with pytest.raises(ValueError, match=match):
            derive(config(), meta)
    with pytest.raises(ValueError, match=r"tensor 'blk.0.attn_q.bias': llama.cpp's olmo2 has no attention biases"):
        derive(dict(config(), attention_bias=True), {})


def test_olmo3_file_of_either_converter_and_its_refusals(tmp_path, monkeypatch):
    """An OLMo 3 file is read as its source model's config: olmo3, the file's (not llama.cpp's
    period-4) layer pattern, the window, YaRN on the full layer; one written by the older
    converter (the attention factor as rope.scaling.attn_factor, no betas: the config's are
    transformers' defaults here) is the same model; an olmo2 file with attention biases, and one
    with an attention factor beside LongRoPE's factor tensors, are refused naming the file."""
    full = dict(OLMO3["rope_parameters"]["full_attention"], beta_fast=32.0, beta_slow=1.0)
    config = dict(OLMO3, rope_parameters=dict(OLMO3["rope_parameters"], full_attention=full))
    sd = _model(config).state_dict()
    _write(tmp_path / "new.gguf", config, sd, Q.F32, "olmo2")
    monkeypatch.setattr(
        gguf.GGUFWriter, "add_rope_scaling_yarn_attn_factor", lambda self, v: self.add_rope_scaling_attn_factors(v)
    )
    for beta in ("fast", "slow"):
        monkeypatch.setattr(gguf.GGUFWriter, f"add_rope_scaling_yarn_beta_{beta}", lambda self, v: None)
    _write(tmp_path / "old.gguf", config, sd, Q.F32, "olmo2")
    monkeypatch.undo()
    meta = {k: f.contents() for k, f in gguf.GGUFReader(str(tmp_path / "old.gguf")).fields.items()}
    assert meta["olmo2.rope.scaling.attn_factor"] == 1.25 and "olmo2.rope.scaling.yarn_beta_fast" not in meta
    new, old = CausalLM.from_gguf(tmp_path / "new.gguf"), CausalLM.from_gguf(tmp_path / "old.gguf")
    cfg = new.config
    assert cfg.model_type == "olmo3" and cfg.layer_types == tuple(OLMO3["layer_types"])
    assert cfg.hf["sliding_window"] == 3 and cfg.hf["rope_parameters"]["full_attention"]["rope_type"] == "yarn"
    ids = np.random.default_rng(1).integers(0, config["vocab_size"], (2, 7))
    np.testing.assert_array_equal(_logits(old, ids), _logits(new, ids))
    np.testing.assert_array_equal(_logits(new, ids), _logits(CausalLM.from_hf(sd, config), ids))
    biased = dict(OLMO2, attention_bias=True)
    _write(tmp_path / "b.gguf", biased, _model(biased).state_dict(), Q.F32, "olmo2")
    with pytest.raises(ValueError, match=r"b.gguf: tensor 'blk.0.attn_q.bias': llama.cpp's olmo2 has no attention"):
        CausalLM.from_gguf(tmp_path / "b.gguf")
    factors = [("rope_factors_long.weight", np.ones(32, np.float32))]
    _write(tmp_path / "f.gguf", config, sd, Q.F32, "olmo2", factors)
    with pytest.raises(ValueError, match=r"f.gguf: 'rope_factors_long.weight' \(LongRoPE\) is not supported in a"):
        CausalLM.from_gguf(tmp_path / "f.gguf")


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_0], ids=lambda q: q.name)
def test_mixtral_experts_apart_are_the_stacked_file_s_model(tmp_path, qtype):
    """An early Mixtral file, each expert's gate, up and down its own tensor (blk.N.ffn_gate.x,
    as llama.cpp's loader still reads them), is the model of the file holding them stacked
    (ffn_*_exps): the same weights bit for bit (float32, and bfloat16 storage) and logits."""
    sd = _model(MIXTRAL).state_dict()
    _write(tmp_path / "stacked.gguf", MIXTRAL, sd, qtype, "llama")
    _write(tmp_path / "apart.gguf", MIXTRAL, sd, qtype, "llama", apart=True)
    names = {t.name for t in gguf.GGUFReader(str(tmp_path / "apart.gguf")).tensors}
    assert "blk.1.ffn_up.3.weight" in names and not any(n.endswith("_exps.weight") for n in names)
    for weights_dtype in (None, "bfloat16"):
        stacked = CausalLM.from_gguf(tmp_path / "stacked.gguf", weights_dtype=weights_dtype)
        apart = CausalLM.from_gguf(tmp_path / "apart.gguf", weights_dtype=weights_dtype)
        assert apart.config.model_type == "mixtral"
        want = stacked.state_dict()
        assert set(apart.state_dict()) == set(want)
        for k, v in apart.state_dict().items():
            np.testing.assert_array_equal(v, want[k], err_msg=k)
        ids = np.random.default_rng(1).integers(0, MIXTRAL["vocab_size"], (2, 6))
        np.testing.assert_array_equal(_logits(apart, ids), _logits(stacked, ids))


def test_mixtral_experts_apart_incomplete_or_mismatched_are_refused_by_name(tmp_path, monkeypatch):
    """An early Mixtral file missing one expert's tensor, with one expert too many, or with an
    expert whose matrix is not expert 0's shape is refused naming the file and the tensor."""
    sd = _model(MIXTRAL).state_dict()
    real = gguf.GGUFWriter.add_tensor

    def writing(change):
        def add(self, name, value, *args, **kwargs):
            return change(lambda n, v: real(self, n, v, *args, **kwargs), name, value)

        return add

    cases = {
        "missing": (lambda add, n, v: None if n == "blk.1.ffn_up.3.weight" else add(n, v)),
        "extra": (
            lambda add, n, v: (
                [add(n, v)] + ([add("blk.0.ffn_gate.4.weight", v)] if n == "blk.0.ffn_gate.3.weight" else [])
            )
        ),
        "shape": (lambda add, n, v: add(n, v[:-1] if n == "blk.0.ffn_down.2.weight" else v)),
    }
    for case, change in cases.items():
        monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", writing(change))
        _write(tmp_path / f"{case}.gguf", MIXTRAL, sd, Q.F32, "llama", apart=True)
        monkeypatch.undo()
    with pytest.raises(
        ValueError,
        match=r"missing.gguf: no tensor 'blk.1.ffn_up.3.weight' \(expert 3 of the model's "
        r"'model.layers.1.mlp.experts.gate_up_proj', 4 experts\)",
    ):
        CausalLM.from_gguf(tmp_path / "missing.gguf")
    with pytest.raises(
        ValueError, match=r"extra.gguf: tensor 'blk.0.ffn_gate.4.weight' is not part of the llama model"
    ):
        CausalLM.from_gguf(tmp_path / "extra.gguf")
    with pytest.raises(
        ValueError, match=r"shape.gguf: tensor 'blk.0.ffn_down.2.weight' has shape \(255, 256\), expert 0's"
    ):
        CausalLM.from_gguf(tmp_path / "shape.gguf")


# -- EXAONE 4.0 (llama.cpp's exaone4) -------------------------------------------------------------
def test_what_llama_cpp_s_exaone4_files_say_of_their_layers():
    """The converter's window and per-layer flags are the layer types (only the sliding layers
    rotate: the reader's rope_layers); no window, or a window without flags (a config with neither
    layer_types nor a pattern), is every layer full and rotating, as llama.cpp builds such files;
    a 64-layer file without them is llama.cpp's 32B (a window of 4096, every fourth layer full),
    an integer pattern such a period; what the converter never writes is refused by name."""
    from npattn.models.configs import GGUF_FAMILIES

    derive = GGUF_FAMILIES["exaone4"].derive
    for meta in ({}, {"attention.sliding_window": 8}):
        c = dict(num_hidden_layers=30, attention_bias=False)
        derive(c, meta)
        assert c == dict(num_hidden_layers=30, sliding_window=None, layer_types=["full_attention"] * 30)
    c = dict(num_hidden_layers=64)
    derive(c, {})
    assert c["sliding_window"] == 4096 and c["layer_types"] == (["sliding_attention"] * 3 + ["full_attention"]) * 16
    c = dict(num_hidden_layers=64)
    derive(c, {"attention.sliding_window": 2048})
    assert c["sliding_window"] == 2048 and c["layer_types"][:4] == ["sliding_attention"] * 3 + ["full_attention"]
    c = dict(num_hidden_layers=3)
    derive(c, {"attention.sliding_window": 5, "attention.sliding_window_pattern": [False, True, True]})
    assert c == dict(num_hidden_layers=3, sliding_window=5, layer_types=["full_attention"] + ["sliding_attention"] * 2)
    c = dict(num_hidden_layers=4)
    derive(c, {"attention.sliding_window": 5, "attention.sliding_window_pattern": 2})
    assert c["layer_types"] == ["sliding_attention", "full_attention"] * 2
    key = r"metadata 'exaone4.attention.sliding_window_pattern'"
    for meta, match in (
        ({"attention.sliding_window_pattern": [True, False]}, key + " without 'exaone4.attention.sliding_window'"),
        (
            {"attention.sliding_window": 5, "attention.sliding_window_pattern": [True] * 3},
            key + r".*expected 2 booleans",
        ),
        ({"attention.sliding_window": 5, "attention.sliding_window_pattern": [1, 0]}, key + r".*expected 2 booleans"),
        (
            {"attention.sliding_window": 5, "attention.sliding_window_pattern": 0},
            key + r" 0: expected one boolean per layer or a period >= 1",
        ),
        (
            {"attention.sliding_window": 0, "attention.sliding_window_pattern": 2},
            r"'exaone4.attention.sliding_window' 0",
        ),
    ):
        with pytest.raises(ValueError, match=match):
            derive(dict(num_hidden_layers=2), meta)
    with pytest.raises(ValueError, match=r"tensor 'blk.0.attn_q.bias': llama.cpp's exaone4 has no attention biases"):
        derive(dict(num_hidden_layers=2, attention_bias=True), {})


def test_exaone4_files_are_their_models(tmp_path, monkeypatch):
    """The 32B's kind of file: its window and flags, Llama 3's rope_freqs.weight read back as the
    config's scaling, the full layer without RoPE; the 1.2B's kind: every layer full and rotating.
    A file whose converter wrote the window but no flags is llama.cpp's model of it (every layer
    full and rotating: the logits of that config); a file with attention biases is refused
    naming the file."""
    sd = _model(EXAONE4).state_dict()
    _write(tmp_path / "32b.gguf", EXAONE4, sd, Q.F32, "exaone4")
    c = CausalLM.from_gguf(tmp_path / "32b.gguf").config
    assert c.layer_types == ("sliding_attention",) * 3 + ("full_attention",) and c.sliding_window == 3
    assert c.rope_layers == (True, True, True, False) and c.rope["default"] == dict(
        EXAONE4["rope_scaling"], rope_theta=1e6
    )
    _write(tmp_path / "1.2b.gguf", EXAONE4_1_2B, _model(EXAONE4_1_2B).state_dict(), Q.F32, "exaone4")
    c = CausalLM.from_gguf(tmp_path / "1.2b.gguf").config
    assert c.layer_types == ("full_attention",) * 2 and c.sliding_window is None and c.rope_layers is None
    monkeypatch.setattr(gguf.GGUFWriter, "add_sliding_window_pattern", lambda self, value: None)
    _write(tmp_path / "old.gguf", EXAONE4, sd, Q.F32, "exaone4")
    monkeypatch.undo()
    old = CausalLM.from_gguf(tmp_path / "old.gguf")
    assert old.config.rope_layers is None and set(old.config.layer_types) == {"full_attention"}
    ids = np.random.default_rng(1).integers(0, EXAONE4["vocab_size"], (2, 6))
    same = dict(EXAONE4, sliding_window=None, layer_types=["full_attention"] * 4)
    np.testing.assert_array_equal(_logits(old, ids), _logits(CausalLM.from_hf(old.state_dict(), same), ids))
    biased = dict(sd)
    for p in ("q", "k", "v"):
        biased[f"model.layers.0.self_attn.{p}_proj.bias"] = np.ones(
            sd[f"model.layers.0.self_attn.{p}_proj.weight"].shape[0], np.float32
        )
    _write(tmp_path / "b.gguf", EXAONE4, biased, Q.F32, "exaone4")
    with pytest.raises(ValueError, match=r"b.gguf: tensor 'blk.0.attn_q.bias': llama.cpp's exaone4 has no attention"):
        CausalLM.from_gguf(tmp_path / "b.gguf")


def test_a_glm4_file_is_its_directory(tmp_path):
    """A glm4 file as Glm4Model writes it (q/k rows as the checkpoint's: llama.cpp's normal RoPE
    rotates GLM's own interleaved pairs; rope.dimension_count 32 of 64 features; the norms after
    attention and after the MLP as post_attention_norm and post_ffw_norm, the one before the MLP as
    ffn_norm; gate and up in one ffn_up) is the model of its directory: config, tensors, logits."""
    g, _, _ = _file_is_its_directory(tmp_path, GLM4, "glm4")
    c = g.config
    assert c.rope_interleaved and c.sandwich_norm and c.head_dim == 64 and not c.tie_word_embeddings
    assert c.attention_config("full_attention").rope_scaling["partial_rotary_factor"] == 0.5
    assert c.attention_bias and c.attention_out_bias is False
    f = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    held = {t.name: np.asarray(t.data) for t in f.tensors}
    assert f.fields["glm4.rope.dimension_count"].contents() == 32
    sd = g.state_dict()
    for own, name in (
        ("post_self_attn_layernorm", "post_attention_norm"),
        ("post_attention_layernorm", "ffn_norm"),
        ("post_mlp_layernorm", "post_ffw_norm"),
    ):
        np.testing.assert_array_equal(sd[f"model.layers.1.{own}.weight"], held[f"blk.1.{name}.weight"], err_msg=own)
    gate_up = np.concatenate([sd["model.layers.0.mlp.gate_proj.weight"], sd["model.layers.0.mlp.up_proj.weight"]])
    np.testing.assert_array_equal(gate_up, held["blk.0.ffn_up.weight"])
    np.testing.assert_array_equal(sd["model.layers.0.self_attn.k_proj.weight"], held["blk.0.attn_k.weight"])
    assert "blk.0.ffn_gate.weight" not in held and "blk.0.attn_output.bias" not in held


@pytest.mark.parametrize(
    "meta, factor",
    [
        ({}, 1.0),
        ({"rope.dimension_count": 64}, 1.0),
        ({"rope.dimension_count": 32}, 0.5),
        ({"rope.dimension_count": 6}, 6 / 64),
    ],
)
def test_glm4_rotated_features_as_llama_cpp_reads_them(meta, factor):
    """rope.dimension_count is llama.cpp's n_rot: left out, the whole head rotates (its default,
    not Glm4Config's half); the factor given back is the one whose int(head_dim * factor) is it."""
    from npattn.models.configs import GGUF_FAMILIES

    config = {"model_type": "glm4", "head_dim": 64}
    GGUF_FAMILIES["glm4"].derive(config, meta)
    assert config["partial_rotary_factor"] == factor
    assert int(64 * config["partial_rotary_factor"]) == meta.get("rope.dimension_count", 64)


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("rope.dimension_count", 33, r"metadata 'glm4.rope.dimension_count' 33: expected an even number"),
        ("rope.dimension_count", 128, r"metadata 'glm4.rope.dimension_count' 128: expected .* to the head's 64"),
        # GLM-4V's M-RoPE (its converter reorders q/k for it): not GLM-4's text model
        ("rope.dimension_sections", [8, 12, 12, 0], r"metadata 'glm4.rope.dimension_sections' is not supported"),
        ("rope.scaling.type", "yarn", r"metadata 'glm4.rope.scaling.type' is not supported"),
        ("nextn_predict_layers", 1, r"metadata 'glm4.nextn_predict_layers' is not supported"),
    ],
)
def test_glm4_files_refused_by_name(tmp_path, monkeypatch, key, value, match):
    """A rotated width llama.cpp could not take, and what no GLM-4 text file holds (M-RoPE's
    sections, RoPE scaling, GLM-OCR's MTP layers), refused naming the file and the key."""
    add = gguf.GGUFWriter.add_rope_freq_base

    def with_key(self, base):
        add(self, base)  # (after rope.dimension_count, which a new value overwrites)
        if isinstance(value, list):
            self.add_array(f"glm4.{key}", value)
        elif isinstance(value, str):
            self.add_string(f"glm4.{key}", value)
        else:
            self.add_uint32(f"glm4.{key}", value)

    monkeypatch.setattr(gguf.GGUFWriter, "add_rope_freq_base", with_key)
    _write(tmp_path / "m.gguf", GLM4, _state(GLM4), Q.F32, "glm4")
    with pytest.raises(ValueError, match=rf"m.gguf: {match}"):
        CausalLM.from_gguf(tmp_path / "m.gguf")


_COHERE_FILES = {
    "cohere2": (COHERE2, "cohere2"),
    "command-r": (COMMAND_R, "command-r"),
    "command-r-plus": (COMMAND_R_PLUS, "command-r"),
}


@pytest.mark.parametrize("config, arch", _COHERE_FILES.values(), ids=_COHERE_FILES.keys())
def test_a_cohere_file_is_its_model_s_directory(tmp_path, config, arch):
    """A ``cohere2`` or ``command-r`` file and the source model's own directory are one model: the
    same config (llama.cpp's period of 4 without a pattern in the file: three sliding layers that
    rotate, a full one that does not, Cohere2Config's default), tensors (q/k rows as written, the
    LayerNorms' weights, Command R+'s biases and q/k norms' weight rows) and logits (the scale 0.375
    or 0.25 float32 holds)."""
    g, _, _ = _file_is_its_directory(tmp_path, config, arch)
    assert g.config.layer_norm and g.config.parallel_mlp and g.config.rope_interleaved
    assert g.config.logits_scaling == 1 / config["logit_scale"]
    if arch == "cohere2":
        assert g.config.layer_types == ("sliding_attention",) * 3 + ("full_attention",)
        assert g.config.rope_layers == (True, True, True, False) and g.config.sliding_window == 3
    else:
        plus = config["use_qk_norm"]
        assert g.config.attention_bias == plus and g.config.qk_norm == plus and g.config.rope_layers is None
        if plus:
            q_norm = g.state_dict()["model.layers.0.self_attn.q_norm.weight"]
            assert g.config.qk_norm_scope == "each_head" and q_norm.shape == (4, 64)


def test_what_llama_cpp_s_cohere_files_say():
    """cohere2: the window (required), the layers of ``attention.sliding_window_pattern`` (absent:
    llama.cpp's period 4; a period, 0 every layer sliding; one flag per layer), ``logit_scale``
    (required, > 0), no RoPE scaling, a tied head; command-r: the same scale, scaling and head;
    each refusal naming its key or tensor."""
    from npattn.models.configs import GGUF_FAMILIES

    S, F = "sliding_attention", "full_attention"
    derive = GGUF_FAMILIES["cohere2"].derive
    meta = {"logit_scale": 0.25, "attention.sliding_window": 4096, "rope.scaling.type": "none"}
    c = dict(num_hidden_layers=8, tie_word_embeddings=True)
    derive(c, meta)
    assert c == dict(
        num_hidden_layers=8,
        tie_word_embeddings=True,
        logit_scale=0.25,
        sliding_window=4096,
        layer_types=[S, S, S, F] * 2,
    )
    for pattern, want in ((2, [S, F] * 2), (0, [S] * 4), ([False, True, True, False], [F, S, S, F])):
        c = dict(num_hidden_layers=4, tie_word_embeddings=True)
        derive(c, dict(meta, **{"attention.sliding_window_pattern": pattern}))
        assert c["layer_types"] == want
    for changes, match in (
        ({"logit_scale": None}, r"'cohere2.logit_scale' None: expected a number > 0"),
        ({"logit_scale": 0.0}, r"'cohere2.logit_scale' 0.0"),
        ({"logit_scale": True}, r"'cohere2.logit_scale' True"),
        ({"rope.scaling.type": "linear"}, r"'cohere2.rope.scaling.type' 'linear'"),
        ({"attention.sliding_window": None}, r"'cohere2.attention.sliding_window' None: expected an integer >= 1"),
        ({"attention.sliding_window": 0}, r"'cohere2.attention.sliding_window' 0"),
        ({"attention.sliding_window_pattern": [True] * 3}, r"'cohere2.attention.sliding_window_pattern'.*4 booleans"),
        ({"attention.sliding_window_pattern": 1.5}, r"'cohere2.attention.sliding_window_pattern' 1.5"),
    ):
        with pytest.raises(ValueError, match=match):
            derive(dict(num_hidden_layers=4, tie_word_embeddings=True), {**meta, **changes})
    with pytest.raises(ValueError, match=r"tensor 'output.weight': llama.cpp's cohere2 has no output tensor"):
        derive(dict(num_hidden_layers=4, tie_word_embeddings=False), meta)
    derive = GGUF_FAMILIES["command-r"].derive
    c = dict(num_hidden_layers=2, tie_word_embeddings=True, use_qk_norm=True)
    derive(c, {"logit_scale": 0.0625})
    assert c == dict(num_hidden_layers=2, tie_word_embeddings=True, use_qk_norm=True, logit_scale=0.0625)
    with pytest.raises(ValueError, match=r"'command-r.logit_scale' -1"):
        derive(dict(num_hidden_layers=2, tie_word_embeddings=True), {"logit_scale": -1})
    with pytest.raises(ValueError, match=r"tensor 'output.weight': llama.cpp's command-r"):
        derive(dict(num_hidden_layers=2, tie_word_embeddings=False), {"logit_scale": 0.0625})


def test_cohere_files_refused_by_name(tmp_path, monkeypatch):
    """A file the converter writes from a checkpoint npattn does not read is refused naming the
    file and the key: a Command R7B whose ``rotary_pct`` is below 1 (``rope.dimension_count`` below
    the heads' width; Cohere2Attention rotates whole heads)."""
    half = gguf.GGUFWriter.add_rope_dimension_count
    monkeypatch.setattr(gguf.GGUFWriter, "add_rope_dimension_count", lambda self, n: half(self, n // 2))
    _write(tmp_path / "half.gguf", COHERE2, _state(COHERE2), Q.F32, "cohere2")
    with pytest.raises(ValueError, match=r"half.gguf: metadata 'cohere2.rope.dimension_count' is 32"):
        CausalLM.from_gguf(tmp_path / "half.gguf")


# -- Hunyuan dense (llama.cpp's hunyuan-dense) -------------------------------------------------------
def test_a_hunyuan_dense_file_is_its_directory_with_the_file_s_base(tmp_path):
    """A float32 hunyuan-dense file and the model's own directory (NTK-alpha RoPE, alpha 1000): the
    same tensors bit for bit, the q/k rows as written (llama.cpp rotates Hunyuan's halves), the
    same config but the RoPE: the file's is the default RoPE of the float32 NTK-alpha base the
    converter writes, so its logits are those of the directory's model with that base, and within
    that rounding of the directory's own (an epsilon float32 holds exactly: the file's is float32)."""
    config = dict(HUNYUAN, rms_norm_eps=2.0**-20)
    src = _model(config)
    _write(tmp_path / "m.gguf", config, src.state_dict(), Q.F32, "hunyuan-dense")
    src.save_pretrained(tmp_path / "dir")
    g, d = CausalLM.from_gguf(tmp_path / "m.gguf"), CausalLM.from_pretrained(tmp_path / "dir")
    assert d.config.rope == {"default": {"rope_type": "ntk_alpha", "alpha": 1000.0, "rope_theta": 10000.0}}
    base = 10000.0 * 1000.0 ** (64 / 62)
    assert g.config.rope == {"default": {"rope_type": "default", "rope_theta": float(np.float32(base))}}
    assert g.config.qk_norm_after_rope and g.config.attention_bias
    meta = dict(hf={}, bos_token_id=None, eos_token_id=None, max_position_embeddings=None, pad_token_id=None)
    assert g.config.replace(rope={}, **meta) == d.config.replace(rope={}, **meta)
    assert set(g.state_dict()) == set(d.state_dict())
    for k, v in d.state_dict().items():
        np.testing.assert_array_equal(g.state_dict()[k], v, err_msg=k)
    ids = np.random.default_rng(1).integers(0, HUNYUAN["vocab_size"], (2, 6))
    same_base = CausalLM.from_hf(d.state_dict(), _file_config(config))
    np.testing.assert_array_equal(_logits(g, ids), _logits(same_base, ids))
    theirs = _logits(d, ids)
    assert np.abs(_logits(g, ids) - theirs).max() <= 1e-4 * np.abs(theirs).max()


def test_what_llama_cpp_s_hunyuan_dense_files_say_of_their_rope():
    """The converter writes no scaling type (none) and factor 1 beside the NTK-alpha base; another
    type or factor is refused by name."""
    from npattn.models.configs import GGUF_FAMILIES

    derive = GGUF_FAMILIES["hunyuan-dense"].derive
    derive({}, {"rope.scaling.type": "none", "rope.scaling.factor": 1.0})
    derive({}, {})
    with pytest.raises(ValueError, match=r"metadata 'hunyuan-dense.rope.scaling.type' 'yarn' is not supported"):
        derive({}, {"rope.scaling.type": "yarn"})
    with pytest.raises(ValueError, match=r"metadata 'hunyuan-dense.rope.scaling.factor' 4.0 is not supported"):
        derive({}, {"rope.scaling.factor": 4.0})


@pytest.mark.parametrize("config", [OLMO, OLMO_CLIP], ids=["olmo", "olmo-clip"])
def test_olmo_file_is_its_directory(tmp_path, config):
    """An olmo file (q/k permuted, no norm tensor) and the source model's own directory
    (save_pretrained, read back by from_pretrained) are one model: the same config (LayerNorms
    without weight or bias at eps 1e-5; attention.clamp_kqv the directory's clip_qkv, or none),
    tensors bit for bit, the same logits; with the clamp, some of q, k and v held at a bound in
    every layer."""
    g, ids, _ = _file_is_its_directory(tmp_path, config, "olmo")
    assert g.config.layer_norm and not g.config.layer_norm_affine and g.config.rms_norm_eps == 1e-5
    assert not [n for n in g.state_dict() if "norm" in n]
    assert g.config.qkv_clip == config.get("clip_qkv")
    if g.config.qkv_clip is not None:
        g(ids)
        for layer in g.model.layers:
            pos = layer.self_attn.pop_saved().position
            held = [1.0 - float(c.inside.mean()) for c in (pos.q_clip, pos.k_clip, pos.v_clip)]
            assert all(0.1 < f < 0.9 for f in held), held
        g.clear_saved()


def test_olmo_metadata_and_biases_as_llama_cpp_reads_them(tmp_path):
    """llama.cpp's olmo: the LayerNorms' epsilon is the converter's 1e-5 (another refused by name:
    transformers' OlmoLayerNorm has no other); a file with q/k biases refused (the converter
    permutes the weights' rows, not the biases'); a clamp_kqv (OLMo-7B-0424's clip_qkv) read as
    the attention's clamp, a negative one refused by the config's name."""
    from npattn.models.configs import GGUF_FAMILIES

    derive = GGUF_FAMILIES["olmo"].derive
    c = dict(model_type="olmo", layer_norm_eps=float(np.float32(1e-5)), attention_bias=False)
    derive(c, {})
    assert c == dict(model_type="olmo", attention_bias=False)
    with pytest.raises(ValueError, match=r"'olmo.attention.layer_norm_epsilon' = 1e-06: OLMo's LayerNorms"):
        derive(dict(model_type="olmo", layer_norm_eps=1e-6), {})
    with pytest.raises(ValueError, match=r"tensor 'blk.0.attn_q.bias' in an olmo file: the converter permutes"):
        derive(dict(model_type="olmo", layer_norm_eps=1e-5, attention_bias=True), {})
    biased = dict(OLMO, attention_bias=True)
    _write(tmp_path / "b.gguf", biased, _model(biased).state_dict(), Q.F32, "olmo")
    with pytest.raises(ValueError, match=r"b.gguf: tensor 'blk.0.attn_q.bias' in an olmo file"):
        CausalLM.from_gguf(tmp_path / "b.gguf")
    clipped = dict(OLMO, clip_qkv=8.0)
    _write(tmp_path / "c.gguf", clipped, _state(OLMO), Q.F32, "olmo")
    assert CausalLM.from_gguf(tmp_path / "c.gguf").config.qkv_clip == 8.0
    _write(tmp_path / "n.gguf", dict(OLMO, clip_qkv=-8.0), _state(OLMO), Q.F32, "olmo")
    with pytest.raises(ValueError, match=r"config\['clip_qkv'\]: expected a finite number > 0, got -8.0"):
        CausalLM.from_gguf(tmp_path / "n.gguf")


def test_a_gptneox_file_is_its_model_s_directory(tmp_path):
    """A Pythia-like file (parallel residual) and a sequential one are their directories' models:
    the same config, tensors and logits (the query_key_value rows: [q; k; v] in the file, per head
    in the directory)."""
    for sub in ("parallel", "sequential"):
        (tmp_path / sub).mkdir()
    _file_is_its_directory(tmp_path / "parallel", GPTNEOX, "gptneox")
    g, _, _ = _file_is_its_directory(tmp_path / "sequential", dict(GPTNEOX, use_parallel_residual=False), "gptneox")
    assert not g.config.parallel_residual


def _check_rotated_share_and_base(tmp_path, monkeypatch, config, sd, arch):
    """A partial-rotary file as its converter writes it (``rope.dimension_count`` 16 of 64, no
    ``rope.freq_base``) is read with that share and llama.cpp's base 10000; with a
    ``rope.freq_base`` written beside the count, with that base."""
    _write(tmp_path / "m.gguf", config, sd, Q.F32, arch)
    m = CausalLM.from_gguf(tmp_path / "m.gguf")
    assert m.config.rope["default"]["rope_theta"] == 10000.0
    assert int(64 * m.config.rope["default"]["partial_rotary_factor"]) == 16

    def with_base(self, value):
        self.add_uint32(f"{arch}.rope.dimension_count", value)
        self.add_float32(f"{arch}.rope.freq_base", 500.0)

    with monkeypatch.context() as mp:
        mp.setattr(gguf.GGUFWriter, "add_rope_dimension_count", with_base)
        _write(tmp_path / "base.gguf", config, sd, Q.F32, arch)
    assert CausalLM.from_gguf(tmp_path / "base.gguf").config.rope["default"]["rope_theta"] == 500.0


def test_gptneox_metadata_as_llama_cpp_reads_it(tmp_path, monkeypatch):
    """``rope.dimension_count`` is the rotated share, ``rope.freq_base`` (which GPTNeoXModel does
    not write) the base where present, llama.cpp's 10000 where absent; no
    ``use_parallel_residual`` (llama.cpp's loader requires it), an odd rotated count, and
    query_key_value rows that are not the heads' are refused by name."""
    sd = _model(GPTNEOX).state_dict()
    _check_rotated_share_and_base(tmp_path, monkeypatch, GPTNEOX, sd, "gptneox")
    with monkeypatch.context() as mp:
        mp.setattr(gguf.GGUFWriter, "add_parallel_residual", lambda self, value: None)
        _write(tmp_path / "none.gguf", GPTNEOX, sd, Q.F32, "gptneox")
    with pytest.raises(ValueError, match="'gptneox.use_parallel_residual' None: expected true or false"):
        CausalLM.from_gguf(tmp_path / "none.gguf")
    with monkeypatch.context() as mp:
        mp.setattr(
            gguf.GGUFWriter,
            "add_rope_dimension_count",
            lambda self, v: self.add_uint32("gptneox.rope.dimension_count", 15),
        )
        _write(tmp_path / "odd.gguf", GPTNEOX, sd, Q.F32, "gptneox")
    with pytest.raises(ValueError, match="'gptneox.rope.dimension_count' 15: expected an even number"):
        CausalLM.from_gguf(tmp_path / "odd.gguf")
    converted = _gptneox_converted
    with monkeypatch.context() as mp:  # a fused bias four rows short
        mp.setattr(
            sys.modules[__name__],
            "_gptneox_converted",
            lambda c, heads: {
                k: v[:-4] if k.endswith("qkv.bias") or "key_value.bias" in k else v
                for k, v in converted(c, heads).items()
            },
        )
        _write(tmp_path / "short.gguf", GPTNEOX, sd, Q.F32, "gptneox")
    with pytest.raises(ValueError, match="tensor 'blk.0.attn_qkv.bias' has shape"):
        CausalLM.from_gguf(tmp_path / "short.gguf")


def test_a_phi2_file_is_its_model_s_directory(tmp_path):
    """A Phi-2-like file is its directory's model: the same config, tensors (the head's bias
    ``output.bias``) and logits; so is one of a quarter of each head rotating."""
    g, _, _ = _file_is_its_directory(tmp_path, PHI2, "phi2")
    assert np.abs(g.state_dict()["lm_head.bias"]).max() > 0
    (tmp_path / "quarter").mkdir()  # a quarter of each head rotating: rope.dimension_count, not PhiConfig's half
    g, _, _ = _file_is_its_directory(tmp_path / "quarter", dict(PHI2, partial_rotary_factor=0.25), "phi2")
    assert int(64 * g.config.rope["default"]["partial_rotary_factor"]) == 16


def test_phi2_files_llama_cpp_cannot_read_are_refused_by_name(tmp_path, monkeypatch):
    """``rope.dimension_count`` is the rotated share; a file without the head (a tied one: its
    bias beside the table is not PhiForCausalLM's), without the head's bias, or of a model with
    fewer key/value heads than heads (the converter writes ``head_count_kv`` = ``head_count``) is
    refused by name."""
    sd = _model(PHI2).state_dict()
    _write(tmp_path / "m.gguf", PHI2, sd, Q.F32, "phi2")
    m = CausalLM.from_gguf(tmp_path / "m.gguf")
    assert int(64 * m.config.rope["default"]["partial_rotary_factor"]) == 32
    assert m.config.rope["default"]["rope_theta"] == 10000.0
    _write(tmp_path / "tied.gguf", PHI2, {k: v for k, v in sd.items() if k != "lm_head.weight"}, Q.F32, "phi2")
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        CausalLM.from_gguf(tmp_path / "tied.gguf")
    _write(tmp_path / "nobias.gguf", PHI2, {k: v for k, v in sd.items() if k != "lm_head.bias"}, Q.F32, "phi2")
    with pytest.raises(ValueError, match="output.bias"):
        CausalLM.from_gguf(tmp_path / "nobias.gguf")
    gqa = dict(PHI2, num_key_value_heads=2)
    _write(tmp_path / "gqa.gguf", gqa, _model(gqa).state_dict(), Q.F32, "phi2")
    with pytest.raises(ValueError, match="k_proj.weight'\\]: expected shape \\(256, 256\\), got \\(128, 256\\)"):
        CausalLM.from_gguf(tmp_path / "gqa.gguf")


# StableLM-3B-4E1T: its config.json has no use_parallel_residual (StableLmConfig's False: sequential),
# for which the converter writes true; no biases, no q/k norms
STABLELM_3B = {k: v for k, v in STABLELM2.items() if k != "use_parallel_residual"} | {"use_qkv_bias": False}


@pytest.mark.parametrize(
    "config", [STABLELM2, STABLELM2_12B, STABLELM_3B], ids=["stablelm2-1.6b", "stablelm2-12b", "stablelm-3b-4e1t"]
)
def test_a_stablelm_file_is_its_model_s_directory(tmp_path, config):
    """A StableLM 2 1.6B-like file (q/k/v biases, sequential), a 12B-like one (per-head q/k
    LayerNorms, parallel: no ffn_norm) and a StableLM-3B-4E1T-like one (whose file says
    use_parallel_residual true over layers that keep their ffn_norm, which llama.cpp runs one after
    the other) are their directories' models: the same config, tensors and logits."""
    g, _, _ = _file_is_its_directory(tmp_path, config, "stablelm")
    assert g.config.parallel_mlp == config.get("use_parallel_residual", False)
    assert g.config.qk_norm == config["qk_layernorm"]
    assert g.config.attention_bias == config["use_qkv_bias"]
    head = config["hidden_size"] // config["num_attention_heads"]
    assert int(head * g.config.rope["default"]["partial_rotary_factor"]) == int(head * config["partial_rotary_factor"])
    if config["qk_layernorm"]:  # one LayerNorm weight row a head: (heads, head_dim), not its transpose
        assert g.state_dict()["model.layers.0.self_attn.q_norm.weight"].shape == (8, 32)
        assert g.state_dict()["model.layers.0.self_attn.k_norm.weight"].shape == (2, 32)


def test_stablelm_files_as_llama_cpp_reads_them(tmp_path, monkeypatch):
    """``rope.dimension_count`` is the rotated share and ``rope.freq_base`` (which StableLMModel does
    not write) the base where present, llama.cpp's 10000 where absent; the tensors say the rest, as
    llama.cpp's loader reads them (not the file's use_parallel_residual): a file saying false
    without ffn_norm is parallel.  A layer missing one of q/k/v's biases, an odd rotated count and
    per-head norms stored (head_dim, heads) are refused by name."""
    sd = _state(STABLELM2)
    _check_rotated_share_and_base(tmp_path, monkeypatch, STABLELM2, sd, "stablelm")
    sd12 = _state(STABLELM2_12B)
    with monkeypatch.context() as mp:  # the metadata says sequential; no ffn_norm: llama.cpp's parallel residual
        mp.setattr(
            gguf.GGUFWriter,
            "add_parallel_residual",
            lambda self, value: self.add_bool("stablelm.use_parallel_residual", False),
        )
        _write(tmp_path / "says.gguf", STABLELM2_12B, sd12, Q.F32, "stablelm")
    assert CausalLM.from_gguf(tmp_path / "says.gguf").config.parallel_mlp
    with monkeypatch.context() as mp:
        mp.setattr(
            gguf.GGUFWriter,
            "add_rope_dimension_count",
            lambda self, v: self.add_uint32("stablelm.rope.dimension_count", 15),
        )
        _write(tmp_path / "odd.gguf", STABLELM2, sd, Q.F32, "stablelm")
    with pytest.raises(ValueError, match="'stablelm.rope.dimension_count' 15: expected an even number"):
        CausalLM.from_gguf(tmp_path / "odd.gguf")
    no_k_bias = {k: v for k, v in sd.items() if k != "model.layers.1.self_attn.k_proj.bias"}
    _write(tmp_path / "bias.gguf", STABLELM2, no_k_bias, Q.F32, "stablelm")
    with pytest.raises(ValueError, match=r"bias.gguf: no tensor 'blk.1.attn_k.bias'"):
        CausalLM.from_gguf(tmp_path / "bias.gguf")
    converted = _stablelm_converted
    with monkeypatch.context() as mp:  # the stacked norms transposed: (head_dim, heads)
        mp.setattr(
            sys.modules[__name__],
            "_stablelm_converted",
            lambda c: {
                k: np.ascontiguousarray(v.T) if "layernorm." in k and v.ndim == 2 else v
                for k, v in converted(c).items()
            },
        )
        _write(tmp_path / "t.gguf", STABLELM2_12B, sd12, Q.F32, "stablelm")
    with pytest.raises(ValueError, match=r"q_norm.weight'\]: expected shape \(8, 32\), got \(32, 8\)"):
        CausalLM.from_gguf(tmp_path / "t.gguf")


def test_a_gpt2_file_is_its_model_s_directory(tmp_path):
    """A GPT-2 file (learned positions position_embd, the fused attn_qkv with its bias, the Conv1D
    weights the converter transposed back) is its directory's model: the same config, tensors and
    logits; tied (the converter writes no output.weight) and untied."""
    g, _, _ = _file_is_its_directory(tmp_path, GPT2, "gpt2")
    assert g.config.tie_word_embeddings and g.config.position_embedding == "wpe" and g.config.hidden_act == "gelu_new"
    assert g.state_dict()["model.wpe.weight"].shape == (128, 256) and g.config.intermediate_size == 1024
    (tmp_path / "untied").mkdir()
    g, _, _ = _file_is_its_directory(tmp_path / "untied", dict(GPT2, tie_word_embeddings=False), "gpt2")
    assert not g.config.tie_word_embeddings


def test_gpt2_files_llama_cpp_cannot_read_are_refused_by_name(tmp_path, monkeypatch):
    """No ``context_length`` (the position table's rows), a ``head_count_kv`` or ``key_length``
    other than GPT-2's heads, and a ``feed_forward_length`` other than the tensors' are refused by
    name; a file of an older converter with ``output.weight`` a copy of ``token_embd`` is the
    same network, untied."""
    sd = _state(GPT2)
    _write(tmp_path / "m.gguf", GPT2, sd, Q.F32, "gpt2")
    m = CausalLM.from_gguf(tmp_path / "m.gguf")
    ids = np.random.default_rng(2).integers(0, 41, (2, 9))
    copied = {**sd, "lm_head.weight": sd["model.wte.weight"]}
    _write(tmp_path / "copy.gguf", dict(GPT2, tie_word_embeddings=False), copied, Q.F32, "gpt2")
    old = CausalLM.from_gguf(tmp_path / "copy.gguf")
    assert not old.config.tie_word_embeddings
    np.testing.assert_array_equal(_logits(old, ids), _logits(m, ids))
    cases = [
        (dict(context=False), "gpt2.context_length' missing"),
        (dict(head_count_kv=2), "gpt2.attention.head_count_kv': expected 4"),
        (dict(key_length=32), "gpt2.attention.key_length': expected embedding_length / head_count"),
        (dict(ffn=512), "model.layers.0.mlp.c_fc.weight'\\]: expected shape \\(512, 256\\)"),
    ]
    real = _gpt2_metadata
    for i, (changes, message) in enumerate(cases):
        monkeypatch.setattr(sys.modules[__name__], "_gpt2_metadata", functools.partial(real, **changes))
        _write(tmp_path / f"{i}.gguf", GPT2, sd, Q.F32, "gpt2")
        with pytest.raises(ValueError, match=message):
            CausalLM.from_gguf(tmp_path / f"{i}.gguf")


def test_a_starcoder2_file_is_its_model_s_directory(tmp_path):
    """A StarCoder2-like file is its directory's model: the same config, tensors (every bias, the
    LayerNorms') and logits; tied (no output.weight) and untied, and a model without use_bias's
    biases (its LayerNorms keep theirs)."""
    g, _, _ = _file_is_its_directory(tmp_path, STARCODER2, "starcoder2")
    assert g.config.tie_word_embeddings and g.config.attention_bias and g.config.mlp_bias
    assert np.abs(g.state_dict()["model.layers.1.mlp.c_fc.bias"]).max() > 0
    for name, change in (("untied", {"tie_word_embeddings": False}), ("nobias", {"use_bias": False})):
        (tmp_path / name).mkdir()
        g, _, _ = _file_is_its_directory(tmp_path / name, dict(STARCODER2, **change), "starcoder2")
    assert not g.config.attention_bias and not g.config.mlp_bias and "model.norm.bias" in g.state_dict()


def test_starcoder2_files_as_llama_cpp_reads_them(tmp_path, monkeypatch):
    """The converter writes no window: a model with ``sliding_window`` 4 becomes a file llama.cpp
    reads as full attention (its logits past the window are those of the same weights without
    the window), and so does a file with ``starcoder2.attention.sliding_window`` 4, a key
    llama.cpp's loader does not read; a file whose blocks have the attention's biases but not the
    MLP's (or the MLP's but not the attention's) is refused by name."""
    windowed = dict(STARCODER2, sliding_window=4)
    sd = _model(windowed).state_dict()
    _write(tmp_path / "m.gguf", windowed, sd, Q.F32, "starcoder2")
    real = _starcoder2_metadata
    monkeypatch.setattr(
        sys.modules[__name__], "_starcoder2_metadata", lambda w, config: (real(w, config), w.add_sliding_window(4))
    )
    _write(tmp_path / "w.gguf", windowed, sd, Q.F32, "starcoder2")
    ids = np.random.default_rng(1).integers(0, windowed["vocab_size"], (1, 7))
    for name in ("m.gguf", "w.gguf"):
        g = CausalLM.from_gguf(tmp_path / name)
        assert g.config.sliding_window is None and set(g.config.layer_types) == {"full_attention"}
        np.testing.assert_array_equal(_logits(g, ids), _logits(CausalLM.from_hf(sd, STARCODER2), ids))
        assert not np.allclose(_logits(g, ids)[0, 6], _logits(CausalLM.from_hf(sd, windowed), ids)[0, 6])
    monkeypatch.undo()
    for lack, have, bad in (
        ("mlp.c_fc.bias", "attn_q.bias", "ffn_up.bias"),
        ("q_proj.bias", "ffn_up.bias", "attn_q.bias"),
    ):
        _write(tmp_path / "x.gguf", STARCODER2, {k: v for k, v in sd.items() if lack not in k}, Q.F32, "starcoder2")
        with pytest.raises(ValueError, match=rf"'blk.0.{have}' without 'blk.0.{bad}'.*use_bias"):
            CausalLM.from_gguf(tmp_path / "x.gguf")

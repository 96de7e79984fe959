"""The sparse-MoE families people run on CPUs: Mixtral (``mixtral``), Qwen1.5-MoE / Qwen2-MoE
(``qwen2_moe``), OLMoE (``olmoe``).  Their released config.json
keys read, short dicts read as transformers reads them, the refusals by name, and against
transformers' own models in float64 (eager attention): logits to 1e-9 and every gradient to 1e-8
under a random upstream gradient, with every router's top-k choice checked to sit far from a tie
(the k-th and (k+1)-th probabilities at least 1e-6 apart: float64's rounding cannot swap them),
cached decoding equal to transformers' full pass, and a directory written by transformers (its
per-expert names) loaded and written back.  The family-wide suites (``TINY_CONFIGS``) run the tiny
entries through backward, JVP, backward-JVP, padded batches, ``save_pretrained`` and bfloat16."""

from __future__ import annotations

import numpy as np
import pytest

from npattn.models import CausalLM, config_from_hf
from npattn.models.configs import moe_config
from npattn.models.tiny import tiny_config
from npattn.nn.moe import TopKRouter

_SIZES = dict(vocab_size=61, hidden_size=32, num_attention_heads=4, num_key_value_heads=2)

# Mixtral-8x7B-v0.1's config.json, its keys as released (sizes shrunk)
_MIXTRAL_RELEASED = dict(
    architectures=["MixtralForCausalLM"],
    attention_dropout=0.0,
    bos_token_id=1,
    eos_token_id=2,
    hidden_act="silu",
    hidden_size=32,
    initializer_range=0.02,
    intermediate_size=24,
    max_position_embeddings=32768,
    model_type="mixtral",
    num_attention_heads=4,
    num_experts_per_tok=2,
    num_hidden_layers=2,
    num_key_value_heads=2,
    num_local_experts=8,
    output_router_logits=False,
    rms_norm_eps=1e-05,
    rope_theta=1000000.0,
    router_aux_loss_coef=0.02,
    sliding_window=None,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
    transformers_version="4.36.0.dev0",
    use_cache=True,
    vocab_size=61,
)

# Qwen1.5-MoE-A2.7B's config.json, its keys as released (sizes shrunk; 60 experts, top 4)
_QWEN2_MOE_RELEASED = dict(
    architectures=["Qwen2MoeForCausalLM"],
    attention_dropout=0.0,
    bos_token_id=151643,
    eos_token_id=151643,
    hidden_act="silu",
    hidden_size=32,
    initializer_range=0.02,
    intermediate_size=40,
    max_position_embeddings=8192,
    max_window_layers=21,
    model_type="qwen2_moe",
    num_attention_heads=4,
    num_hidden_layers=2,
    num_key_value_heads=4,
    rms_norm_eps=1e-06,
    rope_theta=1000000.0,
    sliding_window=32768,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
    transformers_version="4.40.0.dev0",
    use_cache=True,
    use_sliding_window=False,
    vocab_size=61,
    decoder_sparse_step=1,
    moe_intermediate_size=12,
    shared_expert_intermediate_size=48,
    num_experts_per_tok=4,
    num_experts=60,
    norm_topk_prob=False,
    output_router_logits=False,
    router_aux_loss_coef=0.001,
)

# OLMoE-1B-7B-0924's config.json, its keys as released (sizes shrunk; 64 experts, top 8)
_OLMOE_RELEASED = dict(
    architectures=["OlmoeForCausalLM"],
    attention_bias=False,
    attention_dropout=0.0,
    clip_qkv=None,
    eos_token_id=50,
    hidden_act="silu",
    hidden_size=32,
    initializer_range=0.02,
    intermediate_size=12,
    max_position_embeddings=4096,
    model_type="olmoe",
    norm_topk_prob=False,
    num_attention_heads=4,
    num_experts=64,
    num_experts_per_tok=8,
    num_hidden_layers=2,
    num_key_value_heads=4,
    output_router_logits=False,
    pad_token_id=1,
    rms_norm_eps=1e-05,
    rope_scaling=None,
    rope_theta=10000.0,
    router_aux_loss_coef=0.01,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
    transformers_version="4.43.0.dev0",
    use_cache=True,
    vocab_size=61,
)


def test_the_released_configs_read():
    cfg = config_from_hf(_MIXTRAL_RELEASED)
    assert cfg.mlp_types == ("moe",) * 2
    assert cfg.moe.num_experts == 8 and cfg.moe.top_k == 2 and cfg.moe.norm_topk_prob
    assert cfg.layer_types == ("full_attention",) * 2 and cfg.rope["default"]["rope_theta"] == 1e6
    assert cfg.rms_norm_eps == 1e-5 and not cfg.attention_bias
    cfg = config_from_hf(_QWEN2_MOE_RELEASED)
    assert cfg.mlp_types == ("moe",) * 2 and cfg.layer_types == ("full_attention",) * 2
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.norm_topk_prob) == (60, 4, False)
    assert cfg.moe.shared_intermediate_size == 48 and cfg.moe.shared_expert_gate
    assert cfg.attention_bias and cfg.attention_out_bias is False and cfg.layout.per_expert
    cfg = config_from_hf(_OLMOE_RELEASED)
    assert cfg.mlp_types == ("moe",) * 2 and (cfg.moe.num_experts, cfg.moe.top_k) == (64, 8)
    assert not cfg.moe.norm_topk_prob and cfg.moe.intermediate_size == 12 and cfg.moe.shared_intermediate_size is None
    assert cfg.qk_norm and cfg.qk_norm_scope == "all_heads" and cfg.pre_norm and not cfg.sandwich_norm


def test_olmoe_reads_its_experts_under_either_name_and_defaults():
    assert config_from_hf(dict(tiny_config("olmoe"), num_local_experts=4)).moe.num_experts == 4
    bare = {k: v for k, v in tiny_config("olmoe").items() if k not in ("num_experts", "num_experts_per_tok")}
    moe = config_from_hf(bare).moe
    assert (moe.num_experts, moe.top_k, moe.norm_topk_prob) == (64, 8, False)  # OlmoeConfig's


@pytest.mark.parametrize("name, width", [("olmoe", "intermediate_size"), ("qwen2_moe", "moe_intermediate_size")])
def test_the_moe_block_alone_leaves_the_top_k_unnormalised_by_default(name, width):
    """SparseMoeBlock.from_hf_config's reader (moe_config) on a dict without norm_topk_prob:
    transformers' default, false."""
    d = {"model_type": name, "hidden_size": 8, "num_experts": 4, "num_experts_per_tok": 2, width: 4}
    assert moe_config(dict(d, shared_expert_intermediate_size=4)).norm_topk_prob is False


def test_mixtral_reads_its_window_experts_and_defaults():
    cfg = config_from_hf(tiny_config("mixtral"))
    assert cfg.layer_types == ("sliding_attention",) * 2 and cfg.sliding_window == 3
    assert cfg.moe.intermediate_size == 24 and cfg.moe.shared_intermediate_size is None
    assert cfg.layout.expert_projs == ("w1", "w3", "w2")
    short = config_from_hf({k: v for k, v in tiny_config("mixtral").items() if k != "rope_theta"})
    assert short.rope["default"]["rope_theta"] == 1e6  # MixtralConfig's default_theta
    assert config_from_hf(dict(tiny_config("mixtral"), num_experts=4)).moe.num_experts == 4


def test_qwen2_moe_reads_its_windows_dense_layers_and_biases():
    cfg = config_from_hf(tiny_config("qwen2_moe"))
    assert cfg.layer_types == ("sliding_attention", "full_attention", "full_attention") and cfg.sliding_window == 3
    assert cfg.mlp_types == ("moe", "dense", "moe") and cfg.intermediate_size == 24
    step = config_from_hf(tiny_config("qwen2_moe", num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3]))
    assert step.mlp_types == ("dense", "moe", "dense", "dense")
    # Qwen2MoeConfig's layer_types: even layers below max_window_layers, with use_sliding_window only
    wide = config_from_hf(tiny_config("qwen2_moe", num_hidden_layers=5, max_window_layers=4, mlp_only_layers=[]))
    assert wide.layer_types == ("sliding_attention", "full_attention") * 2 + ("full_attention",)
    off = config_from_hf(tiny_config("qwen2_moe", use_sliding_window=False, sliding_window=0))  # as to_dict writes
    assert set(off.layer_types) == {"full_attention"} and off.sliding_window is None
    dense = config_from_hf(tiny_config("qwen2_moe", num_experts=0))
    assert dense.mlp_types == ("dense",) * 3 and dense.moe is None
    plain = config_from_hf(tiny_config("qwen2_moe", qkv_bias=False))
    assert not plain.attention_bias and not plain.attention_config("full_attention").out_bias


# LFM2-8B-A1B's config.json keys (its 24 layers: 6 attention, 18 short convolutions; the older
# tie_embedding beside them); LFM2.5-8B-A1B's say head_dim and rope_parameters instead
_LFM2_8B_A1B = dict(
    architectures=["Lfm2MoeForCausalLM"],
    model_type="lfm2_moe",
    vocab_size=65536,
    hidden_size=2048,
    intermediate_size=7168,
    moe_intermediate_size=1792,
    num_hidden_layers=24,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=128000,
    norm_eps=1e-05,
    conv_bias=False,
    conv_L_cache=3,
    rope_theta=1000000.0,
    num_dense_layers=2,
    num_experts=32,
    num_experts_per_tok=4,
    norm_topk_prob=True,
    use_expert_bias=True,
    routed_scaling_factor=1.0,
    bos_token_id=1,
    eos_token_id=7,
    pad_token_id=0,
    tie_embedding=True,
    initializer_range=0.02,
    use_cache=True,
    dtype="bfloat16",
    transformers_version="4.57.0.dev0",
    layer_types=["conv", "conv", "full_attention", "conv", "conv", "conv"]
    + ["full_attention", "conv", "conv", "conv", "full_attention", "conv"]
    + ["conv", "conv", "full_attention", "conv", "conv", "conv"]
    + ["full_attention", "conv", "conv", "full_attention", "conv", "conv"],
)


def test_the_lfm2_8b_a1b_configs_read():
    cfg = config_from_hf(_LFM2_8B_A1B)
    assert cfg.layer_types.count("full_attention") == 6 and cfg.mlp_types == ("dense",) * 2 + ("moe",) * 22
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.intermediate_size) == (32, 4, 1792)
    assert cfg.intermediate_size == 7168 and cfg.tie_word_embeddings and cfg.head_dim == 64
    assert cfg.rope["default"]["rope_theta"] == 1e6 and cfg.rms_norm_eps == 1e-5
    v25 = {k: v for k, v in _LFM2_8B_A1B.items() if k not in ("rope_theta", "tie_embedding")}
    v25.update(head_dim=64, tie_word_embeddings=True, rope_parameters={"rope_theta": 5000000, "rope_type": "default"})
    cfg = config_from_hf(v25)
    assert cfg.rope["default"]["rope_theta"] == 5e6 and cfg.tie_word_embeddings and cfg.head_dim == 64


def test_lfm2_moe_reads_its_dense_layers_routing_and_names():
    cfg = config_from_hf(tiny_config("lfm2_moe"))
    assert cfg.layer_types == ("conv", "full_attention") and cfg.mlp_types == ("dense", "moe")
    assert cfg.intermediate_size == 24 and cfg.moe.intermediate_size == 8  # no LFM2 width adjustment
    moe = cfg.moe
    assert (moe.router, moe.num_experts, moe.top_k, moe.norm_topk_prob) == ("sigmoid", 4, 2, True)
    assert (moe.routed_scaling_factor, moe.norm_topk_eps, moe.correction_bias) == (1.5, 1e-6, True)
    assert cfg.tie_word_embeddings and cfg.final_norm_name == "embedding_norm" and cfg.qk_norm
    assert cfg.layout.per_expert and cfg.layout.expert_projs == ("w1", "w3", "w2")
    plain = config_from_hf(tiny_config("lfm2_moe", use_expert_bias=False, num_dense_layers=0, tie_embedding=False))
    assert plain.mlp_types == ("moe", "moe") and not plain.moe.correction_bias and not plain.tie_word_embeddings
    names = set(CausalLM(plain, rng=0).state_dict())
    assert "model.layers.0.feed_forward.gate.weight" in names and not any("expert_bias" in n for n in names)
    names = set(CausalLM(cfg, rng=0).state_dict())
    assert {"model.layers.1.feed_forward.expert_bias", "model.layers.0.feed_forward.w1.weight"} <= names
    dense = config_from_hf(tiny_config("lfm2_moe", num_dense_layers=2))
    assert dense.mlp_types == ("dense", "dense") and dense.moe is None
    attention = config_from_hf(tiny_config("lfm2_moe", layer_types=["full_attention"] * 2, conv_bias=True))
    assert attention.short_conv is None and set(attention.layer_types) == {"full_attention"}


@pytest.mark.parametrize(
    "name, bad, match",
    [
        ("olmoe", dict(clip_qkv=-8.0), r"config\['clip_qkv'\]: expected a finite number > 0, got -8.0"),
        ("olmoe", dict(clip_qkv="8"), r"config\['clip_qkv'\]: expected a finite number > 0"),
        ("olmoe", dict(head_dim=8), "'head_dim'"),
        ("olmoe", dict(num_local_experts=5), "num_experts and num_local_experts differ"),
        ("olmoe", dict(norm_topk_prob=1), "'norm_topk_prob'"),
        ("olmoe", dict(shared_expert_intermediate_size=8), "'shared_expert_intermediate_size'"),
        ("olmoe", dict(sliding_window=3), "'sliding_window'"),
        ("qwen2_moe", dict(attention_bias=True), "'attention_bias'"),
        ("qwen2_moe", dict(num_local_experts=4), "'num_local_experts'"),
        ("qwen2_moe", dict(shared_expert_intermediate_size=0), "'shared_expert_intermediate_size'"),
        ("qwen2_moe", dict(mlp_only_layers="1"), "'mlp_only_layers'"),
        ("qwen2_moe", dict(qkv_bias="true"), "'qkv_bias'"),
        (
            "qwen2_moe",
            dict(use_sliding_window=False, layer_types=["sliding_attention"] * 3),
            "'sliding_attention' with use_sliding_window false",
        ),
        ("qwen2_moe", dict(layer_types=["chunked_attention"] * 3), "'chunked_attention'"),
        ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise"),
        ("mixtral", dict(num_experts=5), "num_local_experts and num_experts differ"),
        ("mixtral", dict(attention_bias=True), "'attention_bias'"),
        ("mixtral", dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
        ("mixtral", dict(num_experts_per_tok=0), "'num_experts_per_tok'"),
        ("lfm2_moe", dict(layer_types=None), "needs the key 'layer_types'"),
        ("lfm2_moe", dict(layer_types=["conv", "sliding_attention"]), "'sliding_attention'"),
        ("lfm2_moe", dict(num_dense_layers=-1), "'num_dense_layers'"),
        ("lfm2_moe", dict(use_expert_bias=1), "'use_expert_bias'"),
        ("lfm2_moe", dict(norm_topk_prob="true"), "'norm_topk_prob'"),
        ("lfm2_moe", dict(routed_scaling_factor=0.0), "'routed_scaling_factor'"),
        ("lfm2_moe", dict(hidden_act="gelu"), "'hidden_act'"),  # Lfm2MoeExperts' SiLU is fixed
        ("lfm2_moe", dict(block_dim=16), "'block_dim'"),  # LFM2's own keys are not Lfm2MoeConfig's
        ("lfm2_moe", dict(tie_embedding="yes"), "'tie_embedding'"),
    ],
)
def test_refusals_name_the_key(name, bad, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf(tiny_config(name, **bad))


# -- against transformers ------------------------------------------------------------------------
from _hf64 import (  # noqa: E402
    build,
    check_cached_decoding,
    check_logits_and_grads,
    check_padded_batch,
    hf_logits,
    state_dict,
    transformers_or_none,
)
from _oracles import rel_err  # noqa: E402

T = transformers_or_none()
needs_transformers = pytest.mark.skipif(T is None, reason="transformers and torch (the oracle)")

# (config class, model class, fields): each family's options, windows shorter than the sequence
CASES = {
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(_SIZES, intermediate_size=12, num_hidden_layers=2, num_local_experts=6, num_experts_per_tok=2),
    ),
    "mixtral_window_wide_heads": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(
            _SIZES,
            intermediate_size=12,
            num_hidden_layers=2,
            head_dim=12,
            sliding_window=3,
            num_local_experts=4,
            num_experts_per_tok=3,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        ),
    ),
    # Qwen2-MoE: a shared expert of its own width, a dense layer by decoder_sparse_step, one by
    # mlp_only_layers, sliding layers below max_window_layers, the top k renormalised
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            _SIZES,
            intermediate_size=40,
            num_hidden_layers=4,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=12,
            shared_expert_intermediate_size=20,
            decoder_sparse_step=2,
            use_sliding_window=True,
            sliding_window=3,
            max_window_layers=3,
            norm_topk_prob=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
        ),
    ),
    "qwen2_moe_unnormalised_no_bias": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            _SIZES,
            intermediate_size=40,
            num_hidden_layers=3,
            num_experts=4,
            num_experts_per_tok=3,
            moe_intermediate_size=12,
            shared_expert_intermediate_size=8,
            mlp_only_layers=[0],
            qkv_bias=False,
            tie_word_embeddings=True,
        ),
    ),
    # OLMoE: the q/k norms over the whole projection with grouped keys, biases on the attention,
    # top 3 of 6 left unnormalised; and renormalised
    "olmoe": (
        "OlmoeConfig",
        "OlmoeForCausalLM",
        dict(
            _SIZES,
            intermediate_size=12,
            num_hidden_layers=2,
            num_experts=6,
            num_experts_per_tok=3,
            attention_bias=True,
            pad_token_id=1,
            eos_token_id=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
        ),
    ),
    "olmoe_renormalised_tied": (
        "OlmoeConfig",
        "OlmoeForCausalLM",
        dict(
            _SIZES,
            intermediate_size=12,
            num_hidden_layers=2,
            num_key_value_heads=4,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            tie_word_embeddings=True,
            pad_token_id=1,
            eos_token_id=2,
        ),
    ),
    # LFM2-MoE: a dense layer, then routed experts after a short convolution (biases) and after an
    # attention layer: sigmoid scores, the top 3 of 6 chosen through the expert bias, renormalised
    # (sum + 1e-6), times 1.5; untied
    "lfm2_moe": (
        "Lfm2MoeConfig",
        "Lfm2MoeForCausalLM",
        dict(
            _SIZES,
            intermediate_size=40,
            moe_intermediate_size=12,
            num_hidden_layers=3,
            layer_types=["full_attention", "conv", "full_attention"],
            num_dense_layers=1,
            num_experts=6,
            num_experts_per_tok=3,
            routed_scaling_factor=1.5,
            conv_L_cache=4,
            conv_bias=True,
            tie_word_embeddings=False,
            norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
        ),
    ),
    # LFM2-MoE without the expert bias (the top k of the scores themselves) nor the renormalisation
    "lfm2_moe_plain_routing": (
        "Lfm2MoeConfig",
        "Lfm2MoeForCausalLM",
        dict(
            _SIZES,
            intermediate_size=24,
            moe_intermediate_size=8,
            num_hidden_layers=2,
            num_key_value_heads=1,
            layer_types=["conv", "full_attention"],
            num_dense_layers=0,
            num_experts=5,
            num_experts_per_tok=2,
            use_expert_bias=False,
            norm_topk_prob=False,
            pad_token_id=0,
        ),
    ),
}


def _build(name):
    cfg_cls, model_cls, kwargs = CASES[name]
    return build(getattr(T, cfg_cls), getattr(T, model_cls), **kwargs)


def _ids(vocab, shape=(2, 9), seed=0):
    return np.random.default_rng(seed).integers(0, vocab, shape)


def routing_margin(m) -> float:
    """The smallest gap, over every router of ``m``'s last forward and every token, between the
    k-th and (k+1)-th largest softmax probability, or sigmoid score plus correction bias (the last
    chosen and the first refused expert)."""
    gaps = []
    for mod in m.modules():
        if isinstance(mod, TopKRouter):
            z = mod.last_logits.reshape(-1, mod.last_logits.shape[-1])
            if mod.variant == "sigmoid":  # LFM2-MoE: the sigmoid scores plus the expert bias choose
                p = 1.0 / (1.0 + np.exp(-z)) + getattr(mod, "e_score_correction_bias", 0.0)
            else:
                p = np.exp(z - z.max(-1, keepdims=True))
                p = p / p.sum(-1, keepdims=True)
            p = np.sort(p, axis=-1)[:, ::-1]
            gaps.append((p[:, mod.top_k - 1] - p[:, mod.top_k]).min())
    assert gaps, "no router ran"
    return min(gaps)


@needs_transformers
@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_and_every_gradient_match_transformers(name):
    hf, cfg = _build(name)
    m = CausalLM.from_hf(state_dict(hf), cfg)
    ids = _ids(cfg["vocab_size"])
    dlogits = np.random.default_rng(1).standard_normal(ids.shape + (cfg["vocab_size"],))
    names = check_logits_and_grads(m, hf, ids, dlogits)
    assert routing_margin(m) > 1e-6  # no choice on a tie: the two sides route alike
    for n, p in names.items():
        assert np.abs(p.grad).max() > 0, n  # every parameter is reached (each expert chosen somewhere)


@needs_transformers
@pytest.mark.parametrize("name", sorted(CASES))
def test_cached_decoding_gives_transformers_full_pass(name):
    hf, cfg = _build(name)
    m = CausalLM.from_hf(state_dict(hf), cfg)
    check_cached_decoding(m, hf, _ids(cfg["vocab_size"], seed=3))


# a short convolution with a bias convolves the bias of the padded steps into a row's first tokens
# (in transformers too): such a padded row is not that row alone
_UNBIASED = sorted(n for n, case in CASES.items() if not case[2].get("conv_bias"))


@needs_transformers
@pytest.mark.parametrize("name", _UNBIASED)
def test_a_left_padded_batch_is_transformers_and_each_row_alone(name):
    """A left-padded batch (7, 4 and 1 real tokens) against transformers with the same mask, each
    row equal to its prompt alone, then two tokens more through the cache."""
    hf, cfg = _build(name)
    check_padded_batch(CausalLM.from_hf(state_dict(hf), cfg), hf, cfg["vocab_size"], (7, 4, 1), decode=2)


@needs_transformers
@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "olmoe", "lfm2_moe"])
def test_short_config_dicts_mean_what_they_mean_to_transformers(name):
    """The tiny entry without the keys it leaves out reads as transformers' full to_dict() of it."""
    short = tiny_config(name)
    full = T.AutoConfig.for_model(**short).to_dict()
    meta = dict(bos_token_id=None, eos_token_id=None, max_position_embeddings=None)
    assert config_from_hf(short).replace(**meta) == config_from_hf(full).replace(**meta)
    left_out = (
        "num_local_experts",
        "num_experts",
        "num_experts_per_tok",
        "rope_theta",
        "shared_expert_intermediate_size",
    )
    bare = {k: v for k, v in short.items() if k not in left_out}
    full = T.AutoConfig.for_model(**bare).to_dict()
    assert config_from_hf(bare).replace(**meta) == config_from_hf(full).replace(**meta)


@needs_transformers
@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "olmoe", "lfm2_moe"])
def test_a_transformers_directory_loads_and_saves_back(name, tmp_path):
    """transformers' save_pretrained (each expert apart, under the family's checkpoint names) ->
    from_pretrained gives transformers' logits; our save_pretrained writes the same names, which
    transformers reads back to the same logits."""
    from safetensors import safe_open

    hf, cfg = _build(name)
    hf.save_pretrained(tmp_path / "hf")
    m = CausalLM.from_pretrained(tmp_path / "hf")
    ids = _ids(cfg["vocab_size"])
    ref = hf_logits(hf, ids)
    assert rel_err(m(ids), ref, floor=1e-300, relative_to="max_b") < 1e-9
    m.save_pretrained(tmp_path / "ours")

    def names(d):
        with safe_open(str(d / "model.safetensors"), "np") as f:
            return set(f.keys())

    assert names(tmp_path / "ours") == names(tmp_path / "hf")
    back = T.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ours", dtype="float64", attn_implementation="eager", experts_implementation="eager"
    )
    # loaded outside float64_reference: its RoPE frequencies were computed in float32 (as
    # tests/test_save_pretrained.py compares, to 1e-8)
    assert rel_err(hf_logits(back, ids), ref, floor=1e-300, relative_to="max_b") < 1e-8


@pytest.mark.parametrize("name", ["olmoe", "mixtral", "qwen2_moe", "lfm2_moe"])
def test_hvp_is_the_extrapolated_difference_of_the_gradient(name):
    """CausalLM.loss_hvp (forward over reverse through the routed layers) against the central
    difference of the gradient, Richardson-extrapolated (its eps² term cancelled: OLMoE's tiny
    model curves enough that the plain difference at eps 1e-5 is off by 2e-6, falling as eps²)."""
    from test_loss_hvp import IGNORE, _direction, _flat, _grads, _setup

    m, ids, targets, rng = _setup(name)
    v = _direction(m, rng)
    _, _, hvp = m.loss_hvp(ids, targets, v, ignore_index=IGNORE)
    names = list(dict(m.named_parameters()))

    def central(eps):
        return (
            _flat(_grads(m, ids, targets, v, eps)[1], names) - _flat(_grads(m, ids, targets, v, -eps)[1], names)
        ) / (2 * eps)

    numeric = (4 * central(1e-5) - central(2e-5)) / 3
    assert rel_err(_flat(hvp, names), numeric, floor=1e-300, relative_to="max_b") < 1e-8


@needs_transformers
@pytest.mark.parametrize(
    "name, config_class",
    [
        ("mixtral", "MixtralConfig"),
        ("qwen2_moe", "Qwen2MoeConfig"),
        ("olmoe", "OlmoeConfig"),
        ("lfm2_moe", "Lfm2MoeConfig"),
    ],
)
def test_the_defaults_are_transformers_class_defaults(name, config_class):
    """Every key of the family's ``_DEFAULTS`` is the value of transformers' config class built
    without arguments (Qwen2MoeConfig's sliding_window: 4096 as declared, which its __post_init__
    turns to 0 without use_sliding_window); the counts with two names are the readers' own."""
    from npattn.models.configs import with_defaults

    ours = with_defaults({"model_type": name})
    theirs = getattr(T, config_class)().to_dict()
    declared = {"sliding_window": 4096} if name == "qwen2_moe" else {}
    for key, value in ours.items():
        assert declared.get(key, theirs.get(key)) == value, key
    bare = {k: v for k, v in theirs.items() if k not in ("num_experts", "num_local_experts")}
    if name == "lfm2_moe":  # Lfm2MoeConfig makes no layer_types (its model cannot run without)
        bare["layer_types"] = ["conv"] * bare["num_hidden_layers"]
    experts = config_from_hf(bare)
    assert experts.moe.num_experts == {"mixtral": 8, "qwen2_moe": 60, "olmoe": 64, "lfm2_moe": 32}[name]

"""Configs and checkpoints whose structure is wrong or ambiguous raise ValueError naming the key or
file, never a Python internal (RecursionError, numpy's broadcast error, MemoryError) or minutes of
building: shapes are compared with the config before any layer is built, a config too large to
build is refused by its keys, booleans are JSON booleans, and per-expert keys name one expert one
way.  The shapes said from the config alone are those of the built modules, for every family and
option."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
from _families import FAMILIES

import npattn
from npattn.models import CausalLM, config_from_hf
from npattn.models.causal_lm import DecoderLayer, _state_shapes
from npattn.models.hf import save_safetensors

# -- the config's shapes are the built model's -------------------------------------------------------
VARIANTS = dict(FAMILIES)
VARIANTS.update(
    {
        "llama_biases_tied": dict(FAMILIES["llama"], mlp_bias=True, tie_word_embeddings=True, head_dim=8),
        "qwen3_one_kv_head": dict(FAMILIES["qwen3"], num_key_value_heads=1, tie_word_embeddings=False),
        "gemma3_sandwich_untied": dict(FAMILIES["gemma3_text"], tie_word_embeddings=False, attention_bias=True),
        "gpt_oss_no_bias": dict(FAMILIES["gpt_oss"], attention_bias=False, intermediate_size=12),
        "deepseek_v3_no_q_lora": dict(
            FAMILIES["deepseek_v3"], q_lora_rank=None, n_shared_experts=0, attention_bias=True, first_k_dense_replace=0
        ),
        "deepseek_v3_two_shared": dict(FAMILIES["deepseek_v3"], n_shared_experts=2),
        "qwen3_next_no_shared": dict(
            FAMILIES["qwen3_next"], shared_expert_intermediate_size=0, mlp_only_layers=[1], attention_bias=True
        ),
        "gemma4_moe_double_wide": dict(
            FAMILIES["gemma4_text"],
            enable_moe_block=True,
            num_experts=4,
            top_k_experts=2,
            moe_intermediate_size=8,
            use_double_wide_mlp=True,
            attention_k_eq_v=False,
            attention_bias=True,
            tie_word_embeddings=False,
        ),  # fmt: skip
        "gemma4_no_per_layer_inputs": dict(FAMILIES["gemma4_text"], hidden_size_per_layer_input=0),
    }
)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_shapes_from_the_config_are_the_built_models(name):
    cfg = config_from_hf(VARIANTS[name])
    built = {k: v.shape for k, v in CausalLM(cfg, rng=0).state_dict().items()}
    said = dict(_state_shapes(cfg))
    assert said == built
    assert list(said) == list(built)  # and in the same order


def _checkpoint(name="llama", **config):
    cfg = dict(FAMILIES[name], **config)
    return CausalLM(dict(FAMILIES[name]), rng=0).state_dict(), cfg


def _no_building(monkeypatch):
    """Any layer built from here on fails the test: errors must come before."""

    def boom(*args, **kwargs):
        raise AssertionError("a layer was built before the checkpoint was checked")

    monkeypatch.setattr(DecoderLayer, "__init__", boom)


# -- item 3: structure errors ------------------------------------------------------------------------
def test_config_json_nested_too_deeply(tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    (tmp_path / "config.json").write_text('{"model_type": "llama", "rope_scaling": ' + deep + "}")
    save_safetensors({"x": np.zeros(1, np.float32)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"config\.json.*too deeply"):
        CausalLM.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama", "model_type": "qwen3"}')
    with pytest.raises(ValueError, match=r"config\.json.*duplicate key"):  # which one is meant?
        CausalLM.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config\.json.*JSON object"):
        CausalLM.from_pretrained(tmp_path)


def test_a_deeply_nested_config_value_is_named_not_recursed():
    v: list = []
    for _ in range(100_000):
        v = [v]
    for key in ("tie_word_embeddings", "vocab_size", "rope_parameters"):
        with pytest.raises(ValueError, match=key):
            config_from_hf(dict(FAMILIES["llama"], **{key: v}))


@pytest.mark.parametrize("key", ["intermediate_size", "vocab_size"])
def test_huge_sizes_are_refused_by_key_before_allocation(key, monkeypatch):
    cfg = dict(FAMILIES["llama"], **{key: 10**12})
    with pytest.raises(ValueError, match=rf"{key}=1000000000000"):  # random init: a plausibility bound
        CausalLM(cfg, rng=0)
    sd, _ = _checkpoint()
    _no_building(monkeypatch)
    # with a checkpoint: its shapes are compared with the config's, nothing built yet
    with pytest.raises(ValueError, match=r"expected shape \(.*1000000000000.*\), got"):
        CausalLM.from_hf(sd, cfg)


def test_a_million_layers_fail_at_once(monkeypatch):
    cfg = dict(FAMILIES["llama"], num_hidden_layers=10**6)
    t = time.perf_counter()
    with pytest.raises(ValueError, match="num_hidden_layers"):
        CausalLM(cfg, rng=0)
    sd, _ = _checkpoint()
    _no_building(monkeypatch)
    with pytest.raises(ValueError, match=r"missing key 'model\.layers\.2\..*and more"):
        CausalLM.from_hf(sd, cfg)
    assert time.perf_counter() - t < 30  # was minutes of building


def test_wrong_shapes_are_found_before_any_layer_is_built(monkeypatch):
    sd, cfg = _checkpoint()
    sd["model.layers.1.self_attn.k_proj.weight"] = sd["model.layers.1.self_attn.k_proj.weight"][:, :-1]
    _no_building(monkeypatch)
    with pytest.raises(ValueError, match=r"k_proj\.weight'\]: expected shape \(8, 16\), got \(8, 15\)"):
        CausalLM.from_hf(sd, cfg)
    del sd["model.norm.weight"]
    with pytest.raises(ValueError, match="missing key 'model.norm.weight'"):
        CausalLM.from_hf(sd, cfg)


def _split_experts(name="qwen3_next"):
    """A state dict of ``name`` whose layer-0 experts are written one expert at a time."""
    cfg = FAMILIES[name]
    sd = CausalLM(cfg, rng=0).state_dict()
    layer = 0 if name == "qwen3_next" else 1
    prefix = f"model.layers.{layer}.mlp.experts"
    gu, down = sd.pop(f"{prefix}.gate_up_proj"), sd.pop(f"{prefix}.down_proj")
    inter = gu.shape[1] // 2
    for e in range(gu.shape[0]):
        sd[f"{prefix}.{e}.gate_proj.weight"] = gu[e, :inter]
        sd[f"{prefix}.{e}.up_proj.weight"] = gu[e, inter:]
        sd[f"{prefix}.{e}.down_proj.weight"] = down[e]
    return sd, cfg, prefix, inter


@pytest.mark.parametrize("name", ["qwen3_next", "deepseek_v3"])
def test_a_per_expert_part_of_the_wrong_shape_is_named(name, monkeypatch):
    sd, cfg, prefix, inter = _split_experts(name)
    assert CausalLM.from_hf(sd, cfg) is not None
    _no_building(monkeypatch)
    for e in range(len([k for k in sd if k.endswith("up_proj.weight") and prefix in k])):  # every expert alike
        up = sd[f"{prefix}.{e}.up_proj.weight"]
        sd[f"{prefix}.{e}.up_proj.weight"] = np.concatenate([up, up[:, :1]], axis=1)  # one column too many
    with pytest.raises(ValueError, match=rf"{prefix}\.0\.up_proj\.weight'\]: expected a 2-D tensor of shape"):
        CausalLM.from_hf(sd, cfg)


# -- item 4: ambiguous keys --------------------------------------------------------------------------
def test_an_expert_index_written_two_ways_is_refused():
    sd, cfg, prefix, _ = _split_experts()
    twin = dict(sd, **{f"{prefix}.00.gate_proj.weight": sd[f"{prefix}.0.gate_proj.weight"] + 1})
    with pytest.raises(ValueError, match=r"experts\.00\.gate_proj\.weight.*leading zero"):
        CausalLM.from_hf(twin, cfg)
    renamed = {k.replace(f"{prefix}.1.", f"{prefix}.01."): v for k, v in sd.items()}
    with pytest.raises(ValueError, match=r"experts\.01\..*leading zero"):
        CausalLM.from_hf(renamed, cfg)


def test_per_expert_keys_beside_their_fused_tensor_are_refused():
    sd, cfg, prefix, _ = _split_experts()
    full = CausalLM(cfg, rng=0).state_dict()
    both = dict(sd, **{f"{prefix}.gate_up_proj": full[f"{prefix}.gate_up_proj"]})
    with pytest.raises(ValueError, match=r"both 'model\.layers\.0\.mlp\.experts\.gate_up_proj' and the per-expert"):
        CausalLM.from_hf(both, cfg)


def test_gate_and_up_halves_of_unequal_size_are_refused():
    sd, cfg, prefix, inter = _split_experts()
    for e in range(4):  # the same total rows (2I), split I + 1 / I - 1: was accepted
        gate, up = sd[f"{prefix}.{e}.gate_proj.weight"], sd[f"{prefix}.{e}.up_proj.weight"]
        sd[f"{prefix}.{e}.gate_proj.weight"] = np.concatenate([gate, up[:1]])
        sd[f"{prefix}.{e}.up_proj.weight"] = up[1:]
    with pytest.raises(
        ValueError, match=rf"experts\.0\.gate_proj\.weight'\]: expected a 2-D tensor of shape \({inter}, "
    ):
        CausalLM.from_hf(sd, cfg)


BOOLEANS = [
    ("llama", "tie_word_embeddings"),
    ("llama", "attention_bias"),
    ("llama", "mlp_bias"),
    ("qwen3", "use_sliding_window"),
    ("gemma3_text", "use_bidirectional_attention"),
    ("deepseek_v3", "norm_topk_prob"),
    ("deepseek_v3", "rope_interleave"),
    ("qwen3_next", "norm_topk_prob"),
]


@pytest.mark.parametrize("family, key", BOOLEANS)
@pytest.mark.parametrize("value", ["false", "true", 0, 1, [], "no"])
def test_booleans_are_json_booleans(family, key, value):
    """ "false" (a non-empty string) read as True; 0 and 1 passed as booleans: all refused, naming
    the key and the value."""
    with pytest.raises(ValueError, match=rf"config\['{key}'\].*{re.escape(repr(value))}"):
        config_from_hf(dict(FAMILIES[family], **{key: value}))


def test_null_booleans_read_as_transformers_reads_them():
    """transformers tests a flag's truth: null is false.  Where false is the default that is what
    npattn reads; where true is the default (DeepSeek's rope_interleave) null is refused."""
    cfg = config_from_hf(dict(FAMILIES["llama"], tie_word_embeddings=None, attention_bias=None))
    assert cfg.tie_word_embeddings is False and cfg.attention_bias is False
    with pytest.raises(ValueError, match=r"config\['rope_interleave'\].*None"):
        config_from_hf(dict(FAMILIES["deepseek_v3"], rope_interleave=None))


def test_latent_attention_from_config_reads_booleans_strictly():
    cfg = dict(FAMILIES["deepseek_v3"], q_lora_rank=None)
    npattn.MultiHeadLatentAttention.from_config(cfg)
    for key, value in (("rope_interleave", "false"), ("attention_bias", 0), ("rope_interleave", None)):
        with pytest.raises(ValueError, match=rf"config\['{key}'\]"):
            npattn.MultiHeadLatentAttention.from_config(dict(cfg, **{key: value}))


def test_other_strict_reads():
    with pytest.raises(ValueError, match=r"config\['pad_token_id'\].*True"):
        config_from_hf(dict(FAMILIES["llama"], pad_token_id=True))
    with pytest.raises(ValueError, match=r"config\['pad_token_id'\].*'0'"):
        config_from_hf(dict(FAMILIES["llama"], pad_token_id="0"))
    with pytest.raises(ValueError, match=r"config\['experts_per_token'\]"):  # 1 is not true
        config_from_hf(dict(FAMILIES["gpt_oss"], num_experts_per_tok=1, experts_per_token=True))
    with pytest.raises(ValueError, match=r"config\['rope_scaling'\]"):
        config_from_hf(dict(FAMILIES["llama"], rope_scaling="yarn"))
    with pytest.raises(TypeError, match=r"config\['rope_parameters'\]\['truncate'\]"):
        config_from_hf(
            dict(FAMILIES["gpt_oss"], rope_parameters=dict(FAMILIES["gpt_oss"]["rope_parameters"], truncate="no"))
        )


def test_moe_block_from_hf_config_reads_booleans_strictly():
    from npattn.nn.moe import SparseMoeBlock

    cfg = dict(FAMILIES["qwen3_next"])
    assert SparseMoeBlock.from_hf_config(dict(cfg, norm_topk_prob=False)) is not None
    for value in ("false", 0, None):  # "false" read as True; null is false to transformers, true by default here
        with pytest.raises(ValueError, match=r"config\['norm_topk_prob'\]"):
            SparseMoeBlock.from_hf_config(dict(cfg, norm_topk_prob=value))
    moe = dict(cfg, model_type="qwen3_moe", norm_topk_prob=None)  # default false: null reads as false
    assert SparseMoeBlock.from_hf_config(moe).gate.norm_topk_prob is False


def test_rope_dicts_transformers_would_read_otherwise_than_written_are_refused():
    """transformers silently ignores these: Gemma 3's flat rope_parameters (it wants one dict per
    layer type), 'type' beside a different 'rope_type' (it takes rope_type), a
    max_position_embeddings inside the dict (it reads the config's)."""
    gemma = dict(FAMILIES["gemma3_text"], rope_parameters={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ValueError, match=r"config\['rope_parameters'\]\['rope_type'\].*layer type"):
        config_from_hf(gemma)
    both = dict(FAMILIES["llama"], rope_parameters={"rope_type": "linear", "type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match=r"config\['rope_parameters'\].*'rope_type'='linear' and 'type'='yarn'"):
        config_from_hf(both)
    inner = {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 16}
    with pytest.raises(ValueError, match=r"\['max_position_embeddings'\]: 16 differs .* max_position_embeddings=8"):
        config_from_hf(dict(FAMILIES["llama"], max_position_embeddings=8, rope_parameters=inner))


# -- a partial rotation where transformers rotates whole heads -------------------------------------------
_PARTIAL_ROPE = (
    "qwen3_next",
    "qwen3_5_text",
    "qwen3_5_moe_text",
    "phi3",
    "glm4",
    "gpt_neox",
    "phi",
    "stablelm",
)  # rotate part of each head


_WHOLE_HEADS = sorted(set(FAMILIES) - set(_PARTIAL_ROPE))  # their own tests read the factor
_NO_ROPE_DICT = ("kimi_linear", "nemotron_h", "nemotron_h_moe", "gpt2", "mamba2")  # GPT-2: learned positions, no RoPE
_WHERE = [(f, "top") for f in _WHOLE_HEADS] + [(f, "dict") for f in _WHOLE_HEADS if f not in _NO_ROPE_DICT]


@pytest.mark.parametrize("family, where", _WHERE)  # (Kimi Linear's and Nemotron-H's attention, Mamba-2: no RoPE dict)
def test_partial_rotary_factor_is_refused_where_transformers_rotates_whole_heads(family, where):
    """Llama's attention (and that of every family it was copied into) rotates whole heads: its
    default RoPE ignores ``partial_rotary_factor`` (``test_transformers_ignores_the_factor``), so a
    partial rotation would give other logits; npattn refuses the key rather than guess."""
    cfg = dict(FAMILIES[family])
    config_from_hf(cfg)  # the family's own config reads
    half = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
    if where == "top":
        cfg["partial_rotary_factor"] = 0.5
    elif family in ("gemma3_text", "olmo3", "gemma4_text"):  # one dict per layer type
        cfg["rope_parameters"] = {
            "full_attention": half,
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        }
    else:
        cfg["rope_parameters"] = dict(cfg.get("rope_parameters") or {}, **half)
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        config_from_hf(cfg)


def test_transformers_ignores_the_factor():
    """The refusal's premise: transformers' Llama rotates whole heads whatever the factor (if a
    release honoured it, this fails and the refusal must become a reading)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = dict(FAMILIES["llama"], dtype="float64")
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    logits = []
    for extra in ({}, {"partial_rotary_factor": 0.5}):
        torch.manual_seed(0)
        hf_cfg = transformers.LlamaConfig(**dict(cfg, **extra), attn_implementation="eager")
        model = transformers.LlamaForCausalLM(hf_cfg).double().eval()
        with torch.no_grad():
            logits.append(model(ids).logits.numpy())
    np.testing.assert_array_equal(logits[0], logits[1])

"""NVIDIA Nemotron-H (``nemotron_h``: NVIDIA-Nemotron-Nano-9B-v2/12B-v2, Nemotron-H-4B/8B, and
Nemotron 3's routed experts): blocks of one sublayer each, ``x + mixer(norm(x))``, the mixer a
Mamba-2 layer, attention without RoPE, an MLP ``down(relu2(up(x)))`` (layer kind ``"none"`` / MLP
kind ``"none"``, ``"plain"``) or routed experts that are not gated with a shared expert (MLP kind
``"moe"``, ``PlainExperts``; the tiny entry ``nemotron_h_moe``).

* the config reader: the block pattern (``hybrid_override_pattern``, ``layers_block_type``), the
  older key names, every refusal by name;
* against transformers' own ``NemotronHForCausalLM`` in float64: logits to 1e-9 and every
  parameter's gradient to 1e-8 under a random upstream gradient, cached decoding, a left-padded
  batch, ``save_pretrained`` read back by transformers.  The family-wide suites run the tiny entry.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from _hf64 import transformers_or_none

from npattn.models import CausalLM, config_from_hf
from npattn.models.tiny import tiny_config

T = transformers_or_none()
oracle = pytest.mark.skipif(T is None, reason="needs torch and transformers")

_SIZES = dict(
    model_type="nemotron_h", vocab_size=37, hidden_size=16, intermediate_size=20, num_attention_heads=4,
    num_key_value_heads=2, head_dim=6, mamba_num_heads=4, mamba_head_dim=6, n_groups=2, ssm_state_size=4,
    conv_kernel=3, chunk_size=4,
)  # fmt: skip


def test_the_pattern_and_the_kinds():
    cfg = config_from_hf(dict(_SIZES, hybrid_override_pattern="M-M*-", num_hidden_layers=52))
    assert cfg.num_hidden_layers == 5  # transformers: the pattern's length
    assert cfg.layer_types == ("linear_attention", "none", "linear_attention", "full_attention", "none")
    assert cfg.mlp_types == ("none", "plain", "none", "none", "plain")
    assert cfg.hidden_act == "relu2" and cfg.rms_norm_eps == 1e-5
    assert cfg.pad_token_id == 0 and not cfg.pad_embedding_row  # generation's pad, no padding row
    assert cfg.rope_layers == (False,) * 5
    m = cfg.linear_attention
    assert (m.num_heads, m.head_dim, m.n_groups, m.state_size, m.conv_kernel, m.chunk_size) == (4, 6, 2, 4, 3, 4)
    assert m.time_step_limit == (0.001, math.inf) and m.gated_norm == "gate_first" and m.conv_bias
    listed = config_from_hf(dict(_SIZES, layers_block_type=["linear_attention", "mlp", "full_attention"]))
    assert listed.layer_types == ("linear_attention", "none", "full_attention")
    tied = config_from_hf(dict(_SIZES, hybrid_override_pattern="M-", tie_word_embeddings=True))
    assert not tied.tie_word_embeddings  # NemotronHForCausalLM ties nothing


def test_the_experts_blocks():
    """Nemotron 3's "E" blocks: DeepSeek-V3's sigmoid router, experts that are not gated, the shared
    expert, the latent width; NemotronHConfig's default blocks hold one."""
    cfg = config_from_hf(tiny_config("nemotron_h_moe"))
    assert cfg.layer_types == ("linear_attention", "none", "full_attention", "none", "none")
    assert cfg.mlp_types == ("none", "moe", "none", "plain", "moe")
    e = cfg.moe
    assert (e.num_experts, e.top_k, e.intermediate_size, e.experts, e.hidden_act) == (4, 2, 6, "plain", "relu2")
    assert (e.router, e.norm_topk_prob, e.n_group, e.topk_group) == ("sigmoid", True, 2, 1)
    assert e.routed_scaling_factor == 2.5
    assert (e.shared_intermediate_size, e.shared_name, e.latent_size, e.shared_bias) == (10, "shared_experts", 8, False)
    assert cfg.layout.per_expert and cfg.layout.expert_projs == (None, "up_proj", "down_proj")
    alias = config_from_hf(dict(_SIZES, hybrid_override_pattern="ME", num_local_experts=6, n_routed_experts=8))
    assert alias.moe.num_experts == 6  # NemotronHConfig.attribute_map: num_local_experts sets n_routed_experts
    default = config_from_hf(dict(_SIZES))  # layers_block_type's default: M, E, *, -
    assert default.mlp_types == ("none", "moe", "none", "plain") and default.moe.latent_size is None
    biased = config_from_hf(dict(_SIZES, hybrid_override_pattern="E", mlp_bias=True, moe_latent_size=4))
    assert biased.moe.shared_bias and biased.moe.latent_bias


def test_older_key_names():
    old = dict(_SIZES, hybrid_override_pattern="M*", mamba_n_groups=1, mamba_d_conv=2, mamba_chunk_size=8)
    old.update(mamba_dt_min=0.02, mamba_conv_bias=False, mamba_expand=3, mamba_dt_limit=[0.0, 1.0])
    m = config_from_hf(old).linear_attention
    assert (m.n_groups, m.conv_kernel, m.chunk_size, m.conv_bias) == (1, 2, 8, False)
    assert m.time_step_limit == (0.02, math.inf)


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(hybrid_override_pattern="M*E-", moe_shared_expert_intermediate_size=0), "moe_shared_expert_inter"),
        (dict(hybrid_override_pattern="E", moe_latent_size=0), "moe_latent_size"),
        (dict(hybrid_override_pattern="E", norm_topk_prob="yes"), "norm_topk_prob"),
        (dict(hybrid_override_pattern="MX"), "hybrid_override_pattern"),
        (dict(layers_block_type=["mamba"]), "'mamba' is not supported"),
        (dict(layers_block_type="M*"), "expected a non-empty list"),
        (dict(hybrid_override_pattern="M*", attention_bias=True), "attention_bias"),
        (dict(hybrid_override_pattern="M*", sliding_window=8), "sliding_window"),
        (dict(hybrid_override_pattern="M*", mamba_proj_bias=True), "mamba_proj_bias"),
        (dict(hybrid_override_pattern="M*", mamba_hidden_act="gelu"), "mamba_hidden_act"),
        (dict(hybrid_override_pattern="M*", mlp_hidden_act="tanh"), "mlp_hidden_act"),
        (dict(hybrid_override_pattern="M*", n_groups=3), "n_groups"),
        (dict(hybrid_override_pattern="M*", time_step_min=-1.0), "time_step_min"),
        (dict(hybrid_override_pattern="M*", new_option=1), "new_option"),
    ],
)
def test_refusals_name_the_key(bad, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf(dict(_SIZES, **bad))


@pytest.mark.parametrize(
    "bad,match", [(dict(n_routed_experts=6, n_group=4), "n_group"), (dict(num_experts_per_tok=9), "top_k")]
)
def test_a_router_transformers_cannot_build_is_refused_by_name(bad, match):
    with pytest.raises(ValueError, match=match):
        CausalLM(config_from_hf(dict(_SIZES, hybrid_override_pattern="E", **bad)), rng=0)


@pytest.mark.parametrize("kinds", [("none", "plain"), ("linear_attention", "none"), ("full_attention", "none")])
def test_a_block_of_one_sublayer_against_finite_differences(kinds):
    """A layer without attention (the MLP block) or without an MLP (the Mamba-2 and attention
    blocks): backward, JVP and second order against central differences."""
    from npattn.models.causal_lm import DecoderLayer
    from npattn.testing import gradcheck, gradgradcheck

    cfg = config_from_hf(dict(_SIZES, hybrid_override_pattern="M*-"))
    cfg = cfg.replace(layer_types=(kinds[0],) * 3, mlp_types=(kinds[1],) * 3)
    layer = DecoderLayer(cfg, 0, rng=1)
    names = sorted(n for n, _ in layer.named_parameters())
    assert names[-1] == "norm.weight" and all(n.startswith("mixer.") for n in names[:-1])
    x = np.random.default_rng(2).standard_normal((2, 5, 16))
    for report in (gradcheck(layer, x, mode="both", seed=3), gradgradcheck(layer, x, seed=4)):
        assert report.ok, str(report)


def test_names_are_the_checkpoints():
    m = CausalLM(tiny_config("nemotron_h"), rng=0)
    names = set(dict(m.named_parameters()))
    assert "model.layers.0.mixer.A_log" in names and "model.layers.1.mixer.up_proj.weight" in names
    assert "model.layers.2.mixer.q_proj.weight" in names and "model.norm_f.weight" in names
    assert "model.embeddings.weight" in names
    assert {n for n in names if ".layers.1." in n} == {
        "model.layers.1.norm.weight", "model.layers.1.mixer.up_proj.weight", "model.layers.1.mixer.down_proj.weight"
    }  # fmt: skip


# -- against transformers ----------------------------------------------------------------------
# NVIDIA's released config.json spells the mixer's keys the older way (mamba_n_groups, mamba_d_conv,
# mamba_chunk_size, mamba_dt_*...), beside the other keys of its remote NemotronHConfig
_RELEASED = dict(
    _SIZES, hybrid_override_pattern="M-M*-", num_hidden_layers=5, mamba_n_groups=2, mamba_d_conv=3,
    mamba_expand=2, mamba_hidden_act="silu", mamba_dt_min=0.001, mamba_dt_max=0.1, mamba_dt_limit=[0.0, 1e9],
    mamba_dt_init_floor=1e-4, mamba_conv_bias=True, mamba_proj_bias=False, mamba_chunk_size=4,
    residual_in_fp32=False, rescale_prenorm_residual=True, hidden_dropout=0.0, use_mamba_kernels=True,
    num_logits_to_keep=1, sliding_window=None, attention_bias=False, use_bias=False, mlp_bias=False,
    layer_norm_epsilon=1e-5, mlp_hidden_act="relu2", initializer_range=0.02, max_position_embeddings=8192,
    architectures=["NemotronHForCausalLM"], torch_dtype="bfloat16", use_cache=True,
)  # fmt: skip


@oracle
@pytest.mark.parametrize("name", ["released", "tiny", "biases_tied", "moe", "moe_biases"])
def test_dicts_mean_what_they_mean_to_transformers(name):
    """The older key names and short dicts read as transformers' NemotronHConfig reads them."""
    d = _RELEASED if name == "released" else (CASES[name] or tiny_config("nemotron_h"))
    full = T.NemotronHConfig(**{k: v for k, v in d.items() if k != "model_type"}).to_dict()
    meta = dict(bos_token_id=None, eos_token_id=None, max_position_embeddings=None)
    assert config_from_hf(d).replace(**meta) == config_from_hf(full).replace(**meta)


CASES = {
    "tiny": None,
    # biases on in_proj/out_proj and the MLP, no conv bias, a tied head, two Mamba blocks in a row
    "biases_tied": dict(
        _SIZES,
        layers_block_type=["linear_attention", "linear_attention", "full_attention", "mlp"],
        use_bias=True,
        mlp_bias=True,
        use_conv_bias=False,
        tie_word_embeddings=True,
        time_step_min=0.02,
    ),  # fmt: skip
    # Nemotron 3's experts: the tiny entry (groups, scaling, a latent width), then biases on the shared
    # expert, one group, no renormalisation and no latent width, silu experts
    "moe": tiny_config("nemotron_h_moe"),
    "moe_biases": dict(
        _SIZES,
        hybrid_override_pattern="EM-E*",
        n_routed_experts=5,
        num_experts_per_tok=3,
        moe_intermediate_size=7,
        moe_shared_expert_intermediate_size=9,
        mlp_bias=True,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        mlp_hidden_act="silu",
    ),  # fmt: skip
    "moe_latent_biases": dict(
        tiny_config("nemotron_h_moe"),
        mlp_bias=True,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=3,
    ),  # fmt: skip
}


def _case(name):
    from _hf64 import build

    kwargs = CASES[name] or tiny_config("nemotron_h")
    kwargs = {k: v for k, v in kwargs.items() if k != "model_type"}
    return build(T.NemotronHConfig, T.NemotronHForCausalLM, **kwargs)


@oracle
@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_and_every_gradient_match_transformers(name):
    from _hf64 import check_logits_and_grads, state_dict

    hf, cfg = _case(name)
    m = CausalLM.from_hf(state_dict(hf), cfg)
    ids = np.random.default_rng(0).integers(0, cfg["vocab_size"], (2, 9))
    ids[:, 2] = cfg["pad_token_id"]  # its embedding row has a gradient (no padding_idx in transformers)
    dlogits = np.random.default_rng(1).standard_normal(ids.shape + (cfg["vocab_size"],))
    params = check_logits_and_grads(m, hf, ids, dlogits)
    assert any(".mixer.A_log" in n for n in params) and any(".mixer.k_proj" in n for n in params)
    if name.startswith("moe"):  # every expert chosen by some token: each one's gradient compared
        assert any(".mixer.experts.up_proj" in n for n in params)
        assert any(".mixer.shared_experts.down_proj" in n for n in params)
        for layer in m.model.layers:
            if layer.mlp is not None and hasattr(layer.mlp, "experts"):
                assert np.all(np.abs(layer.mlp.experts.up_proj.grad).sum((1, 2)) > 0)


@oracle
@pytest.mark.parametrize("name", sorted(CASES))
def test_cached_decoding_and_a_padded_batch_are_transformers(name):
    from _hf64 import check_cached_decoding, check_padded_batch, state_dict

    hf, cfg = _case(name)
    m = CausalLM.from_hf(state_dict(hf), cfg)
    check_cached_decoding(m, hf, np.random.default_rng(3).integers(0, cfg["vocab_size"], (2, 9)))
    if not cfg["use_bias"]:
        check_padded_batch(m, hf, cfg["vocab_size"], [7, 4], decode=2)


def test_save_pretrained_writes_the_backbone_names(tmp_path):
    """The released checkpoints' names (transformers reads the directory back in
    tests/test_save_pretrained.py, as every family's)."""
    from safetensors.numpy import load_file

    m = CausalLM(tiny_config("nemotron_h"), rng=0)
    m.save_pretrained(tmp_path)
    keys = set(load_file(tmp_path / "model.safetensors"))
    assert "backbone.embeddings.weight" in keys and "backbone.norm_f.weight" in keys
    assert "backbone.layers.1.mixer.up_proj.weight" in keys and not any(k.startswith("model.") for k in keys)
    ids = np.random.default_rng(5).integers(0, 41, (1, 6))
    np.testing.assert_allclose(CausalLM.from_pretrained(tmp_path)(ids), m(ids), rtol=1e-12, atol=1e-12)


def test_the_experts_are_written_and_read_one_expert_at_a_time(tmp_path):
    """Nemotron 3's released checkpoints keep each routed expert apart
    (``backbone.layers.{i}.mixer.experts.{e}.up_proj.weight``; transformers' conversion_mapping
    stacks them): save_pretrained writes them so, the reader stacks them back, and a stacked tensor
    beside its parts, or a missing expert, is refused by name."""
    from safetensors.numpy import load_file, save_file

    m = CausalLM(tiny_config("nemotron_h_moe"), rng=0)
    m.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    assert {
        f"backbone.layers.1.mixer.experts.{e}.{p}.weight" for e in range(4) for p in ("up_proj", "down_proj")
    } <= set(tensors)
    assert not any(k.endswith("experts.up_proj") or k.endswith("experts.down_proj") for k in tensors)
    assert tensors["backbone.layers.4.mixer.experts.3.up_proj.weight"].shape == (6, 8)  # (I, the latent width)
    np.testing.assert_array_equal(
        tensors["backbone.layers.4.mixer.experts.2.down_proj.weight"], m.model.layers[4].mlp.experts.down_proj.data[2]
    )
    ids = np.random.default_rng(5).integers(0, 41, (1, 6))
    np.testing.assert_array_equal(CausalLM.from_pretrained(tmp_path)(ids), m(ids))
    del tensors["backbone.layers.1.mixer.experts.3.down_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing key '.*layers\.1\.mixer\.experts\.3\.down_proj\.weight'"):
        CausalLM.from_pretrained(tmp_path)
    tensors["backbone.layers.1.mixer.experts.3.down_proj.weight"] = np.zeros((8, 6), np.float32)
    tensors["backbone.layers.1.mixer.experts.up_proj"] = np.zeros((4, 6, 8), np.float32)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"both '.*layers\.1\.mixer\.experts\.up_proj' and the per-expert keys"):
        CausalLM.from_pretrained(tmp_path)


def test_a_tie_flag_keeps_the_head_its_own(tmp_path):
    """``tie_word_embeddings: true`` ties nothing (``NemotronHForCausalLM._tied_weights_keys`` is
    empty): the head is ``lm_head.weight``, written beside the flag as given (as transformers'
    save_pretrained does), and a checkpoint without it is refused by name, not tied."""
    import json

    from safetensors.numpy import load_file, save_file

    m = CausalLM(tiny_config("nemotron_h", tie_word_embeddings=True), rng=0)
    assert not np.array_equal(m.lm_head.weight.data, m.model.embed_tokens.weight.data)
    m.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is True
    tensors = load_file(tmp_path / "model.safetensors")
    np.testing.assert_array_equal(tensors["lm_head.weight"], m.lm_head.weight.data)
    ids = np.random.default_rng(5).integers(0, 41, (1, 6))
    np.testing.assert_array_equal(CausalLM.from_pretrained(tmp_path)(ids), m(ids))
    del tensors["lm_head.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing key 'lm_head.weight'"):
        CausalLM.from_pretrained(tmp_path)

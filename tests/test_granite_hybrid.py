"""Granite 4.0's hybrid models (``granitemoehybrid`` with Mamba-2 layers: granite-4.0-h-micro,
-h-tiny, -h-small): the ``mamba_*`` keys read into ``Mamba2Config`` (``"auto"`` head width, a
missing ``layer_types`` every layer Mamba-2, as transformers reads them), the refusals by name,
and against transformers' own ``GraniteMoeHybridForCausalLM`` in float64: logits to 1e-9 and
every parameter's gradient to 1e-8 under a random upstream gradient, cached decoding and a
left-padded batch.  The family-wide suites run the tiny entry (a Mamba-2 layer before an
attention layer, with experts)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from _hf64 import transformers_or_none

from npattn.models import CausalLM, config_from_hf
from npattn.models.configs import Mamba2Config

T = transformers_or_none()
oracle = pytest.mark.skipif(T is None, reason="needs torch and transformers")

# granite-4.0-h-tiny's config.json keys at a tiny size (4 Mamba-2 layers, one attention layer there
# in every ten; routed experts beside the shared MLP, no positions)
_RELEASED = dict(
    architectures=["GraniteMoeHybridForCausalLM"],
    attention_bias=False,
    attention_dropout=0.0,
    attention_multiplier=0.0078125,
    bos_token_id=100257,
    embedding_multiplier=12,
    eos_token_id=100257,
    hidden_act="silu",
    hidden_size=32,
    init_method="mup",
    initializer_range=0.1,
    intermediate_size=16,
    layer_types=["mamba", "mamba", "attention", "mamba"],
    logits_scaling=6,
    mamba_chunk_size=256,
    mamba_conv_bias=True,
    mamba_d_conv=4,
    mamba_d_head=8,
    mamba_d_state=16,
    mamba_expand=2,
    mamba_n_groups=1,
    mamba_n_heads=8,
    mamba_proj_bias=False,
    max_position_embeddings=131072,
    model_type="granitemoehybrid",
    normalization_function="rmsnorm",
    num_attention_heads=4,
    num_experts_per_tok=2,
    num_hidden_layers=4,
    num_key_value_heads=1,
    num_local_experts=4,
    output_router_logits=False,
    pad_token_id=100256,
    position_embedding_type="nope",
    residual_multiplier=0.22,
    rms_norm_eps=1e-05,
    rope_scaling=None,
    rope_theta=10000,
    router_aux_loss_coef=0.0,
    shared_intermediate_size=24,
    tie_word_embeddings=True,
    torch_dtype="bfloat16",
    transformers_version="4.56.0",
    use_cache=True,
    vocab_size=100352,
)


def test_the_released_hybrid_config_reads():
    """Every key read or known; the Mamba-2 layers' arguments; the layers named as transformers'."""
    c = config_from_hf(_RELEASED)
    assert c.layer_types == ("linear_attention", "linear_attention", "full_attention", "linear_attention")
    assert c.linear_attention == Mamba2Config(
        hidden_size=32, num_heads=8, head_dim=8, state_size=16, n_groups=1, conv_kernel=4, conv_bias=True,
        proj_bias=False, rms_norm_eps=1e-5, time_step_limit=(0.0, math.inf), chunk_size=256,
    )  # fmt: skip
    assert c.mlp_types == ("moe",) * 4 and c.rope_layers == (False,) * 4
    small = dict(_RELEASED, vocab_size=61, pad_token_id=60, bos_token_id=1, eos_token_id=2)
    names = set(CausalLM(small, rng=0).state_dict())
    layer = sorted(k[len("model.layers.0.mamba.") :] for k in names if k.startswith("model.layers.0.mamba."))
    assert layer == [
        "A_log", "D", "conv1d.bias", "conv1d.weight", "dt_bias", "in_proj.weight", "norm.weight", "out_proj.weight"
    ]  # fmt: skip
    assert "model.layers.2.self_attn.q_proj.weight" in names and not any("layers.2.mamba" in k for k in names)


def test_auto_head_width_transformers_5_names_and_a_missing_layer_types():
    """``mamba_d_head`` "auto" is ``mamba_expand * hidden_size / mamba_n_heads``; transformers 5's
    "linear_attention" is "mamba"; without ``layer_types`` every layer is Mamba-2 (transformers')."""
    a = config_from_hf(_RELEASED)
    assert config_from_hf(dict(_RELEASED, mamba_d_head="auto")).replace(hf={}) == a.replace(hf={})
    lt = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
    assert config_from_hf(dict(_RELEASED, layer_types=lt)).replace(hf={}) == a.replace(hf={})
    every = config_from_hf({k: v for k, v in _RELEASED.items() if k != "layer_types"})
    assert every.layer_types == ("linear_attention",) * 4
    clipped = config_from_hf(dict(_RELEASED, time_step_limit=[0.001, 100.0]))
    assert clipped.linear_attention.time_step_limit == (0.001, 100.0)


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(mamba_d_head=4), r"config\['mamba_d_head'\]: expected mamba_expand \* hidden_size / mamba_n_heads = 8"),
        (dict(mamba_d_head="4"), r"config\['mamba_d_head'\]: expected 'auto' or an integer >= 1"),
        (dict(mamba_d_head="auto", mamba_n_heads=7), r"config\['mamba_n_heads'\]: expected a divisor of"),
        (dict(mamba_n_groups=3), r"config\['mamba_n_groups'\]: expected a divisor of mamba_n_heads = 8, got 3"),
        (dict(mamba_n_heads=0), r"config\['mamba_n_heads'\]: expected an integer >= 1"),
        (dict(mamba_d_state=0), r"config\['mamba_d_state'\]: expected an integer >= 1"),
        (dict(mamba_d_conv=1.5), r"config\['mamba_d_conv'\]: expected an integer"),
        (dict(mamba_chunk_size=0), r"config\['mamba_chunk_size'\]: expected an integer >= 1"),
        (dict(mamba_conv_bias="yes"), r"mamba_conv_bias"),
        (dict(mamba_proj_bias=1), r"mamba_proj_bias"),
        (dict(time_step_limit=[1.0, 0.5]), r"config\['time_step_limit'\]: expected two numbers \[low, high\]"),
        (dict(time_step_limit=[0.0]), r"config\['time_step_limit'\]: expected two numbers"),
        (dict(time_step_limit=[0.0, "inf"]), r"config\['time_step_limit'\]: expected two numbers"),
        (dict(hidden_act="gelu"), r"config\['hidden_act'\] = 'gelu' is not supported .* with Mamba-2 layers"),
        (dict(layer_types=["mamba", "attention", "mamba"]), r"config\['layer_types'\]: expected a list of 4"),
        (dict(layer_types=["mamba", "mamba2", "attention", "mamba"]), r"'mamba2' is not supported"),
    ],
)
def test_hybrid_refusals_name_the_key(bad, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf(dict(_RELEASED, **bad))


def test_without_mamba_layers_the_keys_are_metadata():
    """An all-attention model reads the ``mamba_*`` keys as metadata, whatever they say."""
    c = config_from_hf(dict(_RELEASED, layer_types=["attention"] * 4, mamba_d_head=5, hidden_act="gelu"))
    assert c.linear_attention is None and c.layer_types == ("full_attention",) * 4


@oracle
@pytest.mark.parametrize(
    "short",
    [
        dict(model_type="granitemoehybrid", vocab_size=61, hidden_size=16, num_attention_heads=2, num_hidden_layers=2,
             layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_state=8),
        dict(model_type="granitemoehybrid", vocab_size=61, hidden_size=16, num_attention_heads=2, num_hidden_layers=2,
             mamba_n_heads=2, num_local_experts=0),
    ],
)  # fmt: skip
def test_short_config_dicts_mean_what_they_mean_to_transformers(short):
    """Keys left out (``mamba_d_head`` "auto", ``time_step_limit``, the groups, the taps, the
    biases, ``layer_types``) read as transformers reads them."""
    full = T.AutoConfig.for_model(**short).to_dict()
    meta = dict(bos_token_id=None, eos_token_id=None, max_position_embeddings=None)
    assert config_from_hf(short).replace(**meta) == config_from_hf(full).replace(**meta)


_BASE = dict(
    vocab_size=61,
    hidden_size=16,
    intermediate_size=12,
    num_attention_heads=4,
    num_key_value_heads=2,
    attention_bias=True,
    embedding_multiplier=5.0,
    residual_multiplier=0.4,
    attention_multiplier=0.25,
    logits_scaling=3.0,
    shared_intermediate_size=20,
    mamba_n_heads=4,
    mamba_n_groups=2,
    mamba_d_state=4,
    mamba_d_conv=3,
    mamba_chunk_size=4,
)
CASES = {
    # two Mamba-2 layers around an attention layer, 2 of 3 experts beside the shared MLP, no positions
    "mamba_moe_nope": dict(_BASE, num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"],
                           num_local_experts=3, num_experts_per_tok=2, position_embedding_type="nope"),
    # the projections' biases and no convolution bias, the shared MLP alone, RoPE, tied
    "mamba_dense_rope_biases": dict(_BASE, num_hidden_layers=2, layer_types=["attention", "mamba"],
                                    num_local_experts=0, num_experts_per_tok=0, position_embedding_type="rope",
                                    mamba_proj_bias=True, mamba_conv_bias=False, tie_word_embeddings=True,
                                    rope_theta=500.0),
}  # fmt: skip


def _case(name):
    from _hf64 import build

    return build(T.GraniteMoeHybridConfig, T.GraniteMoeHybridForCausalLM, **CASES[name])


def _split_grads(ref: dict) -> dict:
    """transformers' gradients under the model's names: the shared MLP's fused input_linear as its
    gate and up rows."""
    out = {}
    for k, v in ref.items():
        if k.endswith("shared_mlp.input_linear.weight"):
            half, prefix = v.shape[0] // 2, k[: -len("input_linear.weight")]
            out[prefix + "gate_proj.weight"], out[prefix + "up_proj.weight"] = v[:half], v[half:]
        else:
            out[k] = v
    return out


@oracle
@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_and_every_gradient_match_transformers(name):
    """Without RoPE a key's bias adds the same q.b to every score of a query: its gradient is 0."""
    from _hf64 import check_logits_and_grads, state_dict

    hf, cfg = _case(name)
    m = CausalLM.from_hf(state_dict(hf), cfg)
    ids = np.random.default_rng(0).integers(0, cfg["vocab_size"], (2, 9))
    attention = [i for i, t in enumerate(m.config.layer_types) if t == "full_attention"]
    zero = [f"model.layers.{i}.self_attn.k_proj.bias" for i in attention] if "nope" in name else ()
    dlogits = np.random.default_rng(1).standard_normal(ids.shape + (cfg["vocab_size"],))
    params = check_logits_and_grads(m, hf, ids, dlogits, grads=_split_grads, zero=zero)
    assert any(".mamba.A_log" in n for n in params)


@oracle
@pytest.mark.parametrize("name", sorted(CASES))
def test_cached_decoding_and_a_padded_batch_are_transformers(name):
    """Decoding through the kept convolution windows and states gives transformers' full pass; a
    left-padded batch gives transformers' logits (each row its prompt alone without in_proj's
    bias, which transformers convolves from the padding into the first tokens)."""
    from _hf64 import check_cached_decoding, check_padded_batch, state_dict

    hf, cfg = _case(name)
    m = CausalLM.from_hf(state_dict(hf), cfg)
    check_cached_decoding(m, hf, np.random.default_rng(3).integers(0, cfg["vocab_size"], (2, 9)))
    if not cfg["mamba_proj_bias"]:
        check_padded_batch(m, hf, cfg["vocab_size"], [7, 4], decode=2)


def test_an_infinite_time_step_limit_is_written_and_read_as_transformers_5_does(tmp_path):
    """JSON has no infinity: transformers 5 writes ``time_step_limit``'s as ``{"__float__":
    "Infinity"}``; that reads, and a model built from a dict holding the float writes it so."""
    import json

    tagged = dict(_RELEASED, time_step_limit=[0.0, {"__float__": "Infinity"}])
    assert config_from_hf(tagged).linear_attention.time_step_limit == (0.0, math.inf)
    small = dict(_RELEASED, vocab_size=61, pad_token_id=60, time_step_limit=[0.0, math.inf], num_hidden_layers=2)
    small["layer_types"] = ["mamba", "attention"]
    m = CausalLM(small, rng=0)
    m.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["time_step_limit"] == [0.0, {"__float__": "Infinity"}]
    back = CausalLM.from_pretrained(tmp_path)
    assert back.config.linear_attention == m.config.linear_attention
    with pytest.raises(ValueError, match=r"config\['time_step_limit'\]"):
        config_from_hf(dict(_RELEASED, time_step_limit=[0.0, {"__float__": "NaN"}]))

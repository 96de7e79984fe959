"""Arcee (``arcee``, arcee-ai/AFM-4.5B): Llama's layers with a non-gated MLP
``down_proj(relu2(up_proj(x)))`` (``ArceeMLP``: no ``gate_proj``) and AFM-4.5B's YaRN.  The released
config read, the defaults, the MLP as the plain relu2 one (without torch), transformers' own
directory loaded by ``from_pretrained`` with its logits and every gradient in float64, short dicts,
and the refusals by name.  The family-wide suites run the tiny entry and
``tests/test_causal_lm_parity.py`` two cases against ``ArceeForCausalLM``."""

from __future__ import annotations

import numpy as np
import pytest
from _hf64 import transformers_or_none

from npattn import functional as F
from npattn import no_grad
from npattn.models import CausalLM, config_from_hf
from npattn.models.tiny import tiny_config

T = transformers_or_none()
needs_transformers = pytest.mark.skipif(T is None, reason="needs torch and transformers")

# arcee-ai/AFM-4.5B's config.json at a tiny size: its keys as released (rope_scaling with both
# "type" and "rope_type", mscale, pretraining_tp)
_RELEASED = dict(
    architectures=["ArceeForCausalLM"],
    attention_bias=False,
    attention_dropout=0.0,
    bos_token_id=128000,
    eos_token_id=128001,
    head_dim=8,
    hidden_act="relu2",
    hidden_size=32,
    initializer_range=0.02,
    intermediate_size=48,
    max_position_embeddings=65536,
    mlp_bias=False,
    model_type="arcee",
    num_attention_heads=4,
    num_hidden_layers=2,
    num_key_value_heads=1,
    pretraining_tp=1,
    rms_norm_eps=1e-05,
    rope_scaling={
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 20.0,
        "mscale": 1.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "type": "yarn",
    },
    rope_theta=10000.0,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
    transformers_version="4.53.2",
    use_cache=True,
    vocab_size=61,
)


def test_the_released_config_reads():
    """Every key of AFM-4.5B's config.json is read or known: the plain relu2 MLP on every layer,
    YaRN over 4096 original positions at base 10000, heads of 8, one KV head, no biases."""
    c = config_from_hf(_RELEASED)
    assert c.mlp_types == ("plain",) * 2 and c.layer_types == ("full_attention",) * 2 and c.hidden_act == "relu2"
    a = c.attention_config("full_attention")
    assert a.rope_scaling["rope_type"] == "yarn" and a.rope_scaling["factor"] == 20.0
    assert a.rope_scaling["original_max_position_embeddings"] == 4096 and a.rope_scaling["rope_theta"] == 10000.0
    assert (a.qkv_bias, a.out_bias, c.mlp_bias) == (False, False, False)
    assert (c.head_dim, c.num_key_value_heads, c.tie_word_embeddings, c.rms_norm_eps) == (8, 1, False, 1e-5)
    names = [n for n, _ in CausalLM(c, rng=0).named_parameters() if ".layers.0.mlp." in n]
    assert names == ["model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight"]


def test_the_defaults_are_transformers_class_defaults():
    """A key left out means ArceeConfig's default: relu2, rms_norm_eps 1e-5, bos/eos 128000/128001,
    no biases, untied; head_dim hidden / heads, num_key_value_heads the heads."""
    short = config_from_hf(dict(model_type="arcee", vocab_size=61, hidden_size=32, num_attention_heads=4))
    assert (short.hidden_act, short.rms_norm_eps, short.bos_token_id, short.eos_token_id) == (
        "relu2",
        1e-5,
        128000,
        128001,
    )
    assert (short.head_dim, short.num_key_value_heads, short.intermediate_size, short.num_hidden_layers) == (
        8,
        4,
        18432,
        32,
    )
    assert (short.mlp_bias, short.tie_word_embeddings, short.mlp_types[0]) == (False, False, "plain")
    assert config_from_hf(dict(tiny_config("arcee"), hidden_act="silu")).hidden_act == "silu"


@needs_transformers
def test_the_defaults_are_arcee_config_s():
    """Every key of the family's ``_DEFAULTS`` is the value of ``ArceeConfig()``'s, and its to_dict()
    is the model ``with_defaults`` describes."""
    from npattn.models.configs import with_defaults

    ours, theirs = with_defaults({"model_type": "arcee"}), T.ArceeConfig().to_dict()
    for key, value in ours.items():
        assert theirs[key] == value, key
    meta = dict(bos_token_id=None, eos_token_id=None, max_position_embeddings=None)
    assert config_from_hf(theirs).replace(**meta) == config_from_hf({"model_type": "arcee"}).replace(**meta)


def test_the_mlp_is_down_of_relu2_of_up():
    """A layer's MLP is ``down(relu2(up(x)))`` with both biases: written out from the layer's own
    weights, and relu2 is max(x, 0)^2 (a gated silu MLP would give other values)."""
    m = CausalLM(tiny_config("arcee"), rng=0, dtype=np.float64)
    p = dict(m.named_parameters())
    x = np.random.default_rng(1).standard_normal((3, 16))
    pre = "model.layers.1.mlp."
    up = x @ p[pre + "up_proj.weight"].data.T + p[pre + "up_proj.bias"].data
    want = np.maximum(up, 0) ** 2 @ p[pre + "down_proj.weight"].data.T + p[pre + "down_proj.bias"].data
    with no_grad():
        got = m.model.layers[1].mlp(x)
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(F.relu2(up)[0], np.maximum(up, 0) ** 2, rtol=0, atol=0)


@needs_transformers
@pytest.mark.parametrize("family", ["arcee", "arcee_tied"])
def test_a_transformers_directory_loads_with_its_logits_and_gradients(tmp_path, family):
    """transformers' own save_pretrained directory (ArceeForCausalLM in float64: the tiny entry's
    biases and YaRN; or tied, without biases, the released rope_scaling) loads with
    ``CausalLM.from_pretrained``; logits to 1e-9 and every gradient to 1e-8 under a random upstream
    gradient, the pad token among the ids; the directory ``save_pretrained`` writes back loads in
    transformers (no key missing or unexpected) with the same weights."""
    from _hf64 import check_directory_round_trip

    cfg = tiny_config("arcee")
    if family == "arcee_tied":
        cfg = dict(cfg, mlp_bias=False, tie_word_embeddings=True, rope_parameters=None)
        cfg["rope_scaling"] = dict(_RELEASED["rope_scaling"], original_max_position_embeddings=4)
    check_directory_round_trip(tmp_path, T.ArceeConfig, T.ArceeForCausalLM, cfg)


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(hidden_act="xielu_not"), r"config\['hidden_act'\] = 'xielu_not' is not supported"),
        (dict(mlp_bias="true"), r"config\['mlp_bias'\]: expected true or false \(a JSON boolean\), got 'true'"),
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
        (dict(head_dim=0), r"config\['head_dim'\]: expected an integer >= 1, got 0"),
        (dict(num_key_value_heads=3), r"config\['num_key_value_heads'\]: expected a divisor"),
        # keys of other families: ArceeConfig has no gate, no qk-norm, no window
        (dict(use_qk_norm=True), "key 'use_qk_norm' is not supported"),
        (dict(sliding_window=4), "key 'sliding_window' is not supported"),
        (dict(rope_parameters={"rope_type": "yarn", "factor": -2.0}), "factor"),
    ],
)
def test_refusals_name_the_key(bad, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf(tiny_config("arcee", **bad))

"""The first OLMo (``olmo``: allenai/OLMo-1B-hf, OLMo-7B-hf, OLMo-7B-0424-hf): Llama's pre-norm
layers whose norms are LayerNorms without weight or bias (``OlmoLayerNorm``, eps 1e-5).  The
released config read, the defaults, the norm as a plain standardisation (without torch),
transformers' own directory loaded by ``from_pretrained`` with its logits and every gradient in
float64, ``save_pretrained`` read back by transformers, and the refusals by name.  The family-wide
suites run the tiny entry; ``clip_qkv`` (OLMo-7B-0424's) is tested in tests/test_qkv_clip.py."""

from __future__ import annotations

import numpy as np
import pytest
from _hf64 import transformers_or_none

from npattn import no_grad
from npattn.models import CausalLM, config_from_hf
from npattn.models.tiny import tiny_config

T = transformers_or_none()
needs_transformers = pytest.mark.skipif(T is None, reason="needs torch and transformers")

# allenai/OLMo-1B-hf's config.json at a tiny size: its keys as released
_RELEASED = dict(
    architectures=["OlmoForCausalLM"],
    attention_bias=False,
    attention_dropout=0.0,
    bos_token_id=None,
    clip_qkv=None,
    eos_token_id=50279,
    hidden_act="silu",
    hidden_size=32,
    initializer_range=0.02,
    intermediate_size=48,
    max_position_embeddings=2048,
    model_type="olmo",
    num_attention_heads=4,
    num_hidden_layers=2,
    num_key_value_heads=4,
    pad_token_id=1,
    pretraining_tp=1,
    rope_scaling=None,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    torch_dtype="float32",
    transformers_version="4.40.0.dev0",
    use_cache=True,
    vocab_size=61,
)


def test_the_released_config_reads():
    """Every key of OLMo-1B-hf's config.json is read or known: LayerNorms without parameters (no
    norm tensor at all), a tied head, no biases, every layer full attention with a gated MLP."""
    c = config_from_hf(_RELEASED)
    assert c.layer_norm and not c.layer_norm_affine and c.rms_norm_eps == 1e-5
    assert c.mlp_types == ("dense",) * 2 and c.layer_types == ("full_attention",) * 2 and c.hidden_act == "silu"
    assert c.tie_word_embeddings and c.attention_config("full_attention").qkv_bias is False
    names = [n for n, _ in CausalLM(c, rng=0).named_parameters()]
    assert not [n for n in names if "norm" in n], names
    assert names[:2] == ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"]


def test_the_defaults_are_transformers_class_defaults():
    """A key left out means OlmoConfig's default: silu, untied, no biases, pad 1, eos 50279, 2048
    positions, no clip; the norms' eps is 1e-5 whatever the config says (no key for it)."""
    short = config_from_hf(dict(model_type="olmo", vocab_size=61, hidden_size=32, num_attention_heads=4))
    assert (short.hidden_act, short.rms_norm_eps, short.pad_token_id, short.eos_token_id) == ("silu", 1e-5, 1, 50279)
    assert (short.intermediate_size, short.num_hidden_layers, short.num_key_value_heads) == (11008, 32, 4)
    assert (short.tie_word_embeddings, short.max_position_embeddings) == (False, 2048) and short.qkv_clip is None


@needs_transformers
def test_the_defaults_are_olmo_config_s():
    """Every key of the family's ``_DEFAULTS`` is the value of ``OlmoConfig()``'s, and its to_dict()
    is the model ``with_defaults`` describes."""
    from npattn.models.configs import with_defaults

    ours, theirs = with_defaults({"model_type": "olmo"}), T.OlmoConfig().to_dict()
    for key, value in ours.items():
        assert theirs[key] == value, key
    meta = dict(bos_token_id=None, eos_token_id=None, max_position_embeddings=None)
    assert config_from_hf(theirs).replace(**meta) == config_from_hf({"model_type": "olmo"}).replace(**meta)


def test_the_norm_is_a_plain_standardisation():
    """A layer's input norm is ``(x - mean) / sqrt(var + 1e-5)`` with no weight and no bias (an
    RMSNorm, or a LayerNorm with a weight, would give other values or tensors)."""
    m = CausalLM(tiny_config("olmo"), rng=0, dtype=np.float64)
    x = 3.0 + np.random.default_rng(1).standard_normal((3, 16))
    want = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)
    norm = m.model.layers[0].input_layernorm
    assert norm.weight is None and norm.bias is None
    with no_grad():
        got = norm(x)
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13)


@needs_transformers
@pytest.mark.parametrize("family", ["olmo", "olmo_untied"])
def test_a_transformers_directory_loads_with_its_logits_and_gradients(tmp_path, family):
    """transformers' own save_pretrained directory (OlmoForCausalLM in float64, its float32
    LayerNorm made float64: the tiny entry's biases, GQA and tied head; or untied without biases)
    loads with ``CausalLM.from_pretrained``; logits to 1e-9 and every gradient to 1e-8 under a
    random upstream gradient, the pad token among the ids; the directory ``save_pretrained`` writes
    back loads in transformers (no key missing or unexpected) with the same weights."""
    from _hf64 import check_directory_round_trip

    cfg = tiny_config("olmo")
    if family == "olmo_untied":
        cfg = dict(cfg, attention_bias=False, tie_word_embeddings=False, num_key_value_heads=4)
    check_directory_round_trip(tmp_path, T.OlmoConfig, T.OlmoForCausalLM, cfg)


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(clip_qkv=-8.0), r"config\['clip_qkv'\]: expected a finite number > 0, got -8.0"),
        (dict(clip_qkv="8"), r"config\['clip_qkv'\]: expected a finite number > 0"),
        (dict(hidden_act="gelu_not"), r"config\['hidden_act'\] = 'gelu_not' is not supported"),
        (dict(attention_bias="true"), r"config\['attention_bias'\]: expected true or false"),
        (dict(num_key_value_heads=3), r"config\['num_key_value_heads'\]: expected a divisor"),
        # keys of other families: OlmoConfig has no eps key, no MLP bias, no qk-norm, no window
        (dict(rms_norm_eps=1e-6), "key 'rms_norm_eps' is not supported"),
        (dict(layer_norm_eps=1e-6), "key 'layer_norm_eps' is not supported"),
        (dict(mlp_bias=True), "key 'mlp_bias' is not supported"),
        (dict(sliding_window=4), "key 'sliding_window' is not supported"),
    ],
)
def test_refusals_name_the_key(bad, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf(tiny_config("olmo", **bad))

"""GLM-4 (``glm4``: GLM-4-9B-0414, GLM-4-32B-0414, GLM-Z1; ``Glm4ForCausalLM``): Llama's attention
with biases on q, k and v only, RoPE on the interleaved pairs ``(2i, 2i + 1)`` of the first
``partial_rotary_factor`` (default 0.5) of each head, plain RMSNorms after both sublayers as well as
before them under GLM's own names (``post_self_attn_layernorm`` after attention,
``post_attention_layernorm`` before the MLP, ``post_mlp_layernorm`` after it), the MLP's gate and up
rows in one ``gate_up_proj``.  The released config read, the defaults, the names both ways, and
against ``Glm4ForCausalLM`` in float64 (logits to 1e-9, every gradient to 1e-8 under a random
upstream gradient, cached decoding, transformers' own directory); the refusals by name.  The
family-wide suites run the tiny entry."""

from __future__ import annotations

import numpy as np
import pytest
from _hf64 import transformers_or_none

from npattn import no_grad
from npattn.models import CausalLM, config_from_hf
from npattn.models.tiny import tiny_config

T = transformers_or_none()
needs_transformers = pytest.mark.skipif(T is None, reason="needs torch and transformers")

_SIZES = dict(vocab_size=61, hidden_size=32, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2)

# THUDM/GLM-4-9B-0414's config.json at a tiny size: its keys as released
_RELEASED = dict(
    architectures=["Glm4ForCausalLM"],
    attention_bias=True,
    attention_dropout=0.0,
    eos_token_id=[151329, 151336, 151338],
    head_dim=8,
    hidden_act="silu",
    hidden_size=32,
    initializer_range=0.02,
    intermediate_size=40,
    max_position_embeddings=32768,
    model_type="glm4",
    num_attention_heads=4,
    num_hidden_layers=2,
    num_key_value_heads=2,
    pad_token_id=0,
    partial_rotary_factor=0.5,
    rms_norm_eps=1e-05,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
    transformers_version="4.52.0.dev0",
    use_cache=True,
    vocab_size=61,
)


def test_the_released_config_reads():
    """Every key of the released config.json is read or known: half of each head of 8 rotating on
    interleaved pairs, biases on q/k/v but not o, the norms after both sublayers, untied."""
    c = config_from_hf(_RELEASED)
    a = c.attention_config("full_attention")
    assert a.rope_interleaved and a.rope and a.scale is None
    assert a.rope_scaling == {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    assert (a.qkv_bias, a.out_bias, c.mlp_bias) == (True, False, False)
    assert (c.head_dim, c.num_key_value_heads, c.tie_word_embeddings, c.rms_norm_eps) == (8, 2, False, 1e-5)
    assert c.sandwich_norm and c.pre_norm and not c.norm_offset and c.embed_scale is False
    assert c.layer_types == ("full_attention",) * 2 and c.mlp_types == ("dense",) * 2


def test_the_defaults_are_transformers_class_defaults():
    """A key left out means Glm4Config's default: heads of 128, half of each rotating, q/k/v
    biases, an untied head, eps 1.5625e-7; a factor in the RoPE dict wins over the one beside it."""
    short = config_from_hf(dict(_SIZES, model_type="glm4", num_hidden_layers=1))
    a = short.attention_config("full_attention")
    assert (short.head_dim, short.tie_word_embeddings, a.qkv_bias, a.out_bias) == (128, False, True, False)
    assert a.rope_scaling == {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    assert short.rms_norm_eps == 1.5625e-07 and short.pad_token_id is None  # 151329: outside a 61-token table
    own = dict(_SIZES, model_type="glm4", num_hidden_layers=1, head_dim=8, partial_rotary_factor=0.75)
    own["rope_parameters"] = {"rope_type": "default", "rope_theta": 50.0, "partial_rotary_factor": 0.25}
    assert config_from_hf(own).attention_config("full_attention").rope_scaling["partial_rotary_factor"] == 0.25
    del own["rope_parameters"]
    assert config_from_hf(own).attention_config("full_attention").rope_scaling["partial_rotary_factor"] == 0.75


@needs_transformers
def test_the_defaults_are_glm4_config_s():
    """Every key of the family's ``_DEFAULTS`` is ``Glm4Config()``'s value (the factor inside its
    RoPE dict), and its to_dict() is the model ``with_defaults`` describes."""
    from npattn.models.configs import with_defaults

    ours, theirs = with_defaults({"model_type": "glm4"}), T.Glm4Config().to_dict()
    assert ours.pop("partial_rotary_factor") == theirs["rope_parameters"]["partial_rotary_factor"]
    for key, value in ours.items():
        assert theirs[key] == value, key
    meta = dict(bos_token_id=None, eos_token_id=None, max_position_embeddings=None)
    assert config_from_hf(theirs).replace(**meta) == config_from_hf({"model_type": "glm4"}).replace(**meta)


def test_the_model_and_its_checkpoints_speak_glm_s_names():
    """The four norms under GLM's names in the model (and so in its state dict and checkpoints);
    Llama's / Gemma's names are what ``generic_name`` gives back; the MLP's halves are one
    ``gate_up_proj`` in a checkpoint (the model keeps them apart)."""
    from npattn.models.hf import checkpoint_key

    m = CausalLM(tiny_config("glm4"), rng=0)
    layer = sorted(k[len("model.layers.0.") :] for k in m.state_dict() if k.startswith("model.layers.0."))
    norms = [k for k in layer if "layernorm" in k]
    assert norms == [
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "post_mlp_layernorm.weight",
        "post_self_attn_layernorm.weight",
    ]
    assert "self_attn.o_proj.bias" not in layer and "self_attn.q_proj.bias" in layer
    cfg = m.config
    generic = {n: cfg.generic_name(f"model.layers.0.{n}") for n in norms}
    assert generic == {
        "input_layernorm.weight": "model.layers.0.input_layernorm.weight",
        "post_self_attn_layernorm.weight": "model.layers.0.post_attention_layernorm.weight",
        "post_attention_layernorm.weight": "model.layers.0.pre_feedforward_layernorm.weight",
        "post_mlp_layernorm.weight": "model.layers.0.post_feedforward_layernorm.weight",
    }
    assert checkpoint_key("model.layers.1.mlp.up_proj.weight", cfg.layout) == "model.layers.1.mlp.gate_up_proj.weight"


def test_each_norm_acts_where_its_name_says():
    """By the state dict's names: with ``post_mlp_layernorm`` zero the MLP and the norm before it
    change nothing; with ``post_attention_layernorm`` (before the MLP) zero the MLP sees zeros, the
    same logits; with ``post_self_attn_layernorm`` zero the attention and ``input_layernorm``
    change nothing, while the MLP still does."""
    cfg = tiny_config("glm4", num_hidden_layers=1)
    base = CausalLM(cfg, rng=0, dtype=np.float64).state_dict()
    ids = np.array([[1, 5, 7, 2, 9, 3]])
    rng = np.random.default_rng(0)

    def logits(**changes):
        m = CausalLM(cfg, dtype=np.float64)
        sd = dict(base)
        for name, value in changes.items():
            key = f"model.layers.0.{name}.weight"
            sd[key] = np.zeros_like(sd[key]) if value == 0 else sd[key] + rng.standard_normal(sd[key].shape)
        m.load_state_dict(sd)
        with no_grad():
            return m(ids)

    def same(a, b):
        np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-13)

    no_mlp = logits(post_mlp_layernorm=0)
    same(logits(post_mlp_layernorm=0, **{"mlp.down_proj": 1, "post_attention_layernorm": 1}), no_mlp)
    same(logits(post_attention_layernorm=0), no_mlp)
    no_attn = logits(post_self_attn_layernorm=0)
    same(logits(post_self_attn_layernorm=0, **{"self_attn.o_proj": 1, "input_layernorm": 1}), no_attn)
    assert np.abs(logits(post_self_attn_layernorm=0, **{"mlp.down_proj": 1}) - no_attn).max() > 1e-3
    assert np.abs(no_mlp - no_attn).max() > 1e-3 and np.abs(logits() - no_mlp).max() > 1e-3


# -- against transformers' Glm4ForCausalLM (float64, eager) --------------------------------------
_CASES = {
    # the tiny entry: heads of 8 (4 rotating), 2 KV heads, q/k/v biases, untied
    "tiny": {},
    # the whole head rotating, one KV head, no biases, a tied head, a pad row
    "whole_tied": dict(
        partial_rotary_factor=1.0, num_key_value_heads=1, attention_bias=False, tie_word_embeddings=True
    ),
    # 6 of 12 features rotating under YaRN's frequencies and attention factor (the factor in the dict)
    "yarn": dict(
        head_dim=12,
        max_position_embeddings=32,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 500.0,
            "factor": 4.0,
            "original_max_position_embeddings": 8,
            "partial_rotary_factor": 0.5,
        },
    ),
    # three quarters of 8 (6 features, 3 pairs) under linear scaling, GQA of 4 over 2
    "linear_three_quarters": dict(
        partial_rotary_factor=0.75, rope_parameters={"rope_type": "linear", "rope_theta": 100.0, "factor": 2.0}
    ),
}


def _hf(name, seed=0):
    from _hf64 import build, state_dict

    kwargs = {k: v for k, v in tiny_config("glm4", **_CASES[name]).items() if k != "model_type"}
    hf, cfg = build(T.Glm4Config, T.Glm4ForCausalLM, seed=seed, **kwargs)
    return hf, cfg, CausalLM.from_hf(state_dict(hf), cfg)


def _split_grads(ref: dict) -> dict:
    """transformers' gradients under npattn's names (``gate_up_proj``'s rows: the gate's, the up's)."""
    out = {}
    for k, g in ref.items():
        if k.endswith("gate_up_proj.weight"):
            p = k[: -len("gate_up_proj.weight")]
            out[p + "gate_proj.weight"], out[p + "up_proj.weight"] = np.split(g, 2)
        else:
            out[k] = g
    return out


@needs_transformers
@pytest.mark.parametrize("name", sorted(_CASES))
@pytest.mark.parametrize("length", [2, 7])
def test_logits_and_every_gradient_match_transformers(name, length):
    from _hf64 import check_logits_and_grads

    hf, cfg, m = _hf(name)
    assert m.dtype == np.float64
    ids = np.random.default_rng(length).integers(0, cfg["vocab_size"], (2, length))
    ids[0, 1] = 0  # the pad row (where there is one) is looked up too
    dlogits = np.random.default_rng(1).standard_normal(ids.shape + (cfg["vocab_size"],))
    check_logits_and_grads(m, hf, ids, dlogits, grads=_split_grads)


@needs_transformers
@pytest.mark.parametrize("name", sorted(_CASES))
def test_cached_decoding_is_transformers_full_pass(name):
    from _hf64 import check_cached_decoding

    hf, cfg, m = _hf(name, seed=2)
    ids = np.random.default_rng(3).integers(0, cfg["vocab_size"], (2, 9))
    check_cached_decoding(m, hf, ids, prompt=3)


@needs_transformers
@pytest.mark.parametrize(
    "short",
    [
        dict(_SIZES, model_type="glm4", num_hidden_layers=2),
        dict(_SIZES, model_type="glm4", num_hidden_layers=1, head_dim=8, attention_bias=False, rope_theta=10.0),
        dict(_SIZES, model_type="glm4", num_hidden_layers=1, head_dim=8, partial_rotary_factor=0.25),
        dict(
            _SIZES,
            model_type="glm4",
            num_hidden_layers=1,
            rope_parameters={"rope_type": "linear", "rope_theta": 50.0, "factor": 2.0},
        ),
    ],
)
def test_short_config_dicts_mean_what_they_mean_to_transformers(short):
    """A dict that leaves keys out (head_dim, the factor, the base, the biases) reads as
    transformers reads it: the same CausalLMConfig as transformers' full to_dict() of it."""
    full = T.AutoConfig.for_model(**short).to_dict()
    meta = dict(bos_token_id=None, eos_token_id=None, max_position_embeddings=None)
    assert config_from_hf(short).replace(**meta) == config_from_hf(full).replace(**meta)


@needs_transformers
def test_a_transformers_directory_loads_with_its_logits_and_gradients(tmp_path):
    """transformers' own save_pretrained directory (float64: its config.json, its fused
    gate_up_proj, GLM's norm names) loads with ``CausalLM.from_pretrained``; the logits and every
    gradient are transformers'."""
    from _hf64 import check_logits_and_grads

    hf, cfg, _ = _hf("tiny", seed=4)
    hf.save_pretrained(tmp_path)
    m = CausalLM.from_pretrained(tmp_path)
    assert m.dtype == np.float64
    ids = np.array([[1, 5, 7, 2, 9, 3], [4, 4, 8, 0, 1, 2]])
    dlogits = np.random.default_rng(5).standard_normal(ids.shape + (cfg["vocab_size"],))
    check_logits_and_grads(m, hf, ids, dlogits, grads=_split_grads)


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(attention_bias="true"), r"config\['attention_bias'\]: expected true or false \(a JSON boolean\)"),
        (dict(head_dim=0), r"config\['head_dim'\]: expected an integer >= 1, got 0"),
        # 10 * 0.5 = 5 features: odd (transformers would turn 6 at the frequencies of a width of 5)
        (dict(head_dim=10, partial_rotary_factor=0.5), r"partial_rotary_factor \(0.5 of 10 features\): expected an"),
        (dict(partial_rotary_factor=1.5), r"partial_rotary_factor'\]: expected a share in \(0, 1\]"),
        (dict(hidden_act="swish_beta"), r"config\['hidden_act'\] = 'swish_beta' is not supported"),
        # Glm4Model masks causally without a window; the MLP and o_proj have no bias switch
        (dict(sliding_window=3), "key 'sliding_window' is not supported"),
        (dict(mlp_bias=True), "key 'mlp_bias' is not supported"),
        # GLM-4-MoE's keys in a dense config
        (dict(n_routed_experts=4), "key 'n_routed_experts' is not supported"),
    ],
)
def test_refusals_name_the_key(bad, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf(tiny_config("glm4", **bad))


def test_the_moe_variant_is_refused_by_name():
    """GLM-4.5's MoE (``glm4_moe``) is not read: its model_type is named."""
    moe = dict(tiny_config("glm4"), model_type="glm4_moe", n_routed_experts=4)
    with pytest.raises(ValueError, match=r"config\['model_type'\]: expected one of \[.*'glm4'.*\], got 'glm4_moe'"):
        config_from_hf(moe)

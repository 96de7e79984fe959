"""Apertus (``apertus``, swiss-ai/Apertus-8B and 70B): Llama's attention with per-head q/k RMSNorms
and biases on q, k, v, o, the norms ``attention_layernorm`` / ``feedforward_layernorm``, and a
non-gated MLP ``down_proj(xielu(up_proj(x)))`` whose xIELU holds two trained parameters
(``act_fn.alpha_p``, ``act_fn.alpha_n``, softplus-parametrised) and two buffers (``act_fn.beta``,
``act_fn.eps``).  The released config read, the defaults, the MLP written out (without torch),
transformers' own directory loaded by ``from_pretrained`` with its logits and every gradient (xIELU's
parameters included) in float64, the checkpoint's names written back, and the refusals by name.
The family-wide suites run the tiny entry and ``tests/test_causal_lm_parity.py`` two cases against
``ApertusForCausalLM``."""

from __future__ import annotations

import numpy as np
import pytest
from _hf64 import transformers_or_none

from npattn import no_grad
from npattn.models import CausalLM, config_from_hf
from npattn.models.tiny import tiny_config

T = transformers_or_none()
needs_transformers = pytest.mark.skipif(T is None, reason="needs torch and transformers")

# swiss-ai/Apertus-8B-2509's config.json at a tiny size: its keys as released (rope_scaling llama3 at
# base 12e6, and mlp_bias, qk_norm, post_norm, hidden_dropout, which ApertusConfig does not define)
_RELEASED = dict(
    architectures=["ApertusForCausalLM"],
    attention_bias=False,
    attention_dropout=0.0,
    bos_token_id=1,
    eos_token_id=68,
    hidden_act="xielu",
    hidden_dropout=0.0,
    hidden_size=32,
    initializer_range=0.02,
    intermediate_size=48,
    max_position_embeddings=65536,
    mlp_bias=False,
    model_type="apertus",
    num_attention_heads=4,
    num_hidden_layers=2,
    num_key_value_heads=2,
    pad_token_id=3,
    post_norm=False,
    qk_norm=True,
    rms_norm_eps=1e-05,
    rope_scaling={
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    rope_theta=12000000,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
    transformers_version="4.56.0.dev0",
    use_cache=True,
    vocab_size=61,
)


def test_the_released_config_reads():
    """Every key of Apertus-8B's config.json is read or known: the plain xIELU MLP, per-head q/k
    norms, Llama 3's RoPE scaling at base 12e6, the checkpoint's norm and activation names."""
    c = config_from_hf(_RELEASED)
    assert c.mlp_types == ("plain",) * 2 and c.hidden_act == "xielu" and c.qk_norm and not c.mlp_bias
    a = c.attention_config("full_attention")
    assert a.rope_scaling["rope_type"] == "llama3" and a.rope_scaling["rope_theta"] == 12000000
    assert (c.head_dim, c.num_key_value_heads, c.rms_norm_eps, c.pad_token_id) == (8, 2, 1e-5, 3)
    names = [n for n in CausalLM(c, rng=0).state_dict() if ".layers.0." in n]
    assert names == [
        f"model.layers.0.{n}"
        for n in (
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
            "self_attn.q_norm.weight",
            "self_attn.k_norm.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
            "mlp.act_fn.alpha_p",
            "mlp.act_fn.alpha_n",
            "mlp.act_fn.beta",
            "mlp.act_fn.eps",
            "attention_layernorm.weight",
            "feedforward_layernorm.weight",
        )
    ]


def test_the_defaults_are_transformers_class_defaults():
    """A key left out means ApertusConfig's default: xielu, Llama 3's scaling (factor 8 over 8192
    positions) at base 12e6, rms_norm_eps 1e-5, pad/bos/eos 3/1/2, no biases, untied; a base given
    beside no RoPE dict replaces 12e6 in that dict."""
    short = config_from_hf(dict(model_type="apertus", vocab_size=61, hidden_size=32, num_attention_heads=4))
    rope = short.attention_config("full_attention").rope_scaling
    assert rope["rope_type"] == "llama3" and (rope["factor"], rope["rope_theta"]) == (8.0, 12000000.0)
    assert rope["original_max_position_embeddings"] == 8192
    assert (short.hidden_act, short.rms_norm_eps, short.pad_token_id, short.eos_token_id) == ("xielu", 1e-5, 3, 2)
    assert (short.head_dim, short.num_key_value_heads, short.intermediate_size) == (8, 4, 14336)
    assert (short.tie_word_embeddings, short.attention_bias, short.mlp_types[0]) == (False, False, "plain")


@needs_transformers
def test_the_defaults_are_apertus_config_s():
    """Every key of the family's ``_DEFAULTS`` is the value of ``ApertusConfig()``'s, and its
    to_dict() is the model ``with_defaults`` describes."""
    from npattn.models.configs import with_defaults

    ours, theirs = with_defaults({"model_type": "apertus"}), T.ApertusConfig().to_dict()
    for key, value in ours.items():
        assert theirs[key] == value, key
    meta = dict(bos_token_id=None, eos_token_id=None, max_position_embeddings=None)
    assert config_from_hf(theirs).replace(**meta) == config_from_hf({"model_type": "apertus"}).replace(**meta)


def test_the_mlp_is_down_of_xielu_of_up():
    """A layer's MLP is ``down(xielu(up(x)))``, xIELU written out from the layer's own raw
    parameters and buffers (a_p = softplus(alpha_p), a_n = beta + softplus(alpha_n)); the buffers
    are not parameters (no gradient), the two raw numbers are."""
    m = CausalLM(tiny_config("apertus"), rng=0, dtype=np.float64)
    pre = "model.layers.1.mlp."
    sd = m.state_dict()
    sd.update({pre + "act_fn.alpha_p": np.array([0.3]), pre + "act_fn.alpha_n": np.array([-0.6])})
    sd.update({pre + "act_fn.beta": np.array(0.4), pre + "act_fn.eps": np.array(-0.2)})
    m.load_state_dict(sd)
    x = np.random.default_rng(1).standard_normal((3, 16)) * 2
    u = x @ sd[pre + "up_proj.weight"].T
    a_p, a_n = np.log1p(np.exp(0.3)), 0.4 + np.log1p(np.exp(-0.6))
    act = np.where(u > 0, a_p * u * u + 0.4 * u, a_n * (np.expm1(np.minimum(u, -0.2)) - u) + 0.4 * u)
    with no_grad():
        got = m.model.layers[1].mlp(x)
    np.testing.assert_allclose(got, act @ sd[pre + "down_proj.weight"].T, rtol=1e-13, atol=1e-13)
    params = dict(m.named_parameters())
    assert pre + "act_fn.alpha_p" in params and pre + "act_fn.beta" not in params


@needs_transformers
@pytest.mark.parametrize("family", ["apertus", "apertus_released"])
def test_a_transformers_directory_loads_with_its_logits_and_gradients(tmp_path, family):
    """transformers' own save_pretrained directory (ApertusForCausalLM in float64, every weight and
    xIELU's buffers drawn at random: the tiny entry's biases and Llama 3 scaling, or the released
    shape) loads with ``CausalLM.from_pretrained``; logits to 1e-9 and every gradient (xIELU's
    alpha_p, alpha_n included) to 1e-8 under a random upstream gradient, the pad token among the
    ids; npattn's save_pretrained is read back by transformers with no key missing, unexpected or
    of another shape (beta and eps 0-d), the same tensors."""
    from _hf64 import check_directory_round_trip

    cfg = tiny_config("apertus")
    if family == "apertus_released":
        cfg = {k: v for k, v in _RELEASED.items() if k not in ("architectures", "torch_dtype", "transformers_version")}
        cfg["rope_scaling"] = dict(cfg["rope_scaling"], original_max_position_embeddings=4)
        cfg["pad_token_id"] = 0
    params = check_directory_round_trip(tmp_path, T.ApertusConfig, T.ApertusForCausalLM, cfg)
    assert np.abs(params["model.layers.0.mlp.act_fn.alpha_n"].grad).max() > 0


@needs_transformers
@pytest.mark.parametrize(
    "short",
    [
        dict(model_type="apertus", vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=1),
        dict(model_type="apertus", vocab_size=61, hidden_size=32, num_hidden_layers=1, rope_theta=1e4),
        dict(model_type="apertus", vocab_size=61, hidden_size=32, num_hidden_layers=1, rope_parameters=None),
    ],
)
def test_short_config_dicts_mean_what_they_mean_to_transformers(short):
    """A dict that leaves keys out (the RoPE dict, its base, the heads) reads as transformers reads
    it: the same CausalLMConfig as transformers' full to_dict() of it."""
    full = T.AutoConfig.for_model(**short).to_dict()
    meta = dict(bos_token_id=None, eos_token_id=None, max_position_embeddings=None)
    assert config_from_hf(short).replace(**meta) == config_from_hf(full).replace(**meta)


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(hidden_act="tanh"), r"config\['hidden_act'\] = 'tanh' is not supported"),
        (dict(mlp_bias=True), r"config\['mlp_bias'\] = True is not supported .* no bias"),
        (dict(qk_norm=False), r"config\['qk_norm'\] = False is not supported .* always normalises"),
        (dict(post_norm=True), r"config\['post_norm'\] = True is not supported"),
        (dict(attention_bias="true"), r"config\['attention_bias'\]: expected true or false"),
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
        (dict(use_qk_norm=True), "key 'use_qk_norm' is not supported"),
        (dict(sliding_window=4), "key 'sliding_window' is not supported"),
    ],
)
def test_refusals_name_the_key(bad, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf(tiny_config("apertus", **bad))


def test_xielu_is_refused_where_the_mlp_is_gated():
    """xIELU's trained parameters have a place in the plain MLP only: a gated (Llama) or routed
    family saying xielu is refused naming hidden_act; Arcee's plain MLP takes it."""
    with pytest.raises(ValueError, match=r"config\['hidden_act'\] = 'xielu' is not supported .*\['dense'\] MLPs"):
        config_from_hf(tiny_config("llama", hidden_act="xielu"))
    assert config_from_hf(tiny_config("arcee", hidden_act="xielu")).hidden_act == "xielu"
    from npattn.nn.moe import GatedMLP

    with pytest.raises(ValueError, match=r"hidden_act: expected one of \[.*\], got 'xielu'"):
        GatedMLP(8, 16, hidden_act="xielu")

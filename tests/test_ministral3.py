"""Ministral 3 (``ministral3``; the text model of the ``mistral3`` checkpoints) and Ministral
(``ministral``, 8B-2410): Mistral's layers, the first with its queries multiplied after RoPE by
``1 + beta log(1 + floor(p / original_max_position_embeddings))`` at position ``p``
(``MultiHeadAttention``'s ``query_scale_by_position``), the second with ``layer_types`` naming each
layer sliding or full.  Without torch: the configs read (defaults, the scale's two numbers), the
attention option through every path (the training forward and its backward and JVP against
central differences, the cached decoding of one query at a time, given positions), the refusals
by name.  Against transformers (the oracle tests marked one by one): the class defaults, cached
decoding and a left-padded batch, ``Mistral3ForConditionalGeneration``'s own directory loaded as
its text model.  ``tests/test_causal_lm_parity.py`` has the logits and every gradient of three
cases against transformers in float64; the family-wide suites run the tiny entries."""

from __future__ import annotations

import numpy as np
import pytest
from _hf64 import transformers_or_none
from _oracles import rel_err

import npattn
from npattn import no_grad
from npattn.models import CausalLM, config_from_hf
from npattn.models.tiny import tiny_config

T = transformers_or_none()
needs_transformers = pytest.mark.skipif(T is None, reason="needs torch and transformers")

_SIZES = dict(vocab_size=61, hidden_size=32, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2)


def _scale(p, beta, length):
    return 1.0 + beta * np.log(1.0 + np.floor(np.asarray(p) / length))


# -- the configs ------------------------------------------------------------------------------------
def test_the_tiny_config_reads_the_scale_beside_yarn():
    """beta comes out of rope_parameters into query_scale_by_position with YaRN's original length;
    the RoPE dict keeps YaRN's keys only; every layer full without a window."""
    c = config_from_hf(tiny_config("ministral3"))
    a = c.attention_config("full_attention")
    assert c.query_scale_by_position == a.query_scale_by_position == (0.5, 2)
    assert "llama_4_scaling_beta" not in a.rope_scaling and a.rope_scaling["rope_type"] == "yarn"
    assert c.layer_types == ("full_attention",) * 2 and c.sliding_window is None and a.window is None
    assert config_from_hf(tiny_config("mistral")).query_scale_by_position is None


def test_the_defaults_are_ministral3_config_s():
    """A dict of sizes only reads Ministral3Config's rope_parameters (YaRN, factor 16 over 16384
    positions, base 1e6, beta 0.1), head_dim 128, no window, eps 1e-5, pad 11."""
    c = config_from_hf(dict(_SIZES, model_type="ministral3", num_hidden_layers=1))
    rope = c.rope["default"]
    assert c.query_scale_by_position == (0.1, 16384)
    assert (rope["rope_type"], rope["factor"], rope["rope_theta"], rope["original_max_position_embeddings"]) == (
        "yarn",
        16.0,
        1e6,
        16384,
    )
    assert (c.head_dim, c.sliding_window, c.rms_norm_eps, c.pad_token_id, c.tie_word_embeddings) == (
        128,
        None,
        1e-5,
        11,
        False,
    )


def test_ministral_reads_its_layer_types():
    """Ministral's layer_types name each layer; by default every layer slides when sliding_window
    is set (MinistralConfig's 4096), none when it is null."""
    c = config_from_hf(tiny_config("ministral"))
    assert c.layer_types == ("sliding_attention", "full_attention") and c.sliding_window == 3
    assert c.attention_config("sliding_attention").window == (2, 0)
    assert c.attention_config("full_attention").window is None and c.query_scale_by_position is None
    short = config_from_hf(dict(_SIZES, model_type="ministral", num_hidden_layers=2))
    assert short.layer_types == ("sliding_attention",) * 2 and short.sliding_window == 4096
    full = config_from_hf(dict(_SIZES, model_type="ministral", num_hidden_layers=2, sliding_window=None))
    assert full.layer_types == ("full_attention",) * 2 and full.sliding_window is None


def _rope(**kw):
    rp = dict(tiny_config("ministral3")["rope_parameters"])
    rp.update(kw)
    return {k: v for k, v in rp.items() if v is not None}


@pytest.mark.parametrize(
    "bad,match",
    [
        (
            dict(rope_parameters=_rope(llama_4_scaling_beta=None)),
            r"config\['rope_parameters'\]\['llama_4_scaling_beta'\]: expected a finite number .* got None",
        ),
        (
            dict(rope_parameters=_rope(llama_4_scaling_beta="0.1")),
            r"\['llama_4_scaling_beta'\]: expected a finite number .* got '0.1'",
        ),
        (
            dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "llama_4_scaling_beta": 0.1}),
            r"config\['rope_parameters'\]\['original_max_position_embeddings'\]: expected an integer >= 1 .* got None",
        ),
        (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), r"\['llama_4_scaling_beta'\]: .* got None"),
        (dict(rope_parameters=_rope(bogus=1.0)), r"'bogus'"),
        (dict(layer_types=["full_attention", "full_attention"]), "key 'layer_types' is not supported"),
        (dict(attention_bias=True), "key 'attention_bias' is not supported"),
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    ],
)
def test_ministral3_refusals_name_the_key(bad, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf(tiny_config("ministral3", **bad))


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(layer_types=["sliding_attention"]), r"config\['layer_types'\]: expected 2 entries"),
        (dict(layer_types=["linear_attention", "full_attention"]), r"'linear_attention' is not supported"),
        (dict(use_sliding_window=True), "key 'use_sliding_window' is not supported"),
    ],
)
def test_ministral_refusals_name_the_key(bad, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf(tiny_config("ministral", **bad))


# -- the attention option ----------------------------------------------------------------------------
def _mha(**kw):
    return npattn.MultiHeadAttention(
        16, 16, 4, num_kv_heads=2, causal=True, rope=True, query_scale_by_position=(0.7, 2), rng=0, **kw
    )


def test_the_scale_is_the_queries_factor_by_position():
    """With rope off and one query per call, the scale multiplies the scores of the query at
    position p by its factor: equal to a module without it whose softmax scale is that factor."""
    x = np.random.default_rng(0).standard_normal((1, 7, 16))
    m = npattn.MultiHeadAttention(16, 16, 2, causal=True, query_scale_by_position=(0.7, 2), rng=0)
    full = m(x)
    for p in range(7):
        plain = npattn.MultiHeadAttention(16, 16, 2, causal=True, scale=float(_scale(p, 0.7, 2)) / np.sqrt(8), rng=0)
        assert rel_err(plain(x)[:, p], full[:, p], floor=1e-300) < 1e-12, p
    assert _scale(6, 0.7, 2) > 1.7 and _scale(1, 0.7, 2) == 1.0


def test_every_path_applies_the_scale():
    """The forward kept for a backward, the cached decoding of a prompt then one query at a time
    (the joint q/k path), and given positions (a padded batch's) give the same numbers; without
    the option they differ."""
    x = np.random.default_rng(1).standard_normal((2, 7, 16))
    m = _mha()
    full = m(x)  # grad enabled: the staged path
    with no_grad():
        steps = [m(x[:, :3], use_cache=True)] + [m(x[:, t : t + 1], use_cache=True) for t in range(3, 7)]
        assert rel_err(np.concatenate(steps, axis=1), full, floor=1e-300) < 1e-12
        m.reset_kv_cache()
        assert rel_err(m(x), full, floor=1e-300) < 1e-12  # the joint path of a whole pass
        m.reset_kv_cache()
        m(x[:, :2], use_cache=True)
        rest = m(x[:, 2:], use_cache=True, positions=np.broadcast_to(np.arange(2, 7), (2, 5)))
    assert rel_err(rest, full[:, 2:], floor=1e-300) < 1e-12
    m.reset_kv_cache()
    other = npattn.MultiHeadAttention(16, 16, 4, num_kv_heads=2, causal=True, rope=True, rng=0)
    assert rel_err(other(x), full, floor=1e-300) > 1e-3


def test_backward_and_jvp_against_central_differences():
    """The scale in the backward and the JVP: npattn.gradcheck (central differences, reverse and
    forward mode) of a module whose positions cross three steps of the scale."""
    m = _mha(dtype=np.float64)
    x = np.random.default_rng(2).standard_normal((2, 6, 16))
    assert npattn.gradcheck(m, x, mode="both").ok


@pytest.mark.parametrize("bad", [(0.1,), (0.1, 0), (0.1, 2.5), (float("nan"), 2), ("0.1", 2), (True, 2), 3])
def test_the_option_is_checked(bad):
    with pytest.raises(ValueError, match=r"query_scale_by_position: expected None or a pair \(beta, length\)"):
        npattn.MultiHeadAttention(16, 16, 4, query_scale_by_position=bad)


# -- against transformers -------------------------------------------------------------------------
@needs_transformers
@pytest.mark.parametrize("family,cls", [("ministral3", "Ministral3Config"), ("ministral", "MinistralConfig")])
def test_the_defaults_are_the_config_class_s(family, cls):
    """Every key of the family's ``_DEFAULTS`` is the value of transformers' config class built
    without arguments, and that class's to_dict() reads as a dict of nothing but the model_type."""
    from npattn.models.configs import with_defaults

    ours, theirs = with_defaults({"model_type": family}), getattr(T, cls)().to_dict()
    for key, value in ours.items():
        assert theirs[key] == value, key
    meta = dict(bos_token_id=None, eos_token_id=None, max_position_embeddings=None)
    assert config_from_hf(theirs).replace(**meta) == config_from_hf({"model_type": family}).replace(**meta)


@needs_transformers
@pytest.mark.parametrize("family", ["ministral3", "ministral"])
def test_cached_decoding_and_a_left_padded_batch_are_transformers(family):
    """Decoding through the cache gives transformers' full pass (the queries' scale at the cache's
    offsets); a left-padded batch gives transformers' logits with generate's positions (the scale
    at each row's own positions), each row its prompt alone, and decoding on after it."""
    from _hf64 import build, check_cached_decoding, check_padded_batch, state_dict

    cfg = tiny_config(family)
    prefix = "Ministral3" if family == "ministral3" else "Ministral"
    kwargs = {k: v for k, v in cfg.items() if k != "model_type"}
    hf, _ = build(getattr(T, f"{prefix}Config"), getattr(T, f"{prefix}ForCausalLM"), **kwargs)
    m = CausalLM.from_hf(state_dict(hf), cfg)
    ids = np.random.default_rng(3).integers(0, cfg["vocab_size"], (2, 9))
    check_cached_decoding(m, hf, ids)
    check_padded_batch(m, hf, cfg["vocab_size"], (8, 5, 2), decode=3)


_PIXTRAL = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=8)


@needs_transformers
@pytest.mark.parametrize("text", ["ministral3", "mistral"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_mistral3_directory_loads_its_text_model(text, tied, tmp_path):
    """``Mistral3ForConditionalGeneration.save_pretrained`` (a Pixtral vision tower and its
    projector beside the text model under ``language_model.*``; the head tied by the top-level
    tie_word_embeddings, whatever the text config says): from_pretrained loads the text model with
    the logits of transformers' multimodal class on text, sets the towers aside by name, and
    refuses a tensor of no known tower and a top-level option by name."""
    from _hf64 import build, hf_logits
    from test_families_round4 import assert_unread_parts_refused

    text_config = dict(tiny_config(text), tie_word_embeddings=not tied)  # the text config's is not applied
    hf, cfg = build(
        T.Mistral3Config,
        T.Mistral3ForConditionalGeneration,
        text_config=text_config,
        vision_config=dict(_PIXTRAL, patch_size=2, head_dim=4),
        spatial_merge_size=1,
        tie_word_embeddings=tied,
    )
    hf.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match=r"multi_modal_projector\.\* \(\d+ tensors\), vision_tower\.\* \("):
        m = CausalLM.from_pretrained(tmp_path)
    assert m.config.model_type == text and (m.lm_head is None) == tied
    ids = np.random.default_rng(5).integers(0, text_config["vocab_size"], (2, 7))
    with no_grad():
        assert rel_err(m(ids), hf_logits(hf, ids), floor=1e-300, relative_to="max_b") < 1e-9
    assert_unread_parts_refused(tmp_path, "audio_tower.w", lambda good: [({"audio_config": {}}, "'audio_config'")])


def test_a_mistral3_config_names_its_text_types():
    """A mistral3 checkpoint holds a ministral3 or a mistral text model; another is refused by
    name; the head follows the top-level tie_word_embeddings (true when absent)."""
    from npattn.models.configs import text_checkpoint

    outer = dict(model_type="mistral3", vision_config={}, image_token_index=10)
    text, _, _ = text_checkpoint(dict(outer, text_config=tiny_config("ministral3")), {})
    assert text["tie_word_embeddings"] is True and text["model_type"] == "ministral3"
    text, _, _ = text_checkpoint(dict(outer, tie_word_embeddings=False, text_config=tiny_config("mistral")), {})
    assert text["tie_word_embeddings"] is False
    with pytest.raises(ValueError, match=r"expected 'ministral3' or 'mistral' in a 'mistral3' checkpoint, got 'llama'"):
        text_checkpoint(dict(outer, text_config=tiny_config("llama")), {})
    with pytest.raises(ValueError, match=r"config\['tie_word_embeddings'\]: expected true or false"):
        text_checkpoint(dict(outer, tie_word_embeddings=None, text_config=tiny_config("mistral")), {})

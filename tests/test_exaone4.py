"""EXAONE 4.0 (``exaone4``): OLMo 2's post-norm layers with per-head QK-norm, sliding-window and
full layers (``layer_types``, or every ``sliding_window_pattern``-th layer full), RoPE on the
sliding layers only where the model has a window ("global NoPE": the 32B) and on every layer where
it has none (the 1.2B), Llama 3's RoPE scaling.  The released configs read, which layers slide and
which rotate (the config and the modules built), the refusals by name, short dicts read as
transformers reads them, transformers' logits and every gradient for both released shapes, cached
decoding and a left-padded batch against transformers, a transformers directory loaded and saved
back.  The family-wide suites run the tiny entry and ``tests/test_causal_lm_parity.py`` two more
cases (cached decoding among them)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from npattn import no_grad
from npattn.models import CausalLM, config_from_hf
from npattn.models.tiny import tiny_config

_SIZES = dict(vocab_size=61, hidden_size=32, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2)
_LLAMA3 = {"factor": 16.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 8192}

# EXAONE-4.0-32B's config.json at a tiny size (8 layers of its 64, a window of 4 of its 4096): its
# keys as released, the string pattern "LLLG" beside the list transformers reads, Llama 3's scaling
_RELEASED_32B = dict(
    architectures=["Exaone4ForCausalLM"],
    attention_dropout=0.0,
    bos_token_id=1,
    eos_token_id=361,
    head_dim=8,
    hidden_act="silu",
    hidden_size=32,
    initializer_range=0.02,
    intermediate_size=40,
    layer_types=["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 3 + ["full_attention"],
    max_position_embeddings=131072,
    model_type="exaone4",
    num_attention_heads=4,
    num_hidden_layers=8,
    num_key_value_heads=1,
    pad_token_id=0,
    rms_norm_eps=1e-05,
    rope_scaling=dict(_LLAMA3, rope_type="llama3"),
    rope_theta=1000000,
    sliding_window=4,
    sliding_window_pattern="LLLG",
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
    transformers_version="4.54.0.dev0",
    use_cache=True,
    vocab_size=61,
)
# EXAONE-4.0-1.2B's (3 layers of its 30): no window and no pattern, every layer full, a tied head
_RELEASED_1_2B = dict(
    _RELEASED_32B,
    layer_types=["full_attention"] * 3,
    max_position_embeddings=65536,
    num_hidden_layers=3,
    sliding_window=None,
    sliding_window_pattern=None,
    tie_word_embeddings=True,
)


def test_the_released_configs_read():
    """Every key of both releases' config.json is read or known: the 32B's three sliding layers
    of every four rotate and its full layers do not; the 1.2B's layers are all full and all
    rotate (no window); both with Llama 3's scaling of factor 16 at a base of 1e6."""
    c = config_from_hf(_RELEASED_32B)
    assert c.layer_types == (("sliding_attention",) * 3 + ("full_attention",)) * 2 and c.sliding_window == 4
    assert c.rope_layers == (True, True, True, False) * 2 and not c.tie_word_embeddings
    assert c.rope["default"] == dict(_LLAMA3, rope_type="llama3", rope_theta=1e6)
    assert (c.pre_norm, c.sandwich_norm, c.qk_norm, c.qk_norm_scope) == (False, True, True, "head")
    c = config_from_hf(_RELEASED_1_2B)
    assert c.layer_types == ("full_attention",) * 3 and c.sliding_window is None and c.rope_layers is None
    assert c.tie_word_embeddings and c.rope["default"]["rope_type"] == "llama3"


def test_which_layers_slide_and_rotate():
    """Exaone4Config's rule without layer_types (every pattern-th layer full, 4 by default, with
    its window of 4096); with a window only the sliding layers rotate, so a model of full layers
    and a window rotates nowhere (as transformers builds it), one without a window everywhere; the
    built attention modules' rope flags and windows follow."""
    short = dict(_SIZES, model_type="exaone4", num_hidden_layers=8)
    c = config_from_hf(short)
    assert c.layer_types == (("sliding_attention",) * 3 + ("full_attention",)) * 2 and c.sliding_window == 4096
    assert c.rope_layers == (True, True, True, False) * 2
    c = config_from_hf(dict(short, sliding_window_pattern=3, sliding_window=5))
    slide = "sliding_attention"
    assert c.layer_types == (slide, slide, "full_attention") * 2 + (slide, slide)
    assert c.rope_layers == (True, True, False) * 2 + (True, True) and c.sliding_window == 5
    c = config_from_hf(dict(short, sliding_window_pattern=1))
    assert c.layer_types == ("full_attention",) * 8 and c.rope_layers == (False,) * 8
    c = config_from_hf(dict(short, layer_types=["full_attention"] * 8))  # the class's window: NoPE everywhere
    assert c.rope_layers == (False,) * 8 and c.sliding_window is None
    c = config_from_hf(dict(short, layer_types=["full_attention"] * 8, sliding_window=None))
    assert c.rope_layers is None
    m = CausalLM(tiny_config("exaone4"), rng=0)
    assert m.config.layer_types == ("sliding_attention", "full_attention") and m.config.rope_layers == (True, False)
    assert [layer.attention.rope for layer in m.model.layers] == [True, False]
    assert [layer.attention.window for layer in m.model.layers] == [(2, 0), None]
    assert not hasattr(m.model.layers[0], "input_layernorm") and m.model.layers[0].attention.q_norm.weight.shape == (8,)


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(layer_types=["sliding_attention"] * 3), r"'layer_types'.*2 entries"),
        (dict(layer_types=["sliding_attention", "chunked_attention"]), r"'layer_types'.*'chunked_attention'"),
        (dict(sliding_window=None, layer_types=["sliding_attention", "full_attention"]), r"'sliding_window'"),
        (dict(sliding_window=None), r"'layer_types'\]: needed where sliding_window is null"),
        (dict(sliding_window_pattern="LG"), r"'sliding_window_pattern'\] = 'LG'.*integer pattern only"),
        (dict(sliding_window_pattern=0), r"'sliding_window_pattern'.*integer >= 1, got 0"),
        (dict(sliding_window=0), r"'sliding_window'.*integer >= 1, got 0"),
        (dict(attention_bias=True), r"key 'attention_bias' is not supported"),
        (dict(qk_norm=False), r"key 'qk_norm' is not supported"),
        (dict(hidden_act="bogus"), r"'hidden_act'"),
        (dict(rope_parameters={"rope_type": "bogus", "rope_theta": 10.0}), "rope"),
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    ],
)
def test_refusals_name_the_key(bad, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf(tiny_config("exaone4", **bad))


# -- against transformers ------------------------------------------------------------------------
from _hf64 import (  # noqa: E402
    build,
    check_cached_decoding,
    check_logits_and_grads,
    check_padded_batch,
    float64_reference,
    state_dict,
    transformers_or_none,
)
from _oracles import rel_err  # noqa: E402

T = transformers_or_none()
needs_transformers = pytest.mark.skipif(T is None, reason="transformers and torch (the oracle)")


def _ids(vocab, shape=(2, 9), seed=0):
    return np.random.default_rng(seed).integers(0, vocab, shape)


def _released(config: dict) -> dict:
    """A released config as transformers' config class takes it (its metadata keys left out)."""
    return {k: v for k, v in config.items() if k not in ("architectures", "model_type", "transformers_version")}


@needs_transformers
@pytest.mark.parametrize("released", [_RELEASED_32B, _RELEASED_1_2B], ids=["32b", "1.2b"])
def test_released_shapes_logits_and_every_gradient_match_transformers(released):
    """Both releases' configs at a tiny size (the 32B's window of 4 inside sequences of 9, its
    NoPE full layers): logits to 1e-9 and every gradient to 1e-8 under a random upstream gradient."""
    hf, cfg = build(T.Exaone4Config, T.Exaone4ForCausalLM, **_released(released))
    m = CausalLM.from_hf(state_dict(hf), dict(released))
    ids = _ids(released["vocab_size"])
    check_logits_and_grads(m, hf, ids, np.random.default_rng(1).standard_normal(ids.shape + (released["vocab_size"],)))


@needs_transformers
def test_cached_decoding_and_a_left_padded_batch_are_transformers():
    """The 32B's shape (its window of 4, its NoPE full layers): decoding through the cache gives
    transformers' full pass; a left-padded batch of rows longer and shorter than the window gives
    transformers' logits with the same mask and generate's positions, each row its prompt alone,
    and decoding on after it each row alone."""
    released = _RELEASED_32B
    hf, _ = build(T.Exaone4Config, T.Exaone4ForCausalLM, **_released(released))
    m = CausalLM.from_hf(state_dict(hf), dict(released))
    check_cached_decoding(m, hf, _ids(released["vocab_size"], seed=3))
    check_padded_batch(m, hf, released["vocab_size"], (9, 5, 2), decode=3)


@needs_transformers
def test_a_transformers_directory_loads_and_saves_back(tmp_path):
    """transformers' save_pretrained of the 32B's shape (its list and "LLLG") -> from_pretrained:
    transformers' logits; save_pretrained -> transformers reads the same layers and logits."""
    import torch

    hf, _ = build(T.Exaone4Config, T.Exaone4ForCausalLM, **_released(_RELEASED_32B))
    hf.save_pretrained(tmp_path / "hf")
    m = CausalLM.from_pretrained(tmp_path / "hf")
    assert m.config.rope_layers == (True, True, True, False) * 2
    ids = _ids(_RELEASED_32B["vocab_size"], seed=2)
    with torch.no_grad(), float64_reference():
        ref = hf(input_ids=torch.from_numpy(ids)).logits.numpy()
    with no_grad():
        mine = m(ids)
    assert rel_err(mine, ref, floor=1e-300, relative_to="max_b") < 1e-9
    m.save_pretrained(tmp_path / "np")
    saved = json.loads((tmp_path / "np" / "config.json").read_text())
    assert saved["layer_types"] == _RELEASED_32B["layer_types"] and saved["sliding_window"] == 4
    back = T.AutoModelForCausalLM.from_pretrained(tmp_path / "np", attn_implementation="eager")
    assert back.config.layer_types == _RELEASED_32B["layer_types"] and back.dtype == torch.float64
    with torch.no_grad(), float64_reference():
        theirs = back.eval()(input_ids=torch.from_numpy(ids)).logits.numpy()
    # (its RoPE frequencies made in float32 by from_pretrained, where build makes float64 ones)
    assert rel_err(theirs, mine, floor=1e-300, relative_to="max_b") < 1e-8


@needs_transformers
@pytest.mark.parametrize(
    "short",
    [
        dict(_SIZES, model_type="exaone4", num_hidden_layers=8),
        dict(_SIZES, model_type="exaone4", num_hidden_layers=6, sliding_window_pattern=3, sliding_window=5),
        dict(_SIZES, model_type="exaone4", num_hidden_layers=3, layer_types=["full_attention"] * 3),
        dict(_SIZES, model_type="exaone4", num_hidden_layers=1, sliding_window=None, layer_types=["full_attention"]),
        dict(_SIZES, model_type="exaone4", num_hidden_layers=2, rope_theta=7.0, head_dim=16, tie_word_embeddings=True),
        dict(_SIZES, model_type="exaone4", num_hidden_layers=4, rope_scaling=dict(_LLAMA3, rope_type="llama3")),
    ],
)
def test_short_config_dicts_mean_what_they_mean_to_transformers(short):
    full = T.AutoConfig.for_model(**short).to_dict()
    meta = dict(bos_token_id=None, eos_token_id=None, max_position_embeddings=None, pad_token_id=None)
    a, b = config_from_hf(short), config_from_hf(full)
    assert a.replace(**meta) == b.replace(**meta)
    assert a.layer_types == tuple(full["layer_types"]) and a.rope == b.rope and a.sliding_window == b.sliding_window

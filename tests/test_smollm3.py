"""SmolLM3 (``smollm3``): Llama's layers of which those with a 0 in ``no_rope_layers`` attend
without RoPE (NoPE; by default every fourth).  Which layers rotate (the list, the interval's
default, the modules built), transformers' logits and every gradient with biases on the attention
(a NoPE layer's ``k_proj.bias`` has a gradient of exactly zero: every key of a row gains the same
``q . b``), a transformers directory with its own list loaded and saved back, short dicts read as
transformers reads them, and the refusals by name.  The family-wide suites run the tiny entry and
``tests/test_causal_lm_parity.py`` two more cases (cached decoding among them)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from npattn import no_grad
from npattn.models import CausalLM, config_from_hf
from npattn.models.tiny import tiny_config

_SIZES = dict(vocab_size=61, hidden_size=32, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2)


# SmolLM3-3B's config.json (HuggingFaceTB/SmolLM3-3B) at a tiny size: its keys as released, the
# older ones (max_window_layers, pretraining_tp, rope_scaling null, no layer_types) among them
_RELEASED = dict(
    architectures=["SmolLM3ForCausalLM"],
    attention_bias=False,
    attention_dropout=0.0,
    bos_token_id=None,
    eos_token_id=2,
    hidden_act="silu",
    hidden_size=32,
    initializer_range=0.02,
    intermediate_size=40,
    max_position_embeddings=64,
    max_window_layers=4,
    mlp_bias=False,
    model_type="smollm3",
    no_rope_layer_interval=4,
    no_rope_layers=[1, 1, 1, 0],
    num_attention_heads=4,
    num_hidden_layers=4,
    num_key_value_heads=2,
    pad_token_id=0,
    pretraining_tp=2,
    rms_norm_eps=1e-06,
    rope_scaling=None,
    rope_theta=5000000.0,
    sliding_window=None,
    tie_word_embeddings=True,
    torch_dtype="bfloat16",
    transformers_version="4.54.0.dev0",
    use_cache=False,
    use_sliding_window=False,
    vocab_size=61,
)


def test_the_released_config_reads():
    """Every key of SmolLM3-3B's config.json is read or known (max_window_layers: a key
    transformers' SmolLM3 never reads): every fourth layer NoPE, all full, tied, RoPE base 5e6."""
    c = config_from_hf(_RELEASED)
    assert c.rope_layers == (True, True, True, False) and c.layer_types == ("full_attention",) * 4
    assert c.tie_word_embeddings and c.rope["default"]["rope_theta"] == 5e6 and c.sliding_window is None


def test_which_layers_rotate():
    """The list as given (1: RoPE, 0: NoPE), else SmolLM3Config's rule (every interval-th layer
    NoPE); the built attention modules' ``rope`` flags follow; with use_sliding_window the NoPE
    layers slide by default."""
    short = dict(_SIZES, model_type="smollm3", num_hidden_layers=8)
    assert config_from_hf(short).rope_layers == (True, True, True, False) * 2
    c = config_from_hf(dict(short, no_rope_layer_interval=3))
    assert c.rope_layers == (True, True, False) * 2 + (True, True)
    c = config_from_hf(dict(short, no_rope_layers=[0, 1, 1, 0, 1, 1, 1, 1], no_rope_layer_interval=2))
    assert c.rope_layers == (False, True, True, False, True, True, True, True)
    m = CausalLM(tiny_config("smollm3"), rng=0)
    assert m.config.rope_layers == (True, False, True, False)
    assert [layer.attention.rope for layer in m.model.layers] == [True, False, True, False]
    assert m.config.layer_types == ("full_attention", "sliding_attention") * 2 and m.config.sliding_window == 3
    assert m.config.tie_word_embeddings  # SmolLM3Config's default, as SmolLM3-3B


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(no_rope_layers=[1, 1, 0]), r"'no_rope_layers'.*4 entries"),
        (dict(no_rope_layers=[1, 1, 0, 1, 1]), r"'no_rope_layers'.*4 entries"),
        (dict(no_rope_layers=[1, 2, 1, 0]), r"'no_rope_layers'.*0 \(NoPE\) or 1 \(RoPE\), got 2"),
        (dict(no_rope_layers=[1, True, 1, 0]), r"'no_rope_layers'.*got True"),
        (dict(no_rope_layers="1110"), r"'no_rope_layers'.*a list"),
        (dict(no_rope_layer_interval=0), r"'no_rope_layer_interval'"),
        (dict(use_sliding_window=False, layer_types=["sliding_attention"] * 4), r"'layer_types'.*use_sliding_window"),
        (dict(sliding_window=None, layer_types=["sliding_attention"] * 4), r"'sliding_window'"),
        (dict(layer_types=["full_attention", "chunked_attention"] * 2), r"'layer_types'.*'chunked_attention'"),
        (dict(rope_scaling={"rope_type": "bogus"}), "rope"),
        (dict(qk_norm=True), r"'qk_norm'"),
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
        (dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}), "partial_rotary_factor"),
    ],
)
def test_refusals_name_the_key(bad, match):
    d = tiny_config("smollm3")
    d.pop("no_rope_layer_interval") if "no_rope_layer_interval" in bad else None
    with pytest.raises(ValueError, match=match):
        config_from_hf(dict(d, **bad))


# -- against transformers ------------------------------------------------------------------------
from _hf64 import (  # noqa: E402
    build,
    check_logits_and_grads,
    float64_reference,
    hf_logits,
    state_dict,
    transformers_or_none,
)
from _oracles import rel_err  # noqa: E402

T = transformers_or_none()
needs_transformers = pytest.mark.skipif(T is None, reason="transformers and torch (the oracle)")


def _ids(vocab, shape=(2, 9), seed=0):
    return np.random.default_rng(seed).integers(0, vocab, shape)


@needs_transformers
def test_biased_attention_logits_and_every_gradient_match_transformers():
    """Biases on q, k, v and o (attention_bias) and the MLP, the list's NoPE layers 0 and 2 (one
    sliding): logits to 1e-9 and every gradient to 1e-8, but the NoPE layers' k_proj.bias, whose
    gradient is zero in exact arithmetic on both sides (rounding only); with RoPE it is not."""
    kw = dict(
        _SIZES,
        num_hidden_layers=4,
        no_rope_layers=[0, 1, 0, 1],
        use_sliding_window=True,
        sliding_window=4,
        attention_bias=True,
        mlp_bias=True,
        pad_token_id=0,
    )
    hf, cfg = build(T.SmolLM3Config, T.SmolLM3ForCausalLM, **kw)
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"] * 2
    m = CausalLM.from_hf(state_dict(hf), cfg)
    ids = _ids(cfg["vocab_size"])
    dlogits = np.random.default_rng(1).standard_normal(ids.shape + (cfg["vocab_size"],))
    nope = ("model.layers.0.self_attn.k_proj.bias", "model.layers.2.self_attn.k_proj.bias")
    names = check_logits_and_grads(m, hf, ids, dlogits, zero=nope)
    scale = max(np.abs(p.grad).max() for p in names.values())
    assert np.abs(names["model.layers.1.self_attn.k_proj.bias"].grad).max() > 1e-6 * scale


@needs_transformers
def test_a_transformers_directory_with_its_list_loads_and_saves_back(tmp_path):
    """transformers' save_pretrained (its config.json with no_rope_layers) -> from_pretrained:
    transformers' logits; save_pretrained -> transformers reads the list and gives the same logits."""
    import torch

    kw = dict(_SIZES, num_hidden_layers=4, no_rope_layers=[1, 0, 0, 1], pad_token_id=0)
    hf, cfg = build(T.SmolLM3Config, T.SmolLM3ForCausalLM, **kw)
    hf.save_pretrained(tmp_path / "hf")
    m = CausalLM.from_pretrained(tmp_path / "hf")
    assert m.config.rope_layers == (True, False, False, True)
    ids = _ids(cfg["vocab_size"], seed=2)
    with torch.no_grad(), float64_reference():
        ref = hf(input_ids=torch.from_numpy(ids)).logits.numpy()
    with no_grad():
        mine = m(ids)
    assert rel_err(mine, ref, floor=1e-300, relative_to="max_b") < 1e-9
    m.save_pretrained(tmp_path / "np")
    assert json.loads((tmp_path / "np" / "config.json").read_text())["no_rope_layers"] == [1, 0, 0, 1]
    back = T.AutoModelForCausalLM.from_pretrained(tmp_path / "np", attn_implementation="eager")
    assert back.config.no_rope_layers == [1, 0, 0, 1] and back.dtype == torch.float64
    with torch.no_grad(), float64_reference():
        theirs = back.eval()(input_ids=torch.from_numpy(ids)).logits.numpy()
    # (its RoPE frequencies made in float32 by from_pretrained, where build makes float64 ones)
    assert rel_err(theirs, mine, floor=1e-300, relative_to="max_b") < 1e-8


@needs_transformers
@pytest.mark.parametrize(
    "short",
    [
        dict(_SIZES, model_type="smollm3", num_hidden_layers=8),
        dict(_SIZES, model_type="smollm3", num_hidden_layers=6, use_sliding_window=True, sliding_window=5),
        dict(_SIZES, model_type="smollm3", num_hidden_layers=4, use_sliding_window=True),  # no window: all full
        dict(_SIZES, model_type="smollm3", num_hidden_layers=4, no_rope_layers=[0, 0, 1, 1], rope_theta=7.0),
        dict(_SIZES, model_type="smollm3", num_hidden_layers=5, no_rope_layer_interval=2, attention_bias=True),
    ],
)
def test_short_config_dicts_mean_what_they_mean_to_transformers(short):
    full = T.AutoConfig.for_model(**short).to_dict()
    meta = dict(bos_token_id=None, eos_token_id=None, max_position_embeddings=None, pad_token_id=None)
    a, b = config_from_hf(short), config_from_hf(full)
    assert a.replace(**meta) == b.replace(**meta)
    assert a.rope_layers == tuple(bool(x) for x in full["no_rope_layers"])
    assert a.layer_types == tuple(full["layer_types"]) and a.rope == b.rope


@needs_transformers
def test_the_released_config_gives_transformers_logits():
    """The released config.json's keys as transformers builds them (its max_window_layers kept as
    an attribute nothing reads): the same logits."""
    hf, cfg = build(T.SmolLM3Config, T.SmolLM3ForCausalLM, **_RELEASED)
    assert cfg["max_window_layers"] == 4
    m = CausalLM.from_hf(state_dict(hf), dict(_RELEASED))
    ids = _ids(_RELEASED["vocab_size"], seed=4)
    ref = hf_logits(hf, ids)
    assert rel_err(m(ids), ref, floor=1e-300, relative_to="max_b") < 1e-9

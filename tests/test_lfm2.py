"""LFM2's reader: the keys only LFM2 has (full_attn_idxs, the MLP's width adjustment, the older
tie_embedding and block_ff_dim, the original implementation's keys of the released config.json
files) read as transformers' Lfm2Config reads them, and every key npattn does not implement
refused by name.  The family-wide suites run its tiny entry (TINY_CONFIGS["lfm2"])."""

from __future__ import annotations

import numpy as np
import pytest

from npattn.models import CausalLM, config_from_hf
from npattn.models.tiny import tiny_config

# the shape of the released LFM2 config.json files (LFM2-350M's keys, tiny sizes): the original
# implementation's keys beside transformers'
RELEASED = dict(
    architectures=["Lfm2ForCausalLM"],
    block_auto_adjust_ff_dim=True,
    block_dim=16,
    block_ff_dim=48,
    block_ffn_dim_multiplier=1.0,
    block_mlp_init_scale=1.0,
    block_multiple_of=8,
    block_norm_eps=1e-05,
    block_out_init_scale=1.0,
    block_use_swiglu=True,
    block_use_xavier_init=True,
    bos_token_id=1,
    conv_L_cache=3,
    conv_bias=False,
    conv_dim=16,
    conv_dim_out=16,
    conv_use_xavier_init=True,
    eos_token_id=7,
    full_attn_idxs=[1, 3],
    hidden_size=16,
    initializer_range=0.02,
    intermediate_size=48,
    max_position_embeddings=128000,
    model_type="lfm2",
    norm_eps=1e-05,
    num_attention_heads=4,
    num_heads=4,
    num_hidden_layers=4,
    num_key_value_heads=2,
    pad_token_id=0,
    rope_theta=1000000.0,
    theta=1000000.0,
    tie_embedding=True,
    torch_dtype="bfloat16",
    transformers_version="4.54.0.dev0",
    use_cache=True,
    use_pos_enc=True,
    vocab_size=41,
)


def _hf(config: dict):
    T = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    kwargs = {k: v for k, v in config.items() if k not in ("model_type", "architectures", "transformers_version")}
    return T.Lfm2Config(**kwargs)


def test_released_config_json_reads_as_transformers_builds_it():
    pytest.importorskip("torch")
    T = pytest.importorskip("transformers")
    from _hf64 import build, hf_logits, state_dict

    cfg = config_from_hf(RELEASED)
    assert cfg.layer_types == ("conv", "full_attention", "conv", "full_attention")
    assert cfg.intermediate_size == 32 and cfg.tie_word_embeddings and cfg.rms_norm_eps == 1e-5
    kwargs = {k: v for k, v in RELEASED.items() if k not in ("model_type", "architectures", "transformers_version")}
    kwargs.pop("torch_dtype")
    hf, d = build(T.Lfm2Config, T.Lfm2ForCausalLM, **kwargs)
    assert tuple(hf.model.layers[0].feed_forward.w1.weight.shape) == (32, 16)
    m = CausalLM.from_hf(state_dict(hf), RELEASED)
    assert m.config.layer_types == cfg.layer_types and m.lm_head is None
    ids = np.random.default_rng(0).integers(0, 41, (2, 6))
    from _oracles import rel_err

    assert rel_err(m(ids), hf_logits(hf, ids), floor=1e-300, relative_to="max_b") < 1e-9


@pytest.mark.parametrize(
    "changes",
    [
        dict(),
        dict(full_attn_idxs=[0]),
        dict(full_attn_idxs=None),
        dict(full_attn_idxs=[2], layer_types=["conv", "full_attention", "conv"]),  # layer_types wins
        dict(block_ff_dim=60, intermediate_size=24),
        dict(tie_embedding=False),
        dict(block_auto_adjust_ff_dim=False),
        dict(block_ffn_dim_multiplier=1.3, block_multiple_of=16),
        dict(head_dim=8),
    ],
)
def test_short_dicts_mean_what_they_mean_to_transformers(changes):
    """Keys left out, the older aliases and the width's rule: the same CausalLMConfig as the
    to_dict() of transformers' config built from the dict, and the MLP's width and the head's
    tying that transformers' model has."""
    T = pytest.importorskip("transformers")
    short = tiny_config("lfm2", num_hidden_layers=3, **changes)
    if "layer_types" not in changes:  # from full_attn_idxs (every layer when it is left out or null)
        del short["layer_types"]
    hf_cfg = _hf(short)
    a, b = config_from_hf(short), config_from_hf(hf_cfg.to_dict())
    meta = dict(bos_token_id=None, eos_token_id=None, max_position_embeddings=None)
    assert a.replace(**meta) == b.replace(**meta)
    assert a.layer_types == tuple(hf_cfg.layer_types)
    model = T.Lfm2ForCausalLM(hf_cfg)
    assert a.intermediate_size == model.model.layers[0].feed_forward.w1.weight.shape[0]
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert a.tie_word_embeddings == tied


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(block_dim=32), r"config\['block_dim'\] = 32 differs from config\['hidden_size'\] = 16"),
        (dict(conv_dim_out=8), "conv_dim_out"),
        (dict(num_heads=2), r"config\['num_heads'\] = 2 differs from config\['num_attention_heads'\]"),
        (dict(block_norm_eps=1e-6), "block_norm_eps"),
        (dict(block_use_swiglu=False), r"config\['block_use_swiglu'\] = False is not supported"),
        (dict(use_pos_enc=False), "use_pos_enc"),
        (dict(theta=10000.0), r"config\['theta'\] = 10000.0 differs from the RoPE base 1000.0"),
        (dict(layer_types=["conv", "sliding_attention"]), "'sliding_attention' is not supported"),
        (dict(layer_types=["conv"]), r"expected 2 entries"),
        (dict(full_attn_idxs="1"), r"config\['full_attn_idxs'\]: expected a list"),
        (dict(hidden_act="gelu"), "key 'hidden_act' is not supported"),
        (dict(attention_bias=True), "key 'attention_bias' is not supported"),
        (dict(sliding_window=4), "key 'sliding_window' is not supported"),
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor = 0.5"),
        (dict(conv_L_cache=0), r"config\['conv_L_cache'\]: expected an integer >= 1"),
        (dict(conv_bias="no"), r"config\['conv_bias'\]: expected true or false"),
        (dict(block_auto_adjust_ff_dim=1), r"config\['block_auto_adjust_ff_dim'\]: expected true or false"),
        (dict(block_multiple_of=0), r"config\['block_multiple_of'\]"),
        (dict(block_ffn_dim_multiplier=None), r"config\['block_ffn_dim_multiplier'\]: expected a finite number"),
        (dict(block_ffn_dim_multiplier=0.0), r"config\['block_ffn_dim_multiplier'\]: expected a finite number"),
        (dict(intermediate_size=1), "the MLP's adjusted width is 0"),
    ],
)
def test_unsupported_or_contradicting_keys_are_refused_by_name(changes, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf(tiny_config("lfm2", **changes))


def test_the_model_speaks_lfm2_names():
    m = CausalLM(tiny_config("lfm2"), rng=0)
    names = list(dict(m.named_parameters()))
    assert "model.embedding_norm.weight" in names and "model.norm.weight" not in names
    layer0 = [n[len("model.layers.0.") :] for n in names if n.startswith("model.layers.0.")]
    layer1 = [n[len("model.layers.1.") :] for n in names if n.startswith("model.layers.1.")]
    assert sorted(layer0) == sorted(
        ["conv.conv.weight", "conv.in_proj.weight", "conv.out_proj.weight", "operator_norm.weight", "ffn_norm.weight"]
        + [f"feed_forward.w{i}.weight" for i in (1, 2, 3)]
    )
    assert {"self_attn.out_proj.weight", "self_attn.q_layernorm.weight", "self_attn.k_layernorm.weight"} <= set(layer1)
    assert m.layers[0].attention.conv_L_cache == 3 and m.layers[0].mlp.intermediate_size == 16


@pytest.mark.parametrize("prompt", [1, 2, 5])
def test_greedy_generate_with_biased_convolutions_equals_transformers(prompt):
    """Cached decoding through the convolutions' kept windows (4 taps, biases): a prompt shorter
    than the window, as long, and longer; transformers' generate runs its own conv cache
    (causal_conv1d_update each step)."""
    torch = pytest.importorskip("torch")
    T = pytest.importorskip("transformers")
    from _hf64 import build, float64_reference, state_dict

    hf, d = build(
        T.Lfm2Config,
        T.Lfm2ForCausalLM,
        vocab_size=61,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["conv", "full_attention", "conv"],
        conv_L_cache=4,
        conv_bias=True,
        block_multiple_of=8,
        eos_token_id=None,
    )
    m = CausalLM.from_hf(state_dict(hf), d)
    ids = np.random.default_rng(prompt).integers(1, 61, (2, prompt))
    with torch.no_grad(), float64_reference():
        ref = hf.generate(
            torch.from_numpy(ids), attention_mask=torch.ones(ids.shape, dtype=torch.long), max_new_tokens=12,
            do_sample=False,
        ).numpy()  # fmt: skip
    out = m.generate(ids, 12)
    np.testing.assert_array_equal(out, ref)
    assert len(set(out[:, prompt:].ravel().tolist())) > 3  # a completion worth comparing
    m.reset_kv_cache()
    m(ids, use_cache=True)  # each conv layer keeps its last 3 inputs, zeros before the prompt
    assert all(layer.attention.conv_state.shape == (2, 3, 32) for layer in m.layers[::2])
    assert not m.layers[0].attention.conv_state[:, : max(0, 3 - prompt)].any()


def test_padded_batch_with_convolution_biases_is_transformers_s():
    """With conv_bias, a padded step's input is zero but its projections are the biases, whose
    products transformers convolves into the next tokens (Lfm2ShortConv masks the input before
    in_proj): a padded row's logits are then transformers' for that batch, not the row's alone.
    npattn follows transformers (the released models have no biases, where both agree)."""
    torch = pytest.importorskip("torch")
    T = pytest.importorskip("transformers")
    from _hf64 import build, hf_logits, state_dict
    from _oracles import rel_err

    from npattn import no_grad

    hf, d = build(
        T.Lfm2Config, T.Lfm2ForCausalLM, vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, layer_types=["conv", "full_attention", "conv"], conv_L_cache=4,
        conv_bias=True, block_multiple_of=8,
    )  # fmt: skip
    m = CausalLM.from_hf(state_dict(hf), d)
    ids = np.random.default_rng(0).integers(0, 61, (2, 7))
    mask = np.array([[0, 0, 0, 1, 1, 1, 1], [1] * 7])
    pos = np.where(mask == 1, np.cumsum(mask, 1) - 1, 0)
    ref = hf_logits(hf, ids, attention_mask=torch.from_numpy(mask), position_ids=torch.from_numpy(pos))
    with no_grad():
        out, alone = m(ids, attention_mask=mask), m(ids[:1, 3:])
    real = mask.astype(bool)
    assert rel_err(out[real], ref[real], floor=1e-300, relative_to="max_b") < 1e-10
    assert rel_err(out[0, 3:], alone[0], floor=1e-300, relative_to="max_b") > 1e-3

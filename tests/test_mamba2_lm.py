"""Mamba-2 (``mamba2``: Mamba-Codestral-7B, state-spaces/mamba2-130m to 2.7b in transformers'
format): blocks ``x + mixer(norm(x))`` of a Mamba-2 mixer alone (layer kind ``"linear_attention"``,
MLP kind ``"none"``), ``norm_f``, the head tied or not.

* the config reader: every Mamba2Config key read, metadata or refused by name;
* against transformers' own ``Mamba2ForCausalLM`` in float64 (its torch path, sequences longer
  than one chunk): logits to 1e-9 and every parameter's gradient to 1e-8 under a random upstream
  gradient, cached decoding, a left-padded batch, greedy generate, the directory both ways.  The
  family-wide suites run the tiny entry.
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

# a config as transformers 4.44's Mamba2Config.to_dict wrote it, at mamba2-130m's sizes (24 blocks of
# 24 heads of 64, one group, a tied head), with 4.44's keys that transformers 5 reads nowhere
RELEASED_130M = dict(
    model_type="mamba2", architectures=["Mamba2ForCausalLM"], vocab_size=50288, hidden_size=768,
    num_hidden_layers=24, num_heads=24, head_dim=64, state_size=128, expand=2, n_groups=1, conv_kernel=4,
    chunk_size=256, use_bias=False, use_conv_bias=True, hidden_act="silu", layer_norm_epsilon=1e-5,
    residual_in_fp32=True, rescale_prenorm_residual=False, time_step_rank=48, time_step_min=0.001,
    time_step_max=0.1, time_step_floor=1e-4, time_step_limit=[0.0, {"__float__": "Infinity"}],
    initializer_range=0.1, tie_word_embeddings=True, use_cache=True, pad_token_id=0, bos_token_id=0,
    eos_token_id=0, torch_dtype="float32", transformers_version="4.44.0", rms_norm=True, norm_before_gate=False,
    time_step_init_scheme="random", time_step_scale=1.0,
)  # fmt: skip


def test_the_tiny_entry_and_a_released_config():
    cfg = config_from_hf(tiny_config("mamba2"))
    assert cfg.layer_types == ("linear_attention",) * 2 and cfg.mlp_types == ("none",) * 2
    assert cfg.rms_norm_eps == 1e-5 and not cfg.pad_embedding_row and not cfg.tie_word_embeddings
    m = cfg.linear_attention
    assert (m.num_heads, m.head_dim, m.n_groups, m.state_size, m.conv_kernel, m.chunk_size) == (4, 8, 2, 4, 3, 4)
    assert m.conv_bias and not m.proj_bias and m.gated_norm == "gate_first" and m.rms_norm_eps == 1e-5
    assert m.time_step_limit == (0.0, math.inf)
    big = config_from_hf(RELEASED_130M)
    assert big.tie_word_embeddings and big.num_hidden_layers == 24
    b = big.linear_attention
    assert (b.num_heads, b.head_dim, b.n_groups, b.state_size, b.chunk_size) == (24, 64, 1, 128, 256)
    # Mamba2Config's class defaults (Mamba-Codestral-7B's sizes) for the keys left out
    d = config_from_hf(dict(model_type="mamba2", vocab_size=41, num_hidden_layers=1))
    c = d.linear_attention
    assert (d.hidden_size, c.num_heads, c.head_dim, c.n_groups, c.state_size, c.conv_kernel) == (
        4096,
        128,
        64,
        8,
        128,
        4,
    )
    assert c.conv_bias and not c.proj_bias and c.chunk_size == 256 and not d.tie_word_embeddings


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (dict(head_dim=6), r"config\['head_dim'\]: expected expand \* hidden_size / num_heads = 8"),
        (dict(expand=3), r"config\['head_dim'\]: expected expand \* hidden_size / num_heads = 12"),
        (dict(n_groups=3), r"config\['n_groups'\]: expected a divisor of num_heads = 4, got 3"),
        (dict(hidden_act="gelu"), r"config\['hidden_act'\] = 'gelu' is not supported"),
        (dict(time_step_limit=[1.0, 0.5]), r"config\['time_step_limit'\]: expected two numbers"),
        (dict(use_conv_bias="yes"), r"config\['use_conv_bias'\]: expected true or false"),
        (dict(use_bias=1), r"config\['use_bias'\]: expected true or false"),
        (dict(residual_in_fp32="no"), r"config\['residual_in_fp32'\]: expected true or false"),
        (dict(state_size=0), r"config\['state_size'\]: expected an integer >= 1"),
        (dict(num_heads=None), r"needs the key .num_heads., which is missing"),
        (dict(num_attention_heads=4), r"key 'num_attention_heads' is not supported by npattn for model_type 'mamba2'"),
        (dict(rms_norm_eps=1e-6), r"key 'rms_norm_eps' is not supported"),
        (dict(d_model=16), r"key 'd_model' is not supported"),
        (dict(rms_norm=False), r"config\['rms_norm'\] = False is not supported .*always applies its gated RMSNorm"),
        (dict(norm_before_gate=True), r"config\['norm_before_gate'\] = True is not supported .*gates before"),
    ],
)
def test_refusals_name_the_key(bad, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf(tiny_config("mamba2", **bad))


def test_save_pretrained_writes_the_backbone_names(tmp_path):
    """The released checkpoints' names (transformers reads the directory back in
    tests/test_save_pretrained.py, as every family's); a tied head is not written."""
    from safetensors.numpy import load_file

    m = CausalLM(tiny_config("mamba2", tie_word_embeddings=True), rng=0)
    assert m.lm_head is None  # the head is the embedding
    m.save_pretrained(tmp_path)
    keys = set(load_file(tmp_path / "model.safetensors"))
    assert "backbone.embeddings.weight" in keys and "backbone.norm_f.weight" in keys
    assert "backbone.layers.1.mixer.norm.weight" in keys and "backbone.layers.0.norm.weight" in keys
    assert "lm_head.weight" not in keys and not any(k.startswith("model.") for k in keys)
    ids = np.random.default_rng(5).integers(0, 41, (1, 6))
    np.testing.assert_allclose(CausalLM.from_pretrained(tmp_path)(ids), m(ids), rtol=1e-12, atol=1e-12)


def test_the_embedding_s_older_name_is_read(tmp_path):
    """``backbone.embedding.weight`` (Mamba2Model.load_hook's older name) reads as
    ``backbone.embeddings.weight``; npattn writes the newer one; both at once are refused by name."""
    from safetensors.numpy import load_file, save_file

    m = CausalLM(tiny_config("mamba2"), rng=0)
    m.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["backbone.embedding.weight"] = tensors.pop("backbone.embeddings.weight")
    save_file(tensors, tmp_path / "model.safetensors")
    back = CausalLM.from_pretrained(tmp_path)
    ids = np.random.default_rng(5).integers(0, 41, (1, 6))
    np.testing.assert_array_equal(back(ids), m(ids))
    back.save_pretrained(tmp_path / "again")
    assert "backbone.embeddings.weight" in load_file(tmp_path / "again" / "model.safetensors")
    tensors["backbone.embeddings.weight"] = tensors["backbone.embedding.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"'backbone.embeddings?.weight' and 'backbone.embeddings?.weight' are the same"
    ):
        CausalLM.from_pretrained(tmp_path)


# the tiny entry (a conv bias, no projection biases, two groups) and one with every other option:
# in_proj/out_proj biases, no conv bias, four groups, a clipped step, a tied head, chunks of 3
CASES = {
    "tiny": None,
    "options": dict(
        tiny_config("mamba2"),
        use_bias=True,
        use_conv_bias=False,
        n_groups=4,
        time_step_limit=[0.3, 0.9],
        tie_word_embeddings=True,
        chunk_size=3,
        num_hidden_layers=3,
    ),  # fmt: skip
}


def _model_names(grads: dict) -> dict:
    """transformers' names (its in-memory ``backbone.*``) as npattn's model names them (``model.*``)."""
    return {k.replace("backbone.", "model.", 1): v for k, v in grads.items()}


def _case(name):
    from _hf64 import build

    kwargs = CASES[name] or tiny_config("mamba2")
    kwargs = {k: v for k, v in kwargs.items() if k != "model_type"}
    return build(T.Mamba2Config, T.Mamba2ForCausalLM, **kwargs)


@oracle
@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_and_every_gradient_match_transformers(name):
    from _hf64 import check_logits_and_grads, state_dict

    hf, cfg = _case(name)
    m = CausalLM.from_hf(state_dict(hf), cfg)
    assert (m.lm_head is None) == cfg["tie_word_embeddings"]
    ids = np.random.default_rng(0).integers(0, cfg["vocab_size"], (2, 11))  # longer than a chunk (3 or 4)
    ids[:, 2] = cfg["pad_token_id"]  # its embedding row has a gradient (no padding_idx in transformers)
    dlogits = np.random.default_rng(1).standard_normal(ids.shape + (cfg["vocab_size"],))
    params = check_logits_and_grads(m, hf, ids, dlogits, grads=_model_names)
    assert any(".mixer.D" in n for n in params) and any(".mixer.norm.weight" in n for n in params)


@oracle
@pytest.mark.parametrize("name", sorted(CASES))
def test_cached_decoding_and_a_padded_batch_are_transformers(name):
    from _hf64 import check_cached_decoding, check_padded_batch, state_dict

    hf, cfg = _case(name)
    m = CausalLM.from_hf(state_dict(hf), cfg)
    check_cached_decoding(m, hf, np.random.default_rng(3).integers(0, cfg["vocab_size"], (2, 11)), prompt=5)
    if not cfg["use_bias"]:  # in_proj's bias at a padded step (zero input) would reach the convolution
        check_padded_batch(m, hf, cfg["vocab_size"], [9, 4], decode=2)


@oracle
def test_the_directory_both_ways(tmp_path):
    from _hf64 import check_directory_round_trip

    cfg = {k: v for k, v in CASES["options"].items()}
    check_directory_round_trip(tmp_path, T.Mamba2Config, T.Mamba2ForCausalLM, cfg, grads=_model_names)

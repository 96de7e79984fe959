"""Falcon-H1 (``falcon_h1``: tiiuae/Falcon-H1-0.5B/1.5B/1.5B-Deep/3B/7B/34B, Falcon-H1R): every layer
attention and a Mamba-2 mixer side by side (``ParallelSum``), the muP factors.

* the config reader: a released config.json's keys (Falcon-H1-0.5B's at a tiny size) read into
  the hybrid layers, their factors and the mixer's options; ``mamba_d_ssm`` null, the norm's three
  placements; every refusal by name; short dicts as transformers reads them;
* ``ParallelSum``: its formula, ``gradcheck`` (backward and JVP) and ``gradgradcheck`` with each
  branch's factors, its keyword arguments by branch, bad arguments;
* against transformers' own ``FalconH1ForCausalLM`` in float64 (three layouts: no norm as the 0.5B,
  the norm after the gate with both projections' biases and a tied head, the tiny entry's norm
  before the gate): logits to 1e-9 and every parameter's gradient to 1e-8 under a random upstream
  gradient, cached decoding and a left-padded batch.  The family-wide suites run the tiny entry.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from _hf64 import transformers_or_none

import npattn
from npattn.models import CausalLM, config_from_hf
from npattn.nn import ParallelSum

T = transformers_or_none()
oracle = pytest.mark.skipif(T is None, reason="needs torch and transformers")

# Falcon-H1-0.5B-Instruct's config.json keys at a tiny size (its muP factors, no norm in the mixer)
_RELEASED = dict(
    architectures=["FalconH1ForCausalLM"],
    attention_bias=False,
    attention_dropout=0.0,
    attention_in_multiplier=1.0,
    attention_out_multiplier=0.9375,
    attn_layer_indices=None,
    bos_token_id=1,
    embedding_multiplier=5.656854249492381,
    eos_token_id=11,
    head_dim=8,
    hidden_act="silu",
    hidden_size=16,
    initializer_range=0.02,
    intermediate_size=32,
    key_multiplier=0.390625,
    lm_head_multiplier=0.0390625,
    mamba_chunk_size=128,
    mamba_conv_bias=True,
    mamba_d_conv=4,
    mamba_d_head=8,
    mamba_d_ssm=24,
    mamba_d_state=8,
    mamba_expand=2,
    mamba_n_groups=1,
    mamba_n_heads=3,
    mamba_norm_before_gate=False,
    mamba_proj_bias=False,
    mamba_rms_norm=False,
    mamba_use_mlp=True,
    max_position_embeddings=16384,
    mlp_bias=False,
    mlp_expansion_factor=8,
    mlp_multipliers=[0.8838834764831844, 0.5859375],
    model_type="falcon_h1",
    num_attention_heads=4,
    num_hidden_layers=3,
    num_key_value_heads=2,
    num_logits_to_keep=1,
    pad_token_id=0,
    projectors_bias=False,
    rms_norm_eps=1e-05,
    rope_scaling=None,
    rope_theta=100000000000.0,
    ssm_in_multiplier=1.25,
    ssm_multipliers=[0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738],
    ssm_out_multiplier=0.23570226039551587,
    tie_word_embeddings=False,
    time_step_floor=0.0001,
    time_step_max=0.1,
    time_step_min=0.001,
    time_step_rank="auto",
    torch_dtype="bfloat16",
    transformers_version="4.52.0.dev0",
    use_cache=True,
    vocab_size=61,
)


def test_the_released_config_reads():
    """Every key read (or known as metadata): the hybrid layers, the factors where npattn applies
    them, the mixer's sizes and options, the checkpoint's names."""
    c = config_from_hf(_RELEASED)
    assert c.layer_types == ("hybrid",) * 3 and c.mlp_types == ("dense",) * 3
    assert c.hybrid_multipliers == (1.0, 0.9375, 1.25, 0.23570226039551587)
    assert c.mlp_multipliers == (0.8838834764831844, 0.5859375)
    assert c.embed_scale == 5.656854249492381
    assert c.logits_scaling == 1 / 0.0390625
    assert math.isclose(c.attention_scale, 0.390625 / math.sqrt(8), rel_tol=1e-15)
    assert c.rope["default"]["rope_theta"] == 1e11 and c.head_dim == 8
    m = c.linear_attention
    assert (m.num_heads, m.head_dim, m.state_size, m.n_groups, m.conv_kernel, m.chunk_size) == (3, 8, 8, 1, 4, 128)
    assert (m.gated_norm, m.proj_bias, m.out_proj_bias, m.conv_bias) == (None, False, False, True)
    assert m.proj_multipliers == tuple(_RELEASED["ssm_multipliers"])
    assert m.time_step_limit == (0.0, math.inf)
    names = dict(CausalLM(c, rng=0).named_parameters())
    layer = {n.split(".", 3)[3] for n in names if n.startswith("model.layers.0.")}
    assert {"mamba.in_proj.weight", "mamba.out_proj.weight", "self_attn.q_proj.weight"} <= layer
    assert {"feed_forward.gate_proj.weight", "input_layernorm.weight", "pre_ff_layernorm.weight"} <= layer
    assert "mamba.norm.weight" not in layer and "model.final_layernorm.weight" in names


@pytest.mark.parametrize(
    ("changes", "want"),
    [
        (dict(mamba_rms_norm=True, mamba_norm_before_gate=True), "norm_first"),
        (dict(mamba_rms_norm=True, mamba_norm_before_gate=False), "gate_first"),
        (dict(mamba_rms_norm=True), "norm_first"),  # FalconH1Config's default: the norm before the gate
        (dict(mamba_rms_norm=False, mamba_norm_before_gate=True), None),
    ],
)
def test_the_norm_placements(changes, want):
    c = {k: v for k, v in _RELEASED.items() if k != "mamba_norm_before_gate"} if len(changes) == 1 else _RELEASED
    assert config_from_hf(dict(c, **changes)).linear_attention.gated_norm == want


def test_inner_width_head_width_and_factors_of_one():
    """``mamba_d_ssm`` null: ``mamba_expand * hidden_size`` (and ``mamba_d_head`` "auto" divides
    it); ``ssm_multipliers`` null or all ones: no factors; projectors_bias: out_proj's alone."""
    c = config_from_hf(dict(_RELEASED, mamba_d_ssm=None, mamba_expand=2, mamba_n_heads=4, mamba_d_head="auto"))
    assert (c.linear_attention.num_heads, c.linear_attention.head_dim) == (4, 8)
    for v in (None, [1.0] * 5):
        assert config_from_hf(dict(_RELEASED, ssm_multipliers=v)).linear_attention.proj_multipliers is None
    c = config_from_hf(dict(_RELEASED, mlp_multipliers=None, projectors_bias=True))
    assert c.mlp_multipliers == (1.0, 1.0)
    assert (c.linear_attention.proj_bias, c.linear_attention.out_proj_bias) == (False, True)


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (dict(mamba_use_mlp=False), r"config\['mamba_use_mlp'\]"),
        (dict(attn_layer_indices=[0, 2]), r"config\['attn_layer_indices'\]"),
        (dict(mlp_multipliers=[1.0]), r"config\['mlp_multipliers'\]"),
        (dict(mlp_multipliers=[1.0, -0.5]), r"config\['mlp_multipliers'\]"),
        (dict(ssm_multipliers=[1.0] * 4), r"config\['ssm_multipliers'\]"),
        (dict(ssm_multipliers=[1.0, 1.0, True, 1.0, 1.0]), r"config\['ssm_multipliers'\]"),
        (dict(key_multiplier=0.0), r"config\['key_multiplier'\]"),
        (dict(lm_head_multiplier=-1.0), r"config\['lm_head_multiplier'\]"),
        (dict(ssm_out_multiplier="x"), r"config\['ssm_out_multiplier'\]"),
        (dict(attention_in_multiplier=math.inf), r"config\['attention_in_multiplier'\]"),
        (dict(mamba_d_head=7), r"config\['mamba_d_head'\].*mamba_d_ssm / mamba_n_heads"),
        (dict(mamba_d_ssm=None, mamba_d_head="auto", mamba_n_heads=5), r"config\['mamba_n_heads'\].*mamba_expand"),
        (dict(mamba_n_groups=2), r"config\['mamba_n_groups'\]"),
        (dict(mamba_rms_norm="yes"), r"config\['mamba_rms_norm'\]"),
        (dict(hidden_act="gelu"), r"config\['hidden_act'\].*'falcon_h1'"),
        (dict(time_step_limit=[1.0, 0.5]), r"config\['time_step_limit'\]"),
        (dict(sliding_window=8), r"key 'sliding_window'"),
    ],
)
def test_refusals_name_the_key(bad, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf(dict(_RELEASED, **bad))


@oracle
@pytest.mark.parametrize(
    "short",
    [
        dict(model_type="falcon_h1", vocab_size=61, hidden_size=16, intermediate_size=24, num_attention_heads=4,
             num_key_value_heads=2, num_hidden_layers=2, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_state=8),
        dict(model_type="falcon_h1", vocab_size=61, hidden_size=16, intermediate_size=24, num_attention_heads=2,
             num_key_value_heads=None, num_hidden_layers=1, mamba_d_ssm=None, mamba_n_heads=8, mamba_rms_norm=True),
    ],
)  # fmt: skip
def test_short_config_dicts_mean_what_they_mean_to_transformers(short):
    """Keys left out (the multipliers' ones, ``mamba_d_head`` "auto", the norm's placement, the
    taps, the biases, ``time_step_limit``) read as transformers reads them."""
    full = T.AutoConfig.for_model(**short).to_dict()
    meta = dict(bos_token_id=None, eos_token_id=None, max_position_embeddings=None)
    assert config_from_hf(short).replace(**meta) == config_from_hf(full).replace(**meta)


# -- ParallelSum -------------------------------------------------------------------------------
def _parallel(seed=0):
    """A Mamba-2 mixer and an attention with RoPE side by side, every factor away from 1."""
    mamba = npattn.Mamba2Mixer(8, num_heads=2, head_dim=4, state_size=3, n_groups=1, conv_kernel=3, rng=seed)
    attn = npattn.MultiHeadAttention(8, 8, num_heads=2, causal=True, rope=True, rng=seed + 1)
    return ParallelSum(
        {"mamba": mamba, "self_attn": attn},
        input_multipliers={"mamba": 1.3, "self_attn": 0.8},
        output_multipliers={"mamba": 0.6, "self_attn": 1.7},
    )


def test_parallel_sum_formula_gradients_and_second_order():
    """``sum_k out_k m_k(in_k x)``; gradcheck (backward, JVP) and gradgradcheck along the input and
    every parameter, a left-padded row reaching each branch in its own form."""
    par = _parallel()
    x = np.random.default_rng(2).standard_normal((2, 5, 8))
    y = par(x)
    par.clear_saved()
    want = 0.6 * par.mamba(1.3 * x) + 1.7 * par.self_attn(0.8 * x)
    np.testing.assert_allclose(y, want, rtol=1e-13, atol=1e-13)
    par.mamba.clear_saved(), par.self_attn.clear_saved()
    mask = np.array([[1] * 5, [0, 0, 1, 1, 1]], bool)
    kw = {"mamba": {"attention_mask": mask}, "self_attn": {"key_padding_mask": ~mask}}
    report = npattn.gradcheck(par, x, mode="both", branch_kwargs=kw)
    assert report.ok, report
    assert {"mamba.A_log", "self_attn.W_query.weight"} <= {r.name for r in report.rows}
    second = npattn.gradgradcheck(par, x, branch_kwargs=kw)
    assert second.ok, second


def test_parallel_sum_decodes_each_branch_and_resets():
    par = _parallel()
    x = np.random.default_rng(3).standard_normal((1, 6, 8))
    full = par(x)
    par.reset_kv_cache()
    parts = [par(x[:, :4], use_cache=True), par(x[:, 4:], use_cache=True)]
    np.testing.assert_allclose(np.concatenate(parts, axis=1), full, rtol=1e-12, atol=1e-12)
    par.reset_kv_cache()
    assert par.mamba.kv_cache_length == 0
    assert "input_multipliers={'mamba': 1.3" in repr(par)


def test_parallel_sum_bad_arguments():
    lin = npattn.Linear(4, 4, rng=0)
    for args, kw, match in (
        ({}, {}, "at least one branch"),
        ({"a.b": lin}, {}, "without dots"),
        ({"a": lin}, dict(input_multipliers={"b": 2.0}), "input_multipliers: 'b' is no branch"),
        ({"a": lin}, dict(output_multipliers={"a": math.nan}), r"output_multipliers\['a'\]"),
        ({"a": lin}, dict(output_multipliers={"a": True}), r"output_multipliers\['a'\]"),
    ):
        with pytest.raises(ValueError, match=match):
            ParallelSum(args, **kw)
    with pytest.raises(TypeError, match=r"ParallelSum\['a'\]"):
        ParallelSum({"a": 3})
    par = ParallelSum({"a": lin})
    with pytest.raises(ValueError, match="branch_kwargs: 'b' is no branch"):
        par(np.ones((2, 4)), branch_kwargs={"b": {}})
    par(np.ones((2, 4)))
    with pytest.raises(TypeError, match="at most one input tangent"):
        par.jvp(np.ones((2, 4)), np.ones((2, 4)))
    with pytest.raises(TypeError, match="at most one input tangent"):
        par.backward_jvp(np.ones((2, 4)), np.ones((2, 4)), np.ones((2, 4)))
    par.reset_kv_cache()  # a branch without a cache is left alone
    assert repr(par).startswith("ParallelSum(")


# -- against transformers ----------------------------------------------------------------------
_SIZES = dict(vocab_size=61, hidden_size=16, intermediate_size=20, num_attention_heads=4, num_key_value_heads=2,
              head_dim=6, num_hidden_layers=2, mamba_d_ssm=24, mamba_n_heads=4, mamba_d_head=6, mamba_n_groups=2,
              mamba_d_state=4, mamba_d_conv=3, mamba_chunk_size=4, rope_theta=500.0)  # fmt: skip
_FACTORS = {k: v for k, v in _RELEASED.items() if k.endswith(("multiplier", "multipliers"))}
CASES = {
    # Falcon-H1-0.5B's layout: no norm in the mixer, its muP factors
    "no_norm": dict(_SIZES, **_FACTORS, mamba_rms_norm=False),
    # the 1.5B-Deep's norm after the gate; every bias (the attention's, in_proj's, out_proj's), tied,
    # the factors away from the released ones
    "gate_first_biases_tied": dict(
        _SIZES, mamba_rms_norm=True, mamba_norm_before_gate=False, attention_bias=True, mamba_proj_bias=True,
        projectors_bias=True, mamba_conv_bias=False, tie_word_embeddings=True, embedding_multiplier=0.7,
        lm_head_multiplier=1.9, key_multiplier=1.6, attention_in_multiplier=0.75, attention_out_multiplier=1.4,
        ssm_in_multiplier=0.5, ssm_out_multiplier=2.0, mlp_multipliers=[1.5, 0.45],
        ssm_multipliers=[1.1, 0.6, 0.9, 1.4, 0.7],
    ),
}  # fmt: skip


def _case(name):
    from _hf64 import build

    from npattn.models.tiny import tiny_config

    kwargs = CASES[name] if name in CASES else {k: v for k, v in tiny_config("falcon_h1").items() if k != "model_type"}
    return build(T.FalconH1Config, T.FalconH1ForCausalLM, **kwargs)


@oracle
@pytest.mark.parametrize("name", [*sorted(CASES), "tiny"])
def test_logits_and_every_gradient_match_transformers(name):
    from _hf64 import check_logits_and_grads, state_dict

    hf, cfg = _case(name)
    m = CausalLM.from_hf(state_dict(hf), cfg)
    ids = np.random.default_rng(0).integers(0, cfg["vocab_size"], (2, 9))
    dlogits = np.random.default_rng(1).standard_normal(ids.shape + (cfg["vocab_size"],))
    params = check_logits_and_grads(m, hf, ids, dlogits)
    assert any(".mamba.A_log" in n for n in params) and any(".self_attn.k_proj" in n for n in params)


@oracle
@pytest.mark.parametrize("name", [*sorted(CASES), "tiny"])
def test_cached_decoding_and_a_padded_batch_are_transformers(name):
    """Decoding through both branches' caches gives transformers' full pass; a left-padded batch
    gives transformers' logits (without in_proj's bias, which transformers convolves from the
    padding into the first tokens)."""
    from _hf64 import check_cached_decoding, check_padded_batch, state_dict

    hf, cfg = _case(name)
    m = CausalLM.from_hf(state_dict(hf), cfg)
    check_cached_decoding(m, hf, np.random.default_rng(3).integers(0, cfg["vocab_size"], (2, 9)))
    if not cfg["mamba_proj_bias"]:
        check_padded_batch(m, hf, cfg["vocab_size"], [7, 4], decode=2)

"""RoPE as models configure it: the scalings (linear, dynamic NTK, YaRN, Llama 3), partial rotary
and the attention factor, against Hugging Face's own code in float64 (``ROPE_INIT_FUNCTIONS``,
the rotary embedding classes, ``apply_rotary_pos_emb``, torch autograd), finite differences, the
textbook tier, and bad configuration dicts."""

import math

import numpy as np
import pytest
from _hf64 import default_float64, float64_torch
from hypothesis import given, settings
from hypothesis import strategies as st

import npattn.functional as F
from npattn.functional import kernels
from npattn.functional import reference as R
from npattn.testing import gradcheck, rope_scalings

TOL = 1e-12

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
# DeepSeek-V3's rope_scaling (old spelling "type", mscale / mscale_all_dim) and GPT-OSS's (truncate False)
DEEPSEEK = {
    "type": "yarn",
    "factor": 40.0,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
    "original_max_position_embeddings": 16,
}
GPT_OSS = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 16,
}
# (rope dict without rope_theta, head_dim, partial_rotary_factor, max_position_embeddings)
CASES = [
    ({"rope_type": "default"}, 16, 1.0, 64),
    ({"rope_type": "default"}, 16, 0.25, 64),
    ({"rope_type": "linear", "factor": 4.0}, 16, 1.0, 64),
    ({"rope_type": "linear", "factor": 2.5}, 12, 0.5, 64),
    ({"rope_type": "dynamic", "factor": 3.0}, 16, 1.0, 8),
    ({"type": "dynamic", "factor": 2.0}, 24, 0.5, 8),
    (YARN, 16, 1.0, 64),
    (dict(YARN, attention_factor=0.7, beta_fast=8.0, beta_slow=2.0), 32, 0.5, 64),
    (DEEPSEEK, 16, 1.0, 640),
    (GPT_OSS, 16, 1.0, 512),
    (LLAMA3, 16, 1.0, 256),
    (dict(LLAMA3, low_freq_factor=2.0, high_freq_factor=3.0), 32, 0.5, 256),
]
IDS = [f"{c[0].get('rope_type', c[0].get('type'))}-{c[1]}-{c[2]}-{i}" for i, c in enumerate(CASES)]


def hf_config(params, head_dim, partial, max_pos, theta):
    from transformers import Qwen3NextConfig

    rope = dict(params, rope_theta=theta, partial_rotary_factor=partial)  # Qwen3-Next's default is 0.25
    return Qwen3NextConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rope_parameters=rope,
    )


def npattn_scaling(config):
    """What a model builder hands npattn: the config's rope dict plus max_position_embeddings."""
    return dict(config.rope_parameters, max_position_embeddings=config.max_position_embeddings)


@pytest.fixture
def hf64(monkeypatch):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    float64_torch(monkeypatch, "modeling_rope_utils", "models.qwen3_next.modeling_qwen3_next")
    with default_float64():
        yield


# ------------------------------------------------------------------ Hugging Face's init functions


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("theta", [10000.0, 500.0])
def test_frequencies_equal_hugging_face_init_functions(hf64, case, theta):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRotaryEmbedding

    params, head_dim, partial, max_pos = case
    config = hf_config(params, head_dim, partial, max_pos, theta)
    kind = config.rope_parameters["rope_type"]
    init = Qwen3NextRotaryEmbedding.compute_default_rope_parameters if kind == "default" else ROPE_INIT_FUNCTIONS[kind]
    for seq_len in (None, 3, max_pos, 3 * max_pos + 1) if kind == "dynamic" else (None,):
        expected, expected_factor = init(config, seq_len=seq_len)
        inv_freq, factor = F.rope_frequencies(head_dim, scaling=npattn_scaling(config), seq_len=seq_len)
        assert inv_freq.shape == (int(head_dim * partial) // 2,)
        np.testing.assert_allclose(inv_freq, expected.numpy(), rtol=TOL, atol=0)
        assert factor == pytest.approx(expected_factor, rel=TOL)
        ref, ref_factor = R.rope_frequencies(head_dim, scaling=npattn_scaling(config), seq_len=seq_len)
        np.testing.assert_allclose(ref, inv_freq, rtol=TOL, atol=0)
        assert ref_factor == pytest.approx(factor, rel=TOL)


def test_the_scalings_do_change_the_frequencies():
    """Guards the oracle test against comparing two unscaled computations."""
    plain, _ = F.rope_frequencies(16, 10000.0)
    assert np.allclose(plain, 10000.0 ** (-np.arange(0, 16, 2) / 16), rtol=1e-15)
    for params in (YARN, LLAMA3, {"rope_type": "linear", "factor": 4.0}):
        scaled, _ = F.rope_frequencies(16, 10000.0, params)
        assert np.abs(scaled - plain).max() > 1e-3 * plain.max()
    dyn = {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 8}
    assert np.array_equal(F.rope_frequencies(16, scaling=dyn, seq_len=8)[0], plain)  # within the trained length
    assert np.all(F.rope_frequencies(16, scaling=dyn, seq_len=40)[0][1:] < plain[1:])  # beyond: a larger base
    assert F.rope_frequencies(16, scaling=YARN)[1] == pytest.approx(0.1 * math.log(4.0) + 1)
    assert F.rope_frequencies(16, scaling=DEEPSEEK)[1] == pytest.approx(
        F.yarn_mscale(40.0, 1.0) / F.yarn_mscale(40.0, 0.8)
    )


def test_softmax_scale_as_deepseek_v3(hf64):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale, yarn_get_mscale

    for scale, mscale in ((40.0, 1.0), (4.0, 0.707), (1.0, 1.0), (0.5, 2.0)):
        assert F.yarn_mscale(scale, mscale) == pytest.approx(yarn_get_mscale(scale, mscale), rel=1e-15)
    base = 24**-0.5
    for params in (DEEPSEEK, YARN, dict(DEEPSEEK, mscale_all_dim=0.0), None, {"rope_type": "linear", "factor": 2.0}):
        expected = yarn_apply_mscale({"rope_type": "default"} if params is None else dict(params), base)
        if params is not None and "type" in params:  # HF reads rope_type after its standardisation
            expected = yarn_apply_mscale(dict(params, rope_type=params["type"]), base)
        assert F.rope_softmax_scale(base, params) == pytest.approx(expected, rel=1e-15)
    assert F.rope_softmax_scale(base, DEEPSEEK) != base


# --------------------------------------------------------- the rotary classes and apply_rotary_pos_emb


def _hf_rope(torch, config, x, positions, rotary=None):
    """Hugging Face's path: the rotary class gives cos/sin, ``apply_rotary_pos_emb`` (Qwen3-Next's,
    the partial-rotary one; Llama's for whole heads) rotates."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_apply
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRotaryEmbedding
    from transformers.models.qwen3_next.modeling_qwen3_next import apply_rotary_pos_emb as partial_apply

    rotary = rotary or Qwen3NextRotaryEmbedding(config)
    cos, sin = rotary(x, torch.from_numpy(positions)[None])
    apply = llama_apply if cos.shape[-1] == x.shape[-1] else partial_apply
    y, _ = apply(x, x, cos, sin)
    return y


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_rope_equals_hugging_face_rotary_class_and_autograd(hf64, case):
    import torch

    params, head_dim, partial, max_pos = case
    config = hf_config(params, head_dim, partial, max_pos, 1000.0)
    rng = np.random.default_rng(head_dim + len(params))
    length = 6
    for offset in (0, max_pos + 3):  # past the trained length too (dynamic grows its base)
        positions = np.arange(length) + offset
        x = rng.standard_normal((2, 3, length, head_dim))
        y, cache = F.rope(x, positions, scaling=npattn_scaling(config))
        dy = rng.standard_normal(y.shape)
        dx = F.rope_backward(dy, cache)
        tx = torch.from_numpy(x.copy()).requires_grad_(True)
        ty = _hf_rope(torch, config, tx, positions)
        ty.backward(torch.from_numpy(dy))
        np.testing.assert_allclose(y, ty.detach().numpy(), rtol=0, atol=TOL * np.abs(x).max())
        np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=0, atol=TOL * np.abs(dy).max())
        if partial != 1.0:  # the features past the rotary part pass through, values and gradients
            r = int(head_dim * partial)
            assert np.array_equal(y[..., r:], x[..., r:]) and np.array_equal(dx[..., r:], dy[..., r:])


def test_interleaved_yarn_equals_deepseek_v3(hf64, monkeypatch):
    """DeepSeek-V3's interleaved RoPE (``apply_rotary_pos_emb_interleave``) turns pairs
    ``(2i, 2i+1)`` and writes the result de-interleaved (first members, then second members):
    npattn's ``interleaved=True`` output in that order, with YaRN and its mscale attention factor."""
    import torch
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3RotaryEmbedding,
        apply_rotary_pos_emb_interleave,
    )

    float64_torch(monkeypatch, "models.deepseek_v3.modeling_deepseek_v3")
    config = DeepseekV3Config(
        hidden_size=32,
        num_attention_heads=4,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        kv_lora_rank=8,
        q_lora_rank=None,
        max_position_embeddings=640,
        rope_theta=500.0,
        rope_scaling=dict(DEEPSEEK),
    )
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 3, 6, 8))
    positions = np.arange(6) + 20
    y, cache = F.rope(x, positions, interleaved=True, scaling=npattn_scaling(config))
    dy = rng.standard_normal(y.shape)
    dx = F.rope_backward(dy, cache)
    tx = torch.from_numpy(x.copy()).requires_grad_(True)
    cos, sin = DeepseekV3RotaryEmbedding(config)(tx, torch.from_numpy(positions)[None])
    ty, _ = apply_rotary_pos_emb_interleave(tx, tx, cos, sin)
    order = np.r_[0:8:2, 1:8:2]  # de-interleaved
    ty.backward(torch.from_numpy(dy[..., order]))
    np.testing.assert_allclose(y[..., order], ty.detach().numpy(), rtol=0, atol=TOL * np.abs(x).max())
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=0, atol=TOL * np.abs(dy).max())


def test_dynamic_follows_hugging_face_over_a_growing_sequence(hf64):
    """Decoding past max_position_embeddings: HF's dynamic_rope_update recomputes the frequencies
    at every longer position; npattn computes them from the positions of each call."""
    import torch
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRotaryEmbedding

    config = hf_config({"rope_type": "dynamic", "factor": 2.0}, 16, 1.0, 4, 10000.0)
    rotary = Qwen3NextRotaryEmbedding(config)
    rng = np.random.default_rng(0)
    for positions in (np.arange(0, 6), np.array([6]), np.arange(7, 12), np.array([12])):
        x = rng.standard_normal((1, 2, positions.size, 16))
        y, _ = F.rope(x, positions, scaling=npattn_scaling(config))
        expected = _hf_rope(torch, config, torch.from_numpy(x), positions, rotary)
        np.testing.assert_allclose(y, expected.numpy(), rtol=0, atol=TOL * np.abs(x).max())


# ----------------------------------------------------------------- finite differences, both tiers


@st.composite
def scaled_cases(draw):
    half = draw(st.integers(2, 6))
    d = 2 * half + draw(st.sampled_from([0, 0, 2, 3]))  # sometimes features that pass through
    rotary_dim = None if d == 2 * half else 2 * half
    params = draw(rope_scalings(max_position_embeddings=4))
    length = draw(st.integers(1, 5))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    pos = np.arange(length) + draw(st.integers(0, 20))
    return rng.standard_normal((2, length, d)), pos, params, rotary_dim, draw(st.booleans()), rng


@settings(max_examples=60)
@given(scaled_cases())
def test_both_tiers_equal_and_the_kernel_equals_the_public_op(case):
    x, pos, params, rotary_dim, interleaved, rng = case
    kw = dict(base=500.0, interleaved=interleaved, scaling=params, rotary_dim=rotary_dim)
    y, cache = F.rope(x, pos, **kw)
    ry, rcache = R.rope(x, pos, **kw)
    np.testing.assert_allclose(ry, y, rtol=0, atol=TOL)
    dy = rng.standard_normal(y.shape)
    np.testing.assert_allclose(R.rope_backward(dy, rcache), F.rope_backward(dy, cache), rtol=0, atol=TOL)
    from npattn.functional.rope_scaling import check_scaling

    ky, _ = kernels.rope(
        x, pos, base=500.0, interleaved=interleaved, scaling=check_scaling(params), rotary_dim=rotary_dim
    )
    assert np.array_equal(ky, y)


@settings(max_examples=25)
@given(scaled_cases())
def test_scaled_rope_backward_finite_differences(case):
    x, pos, params, rotary_dim, interleaved, rng = case
    report = gradcheck(F.rope, x, pos, interleaved=interleaved, scaling=params, rotary_dim=rotary_dim)
    assert report.ok, str(report)


def test_yarn_factor_scales_the_rotated_part_and_keeps_norms_up_to_it():
    x = np.random.default_rng(3).standard_normal((4, 8))
    y, _ = F.rope(x, scaling=YARN, rotary_dim=6)
    a = 0.1 * math.log(4.0) + 1
    np.testing.assert_allclose(np.linalg.norm(y[:, :6], axis=-1), a * np.linalg.norm(x[:, :6], axis=-1), rtol=1e-13)
    assert np.array_equal(y[:, 6:], x[:, 6:])
    y32, _ = F.rope(x.astype(np.float32), scaling=YARN, rotary_dim=6)
    assert y32.dtype == np.float32


def test_rope_theta_in_the_dict_is_the_base():
    x = np.random.default_rng(4).standard_normal((3, 8))
    by_dict, _ = F.rope(x, scaling={"rope_type": "default", "rope_theta": 500.0})
    assert np.array_equal(by_dict, F.rope(x, base=500.0)[0])
    assert np.array_equal(by_dict, F.rope(x, base=500.0, scaling={"rope_theta": 500.0})[0])
    partial, _ = F.rope(x, scaling={"partial_rotary_factor": 0.5})
    assert np.array_equal(partial, F.rope(x, rotary_dim=4)[0])
    # as Hugging Face's standardisation: original_max_position_embeddings defaults to max_position_embeddings
    for params in (YARN, LLAMA3):
        short = {k: v for k, v in params.items() if k != "original_max_position_embeddings"}
        by_max = dict(short, max_position_embeddings=params["original_max_position_embeddings"])
        assert np.array_equal(F.rope(x, scaling=by_max)[0], F.rope(x, scaling=params)[0])
    # None values are absent keys, as in Hugging Face's configs
    assert np.array_equal(F.rope(x, scaling=dict(YARN, attention_factor=None))[0], F.rope(x, scaling=YARN)[0])


# ------------------------------------------------------------------------------------ bad input


def raises(exc, name, fn, *parts):
    with pytest.raises(exc, match=f"^{name}") as info:
        fn()
    for part in parts:
        assert part in str(info.value), (part, str(info.value))


def test_bad_scaling_dicts_are_refused_naming_the_key():
    x = np.zeros((3, 8))
    for fn in (lambda s: F.rope(x, scaling=s), lambda s: F.rope_frequencies(8, scaling=s)):
        raises(ValueError, r"scaling\['rope_type'\]", lambda: fn({"rope_type": "su"}), "'su'", "longrope")
        raises(ValueError, r"scaling\['type'\]", lambda: fn({"type": "ntk"}), "'ntk'")
        raises(ValueError, r"scaling\['rope_type'\]", lambda: fn({"rope_type": 3}), "3")
        raises(ValueError, "scaling", lambda: fn({"rope_type": "yarn", "type": "linear", "factor": 2}), "disagree")
        raises(ValueError, r"scaling\['factor'\]", lambda: fn({"rope_type": "default", "factor": 2.0}), "'default'")
        raises(ValueError, r"scaling\['low_freq_factor'\]", lambda: fn(dict(YARN, low_freq_factor=1.0)), "'yarn'")
        raises(ValueError, "scaling", lambda: fn({"rope_type": "linear"}), "'factor'")
        raises(ValueError, "scaling", lambda: fn({"rope_type": "dynamic", "factor": 2.0}), "'max_position_embeddings'")
        raises(ValueError, "scaling", lambda: fn({"rope_type": "yarn", "factor": 2.0}), "original_max_position")
        raises(
            ValueError, "scaling", lambda: fn({"rope_type": "yarn", "original_max_position_embeddings": 8}), "'factor'"
        )
        raises(ValueError, "scaling", lambda: fn({k: v for k, v in LLAMA3.items() if k != "high_freq_factor"}))
        raises(ValueError, r"scaling\['high_freq_factor'\]", lambda: fn(dict(LLAMA3, high_freq_factor=1.0)))
        raises(ValueError, r"scaling\['factor'\]", lambda: fn({"rope_type": "linear", "factor": -2.0}), "-2.0")
        raises(ValueError, r"scaling\['factor'\]", lambda: fn({"rope_type": "linear", "factor": math.inf}))
        raises(TypeError, r"scaling\['factor'\]", lambda: fn({"rope_type": "linear", "factor": "8"}))
        raises(TypeError, r"scaling\['factor'\]", lambda: fn({"rope_type": "linear", "factor": True}))
        raises(TypeError, r"scaling\['truncate'\]", lambda: fn(dict(YARN, truncate=1)))
        raises(ValueError, r"scaling\['rope_theta'\]", lambda: fn({"rope_theta": 0}))
        raises(ValueError, r"scaling\['partial_rotary_factor'\]", lambda: fn({"partial_rotary_factor": 1.5}))
        raises(ValueError, r"scaling\['beta_fast'\]", lambda: fn(dict(YARN, beta_fast=-1.0)))
        raises(TypeError, "scaling", lambda: fn([("rope_type", "yarn")]), "list")
        raises(TypeError, "scaling", lambda: fn({1: 2}))
    raises(ValueError, "partial_rotary_factor", lambda: F.rope(x, scaling={"partial_rotary_factor": 0.1}), "[2, 8]")
    raises(ValueError, "partial_rotary_factor", lambda: F.rope(x, scaling={"partial_rotary_factor": 0.375}), "got 3")
    raises(ValueError, "rotary_dim", lambda: F.rope(x, rotary_dim=5), "even", "got 5")
    raises(ValueError, "rotary_dim", lambda: F.rope(x, rotary_dim=10), "got 10")
    raises(ValueError, "rotary_dim", lambda: F.rope(x, rotary_dim=0))
    raises(TypeError, "rotary_dim", lambda: F.rope(x, rotary_dim=4.0))
    raises(ValueError, "rotary_dim", lambda: F.rope(x, rotary_dim=6, scaling={"partial_rotary_factor": 0.5}), "4")
    dyn = {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 4}
    raises(ValueError, "rotary_dim", lambda: F.rope(x, rotary_dim=2, scaling=dyn), "dynamic")
    raises(ValueError, "base", lambda: F.rope(x, base=50.0, scaling={"rope_theta": 60.0}), "60.0")
    raises(ValueError, "x", lambda: F.rope(np.zeros((3, 5))), "even")
    assert F.rope(np.zeros((3, 5)), rotary_dim=4)[0].shape == (3, 5)  # odd D, even rotary part: fine
    raises(ValueError, "dim", lambda: F.rope_frequencies(0))
    raises(TypeError, "dim", lambda: F.rope_frequencies(8.0))
    raises(ValueError, "dim", lambda: F.rope_frequencies(7), "got 7")
    raises(ValueError, "seq_len", lambda: F.rope_frequencies(8, scaling=dyn, seq_len=0))
    raises(ValueError, "base", lambda: F.rope_frequencies(8, base=-1.0))
    raises(ValueError, "scale", lambda: F.yarn_mscale(0.0))
    raises(ValueError, "mscale", lambda: F.yarn_mscale(2.0, -1.0))
    raises(ValueError, "scale", lambda: F.rope_softmax_scale(-1.0, YARN))
    raises(ValueError, r"scaling\['rope_type'\]", lambda: F.rope_softmax_scale(1.0, {"rope_type": "x"}))

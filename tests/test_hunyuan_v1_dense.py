"""Hunyuan's dense models (model_type ``hunyuan_v1_dense``): the QK-norm after RoPE
(``MultiHeadAttention``'s ``qk_norm_after_rope``), NTK-alpha RoPE (``"ntk_alpha"``), the reader.

The logits and every gradient against transformers: tests/test_causal_lm_parity.py; the
family-wide suites run the tiny entry."""

from __future__ import annotations

import numpy as np
import pytest
from _hf64 import transformers_or_none
from _oracles import rel_err

import npattn
from npattn import no_grad
from npattn.functional import rope_frequencies
from npattn.models import CausalLM, config_from_hf
from npattn.models.tiny import tiny_config

T = transformers_or_none()
needs_transformers = pytest.mark.skipif(T is None, reason="needs torch and transformers")


def _mha(after=True, dtype=np.float64, **kw):
    return npattn.MultiHeadAttention(
        16, 16, 4, num_kv_heads=2, causal=True, rope=True, qk_norm=True, qk_norm_after_rope=after,
        rope_base=100.0, rng=0, dtype=dtype, **kw,
    )  # fmt: skip


def _randomize_norms(m, seed=5):
    rng = np.random.default_rng(seed)
    for norm in (m.q_norm, m.k_norm):
        norm.weight.data = 1.0 + 0.3 * rng.standard_normal(norm.weight.data.shape)


# -- the option ---------------------------------------------------------------------------------------
def test_the_norm_follows_the_rotation():
    """With the option, each head of q and k is rotated, then normalised (the rotation keeps each
    pair's length but not the head's weighting, so the order matters): a module without RoPE fed
    the rotated heads computes the same normalisation; the other order differs."""
    m = _mha()
    _randomize_norms(m)
    x = np.random.default_rng(0).standard_normal((2, 5, 16))
    qh = m._split(x @ m.W_query.weight.data.T, 4)
    qr, _ = npattn.functional.rope(qh, np.arange(5), base=100.0)
    want, _ = m._qk_norm(qr, m.q_norm)
    got, _, _ = m._position(qh, m._split(x @ m.W_key.weight.data.T, 2), 0)
    assert rel_err(got, want, floor=1e-300) < 1e-13
    before = _mha(after=False)
    before.load_state_dict(m.state_dict())
    assert rel_err(before(x), m(x), floor=1e-300) > 1e-3


def test_every_path_agrees():
    """The forward kept for a backward (staged), cached decoding (the joint q/k path), a whole
    pass without a state (joint) and given positions give the same numbers."""
    m = _mha()
    _randomize_norms(m)
    x = np.random.default_rng(1).standard_normal((2, 7, 16))
    full = m(x)
    with no_grad():
        steps = [m(x[:, :3], use_cache=True)] + [m(x[:, t : t + 1], use_cache=True) for t in range(3, 7)]
        assert rel_err(np.concatenate(steps, axis=1), full, floor=1e-300) < 1e-12
        m.reset_kv_cache()
        assert rel_err(m(x), full, floor=1e-300) < 1e-12
        m.reset_kv_cache()
        m(x[:, :2], use_cache=True)
        rest = m(x[:, 2:], use_cache=True, positions=np.broadcast_to(np.arange(2, 7), (2, 5)))
    assert rel_err(rest, full[:, 2:], floor=1e-300) < 1e-12


def test_a_long_prompt_without_a_state_is_the_staged_forward():
    """A long prompt in a call that keeps nothing (no_grad) gives the numbers of the forward kept
    for a backward, bit for bit (the QK-norm after RoPE takes the staged path either way)."""
    m = npattn.MultiHeadAttention(
        64, 64, 8, num_kv_heads=8, causal=True, rope=True, qk_norm=True, qk_norm_after_rope=True, rng=0
    )
    _randomize_norms(m)
    x = np.random.default_rng(2).standard_normal((1, 300, 64))
    full = m(x)
    with no_grad():
        assert np.array_equal(m(x), full)


@pytest.mark.parametrize("after", [True, False])
def test_backward_and_jvp_against_central_differences(after):
    """npattn.gradcheck (central differences, reverse and forward mode), the norms' weights included."""
    m = _mha(after)
    _randomize_norms(m)
    x = np.random.default_rng(3).standard_normal((2, 5, 16))
    assert npattn.gradcheck(m, x, mode="both").ok


def test_second_order_against_central_differences_of_the_backward():
    """backward_jvp: the gradients' tangent along an input and every parameter's tangent is the
    central difference of the backward along them."""
    m = _mha()
    _randomize_norms(m)
    rng = np.random.default_rng(4)
    x, dy, tx = rng.standard_normal((2, 5, 16)), rng.standard_normal((2, 5, 16)), rng.standard_normal((2, 5, 16))
    params = dict(m.named_parameters())
    tp = {n: rng.standard_normal(p.data.shape) for n, p in params.items()}

    def grads(s):
        saved = {n: p.data for n, p in params.items()}
        for n, p in params.items():
            p.data = saved[n] + s * tp[n]
            p.grad = None
        try:
            m(x + s * tx)
            dx = m.backward(dy)
            return [dx] + [params[n].grad.copy() for n in params]
        finally:
            for n, p in params.items():
                p.data = saved[n]

    h = 1e-6  # the third derivatives are large (~1e4): the O(h^2) error 1e-8
    plus, minus = grads(h), grads(-h)
    want = [(a - b) / (2 * h) for a, b in zip(plus, minus)]
    for p in params.values():
        p.grad = p.grad_tangent = None
    m(x)
    _, tdx = m.backward_jvp(dy, tx, param_tangents=tp)
    assert rel_err(tdx, want[0], floor=1e-300, relative_to="max_b") < 1e-7
    for w, n in zip(want[1:], params):
        assert rel_err(params[n].grad_tangent, w, floor=1e-300, relative_to="max_b") < 1e-7, n


def test_the_option_is_checked():
    with pytest.raises(TypeError, match="qk_norm_after_rope"):
        npattn.MultiHeadAttention(16, 16, 4, qk_norm=True, qk_norm_after_rope=1)
    assert "qk_norm_after_rope=True" in repr(_mha())


# -- NTK-alpha RoPE -----------------------------------------------------------------------------------
def test_ntk_alpha_stretches_the_base():
    inv, factor = rope_frequencies(8, 1000.0, {"rope_type": "ntk_alpha", "alpha": 3.0})
    base = 1000.0 * 3.0 ** (8 / 6)
    np.testing.assert_allclose(inv, base ** -(np.arange(0, 8, 2) / 8), rtol=1e-15)
    assert factor == 1.0
    from npattn.functional import reference

    ref, _ = reference.rope_frequencies(8, 1000.0, {"rope_type": "ntk_alpha", "alpha": 3.0})
    np.testing.assert_allclose(inv, ref, rtol=1e-14)


@pytest.mark.parametrize(
    "bad,match",
    [
        ({"rope_type": "ntk_alpha"}, "needs the key 'alpha'"),
        ({"rope_type": "ntk_alpha", "alpha": 0.0}, "alpha"),
        ({"rope_type": "ntk_alpha", "alpha": 2.0, "factor": 2.0}, "'factor'"),
    ],
)
def test_ntk_alpha_refusals_name_the_key(bad, match):
    with pytest.raises(ValueError, match=match):
        rope_frequencies(8, 1000.0, bad)


def test_ntk_alpha_needs_more_than_two_rotated_features():
    with pytest.raises(ValueError, match="more than 2 rotated features"):
        rope_frequencies(2, 1000.0, {"rope_type": "ntk_alpha", "alpha": 2.0})


@needs_transformers
@pytest.mark.parametrize("head_dim,alpha,theta", [(8, 3.0, 1000.0), (128, 1000.0, 10000.0), (64, 50.0, 1e6)])
def test_ntk_alpha_frequencies_are_transformers(head_dim, alpha, theta):
    import torch

    rope = {"rope_type": "dynamic", "alpha": alpha, "factor": 1.0, "rope_theta": theta}
    cfg = T.HunYuanDenseV1Config(head_dim=head_dim, rope_parameters=rope)
    from transformers.models.hunyuan_v1_dense.modeling_hunyuan_v1_dense import HunYuanDenseV1RotaryEmbedding

    inv, factor = HunYuanDenseV1RotaryEmbedding.compute_ntk_alpha_rope_parameters(cfg)
    ours, f = rope_frequencies(head_dim, theta, {"rope_type": "ntk_alpha", "alpha": alpha})
    assert inv.dtype == torch.float32
    np.testing.assert_allclose(ours, inv.double().numpy(), rtol=1e-6)  # transformers' float32 table
    assert f == factor == 1.0


# -- the reader ---------------------------------------------------------------------------------------
def test_the_tiny_config_reads_ntk_alpha_and_the_order():
    c = config_from_hf(tiny_config("hunyuan_v1_dense"))
    assert c.rope == {"default": {"rope_type": "ntk_alpha", "alpha": 3.0, "rope_theta": 1000.0}}
    assert c.qk_norm and c.qk_norm_after_rope and c.attention_config("full_attention").qk_norm_after_rope
    names = {n for n, _ in CausalLM(tiny_config("hunyuan_v1_dense"), rng=0).named_parameters()}
    assert "model.layers.0.self_attn.query_layernorm.weight" in names
    assert "model.layers.1.self_attn.key_layernorm.weight" in names
    assert not any("q_norm" in n or "k_norm" in n for n in names)


def test_dynamic_without_alpha_is_dynamic_ntk():
    cfg = tiny_config("hunyuan_v1_dense", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "alpha": 0})
    assert config_from_hf(cfg).rope["default"]["rope_type"] == "dynamic"


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(head_dim=None), "needs the key 'head_dim'"),
        (dict(use_qk_norm=True), "'use_qk_norm' is not supported"),
        (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "beta_fast": 32}), "beta_fast"),
        (dict(rope_parameters={"rope_type": "dynamic", "alpha": 2.0, "partial_rotary_factor": 0.5}), "partial"),
    ],
)
def test_refusals_name_the_key(changes, match):
    cfg = tiny_config("hunyuan_v1_dense")
    cfg.update(changes)
    if cfg.get("head_dim") is None:
        cfg.pop("head_dim")
    with pytest.raises(ValueError, match=match):
        config_from_hf(cfg)


@needs_transformers
def test_the_defaults_are_the_config_class_s():
    from npattn.models.configs import with_defaults

    ours, theirs = with_defaults({"model_type": "hunyuan_v1_dense"}), T.HunYuanDenseV1Config().to_dict()
    for key, value in ours.items():
        assert theirs[key] == value, key
    meta = dict(bos_token_id=None, eos_token_id=None, max_position_embeddings=None)
    a = config_from_hf(dict(theirs, head_dim=128)).replace(**meta)
    assert a == config_from_hf({"model_type": "hunyuan_v1_dense", "head_dim": 128}).replace(**meta)


@needs_transformers
def test_a_saved_directory_round_trips_through_transformers(tmp_path):
    """transformers' save_pretrained directory loads (the checkpoint's own names) with its logits;
    npattn's save_pretrained writes the same config and tensors back, which transformers loads;
    cached decoding and a left-padded batch are transformers'."""
    import json

    from _hf64 import build, check_cached_decoding, check_padded_batch, hf_logits
    from safetensors.numpy import load_file

    cfg = tiny_config("hunyuan_v1_dense")
    kwargs = {k: v for k, v in cfg.items() if k != "model_type"}
    hf, _ = build(T.HunYuanDenseV1Config, T.HunYuanDenseV1ForCausalLM, **kwargs)
    hf.save_pretrained(tmp_path / "hf")
    m = CausalLM.from_pretrained(tmp_path / "hf", dtype=np.float64)
    ids = np.random.default_rng(3).integers(0, cfg["vocab_size"], (2, 9))
    want = hf_logits(hf, ids)
    assert rel_err(m(ids), want, floor=1e-300, relative_to="max_b") < 1e-9
    m.save_pretrained(tmp_path / "ours")
    for name in ("config.json",):
        assert json.loads((tmp_path / "ours" / name).read_text()) == json.loads((tmp_path / "hf" / name).read_text())
    theirs, ours = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "ours" / "model.safetensors")
    assert set(ours) == set(theirs)
    for k, v in theirs.items():
        np.testing.assert_array_equal(ours[k], v, err_msg=k)
    back = T.HunYuanDenseV1ForCausalLM.from_pretrained(tmp_path / "ours", dtype="float64").eval()
    assert set(dict(back.named_parameters())) == set(dict(hf.named_parameters()))
    check_cached_decoding(m, hf, ids)
    check_padded_batch(m, hf, cfg["vocab_size"], (8, 5, 2), decode=3)

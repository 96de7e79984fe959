"""``MultiHeadLatentAttention`` against Hugging Face's ``DeepseekV3Attention`` (the oracle), float64.

The HF module is built alone from a tiny random ``DeepseekV3Config`` and run as the model runs it:
``position_embeddings = (cos, sin)`` from the rotary embedding, an additive causal mask, eager
attention.  The reference's float32 steps run in float64 (the tests compare float64, they do not
loosen tolerances): its RMSNorm's cast and its eager softmax's dtype through ``_hf64.float64_torch``,
and the rotary angles here: the test computes ``cos``/``sin`` in float64 from the same frequencies
(checked equal to HF's to float32 precision).  The HF state dict loads into npattn's module
unchanged (same keys, ``strict=True``).  Outputs, the input gradient and every parameter gradient
agree with torch autograd to 1e-10.
"""

import math

import numpy as np
import pytest
from _hf64 import float64_torch
from _oracles import rel_err

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from transformers import DeepseekV3Config  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf  # noqa: E402

import npattn  # noqa: E402

RTOL = 1e-10
HIDDEN, HEADS = 16, 4
DIMS = {"kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 6, "v_head_dim": 5}


@pytest.fixture
def float64_reference(monkeypatch):
    float64_torch(monkeypatch, "models.deepseek_v3.modeling_deepseek_v3")


def make_config(q_lora_rank, *, interleave=True, bias=False, rope_parameters=None, max_position_embeddings=64):
    cfg = DeepseekV3Config(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        q_lora_rank=q_lora_rank,
        rope_interleave=interleave,
        attention_bias=bias,
        rope_parameters=rope_parameters or {"rope_type": "default", "rope_theta": 500.0},
        max_position_embeddings=max_position_embeddings,
        vocab_size=32,
        num_hidden_layers=1,
        **DIMS,
    )
    cfg._attn_implementation = "eager"
    return cfg


def hf_attention(cfg, seed):
    torch.manual_seed(seed)
    m = hf.DeepseekV3Attention(cfg, layer_idx=0).double()
    with torch.no_grad():  # random norm weights and biases too, so every parameter matters
        for name, p in m.named_parameters():
            p.copy_(torch.empty_like(p).uniform_(-0.6, 0.6) + (1.0 if "layernorm" in name else 0.0))
    return m


def position_embeddings(cfg, positions):
    """``(cos, sin)`` as ``DeepseekV3RotaryEmbedding`` makes them, in float64: the frequencies and
    attention factor of HF's own rope init (float32) recomputed in float64 by npattn's RoPE code,
    checked equal to HF's to float32 precision."""
    rot = hf.DeepseekV3RotaryEmbedding(cfg)
    params = cfg.rope_parameters
    dr = cfg.qk_rope_head_dim
    if params.get("rope_type", "default") == "default":
        inv_freq, factor = params["rope_theta"] ** (-np.arange(0, dr, 2) / dr), 1.0
    else:
        inv_freq, factor = npattn.functional.rope_frequencies(dr, params["rope_theta"], params)
    np.testing.assert_allclose(inv_freq, rot.inv_freq.double().numpy(), rtol=1e-6)
    assert math.isclose(factor, rot.attention_scaling, rel_tol=1e-6)
    freqs = np.asarray(positions, np.float64)[..., None] * inv_freq
    emb = torch.from_numpy(np.concatenate([freqs, freqs], axis=-1))
    return emb.cos() * factor, emb.sin() * factor


def causal_mask(L):
    return torch.full((L, L), -math.inf, dtype=torch.float64).triu(1)[None, None]


def run_both(cfg, seed, *, B=2, L=5, absorb=False, **npkw):
    """Forward and backward through both; returns (npattn module, its output, dx, HF module,
    HF output, x tensor)."""
    tm = hf_attention(cfg, seed)
    m = npattn.MultiHeadLatentAttention.from_config(cfg.to_dict(), **npkw)
    m.load_state_dict(tm.state_dict(), strict=True)
    rng = np.random.default_rng(seed + 1)
    x = rng.standard_normal((B, L, HIDDEN))
    dy = rng.standard_normal((B, L, HIDDEN))
    xt = torch.tensor(x, requires_grad=True)
    cos, sin = position_embeddings(cfg, np.arange(L)[None])
    yt, _ = tm(xt, position_embeddings=(cos, sin), attention_mask=causal_mask(L))
    yt.backward(torch.from_numpy(dy))
    y = m(x, absorb=absorb)
    dx = m.backward(dy)
    return m, y, dx, tm, yt, xt


def assert_matches(m, y, dx, tm, yt, xt):
    err = rel_err(y, yt, floor=1e-3, relative_to="max_b")
    assert err <= RTOL, ("out", err)
    err = rel_err(dx, xt.grad, floor=1e-3, relative_to="max_b")
    assert err <= RTOL, ("dx", err)
    tparams = dict(tm.named_parameters())
    names = [n for n, _ in m.named_parameters()]
    assert sorted(names) == sorted(tparams)
    for name, p in m.named_parameters():
        err = rel_err(p.grad, tparams[name].grad, floor=1e-3, relative_to="max_b")
        assert err <= RTOL, f"{name}: relative error {err:.3e}"


@pytest.mark.parametrize("absorb", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("q_lora_rank", [None, 7])
def test_matches_transformers(float64_reference, q_lora_rank, interleave, bias, absorb):
    cfg = make_config(q_lora_rank, interleave=interleave, bias=bias)
    assert_matches(*run_both(cfg, seed=3, absorb=absorb))


def test_state_dict_keys_are_hf_names():
    for q_lora_rank in (None, 7):
        cfg = make_config(q_lora_rank, bias=True)
        tm = hf.DeepseekV3Attention(cfg, layer_idx=0)
        m = npattn.MultiHeadLatentAttention.from_config(cfg.to_dict(), rng=0)
        assert list(m.state_dict()) == list(tm.state_dict())
        for k, v in tm.state_dict().items():
            assert m.state_dict()[k].shape == tuple(v.shape), k


def test_softmax_scale_matches_transformers():
    for params in (
        {"rope_type": "default", "rope_theta": 500.0},
        {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "mscale_all_dim": 0.7, "mscale": 1.0,
         "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0},
        {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 16},
    ):  # fmt: skip
        cfg = make_config(None, rope_parameters=params)
        tm = hf.DeepseekV3Attention(cfg, layer_idx=0)
        m = npattn.MultiHeadLatentAttention.from_config(cfg.to_dict(), rng=0)
        assert math.isclose(m.scaling, tm.scaling, rel_tol=1e-15), (m.scaling, tm.scaling)


YARN = {
    "rope_type": "yarn",
    "rope_theta": 500.0,
    "factor": 4.0,
    "mscale": 0.8,
    "mscale_all_dim": 0.6,
    "original_max_position_embeddings": 16,
    "beta_fast": 8.0,
    "beta_slow": 1.0,
}


@pytest.mark.parametrize("absorb", [False, True])
@pytest.mark.parametrize("q_lora_rank", [None, 7])
def test_matches_transformers_yarn(float64_reference, q_lora_rank, absorb):
    cfg = make_config(q_lora_rank, rope_parameters=dict(YARN))
    assert_matches(*run_both(cfg, seed=5, L=7, absorb=absorb))


@pytest.mark.parametrize("rope_parameters", [None, YARN], ids=["default", "yarn"])
def test_cached_decoding_matches_transformers(float64_reference, rope_parameters):
    """Token-by-token decoding with npattn's latent cache gives HF's full causal pass."""
    cfg = make_config(7, rope_parameters=None if rope_parameters is None else dict(rope_parameters))
    tm = hf_attention(cfg, 11)
    m = npattn.MultiHeadLatentAttention.from_config(cfg.to_dict())
    m.load_state_dict(tm.state_dict())
    x = np.random.default_rng(12).standard_normal((2, 6, HIDDEN))
    cos, sin = position_embeddings(cfg, np.arange(6)[None])
    with torch.no_grad():
        yt, _ = tm(torch.from_numpy(x), position_embeddings=(cos, sin), attention_mask=causal_mask(6))
    m.reset_kv_cache()
    y = np.concatenate([m(x[:, i : i + 1], use_cache=True) for i in range(6)], axis=1)
    assert rel_err(y, yt, floor=1e-3, relative_to="max_b") <= RTOL

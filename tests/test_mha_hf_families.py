"""``MultiHeadAttention`` configured as the attention layers of the open-model families, against
Hugging Face's own attention classes (eager attention, float64): Llama with Llama 3.1 RoPE
scaling, Qwen3 (QK-norm, a head size apart from the hidden size), Gemma 3 (sliding window, its
local RoPE base, ``query_pre_attn_scalar``, ``(1 + w)`` QK-norm; a global layer with linear
scaling), GPT-OSS (sinks, sliding window, biases, YaRN), Qwen3-Next full attention (output gate,
partial rotary, ``(1 + w)`` QK-norm).  Outputs, the input's gradient and every parameter's
gradient equal torch autograd's through the Hugging Face layer.

The Hugging Face layers get ``position_embeddings`` from their model's rotary class and an
additive causal (sliding-window) mask, as their models build them.  Their float32 upcasts
(RoPE frequencies, the eager softmax, the RMSNorms) run in float64 here (``_hf64``; the
``x.float()`` of the Gemma-style norms by patching their forward to the same formula without it).
"""

import numpy as np
import pytest
from _hf64 import default_float64, float64_torch

import npattn

TOL = 1e-10
# npattn's parameter names -> the Hugging Face attention layer's
HF_NAMES = {
    "W_query.weight": "q_proj.weight",
    "W_query.bias": "q_proj.bias",
    "W_key.weight": "k_proj.weight",
    "W_key.bias": "k_proj.bias",
    "W_value.weight": "v_proj.weight",
    "W_value.bias": "v_proj.bias",
    "out_proj.weight": "o_proj.weight",
    "out_proj.bias": "o_proj.bias",
    "q_norm.weight": "q_norm.weight",
    "k_norm.weight": "k_norm.weight",
    "sinks": "sinks",
}


@pytest.fixture
def hf(monkeypatch):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    models = ("llama", "qwen3", "gemma3", "gpt_oss", "qwen3_next")
    float64_torch(monkeypatch, "modeling_rope_utils", *(f"models.{m}.modeling_{m}" for m in models))
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    for cls in (Gemma3RMSNorm, Qwen3NextRMSNorm):  # their formula, without the x.float() round trip
        monkeypatch.setattr(cls, "forward", lambda self, x: self._norm(x) * (1.0 + self.weight))
    with default_float64():
        yield torch


def additive_mask(torch, length, sliding_window=None):
    """The eager layers' 4-d additive mask: 0 where query i may see key j (causal, and
    ``j > i - sliding_window`` on sliding layers, as ``sliding_window_overlay``), else the dtype's min."""
    i, j = np.arange(length)[:, None], np.arange(length)[None, :]
    allowed = j <= i
    if sliding_window is not None:
        allowed &= j > i - sliding_window
    return torch.from_numpy(np.where(allowed, 0.0, np.finfo(np.float64).min)[None, None])


def compare(torch, layer, rotary, m, hidden, *, length=7, sliding_window=None, layer_type=None, seed=0):
    """Load the HF layer's weights into ``m``; compare outputs and every gradient."""
    rng = np.random.default_rng(seed)
    layer.double()
    with torch.no_grad():  # random norms and sinks (their inits are ones / zeros / empty)
        for name, p in layer.named_parameters():
            if "norm" in name or name == "sinks":
                p.copy_(torch.from_numpy(rng.normal(0.0, 0.5, tuple(p.shape))))
    hf_params = dict(layer.named_parameters())
    names = [n for n, _ in m.named_parameters()]
    assert {HF_NAMES[n] for n in names} == set(hf_params), (names, sorted(hf_params))
    m.load_state_dict({n: hf_params[HF_NAMES[n]].detach().numpy() for n in names})

    x = rng.standard_normal((2, length, hidden))
    dy = rng.standard_normal((2, length, m.d_out))
    y = m(x)
    dx = m.backward(dy)

    tx = torch.from_numpy(x.copy()).requires_grad_(True)
    positions = torch.arange(length)[None].expand(2, length)
    cos, sin = rotary(tx, positions) if layer_type is None else rotary(tx, positions, layer_type)
    ty, _ = layer(tx, position_embeddings=(cos, sin), attention_mask=additive_mask(torch, length, sliding_window))
    ty.backward(torch.from_numpy(dy))

    def close(a, b, what):
        b = b.detach().numpy()
        np.testing.assert_allclose(a, b, rtol=0, atol=TOL * max(1.0, np.abs(b).max()), err_msg=what)

    close(y, ty, "output")
    close(dx, tx.grad, "dx")
    for n, p in m.named_parameters():
        close(p.grad, hf_params[HF_NAMES[n]].grad, n)
    return y


def rope_scaling_of(config, layer_type=None):
    params = config.rope_parameters if layer_type is None else config.rope_parameters[layer_type]
    return dict(params, max_position_embeddings=config.max_position_embeddings)


def eager(config):
    config._attn_implementation = "eager"
    return config


def decoder_attention(config, **kw):
    """The npattn module for a decoder layer of ``config`` (causal, RoPE, the config's head
    counts, head size and biases), plus the family's options ``kw``."""
    bias = config.attention_bias
    return npattn.MultiHeadAttention(
        config.hidden_size,
        config.hidden_size,
        config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        qkv_bias=bias,
        out_bias=bias,
        causal=True,
        rope=True,
        **kw,
    )


@pytest.mark.parametrize("head_dim", [None, 12])
def test_llama_with_llama3_rope_scaling(hf, head_dim):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    config = eager(
        LlamaConfig(
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=head_dim,
            max_position_embeddings=64,
            rope_theta=500.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        )
    )
    m = decoder_attention(config, rope_scaling=rope_scaling_of(config))
    compare(hf, LlamaAttention(config, 0), LlamaRotaryEmbedding(config), m, 32)


def test_qwen3_qk_norm_and_head_dim(hf):
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3RotaryEmbedding

    config = eager(
        Qwen3Config(
            hidden_size=24,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            rms_norm_eps=1e-6,
            rope_theta=1000.0,
            max_position_embeddings=64,
        )
    )
    m = decoder_attention(config, rope_scaling=rope_scaling_of(config), qk_norm=True, qk_norm_eps=config.rms_norm_eps)
    assert m.W_query.weight.shape == (64, 24) and m.out_proj.weight.shape == (24, 64)
    compare(hf, Qwen3Attention(config, 0), Qwen3RotaryEmbedding(config), m, 24)


def gemma3_config():
    from transformers import Gemma3TextConfig

    return eager(
        Gemma3TextConfig(
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_hidden_layers=2,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=3,
            query_pre_attn_scalar=24,
            rms_norm_eps=1e-6,
            max_position_embeddings=64,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0},
            },
        )
    )


@pytest.mark.parametrize("layer", [0, 1])
def test_gemma3_local_and_global_layers(hf, layer):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3Attention, Gemma3RotaryEmbedding

    config = gemma3_config()
    kind = config.layer_types[layer]
    sliding = kind == "sliding_attention"
    assert config.attn_logit_softcapping is None
    m = decoder_attention(
        config,
        window=(config.sliding_window - 1, 0) if sliding else None,
        scale=config.query_pre_attn_scalar**-0.5,
        rope_scaling=rope_scaling_of(config, kind),  # the local layers' own base
        qk_norm=True,
        qk_norm_eps=config.rms_norm_eps,
        qk_norm_unit_offset=True,
    )
    assert m.rope_base == (100.0 if sliding else 1000.0)
    compare(
        hf,
        Gemma3Attention(config, layer),
        Gemma3RotaryEmbedding(config),
        m,
        32,
        sliding_window=config.sliding_window if sliding else None,
        layer_type=kind,
    )


def test_gpt_oss_sinks_window_biases_and_yarn(hf):
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, GptOssRotaryEmbedding

    config = eager(
        GptOssConfig(
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=12,
            sliding_window=3,
            num_hidden_layers=2,
            max_position_embeddings=256,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 8.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 16,
                "rope_theta": 1000.0,
            },
        )
    )
    assert config.layer_types[0] == "sliding_attention" and config.attention_bias
    m = decoder_attention(
        config, window=(config.sliding_window - 1, 0), sinks=True, rope_scaling=rope_scaling_of(config)
    )
    compare(hf, GptOssAttention(config, 0), GptOssRotaryEmbedding(config), m, 32, sliding_window=3, length=8)


@pytest.mark.parametrize("partial_in_dict", [False, True])
def test_qwen3_next_gated_attention_with_partial_rotary(hf, partial_in_dict):
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextAttention, Qwen3NextRotaryEmbedding

    config = eager(
        Qwen3NextConfig(
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            partial_rotary_factor=0.25,
            rms_norm_eps=1e-6,
            rope_theta=1000.0,
            max_position_embeddings=64,
        )
    )
    scaling = rope_scaling_of(config)
    assert scaling["partial_rotary_factor"] == 0.25
    kw = {} if partial_in_dict else {"partial_rotary_factor": 0.25}
    if not partial_in_dict:
        del scaling["partial_rotary_factor"]
    m = decoder_attention(
        config,
        rope_scaling=scaling,
        qk_norm=True,
        qk_norm_eps=config.rms_norm_eps,
        qk_norm_unit_offset=True,
        output_gate=True,
        **kw,
    )
    assert m.rotary_dim == 4 and m.W_query.weight.shape == (2 * 4 * 16, 32)
    compare(hf, Qwen3NextAttention(config, 3), Qwen3NextRotaryEmbedding(config), m, 32)

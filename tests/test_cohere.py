"""Command R7B (``cohere2``) and Command R (``cohere``): the parallel block (attention and MLP on
one bias-free LayerNorm, both added to the residual: ``ParallelSum``), RoPE on interleaved pairs,
the logits times ``logit_scale``, Command R7B's sliding layers with RoPE and full layers without.

* the config readers: the keys of the released config.json files (at a tiny size) read, which
  layers slide and rotate, ``sliding_window_pattern``'s default layers, every refusal by name;
* the layer without torch: its one norm mean-subtracted with a weight and no bias, its output
  ``x + attn(norm(x)) + mlp(norm(x))`` from its own modules, which layers rotate;
* against transformers' ``Cohere2ForCausalLM`` in float64 with attention biases (the tiny entry has
  none): logits to 1e-9 and every parameter's gradient to 1e-8 under a random upstream gradient,
  cached decoding, a left-padded batch.  The family-wide suites run both tiny entries, and
  ``tests/test_causal_lm_parity.py`` two more layouts against transformers.
"""

from __future__ import annotations

import numpy as np
import pytest
from _hf64 import transformers_or_none

from npattn import no_grad
from npattn.models import CausalLM, config_from_hf
from npattn.models.tiny import tiny_config
from npattn.nn import LayerNorm, ParallelSum

T = transformers_or_none()
oracle = pytest.mark.skipif(T is None, reason="needs torch and transformers")

_TINY = dict(vocab_size=61, hidden_size=16, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2)

# c4ai-command-r7b-12-2024's config.json keys at a tiny size (its own training code's keys beside
# Cohere2Config's: transformers reads none of them)
_R7B = dict(
    _TINY,
    architectures=["Cohere2ForCausalLM"],
    attention_bias=False,
    attention_dropout=0.0,
    bos_token_id=5,
    cache_implementation="hybrid",
    eos_token_id=60,
    head_dim=4,
    hidden_act="silu",
    initializer_range=0.02,
    layer_norm_eps=1e-05,
    layer_switch=4,
    logit_scale=0.25,
    max_position_embeddings=132096,
    model_type="cohere2",
    num_hidden_layers=8,
    order_of_interleaved_layers="local_attn_first",
    pad_token_id=0,
    position_embedding_type="rope_gptj",
    rope_scaling=None,
    rope_theta=50000,
    rotary_pct=1.0,
    sliding_window=4096,
    sliding_window_pattern=4,
    torch_dtype="bfloat16",
    transformers_version="4.48.0.dev0",
    use_cache=True,
    use_embedding_sharing=True,
    use_gated_activation=True,
    use_parallel_block=True,
    use_parallel_embedding=True,
    use_qk_norm=False,
)

# c4ai-command-r-08-2024's config.json keys at a tiny size
_R = dict(
    _TINY,
    model_max_length=131072,
    architectures=["CohereForCausalLM"],
    attention_bias=False,
    attention_dropout=0.0,
    bos_token_id=5,
    eos_token_id=60,
    hidden_act="silu",
    initializer_range=0.02,
    layer_norm_eps=1e-05,
    logit_scale=0.0625,
    max_position_embeddings=131072,
    model_type="cohere",
    num_hidden_layers=2,
    pad_token_id=0,
    rope_theta=4000000,
    torch_dtype="float16",
    transformers_version="4.44.0",
    use_cache=True,
    use_qk_norm=False,
)


def test_command_r7b_config_read():
    cfg = config_from_hf(_R7B)
    S, F = "sliding_attention", "full_attention"
    assert cfg.layer_types == (S, S, S, F) * 2
    assert cfg.rope_layers == (True, True, True, False) * 2  # Cohere2Attention: RoPE only with a window
    assert cfg.sliding_window == 4096 and cfg.head_dim == 4 and cfg.tie_word_embeddings
    assert cfg.layer_norm and cfg.parallel_mlp and cfg.rope_interleaved
    assert cfg.logits_scaling == 4.0 and cfg.rms_norm_eps == 1e-5
    assert cfg.rope["default"]["rope_theta"] == 50000
    rotates = [layer.parallel.self_attn.rope for layer in CausalLM(cfg, rng=0).model.layers]
    assert rotates == [True, True, True, False] * 2


def test_command_r_config_read():
    cfg = config_from_hf(_R)
    assert cfg.layer_types == ("full_attention",) * 2 and cfg.rope_layers is None
    assert cfg.layer_norm and cfg.parallel_mlp and cfg.rope_interleaved and cfg.logits_scaling == 16.0
    assert cfg.rope["default"]["rope_theta"] == 4000000 and cfg.tie_word_embeddings


def test_command_r_plus_qk_norm_read():
    """``use_qk_norm`` (Command R+): each head's q and k through a bias-free LayerNorm with its own
    weight row (``qk_norm_scope`` "each_head", eps ``layer_norm_eps``), weights ``(heads, head_dim)``
    and ``(kv_heads, head_dim)``; null reads as false (CohereConfig's default)."""
    cfg = config_from_hf(dict(_R, use_qk_norm=True, layer_norm_eps=1e-4))
    assert cfg.qk_norm and cfg.qk_norm_scope == "each_head"
    a = cfg.attention_config("full_attention", 0)
    assert a.qk_norm and a.qk_norm_scope == "each_head" and a.qk_norm_eps == 1e-4
    sd = CausalLM(cfg, rng=0).state_dict()
    assert sd["model.layers.0.self_attn.q_norm.weight"].shape == (4, 4)
    assert sd["model.layers.0.self_attn.k_norm.weight"].shape == (2, 4)
    assert not config_from_hf(dict(_R, use_qk_norm=None)).qk_norm


def _each_head_mha(**kw):
    from npattn import MultiHeadAttention

    m = MultiHeadAttention(
        16, 16, num_heads=4, num_kv_heads=2, causal=True, rope=True, rope_interleaved=True, qk_norm=True,
        qk_norm_scope="each_head", qk_norm_eps=1e-4, rng=0, **kw,
    )  # fmt: skip
    rng = np.random.default_rng(3)
    m.q_norm.weight.data[:] = 1 + 0.3 * rng.standard_normal((4, 4))
    m.k_norm.weight.data[:] = 1 + 0.3 * rng.standard_normal((2, 4))
    return m, rng.standard_normal((2, 5, 16))


def test_each_head_qk_norm_formula():
    """``qk_norm_scope="each_head"``: the scores are those of q and k each LayerNormed over its
    head's features (mean subtracted, biased variance, eps inside), times the head's own weight
    row, before RoPE (on interleaved pairs), written out with numpy."""
    from npattn.functional import scaled_dot_product_attention

    m, x = _each_head_mha()

    def normed(t, w):  # (B, L, h * 4) -> each head normed, times its row
        t = t.reshape(t.shape[:-1] + w.shape)
        t = (t - t.mean(-1, keepdims=True)) / np.sqrt(t.var(-1, keepdims=True) + 1e-4) * w
        return t.reshape(t.shape[:-2] + (-1,))

    q = normed(m.W_query(x), m.q_norm.weight.data)
    k = normed(m.W_key(x), m.k_norm.weight.data)

    def heads(t, h):
        return t.reshape(2, 5, h, 4).swapaxes(1, 2)

    qr = _interleaved_rope(heads(q, 4))
    kr = np.repeat(_interleaved_rope(heads(k, 2)), 2, axis=1)
    v = np.repeat(heads(m.W_value(x), 2), 2, axis=1)
    att = scaled_dot_product_attention(qr, kr, v, is_causal=True)[0]
    want = m.out_proj(att.swapaxes(1, 2).reshape(2, 5, 16))
    with no_grad():
        np.testing.assert_allclose(m(x), want, rtol=1e-12, atol=1e-12)


def _interleaved_rope(t, base=10000.0):
    """RoPE on the pairs (2i, 2i + 1) of ``t (B, h, L, d)`` at positions 0..L-1."""
    d = t.shape[-1]
    ang = np.arange(t.shape[-2])[:, None] * base ** (-np.arange(0, d, 2) / d)
    c, s = np.cos(ang), np.sin(ang)
    a, b = t[..., 0::2], t[..., 1::2]
    out = np.empty_like(t)
    out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
    return out


def test_each_head_qk_norm_derivatives():
    """Backward and forward mode against central differences (gradcheck, both modes), second order
    against central differences of the backward (gradgradcheck), every parameter (the two weight
    rows included); qk_norm_unit_offset refused with it, by name."""
    from npattn import gradcheck
    from npattn.testing import gradgradcheck

    m, x = _each_head_mha()
    assert gradcheck(m, x, mode="both").ok
    assert gradgradcheck(m, x).ok
    with pytest.raises(ValueError, match="qk_norm_unit_offset"):
        _each_head_mha(qk_norm_unit_offset=True)


def test_rope_base_defaults():
    """A dict without a RoPE base: CohereConfig's 500000, Cohere2Config's 10000."""
    assert config_from_hf(tiny_config("cohere", rope_theta=None)).rope["default"]["rope_theta"] == 500000
    assert config_from_hf(tiny_config("cohere2", rope_theta=None)).rope["default"]["rope_theta"] == 10000


@pytest.mark.parametrize("pattern", [1, 2, 3, 5])
def test_sliding_window_pattern_makes_the_layer_types(pattern):
    """Left out, ``layer_types`` is every ``pattern``-th layer full (the last of each period), as
    Cohere2Config makes it; with ``layer_types`` given the pattern is not read."""
    d = tiny_config("cohere2", num_hidden_layers=5, sliding_window_pattern=pattern)
    want = tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(5))
    assert config_from_hf(d).layer_types == want
    lt = ["full_attention", "sliding_attention"] * 2 + ["full_attention"]
    cfg = config_from_hf(dict(d, layer_types=lt))
    assert cfg.layer_types == tuple(lt) and cfg.rope_layers == tuple(t == "sliding_attention" for t in lt)
    if T is not None:
        short = dict(d)
        short.pop("model_type")
        assert tuple(T.Cohere2Config(**short).layer_types) == want


@pytest.mark.parametrize(
    "family, change, key",
    [
        ("cohere2", dict(use_qk_norm=True), "use_qk_norm"),
        ("cohere2", dict(head_dim=8), "head_dim"),
        ("cohere", dict(use_parallel_block=False), "use_parallel_block"),
        ("cohere2", dict(use_gated_activation=False), "use_gated_activation"),
        ("cohere", dict(position_embedding_type="rope"), "position_embedding_type"),
        ("cohere2", dict(rotary_pct=0.5), "rotary_pct"),
        ("cohere2", dict(use_embedding_sharing=False), "use_embedding_sharing"),
        ("cohere", dict(tie_word_embeddings=False, use_embedding_sharing=True), "use_embedding_sharing"),
        ("cohere2", dict(order_of_interleaved_layers="global_attn_first"), "order_of_interleaved_layers"),
        ("cohere2", dict(rms_norm_eps=1e-6), "rms_norm_eps"),
        ("cohere", dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
        ("cohere2", dict(layer_types=["sliding_attention", "linear_attention", "full_attention"]), "layer_types"),
        ("cohere2", dict(sliding_window=None), "sliding_window"),
        ("cohere2", dict(logit_scale=0.0), "logit_scale"),
        ("cohere", dict(layer_norm_eps=-1.0), "layer_norm_eps"),
        ("cohere", dict(mlp_bias=True), "mlp_bias"),
    ],
)
def test_refusals_name_the_key(family, change, key):
    with pytest.raises(ValueError, match=key):
        config_from_hf(tiny_config(family, **change))


@pytest.mark.parametrize("family", ["cohere2", "cohere"])
def test_the_parallel_block_without_torch(family):
    """One layer: ``x + attn(n(x)) + mlp(n(x))`` with ``n`` the mean-subtracted LayerNorm (weight,
    no bias, ``layer_norm_eps``), from the layer's own modules; its backward is the sum of both
    branches' through the one norm."""
    m = CausalLM(tiny_config(family), rng=0)
    layer = m.model.layers[0]
    norm = layer.input_layernorm
    assert isinstance(norm, LayerNorm) and norm.bias is None and norm.eps == 1e-4
    assert isinstance(m.model.norm, LayerNorm) and m.model.norm.bias is None
    assert isinstance(layer.attention, ParallelSum) and layer.mlp is None
    assert not hasattr(layer, "post_attention_layernorm")
    rng = np.random.default_rng(0)
    norm.weight.data[:] = 1 + 0.3 * rng.standard_normal(16)
    x = rng.standard_normal((2, 5, 16))
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    n = (x - mu) / np.sqrt(var + 1e-4) * norm.weight.data
    with no_grad():
        want = x + layer.attention.self_attn(n) + layer.attention.mlp(n)
        np.testing.assert_allclose(layer(x), want, rtol=1e-12, atol=1e-12)
    names = {k.split(".", 3)[3] for k in m.state_dict() if k.startswith("model.layers.0.")}
    assert "self_attn.q_proj.weight" in names and "mlp.gate_proj.weight" in names
    assert "input_layernorm.weight" in names and not any(k.startswith("parallel") for k in names)


def test_logits_times_logit_scale_without_torch():
    """The head's logits times ``logit_scale``: the same weights with another scale give the
    logits in that proportion."""
    a = CausalLM(tiny_config("cohere2"), rng=0)
    b = CausalLM(tiny_config("cohere2", logit_scale=1.2), rng=0)
    ids = np.array([[3, 1, 4, 1, 5]])
    with no_grad():
        np.testing.assert_allclose(b(ids), a(ids) * 3.0, rtol=1e-12)  # 1.2 / 0.4


@oracle
def test_command_r7b_with_biases_against_transformers():
    """Attention biases on all four projections, GQA, the default pattern of period 2 over 3
    layers: logits and every gradient.  The full layer rotates nothing, so its key bias moves every
    score of a query alike: its gradient is zero but for rounding (both sides must be)."""
    from _hf64 import build, check_cached_decoding, check_logits_and_grads, check_padded_batch, state_dict

    kw = tiny_config("cohere2", attention_bias=True, vocab_size=61)
    kw.pop("model_type")
    hf, cfg = build(T.Cohere2Config, T.Cohere2ForCausalLM, **kw)
    assert cfg["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    m = CausalLM.from_hf(state_dict(hf), cfg)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 61, (2, 7))
    dlogits = rng.standard_normal(ids.shape + (61,))
    check_logits_and_grads(m, hf, ids, dlogits, zero={"model.layers.1.self_attn.k_proj.bias"})
    check_cached_decoding(m, hf, ids)
    check_padded_batch(m, hf, 61, (6, 3), decode=2)

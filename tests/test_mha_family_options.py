"""``MultiHeadAttention``'s options for the open-model families: ``head_dim``, ``scale``,
``rope_scaling`` / ``partial_rotary_factor`` / ``rope_interleaved``, ``qk_norm_eps`` and the
``(1 + w)`` QK-norm, the output gate; and the rolling KV cache of sliding-window layers.
Finite differences for every gradient, cached decoding against the full pass, bounded memory,
bad arguments.  (Against Hugging Face's layers: test_mha_hf_families.py.)"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import npattn
from npattn.testing import gradcheck, rope_scalings

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4}
OPTIONS = {
    "head_dim": dict(head_dim=6, num_kv_heads=2),
    "scale": dict(scale=0.3, causal=True),
    "gate": dict(output_gate=True, causal=True),
    "gate_gqa_rope": dict(output_gate=True, num_kv_heads=2, rope=True, head_dim=6, causal=True),
    "gemma_norm": dict(
        qk_norm=True, qk_norm_eps=1e-6, qk_norm_unit_offset=True, rope=True, rope_base=100.0, head_dim=4
    ),
    "yarn_partial_interleaved": dict(
        rope=True, rope_scaling=YARN, partial_rotary_factor=0.5, rope_interleaved=True, head_dim=8
    ),
    "everything": dict(
        head_dim=6,
        num_kv_heads=2,
        output_gate=True,
        qk_norm=True,
        qk_norm_unit_offset=True,
        rope=True,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 2.0,
            "original_max_position_embeddings": 4,
        },
        partial_rotary_factor=2 / 3,
        scale=0.25,
        sinks=True,
        window=(2, 0),
        causal=True,
        qkv_bias=True,
    ),
}


def make(name, memory_efficient=False, d=12, heads=4, seed=0, **extra):
    m = npattn.MultiHeadAttention(d, d, heads, memory_efficient=memory_efficient, rng=seed, **OPTIONS[name], **extra)
    rng = np.random.default_rng(seed + 1)
    for n, p in m.named_parameters():  # norms, offsets and sinks away from their neutral start
        if "norm" in n or n == "sinks":
            p.data[...] = rng.normal(0.0, 0.5, p.data.shape)
    return m


@pytest.mark.parametrize("memory_efficient", [False, True])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_gradients_finite_differences(name, memory_efficient):
    m = make(name, memory_efficient)
    x = np.random.default_rng(2).standard_normal((2, 5, 12))
    report = gradcheck(m, x)
    assert report.ok, str(report)


def test_gate_in_cross_attention_finite_differences():
    m = npattn.MultiHeadAttention(8, 8, 2, kdim=6, vdim=5, output_gate=True, head_dim=3, rng=3)
    rng = np.random.default_rng(4)
    q, k, v = rng.standard_normal((2, 3, 8)), rng.standard_normal((2, 4, 6)), rng.standard_normal((2, 4, 5))
    report = gradcheck(m, q, k, v)
    assert report.ok, str(report)


def test_the_gate_multiplies_the_attention_output_by_its_sigmoid():
    """Against the explicit formula: the same module without the gate rows, times sigmoid(g)."""
    m = make("gate")
    plain = npattn.MultiHeadAttention(12, 12, 4, causal=True, rng=0)
    w = m.W_query.weight.data.reshape(4, 2, 3, 12)  # (heads, query|gate, hd, d_in)
    plain.load_state_dict(
        {
            "W_query.weight": w[:, 0].reshape(12, 12),
            "W_key.weight": m.W_key.weight.data,
            "W_value.weight": m.W_value.weight.data,
            "out_proj.weight": np.eye(12),
            "out_proj.bias": np.zeros(12),
        }
    )
    x = np.random.default_rng(5).standard_normal((2, 5, 12))
    attn = plain(x)
    gate = x @ w[:, 1].reshape(12, 12).T
    expected = (attn / (1 + np.exp(-gate))) @ m.out_proj.weight.data.T + m.out_proj.bias.data
    np.testing.assert_allclose(m(x), expected, rtol=0, atol=1e-12)


def test_head_dim_shapes_and_default():
    m = npattn.MultiHeadAttention(10, 14, 4, num_kv_heads=2, head_dim=6, output_gate=True)
    shapes = {n: p.shape for n, p in m.named_parameters()}
    assert shapes["W_query.weight"] == (48, 10) and shapes["W_key.weight"] == (12, 10)
    assert shapes["out_proj.weight"] == (14, 24) and m(np.zeros((3, 10))).shape == (3, 14)
    # without head_dim nothing changes: the same draws, the same parameters as before
    a, b = npattn.MultiHeadAttention(12, 12, 4, rng=7), npattn.MultiHeadAttention(12, 12, 4, head_dim=3, rng=7)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert np.array_equal(p.data, q.data), n
    assert "head_dim=6" in repr(m) and "output_gate=True" in repr(m)
    r = repr(make("everything"))
    for part in ("rope_scaling='llama3'", "partial_rotary_factor=0.66", "scale=0.25", "qk_norm_unit_offset=True"):
        assert part in r, (part, r)
    assert "rope_interleaved=True" in repr(make("yarn_partial_interleaved"))


def test_scale_and_unit_offset_norm_mean_what_they_say():
    x = np.random.default_rng(6).standard_normal((2, 5, 12))
    a = npattn.MultiHeadAttention(12, 12, 4, rng=1, scale=0.5)
    b = npattn.MultiHeadAttention(12, 12, 4, rng=1)
    b.W_query.weight.data[...] *= 0.5 * np.sqrt(3)  # default scale 1/sqrt(3): fold the ratio into W_query
    np.testing.assert_allclose(a(x), b(x), rtol=0, atol=1e-12)
    g = npattn.MultiHeadAttention(12, 12, 4, rng=1, qk_norm=True, qk_norm_unit_offset=True, qk_norm_eps=1e-3)
    p = npattn.MultiHeadAttention(12, 12, 4, rng=1, qk_norm=True, qk_norm_eps=1e-3)
    assert np.array_equal(g.q_norm.weight.data, np.zeros(3)) and g.q_norm.eps == 1e-3
    np.testing.assert_allclose(g(x), p(x), rtol=0, atol=1e-12)  # (1 + 0) = 1
    g.k_norm.weight.data[...] = 0.5
    p.k_norm.weight.data[...] = 1.5
    np.testing.assert_allclose(g(x), p(x), rtol=0, atol=1e-12)


def test_float32_stays_float32():
    m = make("everything").to(np.float32)
    x = np.random.default_rng(7).standard_normal((2, 5, 12)).astype(np.float32)
    y = m(x)
    dx = m.backward(np.ones_like(y))
    assert y.dtype == dx.dtype == np.float32
    assert all(p.grad.dtype == np.float32 for _, p in m.named_parameters())


# ------------------------------------------------------------------------ cached decoding, rolling


def decode(m, x, split):
    m.reset_kv_cache()
    outs, i = [], 0
    for n in split:
        outs.append(m(x[..., i : i + n, :], use_cache=True))
        i += n
    return np.concatenate(outs, axis=-2)


@pytest.mark.parametrize("memory_efficient", [False, True])
@pytest.mark.parametrize("name", ["gate_gqa_rope", "gemma_norm", "yarn_partial_interleaved", "everything"])
def test_cached_decoding_equals_the_full_pass(name, memory_efficient):
    extra = {} if "causal" in OPTIONS[name] else {"causal": True}
    m = make(name, memory_efficient, **extra).eval()
    x = np.random.default_rng(8).standard_normal((2, 9, 12))
    full = m(x)
    for split in ([1] * 9, [4, 1, 3, 1], [9]):
        np.testing.assert_allclose(decode(m, x, split), full, rtol=0, atol=1e-12)


@pytest.mark.parametrize("memory_efficient", [False, True])
@pytest.mark.parametrize(
    "opts",
    [
        dict(window=(3, 0), causal=True, rope=True),
        dict(window=(2, -1), causal=True, num_kv_heads=2, sinks=True, rope=True, alibi=True),
        dict(window=(4, 0), rope=True, add_bias_kv=True, add_zero_attn=True),  # (left, 0): causal by the window
        dict(window=(0, 0), causal=True),
    ],
)
def test_rolling_cache_keeps_memory_bounded_and_the_logits(opts, memory_efficient):
    m = npattn.MultiHeadAttention(8, 8, 4, rng=9, memory_efficient=memory_efficient, **opts).eval()
    if m.sinks is not None:
        m.sinks.data[...] = np.random.default_rng(10).normal(0, 1, 4)
    left = opts["window"][0]
    x = np.random.default_rng(11).standard_normal((2, 300, 8))
    full = m(x)
    m.reset_kv_cache()
    outs = [m(x[:, :5], use_cache=True)]  # a prompt, then one token at a time
    capacities = set()
    for t in range(5, 300):
        outs.append(m(x[:, t : t + 1], use_cache=True))
        assert m.kv_cache_size <= left and m.kv_cache_length == t + 1
        capacities.add(m._kv_cache.k.shape[-2])
    assert max(capacities) <= max(16, 2 * (left + 1)) * 2  # bounded: never grows with the sequence
    np.testing.assert_allclose(np.concatenate(outs, axis=1), full, rtol=0, atol=1e-12)


def test_rolling_cache_after_a_long_prompt_gives_the_memory_back():
    m = npattn.MultiHeadAttention(8, 8, 2, window=(3, 0), causal=True, rope=True, rng=0).eval()
    x = np.random.default_rng(12).standard_normal((1, 200, 8))
    m(x[:, :190], use_cache=True)
    assert m.kv_cache_size == 3 and m.kv_cache_length == 190
    m(x[:, 190:191], use_cache=True)
    assert m._kv_cache.k.shape[-2] <= 16 and m.kv_cache_size == 3
    np.testing.assert_allclose(m(x[:, 191:], use_cache=True), m(x)[:, 191:], rtol=0, atol=1e-12)


def test_rolling_cache_masks_and_weights_still_cover_every_key_seen():
    """The contract of the cache is unchanged: masks cover all T + Lq keys, the weights too (the
    rolled-out keys, hidden by the window, with weight 0)."""
    m = npattn.MultiHeadAttention(8, 8, 2, window=(2, 0), causal=True, rng=1).eval()
    rng = np.random.default_rng(13)
    x = rng.standard_normal((2, 6, 8))
    pad = np.zeros((2, 6), bool)
    pad[1, 4] = True
    extra = rng.uniform(-1, 1, (6, 6))
    full, w_full = m(x, key_padding_mask=pad, attn_mask=extra, need_weights=True)
    m.reset_kv_cache()
    outs = []
    for t in range(6):
        o, w = m(
            x[:, t : t + 1],
            use_cache=True,
            key_padding_mask=pad[:, : t + 1],
            attn_mask=extra[t : t + 1, : t + 1],
            need_weights=True,
        )
        outs.append(o)
        assert w.shape == (2, 2, 1, t + 1)
        np.testing.assert_allclose(w, w_full[..., t : t + 1, : t + 1], rtol=0, atol=1e-12)
    np.testing.assert_allclose(np.concatenate(outs, axis=1), full, rtol=0, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(
    scaling=rope_scalings(types=("default", "linear", "yarn", "llama3"), max_position_embeddings=4),
    gate=st.booleans(),
    left=st.sampled_from([None, 0, 1, 3]),
    partial=st.sampled_from([1.0, 0.5]),
    interleaved=st.booleans(),
    split=st.lists(st.integers(1, 3), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_property_cached_decoding_equals_the_full_pass(scaling, gate, left, partial, interleaved, split, seed):
    """Any scaling but ``dynamic`` (its frequencies follow the length seen, so cached keys keep
    the rotation of their call, as in Hugging Face), gate, window (rolling cache), partial rotary."""
    m = npattn.MultiHeadAttention(
        8,
        8,
        2,
        head_dim=4,
        num_kv_heads=1,
        causal=True,
        rope=True,
        rope_scaling=scaling,
        partial_rotary_factor=partial,
        rope_interleaved=interleaved,
        output_gate=gate,
        window=None if left is None else (left, 0),
        rng=seed,
    ).eval()
    x = np.random.default_rng(seed).standard_normal((2, sum(split), 8))
    np.testing.assert_allclose(decode(m, x, split), m(x), rtol=0, atol=1e-12)


def test_no_rolling_without_a_window_that_forgets():
    for opts in (dict(causal=True), dict(window=(-1, 0), causal=True), dict(window=(2, 1))):
        m = npattn.MultiHeadAttention(8, 8, 2, rng=0, **opts).eval()
        m(np.ones((1, 5, 8)), use_cache=True)
        m(np.ones((1, 1, 8)), use_cache=True)
        assert m.kv_cache_size == m.kv_cache_length == 6


# ----------------------------------------------------------------------------------- bad input


def raises(exc, name, fn, *parts):
    with pytest.raises(exc, match=f"^{name}") as info:
        fn()
    for part in parts:
        assert part in str(info.value), (part, str(info.value))


def test_bad_options_are_refused_naming_them():
    def mha(**kw):
        return npattn.MultiHeadAttention(8, 8, 2, **kw)

    raises(ValueError, "head_dim", lambda: mha(head_dim=0))
    raises(TypeError, "head_dim", lambda: mha(head_dim=2.0))
    raises(ValueError, "d_out", lambda: npattn.MultiHeadAttention(8, 9, 2))  # no head_dim: d_out must split
    assert npattn.MultiHeadAttention(8, 9, 2, head_dim=4).d_out == 9
    for bad in (0.0, -1.0, float("nan")):
        raises(ValueError, "scale", lambda: mha(scale=bad))
    raises(TypeError, "scale", lambda: mha(scale="0.5"))
    raises(TypeError, "scale", lambda: mha(scale=True))
    raises(ValueError, r"rope_scaling\['rope_type'\]", lambda: mha(rope=True, rope_scaling={"rope_type": "ntk"}), "ntk")
    raises(ValueError, r"rope_scaling\['factor'\]", lambda: mha(rope_scaling={"factor": 2.0}))
    raises(ValueError, "rope_scaling", lambda: mha(rope=True, rope_scaling={"rope_type": "linear"}), "'factor'")
    raises(TypeError, "rope_scaling", lambda: mha(rope_scaling="yarn"))
    raises(ValueError, "rope_base", lambda: mha(rope_base=50.0, rope_scaling={"rope_theta": 60.0}), "60.0")
    assert mha(rope=True, rope_scaling={"rope_theta": 60.0}).rope_base == 60.0
    raises(ValueError, "partial_rotary_factor", lambda: mha(rope=True, partial_rotary_factor=1.5))
    raises(ValueError, "partial_rotary_factor", lambda: mha(rope=True, partial_rotary_factor=0.0))
    raises(TypeError, "partial_rotary_factor", lambda: mha(rope=True, partial_rotary_factor="half"))
    raises(ValueError, "partial_rotary_factor", lambda: mha(rope=True, partial_rotary_factor=0.2), "got 0")
    raises(
        ValueError,
        "partial_rotary_factor",
        lambda: mha(rope=True, partial_rotary_factor=0.5, rope_scaling={"partial_rotary_factor": 0.25}),
        "0.25",
    )
    assert mha(rope=True, rope_scaling={"partial_rotary_factor": 0.5}).rotary_dim == 2
    raises(ValueError, "rope", lambda: npattn.MultiHeadAttention(8, 8, 2, head_dim=3, rope=True), "even")
    assert npattn.MultiHeadAttention(8, 8, 2, head_dim=6, rope=True, partial_rotary_factor=2 / 3).rotary_dim == 4
    raises(TypeError, "rope_interleaved", lambda: mha(rope_interleaved=1))
    raises(ValueError, "qk_norm_eps", lambda: mha(qk_norm=True, qk_norm_eps=-1e-6))
    raises(TypeError, "qk_norm_eps", lambda: mha(qk_norm=True, qk_norm_eps="1e-6"))
    raises(TypeError, "qk_norm_unit_offset", lambda: mha(qk_norm=True, qk_norm_unit_offset=1))
    raises(TypeError, "output_gate", lambda: mha(output_gate="yes"))

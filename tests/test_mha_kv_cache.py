"""``MultiHeadAttention``'s KV cache: ``forward(x, use_cache=True)`` and ``reset_kv_cache()``.

A causal sequence fed token by token (or as a prefill chunk then decoding steps) gives the outputs
of one full forward over it, to 1e-12, with every option that depends on positions (RoPE, window,
ALiBi, bottom-right alignment), grouped-query heads, sinks, QK-norm and torch's extra keys, in
both attention cores."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import npattn

H, HD = 4, 4
D = H * HD

CONFIGS = {
    "causal": {},
    "rope": {"rope": True},
    "gqa_rope": {"num_kv_heads": 2, "rope": True},
    "mqa": {"num_kv_heads": 1, "qkv_bias": True},
    "window": {"window": (2, 0)},
    "sinks": {"sinks": True},
    "alibi": {"alibi": True},
    "softcap_qk_norm": {"softcap": 1.5, "qk_norm": True},
    "extras": {"add_bias_kv": True, "add_zero_attn": True},
    "everything": {
        "num_kv_heads": 2,
        "rope": True,
        "window": (3, 0),
        "sinks": True,
        "alibi": True,
        "softcap": 2.0,
        "qk_norm": True,
        "qkv_bias": True,
        "add_bias_kv": True,
        "add_zero_attn": True,
    },
}
SPLITS = {"token_by_token": [1] * 7, "prefill_then_decode": [4, 1, 1, 1], "chunks": [2, 3, 2]}


def make(cfg, memory_efficient=False, seed=0, **extra):
    m = npattn.MultiHeadAttention(
        D, D, H, causal=True, memory_efficient=memory_efficient, rng=seed, **CONFIGS[cfg], **extra
    )
    rng = np.random.default_rng(seed + 1)
    if m.sinks is not None:
        m.sinks.data[...] = rng.normal(0, 1, H)
    if m.qk_norm:
        m.q_norm.weight.data[...] = rng.uniform(0.5, 1.5, HD)
        m.k_norm.weight.data[...] = rng.uniform(0.5, 1.5, HD)
    return m.eval()


def decode(m, x, split):
    m.reset_kv_cache()
    outs, i = [], 0
    for n in split:
        outs.append(m(x[..., i : i + n, :], use_cache=True))
        i += n
    assert i == x.shape[-2] and m.kv_cache_length == i
    return np.concatenate(outs, axis=-2)


@pytest.mark.parametrize("memory_efficient", [False, True])
@pytest.mark.parametrize("split", sorted(SPLITS))
@pytest.mark.parametrize("cfg", sorted(CONFIGS))
def test_cached_equals_full_recomputation(cfg, split, memory_efficient):
    m = make(cfg, memory_efficient)
    x = np.random.default_rng(2).standard_normal((2, 7, D))
    full = m(x)
    np.testing.assert_allclose(decode(m, x, SPLITS[split]), full, rtol=0, atol=1e-12)


@pytest.mark.parametrize("cfg", ["causal", "everything"])
def test_cached_unbatched_and_many_batch_axes(cfg):
    m = make(cfg)
    for shape in ((7, D), (2, 3, 7, D)):
        x = np.random.default_rng(3).standard_normal(shape)
        np.testing.assert_allclose(decode(m, x, [3, 1, 1, 2]), m(x), rtol=0, atol=1e-12)


def test_cached_with_masks_over_all_keys():
    """Masks given to a cached call cover every cached key (T + Lq columns)."""
    m = make("gqa_rope")
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 6, D))
    pad = np.zeros((2, 6), bool)
    pad[0, 1] = True
    extra = rng.uniform(-1, 1, (6, 6))
    full = m(x, key_padding_mask=pad, attn_mask=extra)
    m.reset_kv_cache()
    a = m(x[:, :4], use_cache=True, key_padding_mask=pad[:, :4], attn_mask=extra[:4, :4])
    b = m(x[:, 4:5], use_cache=True, key_padding_mask=pad[:, :5], attn_mask=extra[4:5, :5])
    c = m(x[:, 5:], use_cache=True, key_padding_mask=pad, attn_mask=extra[5:, :])
    np.testing.assert_allclose(np.concatenate([a, b, c], axis=1), full, rtol=0, atol=1e-12)


def test_cached_need_weights_are_the_last_rows():
    m = make("everything")
    x = np.random.default_rng(5).standard_normal((2, 5, D))
    _, w_full = m(x, need_weights=True)
    m.reset_kv_cache()
    m(x[:, :4], use_cache=True)
    _, w = m(x[:, 4:], use_cache=True, need_weights=True)
    np.testing.assert_allclose(w, w_full[..., 4:, :], rtol=0, atol=1e-12)


def test_cache_holds_only_the_kv_heads_after_rope():
    m = make("gqa_rope")
    x = np.random.default_rng(6).standard_normal((2, 5, D))
    m.reset_kv_cache()
    m(x, use_cache=True)
    k, v = m._kv_cache.k[..., :5, :], m._kv_cache.v[..., :5, :]
    assert k.shape == (2, 2, 5, HD) and v.shape == (2, 2, 5, HD)
    kk = x @ m.W_key.weight.data.T
    kk = kk.reshape(2, 5, 2, HD).swapaxes(1, 2)
    rotated, _ = npattn.functional.rope(kk, base=m.rope_base)
    np.testing.assert_allclose(k, rotated, rtol=0, atol=1e-13)


def test_cache_grows_past_its_first_capacity():
    m = make("rope")
    x = np.random.default_rng(7).standard_normal((1, 40, D))
    np.testing.assert_allclose(decode(m, x, [1] * 40), m(x), rtol=0, atol=1e-12)


def test_reset_starts_a_new_sequence():
    m = make("rope")
    rng = np.random.default_rng(8)
    x, y = rng.standard_normal((2, 3, D)), rng.standard_normal((2, 4, D))
    decode(m, x, [3])
    m.reset_kv_cache()
    assert m.kv_cache_length == 0
    np.testing.assert_allclose(m(y, use_cache=True), m(y), rtol=0, atol=1e-12)


def test_cached_call_keeps_no_backward_state():
    m = make("causal").train()
    x = np.random.default_rng(9).standard_normal((2, 3, D))
    out = m(x)  # a normal forward first: its state is dropped by the cached call
    m(x, use_cache=True)
    with pytest.raises(RuntimeError, match="backward"):
        m.backward(np.ones_like(out))
    out = m(x)  # an uncached forward works as usual and leaves the cache alone
    m.backward(np.ones_like(out))
    assert m.kv_cache_length == 3


def test_use_cache_refusals_change_nothing():
    m = make("rope")
    rng = np.random.default_rng(10)
    x = rng.standard_normal((2, 3, D))
    m(x, use_cache=True)
    before = (m._kv_cache.k.copy(), m.kv_cache_length)
    with pytest.raises(ValueError, match="use_cache"):
        m(x, x, x, use_cache=True)
    with pytest.raises(ValueError, match="batch shape"):
        m(rng.standard_normal((3, 1, D)), use_cache=True)
    with pytest.raises(ValueError, match="key_padding_mask"):
        m(x[:, :1], use_cache=True, key_padding_mask=np.zeros((2, 1), bool))  # must cover all 4 keys
    with pytest.raises(ValueError, match="attn_mask"):
        m(x[:, :1], use_cache=True, attn_mask=np.ones((1, 1), bool) & np.ones((1, 2), bool))
    with pytest.raises(TypeError, match="use_cache"):
        m(x[:, :1], use_cache=1)
    assert m.kv_cache_length == before[1]
    np.testing.assert_array_equal(m._kv_cache.k, before[0])
    # and the sequence goes on as if nothing happened
    x2 = rng.standard_normal((2, 1, D))
    got = m(x2, use_cache=True)
    full = m(np.concatenate([x, x2], axis=1))
    np.testing.assert_allclose(got, full[:, 3:], rtol=0, atol=1e-12)


def test_cache_under_no_grad_and_float32():
    m = make("everything", dtype=np.float32)
    x = np.random.default_rng(11).standard_normal((2, 6, D)).astype(np.float32)
    with npattn.no_grad():
        got = decode(m, x, [2, 1, 1, 1, 1])
    assert got.dtype == np.float32 and m._kv_cache.k.dtype == np.float32
    np.testing.assert_allclose(got, m(x), rtol=0, atol=2e-5)


def test_gpt_style_usage():
    """What a GPT's generation loop does: prefill, then one token at a time."""
    m = make("gqa_rope")
    x = np.random.default_rng(12).standard_normal((1, 6, D))
    m.reset_kv_cache()
    first = m(x[:, :3], use_cache=True)
    steps = [m(x[:, i : i + 1], use_cache=True) for i in range(3, 6)]
    np.testing.assert_allclose(np.concatenate([first] + steps, axis=1), m(x), rtol=0, atol=1e-12)


# -- property: any configuration, any split -----------------------------------------------------------
@st.composite
def cached_cases(draw):
    kw = {
        "num_kv_heads": draw(st.sampled_from([1, 2, 4])),
        "rope": draw(st.booleans()),
        "qk_norm": draw(st.booleans()),
        "alibi": draw(st.booleans()),
        "sinks": draw(st.booleans()),
        "qkv_bias": draw(st.booleans()),
        "add_bias_kv": draw(st.booleans()),
        "add_zero_attn": draw(st.booleans()),
        "memory_efficient": draw(st.booleans()),
    }
    if draw(st.booleans()):
        kw["window"] = (draw(st.integers(-1, 4)), 0)
    if draw(st.booleans()):
        kw["softcap"] = draw(st.floats(0.5, 5.0))
    n = draw(st.integers(2, 9))
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=n - 1)))
    split = [b - a for a, b in zip([0] + cuts, cuts + [n])]
    lead = draw(st.sampled_from([(), (1,), (2,), (2, 1)]))
    return kw, split, lead, draw(st.integers(0, 2**16))


@settings(max_examples=60)
@given(case=cached_cases())
def test_property_cached_equals_full(case):
    kw, split, lead, seed = case
    m = npattn.MultiHeadAttention(D, D, H, causal=True, rng=seed, **kw).eval()
    rng = np.random.default_rng(seed)
    if m.sinks is not None:
        m.sinks.data[...] = rng.normal(0, 1, H)
    x = rng.standard_normal(lead + (sum(split), D))
    np.testing.assert_allclose(decode(m, x, split), m(x), rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_grouped_heads_last_output_is_the_grouped_output(dtype):
    """With grouped-query heads the core writes each group's rows straight into the heads-last
    output (merging heads before out_proj is then a view, not a copy) (issue 32, item 5): the
    same numbers as the grouped layout, bit for bit."""
    rng = np.random.default_rng(6)
    q = rng.standard_normal((2, 4, 300, 8)).astype(dtype)
    k, v = (rng.standard_normal((2, 2, 300, 8)).astype(dtype) for _ in range(2))
    from npattn.functional import kernels as K

    a, _ = K.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, heads_last=True)
    b, _ = K.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert a.shape == b.shape and a.swapaxes(-2, -3).flags.c_contiguous
    assert np.array_equal(a, b)

"""``npattn.nn.kv_cache``: the KV cache's public API (append, keys/values, length, position, trim,
nbytes, reset) on its own, and ``MultiHeadAttention`` split into its core and torch's extras."""

import numpy as np
import pytest

import npattn
from npattn.nn.attention_core import MultiHeadAttentionCore
from npattn.nn.kv_cache import KVCache, RollingKVCache


def _kv(rng, n, lead=(2, 3), hd=4, hv=5, dtype=np.float64):
    return rng.standard_normal(lead + (n, hd)).astype(dtype), rng.standard_normal(lead + (n, hv)).astype(dtype)


def test_append_returns_every_held_token_in_order():
    rng = np.random.default_rng(0)
    cache = KVCache()
    assert cache.length == cache.position == cache.nbytes == cache.capacity == 0 and cache.lead is None
    chunks = [_kv(rng, n) for n in (3, 1, 20, 2)]  # the third outgrows the first buffers
    for i, (k, v) in enumerate(chunks):
        ks, vs = cache.append(k, v)
        want_k = np.concatenate([c[0] for c in chunks[: i + 1]], axis=-2)
        want_v = np.concatenate([c[1] for c in chunks[: i + 1]], axis=-2)
        np.testing.assert_array_equal(ks, want_k)
        np.testing.assert_array_equal(vs, want_v)
        np.testing.assert_array_equal(cache.keys, want_k)
        np.testing.assert_array_equal(cache.values, want_v)
    assert cache.length == cache.position == 26 and cache.lead == (2,)  # the batch axes, before (Hk, T, hd)
    assert cache.capacity >= 26
    assert cache.nbytes == 26 * 2 * 3 * (4 + 5) * 8  # held tokens only, not the spare room
    cache.trim()  # a full cache forgets nothing
    assert cache.length == 26
    cache.reset()
    assert cache.length == cache.position == cache.nbytes == 0 and cache.keys is None and cache.lead is None


def test_capacity_doubles_and_a_cast_regrows_in_the_new_dtype():
    rng = np.random.default_rng(1)
    cache = KVCache()
    cache.append(*_kv(rng, 3))
    assert cache.capacity == 16  # max(16, 2 * first chunk)
    k32, v32 = _kv(rng, 1, dtype=np.float32)
    ks, vs = cache.append(k32, v32)
    assert ks.dtype == vs.dtype == np.float32 and cache.length == 4
    np.testing.assert_array_equal(ks[..., 3:, :], k32)


def test_rolling_cache_keeps_the_last_tokens_and_counts_every_position():
    rng = np.random.default_rng(2)
    cache = RollingKVCache(keep=3)
    k, v = _kv(rng, 100)
    cache.append(k, v)
    cache.trim()
    assert cache.length == 3 and cache.position == 100
    np.testing.assert_array_equal(cache.keys, k[..., -3:, :])
    np.testing.assert_array_equal(cache.values, v[..., -3:, :])
    assert cache.capacity <= 16  # the long prompt's buffers were given back
    k2, v2 = _kv(rng, 2)
    ks, _ = cache.append(k2, v2)
    np.testing.assert_array_equal(ks, np.concatenate([k[..., -3:, :], k2], axis=-2))
    cache.trim()
    np.testing.assert_array_equal(cache.keys, np.concatenate([k[..., -1:, :], k2], axis=-2))
    assert (cache.length, cache.position) == (3, 102)


def test_modules_hold_the_public_caches():
    x = np.random.default_rng(3).standard_normal((1, 5, 8))
    full = npattn.MultiHeadAttention(8, 8, 2, causal=True, rng=0)
    rolling = npattn.MultiHeadAttention(8, 8, 2, causal=True, window=(2, 0), rng=0)
    with npattn.no_grad():
        full(x, use_cache=True)
        rolling(x, use_cache=True)
    assert type(full._kv_cache) is KVCache and type(rolling._kv_cache) is RollingKVCache
    assert full._kv_cache.nbytes == 5 * 2 * (4 + 4) * 8  # 5 tokens, two kv heads of 4 keys and 4 values
    assert rolling.kv_cache_size == rolling._kv_cache.length == 2 and rolling.kv_cache_length == 5


def test_options_are_one_object_checked_by_the_cores_check():
    m = npattn.MultiHeadAttention(
        8, 8, 2, causal=True, window=[3, 0], causal_align="bottom_right", softcap=5, alibi=True
    )
    o = m.options
    assert (o.window, o.causal_align, o.softcap) == ((3, 0), "bottom_right", 5.0)
    assert (m.window, m.causal_align, m.softcap) == (o.window, o.causal_align, o.softcap)
    np.testing.assert_array_equal(o.alibi_slopes, m.alibi_slopes())
    x = np.random.default_rng(4).standard_normal((2, 4, 8))
    y = m(x)
    np.testing.assert_array_equal(m.to(np.float32)(x.astype(np.float32)).dtype, np.float32)  # slopes follow the cast
    assert y.dtype == np.float64
    # the same messages as npattn.functional.scaled_dot_product_attention's
    for kw, exc, text in [
        (dict(window=(-2, 0)), ValueError, "left = -2"),
        (dict(window=(1.5, 0)), TypeError, "1.5"),
        (dict(causal_align="bottom-right"), ValueError, "'bottom-right'"),
        (dict(softcap=0.0), ValueError, "0.0"),
    ]:
        name = next(iter(kw))
        with pytest.raises(exc, match=rf"^{name}: .*{text}"):
            npattn.MultiHeadAttention(8, 8, 2, **kw)
        with pytest.raises(exc, match=rf"^{name}: .*{text}"):
            npattn.functional.scaled_dot_product_attention(
                np.ones((2, 3, 4)), np.ones((2, 3, 4)), np.ones((2, 3, 4)), **kw
            )


@pytest.mark.parametrize("cross", [False, True])
def test_core_is_the_module_without_torch_extras(cross):
    rng = np.random.default_rng(5)
    kw = dict(causal=not cross, num_kv_heads=1, rope=True, qk_norm=True, sinks=True, window=(2, 1), rng=7)
    m, c = npattn.MultiHeadAttention(8, 8, 2, **kw), MultiHeadAttentionCore(8, 8, 2, **kw)
    assert list(m.state_dict()) == list(c.state_dict())
    c.load_state_dict({k: rng.standard_normal(v.shape) for k, v in m.state_dict().items()})
    m.load_state_dict(c.state_dict())
    x, mem = rng.standard_normal((2, 5, 8)), rng.standard_normal((2, 6, 8))
    args = (x, mem, mem) if cross else (x,)
    dy = rng.standard_normal((2, 5, 8))
    np.testing.assert_array_equal(m(*args), c(*args))
    dm, dc = m.backward(dy), c.backward(dy)
    for a, b in zip(dm if cross else [dm], dc if cross else [dc]):
        np.testing.assert_array_equal(a, b)
    for (n, p), (_, q) in zip(m.named_parameters(), c.named_parameters()):
        np.testing.assert_array_equal(p.grad, q.grad, err_msg=n)


def test_extra_keys_keep_the_state_dict_order():
    m = npattn.MultiHeadAttention(8, 8, 2, add_bias_kv=True, sinks=True, rng=0)
    assert list(m.state_dict())[:3] == ["bias_k", "bias_v", "sinks"]

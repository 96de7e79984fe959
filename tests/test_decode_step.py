"""The cached decoding step's own paths (issue 32, item 5): one query row of every grouped head in
one pass of the attention kernel, bit for bit the block loop's; no second validation inside the
model's layers; ``clear_saved``'s cached module list."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

import npattn.functional.attention as A
from npattn import no_grad
from npattn.functional import kernels as K
from npattn.models import CausalLM
from npattn.models import causal_lm as CL
from npattn.models.tiny import tiny_config
from npattn.nn.attention import MultiHeadAttention
from npattn.nn.layers import Linear, RMSNorm
from npattn.nn.module import Module


def _attend(q, k, v, kw, dout):
    out, cache = K.scaled_dot_product_attention(q, k, v, **kw)
    grads = K.scaled_dot_product_attention_backward(dout, cache)
    return out, cache, grads


def _loop_only(monkeypatch):
    """The block loop for every call, as before the one-row path."""
    monkeypatch.setattr(A, "_one_row_serves", lambda *a: False)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("heads", [(16, 8), (12, 3), (4, 1)])
@pytest.mark.parametrize("lead", [(), (1,), (2, 3)])
@pytest.mark.parametrize(
    "opts",
    [
        dict(is_causal=True, causal_align="bottom_right"),
        dict(is_causal=True, causal_align="top_left"),
        dict(is_causal=False),
        dict(is_causal=True, causal_align="bottom_right", window=(5, 0)),
        dict(is_causal=False, scale=1.0),
    ],
)
@pytest.mark.parametrize("keys", [0, 1, 7, 9, 130])
def test_one_query_row_of_every_group_is_the_block_loop_bit_for_bit(monkeypatch, dtype, heads, lead, opts, keys):
    rng = np.random.default_rng(keys + 7 * len(lead))
    hq, hk = heads
    E = 32 if keys % 2 else 16
    q = rng.standard_normal(lead + (hq, 1, E)).astype(dtype)
    k = rng.standard_normal(lead + (hk, keys + 5, E)).astype(dtype)[..., :keys, :]  # a cache's view
    v = rng.standard_normal(lead + (hk, keys + 5, E + 3)).astype(dtype)[..., :keys, :]
    dout = rng.standard_normal(lead + (hq, 1, E + 3)).astype(dtype)
    for heads_last in (True, False):
        kw = dict(opts, enable_gqa=True, heads_last=heads_last)
        scores = []
        monkeypatch.setattr(A._Rows, "scores", lambda self, blk, f=A._Rows.scores: scores.append(1) or f(self, blk))
        out, cache, grads = _attend(q, k, v, kw, dout)
        assert scores == []  # the one-row pass, not the loop's blocks
        with monkeypatch.context() as m:
            _loop_only(m)
            out0, cache0, grads0 = _attend(q, k, v, kw, dout)
        assert scores == [1] * (hq // hk)
        assert out.strides == out0.strides
        np.testing.assert_array_equal(out, out0)
        np.testing.assert_array_equal(cache.weights, cache0.weights)
        assert [p.shape for p in cache.p] == [p.shape for p in cache0.p]
        assert all(p.flags.c_contiguous for p in cache.p)
        for g, g0 in zip(grads, grads0):
            np.testing.assert_array_equal(g, g0)
        full_band = "window" not in opts and (not opts["is_causal"] or opts.get("causal_align") == "bottom_right")
        if heads_last and full_band and hq != hk and keys:  # a decoding step's call, no cache
            direct = A.decoding_attention(q, k, v, opts.get("scale"), hq // hk)
            assert direct.strides == out.strides
            np.testing.assert_array_equal(direct, out)
        monkeypatch.undo()


def test_the_loop_serves_what_the_one_row_pass_does_not(monkeypatch):
    """A mask, sinks, softcap, several query rows, or no grouping: the block loop."""
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((4, 1, 8)), rng.standard_normal((2, 6, 8)), rng.standard_normal((2, 6, 8))
    calls = []
    monkeypatch.setattr(A, "_one_row", lambda *a: calls.append(1))
    for kw in (
        dict(attn_mask=np.ones((4, 1, 6), bool)),
        dict(sinks=np.zeros(4)),
        dict(softcap=2.0),
        dict(alibi_slopes=np.ones(4)),
        dict(dropout_p=0.5, rng=0),
    ):
        A.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
    A.scaled_dot_product_attention(rng.standard_normal((4, 2, 8)), k, v, enable_gqa=True)
    A.scaled_dot_product_attention(rng.standard_normal((2, 1, 8)), k, v)
    assert calls == []


def _tiny(dtype=np.float64):
    return CausalLM(tiny_config("qwen3"), rng=0, dtype=dtype)


def _decode(m, prompt, steps):
    m.reset_kv_cache()
    with no_grad():
        lg = m(prompt, use_cache=True)
        out = [lg]
        for _ in range(steps):
            lg = m(lg[:, -1:].argmax(-1), use_cache=True, logits_to_keep=1)
            out.append(lg)
    return np.concatenate(out, axis=1)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_decoding_validates_at_the_model_edge_only(monkeypatch, dtype):
    """A cached step checks its ids once; the layers' norms, attention and MLP take their
    unvalidated ``_forward`` and give the validated path's logits bit for bit."""
    m = _tiny(dtype)
    prompt = np.random.default_rng(0).integers(0, 40, (2, 5))
    calls = []

    def spy(cls, name):
        f = getattr(cls, name)
        monkeypatch.setattr(cls, name, lambda self, *a, **kw: calls.append(name) or f(self, *a, **kw))

    spy(MultiHeadAttention, "_check_inputs")
    spy(RMSNorm, "_check_input")
    fast = _decode(m, prompt, 6)
    assert calls == []
    monkeypatch.setattr(CL, "_checked", lambda mod, x: mod(x))
    monkeypatch.setattr(CL, "is_grad_enabled", lambda: True)  # DecoderLayer takes the public calls
    checked = _decode(m, prompt, 6)
    assert calls.count("_check_inputs") == 7 * m.config.num_hidden_layers
    np.testing.assert_array_equal(fast, checked)


def test_decoding_refuses_another_batch_shape_before_any_change():
    m = _tiny()
    with no_grad():
        m(np.array([[1, 2, 3]]), use_cache=True)
    lengths = [layer.attention._kv_cache.length for layer in m.layers]
    with pytest.raises(ValueError, match="query"):
        m(np.array([[4], [5]]), use_cache=True)
    assert [layer.attention._kv_cache.length for layer in m.layers] == lengths


def test_clear_saved_reaches_a_submodule_registered_later():
    outer = Module()
    outer.a = Linear(3, 2, rng=0)
    outer.clear_saved()  # the module list is cached now
    outer.b = Linear(2, 2, rng=1)
    outer.b(np.ones((1, 2)))
    assert outer.b.num_saved == 1
    outer.clear_saved()
    assert outer.b.num_saved == 0


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    "kw",
    [
        dict(qk_norm=True, rope=True, num_kv_heads=2),
        dict(qk_norm=True, qk_norm_unit_offset=True, rope=True, rope_interleaved=True, num_kv_heads=1),
        dict(qk_norm=True, rope=True, partial_rotary_factor=0.5, num_kv_heads=4),
        dict(qk_norm=True, num_kv_heads=2),
        dict(rope=True, rope_scaling={"rope_type": "linear", "factor": 2.0}, num_kv_heads=2),
        dict(rope=True, rope_scaling={"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 5}),
        dict(rope=True, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4}),
        dict(qk_norm=True, qk_norm_scope="all_heads", rope=True, num_kv_heads=2),  # the heads apart
        dict(qk_norm=True, qk_norm_scope="each_head", rope=True, rope_interleaved=True, num_kv_heads=2),  # apart
        dict(qk_norm=True, rope=True, output_gate=True, num_kv_heads=2),  # the heads apart
    ],
)
def test_a_call_that_keeps_nothing_positions_q_and_k_as_one_array_bit_for_bit(monkeypatch, dtype, kw):
    """A cached call (nothing kept) normalises and rotates q's and k's heads as one array
    (``_position_joint``): the outputs of the steps apart, bit for bit, over a prompt and the
    decoding steps after it."""
    rng = np.random.default_rng(5)
    m = MultiHeadAttention(32, 32, 4, causal=True, rng=1, dtype=dtype, **kw)
    for p in m.parameters():  # norm weights away from one: a wrong weight shows
        p.data[...] = rng.standard_normal(p.data.shape).astype(dtype) * 0.5 + (p.data if p.data.ndim == 1 else 0)
    x = rng.standard_normal((2, 7, 32)).astype(dtype)
    calls = []
    joint = type(m)._position_joint
    monkeypatch.setattr(type(m), "_position_joint", lambda self, *a: calls.append(1) or joint(self, *a))

    def run():
        m.reset_kv_cache()
        with no_grad():
            steps = [m(x[:, :4], use_cache=True)] + [m(x[:, i : i + 1], use_cache=True) for i in range(4, 7)]
        return np.concatenate(steps, axis=1)

    out = run()
    assert len(calls) == (4 if m._joint_heads() else 0)
    np.testing.assert_array_equal(out, run())  # again, the angle tables remembered (rope_run)
    monkeypatch.setattr(type(m), "_joint_heads", lambda self: False)
    np.testing.assert_array_equal(out, run())


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    "heads", [(4, 2), (4, 1), (3, 3)]
)  # rows of heads a token: 6, 5, 6 (blocks of 8, 16, 8 tokens)
@pytest.mark.parametrize("block", [1, 700])  # elements: the fewest tokens a block may take; about 700
def test_a_long_prompt_is_positioned_a_block_of_tokens_at_a_time_bit_for_bit(monkeypatch, dtype, heads, block):
    """One sequence's prompt goes through ``_position_joint``'s QK-norm and rotation a block of
    tokens at a time (``_token_block``): the output of the whole array at once, bit for bit (the
    norm's means summed in the same groups of rows), the rotation's tables those of the whole run
    (dynamic NTK: its frequencies from the run's length)."""
    from npattn.nn import attention_core

    h, hk = heads
    scaling = {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 8}
    m = MultiHeadAttention(8 * h, 8 * h, h, num_kv_heads=hk, causal=True, rng=1, dtype=dtype, qk_norm=True, rope=True)
    m2 = MultiHeadAttention(
        8 * h, 8 * h, h, num_kv_heads=hk, causal=True, rng=1, dtype=dtype, qk_norm=True, rope=True, rope_scaling=scaling
    )
    rng = np.random.default_rng(5)
    for p, p2 in zip(m.parameters(), m2.parameters()):
        p.data[...] = p2.data[...] = rng.standard_normal(p.data.shape).astype(dtype) * 0.5 + (
            p.data if p.data.ndim == 1 else 0
        )
    x = rng.standard_normal((1, 45, 8 * h)).astype(dtype)
    blocks = []
    turn = type(m)._norm_turn
    monkeypatch.setattr(type(m), "_norm_turn", lambda self, *a: blocks.append(1) or turn(self, *a))

    def run(att, size):
        monkeypatch.setattr(attention_core, "_POSITION_BLOCK", size)
        att.reset_kv_cache()
        blocks.clear()
        with no_grad():
            return att(x, use_cache=True), len(blocks)

    for att in (m, m2):
        whole, one = run(att, 1 << 30)
        parts, many = run(att, block)
        assert one == 1 and many >= 3
        np.testing.assert_array_equal(parts, whole)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_cached_step_attends_through_decoding_attention_bit_for_bit(monkeypatch, dtype):
    """A decoding step's one query row (nothing kept, no weights read) skips the kernel's setup
    (``K.decoding_attention``): the logits of the kernel's own path, bit for bit; a call that
    asks for the weights, a mask or a window keeps the kernel."""
    m = _tiny(dtype)
    prompt = np.random.default_rng(4).integers(0, 40, (2, 5))
    calls = []
    f = K.decoding_attention
    monkeypatch.setattr(K, "decoding_attention", lambda *a: calls.append(1) or f(*a))
    fast = _decode(m, prompt, 4)
    plain = [layer.self_attn.window is None for layer in m.model.layers]  # a windowed layer keeps the kernel
    assert 0 < sum(plain) < len(plain) and len(calls) == 4 * sum(plain)
    monkeypatch.setattr(MultiHeadAttention, "_decodes", lambda self, *a: False)
    np.testing.assert_array_equal(fast, _decode(m, prompt, 4))
    calls.clear()
    att = MultiHeadAttention(16, 16, 4, num_kv_heads=2, causal=True, rng=0, dtype=dtype)
    x = np.random.default_rng(0).standard_normal((1, 3, 16)).astype(dtype)
    with no_grad():
        att(x[:, :2], use_cache=True)
        att(x[:, 2:], use_cache=True, need_weights=True)
    assert calls == []


def test_rope_run_remembers_short_tables_read_only_and_computes_the_rest():
    """``K.rope_run``: ``rope``'s output for tokens at consecutive positions, bit for bit; the
    angle tables of a short run are made once and shared read-only (the layers of a step), a long
    run's and those of options that cannot be a key are computed each time."""
    R = importlib.import_module("npattn.functional.rope")  # the module (the package's ``rope`` is the op)
    x = np.random.default_rng(0).standard_normal((2, 3, 4, 8))  # (B, L, H, D)
    R._run_table.cache_clear()
    unhashable = {"rope_type": "default", "odd": {"a": 1}}  # not a key: computed each time
    for scaling in (None, {"rope_type": "linear", "factor": 2.0}, {"rope_type": "default", "odd": [1, 2]}, unhashable):
        for interleaved in (False, True):  # the same angles, laid out for the other pairing
            kw = dict(base=100.0, scaling=None if scaling is None else dict(scaling), interleaved=interleaved)
            want = K.rope(x, np.arange(5, 8)[:, None], **kw)[0]
            np.testing.assert_array_equal(K.rope_run(x, 5, **kw), want)
            np.testing.assert_array_equal(K.rope_run(x, 5, **kw), want)
    info = R._run_table.cache_info()
    assert (info.misses, info.hits) == (6, 6)
    cos, _ = R._run_table(5, 3, 8, 100.0, (("rope_type", "default"),), "d", False)
    assert not cos.flags.writeable
    assert R._frozen({"rope_type": "default", "odd": {"a": 1}}) is None
    long = np.zeros((1, R._RUN_TABLE_MAX // 8 + 1, 1, 8))
    R._run_table.cache_clear()
    K.rope_run(long, 0)
    assert R._run_table.cache_info().misses == 0

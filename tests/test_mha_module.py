"""``MultiHeadAttention`` as a module: the fused q/k/v weight it owns (its row blocks are the
``W_query``/``W_key``/``W_value`` parameters), weights changed between forward and backward,
validation of every option and input before any state changes."""

import copy

import numpy as np
import pytest

import npattn
from npattn.optim import SGD

RNG = np.random.default_rng(0)


def fresh(**kw):
    return npattn.MultiHeadAttention(8, 8, 2, rng=0, **kw)


# -- the fused weight ------------------------------------------------------------------------------
@pytest.mark.parametrize("qkv_bias", [False, True])
def test_projection_parameters_are_views_of_one_fused_weight(qkv_bias):
    m = fresh(qkv_bias=qkv_bias, num_kv_heads=1)
    x = RNG.standard_normal((2, 3, 8))
    y0 = m(x)
    W, b = m._fused_qkv()
    assert W.shape == (8 + 2 * 4, 8)
    for mod in (m.W_query, m.W_key, m.W_value):
        assert np.shares_memory(mod.weight.data, W)
        if qkv_bias:
            assert np.shares_memory(mod.bias.data, b)
    # a write into one parameter is a write into the fused weight: the output follows it
    m.W_value.weight.data[...] *= 2.0
    m.W_value.weight.bump_version()
    y1 = m(x)
    ref = npattn.MultiHeadAttention(8, 8, 2, rng=0, qkv_bias=qkv_bias, num_kv_heads=1)
    ref.load_state_dict(m.state_dict())
    np.testing.assert_array_equal(y1, ref(x))
    assert not np.allclose(y0, y1)


def test_fused_weight_follows_to_deepcopy_and_assignment():
    m = fresh(qkv_bias=True)
    x = RNG.standard_normal((2, 3, 8))
    y = m(x)
    c = copy.deepcopy(m)  # deepcopy does not keep the views: the copy rebuilds its fused weight
    np.testing.assert_array_equal(c(x), y)
    c.W_key.weight.data[...] = 0.0
    c.W_key.weight.bump_version()
    assert not np.allclose(c(x), y)
    np.testing.assert_array_equal(m(x), y)  # the original is untouched
    m.to(np.float32)
    y32 = m(x.astype(np.float32))
    assert y32.dtype == np.float32 and m._fused_qkv()[0].dtype == np.float32
    np.testing.assert_allclose(y32, y, rtol=0, atol=1e-5)
    m.to(np.float64)
    m.W_query.weight.data = m.W_query.weight.data * 0.5  # a new array: the fused weight is rebuilt from it
    ref = fresh(qkv_bias=True)
    ref.load_state_dict(m.state_dict())
    np.testing.assert_array_equal(m(x), ref(x))


def test_gradients_land_in_each_parameter():
    m = fresh(qkv_bias=True, num_kv_heads=1)
    x = RNG.standard_normal((2, 3, 8))
    report = npattn.gradcheck(m, x)
    assert report.ok, str(report)


# -- weights changed between forward and backward ---------------------------------------------------
def test_optimizer_step_between_forward_and_backward_raises():
    m = fresh()
    x = RNG.standard_normal((2, 3, 8))
    y = m(x)
    m.backward(np.ones_like(y))
    y = m(x)
    SGD(m, lr=0.1).step()
    with pytest.raises(RuntimeError, match="W_query.weight|modified"):
        m.backward(np.ones_like(y))


@pytest.mark.parametrize("name", ["W_key.weight", "out_proj.weight", "sinks", "q_norm.weight", "bias_k"])
def test_load_state_dict_between_forward_and_backward_raises(name):
    m = fresh(sinks=True, qk_norm=True, add_bias_kv=True, memory_efficient=True)
    x = RNG.standard_normal((2, 3, 8))
    y = m(x)
    sd = m.state_dict()
    sd[name] = sd[name] + 1.0
    m.load_state_dict(sd)
    with pytest.raises(RuntimeError, match="modified"):
        m.backward(np.ones_like(y))


def test_backward_uses_exactly_the_forward_weights_after_a_rejected_backward():
    """A refused dy keeps the state; the gradient then equals a fresh forward+backward's."""
    m = fresh(sinks=True, rope=True)
    x = RNG.standard_normal((2, 3, 8))
    g = RNG.standard_normal((2, 3, 8))
    y = m.forward(x)
    with pytest.raises(ValueError, match="dy"):
        m.backward(np.ones((2, 3, 7)))
    m.zero_grad()
    dx = m.backward(g)
    ref = fresh(sinks=True, rope=True)
    ref.load_state_dict(m.state_dict())
    ref(x)
    np.testing.assert_array_equal(dx, ref.backward(g))
    np.testing.assert_array_equal(y, ref(x))


def test_grad_none_is_recreated():
    m = fresh(sinks=True, add_bias_kv=True, qk_norm=True)
    for p in m.parameters():
        p.grad = None
    x = RNG.standard_normal((2, 3, 8))
    y = m(x)
    m.backward(np.ones_like(y))
    assert all(p.grad is not None and p.grad.shape == p.data.shape for p in m.parameters())


# -- validation ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, exc, match",
    [
        ({"window": 3}, TypeError, "window"),
        ({"window": (1,)}, TypeError, "window"),
        ({"window": (1.0, 0)}, TypeError, "window"),
        ({"window": (-2, 0)}, ValueError, "window"),
        ({"window": (True, 0)}, TypeError, "window"),
        ({"causal_align": "top-left"}, ValueError, "causal_align"),
        ({"causal_align": None}, ValueError, "causal_align"),
        ({"softcap": 0.0}, ValueError, "softcap"),
        ({"softcap": -1.0}, ValueError, "softcap"),
        ({"softcap": float("nan")}, ValueError, "softcap"),
        ({"softcap": "2"}, TypeError, "softcap"),
        ({"alibi": 1}, TypeError, "alibi"),
        ({"sinks": None}, TypeError, "sinks"),
        ({"rope": "yes"}, TypeError, "rope"),
        ({"rope_base": 0.0}, ValueError, "rope_base"),
        ({"rope_base": float("inf")}, ValueError, "rope_base"),
        ({"qk_norm": 0}, TypeError, "qk_norm"),
        ({"add_bias_kv": 1}, TypeError, "add_bias_kv"),
        ({"add_zero_attn": None}, TypeError, "add_zero_attn"),
    ],
)
def test_bad_options_raise(kw, exc, match):
    with pytest.raises(exc, match=match):
        fresh(**kw)


def test_rope_needs_an_even_head_dim():
    with pytest.raises(ValueError, match="rope: .*even head_dim.*3"):
        npattn.MultiHeadAttention(6, 6, 2, rope=True)


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        ({"average_attn_weights": 1}, TypeError, "average_attn_weights"),
        ({"use_cache": None}, TypeError, "use_cache"),
        ({"need_weights": "no"}, TypeError, "need_weights"),
        ({"attn_mask": np.ones((3, 4), bool)}, ValueError, "attn_mask"),
        ({"attn_mask": np.ones((3, 3), np.int8)}, TypeError, "attn_mask"),
        ({"key_padding_mask": np.zeros((2, 4), bool)}, ValueError, "key_padding_mask"),
        ({"key_padding_mask": np.zeros((2, 3), np.float16)}, TypeError, "key_padding_mask"),
    ],
)
def test_bad_forward_arguments_change_no_state(kw, exc, match):
    """Every argument is checked before any arithmetic: the state of the last good forward
    survives (its backward still works) and the KV cache is untouched."""
    m = fresh(sinks=True, rope=True, add_bias_kv=True)
    x = RNG.standard_normal((2, 3, 8))
    g = RNG.standard_normal((2, 3, 8))
    m(x[:, :2], use_cache=True)
    y = m(x)
    with pytest.raises(exc, match=match):
        m(x * 2, **kw)
    with pytest.raises(exc, match=match):
        m(x[:, :1] * 2, use_cache=True, **kw) if "use_cache" not in kw else m(x * 2, **kw)
    assert m.kv_cache_length == 2
    dx = m.backward(g)
    ref = fresh(sinks=True, rope=True, add_bias_kv=True)
    ref.load_state_dict(m.state_dict())
    np.testing.assert_array_equal(ref(x), y)
    np.testing.assert_array_equal(ref.backward(g), dx)


def test_unbatched_self_and_cross_attention_gradients_shaped_like_inputs():
    m = npattn.MultiHeadAttention(8, 6, 2, kdim=3, vdim=5, rng=0)
    q, k, v = RNG.standard_normal((4, 8)), RNG.standard_normal((5, 3)), RNG.standard_normal((5, 5))
    out = m(q, k, v)
    assert out.shape == (4, 6)
    dq, dk, dv = m.backward(RNG.standard_normal(out.shape))
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    batched = m(q[None], k[None], v[None])
    np.testing.assert_allclose(batched[0], out, rtol=0, atol=1e-14)
    assert npattn.gradcheck(m, q, k, v).ok
    s = npattn.MultiHeadAttention(8, 8, 2, rng=0)
    x = RNG.standard_normal((4, 8))
    assert s(x).shape == (4, 8) and s.backward(np.ones((4, 8))).shape == (4, 8)
    assert npattn.gradcheck(s, x).ok


def test_repr_lists_the_options():
    r = repr(
        fresh(
            window=(2, 0),
            causal_align="bottom_right",
            softcap=3.0,
            alibi=True,
            sinks=True,
            rope=True,
            qk_norm=True,
            add_bias_kv=True,
            add_zero_attn=True,
        )
    )
    for s in (
        "window=(2, 0)",
        "bottom_right",
        "softcap=3.0",
        "alibi=True",
        "sinks=True",
        "rope=True",
        "qk_norm=True",
        "add_bias_kv=True",
        "add_zero_attn=True",
        "q_norm",
    ):
        assert s in r


@pytest.mark.parametrize(
    "sd, match",
    [
        (
            {
                "q_proj_weight": np.zeros((4, 4)),
                "k_proj_weight": np.zeros((3, 4)),
                "v_proj_weight": np.zeros((4, 4)),
                "out_proj.weight": np.zeros((4, 4)),
            },
            "k_proj_weight",
        ),
        (
            {"in_proj_weight": np.zeros((12, 4)), "in_proj_bias": np.zeros(11), "out_proj.weight": np.zeros((4, 4))},
            "in_proj_bias",
        ),
        (
            {"in_proj_weight": np.zeros((12, 4)), "bias_k": np.zeros((1, 1, 4)), "out_proj.weight": np.zeros((4, 4))},
            "bias_v",
        ),
        (
            {
                "in_proj_weight": np.zeros((12, 4)),
                "bias_k": np.zeros((1, 1, 3)),
                "bias_v": np.zeros((1, 1, 4)),
                "out_proj.weight": np.zeros((4, 4)),
            },
            "bias_k",
        ),
        (
            {"in_proj_weight": np.zeros((12, 4)), "out_proj.weight": np.zeros((4, 4)), "in_proj.weight": np.zeros(1)},
            "unknown keys",
        ),
    ],
)
def test_from_torch_state_dict_bad_shapes_and_keys(sd, match):
    with pytest.raises(ValueError, match=match):
        npattn.MultiHeadAttention.from_torch_state_dict(sd, 2)


def test_kv_cache_follows_a_dtype_change():
    m = fresh(rope=True, causal=True)
    x = RNG.standard_normal((1, 4, 8))
    m(x[:, :2], use_cache=True)
    m.to(np.float32)
    y = m(x[:, 2:].astype(np.float32), use_cache=True)
    assert y.dtype == np.float32 and m._kv_cache.k.dtype == np.float32
    np.testing.assert_allclose(y, m(x.astype(np.float32))[:, 2:], rtol=0, atol=1e-5)


def test_one_constructor_signature_and_the_core_refuses_torchs_extra_keys():
    """MultiHeadAttention's constructor is the core's (written once, add_bias_kv and add_zero_attn
    after memory_efficient); the core refuses the two extras before drawing any weight."""
    import inspect

    from npattn.nn.attention_core import MultiHeadAttentionCore

    public = list(inspect.signature(npattn.MultiHeadAttention).parameters.values())
    assert public == list(inspect.signature(MultiHeadAttentionCore).parameters.values())
    names = [p.name for p in public]
    assert names[names.index("memory_efficient") + 1 :][:2] == ["add_bias_kv", "add_zero_attn"]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in public[3:])
    for name in ("add_bias_kv", "add_zero_attn"):
        rng = np.random.default_rng(0)
        with pytest.raises(ValueError, match=f"{name}: expected False"):
            MultiHeadAttentionCore(8, 8, 2, rng=rng, **{name: True})
        assert rng.bit_generator.state == np.random.default_rng(0).bit_generator.state  # nothing drawn
        m = npattn.MultiHeadAttention(8, 8, 2, **{name: True})
        assert m._n_extra == 1 and getattr(m, name) is True
    with pytest.raises(TypeError, match="no_such_option"):
        npattn.MultiHeadAttention(8, 8, 2, no_such_option=True)

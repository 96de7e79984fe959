"""Bad input raises npattn's own TypeError/ValueError, naming the argument and showing what was
expected and what was given, before any arithmetic (never a raw numpy error)."""

import re

import numpy as np
import pytest

import npattn.functional as F

R = np.random.default_rng(0)


def u(*shape):
    return R.uniform(-1, 1, shape)


def shapes_in(msg, *shapes):
    """Every shape appears in the message (as numpy prints tuples)."""
    for s in shapes:
        assert str(tuple(s)) in msg, f"{tuple(s)} not in {msg!r}"


def raises(exc, name, fn, *shapes):
    with pytest.raises(exc, match=rf"^{re.escape(name)}\b") as info:
        fn()
    shapes_in(str(info.value), *shapes)
    return str(info.value)


# ------------------------------------------------------------------ non-numeric inputs, every op

BAD_VALUES = {
    "bool": np.ones((2, 3), dtype=bool),
    "complex": np.ones((2, 3), dtype=complex),
    "string": np.full((2, 3), "a"),
    "object": np.array([[1.0, None, 2.0], [0.0, 1.0, 2.0]], dtype=object),
}
FLOAT_ARG_CALLS = {
    "linear.x": ("x", lambda a: F.linear(a, u(4, 3))),
    "linear.weight": ("weight", lambda a: F.linear(u(5, 3), a)),
    "linear.bias": ("bias", lambda a: F.linear(u(2, 3), u(2, 3), a[0, :2])),
    "embedding.weight": ("weight", lambda a: F.embedding(np.array([0, 1]), a)),
    "softmax.x": ("x", lambda a: F.softmax(a)),
    "relu.x": ("x", lambda a: F.relu(a)),
    "gelu.x": ("x", lambda a: F.gelu(a)),
    "gelu_tanh.x": ("x", lambda a: F.gelu(a, "tanh")),
    "dropout.x": ("x", lambda a: F.dropout(a, 0.5, 0)),
    "layer_norm.x": ("x", lambda a: F.layer_norm(a)),
    "layer_norm.weight": ("weight", lambda a: F.layer_norm(u(2, 3), a[0])),
    "layer_norm.bias": ("bias", lambda a: F.layer_norm(u(2, 3), None, a[0])),
    "cross_entropy.logits": ("logits", lambda a: F.cross_entropy(a, np.array([0, 1]))),
    "sdpa.q": ("q", lambda a: F.scaled_dot_product_attention(a, u(4, 3), u(4, 2))),
    "sdpa.k": ("k", lambda a: F.scaled_dot_product_attention(u(2, 3), a, u(2, 2))),
    "sdpa.v": ("v", lambda a: F.scaled_dot_product_attention(u(2, 3), u(2, 3), a)),
}

SLICED = {"linear.bias", "layer_norm.weight", "layer_norm.bias"}  # these lambdas index their argument


@pytest.mark.parametrize("kind", sorted(BAD_VALUES))
@pytest.mark.parametrize("call", sorted(FLOAT_ARG_CALLS))
def test_non_real_inputs_raise_type_error(call, kind):
    name, fn = FLOAT_ARG_CALLS[call]
    msg = raises(TypeError, name, lambda: fn(BAD_VALUES[kind]))
    assert str(BAD_VALUES[kind].dtype) in msg


@pytest.mark.parametrize("call", sorted(c for c in FLOAT_ARG_CALLS if c not in SLICED))
def test_ragged_nested_lists_raise_type_error(call):
    name, fn = FLOAT_ARG_CALLS[call]
    with pytest.raises(TypeError, match=rf"^{name}\b"):
        fn([[1.0, 2.0], [3.0]])


def test_integer_values_are_accepted_as_floats():
    out, _ = F.linear(np.arange(6).reshape(2, 3), np.ones((4, 3), dtype=np.int32))
    assert out.dtype == np.float64
    out, _ = F.softmax(np.arange(3))
    assert out.dtype == np.float64


# ------------------------------------------------------------------ linear / embedding


def test_linear_shapes():
    raises(ValueError, "x", lambda: F.linear(np.float64(1.0), u(4, 3)), ())
    raises(ValueError, "weight", lambda: F.linear(u(2, 3), u(3)), (3,))
    raises(ValueError, "weight", lambda: F.linear(u(2, 3), u(2, 4, 3)), (2, 4, 3))
    msg = raises(ValueError, "weight", lambda: F.linear(u(2, 3), u(4, 5)), (4, 5))
    assert "3" in msg  # the expected in_features
    raises(ValueError, "bias", lambda: F.linear(u(2, 3), u(4, 3), u(5)), (4,), (5,))
    raises(ValueError, "bias", lambda: F.linear(u(2, 3), u(4, 3), u(1, 4)), (4,), (1, 4))


def test_embedding_ids_and_weight():
    raises(TypeError, "ids", lambda: F.embedding(u(2, 3), u(4, 2)))
    raises(TypeError, "ids", lambda: F.embedding(np.array([True, False]), u(4, 2)))
    msg = raises(ValueError, "ids", lambda: F.embedding(np.array([0, 4]), u(4, 2)))
    assert "[0, 4)" in msg and "got 4" in msg
    raises(ValueError, "ids", lambda: F.embedding(np.array([-1, 0]), u(4, 2)))
    raises(ValueError, "weight", lambda: F.embedding(np.array([0]), u(4)), (4,))


# ------------------------------------------------------------------ softmax / activations


def test_softmax_axis_and_ndim():
    msg = raises(ValueError, "axis", lambda: F.softmax(u(2, 3), axis=2))
    assert "[-2, 1]" in msg and "got 2" in msg
    raises(ValueError, "axis", lambda: F.softmax(u(2, 3), axis=-3))
    raises(TypeError, "axis", lambda: F.softmax(u(2, 3), axis=1.0))
    raises(TypeError, "axis", lambda: F.softmax(u(2, 3), axis=None))
    raises(TypeError, "axis", lambda: F.softmax(u(2, 3), axis=True))
    raises(ValueError, "axis", lambda: F.softmax(np.float64(2.0), axis=1))  # a 0-d input is one value: axis 0 or -1


@pytest.mark.parametrize("approximate", ["fast", "Tanh", None, "", 1])
def test_gelu_bad_approximate(approximate):
    msg = raises(ValueError, "approximate", lambda: F.gelu(u(3), approximate=approximate))
    assert "'none'" in msg and "'tanh'" in msg and repr(approximate) in msg


# ------------------------------------------------------------------ dropout


@pytest.mark.parametrize("p", [-0.1, 1.5, float("nan"), float("inf"), -np.inf])
def test_dropout_p_outside_unit_interval(p):
    msg = raises(ValueError, "p", lambda: F.dropout(u(3), p, 0))
    assert "[0, 1]" in msg and str(float(p)) in msg


@pytest.mark.parametrize("p", ["0.5", None, True, [0.5]])
def test_dropout_p_not_a_number(p):
    raises(TypeError, "p", lambda: F.dropout(u(3), p, 0))


def test_dropout_training_and_rng():
    raises(TypeError, "training", lambda: F.dropout(u(3), 0.5, 0, training="yes"))
    raises(TypeError, "training", lambda: F.dropout(u(3), 0.5, 0, training=1))
    raises(TypeError, "rng", lambda: F.dropout(u(3), 0.5, "seed"))
    raises(TypeError, "rng", lambda: F.dropout(u(3), 0.5, 1.5))
    raises(ValueError, "rng", lambda: F.dropout(u(3), 0.5, -1))
    raises(TypeError, "rng", lambda: F.dropout(u(3), 0.5, "seed", training=False))  # validated even when unused


# ------------------------------------------------------------------ layer norm


def test_layer_norm_shapes_and_eps():
    raises(ValueError, "x", lambda: F.layer_norm(np.float64(1.0)), ())
    raises(ValueError, "weight", lambda: F.layer_norm(u(2, 3), u(4)), (3,), (4,))
    raises(ValueError, "weight", lambda: F.layer_norm(u(2, 3), u(3, 3)), (2, 3), (3, 3))  # not x's trailing axes
    raises(ValueError, "bias", lambda: F.layer_norm(u(2, 3), None, u(2)), (3,), (2,))
    for eps in (-1.0, float("nan"), float("inf")):
        raises(ValueError, "eps", lambda: F.layer_norm(u(2, 3), None, None, eps))
    raises(TypeError, "eps", lambda: F.layer_norm(u(2, 3), None, None, "small"))


# ------------------------------------------------------------------ cross entropy


def test_cross_entropy_targets():
    raises(ValueError, "targets", lambda: F.cross_entropy(u(2, 3), np.array([0, 1, 2])), (2,), (3,))
    raises(ValueError, "targets", lambda: F.cross_entropy(u(2, 4, 3), np.zeros((4, 2), int)), (2, 4), (4, 2))
    raises(TypeError, "targets", lambda: F.cross_entropy(u(2, 3), np.array([0.0, 1.0])))
    msg = raises(ValueError, "targets", lambda: F.cross_entropy(u(2, 3), np.array([0, 3])))
    assert "[0, 3)" in msg
    raises(ValueError, "targets", lambda: F.cross_entropy(u(2, 3), np.array([-1, 0])))
    raises(TypeError, "ignore_index", lambda: F.cross_entropy(u(2, 3), np.array([0, 1]), ignore_index=1.5))
    raises(TypeError, "ignore_index", lambda: F.cross_entropy(u(2, 3), np.array([0, 1]), ignore_index=True))
    raises(ValueError, "logits", lambda: F.cross_entropy(np.float64(1.0), np.array(0)), ())
    # an ignored target may lie outside [0, C)
    loss, _ = F.cross_entropy(u(2, 3), np.array([-100, 1]), ignore_index=-100)
    assert np.isfinite(loss)


# ------------------------------------------------------------------ attention


def sdpa(q, k, v, **kw):
    return F.scaled_dot_product_attention(q, k, v, **kw)


def test_attention_ndim():
    raises(ValueError, "q", lambda: sdpa(u(3), u(3), u(3)), (3,))
    raises(ValueError, "k", lambda: sdpa(u(2, 3, 4), u(4), u(3, 4)), (4,))
    raises(ValueError, "v", lambda: sdpa(u(2, 3, 4), u(2, 5, 4), u(5)), (5,))
    raises(ValueError, "q", lambda: sdpa(u(2, 3, 0), u(2, 5, 0), u(2, 5, 4)), (2, 3, 0))


def test_attention_feature_mismatch():
    raises(ValueError, "k", lambda: sdpa(u(2, 3, 4), u(2, 5, 5), u(2, 5, 4)), (2, 5, 5))


def test_attention_kv_length_mismatch():
    raises(ValueError, "v", lambda: sdpa(u(2, 3, 4), u(2, 5, 4), u(2, 6, 4)), (2, 5, 4), (2, 6, 4))
    raises(ValueError, "v", lambda: sdpa(u(2, 2, 3, 4), u(2, 2, 5, 4), u(2, 3, 5, 4)), (2, 2, 5, 4), (2, 3, 5, 4))


def test_attention_batch_mismatch():
    raises(ValueError, "k", lambda: sdpa(u(2, 3, 4), u(3, 5, 4), u(3, 5, 4)), (2, 3, 4), (3, 5, 4))
    raises(ValueError, "k", lambda: sdpa(u(2, 2, 3, 4), u(3, 2, 5, 4), u(3, 2, 5, 4)), (2, 2, 3, 4), (3, 2, 5, 4))
    raises(
        ValueError,
        "k",
        lambda: sdpa(u(3, 4, 3, 4), u(2, 2, 5, 4), u(2, 2, 5, 4), enable_gqa=True),
        (3, 4, 3, 4),
        (2, 2, 5, 4),
    )


def test_attention_heads():
    msg = raises(ValueError, "k", lambda: sdpa(u(1, 4, 3, 4), u(1, 2, 5, 4), u(1, 2, 5, 4)), (1, 4, 3, 4), (1, 2, 5, 4))
    assert "enable_gqa" in msg  # the hint
    msg = raises(
        ValueError,
        "k",
        lambda: sdpa(u(1, 3, 3, 4), u(1, 2, 5, 4), u(1, 2, 5, 4), enable_gqa=True),
        (1, 3, 3, 4),
        (1, 2, 5, 4),
    )
    assert "multiple" in msg
    raises(ValueError, "k", lambda: sdpa(u(1, 2, 3, 4), u(1, 4, 5, 4), u(1, 4, 5, 4), enable_gqa=True))


def test_attention_masks():
    q, k, v = u(2, 3, 4), u(2, 5, 4), u(2, 5, 2)
    raises(ValueError, "attn_mask", lambda: sdpa(q, k, v, attn_mask=np.ones((3, 4), bool)), (2, 3, 5), (3, 4))
    raises(
        ValueError, "attn_mask", lambda: sdpa(q, k, v, attn_mask=np.ones((3, 2, 3, 5), bool)), (2, 3, 5), (3, 2, 3, 5)
    )
    raises(ValueError, "attn_mask", lambda: sdpa(q, k, v, attn_mask=np.zeros((5, 3))), (2, 3, 5), (5, 3))
    msg = raises(TypeError, "attn_mask", lambda: sdpa(q, k, v, attn_mask=np.ones((3, 5), int)))
    assert "int64" in msg
    raises(TypeError, "attn_mask", lambda: sdpa(q, k, v, attn_mask=np.ones((3, 5), np.uint8)))
    raises(TypeError, "attn_mask", lambda: sdpa(q, k, v, attn_mask=np.ones((3, 5), complex)))
    raises(TypeError, "attn_mask", lambda: sdpa(q, k, v, attn_mask=np.full((3, 5), "a")))


def test_attention_options():
    q, k, v = u(2, 3, 4), u(2, 5, 4), u(2, 5, 2)
    for p in (-0.5, 1.01, float("nan")):
        raises(ValueError, "dropout_p", lambda: sdpa(q, k, v, dropout_p=p))
    raises(TypeError, "dropout_p", lambda: sdpa(q, k, v, dropout_p="0.1"))
    for s in ("big", True, [1.0], 1j):
        raises(TypeError, "scale", lambda: sdpa(q, k, v, scale=s))
    for s in (float("nan"), float("inf")):
        with pytest.raises((TypeError, ValueError), match="^scale"):
            sdpa(q, k, v, scale=s)
    raises(TypeError, "is_causal", lambda: sdpa(q, k, v, is_causal=1))
    raises(TypeError, "is_causal", lambda: sdpa(q, k, v, is_causal=None))
    raises(TypeError, "enable_gqa", lambda: sdpa(q, k, v, enable_gqa="yes"))
    raises(TypeError, "rng", lambda: sdpa(q, k, v, dropout_p=0.5, rng=1.5))


# ------------------------------------------------------------------ wrongly shaped / typed dout, every backward


def _forwards():
    return {
        "linear": (F.linear(u(2, 3), u(4, 3), u(4)), F.linear_backward),
        "embedding": (F.embedding(np.array([[0, 1, 1]]), u(4, 2)), F.embedding_backward),
        "softmax": (F.softmax(u(2, 3), axis=0), F.softmax_backward),
        "relu": (F.relu(u(2, 3)), F.relu_backward),
        "gelu": (F.gelu(u(2, 3)), F.gelu_backward),
        "gelu_tanh": (F.gelu(u(2, 3), "tanh"), F.gelu_backward),
        "dropout": (F.dropout(u(2, 3), 0.5, 0), F.dropout_backward),
        "dropout_eval": (F.dropout(u(2, 3), 0.5, 0, training=False), F.dropout_backward),
        "dropout_p1": (F.dropout(u(2, 3), 1.0, 0), F.dropout_backward),
        "layer_norm": (F.layer_norm(u(2, 3), u(3), u(3)), F.layer_norm_backward),
        "cross_entropy": (F.cross_entropy(u(2, 3), np.array([0, 2])), F.cross_entropy_backward),
        "sdpa": (
            F.scaled_dot_product_attention(u(2, 3, 4), u(2, 5, 4), u(2, 5, 2)),
            F.scaled_dot_product_attention_backward,
        ),
        "sdpa_gqa": (
            F.scaled_dot_product_attention(
                u(1, 4, 3, 4), u(1, 2, 5, 4), u(1, 2, 5, 2), enable_gqa=True, dropout_p=0.3, rng=0
            ),
            F.scaled_dot_product_attention_backward,
        ),
    }


@pytest.mark.parametrize("op", sorted(_forwards()))
def test_wrongly_shaped_dout(op):
    (out, cache), backward = _forwards()[op]
    shape = np.shape(out)
    for bad in [shape + (1,), (2,) + shape, shape[:-1] + (shape[-1] + 1,) if shape else (1,)]:
        raises(ValueError, "dout", lambda: backward(np.ones(bad), cache), shape, bad)
    raises(TypeError, "dout", lambda: backward(np.ones(shape, dtype=bool), cache))
    raises(TypeError, "dout", lambda: backward(np.ones(shape, dtype=complex), cache))
    backward(np.ones(shape), cache)  # the right shape works


def test_errors_come_before_arithmetic():
    # a failing call changes nothing and leaves no partial state: the same arrays then work
    q, k, v = u(2, 3, 4), u(2, 5, 4), u(2, 5, 2)
    before = [a.copy() for a in (q, k, v)]
    with pytest.raises(ValueError):
        sdpa(q, k, v, attn_mask=np.ones((4, 4), bool))
    for a, b in zip((q, k, v), before):
        np.testing.assert_array_equal(a, b)
    sdpa(q, k, v)

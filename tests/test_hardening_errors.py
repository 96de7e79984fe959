"""Bad input across the whole public API, table-driven (in the spirit of PyTorch's OpInfo
``error_inputs``): one table per area, each row ``(callable, args, kwargs, exception type, regex)``
plus the substrings (expected and actual values) the message must show.

Every row must raise npattn's *own* error (see ``_hardening.assert_own_error``): exactly
``ValueError``/``TypeError`` (``RuntimeError`` for the module protocol), from an explicit ``raise``
inside npattn, whose message starts with the argument's name and a colon and never reads like
numpy's "operands could not be broadcast" / "matmul: Input operand" / "shapes ... not aligned".
"""

import contextlib
import io

import numpy as np
import pytest
from _hardening import assert_own_error, expect_error

import npattn
import npattn.functional as F
from npattn import book, masks
from npattn.models import TinyTransformer
from npattn.optim import SGD, Adam, AdamW, WarmupCosine, clip_grad_norm_
from npattn.testing import gradcheck, numerical_gradient

R = np.random.default_rng(0)
NAN, INF = float("nan"), float("inf")


def u(*shape):
    return R.uniform(-1, 1, shape)


RAGGED = [[1.0, 2.0], [3.0]]
BAD_KINDS = {
    "bool": lambda s: np.ones(s, bool),
    "complex": lambda s: np.ones(s, complex),
    "str": lambda s: np.full(s, "a"),
    "object": lambda s: np.ones(s, object),
}


def row(id_, fn, *args, exc, match, contains=(), **kwargs):
    return pytest.param(fn, args, kwargs, exc, match, tuple(contains), id=id_)


def run_row(fn, args, kwargs, exc, match, contains):
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    assert_own_error(info.value, exc, match, contains)


def bw(forward, backward):
    """``f(dout)``: run ``forward()`` for a fresh cache, then ``backward(dout, cache)``."""

    def f(dout):
        return backward(dout, forward()[1])

    return f


sdpa = F.scaled_dot_product_attention
mea = F.memory_efficient_attention
Q, K, V = u(2, 3, 4), u(2, 5, 4), u(2, 5, 6)
Q4, K4, V4 = u(2, 4, 3, 4), u(2, 2, 5, 4), u(2, 2, 5, 6)

# ----------------------------------------------------------------------------------- functional
FUNCTIONAL = [
    # wrong ndim
    row("linear-x-0d", F.linear, np.float64(1.0), u(4, 3), exc=ValueError, match="x: ", contains=["()"]),
    row("linear-weight-1d", F.linear, u(2, 3), u(3), exc=ValueError, match="weight: ", contains=["(3,)"]),
    row("softmax-0d-axis", F.softmax, np.float64(1.0), axis=1, exc=ValueError, match="axis: "),
    row("layer_norm-0d", F.layer_norm, np.float64(1.0), exc=ValueError, match="x: ", contains=["()"]),
    row("layer_norm-no-features", F.layer_norm, u(2, 0), exc=ValueError, match="x: ", contains=["(2, 0)"]),
    row("cross_entropy-0d", F.cross_entropy, np.float64(1.0), np.array(0), exc=ValueError, match="logits: "),
    row("embedding-weight-1d", F.embedding, np.array([0]), u(4), exc=ValueError, match="weight: ", contains=["(4,)"]),
    row("sdpa-q-1d", sdpa, u(4), u(4), u(4), exc=ValueError, match="q: ", contains=["(4,)"]),
    row("sdpa-k-ndim", sdpa, Q, u(4), u(5, 6), exc=ValueError, match="k: ", contains=["(4,)"]),
    row("mea-q-1d", mea, u(4), u(4), u(4), exc=ValueError, match="q: ", contains=["(4,)"]),
    row("mea-v-ndim", mea, Q, K, u(6), exc=ValueError, match="v: ", contains=["(6,)"]),
    # mismatched feature sizes
    row("linear-in", F.linear, u(2, 3), u(4, 5), exc=ValueError, match="weight: ", contains=["3", "(4, 5)"]),
    row("linear-bias", F.linear, u(2, 3), u(4, 3), u(5), exc=ValueError, match="bias: ", contains=["(4,)", "(5,)"]),
    row("layer_norm-weight", F.layer_norm, u(2, 3), u(4), exc=ValueError, match="weight: ", contains=["(3,)", "(4,)"]),
    row(
        "layer_norm-bias",
        F.layer_norm,
        u(2, 3),
        None,
        u(2, 3),
        exc=ValueError,
        match="bias: ",
        contains=["(3,)", "(2, 3)"],
    ),
    row("sdpa-E", sdpa, Q, u(2, 5, 5), V, exc=ValueError, match="k: ", contains=["4", "(2, 5, 5)"]),
    row("sdpa-E0", sdpa, u(2, 3, 0), u(2, 5, 0), V, exc=ValueError, match="q: ", contains=["(2, 3, 0)"]),
    row("mea-E", mea, Q, u(2, 5, 5), V, exc=ValueError, match="k: ", contains=["(2, 5, 5)"]),
    # key/value length and batch mismatches
    row("sdpa-kv-len", sdpa, Q, K, u(2, 6, 6), exc=ValueError, match="v: ", contains=["(2, 5, 4)", "(2, 6, 6)"]),
    row(
        "sdpa-batch", sdpa, Q, u(3, 5, 4), u(3, 5, 6), exc=ValueError, match="k: ", contains=["(2, 3, 4)", "(3, 5, 4)"]
    ),
    row("sdpa-v-batch", sdpa, Q, K, u(3, 5, 6), exc=ValueError, match="v: ", contains=["(3, 5, 6)"]),
    row("mea-kv-len", mea, Q, K, u(2, 6, 6), exc=ValueError, match="v: ", contains=["(2, 6, 6)"]),
    row("mea-batch", mea, Q, u(3, 5, 4), u(3, 5, 6), exc=ValueError, match="k: ", contains=["(3, 5, 4)"]),
    row(
        "cross_entropy-targets",
        F.cross_entropy,
        u(2, 3),
        np.array([0, 1, 2]),
        exc=ValueError,
        match="targets: ",
        contains=["(2,)", "(3,)"],
    ),
    # heads that do not divide
    row("sdpa-heads-no-gqa", sdpa, Q4, K4, V4, exc=ValueError, match="k: ", contains=["enable_gqa", "(2, 2, 5, 4)"]),
    row(
        "sdpa-gqa-not-multiple",
        sdpa,
        u(2, 3, 3, 4),
        K4,
        V4,
        enable_gqa=True,
        exc=ValueError,
        match="k: ",
        contains=["multiple", "(2, 3, 3, 4)"],
    ),
    row("sdpa-gqa-zero-kv-heads", sdpa, Q4, u(2, 0, 5, 4), u(2, 0, 5, 6), enable_gqa=True, exc=ValueError, match="k: "),
    row("mea-heads", mea, Q4, K4, V4, exc=ValueError, match="k: ", contains=["(2, 2, 5, 4)"]),
    # masks: non-broadcastable, integer, non-numeric, ragged, +inf/NaN
    row(
        "sdpa-mask-shape",
        sdpa,
        Q,
        K,
        V,
        attn_mask=np.ones((3, 4), bool),
        exc=ValueError,
        match="attn_mask: ",
        contains=["(2, 3, 5)", "(3, 4)"],
    ),
    row(
        "sdpa-mask-int",
        sdpa,
        Q,
        K,
        V,
        attn_mask=np.ones((3, 5), int),
        exc=TypeError,
        match="attn_mask: ",
        contains=["int64"],
    ),
    row("sdpa-mask-uint8", sdpa, Q, K, V, attn_mask=np.ones((3, 5), np.uint8), exc=TypeError, match="attn_mask: "),
    row("sdpa-mask-complex", sdpa, Q, K, V, attn_mask=np.ones((3, 5), complex), exc=TypeError, match="attn_mask: "),
    row("sdpa-mask-str", sdpa, Q, K, V, attn_mask="causal", exc=TypeError, match="attn_mask: "),
    row("sdpa-mask-ragged", sdpa, Q, K, V, attn_mask=[[True], [True, False]], exc=TypeError, match="attn_mask: "),
    row(
        "sdpa-mask-nan",
        sdpa,
        Q,
        K,
        V,
        attn_mask=np.full((3, 5), NAN),
        exc=ValueError,
        match="attn_mask: ",
        contains=["NaN"],
    ),
    row(
        "sdpa-mask-posinf",
        sdpa,
        Q,
        K,
        V,
        attn_mask=np.full((3, 5), INF),
        exc=ValueError,
        match="attn_mask: ",
        contains=["+inf"],
    ),
    row(
        "mea-mask-shape",
        mea,
        Q,
        K,
        V,
        attn_mask=np.ones((5, 3), bool),
        exc=ValueError,
        match="attn_mask: ",
        contains=["(2, 3, 5)", "(5, 3)"],
    ),
    row("mea-mask-int", mea, Q, K, V, attn_mask=np.ones((3, 5), np.int8), exc=TypeError, match="attn_mask: "),
    row("mea-mask-ragged", mea, Q, K, V, attn_mask=[[1.0], [1.0, 2.0]], exc=TypeError, match="attn_mask: "),
    row("mea-mask-posinf", mea, Q, K, V, attn_mask=np.full((3, 5), INF), exc=ValueError, match="attn_mask: "),
    # non-integer sizes and bad options
    row("mea-block-float", mea, Q, K, V, block_size=2.0, exc=TypeError, match="block_size: ", contains=["2.0"]),
    row("mea-block-bool", mea, Q, K, V, block_size=True, exc=TypeError, match="block_size: "),
    row("mea-block-zero", mea, Q, K, V, block_size=0, exc=ValueError, match="block_size: ", contains=["got 0"]),
    row("mea-scale-nan", mea, Q, K, V, scale=NAN, exc=ValueError, match="scale: "),
    row("mea-causal-int", mea, Q, K, V, is_causal=1, exc=TypeError, match="is_causal: "),
    row("sdpa-scale-str", sdpa, Q, K, V, scale="big", exc=TypeError, match="scale: "),
    row("sdpa-gqa-str", sdpa, Q, K, V, enable_gqa="yes", exc=TypeError, match="enable_gqa: "),
    row("softmax-axis", F.softmax, u(2, 3), axis=2, exc=ValueError, match="axis: ", contains=["[-2, 1]", "got 2"]),
    row("softmax-axis-float", F.softmax, u(2, 3), axis=1.0, exc=TypeError, match="axis: "),
    row(
        "gelu-approximate", F.gelu, u(3), approximate="fast", exc=ValueError, match="approximate: ", contains=["'fast'"]
    ),
    row("layer_norm-eps", F.layer_norm, u(2, 3), None, None, -1.0, exc=ValueError, match="eps: ", contains=["-1.0"]),
    row(
        "cross_entropy-class",
        F.cross_entropy,
        u(2, 3),
        np.array([0, 3]),
        exc=ValueError,
        match="targets: ",
        contains=["[0, 3)"],
    ),
    row(
        "cross_entropy-ignore",
        F.cross_entropy,
        u(2, 3),
        np.array([0, 1]),
        ignore_index=1.5,
        exc=TypeError,
        match="ignore_index: ",
    ),
    row("embedding-ids-float", F.embedding, u(3), u(4, 2), exc=TypeError, match="ids: ", contains=["float64"]),
    row(
        "embedding-ids-range",
        F.embedding,
        np.array([0, 4]),
        u(4, 2),
        exc=ValueError,
        match="ids: ",
        contains=["[0, 4)", "4"],
    ),
    row("embedding-ids-ragged", F.embedding, [[0], [1, 2]], u(4, 2), exc=TypeError, match="ids: "),
    # p outside [0, 1] or NaN
    *[
        row(f"dropout-p-{p}", F.dropout, u(3), p, 0, exc=ValueError, match="p: ", contains=["[0, 1]", str(p)])
        for p in (-0.1, 1.5, NAN, INF)
    ],
    *[
        row(f"sdpa-dropout_p-{p}", sdpa, Q, K, V, dropout_p=p, exc=ValueError, match="dropout_p: ", contains=[str(p)])
        for p in (-0.5, 1.01, NAN)
    ],
    row("dropout-p-str", F.dropout, u(3), "0.5", 0, exc=TypeError, match="p: "),
    row(
        "dropout-rng",
        F.dropout,
        u(3),
        0.5,
        np.random.RandomState(0),
        exc=TypeError,
        match="rng: ",
        contains=["RandomState"],
    ),
    row("dropout-training", F.dropout, u(3), 0.5, 0, training="yes", exc=TypeError, match="training: "),
    # ragged values
    row("linear-x-ragged", F.linear, RAGGED, u(4, 2), exc=TypeError, match="x: ", contains=["list"]),
    row("sdpa-q-ragged", sdpa, RAGGED, K, V, exc=TypeError, match="q: "),
    row("mea-v-ragged", mea, Q, K, RAGGED, exc=TypeError, match="v: "),
]

# bool / complex / string / object values for every float argument of every op
VALUE_ARGS = {
    "linear.x": ("x", lambda a: F.linear(a, u(4, 3))),
    "linear.weight": ("weight", lambda a: F.linear(u(5, 3), a)),
    "linear.bias": ("bias", lambda a: F.linear(u(2, 3), u(3, 3), a)),
    "embedding.weight": ("weight", lambda a: F.embedding(np.array([0]), a)),
    "softmax.x": ("x", F.softmax),
    "relu.x": ("x", F.relu),
    "gelu.x": ("x", F.gelu),
    "dropout.x": ("x", lambda a: F.dropout(a, 0.5, 0)),
    "layer_norm.x": ("x", F.layer_norm),
    "layer_norm.weight": ("weight", lambda a: F.layer_norm(u(2, 3), a)),
    "layer_norm.bias": ("bias", lambda a: F.layer_norm(u(2, 3), None, a)),
    "cross_entropy.logits": ("logits", lambda a: F.cross_entropy(a, np.zeros(3, int))),
    "sdpa.q": ("q", lambda a: sdpa(a, u(3, 3), u(3, 3))),
    "sdpa.k": ("k", lambda a: sdpa(u(3, 3), a, u(3, 3))),
    "sdpa.v": ("v", lambda a: sdpa(u(3, 3), u(3, 3), a)),
    "mea.q": ("q", lambda a: mea(a, u(3, 3), u(3, 3))),
    "mea.k": ("k", lambda a: mea(u(3, 3), a, u(3, 3))),
    "mea.v": ("v", lambda a: mea(u(3, 3), u(3, 3), a)),
}


@pytest.mark.parametrize("fn,args,kwargs,exc,match,contains", FUNCTIONAL)
def test_functional_bad_input(fn, args, kwargs, exc, match, contains):
    run_row(fn, args, kwargs, exc, match, contains)


@pytest.mark.parametrize("kind", sorted(BAD_KINDS))
@pytest.mark.parametrize("arg", sorted(VALUE_ARGS))
def test_functional_non_real_values(arg, kind):
    name, fn = VALUE_ARGS[arg]
    a = BAD_KINDS[kind]((3,) if arg.endswith(("bias", "layer_norm.weight")) else (3, 3))
    expect_error(lambda: fn(a), TypeError, f"{name}: ", str(a.dtype))


# wrongly shaped / typed upstream gradients, every functional backward
BACKWARDS = {
    "linear": bw(lambda: F.linear(u(2, 3), u(4, 3), u(4)), F.linear_backward),
    "embedding": bw(lambda: F.embedding(np.array([[0, 1]]), u(4, 2)), F.embedding_backward),
    "softmax": bw(lambda: F.softmax(u(2, 3)), F.softmax_backward),
    "relu": bw(lambda: F.relu(u(2, 3)), F.relu_backward),
    "gelu": bw(lambda: F.gelu(u(2, 3), "tanh"), F.gelu_backward),
    "dropout": bw(lambda: F.dropout(u(2, 3), 0.5, 0), F.dropout_backward),
    "layer_norm": bw(lambda: F.layer_norm(u(2, 3), u(3), u(3)), F.layer_norm_backward),
    "cross_entropy": bw(lambda: F.cross_entropy(u(2, 3), np.array([0, 2])), F.cross_entropy_backward),
    "sdpa": bw(lambda: sdpa(Q, K, V, is_causal=True), F.scaled_dot_product_attention_backward),
    "sdpa-gqa-dropout": bw(
        lambda: sdpa(Q4, K4, V4, enable_gqa=True, dropout_p=0.3, rng=0), F.scaled_dot_product_attention_backward
    ),
    "mea": bw(lambda: mea(Q, K, V, block_size=2), F.memory_efficient_attention_backward),
}
OUT_SHAPES = {
    "linear": (2, 4),
    "embedding": (1, 2, 2),
    "softmax": (2, 3),
    "relu": (2, 3),
    "gelu": (2, 3),
    "dropout": (2, 3),
    "layer_norm": (2, 3),
    "cross_entropy": (),
    "sdpa": (2, 3, 6),
    "sdpa-gqa-dropout": (2, 4, 3, 6),
    "mea": (2, 3, 6),
}


@pytest.mark.parametrize("op", sorted(BACKWARDS))
def test_functional_bad_dout(op):
    f, shape = BACKWARDS[op], OUT_SHAPES[op]
    for bad in (shape + (1,), (2,) + shape, (7,)):
        expect_error(lambda: f(np.ones(bad)), ValueError, "dout: ", str(shape), str(bad))
    for kind, make in BAD_KINDS.items():
        expect_error(lambda: f(make(shape)), TypeError, "dout: ")
    expect_error(lambda: f(RAGGED), TypeError, "dout: ")
    f(np.ones(shape))  # the right shape works


# ----------------------------------------------------------------------------------- modules
MHA, ENC = npattn.MultiHeadAttention, npattn.EncoderBlock
X = u(2, 3, 4)


def call(make, *args, **kwargs):
    """A row's callable: build the module, then call it."""
    return lambda: make()(*args, **kwargs)


MODULES = [
    # constructors: non-integer sizes, heads that do not divide, p outside [0, 1]
    row("Linear-in", npattn.Linear, 2.5, 3, exc=TypeError, match="in_features: ", contains=["2.5"]),
    row("Linear-out0", npattn.Linear, 2, 0, exc=ValueError, match="out_features: ", contains=["got 0"]),
    row("LayerNorm-shape", npattn.LayerNorm, (2, 0), exc=ValueError, match="normalized_shape: "),
    row("LayerNorm-eps", npattn.LayerNorm, 3, eps=NAN, exc=ValueError, match="eps: "),
    row("Dropout-p", npattn.Dropout, 1.5, exc=ValueError, match="p: ", contains=["[0, 1]", "1.5"]),
    row("Dropout-p-nan", npattn.Dropout, NAN, exc=ValueError, match="p: ", contains=["nan"]),
    row("Embedding-dim", npattn.Embedding, 3, 2.0, exc=TypeError, match="embedding_dim: "),
    row(
        "FeedForward-act",
        npattn.FeedForward,
        4,
        8,
        activation="swish",
        exc=ValueError,
        match="activation: ",
        contains=["'swish'"],
    ),
    row("MHA-d_out-heads", MHA, 4, 6, 4, exc=ValueError, match="d_out: ", contains=["num_heads=4", "6"]),
    row("MHA-kv-heads", MHA, 4, 6, 3, num_kv_heads=2, exc=ValueError, match="num_kv_heads: ", contains=["3", "2"]),
    row("MHA-heads-float", MHA, 4, 4, 2.0, exc=TypeError, match="num_heads: "),
    row("MHA-dropout", MHA, 4, 4, 2, dropout=-0.1, exc=ValueError, match="dropout: "),
    row("MHA-memeff-dropout", MHA, 4, 4, 2, dropout=1.5, memory_efficient=True, exc=ValueError, match="dropout: "),
    row("MHA-dtype", MHA, 4, 4, 2, dtype=np.float16, exc=TypeError, match="dtype: ", contains=["float16"]),
    row("MHA-rng", MHA, 4, 4, 2, rng=1.5, exc=TypeError, match="rng: "),
    row("Encoder-heads", ENC, 6, 4, 8, exc=ValueError, match="d_model: ", contains=["num_heads=4", "6"]),
    row("Encoder-dropout", ENC, 4, 2, 8, dropout=NAN, exc=ValueError, match="dropout: "),
    row("Tiny-vocab", TinyTransformer, 0, 8, 4, 2, 1, 8, exc=ValueError, match="vocab_size: "),
    row("Tiny-heads", TinyTransformer, 5, 8, 6, 4, 1, 8, exc=ValueError, match="d_model: "),
    row("Tiny-dropout", TinyTransformer, 5, 8, 4, 2, 1, 8, dropout=2.0, exc=ValueError, match="dropout: "),
    # forward: wrong ndim, feature sizes, key/value lengths and batches
    row("Linear-x", call(lambda: npattn.Linear(3, 2), u(2, 4)), exc=ValueError, match="x: ", contains=["(2, 4)", "3"]),
    row("LayerNorm-x", call(lambda: npattn.LayerNorm(3), u(2, 4)), exc=ValueError, match="x: ", contains=["(2, 4)"]),
    row("FeedForward-x", call(lambda: npattn.FeedForward(3, 5), u(2, 4)), exc=ValueError, match="x: "),
    row("MHA-query-ndim", call(lambda: MHA(4, 4, 2), u(4)), exc=ValueError, match="query: ", contains=["(4,)"]),
    row(
        "MHA-query-features",
        call(lambda: MHA(4, 4, 2), u(2, 3, 5)),
        exc=ValueError,
        match="query: ",
        contains=["(2, 3, 5)", "4"],
    ),
    row(
        "MHA-key-batch",
        call(lambda: MHA(4, 4, 2), X, u(3, 5, 4), u(3, 5, 4)),
        exc=ValueError,
        match="key: ",
        contains=["(3, 5, 4)"],
    ),
    row(
        "MHA-value-len",
        call(lambda: MHA(4, 4, 2), X, u(2, 5, 4), u(2, 6, 4)),
        exc=ValueError,
        match="value: ",
        contains=["(2, 6, 4)"],
    ),
    row("MHA-key-only", call(lambda: MHA(4, 4, 2), X, X), exc=ValueError, match="key, value: "),
    row("MHA-kdim", call(lambda: MHA(4, 4, 2, kdim=3), X), exc=ValueError, match="key, value: ", contains=["kdim=3"]),
    # forward: masks
    row(
        "MHA-mask-shape",
        call(lambda: MHA(4, 4, 2), X, attn_mask=np.ones((4, 3), bool)),
        exc=ValueError,
        match="attn_mask: ",
        contains=["(4, 3)", "(2, 2, 3, 3)"],
    ),
    row(
        "MHA-mask-int",
        call(lambda: MHA(4, 4, 2), X, attn_mask=np.ones((3, 3), int)),
        exc=TypeError,
        match="attn_mask: ",
        contains=["int64"],
    ),
    row(
        "MHA-mask-ragged",
        call(lambda: MHA(4, 4, 2), X, attn_mask=[[True], [True, False]]),
        exc=TypeError,
        match="attn_mask: ",
    ),
    row(
        "MHA-mask-nan",
        call(lambda: MHA(4, 4, 2), X, attn_mask=np.full((3, 3), NAN)),
        exc=ValueError,
        match="attn_mask: ",
        contains=["NaN"],
    ),
    row(
        "MHA-kpm-shape",
        call(lambda: MHA(4, 4, 2), X, key_padding_mask=np.ones((2, 4), bool)),
        exc=ValueError,
        match="key_padding_mask: ",
        contains=["(2, 3)", "(2, 4)"],
    ),
    row(
        "MHA-kpm-int",
        call(lambda: MHA(4, 4, 2), X, key_padding_mask=np.ones((2, 3), np.int32)),
        exc=TypeError,
        match="key_padding_mask: ",
    ),
    row(
        "MHA-kpm-ragged",
        call(lambda: MHA(4, 4, 2), X, key_padding_mask=[[True], [True, False]]),
        exc=TypeError,
        match="key_padding_mask: ",
    ),
    row(
        "MHA-kpm-posinf",
        call(lambda: MHA(4, 4, 2), X, key_padding_mask=np.full((2, 3), INF)),
        exc=ValueError,
        match="key_padding_mask: ",
        contains=["+inf"],
    ),
    row(
        "MHA-memeff-weights",
        call(lambda: MHA(4, 4, 2, memory_efficient=True), X, need_weights=True),
        exc=ValueError,
        match="need_weights: ",
    ),
    row(
        "MHA-memeff-mask",
        call(lambda: MHA(4, 4, 2, memory_efficient=True), X, attn_mask=np.ones((3, 3), int)),
        exc=TypeError,
        match="attn_mask: ",
    ),
    row("Encoder-x", call(lambda: ENC(4, 2, 8), u(2, 3, 5)), exc=ValueError, match="x: ", contains=["(2, 3, 5)"]),
    row(
        "Encoder-mask",
        call(lambda: ENC(4, 2, 8), X, attn_mask=np.ones((2, 2), bool)),
        exc=ValueError,
        match="attn_mask: ",
    ),
    row(
        "Tiny-ids-float",
        call(lambda: TinyTransformer(5, 4, 4, 2, 1, 8), np.zeros((1, 3))),
        exc=TypeError,
        match="ids: ",
    ),
    row(
        "Tiny-too-long",
        call(lambda: TinyTransformer(5, 4, 4, 2, 1, 8), np.zeros((1, 5), int)),
        exc=ValueError,
        match="ids: ",
        contains=["context_length=4", "(1, 5)"],
    ),
    row(
        "Tiny-vocab-range",
        call(lambda: TinyTransformer(5, 4, 4, 2, 1, 8), np.array([[0, 5]])),
        exc=ValueError,
        match="ids: ",
        contains=["[0, 5)"],
    ),
    # from_torch_state_dict
    row("from_torch-not-mapping", MHA.from_torch_state_dict, 3, 2, exc=TypeError, match="state_dict: "),
    row(
        "from_torch-out-1d",
        MHA.from_torch_state_dict,
        {"out_proj.weight": np.zeros(4)},
        2,
        exc=ValueError,
        match="state_dict: ",
        contains=["(4,)"],
    ),
    row(
        "from_torch-in-proj",
        MHA.from_torch_state_dict,
        {"out_proj.weight": np.zeros((4, 4)), "in_proj_weight": np.zeros((12, 3))},
        2,
        exc=ValueError,
        match="state_dict: ",
        contains=["(12, 4)", "(12, 3)"],
    ),
    row(
        "from_torch-heads",
        MHA.from_torch_state_dict,
        {"out_proj.weight": np.zeros((4, 4)), "in_proj_weight": np.zeros((12, 4))},
        3,
        exc=ValueError,
        match="d_out: ",
    ),
    row(
        "from_torch-missing",
        MHA.from_torch_state_dict,
        {"in_proj_weight": np.zeros((12, 4))},
        2,
        exc=ValueError,
        match="state_dict: ",
        contains=["out_proj.weight"],
    ),
    # Parameter / Module helpers
    *[
        row(f"Parameter-{k}", npattn.Parameter, make((2,)), exc=TypeError, match="data: ")
        for k, make in sorted(BAD_KINDS.items())
    ],
    row("train-mode", lambda: npattn.Linear(2, 2).train("no"), exc=TypeError, match="mode: "),
    row("to-dtype", lambda: npattn.Linear(2, 2).to(np.int32), exc=TypeError, match="dtype: "),
    row(
        "ModuleList-append",
        lambda: npattn.ModuleList([npattn.Linear(2, 2), 3]),
        exc=TypeError,
        match=r"ModuleList.append: ",
    ),
]


@pytest.mark.parametrize("fn,args,kwargs,exc,match,contains", MODULES)
def test_module_bad_input(fn, args, kwargs, exc, match, contains):
    run_row(fn, args, kwargs, exc, match, contains)


@pytest.mark.parametrize("kind", sorted(BAD_KINDS))
@pytest.mark.parametrize(
    "make,name",
    [
        (lambda: npattn.Linear(3, 3), "x"),
        (lambda: npattn.LayerNorm(3), "x"),
        (lambda: npattn.Dropout(0.5), "x"),
        (lambda: npattn.FeedForward(3, 4), "x"),
        (lambda: MHA(3, 4, 2), "query"),
        (lambda: ENC(3, 1, 4), "x"),
        (lambda: book.SelfAttention_v1(3, 2), "x"),
        (lambda: book.CausalAttention(3, 2, 4, 0.0), "x"),
        (lambda: book.MultiHeadAttentionWrapper(3, 2, 4, 0.0, 2), "x"),
        (lambda: book.MultiHeadAttention(3, 4, 4, 0.0, 2), "x"),
    ],
    ids=["Linear", "LayerNorm", "Dropout", "FeedForward", "MHA", "EncoderBlock", "v1", "Causal", "Wrapper", "BookMHA"],
)
def test_module_non_real_inputs(make, name, kind):
    m = make()
    a = BAD_KINDS[kind]((2, 3, 3))
    expect_error(lambda: m(a), TypeError, f"{name}: ", str(a.dtype))
    assert all(sub._cache is None for sub in m.modules())


def test_mha_cross_attention_value_dtypes():
    m = MHA(3, 4, 2)
    for kind, make in BAD_KINDS.items():
        expect_error(lambda: m(u(2, 3, 3), make((2, 4, 3)), u(2, 4, 3)), TypeError, "key: ")
        expect_error(lambda: m(u(2, 3, 3), u(2, 4, 3), make((2, 4, 3))), TypeError, "value: ")


# --------------------------------------------------------------------- module backward protocol
XB = u(2, 3, 4)
IDS = np.array([[0, 1, 2]])
# factory, inputs, forward kwargs
PROTOCOL = {
    "Linear": (lambda: npattn.Linear(4, 3, rng=0), (XB,), {}),
    "LayerNorm": (lambda: npattn.LayerNorm(4), (XB,), {}),
    "Dropout": (lambda: npattn.Dropout(0.5, rng=0), (XB,), {}),
    "Embedding": (lambda: npattn.Embedding(4, 3, rng=0), (IDS,), {}),
    "FeedForward": (lambda: npattn.FeedForward(4, 6, activation="gelu", dropout=0.2, rng=0), (XB,), {}),
    "MHA": (lambda: MHA(4, 4, 2, dropout=0.2, rng=0), (XB,), {}),
    "MHA-weights": (lambda: MHA(4, 4, 2, rng=0), (XB,), {"need_weights": True}),
    "MHA-cross-gqa": (
        lambda: MHA(4, 4, 2, num_kv_heads=1, kdim=3, vdim=5, rng=0),
        (XB, u(2, 6, 3), u(2, 6, 5)),
        {"key_padding_mask": np.zeros((2, 6), bool)},
    ),
    "MHA-memeff": (lambda: MHA(4, 4, 2, causal=True, memory_efficient=True, rng=0), (XB,), {}),
    "EncoderBlock": (lambda: ENC(4, 2, 6, rng=0), (XB,), {}),
    "EncoderBlock-prenorm": (lambda: ENC(4, 2, 6, norm_first=True, causal=True, rng=0), (XB,), {}),
    "SelfAttention_v1": (lambda: book.SelfAttention_v1(4, 2, rng=0), (XB,), {}),
    "SelfAttention_v2": (lambda: book.SelfAttention_v2(4, 2, rng=0), (XB[0],), {}),
    "CausalAttention": (lambda: book.CausalAttention(4, 2, 5, 0.1, rng=0), (XB,), {}),
    "Wrapper": (lambda: book.MultiHeadAttentionWrapper(4, 2, 5, 0.1, 2, rng=0), (XB,), {}),
    "BookMHA": (lambda: book.MultiHeadAttention(4, 4, 5, 0.1, 2, rng=0), (XB,), {}),
    "TinyTransformer": (lambda: TinyTransformer(5, 4, 4, 2, 1, 6, rng=0), (IDS,), {}),
}


def _first(y):
    return y[0] if isinstance(y, tuple) else y


def _grads_snapshot(m):
    return {n: p.grad.copy() for n, p in m.named_parameters()}


@pytest.mark.parametrize("case", sorted(PROTOCOL))
def test_module_bad_dy_names_dy_and_keeps_the_state(case):
    make, inputs, kw = PROTOCOL[case]
    name = "dlogits" if case == "TinyTransformer" else "dy"
    m = make()
    shape = _first(m(*inputs, **kw)).shape
    snap = _grads_snapshot(m)
    bads = [shape + (1,), shape[:-1] + (shape[-1] + 1,), (5,)]
    for bad in bads:
        expect_error(lambda: m.backward(np.ones(bad)), ValueError, f"{name}: ", str(shape), str(bad))
    for kind, mk in BAD_KINDS.items():
        expect_error(lambda: m.backward(mk(shape)), TypeError, f"{name}: ")
    expect_error(lambda: m.backward(RAGGED), TypeError, f"{name}: ")
    expect_error(lambda: m.backward(None), TypeError, f"{name}: ")
    for n, p in m.named_parameters():  # nothing was added into .grad
        np.testing.assert_array_equal(p.grad, snap[n], err_msg=n)
    # the bad calls released nothing: the right dy still works, once
    m.backward(np.ones(shape))
    msg = expect_error(lambda: m.backward(np.ones(shape)), RuntimeError, rf"{type(m).__name__}.backward: ")
    assert "forward" in msg
    assert all(sub._cache is None for sub in m.modules())


@pytest.mark.parametrize("case", sorted(PROTOCOL))
def test_module_backward_before_forward_and_after_no_grad(case):
    make, inputs, kw = PROTOCOL[case]
    m = make()
    # before any forward, even with a garbage dy: the protocol error comes first
    for dy in (np.ones(3), "garbage", None):
        expect_error(lambda: m.backward(dy), RuntimeError, rf"{type(m).__name__}.backward: ", "forward")
    with npattn.no_grad():
        shape = _first(m(*inputs, **kw)).shape
    expect_error(lambda: m.backward(np.ones(shape)), RuntimeError, rf"{type(m).__name__}.backward: ", "no_grad")


@pytest.mark.parametrize("case", sorted(PROTOCOL))
def test_float64_dy_on_float32_module_is_cast(case):
    make, inputs, kw = PROTOCOL[case]
    m = make().to(np.float32)
    inputs = [a.astype(np.float32) if a.dtype.kind == "f" else a for a in inputs]
    y = _first(m(*inputs, **kw))
    assert y.dtype == np.float32
    g = m.backward(np.ones(y.shape, np.float64))
    for a in g if isinstance(g, tuple) else (g,):
        assert a is None or a.dtype == np.float32
    for n, p in m.named_parameters():
        assert p.grad.dtype == np.float32, n


# ----------------------------------------------------------------------------------- state dicts
SD_CASES = {
    "Linear": lambda: npattn.Linear(4, 3, rng=0),
    "MHA": lambda: MHA(4, 4, 2, qkv_bias=True, rng=0),
    "EncoderBlock": lambda: ENC(4, 2, 6, rng=0),
    "BookMHA": lambda: book.MultiHeadAttention(4, 4, 5, 0.1, 2, rng=0),
}


def _state_dict_rows(sd):
    k0 = next(iter(sd))
    wrong_shape = dict(sd)
    wrong_shape[k0] = np.zeros(sd[k0].shape + (1,))
    missing = dict(sd)
    del missing[k0]
    unexpected = dict(sd, extra=np.zeros(2))
    complex_ = dict(sd)
    complex_[k0] = sd[k0].astype(complex)
    string = dict(sd)
    string[k0] = np.full(sd[k0].shape, "a")
    ragged = dict(sd)
    ragged[k0] = RAGGED
    return [
        (wrong_shape, {}, ValueError, [repr(k0), str(sd[k0].shape), str(sd[k0].shape + (1,))]),
        (missing, {}, ValueError, ["missing", repr(k0)]),
        (unexpected, {}, ValueError, ["unexpected", "'extra'"]),
        (complex_, {}, ValueError, [repr(k0), "complex128"]),
        (string, {}, ValueError, [repr(k0), "<U1"]),
        (ragged, {}, ValueError, [repr(k0)]),
        (wrong_shape, {"strict": False}, ValueError, [repr(k0)]),
        (sd, {"strict": "yes"}, TypeError, ["strict"]),
        (list(sd.items()), {}, TypeError, ["list"]),
    ]


@pytest.mark.parametrize("case", sorted(SD_CASES))
def test_load_state_dict_errors_are_atomic(case):
    m = SD_CASES[case]()
    good = {k: np.asarray(v) + 1.0 for k, v in m.state_dict().items()}
    for bad, kw, exc, contains in _state_dict_rows(good):
        before = m.state_dict()
        expect_error(lambda: m.load_state_dict(bad, **kw), exc, r"(load_state_dict|state_dict|strict): ", *contains)
        after = m.state_dict()
        assert list(after) == list(before)
        for k in before:  # nothing changed
            np.testing.assert_array_equal(after[k], before[k], err_msg=k)
    m.load_state_dict(good)  # and the good dict still loads


# ----------------------------------------------------------------------------------- book
BOOK = [
    row(
        "v1-ndim",
        call(lambda: book.SelfAttention_v1(3, 2), u(1, 1, 2, 3)),
        exc=ValueError,
        match="x: ",
        contains=["(1, 1, 2, 3)"],
    ),
    row(
        "v1-d_in", call(lambda: book.SelfAttention_v1(3, 2), u(2, 4)), exc=ValueError, match="x: ", contains=["(2, 4)"]
    ),
    row("v2-ndim", call(lambda: book.SelfAttention_v2(3, 2), u(3)), exc=ValueError, match="x: "),
    *[
        row(f"{n}-context", call(mk, u(1, 5, 3)), exc=ValueError, match="x: ", contains=["context_length=4", "5"])
        for n, mk in [
            ("Causal", lambda: book.CausalAttention(3, 2, 4, 0.0)),
            ("Wrapper", lambda: book.MultiHeadAttentionWrapper(3, 2, 4, 0.0, 2)),
            ("BookMHA", lambda: book.MultiHeadAttention(3, 2, 4, 0.0, 2)),
        ]
    ],
    row(
        "Causal-context-2d",
        call(lambda: book.CausalAttention(3, 2, 4, 0.0), u(6, 3)),
        exc=ValueError,
        match="x: ",
        contains=["context_length=4", "6"],
    ),
    row("Causal-dropout", book.CausalAttention, 3, 2, 4, 1.5, exc=ValueError, match="dropout: "),
    row("Causal-context-float", book.CausalAttention, 3, 2, 4.0, 0.0, exc=TypeError, match="context_length: "),
    row("Wrapper-heads", book.MultiHeadAttentionWrapper, 3, 2, 4, 0.0, 0, exc=ValueError, match="num_heads: "),
    row("BookMHA-divide", book.MultiHeadAttention, 3, 3, 4, 0.0, 2, exc=ValueError, match="d_out: "),
    row("BookMHA-dropout-nan", book.MultiHeadAttention, 3, 2, 4, NAN, 2, exc=ValueError, match="dropout: "),
]


@pytest.mark.parametrize("fn,args,kwargs,exc,match,contains", BOOK)
def test_book_bad_input(fn, args, kwargs, exc, match, contains):
    run_row(fn, args, kwargs, exc, match, contains)


# ----------------------------------------------------------------------------------- gradcheck, masks
GX = u(2, 3)
GRADCHECK = [
    row("target-int", gradcheck, 42, GX, exc=TypeError, match="target: "),
    row("target-class", gradcheck, npattn.Linear, GX, exc=TypeError, match="target: ", contains=["instantiate"]),
    row("target-4-tuple", gradcheck, (F.relu, F.relu_backward, F.relu_jvp, F.relu), GX, exc=TypeError, match="target:"),
    row("target-no-jvp", gradcheck, (F.relu, F.relu_backward), GX, mode="fwd", exc=ValueError, match="target: "),
    row("mode", gradcheck, F.relu, GX, mode="forward", exc=ValueError, match="mode: "),
    row("dtype", gradcheck, F.relu, GX, dtype=np.float16, exc=ValueError, match="dtype: "),
    row("target-no-backward", gradcheck, lambda x: F.relu(x), GX, exc=ValueError, match="target: "),
    row("no-inputs", gradcheck, F.relu, exc=ValueError, match="inputs: "),
    row("bool-input", gradcheck, F.relu, np.ones(3, bool), exc=TypeError, match="x: "),
    row("seed-str", gradcheck, F.relu, GX, seed="0", exc=TypeError, match="seed: "),
    row("seed-neg", gradcheck, F.relu, GX, seed=-1, exc=ValueError, match="seed: ", contains=["-1"]),
    row("eps-zero", gradcheck, F.relu, GX, eps=0.0, exc=ValueError, match="eps: "),
    row("eps-str", gradcheck, F.relu, GX, eps="small", exc=TypeError, match="eps: "),
    row("rtol-nan", gradcheck, F.relu, GX, rtol=NAN, exc=ValueError, match="rtol: "),
    row("atol-neg", gradcheck, F.relu, GX, atol=-1.0, exc=ValueError, match="atol: "),
    row("module-input", gradcheck, npattn.Linear(3, 2), u(2, 4), exc=ValueError, match="x: ", contains=["(2, 4)"]),
    row("module-no-input", gradcheck, npattn.Linear(3, 2), exc=ValueError, match="inputs: "),
    row(
        "grad-shape",
        gradcheck,
        (F.relu, lambda d, c: np.ones(5)),
        GX,
        exc=ValueError,
        match="<lambda>: ",
        contains=["(5,)", "(2, 3)"],
    ),
    row("ng-f", numerical_gradient, 3, np.ones(2), exc=TypeError, match="f: "),
    row("ng-f-array", numerical_gradient, lambda a: a, np.ones(2), exc=TypeError, match="f: ", contains=["(2,)"]),
    row("ng-x", numerical_gradient, lambda a: 0.0, [1.0, 2.0], exc=TypeError, match="x: "),
    row("ng-eps", numerical_gradient, lambda a: 0.0, np.ones(2), eps=0.0, exc=ValueError, match="eps: "),
]
MASKS = [
    row("causal-float", masks.causal, 2.5, exc=TypeError, match="Lq: "),
    row("causal-zero", masks.causal, 2, 0, exc=ValueError, match="Lk: "),
    row("padding-ragged", masks.padding, [[1], [1, 2]], 3, exc=TypeError, match="lengths: "),
    row("padding-range", masks.padding, [4], 3, exc=ValueError, match="lengths: ", contains=["[0, 3]"]),
    row("padding-float", masks.padding, [1.5], 3, exc=TypeError, match="lengths: "),
    row("window-zero", masks.sliding_window, 3, 0, exc=ValueError, match="window: "),
    row("combine-int", masks.combine, np.ones(3, int), exc=TypeError, match="masks: "),
    row("combine-ragged", masks.combine, [[True], [True, False]], exc=TypeError, match="masks: "),
    row(
        "combine-shapes",
        masks.combine,
        np.ones((2, 3), bool),
        np.ones((4, 1, 2), bool),
        exc=ValueError,
        match="masks: ",
        contains=["(2, 3)", "(4, 1, 2)"],
    ),
    row("to_additive-int", masks.to_additive, np.ones(3, int), exc=TypeError, match="mask: "),
    row("to_additive-dtype", masks.to_additive, np.ones(3, bool), dtype=int, exc=TypeError, match="dtype: "),
    row("to_additive-dtype-str", masks.to_additive, np.ones(3, bool), dtype="banana", exc=TypeError, match="dtype: "),
    row("kpm-int", masks.from_key_padding_mask, np.ones((2, 3), int), exc=TypeError, match="key_padding_mask: "),
    row("kpm-0d", masks.from_key_padding_mask, np.bool_(True), exc=ValueError, match="key_padding_mask: "),
    row("kpm-ragged", masks.from_key_padding_mask, [[True], [True, False]], exc=TypeError, match="key_padding_mask: "),
    row("kpm-nan", masks.from_key_padding_mask, np.full((2, 3), NAN), exc=ValueError, match="key_padding_mask: "),
]


@pytest.mark.parametrize("fn,args,kwargs,exc,match,contains", GRADCHECK + MASKS)
def test_gradcheck_and_masks_bad_input(fn, args, kwargs, exc, match, contains):
    run_row(fn, args, kwargs, exc, match, contains)


def test_numerical_gradient_restores_x_when_f_raises():
    x = np.arange(3.0)

    def f(a):
        if a[1] != 1.0:
            raise KeyError("boom")
        return float(a.sum())

    with pytest.raises(KeyError):
        numerical_gradient(f, x)
    np.testing.assert_array_equal(x, [0.0, 1.0, 2.0])


# ----------------------------------------------------------------------------------- optimizers, CLI
def _params():
    return [npattn.Parameter(np.ones(3))]


def _step_with_grad(opt_cls, grad, **kw):
    def f():
        ps = _params()
        opt = opt_cls(ps, **kw)
        ps[0].grad = grad
        opt.step()

    return f


OPTIM = [
    row("sgd-lr-inf", SGD, _params(), lr=INF, exc=ValueError, match="lr: "),
    row("adam-betas-nan", Adam, _params(), betas=(NAN, 0.9), exc=ValueError, match=r"betas\[0\]: "),
    row("adamw-eps-inf", AdamW, _params(), eps=INF, exc=ValueError, match="eps: "),
    row("adam-wd-bool", Adam, _params(), weight_decay=True, exc=TypeError, match="weight_decay: "),
    row(
        "sgd-grad-shape",
        _step_with_grad(SGD, np.ones(4), lr=0.1),
        exc=ValueError,
        match=r"SGD.step: ",
        contains=["(3,)", "(4,)"],
    ),
    row(
        "adam-grad-complex",
        _step_with_grad(Adam, np.ones(3, complex)),
        exc=TypeError,
        match=r"Adam.step: ",
        contains=["complex128"],
    ),
    row("adamw-grad-str", _step_with_grad(AdamW, "abc"), exc=TypeError, match=r"AdamW.step: ", contains=["str"]),
    row("clip-max-norm-nan", clip_grad_norm_, _params(), NAN, exc=ValueError, match="max_norm: "),
    row(
        "clip-flag",
        clip_grad_norm_,
        _params(),
        1.0,
        error_if_nonfinite="yes",
        exc=TypeError,
        match="error_if_nonfinite: ",
    ),
    row(
        "warmup-float",
        lambda: WarmupCosine(SGD(_params(), lr=0.1), warmup_steps=1.5, total_steps=4),
        exc=TypeError,
        match="warmup_steps: ",
    ),
]


@pytest.mark.parametrize("fn,args,kwargs,exc,match,contains", OPTIM)
def test_optim_bad_input(fn, args, kwargs, exc, match, contains):
    run_row(fn, args, kwargs, exc, match, contains)


def test_clip_grad_norm_of_huge_finite_gradients_is_finite():
    ps = _params()
    ps[0].grad = np.array([3e200, 4e200, 0.0])
    total = clip_grad_norm_(ps, 1.0)
    assert total == pytest.approx(5e200, rel=1e-12)
    np.testing.assert_allclose(ps[0].grad, [0.6, 0.8, 0.0], rtol=1e-9)


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "--nope"],
        ["check", "--seed", "-1"],
        ["check", "--seed", "1.5"],
        ["demo", "--steps", "1.5"],
        ["demo", "--seed", "x"],
        ["demo", "--task"],
        ["check", "extra"],
    ],
)
def test_cli_bad_arguments_exit_2_with_usage(argv):
    from npattn.__main__ import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "usage:" in err.getvalue() and "Traceback" not in err.getvalue()

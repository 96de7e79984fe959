"""Bad input for every constructor, forward and backward: npattn's own ValueError/TypeError,
naming the argument, raised before any arithmetic (never a raw numpy error)."""

import numpy as np
import pytest

import npattn
from npattn import book

M = npattn.MultiHeadAttention
E = npattn.EncoderBlock
X = np.zeros((2, 3, 4))
XB = np.zeros((1, 3, 3))
NAN = float("nan")

CONSTRUCTORS = [
    # Linear
    (lambda: npattn.Linear(2.5, 3), TypeError, "in_features"),
    (lambda: npattn.Linear(2, "3"), TypeError, "out_features"),
    (lambda: npattn.Linear(0, 3), ValueError, "in_features"),
    (lambda: npattn.Linear(2, 3, bias=1), TypeError, "bias"),
    (lambda: npattn.Linear(2, 3, dtype=int), TypeError, "dtype"),
    (lambda: npattn.Linear(2, 3, rng="seed"), TypeError, "rng"),
    (lambda: npattn.Linear(2, 3, rng=-1), ValueError, "rng"),
    # LayerNorm
    (lambda: npattn.LayerNorm(3.0), TypeError, "normalized_shape"),
    (lambda: npattn.LayerNorm((2, 0)), ValueError, "normalized_shape"),
    (lambda: npattn.LayerNorm(()), ValueError, "normalized_shape"),
    (lambda: npattn.LayerNorm(0), ValueError, "normalized_shape"),
    (lambda: npattn.LayerNorm(3, eps=-1e-5), ValueError, "eps"),
    (lambda: npattn.LayerNorm(3, eps=NAN), ValueError, "eps"),
    (lambda: npattn.LayerNorm(3, elementwise_affine="yes"), TypeError, "elementwise_affine"),
    (lambda: npattn.LayerNorm(3, bias=None), TypeError, "bias"),
    (lambda: npattn.LayerNorm(3, dtype=np.float16), TypeError, "dtype"),
    # Dropout
    (lambda: npattn.Dropout(1.1), ValueError, "p"),
    (lambda: npattn.Dropout(-0.1), ValueError, "p"),
    (lambda: npattn.Dropout(NAN), ValueError, "p"),
    (lambda: npattn.Dropout("0.5"), TypeError, "p"),
    (lambda: npattn.Dropout(True), TypeError, "p"),
    # Embedding
    (lambda: npattn.Embedding(0, 2), ValueError, "num_embeddings"),
    (lambda: npattn.Embedding(3, 2.0), TypeError, "embedding_dim"),
    (lambda: npattn.Embedding(3, 2, dtype="f2"), TypeError, "dtype"),
    # FeedForward
    (lambda: npattn.FeedForward("2", 3), TypeError, "d_model"),
    (lambda: npattn.FeedForward(2, 3.0), TypeError, "d_ff"),
    (lambda: npattn.FeedForward(2, 0), ValueError, "d_ff"),
    (lambda: npattn.FeedForward(2, 3, activation="tanh"), ValueError, "activation"),
    (lambda: npattn.FeedForward(2, 3, activation=None), ValueError, "activation"),
    (lambda: npattn.FeedForward(2, 3, activation=["relu"]), ValueError, "activation"),
    (lambda: npattn.FeedForward(2, 3, dropout=2), ValueError, "dropout"),
    (lambda: npattn.FeedForward(2, 3, dropout=NAN), ValueError, "dropout"),
    (lambda: npattn.FeedForward(2, 3, dtype=np.int64), TypeError, "dtype"),
    # MultiHeadAttention
    (lambda: M(4.0, 4, 2), TypeError, "d_in"),
    (lambda: M(4, "4", 2), TypeError, "d_out"),
    (lambda: M(4, 4, 0), ValueError, "num_heads"),
    (lambda: M(4, 4, 2.0), TypeError, "num_heads"),
    (lambda: M(4, 5, 2), ValueError, "d_out"),
    (lambda: M(4, 6, 3, num_kv_heads=2), ValueError, "num_kv_heads"),
    (lambda: M(4, 4, 2, num_kv_heads=4), ValueError, "num_kv_heads"),
    (lambda: M(4, 4, 2, num_kv_heads=0), ValueError, "num_kv_heads"),
    (lambda: M(4, 4, 2, num_kv_heads=1.0), TypeError, "num_kv_heads"),
    (lambda: M(4, 4, 2, kdim=0), ValueError, "kdim"),
    (lambda: M(4, 4, 2, vdim=2.0), TypeError, "vdim"),
    (lambda: M(4, 4, 2, dropout=1.5), ValueError, "dropout"),
    (lambda: M(4, 4, 2, dropout=-0.1), ValueError, "dropout"),
    (lambda: M(4, 4, 2, dropout=NAN), ValueError, "dropout"),
    (lambda: M(4, 4, 2, qkv_bias="no"), TypeError, "qkv_bias"),
    (lambda: M(4, 4, 2, out_bias=0), TypeError, "out_bias"),
    (lambda: M(4, 4, 2, causal=1), TypeError, "causal"),
    (lambda: M(4, 4, 2, dtype=np.int32), TypeError, "dtype"),
    (lambda: M(4, 4, 2, dtype="banana"), TypeError, "dtype"),
    (lambda: M(4, 4, 2, rng=1.5), TypeError, "rng"),
    # EncoderBlock
    (lambda: E(5, 2, 4), ValueError, "d_model"),
    (lambda: E(4.0, 2, 4), TypeError, "d_model"),
    (lambda: E(4, 0, 4), ValueError, "num_heads"),
    (lambda: E(4, 2, "4"), TypeError, "d_ff"),
    (lambda: E(4, 2, 4, activation="swish"), ValueError, "activation"),
    (lambda: E(4, 2, 4, dropout=-0.5), ValueError, "dropout"),
    (lambda: E(4, 2, 4, dropout=NAN), ValueError, "dropout"),
    (lambda: E(4, 2, 4, norm_first="no"), TypeError, "norm_first"),
    (lambda: E(4, 2, 4, causal=None), TypeError, "causal"),
    (lambda: E(4, 2, 4, dtype=np.float16), TypeError, "dtype"),
    # book
    (lambda: book.SelfAttention_v1(0, 2), ValueError, "d_in"),
    (lambda: book.SelfAttention_v1(3, 2.0), TypeError, "d_out"),
    (lambda: book.SelfAttention_v1(3, 2, dtype=np.int8), TypeError, "dtype"),
    (lambda: book.SelfAttention_v2(3, 2, qkv_bias="x"), TypeError, "qkv_bias"),
    (lambda: book.CausalAttention(3, 2, 0, 0.0), ValueError, "context_length"),
    (lambda: book.CausalAttention(3, 2, 4.0, 0.0), TypeError, "context_length"),
    (lambda: book.CausalAttention(3, 2, 4, 1.5), ValueError, "dropout"),
    (lambda: book.CausalAttention(3, 2, 4, NAN), ValueError, "dropout"),
    (lambda: book.MultiHeadAttentionWrapper(3, 2, 4, 0.0, 0), ValueError, "num_heads"),
    (lambda: book.MultiHeadAttentionWrapper(3, 2, 4, 0.0, 2.0), TypeError, "num_heads"),
    (lambda: book.MultiHeadAttentionWrapper(3, 2, 4, NAN, 2), ValueError, "dropout"),
    (lambda: book.MultiHeadAttention(3, 3, 4, 0.0, 2), ValueError, "d_out"),
    (lambda: book.MultiHeadAttention(3, 2, "4", 0.0, 2), TypeError, "context_length"),
    (lambda: book.MultiHeadAttention(3, 2, 4, -1.0, 2), ValueError, "dropout"),
    (lambda: book.MultiHeadAttention(3, 2, 4, 0.0, 2, dtype=np.float16), TypeError, "dtype"),
]


@pytest.mark.parametrize("make,exc,match", CONSTRUCTORS, ids=[f"{i}-{c[2]}" for i, c in enumerate(CONSTRUCTORS)])
def test_bad_constructor_arguments(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


FORWARDS = [
    # Linear / LayerNorm / Dropout / Embedding / FeedForward
    (lambda: npattn.Linear(2, 3)(np.zeros((2, 4))), ValueError, r"x: .*\(2, 4\)"),
    (lambda: npattn.Linear(2, 3)(np.float64(1.0)), ValueError, "x"),
    (lambda: npattn.Linear(2, 3)(np.ones((2, 2), bool)), TypeError, "x"),
    (lambda: npattn.Linear(2, 3)(np.ones((2, 2), complex)), TypeError, "x"),
    (lambda: npattn.Linear(2, 3)(np.array([["a", "b"]])), TypeError, "x"),
    (lambda: npattn.LayerNorm(3)(np.zeros((2, 4))), ValueError, "x"),
    (lambda: npattn.Dropout(0.5)(np.ones(3, bool)), TypeError, "x"),
    (lambda: npattn.Dropout(0.5)(np.array(["a"])), TypeError, "x"),
    (lambda: npattn.Embedding(3, 2)(np.array([0.0, 1.0])), TypeError, "ids"),
    (lambda: npattn.Embedding(3, 2)(np.array([0, 3])), ValueError, "ids"),
    (lambda: npattn.Embedding(3, 2)(np.array([-1])), ValueError, "ids"),
    (lambda: npattn.FeedForward(2, 3)(np.zeros((2, 3))), ValueError, "x"),
    # MultiHeadAttention
    (lambda: M(4, 4, 2)(np.zeros((2, 3, 5))), ValueError, r"query: .*\(2, 3, 5\)"),
    (lambda: M(4, 4, 2)(np.zeros(4)), ValueError, "query"),
    (lambda: M(4, 4, 2)(np.zeros((2, 3, 4), bool)), TypeError, "query"),
    (lambda: M(4, 4, 2)(np.zeros((2, 3, 4), object)), TypeError, "query"),
    (lambda: M(4, 4, 2)(X, X), ValueError, "key, value"),
    (lambda: M(4, 4, 2)(X, value=X), ValueError, "key, value"),
    (lambda: M(4, 4, 2, kdim=3)(X), ValueError, "kdim"),
    (lambda: M(4, 4, 2, vdim=3)(X), ValueError, "vdim"),
    (lambda: M(4, 4, 2)(X, np.zeros((3, 3, 4)), np.zeros((3, 3, 4))), ValueError, r"key: .*\(3, 3, 4\)"),
    (lambda: M(4, 4, 2)(X, np.zeros((3, 4)), np.zeros((3, 4))), ValueError, "key"),
    (lambda: M(4, 4, 2)(X, np.zeros((2, 3, 4)), np.zeros((2, 5, 4))), ValueError, r"value: .*\(2, 5, 4\)"),
    (lambda: M(4, 4, 2)(X, np.zeros((2, 3, 4)), np.zeros((1, 3, 4))), ValueError, "value"),
    (lambda: M(4, 4, 2, kdim=3)(X, np.zeros((2, 3, 4)), X), ValueError, "key"),
    (lambda: M(4, 4, 2, vdim=3)(X, X, X), ValueError, "value"),
    (lambda: M(4, 4, 2)(X, X, X.astype(bool)), TypeError, "value"),
    (lambda: M(4, 4, 2)(X, attn_mask=np.ones((4, 3), bool)), ValueError, r"attn_mask: .*\(4, 3\)"),
    (lambda: M(4, 4, 2)(X, attn_mask=np.ones((3, 3, 3), bool)), ValueError, "attn_mask"),
    (lambda: M(4, 4, 2)(X, attn_mask=np.ones((4, 1, 3), bool)), ValueError, "attn_mask"),  # not torch's (b*H, L, S)
    (lambda: M(4, 4, 2)(X, attn_mask=np.ones((3, 3), int)), TypeError, "attn_mask"),
    (lambda: M(4, 4, 2)(X, attn_mask=np.ones((3, 3), np.uint8)), TypeError, "attn_mask"),
    (lambda: M(4, 4, 2)(X, attn_mask=np.ones((3, 3), complex)), TypeError, "attn_mask"),
    (lambda: M(4, 4, 2)(X, key_padding_mask=np.ones((2, 3), int)), TypeError, "key_padding_mask"),
    (lambda: M(4, 4, 2)(X, key_padding_mask=np.ones((2, 4), bool)), ValueError, r"key_padding_mask: .*\(2, 4\)"),
    (lambda: M(4, 4, 2)(X, key_padding_mask=np.ones((3,), bool)), ValueError, "key_padding_mask"),
    (lambda: M(4, 4, 2)(X, key_padding_mask=np.ones((1, 2, 3), bool)), ValueError, "key_padding_mask"),
    (
        lambda: M(4, 4, 2)(X, np.zeros((2, 5, 4)), np.zeros((2, 5, 4)), key_padding_mask=np.ones((2, 3), bool)),
        ValueError,
        "key_padding_mask",
    ),
    (lambda: M(4, 4, 2)(X, need_weights=1), TypeError, "need_weights"),
    # EncoderBlock
    (lambda: E(4, 2, 4)(np.zeros((2, 3, 5))), ValueError, "x"),
    (lambda: E(4, 2, 4)(np.zeros(4)), ValueError, "x"),
    (lambda: E(4, 2, 4)(X.astype(bool)), TypeError, "x"),
    (lambda: E(4, 2, 4)(X, attn_mask=np.ones((2, 2), bool)), ValueError, "attn_mask"),
    (lambda: E(4, 2, 4)(X, attn_mask=np.ones((3, 3), int)), TypeError, "attn_mask"),
    (lambda: E(4, 2, 4)(X, key_padding_mask=np.ones((3, 3), bool)), ValueError, "key_padding_mask"),
    (lambda: E(4, 2, 4)(X, key_padding_mask=np.zeros((2, 3), np.int8)), TypeError, "key_padding_mask"),
    # book
    (lambda: book.SelfAttention_v1(3, 2)(np.zeros(3)), ValueError, "x"),
    (lambda: book.SelfAttention_v1(3, 2)(np.zeros((1, 1, 2, 3))), ValueError, "x"),
    (lambda: book.SelfAttention_v1(3, 2)(np.zeros((2, 4))), ValueError, "x"),
    (lambda: book.SelfAttention_v2(3, 2)(np.zeros((2, 3), bool)), TypeError, "x"),
    (lambda: book.SelfAttention_v2(3, 2)(np.zeros((1, 1, 2, 3))), ValueError, "x"),
    (lambda: book.CausalAttention(3, 2, 4, 0.0)(np.zeros((1, 5, 3))), ValueError, "context_length"),
    (lambda: book.CausalAttention(3, 2, 4, 0.0)(np.zeros((5, 3))), ValueError, "context_length"),
    (lambda: book.CausalAttention(3, 2, 4, 0.0)(np.zeros((1, 1, 2, 3))), ValueError, "x"),
    (lambda: book.CausalAttention(3, 2, 4, 0.0)(np.zeros(3)), ValueError, "x"),
    (lambda: book.MultiHeadAttentionWrapper(3, 2, 4, 0.0, 2)(np.zeros((1, 5, 3))), ValueError, "context_length"),
    (lambda: book.MultiHeadAttentionWrapper(3, 2, 4, 0.0, 2)(np.zeros((3,))), ValueError, "x"),
    (lambda: book.MultiHeadAttentionWrapper(3, 2, 4, 0.0, 2)(np.zeros((1, 1, 2, 3))), ValueError, "x"),
    (lambda: book.MultiHeadAttention(3, 2, 4, 0.0, 2)(np.zeros((1, 5, 3))), ValueError, "context_length"),
    (lambda: book.MultiHeadAttention(3, 2, 4, 0.0, 2)(np.zeros((1, 1, 2, 3))), ValueError, "x"),
    (lambda: book.MultiHeadAttention(3, 2, 4, 0.0, 2)(np.zeros(3)), ValueError, "x"),
    (lambda: book.MultiHeadAttention(3, 2, 4, 0.0, 2)(np.zeros((1, 2, 4))), ValueError, "x"),
]


@pytest.mark.parametrize("call,exc,match", FORWARDS, ids=[f"{i}-{c[2][:20]}" for i, c in enumerate(FORWARDS)])
def test_bad_forward_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


# modules, a good input and a wrongly shaped upstream gradient
BACKWARDS = [
    (lambda: npattn.Linear(2, 3), (np.zeros((4, 2)),), (4, 2)),
    (lambda: npattn.LayerNorm(3), (np.zeros((4, 3)),), (4, 2)),
    (lambda: npattn.Dropout(0.5, rng=0), (np.zeros((4, 3)),), (3, 4)),
    (lambda: npattn.Embedding(3, 2), (np.array([[0, 1]]),), (1, 2, 3)),
    (lambda: npattn.FeedForward(2, 3), (np.zeros((4, 2)),), (4, 3)),
    (lambda: M(4, 4, 2), (X,), (2, 3, 5)),
    (lambda: M(4, 4, 2), (X, X, X), (2, 3)),
    (lambda: M(4, 4, 2, num_kv_heads=1, kdim=2, vdim=3), (X, np.zeros((2, 5, 2)), np.zeros((2, 5, 3))), (2, 5, 4)),
    (lambda: E(4, 2, 4), (X,), (2, 3, 5)),
    (lambda: E(4, 2, 4, norm_first=True), (X,), (2, 3, 5)),
    (lambda: E(4, 2, 4, norm_first=True), (X,), (3, 4)),
    (lambda: book.SelfAttention_v1(3, 2), (np.zeros((2, 3)),), (2, 3)),
    (lambda: book.SelfAttention_v2(3, 2), (np.zeros((2, 3)),), (2, 3)),
    (lambda: book.CausalAttention(3, 2, 4, 0.0), (XB,), (1, 3, 3)),
    (lambda: book.MultiHeadAttentionWrapper(3, 2, 4, 0.0, 2), (XB,), (1, 3, 2)),
    (lambda: book.MultiHeadAttention(3, 2, 4, 0.0, 2), (XB,), (1, 2, 2)),
]


@pytest.mark.parametrize("make,inputs,bad", BACKWARDS, ids=[f"{i}" for i in range(len(BACKWARDS))])
def test_bad_upstream_gradient(make, inputs, bad):
    m = make()
    y = m(*inputs)
    snap = {n: p.grad.copy() for n, p in m.named_parameters()}
    with pytest.raises(ValueError, match=r"(dy|dout): expected shape .*" + r"\(" + ", ".join(map(str, y.shape))):
        m.backward(np.zeros(bad))
    for n, p in m.named_parameters():  # nothing accumulated from the bad call
        np.testing.assert_array_equal(p.grad, snap[n], err_msg=n)
    with pytest.raises(TypeError, match="(dy|dout)"):
        _bool_dy(make, inputs)


def _bool_dy(make, inputs):
    m = make()
    y = m(*inputs)
    m.backward(np.zeros(y.shape, bool))


def test_inputs_are_never_modified():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 4))
    kv = rng.standard_normal((2, 5, 4))
    mask = rng.random((3, 5)) < 0.7
    fmask = rng.standard_normal((3, 3))
    kpm = rng.random((2, 5)) < 0.3
    copies = [a.copy() for a in (x, kv, mask, fmask, kpm)]
    m = M(4, 4, 2, dropout=0.3, rng=0)
    m(x, kv, kv, attn_mask=mask, key_padding_mask=kpm)
    dy = rng.standard_normal((2, 3, 4))
    dyc = dy.copy()
    m.backward(dy)
    m(x, attn_mask=fmask)
    m.backward(dy)
    e = E(4, 2, 6, norm_first=True, rng=0)
    e(x, attn_mask=fmask)
    e.backward(dy)
    for a, c in zip((x, kv, mask, fmask, kpm, dy), copies + [dyc]):
        np.testing.assert_array_equal(a, c)

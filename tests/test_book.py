"""The numbers printed in chapter 3 of *Build a Large Language Model (From Scratch)*, reproduced
with npattn from the book's seeded weights shipped as ``npattn.data.load("chapter3")``."""

import numpy as np
import pytest

import npattn
from npattn import book, data
from npattn import functional as F

NPZ = data.load("chapter3")
INPUTS = NPZ["inputs"].astype(np.float64)  # "Your journey starts with one step"
BATCH = np.stack([INPUTS, INPUTS])
PRINTED = 1e-4  # the book prints four decimals


def weights(prefix):
    return {k[len(prefix) + 1 :]: NPZ[k] for k in NPZ if k.startswith(prefix + ".")}


def test_inputs_are_the_book_embeddings():
    np.testing.assert_allclose(INPUTS[1], [0.55, 0.87, 0.66], atol=1e-7)
    assert INPUTS.shape == (6, 3)


def test_simple_attention_for_journey_with_functional_ops():
    query = INPUTS[1]
    scores, _ = F.linear(INPUTS, query[None, :])  # the six dot products x_i . x_2
    scores = scores[:, 0]
    np.testing.assert_allclose(scores, [0.9544, 1.4950, 1.4754, 0.8434, 0.7070, 1.0865], atol=PRINTED)
    w, _ = F.softmax(scores, axis=0)
    np.testing.assert_allclose(w, [0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581], atol=PRINTED)
    assert abs(w.sum() - 1.0) < 1e-12
    ctx, _ = F.linear(w[None, :], INPUTS.T)  # the weighted sum sum_i w_i x_i
    np.testing.assert_allclose(ctx[0], [0.4419, 0.6515, 0.5683], atol=PRINTED)
    # all context vectors at once: softmax(X X^T) X
    all_scores, _ = F.linear(INPUTS, INPUTS)
    all_w, _ = F.softmax(all_scores, axis=-1)
    all_ctx, _ = F.linear(all_w, INPUTS.T)
    np.testing.assert_allclose(all_ctx[1], [0.4419, 0.6515, 0.5683], atol=PRINTED)
    np.testing.assert_allclose(all_ctx, NPZ["out.simple"], atol=1e-6, rtol=0)


def test_manual_weights_seed_123_via_self_attention_v1():
    sa = book.SelfAttention_v1(3, 2)
    sa.load_state_dict({k[len("manual.") :]: NPZ[k] for k in NPZ if k.startswith("manual.")})
    query_2 = INPUTS[1] @ sa.W_query.data
    np.testing.assert_allclose(query_2, [0.4306, 1.4551], atol=PRINTED)
    keys = INPUTS @ sa.W_key.data
    np.testing.assert_allclose(query_2 @ keys[1], 1.8524, atol=PRINTED)
    out = sa(INPUTS)
    np.testing.assert_allclose(out[1], [0.3061, 0.8210], atol=PRINTED)
    np.testing.assert_allclose(out[1], NPZ["out.manual"], atol=1e-6, rtol=0)
    np.testing.assert_allclose(out[0], [0.2996, 0.8053], atol=PRINTED)


@pytest.mark.parametrize(
    "prefix,factory,x,first,last",
    [
        ("sa_v1", lambda: book.SelfAttention_v1(3, 2), INPUTS, [0.2996, 0.8053], None),
        ("sa_v2", lambda: book.SelfAttention_v2(3, 2), INPUTS, [-0.0739, 0.0713], None),
        ("ca", lambda: book.CausalAttention(3, 2, 6, 0.0), BATCH, [-0.4519, 0.2216], [-0.5299, -0.1081]),
        (
            "mhaw",
            lambda: book.MultiHeadAttentionWrapper(3, 2, 6, 0.0, num_heads=2),
            BATCH,
            [-0.4519, 0.2216, 0.4772, 0.1063],
            [-0.5299, -0.1081, 0.5077, 0.3493],
        ),
        ("mha", lambda: book.MultiHeadAttention(3, 2, 6, 0.0, num_heads=2), BATCH, [0.3190, 0.4858], [0.2575, 0.4028]),
    ],
)
@pytest.mark.parametrize("training", [False, True])
def test_book_objects_reproduce_printed_and_stored_outputs(prefix, factory, x, first, last, training):
    m = factory()
    m.load_state_dict(weights(prefix))  # strict: the exported keys are exactly ours
    m.train(training)  # dropout 0.0: training mode changes nothing
    out = m(x)
    expected = NPZ[f"out.{prefix}"]
    assert out.shape == expected.shape and out.dtype == np.float64
    row = out[0] if out.ndim == 2 else out[0, 0]
    np.testing.assert_allclose(row, first, atol=PRINTED)
    if last is not None:
        np.testing.assert_allclose(out[1, -1], last, atol=PRINTED)
    np.testing.assert_allclose(out, expected, atol=1e-6, rtol=0)
    # the (num_tokens, d_in) form gives the batch's rows
    if out.ndim == 3:
        np.testing.assert_allclose(m(x[0]), out[0], rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize(
    "prefix,factory,x",
    [
        ("sa_v1", lambda: book.SelfAttention_v1(3, 2, dtype=np.float32), INPUTS),
        ("sa_v2", lambda: book.SelfAttention_v2(3, 2, dtype=np.float32), INPUTS),
        ("ca", lambda: book.CausalAttention(3, 2, 6, 0.0, dtype=np.float32), BATCH),
        ("mhaw", lambda: book.MultiHeadAttentionWrapper(3, 2, 6, 0.0, 2, dtype=np.float32), BATCH),
        ("mha", lambda: book.MultiHeadAttention(3, 2, 6, 0.0, 2, dtype=np.float32), BATCH),
    ],
)
def test_book_objects_in_float32(prefix, factory, x):
    m = factory()
    m.load_state_dict(weights(prefix))
    out = m(x.astype(np.float32))
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, NPZ[f"out.{prefix}"], atol=1e-6, rtol=0)


def test_wrapper_head0_is_causal_attention():
    ca = weights("ca")
    head0 = {k[len("heads.0.") :]: v for k, v in weights("mhaw").items() if k.startswith("heads.0.")}
    assert set(ca) == set(head0)
    for k in ca:
        np.testing.assert_array_equal(ca[k], head0[k])
    np.testing.assert_array_equal(NPZ["out.mhaw"][..., :2], NPZ["out.ca"])


def test_shorter_sequences_use_the_top_left_of_the_mask():
    m = book.CausalAttention(3, 2, 6, 0.0)
    m.load_state_dict(weights("ca"))
    full = m(BATCH)
    # causal: the first 4 tokens' outputs do not depend on tokens 4, 5
    np.testing.assert_allclose(m(BATCH[:, :4]), full[:, :4], rtol=1e-13, atol=1e-15)
    mha = book.MultiHeadAttention(3, 2, 6, 0.0, 2)
    mha.load_state_dict(weights("mha"))
    np.testing.assert_allclose(mha(BATCH[:, :3]), mha(BATCH)[:, :3], rtol=1e-13, atol=1e-15)


def test_mask_buffer_is_used_like_torch():
    """The book masks where ``mask.bool()``; a loaded all-zero mask means no masking at all."""
    m = book.MultiHeadAttention(3, 2, 6, 0.0, 2)
    sd = weights("mha")
    sd["mask"] = np.zeros((6, 6), np.float32)
    m.load_state_dict(sd)
    plain = npattn.MultiHeadAttention(3, 2, 2)
    plain.load_state_dict({k: v for k, v in sd.items() if k != "mask"})
    np.testing.assert_allclose(m(BATCH), plain(BATCH), rtol=1e-13, atol=1e-15)
    assert not np.allclose(m(BATCH), NPZ["out.mha"], atol=1e-3)
    causal = npattn.MultiHeadAttention(3, 2, 2, causal=True)
    causal.load_state_dict({k: v for k, v in sd.items() if k != "mask"})
    np.testing.assert_allclose(causal(BATCH), NPZ["out.mha"], atol=1e-6, rtol=0)


def test_book_initialisation():
    v1 = book.SelfAttention_v1(30, 20, rng=0)
    for p in v1.parameters():
        assert p.shape == (30, 20) and p.data.min() >= 0 and p.data.max() < 1 and p.data.std() > 0.2
    ca = book.CausalAttention(16, 8, 5, 0.0, rng=0)
    np.testing.assert_array_equal(ca.mask, np.triu(np.ones((5, 5)), 1))
    for p in ca.parameters():
        assert p.shape == (8, 16) and np.abs(p.data).max() <= 0.25
    a = book.MultiHeadAttention(4, 4, 3, 0.0, 2, rng=5).state_dict()
    b = book.MultiHeadAttention(4, 4, 3, 0.0, 2, rng=5).state_dict()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])  # same seed, same parameters
    c = book.MultiHeadAttention(4, 4, 3, 0.0, 2, rng=6).state_dict()
    assert not np.array_equal(a["W_query.weight"], c["W_query.weight"])


def test_book_dropout_in_training_only():
    m = book.MultiHeadAttention(3, 2, 6, 0.5, 2, rng=0)
    m.load_state_dict(weights("mha"))
    m.eval()
    np.testing.assert_allclose(m(BATCH), NPZ["out.mha"], atol=1e-6, rtol=0)
    m.train()
    assert not np.allclose(m(BATCH), NPZ["out.mha"], atol=1e-3)

"""``npattn.masks``: causal (top-left, Lq != Lk), padding, sliding window, combine,
from_key_padding_mask, to_additive, and bad arguments."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import npattn
from npattn import masks

sizes = st.integers(1, 7)


@settings(max_examples=50)
@given(lq=sizes, lk=sizes)
def test_causal_top_left(lq, lk):
    m = masks.causal(lq, lk)
    assert m.dtype == bool and m.shape == (lq, lk)
    for i in range(lq):
        for j in range(lk):
            assert m[i, j] == (j <= i)
    assert m[0, 0]  # every query sees key 0: no row is empty


def test_causal_default_square_and_examples():
    np.testing.assert_array_equal(masks.causal(3), [[1, 0, 0], [1, 1, 0], [1, 1, 1]])
    np.testing.assert_array_equal(masks.causal(2, 4), [[1, 0, 0, 0], [1, 1, 0, 0]])
    np.testing.assert_array_equal(masks.causal(4, 2), [[1, 0], [1, 1], [1, 1], [1, 1]])


def test_causal_matches_torch_is_causal_alignment():
    torch = pytest.importorskip("torch")
    # torch documents is_causal as ones(L, S).tril(diagonal=0): top-left aligned
    for lq, lk in [(2, 5), (5, 2), (3, 3)]:
        np.testing.assert_array_equal(masks.causal(lq, lk), torch.ones(lq, lk, dtype=torch.bool).tril(0).numpy())


def test_causal_mask_equals_causal_flag_in_mha():
    x = np.random.default_rng(0).uniform(-1, 1, (2, 4, 3))
    kv = np.random.default_rng(1).uniform(-1, 1, (2, 6, 3))
    m = npattn.MultiHeadAttention(3, 4, 2, causal=True, rng=0)
    plain = npattn.MultiHeadAttention(3, 4, 2, rng=1)
    plain.load_state_dict(m.state_dict())
    np.testing.assert_allclose(m(x, kv, kv), plain(x, kv, kv, attn_mask=masks.causal(4, 6)), rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(m(x), plain(x, attn_mask=masks.causal(4)), rtol=1e-13, atol=1e-15)
    assert not np.allclose(m(x), plain(x))


@settings(max_examples=50)
@given(L=sizes, lengths=st.lists(st.integers(0, 7), min_size=0, max_size=4))
def test_padding(L, lengths):
    lengths = [min(n, L) for n in lengths]
    m = masks.padding(np.array(lengths, dtype=np.int64), L)
    assert m.dtype == bool and m.shape == (len(lengths), L)
    for b, n in enumerate(lengths):
        assert m[b].tolist() == [True] * n + [False] * (L - n)


def test_padding_is_complement_of_key_padding_mask_in_mha():
    x = np.random.default_rng(0).uniform(-1, 1, (2, 4, 3))
    m = npattn.MultiHeadAttention(3, 4, 2, rng=0)
    keep = masks.padding([2, 4], 4)
    a = m(x, key_padding_mask=~keep)
    b = m(x, attn_mask=keep[:, None, None, :])
    c = m(x, attn_mask=masks.from_key_padding_mask(~keep))
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, c)
    # a padded key has no influence on batch 0: change it and nothing moves
    x2 = x.copy()
    x2[0, 3] += 10.0
    np.testing.assert_allclose(m(x2, key_padding_mask=~keep)[0, :3], a[0, :3], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    "lengths,L,exc,match",
    [
        ([[1, 2]], 3, ValueError, "lengths"),
        ([-1, 2], 3, ValueError, "lengths"),
        ([4], 3, ValueError, "lengths"),
        ([1.5], 3, TypeError, "lengths"),
        ([True], 3, TypeError, "lengths"),
        ([1], 0, ValueError, "L"),
        ([1], 2.0, TypeError, "L"),
    ],
)
def test_padding_bad_arguments(lengths, L, exc, match):
    with pytest.raises(exc, match=match):
        masks.padding(lengths, L)


@settings(max_examples=50)
@given(L=sizes, window=st.integers(1, 8))
def test_sliding_window(L, window):
    m = masks.sliding_window(L, window)
    assert m.dtype == bool and m.shape == (L, L)
    for i in range(L):
        for j in range(L):
            assert m[i, j] == (i - window < j <= i)
        assert m[i].sum() == min(window, i + 1)
    if window >= L:
        np.testing.assert_array_equal(m, masks.causal(L))
    if window == 1:
        np.testing.assert_array_equal(m, np.eye(L, dtype=bool))


@pytest.mark.parametrize(
    "args,exc,match",
    [
        ((0, 2), ValueError, "L"),
        ((3, 0), ValueError, "window"),
        ((3, 1.0), TypeError, "window"),
        ((3.0, 1), TypeError, "L"),
        ((True, 1), TypeError, "L"),
    ],
)
def test_sliding_window_bad_arguments(args, exc, match):
    with pytest.raises(exc, match=match):
        masks.sliding_window(*args)


@pytest.mark.parametrize(
    "args,exc,match",
    [
        ((0,), ValueError, "Lq"),
        ((2, 0), ValueError, "Lk"),
        ((2.5,), TypeError, "Lq"),
        ((2, "3"), TypeError, "Lk"),
    ],
)
def test_causal_bad_arguments(args, exc, match):
    with pytest.raises(exc, match=match):
        masks.causal(*args)


# ------------------------------------------------------------------------------ combine


@settings(max_examples=40)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 4))
def test_combine_bool_is_and(seed, n):
    rng = np.random.default_rng(seed)
    ms = [rng.random((3, 4)) < 0.6 for _ in range(n)]
    copies = [m.copy() for m in ms]
    out = masks.combine(*ms, None)
    assert out.dtype == bool
    np.testing.assert_array_equal(out, np.logical_and.reduce(ms))
    for m, c in zip(ms, copies):
        np.testing.assert_array_equal(m, c)  # inputs untouched


def test_combine_float_sum_and_mixed():
    a = np.array([[0.0, -1.0], [2.0, 0.5]])
    b = np.array([[1.0, 1.0], [-np.inf, 0.0]])
    np.testing.assert_array_equal(masks.combine(a, b), a + b)
    keep = np.array([[True, False], [True, True]])
    out = masks.combine(a, keep)
    assert out.dtype == np.float64
    np.testing.assert_array_equal(out, [[0.0, -np.inf], [2.0, 0.5]])
    a32 = a.astype(np.float32)
    assert masks.combine(a32, keep).dtype == np.float32


def test_combine_broadcasts_and_matches_attention():
    keep_k = masks.padding([2, 3], 3)[:, None, None, :]  # (2, 1, 1, 3)
    c = masks.causal(3)  # (3, 3)
    out = masks.combine(keep_k, c)
    assert out.shape == (2, 1, 3, 3)
    np.testing.assert_array_equal(out, keep_k & c)
    x = np.random.default_rng(0).uniform(-1, 1, (2, 3, 4))
    m = npattn.MultiHeadAttention(4, 4, 2, rng=0)
    np.testing.assert_allclose(
        m(x, attn_mask=out), m(x, attn_mask=masks.combine(masks.to_additive(c), keep_k)), rtol=1e-13, atol=1e-15
    )


def test_combine_nothing_and_errors():
    assert masks.combine() is None
    assert masks.combine(None, None) is None
    with pytest.raises(ValueError, match="masks"):
        masks.combine(np.ones((2, 3), bool), np.ones((4, 3), bool))
    with pytest.raises(TypeError, match="masks"):
        masks.combine(np.ones((2, 3), bool), np.ones((2, 3), int))


def test_to_additive():
    m = np.array([True, False, True])
    np.testing.assert_array_equal(masks.to_additive(m), [0.0, -np.inf, 0.0])
    assert masks.to_additive(m, np.float32).dtype == np.float32
    f = np.array([0.5, -1.0])
    np.testing.assert_array_equal(masks.to_additive(f), f)
    with pytest.raises(TypeError, match="mask"):
        masks.to_additive(np.array([1, 0]))


# ------------------------------------------------------------------------------ key padding


def test_from_key_padding_mask():
    kpm = np.array([[False, False, True], [False, True, True]])
    out = masks.from_key_padding_mask(kpm)
    assert out.shape == (2, 1, 1, 3) and out.dtype == bool
    np.testing.assert_array_equal(out[:, 0, 0], ~kpm)
    np.testing.assert_array_equal(kpm, [[False, False, True], [False, True, True]])  # untouched
    f = np.array([[0.0, -np.inf, 1.0]])
    np.testing.assert_array_equal(masks.from_key_padding_mask(f), f[:, None, None, :])
    with pytest.raises(TypeError, match="key_padding_mask"):
        masks.from_key_padding_mask(np.array([[0, 1]]))
    with pytest.raises(TypeError, match="key_padding_mask"):
        masks.from_key_padding_mask(np.array([["a"]]))
    with pytest.raises(ValueError, match="key_padding_mask"):
        masks.from_key_padding_mask(np.array(True))


def test_float_key_padding_mask_in_mha_is_additive():
    x = np.random.default_rng(0).uniform(-1, 1, (2, 3, 4))
    m = npattn.MultiHeadAttention(4, 4, 2, rng=0)
    kpm_bool = np.array([[False, True, False], [False, False, False]])
    kpm_float = np.where(kpm_bool, -np.inf, 0.0)
    np.testing.assert_array_equal(m(x, key_padding_mask=kpm_bool), m(x, key_padding_mask=kpm_float))

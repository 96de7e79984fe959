"""Nucleus (top-p) sampling in npattn.generation."""

import numpy as np
import pytest

from npattn.generation import generate, next_token_probs, sample_next_token


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))
    # ranked masses before each token: 0, 0.5, 0.8, 0.95
    np.testing.assert_allclose(next_token_probs(logits, 1.0, top_p=0.5), [[1, 0, 0, 0]], atol=1e-15)
    np.testing.assert_allclose(next_token_probs(logits, 1.0, top_p=0.6), [[0.625, 0.375, 0, 0]], atol=1e-15)
    np.testing.assert_allclose(next_token_probs(logits, 1.0, top_p=0.81), [[0.5, 0.3, 0.15, 0]] / np.float64(0.95))
    np.testing.assert_allclose(next_token_probs(logits, 1.0, top_p=1.0), [[0.5, 0.3, 0.15, 0.05]])
    # the order of the vocabulary does not matter
    perm = np.array([2, 0, 3, 1])
    np.testing.assert_allclose(next_token_probs(logits[:, perm], 1.0, top_p=0.6), [[0, 0.625, 0, 0.375]], atol=1e-15)


def test_top_p_after_temperature_and_top_k():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 11))
    p = next_token_probs(logits, 0.7, 5, top_p=0.9)
    ref = next_token_probs(logits, 0.7, 5)
    for row, r in zip(p, ref):
        order = np.argsort(-r)
        before = np.cumsum(r[order]) - r[order]
        kept = order[before < 0.9]
        assert set(np.flatnonzero(row)) == set(kept)
        np.testing.assert_allclose(row[kept], r[kept] / r[kept].sum())


def test_sampling_never_draws_outside_the_nucleus():
    logits = np.log(np.array([[0.6, 0.3, 0.1]] * 4))
    draws = np.concatenate([sample_next_token(logits, 1.0, rng=s, top_p=0.7) for s in range(50)])
    assert set(draws.tolist()) <= {0, 1} and set(draws.tolist()) == {0, 1}


def test_generate_with_top_p_is_reproducible_and_restricted():
    table = np.log(np.array([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4]]))

    def model(idx):  # a bigram model: the last token picks a row
        return table[idx]

    a = generate(model, np.array([[0, 1]]), 20, 8, temperature=1.0, rng=3, top_p=0.6)
    b = generate(model, np.array([[0, 1]]), 20, 8, temperature=1.0, rng=3, top_p=0.6)
    np.testing.assert_array_equal(a, b)
    nxt = a[0, 2:]
    prev = a[0, 1:-1]
    allowed = {0: {0}, 1: {1}, 2: {2, 0}}  # row 2: 0.4, then 0.3 (token 0 first on the tie) reaches 0.6
    for p_, n_ in zip(prev, nxt):
        assert n_ in allowed[int(p_)]


@pytest.mark.parametrize(
    "bad, exc", [(0.0, ValueError), (1.5, ValueError), (-0.1, ValueError), ("0.5", TypeError), (True, TypeError)]
)
def test_bad_top_p(bad, exc):
    logits = np.zeros((1, 3))
    with pytest.raises(exc, match="top_p"):
        next_token_probs(logits, 1.0, top_p=bad)
    with pytest.raises(exc, match="top_p"):
        sample_next_token(logits, 1.0, top_p=bad)
    with pytest.raises(exc, match="top_p"):
        generate(lambda i: np.zeros(i.shape + (3,)), np.array([[0]]), 1, 4, top_p=bad)

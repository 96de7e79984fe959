"""Generation (``npattn.generation``, ``npattn.book.generate``/``generate_text_simple``,
``TinyTransformer.generate``): greedy, temperature, top-k, EOS, determinism, the KV cache."""

import numpy as np
import pytest

from npattn import book
from npattn.generation import generate, next_token_probs, sample_next_token
from npattn.models import TinyTransformer


def gpt(**kw):
    cfg = dict(vocab_size=13, context_length=8, emb_dim=8, n_heads=2, n_layers=2, drop_rate=0.2, qkv_bias=True)
    cfg.update(kw)
    return book.GPTModel(cfg, rng=3)


def manual_greedy(model, idx, n, ctx):
    model.eval()
    for _ in range(n):
        nxt = model(idx[:, -ctx:])[:, -1].argmax(-1)
        idx = np.concatenate([idx, nxt[:, None]], axis=1)
    return idx


# -- greedy ------------------------------------------------------------------------------------------
def test_generate_text_simple_is_the_argmax_loop_with_a_sliding_window():
    m = gpt()
    prompt = np.array([[1, 2, 3], [4, 5, 6]])
    out = book.generate_text_simple(m, prompt, 9, 4)  # beyond context_size 4: the window slides
    assert out.shape == (2, 12)
    np.testing.assert_array_equal(out, manual_greedy(gpt(), prompt, 9, 4))
    assert m.training  # the mode is restored
    with pytest.raises(RuntimeError):
        m.backward(np.zeros((2, 4, 13)))  # nothing kept for backward


def test_temperature_zero_ignores_top_k_and_draws_nothing():
    m = gpt()
    prompt = np.array([[1, 2]])
    rng = np.random.default_rng(0)
    state = rng.bit_generator.state
    out = book.generate(m, prompt, 5, 8, temperature=0.0, top_k=2, rng=rng)
    np.testing.assert_array_equal(out, book.generate_text_simple(m, prompt, 5, 8))
    assert rng.bit_generator.state == state


# -- sampling ------------------------------------------------------------------------------------------
def test_same_rng_same_tokens_other_seed_other_tokens():
    m = gpt()
    prompt = np.array([[1, 2, 3]] * 3)
    a = book.generate(m, prompt, 12, 8, temperature=1.5, rng=7)
    b = book.generate(m, prompt, 12, 8, temperature=1.5, rng=np.random.default_rng(7))
    np.testing.assert_array_equal(a, b)
    c = book.generate(m, prompt, 12, 8, temperature=1.5, rng=8)
    assert not np.array_equal(a, c)
    assert not np.array_equal(a[0], a[1])  # each row draws its own token


def test_sampling_follows_softmax_of_logits_over_temperature():
    logits = np.array([2.0, 1.0, 0.5, -1.0, 0.0])
    for temperature in (0.5, 1.0, 2.0):
        n = 40000
        draws = sample_next_token(np.tile(logits, (n, 1)), temperature, rng=0)
        freq = np.bincount(draws, minlength=5) / n
        p = np.exp(logits / temperature) / np.exp(logits / temperature).sum()
        np.testing.assert_allclose(next_token_probs(logits, temperature), p, rtol=1e-12)
        assert np.abs(freq - p).max() < 4 * np.sqrt(p.max() / n)


def test_top_k_masks_all_but_the_k_largest():
    logits = np.array([[0.3, 2.0, -1.0, 1.5, 1.0, 0.9]])
    p = next_token_probs(logits, 1.0, top_k=3)
    assert np.count_nonzero(p) == 3 and set(np.flatnonzero(p[0])) == {1, 3, 4}
    kept = logits[0, [1, 3, 4]]
    np.testing.assert_allclose(p[0, [1, 3, 4]], np.exp(kept) / np.exp(kept).sum(), rtol=1e-12)
    draws = sample_next_token(np.tile(logits, (5000, 1)), 5.0, top_k=3, rng=1)
    assert set(np.unique(draws)) == {1, 3, 4}
    assert set(np.unique(sample_next_token(np.tile(logits, (500, 1)), 1.0, top_k=1, rng=1))) == {1}
    # ties with the k-th largest are kept (the book's ``logits < min_val``)
    assert np.count_nonzero(next_token_probs(np.array([1.0, 2.0, 2.0, 0.0]), 1.0, top_k=1)) == 2
    # a k at least the vocabulary keeps everything
    np.testing.assert_allclose(next_token_probs(logits, 1.0, top_k=99), next_token_probs(logits, 1.0))
    # greedy: one-hot of the arg-max
    np.testing.assert_array_equal(next_token_probs(logits, 0.0), np.eye(6)[[1]])


def test_tiny_temperature_does_not_overflow():
    logits = np.array([[1e4, 0.0, -1e4]])
    p = next_token_probs(logits, 1e-300)
    np.testing.assert_array_equal(p, [[1.0, 0.0, 0.0]])
    assert sample_next_token(logits, 1e-300, rng=0)[0] == 0


# -- EOS -------------------------------------------------------------------------------------------------
def test_eos_stops_and_is_not_appended_for_one_sequence():
    m = gpt()
    prompt = np.array([[1, 2]])
    full = book.generate(m, prompt, 6, 8)
    eos = int(full[0, 4])  # the third generated token
    first = int(np.flatnonzero(full[0, 2:] == eos)[0]) + 2
    out = book.generate(m, prompt, 6, 8, eos_id=eos)
    np.testing.assert_array_equal(out, full[:, :first])
    np.testing.assert_array_equal(book.generate(m, prompt, 6, 8, eos_id=99), full)  # never produced


def test_eos_in_a_batch_pads_finished_rows():
    m = gpt()
    prompt = np.array([[1, 2], [7, 8]])
    full = book.generate(m, prompt, 6, 8)
    eos = int(full[0, 3])
    out = book.generate(m, prompt, 6, 8, eos_id=eos)
    for row, f in zip(out, full):
        hits = np.flatnonzero(f[2:] == eos)
        if hits.size and hits[0] + 2 < out.shape[1]:
            stop = hits[0] + 2
            np.testing.assert_array_equal(row[:stop], f[:stop])
            assert (row[stop:] == eos).all()
        else:
            np.testing.assert_array_equal(row, f[: out.shape[1]])
    # generation ran until the last row finished, or to the end
    assert out.shape[1] == 8 or all((full[r, 2 : out.shape[1] + 1] == eos).any() for r in range(2))


# -- the KV cache -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_cache_gives_the_same_tokens(sampled, dtype):
    m = gpt()
    m.to(dtype)
    prompt = np.array([[1, 2, 3], [4, 5, 6]])
    kw = dict(temperature=0.8, top_k=5, rng=11) if sampled else {}
    for n, ctx in ((5, 8), (12, 8), (9, 5)):  # inside the context, and sliding past it
        a = book.generate(m, prompt, n, ctx, use_cache=True, **kw)
        b = book.generate(m, prompt, n, ctx, use_cache=False, **kw)
        np.testing.assert_array_equal(a, b)
    assert m.current_pos == 0  # reset afterwards


def test_cached_logits_equal_full_recomputation():
    m = gpt(n_layers=3)
    m.eval()
    ids = np.random.default_rng(0).integers(0, 13, (2, 8))
    full = m(ids)
    m.reset_kv_cache()
    parts = [m(ids[:, :3], use_cache=True), m(ids[:, 3:4], use_cache=True), m(ids[:, 4:8], use_cache=True)]
    np.testing.assert_allclose(np.concatenate(parts, axis=1), full, rtol=1e-12, atol=1e-12)
    assert m.current_pos == 8
    with pytest.raises(ValueError, match="after 8 cached tokens"):
        m(ids[:, :1], use_cache=True)
    m.reset_kv_cache()
    np.testing.assert_allclose(m(ids[:, :5], use_cache=True), full[:, :5], rtol=1e-12, atol=1e-12)
    with pytest.raises(RuntimeError):
        m.backward(np.zeros((2, 5, 13)))  # cached decoding keeps no backward state


# -- TinyTransformer uses the same code ------------------------------------------------------------------
def test_tiny_transformer_sampling_options():
    m = TinyTransformer(11, 12, 16, 2, 1, 32, rng=0)
    prompt = np.array([[1, 2, 3], [3, 2, 1]], dtype=np.int32)
    a = m.generate(prompt, 6, temperature=1.0, top_k=4, rng=5)
    assert a.dtype == np.int32 and a.shape == (2, 9)
    np.testing.assert_array_equal(a, generate(m, prompt, 6, 12, 1.0, 4, rng=5))
    np.testing.assert_array_equal(a, m.generate(prompt, 6, temperature=1.0, top_k=4, rng=5))
    np.testing.assert_array_equal(m.generate(prompt, 6), generate(m, prompt, 6, 12))
    one = m.generate(prompt[:1], 6, temperature=1.0, top_k=4, rng=5)
    eos = int(one[0, 4])
    stop = int(np.flatnonzero(one[0, 3:] == eos)[0]) + 3
    np.testing.assert_array_equal(m.generate(prompt[:1], 6, temperature=1.0, top_k=4, rng=5, eos_id=eos), one[:, :stop])
    with pytest.raises(ValueError, match="temperature"):
        m.generate(prompt, 2, temperature=-1.0)


# -- argument checks -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,err,match",
    [
        (dict(temperature=-0.1), ValueError, "temperature"),
        (dict(temperature=float("nan")), ValueError, "temperature"),
        (dict(temperature=True), TypeError, "temperature"),
        (dict(temperature="1"), TypeError, "temperature"),
        (dict(top_k=0), ValueError, "top_k"),
        (dict(top_k=2.0), TypeError, "top_k"),
        (dict(eos_id=1.0), TypeError, "eos_id"),
        (dict(rng="x"), TypeError, "rng"),
        (dict(use_cache=1), TypeError, "use_cache"),
        (dict(max_new_tokens=-1), ValueError, "max_new_tokens"),
        (dict(max_new_tokens=2.5), TypeError, "max_new_tokens"),
        (dict(context_size=0), ValueError, "context_size"),
        (dict(idx=np.array([[1.0, 2.0]])), TypeError, "idx"),
        (dict(idx=np.zeros((1, 0), int)), ValueError, "idx"),
        (dict(model=3), TypeError, "model"),
    ],
)
def test_bad_arguments(kwargs, err, match):
    m = gpt()
    args = dict(model=m, idx=np.array([[1, 2]]), max_new_tokens=3, context_size=8)
    args.update(kwargs)
    before = m.state_dict()
    with pytest.raises(err, match=match):
        book.generate(**args)
    assert m.training and m.current_pos == 0
    for k, v in m.state_dict().items():
        np.testing.assert_array_equal(v, before[k])


def test_bad_logits_for_the_sampling_helpers():
    with pytest.raises(ValueError, match="logits"):
        sample_next_token(np.zeros(3))
    with pytest.raises(ValueError, match="logits"):
        next_token_probs(np.zeros((2, 3), int))
    # no distribution to sample from: refused (as torch.multinomial), never the id vocab (3 here)
    for row in ([1.0, np.nan, 0.0], [np.inf, 0.0, 0.0], [-np.inf] * 3):
        with pytest.raises(ValueError, match="logits: expected finite values.*in row 1"):
            sample_next_token(np.array([[0.0, 1.0, 2.0], row]), 1.0, rng=0)
    with pytest.raises(ValueError, match="logits: expected finite values"):
        generate(lambda idx: np.full(idx.shape + (3,), np.nan), np.array([[1]]), 2, 4, temperature=1.0, rng=0)
    np.testing.assert_array_equal(sample_next_token(np.array([[0.0, -np.inf, 2.0]]), 1.0, top_k=1, rng=0), [2])


def test_book_multi_head_attention_cache_token_by_token():
    m = book.MultiHeadAttention(6, 6, 5, 0.0, 2, qkv_bias=True, rng=0)
    x = np.random.default_rng(1).standard_normal((2, 5, 6))
    full = m(x)
    steps = [m(x[:, t : t + 1], use_cache=True) for t in range(5)]
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, rtol=1e-12, atol=1e-14)
    assert m.kv_cache_length == 5
    with pytest.raises(ValueError, match="5 cached"):
        m(x[:, :1], use_cache=True)
    m.reset_kv_cache()
    np.testing.assert_allclose(m(x[:, :2], use_cache=True), full[:, :2], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(m(x[:, 2:], use_cache=True), full[:, 2:], rtol=1e-12, atol=1e-14)
    # a loaded all-zero mask buffer (no masking) is honoured by the cache as well
    m.reset_kv_cache()
    m.mask[...] = 0
    np.testing.assert_allclose(m(x[:, :3], use_cache=True), m(x[:, :3]), rtol=1e-12, atol=1e-14)


def test_any_callable_model():
    """A plain function is a model: a bigram table, ``logits[b, t] = table[idx[b, t]]``."""
    table = np.random.default_rng(0).standard_normal((6, 6))
    out = generate(lambda idx: table[idx], np.array([[2], [5]]), 4, 3, use_cache=True)
    expect = [[2], [5]]
    for row in expect:
        for _ in range(4):
            row.append(int(table[row[-1]].argmax()))
    np.testing.assert_array_equal(out, expect)

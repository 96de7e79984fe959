"""CausalLM.generate / CausalLM.stream with transformers' conventions: greedy tokens equal to
transformers' generate on the same model (every family; equal-length and left-padded batches; eos
and pad), sampling with transformers' warpers, arguments checked before the first token."""

from __future__ import annotations

import numpy as np
import pytest

from npattn import no_grad
from npattn.generation import generate_tokens, stream_tokens
from npattn.models import CausalLM
from npattn.models.tiny import TINY_CONFIGS, tiny_config

FAMILIES = sorted(TINY_CONFIGS)
IDS = np.array([[1, 5, 9, 2, 30, 7], [3, 3, 0, 36, 11, 4]])
MASK = np.array([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
# a random tied Gemma 2 or 3 (embeddings times sqrt(hidden)) mostly repeats one token: nothing to compare
UNTIED = {"gemma3_text": dict(tie_word_embeddings=False), "gemma2": dict(tie_word_embeddings=False)}


def _pair(name, **changes):
    """transformers' model of the family (float64, eager, weights N(w, 0.5²): peaked logits) and
    npattn's from its state dict."""
    torch = pytest.importorskip("torch")
    T = pytest.importorskip("transformers")
    from _hf64 import randomize

    config = T.AutoConfig.for_model(**tiny_config(name, **changes))
    config._experts_implementation = "eager"
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = T.AutoModelForCausalLM.from_config(config).double().eval()
    randomize(hf, 0, scale=0.5)
    return hf, CausalLM.from_hf(hf.state_dict(), hf.config.to_dict())


def _hf_generate(hf, ids, n, **kwargs):
    """transformers' greedy generate in float64; the attention mask given (ones by default),
    since without one it takes every pad id in the prompt for padding (OLMo 3's pad id 1 is one
    of these prompts' tokens), which npattn does not."""
    import torch
    from _hf64 import float64_reference

    kwargs.setdefault("attention_mask", np.ones_like(ids))
    kwargs = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
    with torch.no_grad(), float64_reference():
        return hf.generate(torch.from_numpy(ids), max_new_tokens=n, do_sample=False, **kwargs).numpy()


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_equals_transformers(name):
    """An equal-length batch, the config's eos (Llama's 2, DeepSeek-V3's and Gemma 3's 1) as the
    default; then a left-padded batch with its attention_mask, each row as its prompt alone."""
    hf, m = _pair(name, **UNTIED.get(name, {}))
    out = m.generate(IDS, 10)
    ref = _hf_generate(hf, IDS, 10)
    np.testing.assert_array_equal(out[:, : ref.shape[1]], ref)
    assert out.shape == (2, 16)  # the contract's width, whether or not every row finished
    assert len(set(out[:, 6:].ravel().tolist())) > 3  # a completion worth comparing
    padded = np.where(MASK == 1, IDS, 0)
    out = m.generate(padded, 10, attention_mask=MASK)
    ref = _hf_generate(hf, padded, 10, attention_mask=MASK, pad_token_id=0)
    np.testing.assert_array_equal(out[:, : ref.shape[1]], ref)
    alone = m.generate(IDS[:1, 2:], 10)[0, 4:]  # shorter when it reaches eos before the batch ends
    np.testing.assert_array_equal(out[0, 6 : 6 + len(alone)], alone)


@pytest.mark.parametrize("name", ["llama", "gemma3_text"])
def test_finished_rows_continue_with_pad_as_transformers(name):
    """A row that has produced an eos id continues with the pad token (Gemma 3's config has one,
    0; Llama's has none: its eos); decoding stops when every row has finished (transformers then
    returns fewer columns, npattn fills the contract's (B, L + max_new_tokens) with the pad token);
    an eos given as a list; eos_token_id overrides the config's."""
    hf, m = _pair(name)
    free = m.generate(IDS, 10, eos_token_id=[])  # no eos: all 10 steps
    assert free.shape == (2, 16)
    first = int(free[0, 7])  # row 0's second new token
    for eos in (first, [first, int(free[1, 9])], [int(free[0, 6]), int(free[1, 6])]):
        out = m.generate(IDS, 10, eos_token_id=eos)
        ref = _hf_generate(hf, IDS, 10, eos_token_id=eos)
        np.testing.assert_array_equal(out[:, : ref.shape[1]], ref)
        assert out.shape == (2, 16)
    assert ref.shape == (2, 7)  # both rows finished at once at the first step: transformers stops
    pad = m.config.pad_token_id if m.config.pad_token_id is not None else first
    eos0 = eos[0] if isinstance(eos, list) else eos
    assert set(out[:, 7:].ravel().tolist()) == {m.config.pad_token_id if m.config.pad_token_id is not None else eos0}
    out = m.generate(IDS, 10, eos_token_id=first)
    row = out[0, 6:].tolist()
    assert row[: row.index(first) + 1] == free[0, 6 : 6 + row.index(first) + 1].tolist()
    assert set(row[row.index(first) + 1 :]) <= {pad}


def test_eos_token_id_as_numpy_values():
    """An eos id may come as numpy (a 0-d array is the id, a 1-d array the list), also where
    generate fills the columns after every row has finished."""
    m = CausalLM(tiny_config("llama"), rng=0)
    first = int(m.generate(IDS[:1], 1, eos_token_id=[])[0, 6])
    want = m.generate(IDS[:1], 4, eos_token_id=first)
    assert want[0, 6:].tolist() == [first] * 4  # finished at the first step, then filled
    for eos in (np.int64(first), np.array(first), np.array([first]), (first,)):
        np.testing.assert_array_equal(m.generate(IDS[:1], 4, eos_token_id=eos), want)
        assert [s.tolist() for s in m.stream(IDS[:1], 4, eos_token_id=eos)] == [[first]]


def test_narrow_id_dtypes_are_widened_not_wrapped():
    """uint8 prompt ids of a 1000-token model: the new ids (some above 255) neither wrap nor are
    fed back wrapped; the result is uint16, the tokens those of int64 ids (also the book's loop)."""
    from npattn.generation import generate

    m = CausalLM(tiny_config("llama", vocab_size=1000), rng=0)
    want = m.generate(IDS, 8)
    assert want[:, 6:].max() > 255
    got = m.generate(IDS.astype(np.uint8), 8)
    assert got.dtype == np.uint16
    np.testing.assert_array_equal(got, want)
    assert {s.dtype for s in m.stream(IDS.astype(np.uint8), 3)} == {np.dtype(np.uint16)}
    np.testing.assert_array_equal(generate(m, IDS.astype(np.int8), 8, 64), want)


def test_stream_yields_generate_tokens_step_by_step():
    m = CausalLM(tiny_config("qwen3"), rng=0)
    out = m.generate(IDS, 7)
    steps = list(m.stream(IDS, 7))
    assert len(steps) == 7 and all(s.shape == (2,) and s.dtype == IDS.dtype for s in steps)
    np.testing.assert_array_equal(np.stack(steps, axis=1), out[:, 6:])
    one = list(m.stream(IDS[0], 3))  # a single prompt (L,): one token per step
    assert [s.shape for s in one] == [()] * 3
    np.testing.assert_array_equal(m.generate(IDS[0], 3), np.concatenate([IDS[0], one]))
    np.testing.assert_array_equal(m.generate(IDS[0], 3), m.generate(IDS[:1], 3)[0])


def test_stream_restores_mode_and_cache_when_closed():
    """Eval mode and the cache while a stream runs; its model's mode back and its cache empty when
    it is closed (a cached call then starts a new sequence)."""
    from npattn import no_grad

    m = CausalLM(tiny_config("gemma3_text"), rng=0)
    m.train()
    s = m.stream(IDS, 5)
    assert m.training  # nothing runs before the first token is asked for
    next(s)
    assert not m.training
    s.close()
    assert m.training
    with no_grad():
        np.testing.assert_array_equal(m(IDS, use_cache=True), m(IDS))
    m.reset_kv_cache()
    m.generate(IDS, 3)
    assert m.training


def test_streams_on_one_model_are_independent():
    """A model holds one cache: a stream resumed after another generate or stream on the same model
    re-encodes its tokens so far, so each gives the tokens it gives alone (transformers' calls each
    have their own cache); closing an abandoned stream leaves a later stream's cache alone."""
    m = CausalLM(tiny_config("qwen3_next"), rng=0)  # attention and recurrent layers' caches
    want = m.generate(IDS, 6, attention_mask=MASK, eos_token_id=[])[:, 6:]
    s = m.stream(IDS, 6, attention_mask=MASK, eos_token_id=[])
    got = [next(s)]
    other = m.generate(IDS[:1, :3], 4, eos_token_id=[])
    got.append(next(s))
    t = m.stream(IDS[1], 3, eos_token_id=[])
    alone = [next(t)]
    got += list(s)
    alone += list(t)
    np.testing.assert_array_equal(np.stack(got, axis=1), want)
    np.testing.assert_array_equal(alone, m.generate(IDS[1], 3, eos_token_id=[])[6:])
    np.testing.assert_array_equal(other, m.generate(IDS[:1, :3], 4, eos_token_id=[]))
    abandoned = m.stream(IDS, 6)
    next(abandoned)
    s = m.stream(IDS, 6, attention_mask=MASK, eos_token_id=[])
    got = [next(s)]
    abandoned.close()
    got += list(s)
    np.testing.assert_array_equal(np.stack(got, axis=1), want)


class _Fixed:
    """A model whose next-token logits are always ``logits``: the sampler's distribution alone."""

    def __init__(self, logits):
        self.logits = np.asarray(logits, np.float64)

    def __call__(self, ids, **kwargs):
        return np.broadcast_to(self.logits, ids.shape + self.logits.shape[-1:])


@pytest.mark.parametrize(
    "options",
    [
        dict(temperature=1.0),
        dict(temperature=0.7, top_k=3),
        dict(temperature=1.3, top_p=0.8),
        dict(temperature=0.9, top_k=4, top_p=0.7),
        dict(top_k=0, top_p=1.0),  # transformers' "off" values
        dict(temperature=0.8, min_p=0.2),
        dict(temperature=1.2, top_k=6, top_p=0.95, min_p=0.3),
        dict(min_p=0.0),
    ],
)
def test_sampling_draws_from_transformers_warpers(options):
    """do_sample draws from softmax of transformers' temperature, top-k, top-p and min-p warpers
    (in that order) applied to the logits: frequencies over 40000 rows within 5 standard errors."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = np.array([2.0, 1.5, 1.4, 0.3, -0.5, -1.0, -3.0])
    warpers = LogitsProcessorList()
    t, k, p = options.get("temperature", 1.0), options.get("top_k"), options.get("top_p")
    if t != 1.0:
        warpers.append(TemperatureLogitsWarper(t))
    if k:
        warpers.append(TopKLogitsWarper(k))
    if p is not None and p < 1.0:
        warpers.append(TopPLogitsWarper(p))
    if options.get("min_p") is not None:
        warpers.append(MinPLogitsWarper(options["min_p"]))
    scores = warpers(torch.zeros(1, 1, dtype=torch.long), torch.from_numpy(logits)[None])
    expect = torch.softmax(scores, -1)[0].numpy()
    n = 40000
    (tokens,) = stream_tokens(_Fixed(logits), np.zeros((n, 1), np.int64), 1, do_sample=True, rng=0, **options)
    freq = np.bincount(tokens, minlength=len(logits)) / n
    assert (freq[expect == 0] == 0).all()
    np.testing.assert_array_less(np.abs(freq - expect), 5 * np.sqrt(expect * (1 - expect) / n) + 1e-12)


@pytest.mark.parametrize("penalty", [1.8, 0.4])
def test_repetition_penalty_greedy_equals_transformers(penalty):
    """transformers' repetition penalty (above 1 against repeats, below 1 for them) in greedy
    decoding: an equal-length batch and a left-padded one, whose padding is no token of its row
    (transformers leaves it out through the attention mask); the tokens differ from those without
    the penalty, so the comparison can fail."""
    hf, m = _pair("llama")
    out = m.generate(IDS, 10, repetition_penalty=penalty)
    ref = _hf_generate(hf, IDS, 10, repetition_penalty=penalty)
    np.testing.assert_array_equal(out[:, : ref.shape[1]], ref)
    assert not np.array_equal(out, m.generate(IDS, 10))
    padded = np.where(MASK == 1, IDS, 0)
    out = m.generate(padded, 10, attention_mask=MASK, repetition_penalty=penalty)
    eos = hf.config.eos_token_id  # a finished row continues with it (npattn's pad without a pad id)
    ref = _hf_generate(hf, padded, 10, attention_mask=MASK, pad_token_id=eos, repetition_penalty=penalty)
    np.testing.assert_array_equal(out[:, : ref.shape[1]], ref)


def _penalized_greedy(m, ids, mask, n, penalty):
    """Greedy decoding by hand: the whole sequence through the model at every step, each row's
    last logits with its tokens' (not its padding's) penalised."""
    out, mask = ids.copy(), mask.astype(bool)
    for _ in range(n):
        with no_grad():
            z = m(out, attention_mask=mask.astype(np.int64))[:, -1].copy()
        for b in range(len(out)):
            for t in set(out[b][mask[b]].tolist()):
                z[b, t] = z[b, t] * penalty if z[b, t] < 0 else z[b, t] / penalty
        out = np.concatenate([out, z.argmax(-1)[:, None]], axis=1)
        mask = np.concatenate([mask, np.ones((len(out), 1), bool)], axis=1)
    return out


@pytest.mark.parametrize("penalty", [2.5, 0.3])
def test_repetition_penalty_is_each_rows_tokens_penalised(penalty):
    """Without transformers: the cached loop with a penalty equals greedy decoding by hand from the
    whole sequence, where each row's tokens so far (prompt and new, not padding) have their logits
    divided by the penalty (multiplied where negative); a left-padded batch's rows differ in their
    padding only."""
    m = CausalLM(tiny_config("llama"), rng=0, dtype=np.float64)
    padded = np.where(MASK == 1, IDS, 7)  # the padding holds a token of neither row
    out = m.generate(padded, 8, attention_mask=MASK, repetition_penalty=penalty, eos_token_id=[])
    np.testing.assert_array_equal(out, _penalized_greedy(m, padded, MASK, 8, penalty))
    assert not np.array_equal(out, m.generate(padded, 8, attention_mask=MASK, eos_token_id=[]))
    assert m.generate(padded, 8, attention_mask=MASK, repetition_penalty=1.0, eos_token_id=[]).tolist() == (
        m.generate(padded, 8, attention_mask=MASK, eos_token_id=[]).tolist()
    )


def test_sampling_is_seeded():
    m = CausalLM(tiny_config("llama"), rng=0)
    a = m.generate(IDS, 6, do_sample=True, temperature=1.5, rng=3)
    np.testing.assert_array_equal(a, m.generate(IDS, 6, do_sample=True, temperature=1.5, rng=3))
    assert not np.array_equal(a, m.generate(IDS, 6, do_sample=True, temperature=1.5, rng=4))
    # top_k=1 leaves one choice: the greedy tokens; greedy ignores temperature (as transformers)
    np.testing.assert_array_equal(m.generate(IDS, 6, do_sample=True, top_k=1, rng=5), m.generate(IDS, 6))
    np.testing.assert_array_equal(m.generate(IDS, 6, temperature=0.1), m.generate(IDS, 6))


def test_generic_model_and_book_generate_share_the_loop():
    """generate_tokens works on any npattn model (TinyTransformer: no cache of CausalLM's kind),
    with the book's generate's greedy tokens when no eos is involved."""
    import npattn
    from npattn.generation import generate

    tiny = npattn.TinyTransformer(12, 32, 16, 2, 1, 32, rng=0)
    ids = np.array([[1, 2, 3], [4, 5, 6]])
    np.testing.assert_array_equal(generate_tokens(tiny, ids, 5), generate(tiny, ids, 5, 32))


@pytest.mark.parametrize(
    "kwargs,error,word",
    [
        (dict(max_new_tokens=-1), ValueError, "max_new_tokens"),
        (dict(max_new_tokens=1.5), TypeError, "max_new_tokens"),
        (dict(do_sample=1), TypeError, "do_sample"),
        (dict(do_sample=True, temperature=0.0), ValueError, "temperature"),
        (dict(temperature=-1.0), ValueError, "temperature"),
        (dict(top_k=-2), ValueError, "top_k"),
        (dict(top_p=1.5), ValueError, "top_p"),
        (dict(min_p=1.5), ValueError, "min_p"),
        (dict(min_p=-0.1), ValueError, "min_p"),
        (dict(min_p="0.1"), TypeError, "min_p"),
        (dict(repetition_penalty=0.0), ValueError, "repetition_penalty"),
        (dict(repetition_penalty=float("inf")), ValueError, "repetition_penalty"),
        (dict(repetition_penalty=True), TypeError, "repetition_penalty"),
        (dict(eos_token_id="2"), TypeError, "eos_token_id"),
        (dict(eos_token_id=[1, -1]), ValueError, "eos_token_id"),
        (dict(eos_token_id=True), TypeError, "eos_token_id"),
        (dict(attention_mask=np.ones((2, 5), int)), ValueError, "attention_mask"),
        (dict(attention_mask=np.ones((2, 6))), TypeError, "attention_mask"),
        (dict(attention_mask=np.full((2, 6), 2)), ValueError, "attention_mask"),
        (dict(attention_mask=np.array([[0] * 6, [1] * 6])), ValueError, "attention_mask"),
        # right padding, a gap: the new tokens would follow padding (a token 0 from zero logits, then a refusal)
        (dict(attention_mask=np.array([[1] * 6, [1] * 4 + [0] * 2])), ValueError, "left padding.*row 1, column 4"),
        (dict(attention_mask=np.array([[0, 1, 0, 1, 1, 1], [1] * 6])), ValueError, "left padding.*row 0, column 2"),
        (dict(ids=np.array([[1, 2, 99]])), ValueError, "vocab_size"),
        (dict(ids=np.array([[1.0, 2.0]])), TypeError, "ids"),
    ],
)
def test_arguments_are_checked_before_the_first_token(kwargs, error, word):
    m = CausalLM(tiny_config("llama"), rng=0)
    args = dict(ids=IDS, max_new_tokens=3) | kwargs
    for method in (m.generate, m.stream):  # stream: when called, not at the first next()
        with pytest.raises(error, match=word):
            method(args["ids"], args["max_new_tokens"], **_opts(args))


def _opts(args):
    return {k: v for k, v in args.items() if k not in ("ids", "max_new_tokens")}


def test_padding_needs_a_model_that_takes_a_mask():
    """A 0 in attention_mask for a model whose forward takes none: NotImplementedError naming the
    missing piece; a mask of ones is an unpadded batch."""
    import npattn

    tiny = npattn.TinyTransformer(12, 32, 16, 2, 1, 32, rng=0)
    ids = np.array([[1, 2, 3], [4, 5, 6]])
    with pytest.raises(NotImplementedError, match="attention_mask.*TinyTransformer.forward"):
        stream_tokens(tiny, ids, 2, attention_mask=np.array([[0, 1, 1], [1, 1, 1]]))
    np.testing.assert_array_equal(
        generate_tokens(tiny, ids, 2, attention_mask=np.ones((2, 3), bool)), generate_tokens(tiny, ids, 2)
    )


def test_max_new_tokens_zero_returns_the_prompt():
    m = CausalLM(tiny_config("llama"), rng=0)
    np.testing.assert_array_equal(m.generate(IDS, 0), IDS)
    assert list(m.stream(IDS, 0)) == []


@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
def test_logits_to_keep_is_the_last_positions_of_the_cached_pass(name):
    m = CausalLM(tiny_config(name), rng=0)
    want = m(IDS, use_cache=True, attention_mask=MASK)
    m.reset_kv_cache()
    got = m(IDS, use_cache=True, attention_mask=MASK, logits_to_keep=2)
    np.testing.assert_array_equal(got, want[:, -2:])
    step = m(IDS[:, :1], use_cache=True, logits_to_keep=1)  # a decoding step after it: the same cache
    m.reset_kv_cache()
    m(IDS, use_cache=True, attention_mask=MASK)
    np.testing.assert_array_equal(step, m(IDS[:, :1], use_cache=True))
    m.reset_kv_cache()
    last = m(IDS[0], use_cache=True, logits_to_keep=1)  # one sequence (L,): (1, vocab)
    np.testing.assert_allclose(last, m(IDS[0])[-1:], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1"])
def test_logits_to_keep_refused_by_name(bad):
    m = CausalLM(tiny_config("llama"), rng=0)
    with pytest.raises(ValueError, match="logits_to_keep: expected an int >= 0"):
        m(IDS, use_cache=True, logits_to_keep=bad)
    with pytest.raises(ValueError, match="logits_to_keep: 1 needs use_cache=True"):
        m(IDS, logits_to_keep=1)
    assert m._seen == 0  # refused before anything was cached

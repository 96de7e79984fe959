"""``PromptCache`` (``model.prompt_cache()``, ``generate``/``stream`` with ``prompt_cache=``): the
caches kept between calls, cut back to the prefix a new prompt shares with the tokens held, give
the tokens and logits of a fresh call, every family (float64), over a sequence of calls (a prompt;
its extension leaving the reply, as a chat template re-renders it; an extension of everything held;
a divergence inside the old prompt; a prompt shorter than the cache); the positions actually run
show what was reused: any prefix for layers keeping every key, the last prompt's end or everything
held for recurrent states and sliding windows.  Also the ``KVCache.crop`` family of methods, a
stream closed early or interrupted, another call in between, and the refusals by name."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from npattn.generation import PromptCache, generate_tokens, stream_tokens
from npattn.models import CausalLM
from npattn.models.tiny import TINY_CONFIGS, tiny_config
from npattn.nn.delta_net import RecurrentLayer
from npattn.nn.kv_cache import KVCache, RollingKVCache

FAMILIES = sorted(TINY_CONFIGS)
NEW = 4  # tokens generated per call (the cache then holds the prompt and NEW - 1 of them)


class Recorder:
    """``model.forward`` wrapped (its signature kept, so ``logits_to_keep`` is still passed): the
    positions each call runs and the last position's logits."""

    def __init__(self, model):
        self.calls: list = []
        real = model.forward

        @functools.wraps(real)
        def forward(ids, **kw):
            out = real(ids, **kw)
            self.calls.append((np.asarray(ids).shape[-1], np.array(np.asarray(out)[..., -1, :])))
            return out

        object.__setattr__(model, "forward", forward)

    def take(self) -> list:
        calls, self.calls = self.calls, []
        return calls


def _kind(model) -> str:
    """The model's kind of caches: "recurrent" (a state that cannot be cut back), "rolling" (a
    sliding window: keys dropped), or "full" (every key kept: any prefix is reused)."""
    if any(isinstance(m, RecurrentLayer) for m in model.modules()):
        return "recurrent"
    windows = [getattr(m, "_rolling_keep", lambda: None)() for m in model.modules()]
    windows += [getattr(m, "window", None) for m in model.modules() if type(m).__name__ == "SharedKVAttention"]
    return "rolling" if any(w is not None for w in windows) else "full"


def _common(a, b) -> int:
    n = min(len(a), len(b))
    same = np.asarray(a[:n]) == np.asarray(b[:n])
    return n if same.all() else int(same.argmin())


def _check_call(model, rec, cache, prompt, **kw):
    """One call with the cache against a fresh one: the same tokens, each step's logits to 1e-12
    relative; returns ``(tokens, positions run by the prompt's pass, by the whole call minus by
    the fresh one)`` (one token per step, or all of them again at LongRoPE's switch).  A model
    with a cache that cannot be cut back anywhere runs its prompt's last token apart (two
    forwards, one where the rest of the prompt is that token alone)."""
    out = model.generate(prompt, NEW, prompt_cache=cache, eos_token_id=[], **kw)
    cached = rec.take()
    fresh = model.generate(prompt, NEW, eos_token_id=[], **kw)
    alone = rec.take()
    np.testing.assert_array_equal(out, fresh)
    apart = len(cached) - NEW  # the forward of the prompt's tokens before the last
    assert len(alone) == NEW and apart in ((0, 1) if _kind(model) != "full" else (0,))
    assert apart == 0 or cached[1][0] == 1  # then the last token alone
    for (_, a), (_, b) in zip(cached[apart:], alone):
        assert np.abs(a - b).max() <= 1e-12 * np.abs(b).max()
    assert alone[0][0] == len(prompt)  # a fresh call runs its whole prompt first
    ran = sum(n for n, _ in cached[: 1 + apart])
    return out, ran, sum(n for n, _ in cached) - sum(n for n, _ in alone)


@pytest.mark.parametrize("name", FAMILIES)
def test_calls_with_the_cache_equal_fresh_calls_and_reuse_what_they_can(name):
    model = CausalLM(tiny_config(name), rng=0)
    assert model.dtype == np.float64
    rec, kind = Recorder(model), _kind(model)
    cache = model.prompt_cache()
    rng = np.random.default_rng(1)
    p1 = rng.integers(3, 41, 7)

    def step(prompt, expected_reuse):
        held = cache.tokens
        out, ran, fewer = _check_call(model, rec, cache, prompt)
        assert cache.reused == expected_reuse, (kind, len(held), _common(prompt, held))
        assert ran == len(prompt) - expected_reuse and fewer == -expected_reuse
        np.testing.assert_array_equal(cache.tokens, out[:-1])  # the prompt and every new token but the last
        return out, held

    out1, _ = step(p1, 0)
    # the reply re-rendered differently after its first token (a chat template dropping a thinking
    # part), then a new message: a layer keeping its keys (or a window pinned at the prompt's end)
    # is cut back inside the reply; a recurrent state resumes from the end of the last prompt
    p2 = np.concatenate([p1, out1[7:8], [40 - out1[8] % 3, 21, 22]])
    t2 = _common(p2, cache.tokens)
    out2, _ = step(p2, 7 if kind == "recurrent" else t2)
    p3 = np.concatenate([out2, [9, 10, 11]])  # everything held, then more: every layer goes on
    step(p3, len(cache.tokens))
    # the same prompt again (a reply regenerated): every kind resumes before its last token, a
    # recurrent state or a rolling window from the point marked there
    step(p3, len(p3) - 1)
    p4 = np.concatenate([p3[:4], [40 - p3[4] % 3, 13, 14, 15, 16]])  # leaves the old prompt at 4
    step(p4, 0 if kind != "full" else 4)
    p5 = p4[:4]  # shorter than the cache, shorter than LongRoPE's switch (Phi-3's tiny: 5)
    out5, _ = step(p5, 0 if kind != "full" or model.reencode_length else 3)
    step(np.concatenate([out5, [3, 4]]), len(cache.tokens))


@pytest.mark.parametrize("name", ["llama", "qwen3_next", "gemma3_text", "lfm2"])
def test_sampling_with_a_seed_gives_the_same_tokens(name):
    model = CausalLM(tiny_config(name), rng=0)
    cache = model.prompt_cache()
    opts = dict(do_sample=True, temperature=1.3, top_k=20, eos_token_id=[])
    prompt = np.array([5, 6, 7, 8, 9])
    for turn in range(3):
        out = model.generate(prompt, 5, prompt_cache=cache, rng=turn, **opts)
        np.testing.assert_array_equal(out, model.generate(prompt, 5, rng=turn, **opts))
        assert cache.reused == (0 if turn == 0 else len(prompt) - 4)  # all held: out but its last
        prompt = np.concatenate([out, [11, 12, 13]])


def test_a_closed_stream_holds_the_tokens_it_fed_and_equal_logits_follow():
    model = CausalLM(tiny_config("qwen3_next"), rng=0)
    cache = model.prompt_cache()
    prompt = np.array([[4, 8, 15, 16, 23]])  # (1, L): one sequence as a batch of one
    steps = model.stream(prompt, 6, prompt_cache=cache, eos_token_id=[])
    first = [int(next(steps)[0]) for _ in range(3)]
    steps.close()
    assert cache.tokens.tolist() == prompt[0].tolist() + first[:2]
    more = np.concatenate([prompt[0], first, [3]])
    out = model.generate(more, 4, prompt_cache=cache, eos_token_id=[])
    assert cache.reused == 7
    np.testing.assert_array_equal(out, model.generate(more, 4, eos_token_id=[]))


def test_another_call_in_between_takes_the_model_and_the_cache_stays_right():
    model = CausalLM(tiny_config("qwen3"), rng=0)
    cache = model.prompt_cache()
    prompt = np.array([4, 8, 15, 16, 23])
    steps = stream_tokens(model, prompt, 5, prompt_cache=cache)
    got = [int(next(steps))]
    other = generate_tokens(model, np.array([1, 2, 3]), 3)  # takes the model's cache
    got += [int(t) for t in steps]  # this stream runs its tokens again, then goes on
    np.testing.assert_array_equal(other, generate_tokens(model, np.array([1, 2, 3]), 3))
    assert got == generate_tokens(model, prompt, 5)[5:].tolist()
    assert cache.tokens.tolist() == prompt.tolist() + got[:-1]
    again = np.concatenate([prompt, got, [7]])
    np.testing.assert_array_equal(
        generate_tokens(model, again, 3, prompt_cache=cache), generate_tokens(model, again, 3)
    )
    assert cache.reused == len(prompt) + 4  # everything held


@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
@pytest.mark.parametrize("change", ["assign", "load_state_dict", "bump_version", "to"])
def test_a_change_of_the_weights_runs_the_whole_prompt_again(name, change):
    """The caches hold what the old weights computed: after a change npattn sees (a parameter's
    version), nothing is reused and the call equals a fresh one; with no change, everything is."""
    model = CausalLM(tiny_config(name), rng=0)
    cache = model.prompt_cache()
    prompt = np.array([4, 8, 15, 16, 23])
    out = model.generate(prompt, 3, prompt_cache=cache, eos_token_id=[])
    more = np.concatenate([out, [7]])
    model.generate(more, 2, prompt_cache=cache, eos_token_id=[])
    assert cache.reused == len(out) - 1  # unchanged weights: everything held is reused
    w = dict(model.named_parameters())["model.norm.weight"]
    if change == "assign":
        w.data = w.data * 1.5 + 0.5
    elif change == "load_state_dict":
        sd = model.state_dict()
        sd["model.norm.weight"] = sd["model.norm.weight"] * 0.5 + 0.5
        model.load_state_dict(sd)
    elif change == "bump_version":
        w.data[...] += 0.5  # in place: npattn cannot see it until told
        w.bump_version()
    else:
        model.to(np.float32)
        model.to(np.float64)
    again = np.concatenate([more, [9]])
    got = model.generate(again, 3, prompt_cache=cache, eos_token_id=[])
    assert cache.reused == 0
    np.testing.assert_array_equal(got, model.generate(again, 3, eos_token_id=[]))


def test_a_forward_that_fails_leaves_the_cache_empty(monkeypatch):
    model = CausalLM(tiny_config("llama"), rng=0)
    cache = model.prompt_cache()
    model.generate(np.array([4, 8, 15]), 3, prompt_cache=cache)
    assert len(cache) == 5
    layer = model.layers[1]
    real = type(layer).forward
    calls = []

    def failing(self, *args, **kw):
        calls.append(1)
        if len(calls) == 2:  # the second step, after the first layer appended its keys
            raise KeyboardInterrupt
        return real(self, *args, **kw)

    monkeypatch.setattr(type(layer), "forward", failing)
    with pytest.raises(KeyboardInterrupt):
        model.generate(np.array([4, 8, 15, 16, 23]), 4, prompt_cache=cache)
    monkeypatch.undo()
    assert len(cache) == 0 and cache.reused == 3
    prompt = np.array([4, 8, 15, 16, 23])
    np.testing.assert_array_equal(model.generate(prompt, 4, prompt_cache=cache), model.generate(prompt, 4))
    assert cache.reused == 0


def test_without_a_cache_nothing_changes_and_reset_empties_it():
    model = CausalLM(tiny_config("llama"), rng=0)
    cache = model.prompt_cache()
    prompt = np.array([4, 8, 15, 16])
    model.generate(prompt, 3, prompt_cache=cache)
    model.generate(np.array([9, 9]), 3)  # a call without it leaves it alone
    assert len(cache) == 6 and "tokens=6" in repr(cache) and cache.model is model
    model.generate(prompt, 3, prompt_cache=cache)
    assert cache.reused == 3
    cache.reset()
    assert len(cache) == 0
    model.generate(prompt, 3, prompt_cache=cache)
    assert cache.reused == 0
    assert model.generate(prompt, 0, prompt_cache=cache).tolist() == prompt.tolist()  # nothing run
    assert len(cache) == 6


def test_a_changed_dtype_reuses_nothing():
    model = CausalLM(tiny_config("llama"), rng=0)
    cache = model.prompt_cache()
    prompt = np.array([4, 8, 15, 16])
    model.generate(prompt, 3, prompt_cache=cache)
    model.to(np.float32)
    np.testing.assert_array_equal(model.generate(prompt, 3, prompt_cache=cache), model.generate(prompt, 3))
    assert cache.reused == 0


def test_refusals_name_the_argument():
    model = CausalLM(tiny_config("llama"), rng=0)
    other = CausalLM(tiny_config("llama"), rng=0)
    cache = model.prompt_cache()
    with pytest.raises(ValueError, match=r"^ids: expected one sequence.*got shape \(2, 3\)"):
        model.generate(np.array([[1, 2, 3], [4, 5, 6]]), 2, prompt_cache=cache)
    with pytest.raises(ValueError, match="^attention_mask: expected no padding"):
        model.generate(np.array([[1, 2, 3]]), 2, attention_mask=np.array([[0, 1, 1]]), prompt_cache=cache)
    out = model.generate(np.array([[1, 2, 3]]), 2, attention_mask=np.ones((1, 3), int), prompt_cache=cache)
    assert out.shape == (1, 5) and len(cache) == 4  # a mask of ones is no padding
    with pytest.raises(ValueError, match="^prompt_cache: made for another model"):
        other.generate(np.array([1, 2, 3]), 2, prompt_cache=cache)
    with pytest.raises(ValueError, match="^prompt_cache: made for another model"):
        stream_tokens(other, np.array([1, 2, 3]), 2, prompt_cache=cache)
    with pytest.raises(TypeError, match="^prompt_cache: expected a PromptCache"):
        model.generate(np.array([1, 2, 3]), 2, prompt_cache=object())
    with pytest.raises(TypeError, match="^model: expected a model with decoding caches"):
        PromptCache(object())
    from npattn import book

    gpt = book.GPTModel(
        dict(vocab_size=20, context_length=8, emb_dim=8, n_heads=2, n_layers=1, drop_rate=0.0, qkv_bias=False), rng=0
    )
    with pytest.raises(TypeError, match="^model: expected a model with decoding caches.*got GPTModel"):
        PromptCache(gpt)  # its attention layers have caches, but its own count of positions is not one's
    steps = model.stream(np.array([1, 2, 3]), 4, prompt_cache=cache)
    next(steps)
    with pytest.raises(ValueError, match="^prompt_cache: in use by a stream"):
        model.generate(np.array([1, 2, 3]), 2, prompt_cache=cache)
    with pytest.raises(ValueError, match="^prompt_cache: in use by a stream"):
        cache.reset()
    steps.close()
    assert len(cache) == 3  # the prompt and the first token: the cache is free again
    model.generate(np.array([1, 2, 3]), 2, prompt_cache=cache)


def test_two_streams_made_before_either_starts_the_second_is_refused_when_it_starts():
    model = CausalLM(tiny_config("llama"), rng=0)
    cache = model.prompt_cache()
    a = model.stream(np.array([1, 2, 3]), 3, prompt_cache=cache)
    b = model.stream(np.array([1, 2, 3]), 3, prompt_cache=cache)
    first = next(a)
    with pytest.raises(ValueError, match="^prompt_cache: in use by a stream"):
        next(b)
    rest = [int(t) for t in a]
    assert [int(first)] + rest == model.generate(np.array([1, 2, 3]), 3)[3:].tolist()
    assert len(cache) == 5


# -- the caches' own methods --------------------------------------------------------------------
def test_kv_cache_crop_then_append_equals_a_cache_of_the_prefix():
    rng = np.random.default_rng(0)
    k, v = rng.standard_normal((2, 1, 9, 3))
    cache, ref = KVCache(), KVCache()
    cache.append(k[:, :7], v[:, :7])
    assert cache.can_crop(7) and cache.can_crop(0) and not cache.can_crop(8) and not cache.can_crop(-1)
    cache.crop(4)
    keys, values = cache.append(k[:, 7:], v[:, 7:])
    ref.append(k[:, :4], v[:, :4])
    want = ref.append(k[:, 7:], v[:, 7:])
    np.testing.assert_array_equal(keys, want[0])
    np.testing.assert_array_equal(values, want[1])
    assert (cache.length, cache.position) == (6, 6)
    with pytest.raises(ValueError, match="^n: expected a position"):
        cache.crop(7)


def test_rolling_cache_crops_where_it_still_holds_the_window_and_a_pin_keeps_it():
    rng = np.random.default_rng(0)
    k = rng.standard_normal((1, 12, 2))
    cache = RollingKVCache(keep=3)
    cache.append(k[:, :5], k[:, :5])
    assert cache.can_crop(2)  # nothing dropped yet: any position
    cache.trim()  # holds positions 2, 3, 4
    assert cache.can_crop(5) and not cache.can_crop(4)
    with pytest.raises(ValueError, match="^n: expected a position"):
        cache.crop(4)
    cache.pin(5)
    cache.append(k[:, 5:9], k[:, 5:9])
    cache.trim()  # pinned at 5: from 2 on (what a query at 5 sees)
    assert (cache.length, cache.position) == (7, 9) and cache.can_crop(5) and cache.can_crop(7)
    cache.crop(6)
    assert cache.pinned is None and (cache.length, cache.position) == (4, 6)
    np.testing.assert_array_equal(cache.keys, k[:, 2:6])
    cache.append(k[:, 6:12], k[:, 6:12])
    cache.trim()  # no pin any more: the last 3
    np.testing.assert_array_equal(cache.keys, k[:, 9:12])
    cache.pin(12)
    cache.reset()
    assert cache.pinned is None


def test_the_model_counts_the_reused_tokens_as_fed():
    """Inside a call that reused 4 tokens the model has fed 5: a direct cached forward takes a mask
    over those 5 and its new token (transformers' convention), and its logits are a fresh pass's."""
    model = CausalLM(tiny_config("llama"), rng=0)
    cache = model.prompt_cache()
    model.generate(np.array([4, 8, 15, 16, 23, 40]), 4, prompt_cache=cache)
    prompt = np.array([4, 8, 15, 16, 9])
    steps = model.stream(prompt, 3, prompt_cache=cache)
    next(steps)
    assert cache.reused == 4
    logits = model(np.array([[7]]), use_cache=True, attention_mask=np.ones((1, 6), int))
    steps.close()
    cache.reset()  # (the direct forward is not one the stream knows of)
    want = model(np.concatenate([prompt, [7]])[None])[:, -1:]
    np.testing.assert_allclose(logits, want, rtol=1e-12, atol=1e-12 * np.abs(want).max())


def test_a_failure_while_resuming_frees_and_empties_the_cache(monkeypatch):
    model = CausalLM(tiny_config("llama"), rng=0)
    cache = model.prompt_cache()
    model.generate(np.array([4, 8, 15, 16]), 3, prompt_cache=cache)
    attention = model.layers[0].attention

    def broken(n, mark):
        raise RuntimeError("cannot rewind")

    monkeypatch.setattr(attention, "_rewind_cache", broken)
    with pytest.raises(RuntimeError, match="cannot rewind"):
        model.generate(np.array([4, 8, 15, 9]), 3, prompt_cache=cache)
    monkeypatch.undo()
    assert len(cache) == 0
    cache.reset()  # not in use
    prompt = np.array([4, 8, 15, 9])
    np.testing.assert_array_equal(model.generate(prompt, 3, prompt_cache=cache), model.generate(prompt, 3))


@pytest.mark.parametrize("name", ["mistral", "gemma3_text"])
def test_a_window_that_dropped_nothing_is_cut_back_anywhere(name):
    """A sliding window longer than every sequence here: its rolling cache has dropped no key, so
    a prompt leaving the old one inside is cut back as with full attention."""
    model = CausalLM(tiny_config(name, sliding_window=64), rng=0)
    rec = Recorder(model)
    cache = model.prompt_cache()
    p1 = np.array([4, 8, 15, 16, 23, 30, 3])
    _check_call(model, rec, cache, p1)
    p2 = np.array([4, 8, 15, 16, 9, 10])
    _, ran, _ = _check_call(model, rec, cache, p2)
    assert cache.reused == 4 and ran == 2

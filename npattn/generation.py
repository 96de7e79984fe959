"""Autoregressive text generation for any npattn language model: greedy, temperature, top-k, top-p, min-p, EOS.

One implementation, used by ``npattn.book.generate`` / ``generate_text_simple`` (the book's
chapter 4 and 5 functions), by ``TinyTransformer.generate``, and with Hugging Face transformers'
conventions (``do_sample``, ``eos_token_id``, a finished row continuing with the pad token) by
``generate_tokens`` / ``stream_tokens``, which ``CausalLM.generate`` and ``CausalLM.stream`` are.

A *model* here is anything callable as ``model(idx) -> logits``: integer token ids ``(B, L)``
in, ``(B, L, vocab)`` logits out, where ``logits[:, t]`` predicts token ``t + 1``.  A model
that also has ``reset_kv_cache()`` and accepts ``model(idx, use_cache=True)`` (``GPTModel``)
decodes incrementally with a KV cache: the prompt is encoded once, then each step feeds only the
newest token.  The tokens are the same with and without the cache.

Sampling one step (the book's chapter 5, ``next_token_probs`` and ``sample_next_token``)::

    logits = logits[:, -1, :]                        # the last position's prediction
    top_k:        logits[logits < k-th largest] = -inf   (ties with the k-th value are kept)
    temperature:  0 -> argmax (greedy);  T > 0 -> sample from softmax(logits / T)
    top_p:        keep the most probable tokens until their probabilities sum to top_p (nucleus
                  sampling: a token stays when the tokens more probable than it sum to less than
                  top_p, so the most probable one always stays), then renormalise
    min_p:        keep the tokens at least min_p times as probable as the most probable one,
                  then renormalise

``stream_tokens`` (transformers' ``generate``) also takes ``repetition_penalty``: before any of
these steps, greedy or not, the logit ``z`` of every token already in the row (its prompt's tokens
and those generated) becomes ``z / penalty`` where ``z > 0`` and ``z * penalty`` where not.
"""

from __future__ import annotations

import inspect
import math
import numbers
import weakref

import numpy as np

from ._validate import as_index, as_rng, check_bool, check_size, to_numpy
from .nn.module import no_grad

__all__ = [
    "PromptCache",
    "check_sampling",
    "generate",
    "generate_tokens",
    "next_token_probs",
    "sample_next_token",
    "stream_tokens",
]


class PromptCache:
    """A model's decoding caches kept between ``generate`` / ``stream`` calls (prompt caching).

    ``model.prompt_cache()`` makes one (``CausalLM.prompt_cache``); pass it as
    ``model.generate(ids, n, prompt_cache=cache)`` or ``model.stream(...)`` (or
    ``stream_tokens(model, ids, n, prompt_cache=cache)``), one sequence at a time.  A call keeps
    the longest common prefix of its ``ids`` and the tokens the cache holds (``tokens``), cuts every
    layer's cache back to it, runs only the rest of the prompt (at least its last token, whose
    logits choose the first new token), then decodes as usual; when it ends (or its stream is
    closed) the cache holds what the model ran: the prompt and every new token but the last (which
    was never fed), as transformers' ``past_key_values`` after ``generate``.  The tokens and logits
    are those of a call without it (transformers' "prompt reuse", llama.cpp's common prefix).

    What is reused when: layers that keep every key (full attention, MLA's latents) are cut back
    to any length.  Two kinds of caches cannot be: a recurrent state (gated DeltaNet, Kimi Delta
    Attention, Mamba-2, LFM2's short convolutions) sums every token seen, and a sliding window's rolling
    cache has dropped the keys older than its window (until it drops any, it is cut back as a full
    one).  With them, a call runs its prompt's last token apart, and the cache also keeps what the
    end of the last prompt and the point before its last token need (the recurrent states as they
    were there; the rolling caches keep the window before it), so a new prompt that extends
    everything held runs on from there; else one that extends the last prompt (a chat's next turn,
    however its template renders the reply) resumes at that prompt's end (a rolling cache at the
    common prefix); else one that shares all but the last token of it (the same prompt again, a
    reply regenerated, since a prompt's last token always runs) resumes before that token; else
    (a prompt that leaves the last one earlier) the whole prompt runs again.  With LongRoPE
    (``CausalLM.reencode_length``) keys are reused only when they were
    rotated with the frequencies a fresh run of the prompt uses.
    ``reused`` says how many prompt tokens the last call did not run.

    Batch size 1 only: ``ids`` of shape ``(L,)`` or ``(1, L)``, no padding (an ``attention_mask``
    of ones is accepted); one cache per model (another model refused), used by one call at a time.
    It holds what the model computed with its weights as they were.  Another
    generate or stream on the same model while a call holding it is between two steps takes the
    model's cache: that call then re-encodes its tokens and the cache keeps the result; a call
    that fails or is interrupted inside the model leaves the cache empty.  A change of the weights
    that npattn sees (a parameter's version: an optimizer step, ``load_state_dict``,
    ``Module.to``, an assignment to ``.data``) makes the next call run its whole prompt; after
    writing into a parameter's array in place, call ``p.bump_version()`` or ``reset()``.

    Parameters
    ----------
    model : CausalLM
        A model whose decoding caches it holds.

    Raises
    ------
    TypeError
        A model without decoding caches.

    Examples
    --------
    >>> import numpy as np
    >>> from npattn.models import CausalLM
    >>> from npattn.models.tiny import tiny_config
    >>> model = CausalLM(tiny_config("qwen3_next"), rng=0)       # gated DeltaNet and attention
    >>> cache = model.prompt_cache()
    >>> prompt = np.array([1, 2, 3, 4])
    >>> reply = model.generate(prompt, 3, prompt_cache=cache)[4:]
    >>> cache.tokens.tolist() == prompt.tolist() + reply[:2].tolist(), cache.reused
    (True, 0)
    >>> turn = np.concatenate([prompt, [7, 8, 9]])                # leaves the reply: from the prompt's end
    >>> out = model.generate(turn, 3, prompt_cache=cache)
    >>> cache.reused, bool(np.array_equal(out, model.generate(turn, 3)))
    (4, True)
    >>> again = model.generate(turn, 3, prompt_cache=cache)         # the same prompt: before its last token
    >>> cache.reused, bool(np.array_equal(again, out))
    (6, True)
    >>> _ = model.generate(np.array([1, 2, 5]), 3, prompt_cache=cache)
    >>> cache.reused                                              # inside the old prompt: all again
    0
    """

    def __init__(self, model) -> None:
        # every module with a decoding cache, the model first (its count of the tokens fed)
        holders = [m for m in getattr(model, "modules", lambda: ())() if callable(getattr(m, "_cache_state", None))]
        if not holders or holders[0] is not model or not callable(getattr(model, "reset_kv_cache", None)):
            raise TypeError(
                f"model: expected a model with decoding caches (a npattn.models.CausalLM), got {type(model).__name__}"
            )
        self._model = model
        self._holders = holders
        # a cache that cannot be cut back anywhere (a recurrent state, a rolling window): the
        # prompt's last token runs apart, so that the point before it is marked too (_decode)
        self._splits = not all(h._rewinds_anywhere() for h in holders)
        self._busy = False  # a call holds the caches (they are in the model)
        self.reused = 0
        self.reset()

    @property
    def model(self):
        """The model whose caches this holds."""
        return self._model

    @property
    def tokens(self) -> np.ndarray:
        """The token ids whose states the cache holds, ``(len(self),)`` int64 (a copy)."""
        return self._tokens.copy()

    def __len__(self) -> int:
        return len(self._tokens)

    def reset(self) -> None:
        """Empty the cache (the next call runs its whole prompt).

        Raises
        ------
        ValueError
            While a stream using it has not ended.
        """
        if self._busy:
            raise ValueError("prompt_cache: in use by a stream that has not ended; close it first")
        self._clear()

    def __repr__(self) -> str:
        return f"PromptCache(model={type(self._model).__name__}, tokens={len(self)}, reused={self.reused})"

    # -- the decoding loop's side (_decode) ------------------------------------------------------
    def _clear(self) -> None:
        self._tokens = np.zeros(0, np.int64)
        self._states: list | None = None  # each holder's _cache_state(), taken out of the model
        # (n, each holder's _cache_mark(n)) at the end of the last prompt, then (where the model
        # has caches that cannot be cut back anywhere) before its last token
        self._points: list = []
        self._pending: list = []  # this call's points, kept once it ends well
        self._long = False  # LongRoPE: the held keys were rotated with the long factors
        self._dtype = None
        self._weights: tuple = ()  # _weights_seen() when the caches were stored

    def _check(self, model, ids: np.ndarray, mask) -> None:
        """``stream_tokens``' checks of its arguments against this cache."""
        if model is not self._model:
            raise ValueError(
                f"prompt_cache: made for another model ({type(self._model).__name__} at {id(self._model):#x}), got "
                f"{type(model).__name__} at {id(model):#x}; each model needs its own (model.prompt_cache())"
            )
        if ids.ndim == 2 and ids.shape[0] != 1:
            raise ValueError(f"ids: expected one sequence, (L,) or (1, L), with prompt_cache, got shape {ids.shape}")
        if mask is not None:
            raise ValueError("attention_mask: expected no padding (all ones or None) with prompt_cache, got a 0")
        if self._busy:
            raise ValueError("prompt_cache: in use by a stream that has not ended; close it or use another cache")

    def _resume(self, ids: np.ndarray) -> int:
        """Put the held caches into the model, cut back to what ``ids (L,)`` shares with the held
        tokens (or to the last prompt's end, or nothing: see the class notes); returns how many
        tokens of ``ids`` the model holds now (the rest is to be run)."""
        if self._busy:
            raise ValueError("prompt_cache: in use by a stream that has not ended; close it or use another cache")
        model, held, states, points, long_ = self._model, self._tokens, self._states, self._points, self._long
        dtype, weights = self._dtype, self._weights
        self._busy, self.reused = True, 0
        self._clear()  # what it held is the model's now, until _store
        try:
            model.reset_kv_cache()
            m = min(len(held), len(ids) - 1)  # at least the last token runs
            same = held[:m] == ids[:m]
            n = m if same.all() else int(same.argmin())
            reencode = getattr(model, "reencode_length", None)
            regime = reencode is None or long_ == (len(ids) >= reencode)
            if states is None or n == 0 or not regime or dtype != getattr(model, "dtype", None):
                return 0
            if weights != self._weights_seen():  # the weights changed since: nothing held is theirs
                return 0
            for holder, state in zip(self._holders, states):
                holder._set_cache_state(state)
            # the common prefix (everything held, or a cache cut back), else the marked points
            tries = [(n, points[0][1] if points else [None] * len(self._holders))] + points
            for at, marks in tries:
                if 0 < at <= n and all(h._can_rewind(at, k) for h, k in zip(self._holders, marks)):
                    for h, k in zip(self._holders, marks):
                        h._rewind_cache(at, k)
                    self.reused = at
                    return at
            model.reset_kv_cache()
            return 0
        except BaseException:
            self._busy = False
            model.reset_kv_cache()
            raise

    def _mark(self, n: int) -> None:
        """The model has just run the first ``n`` tokens of the prompt (all of them, or all but the
        last): remember this point, the later first."""
        self._pending.insert(0, (n, [h._cache_mark(n) for h in self._holders]))

    def _store(self, tokens: np.ndarray | None) -> None:
        """The call ends: take the model's caches, which hold ``tokens`` (None: not usable)."""
        self._busy = False
        if tokens is None:
            self._clear()
            return
        points = self._pending
        self._clear()
        self._states = [h._cache_state() for h in self._holders]
        self._tokens = np.array(tokens, dtype=np.int64)
        self._points = points
        reencode = getattr(self._model, "reencode_length", None)
        self._long = reencode is not None and len(tokens) >= reencode
        self._dtype = getattr(self._model, "dtype", None)
        self._weights = self._weights_seen()

    def _weights_seen(self) -> tuple:
        """Each parameter and its version (``npattn.Parameter``: bumped by every change npattn sees:
        an optimizer step, ``load_state_dict``, ``Module.to``, an assignment to ``.data``)."""
        return tuple((id(p), p._version) for p in self._model.parameters())


def _before_last(model, out: np.ndarray, start: int, prompt_cache: PromptCache, kw: dict) -> int:
    """Where the prompt cache holds a cache that cannot be cut back anywhere (``PromptCache._splits``),
    run the prompt ``out (1, L)`` from ``start`` up to its last token and mark that point (the same
    prompt sent again, whose last token must run, resumes there); returns where the rest starts."""
    last = out.shape[1] - 1
    if not prompt_cache._splits:
        return start
    if last > start:
        model(out[:, start:last], use_cache=True, **kw)
    prompt_cache._mark(last)
    return last


def check_sampling(temperature, top_k, eos_id):
    """Validate the sampling options; returns ``(temperature as float, top_k, eos_id)``.

    Parameters
    ----------
    temperature : float
        >= 0 (0: greedy).
    top_k : int or None
        >= 1.
    eos_id : int or None
        >= 0.

    Returns
    -------
    tuple
        ``(temperature, top_k, eos_id)``, checked.

    Raises
    ------
    TypeError, ValueError
        A non-number or negative ``temperature``, a ``top_k`` or ``eos_id`` that is not a
        non-negative integer (``top_k`` >= 1).

    Examples
    --------
    >>> from npattn.generation import check_sampling
    >>> check_sampling(0, 5, None)
    (0.0, 5, None)
    """
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"temperature: expected a real number >= 0, got {temperature!r} ({type(temperature).__name__})")
    temperature = float(temperature)
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature: expected a finite number >= 0 (0 = greedy), got {temperature}")
    if top_k is not None:
        top_k = check_size(top_k, "top_k")
    if eos_id is not None:
        if isinstance(eos_id, bool) or not isinstance(eos_id, numbers.Integral):
            raise TypeError(f"eos_id: expected an integer token id or None, got {eos_id!r} ({type(eos_id).__name__})")
        eos_id = int(eos_id)
    return temperature, top_k, eos_id


def _top_k_mask(logits: np.ndarray, top_k: int | None) -> np.ndarray:
    """The book's ``torch.where(logits < topk(logits, k).values[:, -1], -inf, logits)``: every
    logit below the k-th largest becomes ``-inf`` (a k larger than the vocabulary keeps all)."""
    v = logits.shape[-1]
    if top_k is None or top_k >= v:
        return logits
    kth = np.partition(logits, v - top_k, axis=-1)[..., v - top_k : v - top_k + 1]  # the k-th largest
    return np.where(logits < kth, -np.inf, logits).astype(logits.dtype, copy=False)


def _check_top_p(top_p) -> float | None:
    """``top_p``: None (off) or a number in (0, 1]."""
    if top_p is None:
        return None
    if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real):
        raise TypeError(f"top_p: expected a number in (0, 1] or None, got {top_p!r} ({type(top_p).__name__})")
    if not 0.0 < float(top_p) <= 1.0:
        raise ValueError(f"top_p: expected a number in (0, 1] or None, got {top_p}")
    return float(top_p)


def _top_p_filter(p: np.ndarray, top_p: float | None) -> np.ndarray:
    """Nucleus filtering of probabilities ``p (..., vocab)``: zero every token for which the
    tokens ranked before it (by probability, highest first) already sum to ``top_p`` or more,
    then renormalise.  The most probable token always stays."""
    if top_p is None or top_p >= 1.0:
        return p
    order = np.argsort(-p, axis=-1, kind="stable")
    ps = np.take_along_axis(p, order, axis=-1)
    before = np.cumsum(ps, axis=-1) - ps  # mass of the tokens ranked before each one
    keep = np.empty_like(p, dtype=bool)
    np.put_along_axis(keep, order, before < top_p, axis=-1)
    q = np.where(keep, p, 0.0)
    return q / q.sum(axis=-1, keepdims=True)


def _check_min_p(min_p) -> float | None:
    """``min_p``: None (off) or a number in [0, 1]."""
    if min_p is None:
        return None
    if isinstance(min_p, bool) or not isinstance(min_p, numbers.Real):
        raise TypeError(f"min_p: expected a number in [0, 1] or None, got {min_p!r} ({type(min_p).__name__})")
    if not 0.0 <= float(min_p) <= 1.0:
        raise ValueError(f"min_p: expected a number in [0, 1] or None, got {min_p}")
    return float(min_p)


def _min_p_filter(p: np.ndarray, min_p: float | None) -> np.ndarray:
    """transformers' ``MinPLogitsWarper`` on probabilities ``p (..., vocab)``: zero every token
    less probable than ``min_p`` times the most probable one, then renormalise (the most probable
    token always stays)."""
    if not min_p:
        return p
    q = np.where(p < min_p * p.max(axis=-1, keepdims=True), 0.0, p)
    return q / q.sum(axis=-1, keepdims=True)


def _check_repetition_penalty(penalty) -> float | None:
    """``repetition_penalty``: None or 1 (off), or a finite number > 0."""
    if penalty is None:
        return None
    if isinstance(penalty, bool) or not isinstance(penalty, numbers.Real):
        raise TypeError(
            f"repetition_penalty: expected a number > 0 or None, got {penalty!r} ({type(penalty).__name__})"
        )
    penalty = float(penalty)
    if not (math.isfinite(penalty) and penalty > 0):
        raise ValueError(f"repetition_penalty: expected a finite number > 0 (1: none) or None, got {penalty}")
    return None if penalty == 1 else penalty


def _penalize(logits: np.ndarray, seen: np.ndarray, penalty: float) -> np.ndarray:
    """transformers' ``RepetitionPenaltyLogitsProcessor``: the logits ``z`` of the tokens marked in
    ``seen`` (``logits``' shape, bool) become ``z * penalty`` where ``z < 0``, else ``z / penalty``
    (both lower the token's chance for a penalty above 1), in ``logits``' dtype."""
    p = logits.dtype.type(penalty)
    return np.where(seen, np.where(logits < 0, logits * p, logits / p), logits)


def next_token_probs(
    logits, temperature: float = 1.0, top_k: int | None = None, *, top_p=None, min_p=None
) -> np.ndarray:
    """The distribution the next token is drawn from: ``softmax(top_k(logits) / temperature)``
    over the last axis of ``logits (..., vocab)``, then nucleus-filtered by ``top_p`` (None or
    1: off), then by ``min_p`` (None or 0: off; transformers' order of the three warpers).  A
    ``top_k`` of at least ``vocab`` keeps every token (clamped to ``min(top_k, vocab)``).
    ``temperature=0`` gives the one-hot of the arg-max (greedy decoding; the first one on ties).

    Parameters
    ----------
    logits : array_like
        ``(..., vocab)``.
    temperature : float
        >= 0.
    top_k : int, optional
        Keep the ``top_k`` largest logits.
    top_p : float, optional
        In ``(0, 1]``.
    min_p : float, optional
        In ``[0, 1]``: a token stays when it is at least ``min_p`` times as probable as the most
        probable one (transformers' ``min_p``).

    Returns
    -------
    ndarray
        Of ``logits``' shape: probabilities summing to 1 over the last axis.

    Raises
    ------
    TypeError, ValueError
        Options out of range (see ``check_sampling``), a ``top_p`` outside ``(0, 1]``, a ``min_p``
        outside ``[0, 1]``.

    Examples
    --------
    >>> import numpy as np
    >>> from npattn.generation import next_token_probs
    >>> logits = np.log(np.array([0.5, 0.3, 0.2]))
    >>> np.round(next_token_probs(logits), 4)
    array([0.5, 0.3, 0.2])
    >>> np.round(next_token_probs(logits, top_k=2), 4)      # renormalised over the two largest
    array([0.625, 0.375, 0.   ])
    >>> next_token_probs(logits, temperature=0)              # greedy: the one-hot of the arg-max
    array([1., 0., 0.])
    >>> np.round(next_token_probs(logits, min_p=0.5), 4)    # at least half the top token's 0.5
    array([0.625, 0.375, 0.   ])
    """
    temperature, top_k, _ = check_sampling(temperature, top_k, None)
    top_p, min_p = _check_top_p(top_p), _check_min_p(min_p)
    logits = np.asarray(logits)
    if logits.dtype.kind != "f" or logits.ndim < 1 or logits.shape[-1] < 1:
        raise ValueError(
            f"logits: expected a float array (..., vocab) with vocab >= 1, got "
            f"dtype {logits.dtype}, shape {logits.shape}"
        )
    return _probs(logits, temperature, top_k, top_p, min_p)


def _probs(logits, temperature, top_k, top_p=None, min_p=None):
    if temperature == 0.0:
        out = np.zeros_like(logits)
        np.put_along_axis(out, logits.argmax(axis=-1)[..., None], 1.0, axis=-1)
        return out
    z = _top_k_mask(logits, top_k)
    # softmax(z / T) = softmax((z - max z) / T): the shifted form cannot overflow for small T
    z = (z - z.max(axis=-1, keepdims=True)) / z.dtype.type(temperature)
    e = np.exp(z)
    return _min_p_filter(_top_p_filter(e / e.sum(axis=-1, keepdims=True), top_p), min_p)


def _sample(
    logits: np.ndarray, temperature: float, top_k, rng: np.random.Generator, top_p=None, min_p=None
) -> np.ndarray:
    """One token per row of ``logits (B, vocab)``.  Greedy: the arg-max (top-k changes nothing).
    Sampling: inverse CDF, one uniform draw ``rng.random(B)`` per step, so a seed fixes the tokens;
    a token of probability 0 (masked by top-k) is never drawn.  A row of logits with NaN or +inf,
    or only -inf, has no distribution: ValueError (torch.multinomial refuses it as well), where the
    inverse CDF of its NaN probabilities would give the id ``vocab``, outside the vocabulary."""
    if temperature == 0.0:
        return logits.argmax(axis=-1)
    with np.errstate(invalid="ignore"):  # a row without a distribution: refused just below
        p = _probs(logits.astype(np.float64), temperature, top_k, top_p, min_p)
    bad = np.flatnonzero(np.isnan(p).any(axis=-1))
    if len(bad):
        raise ValueError(
            f"logits: expected finite values to sample from (-inf for some tokens only), got NaN, +inf or only "
            f"-inf in row {bad[0]}"
        )
    cdf = np.cumsum(p, axis=-1)
    u = rng.random(len(p)) * cdf[:, -1]
    return np.array([np.searchsorted(c, x, side="right") for c, x in zip(cdf, u)], dtype=np.int64)


def sample_next_token(
    logits, temperature: float = 0.0, top_k: int | None = None, *, rng=None, top_p=None, min_p=None
) -> np.ndarray:
    """The book's sampling step on ``logits (B, vocab)`` (the last position's): greedy arg-max at
    ``temperature=0``, else a draw from ``next_token_probs(logits, temperature, top_k,
    top_p=top_p, min_p=min_p)``.
    Returns ``(B,)`` int64 token ids.

    Parameters
    ----------
    logits : array_like
        ``(B, vocab)``.
    temperature, top_k, top_p, min_p
        As ``next_token_probs``.
    rng : numpy.random.Generator, int or None
        For sampling (greedy draws nothing).

    Returns
    -------
    ndarray of int64
        ``(B,)``.

    Raises
    ------
    TypeError, ValueError
        Options out of range, ``logits`` not 2-d.

    Examples
    --------
    >>> import numpy as np
    >>> from npattn.generation import sample_next_token
    >>> logits = np.array([[0.0, 3.0, 1.0], [2.0, 0.0, 0.0]])
    >>> sample_next_token(logits)                            # temperature 0: greedy
    array([1, 0])
    >>> sample_next_token(logits, 1.0, top_k=1, rng=0)       # top_k=1 leaves one choice
    array([1, 0])
    """
    temperature, top_k, _ = check_sampling(temperature, top_k, None)
    top_p, min_p = _check_top_p(top_p), _check_min_p(min_p)
    logits = np.asarray(logits)
    if logits.dtype.kind != "f" or logits.ndim != 2 or logits.shape[-1] < 1:
        raise ValueError(
            f"logits: expected a float array (batch, vocab), got dtype {logits.dtype}, shape {logits.shape}"
        )
    return _sample(logits, temperature, top_k, as_rng(rng), top_p, min_p)


def generate(
    model,
    idx,
    max_new_tokens,
    context_size,
    temperature=0.0,
    top_k=None,
    eos_id=None,
    *,
    rng=None,
    use_cache=True,
    top_p=None,
):
    """Append up to ``max_new_tokens`` tokens to ``idx`` (integer ids ``(..., L)``, usually
    ``(batch, L)``), each predicted from at most the last ``context_size`` tokens.

    * ``temperature=0``: greedy (arg-max); ``temperature > 0``: sample from
      ``softmax(logits / temperature)``, after ``top_k`` (keep the ``top_k`` largest logits,
      the others become ``-inf``; ties with the k-th are kept, as the book's ``torch.where``; a
      ``top_k`` of at least the vocabulary size keeps every token, as Hugging Face's top-k
      warper clamps to ``min(top_k, vocab)``, where ``torch.topk`` itself would raise), then
      ``top_p`` (nucleus: the most probable tokens whose probabilities sum to ``top_p``; None or
      1 keeps all).
    * ``eos_id``: a sequence that produces ``eos_id`` is finished.  As in the book, generation
      stops at the step where the (last) sequence finishes, and that step's ``eos_id`` is not
      appended; in a batch, sequences that finished earlier are padded with ``eos_id`` until
      then.  So the result may be shorter than ``L + max_new_tokens``.
    * ``rng``: Generator, int seed or None; the same seed gives the same tokens (one
      ``rng.random(batch)`` per sampled step; greedy decoding draws nothing).
    * ``use_cache``: with a model that has a KV cache (``reset_kv_cache`` and
      ``model(idx, use_cache=True)``), encode the prompt once and then feed one token per step.
      Once the sequence is longer than ``context_size`` the window slides and absolute position
      embeddings change for every kept token, so those steps re-encode the last ``context_size``
      tokens, exactly as without the cache.  The cache is reset before and after.  Ignored for
      models without a cache.

    Runs in eval mode (dropout off) under ``no_grad`` and restores the model's mode.
    Returns the ids ``(..., L + new)``, of ``idx``'s integer dtype (widened where it cannot hold
    every id of the vocabulary, e.g. uint8 ids of a larger one).

    Parameters
    ----------
    model : Module
        Maps ids ``(..., L)`` to logits ``(..., L, vocab)``.
    idx : array_like of int
        The prompt ids, ``(..., L)``.
    max_new_tokens : int
        >= 0.
    context_size : int
        How many of the last tokens the model sees.
    temperature, top_k, top_p, min_p
        As ``next_token_probs``.
    eos_id : int, optional
        Stop a sequence when it produces this id.
    rng : numpy.random.Generator, int or None
    use_cache : bool

    Returns
    -------
    ndarray
        The ids ``(..., L + new)``.

    Raises
    ------
    TypeError, ValueError
        Options out of range, non-integer ids.

    Examples
    --------
    >>> import numpy as np
    >>> import npattn
    >>> from npattn.generation import generate
    >>> model = npattn.TinyTransformer(12, 16, 16, 2, 1, 32, rng=0)
    >>> out = generate(model, np.array([[1, 2, 3]]), max_new_tokens=4, context_size=16)
    >>> out.shape, out[0, :3].tolist()
    ((1, 7), [1, 2, 3])
    >>> bool(np.array_equal(out, generate(model, np.array([[1, 2, 3]]), 4, 16, use_cache=False)))
    True
    """
    idx = as_index(idx, "idx")
    if idx.ndim < 1 or idx.shape[-1] < 1:
        raise ValueError(f"idx: expected integer token ids of shape (..., L) with L >= 1, got shape {idx.shape}")
    n = check_size(max_new_tokens, "max_new_tokens", minimum=0)
    context_size = check_size(context_size, "context_size")
    temperature, top_k, eos_id = check_sampling(temperature, top_k, eos_id)
    top_p = _check_top_p(top_p)
    rng = as_rng(rng)
    if not callable(model):
        raise TypeError(f"model: expected a callable model(idx) -> logits, got {type(model).__name__}")
    use_cache = check_bool(use_cache, "use_cache") and callable(getattr(model, "reset_kv_cache", None))

    lead = idx.shape[:-1]
    out = idx.reshape(-1, idx.shape[-1])
    finished = np.zeros(len(out), dtype=bool)

    def choose(last):  # the book's EOS: the step where the last sequence finishes appends nothing
        nxt = _sample(last, temperature, top_k, rng, top_p)
        if eos_id is not None:
            nxt = np.where(finished, eos_id, nxt)
            finished[...] |= nxt == eos_id
            if finished.all():
                return None
        return nxt, False

    steps = [t[:, None] for t in _decode(model, out, n, choose, context_size=context_size, use_cache=use_cache)]
    out = np.concatenate([out, *steps], axis=1)
    return out.reshape(lead + (out.shape[1],))


def _decode(model, out: np.ndarray, n: int, choose, *, context_size=None, use_cache=True, mask=None, prompt_cache=None):
    """The decoding loop of every generator here: ``n`` steps on the prompt ``out (B, L)``, each
    the last position's logits ``(B, vocab)`` -> ``choose(logits)``, which returns ``(tokens (B,),
    last)`` (``last``: this step's tokens are the final ones) or ``None`` (stop, nothing appended);
    yields each step's tokens.  With a model that has a cache (``reset_kv_cache`` and
    ``model(idx, use_cache=True)``) and ``use_cache``, the prompt is encoded once and each step
    feeds one token; past ``context_size`` tokens (None: no limit) the last ``context_size`` are
    re-encoded each step.  ``mask``: the prompt's ``attention_mask (B, L)`` (left padding) for a
    model whose forward takes one, given with the prompt (the new tokens are tokens: a cached step
    needs no mask, an uncached pass gets the prompt's followed by ones).  Eval mode (dropout off)
    while the loop runs, each forward under ``no_grad`` (nothing else between two steps is); the
    cache is reset before and after and the model's mode restored when the loop ends or the
    generator is closed.  A model whose ``reencode_length`` is set (LongRoPE) encodes its tokens
    so far again, into a fresh cache, at the step where they reach that length, as transformers'
    Phi-3 drops its cache there.  A model has one cache: the loop that last filled it holds it
    (``_CACHE_HOLDER``), and a loop resumed after another generate/stream on the same model
    filled it re-encodes its tokens so far before its next step, as transformers' calls, each with
    its own cache, are independent (and ends without resetting what another holds).  A direct
    ``model(..., use_cache=True)`` or ``reset_kv_cache()`` between two steps is not seen.
    ``prompt_cache`` (a ``PromptCache`` of ``model``, one row): the prompt's pass starts from the
    caches it holds (``PromptCache._resume``: the prompt's tokens before the one returned are not
    run), the end of the prompt is marked, and when the loop ends the caches go back into it with
    the tokens fed (emptied where a forward did not complete)."""
    use_cache = use_cache and callable(getattr(model, "reset_kv_cache", None))
    was_training = getattr(model, "training", None) if callable(getattr(model, "train", None)) else None
    if was_training is not None:
        model.train(False)
    me = object()  # this loop, as _CACHE_HOLDER knows it

    def tokens_mask(start=0):  # the prompt's mask followed by ones for the new tokens
        if mask is None:
            return {}
        new = np.ones((len(out), out.shape[1] - mask.shape[1]), mask.dtype)
        return {"attention_mask": np.concatenate([mask, new], axis=1)[:, start:]}

    # LongRoPE (CausalLM.reencode_length): the whole sequence again where the frequencies switch
    reencode = getattr(model, "reencode_length", None) if use_cache else None
    fed, resumed = 0, False  # the tokens the cache holds (when a forward completed); prompt_cache taken
    try:
        primed = False
        for _ in range(n):
            with no_grad():
                if use_cache and (context_size is None or out.shape[1] <= context_size):
                    if primed and _holds_cache(model, me) and out.shape[1] != reencode:
                        fed = -1
                        logits = model(out[:, -1:], use_cache=True)
                        fed = out.shape[1]
                    else:  # the prompt, or the tokens so far when another loop took the cache: the
                        # last position's logits only, where the model can say so
                        start = 0
                        if prompt_cache is not None and not primed:
                            start = prompt_cache._resume(out[0])
                            resumed = True
                        else:
                            model.reset_kv_cache()
                        _hold_cache(model, me)
                        kw = tokens_mask()
                        if _keeps_logits(model):
                            kw["logits_to_keep"] = 1
                        fed = -1
                        if resumed and not primed:
                            start = _before_last(model, out, start, prompt_cache, kw)
                        logits = model(out[:, start:], use_cache=True, **kw)
                        fed = out.shape[1]
                        if resumed and not primed:
                            prompt_cache._mark(fed)
                    primed = True
                else:
                    start = 0 if context_size is None else max(0, out.shape[1] - context_size)
                    logits = model(out[:, start:], **tokens_mask(start))
            logits = np.asarray(logits)[:, -1, :]
            step = choose(logits)
            if step is None:
                return
            tokens, last = step
            # the ids' dtype, widened where it cannot hold every id of the vocabulary (uint8 ids of
            # a 1000-token model): a new id must not wrap, nor be fed back wrapped
            tokens = tokens.astype(np.promote_types(out.dtype, np.min_scalar_type(logits.shape[-1] - 1)), copy=False)
            out = np.concatenate([out, tokens[:, None]], axis=1)
            yield tokens
            if last:
                return
    finally:
        holds = use_cache and _holds_cache(model, me)
        if resumed:  # the caches go back into the prompt cache (nothing usable: emptied)
            prompt_cache._store(out[0, :fed] if holds and fed > 0 else None)
        if holds:
            model.reset_kv_cache()
            _hold_cache(model, None)
        if was_training is not None:
            model.train(was_training)


# The decoding loop (``_decode``'s ``me``) whose tokens each model's cache holds.
_CACHE_HOLDER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _hold_cache(model, me) -> None:
    """``me`` fills ``model``'s cache (None: nothing does)."""
    try:
        _CACHE_HOLDER[model] = me
    except TypeError:  # a model that cannot be weakly referenced or hashed: not tracked
        pass


def _holds_cache(model, me) -> bool:
    """Whether ``me`` filled ``model``'s cache last (True for a model that is not tracked)."""
    try:
        return _CACHE_HOLDER.get(model) is me
    except TypeError:
        return True


def _keeps_logits(model) -> bool:
    """Whether ``model``'s forward takes ``logits_to_keep`` (``CausalLM``, transformers' models)."""
    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (AttributeError, TypeError, ValueError):
        return False


def _check_token_ids(value, name: str, *, many: bool = True) -> list:
    """``eos_token_id`` (None, an id or, with ``many``, a list of ids) or ``pad_token_id`` (None
    or an id) as a list of ids, each an integer >= 0."""
    if value is None:
        return []
    if isinstance(value, np.ndarray) and value.ndim == 0:  # one id as a 0-d array (not iterable)
        value = value.item()
    ids = list(value) if many and isinstance(value, (list, tuple, np.ndarray)) else [value]
    what = "a token id (an integer >= 0)" + (", a list of them" if many else "") + " or None"
    for e in ids:
        if isinstance(e, (bool, np.bool_)) or not isinstance(e, numbers.Integral):
            raise TypeError(f"{name}: expected {what}, got {value!r}")
        if e < 0:
            raise ValueError(f"{name}: expected {what}, got {value!r}")
    return [int(e) for e in ids]


def _takes_mask(model) -> bool:
    """Whether ``model``'s forward has an ``attention_mask`` argument (padded batches)."""
    forward = getattr(model, "forward", model)
    try:
        return "attention_mask" in inspect.signature(forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - a callable without a signature
        return False


def _check_attention_mask(attention_mask, shape, model) -> np.ndarray | None:
    """``attention_mask`` as a bool array of the prompt's ``shape`` (as the model takes it), or
    None when it marks no padding (all ones) or is None.  Left padding only (ValueError for a 0
    after a 1 in a row); a 0 needs a model whose forward takes ``attention_mask``:
    ``NotImplementedError`` otherwise."""
    if attention_mask is None:
        return None
    mask = to_numpy(attention_mask, "attention_mask")
    if mask.dtype.kind not in "biu":
        raise TypeError(
            f"attention_mask: expected integers or booleans (1 = token, 0 = padding), got dtype {mask.dtype}"
        )
    if mask.shape != shape:
        raise ValueError(f"attention_mask: expected the shape of ids {shape}, got {mask.shape}")
    if ((mask != 0) & (mask != 1)).any():
        bad = mask[(mask != 0) & (mask != 1)].flat[0]
        raise ValueError(f"attention_mask: expected 1 (token) and 0 (padding) only, got {bad}")
    if mask.all():
        return None
    rows = mask.reshape(-1, shape[-1]).astype(np.int8)
    if (rows.sum(-1) == 0).any():
        raise ValueError("attention_mask: a row has no token (all 0); expected at least one 1 per row")
    # the next token follows each row's last column: a 0 after a 1 (right padding, a gap) would
    # continue from padding (transformers warns and does so; the model's forward refuses a gap)
    right = np.argwhere(np.diff(rows, axis=-1) < 0)
    if len(right):
        raise ValueError(
            "attention_mask: expected left padding (each row's 0s before all its 1s, the new tokens following its "
            "last column; a Hugging Face tokenizer pads so with padding_side='left'), got a 0 after a 1 in row "
            f"{right[0][0]}, column {right[0][1] + 1}"
        )
    if not _takes_mask(model):
        raise NotImplementedError(
            f"attention_mask: a 0 (a padded prompt) needs a model whose forward takes attention_mask, and "
            f"{type(model).__name__}.forward does not; generate prompts of equal length together (a mask of ones) "
            "or one prompt at a time"
        )
    return rows.astype(bool)


def stream_tokens(
    model,
    ids,
    max_new_tokens,
    *,
    attention_mask=None,
    do_sample=False,
    temperature=1.0,
    top_k=None,
    top_p=None,
    eos_token_id=None,
    pad_token_id=None,
    rng=None,
    min_p=None,
    repetition_penalty=None,
    prompt_cache=None,
):
    """Decode up to ``max_new_tokens`` tokens after ``ids`` as Hugging Face transformers'
    ``generate`` does, yielding each step's tokens as they come: an integer array of
    ``ids.shape[:-1]`` (``(B,)`` for a batch ``(B, L)``) per step.  Every argument is checked
    here, before the first token (the returned generator then only decodes).

    transformers' conventions:

    * greedy (the arg-max, the first on ties) unless ``do_sample``; sampling draws from
      ``softmax(logits / temperature)`` after ``top_k`` (None or 0: off) and ``top_p`` (None or
      1: off) and ``min_p`` (None: off), as transformers' temperature, top-k, top-p and min-p
      warpers in that order (where transformers' ``GenerationConfig`` leaves ``top_k`` unset it
      uses 50: pass ``top_k=50`` for its default);
    * ``repetition_penalty`` (None or 1: off), greedy or sampling, before the warpers: the logit
      ``z`` of every token the row holds (its prompt's, not its padding's, and those generated)
      becomes ``z / penalty`` where ``z > 0`` and ``z * penalty`` where not, as transformers'
      ``RepetitionPenaltyLogitsProcessor`` (which ``generate`` also applies when it comes from the
      checkpoint's ``generation_config.json``: ``CausalLM.generate`` takes it from there too);
    * ``eos_token_id`` (an id or a list of ids; None or ``[]``: none): a row that has produced one is finished and
      continues with ``pad_token_id`` (None: the first eos id); the loop stops when every row is
      finished, so fewer than ``max_new_tokens`` steps may come;
    * ``attention_mask``: ``(B, L)``, 1 for a token and 0 for (left) padding, as transformers
      takes it: given to the model's forward with the prompt (``CausalLM(ids, attention_mask=...)``),
      so that each row continues as its prompt alone would; a 0 after a 1 (right padding, a gap)
      raises ValueError, since the new tokens follow each row's last column (transformers warns and
      continues from the padding); a model whose forward takes no ``attention_mask`` decodes
      batches without padding only (a 0 raises ``NotImplementedError``).
      None means every token is real: transformers' ``generate`` would guess a mask from the pad
      token where the prompt contains it (``ids != pad_token_id``), npattn takes no token for
      padding unless the mask says so (pass the tokenizer's mask);
    * ``prompt_cache`` (a ``PromptCache`` of ``model``; one sequence, no padding): the caches kept
      from the last call that used it, cut back to the prefix its tokens share with ``ids``, whose
      tokens are then not run again; it holds this call's tokens when it ends (transformers'
      ``past_key_values`` passed back into ``generate``).  None: a fresh cache, emptied after.

    Parameters
    ----------
    model : Module
        ``model(ids) -> logits (B, L, vocab)``; with ``reset_kv_cache`` and
        ``model(ids, use_cache=True)`` the prompt is encoded once and each step feeds one token.
    ids : array_like of int
        ``(B, L)`` or ``(L,)``, ``L >= 1``.
    max_new_tokens : int
        >= 0.
    attention_mask : array_like, optional
    do_sample : bool
    temperature : float
        > 0 when sampling.
    top_k : int, optional
    top_p : float, optional
        In ``(0, 1]``.
    eos_token_id : int or list of int, optional
    pad_token_id : int, optional
    min_p : float, optional
        In ``[0, 1]``.
    repetition_penalty : float, optional
        > 0.
    rng : numpy.random.Generator, int or None
        The sampling's randomness (one ``rng.random(B)`` per sampled step; greedy draws nothing).
    prompt_cache : PromptCache, optional
        Keyword only.

    Returns
    -------
    generator of ndarray
        One array of ``ids.shape[:-1]`` per step, of ``ids``' integer dtype (widened where it
        cannot hold every id of the vocabulary, e.g. uint8 ids of a larger one).  While it runs the
        model is in eval mode and holds its cache; both are restored when it ends or is closed.
        Another generate or stream on the same model between two of its steps takes the cache:
        this one then re-encodes its tokens so far before its next step (the same tokens).

    Raises
    ------
    TypeError, ValueError
        Arguments out of range, naming them.
    NotImplementedError
        An ``attention_mask`` with a 0 for a model whose forward takes no ``attention_mask``.

    Examples
    --------
    >>> import numpy as np
    >>> import npattn
    >>> from npattn.generation import stream_tokens
    >>> model = npattn.TinyTransformer(12, 16, 16, 2, 1, 32, rng=0)
    >>> steps = list(stream_tokens(model, np.array([[1, 2, 3], [4, 5, 6]]), 3))
    >>> len(steps), steps[0].shape
    (3, (2,))
    """
    ids = as_index(ids, "ids")
    if ids.ndim not in (1, 2) or ids.shape[-1] < 1:
        raise ValueError(f"ids: expected token ids of shape (B, L) or (L,) with L >= 1, got shape {ids.shape}")
    n = check_size(max_new_tokens, "max_new_tokens", minimum=0)
    mask = _check_attention_mask(attention_mask, ids.shape, model)
    do_sample = check_bool(do_sample, "do_sample")
    if isinstance(top_k, numbers.Integral) and not isinstance(top_k, bool) and top_k == 0:
        top_k = None  # transformers: 0 is no top-k
    temperature, top_k, _ = check_sampling(temperature, top_k, None)
    if do_sample and temperature == 0.0:
        raise ValueError("temperature: expected a number > 0 with do_sample=True, got 0.0 (do_sample=False is greedy)")
    top_p, min_p = _check_top_p(top_p), _check_min_p(min_p)
    penalty = _check_repetition_penalty(repetition_penalty)
    eos = _check_token_ids(eos_token_id, "eos_token_id")
    pad = _check_token_ids(pad_token_id, "pad_token_id", many=False)
    pad_id = pad[0] if pad else (eos[0] if eos else None)
    rng = as_rng(rng)
    if not callable(model):
        raise TypeError(f"model: expected a callable model(ids) -> logits, got {type(model).__name__}")
    if prompt_cache is not None:
        if not isinstance(prompt_cache, PromptCache):
            raise TypeError(
                "prompt_cache: expected a PromptCache (model.prompt_cache()) or None, got "
                f"{type(prompt_cache).__name__}"
            )
        prompt_cache._check(model, ids, mask)
    lead = ids.shape[:-1]
    out = ids.reshape(-1, ids.shape[-1])
    unfinished = np.ones(len(out), dtype=bool)
    t = temperature if do_sample else 0.0  # _sample: 0 is the arg-max
    rows = np.arange(len(out))
    seen: list = []  # repetition_penalty's (B, vocab) marks of the tokens each row holds

    def choose(last):
        if penalty is not None:
            if not seen:  # the prompt's tokens, its padding left out (the vocabulary known now)
                seen.append(np.zeros(last.shape, bool))
                real = np.ones(out.shape, bool) if mask is None else mask
                seen[0][np.broadcast_to(rows[:, None], out.shape)[real], out[real]] = True
            last = _penalize(last, seen[0], penalty)
        nxt = _sample(last, t, top_k, rng, top_p, min_p)
        if eos:
            nxt = np.where(unfinished, nxt, pad_id)
            unfinished[...] &= ~np.isin(nxt, eos)
        if seen:  # (a pad id outside the vocabulary marks nothing)
            inside = nxt < last.shape[-1]
            seen[0][rows[inside], nxt[inside]] = True
        return nxt, not unfinished.any()

    return (step.reshape(lead) for step in _decode(model, out, n, choose, mask=mask, prompt_cache=prompt_cache))


def generate_tokens(model, ids, max_new_tokens, **options) -> np.ndarray:
    """The prompt followed by the tokens of ``stream_tokens(model, ids, max_new_tokens,
    **options)`` (see there): ``(B, L + steps)`` for ``ids (B, L)`` (``(L + steps,)`` for
    ``(L,)``), ``steps <= max_new_tokens`` (fewer when every row has finished), as transformers'
    ``generate`` returns them, of ``ids``' integer dtype (widened as there).

    Examples
    --------
    >>> import numpy as np
    >>> import npattn
    >>> from npattn.generation import generate_tokens
    >>> model = npattn.TinyTransformer(12, 16, 16, 2, 1, 32, rng=0)
    >>> out = generate_tokens(model, np.array([[1, 2, 3]]), 4)
    >>> out.shape, out[0, :3].tolist()
    ((1, 7), [1, 2, 3])
    """
    steps = stream_tokens(model, ids, max_new_tokens, **options)
    ids = as_index(ids, "ids")
    return np.concatenate([ids, *(s[..., None] for s in steps)], axis=-1)

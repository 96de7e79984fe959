"""``npattn generate DIRECTORY PROMPT``: a completion from a saved Hugging Face model, streamed.

The directory holds ``config.json``, the safetensors weights and ``tokenizer.json``; the
``tokenizers`` package (``pip install "npattn[hf]"``, or ``pip install ".[hf]"`` from a clone)
turns the prompt into ids and the ids back into text.  The prompt is encoded once into every
layer's cache, then each new token is one cached step (``CausalLM(ids, use_cache=True)``),
sampled by ``npattn.generation`` (greedy at temperature 0; ``--top-k``, ``--top-p``,
``--seed``).  Text is printed as it grows (the decoded completion's new characters after each
token); the last line reports tokens per second.  Every loading, config, tokenizer or input error
is one line on stderr and exit status 2, before the prompt is printed.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from .._hints import install_hint
from .._validate import check_size

__all__ = ["stream", "main"]


def _eos_ids(config, name: str = "eos_token_id") -> set:
    """The config's ``eos_token_id`` (an id, a list of ids or None) as a set of ids, each checked
    to be an integer in ``[0, vocab_size)`` (ValueError/TypeError naming ``name`` otherwise)."""
    eos = config.eos_token_id
    if eos is None:
        return set()
    ids = eos if isinstance(eos, (list, tuple)) else [eos]
    for e in ids:
        check_size(e, name, minimum=0)
        if e >= config.vocab_size:
            raise ValueError(f"{name}: expected token ids in [0, {config.vocab_size}) (vocab_size), got {e}")
    return {int(e) for e in ids}


class _Failure(Exception):
    """An error of ``npattn generate`` to report as one line on stderr, exit status 2."""


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())  # a message is one line, whatever the exception held
    return text or type(e).__name__


def stream(model, prompt_ids, max_new_tokens, *, temperature=0.0, top_k=None, top_p=None, rng=None, eos=()):
    """Yield up to ``max_new_tokens`` token ids after ``prompt_ids`` (a list of ints), one cached
    step each; stops after an id in ``eos`` (which is yielded).  Resets the model's cache."""
    from ..generation import sample_next_token
    from ..nn.module import no_grad

    rng = np.random.default_rng(rng) if not isinstance(rng, np.random.Generator) else rng
    model.eval()
    model.reset_kv_cache()
    try:
        with no_grad():
            logits = model(np.asarray([prompt_ids]), use_cache=True)
            for _ in range(max_new_tokens):
                nxt = int(sample_next_token(logits[:, -1, :], temperature, top_k, rng=rng, top_p=top_p)[0])
                yield nxt
                if nxt in eos:
                    return
                logits = model(np.asarray([[nxt]]), use_cache=True)
    finally:
        model.reset_kv_cache()


def main(args) -> int:
    """Run ``npattn generate``: every loading, config, tokenizer or input error is one line on
    stderr and exit status 2 (never a traceback), reported before the prompt is printed."""
    try:
        model, tokenizer, prompt_ids, eos = _load(args)
    except _Failure as e:
        print(f"npattn generate: {e}", file=sys.stderr)
        return 2
    return _run(args, model, tokenizer, prompt_ids, eos)


# What loading a directory can raise: npattn's own validation (ValueError, TypeError), the file
# system (OSError), and what a hostile file may still provoke (deep JSON, huge sizes).
_LOAD_ERRORS = (OSError, ValueError, TypeError, KeyError, RecursionError, MemoryError, OverflowError)


def _load(args):
    """The model, the tokenizer, the prompt's ids and the eos ids, every check done; raises
    ``_Failure``."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise _Failure(f"needs the tokenizers package ({install_hint('hf')})") from None
    from ..generation import _check_top_p, check_sampling
    from ..models import CausalLM

    try:
        check_sampling(args.temperature, args.top_k, None)
        _check_top_p(args.top_p)
    except (TypeError, ValueError) as e:
        raise _Failure(_one_line(e)) from None
    if not os.path.isdir(args.directory):
        raise _Failure(f"directory: no such directory {args.directory!r}")
    tok_path = os.path.join(args.directory, "tokenizer.json")
    if not os.path.isfile(tok_path):
        raise _Failure(f"no tokenizer.json in {args.directory!r}")
    try:
        tokenizer = Tokenizer.from_file(tok_path)
    except Exception as e:  # tokenizers raises a bare Exception for every malformed file
        raise _Failure(f"{tok_path}: not a readable tokenizer ({_one_line(e)})") from None
    try:
        model = CausalLM.from_pretrained(args.directory)
        eos = _eos_ids(model.config, f"{os.path.join(args.directory, 'config.json')}: eos_token_id")
    except _LOAD_ERRORS as e:
        raise _Failure(_one_line(e)) from None
    try:
        prompt_ids = tokenizer.encode(args.prompt).ids
    except Exception as e:
        raise _Failure(f"{tok_path}: cannot encode the prompt ({_one_line(e)})") from None
    if not prompt_ids:
        raise _Failure("the prompt encodes to no tokens")
    vocab = model.config.vocab_size
    if max(prompt_ids) >= vocab:
        raise _Failure(
            f"{tok_path}: the prompt's token id {max(prompt_ids)} is outside the model's vocabulary "
            f"[0, {vocab}) (vocab_size)"
        )
    return model, tokenizer, prompt_ids, eos


def _run(args, model, tokenizer, prompt_ids, eos) -> int:
    """Print the prompt, then the completion as it grows, then the tokens per second."""
    out = sys.stdout
    out.write(args.prompt)
    out.flush()
    new: list = []
    shown = ""
    start = time.perf_counter()
    for token in stream(
        model,
        prompt_ids,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        rng=args.seed,
        eos=eos,
    ):
        new.append(token)
        text = tokenizer.decode(new)
        # print what the new token added; a byte-level token may end in the middle of a character
        # (decoded as U+FFFD until the next token completes it): hold that back
        if text.startswith(shown) and not text.endswith("\ufffd"):
            out.write(text[len(shown) :])
            out.flush()
            shown = text
    elapsed = time.perf_counter() - start
    text = tokenizer.decode(new)
    if text.startswith(shown):  # whatever was held back
        out.write(text[len(shown) :])
    rate = len(new) / elapsed if elapsed > 0 else float("inf")
    out.write(f"\n[{len(new)} tokens in {elapsed:.2f} s, {rate:.1f} tokens/s]\n")
    return 0

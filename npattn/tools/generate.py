"""``npattn generate DIRECTORY PROMPT``: a completion from a saved Hugging Face model, streamed.

The directory holds ``config.json``, the safetensors weights and ``tokenizer.json``; the
``tokenizers`` package (``pip install "npattn[hf]"``, or ``pip install ".[hf]"`` from a clone)
turns the prompt into ids and the ids back into text.  DIRECTORY may also be a GGUF file
(``CausalLM.from_gguf``; the ``gguf`` package): its tokenizer is built from the file's
metadata (``npattn.models.gguf.gguf_tokenizer``), ``--chat`` takes its ``tokenizer.chat_template``.
The tokens come from ``CausalLM.stream`` (the prompt encoded once into every layer's cache, then
one cached step per token; greedy at temperature 0, else sampled with ``--top-k``, ``--top-p``,
``--seed``; the ``eos_token_id`` of ``generation_config.json``, else of ``config.json``, ends it).
Text is printed as it grows (the decoded completion's new characters after each token); the last
line reports tokens per second.

``--chat``: the prompt is one user message, put into the model's chat template (``chat_template``
of ``tokenizer_config.json``, or ``chat_template.jinja`` beside it, which transformers prefers) as
transformers' ``apply_chat_template(..., add_generation_prompt=True)`` renders it
(``npattn.models.chat.apply_chat_template``); the text is encoded without adding special tokens
and only the reply is printed.  ``--ids``: PROMPT is token ids (``"1 5 9"`` or
``"1,5,9"``), for a model without a tokenizer: ids in, ids out, no ``tokenizers`` needed.

Every loading, config, tokenizer, template or input error is one line on stderr and exit status
2, before anything is printed.
"""

from __future__ import annotations

import os
import re
import sys
import time

import numpy as np

from .._validate import check_size

__all__ = ["stream", "main", "chat_main"]


def _eos_ids(eos, vocab_size: int, name: str = "eos_token_id") -> set:
    """``eos`` (an id, a list of ids or None) as a set of ids, each checked to be an integer in
    ``[0, vocab_size)`` (ValueError/TypeError naming ``name`` otherwise)."""
    if eos is None:
        return set()
    ids = eos if isinstance(eos, (list, tuple)) else [eos]
    for e in ids:
        check_size(e, name, minimum=0)
        if e >= vocab_size:
            raise ValueError(f"{name}: expected token ids in [0, {vocab_size}) (vocab_size), got {e}")
    return {int(e) for e in ids}


class _Failure(Exception):
    """An error of ``npattn generate`` to report as one line on stderr, exit status 2."""


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())  # a message is one line, whatever the exception held
    return text or type(e).__name__


def stream(
    model,
    prompt_ids,
    max_new_tokens,
    *,
    temperature=0.0,
    top_k=None,
    top_p=None,
    rng=None,
    eos=(),
    min_p=None,
    repetition_penalty=None,
    prompt_cache=None,
):
    """Yield up to ``max_new_tokens`` token ids after ``prompt_ids`` (a list of ints): the one row
    of ``model.stream`` (greedy at ``temperature`` 0, else sampled; ``repetition_penalty`` None:
    the checkpoint's, as ``model.stream`` takes it); stops after an id in ``eos`` (which is
    yielded; empty: none).  ``prompt_cache``: ``model.stream``'s (the caches kept between calls)."""
    sample = temperature > 0
    steps = model.stream(
        np.asarray([prompt_ids]),
        max_new_tokens,
        do_sample=sample,
        temperature=temperature if sample else 1.0,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        eos_token_id=sorted(eos),
        rng=rng,
        prompt_cache=prompt_cache,
    )
    for step in steps:
        yield int(step[0])


def main(args) -> int:
    """Run ``npattn generate``: every loading, config, tokenizer or input error is one line on
    stderr and exit status 2 (never a traceback), reported before the prompt is printed.  PROMPT
    given as several arguments (``npattn generate DIR The capital of``, ``--ids 3 1 4``) is their
    words joined by single spaces."""
    if not isinstance(args.prompt, str):
        args.prompt = " ".join(args.prompt)
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
    """The model, the tokenizer (None with ``--ids``), the prompt's ids and the eos ids, every
    check done; raises ``_Failure``."""
    if args.ids and args.chat:
        raise _Failure("--chat puts text into the chat template: it cannot be used with --ids")
    model, tokenizer, tok_path, eos = _load_model(args)
    if tokenizer is None:
        prompt_ids = _parse_ids(args.prompt)
        _check_vocab(prompt_ids, model, "PROMPT")
    else:
        conversation = [{"role": "user", "content": args.prompt}]
        prompt_ids = _encode(
            tokenizer,
            tok_path,
            _chat_text(args.directory, conversation) if args.chat else args.prompt,
            model,
            args.chat,
        )
    return model, tokenizer, prompt_ids, eos


def _encode(tokenizer, tok_path: str, text: str, model, chat: bool) -> list:
    """``text``'s ids, checked against the model's vocabulary; a chat template's text is encoded
    without adding special tokens (it wrote them itself, as transformers encodes it)."""
    try:
        ids = (tokenizer.encode(text, add_special_tokens=False) if chat else tokenizer.encode(text)).ids
    except Exception as e:
        raise _Failure(f"{tok_path}: cannot encode the prompt ({_one_line(e)})") from None
    _check_vocab(ids, model, tok_path)
    return ids


def _check_vocab(ids: list, model, where: str) -> None:
    if not ids:
        raise _Failure("the prompt encodes to no tokens")
    vocab = model.config.vocab_size
    if max(ids) >= vocab:
        raise _Failure(
            f"{where}: the prompt's token id {max(ids)} is outside the model's vocabulary [0, {vocab}) (vocab_size)"
        )


def _load_model(args):
    """The model, its tokenizer (None with ``--ids``), where the tokenizer came from and the eos
    ids, the sampling options checked; raises ``_Failure``."""
    from ..generation import _check_min_p, _check_repetition_penalty, _check_top_p, check_sampling
    from ..models import CausalLM

    try:
        check_sampling(args.temperature, args.top_k, None)
        _check_top_p(args.top_p)
        _check_min_p(args.min_p)
        _check_repetition_penalty(args.repetition_penalty)
    except (TypeError, ValueError) as e:
        raise _Failure(_one_line(e)) from None
    if os.path.isfile(args.directory):
        model, tokenizer, tok_path = _from_gguf(args.directory, not args.ids, _weights_dtype(args))
        eos_name = f"{args.directory}: tokenizer.ggml.eos_token_id"
    elif not os.path.isdir(args.directory):
        raise _Failure(f"directory: no such directory or GGUF file {args.directory!r}")
    else:
        tok_path = os.path.join(args.directory, "tokenizer.json")
        tokenizer = None if args.ids else _tokenizer(args.directory, args.chat)  # before the model: fails fast
        try:
            model = CausalLM.from_pretrained(args.directory, weights_dtype=_weights_dtype(args))
        except _LOAD_ERRORS as e:
            raise _Failure(_one_line(e)) from None
        source = "config.json" if model.generation_config is None else "generation_config.json"
        eos_name = f"{os.path.join(args.directory, source)}: eos_token_id"
    try:
        eos = _eos_ids(model.generation_defaults["eos_token_id"], model.config.vocab_size, eos_name)
    except _LOAD_ERRORS as e:
        raise _Failure(_one_line(e)) from None
    return model, tokenizer, tok_path, eos


def _weights_dtype(args):
    """``--bfloat16``: the model's ``weights_dtype``."""
    return "bfloat16" if getattr(args, "bfloat16", False) else None


def _from_gguf(path: str, with_tokenizer: bool, weights_dtype=None) -> tuple:
    """``(model, tokenizer or None, where)`` of a GGUF file; raises ``_Failure``."""
    from ..models import CausalLM

    try:
        model = CausalLM.from_gguf(path, weights_dtype=weights_dtype)
    except ImportError as e:
        raise _Failure(_one_line(e)) from None
    except _LOAD_ERRORS as e:
        raise _Failure(_one_line(e)) from None
    return model, _tokenizer(path) if with_tokenizer else None, path


def _without_tokenizer(chat: bool) -> str:
    """The way on without a tokenizer, for an error's end: the prompt as token ids (``--ids``),
    except with ``--chat``, whose template's text needs one (and which refuses ``--ids``)."""
    return "" if chat else ", or pass the prompt as token ids with --ids"


def _tokenizer(path: str, chat: bool = False):
    """The checkpoint's tokenizer (``npattn.models.chat.load_tokenizer``: a directory's
    ``tokenizer.json`` or a GGUF file's), or ``_Failure`` saying what to do."""
    from ..models.chat import load_tokenizer

    try:
        return load_tokenizer(path)
    except (ImportError, FileNotFoundError) as e:  # the package or the file: install, copy, or --ids
        raise _Failure(f"{_one_line(e)}{_without_tokenizer(chat)}") from None
    except _LOAD_ERRORS as e:
        raise _Failure(_one_line(e)) from None


def _parse_ids(prompt: str) -> list:
    """``--ids``: the token ids of PROMPT, integers separated by spaces or commas."""
    words = [w for w in re.split(r"[\s,]+", prompt) if w]
    bad = [w for w in words if not w.isdigit()]
    if bad or not words:
        got = repr(bad[0]) if bad else "nothing"
        raise _Failure(
            f"PROMPT: with --ids, expected token ids (integers >= 0 separated by spaces or commas), got {got}"
        )
    return [int(w) for w in words]


def _chat_text(path: str, conversation: list) -> str:
    """The conversation in the checkpoint's chat template, with the assistant's header after it
    (``npattn.models.chat.apply_chat_template``, as transformers renders it)."""
    from ..models.chat import apply_chat_template

    try:
        return apply_chat_template(path, conversation, add_generation_prompt=True)
    except ImportError as e:
        raise _Failure(f"--chat: {_one_line(e)}") from None
    except _LOAD_ERRORS as e:
        raise _Failure(f"--chat: {_one_line(e)}") from None


def _continuation(tokenizer, context: list, before: str, new: list) -> str:
    """The text the tokens ``new`` add after the tokens ``context`` (decoded as ``before``): the
    whole sequence's decoding past the context's, or the new tokens' own where the context's is
    not its start."""
    whole = tokenizer.decode(context + new)
    return whole[len(before) :] if whole.startswith(before) else tokenizer.decode(new)


def _sampling(args) -> dict:
    """``stream``'s sampling options from the command line."""
    return dict(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        rng=args.seed,
    )


def _show(tokens, tokenizer, context: list, out) -> list:
    """Print the text the tokens of the iterator ``tokens`` add after ``context`` as it grows (the
    ids themselves without a tokenizer); returns the tokens.  After a prompt the continuation is
    the whole sequence's decoding past the prompt's: a SentencePiece decoder strips the space that
    starts a text (Llama 2's, Phi-3's "▁the" alone is "the"), and a word level one joins words
    with spaces; a chat reply, printed alone, is its own tokens' text (an empty ``context``)."""
    new: list = []
    shown = ""
    before = tokenizer.decode(context) if tokenizer is not None and context else ""
    for token in tokens:
        new.append(token)
        if tokenizer is None:
            out.write(f" {token}")
            out.flush()
            continue
        text = _continuation(tokenizer, context, before, new)
        # print what the new token added; a byte-level token may end in the middle of a character
        # (decoded as U+FFFD until the next token completes it): hold that back
        if text.startswith(shown) and not text.endswith("\ufffd"):
            out.write(text[len(shown) :])
            out.flush()
            shown = text
    if tokenizer is not None:
        text = _continuation(tokenizer, context, before, new)
        if text.startswith(shown):  # whatever was held back
            out.write(text[len(shown) :])
    return new


def _rate(n: int, elapsed: float, reused: str = "") -> str:
    rate = n / elapsed if elapsed > 0 else float("inf")
    return f"[{n} tokens in {elapsed:.2f} s, {rate:.1f} tokens/s{reused}]"


def _run(args, model, tokenizer, prompt_ids, eos) -> int:
    """Print the prompt (not with ``--chat``: the reply alone), then the completion as it grows,
    then the tokens per second.  Without a tokenizer (``--ids``) the ids themselves."""
    out = sys.stdout
    if tokenizer is None:
        out.write(" ".join(map(str, prompt_ids)))
    elif not args.chat:
        out.write(args.prompt)
    out.flush()
    context = [] if tokenizer is None or args.chat else list(prompt_ids)
    start = time.perf_counter()
    new = _show(stream(model, prompt_ids, args.max_new_tokens, eos=eos, **_sampling(args)), tokenizer, context, out)
    out.write(f"\n{_rate(len(new), time.perf_counter() - start)}\n")
    return 0


CHAT_HELP = "/reset starts a new conversation, /exit (or end of input) ends"


def chat_main(args) -> int:
    """Run ``npattn chat``: a conversation on standard input and output.  Each line read is a user
    message; the whole conversation so far (after the ``--system`` message) goes through the chat
    template and the model, and the reply is printed as it grows, then kept as the assistant's
    message.  The model's caches are kept from turn to turn (``model.prompt_cache()``): a turn
    runs only the tokens of its prompt after what it shares with the last turn's prompt and reply
    (where the template renders the reply as it was generated, all of it; the rate line says how
    many prompt tokens were reused), with the replies of a run that encodes everything again.
    ``/reset`` empties the conversation (and the cache), ``/exit`` or the end of input ends it.  Loading
    and template errors are one line on stderr and exit status 2 before the first prompt; an
    error of one turn (its template's refusal) is reported and that message dropped."""
    args.ids, args.chat = False, True
    system = [] if args.system is None else [{"role": "system", "content": args.system}]
    try:
        model, tokenizer, tok_path, eos = _load_model(args)
        _chat_text(args.directory, system + [{"role": "user", "content": "hello"}])  # the template works
    except _Failure as e:
        print(f"npattn chat: {e}", file=sys.stderr)
        return 2
    out = sys.stdout
    out.write(f"{CHAT_HELP}\n")
    conversation = list(system)
    cache = model.prompt_cache()
    while True:
        out.write("> ")
        out.flush()
        line = sys.stdin.readline()
        if not line or line.strip() in ("/exit", "/quit"):
            out.write("\n" if not line else "")
            return 0
        message = line.strip()
        if message == "/reset":
            conversation = list(system)
            cache.reset()
            continue
        if not message:
            continue
        try:
            text = _chat_text(args.directory, conversation + [{"role": "user", "content": message}])
            ids = _encode(tokenizer, tok_path, text, model, True)
        except _Failure as e:
            print(f"npattn chat: {e}", file=sys.stderr)
            continue
        start = time.perf_counter()
        steps = stream(model, ids, args.max_new_tokens, eos=eos, prompt_cache=cache, **_sampling(args))
        new = _show(steps, tokenizer, [], out)
        reused = f", {cache.reused} of {len(ids)} prompt tokens reused" if new else ""
        out.write(f"\n{_rate(len(new), time.perf_counter() - start, reused)}\n")
        reply = tokenizer.decode([t for t in new if t not in eos])
        conversation += [{"role": "user", "content": message}, {"role": "assistant", "content": reply}]

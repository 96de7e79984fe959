"""``npattn generate DIRECTORY PROMPT``: a completion from a saved Hugging Face model, streamed.

The directory holds ``config.json``, the safetensors weights and ``tokenizer.json``; the
``tokenizers`` package (``pip install "npattn[hf]"``) turns the prompt into ids and the ids back
into text.  The prompt is encoded once into every layer's cache, then each new token is one
cached step (``CausalLM(ids, use_cache=True)``), sampled by ``npattn.generation`` (greedy at
temperature 0; ``--top-k``, ``--top-p``, ``--seed``).  Text is printed as it grows (the decoded
completion's new characters after each token); the last line reports tokens per second.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np


def _eos_ids(config) -> set:
    eos = config.eos_token_id
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


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
    try:
        from tokenizers import Tokenizer
    except ImportError:
        print("npattn generate: needs the tokenizers package (pip install 'npattn[hf]')", file=sys.stderr)
        return 1
    from ..generation import _check_top_p, check_sampling
    from ..models import CausalLM

    try:
        check_sampling(args.temperature, args.top_k, None)
        _check_top_p(args.top_p)
    except (TypeError, ValueError) as e:
        print(f"npattn generate: {e}", file=sys.stderr)
        return 2
    tok_path = os.path.join(args.directory, "tokenizer.json")
    if not os.path.isfile(tok_path):
        print(f"npattn generate: no tokenizer.json in {args.directory!r}", file=sys.stderr)
        return 1
    try:
        model = CausalLM.from_pretrained(args.directory)
    except (OSError, ValueError, TypeError) as e:
        print(f"npattn generate: {e}", file=sys.stderr)
        return 1
    tokenizer = Tokenizer.from_file(tok_path)
    prompt_ids = tokenizer.encode(args.prompt).ids
    if not prompt_ids:
        print("npattn generate: the prompt encodes to no tokens", file=sys.stderr)
        return 1
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
        eos=_eos_ids(model.config),
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

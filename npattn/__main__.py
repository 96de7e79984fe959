"""``npattn`` / ``python -m npattn``: the command line (``check``, ``demo``, ``bench``, ``generate``, ``chat``)."""

from __future__ import annotations

import argparse
import sys

from . import __version__


def _int_at_least(minimum, what):
    """An argparse type: an integer >= ``minimum`` (argparse turns the error into a usage message)."""

    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {what} integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected a {what} integer, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1, "positive")
_seed = _int_at_least(0, "non-negative")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="npattn", description="Transformer attention in pure NumPy.")
    parser.add_argument("--version", action="version", version=f"npattn {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{check,demo,bench,generate}")
    sub.required = True

    p = sub.add_parser("check", help="gradcheck every module and functional op (exit 1 on a failure)")
    p.add_argument("--seed", type=_seed, default=0, help="seed of inputs and upstream gradients (default 0)")
    p.add_argument(
        "--order",
        type=int,
        choices=(1, 2),
        default=1,
        help="1: the backward and forward mode (default); 2: the second order (backward_jvp, gradgradcheck)",
    )

    p = sub.add_parser("demo", help="train a small causal transformer on a toy task with numpy alone")
    p.add_argument(
        "--out", default="npattn-demo", help="folder for loss_curve.png and attention maps (default ./npattn-demo)"
    )
    p.add_argument("--steps", type=_positive_int, default=None, help="training steps (default: the task's)")
    p.add_argument("--seed", type=_seed, default=0, help="random seed (default 0)")
    p.add_argument(
        "--task",
        default="reverse",
        choices=("reverse", "sort", "chars"),
        help="reverse or sort digits, or chars: a GPT trained on npattn's docstrings (default reverse)",
    )

    p = sub.add_parser(
        "bench", help="timings and memory against torch when it is importable; each flag runs one section"
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--quick", action="store_true", help="small sizes only (seconds, for smoke tests)")
    from .tools.bench.cli import SECTIONS  # the sections and their flags: one list

    for section in SECTIONS:
        p.add_argument(f"--{section.name}", action="store_true", help=section.help)

    p = sub.add_parser("generate", help="complete a prompt with a saved Hugging Face model (needs tokenizers)")
    p.add_argument(
        "directory", help="a save_pretrained directory (config.json, safetensors, tokenizer.json) or a GGUF file"
    )
    p.add_argument(
        "prompt", nargs="+", help="the text to complete, one argument or several words (token ids with --ids)"
    )
    p.add_argument("--max-new-tokens", type=_positive_int, default=64, help="tokens to add (default 64)")
    _sampling_arguments(p)
    p.add_argument(
        "--chat", action="store_true", help="the prompt as a user message in the chat template of tokenizer_config.json"
    )
    p.add_argument(
        "--ids", action="store_true", help="the prompt is token ids ('1 5 9'): no tokenizer needed, ids printed"
    )

    p = sub.add_parser("chat", help="a conversation with a saved chat model on the terminal (needs tokenizers, jinja2)")
    p.add_argument(
        "directory", help="a save_pretrained directory (with tokenizer.json and a chat template) or GGUF file"
    )
    p.add_argument("--system", default=None, help="a system message opening the conversation")
    p.add_argument("--max-new-tokens", type=_positive_int, default=512, help="most tokens of a reply (default 512)")
    _sampling_arguments(p)
    return parser


def _sampling_arguments(p) -> None:
    """The options ``npattn generate`` and ``npattn chat`` share: sampling and weight storage."""
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-k", type=_positive_int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling: the most likely tokens up to mass p")
    p.add_argument(
        "--min-p", type=float, default=None, help="sample among the tokens at least p times as likely as the top one"
    )
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=None,
        help="> 1 makes the tokens already in the text less likely (default: generation_config.json's, else none)",
    )
    p.add_argument("--seed", type=_seed, default=None, help="random seed of the sampling")
    p.add_argument(
        "--bfloat16",
        action="store_true",
        help="keep the large weight matrices as bfloat16 (weights_dtype='bfloat16'): half the memory of float32",
    )


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "check":
        from .tools.check import main as run
    elif args.command == "demo":
        from .tools.demo import main as run
    elif args.command == "generate":
        from .tools.generate import main as run
    elif args.command == "chat":
        from .tools.generate import chat_main as run
    else:
        from .tools.bench import main as run
    return int(run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

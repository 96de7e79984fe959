"""Writes ``docs/api/*.rst`` from the public modules' ``__all__`` (called by ``conf.py`` at build time).

``index.rst`` lists the modules, each with its line of ``MODULES``.  One page per public module;
each name in its ``__all__`` gets an ``autofunction``/``autoclass`` entry (hence its own anchor,
``id="<module>.<name>"``) on the first page that exports it, in the order of ``MODULES``; a later
module that re-exports the same object links to that entry, under an anchor of its own
(``id="npattn.nn.Linear"`` beside the link to ``npattn.Linear``).
"""

from __future__ import annotations

import importlib
import inspect
import pathlib

MODULES = [
    ("npattn", "The top-level package: the modules, ``no_grad``, ``gradcheck``, the version."),
    ("npattn.functional", "The fast tier: every op a pair ``op(...) -> (out, cache)``, ``op_backward``, ``op_jvp``."),
    ("npattn.functional.reference", "The textbook tier: the same pairs as formulas, derivations beside the code."),
    ("npattn.nn", "Modules used like ``torch.nn``: ``y = m(x)``, ``dx = m.backward(dy)``, gradients in ``p.grad``."),
    (
        "npattn.models",
        "Whole models: ``CausalLM`` from a Hugging Face config (the families of ``SUPPORTED_MODEL_TYPES``, among"
        " them Llama 3, Mistral, Mixtral, Qwen2 to 3.5 and Qwen2-MoE, Gemma 2 to 4, GPT-OSS, DeepSeek-V3, OLMo,"
        " OLMoE, SmolLM3, Phi-3, Granite 3 and 4.0, Falcon-H1, Nemotron-H, Command R, R+ and R7B, GPT-NeoX, GPT-2,"
        " Phi-2, StableLM, StarCoder2, Arcee, Apertus, Hunyuan dense, LFM2, EXAONE 4.0, ERNIE 4.5, GLM-4,"
        " Ministral, Ministral 3"
        " and Mamba-2), a small GPT-style ``TinyTransformer``, and the tokenizer and chat template of a checkpoint.",
    ),
    ("npattn.book", "The classes and functions of *Build a Large Language Model (From Scratch)*, chapters 3-5."),
    ("npattn.optim", "Optimisers, gradient clipping and schedules."),
    ("npattn.generation", "Sampling and generation shared by every model."),
    ("npattn.masks", "Attention-mask helpers (True = may attend)."),
    ("npattn.testing", "Gradient checks and hypothesis strategies for property tests (needs hypothesis)."),
    ("npattn.viz", "Plots (needs matplotlib)."),
    ("npattn.data", "Small arrays shipped with the package: what the notebooks read."),
]


def _kind(obj) -> str | None:
    if inspect.isclass(obj):
        return "autoclass"
    if callable(obj):
        return "autofunction"
    return None


def _anchor(ident: str) -> list[str]:
    return [".. raw:: html", "", f'   <span id="{ident}"></span>', ""]


def pages() -> dict[str, str]:
    """``{module name: reStructuredText}`` for every module of ``MODULES``."""
    seen: dict[int, str] = {}
    # viewcode links a source file's objects back to "<first page's module>.<name>": give them that anchor
    first_page: dict[str, str] = {}
    out = {}
    for modname, blurb in MODULES:
        mod = importlib.import_module(modname)
        title = f"``{modname}``"
        lines = [title, "=" * len(title), "", blurb, "", f".. automodule:: {modname}", "   :no-members:", ""]
        lines += [f".. currentmodule:: {modname}", ""]
        for name in mod.__all__:
            obj = getattr(mod, name)
            kind = _kind(obj)
            if kind is None:  # a submodule or a constant: say what it is
                if inspect.ismodule(obj):
                    lines += [f"* ``{modname}.{name}``: the module ``{obj.__name__}``.", ""]
                else:
                    lines += [f".. data:: {name}", "", f"   ``{obj!r}``", ""]
                continue
            key = id(obj)
            if key in seen:
                lines += _anchor(f"{modname}.{name}")
                lines += [f"* ``{modname}.{name}``: the same object as :py:obj:`{seen[key]}`.", ""]
                continue
            seen[key] = f"{modname}.{name}"
            source = first_page.setdefault(getattr(obj, "__module__", modname), modname)
            if source != modname:
                lines += _anchor(f"{source}.{name}")
            opts = ["   :members:", "   :special-members: __call__"] if kind == "autoclass" else []
            lines += [f".. {kind}:: {name}", *opts, ""]
        out[modname] = "\n".join(lines) + "\n"
    return out


def index_page() -> str:
    """The API index (reStructuredText): every module of ``MODULES`` linked, with its line."""
    title = "API reference"
    lines = [title, "=" * len(title), ""]
    lines += ["Generated from the docstrings; every public name has its own anchor.", ""]
    for modname, blurb in MODULES:
        lines += [f"* :doc:`{modname}` — {blurb}"]
    lines += ["", ".. toctree::", "   :hidden:", ""]
    lines += [f"   {modname}" for modname, _ in MODULES]
    return "\n".join(lines) + "\n"


def write_pages(directory: pathlib.Path) -> None:
    directory.mkdir(exist_ok=True)
    for name, text in {"index": index_page(), **pages()}.items():
        path = directory / f"{name}.rst"
        if not path.exists() or path.read_text() != text:
            path.write_text(text)

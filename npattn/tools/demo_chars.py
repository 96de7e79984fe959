"""``npattn demo --task chars``: train the book's GPT character by character on npattn's own
docstrings, in NumPy, then let it write.

The text is every docstring of the installed ``npattn`` package (modules, classes, functions,
in file order), read with ``ast`` at run time: text this project wrote itself, nothing
third-party is shipped or downloaded.  The characters are the vocabulary.  The last 10% of the
text is held out; the model never trains on it and its loss is reported as the validation loss.

The model is ``npattn.book.GPTModel`` (chapter 4 of *Build a Large Language Model (From
Scratch)*) in float32; training is next-character prediction on random windows with AdamW, a
warm-up cosine schedule and gradient clipping, every gradient from the hand-written backward
passes.  Afterwards ``npattn.book.generate`` samples from it with the KV cache (temperature
0.8, top-k 10).  ``tqdm`` and ``matplotlib`` are optional (progress bar, ``loss_curve.png``).
"""

from __future__ import annotations

import ast
import os
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ._blas import single_blas_thread
from ._train import fit, loss_line, plot_losses, pyplot, save_figure, training_line, with_progress, write_pictures

__all__ = ["CharsConfig", "corpus", "CharTokenizer", "train_chars", "main"]


@dataclass(frozen=True)
class CharsConfig:
    steps: int = 800
    batch_size: int = 32
    context_length: int = 64
    emb_dim: int = 64
    n_heads: int = 4
    n_layers: int = 2
    lr: float = 3e-3
    warmup_steps: int = 50
    min_lr: float = 3e-4
    weight_decay: float = 0.01
    clip: float = 1.0
    eval_batches: int = 8
    sample_chars: int = 300
    prompt: str = "The attention "
    temperature: float = 0.8
    top_k: int = 10
    seed: int = 0


def corpus() -> str:
    """Every docstring of the npattn package, in a fixed order (sorted file paths, then ``ast``
    order), separated by blank lines."""
    import npattn

    root = os.path.dirname(os.path.abspath(npattn.__file__))
    paths = []
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        paths += [os.path.join(folder, f) for f in sorted(files) if f.endswith(".py")]
    parts = []
    for path in sorted(paths):
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    parts.append(doc)
    return "\n\n".join(parts) + "\n"


class CharTokenizer:
    """Characters <-> ids (the sorted set of the text's characters)."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        unknown = sorted(set(text) - set(self.index))
        if unknown:
            raise ValueError(f"text: characters not in the vocabulary: {unknown!r}")
        return np.array([self.index[c] for c in text], dtype=np.int64)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in np.asarray(ids).reshape(-1))


@dataclass
class CharsResult:
    model: Any
    tokenizer: CharTokenizer
    losses: np.ndarray
    val_loss: float
    sample: str
    seconds: float
    text_chars: int


def _windows(data: np.ndarray, starts: np.ndarray, n: int):
    idx = starts[:, None] + np.arange(n + 1)
    w = data[idx]
    return w[:, :-1], w[:, 1:]


def train_chars(cfg: CharsConfig, progress=None) -> CharsResult:
    """Train on ``corpus()``; ``progress(step, loss)`` after every step."""
    with single_blas_thread():
        return _train(cfg, progress)


def _train(cfg, progress):
    from .. import book
    from .. import functional as F
    from ..nn.module import no_grad

    text = corpus()
    tok = CharTokenizer(text)
    data = tok.encode(text)
    split = int(0.9 * len(data))
    train, val = data[:split], data[split:]
    rng = np.random.default_rng(cfg.seed)
    gcfg = {
        "vocab_size": tok.vocab_size,
        "context_length": cfg.context_length,
        "emb_dim": cfg.emb_dim,
        "n_heads": cfg.n_heads,
        "n_layers": cfg.n_layers,
        "drop_rate": 0.0,
        "qkv_bias": False,
    }
    model = book.GPTModel(gcfg, rng=rng, dtype=np.float32)
    for emb in (model.tok_emb, model.pos_emb):  # GPT-2's N(0, 0.02) tables train faster than torch's N(0, 1)
        emb.weight.data *= np.float32(0.02)
    one = np.ones((), np.float32)

    def loss_and_grad():  # next-character prediction on random windows
        x, y = _windows(train, rng.integers(0, len(train) - cfg.context_length - 1, cfg.batch_size), cfg.context_length)
        loss, cache = F.cross_entropy(model(x), y)
        return float(loss), F.cross_entropy_backward(one, cache)

    start = time.perf_counter()
    losses = fit(model, cfg, loss_and_grad, progress)
    model.eval()
    vrng = np.random.default_rng(12345)  # the same validation windows for every run
    with no_grad():
        val_losses = []
        for _ in range(cfg.eval_batches):
            x, y = _windows(
                val, vrng.integers(0, len(val) - cfg.context_length - 1, cfg.batch_size), cfg.context_length
            )
            val_losses.append(float(F.cross_entropy(model(x), y)[0]))
    seconds = time.perf_counter() - start
    prompt = tok.encode(cfg.prompt)[None, -cfg.context_length :]
    out = book.generate(
        model,
        prompt,
        cfg.sample_chars,
        cfg.context_length,
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        rng=cfg.seed,
        use_cache=True,
    )
    return CharsResult(model, tok, losses, float(np.mean(val_losses)), tok.decode(out[0]), seconds, len(text))


def save_loss_curve(result: CharsResult, out_dir: str) -> str:
    plt = pyplot(out_dir)
    fig, ax = plt.subplots(figsize=(6, 4))
    plot_losses(ax, result.losses, "training loss per step", 40)
    ax.axhline(result.val_loss, color="C1", ls="--", lw=1.2, label=f"held-out loss {result.val_loss:.3f}")
    ax.axhline(
        np.log(result.tokenizer.vocab_size),
        color="0.5",
        ls=":",
        lw=1,
        label=f"uniform guess, ln {result.tokenizer.vocab_size}",
    )
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy per character (nats)")
    ax.set_title("GPTModel on npattn's docstrings, character level")
    ax.legend()
    fig.tight_layout()
    return save_figure(plt, fig, out_dir, "loss_curve.png")


def main(args) -> int:
    cfg = CharsConfig(seed=args.seed)
    if args.steps is not None:
        cfg = replace(cfg, steps=args.steps)
    text = corpus()
    tok = CharTokenizer(text)
    print(
        f"task chars: next-character prediction on npattn's own docstrings ({len(text)} characters, "
        f"{tok.vocab_size} distinct; the last 10% held out)"
    )
    print(
        f"model: npattn.book.GPTModel, {cfg.n_layers} layers, {cfg.n_heads} heads, emb_dim {cfg.emb_dim}, "
        f"context {cfg.context_length}, float32"
    )
    print(training_line(cfg, "windows"))
    result = with_progress(train_chars, cfg)
    print(f"parameters: {result.model.num_parameters()}")
    write_pictures("loss curve", lambda out: [save_loss_curve(result, out)], args.out)
    print(f"sample (temperature {cfg.temperature:g}, top-k {cfg.top_k}, KV cache):")
    print("-" * 72)
    print(result.sample)
    print("-" * 72)
    print(f"time: {result.seconds:.1f} s")
    print(loss_line(result.losses))
    print(f"final loss: {result.val_loss:.4f} (held-out cross-entropy per character, nats)")
    return 0

"""``npattn demo``: train a small causal transformer on a toy sequence task, with numpy alone.

The task shows a digit sequence, a separator and the answer, e.g. for ``reverse``::

    3 1 4 1 5 9 2 6 | 6 2 9 5 1 4 1 3

and the model learns, by next-token prediction on the answer positions only (the prompt
targets are ``ignore_index``), to produce the answer one token at a time.  Reversal cannot be
done without attention: answer token ``i`` must look ``2 i + 1`` positions back, and the attention
maps show the anti-diagonal the heads learn.  ``sort`` (the digits in increasing order) needs
counting instead.

Training uses teacher forcing, AdamW, a warm-up cosine learning-rate schedule, gradient
clipping and float32.  Accuracy is measured on a fixed held-out set of sequences that never
appear in a training batch, by **greedy autoregressive decoding** of the whole answer (the model
reads only the prompt and its own previous outputs), and counts a sequence as correct only when
every answer token is right (exact match).

All randomness (weights, held-out set, batches) comes from one ``np.random.default_rng(seed)``:
the same ``--seed`` prints the same numbers.  ``tqdm`` (progress bar) and ``matplotlib``
(pictures) are optional and imported lazily: ``pip install "npattn[demo]"`` (from a clone:
``pip install ".[demo]"``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from ._blas import single_blas_thread
from ._train import fit, loss_line, plot_losses, pyplot, save_figure, training_line, with_progress, write_pictures

if TYPE_CHECKING:  # pragma: no cover - for the annotations only
    from ..models import TinyTransformer

SEP = 10  # token id of the separator; digits are 0..9
VOCAB_SIZE = 11
IGNORE_INDEX = -100
TOKEN_LABELS = [str(d) for d in range(10)] + ["|"]

__all__ = ["DemoConfig", "TASKS", "make_examples", "HeldOutSet", "train", "main", "single_blas_thread"]


@dataclass(frozen=True)
class DemoConfig:
    """Everything that defines a run (the defaults are the ``reverse`` task's)."""

    task: str = "reverse"
    n_digits: int = 8
    steps: int = 600
    batch_size: int = 64
    d_model: int = 64
    num_heads: int = 4
    num_layers: int = 2
    d_ff: int = 256
    lr: float = 3e-3
    warmup_steps: int = 100
    min_lr: float = 1e-4
    weight_decay: float = 0.01
    clip: float = 1.0
    held_out: int = 1000
    seed: int = 0


# default settings of each task (``--steps`` overrides ``steps``)
TASKS = {
    "reverse": DemoConfig(task="reverse"),
    "sort": DemoConfig(task="sort", steps=800),
}


# -- data --------------------------------------------------------------------------------------
def answer_of(digits: np.ndarray, task: str) -> np.ndarray:
    """The answer digits of each row of ``digits (N, n)``."""
    if task == "reverse":
        return digits[:, ::-1]
    if task == "sort":
        return np.sort(digits, axis=1)
    raise ValueError(f"task: expected one of {sorted(TASKS)}, got {task!r}")


def make_examples(digits: np.ndarray, task: str):
    """``digits (N, n)`` -> ``(ids, targets)``, both ``(N, 2 n)``.

    The full sequence is ``digits, SEP, answer`` (``2 n + 1`` tokens); ``ids`` drops its last
    token and ``targets`` its first (next-token prediction).  Only the ``n`` answer tokens are
    predicted: the targets of the prompt positions are ``IGNORE_INDEX``.
    """
    n = digits.shape[1]
    full = np.concatenate([digits, np.full((len(digits), 1), SEP), answer_of(digits, task)], axis=1)
    ids, targets = full[:, :-1], full[:, 1:].copy()
    targets[:, :n] = IGNORE_INDEX
    return ids, targets


def _keys(digits: np.ndarray) -> np.ndarray:
    """Each row of digits read as one base-10 integer (its identity, for held-out exclusion)."""
    return digits @ (10 ** np.arange(digits.shape[1], dtype=np.int64))


class HeldOutSet:
    """``size`` distinct random digit sequences, and a sampler of training batches without them."""

    def __init__(self, rng: np.random.Generator, n_digits: int, size: int):
        digits = rng.integers(0, 10, size=(size, n_digits))
        _, first = np.unique(_keys(digits), return_index=True)
        self.digits = digits[np.sort(first)]
        self._keys = np.sort(_keys(self.digits))
        self.n_digits = n_digits

    def contains(self, digits: np.ndarray) -> np.ndarray:
        k = _keys(digits)
        pos = np.minimum(np.searchsorted(self._keys, k), len(self._keys) - 1)
        return self._keys[pos] == k

    def training_digits(self, rng: np.random.Generator, batch_size: int) -> np.ndarray:
        """A batch of random digit sequences, none of them in the held-out set."""
        digits = rng.integers(0, 10, size=(batch_size, self.n_digits))
        while True:
            seen = self.contains(digits)
            if not seen.any():
                return digits
            digits[seen] = rng.integers(0, 10, size=(int(seen.sum()), self.n_digits))


# -- training ----------------------------------------------------------------------------------
@dataclass
class DemoResult:
    model: "TinyTransformer"
    losses: np.ndarray
    accuracy: float
    token_accuracy: float
    held_out: HeldOutSet
    seconds: float


def evaluate(model, digits: np.ndarray, task: str):
    """Greedy autoregressive decoding of the answers of ``digits``.
    Returns ``(exact-match accuracy, per-token accuracy)``."""
    n = digits.shape[1]
    prompt = np.concatenate([digits, np.full((len(digits), 1), SEP)], axis=1)
    predicted = model.generate(prompt, n)[:, n + 1 :]
    correct = predicted == answer_of(digits, task)
    return float(correct.all(axis=1).mean()), float(correct.mean())


def build_model(cfg: DemoConfig, rng):
    from ..models import TinyTransformer

    return TinyTransformer(
        VOCAB_SIZE, 2 * cfg.n_digits, cfg.d_model, cfg.num_heads, cfg.num_layers, cfg.d_ff, rng=rng, dtype=np.float32
    )


def train(cfg: DemoConfig, progress=None) -> DemoResult:
    """Train on ``cfg.task`` and evaluate on the held-out set.  ``progress(step, loss)`` is
    called after every step (for a progress bar)."""
    with single_blas_thread():
        return _train(cfg, progress)


def _train(cfg, progress):
    rng = np.random.default_rng(cfg.seed)
    model = build_model(cfg, rng)
    held_out = HeldOutSet(rng, cfg.n_digits, cfg.held_out)

    def loss_and_grad():  # teacher forcing on a batch, the prompt positions ignored
        ids, targets = make_examples(held_out.training_digits(rng, cfg.batch_size), cfg.task)
        return model.loss(ids, targets, ignore_index=IGNORE_INDEX)

    start = time.perf_counter()
    losses = fit(model, cfg, loss_and_grad, progress)
    accuracy, token_accuracy = evaluate(model, held_out.digits, cfg.task)
    return DemoResult(model, losses, accuracy, token_accuracy, held_out, time.perf_counter() - start)


# -- pictures ----------------------------------------------------------------------------------
def save_pictures(result: DemoResult, cfg: DemoConfig, out_dir: str):
    """Write ``loss_curve.png`` and ``attention_layer{l}.png`` (every head of layer ``l`` for
    one held-out example).  Returns the file names written."""
    plt = pyplot(out_dir)
    fig, ax = plt.subplots(figsize=(6, 4))
    plot_losses(ax, result.losses, "loss per step", 50)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy on the answer tokens")
    ax.set_title(f"{cfg.task}, {cfg.n_digits} digits: held-out exact match {result.accuracy:.3f}")
    ax.legend()
    fig.tight_layout()
    written = [save_figure(plt, fig, out_dir, "loss_curve.png")]

    ids, _ = make_examples(result.held_out.digits[:1], cfg.task)
    weights = result.model.attention_weights(ids)[:, 0]  # (layers, heads, L, L)
    labels = [TOKEN_LABELS[t] for t in ids[0]]
    L = len(labels)
    for layer, per_head in enumerate(weights, start=1):
        heads = len(per_head)
        fig, axes = plt.subplots(1, heads, figsize=(3.2 * heads, 4.0), squeeze=False, layout="constrained")
        for h, ax in enumerate(axes[0]):
            ax.imshow(per_head[h], cmap="viridis", vmin=0.0, vmax=1.0)
            ax.set_title(f"head {h + 1}")
            ax.set_xticks(range(L), labels, fontsize=7)
            ax.set_yticks(range(L), labels, fontsize=7)
            ax.set_xlabel("key (attended token)")
            if h == 0:
                ax.set_ylabel("query (current token)")
        fig.suptitle(f"{cfg.task}: attention of layer {layer}, held-out example {' '.join(labels)}")
        written.append(save_figure(plt, fig, out_dir, f"attention_layer{layer}.png"))
    return written


# -- command line ------------------------------------------------------------------------------
def main(args) -> int:
    if args.task == "chars":
        from .demo_chars import main as chars_main

        return chars_main(args)
    cfg = TASKS[args.task]
    cfg = replace(cfg, seed=args.seed, steps=args.steps if args.steps is not None else cfg.steps)
    n_params = build_model(cfg, 0).num_parameters()
    example = np.array([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3][: cfg.n_digits]])
    full = np.concatenate([example[0], [SEP], answer_of(example, cfg.task)[0]])
    print(
        f"task {cfg.task}: {cfg.n_digits} random digits, separator, answer "
        f"(e.g. {' '.join(TOKEN_LABELS[t] for t in full)})"
    )
    print(
        f"model: causal transformer, {cfg.num_layers} layers, {cfg.num_heads} heads, d_model {cfg.d_model}, "
        f"d_ff {cfg.d_ff}, {n_params} parameters, float32"
    )
    print(training_line(cfg, "sequences"))
    result = with_progress(train, cfg)
    print(loss_line(result.losses))
    print(f"time: {result.seconds:.1f} s")
    write_pictures("pictures", lambda out: save_pictures(result, cfg, out), args.out)

    print(
        f"held-out: {len(result.held_out.digits)} sequences never trained on, answers decoded greedily "
        f"token by token; per-token accuracy {result.token_accuracy:.3f}; "
        f"accuracy below = exact match of the whole answer"
    )
    print(f"accuracy: {result.accuracy:.3f}")
    return 0

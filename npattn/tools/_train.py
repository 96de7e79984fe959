"""What both demos (``demo.py``, ``demo_chars.py``) share: the training loop (AdamW, warm-up
cosine schedule, gradient clipping), its progress bar and lines of output, and the loss curve.
(One BLAS thread for their tiny matrices: ``_blas.single_blas_thread``.)"""

from __future__ import annotations

import os
import sys

import numpy as np

from .._hints import install_hint


def smooth(x: np.ndarray, window: int) -> np.ndarray:
    """The means of ``window`` consecutive values of ``x`` (``len(x) - window + 1`` of them)."""
    from ..viz import _moving_average  # per-window sums: one NaN/inf spoils only its windows

    window = max(1, min(window, len(x)))
    return _moving_average(x, window)[window - 1 :]


class Progress:
    """A tqdm bar on stderr showing the loss, or (without tqdm) ten plain lines on stdout."""

    def __init__(self, steps: int):
        self.steps = steps
        self.every = max(1, steps // 10)
        self.avg: "float | None" = None
        try:
            from tqdm import tqdm
        except ImportError:
            self.bar = None
            print(f"(install tqdm for a progress bar: {install_hint('demo')})")
        else:
            self.bar = tqdm(total=steps, desc="training", unit="step", file=sys.stderr, mininterval=0.5)

    def __call__(self, step: int, loss: float):
        self.avg = loss if self.avg is None else 0.95 * self.avg + 0.05 * loss
        if self.bar is not None:
            self.bar.update(1)
            if step % 10 == 0 or step == self.steps - 1:
                self.bar.set_postfix(loss=f"{self.avg:.4f}", refresh=False)
        elif (step + 1) % self.every == 0 or step == self.steps - 1:
            print(f"step {step + 1:5d}/{self.steps}  loss {self.avg:.4f}", flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def fit(model, cfg, loss_and_grad, progress=None) -> np.ndarray:
    """``cfg.steps`` steps of AdamW (``cfg.lr``, ``cfg.weight_decay``) under a warm-up cosine schedule
    (``cfg.warmup_steps`` up to ``cfg.lr``, down to ``cfg.min_lr``) with the gradients clipped to
    ``cfg.clip``: ``loss_and_grad()`` draws a batch and returns ``(loss, dlogits)``, which the model's
    backward takes.  ``progress(step, loss)`` after every step; returns the losses."""
    from ..optim import AdamW, WarmupCosine, clip_grad_norm_

    opt = AdamW(model, lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = WarmupCosine(
        opt, warmup_steps=min(cfg.warmup_steps, cfg.steps), total_steps=cfg.steps, min_lr=min(cfg.min_lr, cfg.lr)
    )
    losses = np.empty(cfg.steps)
    for step in range(cfg.steps):
        opt.zero_grad()
        loss, dlogits = loss_and_grad()
        model.backward(dlogits)
        clip_grad_norm_(model, cfg.clip)
        opt.step()
        sched.step()
        losses[step] = loss
        if progress is not None:
            progress(step, loss)
    return losses


def training_line(cfg, batch_of: str) -> str:
    """The line that describes ``fit``'s run (``batch_of``: what a batch holds)."""
    return (
        f"training: {cfg.steps} steps of {cfg.batch_size} {batch_of}, AdamW lr {cfg.lr:g} "
        f"(warm-up {min(cfg.warmup_steps, cfg.steps)}, cosine), grad clip {cfg.clip:g}, seed {cfg.seed}"
    )


def with_progress(train, cfg):
    """``train(cfg, progress)`` with a ``Progress`` of ``cfg.steps`` steps, closed however it ends."""
    progress = Progress(cfg.steps)
    try:
        return train(cfg, progress)
    finally:
        progress.close()


def loss_line(losses: np.ndarray) -> str:
    """The first step's loss and the mean of the last 50 (or fewer)."""
    last = min(50, len(losses))
    return (
        f"training loss: {losses[0]:.4f} at the first step, {losses[-last:].mean():.4f} on average over the last {last}"
    )


def write_pictures(what: str, save, out_dir: str) -> None:
    """``save(out_dir)`` (the names of the files it wrote) when matplotlib is installed; one line
    says what was written, or why nothing was."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"matplotlib is not installed: no {what} written ({install_hint('demo')})")
        return
    try:
        written = save(out_dir)
    except OSError as e:
        print(f"could not write the {what} to {out_dir}: {e}")
    else:
        print(f"wrote {', '.join(written)} to {out_dir}")


def pyplot(out_dir: str):
    """``matplotlib.pyplot`` on the Agg backend, ``out_dir`` created."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    return plt


def plot_losses(ax, losses: np.ndarray, label: str, windows: int) -> None:
    """``losses`` per step, faint, and their mean over ``len(losses) // windows`` steps."""
    steps = np.arange(1, len(losses) + 1)
    ax.plot(steps, losses, color="0.75", lw=0.8, label=label)
    window = max(1, len(losses) // windows)
    if window > 1:
        ax.plot(steps[window - 1 :], smooth(losses, window), color="C0", lw=1.5, label=f"mean of {window} steps")


def save_figure(plt, fig, out_dir: str, name: str) -> str:
    """``fig`` written to ``out_dir/name`` (100 dpi) and closed; returns ``name``."""
    fig.savefig(os.path.join(out_dir, name), dpi=100)
    plt.close(fig)
    return name

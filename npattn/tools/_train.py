"""What both demos (``demo.py``, ``demo_chars.py``) share: the training progress bar and the
smoothed loss curve.  (One BLAS thread for their tiny matrices: ``_blas.single_blas_thread``.)"""

from __future__ import annotations

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

"""Hugging Face modules as float64 oracles.

``transformers`` computes RoPE frequencies with ``dtype=torch.float`` (float32) and its eager
attention and RMSNorms upcast to ``torch.float32``; in float64 tests those upcasts would be
*down*casts.  ``float64_torch(monkeypatch, *modules)`` replaces the ``torch`` each given module
sees by a proxy whose ``float``/``float32`` are ``torch.float64`` (everything else is torch's), so
the same code runs in float64; ``default_float64()`` makes float64 torch's default dtype for a
block (integer tensors times Python floats, e.g. the dynamic NTK base at a tensor ``seq_len``).
Tensor methods (``x.float()``) are not affected: the tests patch those classes where they matter
and say so.
"""

import contextlib
import importlib


class _Float64Torch:
    def __init__(self, torch):
        self._torch = torch
        self.float = torch.float64
        self.float32 = torch.float64

    def __getattr__(self, name):
        return getattr(self._torch, name)


def float64_torch(monkeypatch, *module_names):
    """Patch ``torch`` inside each module (dotted names under ``transformers``)."""
    import torch

    proxy = _Float64Torch(torch)
    for name in module_names:
        monkeypatch.setattr(importlib.import_module(f"transformers.{name}"), "torch", proxy)
    return proxy


@contextlib.contextmanager
def default_float64():
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)

"""transformers' own models as oracles for ``npattn.models.CausalLM``, in float64 throughout.

transformers upcasts to float32 in places (softmax ``dtype=torch.float32``, RMSNorm's
``.to(torch.float32)``, RoPE's ``.float()`` angles and float32 inverse frequencies, the MoE
routers' ``.type(torch.float32)``, DeltaNet's ``.to(torch.float32)``).  In a float64 model those
casts would round the reference to float32 precision, so ``float64_reference()`` turns every cast
to float32 (and every float32 factory) into float64 while the reference is built and run: the
reference then computes the same formulas in float64, and the comparison can hold to 1e-9
instead of being loosened to float32's 1e-6.
"""

from __future__ import annotations

import contextlib
import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

F32, F64 = torch.float32, torch.float64


def _dt(d):
    return F64 if d is F32 else d


@contextlib.contextmanager
def float64_reference():
    """Every float32 cast / factory inside becomes float64; default dtype float64."""
    T = torch.Tensor
    orig = {"to": T.to, "float": T.float, "type": T.type}
    sm = torch.nn.functional.softmax
    factories = {n: getattr(torch, n) for n in ("arange", "zeros", "ones", "tensor", "full", "empty", "linspace")}

    def to(self, *args, **kwargs):
        args = tuple(_dt(a) if isinstance(a, torch.dtype) else a for a in args)
        if "dtype" in kwargs:
            kwargs["dtype"] = _dt(kwargs["dtype"])
        return orig["to"](self, *args, **kwargs)

    def flt(self, *args, **kwargs):
        return orig["to"](self, F64)

    def typ(self, dtype=None, *args, **kwargs):
        if dtype is None:
            return orig["type"](self)
        return orig["type"](self, _dt(dtype), *args, **kwargs)

    def softmax(input, dim=None, _stacklevel=3, dtype=None):
        return sm(input, dim=dim, dtype=_dt(dtype) if dtype is not None else None)

    def factory(f):
        @functools.wraps(f)
        def g(*args, **kwargs):
            if "dtype" in kwargs:
                kwargs["dtype"] = _dt(kwargs["dtype"])
            return f(*args, **kwargs)

        return g

    prev = torch.get_default_dtype()
    torch.set_default_dtype(F64)
    T.to, T.float, T.type = to, flt, typ
    torch.nn.functional.softmax = softmax
    for n, f in factories.items():
        setattr(torch, n, factory(f))
    try:
        yield
    finally:
        T.to, T.float, T.type = orig["to"], orig["float"], orig["type"]
        torch.nn.functional.softmax = sm
        for n, f in factories.items():
            setattr(torch, n, f)
        torch.set_default_dtype(prev)


def randomize(model, seed: int = 0, scale: float = 0.2) -> None:
    """Every parameter (and float buffer of the state dict) drawn N(0, scale²); norm weights
    around their own centre (1 for ``w`` norms, 0 for Gemma's ``1 + w``), so that every
    gradient path carries signal."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=p.dtype) * scale
            p.copy_(p + noise)
        persistent = set(model.state_dict())
        for name, b in model.named_buffers():  # e.g. DeepSeek-V3's e_score_correction_bias (choice only)
            if name in persistent and b.dtype.is_floating_point:
                b.copy_(torch.randn(b.shape, generator=g, dtype=b.dtype) * scale)


def build(config_cls, model_cls, seed: int = 0, **kwargs):
    """``(hf_model float64 eager, config dict)`` with random weights, built under ``float64_reference``."""
    cfg = config_cls(**kwargs)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    with float64_reference():
        torch.manual_seed(seed)
        model = model_cls(cfg).double().eval()
        randomize(model, seed)
    return model, cfg.to_dict()


def hf_logits_and_grads(model, ids: np.ndarray, dlogits: np.ndarray):
    """transformers' logits and every parameter's gradient of ``sum(logits * dlogits)``."""
    model.zero_grad()
    with float64_reference():
        out = model(input_ids=torch.from_numpy(ids), use_cache=False).logits
        out.backward(torch.from_numpy(dlogits))
    grads = {n: p.grad.detach().numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach().numpy(), grads


def state_dict(model) -> dict:
    """The model's state dict as numpy arrays (float64)."""
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))

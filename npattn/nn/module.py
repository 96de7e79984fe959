"""``Parameter``, ``Module`` and ``no_grad``: the small protocol every layer follows.

A module's ``forward`` calls pure functional pairs, keeps their cache in ``self._cache`` and
returns the output; ``backward(dy)`` takes that cache (releasing it), returns the gradient with
respect to the input(s) and *adds* each parameter's gradient into ``param.grad``.
"""
from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict

import numpy as np

from .._validate import as_float, check_bool, check_dtype, check_grad, to_numpy

__all__ = ["Parameter", "Module", "ModuleList", "no_grad", "is_grad_enabled"]

_state = threading.local()


def is_grad_enabled() -> bool:
    """False inside ``no_grad()``: modules then keep no forward state (no caches)."""
    return getattr(_state, "grad_enabled", True)


@contextlib.contextmanager
def no_grad():
    """Run forward passes without keeping what backward needs (inference: no (L, L) caches held).

    Thread-local, re-entrant.  ``backward`` after a forward run under ``no_grad`` raises
    ``RuntimeError``.
    """
    prev = is_grad_enabled()
    _state.grad_enabled = False
    try:
        yield
    finally:
        _state.grad_enabled = prev


class Parameter:
    """A trainable array: ``.data`` and ``.grad`` (same shape and dtype; grad starts at zero)."""

    __slots__ = ("data", "grad")

    def __init__(self, data, dtype=None):
        data = as_float(data, "data")  # bool, complex, string, object: TypeError
        data = np.array(data, dtype=dtype, copy=True)
        if data.dtype.kind != "f":
            data = data.astype(np.float64)
        self.data = data
        self.grad = np.zeros_like(data)

    @property
    def shape(self):
        return self.data.shape

    @property
    def dtype(self):
        return self.data.dtype

    def zero_grad(self):
        self.grad[...] = 0

    def __repr__(self):
        return f"Parameter(shape={self.data.shape}, dtype={self.data.dtype})"


class Module:
    """Base class.  Subclasses set parameters/submodules as attributes and implement
    ``forward`` (storing one cache with ``self._save(cache)``) and ``backward``."""

    def __init__(self):
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_buffers", OrderedDict())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "_cache", None)
        object.__setattr__(self, "_dy_spec", None)
        object.__setattr__(self, "training", True)

    # -- registration ---------------------------------------------------------------------
    def __setattr__(self, name, value):
        if "_parameters" not in self.__dict__:
            raise RuntimeError(f"{type(self).__name__}.__init__ must call super().__init__() first")
        for d in (self._parameters, self._modules, self._buffers):
            d.pop(name, None)
        if isinstance(value, Parameter):
            self._parameters[name] = value
        elif isinstance(value, Module):
            self._modules[name] = value
        object.__setattr__(self, name, value)

    def register_buffer(self, name: str, value) -> None:
        """A non-trainable array saved in ``state_dict`` (e.g. the book's causal ``mask``)."""
        value = np.asarray(value)
        self._buffers[name] = None
        object.__setattr__(self, name, value)

    # -- forward / backward protocol -------------------------------------------------------
    def __call__(self, *args, **kwargs):
        out = self.forward(*args, **kwargs)
        if self._cache is not None:  # remember what ``backward(dy)`` must receive (see _check_dy)
            y = out[0] if isinstance(out, tuple) and out else out
            if isinstance(y, np.ndarray):
                object.__setattr__(self, "_dy_spec", (y.shape, y.dtype))
        return out

    def forward(self, *args, **kwargs):  # pragma: no cover - abstract
        raise NotImplementedError

    def backward(self, dy):  # pragma: no cover - abstract
        raise NotImplementedError

    def _save(self, cache) -> None:
        """Keep the forward state for one backward (nothing is kept under ``no_grad``)."""
        object.__setattr__(self, "_dy_spec", None)  # set again by __call__ once the output exists
        object.__setattr__(self, "_cache", cache if is_grad_enabled() else None)
        if not is_grad_enabled():
            object.__setattr__(self, "_nograd_forward", True)
        else:
            object.__setattr__(self, "_nograd_forward", False)

    def _pop(self):
        """Take (and release) the forward state; RuntimeError when there is none."""
        cache = self._cache
        if cache is None:
            if getattr(self, "_nograd_forward", False):
                raise RuntimeError(
                    f"{type(self).__name__}.backward: the last forward ran under no_grad(), nothing was kept"
                )
            raise RuntimeError(
                f"{type(self).__name__}.backward: no forward state to use; call the module first "
                "(backward releases the state, so each forward allows one backward)"
            )
        object.__setattr__(self, "_cache", None)
        object.__setattr__(self, "_dy_spec", None)
        return cache

    def _check_dy(self, dy, name: str = "dy"):
        """Validate the upstream gradient *before* the forward state is taken (so a bad ``dy``
        neither releases the state nor adds anything into ``.grad``).

        ``RuntimeError`` when there is no forward state (as ``_pop``); ``TypeError`` for a
        non-numeric ``dy``; ``ValueError("dy: expected shape <output shape> ..., got <shape>")``
        for a wrongly shaped one.  Returns ``dy`` cast to the output's dtype.  When the module
        was run as ``m.forward(...)`` instead of ``m(...)`` the output shape is unknown here and
        ``dy`` is returned as it is (the functional backward still checks it).
        """
        if self._cache is None:
            self._pop()  # raises the protocol's RuntimeError
        spec = self.__dict__.get("_dy_spec")
        if spec is None:
            return dy
        return check_grad(dy, spec[0], spec[1], name)

    @staticmethod
    def _accumulate(param: Parameter, grad) -> None:
        if grad is not None:
            param.grad += grad

    # -- traversal --------------------------------------------------------------------------
    def named_modules(self, prefix: str = ""):
        yield prefix, self
        for name, m in self._modules.items():
            yield from m.named_modules(f"{prefix}.{name}" if prefix else name)

    def modules(self):
        for _, m in self.named_modules():
            yield m

    def children(self):
        return iter(self._modules.values())

    def named_parameters(self, prefix: str = ""):
        """``(dotted_name, Parameter)`` in registration order, own parameters first."""
        for name, p in self._parameters.items():
            yield (f"{prefix}.{name}" if prefix else name), p
        for name, m in self._modules.items():
            yield from m.named_parameters(f"{prefix}.{name}" if prefix else name)

    def parameters(self):
        for _, p in self.named_parameters():
            yield p

    def named_buffers(self, prefix: str = ""):
        for name in self._buffers:
            yield (f"{prefix}.{name}" if prefix else name), getattr(self, name)
        for name, m in self._modules.items():
            yield from m.named_buffers(f"{prefix}.{name}" if prefix else name)

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.zero_grad()

    def train(self, mode: bool = True):
        mode = check_bool(mode, "mode")
        for m in self.modules():
            object.__setattr__(m, "training", bool(mode))
        return self

    def eval(self):
        return self.train(False)

    @property
    def dtype(self):
        return getattr(self, "_dtype", np.dtype(np.float64))

    def to(self, dtype):
        """Cast every parameter (data and grad) and float buffer to ``dtype`` in place; returns self."""
        dt = check_dtype(dtype)
        for m in self.modules():
            object.__setattr__(m, "_dtype", dt)
            object.__setattr__(m, "_cache", None)
            object.__setattr__(m, "_dy_spec", None)
            for p in m._parameters.values():
                p.data = p.data.astype(dt)
                p.grad = p.grad.astype(dt)
            for name in m._buffers:
                b = getattr(m, name)
                if b.dtype.kind == "f":
                    object.__setattr__(m, name, b.astype(dt))
        return self

    def num_parameters(self) -> int:
        return sum(p.data.size for p in self.parameters())

    # -- state dicts -----------------------------------------------------------------------
    def _state_entries(self, prefix: str = ""):
        """torch's order: own parameters, own buffers, then each child."""
        for name, p in self._parameters.items():
            yield (f"{prefix}.{name}" if prefix else name), self, name, True
        for name in self._buffers:
            yield (f"{prefix}.{name}" if prefix else name), self, name, False
        for name, m in self._modules.items():
            yield from m._state_entries(f"{prefix}.{name}" if prefix else name)

    def state_dict(self) -> "OrderedDict[str, np.ndarray]":
        """``{name: copy}`` of every parameter and buffer."""
        out = OrderedDict()
        for key, owner, name, is_param in self._state_entries():
            arr = owner._parameters[name].data if is_param else getattr(owner, name)
            out[key] = np.array(arr, copy=True)
        return out

    def load_state_dict(self, state_dict, strict: bool = True):
        """Copy values from ``state_dict`` (any array-likes: numpy arrays, CPU torch tensors).

        Atomic: every key, shape and dtype is checked first; on a missing, unexpected or wrongly
        shaped key a ``ValueError`` names the key(s) and nothing is changed.  With
        ``strict=False`` missing and unexpected keys are allowed (and returned) but shapes are
        still checked.  Returns ``(missing_keys, unexpected_keys)``.
        """
        if not hasattr(state_dict, "keys") or not hasattr(state_dict, "__getitem__"):
            raise TypeError(f"state_dict: expected a mapping of names to arrays, got {type(state_dict).__name__}")
        strict = check_bool(strict, "strict")
        entries = {key: (owner, name, is_param) for key, owner, name, is_param in self._state_entries()}
        missing = [k for k in entries if k not in state_dict]
        unexpected = [k for k in state_dict.keys() if k not in entries]
        problems = []
        if strict and missing:
            problems.append(f"missing keys {missing}")
        if strict and unexpected:
            problems.append(f"unexpected keys {unexpected}")
        staged = []
        for key, (owner, name, is_param) in entries.items():
            if key not in state_dict:
                continue
            try:
                arr = to_numpy(state_dict[key])
            except Exception as e:
                problems.append(f"key {key!r}: cannot convert to an array ({e})")
                continue
            current = owner._parameters[name].data if is_param else getattr(owner, name)
            if arr.dtype.kind not in "fiub":
                problems.append(f"key {key!r}: expected a numeric array, got dtype {arr.dtype}")
                continue
            if arr.shape != current.shape:
                problems.append(f"key {key!r}: expected shape {current.shape}, got {arr.shape}")
                continue
            staged.append((owner, name, is_param, arr))
        if problems:
            raise ValueError("load_state_dict: nothing was loaded; " + "; ".join(problems))
        for owner, name, is_param, arr in staged:
            if is_param:
                p = owner._parameters[name]
                p.data[...] = arr.astype(p.data.dtype, copy=False)
            else:
                cur = getattr(owner, name)
                object.__setattr__(owner, name, np.array(arr, dtype=cur.dtype, copy=True))
        return missing, unexpected

    def save(self, path) -> None:
        """Write ``state_dict()`` to an ``.npz`` file."""
        np.savez(path, **self.state_dict())

    def load(self, path, strict: bool = True):
        """Load an ``.npz`` written by ``save`` (atomic, as ``load_state_dict``)."""
        with np.load(path, allow_pickle=False) as f:
            return self.load_state_dict({k: f[k] for k in f.files}, strict=strict)

    # -- repr ------------------------------------------------------------------------------
    def extra_repr(self) -> str:
        return ""

    def __repr__(self):
        lines = [f"{type(self).__name__}({self.extra_repr()}"]
        if self._modules:
            for name, m in self._modules.items():
                sub = repr(m).replace("\n", "\n  ")
                lines.append(f"  ({name}): {sub}")
            return "\n".join(lines) + "\n)"
        return lines[0] + ")"


class ModuleList(Module):
    """A list of submodules, named ``0``, ``1``, ... in state dicts (as ``torch.nn.ModuleList``)."""

    def __init__(self, modules=()):
        super().__init__()
        for i, m in enumerate(modules):
            self.append(m)

    def append(self, m: Module):
        if not isinstance(m, Module):
            raise TypeError(f"ModuleList.append: expected a Module, got {type(m).__name__}")
        setattr(self, str(len(self._modules)), m)
        return self

    def __getitem__(self, i):
        return list(self._modules.values())[i]

    def __len__(self):
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())

"""``Parameter``, ``Module`` and ``no_grad``: the small protocol every layer follows.

A module's ``forward`` calls pure functional pairs, keeps their cache in ``self._cache`` and
returns the output; ``backward(dy)`` takes that cache (releasing it), returns the gradient with
respect to the input(s) and *adds* each parameter's gradient into ``param.grad``.

What every subclass gets from this base class, without writing anything:

* ``dy`` is checked (shape of the output, numeric dtype) *before* the forward state is taken,
  whether the module ran as ``m(x)`` or ``m.forward(x)``: a refused ``dy`` loses nothing;
* ``_save`` records the version of every parameter of the module and its submodules, and
  ``backward`` raises ``RuntimeError`` (naming the parameter, nothing accumulated) when one was
  changed after the forward (optimizer step, ``load_state_dict``, ``p.data = ...``);
* a ``p.grad`` set to ``None`` is created again by the next backward (``_accumulate``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import zipfile
from collections import OrderedDict

import numpy as np

from .._validate import as_float, check_bool, check_dtype, check_grad, to_numpy
from ..functional._workspace import Workspace

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
    """A trainable array: ``.data`` and ``.grad`` (same shape and dtype; grad starts at zero).

    ``grad`` may be set to ``None`` (as in torch): ``zero_grad`` and the next module ``backward``
    create it again, optimizers skip the parameter meanwhile.

    Every change npattn can see bumps ``_version``: assigning ``p.data = ...`` (also what
    ``p.data -= ...`` does, so every optimizer step), ``Module.load_state_dict`` and
    ``Module.to``.  A module records the versions of its parameters at forward and its
    ``backward`` raises ``RuntimeError`` when one changed in between (as torch's "modified by an
    inplace operation").  Writes straight into the array (``p.data[...] = v``, ``np.add(p.data,
    1, out=p.data)``) are invisible to the counter: call ``p.bump_version()`` after them.
    ``zero_grad`` does not change ``data`` and does not bump.
    """

    __slots__ = ("_data", "grad", "_version")

    def __init__(self, data, dtype=None):
        data = as_float(data, "data")  # bool, complex, string, object, float16: TypeError
        if dtype is not None:
            dtype = check_dtype(dtype)
        self._data = np.array(data, dtype=dtype, copy=True)
        self._version = 0
        self.grad = np.zeros_like(self._data)

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value) -> None:
        self._data = as_float(value, "data")
        self._version += 1

    def bump_version(self) -> None:
        """Tell npattn that ``data`` was written in place (a forward state kept before is stale)."""
        self._version += 1

    @property
    def shape(self):
        return self._data.shape

    @property
    def dtype(self):
        return self._data.dtype

    def zero_grad(self) -> None:
        """Set ``grad`` to zeros in place (a ``None`` grad becomes a zero array)."""
        if self.grad is None:
            self.grad = np.zeros_like(self._data)
        else:
            self.grad[...] = 0

    def __repr__(self):
        return f"Parameter(shape={self._data.shape}, dtype={self._data.dtype})"


_structure = [0]  # bumped whenever a module registers or replaces a parameter or submodule


class Module:
    """Base class.  Subclasses set parameters/submodules as attributes and implement
    ``forward`` (storing one cache with ``self._save(cache)``) and ``backward``."""

    _parameters: "OrderedDict[str, Parameter]"
    _buffers: "OrderedDict[str, None]"
    _modules: "OrderedDict[str, Module]"
    _cache: object
    training: bool

    def __init__(self):
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_buffers", OrderedDict())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "_cache", None)
        object.__setattr__(self, "_dy_spec", None)
        object.__setattr__(self, "_versions", None)
        object.__setattr__(self, "training", True)

    # -- registration ---------------------------------------------------------------------
    def __setattr__(self, name, value):
        if "_parameters" not in self.__dict__:
            raise RuntimeError(f"{type(self).__name__}.__init__ must call super().__init__() first")
        if name in self._parameters or name in self._modules or isinstance(value, (Parameter, Module)):
            _structure[0] += 1  # the cached parameter lists (``_param_list``) are stale
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
    def __init_subclass__(cls, **kwargs):
        """Every subclass's ``forward`` records its output's shape and dtype after it returns,
        so ``backward`` can check ``dy`` before taking the state whether the module was run as
        ``m(x)`` or ``m.forward(x)`` (a rejected ``dy`` then loses nothing: retry with the right
        one)."""
        super().__init_subclass__(**kwargs)
        fwd = cls.__dict__.get("forward")
        if fwd is None or getattr(fwd, "_npattn_records_output", False):
            return

        @functools.wraps(fwd)
        def forward(self, *args, **kw):
            out = fwd(self, *args, **kw)
            self._record_output(out)
            return out

        forward._npattn_records_output = True
        cls.forward = forward

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):  # pragma: no cover - abstract
        raise NotImplementedError

    def backward(self, dy):  # pragma: no cover - abstract
        raise NotImplementedError

    def _record_output(self, out) -> None:
        """Remember what ``backward(dy)`` must receive (see ``_check_dy``)."""
        if self._cache is not None:
            y = out[0] if isinstance(out, tuple) and out else out
            if isinstance(y, np.ndarray):
                object.__setattr__(self, "_dy_spec", (y.shape, y.dtype))

    def _param_list(self) -> tuple:
        """``((dotted_name, Parameter), ...)`` of this module and its submodules, each parameter
        once; cached until a parameter or submodule is registered anywhere."""
        cached = self.__dict__.get("_plist")
        if cached is not None and cached[0] == _structure[0]:
            return cached[1]
        seen: set = set()
        found = []
        for name, p in self.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                found.append((name, p))
        plist = tuple(found)
        object.__setattr__(self, "_plist", (_structure[0], plist))
        return plist

    def _workspace(self) -> Workspace:
        """This module's ``Workspace``: the arrays its forward keeps for its backward, reused by
        the next step (``npattn.functional._workspace``); made on first use, never copied or
        pickled, released by ``eval()`` / ``train(False)`` and ``to()``."""
        ws = self.__dict__.get("_ws")
        if ws is None:
            ws = Workspace()
            object.__setattr__(self, "_ws", ws)
        return ws

    @staticmethod
    def _scratch() -> Workspace:
        """The calling thread's ``Workspace`` for arrays that live only inside one ``backward``
        call (inner gradients, scratch).  Shared by every module of the thread: the layers of a
        model run their backward one after another, so they reuse one layer's worth, not one each.
        ``eval()`` / ``train(False)`` and ``to()`` release it."""
        ws = getattr(_state, "scratch", None)
        if ws is None:
            ws = _state.scratch = Workspace()
        return ws

    def _save(self, cache) -> None:
        """Keep the forward state for one backward (nothing is kept under ``no_grad``), with the
        versions of every parameter of the module (submodules included), checked by ``_pop``."""
        object.__setattr__(self, "_dy_spec", None)  # set again once the output exists
        if is_grad_enabled():
            plist = self._param_list()
            object.__setattr__(self, "_versions", (plist, tuple(p._version for _, p in plist)))
            object.__setattr__(self, "_cache", cache)
            object.__setattr__(self, "_nograd_forward", False)
        else:
            object.__setattr__(self, "_cache", None)
            object.__setattr__(self, "_versions", None)
            object.__setattr__(self, "_nograd_forward", True)

    def _check_versions(self) -> None:
        """``RuntimeError`` when a parameter changed (or was replaced) since the forward;
        ``TypeError`` when a ``p.grad`` cannot accumulate (wrong shape, not a writeable float
        array), checked before anything is accumulated."""
        saved = self.__dict__.get("_versions")
        if saved is None:
            return
        plist, versions = saved
        for (name, p), v in zip(plist, versions):
            g = p.grad
            if g is not None and not (
                isinstance(g, np.ndarray) and g.shape == p._data.shape and g.dtype.kind == "f" and g.flags.writeable
            ):
                got = (
                    f"shape {g.shape}, dtype {g.dtype}, writeable={g.flags.writeable}"
                    if isinstance(g, np.ndarray)
                    else type(g).__name__
                )
                raise TypeError(
                    f"{type(self).__name__}.backward: parameter {name!r} has a grad that cannot accumulate "
                    f"(expected None or a writeable float array of shape {p._data.shape}, got {got}); "
                    "nothing was accumulated"
                )
            if p._version != v:
                raise RuntimeError(
                    f"{type(self).__name__}.backward: one of the variables needed for gradient computation "
                    f"has been modified by an inplace operation: parameter {name!r} changed after the "
                    f"forward (version {v} -> {p._version}: an optimizer step, load_state_dict or an "
                    "assignment to .data); run the forward again"
                )
        now = self._param_list()
        if now is not plist and [id(p) for _, p in now] != [id(p) for _, p in plist]:
            raise RuntimeError(
                f"{type(self).__name__}.backward: parameters were replaced or added after the forward; "
                "run the forward again"
            )

    def _pop(self):
        """Take (and release) the forward state; RuntimeError when there is none or when a
        parameter changed since the forward (then nothing is released)."""
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
        self._check_versions()
        object.__setattr__(self, "_cache", None)
        object.__setattr__(self, "_dy_spec", None)
        object.__setattr__(self, "_versions", None)
        return cache

    def _check_dy(self, dy, name: str = "dy"):
        """Validate the upstream gradient *before* the forward state is taken (so a bad ``dy``
        neither releases the state nor adds anything into ``.grad``).

        ``RuntimeError`` when there is no forward state (as ``_pop``) or when a parameter
        changed since the forward; ``TypeError`` for a non-numeric ``dy``;
        ``ValueError("dy: expected shape <output shape> ..., got <shape>")`` for a wrongly
        shaped one.  Returns ``dy`` cast to the output's dtype.
        """
        if self._cache is None:
            self._pop()  # raises the protocol's RuntimeError
        self._check_versions()
        spec = self.__dict__.get("_dy_spec")
        if spec is None:
            return dy
        return check_grad(dy, spec[0], spec[1], name)

    @staticmethod
    def _accumulate(param: Parameter, grad) -> None:
        """``param.grad += grad``; a ``None`` ``param.grad`` (set by the user) is created."""
        if grad is None:
            return
        if param.grad is None:
            param.grad = np.array(grad, dtype=param.data.dtype, copy=True)
        else:
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
        """Training mode (dropout active) or, with ``mode=False``, evaluation mode, which also
        releases the arrays the modules keep between training steps (``_workspace``)."""
        mode = check_bool(mode, "mode")
        for m in self.modules():
            object.__setattr__(m, "training", bool(mode))
            if not mode:
                m.__dict__.pop("_ws", None)
        if not mode:
            _state.scratch = None
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
            object.__setattr__(m, "_versions", None)
            m.__dict__.pop("_ws", None)
            _state.scratch = None
            for p in m._parameters.values():
                p.data = p.data.astype(dt)  # bumps the version
                p.grad = None if p.grad is None else p.grad.astype(dt)
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

        Atomic: every key, shape, dtype and value range is checked first, and on any problem
        nothing is changed.  A missing, unexpected or wrongly shaped key, or a float value
        outside the range of the module's dtype (``1e300`` into float32, which would become
        ``inf``), raises ``ValueError`` naming the key(s); a value of the wrong kind (bool,
        complex, string, float16 ...) raises ``TypeError``.  ``inf`` and NaN load as they are.
        With ``strict=False`` missing and unexpected keys are allowed (and returned) but shapes
        and values are still checked.  Loading bumps the version of every loaded parameter (a
        forward state kept before refuses ``backward``).  Returns ``(missing_keys, unexpected_keys)``.
        """
        if not hasattr(state_dict, "keys") or not hasattr(state_dict, "__getitem__"):
            raise TypeError(f"state_dict: expected a mapping of names to arrays, got {type(state_dict).__name__}")
        strict = check_bool(strict, "strict")
        entries = {key: (owner, name, is_param) for key, owner, name, is_param in self._state_entries()}
        missing = [k for k in entries if k not in state_dict]
        unexpected = [k for k in state_dict.keys() if k not in entries]
        problems: list = []
        type_problems: list = []
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
            problem = _load_problem(key, arr, current)
            if problem is not None:
                (type_problems if problem[0] is TypeError else problems).append(problem[1])
                continue
            staged.append((owner, name, is_param, arr))
        if type_problems or problems:
            exc = TypeError if type_problems else ValueError
            raise exc("load_state_dict: nothing was loaded; " + "; ".join(type_problems + problems))
        for owner, name, is_param, arr in staged:
            if is_param:
                p = owner._parameters[name]
                p.data[...] = arr.astype(p.data.dtype, copy=False)
                p.bump_version()
            else:
                cur = getattr(owner, name)
                object.__setattr__(owner, name, np.array(arr, dtype=cur.dtype, copy=True))
        return missing, unexpected

    def save(self, path) -> None:
        """Write ``state_dict()`` to an ``.npz`` file (``.npz`` is appended when ``path`` lacks
        it, as ``np.savez`` does).  A ``path`` that is a directory raises ``IsADirectoryError``."""
        path = os.fspath(path)
        target = path if path.endswith(".npz") else path + ".npz"
        for p in dict.fromkeys((path, target)):
            if os.path.isdir(p):
                raise IsADirectoryError(
                    f"save: {p!r} is a directory; expected a file name such as {os.path.join(p, 'model.npz')!r}"
                )
        np.savez(target, **self.state_dict())  # type: ignore[arg-type]

    def load(self, path, strict: bool = True):
        """Load an ``.npz`` written by ``save`` (atomic, as ``load_state_dict``).

        ``path`` may omit the ``.npz`` that ``save`` appended.  A missing file raises
        ``FileNotFoundError``, a directory ``IsADirectoryError``, a file that is not an ``.npz``
        archive (or a damaged one) ``ValueError``; the module is then unchanged.
        """
        path = os.fspath(path)
        if os.path.isdir(path):
            raise IsADirectoryError(f"load: {path!r} is a directory; expected an .npz file written by save()")
        if not os.path.exists(path) and not path.endswith(".npz") and os.path.isfile(path + ".npz"):
            path = path + ".npz"
        if not os.path.exists(path):
            raise FileNotFoundError(f"load: no such file {path!r}" + ("" if path.endswith(".npz") else " (nor .npz)"))
        if not zipfile.is_zipfile(path):
            raise ValueError(f"load: {path!r} is not an .npz archive (written by save()); it may be corrupt")
        try:
            with np.load(path, allow_pickle=False) as f:
                arrays = {k: f[k] for k in f.files}
        except Exception as e:
            raise ValueError(
                f"load: cannot read the .npz archive {path!r}; it may be corrupt ({type(e).__name__}: {e})"
            ) from None
        return self.load_state_dict(arrays, strict=strict)

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


def _load_problem(key: str, arr: np.ndarray, current: np.ndarray):
    """``(exception type, message)`` when ``arr`` cannot be loaded over ``current``, else None."""
    kind = arr.dtype.kind
    if kind == "b" and current.dtype.kind != "b":
        return TypeError, f"key {key!r}: expected a numeric array, got a bool array"
    if kind not in "fiub":
        return ValueError, f"key {key!r}: expected a numeric array, got dtype {arr.dtype}"
    if kind == "f" and arr.dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
        return TypeError, (
            f"key {key!r}: {arr.dtype} is not supported; convert it with .astype(np.float32) (or np.float64)"
        )
    if arr.shape != current.shape:
        return ValueError, f"key {key!r}: expected shape {current.shape}, got {arr.shape}"
    if current.dtype.kind == "f" and arr.size and (kind in "iu" or arr.dtype.itemsize > current.dtype.itemsize):
        big = float(np.finfo(current.dtype).max)
        with np.errstate(invalid="ignore"):
            finite = np.abs(arr[np.isfinite(arr)]) if kind == "f" else np.abs(arr.astype(np.float64))
        if finite.size and finite.max() > big:
            return ValueError, (
                f"key {key!r}: value {float(finite.max()):g} is out of the range of "
                f"{current.dtype} (max {big:g}); it would become inf"
            )
    return None

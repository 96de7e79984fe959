"""``Parameter``, ``Module`` and ``no_grad``: the small protocol every layer follows.

A module's ``forward`` calls pure functional pairs, keeps their cache with
``self.save_for_backward(cache)`` and returns the output; ``backward(dy)`` takes that cache back
with ``self.pop_saved()``, returns the gradient with respect to the input(s) and *adds* each
parameter's gradient into ``param.grad`` with ``self.accumulate_grad(param, grad)``.  After a
forward, ``jvp(*input_tangents, param_tangents=None)`` gives the output's tangent (forward mode)
from the same saved state without consuming it, and ``backward_jvp(dy, *input_tangents,
param_tangents=None, ddy=None)`` is the second order (forward over reverse): the backward's
gradients and their tangents when the inputs, the parameters and ``dy`` move along tangents,
consuming the state as ``backward`` does.

Saved states form a stack, one entry per call: a module called twice in one forward (a shared
``LayerNorm``, tied layers) keeps both states, and its two ``backward`` calls, made in reverse
order as a chain rule runs, consume them latest first (as torch's autograd does).  ``backward``
with nothing saved raises ``RuntimeError``; a forward under ``no_grad()`` keeps nothing and
releases the states kept before it (so ``backward`` after it raises, as it always did).
Forward passes whose backward will never run should run under ``no_grad()`` or be followed by
``clear_saved()``: states are kept until consumed.

What every subclass gets from this base class, without writing anything:

* ``dy`` is checked (shape of the output, numeric dtype) *before* the forward state is taken,
  whether the module ran as ``m(x)`` or ``m.forward(x)``: a refused ``dy`` loses nothing;
* ``save_for_backward`` records the version of every parameter of the module and its submodules,
  and ``backward`` raises ``RuntimeError`` (naming the parameter, nothing accumulated) when one
  was changed after the forward (optimizer step, ``load_state_dict``, ``p.data = ...``);
* a ``p.grad`` set to ``None`` is created again by the next backward (``accumulate_grad``).

``ModuleList`` is defined beside ``Sequential`` in ``npattn.nn.containers`` (which builds on this
file, not the other way round); ``npattn.nn.module.ModuleList`` names the same class.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import warnings
import zipfile
from collections import OrderedDict

import numpy as np

from .._validate import as_float, check_bool, check_dtype, check_grad, to_numpy
from ..functional._bfloat16 import BFloat16Array, to_bfloat16_bits
from ..functional._workspace import Workspace

__all__ = ["Parameter", "Module", "ParamTangents", "no_grad", "is_grad_enabled"]  # ModuleList: nn.containers

_state = threading.local()

# A forward outside no_grad keeps its state until a backward takes it (a stack, so that a module
# called twice in one forward gets both backwards).  Forwards whose backward never comes (an
# evaluation loop run without no_grad) would pile states up unseen: past this many, warn once.
SAVED_STATES_WARNING = 64


def is_grad_enabled() -> bool:
    """False inside ``no_grad()``: modules then keep no forward state (no caches).

    Returns
    -------
    bool
        Whether forward passes keep their state for backward (this thread).

    Examples
    --------
    >>> import npattn
    >>> npattn.is_grad_enabled()
    True
    >>> with npattn.no_grad():
    ...     npattn.is_grad_enabled()
    False
    """
    return getattr(_state, "grad_enabled", True)


@contextlib.contextmanager
def no_grad():
    """Run forward passes without keeping what backward needs (inference: no (L, L) caches held).

    Thread-local, re-entrant.  ``backward`` after a forward run under ``no_grad`` raises
    ``RuntimeError``.

    Examples
    --------
    >>> import numpy as np
    >>> import npattn
    >>> lin = npattn.Linear(2, 2, rng=0)
    >>> with npattn.no_grad():
    ...     y = lin(np.ones((1, 2)))
    >>> try:
    ...     lin.backward(np.ones((1, 2)))
    ... except RuntimeError:
    ...     print("nothing to differentiate")
    nothing to differentiate
    """
    prev = is_grad_enabled()
    _state.grad_enabled = False
    try:
        yield
    finally:
        _state.grad_enabled = prev


class Parameter:
    """A trainable array: ``.data`` and ``.grad`` (same shape and dtype; grad starts at zero).

    ``grad_tangent`` is where ``Module.backward_jvp`` adds the tangent of the gradient (the
    Hessian-vector product of the loss, for a scalar loss): ``None`` until the first
    ``backward_jvp`` makes it (an array of ``grad``'s shape and dtype), set to zeros in place by
    ``zero_grad``.

    ``grad`` may be set to ``None`` (as in torch): ``zero_grad`` and the next module ``backward``
    create it again, optimizers skip the parameter meanwhile.

    Every change npattn can see bumps ``_version``: assigning ``p.data = ...`` (also what
    ``p.data -= ...`` does, so every optimizer step), ``Module.load_state_dict`` and
    ``Module.to``.  A module records the versions of its parameters at forward and its
    ``backward`` raises ``RuntimeError`` when one changed in between (as torch's "modified by an
    inplace operation").  Writes straight into the array (``p.data[...] = v``, ``np.add(p.data,
    1, out=p.data)``) are invisible to the counter: call ``p.bump_version()`` after them.
    ``zero_grad`` does not change ``data`` and does not bump.

    Examples
    --------
    >>> import numpy as np
    >>> import npattn
    >>> p = npattn.Parameter(np.ones(3))
    >>> p.shape, p.dtype, p.grad
    ((3,), dtype('float64'), array([0., 0., 0.]))
    """

    __slots__ = ("_data", "grad", "grad_tangent", "_version")

    def __init__(self, data, dtype=None):
        data = as_float(data, "data")  # bool, complex, string, object, float16: TypeError
        if dtype is not None:
            dtype = check_dtype(dtype)
        if data.size > 1 and not any(data.strides) and not data.flat[0]:
            # a broadcast zero (a model about to be loaded): fresh zero pages, none touched until written
            self._data = np.zeros(data.shape, data.dtype if dtype is None else dtype)
        else:
            self._data = np.array(data, dtype=dtype, copy=True)
        self._version = 0
        self.grad = np.zeros(self._data.shape, self._data.dtype)  # calloc'd: no page touched until written
        self.grad_tangent = None  # made by the first backward_jvp (second order is rare: no array before)

    @property
    def data(self) -> np.ndarray:
        """The parameter's values; assigning a new array bumps the version."""
        return self._data

    @data.setter
    def data(self, value) -> None:
        self._data = value if isinstance(value, BFloat16Array) else as_float(value, "data")
        self._version += 1

    def bump_version(self) -> None:
        """Tell npattn that ``data`` was written in place (a forward state kept before is stale)."""
        self._version += 1

    @property
    def shape(self):
        """``data.shape``."""
        return self._data.shape

    @property
    def dtype(self):
        """``data.dtype``."""
        return self._data.dtype

    def zero_grad(self) -> None:
        """Set ``grad`` to zeros in place (a ``None`` grad becomes a zero array), and
        ``grad_tangent`` too when it exists (a ``None`` one stays ``None``).  A parameter kept as
        bfloat16 (``BFloat16Array``: no gradient is ever computed for it) keeps ``None``."""
        if isinstance(self._data, BFloat16Array):
            return
        if self.grad is None:
            self.grad = np.zeros_like(self._data)
        else:
            self.grad[...] = 0
        if getattr(self, "grad_tangent", None) is not None:
            self.grad_tangent[...] = 0

    def __repr__(self):
        return f"Parameter(shape={self._data.shape}, dtype={self._data.dtype})"


_structure = [0]  # bumped whenever a module registers or replaces a parameter or submodule


class _Saved:
    """One saved forward state: the cache, the parameter versions at save time, and the shape
    and dtype of the output (what ``backward`` must receive), set once the output exists.
    (A plain object, so tools that walk a module's attributes find the arrays it keeps.)"""

    def __init__(self, cache, versions):
        self.cache = cache
        self.versions = versions
        self.dy_spec = None
        self.jvp_tangents = None  # the latest jvp's tangents and forward tangents (_JvpTangents)


class _JvpTangents:
    """What a user's ``jvp`` computed from one forward state, for a ``backward_jvp`` of that state
    along the same tangents: the input tangents as given, a copy of the tangents' values
    (``_tangent_values``: the input tangents, then the ``param_tangents`` dict's names and arrays)
    and the remembering :class:`ParamTangents` that holds every stage's forward tangents."""

    __slots__ = ("inputs", "values", "pt")

    def __init__(self, inputs: tuple, param_tangents, pt: "ParamTangents"):
        self.inputs = inputs
        self.values = _tangent_values(inputs, param_tangents)
        self.pt = pt

    def matches(self, inputs: tuple, param_tangents) -> bool:
        """True when ``inputs`` and ``param_tangents`` hold the values given to the ``jvp`` (the
        same names, shapes, dtypes and bytes, whether the same arrays or not, changed in place or
        not): then its forward tangents are theirs."""
        return _same_values(_tangent_values(inputs, param_tangents, copy=False), self.values)


def _value(a, copy: bool):
    """``a``'s bytes as a C-contiguous array of unsigned integers of its item size (a copy when
    ``copy``: what a later change in place cannot reach), so that equal means the same bits
    (``-0.0`` is not ``0.0``, a NaN equals itself); ``None`` stays ``None``; anything else (not a
    numeric array) an object equal to nothing else."""
    if a is None:
        return None
    if not isinstance(a, np.ndarray) or a.dtype.kind not in "fiu":
        return object()
    size = a.dtype.itemsize
    bits = np.array(a, order="C", copy=copy or None).reshape(-1).view(f"u{size}" if size in (1, 2, 4, 8) else "u1")
    return a.dtype.str, a.shape, bits


def _tangent_values(inputs: tuple, param_tangents, copy: bool = True):
    """The values of a ``jvp``'s or ``backward_jvp``'s tangents (``_JvpTangents``): the input
    tangents, then the ``param_tangents`` names with their arrays (``_value``)."""
    items = () if param_tangents is None else tuple(param_tangents.items())
    return tuple(_value(a, copy) for a in inputs), tuple((n, _value(a, copy)) for n, a in items)


def _same_values(got, kept) -> bool:
    """``_tangent_values`` equal entry by entry: the same names, dtypes, shapes and bits (one pass
    over the arrays that reaches them, stopping at the first difference)."""

    def same(a, b):
        if a is None or b is None or not isinstance(a, tuple) or not isinstance(b, tuple):
            return a is b
        return a[:2] == b[:2] and np.array_equal(a[2], b[2])

    (ins, params), (kept_ins, kept_params) = got, kept
    return (
        len(ins) == len(kept_ins)
        and len(params) == len(kept_params)
        and all(same(a, b) for a, b in zip(ins, kept_ins))
        and all(n == m and same(a, b) for (n, a), (m, b) in zip(params, kept_params))
    )


class ParamTangents:
    """The parameter tangents given to :meth:`Module.jvp`, looked up by ``Parameter`` object.

    ``param_tangents.get(self.weight)`` is the tangent of that parameter (an array of its shape
    and dtype) or ``None`` (zero).  Keyed by the parameter itself, not by a name, so a parameter
    shared by two submodules (tied weights) gets its tangent in both.
    """

    __slots__ = ("_by_id", "_memo")

    def __init__(self, by_id=None):
        self._by_id = dict(by_id or {})
        self._memo = None  # forward tangents already computed, while remembering (_remembering)

    def _remembering(self) -> "ParamTangents":
        """The same tangents, remembering the forward tangents computed with them (``_remember``):
        for one second-order pass that runs a ``jvp`` and then a ``backward_jvp`` from the same
        forward states with the same tangent arrays, unchanged in between (``CausalLM.loss_hvp``:
        its ``jvp`` gives the logits' tangent, and its ``backward_jvp`` needs every layer's
        forward tangents again, each module's own once more)."""
        out = ParamTangents()
        out._by_id, out._memo = self._by_id, {}
        return out

    def _remember(self, objs: tuple, compute):
        """``compute()`` once per ``objs`` (a module, what is computed, its saved state, the input
        tangents: compared by identity, and kept alive with the result so that no id is reused)
        while remembering; otherwise ``compute()`` every time."""
        if self._memo is None:
            return compute()
        key = tuple(map(id, objs))
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = (objs, compute())
        return hit[1]

    def _forget(self, objs: tuple) -> None:
        """Drop what ``_remember`` keeps for ``objs`` (nothing when not remembering)."""
        if self._memo is not None:
            self._memo.pop(tuple(map(id, objs)), None)

    def get(self, param):
        """The tangent of ``param`` (a ``Parameter`` or ``None``), or ``None`` when it has none."""
        if param is None:
            return None
        entry = self._by_id.get(id(param))
        return None if entry is None else entry[1]

    def __bool__(self):
        return bool(self._by_id)

    def __len__(self):
        return len(self._by_id)

    def __repr__(self):
        return f"ParamTangents({len(self._by_id)} tangent(s))"


class Module:
    """Base class of every layer: parameters, submodules, the forward/backward protocol.

    A subclass calls ``super().__init__()``, assigns ``Parameter`` and ``Module`` attributes
    (registered automatically, in order, for ``named_parameters`` and ``state_dict``) and
    implements

    * ``forward(*inputs)``: compute the output, keep what backward needs with
      ``self.save_for_backward(cache)`` (one call per forward), return the output;
    * ``backward(dy)``: take the state with ``cache = self.pop_saved()`` (after checking ``dy``
      with ``dy = self._check_dy(dy)`` if wanted), add parameter gradients with
      ``self.accumulate_grad(param, grad)``, return the input gradient(s);
    * optionally ``_jvp(state, input_tangents, param_tangents)`` for forward mode (see ``jvp``)
      and ``_backward_jvp(state, dy, input_tangents, param_tangents, ddy)`` for the second order
      (see ``backward_jvp``).

    The saved states are a stack (one per call), so a module used twice in one forward works:
    call ``backward`` once per use, in reverse order.  See ``docs/guides/own_module.md``.

    Examples
    --------
    A module with one parameter, ``y = x * scale``:

    >>> import numpy as np
    >>> import npattn
    >>> class Scale(npattn.Module):
    ...     def __init__(self, n):
    ...         super().__init__()
    ...         self.scale = npattn.Parameter(np.full(n, 2.0))
    ...     def forward(self, x):
    ...         self.save_for_backward(x)
    ...         return x * self.scale.data
    ...     def backward(self, dy):
    ...         x = self.pop_saved()
    ...         self.accumulate_grad(self.scale, (dy * x).reshape(-1, x.shape[-1]).sum(0))
    ...         return dy * self.scale.data
    >>> m = Scale(3)
    >>> m(np.ones((2, 3)))
    array([[2., 2., 2.],
           [2., 2., 2.]])
    >>> m.backward(np.ones((2, 3)))[0], m.scale.grad
    (array([2., 2., 2.]), array([2., 2., 2.]))
    >>> npattn.gradcheck(m, np.random.default_rng(0).standard_normal((2, 3))).ok
    True
    """

    _parameters: "OrderedDict[str, Parameter]"
    _buffers: "OrderedDict[str, None]"
    _modules: "OrderedDict[str, Module]"
    _states: "list[_Saved]"
    training: bool

    def __init__(self):
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_buffers", OrderedDict())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "_states", [])
        object.__setattr__(self, "_nograd_forward", False)
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
        """A non-trainable array saved in ``state_dict`` (e.g. the book's causal ``mask``).

        Parameters
        ----------
        name : str
            The attribute (and state-dict key) name.
        value : array_like
            The buffer's value, stored as an ndarray.
        """
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
            depth = len(self._states)
            out = fwd(self, *args, **kw)
            self._record_output(out, depth)
            return out

        forward._npattn_records_output = True
        cls.forward = forward

    def __call__(self, *args, **kwargs):
        """``m(*inputs, **options)`` is ``m.forward(*inputs, **options)``."""
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):  # pragma: no cover - abstract
        """Compute the output from the inputs and keep what ``backward`` needs.

        Subclasses implement it: call functional pairs (or submodules), keep their caches with
        ``self.save_for_backward(cache)`` and return the output.

        Returns
        -------
        numpy.ndarray
            The output (some modules return a tuple whose first element is the output).
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement forward")

    def backward(self, dy):  # pragma: no cover - abstract
        """Gradient of the loss with respect to the input(s), given ``dy``, that of the output.

        Consumes the latest forward state (``pop_saved``) and *adds* every parameter's gradient
        into its ``.grad`` (``accumulate_grad``).

        Parameters
        ----------
        dy : numpy.ndarray
            The gradient of the loss with respect to the output, of the output's shape.

        Returns
        -------
        numpy.ndarray or tuple or None
            The gradient with respect to the input (a tuple for several inputs, None for
            inputs without a gradient such as token ids).

        Raises
        ------
        RuntimeError
            With no forward state left (before any forward, after the last one was consumed,
            or when the forward ran under ``no_grad``), or when a parameter changed since the
            forward.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement backward")

    def _record_output(self, out, depth=None) -> None:
        """Remember what ``backward(dy)`` must receive (see ``_check_dy``): the shape and dtype
        of ``out`` go with the state this call saved (if it saved one)."""
        states = self._states
        if not states or (depth is not None and len(states) <= depth):
            return
        y = out[0] if isinstance(out, tuple) and out else out
        if isinstance(y, np.ndarray):
            states[-1].dy_spec = (y.shape, y.dtype)

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

    def save_for_backward(self, cache) -> None:
        """Keep ``cache`` (anything: a functional pair's cache, a tuple of them) for one backward.

        Call it once in each ``forward``.  The states form a stack: each call pushes one, each
        ``pop_saved`` (in ``backward``) takes the latest.  The versions of every parameter of
        the module and its submodules are recorded with it and checked when it is used.  Under
        ``no_grad()`` nothing is kept and the states kept before are released (as before the
        stack: a ``backward`` after a forward under ``no_grad`` raises ``RuntimeError``).

        Parameters
        ----------
        cache : object
            What ``backward`` (and ``_jvp``) will need.
        """
        if is_grad_enabled():
            plist = self._param_list()
            self._states.append(_Saved(cache, (plist, tuple(p._version for _, p in plist))))
            if len(self._states) == SAVED_STATES_WARNING:
                warnings.warn(
                    f"{type(self).__name__} keeps {SAVED_STATES_WARNING} forward states that no backward has "
                    "taken yet; run forwards whose backward never comes (evaluation) under npattn.no_grad(), "
                    "or release them with clear_saved()",
                    RuntimeWarning,
                    stacklevel=2,
                )
            object.__setattr__(self, "_nograd_forward", False)
        else:
            self._states.clear()
            object.__setattr__(self, "_nograd_forward", True)

    def _no_state_error(self, what: str = "backward") -> RuntimeError:
        if self.__dict__.get("_nograd_forward", False):
            return RuntimeError(f"{type(self).__name__}.{what}: the last forward ran under no_grad(), nothing was kept")
        return RuntimeError(
            f"{type(self).__name__}.{what}: no forward state to use; call the module first "
            "(backward releases the state, so each forward allows one backward)"
        )

    def _check_versions(self, entry=None) -> None:
        """``RuntimeError`` when a parameter changed (or was replaced) since the forward that
        saved ``entry`` (default: the latest); ``TypeError`` when a ``p.grad`` cannot accumulate
        (wrong shape, not a writeable float array), checked before anything is accumulated."""
        if entry is None:
            if not self._states:
                return
            entry = self._states[-1]
        plist, versions = entry.versions
        for (name, p), v in zip(plist, versions):
            if isinstance(p._data, BFloat16Array):
                raise RuntimeError(
                    f"{type(self).__name__}: parameter {name!r} is stored as bfloat16 "
                    "(CausalLM.from_pretrained(..., weights_dtype='bfloat16')), which is for inference: backward, "
                    "jvp and backward_jvp need float weights; load without weights_dtype, or convert with "
                    "model.to(np.float32) first"
                )
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

    def pop_saved(self):
        """Take (and release) the latest forward state, as kept by ``save_for_backward``.

        Returns
        -------
        object
            The cache given to the latest ``save_for_backward`` not yet popped.

        Raises
        ------
        RuntimeError
            When there is none (no forward, all consumed, or a forward under ``no_grad``), or
            when a parameter changed since that forward (then nothing is released).
        """
        if not self._states:
            raise self._no_state_error()
        self._check_versions(self._states[-1])
        return self._states.pop().cache

    def saved_state(self, index: int = -1):
        """The forward state kept by ``save_for_backward``, *without* releasing it (``jvp``
        uses it; a ``backward`` may follow).

        Parameters
        ----------
        index : int
            Which saved state, as a list index: ``-1`` (default) is the latest, ``-2`` the one
            before (a module called twice in one forward).

        Raises
        ------
        RuntimeError
            When there is no such state, or when a parameter changed since that forward.
        """
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"index: expected an int, got {index!r} ({type(index).__name__})")
        states = self._states
        if not states:
            raise self._no_state_error("saved_state")
        if not -len(states) <= index < len(states):
            raise RuntimeError(
                f"{type(self).__name__}.saved_state: index {index} is out of range ({len(states)} state(s) kept)"
            )
        self._check_versions(states[index])
        return states[index].cache

    @property
    def num_saved(self) -> int:
        """How many forward states this module keeps (calls not yet consumed by ``backward``)."""
        return len(self._states)

    def clear_saved(self) -> None:
        """Release every kept forward state of this module and its submodules (after forward
        passes whose backward will never run, outside ``no_grad``)."""
        for m in self._module_list():
            m._states.clear()

    def _module_list(self) -> tuple:
        """This module and every submodule (``modules()``) as a tuple, cached as ``_param_list``
        is (a cached decoding step clears each attention's states: no generator walk per call)."""
        cached = self.__dict__.get("_mlist")
        if cached is not None and cached[0] == _structure[0]:
            return cached[1]
        mods = tuple(self.modules())
        object.__setattr__(self, "_mlist", (_structure[0], mods))
        return mods

    @property
    def _cache(self):
        """The latest saved state's cache, or None (read-only view kept for old code and tests)."""
        states = self.__dict__.get("_states")
        return states[-1].cache if states else None

    def _check_dy(self, dy, name: str = "dy"):
        """Validate the upstream gradient *before* the forward state is taken (so a bad ``dy``
        neither releases the state nor adds anything into ``.grad``).

        ``RuntimeError`` when there is no forward state (as ``pop_saved``) or when a parameter
        changed since the forward; ``TypeError`` for a non-numeric ``dy``;
        ``ValueError("dy: expected shape <output shape> ..., got <shape>")`` for a wrongly
        shaped one.  Returns ``dy`` cast to the output's dtype.
        """
        if not self._states:
            raise self._no_state_error()
        entry = self._states[-1]
        self._check_versions(entry)
        spec = entry.dy_spec
        if spec is None:
            return dy
        return check_grad(dy, spec[0], spec[1], name)

    @staticmethod
    def accumulate_grad(param: Parameter, grad) -> None:
        """Add ``grad`` into ``param.grad`` (``param.grad += grad``), as every ``backward`` must.

        A ``None`` ``param.grad`` (set by the user) is created; a ``None`` ``grad`` adds nothing.

        Parameters
        ----------
        param : Parameter
            The parameter whose gradient grows.
        grad : numpy.ndarray or None
            Its gradient from this backward, of the parameter's shape.
        """
        if grad is None:
            return
        if param.grad is None:
            param.grad = np.array(grad, dtype=param.data.dtype, copy=True)
        else:
            param.grad += grad

    # -- forward mode ----------------------------------------------------------------------
    def jvp(self, *input_tangents, param_tangents=None):
        """Forward mode: the tangent of the output of the latest forward along given tangents.

        Uses the latest saved state *without* consuming it, so ``backward`` may follow.  The
        forward tangents of every stage stay on that state until it is consumed (or until the next
        ``jvp`` of it), for a ``backward_jvp`` along the same tangents (see there).

        Parameters
        ----------
        *input_tangents : numpy.ndarray or None
            One per positional input of the forward, each of that input's shape (``None``: zero;
            inputs without a gradient, such as token ids, take ``None``).
        param_tangents : mapping of str to numpy.ndarray, optional
            Tangents of parameters by their ``named_parameters`` names; missing ones are zero.

        Returns
        -------
        numpy.ndarray
            The directional derivative of the output, of the output's shape.

        Raises
        ------
        RuntimeError
            With no forward state (as ``backward``) or when a parameter changed since the forward.
        NotImplementedError
            When the module has no forward mode (no ``_jvp``).
        ValueError, TypeError
            For an unknown parameter name or a tangent of the wrong shape or kind.
        """
        if not self._states:
            raise self._no_state_error("jvp")
        inputs, pt = tuple(input_tangents), self._param_tangents(param_tangents)
        if isinstance(param_tangents, ParamTangents):  # a composite's or loss_hvp's own remembering
            return self._jvp_at(-1, inputs, pt)
        entry = self._states[-1]
        entry.jvp_tangents = None  # the previous jvp's are released first
        pt = pt._remembering()
        out = self._jvp_at(-1, inputs, pt)
        pt._forget((self, "jvp", entry.cache) + inputs)
        entry.jvp_tangents = _JvpTangents(inputs, param_tangents, pt)
        # the caller's own array: a change in place must not reach what backward_jvp reuses
        return out.copy() if isinstance(out, np.ndarray) else out

    def _jvp_at(self, index: int, input_tangents: tuple, param_tangents) -> np.ndarray:
        """``_jvp`` from saved state ``index`` (a list index; kept as ``_jvp_index``, counted from
        the top, while it runs, so that ``_child_jvp`` finds the children's states of that call)."""
        state = self.saved_state(index)
        if index >= 0:
            index -= len(self._states)
        prev = self.__dict__.get("_jvp_index", -1)
        object.__setattr__(self, "_jvp_index", index)
        try:
            if not isinstance(param_tangents, ParamTangents):
                return self._jvp(state, tuple(input_tangents), param_tangents)
            return param_tangents._remember(
                (self, "jvp", state) + tuple(input_tangents),
                lambda: self._jvp(state, tuple(input_tangents), param_tangents),
            )
        finally:
            object.__setattr__(self, "_jvp_index", prev)

    def _param_tangents(self, param_tangents) -> ParamTangents:
        """Check ``param_tangents`` (names -> arrays) and key them by parameter."""
        if param_tangents is None:
            return ParamTangents()
        if isinstance(param_tangents, ParamTangents):
            return param_tangents
        if not hasattr(param_tangents, "items"):
            raise TypeError(
                f"param_tangents: expected a mapping of parameter names to arrays, got {type(param_tangents).__name__}"
            )
        params = dict(self.named_parameters())
        by_id: dict = {}
        for name, t in param_tangents.items():
            if name not in params:
                raise ValueError(f"param_tangents: unknown parameter {name!r}; valid names: {list(params)}")
            if t is None:
                continue
            p = params[name]
            if id(p) in by_id:
                raise ValueError(
                    f"param_tangents: {name!r} and {by_id[id(p)][0]!r} are the same (tied) parameter; give one tangent"
                )
            arr = as_float(t, f"param_tangents[{name!r}]")
            if arr.shape != p.data.shape:
                raise ValueError(f"param_tangents[{name!r}]: expected shape {p.data.shape}, got {arr.shape}")
            by_id[id(p)] = (name, arr.astype(p.data.dtype, copy=False))
        return ParamTangents(by_id)

    def _jvp(self, state, input_tangents, param_tangents):
        """Forward-mode hook: the output tangent from a saved ``state`` (what ``forward`` gave
        ``save_for_backward``), ``input_tangents`` (a tuple, ``None`` = zero) and
        ``param_tangents`` (a :class:`ParamTangents`: ``param_tangents.get(self.weight)``).
        Must not change the state.  The base class has no forward mode."""
        raise NotImplementedError(
            f"{type(self).__name__} has no forward mode (jvp) yet: it does not implement "
            "_jvp(state, input_tangents, param_tangents)"
        )

    def _child_jvp(self, child, state_index, input_tangents, param_tangents):
        """``child``'s output tangent, for a composite's ``_jvp``.

        ``state_index`` picks the child's saved state: a negative index counts from this call,
        not from the top of the child's stack: ``-1`` is the child's state of the call whose
        ``_jvp`` is running (with one child call per call of this module; so a composite called
        twice in one forward gets each call's own children states), ``-2`` the one before it.  A
        non-negative index is a plain position in the child's stack (``Sequential`` records them).
        """
        if state_index < 0:
            state_index += self.__dict__.get("_jvp_index", -1) + 1
        return child._jvp_at(state_index, tuple(input_tangents), param_tangents)

    # -- second order (forward over reverse) -----------------------------------------------
    def backward_jvp(self, dy, *input_tangents, param_tangents=None, ddy=None):
        """Second order: ``backward``'s gradients and their tangents along given tangents.

        The backward is a function of the forward's inputs, of the parameters and of ``dy``;
        when they move along ``input_tangents``, ``param_tangents`` and ``ddy``, each gradient
        moves too, and this gives that directional derivative (forward mode over the reverse
        pass).  Consumes the latest forward state as ``backward`` does, adds each parameter's
        gradient into ``p.grad`` (as ``backward``) and the gradient's tangent into
        ``p.grad_tangent`` (created at zero when ``None``).  With a scalar loss ``L`` whose
        ``dy`` is the output's gradient, the input and parameter tangents ``v`` and ``ddy`` the
        tangent of ``dy`` that they cause, ``p.grad_tangent`` is the Hessian-vector product ``H v``.

        After ``jvp`` of the same forward state along the same tangents (each input tangent, and
        the ``param_tangents`` dict's names and arrays, compared by value: bit for bit against
        a copy that ``jvp`` keeps of them), the forward tangents that ``jvp`` computed are reused
        instead of computed again (the Hessian-vector recipe: forward, ``jvp``, ``backward_jvp``).
        Other values (other arrays, or the same ones changed in place in between) are worked
        from scratch.

        A module implements the hook ``_backward_jvp(state, dy, input_tangents, param_tangents,
        ddy) -> (dx, dx_tangent)`` (``state``: what its forward gave ``save_for_backward``;
        ``param_tangents.get(p)`` as in ``_jvp``; it adds into ``p.grad`` with
        ``accumulate_grad`` and into ``p.grad_tangent`` with ``accumulate_grad_tangent``), or
        overrides this method as it overrides ``backward``.  A composite calls its children's
        with ``_child_backward_jvp``.

        Parameters
        ----------
        dy : numpy.ndarray
            The upstream gradient, of the output's shape (as ``backward``'s).
        *input_tangents : numpy.ndarray or None
            One per positional input of the forward, each of that input's shape (``None``: zero;
            inputs without a gradient, such as token ids, take ``None``), as ``jvp`` takes them.
        param_tangents : mapping of str to numpy.ndarray, optional
            Tangents of parameters by their ``named_parameters`` names; missing ones are zero.
        ddy : numpy.ndarray, optional
            The tangent of ``dy`` (``None``: zero), of ``dy``'s shape.

        Returns
        -------
        dx : numpy.ndarray or tuple or None
            Exactly what ``backward(dy)`` returns.
        dx_tangent : numpy.ndarray or tuple or None
            Its tangent, of the same structure and shapes (``None`` where ``dx`` is ``None``).

        Raises
        ------
        RuntimeError
            With no forward state (as ``backward``) or when a parameter changed since the forward.
        NotImplementedError
            When the module has no second order (no ``_backward_jvp``); nothing is consumed.
        ValueError, TypeError
            ``dy`` or ``ddy`` of the wrong shape, an unknown parameter name, a tangent of the wrong
            shape or kind, or a ``p.grad_tangent`` that cannot accumulate.
        """
        dy = self._check_dy(dy)
        if ddy is not None:
            ddy = self._check_dy(ddy, "ddy")
        entry, inputs = self._states[-1], tuple(input_tangents)
        kept = entry.jvp_tangents  # released with the state
        if (
            kept is not None
            and not isinstance(param_tangents, ParamTangents)
            and (param_tangents is None or hasattr(param_tangents, "items"))
            and kept.matches(inputs, param_tangents)
        ):  # this state's jvp along the same values: its forward tangents, found by its arrays
            inputs, param_tangents = kept.inputs, kept.pt
        elif not isinstance(param_tangents, ParamTangents):  # a composite's children share theirs
            param_tangents = self._param_tangents(param_tangents)._remembering()
        self._check_grad_tangents()
        result = self._backward_jvp(entry.cache, dy, inputs, param_tangents, ddy)
        self._release(entry)
        return result

    def _release(self, entry) -> None:
        """Drop the saved state ``entry`` (a hook that popped it itself changes nothing)."""
        for i in range(len(self._states) - 1, -1, -1):
            if self._states[i] is entry:
                del self._states[i]
                return

    def _check_grad_tangents(self) -> None:
        """``TypeError`` (before anything is consumed or accumulated) when a ``p.grad_tangent``
        is neither ``None`` nor a writeable float array of the parameter's shape."""
        for name, p in self._param_list():
            g = getattr(p, "grad_tangent", None)
            if g is not None and not (
                isinstance(g, np.ndarray) and g.shape == p._data.shape and g.dtype.kind == "f" and g.flags.writeable
            ):
                got = f"shape {g.shape}, dtype {g.dtype}" if isinstance(g, np.ndarray) else type(g).__name__
                raise TypeError(
                    f"{type(self).__name__}.backward_jvp: parameter {name!r} has a grad_tangent that cannot "
                    f"accumulate (expected None or a writeable float array of shape {p._data.shape}, got {got}); "
                    "nothing was accumulated"
                )

    def _backward_jvp(self, state, dy, input_tangents, param_tangents, ddy):
        """Second-order hook: ``(dx, dx_tangent)`` from the saved ``state`` (what ``forward``
        gave ``save_for_backward``; ``backward_jvp`` releases it after the hook returns), the
        checked ``dy``, ``input_tangents`` (a tuple, ``None`` = zero), ``param_tangents`` (a
        :class:`ParamTangents`) and ``ddy`` (``None`` = zero).  Adds each parameter's gradient
        with ``accumulate_grad`` and its tangent with ``accumulate_grad_tangent``.  The base class
        has no second order."""
        raise NotImplementedError(
            f"{type(self).__name__} has no second order (backward_jvp) yet: it does not implement "
            "_backward_jvp(state, dy, input_tangents, param_tangents, ddy)"
        )

    @staticmethod
    def accumulate_grad_tangent(param: Parameter, tangent) -> None:
        """Add ``tangent`` into ``param.grad_tangent`` (created when ``None``), as every
        ``_backward_jvp`` must; a ``None`` ``tangent`` adds nothing.

        Parameters
        ----------
        param : Parameter
            The parameter whose gradient's tangent grows.
        tangent : numpy.ndarray or None
            The tangent of its gradient from this ``backward_jvp``, of the parameter's shape.
        """
        if tangent is None:
            return
        if getattr(param, "grad_tangent", None) is None:
            param.grad_tangent = np.array(tangent, dtype=param.data.dtype, copy=True)
        else:
            param.grad_tangent += tangent

    def _accumulate_second(self, pairs) -> None:
        """``accumulate_grad`` and ``accumulate_grad_tangent`` for each ``(param, grad,
        grad_tangent)`` (a ``None`` parameter is skipped: an absent bias)."""
        for p, g, t in pairs:
            if p is not None:
                self.accumulate_grad(p, g)
                self.accumulate_grad_tangent(p, t)

    def _child_backward_jvp(self, child, dy, input_tangents, param_tangents, ddy):
        """``child``'s ``(dx, dx_tangent)`` from its latest state, for a composite's
        ``_backward_jvp`` (``dy`` and ``ddy`` already what the child's output takes; the child's
        state is consumed).  A child that overrides ``backward_jvp`` itself is called through it."""
        if type(child).backward_jvp is not Module.backward_jvp:
            return child.backward_jvp(dy, *input_tangents, param_tangents=param_tangents, ddy=ddy)
        if not child._states:
            raise child._no_state_error("backward_jvp")
        entry = child._states[-1]
        child._check_versions(entry)
        result = child._backward_jvp(entry.cache, dy, tuple(input_tangents), param_tangents, ddy)
        child._release(entry)
        return result

    # -- traversal --------------------------------------------------------------------------
    def named_modules(self, prefix: str = ""):
        """Yield ``(dotted_name, module)`` for this module (name ``prefix``) and every submodule.

        Parameters
        ----------
        prefix : str
            Prepended to every name (``""``: this module is ``""``, its children ``"linear1"``, ...).
        """
        yield prefix, self
        for name, m in self._modules.items():
            yield from m.named_modules(f"{prefix}.{name}" if prefix else name)

    def modules(self):
        """Yield this module and every submodule, depth first (as ``named_modules``)."""
        for _, m in self.named_modules():
            yield m

    def children(self):
        """An iterator over the direct submodules, in registration order."""
        return iter(self._modules.values())

    def named_parameters(self, prefix: str = ""):
        """``(dotted_name, Parameter)`` in registration order, own parameters first."""
        for name, p in self._parameters.items():
            yield (f"{prefix}.{name}" if prefix else name), p
        for name, m in self._modules.items():
            yield from m.named_parameters(f"{prefix}.{name}" if prefix else name)

    def parameters(self):
        """Yield every ``Parameter`` (as ``named_parameters``, without the names)."""
        for _, p in self.named_parameters():
            yield p

    def named_buffers(self, prefix: str = ""):
        """Yield ``(dotted_name, array)`` for every buffer of this module and its submodules."""
        for name in self._buffers:
            yield (f"{prefix}.{name}" if prefix else name), getattr(self, name)
        for name, m in self._modules.items():
            yield from m.named_buffers(f"{prefix}.{name}" if prefix else name)

    def zero_grad(self) -> None:
        """Set every parameter's ``.grad`` to zeros (``Parameter.zero_grad``)."""
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
        """Evaluation mode: ``train(False)``.  Returns self."""
        return self.train(False)

    @property
    def dtype(self):
        """The module's floating dtype (float64 unless constructed or cast ``to`` another)."""
        return getattr(self, "_dtype", np.dtype(np.float64))

    def to(self, dtype):
        """Cast every parameter (data and grad) and float buffer to ``dtype`` in place; returns self."""
        dt = check_dtype(dtype)
        for m in self.modules():
            object.__setattr__(m, "_dtype", dt)
            m._states.clear()
            m.__dict__.pop("_ws", None)
            _state.scratch = None
            for p in m._parameters.values():
                p.data = p.data.astype(dt)  # bumps the version
                p.grad = None if p.grad is None else p.grad.astype(dt)
                if getattr(p, "grad_tangent", None) is not None:
                    p.grad_tangent = p.grad_tangent.astype(dt)
            for name in m._buffers:
                b = getattr(m, name)
                if b.dtype.kind == "f":
                    object.__setattr__(m, name, b.astype(dt))
        return self

    def num_parameters(self) -> int:
        """The number of scalar parameters (tied parameters counted once per name)."""
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
                if isinstance(p.data, BFloat16Array):  # kept as bfloat16: the values rounded into its bits
                    to_bfloat16_bits(arr, out=p.data.bits)
                else:
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
        """Text inside the parentheses of ``repr(module)``; subclasses override it."""
        return ""

    def __repr__(self):
        lines = [f"{type(self).__name__}({self.extra_repr()}"]
        if self._modules:
            for name, m in self._modules.items():
                sub = repr(m).replace("\n", "\n  ")
                lines.append(f"  ({name}): {sub}")
            return "\n".join(lines) + "\n)"
        return lines[0] + ")"


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

"""Containers: ``ModuleList`` (a list of submodules), ``Sequential`` (a chain with its backward)
and ``ParallelSum`` (branches on the same input, their outputs summed).

Both name their children ``0``, ``1``, ... so state-dict keys read ``0.weight``, ``1.bias``, as
torch's ``nn.ModuleList`` / ``nn.Sequential`` (and a ``Sequential`` inside a model gives
``layers.0.weight``).

``Sequential``'s backward is the chain rule of a chain: the children's backwards in reverse order,
each fed the gradient the next one returned.  Its forward mode is the same chain run forwards:
each child's ``_jvp`` from the state it saved in this call; its second order (``backward_jvp``)
runs both: the tangents of the children's inputs forwards, their ``backward_jvp`` backwards.  A
module may appear twice in one ``Sequential`` (shared weights): each call keeps its own state, the
two backwards add both gradients into the shared parameters.
"""

from __future__ import annotations

import math
from collections import OrderedDict

from . import module
from .module import Module

__all__ = ["ModuleList", "ParallelSum", "Sequential"]


def _check_module(m, where: str) -> Module:
    if not isinstance(m, Module):
        raise TypeError(f"{where}: expected a Module, got {type(m).__name__}")
    return m


class ModuleList(Module):
    """A list of submodules, named ``0``, ``1``, ... in state dicts (as ``torch.nn.ModuleList``).

    It registers its modules (their parameters appear in ``named_parameters`` as ``0.weight``,
    ...) but has no forward of its own: the owning module decides how to call them.

    Parameters
    ----------
    modules : iterable of Module, optional
        The initial modules, in order.

    Raises
    ------
    TypeError
        For an item that is not a ``Module``.

    Examples
    --------
    >>> import npattn
    >>> layers = npattn.ModuleList([npattn.Linear(4, 4, rng=0), npattn.Linear(4, 2, rng=1)])
    >>> len(layers), [name for name, _ in layers.named_parameters()]
    (2, ['0.weight', '0.bias', '1.weight', '1.bias'])
    """

    def __init__(self, modules=()) -> None:
        super().__init__()
        for m in modules:
            self.append(m)

    def append(self, m: Module) -> "ModuleList":
        """Add ``m`` at the end (named ``str(len(self))``); returns self."""
        _check_module(m, f"{type(self).__name__}.append")
        setattr(self, str(len(self._modules)), m)
        return self

    def extend(self, modules) -> "ModuleList":
        """Append every module of ``modules``; returns self."""
        for m in modules:
            self.append(m)
        return self

    def __getitem__(self, i):
        """``self[i]`` (a module; negative indices count from the end) or ``self[a:b]`` (a new
        container of the same type holding those modules)."""
        items = list(self._modules.values())
        if isinstance(i, slice):
            return type(self)(items[i]) if type(self) is ModuleList else Sequential(*items[i])
        return items[i]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())


# its old path: ``npattn.nn.module.ModuleList`` (module.py does not import this file: no import circle)
setattr(module, "ModuleList", ModuleList)


class Sequential(ModuleList):
    """Run modules one after another: ``y = m_n(... m_2(m_1(x)))``, as ``torch.nn.Sequential``.

    ``backward(dy)`` runs the children's backwards in reverse order and returns the input's
    gradient; ``jvp(tx, param_tangents=...)`` runs their forward modes in order.  Keys ``0.*``,
    ``1.*``, ... (or the given names when built from an ``OrderedDict``).

    Parameters
    ----------
    *modules : Module
        The chain, in order; or a single ``OrderedDict`` of ``name: module``.

    Raises
    ------
    TypeError
        For an item that is not a ``Module``.
    ValueError
        For a name of the ``OrderedDict`` that is empty, not a string or holds a dot.

    Examples
    --------
    >>> import numpy as np, npattn
    >>> net = npattn.nn.Sequential(npattn.Linear(4, 8, rng=0), npattn.LayerNorm(8), npattn.Linear(8, 2, rng=1))
    >>> y = net(np.ones((3, 4)))
    >>> dx = net.backward(np.ones_like(y))
    >>> list(net.state_dict())[:2]
    ['0.weight', '0.bias']
    """

    def __init__(self, *modules) -> None:
        if len(modules) == 1 and isinstance(modules[0], (OrderedDict, dict)):
            Module.__init__(self)
            for name, m in modules[0].items():
                if not isinstance(name, str) or not name or "." in name:
                    raise ValueError(f"Sequential: expected module names without dots, got {name!r}")
                setattr(self, name, _check_module(m, f"Sequential[{name!r}]"))
            return
        super().__init__(modules)

    def forward(self, x):
        """Feed ``x`` through every module in order and return the last output.

        Parameters
        ----------
        x : numpy.ndarray
            The first module's input.

        Returns
        -------
        numpy.ndarray
            The last module's output.
        """
        used = []  # (child, index of the state this call saved, or None)
        for m in self:
            before = m.num_saved
            x = m(x)
            used.append(len(m._states) - 1 if m.num_saved > before else None)
        self.save_for_backward(tuple(used))
        return x

    def backward(self, dy):
        """Backward through the chain: each module's ``backward``, last to first.

        Parameters
        ----------
        dy : numpy.ndarray
            Gradient of the loss with respect to the output.

        Returns
        -------
        numpy.ndarray or None
            Gradient with respect to the input (None when the first module has none, e.g. an
            ``Embedding``).

        Raises
        ------
        RuntimeError
            Without a forward state (as every module).
        """
        dy = self._check_dy(dy)
        self.pop_saved()
        for m in reversed(list(self)):
            dy = m.backward(dy)
        return dy

    def _jvp(self, state, input_tangents, param_tangents):
        t = input_tangents[0] if input_tangents else None
        if len(input_tangents) > 1:
            raise TypeError(f"Sequential.jvp: expected at most one input tangent, got {len(input_tangents)}")
        for m, index in zip(self, state):
            if index is None:
                raise RuntimeError(f"Sequential.jvp: {type(m).__name__} kept no state in this forward")
            t = self._child_jvp(m, index, (t,), param_tangents)
        return t

    def _backward_jvp(self, state, dy, input_tangents, param_tangents, ddy):
        """Second order of the chain: each child's input tangent from the forward's chain run on
        tangents (its ``_jvp`` from the state it saved in this call), then each child's
        ``backward_jvp``, last to first, fed the tangent of its input and of its upstream
        gradient (the next child's ``dx_tangent``)."""
        if len(input_tangents) > 1:
            raise TypeError(f"Sequential.backward_jvp: expected at most one input tangent, got {len(input_tangents)}")
        t = input_tangents[0] if input_tangents else None
        inputs = []
        for m, index in zip(self, state):
            if index is None:
                raise RuntimeError(f"Sequential.backward_jvp: {type(m).__name__} kept no state in this forward")
            inputs.append(t)
            if len(inputs) < len(state):  # the last output's tangent is not needed
                t = self._child_jvp(m, index, (t,), param_tangents)
        for m, t in zip(reversed(list(self)), reversed(inputs)):
            dy, ddy = self._child_backward_jvp(m, dy, (t,), param_tangents, ddy)
        return dy, ddy


class ParallelSum(Module):
    """Branches on the same input, summed: ``y = sum_k out_k * m_k(in_k * x)``.

    Falcon-H1's decoder layer runs its attention and its Mamba-2 mixer side by side on the same
    normalised input this way, each with its muP factors (``attention_in_multiplier`` and
    ``attention_out_multiplier``, ``ssm_in_multiplier`` and ``ssm_out_multiplier``).  The factors
    are plain numbers applied in every pass (forward, backward, JVP, second order), not folded
    into the branches' weights: ``dx = sum_k in_k * m_k.backward(out_k * dy)``.

    Parameters
    ----------
    branches : mapping of str to Module
        The branches by name (their state-dict prefixes), in the order they run.
    input_multipliers, output_multipliers : mapping of str to float, optional
        Each branch's factor of its input and of its output (a branch left out: 1).

    Raises
    ------
    TypeError
        A branch that is not a ``Module``.
    ValueError
        A bad name (empty, with a dot, or a multiplier's name that is no branch) or a factor that is
        not a finite number.

    Notes
    -----
    ``forward(x, use_cache=True)`` passes ``use_cache`` to every branch that keeps a decoding cache
    (one with ``reset_kv_cache``; a position-wise branch such as Cohere's MLP beside its attention
    has none and takes no such argument); ``branch_kwargs`` gives a branch its own keyword arguments by its name (a
    padding mask in the form it takes).  ``reset_kv_cache()`` resets every branch that has one.

    Examples
    --------
    >>> import numpy as np, npattn
    >>> par = npattn.nn.ParallelSum({"a": npattn.Linear(4, 4, rng=0), "b": npattn.Linear(4, 4, rng=1)},
    ...                             output_multipliers={"b": 0.5})
    >>> x = np.ones((2, 4))
    >>> bool(np.allclose(par(x), par.a(x) + 0.5 * par.b(x)))
    True
    >>> par(x).shape, par.backward(np.ones((2, 4))).shape
    ((2, 4), (2, 4))
    """

    def __init__(self, branches, *, input_multipliers=None, output_multipliers=None) -> None:
        super().__init__()
        names = []
        for name, m in dict(branches).items():
            if not isinstance(name, str) or not name or "." in name:
                raise ValueError(f"ParallelSum: expected branch names without dots, got {name!r}")
            setattr(self, name, _check_module(m, f"ParallelSum[{name!r}]"))
            names.append(name)
        if not names:
            raise ValueError("ParallelSum: expected at least one branch, got none")
        self._names = tuple(names)
        self._in = self._factors(input_multipliers, "input_multipliers")
        self._out = self._factors(output_multipliers, "output_multipliers")

    def _factors(self, given, what: str) -> dict:
        """``{name: factor}`` of the branches whose factor is not 1."""
        out = {}
        for name, v in dict(given or {}).items():
            if name not in self._names:
                raise ValueError(f"{what}: {name!r} is no branch (branches: {list(self._names)})")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{what}[{name!r}]: expected a finite number, got {v!r}")
            if float(v) != 1.0:
                out[name] = float(v)
        return out

    def branches(self) -> tuple:
        """``((name, module), ...)`` in the order they run."""
        return tuple((n, self._modules[n]) for n in self._names)

    @staticmethod
    def _scaled(a, factor):
        return a if factor is None or a is None else a * factor

    def forward(self, x, *, use_cache: bool = False, branch_kwargs=None):
        """``sum_k out_k * m_k(in_k * x, **branch_kwargs[k])``.

        Parameters
        ----------
        x : numpy.ndarray
            The input every branch takes.
        use_cache : bool
            Decode incrementally (passed to every branch that has a decoding cache).
        branch_kwargs : mapping of str to mapping, optional
            Keyword arguments of a branch by its name.

        Returns
        -------
        numpy.ndarray
            The sum of the branches' scaled outputs.
        """
        kwargs = dict(branch_kwargs or {})
        unknown = set(kwargs) - set(self._names)
        if unknown:
            raise ValueError(f"branch_kwargs: {sorted(unknown)[0]!r} is no branch (branches: {list(self._names)})")
        y = None
        for name, m in self.branches():
            kw = dict(kwargs.get(name) or {})
            if use_cache and callable(getattr(m, "reset_kv_cache", None)):
                kw["use_cache"] = True
            out = self._scaled(m(self._scaled(x, self._in.get(name)), **kw), self._out.get(name))
            y = out if y is None else y + out
        self.save_for_backward(None)
        return y

    def backward(self, dy):
        """``sum_k in_k * m_k.backward(out_k * dy)``, the branches last to first."""
        dy = self._check_dy(dy)
        self.pop_saved()
        dx = None
        for name, m in reversed(self.branches()):
            d = self._scaled(m.backward(self._scaled(dy, self._out.get(name))), self._in.get(name))
            dx = d if dx is None else dx + d
        return dx

    def _jvp(self, state, input_tangents, param_tangents):
        """Forward mode: ``sum_k out_k * m_k'(in_k * tx)`` (each branch's ``_jvp`` of this call)."""
        if len(input_tangents) > 1:
            raise TypeError(f"ParallelSum.jvp: expected at most one input tangent, got {len(input_tangents)}")
        tx = input_tangents[0] if input_tangents else None
        ty = None
        for name, m in self.branches():
            t = self._child_jvp(m, -1, (self._scaled(tx, self._in.get(name)),), param_tangents)
            t = self._scaled(t, self._out.get(name))
            ty = t if ty is None else ty + t
        return ty

    def _backward_jvp(self, state, dy, input_tangents, param_tangents, ddy):
        """Second order: each branch's ``backward_jvp`` on ``(out_k dy, out_k ddy)`` with its input's
        tangent ``in_k tx``, the pairs times ``in_k`` and summed."""
        if len(input_tangents) > 1:
            raise TypeError(f"ParallelSum.backward_jvp: expected at most one input tangent, got {len(input_tangents)}")
        tx = input_tangents[0] if input_tangents else None
        dx = tdx = None
        for name, m in reversed(self.branches()):
            fi, fo = self._in.get(name), self._out.get(name)
            d, td = self._child_backward_jvp(
                m, self._scaled(dy, fo), (self._scaled(tx, fi),), param_tangents, self._scaled(ddy, fo)
            )
            d, td = self._scaled(d, fi), self._scaled(td, fi)
            dx = d if dx is None else dx + d
            tdx = td if tdx is None else tdx + td
        return dx, tdx

    def reset_kv_cache(self) -> None:
        """Empty every branch's decoding cache (a branch without one is left alone)."""
        for _, m in self.branches():
            reset = getattr(m, "reset_kv_cache", None)
            if callable(reset):
                reset()

    def extra_repr(self) -> str:
        """The factors other than 1, shown by ``repr(module)``."""
        parts = [f"input_multipliers={self._in}"] if self._in else []
        return ", ".join(parts + ([f"output_multipliers={self._out}"] if self._out else []))

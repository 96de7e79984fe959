"""Containers: ``ModuleList`` (a list of submodules) and ``Sequential`` (a chain with its backward).

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

from collections import OrderedDict

from . import module
from .module import Module

__all__ = ["ModuleList", "Sequential"]


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

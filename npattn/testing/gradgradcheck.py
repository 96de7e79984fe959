"""Check hand-written second derivatives (forward over reverse) against central differences.

``gradgradcheck(target, *inputs)`` checks ``backward_jvp``, the directional derivative of the
backward's gradients, with :func:`gradcheck`'s own forward-mode check: the "function" is the
backward, the gradients it returns as a function of the inputs (and parameters) and of the
upstream gradient ``dout``, and its "forward mode" is ``backward_jvp``'s ``grad_tangents``::

    >>> import numpy as np
    >>> import npattn
    >>> from npattn import functional as F
    >>> report = npattn.gradgradcheck(F.softmax, np.random.default_rng(0).standard_normal((2, 3)))
    >>> report.ok, [row.name for row in report.rows]
    (True, ['dx along x', 'dx along dout', 'hessian'])

Each tensor that the backward reads (every checked input, every parameter of a module, and
``dout``, ``dy`` for a module) moves along a random tangent of its own, and every gradient's
tangent from ``backward_jvp`` is compared, element by element, with the central difference of
that gradient along it: a row ``"dx along x"`` per pair, with gradcheck's steps (the typical
element's of the moved tensor, ``u**(1/3)`` times its scale), tolerances (the difference's
rounding, ``rtol`` and a floor) and second and third looks with smaller steps, so that a right
``backward_jvp`` passes at any scale, and one element off by 1e-3 of the largest, or a tangent
scaled by ``1 + 1e-3``, fails.  The floor is ``64 u`` times the gradient's resolution over the
step: its largest element or, if larger, ``max |out * dout|`` over its tensor's typical
magnitude (gradcheck's floor for that gradient, per output: the terms the backward adds up, which
may cancel, as softmax's ``y (dout - <dout, y>)`` at saturated scores).  Moving ``dout`` checks the
``ddout`` term; the backward is linear in it, so the difference has no truncation error and its
step is ``dout``'s typical magnitude (the rounding over the step at its smallest).

The row ``"hessian"`` (mode ``"symmetry"``) checks ``<u, H v> = <H u, v>`` for two random
tangents ``u, v`` of all the moved inputs and parameters at once (``dout`` held fixed), ``H v``
being ``backward_jvp``'s ``grad_tangents`` along ``v``: ``H`` is the Hessian of the scalar
``<dout, out>`` (the loss itself when the output is a scalar, as ``cross_entropy``'s mean), so it
is symmetric whatever the output's shape; a backward that is no gradient (its tangents right
for it, but its "Hessian" not symmetric) fails there and nowhere else.  Both sides are analytic,
so the tolerance is their rounding (``64 u`` times the terms' magnitudes).

This module imports numpy and the standard library only.
"""

from __future__ import annotations

import copy
import math
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import numpy as np

from ..nn.module import Module
from .gradcheck import (
    _C_FLOOR,
    _RTOL,
    _U,
    GradcheckError,
    GradcheckReport,
    GradcheckRow,
    _as_output,
    _as_tuple,
    _check_arguments,
    _check_jvp,
    _companion,
    _functional_setup,
    _module_setup,
    _normalise_wrt,
    _Options,
    _pair_grads,
    _pow2,
    _Problem,
    _refuse_class,
    _renamed,
    _row,
    _scale,
    _steps,
    _unique_names,
)

__all__ = ["gradgradcheck"]

_EXPECTED = "a forward function, a (forward, backward, backward_jvp) tuple or a Module instance"
_MODULE_SIGNATURE = "backward_jvp(dy, *input_tangents, param_tangents=None, ddy=None) -> (dx, dx_tangent)"


class _SecondOrder(NamedTuple):
    """A target made ready for its second order: ``moved`` the arrays that the backward reads
    (perturbed in place: the inputs' copies, the parameters' data, the upstream gradient, named
    ``upstream``); ``grads()`` the backward's gradients at their current values, by name;
    ``grad_tangents({name: tangent})`` ``backward_jvp``'s tangents of those gradients when the
    named tensors move along the tangents (the upstream gradient's is ``ddout``)."""

    label: str
    moved: List[Tuple[str, np.ndarray]]
    upstream: str
    grads: Callable[[], Dict[str, np.ndarray]]
    grad_tangents: Callable[[Dict[str, np.ndarray]], Dict[str, np.ndarray]]
    t0: float  # sum |out * dout| at the point: the scale of <dout, out>'s terms
    scales: Dict[str, float]  # the typical magnitude of each tensor with a gradient


def gradgradcheck(
    target,
    *inputs,
    seed=0,
    eps=None,
    rtol=None,
    atol=None,
    wrt=None,
    raise_exception=False,
    **forward_kwargs,
) -> GradcheckReport:
    """Compare ``backward_jvp`` with central differences of the backward, and check ``<u, Hv> = <Hu, v>``.

    Parameters
    ----------
    target : callable, tuple or Module
        * a functional forward ``op`` returning ``(out, cache)``: its backward is ``<op
          name>_backward`` and its second order ``<op name>_backward_jvp(dout, cache, tangents,
          ddout=None) -> (grads, grad_tangents)`` in the same python module;
        * a ``(forward, backward, backward_jvp)`` tuple with the same protocol;
        * a :class:`npattn.Module` instance with ``backward_jvp(dy, *input_tangents,
          param_tangents=None, ddy=None) -> (dx, dx_tangent)`` (each parameter's gradient added
          into ``p.grad``, its tangent into ``p.grad_tangent``): deep-copied (the caller's module
          is untouched), called as ``m(*inputs, **forward_kwargs)``; the gradients are the inputs'
          and every float parameter's, the tensors moved the inputs, the parameters and ``dy``.
    *inputs
        The positional inputs, as :func:`gradcheck` takes them (float arrays are moved and get
        gradients; integer ids, bool masks and other values are constants).
    seed : int
        Seeds the upstream gradient (as gradcheck's: ``default_rng(seed).standard_normal``) and
        the tangents.
    eps : float, optional
        The finite-difference step; ``None`` (default): ``u**(1/3)`` times the typical magnitude
        of the moved tensor, as gradcheck's forward mode takes it.
    rtol : float, optional
        Relative part of the tolerance; ``None`` is ``1e-5``.
    atol : float, optional
        Absolute floor of the tolerance; ``None`` (default) is the gradient's own resolution
        (``64 u max|gradient| / step``).
    wrt : str or sequence of str, optional
        The tensors to move (default: all): input and parameter names as gradcheck's ``wrt``,
        and ``"dout"`` (``"dy"`` for a module) for the upstream gradient.  Every gradient is
        compared along each; the symmetry row uses the named inputs and parameters.
    raise_exception : bool
        Raise :class:`GradcheckError` (carrying the report) when a check fails.
    **forward_kwargs
        Passed to the forward.

    Returns
    -------
    GradcheckReport
        One row ``"d<gradient> along <moved>"`` (mode ``"backward_jvp"``) per gradient and moved
        tensor, whose ``at`` indexes the gradient, and a row ``"hessian"`` (mode ``"symmetry"``);
        ``str(report)`` is a table titled ``gradgradcheck``.

    Raises
    ------
    GradcheckError
        With ``raise_exception=True`` when a check fails.
    TypeError
        A target without a second order (no ``<op>_backward_jvp``, a module without
        ``backward_jvp`` or whose ``backward_jvp`` raises ``NotImplementedError``), a tuple that
        is not ``(forward, backward, backward_jvp)``, or bad arguments (as gradcheck's).
    ValueError
        Bad arguments, unknown ``wrt`` names, or results of the wrong number or shape.
    RuntimeError
        When the forward modifies its inputs or gives two different outputs at the same point.

    Examples
    --------
    >>> import numpy as np
    >>> import npattn
    >>> from npattn import functional as F
    >>> rng = np.random.default_rng(0)
    >>> logits, targets = rng.standard_normal((4, 5)), np.array([0, 2, 4, 1])
    >>> npattn.gradgradcheck(F.cross_entropy, logits, targets).ok      # a scalar loss: its Hessian
    True
    >>> def wrong(dout, cache, tangents, ddout=None):                   # a tangent 0.1% too large
    ...     grads, tangents = F.softmax_backward_jvp(dout, cache, tangents, ddout)
    ...     return grads, tangents * 1.001
    >>> report = npattn.gradgradcheck((F.softmax, F.softmax_backward, wrong), logits)
    >>> report.failed                                    # (scaled alike, H stays symmetric)
    ['dx along x', 'dx along dout']
    """
    _check_arguments(inputs, seed, eps, rtol, atol, raise_exception=raise_exception)
    names = _normalise_wrt(wrt)
    prepare, label = _resolve(target)
    upstream = "dy" if isinstance(target, Module) else "dout"
    inner = [n for n in names if n != upstream] if names is not None else None
    opts = _Options(int(seed), eps, float(rtol) if rtol is not None else _RTOL, atol, inner or None, False, "fwd")
    problem = prepare(inputs, forward_kwargs, opts)
    moved = problem.moved
    if names is not None:
        moved = [(n, a) for n, a in moved if n in names or (n == problem.upstream and upstream in names)]
    report = GradcheckReport(
        _rows(problem, moved, opts), target=label, eps=eps, rtol=opts.rtol, atol=atol, kind="gradgradcheck"
    )
    if raise_exception and not report.ok:
        raise GradcheckError(report)
    return report


def _resolve(target):
    """``(prepare(inputs, kwargs, opts) -> _SecondOrder, label)`` for any target."""
    _refuse_class(target, _EXPECTED)
    if isinstance(target, Module):
        if not callable(getattr(target, "backward_jvp", None)):
            raise TypeError(
                f"target: {type(target).__name__} has no {_MODULE_SIGNATURE}, the second order gradgradcheck "
                "checks (define it on the module, or check a functional pair with its <op>_backward_jvp)"
            )
        base = target

        def prepare_module(inputs, kwargs, opts):
            return _module_second_order(base, inputs, kwargs, opts)

        return prepare_module, type(target).__name__
    if isinstance(target, tuple):
        if len(target) != 3 or not all(callable(t) for t in target):
            raise TypeError(
                f"target: expected a (forward, backward, backward_jvp) tuple of callables, got a tuple of "
                f"{len(target)} item(s)" + (" (the second order needs backward_jvp)" if len(target) == 2 else "")
            )
        forward, backward, backward_jvp = target
    elif callable(target):
        forward = target
        fname = getattr(forward, "__name__", None)
        backward, backward_jvp = _companion(forward, "_backward"), _companion(forward, "_backward_jvp")
        for what, found in (("_backward", backward), ("_backward_jvp", backward_jvp)):
            if not callable(found):
                raise TypeError(
                    f"target: no '{fname}{what}' next to {fname!r} in module {getattr(forward, '__module__', None)!r} "
                    "(gradgradcheck needs the backward and its second order <op>_backward_jvp); pass a "
                    "(forward, backward, backward_jvp) tuple"
                )
    else:
        raise TypeError(f"target: expected {_EXPECTED}, got {type(target).__name__}")

    def prepare_functional(inputs, kwargs, opts):
        return _functional_second_order(forward, backward, backward_jvp, inputs, kwargs, opts)

    return prepare_functional, getattr(forward, "__name__", "forward")


def _shaped(values: Dict[str, object], like: Dict[str, np.ndarray], what: str) -> Dict[str, np.ndarray]:
    """``values`` as float64 copies, each checked against the shape of the gradient it is the tangent of."""
    out = {}
    for name, ref in like.items():
        v = values[name]
        if v is None:
            raise ValueError(f"{what} returned None as the tangent of the gradient of {name!r}; expected an array")
        v = np.asarray(v)
        if v.shape != ref.shape:
            raise ValueError(
                f"{what}: the tangent of the gradient of {name!r} has shape {v.shape}, expected {ref.shape} "
                "(the gradient's)"
            )
        out[name] = _as_output(v)
    return out


def _two(result, what: str, names: str):
    if not (isinstance(result, tuple) and len(result) == 2):
        raise TypeError(f"{what}: expected it to return {names}, got {type(result).__name__}")
    return result


def _functional_second_order(forward, backward, backward_jvp, inputs, kwargs, opts) -> _SecondOrder:
    s = _functional_setup(forward, backward, inputs, kwargs, opts, np.float64, None)
    g = np.array(s.g, dtype=np.float64)  # the upstream gradient, moved like the inputs
    upstream = _unique_names(["dout"], taken=list(s.raw))[0]
    what = getattr(backward_jvp, "__name__", "backward_jvp")

    def grads():
        results = _as_tuple(backward(g, s.call()[1]))
        return {name: _as_output(results[slot]) for name, slot in s.slots.items()}

    def grad_tangents(by_name):
        tangents = tuple(s.tangents({n: t for n, t in by_name.items() if n != upstream}, np.float64))
        _, cache = s.call()
        _, results = _two(backward_jvp(g, cache, tangents, by_name.get(upstream)), what, "(grads, grad_tangents)")
        results = _as_tuple(results)
        if len(results) != s.n_slots:
            raise ValueError(
                f"{what} returned {len(results)} grad_tangent(s), expected {s.n_slots} (one per result of the backward)"
            )
        return _shaped({name: results[slot] for name, slot in s.slots.items()}, s.raw, what)

    return _SecondOrder(s.label, s.checked + [(upstream, g)], upstream, grads, grad_tangents, *_scales(s))


def _scales(s) -> Tuple[float, Dict[str, float]]:
    """``(sum |out * dout|, {name: typical magnitude})`` of a gradcheck setup."""
    t0 = float(np.max(np.abs(_as_output(s.out) * s.g), initial=0.0))
    return t0, {name: _scale(arr) for name, arr in s.tensors.items()}


def _module_second_order(target: Module, inputs, kwargs, opts) -> _SecondOrder:
    m = copy.deepcopy(target)
    m.clear_saved()
    m.to(np.float64)
    s = _module_setup(m, inputs, kwargs, opts, np.float64, None)
    g = np.array(s.g, dtype=np.float64)
    upstream = _unique_names(["dy"], taken=list(s.raw) + s.in_names)[0]
    what = f"{s.label}.backward_jvp"

    def collect(dx, attr: str, label: str) -> Dict[str, object]:
        pairs = _pair_grads(_as_tuple(dx), s.inputs, s.in_names, label)
        got: Dict[str, object] = {s.in_names[i]: grad for i, (_, grad) in pairs.items()}
        for name, p in s.params.items():
            value = getattr(p, attr, None)
            got[name] = np.zeros(p.data.shape) if value is None else value
        return got

    def grads():
        m.clear_saved()
        s.call()
        m.zero_grad()
        return {n: _as_output(v) for n, v in collect(m.backward(g), "grad", f"{s.label}.backward").items()}

    def grad_tangents(by_name):
        input_tangents, param_tangents = s.tangents({n: t for n, t in by_name.items() if n != upstream}, np.float64)
        m.clear_saved()
        s.call()
        m.zero_grad()
        for p in s.params.values():  # what backward_jvp adds to (zero_grad may not know it yet)
            if isinstance(getattr(p, "grad_tangent", None), np.ndarray):
                p.grad_tangent[...] = 0
        try:
            result = m.backward_jvp(g, *input_tangents, param_tangents=param_tangents, ddy=by_name.get(upstream))
        except NotImplementedError as e:
            raise TypeError(f"target: {what} is not implemented ({e}); gradgradcheck needs {_MODULE_SIGNATURE}") from e
        _, dx_tangent = _two(result, what, "(dx, dx_tangent)")
        return _shaped(collect(dx_tangent, "grad_tangent", f"{what}'s dx_tangent"), s.raw, what)

    return _SecondOrder(s.label, s.checked + [(upstream, g)], upstream, grads, grad_tangents, *_scales(s))


def _rows(problem: _SecondOrder, moved, opts: _Options) -> List[GradcheckRow]:
    """gradcheck's forward-mode check of each gradient along each moved tensor, then the symmetry."""
    base = problem.grads()
    # each gradient's resolution, the floor of its tangent's check (times 64 u / step): its largest
    # element or, when it cancelled (softmax's at saturated scores), gradcheck's floor for it,
    # sum |out * dout| over its tensor's scale
    resolution = {
        n: max(float(np.max(np.abs(b), initial=0.0)), problem.t0 / problem.scales[n]) for n, b in base.items()
    }
    rows: List[GradcheckRow] = []
    tangents = np.random.default_rng([opts.seed, 2])
    for name, arr in moved:
        # one evaluation serves every gradient: the backward at each perturbed point, backward_jvp
        # at each realised tangent (the same points and tangents for every gradient's check)
        at: Dict[bytes, Dict[str, np.ndarray]] = {}
        along: Dict[bytes, Dict[str, np.ndarray]] = {}

        def joined(arr=arr, at=at):
            key = arr.tobytes()
            if key not in at:
                at[key] = problem.grads()
            return at[key]

        def joined_tangent(moved_name, t, along=along):
            key = np.asarray(t).tobytes()
            if key not in along:
                along[key] = problem.grad_tangents({moved_name: t})
            return along[key]

        v = tangents.standard_normal(arr.shape)
        move = opts
        if name == problem.upstream and opts.eps is None:
            # the backward is linear in dout: a difference along it has no truncation error, so
            # the step is dout's typical magnitude (the rounding of the difference at its smallest)
            move = opts._replace(eps=float(_pow2(_scale(arr))))
        for part, value in base.items():
            check = _Problem(
                problem.label,
                lambda part=part, joined=joined: joined()[part],
                np.zeros_like(value),
                value,
                [(name, arr)],
                {},
                lambda moved_name, t, part=part, joined_tangent=joined_tangent: joined_tangent(moved_name, t)[part],
            )
            floor = _C_FLOOR * _U * resolution[part] / _steps(arr, move.eps)[0]
            part_opts = move if opts.atol is not None else move._replace(atol=floor)
            row, _ = _check_jvp(check, name, arr, v, part_opts, mode="backward_jvp")
            rows.append(_renamed(row, f"d{part} along {name}", in_output=False))
    symmetry = _symmetry_row(problem, moved, resolution, opts)
    return rows + ([symmetry] if symmetry is not None else [])


def _symmetry_row(problem: _SecondOrder, moved, resolution, opts: _Options) -> Optional[GradcheckRow]:
    """``<u, H v>`` against ``<H u, v>`` along random tangents of every moved input and parameter.

    Both sides are sums of analytic products, exact to the rounding of those sums (``64 u
    sqrt(n)`` times the magnitudes of their terms) and of each element of ``H t``: a gradient's
    tangent, resolved to ``64 u`` times the gradient's resolution per unit of relative move,
    ``max |t_m| / scale_m`` at most."""
    tensors = [(n, a) for n, a in moved if n != problem.upstream]
    if not tensors:
        return None
    rng = np.random.default_rng([opts.seed, 4])
    u, v = ({n: np.where(np.isfinite(a), rng.standard_normal(a.shape), 0.0) for n, a in tensors} for _ in range(2))
    hu, hv = problem.grad_tangents(u), problem.grad_tangents(v)
    lhs = sum(float(np.dot(u[n].reshape(-1), hv[n].reshape(-1))) for n in u)
    rhs = sum(float(np.dot(hu[n].reshape(-1), v[n].reshape(-1))) for n in u)
    terms = sum(float(np.sum(np.abs(u[n] * hv[n])) + np.sum(np.abs(hu[n] * v[n]))) for n in u)

    def relative(t):  # the largest relative move of a tangent
        return max(float(np.max(np.abs(t[n]), initial=0.0)) / problem.scales[n] for n in t)

    moves = sum(
        resolution[n] * (float(np.sum(np.abs(u[n]))) * relative(v) + float(np.sum(np.abs(v[n]))) * relative(u))
        for n in u
    )
    tol = _C_FLOOR * _U * (math.sqrt(sum(a.size for _, a in tensors)) * terms + moves)
    if opts.atol is not None:
        tol = max(tol, opts.atol)
    return _row("hessian", lhs, rhs, tol, tol, 1.0, "symmetry", None)

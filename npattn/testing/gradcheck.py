"""Check hand-written derivatives against central finite differences, in both modes.

``gradcheck(target, *inputs, **forward_kwargs)`` runs ``target`` once to get the analytic
gradients of ``f = sum(out * g)`` for a random upstream gradient ``g`` (never all ones, which
would hide transposition and broadcasting mistakes), estimates the same gradients by central
differences, one element at a time, and reports the worst error of every checked tensor::

    >>> import numpy as np
    >>> from npattn.functional import softmax
    >>> from npattn.testing import gradcheck
    >>> report = gradcheck(softmax, np.random.default_rng(0).standard_normal((2, 3)), axis=0)
    >>> report.ok
    True

``mode="fwd"`` checks the forward mode (``<op>_jvp``, ``Module.jvp``) against central
differences of the output along a random tangent; ``mode="both"`` checks both and the
transposition identity ``<g, J v> = <J^T g, v>`` that ties the two hand-written derivatives
together.  ``dtype=np.float32`` checks the float32 path of the target: its output against the
float64 path's, its gradients (and JVPs) against central differences of the float64 forward,
within float32 rounding (a mistake in a backward fails whatever dtype it shows in).

How the tolerance follows the finite-difference error
-----------------------------------------------------
With a step ``h`` the central difference ``(f(x + h) - f(x - h)) / 2h`` is off by

* truncation, ``h**2 |f'''| / 6``: the Taylor terms the difference does not cancel, and
* rounding, about ``u * sum|terms| / h`` (``u`` = 2.2e-16): each evaluation of ``f`` is exact
  only to ``u`` times the sum of the magnitudes of the terms ``out_j * g_j`` it adds up.

Both are balanced by ``h = u**(1/3) * scale``, about ``6e-6`` times the scale of the element:
``max(|x_i|, typical)``, the typical magnitude being the tensor's root mean square with each
magnitude capped at 8 times the median non-zero one (so one element of 1e6 among O(1) ones
is stepped by its own scale and does not set the others' step), rounded to a power of two, so
``x + h`` is exact more often; the step actually taken, ``(x + h) - x``, is the one divided
by.  A direction (``fast=True``, forward mode) moves every element by the typical element's
step along it, so that its tangent is the direction to rounding.  Only the outputs that the perturbation moves enter the
difference (``sum((out+ - out-) * g)``, the others cancel exactly), so the rounding estimate of
each element is ``u * sum_j (|out+_j| + |out-_j|) |g_j| / 2h`` over the moved outputs ``j``.

An element passes when ``|analytic - numerical| <= C * rounding + rtol * max(|analytic|,
|numerical|) + atol``, with ``C = 32`` (the forward's own rounding is a few ``u`` per output) and
``atol`` (default) a floor at the resolution of the analytic gradient itself, ``64 u sum|out *
g| / scale``.  An element that fails is looked at again with a step 64 times smaller: its truncation
error is 4096 times smaller (a 1/1024 share of the two estimates' difference joins the
tolerance), a ReLU kink that the first step straddled is cleared, and the rounding bound, 64
times larger, is still far below 1e-3 of the gradient.  If it still fails, a third look takes
half the step and counts every output in the rounding bound (an output that moved by less than
its last bit reads as unmoved): where truncation dominates the two estimates differ by three
times the truncation error of the smaller step, and that difference joins the tolerance.  A
wrong gradient agrees with itself at every step, so it still fails.  For a float64 op these tolerances
are some 1e-9 of the gradient's scale: a gradient off by 1e-3 of its largest element anywhere,
or scaled by ``1 + 1e-3``, fails, and a right one does not.

Forward mode compares every output element of the JVP with ``(out(x + h v) - out(x - h v)) / 2h``
in the same way, per output (rounding ``u (|out+| + |out-|) / 2h``, floor ``64 u max|out| / h``:
an output that is small because its forward cancelled, as gelu's ``1 + erf(-6)``, carries an error
of that size), with the same second look.  The transposition check needs no difference: both
sides are analytic, equal to the rounding of their sums of products.

Inputs: float inputs are copied and cast (the caller's arrays are never touched); integer
inputs (token ids, class targets) and bool masks are passed through untouched and get no
gradient; a list of floats counts as a float array; anything else that is not an ndarray
(``None``, python numbers, strings) is passed through as a constant.  Positional float arrays
are checked; a float array passed by keyword is a constant (``attn_mask=m``) unless the backward
appends a gradient for it (``sinks=``, ``mask_grad=True``).  ``wrt=`` names what to check;
``fast=True`` checks one random direction per tensor (two forwards each) instead of every
element.  Because ``eps``, ``rtol``, ``atol``, ``seed``, ``wrt``, ``fast``, ``mode``, ``dtype``
and ``raise_exception`` are this function's own keywords, an op's ``eps`` (``layer_norm``)
must be passed positionally.

Second order
------------
``gradgradcheck(target, *inputs)`` checks hand-written second derivatives (forward over
reverse) against central differences.  It checks ``backward_jvp``, the directional derivative of
the backward's gradients, with :func:`gradcheck`'s own forward-mode check: the "function" is the
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
import inspect
import math
import numbers
import sys
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from .._docs import shared_doc
from ..nn.module import Module, Parameter, no_grad

__all__ = ["gradcheck", "gradgradcheck", "GradcheckReport", "GradcheckRow", "GradcheckError", "numerical_gradient"]

_U = float(np.finfo(np.float64).eps)  # 2.2e-16: the unit of float64 rounding used in the bounds
_STEP = _U ** (1.0 / 3.0)  # 6.1e-6: the relative step that balances truncation and rounding
_C_ROUND = 32.0  # safety factor on the rounding estimate (calibrated: see tests/test_gradcheck_props.py)
_C_FLOOR = 64.0  # the analytic side's resolution, in units of u * (sum of |terms|)
_FINE = 64.0  # the second look's step is h / _FINE: truncation 4096 times smaller, clear of nearby kinks
_CAP = 8.0  # the typical scale caps each magnitude at 8 times the median non-zero one (see _scale)
_RTOL = 1e-5  # default relative tolerance (float64 checks)
_U32 = float(np.finfo(np.float32).eps)  # 1.2e-7
_C32 = 64.0  # safety factor of the float32 comparison, in float32 ulps and input sensitivities
_RTOL32 = _C32 * _U32  # default relative tolerance of the float32 path against float64 (7.6e-6)
_MODES = ("rev", "fwd", "both")
# each row mode: (how the report's title says it, the two numbers compared as where() names them)
_MODE_TEXT = {
    "element": ("per element", "analytic", "numerical"),
    "direction": ("one random direction per tensor", "analytic", "numerical"),
    "jvp": ("forward mode", "analytic", "numerical"),
    "transpose": ("<g, Jv> = <J^T g, v>", "<J^T g, v>", "<g, J v>"),
    "float32": ("float32 against float64", "float32", "float64"),
    "backward_jvp": ("backward_jvp against central differences of the backward", "backward_jvp", "numerical"),
    "symmetry": ("<u, Hv> = <Hu, v>", "<u, Hv>", "<Hu, v>"),
}


class GradcheckError(AssertionError):
    """Raised by ``gradcheck(..., raise_exception=True)`` when a check fails; the message is
    the report's table (``.report`` holds the :class:`GradcheckReport`).

    Examples
    --------
    >>> import numpy as np
    >>> import npattn
    >>> from npattn import functional as F
    >>> try:
    ...     npattn.gradcheck((F.relu, lambda d, c: 2 * F.relu_backward(d, c)), np.array([1.0, 2.0]),
    ...                      raise_exception=True)
    ... except npattn.testing.GradcheckError as e:
    ...     print(e.report.failed)
    ['x']
    """

    def __init__(self, report):
        super().__init__(str(report))
        self.report = report


class _RowFields(NamedTuple):
    name: str
    max_abs_err: float
    max_rel_err: float
    ok: bool


_ROW_EXTRAS = ("mode", "at", "analytic_value", "numerical_value", "tol", "ratio", "step", "note", "in_output")


class GradcheckRow(_RowFields):
    """One checked tensor: ``(name, max_abs_err, max_rel_err, ok)`` and, as attributes, where its
    worst element is.

    * ``mode``: ``"element"`` (every element against its own central difference),
      ``"direction"`` (``fast=True``: ``<analytic gradient, u>`` against the central difference
      along a random ``u``), ``"jvp"`` (the forward mode's output tangent, every output element,
      against the central difference of the output along a random tangent), ``"transpose"``
      (``<g, J v>`` from the JVP against ``<J^T g, v>`` from the backward), ``"float32"``
      (``dtype=np.float32``: the row ``output`` compares the float32 forward with the float64
      one; the others compare the float32 path's gradient, or JVP for ``"jvp <name>"``, with
      central differences of the float64 forward);
    * ``at``: the index of the worst element (the largest ``error / tolerance``), ``()`` for
      scalar comparisons; ``in_output``: whether ``at`` indexes the output rather than the
      tensor ``name`` (forward-mode rows: the row is named after the tensor moved, its errors
      are in the output's tangent);
    * ``analytic_value``, ``numerical_value``: the two numbers compared there (for
      ``"transpose"``: ``<J^T g, v>`` and ``<g, J v>``; for ``"float32"``: the float32 value and
      the float64 one, or the float64 central difference);
    * ``tol``: the tolerance of that element, ``ratio``: the largest ``error / tolerance`` (a
      row passes iff ``ratio <= 1``), ``step``: the finite-difference step of an element of
      typical size (larger elements take steps in proportion to themselves), ``note``: why a
      row failed without a number (a wrong dtype).

    The row unpacks as the 4-tuple whatever the mode; ``max_rel_err`` is
    ``|a - n| / max(|a|, |n|)`` at the worst relative element (floored by the row's ``atol``).

    Examples
    --------
    >>> import numpy as np
    >>> import npattn
    >>> row = npattn.gradcheck(npattn.Linear(3, 2, rng=0), np.ones((2, 3))).rows[1]
    >>> row.name, row.ok, row.mode, row.ratio < 1
    ('weight', True, 'element', True)
    """

    mode: str
    at: tuple
    analytic_value: float
    numerical_value: float
    tol: float
    ratio: float
    step: Optional[float]
    note: str
    in_output: bool

    def __new__(cls, name, max_abs_err, max_rel_err, ok, mode: str = "element", **extras):
        self = super().__new__(cls, name, max_abs_err, max_rel_err, ok)
        self.mode = mode
        self.at = tuple(extras.pop("at", ()))
        self.analytic_value = float(extras.pop("analytic_value", math.nan))
        self.numerical_value = float(extras.pop("numerical_value", math.nan))
        self.tol = float(extras.pop("tol", math.nan))
        self.ratio = float(extras.pop("ratio", math.nan))
        self.step = extras.pop("step", None)
        self.note = str(extras.pop("note", ""))
        in_output = extras.pop("in_output", None)
        self.in_output = mode == "jvp" if in_output is None else bool(in_output)
        if extras:
            raise TypeError(f"GradcheckRow: unknown field(s) {sorted(extras)}")
        return self

    def __getnewargs_ex__(self):
        return (tuple(self) + (self.mode,), {k: getattr(self, k) for k in _ROW_EXTRAS[1:]})

    def where(self) -> str:
        """``"name[i, j] (mode): analytic ..., numerical ... (tolerance ...)"`` for the worst element;
        for a forward-mode row, whose index is the output's, ``"name (jvp) at output[i, j]: ..."``."""
        idx = "[" + ", ".join(str(int(i)) for i in self.at) + "]" if self.at else ""
        if self.mode == "float32":  # the output row compares two evaluations, the others a difference
            what = ("float32", "float64" if self.step is None else "float64 numerical")
        else:
            what = _MODE_TEXT.get(self.mode, ("", "analytic", "numerical"))[1:]
        place = f"{self.name} ({self.mode}) at output{idx}" if self.in_output else f"{self.name}{idx} ({self.mode})"
        if self.mode == "backward_jvp":  # "dx along x": the index is dx's
            grad, _, moved = self.name.partition(" along ")
            place = f"{grad}{idx} along {moved} ({self.mode})"
        text = (
            f"{place}: {what[0]} {self.analytic_value:.6e}, "
            f"{what[1]} {self.numerical_value:.6e}, |difference| {abs(self.analytic_value - self.numerical_value):.3e} "
            f"(tolerance {self.tol:.3e})"
        )
        return text + (f"; {self.note}" if self.note else "")

    def __repr__(self):
        return (
            f"GradcheckRow(name={self.name!r}, max_abs_err={self.max_abs_err!r}, "
            f"max_rel_err={self.max_rel_err!r}, ok={self.ok!r}, mode={self.mode!r}, at={self.at!r}, "
            f"ratio={self.ratio!r})"
        )


class GradcheckReport:
    """The result of :func:`gradcheck`.

    * ``ok``: every element of every checked tensor passed;
    * ``rows``: a list of :class:`GradcheckRow` ``(name, max_abs_err, max_rel_err, ok)``, each
      knowing its worst element (``row.at``, ``row.analytic_value``, ``row.numerical_value``,
      ``row.tol``, ``row.ratio = max error / tolerance``);
    * ``failed``: the names of the rows that did not pass;
    * ``worst``: the row with the largest ``error / tolerance``, ``worst.where()`` says where;
    * ``analytic`` / ``numerical``: ``{name: array}`` of the element and direction rows;
    * ``str(report)``: an aligned table and a line pointing at the worst element.

    Truth-testing a report raises ``TypeError``: write ``report.ok`` (``assert gradcheck(...)``
    would otherwise pass whatever the result).

    Examples
    --------
    >>> import numpy as np
    >>> import npattn
    >>> report = npattn.gradcheck(npattn.Linear(3, 2, rng=0), np.ones((2, 3)))
    >>> [row.name for row in report.rows], report.ok
    (['input', 'weight', 'bias'], True)
    >>> print(report)                                         # doctest: +ELLIPSIS
    gradcheck Linear: ok ...
    name   | max abs err | max rel err | err/tol | worst at | ok
    ...
    """

    def __init__(
        self,
        rows,
        *,
        target="",
        eps=None,
        rtol=_RTOL,
        atol=None,
        analytic=None,
        numerical=None,
        dtype="float64",
        kind="gradcheck",
    ):
        self.rows: List[GradcheckRow] = list(rows)
        self.target = target
        self.kind = kind  # the check that made it, the table's first word: "gradcheck", "gradgradcheck"
        self.eps, self.rtol, self.atol = eps, rtol, atol
        self.dtype = dtype
        self.analytic = dict(analytic or {})
        self.numerical = dict(numerical or {})

    @property
    def ok(self) -> bool:
        """True when every element of every checked tensor passed."""
        return all(r.ok for r in self.rows)

    @property
    def failed(self) -> List[str]:
        """The names of the rows that did not pass (empty when ``ok``)."""
        return [r.name for r in self.rows if not r.ok]

    @property
    def worst(self) -> Optional[GradcheckRow]:
        """The row whose worst element is nearest to (or furthest past) its tolerance."""
        if not self.rows:
            return None

        def key(r):
            return (not r.ok, r.ratio if math.isfinite(r.ratio) else math.inf)

        return max(self.rows, key=key)

    def __bool__(self):
        raise TypeError("GradcheckReport: use report.ok (truth-testing a report is ambiguous)")

    def __iter__(self):
        return iter(self.rows)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, name_or_index):
        """``report["weight"]`` (by name: the first row of that name) or ``report[0]`` -> a row."""
        if isinstance(name_or_index, str):
            for r in self.rows:
                if r.name == name_or_index:
                    return r
            raise KeyError(f"no checked tensor named {name_or_index!r}; have {[r.name for r in self.rows]}")
        return self.rows[name_or_index]

    def row(self, name: str, mode: str) -> GradcheckRow:
        """The row of ``name`` checked in ``mode`` (``"element"``, ``"jvp"``, ``"transpose"`` ...)."""
        for r in self.rows:
            if r.name == name and r.mode == mode:
                return r
        raise KeyError(f"no row {name!r} in mode {mode!r}; have {[(r.name, r.mode) for r in self.rows]}")

    @property
    def modes(self) -> List[str]:
        """The modes of the rows, in order."""
        return [r.mode for r in self.rows]

    def __str__(self):
        with_mode = any(m != "element" for m in self.modes)
        head = ("name", "max abs err", "max rel err", "err/tol", "worst at", "ok") + (("mode",) if with_mode else ())
        body = [
            (
                r.name,
                f"{r.max_abs_err:.3e}",
                f"{r.max_rel_err:.3e}",
                f"{r.ratio:.2g}",
                ("output" if r.in_output else "") + str(tuple(int(i) for i in r.at)) if r.at else "-",
                "yes" if r.ok else "NO",
            )
            + ((r.mode,) if with_mode else ())
            for r in self.rows
        ]
        widths = [max(len(row[i]) for row in [head] + body) for i in range(len(head))]

        def fmt(row):
            cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:4], widths[1:4])]
            cells += [c.ljust(w) for c, w in zip(row[4:], widths[4:])]
            return " | ".join(cells).rstrip()

        modes = set(self.modes)
        how = ", ".join(text for m, (text, _, _) in _MODE_TEXT.items() if m in modes)
        eps = "auto" if self.eps is None else f"{self.eps:g}"
        atol = "auto" if self.atol is None else f"{self.atol:g}"
        title = (
            f"{self.kind} {self.target}: {'ok' if self.ok else 'FAILED'} "
            f"({how}; eps={eps}, rtol={self.rtol:g}, atol={atol})"
        )
        sep = "-+-".join("-" * w for w in widths)
        lines = [title, fmt(head), sep] + [fmt(b) for b in body]
        w = self.worst
        if w is not None:
            lines.append(("worst: " if self.ok else "FAILED at ") + w.where())
        return "\n".join(lines)

    def __repr__(self):
        return f"<GradcheckReport {self.target} ok={self.ok} failed={self.failed}>"


def numerical_gradient(f: Callable[[np.ndarray], float], x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Central-difference gradient of the scalar function ``f`` at ``x``.

    ``grad[i] = (f(x + eps e_i) - f(x - eps e_i)) / (2 eps)``, one element at a time.  ``x``
    must be a writable float ndarray; it is perturbed *in place* (so ``f`` may read it through a
    closure instead of its argument) and restored exactly afterwards.  Costs ``2 * x.size``
    calls of ``f``; the error is ``O(eps^2)`` truncation plus ``O(|f| * 1e-16 / eps)`` rounding.

    Parameters
    ----------
    f : callable
        ``f(x) -> float``.
    x : ndarray
        A writable float array (perturbed in place and restored).
    eps : float
        The step, > 0.

    Returns
    -------
    ndarray
        ``df/dx``, of ``x``'s shape.

    Raises
    ------
    TypeError
        ``f`` not callable, or ``x`` not a writable float ndarray.
    ValueError
        A non-positive or non-finite ``eps``.

    Examples
    --------
    >>> import numpy as np
    >>> from npattn.testing import numerical_gradient
    >>> x = np.array([1.0, 2.0])
    >>> np.round(numerical_gradient(lambda x: float((x ** 2).sum()), x), 6)
    array([2., 4.])
    """
    if not callable(f):
        raise TypeError(f"f: expected a function of x returning a scalar, got {type(f).__name__}")
    if not isinstance(x, np.ndarray) or x.dtype.kind != "f":
        raise TypeError(
            f"x: expected a float ndarray, got {type(x).__name__}"
            + (f" of dtype {x.dtype}" if isinstance(x, np.ndarray) else "")
        )
    if x.dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise TypeError(
            f"x: {x.dtype} is not supported (eps-sized steps need float64); convert with x.astype(np.float64)"
        )
    if not x.flags.writeable:
        raise ValueError("x: expected a writable array (it is perturbed in place and restored)")
    _check_tolerances(eps, 1.0, 0.0)

    def scalar(value):
        if np.ndim(value) != 0:
            raise TypeError(f"f: expected a scalar result, got an array of shape {np.shape(value)}")
        return float(value)

    grad = np.zeros(x.shape, dtype=np.float64)
    flat_grad = grad.reshape(-1)
    for i, idx in enumerate(np.ndindex(x.shape)):
        orig = x[idx]
        try:
            x[idx] = orig + eps
            fp = scalar(f(x))
            x[idx] = orig - eps
            fm = scalar(f(x))
        finally:  # x is restored even when f raises
            x[idx] = orig
        flat_grad[i] = (fp - fm) / (2.0 * eps)
    return grad


# --------------------------------------------------------------------------------------------
# helpers


def _is_float_array(x) -> bool:
    return isinstance(x, np.ndarray) and x.dtype.kind == "f"


def _prepare_input(x, dtype=np.float64):
    """float arrays (and lists of floats) -> copies in ``dtype`` (checked); everything else untouched."""
    if isinstance(x, list):
        try:
            a = np.asarray(x)
        except ValueError:  # ragged: let the forward complain
            return x
        if a.dtype.kind == "f":
            return a.astype(dtype)
        return x
    if _is_float_array(x):
        return np.array(x, dtype=dtype, copy=True)
    return x


def _positional_names(fn, n: int, default: str) -> List[str]:
    """The first ``n`` positional parameter names of ``fn`` (``{default}{i}`` beyond them)."""
    names: List[str] = []
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    for p in params:
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
        elif p.kind == p.VAR_POSITIONAL:
            break
    names = names[:n]
    names += [f"{default}{i}" for i in range(len(names), n)]
    return names


def _fresh_generators(values):
    """Deep copies of the ``np.random.Generator`` values (others untouched)."""
    return {k: (copy.deepcopy(v) if isinstance(v, np.random.Generator) else v) for k, v in values.items()}


def _as_tuple(grads) -> tuple:
    if grads is None:
        return ()
    if not isinstance(grads, (tuple, list)):
        return (grads,)
    return tuple(grads)


def _pair_grads(grads: tuple, inputs, names, what: str) -> Dict[int, Tuple[int, np.ndarray]]:
    """Map a backward's results onto the float inputs: ``{input index: (slot in grads, grad)}``."""
    float_idx = [i for i, x in enumerate(inputs) if _is_float_array(x)]
    pairs: Dict[int, Tuple[int, np.ndarray]] = {}
    if len(grads) == len(inputs):
        for i, (x, g) in enumerate(zip(inputs, grads)):
            if not _is_float_array(x):
                continue
            if g is None:
                raise ValueError(
                    f"{what} returned None as the gradient of float input {names[i]!r} "
                    f"(position {i}); pass constants by keyword or as non-float arrays"
                )
            pairs[i] = (i, g)
    else:
        got = [(slot, g) for slot, g in enumerate(grads) if g is not None]
        if len(got) != len(float_idx):
            raise ValueError(
                f"{what} returned {len(grads)} value(s), {len(got)} of them not None, for "
                f"{len(inputs)} positional input(s) of which {len(float_idx)} are float arrays "
                f"({[names[i] for i in float_idx]}): cannot tell which gradient belongs to which input; "
                "pass constant float arrays (e.g. a float attn_mask) by keyword"
            )
        pairs = dict(zip(float_idx, got))
    for i, (slot, g) in pairs.items():
        g = np.asarray(g)
        if g.shape != inputs[i].shape:
            raise ValueError(
                f"{what}: the gradient of {names[i]!r} has shape {g.shape}, expected {inputs[i].shape} (the input's)"
            )
        pairs[i] = (slot, g)
    return pairs


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _check_tolerances(eps, rtol, atol):
    for name, value, zero_ok in (("eps", eps, False), ("rtol", rtol, False), ("atol", atol, True)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(
                f"{name}: expected None (automatic) or a finite number {'>= 0' if zero_ok else '> 0'}, "
                f"got {value!r} ({type(value).__name__})"
            )
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
            raise ValueError(
                f"{name}: expected None (automatic) or a finite number {'>= 0' if zero_ok else '> 0'}, got {value!r}"
            )


def _check_dtype_option(dtype):
    if dtype is None:
        return None
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype: expected None, np.float64 or np.float32, got {dtype!r}") from None
    if dt not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise ValueError(f"dtype: expected None, np.float64 or np.float32, got {dt}")
    return dt


def _scale(arr: np.ndarray) -> float:
    """The typical magnitude of ``arr``'s elements: the root mean square of its finite elements,
    each magnitude capped at ``_CAP`` times the median non-zero one (1 when none is non-zero).

    The cap keeps one large element from setting the scale of all: among O(1) elements a single
    1e6 would make the plain root mean square about 1e6 / sqrt(n), and a step from it would step
    the O(1) elements far outside where their derivative is (tanh's)."""
    a = np.abs(arr[np.isfinite(arr)])
    nonzero = a[a > 0]
    if nonzero.size == 0:
        return 1.0
    a = np.minimum(a, _CAP * float(np.median(nonzero)))
    s = float(np.sqrt(np.mean(np.square(a, dtype=np.float64))))
    return s if s > 0 and math.isfinite(s) else 1.0


def _pow2(x):
    """``x`` (> 0) rounded to the nearest power of two, elementwise (``x + h`` is exact more often)."""
    return 2.0 ** np.round(np.log2(x))


def _steps(arr: np.ndarray, eps) -> Tuple[float, np.ndarray]:
    """``(h, steps)``: ``h`` the step of an element of typical size, ``steps`` each element's.

    ``eps`` when given (every element alike).  Otherwise ``u**(1/3) * max(|x_i|, scale)``
    rounded to a power of two, ``scale`` the typical magnitude (:func:`_scale`): an element
    much larger than the rest is stepped in proportion to itself, the others (and zeros) in
    proportion to the typical one, so each difference balances truncation and rounding at its
    own element's scale."""
    if eps is not None:
        return float(eps), np.full(arr.shape, float(eps))
    s = _scale(arr)
    mag = np.where(np.isfinite(arr), np.abs(arr), 0.0)
    return float(_pow2(_STEP * s)), _pow2(_STEP * np.maximum(mag, s))


class _Options(NamedTuple):
    seed: int
    eps: Optional[float]
    rtol: float
    atol: Optional[float]
    wrt: Optional[List[str]]
    fast: bool
    mode: str


def _normalise_wrt(wrt) -> Optional[List[str]]:
    if wrt is None:
        return None
    if isinstance(wrt, str):
        wrt = [wrt]
    try:
        names = list(wrt)
    except TypeError:
        raise TypeError(f"wrt: expected None, a name or a sequence of names, got {type(wrt).__name__}") from None
    for n in names:
        if not isinstance(n, str):
            raise TypeError(f"wrt: expected names (str), got {n!r} ({type(n).__name__})")
    if not names:
        raise ValueError("wrt: expected at least one name (None checks everything), got an empty sequence")
    return list(dict.fromkeys(names))


def _check_wrt_names(wrt, valid: Sequence[str], label: str) -> None:
    if wrt is None:
        return
    unknown = [n for n in wrt if n not in valid]
    if unknown:
        raise ValueError(f"wrt: unknown name(s) {unknown} for {label}; valid names: {list(valid)}")


def _unique_names(names: Sequence[str], taken=()) -> List[str]:
    seen = set(taken)
    out = []
    for n in names:
        m, k = n, 1
        while m in seen:
            k += 1
            m = f"{n}#{k}"
        seen.add(m)
        out.append(m)
    return out


def _check_unmodified(inputs, pristine, names, label):
    for i, (x, p) in enumerate(zip(inputs, pristine)):
        if isinstance(p, np.ndarray) and not np.array_equal(x, p, equal_nan=p.dtype.kind == "f"):
            raise RuntimeError(
                f"{label}: the forward modified its input {names[i]!r}; finite differences would be meaningless"
            )


def _check_deterministic(out1, out2, label):
    if np.shape(out1) != np.shape(out2) or not np.array_equal(np.asarray(out1), np.asarray(out2), equal_nan=True):
        raise RuntimeError(
            f"{label}: two forward calls at the same point gave different outputs; "
            "pass randomness as an np.random.Generator or an int seed (rng=...)"
        )


def _keyword_order(forward, kwargs) -> List[str]:
    """The keyword arguments' names in the forward's signature order (unknown ones last)."""
    try:
        order = list(inspect.signature(forward).parameters)
    except (TypeError, ValueError):
        order = []
    pos = {n: i for i, n in enumerate(order)}
    return sorted(kwargs, key=lambda k: (pos.get(k, len(order)), list(kwargs).index(k)))


def _as_output(out) -> np.ndarray:
    """The forward's output as a fresh float64 array (a module may reuse its output's memory)."""
    return np.array(out, dtype=np.float64, copy=True)


# --------------------------------------------------------------------------------------------
# what is checked: one forward at a point that can be moved, its derivatives at that point


class _Problem:
    """A target made ready: ``run()`` evaluates the output (float64 copy) at the current values
    of the ``checked`` arrays (perturbed in place); ``analytic`` holds the backward's gradients of
    ``<out, g>``; ``jvp(name, t)`` the forward mode's output tangent along ``t`` for one tensor
    (or None when the target has none); ``out`` the output at the unperturbed point."""

    def __init__(self, label, run, g, out, checked, analytic, jvp=None, dtypes=None):
        self.label = label
        self.run = run
        self.g = g
        self.out = out
        self.checked: List[Tuple[str, np.ndarray]] = checked
        self.analytic: Dict[str, np.ndarray] = analytic
        self.jvp = jvp
        self.dtypes = dtypes or {}  # name -> dtype of what the target returned ("output" included)
        self.t0 = float(np.sum(np.abs(out * g))) if out.size else 0.0


def _moved(op: np.ndarray, om: np.ndarray, g: Optional[np.ndarray], step: float, every: bool = False):
    """``(sum((op - om) * g) / step, u * sum over moved outputs of (|op| + |om|) |g| / step)``, or
    with ``g=None`` the elementwise ``((op - om) / step, rounding bound per output)``.

    ``every=True`` counts the outputs that did not move too: one that moved by less than its
    last bit reads as unmoved, its change lost (the second look uses this, the wider bound)."""
    d = op - om
    mag = np.abs(op) + np.abs(om)
    if not every:
        mag = np.where(d != 0, mag, 0.0)
    if g is None:
        return d / step, _U * mag / step
    gf = g.reshape(-1)
    return float(np.dot(d.reshape(-1), gf)) / step, _U * float(np.dot(mag.reshape(-1), np.abs(gf))) / step


def _at(problem: _Problem, arr: np.ndarray, where, plus, minus):
    """The outputs with ``arr[where]`` set to ``plus`` and then ``minus`` (restored after)."""
    orig = np.array(arr[where], copy=True)
    try:
        arr[where] = plus
        op = problem.run()
        arr[where] = minus
        om = problem.run()
    finally:
        arr[where] = orig
    return op, om


def _element_fd(problem, arr, idx, h, every=False):
    """Central difference of ``<out, g>`` along element ``idx`` with step ``h``: (value, rounding bound)."""
    x0 = arr[idx]
    if not np.isfinite(x0):  # an infinite mask entry: nothing moves when it does
        return 0.0, 0.0
    xp, xm = x0 + h, x0 - h
    op, om = _at(problem, arr, idx, xp, xm)
    return _moved(op, om, problem.g, float((xp - x0) + (x0 - xm)), every)


def _bounds(a, n, rnd, rtol, floor):
    return _C_ROUND * rnd + rtol * np.maximum(np.abs(a), np.abs(n)) + floor


def _row(name, a, n, bound, floor, rtol, mode, step, note="", ok=None, in_output=None):
    """A row from arrays of analytic values, numerical values and tolerances (same shape)."""
    a = np.asarray(a, dtype=np.float64)
    n = np.asarray(n, dtype=np.float64)
    bound = np.broadcast_to(np.asarray(bound, dtype=np.float64), a.shape)
    if a.size == 0:
        return GradcheckRow(
            name, 0.0, 0.0, ok is not False, mode, ratio=0.0, step=step, note=note, tol=0.0, in_output=in_output
        )
    finite = np.isfinite(a) & np.isfinite(n)
    err = np.where(finite, np.abs(a - n), np.inf)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(err == 0, 0.0, err / bound)
        denom = np.maximum(np.maximum(np.abs(a), np.abs(n)), floor / rtol)
        rel = np.where(err == 0, 0.0, np.where(denom > 0, err / np.where(denom > 0, denom, 1.0), np.inf))
    ratio = np.where(np.isnan(ratio), np.inf, ratio)
    k = int(np.argmax(ratio))
    index = np.unravel_index(k, a.shape) if a.ndim else ()
    passed = bool(np.all(err <= bound)) if ok is None else ok
    return GradcheckRow(
        name,
        float(err.max()),
        float(rel.max()),
        passed and not note,
        mode,
        at=tuple(int(i) for i in index),
        analytic_value=float(a.reshape(-1)[k]),
        numerical_value=float(n.reshape(-1)[k]),
        tol=float(bound.reshape(-1)[k]),
        ratio=float(ratio.reshape(-1)[k]),
        step=step,
        note=note,
        in_output=in_output,
    )


def _check_elements(problem: _Problem, name: str, arr: np.ndarray, opts: _Options, a=None, extra=0.0, mode="element"):
    """Every element of the gradient ``a`` (default: the problem's analytic gradient of ``name``)
    against its own central difference of the problem's forward; ``extra`` (per element) joins
    the tolerance (the float32 mode's rounding of ``a``)."""
    a = problem.analytic[name] if a is None else np.asarray(a, dtype=np.float64)
    extra = np.broadcast_to(np.asarray(extra, dtype=np.float64), arr.shape)
    h, steps = _steps(arr, opts.eps)
    floor = opts.atol if opts.atol is not None else _C_FLOOR * _U * problem.t0 / _scale(arr)
    n = np.empty(arr.shape)
    rnd = np.empty(arr.shape)
    for idx in np.ndindex(arr.shape):
        n[idx], rnd[idx] = _element_fd(problem, arr, idx, steps[idx])
    bound = _bounds(a, n, rnd, opts.rtol, floor) + extra
    with np.errstate(invalid="ignore"):
        bad = ~(np.abs(a - n) <= bound)
    for idx in zip(*np.nonzero(bad)) if arr.ndim else ([()] if bad else []):
        # a second look with a step 64 times smaller: truncation 4096 times smaller (at most
        # |n - n2| / 4095) and clear of a kink (relu) that the step straddled
        n2, r2 = _element_fd(problem, arr, idx, steps[idx] / _FINE)
        b2 = _bounds(a[idx], n2, r2, opts.rtol, floor) + abs(n[idx] - n2) / 1024 + extra[idx]
        if abs(a[idx] - n2) <= b2:
            n[idx], bound[idx] = n2, b2
            continue
        # a third with half the step, counting every output (one that moved by less than its
        # last bit reads as unmoved): where truncation dominates the two estimates differ
        n3, r3 = _element_fd(problem, arr, idx, steps[idx] / 2, every=True)
        b3 = _bounds(a[idx], n3, r3, opts.rtol, floor) + abs(n[idx] - n3) + extra[idx]
        if abs(a[idx] - n3) <= b3:
            n[idx], bound[idx] = n3, b3
    return _row(name, a, n, bound, floor, opts.rtol, mode, h), n


def _direction_fd(problem, arr, v, h, g, every=False):
    """Outputs at ``arr ± h v``: the central difference (of ``<out, g>``, or of the output with
    ``g=None``), its rounding bound and the realised tangent ``(x+ - x-) / 2h``.

    One step for the whole tensor (the tangent is ``v`` to rounding): ``h`` is its typical
    element's, so a tensor with a few far larger elements is not stepped by their scale."""
    v = np.where(np.isfinite(arr), v, 0.0)  # infinite entries (masks) stay where they are
    with np.errstate(invalid="ignore"):
        xp, xm = np.where(v != 0, arr + h * v, arr), np.where(v != 0, arr - h * v, arr)
    op, om = _at(problem, arr, Ellipsis, xp, xm)
    with np.errstate(invalid="ignore"):
        t = np.where(v != 0, xp - xm, 0.0) / (2 * h)
    value, rnd = _moved(op, om, g, 2 * h, every)
    return value, rnd, t


def _check_direction(
    problem: _Problem, name: str, arr: np.ndarray, v: np.ndarray, opts: _Options, a=None, extra=0.0, mode="direction"
):
    """``<a, t>`` against the central difference of ``<out, g>`` along the realised tangent
    ``t`` of ``v``; ``extra`` (per element of ``a``) joins the tolerance as ``sum |extra t|``."""
    a = problem.analytic[name] if a is None else np.asarray(a, dtype=np.float64)
    extra = np.broadcast_to(np.asarray(extra, dtype=np.float64), arr.shape)
    h, _ = _steps(arr, opts.eps)
    n, rnd, t = _direction_fd(problem, arr, v, h, problem.g)
    av = float(np.dot(a.reshape(-1), t.reshape(-1)))
    floor = (
        opts.atol
        if opts.atol is not None
        else _C_FLOOR * _U * (float(np.sum(np.abs(a * t))) + problem.t0 / _scale(arr) * float(np.sum(np.abs(t))))
    )
    bound = float(_bounds(av, n, rnd, opts.rtol, floor)) + float(np.sum(extra * np.abs(t)))
    if not abs(av - n) <= bound:  # second and third looks, as for elements
        for step, every, share in ((h / _FINE, False, 1 / 1024), (h / 2, True, 1.0)):
            n2, r2, t2 = _direction_fd(problem, arr, v, step, problem.g, every=every)
            av2 = float(np.dot(a.reshape(-1), t2.reshape(-1)))
            b2 = float(_bounds(av2, n2, r2, opts.rtol, floor)) + abs(n - n2) * share
            b2 += float(np.sum(extra * np.abs(t2)))
            if abs(av2 - n2) <= b2:
                av, n, bound = av2, n2, b2
                break
    return _row(name, av, n, bound, floor, opts.rtol, mode, h), (av, n)


def _check_jvp(problem: _Problem, name: str, arr: np.ndarray, v: np.ndarray, opts: _Options, jvp=None, mode="jvp"):
    """The forward mode along ``v`` against the central difference of the output.  ``jvp(name,
    t) -> (output tangent, extra tolerance per output)`` replaces the problem's own (whose
    extra is 0): the float32 mode's."""
    h, _ = _steps(arr, opts.eps)
    n, rnd, t = _direction_fd(problem, arr, v, h, None)
    jv, extra = jvp(name, t) if jvp is not None else (problem.jvp(name, t), 0.0)
    if jv.shape != problem.out.shape:
        raise ValueError(f"{problem.label}: the JVP along {name!r} has shape {jv.shape}, expected {problem.out.shape}")
    # the resolution of a difference of the outputs at their largest scale: an output that is
    # small because its forward cancelled (gelu's tail, 1 + erf(-6)) carries an error of that size
    floor = opts.atol if opts.atol is not None else _C_FLOOR * _U * float(np.max(np.abs(problem.out), initial=0.0)) / h
    bound = _bounds(jv, n, rnd, opts.rtol, floor) + extra
    with np.errstate(invalid="ignore"):
        bad = ~(np.abs(jv - n) <= bound)
    n1 = n
    for step, every, share in ((h / _FINE, False, 1 / 1024), (h / 2, True, 1.0)):  # as for elements
        if not bad.any():
            break
        # the same JVP against the smaller steps' differences (t and their tangents differ by rounding)
        n2, r2, _ = _direction_fd(problem, arr, v, step, None, every=every)
        b2 = _bounds(jv, n2, r2, opts.rtol, floor) + np.abs(n1 - n2) * share + extra
        fix = bad & (np.abs(jv - n2) <= b2)
        n, bound = np.where(fix, n2, n), np.where(fix, b2, bound)
        bad &= ~fix
    return _row(name, jv, n, bound, floor, opts.rtol, mode, h, in_output=True), (t, jv)


def _check_transpose(problem: _Problem, name: str, arr: np.ndarray, t: np.ndarray, jv: np.ndarray):
    """``<g, J t>`` (forward mode) against ``<J^T g, t>`` (backward): both analytic, equal up to
    the rounding of the two sums of products and of their terms (each analytic element is exact
    only to the resolution floors of the element and JVP checks)."""
    a = problem.analytic[name]
    lhs = float(np.dot(problem.g.reshape(-1), jv.reshape(-1)))
    rhs = float(np.dot(a.reshape(-1), t.reshape(-1)))
    terms = float(np.sum(np.abs(problem.g * jv))) + float(np.sum(np.abs(a * t)))
    st, sg, s = float(np.sum(np.abs(t))), float(np.sum(np.abs(problem.g))), _scale(arr)
    out_max = float(np.max(np.abs(problem.out), initial=0.0))
    tol = _C_FLOOR * _U * (math.sqrt(a.size + jv.size) * terms + problem.t0 / s * st + out_max * st * sg / s)
    return _row(name, rhs, lhs, tol, tol, 1.0, "transpose", None)


def _run_checks(problem: _Problem, opts: _Options, pristine_t0=None) -> Tuple[List[GradcheckRow], dict, dict]:
    rows: List[GradcheckRow] = []
    analytic: dict = {}
    numerical: dict = {}
    directions = np.random.default_rng([opts.seed, 1])
    tangents = np.random.default_rng([opts.seed, 2])
    if opts.mode in ("fwd", "both") and problem.jvp is None:
        raise ValueError(f"{problem.label}: mode={opts.mode!r} needs a forward mode (JVP) and the target has none")
    for name, arr in problem.checked:
        if opts.mode in ("rev", "both"):
            if opts.fast:
                row, (av, n) = _check_direction(problem, name, arr, directions.standard_normal(arr.shape), opts)
                analytic[name], numerical[name] = np.asarray(av), np.asarray(n)
            else:
                row, n = _check_elements(problem, name, arr, opts)
                analytic[name], numerical[name] = problem.analytic[name], n
            rows.append(row)
        if opts.mode in ("fwd", "both"):
            row, (t, jv) = _check_jvp(problem, name, arr, tangents.standard_normal(arr.shape), opts)
            rows.append(row)
            if opts.mode == "both":
                rows.append(_check_transpose(problem, name, arr, t, jv))
    return rows, analytic, numerical


# --------------------------------------------------------------------------------------------


#: The docstring sections that gradcheck and gradgradcheck share (their targets, tolerances and results differ).
_CHECK_DOC = {
    "target": """
        Parameters
        ----------
        target : callable, tuple or Module
        """,
    "forward_kwargs_returns": """
        **forward_kwargs
            Passed to the forward.

        Returns
        -------
        GradcheckReport
        """,
    "raises": """
        Raises
        ------
        GradcheckError
            With ``raise_exception=True`` when a check fails.
        """,
    "runtime_error": """
        RuntimeError
            When the forward modifies its inputs or gives two different outputs at the same point.
        """,
    "npattn_examples": """
        Examples
        --------
        >>> import numpy as np
        >>> import npattn
        >>> from npattn import functional as F
        """,
}


@shared_doc(**_CHECK_DOC)
def gradcheck(
    target,
    *inputs,
    seed=0,
    eps=None,
    rtol=None,
    atol=None,
    wrt=None,
    fast=False,
    mode="rev",
    dtype=None,
    raise_exception=False,
    **forward_kwargs,
) -> GradcheckReport:
    """Compare hand-written derivatives with central differences of ``f = sum(forward(*inputs) * g)``.

    <target>
        * a functional forward ``op`` returning ``(out, cache)``; its backward is
          ``<op name>_backward`` and its forward mode ``<op name>_jvp`` in the same python module;
        * a ``(forward, backward)`` or ``(forward, backward, jvp)`` tuple with the same protocol;
        * a :class:`npattn.Module` instance: it is deep-copied and cast (the caller's module is
          untouched), called as ``m(*inputs, **forward_kwargs)`` (a tuple output such as
          ``(out, weights)`` uses its first element), ``m.backward(g)`` gives the input
          gradient(s), ``m.jvp(*input_tangents, param_tangents=...)`` the forward mode; every
          parameter is checked too, its gradient read from ``p.grad`` after ``zero_grad()``.
    *inputs
        The positional inputs; float arrays (and lists of floats) are checked.
    seed : int
        Seeds the upstream gradient ``g = default_rng(seed).standard_normal(out.shape)`` and the
        random directions and tangents.
    eps : float, optional
        The finite-difference step.  ``None`` (default): for each element ``u**(1/3)`` times
        ``max(|x_i|, typical magnitude of its tensor)`` (rounded to a power of two; the typical
        magnitude is robust to a few far larger elements); a number: that step for every element.
    rtol : float, optional
        Relative part of the tolerance; ``None`` is ``1e-5`` (``2**-13`` with ``dtype=np.float32``).
    atol : float, optional
        Absolute floor of the tolerance; ``None`` (default) is the analytic side's own resolution
        (``64 u sum|out * g| / scale`` for a gradient; ``rtol * max|float64 result|`` with
        ``dtype=np.float32``).
    wrt : str or sequence of str, optional
        The names of the tensors to check (default: every float array input with a gradient
        and, for modules, every parameter): the forward's parameter names (``x``, ``q``,
        ``attn_mask``, ``sinks`` ...), for modules ``input`` (one input) or the forward's
        parameter names, and the dotted parameter names (``W_query.weight``).
    fast : bool
        Check one random direction ``u`` per tensor instead of every element: the analytic
        ``<backward(g), u>`` against the central difference of ``f`` along ``u`` (two forwards
        per tensor instead of two per element).  A wrong gradient is caught with probability 1,
        but the row cannot say which element is wrong.
    mode : {"rev", "fwd", "both"}
        ``"rev"`` checks the backward; ``"fwd"`` the forward mode (JVP) along a random tangent
        per tensor, every output element against the central difference of the output;
        ``"both"`` both, and the transposition identity ``<g, J v> = <J^T g, v>``.
    dtype : None, np.float64 or np.float32
        ``np.float32``: run the target in float32 (inputs rounded to float32, a module cast),
        compare its output with the float64 path's at the same values, and its gradients (and
        JVPs with ``mode="fwd"/"both"``; one direction each with ``fast=True``) with central
        differences of the float64 forward there, so that a wrong backward fails whether or
        not its float64 path shares the mistake; results must also come back as float32.
        ``None``/``np.float64``: the finite-difference check, in float64.  The tolerance adds to
        the difference's own some float32 ulps of each tensor's scale plus 64 times how far the
        float64 result moves when the inputs move by their own float32 rounding (the problem's
        conditioning); a computation that cancels beyond that (attention scores of several
        hundred) needs a looser ``rtol``, and defaults that depend on the dtype (``rms_norm``'s
        ``eps=None``) make the two paths different functions: pass them explicitly.
    raise_exception : bool
        Raise :class:`GradcheckError` (an ``AssertionError`` carrying the report) when a check fails.
    <forward_kwargs_returns>
        ``report.ok``, ``report.rows``, ``report.worst``; ``str(report)`` is a table.

    <raises>
    TypeError, ValueError
        For bad arguments, a target without the needed backward/JVP, or gradients that cannot
        be paired with the inputs.
    <runtime_error>

    Notes
    -----
    Backward results are normalised to a tuple; when its length equals the number of positional
    inputs they pair up by position (``None`` gradients and non-float inputs skipped), otherwise
    the non-``None`` gradients pair in order with the float inputs.  A backward that returns
    *more* gradients than there are positional inputs (``sinks=``'s ``dsinks``, ``mask_grad``'s
    ``dmask``) pairs the first ones by position and the extra, non-``None`` ones in order with
    the float keyword arrays (in the forward's signature order; only those named in ``wrt``).
    The JVP is given one tangent per backward result, in the same order (``None`` for zero); a
    module's ``jvp`` one per positional input of its forward (``None`` for zero, every one of
    them when the tangent is a parameter's), so its ``_jvp`` may unpack ``input_tangents``.

    Randomness: every ``np.random.Generator`` among the arguments is snapshotted and a fresh copy
    is passed to each forward; a module's own Generator attributes are saved and restored before
    each forward, so dropout draws the same mask every time.

    <npattn_examples>
    >>> x = np.random.default_rng(0).standard_normal((3, 5))
    >>> report = npattn.gradcheck(F.softmax, x)              # a pair: softmax + softmax_backward
    >>> report.ok, report.failed
    (True, [])
    >>> npattn.gradcheck(npattn.LayerNorm(5), x, mode="both").ok   # a module, reverse and forward mode
    True
    >>> def bad_backward(dout, cache):                        # a transposition bug is caught
    ...     return F.softmax_backward(dout, cache) * 1.001
    >>> npattn.gradcheck((F.softmax, bad_backward), x).failed
    ['x']
    """
    _check_arguments(inputs, seed, eps, rtol, atol, fast=fast, raise_exception=raise_exception)
    if not isinstance(mode, str) or mode not in _MODES:
        raise ValueError(f"mode: expected one of {list(_MODES)}, got {mode!r}")
    dt = _check_dtype_option(dtype)
    f32 = dt == np.dtype(np.float32)
    wrt = _normalise_wrt(wrt)
    opts = _Options(
        int(seed), eps, float(rtol) if rtol is not None else (_RTOL32 if f32 else _RTOL), atol, wrt, bool(fast), mode
    )
    make, label = _resolve(target, mode)
    if f32:
        report = _float32_report(make, inputs, forward_kwargs, opts, label)
    else:
        problem = make(np.float64, inputs, forward_kwargs, opts, None)
        rows, analytic, numerical = _run_checks(problem, opts)
        report = GradcheckReport(
            rows, target=label, eps=eps, rtol=opts.rtol, atol=atol, analytic=analytic, numerical=numerical
        )
    if raise_exception and not report.ok:
        raise GradcheckError(report)
    return report


def companion(forward, suffix: str):
    """``<forward's name><suffix>`` from the python module that defines ``forward`` (None when absent)."""
    fname = getattr(forward, "__name__", None)
    mod = sys.modules.get(getattr(forward, "__module__", None) or "")
    return getattr(mod, f"{fname}{suffix}", None) if (mod is not None and fname) else None


def _refuse_class(target, expected: str) -> None:
    if isinstance(target, type):
        raise TypeError(f"target: expected {expected}, got the class {target.__name__} (instantiate it first)")


def _check_arguments(inputs, seed, eps, rtol, atol, **flags) -> None:
    """The checks' common arguments: at least one input, a seed >= 0, tolerances, True/False flags."""
    _check_tolerances(eps, rtol, atol)
    if not inputs:
        raise ValueError("inputs: expected at least one positional input to check, got none")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed: expected a non-negative integer, got {seed!r} ({type(seed).__name__})")
    if seed < 0:
        raise ValueError(f"seed: expected a non-negative integer, got {seed!r}")
    for flag, value in flags.items():
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{flag}: expected True or False, got {value!r} ({type(value).__name__})")


def _resolve(target, mode):
    """``(make(dtype, inputs, kwargs, opts, g_dtype) -> _Problem, label)`` for any target."""
    _refuse_class(target, "a forward function, a (forward, backward) pair or a Module instance")
    if isinstance(target, Module):
        base = copy.deepcopy(target)
        base.clear_saved()

        def make_module(dtype, inputs, kwargs, opts, g_dtype, jiggle=None):
            m = copy.deepcopy(base)
            m.to(dtype)
            if jiggle is not None:
                for p in m.parameters():
                    p.data = _jiggled(p.data, jiggle)
            return _module_problem(m, inputs, kwargs, opts, dtype, g_dtype, jiggle)

        return make_module, type(target).__name__
    jvp = None
    if isinstance(target, tuple):
        if len(target) not in (2, 3) or not all(callable(t) for t in target):
            raise TypeError(
                "target: expected a (forward, backward) or (forward, backward, jvp) tuple of callables, "
                f"got a tuple of {len(target)} item(s)"
            )
        forward, backward = target[0], target[1]
        jvp = target[2] if len(target) == 3 else None
        if jvp is None and mode != "rev":
            raise ValueError(f"target: mode={mode!r} needs a forward mode: pass (forward, backward, jvp)")
    elif callable(target):
        forward = target
        fname = getattr(forward, "__name__", None)
        backward = companion(forward, "_backward")
        if not callable(backward):
            raise ValueError(
                f"target: no backward '{fname}_backward' next to {fname!r} in module "
                f"{getattr(forward, '__module__', None)!r}; pass a (forward, backward) tuple"
            )
        jvp = companion(forward, "_jvp")
        if mode != "rev" and not callable(jvp):
            raise ValueError(
                f"target: mode={mode!r} needs a forward mode and there is no '{fname}_jvp' next to "
                f"{fname!r} in module {forward.__module__!r}; pass a (forward, backward, jvp) tuple"
            )
    else:
        raise TypeError(
            f"target: expected a forward function, a (forward, backward) pair or a Module "
            f"instance, got {type(target).__name__}"
        )

    def make_functional(dtype, inputs, kwargs, opts, g_dtype, jiggle=None):
        return _functional_problem(forward, backward, jvp, inputs, kwargs, opts, dtype, g_dtype, jiggle)

    return make_functional, getattr(forward, "__name__", "forward")


def _upstream(seed: int, shape, g_dtype) -> np.ndarray:
    g = np.asarray(np.random.default_rng(seed).standard_normal(shape))
    return g if g_dtype is None else g.astype(g_dtype).astype(np.float64)


def _pair_extra_grads(grads, n_inputs, kw_float, wrt):
    """A backward with more results than positional inputs: the first pair by position, the
    extra non-None ones with the float keyword arrays (``kw_float``, signature order; those in
    ``wrt`` when it names any).  Returns ``(positional grads, {keyword: (slot, grad)})`` or None."""
    if len(grads) <= n_inputs:
        return None
    extra = [(slot, g) for slot, g in enumerate(grads) if slot >= n_inputs and g is not None]
    named = [k for k in kw_float if wrt is not None and k in wrt]
    targets = named or kw_float
    if not extra or len(extra) != len(targets):
        return None
    return tuple(grads[:n_inputs]), dict(zip(targets, extra))


def _prepared_inputs(inputs, dtype, jiggle=None) -> list:
    """The inputs as a check perturbs them: ``_prepare_input``'s copies, the float ones moved by
    ``jiggle`` when given."""
    inputs = [_prepare_input(x, dtype) for x in inputs]
    if jiggle is not None:
        inputs = [_jiggled(x, jiggle) if _is_float_array(x) else x for x in inputs]
    return inputs


def _wrt_only(checked: list, wrt, label: str, nothing: str) -> list:
    """The ``(name, array)`` pairs of ``checked`` that ``wrt`` names (all when None); ValueError
    saying ``nothing`` (what the target lacks) when none is left."""
    if wrt is not None:
        checked = [(n, a) for n, a in checked if n in wrt]
    if not checked:
        raise ValueError(f"{label}: nothing to check: {nothing}")
    return checked


class _FunctionalSetup(NamedTuple):
    """A functional target made ready at its point: ``call()`` runs the forward at the current
    values of the ``checked`` arrays (copies, perturbed in place) and returns ``(out, cache)``;
    ``g`` the upstream gradient; ``out`` the first output; ``tensors`` every array with a
    gradient by name (``checked``: those ``wrt`` names); ``raw`` the backward's results at ``g``
    by name; ``slots`` each name's position among the backward's ``n_slots`` results (the order
    in which ``<op>_jvp`` and ``<op>_backward_jvp`` take tangents)."""

    label: str
    call: Callable[[], tuple]
    g: np.ndarray
    out: np.ndarray
    checked: List[Tuple[str, np.ndarray]]
    tensors: Dict[str, np.ndarray]
    raw: Dict[str, np.ndarray]
    slots: Dict[str, int]
    n_slots: int
    dtypes: dict

    def tangents(self, by_name: Dict[str, np.ndarray], dtype) -> List[Optional[np.ndarray]]:
        """One tangent per backward result, in its order (``None``: zero), from ``{name: tangent}``."""
        tangents: List[Optional[np.ndarray]] = [None] * self.n_slots
        for name, t in by_name.items():
            tangents[self.slots[name]] = np.asarray(t).astype(dtype)
        return tangents


def _functional_setup(forward, backward, inputs, kwargs, opts, dtype, g_dtype, jiggle=None) -> _FunctionalSetup:
    label = getattr(forward, "__name__", "forward")
    inputs = _prepared_inputs(inputs, dtype, jiggle)
    names = _positional_names(forward, len(inputs), "input")
    kwargs = dict(kwargs)
    kw_float = [k for k in _keyword_order(forward, kwargs) if _is_float_array(kwargs[k])]
    for k in kw_float:  # copies: they may be checked (perturbed in place) below
        kwargs[k] = np.array(kwargs[k], dtype=dtype, copy=True)
    valid = [names[i] for i, x in enumerate(inputs) if _is_float_array(x)] + kw_float
    _check_wrt_names(opts.wrt, valid, label)
    pos_gens = {i: copy.deepcopy(x) for i, x in enumerate(inputs) if isinstance(x, np.random.Generator)}
    kw_snapshot = _fresh_generators(kwargs)

    def call():
        args = list(inputs)
        for i, gen in pos_gens.items():
            args[i] = copy.deepcopy(gen)
        return forward(*args, **_fresh_generators(kw_snapshot))

    pristine = [x.copy() if isinstance(x, np.ndarray) else None for x in inputs]
    kw_pristine = {k: kwargs[k].copy() for k in kw_float}
    res = call()
    if not (isinstance(res, tuple) and len(res) == 2):
        raise TypeError(f"{label}: expected the forward to return (out, cache), got {type(res).__name__}")
    out, cache = res
    _check_unmodified(inputs, pristine, names, label)
    _check_unmodified([kwargs[k] for k in kw_float], [kw_pristine[k] for k in kw_float], kw_float, label)
    out = np.asarray(out)
    g = _upstream(opts.seed, out.shape, g_dtype)
    _check_deterministic(out, call()[0], label)
    what = f"{getattr(backward, '__name__', 'backward')}"
    grads = _as_tuple(backward(g.astype(out.dtype) if out.dtype.kind == "f" else g, cache))
    n_slots = len(grads)
    kw_grads: Dict[str, Tuple[int, np.ndarray]] = {}
    float_pos = [i for i, x in enumerate(inputs) if _is_float_array(x)]
    if len(grads) > len(inputs) and len([x for x in grads if x is not None]) != len(float_pos):
        split = _pair_extra_grads(grads, len(inputs), kw_float, opts.wrt)
        if split is not None:
            grads, kw_grads = split
    pairs = _pair_grads(grads, inputs, names, what)
    for k, (_, gk) in kw_grads.items():
        gk = np.asarray(gk)
        if gk.shape != kwargs[k].shape:
            raise ValueError(
                f"{what}: the gradient of {k!r} has shape {gk.shape}, expected {kwargs[k].shape} (the keyword input's)"
            )
    if opts.wrt is not None:
        have = {names[i] for i in pairs} | set(kw_grads)
        lacking = [n for n in opts.wrt if n not in have]
        if lacking:
            raise ValueError(
                f"wrt: {what} returned no gradient for {lacking} (keyword inputs need a gradient "
                "appended by the backward, e.g. mask_grad=True for a float attn_mask)"
            )
    checked = [(names[i], inputs[i]) for i in sorted(pairs)] + [(k, kwargs[k]) for k in kw_grads]
    slots = {names[i]: pairs[i][0] for i in pairs}
    slots.update({k: slot for k, (slot, _) in kw_grads.items()})
    raw = {names[i]: np.asarray(pairs[i][1]) for i in sorted(pairs)}
    raw.update({k: np.asarray(v) for k, (_, v) in kw_grads.items()})
    tensors, checked = dict(checked), _wrt_only(checked, opts.wrt, label, "no positional float input")
    dtypes = {"output": out.dtype, **{n: r.dtype for n, r in raw.items()}}
    return _FunctionalSetup(label, call, g, out, checked, tensors, raw, slots, n_slots, dtypes)


def _functional_problem(forward, backward, jvp, inputs, kwargs, opts, dtype, g_dtype, jiggle=None):
    s = _functional_setup(forward, backward, inputs, kwargs, opts, dtype, g_dtype, jiggle)

    def run():
        return _as_output(s.call()[0])

    def tangent_of(name, t):
        _, c = s.call()  # a fresh cache: the backward may have used the first one's memory
        r = np.asarray(jvp(c, *s.tangents({name: t}, dtype)))
        s.dtypes[f"jvp {name}"] = r.dtype
        return _as_output(r)

    analytic = {n: np.asarray(r, dtype=np.float64) for n, r in s.raw.items()}
    return _Problem(s.label, run, s.g, _as_output(s.out), s.checked, analytic, tangent_of if jvp else None, s.dtypes)


class _ModuleSetup(NamedTuple):
    """A module target made ready at its point: ``call()`` runs the forward (keeping its state) at
    the current values of the ``checked`` arrays (the inputs' copies and the parameters' data,
    perturbed in place), ``run()`` without gradients; ``g`` the upstream gradient; ``raw_out``
    the forward's output, ``out`` its float64 copy; ``tensors`` every array with a gradient by
    name (``checked``: those ``wrt`` names); ``raw`` the backward's results at ``g`` by name
    (inputs as ``in_names``, parameters by their dotted names, ``params``); ``position`` each
    input name's place among the forward's positional ``inputs``."""

    label: str
    m: Module
    inputs: list
    in_names: List[str]
    call: Callable[[], np.ndarray]
    run: Callable[[], np.ndarray]
    g: np.ndarray
    raw_out: np.ndarray
    out: np.ndarray
    checked: List[Tuple[str, np.ndarray]]
    tensors: Dict[str, np.ndarray]
    raw: Dict[str, np.ndarray]
    params: Dict[str, Parameter]
    position: Dict[str, int]
    dtypes: dict

    def tangents(self, by_name: Dict[str, np.ndarray], dtype) -> Tuple[List[Optional[np.ndarray]], Optional[dict]]:
        """``{name: tangent}`` as ``Module.jvp`` takes it: one tangent per positional input
        (``None``: zero, as ``Module.jvp`` promises its ``_jvp``) and the parameters' by name
        (``None`` when there is none)."""
        input_tangents: List[Optional[np.ndarray]] = [None] * len(self.inputs)
        param_tangents = {}
        for name, t in by_name.items():
            t = np.asarray(t).astype(dtype)
            if name in self.params:
                param_tangents[name] = t
            else:
                input_tangents[self.position[name]] = t
        return input_tangents, (param_tangents or None)


def _module_setup(m: Module, inputs, kwargs, opts, dtype, g_dtype, jiggle=None) -> _ModuleSetup:
    label = type(m).__name__
    inputs = _prepared_inputs(inputs, dtype, jiggle)
    float_idx = [i for i, x in enumerate(inputs) if _is_float_array(x)]
    if len(float_idx) == 1 and len(inputs) == 1:
        in_names = ["input"]
    else:
        in_names = _positional_names(m.forward, len(inputs), "input")
    params = list(m._param_list())
    in_names = _unique_names(in_names, taken=[n for n, _ in params])
    valid = [in_names[i] for i in float_idx] + [n for n, p in params if p.data.dtype.kind == "f"]
    _check_wrt_names(opts.wrt, valid, label)

    gens = {}
    for sub in m.modules():
        for v in vars(sub).values():
            if isinstance(v, np.random.Generator) and id(v) not in gens:
                gens[id(v)] = (v, copy.deepcopy(v.bit_generator.state))
    kw_snapshot = _fresh_generators(kwargs)

    def call():
        for gen, state in gens.values():
            gen.bit_generator.state = copy.deepcopy(state)
        return _first(m(*inputs, **_fresh_generators(kw_snapshot)))

    def run():
        with no_grad():
            return _as_output(call())

    pristine = [x.copy() if isinstance(x, np.ndarray) else None for x in inputs]
    out1 = run()
    _check_unmodified(inputs, pristine, in_names, label)
    _check_deterministic(out1, run(), label)
    raw_out = np.asarray(call())  # the forward whose state backward uses
    out = _as_output(raw_out)
    g = _upstream(opts.seed, out.shape, g_dtype)
    m.zero_grad()
    grads = _pair_grads(_as_tuple(m.backward(g.astype(raw_out.dtype))), inputs, in_names, f"{label}.backward")
    raw = {in_names[i]: np.asarray(grads[i][1]) for i in sorted(grads)}
    checked = [(in_names[i], inputs[i]) for i in sorted(grads)]
    param_names = {}
    for pname, p in params:
        if p.data.dtype.kind != "f":
            continue
        raw[pname] = np.zeros(p.data.shape, p.data.dtype) if p.grad is None else np.array(p.grad, copy=True)
        if not p.data.flags.writeable:
            p.data = np.array(p.data, copy=True)
        checked.append((pname, p.data))
        param_names[pname] = p
    tensors, checked = dict(checked), _wrt_only(checked, opts.wrt, label, "no float input and no parameter")
    dtypes = {"output": raw_out.dtype, **{n: r.dtype for n, r in raw.items()}}
    position = {in_names[i]: i for i in range(len(inputs))}
    return _ModuleSetup(
        label, m, inputs, in_names, call, run, g, raw_out, out, checked, tensors, raw, param_names, position, dtypes
    )


def _module_problem(m: Module, inputs, kwargs, opts, dtype, g_dtype, jiggle=None):
    s = _module_setup(m, inputs, kwargs, opts, dtype, g_dtype, jiggle)

    def tangent_of(name, t):
        input_tangents, param_tangents = s.tangents({name: t}, dtype)
        m.clear_saved()
        s.call()  # a forward state for jvp (with gradients enabled)
        try:
            r = np.asarray(m.jvp(*input_tangents, param_tangents=param_tangents))
        finally:
            m.clear_saved()
        s.dtypes[f"jvp {name}"] = r.dtype
        return _as_output(r)

    analytic = {n: np.asarray(r, dtype=np.float64) for n, r in s.raw.items()}
    return _Problem(s.label, s.run, s.g, s.out, s.checked, analytic, tangent_of, s.dtypes)


def _jiggled(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``x * (1 + u32 * xi)``, ``xi`` uniform in (-1, 1): the input moved by float32 rounding."""
    return x * (1.0 + _U32 * rng.uniform(-1.0, 1.0, x.shape))


def _rounding32(r64, moved, opts: _Options):
    """``(tolerance, floor)`` of a float32 result against float64 at the same values.

    Two things make them differ: float32 rounding inside the computation, about a few float32
    ulps of the tensor's scale, and the problem's sensitivity: how far the float64 result moves
    (``moved``) when the inputs move by their own float32 rounding (an ill-conditioned softmax
    of large scores moves a lot).  Tolerance: ``C * |moved - r64| + rtol * |r64| + floor``, the
    floor ``rtol * max|r64|`` (``atol`` when given), ``C = 64``, ``rtol = 64 u32`` by default."""
    r64 = np.asarray(r64, dtype=np.float64)
    floor = opts.atol if opts.atol is not None else opts.rtol * float(np.max(np.abs(r64), initial=0.0))
    return _C32 * np.abs(np.asarray(moved, dtype=np.float64) - r64) + opts.rtol * np.abs(r64) + floor, floor


def _renamed(row: GradcheckRow, name: str, note: str = "", **changes) -> GradcheckRow:
    """``row`` named ``name``, failed with ``note`` when there is one; ``changes`` replace extras
    (``mode``, ``in_output``, ...)."""
    extras = {k: getattr(row, k) for k in _ROW_EXTRAS if k != "note"}
    extras.update(changes)
    return GradcheckRow(name, row.max_abs_err, row.max_rel_err, row.ok and not note, note=note, **extras)


def _dtype_note(got_dtype) -> str:
    return "" if got_dtype == np.dtype(np.float32) else f"returned {got_dtype}, expected float32"


def _float32_report(make, inputs, kwargs, opts: _Options, label):
    """``dtype=np.float32``: the float32 path's output against the float64 path's at the same
    (float32) values, and its gradients and JVPs against central differences of the float64
    forward there, each with the float32 rounding bound of :func:`_rounding32` added to the
    difference's own tolerance.  (The float64 path's gradient enters only through how far it
    moves with the inputs' float32 rounding, never as the reference: a mistake shared by both
    paths fails here too.)"""
    ins32 = [_prepare_input(x, np.float32) for x in inputs]
    kw32 = {k: (_prepare_input(v, np.float32) if _is_float_array(v) else v) for k, v in kwargs.items()}
    p32 = make(np.float32, ins32, kw32, opts, np.float32)
    p64 = make(np.float64, ins32, kw32, opts, np.float32)
    pmv = make(np.float64, ins32, kw32, opts, np.float32, np.random.default_rng([opts.seed, 3]))
    bound, floor = _rounding32(p64.out, pmv.out, opts)
    note = _dtype_note(p32.dtypes["output"])
    rows = [_row("output", p32.out, p64.out, bound, floor, opts.rtol, "float32", None, note)]
    analytic: dict = {}
    numerical: dict = {}
    directions = np.random.default_rng([opts.seed, 1])
    tangents = np.random.default_rng([opts.seed, 2])
    if opts.mode in ("fwd", "both") and (p32.jvp is None or p64.jvp is None or pmv.jvp is None):
        raise ValueError(f"{label}: mode={opts.mode!r} needs a forward mode (JVP) and the target has none")
    for name, arr in p64.checked:
        if opts.mode in ("rev", "both"):
            extra, _ = _rounding32(p64.analytic[name], pmv.analytic[name], opts)
            r32 = p32.analytic[name]
            if opts.fast:
                v = directions.standard_normal(arr.shape)
                row, (av, n) = _check_direction(p64, name, arr, v, opts, r32, extra, "float32")
                analytic[name], numerical[name] = np.asarray(av), np.asarray(n)
            else:
                row, numerical[name] = _check_elements(p64, name, arr, opts, r32, extra, "float32")
                analytic[name] = r32
            rows.append(_renamed(row, name, _dtype_note(p32.dtypes[name])))
        if opts.mode in ("fwd", "both"):

            def jvp32(name, t):
                t32 = t.astype(np.float32)  # the float32 path's tangent: t rounded
                j64 = p64.jvp(name, t32)
                extra, _ = _rounding32(j64, pmv.jvp(name, t32), opts)
                # t32 is t rounded: its float64 JVP's distance from t's joins the tolerance
                return p32.jvp(name, t32), extra + _C32 * np.abs(j64 - p64.jvp(name, t))

            row, _ = _check_jvp(p64, name, arr, tangents.standard_normal(arr.shape), opts, jvp32, "float32")
            rows.append(_renamed(row, f"jvp {name}", _dtype_note(p32.dtypes[f"jvp {name}"])))
    return GradcheckReport(
        rows,
        target=label,
        eps=opts.eps,
        rtol=opts.rtol,
        atol=opts.atol,
        analytic=analytic,
        numerical=numerical,
        dtype="float32",
    )


# Second order: gradgradcheck, gradcheck's forward-mode check of the backward
_EXPECTED_SECOND = "a forward function, a (forward, backward, backward_jvp) tuple or a Module instance"
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


@shared_doc(**_CHECK_DOC)
def gradgradcheck(
    target, *inputs, seed=0, eps=None, rtol=None, atol=None, wrt=None, raise_exception=False, **forward_kwargs
) -> GradcheckReport:
    """Compare ``backward_jvp`` with central differences of the backward, and check ``<u, Hv> = <Hu, v>``.

    <target>
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
    <forward_kwargs_returns>
        One row ``"d<gradient> along <moved>"`` (mode ``"backward_jvp"``) per gradient and moved
        tensor, whose ``at`` indexes the gradient, and a row ``"hessian"`` (mode ``"symmetry"``);
        ``str(report)`` is a table titled ``gradgradcheck``.

    <raises>
    TypeError
        A target without a second order (no ``<op>_backward_jvp``, a module without
        ``backward_jvp`` or whose ``backward_jvp`` raises ``NotImplementedError``), a tuple that
        is not ``(forward, backward, backward_jvp)``, or bad arguments (as gradcheck's).
    ValueError
        Bad arguments, unknown ``wrt`` names, or results of the wrong number or shape.
    <runtime_error>

    <npattn_examples>
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
    prepare, label = _second_order_target(target)
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


def _second_order_target(target):
    """``(prepare(inputs, kwargs, opts) -> _SecondOrder, label)`` for any target."""
    _refuse_class(target, _EXPECTED_SECOND)
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
        backward, backward_jvp = companion(forward, "_backward"), companion(forward, "_backward_jvp")
        for what, found in (("_backward", backward), ("_backward_jvp", backward_jvp)):
            if not callable(found):
                raise TypeError(
                    f"target: no '{fname}{what}' next to {fname!r} in module {getattr(forward, '__module__', None)!r} "
                    "(gradgradcheck needs the backward and its second order <op>_backward_jvp); pass a "
                    "(forward, backward, backward_jvp) tuple"
                )
    else:
        raise TypeError(f"target: expected {_EXPECTED_SECOND}, got {type(target).__name__}")

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

"""Check a hand-written backward against central finite differences.

``gradcheck(target, *inputs, **forward_kwargs)`` runs ``target`` once to get the analytic
gradients of ``sum(out * g)`` for a random upstream gradient ``g`` (never all ones, which would
hide transposition and broadcasting mistakes), then estimates the same gradients by central
differences, one element at a time, and reports the worst error of every checked tensor::

    >>> import numpy as np
    >>> from npattn.functional import softmax
    >>> from npattn.gradcheck import gradcheck
    >>> report = gradcheck(softmax, np.random.default_rng(0).standard_normal((2, 3)), axis=0)
    >>> report.ok
    True

Everything runs in float64: float inputs are copied and cast (so the caller's arrays are never
touched); integer inputs (token ids, class targets) and bool masks are passed through untouched
and get no gradient; a list of floats counts as a float array; anything else that is not an
ndarray (``None``, python numbers, strings) is passed through as a constant.  Positional float
arrays are checked; a float array passed by keyword is a constant (``attn_mask=m``) unless the
backward appends a gradient for it (``sinks=``, ``mask_grad=True``).  ``wrt=`` names what to
check; ``fast=True`` checks one random direction per tensor (two forwards each) instead of every
element.  Because ``eps``, ``rtol``, ``atol``, ``seed``, ``wrt`` and ``fast`` are this
function's own keywords, an op's ``eps`` (``layer_norm``) must be passed positionally.

This module imports numpy and the standard library only.
"""

from __future__ import annotations

import copy
import inspect
import math
import numbers
import sys
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence

import numpy as np

from ..nn.module import Module

__all__ = ["gradcheck", "GradcheckReport", "GradcheckRow", "numerical_gradient"]


class _RowFields(NamedTuple):
    name: str
    max_abs_err: float
    max_rel_err: float
    ok: bool


class GradcheckRow(_RowFields):
    """One checked tensor: ``(name, max_abs_err, max_rel_err, ok)`` and ``.mode``.

    ``mode`` is ``"element"`` (the worst error over the tensor's elements, each compared with its
    own central difference) or ``"direction"`` (``fast=True``: the one directional derivative
    ``<analytic gradient, u>`` against the central difference along a random ``u``).  The row
    unpacks as the 4-tuple, whatever the mode.
    """

    mode: str

    def __new__(cls, name, max_abs_err, max_rel_err, ok, mode: str = "element"):
        self = super().__new__(cls, name, max_abs_err, max_rel_err, ok)
        self.mode = mode
        return self

    def __getnewargs__(self):
        return (*self, self.mode)

    def __repr__(self):
        return (
            f"GradcheckRow(name={self.name!r}, max_abs_err={self.max_abs_err!r}, "
            f"max_rel_err={self.max_rel_err!r}, ok={self.ok!r}, mode={self.mode!r})"
        )


class GradcheckReport:
    """The result of :func:`gradcheck`.

    * ``ok``: every element of every checked tensor passed;
    * ``rows``: a list of :class:`GradcheckRow` ``(name, max_abs_err, max_rel_err, ok)``;
    * ``failed``: the names of the rows that did not pass;
    * ``analytic`` / ``numerical``: ``{name: gradient array}`` for a closer look;
    * ``str(report)``: an aligned table.

    An element passes iff ``|a - n| <= max(atol, rtol * max(|a|, |n|))``; the relative error
    reported is ``|a - n| / max(|a|, |n|, atol / rtol)``, so a row is ok iff its
    ``max_rel_err <= rtol``.  Truth-testing a report raises ``TypeError``: write ``report.ok``
    (``assert gradcheck(...)`` would otherwise pass whatever the result).
    """

    def __init__(self, rows, *, target="", eps=1e-6, rtol=1e-5, atol=1e-8, analytic=None, numerical=None):
        self.rows: List[GradcheckRow] = list(rows)
        self.target = target
        self.eps, self.rtol, self.atol = eps, rtol, atol
        self.analytic = dict(analytic or {})
        self.numerical = dict(numerical or {})

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)

    @property
    def failed(self) -> List[str]:
        return [r.name for r in self.rows if not r.ok]

    def __bool__(self):
        raise TypeError("GradcheckReport: use report.ok (truth-testing a report is ambiguous)")

    def __iter__(self):
        return iter(self.rows)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, name_or_index):
        """``report["weight"]`` (by name) or ``report[0]`` (by position) -> a row."""
        if isinstance(name_or_index, str):
            for r in self.rows:
                if r.name == name_or_index:
                    return r
            raise KeyError(f"no checked tensor named {name_or_index!r}; have {[r.name for r in self.rows]}")
        return self.rows[name_or_index]

    @property
    def modes(self) -> List[str]:
        """The modes of the rows, in order (``"element"`` or ``"direction"``)."""
        return [getattr(r, "mode", "element") for r in self.rows]

    def __str__(self):
        with_mode = any(m != "element" for m in self.modes)
        head = ("name", "max abs err", "max rel err", "ok") + (("mode",) if with_mode else ())
        body = [
            (r.name, f"{r.max_abs_err:.3e}", f"{r.max_rel_err:.3e}", "yes" if r.ok else "NO")
            + ((m,) if with_mode else ())
            for r, m in zip(self.rows, self.modes)
        ]
        widths = [max(len(row[i]) for row in [head] + body) for i in range(len(head))]

        def fmt(row):
            cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:3], widths[1:3])]
            cells += [c.ljust(w) for c, w in zip(row[3:], widths[3:])]
            return " | ".join(cells).rstrip()

        modes = set(self.modes)
        how = (
            "one random direction per tensor"
            if modes == {"direction"}
            else "per element"
            if modes <= {"element"}
            else "per element and by direction"
        )
        title = (
            f"gradcheck {self.target}: {'ok' if self.ok else 'FAILED'} "
            f"({how}; eps={self.eps:g}, rtol={self.rtol:g}, atol={self.atol:g})"
        )
        sep = "-+-".join("-" * w for w in widths)
        return "\n".join([title, fmt(head), sep] + [fmt(b) for b in body])

    def __repr__(self):
        return f"<GradcheckReport {self.target} ok={self.ok} failed={self.failed}>"


def numerical_gradient(f: Callable[[np.ndarray], float], x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Central-difference gradient of the scalar function ``f`` at ``x``.

    ``grad[i] = (f(x + eps e_i) - f(x - eps e_i)) / (2 eps)``, one element at a time.  ``x``
    must be a writable float ndarray; it is perturbed *in place* (so ``f`` may read it through a
    closure instead of its argument) and restored exactly afterwards.  Costs ``2 * x.size``
    calls of ``f``; the error is ``O(eps^2)`` truncation plus ``O(|f| * 1e-16 / eps)`` rounding.
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


def _errors(a: np.ndarray, n: np.ndarray, rtol: float, atol: float):
    """(max_abs_err, max_rel_err, ok) with the element test ``|a-n| <= max(atol, rtol*max(|a|,|n|))``."""
    if a.size == 0:
        return 0.0, 0.0, True
    a = a.astype(np.float64, copy=False)
    err = np.abs(a - n)
    denom = np.maximum(np.maximum(np.abs(a), np.abs(n)), atol / rtol)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(denom > 0, err / np.where(denom > 0, denom, 1.0), np.where(err > 0, np.inf, 0.0))
    bad = ~(np.isfinite(a) & np.isfinite(n))
    if bad.any():
        err = np.where(bad, np.inf, err)
        rel = np.where(bad, np.inf, rel)
    ok_elem = err <= np.maximum(atol, rtol * np.maximum(np.abs(a), np.abs(n)))
    ok_elem &= ~bad
    return float(err.max()), float(rel.max()), bool(ok_elem.all())


def _is_float_array(x) -> bool:
    return isinstance(x, np.ndarray) and x.dtype.kind == "f"


def _prepare_input(x):
    """float arrays (and lists of floats) -> float64 copies (checked); everything else untouched."""
    if isinstance(x, list):
        try:
            a = np.asarray(x)
        except ValueError:  # ragged: let the forward complain
            return x
        if a.dtype.kind == "f":
            return a.astype(np.float64)
        return x
    if _is_float_array(x):
        return np.array(x, dtype=np.float64, copy=True)
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


def _pair_grads(grads, inputs, names, what: str):
    """Map a backward's results onto the float inputs.  Returns ``{input index: grad}``."""
    if grads is None:
        grads = ()
    elif not isinstance(grads, (tuple, list)):
        grads = (grads,)
    float_idx = [i for i, x in enumerate(inputs) if _is_float_array(x)]
    pairs = {}
    if len(grads) == len(inputs):
        for i, (x, g) in enumerate(zip(inputs, grads)):
            if not _is_float_array(x):
                continue
            if g is None:
                raise ValueError(
                    f"{what} returned None as the gradient of float input {names[i]!r} "
                    f"(position {i}); pass constants by keyword or as non-float arrays"
                )
            pairs[i] = g
    else:
        got = [g for g in grads if g is not None]
        if len(got) != len(float_idx):
            raise ValueError(
                f"{what} returned {len(grads)} value(s), {len(got)} of them not None, for "
                f"{len(inputs)} positional input(s) of which {len(float_idx)} are float arrays "
                f"({[names[i] for i in float_idx]}): cannot tell which gradient belongs to which input; "
                "pass constant float arrays (e.g. a float attn_mask) by keyword"
            )
        pairs = dict(zip(float_idx, got))
    for i, g in pairs.items():
        g = np.asarray(g)
        if g.shape != inputs[i].shape:
            raise ValueError(
                f"{what}: the gradient of {names[i]!r} has shape {g.shape}, expected {inputs[i].shape} (the input's)"
            )
        pairs[i] = g
    return pairs


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _objective(out, g) -> float:
    out = np.asarray(out, dtype=np.float64)
    return float(np.dot(out.reshape(-1), g.reshape(-1)))


def _check_tolerances(eps, rtol, atol):
    for name, value, zero_ok in (("eps", eps, False), ("rtol", rtol, False), ("atol", atol, True)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(
                f"{name}: expected a finite number {'>= 0' if zero_ok else '> 0'}, "
                f"got {value!r} ({type(value).__name__})"
            )
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
            raise ValueError(f"{name}: expected a finite number {'>= 0' if zero_ok else '> 0'}, got {value!r}")


# --------------------------------------------------------------------------------------------


def gradcheck(
    target, *inputs, seed=0, eps=1e-6, rtol=1e-5, atol=1e-8, wrt=None, fast=False, **forward_kwargs
) -> GradcheckReport:
    """Compare a backward with central differences of ``sum(forward(*inputs) * g)``.

    ``target`` is one of

    * a functional forward ``op`` returning ``(out, cache)``; its backward is
      ``<op name>_backward`` in the same python module;
    * a ``(forward, backward)`` tuple with the same protocol;
    * a :class:`npattn.module.Module` instance: it is deep-copied and cast to float64 (the
      caller's module is untouched), called as ``m(*inputs, **forward_kwargs)`` (a tuple output
      such as ``(out, weights)`` uses its first element), and ``m.backward(g)`` gives the input
      gradient(s); every parameter is checked too, its gradient read from ``p.grad`` after
      ``zero_grad()``.

    The upstream gradient is ``np.random.default_rng(seed).standard_normal(out.shape)``.
    Backward results are normalised to a tuple; when its length equals the number of positional
    inputs they pair up by position (``None`` gradients and non-float inputs skipped), otherwise
    the non-``None`` gradients pair in order with the float inputs.  A backward that returns
    *more* gradients than there are positional inputs (``sinks=``'s ``dsinks``, ``mask_grad``'s
    ``dmask``) pairs the first ones by position and the extra, non-``None`` ones in order with
    the float keyword arrays (in the forward's signature order; only those named in ``wrt`` when
    ``wrt`` names any).  A mismatch raises ``ValueError``.

    ``wrt``: the names of the tensors to check, a string or a sequence of strings (default: every
    float array input with a gradient and, for modules, every parameter).  The names are the row
    names: the forward's parameter names (``x``, ``q``, ``attn_mask``, ``sinks`` ...), for
    modules ``input`` (one input) or the forward's parameter names, and the dotted parameter
    names (``W_query.weight``).  An unknown name raises ``ValueError`` listing the valid ones.

    ``fast=True`` checks one random direction ``u`` per tensor instead of every element: the
    analytic directional derivative ``<backward(g), u>`` against the central difference
    ``(f(x + eps u) - f(x - eps u)) / (2 eps)`` of ``f = <forward, g>``, two forwards per tensor
    instead of two per element.  A wrong gradient is caught with probability 1 (the direction
    is Gaussian), but the row cannot say which element is wrong; the default per-element table
    is the one to read when learning.  Rows say their ``mode`` (``"element"``/``"direction"``).

    Randomness: every ``np.random.Generator`` among the arguments is snapshotted and a fresh copy
    is passed to each forward; a module's own Generator attributes are saved and restored before
    each forward, so dropout draws the same mask every time.  A forward that still gives two
    different outputs at the same point, or that writes into its inputs, raises ``RuntimeError``.

    Returns a :class:`GradcheckReport`.
    """
    _check_tolerances(eps, rtol, atol)
    if not inputs:
        raise ValueError("inputs: expected at least one positional input to check, got none")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed: expected a non-negative integer, got {seed!r} ({type(seed).__name__})")
    if seed < 0:
        raise ValueError(f"seed: expected a non-negative integer, got {seed!r}")
    if not isinstance(fast, (bool, np.bool_)):
        raise TypeError(f"fast: expected True or False, got {fast!r} ({type(fast).__name__})")
    wrt = _normalise_wrt(wrt)
    if isinstance(target, type):
        raise TypeError(
            f"target: expected a forward function, a (forward, backward) pair or a Module "
            f"instance, got the class {target.__name__} (instantiate it first)"
        )
    opts = _Options(int(seed), eps, rtol, atol, wrt, bool(fast))
    if isinstance(target, Module):
        return _gradcheck_module(target, inputs, opts, forward_kwargs)
    if isinstance(target, tuple):
        if len(target) != 2 or not all(callable(t) for t in target):
            raise TypeError(
                f"target: expected a (forward, backward) pair of callables, got a tuple of {len(target)} item(s)"
            )
        forward, backward = target
    elif callable(target):
        forward = target
        fname = getattr(forward, "__name__", None)
        mod = sys.modules.get(getattr(forward, "__module__", None) or "")
        backward = getattr(mod, f"{fname}_backward", None) if (mod is not None and fname) else None
        if not callable(backward):
            raise ValueError(
                f"target: no backward '{fname}_backward' next to {fname!r} in module "
                f"{getattr(forward, '__module__', None)!r}; pass a (forward, backward) tuple"
            )
    else:
        raise TypeError(
            f"target: expected a forward function, a (forward, backward) pair or a Module "
            f"instance, got {type(target).__name__}"
        )
    return _gradcheck_functional(forward, backward, inputs, opts, forward_kwargs)


class _Options(NamedTuple):
    seed: int
    eps: float
    rtol: float
    atol: float
    wrt: Optional[List[str]]
    fast: bool


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


def _directional(objective, arr: np.ndarray, u: np.ndarray, eps: float) -> float:
    """Central difference of ``objective`` along ``u`` (``arr`` perturbed in place, then restored)."""
    orig = arr.copy()
    try:
        arr += eps * u
        fp = float(objective())
        np.subtract(orig, eps * u, out=arr)
        fm = float(objective())
    finally:
        arr[...] = orig
    return (fp - fm) / (2.0 * eps)


def _run_checks(objective, checked, analytic, opts: _Options, label):
    """Numerical gradients of ``objective`` w.r.t. each array in ``checked`` and the report."""
    rows, numerical = [], {}
    if opts.fast:
        directions = np.random.default_rng([opts.seed, 1])
        analytic = dict(analytic)
        for name, arr in checked:
            u = directions.standard_normal(arr.shape)
            a = np.asarray(float(np.dot(np.asarray(analytic[name], np.float64).reshape(-1), u.reshape(-1))))
            n = np.asarray(_directional(objective, arr, u, opts.eps))
            analytic[name], numerical[name] = a, n
            err_abs, err_rel, ok = _errors(a, n, opts.rtol, opts.atol)
            rows.append(GradcheckRow(name, err_abs, err_rel, ok, mode="direction"))
    else:
        for name, arr in checked:
            num = numerical_gradient(lambda _: objective(), arr, opts.eps)
            numerical[name] = num
            rows.append(GradcheckRow(name, *_errors(analytic[name], num, opts.rtol, opts.atol)))
    return GradcheckReport(
        rows, target=label, eps=opts.eps, rtol=opts.rtol, atol=opts.atol, analytic=analytic, numerical=numerical
    )


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


def _pair_extra_grads(grads, inputs, names, kw_float, wrt, what):
    """A backward with more results than positional inputs: the first pair by position, the
    extra non-None ones with the float keyword arrays (``kw_float``, signature order; those in
    ``wrt`` when it names any).  Returns ``(positional grads, {keyword: grad})`` or None."""
    if len(grads) <= len(inputs):
        return None
    extra = [g for g in grads[len(inputs) :] if g is not None]
    named = [k for k in kw_float if wrt is not None and k in wrt]
    targets = named or kw_float
    if not extra or len(extra) != len(targets):
        return None
    return tuple(grads[: len(inputs)]), dict(zip(targets, extra))


def _gradcheck_functional(forward, backward, inputs, opts, kwargs):
    label = getattr(forward, "__name__", "forward")
    inputs = [_prepare_input(x) for x in inputs]
    names = _positional_names(forward, len(inputs), "input")
    kwargs = dict(kwargs)
    kw_float = [k for k in _keyword_order(forward, kwargs) if _is_float_array(kwargs[k])]
    for k in kw_float:  # float64 copies: they may be checked (perturbed in place) below
        kwargs[k] = np.array(kwargs[k], dtype=np.float64, copy=True)
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
    g = np.asarray(np.random.default_rng(opts.seed).standard_normal(out.shape))
    _check_deterministic(out, call()[0], label)
    what = f"{getattr(backward, '__name__', 'backward')}"
    grads = backward(g.astype(out.dtype) if out.dtype.kind == "f" else g, cache)
    if grads is None:
        grads = ()
    elif not isinstance(grads, (tuple, list)):
        grads = (grads,)
    kw_grads: Dict[str, np.ndarray] = {}
    float_pos = [i for i, x in enumerate(inputs) if _is_float_array(x)]
    if len(grads) > len(inputs) and len([x for x in grads if x is not None]) != len(float_pos):
        split = _pair_extra_grads(tuple(grads), inputs, names, kw_float, opts.wrt, what)
        if split is not None:
            grads, kw_grads = split
    pairs = _pair_grads(grads, inputs, names, what)
    for k, gk in kw_grads.items():
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
    analytic = {names[i]: np.asarray(pairs[i], dtype=np.float64) for i in sorted(pairs)}
    analytic.update({k: np.asarray(v, dtype=np.float64) for k, v in kw_grads.items()})
    if opts.wrt is not None:
        checked = [(n, a) for n, a in checked if n in opts.wrt]
    if not checked:
        raise ValueError(f"{label}: nothing to check: no positional float input")
    return _run_checks(lambda: _objective(call()[0], g), checked, analytic, opts, label)


def _gradcheck_module(module, inputs, opts, kwargs):
    label = type(module).__name__
    m = copy.deepcopy(module)
    m.to(np.float64)
    inputs = [_prepare_input(x) for x in inputs]
    float_idx = [i for i, x in enumerate(inputs) if _is_float_array(x)]
    if len(float_idx) == 1 and len(inputs) == 1:
        in_names = ["input"]
    else:
        in_names = _positional_names(m.forward, len(inputs), "input")
    params = []
    seen = set()
    for pname, p in m.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            params.append((pname, p))
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

    pristine = [x.copy() if isinstance(x, np.ndarray) else None for x in inputs]
    out = np.asarray(call())
    _check_unmodified(inputs, pristine, in_names, label)
    _check_deterministic(out, np.asarray(call()), label)
    out = np.asarray(call())  # the forward whose state backward uses
    g = np.asarray(np.random.default_rng(opts.seed).standard_normal(out.shape))
    m.zero_grad()
    grads = _pair_grads(m.backward(g), inputs, in_names, f"{label}.backward")
    analytic = {in_names[i]: np.asarray(grads[i], dtype=np.float64) for i in sorted(grads)}
    checked = [(in_names[i], inputs[i]) for i in sorted(grads)]
    for pname, p in params:
        if p.data.dtype.kind != "f":
            continue
        analytic[pname] = np.zeros(p.data.shape) if p.grad is None else np.array(p.grad, dtype=np.float64, copy=True)
        if p.data.dtype != np.float64 or not p.data.flags.writeable:
            p.data = np.array(p.data, dtype=np.float64, copy=True)
        checked.append((pname, p.data))
    if opts.wrt is not None:
        checked = [(n, a) for n, a in checked if n in opts.wrt]
    if not checked:
        raise ValueError(f"{label}: nothing to check: no float input and no parameter")
    return _run_checks(lambda: _objective(call(), g), checked, analytic, opts, label)

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
ndarray (``None``, python numbers, strings) is passed through as a constant.  Only *positional* float arrays are checked, so pass a float mask
or any other constant array by keyword (``attn_mask=m``).  Because ``eps``, ``rtol``, ``atol``
and ``seed`` are this function's own keywords, an op's ``eps`` (``layer_norm``) must be passed
positionally.

This module imports numpy and the standard library only.
"""
from __future__ import annotations

import copy
import inspect
import math
import numbers
import sys
from typing import Callable, List, NamedTuple, Optional, Sequence

import numpy as np

from ..nn.module import Module

__all__ = ["gradcheck", "GradcheckReport", "GradcheckRow", "numerical_gradient"]


class GradcheckRow(NamedTuple):
    """One checked tensor: the worst absolute and relative error over its elements."""

    name: str
    max_abs_err: float
    max_rel_err: float
    ok: bool


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

    def __str__(self):
        head = ("name", "max abs err", "max rel err", "ok")
        body = [(r.name, f"{r.max_abs_err:.3e}", f"{r.max_rel_err:.3e}", "yes" if r.ok else "NO")
                for r in self.rows]
        widths = [max(len(row[i]) for row in [head] + body) for i in range(4)]

        def fmt(row):
            cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:3], widths[1:3])]
            cells.append(row[3].ljust(widths[3]))
            return " | ".join(cells).rstrip()

        title = (f"gradcheck {self.target}: {'ok' if self.ok else 'FAILED'} "
                 f"(eps={self.eps:g}, rtol={self.rtol:g}, atol={self.atol:g})")
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
        raise TypeError(f"x: expected a float ndarray, got {type(x).__name__}"
                        + (f" of dtype {x.dtype}" if isinstance(x, np.ndarray) else ""))
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
                raise ValueError(f"{what} returned None as the gradient of float input {names[i]!r} "
                                 f"(position {i}); pass constants by keyword or as non-float arrays")
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
            raise ValueError(f"{what}: the gradient of {names[i]!r} has shape {g.shape}, "
                             f"expected {inputs[i].shape} (the input's)")
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
            raise TypeError(f"{name}: expected a finite number {'>= 0' if zero_ok else '> 0'}, "
                            f"got {value!r} ({type(value).__name__})")
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
            raise ValueError(f"{name}: expected a finite number {'>= 0' if zero_ok else '> 0'}, got {value!r}")


# --------------------------------------------------------------------------------------------

def gradcheck(target, *inputs, seed=0, eps=1e-6, rtol=1e-5, atol=1e-8, **forward_kwargs) -> GradcheckReport:
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
    the non-``None`` gradients pair in order with the float inputs; a mismatch raises
    ``ValueError``.

    Randomness: every ``np.random.Generator`` among the arguments is snapshotted and a fresh copy
    is passed to each forward; a module's own Generator attributes are saved and restored before
    each forward, so dropout draws the same mask every time.  A forward that still gives two
    different outputs at the same point, or that writes into its inputs, raises ``RuntimeError``.

    Rows are named after the forward's parameters (``x``, ``weight``, ``q``...), for modules
    ``input`` (one input) or the forward's parameter names (``query``, ``key``, ``value``)
    followed by the dotted parameter names.  Returns a :class:`GradcheckReport`.
    """
    _check_tolerances(eps, rtol, atol)
    if not inputs:
        raise ValueError("inputs: expected at least one positional input to check, got none")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed: expected a non-negative integer, got {seed!r} ({type(seed).__name__})")
    if seed < 0:
        raise ValueError(f"seed: expected a non-negative integer, got {seed!r}")
    if isinstance(target, type):
        raise TypeError(f"target: expected a forward function, a (forward, backward) pair or a Module "
                        f"instance, got the class {target.__name__} (instantiate it first)")
    if isinstance(target, Module):
        return _gradcheck_module(target, inputs, seed, eps, rtol, atol, forward_kwargs)
    if isinstance(target, tuple):
        if len(target) != 2 or not all(callable(t) for t in target):
            raise TypeError("target: expected a (forward, backward) pair of callables, "
                            f"got a tuple of {len(target)} item(s)")
        forward, backward = target
    elif callable(target):
        forward = target
        fname = getattr(forward, "__name__", None)
        mod = sys.modules.get(getattr(forward, "__module__", None) or "")
        backward = getattr(mod, f"{fname}_backward", None) if (mod is not None and fname) else None
        if not callable(backward):
            raise ValueError(f"target: no backward '{fname}_backward' next to {fname!r} in module "
                             f"{getattr(forward, '__module__', None)!r}; pass a (forward, backward) tuple")
    else:
        raise TypeError(f"target: expected a forward function, a (forward, backward) pair or a Module "
                        f"instance, got {type(target).__name__}")
    return _gradcheck_functional(forward, backward, inputs, seed, eps, rtol, atol, forward_kwargs)


def _run_checks(objective, checked, analytic, eps, rtol, atol, label):
    """Numerical gradients of ``objective`` w.r.t. each array in ``checked`` and the report."""
    rows, numerical = [], {}
    for name, arr in checked:
        num = numerical_gradient(lambda _: objective(), arr, eps)
        numerical[name] = num
        rows.append(GradcheckRow(name, *_errors(analytic[name], num, rtol, atol)))
    return GradcheckReport(rows, target=label, eps=eps, rtol=rtol, atol=atol,
                           analytic=analytic, numerical=numerical)


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
            raise RuntimeError(f"{label}: the forward modified its input {names[i]!r}; "
                               "finite differences would be meaningless")


def _check_deterministic(out1, out2, label):
    if np.shape(out1) != np.shape(out2) or not np.array_equal(np.asarray(out1), np.asarray(out2), equal_nan=True):
        raise RuntimeError(f"{label}: two forward calls at the same point gave different outputs; "
                           "pass randomness as an np.random.Generator or an int seed (rng=...)")


def _gradcheck_functional(forward, backward, inputs, seed, eps, rtol, atol, kwargs):
    label = getattr(forward, "__name__", "forward")
    inputs = [_prepare_input(x) for x in inputs]
    names = _positional_names(forward, len(inputs), "input")
    pos_gens = {i: copy.deepcopy(x) for i, x in enumerate(inputs) if isinstance(x, np.random.Generator)}
    kw_snapshot = _fresh_generators(kwargs)

    def call():
        args = list(inputs)
        for i, gen in pos_gens.items():
            args[i] = copy.deepcopy(gen)
        return forward(*args, **_fresh_generators(kw_snapshot))

    pristine = [x.copy() if isinstance(x, np.ndarray) else None for x in inputs]
    res = call()
    if not (isinstance(res, tuple) and len(res) == 2):
        raise TypeError(f"{label}: expected the forward to return (out, cache), got {type(res).__name__}")
    out, cache = res
    _check_unmodified(inputs, pristine, names, label)
    out = np.asarray(out)
    g = np.asarray(np.random.default_rng(seed).standard_normal(out.shape))
    _check_deterministic(out, call()[0], label)
    grads = _pair_grads(backward(g.astype(out.dtype) if out.dtype.kind == "f" else g, cache),
                        inputs, names, f"{getattr(backward, '__name__', 'backward')}")
    if not grads:
        raise ValueError(f"{label}: nothing to check: no positional float input")
    checked = [(names[i], inputs[i]) for i in sorted(grads)]
    analytic = {names[i]: np.asarray(grads[i], dtype=np.float64) for i in sorted(grads)}
    return _run_checks(lambda: _objective(call()[0], g), checked, analytic, eps, rtol, atol, label)


def _gradcheck_module(module, inputs, seed, eps, rtol, atol, kwargs):
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
    g = np.asarray(np.random.default_rng(seed).standard_normal(out.shape))
    m.zero_grad()
    grads = _pair_grads(m.backward(g), inputs, in_names, f"{label}.backward")
    analytic = {in_names[i]: np.asarray(grads[i], dtype=np.float64) for i in sorted(grads)}
    checked = [(in_names[i], inputs[i]) for i in sorted(grads)]
    for pname, p in params:
        if p.data.dtype.kind != "f":
            continue
        analytic[pname] = np.array(p.grad, dtype=np.float64, copy=True)
        if p.data.dtype != np.float64 or not p.data.flags.writeable:
            p.data = np.array(p.data, dtype=np.float64, copy=True)
        checked.append((pname, p.data))
    if not checked:
        raise ValueError(f"{label}: nothing to check: no float input and no parameter")
    return _run_checks(lambda: _objective(call(), g), checked, analytic, eps, rtol, atol, label)

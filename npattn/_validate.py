"""Input checks shared by the whole package.

Every public entry point validates its arguments here *before* any arithmetic, so a user sees
npattn's own ``TypeError``/``ValueError`` naming the argument and the expected and actual
value, never a numpy broadcasting or matmul error from deep inside a computation.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

_FLOAT_KINDS = "f"
_INT_KINDS = "iu"


def to_numpy(x, name: "str | None" = None):
    """Array-like -> ndarray without copying when possible (CPU torch tensors included).

    With ``name``, an array-like numpy cannot convert (e.g. a ragged nested list) raises
    ``TypeError("<name>: ...")`` instead of numpy's own error.
    """
    if isinstance(x, np.ndarray):
        return x
    try:
        if hasattr(x, "detach") and hasattr(x, "cpu"):  # a torch tensor, without importing torch
            x = x.detach().cpu().numpy()
        return np.asarray(x)
    except Exception as e:
        if name is None:
            raise
        raise TypeError(
            f"{name}: expected an array-like, got {type(x).__name__} that numpy cannot convert ({e})"
        ) from None


def as_float(x, name: str, dtype=None) -> np.ndarray:
    """Return ``x`` as a floating ndarray.

    Floating arrays keep their dtype unless ``dtype`` is given; integer arrays become ``dtype``
    (float64 when None).  bool, complex, string and object arrays raise ``TypeError``, and so do
    float16 and longdouble arrays (see :func:`check_float_dtype`: float32 and float64 only).
    Never copies when no cast is needed; never writes into ``x``.
    """
    a = to_numpy(x, name)  # e.g. ragged nested lists -> TypeError naming the argument
    kind = a.dtype.kind
    if kind in _FLOAT_KINDS:
        check_float_dtype(a.dtype, name)
        if dtype is not None and a.dtype != dtype:
            a = a.astype(dtype)
        return a
    if kind in _INT_KINDS:
        return a.astype(np.float64 if dtype is None else dtype)
    raise TypeError(
        f"{name}: expected a real floating or integer array, got dtype {a.dtype}"
        + (" (bool arrays are masks, not values)" if kind == "b" else "")
    )


def as_floats_of_one_dtype(*named) -> tuple:
    """``(name, array-like)`` pairs as float arrays of one dtype, as torch requires of the operands
    of one op (e.g. q, k and v of an attention).  Float arrays must share their dtype:
    ``TypeError`` naming the first that differs, before any arithmetic (a silent cast would
    compute float64 inputs in float32).  Integer arrays take that dtype (float64 when none is a
    float array); bool, complex, float16 ... raise as in :func:`as_float`.
    """
    arrays = [(name, to_numpy(x, name)) for name, x in named]
    floats = [(name, as_float(a, name)) for name, a in arrays if a.dtype.kind in _FLOAT_KINDS]
    dtype = floats[0][1].dtype if floats else None
    for name, a in floats[1:]:
        if a.dtype != dtype:
            raise TypeError(
                f"{name}: expected the dtype of {floats[0][0]}, {dtype}, got {a.dtype} "
                f"({', '.join(n for n, _ in arrays)} must share one dtype, as in torch; "
                f"convert with {name}.astype(np.{dtype}))"
            )
    return tuple(as_float(a, name, dtype) for name, a in arrays)


def as_index(x, name: str) -> np.ndarray:
    """Integer index array (token ids, class targets)."""
    a = to_numpy(x, name)
    if a.dtype.kind not in _INT_KINDS:
        raise TypeError(f"{name}: expected an integer array, got dtype {a.dtype}")
    return a


def check_ndim(a: np.ndarray, name: str, min_ndim: int, desc: str = "") -> None:
    if a.ndim < min_ndim:
        raise ValueError(
            f"{name}: expected at least {min_ndim} dimensions{' ' + desc if desc else ''}, got shape {a.shape}"
        )


def check_size(value, name: str, *, minimum: int = 1) -> int:
    """A positive integer size (bools and floats are refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an integer, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value}")
    return int(value)


def check_prob(p, name: str = "p") -> float:
    """A probability in [0, 1] (NaN, bools and non-numbers refused)."""
    if isinstance(p, bool) or not isinstance(p, numbers.Real):
        raise TypeError(f"{name}: expected a float in [0, 1], got {p!r} ({type(p).__name__})")
    p = float(p)
    if not (0.0 <= p <= 1.0):  # also catches NaN
        raise ValueError(f"{name}: expected a value in [0, 1], got {p}")
    return p


def check_positive_float(x, name: str, *, allow_zero: bool = False) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name}: expected a real number, got {x!r} ({type(x).__name__})")
    x = float(x)
    if not math.isfinite(x) or x < 0 or (x == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name}: expected a finite number {bound}, got {x}")
    return x


def check_bool(x, name: str) -> bool:
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name}: expected True or False, got {x!r} ({type(x).__name__})")
    return bool(x)


def check_axis(axis, ndim: int, name: str = "axis") -> int:
    if isinstance(axis, bool) or not isinstance(axis, numbers.Integral):
        raise TypeError(f"{name}: expected an integer, got {axis!r} ({type(axis).__name__})")
    axis = int(axis)
    if not -ndim <= axis < ndim:
        raise ValueError(f"{name}: expected a value in [{-ndim}, {ndim - 1}] for a {ndim}-d input, got {axis}")
    return int(axis) % ndim


def check_dtype(dtype, name: str = "dtype") -> np.dtype:
    """Module dtypes: float32 or float64."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{name}: expected np.float32 or np.float64, got {dtype!r}") from None
    if dt.kind == "f":
        check_float_dtype(dt, name, is_dtype_argument=True)
    if dt not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise TypeError(f"{name}: expected np.float32 or np.float64, got {dt}")
    return dt


def as_rng(rng, name: str = "rng") -> np.random.Generator:
    """``np.random.Generator`` (used as is), int seed, or None (fresh entropy)."""
    if isinstance(rng, np.random.Generator):
        return rng
    if rng is None:
        return np.random.default_rng()
    if isinstance(rng, bool) or not isinstance(rng, numbers.Integral):
        raise TypeError(f"{name}: expected a numpy Generator, an int seed or None, got {type(rng).__name__}")
    if rng < 0:
        raise ValueError(f"{name}: expected a non-negative seed, got {rng}")
    return np.random.default_rng(int(rng))


def _float_of_shape(a, name: str, shape, dtype, whose: str) -> np.ndarray:
    """A float (or integer) array of exactly ``shape`` (``whose`` shape it is, for the message),
    cast to ``dtype``."""
    g = as_float(a, name)
    if g.shape != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)} ({whose}), got {g.shape}")
    if g.dtype != dtype:
        g = g.astype(dtype)
    return g


def check_grad(dout, shape, dtype, name: str = "dout") -> np.ndarray:
    """An upstream gradient: same shape as the forward output, cast to its dtype."""
    return _float_of_shape(dout, name, shape, dtype, "the forward output's")


def check_tangents(tangents: tuple, names: tuple, op: str) -> tuple:
    """The tangents given to ``<op>_jvp``: at most ``len(names)`` of them (missing trailing ones
    are None, i.e. zero).  Returns a tuple of ``len(names)`` entries; more raise ``TypeError``
    listing the names expected."""
    if len(tangents) > len(names):
        raise TypeError(f"{op}: expected at most {len(names)} tangents ({', '.join(names)}), got {len(tangents)}")
    return tuple(tangents) + (None,) * (len(names) - len(tangents))


def check_tangent(t, name: str, shape, dtype, present: bool = True):
    """A tangent of a forward's input: None (zero), or a float (or integer) array of exactly the
    input's ``shape``, cast to the forward's ``dtype``.  bool, complex, string and object arrays
    raise ``TypeError``; another shape raises ``ValueError``.  ``present=False`` (the forward had
    no such input, e.g. no bias) accepts only None."""
    if t is None:
        return None
    if not present:
        raise ValueError(f"{name}: expected None (the forward had no such input), got {type(t).__name__}")
    return _float_of_shape(t, name, shape, dtype, "the input's")


def check_tangents_as(tangents: tuple, op: str, dtype, specs: tuple) -> tuple:
    """The tangents given to ``op`` (an ``<op>_jvp`` or ``<op>_backward_jvp``), one per spec
    ``(name, shape)`` or ``(name, shape, present)`` in the backward's order: at most
    ``len(specs)`` of them (:func:`check_tangents`; missing trailing ones are None, i.e. zero), each
    None or of its input's shape, cast to ``dtype`` (:func:`check_tangent`)."""
    padded = check_tangents(tuple(tangents), tuple(s[0] for s in specs), op)
    return tuple(check_tangent(t, s[0], s[1], dtype, *s[2:]) for t, s in zip(padded, specs))


def check_backward_jvp(dout, tangents, ddout, op: str, shape, dtype, specs: tuple) -> tuple:
    """The arguments of ``<op>_backward_jvp(dout, cache, tangents, ddout=None)`` after the cache:
    ``dout`` as the backward checks it (:func:`check_grad`, the forward output's ``shape``);
    ``tangents`` a tuple or list (None: every tangent zero) checked as ``<op>_jvp`` checks its
    tangents (:func:`check_tangents_as` with the op's ``specs``); ``ddout`` None (zero) or of
    ``dout``'s shape.  Returns ``(dout, tangents, ddout)``, cast to ``dtype``, tangents padded with
    None to ``len(specs)``."""
    dout = check_grad(dout, shape, dtype)
    if tangents is None:
        tangents = ()
    elif not isinstance(tangents, (tuple, list)):
        names = ", ".join(s[0] for s in specs)
        raise TypeError(
            f"tangents: expected a tuple of at most {len(specs)} tangents ({names}; None for zero) or None, "
            f"got {type(tangents).__name__}"
            + (f" (write ({specs[0][0]},) for one)" if hasattr(tangents, "shape") else "")
        )
    tangents = check_tangents_as(tangents, op, dtype, specs)
    ddout = None if ddout is None else check_grad(ddout, shape, dtype, "ddout")
    return dout, tangents, ddout


def check_mask(mask, name: str, target_shape) -> np.ndarray:
    """A bool (True = may attend) or float (additive) mask broadcastable to ``target_shape``.

    Float masks may hold any finite value and ``-inf`` (a blocked key); ``+inf`` and NaN would
    turn whole rows into NaN, so they raise ``ValueError``.
    """
    m = to_numpy(mask, name)
    kind = m.dtype.kind
    if kind in _INT_KINDS:
        raise TypeError(
            f"{name}: integer masks are ambiguous; pass bool (True = may attend) or float (added to scores), "
            f"got dtype {m.dtype}"
        )
    if kind not in "bf":
        raise TypeError(f"{name}: expected a bool or float array, got dtype {m.dtype}")
    if kind == "f":
        check_float_dtype(m.dtype, name)
    try:
        if np.broadcast_shapes(m.shape, tuple(target_shape)) != tuple(target_shape):
            raise ValueError
    except ValueError:
        raise ValueError(f"{name}: expected a shape broadcastable to {tuple(target_shape)}, got {m.shape}") from None
    check_additive_values(m, name)
    return m


def check_additive_values(m: np.ndarray, name: str) -> None:
    """A float mask: finite values or ``-inf`` only (``+inf``/NaN raise ``ValueError``); float16
    and longdouble masks raise ``TypeError`` (:func:`check_float_dtype`)."""
    if m.dtype.kind == "f":
        check_float_dtype(m.dtype, name)
    if m.dtype.kind == "f" and m.size and not (m < np.inf).all():  # False for +inf and NaN
        bad = "NaN" if np.isnan(m).any() else "+inf"
        raise ValueError(f"{name}: expected float mask values that are finite or -inf (-inf blocks a key), got {bad}")


_SUPPORTED_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
_UNSUPPORTED_WHY = {
    "float16": "its range overflows in layer norm's squares and softmax's sums",
}


def check_float_dtype(dtype, name: str, *, is_dtype_argument: bool = False) -> np.dtype:
    """The package's float policy: float32 and float64 are computed in their own dtype; every
    other float dtype (float16, longdouble) raises ``TypeError`` naming the argument and
    suggesting float32, before any arithmetic (never a silently wrong or overflowing result).
    The advice fits the argument: an array is converted (``x.astype(np.float32)``); a
    ``dtype`` argument (``is_dtype_argument``) is given another value (``dtype=np.float32``).
    """
    dt = np.dtype(dtype)
    if dt in _SUPPORTED_FLOATS:
        return dt
    why = _UNSUPPORTED_WHY.get(dt.name, "npattn computes in float32 or float64 only")
    if not dt.isnative:  # '>f4' on a little-endian machine: float32 by name, yet not one numpy computes in
        why = f"byte order {dt.str!r}: npattn computes in the machine's own byte order"
    if is_dtype_argument:
        advice = f"pass {name + '=' if name.isidentifier() else ''}np.float32 (or np.float64)"
    else:
        advice = f"convert with {name if name.isidentifier() else 'it'}.astype(np.float32) (or np.float64)"
    shown = dt.name if dt.isnative else dt.str
    raise TypeError(f"{name}: {shown} is not supported ({why}); {advice}")


def check_cache_batch(cache_lead, x_shape, name: str, cache: str) -> None:
    """A cached call continues the cached batch of sequences: ``x``'s batch shape (every axis but
    the last two) must be the cache's; ``ValueError`` compares batch shape with batch shape."""
    lead = tuple(x_shape[:-2])
    if lead != tuple(cache_lead):
        raise ValueError(
            f"{name}: expected the batch shape {tuple(cache_lead)} of the {cache}, got the batch shape {lead} "
            f"({name} of shape {tuple(x_shape)}; call reset_kv_cache() to start a new sequence)"
        )


def check_broadcastable(shape, target, name: str, what: str) -> None:
    """``name``'s ``shape`` broadcasts to ``target`` without widening it (``what`` says what
    ``target`` is, e.g. "x's shape without D"); ``ValueError`` otherwise."""
    target = tuple(target)
    try:
        ok = np.broadcast_shapes(tuple(shape), target) == target
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"{name}: expected a shape broadcastable to {target} ({what}), got {tuple(shape)}")


def check_cache(cache, expected: type, backward: str):
    """The cache a backward was given must be the one its own forward returned.  Both tiers name
    their caches alike, so when the two class names coincide (a textbook cache given to a fast
    backward) the message names each with its module."""
    got = type(cache)
    if not isinstance(cache, expected):
        if got.__name__ == expected.__name__:
            want, have = (f"{t.__module__}.{t.__qualname__}" for t in (expected, got))
        else:
            want, have = expected.__name__, got.__name__
        raise TypeError(f"cache: {backward} expected a {want} (the cache its forward returns), got {have}")
    return cache


def check_normalized_shape(normalized_shape, x_shape, name: str = "normalized_shape") -> tuple:
    """An int or a tuple of ints equal to the trailing axes of ``x_shape`` (at least one axis)."""
    shape: tuple[int, ...]
    if isinstance(normalized_shape, numbers.Integral) and not isinstance(normalized_shape, bool):
        shape = (int(normalized_shape),)
    elif isinstance(normalized_shape, (tuple, list)) and all(
        isinstance(s, numbers.Integral) and not isinstance(s, bool) for s in normalized_shape
    ):
        shape = tuple(int(s) for s in normalized_shape)
    else:
        raise TypeError(f"{name}: expected an int or a tuple of ints, got {normalized_shape!r}")
    if len(shape) == 0:
        raise ValueError(f"{name}: expected at least one axis, got {shape}")
    if len(shape) > len(x_shape) or tuple(x_shape[len(x_shape) - len(shape) :]) != shape:
        raise ValueError(f"{name}: expected the trailing axes of x (shape {tuple(x_shape)}), got {shape}")
    return shape

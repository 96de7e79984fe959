"""Element-wise and row-wise nonlinearities: ``relu``, ``relu2``, ``clamp``, ``xielu``, ``gelu``, ``silu``,
``softmax``, ``dropout``.

Each public op validates its arguments and calls the unvalidated kernel ``op_kernel`` below it; each public
backward checks ``dout`` and that the cache is its own forward's, then calls ``op_backward_kernel``.
"""

from __future__ import annotations

import math
import numbers
import textwrap
from typing import NamedTuple, Optional

import numpy as np

from .._docs import (
    FD_CHECK,
    SEVERAL_TANGENTS,
    backward_jvp_sections,
    backward_sections,
    jvp_sections,
    shared_doc,
)
from .._validate import (
    as_float,
    as_rng,
    check_axis,
    check_backward_jvp,
    check_bool,
    check_cache,
    check_grad,
    check_prob,
    check_tangents_as,
)
from ._erf import erf

__all__ = [
    "ReluCache",
    "GeluCache",
    "SiluCache",
    "SoftmaxCache",
    "DropoutCache",
    "relu",
    "relu_backward",
    "relu_jvp",
    "relu_backward_jvp",
    "Relu2Cache",
    "relu2",
    "relu2_backward",
    "relu2_jvp",
    "relu2_backward_jvp",
    "ClampCache",
    "clamp",
    "clamp_backward",
    "clamp_jvp",
    "clamp_backward_jvp",
    "XieluCache",
    "xielu",
    "xielu_backward",
    "xielu_jvp",
    "xielu_backward_jvp",
    "gelu",
    "gelu_backward",
    "gelu_jvp",
    "gelu_backward_jvp",
    "silu",
    "silu_backward",
    "silu_jvp",
    "silu_backward_jvp",
    "softmax",
    "softmax_backward",
    "softmax_jvp",
    "softmax_backward_jvp",
    "dropout",
    "dropout_backward",
    "dropout_jvp",
    "dropout_backward_jvp",
]


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
# |x| beyond which GELU's correction terms are exactly 0 in float32 and float64 (tanh(u) = +-1,
# exp(-x^2/2) = 0); clipping there keeps x^3 and x^2 from overflowing without changing a bit.
_GELU_CLIP = 1e4


class ReluCache(NamedTuple):
    positive: np.ndarray  # the mask x > 0
    dtype: np.dtype


class Relu2Cache(NamedTuple):
    r: np.ndarray  # max(x, 0)


class ClampCache(NamedTuple):
    inside: np.ndarray  # the mask min <= x <= max (bounds included, as torch; False where x is NaN)
    dtype: np.dtype


class XieluCache(NamedTuple):
    x: np.ndarray
    positive: np.ndarray  # x > 0
    e: np.ndarray  # exp(min(x, eps)) where x <= 0 and x < eps (d expm1(min(x, eps)) / dx there), else 0
    q: np.ndarray  # expm1(min(x, eps)) - x where x <= 0 (dy / d a_n), else 0
    alpha_p: np.ndarray  # the raw parameters, as given
    alpha_n: np.ndarray
    a_p: np.ndarray  # softplus(alpha_p)
    a_n: np.ndarray  # beta + softplus(alpha_n)
    beta: float


class GeluCache(NamedTuple):
    x: np.ndarray
    aux: np.ndarray  # Phi(x) for "none", tanh(u) for "tanh"
    approximate: str


class SiluCache(NamedTuple):
    x: np.ndarray
    sig: np.ndarray  # sigmoid(x)


class SoftmaxCache(NamedTuple):
    y: np.ndarray
    axis: Optional[int]  # None for a 0-d input


class DropoutCache(NamedTuple):
    keep: Optional[np.ndarray]  # None: the identity (eval mode or p = 0)
    scale: float
    shape: tuple
    dtype: np.dtype


def _jvp_example(op: str, args: str = "") -> str:
    """An activation's ``op_jvp`` example: ``tout`` against the central difference of ``op`` (called
    with ``args`` after ``x``) along a random tangent."""
    return f"""
    >>> import numpy as np
    >>> from npattn import functional as F
    >>> rng = np.random.default_rng(0)
    >>> x, tx = rng.standard_normal((3, 5)), rng.standard_normal((3, 5))
    >>> out, cache = F.{op}(x{args})
    >>> tout = F.{op}_jvp(cache, tx)
    >>> f = lambda s: F.{op}(x + s * tx{args})[0]
    """ + FD_CHECK.lstrip()


_INPUT_OF = {  # the input's shape and dtype, from each activation's cache
    ReluCache: lambda c: (c.positive.shape, c.dtype),
    Relu2Cache: lambda c: (c.r.shape, c.r.dtype),
    ClampCache: lambda c: (c.inside.shape, c.dtype),
    GeluCache: lambda c: (c.x.shape, c.x.dtype),
    SiluCache: lambda c: (c.x.shape, c.x.dtype),
    SoftmaxCache: lambda c: (c.y.shape, c.y.dtype),
    DropoutCache: lambda c: (c.shape, c.dtype),
}


def _derivatives(op: str, cache_type: type, backward_kernel, jvp: str, backward_jvp: str, second=None, example_args=""):
    """An activation's forward mode and second order, ``(op_jvp, op_jvp_kernel, op_backward_jvp,
    op_backward_jvp_kernel)``, made from its backward kernel ``dx = J^T dy``, which is all they need:

    - the Jacobian is symmetric (diagonal for the element-wise ops, ``diag(y) - y y^T`` for softmax),
      so ``J tx = J^T tx``: the JVP is the backward kernel applied to ``tx``;
    - the backward is linear in ``dy``, so ``ddout`` adds the backward kernel applied to ``ddout``,
      and ``second(dout, cache, tx)`` the part that ``x``'s tangent makes (None: the backward does
      not depend on ``x`` away from a kink; relu and dropout).

    ``jvp`` and ``backward_jvp`` are the derivations that start the two public docstrings; the
    public ops check the cache, the tangents (of the input's shape, cast to its dtype) and ``dout``
    / ``ddout``, then call their kernel.
    """
    shape_and_dtype = _INPUT_OF[cache_type]
    cache_name = cache_type.__name__

    def jvp_kernel(cache, tx=None):
        if tx is None:
            return np.zeros(*shape_and_dtype(cache))
        return backward_kernel(tx, cache)

    def backward_jvp_kernel(dout, cache, tangents=(None,), ddout=None):
        grads = backward_kernel(dout, cache)
        tdx = np.zeros_like(grads) if ddout is None else backward_kernel(ddout, cache)
        if second is not None and tangents[0] is not None:
            tdx += second(dout, cache, tangents[0])
        return grads, tdx

    def jvp_op(cache, *tangents):
        check_cache(cache, cache_type, f"{op}_jvp")
        shape, dtype = shape_and_dtype(cache)
        return jvp_kernel(cache, *check_tangents_as(tangents, f"{op}_jvp", dtype, (("tx", shape),)))

    def backward_jvp_op(dout, cache, tangents, ddout=None):
        name = f"{op}_backward_jvp"
        check_cache(cache, cache_type, name)
        shape, dtype = shape_and_dtype(cache)
        dout, tangents, ddout = check_backward_jvp(dout, tangents, ddout, name, shape, dtype, (("tx", shape),))
        return backward_jvp_kernel(dout, cache, tangents, ddout)

    jvp_op.__doc__ = f"""Forward mode of ``{op}``: {jvp}

    <jvp_sections>

    Examples
    --------
    <jvp_example>
    """
    backward_jvp_op.__doc__ = f"""Second order of ``{op}``: {backward_jvp}

    <backward_jvp_sections>
    """
    jvp_kernel.__doc__ = f"The kernel of ``{op}_jvp`` (``tx`` checked, None = zero)."
    backward_jvp_kernel.__doc__ = f"The kernel of ``{op}_backward_jvp``" + (
        ": ``tx`` does not enter." if second is None else "."
    )
    jvp_op.__annotations__ = {"cache": cache_name, "return": "np.ndarray"}
    backward_jvp_op.__annotations__ = {"dout": "np.ndarray", "cache": cache_name}
    for fn, name in (
        (jvp_op, "jvp"),
        (jvp_kernel, "jvp_kernel"),
        (backward_jvp_op, "backward_jvp"),
        (backward_jvp_kernel, "backward_jvp_kernel"),
    ):
        fn.__name__ = fn.__qualname__ = f"{op}_{name}"
    jvp_op = shared_doc(jvp_sections=jvp_sections(op, cache_name), jvp_example=_jvp_example(op, example_args))(jvp_op)
    backward_jvp_op = shared_doc(backward_jvp_sections=backward_jvp_sections(op, cache_name))(backward_jvp_op)
    return jvp_op, jvp_kernel, backward_jvp_op, backward_jvp_kernel


def _forward_sections(op: str, y: str = "Of ``x``'s shape and dtype.", params: str = "", raises: str = "") -> str:
    """The Parameters, Returns and Raises of an element-wise ``op(x, ...) -> (y, cache)``: ``y``
    describes the output, ``params`` and ``raises`` are the entries of the op's other arguments."""
    text = """
        Parameters
        ----------
        x : array_like
            Any shape; float32 or float64 (integers are cast to float64).
        <params>

        Returns
        -------
        y : ndarray
            <y>
        cache : <cache>
            For ``<op>_backward`` and ``<op>_jvp``.

        Raises
        ------
        TypeError
            ``x`` is not a real numeric array (bool, complex, string, object), or float16/longdouble.
        <raises>
        """
    for name, part in (("params", params), ("raises", raises)):
        lines = textwrap.indent(textwrap.dedent(part).strip("\n"), " " * 8) + "\n" if part else ""
        text = text.replace(f"        <{name}>\n", lines)
    return text.replace("<y>", y).replace("<cache>", f"{op.capitalize()}Cache").replace("<op>", op)


# ----------------------------------------------------------------------------------------- relu


@shared_doc(sections=_forward_sections("relu", y="``max(x, 0)``, of ``x``'s shape and dtype."))
def relu(x: np.ndarray) -> tuple[np.ndarray, ReluCache]:
    """``y = max(x, 0)``.  Returns ``(y, cache)``; the cache keeps the mask ``x > 0``.

    <sections>

    <examples>
    >>> y, cache = F.relu(np.array([-1.0, 0.0, 2.0]))
    >>> y
    array([0., 0., 2.])
    >>> F.relu_backward(np.array([5.0, 5.0, 5.0]), cache)
    array([0., 0., 5.])
    """
    return relu_kernel(as_float(x, "x"))


def relu_kernel(x, out=None, mask_out=None):
    """The kernel of ``relu``; ``out`` (may be ``x`` itself) and ``mask_out`` (bool): optional
    arrays of ``x``'s shape to write ``y`` and the mask into (a module's workspace)."""
    positive = np.greater(x, 0, out=mask_out)  # before ``out`` may overwrite x
    return np.maximum(x, 0, out=out), ReluCache(positive, x.dtype)


@shared_doc(backward_sections=backward_sections("relu", "ReluCache", " ``dL/dy``, of ``y``'s shape."))
def relu_backward(dout: np.ndarray, cache: ReluCache) -> np.ndarray:
    """``dx = dy * [x > 0]`` (0 at x == 0, as torch).

    <backward_sections>
    """
    check_cache(cache, ReluCache, "relu_backward")
    return relu_backward_kernel(check_grad(dout, cache.positive.shape, cache.dtype), cache)


def relu_backward_kernel(dout, cache, out=None):
    """The kernel of ``relu_backward``; ``out`` (may be ``dout`` itself): where to write ``dx``."""
    return np.multiply(dout, cache.positive, out=out)


relu_jvp, relu_jvp_kernel, relu_backward_jvp, relu_backward_jvp_kernel = _derivatives(
    "relu",
    ReluCache,
    relu_backward_kernel,
    jvp="""``ty = tx * [x > 0]`` (the derivative 0 at
    ``x == 0``, as the backward and torch).""",
    backward_jvp="""``dx = dy * [x > 0]`` is linear in ``dy`` and its mask is
    piecewise constant in ``x`` (its derivative is 0 away from ``x = 0``, as torch's), so
    ``tdx = ddout * [x > 0]`` whatever ``tx`` is.""",
)


# ---------------------------------------------------------------------------------------- relu2


@shared_doc(sections=_forward_sections("relu2", y="``max(x, 0)^2``, of ``x``'s shape and dtype."))
def relu2(x: np.ndarray) -> tuple[np.ndarray, Relu2Cache]:
    """Squared ReLU: ``y = max(x, 0)^2`` (Hugging Face's ``"relu2"``, ``ReLUSquaredActivation``;
    Nemotron-H's MLPs).  Returns ``(y, cache)``; the cache keeps ``r = max(x, 0)``.

    <sections>

    <examples>
    >>> y, cache = F.relu2(np.array([-1.0, 0.0, 3.0]))
    >>> y
    array([0., 0., 9.])
    >>> F.relu2_backward(np.array([1.0, 1.0, 1.0]), cache)
    array([0., 0., 6.])
    """
    return relu2_kernel(as_float(x, "x"))


def relu2_kernel(x):
    """The kernel of ``relu2``."""
    r = np.maximum(x, 0)
    return r * r, Relu2Cache(r)


@shared_doc(backward_sections=backward_sections("relu2", "Relu2Cache", " ``dL/dy``, of ``y``'s shape."))
def relu2_backward(dout: np.ndarray, cache: Relu2Cache) -> np.ndarray:
    """``dy/dx = 2 max(x, 0)`` (0 at and below 0: the derivative is continuous there), so
    ``dx = 2 r dy`` with ``r = max(x, 0)``.

    <backward_sections>
    """
    check_cache(cache, Relu2Cache, "relu2_backward")
    return relu2_backward_kernel(check_grad(dout, cache.r.shape, cache.r.dtype), cache)


def relu2_backward_kernel(dout, cache):
    """The kernel of ``relu2_backward``."""
    return dout * (2 * cache.r)


relu2_jvp, relu2_jvp_kernel, relu2_backward_jvp, relu2_backward_jvp_kernel = _derivatives(
    "relu2",
    Relu2Cache,
    relu2_backward_kernel,
    jvp="""``ty = 2 max(x, 0) * tx``.""",
    backward_jvp="""``dx = 2 max(x, 0) dy``, so ``tdx = 2 max(x, 0) ddout +
    2 [x > 0] dy tx`` (``relu2'' = 2 [x > 0]``, 0 at ``x = 0`` as relu's derivative there).""",
    second=lambda dout, cache, tx: 2 * dout * (cache.r > 0) * tx,
)


# ---------------------------------------------------------------------------------------- clamp


def _clamp_bound(v, name: str) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or math.isnan(v):
        raise ValueError(f"{name}: expected a real number or None, got {v!r}")
    return float(v)


def clamp_inside(x, lo=None, hi=None) -> np.ndarray:
    """The mask ``lo <= x <= hi`` (bounds included; a bound None is no bound): where ``clamp``
    passes ``x`` through, so where its gradient is 1 (False where ``x`` is NaN, as torch)."""
    if lo is None:
        return np.less_equal(x, hi)
    inside = np.greater_equal(x, lo)
    return inside if hi is None else np.logical_and(inside, np.less_equal(x, hi), out=inside)


@shared_doc(
    sections=_forward_sections(
        "clamp",
        y="``min(max(x, min), max)``, of ``x``'s shape and dtype.",
        params="""
        min, max : float or None
            The bounds (None: no bound on that side; at least one given, ``min <= max``).
        """,
        raises="ValueError\n    A bound not a real number (NaN) or None; both None; ``min > max``.",
    )
)
def clamp(x: np.ndarray, min: float | None = None, max: float | None = None) -> tuple[np.ndarray, ClampCache]:
    """``y = min(max(x, min), max)``, torch's ``clamp`` (OLMo's ``clip_qkv`` on q, k and v).
    Returns ``(y, cache)``; the cache keeps the mask ``min <= x <= max``.

    The gradient is torch's: 1 where ``min <= x <= max`` (the bounds included), 0 outside, where
    ``y`` is a constant.

    <sections>

    <examples>
    >>> y, cache = F.clamp(np.array([-3.0, -1.0, 0.5, 1.0, 2.0]), -1.0, 1.0)
    >>> y
    array([-1. , -1. ,  0.5,  1. ,  1. ])
    >>> F.clamp_backward(np.full(5, 7.0), cache)
    array([0., 7., 7., 7., 0.])
    """
    lo, hi = _clamp_bound(min, "min"), _clamp_bound(max, "max")
    if lo is None and hi is None:
        raise ValueError("clamp: expected at least one of min and max, got both None")
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"clamp: expected min <= max, got min={lo!r} > max={hi!r}")
    return clamp_kernel(as_float(x, "x"), lo, hi)


def clamp_kernel(x, min=None, max=None, out=None):
    """The kernel of ``clamp`` (bounds checked: floats or None, ``min <= max``); ``out`` (may be
    ``x`` itself): an array of ``x``'s shape to write ``y`` into."""
    inside = clamp_inside(x, min, max)  # before ``out`` may overwrite x
    return np.clip(x, min, max, out=out), ClampCache(inside, x.dtype)


@shared_doc(backward_sections=backward_sections("clamp", "ClampCache", " ``dL/dy``, of ``y``'s shape."))
def clamp_backward(dout: np.ndarray, cache: ClampCache) -> np.ndarray:
    """``dx = dy * [min <= x <= max]``: 1 inside the bounds, the bounds included (as torch), 0
    outside, where ``y`` is a constant.

    <backward_sections>
    """
    check_cache(cache, ClampCache, "clamp_backward")
    return clamp_backward_kernel(check_grad(dout, cache.inside.shape, cache.dtype), cache)


def clamp_backward_kernel(dout, cache, out=None):
    """The kernel of ``clamp_backward``; ``out`` (may be ``dout`` itself): where to write ``dx``."""
    return np.multiply(dout, cache.inside, out=out)


clamp_jvp, clamp_jvp_kernel, clamp_backward_jvp, clamp_backward_jvp_kernel = _derivatives(
    "clamp",
    ClampCache,
    clamp_backward_kernel,
    jvp="""``ty = tx * [min <= x <= max]`` (the bounds included, as
    the backward and torch).""",
    backward_jvp="""``dx = dy * [min <= x <= max]`` is linear in ``dy``
    and its mask is piecewise constant in ``x`` (its derivative is 0 away from the bounds, as
    torch's), so ``tdx = ddout * [min <= x <= max]`` whatever ``tx`` is.""",
    example_args=", -0.5, 0.5",
)


# ---------------------------------------------------------------------------------------- xielu


def _softplus(a):
    """``log(1 + exp(a))`` without overflow."""
    return np.logaddexp(0, a)


def _sigmoid(a):
    """``1 / (1 + exp(-a))`` (softplus' derivative) without overflow."""
    return np.exp(-np.logaddexp(0, -a))


def _xielu_scalar(v, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
        raise ValueError(f"{name}: expected a finite real number, got {v!r}")
    return float(v)


def _xielu_parameter(a, name: str, dtype) -> np.ndarray:
    a = as_float(a, name, dtype)
    if a.size != 1:
        raise ValueError(f"{name}: expected one number (shape () or (1,)), got shape {a.shape}")
    return a


_XIELU_PARAMS = """
        alpha_p, alpha_n : array_like
            One number each (shape ``()`` or ``(1,)``, as transformers' ``XIELUActivation`` keeps
            them): the raw trained parameters, ``a_p = softplus(alpha_p)`` and ``a_n = beta +
            softplus(alpha_n)``; cast to ``x``'s dtype.
        beta : float
            The linear term's slope (a buffer in transformers: not trained), default 0.5.
        eps : float
            Where the negative branch's ``expm1`` stops following ``x`` (``min(x, eps)``), default -1e-6.
"""


@shared_doc(
    sections=_forward_sections(
        "xielu",
        y="Of ``x``'s shape and dtype.",
        params=_XIELU_PARAMS,
        raises="ValueError\n    ``alpha_p`` or ``alpha_n`` not of one number; ``beta`` or ``eps`` not a finite number.",
    )
)
def xielu(x: np.ndarray, alpha_p, alpha_n, beta: float = 0.5, eps: float = -1e-6) -> tuple[np.ndarray, XieluCache]:
    """xIELU (Huang and Schlag, arXiv:2411.13010; Hugging Face's ``"xielu"``, Apertus's MLP
    activation): with ``a_p = softplus(alpha_p)`` and ``a_n = beta + softplus(alpha_n)``::

        y = a_p x^2 + beta x                           where x > 0
        y = a_n (expm1(min(x, eps)) - x) + beta x      where x <= 0

    Returns ``(y, cache)``; ``xielu_backward`` gives ``(dx, dalpha_p, dalpha_n)``.  The derivation:
    ``functional.reference.xielu``.

    <sections>

    <examples>
    >>> alpha_p, alpha_n = np.log(np.expm1(0.8)), np.log(np.expm1(0.3))  # a_p = 0.8, a_n = 0.5 + 0.3
    >>> y, cache = F.xielu(np.array([-1.0, 0.5, 2.0]), alpha_p, alpha_n)
    >>> np.round(y, 6)
    array([-0.205696,  0.45    ,  4.2     ])
    >>> dx, dalpha_p, dalpha_n = F.xielu_backward(np.ones(3), cache)
    >>> np.round(dx, 6)
    array([-0.005696,  1.3     ,  3.7     ])
    """
    x = as_float(x, "x")
    ap, an = _xielu_parameter(alpha_p, "alpha_p", x.dtype), _xielu_parameter(alpha_n, "alpha_n", x.dtype)
    return xielu_kernel(x, ap, an, _xielu_scalar(beta, "beta"), _xielu_scalar(eps, "eps"))


def xielu_kernel(x, alpha_p, alpha_n, beta=0.5, eps=-1e-6):
    """The kernel of ``xielu``."""
    a_p = _softplus(alpha_p).reshape(())
    a_n = (beta + _softplus(alpha_n)).reshape(())
    positive = x > 0
    m = np.minimum(x, eps)
    q = np.where(positive, 0, np.expm1(m) - x)
    e = np.where(~positive & (x < eps), np.exp(m), 0).astype(x.dtype, copy=False)
    y = np.where(positive, a_p * x * x, a_n * q) + beta * x
    return y.astype(x.dtype, copy=False), XieluCache(
        x, positive, e, q.astype(x.dtype, copy=False), alpha_p, alpha_n, a_p, a_n, beta
    )


def _xielu_slope(cache):
    """``dy/dx``: ``2 a_p x + beta`` where ``x > 0``, ``a_n (e - 1) + beta`` where not."""
    return np.where(cache.positive, 2 * cache.a_p * cache.x, cache.a_n * (cache.e - 1)) + cache.beta


def _xielu_sums(w, cache):
    """``(sum(w [x > 0] x^2) sigmoid(alpha_p), sum(w q) sigmoid(alpha_n))``, each of its parameter's
    shape: the parameters' gradients for the upstream ``w``."""
    sp, sn = _sigmoid(cache.alpha_p), _sigmoid(cache.alpha_n)
    gp = np.sum(w * np.where(cache.positive, cache.x * cache.x, 0)) * sp
    gn = np.sum(w * cache.q) * sn
    return gp.reshape(cache.alpha_p.shape), gn.reshape(cache.alpha_n.shape)


@shared_doc(
    backward_sections=backward_sections("xielu", "XieluCache")
    .replace("-------\nndarray\n", "-------\ntuple of ndarray\n")
    .replace(
        "``dx``, of ``x``'s shape and dtype.",
        "``(dx, dalpha_p, dalpha_n)``: ``dx`` of ``x``'s shape and dtype, the parameters' gradients of their shapes.",
    )
)
def xielu_backward(dout: np.ndarray, cache: XieluCache) -> tuple:
    """``dx = dy (2 a_p x + beta)`` where ``x > 0``, ``dy (a_n (exp(min(x, eps)) [x < eps] - 1) +
    beta)`` where not; ``dalpha_p = sum(dy x^2 [x > 0]) sigmoid(alpha_p)`` and ``dalpha_n =
    sum(dy (expm1(min(x, eps)) - x) [x <= 0]) sigmoid(alpha_n)`` (softplus' derivative is the sigmoid).

    <backward_sections>
    """
    check_cache(cache, XieluCache, "xielu_backward")
    return xielu_backward_kernel(check_grad(dout, cache.x.shape, cache.x.dtype), cache)


def xielu_backward_kernel(dout, cache):
    """The kernel of ``xielu_backward``."""
    return (dout * _xielu_slope(cache), *_xielu_sums(dout, cache))


def _xielu_specs(cache) -> tuple:
    return (("tx", cache.x.shape), ("talpha_p", cache.alpha_p.shape), ("talpha_n", cache.alpha_n.shape))


@shared_doc(
    jvp_sections=jvp_sections(
        "xielu",
        "XieluCache",
        tangents="``(tx, talpha_p, talpha_n)``, each of its input's shape (None: zero).",
        most="three tangents",
    ),
    jvp_example=_jvp_example("xielu", ", 0.3, -0.2"),
)
def xielu_jvp(cache: XieluCache, *tangents) -> np.ndarray:
    """Forward mode of ``xielu``: ``ty = (dy/dx) tx + [x > 0] x^2 sigmoid(alpha_p) talpha_p +
    q sigmoid(alpha_n) talpha_n`` with ``q = (expm1(min(x, eps)) - x) [x <= 0]``.

    <jvp_sections>

    Examples
    --------
    <jvp_example>
    """
    check_cache(cache, XieluCache, "xielu_jvp")
    return xielu_jvp_kernel(cache, *check_tangents_as(tangents, "xielu_jvp", cache.x.dtype, _xielu_specs(cache)))


def xielu_jvp_kernel(cache, tx=None, talpha_p=None, talpha_n=None):
    """The kernel of ``xielu_jvp`` (tangents checked, None = zero)."""
    ty = np.zeros_like(cache.x) if tx is None else _xielu_slope(cache) * tx
    if talpha_p is not None:
        ty = ty + np.where(cache.positive, cache.x * cache.x, 0) * (_sigmoid(cache.alpha_p) * talpha_p).reshape(())
    if talpha_n is not None:
        ty = ty + cache.q * (_sigmoid(cache.alpha_n) * talpha_n).reshape(())
    return ty


@shared_doc(
    backward_jvp_sections=backward_jvp_sections(
        "xielu",
        "XieluCache",
        tangents="``(tx, talpha_p, talpha_n)`` as ``xielu_jvp`` takes them; None (or left out at the end): zero.",
        grads="``(dx, dalpha_p, dalpha_n)``",
        grad_tangents="Their tangents, of the same shapes.",
        **SEVERAL_TANGENTS,
    )
)
def xielu_backward_jvp(dout: np.ndarray, cache: XieluCache, tangents, ddout=None):
    """Second order of ``xielu``: the tangents of ``(dx, dalpha_p, dalpha_n)`` when ``x``,
    ``alpha_p``, ``alpha_n`` move along ``(tx, talpha_p, talpha_n)`` and ``dy`` along ``ddy``.
    With ``s_p = sigmoid(alpha_p)``, ``s_n = sigmoid(alpha_n)`` (``s' = s (1 - s)``), ``P = [x > 0]``,
    ``N = [x <= 0]``, ``e = exp(min(x, eps)) [x < eps] N`` and ``q = (expm1(min(x, eps)) - x) N``::

        tdx       = ddy (dy/dx) + dy (P (2 a_p tx + 2 x s_p talpha_p) + N (a_n e tx + (e - 1) s_n talpha_n))
        tdalpha_p = s_p sum(ddy P x^2 + 2 dy P x tx) + s_p (1 - s_p) talpha_p sum(dy P x^2)
        tdalpha_n = s_n sum(ddy q + dy (e - 1) N tx) + s_n (1 - s_n) talpha_n sum(dy q)

    <backward_jvp_sections>
    """
    check_cache(cache, XieluCache, "xielu_backward_jvp")
    dout, tangents, ddout = check_backward_jvp(
        dout, tangents, ddout, "xielu_backward_jvp", cache.x.shape, cache.x.dtype, _xielu_specs(cache)
    )
    return xielu_backward_jvp_kernel(dout, cache, tangents, ddout)


def xielu_backward_jvp_kernel(dout, cache, tangents=(None, None, None), ddout=None):
    """The kernel of ``xielu_backward_jvp`` (``tangents`` the checked ``(tx, talpha_p, talpha_n)``)."""
    tx, tap, tan = (tuple(tangents) + (None, None, None))[:3]
    grads = xielu_backward_kernel(dout, cache)
    x, pos, e = cache.x, cache.positive, cache.e
    sp, sn = _sigmoid(cache.alpha_p), _sigmoid(cache.alpha_n)
    if ddout is None:
        tdx = np.zeros_like(grads[0])
        tdap, tdan = np.zeros_like(grads[1]), np.zeros_like(grads[2])
    else:
        tdx = ddout * _xielu_slope(cache)
        tdap, tdan = _xielu_sums(ddout, cache)
    if tx is not None:  # the slope's own derivative: 2 a_p where x > 0, a_n e where not
        tdx = tdx + dout * np.where(pos, 2 * cache.a_p, cache.a_n * e) * tx
        tdap = tdap + (2 * np.sum(dout * np.where(pos, x, 0) * tx) * sp).reshape(tdap.shape)
        tdan = tdan + (np.sum(dout * np.where(pos, 0, e - 1) * tx) * sn).reshape(tdan.shape)
    if tap is not None:
        tdx = tdx + dout * np.where(pos, 2 * x, 0) * (sp * tap).reshape(())
        tdap = tdap + np.sum(dout * np.where(pos, x * x, 0)) * sp * (1 - sp) * tap
    if tan is not None:
        tdx = tdx + dout * np.where(pos, 0, e - 1) * (sn * tan).reshape(())
        tdan = tdan + np.sum(dout * cache.q) * sn * (1 - sn) * tan
    return grads, (tdx, tdap, tdan)


# ----------------------------------------------------------------------------------------- gelu


@shared_doc(
    sections=_forward_sections(
        "gelu",
        params="""
            approximate : {"none", "tanh"}
                The exact erf form or torch's tanh approximation.
            """,
        raises="""
            ValueError
                ``approximate`` is neither ``"none"`` nor ``"tanh"``.
            """,
    )
)
def gelu(x: np.ndarray, approximate: str = "none") -> tuple[np.ndarray, GeluCache]:
    """GELU.  ``"none"``: ``y = x Phi(x)`` with ``Phi(x) = (1 + erf(x / sqrt 2)) / 2``.
    ``"tanh"``: ``y = x/2 (1 + tanh(u))``, ``u = sqrt(2/pi) (x + 0.044715 x^3)`` (as torch).

    <sections>

    <examples>
    >>> y, cache = F.gelu(np.array([-1.0, 0.0, 1.0]))
    >>> np.round(y, 4)
    array([-0.1587,  0.    ,  0.8413])
    >>> np.round(F.gelu_backward(np.ones(3), cache), 4)
    array([-0.0833,  0.5   ,  1.0833])
    """
    x = as_float(x, "x")
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate: expected 'none' or 'tanh', got {approximate!r}")
    return gelu_kernel(x, approximate)


def gelu_kernel(x, approximate="none"):
    if approximate == "none":
        cdf = 0.5 * (1.0 + erf(x * _INV_SQRT_2))
        return x * cdf, GeluCache(x, cdf, approximate)
    xc = np.clip(x, -_GELU_CLIP, _GELU_CLIP)  # x**3 would overflow (RuntimeWarning) for huge |x|
    t = np.tanh(_SQRT_2_OVER_PI * (xc + 0.044715 * xc**3))
    return 0.5 * x * (1.0 + t), GeluCache(x, t, approximate)


@shared_doc(backward_sections=backward_sections("gelu", "GeluCache"))
def gelu_backward(dout: np.ndarray, cache: GeluCache) -> np.ndarray:
    """``"none"``: ``dy/dx = Phi(x) + x phi(x)``, ``phi(x) = exp(-x^2/2) / sqrt(2 pi)``.
    ``"tanh"``: ``dy/dx = (1 + t)/2 + x/2 (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)``, ``t = tanh(u)``.

    <backward_sections>
    """
    check_cache(cache, GeluCache, "gelu_backward")
    return gelu_backward_kernel(check_grad(dout, cache.x.shape, cache.x.dtype), cache)


def gelu_backward_kernel(dout, cache):
    x, aux, approximate = cache
    xc = np.clip(x, -_GELU_CLIP, _GELU_CLIP)  # identical below the clip; no inf * 0 above it
    if approximate == "none":
        return dout * (aux + xc * (_INV_SQRT_2PI * np.exp(-0.5 * xc * xc)))
    t = aux
    du = _SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * xc * xc)
    return dout * (0.5 * (1.0 + t) + 0.5 * xc * (1.0 - t * t) * du)


def _gelu_second(cache):
    """``gelu''(x)`` (derived in ``gelu_backward_jvp``), clipped as the backward is."""
    x, aux, approximate = cache
    xc = np.clip(x, -_GELU_CLIP, _GELU_CLIP)
    if approximate == "none":
        return _INV_SQRT_2PI * np.exp(-0.5 * xc * xc) * (2.0 - xc * xc)
    t = aux
    du = _SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * xc * xc)
    return (1.0 - t * t) * (du - xc * t * du * du + 3.0 * _SQRT_2_OVER_PI * 0.044715 * xc * xc)


gelu_jvp, gelu_jvp_kernel, gelu_backward_jvp, gelu_backward_jvp_kernel = _derivatives(
    "gelu",
    GeluCache,
    gelu_backward_kernel,
    jvp="""``ty = gelu'(x) * tx`` (both forms; the
    derivative as derived in ``gelu_backward``).""",
    backward_jvp="""``dx = dy * gelu'(x)``, so ``tdx = ddout * gelu'(x) + dy *
    gelu''(x) * tx``, with

    - ``"none"``: ``gelu' = Phi + x phi`` and ``phi' = -x phi``, so ``gelu'' = 2 phi - x^2 phi =
      phi(x) (2 - x^2)``;
    - ``"tanh"``: ``gelu' = (1 + t)/2 + x/2 (1 - t^2) u'`` with ``t = tanh(u)``, ``t' = (1 - t^2) u'``,
      ``u' = sqrt(2/pi) (1 + 3 * 0.044715 x^2)``, ``u'' = 6 sqrt(2/pi) 0.044715 x``, so
      ``gelu'' = (1 - t^2) (u' - x t u'^2 + x u'' / 2)``.""",
    second=lambda dout, cache, tx: dout * _gelu_second(cache) * tx,
)


# ----------------------------------------------------------------------------------------- silu


@shared_doc(sections=_forward_sections("silu"))
def silu(x: np.ndarray) -> tuple[np.ndarray, SiluCache]:
    """SiLU (swish): ``y = x * sigmoid(x)``, ``sigmoid(x) = 1 / (1 + exp(-x))`` (as torch's ``F.silu``).

    The sigmoid is evaluated without overflow for any finite x: with ``e = exp(-|x|)`` (<= 1),
    ``sigmoid(x) = 1 / (1 + e)`` for x >= 0 and ``e / (1 + e)`` for x < 0.
    Returns ``(y, cache)``; the cache keeps ``x`` and ``sigmoid(x)``.

    <sections>

    <examples>
    >>> y, cache = F.silu(np.array([-2.0, 0.0, 2.0]))
    >>> np.round(y, 4)
    array([-0.2384,  0.    ,  1.7616])
    >>> np.round(F.silu_backward(np.ones(3), cache), 4)
    array([-0.0908,  0.5   ,  1.0908])
    """
    return silu_kernel(as_float(x, "x"))


def sigmoid(z: np.ndarray) -> np.ndarray:
    """``1 / (1 + exp(-z))`` without overflow, a new array of ``z``'s dtype: with ``e = exp(-|z|)``
    (<= 1), ``1 / (1 + e)`` for z >= 0 and ``e / (1 + e)`` for z < 0.  The numerator is
    ``max(e, z >= 0)`` (1 where z >= 0 since e <= 1; e elsewhere; NaN stays NaN): a SIMD maximum,
    where ``np.where`` on the sign would take most of the time."""
    return _sigmoid_into(z, np.empty(z.shape, z.dtype), np.empty(z.shape, z.dtype), np.empty(z.shape, bool))


def _sigmoid_into(z, e, num, sign):
    """``sigmoid(z)`` written into ``num``, with ``e`` (``z``'s dtype) and ``sign`` (bool) as
    scratch of ``z``'s shape; returns ``num``."""
    np.exp(np.negative(np.abs(z, out=e), out=e), out=e)
    np.maximum(e, np.greater_equal(z, 0, out=sign), out=num)
    e += 1.0
    return np.divide(num, e, out=num)


SILU_BLOCK = 1 << 15  # elements of one block of rows in silu_mul_ (128 KB in float32: stays in L2)


def silu_mul_(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a = silu(a) * b`` in place (SwiGLU's ``act(gate) * up`` of a call that keeps nothing), with
    the kept path's roundings (``a * sigmoid(a)``, then times ``b``), a block of about
    ``SILU_BLOCK`` elements at a time: the sigmoid's four passes and the two products run over a
    block that stays in the cache, not over the whole ``(..., d_ff)`` arrays (a 512-token prompt's
    are 6 MB each).  ``a`` and ``b``: arrays of one shape and float dtype whose rows (last axis)
    are contiguous, ``a`` writable; returns ``a``."""
    if a.ndim < 2:
        return silu_mul_(a[None], b[None])[0]
    width = a.shape[-1]
    rows = max(1, SILU_BLOCK // max(width, 1))
    e, num, sign = np.empty((rows, width), a.dtype), np.empty((rows, width), a.dtype), np.empty((rows, width), bool)
    for lead in np.ndindex(a.shape[:-2]):  # each (L, width) matrix, its rows a block at a time
        a2, b2 = a[lead], b[lead]
        for i in range(0, a2.shape[0], rows):
            k = min(rows, a2.shape[0] - i)
            ai = a2[i : i + k]
            np.multiply(ai, _sigmoid_into(ai, e[:k], num[:k], sign[:k]), out=ai)
            ai *= b2[i : i + k]
    return a


def silu_kernel(x):
    sig = sigmoid(x)
    return x * sig, SiluCache(x, sig)


@shared_doc(backward_sections=backward_sections("silu", "SiluCache"))
def silu_backward(dout: np.ndarray, cache: SiluCache) -> np.ndarray:
    """With ``s = sigmoid(x)``, ``ds/dx = s (1 - s)``; so ``dy/dx = s + x s (1 - s) = s (1 + x (1 - s))``
    and ``dx = dy * s * (1 + x * (1 - s))``.

    <backward_sections>
    """
    check_cache(cache, SiluCache, "silu_backward")
    return silu_backward_kernel(check_grad(dout, cache.x.shape, cache.x.dtype), cache)


def silu_backward_kernel(dout, cache):
    x, s = cache
    return dout * (s * (1.0 + x * (1.0 - s)))


def _silu_second(dout, cache, tx):
    """``dy * silu''(x) * tx`` (``silu''`` derived in ``silu_backward_jvp``)."""
    x, s = cache
    return dout * (s * (1.0 - s) * (2.0 + x * (1.0 - 2.0 * s))) * tx


silu_jvp, silu_jvp_kernel, silu_backward_jvp, silu_backward_jvp_kernel = _derivatives(
    "silu",
    SiluCache,
    silu_backward_kernel,
    jvp="""``ty = s (1 + x (1 - s)) * tx`` with
    ``s = sigmoid(x)`` (derived in ``silu_backward``).""",
    backward_jvp="""``dx = dy * silu'(x)``, ``silu' = s (1 + x (1 - s))`` with
    ``s = sigmoid(x)``, ``s' = s (1 - s)``, so ``silu'' = s (1 - s) (1 + x (1 - s)) + s ((1 - s) -
    x s (1 - s)) = s (1 - s) (2 + x (1 - 2 s))`` and ``tdx = ddout * silu'(x) + dy * silu''(x) * tx``.""",
    second=_silu_second,
)


# -------------------------------------------------------------------------------------- softmax


@shared_doc()
def softmax(x: np.ndarray, axis: int = -1) -> tuple[np.ndarray, SoftmaxCache]:
    """``y = exp(x - max) / sum(exp(x - max))`` along ``axis``: stable for any finite input.

    A slice that is entirely ``-inf`` (every position masked) gives zeros, not NaN.  A 0-d input is
    a softmax over one value: ``y = 1`` and ``dx = 0`` (as torch; ``axis`` must be 0 or -1).
    Returns ``(y, cache)``; the cache is ``(y, axis)`` (axis None for a 0-d input).

    Parameters
    ----------
    x : array_like
        Any shape; float32 or float64 (integers are cast to float64); ``-inf`` entries allowed.
    axis : int
        The axis to normalise over (negative counts from the end).

    Returns
    -------
    y : ndarray
        Of ``x``'s shape and dtype; each slice along ``axis`` sums to 1 (or is all 0 when the slice
        is all ``-inf``).
    cache : SoftmaxCache
        For ``softmax_backward`` and ``softmax_jvp``.

    Raises
    ------
    TypeError
        ``x`` is not a real numeric array, or ``axis`` is not an integer.
    ValueError
        ``axis`` out of range for ``x``.

    <examples>
    >>> y, cache = F.softmax(np.array([[1.0, 2.0, 3.0], [0.0, 0.0, -np.inf]]))
    >>> np.round(y, 4)
    array([[0.09  , 0.2447, 0.6652],
           [0.5   , 0.5   , 0.    ]])
    >>> dx = F.softmax_backward(np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]), cache)
    >>> np.round(dx.sum(axis=-1), 12)   # the gradient of a normalised output sums to zero
    array([0., 0.])
    """
    x = as_float(x, "x")
    if x.ndim == 0:
        if isinstance(axis, bool) or not isinstance(axis, numbers.Integral):
            raise TypeError(f"axis: expected an integer, got {axis!r} ({type(axis).__name__})")
        if axis not in (0, -1):
            raise ValueError(f"axis: expected 0 or -1 for a 0-d input (a softmax over its one value), got {axis}")
        return softmax_kernel(x, None)
    return softmax_kernel(x, check_axis(axis, x.ndim))


def softmax_kernel(x, axis=-1):
    if x.ndim == 0:  # one value: its softmax is 1 (exp(x - x) / exp(x - x))
        y = np.ones((), dtype=x.dtype)
        return y, SoftmaxCache(y, None)
    m = x.max(axis=axis, keepdims=True, initial=-np.inf)  # empty axis allowed
    m[~np.isfinite(m)] = 0.0  # all -inf slice: exp(-inf) = 0 below
    y = np.exp(x - m)
    s = y.sum(axis=axis, keepdims=True)
    s[s == 0] = 1.0
    y /= s
    return y, SoftmaxCache(y, axis)


@shared_doc(backward_sections=backward_sections("softmax", "SoftmaxCache"))
def softmax_backward(dout: np.ndarray, cache: SoftmaxCache) -> np.ndarray:
    """Jacobian ``dy_i/dx_j = y_i (delta_ij - y_j)``, so ``dx = y * (dy - sum(dy * y))``.

    <backward_sections>
    """
    check_cache(cache, SoftmaxCache, "softmax_backward")
    return softmax_backward_kernel(check_grad(dout, cache.y.shape, cache.y.dtype), cache)


def softmax_backward_kernel(dout, cache):
    y, axis = cache
    return y * (dout - (dout * y).sum(axis=axis, keepdims=True))  # axis None (0-d): dy - dy = 0


def _softmax_second(dout, cache, tx):
    """The part of softmax's ``tdx`` that ``tx`` makes: ``ty * (g - <g, y>) - y <g, ty>`` (derived in
    ``softmax_backward_jvp``)."""
    y, axis = cache
    ty = softmax_backward_kernel(tx, cache)  # softmax_jvp: J is symmetric
    return ty * (dout - (dout * y).sum(axis=axis, keepdims=True)) - y * (dout * ty).sum(axis=axis, keepdims=True)


softmax_jvp, softmax_jvp_kernel, softmax_backward_jvp, softmax_backward_jvp_kernel = _derivatives(
    "softmax",
    SoftmaxCache,
    softmax_backward_kernel,
    jvp="""with ``dy_i/dx_j = y_i (delta_ij - y_j)``,
    ``ty = y * (tx - sum(y * tx))`` along the axis (the Jacobian is symmetric, so this is also
    the backward's formula).  A slice of all ``-inf`` has ``y = 0``, hence ``ty = 0``; a 0-d input
    gives 0.""",
    backward_jvp="""the backward ``dx = y * (g - <g, y>)`` (``g = dout``, ``<.,.>``
    the sum along the axis) is a product of ``y`` and ``g``; with ``ty = y * (tx - <y, tx>)``
    (``softmax_jvp``) and ``tg = ddout`` the product rule gives

        tdx = ty * (g - <g, y>) + y * (tg - <tg, y> - <g, ty>),

    i.e. ``softmax_backward(ddout)`` plus ``ty * (g - <g, y>) - y <g, ty>``.  A slice of all
    ``-inf`` (``y = 0``) and a 0-d input give 0.""",
    second=_softmax_second,
)


# -------------------------------------------------------------------------------------- dropout


@shared_doc()
def dropout(x: np.ndarray, p: float, rng=None, training: bool = True) -> tuple[np.ndarray, DropoutCache]:
    """Inverted dropout: keep each entry with probability ``1 - p`` and scale it by ``1/(1 - p)``.

    The keep-mask is ``rng.random(x.shape) >= p`` (float64 draws whatever the dtype, so a seed
    gives the same mask in float32 and float64).  ``p = 1`` gives zeros; ``training=False`` or
    ``p = 0`` is the identity (no random numbers drawn).  ``rng``: Generator, int seed or None.
    Returns ``(y, cache)``; the cache is ``(keep_mask or None, scale, shape, dtype)``.

    Parameters
    ----------
    x : array_like
        Any shape; float32 or float64 (integers are cast to float64).
    p : float
        The probability of zeroing an entry, in ``[0, 1]``.
    rng : numpy.random.Generator, int or None
        Where the keep-mask comes from (an int seed is ``np.random.default_rng(seed)``).
    training : bool
        False: the identity.

    Returns
    -------
    y : ndarray
        Of ``x``'s shape and dtype.
    cache : DropoutCache
        For ``dropout_backward`` and ``dropout_jvp`` (the same mask).

    Raises
    ------
    TypeError
        ``x`` not a real numeric array, ``training`` not a bool, ``rng`` not a Generator/int/None.
    ValueError
        ``p`` outside ``[0, 1]`` or NaN.

    <examples>
    >>> y, cache = F.dropout(np.ones((2, 4)), 0.5, rng=0)
    >>> sorted(set(y.ravel().tolist()))          # dropped, or kept and scaled by 1/(1 - p)
    [0.0, 2.0]
    >>> dx = F.dropout_backward(np.ones((2, 4)), cache)
    >>> bool(np.array_equal(dx, y))              # the same mask and scale
    True
    """
    x = as_float(x, "x")
    p = check_prob(p, "p")
    training = check_bool(training, "training")
    if not training or p == 0.0:
        as_rng(rng)  # still validate the argument
        return dropout_kernel(x, p, None, False)
    return dropout_kernel(x, p, as_rng(rng), training)


def dropout_kernel(x, p, rng=None, training=True):
    """Kernel: ``rng`` must be a Generator unless the call is the identity."""
    if not training or p == 0.0:
        return x.copy(), DropoutCache(None, 1.0, x.shape, x.dtype)
    if p == 1.0:
        return np.zeros_like(x), DropoutCache(np.zeros(x.shape, dtype=bool), 0.0, x.shape, x.dtype)
    keep = rng.random(x.shape) >= p
    scale = 1.0 / (1.0 - p)
    return x * keep * scale, DropoutCache(keep, scale, x.shape, x.dtype)


@shared_doc(backward_sections=backward_sections("dropout", "DropoutCache"))
def dropout_backward(dout: np.ndarray, cache: DropoutCache) -> np.ndarray:
    """The forward is ``y = x * keep * s``, linear in x: ``dx = dy * keep * s`` (same mask).

    <backward_sections>
    """
    check_cache(cache, DropoutCache, "dropout_backward")
    return dropout_backward_kernel(check_grad(dout, cache.shape, cache.dtype), cache)


def dropout_backward_kernel(dout, cache):
    if cache.keep is None:
        return dout.copy()
    return dout * cache.keep * cache.scale


dropout_jvp, dropout_jvp_kernel, dropout_backward_jvp, dropout_backward_jvp_kernel = _derivatives(
    "dropout",
    DropoutCache,
    dropout_backward_kernel,
    jvp="""``y = x * keep * s`` is linear in ``x``, so
    ``ty = tx * keep * s`` with the forward's own mask (the identity in eval mode or with ``p = 0``).""",
    backward_jvp="""``dx = dy * keep * s`` is linear in ``dy`` and does not read
    ``x``, so ``tdx = ddout * keep * s`` (the forward's own mask) whatever ``tx`` is.""",
    example_args=", 0.5, rng=1",
)

"""Basic layers: ``Linear``, ``LayerNorm``, ``RMSNorm``, ``Dropout``, ``Embedding``, ``FeedForward``.

Each is thin: it holds ``Parameter``s, calls a functional pair, keeps that pair's cache and adds
parameter gradients into ``.grad`` on ``backward``.

Validation runs once, at the edge.  A public ``forward(x)`` checks and casts ``x`` and then calls
``_forward(x)``, which calls the unvalidated kernels of ``npattn.functional.kernels``;
``backward(dy)`` checks ``dy`` and calls ``_backward(dy)``.  A module composing others (e.g.
``FeedForward``, ``EncoderBlock``) validates its own inputs once and then calls its children's
``_forward`` / ``_backward`` directly: those two take arrays that are already what the public
edge would have made of them (the module's dtype, shapes that fit).
Every layer takes any number of leading axes, so unbatched input ``(L, features)`` works as in torch.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Optional, Tuple, Union

import numpy as np

from .. import functional as F
from .._docs import shared_doc
from .._validate import (
    as_float,
    as_index,
    as_rng,
    check_bool,
    check_dtype,
    check_positive_float,
    check_prob,
    check_size,
)
from ..functional import kernels as K
from ..functional._bfloat16 import BFloat16Array
from .module import Module, Parameter, is_grad_enabled

__all__ = ["Linear", "LayerNorm", "RMSNorm", "Dropout", "Embedding", "FeedForward"]

ShapeLike = Union[int, Tuple[int, ...]]


def check_features(x: np.ndarray, name: str, expected: int, module: str) -> None:
    """``x (..., expected)``, else a ValueError naming the argument and the module (every module's input)."""
    if x.ndim < 1 or x.shape[-1] != expected:
        raise ValueError(f"{name}: expected shape (..., {expected}) for {module}, got {x.shape}")


def _normalized_shape(normalized_shape) -> Tuple[int, ...]:
    """An int or a non-empty tuple/list of positive ints -> a tuple (torch's ``normalized_shape``)."""
    if isinstance(normalized_shape, (tuple, list)):
        if len(normalized_shape) == 0:
            raise ValueError("normalized_shape: expected an int or a non-empty tuple of ints, got ()")
        return tuple(check_size(d, "normalized_shape") for d in normalized_shape)
    return (check_size(normalized_shape, "normalized_shape"),)


def _as_trailing(x, name: str, dtype, shape: Tuple[int, ...], module: str) -> np.ndarray:
    """``x`` cast to ``dtype``, of shape ``(..., *shape)``, else a ValueError naming the argument and
    ``module(shape)`` (a norm's input)."""
    x = as_float(x, name, dtype)
    k = len(shape)
    if x.ndim < k or x.shape[x.ndim - k :] != shape:
        raise ValueError(
            f"{name}: expected shape (..., {', '.join(map(str, shape))}) for {module}({shape}), got {x.shape}"
        )
    return x


def _backward_sections(kind: str = "ndarray", returns: str = "``dx``, of the input's shape.") -> str:
    """A layer's ``backward`` sections: ``dy``, what it returns (``kind``: its type) and its errors."""
    return f"""
        Parameters
        ----------
        dy : array_like
            The upstream gradient, of the forward output's shape.

        Returns
        -------
        {kind}
            {returns}

        Raises
        ------
        RuntimeError
            No forward to differentiate (none yet, already used, or run under ``no_grad``), or a
            parameter changed since the forward.
        ValueError
            ``dy`` of the wrong shape.
        """


_BACKWARD_SECTIONS = _backward_sections()


def _forward_sections(x: str, y: str) -> str:
    """A feature layer's ``forward`` sections: ``x`` (its shape), the output (``y``: its shape), the errors."""
    return f"""
        Parameters
        ----------
        x : array_like
            {x}; cast to the module's dtype.

        Returns
        -------
        ndarray
            {y}, in the module's dtype.

        Raises
        ------
        TypeError
            A non-numeric input, or float16/longdouble.
        ValueError
            An input whose feature size does not match the module.
        """


#: ``LayerNorm.forward``'s and ``RMSNorm.forward``'s sections.
_NORM_FORWARD_SECTIONS = _forward_sections("``(..., *normalized_shape)``", "Of ``x``'s shape")


def _data(p: Optional[Parameter]):
    return None if p is None else p.data


def input_tangent(input_tangents: tuple, module: str, method: str = "jvp"):
    """The one input tangent of a single-input module (None: zero); ``method`` names the caller
    in the message (``jvp`` or ``backward_jvp``)."""
    if len(input_tangents) > 1:
        raise TypeError(f"{module}.{method}: expected at most one input tangent, got {len(input_tangents)}")
    return input_tangents[0] if input_tangents else None


class _Layer(Module):
    """A layer whose ``backward`` checks ``dy`` and hands it to ``_backward`` (which returns dx and
    adds the parameters' gradients)."""

    @shared_doc(backward_sections=_BACKWARD_SECTIONS)
    def backward(self, dy) -> np.ndarray:
        """The backward pass of the last forward: returns dx and adds
        every parameter's gradient into ``p.grad``.

        <backward_sections>
        """
        return self._backward(self._check_dy(dy))

    def _backward(self, dy: np.ndarray) -> np.ndarray:
        raise NotImplementedError


class Linear(_Layer):
    """``y = x @ weight.T + bias``; ``weight (out, in)`` and ``bias (out,)`` drawn from
    U(-1/sqrt(in), 1/sqrt(in)) as ``torch.nn.Linear``.

    Parameters
    ----------
    in_features, out_features : int
        Positive sizes.
    bias : bool
        False: no bias.
    rng : numpy.random.Generator, int or None
        Draws the initial weights.
    dtype : float32 or float64

    Raises
    ------
    TypeError, ValueError
        A size that is not a positive integer, a non-bool ``bias``, an unsupported dtype.

    Examples
    --------
    >>> import numpy as np
    >>> import npattn
    >>> lin = npattn.Linear(3, 2, rng=0)
    >>> x = np.ones((4, 3))
    >>> y = lin(x)
    >>> dx = lin.backward(np.ones((4, 2)))
    >>> y.shape, dx.shape, lin.weight.grad.shape
    ((4, 2), (4, 3), (2, 3))
    >>> lin.bias.grad                  # the column sums of dy, added into .grad
    array([4., 4.])
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, rng=None, dtype=np.float64) -> None:
        super().__init__()
        self.in_features = check_size(in_features, "in_features")
        self.out_features = check_size(out_features, "out_features")
        has_bias = check_bool(bias, "bias")
        self._dtype = check_dtype(dtype)
        rng = as_rng(rng)
        bound = 1.0 / math.sqrt(self.in_features)
        self.weight = Parameter(rng.uniform(-bound, bound, (self.out_features, self.in_features)), self._dtype)
        self.bias = Parameter(rng.uniform(-bound, bound, (self.out_features,)), self._dtype) if has_bias else None

    def _check_input(self, x, name: str = "x") -> np.ndarray:
        x = as_float(x, name, self.dtype)
        check_features(x, name, self.in_features, f"Linear({self.in_features}, {self.out_features})")
        return x

    @shared_doc(forward_sections=_forward_sections("``(..., in_features)``", "``(..., out_features)``"))
    def forward(self, x) -> np.ndarray:
        """The forward pass: ``y = x @ weight.T + bias``.

        <forward_sections>
        """
        return self._forward(self._check_input(x))

    def _forward(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """``forward`` on a checked ``x``; ``out``: where to write ``y`` (a calling module's workspace)."""
        y, cache = K.linear(x, self.weight.data, _data(self.bias), out=out)
        self.save_for_backward(cache)
        return y

    def _backward(self, dy: np.ndarray, dx_out: np.ndarray | None = None) -> np.ndarray:
        """``backward`` on a checked ``dy``; ``dx_out``: where to write ``dx`` (a calling module's workspace)."""
        dx, dw, db = K.linear_backward(dy, self.pop_saved(), dx_out)
        self.accumulate_grad(self.weight, dw)
        if self.bias is not None:
            self.accumulate_grad(self.bias, db)
        return dx

    def _jvp(self, state, input_tangents, param_tangents):
        """Forward mode: ``ty = tx @ W.T + x @ tW.T + tb`` (``functional.linear_jvp``)."""
        tx = input_tangent(input_tangents, "Linear")
        return F.linear_jvp(state, tx, param_tangents.get(self.weight), param_tangents.get(self.bias))

    def _backward_jvp(self, state, dy, input_tangents, param_tangents, ddy):
        """Second order (``functional.linear_backward_jvp``): ``tdx = ddy W + dy tW``, ``tdW =
        ddy^T x + dy^T tx``, ``tdb = sum(ddy)``."""
        tx = input_tangent(input_tangents, "Linear", "backward_jvp")
        tw, tb = param_tangents.get(self.weight), param_tangents.get(self.bias)
        (dx, dw, db), (tdx, tdw, tdb) = F.linear_backward_jvp(dy, state, (tx, tw, tb), ddy)
        self._accumulate_second(((self.weight, dw, tdw), (self.bias, db, tdb)))
        return dx, tdx

    def extra_repr(self):
        """The arguments shown by ``repr(module)``."""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class _Norm(_Layer):
    """What ``LayerNorm`` and ``RMSNorm`` share: the checks, passes and repr around the kernel
    ``functional.<_OP>`` (its ``_backward``, ``_jvp``, ``_backward_jvp``) with the affine
    parameters ``_affine()`` (None: absent), in the kernel's order."""

    _OP: str  # the functional pair: "layer_norm" or "rms_norm"
    _NAME: str  # the module's name in error messages
    normalized_shape: Tuple[int, ...]
    eps: Optional[float]
    elementwise_affine: bool

    def _affine(self) -> tuple:
        raise NotImplementedError

    def _check_input(self, x, name: str = "x") -> np.ndarray:
        return _as_trailing(x, name, self.dtype, self.normalized_shape, self._NAME)

    @shared_doc(norm_forward_sections=_NORM_FORWARD_SECTIONS)
    def forward(self, x) -> np.ndarray:
        """The forward pass over the trailing ``normalized_shape`` axes: ``LayerNorm`` subtracts the
        mean and divides by the standard deviation, then scales and shifts; ``RMSNorm`` divides by
        the root mean square, then scales.

        <norm_forward_sections>
        """
        return self._forward(self._check_input(x))

    def _forward(self, x: np.ndarray) -> np.ndarray:
        params = [_data(p) for p in self._affine()]
        kw = {"keep": False} if self._OP == "rms_norm" and not is_grad_enabled() else {}
        y, cache = getattr(K, self._OP)(x, *params, self.eps, normalized_shape=self.normalized_shape, **kw)
        self.save_for_backward(cache)
        return y

    def _backward(self, dy: np.ndarray) -> np.ndarray:
        dx, *grads = getattr(K, self._OP + "_backward")(dy, self.pop_saved())
        for p, g in zip(self._affine(), grads):
            if p is not None:
                self.accumulate_grad(p, g)
        return dx

    def _jvp(self, state, input_tangents, param_tangents):
        """Forward mode (``functional.layer_norm_jvp`` / ``rms_norm_jvp``)."""
        tx = input_tangent(input_tangents, self._NAME)
        return getattr(F, self._OP + "_jvp")(state, tx, *[param_tangents.get(p) for p in self._affine()])

    def _backward_jvp(self, state, dy, input_tangents, param_tangents, ddy):
        """Second order (``functional.layer_norm_backward_jvp`` / ``rms_norm_backward_jvp``)."""
        tx = input_tangent(input_tangents, self._NAME, "backward_jvp")
        params = self._affine()
        tangents = (tx, *[param_tangents.get(p) for p in params])
        (dx, *grads), (tdx, *tgrads) = getattr(F, self._OP + "_backward_jvp")(dy, state, tangents, ddy)
        self._accumulate_second(tuple(zip(params, grads, tgrads)))
        return dx, tdx

    def extra_repr(self):
        """The arguments shown by ``repr(module)``."""
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class LayerNorm(_Norm):
    """Layer norm over the trailing ``normalized_shape`` axes (an int: the last axis; a tuple:
    that many trailing axes, as ``torch.nn.LayerNorm``); biased variance, ``eps`` inside the
    square root.  ``weight`` (ones) and ``bias`` (zeros) have shape ``normalized_shape``;
    ``elementwise_affine=False`` has neither, ``bias=False`` only the weight.

    Examples
    --------
    >>> import numpy as np
    >>> import npattn
    >>> ln = npattn.LayerNorm(4)
    >>> y = ln(np.array([[1.0, 2.0, 3.0, 4.0]]))
    >>> np.round(y, 4)
    array([[-1.3416, -0.4472,  0.4472,  1.3416]])
    >>> ln.backward(np.array([[1.0, -1.0, 2.0, 0.5]])).shape
    (1, 4)
    """

    _OP, _NAME = "layer_norm", "LayerNorm"

    def __init__(
        self,
        normalized_shape: ShapeLike,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        *,
        dtype=np.float64,
    ) -> None:
        super().__init__()
        self.normalized_shape = _normalized_shape(normalized_shape)
        self.eps = check_positive_float(eps, "eps", allow_zero=True)
        self.elementwise_affine = check_bool(elementwise_affine, "elementwise_affine")
        bias = check_bool(bias, "bias")
        self._dtype = check_dtype(dtype)
        shape = self.normalized_shape
        self.weight = Parameter(np.ones(shape), self._dtype) if self.elementwise_affine else None
        self.bias = Parameter(np.zeros(shape), self._dtype) if (self.elementwise_affine and bias) else None

    def _affine(self) -> tuple:
        return (self.weight, self.bias)


class RMSNorm(_Norm):
    """``y = x / sqrt(mean(x**2) + eps) * weight`` over the trailing ``normalized_shape`` axes, as
    ``torch.nn.RMSNorm``; ``eps=None`` is ``np.finfo(dtype).eps`` of the module's dtype.  ``weight``
    (ones, shape ``normalized_shape``) unless ``elementwise_affine=False``.

    Examples
    --------
    >>> import numpy as np
    >>> import npattn
    >>> norm = npattn.RMSNorm(2, eps=0.0)
    >>> norm(np.array([[3.0, 4.0]]))
    array([[0.84852814, 1.13137085]])
    """

    _OP, _NAME = "rms_norm", "RMSNorm"

    def __init__(
        self,
        normalized_shape: ShapeLike,
        eps: Optional[float] = None,
        elementwise_affine: bool = True,
        *,
        dtype=np.float64,
    ) -> None:
        super().__init__()
        self.normalized_shape = _normalized_shape(normalized_shape)
        self.eps = None if eps is None else check_positive_float(eps, "eps", allow_zero=True)
        self.elementwise_affine = check_bool(elementwise_affine, "elementwise_affine")
        self._dtype = check_dtype(dtype)
        self.weight = Parameter(np.ones(self.normalized_shape), self._dtype) if self.elementwise_affine else None

    def _affine(self) -> tuple:
        return (self.weight,)


class Dropout(Module):
    """Inverted dropout, active only in training mode; masks drawn from ``rng``.  Float input
    keeps its dtype (integer input becomes float64).

    Examples
    --------
    >>> import numpy as np
    >>> import npattn
    >>> drop = npattn.Dropout(0.5, rng=0)
    >>> sorted(set(drop(np.ones(8)).tolist()))     # training mode: dropped or scaled by 2
    [0.0, 2.0]
    >>> drop.eval()(np.ones(3))                      # eval mode: the identity
    array([1., 1., 1.])
    """

    def __init__(self, p: float = 0.5, *, rng=None) -> None:
        super().__init__()
        self.p = check_prob(p, "p")
        self.rng = as_rng(rng)

    def forward(self, x) -> np.ndarray:
        """The forward pass: in training mode, zero each entry with probability ``p`` and scale the
        rest by ``1 / (1 - p)``; in eval mode the identity.

        Parameters
        ----------
        x : array_like
            Any shape.

        Returns
        -------
        ndarray
            Of ``x``'s shape (float input keeps its dtype).

        Raises
        ------
        TypeError
            A non-numeric input.
        """
        return self._forward(as_float(x, "x"))

    def _forward(self, x: np.ndarray) -> np.ndarray:
        y, cache = K.dropout(x, self.p, self.rng, self.training)
        self.save_for_backward(cache)
        return y

    @shared_doc(backward_sections=_BACKWARD_SECTIONS)
    def backward(self, dy) -> np.ndarray:
        """The backward pass of the last forward: returns dx and adds
        nothing (dropout has no parameters).

        <backward_sections>
        """
        return self._backward(self._check_dy(dy))

    def _backward(self, dy: np.ndarray) -> np.ndarray:
        return K.dropout_backward(dy, self.pop_saved())

    def _jvp(self, state, input_tangents, param_tangents):
        """Forward mode: the tangent through the forward's own mask (``functional.dropout_jvp``)."""
        return F.dropout_jvp(state, input_tangent(input_tangents, "Dropout"))

    def _backward_jvp(self, state, dy, input_tangents, param_tangents, ddy):
        """Second order: ``dx = mask dy / (1 - p)`` is linear in ``dy`` alone, so ``tdx`` is the
        same map of ``ddy`` (``functional.dropout_backward_jvp``)."""
        tx = input_tangent(input_tangents, "Dropout", "backward_jvp")
        return F.dropout_backward_jvp(dy, state, (tx,), ddy)

    @property
    def active(self) -> bool:
        """True when ``forward`` changes anything (training mode and ``p > 0``)."""
        return self.training and self.p > 0.0

    def extra_repr(self):
        """The arguments shown by ``repr(module)``."""
        return f"p={self.p}"


class Embedding(Module):
    """Lookup table ``weight (num_embeddings, embedding_dim)`` drawn from N(0, 1), as
    ``torch.nn.Embedding``.  ``backward`` returns None (token ids have no gradient) and adds into
    ``weight.grad``.

    * ``padding_idx`` (an int in ``[-num_embeddings, num_embeddings)``, negative counting from the
      end): that row is zero at start and never gets a gradient;
    * ``max_norm``: before each lookup, every looked-up row whose ``norm_type``-norm exceeds
      ``max_norm`` is rescaled **in place** in ``weight.data`` to norm ``max_norm`` (torch's
      ``scale = max_norm / (norm + 1e-7)``); no gradient flows through that rescaling;
    * ``scale_grad_by_freq``: each row's gradient is divided by the number of times its id occurs
      in the batch.

    Examples
    --------
    >>> import numpy as np
    >>> import npattn
    >>> emb = npattn.Embedding(10, 4, padding_idx=0, rng=0)
    >>> out = emb(np.array([[0, 3, 3]]))
    >>> out.shape, bool((out[0, 0] == 0).all())     # the padding row is zero
    ((1, 3, 4), True)
    >>> emb.backward(np.ones((1, 3, 4))) is None
    True
    >>> emb.weight.grad[3]                           # id 3 occurred twice
    array([2., 2., 2., 2.])
    """

    weight: Parameter
    padding_idx: Optional[int]
    max_norm: Optional[float]
    norm_type: float
    scale_grad_by_freq: bool

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: Optional[int] = None,
        max_norm: Optional[float] = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        *,
        rng=None,
        dtype=np.float64,
    ) -> None:
        super().__init__()
        self.num_embeddings = check_size(num_embeddings, "num_embeddings")
        self.embedding_dim = check_size(embedding_dim, "embedding_dim")
        if padding_idx is not None:
            if isinstance(padding_idx, bool) or not isinstance(padding_idx, numbers.Integral):
                raise TypeError(
                    f"padding_idx: expected an integer or None, got {padding_idx!r} ({type(padding_idx).__name__})"
                )
            n = self.num_embeddings
            if not -n <= padding_idx < n:
                raise ValueError(
                    f"padding_idx: expected a value in [{-n}, {n - 1}] (num_embeddings={n}), got {padding_idx}"
                )
            padding_idx = int(padding_idx) % n
        self.padding_idx = padding_idx
        self.max_norm = None if max_norm is None else check_positive_float(max_norm, "max_norm")
        if isinstance(norm_type, bool) or not isinstance(norm_type, numbers.Real):
            raise TypeError(f"norm_type: expected a float > 0 (or inf), got {norm_type!r} ({type(norm_type).__name__})")
        if not norm_type > 0:  # also refuses NaN
            raise ValueError(f"norm_type: expected a number > 0 (or inf), got {norm_type}")
        self.norm_type = float(norm_type)
        self.scale_grad_by_freq = check_bool(scale_grad_by_freq, "scale_grad_by_freq")
        self._dtype = check_dtype(dtype)
        w = as_rng(rng).standard_normal((self.num_embeddings, self.embedding_dim))
        if self.padding_idx is not None:
            w[self.padding_idx] = 0.0
        self.weight = Parameter(w, self._dtype)

    def _check_input(self, ids, name: str = "ids") -> np.ndarray:
        ids = as_index(ids, name)
        n = self.num_embeddings
        if ids.size and (ids.min() < 0 or ids.max() >= n):
            bad = ids.min() if ids.min() < 0 else ids.max()
            raise ValueError(f"{name}: expected values in [0, {n}), got {bad}")
        return ids

    def forward(self, ids) -> np.ndarray:
        """The forward pass: the rows of ``weight`` at ``ids`` (renormalised first with ``max_norm``).

        Parameters
        ----------
        ids : array_like of int
            Any shape, each in ``[0, num_embeddings)``.

        Returns
        -------
        ndarray
            ``ids.shape + (embedding_dim,)``, in the module's dtype.

        Raises
        ------
        TypeError
            Non-integer ids.
        ValueError
            An id out of range.
        """
        return self._forward(self._check_input(ids))

    def _renorm_(self, ids: np.ndarray) -> None:
        """torch's ``embedding_renorm_``: rescale, in place, the looked-up rows whose norm exceeds
        ``max_norm`` (each distinct row once)."""
        rows = np.unique(ids)
        w = self.weight.data
        sub = w[rows]
        norms = np.linalg.norm(sub, ord=self.norm_type, axis=1)
        big = norms > self.max_norm
        if big.any():
            w[rows[big]] = sub[big] * (self.max_norm / (norms[big] + 1e-7))[:, None].astype(w.dtype)
            self.weight.bump_version()  # a forward state kept elsewhere from these rows is stale

    def _forward(self, ids: np.ndarray) -> np.ndarray:
        if self.max_norm is not None:
            self._renorm_(ids)  # the rows are now within max_norm: the lookup needs no renorm of its own
        y, cache = K.embedding(ids, self.weight.data, self.padding_idx, None, self.norm_type, self.scale_grad_by_freq)
        self.save_for_backward(cache)
        return y

    @shared_doc(backward_sections=_backward_sections("None", "Token ids have no gradient."))
    def backward(self, dy) -> None:
        """The backward pass of the last forward: returns dx and adds
        the rows' gradients into ``weight.grad``.

        <backward_sections>
        """
        self._backward(self._check_dy(dy))
        return None

    def _backward(self, dy: np.ndarray) -> None:
        self.accumulate_grad(self.weight, K.embedding_backward(dy, self.pop_saved()))
        return None

    def _jvp(self, state, input_tangents, param_tangents):
        """Forward mode: the looked-up rows of the weight's tangent (``functional.embedding_jvp``);
        token ids have no tangent (pass None or nothing)."""
        if input_tangent(input_tangents, "Embedding") is not None:
            raise TypeError("Embedding.jvp: token ids have no tangent; expected None")
        return F.embedding_jvp(state, param_tangents.get(self.weight))

    def _backward_jvp(self, state, dy, input_tangents, param_tangents, ddy):
        """Second order: ``dweight`` scatters ``dy`` into the looked-up rows, linear in ``dy``
        alone, so its tangent scatters ``ddy`` (``functional.embedding_backward_jvp``); the ids
        have neither a gradient nor a tangent (``(None, None)``)."""
        if input_tangent(input_tangents, "Embedding", "backward_jvp") is not None:
            raise TypeError("Embedding.backward_jvp: token ids have no tangent; expected None")
        dw, tdw = F.embedding_backward_jvp(dy, state, (param_tangents.get(self.weight),), ddy)
        self._accumulate_second(((self.weight, dw, tdw),))
        return None, None

    def extra_repr(self):
        """The arguments shown by ``repr(module)``."""
        s = f"{self.num_embeddings}, {self.embedding_dim}"
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        if self.max_norm is not None:
            s += f", max_norm={self.max_norm}, norm_type={self.norm_type}"
        if self.scale_grad_by_freq:
            s += ", scale_grad_by_freq=True"
        return s


# name -> (kernel name, keyword arguments)
_ACTIVATIONS = {
    "relu": ("relu", {}),
    "relu2": ("relu2", {}),
    "xielu": ("xielu", {}),  # with trained parameters: FeedForward's act_fn (XIELU), never a bare kernel
    "gelu": ("gelu", {"approximate": "none"}),
    "gelu_tanh": ("gelu", {"approximate": "tanh"}),
    "silu": ("silu", {}),
    "swiglu": ("silu", {}),
}


def _act(name: str):
    kernel, kwargs = _ACTIVATIONS[name]
    return getattr(K, kernel), getattr(K, kernel + "_backward"), kwargs


def act_kernels(name: str) -> tuple:
    """``(forward, backward, jvp, backward_jvp)``: the kernels of the activation ``name`` (one of
    ``_ACTIVATIONS``), the forward's keywords bound, for a module that applies one by hand."""
    kernel, kwargs = _ACTIVATIONS[name]
    ops = (getattr(K, kernel + suffix) for suffix in ("_backward", "_jvp", "_backward_jvp"))
    return (functools.partial(getattr(K, kernel), **kwargs), *ops)


def fused_linears(owner: Module, mods: tuple) -> Optional[tuple]:
    """``(W, b)``: the weights of the ``Linear`` modules ``mods`` (one input width) stacked by rows
    in one array, whose row blocks the parameters' ``.data`` become (views: the same values, the
    same versions), so that one GEMM (one GEMV when decoding) forms every output; ``b`` likewise,
    None without biases.  Kept on ``owner`` (``_fused``: a fused q/k/v, the gated unit's gate and
    up) and made again only when a parameter's ``.data`` was replaced by another array
    (``Module.to``, ``copy.deepcopy``, an assignment to ``.data``, ``store_bfloat16``).  None when
    the weights cannot share one array (bfloat16 bits beside floats, or two dtypes)."""
    weights = [m.weight for m in mods]
    has_bias = [m.bias is not None for m in mods]
    if any(has_bias) and not all(has_bias):
        return None
    biases = [m.bias for m in mods] if all(has_bias) else None
    f = owner.__dict__.get("_fused")
    if f is not None and _linked(f[0], f[2], weights) and (f[1] is None or _linked(f[1], f[3], biases)):
        return f[0], f[1]
    datas = [w.data for w in weights]
    bf16 = [isinstance(d, BFloat16Array) for d in datas]
    if any(bf16) and not all(bf16) or len({d.dtype for d in datas}) > 1:
        return None
    W = BFloat16Array(np.concatenate([d.bits for d in datas])) if all(bf16) else _stacked(datas)
    wv = _views(W, weights)
    b = bv = None
    if biases is not None:
        b = np.concatenate([p.data for p in biases])
        bv = _views(b, biases)
    object.__setattr__(owner, "_fused", (W, b, wv, bv))
    return W, b


def _stacked(datas: list) -> np.ndarray:
    """The float weights ``datas`` stacked by rows, ``(N, K)``, stored column by column (Fortran
    order) when ``N > 2 K``: a decoding step's product ``x W^T`` then reads ``W`` as ``K`` columns
    of ``N`` contiguous values (BLAS's non-transposed matrix-vector kernel) instead of ``N`` rows
    of ``K``.  Either kernel reads a few runs of memory side by side, and the hardware prefetchers
    stream a long run better than a short one: a wide fused projection (q/k/v, or gate and up,
    with ``N`` several times ``d_model``) has columns several times longer than its rows.  On the
    machine of issue 32 (OpenBLAS, AVX-512, 2 threads; its figures are in the issue's notes and
    hold for that machine alone) the columns read faster where ``N > 2 K`` and the rows where
    ``N <= 2 K``; ``npattn bench --decode-large`` shows a decoding step on yours.  The same
    values either way; only the order of a product's sums may differ, by a rounding."""
    n, k = sum(d.shape[0] for d in datas), datas[0].shape[1]
    return np.concatenate(datas, out=np.empty((n, k), datas[0].dtype, order="F" if n > 2 * k else "C"))


def _linked(fused, views, params) -> bool:
    """True while each parameter's ``.data`` is still the view of ``fused`` handed to it."""
    for p, w in zip(params, views):  # (a loop, not all() over a generator: every decoding step asks)
        if p.data is not w or w.base is not fused:
            return False
    return True


def _views(fused, params):
    """Point each parameter's ``.data`` at its row block of ``fused``; return the views."""
    views, r = [], 0
    for p in params:
        n = p.data.shape[0]
        w = fused.part(slice(r, r + n)) if isinstance(fused, BFloat16Array) else fused[r : r + n]
        version = p._version
        p.data = w
        p._version = version  # the same values, only in another array: nothing a kept forward state must refuse
        views.append(w)
        r += n
    return tuple(views)


# The gated unit ``h = act(gate(x)) * up(x)`` (SwiGLU and its kin), said once for FeedForward's
# "swiglu" (linear1, linear3) and nn.moe.GatedMLP (gate_proj, up_proj); ``state`` is
# ``(act's cache, s = act(gate x), b = up x)``.  Shared with nn.moe (as check_features and
# input_tangent with every module): public names, outside __all__.
def gated_unit(act: str, gate: Linear, up: Linear, x: np.ndarray, owner: Optional[Module] = None, gate_scale=None):
    """``(h, state)``; ``owner``: the module holding ``gate`` and ``up``, whose fused weights
    (``fused_linears``) serve a call without grad (None: the two products apart); ``gate_scale``: a
    factor of ``gate x`` before the activation (Falcon-H1's; None: none), ``a = gate_scale gate x``."""
    kernel, _, kwargs = _act(act)
    if not is_grad_enabled():  # no state kept (inference): the products go in place, no state
        return _gated_unit_inference(act, gate, up, x, owner, gate_scale), None
    a = gate._forward(x)
    s, act_cache = kernel(a if gate_scale is None else a * gate_scale, **kwargs)
    b = up._forward(x)
    return s * b, (act_cache, s, b)


def _gated_unit_inference(
    act: str, gate: Linear, up: Linear, x: np.ndarray, owner: Optional[Module], gate_scale=None
) -> np.ndarray:
    """``act(a) * b`` written into ``a``'s array (fresh, seen by nobody else), with the roundings
    of the kept path (``silu(a) = a * sigmoid(a)``, then times ``b``): two arrays of
    ``(..., d_ff)`` fewer per call, which on a long prompt are fresh pages each.  With the fused
    weights ``a`` and ``b`` are the two halves of one product's output (each element the same dot
    product as apart: the same bits, but in float32 with a column-major stack (``_stacked``), whose
    single-precision kernels may order a few outputs' sums otherwise: a rounding), one GEMM instead
    of two, one GEMV when decoding.  SiLU's
    passes go a block of rows at a time (``K.silu_mul_``), over a block the cache holds."""
    kernel, _, kwargs = _act(act)
    fused = None if owner is None else fused_linears(owner, (gate, up))
    if fused is None:
        a, b = gate._forward(x), None
    else:
        ab = K.linear(x, *fused)[0]
        a, b = ab[..., : gate.out_features], ab[..., gate.out_features :]
    b = up._forward(x) if b is None else b
    if gate_scale is not None:
        a *= gate_scale  # a fresh array (or a half of one)
    if _ACTIVATIONS[act][0] == "silu":
        return K.silu_mul_(a, b)
    h = kernel(a, **kwargs)[0]
    h *= b
    return h


def gated_unit_backward(act: str, gate: Linear, up: Linear, dh: np.ndarray, state, gate_scale=None) -> np.ndarray:
    """``h = s b`` with ``s = act(a)``, ``a = gate x`` (times ``gate_scale``), ``b = up x``: ``db = dh s``,
    ``da = act'(a) (dh b)``, and ``dx`` sums the two linears' input gradients."""
    act_cache, s, b = state
    dx = up._backward(dh * s)
    da = _act(act)[1](dh * b, act_cache)
    dx += gate._backward(da if gate_scale is None else da * gate_scale)
    return dx


def gated_unit_jvp(
    module: Module, act: str, gate: Linear, up: Linear, tx, state, param_tangents, gate_scale=None
) -> np.ndarray:
    """``th = act'(a) ta b + s tb`` with the linears' tangents ``ta``, ``tb`` (the children's
    latest states are ``module``'s call's)."""
    return gated_unit_tangents(module, act, gate, up, tx, state, param_tangents, gate_scale)[0]


def gated_unit_tangents(module: Module, act: str, gate: Linear, up: Linear, tx, state, param_tangents, gate_scale=None):
    """``(th, (ta, ts, tb))``: the unit's output tangent and those of ``a = gate x`` (times
    ``gate_scale``), ``s = act(a)`` and ``b = up x`` (what ``gated_unit_backward_jvp`` needs)."""
    act_cache, s, b = state
    ta = module._child_jvp(gate, -1, (tx,), param_tangents)
    if gate_scale is not None:
        ta = ta * gate_scale
    tb = module._child_jvp(up, -1, (tx,), param_tangents)
    ts = getattr(K, _ACTIVATIONS[act][0] + "_jvp")(act_cache, ta)
    return ts * b + s * tb, (ta, ts, tb)


def gated_unit_backward_jvp(
    module: Module, act: str, gate: Linear, up: Linear, dh, tdh, tx, inner, state, param_tangents, gate_scale=None
):
    """Second order of ``gated_unit_backward``, ``inner = (ta, ts, tb)`` from ``gated_unit_tangents``:
    the backward ``db = dh s``, ``u = dh b``, ``da = act'(a) u`` differentiated by the product rule,
    ``tdb = tdh s + dh ts``, ``tu = tdh b + dh tb``, ``tda`` from ``<act>_backward_jvp(u, (ta,),
    tu)``; each linear's ``backward_jvp`` with ``tx``; ``dx`` and its tangent summed."""
    act_cache, s, b = state
    ta, ts, tb = inner
    tdb, tu = dh * ts, dh * tb
    if tdh is not None:
        tdb += tdh * s
        tu += tdh * b
    da, tda = getattr(K, _ACTIVATIONS[act][0] + "_backward_jvp")(dh * b, act_cache, (ta,), tu)
    if gate_scale is not None:  # a = gate_scale gate x
        da, tda = da * gate_scale, tda * gate_scale
    dx, tdx = module._child_backward_jvp(up, dh * s, (tx,), param_tangents, tdb)
    dx_gate, tdx_gate = module._child_backward_jvp(gate, da, (tx,), param_tangents, tda)
    return dx + dx_gate, tdx + tdx_gate


class XIELU(_Layer):
    """xIELU with its two trained numbers (``functional.xielu``; transformers' ``XIELUActivation``,
    Apertus's MLP activation): ``alpha_p`` and ``alpha_n`` (Parameters of shape ``(1,)``, stored raw:
    ``a_p = softplus(alpha_p)``, ``a_n = beta + softplus(alpha_n)``) and the buffers ``beta``,
    ``eps`` (0-d, saved in ``state_dict``, not trained).  Initialised as transformers initialises
    them: ``a_p = alpha_p_init``, ``a_n = alpha_n_init``.  ``FeedForward(activation="xielu")`` holds
    one as ``act_fn``."""

    beta: np.ndarray  # buffers (register_buffer)
    eps: np.ndarray

    def __init__(
        self,
        alpha_p_init: float = 0.8,
        alpha_n_init: float = 0.8,
        beta: float = 0.5,
        eps: float = -1e-6,
        *,
        dtype=np.float64,
    ) -> None:
        super().__init__()
        for name, v in (("alpha_p_init", alpha_p_init), ("alpha_n_init", alpha_n_init), ("beta", beta), ("eps", eps)):
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
                raise ValueError(f"{name}: expected a finite real number, got {v!r}")
        if alpha_p_init <= 0 or alpha_n_init <= beta:
            raise ValueError(
                f"XIELU: expected alpha_p_init > 0 and alpha_n_init > beta (softplus' values), got "
                f"alpha_p_init={alpha_p_init!r}, alpha_n_init={alpha_n_init!r}, beta={beta!r}"
            )
        self._dtype = check_dtype(dtype)
        self.alpha_p = Parameter(np.array([math.log(math.expm1(alpha_p_init))]), self._dtype)
        self.alpha_n = Parameter(np.array([math.log(math.expm1(alpha_n_init - beta))]), self._dtype)
        self.register_buffer("beta", np.array(beta, self._dtype))
        self.register_buffer("eps", np.array(eps, self._dtype))

    def _check_input(self, x, name: str = "x") -> np.ndarray:
        return as_float(x, name, self.dtype)

    def forward(self, x) -> np.ndarray:
        """The forward pass, elementwise: ``a_p x^2 + beta x`` where ``x > 0``, ``a_n (expm1(min(x,
        eps)) - x) + beta x`` where not.

        Parameters
        ----------
        x : array_like
            Any shape.

        Returns
        -------
        ndarray
            Of ``x``'s shape, in the module's dtype.

        Raises
        ------
        TypeError
            A non-numeric input.
        """
        return self._forward(self._check_input(x))

    def _forward(self, x: np.ndarray) -> np.ndarray:
        y, cache = K.xielu(x, self.alpha_p.data, self.alpha_n.data, float(self.beta), float(self.eps))
        self.save_for_backward(cache)
        return y

    def _backward(self, dy: np.ndarray) -> np.ndarray:
        dx, dalpha_p, dalpha_n = K.xielu_backward(dy, self.pop_saved())
        self.accumulate_grad(self.alpha_p, dalpha_p)
        self.accumulate_grad(self.alpha_n, dalpha_n)
        return dx

    def _jvp(self, state, input_tangents, param_tangents):
        """Forward mode (``functional.xielu_jvp``) along the input's and both parameters' tangents."""
        tx = input_tangent(input_tangents, "XIELU")
        return F.xielu_jvp(state, tx, param_tangents.get(self.alpha_p), param_tangents.get(self.alpha_n))

    def _backward_jvp(self, state, dy, input_tangents, param_tangents, ddy):
        """Second order (``functional.xielu_backward_jvp``): the parameters' gradients and their
        tangents added into ``grad`` / ``grad_tangent``."""
        tx = input_tangent(input_tangents, "XIELU", "backward_jvp")
        params = (self.alpha_p, self.alpha_n)
        tangents = (tx, *[param_tangents.get(p) for p in params])
        (dx, *grads), (tdx, *tgrads) = F.xielu_backward_jvp(dy, state, tangents, ddy)
        self._accumulate_second(tuple(zip(params, grads, tgrads)))
        return dx, tdx

    def extra_repr(self):
        """The arguments shown by ``repr(module)``."""
        return f"beta={float(self.beta)}, eps={float(self.eps)}"


class FeedForward(_Layer):
    """Position-wise feed-forward: ``linear2(dropout(act(linear1(x))))`` (as torch's encoder layer).

    ``activation`` is ``"relu"``, ``"relu2"`` (squared ReLU, Nemotron-H's), ``"xielu"`` (Apertus's,
    with trained parameters: ``act_fn``, an ``XIELU``), ``"gelu"`` (erf form),
    ``"gelu_tanh"``, ``"silu"`` or ``"swiglu"``: ``linear2(dropout(silu(linear1(x)) * linear3(x)))``
    (Llama's gated unit; adds ``linear3`` ``(d_ff, d_model)``).  ``bias=False`` drops every linear
    bias.  Keys: ``linear1.*``, ``linear2.*`` (and ``linear3.*`` for swiglu).

    SwiGLU backward: with ``a = linear1(x)``, ``b = linear3(x)``, ``h = silu(a) * b``:
    ``da = silu'(a) * (dh * b)``, ``db = dh * silu(a)``, and ``dx`` is the sum of both linears'
    input gradients.

    Examples
    --------
    >>> import numpy as np
    >>> import npattn
    >>> ff = npattn.FeedForward(8, 32, activation="swiglu", bias=False, rng=0)
    >>> x = np.random.default_rng(1).standard_normal((2, 5, 8))
    >>> y = ff(x)
    >>> ff.backward(np.ones_like(y)).shape, sorted(dict(ff.named_parameters()))
    ((2, 5, 8), ['linear1.weight', 'linear2.weight', 'linear3.weight'])
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        activation: str = "relu",
        dropout: float = 0.0,
        bias: bool = True,
        rng=None,
        dtype=np.float64,
    ) -> None:
        super().__init__()
        check_size(d_model, "d_model")
        check_size(d_ff, "d_ff")
        if not isinstance(activation, str) or activation not in _ACTIVATIONS:
            raise ValueError(f"activation: expected one of {sorted(_ACTIVATIONS)}, got {activation!r}")
        check_prob(dropout, "dropout")
        bias = check_bool(bias, "bias")
        rng = as_rng(rng)
        self.activation = activation
        self._dtype = check_dtype(dtype)
        self.linear1 = Linear(d_model, d_ff, bias, rng=rng, dtype=dtype)
        self.linear2 = Linear(d_ff, d_model, bias, rng=rng, dtype=dtype)
        if activation == "swiglu":
            self.linear3 = Linear(d_model, d_ff, bias, rng=rng, dtype=dtype)
        if activation == "xielu":
            self.act_fn = XIELU(dtype=dtype)
        self.dropout = Dropout(dropout, rng=rng)

    def _check_input(self, x, name: str = "x") -> np.ndarray:
        x = as_float(x, name, self.dtype)
        d, d_ff = self.linear1.in_features, self.linear1.out_features
        check_features(x, name, d, f"FeedForward({d}, {d_ff})")
        return x

    @shared_doc(forward_sections=_forward_sections("``(..., d_model)``", "``(..., d_model)``"))
    def forward(self, x) -> np.ndarray:
        """The forward pass: ``linear2(dropout(act(linear1(x))))``.

        <forward_sections>
        """
        return self._forward(self._check_input(x))

    def _forward(self, x: np.ndarray) -> np.ndarray:
        act, _, kwargs = _act(self.activation)
        # A training step's (..., d_ff) arrays come from (and go back to) the module's workspace
        ws = self._workspace() if is_grad_enabled() and self.activation not in ("swiglu", "xielu") else None
        reused: tuple = ()
        if self.activation == "swiglu":  # cache: silu's, silu(a) and b, for the product's gradient
            h, cache = gated_unit("swiglu", self.linear1, self.linear3, x, self)
        elif self.activation == "xielu":  # the child act_fn keeps its own cache
            h, cache = self.act_fn._forward(self.linear1._forward(x)), None
        elif ws is None:
            h, cache = act(self.linear1._forward(x), **kwargs)
        else:
            a = self.linear1._forward(x, out=ws.empty(x.shape[:-1] + (self.linear1.out_features,), x.dtype))
            if self.activation == "relu":  # in place: relu keeps only its mask
                h, cache = K.relu(a, out=a, mask_out=ws.empty(a.shape, bool))
                reused = (a, cache.positive)
            else:
                h, cache = act(a, **kwargs)
                reused = (a,)
        drop = self.dropout.active  # an inactive dropout is skipped: no copy of (..., d_ff) each way
        self.save_for_backward((cache, drop, reused))
        return self.linear2._forward(self.dropout._forward(h) if drop else h)

    def _backward(self, dy: np.ndarray) -> np.ndarray:
        cache, drop, reused = self.pop_saved()
        act_backward = _act(self.activation)[1]
        ws = self._scratch() if reused else None  # the backward's own arrays: shared by all modules
        h_shape = dy.shape[:-1] + (self.linear2.in_features,)
        dh = dh_ws = self.linear2._backward(dy, None if ws is None else ws.empty(h_shape, dy.dtype))
        if drop:
            dh = self.dropout._backward(dh)
        if self.activation == "swiglu":
            return gated_unit_backward("swiglu", self.linear1, self.linear3, dh, cache)
        if self.activation == "xielu":
            return self.linear1._backward(self.act_fn._backward(dh))
        if ws is None:
            return self.linear1._backward(act_backward(dh, cache))
        if self.activation == "relu" and not drop:  # in place on dh, a workspace array
            da = K.relu_backward(dh, cache, out=dh)
        else:
            da = act_backward(dh, cache)
        dx = self.linear1._backward(da)
        ws.give(dh_ws)  # nothing refers to them any more: the next step reuses them
        self._workspace().give(*reused)
        return dx

    def _jvp(self, state, input_tangents, param_tangents):
        """Forward mode, the forward's chain run on tangents: ``ta = linear1'(tx)``, ``th =
        act'(a) * ta`` (swiglu: ``th = silu'(a) ta * b + silu(a) * tb`` with ``tb = linear3'(tx)``),
        the dropout's own mask, then ``linear2'``.  Each child's latest state is this call's."""
        tx = input_tangent(input_tangents, "FeedForward")
        cache, drop, _ = state
        if self.activation == "swiglu":
            th = gated_unit_jvp(self, "swiglu", self.linear1, self.linear3, tx, cache, param_tangents)
        elif self.activation == "xielu":
            ta = self._child_jvp(self.linear1, -1, (tx,), param_tangents)
            th = self._child_jvp(self.act_fn, -1, (ta,), param_tangents)
        else:
            act_jvp = getattr(F, _ACTIVATIONS[self.activation][0] + "_jvp")
            th = act_jvp(cache, self._child_jvp(self.linear1, -1, (tx,), param_tangents))
        if drop:
            th = self._child_jvp(self.dropout, -1, (th,), param_tangents)
        return self._child_jvp(self.linear2, -1, (th,), param_tangents)

    def _backward_jvp(self, state, dy, input_tangents, param_tangents, ddy):
        """Second order: the tangents of the forward's chain first (as ``_jvp``: ``ta``, ``th``,
        the dropout's), then the backward's chain in reverse, each step's ``backward_jvp`` fed
        the tangent of its input and the tangent of its upstream gradient (``linear2``'s, the
        dropout's, ``<act>_backward_jvp``'s or the gated unit's, ``linear1``'s)."""
        tx = input_tangent(input_tangents, "FeedForward", "backward_jvp")
        cache, drop, reused = state
        pt = param_tangents
        kernel = _ACTIVATIONS[self.activation][0]
        if self.activation == "swiglu":
            th, inner = gated_unit_tangents(self, "swiglu", self.linear1, self.linear3, tx, cache, pt)
        elif self.activation == "xielu":
            ta = self._child_jvp(self.linear1, -1, (tx,), pt)
            th = self._child_jvp(self.act_fn, -1, (ta,), pt)
        else:
            ta = self._child_jvp(self.linear1, -1, (tx,), pt)
            th = getattr(K, kernel + "_jvp")(cache, ta)
        th_out = self._child_jvp(self.dropout, -1, (th,), pt) if drop else th
        dh, tdh = self._child_backward_jvp(self.linear2, dy, (th_out,), pt, ddy)
        if drop:
            dh, tdh = self._child_backward_jvp(self.dropout, dh, (th,), pt, tdh)
        if self.activation == "swiglu":
            return gated_unit_backward_jvp(self, "swiglu", self.linear1, self.linear3, dh, tdh, tx, inner, cache, pt)
        if self.activation == "xielu":
            da, tda = self._child_backward_jvp(self.act_fn, dh, (ta,), pt, tdh)
        else:
            da, tda = getattr(K, kernel + "_backward_jvp")(dh, cache, (ta,), tdh)
        result = self._child_backward_jvp(self.linear1, da, (tx,), pt, tda)
        if reused:
            self._workspace().give(*reused)
        return result

    def extra_repr(self):
        """The arguments shown by ``repr(module)``."""
        return f"activation={self.activation!r}"

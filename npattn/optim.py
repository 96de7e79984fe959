"""Optimizers, gradient clipping and a learning-rate schedule, in plain NumPy.

Each optimizer reproduces the single-tensor code path of its ``torch.optim`` namesake (same
formulas, same order of operations), so a NumPy model and its torch twin trained from the same
weights and gradients stay equal to float64 rounding.

Conventions shared by everything here:

* Parameters are updated **in place** (``p.data -= ...``): arrays held elsewhere (a module's
  attributes, a state dict you are comparing against) keep pointing at the live weights.
* Hyper-parameters are validated before any arithmetic and stored as python ``float`` s, so a
  float32 parameter, its gradient and its optimizer state stay float32 (under numpy 2 a
  ``np.float64`` scalar times a float32 array would be float64).
* A parameter whose ``grad`` is ``None`` is skipped by ``step`` (as in torch).

Typical loop::

    opt = AdamW(model, lr=3e-4, weight_decay=0.1)
    sched = WarmupCosine(opt, warmup_steps=100, total_steps=2000)
    for batch in batches:
        opt.zero_grad()
        loss = ...; model.backward(dloss)
        clip_grad_norm_(model, 1.0)
        opt.step()
        sched.step()
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from ._docs import shared_doc
from ._validate import check_bool, check_positive_float, check_size
from .functional._bfloat16 import BFloat16Array
from .nn.module import Parameter

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "clip_grad_norm_", "WarmupCosine"]


# -- argument checks -------------------------------------------------------------------------
def _check_unit_open(x, name: str) -> float:
    """A real number in [0, 1) (momentum, betas)."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name}: expected a float in [0, 1), got {x!r} ({type(x).__name__})")
    x = float(x)
    if not (0.0 <= x < 1.0):  # also catches NaN
        raise ValueError(f"{name}: expected a value in [0, 1), got {x}")
    return x


def _check_betas(betas) -> tuple:
    try:
        b = tuple(betas)
    except TypeError:
        raise TypeError(
            f"betas: expected a pair (beta1, beta2) of floats in [0, 1), got {betas!r} ({type(betas).__name__})"
        ) from None
    if len(b) != 2:
        raise ValueError(f"betas: expected a pair (beta1, beta2), got {len(b)} values: {betas!r}")
    return (_check_unit_open(b[0], "betas[0]"), _check_unit_open(b[1], "betas[1]"))


def _collect_params(params, name: str = "params") -> list:
    """A Module (its ``parameters()``) or an iterable of Parameters -> list without duplicates."""
    if isinstance(params, Parameter):
        raise TypeError(
            f"{name}: expected an iterable of Parameters or a Module, got a single Parameter; wrap it in a list"
        )
    if hasattr(params, "parameters") and callable(params.parameters):
        params = params.parameters()
    if isinstance(params, (str, bytes, np.ndarray)) or not hasattr(params, "__iter__"):
        raise TypeError(f"{name}: expected an iterable of Parameters or a Module, got {type(params).__name__}")
    out, seen = [], set()
    for i, p in enumerate(params):
        if not isinstance(p, Parameter):
            raise TypeError(
                f"{name}: element {i} is {type(p).__name__}, expected npattn.module.Parameter"
                + (" (wrap arrays in Parameter(...))" if isinstance(p, np.ndarray) else "")
            )
        if isinstance(p.data, BFloat16Array):
            raise ValueError(
                f"{name}: element {i} is stored as bfloat16 (CausalLM.from_pretrained(..., weights_dtype='bfloat16'), "
                "for inference); an optimizer updates float weights: load without weights_dtype, or call "
                "model.to(np.float32) first"
            )
        if id(p) not in seen:  # tied weights are listed once, so they are stepped once
            seen.add(id(p))
            out.append(p)
    return out


def _plain(x):
    """State value -> plain python / numpy (copied)."""
    if isinstance(x, np.ndarray):
        return np.array(x, copy=True)
    return x


def _state_array(v, like: np.ndarray, what: str, problems: list):
    """``v`` as a copy of ``like``'s dtype when it is a finite numeric array of ``like``'s shape
    within that dtype's range; else None (what is wrong appended to ``problems``)."""
    try:
        a = np.asarray(v)
    except Exception as e:  # ragged nested lists and the like
        problems.append(f"{what} cannot be converted to an array ({e})")
        return None
    if a.dtype.kind not in "fiu" or a.shape != like.shape:
        problems.append(f"{what} must be a numeric array of shape {like.shape}, got dtype {a.dtype} shape {a.shape}")
        return None
    if a.dtype.kind == "f" and a.dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
        problems.append(f"{what} has dtype {a.dtype}; expected float32 or float64")
        return None
    if not np.isfinite(a).all():
        problems.append(f"{what} holds inf or NaN values")
        return None
    big = float(np.finfo(like.dtype).max)
    if a.size and float(np.abs(a).max()) > big:
        problems.append(f"{what} holds {float(np.abs(a).max()):g}, out of the range of {like.dtype} (max {big:g})")
        return None
    return np.array(a, dtype=like.dtype, copy=True)


# -- docstring parts the optimizers share (npattn._docs.shared_doc) -------------------------
def _raises_and_example(construct: str) -> str:
    """The optimizers' Raises and Examples sections (the example fits a ``Linear`` with
    ``optim.<construct>``), for their docstrings' line ``<raises_and_example>``."""
    return f"""
        Raises
        ------
        TypeError, ValueError
            No parameters, or a hyper-parameter out of range (a negative ``lr``, betas outside
            ``[0, 1)``, ...).

        Examples
        --------
        >>> import numpy as np
        >>> import npattn
        >>> from npattn import optim
        >>> lin = npattn.Linear(3, 1, rng=0)
        >>> opt = optim.{construct}
        >>> x, target = np.ones((4, 3)), np.zeros((4, 1))
        >>> losses = []
        >>> for _ in range(50):
        ...     opt.zero_grad()
        ...     y = lin(x)
        ...     losses.append(float(((y - target) ** 2).mean()))
        ...     _ = lin.backward(2 * (y - target) / y.size)
        ...     opt.step()
        >>> losses[-1] < 0.01 * losses[0]
        True
        """


_ADAM_STEP = """
    m     = beta1 * m + (1 - beta1) * g
    v     = beta2 * v + (1 - beta2) * g * g
    bc1   = 1 - beta1 ** t
    bc2   = 1 - beta2 ** t
    denom = sqrt(v) / sqrt(bc2) + eps
    p    -= (lr / bc1) * m / denom
    """  # Adam's and AdamW's update of the moments and the parameter


# -- base class ----------------------------------------------------------------------------
class Optimizer:
    """Base class: holds the parameter list, the learning rate and per-parameter state.

    ``params`` is a Module (its ``parameters()`` are used) or an iterable of ``Parameter``;
    duplicates (tied weights) are kept once.  ``lr`` is a plain attribute a scheduler may
    reassign (it is validated on assignment).  ``self.state[i]`` is a dict holding the state of
    ``self.params[i]`` (created lazily on its first update).

    Subclasses list their hyper-parameter names in ``_hyper`` (saved by ``state_dict``) and
    implement ``_update(p, grad, state)``.

    Examples
    --------
    >>> import npattn
    >>> from npattn import optim
    >>> opt = optim.SGD(npattn.Linear(2, 2, rng=0), lr=0.1)
    >>> len(opt.params), opt.lr
    (2, 0.1)
    """

    _hyper: tuple = ("lr",)

    def __init__(self, params, lr):
        # validate everything before storing anything
        lr = check_positive_float(lr, "lr", allow_zero=True)
        plist = _collect_params(params)
        if not plist:
            raise ValueError("params: got an empty list of parameters; the optimizer would have nothing to update")
        self.params = plist
        self._lr = lr
        self.state = [dict() for _ in plist]

    def __setattr__(self, name, value):
        """Hyper-parameters (``_hyper``) are validated on assignment as in the constructor
        (``opt.momentum = 5.0`` raises ``ValueError`` and leaves the old value)."""
        if name in type(self)._hyper and name != "lr":
            value = self._validate_hyper(name, value)
            current = {k: self.__dict__[k] for k in type(self)._hyper if k in self.__dict__}
            self._check_combination({**current, name: value}, name)
        object.__setattr__(self, name, value)

    def _check_combination(self, hyper: dict, name: str) -> None:
        """Constraints between hyper-parameters (``hyper`` may lack some during construction)."""

    @property
    def lr(self) -> float:
        """The learning rate (validated on assignment: a finite number >= 0)."""
        return self._lr

    @lr.setter
    def lr(self, value) -> None:
        self._lr = check_positive_float(value, "lr", allow_zero=True)

    def zero_grad(self) -> None:
        """Set every gradient to zero, in place (a ``None`` grad becomes a zero array), and every
        ``grad_tangent`` too when it exists (``backward_jvp`` accumulates into it; a ``None`` one
        stays ``None``): ``Parameter.zero_grad`` of each parameter, as ``Module.zero_grad``."""
        for p in self.params:
            p.zero_grad()

    def step(self) -> None:
        """Apply one update to every parameter with a gradient."""
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            if not isinstance(p.grad, np.ndarray) or p.grad.dtype.kind != "f":
                got = f"dtype {p.grad.dtype}" if isinstance(p.grad, np.ndarray) else type(p.grad).__name__
                raise TypeError(
                    f"{type(self).__name__}.step: parameter {i} has a grad that is not a float array, got {got}"
                )
            if p.grad.shape != p.data.shape:
                raise ValueError(
                    f"{type(self).__name__}.step: parameter {i} has data shape {p.data.shape} "
                    f"but grad shape {p.grad.shape}"
                )
            self._update(p, p.grad, self.state[i])

    def _update(self, p: Parameter, grad: np.ndarray, state: dict) -> None:  # pragma: no cover
        raise NotImplementedError

    # -- state dicts -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """``{"hyper": {name: float | bool}, "state": {index: {key: array | int}}}`` (copies).

        ``index`` is the parameter's position in ``self.params``; only parameters that have
        been updated at least once have an entry.
        """
        hyper = {}
        for k in self._hyper:
            v = getattr(self, k)
            hyper[k] = tuple(v) if isinstance(v, tuple) else v
        state = {i: {k: _plain(v) for k, v in s.items()} for i, s in enumerate(self.state) if s}
        return {"hyper": hyper, "state": state}

    def load_state_dict(self, state_dict) -> None:
        """Restore what ``state_dict`` returned (from an optimizer over same-shaped parameters).

        Atomic: hyper-parameters are re-validated, every index, key and shape is checked first;
        on any problem a ``ValueError``/``TypeError`` says what, and nothing is changed.
        Arrays are copied and cast to their parameter's dtype.
        """
        if not hasattr(state_dict, "keys") or "state" not in state_dict or "hyper" not in state_dict:
            raise TypeError(
                "state_dict: expected a dict with keys 'hyper' and 'state' (as returned by state_dict()), "
                f"got {type(state_dict).__name__}"
            )
        hyper, state = state_dict["hyper"], state_dict["state"]
        for part, value in (("hyper", hyper), ("state", state)):
            if not hasattr(value, "keys") or not hasattr(value, "__getitem__"):
                raise TypeError(
                    f"state_dict: expected {part!r} to be a dict (as returned by state_dict()), "
                    f"got {type(value).__name__}"
                )
        hyper = {k: hyper[k] for k in hyper.keys()}
        unknown = sorted(set(hyper) - set(self._hyper), key=repr)
        if unknown:
            raise ValueError(f"state_dict: unknown hyper-parameters {unknown} for {type(self).__name__}")
        staged_hyper = {k: self._validate_hyper(k, v) for k, v in hyper.items()}
        self._check_combination({**{k: getattr(self, k) for k in self._hyper}, **staged_hyper}, "state_dict")

        problems: list = []
        staged = [entry for key in state.keys() if (entry := self._stage_state(key, state[key], problems))]
        if problems:
            raise ValueError("load_state_dict: nothing was loaded; " + "; ".join(problems))
        for k, v in staged_hyper.items():
            object.__setattr__(self, "_lr" if k == "lr" else k, v)
        self.state = [dict() for _ in self.params]
        for i, new in staged:
            self.state[i] = new

    def _stage_state(self, key, s, problems: list):
        """``(i, state)`` of one entry of a state dict, checked and cast to its parameter's dtype;
        None when its index or keys are wrong (what is wrong appended to ``problems``)."""
        expected = self._state_keys()
        if isinstance(key, bool) or not isinstance(key, (numbers.Integral, str)):
            problems.append(f"state index {key!r} is not an integer")
            return None
        try:
            i = int(key)
        except (TypeError, ValueError):
            problems.append(f"state index {key!r} is not an integer")
            return None
        if not 0 <= i < len(self.params):
            problems.append(f"state index {i} out of range for {len(self.params)} parameters")
            return None
        if not hasattr(s, "keys") or not hasattr(s, "__getitem__"):
            problems.append(f"state {i}: expected a dict with keys {sorted(expected)}, got {type(s).__name__}")
            return None
        s = {k: s[k] for k in s.keys()}
        if set(s) != expected:
            problems.append(f"state {i}: expected keys {sorted(expected)}, got {sorted(s, key=repr)}")
            return None
        new = {}
        for k, v in s.items():
            if k == "step":
                if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral) or v < 1:
                    problems.append(f"state {i}: 'step' must be a positive integer, got {v!r}")
                new[k] = int(v) if isinstance(v, numbers.Integral) else v
            else:
                a = _state_array(v, self.params[i].data, f"state {i}: {k!r}", problems)
                if a is not None:
                    new[k] = a
        return i, new

    def _validated(self, **hyper) -> dict:
        """Every hyper-parameter checked (by ``_validate_hyper``, as on later assignment) before
        anything is stored."""
        return {name: self._validate_hyper(name, value) for name, value in hyper.items()}

    def _init(self, params, hyper: dict) -> None:
        """``Optimizer.__init__`` with the learning rate, then the other validated hyper-parameters."""
        Optimizer.__init__(self, params, hyper["lr"])
        for name, value in hyper.items():
            if name != "lr":
                setattr(self, name, value)

    def _validate_hyper(self, name: str, value):
        if name == "lr":
            return check_positive_float(value, "lr", allow_zero=True)
        raise NotImplementedError  # pragma: no cover - subclasses cover their names

    def _state_keys(self) -> set:  # pragma: no cover - abstract
        raise NotImplementedError

    def __repr__(self):
        hp = ", ".join(f"{k}={getattr(self, k)!r}" for k in self._hyper)
        return f"{type(self).__name__}({len(self.params)} parameters, {hp})"


# -- SGD ------------------------------------------------------------------------------------
@shared_doc(raises_and_example=_raises_and_example("SGD(lin, lr=0.1, momentum=0.9)"))
class SGD(Optimizer):
    r"""Stochastic gradient descent with optional momentum, as ``torch.optim.SGD`` (dampening 0).

    For each parameter ``p`` with gradient ``grad``, at step ``t = 1, 2, ...``::

        g   = grad + weight_decay * p                 # L2 penalty folded into the gradient
        buf = g                      if t == 1        # (only when momentum > 0)
              momentum * buf + g     otherwise
        g   = g + momentum * buf     if nesterov
              buf                    otherwise
        p  -= lr * g

    With ``momentum == 0`` there is no buffer and the update is ``p -= lr * g``.
    ``nesterov=True`` requires ``momentum > 0`` (as in torch).

    <raises_and_example>
    """

    _hyper = ("lr", "momentum", "weight_decay", "nesterov")

    def __init__(self, params, lr, momentum=0.0, weight_decay=0.0, nesterov=False):
        hyper = self._validated(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
        if hyper["nesterov"] and hyper["momentum"] == 0.0:
            raise ValueError("nesterov: Nesterov momentum requires momentum > 0, got momentum=0.0")
        self._init(params, hyper)

    def _validate_hyper(self, name, value):
        if name == "momentum":
            return _check_unit_open(value, "momentum")
        if name == "weight_decay":
            return check_positive_float(value, "weight_decay", allow_zero=True)
        if name == "nesterov":
            return check_bool(value, "nesterov")
        return super()._validate_hyper(name, value)

    def _check_combination(self, hyper, name):
        if hyper.get("nesterov") and hyper.get("momentum", 1.0) == 0.0:
            raise ValueError(f"{name}: Nesterov momentum requires momentum > 0, got nesterov=True with momentum=0.0")

    def _state_keys(self):
        return {"momentum_buffer"}

    def _update(self, p, grad, state):
        lr, mu, wd = self._lr, self.momentum, self.weight_decay
        g = grad + wd * p.data if wd != 0.0 else grad
        if mu != 0.0:
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = np.array(g, dtype=p.data.dtype, copy=True)
            else:
                buf *= mu
                buf += g
            g = g + mu * buf if self.nesterov else buf
        p.data -= lr * g


# -- Adam / AdamW ----------------------------------------------------------------------------
@shared_doc(adam_step=_ADAM_STEP, raises_and_example=_raises_and_example("Adam(lin, lr=0.1)"))
class Adam(Optimizer):
    r"""Adam, as ``torch.optim.Adam`` (L2 weight decay added to the gradient; no amsgrad).

    For each parameter ``p`` with gradient ``grad``, at step ``t = 1, 2, ...`` (``m``, ``v``
    start at zero)::

        g     = grad + weight_decay * p
        <adam_step>

    ``eps`` is added *after* the bias correction of ``sqrt(v)``, exactly as torch does.

    <raises_and_example>
    """

    _hyper = ("lr", "betas", "eps", "weight_decay")
    _decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        self._init(params, self._validated(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def _validate_hyper(self, name, value):
        if name == "betas":
            return _check_betas(value)
        if name == "eps":
            return check_positive_float(value, "eps")
        if name == "weight_decay":
            return check_positive_float(value, "weight_decay", allow_zero=True)
        return super()._validate_hyper(name, value)

    def _state_keys(self):
        return {"step", "exp_avg", "exp_avg_sq"}

    def _update(self, p, grad, state):
        lr, eps, wd = self._lr, self.eps, self.weight_decay
        beta1, beta2 = self.betas
        if not state:
            state["step"] = 0
            state["exp_avg"] = np.zeros_like(p.data)
            state["exp_avg_sq"] = np.zeros_like(p.data)
        state["step"] += 1
        t = state["step"]
        m, v = state["exp_avg"], state["exp_avg_sq"]

        g = grad
        if wd != 0.0:
            if self._decoupled:
                p.data *= 1.0 - lr * wd
            else:
                g = grad + wd * p.data

        m *= beta1
        m += (1.0 - beta1) * g
        v *= beta2
        v += (1.0 - beta2) * (g * g)

        bias_correction1 = 1.0 - beta1**t
        bias_correction2 = 1.0 - beta2**t
        step_size = lr / bias_correction1
        denom = np.sqrt(v)
        denom /= math.sqrt(bias_correction2)
        denom += eps
        p.data -= step_size * (m / denom)


@shared_doc(adam_step=_ADAM_STEP, raises_and_example=_raises_and_example("AdamW(lin, lr=0.1, weight_decay=0.0)"))
class AdamW(Adam):
    r"""AdamW, as ``torch.optim.AdamW``: Adam with *decoupled* weight decay.

    For each parameter ``p`` with gradient ``g``, at step ``t = 1, 2, ...``::

        p    *= 1 - lr * weight_decay                 # decay first, independent of the gradient
        <adam_step>

    <raises_and_example>
    """

    _decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


# -- gradient clipping ---------------------------------------------------------------------
def clip_grad_norm_(params, max_norm, eps: float = 1e-6, error_if_nonfinite: bool = False) -> float:
    r"""Rescale gradients in place so their global L2 norm is at most about ``max_norm``.

    As ``torch.nn.utils.clip_grad_norm_`` (``norm_type=2``)::

        total = sqrt(sum over parameters of sum(grad ** 2))
        coef  = min(max_norm / (total + eps), 1)
        grad *= coef          (every gradient; nothing changes when coef == 1)

    Note that, as in torch, gradients are scaled slightly even when ``total`` is a hair below
    ``max_norm`` (within ``eps``).  The norm is accumulated in float64 whatever the gradient
    dtype; the scaling keeps each gradient's dtype.  ``params`` is a Module or an iterable of
    Parameters; ``None`` gradients are ignored.  Returns the total norm (before clipping) as a
    python float.  If it is not finite the gradients are left untouched (torch would multiply
    them by ``nan``/``0``), or a ``RuntimeError`` is raised with ``error_if_nonfinite=True``.

    Examples
    --------
    >>> import numpy as np
    >>> import npattn
    >>> from npattn import optim
    >>> lin = npattn.Linear(2, 1, bias=False, rng=0)
    >>> lin.weight.grad = np.array([[3.0, 4.0]])
    >>> optim.clip_grad_norm_(lin, max_norm=1.0)          # the norm before clipping
    5.0
    >>> np.round(lin.weight.grad, 4)
    array([[0.6, 0.8]])
    """
    max_norm = check_positive_float(max_norm, "max_norm")
    eps = check_positive_float(eps, "eps", allow_zero=True)
    error_if_nonfinite = check_bool(error_if_nonfinite, "error_if_nonfinite")
    grads = [p.grad for p in _collect_params(params) if p.grad is not None]
    if not grads:
        return 0.0
    sq = 0.0
    with np.errstate(over="ignore"):
        for g in grads:
            flat = g.reshape(-1).astype(np.float64, copy=False)
            sq += float(np.dot(flat, flat))
    total = math.sqrt(sq)
    if math.isinf(total) and all(np.isfinite(g).all() for g in grads):
        # finite gradients whose squares overflow (|g| ~ 1e154 and up): the same norm, rescaled
        amax = max(float(np.abs(g).max(initial=0.0)) for g in grads)
        sq = 0.0
        for g in grads:
            flat = g.reshape(-1).astype(np.float64, copy=False) / amax
            sq += float(np.dot(flat, flat))
        total = amax * math.sqrt(sq)
    if not math.isfinite(total):
        if error_if_nonfinite:
            raise RuntimeError(
                f"clip_grad_norm_: the total norm of the gradients is {total}; "
                "set error_if_nonfinite=False to return it without clipping"
            )
        return total
    coef = max_norm / (total + eps)
    if coef < 1.0:
        for g in grads:
            g *= coef
    return total


# -- learning-rate schedule ----------------------------------------------------------------
class WarmupCosine:
    r"""Linear warm-up, then cosine decay to ``min_lr``; sets ``optimizer.lr`` at every step.

    With ``base_lr`` the optimizer's ``lr`` when the scheduler is built, ``W = warmup_steps``
    and ``T = total_steps``, the learning rate used for optimizer step ``t = 0, 1, 2, ...`` is::

        lr(t) = base_lr * (t + 1) / W                                    for t < W
        lr(t) = min_lr + (base_lr - min_lr) * (1 + cos(pi * (t - W) / (T - W))) / 2
                                                                         for W <= t < T
        lr(t) = min_lr                                                   for t >= T

    So warm-up starts at ``base_lr / W`` (never 0), reaches ``base_lr`` at ``t = W - 1`` and
    ``t = W``, and the cosine arrives at ``min_lr`` at ``t = T``.  ``W = 0`` means no warm-up.

    The constructor sets ``optimizer.lr = lr(0)``; each ``step()`` (call it after
    ``optimizer.step()``) advances ``t`` by one and sets ``optimizer.lr = lr(t)``.

    Examples
    --------
    >>> import npattn
    >>> from npattn import optim
    >>> opt = optim.AdamW(npattn.Linear(2, 2, rng=0), lr=1.0)
    >>> sched = optim.WarmupCosine(opt, warmup_steps=2, total_steps=4)
    >>> lrs = [opt.lr]
    >>> for _ in range(4):
    ...     opt.step()
    ...     _ = sched.step()
    ...     lrs.append(round(opt.lr, 4))
    >>> lrs
    [0.5, 1.0, 1.0, 0.5, 0.0]
    """

    def __init__(self, optimizer, warmup_steps, total_steps, min_lr=0.0):
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"optimizer: expected an npattn.optim.Optimizer, got {type(optimizer).__name__}")
        warmup_steps = check_size(warmup_steps, "warmup_steps", minimum=0)
        total_steps = check_size(total_steps, "total_steps", minimum=1)
        if warmup_steps > total_steps:
            raise ValueError(f"warmup_steps: expected at most total_steps={total_steps}, got {warmup_steps}")
        min_lr = check_positive_float(min_lr, "min_lr", allow_zero=True)
        base_lr = optimizer.lr
        if min_lr > base_lr:
            raise ValueError(f"min_lr: expected at most the optimizer's lr={base_lr}, got {min_lr}")
        self.optimizer = optimizer
        self.base_lr = base_lr
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.min_lr = min_lr
        self.t = 0
        optimizer.lr = self.get_lr(0)

    def get_lr(self, t) -> float:
        """The learning rate for step ``t`` (a pure function of ``t`` and the constructor args)."""
        t = check_size(t, "t", minimum=0)
        W, T = self.warmup_steps, self.total_steps
        if t < W:
            return self.base_lr * (t + 1) / W
        if t >= T:
            return self.min_lr
        progress = (t - W) / (T - W)
        return self.min_lr + (self.base_lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def step(self) -> float:
        """Advance one step, set and return ``optimizer.lr``."""
        self.t += 1
        lr = self.get_lr(self.t)
        self.optimizer.lr = lr
        return lr

    @property
    def lr(self) -> float:
        """The learning rate of the current step."""
        return self.get_lr(self.t)

    def state_dict(self) -> dict:
        """The scheduler's step counter and settings, for ``load_state_dict``.

        Returns
        -------
        dict
            ``t``, ``base_lr``, ``warmup_steps``, ``total_steps``, ``min_lr``.
        """
        return {
            "t": self.t,
            "base_lr": self.base_lr,
            "warmup_steps": self.warmup_steps,
            "total_steps": self.total_steps,
            "min_lr": self.min_lr,
        }

    def load_state_dict(self, state_dict) -> None:
        """Restore the step counter and settings, and set ``optimizer.lr`` accordingly."""
        try:
            t = check_size(state_dict["t"], "t", minimum=0)
            base_lr = check_positive_float(state_dict["base_lr"], "base_lr", allow_zero=True)
            W = check_size(state_dict["warmup_steps"], "warmup_steps", minimum=0)
            T = check_size(state_dict["total_steps"], "total_steps", minimum=1)
            min_lr = check_positive_float(state_dict["min_lr"], "min_lr", allow_zero=True)
        except (KeyError, TypeError) as e:
            raise TypeError(f"state_dict: expected the dict returned by WarmupCosine.state_dict() ({e})") from None
        if W > T or min_lr > base_lr:
            raise ValueError(
                f"state_dict: inconsistent schedule (warmup_steps={W}, total_steps={T}, "
                f"base_lr={base_lr}, min_lr={min_lr})"
            )
        self.t, self.base_lr, self.warmup_steps, self.total_steps, self.min_lr = t, base_lr, W, T, min_lr
        self.optimizer.lr = self.get_lr(t)

    def __repr__(self):
        return (
            f"WarmupCosine(base_lr={self.base_lr}, warmup_steps={self.warmup_steps}, "
            f"total_steps={self.total_steps}, min_lr={self.min_lr}, t={self.t})"
        )

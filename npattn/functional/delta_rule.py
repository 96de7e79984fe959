"""The gated delta rule, chunk by chunk (Qwen3-Next's linear attention), and the two norms around it.

``gated_delta_rule`` gives the numbers of the step-by-step recurrence of
``npattn.functional.reference.gated_delta_rule`` (to 1e-12 in float64), with work linear in ``L``
and no ``(L, L)`` array: the ``L`` steps are cut into chunks of ``C = chunk_size``; everything
inside a chunk that does not depend on the state entering it is computed for a block of chunks
at once (a few batched matrix products and one ``C x C`` triangular inverse per chunk: the WY / UT
transform of DeltaNet), and a loop over the chunks carries the state with two
``(C, Dk) x (Dk, Dv)`` products per chunk.  A block's ``C x C`` arrays hold about ``_BLOCK``
numbers whatever ``L`` is, so they stay in the CPU's cache (the time per step does not grow with
``L``) and the scratch memory of a call is bounded.

The chunk form (one head; ``S`` the state entering the chunk, rows ``i, j = 1..C`` the chunk's
steps; ``q`` already scaled, ``k`` already normalised):

    gamma_i = g_1 + ... + g_i           the decay from the chunk's start, in log space
    a_i = e^{gamma_i},  b_i = e^{gamma_C - gamma_i},  Gam_ij = e^{gamma_i - gamma_j} (j <= i, else 0)

The recurrence's state after step i is ``S_i = a_i S + sum_{j<=i} Gam_ij k_j u_j^T`` (each write
decays from its own step on).  Step i's delta ``u_i = beta_i (v_i - (e^{g_i} S_{i-1})^T k_i)``
then reads

    u_i + sum_{j<i} beta_i Gam_ij (k_i . k_j) u_j = beta_i v_i - beta_i a_i S^T k_i,

a unit lower-triangular system ``(I + M) U = R`` with ``M_ij = beta_i Gam_ij (k_i . k_j)`` (j < i).
With ``T = (I + M)^{-1}`` (the UT transform) ``U = W_v - W_k S``, ``W_v = T diag(beta) V``,
``W_k = T diag(beta a) K``: neither depends on ``S``.  Then

    O  = diag(a) Q S + P U,      P = (Q K^T) * Gam   (lower triangle, diagonal included)
    S' = a_C S + (diag(b) K)^T U                     (the state leaving the chunk)

Two things keep these numbers those of the recurrence where floating point could make them differ:

* every exponent is a sum of the ``g`` it spans (``gamma_i - gamma_j = g_{j+1} + ... + g_i``,
  ``segment_sums``), never a difference of two running sums, which would lose the weak decays'
  digits after a strong one in float32 and turn a reset ``g = -inf`` into ``-inf - -inf``;
* the products with the triangular ``T`` and ``P`` never multiply their zeros by an inf or NaN
  (``triangular_matmul``), so a non-finite value at step t reaches exactly what it reaches in the
  recurrence (no output before t, no gradient after t from ``dout``).

Backward (derived beside ``_chunked_backward``): the adjoint of the state runs the chunks in
reverse, ``dS = a_C dS' + (diag(a) Q)^T dO - W_k^T (P^T dO + diag(b) K dS')``; everything else is
again computed for a block of chunks at once from the states at the chunks' starts, which are all the
forward keeps (``(L / C) Dk Dv`` numbers per head) beside its inputs.

Also here: ``l2_norm`` (``x / sqrt(sum x^2 + eps)``, the q/k normalisation) and
``rms_norm_gated`` (``RMSNorm(x) * weight * silu(gate)``), both built on ``rms_norm``'s kernels.
"""

from __future__ import annotations

import math
import textwrap
from typing import Callable, NamedTuple, Optional

import numpy as np

from .._docs import shared_doc, tiers_examples
from .._validate import (
    as_float,
    as_floats_of_one_dtype,
    check_backward_jvp,
    check_bool,
    check_cache,
    check_grad,
    check_positive_float,
    check_size,
    check_tangents_as,
)
from .activation import SiluCache, silu_backward_jvp_kernel, silu_backward_kernel, silu_jvp_kernel, silu_kernel
from .norm import (
    RMSNormCache,
    rms_norm_backward_jvp_kernel,
    rms_norm_backward_kernel,
    rms_norm_jvp_kernel,
    rms_norm_kernel,
)

__all__ = [
    "gated_delta_rule",
    "gated_delta_rule_backward",
    "gated_delta_rule_jvp",
    "gated_delta_rule_backward_jvp",
    "GatedDeltaRuleCache",
    "l2_norm",
    "l2_norm_backward",
    "l2_norm_jvp",
    "l2_norm_backward_jvp",
    "rms_norm_gated",
    "rms_norm_gated_backward",
    "rms_norm_gated_jvp",
    "rms_norm_gated_backward_jvp",
]

QK_EPS = 1e-6  # the eps of transformers' / FLA's l2norm of q and k


# ------------------------------------------------------------------------------------- l2_norm


class L2NormCache(NamedTuple):
    norm: RMSNormCache  # rms_norm's cache of x with eps / N
    root_n: float  # sqrt(N)


#: The two normalisations' ``Returns`` and the head of their ``Raises`` (each one's errors follow).
_Y_CACHE_RAISES = """
    Returns
    -------
    (y, cache)

    Raises
    ------
    TypeError, ValueError
    """


@shared_doc(y_cache_raises=_Y_CACHE_RAISES)
def l2_norm(x: np.ndarray, eps: float = 1e-6) -> tuple[np.ndarray, L2NormCache]:
    """``y = x / sqrt(sum(x^2) + eps)`` over the last axis (transformers' ``l2norm``, eps 1e-6).

    Parameters
    ----------
    x : ndarray ``(..., N)``
    eps : float, >= 0

    <y_cache_raises>
        For a non-float ``x``, a 0-d ``x`` or an empty last axis, a negative or non-finite ``eps``.

    <examples>
    >>> y, cache = F.l2_norm(np.array([[3.0, 4.0]]), eps=0.0)
    >>> y
    array([[0.6, 0.8]])
    """
    x = as_float(x, "x")
    _check_rows(x, "x")
    return l2_norm_kernel(x, check_positive_float(eps, "eps", allow_zero=True))


def _check_rows(x, name):
    if x.ndim < 1 or x.shape[-1] < 1:
        raise ValueError(f"{name}: expected shape (..., N) with N >= 1, got {x.shape}")


def l2_norm_kernel(x, eps=1e-6):
    """``sum(x^2) + eps = N (mean(x^2) + eps / N)``, so ``l2_norm(x) = rms_norm(x, eps / N) / sqrt(N)``."""
    n = x.shape[-1]
    y, cache = rms_norm_kernel(x, None, eps / n, normalized_shape=(n,))
    root_n = math.sqrt(n)
    y /= root_n
    return y, L2NormCache(cache, root_n)


def l2_norm_backward(dout: np.ndarray, cache: L2NormCache) -> np.ndarray:
    """``y = rms_norm(x, eps / N) / sqrt(N)``: ``dx = rms_norm_backward(dy / sqrt(N))``, which is
    ``r (dy - y (y . dy))`` with ``r = (sum x^2 + eps)^(-1/2)`` (the part of dy along y removed).

    Returns
    -------
    dx : ndarray
    """
    check_cache(cache, L2NormCache, "l2_norm_backward")
    return l2_norm_backward_kernel(check_grad(dout, cache.norm.xhat.shape, cache.norm.xhat.dtype), cache)


def l2_norm_backward_kernel(dout, cache):
    return rms_norm_backward_kernel(dout / cache.root_n, cache.norm)[0]


def l2_norm_jvp(cache: L2NormCache, *tangents) -> np.ndarray:
    """Forward mode of ``l2_norm``: the Jacobian ``r (I - y y^T)`` is symmetric, so
    ``ty = r (tx - y (y . tx))``, the backward's formula with ``tx`` for ``dout``.

    Parameters
    ----------
    cache : L2NormCache
    *tangents : ndarray or None
        ``tx`` (x's shape; None: zero).

    Returns
    -------
    ty : ndarray
    """
    check_cache(cache, L2NormCache, "l2_norm_jvp")
    return l2_norm_jvp_kernel(
        cache, *check_tangents_as(tangents, "l2_norm_jvp", cache.norm.xhat.dtype, _l2_specs(cache))
    )


def _l2_specs(cache):
    return (("tx", cache.norm.xhat.shape),)


def l2_norm_jvp_kernel(cache, tx=None):
    return np.zeros(cache.norm.xhat.shape, cache.norm.xhat.dtype) if tx is None else l2_norm_backward_kernel(tx, cache)


def l2_norm_backward_jvp(dout: np.ndarray, cache: L2NormCache, tangents, ddout=None):
    """Second order of ``l2_norm``: ``y = rms_norm(x, eps / N) / sqrt(N)``, so the backward is
    ``rms_norm_backward(dy / sqrt(N))`` and its tangent ``rms_norm_backward_jvp``'s along
    ``(tx,)`` and ``ddout / sqrt(N)``: with ``r = (sum x^2 + eps)^(-1/2)``, ``dx = r (dy - y (y .
    dy))``, ``ty = r (tx - y (y . tx))`` and ``tr = -r^2 (y . tx)``,

        tdx = (tr / r) dx + r (ddy - y (y . ddy)) - r (ty (y . dy) + y (ty . dy)).

    Parameters
    ----------
    dout, cache, tangents, ddout
        As ``l2_norm_backward`` and ``l2_norm_jvp`` take them: ``tangents = (tx,)``; None: zero.

    Returns
    -------
    (dx, tdx)
        ``dx`` exactly ``l2_norm_backward(dout, cache)``, ``tdx`` its tangent.
    """
    check_cache(cache, L2NormCache, "l2_norm_backward_jvp")
    xhat = cache.norm.xhat
    dout, tangents, ddout = check_backward_jvp(
        dout, tangents, ddout, "l2_norm_backward_jvp", xhat.shape, xhat.dtype, _l2_specs(cache)
    )
    return l2_norm_backward_jvp_kernel(dout, cache, tangents, ddout)


def l2_norm_backward_jvp_kernel(dout, cache, tangents=(None,), ddout=None):
    root = cache.root_n
    (dx, _), (tdx, _) = rms_norm_backward_jvp_kernel(
        dout / root, cache.norm, (tangents[0], None), None if ddout is None else ddout / root
    )
    return dx, tdx


# ------------------------------------------------------------------------------- rms_norm_gated


class RMSNormGatedCache(NamedTuple):
    normed: np.ndarray  # RMSNorm(x) * weight
    sig: np.ndarray  # silu(gate)
    norm: RMSNormCache
    gate: SiluCache


@shared_doc(y_cache_raises=_Y_CACHE_RAISES)
def rms_norm_gated(
    x: np.ndarray, gate: np.ndarray, weight: np.ndarray, eps: float = 1e-6
) -> tuple[np.ndarray, RMSNormGatedCache]:
    """``y = x / sqrt(mean(x^2) + eps) * weight * silu(gate)`` over the last axis (norm, then gate).

    As transformers' ``Qwen3NextRMSNormGated``, which upcasts to float32 for the norm and the
    gate: here every step runs in x's own dtype (the same numbers for float32 input, more exact
    ones for float64).

    Parameters
    ----------
    x, gate : ndarray ``(..., D)``, the same shape
    weight : ndarray ``(D,)``
    eps : float, >= 0 (Qwen3-Next's ``rms_norm_eps``, 1e-6)

    <y_cache_raises>
        Naming the argument: non-float arrays, shapes that do not fit, a bad ``eps``.

    <examples>
    >>> x, gate = np.array([[3.0, 4.0]]), np.array([[0.0, 100.0]])
    >>> y, cache = F.rms_norm_gated(x, gate, np.ones(2), eps=0.0)
    >>> np.round(y, 4)                  # rms_norm(x) * silu(gate): silu(0) = 0, silu(100) = 100
    array([[  0.    , 113.1371]])
    """
    x = as_float(x, "x")
    _check_rows(x, "x")
    gate = as_float(gate, "gate", x.dtype)
    if gate.shape != x.shape:
        raise ValueError(f"gate: expected x's shape {x.shape}, got {gate.shape}")
    weight = as_float(weight, "weight", x.dtype)
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight: expected shape ({x.shape[-1]},) (x's last dimension), got {weight.shape}")
    return rms_norm_gated_kernel(x, gate, weight, check_positive_float(eps, "eps", allow_zero=True))


def rms_norm_gated_kernel(x, gate, weight, eps=1e-6):
    normed, norm_cache = rms_norm_kernel(x, weight, eps, normalized_shape=x.shape[-1:])
    sig, gate_cache = silu_kernel(gate)
    return normed * sig, RMSNormGatedCache(normed, sig, norm_cache, gate_cache)


def rms_norm_gated_backward(dout: np.ndarray, cache: RMSNormGatedCache) -> tuple[np.ndarray, ...]:
    """``y = n * s``, ``n = RMSNorm(x) * weight``, ``s = silu(gate)``: the gradient at n is
    ``dy * s`` (rms_norm's backward then gives dx and dweight), at s it is ``dy * n`` (silu's
    backward gives dgate).

    Returns
    -------
    (dx, dgate, dweight)
    """
    check_cache(cache, RMSNormGatedCache, "rms_norm_gated_backward")
    return rms_norm_gated_backward_kernel(check_grad(dout, cache.normed.shape, cache.normed.dtype), cache)


def rms_norm_gated_backward_kernel(dout, cache):
    normed, sig, norm_cache, gate_cache = cache
    dx, dweight = rms_norm_backward_kernel(dout * sig, norm_cache)
    return dx, silu_backward_kernel(dout * normed, gate_cache), dweight


def rms_norm_gated_jvp(cache: RMSNormGatedCache, *tangents) -> np.ndarray:
    """Forward mode of ``rms_norm_gated``: ``y = n * s``, so ``ty = tn * s + n * ts`` with ``tn``
    rms_norm's JVP along ``(tx, tweight)`` and ``ts`` silu's along ``tgate``.

    Parameters
    ----------
    cache : RMSNormGatedCache
    *tangents : ndarray or None
        ``(tx, tgate, tweight)``, the backward's order; None or left out: zero.

    Returns
    -------
    ty : ndarray
    """
    check_cache(cache, RMSNormGatedCache, "rms_norm_gated_jvp")
    specs = _gated_specs(cache)
    return rms_norm_gated_jvp_kernel(
        cache, *check_tangents_as(tangents, "rms_norm_gated_jvp", cache.normed.dtype, specs)
    )


def _gated_specs(cache):
    shape = cache.normed.shape
    return (("tx", shape), ("tgate", shape), ("tweight", shape[-1:]))


def rms_norm_gated_jvp_kernel(cache, tx=None, tgate=None, tweight=None):
    normed, sig, norm_cache, gate_cache = cache
    ty = rms_norm_jvp_kernel(norm_cache, tx, tweight)
    ty *= sig
    if tgate is not None:
        ty += normed * silu_jvp_kernel(gate_cache, tgate)
    return ty


def rms_norm_gated_backward_jvp(dout: np.ndarray, cache: RMSNormGatedCache, tangents, ddout=None):
    """Second order of ``rms_norm_gated``: ``y = n * s`` with ``n = RMSNorm(x) * weight``, ``s =
    silu(gate)``; the backward hands ``dy * s`` to rms_norm's backward (dx, dweight) and ``dy * n``
    to silu's (dgate).  Along ``(tx, tgate, tweight)`` and ``ddout`` those two upstream gradients
    move by ``ddy * s + dy * ts`` and ``ddy * n + dy * tn`` (``ts`` silu's JVP along ``tgate``,
    ``tn`` rms_norm's along ``(tx, tweight)``), so the tangents are rms_norm's second order along
    ``((tx, tweight), ddy * s + dy * ts)`` and silu's along ``((tgate,), ddy * n + dy * tn)``.

    Parameters
    ----------
    dout, cache, tangents, ddout
        As ``rms_norm_gated_backward`` and ``rms_norm_gated_jvp`` take them: ``tangents = (tx,
        tgate, tweight)``; None (or left out at the end): zero.

    Returns
    -------
    ((dx, dgate, dweight), (tdx, tdgate, tdweight))
        The gradients exactly ``rms_norm_gated_backward(dout, cache)``, then their tangents.
    """
    check_cache(cache, RMSNormGatedCache, "rms_norm_gated_backward_jvp")
    shape, dtype = cache.normed.shape, cache.normed.dtype
    dout, tangents, ddout = check_backward_jvp(
        dout, tangents, ddout, "rms_norm_gated_backward_jvp", shape, dtype, _gated_specs(cache)
    )
    return rms_norm_gated_backward_jvp_kernel(dout, cache, tangents, ddout)


def rms_norm_gated_backward_jvp_kernel(dout, cache, tangents, ddout=None):
    normed, sig, norm_cache, gate_cache = cache
    tx, tgate, tweight = tangents
    ts = None if tgate is None else silu_jvp_kernel(gate_cache, tgate)
    tn = None if tx is None and tweight is None else rms_norm_jvp_kernel(norm_cache, tx, tweight)
    (dx, dweight), (tdx, tdweight) = rms_norm_backward_jvp_kernel(
        dout * sig, norm_cache, (tx, tweight), _sum_of(ddout, sig, dout, ts)
    )
    dgate, tdgate = silu_backward_jvp_kernel(dout * normed, gate_cache, (tgate,), _sum_of(ddout, normed, dout, tn))
    return (dx, dgate, dweight), (tdx, tdgate, tdweight)


def _sum_of(a, b, c, d):
    """``a * b + c * d`` where a None factor makes its product zero; None when both are."""
    terms = [u * v for u, v in ((a, b), (c, d)) if u is not None and v is not None]
    return None if not terms else terms[0] if len(terms) == 1 else terms[0] + terms[1]


# ----------------------------------------------------------------------------- gated_delta_rule


class DeltaRuleCache(NamedTuple):
    """The fields of the chunked delta rules' caches (``GatedDeltaRuleCache``, and
    ``kda.KimiDeltaAttentionCache`` with a log decay per key channel), written once: the inputs as
    used and the chunks' start states.  Each rule's cache is its own subclass, so a backward
    refuses the other rule's."""

    q: np.ndarray  # (B..., H, L, Dk) normalised (use_qk_l2norm) and scaled
    k: np.ndarray  # (B..., H, L, Dk) normalised (use_qk_l2norm)
    v: np.ndarray  # (B..., H, L, Dv)
    g: np.ndarray  # (B..., H, L), or (B..., H, L, Dk): one log decay per key channel
    beta: np.ndarray  # (B..., H, L)
    states: np.ndarray  # (B..., H, N, Dk, Dv): the state entering each of the N chunks
    chunk: int  # C, the chunk length used
    scale: float
    q_norm: Optional[L2NormCache]  # with use_qk_l2norm
    k_norm: Optional[L2NormCache]
    has_initial_state: bool
    final_state: Optional[np.ndarray]  # (B..., H, Dk, Dv) with output_final_state, else None


class GatedDeltaRuleCache(DeltaRuleCache):
    """What ``gated_delta_rule_backward`` needs: the inputs as used and the chunks' start states
    (``DeltaRuleCache``'s fields, ``g (B..., H, L)``)."""

    __slots__ = ()


#: The parts of the chunked rules' forward docstrings that ``gated_delta_rule`` and
#: ``kda.kimi_delta_attention`` share (``<rule_qkv>``, ``<rule_options>``, ``<rule_returns>``,
#: ``<rule_examples>``); each rule writes its own ``g`` and the rest.
RULE_FORWARD_DOC = {
    "rule_qkv": """
        q, k : ndarray ``(B..., H, L, Dk)``
        v : ndarray ``(B..., H, L, Dv)``
        """,
    "rule_options": """
        initial_state : ndarray ``(B..., H, Dk, Dv)``, optional
        output_final_state : bool
            Keep the final state as ``cache.final_state`` (else it is None).
        use_qk_l2norm : bool
            Normalise q and k first: ``x / sqrt(sum(x^2) + 1e-6)`` over ``Dk``.
        chunk_size : int >= 1
            Steps per chunk (``min(chunk_size, L)`` is used); any value gives the same numbers.
        """,
    "rule_returns": """
        Returns
        -------
        (out, cache)
            ``out (B..., H, L, Dv)`` in the inputs' float dtype (integer inputs take it; mixed float dtypes raise).

        Raises
        ------
        TypeError, ValueError
            Naming the argument, before any arithmetic: non-float arrays, shapes that do not fit
            (expected vs actual), ``L = 0``, a bad ``scale`` or ``chunk_size``, non-bool flags.
        """,
    "rule_examples": tiers_examples("The chunked form gives the textbook recurrence's numbers:").rstrip()
    + """
    >>> q, k, v = (rng.standard_normal((1, 2, 10, 4)) for _ in range(3))      # (batch, heads, L, d)
    """,
}


def rule_backward_doc(cache: str) -> dict:
    """The ``Parameters`` and the head of the ``Returns`` of a chunked rule's backward (``<rule_backward>``)
    whose cache is of class ``cache``."""
    return {
        "rule_backward": f"""
        Parameters
        ----------
        dout : ndarray ``(B..., H, L, Dv)``
        cache : {cache}
        dfinal_state : ndarray ``(B..., H, Dk, Dv)``, optional
            The gradient reaching the final state (e.g. from a later segment); zero if None.

        Returns
        -------
        (dq, dk, dv, dg, dbeta, dinitial_state)
        """
    }


def rule_jvp_doc(cache: str) -> dict:
    """The ``Parameters`` and ``Returns`` of a chunked rule's ``_jvp`` (``<rule_jvp>``) whose cache is
    of class ``cache``."""
    return {
        "rule_jvp": f"""
        Parameters
        ----------
        cache : {cache}
        *tangents : ndarray or None
            ``(tq, tk, tv, tg, tbeta, tinitial_state)``, the backward's order, each of its input's
            shape; None or left out: zero (``tinitial_state`` must be None without an initial state).

        Returns
        -------
        tout, or (tout, tfinal_state)
            The latter when the forward kept the final state.
        """
    }


def rule_backward_jvp_doc(op: str) -> dict:
    """The ``Parameters``, ``Returns`` and ``Raises`` of a chunked rule ``op``'s ``_backward_jvp``
    (``<rule_backward_jvp>``)."""
    grads = (
        f"``grads`` exactly ``{op}_backward(dout, cache, dfinal_state)``, ``grad_tangents`` their tangents"
        " in the same order (``dinitial_state``'s None without an initial state)."
    )
    tangents = (
        f"``(tq, tk, tv, tg, tbeta, tinitial_state)``, ``{op}_jvp``'s order; None or left out: zero"
        " (``tinitial_state`` must be None without an initial state)."
    )

    def wrap(text: str) -> str:  # an entry's description, as the pairs' docstrings wrap it (col 100)
        return "\n".join(textwrap.wrap(text, 92, break_long_words=False, break_on_hyphens=False)).replace(
            "\n", "\n" + " " * 12
        )

    return {
        "rule_backward_jvp": f"""
        Parameters
        ----------
        dout, cache, dfinal_state
            As ``{op}_backward`` takes them.
        tangents : tuple or None
            {wrap(tangents)}
        ddout : ndarray of ``dout``'s shape, optional
        ddfinal_state : ndarray of the final state's shape, optional
            The tangents of ``dout`` and ``dfinal_state`` (None: zero).

        Returns
        -------
        (grads, grad_tangents)
            {wrap(grads)}

        Raises
        ------
        TypeError, ValueError
            Naming the argument: a wrong cache, shapes that do not fit, too many tangents.
        """
    }


def state_shape(c: DeltaRuleCache) -> tuple:
    """The state's shape ``(B..., H, Dk, Dv)`` of a chunked rule's cache."""
    return c.states.shape[:-3] + c.states.shape[-2:]


def tangent_specs(c: DeltaRuleCache) -> tuple:
    """The tangents' names and shapes, in the backward's order (``check_tangents_as``'s specs)."""
    return (
        ("tq", c.q.shape),
        ("tk", c.k.shape),
        ("tv", c.v.shape),
        ("tg", c.g.shape),
        ("tbeta", c.beta.shape),
        ("tinitial_state", state_shape(c), c.has_initial_state),
    )


def checked_backward(op: str, cache, cache_type: type, dout, dfinal_state) -> tuple:
    """The checks of a chunked rule's backward ``op`` (the cache of ``cache_type``, ``dout`` of
    ``v``'s shape, ``dfinal_state`` of the state's), before any arithmetic: ``(dout, dfinal_state)``."""
    check_cache(cache, cache_type, op)
    dtype = cache.v.dtype
    dout = check_grad(dout, cache.v.shape, dtype)
    if dfinal_state is not None:
        dfinal_state = check_grad(dfinal_state, state_shape(cache), dtype, "dfinal_state")
    return dout, dfinal_state


def checked_backward_jvp(op: str, cache, cache_type: type, dout, tangents, ddout, dfinal_state, ddfinal_state):
    """The checks of a chunked rule's second order ``op``, before any arithmetic: ``(dout,
    tangents, ddout, dfinal_state, ddfinal_state)``, each checked (None stays None)."""
    check_cache(cache, cache_type, op)
    dtype = cache.v.dtype
    dout, tangents, ddout = check_backward_jvp(dout, tangents, ddout, op, cache.v.shape, dtype, tangent_specs(cache))
    dfinal_state, ddfinal_state = (
        None if x is None else check_grad(x, state_shape(cache), dtype, name)
        for x, name in ((dfinal_state, "dfinal_state"), (ddfinal_state, "ddfinal_state"))
    )
    return dout, tangents, ddout, dfinal_state, ddfinal_state


@shared_doc(**RULE_FORWARD_DOC)
def gated_delta_rule(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    g: np.ndarray,
    beta: np.ndarray,
    *,
    scale: Optional[float] = None,
    initial_state: Optional[np.ndarray] = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
) -> tuple[np.ndarray, GatedDeltaRuleCache]:
    """The gated delta rule (Qwen3-Next's linear attention), computed chunk by chunk.

    From ``S_0 = initial_state`` (zeros if None), for each step t:
    ``S = exp(g_t) S``; ``S = S + k_t (beta_t (v_t - k_t^T S))^T``; ``o_t = q_t^T S`` (the
    recurrence of ``npattn.functional.reference.gated_delta_rule`` and of transformers'
    ``torch_recurrent_gated_delta_rule``), in chunks of ``chunk_size`` steps (see the module
    docstring).  Work and memory are linear in ``L``.

    Parameters
    ----------
    <rule_qkv>
    g : ndarray ``(B..., H, L)``
        Log decays (``<= 0`` in Qwen3-Next: the state is multiplied by ``exp(g_t)``).
    beta : ndarray ``(B..., H, L)``
        Write strengths (``sigmoid(b)`` in Qwen3-Next).
    scale : float > 0, optional
        Multiplies q (after the normalisation); default ``1 / sqrt(Dk)``.
    <rule_options>

    <rule_returns>

    <rule_examples>
    >>> g, beta = -rng.random((1, 2, 10)), rng.random((1, 2, 10))             # log-decay <= 0, beta in [0, 1]
    >>> out, cache = F.gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True, chunk_size=4)
    >>> ref, _ = R.gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True)
    >>> out.shape, bool(np.allclose(out, ref, rtol=0, atol=1e-10))
    ((1, 2, 10, 4), True)
    >>> len(F.gated_delta_rule_backward(rng.standard_normal(out.shape), cache))   # dq, dk, dv, dg, dbeta, dS0
    6
    """
    kw = dict(initial_state=initial_state, output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm)
    arrays, options = checked_inputs(q, k, v, g, beta, scale=scale, chunk_size=chunk_size, **kw)
    return gated_delta_rule_kernel(*arrays, **options)


def checked_inputs(
    q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm, chunk_size, per_channel=False
):
    """The checks of ``gated_delta_rule`` (and, ``per_channel``: ``g`` of q's shape, one log decay
    per key channel, of ``kda.kimi_delta_attention``), before any arithmetic: ``((q, k, v, g,
    beta), options)``, the arrays of one float dtype, the options the kernel's keywords (``scale``
    resolved, ``initial_state`` in that dtype)."""
    # mixed float dtypes: TypeError, as the attention cores (a silent cast would hide float64 inputs)
    q, k, v, g, beta = as_floats_of_one_dtype(("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta))
    dtype = q.dtype
    if q.ndim < 3:
        raise ValueError(f"q: expected shape (..., H, L, Dk), got {q.shape}")
    lead, steps, dk = q.shape[:-2], q.shape[-2], q.shape[-1]
    if steps < 1 or dk < 1:
        raise ValueError(f"q: expected at least 1 step and 1 feature in (..., H, L, Dk), got {q.shape}")
    if k.shape != q.shape:
        raise ValueError(f"k: expected q's shape {q.shape}, got {k.shape}")
    if v.ndim != q.ndim or v.shape[:-1] != q.shape[:-1] or v.shape[-1] < 1:
        raise ValueError(f"v: expected shape {q.shape[:-1] + ('Dv',)} with Dv >= 1, got {v.shape}")
    g_shape = (q.shape, "q's: a log decay per key channel") if per_channel else (q.shape[:-1], "q's without Dk")
    for a, name, (want, what) in ((g, "g", g_shape), (beta, "beta", (q.shape[:-1], "q's without Dk"))):
        if a.shape != want:
            raise ValueError(f"{name}: expected shape {want} ({what}), got {a.shape}")
    scale = 1.0 / math.sqrt(dk) if scale is None else check_positive_float(scale, "scale")
    if initial_state is not None:
        initial_state = as_float(initial_state, "initial_state").astype(dtype, copy=False)
        want = lead + (dk, v.shape[-1])
        if initial_state.shape != want:
            raise ValueError(f"initial_state: expected shape {want} (..., H, Dk, Dv), got {initial_state.shape}")
    options = dict(
        scale=scale,
        initial_state=initial_state,
        output_final_state=check_bool(output_final_state, "output_final_state"),
        use_qk_l2norm=check_bool(use_qk_l2norm, "use_qk_l2norm"),
        chunk_size=check_size(chunk_size, "chunk_size"),
    )
    return (q, k, v, g, beta), options


def gated_delta_rule_kernel(
    q, k, v, g, beta, *, scale, initial_state=None, output_final_state=False, use_qk_l2norm=False, chunk_size=64
):
    """The kernel of ``gated_delta_rule`` (arguments checked, one dtype, ``scale`` resolved)."""
    return chunked_forward(
        _RULE,
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm=use_qk_l2norm,
        chunk_size=chunk_size,
    )


def chunked_forward(rule, q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm, chunk_size):
    """The chunked forward of ``rule`` (this rule's ``_RULE``, or ``kda``'s): q and k normalised
    (``use_qk_l2norm``), q scaled, then per group of batch rows the blocks of chunks in order, the
    state carried by ``_scan``, ``O = diag(a) Q S + P U`` (``(A * Q) S + P U`` with a decay per
    channel).  Returns ``(out, rule.cache(...))``."""
    q_norm = k_norm = None
    if use_qk_l2norm:
        q, q_norm = l2_norm_kernel(q, QK_EPS)
        k, k_norm = l2_norm_kernel(k, QK_EPS)
        q *= scale  # q is l2_norm's fresh output
    else:
        q = q * scale
    lead, steps, dk, dv = q.shape[:-2], q.shape[-2], q.shape[-1], v.shape[-1]
    chunk = min(chunk_size, steps)
    chunks = rule.chunked(steps, chunk, q, k, v, g, beta)
    rows, n = chunks[0].shape[:2]
    s0 = np.zeros((rows, dk, dv), q.dtype) if initial_state is None else initial_state.reshape(rows, dk, dv)
    states = np.empty((rows, n, dk, dv), q.dtype)
    out = np.empty(chunks[2].shape, q.dtype)
    final = np.empty((rows, dk, dv), q.dtype)
    for rs, blocks in rule.groups(rows, n, chunk, dk):
        s = s0[rs]
        for blk in blocks:
            terms = rule.terms(*(x[rs, blk] for x in chunks))
            states[rs, blk], u, s = _scan(terms, s)
            out[rs, blk] = terms.qa @ states[rs, blk] + triangular_matmul(terms.p, u)  # O = diag(a) Q S + P U
        final[rs] = s
    out = out.reshape(rows, -1, dv)[:, :steps].reshape(lead + (steps, dv))
    return out, rule.cache(
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        states=states.reshape(lead + (n, dk, dv)),
        chunk=chunk,
        scale=scale,
        q_norm=q_norm,
        k_norm=k_norm,
        has_initial_state=initial_state is not None,
        final_state=final.reshape(lead + (dk, dv)) if output_final_state else None,
    )


class _Chunks(NamedTuple):
    """The state-independent quantities of every chunk (``rows`` = batch x heads, ``N`` chunks)."""

    q: np.ndarray  # (rows, N, C, Dk) scaled q, zero-padded to N * C steps
    k: np.ndarray  # (rows, N, C, Dk)
    v: np.ndarray  # (rows, N, C, Dv)
    beta: np.ndarray  # (rows, N, C)
    a: np.ndarray  # (rows, N, C) e^{gamma_i}
    b: np.ndarray  # (rows, N, C) e^{gamma_C - gamma_i} = e^{g_{i+1} + ... + g_C}
    gam: np.ndarray  # (rows, N, C, C) e^{gamma_i - gamma_j} = e^{g_{j+1} + ... + g_i} for j <= i, 0 above
    kk: np.ndarray  # (rows, N, C, C) k_i . k_j for j <= i, 0 above the diagonal
    qk: np.ndarray  # (rows, N, C, C) q_i . k_j for j <= i, 0 above the diagonal
    t: Optional[np.ndarray]  # (rows, N, C, C) (I + M)^{-1}, the UT transform (None in the tangents: m)
    p: np.ndarray  # (rows, N, C, C) (Q K^T) * Gam
    qa: np.ndarray  # (rows, N, C, Dk) diag(a) Q
    kb: np.ndarray  # (rows, N, C, Dk) diag(b) K
    wv: np.ndarray  # (rows, N, C, Dv) T diag(beta) V
    wk: np.ndarray  # (rows, N, C, Dk) T diag(beta a) K
    # the terms' tangents (``_term_tangents``) carry tM, the tangent of M, and no tT = -T tM T:
    # every product with tT is one with T and tM (``tT X = -T tM W`` for ``W = T X``)
    m: Optional[np.ndarray] = None  # (rows, N, C, C) strictly lower


_BLOCK = 1 << 18  # elements of one (rows, chunks, C, C) array of a block of chunks (1-2 MiB)


def chunk_blocks(rows, n, chunk):
    """The chunks ``0 .. n-1`` in blocks (slices) small enough that a block's ``(rows, chunks, C, C)``
    arrays hold about ``_BLOCK`` elements: they stay in the CPU's cache, so the time per step does
    not grow with L, and the scratch memory of a call is bounded whatever L is."""
    per = max(1, _BLOCK // (rows * chunk * chunk))
    return [slice(i, min(i + per, n)) for i in range(0, n, per)]


def _chunked(steps, chunk, q, k, v, g, beta):
    """``q, k, v (B..., L, D)`` and ``g, beta (B..., L)`` as chunks ``(rows, N, C, D)`` and ``(rows, N, C)``."""
    vectors = tuple(pad_chunks(x, steps, chunk) for x in (q, k, v))
    return vectors + tuple(pad_chunks(x[..., None], steps, chunk)[..., 0] for x in (g, beta))


def pad_chunks(x, steps, chunk):
    """``(B..., L, D)`` -> ``(rows, N, C, D)``, zero-padded at the end to ``N * C`` steps (a padded
    step has k = v = q = 0, g = beta = 0: it leaves the state as it was and reads nothing out)."""
    x = x.reshape((-1, steps, x.shape[-1]))
    n = -(-steps // chunk)
    if n * chunk != steps:
        x = np.concatenate([x, np.zeros((x.shape[0], n * chunk - steps, x.shape[-1]), x.dtype)], axis=1)
    return x.reshape((x.shape[0], n, chunk, x.shape[-1]))


def _chunk_terms(q, k, v, g, beta) -> _Chunks:
    """The state-independent terms of the chunks given (``(rows, n, C, ...)`` arrays, see ``_chunked``).

    Every exponent is a sum of the ``g`` it spans, never a difference of two running sums: after
    a strong decay (``g = -3e4``) the running sum ``gamma`` has lost the digits of the weak
    decays that follow (float32: ``-3e4 - 0.01`` is ``-30000.0098``), so ``gamma_i - gamma_j``
    would be off by 1e-3, and a full reset (``g = -inf``) would make it ``-inf - -inf``."""
    lower = np.tril(np.ones(g.shape[-1:] * 2, dtype=bool))  # j <= i
    gam = flushed_exp(np.where(lower, segment_sums(g), -np.inf))  # masked before exp: 0 above the diagonal
    a = flushed_exp(np.cumsum(g, axis=-1))  # (rows, N, C) e^{gamma_i}
    b = gam[..., -1, :]  # e^{g_{i+1} + ... + g_C} = Gam_Ci
    kt = k.swapaxes(-1, -2)
    kk = np.tril(k @ kt)  # lower triangles only: no value of a later step above the diagonal
    qk = np.tril(q @ kt)
    t = unit_lower_inverse(np.tril(beta[..., :, None] * kk * gam, -1))  # M_ij = beta_i Gam_ij k_i.k_j, j < i
    return _Chunks(
        q=q,
        k=k,
        v=v,
        beta=beta,
        a=a,
        b=b,
        gam=gam,
        kk=kk,
        qk=qk,
        t=t,
        p=qk * gam,  # P = (Q K^T) * Gam
        qa=q * a[..., None],  # diag(a) Q
        kb=k * b[..., None],  # diag(b) K
        wv=triangular_matmul(t, v * beta[..., None]),  # W_v = T diag(beta) V
        wk=triangular_matmul(t, k * (beta * a)[..., None]),  # W_k = T diag(beta a) K
    )


def segment_sums(x):
    """``D_ij = x_{j+1} + ... + x_i`` for ``j <= i`` (0 on the diagonal and above) over the last
    axis: ``(..., C) -> (..., C, C)``, each a sum of the terms it spans (a running sum down each
    column of the matrix holding ``x_i`` below the diagonal), so no cancellation between large
    partial sums and no ``inf - inf``."""
    strict = np.tril(np.ones(x.shape[-1:] * 2, dtype=bool), -1)  # j < i
    d = np.where(strict, x[..., :, None], 0)
    return running_sum(d, -2)


def running_sum(x, axis):
    """``np.cumsum(x, axis, out=x)``: the same additions in the same order, as ``C - 1`` in-place
    vector additions along ``axis`` (a chunk's few steps).  Several times faster than numpy's
    cumsum along an inner axis of the chunks' ``(C, C)`` and ``(C, Dk, C)`` arrays."""
    y = np.moveaxis(x, axis, 0)  # a view: the additions land in x
    for i in range(1, y.shape[0]):
        y[i] += y[i - 1]
    return x


def triangular_matmul(m, x, upper=False):
    """``m @ x`` for a lower- (``upper``: upper-) triangular ``m (..., C, C)`` whose other triangle
    is exactly zero, without ever forming ``0 * inf`` across that triangle: with an inf or NaN in
    row j of x, row i of the result (i < j; ``upper``: i > j) stays what the step-by-step
    recurrence gives instead of becoming NaN.  All-finite x (the usual case) takes one batched
    product; otherwise the rows are formed from their own triangle only, one row at a time."""
    if np.isfinite(x).all():
        return m @ x
    c = m.shape[-1]
    out = np.empty(np.broadcast_shapes(m.shape[:-1], x.shape[:-2] + (c,)) + x.shape[-1:], np.result_type(m, x))
    for i in range(c):
        span = slice(i, c) if upper else slice(0, i + 1)
        out[..., i, :] = (m[..., i, None, span] @ x[..., span, :])[..., 0, :]
    return out


def flushed_exp(x):
    """``exp(x)`` with results below the dtype's smallest normal number set to 0.  Strong decays
    make ``e^{gamma}`` subnormal inside a chunk (float32: below 1.2e-38, at gamma < -87), and
    arithmetic on subnormals runs 10-100 times slower on x86 CPUs; such a factor changes a result
    by less than the format's smallest normal number."""
    y = np.exp(x)
    y[y < np.finfo(y.dtype).tiny] = 0.0
    return y


def unit_lower_inverse(m):
    """``T = (I + M)^{-1}`` for strictly lower-triangular ``M (..., C, C)``, by forward substitution:
    ``(I + M) T = I`` gives row by row ``T_i = e_i - sum_{j<i} M_ij T_j``, and ``T_j`` (``j < i``)
    is zero right of column ``j``, so ``T[i, :i] = -M[i, :i] T[:i, :i]``: one batched
    vector-matrix product per row (several times faster than a general inverse, as stable as a
    triangular solve).  With an inf or NaN in M the product skips ``T``'s zeros
    (``triangular_matmul``): ``T_ij`` for ``i, j`` after a non-finite ``M_il`` does not depend on it."""
    c = m.shape[-1]
    t = np.zeros(m.shape, m.dtype)
    t[..., np.arange(c), np.arange(c)] = 1.0
    finite = bool(np.isfinite(m).all())
    for i in range(1, c):
        if finite:
            t[..., i, :i] = -np.matmul(m[..., i, None, :i], t[..., :i, :i])[..., 0, :]
        else:  # the same product as T[:i, :i]^T m_i
            ti = t[..., :i, :i].swapaxes(-1, -2)
            t[..., i, :i] = -triangular_matmul(ti, m[..., i, :i, None], upper=True)[..., 0]
    return t


def _scan(c, s):
    """The one sequential part: carry the state through the chunks.  Returns the states entering
    each chunk ``(rows, N, Dk, Dv)``, the deltas ``U (rows, N, C, Dv)`` and the final state (the
    chunks' terms ``c`` of this rule or of ``kda``'s, whose ``a_C`` is one number per key channel)."""
    rows, n = c.q.shape[:2]
    states = np.empty((rows, n) + s.shape[-2:], s.dtype)
    u = np.empty(c.v.shape, s.dtype)
    decay = chunk_decay(c.a)  # (rows, N, 1, 1) a_C, the whole chunk's decay ((rows, N, Dk, 1): one per channel)
    kbt = c.kb.swapaxes(-1, -2)
    for i in range(n):
        states[:, i] = s
        u[:, i] = c.wv[:, i] - c.wk[:, i] @ s  # U = W_v - W_k S
        s = decay[:, i] * s + kbt[:, i] @ u[:, i]  # S' = a_C S + (diag(b) K)^T U
    return states, u, s


@shared_doc(**rule_backward_doc("GatedDeltaRuleCache"))
def gated_delta_rule_backward(
    dout: np.ndarray, cache: GatedDeltaRuleCache, dfinal_state: Optional[np.ndarray] = None
) -> tuple[Optional[np.ndarray], ...]:
    """Gradients of ``gated_delta_rule``, chunk by chunk (derivation beside ``_chunked_backward``).

    <rule_backward>
        ``dinitial_state`` is None when the forward had no initial state.
    """
    dout, dfinal_state = checked_backward("gated_delta_rule_backward", cache, GatedDeltaRuleCache, dout, dfinal_state)
    return gated_delta_rule_backward_kernel(dout, cache, dfinal_state)


def gated_delta_rule_backward_kernel(dout, cache, dfinal_state=None):
    return chunked_backward(_RULE, dout, cache, dfinal_state)


def chunked_backward(rule, dout, cache, dfinal_state=None):
    """The chunked backward of ``rule``: per group of batch rows the blocks of chunks in reverse
    (the state's adjoint runs backwards, ``rule.backward`` for each block), then the scale and
    ``l2_norm``'s backward.  Returns the backward's six gradients."""
    q, chunk = cache.q, cache.chunk
    lead, steps, dk, dv = q.shape[:-2], q.shape[-2], q.shape[-1], cache.v.shape[-1]
    chunks = rule.chunked(steps, chunk, q, cache.k, cache.v, cache.g, cache.beta)
    doc = pad_chunks(dout, steps, chunk)
    rows, n = chunks[0].shape[:2]
    s = cache.states.reshape((rows,) + cache.states.shape[-3:])
    dsf = np.zeros((rows, dk, dv), dtype=q.dtype) if dfinal_state is None else dfinal_state.reshape(rows, dk, dv)
    ds0 = np.empty((rows, dk, dv), q.dtype)
    grads = tuple(np.empty(x.shape, q.dtype) for x in chunks)
    for rs, blocks in rule.groups(rows, n, chunk, dk):
        ds = dsf[rs]
        for blk in reversed(blocks):  # the last block first: the state's adjoint runs backwards
            terms = rule.terms(*(x[rs, blk] for x in chunks))
            block_grads, ds = rule.backward(terms, s[rs, blk], doc[rs, blk], ds)
            for whole, part in zip(grads, block_grads):
                whole[rs, blk] = part
        ds0[rs] = ds
    dq, dk_, dv_, dg, dbeta = (
        x.reshape((rows, -1) + x.shape[3:])[:, :steps].reshape(lead + (steps,) + x.shape[3:]) for x in grads
    )
    dq *= cache.scale
    if cache.q_norm is not None:
        dq, dk_ = l2_norm_backward_kernel(dq, cache.q_norm), l2_norm_backward_kernel(dk_, cache.k_norm)
    return dq, dk_, dv_, dg, dbeta, (ds0.reshape(lead + (dk, dv)) if cache.has_initial_state else None)


class _BackwardParts(NamedTuple):
    """The intermediates of ``_chunked_backward`` its forward-mode derivative reads (names as there)."""

    pt_do: np.ndarray
    ds_end: np.ndarray
    u: np.ndarray
    du: np.ndarray
    dr: np.ndarray
    dp: np.ndarray
    dqa: np.ndarray
    dpg: np.ndarray
    dkb: np.ndarray
    dm: np.ndarray
    dmg: np.ndarray
    d: np.ndarray
    ks: np.ndarray
    ks_dr: np.ndarray
    dr_st: np.ndarray
    dgam: np.ndarray
    da: np.ndarray
    db: np.ndarray
    da_end: np.ndarray


def _chunked_backward(c: _Chunks, s, do, dsf, keep=False):
    """Backward of the chunks of a block, all at once but for the state's adjoint.

    The chunk computed (``S`` entering, ``S'`` leaving, ``R = diag(beta) V - diag(beta a) K S``):

        U = T R,   O = diag(a) Q S + P U,   S' = a_C S + (diag(b) K)^T U.

    Given ``dO`` and ``dS'``:

        dU = P^T dO + diag(b) K dS'                          (U feeds O and S')
        dR = T^T dU                                          (U = T R)
        dS = a_C dS' + (diag(a) Q)^T dO - (diag(beta a) K)^T dR
           = a_C dS' + (diag(a) Q)^T dO - W_k^T dU           (W_k = T diag(beta a) K)

    the last line is the reverse scan over chunks (``dS'`` of chunk n is ``dS`` of chunk n + 1,
    ``dfinal_state`` for the last).  Then, with every ``dS'`` known, for all the block's chunks at once:

        from O:   dP = dO U^T (lower);  d(diag(a) Q) = dO S^T;  dGam += dP * (Q K^T)
                  dQ = diag(a) dO S^T + (dP * Gam) K;  dK += (dP * Gam)^T Q;  da_i = q_i . (dO S^T)_i
        from S':  d(diag(b) K) = U dS'^T, so dK += diag(b) U dS'^T, db_i = k_i . (U dS'^T)_i;
                  d a_C = <dS', S>
        from U = (I + M)^{-1} R:  dM = -dR U^T (strictly lower: M's support), and
                  M_ij = beta_i Gam_ij (k_i . k_j):  dbeta_i += sum_j dM_ij Gam_ij (k_i . k_j),
                  dK += (D + D^T) K with D = diag(beta) (dM * Gam),  dGam += dM * beta_i (k_i . k_j)
        from R:   dV = diag(beta) dR;  dbeta_i += v_i . dR_i - a_i (S^T k_i) . dR_i;
                  da_i -= beta_i (S^T k_i) . dR_i;  dK -= diag(beta a) dR S^T
        decays:   a_i = e^{gamma_i}: dgamma_i = a_i da_i, and dgamma_C += a_C d a_C; gamma = cumsum(g)
                  in the chunk, so dg_l = sum_{i >= l} dgamma_i;
                  Gam_ij = e^{D_ij}, D_ij = g_{j+1} + ... + g_i, and b_j = Gam_Cj: with
                  dD = dGam * Gam and dD_Cj += b_j db_j, dg_l += sum_{i >= l > j} dD_ij
                  (``segment_sums_backward``; sums only, as the forward's exponents).

    Returns ``((dq, dk, dv, dg, dbeta) per chunk, dS of the first chunk = dinitial_state)``, and
    with ``keep`` the intermediates as ``_BackwardParts`` third (for ``_chunked_backward_jvp``).
    """
    pt_do, ds_end, ds, u, du, dr = adjoint_scan(c, s, do, dsf, c.a[..., -1, None, None])
    st = s.swapaxes(-1, -2)
    # from O
    dp = np.tril(do @ u.swapaxes(-1, -2))
    dqa = do @ st  # (rows, N, C, Dk)
    dpg = dp * c.gam
    dq = dqa * c.a[..., None] + triangular_matmul(dpg, c.k)
    dk = triangular_matmul(dpg.swapaxes(-1, -2), c.q, upper=True)
    da = (c.q * dqa).sum(-1)
    dgam = dp * c.qk
    # from S'
    dkb = u @ ds_end.swapaxes(-1, -2)  # (rows, N, C, Dk)
    dk += dkb * c.b[..., None]
    db = (c.k * dkb).sum(-1)
    da_end = (ds_end * s).sum(axis=(-2, -1))  # (rows, N)
    # from U = (I + M)^{-1} R
    dm = -np.tril(dr @ u.swapaxes(-1, -2), -1)
    dmg = dm * c.gam
    dbeta = (dmg * c.kk).sum(-1)
    d = dmg * c.beta[..., :, None]
    dk += triangular_matmul(d, c.k) + triangular_matmul(d.swapaxes(-1, -2), c.k, upper=True)
    dgam += dm * c.kk * c.beta[..., :, None]
    # from R = diag(beta) V - diag(beta a) K S
    ks = c.k @ s  # (rows, N, C, Dv) S^T k_i as rows
    ks_dr = (ks * dr).sum(-1)
    dv = dr * c.beta[..., None]
    dbeta += (c.v * dr).sum(-1) - c.a * ks_dr
    da -= c.beta * ks_dr
    dr_st = dr @ st
    dk -= dr_st * (c.beta * c.a)[..., None]
    # the decays: a_i = e^{gamma_i}, gamma = cumsum(g); Gam_ij = e^{D_ij} and b_j = Gam_Cj, D = segment_sums(g)
    dd = dgam * c.gam  # dD_ij = dGam_ij Gam_ij
    dd[..., -1, :] += db * c.b
    dgamma = da * c.a
    dgamma[..., -1] += da_end * c.a[..., -1]
    dg = np.cumsum(dgamma[..., ::-1], axis=-1)[..., ::-1] + segment_sums_backward(dd)
    if not keep:
        return (dq, dk, dv, dg, dbeta), ds
    parts = (pt_do, ds_end, u, du, dr, dp, dqa, dpg, dkb, dm, dmg, d, ks, ks_dr, dr_st, dgam, da, db, da_end)
    return (dq, dk, dv, dg, dbeta), ds, _BackwardParts(*parts)


def _chunked_backward_jvp(c: _Chunks, tc: _Chunks, s, ts, do, tdo, dsf, tdsf):
    """``_chunked_backward`` and its forward-mode derivative: each of its lines by the product
    rule, the terms moving along ``tc`` (``_term_tangents``), the states along ``ts`` (the
    forward's tangents, ``tangent_scan``), ``dO`` along ``tdo`` and ``dS'`` of the last chunk along
    ``tdsf``.  The state's adjoint and its tangent run the chunks in reverse together:

        tdS = ta_C dS' + a_C tdS' + t(Q_a^T dO) - tW_k^T (P^T dO + K_b dS') - W_k^T t(P^T dO + K_b dS')

    every other line is a sum of products, each moving one factor at a time (the linear steps,
    the reversed cumsum and ``segment_sums_backward``, take the tangents as they are).

    Returns ``(grads, dS, tgrads, tdS)`` in ``_chunked_backward``'s order."""
    grads, ds, b = _chunked_backward(c, s, do, dsf, keep=True)
    tds_end, tds, tu, tdr = adjoint_tangents(c, tc, b, s, ts, do, tdo, tdsf)
    st, tst = s.swapaxes(-1, -2), ts.swapaxes(-1, -2)
    # from O
    tdp = np.tril(tdo @ b.u.swapaxes(-1, -2) + do @ tu.swapaxes(-1, -2))
    tdqa = tdo @ st + do @ tst
    tdpg = tdp * c.gam + b.dp * tc.gam
    tdq = tdqa * c.a[..., None] + b.dqa * tc.a[..., None]
    tdq += triangular_matmul(tdpg, c.k) + triangular_matmul(b.dpg, tc.k)
    tdk = triangular_matmul(tdpg.swapaxes(-1, -2), c.q, upper=True)
    tdk += triangular_matmul(b.dpg.swapaxes(-1, -2), tc.q, upper=True)
    tda = (tc.q * b.dqa + c.q * tdqa).sum(-1)
    tdgam = tdp * c.qk + b.dp * tc.qk
    # from S'
    tdkb = tu @ b.ds_end.swapaxes(-1, -2) + b.u @ tds_end.swapaxes(-1, -2)
    tdk += tdkb * c.b[..., None] + b.dkb * tc.b[..., None]
    tdb = (tc.k * b.dkb + c.k * tdkb).sum(-1)
    tda_end = (tds_end * s + b.ds_end * ts).sum(axis=(-2, -1))
    # from U = (I + M)^{-1} R
    tdm = -np.tril(tdr @ b.u.swapaxes(-1, -2) + b.dr @ tu.swapaxes(-1, -2), -1)
    tdmg = tdm * c.gam + b.dm * tc.gam
    tdbeta = (tdmg * c.kk + b.dmg * tc.kk).sum(-1)
    td = tdmg * c.beta[..., :, None] + b.dmg * tc.beta[..., :, None]
    tdk += triangular_matmul(td, c.k) + triangular_matmul(b.d, tc.k)
    tdk += triangular_matmul(td.swapaxes(-1, -2), c.k, upper=True)
    tdk += triangular_matmul(b.d.swapaxes(-1, -2), tc.k, upper=True)
    tdgam += (tdm * c.kk + b.dm * tc.kk) * c.beta[..., :, None] + b.dm * c.kk * tc.beta[..., :, None]
    # from R = diag(beta) V - diag(beta a) K S
    tks = tc.k @ s + c.k @ ts
    tks_dr = (tks * b.dr + b.ks * tdr).sum(-1)
    tdv = tdr * c.beta[..., None] + b.dr * tc.beta[..., None]
    tdbeta += (tc.v * b.dr + c.v * tdr).sum(-1) - tc.a * b.ks_dr - c.a * tks_dr
    tda -= tc.beta * b.ks_dr + c.beta * tks_dr
    tdk -= (tdr @ st + b.dr @ tst) * (c.beta * c.a)[..., None] + b.dr_st * (tc.beta * c.a + c.beta * tc.a)[..., None]
    # the decays: linear in (dgam, db, da, da_end) given the terms
    tdd = tdgam * c.gam + b.dgam * tc.gam
    tdd[..., -1, :] += tdb * c.b + b.db * tc.b
    tdgamma = tda * c.a + b.da * tc.a
    tdgamma[..., -1] += tda_end * c.a[..., -1] + b.da_end * tc.a[..., -1]
    tdg = np.cumsum(tdgamma[..., ::-1], axis=-1)[..., ::-1] + segment_sums_backward(tdd)
    return grads, ds, (tdq, tdk, tdv, tdg, tdbeta), tds


def adjoint_tangents(c, tc, b, s, ts, do, tdo, tdsf):
    """The tangents of the state's adjoint and of the deltas through a block of chunks (``c``,
    ``tc`` the terms and their tangents, ``b`` the backward's intermediates; this rule's or
    ``kda``'s, whose ``a_C`` is one number per key channel: ``chunk_decay``).  The adjoint's
    tangent runs the chunks in reverse:

        tdS = ta_C dS' + a_C tdS' + t(Q_a^T dO) - tW_k^T (P^T dO + K_b dS') - W_k^T t(P^T dO + K_b dS')

    then ``tU = tW_v - tW_k S - W_k tS`` and ``tdR = tT^T dU + T^T tdU = T^T (tdU - tM^T dR)`` with
    ``tdU = t(P^T dO) + tK_b dS' + K_b tdS'`` (``tT = -T tM T`` is never formed).  Returns ``(tdS'
    of each chunk, tdS of the first, tU, tdR)``."""
    n = c.q.shape[1]
    tpt_do = triangular_matmul(tc.p.swapaxes(-1, -2), do, upper=True)
    tpt_do += triangular_matmul(c.p.swapaxes(-1, -2), tdo, upper=True)
    tqa_do = tc.qa.swapaxes(-1, -2) @ do + c.qa.swapaxes(-1, -2) @ tdo
    decay, tdecay = chunk_decay(c.a), chunk_decay(tc.a)
    tds_end = np.empty(s.shape, s.dtype)
    tds = tdsf
    for i in reversed(range(n)):
        tds_end[:, i] = tds
        dsi = b.ds_end[:, i]
        tds = (
            tdecay[:, i] * dsi
            + decay[:, i] * tds
            + tqa_do[:, i]
            - tc.wk[:, i].swapaxes(-1, -2) @ (b.pt_do[:, i] + c.kb[:, i] @ dsi)
            - c.wk[:, i].swapaxes(-1, -2) @ (tpt_do[:, i] + tc.kb[:, i] @ dsi + c.kb[:, i] @ tds)
        )
    tu = tc.wv - tc.wk @ s - c.wk @ ts
    tdu = tpt_do + tc.kb @ b.ds_end + c.kb @ tds_end
    tdu -= triangular_matmul(tc.m.swapaxes(-1, -2), b.dr, upper=True)  # tT^T dU = -T^T tM^T dR
    return tds_end, tds, tu, triangular_matmul(c.t.swapaxes(-1, -2), tdu, upper=True)


def segment_sums_backward(dd):
    """The adjoint of ``segment_sums`` (``dd`` is overwritten): ``D_ij = x_{j+1} +
    ... + x_i`` holds ``x_l`` for ``j < l <= i``, so ``dx_l = sum_{i >= l} F_{i, l-1}`` with the
    running sums along the rows ``F_im = sum_{j <= m} dD_ij``, and ``dx_1 = 0``: sums only, no
    differences of large sums, as in the forward."""
    f = running_sum(dd, -1)
    strict = np.tril(np.ones(dd.shape[-1:] * 2, dtype=bool), -1)  # F_{i, l-1} with i >= l
    dx = np.zeros(dd.shape[:-1], dd.dtype)
    dx[..., 1:] = np.where(strict, f, 0).sum(-2)[..., :-1]
    return dx


# ------------------------------------------------------------------------- gated_delta_rule_jvp


@shared_doc(**rule_jvp_doc("GatedDeltaRuleCache"))
def gated_delta_rule_jvp(cache: GatedDeltaRuleCache, *tangents):
    """Forward mode of ``gated_delta_rule``, chunk by chunk (derivation beside ``_chunked_jvp``).

    <rule_jvp>
    """
    c = check_cache(cache, GatedDeltaRuleCache, "gated_delta_rule_jvp")
    return gated_delta_rule_jvp_kernel(
        c, *check_tangents_as(tangents, "gated_delta_rule_jvp", c.q.dtype, tangent_specs(c))
    )


def gated_delta_rule_jvp_kernel(cache, tq=None, tk=None, tv=None, tg=None, tbeta=None, ts0=None, *, keep=False):
    """The kernel of ``gated_delta_rule_jvp``; with ``keep``, ``(its result, ForwardTangents)`` for
    ``gated_delta_rule_backward_jvp_kernel(..., forward=)`` along the same tangents."""
    return chunked_jvp(_RULE, cache, tq, tk, tv, tg, tbeta, ts0, keep=keep)


class ForwardTangents(NamedTuple):
    """What a chunked rule's JVP computed that its second order along the same tangents computes
    again (``chunked_jvp(..., keep=True)``, ``second_order_kernel(..., forward=)``): the tangents
    as the forward used its inputs, as chunks, the state's tangent entering each chunk, ``(L / C)
    Dk Dv`` numbers per head as the forward's states, and the terms and term tangents of the last
    block of chunks, which the second order takes first (one block's arrays, about ``_BLOCK``
    numbers each, whatever ``L`` is; kept when the rows make one group)."""

    tchunks: tuple  # rule.chunked of used_tangents
    tstates: np.ndarray  # (rows, N, Dk, Dv)
    last: Optional[tuple]  # (terms, term tangents) of the last block, or None


def chunked_jvp(rule, cache, tq=None, tk=None, tv=None, tg=None, tbeta=None, ts0=None, *, keep=False):
    """The chunked forward mode of ``rule``: the tangents as the forward used its inputs
    (``used_tangents``), then per group of batch rows the blocks of chunks in order, the state's
    tangent carried by ``rule.jvp``.  Returns ``tout``, or ``(tout, tfinal_state)``; with
    ``keep``, that and the ``ForwardTangents`` the second order along these tangents reuses."""
    c = cache
    lead, steps, dk, dv = c.q.shape[:-2], c.q.shape[-2], c.q.shape[-1], c.v.shape[-1]
    chunks = rule.chunked(steps, c.chunk, c.q, c.k, c.v, c.g, c.beta)
    tchunks = rule.chunked(steps, c.chunk, *used_tangents(c, tq, tk, tv, tg, tbeta))
    rows, n = chunks[0].shape[:2]
    s = c.states.reshape((rows,) + c.states.shape[-3:])
    ts0 = np.zeros((rows, dk, dv), c.q.dtype) if ts0 is None else ts0.reshape(rows, dk, dv)
    tout = np.empty(chunks[2].shape, c.q.dtype)
    tfinal = np.empty((rows, dk, dv), c.q.dtype)
    tstates = np.empty(s.shape, s.dtype)
    groups = rule.groups(rows, n, c.chunk, dk)
    for rs, blocks in groups:
        ts = ts0[rs]
        for blk in blocks:
            terms = rule.terms(*(x[rs, blk] for x in chunks))
            tout[rs, blk], tstates[rs, blk], ts, tterms = rule.jvp(
                terms, s[rs, blk], *(x[rs, blk] for x in tchunks), ts
            )
        tfinal[rs] = ts
    tout = tout.reshape(rows, -1, dv)[:, :steps].reshape(lead + (steps, dv))
    out = tout if c.final_state is None else (tout, tfinal.reshape(lead + (dk, dv)))
    if not keep:
        return out
    return out, ForwardTangents(tchunks, tstates, (terms, tterms) if len(groups) == 1 else None)


def used_tangents(c: DeltaRuleCache, tq, tk, tv, tg, tbeta):
    """The tangents of the inputs as the forward used them: q's through ``l2_norm``'s JVP and the
    scale, k's through ``l2_norm``'s JVP (``use_qk_l2norm``); None as zeros."""
    zero = np.zeros_like
    tq = zero(c.q) if tq is None else c.scale * (tq if c.q_norm is None else l2_norm_jvp_kernel(c.q_norm, tq))
    tk = zero(c.k) if tk is None else (tk if c.k_norm is None else l2_norm_jvp_kernel(c.k_norm, tk))
    tv, tg, tbeta = (zero(a) if t is None else t for t, a in ((tv, c.v), (tg, c.g), (tbeta, c.beta)))
    return tq, tk, tv, tg, tbeta


@shared_doc(**rule_backward_jvp_doc("gated_delta_rule"))
def gated_delta_rule_backward_jvp(
    dout: np.ndarray,
    cache: GatedDeltaRuleCache,
    tangents,
    ddout: Optional[np.ndarray] = None,
    dfinal_state: Optional[np.ndarray] = None,
    ddfinal_state: Optional[np.ndarray] = None,
):
    """Second order of ``gated_delta_rule``, chunk by chunk: ``gated_delta_rule_backward(dout,
    cache, dfinal_state)``'s gradients and their tangents when the inputs move along ``tangents``,
    ``dout`` along ``ddout`` and ``dfinal_state`` along ``ddfinal_state``.

    A first pass carries the state's tangent through the chunks as ``gated_delta_rule_jvp`` does
    (keeping the tangent entering each chunk: ``(L / C) Dk Dv`` numbers per head, as the
    forward's states); the second runs the chunks in reverse as the backward does, each line of
    ``_chunked_backward`` with its tangent (derivation beside ``_chunked_backward_jvp``); then
    the scale and, with ``use_qk_l2norm``, ``l2_norm``'s second order along the raw tangents.
    Work linear in ``L``, no ``(L, L)`` array.

    <rule_backward_jvp>
    """
    dout, tangents, ddout, dfinal_state, ddfinal_state = checked_backward_jvp(
        "gated_delta_rule_backward_jvp", cache, GatedDeltaRuleCache, dout, tangents, ddout, dfinal_state, ddfinal_state
    )
    return gated_delta_rule_backward_jvp_kernel(dout, cache, tangents, ddout, dfinal_state, ddfinal_state)


def gated_delta_rule_backward_jvp_kernel(
    dout, cache, tangents=(), ddout=None, dfinal_state=None, ddfinal_state=None, *, forward=None
):
    """The kernel of ``gated_delta_rule_backward_jvp``; ``forward``: the ``ForwardTangents`` that
    ``gated_delta_rule_jvp_kernel(cache, *tangents, keep=True)`` gave along the same tangents."""
    return second_order_kernel(_RULE, dout, cache, tangents, ddout, dfinal_state, ddfinal_state, forward=forward)


class ChunkedRule(NamedTuple):
    """A chunked delta rule's own pieces, which ``chunked_forward``, ``chunked_backward``,
    ``chunked_jvp`` and ``second_order_kernel`` drive (this rule's ``_RULE``; ``kda``'s with a
    decay per key channel)."""

    cache: Callable  # the rule's cache class, a ``DeltaRuleCache``
    chunked: Callable  # (steps, chunk, q, k, v, g, beta) -> the five as chunks (``_chunked``)
    groups: Callable  # (rows, N, C, Dk) -> [(rows' slice, [blocks of chunks])]
    terms: Callable  # the state-independent terms of a block (``_chunk_terms``)
    term_tangents: Callable  # their tangents (``_term_tangents``)
    backward: Callable  # ``_chunked_backward``
    jvp: Callable  # ``_chunked_jvp``
    backward_jvp: Callable  # ``_chunked_backward_jvp``


def second_order_kernel(
    rule, dout, cache, tangents=(), ddout=None, dfinal_state=None, ddfinal_state=None, *, forward=None
):
    """The chunked second order (``gated_delta_rule_backward_jvp``, ``kimi_delta_attention_backward_jvp``)
    of ``rule``'s pieces: per group of batch rows, the states' tangents forwards through the
    blocks of chunks (``tangent_scan``, the tangent entering each chunk kept as the forward keeps
    the states; taken from ``forward``, the ``ForwardTangents`` of ``chunked_jvp`` along the same
    tangents, when given), then the backward and its tangent through the blocks in reverse
    (``rule.backward_jvp``); last the scale and, with ``use_qk_l2norm``, ``l2_norm``'s second
    order along the raw ``tq``, ``tk``.  Work linear in ``L``, no ``(L, L)`` array."""
    c = cache
    tq_in, tk_in, tv, tg, tbeta, ts0 = (tuple(tangents) + (None,) * 6)[:6]
    lead, steps, dk, dv = c.q.shape[:-2], c.q.shape[-2], c.q.shape[-1], c.v.shape[-1]
    chunks = rule.chunked(steps, c.chunk, c.q, c.k, c.v, c.g, c.beta)
    if forward is None:
        tchunks = rule.chunked(steps, c.chunk, *used_tangents(c, tq_in, tk_in, tv, tg, tbeta))
    else:
        tchunks = forward.tchunks
    doc = pad_chunks(dout, steps, c.chunk)
    tdoc = np.zeros_like(doc) if ddout is None else pad_chunks(ddout, steps, c.chunk)
    rows, n = chunks[0].shape[:2]
    s = c.states.reshape((rows,) + c.states.shape[-3:])
    zeros = np.zeros((rows, dk, dv), c.q.dtype)
    ts_all, ds_all, tds_all = (
        zeros if x is None else x.reshape(rows, dk, dv) for x in (ts0, dfinal_state, ddfinal_state)
    )
    grads = tuple(np.empty(x.shape, c.q.dtype) for x in chunks * 2)
    ds0, tds0 = np.empty_like(zeros), np.empty_like(zeros)

    def terms(rs, blk):
        t = rule.terms(*(x[rs, blk] for x in chunks))
        return t, rule.term_tangents(t, *(x[rs, blk] for x in tchunks))

    groups = rule.groups(rows, n, c.chunk, dk)
    for rs, blocks in groups:
        last = None if forward is None or len(groups) > 1 else forward.last
        if forward is None:
            tstates, ts = np.empty(s[rs].shape, s.dtype), ts_all[rs]
            for blk in blocks:  # the states' tangents, forwards
                last = terms(rs, blk)
                tstates[:, blk], _, _, ts = tangent_scan(*last, s[rs, blk], ts)
        else:
            tstates = forward.tstates[rs]
        ds, tds = ds_all[rs], tds_all[rs]
        for i, blk in enumerate(reversed(blocks)):  # the backward and its tangent, the last block first
            block_terms = last if i == 0 and last is not None else terms(rs, blk)  # the last block's: kept
            block_grads, ds, block_tangents, tds = rule.backward_jvp(
                *block_terms, s[rs, blk], tstates[:, blk], doc[rs, blk], tdoc[rs, blk], ds, tds
            )
            for whole, part in zip(grads, block_grads + block_tangents):
                whole[rs, blk] = part
        ds0[rs], tds0[rs] = ds, tds
    whole = [x.reshape((rows, -1) + x.shape[3:])[:, :steps].reshape(lead + (steps,) + x.shape[3:]) for x in grads]
    dq, dk_, dv_, dg, dbeta = whole[:5]  # the gradients, unpadded to the steps
    tdq, tdk, tdv, tdg, tdbeta = whole[5:]  # their tangents
    dq *= c.scale
    tdq *= c.scale
    if c.q_norm is not None:
        dq, tdq = l2_norm_backward_jvp_kernel(dq, c.q_norm, (tq_in,), tdq)
        dk_, tdk = l2_norm_backward_jvp_kernel(dk_, c.k_norm, (tk_in,), tdk)
    state = c.has_initial_state
    return (
        (dq, dk_, dv_, dg, dbeta, ds0.reshape(lead + (dk, dv)) if state else None),
        (tdq, tdk, tdv, tdg, tdbeta, tds0.reshape(lead + (dk, dv)) if state else None),
    )


def _chunked_jvp(c: _Chunks, s, tq, tk, tv, tg, tbeta, ts):
    """The product rule through one chunk's formulas (module docstring), for a block of chunks
    at once but for the tangent of the state, carried through the chunks as the state is:

        ta = a cumsum(tg);  tD = segment_sums(tg);  tGam = Gam tD;  tb_j = b_j tD_Cj
        tM = beta (tK K^T + K tK^T) Gam + tbeta (K K^T) Gam + beta (K K^T) tGam   (strictly lower)
        tT = -T tM T                                       (from T (I + M) = I; never formed:)
        tW_v = tT diag(beta) V + T (diag(tbeta) V + diag(beta) tV) = T (diag(tbeta) V + diag(beta) tV - tM W_v)
        tW_k = tT diag(beta a) K + T (...) = T (diag(tbeta a + beta ta) K + diag(beta a) tK - tM W_k)
        tP = (tQ K^T + Q tK^T) Gam + (Q K^T) tGam          (lower, diagonal included)
        tU = tW_v - tW_k S - W_k tS
        tO = diag(ta) Q S + diag(a) (tQ S + Q tS) + tP U + P tU
        tS' = ta_C S + a_C tS + (diag(tb) K + diag(b) tK)^T U + (diag(b) K)^T tU

    Returns ``(tO (rows, N, C, Dv), the state's tangent entering each chunk, the final state's,
    the terms' tangents)``."""
    tc = _term_tangents(c, tq, tk, tv, tg, tbeta)
    return (*output_tangents(c, tc, s, ts), tc)


def adjoint_scan(c, s, do, dsf, decay):
    """The first half of both rules' ``_chunked_backward`` (derived there): the reverse scan of the
    state's adjoint over a block's chunks,

        dS = a_C dS' + (a Q)^T dO - W_k^T (P^T dO + (b K) dS')

    (``a Q`` is ``c.qa``, ``b K`` is ``c.kb``; ``decay``: ``a_C`` shaped to multiply ``dS``, a
    scalar per row in the gated delta rule, a diagonal in KDA), starting from ``dS' = dsf`` for the
    last chunk; then, for all the chunks at once, ``U = W_v - W_k S``, ``dU = P^T dO + (b K) dS'``
    and ``dR = T^T dU``.  Returns ``(P^T dO, dS' of each chunk, dS of the first chunk, U, dU, dR)``."""
    n = c.q.shape[1]
    pt_do = triangular_matmul(c.p.swapaxes(-1, -2), do, upper=True)  # (rows, N, C, Dv) P^T dO
    qa_do = c.qa.swapaxes(-1, -2) @ do  # (rows, N, Dk, Dv) (a Q)^T dO
    wkt = c.wk.swapaxes(-1, -2)
    ds_end = np.empty(s.shape, s.dtype)  # dS' of each chunk
    ds = dsf
    for i in reversed(range(n)):
        ds_end[:, i] = ds
        ds = decay[:, i] * ds + qa_do[:, i] - wkt[:, i] @ (pt_do[:, i] + c.kb[:, i] @ ds)
    u = c.wv - c.wk @ s  # U = W_v - W_k S, recomputed for the block
    du = pt_do + c.kb @ ds_end
    assert c.t is not None  # the terms (their tangents have none)
    return pt_do, ds_end, ds, u, du, triangular_matmul(c.t.swapaxes(-1, -2), du, upper=True)


def output_tangents(c, tc, s, ts):
    """The last lines of both rules' ``_chunked_jvp`` (derived there), from the terms' tangents
    ``tc``: the state's tangent carried through the chunks (``tangent_scan``), then
    ``tO = t(a Q) S + (a Q) tS + tP U + P tU``.  Returns ``(tO, the state's tangent entering each
    chunk, the final state's)``."""
    tstates, u, tu, ts = tangent_scan(c, tc, s, ts)
    tout = tc.qa @ s + c.qa @ tstates
    tout += triangular_matmul(tc.p, u) + triangular_matmul(c.p, tu)
    return tout, tstates, ts


def _term_tangents(c: _Chunks, tq, tk, tv, tg, tbeta) -> _Chunks:
    """The tangents of the chunks' terms (``_chunked_jvp``'s first lines), field by field as a
    ``_Chunks``; the lower triangles only, as the terms."""
    ta = c.a * np.cumsum(tg, axis=-1)
    td = segment_sums(tg)  # the tangents of the exponents D_ij, sums as the forward's
    tgam = c.gam * td
    tb = c.b * td[..., -1, :]
    kt = c.k.swapaxes(-1, -2)
    tkk = tk @ kt
    tkk = np.tril(tkk + tkk.swapaxes(-1, -2))
    bcol = c.beta[..., :, None]
    tm = np.tril(bcol * tkk * c.gam + tbeta[..., :, None] * c.kk * c.gam + bcol * c.kk * tgam, -1)
    # W = T X with T = (I + M)^{-1}: tW = tT X + T tX = T (tX - tM W), as tT = -T tM T
    twv = c.v * tbeta[..., None] + tv * c.beta[..., None]
    twv -= triangular_matmul(tm, c.wv)
    ba = c.beta * c.a
    twk = c.k * (tbeta * c.a + c.beta * ta)[..., None] + tk * ba[..., None]
    twk -= triangular_matmul(tm, c.wk)
    tqk = np.tril(tq @ kt + c.q @ tk.swapaxes(-1, -2))
    return _Chunks(
        q=tq,
        k=tk,
        v=tv,
        beta=tbeta,
        a=ta,
        b=tb,
        gam=tgam,
        kk=tkk,
        qk=tqk,
        t=None,
        p=tqk * c.gam + c.qk * tgam,
        qa=tq * c.a[..., None] + c.q * ta[..., None],
        kb=c.k * tb[..., None] + tk * c.b[..., None],
        wv=triangular_matmul(c.t, twv),
        wk=triangular_matmul(c.t, twk),
        m=tm,
    )


def tangent_scan(c, tc, s, ts):
    """``_scan``'s tangent: the states' tangents entering each chunk, ``U`` and ``tU``, and the
    final state's tangent (``tU = tW_v - tW_k S - W_k tS``, ``tS' = ta_C S + a_C tS + tK_b^T U +
    K_b^T tU``).  ``c``, ``tc``: the chunks' terms and their tangents, of this rule or of
    ``kda`` (``a_C`` a number per chunk or one per key channel: ``chunk_decay``)."""
    u = c.wv - c.wk @ s
    n = c.q.shape[1]
    tstates = np.empty(s.shape, s.dtype)
    tu = np.empty(u.shape, u.dtype)
    decay, tdecay = chunk_decay(c.a), chunk_decay(tc.a)
    for i in range(n):
        tstates[:, i] = ts
        tu[:, i] = tc.wv[:, i] - tc.wk[:, i] @ s[:, i] - c.wk[:, i] @ ts
        ts = (
            tdecay[:, i] * s[:, i]
            + decay[:, i] * ts
            + tc.kb[:, i].swapaxes(-1, -2) @ u[:, i]
            + c.kb[:, i].swapaxes(-1, -2) @ tu[:, i]
        )
    return tstates, u, tu, ts


def chunk_decay(a):
    """The whole chunk's decay ``a_C`` of each row of the state, ``(rows, N, 1, 1)`` from ``a (rows,
    N, C)`` (one number) or ``(rows, N, Dk, 1)`` from ``a (rows, N, C, Dk)`` (one per key channel)."""
    last = a[:, :, -1]
    return last.reshape(last.shape[:2] + (-1, 1))


_RULE = ChunkedRule(
    cache=GatedDeltaRuleCache,
    chunked=_chunked,
    groups=lambda rows, n, chunk, dk: [(slice(None), chunk_blocks(rows, n, chunk))],
    terms=_chunk_terms,
    term_tangents=_term_tangents,
    backward=_chunked_backward,
    jvp=_chunked_jvp,
    backward_jvp=_chunked_backward_jvp,
)

"""``mamba2_scan``: Mamba-2's selective state-space scan (Granite 4.0's hybrid layers), chunk by chunk.

The recurrence of ``npattn.functional.reference.mamba2_scan`` (to 1e-12 in float64), per head with
the state ``S (P, N)``: ``delta_t = clip(softplus(dt_t + dt_bias), *time_step_limit)``, ``a_t =
exp(delta_t A)``, ``S_t = a_t S_{t-1} + delta_t x_t B_t^T``, ``y_t = S_t C_t + D x_t``.

**The forward, chunk by chunk** (transformers' ``mamba2_chunk_scan``, the "state space duality"
form).  Inside a chunk of ``c`` steps starting from ``S``, with the log decays ``l_i = delta_i A``,
``Lam_i = l_1 + ... + l_i`` and ``seg_ij = l_{j+1} + ... + l_i`` (``j <= i``, each a sum of the
terms it spans: ``delta_rule.segment_sums``, no differences of large sums)::

    S_i = e^{Lam_i} S + sum_{j <= i} e^{seg_ij} delta_j x_j B_j^T
    Y   = (e^{seg} * (C B^T)) (delta x) + diag(e^{Lam}) C S^T + D x          (c, P)
    S'  = e^{Lam_c} S + (e^{seg_c.} delta x)^T B                              (P, N)

two ``(c, c)`` products and two ``(c, N) x (N, P)`` ones per chunk and head instead of ``c`` rank-1
updates of the ``(P, N)`` state: the work runs in matrix products, and only the state entering each
chunk is kept (``L / c`` states instead of ``L``).

**The backward, chunk by chunk** (``_chunk_backward``): the adjoint of the three lines above,
the chunks taken last to first, the adjoint ``dS`` of the state leaving a chunk carried to the one
before it: within a chunk the gradients through the masked quadratic form are ``(c, c)`` and
``(c, N) x (N, P)`` products too, and those of the log decays come from the segment sums' adjoint
(sums only, as the forward).  The chunk's terms (decays, ``C B^T``) are formed again from the
inputs and the state kept at its start.

**The forward mode, chunk by chunk** (``_chunk_jvp_out``, ``_chunk_jvp_state``): the three lines
differentiated by the product rule, in the same matrix products, the tangent of the state carried
from chunk to chunk (the tangents of the chunk's terms: ``_chunk_tangent``).

**The second order, chunk by chunk** (``_chunk_backward_tangent``): the backward's lines
differentiated by the product rule, the forward's tangents of the states entering the chunks
first (``_chunk_jvp_state``), then the chunks last to first with the adjoint ``dS`` and its
tangent carried back.  The heads of a group are kept side by side (``(B..., G, H / G, ...)``) so
that ``B`` and ``C`` broadcast over them instead of being copied per head.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import numpy as np

from .._validate import (
    as_float,
    as_floats_of_one_dtype,
    check_backward_jvp,
    check_bool,
    check_cache,
    check_grad,
    check_size,
    check_tangents_as,
)
from .delta_rule import segment_sums, segment_sums_backward

__all__ = [
    "mamba2_scan",
    "mamba2_scan_backward",
    "mamba2_scan_jvp",
    "mamba2_scan_backward_jvp",
    "Mamba2ScanCache",
]


class Mamba2ScanCache(NamedTuple):
    """What ``mamba2_scan_backward`` needs: the inputs and the state entering every chunk."""

    x: np.ndarray  # (B..., H, L, P)
    dt: np.ndarray  # (B..., H, L) the step sizes as used: clip(softplus(dt + dt_bias), *time_step_limit)
    sig: np.ndarray  # (B..., H, L) d dt / d(dt + dt_bias): sigmoid where the clip lets dt through, else 0
    A: np.ndarray  # (H,)
    B: np.ndarray  # (B..., G, L, N)
    C: np.ndarray  # (B..., G, L, N)
    D: Optional[np.ndarray]  # (H,) or None
    starts: np.ndarray  # (chunks, rows, G, H / G, P, N) the state entering each chunk (rows: B... flattened)
    chunk_size: int
    has_dt_bias: bool
    has_initial_state: bool
    final_state: Optional[np.ndarray]  # (B..., H, P, N) S_L with output_final_state, else None


def mamba2_scan(
    x: np.ndarray,
    dt: np.ndarray,
    A: np.ndarray,
    B: np.ndarray,
    C: np.ndarray,
    D: Optional[np.ndarray] = None,
    dt_bias: Optional[np.ndarray] = None,
    *,
    time_step_limit: tuple = (0.0, math.inf),
    initial_state: Optional[np.ndarray] = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[np.ndarray, Mamba2ScanCache]:
    """Mamba-2's selective scan (Granite 4.0's state-space layers), chunk by chunk.

    Per head, from ``S_0 = initial_state`` (zeros if None): ``delta_t = clip(softplus(dt_t +
    dt_bias), *time_step_limit)`` (torch's softplus: the identity above 20), ``S_t = exp(delta_t
    A) S_{t-1} + delta_t x_t B_t^T``, ``y_t = S_t C_t + D x_t`` (the recurrence of
    ``npattn.functional.reference.mamba2_scan`` and of transformers' ``mamba2_chunk_scan``), in
    chunks of ``chunk_size`` steps (see the module docstring).

    Parameters
    ----------
    x : ndarray ``(B..., H, L, P)``
        ``H`` heads of ``P`` channels, head-first (transformers' layout is ``(B, L, H, P)``).
    dt : ndarray ``(B..., H, L)``
        The raw step sizes (before ``dt_bias`` and the softplus).
    A : ndarray ``(H,)``
        The decay rates (negative in Mamba: ``-exp(A_log)``).
    B, C : ndarray ``(B..., G, L, N)``
        The write and read keys, shared by the ``H / G`` heads of each of the ``G`` groups (head
        ``h`` reads group ``h // (H / G)``).
    D, dt_bias : ndarray ``(H,)``, optional
        The skip connection and the step sizes' bias (None: zero).
    time_step_limit : (float, float)
        ``(low, high)`` bounds of the step sizes (transformers' ``time_step_limit``; the default
        never clips, softplus being positive).
    initial_state : ndarray ``(B..., H, P, N)``, optional
        The state before the first step (zeros if None).
    output_final_state : bool
        Keep ``S_L`` as ``cache.final_state``, the state for the next call.
    chunk_size : int
        The chunk length (the numbers do not depend on it).

    Returns
    -------
    (y, cache)
        ``y (B..., H, L, P)``.

    Raises
    ------
    TypeError, ValueError
        Naming the argument, expected vs actual, before any arithmetic.

    Examples
    --------
    >>> import numpy as np
    >>> from npattn import functional as F
    >>> from npattn.functional import reference as R
    >>> rng = np.random.default_rng(0)
    >>> x, dt = rng.standard_normal((1, 4, 6, 3)), rng.standard_normal((1, 4, 6))   # H = 4, L = 6, P = 3
    >>> B, C = rng.standard_normal((2, 1, 2, 6, 5))                                  # G = 2, N = 5
    >>> A = -np.arange(1.0, 5.0)
    >>> y, cache = F.mamba2_scan(x, dt, A, B, C, chunk_size=4)
    >>> ref, _ = R.mamba2_scan(x, dt, A, B, C)
    >>> y.shape, bool(np.allclose(y, ref, rtol=0, atol=1e-12))
    ((1, 4, 6, 3), True)
    >>> len(F.mamba2_scan_backward(rng.standard_normal(y.shape), cache))   # dx, ddt, dA, dB, dC, dD, ddt_bias, dS0
    8
    """
    arrays = [("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C)]
    arrays += [(n, a) for n, a in (("D", D), ("dt_bias", dt_bias)) if a is not None]
    checked = dict(zip((n for n, _ in arrays), as_floats_of_one_dtype(*arrays)))
    x, dt, A, B, C = (checked[n] for n in ("x", "dt", "A", "B", "C"))
    D, dt_bias = checked.get("D"), checked.get("dt_bias")
    if x.ndim < 3 or min(x.shape[-3:]) < 1:
        raise ValueError(f"x: expected shape (..., H, L, P) with H, L, P >= 1, got {x.shape}")
    lead, (heads, steps, _) = x.shape[:-3], x.shape[-3:]
    if dt.shape != x.shape[:-1]:
        raise ValueError(f"dt: expected shape {x.shape[:-1]} (x's without P), got {dt.shape}")
    for name, a in (("A", A), ("D", D), ("dt_bias", dt_bias)):
        if a is not None and a.shape != (heads,):
            raise ValueError(f"{name}: expected shape ({heads},) (one per head), got {a.shape}")
    if B.ndim != x.ndim or B.shape[:-3] != lead or B.shape[-2] != steps or min(B.shape[-3:]) < 1:
        raise ValueError(f"B: expected shape {lead + ('G', steps, 'N')}, got {B.shape}")
    if heads % B.shape[-3]:
        raise ValueError(f"B: expected a number of groups dividing the {heads} heads, got {B.shape[-3]}")
    if C.shape != B.shape:
        raise ValueError(f"C: expected B's shape {B.shape}, got {C.shape}")
    limit = _check_limit(time_step_limit)
    if initial_state is not None:
        initial_state = as_float(initial_state, "initial_state").astype(x.dtype, copy=False)
        want = x.shape[:-2] + (x.shape[-1], B.shape[-1])
        if initial_state.shape != want:
            raise ValueError(f"initial_state: expected shape {want} (..., H, P, N), got {initial_state.shape}")
    return mamba2_scan_kernel(
        x,
        dt,
        A,
        B,
        C,
        D,
        dt_bias,
        time_step_limit=limit,
        initial_state=initial_state,
        output_final_state=check_bool(output_final_state, "output_final_state"),
        chunk_size=check_size(chunk_size, "chunk_size"),
    )


def _check_limit(limit) -> tuple:
    try:
        lo, hi = (float(v) for v in limit)
    except (TypeError, ValueError):
        raise ValueError(f"time_step_limit: expected two numbers (low, high), got {limit!r}") from None
    if not lo <= hi:
        raise ValueError(f"time_step_limit: expected low <= high, got {limit!r}")
    return lo, hi


class _Folded(NamedTuple):
    """The inputs with the heads of a group side by side: rows ``R`` (``B...`` flattened), groups
    ``G``, heads per group ``Hg``."""

    x: np.ndarray  # (R, G, Hg, L, P)
    delta: np.ndarray  # (R, G, Hg, L)
    A: np.ndarray  # (G, Hg, 1)
    B: np.ndarray  # (R, G, L, N)
    C: np.ndarray  # (R, G, L, N)


def _fold(c) -> _Folded:
    groups, heads = c.B.shape[-3], c.x.shape[-3]
    per = heads // groups
    x = c.x.reshape((-1, groups, per) + c.x.shape[-2:])
    delta = c.dt.reshape(x.shape[:-1])
    A = c.A.reshape(groups, per, 1)
    B, C = (b.reshape((-1, groups) + b.shape[-2:]) for b in (c.B, c.C))
    return _Folded(x, delta, A, B, C)


def _step_sizes(dt, dt_bias, limit):
    """``(delta, sig)``: the clipped softplus (torch's: the identity above 20) and its derivative
    (0 where the clip holds)."""
    u = dt if dt_bias is None else dt + dt_bias[:, None]
    big = u > 20.0  # torch's softplus: the identity above its threshold
    soft = np.where(big, u, np.logaddexp(0.0, np.minimum(u, 20.0)))
    lo, hi = limit
    free = (soft >= lo) & (soft <= hi)
    sig = np.where(big, 1.0, 0.5 * (1.0 + np.tanh(0.5 * u)))
    return np.clip(soft, lo, hi), np.where(free, sig, 0.0).astype(u.dtype)


class _Chunk(NamedTuple):
    """One chunk's terms of the SSD form (``c`` steps), as the forward forms them."""

    lam: np.ndarray  # (R, G, Hg, c) Lam_i = l_1 + ... + l_i, l_i = delta_i A the log decays
    decay: np.ndarray  # (R, G, Hg, c, c) e^{seg_ij} below the diagonal, 0 above
    CB: np.ndarray  # (R, G, 1, c, c) C B^T, shared by the heads of a group
    scores: np.ndarray  # (R, G, Hg, c, c) e^{seg} * (C B^T)
    u: np.ndarray  # (R, G, Hg, c, P) delta x
    B: np.ndarray  # (R, G, 1, c, N)
    C: np.ndarray  # (R, G, 1, c, N)


def _chunk(f: _Folded, s, e) -> _Chunk:
    """The terms of steps ``s .. e-1`` (the forward's, rebuilt by the backward)."""
    la = f.delta[..., s:e] * f.A  # (R, G, Hg, c) the log decays
    seg = segment_sums(la)  # l_{j+1} + ... + l_i below the diagonal
    decay = np.where(np.tril(np.ones((e - s, e - s), dtype=bool)), np.exp(seg), 0.0)
    Bc, Cc = f.B[:, :, None, s:e], f.C[:, :, None, s:e]
    CB = Cc @ np.swapaxes(Bc, -1, -2)
    u = f.delta[..., s:e, None] * f.x[..., s:e, :]
    return _Chunk(np.cumsum(la, -1), decay, CB, decay * CB, u, Bc, Cc)


def _chunks(steps, chunk):
    return [(s, min(s + chunk, steps)) for s in range(0, steps, chunk)]


def mamba2_scan_kernel(
    x,
    dt,
    A,
    B,
    C,
    D=None,
    dt_bias=None,
    *,
    time_step_limit=(0.0, math.inf),
    initial_state=None,
    output_final_state=False,
    chunk_size=64,
):
    """The kernel of ``mamba2_scan`` (arguments checked, one dtype)."""
    delta, sig = _step_sizes(dt, dt_bias, time_step_limit)
    has = (dt_bias is not None, initial_state is not None)
    c = Mamba2ScanCache(x, delta, sig, A, B, C, D, None, chunk_size, *has, None)
    f = _fold(c)
    rows, groups, per, steps, p = f.x.shape
    S = np.zeros((rows, groups, per, p, B.shape[-1]), x.dtype)
    if initial_state is not None:
        S[...] = initial_state.reshape(S.shape)
    spans = _chunks(steps, chunk_size)
    starts = np.empty((len(spans),) + S.shape, x.dtype)
    y = np.empty(f.x.shape, x.dtype)
    for k, (s, e) in enumerate(spans):
        starts[k] = S
        ch = _chunk(f, s, e)
        y[..., s:e, :] = ch.scores @ ch.u + np.exp(ch.lam)[..., None] * (ch.C @ np.swapaxes(S, -1, -2))
        to_end = ch.decay[..., -1, :]  # e^{l_{j+1} + ... + l_c}: step j's write decayed to the chunk's end
        S = np.exp(ch.lam[..., -1])[..., None, None] * S + np.swapaxes(to_end[..., None] * ch.u, -1, -2) @ ch.B
    if D is not None:
        y += D.reshape(groups, per, 1, 1) * f.x
    final = S.reshape(x.shape[:-2] + S.shape[-2:]) if output_final_state else None
    return y.reshape(x.shape), c._replace(starts=starts, final_state=final)


def _per_head(a, heads):
    """Sum ``(R, G, Hg, ...)`` to one number per head ``(H,)``."""
    return a.reshape(a.shape[:3] + (-1,)).sum((0, 3)).reshape(heads)


def _grads_out(c, f, dx, ddelta_walk, g, dB, dC, dout, dS):
    """The backward's steps off the walk (``reference.mamba2_scan_backward``), public shapes;
    ``g = dL/d(delta A)`` (the textbook's ``da a``)."""
    heads = c.x.shape[-3]
    ddelta = ddelta_walk + g * f.A
    dA = _per_head(g * f.delta, heads)
    dD = None
    if c.D is not None:
        dx += c.D.reshape(f.A.shape + (1,)) * dout
        dD = _per_head(dout * f.x, heads)
    du = ddelta * c.sig.reshape(ddelta.shape)
    dbias = _per_head(du, heads) if c.has_dt_bias else None
    dinit = dS.reshape(c.x.shape[:-2] + dS.shape[-2:]) if c.has_initial_state else None
    dx, du, dB, dC = dx.reshape(c.x.shape), du.reshape(c.dt.shape), dB.reshape(c.B.shape), dC.reshape(c.C.shape)
    return dx, du, dA, dB, dC, dD, dbias, dinit


def _state_shape(c):
    return c.x.shape[:-2] + (c.x.shape[-1], c.B.shape[-1])


def mamba2_scan_backward(dout: np.ndarray, cache: Mamba2ScanCache, dfinal_state: Optional[np.ndarray] = None):
    """Backpropagation through time, chunk by chunk in matrix form (the adjoint of the chunked
    forward, ``_chunk_backward``; the sums of ``reference.mamba2_scan_backward``).

    Returns
    -------
    (dx, ddt, dA, dB, dC, dD, ddt_bias, dinitial_state)
        None where the forward had no ``D`` / ``dt_bias`` / initial state.
    """
    check_cache(cache, Mamba2ScanCache, "mamba2_scan_backward")
    dout = check_grad(dout, cache.x.shape, cache.x.dtype)
    if dfinal_state is not None:
        dfinal_state = check_grad(dfinal_state, _state_shape(cache), cache.x.dtype, "dfinal_state")
    return mamba2_scan_backward_kernel(dout, cache, dfinal_state)


def mamba2_scan_backward_kernel(dout, cache, dfinal_state=None):
    c = cache
    f = _fold(c)
    do_all = dout.reshape(f.x.shape)
    dS = np.zeros(c.starts.shape[1:], c.x.dtype)
    if dfinal_state is not None:
        dS[...] = dfinal_state.reshape(dS.shape)
    dU, dl = np.empty_like(f.x), np.empty_like(f.delta)  # U = delta x, l = delta A
    dB, dC = np.empty_like(f.B), np.empty_like(f.C)
    for k, (s, e) in reversed(list(enumerate(_chunks(f.x.shape[-2], c.chunk_size)))):
        g = _chunk_backward(_chunk(f, s, e), c.starts[k], do_all[..., s:e, :], dS)
        dU[..., s:e, :], dl[..., s:e], dB[:, :, s:e], dC[:, :, s:e], dS = g
    # U = delta x: dx = delta dU, ddelta = x . dU (and l = delta A: ddelta += dl A, in _grads_out)
    dx, ddelta = f.delta[..., None] * dU, (f.x * dU).sum(-1)
    return _grads_out(c, f, dx, ddelta, dl, dB, dC, do_all, dS)


class _Adjoint(NamedTuple):
    """The products of a chunk's backward that its second order reuses."""

    dP: np.ndarray  # (R, G, Hg, c, c) dY u^T
    dCB: np.ndarray  # (R, G, 1, c, c) d(C B^T) = E * dP, added over the heads of a group
    w: np.ndarray  # (R, G, Hg, c, P) B dS'^T
    dYS: np.ndarray  # (R, G, Hg, c, N) dY S


def _adjoint(ch: _Chunk, S, dY, dS) -> _Adjoint:
    """The chunk's products with ``dY`` (``dL/dY``) and ``dS`` (``dL/dS'``), see ``_Adjoint``."""
    dP = dY @ np.swapaxes(ch.u, -1, -2)
    dCB = (ch.decay * dP).sum(2, keepdims=True)  # the heads of a group share C B^T
    return _Adjoint(dP, dCB, ch.B @ np.swapaxes(dS, -1, -2), dY @ S)


def _from_end(x):
    """``x_m + ... + x_c`` over the last axis: the adjoint of the running sums ``Lam``."""
    return np.cumsum(x[..., ::-1], -1)[..., ::-1]


def _chunk_backward(ch: _Chunk, S, dY, dS, adj: Optional[_Adjoint] = None):
    """One chunk of the backward: from ``S`` (the state entering it), ``dY = dL/dY (c, P)`` and
    ``dS = dL/dS'`` (the state leaving it), ``(du, dl, dB, dC, dL/dS)`` with ``u = delta x``, ``l =
    delta A`` (``dB``, ``dC`` added over the heads of a group).

    The adjoint of the module docstring's three lines, ``E = e^{seg}`` (lower), ``e_i = e^{Lam_i}``,
    ``E_c. = e^{seg_c.}`` (E's last row: each write decayed to the chunk's end)::

        Y = (E * C B^T) u:       du = (E * C B^T)^T dY;     with dP = dY u^T (c, c):
                                 d(C B^T) = E * dP;  dC = d(C B^T) B,  dB = d(C B^T)^T C
                                 dseg = E * C B^T * dP
        Y += diag(e) C S^T:      dC += diag(e) dY S;  dS_in = (diag(e) dY)^T C
                                 dLam_i = e_i <(dY S)_i, C_i>
        S' = e_c S + (E_c. u)^T B, with w = B dS'^T (c, P):
                                 du_j += E_cj w_j;   dB_j += E_cj dS'^T u_j;   dS_in += e_c dS'
                                 dseg_cj += E_cj <u_j, w_j>;  dLam_c += e_c <dS', S>

    and ``dl`` from ``seg_ij = l_{j+1} + ... + l_i`` (``delta_rule.segment_sums_backward``: sums
    only) and ``Lam_i = l_1 + ... + l_i`` (``dl_m = dLam_m + ... + dLam_c``).  The textbook's walk
    (``reference.mamba2_scan_backward``) computes the same sums step by step: its ``da_t a_t`` is
    ``dl_t``, its ``dS`` at the chunk's start ``dS_in``.
    """
    swap = np.swapaxes
    to_end, e = ch.decay[..., -1, :], np.exp(ch.lam)  # E_c. (R, G, Hg, c), e (R, G, Hg, c)
    adj = _adjoint(ch, S, dY, dS) if adj is None else adj
    dseg = ch.scores * adj.dP
    du = swap(ch.scores, -1, -2) @ dY + to_end[..., None] * adj.w
    dseg[..., -1, :] += to_end * (ch.u * adj.w).sum(-1)
    dlam = e * (adj.dYS * ch.C).sum(-1)
    dlam[..., -1] += e[..., -1] * (dS * S).sum((-2, -1))
    dl = segment_sums_backward(dseg) + _from_end(dlam)
    dC = (adj.dCB @ ch.B)[:, :, 0] + (e[..., None] * adj.dYS).sum(2)
    dB = (swap(adj.dCB, -1, -2) @ ch.C)[:, :, 0] + ((to_end[..., None] * ch.u) @ dS).sum(2)
    dS_in = e[..., -1, None, None] * dS + swap(e[..., None] * dY, -1, -2) @ ch.C
    return du, dl, dB, dC, dS_in


def _tangent_specs(c):
    return (
        ("tx", c.x.shape),
        ("tdt", c.dt.shape),
        ("tA", c.A.shape),
        ("tB", c.B.shape),
        ("tC", c.C.shape),
        ("tD", c.A.shape, c.D is not None),
        ("tdt_bias", c.A.shape, c.has_dt_bias),
        ("tinitial_state", _state_shape(c), c.has_initial_state),
    )


class _Tangents(NamedTuple):
    """The tangents the lines use, folded, zeros for None (``tD`` None for zero)."""

    x: np.ndarray
    u: np.ndarray  # tdt + tdt_bias
    delta: np.ndarray
    A: np.ndarray  # (G, Hg, 1)
    B: np.ndarray
    C: np.ndarray
    D: Optional[np.ndarray]  # (G, Hg, 1, 1)
    S0: np.ndarray


def _fold_tangents(
    c, f: _Folded, tx=None, tdt=None, tA=None, tB=None, tC=None, tD=None, tbias=None, tS=None
) -> _Tangents:
    zero = np.zeros_like
    tu = zero(f.delta) if tdt is None else tdt.reshape(f.delta.shape).copy()
    if tbias is not None:
        tu += tbias.reshape(f.A.shape)
    tdelta = c.sig.reshape(tu.shape) * tu
    tA = zero(f.A) if tA is None else tA.reshape(f.A.shape)
    tx = zero(f.x) if tx is None else tx.reshape(f.x.shape)
    tB = zero(f.B) if tB is None else tB.reshape(f.B.shape)
    tC = zero(f.C) if tC is None else tC.reshape(f.C.shape)
    tD = None if tD is None else tD.reshape(f.A.shape + (1,))
    tS0 = np.zeros(c.starts.shape[1:], c.x.dtype) if tS is None else tS.reshape(c.starts.shape[1:])
    return _Tangents(tx, tu, tdelta, tA, tB, tC, tD, tS0)


def mamba2_scan_jvp(cache: Mamba2ScanCache, *tangents):
    """Forward mode of ``mamba2_scan`` along ``(tx, tdt, tA, tB, tC, tD, tdt_bias,
    tinitial_state)`` (the backward's order; None or left out: zero): the tangent of the chunked
    forward, chunk by chunk in matrix form (``_chunk_jvp_out``, ``_chunk_jvp_state``; the sums of
    ``reference.mamba2_scan_jvp``).

    Returns
    -------
    ty : ndarray ``(B..., H, L, P)``, or ``(ty, tfinal_state)`` when the forward kept the final state.
    """
    check_cache(cache, Mamba2ScanCache, "mamba2_scan_jvp")
    return mamba2_scan_jvp_kernel(
        cache, *check_tangents_as(tangents, "mamba2_scan_jvp", cache.x.dtype, _tangent_specs(cache))
    )


def mamba2_scan_jvp_kernel(cache, *tangents):
    c = cache
    f = _fold(c)
    t = _fold_tangents(c, f, *tangents)
    ty = np.empty(f.x.shape, c.x.dtype)
    tS = t.S0
    for k, (s, e) in enumerate(_chunks(f.x.shape[-2], c.chunk_size)):
        ch, S = _chunk(f, s, e), c.starts[k]
        tc = _chunk_tangent(f, t, ch, s, e)
        ty[..., s:e, :] = _chunk_jvp_out(ch, tc, S, tS)
        tS = _chunk_jvp_state(ch, tc, S, tS)
    if c.D is not None:
        ty += c.D.reshape(f.A.shape + (1,)) * t.x
    if t.D is not None:
        ty += t.D * f.x
    ty = ty.reshape(c.x.shape)
    return ty if c.final_state is None else (ty, tS.reshape(c.final_state.shape))


class _ChunkTangent(NamedTuple):
    """The tangents of a ``_Chunk``'s terms (``tE = E * tseg``, ``tseg`` the segment sums of ``tl``)."""

    lam: np.ndarray  # (R, G, Hg, c) tLam
    decay: np.ndarray  # (R, G, Hg, c, c) tE
    scores: np.ndarray  # (R, G, Hg, c, c) tE * C B^T + E * (tC B^T + C tB^T)
    u: np.ndarray  # (R, G, Hg, c, P) tdelta x + delta tx
    B: np.ndarray  # (R, G, 1, c, N)
    C: np.ndarray  # (R, G, 1, c, N)


def _chunk_tangent(f: _Folded, t: _Tangents, ch: _Chunk, s, e) -> _ChunkTangent:
    """The tangents of the terms of steps ``s .. e-1`` along ``t``."""
    tl = t.delta[..., s:e] * f.A + f.delta[..., s:e] * t.A  # l = delta A
    tE = ch.decay * segment_sums(tl)  # E = e^{seg}, 0 above the diagonal
    tB, tC = t.B[:, :, None, s:e], t.C[:, :, None, s:e]
    tCB = tC @ np.swapaxes(ch.B, -1, -2) + ch.C @ np.swapaxes(tB, -1, -2)
    tu = t.delta[..., s:e, None] * f.x[..., s:e, :] + f.delta[..., s:e, None] * t.x[..., s:e, :]
    return _ChunkTangent(np.cumsum(tl, -1), tE, tE * ch.CB + ch.decay * tCB, tu, tB, tC)


def _chunk_jvp_out(ch: _Chunk, tc: _ChunkTangent, S, tS):
    """The tangent of the chunk's ``Y`` without the skip, by the product rule on the module
    docstring's line (``e = e^{Lam}``, ``te = e tLam``)::

        tY = t(E * C B^T) u + (E * C B^T) tu + diag(te) C S^T + diag(e) (tC S^T + C tS^T)
    """
    swap, e = np.swapaxes, np.exp(ch.lam)
    CS = ch.C @ swap(S, -1, -2)
    read = tc.lam[..., None] * CS + tc.C @ swap(S, -1, -2) + ch.C @ swap(tS, -1, -2)
    return tc.scores @ ch.u + ch.scores @ tc.u + e[..., None] * read


def _chunk_jvp_state(ch: _Chunk, tc: _ChunkTangent, S, tS):
    """The tangent of the state leaving the chunk::

        tS' = e_c (tLam_c S + tS) + (tE_c. u + E_c. tu)^T B + (E_c. u)^T tB

    (``E_c.`` the last row of ``E``: each write decayed to the chunk's end).
    """
    swap, end = np.swapaxes, np.exp(ch.lam[..., -1])[..., None, None]
    to_end, tto_end = ch.decay[..., -1, :, None], tc.decay[..., -1, :, None]
    written = swap(tto_end * ch.u + to_end * tc.u, -1, -2) @ ch.B + swap(to_end * ch.u, -1, -2) @ tc.B
    return end * (tc.lam[..., -1, None, None] * S + tS) + written


def mamba2_scan_backward_jvp(
    dout: np.ndarray,
    cache: Mamba2ScanCache,
    tangents,
    ddout: Optional[np.ndarray] = None,
    dfinal_state: Optional[np.ndarray] = None,
    ddfinal_state: Optional[np.ndarray] = None,
):
    """Second order of ``mamba2_scan``: the backward's gradients and their tangents along
    ``tangents`` (``mamba2_scan_jvp``'s order), ``ddout`` and ``ddfinal_state`` (None: zero): the
    tangent of the chunked backward, chunk by chunk in matrix form (``_chunk_backward_tangent``;
    the sums of ``reference.mamba2_scan_backward_jvp``).

    Returns
    -------
    (grads, grad_tangents)
        Both in the backward's order (None where the forward had no such input).
    """
    check_cache(cache, Mamba2ScanCache, "mamba2_scan_backward_jvp")
    dtype, specs = cache.x.dtype, _tangent_specs(cache)
    dout, tangents, ddout = check_backward_jvp(
        dout, tangents, ddout, "mamba2_scan_backward_jvp", cache.x.shape, dtype, specs
    )
    dfinal_state, ddfinal_state = (
        None if a is None else check_grad(a, _state_shape(cache), dtype, name)
        for a, name in ((dfinal_state, "dfinal_state"), (ddfinal_state, "ddfinal_state"))
    )
    return mamba2_scan_backward_jvp_kernel(dout, cache, tangents, ddout, dfinal_state, ddfinal_state)


def _chunk_backward_tangent(ch: _Chunk, tc: _ChunkTangent, adj: _Adjoint, S, tS, dY, tdY, dS, tdS):
    """The tangent of ``_chunk_backward``'s outputs, each of its lines by the product rule
    (``te = e tLam``, ``tE_c.`` the last row of ``tE``; ``segment_sums_backward`` and the sums from
    the end are linear)::

        tdP = tdY u^T + dY tu^T;   td(C B^T) = tE * dP + E * tdP;   tw = tB dS'^T + B tdS'^T
        tdseg = t(E * C B^T) * dP + (E * C B^T) * tdP   (+ the last row's tangent)
        tdu = t(E * C B^T)^T dY + (E * C B^T)^T tdY + tE_c. w + E_c. tw
        tdLam_i = te_i <(dY S)_i, C_i> + e_i (<(tdY S + dY tS)_i, C_i> + <(dY S)_i, tC_i>)
        tdC = td(C B^T) B + d(C B^T) tB + diag(te) dY S + diag(e) (tdY S + dY tS)
        tdB = td(C B^T)^T C + d(C B^T)^T tC + (tE_c. u + E_c. tu) dS' + (E_c. u) tdS'
        tdS_in = te_c dS' + e_c tdS' + (diag(te) dY + diag(e) tdY)^T C + (diag(e) dY)^T tC
    """
    swap = np.swapaxes
    to_end, tto_end = ch.decay[..., -1, :], tc.decay[..., -1, :]
    e = np.exp(ch.lam)
    te = e * tc.lam
    tdP = tdY @ swap(ch.u, -1, -2) + dY @ swap(tc.u, -1, -2)
    tdCB = (tc.decay * adj.dP + ch.decay * tdP).sum(2, keepdims=True)
    tdseg = tc.scores * adj.dP + ch.scores * tdP
    tw = tc.B @ swap(dS, -1, -2) + ch.B @ swap(tdS, -1, -2)
    tdu = swap(tc.scores, -1, -2) @ dY + swap(ch.scores, -1, -2) @ tdY
    tdu += tto_end[..., None] * adj.w + to_end[..., None] * tw
    tdseg[..., -1, :] += tto_end * (ch.u * adj.w).sum(-1) + to_end * (tc.u * adj.w + ch.u * tw).sum(-1)
    tdYS = tdY @ S + dY @ tS
    tdlam = te * (adj.dYS * ch.C).sum(-1) + e * (tdYS * ch.C + adj.dYS * tc.C).sum(-1)
    tdlam[..., -1] += te[..., -1] * (dS * S).sum((-2, -1)) + e[..., -1] * (tdS * S + dS * tS).sum((-2, -1))
    tdl = segment_sums_backward(tdseg) + _from_end(tdlam)
    tdC = (tdCB @ ch.B + adj.dCB @ tc.B)[:, :, 0] + (te[..., None] * adj.dYS + e[..., None] * tdYS).sum(2)
    tdB = (swap(tdCB, -1, -2) @ ch.C + swap(adj.dCB, -1, -2) @ tc.C)[:, :, 0]
    tdB += ((tto_end[..., None] * ch.u + to_end[..., None] * tc.u) @ dS + (to_end[..., None] * ch.u) @ tdS).sum(2)
    teY = te[..., None] * dY + e[..., None] * tdY
    tdS_in = te[..., -1, None, None] * dS + e[..., -1, None, None] * tdS
    tdS_in += swap(teY, -1, -2) @ ch.C + swap(e[..., None] * dY, -1, -2) @ tc.C
    return tdu, tdl, tdB, tdC, tdS_in


def _tangent_starts(c, f: _Folded, t: _Tangents, spans) -> np.ndarray:
    """The forward's tangents ``tS`` entering each chunk (as ``c.starts`` holds the states)."""
    tstarts = np.empty(c.starts.shape, c.x.dtype)
    tS = t.S0
    for k, (s, e) in enumerate(spans):
        tstarts[k] = tS
        ch = _chunk(f, s, e)
        tS = _chunk_jvp_state(ch, _chunk_tangent(f, t, ch, s, e), c.starts[k], tS)
    return tstarts


def mamba2_scan_backward_jvp_kernel(dout, cache, tangents, ddout=None, dfinal_state=None, ddfinal_state=None):
    c = cache
    f = _fold(c)
    t = _fold_tangents(c, f, *tangents)
    spans = _chunks(f.x.shape[-2], c.chunk_size)
    tstarts = _tangent_starts(c, f, t, spans)
    do_all = dout.reshape(f.x.shape)
    tdo_all = np.zeros_like(do_all) if ddout is None else ddout.reshape(f.x.shape)
    dS, tdS = np.zeros(c.starts.shape[1:], c.x.dtype), np.zeros(c.starts.shape[1:], c.x.dtype)
    if dfinal_state is not None:
        dS[...] = dfinal_state.reshape(dS.shape)
    if ddfinal_state is not None:
        tdS[...] = ddfinal_state.reshape(dS.shape)
    empty = np.empty_like
    dU, dl, dB, dC = empty(f.x), empty(f.delta), empty(f.B), empty(f.C)  # U = delta x, l = delta A
    tdU, tdl, tdB, tdC = empty(f.x), empty(f.delta), empty(f.B), empty(f.C)
    for k, (s, e) in reversed(list(enumerate(spans))):
        ch, S, dY, tdY = _chunk(f, s, e), c.starts[k], do_all[..., s:e, :], tdo_all[..., s:e, :]
        adj = _adjoint(ch, S, dY, dS)
        tg = _chunk_backward_tangent(ch, _chunk_tangent(f, t, ch, s, e), adj, S, tstarts[k], dY, tdY, dS, tdS)
        tdU[..., s:e, :], tdl[..., s:e], tdB[:, :, s:e], tdC[:, :, s:e], tdS = tg
        g = _chunk_backward(ch, S, dY, dS, adj)
        dU[..., s:e, :], dl[..., s:e], dB[:, :, s:e], dC[:, :, s:e], dS = g
    grads = _grads_out(c, f, f.delta[..., None] * dU, (f.x * dU).sum(-1), dl, dB, dC, do_all, dS)
    tdx, tddelta = _tangents_through_u_and_l(f, t, dU, tdU, dl, tdl)
    tdD = None
    if c.D is not None:
        tdx += c.D.reshape(f.A.shape + (1,)) * tdo_all
        tdD = _per_head(tdo_all * f.x + do_all * t.x, c.x.shape[-3])
    if t.D is not None:
        tdx += t.D * do_all
    # delta = clip(softplus(u)): du = ddelta s, s' = s (1 - s)
    sig = c.sig.reshape(f.delta.shape)
    ddelta = (f.x * dU).sum(-1) + dl * f.A
    tdu = tddelta * sig + ddelta * sig * (1.0 - sig) * t.u
    tdbias = _per_head(tdu, c.x.shape[-3]) if c.has_dt_bias else None
    tdinit = tdS.reshape(_state_shape(c)) if c.has_initial_state else None
    tdA = _per_head(tdl * f.delta + dl * t.delta, c.x.shape[-3])
    tgrads = (
        tdx.reshape(c.x.shape),
        tdu.reshape(c.dt.shape),
        tdA,
        tdB.reshape(c.B.shape),
        tdC.reshape(c.C.shape),
        tdD,
        tdbias,
        tdinit,
    )
    return grads, tgrads


def _tangents_through_u_and_l(f: _Folded, t: _Tangents, dU, tdU, dl, tdl):
    """``(tdx, tddelta)`` from the tangents of ``dU`` (``U = delta x``) and ``dl`` (``l = delta A``;
    the textbook's ``g = da a``): ``dx = delta dU``, ``ddelta = x . dU + dl A``, by the product rule."""
    tdx = t.delta[..., None] * dU + f.delta[..., None] * tdU
    return tdx, (t.x * dU + f.x * tdU).sum(-1) + tdl * f.A + dl * t.A

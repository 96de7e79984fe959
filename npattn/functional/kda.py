"""Kimi Delta Attention chunk by chunk: the gated delta rule with a decay per key channel.

``kimi_delta_attention`` gives the numbers of the step-by-step recurrence of
``npattn.functional.reference.kimi_delta_attention`` (to 1e-12 in float64) with work linear in
``L``: the chunked form of ``gated_delta_rule`` (``delta_rule.py``, whose helpers this file uses),
with the chunk's decays made per channel.  One head; ``S`` the state entering the chunk, rows
``i, j = 1..C`` the chunk's steps, ``d`` a key channel; ``q`` already scaled, ``k`` normalised:

    gamma_id = g_1d + ... + g_id        the decay of channel d from the chunk's start (log space)
    a_id = e^{gamma_id},  b_id = e^{g_{i+1,d} + ... + g_Cd},  Gam_ijd = e^{g_{j+1,d} + ... + g_id}  (j <= i)

The state after step i is ``S_i = diag(a_i) S + sum_{j<=i} diag(Gam_ij) k_j u_j^T``, so step i's
delta ``u_i = beta_i (v_i - (diag(e^{g_i}) S_{i-1})^T k_i)`` solves

    u_i + sum_{j<i} beta_i (k_i . Gam_ij . k_j) u_j = beta_i v_i - beta_i (a_i * k_i)^T S,

with ``x . Gam_ij . y = sum_d x_d Gam_ijd y_d``: the unit lower-triangular system ``(I + M) U =
R``, ``M_ij = beta_i (k_i . Gam_ij . k_j)``.  With ``T = (I + M)^{-1}``, ``U = W_v - W_k S``,
``W_v = T diag(beta) V``, ``W_k = T diag(beta) (A * K)`` (``A`` the ``(C, Dk)`` matrix of the
``a_id``, ``*`` elementwise), and

    O  = (A * Q) S + P U,      P_ij = q_i . Gam_ij . k_j   (j <= i, else 0)
    S' = diag(a_C) S + (B * K)^T U.

**The per-channel decay inside a chunk.**  A scalar decay factors out of ``q_i . k_j``
(``Gam_ij (q_i . k_j)``, one ``(C, C)`` matrix); a per-channel one sits inside the sum over
channels.  FLA (``fla/ops/gla``, ``fla/ops/kda``) and transformers' ``chunk_kimi_delta_attention``
factor it as ``e^{gamma_i - gamma_j} = e^{gamma_i} e^{-gamma_j}``: q scaled by ``e^{gamma}``, k by
``e^{-gamma}``, one matrix product.  After a strong decay that breaks down: ``e^{-gamma_j}``
overflows (float32: past ``gamma = -88``; one step of ``g = -100`` is enough), and the difference
``gamma_i - gamma_j`` of two large running sums has lost the weak decays' digits.  FLA's kernels
cut the chunk into sub-chunks of 16 with a reference step per sub-chunk (two factors each at most 1
when ``g <= 0``) and compute the diagonal sub-chunks pair by pair.  Here every pair is formed
directly: ``Gam (C, Dk, C)`` per chunk, each exponent the sum of the decays it spans
(``delta_rule.segment_sums`` along each channel), as ``gated_delta_rule`` forms its ``(C, C)``
matrix.  It is exact where the recurrence is (strong decays, ``g = -inf`` resets, decays of either
sign: no factor is ever larger than the product it stands for), and costs ``C Dk`` numbers and
exponentials per step: linear in ``L`` as the rest, and of the order of the ``(C, Dk) x (Dk, C)``
products that a factorisation would save; no step's arithmetic depends on where a strong decay falls.
The contractions over channels are batched matrix-vector products, and a block of chunks holds
about ``_BLOCK`` numbers of these ``(C, Dk, C)`` arrays (rows of the batch are split too when one
chunk of every row would not fit).

Non-finite values: as ``delta_rule``, products with the triangular ``T``, ``P`` skip their zeros
when the other factor is not finite (``triangular_matmul``), and the pairwise arrays are masked
(``np.where``, never multiplied by a zero) above the diagonal, so a NaN or inf at step t reaches what it
reaches in the recurrence.

Backward and JVP: as ``gated_delta_rule``'s (``_chunked_backward``, ``_chunked_jvp`` beside the
formulas), the decay gradients per channel: ``dg_ld = sum_{i >= l} a_id da_id`` plus the segment
sums' adjoint along channel d; the second order (``_chunked_backward_jvp``) each of the backward's
lines by the product rule.  The drivers over the groups of rows and blocks of chunks (forward,
backward, JVP, second order) and the scans are ``delta_rule``'s, given this rule's pieces (``_RULE``).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

from .._docs import shared_doc
from .._validate import check_cache, check_tangents_as
from . import delta_rule
from .delta_rule import (
    RULE_FORWARD_DOC,
    ChunkedRule,
    DeltaRuleCache,
    adjoint_scan,
    adjoint_tangents,
    checked_backward,
    checked_backward_jvp,
    checked_inputs,
    chunk_blocks,
    chunked_backward,
    chunked_forward,
    chunked_jvp,
    flushed_exp,
    output_tangents,
    pad_chunks,
    rule_backward_doc,
    rule_backward_jvp_doc,
    rule_jvp_doc,
    second_order_kernel,
    segment_sums,
    segment_sums_backward,
    tangent_specs,
    triangular_matmul,
    unit_lower_inverse,
)

__all__ = [
    "kimi_delta_attention",
    "kimi_delta_attention_backward",
    "kimi_delta_attention_jvp",
    "kimi_delta_attention_backward_jvp",
    "KimiDeltaAttentionCache",
]


class KimiDeltaAttentionCache(DeltaRuleCache):
    """What ``kimi_delta_attention_backward`` needs: the inputs as used and the chunks' start states
    (the gated delta rule's fields, ``delta_rule.DeltaRuleCache``, but ``g (B..., H, L, Dk)``, one
    log decay per key channel)."""

    __slots__ = ()


@shared_doc(**RULE_FORWARD_DOC)
def kimi_delta_attention(
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
    chunk_size: int = 16,
) -> tuple[np.ndarray, KimiDeltaAttentionCache]:
    """Kimi Delta Attention (Kimi Linear's linear attention), computed chunk by chunk.

    From ``S_0 = initial_state`` (zeros if None), for each step t:
    ``S = diag(exp(g_t)) S`` (row d of the state times ``exp(g_td)``);
    ``S = S + k_t (beta_t (v_t - k_t^T S))^T``; ``o_t = q_t^T S`` (the recurrence of
    ``npattn.functional.reference.kimi_delta_attention`` and of transformers'
    ``recurrent_kimi_delta_attention``), in chunks of ``chunk_size`` steps (see the module
    docstring).  Work and memory are linear in ``L``.  With ``g`` the same in every channel
    (``g[..., None]`` broadcast) this is ``gated_delta_rule``.

    Parameters
    ----------
    <rule_qkv>
    g : ndarray ``(B..., H, L, Dk)``
        Log decays, one per key channel (``<= 0`` in Kimi Linear: row d of the state is
        multiplied by ``exp(g_td)``).
    beta : ndarray ``(B..., H, L)``
        Write strengths (``sigmoid(b)`` in Kimi Linear).
    scale : float > 0, optional
        Multiplies q (after the normalisation); default ``1 / sqrt(Dk)`` (transformers' only choice).
    <rule_options>
        The pairwise decays cost ``C Dk`` per step, so the default is 16 (FLA's sub-chunk), not the
        gated delta rule's 64.

    <rule_returns>

    <rule_examples>
    >>> g, beta = -rng.random((1, 2, 10, 4)), rng.random((1, 2, 10))          # a log decay per channel
    >>> out, cache = F.kimi_delta_attention(q, k, v, g, beta, use_qk_l2norm=True, chunk_size=4)
    >>> ref, _ = R.kimi_delta_attention(q, k, v, g, beta, use_qk_l2norm=True)
    >>> out.shape, bool(np.allclose(out, ref, rtol=0, atol=1e-10))
    ((1, 2, 10, 4), True)
    >>> len(F.kimi_delta_attention_backward(rng.standard_normal(out.shape), cache))   # dq, dk, dv, dg, dbeta, dS0
    6
    """
    kw = dict(initial_state=initial_state, output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm)
    arrays, options = checked_inputs(q, k, v, g, beta, scale=scale, chunk_size=chunk_size, per_channel=True, **kw)
    return _kimi_delta_attention(*arrays, **options)


def _kimi_delta_attention(q, k, v, g, beta, **options):
    """The kernel of ``kimi_delta_attention`` (arguments checked, one dtype, ``options`` the keywords
    ``checked_inputs`` gives): the gated delta rule's chunked forward (``delta_rule.chunked_forward``)
    with this rule's chunks."""
    return chunked_forward(_RULE, q, k, v, g, beta, **options)


class _Chunks(NamedTuple):
    """The state-independent quantities of every chunk (``rows`` = batch x heads, ``N`` chunks)."""

    q: np.ndarray  # (rows, N, C, Dk) scaled q, zero-padded to N * C steps
    k: np.ndarray  # (rows, N, C, Dk)
    v: np.ndarray  # (rows, N, C, Dv)
    beta: np.ndarray  # (rows, N, C)
    lower: np.ndarray  # (C, 1, C) j <= i, to mask the pairwise arrays
    a: np.ndarray  # (rows, N, C, Dk) e^{gamma_id}
    b: np.ndarray  # (rows, N, C, Dk) e^{g_{i+1,d} + ... + g_Cd} = Gam_Cid
    gam: np.ndarray  # (rows, N, C, Dk, C) [i, d, j] = Gam_ijd = e^{g_{j+1,d} + ... + g_id} for j <= i, 0 above
    xk: np.ndarray  # (rows, N, C, Dk, C) [i, d, j] = Gam_ijd k_jd (j <= i, 0 above): k_j decayed to step i
    kk: np.ndarray  # (rows, N, C, C) k_i . Gam_ij . k_j for j < i, 0 on and above the diagonal
    t: Optional[np.ndarray]  # (rows, N, C, C) (I + M)^{-1}, M = diag(beta) kk, the UT transform (tangents: None)
    p: np.ndarray  # (rows, N, C, C) q_i . Gam_ij . k_j for j <= i, 0 above
    qa: np.ndarray  # (rows, N, C, Dk) A * Q
    ka: np.ndarray  # (rows, N, C, Dk) A * K
    kb: np.ndarray  # (rows, N, C, Dk) B * K
    wv: np.ndarray  # (rows, N, C, Dv) T diag(beta) V
    wk: np.ndarray  # (rows, N, C, Dk) T diag(beta) (A * K)
    m: Optional[np.ndarray] = None  # tangents only: tM, no tT (as delta_rule._Chunks)


def _groups(rows, n, chunk, dk):
    """The batch rows in groups, each with its blocks of chunks (``delta_rule.chunk_blocks``): a block's
    ``(rows, chunks, C, Dk, C)`` arrays hold about ``delta_rule._BLOCK`` numbers (one chunk of
    one row at least), so the time per step does not grow with L and the scratch memory of a call
    is bounded."""
    per = max(1, delta_rule._BLOCK // (chunk * chunk * dk))
    groups = [slice(r, min(r + per, rows)) for r in range(0, rows, per)]
    return [(rs, chunk_blocks((rs.stop - rs.start) * dk, n, chunk)) for rs in groups]


def _chunked(steps, chunk, q, k, v, g, beta):
    """``q, k, v, g (B..., L, D)`` and ``beta (B..., L)`` as chunks ``(rows, N, C, D)`` and
    ``(rows, N, C)`` (a padded step has k = q = v = 0, g = beta = 0: it changes nothing)."""
    vectors = tuple(pad_chunks(x, steps, chunk) for x in (q, k, v, g))
    return vectors + (pad_chunks(beta[..., None], steps, chunk)[..., 0],)


def _decayed(gam, lower, x):
    """``X[i, d, j] = Gam_ijd x_jd`` (``x (..., C, Dk)``: step j's vector decayed to step i), 0 for
    ``j > i`` by a mask, not by the zero of ``Gam``: no ``0 * inf`` from a later step."""
    return np.where(lower, gam * x.swapaxes(-1, -2)[..., None, :, :], 0.0)


def _decayed_rows(gam, lower, x):
    """``Y[i, d, j] = Gam_ijd x_id`` (step i's vector with the decay from step j), 0 for ``j > i``."""
    return np.where(lower, gam * x[..., :, :, None], 0.0)


def _pair(x, xs):
    """``sum_d x_id X[i, d, j]`` for ``x (..., C, Dk)``, ``X (..., C, Dk, C)``: ``(..., C, C)``
    (one vector-matrix product per step i, batched)."""
    return (x[..., :, None, :] @ xs)[..., 0, :]


def _rows(m, xs):
    """``sum_j m_ij X[i, d, j]``: ``(..., C, Dk)``."""
    return (xs @ m[..., :, :, None])[..., 0]


def _cols(m, ys):
    """``sum_i m_ij Y[i, d, j]``, indexed ``[j, d]``: ``(..., C, Dk)``."""
    return (ys.swapaxes(-1, -3) @ m.swapaxes(-1, -2)[..., :, :, None])[..., 0]


def _chunk_terms(q, k, v, g, beta) -> _Chunks:
    """The state-independent terms of the chunks given (``(rows, n, C, ...)`` arrays).

    Every exponent is the sum of the decays it spans, per channel (``segment_sums`` along the
    steps of each channel), never a difference of running sums nor a product of two factors
    ``e^{gamma_i} e^{-gamma_j}`` (module docstring)."""
    c = g.shape[-2]
    lower = np.tril(np.ones((c, c), dtype=bool))[:, None, :]  # [i, ., j]: j <= i
    seg = segment_sums(g.swapaxes(-1, -2)).swapaxes(-3, -2)  # [i, d, j] = g_{j+1,d} + ... + g_id
    gam = flushed_exp(np.where(lower, seg, -np.inf))  # masked before exp: 0 above the diagonal
    a = flushed_exp(np.cumsum(g, axis=-2))  # e^{gamma_id}
    b = gam[..., -1, :, :].swapaxes(-1, -2)  # Gam_Cjd as [j, d]
    xk = _decayed(gam, lower, k)
    kk = np.tril(_pair(k, xk), -1)  # strictly lower: M's support
    p = np.tril(_pair(q, xk))  # lower triangles only: no value of a later step above the diagonal
    t = unit_lower_inverse(beta[..., :, None] * kk)  # M_ij = beta_i (k_i . Gam_ij . k_j), j < i
    ka = k * a
    return _Chunks(
        q=q,
        k=k,
        v=v,
        beta=beta,
        lower=lower,
        a=a,
        b=b,
        gam=gam,
        xk=xk,
        kk=kk,
        t=t,
        p=p,
        qa=q * a,
        ka=ka,
        kb=k * b,
        wv=triangular_matmul(t, v * beta[..., None]),  # W_v = T diag(beta) V
        wk=triangular_matmul(t, ka * beta[..., None]),  # W_k = T diag(beta) (A * K)
    )


@shared_doc(**rule_backward_doc("KimiDeltaAttentionCache"))
def kimi_delta_attention_backward(
    dout: np.ndarray, cache: KimiDeltaAttentionCache, dfinal_state: Optional[np.ndarray] = None
) -> tuple[Optional[np.ndarray], ...]:
    """Gradients of ``kimi_delta_attention``, chunk by chunk (derivation beside ``_chunked_backward``).

    <rule_backward>
        ``dg`` of g's shape ``(B..., H, L, Dk)``; ``dinitial_state`` is None when the forward had
        no initial state.
    """
    dout, dfinal_state = checked_backward(
        "kimi_delta_attention_backward", cache, KimiDeltaAttentionCache, dout, dfinal_state
    )
    return _kimi_delta_attention_backward(dout, cache, dfinal_state)


def _kimi_delta_attention_backward(dout, cache, dfinal_state=None):
    return chunked_backward(_RULE, dout, cache, dfinal_state)


def _chunked_backward(c: _Chunks, s, do, dsf, keep=False):
    """Backward of the chunks of a block, all at once but for the state's adjoint.

    The chunk computed (``S`` entering, ``S'`` leaving, ``R = diag(beta) V - diag(beta) (A * K) S``):

        U = T R,   O = (A * Q) S + P U,   S' = diag(a_C) S + (B * K)^T U.

    Given ``dO`` and ``dS'``:

        dU = P^T dO + (B * K) dS'                            (U feeds O and S')
        dR = T^T dU                                          (U = T R)
        dS = diag(a_C) dS' + (A * Q)^T dO - W_k^T dU         (W_k = T diag(beta) (A * K))

    the last line is the reverse scan over chunks (``dS'`` of chunk n is ``dS`` of chunk n + 1,
    ``dfinal_state`` for the last).  Then, with every ``dS'`` known, for all the block's chunks at once:

        from O:   dP = dO U^T (lower);  d(A * Q) = dO S^T, so dQ = A * (dO S^T), dA = Q * (dO S^T);
                  P_ij = sum_d q_id Gam_ijd k_jd:  dq_id += sum_j dP_ij Gam_ijd k_jd,
                  dk_jd += sum_i dP_ij Gam_ijd q_id,  dGam_ijd += dP_ij q_id k_jd
        from S':  d(B * K) = U dS'^T: dK += B * (U dS'^T), dB = K * (U dS'^T);
                  d a_Cd = sum_v dS'_dv S_dv  (row d of <dS', S>)
        from U = (I + M)^{-1} R:  dM = -dR U^T (strictly lower), and with D = diag(beta) dM,
                  M_ij = beta_i sum_d k_id Gam_ijd k_jd:  dbeta_i += sum_j dM_ij (k_i . Gam_ij . k_j),
                  dk_id += sum_j D_ij Gam_ijd k_jd,  dk_jd += sum_i D_ij Gam_ijd k_id,
                  dGam_ijd += D_ij k_id k_jd
        from R:   dV = diag(beta) dR;  dbeta_i += v_i . dR_i - ((a_i * k_i)^T S) . dR_i;
                  d(A * K) = -diag(beta) dR S^T:  dK += A * that,  dA += K * that
        decays:   a_id = e^{gamma_id}: dgamma_id = a_id da_id, and dgamma_Cd += a_Cd d a_Cd;
                  gamma = cumsum(g) along the chunk, so dg_ld = sum_{i >= l} dgamma_id;
                  Gam_ijd = e^{D_ijd}, D_ijd = g_{j+1,d} + ... + g_id, and b_jd = Gam_Cjd: with
                  dD = dGam * Gam = Gam_ijd k_jd (dP_ij q_id + D_ij k_id) and dD_Cjd += b_jd db_jd,
                  dg_ld += sum_{i >= l > j} dD_ijd  (``segment_sums_backward`` along each channel).

    Returns ``((dq, dk, dv, dg, dbeta) per chunk, dS of the first chunk)``, and with ``keep`` the
    intermediates as ``_BackwardParts`` third (for ``_chunked_backward_jvp``).
    """
    pt_do, ds_end, ds, u, du, dr = adjoint_scan(c, s, do, dsf, c.a[..., -1, :, None])
    st = s.swapaxes(-1, -2)
    # from O
    dp = np.tril(do @ u.swapaxes(-1, -2))
    dqa = do @ st  # (rows, N, C, Dk)
    dq = dqa * c.a + _rows(dp, c.xk)
    da = c.q * dqa
    dk = _cols(dp, _decayed_rows(c.gam, c.lower, c.q))
    # from S'
    dkb = u @ ds_end.swapaxes(-1, -2)  # (rows, N, C, Dk)
    dk += dkb * c.b
    db = c.k * dkb
    da_end = (ds_end * s).sum(-1)  # (rows, N, Dk)
    # from U = (I + M)^{-1} R
    dm = -np.tril(dr @ u.swapaxes(-1, -2), -1)
    dbeta = (dm * c.kk).sum(-1)
    d = dm * c.beta[..., :, None]
    dk += _rows(d, c.xk) + _cols(d, _decayed_rows(c.gam, c.lower, c.k))
    # from R = diag(beta) V - diag(beta) (A * K) S
    ks = c.ka @ s  # (rows, N, C, Dv) (a_i * k_i)^T S as rows
    dv = dr * c.beta[..., None]
    dbeta += ((c.v - ks) * dr).sum(-1)
    dka = -(dv @ st)  # d(A * K) = -diag(beta) dR S^T
    dk += dka * c.a
    da += dka * c.k
    # the decays: a = e^{gamma}, gamma = cumsum(g); Gam_ijd = e^{D_ijd}, b_jd = Gam_Cjd, D = segment_sums(g)
    dd = np.where(
        c.lower, c.xk * (dp[..., :, None, :] * c.q[..., :, :, None] + d[..., :, None, :] * c.k[..., :, :, None]), 0
    )
    dd[..., -1, :, :] += (db * c.b).swapaxes(-1, -2)
    dgamma = da * c.a
    dgamma[..., -1, :] += da_end * c.a[..., -1, :]
    dg = np.cumsum(dgamma[..., ::-1, :], axis=-2)[..., ::-1, :]
    dg += segment_sums_backward(dd.swapaxes(-3, -2)).swapaxes(-1, -2)
    if not keep:
        return (dq, dk, dv, dg, dbeta), ds
    parts = _BackwardParts(pt_do, ds_end, u, du, dr, dp, dqa, dkb, dm, d, ks, dv, dka, da, db, da_end)
    return (dq, dk, dv, dg, dbeta), ds, parts


class _BackwardParts(NamedTuple):
    """The intermediates of ``_chunked_backward`` its forward-mode derivative reads (names as there)."""

    pt_do: np.ndarray  # P^T dO
    ds_end: np.ndarray  # dS' of each chunk
    u: np.ndarray
    du: np.ndarray
    dr: np.ndarray
    dp: np.ndarray
    dqa: np.ndarray  # d(A * Q)
    dkb: np.ndarray  # d(B * K)
    dm: np.ndarray
    d: np.ndarray  # diag(beta) dM
    ks: np.ndarray  # (A * K) S
    dv: np.ndarray  # diag(beta) dR
    dka: np.ndarray  # d(A * K)
    da: np.ndarray
    db: np.ndarray
    da_end: np.ndarray


def _chunked_backward_jvp(c: _Chunks, tc: _Chunks, s, ts, do, tdo, dsf, tdsf):
    """``_chunked_backward`` and its forward-mode derivative, for a block of chunks: each of its
    lines by the product rule, the terms moving along ``tc`` (``_term_tangents``), the states along
    ``ts`` (``delta_rule.tangent_scan``), ``dO`` along ``tdo`` and ``dS'`` of the last chunk along
    ``tdsf``.  The state's adjoint and its tangent run the chunks in reverse together, then ``tU``
    and ``tdR`` (``delta_rule.adjoint_tangents``, shared with the gated delta rule: ``a_C`` one
    number per channel here); every other line is a sum of products, moving one factor at a time:

        from O:   tdP = tdO U^T + dO tU^T (lower);  td(A * Q) = tdO S^T + dO tS^T;
                  tdq = td(A * Q) * A + d(A * Q) * tA + sum_j (tdP_ij Gam_ij k_j + dP_ij t(Gam_ij k_j));
                  tdk_jd += sum_i (tdP_ij Gam_ijd q_id + dP_ij t(Gam_ijd q_id))
        from S':  td(B * K) = tU dS'^T + U tdS'^T, and so on for dK, dB;  tda_C = <tdS', S> + <dS', tS>
        from U:   tdM = -(tdR U^T + dR tU^T) (strictly lower);  tD = diag(beta) tdM + diag(tbeta) dM
        from R:   t((A * K) S) = t(A * K) S + (A * K) tS;  tdV = diag(beta) tdR + diag(tbeta) dR
        decays:   tdD = t(Gam_ijd k_jd) (dP_ij q_id + D_ij k_id) + Gam_ijd k_jd t(dP_ij q_id + D_ij k_id),
                  then the reversed cumsum and ``segment_sums_backward`` (linear) take the tangents.

    Returns ``(grads, dS, tgrads, tdS)`` in ``_chunked_backward``'s order."""
    grads, ds, b = _chunked_backward(c, s, do, dsf, keep=True)
    tds_end, tds, tu, tdr = adjoint_tangents(c, tc, b, s, ts, do, tdo, tdsf)
    st, tst = s.swapaxes(-1, -2), ts.swapaxes(-1, -2)
    lower = c.lower
    # from O = (A * Q) S + P U
    tdp = np.tril(tdo @ b.u.swapaxes(-1, -2) + do @ tu.swapaxes(-1, -2))
    tdqa = tdo @ st + do @ tst
    tdq = tdqa * c.a + b.dqa * tc.a + _rows(tdp, c.xk) + _rows(b.dp, tc.xk)
    tda = tc.q * b.dqa + c.q * tdqa
    tqrows = _decayed_rows(tc.gam, lower, c.q) + _decayed_rows(c.gam, lower, tc.q)
    tdk = _cols(tdp, _decayed_rows(c.gam, lower, c.q)) + _cols(b.dp, tqrows)
    # from S' = diag(a_C) S + (B * K)^T U
    tdkb = tu @ b.ds_end.swapaxes(-1, -2) + b.u @ tds_end.swapaxes(-1, -2)
    tdk += tdkb * c.b + b.dkb * tc.b
    tdb = tc.k * b.dkb + c.k * tdkb
    tda_end = (tds_end * s + b.ds_end * ts).sum(-1)
    # from U = (I + M)^{-1} R
    tdm = -np.tril(tdr @ b.u.swapaxes(-1, -2) + b.dr @ tu.swapaxes(-1, -2), -1)
    tdbeta = (tdm * c.kk + b.dm * tc.kk).sum(-1)
    td = tdm * c.beta[..., :, None] + b.dm * tc.beta[..., :, None]
    tkrows = _decayed_rows(tc.gam, lower, c.k) + _decayed_rows(c.gam, lower, tc.k)
    tdk += _rows(td, c.xk) + _rows(b.d, tc.xk) + _cols(td, _decayed_rows(c.gam, lower, c.k)) + _cols(b.d, tkrows)
    # from R = diag(beta) V - diag(beta) (A * K) S
    tks = tc.ka @ s + c.ka @ ts
    tdv = tdr * c.beta[..., None] + b.dr * tc.beta[..., None]
    tdbeta += ((tc.v - tks) * b.dr + (c.v - b.ks) * tdr).sum(-1)
    tdka = -(tdv @ st + b.dv @ tst)
    tdk += tdka * c.a + b.dka * tc.a
    tda += tdka * c.k + b.dka * tc.k
    # the decays: linear in (dD, da, da_end) given the terms
    qi, ki, tqi, tki = (x[..., :, :, None] for x in (c.q, c.k, tc.q, tc.k))  # [i, d, .]
    dpj, dj, tdpj, tdj = (x[..., :, None, :] for x in (b.dp, b.d, tdp, td))  # [i, ., j]
    tdd = tc.xk * (dpj * qi + dj * ki) + c.xk * (tdpj * qi + dpj * tqi + tdj * ki + dj * tki)
    tdd = np.where(lower, tdd, 0)
    tdd[..., -1, :, :] += (tdb * c.b + b.db * tc.b).swapaxes(-1, -2)
    tdgamma = tda * c.a + b.da * tc.a
    tdgamma[..., -1, :] += tda_end * c.a[..., -1, :] + b.da_end * tc.a[..., -1, :]
    tdg = np.cumsum(tdgamma[..., ::-1, :], axis=-2)[..., ::-1, :]
    tdg += segment_sums_backward(tdd.swapaxes(-3, -2)).swapaxes(-1, -2)
    return grads, ds, (tdq, tdk, tdv, tdg, tdbeta), tds


# ------------------------------------------------------------------------ kimi_delta_attention_jvp


@shared_doc(**rule_jvp_doc("KimiDeltaAttentionCache"))
def kimi_delta_attention_jvp(cache: KimiDeltaAttentionCache, *tangents):
    """Forward mode of ``kimi_delta_attention``, chunk by chunk (derivation beside ``_chunked_jvp``).

    <rule_jvp>
    """
    c = check_cache(cache, KimiDeltaAttentionCache, "kimi_delta_attention_jvp")
    return _kimi_delta_attention_jvp(
        c, *check_tangents_as(tangents, "kimi_delta_attention_jvp", c.q.dtype, tangent_specs(c))
    )


def _kimi_delta_attention_jvp(cache, tq=None, tk=None, tv=None, tg=None, tbeta=None, ts0=None):
    return chunked_jvp(_RULE, cache, tq, tk, tv, tg, tbeta, ts0)


def _chunked_jvp(c: _Chunks, s, tq, tk, tv, tg, tbeta, ts):
    """The product rule through one chunk's formulas (module docstring), for a block of chunks
    at once but for the tangent of the state, carried through the chunks as the state is:

        tA = A * cumsum(tg);  tD = segment_sums(tg) per channel;  tGam = Gam * tD;  tb_jd = b_jd tD_Cjd
        tkk_ij = sum_d (tk_id Gam_ijd k_jd + k_id (Gam_ijd tk_jd + tGam_ijd k_jd))      (strictly lower)
        tM = diag(beta) tkk + diag(tbeta) kk;  tT = -T tM T          (from T (I + M) = I; never formed:)
        tW_v = tT diag(beta) V + T (diag(tbeta) V + diag(beta) tV) = T (diag(tbeta) V + diag(beta) tV - tM W_v)
        tW_k = T (diag(tbeta) (A * K) + diag(beta) (tA * K + A * tK) - tM W_k)
        tP_ij = sum_d (tq_id Gam_ijd k_jd + q_id (Gam_ijd tk_jd + tGam_ijd k_jd))         (lower)
        tU = tW_v - tW_k S - W_k tS
        tO = (tA * Q + A * tQ) S + (A * Q) tS + tP U + P tU
        tS' = diag(ta_C) S + diag(a_C) tS + (tB * K + B * tK)^T U + (B * K)^T tU

    Returns ``(tO (rows, N, C, Dv), the state's tangent entering each chunk, the final state's,
    the terms' tangents)``."""
    tc = _term_tangents(c, tq, tk, tv, tg, tbeta)
    return (*output_tangents(c, tc, s, ts), tc)


def _term_tangents(c: _Chunks, tq, tk, tv, tg, tbeta) -> _Chunks:
    """The tangents of the chunks' terms (``_chunked_jvp``'s first lines), field by field as a
    ``_Chunks`` (``lower`` the terms' own); the lower triangles only, as the terms."""
    ta = c.a * np.cumsum(tg, axis=-2)
    td = segment_sums(tg.swapaxes(-1, -2)).swapaxes(-3, -2)  # [i, d, j]: the tangents of the exponents
    tgam = c.gam * td
    tb = c.b * td[..., -1, :, :].swapaxes(-1, -2)
    txk = np.where(
        c.lower, c.gam * tk.swapaxes(-1, -2)[..., None, :, :] + tgam * c.k.swapaxes(-1, -2)[..., None, :, :], 0
    )
    tkk = np.tril(_pair(tk, c.xk) + _pair(c.k, txk), -1)
    tm = c.beta[..., :, None] * tkk + tbeta[..., :, None] * c.kk
    # tW = T (tX - tM W) for W = T X, as tT = -T tM T (delta_rule._term_tangents)
    twv = c.v * tbeta[..., None] + tv * c.beta[..., None]
    twv -= triangular_matmul(tm, c.wv)
    tka = ta * c.k + c.a * tk
    twk = c.ka * tbeta[..., None] + tka * c.beta[..., None]
    twk -= triangular_matmul(tm, c.wk)
    return _Chunks(
        q=tq,
        k=tk,
        v=tv,
        beta=tbeta,
        lower=c.lower,
        a=ta,
        b=tb,
        gam=tgam,
        xk=txk,
        kk=tkk,
        t=None,
        p=np.tril(_pair(tq, c.xk) + _pair(c.q, txk)),
        qa=ta * c.q + c.a * tq,
        ka=tka,
        kb=tb * c.k + c.b * tk,
        wv=triangular_matmul(c.t, twv),
        wk=triangular_matmul(c.t, twk),
        m=tm,
    )


# --------------------------------------------------------------- kimi_delta_attention_backward_jvp


@shared_doc(**rule_backward_jvp_doc("kimi_delta_attention"))
def kimi_delta_attention_backward_jvp(
    dout: np.ndarray,
    cache: KimiDeltaAttentionCache,
    tangents,
    ddout: Optional[np.ndarray] = None,
    dfinal_state: Optional[np.ndarray] = None,
    ddfinal_state: Optional[np.ndarray] = None,
):
    """Second order of ``kimi_delta_attention``, chunk by chunk: ``kimi_delta_attention_backward(dout,
    cache, dfinal_state)``'s gradients and their tangents when the inputs move along ``tangents``,
    ``dout`` along ``ddout`` and ``dfinal_state`` along ``ddfinal_state``.

    A first pass carries the state's tangent through the chunks as ``kimi_delta_attention_jvp``
    does (keeping the tangent entering each chunk: ``(L / C) Dk Dv`` numbers per head, as the
    forward's states); the second runs the chunks in reverse as the backward does, each line of
    ``_chunked_backward`` with its tangent (derivation beside ``_chunked_backward_jvp``); then the
    scale and, with ``use_qk_l2norm``, ``l2_norm``'s second order along the raw tangents (the
    driver is the gated delta rule's, ``delta_rule.second_order_kernel``).  Work linear in ``L``,
    no ``(L, L)`` array: a block of chunks holds its ``(C, Dk, C)`` arrays, as the backward.

    <rule_backward_jvp>
    """
    name, cache_type = "kimi_delta_attention_backward_jvp", KimiDeltaAttentionCache
    dout, tangents, ddout, dfinal_state, ddfinal_state = checked_backward_jvp(
        name, cache, cache_type, dout, tangents, ddout, dfinal_state, ddfinal_state
    )
    return second_order_kernel(_RULE, dout, cache, tangents, ddout, dfinal_state, ddfinal_state)


_RULE = ChunkedRule(
    cache=KimiDeltaAttentionCache,
    chunked=_chunked,
    groups=_groups,
    terms=_chunk_terms,
    term_tangents=_term_tangents,
    backward=_chunked_backward,
    jvp=_chunked_jvp,
    backward_jvp=_chunked_backward_jvp,
)

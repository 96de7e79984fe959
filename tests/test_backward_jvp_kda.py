"""Second order of Kimi Delta Attention (``kimi_delta_attention_backward_jvp``), both tiers (issue 31, item 1).

``kimi_delta_attention_backward_jvp(dout, cache, tangents, ddout, dfinal_state, ddfinal_state)``
returns ``(grads, grad_tangents)``: ``grads`` exactly the backward's, ``grad_tangents`` their
directional derivatives when the inputs move along ``tangents``, ``dout`` along ``ddout`` and
``dfinal_state`` along ``ddfinal_state``.  In float64 with random upstream gradients and tangents:

* the textbook tier against central differences of its backward (every input, the final state's
  gradient moving too) and ``npattn.gradgradcheck`` (``<u, Hv> = <Hu, v>`` included); both tiers'
  ``H w`` against ``_fd.fd_gradients`` of ``<grad, w>`` (the Hessian's symmetry);
* the textbook tier against ``torch.func.jvp`` of ``torch.func.vjp`` of the explicit recurrence
  (``_oracles.torch_delta_rule`` with a decay per channel; skipped without torch);
* a decay shared by the channels gives the gated delta rule's second order (``tdg`` summed);
* the chunked fast tier equal to the textbook one (1e-12; hypothesis over shapes, chunk sizes,
  ``use_qk_l2norm``, initial and final state), its gradients exactly its backward's, and against
  central differences of its own backward; blocks of chunks and row groups of every size; float32
  stays float32; bad arguments named.
"""

from __future__ import annotations

import numpy as np
import pytest
from _fd import fd_gradients
from _oracles import rel_err, torch_delta_rule
from hypothesis import given, settings
from hypothesis import strategies as st

import npattn
import npattn.functional as F
from npattn.functional import delta_rule, kda
from npattn.functional import reference as R
from npattn.testing import delta_rule_inputs

H = 1e-6  # the central differences' step


def _inputs(rng, lead=(2, 2), steps=5, dk=3, dv=2, init=True):
    """``(q, k, v, g, beta[, initial_state])``: decays that differ between the channels."""
    q, k = rng.standard_normal(lead + (steps, dk)), rng.standard_normal(lead + (steps, dk))
    v = rng.standard_normal(lead + (steps, dv))
    g = -np.logaddexp(0.0, 1.5 * rng.standard_normal(lead + (steps, dk)))
    beta = rng.uniform(0.2, 0.9, lead + (steps,))
    return (q, k, v, g, beta) + ((rng.standard_normal(lead + (dk, dv)),) if init else ())


def _cache(module, primals, l2, **extra):
    init = primals[5] if len(primals) > 5 else None
    kw = dict(initial_state=init, use_qk_l2norm=l2, output_final_state=init is not None)
    return module.kimi_delta_attention(*primals[:5], **kw, **extra)[1]


def _draws(rng, primals):
    """Tangents for every primal, ``dout``, ``ddout`` and, with an initial state, ``dfinal_state``
    and ``ddfinal_state`` (all random, never ones)."""
    v = primals[2]
    tangents = tuple(rng.standard_normal(p.shape) for p in primals)
    dout, ddout = rng.standard_normal(v.shape), rng.standard_normal(v.shape)
    state = primals[5].shape if len(primals) > 5 else None
    dfin, ddfin = (None, None) if state is None else (rng.standard_normal(state), rng.standard_normal(state))
    return tangents, dout, ddout, dfin, ddfin


def _central(module, primals, l2, tangents, dout, ddout, dfin, ddfin, **extra):
    """The backward's central differences along the tangents, ``ddout`` and ``ddfinal_state``."""

    def at(sign):
        moved = [p + sign * H * t for p, t in zip(primals, tangents)]
        dfin_moved = None if dfin is None else dfin + sign * H * ddfin
        return module.kimi_delta_attention_backward(
            dout + sign * H * ddout, _cache(module, moved, l2, **extra), dfin_moved
        )

    return [None if a is None else (a - b) / (2 * H) for a, b in zip(at(1), at(-1))]


@pytest.mark.parametrize("l2", [False, True])
@pytest.mark.parametrize("with_state", [False, True])
def test_textbook_against_central_differences_of_the_backward(l2, with_state):
    rng = np.random.default_rng(1 + 2 * l2 + with_state)
    primals = _inputs(rng, init=with_state)
    tangents, dout, ddout, dfin, ddfin = _draws(rng, primals)
    cache = _cache(R, primals, l2)
    grads, tans = R.kimi_delta_attention_backward_jvp(dout, cache, tangents, ddout, dfin, ddfin)
    for a, b in zip(grads, R.kimi_delta_attention_backward(dout, cache, dfin)):
        assert (a is None) == (b is None) == (not with_state and b is None)
        if a is not None:
            np.testing.assert_array_equal(a, b)
    assert len(tans) == 6 and (tans[5] is None) == (not with_state)
    for t, n, p in zip(tans, _central(R, primals, l2, tangents, dout, ddout, dfin, ddfin), primals):
        if t is not None:
            assert t.shape == p.shape and np.any(n)  # a tangent that is zero proves nothing
            assert rel_err(t, n, floor=1.0, relative_to="max_b") < 1e-6


@pytest.mark.parametrize("tier", [R, F], ids=["textbook", "fast"])
def test_hessian_times_w_is_the_gradient_of_the_gradients_projection(tier):
    """With ``L = <dout, out> + <dfinal, S_L>`` the gradients are ``grad L`` and their tangents
    along ``w`` (``ddout = 0``) are ``H w``; ``H`` is symmetric, so ``H w`` is also the gradient of
    ``phi(x) = <grad L(x), w>``, here by ``_fd.fd_gradients`` entry by entry (an independent
    check: not along the direction, and sharing no code with npattn)."""
    rng = np.random.default_rng(13)
    primals = _inputs(rng, lead=(1, 1), steps=4, dk=2, dv=2)
    w, dout, _, dfin, _ = _draws(rng, primals)
    extra = {} if tier is R else dict(chunk_size=3)

    def phi(*xs):
        grads = tier.kimi_delta_attention_backward(dout, _cache(tier, xs, True, **extra), dfin)
        return sum(np.sum(g * t) for g, t in zip(grads, w))

    numeric = fd_gradients(phi, primals)
    _, hw = tier.kimi_delta_attention_backward_jvp(dout, _cache(tier, primals, True, **extra), w, None, dfin)
    for t, n in zip(hw, numeric):
        assert np.any(n) and rel_err(t, n, floor=1.0, relative_to="max_b") < 1e-6


@pytest.mark.parametrize("l2", [False, True])
def test_textbook_gradgradcheck(l2):
    """``npattn.gradgradcheck`` on the textbook pair: every gradient along every input and
    ``dout``, and the Hessian's symmetry."""
    q, k, v, g, beta, s0 = _inputs(np.random.default_rng(5), lead=(1, 2), steps=4)
    report = npattn.gradgradcheck(R.kimi_delta_attention, q, k, v, g, beta, initial_state=s0, use_qk_l2norm=l2)
    assert report.ok, str(report)
    assert len(report.rows) == 6 * 7 + 1  # six gradients along six inputs and dout, and the symmetry row


@pytest.mark.parametrize("l2", [False, True])
@pytest.mark.parametrize("with_state", [False, True])
def test_textbook_matches_torch_jvp_of_vjp(torch_or_skip, l2, with_state):
    """``torch.func.jvp`` of ``torch.func.vjp`` of the explicit recurrence, float64, 1e-10."""
    torch = torch_or_skip
    rng = np.random.default_rng(7 + 2 * l2 + with_state)
    primals = _inputs(rng, init=with_state)
    tangents, dout, ddout, dfin, ddfin = _draws(rng, primals)
    n = len(primals)

    def grads_of(*args):
        fn = lambda *p: torch_delta_rule(torch, *p, l2=l2, final=with_state)  # noqa: E731
        _, vjp = torch.func.vjp(fn, *args[:n])
        return vjp((args[n], args[n + 1]) if with_state else args[n])

    upstream, tupstream = ((dout, dfin), (ddout, ddfin)) if with_state else ((dout,), (ddout,))
    args = tuple(torch.tensor(a) for a in primals + upstream)
    want_grads, want_tans = torch.func.jvp(grads_of, args, tuple(torch.tensor(a) for a in tangents + tupstream))
    grads, tans = R.kimi_delta_attention_backward_jvp(dout, _cache(R, primals, l2), tangents, ddout, dfin, ddfin)
    grads, tans = [x for x in grads if x is not None], [x for x in tans if x is not None]
    assert len(grads) == len(tans) == len(want_grads) == n
    for g_, t_, wg, wt in zip(grads, tans, want_grads, want_tans):
        assert rel_err(g_, wg, floor=1.0, relative_to="max_b") < 1e-10
        assert rel_err(t_, wt, floor=1.0, relative_to="max_b") < 1e-10


def test_textbook_a_decay_shared_by_the_channels_is_the_gated_delta_rule():
    """``g`` and ``tg`` the same in every channel: the gated delta rule's second order, ``tdg`` the
    sum over the channels (a shared decay gets the sum of its uses' gradients)."""
    rng = np.random.default_rng(9)
    q, k, v, g, beta, s0 = _inputs(rng)
    tangents, dout, ddout, dfin, ddfin = _draws(rng, (q, k, v, g, beta, s0))
    shared, tshared = g[..., 0], tangents[3][..., 0]
    dk = q.shape[-1]
    kda = R.kimi_delta_attention_backward_jvp(
        dout,
        _cache(R, (q, k, v, np.repeat(shared[..., None], dk, -1), beta, s0), True),
        tangents[:3] + (np.repeat(tshared[..., None], dk, -1),) + tangents[4:],
        ddout,
        dfin,
        ddfin,
    )
    gdr = R.gated_delta_rule_backward_jvp(
        dout,
        R.gated_delta_rule(q, k, v, shared, beta, initial_state=s0, use_qk_l2norm=True, output_final_state=True)[1],
        tangents[:3] + (tshared,) + tangents[4:],
        ddout,
        dfin,
        ddfin,
    )
    for a, b in zip(kda[0] + kda[1], gdr[0] + gdr[1]):
        a = a.sum(-1) if a.ndim != b.ndim else a  # dg, tdg: one per channel
        assert rel_err(a, b, floor=1.0, relative_to="max_b") < 1e-12


def test_textbook_none_is_zero():
    rng = np.random.default_rng(11)
    primals = _inputs(rng)
    _, dout, _, _, _ = _draws(rng, primals)
    grads, tans = R.kimi_delta_attention_backward_jvp(dout, _cache(R, primals, True), None)
    assert all(t.shape == g.shape and not t.any() for g, t in zip(grads, tans))


# -- the chunked fast tier ---------------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(delta_rule_inputs(max_len=12, max_dim=4), st.integers(0, 2**32 - 1))
def test_chunked_equals_textbook(case, seed):
    """Shapes (0-2 batch axes, 1-2 heads, L up to 12), chunk sizes from 1 to past L, with and
    without the initial state, the l2 norm, the final state and its gradient (and their tangents):
    the chunked second order's gradients are exactly its backward's, its tangents the textbook's
    to 1e-12, float64 throughout."""
    rng = np.random.default_rng(seed)
    dk = case.q.shape[-1]
    g = case.g[..., None] * rng.uniform(0.0, 3.0, case.g.shape + (dk,))  # a decay per channel
    primals = (case.q, case.k, case.v, g, case.beta) + (() if case.initial_state is None else (case.initial_state,))
    tangents = tuple(None if rng.random() < 0.2 else rng.standard_normal(p.shape) for p in primals)
    ddout = rng.standard_normal(case.dout.shape)
    dfin = case.dfinal_state if case.output_final_state else None
    ddfin = None if dfin is None else rng.standard_normal(dfin.shape)
    kw = case.kwargs()
    fast = F.kimi_delta_attention(*primals[:5], chunk_size=case.chunk_size, **kw)[1]
    grads, tans = F.kimi_delta_attention_backward_jvp(case.dout, fast, tangents, ddout, dfin, ddfin)
    for a, b in zip(grads, F.kimi_delta_attention_backward(case.dout, fast, dfin)):
        assert (a is None) == (b is None)
        if a is not None:
            np.testing.assert_array_equal(a, b)
    textbook = R.kimi_delta_attention(*primals[:5], **kw)[1]
    want = R.kimi_delta_attention_backward_jvp(case.dout, textbook, tangents, ddout, dfin, ddfin)[1]
    for t, w in zip(tans, want):
        assert (t is None) == (w is None)
        if t is not None:
            assert t.dtype == np.float64 and t.shape == w.shape
            assert rel_err(t, w, floor=1.0, relative_to="max_b") < 1e-12


@pytest.mark.parametrize("chunk", [1, 2, 3, 16])
@pytest.mark.parametrize("l2", [False, True])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_against_central_differences_of_its_backward(chunk, l2, with_state):
    """7 steps: a partial last chunk but for C = 1; against central differences of the chunked
    backward along every input, ``dout`` and ``dfinal_state``."""
    rng = np.random.default_rng(20 + chunk + 4 * l2 + 8 * with_state)
    primals = _inputs(rng, steps=7, init=with_state)
    tangents, dout, ddout, dfin, ddfin = _draws(rng, primals)
    cache = _cache(F, primals, l2, chunk_size=chunk)
    _, tans = F.kimi_delta_attention_backward_jvp(dout, cache, tangents, ddout, dfin, ddfin)
    numeric = _central(F, primals, l2, tangents, dout, ddout, dfin, ddfin, chunk_size=chunk)
    for t, n in zip(tans, numeric):
        assert (t is None) == (n is None)
        if t is not None:
            assert np.any(n) and rel_err(t, n, floor=1.0, relative_to="max_b") < 1e-6


@pytest.mark.parametrize("block", [None, 1, 300, 5000])
def test_chunked_every_block_and_row_group_same_numbers(monkeypatch, block):
    """L = 23 with strong decays in some channels: blocks of the default size, of one chunk of one
    row each, of a few chunks, of a few rows (the batch split into row groups): the textbook's
    numbers every time."""
    rng = np.random.default_rng(31)
    primals = _inputs(rng, lead=(2, 3), steps=23, dk=4, dv=3)
    primals[3][0, 1, 9:12, :2] = -30.0  # e^{gamma} underflows inside a chunk, in two channels
    tangents, dout, ddout, dfin, ddfin = _draws(rng, primals)
    want = R.kimi_delta_attention_backward_jvp(dout, _cache(R, primals, True), tangents, ddout, dfin, ddfin)[1]
    if block is not None:
        monkeypatch.setattr(delta_rule, "_BLOCK", block)
    for chunk in (4, 16):
        cache = _cache(F, primals, True, chunk_size=chunk)
        tans = F.kimi_delta_attention_backward_jvp(dout, cache, tangents, ddout, dfin, ddfin)[1]
        for t, w in zip(tans, want):
            assert rel_err(t, w, floor=1.0, relative_to="max_b") < 1e-12


def test_chunked_gradgradcheck_and_float32():
    q, k, v, g, beta, s0 = _inputs(np.random.default_rng(33), lead=(1, 2), steps=6)
    kw = dict(initial_state=s0, use_qk_l2norm=True, chunk_size=4)
    report = npattn.gradgradcheck(F.kimi_delta_attention, q, k, v, g, beta, **kw)
    assert report.ok, str(report)
    args = tuple(a.astype(np.float32) for a in (q, k, v, g, beta))
    _, cache = F.kimi_delta_attention(*args, use_qk_l2norm=True, chunk_size=4)
    rng = np.random.default_rng(34)
    tangents = tuple(rng.standard_normal(a.shape) for a in args)
    dout = rng.standard_normal(v.shape).astype(np.float32)
    _, tans = F.kimi_delta_attention_backward_jvp(dout, cache, tangents, dout[..., ::-1, :].copy())
    assert all(t.dtype == np.float32 and np.isfinite(t).all() for t in tans[:5]) and tans[5] is None
    _, none = F.kimi_delta_attention_backward_jvp(dout, cache, None)
    assert all(t.dtype == np.float32 and not t.any() for t in none[:5])


def test_chunked_bad_arguments_are_refused_naming_them():
    rng = np.random.default_rng(35)
    primals = _inputs(rng, init=False)
    tangents, dout, ddout, _, _ = _draws(rng, primals)
    cache = _cache(F, primals, False, chunk_size=2)
    fn = F.kimi_delta_attention_backward_jvp
    with pytest.raises(ValueError, match="tinitial_state.*expected None"):
        fn(dout, cache, tangents + (np.zeros((2, 2, 3, 2)),), ddout)
    with pytest.raises(ValueError, match="tg"):
        fn(dout, cache, (None, None, None, primals[3][..., 0]), ddout)
    with pytest.raises(ValueError, match="ddfinal_state"):
        fn(dout, cache, tangents, ddout, None, np.zeros((2, 2, 3)))
    with pytest.raises(ValueError, match="ddout"):
        fn(dout, cache, tangents, np.zeros((2, 2, 5, 3)))
    with pytest.raises(TypeError, match="at most 6"):
        fn(dout, cache, tangents + (None, None), ddout)
    gated = F.gated_delta_rule(*primals[:3], primals[3][..., 0], primals[4])[1]
    with pytest.raises(TypeError, match="cache: kimi_delta_attention_backward_jvp expected a KimiDeltaAttentionCache"):
        fn(dout, gated, tangents, ddout)
    with pytest.raises(TypeError, match="cache: gated_delta_rule_backward_jvp expected a GatedDeltaRuleCache"):
        F.gated_delta_rule_backward_jvp(dout, cache, None)


def test_fast_cache_shares_the_gated_delta_rules_fields():
    """The two chunked caches are written once (``delta_rule.DeltaRuleCache``): the same fields,
    each rule its own name, neither accepted by the other's backward."""
    primals = _inputs(np.random.default_rng(36), init=False)
    cache = _cache(F, primals, False, chunk_size=2)
    assert type(cache) is kda.KimiDeltaAttentionCache and cache._fields == delta_rule.GatedDeltaRuleCache._fields
    assert isinstance(cache, delta_rule.DeltaRuleCache) and not isinstance(cache, delta_rule.GatedDeltaRuleCache)
    assert repr(cache).startswith("KimiDeltaAttentionCache(q=") and type(cache._replace(scale=1.0)) is type(cache)


def test_npattn_check_covers_kda():
    """``npattn check`` (both orders) runs the chunked pair and the KimiDeltaAttention layer."""
    from npattn.tools.check import cases

    for order in (1, 2):
        found = {n: t for n, t in cases(0, order=order) if n.startswith(("kimi_delta_attention", "KimiDelta"))}
        assert len(found) == 2, sorted(found)
        for name, thunk in found.items():
            assert thunk().ok, (order, name)


@pytest.mark.parametrize("upstream", ["dout", "ddout"])
@pytest.mark.parametrize("step", [2, 4, 5, 8])
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_chunked_non_finite_upstream_reaches_what_the_textbook_reaches(upstream, step, value):
    """A NaN or inf in ``dout`` or ``ddout`` at one step (chunks of 4: inside a chunk, at a border,
    in the padded last chunk): the gradients and their tangents are finite exactly where the
    textbook tier's are, and equal there (as the gated delta rule's second order)."""
    rng = np.random.default_rng(40 + step)
    primals = _inputs(rng, lead=(1, 2), steps=9, init=False)
    tangents, dout, ddout, _, _ = _draws(rng, primals)
    (dout if upstream == "dout" else ddout)[0, 1, step, 0] = value
    with np.errstate(all="ignore"):
        fast = F.kimi_delta_attention_backward_jvp(dout, _cache(F, primals, True, chunk_size=4), tangents, ddout)
        ref = R.kimi_delta_attention_backward_jvp(dout, _cache(R, primals, True), tangents, ddout)
    assert not all(np.isfinite(t).all() for t in ref[1][:5])  # the value reaches the tangents
    for a, b in zip(fast[0][:5] + fast[1][:5], ref[0][:5] + ref[1][:5]):
        finite = np.isfinite(b)
        np.testing.assert_array_equal(np.isfinite(a), finite)
        assert rel_err(a[finite], b[finite], floor=1.0, relative_to="max_b") < 1e-12


@pytest.mark.parametrize("steps", [(0,), (3,), (4,), (1, 2), (5, 7)])
@pytest.mark.parametrize("channels", [slice(None), slice(1, 2)], ids=["all", "one"])
def test_chunked_full_resets_stay_finite_and_equal_the_textbook(steps, channels):
    """``g = -inf`` (the state's rows forgotten) at chunk borders, inside a chunk, twice in one, in
    every channel or one: no floating-point exception in the chunked second order (every
    exponent a sum, nothing divided), finite, the textbook's numbers."""
    rng = np.random.default_rng(50 + len(steps))
    primals = _inputs(rng, lead=(1, 2), steps=9)
    for s in steps:
        primals[3][..., s, channels] = -np.inf
    tangents, dout, ddout, dfin, ddfin = _draws(rng, primals)
    with np.errstate(all="raise"):
        _, tans = F.kimi_delta_attention_backward_jvp(
            dout, _cache(F, primals, True, chunk_size=4), tangents, ddout, dfin, ddfin
        )
    with np.errstate(all="ignore"):  # exp(-inf) in the recurrence
        _, want = R.kimi_delta_attention_backward_jvp(dout, _cache(R, primals, True), tangents, ddout, dfin, ddfin)
    for t, w in zip(tans, want):
        assert np.isfinite(t).all() and rel_err(t, w, floor=1.0, relative_to="max_b") < 1e-12

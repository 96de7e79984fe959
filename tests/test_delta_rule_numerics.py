"""The chunked gated_delta_rule where its arithmetic differs most from the recurrence's.

* Non-finite values (issue 28, item 8): a NaN or inf at step t reaches exactly the outputs,
  gradients and tangents that it reaches in the step-by-step textbook tier (so no output before t
  in the forward and the JVP, no gradient after t from ``dout``), inside a chunk and at chunk
  borders; a full reset ``g = -inf`` gives the textbook tier's finite numbers.
* Strong decays in float32 (item 9): ``g = -3e4`` at any step of a chunk, then weak decays: the
  float32 forward, backward and JVP stay within 1e-4 of float64.
* The second order (``gated_delta_rule_backward_jvp``, issue 31) keeps both: no later step reached
  from ``dout`` or ``ddout``, a full reset finite, float32 within 1e-4 after a strong decay.
"""

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import npattn.functional as F
from npattn.functional import reference as R

NAMES = ("q", "k", "v", "g", "beta", "initial_state")
CHUNK, STEPS = 4, 13  # chunks [0, 4), [4, 8), [8, 12), [12, 13) (the last one padded)
POSITIONS = (0, 2, 3, 4, 7, 8, 12)  # chunk starts and ends, inside a chunk, the padded chunk


def _case(rng, lead=(1, 2), steps=STEPS, dk=3, dv=4):
    return dict(
        q=rng.standard_normal(lead + (steps, dk)),
        k=rng.standard_normal(lead + (steps, dk)),
        v=rng.standard_normal(lead + (steps, dv)),
        g=-np.logaddexp(0.0, rng.standard_normal(lead + (steps,))),
        beta=1.0 / (1.0 + np.exp(-rng.standard_normal(lead + (steps,)))),
        initial_state=rng.standard_normal(lead + (dk, dv)),
    )


def _tangents(rng, c):
    return [rng.standard_normal(c[n].shape) for n in NAMES]


def _run(c, dout, dfinal, tangents):
    """(fast, textbook) pairs of outputs, gradients and tangents, the fast tier in chunks of 4."""
    kw = dict(use_qk_l2norm=True, output_final_state=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # inf - inf, 0 * inf in both tiers
        results = []
        for tier, extra in ((F, dict(chunk_size=CHUNK)), (R, {})):
            out, cache = tier.gated_delta_rule(**c, **kw, **extra)
            grads = tier.gated_delta_rule_backward(dout, cache, dfinal)
            tout, tfinal = tier.gated_delta_rule_jvp(cache, *tangents)
            results.append((out, cache.final_state, *grads, tout, tfinal))
    return results


def _same_where_finite(fast, ref, what):
    """The fast tier is finite exactly where the textbook tier is, and equal to it there."""
    for name, a, b in zip(("out", "final_state") + tuple("d" + n for n in NAMES) + ("tout", "tfinal"), fast, ref):
        fa, fb = np.isfinite(a), np.isfinite(b)
        assert np.array_equal(fa, fb), (what, name, np.argwhere(fa != fb)[:5])
        err = float(np.max(np.abs(np.subtract(a, b, out=np.zeros(b.shape), where=fb)), initial=0.0))
        assert err <= 1e-10 * max(1.0, float(np.max(np.abs(np.where(fb, b, 0.0))))), (what, name, err)


@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_input_reaches_what_it_reaches_in_the_recurrence(name, value):
    """Before the fix a NaN in k at step 4 made the outputs of steps 0-3 NaN too (``0 * NaN``
    across the zeros of the chunk's triangular matrices) and ``g = -inf`` gave NaN over the chunk
    (``-inf - -inf``).  In head 1 only: head 0 stays finite throughout."""
    rng = np.random.default_rng(0)
    for t in POSITIONS:
        c = _case(rng)
        c[name][0, 1, t] = value
        dout = rng.standard_normal(c["v"].shape)
        dfinal = rng.standard_normal(c["initial_state"].shape)
        fast, ref = _run(c, dout, dfinal, _tangents(rng, c))
        _same_where_finite(fast, ref, (name, value, t))
        out, tout = fast[0], fast[-2]
        assert np.isfinite(out[0, 1, :t]).all() and np.isfinite(tout[0, 1, :t]).all()  # nothing before t
        assert np.isfinite(out[0, 0]).all() and all(np.isfinite(x[0, 0]).all() for x in fast)  # other head


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_upstream_gradient_reaches_no_later_step(value):
    """A NaN or inf in ``dout`` at step t reaches the gradients of steps <= t only (the state's
    adjoint runs backwards), as in the recurrence; before the fix it spread over t's chunk."""
    rng = np.random.default_rng(1)
    for t in POSITIONS:
        c = _case(rng)
        dout = rng.standard_normal(c["v"].shape)
        dout[0, 1, t, 2] = value
        fast, ref = _run(c, dout, rng.standard_normal(c["initial_state"].shape), _tangents(rng, c))
        _same_where_finite(fast, ref, (value, t))
        for grad in fast[2:7]:  # dq, dk, dv, dg, dbeta
            assert np.isfinite(grad[0, 1, t + 1 :]).all()
        assert not np.isfinite(fast[7][0, 1]).all()  # dinitial_state


@pytest.mark.parametrize("value", [np.nan, np.inf])
@pytest.mark.parametrize("which", ["dout", "ddout"])
def test_second_order_non_finite_upstream_reaches_no_later_step(which, value):
    """``gated_delta_rule_backward_jvp`` keeps the first order's causality: a NaN or inf in
    ``dout`` or ``ddout`` at step t reaches the gradients and their tangents of steps <= t only,
    finite exactly where the textbook tier's are and equal to them there."""
    rng = np.random.default_rng(3)
    for t in POSITIONS:
        c = _case(rng)
        dout, ddout = rng.standard_normal(c["v"].shape), rng.standard_normal(c["v"].shape)
        (dout if which == "dout" else ddout)[0, 1, t, 2] = value
        tangents = _tangents(rng, c)
        dfinal, ddfinal = (rng.standard_normal(c["initial_state"].shape) for _ in range(2))
        results = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            for tier, extra in ((F, dict(chunk_size=CHUNK)), (R, {})):
                _, cache = tier.gated_delta_rule(**c, use_qk_l2norm=True, output_final_state=True, **extra)
                grads, tans = tier.gated_delta_rule_backward_jvp(dout, cache, tangents, ddout, dfinal, ddfinal)
                results.append(grads + tans)
        for i, (a, b) in enumerate(zip(*results)):
            fa, fb = np.isfinite(a), np.isfinite(b)
            assert np.array_equal(fa, fb), (which, value, t, i, np.argwhere(fa != fb)[:5])
            err = float(np.max(np.abs(np.subtract(a, b, out=np.zeros(b.shape), where=fb)), initial=0.0))
            assert err <= 1e-10 * max(1.0, float(np.max(np.abs(np.where(fb, b, 0.0))))), (which, t, i, err)
        fast = results[0]
        for x in fast[:5] + fast[6:11]:  # dq .. dbeta and their tangents
            assert np.isfinite(x[0, 1, t + 1 :]).all(), (which, value, t)
        assert not np.isfinite(fast[11][0, 1]).all()  # dinitial_state's tangent


@pytest.mark.parametrize("value", [np.nan, np.inf])
@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta"])
def test_non_finite_tangent_reaches_no_earlier_step(name, value):
    rng = np.random.default_rng(2)
    for t in POSITIONS:
        c = _case(rng)
        tangents = _tangents(rng, c)
        tangents[NAMES.index(name)][0, 1, t] = value
        dout = rng.standard_normal(c["v"].shape)
        fast, ref = _run(c, dout, rng.standard_normal(c["initial_state"].shape), tangents)
        _same_where_finite(fast, ref, (name, value, t))
        assert np.isfinite(fast[-2][0, 1, :t]).all()


@pytest.mark.parametrize("steps", [(0,), (3,), (4,), (5,), (12,), (1, 2), (5, 7), (2, 4, 6, 8)])
def test_full_reset_equals_the_recurrence(steps):
    """``g = -inf`` (the state forgotten) at chunk borders, inside chunks, twice in one chunk:
    forward, backward and JVP finite and equal to the textbook tier (before: NaN over the chunk)."""
    rng = np.random.default_rng(3)
    c = _case(rng)
    c["g"][..., list(steps)] = -np.inf
    dout, dfinal = rng.standard_normal(c["v"].shape), rng.standard_normal(c["initial_state"].shape)
    fast, ref = _run(c, dout, dfinal, _tangents(rng, c))
    for a, b in zip(fast, ref):
        assert np.isfinite(a).all()
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-12 * max(1.0, float(np.abs(b).max())))


# ----------------------------------------------------------------------------- float32 strong decays


def _float32_against_float64(position, strength=-3e4, steps=130, seed=0):
    """Largest errors of float32 (forward, each gradient, JVP) against float64 on the same inputs,
    relative to max(1, max |float64|): ``g = -0.01`` everywhere but ``strength`` at ``position``."""
    rng = np.random.default_rng(seed)
    c = _case(rng, lead=(1, 2), steps=steps, dk=16, dv=8)
    c["g"] = np.full(c["g"].shape, -0.01)
    c["g"][..., position] = strength
    c = {n: a.astype(np.float32).astype(np.float64) for n, a in c.items()}  # the same numbers in both
    dout = rng.standard_normal(c["v"].shape).astype(np.float32)
    tangents = [t.astype(np.float32) for t in _tangents(rng, c)]
    results = []
    for dtype in (np.float64, np.float32):
        out, cache = F.gated_delta_rule(**{n: a.astype(dtype) for n, a in c.items()}, use_qk_l2norm=True)
        grads = F.gated_delta_rule_backward(dout.astype(dtype), cache)
        tout = F.gated_delta_rule_jvp(cache, *(t.astype(dtype) for t in tangents))
        results.append((out, *grads, tout))
    return [float(np.abs(a - b).max()) / max(1.0, float(np.abs(b).max())) for a, b in zip(results[1], results[0])]


def test_float32_after_a_strong_decay_at_the_first_step():
    """The issue's case: before the fix 1.9e-3 off in the forward (the running sum of the decays,
    -30000.0098 in float32, loses the weak decays' digits)."""
    assert max(_float32_against_float64(0)) < 1e-4


@settings(max_examples=25, deadline=None)
@given(position=st.integers(0, 129), strength=st.sampled_from([-3e4, -1e3, -200.0]))
def test_float32_after_a_strong_decay_anywhere(position, strength):
    """Wherever the strong decay falls in a chunk of 64 (and in the shorter last chunk)."""
    assert max(_float32_against_float64(position, strength)) < 1e-4


@pytest.mark.parametrize("position", [0, 37, 64, 129])
def test_second_order_full_reset_and_float32_strong_decay(position):
    """``gated_delta_rule_backward_jvp`` on the first order's hard cases: ``g = -inf`` twice in a
    chunk and at a border gives the textbook tier's finite numbers; ``g = -3e4`` at ``position``
    then weak decays keeps float32 within 1e-4 of float64 (sums of spans, as the first order)."""
    rng = np.random.default_rng(4)
    c = _case(rng)
    c["g"][..., [2, 3, 8]] = -np.inf
    dout, ddout = rng.standard_normal(c["v"].shape), rng.standard_normal(c["v"].shape)
    dfinal, ddfinal = (rng.standard_normal(c["initial_state"].shape) for _ in range(2))
    tangents = _tangents(rng, c)
    results = []
    for tier, extra in ((F, dict(chunk_size=CHUNK)), (R, {})):
        _, cache = tier.gated_delta_rule(**c, use_qk_l2norm=True, output_final_state=True, **extra)
        grads, tans = tier.gated_delta_rule_backward_jvp(dout, cache, tangents, ddout, dfinal, ddfinal)
        results.append(grads + tans)
    for a, b in zip(*results):
        assert np.isfinite(a).all()
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-12 * max(1.0, float(np.abs(b).max())))

    c = _case(rng, lead=(1, 2), steps=130, dk=16, dv=8)
    c["g"] = np.full(c["g"].shape, -0.01)
    c["g"][..., position] = -3e4
    c = {n: a.astype(np.float32).astype(np.float64) for n, a in c.items()}  # the same numbers in both
    dout, ddout = (rng.standard_normal(c["v"].shape).astype(np.float32) for _ in range(2))
    tangents = [t.astype(np.float32) for t in _tangents(rng, c)]
    results = []
    for dtype in (np.float64, np.float32):
        _, cache = F.gated_delta_rule(**{n: a.astype(dtype) for n, a in c.items()}, use_qk_l2norm=True)
        cast = [t.astype(dtype) for t in tangents]
        grads, tans = F.gated_delta_rule_backward_jvp(dout.astype(dtype), cache, cast, ddout.astype(dtype))
        results.append(grads + tans)
    for a, b in zip(results[1], results[0]):
        assert a.dtype == np.float32
        assert float(np.abs(a - b).max()) / max(1.0, float(np.abs(b).max())) < 1e-4

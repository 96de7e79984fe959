"""Kimi Delta Attention (``kimi_delta_attention``): the gated delta rule with a log decay per key
channel, textbook recurrence and chunked fast tier.

* both tiers against central differences (gradients, final state's gradient, JVP), float64;
* the textbook tier against transformers' own ``recurrent_kimi_delta_attention`` and
  ``chunk_kimi_delta_attention`` (kimi_linear; float32 casts made float64), gradients by autograd;
* the fast tier equal to the textbook one (1e-12), hypothesis over shapes, chunk sizes and options;
* a decay the same in every channel is ``gated_delta_rule`` (both tiers, gradients, JVP);
* float32 after strong decays (anywhere in a chunk, in some channels only) within 1e-4 of float64;
* a NaN or inf reaches what it reaches in the recurrence; ``g = -inf`` resets stay finite;
* bad input named.
"""

import warnings

import numpy as np
import pytest
from _fd import fd_gradients
from _oracles import rel_err
from hypothesis import given, settings
from hypothesis import strategies as st

import npattn.functional as F
from npattn.functional import delta_rule
from npattn.functional import reference as R
from npattn.testing import delta_rule_inputs

NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def close(a, b, tol=1e-12):
    """max |a - b| <= tol * max(1, max |b|)."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    if a.size == 0:
        return
    err = float(np.max(np.abs(a - b)))
    assert err <= tol * max(1.0, float(np.max(np.abs(b)))), err


def _case(rng, lead=(2, 3), steps=9, dk=4, dv=5, init=True):
    return dict(
        q=rng.standard_normal(lead + (steps, dk)),
        k=rng.standard_normal(lead + (steps, dk)),
        v=rng.standard_normal(lead + (steps, dv)),
        g=-np.logaddexp(0.0, 2.0 * rng.standard_normal(lead + (steps, dk))),  # channels decay unlike each other
        beta=1.0 / (1.0 + np.exp(-rng.standard_normal(lead + (steps,)))),
        initial_state=rng.standard_normal(lead + (dk, dv)) if init else None,
    )


def _loss(tier, c, dout, dfinal, **kw):
    def loss(*xs):
        out, cache = tier.kimi_delta_attention(*xs[:5], initial_state=xs[5], output_final_state=True, **kw)
        return np.sum(out * dout) + np.sum(cache.final_state * dfinal)

    return loss


@pytest.mark.parametrize(
    "tier, kw", [(R, {}), (F, dict(chunk_size=2)), (F, dict(chunk_size=3))], ids=["textbook", "fast-2", "fast-3"]
)
@pytest.mark.parametrize("l2", [False, True])
def test_gradients_against_central_differences(tier, kw, l2):
    """L = 5 in chunks of 2 or 3: chunk borders and a padded last chunk; every input, the initial
    state included, with random dout and a random gradient reaching the final state."""
    rng = np.random.default_rng(2)
    c = _case(rng, lead=(1, 2), steps=5, dk=3, dv=2)
    dout, dfinal = rng.standard_normal((1, 2, 5, 2)), rng.standard_normal((1, 2, 3, 2))
    arrays = [c[n] for n in NAMES]
    _, cache = tier.kimi_delta_attention(
        *arrays[:5], initial_state=arrays[5], output_final_state=True, use_qk_l2norm=l2, **kw
    )
    grads = tier.kimi_delta_attention_backward(dout, cache, dfinal)
    numerical = fd_gradients(_loss(tier, c, dout, dfinal, use_qk_l2norm=l2, **kw), arrays)
    for name, got, num in zip(NAMES, grads, numerical):
        assert got.shape == num.shape, name
        assert rel_err(got, num) < 1e-6, name


@pytest.mark.parametrize("tier, kw", [(R, {}), (F, dict(chunk_size=2))], ids=["textbook", "fast"])
def test_jvp_against_central_differences(tier, kw):
    """The tangent of the output and of the final state along random tangents of every input."""
    rng = np.random.default_rng(3)
    c = _case(rng, lead=(1, 2), steps=5, dk=3, dv=2)
    tangents = [rng.standard_normal(c[n].shape) for n in NAMES]
    opts = dict(output_final_state=True, use_qk_l2norm=True, **kw)

    def run(eps):
        moved = {n: c[n] + eps * t for n, t in zip(NAMES, tangents)}
        out, cache = tier.kimi_delta_attention(**moved, **opts)
        return out, cache.final_state

    _, cache = tier.kimi_delta_attention(**c, **opts)
    tout, tfinal = tier.kimi_delta_attention_jvp(cache, *tangents)
    eps = 1e-6
    (up, up_s), (down, down_s) = run(eps), run(-eps)
    assert rel_err(tout, (up - down) / (2 * eps)) < 1e-6
    assert rel_err(tfinal, (up_s - down_s) / (2 * eps)) < 1e-6


def test_final_state_gradient_alone_and_across_a_split():
    """Two calls, the second starting from the first's final state, give the one-pass output; the
    gradient reaches the first call through dfinal_state = the second's dinitial_state."""
    rng = np.random.default_rng(5)
    c = _case(rng, steps=20, init=False)
    out, cache = F.kimi_delta_attention(**c, use_qk_l2norm=True, chunk_size=6)

    def part(a, s):
        return a[..., s, :] if a.ndim == 4 else a[..., s]

    first = {n: part(a, slice(0, 8)) for n, a in c.items() if a is not None}
    second = {n: part(a, slice(8, None)) for n, a in c.items() if a is not None}
    o1, c1 = F.kimi_delta_attention(**first, use_qk_l2norm=True, output_final_state=True, chunk_size=6)
    o2, c2 = F.kimi_delta_attention(**second, initial_state=c1.final_state, use_qk_l2norm=True, chunk_size=6)
    close(np.concatenate([o1, o2], axis=-2), out)
    dout = rng.standard_normal(out.shape)
    full = F.kimi_delta_attention_backward(dout, cache)
    g2 = F.kimi_delta_attention_backward(dout[..., 8:, :], c2)
    g1 = F.kimi_delta_attention_backward(dout[..., :8, :], c1, g2[5])
    for i in range(5):
        close(np.concatenate([g1[i], g2[i]], axis=-2 if full[i].ndim == 4 else -1), full[i])
    # only a gradient at the final state: every input's gradient against central differences
    s = {n: a[:1, :1] for n, a in first.items()}
    dfinal = rng.standard_normal((1, 1, 4, 5))
    _, cs = R.kimi_delta_attention(**s, output_final_state=True)
    grads = R.kimi_delta_attention_backward(np.zeros((1, 1, 8, 5)), cs, dfinal)

    def loss(*xs):
        return np.sum(R.kimi_delta_attention(*xs, output_final_state=True)[1].final_state * dfinal)

    for got, num in zip(grads, fd_gradients(loss, [s[n] for n in NAMES[:5]])):
        assert rel_err(got, num) < 1e-6
    fast = F.kimi_delta_attention_backward(
        np.zeros((1, 1, 8, 5)), F.kimi_delta_attention(**s, output_final_state=True, chunk_size=3)[1], dfinal
    )
    for a, b in zip(fast[:5], grads[:5]):
        close(a, b)


# ------------------------------------------------------------------------------------ transformers


@pytest.mark.parametrize("l2", [False, True])
def test_matches_transformers_kimi_linear_functions(l2):
    """transformers' own ``recurrent_kimi_delta_attention`` and ``chunk_kimi_delta_attention``
    (kimi_linear; every float32 cast made float64 by ``_hf64.float64_reference``): outputs, final
    state and every gradient by autograd, against both tiers; L = 70 (more than one of their
    chunks of 64, not a multiple of it).  transformers takes ``(B, L, H, ...)`` and no scale
    (always ``1/sqrt(Dk)``, npattn's default)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from _hf64 import float64_reference
    from transformers.models.kimi_linear import modeling_kimi_linear as hf

    rng = np.random.default_rng(17)
    c = _case(rng, lead=(2, 3), steps=70, dk=4, dv=5)
    opts = dict(output_final_state=True, use_qk_l2norm=l2)
    dout, dfinal = rng.standard_normal((2, 3, 70, 5)), rng.standard_normal((2, 3, 4, 5))
    ours = []
    for tier, kw in ((R, {}), (F, dict(chunk_size=16))):
        out, cache = tier.kimi_delta_attention(**c, **opts, **kw)
        ours.append((out, cache.final_state, tier.kimi_delta_attention_backward(dout, cache, dfinal)))

    def heads_second(a):  # npattn's (B, H, L, ...) <-> transformers' (B, L, H, ...)
        return np.ascontiguousarray(np.swapaxes(a, 1, 2))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback-to-PyTorch notice
        for fn in (hf.recurrent_kimi_delta_attention, hf.chunk_kimi_delta_attention):
            with float64_reference():
                ts = [torch.tensor(heads_second(c[n]), requires_grad=True) for n in NAMES[:5]]
                s0 = torch.tensor(c["initial_state"], requires_grad=True)
                o, s = fn(*ts, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=l2)
                assert o.dtype == torch.float64
                ((o * torch.tensor(heads_second(dout))).sum() + (s * torch.tensor(dfinal)).sum()).backward()
            for out, final, grads in ours:
                close(out, heads_second(o.detach().numpy()), 1e-10)
                close(final, s.detach().numpy(), 1e-10)
                for got, t in zip(grads[:5], ts):
                    close(got, heads_second(t.grad.numpy()), 1e-10)
                close(grads[5], s0.grad.numpy(), 1e-10)


# ------------------------------------------------------------------------------ fast == textbook


def _tangents(rng, c):
    return [None if c[n] is None else rng.standard_normal(c[n].shape) for n in NAMES]


@settings(max_examples=60)
@given(delta_rule_inputs(), st.integers(0, 2**32 - 1))
def test_chunked_equals_recurrence(case, seed):
    """Shapes, chunk sizes (L often not a multiple), initial state, l2 norm, final state and its
    gradient from ``delta_rule_inputs``; the scalar decay made a decay per channel."""
    rng = np.random.default_rng(seed)
    dk = case.q.shape[-1]
    g = case.g[..., None] * rng.uniform(0.0, 3.0, case.g.shape + (dk,))
    kw = case.kwargs()
    out, cache = R.kimi_delta_attention(case.q, case.k, case.v, g, case.beta, **kw)
    out2, cache2 = F.kimi_delta_attention(case.q, case.k, case.v, g, case.beta, chunk_size=case.chunk_size, **kw)
    close(out2, out)
    if case.output_final_state:
        close(cache2.final_state, cache.final_state)
    else:
        assert cache2.final_state is None
    g_ref = R.kimi_delta_attention_backward(case.dout, cache, case.dfinal_state)
    g_fast = F.kimi_delta_attention_backward(case.dout, cache2, case.dfinal_state)
    for a, b in zip(g_fast, g_ref):
        if b is None:
            assert a is None
        else:
            assert a.dtype == np.float64
            close(a, b)
    c = dict(q=case.q, k=case.k, v=case.v, g=g, beta=case.beta, initial_state=case.initial_state)
    ts = _tangents(rng, c)
    t_fast, t_ref = F.kimi_delta_attention_jvp(cache2, *ts), R.kimi_delta_attention_jvp(cache, *ts)
    for a, b in zip(*((t,) if isinstance(t, np.ndarray) else t for t in (t_fast, t_ref))):
        close(a, b)


@pytest.mark.parametrize("block", [None, 1, 3000, 40000])
def test_long_sequence_every_chunk_size_and_block_same_numbers(monkeypatch, block):
    """L = 103 (prime), strong and weak decays; chunks in blocks of the default size, of one chunk
    of one row each, of a few chunks, of a few rows (the batch split into row groups)."""
    if block is not None:
        monkeypatch.setattr(delta_rule, "_BLOCK", block)
    rng = np.random.default_rng(3)
    c = _case(rng, lead=(2, 3), steps=103, dk=6, dv=4)
    c["g"][0, 0, 50:60, :3] = -30.0  # decays that underflow e^{gamma} inside a chunk, in some channels
    out, cache = R.kimi_delta_attention(**c, output_final_state=True, use_qk_l2norm=True)
    dout = rng.standard_normal(out.shape)
    ref = R.kimi_delta_attention_backward(dout, cache)
    ts = _tangents(rng, c)
    tref = R.kimi_delta_attention_jvp(cache, *ts)
    for chunk in (1, 7, 32, 64, 103, 500):
        out2, cache2 = F.kimi_delta_attention(**c, output_final_state=True, use_qk_l2norm=True, chunk_size=chunk)
        close(out2, out)
        close(cache2.final_state, cache.final_state)
        n = -(-103 // min(chunk, 103))
        assert cache2.states.shape == (2, 3, n, 6, 4)  # the boundary states, no (L, L) array
        for a, b in zip(F.kimi_delta_attention_backward(dout, cache2), ref):
            close(a, b)
        for a, b in zip(F.kimi_delta_attention_jvp(cache2, *ts), tref):
            close(a, b)


@pytest.mark.parametrize("tier, kw", [(R, {}), (F, dict(chunk_size=4))], ids=["textbook", "fast"])
def test_a_decay_shared_by_the_channels_is_the_gated_delta_rule(tier, kw):
    """``g[..., None]`` broadcast over Dk: the output, final state, dq, dk, dv, dbeta, dS0 and the
    JVP are ``gated_delta_rule``'s, and ``dg`` summed over the channels is its ``dg``."""
    rng = np.random.default_rng(7)
    c = _case(rng, steps=11)
    g = c["g"][..., 0]
    c_kda = dict(c, g=np.repeat(g[..., None], 4, axis=-1))
    c_gdr = dict(c, g=g)
    opts = dict(output_final_state=True, use_qk_l2norm=True, **kw)
    out, cache = tier.kimi_delta_attention(**c_kda, **opts)
    ref, ref_cache = R.gated_delta_rule(**c_gdr, output_final_state=True, use_qk_l2norm=True)
    close(out, ref)
    close(cache.final_state, ref_cache.final_state)
    dout, dfinal = rng.standard_normal(out.shape), rng.standard_normal(ref_cache.final_state.shape)
    grads = tier.kimi_delta_attention_backward(dout, cache, dfinal)
    want = R.gated_delta_rule_backward(dout, ref_cache, dfinal)
    for i in (0, 1, 2, 4, 5):
        close(grads[i], want[i])
    close(grads[3].sum(-1), want[3])
    ts = _tangents(rng, c_gdr)
    tout, tfinal = tier.kimi_delta_attention_jvp(cache, *ts[:3], np.repeat(ts[3][..., None], 4, -1), *ts[4:])
    want_t = R.gated_delta_rule_jvp(ref_cache, *ts)
    close(tout, want_t[0])
    close(tfinal, want_t[1])


def test_float32_stays_float32_default_scale():
    rng = np.random.default_rng(4)
    c = _case(rng, steps=30)
    out64, _ = F.kimi_delta_attention(**c)
    ref, _ = R.kimi_delta_attention(**c, scale=1.0 / np.sqrt(4))
    close(out64, ref)
    out, cache = F.kimi_delta_attention(**{n: a.astype(np.float32) for n, a in c.items()})
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, out64, atol=1e-4)
    grads = F.kimi_delta_attention_backward(rng.standard_normal(out.shape).astype(np.float32), cache)
    assert {a.dtype for a in grads} == {np.dtype(np.float32)}


# ----------------------------------------------------------------------------- float32 strong decays


def _float32_against_float64(position, strength, channels, steps=130, seed=0):
    """Largest errors of float32 (forward, each gradient, JVP) against float64 on the same inputs,
    relative to max(1, max |float64|): ``g = -0.01`` everywhere but ``strength`` at ``position`` in
    the ``channels`` given (the others keep their weak decay)."""
    rng = np.random.default_rng(seed)
    c = _case(rng, lead=(1, 2), steps=steps, dk=16, dv=8)
    c["g"] = np.full(c["g"].shape, -0.01)
    c["g"][..., position, channels] = strength
    c = {n: a.astype(np.float32).astype(np.float64) for n, a in c.items()}  # the same numbers in both
    dout = rng.standard_normal(c["v"].shape).astype(np.float32)
    tangents = [t.astype(np.float32) for t in _tangents(rng, c)]
    results = []
    for dtype in (np.float64, np.float32):
        out, cache = F.kimi_delta_attention(**{n: a.astype(dtype) for n, a in c.items()}, use_qk_l2norm=True)
        grads = F.kimi_delta_attention_backward(dout.astype(dtype), cache)
        tout = F.kimi_delta_attention_jvp(cache, *(t.astype(dtype) for t in tangents))
        results.append((out, *grads, tout))
    return [float(np.abs(a - b).max()) / max(1.0, float(np.abs(b).max())) for a, b in zip(results[1], results[0])]


def test_float32_the_factorised_chunk_form_fails_where_this_one_holds():
    """Why the pairwise decays: transformers' ``chunk_kimi_delta_attention`` (``e^{gamma_i - gamma_j}``
    from running sums, FLA's naive form) run in float32 after ``g = -3e4`` at the first step is far
    from its own float64 run; npattn's float32 stays within 1e-4."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from _hf64 import float64_reference
    from transformers.models.kimi_linear import modeling_kimi_linear as hf

    rng = np.random.default_rng(0)
    c = _case(rng, lead=(1, 2), steps=64, dk=16, dv=8, init=False)
    c["g"] = np.full(c["g"].shape, -0.01)
    c["g"][..., 0, :] = -3e4
    del c["initial_state"]
    c = {n: a.astype(np.float32) for n, a in c.items()}
    outs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback-to-PyTorch notice; inf - inf
        args = [torch.tensor(np.swapaxes(c[n], 1, 2).astype(np.float64)) for n in NAMES[:5]]
        with float64_reference():  # its float32 casts made float64
            outs.append(hf.chunk_kimi_delta_attention(*args, use_qk_l2norm_in_kernel=True)[0].numpy())
        args = [a.to(torch.float32) for a in args]
        outs.append(hf.chunk_kimi_delta_attention(*args, use_qk_l2norm_in_kernel=True)[0].numpy())
    theirs = float(np.abs(outs[1] - outs[0]).max()) / max(1.0, float(np.abs(outs[0]).max()))
    assert not theirs < 1e-4, theirs  # inf - inf, or the weak decays' digits lost
    assert max(_float32_against_float64(0, -3e4, slice(None), steps=64)) < 1e-4


@pytest.mark.parametrize("channels", [slice(None), slice(0, 5), [3]], ids=["all", "five", "one"])
def test_float32_after_a_strong_decay_at_the_first_step(channels):
    assert max(_float32_against_float64(0, -3e4, channels)) < 1e-4


@settings(max_examples=25, deadline=None)
@given(
    position=st.integers(0, 129),
    strength=st.sampled_from([-3e4, -1e3, -200.0, -90.0]),
    channels=st.sampled_from([slice(None), slice(0, 5), slice(7, 8)]),
)
def test_float32_after_a_strong_decay_anywhere(position, strength, channels):
    """Wherever the strong decay falls in a chunk of 64 (and in the shorter last chunk), in every
    channel or a few."""
    assert max(_float32_against_float64(position, strength, channels)) < 1e-4


# ----------------------------------------------------------------------------- non-finite values

CHUNK, STEPS = 4, 13  # chunks [0, 4), [4, 8), [8, 12), [12, 13) (the last one padded)
POSITIONS = (0, 2, 3, 4, 7, 8, 12)  # chunk starts and ends, inside a chunk, the padded chunk


def _run(c, dout, dfinal, tangents):
    """(fast, textbook) tuples of outputs, gradients and tangents, the fast tier in chunks of 4."""
    kw = dict(use_qk_l2norm=True, output_final_state=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # inf - inf, 0 * inf in both tiers
        results = []
        for tier, extra in ((F, dict(chunk_size=CHUNK)), (R, {})):
            out, cache = tier.kimi_delta_attention(**c, **kw, **extra)
            grads = tier.kimi_delta_attention_backward(dout, cache, dfinal)
            tout, tfinal = tier.kimi_delta_attention_jvp(cache, *tangents)
            results.append((out, cache.final_state, *grads, tout, tfinal))
    return results


def _same_where_finite(fast, ref, what):
    """The fast tier is finite exactly where the textbook tier is, and equal to it there."""
    for name, a, b in zip(("out", "final_state") + tuple("d" + n for n in NAMES) + ("tout", "tfinal"), fast, ref):
        fa, fb = np.isfinite(a), np.isfinite(b)
        assert np.array_equal(fa, fb), (what, name, np.argwhere(fa != fb)[:5])
        err = float(np.max(np.abs(np.subtract(a, b, out=np.zeros(b.shape), where=fb)), initial=0.0))
        assert err <= 1e-10 * max(1.0, float(np.max(np.abs(np.where(fb, b, 0.0))))), (what, name, err)


def _small(rng):
    return _case(rng, lead=(1, 2), steps=STEPS, dk=3, dv=4)


@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_input_reaches_what_it_reaches_in_the_recurrence(name, value):
    """In head 1 only (one channel of g): head 0 stays finite, nothing before step t moves."""
    rng = np.random.default_rng(0)
    for t in POSITIONS:
        c = _small(rng)
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
    rng = np.random.default_rng(1)
    for t in POSITIONS:
        c = _small(rng)
        dout = rng.standard_normal(c["v"].shape)
        dout[0, 1, t, 2] = value
        fast, ref = _run(c, dout, rng.standard_normal(c["initial_state"].shape), _tangents(rng, c))
        _same_where_finite(fast, ref, (value, t))
        for grad in fast[2:7]:  # dq, dk, dv, dg, dbeta
            assert np.isfinite(grad[0, 1, t + 1 :]).all()


@pytest.mark.parametrize("value", [np.nan, np.inf])
@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta"])
def test_non_finite_tangent_reaches_no_earlier_step(name, value):
    rng = np.random.default_rng(2)
    for t in POSITIONS:
        c = _small(rng)
        tangents = _tangents(rng, c)
        tangents[NAMES.index(name)][0, 1, t] = value
        dout = rng.standard_normal(c["v"].shape)
        fast, ref = _run(c, dout, rng.standard_normal(c["initial_state"].shape), tangents)
        _same_where_finite(fast, ref, (name, value, t))
        assert np.isfinite(fast[-2][0, 1, :t]).all()


@pytest.mark.parametrize("steps", [(0,), (3,), (4,), (5,), (12,), (1, 2), (5, 7), (2, 4, 6, 8)])
@pytest.mark.parametrize("channels", [slice(None), slice(1, 2)], ids=["all", "one"])
def test_full_reset_equals_the_recurrence(steps, channels):
    """``g = -inf`` (a channel forgotten) at chunk borders, inside chunks, twice in one chunk."""
    rng = np.random.default_rng(3)
    c = _small(rng)
    c["g"][..., list(steps), channels] = -np.inf
    dout, dfinal = rng.standard_normal(c["v"].shape), rng.standard_normal(c["initial_state"].shape)
    fast, ref = _run(c, dout, dfinal, _tangents(rng, c))
    for a, b in zip(fast, ref):
        assert np.isfinite(a).all()
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-12 * max(1.0, float(np.abs(b).max())))


# ---------------------------------------------------------------------------------------- errors


def test_bad_input_is_named():
    rng = np.random.default_rng(6)
    c = _case(rng, lead=(1, 2), steps=4, dk=3, dv=2, init=False)
    q, k, v, g, beta = (c[n] for n in NAMES[:5])
    call = F.kimi_delta_attention
    with pytest.raises(ValueError, match="q: expected shape"):
        call(q[0, 0], k[0, 0], v[0, 0], g[0, 0], beta[0, 0])
    with pytest.raises(ValueError, match=r"k: expected q's shape \(1, 2, 4, 3\), got \(1, 2, 4, 2\)"):
        call(q, k[..., :2], v, g, beta)
    with pytest.raises(ValueError, match="v: expected shape"):
        call(q, k, v[..., :3, :], g, beta)
    with pytest.raises(ValueError, match=r"g: expected shape \(1, 2, 4, 3\) \(q's: a log decay per key channel\)"):
        call(q, k, v, g[..., 0], beta)  # a scalar decay per step: that is gated_delta_rule
    with pytest.raises(ValueError, match=r"beta: expected shape \(1, 2, 4\)"):
        call(q, k, v, g, beta[..., :2])
    with pytest.raises(ValueError, match=r"initial_state: expected shape \(1, 2, 3, 2\)"):
        call(q, k, v, g, beta, initial_state=np.zeros((1, 2, 2, 3)))
    with pytest.raises(ValueError, match="scale"):
        call(q, k, v, g, beta, scale=-1.0)
    with pytest.raises(ValueError, match="chunk_size"):
        call(q, k, v, g, beta, chunk_size=0)
    with pytest.raises(TypeError, match="use_qk_l2norm"):
        call(q, k, v, g, beta, use_qk_l2norm="yes")
    with pytest.raises(TypeError, match="g"):
        call(q, k, v, g.astype(np.float32), beta)
    out, cache = call(q, k, v, g, beta)
    with pytest.raises(ValueError, match="dout"):
        F.kimi_delta_attention_backward(out[..., :1], cache)
    with pytest.raises(ValueError, match="dfinal_state"):
        F.kimi_delta_attention_backward(out, cache, np.zeros((1, 2, 3)))
    with pytest.raises(TypeError, match="cache: kimi_delta_attention_backward expected a KimiDeltaAttentionCache"):
        F.kimi_delta_attention_backward(out, F.gated_delta_rule(q, k, v, g[..., 0], beta)[1])
    with pytest.raises(ValueError, match="tg"):
        F.kimi_delta_attention_jvp(cache, None, None, None, g[..., 0])
    with pytest.raises(ValueError, match="tinitial_state: expected None"):
        F.kimi_delta_attention_jvp(cache, None, None, None, None, None, np.zeros((1, 2, 3, 2)))
    with pytest.raises(TypeError, match="at most 6 tangents"):
        F.kimi_delta_attention_jvp(cache, *([None] * 7))


def test_textbook_cache_is_the_gated_delta_rules_with_a_decay_per_channel():
    """The textbook KDA cache is the gated delta rule's, written once: the same fields, its own name."""
    rng = np.random.default_rng(7)
    q, k = rng.standard_normal((2, 1, 3, 4))
    v, g, beta = rng.standard_normal((1, 3, 2)), -rng.random((1, 3, 4)), rng.random((1, 3))
    _, cache = R.kimi_delta_attention(q, k, v, g, beta, output_final_state=True)
    assert type(cache) is R.KimiDeltaAttentionCache and isinstance(cache, R.GatedDeltaRuleCache)
    assert cache._fields == R.GatedDeltaRuleCache._fields
    assert repr(cache).startswith("KimiDeltaAttentionCache(q=") and cache.g.shape == (1, 3, 4)
    assert type(cache._replace(scale=1.0)) is R.KimiDeltaAttentionCache

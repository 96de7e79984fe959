"""Gated DeltaNet's functional pairs: gated_delta_rule (recurrence and chunked), causal_conv1d,
l2_norm, rms_norm_gated.

* the textbook tier against torch autograd of the explicit formula (float64, 1e-10) and central
  differences;
* the fast tier (chunked: WY / UT transform) against the textbook recurrence (1e-12), property
  tests over shapes, chunk sizes (L not a multiple of the chunk), initial states, the l2 norm;
* bad input for every argument.
"""

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


def close(a, b, tol=1e-12):
    """max |a - b| <= tol * max(1, max |b|)."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    if a.size == 0:
        return
    err = float(np.max(np.abs(a - b)))
    assert err <= tol * max(1.0, float(np.max(np.abs(b)))), err


def _case(rng, lead=(2, 3), steps=9, dk=4, dv=5, init=True):
    k = rng.standard_normal(lead + (steps, dk))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    return dict(
        q=rng.standard_normal(lead + (steps, dk)),
        k=k,
        v=rng.standard_normal(lead + (steps, dv)),
        g=-np.logaddexp(0.0, rng.standard_normal(lead + (steps,))),
        beta=1.0 / (1.0 + np.exp(-rng.standard_normal(lead + (steps,)))),
        initial_state=rng.standard_normal(lead + (dk, dv)) if init else None,
    )


# -------------------------------------------------------------------------- gated_delta_rule


def _torch_delta_rule(torch, q, k, v, g, beta, s, scale, l2):
    """The recurrence in torch, step by step, as written in the contract."""
    if l2:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * scale
    outs = []
    for t in range(q.shape[-2]):
        s = torch.exp(g[..., t])[..., None, None] * s
        u = beta[..., t, None] * (v[..., t, :] - torch.einsum("...kv,...k->...v", s, k[..., t, :]))
        s = s + k[..., t, :, None] * u[..., None, :]
        outs.append(torch.einsum("...kv,...k->...v", s, q[..., t, :]))
    return torch.stack(outs, -2), s


@pytest.mark.parametrize("l2", [False, True])
@pytest.mark.parametrize("init", [False, True])
def test_reference_delta_rule_matches_torch_autograd(torch_or_skip, l2, init):
    torch = torch_or_skip
    rng = np.random.default_rng(1)
    c = _case(rng, init=init)
    scale = 0.7
    out, cache = R.gated_delta_rule(
        c["q"], c["k"], c["v"], c["g"], c["beta"], scale=scale,
        initial_state=c["initial_state"], output_final_state=True, use_qk_l2norm=l2,
    )  # fmt: skip
    dout = rng.standard_normal(out.shape)
    dfinal = rng.standard_normal(cache.final_state.shape)
    grads = R.gated_delta_rule_backward(dout, cache, dfinal)

    names = ["q", "k", "v", "g", "beta"]
    ts = [torch.tensor(c[n], requires_grad=True) for n in names]
    s0 = torch.tensor(c["initial_state"] if init else np.zeros(cache.final_state.shape), requires_grad=init)
    t_out, t_final = _torch_delta_rule(torch, *ts, s0, scale, l2)
    ((t_out * torch.tensor(dout)).sum() + (t_final * torch.tensor(dfinal)).sum()).backward()
    close(out, t_out.detach().numpy(), 1e-10)
    close(cache.final_state, t_final.detach().numpy(), 1e-10)
    for got, t in zip(grads[:5], ts):
        close(got, t.grad.numpy(), 1e-10)
    if init:
        close(grads[5], s0.grad.numpy(), 1e-10)
    else:
        assert grads[5] is None


@pytest.mark.parametrize("l2", [False, True])
def test_fast_delta_rule_matches_transformers_functions(monkeypatch, l2):
    """transformers' own torch_chunk_gated_delta_rule and torch_recurrent_gated_delta_rule (their
    float32 casts made float64 by ``_hf64``), outputs, final state and every gradient by autograd;
    L = 70: more than one of their chunks of 64, not a multiple of it."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from _hf64 import float64_torch
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    float64_torch(monkeypatch, "models.qwen3_next.modeling_qwen3_next")
    rng = np.random.default_rng(17)
    c = _case(rng, lead=(2, 3), steps=70, dk=4, dv=5)
    out, cache = F.gated_delta_rule(**c, output_final_state=True, use_qk_l2norm=l2, chunk_size=16)
    dout, dfinal = rng.standard_normal(out.shape), rng.standard_normal(cache.final_state.shape)
    grads = F.gated_delta_rule_backward(dout, cache, dfinal)

    def heads_second(a):  # npattn's (B, H, L, ...) <-> transformers' (B, L, H, ...)
        return np.ascontiguousarray(np.swapaxes(a, 1, 2))

    for fn in (hf.torch_chunk_gated_delta_rule, hf.torch_recurrent_gated_delta_rule):
        ts = [torch.tensor(heads_second(c[n]), requires_grad=True) for n in ("q", "k", "v", "g", "beta")]
        s0 = torch.tensor(c["initial_state"], requires_grad=True)
        o, s = fn(*ts, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=l2)
        assert o.dtype == torch.float64
        ((o * torch.tensor(heads_second(dout))).sum() + (s * torch.tensor(dfinal)).sum()).backward()
        close(out, heads_second(o.detach().numpy()), 1e-10)
        close(cache.final_state, s.detach().numpy(), 1e-10)
        for got, t in zip(grads[:5], ts):
            close(got, heads_second(t.grad.numpy()), 1e-10)
        close(grads[5], s0.grad.numpy(), 1e-10)


def test_reference_delta_rule_finite_differences():
    rng = np.random.default_rng(2)
    c = _case(rng, lead=(1, 2), steps=5, dk=3, dv=2)
    dout = rng.standard_normal((1, 2, 5, 2))
    dfinal = rng.standard_normal((1, 2, 3, 2))
    arrays = [c[n] for n in ("q", "k", "v", "g", "beta", "initial_state")]

    def loss(*xs):
        out, cache = R.gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True, use_qk_l2norm=True)
        return np.sum(out * dout) + np.sum(cache.final_state * dfinal)

    _, cache = R.gated_delta_rule(*arrays[:5], initial_state=arrays[5], output_final_state=True, use_qk_l2norm=True)
    grads = R.gated_delta_rule_backward(dout, cache, dfinal)
    for got, num in zip(grads, fd_gradients(loss, arrays)):
        assert rel_err(got, num) < 1e-6


def _both(case, chunk):
    kw = case.kwargs()
    ref = R.gated_delta_rule(case.q, case.k, case.v, case.g, case.beta, **kw)
    fast = F.gated_delta_rule(case.q, case.k, case.v, case.g, case.beta, chunk_size=chunk, **kw)
    return ref, fast


@settings(max_examples=60)
@given(delta_rule_inputs())
def test_chunked_equals_recurrence(case):
    (out, cache), (out2, cache2) = _both(case, case.chunk_size)
    close(out2, out)
    if case.output_final_state:
        close(cache2.final_state, cache.final_state)
    else:
        assert cache2.final_state is None
    g_ref = R.gated_delta_rule_backward(case.dout, cache, case.dfinal_state)
    g_fast = F.gated_delta_rule_backward(case.dout, cache2, case.dfinal_state)
    for a, b in zip(g_fast, g_ref):
        if b is None:
            assert a is None
        else:
            assert a.dtype == np.float64
            close(a, b)


@pytest.mark.parametrize("block", [None, 1, 3000])
def test_chunked_long_sequence_every_chunk_size_same_numbers(monkeypatch, block):
    """L = 203 (prime: never a multiple of the chunk), strong and weak decays, several chunks;
    chunks in blocks of the default size, of one chunk each, of a few chunks each."""
    if block is not None:
        monkeypatch.setattr(delta_rule, "_BLOCK", block)
    rng = np.random.default_rng(3)
    c = _case(rng, lead=(1, 2), steps=203, dk=6, dv=4)
    c["g"][0, 0, 50:60] = -30.0  # decays that underflow e^{gamma} inside a chunk
    out, cache = R.gated_delta_rule(**c, output_final_state=True, use_qk_l2norm=True)
    dout = rng.standard_normal(out.shape)
    ref = R.gated_delta_rule_backward(dout, cache)
    for chunk in (1, 7, 32, 64, 203, 500):
        out2, cache2 = F.gated_delta_rule(**c, output_final_state=True, use_qk_l2norm=True, chunk_size=chunk)
        close(out2, out)
        close(cache2.final_state, cache.final_state)
        n = -(-203 // min(chunk, 203))
        assert cache2.states.shape == (1, 2, n, 6, 4)  # the boundary states, no (L, L) array
        for a, b in zip(F.gated_delta_rule_backward(dout, cache2), ref):
            close(a, b)
        ts = _tangents(chunk, c["q"], c["k"], c["v"], c["g"], c["beta"], c["initial_state"])
        for a, b in zip(F.gated_delta_rule_jvp(cache2, *ts), R.gated_delta_rule_jvp(cache, *ts)):
            close(a, b)


def test_chunked_default_scale_and_float32():
    rng = np.random.default_rng(4)
    c = _case(rng, steps=70)
    out64, _ = F.gated_delta_rule(**c)
    out, cache = F.gated_delta_rule(**{n: (a.astype(np.float32) if a is not None else None) for n, a in c.items()})
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, out64, atol=1e-4)
    dq, dk, dv, dg, dbeta, ds0 = F.gated_delta_rule_backward(np.ones(out.shape, np.float32), cache)
    assert {a.dtype for a in (dq, dk, dv, dg, dbeta, ds0)} == {np.dtype(np.float32)}
    ref, _ = R.gated_delta_rule(**c, scale=1.0 / np.sqrt(4))
    close(out64, ref)


def test_float32_strong_decays_match_float64():
    """Decays of -10 per step make e^{gamma} subnormal in float32 within a chunk (flushed to 0
    there): the float32 result and gradients still match float64's."""
    rng = np.random.default_rng(18)
    c = _case(rng, lead=(1, 2), steps=150, dk=8, dv=4)
    c["g"] = c["g"] * 10.0
    out, cache = F.gated_delta_rule(**c, use_qk_l2norm=True)
    dout = rng.standard_normal(out.shape)
    grads = F.gated_delta_rule_backward(dout, cache)
    c32 = {n: a.astype(np.float32) for n, a in c.items()}
    out32, cache32 = F.gated_delta_rule(**c32, use_qk_l2norm=True)
    np.testing.assert_allclose(out32, out, rtol=1e-4, atol=1e-5)
    for g32, g64 in zip(F.gated_delta_rule_backward(dout.astype(np.float32), cache32), grads):
        np.testing.assert_allclose(g32, g64, rtol=1e-3, atol=1e-4 * max(1.0, float(np.abs(g64).max())))


def test_split_sequence_with_carried_state_equals_one_pass():
    """Two calls, the second starting from the first's final state, give the one-pass output; the
    gradient flows back across the split through dfinal_state = dinitial_state of the second."""
    rng = np.random.default_rng(5)
    c = _case(rng, steps=20, init=False)
    out, cache = F.gated_delta_rule(**c, use_qk_l2norm=True, chunk_size=6)
    first = {n: (a[..., :8, :] if a.ndim == 4 else a[..., :8]) for n, a in c.items() if a is not None}
    second = {n: (a[..., 8:, :] if a.ndim == 4 else a[..., 8:]) for n, a in c.items() if a is not None}
    o1, c1 = F.gated_delta_rule(**first, use_qk_l2norm=True, output_final_state=True, chunk_size=6)
    o2, c2 = F.gated_delta_rule(**second, initial_state=c1.final_state, use_qk_l2norm=True, chunk_size=6)
    close(np.concatenate([o1, o2], axis=-2), out)
    dout = rng.standard_normal(out.shape)
    full = F.gated_delta_rule_backward(dout, cache)
    g2 = F.gated_delta_rule_backward(dout[..., 8:, :], c2)
    g1 = F.gated_delta_rule_backward(dout[..., :8, :], c1, g2[5])
    for i in range(5):
        close(np.concatenate([g1[i], g2[i]], axis=-2 if full[i].ndim == 4 else -1), full[i])


def test_delta_rule_bad_input():
    rng = np.random.default_rng(6)
    c = _case(rng, lead=(1, 2), steps=4, dk=3, dv=2, init=False)
    q, k, v, g, beta = (c[n] for n in ("q", "k", "v", "g", "beta"))
    call = F.gated_delta_rule
    with pytest.raises(ValueError, match="q: expected shape"):
        call(q[0, 0], k[0, 0], v[0, 0], g[0, 0], beta[0, 0])
    with pytest.raises(ValueError, match="q: expected at least 1 step"):
        call(q[..., :0, :], k[..., :0, :], v[..., :0, :], g[..., :0], beta[..., :0])
    with pytest.raises(ValueError, match=r"k: expected q's shape \(1, 2, 4, 3\), got \(1, 2, 4, 2\)"):
        call(q, k[..., :2], v, g, beta)
    with pytest.raises(ValueError, match="v: expected shape"):
        call(q, k, v[..., :3, :], g, beta)
    with pytest.raises(ValueError, match=r"g: expected shape \(1, 2, 4\)"):
        call(q, k, v, g[..., None], beta)
    with pytest.raises(ValueError, match="beta: expected shape"):
        call(q, k, v, g, beta[..., :2])
    with pytest.raises(TypeError, match="beta"):
        call(q, k, v, g, beta > 0)
    with pytest.raises(TypeError, match="q"):
        call(q.astype(np.float16), k, v, g, beta)
    with pytest.raises(ValueError, match="scale"):
        call(q, k, v, g, beta, scale=-1.0)
    with pytest.raises(TypeError, match="scale"):
        call(q, k, v, g, beta, scale="big")
    with pytest.raises(ValueError, match=r"initial_state: expected shape \(1, 2, 3, 2\)"):
        call(q, k, v, g, beta, initial_state=np.zeros((1, 2, 2, 3)))
    with pytest.raises(TypeError, match="output_final_state"):
        call(q, k, v, g, beta, output_final_state=1)
    with pytest.raises(TypeError, match="use_qk_l2norm"):
        call(q, k, v, g, beta, use_qk_l2norm="yes")
    with pytest.raises(ValueError, match="chunk_size"):
        call(q, k, v, g, beta, chunk_size=0)
    with pytest.raises(TypeError, match="chunk_size"):
        call(q, k, v, g, beta, chunk_size=2.0)
    out, cache = call(q, k, v, g, beta)
    with pytest.raises(ValueError, match="dout: expected shape"):
        F.gated_delta_rule_backward(out[..., :2, :], cache)
    with pytest.raises(ValueError, match=r"dfinal_state: expected shape \(1, 2, 3, 2\)"):
        F.gated_delta_rule_backward(out, cache, np.zeros((1, 2, 3)))
    with pytest.raises(TypeError, match="cache"):
        F.gated_delta_rule_backward(out, (1, 2))
    # integers are cast; mixed float dtypes are refused (as the attention cores), naming the odd one
    out_i, _ = call(q, k, v, g, beta, initial_state=np.zeros((1, 2, 3, 2), dtype=np.int64))
    close(out_i, out)
    out_ki, _ = call(q, np.rint(k * 4).astype(np.int64), v, g, beta)
    assert out_ki.dtype == np.float64
    with pytest.raises(TypeError, match=r"k: expected the dtype of q, float32, got float64"):
        call(q.astype(np.float32), k, v, g, beta)
    with pytest.raises(TypeError, match=r"beta: expected the dtype of q, float64, got float32"):
        call(q, k, v, g, beta.astype(np.float32))


# ----------------------------------------------------------------------------- causal_conv1d


def _conv_case(rng, lead=(2,), steps=7, channels=5, taps=4):
    return (
        rng.standard_normal(lead + (steps, channels)),
        rng.standard_normal((channels, taps)),
        rng.standard_normal(channels),
        rng.standard_normal(lead + (taps - 1, channels)),
    )


@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("with_state", [False, True])
def test_reference_conv_matches_torch_autograd(torch_or_skip, activation, with_bias, with_state):
    torch = torch_or_skip
    rng = np.random.default_rng(7)
    x, w, b, s = _conv_case(rng)
    b = b if with_bias else None
    s = s if with_state else None
    y, cache = R.causal_conv1d(x, w, b, activation=activation, initial_state=s, output_final_state=True)
    dy = rng.standard_normal(y.shape)
    grads = R.causal_conv1d_backward(dy, cache)

    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    tb = torch.tensor(b, requires_grad=True) if with_bias else None
    ts = torch.tensor(s if with_state else np.zeros((2, 3, 5)), requires_grad=True)
    xp = torch.cat([ts, tx], dim=1).transpose(1, 2)  # (B, C, K - 1 + L), torch's layout
    z = torch.nn.functional.conv1d(xp, tw[:, None, :], tb, groups=5).transpose(1, 2)
    ty = torch.nn.functional.silu(z) if activation else z
    (ty * torch.tensor(dy)).sum().backward()
    close(y, ty.detach().numpy(), 1e-10)
    close(cache[-1], np.concatenate([s if with_state else np.zeros((2, 3, 5)), x], 1)[:, -3:], 1e-15)
    close(grads[0], tx.grad.numpy(), 1e-10)
    close(grads[1], tw.grad.numpy(), 1e-10)
    if with_bias:
        close(grads[2], tb.grad.numpy(), 1e-10)
    else:
        assert grads[2] is None
    if with_state:
        close(grads[3], ts.grad.numpy(), 1e-10)
    else:
        assert grads[3] is None


def test_reference_conv_finite_differences():
    rng = np.random.default_rng(8)
    x, w, b, s = _conv_case(rng, lead=(2,), steps=5, channels=3, taps=3)
    dy = rng.standard_normal(x.shape)

    def loss(x, w, b, s):
        return np.sum(R.causal_conv1d(x, w, b, activation="silu", initial_state=s)[0] * dy)

    _, cache = R.causal_conv1d(x, w, b, activation="silu", initial_state=s)
    for got, num in zip(R.causal_conv1d_backward(dy, cache), fd_gradients(loss, [x, w, b, s])):
        assert rel_err(got, num) < 1e-6


@settings(max_examples=40)
@given(
    st.lists(st.integers(1, 3), min_size=0, max_size=2),
    st.integers(1, 9),
    st.integers(1, 4),
    st.integers(1, 5),
    st.tuples(st.booleans(), st.booleans(), st.booleans()),
    st.integers(0, 2**32 - 1),
)
def test_conv_fast_equals_reference(lead, steps, channels, taps, flags, seed):
    with_bias, with_state, silu = flags
    rng = np.random.default_rng(seed)
    x, w, b, s = _conv_case(rng, tuple(lead), steps, channels, taps)
    kw = dict(activation="silu" if silu else None, initial_state=s if with_state else None, output_final_state=True)
    y, cache = R.causal_conv1d(x, w, b if with_bias else None, **kw)
    y2, cache2 = F.causal_conv1d(x, w, b if with_bias else None, **kw)
    close(y2, y)
    close(cache2.final_state, cache[-1])
    dy = rng.standard_normal(y.shape)
    for a, r in zip(F.causal_conv1d_backward(dy, cache2), R.causal_conv1d_backward(dy, cache)):
        if r is None:
            assert a is None
        else:
            close(a, r)


def test_conv_decoding_in_pieces_equals_one_pass():
    rng = np.random.default_rng(9)
    x, w, b, _ = _conv_case(rng, steps=9)
    y, _ = F.causal_conv1d(x, w, b, activation="silu")
    state, pieces = None, []
    for lo, hi in ((0, 1), (1, 5), (5, 6), (6, 9)):
        yi, ci = F.causal_conv1d(x[:, lo:hi], w, b, activation="silu", initial_state=state, output_final_state=True)
        state = ci.final_state
        pieces.append(yi)
    close(np.concatenate(pieces, axis=1), y)


def test_conv_bad_input():
    rng = np.random.default_rng(10)
    x, w, b, s = _conv_case(rng)
    with pytest.raises(ValueError, match="x: expected shape"):
        F.causal_conv1d(x[0, 0], w)
    with pytest.raises(ValueError, match=r"weight: expected shape \(5, K\)"):
        F.causal_conv1d(x, w[:3])
    with pytest.raises(ValueError, match="weight: expected shape"):
        F.causal_conv1d(x, w[:, None, :])
    with pytest.raises(ValueError, match=r"bias: expected shape \(5,\)"):
        F.causal_conv1d(x, w, b[:2])
    with pytest.raises(ValueError, match="activation"):
        F.causal_conv1d(x, w, activation="relu")
    with pytest.raises(ValueError, match=r"initial_state: expected shape \(2, 3, 5\)"):
        F.causal_conv1d(x, w, initial_state=s[:, :2])
    with pytest.raises(TypeError, match="output_final_state"):
        F.causal_conv1d(x, w, output_final_state=None)
    with pytest.raises(TypeError, match="x"):
        F.causal_conv1d(x > 0, w)
    y, cache = F.causal_conv1d(x, w)
    with pytest.raises(ValueError, match="dout: expected shape"):
        F.causal_conv1d_backward(y[:, 1:], cache)
    with pytest.raises(TypeError, match="cache"):
        F.causal_conv1d_backward(y, None)


# ------------------------------------------------------------------ l2_norm and rms_norm_gated


def test_norms_reference_match_torch_autograd(torch_or_skip):
    torch = torch_or_skip
    rng = np.random.default_rng(11)
    x, z, w = rng.standard_normal((3, 4, 6)), rng.standard_normal((3, 4, 6)), rng.standard_normal(6)
    dy = rng.standard_normal((3, 4, 6))
    tx, tz, tw = (torch.tensor(a, requires_grad=True) for a in (x, z, w))
    ty = tx * torch.rsqrt(tx.pow(2).mean(-1, keepdim=True) + 1e-6) * tw * torch.nn.functional.silu(tz)
    (ty * torch.tensor(dy)).sum().backward()
    y, cache = R.rms_norm_gated(x, z, w, 1e-6)
    close(y, ty.detach().numpy(), 1e-10)
    for got, t in zip(R.rms_norm_gated_backward(dy, cache), (tx, tz, tw)):
        close(got, t.grad.numpy(), 1e-10)

    tx = torch.tensor(x, requires_grad=True)
    ty = tx * torch.rsqrt((tx * tx).sum(-1, keepdim=True) + 1e-6)
    (ty * torch.tensor(dy)).sum().backward()
    y, cache = R.l2_norm(x)
    close(y, ty.detach().numpy(), 1e-10)
    close(R.l2_norm_backward(dy, cache), tx.grad.numpy(), 1e-10)


def test_norms_reference_finite_differences():
    rng = np.random.default_rng(12)
    x, z, w = rng.standard_normal((2, 5)), rng.standard_normal((2, 5)), rng.standard_normal(5)
    dy = rng.standard_normal((2, 5))
    _, cache = R.rms_norm_gated(x, z, w, 1e-6)
    num = fd_gradients(lambda x, z, w: np.sum(R.rms_norm_gated(x, z, w, 1e-6)[0] * dy), [x, z, w])
    for got, n in zip(R.rms_norm_gated_backward(dy, cache), num):
        assert rel_err(got, n) < 1e-6
    (num,) = fd_gradients(lambda x: np.sum(R.l2_norm(x)[0] * dy), [x])
    assert rel_err(R.l2_norm_backward(dy, R.l2_norm(x)[1]), num) < 1e-6


@settings(max_examples=40)
@given(
    st.lists(st.integers(1, 3), min_size=0, max_size=2),
    st.integers(1, 7),
    st.sampled_from([0.0, 1e-6, 0.5]),
    st.integers(0, 2**32 - 1),
)
def test_norms_fast_equal_reference(lead, d, eps, seed):
    rng = np.random.default_rng(seed)
    shape = tuple(lead) + (d,)
    x, z, w, dy = (
        rng.standard_normal(shape),
        rng.standard_normal(shape),
        rng.standard_normal(d),
        rng.standard_normal(shape),
    )
    y, cache = F.rms_norm_gated(x, z, w, eps + 1e-12)
    y_ref, cache_ref = R.rms_norm_gated(x, z, w, eps + 1e-12)
    close(y, y_ref)
    for a, b in zip(F.rms_norm_gated_backward(dy, cache), R.rms_norm_gated_backward(dy, cache_ref)):
        close(a, b)
    y, cache = F.l2_norm(x, eps + 1e-12)
    y_ref, cache_ref = R.l2_norm(x, eps + 1e-12)
    close(y, y_ref)
    close(F.l2_norm_backward(dy, cache), R.l2_norm_backward(dy, cache_ref))


def test_norms_bad_input():
    x = np.ones((2, 3))
    with pytest.raises(ValueError, match="x: expected shape"):
        F.l2_norm(np.ones((2, 0)))
    with pytest.raises(ValueError, match="eps"):
        F.l2_norm(x, -1.0)
    with pytest.raises(TypeError, match="x"):
        F.l2_norm(x > 0)
    with pytest.raises(ValueError, match=r"gate: expected x's shape \(2, 3\)"):
        F.rms_norm_gated(x, np.ones((2, 2)), np.ones(3))
    with pytest.raises(ValueError, match=r"weight: expected shape \(3,\)"):
        F.rms_norm_gated(x, x, np.ones(2))
    with pytest.raises(ValueError, match="eps"):
        F.rms_norm_gated(x, x, np.ones(3), float("nan"))
    with pytest.raises(ValueError, match="x: expected shape"):
        F.rms_norm_gated(np.ones(()), x, np.ones(3))
    y, cache = F.rms_norm_gated(x, x, np.ones(3))
    with pytest.raises(ValueError, match="dout"):
        F.rms_norm_gated_backward(y[:1], cache)
    with pytest.raises(TypeError, match="cache"):
        F.rms_norm_gated_backward(y, F.l2_norm(x)[1])
    with pytest.raises(ValueError, match="dout"):
        F.l2_norm_backward(y[:1], F.l2_norm(x)[1])
    with pytest.raises(TypeError, match="cache"):
        F.l2_norm_backward(y, cache)


# ------------------------------------------------------------------------------ forward mode


def _tangents(seed, *arrays):
    rng = np.random.default_rng(seed)
    return [None if a is None else rng.standard_normal(a.shape).astype(a.dtype) for a in arrays]


def _dot(xs, ys):
    return sum(float(np.sum(x * y)) for x, y in zip(xs, ys) if x is not None and y is not None)


@settings(max_examples=40)
@given(delta_rule_inputs(max_len=14))
def test_delta_rule_jvp_fast_equals_reference_and_transposes_the_backward(case):
    (_, cache), (_, cache2) = _both(case, case.chunk_size)
    ts = _tangents(1, case.q, case.k, case.v, case.g, case.beta, case.initial_state)
    ref, fast = R.gated_delta_rule_jvp(cache, *ts), F.gated_delta_rule_jvp(cache2, *ts)
    if case.output_final_state:
        close(fast[0], ref[0])
        close(fast[1], ref[1])
        outs = [case.dout, case.dfinal_state]
        tout = list(fast)
    else:
        close(fast, ref)
        outs, tout = [case.dout], [fast]
    # <dout, J t> = <J^T dout, t>: forward and reverse mode agree
    grads = F.gated_delta_rule_backward(case.dout, cache2, case.dfinal_state if case.output_final_state else None)
    lhs, rhs = _dot(outs, tout), _dot(grads, ts)
    assert abs(lhs - rhs) <= 1e-12 * max(1.0, abs(lhs))


def test_delta_rule_jvp_central_differences_and_partial_tangents():
    rng = np.random.default_rng(13)
    c = _case(rng, lead=(1, 2), steps=6, dk=3, dv=2)
    names = ("q", "k", "v", "g", "beta", "initial_state")
    arrays = [c[n] for n in names]
    ts = _tangents(2, *arrays)
    _, cache = R.gated_delta_rule(**c, use_qk_l2norm=True, output_final_state=True)
    tout, tfinal = R.gated_delta_rule_jvp(cache, *ts)
    eps = 1e-6
    plus = R.gated_delta_rule(*[a + eps * t for a, t in zip(arrays[:5], ts)], initial_state=arrays[5] + eps * ts[5],
                              use_qk_l2norm=True, output_final_state=True)  # fmt: skip
    minus = R.gated_delta_rule(*[a - eps * t for a, t in zip(arrays[:5], ts)], initial_state=arrays[5] - eps * ts[5],
                               use_qk_l2norm=True, output_final_state=True)  # fmt: skip
    assert rel_err(tout, (plus[0] - minus[0]) / (2 * eps)) < 1e-6
    assert rel_err(tfinal, (plus[1].final_state - minus[1].final_state) / (2 * eps)) < 1e-6
    # only tg given (the others zero), without a kept final state: the tangent alone
    _, cache = R.gated_delta_rule(**c)
    _, cache2 = F.gated_delta_rule(**c, chunk_size=4)
    close(
        F.gated_delta_rule_jvp(cache2, None, None, None, ts[3]), R.gated_delta_rule_jvp(cache, None, None, None, ts[3])
    )
    close(F.gated_delta_rule_jvp(cache2), np.zeros_like(c["v"]))
    close(R.gated_delta_rule_jvp(cache), np.zeros_like(c["v"]))


@pytest.mark.parametrize("activation", [None, "silu"])
def test_conv_jvp(activation):
    rng = np.random.default_rng(14)
    x, w, b, s = _conv_case(rng)
    ts = _tangents(3, x, w, b, s)
    y, cache = R.causal_conv1d(x, w, b, activation=activation, initial_state=s)
    _, cache2 = F.causal_conv1d(x, w, b, activation=activation, initial_state=s)
    ref = R.causal_conv1d_jvp(cache, *ts)
    close(F.causal_conv1d_jvp(cache2, *ts), ref)
    eps = 1e-6
    plus = R.causal_conv1d(
        *[a + eps * t for a, t in zip((x, w, b), ts)], activation=activation, initial_state=s + eps * ts[3]
    )
    minus = R.causal_conv1d(
        *[a - eps * t for a, t in zip((x, w, b), ts)], activation=activation, initial_state=s - eps * ts[3]
    )
    assert rel_err(ref, (plus[0] - minus[0]) / (2 * eps)) < 1e-6
    dy = rng.standard_normal(y.shape)
    lhs, rhs = _dot([dy], [ref]), _dot(F.causal_conv1d_backward(dy, cache2), ts)
    assert abs(lhs - rhs) <= 1e-12 * abs(lhs)
    for part in ([ts[0]], [None, ts[1]], [None, None, ts[2]], [None, None, None, ts[3]], []):
        close(F.causal_conv1d_jvp(cache2, *part), R.causal_conv1d_jvp(cache, *part))


def test_norms_jvp():
    rng = np.random.default_rng(15)
    x, z, w = rng.standard_normal((3, 6)), rng.standard_normal((3, 6)), rng.standard_normal(6)
    ts = _tangents(4, x, z, w)
    y, cache = R.rms_norm_gated(x, z, w)
    _, cache2 = F.rms_norm_gated(x, z, w)
    ref = R.rms_norm_gated_jvp(cache, *ts)
    close(F.rms_norm_gated_jvp(cache2, *ts), ref)
    eps = 1e-6
    fd = (R.rms_norm_gated(*[a + eps * t for a, t in zip((x, z, w), ts)])[0]
          - R.rms_norm_gated(*[a - eps * t for a, t in zip((x, z, w), ts)])[0]) / (2 * eps)  # fmt: skip
    assert rel_err(ref, fd) < 1e-6
    for part in ([ts[0]], [None, ts[1]], [None, None, ts[2]], []):
        close(F.rms_norm_gated_jvp(cache2, *part), R.rms_norm_gated_jvp(cache, *part))
    ref = R.l2_norm_jvp(R.l2_norm(x)[1], ts[0])
    close(F.l2_norm_jvp(F.l2_norm(x)[1], ts[0]), ref)
    assert rel_err(ref, (R.l2_norm(x + eps * ts[0])[0] - R.l2_norm(x - eps * ts[0])[0]) / (2 * eps)) < 1e-6
    close(F.l2_norm_jvp(F.l2_norm(x)[1]), np.zeros_like(x))
    close(R.l2_norm_jvp(R.l2_norm(x)[1]), np.zeros_like(x))


def test_jvp_bad_tangents():
    rng = np.random.default_rng(16)
    c = _case(rng, lead=(1, 2), steps=4, dk=3, dv=2, init=False)
    _, cache = F.gated_delta_rule(**c)
    with pytest.raises(TypeError, match="at most 6 tangents"):
        F.gated_delta_rule_jvp(cache, *([None] * 7))
    with pytest.raises(ValueError, match=r"tk: expected shape \(1, 2, 4, 3\)"):
        F.gated_delta_rule_jvp(cache, None, np.ones((1, 2, 4, 2)))
    with pytest.raises(ValueError, match="tinitial_state: expected None"):
        F.gated_delta_rule_jvp(cache, None, None, None, None, None, np.ones((1, 2, 3, 2)))
    with pytest.raises(TypeError, match="cache"):
        F.gated_delta_rule_jvp(F.l2_norm(c["q"])[1])
    x, w, _, _ = _conv_case(rng)
    _, ccache = F.causal_conv1d(x, w)
    with pytest.raises(ValueError, match="tbias: expected None"):
        F.causal_conv1d_jvp(ccache, None, None, np.ones(5))
    with pytest.raises(ValueError, match="tweight: expected shape"):
        F.causal_conv1d_jvp(ccache, None, np.ones(5))
    with pytest.raises(TypeError, match="cache"):
        F.causal_conv1d_jvp(cache)
    _, ncache = F.rms_norm_gated(x, x, np.ones(5))
    with pytest.raises(ValueError, match=r"tweight: expected shape \(5,\)"):
        F.rms_norm_gated_jvp(ncache, None, None, np.ones(4))
    with pytest.raises(TypeError, match="at most 1 tangents"):
        F.l2_norm_jvp(F.l2_norm(x)[1], x, x)
    with pytest.raises(TypeError, match="cache"):
        F.rms_norm_gated_jvp(cache)
    with pytest.raises(TypeError, match="cache"):
        F.l2_norm_jvp(cache)

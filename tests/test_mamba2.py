"""Mamba-2's selective scan (``mamba2_scan``), Granite 4.0's hybrid layers.

* the textbook tier against transformers' own ``mamba2_chunk_scan`` (torch autograd, float64 under
  ``float64_reference``) and its one-step decoding update ``mamba2_selective_state_update``;
* every derivative (backward, JVP, backward-JVP, with the final state and its gradient) of both
  tiers against central differences of the tier's own forward in float64 with random upstream
  gradients and tangents, L >= 2, uneven chunks, a clip of the step sizes that holds some of them;
* the fast tier (chunked) equal to the textbook one to 1e-12 over hypothesis-drawn shapes, groups,
  chunk sizes and options, in float32 close to float64, checked by ``npattn.gradcheck`` and
  central differences of its own backward; a sequence split with the carried state; bad input.
"""

import math

import numpy as np
import pytest
from _hf64 import float64_reference, transformers_or_none
from _oracles import rel_err
from hypothesis import given, settings
from hypothesis import strategies as st

import npattn
import npattn.functional as F
from npattn.functional import reference as R
from npattn.testing import seeds

T = transformers_or_none()
needs_transformers = pytest.mark.skipif(T is None, reason="needs torch and transformers")


def scan_inputs(rng, lead=(2,), heads=4, groups=2, steps=5, p=3, n=2):
    """``[x, dt, A, B, C, D, dt_bias, initial_state]`` in the tangents' order."""
    return [
        rng.standard_normal(lead + (heads, steps, p)),
        rng.standard_normal(lead + (heads, steps)),
        -rng.uniform(0.5, 2.0, heads),
        rng.standard_normal(lead + (groups, steps, n)),
        rng.standard_normal(lead + (groups, steps, n)),
        rng.standard_normal(heads),
        rng.standard_normal(heads),
        rng.standard_normal(lead + (heads, p, n)),
    ]


def _hf_scan(torch, hf, x, dt, A, B, C, D, bias, s0, chunk, limit=(0.0, math.inf)):
    """transformers' chunked scan, in its layout ``(b, l, h, p)``: ``(y head-first, final state)``."""
    y, final = hf.mamba2_chunk_scan(
        x.transpose(1, 2),
        dt.transpose(1, 2),
        A,
        B.transpose(1, 2),
        C.transpose(1, 2),
        chunk_size=chunk,
        D=D,
        dt_bias=bias,
        initial_states=s0,
        dt_softplus=True,
        dt_limit=limit,
        return_final_states=True,
    )
    return y.transpose(1, 2), final


@needs_transformers
@pytest.mark.parametrize("chunk", [2, 8])
@pytest.mark.parametrize("limit", [(0.0, math.inf), (0.3, 1.5)])
def test_reference_scan_is_transformers_chunk_scan(chunk, limit):
    """Output, final state and every gradient under random ``dy`` and ``dfinal_state``, chunk sizes
    that split the 5 steps unevenly or not at all, with and without a clip that holds some steps,
    one step size past torch's softplus threshold."""
    torch = pytest.importorskip("torch")
    from transformers.models.granitemoehybrid import modeling_granitemoehybrid as hf

    rng = np.random.default_rng(3)
    args = scan_inputs(rng)
    args[1][0, 1, 2] = 25.0  # past torch's softplus threshold (20): the identity there
    y, cache = R.mamba2_scan(*args[:7], time_step_limit=limit, initial_state=args[7], output_final_state=True)
    dy, dfin = rng.standard_normal(y.shape), rng.standard_normal(cache.final_state.shape)
    grads = R.mamba2_scan_backward(dy, cache, dfin)
    if limit[0] > 0:
        assert 0 < np.mean(cache.sig == 0) < 1  # the clip holds some steps, not all
    with float64_reference():
        ts = [torch.tensor(a, requires_grad=True) for a in args]
        ty, tfin = _hf_scan(torch, hf, *ts, chunk, limit)
        torch.autograd.backward([ty, tfin], [torch.tensor(dy), torch.tensor(dfin)])
    assert rel_err(y, ty, floor=1.0, relative_to="max_b") < 1e-12
    assert rel_err(cache.final_state, tfin, floor=1.0, relative_to="max_b") < 1e-12
    for name, g, t in zip("x dt A B C D dt_bias initial_state".split(), grads, ts):
        assert rel_err(g, t.grad, floor=1.0, relative_to="max_b") < 1e-11, name


@needs_transformers
def test_reference_scan_step_is_transformers_decoding_update():
    """One step from a carried state is ``mamba2_selective_state_update`` (output and new state)."""
    torch = pytest.importorskip("torch")
    from transformers.models.granitemoehybrid import modeling_granitemoehybrid as hf

    rng = np.random.default_rng(4)
    x, dt, A, B, C, D, bias, s0 = scan_inputs(rng, steps=1)
    y, cache = R.mamba2_scan(x, dt, A, B, C, D, bias, initial_state=s0, output_final_state=True)
    with float64_reference():
        state = torch.tensor(s0)
        p = x.shape[-1]
        out = hf.mamba2_selective_state_update(
            state,
            torch.tensor(x[:, :, 0]),
            torch.tensor(dt).expand(-1, -1, p),  # (b, h, 1) -> (b, h, p)
            torch.tensor(A)[:, None, None].expand(-1, p, B.shape[-1]),
            torch.tensor(B[:, :, 0]),
            torch.tensor(C[:, :, 0]),
            torch.tensor(D)[:, None].expand(-1, p),
            dt_bias=torch.tensor(bias)[:, None].expand(-1, p),
            dt_softplus=True,
        )
    assert rel_err(y[:, :, 0], out, floor=1.0, relative_to="max_b") < 1e-13
    assert rel_err(cache.final_state, state, floor=1.0, relative_to="max_b") < 1e-13


def _moved(primals, tangents, h):
    return [p + h * t for p, t in zip(primals, tangents)]


@pytest.mark.parametrize("tier", [R, F], ids=["textbook", "fast"])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("limit", [(0.0, math.inf), (0.3, 1.5)])
def test_derivatives_are_central_differences(tier, with_state, limit):
    """Backward (with ``dfinal_state``), JVP (with the final state's tangent) and backward-JVP
    (along ``ddout``, ``ddfinal_state``) of each tier against central differences of its own
    forward in float64: random upstream gradients and tangents, 5 steps in chunks of 2, two heads
    per group, a clip that holds some steps."""
    rng = np.random.default_rng(5)
    primals = scan_inputs(rng)
    if not with_state:
        primals = primals[:7]
    tangents = [rng.standard_normal(np.shape(p)) for p in primals]
    kw = dict(time_step_limit=limit, output_final_state=with_state, chunk_size=2)

    def run(p):
        return tier.mamba2_scan(*p[:7], initial_state=p[7] if with_state else None, **kw)

    y, cache = run(primals)
    dy, ddy = rng.standard_normal(y.shape), rng.standard_normal(y.shape)
    dfin, ddfin = (rng.standard_normal(primals[7].shape) for _ in range(2)) if with_state else (None, None)
    grads = tier.mamba2_scan_backward(dy, cache, dfin)
    assert len(grads) == 8 and (grads[7] is None) == (not with_state)
    h = 1e-6

    def loss(p):
        y, c = run(p)
        return (y * dy).sum() + (0.0 if dfin is None else (c.final_state * dfin).sum())

    for i, (p, g) in enumerate(zip(primals, grads)):
        u = rng.standard_normal(np.shape(p))
        step = [np.zeros(np.shape(q)) for q in primals]
        step[i] = u
        fd = (loss(_moved(primals, step, h)) - loss(_moved(primals, step, -h))) / (2 * h)
        assert abs(float((g * u).sum()) - fd) < 1e-7 * max(1.0, abs(fd)), i
    out = tier.mamba2_scan_jvp(cache, *tangents)
    (yp, cp), (ym, cm) = run(_moved(primals, tangents, h)), run(_moved(primals, tangents, -h))
    ty = out[0] if with_state else out
    assert rel_err(ty, (yp - ym) / (2 * h), floor=1.0, relative_to="max_b") < 1e-7
    if with_state:
        assert rel_err(out[1], (cp.final_state - cm.final_state) / (2 * h), floor=1.0, relative_to="max_b") < 1e-7
    again, tgrads = tier.mamba2_scan_backward_jvp(dy, cache, tangents, ddy, dfin, ddfin)
    for a, b in zip(again, grads):
        _close(a, b)

    def backward_at(sign):
        moved = None if dfin is None else dfin + sign * h * ddfin
        return tier.mamba2_scan_backward(dy + sign * h * ddy, run(_moved(primals, tangents, sign * h))[1], moved)

    for i, (t, a, b) in enumerate(zip(tgrads, backward_at(1), backward_at(-1))):
        assert (t is None) == (a is None), i
        if t is not None:
            assert np.any(t) and rel_err(t, (a - b) / (2 * h), floor=1.0, relative_to="max_b") < 1e-7, i


# ------------------------------------------------------------------------------ the fast tier


def _close(a, b, tol=1e-12):
    assert (a is None) == (b is None)
    if a is not None:
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
        assert rel_err(a, b, floor=1.0, relative_to="max_b") < tol


def _tuple(out):
    return out if isinstance(out, tuple) else (out,)


@settings(max_examples=30)
@given(
    st.lists(st.integers(1, 2), max_size=2),
    st.integers(1, 2),
    st.integers(1, 2),
    st.integers(1, 7),
    st.integers(1, 3),
    st.integers(1, 3),
    st.integers(1, 9),
    st.tuples(*(st.booleans(),) * 6),
    seeds(),
)
def test_fast_tier_equals_textbook(lead, groups, per_group, steps, p, n, chunk, flags, seed):
    """Outputs, final state, every gradient, the JVP and the second order: fast (chunks of 1 to
    past L) against the textbook recurrence, to 1e-12 in float64."""
    with_d, with_bias, with_init, final, dfinal, clip = flags
    rng = np.random.default_rng(seed)
    x, dt, A, B, C, D, bias, s0 = scan_inputs(rng, tuple(lead), groups * per_group, groups, steps, p, n)
    args = (x, dt, A, B, C, D if with_d else None, bias if with_bias else None)
    kw = dict(
        time_step_limit=(0.3, 1.5) if clip else (0.0, math.inf),
        initial_state=s0 if with_init else None,
        output_final_state=final,
    )
    y, fast = F.mamba2_scan(*args, **kw, chunk_size=chunk)
    ref, slow = R.mamba2_scan(*args, **kw)
    _close(y, ref)
    _close(fast.final_state, slow.final_state)
    dy, ddy = rng.standard_normal(y.shape), rng.standard_normal(y.shape)
    dfin = rng.standard_normal(s0.shape) if dfinal else None
    ddfin = rng.standard_normal(s0.shape) if dfinal else None
    for a, b in zip(F.mamba2_scan_backward(dy, fast, dfin), R.mamba2_scan_backward(dy, slow, dfin)):
        _close(a, b)
    present = (True, True, True, True, True, with_d, with_bias, with_init)
    tangents = tuple(rng.standard_normal(np.shape(a)) if keep else None for a, keep in zip(x_all(args, s0), present))
    for a, b in zip(_tuple(F.mamba2_scan_jvp(fast, *tangents)), _tuple(R.mamba2_scan_jvp(slow, *tangents))):
        _close(a, b)
    got = F.mamba2_scan_backward_jvp(dy, fast, tangents, ddy, dfin, ddfin)
    want = R.mamba2_scan_backward_jvp(dy, slow, tangents, ddy, dfin, ddfin)
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        _close(a, b)


def x_all(args, s0):
    """The eight inputs in the tangents' order (``s0`` for the initial state's shape)."""
    x, dt, A, B, C, D, bias = args
    return (x, dt, A, B, C, A if D is None else D, A if bias is None else bias, s0)


def test_fast_tier_float32_is_float64_rounded():
    """float32 in, float32 out (the cache, every gradient, the JVP, the second order), close to the
    float64 numbers."""
    rng = np.random.default_rng(6)
    args = scan_inputs(rng, steps=9)
    y, cache = F.mamba2_scan(*args[:7], initial_state=args[7], chunk_size=4)
    y32, cache32 = F.mamba2_scan(*(a.astype(np.float32) for a in args[:7]), initial_state=args[7], chunk_size=4)
    assert y32.dtype == cache32.starts.dtype == np.float32
    assert rel_err(y32, y, floor=1.0, relative_to="max_b") < 1e-5
    dy = rng.standard_normal(y.shape)
    for a, b in zip(F.mamba2_scan_backward(dy.astype(np.float32), cache32), F.mamba2_scan_backward(dy, cache)):
        assert a.dtype == np.float32 and rel_err(a, b, floor=1.0, relative_to="max_b") < 1e-4
    tangents = [rng.standard_normal(np.shape(a)) for a in args]
    t32 = [a.astype(np.float32) for a in tangents]
    ty32, ty = F.mamba2_scan_jvp(cache32, *t32), F.mamba2_scan_jvp(cache, *tangents)
    assert ty32.dtype == np.float32 and rel_err(ty32, ty, floor=1.0, relative_to="max_b") < 1e-4
    got = F.mamba2_scan_backward_jvp(dy.astype(np.float32), cache32, t32, dy.astype(np.float32))
    want = F.mamba2_scan_backward_jvp(dy, cache, tangents, dy)
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        assert a.dtype == np.float32 and rel_err(a, b, floor=1.0, relative_to="max_b") < 1e-4


def test_fast_tier_gradcheck_and_second_order():
    """``npattn.gradcheck`` (backward, JVP, transposition) of the chunked tier, every input, chunks
    that split the 5 steps unevenly; its second order against central differences of its backward."""
    rng = np.random.default_rng(7)
    primals = scan_inputs(rng)
    kw = dict(time_step_limit=(0.3, 1.5), chunk_size=2)
    report = npattn.gradcheck(F.mamba2_scan, *primals[:7], initial_state=primals[7], mode="both", **kw)
    assert report.ok, report
    assert {r.name for r in report.rows} == {"x", "dt", "A", "B", "C", "D", "dt_bias", "initial_state"}
    tangents = [rng.standard_normal(np.shape(a)) for a in primals]

    def cache_at(p):
        return F.mamba2_scan(*p[:7], initial_state=p[7], output_final_state=True, **kw)[1]

    dy, ddy = rng.standard_normal(primals[0].shape), rng.standard_normal(primals[0].shape)
    dfin, ddfin = rng.standard_normal(primals[7].shape), rng.standard_normal(primals[7].shape)
    _, tgrads = F.mamba2_scan_backward_jvp(dy, cache_at(primals), tangents, ddy, dfin, ddfin)
    h = 1e-6
    at = [
        F.mamba2_scan_backward(
            dy + sign * h * ddy, cache_at(_moved(primals, tangents, sign * h)), dfin + sign * h * ddfin
        )
        for sign in (1, -1)
    ]
    for t, a, b in zip(tgrads, *at):
        assert np.any(t) and rel_err(t, (a - b) / (2 * h), floor=1.0, relative_to="max_b") < 1e-7


def test_split_sequence_with_carried_state_equals_one_pass():
    """Two calls, the second from the first's final state (decoding), give one pass's outputs; the
    gradients flow back through ``dfinal_state``."""
    rng = np.random.default_rng(8)
    x, dt, A, B, C, D, bias, _ = scan_inputs(rng, steps=7)
    y, cache = F.mamba2_scan(x, dt, A, B, C, D, bias, chunk_size=3)
    cut = 4
    first = (x[..., :cut, :], dt[..., :cut], A, B[..., :cut, :], C[..., :cut, :], D, bias)
    second = (x[..., cut:, :], dt[..., cut:], A, B[..., cut:, :], C[..., cut:, :], D, bias)
    y1, c1 = F.mamba2_scan(*first, output_final_state=True, chunk_size=3)
    y2, c2 = F.mamba2_scan(*second, initial_state=c1.final_state, chunk_size=3)
    _close(np.concatenate([y1, y2], axis=-2), y)
    dy = rng.standard_normal(y.shape)
    full = F.mamba2_scan_backward(dy, cache)
    g2 = F.mamba2_scan_backward(dy[..., cut:, :], c2)
    g1 = F.mamba2_scan_backward(dy[..., :cut, :], c1, g2[7])
    _close(np.concatenate([g1[0], g2[0]], axis=-2), full[0])
    _close(g1[2] + g2[2], full[2])  # dA
    _close(np.concatenate([g1[3], g2[3]], axis=-2), full[3])  # dB


def test_bad_input_is_refused_naming_the_argument():
    rng = np.random.default_rng(9)
    x, dt, A, B, C, D, bias, s0 = scan_inputs(rng)
    call = F.mamba2_scan
    cases = [
        (lambda: call(x[0, 0], dt, A, B, C), "x"),
        (lambda: call(x, dt[..., :-1], A, B, C), "dt"),
        (lambda: call(x, dt, A[:-1], B, C), "A"),
        (lambda: call(x, dt, A, B[..., :-1, :], C), "B"),
        (lambda: call(x, dt, A, B[:, :1].repeat(3, 1), C), "B"),
        (lambda: call(x, dt, A, B, C[..., :-1]), "C"),
        (lambda: call(x, dt, A, B, C, D[:-1]), "D"),
        (lambda: call(x, dt, A, B, C, D, bias[:-1]), "dt_bias"),
        (lambda: call(x, dt, A, B, C, time_step_limit=(2.0, 1.0)), "time_step_limit"),
        (lambda: call(x, dt, A, B, C, time_step_limit=1.0), "time_step_limit"),
        (lambda: call(x, dt, A, B, C, initial_state=s0[..., :-1]), "initial_state"),
        (lambda: call(x, dt, A, B, C, chunk_size=0), "chunk_size"),
    ]
    for fn, name in cases:
        with pytest.raises(ValueError, match=name):
            fn()
    with pytest.raises(TypeError, match="output_final_state"):
        call(x, dt, A, B, C, output_final_state=1)
    with pytest.raises(TypeError):
        call(x.astype(np.float32), dt, A, B, C)
    y, cache = call(x, dt, A, B, C)
    with pytest.raises(ValueError, match="dout"):
        F.mamba2_scan_backward(y[..., :-1, :], cache)
    with pytest.raises(ValueError, match="dfinal_state"):
        F.mamba2_scan_backward(y, cache, s0[..., :-1])
    with pytest.raises(TypeError, match="cache"):
        F.mamba2_scan_backward(y, R.mamba2_scan(x, dt, A, B, C)[1])
    with pytest.raises(ValueError, match="tD"):
        F.mamba2_scan_jvp(cache, None, None, None, None, None, D)
    with pytest.raises(ValueError, match="ddfinal_state"):
        F.mamba2_scan_backward_jvp(y, cache, (x,), None, None, s0[..., :-1])


# ------------------------------------------------------------------------------ the module


def _mixer(seed=0, **kw):
    """A small ``Mamba2Mixer`` (4 heads of 4 in 2 groups, biases everywhere) with its parameters
    moved off transformers' initial values, so that every gradient path carries signal."""
    args = dict(num_heads=4, head_dim=4, state_size=3, n_groups=2, conv_kernel=3, proj_bias=True, chunk_size=2)
    m = npattn.Mamba2Mixer(8, **{**args, **kw}, rng=seed)
    rng = np.random.default_rng(seed + 1)
    for p in m.parameters():
        p.data += 0.3 * rng.standard_normal(p.data.shape)
    return m


def _hf_mixer(torch, m):
    """transformers' GraniteMoeHybridMambaLayer with ``m``'s sizes and weights, float64."""
    from transformers import GraniteMoeHybridConfig
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridMambaLayer

    cfg = GraniteMoeHybridConfig(
        hidden_size=m.hidden_size,
        num_attention_heads=2,
        num_hidden_layers=1,
        layer_types=["mamba"],
        mamba_n_heads=m.num_heads,
        mamba_d_head=m.head_dim,
        mamba_d_state=m.state_size,
        mamba_n_groups=m.n_groups,
        mamba_d_conv=m.conv_kernel,
        mamba_expand=m.num_heads * m.head_dim // m.hidden_size,
        mamba_conv_bias=m.conv_bias,
        mamba_proj_bias=m.proj_bias,
        mamba_chunk_size=m.chunk_size,
        rms_norm_eps=m.eps,
        time_step_limit=m.time_step_limit,
    )
    with float64_reference():
        hf = GraniteMoeHybridMambaLayer(cfg, 0).double().eval()
        state = {n: torch.from_numpy(a.copy()) for n, a in m.state_dict().items()}
        hf.load_state_dict(state, strict=True)
    return hf


@needs_transformers
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("limit", [(0.0, math.inf), (0.5, 1.2)])
def test_module_is_transformers_mamba_layer(padded, limit):
    """Output and every parameter's and the input's gradient under a random upstream gradient,
    float64, against transformers' ``GraniteMoeHybridMambaLayer`` (its CPU path), with a left
    padded row (its ``attention_mask``) and a clip of the step sizes."""
    torch = pytest.importorskip("torch")
    m = _mixer(time_step_limit=limit)
    hf = _hf_mixer(torch, m)
    rng = np.random.default_rng(10)
    x = rng.standard_normal((2, 6, 8))
    mask = np.ones((2, 6), dtype=np.int64)
    if padded:
        mask[1, :2] = 0
    dy = rng.standard_normal(x.shape)
    with float64_reference():
        tx = torch.tensor(x, requires_grad=True)
        ty = hf(tx, attention_mask=torch.from_numpy(mask) if padded else None)
        ty.backward(torch.from_numpy(dy))
    y = m(x, attention_mask=mask if padded else None)
    assert rel_err(y, ty, floor=1.0, relative_to="max_b") < 1e-12
    m.zero_grad()
    dx = m.backward(dy)
    assert rel_err(dx, tx.grad, floor=1.0, relative_to="max_b") < 1e-11
    grads = {n: p.grad for n, p in hf.named_parameters()}
    assert set(grads) == {n for n, _ in m.named_parameters()}
    for n, p in m.named_parameters():
        assert rel_err(p.grad, grads[n], floor=1.0, relative_to="max_b") < 1e-11, n


def test_module_gradcheck_and_second_order():
    """``npattn.gradcheck`` (backward, JVP, transposition) and ``npattn.gradgradcheck`` of the
    layer, the input and every parameter, with a left-padded row."""
    m = _mixer()
    x = np.random.default_rng(11).standard_normal((2, 5, 8))
    mask = np.array([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    report = npattn.gradcheck(m, x, mode="both", attention_mask=mask)
    assert report.ok, report
    assert {r.name for r in report.rows} >= {"input", "A_log", "D", "dt_bias", "norm.weight", "conv1d.bias"}
    second = npattn.gradgradcheck(m, x, attention_mask=mask)
    assert second.ok, second


def test_module_decoding_equals_one_pass_and_padding_leaves_a_row_alone():
    """Feeding the sequence in pieces through the cache (3, 1, then 2 tokens) gives one pass's
    outputs; a left-padded row's tokens give what the row gives alone (without in_proj's bias,
    which transformers convolves from the padding into the first tokens)."""
    m = _mixer()
    x = np.random.default_rng(12).standard_normal((2, 6, 8))
    full = m(x)
    m.reset_kv_cache()
    parts = [m(x[:, :3], use_cache=True), m(x[:, 3:4], use_cache=True), m(x[:, 4:], use_cache=True)]
    _close(np.concatenate(parts, axis=1), full)
    assert m.kv_cache_length == 6 and m.recurrent_state.shape == (2, 4, 4, 3)
    assert m.conv_state.shape == (2, 2, m.conv_dim)
    m = _mixer(proj_bias=False)  # with in_proj's bias the padding's projections reach the convolution
    mask = np.array([[1] * 6, [0, 0] + [1] * 4])
    out = m(x, attention_mask=mask)
    _close(out[1, 2:], m(x[1:, 2:])[0])


def test_module_bad_arguments_are_refused_by_name():
    for kw, name in (
        (dict(num_heads=4, n_groups=3), "n_groups"),
        (dict(num_heads=0), "num_heads"),
        (dict(time_step_limit=(1.0, 0.5)), "time_step_limit"),
        (dict(time_step_limit="x"), "time_step_limit"),
        (dict(rms_norm_eps=-1.0), "rms_norm_eps"),
    ):
        with pytest.raises(ValueError, match=name):
            npattn.Mamba2Mixer(8, **kw)
    with pytest.raises(TypeError, match="conv_bias"):
        npattn.Mamba2Mixer(8, conv_bias=1)


# -- Falcon-H1's options: out_proj's own bias, the norm before the gate or none, the muP factors --
_FALCON_MULTIPLIERS = (0.7, 1.3, 0.6, 1.7, 0.45)


def _hf_falcon_mixer(torch, m):
    """transformers' FalconH1Mixer with ``m``'s sizes, options and weights, float64 (its
    ``ssm_in_multiplier`` 1: the decoder layer's factor is not the mixer's here)."""
    from transformers import FalconH1Config
    from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1Mixer, compute_mup_vector

    cfg = FalconH1Config(
        hidden_size=m.hidden_size,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_hidden_layers=1,
        mamba_n_heads=m.num_heads,
        mamba_d_head=m.head_dim,
        mamba_d_ssm=m.num_heads * m.head_dim,
        mamba_d_state=m.state_size,
        mamba_n_groups=m.n_groups,
        mamba_d_conv=m.conv_kernel,
        mamba_conv_bias=m.conv_bias,
        mamba_proj_bias=m.proj_bias,
        projectors_bias=m.out_proj_bias,
        mamba_chunk_size=m.chunk_size,
        mamba_rms_norm=m.gated_norm is not None,
        mamba_norm_before_gate=m.gated_norm == "norm_first",
        ssm_multipliers=list(m.proj_multipliers or (1.0,) * 5),
        rms_norm_eps=m.eps,
        time_step_limit=m.time_step_limit,
    )
    with float64_reference():
        hf = FalconH1Mixer(cfg, 0).double().eval()
        hf.register_buffer("mup_vector", compute_mup_vector(cfg).double(), persistent=False)
        state = {n: torch.from_numpy(a.copy()) for n, a in m.state_dict().items()}
        hf.load_state_dict(state, strict=True)
    return hf


@needs_transformers
@pytest.mark.parametrize(
    "kw",
    [
        dict(gated_norm=None, proj_bias=False, out_proj_bias=True),
        dict(gated_norm="norm_first", proj_multipliers=_FALCON_MULTIPLIERS),
        dict(gated_norm=None, proj_multipliers=_FALCON_MULTIPLIERS, proj_bias=True, out_proj_bias=False),
    ],
    ids=["no_norm", "norm_first", "no_norm_multipliers"],
)
def test_falcon_options_are_transformers_falcon_h1_mixer(kw):
    """Falcon-H1's mixer (``FalconH1Mixer``, its CPU path, float64): output, the input's and every
    parameter's gradient under a random upstream gradient, with a left-padded row, for the norm
    after the gate's product removed or moved before the gate, the five muP factors of in_proj's
    output and out_proj's bias apart from in_proj's."""
    torch = pytest.importorskip("torch")
    m = _mixer(**kw)
    assert ("norm.weight" in dict(m.named_parameters())) == (kw["gated_norm"] is not None)
    hf = _hf_falcon_mixer(torch, m)
    rng = np.random.default_rng(13)
    x = rng.standard_normal((2, 6, 8))
    mask = np.array([[1] * 6, [0, 0] + [1] * 4])
    dy = rng.standard_normal(x.shape)
    with float64_reference():
        tx = torch.tensor(x, requires_grad=True)
        ty = hf(tx, attention_mask=torch.from_numpy(mask))
        ty.backward(torch.from_numpy(dy))
    y = m(x, attention_mask=mask)
    assert rel_err(y, ty, floor=1.0, relative_to="max_b") < 1e-12
    m.zero_grad()
    dx = m.backward(dy)
    assert rel_err(dx, tx.grad, floor=1.0, relative_to="max_b") < 1e-11
    grads = {n: p.grad for n, p in hf.named_parameters()}
    assert set(grads) == {n for n, _ in m.named_parameters()}
    for n, p in m.named_parameters():
        assert rel_err(p.grad, grads[n], floor=1.0, relative_to="max_b") < 1e-11, n


@pytest.mark.parametrize("gated_norm", [None, "norm_first"])
def test_falcon_options_gradcheck_second_order_and_decoding(gated_norm):
    """``npattn.gradcheck`` (backward, JVP) and ``npattn.gradgradcheck`` of the layer with the norm
    before the gate or none and the muP factors (a left-padded row); cached decoding in pieces
    equals one pass."""
    m = _mixer(gated_norm=gated_norm, proj_multipliers=_FALCON_MULTIPLIERS, out_proj_bias=False)
    x = np.random.default_rng(14).standard_normal((2, 5, 8))
    mask = np.array([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    report = npattn.gradcheck(m, x, mode="both", attention_mask=mask)
    assert report.ok, report
    second = npattn.gradgradcheck(m, x, attention_mask=mask)
    assert second.ok, second
    full = m(x)
    m.reset_kv_cache()
    parts = [m(x[:, :3], use_cache=True), m(x[:, 3:4], use_cache=True), m(x[:, 4:], use_cache=True)]
    _close(np.concatenate(parts, axis=1), full)


def test_falcon_options_bad_arguments_are_refused_by_name():
    for kw, name in (
        (dict(gated_norm="after"), "gated_norm"),
        (dict(proj_multipliers=(1.0, 2.0)), "proj_multipliers"),
        (dict(proj_multipliers=(1.0, 2.0, 3.0, 4.0, math.nan)), "proj_multipliers"),
        (dict(proj_multipliers="abcde"), "proj_multipliers"),
    ):
        with pytest.raises(ValueError, match=name):
            npattn.Mamba2Mixer(8, num_heads=4, head_dim=4, state_size=3, n_groups=2, **kw)
    with pytest.raises(TypeError, match="out_proj_bias"):
        npattn.Mamba2Mixer(8, out_proj_bias=1)

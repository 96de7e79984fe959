"""Second order of the modules: ``m.backward_jvp(dy, *input_tangents, param_tangents=None, ddy=None)
-> (dx, dx_tangent)`` (issue 31, item 2).

For each module, in float64, with random ``dy``, ``ddy``, input tangents and a tangent for every
parameter: ``dx`` is exactly what ``backward`` returns and ``p.grad`` receives what ``backward``
adds; ``dx_tangent`` and every ``p.grad_tangent`` equal central differences of the backward when
the inputs and the parameters move along their tangents and ``dy`` along ``ddy`` (dropout replays
the forward's masks: every generator of the module is rewound before each forward).  Then the
protocol: ``grad_tangent`` accumulates and ``zero_grad`` zeros it, the state is consumed as by
``backward``, float32 stays float32, a refused call consumes nothing, and a user module's
``_backward_jvp`` hook (also checked by ``npattn.testing.gradgradcheck``).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
from _oracles import rel_err

import npattn
from npattn import book
from npattn.nn import Sequential

# -- the check -------------------------------------------------------------------------------------------


def _perturb(m, rng, scale=0.1):
    """Move every parameter off its initial value (layer norms at ones, zero biases)."""
    for p in m.parameters():
        p.data = p.data + scale * rng.standard_normal(p.data.shape)


def _generators(m):
    """Every ``numpy.random.Generator`` the module and its submodules hold (dropout masks)."""
    found = {}
    for sub in m.modules():
        for v in vars(sub).values():
            if isinstance(v, np.random.Generator):
                found[id(v)] = v
    return list(found.values())


class _Replay:
    """Rewinds the module's generators to where they were when made, so each forward draws the
    same dropout masks."""

    def __init__(self, m):
        self.gens = _generators(m)
        self.states = [copy.deepcopy(g.bit_generator.state) for g in self.gens]

    def __call__(self):
        for g, s in zip(self.gens, self.states):
            g.bit_generator.state = copy.deepcopy(s)


def params(m):
    return m.named_parameters()


def _tuple(d):
    return d if isinstance(d, tuple) else (d,)


def _tangents(m, ins, rng):
    tins = [rng.standard_normal(a.shape) if np.asarray(a).dtype.kind == "f" else None for a in ins]
    seen, tp = set(), {}
    for n, p in m.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            tp[n] = rng.standard_normal(p.data.shape)
    return tins, tp


def _backward_at(m, replay, ins, dy, tins, tp, ddy, e, **kw):
    """``backward``'s input gradients and parameter gradients with the inputs, the parameters
    and ``dy`` moved by ``e`` along their tangents."""
    params = dict(m.named_parameters())
    base = {n: params[n].data for n in tp}
    for n in tp:
        params[n].data = base[n] + e * tp[n]
    replay()
    m(*[a if t is None else a + e * t for a, t in zip(ins, tins)], **kw)
    m.zero_grad()
    dx = _tuple(m.backward(dy + e * ddy))
    grads = {n: p.grad.copy() for n, p in m.named_parameters()}
    for n in tp:
        params[n].data = base[n]
    return dx, grads


def check_second_order(m, ins, rng, eps=1e-5, tol=1e-6, **kw):
    """``m.backward_jvp`` against ``backward`` (equal) and central differences of it (tangents)."""
    replay = _Replay(m)
    replay()
    y = m(*ins, **kw)
    y = y[0] if isinstance(y, tuple) else y  # a router's (weights, indices)
    m.clear_saved()
    dy, ddy = rng.standard_normal(y.shape), rng.standard_normal(y.shape)
    tins, tp = _tangents(m, ins, rng)

    dx_ref, grads_ref = _backward_at(m, replay, ins, dy, tins, tp, ddy, 0.0, **kw)
    replay()
    m(*ins, **kw)
    m.zero_grad()
    for p in m.parameters():
        p.grad_tangent = None
    dx, tdx = m.backward_jvp(dy, *tins, param_tangents=tp, ddy=ddy)
    dx, tdx = _tuple(dx), _tuple(tdx)
    assert len(dx) == len(tdx) == len(dx_ref)
    for a, b in zip(dx, dx_ref):  # the backward's gradients, exactly
        assert (a is None and b is None) or np.array_equal(a, b)
    for n, p in m.named_parameters():
        np.testing.assert_array_equal(p.grad, grads_ref[n], err_msg=n)
    with pytest.raises(RuntimeError):  # the state is consumed, as by backward
        m.backward_jvp(dy, *tins, param_tangents=tp, ddy=ddy)
    got = {n: np.zeros_like(p.data) if p.grad_tangent is None else p.grad_tangent.copy() for n, p in params(m)}

    (dx_p, g_p), (dx_m, g_m) = (_backward_at(m, replay, ins, dy, tins, tp, ddy, s * eps, **kw) for s in (1, -1))
    for i, (t, a, b) in enumerate(zip(tdx, dx_p, dx_m)):
        if t is None:
            assert a is None
            continue
        assert t.shape == a.shape and t.dtype == a.dtype
        assert rel_err(t, (a - b) / (2 * eps), floor=1e-2, relative_to="max_b") < tol, f"dx_tangent[{i}]"
    for n, p in m.named_parameters():
        fd = (g_p[n] - g_m[n]) / (2 * eps)
        assert got[n].shape == p.data.shape and got[n].dtype == p.data.dtype
        assert rel_err(got[n], fd, floor=1e-2, relative_to="max_b") < tol, n
    return tdx


# -- the layers ------------------------------------------------------------------------------------------

LAYERS = {
    "Linear": lambda: npattn.Linear(5, 4, rng=0),
    "Linear-nobias": lambda: npattn.Linear(5, 4, bias=False, rng=0),
    "LayerNorm": lambda: npattn.LayerNorm(5),
    "LayerNorm-nobias": lambda: npattn.LayerNorm(5, bias=False),
    "LayerNorm-noaffine": lambda: npattn.LayerNorm(5, elementwise_affine=False),
    "LayerNorm-2d": lambda: npattn.LayerNorm((3, 5)),
    "RMSNorm": lambda: npattn.RMSNorm(5, eps=1e-6),
    "RMSNorm-noaffine": lambda: npattn.RMSNorm(5, elementwise_affine=False),
    "Dropout": lambda: npattn.Dropout(0.3, rng=0),
    **{
        f"FeedForward-{act}": (lambda act=act: npattn.FeedForward(5, 7, activation=act, rng=0))
        for act in ("relu", "relu2", "xielu", "gelu", "gelu_tanh", "silu", "swiglu")
    },
    "FeedForward-xielu-dropout": lambda: npattn.FeedForward(5, 7, activation="xielu", dropout=0.25, rng=0),
    "FeedForward-dropout": lambda: npattn.FeedForward(5, 7, activation="gelu", dropout=0.25, rng=0),
    "FeedForward-swiglu-dropout": lambda: npattn.FeedForward(5, 7, activation="swiglu", dropout=0.25, rng=0),
    "Sequential": lambda: Sequential(
        npattn.Linear(5, 6, rng=0), npattn.RMSNorm(6), npattn.FeedForward(6, 8, activation="silu", rng=1)
    ),
}


@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_second_order(name):
    rng = np.random.default_rng(0)
    m = LAYERS[name]()
    _perturb(m, rng)
    check_second_order(m, (rng.standard_normal((2, 3, 5)),), rng)


def test_relu_feed_forward_in_eval_mode():
    """Outside training the feed-forward takes its path without the workspace."""
    rng = np.random.default_rng(1)
    m = npattn.FeedForward(5, 7, activation="relu", dropout=0.5, rng=0).eval()
    _perturb(m, rng)
    check_second_order(m, (rng.standard_normal((2, 3, 5)),), rng)


def test_sequential_with_a_module_used_twice():
    """A shared module's two calls: each backward_jvp takes its own state and both gradients and
    their tangents add into the shared parameters."""
    rng = np.random.default_rng(2)
    shared = npattn.Linear(5, 5, rng=0)
    m = Sequential(shared, npattn.LayerNorm(5), shared)
    _perturb(m, rng)
    check_second_order(m, (rng.standard_normal((3, 5)),), rng)


@pytest.mark.parametrize("kw", [{}, dict(padding_idx=1), dict(scale_grad_by_freq=True)])
def test_embedding_second_order(kw):
    rng = np.random.default_rng(3)
    m = npattn.Embedding(7, 4, rng=0, **kw)
    ids = np.array([[1, 3, 3, 0], [6, 1, 2, 3]])
    check_second_order(m, (ids,), rng)
    m(ids)
    with pytest.raises(TypeError, match="token ids have no tangent"):
        m.backward_jvp(np.ones((2, 4, 4)), np.ones((2, 4)))
    assert m.num_saved == 1  # refused: nothing consumed


def test_sequential_from_embedding():
    rng = np.random.default_rng(4)
    m = Sequential(npattn.Embedding(9, 5, rng=0), npattn.LayerNorm(5), npattn.Linear(5, 9, rng=1))
    _perturb(m, rng)
    dx = check_second_order(m, (rng.integers(0, 9, (2, 4)),), rng)
    assert dx == (None,)


# -- the book's classes ----------------------------------------------------------------------------------

_GPT = dict(vocab_size=13, context_length=6, emb_dim=6, n_heads=2, n_layers=2, drop_rate=0.0, qkv_bias=True)

BOOK = {
    "GELU": lambda: book.GELU(),
    "LayerNorm": lambda: book.LayerNorm(6),
    "FeedForward": lambda: book.FeedForward(dict(emb_dim=6), rng=0),
    "SelfAttention_v1": lambda: book.SelfAttention_v1(6, 4, rng=0),
    "SelfAttention_v2": lambda: book.SelfAttention_v2(6, 4, True, rng=0),
    "CausalAttention": lambda: book.CausalAttention(6, 4, 5, 0.2, True, rng=0),
    "MultiHeadAttentionWrapper": lambda: book.MultiHeadAttentionWrapper(6, 4, 5, 0.2, 2, True, rng=0),
    "MultiHeadAttention": lambda: book.MultiHeadAttention(6, 4, 5, 0.2, 2, True, rng=0),
    "TransformerBlock": lambda: book.TransformerBlock(dict(_GPT, drop_rate=0.2), rng=0),
}


@pytest.mark.parametrize("name", list(BOOK))
def test_book_second_order(name):
    rng = np.random.default_rng(5)
    m = BOOK[name]()
    _perturb(m, rng)
    check_second_order(m, (rng.standard_normal((2, 4, 6)),), rng)


@pytest.mark.parametrize("drop_rate", [0.0, 0.2])
def test_book_gpt_second_order(drop_rate):
    rng = np.random.default_rng(6)
    m = book.GPTModel(dict(_GPT, drop_rate=drop_rate), rng=0)
    _perturb(m, rng)
    assert check_second_order(m, (rng.integers(0, 13, (2, 5)),), rng) == (None,)
    m(np.array([1, 2, 3]))
    with pytest.raises(TypeError, match="token ids have no tangent"):
        m.backward_jvp(np.ones((3, 13)), np.ones(3))


# -- the protocol ----------------------------------------------------------------------------------------


def test_grad_tangent_accumulates_and_zero_grad_zeros_it():
    rng = np.random.default_rng(6)
    m = npattn.FeedForward(4, 6, activation="swiglu", rng=0)
    assert all(p.grad_tangent is None for p in m.parameters())  # none before a second order
    x, dy, ddy = rng.standard_normal((3, 4)), rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    tp = {"linear1.weight": rng.standard_normal((6, 4))}
    m(x)
    m.backward_jvp(dy, None, param_tangents=tp, ddy=ddy)
    once = {n: p.grad_tangent.copy() for n, p in m.named_parameters()}
    assert all(np.any(v) for v in once.values())
    m(x)
    m.backward_jvp(dy, None, param_tangents=tp, ddy=ddy)
    for n, p in m.named_parameters():  # added, not replaced
        np.testing.assert_allclose(p.grad_tangent, 2 * once[n], rtol=1e-14, atol=0, err_msg=n)
        assert p.grad_tangent.shape == p.grad.shape and p.grad_tangent.dtype == p.grad.dtype
    m.zero_grad()
    assert all(not np.any(p.grad_tangent) and not np.any(p.grad) for p in m.parameters())
    p = npattn.Parameter(np.ones(3))
    p.zero_grad()  # a None grad_tangent stays None
    assert p.grad_tangent is None


def test_tangents_left_out_are_zero():
    """No tangent at all: the gradients' tangents are zero; ``ddy`` alone: the backward of ``ddy``
    (the backward is linear in ``dy``)."""
    rng = np.random.default_rng(7)
    m = npattn.FeedForward(4, 6, activation="gelu", rng=0)
    x, dy, ddy = rng.standard_normal((3, 4)), rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    m(x)
    dx, tdx = m.backward_jvp(dy)
    assert not np.any(tdx) and all(not np.any(p.grad_tangent) for p in m.parameters())
    m.zero_grad()
    m(x)
    _, tdx = m.backward_jvp(dy, ddy=ddy)
    tangents = {n: p.grad_tangent.copy() for n, p in m.named_parameters()}
    m.zero_grad()
    m(x)
    np.testing.assert_allclose(tdx, m.backward(ddy), rtol=1e-13, atol=1e-15)
    for n, p in m.named_parameters():
        np.testing.assert_allclose(tangents[n], p.grad, rtol=1e-13, atol=1e-15, err_msg=n)


def test_float32_stays_float32():
    rng = np.random.default_rng(8)
    m64 = npattn.FeedForward(4, 6, activation="swiglu", rng=0)
    m32 = copy.deepcopy(m64).to(np.float32)
    x, dy, ddy, tx = (rng.standard_normal((2, 3, 4)) for _ in range(4))
    tp = {n: rng.standard_normal(p.shape) for n, p in m64.named_parameters()}
    out = []
    for m in (m64, m32):
        m(x.astype(m.dtype))
        dx, tdx = m.backward_jvp(dy, tx, param_tangents=tp, ddy=ddy)
        assert dx.dtype == tdx.dtype == m.dtype
        assert all(p.grad_tangent.dtype == m.dtype for p in m.parameters())
        out.append((tdx, {n: p.grad_tangent for n, p in m.named_parameters()}))
    assert rel_err(out[1][0], out[0][0], floor=1.0, relative_to="max_b") < 1e-5
    for n in tp:
        assert rel_err(out[1][1][n], out[0][1][n], floor=1.0, relative_to="max_b") < 1e-5, n
    # to() casts an existing grad_tangent too
    m64.to(np.float32)
    assert all(p.grad_tangent.dtype == np.float32 for p in m64.parameters())


def test_state_and_refusals():
    rng = np.random.default_rng(9)
    m = npattn.Linear(4, 3, rng=0)
    x, dy = rng.standard_normal((2, 4)), rng.standard_normal((2, 3))
    with pytest.raises(RuntimeError, match="no forward state"):
        m.backward_jvp(dy)
    m(x)
    with pytest.raises(ValueError, match="ddy"):
        m.backward_jvp(dy, ddy=np.ones((2, 4)))
    with pytest.raises(ValueError, match="dy"):
        m.backward_jvp(np.ones((2, 4)))
    with pytest.raises(ValueError, match="unknown parameter 'wieght'"):
        m.backward_jvp(dy, param_tangents={"wieght": np.ones((3, 4))})
    with pytest.raises(TypeError, match="at most one input tangent"):
        m.backward_jvp(dy, None, None)
    m.weight.grad_tangent = np.zeros((4, 3))
    with pytest.raises(TypeError, match="grad_tangent"):
        m.backward_jvp(dy)
    m.weight.grad_tangent = None
    assert m.num_saved == 1 and not np.any(m.weight.grad)  # every refusal consumed nothing
    m.backward_jvp(dy)
    with pytest.raises(RuntimeError, match="no forward state"):  # consumed, as backward
        m.backward(dy)
    m(x)
    m.weight.data = m.weight.data * 2  # a parameter changed after the forward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        m.backward_jvp(dy)
    with npattn.no_grad():
        m(x)
    with pytest.raises(RuntimeError, match="no_grad"):
        m.backward_jvp(dy)


# -- a user module ---------------------------------------------------------------------------------------


class Scale(npattn.Module):
    """``y = tanh(x) * scale``: backward and its second order by hand, through the hook."""

    def __init__(self, n):
        super().__init__()
        self.scale = npattn.Parameter(np.linspace(0.5, 1.5, n))

    def forward(self, x):
        t = np.tanh(x)
        self.save_for_backward((x, t))
        return t * self.scale.data

    def backward(self, dy):
        dy = self._check_dy(dy)
        x, t = self.pop_saved()
        self.accumulate_grad(self.scale, (dy * t).reshape(-1, t.shape[-1]).sum(0))
        return dy * self.scale.data * (1 - t**2)

    def _jvp(self, state, input_tangents, param_tangents):  # forward mode: inside a composite
        x, t = state
        (tx,) = input_tangents or (None,)
        ts = param_tangents.get(self.scale)
        ty = np.zeros_like(x) if tx is None else (1 - t**2) * tx * self.scale.data
        return ty if ts is None else ty + t * ts

    def _backward_jvp(self, state, dy, input_tangents, param_tangents, ddy):
        x, t = state
        (tx,) = input_tangents or (None,)
        tx = np.zeros_like(x) if tx is None else tx
        ddy = np.zeros_like(dy) if ddy is None else ddy
        ts = param_tangents.get(self.scale)
        ts = np.zeros_like(self.scale.data) if ts is None else ts
        tt = (1 - t**2) * tx  # the tangent of tanh(x)
        s = self.scale.data
        self.accumulate_grad(self.scale, (dy * t).reshape(-1, t.shape[-1]).sum(0))
        self.accumulate_grad_tangent(self.scale, (ddy * t + dy * tt).reshape(-1, t.shape[-1]).sum(0))
        dx = dy * s * (1 - t**2)
        tdx = ddy * s * (1 - t**2) + dy * ts * (1 - t**2) - 2 * dy * s * t * tt
        return dx, tdx


def test_user_module_hook():
    rng = np.random.default_rng(10)
    m = Scale(4)
    check_second_order(m, (rng.standard_normal((3, 4)),), rng)
    inside = Sequential(npattn.Linear(4, 4, rng=0), Scale(4), npattn.LayerNorm(4))  # composed
    _perturb(inside, rng)
    check_second_order(inside, (rng.standard_normal((3, 4)),), rng)


def test_user_module_without_second_order():
    class Plain(npattn.Module):
        def forward(self, x):
            self.save_for_backward(None)
            return 2 * x

        def backward(self, dy):
            self.pop_saved()
            return 2 * dy

    m = Plain()
    m(np.ones(3))
    with pytest.raises(NotImplementedError, match="_backward_jvp"):
        m.backward_jvp(np.ones(3))
    np.testing.assert_array_equal(m.backward(np.ones(3)), 2 * np.ones(3))  # nothing consumed


def test_gradgradcheck_checks_the_modules():
    gradgradcheck = pytest.importorskip("npattn.testing.gradgradcheck").gradgradcheck
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 3, 4))
    for m in (npattn.FeedForward(4, 6, activation="swiglu", rng=0), npattn.LayerNorm(4), Scale(4)):
        _perturb(m, rng)
        report = gradgradcheck(m, x)
        assert report.ok, str(report)


# -- MultiHeadAttention ----------------------------------------------------------------------------------

MHA_OPTIONS = {
    "plain": dict(),
    "biases-causal": dict(qkv_bias=True, causal=True),
    "gqa-rope-qknorm": dict(num_kv_heads=1, rope=True, qk_norm=True, qk_norm_eps=1e-6, causal=True),
    "qknorm-offset-partial-rope": dict(
        qk_norm=True, qk_norm_unit_offset=True, rope=True, partial_rotary_factor=0.5, head_dim=4
    ),
    "gate-sinks-window": dict(output_gate=True, sinks=True, window=(2, 0), causal=True, qkv_bias=True),
    "softcap-alibi": dict(softcap=5.0, alibi=True, causal=True),
    "memory-efficient": dict(memory_efficient=True, causal=True, sinks=True, num_kv_heads=1),
    "bias-kv-zero-attn": dict(add_bias_kv=True, add_zero_attn=True, causal=True, qkv_bias=True),
    "dropout": dict(dropout=0.3, qkv_bias=True),
    "dropout-memory-efficient": dict(dropout=0.3, memory_efficient=True),
}


@pytest.mark.parametrize("name", list(MHA_OPTIONS))
def test_multi_head_attention_second_order(name):
    rng = np.random.default_rng(12)
    m = npattn.MultiHeadAttention(6, 8, 2, rng=0, **MHA_OPTIONS[name])
    _perturb(m, rng)
    check_second_order(m, (rng.standard_normal((2, 5, 6)),), rng)


def test_multi_head_attention_masks_and_unbatched():
    rng = np.random.default_rng(13)
    m = npattn.MultiHeadAttention(6, 8, 2, qkv_bias=True, rng=0)
    _perturb(m, rng)
    pad = np.array([[False, False, False, True, True], [False] * 5])
    check_second_order(m, (rng.standard_normal((2, 5, 6)),), rng, key_padding_mask=pad)
    check_second_order(m, (rng.standard_normal((5, 6)),), rng, attn_mask=np.tri(5, dtype=bool))


@pytest.mark.parametrize("kw", [dict(), dict(output_gate=True, qkv_bias=True, num_kv_heads=1)])
def test_cross_attention_second_order(kw):
    """Three inputs: dx and dx_tangent are tuples (dquery, dkey, dvalue), as backward returns."""
    rng = np.random.default_rng(14)
    m = npattn.MultiHeadAttention(6, 8, 2, kdim=5, vdim=3, rng=0, **kw)
    _perturb(m, rng)
    ins = (rng.standard_normal((2, 4, 6)), rng.standard_normal((2, 3, 5)), rng.standard_normal((2, 3, 3)))
    tdx = check_second_order(m, ins, rng)
    assert len(tdx) == 3


# -- the blocks ------------------------------------------------------------------------------------------

BLOCKS = [
    dict(norm_first=False, activation="relu", dropout=0.0),
    dict(norm_first=True, activation="gelu", causal=True, dropout=0.0),
    dict(norm_first=False, activation="swiglu", bias=False, dropout=0.2),
    dict(norm_first=True, activation="silu", dropout=0.2),
]


@pytest.mark.parametrize("kw", BLOCKS)
def test_encoder_block_second_order(kw):
    rng = np.random.default_rng(15)
    m = npattn.EncoderBlock(8, 2, 12, rng=1, **kw)
    _perturb(m, rng)
    pad = np.array([[False, False, False, True], [False] * 4])
    check_second_order(m, (rng.standard_normal((2, 4, 8)),), rng, key_padding_mask=pad)


@pytest.mark.parametrize("kw", BLOCKS)
def test_decoder_block_second_order(kw):
    rng = np.random.default_rng(16)
    kw = {k: v for k, v in kw.items() if k != "causal"}
    m = npattn.DecoderBlock(8, 2, 12, causal=True, rng=2, **kw)
    _perturb(m, rng)
    ins = (rng.standard_normal((2, 4, 8)), rng.standard_normal((2, 3, 8)))
    mem_pad = np.array([[False, False, True], [False] * 3])
    tdx = check_second_order(m, ins, rng, memory_key_padding_mask=mem_pad)
    assert len(tdx) == 2


# -- TinyTransformer -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw", [dict(activation="gelu"), dict(dropout=0.2, activation="swiglu")])
def test_tiny_transformer_second_order(kw):
    from npattn.models import TinyTransformer

    rng = np.random.default_rng(17)
    m = TinyTransformer(11, 6, 8, 2, 2, 12, embedding_std=1.0, rng=0, **kw)
    _perturb(m, rng)
    assert check_second_order(m, (rng.integers(0, 11, (2, 5)),), rng) == (None,)
    check_second_order(m, (rng.integers(0, 11, (5,)),), rng)  # unbatched


# -- MultiHeadLatentAttention ----------------------------------------------------------------------------

_MLA = dict(kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=3)


@pytest.mark.parametrize(
    "kw, absorb",
    [
        (dict(), False),
        (dict(), True),
        (dict(q_lora_rank=5, attention_bias=True, rope_interleave=False), False),
        (dict(q_lora_rank=5, attention_bias=True), True),
    ],
)
def test_latent_attention_second_order(kw, absorb):
    rng = np.random.default_rng(18)
    m = npattn.MultiHeadLatentAttention(8, 2, rng=0, **_MLA, **kw)
    _perturb(m, rng)
    x = rng.standard_normal((2, 4, 8))
    check_second_order(m, (x,), rng, absorb=absorb)
    check_second_order(m, (x,), rng, absorb=absorb, positions=np.array([[0, 1, 2, 3], [3, 4, 5, 6]]))


# -- mixture of experts ----------------------------------------------------------------------------------


@pytest.mark.parametrize("act", ["silu", "gelu", "relu", "relu2"])
def test_gated_mlp_second_order(act):
    from npattn.nn.moe import GatedMLP

    rng = np.random.default_rng(19)
    m = GatedMLP(5, 6, act, bias=True, rng=0)
    _perturb(m, rng)
    check_second_order(m, (rng.standard_normal((2, 3, 5)),), rng)


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(variant="topk_softmax", bias=True),
        dict(variant="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5),
        dict(variant="softmax_topk", norm_topk_prob=True),
        dict(variant="sigmoid", norm_topk_prob=True, norm_topk_eps=0.5, correction_bias=False),  # LFM2-MoE's
    ],
)
def test_router_second_order(kw):
    """The router's weights (``forward`` returns ``(weights, indices)``): the choice of experts is
    constant under small moves (random scores are well apart at this step)."""
    from npattn.nn.moe import TopKRouter

    rng = np.random.default_rng(20)
    m = TopKRouter(5, 6, 2, rng=0, **kw)
    _perturb(m, rng, scale=1.0)
    check_second_order(m, (rng.standard_normal((2, 3, 5)),), rng)


@pytest.mark.parametrize("cls", ["Experts", "GptOssExperts", "PlainExperts"])
def test_experts_second_order(cls):
    """Three inputs ``(x, top_k_index, top_k_weights)``: the indices take no tangent; ``dx`` and
    ``dx_tangent`` are ``(dx, dtop_k_weights)`` pairs."""
    import npattn.nn.moe as moe

    rng = np.random.default_rng(21)
    m = getattr(moe, cls)(4, 5, 3, rng=0)
    _perturb(m, rng)
    x, idx, w = rng.standard_normal((2, 3, 5)), rng.integers(0, 4, (2, 3, 2)), rng.random((2, 3, 2))
    tdx = check_second_order(m, (x, idx, w), rng)
    assert len(tdx) == 2


@pytest.mark.parametrize(
    "kw",
    [
        dict(shared_intermediate_size=3, shared_expert_gate=True, norm_topk_prob=True),
        dict(shared_intermediate_size=3, router="sigmoid", routed_scaling_factor=1.5),
        dict(experts="gpt_oss", router="topk_softmax", router_bias=True),
        # Nemotron 3's: experts that are not gated (relu2), a plain shared expert with biases, a
        # latent width with biased projections; then silu experts on x itself
        dict(
            experts="plain",
            hidden_act="relu2",
            router="sigmoid",
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            shared_intermediate_size=3,
            shared_bias=True,
            latent_size=2,
            latent_bias=True,
        ),
        dict(experts="plain", hidden_act="silu", router="sigmoid", shared_intermediate_size=4),
    ],
)
def test_sparse_moe_block_second_order(kw):
    from npattn.nn.moe import SparseMoeBlock

    rng = np.random.default_rng(22)
    m = SparseMoeBlock(5, 4, 2, 3, rng=0, **kw)
    _perturb(m, rng, scale=0.5)
    check_second_order(m, (rng.standard_normal((2, 3, 5)),), rng)


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(projections="qkv_z_b_a"),
        dict(chunk_size=2, attention_mask=np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])),
        dict(chunk_size=64, projections="qkv_z_b_a", attention_mask=np.array([[1, 1, 1, 0, 1], [0, 1, 1, 1, 1]])),
    ],
)
def test_gated_delta_net_second_order(kw):
    """Grouped key heads (4 value heads on 2 key heads), both projection layouts, chunks of 3, 2
    and 64 over 5 steps, left and inner padding: the chunked gated_delta_rule_backward_jvp with
    the convolution's and the gated norm's, against central differences of the backward (eps
    1e-6: at 1e-5 their eps^2 error is 3e-5 of the largest element)."""
    kw = dict(kw)
    mask = kw.pop("attention_mask", None)
    rng = np.random.default_rng(23)
    layout = kw.pop("projections", "qkvz_ba")
    m = npattn.GatedDeltaNet(8, 4, 2, 3, 2, projections=layout, rng=0, **{"chunk_size": 3, **kw})
    _perturb(m, rng, scale=0.3)
    extra = {} if mask is None else dict(attention_mask=mask)
    check_second_order(m, (rng.standard_normal((2, 5, 8)),), rng, eps=1e-6, **extra)


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(conv_bias=True),
        dict(conv_bias=True, attention_mask=np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])),
    ],
)
def test_short_conv_second_order(kw):
    """LFM2's gated short convolution (3 taps over 5 steps, with and without biases, left padding):
    the products' rule around causal_conv1d_backward_jvp without an activation, against central
    differences of the backward."""
    kw = dict(kw)
    mask = kw.pop("attention_mask", None)
    rng = np.random.default_rng(29)
    m = npattn.ShortConv(6, 3, rng=0, **kw)
    _perturb(m, rng, scale=0.3)
    extra = {} if mask is None else dict(attention_mask=mask)
    check_second_order(m, (rng.standard_normal((2, 5, 6)),), rng, eps=1e-6, **extra)


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(chunk_size=2, attention_mask=np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])),
        dict(chunk_size=16, attention_mask=np.array([[1, 1, 1, 0, 1], [0, 1, 1, 1, 1]])),
    ],
)
def test_kimi_delta_attention_second_order(kw):
    """Kimi Linear's KDA layer (2 heads of 3, a decay per channel), chunks of 3, 2 and 16 over 5
    steps, left and inner padding: the chunked kimi_delta_attention_backward_jvp with the
    convolution's, the gates' and the norm's second order, against central differences of the
    backward, and ``npattn.gradgradcheck`` (the Hessian's symmetry included)."""
    from npattn.nn.kimi_delta import KimiDeltaAttention

    kw = dict(kw)
    mask = kw.pop("attention_mask", None)
    rng = np.random.default_rng(24)
    m = KimiDeltaAttention(8, 2, 3, 3, rng=0, **{"chunk_size": 3, **kw})
    _perturb(m, rng, scale=0.3)
    extra = {} if mask is None else dict(attention_mask=mask)
    x = rng.standard_normal((2, 5, 8))
    check_second_order(m, (x,), rng, eps=1e-6, **extra)
    report = npattn.gradgradcheck(m, x, **extra)
    assert report.ok, str(report)


# -- a jvp's forward tangents reused by the backward_jvp after it ------------------------------------------


def _reuse_case(kind, rng):
    """A module with every parameter moved, its input and a random ``dy``."""
    if kind == "mha":
        m = npattn.MultiHeadAttention(6, 8, 2, causal=True, rope=True, qk_norm=True, output_gate=True, rng=0)
        x = rng.standard_normal((2, 5, 6))
    else:  # a composite: its children's forward tangents are remembered through it
        m = Sequential(npattn.MultiHeadAttention(6, 6, 2, causal=True, rng=0), npattn.LayerNorm(6))
        x = rng.standard_normal((2, 5, 6))
    _perturb(m, rng)
    return m, x, rng.standard_normal((2, 5, 8 if kind == "mha" else 6))


def _second(m, x, dy, *, jvp=None, tx=None, v=None, ddy=None, mutate=None):
    """``backward_jvp(dy, tx, param_tangents=v, ddy=ddy)`` after a fresh forward, with first a
    ``jvp(*jvp[0], param_tangents=jvp[1])`` of that state when given (then ``mutate(v)``)."""
    m.zero_grad()
    for p in m.parameters():
        p.grad_tangent = None
    m(x)
    if jvp is not None:
        m.jvp(*jvp[0], param_tangents=jvp[1])
        if mutate is not None:
            mutate(v)
    dx, tdx = m.backward_jvp(dy, tx, param_tangents=v, ddy=ddy)
    return [dx, tdx] + [p.grad_tangent.copy() for p in m.parameters()]


@pytest.mark.parametrize("kind", ["mha", "sequential"])
def test_backward_jvp_reuses_only_the_same_tangents(kind, monkeypatch):
    """After ``jvp`` along the tangents that ``backward_jvp`` gets (the same arrays, or equal
    copies), the forward tangents are computed once (counted) and the result is the one worked
    from scratch bit for bit; along other values (other arrays, the same dict with its arrays
    replaced, the same arrays changed in place, another input tangent, a new forward in between)
    nothing the ``jvp`` computed is used: a stale reuse would give the first direction's
    curvature, far from the second's."""
    rng = np.random.default_rng(40)
    m, x, dy = _reuse_case(kind, rng)
    draw = lambda: {n: rng.standard_normal(p.data.shape) for n, p in m.named_parameters()}  # noqa: E731
    v1, v2, v3 = draw(), draw(), draw()
    tx1, tx2, ddy = rng.standard_normal(x.shape), rng.standard_normal(x.shape), rng.standard_normal(dy.shape)
    core = npattn.nn.attention_core.MultiHeadAttentionCore
    calls = []
    original = core._forward_tangents
    monkeypatch.setattr(core, "_forward_tangents", lambda *a: calls.append(1) or original(*a))

    want = _second(m, x, dy, tx=tx2, v=v2, ddy=ddy)
    calls.clear()
    for tangents in ((tx2,), v2), ((tx2.copy(),), {n: a.copy() for n, a in v2.items()}):
        calls.clear()
        got = _second(m, x, dy, jvp=tangents, tx=tx2, v=v2, ddy=ddy)
        assert len(calls) == 1  # the jvp's, reused
        assert all(np.array_equal(a, b) for a, b in zip(got, want))

    other = _second(m, x, dy, tx=tx1, v=v1, ddy=ddy)
    assert rel_err(other[1], want[1]) > 1e-3  # dx's tangent: so a stale reuse shows
    stale_cases = [
        dict(jvp=((tx1,), v1), tx=tx2, v=v2),  # other arrays
        dict(jvp=((tx2,), v1), tx=tx2, v=v1, mutate=lambda v: v.update(v2)),  # the same dict, arrays replaced
        dict(jvp=((tx2,), v3), tx=tx2, v=v3, mutate=lambda v: [v[n].__setitem__(..., v2[n]) for n in v]),  # in place
    ]
    for case in stale_cases:
        calls.clear()
        got = _second(m, x, dy, ddy=ddy, **case)
        assert len(calls) == 2
        assert all(np.array_equal(a, b) for a, b in zip(got, want))
    calls.clear()
    got = _second(m, x, dy, jvp=((tx1,), v2), tx=tx2, v=v2, ddy=ddy)  # another input tangent
    assert len(calls) == 2 and all(np.array_equal(a, b) for a, b in zip(got, want))
    m(x)  # a jvp of one forward, a backward_jvp of the next: that state has no jvp of its own
    m.jvp(tx1, param_tangents=v1)
    calls.clear()
    got = _second(m, x, dy, tx=tx2, v=v2, ddy=ddy)
    assert len(calls) == 1 and all(np.array_equal(a, b) for a, b in zip(got, want))
    m.clear_saved()


def test_gated_mlp_multipliers_second_order():
    """The second order of ``GatedMLP`` with Falcon-H1's two multipliers."""
    from npattn.nn.moe import GatedMLP

    rng = np.random.default_rng(23)
    m = GatedMLP(5, 6, "silu", bias=True, gate_multiplier=0.6, down_multiplier=1.9, rng=0)
    _perturb(m, rng)
    check_second_order(m, (rng.standard_normal((2, 3, 5)),), rng)

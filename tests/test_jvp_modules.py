"""Forward mode (``jvp``) of the composite modules: ``EncoderBlock``, ``DecoderBlock``,
``CausalLM`` (every family), ``TinyTransformer`` and the book's classes (``npattn.book``).

Each module's JVP, with random tangents for its float inputs and for every parameter at once, is
checked against central differences of the forward (inputs and parameters moved together), against
its backward by the transposition identity ``<u, J t> = <J^T u, t>``, and the forward state must
survive ``jvp``: the backward that follows gives exactly the gradients it gives without it.
``npattn.gradcheck(mode="both")`` checks each tensor's tangent on its own.  Where torch is
importable, ``torch.func.jvp`` of the equivalent torch module (``TransformerEncoderLayer``, the
book's chapter-4 ``GPTModel``) gives the same tangent in float64.
"""

from __future__ import annotations

import copy
import importlib.util
import os

import numpy as np
import pytest
from _families import FAMILIES
from _oracles import rel_err

import npattn
from npattn import book
from npattn.models import CausalLM, TinyTransformer
from npattn.nn.transformer import DecoderBlock, EncoderBlock, _rename_torch_state

HERE = os.path.dirname(__file__)


def _perturb(m, rng, scale=0.1):
    """Move every parameter off its initial value (layer norms at ones, zero biases)."""
    for p in m.parameters():
        p.data[...] += scale * rng.standard_normal(p.data.shape)


def _param_tangents(m, rng):
    """A random tangent for every parameter, by name (a tied parameter once)."""
    seen, out = set(), {}
    for n, p in m.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out[n] = rng.standard_normal(p.data.shape)
    return out


def _input_tangents(ins, rng):
    """A random tangent for each float input; integer inputs (token ids) take None."""
    return [rng.standard_normal(a.shape) if a.dtype.kind == "f" else None for a in ins]


def _fd_jvp(m, ins, tins, tp, eps=1e-6, **kw):
    """Central differences of the output along the inputs' and parameters' tangents together."""
    params = {n: p for n, p in m.named_parameters() if n in tp}
    base = {n: p.data.copy() for n, p in params.items()}

    def f(sign):
        for n, p in params.items():
            p.data = base[n] + sign * eps * tp[n]
        moved = [a if t is None else a + sign * eps * t for a, t in zip(ins, tins)]
        with npattn.no_grad():
            return m(*moved, **kw)

    num = (f(1) - f(-1)) / (2 * eps)
    for n, p in params.items():
        p.data = base[n]
    return num


def _grads(m, ins, u, jvp_args=None, **kw):
    """Input and parameter gradients of ``<u, m(*ins)>``, with a ``jvp`` between forward and
    backward when ``jvp_args`` is given; returns ``(input grads, {name: grad}, the jvp)``."""
    m.zero_grad()
    m(*ins, **kw)
    t = None if jvp_args is None else m.jvp(*jvp_args[0], param_tangents=jvp_args[1])
    g = m.backward(u)
    g = g if isinstance(g, tuple) else (g,)
    return g, {n: p.grad.copy() for n, p in m.named_parameters()}, t


def _assert_transposed(u, t, input_grads, tins, param_grads, tp):
    """``<u, J t> = <J^T u, t>``: the JVP against the backward's input and parameter gradients."""
    lhs = float(np.sum(u * t))
    rhs = sum(float(np.sum(g * ti)) for g, ti in zip(input_grads, tins) if ti is not None)
    rhs += sum(float(np.sum(param_grads[n] * tp[n])) for n in tp)
    assert abs(lhs - rhs) <= 1e-10 * max(1.0, abs(lhs)), (lhs, rhs)


def _jvp_then_backward(m, ins, rng):
    """One forward, its JVP along random tangents, then the backward of the same forward (with
    dropout: the same masks); checks the transposition identity and returns ``(jvp, tins, tp)``."""
    tins, tp = _input_tangents(ins, rng), _param_tangents(m, rng)
    y = m(*ins)
    t = m.jvp(*tins, param_tangents=tp)
    u = rng.standard_normal(y.shape)
    m.zero_grad()
    g = m.backward(u)
    g = g if isinstance(g, tuple) else (g,)
    _assert_transposed(u, t, g, tins, {n: p.grad for n, p in m.named_parameters()}, tp)
    return t, tins, tp


def _check_jvp(m, ins, rng, fd_tol=1e-6, **kw):
    """The JVP of ``m`` at ``ins`` along random tangents of every float input and every parameter:
    central differences, the transposition identity, the state kept for backward."""
    tins, tp = _input_tangents(ins, rng), _param_tangents(m, rng)
    y = m(*ins, **kw)
    t = m.jvp(*tins, param_tangents=tp)
    np.testing.assert_array_equal(t, m.jvp(*tins, param_tangents=tp))  # the state is not consumed
    m.clear_saved()
    assert t.shape == y.shape and t.dtype == y.dtype
    u = rng.standard_normal(y.shape)
    g0, p0, _ = _grads(m, ins, u, **kw)
    g1, p1, t1 = _grads(m, ins, u, (tins, tp), **kw)
    np.testing.assert_array_equal(t1, t)
    for a, b in zip(g0, g1):  # backward after jvp: the same gradients as without it
        assert (a is None and b is None) or np.array_equal(a, b)
    for n in p0:
        np.testing.assert_array_equal(p0[n], p1[n], err_msg=n)
    _assert_transposed(u, t, g1, tins, p1, tp)
    num = _fd_jvp(m, ins, tins, tp, **kw)
    assert rel_err(t, num, floor=1.0, relative_to="max_b") < fd_tol, rel_err(t, num, floor=1.0, relative_to="max_b")
    return t


def _gradcheck_both(m, *ins, seed=0):
    report = npattn.gradcheck(m, *ins, mode="both", fast=True, seed=seed)
    assert report.ok, str(report)


# -- EncoderBlock / DecoderBlock --------------------------------------------------------------------
BLOCKS = [
    dict(norm_first=False, activation="relu"),
    dict(norm_first=True, activation="gelu", causal=True, qkv_bias=True),
    dict(norm_first=False, activation="swiglu", bias=False),
]


@pytest.mark.parametrize("kw", BLOCKS)
def test_encoder_block_jvp(kw):
    rng = np.random.default_rng(0)
    m = EncoderBlock(8, 2, 12, dropout=0.0, rng=1, **kw)
    _perturb(m, rng)
    x = rng.standard_normal((2, 4, 8))
    _check_jvp(m, (x,), rng)
    _gradcheck_both(m, x)


@pytest.mark.parametrize("kw", [dict(norm_first=False), dict(norm_first=True, causal=True, activation="gelu")])
def test_decoder_block_jvp(kw):
    rng = np.random.default_rng(1)
    m = DecoderBlock(8, 2, 12, dropout=0.0, rng=2, **kw)
    _perturb(m, rng)
    x, memory = rng.standard_normal((2, 4, 8)), rng.standard_normal((2, 3, 8))
    _check_jvp(m, (x, memory), rng)
    _gradcheck_both(m, x, memory)


def test_blocks_jvp_with_masks():
    rng = np.random.default_rng(2)
    enc = EncoderBlock(8, 2, 12, dropout=0.0, rng=3)
    dec = DecoderBlock(8, 2, 12, dropout=0.0, norm_first=True, rng=4)
    _perturb(enc, rng)
    _perturb(dec, rng)
    x, memory = rng.standard_normal((2, 4, 8)), rng.standard_normal((2, 3, 8))
    pad = np.array([[False, False, False, True], [False, False, False, False]])
    _check_jvp(enc, (x,), rng, key_padding_mask=pad)
    mem_pad = np.array([[False, False, True], [False, False, False]])
    _check_jvp(dec, (x, memory), rng, tgt_mask=np.tri(4, dtype=bool), memory_key_padding_mask=mem_pad)


@pytest.mark.parametrize("cls", [EncoderBlock, DecoderBlock])
@pytest.mark.parametrize("norm_first", [False, True])
def test_blocks_dropout_uses_the_forwards_masks(cls, norm_first):
    """With dropout the forward draws fresh masks: the JVP must use this forward's (attention,
    feed-forward and residual dropouts), which the transposition identity with backward tests."""
    rng = np.random.default_rng(3)
    m = cls(8, 2, 12, dropout=0.3, norm_first=norm_first, rng=5)
    ins = (rng.standard_normal((2, 4, 8)),) + ((rng.standard_normal((2, 3, 8)),) if cls is DecoderBlock else ())
    t, tins, tp = _jvp_then_backward(m, ins, rng)
    m.eval()  # and without dropout the JVP differs: the masks did act
    m(*ins)
    assert rel_err(m.jvp(*tins, param_tangents=tp), t, floor=1.0, relative_to="max_b") > 1e-3


def test_blocks_jvp_tangents_left_out_are_zero_and_refused():
    rng = np.random.default_rng(4)
    m = DecoderBlock(8, 2, 12, dropout=0.0, rng=6)
    x, memory = rng.standard_normal((2, 4, 8)), rng.standard_normal((2, 3, 8))
    with pytest.raises(RuntimeError, match="no forward state"):
        m.jvp(x)
    m(x, memory)
    assert not np.any(m.jvp())
    tm = rng.standard_normal(memory.shape)
    np.testing.assert_array_equal(m.jvp(None, tm), m.jvp(np.zeros_like(x), tm, param_tangents={}))
    with pytest.raises(ValueError, match="tx"):
        m.jvp(np.zeros((2, 4, 7)))
    with pytest.raises(ValueError, match="tmemory"):
        m.jvp(None, np.zeros((2, 4, 8)))
    with pytest.raises(TypeError, match="tmemory"):
        m.jvp(None, np.zeros(memory.shape, bool))
    with pytest.raises(TypeError, match="at most 2"):
        m.jvp(None, None, None)
    e = EncoderBlock(8, 2, 12, rng=7)
    e(x)
    with pytest.raises(TypeError, match="at most 1"):
        e.jvp(None, None)
    with pytest.raises(ValueError, match="tx"):
        e.jvp(np.zeros((4, 8)))


def test_encoder_block_jvp_float32_stays_float32():
    rng = np.random.default_rng(5)
    m64 = EncoderBlock(8, 2, 12, dropout=0.0, norm_first=True, rng=8)
    _perturb(m64, rng)
    m32 = copy.deepcopy(m64).to(np.float32)
    x, tx = rng.standard_normal((2, 4, 8)), rng.standard_normal((2, 4, 8))
    tp = _param_tangents(m64, rng)
    m64(x)
    m32(x.astype(np.float32))
    t32 = m32.jvp(tx, param_tangents=tp)
    assert t32.dtype == np.float32
    assert rel_err(t32, m64.jvp(tx, param_tangents=tp), floor=1.0, relative_to="max_b") < 1e-4


def _torch_encoder(torch, E, H, d_ff, norm_first, activation):
    torch.manual_seed(0)
    tm = torch.nn.TransformerEncoderLayer(
        E, H, d_ff, dropout=0.0, activation=activation, batch_first=True, norm_first=norm_first, dtype=torch.float64
    )
    with torch.no_grad():
        for p in tm.parameters():
            p.uniform_(-0.8, 0.8)
    return tm.train()  # dropout 0; keeps torch off its inference fast path


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_block_jvp_matches_torch(norm_first):
    torch = pytest.importorskip("torch")
    from torch.func import functional_call, jvp
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tm = _torch_encoder(torch, 8, 2, 12, norm_first, "gelu")
    m = EncoderBlock.from_torch_state_dict(tm.state_dict(), 2, dropout=0.0, norm_first=norm_first, activation="gelu")
    rng = np.random.default_rng(6)
    x, tx = rng.standard_normal((2, 5, 8)), rng.standard_normal((2, 5, 8))
    params = {n: p.detach() for n, p in tm.named_parameters()}
    ttorch = {n: rng.standard_normal(tuple(p.shape)) for n, p in params.items()}
    tp = _rename_torch_state(ttorch, {"self_attn": "mha"}, 8)  # the packed in_proj's tangent split as its weight
    with sdpa_kernel(SDPBackend.MATH):  # the fused CPU kernels have no forward AD
        _, want = jvp(
            lambda xx, pp: functional_call(tm, pp, (xx,)),
            (torch.from_numpy(x), params),
            (torch.from_numpy(tx), {n: torch.from_numpy(t) for n, t in ttorch.items()}),
        )
    m(x)
    np.testing.assert_allclose(m.jvp(tx, param_tangents=tp), want.numpy(), rtol=1e-10, atol=1e-10)


# -- CausalLM ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_causal_lm_jvp(name):
    rng = np.random.default_rng(1)
    m = CausalLM(FAMILIES[name], rng=0)
    _perturb(m, rng)
    # no pad token: its padding_idx row has no gradient (torch's embedding), so the JVP along it is
    # not the backward's transpose (Gemma's pad id is 0, OLMo 3's 1)
    real = [i for i in range(41) if i != m.config.pad_token_id]
    ids = rng.choice(real, (2, 5))
    _check_jvp(m, (ids,), rng)


def test_causal_lm_jvp_ids_take_no_tangent():
    m = CausalLM(FAMILIES["llama"], rng=0)
    ids = np.array([[1, 2, 3]])
    m(ids)
    assert not np.any(m.jvp(None))
    with pytest.raises(TypeError, match="token ids have no tangent"):
        m.jvp(np.ones((1, 3)))
    layer = m.layers[0]  # a decoder layer on its own: one tangent of its input's shape
    layer(np.ones((1, 3, 16)))
    with pytest.raises(ValueError, match="tx"):
        layer.jvp(np.ones((1, 3, 15)))
    with pytest.raises(TypeError, match="at most 1"):
        layer.jvp(None, None)
    assert not np.any(layer.jvp())


# -- TinyTransformer ------------------------------------------------------------------------------------
def test_tiny_transformer_jvp():
    rng = np.random.default_rng(2)
    m = TinyTransformer(11, 6, 8, 2, 2, 12, activation="gelu", embedding_std=1.0, rng=0)
    _perturb(m, rng)
    ids = rng.integers(0, 11, (2, 5))
    _check_jvp(m, (ids,), rng)
    _gradcheck_both(m, ids)


def test_tiny_transformer_jvp_unbatched_and_dropout():
    rng = np.random.default_rng(3)
    m = TinyTransformer(11, 6, 8, 2, 1, 12, dropout=0.2, rng=0)
    t, _, _ = _jvp_then_backward(m, (rng.integers(0, 11, (5,)),), rng)
    assert t.shape == (5, 11)


# -- the book's classes ------------------------------------------------------------------------------------
_GPT = dict(vocab_size=13, context_length=6, emb_dim=8, n_heads=2, n_layers=2, drop_rate=0.0, qkv_bias=True)


def _cfg(**kw):
    return dict(_GPT, **kw)


BOOK = {
    "SelfAttention_v1": lambda: book.SelfAttention_v1(6, 4, rng=0),
    "SelfAttention_v2": lambda: book.SelfAttention_v2(6, 4, True, rng=0),
    "CausalAttention": lambda: book.CausalAttention(6, 4, 5, 0.0, True, rng=0),
    "MultiHeadAttentionWrapper": lambda: book.MultiHeadAttentionWrapper(6, 4, 5, 0.0, 2, True, rng=0),
    "MultiHeadAttention": lambda: book.MultiHeadAttention(6, 4, 5, 0.0, 2, True, rng=0),
    "GELU": lambda: book.GELU(),
    "LayerNorm": lambda: book.LayerNorm(6),
    "FeedForward": lambda: book.FeedForward(dict(emb_dim=6), rng=0),
    "TransformerBlock": lambda: book.TransformerBlock(_cfg(emb_dim=6), rng=0),
}


@pytest.mark.parametrize("name", list(BOOK))
def test_book_module_jvp(name):
    rng = np.random.default_rng(4)
    m = BOOK[name]()
    _perturb(m, rng)
    x = rng.standard_normal((2, 4, 6))
    _check_jvp(m, (x,), rng)
    _gradcheck_both(m, x)


def test_book_gpt_jvp():
    rng = np.random.default_rng(5)
    m = book.GPTModel(_cfg(), rng=0)
    _perturb(m, rng)
    idx = rng.integers(0, 13, (2, 5))
    _check_jvp(m, (idx,), rng)
    _gradcheck_both(m, idx)


@pytest.mark.parametrize("drop_rate", [0.2])
def test_book_dropout_uses_the_forwards_masks(drop_rate):
    """Attention-weight, shortcut and embedding dropout: the JVP uses this forward's masks."""
    rng = np.random.default_rng(6)
    for m, ins in (
        (book.GPTModel(_cfg(drop_rate=drop_rate), rng=0), (rng.integers(0, 13, (2, 5)),)),
        (book.MultiHeadAttentionWrapper(6, 4, 5, drop_rate, 2, True, rng=0), (rng.standard_normal((2, 4, 6)),)),
    ):
        _jvp_then_backward(m, ins, rng)


def test_book_jvp_bad_tangents_and_state():
    m = book.LayerNorm(6)
    x = np.ones((2, 6))
    m(x)
    with pytest.raises(TypeError, match="at most 1"):
        m.jvp(None, None)
    with pytest.raises(ValueError, match="tx"):
        m.jvp(np.ones((2, 5)))
    gpt = book.GPTModel(_cfg(), rng=0)
    gpt(np.array([[1, 2]]))
    with pytest.raises(TypeError, match="token ids have no tangent"):
        gpt.jvp(np.ones((1, 2)))
    ff = book.FeedForward(dict(emb_dim=6), rng=0)
    with pytest.raises(RuntimeError, match="no forward state"):
        ff.backward(np.ones((2, 6)))  # FeedForward keeps a state of its own now: one backward per forward
    ff(x)
    ff.backward(np.ones((2, 6)))
    with pytest.raises(RuntimeError, match="no forward state"):
        ff.jvp(x)


def test_book_gpt_jvp_matches_torch():
    torch = pytest.importorskip("torch")
    from torch.func import functional_call, jvp

    spec = importlib.util.spec_from_file_location("chapter4_torch", os.path.join(HERE, "book", "chapter4_torch.py"))
    ref = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref)
    cfg = _cfg(qkv_bias=False)
    torch.manual_seed(0)
    tm = ref.GPTModel(cfg).double()
    m = book.GPTModel(cfg)
    m.load_state_dict(tm.state_dict())
    rng = np.random.default_rng(7)
    idx = rng.integers(0, 13, (2, 5))
    params = {n: p.detach() for n, p in tm.named_parameters()}
    tp = {n: rng.standard_normal(tuple(p.shape)) for n, p in params.items()}
    _, want = jvp(
        lambda pp: functional_call(tm, pp, (torch.from_numpy(idx),)),
        (params,),
        ({n: torch.from_numpy(t) for n, t in tp.items()},),
    )
    m(idx)
    np.testing.assert_allclose(m.jvp(param_tangents=tp), want.numpy(), rtol=1e-10, atol=1e-10)

"""Validation once, at the edges: a block validates its inputs and masks (building each
attention's mask with ``MultiHeadAttention._build_mask``, under the block's argument names)
before any sublayer runs, then calls the attention's unvalidated ``_forward`` / ``_backward``;
the public ``MultiHeadAttention.forward`` is not re-entered."""

import numpy as np
import pytest

from npattn import book
from npattn.nn import layers
from npattn.nn.attention import MultiHeadAttention
from npattn.nn.transformer import DecoderBlock, EncoderBlock


@pytest.fixture
def calls(monkeypatch):
    """Record, in order, every ``_check_inputs``, ``_check_cache``, ``_build_mask`` and public
    ``forward``/``backward`` of MultiHeadAttention, and every LayerNorm ``_forward``."""
    log = []

    def spy(cls, name):
        orig = getattr(cls, name, None)
        if orig is None:
            return

        def wrapped(self, *args, **kw):
            log.append((name, id(self)))
            return orig(self, *args, **kw)

        monkeypatch.setattr(cls, name, wrapped)

    for name in ("_check_inputs", "_check_cache", "_build_mask", "forward", "backward"):
        spy(MultiHeadAttention, name)
    spy(layers.LayerNorm, "_forward")
    return log


def _names(log, which):
    return [n for n, _ in log if n in which]


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_block_builds_the_mask_once_at_its_edge(calls, norm_first):
    rng = np.random.default_rng(0)
    blk = EncoderBlock(8, 2, 16, dropout=0.0, norm_first=norm_first, rng=1)
    x = rng.standard_normal((2, 5, 8))
    am = np.tril(np.ones((5, 5), bool))
    kpm = np.zeros((2, 5), bool)
    kpm[1, -1] = True
    y = blk(x, attn_mask=am, key_padding_mask=kpm)
    assert calls[0] == ("_build_mask", id(blk.mha))  # first, before layer norm 1 (pre-norm) or the attention
    assert _names(calls, {"_build_mask"}) == ["_build_mask"]
    assert _names(calls, {"_check_inputs", "_check_cache", "forward"}) == []
    calls.clear()
    blk.backward(rng.standard_normal(y.shape))
    assert _names(calls, {"backward"}) == []  # the block's own check of dy only (MHA._backward)


def test_encoder_block_equals_the_public_path():
    """The unvalidated path computes what the public MultiHeadAttention computes, masks included."""
    rng = np.random.default_rng(1)
    blk = EncoderBlock(8, 2, 16, dropout=0.0, rng=2)
    x = rng.standard_normal((2, 4, 8))
    am = rng.standard_normal((2, 2, 4, 4))
    kpm = np.array([[False, False, False, True], [False, True, False, False]])
    y = blk(x, attn_mask=am, key_padding_mask=kpm)
    h = blk.layernorm1(x + blk.mha(x, attn_mask=am, key_padding_mask=kpm))
    ref = blk.layernorm2(h + blk.ffn(h))
    np.testing.assert_array_equal(y, ref)


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_block_builds_each_mask_once_at_its_edge(calls, norm_first):
    rng = np.random.default_rng(2)
    blk = DecoderBlock(8, 2, 16, dropout=0.0, norm_first=norm_first, causal=True, rng=3)
    x, mem = rng.standard_normal((2, 4, 8)), rng.standard_normal((2, 6, 8))
    y = blk(
        x,
        mem,
        tgt_key_padding_mask=np.zeros((2, 4), bool),
        memory_mask=np.ones((4, 6), bool),
        memory_key_padding_mask=np.zeros((2, 6), bool),
    )
    assert calls[:2] == [("_build_mask", id(blk.self_attn)), ("_build_mask", id(blk.cross_attn))]
    assert _names(calls, {"_build_mask"}) == ["_build_mask"] * 2
    assert _names(calls, {"_check_inputs", "_check_cache", "forward"}) == []
    calls.clear()
    dx, dmem = blk.backward(rng.standard_normal(y.shape))
    assert dx.shape == x.shape and dmem.shape == mem.shape
    assert _names(calls, {"backward"}) == []


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize(
    "kw, err, msg",
    [
        (
            {"memory_key_padding_mask": np.array([[0.0, np.inf, 0.0]])},
            ValueError,
            "memory_key_padding_mask: expected float mask values that are finite or -inf",
        ),
        ({"memory_key_padding_mask": np.zeros((1, 3), np.int64)}, TypeError, "memory_key_padding_mask: expected bool"),
        ({"memory_mask": np.ones((2, 4), bool)}, ValueError, "memory_mask: expected a shape broadcastable to"),
        ({"tgt_mask": np.ones((2, 2), np.int32)}, TypeError, "tgt_mask: integer masks are ambiguous"),
        (
            {"tgt_key_padding_mask": np.zeros((1, 3), bool)},
            ValueError,
            r"tgt_key_padding_mask: expected shape \(1, 2\)",
        ),
    ],
)
def test_decoder_block_refuses_bad_masks_before_any_sublayer(calls, norm_first, kw, err, msg):
    rng = np.random.default_rng(3)
    blk = DecoderBlock(4, 2, 8, dropout=0.0, norm_first=norm_first, rng=4)
    x, mem = rng.standard_normal((1, 2, 4)), rng.standard_normal((1, 3, 4))
    with pytest.raises(err, match=msg):
        blk(x, mem, **kw)
    assert _names(calls, {"_forward"}) == []  # no layer norm ran
    assert all(m._cache is None for _, m in blk.named_modules())


def test_encoder_block_refuses_a_bad_mask_before_layer_norm_1(calls):
    blk = EncoderBlock(4, 2, 8, dropout=0.0, norm_first=True, rng=5)
    x = np.random.default_rng(4).standard_normal((1, 3, 4))
    with pytest.raises(ValueError, match="key_padding_mask: expected float mask values"):
        blk(x, key_padding_mask=np.array([[0.0, np.nan, 0.0]]))
    assert _names(calls, {"_forward"}) == []
    assert blk.layernorm1._cache is None and blk.mha._cache is None


def test_public_mha_validates_once(calls):
    m = MultiHeadAttention(4, 4, 2, rng=6)
    x = np.random.default_rng(5).standard_normal((2, 3, 4))
    m(x, key_padding_mask=np.zeros((2, 3), bool))
    assert _names(calls, {"_check_inputs", "_check_cache", "_build_mask"}) == [
        "_check_inputs",
        "_check_cache",
        "_build_mask",
    ]


def test_book_mha_validates_once(calls):
    """The book's attention checks its tokens and the cache, then takes its buffer's mask
    straight to ``_forward`` (nothing to build)."""
    m = book.MultiHeadAttention(4, 4, 6, 0.0, 2, rng=7)
    x = np.random.default_rng(6).standard_normal((2, 3, 4))
    y = m(x)
    assert _names(calls, {"_check_inputs", "_build_mask"}) == []
    ref = MultiHeadAttention(4, 4, 2, causal=True, rng=7)  # same draws, same weights
    np.testing.assert_allclose(y, ref(x), rtol=0, atol=1e-12)
    m(x, use_cache=True)
    with pytest.raises(ValueError, match=r"query: expected the batch shape \(2,\) of the KV cache"):
        m(x[:1, :1], use_cache=True)
    assert m.kv_cache_length == 3

"""``EncoderBlock``/``DecoderBlock.from_torch_state_dict`` without torch: a state dict of numpy arrays
under torch's key names (the layout ``torch.nn.TransformerEncoderLayer`` / ``TransformerDecoderLayer``
export) rebuilds the same block, and every malformed dict is refused naming the key.  (Parity with
torch itself: ``test_encoder_block.py``, ``test_decoder_block.py``.)"""

import numpy as np
import pytest

import npattn
from npattn import DecoderBlock, EncoderBlock


def torch_keys(block, attns):
    """``block``'s parameters under torch's names: q, k, v packed into ``in_proj_*``."""
    sd = {}
    for torch_name, mine in attns.items():
        mha = getattr(block, mine)
        for kind in ("weight", "bias"):
            parts = [getattr(getattr(mha, w), kind) for w in ("W_query", "W_key", "W_value")]
            out = getattr(mha.out_proj, kind)
            if parts[0] is not None:
                sd[f"{torch_name}.in_proj_{kind}"] = np.concatenate([p.data for p in parts])
            elif out is not None:  # bias=True, qkv_bias=False: torch's layer has the bias, at zero
                sd[f"{torch_name}.in_proj_{kind}"] = np.zeros(3 * out.data.shape[0], out.data.dtype)
            if out is not None:
                sd[f"{torch_name}.out_proj.{kind}"] = out.data.copy()
    for name, p in block.named_parameters():
        if name.startswith("ffn."):
            sd[name[len("ffn.") :]] = p.data.copy()
        elif name.startswith("layernorm"):
            sd[name.replace("layernorm", "norm", 1)] = p.data.copy()
    return sd


ENC = {"self_attn": "mha"}
DEC = {"self_attn": "self_attn", "multihead_attn": "cross_attn"}


def _same_block(a, b, *inputs):
    rng = np.random.default_rng(5)
    ya, yb = a(*inputs), b(*inputs)
    np.testing.assert_array_equal(ya, yb)
    dy = rng.standard_normal(ya.shape).astype(ya.dtype)
    ga, gb = a.backward(dy), b.backward(dy)
    for g, h in zip(ga if isinstance(ga, tuple) else (ga,), gb if isinstance(gb, tuple) else (gb,)):
        np.testing.assert_array_equal(g, h)
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for n in pa:
        np.testing.assert_array_equal(pa[n].grad, pb[n].grad)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_encoder_from_numpy_torch_keys_is_the_same_block(bias, dtype):
    kw = dict(dropout=0.0, norm_first=bias, activation="gelu")
    block = EncoderBlock(8, 2, 12, qkv_bias=bias, bias=bias, rng=1, dtype=dtype, **kw)
    sd = torch_keys(block, ENC)
    m = EncoderBlock.from_torch_state_dict(sd, 2, **kw)
    assert m.dtype == dtype  # the state dict's dtype
    x = np.random.default_rng(2).standard_normal((2, 5, 8)).astype(dtype)
    _same_block(block, m, x)
    assert EncoderBlock.from_torch_state_dict(sd, 2, dtype=np.float64).dtype == np.float64


@pytest.mark.parametrize("bias", [True, False])
def test_decoder_from_numpy_torch_keys_is_the_same_block(bias):
    kw = dict(dropout=0.0, norm_first=not bias, causal=True)
    block = DecoderBlock(8, 2, 12, bias=bias, rng=3, **kw)
    m = DecoderBlock.from_torch_state_dict(torch_keys(block, DEC), 2, **kw)
    rng = np.random.default_rng(4)
    _same_block(block, m, rng.standard_normal((2, 4, 8)), rng.standard_normal((2, 6, 8)))


def test_integer_state_dict_gives_a_float64_block():
    sd = {k: np.round(v * 10).astype(np.int64) for k, v in torch_keys(EncoderBlock(4, 2, 6, rng=0), ENC).items()}
    m = EncoderBlock.from_torch_state_dict(sd, 2)
    assert m.dtype == np.float64
    np.testing.assert_array_equal(m.ffn.linear1.weight.data, sd["linear1.weight"])


@pytest.mark.parametrize("cls, attns", [(EncoderBlock, ENC), (DecoderBlock, DEC)], ids=["encoder", "decoder"])
def test_malformed_state_dicts_are_refused_naming_the_key(cls, attns):
    sd = torch_keys(cls(4, 2, 6, rng=0, **({"qkv_bias": True} if cls is EncoderBlock else {})), attns)
    first = next(iter(attns))
    with pytest.raises(TypeError, match="state_dict: expected a mapping"):
        cls.from_torch_state_dict([1, 2], 2)
    with pytest.raises(TypeError, match=r"bias: set by the state dict"):
        cls.from_torch_state_dict(sd, 2, bias=False)
    with pytest.raises(ValueError, match=r"unexpected keys \['norm9.weight'\]"):
        cls.from_torch_state_dict({**sd, "norm9.weight": np.ones(4)}, 2)
    for key in ("linear2.weight", f"{first}.out_proj.bias"):  # a weight, or some of the biases only
        partial = {k: v for k, v in sd.items() if k != key}
        with pytest.raises(ValueError, match=rf"missing keys \[.*'{key}'"):
            cls.from_torch_state_dict(partial, 2)
    with pytest.raises(ValueError, match=rf"key '{first}\.in_proj_weight': expected shape \(12, 4\), got \(9, 4\)"):
        cls.from_torch_state_dict({**sd, f"{first}.in_proj_weight": np.zeros((9, 4))}, 2)
    with pytest.raises(ValueError, match=r"expected 'linear1.weight' of 2 dimensions, got shape \(24,\)"):
        cls.from_torch_state_dict({**sd, "linear1.weight": np.zeros(24)}, 2)
    with pytest.raises(ValueError, match="linear1.weight"):
        cls.from_torch_state_dict({**sd, "linear1.weight": np.zeros((6, 5))}, 2)
    with pytest.raises(ValueError, match="num_heads"):
        cls.from_torch_state_dict(sd, 3)
    with pytest.raises(TypeError, match="state_dict\\['linear1.weight'\\]"):
        cls.from_torch_state_dict({**sd, "linear1.weight": [[1, 2], [3]]}, 2)
    assert isinstance(cls.from_torch_state_dict(sd, 2), npattn.Module)

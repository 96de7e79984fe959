"""ShortConv (LFM2's gated short convolution): outputs and every gradient against transformers'
Lfm2ShortConv in float64 (with and without biases, with padding), central differences in both
modes, decoding with the cache equal to the full pass, bad input for every argument."""

import numpy as np
import pytest
from _fd import check_jvp_keeps_state

import npattn
from npattn import ShortConv, no_grad


def _hf_layer(hidden, taps, bias, seed=0):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import Lfm2Config
    from transformers.models.lfm2 import modeling_lfm2 as hf

    cfg = Lfm2Config(hidden_size=hidden, conv_L_cache=taps, conv_bias=bias, num_hidden_layers=1, layer_types=["conv"])
    torch.manual_seed(seed)
    layer = hf.Lfm2ShortConv(cfg, 0).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.5)
    return torch, layer


def close(a, b, tol=1e-10):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    err = float(np.max(np.abs(a - b)))
    assert err <= tol * max(1.0, float(np.max(np.abs(b)))), err


@pytest.mark.parametrize(
    "taps, bias, steps, padded", [(3, False, 7, False), (3, True, 6, False), (4, True, 1, False), (2, True, 6, True)]
)
def test_matches_transformers_outputs_and_every_gradient(taps, bias, steps, padded):
    torch, hf = _hf_layer(6, taps, bias)
    m = ShortConv(6, conv_L_cache=taps, conv_bias=bias)
    state = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    assert list(state) == list(m.state_dict())
    m.load_state_dict(state)
    rng = np.random.default_rng(steps)
    x = rng.standard_normal((2, steps, 6))
    dy = rng.standard_normal((2, steps, 6))
    mask = np.ones((2, steps), int)
    if padded:
        mask[0, :2] = 0
    tx = torch.tensor(x, requires_grad=True)
    ty = hf(tx, attention_mask=torch.tensor(mask) if padded else None)
    (ty * torch.tensor(dy)).sum().backward()
    y = m(x, attention_mask=mask if padded else None)
    close(y, ty.detach().numpy())
    close(m.backward(dy), tx.grad.numpy())
    params = dict(m.named_parameters())
    assert set(params) == {n for n, _ in hf.named_parameters()}
    for name, p in hf.named_parameters():
        close(params[name].grad, p.grad.numpy())


@pytest.mark.parametrize("bias", [False, True])
def test_gradcheck_central_differences_both_modes(bias):
    m = ShortConv(6, 3, bias, rng=0)
    x = np.random.default_rng(1).standard_normal((2, 7, 6))
    report = npattn.gradcheck(m, x, mode="both")  # backward, JVP, and <u, J v> = <J^T u, v>
    assert report.ok, str(report)
    want = {"conv.weight", "in_proj.weight", "out_proj.weight"} | ({"conv.bias", "in_proj.bias"} if bias else set())
    assert {row[0] for row in report.rows} >= want


def test_jvp_is_linear_in_the_tangents_and_keeps_the_state_for_backward():
    m = ShortConv(6, 3, True, rng=5)
    rng = np.random.default_rng(6)
    x, tx = rng.standard_normal((2, 9, 6)), rng.standard_normal((2, 9, 6))
    tp = {"conv.weight": rng.standard_normal((6, 1, 3)), "conv.bias": rng.standard_normal(6)}
    check_jvp_keeps_state(m, x, tx, tp, rng)


@pytest.mark.parametrize("pieces", [[1] * 10, [4, 1, 5], [10], [1, 1, 8]])
def test_decoding_with_the_cache_equals_the_full_pass(pieces):
    m = ShortConv(8, 4, True, rng=2)
    x = np.random.default_rng(3).standard_normal((2, 10, 8))
    with no_grad():
        full = m(x)
    outs, start = [], 0
    for n in pieces:
        outs.append(m(x[:, start : start + n], use_cache=True))
        start += n
    close(np.concatenate(outs, axis=1), full, 1e-12)
    assert m.kv_cache_length == 10 and m.conv_state.shape == (2, 3, 8)
    close(m.conv_state, _products(m, x)[:, -3:], 1e-14)
    with pytest.raises(RuntimeError):  # a cached call keeps nothing for backward
        m.backward(np.ones_like(full))
    with pytest.raises(ValueError, match=r"batch shape \(2,\)"):
        m(x[:1, :1], use_cache=True)
    m.reset_kv_cache()
    assert m.kv_cache_length == 0 and m.conv_state is None
    close(m(x[:1], use_cache=True), full[:1], 1e-12)  # a new sequence, a new batch shape
    m.reset_cache()
    with no_grad():
        close(m(x[1]), full[1], 1e-12)  # unbatched (L, hidden)


def _products(m, x):
    """``B * x'`` of ``x``: the convolution's inputs, which the cache keeps."""
    bcx = x @ m.in_proj.weight.data.T + m.in_proj.bias.data
    return bcx[..., :8] * bcx[..., 16:]


def test_float32_stays_float32():
    m64 = ShortConv(8, 3, True, rng=4)
    m32 = ShortConv(8, 3, True, rng=4, dtype=np.float32)
    x = np.random.default_rng(5).standard_normal((3, 20, 8))
    y32, y64 = m32(x), m64(x)
    assert y32.dtype == np.float32
    np.testing.assert_allclose(y32, y64, rtol=1e-4, atol=1e-5)
    dx = m32.backward(np.ones_like(y32))
    assert dx.dtype == np.float32
    assert all(p.grad.dtype == np.float32 for p in m32.parameters())
    assert "conv_L_cache=3" in repr(m32)


def test_bad_arguments():
    with pytest.raises(ValueError, match="hidden_size"):
        ShortConv(0)
    with pytest.raises(ValueError, match="conv_L_cache"):
        ShortConv(8, 0)
    with pytest.raises(TypeError, match="conv_L_cache"):
        ShortConv(8, 2.5)
    with pytest.raises((TypeError, ValueError), match="conv_bias"):
        ShortConv(8, 3, "yes")
    m = ShortConv(8, rng=0)
    with pytest.raises(ValueError, match=r"x: expected shape \(\.\.\., L, 8\)"):
        m(np.ones((2, 3, 7)))
    with pytest.raises(ValueError, match="attention_mask: expected shape"):
        m(np.ones((2, 3, 8)), attention_mask=np.ones((2, 4)))
    with pytest.raises(TypeError, match="call the ShortConv itself"):
        m.conv(np.ones((2, 3, 8)))

"""GatedDeltaNet (Qwen3-Next's linear attention layer): outputs and every gradient against
transformers' Qwen3NextGatedDeltaNet in float64, central differences, decoding with the cache
equal to the full pass, bad input for every argument."""

import numpy as np
import pytest
from _fd import check_jvp_keeps_state

import npattn
from npattn import GatedDeltaNet, no_grad

_MODELING = "models.qwen3_next.modeling_qwen3_next"


def _hf_layer(monkeypatch, nv, nk, dk=3, dv=5, hidden=12, taps=3, seed=0):
    """transformers' layer in float64 throughout: its float32 upcasts (the delta rule, the gate,
    the gated norm) are made float64 by giving its module a torch whose float32 is float64, and
    ``Tensor.float`` keeps float64 tensors float64 (``A_log.float()``, ``a.float()``)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from _hf64 import float64_torch
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    float64_torch(monkeypatch, _MODELING)
    to_float = torch.Tensor.float
    monkeypatch.setattr(torch.Tensor, "float", lambda t: t if t.dtype == torch.float64 else to_float(t))
    cfg = Qwen3NextConfig(
        hidden_size=hidden,
        linear_num_value_heads=nv,
        linear_num_key_heads=nk,
        linear_key_head_dim=dk,
        linear_value_head_dim=dv,
        linear_conv_kernel_dim=taps,
        rms_norm_eps=1e-6,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
    )
    torch.manual_seed(seed)
    layer = hf.Qwen3NextGatedDeltaNet(cfg, 0).double()
    with torch.no_grad():  # away from the initial values (ones, zeros) so every path matters
        for name, p in layer.named_parameters():
            p.uniform_(-1.0, 1.0) if name == "A_log" else p.normal_(0.0, 0.5)
    return torch, layer, cfg.to_dict()


def close(a, b, tol=1e-10):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    err = float(np.max(np.abs(a - b)))
    assert err <= tol * max(1.0, float(np.max(np.abs(b)))), err


@pytest.mark.parametrize("nv, nk, steps, chunk", [(2, 2, 9, 64), (4, 2, 11, 4), (6, 2, 16, 5), (3, 1, 1, 2)])
def test_matches_transformers_outputs_and_every_gradient(monkeypatch, nv, nk, steps, chunk):
    torch, hf, config = _hf_layer(monkeypatch, nv, nk)
    m = GatedDeltaNet.from_config(config, chunk_size=chunk)
    state = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    assert set(state) == set(m.state_dict())
    m.load_state_dict(state)
    rng = np.random.default_rng(steps)
    x = rng.standard_normal((2, steps, 12))
    dy = rng.standard_normal((2, steps, 12))
    tx = torch.tensor(x, requires_grad=True)
    ty = hf(tx)
    (ty * torch.tensor(dy)).sum().backward()
    y = m(x)
    close(y, ty.detach().numpy())
    close(m.backward(dy), tx.grad.numpy())
    params = dict(m.named_parameters())
    for name, p in hf.named_parameters():
        close(params[name].grad, p.grad.numpy())


def test_gradcheck_central_differences():
    m = GatedDeltaNet(6, 4, 2, 2, 3, 3, chunk_size=3, rng=0)
    m.A_log.data = np.log(np.array([0.3, 1.0, 2.0, 0.1]))
    x = np.random.default_rng(1).standard_normal((2, 7, 6))
    report = npattn.gradcheck(m, x, mode="both")  # backward, JVP, and <u, J v> = <J^T u, v>
    assert report.ok, str(report)
    assert {row[0] for row in report.rows} >= {"conv1d.weight", "A_log", "dt_bias", "norm.weight"}


def test_jvp_is_linear_in_the_tangents_and_keeps_the_state_for_backward():
    m = GatedDeltaNet(6, 2, 1, 3, 2, 2, chunk_size=4, rng=5)
    rng = np.random.default_rng(6)
    x, tx = rng.standard_normal((2, 9, 6)), rng.standard_normal((2, 9, 6))
    tA = {"A_log": rng.standard_normal(2), "dt_bias": rng.standard_normal(2)}
    check_jvp_keeps_state(m, x, tx, tA, rng)


@pytest.mark.parametrize("pieces", [[1] * 10, [4, 1, 5], [10], [3, 3, 3, 1]])
def test_decoding_with_the_cache_equals_the_full_pass(pieces):
    m = GatedDeltaNet(8, 4, 2, 3, 2, 4, chunk_size=3, rng=2)
    x = np.random.default_rng(3).standard_normal((2, 10, 8))
    with no_grad():
        full = m(x)
    outs, start = [], 0
    for n in pieces:
        outs.append(m(x[:, start : start + n], use_cache=True))
        start += n
    close(np.concatenate(outs, axis=1), full, 1e-12)
    assert m.kv_cache_length == 10
    assert m.recurrent_state.shape == (2, 4, 3, 2) and m.conv_state.shape == (2, 3, 2 * 2 * 3 + 4 * 2)
    with pytest.raises(RuntimeError):  # a cached call keeps nothing for backward
        m.backward(np.ones_like(full))
    with pytest.raises(ValueError, match=r"batch shape \(2,\)"):
        m(x[:1, :1], use_cache=True)
    m.reset_kv_cache()
    assert m.kv_cache_length == 0 and m.recurrent_state is None and m.conv_state is None
    close(m(x[:1], use_cache=True), full[:1], 1e-12)  # a new sequence, a new batch shape
    m.reset_cache()
    with no_grad():
        close(m(x[1]), full[1], 1e-12)  # unbatched (L, hidden)


def test_float32_stays_float32():
    m64 = GatedDeltaNet(8, 2, 1, 4, 3, 4, rng=4)
    m32 = GatedDeltaNet(8, 2, 1, 4, 3, 4, rng=4, dtype=np.float32)
    x = np.random.default_rng(5).standard_normal((3, 70, 8))
    y32, y64 = m32(x), m64(x)
    assert y32.dtype == np.float32
    np.testing.assert_allclose(y32, y64, rtol=1e-3, atol=1e-4)
    dx = m32.backward(np.ones_like(y32))
    assert dx.dtype == np.float32
    assert all(p.grad.dtype == np.float32 for p in m32.parameters())
    assert "num_v_heads=2" in repr(m32)


def test_bad_arguments():
    with pytest.raises(ValueError, match="linear_num_value_heads: expected a multiple of linear_num_key_heads=2"):
        GatedDeltaNet(8, 3, 2)
    for i, name in enumerate(["hidden_size", "linear_num_value_heads", "linear_num_key_heads", "linear_key_head_dim"]):
        args = [8, 2, 1, 2, 2, 2]
        args[i] = 0
        with pytest.raises(ValueError, match=name):
            GatedDeltaNet(*args)
    with pytest.raises(TypeError, match="linear_value_head_dim"):
        GatedDeltaNet(8, 2, 1, 2, 2.5)
    with pytest.raises(ValueError, match="linear_conv_kernel_dim"):
        GatedDeltaNet(8, 2, 1, 2, 2, 0)
    with pytest.raises(ValueError, match="rms_norm_eps"):
        GatedDeltaNet(8, 2, 1, 2, 2, 2, -1.0)
    with pytest.raises(ValueError, match="hidden_act: expected 'silu'"):
        GatedDeltaNet(8, 2, 1, 2, 2, 2, 1e-6, "gelu")
    x = np.ones((1, 3, 8))
    close(GatedDeltaNet(8, 2, 1, 2, 2, 2, 1e-6, "swish", rng=0)(x), GatedDeltaNet(8, 2, 1, 2, 2, 2, rng=0)(x), 0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        GatedDeltaNet(8, 2, 1, 2, 2, 2, chunk_size=0)
    with pytest.raises(TypeError, match="dtype"):
        GatedDeltaNet(8, 2, 1, 2, 2, 2, dtype=np.int32)
    with pytest.raises(ValueError, match="config: expected a 'hidden_size'"):
        GatedDeltaNet.from_config({"linear_num_value_heads": 2})
    m = GatedDeltaNet(8, 2, 1, 2, 2, 2, rng=0)
    with pytest.raises(ValueError, match=r"x: expected shape \(\.\.\., L, 8\)"):
        m(np.ones((2, 3, 7)))
    with pytest.raises(ValueError, match="x: expected shape"):
        m(np.ones(8))
    with pytest.raises(ValueError, match="x: expected shape"):
        m(np.ones((2, 0, 8)))
    with pytest.raises(TypeError, match="x"):
        m(np.ones((2, 3, 8), dtype=bool))
    with pytest.raises(TypeError, match="use_cache"):
        m(np.ones((2, 3, 8)), use_cache=1)
    with pytest.raises(TypeError, match="call the GatedDeltaNet itself"):
        m.norm(np.ones(2))
    y = m(np.ones((2, 3, 8), dtype=np.int64))  # integers are cast
    with pytest.raises(ValueError, match="dy: expected shape"):
        m.backward(np.ones((2, 3, 7)))
    assert m.backward(np.ones_like(y)).shape == (2, 3, 8)
    with pytest.raises(RuntimeError):
        m.backward(np.ones_like(y))

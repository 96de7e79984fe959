"""The book's chapter-4 ``GPTModel`` in NumPy (``npattn.book``): keys, logits and every gradient
against the PyTorch reference (``tests/book/chapter4_torch.py``), through the committed
``npattn/data/chapter4.npz`` (``npattn.data.load("chapter4")``) without torch and live when torch is importable."""

import os

import numpy as np
import pytest
from _fd import fd_gradients
from _oracles import rel_err

from npattn import book, data, gradcheck

HERE = os.path.dirname(__file__)
NPZ = data.load("chapter4")
CFG_KEYS = ("vocab_size", "context_length", "emb_dim", "n_heads", "n_layers", "drop_rate", "qkv_bias")


def stored(name):
    vals = NPZ[f"{name}.cfg"]
    cfg = {k: (int(v) if k not in ("drop_rate", "qkv_bias") else v) for k, v in zip(CFG_KEYS, vals)}
    cfg["drop_rate"], cfg["qkv_bias"] = float(vals[5]), bool(vals[6])
    pre = f"{name}.sd."
    sd = {k[len(pre) :]: NPZ[k] for k in NPZ if k.startswith(pre)}
    pre = f"{name}.grad."
    grads = {k[len(pre) :]: NPZ[k] for k in NPZ if k.startswith(pre)}
    return cfg, sd, grads


def assert_grad_close(a, b, name):
    """rtol 1e-10, with an absolute floor of 1e-13 of the gradient's scale (the key bias's exact
    gradient is 0: softmax ignores a constant added to every score of a row)."""
    np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-13 * max(1.0, np.abs(b).max()), err_msg=name)


def tiny_cfg(**kw):
    cfg = dict(vocab_size=17, context_length=6, emb_dim=8, n_heads=2, n_layers=2, drop_rate=0.0, qkv_bias=False)
    cfg.update(kw)
    return cfg


# -- keys and numbers against the stored torch model ---------------------------------------------
@pytest.mark.parametrize("name", ["tiny", "bias"])
def test_state_dict_keys_are_the_books(name):
    cfg, sd, _ = stored(name)
    ours = book.GPTModel(cfg).state_dict()
    assert list(ours) == list(sd)  # the same keys in torch's order
    for k in sd:
        assert ours[k].shape == sd[k].shape, k
    assert "out_head.bias" not in ours and "trf_blocks.0.att.mask" in ours
    assert ("trf_blocks.0.att.W_query.bias" in ours) == cfg["qkv_bias"]


@pytest.mark.parametrize("name", ["tiny", "bias"])
@pytest.mark.parametrize("training", [False, True])
def test_logits_and_every_gradient_equal_torch_stored(name, training):
    cfg, sd, grads = stored(name)
    m = book.GPTModel(cfg, rng=0)
    m.load_state_dict(sd)
    if training:  # drop_rate > 0 only matters in training mode; the stored run is in eval mode
        m.load_state_dict(sd)
        cfg_nodrop = dict(cfg, drop_rate=0.0)
        m = book.GPTModel(cfg_nodrop, rng=0)
        m.load_state_dict(sd)
    else:
        m.eval()
    idx = NPZ[f"{name}.idx"]
    logits = m(idx)
    assert logits.dtype == np.float64
    np.testing.assert_allclose(logits, NPZ[f"{name}.logits"], rtol=1e-10, atol=1e-12)
    assert m.backward(NPZ[f"{name}.dlogits"]) is None
    named = dict(m.named_parameters())
    assert set(named) == set(grads)
    for k, g in grads.items():
        assert_grad_close(named[k].grad, g, k)


@pytest.mark.parametrize("name", ["tiny", "bias"])
def test_greedy_generation_equals_torch_stored(name):
    cfg, sd, _ = stored(name)
    m = book.GPTModel(cfg)
    m.load_state_dict(sd)
    idx = NPZ[f"{name}.idx"][:1, :3]
    out = book.generate_text_simple(m, idx, 6, cfg["context_length"])
    np.testing.assert_array_equal(out, NPZ[f"{name}.greedy"])
    for use_cache in (False, True):
        np.testing.assert_array_equal(
            book.generate(m, idx, 6, cfg["context_length"], use_cache=use_cache), NPZ[f"{name}.greedy"]
        )


def test_float32_model_stays_float32():
    cfg, sd, _ = stored("bias")
    m = book.GPTModel(cfg, dtype=np.float32)
    m.load_state_dict(sd)
    logits = m(NPZ["bias.idx"])
    assert logits.dtype == np.float32
    np.testing.assert_allclose(logits, NPZ["bias.logits"], rtol=1e-4, atol=1e-4)
    m.backward(NPZ["bias.dlogits"])
    assert all(p.grad.dtype == np.float32 for p in m.parameters())


# -- live torch parity -----------------------------------------------------------------------
def _torch_ref():
    torch = pytest.importorskip("torch")
    import importlib.util

    spec = importlib.util.spec_from_file_location("chapter4_torch", os.path.join(HERE, "book", "chapter4_torch.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return torch, mod


@pytest.mark.parametrize(
    "cfg",
    [
        tiny_cfg(),
        tiny_cfg(qkv_bias=True, n_heads=4, n_layers=1, vocab_size=5),
        tiny_cfg(emb_dim=6, n_heads=3, n_layers=3, context_length=9),
    ],
)
def test_torch_parity_live(cfg):
    torch, ref = _torch_ref()
    torch.manual_seed(0)
    tm = ref.GPTModel(cfg).double()
    m = book.GPTModel(cfg)
    m.load_state_dict(tm.state_dict())  # CPU torch tensors load unchanged
    rng = np.random.default_rng(1)
    idx = rng.integers(0, cfg["vocab_size"], (3, cfg["context_length"]))
    tlogits = tm(torch.from_numpy(idx))
    logits = m(idx)
    np.testing.assert_allclose(logits, tlogits.detach().numpy(), rtol=1e-10, atol=1e-12)
    dlogits = rng.standard_normal(logits.shape)
    (tlogits * torch.from_numpy(dlogits)).sum().backward()
    m.backward(dlogits)
    for name, p in m.named_parameters():
        tg = dict(tm.named_parameters())[name].grad.numpy()
        assert_grad_close(p.grad, tg, name)
    # and the book's generate (batch of one) against ours, greedy with top-k and EOS
    prompt = idx[:1, :2]
    t_out = ref.generate(tm.eval(), torch.from_numpy(prompt), 5, cfg["context_length"], top_k=3)
    np.testing.assert_array_equal(book.generate(m, prompt, 5, cfg["context_length"], top_k=3), t_out.numpy())
    eos = int(t_out[0, 4])
    t_eos = ref.generate(tm, torch.from_numpy(prompt), 5, cfg["context_length"], eos_id=eos)
    np.testing.assert_array_equal(book.generate(m, prompt, 5, cfg["context_length"], eos_id=eos), t_eos.numpy())


# -- gradients by finite differences ---------------------------------------------------------------
def test_gradcheck_whole_gpt():
    m = book.GPTModel(tiny_cfg(qkv_bias=True, n_layers=2), rng=3)
    idx = np.random.default_rng(0).integers(0, 17, (2, 5))
    report = gradcheck(m, idx)
    assert report.ok, str(report)
    assert len(report.rows) == len(list(m.parameters()))


def test_gradcheck_with_dropout_fixed_rng():
    """Dropout in training mode: the masks come from the module's rng, reseeded for each run."""
    cfg = tiny_cfg(drop_rate=0.3, n_layers=1)
    idx = np.random.default_rng(0).integers(0, 17, (2, 4))
    base = book.GPTModel(cfg, rng=5)
    sd = base.state_dict()
    g = np.random.default_rng(2).standard_normal((2, 4, 17))

    def fresh():
        m = book.GPTModel(cfg, rng=11)  # same rng seed: the same dropout masks on every forward
        m.load_state_dict(sd)
        return m

    m = fresh()
    m(idx)
    m.backward(g)
    w = dict(m.named_parameters())
    for name in ("trf_blocks.0.att.W_key.weight", "trf_blocks.0.norm2.scale", "tok_emb.weight", "pos_emb.weight"):

        def loss(a, name=name):
            mm = fresh()
            dict(mm.named_parameters())[name].data[...] = a
            return np.sum(mm(idx) * g)

        (num,) = fd_gradients(loss, [w[name].data])
        assert rel_err(w[name].grad, num) < 1e-6, name
    # and dropout really acted
    assert not np.allclose(fresh()(idx), fresh().eval()(idx))


def test_book_layer_norm_and_gelu():
    x = np.random.default_rng(0).standard_normal((2, 3, 5)) * 3 + 1
    ln = book.LayerNorm(5)
    ln.scale.data[...] = np.arange(1, 6)
    ln.shift.data[...] = 0.5
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)  # biased variance
    np.testing.assert_allclose(ln(x), np.arange(1, 6) * (x - mu) / np.sqrt(var + 1e-5) + 0.5, rtol=1e-12)
    assert [k for k in ln.state_dict()] == ["scale", "shift"]
    y = book.GELU()(x)
    np.testing.assert_allclose(y, 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3))), rtol=1e-12)
    assert gradcheck(book.LayerNorm(5), x).ok and gradcheck(book.GELU(), x).ok
    assert gradcheck(book.FeedForward({"emb_dim": 4}, rng=0), x[..., :4]).ok
    assert gradcheck(book.TransformerBlock(tiny_cfg(emb_dim=4), rng=0), x[..., :4]).ok


def test_configs_and_init():
    assert book.GPT_CONFIG_124M["emb_dim"] == 768 and book.GPT_CONFIG_124M["vocab_size"] == 50257
    a = book.GPTModel(tiny_cfg(), rng=4).state_dict()
    b = book.GPTModel(tiny_cfg(), rng=4).state_dict()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert abs(a["tok_emb.weight"].std() - 1) < 0.3  # torch's nn.Embedding: N(0, 1)
    assert np.abs(a["out_head.weight"]).max() <= 1 / np.sqrt(8)
    np.testing.assert_array_equal(a["trf_blocks.1.att.mask"], np.triu(np.ones((6, 6)), 1))
    m = book.GPTModel(tiny_cfg(n_layers=12, emb_dim=16, n_heads=4, vocab_size=100))
    assert (
        m.num_parameters()
        == 100 * 16 + 6 * 16 + 12 * (4 * 16 * 16 + 16 + 2 * 4 * 16 * 16 + 4 * 16 + 16 + 4 * 16) + 2 * 16 + 16 * 100
    )


# -- errors ----------------------------------------------------------------------------------------
def test_bad_config_and_inputs():
    with pytest.raises(ValueError, match="missing keys"):
        book.GPTModel({"vocab_size": 3})
    with pytest.raises(TypeError, match="cfg"):
        book.GPTModel([1, 2])
    with pytest.raises(ValueError, match="n_heads"):
        book.GPTModel(tiny_cfg(emb_dim=9))
    with pytest.raises(ValueError, match="drop_rate"):
        book.GPTModel(tiny_cfg(drop_rate=1.5))
    with pytest.raises(TypeError, match="qkv_bias"):
        book.GPTModel(tiny_cfg(qkv_bias=1))
    m = book.GPTModel(tiny_cfg(), rng=0)
    with pytest.raises(ValueError, match="context_length=6"):
        m(np.zeros((1, 7), int))
    with pytest.raises(ValueError, match=r"\[0, 17\)"):
        m(np.array([[1, 17]]))
    with pytest.raises(TypeError, match="idx"):
        m(np.zeros((1, 3)))
    with pytest.raises(RuntimeError):
        m.backward(np.zeros((1, 3, 17)))
    m(np.zeros((1, 3), int))
    with pytest.raises(ValueError, match="dlogits"):
        m.backward(np.zeros((1, 3, 16)))


def test_unbatched_ids():
    m = book.GPTModel(tiny_cfg(), rng=2)
    ids = np.random.default_rng(0).integers(0, 17, (3, 5))
    full = m(ids)
    np.testing.assert_allclose(m(ids[2]), full[2], rtol=1e-13, atol=1e-14)
    assert gradcheck(m, ids[0], fast=True).ok  # one direction per tensor: test_gradcheck_whole_gpt checks each entry
    with pytest.raises(ValueError, match=r"\(batch, num_tokens\)"):
        m(ids[None])
    m.eval()
    m.reset_kv_cache()
    parts = np.concatenate([m(ids[0, :2], use_cache=True), m(ids[0, 2:], use_cache=True)], axis=0)
    np.testing.assert_allclose(parts, m(ids[0]), rtol=1e-12, atol=1e-13)
    m.reset_kv_cache()
    m(ids[:2, :2], use_cache=True)
    with pytest.raises(ValueError, match="batch shape"):
        m(ids[:1, 2:3], use_cache=True)
    assert m.current_pos == 2

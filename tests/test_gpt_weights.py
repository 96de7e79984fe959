"""GPT-2 weights into the book's ``GPTModel``: ``GPTModel.from_hf_gpt2_state_dict`` against a
small random Hugging Face ``GPT2LMHeadModel`` built locally (never downloaded), and
``load_weights_into_gpt`` with the same weights in the book's ``params`` layout (OpenAI's
checkpoint as nested dicts, chapter 5)."""

import numpy as np
import pytest

from npattn import book


def hf_model(n_layer=2, n_head=3, n_embd=12, vocab=41, n_positions=10, seed=0):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        vocab_size=vocab,
        n_positions=n_positions,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,
        eos_token_id=None,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # random biases and norm parameters too (their init is 0 / 1)
        for name, p in model.named_parameters():
            if name.endswith("bias") or "ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    return torch, model, cfg


def book_params(sd, n_layer):
    """The book's ``params`` (as ``gpt_download.load_gpt2_params_from_tf_ckpt`` returns) from HF keys."""
    a = lambda k: sd[f"transformer.{k}"].detach().numpy()  # noqa: E731
    params = {"wte": a("wte.weight"), "wpe": a("wpe.weight"), "g": a("ln_f.weight"), "b": a("ln_f.bias"), "blocks": []}
    for i in range(n_layer):
        h = lambda k, i=i: a(f"h.{i}.{k}")  # noqa: E731
        params["blocks"].append(
            {
                "attn": {
                    "c_attn": {"w": h("attn.c_attn.weight"), "b": h("attn.c_attn.bias")},
                    "c_proj": {"w": h("attn.c_proj.weight"), "b": h("attn.c_proj.bias")},
                },
                "mlp": {
                    "c_fc": {"w": h("mlp.c_fc.weight"), "b": h("mlp.c_fc.bias")},
                    "c_proj": {"w": h("mlp.c_proj.weight"), "b": h("mlp.c_proj.bias")},
                },
                "ln_1": {"g": h("ln_1.weight"), "b": h("ln_1.bias")},
                "ln_2": {"g": h("ln_2.weight"), "b": h("ln_2.bias")},
            }
        )
    return params


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_from_hf_gpt2_state_dict_gives_the_same_logits(dtype):
    torch, model, cfg = hf_model()
    if dtype == "float64":
        model = model.double()
    sd = model.state_dict()
    gpt = book.GPTModel.from_hf_gpt2_state_dict(sd, n_heads=cfg.n_head)
    assert gpt.dtype == np.dtype(dtype)
    assert gpt.cfg == {
        "vocab_size": 41,
        "context_length": 10,
        "emb_dim": 12,
        "n_heads": 3,
        "n_layers": 2,
        "drop_rate": 0.0,
        "qkv_bias": True,
    }
    idx = np.random.default_rng(0).integers(0, 41, (3, 10))
    with torch.no_grad():
        expected = model(torch.from_numpy(idx)).logits.numpy()
    logits = gpt(idx)
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == "float64" else dict(rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(logits, expected, **tol)
    # the tied head: lm_head.weight is wte
    np.testing.assert_array_equal(gpt.out_head.weight.data, gpt.tok_emb.weight.data)
    # without lm_head (a GPT2Model state dict, keys without the prefix) the head is tied as well
    bare = {k.removeprefix("transformer."): v for k, v in sd.items() if k != "lm_head.weight"}
    np.testing.assert_allclose(book.GPTModel.from_hf_gpt2_state_dict(bare, n_heads=3)(idx), logits, rtol=1e-6)


def test_generation_equals_hf_greedy():
    torch, model, cfg = hf_model(n_layer=3, n_head=2, n_embd=8, vocab=29, n_positions=16)
    model = model.double()
    gpt = book.GPTModel.from_hf_gpt2_state_dict(model.state_dict(), n_heads=cfg.n_head)
    prompt = np.array([[3, 1, 4, 1]])
    ours = book.generate(gpt, prompt, 8, 16)
    with torch.no_grad():
        theirs = model.generate(
            torch.from_numpy(prompt),
            max_new_tokens=8,
            do_sample=False,
            pad_token_id=0,
            attention_mask=torch.ones_like(torch.from_numpy(prompt)),
        )
    np.testing.assert_array_equal(ours, theirs.numpy())


def test_load_weights_into_gpt_book_layout():
    torch, model, cfg = hf_model()
    model = model.double()
    params = book_params(model.state_dict(), cfg.n_layer)
    gpt = book.GPTModel(
        {
            "vocab_size": 41,
            "context_length": 10,
            "emb_dim": 12,
            "n_heads": 3,
            "n_layers": 2,
            "drop_rate": 0.0,
            "qkv_bias": True,
        },
        rng=0,
    )
    assert book.load_weights_into_gpt(gpt, params) is gpt
    idx = np.random.default_rng(1).integers(0, 41, (2, 7))
    with torch.no_grad():
        expected = model(torch.from_numpy(idx)).logits.numpy()
    np.testing.assert_allclose(gpt(idx), expected, rtol=1e-10, atol=1e-12)
    # the split of c_attn into q, k, v and the transpose, entry by entry
    w = params["blocks"][1]["attn"]["c_attn"]["w"]
    np.testing.assert_array_equal(gpt.trf_blocks[1].att.W_key.weight.data, w[:, 12:24].T)
    b = params["blocks"][1]["attn"]["c_attn"]["b"]
    np.testing.assert_array_equal(gpt.trf_blocks[1].att.W_value.bias.data, b[24:])
    np.testing.assert_array_equal(gpt.trf_blocks[0].ff.layers[0].weight.data, params["blocks"][0]["mlp"]["c_fc"]["w"].T)


def _numpy_params(cfg, seed=0):
    rng = np.random.default_rng(seed)
    e, v, c = cfg["emb_dim"], cfg["vocab_size"], cfg["context_length"]
    r = lambda *s: rng.standard_normal(s)  # noqa: E731
    blk = lambda: {  # noqa: E731
        "attn": {"c_attn": {"w": r(e, 3 * e), "b": r(3 * e)}, "c_proj": {"w": r(e, e), "b": r(e)}},
        "mlp": {"c_fc": {"w": r(e, 4 * e), "b": r(4 * e)}, "c_proj": {"w": r(4 * e, e), "b": r(e)}},
        "ln_1": {"g": r(e), "b": r(e)},
        "ln_2": {"g": r(e), "b": r(e)},
    }
    return {"wte": r(v, e), "wpe": r(c, e), "g": r(e), "b": r(e), "blocks": [blk() for _ in range(cfg["n_layers"])]}


def test_load_weights_errors_change_nothing():
    cfg = {
        "vocab_size": 7,
        "context_length": 5,
        "emb_dim": 4,
        "n_heads": 2,
        "n_layers": 2,
        "drop_rate": 0.0,
        "qkv_bias": True,
    }
    gpt = book.GPTModel(cfg, rng=0)
    before = gpt.state_dict()
    params = _numpy_params(cfg)
    bad = _numpy_params(cfg)
    bad["blocks"][1]["attn"]["c_attn"]["w"] = np.zeros((4, 11))
    with pytest.raises(ValueError, match=r"\['blocks'\]\[1\]\['attn'\]\['c_attn'\]"):
        book.load_weights_into_gpt(gpt, bad)
    bad = _numpy_params(cfg)
    del bad["blocks"][0]["ln_2"]
    with pytest.raises(ValueError, match="ln_2"):
        book.load_weights_into_gpt(gpt, bad)
    bad = _numpy_params(cfg)
    bad["wpe"] = np.zeros((6, 4))
    with pytest.raises(ValueError, match="pos_emb.weight"):
        book.load_weights_into_gpt(gpt, bad)
    with pytest.raises(ValueError, match="2 layers"):
        book.load_weights_into_gpt(gpt, dict(params, blocks=params["blocks"][:1]))
    with pytest.raises(ValueError, match="blocks"):
        book.load_weights_into_gpt(gpt, {k: v for k, v in params.items() if k != "blocks"})
    for k, v in gpt.state_dict().items():
        np.testing.assert_array_equal(v, before[k])
    with pytest.raises(ValueError, match="qkv_bias"):
        book.load_weights_into_gpt(book.GPTModel(dict(cfg, qkv_bias=False)), params)
    with pytest.raises(TypeError, match="GPTModel"):
        book.load_weights_into_gpt(object(), params)
    book.load_weights_into_gpt(gpt, params)
    np.testing.assert_array_equal(gpt.out_head.weight.data, params["wte"])
    np.testing.assert_array_equal(gpt.final_norm.shift.data, params["b"])


def test_from_hf_errors():
    with pytest.raises(TypeError, match="state_dict"):
        book.GPTModel.from_hf_gpt2_state_dict([1, 2], n_heads=2)
    with pytest.raises(ValueError, match="transformer.wte.weight"):
        book.GPTModel.from_hf_gpt2_state_dict({"transformer.wpe.weight": np.zeros((4, 4))}, n_heads=2)
    cfg = {
        "vocab_size": 7,
        "context_length": 5,
        "emb_dim": 4,
        "n_heads": 2,
        "n_layers": 2,
        "drop_rate": 0.0,
        "qkv_bias": True,
    }
    p = _numpy_params(cfg)
    sd = {
        "transformer.wte.weight": p["wte"],
        "transformer.wpe.weight": p["wpe"],
        "transformer.ln_f.weight": p["g"],
        "transformer.ln_f.bias": p["b"],
        "transformer.h.0.ln_1.weight": p["g"],
    }
    with pytest.raises(ValueError, match="n_heads"):
        book.GPTModel.from_hf_gpt2_state_dict(sd)
    with pytest.raises(ValueError, match=r"transformer\.h\.0\.attn\.c_attn\.weight"):
        book.GPTModel.from_hf_gpt2_state_dict(sd, n_heads=2)


def test_from_hf_takes_the_books_config_dict():
    torch, model, cfg = hf_model(n_layer=1, n_head=1, n_embd=64, vocab=19, n_positions=6)
    model = model.double()
    sd = model.state_dict()
    idx = np.array([[1, 5, 7, 2]])
    with torch.no_grad():
        expected = model(torch.from_numpy(idx)).logits.numpy()
    book_cfg = {
        "vocab_size": 19,
        "context_length": 6,
        "emb_dim": 64,
        "n_heads": 1,
        "n_layers": 1,
        "drop_rate": 0.1,
        "qkv_bias": True,
    }
    gpt = book.GPTModel.from_hf_gpt2_state_dict(sd, **book_cfg)
    assert gpt.cfg == book_cfg
    np.testing.assert_allclose(gpt.eval()(idx), expected, rtol=1e-10, atol=1e-12)
    # without n_heads: GPT-2's head size 64
    assert book.GPTModel.from_hf_gpt2_state_dict(sd).cfg["n_heads"] == 1
    with pytest.raises(ValueError, match="n_layers"):
        book.GPTModel.from_hf_gpt2_state_dict(sd, **dict(book_cfg, n_layers=2))
    with pytest.raises(ValueError, match="qkv_bias"):
        book.GPTModel.from_hf_gpt2_state_dict(sd, **dict(book_cfg, qkv_bias=False))
    with pytest.raises(TypeError, match="unexpected"):
        book.GPTModel.from_hf_gpt2_state_dict(sd, n_embd=64)

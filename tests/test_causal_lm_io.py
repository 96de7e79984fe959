"""CausalLM checkpoints from disk without torch (safetensors through a memory map, bfloat16,
shards), config and state-dict errors that name the key, and transformers' save_pretrained
directories where transformers is installed."""

from __future__ import annotations

import json
import mmap
import os

import numpy as np
import pytest

from npattn import no_grad
from npattn.models import CausalLM, config_from_hf
from npattn.models.hf import bf16_to_float32, open_checkpoint, open_safetensors, save_safetensors

LLAMA = {
    "model_type": "llama",
    "vocab_size": 37,
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "architectures": ["LlamaForCausalLM"],
    "torch_dtype": "bfloat16",
}


def _model(config=LLAMA, seed=0, dtype=np.float32):
    m = CausalLM(config, rng=seed, dtype=dtype)
    rng = np.random.default_rng(seed + 1)
    for _, p in m.named_parameters():  # norms away from 1, so every tensor matters
        p.data[...] = p.data + rng.standard_normal(p.shape).astype(p.dtype) * 0.1
    return m


def _to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, round to nearest even (as torch)."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _write(directory, config, tensors, shards=1):
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    names = list(tensors)
    if shards == 1:
        save_safetensors(tensors, os.path.join(directory, "model.safetensors"), {"format": "np"})
        return
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        fn = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_safetensors({k: tensors[k] for k in part}, os.path.join(directory, fn))
        weight_map.update({k: fn for k in part})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def _ids():
    return np.array([[1, 5, 9, 2, 30, 7], [3, 3, 0, 36, 11, 4]])


def test_bf16_widening_is_exact():
    x = np.array([1.0, -2.5, 3.140625, 1e-30, np.inf, -0.0], np.float32)
    bits = _to_bf16_bits(x)
    y = bf16_to_float32(bits)
    np.testing.assert_array_equal(y[[0, 1, 2, 4, 5]], x[[0, 1, 2, 4, 5]])  # representable in bf16
    assert abs(y[3] - 1e-30) / 1e-30 < 2**-8


@pytest.mark.parametrize("shards", [1, 3])
def test_float32_checkpoint_round_trip(tmp_path, shards):
    m = _model()
    _write(tmp_path, LLAMA, m.state_dict(), shards)
    loaded = CausalLM.from_pretrained(tmp_path)
    assert loaded.dtype == np.float32
    with no_grad():
        np.testing.assert_array_equal(loaded(_ids()), m(_ids()))
    for (n, p), (n2, q) in zip(m.named_parameters(), loaded.named_parameters()):
        assert n == n2 and q.dtype == np.float32
        np.testing.assert_array_equal(p.data, q.data)


def test_bf16_checkpoint_loads_into_float32_and_float64(tmp_path):
    m = _model()
    sd = {k: (_to_bf16_bits(v), "BF16") for k, v in m.state_dict().items()}
    _write(tmp_path, LLAMA, sd)
    widened = {k: bf16_to_float32(b) for k, (b, _) in sd.items()}
    ref = CausalLM.from_hf(widened, LLAMA)
    for dtype, expect in ((None, np.float32), (np.float64, np.float64)):
        loaded = CausalLM.from_pretrained(tmp_path, dtype=dtype)
        assert loaded.dtype == expect
        assert all(p.dtype == expect for p in loaded.parameters())
        for (n, p), (_, q) in zip(ref.named_parameters(), loaded.named_parameters()):
            np.testing.assert_array_equal(p.data.astype(expect), q.data, err_msg=n)
    with no_grad():
        diff = np.abs(ref(_ids()) - m(_ids())).max()
    assert 0 < diff < 0.2  # bf16 rounding changes the logits a little


def test_float16_and_float64_tensors(tmp_path):
    m = _model(dtype=np.float64)
    sd = m.state_dict()
    _write(tmp_path / "f64", LLAMA, sd)
    assert CausalLM.from_pretrained(tmp_path / "f64").dtype == np.float64
    _write(tmp_path / "f16", LLAMA, {k: v.astype(np.float16) for k, v in sd.items()})
    loaded = CausalLM.from_pretrained(tmp_path / "f16")
    assert loaded.dtype == np.float32
    w = dict(loaded.named_parameters())["model.embed_tokens.weight"].data
    np.testing.assert_array_equal(w, sd["model.embed_tokens.weight"].astype(np.float16).astype(np.float32))


def test_tensors_stay_on_disk_until_converted(tmp_path):
    m = _model()
    save_safetensors(m.state_dict(), tmp_path / "w.safetensors")
    lazy = open_safetensors(tmp_path / "w.safetensors")
    t = lazy["model.embed_tokens.weight"]
    assert t.shape == (37, 16) and t.dtype == "F32" and "LazyTensor" in repr(t)
    assert isinstance(t._mm.mm, mmap.mmap)  # a file mapping, read on demand
    np.testing.assert_array_equal(t.numpy(), m.state_dict()["model.embed_tokens.weight"])


def test_loading_memory_is_about_the_model(tmp_path):
    """tracemalloc sees numpy's allocations: loading a bfloat16 checkpoint into float32 holds the
    model's parameters and little else (each tensor is widened straight into its parameter, the
    gradient buffers are dropped as the layers are built), never a second copy of the weights.
    (The one transient: the zero gradient a parameter is born with, until its layer is built.)"""
    import tracemalloc

    cfg = dict(LLAMA, vocab_size=4000, hidden_size=64, intermediate_size=256, num_attention_heads=4)
    m = _model(cfg)
    sd = {k: (_to_bf16_bits(v), "BF16") for k, v in m.state_dict().items()}
    _write(tmp_path, cfg, sd)
    model_bytes = sum(p.data.nbytes for p in m.parameters())
    del m
    tracemalloc.start()
    loaded = CausalLM.from_pretrained(tmp_path)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert sum(p.data.nbytes for p in loaded.parameters()) == model_bytes
    # the parameters, plus one freshly built parameter's zero gradient (the largest: lm_head)
    largest = max(p.data.nbytes for p in loaded.parameters())
    assert peak < model_bytes + largest + 0.05 * model_bytes, (peak, model_bytes, largest)
    assert all(p.grad is None for p in loaded.parameters())  # released after loading


# -- errors ----------------------------------------------------------------------------------
def test_state_dict_errors_name_the_key():
    m = _model()
    sd = m.state_dict()
    bad = dict(sd)
    del bad["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="missing key 'model.layers.1.mlp.up_proj.weight'"):
        CausalLM.from_hf(bad, LLAMA)
    with pytest.raises(ValueError, match="unexpected key 'model.layers.0.self_attn.extra.weight'"):
        CausalLM.from_hf({**sd, "model.layers.0.self_attn.extra.weight": np.zeros(3)}, LLAMA)
    bad = dict(sd, **{"model.norm.weight": np.ones(17, np.float32)})
    with pytest.raises(ValueError, match=r"state_dict\['model.norm.weight'\]: expected shape \(16,\), got \(17,\)"):
        CausalLM.from_hf(bad, LLAMA)
    with pytest.raises(TypeError, match="model.norm.weight.*floating"):
        CausalLM.from_hf(dict(sd, **{"model.norm.weight": np.ones(16, np.int64)}), LLAMA)
    with pytest.raises(TypeError, match="state_dict"):
        CausalLM.from_hf([1, 2], LLAMA)
    # derived rotary buffers of older checkpoints are ignored
    CausalLM.from_hf({**sd, "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(2, np.float32)}, LLAMA)


def test_tied_head_is_listed_once_and_checked():
    cfg = dict(LLAMA, tie_word_embeddings=True)
    m = _model(cfg)
    sd = m.state_dict()
    assert "lm_head.weight" not in sd
    names = [n for n, _ in m.named_parameters()]
    assert names.count("model.embed_tokens.weight") == 1 and "lm_head.weight" not in names
    same = CausalLM.from_hf({**sd, "lm_head.weight": sd["model.embed_tokens.weight"]}, cfg)
    np.testing.assert_array_equal(same.state_dict()["model.embed_tokens.weight"], sd["model.embed_tokens.weight"])
    with pytest.raises(ValueError, match="lm_head.weight.*differs"):
        CausalLM.from_hf({**sd, "lm_head.weight": sd["model.embed_tokens.weight"] + 1}, cfg)
    with pytest.raises(ValueError, match="lm_head.weight.*shape"):
        CausalLM.from_hf({**sd, "lm_head.weight": np.zeros((3, 3), np.float32)}, cfg)


def test_tied_pair_under_the_head_s_name_alone(tmp_path):
    """safetensors.torch.save_model writes a tied pair once, under the first name sorted:
    lm_head.weight alone.  transformers ties the embedding to it; so does from_pretrained (it
    raised 'missing key model.embed_tokens.weight')."""
    torch = pytest.importorskip("torch")
    T = pytest.importorskip("transformers")
    from safetensors.torch import save_model

    cfg = dict(LLAMA, tie_word_embeddings=True)
    m = _model(cfg)
    hf = T.LlamaForCausalLM(T.LlamaConfig(**cfg))
    hf.load_state_dict({k: torch.from_numpy(v) for k, v in m.state_dict().items()}, strict=False)
    hf.tie_weights()
    _write(tmp_path, cfg, {})
    save_model(hf, str(tmp_path / "model.safetensors"))
    assert "model.embed_tokens.weight" not in open_safetensors(tmp_path / "model.safetensors")
    loaded = CausalLM.from_pretrained(tmp_path)
    for k, v in m.state_dict().items():
        np.testing.assert_array_equal(loaded.state_dict()[k], v, err_msg=k)
    ref = T.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad(), no_grad():
        want = ref(torch.from_numpy(_ids())).logits.numpy()
        np.testing.assert_allclose(loaded(_ids()), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "change, key",
    [
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
        ({"hidden_act": "tanh"}, "hidden_act"),
        ({"model_type": "bloom"}, "model_type"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"attention_bias": "yes"}, "attention_bias"),
        ({"rms_norm_eps": -1.0}, "rms_norm_eps"),
        ({"attention_dropout": 1.5}, "attention_dropout"),
    ],
)
def test_config_errors_name_the_key(change, key):
    with pytest.raises(ValueError, match=key):
        CausalLM(dict(LLAMA, **change), rng=0)


def test_config_reader_details():
    with pytest.raises(TypeError, match="config"):
        config_from_hf([("model_type", "llama")])
    # a key left out means transformers' default (LlamaConfig's hidden_size is 4096)
    assert config_from_hf({"model_type": "llama"}).hidden_size == 4096
    assert config_from_hf({"model_type": "deepseek_v3"}).hf["routed_scaling_factor"] == 2.5
    with pytest.raises(ValueError, match="sliding_window"):
        config_from_hf(dict(LLAMA, model_type="qwen3", layer_types=["sliding_attention"] * 2, sliding_window=None))
    with pytest.raises(ValueError, match="max_window_layers"):
        config_from_hf(dict(LLAMA, model_type="qwen3", max_window_layers=-1))
    old = dict(LLAMA, rope_scaling={"type": "linear", "factor": 2.0})
    assert config_from_hf(old).rope["default"]["rope_type"] == "linear"
    gemma = {
        "model_type": "gemma3_text",
        "vocab_size": 11,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 4,
        "rope_theta": 1e6,
        "rope_local_base_freq": 1e4,
        "sliding_window": 4,
        "sliding_window_pattern": 2,
        "pad_token_id": -1,
    }
    # transformers 5 merges Gemma 3's rope_scaling into the full-attention layers' rope parameters,
    # whose rope_type ("default") it keeps: an old-style "type" is never applied there, so refused
    with pytest.raises(ValueError, match=r"config\['rope_scaling'\]\['type'\]"):
        config_from_hf(dict(gemma, rope_scaling={"type": "linear", "factor": 8.0}))
    old_gemma = dict(gemma, rope_scaling={"rope_type": "linear", "factor": 8.0})
    assert config_from_hf(old_gemma).rope["full_attention"]["rope_type"] == "linear"
    assert config_from_hf(old_gemma).rope["sliding_attention"]["rope_type"] == "default"
    typed = dict(LLAMA, rope_parameters={"type": "linear", "factor": 2.0, "rope_theta": 1e4})
    assert config_from_hf(typed).rope["default"] == {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
    c = config_from_hf(gemma)
    assert c.layer_types == ("sliding_attention", "full_attention")
    assert c.rope["sliding_attention"]["rope_theta"] == 1e4 and c.rope["full_attention"]["rope_theta"] == 1e6
    assert c.pad_token_id is None and c.embed_scale and c.norm_offset and c.sandwich_norm
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        config_from_hf(dict(gemma, use_bidirectional_attention=True))
    with pytest.raises(ValueError, match="layer_types"):
        config_from_hf(dict(gemma, layer_types=["sliding_attention"]))
    with pytest.raises(ValueError, match="layer_types"):
        config_from_hf(dict(gemma, layer_types=["sliding_attention", "chunked_attention"]))
    assert c.replace(vocab_size=12).vocab_size == 12
    from _families import FAMILIES

    with pytest.raises(ValueError, match="head_dim"):
        config_from_hf(dict(FAMILIES["deepseek_v3"], head_dim=8))


def test_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such directory"):
        CausalLM.from_pretrained(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        CausalLM.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        CausalLM.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        CausalLM.from_pretrained(tmp_path)
    st = tmp_path / "model.safetensors"
    st.write_bytes(b"\x01\x02")
    with pytest.raises(ValueError, match="8-byte"):
        open_safetensors(st)
    st.write_bytes((1000).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match="exceeds"):
        open_safetensors(st)
    st.write_bytes((4).to_bytes(8, "little") + b"{]]]")
    with pytest.raises(ValueError, match="JSON"):
        open_safetensors(st)
    st.write_bytes((2).to_bytes(8, "little") + b"[]")
    with pytest.raises(ValueError, match="JSON object"):
        open_safetensors(st)
    for header, msg in (
        ({"w": {"dtype": "F32", "shape": [2]}}, "malformed"),
        ({"w": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, "dtype 'C64'"),
        ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, "needs 12 bytes"),
    ):
        text = json.dumps(header).encode()
        st.write_bytes(len(text).to_bytes(8, "little") + text + b"\0" * 8)
        with pytest.raises(ValueError, match=msg):
            open_safetensors(st)
    st.unlink()
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "missing.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="shard"):
        open_checkpoint(tmp_path)
    save_safetensors({"b": np.zeros(2, np.float32)}, tmp_path / "s.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "s.safetensors"}}))
    with pytest.raises(ValueError, match="'a' is not in its shard"):
        open_checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("[]")
    with pytest.raises(ValueError, match="weight_map"):
        open_checkpoint(tmp_path)


def test_integer_tensors_are_refused_before_building(tmp_path):
    m = _model()
    sd = dict(m.state_dict())
    sd["model.norm.weight"] = np.ones(16, np.int32)
    _write(tmp_path, LLAMA, sd)
    with pytest.raises(TypeError, match="model.norm.weight"):
        CausalLM.from_pretrained(tmp_path)


# -- transformers' own directories -------------------------------------------------------------
@pytest.mark.parametrize("torch_dtype", ["float32", "bfloat16"])
def test_save_pretrained_directory(tmp_path, torch_dtype):
    torch = pytest.importorskip("torch")
    T = pytest.importorskip("transformers")
    cfg = T.Qwen3Config(
        vocab_size=37,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=4,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    hf = T.Qwen3ForCausalLM(cfg).to(getattr(torch, torch_dtype))
    hf.save_pretrained(tmp_path, max_shard_size="4KB" if torch_dtype == "float32" else "1GB")
    files = sorted(os.listdir(tmp_path))
    assert ("model.safetensors.index.json" in files) == (torch_dtype == "float32")
    loaded = CausalLM.from_pretrained(tmp_path)
    direct = CausalLM.from_hf(hf.state_dict(), hf.config.to_dict())
    assert loaded.dtype == direct.dtype == np.float32
    for (n, p), (n2, q) in zip(direct.named_parameters(), loaded.named_parameters()):
        assert n == n2
        np.testing.assert_array_equal(p.data, q.data, err_msg=n)
    ids = _ids()
    with torch.no_grad():
        ref = hf.float()(input_ids=torch.from_numpy(ids)).logits.numpy()
    with no_grad():
        np.testing.assert_allclose(loaded(ids), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3_text", "gpt_oss", "deepseek_v3", "qwen3_next"])
def test_every_family_loads_from_a_bf16_directory(tmp_path, name):
    """Each family from a saved directory (bfloat16 safetensors, buffers such as DeepSeek-V3's
    correction bias included, a tied head written out too) equals from_hf of the widened tensors."""
    from _families import FAMILIES as SHORT

    cfg = SHORT[name]
    m = _model(cfg)
    sd = m.state_dict()
    if cfg.get("tie_word_embeddings"):
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    bits = {k: (_to_bf16_bits(v), "BF16") for k, v in sd.items()}
    _write(tmp_path, cfg, bits, shards=2)
    loaded = CausalLM.from_pretrained(tmp_path)
    ref = CausalLM.from_hf({k: bf16_to_float32(b) for k, (b, _) in bits.items()}, cfg)
    assert set(loaded.state_dict()) == set(ref.state_dict())
    for k, v in ref.state_dict().items():
        np.testing.assert_array_equal(loaded.state_dict()[k], v, err_msg=k)
    with no_grad():
        np.testing.assert_array_equal(loaded(_ids()), ref(_ids()))


def test_no_draw_generator_gives_constants():
    from npattn.models.hf import _NoDraw

    g = _NoDraw(np.random.PCG64(0))
    assert not g.normal(0.0, 1.0, (2, 3)).any() and not g.standard_normal(4).any()
    np.testing.assert_array_equal(g.uniform(0.5, 1.0, 3), [0.5, 0.5, 0.5])


def test_hub_style_configs():
    """Keys the published config.json files carry besides transformers' own: read where they
    change nothing transformers computes, refused where they would."""
    from _families import FAMILIES as SHORT

    oss = dict(SHORT["gpt_oss"], experts_per_token=2, initial_context_length=4096)
    assert config_from_hf(oss).moe.top_k == 2  # the typed MoEConfig: SparseMoeBlock's top_k
    with pytest.raises(ValueError, match="experts_per_token"):
        config_from_hf(dict(oss, experts_per_token=3))
    with pytest.raises(ValueError, match="quantization_config"):
        config_from_hf(dict(oss, quantization_config={"quant_method": "mxfp4"}))
    ds = dict(SHORT["deepseek_v3"], scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1)
    ds.update(aux_loss_alpha=0.001, seq_aux=True, ep_size=1)
    assert config_from_hf(ds).mlp_types == ("dense", "moe")
    for key, bad in (("scoring_func", "softmax"), ("topk_method", "greedy"), ("moe_layer_freq", 2)):
        with pytest.raises(ValueError, match=key):
            config_from_hf(dict(ds, **{key: bad}))
    nxt = dict(SHORT["qwen3_next"], use_sliding_window=False, sliding_window=None, max_window_layers=28)
    assert config_from_hf(nxt).layer_types == ("linear_attention", "full_attention")


@pytest.mark.parametrize(
    "name, extra",
    [
        ("deepseek_v3", "model.layers.{n}.eh_proj.weight"),  # layer 61 of the released DeepSeek-V3
        ("deepseek_v32", "model.layers.{n}.mlp.experts.0.gate_proj.weight"),
        ("qwen3_next", "mtp.fc.weight"),
        ("qwen3_5_text", "mtp.layers.0.self_attn.q_proj.weight"),
        ("qwen3_5_moe_text", "mtp.fc.weight"),
    ],
)
def test_released_multi_token_prediction_layers_are_left_unread(tmp_path, name, extra):
    """The released DeepSeek-V3 (its num_nextn_predict_layers layers after the model's:
    model.layers.61.*), Qwen3-Next and Qwen3.5 checkpoints carry multi-token-prediction layers
    beside the causal LM; transformers ignores them (_keys_to_ignore_on_load_unexpected) and so
    does from_pretrained (it refused them as unexpected).  Elsewhere they stay unexpected."""
    from npattn.models.tiny import tiny_config

    cfg = tiny_config(name, **({"num_nextn_predict_layers": 1} if name.startswith("deepseek") else {}))
    m = _model(cfg)
    key = extra.format(n=m.config.num_hidden_layers)
    _write(tmp_path, cfg, {**m.state_dict(), key: np.ones((8, 4), np.float32)})
    loaded = CausalLM.from_pretrained(tmp_path)
    for k, v in m.state_dict().items():
        np.testing.assert_array_equal(loaded.state_dict()[k], v, err_msg=k)
    if name.startswith("deepseek"):  # transformers' default of one such layer, its other spelling
        n = m.config.num_hidden_layers
        assert config_from_hf(tiny_config(name)).layout.mtp == (f"model.layers.{n}.",)
        assert config_from_hf(tiny_config(name, num_mtp_layers=2)).layout.mtp[1] == f"model.layers.{n + 1}."
        # no such layers in the config: a layer past the model is unexpected
        _write(tmp_path, dict(cfg, num_nextn_predict_layers=0), {**m.state_dict(), key: np.ones((8, 4), np.float32)})
        with pytest.raises(ValueError, match=rf"key 'model\.layers\.{m.config.num_hidden_layers}\."):
            CausalLM.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"unexpected key 'mtp.fc.weight'"):
        CausalLM.from_hf({**_model(LLAMA).state_dict(), "mtp.fc.weight": np.ones((8, 4))}, LLAMA)


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3_text", "gpt_oss", "deepseek_v3", "qwen3_next"])
def test_every_family_from_a_save_pretrained_directory(tmp_path, name):
    """transformers' own save_pretrained directory of each family (DeepSeek-V3 and Qwen3-Next
    write each expert's projections apart; they are fused while loading) gives the model of its
    in-memory state dict, and transformers' logits."""
    torch = pytest.importorskip("torch")
    T = pytest.importorskip("transformers")
    from _families import FAMILIES as SHORT

    config = T.AutoConfig.for_model(**SHORT[name])
    config._experts_implementation = "eager"
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = T.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    loaded = CausalLM.from_pretrained(tmp_path)
    direct = CausalLM.from_hf(hf.state_dict(), hf.config.to_dict())
    for k, v in direct.state_dict().items():
        np.testing.assert_array_equal(loaded.state_dict()[k], v, err_msg=k)
    ids = _ids() % 41
    with torch.no_grad():
        ref = hf(input_ids=torch.from_numpy(ids)).logits.numpy()
    with no_grad():
        np.testing.assert_allclose(loaded(ids), ref, rtol=1e-4, atol=1e-4)


def test_per_expert_keys_are_fused_or_refused():
    from _families import FAMILIES as SHORT

    cfg = SHORT["qwen3_next"]
    m = _model(cfg)
    sd = m.state_dict()
    split = {k: v for k, v in sd.items() if ".experts." not in k}
    prefix = "model.layers.0.mlp.experts"
    gu, down = sd[f"{prefix}.gate_up_proj"], sd[f"{prefix}.down_proj"]
    inter = gu.shape[1] // 2
    for e in range(gu.shape[0]):
        split[f"{prefix}.{e}.gate_proj.weight"] = gu[e, :inter]
        split[f"{prefix}.{e}.up_proj.weight"] = gu[e, inter:]
        split[f"{prefix}.{e}.down_proj.weight"] = down[e]
    for k in [k for k in sd if k.startswith("model.layers.1.mlp.experts.")]:
        split[k] = sd[k]  # layer 1 stays fused: both forms in one state dict
    loaded = CausalLM.from_hf(split, cfg)
    for k, v in sd.items():
        np.testing.assert_array_equal(loaded.state_dict()[k], v, err_msg=k)
    bad = dict(split)
    del bad[f"{prefix}.2.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing key 'model.layers.0.mlp.experts.2.up_proj.weight'"):
        CausalLM.from_hf(bad, cfg)
    bad = dict(split, **{f"{prefix}.1.down_proj.weight": down[1][:, :-1]})
    with pytest.raises(ValueError, match=r"experts.1.down_proj.weight.*expected a 2-D tensor of shape"):
        CausalLM.from_hf(bad, cfg)

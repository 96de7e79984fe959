"""Released quantized checkpoints: GPT-OSS's MXFP4 experts and DeepSeek-V3's block-scaled FP8
weights, dequantized as transformers' and DeepSeek's reference code do (compared with those
functions themselves where torch/transformers are installed), and loaded by
``CausalLM.from_pretrained`` from tiny checkpoints written quantized by hand."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
from _families import FAMILIES
from test_causal_lm_io import _model, _to_bf16_bits, _write

from npattn import no_grad
from npattn.models import CausalLM
from npattn.models.hf import bf16_to_float32, f8_e4m3_to_float32, open_safetensors
from npattn.models.quant import fp8_block_dequantize, mxfp4_dequantize, should_convert_module

_INT = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def _bits(a: np.ndarray) -> np.ndarray:
    """The bit patterns of a float array (NaN payloads and signed zeros compared too)."""
    return np.ascontiguousarray(a).view(_INT[a.dtype.itemsize])


# -- the formats' values --------------------------------------------------------------------------
def test_f8_e4m3_table_is_torchs(torch_or_skip):
    torch = torch_or_skip
    every = np.arange(256, dtype=np.uint8)
    ref = torch.from_numpy(every).view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(_bits(f8_e4m3_to_float32(every)), _bits(ref))
    assert f8_e4m3_to_float32(np.array([0x7E], np.uint8))[0] == 448.0  # the largest: no infinity


def test_f8_e4m3_table_by_hand():
    """Without torch: the format's definition on a few patterns (sign, exponent bias 7, subnormals)."""
    got = f8_e4m3_to_float32(np.array([0x00, 0x80, 0x38, 0x01, 0x08, 0xC4, 0x7F], np.uint8))
    np.testing.assert_array_equal(got[:6], [0.0, -0.0, 1.0, 2.0**-9, 2.0**-6, -3.0])
    assert np.signbit(got[1]) and np.isnan(got[6])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_mxfp4_equals_transformers(dtype):
    torch = pytest.importorskip("torch")
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 40, 2, 16), dtype=np.uint8)  # every nibble
    scales = rng.integers(0, 256, (3, 40, 2), dtype=np.uint8)  # every exponent, 255 (inf in float32) too
    scales[0, :4] = [[0, 1], [127, 128], [254, 255], [100, 160]]
    tdtype = getattr(torch, dtype)
    ref = mxfp4.convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=tdtype)
    if dtype == "float64":  # computed in float64 as transformers does for a float64 model: no overflow
        got = torch.from_numpy(mxfp4_dequantize(blocks, scales, out=np.empty(ref.shape, np.float64)))
    else:  # the float32 values, rounded to bfloat16 as transformers' bfloat16 ones are
        got = torch.from_numpy(mxfp4_dequantize(blocks, scales)).to(tdtype)
    assert tuple(ref.shape) == (3, 64, 40)
    as_int = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float64: torch.int64}[tdtype]
    assert torch.equal(got.view(as_int), ref.view(as_int))


def test_mxfp4_layout_by_hand():
    """Without transformers: row r, group g, byte j holds inputs 32g + 2j (low nibble) and
    32g + 2j + 1 (high), scaled by 2**(scale - 127); the result is (experts, inputs, rows)."""
    blocks = np.zeros((1, 2, 2, 16), np.uint8)
    blocks[0, 1, 1, 3] = 0x72  # row 1, group 1, byte 3: low nibble 2 (1.0), high nibble 7 (6.0)
    scales = np.full((1, 2, 2), 127, np.uint8)
    scales[0, 1, 1] = 129  # x4
    got = mxfp4_dequantize(blocks, scales)
    want = np.zeros((1, 64, 2), np.float32)
    want[0, 32 + 6, 1], want[0, 32 + 7, 1] = 4.0, 24.0
    np.testing.assert_array_equal(got, want)


def _fp8_reference(w_values: np.ndarray, scale: np.ndarray, block) -> np.ndarray:
    """DeepSeek's weight_dequant (inference/kernel.py): float32(w) * s of its block, edge blocks partial."""
    bm, bn = block
    s = np.repeat(np.repeat(scale, bm, axis=-2), bn, axis=-1)[..., : w_values.shape[-2], : w_values.shape[-1]]
    return w_values.astype(np.float32) * s.astype(np.float32)


def test_fp8_block_equals_transformers():
    torch = pytest.importorskip("torch")
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 256, (256, 384), dtype=np.uint8)  # NaN patterns included
    scale = rng.uniform(1e-4, 1.0, (2, 3)).astype(np.float32)
    ref = fp8.Fp8Dequantize(None)._dequantize_one(
        torch.from_numpy(bits).view(torch.float8_e4m3fn), torch.from_numpy(scale), torch.float32
    )
    got = fp8_block_dequantize(f8_e4m3_to_float32(bits), scale, (128, 128))
    np.testing.assert_array_equal(_bits(got), _bits(ref.numpy()))


def test_fp8_partial_edge_blocks():
    """576 rows (DeepSeek-V3's kv_a_proj_with_mqa) in blocks of 128: five block rows, the last of
    64; transformers' loader, dividing the shape by the scale grid, cannot read it."""
    rng = np.random.default_rng(2)
    bits = rng.integers(0, 0x7F, (576, 200), dtype=np.uint8) | (rng.integers(0, 2, (576, 200), dtype=np.uint8) << 7)
    scale = rng.uniform(1e-3, 1.0, (5, 2)).astype(np.float32)
    values = f8_e4m3_to_float32(bits)
    got = fp8_block_dequantize(values, scale, (128, 128))
    np.testing.assert_array_equal(got, _fp8_reference(values, scale, (128, 128)))
    np.testing.assert_array_equal(got[512:, 128:], values[512:, 128:] * scale[4, 1])  # the corner block
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="not divisible"):
        fp8.Fp8Dequantize(None)._dequantize_one(torch.from_numpy(values), torch.from_numpy(scale), torch.float32)


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.11.self_attn",
        "model.layers.1.mlp.experts",
        "model.layers.1.mlp.router",
        "model.embed_tokens",
        "lm_head",
        "model.layers.0.mlp.gate_proj",
        "model.layers.0.mlp.gate",
        "model.decoder.layers.23.fc1",
    ],
)
def test_modules_to_not_convert_match_as_transformers(name):
    utils = pytest.importorskip("transformers.quantizers.quantizers_utils")
    patterns = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
    for p in (patterns, ["mlp.gate", "fc1"], ["model.layers.1"], None):
        assert should_convert_module(name, p) == utils.should_convert_module(name, p), p


# -- checkpoints -----------------------------------------------------------------------------------
def _bf16(sd: dict) -> tuple:
    """``(tensors for the file as bfloat16 bits, the float32 values they hold)``."""
    bits = {k: (_to_bf16_bits(v), "BF16") for k, v in sd.items()}
    return bits, {k: bf16_to_float32(b) for k, (b, _) in bits.items()}


def _ids(vocab):
    return np.random.default_rng(5).integers(0, vocab, (2, 7))


def _logits(m, ids):
    with no_grad():
        return m(ids)


# GPT-OSS's released quantization_config (openai/gpt-oss-20b config.json)
MXFP4 = {
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
    "quant_method": "mxfp4",
}
OSS = dict(FAMILIES["gpt_oss"], hidden_size=32, intermediate_size=32)  # MXFP4 groups 32 inputs


def _gpt_oss_checkpoint(directory, shards=2, quantization_config=MXFP4):
    """A tiny GPT-OSS written as released: experts as random MXFP4 blocks and scales, the rest
    bfloat16; returns the float32 state dict the file holds, dequantized."""
    rng = np.random.default_rng(3)
    sd = _model(OSS).state_dict()
    files, values = _bf16(sd)
    for i in range(OSS["num_hidden_layers"]):
        prefix = f"model.layers.{i}.mlp.experts"
        for proj in ("gate_up_proj", "down_proj"):
            E, inputs, rows = sd[f"{prefix}.{proj}"].shape
            blocks = rng.integers(0, 256, (E, rows, inputs // 32, 16), dtype=np.uint8)
            scales = rng.integers(122, 129, (E, rows, inputs // 32), dtype=np.uint8)
            del files[f"{prefix}.{proj}"]
            files[f"{prefix}.{proj}_blocks"], files[f"{prefix}.{proj}_scales"] = blocks, scales
            values[f"{prefix}.{proj}"] = mxfp4_dequantize(blocks, scales)
    config = dict(OSS, quantization_config=quantization_config)
    _write(directory, config, files, shards)
    return values


def test_gpt_oss_mxfp4_checkpoint_loads(tmp_path):
    values = _gpt_oss_checkpoint(tmp_path)
    assert open_safetensors(tmp_path / "model-00001-of-00002.safetensors")  # a shard mixing U8 and BF16
    loaded = CausalLM.from_pretrained(tmp_path)
    want = CausalLM.from_hf(values, OSS)
    for k, v in want.state_dict().items():
        np.testing.assert_array_equal(loaded.state_dict()[k], v, err_msg=k)
    ids = _ids(OSS["vocab_size"])
    np.testing.assert_array_equal(_logits(loaded, ids), _logits(want, ids))
    f64 = CausalLM.from_pretrained(tmp_path, dtype=np.float64)
    np.testing.assert_array_equal(
        f64.state_dict()["model.layers.1.mlp.experts.down_proj"], values["model.layers.1.mlp.experts.down_proj"]
    )


def test_gpt_oss_mxfp4_checkpoint_as_transformers_reads_it(tmp_path):
    """transformers loads the same directory dequantized (float32): every tensor is npattn's,
    bit for bit, and the logits agree."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    _gpt_oss_checkpoint(tmp_path, shards=1)
    loaded = CausalLM.from_pretrained(tmp_path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path,
        quantization_config=transformers.Mxfp4Config(dequantize=True),
        dtype=torch.float32,
        attn_implementation="eager",
    )
    theirs = {k: v.numpy() for k, v in ref.state_dict().items()}
    assert theirs.keys() == loaded.state_dict().keys()
    for k, v in loaded.state_dict().items():
        np.testing.assert_array_equal(v, theirs[k], err_msg=k)
    ids = _ids(OSS["vocab_size"])
    with torch.no_grad():
        want = ref(torch.from_numpy(ids)).logits.numpy()
    np.testing.assert_allclose(_logits(loaded, ids), want, rtol=1e-4, atol=1e-4)


def _split_experts(sd: dict) -> dict:
    """Fused experts -> one tensor per expert and projection, as DeepSeek-V3's checkpoint has them."""
    out = {}
    for k, v in sd.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            inter = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[k.replace("gate_up_proj", f"{e}.gate_proj.weight")] = v[e, :inter]
                out[k.replace("gate_up_proj", f"{e}.up_proj.weight")] = v[e, inter:]
        elif k.endswith("mlp.experts.down_proj"):
            for e in range(v.shape[0]):
                out[k.replace("down_proj", f"{e}.down_proj.weight")] = v[e]
        else:
            out[k] = v
    return out


DEEPSEEK = FAMILIES["deepseek_v3"]


def _fp8_checkpoint(directory, block=(8, 8), shards=3, quantization_config=None, tamper=None, config=DEEPSEEK):
    """A tiny DeepSeek-V3 (or V3.2: ``config``) written as released: every projection's weight
    random F8_E4M3 bits (no NaN) beside a float32 weight_scale_inv per block, one tensor per
    expert, the rest bfloat16 (V3.2's indexer: wq_b and wk in FP8, weights_proj bfloat16); returns
    the float32 state dict it holds, dequantized by DeepSeek's formula."""
    rng = np.random.default_rng(4)
    files, values = _bf16(_split_experts(_model(config).state_dict()))
    for k in list(files):
        fp8 = k.endswith(("_proj.weight", "_proj_with_mqa.weight", ".indexer.wq_b.weight", ".indexer.wk.weight"))
        if not fp8 or k.endswith(".indexer.weights_proj.weight"):
            continue  # norms, embeddings, the head, the router and the indexer's head weights stay bfloat16
        rows, cols = files[k][0].shape
        bits = rng.integers(0, 0x7F, (rows, cols), dtype=np.uint8) | (
            rng.integers(0, 2, (rows, cols), dtype=np.uint8) << 7
        )
        scale = rng.uniform(0.002, 0.02, (math.ceil(rows / block[0]), math.ceil(cols / block[1]))).astype(np.float32)
        files[k], files[k + "_scale_inv"] = (bits, "F8_E4M3"), scale
        values[k] = _fp8_reference(f8_e4m3_to_float32(bits), scale, block)
    if tamper:
        tamper(files)
    qc = quantization_config or {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(block),
    }
    _write(directory, dict(config, quantization_config=qc), files, shards)
    return values


@pytest.mark.parametrize("block", [(8, 8), (128, 128), (5, 3)])
def test_deepseek_fp8_checkpoint_loads(tmp_path, block):
    values = _fp8_checkpoint(tmp_path, block)
    loaded = CausalLM.from_pretrained(tmp_path)
    want = CausalLM.from_hf(values, DEEPSEEK)
    got_sd = loaded.state_dict()
    for k, v in want.state_dict().items():
        np.testing.assert_array_equal(got_sd[k], v, err_msg=k)
    ids = _ids(DEEPSEEK["vocab_size"])
    np.testing.assert_array_equal(_logits(loaded, ids), _logits(want, ids))


def test_deepseek_v32_fp8_checkpoint_loads(tmp_path):
    """DeepSeek-V3.2 as released: the lightning indexer's wq_b and wk in FP8 blocks too."""
    config = FAMILIES["deepseek_v32"]
    values = _fp8_checkpoint(tmp_path, (8, 8), config=config)
    loaded = CausalLM.from_pretrained(tmp_path)
    want = CausalLM.from_hf(values, config)
    got_sd = loaded.state_dict()
    assert "model.layers.0.self_attn.indexer.wq_b.weight" in got_sd
    for k, v in want.state_dict().items():
        np.testing.assert_array_equal(got_sd[k], v, err_msg=k)
    ids = _ids(config["vocab_size"])
    np.testing.assert_array_equal(_logits(loaded, ids), _logits(want, ids))


def test_plain_f8_tensor_reads_its_values(tmp_path):
    """An F8_E4M3 tensor of a checkpoint without quantization_config is its values (as torch reads it)."""
    from npattn.models.hf import save_safetensors

    bits = np.arange(0, 0x7E, dtype=np.uint8).reshape(6, 21)
    save_safetensors({"w": (bits, "F8_E4M3")}, tmp_path / "w.safetensors")
    t = open_safetensors(tmp_path / "w.safetensors")["w"]
    assert t.dtype == "F8_E4M3" and t.shape == (6, 21)
    np.testing.assert_array_equal(t.numpy(), f8_e4m3_to_float32(bits))
    out = np.empty((6, 21), np.float64)
    t.read_into(out)
    np.testing.assert_array_equal(out, f8_e4m3_to_float32(bits))


# -- refusals ----------------------------------------------------------------------------------------
def _set(key, value):
    def tamper(files):
        files[key] = value

    return tamper


def _drop(key):
    def tamper(files):
        del files[key]

    return tamper


Q = "model.layers.0.self_attn.q_a_proj.weight"


@pytest.mark.parametrize(
    "qc, tamper, match",
    [
        ({"quant_method": "gptq"}, None, r"quant_method.*'gptq'.*not supported"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, None, "weight_block_size"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, None, r"'fmt'.*'e4m3'"),
        ({"quant_method": "fp8", "group_size": 64}, None, "group_size"),
        (
            {
                "quant_method": "fp8",
                "weight_block_size": [8, 8],
                "modules_to_not_convert": ["model.layers.0.self_attn"],
            },
            None,
            r"'model.layers.0.self_attn.q_\w+.weight' is quantized.*'model.layers.0.self_attn.q_\w+'.*"
            "modules_to_not_convert",
        ),
        (
            None,
            _set(Q + "_scale_inv", np.ones(2, np.float32)),
            rf"'{Q}_scale_inv': expected shape \(1, 2\).*got \(2,\)",
        ),
        (None, _drop(Q + "_scale_inv"), f"{Q}.*F8_E4M3.*no '{Q}_scale_inv'"),
        (None, _set(Q + "_scale_inv", np.ones((1, 1), np.int32)), f"{Q}_scale_inv.*dtype I32"),
        (None, _set(Q, np.ones((8, 16), np.float32)), f"{Q}.*dtype F32, expected F8_E4M3"),
        (
            None,
            _set("model.layers.0.self_attn.extra.weight_scale_inv", np.ones((1, 1), np.float32)),
            "extra.weight_scale_inv.*has no",
        ),
    ],
)
def test_fp8_refusals_name_the_tensor(tmp_path, qc, tamper, match):
    _fp8_checkpoint(tmp_path, quantization_config=qc, tamper=tamper)
    with pytest.raises(ValueError, match=match):
        CausalLM.from_pretrained(tmp_path)


def test_fp8_wrong_scale_shape_says_the_expected_grid(tmp_path):
    _fp8_checkpoint(tmp_path, tamper=_set(Q + "_scale_inv", np.ones((1, 3), np.float32)))
    with pytest.raises(ValueError, match=rf"'{Q}_scale_inv': expected shape \(1, 2\).*got \(1, 3\)"):
        CausalLM.from_pretrained(tmp_path)


G = "model.layers.1.mlp.experts.gate_up_proj"


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda f: f.__setitem__(G + "_scales", f[G + "_scales"][:, :-1]), rf"'{G}_scales': expected shape"),
        (lambda f: f.pop(G + "_scales"), rf"'{G}_blocks' has no '{G}_scales'"),
        (lambda f: f.pop(G + "_blocks"), rf"'{G}_scales' has no '{G}_blocks'"),
        (
            lambda f: f.__setitem__(G + "_blocks", f[G + "_blocks"][..., :8]),
            rf"'{G}_blocks'.*\(experts, rows, groups, 16\)",
        ),
        (lambda f: f.__setitem__(G + "_scales", f[G + "_scales"].astype(np.float32)), rf"'{G}_scales' has dtype F32"),
    ],
)
def test_mxfp4_refusals_name_the_tensor(tmp_path, change, match):
    _gpt_oss_checkpoint(tmp_path, shards=1)
    from npattn.models.hf import open_checkpoint

    config, lazy = open_checkpoint(tmp_path)
    files = {k: (t.numpy() if t.dtype != "BF16" else (_to_bf16_bits(t.numpy()), "BF16")) for k, t in lazy.items()}
    change(files)
    _write(tmp_path / "bad", config, files)
    with pytest.raises(ValueError, match=match):
        CausalLM.from_pretrained(tmp_path / "bad")


def test_mxfp4_in_a_module_not_to_convert_is_refused(tmp_path):
    _gpt_oss_checkpoint(tmp_path, quantization_config=dict(MXFP4, modules_to_not_convert=["model.layers.*.mlp"]))
    with pytest.raises(
        ValueError, match=r"experts.gate_up_proj_blocks.*'model.layers.0.mlp.experts'.*modules_to_not_convert"
    ):
        CausalLM.from_pretrained(tmp_path)


def test_quantization_config_must_be_an_object(tmp_path):
    _gpt_oss_checkpoint(tmp_path, quantization_config="mxfp4")
    with pytest.raises(ValueError, match="quantization_config: expected an object"):
        CausalLM.from_pretrained(tmp_path)
    with open(os.path.join(tmp_path, "config.json")) as f:
        assert json.load(f)["quantization_config"] == "mxfp4"  # nothing written


@pytest.mark.parametrize("kind", ["mxfp4", "fp8"])
def test_a_quantized_checkpoint_into_bfloat16_storage(tmp_path, kind):
    """``weights_dtype="bfloat16"`` on a checkpoint as released (GPT-OSS's MXFP4 experts,
    DeepSeek-V3's FP8 blocks, one tensor per expert): each matrix kept as bfloat16 is the
    dequantized float32 matrix rounded, the rest the float32 model's."""
    from npattn.functional._bfloat16 import BFloat16Array, to_bfloat16_bits

    _gpt_oss_checkpoint(tmp_path) if kind == "mxfp4" else _fp8_checkpoint(tmp_path)
    ref = dict(CausalLM.from_pretrained(tmp_path).named_parameters())
    m = CausalLM.from_pretrained(tmp_path, weights_dtype="bfloat16")
    stored = 0
    for name, p in m.named_parameters():
        if isinstance(p.data, BFloat16Array):
            stored += 1
            np.testing.assert_array_equal(p.data.bits, to_bfloat16_bits(ref[name].data), err_msg=name)
        else:
            np.testing.assert_array_equal(p.data, ref[name].data, err_msg=name)
    assert stored

"""bfloat16 storage (issue 32, item 4): ``CausalLM.from_pretrained(..., weights_dtype="bfloat16")``
keeps the large matrices as bfloat16 bits and computes in float32 — half the bytes, the logits of
a float32 model whose weights were rounded to bfloat16 (round to nearest even, as torch), every
family; inference only (backward, jvp and optimizers refuse it by name, ``to(np.float32)`` trains);
``save_pretrained`` writes the bfloat16 matrices as bfloat16 tensors and the float32 rest as
float32 (the checkpoint is the model); a bfloat16 checkpoint's bits are kept exactly."""

from __future__ import annotations

import json

import numpy as np
import pytest
from _oracles import rel_err

from npattn import no_grad, optim
from npattn.functional._bfloat16 import BFloat16Array, matmul_t, to_bfloat16_bits, widened
from npattn.models import CausalLM
from npattn.models.causal_lm import bfloat16_parameters
from npattn.models.hf import open_safetensors
from npattn.models.tiny import TINY_CONFIGS, tiny_config

# float32 against float32 (rel_err relative to the reference's largest entry): the same values in
# another summation order (the bfloat16 product runs block by block) differ by float32 rounding

FAMILIES = sorted(TINY_CONFIGS)
IDS = np.array([[1, 5, 9, 2, 30, 7, 4], [3, 3, 0, 36, 11, 4, 8]])


def _saved(tmp_path, name="qwen3", seed=0):
    """A float32 model of family ``name`` with every weight moved (norms too), saved: ``(model, dir)``."""
    m = CausalLM(tiny_config(name), rng=seed, dtype=np.float32)
    rng = np.random.default_rng(seed + 1)
    for _, p in m.named_parameters():
        p.data[...] += (rng.standard_normal(p.shape) * 0.1).astype(np.float32)
    m.save_pretrained(tmp_path / name)
    return m, tmp_path / name


def _numpy_rne(x: np.ndarray) -> np.ndarray:
    """bfloat16 rounding to nearest even by its definition, with float64 distances: of the two
    bfloat16 neighbours of each float32 value (its truncation and the next one away from zero),
    the nearer; at a tie the one whose last bit is 0; past the largest finite, inf; a NaN: 0xFFFF
    (as torch writes it)."""
    x = np.asarray(x, np.float32)
    lo = (x.view(np.uint32) >> 16).astype(np.uint16)
    hi = lo + np.uint16(1)
    with np.errstate(invalid="ignore"):
        x64 = x.astype(np.float64)
        lo_f, hi_f = widened(lo).astype(np.float64), widened(hi).astype(np.float64)
    hi_f = np.where(np.isinf(hi_f), np.copysign(2.0**128, x64), hi_f)  # the first value past the largest
    with np.errstate(invalid="ignore"):
        d_lo, d_hi = np.abs(x64 - lo_f), np.abs(hi_f - x64)
    up = (d_hi < d_lo) | ((d_hi == d_lo) & (lo & 1 == 1))
    out = np.where(up, hi, lo)
    return np.where(np.isnan(x), np.uint16(0xFFFF), out)


def _edge_values() -> np.ndarray:
    rng = np.random.default_rng(0)
    with np.errstate(over="ignore", under="ignore"):
        base = (rng.standard_normal(4000) * 10.0 ** rng.integers(-40, 38, 4000)).astype(np.float32)
    bits = rng.integers(0, 2**32, 4000, dtype=np.uint64).astype(np.uint32)
    bits[:100] = 0x7F800001 + rng.integers(0, 2**22, 100).astype(np.uint32)  # NaNs of both signs
    bits[100:200] = bits[:100] | np.uint32(0x80000000)
    ties = ((rng.integers(0, 2**16, 200).astype(np.uint32) << 16) | np.uint32(0x8000)).view(np.float32)
    special = np.array(
        [0.0, -0.0, np.inf, -np.inf, np.nan, 3.4028235e38, -3.4028235e38, 3.3961776e38, 3.3895314e38, 1e-45, 1e-40],
        np.float32,
    )
    return np.concatenate([base, bits.view(np.float32), ties, special])


def _rounded_model(directory, round_bits=to_bfloat16_bits):
    """The float32 model of ``directory`` with ``bfloat16_parameters`` rounded by ``round_bits``."""
    ref = CausalLM.from_pretrained(directory)
    for p in bfloat16_parameters(ref):
        p.data = widened(round_bits(p.data))
    return ref


# -- rounding and widening ---------------------------------------------------------------------
def test_rounding_is_nearest_even():
    x = _edge_values()
    got, want = to_bfloat16_bits(x), _numpy_rne(x)
    np.testing.assert_array_equal(got, want)
    assert to_bfloat16_bits(np.array([np.nan], np.float32))[0] == 0xFFFF


def test_rounding_equals_torch():
    torch = pytest.importorskip("torch")
    x = _edge_values()
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(to_bfloat16_bits(x), want)


def test_widening_is_the_upper_half_of_float32():
    bits = np.random.default_rng(1).integers(0, 2**16, (37, 5), dtype=np.uint16)
    w = widened(bits)
    np.testing.assert_array_equal(w.view(np.uint32), bits.astype(np.uint32) << 16)
    np.testing.assert_array_equal(to_bfloat16_bits(w[np.isfinite(w)]), bits[np.isfinite(w)])


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize(
    "n,rows,cols",
    [(1, 3, 5), (4, 1000, 700), (1, 1500, 600), (2, 3000, 64), (3, 2, 1)]
    + [(1, 4096, 1024), (1, 9001, 64), (1, 2000, 81)]  # decoding: the pairs of bfloat16s, odd columns
    + [(1, 603, 6144), (1, 300, 4622)]  # long rows: 3 segments of each row; a prime half (2311)
    + [(1, 1100, 3072)],  # blocks of 256 rows (a power of 2 above 2**19 / 3072) and a short one a share
)
def test_matmul_t_equals_the_widened_product(n, rows, cols, threads, monkeypatch):
    from npattn.functional import _bfloat16

    monkeypatch.setattr(_bfloat16, "_threads", lambda: threads)
    rng = np.random.default_rng(n + rows)
    w = BFloat16Array(to_bfloat16_bits(rng.standard_normal((rows, cols))))
    x = rng.standard_normal((n, cols)).astype(np.float32)
    want = x.astype(np.float64) @ widened(w.bits).astype(np.float64).T
    assert rel_err(matmul_t(x, w), want, relative_to="max_b") < 1e-6 * np.sqrt(cols)
    assert rel_err(x @ np.asarray(w).T, want, relative_to="max_b") < 1e-6 * np.sqrt(
        cols
    )  # NumPy sees the float32 values


def test_bfloat16_array_has_no_arithmetic_on_its_bits():
    a = BFloat16Array(to_bfloat16_bits(np.array([[1.5, -2.0]])))
    np.testing.assert_array_equal(np.add(a, 1), [[2.5, -1.0]])
    with pytest.raises(TypeError):
        a + 1  # noqa: B018
    with pytest.raises(TypeError):
        a[0] = 1.0  # type: ignore[index]
    with pytest.raises(TypeError, match="bits"):
        BFloat16Array(np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="out"):
        to_bfloat16_bits(np.zeros(4), out=np.zeros(3, np.uint16))


# -- the loaded model --------------------------------------------------------------------------
@pytest.mark.parametrize("name", FAMILIES)
def test_logits_equal_the_rounded_float32_model(tmp_path, name):
    _, d = _saved(tmp_path, name)
    ref = _rounded_model(d, _numpy_rne)
    m = CausalLM.from_pretrained(d, weights_dtype="bfloat16")
    assert m.weights_dtype == "bfloat16" and ref.weights_dtype is None and m.dtype == np.float32
    with no_grad():
        assert rel_err(m(IDS), ref(IDS), relative_to="max_b") < 1e-6
        for i in range(3):  # cached decoding, token by token after a prompt
            step = IDS[:, : 4 + i] if i == 0 else IDS[:, 3 + i : 4 + i]
            got, want = m(step, use_cache=True), ref(step, use_cache=True)
            assert rel_err(got, want, relative_to="max_b") < 1e-6
    stored = {id(p) for p in bfloat16_parameters(m)}
    assert stored and all(isinstance(p.data, BFloat16Array) == (id(p) in stored) for p in m.parameters())
    nf = sum(p.data.nbytes for p in ref.parameters())
    nb = sum(p.data.nbytes for p in m.parameters())
    assert nb == nf - sum(2 * p.data.size for p in bfloat16_parameters(m)) and nb < 0.56 * nf


def test_logits_equal_the_torch_rounded_model(tmp_path):
    torch = pytest.importorskip("torch")

    def torch_bits(a):
        t = torch.from_numpy(np.ascontiguousarray(a, np.float32))
        return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)

    _, d = _saved(tmp_path, "llama")
    ref = _rounded_model(d, torch_bits)
    m = CausalLM.from_pretrained(d, weights_dtype="bfloat16")
    with no_grad():
        assert rel_err(m(IDS), ref(IDS), relative_to="max_b") < 1e-6
    np.testing.assert_array_equal(m.generate(IDS, 5), ref.generate(IDS, 5))


def test_a_bfloat16_checkpoint_keeps_its_bits(tmp_path):
    _, d = _saved(tmp_path, "qwen3")
    m = CausalLM.from_pretrained(d, weights_dtype="bfloat16")
    m.save_pretrained(tmp_path / "bf16")
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    tensors = open_safetensors(tmp_path / "bf16" / "model.safetensors")
    back = CausalLM.from_pretrained(tmp_path / "bf16", weights_dtype="bfloat16")
    for (name, p), (_, q) in zip(m.named_parameters(), back.named_parameters()):
        if isinstance(p.data, BFloat16Array):
            assert tensors[name].dtype == "BF16"
            np.testing.assert_array_equal(q.data.bits, p.data.bits, err_msg=name)
            np.testing.assert_array_equal(q.data.bits, tensors[name]._raw(), err_msg=name)
        else:  # the float32 tensors (norms) are written as held, not rounded: the checkpoint is the model
            assert tensors[name].dtype == "F32"
            np.testing.assert_array_equal(q.data, p.data, err_msg=name)
    plain = CausalLM.from_pretrained(tmp_path / "bf16")  # the same checkpoint into float32
    with no_grad():
        assert rel_err(plain(IDS), back(IDS), relative_to="max_b") < 1e-6


@pytest.mark.parametrize("name", FAMILIES)
def test_transformers_reads_the_bfloat16_checkpoint(tmp_path, name):
    """transformers (float32) reads the saved model with the logits of the model that was saved
    (a float32 checkpoint's norms, not rounded to bfloat16, which moves them by ~1e-3), and of
    both npattn readings of the directory."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    _, d = _saved(tmp_path, name)
    m = CausalLM.from_pretrained(d, weights_dtype="bfloat16")
    m.save_pretrained(tmp_path / "bf16")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "bf16", dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    )
    with torch.no_grad():
        want = hf.eval()(torch.from_numpy(IDS)).logits.numpy()
    plain = CausalLM.from_pretrained(tmp_path / "bf16")
    back = CausalLM.from_pretrained(tmp_path / "bf16", weights_dtype="bfloat16")
    with no_grad():
        assert rel_err(m(IDS), want, relative_to="max_b") < 1e-4  # float32 against float32, two implementations
        assert rel_err(plain(IDS), want, relative_to="max_b") < 1e-4
        assert rel_err(back(IDS), want, relative_to="max_b") < 1e-4


def test_load_state_dict_rounds_into_the_bits(tmp_path):
    src, d = _saved(tmp_path, "llama")
    m = CausalLM.from_pretrained(d, weights_dtype="bfloat16")
    state = {k: v * 0.5 + 0.01 for k, v in src.state_dict().items()}
    m.load_state_dict(state)
    w = m.model.embed_tokens.weight.data
    assert isinstance(w, BFloat16Array)
    np.testing.assert_array_equal(w.bits, to_bfloat16_bits(state["model.embed_tokens.weight"]))


# -- training: refused by name; to(np.float32) trains --------------------------------------------
def test_training_is_refused_by_name(tmp_path):
    _, d = _saved(tmp_path, "llama")
    m = CausalLM.from_pretrained(d, weights_dtype="bfloat16")
    logits = m(IDS)
    dl = np.random.default_rng(0).standard_normal(logits.shape).astype(np.float32)
    with pytest.raises(RuntimeError, match="weights_dtype='bfloat16'"):
        m.backward(dl)
    with pytest.raises(RuntimeError, match="weights_dtype='bfloat16'"):
        m.jvp()
    with pytest.raises(ValueError, match="weights_dtype='bfloat16'"):
        optim.AdamW(m.parameters(), lr=1e-3)
    m.zero_grad()
    assert all(p.grad is None for p in bfloat16_parameters(m))


def test_to_float32_trains_with_the_same_values(tmp_path):
    _, d = _saved(tmp_path, "llama")
    m = CausalLM.from_pretrained(d, weights_dtype="bfloat16")
    ref = _rounded_model(d)
    with no_grad():
        before = m(IDS)
    m.to(np.float32)
    assert m.weights_dtype is None
    logits = m(IDS)
    assert rel_err(logits, before, relative_to="max_b") < 1e-6
    dl = np.random.default_rng(0).standard_normal(logits.shape).astype(np.float32)
    m.backward(dl)
    ref(IDS)
    ref.backward(dl)
    for (name, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
        assert rel_err(p.grad, q.grad, relative_to="max_b") < 1e-5, name


# -- refusals ----------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["float16", "bf16", np.float32, 16])
def test_unknown_weights_dtype_is_refused_by_name(tmp_path, bad):
    with pytest.raises(ValueError, match=r"weights_dtype: expected None or 'bfloat16'"):
        CausalLM.from_pretrained(tmp_path / "nothing-here", weights_dtype=bad)


def test_bfloat16_storage_computes_in_float32(tmp_path):
    _, d = _saved(tmp_path, "llama")
    with pytest.raises(ValueError, match="dtype: weights_dtype='bfloat16' computes in float32"):
        CausalLM.from_pretrained(d, weights_dtype="bfloat16", dtype=np.float64)
    assert CausalLM.from_pretrained(d, weights_dtype="bfloat16", dtype=np.float32).dtype == np.float32


def test_loading_keeps_no_float32_copy(tmp_path, monkeypatch):
    """The loaded model holds its bits and nothing of a float32 copy: no stale fused q/k/v of the
    float32 weights (each attention layer fuses them at build), and a bfloat16 tensor is copied in
    parts (``_COPIED`` bytes, each part's file pages released) with the same bits."""
    from npattn.models import hf

    _, d = _saved(tmp_path, "qwen3")
    m = CausalLM.from_pretrained(d, weights_dtype="bfloat16")
    m.save_pretrained(tmp_path / "bf16")
    monkeypatch.setattr(hf, "_COPIED", 64)  # many parts per tensor
    back = CausalLM.from_pretrained(tmp_path / "bf16", weights_dtype="bfloat16")
    fused = [sub._fused for sub in back.modules() if getattr(sub, "_fused", None) is not None]
    assert all(isinstance(f[0], BFloat16Array) for f in fused)
    with no_grad():
        back(IDS)  # the first forward fuses the bits
    fused = [sub._fused for sub in back.modules() if getattr(sub, "_fused", None) is not None]
    assert fused and all(isinstance(f[0], BFloat16Array) for f in fused)
    for (name, p), (_, q) in zip(m.named_parameters(), back.named_parameters()):
        if isinstance(p.data, BFloat16Array):
            np.testing.assert_array_equal(q.data.bits, p.data.bits, err_msg=name)
    arrays = [v for sub in back.modules() for v in vars(sub).values() if isinstance(v, np.ndarray)]
    assert sum(a.nbytes for a in arrays) < 0.05 * sum(p.data.nbytes for p in back.parameters())


def test_decoding_after_a_fork(monkeypatch):
    """The threads' pool is made again in a forked child (a copy of the parent's has no threads)."""
    import os

    from npattn.functional import _bfloat16

    if not hasattr(os, "fork"):
        pytest.skip("no fork")
    monkeypatch.setattr(_bfloat16, "_threads", lambda: 2)
    w = BFloat16Array(to_bfloat16_bits(np.random.default_rng(0).standard_normal((4096, 256))))
    x = np.ones((1, 256), np.float32)
    want = matmul_t(x, w)  # the pool exists in this process now
    pid = os.fork()
    if pid == 0:  # the child: the same product, through a pool of its own (a stale pool would hang: alarm)
        import signal

        signal.alarm(30)
        ok = np.array_equal(matmul_t(x, w), want)
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("stored", [np.float32, np.float64, np.float16], ids=lambda d: np.dtype(d).name)
def test_a_float_checkpoint_is_rounded_block_by_block(tmp_path, monkeypatch, stored):
    """A float32, float64 or float16 checkpoint into bfloat16 storage: each large matrix is read
    a few values at a time (blocks that end inside rows), each block as float32, then rounded,
    without a float32 copy of the whole tensor: the bits of the whole tensor read as float32
    and rounded (float64 rounded to float32 first, as torch does)."""
    from test_causal_lm_io import LLAMA, _model, _write

    from npattn.models import hf

    src = {k: v.astype(stored) for k, v in _model(LLAMA).state_dict().items()}
    _write(tmp_path / "m", LLAMA, src)
    monkeypatch.setattr(hf, "_COPIED", 4 * 37)  # 37 values a block
    rounded = []
    real = hf.to_bfloat16_bits
    monkeypatch.setattr(hf, "to_bfloat16_bits", lambda x, out=None: rounded.append(x.size) or real(x, out=out))
    m = CausalLM.from_pretrained(tmp_path / "m", weights_dtype="bfloat16")
    assert rounded and max(rounded) == 37  # block by block, never a whole tensor
    for name, p in m.named_parameters():
        want = src[name].astype(np.float32)
        if isinstance(p.data, BFloat16Array):
            np.testing.assert_array_equal(p.data.bits, to_bfloat16_bits(want), err_msg=name)
        else:
            np.testing.assert_array_equal(p.data, want, err_msg=name)

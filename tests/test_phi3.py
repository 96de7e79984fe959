"""Phi-3 / Phi-3.5 / Phi-4-mini (model_type phi3, issue 32 item 3): LongRoPE against transformers'
``ROPE_INIT_FUNCTIONS["longrope"]`` in float64, the reader against ``Phi3Config``, the fused
checkpoint names (``qkv_proj``, ``gate_up_proj``) both ways, and ``CausalLM`` against
``Phi3ForCausalLM`` (eager, float64) on both sides of LongRoPE's switch: logits to 1e-9, every
gradient to 1e-8 (the fused ones as the split parts' rows), cached decoding across the switch as a
transformers forward with a cache, and generate as transformers' generate."""

from __future__ import annotations

import math

import numpy as np
import pytest

from npattn import no_grad
from npattn.functional import rope_frequencies
from npattn.models import CausalLM, config_from_hf
from npattn.models.tiny import tiny_config

SHORT = [1.0, 1.25, 1.5]
LONG = [1.5, 3.0, 6.0]


def _cfg(**changes):
    return tiny_config("phi3", **changes)


# -- LongRoPE ---------------------------------------------------------------------------------
def _hf_longrope(seq_len, **kwargs):
    T = pytest.importorskip("transformers")
    from _hf64 import float64_reference
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    with float64_reference():
        cfg = T.Phi3Config(**kwargs)
        inv, factor = ROPE_INIT_FUNCTIONS["longrope"](cfg, None, seq_len=seq_len)
    assert inv.dtype.itemsize == 8
    return inv.numpy(), factor, cfg.rope_parameters


@pytest.mark.parametrize("seq_len", [None, 1, 16, 17, 100])
@pytest.mark.parametrize(
    "extra",
    [{}, {"factor": 3.0}, {"attention_factor": 0.7}, {"factor": 0.5}],
    ids=["factor_from_lengths", "factor", "attention_factor", "factor_below_1"],
)
def test_longrope_matches_transformers_in_float64(seq_len, extra):
    rng = np.random.default_rng(0)
    short, long = list(1 + rng.random(6)), list(1 + 5 * rng.random(6))
    scaling = dict(rope_type="longrope", short_factor=short, long_factor=long, **extra)
    ref, ref_factor, params = _hf_longrope(
        seq_len,
        hidden_size=64,
        num_attention_heads=4,
        partial_rotary_factor=0.75,
        max_position_embeddings=64,
        original_max_position_embeddings=16,
        rope_theta=500.0,
        rope_scaling=scaling,
    )
    mine, factor = rope_frequencies(16, scaling=dict(params, max_position_embeddings=64), seq_len=seq_len)
    np.testing.assert_allclose(mine, ref, rtol=1e-15, atol=0)  # the powers to the last bit or so
    assert factor == ref_factor
    uses_long = seq_len is not None and seq_len > 16
    base = 1.0 / 500.0 ** (np.arange(0, 12, 2) / 12)
    np.testing.assert_allclose(mine, base / np.array(long if uses_long else short), rtol=1e-15)
    if not extra:  # 64 / 16 = 4: sqrt(1 + ln 4 / ln 16) = sqrt(1.5)
        assert factor == pytest.approx(math.sqrt(1.5), rel=1e-15)


def test_longrope_rotates_by_its_factors_in_rope():
    """F.rope picks the factors from the largest position (+1), as dynamic_rope_update does."""
    from npattn import functional as F

    x = np.random.default_rng(1).standard_normal((5, 8))
    s = dict(rope_type="longrope", short_factor=SHORT, long_factor=LONG, original_max_position_embeddings=4, factor=1.0)
    for positions, long in ((np.arange(4), False), (np.arange(5), True), (np.array([9]), True), (np.array([3]), False)):
        y, _ = F.rope(x[: len(positions)], positions, scaling=s, rotary_dim=6)
        inv = 1.0 / (np.array(LONG if long else SHORT) * 10000.0 ** (np.arange(0, 6, 2) / 6))
        angle = positions[:, None] * inv
        a, b = x[: len(positions), :3], x[: len(positions), 3:6]
        np.testing.assert_allclose(y[:, :3], a * np.cos(angle) - b * np.sin(angle), rtol=1e-13, atol=1e-15)
        assert np.array_equal(y[:, 6:], x[: len(positions), 6:])


@pytest.mark.parametrize(
    "bad,key,exc",
    [
        ({"short_factor": [1.0, 1.0]}, "short_factor", ValueError),
        ({"long_factor": [1.0] * 4}, "long_factor", ValueError),
        ({"long_factor": None}, "long_factor", ValueError),
        ({"short_factor": None}, "short_factor", ValueError),
        ({"short_factor": [1.0, -1.0, 1.0]}, "short_factor", ValueError),
        ({"long_factor": "1,2,3"}, "long_factor", TypeError),
        ({"original_max_position_embeddings": None, "factor": 1.0}, "original_max_position_embeddings", ValueError),
        ({"beta_fast": 32.0}, "beta_fast", ValueError),
    ],
)
def test_bad_longrope_dicts_are_refused_naming_the_key(bad, key, exc):
    s = dict(rope_type="longrope", short_factor=SHORT, long_factor=LONG, original_max_position_embeddings=4, factor=2.0)
    s.update(bad)
    with pytest.raises(exc, match=key):
        rope_frequencies(8, scaling=dict(s, partial_rotary_factor=0.75))


def test_longrope_without_factor_needs_the_lengths():
    s = dict(rope_type="longrope", short_factor=SHORT, long_factor=LONG, original_max_position_embeddings=4)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        rope_frequencies(6, scaling=s)
    assert rope_frequencies(6, scaling=dict(s, max_position_embeddings=16))[1] == pytest.approx(math.sqrt(2.0))


# -- the reader -------------------------------------------------------------------------------
def test_reader_reads_phi3_as_transformers():
    """su/yarn mean longrope; Phi3Config's top-level original_max_position_embeddings (4096 when
    absent) takes the place of the dict's own; partial rotary; the window on every layer."""
    T = pytest.importorskip("transformers")
    for kind, top, want in [
        ("longrope", {}, 4096),  # the top-level field's default wins over the dict's 2
        ("longrope", {"original_max_position_embeddings": 4}, 4),
        ("yarn", {"original_max_position_embeddings": 4}, 4),
        ("su", {"original_max_position_embeddings": 4}, 2),  # standardization skips "su": the dict's
    ]:
        scaling = {"type": kind, "short_factor": SHORT, "long_factor": LONG, "original_max_position_embeddings": 2}
        d = _cfg(rope_scaling=scaling, **top)
        if not top:
            d.pop("original_max_position_embeddings")
        c = config_from_hf(d)
        ref = T.Phi3Config(**{k: v for k, v in d.items() if k != "model_type"}).rope_parameters
        rope = c.rope["default"]
        assert rope["rope_type"] == ref["rope_type"] == "longrope"
        assert rope["original_max_position_embeddings"] == ref["original_max_position_embeddings"] == want, kind
        assert list(rope["short_factor"]) == SHORT and rope["partial_rotary_factor"] == 0.75
    with pytest.raises(ValueError, match="original_max_position_embeddings"):  # transformers: KeyError
        config_from_hf(_cfg(rope_scaling={"type": "su", "short_factor": SHORT, "long_factor": LONG}))
    phi4_keys = dict(lm_head_bias=False, full_attn_mod=1, interpolate_factor=1, mlp_bias=False, attention_bias=False)
    assert config_from_hf(_cfg(**phi4_keys)) == config_from_hf(_cfg())  # Phi-4-mini's config.json has them
    c = config_from_hf(_cfg(sliding_window=3))
    assert c.layer_types == ("sliding_attention",) * 2 and c.sliding_window == 3
    assert config_from_hf(_cfg()).layer_types == ("full_attention",) * 2
    short = {k: v for k, v in _cfg().items() if k not in ("rms_norm_eps", "hidden_act", "resid_pdrop")}
    full = T.AutoConfig.for_model(**short).to_dict()
    meta = dict(bos_token_id=None, eos_token_id=None, max_position_embeddings=None)
    assert config_from_hf(short).replace(**meta) == config_from_hf(full).replace(**meta)


@pytest.mark.parametrize(
    "change,key",
    [
        ({"resid_pdrop": 0.1}, "resid_pdrop"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_type"),
        ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": LONG}}, "short_factor"),
        ({"rope_scaling": {"rope_type": "longrope", "short_factor": SHORT}}, "long_factor"),
        ({"original_max_position_embeddings": 0}, "original_max_position_embeddings"),
        ({"some_phi_option": 1}, "some_phi_option"),
        ({"lm_head_bias": True}, "lm_head_bias"),
        ({"full_attn_mod": 2}, "full_attn_mod"),
        ({"interpolate_factor": 4}, "interpolate_factor"),
    ],
)
def test_reader_refuses_naming_the_key(change, key):
    with pytest.raises(ValueError, match=key):
        config_from_hf(_cfg(**change))


# -- the fused checkpoint names ----------------------------------------------------------------
def _model(seed=0, **changes):
    m = CausalLM(_cfg(**changes), rng=seed)
    rng = np.random.default_rng(seed + 1)
    for _, p in m.named_parameters():
        p.data[...] += rng.standard_normal(p.shape) * 0.1
    return m


def _fused(sd):
    """A split state dict under Phi-3's checkpoint names."""
    out = dict(sd)
    for i in range(2):
        p = f"model.layers.{i}."
        out[p + "self_attn.qkv_proj.weight"] = np.concatenate(
            [out.pop(p + f"self_attn.{n}_proj.weight") for n in "qkv"]
        )
        out[p + "mlp.gate_up_proj.weight"] = np.concatenate(
            [out.pop(p + f"mlp.{n}_proj.weight") for n in ("gate", "up")]
        )
    return out


def test_fused_and_split_names_both_load():
    m = _model()
    sd = m.state_dict()
    assert "model.layers.0.self_attn.q_proj.weight" in sd and "model.layers.0.mlp.gate_proj.weight" in sd
    ids = np.array([[1, 5, 9, 2, 30, 7, 3]])
    with no_grad():
        want = m(ids)
        for src in (sd, _fused(sd)):
            got = CausalLM.from_hf(src, m.config)
            assert list(got.state_dict()) == list(sd)
            for k, v in got.state_dict().items():
                assert np.array_equal(v, sd[k]), k
            assert np.array_equal(got(ids), want)


def test_save_pretrained_writes_the_fused_names(tmp_path):
    from npattn.models.hf import open_checkpoint

    m = _model()
    m.save_pretrained(tmp_path)
    _, tensors = open_checkpoint(tmp_path)
    want = _fused(m.state_dict())
    assert set(tensors) == set(want)
    for k, v in want.items():
        assert np.array_equal(tensors[k].numpy(), v), k
    bf = CausalLM.from_pretrained(tmp_path, weights_dtype="bfloat16")
    bf.save_pretrained(tmp_path / "bf16")
    again = CausalLM.from_pretrained(tmp_path / "bf16", weights_dtype="bfloat16")
    with no_grad():
        ids = np.array([[1, 5, 9, 2, 30, 7]])
        assert np.array_equal(again(ids), bf(ids))
        np.testing.assert_allclose(bf(ids), m(ids), rtol=0, atol=0.05 * np.abs(m(ids)).max())


@pytest.mark.parametrize("weights_dtype", [None, "bfloat16"])
def test_a_fused_tensor_is_read_part_by_part_from_the_file(tmp_path, monkeypatch, weights_dtype):
    """Each part of a fused safetensors tensor reads its own rows' bytes (``LazyTensor.rows``):
    the whole fused tensor is never converted, once per part, as a dequantized GGUF one is."""
    from npattn.models.hf import LazyTensor

    m = _model()
    store = m.save_pretrained if weights_dtype is None else _bf16_saver(m)
    store(tmp_path)
    whole, parts = [], []
    numpy = LazyTensor.numpy
    monkeypatch.setattr(LazyTensor, "numpy", lambda self, dtype=None: whole.append(self.name) or numpy(self, dtype))
    for method in ("read_into", "read_bits_into"):  # float32, or bfloat16 bits as stored
        real = getattr(LazyTensor, method)
        spy = lambda self, out, real=real: parts.append((self.name, self.shape)) or real(self, out)  # noqa: E731
        monkeypatch.setattr(LazyTensor, method, spy)
    loaded = CausalLM.from_pretrained(tmp_path, weights_dtype=weights_dtype)
    fused = [n for n in whole if n.endswith(("qkv_proj.weight", "gate_up_proj.weight"))]
    assert fused == []
    q_rows = m.config.num_attention_heads * m.config.head_dim
    assert ("model.layers.0.self_attn.qkv_proj.weight", (q_rows, m.config.hidden_size)) in parts
    with no_grad():
        ids = np.array([[1, 5, 9, 2, 30, 7]])
        want = m(ids) if weights_dtype is None else CausalLM.from_pretrained(tmp_path, weights_dtype=None)(ids)
        np.testing.assert_allclose(loaded(ids), want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


def _bf16_saver(m):
    from npattn.models.causal_lm import store_bfloat16

    def save(path):
        store_bfloat16(m)
        m.save_pretrained(path)

    return save


@pytest.mark.parametrize(
    "edit,match",
    [
        (
            lambda sd: sd.pop("model.layers.1.self_attn.qkv_proj.weight"),
            "missing key 'model.layers.1.self_attn.qkv_proj",
        ),
        (lambda sd: sd.pop("model.layers.0.mlp.gate_up_proj.weight"), "missing key 'model.layers.0.mlp.gate_up_proj"),
        (
            lambda sd: sd.update({"model.layers.0.self_attn.qkv_proj.weight": np.zeros((31, 16))}),
            r"state_dict\['model.layers.0.self_attn.qkv_proj.weight'\]: expected shape \(32, 16\)",
        ),
        (
            lambda sd: sd.update({"model.layers.1.mlp.gate_up_proj.weight": np.zeros((48, 15))}),
            r"state_dict\['model.layers.1.mlp.gate_up_proj.weight'\]",
        ),
        (
            lambda sd: sd.update({"model.layers.0.self_attn.k_proj.weight": np.zeros((8, 16))}),
            "both 'model.layers.0.self_attn.qkv_proj.weight' and 'model.layers.0.self_attn.k_proj.weight'",
        ),
        (
            lambda sd: sd.update({"model.layers.2.self_attn.qkv_proj.weight": np.zeros((32, 16))}),
            "unexpected key 'model.layers.2.self_attn.qkv_proj.weight'",
        ),
    ],
)
def test_bad_fused_tensors_are_refused_by_name(edit, match):
    m = _model()
    sd = _fused(m.state_dict())
    edit(sd)
    with pytest.raises(ValueError, match=match):
        CausalLM.from_hf(sd, m.config)


# -- against Phi3ForCausalLM -------------------------------------------------------------------
def _hf(seed=0, **changes):
    T = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from _hf64 import build, state_dict

    kwargs = {k: v for k, v in _cfg(**changes).items() if k != "model_type"}
    hf, cfg = build(T.Phi3Config, T.Phi3ForCausalLM, seed=seed, **kwargs)
    return hf, cfg, CausalLM.from_hf(state_dict(hf), cfg)


def _split_grads(ref: dict, cfg) -> dict:
    """transformers' gradients under npattn's names (the fused ones' rows per part)."""
    q = cfg["num_attention_heads"] * 8
    kv = cfg["num_key_value_heads"] * 8
    out = {}
    for k, g in ref.items():
        if k.endswith("qkv_proj.weight"):
            p = k[: -len("qkv_proj.weight")]
            out[p + "q_proj.weight"], out[p + "k_proj.weight"], out[p + "v_proj.weight"] = np.split(g, [q, q + kv])
        elif k.endswith("gate_up_proj.weight"):
            p = k[: -len("gate_up_proj.weight")]
            out[p + "gate_proj.weight"], out[p + "up_proj.weight"] = np.split(g, 2)
        else:
            out[k] = g
    return out


@pytest.mark.parametrize("length", [3, 4, 5, 9])  # original_max_position_embeddings 4: short, short, long, long
@pytest.mark.parametrize("window", [None, 3])
def test_logits_and_every_gradient_match_transformers(length, window):
    from _hf64 import check_logits_and_grads

    hf, cfg, m = _hf(sliding_window=window)
    ids = np.random.default_rng(length).integers(0, cfg["vocab_size"], (2, length))
    dlogits = np.random.default_rng(1).standard_normal(ids.shape + (cfg["vocab_size"],))
    check_logits_and_grads(m, hf, ids, dlogits, grads=lambda ref: _split_grads(ref, cfg))


def test_cached_decoding_across_the_switch_is_transformers_cached_forward():
    """Prompt of 3 (short factors), then one token at a time past original (4): each call's
    frequencies follow its largest position, the cached keys keep theirs, as transformers'
    forward with a DynamicCache; this differs from the full pass (the long factors for all)."""
    torch = pytest.importorskip("torch")
    DynamicCache = pytest.importorskip("transformers").DynamicCache
    from _hf64 import float64_reference
    from _oracles import rel_err

    hf, cfg, m = _hf()
    ids = np.random.default_rng(3).integers(0, cfg["vocab_size"], (2, 8))
    cache = DynamicCache(config=hf.config)
    ref = []
    with float64_reference(), torch.no_grad():
        ref.append(hf(input_ids=torch.from_numpy(ids[:, :3]), cache=cache, use_cache=True).logits.numpy())
        for t in range(3, 8):
            ref.append(hf(input_ids=torch.from_numpy(ids[:, t : t + 1]), cache=cache, use_cache=True).logits.numpy())
        full = hf(input_ids=torch.from_numpy(ids), use_cache=False).logits.numpy()
    ref = np.concatenate(ref, axis=1)
    m.reset_kv_cache()
    with no_grad():
        got = np.concatenate(
            [m(ids[:, :3], use_cache=True)] + [m(ids[:, t : t + 1], use_cache=True) for t in range(3, 8)], 1
        )
        mine_full = m(ids)
    assert rel_err(got, ref, floor=1e-300, relative_to="max_b") < 1e-9
    assert rel_err(mine_full, full, floor=1e-300, relative_to="max_b") < 1e-9
    assert rel_err(got[:, 4:], full[:, 4:], floor=1e-300, relative_to="max_b") > 1e-3  # the switch shows
    assert m.reencode_length == 5


def test_generate_reencodes_at_the_switch_as_transformers():
    """Greedy decoding from a prompt of 2 through the switch (length 5): transformers' generate
    drops its cache there (Phi3ForCausalLM.prepare_inputs_for_generation) and so does ours; the
    tokens are those of full passes."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from _hf64 import float64_reference

    hf, cfg, m = _hf(seed=2)
    prompt = np.array([[3, 17], [5, 8]])
    with float64_reference(), torch.no_grad():
        ref = hf.generate(
            torch.from_numpy(prompt), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
        ).numpy()
    out = m.generate(prompt, 8, eos_token_id=[])
    np.testing.assert_array_equal(out[:, : ref.shape[1]], ref)
    with no_grad():  # every step's token is the full pass's arg-max
        for t in range(2, out.shape[1]):
            np.testing.assert_array_equal(m(out[:, :t])[:, -1].argmax(-1), out[:, t])


@pytest.mark.parametrize("length", [4, 5])
def test_reference_rope_agrees_on_longrope(length):
    """The textbook tier (functional.reference) computes LongRoPE pair by pair as the fast one."""
    from npattn import functional as F
    from npattn.functional import reference as R

    x = np.random.default_rng(2).standard_normal((2, length, 8))
    s = dict(
        rope_type="longrope",
        short_factor=SHORT,
        long_factor=LONG,
        original_max_position_embeddings=4,
        max_position_embeddings=16,
        partial_rotary_factor=0.75,
    )
    ref, _ = R.rope(x, scaling=s)
    fast, _ = F.rope(x, scaling=s)
    np.testing.assert_allclose(ref, fast, rtol=0, atol=1e-14)
    norms = np.linalg.norm(fast[..., :6], axis=-1) / np.linalg.norm(x[..., :6], axis=-1)
    np.testing.assert_allclose(norms, math.sqrt(2.0), rtol=1e-14)  # factor 16 / 4: sqrt(1 + ln 4 / ln 4)

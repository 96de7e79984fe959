"""``MultiHeadLatentAttention`` on its own: gradients against central differences, the absorbed form
equal to the plain one (outputs and every gradient), latent-cache decoding equal to the full pass,
the cache's size, float32, and refused arguments.  (Against Hugging Face's ``DeepseekV3Attention``:
``test_latent_attention_hf.py``.)"""

import numpy as np
import pytest
from _fd import fd_gradients
from _oracles import rel_err
from hypothesis import given, settings

import npattn
from npattn.nn.latent_attention import kv_cache_bytes_per_token
from npattn.testing import latent_attention_configs

D, H = 12, 3
DIMS = {"kv_lora_rank": 5, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 3}
CONFIGS = {
    "q_proj": {},
    "q_lora": {"q_lora_rank": 6},
    "q_lora_bias": {"q_lora_rank": 6, "attention_bias": True},
    "rotate_half_bias": {"rope_interleave": False, "attention_bias": True},
    "not_causal": {"causal": False, "q_lora_rank": 6},
    "yarn": {
        "q_lora_rank": 6,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "mscale": 0.9,
            "mscale_all_dim": 0.7,
            "original_max_position_embeddings": 4,
            "beta_fast": 4.0,
            "beta_slow": 1.0,
        },
    },
}


def make(cfg="q_lora_bias", seed=0, dtype=np.float64, **extra):
    kw = {**DIMS, **CONFIGS[cfg], **extra}
    m = npattn.MultiHeadLatentAttention(D, H, rng=seed, dtype=dtype, **kw)
    rng = np.random.default_rng(seed + 100)
    for name, p in m.named_parameters():  # the norms away from ones, so their gradients matter
        if "layernorm" in name:
            p.data = rng.uniform(0.5, 1.5, p.shape).astype(dtype)
    return m


def grads(m, x, dy, **kw):
    """Output, dx and every parameter gradient of one forward/backward (grads zeroed first)."""
    m.zero_grad()
    y = m(x, **kw)
    dx = m.backward(dy)
    return y, dx, {n: p.grad.copy() for n, p in m.named_parameters()}


def close(a, b, tol=1e-12):
    """max |a - b| <= tol * max |b| (relative to the array's scale, not element by element)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a - b).max(initial=0.0)) <= tol * max(float(np.abs(b).max(initial=0.0)), 1e-300)


def data(shape, seed=1):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape), rng.standard_normal(shape)


# -- gradients -----------------------------------------------------------------------------
@pytest.mark.parametrize("absorb", [False, True])
@pytest.mark.parametrize("cfg", sorted(CONFIGS))
def test_gradcheck(cfg, absorb):
    m = make(cfg)
    x, _ = data((2, 4, D))
    report = npattn.gradcheck(m, x, absorb=absorb)
    assert report.ok, str(report)


def test_central_differences_independent_of_gradcheck():
    """Every gradient against tests/_fd.py's own central differences (no npattn.gradcheck)."""
    m = make("q_lora_bias")
    x, dy = data((2, 4, D), seed=3)
    _, dx, g = grads(m, x, dy)
    params = dict(m.named_parameters())
    names = list(params)

    def loss(x_, *ps):
        for n, v in zip(names, ps):
            params[n].data = v
        with npattn.no_grad():  # forwards whose backward never comes keep no state
            return np.sum(m(x_) * dy)

    num = fd_gradients(loss, [x] + [params[n].data for n in names])
    assert rel_err(dx, num[0]) < 1e-5
    for n, gn in zip(names, num[1:]):
        assert rel_err(g[n], gn) < 1e-5, n


def test_gradcheck_with_masks_and_positions():
    m = make("q_lora")
    x, _ = data((2, 4, D))
    rng = np.random.default_rng(7)
    bool_mask = rng.random((2, 1, 4, 4)) < 0.7
    bool_mask[..., np.arange(4), np.arange(4)] = True
    float_mask = rng.normal(0, 1, (H, 4, 4))
    positions = np.array([[3, 5, 6, 9], [0, 1, 2, 3]])
    for kw in ({"attn_mask": bool_mask}, {"attn_mask": float_mask}, {"positions": positions}):
        for absorb in (False, True):
            report = npattn.gradcheck(m, x, absorb=absorb, **kw)
            assert report.ok, (kw, str(report))


# -- the absorbed form ------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", sorted(CONFIGS))
@pytest.mark.parametrize("shape", [(2, 5, D), (5, D), (2, 3, 4, D)])
def test_absorbed_equals_plain(cfg, shape):
    """Queries through W_uk and attention over latents then W_uv: the plain layer's outputs and
    every gradient (input and parameters) to 1e-12."""
    m = make(cfg)
    x, dy = data(shape)
    y, dx, g = grads(m, x, dy)
    ya, dxa, ga = grads(m, x, dy, absorb=True)
    assert close(ya, y)
    assert close(dxa, dx)
    for n in g:
        assert close(ga[n], g[n]), n


@settings(max_examples=25, deadline=None)
@given(case=latent_attention_configs())
def test_absorbed_equals_plain_and_cache_equals_full_property(case):
    """Over random sizes, query forms, RoPE layouts and scalings, biases and batch axes: the
    absorbed form gives the plain one's output and every gradient, and token-by-token decoding
    with the latent cache gives the full pass."""
    m = case.module()
    y, dx, g = grads(m, case.x, case.dy)
    ya, dxa, ga = grads(m, case.x, case.dy, absorb=True)
    assert close(ya, y) and close(dxa, dx)
    assert all(close(ga[n], g[n]) for n in g)
    m.reset_kv_cache()
    steps = [m(case.x[..., i : i + 1, :], use_cache=True) for i in range(case.x.shape[-2])]
    assert close(np.concatenate(steps, axis=-2), y)


@settings(max_examples=10, deadline=None)
@given(case=latent_attention_configs(max_len=3, max_dim=3))
def test_gradcheck_property(case):
    report = npattn.gradcheck(case.module(), case.x, fast=True)
    assert report.ok, str(report)


# -- latent cache ---------------------------------------------------------------------------
SPLITS = {"token_by_token": [1] * 7, "prefill_then_decode": [4, 1, 1, 1], "chunks": [2, 3, 2]}


def decode(m, x, split, **kw):
    m.reset_kv_cache()
    outs, i = [], 0
    for n in split:
        outs.append(m(x[..., i : i + n, :], use_cache=True, **kw))
        i += n
    assert m.kv_cache_length == i
    return np.concatenate(outs, axis=-2)


@pytest.mark.parametrize("absorb", [None, False])
@pytest.mark.parametrize("split", sorted(SPLITS))
@pytest.mark.parametrize("cfg", ["q_proj", "q_lora_bias", "rotate_half_bias", "yarn"])
def test_cached_decoding_equals_full_pass(cfg, split, absorb):
    m = make(cfg)
    x, _ = data((2, 7, D))
    full = m(x)
    kw = {} if absorb is None else {"absorb": absorb}
    assert close(decode(m, x, SPLITS[split], **kw), full)


@pytest.mark.parametrize("shape", [(7, D), (2, 3, 7, D)])
def test_cached_decoding_any_batch_axes(shape):
    m = make("q_lora")
    x, _ = data(shape)
    assert close(decode(m, x, [3, 1, 1, 2]), m(x))


def test_cached_decoding_with_mask():
    """A mask over every cached key (T + L columns) acts as in the full pass."""
    m = make("q_lora")
    x, _ = data((2, 5, D))
    allowed = np.random.default_rng(4).random((2, 1, 5, 5)) < 0.6
    allowed[..., np.arange(5), np.arange(5)] = True
    full = m(x, attn_mask=allowed)
    m.reset_kv_cache()
    steps = [m(x[:, i : i + 1], use_cache=True, attn_mask=allowed[..., i : i + 1, : i + 1]) for i in range(5)]
    assert close(np.concatenate(steps, axis=1), full)


def test_cache_holds_latent_and_rope_key_only():
    m = make("q_lora")
    x, _ = data((2, 6, D))
    m(x, use_cache=True)
    cache = m._kv_cache
    r, dr = DIMS["kv_lora_rank"], DIMS["qk_rope_head_dim"]
    assert cache.k.shape[:-2] == (2, 1) and cache.k.shape[-1] == r + dr and cache.v.shape[-1] == 0
    per_token = (cache.k[..., : cache.length, :].nbytes + cache.v.nbytes) // (2 * cache.length)
    assert per_token == m.cache_bytes_per_token() == (r + dr) * 8
    # what it holds: the normalised latent and the rotated key of each token
    c = m.kv_a_layernorm(m.kv_a_proj_with_mqa(x)[..., :r])
    np.testing.assert_allclose(cache.k[:, 0, :6, :r], c, rtol=0, atol=1e-14)
    m.reset_kv_cache()
    assert m.kv_cache_length == 0 and m._kv_cache is None


def test_cached_call_keeps_no_backward_state():
    m = make("q_lora")
    x, dy = data((2, 3, D))
    m(x, use_cache=True)
    with pytest.raises(RuntimeError):
        m.backward(dy)
    for sub, width in ((m.q_b_proj, H * 8), (m.kv_a_layernorm, DIMS["kv_lora_rank"]), (m.o_proj, D)):
        with pytest.raises(RuntimeError):  # nor do the submodules
            sub.backward(np.ones((2, 3, width)))


def test_positions_shift_leaves_output_unchanged():
    """RoPE scores depend on position differences only: shifting every position is a no-op."""
    m = make("q_lora")
    x, _ = data((2, 5, D))
    y = m(x)
    assert close(m(x, positions=np.arange(5) + 11), y)
    assert np.array_equal(m(x, positions=np.arange(5)), y)


def test_cache_comparison():
    m = make("q_lora")
    r, dn, dr, dv = DIMS["kv_lora_rank"], DIMS["qk_nope_head_dim"], DIMS["qk_rope_head_dim"], DIMS["v_head_dim"]
    c = m.cache_comparison()
    assert c["mla"] == (r + dr) * 8
    assert c["mha"] == H * (dn + dr + dv) * 8
    assert c["gqa_kv_heads"] == 1 and c["gqa"] == (dn + dr + dv) * 8
    assert c["mha_over_mla"] == c["mha"] / c["mla"]
    assert m.cache_comparison(3)["gqa"] == c["mha"]
    m32 = make("q_lora", dtype=np.float32)
    assert m32.cache_bytes_per_token() == (r + dr) * 4
    assert kv_cache_bytes_per_token(8, 128, 128, np.float32) == 8 * 256 * 4


# -- float32, structure ---------------------------------------------------------------------
def test_float32_end_to_end():
    m64, m32 = make("q_lora_bias"), make("q_lora_bias", dtype=np.float32)
    x, dy = data((2, 4, D))
    y, dx, g = grads(m32, x.astype(np.float32), dy.astype(np.float32), absorb=True)
    y64, dx64, g64 = grads(m64, x, dy)
    assert y.dtype == dx.dtype == np.float32 and all(v.dtype == np.float32 for v in g.values())
    assert close(y, y64, 1e-5) and close(dx, dx64, 1e-5)
    assert all(close(g[n], g64[n], 1e-5) for n in g)
    assert m32(x.astype(np.float32), use_cache=True).dtype == np.float32
    bias = np.random.default_rng(3).normal(0, 1, (4, 4))  # a float64 mask keeps the module float32
    y = m32(x.astype(np.float32), attn_mask=bias)
    assert y.dtype == np.float32 and close(y, m64(x, attn_mask=bias), 1e-5)


def test_parameters_names_shapes_and_seed():
    m = make("q_lora_bias")
    shapes = {n: p.shape for n, p in m.named_parameters()}
    r, dn, dr, dv = DIMS["kv_lora_rank"], DIMS["qk_nope_head_dim"], DIMS["qk_rope_head_dim"], DIMS["v_head_dim"]
    assert shapes == {
        "q_a_proj.weight": (6, D),
        "q_a_proj.bias": (6,),
        "q_a_layernorm.weight": (6,),
        "q_b_proj.weight": (H * (dn + dr), 6),
        "kv_a_proj_with_mqa.weight": (r + dr, D),
        "kv_a_proj_with_mqa.bias": (r + dr,),
        "kv_a_layernorm.weight": (r,),
        "kv_b_proj.weight": (H * (dn + dv), r),
        "o_proj.weight": (D, H * dv),
        "o_proj.bias": (D,),
    }
    assert sorted(n for n, _ in make("q_proj").named_parameters()) == sorted(
        ["q_proj.weight", "kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight"]
    )
    a, b = make("q_lora", seed=5).state_dict(), make("q_lora", seed=5).state_dict()
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert "kv_lora_rank=5" in repr(make())


def test_yarn_scales_scores_and_rotation():
    """YaRN's mscale(factor, mscale_all_dim)**2 on the softmax scale; the rotation is rope's."""
    m = make("yarn")
    m_all = 0.1 * 0.7 * np.log(4.0) + 1.0
    assert np.isclose(m.scaling, (4 + 4) ** -0.5 * m_all**2, rtol=1e-15)
    assert m.rope_scaling["rope_type"] == "yarn" and m.rope_theta == 10000.0


def test_from_config():
    cfg = {
        "hidden_size": D,
        "num_attention_heads": H,
        "num_key_value_heads": H,
        "q_lora_rank": None,
        "attention_bias": True,
        "rope_interleave": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 50.0},
        **DIMS,
    }
    m = npattn.MultiHeadLatentAttention.from_config(cfg, rng=0)
    assert m.rope_theta == 50.0 and not m.rope_interleave and m.attention_bias and m.q_lora_rank is None
    assert m.rms_norm_eps == 1e-6 and m.scaling == (DIMS["qk_nope_head_dim"] + DIMS["qk_rope_head_dim"]) ** -0.5
    old = {k: v for k, v in cfg.items() if k != "rope_parameters"} | {"rope_theta": 70.0, "rope_scaling": None}
    assert npattn.MultiHeadLatentAttention.from_config(old).rope_theta == 70.0


# -- refused arguments ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, exc, words",
    [
        ({"hidden_size": 0}, ValueError, "hidden_size"),
        ({"hidden_size": 2.0}, TypeError, "hidden_size"),
        ({"num_heads": True}, TypeError, "num_heads"),
        ({"kv_lora_rank": 0}, ValueError, "kv_lora_rank"),
        ({"qk_nope_head_dim": None}, TypeError, "qk_nope_head_dim"),
        ({"qk_rope_head_dim": 3}, ValueError, "qk_rope_head_dim"),
        ({"qk_rope_head_dim": 0}, ValueError, "qk_rope_head_dim"),
        ({"v_head_dim": -1}, ValueError, "v_head_dim"),
        ({"q_lora_rank": 0}, ValueError, "q_lora_rank"),
        ({"q_lora_rank": "8"}, TypeError, "q_lora_rank"),
        ({"rms_norm_eps": 0.0}, ValueError, "rms_norm_eps"),
        ({"rms_norm_eps": "1e-6"}, TypeError, "rms_norm_eps"),
        ({"attention_bias": 1}, TypeError, "attention_bias"),
        ({"rope_theta": -1.0}, ValueError, "rope_theta"),
        ({"rope_scaling": "yarn"}, TypeError, "rope_scaling"),
        ({"rope_theta": 7.0, "rope_scaling": {"rope_type": "default", "rope_theta": 5.0}}, ValueError, "rope_theta"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}}, ValueError, "partial"),
        ({"rope_scaling": {"rope_type": "mystery"}}, ValueError, "rope_type"),
        ({"rope_scaling": {"rope_type": "yarn"}}, ValueError, "rope_scaling"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 0.0}}, ValueError, "rope_scaling"),
        ({"rope_interleave": None}, TypeError, "rope_interleave"),
        ({"causal": "yes"}, TypeError, "causal"),
        ({"dtype": np.float16}, TypeError, "dtype"),
        ({"dtype": np.int32}, TypeError, "dtype"),
        ({"rng": "seed"}, TypeError, "rng"),
    ],
)
def test_bad_constructor_arguments(kw, exc, words):
    args = {"hidden_size": D, "num_heads": H, **DIMS}
    args.update(kw)
    with pytest.raises(exc, match=words):
        npattn.MultiHeadLatentAttention(args.pop("hidden_size"), args.pop("num_heads"), **args)


def test_bad_forward_arguments():
    m = make("q_lora")
    x, _ = data((2, 4, D))
    cases = [
        ({"x": x[..., :-1]}, ValueError, "x: expected shape"),
        ({"x": x[0, 0]}, ValueError, "x: expected shape"),
        ({"x": x > 0}, TypeError, "x"),
        ({"x": x.astype(np.complex128)}, TypeError, "x"),
        ({"positions": np.arange(4.0)}, TypeError, "positions"),
        ({"positions": np.arange(5)}, ValueError, r"positions: expected a shape broadcastable to \(2, 4\) .* \(5,\)"),
        ({"positions": np.zeros((3, 2, 4), int)}, ValueError, r"positions: .* got \(3, 2, 4\)"),  # would widen x
        ({"attn_mask": np.ones((4, 4), np.int64)}, TypeError, "attn_mask"),
        ({"attn_mask": np.ones((5, 4), bool)}, ValueError, "attn_mask"),
        ({"attn_mask": np.full((4, 4), np.nan)}, ValueError, "attn_mask"),
        ({"use_cache": 1}, TypeError, "use_cache"),
        ({"absorb": "yes"}, TypeError, "absorb"),
    ]
    for kw, exc, words in cases:
        args = {"x": x, **kw}
        with pytest.raises(exc, match=words):
            m(args.pop("x"), **args)
    m(x, use_cache=True)
    with pytest.raises(ValueError, match="batch shape"):
        m(x[:1, :1], use_cache=True)


def test_backward_protocol_and_bad_dy():
    m = make("q_lora")
    x, dy = data((2, 4, D))
    with pytest.raises(RuntimeError):
        m.backward(dy)
    m(x)
    with pytest.raises(ValueError, match="dy"):
        m.backward(dy[:, :3])
    with pytest.raises(TypeError, match="dy"):
        m.backward(dy > 0)
    m.backward(dy)  # the refused dy lost nothing
    with pytest.raises(RuntimeError):
        m.backward(dy)
    with npattn.no_grad():
        m(x)
    with pytest.raises(RuntimeError):
        m.backward(dy)


def test_bad_config_and_comparison_arguments():
    base = {"hidden_size": D, "num_attention_heads": H, "num_key_value_heads": H, **DIMS}
    with pytest.raises(TypeError, match="config"):
        npattn.MultiHeadLatentAttention.from_config([("hidden_size", D)])
    with pytest.raises(ValueError, match="v_head_dim"):
        npattn.MultiHeadLatentAttention.from_config({k: v for k, v in base.items() if k != "v_head_dim"})
    with pytest.raises(ValueError, match="num_key_value_heads"):
        npattn.MultiHeadLatentAttention.from_config({**base, "num_key_value_heads": 1})
    with pytest.raises(ValueError, match="attention_dropout"):
        npattn.MultiHeadLatentAttention.from_config({**base, "attention_dropout": 0.1})
    m = make()
    with pytest.raises(ValueError, match="num_kv_heads"):
        m.cache_comparison(2)
    with pytest.raises(TypeError, match="num_kv_heads"):
        m.cache_comparison(1.5)
    with pytest.raises(ValueError, match="v_head_dim"):
        kv_cache_bytes_per_token(1, 4, 0)
    with pytest.raises(TypeError, match="dtype"):
        kv_cache_bytes_per_token(1, 4, 4, np.int8)


def test_npattn_check_covers_latent_attention():
    from npattn.tools.check import cases

    found = {name: thunk for name, thunk in cases(0) if name.startswith("MultiHeadLatentAttention")}
    assert len(found) == 3 and any("absorbed" in name for name in found)
    for name, thunk in found.items():
        assert thunk().ok, name

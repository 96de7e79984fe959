"""GraniteMoeShared (``granitemoeshared``) and Granite 4.0 without Mamba (``granitemoehybrid``):
Granite MoE's layer plus a shared MLP on the same normalised input (``moe(h) + shared_mlp(h)``,
then the residual multiplier), the released checkpoints' ``shared_mlp.input_linear`` stacking its
gate and up rows; Granite 4.0's all-attention models (granite-4.0-micro, -1b, -350m) with the
shared MLP alone (``num_local_experts`` 0) or beside the experts, with RoPE or none
(``position_embedding_type``); its Mamba-2 layers: tests/test_granite_hybrid.py.  The released
configs read, short dicts read as transformers reads them, the refusals, and against transformers' own models
in float64 (eager attention): logits to 1e-9 and every gradient to 1e-8 under a random upstream
gradient, cached decoding and a left-padded batch, the checkpoint names both ways.  The
family-wide suites run the two tiny entries."""

from __future__ import annotations

import numpy as np
import pytest
from _hf64 import transformers_or_none

from npattn.models import CausalLM, config_from_hf
from npattn.models.configs import moe_config
from npattn.models.tiny import tiny_config

T = transformers_or_none()
oracle = pytest.mark.skipif(T is None, reason="needs torch and transformers")

# granite-4.0-1b's config.json at a tiny size: its keys as released (40 "attention" layers there)
_RELEASED_HYBRID = dict(
    architectures=["GraniteMoeHybridForCausalLM"],
    attention_bias=False,
    attention_dropout=0.0,
    attention_multiplier=0.0078125,
    bos_token_id=100257,
    embedding_multiplier=12,
    eos_token_id=100257,
    hidden_act="silu",
    hidden_size=32,
    init_method="mup",
    initializer_range=0.1,
    intermediate_size=64,
    layer_types=["attention"] * 3,
    logits_scaling=8,
    mamba_chunk_size=256,
    mamba_conv_bias=True,
    mamba_d_conv=4,
    mamba_d_head=8,
    mamba_d_state=256,
    mamba_expand=2,
    mamba_n_groups=1,
    mamba_n_heads=8,
    mamba_proj_bias=False,
    max_position_embeddings=131072,
    model_type="granitemoehybrid",
    normalization_function="rmsnorm",
    num_attention_heads=4,
    num_experts_per_tok=0,
    num_hidden_layers=3,
    num_key_value_heads=1,
    num_local_experts=0,
    output_router_logits=False,
    pad_token_id=60,
    position_embedding_type="rope",
    residual_multiplier=0.22,
    rms_norm_eps=1e-05,
    rope_scaling=None,
    rope_theta=10000000,
    router_aux_loss_coef=0.01,
    shared_intermediate_size=64,
    tie_word_embeddings=True,
    torch_dtype="bfloat16",
    transformers_version="4.56.0",
    use_cache=True,
    vocab_size=61,
)
# GraniteMoeSharedConfig's keys as a checkpoint's config.json writes them (sizes tiny)
_RELEASED_SHARED = dict(
    architectures=["GraniteMoeSharedForCausalLM"],
    attention_bias=False,
    attention_dropout=0.0,
    attention_multiplier=0.015625,
    bos_token_id=0,
    embedding_multiplier=12.0,
    eos_token_id=0,
    hidden_act="silu",
    hidden_size=32,
    initializer_range=0.02,
    intermediate_size=8,
    logits_scaling=6.0,
    max_position_embeddings=4096,
    model_type="granitemoeshared",
    num_attention_heads=4,
    num_experts_per_tok=2,
    num_hidden_layers=2,
    num_key_value_heads=2,
    num_local_experts=4,
    output_router_logits=False,
    pad_token_id=0,
    residual_multiplier=0.22,
    rms_norm_eps=1e-06,
    rope_scaling=None,
    rope_theta=10000.0,
    router_aux_loss_coef=0.001,
    shared_intermediate_size=16,
    tie_word_embeddings=True,
    torch_dtype="bfloat16",
    transformers_version="4.46.0",
    use_cache=True,
    vocab_size=61,
)
_SIZES = dict(vocab_size=61, hidden_size=32, num_attention_heads=4, num_key_value_heads=2)


def test_the_released_configs_read():
    """Every key is read or known; the shared MLP beside the experts (its names transformers'),
    and Granite 4.0's as the layer's MLP, rotating."""
    s = config_from_hf(_RELEASED_SHARED)
    assert s.mlp_types == ("moe", "moe") and s.moe.shared_intermediate_size == 16 and not s.moe.shared_expert_gate
    assert (s.moe.num_experts, s.moe.top_k, s.moe.router) == (4, 2, "topk_softmax")
    assert s.layout.fused == (("shared_mlp.input_linear", ("shared_mlp.gate_proj", "shared_mlp.up_proj")),)
    names = set(CausalLM(s, rng=0).state_dict())
    layer = sorted(k[len("model.layers.0.") :] for k in names if k.startswith("model.layers.0.") and "_mlp" in k)
    assert layer == ["shared_mlp.gate_proj.weight", "shared_mlp.output_linear.weight", "shared_mlp.up_proj.weight"]
    h = config_from_hf(_RELEASED_HYBRID)
    assert h.mlp_types == ("dense",) * 3 and h.intermediate_size == 64 and h.moe is None
    assert h.layer_types == ("full_attention",) * 3 and h.rope_layers is None
    assert (h.embed_scale, h.residual_multiplier, h.attention_scale, h.logits_scaling) == (12, 0.22, 0.0078125, 8)
    assert h.rope["default"]["rope_theta"] == 10000000
    assert h.attention_config("full_attention", 0).rope
    names = set(CausalLM(h, rng=0).state_dict())
    assert "model.layers.2.shared_mlp.output_linear.weight" in names and not any(".mlp." in k for k in names)


def test_shared_intermediate_size_zero_is_granitemoe():
    """GraniteMoeShared's default 0: no shared MLP (transformers' shared_mlp None), Granite MoE's
    network and names."""
    s = config_from_hf(dict(_RELEASED_SHARED, shared_intermediate_size=0))
    g = {k: v for k, v in _RELEASED_SHARED.items() if k != "shared_intermediate_size"}
    g = config_from_hf(dict(g, model_type="granitemoe"))
    assert s.moe == g.moe and s.layer_names == g.layer_names and s.layout.fused == ()
    assert moe_config(dict(_RELEASED_SHARED, shared_intermediate_size=0)).shared_intermediate_size is None
    assert moe_config(dict(_RELEASED_HYBRID, num_local_experts=4, num_experts_per_tok=2)).shared_intermediate_size == 64
    with pytest.raises(
        ValueError, match=r"config\['num_local_experts'\] = 0: a 'granitemoehybrid' layer without experts"
    ):
        moe_config(_RELEASED_HYBRID)


@pytest.mark.parametrize("position", [None, "nope"])
def test_without_rope_no_layer_rotates(position):
    """transformers builds no rotary embedding for any position_embedding_type but "rope"."""
    c = config_from_hf(dict(_RELEASED_HYBRID, position_embedding_type=position))
    assert c.rope_layers == (False,) * 3
    assert not c.attention_config("full_attention", 1).rope


def test_transformers_5_layer_names_read():
    """transformers 5 writes "full_attention" for "attention" (its legacy remap)."""
    a = config_from_hf(_RELEASED_HYBRID)
    b = config_from_hf(dict(_RELEASED_HYBRID, layer_types=["full_attention"] * 3))
    assert a.replace(hf={}) == b.replace(hf={})


@pytest.mark.parametrize(
    "short",
    [
        dict(_SIZES, model_type="granitemoeshared", num_hidden_layers=2),
        dict(_SIZES, model_type="granitemoeshared", num_hidden_layers=1, shared_intermediate_size=24),
        dict(_SIZES, model_type="granitemoeshared", num_hidden_layers=1, shared_intermediate_size=0),
        dict(
            _SIZES, model_type="granitemoehybrid", num_hidden_layers=2, layer_types=["attention"] * 2, mamba_n_heads=4
        ),
        dict(
            _SIZES,
            mamba_n_heads=8,
            model_type="granitemoehybrid",
            num_hidden_layers=1,
            layer_types=["attention"],
            num_local_experts=0,
            position_embedding_type="rope",
        ),
    ],
)
@oracle
def test_short_config_dicts_mean_what_they_mean_to_transformers(short):
    """Keys left out (the experts' counts, the shared MLP's width, no RoPE) read as transformers
    reads them: the same CausalLMConfig as transformers' full to_dict() of the dict."""
    full = T.AutoConfig.for_model(**short).to_dict()
    meta = dict(bos_token_id=None, eos_token_id=None, max_position_embeddings=None)
    assert config_from_hf(short).replace(**meta) == config_from_hf(full).replace(**meta)


@oracle
@pytest.mark.parametrize(
    "name, config_class",
    [("granitemoeshared", "GraniteMoeSharedConfig"), ("granitemoehybrid", "GraniteMoeHybridConfig")],
)
def test_the_defaults_are_transformers_class_defaults(name, config_class):
    """Every key of the family's ``_DEFAULTS`` is the value of transformers' config class built
    without arguments (GraniteMoeShared's shared width 0, Granite 4.0's 1024, no RoPE)."""
    from npattn.models.configs import with_defaults

    theirs = getattr(T, config_class)().to_dict()
    for key, value in with_defaults({"model_type": name}).items():
        assert theirs.get(key) == value, key


# -- against transformers' own models --------------------------------------------------------
_BASE = dict(
    vocab_size=61,
    hidden_size=32,
    intermediate_size=12,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    attention_bias=True,
    embedding_multiplier=5.0,
    residual_multiplier=0.4,
    attention_multiplier=0.25,
    logits_scaling=3.0,
    rope_theta=500.0,
)
_HYBRID = dict(_BASE, layer_types=["attention"] * 2, mamba_n_heads=8, shared_intermediate_size=20)
CASES = {
    # 3 of 5 experts and a shared MLP of width 20, attention biases, untied
    "shared": ("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM", dict(_BASE, num_local_experts=5,
               num_experts_per_tok=3, shared_intermediate_size=20)),
    # Granite 4.0 as released: no experts, the shared MLP alone, RoPE, grouped heads, tied
    "hybrid_dense_rope": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(_HYBRID, num_local_experts=0,
                          num_experts_per_tok=0, position_embedding_type="rope", tie_word_embeddings=True)),
    # no RoPE (transformers' default position_embedding_type)
    "hybrid_dense_nope": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(_HYBRID, num_local_experts=0,
                          num_experts_per_tok=0)),
    # 2 of 3 experts beside the shared MLP, with RoPE, and without
    "hybrid_moe_rope": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(_HYBRID, num_local_experts=3,
                        num_experts_per_tok=2, position_embedding_type="rope")),
    "hybrid_moe_nope": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(_HYBRID, num_local_experts=3,
                        num_experts_per_tok=2, position_embedding_type="nope")),
}  # fmt: skip


def _case(name):
    from _hf64 import build

    cfg_cls, model_cls, kwargs = CASES[name]
    return build(getattr(T, cfg_cls), getattr(T, model_cls), **kwargs)


def _split_grads(ref: dict) -> dict:
    """transformers' gradients under the model's names: the fused shared_mlp.input_linear's rows
    as its gate and up parts."""
    out = {}
    for k, v in ref.items():
        if k.endswith("shared_mlp.input_linear.weight"):
            half, prefix = v.shape[0] // 2, k[: -len("input_linear.weight")]
            out[prefix + "gate_proj.weight"], out[prefix + "up_proj.weight"] = v[:half], v[half:]
        else:
            out[k] = v
    return out


def _ids(vocab, shape=(2, 7), seed=0):
    return np.random.default_rng(seed).integers(0, vocab, shape)


@oracle
@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_and_every_gradient_match_transformers(name):
    """Without RoPE a key's bias adds the same q.b to every score of a query: its gradient is 0."""
    from _hf64 import check_logits_and_grads, state_dict

    hf, cfg = _case(name)
    m = CausalLM.from_hf(state_dict(hf), cfg)
    ids = _ids(cfg["vocab_size"])
    zero = () if "nope" not in name else [f"model.layers.{i}.self_attn.k_proj.bias" for i in range(2)]
    dlogits = np.random.default_rng(1).standard_normal(ids.shape + (cfg["vocab_size"],))
    check_logits_and_grads(m, hf, ids, dlogits, grads=_split_grads, zero=zero)


@oracle
@pytest.mark.parametrize("name", sorted(CASES))
def test_cached_decoding_and_a_padded_batch_are_transformers(name):
    from _hf64 import check_cached_decoding, check_padded_batch, state_dict

    hf, cfg = _case(name)
    m = CausalLM.from_hf(state_dict(hf), cfg)
    check_cached_decoding(m, hf, _ids(cfg["vocab_size"], (2, 9), seed=3))
    check_padded_batch(m, hf, cfg["vocab_size"], [7, 4], decode=2)


# -- the checkpoint names ----------------------------------------------------------------------
def _moved(name: str, seed: int = 0) -> CausalLM:
    m = CausalLM(tiny_config(name), rng=seed)
    rng = np.random.default_rng(seed + 1)
    for _, p in m.named_parameters():
        p.data[...] = (p.data + rng.standard_normal(p.shape) * 0.1).astype(np.float32)
    return m


@oracle
@pytest.mark.parametrize("family", ["granitemoeshared", "granitemoehybrid"])
def test_save_pretrained_writes_transformers_names(tmp_path, family):
    """The shared MLP goes out fused as input_linear (gate rows, then up rows) and output_linear,
    the experts under the released names: transformers' own save_pretrained of the same weights,
    tensor for tensor; and transformers' directory loads back to the same state dict."""
    import torch

    from npattn.models.hf import open_checkpoint

    m = _moved(family)
    m.save_pretrained(tmp_path / "np")
    ours = open_checkpoint(tmp_path / "np")[1]
    assert "model.layers.1.shared_mlp.input_linear.weight" in ours
    assert not any("gate_proj" in k or "up_proj" in k for k in ours)
    hf = T.AutoModelForCausalLM.from_config(T.AutoConfig.for_model(**tiny_config(family)))
    sd = m.state_dict()
    for i in range(m.config.num_hidden_layers):
        p = f"model.layers.{i}.shared_mlp."
        sd[p + "input_linear.weight"] = np.concatenate([sd.pop(p + "gate_proj.weight"), sd.pop(p + "up_proj.weight")])
    missing, unexpected = hf.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in sd.items()}, strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}
    hf.save_pretrained(tmp_path / "hf")
    theirs = open_checkpoint(tmp_path / "hf")[1]
    assert set(ours) == set(theirs)
    for k, v in theirs.items():
        np.testing.assert_array_equal(ours[k].numpy(), v.numpy(), err_msg=k)
    back = CausalLM.from_pretrained(tmp_path / "hf").state_dict()
    for k, v in m.state_dict().items():
        np.testing.assert_array_equal(back[k], v, err_msg=k)


def test_the_fused_and_the_split_names_both_load():
    m = _moved("granitemoehybrid")
    sd = m.state_dict()
    p = "model.layers.0.shared_mlp."
    fused = dict(sd)
    gate, up = fused.pop(p + "gate_proj.weight"), fused.pop(p + "up_proj.weight")
    fused[p + "input_linear.weight"] = np.concatenate([gate, up])
    for src in (sd, fused):
        back = CausalLM.from_hf(src, tiny_config("granitemoehybrid")).state_dict()
        for k, v in sd.items():
            np.testing.assert_array_equal(back[k], v, err_msg=k)
    fused[p + "gate_proj.weight"] = sd[p + "gate_proj.weight"]
    with pytest.raises(ValueError, match="both 'model.layers.0.shared_mlp.input_linear.weight' and"):
        CausalLM.from_hf(fused, tiny_config("granitemoehybrid"))


# -- refusals ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(layer_types=["attention"] * 2), r"config\['layer_types'\]: expected a list of 3 entries"),
        (dict(layer_types=["attention", "sliding_attention", "attention"]), r"'sliding_attention' is not supported"),
        (dict(position_embedding_type="alibi"), r"config\['position_embedding_type'\] = 'alibi' is not supported"),
        (dict(normalization_function="layernorm"), r"config\['normalization_function'\] = 'layernorm'"),
        (dict(shared_intermediate_size=0), r"config\['shared_intermediate_size'\]: expected an integer >= 1, got 0"),
        (dict(num_local_experts=-1), r"config\['num_local_experts'\]: expected an integer >= 0, got -1"),
        (dict(num_local_experts=2, num_experts_per_tok=3), r"expected at most num_local_experts=2, got 3"),
        (dict(num_local_experts=2, num_experts_per_tok=0), r"config\['num_experts_per_tok'\]: expected an integer"),
        (dict(layers_block_type=["attention"] * 3), "key 'layers_block_type' is not supported"),
        (dict(mlp_bias=True), "key 'mlp_bias' is not supported"),
        (dict(attention_multiplier=0.0), r"config\['attention_multiplier'\]: expected a finite number > 0"),
    ],
)
def test_hybrid_refusals_name_the_key(bad, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf(dict(_RELEASED_HYBRID, **bad))


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(shared_intermediate_size=-2), r"config\['shared_intermediate_size'\]: expected an integer >= 0, got -2"),
        (dict(shared_intermediate_size=1.5), r"config\['shared_intermediate_size'\]: expected an integer"),
        (dict(num_experts_per_tok=5), r"expected at most num_local_experts=4, got 5"),
        (dict(position_embedding_type="rope"), "key 'position_embedding_type' is not supported"),
        (dict(layer_types=["attention"] * 2), "key 'layer_types' is not supported"),
        (dict(logits_scaling=-1.0), r"config\['logits_scaling'\]: expected a finite number > 0"),
    ],
)
def test_shared_refusals_name_the_key(bad, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf(dict(_RELEASED_SHARED, **bad))

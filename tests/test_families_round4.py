"""The families of issue 30 in ``CausalLM`` against transformers' own model classes (eager
attention, float64 with transformers' float32 casts made float64): logits to 1e-9, every
parameter's gradient to 1e-8 by its Hugging Face name, cached decoding and padded batches to
1e-10, the state dict and ``from_pretrained`` round trips, short config dicts read as transformers
reads them, and options refused by name.  Skipped without torch/transformers.

OLMo 3 (``olmo3``): post-norm blocks (``x + post_attention_layernorm(attn(x))``, then
``x + post_feedforward_layernorm(mlp(x))``, no norm before a sublayer), q/k RMSNorm over the whole
projection (weights ``(heads * head_dim,)``), sliding-window layers (three of four by default) with
one RoPE dict per layer type.

Qwen3.5 (``qwen3_5_text``, ``qwen3_5_moe_text``): Qwen3-Next's gated DeltaNet and gated full
attention (3:1 by default, partial RoPE, ``1 + w`` norms) with the DeltaNet's four input
projections (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``) and mRoPE, plain RoPE
for text; the MoE variant routes every layer (always renormalised) beside a gated shared expert."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
T = pytest.importorskip("transformers")

import torch  # noqa: E402
from _hf64 import (  # noqa: E402
    build,
    check_cached_decoding,
    check_logits_and_grads,
    check_padded_batch,
    hf_logits,
    state_dict,
)
from _multimodal import assert_unread_parts_refused  # noqa: E402
from _oracles import rel_err  # noqa: E402

import npattn  # noqa: E402
from npattn import no_grad  # noqa: E402
from npattn.models import CausalLM, config_from_hf  # noqa: E402
from npattn.models.tiny import tiny_config  # noqa: E402
from npattn.nn.attention import MultiHeadAttention  # noqa: E402
from npattn.nn.delta_net import GatedDeltaNet  # noqa: E402


def _kwargs(family: str, **changes) -> dict:
    d = tiny_config(family, **changes)
    d.pop("model_type")
    return d


# each case: (config class, model class, the config's keyword arguments)
CASES = {
    # the tiny table's entry: a window of 3 keys (shorter than the sequences), one RoPE base per
    # layer type, biases, grouped-query attention
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", _kwargs("olmo3")),
    # OLMo 2: the same post-norm layers, every one full, one RoPE; biases, grouped-query attention
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", _kwargs("olmo2")),
    # the default layer pattern (sliding, sliding, sliding, full), head_dim apart from
    # hidden / heads, YaRN on the full-attention layers only, a tied head, no biases
    "olmo3_default_layers": (
        "Olmo3Config",
        "Olmo3ForCausalLM",
        _kwargs(
            "olmo3",
            num_hidden_layers=4,
            layer_types=None,
            head_dim=6,
            num_key_value_heads=1,
            attention_bias=False,
            tie_word_embeddings=True,
            sliding_window=4,
            max_position_embeddings=32,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 300.0},
                "full_attention": {
                    "rope_type": "yarn",
                    "rope_theta": 2000.0,
                    "factor": 4.0,
                    "original_max_position_embeddings": 8,
                },
            },
        ),
    ),
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", _kwargs("qwen3_5_text")),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", _kwargs("qwen3_5_moe_text")),
    # the default 3:1 layout (full attention every fourth layer), grouped-query attention, a tied
    # head and mRoPE's interleaved split of a wider head
    "qwen3_5_text_default_layers": (
        "Qwen3_5TextConfig",
        "Qwen3_5ForCausalLM",
        _kwargs(
            "qwen3_5_text",
            num_hidden_layers=4,
            layer_types=None,
            head_dim=8,
            tie_word_embeddings=True,
            linear_num_key_heads=1,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 500.0,
                "partial_rotary_factor": 0.5,
                "mrope_section": [1, 1, 0],
                "mrope_interleaved": True,
            },
        ),
    ),
}


def _case(name):
    cfg_cls, model_cls, kwargs = CASES[name]
    return build(getattr(T, cfg_cls), getattr(T, model_cls), **kwargs)


def _ids(vocab, shape=(2, 9), seed=0):
    ids = np.random.default_rng(seed).integers(0, vocab, shape)
    ids[0, 1] = 1  # OLMo's pad_token_id: its embedding row is looked up too
    return ids


@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_and_every_gradient_match_transformers(name):
    hf, cfg = _case(name)
    m = CausalLM.from_hf(state_dict(hf), cfg)
    assert m.dtype == np.float64
    ids = _ids(cfg["vocab_size"])
    check_logits_and_grads(m, hf, ids, np.random.default_rng(1).standard_normal(ids.shape + (cfg["vocab_size"],)))


@pytest.mark.parametrize("name", sorted(CASES))
def test_cached_decoding_matches_transformers(name):
    """Nine tokens through a window of 3 or 4 keys: the sliding layers' cache rolls."""
    hf, cfg = _case(name)
    check_cached_decoding(CausalLM.from_hf(state_dict(hf), cfg), hf, _ids(cfg["vocab_size"], seed=3))


@pytest.mark.parametrize("name", sorted(CASES))
def test_padded_batch_matches_transformers_and_each_row_alone(name):
    hf, cfg = _case(name)
    check_padded_batch(CausalLM.from_hf(state_dict(hf), cfg), hf, cfg["vocab_size"], (7, 4, 1))


@pytest.mark.parametrize("name", sorted(CASES))
def test_state_dict_and_from_pretrained_round_trip(name, tmp_path):
    hf, cfg = _case(name)
    sd = state_dict(hf)
    m = CausalLM.from_hf(sd, cfg)
    mine = m.state_dict()
    if cfg.get("tie_word_embeddings"):
        sd.pop("lm_head.weight")  # listed once, as save_pretrained does
    assert set(mine) == set(sd)
    for k, v in sd.items():
        np.testing.assert_array_equal(mine[k], v)
    hf.save_pretrained(tmp_path)  # transformers' own config.json and safetensors
    loaded = CausalLM.from_pretrained(tmp_path)
    assert loaded.dtype == np.float64 and loaded.config == m.config
    ids = _ids(cfg["vocab_size"])
    with no_grad():
        np.testing.assert_array_equal(loaded(ids), m(ids))


@pytest.mark.parametrize("name", ["qwen3_5_text", "qwen3_5_moe_text"])
def test_qwen3_5_over_several_delta_rule_chunks(name):
    """70 tokens: both sides run the chunked delta rule over two chunks of 64."""
    hf, cfg = _case(name)
    m = CausalLM.from_hf(state_dict(hf), cfg)
    ids = _ids(cfg["vocab_size"], (1, 70), seed=5)
    check_logits_and_grads(m, hf, ids, np.random.default_rng(6).standard_normal(ids.shape + (cfg["vocab_size"],)))


def test_qwen3_5_layers_are_qwen3_next_with_four_projections():
    hf, cfg = _case("qwen3_5_text_default_layers")
    m = CausalLM.from_hf(state_dict(hf), cfg)
    c = m.config
    assert c.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert c.linear_attention is not None and c.linear_attention.projections == "qkv_z_b_a"
    names = {n for n, _ in m.model.layers[0].named_parameters()}
    assert {f"linear_attn.in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")} <= names
    assert not {"linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight"} & names
    moe = config_from_hf(CASES["qwen3_5_moe_text"][2] | {"model_type": "qwen3_5_moe_text"})
    assert moe.mlp_types == ("moe", "moe") and moe.moe is not None and moe.moe.norm_topk_prob
    assert moe.moe.shared_expert_gate and moe.layout.per_expert


def test_olmo3_blocks_are_post_norm_with_whole_projection_qk_norm():
    hf, cfg = _case("olmo3")
    m = CausalLM.from_hf(state_dict(hf), cfg)
    c = m.config
    assert not c.pre_norm and c.sandwich_norm and c.qk_norm_scope == "all_heads"
    layer = m.model.layers[0]
    names = {n for n, _ in layer.named_parameters()}
    assert not {"input_layernorm.weight", "pre_feedforward_layernorm.weight"} & names
    assert {"post_attention_layernorm.weight", "post_feedforward_layernorm.weight"} <= names
    heads, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], c.head_dim
    assert layer.self_attn.q_norm.weight.shape == (heads * hd,)
    assert layer.self_attn.k_norm.weight.shape == (kv * hd,)
    assert c.layer_types == ("sliding_attention", "full_attention") and c.sliding_window == 3
    assert c.rope["sliding_attention"]["rope_theta"] == 1000.0 and c.rope["full_attention"]["rope_theta"] == 5000.0


@pytest.mark.parametrize(
    "short",
    [
        dict(
            model_type="olmo3",
            vocab_size=41,
            hidden_size=16,
            intermediate_size=24,
            num_attention_heads=2,
            num_hidden_layers=5,
        ),
        # the legacy rope_theta: transformers gives it to the full-attention layers only
        dict(
            model_type="olmo3",
            vocab_size=41,
            hidden_size=16,
            intermediate_size=24,
            num_attention_heads=4,
            num_hidden_layers=4,
            rope_theta=700.0,
        ),
        # the legacy rope_scaling: merged into the full-attention layers' dict
        dict(
            model_type="olmo3",
            vocab_size=41,
            hidden_size=16,
            intermediate_size=24,
            num_attention_heads=4,
            num_hidden_layers=4,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
        ),
    ],
)
def test_olmo3_short_config_dicts_mean_what_they_mean_to_transformers(short):
    full = T.AutoConfig.for_model(**short).to_dict()
    meta = dict(bos_token_id=None, eos_token_id=None, max_position_embeddings=None)  # not the network
    a, b = config_from_hf(short), config_from_hf(full)
    assert a.replace(**meta) == b.replace(**meta)
    assert a.rope == b.rope and a.layer_types == tuple(full["layer_types"])


_QWEN35_SHORT = dict(
    vocab_size=41,
    hidden_size=16,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=4,
    num_hidden_layers=4,
    linear_key_head_dim=4,
    linear_value_head_dim=4,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)


@pytest.mark.parametrize(
    "short",
    [
        dict(_QWEN35_SHORT, model_type="qwen3_5_text", intermediate_size=24),
        dict(_QWEN35_SHORT, model_type="qwen3_5_text", intermediate_size=24, full_attention_interval=2),
        dict(_QWEN35_SHORT, model_type="qwen3_5_moe_text", moe_intermediate_size=8, num_experts=4),
    ],
)
def test_qwen3_5_short_config_dicts_mean_what_they_mean_to_transformers(short):
    full = T.AutoConfig.for_model(**short).to_dict()
    meta = dict(bos_token_id=None, eos_token_id=None, max_position_embeddings=None)  # not the network
    a, b = config_from_hf(short), config_from_hf(full)
    assert a.replace(**meta) == b.replace(**meta)
    assert a.layer_types == tuple(full["layer_types"]) and a.rope == b.rope


def test_qwen3_5_refusals_name_the_key():
    with pytest.raises(ValueError, match=r"'mrope_section'"):
        config_from_hf(
            tiny_config("qwen3_5_text", rope_parameters={"rope_type": "default", "mrope_section": "11,11,10"})
        )
    with pytest.raises(ValueError, match="'norm_topk_prob'"):
        config_from_hf(tiny_config("qwen3_5_moe_text", norm_topk_prob=False))
    with pytest.raises(ValueError, match="'decoder_sparse_step'"):
        config_from_hf(tiny_config("qwen3_5_moe_text", decoder_sparse_step=2))
    with pytest.raises(ValueError, match="'sliding_attention'"):
        config_from_hf(tiny_config("qwen3_5_text", layer_types=["linear_attention", "sliding_attention"]))
    with pytest.raises(ValueError, match="projections"):
        GatedDeltaNet(16, 4, 2, 4, 4, projections="qkv")


def test_olmo3_refusals_name_the_key():
    with pytest.raises(ValueError, match="'use_bidirectional_attention'"):
        config_from_hf(tiny_config("olmo3", use_bidirectional_attention=True))
    with pytest.raises(ValueError, match=r"\['rope_parameters'\]\['rope_type'\].*OLMo 3"):
        config_from_hf(tiny_config("olmo3", rope_parameters={"rope_type": "default", "rope_theta": 10.0}))
    with pytest.raises(ValueError, match="'chunked_attention'"):
        config_from_hf(tiny_config("olmo3", layer_types=["sliding_attention", "chunked_attention"]))
    with pytest.raises(ValueError, match="qk_norm_scope"):
        MultiHeadAttention(16, 16, 4, qk_norm=True, qk_norm_scope="token")


def _torch_whole_projection_query(mha, x):
    """transformers' OLMo query: RMSNorm over all heads' features of the projection."""
    W = torch.from_numpy(mha.W_query.weight.data)
    w = torch.from_numpy(mha.q_norm.weight.data)
    q = torch.from_numpy(x) @ W.T
    q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + mha.q_norm.eps) * w
    return q


def test_whole_projection_qk_norm_gradients_and_jvp_against_central_differences():
    """The module alone (RoPE, one KV head for three query heads): backward and JVP of
    ``qk_norm_scope="all_heads"`` against central differences, the normalised query against
    transformers' whole-projection RMSNorm, gradcheck and gradgradcheck."""
    rng = np.random.default_rng(0)
    mha = MultiHeadAttention(
        12, 12, 3, num_kv_heads=1, head_dim=4, causal=True, rope=True, qk_norm=True, qk_norm_eps=1e-5,
        qk_norm_scope="all_heads", rng=0,
    )  # fmt: skip
    for p in (mha.q_norm.weight, mha.k_norm.weight):
        p.data[...] = 1 + 0.3 * rng.standard_normal(p.data.shape)
    x = rng.standard_normal((2, 5, 12))
    dy = rng.standard_normal((2, 5, 12))
    tx = rng.standard_normal(x.shape)
    tw = rng.standard_normal(mha.q_norm.weight.shape)
    y = mha(x)
    ty = mha.jvp(tx, param_tangents={"q_norm.weight": tw})
    mha.zero_grad()
    dx = mha.backward(dy)

    def f(xx):
        with no_grad():
            return float((mha(xx) * dy).sum())

    eps = 1e-6
    fd = (f(x + eps * tx) - f(x - eps * tx)) / (2 * eps)
    assert abs((dx * tx).sum() - fd) < 1e-7 * max(1.0, abs(fd))
    for p in (mha.q_norm.weight, mha.k_norm.weight):
        tp = rng.standard_normal(p.data.shape)
        p.data += eps * tp
        up = f(x)
        p.data -= 2 * eps * tp
        down = f(x)
        p.data += eps * tp
        fd = (up - down) / (2 * eps)
        assert abs((p.grad * tp).sum() - fd) < 1e-7 * max(1.0, abs(fd))
    # JVP along the input and the q-norm's weight against central differences of the output
    with no_grad():
        mha.q_norm.weight.data += eps * tw
        up = mha(x + eps * tx)
        mha.q_norm.weight.data -= 2 * eps * tw
        down = mha(x - eps * tx)
        mha.q_norm.weight.data += eps * tw
    assert rel_err(ty, (up - down) / (2 * eps), floor=1e-300, relative_to="max_b") < 1e-7
    # the normalised query is torch's whole-projection RMSNorm
    q = _torch_whole_projection_query(mha, x).numpy()
    qh = mha._qk_norm(mha._split(x @ mha.W_query.weight.data.T, 3), mha.q_norm)[0]
    assert rel_err(qh.swapaxes(-2, -3).reshape(q.shape), q, floor=1e-300, relative_to="max_b") < 1e-13
    assert y.shape == x.shape and ty.shape == y.shape
    # every gradient and the second order (backward_jvp) by npattn's own checks
    assert npattn.gradcheck(mha, x).ok and npattn.gradgradcheck(mha, x).ok


# a tiny vision tower beside the text model (its weights are set aside when loading)
_VISION = dict(
    depth=1,
    hidden_size=8,
    intermediate_size=16,
    num_heads=2,
    out_hidden_size=16,
    patch_size=2,
    temporal_patch_size=1,
    spatial_merge_size=1,
    num_position_embeddings=4,
    in_channels=3,
)


# a tiny SigLIP tower (Gemma 3's) and its projector onto 4 tokens per image
_SIGLIP = dict(
    hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=8, patch_size=2
)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_gemma3_multimodal_checkpoint_loads_its_text_model(tied, tmp_path):
    """A ``gemma3`` directory (Gemma 3 4B and larger: ``text_config``; the text model under
    ``language_model.model.*`` and an untied head as ``language_model.lm_head.weight``, as the
    releases and transformers' own save write them, beside ``vision_tower.*`` and
    ``multi_modal_projector.*``): from_pretrained loads the text model with the logits of
    transformers' multimodal class on text and says which towers' tensors it left aside; a
    tensor of no known tower and a top-level option are refused by name."""
    from npattn.models.hf import open_safetensors

    text = _kwargs("gemma3_text", tie_word_embeddings=tied)
    hf, cfg = build(
        T.Gemma3Config, T.Gemma3ForConditionalGeneration, text_config=text, vision_config=_SIGLIP,
        mm_tokens_per_image=4, tie_word_embeddings=tied,
    )  # fmt: skip
    hf.save_pretrained(tmp_path)
    tensors = {k: t.numpy() for k, t in open_safetensors(tmp_path / "model.safetensors").items()}
    assert ("language_model.lm_head.weight" in tensors) != tied
    with pytest.warns(UserWarning, match=r"multi_modal_projector\.\* \(\d+ tensors\), vision_tower\.\* \("):
        m = CausalLM.from_pretrained(tmp_path)
    assert m.config.model_type == "gemma3_text" and (m.lm_head is None) == tied
    ids = _ids(cfg["text_config"]["vocab_size"])
    with no_grad():
        assert rel_err(m(ids), hf_logits(hf, ids), floor=1e-300, relative_to="max_b") < 1e-9
    assert_unread_parts_refused(tmp_path, "audio_tower.w", lambda good: [({"audio_config": {}}, "'audio_config'")])


def test_gemma3_released_config_means_what_it_means_to_transformers():
    """The config.json of the Gemma 3 4B release (its text_config names six keys and leaves the
    rest to Gemma3TextConfig's defaults; eos at the top) gives the text model transformers' own
    Gemma3Config builds from it."""
    from npattn.models.configs import text_checkpoint

    released = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        **dict(boi_token_index=255999, eoi_token_index=256000, eos_token_id=[1, 106], image_token_index=262144),
        **dict(initializer_range=0.02, mm_tokens_per_image=256, model_type="gemma3", torch_dtype="bfloat16"),
        "text_config": {
            **dict(hidden_size=2560, intermediate_size=10240, model_type="gemma3_text", num_hidden_layers=34),
            **dict(rope_scaling={"factor": 8.0, "rope_type": "linear"}, sliding_window=1024),
        },
        "transformers_version": "4.50.0.dev0",
        "vision_config": {
            **dict(hidden_size=1152, image_size=896, intermediate_size=4304, model_type="siglip_vision_model"),
            **dict(num_attention_heads=16, num_hidden_layers=27, patch_size=14, vision_use_head=False),
        },
    }
    text, _, _ = text_checkpoint(released, {})
    want = T.Gemma3Config(**{k: v for k, v in released.items() if k != "model_type"}).text_config.to_dict()
    meta = dict(bos_token_id=None, eos_token_id=None, max_position_embeddings=None)  # not the network
    assert config_from_hf(text).replace(**meta) == config_from_hf(want).replace(**meta)


@pytest.mark.parametrize(
    "wrapper, family",
    [("Qwen3_5Config", "qwen3_5_text"), ("Qwen3_5MoeConfig", "qwen3_5_moe_text")],
)
def test_multimodal_checkpoint_loads_its_text_model(wrapper, family, tmp_path):
    """A ``qwen3_5`` / ``qwen3_5_moe`` directory (``text_config``, weights under
    ``model.language_model.*`` beside ``model.visual.*`` and multi-token-prediction ``mtp.*``):
    from_pretrained loads the text model with the logits of transformers' multimodal class on
    text, and says which towers' tensors it left aside; anything else is refused by name."""
    from npattn.models.hf import open_safetensors, save_safetensors

    model_cls = (
        "Qwen3_5ForConditionalGeneration" if wrapper == "Qwen3_5Config" else "Qwen3_5MoeForConditionalGeneration"
    )
    hf, cfg = build(getattr(T, wrapper), getattr(T, model_cls), text_config=_kwargs(family), vision_config=_VISION)
    hf.save_pretrained(tmp_path)
    tensors = {k: t.numpy() for k, t in open_safetensors(tmp_path / "model.safetensors").items()}
    tensors["mtp.fc.weight"] = np.ones((16, 32))  # a released checkpoint's MTP layer
    save_safetensors(tensors, tmp_path / "model.safetensors")
    with pytest.warns(UserWarning, match=r"model\.visual\.\* \(\d+ tensors\), mtp\.\* \(1 tensors\)"):
        m = CausalLM.from_pretrained(tmp_path)
    assert m.config.model_type == family
    ids = _ids(cfg["text_config"]["vocab_size"])
    with no_grad():
        assert rel_err(m(ids), hf_logits(hf, ids), floor=1e-300, relative_to="max_b") < 1e-9
    # a tensor of no known tower, a top-level option and a disagreeing tie are refused by name
    assert_unread_parts_refused(
        tmp_path,
        "model.audio_tower.w",
        lambda good: [
            ({"audio_config": {}}, "'audio_config'"),
            ({"tie_word_embeddings": True}, "tie_word_embeddings"),
            ({"text_config": dict(good["text_config"], model_type="qwen3_next")}, r"\['model_type'\]"),
        ],
    )

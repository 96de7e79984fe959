"""Mixture of experts against Hugging Face ``transformers`` (an oracle only; skipped without it):
each family's MoE block built from a tiny random config in float64, its state dict loaded
unchanged into ``SparseMoeBlock.from_hf_config``; outputs, the input gradient and every parameter
gradient against torch autograd (1e-10 relative); the routers' choices and weights; the state-dict
names of a whole tiny model's MoE layer under ``mlp.``."""

import numpy as np
import pytest
from _oracles import rel_err

from npattn.nn.moe import SparseMoeBlock

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from _hf64 import float64_reference  # noqa: E402

MODULES = {
    "gpt_oss": "models.gpt_oss.modeling_gpt_oss",
    "deepseek_v3": "models.deepseek_v3.modeling_deepseek_v3",
    "qwen3_next": "models.qwen3_next.modeling_qwen3_next",
    "qwen3_moe": "models.qwen3_moe.modeling_qwen3_moe",
    "mixtral": "models.mixtral.modeling_mixtral",
    "qwen2_moe": "models.qwen2_moe.modeling_qwen2_moe",
    "olmoe": "models.olmoe.modeling_olmoe",
}
CLASSES = {
    "gpt_oss": ("GptOssConfig", "GptOssMLP", "GptOssForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3MoE", "DeepseekV3ForCausalLM"),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextSparseMoeBlock", "Qwen3NextForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeSparseMoeBlock", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralSparseMoeBlock", "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeSparseMoeBlock", "Qwen2MoeForCausalLM"),
    "olmoe": ("OlmoeConfig", "OlmoeSparseMoeBlock", "OlmoeForCausalLM"),
}

# (family, config fields): every router variant and option the three families use
CASES = [
    ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=6)),
    ("gpt_oss", dict(num_local_experts=6, num_experts_per_tok=3, intermediate_size=4,
                     swiglu_limit=0.7, swiglu_alpha=1.3)),
    ("deepseek_v3", dict(n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=4, n_shared_experts=2,
                         n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)),
    ("deepseek_v3", dict(n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=3, n_shared_experts=1,
                         n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False, hidden_act="gelu")),
    ("qwen3_next", dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=4,
                        shared_expert_intermediate_size=5, norm_topk_prob=True)),
    ("qwen3_next", dict(num_experts=5, num_experts_per_tok=3, moe_intermediate_size=3,
                        shared_expert_intermediate_size=2, norm_topk_prob=False, hidden_act="gelu_pytorch_tanh")),
    ("qwen3_moe", dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=4, norm_topk_prob=False)),
    ("mixtral", dict(num_local_experts=5, num_experts_per_tok=2, intermediate_size=4)),
    ("qwen2_moe", dict(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=4,
                       shared_expert_intermediate_size=6, norm_topk_prob=False)),
    ("qwen2_moe", dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=3,
                       shared_expert_intermediate_size=2, norm_topk_prob=True, hidden_act="gelu")),
    ("olmoe", dict(num_experts=6, num_experts_per_tok=3, intermediate_size=4)),
    ("olmoe", dict(num_experts=5, num_experts_per_tok=2, intermediate_size=3, norm_topk_prob=True)),
]  # fmt: skip
IDS = [f"{f}-{i}" for i, (f, _) in enumerate(CASES)]
H = 8


def _config(family, fields):
    return getattr(transformers, CLASSES[family][0])(hidden_size=H, **fields)


def _hf_block(family, config, seed=0):
    """The family's MoE block, float64, random parameters and correction bias (not HF's zeros)."""
    import importlib

    mod = importlib.import_module(f"transformers.{MODULES[family]}")
    torch.manual_seed(seed)
    block = getattr(mod, CLASSES[family][1])(config).double()
    with torch.no_grad():
        for name, p in block.named_parameters():
            # larger gate_up entries in GPT-OSS so that the clamps act on some units
            p.normal_(std=1.5 if "gate_up" in name and family == "gpt_oss" else 0.5)
        for _, b in block.named_buffers():
            b.uniform_(-0.3, 0.3)
    return block


@pytest.fixture
def f64():
    """transformers' float32 upcasts in the routers (``.type(torch.float32)``, ``.float()``,
    ``softmax(dtype=torch.float)``) become float64, so the oracle stays float64."""
    with float64_reference():
        yield


def _ours(config, hf):
    m = SparseMoeBlock.from_hf_config(config.to_dict())
    m.load_state_dict(hf.state_dict())  # the names and shapes as they are: strict
    return m


@pytest.mark.parametrize("family, fields", CASES, ids=IDS)
def test_block_forward_and_every_gradient_match_transformers(family, fields, f64):
    config = _config(family, fields)
    hf = _hf_block(family, config)
    ours = _ours(config, hf)
    assert sorted(n for n, _ in ours.named_parameters()) == sorted(n for n, _ in hf.named_parameters())
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 9, H, dtype=torch.float64, generator=gen, requires_grad=True)
    out = hf(x)
    out = out[0] if isinstance(out, tuple) else out  # GPT-OSS returns (hidden, router_scores)
    dy = torch.randn(out.shape, dtype=torch.float64, generator=gen)
    out.backward(dy)

    y = ours(x.detach().numpy())
    assert rel_err(y, out.detach().numpy(), floor=1e-12) < 1e-12
    dx = ours.backward(dy.numpy())
    assert rel_err(dx, x.grad.numpy()) < 1e-10
    grads = dict(ours.named_parameters())
    for name, p in hf.named_parameters():
        assert p.grad is not None and p.grad.abs().max() > 0, name
        assert rel_err(grads[name].grad, p.grad.numpy()) < 1e-10, name
    assert ours.tokens_per_expert.sum() == 18 * ours.router_module.top_k


@pytest.mark.parametrize("family, fields", CASES, ids=IDS)
def test_router_choice_and_weights_match_transformers(family, fields, f64):
    config = _config(family, fields)
    hf = _hf_block(family, config, seed=3)
    ours = _ours(config, hf)
    router_hf = hf.router if family == "gpt_oss" else hf.gate
    x = torch.randn(40, H, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    logits, scores, idx = (t.detach().numpy() for t in router_hf(x))
    w, ours_idx = ours.router_module(x.numpy())
    np.testing.assert_allclose(ours.router_module.last_logits, logits, rtol=1e-13, atol=1e-15)
    # transformers' order within the top-k is not always sorted (DeepSeek's sorted=False): compare by expert
    o1, o2 = np.argsort(idx, -1), np.argsort(ours_idx, -1)
    np.testing.assert_array_equal(np.take_along_axis(ours_idx, o2, -1), np.take_along_axis(idx, o1, -1))
    np.testing.assert_allclose(np.take_along_axis(w, o2, -1), np.take_along_axis(scores, o1, -1), rtol=1e-13)


def test_correction_bias_changes_transformers_choice_and_ours_alike(f64):
    """The DeepSeek-V3 correction bias matters (the choice differs from the plain sigmoid order for
    some token) and both routers agree with it."""
    config = _config(*CASES[3])
    hf = _hf_block("deepseek_v3", config, seed=5)
    with torch.no_grad():
        hf.gate.e_score_correction_bias.copy_(torch.linspace(-0.5, 0.5, 6, dtype=torch.float64))
    ours = _ours(config, hf)
    x = torch.randn(30, H, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    _, _, idx = hf.gate(x)
    _, ours_idx = ours.router_module(x.numpy())
    assert [set(r) for r in idx.numpy()] == [set(r) for r in ours_idx]
    plain = np.argsort(-ours.router_module.last_logits, -1)[:, :2]
    assert any(set(a) != set(b) for a, b in zip(plain, ours_idx))


TINY_MODELS = {
    "gpt_oss": dict(
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=4, vocab_size=16,
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=6,
    ),
    "deepseek_v3": dict(
        num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=2, num_key_value_heads=2, vocab_size=16,
        intermediate_size=10, q_lora_rank=4, kv_lora_rank=4, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=3, n_shared_experts=1, n_group=2, topk_group=1,
    ),
    "qwen3_next": dict(
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=4, vocab_size=16,
        intermediate_size=10, layer_types=["full_attention"], num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=3, shared_expert_intermediate_size=5, linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=4, linear_value_head_dim=4,
    ),
    "qwen3_moe": dict(
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=4, vocab_size=16,
        intermediate_size=10, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=3,
    ),
    "mixtral": dict(
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=4, vocab_size=16,
        intermediate_size=6, num_local_experts=4, num_experts_per_tok=2,
    ),
    "qwen2_moe": dict(
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, vocab_size=16, intermediate_size=10,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=3, shared_expert_intermediate_size=5,
    ),
    "olmoe": dict(
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, vocab_size=16, intermediate_size=6,
        num_experts=4, num_experts_per_tok=2,
    ),
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(TINY_MODELS))
def test_names_and_shapes_as_a_whole_models_mlp(family):
    """The keys of a tiny random model's last layer under ``mlp.``: exactly ours, same shapes, same order."""
    config = _config(family, TINY_MODELS[family])
    model = getattr(transformers, CLASSES[family][2])(config)
    last = config.num_hidden_layers - 1
    prefix = f"model.layers.{last}.mlp."
    hf = [(k[len(prefix) :], tuple(v.shape)) for k, v in model.state_dict().items() if k.startswith(prefix)]
    ours = [(k, v.shape) for k, v in SparseMoeBlock.from_hf_config(config.to_dict()).state_dict().items()]
    assert ours == hf  # names, shapes and transformers' order

"""Granite 3.x (``granite``) and Granite MoE (``granitemoe``): Llama's layers with four numbers
(``embedding_multiplier`` on the embeddings, ``residual_multiplier`` on each residual branch,
``attention_multiplier`` as the scores' factor, ``logits_scaling`` dividing the logits) and, for
the MoE, every layer's MLP routed experts under ``block_sparse_moe`` (the top-k logits softmaxed
among themselves), written by the released checkpoints as ``router.layer.weight``,
``input_linear.weight`` and ``output_linear.weight``.  Released configs read, the checkpoint names
both ways (transformers' own directory loaded, ours written under the released names), short
dicts read as transformers reads them, and the refusals by name.  The family-wide suites run the
tiny entries and ``tests/test_causal_lm_parity.py`` three cases against transformers in float64."""

from __future__ import annotations

import numpy as np
import pytest

from npattn import no_grad
from npattn.models import CausalLM, config_from_hf
from npattn.models.tiny import tiny_config

_SIZES = dict(vocab_size=61, hidden_size=32, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2)

# granite-3.3-2b-instruct's config.json at a tiny size: its keys as released
_RELEASED = dict(
    architectures=["GraniteForCausalLM"],
    attention_bias=False,
    attention_dropout=0.0,
    attention_multiplier=0.015625,
    bos_token_id=0,
    embedding_multiplier=12.0,
    eos_token_id=0,
    hidden_act="silu",
    hidden_size=32,
    initializer_range=0.02,
    intermediate_size=40,
    logits_scaling=8.0,
    max_position_embeddings=131072,
    mlp_bias=False,
    model_type="granite",
    num_attention_heads=4,
    num_hidden_layers=2,
    num_key_value_heads=2,
    pad_token_id=0,
    residual_multiplier=0.22,
    rms_norm_eps=1e-05,
    rope_scaling=None,
    rope_theta=10000000.0,
    tie_word_embeddings=True,
    torch_dtype="bfloat16",
    transformers_version="4.49.0",
    use_cache=True,
    vocab_size=61,
)
# granite-3.0-1b-a400m-base's config.json at a tiny size
_RELEASED_MOE = dict(
    {k: v for k, v in _RELEASED.items() if k != "mlp_bias"},
    architectures=["GraniteMoeForCausalLM"],
    model_type="granitemoe",
    intermediate_size=8,
    num_local_experts=4,
    num_experts_per_tok=2,
    output_router_logits=False,
    router_aux_loss_coef=0.0,
    embedding_multiplier=12.0,
    attention_multiplier=0.015625,
    logits_scaling=6.0,
    residual_multiplier=0.22,
)


@pytest.mark.parametrize("released", [_RELEASED, _RELEASED_MOE], ids=["granite", "granitemoe"])
def test_the_released_configs_read(released):
    """Every key of the released config.json files is read or known, the four numbers where they
    belong."""
    c = config_from_hf(released)
    assert c.embed_scale == 12.0 and c.residual_multiplier == 0.22 and c.attention_scale == 0.015625
    assert c.logits_scaling == released["logits_scaling"]
    assert c.attention_config("full_attention").scale == 0.015625
    if released["model_type"] == "granitemoe":
        assert c.mlp_types == ("moe", "moe") and c.layer_names == (("mlp", "block_sparse_moe"),)
        assert (c.moe.num_experts, c.moe.top_k, c.moe.intermediate_size) == (4, 2, 8)
        assert (c.moe.router, c.moe.router_name, c.moe.router_bias) == ("topk_softmax", "router", False)


def test_the_numbers_default_to_one():
    """Left out, the four numbers are 1: the model is Llama's (same weights, same logits)."""
    g = config_from_hf(dict(_SIZES, model_type="granite", num_hidden_layers=1))
    assert (g.embed_scale, g.residual_multiplier, g.attention_scale, g.logits_scaling) == (False, 1.0, 1.0, 1.0)
    llama = dict(_SIZES, model_type="llama", num_hidden_layers=1)
    a, b = CausalLM(llama, rng=0), CausalLM(dict(llama, model_type="granite", attention_multiplier=0.5**0.5 / 2))
    b.load_state_dict(a.state_dict())
    ids = np.array([[1, 5, 7, 2]])
    with no_grad():  # head_dim 8: Llama's 1/sqrt(8) is Granite's attention_multiplier here
        np.testing.assert_allclose(b(ids), a(ids), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "short",
    [
        dict(_SIZES, model_type="granite", num_hidden_layers=2),
        dict(_SIZES, model_type="granite", num_hidden_layers=2, residual_multiplier=0.5, head_dim=4),
        dict(_SIZES, model_type="granitemoe", num_hidden_layers=2),
        dict(_SIZES, model_type="granitemoe", num_hidden_layers=1, num_local_experts=3, logits_scaling=2.0),
    ],
)
def test_short_config_dicts_mean_what_they_mean_to_transformers(short):
    """A dict that leaves keys out (the four numbers, the experts' counts) reads as transformers
    reads it: the same CausalLMConfig as transformers' full to_dict() of it."""
    pytest.importorskip("torch")
    T = pytest.importorskip("transformers")
    full = T.AutoConfig.for_model(**short).to_dict()
    meta = dict(bos_token_id=None, eos_token_id=None, max_position_embeddings=None)
    assert config_from_hf(short).replace(**meta) == config_from_hf(full).replace(**meta)


def _moved(name: str, seed: int = 0) -> CausalLM:
    m = CausalLM(tiny_config(name), rng=seed)
    rng = np.random.default_rng(seed + 1)
    for _, p in m.named_parameters():
        p.data[...] = (p.data + rng.standard_normal(p.shape) * 0.1).astype(np.float32)
    return m


def test_save_pretrained_writes_the_released_moe_names(tmp_path):
    """The MoE tensors go out under the released checkpoints' names, as transformers' own
    save_pretrained of the same model writes them (and reads them back with equal logits)."""
    pytest.importorskip("torch")
    T = pytest.importorskip("transformers")
    from npattn.models.hf import open_checkpoint

    m = _moved("granitemoe")
    m.save_pretrained(tmp_path / "np")
    ours = open_checkpoint(tmp_path / "np")[1]
    layer = sorted(k[len("model.layers.0.") :] for k in ours if k.startswith("model.layers.0."))
    assert [k for k in layer if k.startswith("block_sparse_moe")] == [
        "block_sparse_moe.input_linear.weight",
        "block_sparse_moe.output_linear.weight",
        "block_sparse_moe.router.layer.weight",
    ]
    cfg = T.AutoConfig.for_model(**tiny_config("granitemoe"))
    import torch

    hf = T.AutoModelForCausalLM.from_config(cfg)
    hf.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in m.state_dict().items()}, strict=False)
    hf.save_pretrained(tmp_path / "hf")
    theirs = open_checkpoint(tmp_path / "hf")[1]
    assert set(ours) == set(theirs)
    for k, v in theirs.items():
        np.testing.assert_array_equal(ours[k].numpy(), v.numpy(), err_msg=k)


def test_a_transformers_directory_loads_with_its_logits(tmp_path):
    """transformers' own directory (the released names) loads; the logits are transformers'."""
    torch = pytest.importorskip("torch")
    T = pytest.importorskip("transformers")
    from _hf64 import randomize

    cfg = T.AutoConfig.for_model(**tiny_config("granitemoe", tie_word_embeddings=False))
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = T.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager").eval()
    randomize(hf, 0)
    hf.save_pretrained(tmp_path)
    m = CausalLM.from_pretrained(tmp_path)
    ids = np.array([[1, 5, 7, 2, 9, 3], [4, 4, 8, 0, 1, 2]])
    with torch.no_grad():
        want = hf(input_ids=torch.from_numpy(ids)).logits.numpy()
    with no_grad():
        np.testing.assert_allclose(m(ids), want, rtol=1e-4, atol=1e-5)


def test_both_names_of_one_tensor_are_refused():
    m = _moved("granitemoe")
    sd = m.state_dict()
    prefix = "model.layers.0.block_sparse_moe."
    sd[prefix + "input_linear.weight"] = sd[prefix + "experts.gate_up_proj"]
    with pytest.raises(ValueError, match="input_linear.weight"):
        CausalLM.from_hf(sd, tiny_config("granitemoe"))


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(logits_scaling=0.0), r"config\['logits_scaling'\]: expected a finite number > 0, got 0.0"),
        (dict(embedding_multiplier=-1.0), r"config\['embedding_multiplier'\]: expected a finite number > 0"),
        (dict(residual_multiplier=float("nan")), r"config\['residual_multiplier'\]: expected a finite number"),
        (dict(attention_multiplier="0.5"), r"config\['attention_multiplier'\]: expected a finite number"),
        (dict(logits_scaling=True), r"config\['logits_scaling'\]"),
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
        # GraniteMoeShared's and GraniteMoeHybrid's keys: not this family's
        (dict(shared_intermediate_size=16), "key 'shared_intermediate_size' is not supported"),
        (dict(position_embedding_type="nope"), "key 'position_embedding_type' is not supported"),
    ],
)
@pytest.mark.parametrize("family", ["granite", "granitemoe"])
def test_refusals_name_the_key(family, bad, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf(tiny_config(family, **bad))


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(num_experts_per_tok=5), r"config\['num_experts_per_tok'\]: expected at most num_local_experts=4, got 5"),
        (dict(num_local_experts=0), r"config\['num_local_experts'\]: expected an integer >= 1, got 0"),
        (dict(mlp_bias=True), "key 'mlp_bias' is not supported"),  # GraniteMoe's experts have no biases
        (dict(num_experts=4), "key 'num_experts' is not supported"),  # not a GraniteMoeConfig name
    ],
)
def test_moe_refusals_name_the_key(bad, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf(tiny_config("granitemoe", **bad))

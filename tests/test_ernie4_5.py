"""ERNIE 4.5 dense (``ernie4_5``): Llama's layers with RoPE on interleaved pairs ``(2i, 2i + 1)``
(transformers' ``Ernie4_5``'s ``apply_rotary_pos_emb``: each frequency repeated twice, GLM's
``rotate_half``), one ``use_bias`` for the biases of all seven projections, ``head_dim`` 128 and a
tied head by default.  The released config read, the defaults, the interleaved pairs as Llama's
rotate-half pairs with the q/k rows reordered (without torch), short dicts and transformers' own
directory against transformers, and the refusals by name.  The family-wide suites run the tiny
entry and ``tests/test_causal_lm_parity.py`` three cases against transformers in float64."""

from __future__ import annotations

import numpy as np
import pytest
from _hf64 import transformers_or_none

from npattn import no_grad
from npattn.models import CausalLM, config_from_hf
from npattn.models.tiny import tiny_config

T = transformers_or_none()
needs_transformers = pytest.mark.skipif(T is None, reason="needs torch and transformers")

_SIZES = dict(vocab_size=61, hidden_size=32, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2)

# baidu/ERNIE-4.5-0.3B-PT's config.json at a tiny size: its keys as released
_RELEASED = dict(
    architectures=["Ernie4_5ForCausalLM"],
    bos_token_id=1,
    eos_token_id=2,
    head_dim=8,
    hidden_act="silu",
    hidden_size=32,
    intermediate_size=40,
    max_position_embeddings=131072,
    model_type="ernie4_5",
    num_attention_heads=4,
    num_hidden_layers=2,
    num_key_value_heads=2,
    pad_token_id=0,
    rms_norm_eps=1e-05,
    rope_theta=500000.0,
    tie_word_embeddings=True,
    torch_dtype="bfloat16",
    transformers_version="4.54.0.dev0",
    use_bias=False,
    use_cache=False,
    vocab_size=61,
)


def test_the_released_config_reads():
    """Every key of the released config.json is read or known: interleaved RoPE at its base, no
    biases, the tied head, heads of 8 (not 32 / 4)."""
    c = config_from_hf(_RELEASED)
    a = c.attention_config("full_attention")
    assert a.rope_interleaved and a.rope_scaling["rope_theta"] == 500000.0 and a.rope and a.scale is None
    assert (a.qkv_bias, a.out_bias, c.mlp_bias) == (False, False, False)
    assert (c.head_dim, c.num_key_value_heads, c.tie_word_embeddings, c.rms_norm_eps) == (8, 2, True, 1e-5)
    assert c.layer_types == ("full_attention",) * 2 and c.mlp_types == ("dense",) * 2


def test_the_defaults_are_transformers_class_defaults():
    """A key left out means Ernie4_5Config's default: head_dim 128 (null: hidden / heads), a base of
    500000, a tied head, no biases; other families keep rotate-half pairs."""
    short = config_from_hf(dict(_SIZES, model_type="ernie4_5", num_hidden_layers=1))
    a = short.attention_config("full_attention")
    assert (short.head_dim, short.tie_word_embeddings, a.qkv_bias, short.mlp_bias) == (128, True, False, False)
    assert a.rope_scaling == {"rope_type": "default", "rope_theta": 500000.0} and a.rope_interleaved
    assert config_from_hf(dict(_SIZES, model_type="ernie4_5", num_hidden_layers=1, head_dim=None)).head_dim == 8
    assert not config_from_hf(dict(_SIZES, model_type="llama", num_hidden_layers=1)).rope_interleaved
    assert not config_from_hf(dict(_SIZES, model_type="ernie4_5", num_hidden_layers=1, use_bias=None)).mlp_bias


@needs_transformers
def test_the_defaults_are_ernie4_5_config_s():
    """Every key of the family's ``_DEFAULTS`` is the value of ``Ernie4_5Config()``'s, and its
    to_dict() is the model ``with_defaults`` describes (the base, 500000, is the reader's)."""
    from npattn.models.configs import with_defaults

    ours, theirs = with_defaults({"model_type": "ernie4_5"}), T.Ernie4_5Config().to_dict()
    for key, value in ours.items():
        assert theirs[key] == value, key
    meta = dict(bos_token_id=None, eos_token_id=None, max_position_embeddings=None)
    assert config_from_hf(theirs).replace(**meta) == config_from_hf({"model_type": "ernie4_5"}).replace(**meta)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Each head's rows ``(2, D/2)`` (rotate-half's pairs ``(i, i + D/2)``) as ``(D/2, 2)``: the
    pairs ``(2i, 2i + 1)`` (llama.cpp's ``LlamaModel.permute``)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_the_interleaved_pairs_are_llama_s_with_the_qk_rows_reordered():
    """ERNIE 4.5 rotates the pairs (2i, 2i+1) by pair i's angle; Llama rotates (i, i + D/2) by the
    same angle.  So ERNIE with q/k rows (and biases) reordered pair by pair is Llama (the scores are
    sums over the same pairs): equal logits, and gradients equal after the same reordering."""
    ernie = tiny_config("ernie4_5")
    llama = dict(
        {k: v for k, v in ernie.items() if k != "use_bias"},
        model_type="llama",
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,  # Ernie4_5Config's default (Llama's: 1e-6)
    )
    a = CausalLM(llama, rng=0, dtype=np.float64)
    heads = {"q_proj": ernie["num_attention_heads"], "k_proj": ernie["num_key_value_heads"]}

    def reordered(name, v):
        proj = name.split(".")[-2]
        return _permute(v, heads[proj]) if proj in heads else v

    b = CausalLM(ernie, dtype=np.float64)
    b.load_state_dict({k: reordered(k, v) for k, v in a.state_dict().items()})
    ids = np.array([[1, 5, 7, 2, 9, 3], [4, 4, 8, 0, 1, 2]])
    dlogits = np.random.default_rng(1).standard_normal((2, 6, ernie["vocab_size"]))
    outs = []
    for m in (a, b):
        m.zero_grad()
        outs.append(m(ids))
        m.backward(dlogits)
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-12, atol=1e-12)
    c = CausalLM(ernie, dtype=np.float64)
    c.load_state_dict(a.state_dict())  # the rows not reordered: other logits (the pairs matter)
    with no_grad():
        assert np.abs(c(ids) - outs[0]).max() > 1e-3
    grads = dict(b.named_parameters())
    for name, p in a.named_parameters():
        np.testing.assert_allclose(grads[name].grad, reordered(name, p.grad), rtol=1e-10, atol=1e-12, err_msg=name)


@needs_transformers
@pytest.mark.parametrize(
    "short",
    [
        dict(_SIZES, model_type="ernie4_5", num_hidden_layers=2),
        dict(_SIZES, model_type="ernie4_5", num_hidden_layers=1, head_dim=None, use_bias=True),
        dict(_SIZES, model_type="ernie4_5", num_hidden_layers=1, tie_word_embeddings=False, rope_theta=10.0),
    ],
)
def test_short_config_dicts_mean_what_they_mean_to_transformers(short):
    """A dict that leaves keys out (head_dim, the base, use_bias, the tied head) reads as
    transformers reads it: the same CausalLMConfig as transformers' full to_dict() of it."""
    full = T.AutoConfig.for_model(**short).to_dict()
    meta = dict(bos_token_id=None, eos_token_id=None, max_position_embeddings=None)
    assert config_from_hf(short).replace(**meta) == config_from_hf(full).replace(**meta)


@needs_transformers
def test_a_transformers_directory_loads_with_its_logits(tmp_path):
    """transformers' own save_pretrained directory (Ernie4_5ForCausalLM, biases) loads; the logits
    are transformers'."""
    import torch
    from _hf64 import randomize

    cfg = T.AutoConfig.for_model(**tiny_config("ernie4_5", tie_word_embeddings=False))
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = T.AutoModelForCausalLM.from_config(cfg).eval()
    randomize(hf, 0)
    hf.save_pretrained(tmp_path)
    m = CausalLM.from_pretrained(tmp_path)
    ids = np.array([[1, 5, 7, 2, 9, 3], [4, 4, 8, 0, 1, 2]])
    with torch.no_grad():
        want = hf(input_ids=torch.from_numpy(ids)).logits.numpy()
    np.testing.assert_allclose(m(ids), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(use_bias="true"), r"config\['use_bias'\]: expected true or false \(a JSON boolean\), got 'true'"),
        (dict(use_bias=1), r"config\['use_bias'\]: expected true or false"),
        (dict(attention_dropout=0.1), r"config\['attention_dropout'\] = 0.1 is not supported .* always 0"),
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
        (dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}), "partial_rotary_factor"),
        (dict(head_dim=0), r"config\['head_dim'\]: expected an integer >= 1, got 0"),
        # Llama's names for the biases: not Ernie4_5Config's (use_bias is the one switch)
        (dict(attention_bias=True), "key 'attention_bias' is not supported"),
        (dict(mlp_bias=True), "key 'mlp_bias' is not supported"),
        # the MoE variant's keys in a dense config
        (dict(moe_num_experts=4), "key 'moe_num_experts' is not supported"),
    ],
)
def test_refusals_name_the_key(bad, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf(tiny_config("ernie4_5", **bad))


def test_the_moe_variant_is_refused_by_name():
    """ERNIE 4.5's MoE (``ernie4_5_moe``) is not read: its model_type is named."""
    moe = dict(tiny_config("ernie4_5"), model_type="ernie4_5_moe", moe_num_experts=4, moe_k=2)
    match = r"config\['model_type'\]: expected one of \[.*'ernie4_5'.*\], got 'ernie4_5_moe'"
    with pytest.raises(ValueError, match=match):
        config_from_hf(moe)

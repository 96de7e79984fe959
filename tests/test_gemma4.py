"""Gemma 4's text model (``gemma4_text``) in ``CausalLM`` against transformers' own classes (eager
attention, float64 with transformers' float32 casts made float64): logits to 1e-9, every
parameter's gradient to 1e-8 by its Hugging Face name, cached decoding and padded batches to
1e-10, greedy ``generate``, the checkpoint round trips both ways, a multimodal ``gemma4``
directory, short config dicts read as transformers reads them, options refused by name; the
forward mode against central differences, and ``SharedKVAttention`` alone (a reusing layer's
gradient sent home) by gradcheck and gradgradcheck.

The tiny table's entry: six layers, the last three reusing keys and values (two of them the third
layer's, a sliding window of 3 keys that rolls while decoding; the last the first full layer's),
full-attention layers with their own head width and one kv head used as keys and values
(``attention_k_eq_v``) and proportional RoPE, per-layer input embeddings, a final softcap.  The
second case: the default layer pattern, values of their own, biases, an untied head, double-wide
MLPs on the reusing layer, narrower per-layer inputs; the third: no per-layer inputs, no sharing;
the fourth: the tiny entry with routed experts beside every MLP (``enable_moe_block``: a router
with its own norm, scale and per-expert scales, top 2 of 4 experts)."""

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
    float64_reference,
    hf_logits,
    state_dict,
)
from _multimodal import assert_unread_parts_refused  # noqa: E402
from _oracles import rel_err  # noqa: E402

import npattn  # noqa: E402
from npattn import no_grad  # noqa: E402
from npattn.models import CausalLM, config_from_hf  # noqa: E402
from npattn.models.tiny import tiny_config  # noqa: E402
from npattn.nn.module import Module  # noqa: E402
from npattn.nn.shared_kv import SharedKVAttention  # noqa: E402


def _kwargs(**changes) -> dict:
    d = tiny_config("gemma4_text", **changes)
    d.pop("model_type")
    return d


CASES = {
    "tiny": _kwargs(),
    "default_layers": _kwargs(
        num_hidden_layers=7,
        layer_types=None,  # five sliding, a full one, and the last made full by transformers
        num_kv_shared_layers=1,  # the last reuses the sixth's keys and values
        attention_k_eq_v=False,
        num_global_key_value_heads=None,
        use_double_wide_mlp=True,
        hidden_size_per_layer_input=2,
        attention_bias=True,
        tie_word_embeddings=False,
        final_logit_softcapping=None,
        sliding_window=4,
        rope_parameters=None,  # transformers' two: proportional RoPE (a quarter) on full layers
    ),
    # the large dense models' layout: no per-layer inputs, no KV sharing (transformers' own forward
    # fails on KV sharing without per-layer inputs: it slices them for the reusing layers)
    "no_per_layer_inputs": _kwargs(num_kv_shared_layers=0, hidden_size_per_layer_input=0),
    # the MoE layout (enable_moe_block): routed experts beside every layer's MLP
    "moe": _kwargs(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=8),
}


def _case(name):
    return build(T.Gemma4TextConfig, T.Gemma4ForCausalLM, **CASES[name])


def _ids(vocab, shape=(2, 9), seed=0):
    ids = np.random.default_rng(seed).integers(0, vocab, shape)
    ids[0, 1] = 0  # the pad token: its rows (both tables) are looked up too
    return ids


def test_the_tiny_config_exercises_gemma4s_twists():
    c = config_from_hf(tiny_config("gemma4_text"))
    assert c.kv_sources == (0, 1, 2, 2, 2, 1)  # two layers reuse a sliding layer's keys, one a full one's
    assert c.layer_types[-1] == "full_attention" and c.sliding_window == 3
    full, sliding = c.shared_kv["full_attention"], c.shared_kv["sliding_attention"]
    assert (full.head_dim, full.num_kv_heads, full.k_eq_v) == (8, 1, True)
    assert (sliding.head_dim, sliding.num_kv_heads, sliding.k_eq_v) == (4, 2, False)
    assert full.rope_scaling["rope_type"] == "proportional" and c.per_layer_input_size == 4
    m = CausalLM(c, rng=0)
    names = {n for n, _ in m.named_parameters()}
    assert "model.layers.3.self_attn.k_proj.weight" not in names  # a reusing layer
    assert "model.layers.1.self_attn.v_proj.weight" not in names  # k_eq_v
    assert {"model.embed_tokens_per_layer.weight", "model.layers.0.per_layer_input_gate.weight"} <= names
    assert "model.layers.0.layer_scalar" in m.state_dict()


@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_and_every_gradient_match_transformers(name):
    hf, cfg = _case(name)
    m = CausalLM.from_hf(state_dict(hf), cfg)
    assert m.dtype == np.float64
    ids = _ids(cfg["vocab_size"])
    dlogits = np.random.default_rng(1).standard_normal(ids.shape + (cfg["vocab_size"],))
    names = check_logits_and_grads(m, hf, ids, dlogits, names="subset")  # a parameter torch gives no gradient: zero
    # the layer whose keys and values three later layers reuse gets their gradient
    if name == "tiny":
        assert np.abs(names["model.layers.2.self_attn.k_proj.weight"].grad).max() > 0


@pytest.mark.parametrize("name", sorted(CASES))
def test_cached_decoding_matches_transformers(name):
    """Nine tokens, a prompt of four then one at a time: the producing sliding layer's cache rolls
    and the reusing layers read it."""
    hf, cfg = _case(name)
    check_cached_decoding(CausalLM.from_hf(state_dict(hf), cfg), hf, _ids(cfg["vocab_size"], seed=3))


@pytest.mark.parametrize("name", sorted(CASES))
def test_padded_batch_matches_transformers_and_each_row_alone(name):
    hf, cfg = _case(name)
    check_padded_batch(CausalLM.from_hf(state_dict(hf), cfg), hf, cfg["vocab_size"], (7, 4, 1), decode=2)


@pytest.mark.parametrize("name", sorted(CASES))
def test_greedy_generate_is_transformers(name):
    hf, cfg = _case(name)
    m = CausalLM.from_hf(state_dict(hf), cfg)
    ids = np.random.default_rng(5).integers(3, cfg["vocab_size"], (2, 5))
    with float64_reference(), torch.no_grad():
        ref = hf.generate(torch.from_numpy(ids), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    ref = ref.numpy()
    assert ref.shape == (2, 13)
    np.testing.assert_array_equal(m.generate(ids, 8, eos_token_id=[]), ref)


@pytest.mark.parametrize("name", sorted(CASES))
def test_checkpoints_both_ways(name, tmp_path):
    """transformers' save_pretrained read by npattn (every tensor as it is), npattn's
    save_pretrained read by transformers (the same keys, equal logits)."""
    hf, cfg = _case(name)
    sd = state_dict(hf)
    m = CausalLM.from_hf(sd, cfg)
    mine = m.state_dict()
    if cfg.get("tie_word_embeddings"):
        sd.pop("lm_head.weight")  # listed once, as save_pretrained does
    assert set(mine) == set(sd)
    for k, v in sd.items():
        np.testing.assert_array_equal(mine[k], v)
    hf.save_pretrained(tmp_path / "hf")  # transformers' own config.json (per_layer_config) and safetensors
    loaded = CausalLM.from_pretrained(tmp_path / "hf")
    assert loaded.dtype == np.float64 and loaded.config == m.config
    ids = _ids(cfg["vocab_size"])
    with no_grad():
        np.testing.assert_array_equal(loaded(ids), m(ids))
        ours = m(ids)
    m.save_pretrained(tmp_path / "np")
    back = T.AutoModelForCausalLM.from_pretrained(
        tmp_path / "np", attn_implementation="eager", experts_implementation="eager"
    ).eval()
    assert back.dtype == torch.float64 and type(back) is T.Gemma4ForCausalLM
    read = {k: v.numpy() for k, v in back.state_dict().items() if k != "lm_head.weight" or k in mine}
    assert set(read) == set(mine)
    for k, v in read.items():
        np.testing.assert_array_equal(v, mine[k])
    # its logits: near ours with the RoPE frequencies transformers made in float32 while loading
    # (float32's 6e-8 per angle, grown through the layers), 1e-9 in a model built in float64 holding
    # what it read
    assert rel_err(hf_logits(back, ids), ours, floor=1e-300, relative_to="max_b") < 1e-5
    twin, _ = _case(name)
    twin.load_state_dict(back.state_dict())
    assert rel_err(hf_logits(twin, ids), ours, floor=1e-300, relative_to="max_b") < 1e-9


def test_jvp_is_the_central_difference_of_the_logits():
    """Forward mode along every parameter (the reusing layers' tangents come from their source's
    keys and values) against central differences of the logits."""
    m = CausalLM(tiny_config("gemma4_text"), rng=0)
    rng = np.random.default_rng(6)
    for _, p in m.named_parameters():  # norms around 1, per-layer inputs that matter
        p.data[...] = p.data + 0.1 * rng.standard_normal(p.data.shape)
    ids = np.random.default_rng(7).integers(1, 41, (2, 7))  # no pad token: its rows take no tangent (as torch)
    v = {n: rng.standard_normal(p.data.shape) for n, p in m.named_parameters()}
    m(ids)
    tangent = m.jvp(param_tangents=v)
    eps = 1e-4

    def moved(s):
        for n, p in m.named_parameters():
            p.data[...] = p.data + s * v[n]
        with no_grad():
            out = m(ids)
        for n, p in m.named_parameters():
            p.data[...] = p.data - s * v[n]
        return out

    def central(h):
        return (moved(h) - moved(-h)) / (2 * h)

    numeric = (4 * central(eps / 2) - central(eps)) / 3  # Richardson: the h^2 term cancels
    assert np.abs(numeric).max() > 1e-2
    assert rel_err(tangent, numeric, floor=1e-300, relative_to="max_b") < 1e-7


def test_a_fine_tuning_step_is_transformers():
    """One SGD step on the mean cross-entropy, both sides from the same weights: the same loss
    and the same logits afterwards."""
    hf, cfg = _case("tiny")
    m = CausalLM.from_hf(state_dict(hf), cfg)
    ids = _ids(cfg["vocab_size"], seed=8)
    targets = np.roll(ids, -1, axis=1)
    lr = 0.5
    loss, dlogits = m.loss(ids, targets)
    m.zero_grad()
    m.backward(dlogits)
    for p in m.parameters():
        p.data = p.data - lr * p.grad
    with float64_reference():
        logits = hf(input_ids=torch.from_numpy(ids), use_cache=False).logits
        ref_loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), torch.from_numpy(targets).reshape(-1)
        )
        hf.zero_grad()
        ref_loss.backward()
        with torch.no_grad():
            for p in hf.parameters():
                p -= lr * p.grad
    assert loss == pytest.approx(ref_loss.item(), rel=1e-12)
    with no_grad():
        after = m(ids)
    assert rel_err(after, hf_logits(hf, ids), floor=1e-300, relative_to="max_b") < 1e-9


# a tiny vision and audio tower beside the text model (their weights are set aside when loading)
_VISION = dict(
    hidden_size=8,
    intermediate_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=4,
    patch_size=2,
    position_embedding_size=16,
    pooling_kernel_size=1,
)
_AUDIO = dict(
    hidden_size=8,
    num_hidden_layers=1,
    num_attention_heads=2,
    subsampling_conv_channels=[4, 4],
    output_proj_dims=8,
    conv_kernel_size=3,
)


def test_multimodal_checkpoint_loads_its_text_model(tmp_path):
    """A ``gemma4`` directory (``text_config``, the text model under ``model.language_model.*``
    beside the vision and audio towers and their embedders): from_pretrained loads the text model
    with the logits of transformers' multimodal class on text, and says which towers' tensors it
    left aside; a tensor of no known tower and a top-level option are refused by name."""
    hf, cfg = build(
        T.Gemma4Config, T.Gemma4ForConditionalGeneration, text_config=CASES["tiny"], vision_config=_VISION,
        audio_config=_AUDIO,
    )  # fmt: skip
    hf.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match=r"model\.audio_tower\.\* \(\d+ tensors\).*model\.vision_tower\.\* \("):
        m = CausalLM.from_pretrained(tmp_path)
    assert m.config.model_type == "gemma4_text"
    ids = _ids(cfg["text_config"]["vocab_size"])
    with no_grad():
        assert rel_err(m(ids), hf_logits(hf, ids), floor=1e-300, relative_to="max_b") < 1e-9
    assert_unread_parts_refused(
        tmp_path, "model.speech_tower.w", lambda good: [({"video_config": {}}, "'video_config'")]
    )


_SHORT = dict(model_type="gemma4_text", vocab_size=41, hidden_size=16, intermediate_size=24, num_attention_heads=4)


@pytest.mark.parametrize(
    "short",
    [
        dict(_SHORT, num_hidden_layers=6, head_dim=4, global_head_dim=8),
        dict(_SHORT, num_hidden_layers=7, head_dim=4, global_head_dim=8, num_kv_shared_layers=1),
        dict(
            _SHORT,
            num_hidden_layers=4,
            head_dim=4,
            global_head_dim=8,
            attention_k_eq_v=True,
            num_global_key_value_heads=1,
            num_key_value_heads=2,
            layer_types=["sliding_attention", "full_attention"] * 2,
            hidden_size_per_layer_input=0,
        ),  # fmt: skip
    ],
)
def test_short_config_dicts_mean_what_they_mean_to_transformers(short):
    full = T.AutoConfig.for_model(**short).to_dict()  # per_layer_config in place of global_head_dim
    assert "per_layer_config" in full
    meta = dict(bos_token_id=None, eos_token_id=None, max_position_embeddings=None)  # not the network
    a, b = config_from_hf(short), config_from_hf(full)
    assert a.replace(**meta) == b.replace(**meta)
    assert a.layer_types == tuple(full["layer_types"]) and a.rope == b.rope


def test_refusals_name_the_key():
    for change, key in [
        (dict(enable_moe_block=True), "'num_experts'"),
        (dict(enable_moe_block=True, num_experts=2, top_k_experts=3, moe_intermediate_size=4), "'top_k_experts'"),
        (dict(use_bidirectional_attention="all"), "'use_bidirectional_attention'"),
        (dict(num_kv_shared_layers=6), "'num_kv_shared_layers'"),
        (dict(num_kv_shared_layers=5), r"'num_kv_shared_layers'.*no full_attention layer"),
        (dict(attention_dropout=0.1), "'attention_dropout'"),
        (dict(vocab_size_per_layer_input=40), "'vocab_size_per_layer_input'"),
        (dict(rope_parameters={"sliding_attention": {"rope_type": "default"}}), r"\['sliding_attention'\]"),
        (
            dict(rope_parameters={"sliding_attention": {"rope_type": "yarn", "rope_theta": 1.0, "factor": 2.0}}),
            "'rope_type'",
        ),
        (dict(per_layer_config={"1": {"intermediate_size": 8}}), "'intermediate_size'"),
        (dict(per_layer_config={"1": {"head_dim": 8}}), "per_layer_config.*layer 5"),
        (dict(rope_theta=10.0), "'rope_theta'"),
    ]:
        with pytest.raises(ValueError, match=key):
            config_from_hf(tiny_config("gemma4_text", **change))


class _Pair(Module):
    """Two ``SharedKVAttention`` layers, the second reusing the first's keys and values:
    ``y = b(x2) + a(x1)`` (a module of two inputs, so that gradcheck sees both paths)."""

    def __init__(self, **kw):
        super().__init__()
        self.a = SharedKVAttention(12, 4, 2, 6, rng=0, **kw)
        self.b = SharedKVAttention(12, 4, 2, 6, rng=1, reuse=True, **kw)
        self.b.share_from(self.a)
        rng = np.random.default_rng(2)
        for n, p in self.named_parameters():
            if "norm" in n:
                p.data[...] = 1 + 0.3 * rng.standard_normal(p.data.shape)

    def forward(self, x1, x2):
        y = self.a._forward(x1) + self.b._forward(x2)
        self.save_for_backward(None)
        return y

    def backward(self, dy):
        dy = self._check_dy(dy)
        self.pop_saved()
        dx2 = self.b._backward(dy)  # first: it sends dk, dv home
        return self.a._backward(dy), dx2

    def _jvp(self, state, input_tangents, param_tangents):
        t1, t2 = input_tangents
        return self._child_jvp(self.a, -1, (t1,), param_tangents) + self._child_jvp(self.b, -1, (t2,), param_tangents)

    def _backward_jvp(self, state, dy, input_tangents, param_tangents, ddy):
        t1, t2 = input_tangents
        self._child_jvp(self.a, -1, (t1,), param_tangents)  # its keys' tangents, for b
        g2 = self._child_backward_jvp(self.b, dy, (t2,), param_tangents, ddy)
        g1 = self._child_backward_jvp(self.a, dy, (t1,), param_tangents, ddy)
        return (g1[0], g2[0]), (g1[1], g2[1])


@pytest.mark.parametrize(
    "kw",
    [
        dict(rope_scaling={"rope_theta": 50.0}, window=(2, 0)),
        dict(rope_scaling={"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 50.0}, k_eq_v=True),
    ],
)
def test_shared_kv_attention_sends_the_gradient_home(kw):
    """gradcheck (backward and JVP, both inputs and every parameter: the reusing layer's gradient
    reaches the first layer's key and value projections) and gradgradcheck (the second order)."""
    rng = np.random.default_rng(3)
    x1, x2 = rng.standard_normal((2, 5, 12)), rng.standard_normal((2, 5, 12))
    pair = _Pair(**kw)
    assert npattn.gradcheck(pair, x1, x2, mode="both").ok
    assert npattn.gradgradcheck(pair, x1, x2).ok
    # without the reusing layer's share, a's key projection would miss part of its gradient
    pair.zero_grad()
    y = pair(x1, x2)
    dy = rng.standard_normal(y.shape)
    pair.backward(dy)
    full = pair.a.k_proj.weight.grad.copy()
    pair.zero_grad()
    pair.a._forward(x1)
    pair.a._backward(dy)
    assert rel_err(pair.a.k_proj.weight.grad, full, floor=1e-300, relative_to="max_b") > 1e-3


def test_proportional_rope_in_both_tiers_is_transformers():
    """``rope_type "proportional"``: every pair of the head turns, the first ``int(p d // 2)`` at
    ``base**(-2i/d)`` and the rest not at all, as transformers' ``_compute_proportional_rope_parameters``
    (float64 here); the fast tier's rotation is the textbook tier's, and differs from the other
    types' partial rotary (which rotates a smaller head)."""
    from transformers.modeling_rope_utils import _compute_proportional_rope_parameters

    from npattn import functional as F
    from npattn.functional import reference as R
    from npattn.functional.rope_scaling import rope_frequencies

    for d, p, factor in [(16, 0.25, 1.0), (12, 0.5, 2.0), (8, 1.0, 1.0)]:
        params = {"rope_type": "proportional", "partial_rotary_factor": p, "rope_theta": 500.0, "factor": factor}
        cfg = T.Gemma4TextConfig(
            global_head_dim=d,
            rope_parameters={
                "full_attention": params,
                "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
            },
        )
        with float64_reference():
            ref, _ = _compute_proportional_rope_parameters(cfg, layer_type="full_attention")
        inv, att = rope_frequencies(d, scaling=params)
        assert att == 1.0 and rel_err(inv, ref.numpy(), floor=1e-300, relative_to="max_b") < 1e-15
        assert (inv[int(p * d // 2) :] == 0).all() and (inv[: int(p * d // 2)] > 0).all()
        x = np.random.default_rng(0).standard_normal((2, 3, 7, d))
        pos = np.arange(7) + 5
        fast, _ = F.rope(x, pos, scaling=params)
        slow, _ = R.rope(x, pos, scaling=params, base=500.0)
        assert rel_err(fast, slow, floor=1e-300, relative_to="max_b") < 1e-14
        if p < 1:
            partial, _ = F.rope(x, pos, scaling={"partial_rotary_factor": p, "rope_theta": 500.0})
            assert rel_err(partial, fast, floor=1e-300, relative_to="max_b") > 1e-3


def test_reusing_layers_hold_no_cache():
    """Cache bytes: a reusing layer holds none (it reads its source's), so the model with KV
    sharing holds exactly the reusing layers' worth less than the same model without; the logits
    of its cached decoding are the full pass's."""
    ids = _ids(41, (2, 9), seed=9)

    def decode(cfg):
        m = CausalLM(cfg, rng=0)
        with no_grad():
            full = m(ids)
            m.reset_kv_cache()
            out = np.concatenate(
                [m(ids[:, :5], use_cache=True)] + [m(ids[:, t : t + 1], use_cache=True) for t in range(5, 9)], 1
            )
        assert rel_err(out, full, floor=1e-300, relative_to="max_b") < 1e-12
        return [layer.attention for layer in m.model.layers]

    shared = decode(tiny_config("gemma4_text"))
    alone = decode(tiny_config("gemma4_text", num_kv_shared_layers=0))
    assert [a.kv_cache_nbytes == 0 for a in shared] == [False, False, False, True, True, True]
    assert all(a.kv_cache_length == 9 for a in shared)
    sliding, full = alone[2].kv_cache_nbytes, alone[1].kv_cache_nbytes
    # tokens x (keys, values) x batch x kv heads x head_dim x 8 bytes: a window of 2 past keys, 9 keys
    assert sliding == 2 * 2 * 2 * 2 * 4 * 8 and full == 9 * 2 * 2 * 1 * 8 * 8
    assert sum(a.kv_cache_nbytes for a in alone) - sum(a.kv_cache_nbytes for a in shared) == 2 * sliding + full


def test_npattn_check_covers_gemma4s_layers():
    """``npattn check`` (both orders) runs SharedKVAttention (keys as values with proportional RoPE,
    a window with biases), the per-layer input and the per-layer embeddings."""
    from npattn.tools.check import cases

    for order in (1, 2):
        found = {n: t for n, t in cases(0, order=order) if n.startswith(("SharedKVAttention", "PerLayer", "Dense"))}
        assert len(found) == 5, sorted(found)
        for name, thunk in found.items():
            assert thunk().ok, (order, name)


def test_bidirectional_vision_is_causal_text():
    """``use_bidirectional_attention="vision"`` (the released configs') concerns image tokens only:
    the text model is causal, as transformers' is; ``"all"`` is refused (test_refusals_name_the_key)."""
    hf, cfg = build(
        T.Gemma4TextConfig, T.Gemma4ForCausalLM, **dict(CASES["tiny"], use_bidirectional_attention="vision")
    )
    assert cfg["use_bidirectional_attention"] == "vision"
    m = CausalLM.from_hf(state_dict(hf), cfg)
    ids = _ids(cfg["vocab_size"], seed=10)
    with no_grad():
        assert rel_err(m(ids), hf_logits(hf, ids), floor=1e-300, relative_to="max_b") < 1e-9


def test_moe_hvp_is_the_central_difference_of_the_gradient():
    """loss_hvp with routed experts beside the MLPs (the choice constant near the point) against
    central differences of the gradient, every parameter's block on its own scale."""
    m = CausalLM(tiny_config("gemma4_text", **{k: CASES["moe"][k] for k in ("enable_moe_block", "num_experts",
                 "top_k_experts", "moe_intermediate_size")}), rng=0)  # fmt: skip
    rng = np.random.default_rng(11)
    for _, p in m.named_parameters():
        p.data[...] = p.data + 0.1 * rng.standard_normal(p.data.shape)
    ids = rng.integers(1, 41, (2, 6))
    targets = rng.integers(0, 41, (2, 6))
    v = {n: 0.1 * rng.standard_normal(p.data.shape) for n, p in m.named_parameters()}  # a short step: the choice stays
    _, _, hvp = m.loss_hvp(ids, targets, v)
    eps = 1e-5

    def grads(s):
        for n, p in m.named_parameters():
            p.data[...] = p.data + s * v[n]
        m.zero_grad()
        _, dlogits = m.loss(ids, targets)
        m.backward(dlogits)
        out = {n: p.grad.copy() for n, p in m.named_parameters()}
        for n, p in m.named_parameters():
            p.data[...] = p.data - s * v[n]
        return out

    up, down = grads(eps), grads(-eps)
    scale = max(np.abs((up[n] - down[n]) / (2 * eps)).max() for n in v)
    for n in v:
        num = (up[n] - down[n]) / (2 * eps)
        assert rel_err(hvp[n], num, floor=1e-6 * scale, relative_to="max_b") < 1e-5, n
    assert np.abs(hvp["model.layers.0.router.per_expert_scale"]).max() > 0

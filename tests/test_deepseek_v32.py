"""DeepSeek-V3.2 (``deepseek_v32``) in ``CausalLM`` against transformers' own ``DeepseekV32ForCausalLM``
in float64 (its float32 casts made float64 by ``float64_reference``), the tiny config's indexer
choosing 3 keys of up to 9 so that the choice matters:

* logits 1e-9 and every parameter's gradient by its Hugging Face name 1e-8 (the indexer's, which
  transformers computes under ``no_grad``, get zero: the choice is piecewise constant);
* cached decoding (the indexer keys kept beside the latents) 1e-10 against the full pass;
* a left-padded batch 1e-10 at the real tokens against transformers and each row alone;
* the choice is stable: every choice made in these tests has a clear gap between the k-th and the
  (k+1)-th visible score (asserted on each call), and it matters (the dense model differs);
* the indexer's parameters trained by its KL loss: their gradient against torch autograd of the
  same loss on transformers' layer;
* checkpoints both ways (transformers' save_pretrained read by npattn, the same names written back).
"""

import functools

import numpy as np
import pytest
from _oracles import rel_err

from npattn import no_grad

_rel = functools.partial(rel_err, floor=1e-300, relative_to="max_b")
GAP = 1e-6  # the smallest gap (relative to the row's largest |score|) between the k-th and (k+1)-th


@pytest.fixture(autouse=True)
def stable_choice(monkeypatch):
    """Every top-k choice the model makes in these tests has a clear gap at its border (no tie
    that a rounding could break differently in torch); the gaps seen are returned."""
    import npattn.nn.latent_attention as LA

    real = LA.index_topk_kernel
    seen = []

    def checked(scores, topk, visible=None):
        z = np.where(visible, scores, -np.inf) if visible is not None else scores
        srt = -np.sort(-z, axis=-1)
        if srt.shape[-1] > topk:
            kth, nxt = srt[..., topk - 1], srt[..., topk]
            rows = np.isfinite(nxt)  # rows that see more than topk keys: the choice is a real one
            if rows.any():
                scale = np.maximum(np.abs(srt[..., :1]).max(-1), 1e-30)[rows]
                gap = ((kth[rows] - nxt[rows]) / scale).min()  # rows only: -inf - -inf elsewhere
                assert gap > GAP, f"a near tie at the top-{topk} border: relative gap {gap}"
                seen.append(gap)
        return real(scores, topk, visible)

    monkeypatch.setattr(LA, "index_topk_kernel", checked)
    return seen


def _model(seed=0, **changes):
    pytest.importorskip("torch")
    T = pytest.importorskip("transformers")
    from _hf64 import build, state_dict

    from npattn.models import CausalLM
    from npattn.models.tiny import tiny_config

    kwargs = {k: v for k, v in tiny_config("deepseek_v32", **changes).items() if k != "model_type"}
    hf, cfg = build(T.DeepseekV32Config, T.DeepseekV32ForCausalLM, seed=seed, **kwargs)
    return hf, cfg, CausalLM.from_hf(state_dict(hf), cfg)


def _hf_logits(hf, ids, **kwargs):
    import torch
    from _hf64 import float64_reference

    with float64_reference(), torch.no_grad():
        return hf(input_ids=torch.from_numpy(ids), use_cache=False, **kwargs).logits.numpy()


def test_config_reads_as_transformers(stable_choice):
    from npattn.models import config_from_hf
    from npattn.models.tiny import tiny_config
    from npattn.nn.latent_attention import LightningIndexer, MultiHeadLatentAttention

    hf, cfg, m = _model()
    assert config_from_hf(tiny_config("deepseek_v32")) == m.config  # the short dict as transformers' to_dict
    lat = m.config.latent
    assert (lat.index_topk, lat.index_n_heads, lat.index_head_dim) == (3, 16, 8)
    for layer in m.model.layers:
        assert isinstance(layer.attention, MultiHeadLatentAttention)
        assert isinstance(layer.attention.indexer, LightningIndexer)
    assert m.config.mlp_types == ("dense", "moe")


def test_logits_and_every_gradient_match_transformers(stable_choice):
    from _hf64 import check_logits_and_grads, hf_logits

    hf, cfg, m = _model()
    rng = np.random.default_rng(1)
    ids = rng.integers(0, cfg["vocab_size"], (2, 9))
    dlogits = rng.standard_normal(ids.shape + (cfg["vocab_size"],))
    names = check_logits_and_grads(m, hf, ids, dlogits, names="subset")  # transformers' indexer: no_grad, zero here
    assert stable_choice  # choices were made (rows seeing more than 3 keys), each with a clear gap
    assert set(names) == {n for n, _ in hf.named_parameters()}
    no_grad_names = {n for n, p in hf.named_parameters() if p.grad is None}
    assert no_grad_names and all(".indexer." in n for n in no_grad_names)
    ref = hf_logits(hf, ids)
    # the choice matters: the same weights attending densely give other logits
    from npattn.models import CausalLM

    dense = CausalLM.from_hf(m.state_dict(), dict(cfg, index_topk=9))
    with no_grad():
        assert _rel(dense(ids), ref) > 1e-3


def test_cached_decoding_matches_the_full_pass(stable_choice):
    hf, cfg, m = _model(3)
    ids = np.random.default_rng(3).integers(0, cfg["vocab_size"], (2, 9))
    ref = _hf_logits(hf, ids)
    m.reset_kv_cache()
    with no_grad():
        parts = [m(ids[:, :4], use_cache=True)] + [m(ids[:, t : t + 1], use_cache=True) for t in range(4, 9)]
    assert _rel(np.concatenate(parts, axis=1), ref) < 1e-10
    att = m.model.layers[0].attention
    assert att._index_keys.shape == (2, 9, 8)  # each token's indexer key, beside its latent
    assert att.cache_bytes_per_token() == (8 + 4 + 8) * 8  # latent, rotated key, indexer key; float64
    m.reset_kv_cache()
    assert att._index_keys is None


def test_padded_batch_matches_transformers_and_each_row_alone(stable_choice):
    pytest.importorskip("torch")
    from _hf64 import check_padded_batch

    hf, cfg, m = _model(4)
    check_padded_batch(m, hf, cfg["vocab_size"], (8, 5, 2), decode=2)


def test_checkpoint_round_trips(tmp_path, stable_choice):
    from npattn.models import CausalLM
    from npattn.models.hf import open_checkpoint

    hf, cfg, m = _model(5)
    hf.save_pretrained(tmp_path / "hf")
    theirs = set(open_checkpoint(tmp_path / "hf")[1])
    assert "model.layers.0.self_attn.indexer.wq_b.weight" in theirs
    loaded = CausalLM.from_pretrained(tmp_path / "hf")
    assert loaded.config == m.config
    ids = np.random.default_rng(5).integers(0, cfg["vocab_size"], (1, 7))
    with no_grad():
        np.testing.assert_array_equal(loaded(ids), m(ids))
    m.save_pretrained(tmp_path / "ours")
    assert set(open_checkpoint(tmp_path / "ours")[1]) == theirs


def test_indexer_kl_training_gradients_match_torch_autograd(stable_choice):
    """The indexer learns from its own loss: ``indexer_loss`` (the KL divergence of the main
    attention's head-summed, normalised weights over each query's chosen keys, held fixed, to the
    indexer's softmax over them) and its gradient to each indexer parameter, against torch autograd
    of the same loss written on transformers' own layer (its indexer's scoring lines without
    ``no_grad``, its eager attention's weights detached)."""
    torch = pytest.importorskip("torch")
    from _hf64 import float64_reference
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as M

    from npattn.nn.latent_attention import MultiHeadLatentAttention

    hf, cfg, _ = _model(6)
    layer = hf.model.layers[1].self_attn
    ours = MultiHeadLatentAttention.from_config(cfg)
    ours.load_state_dict({k: v.detach().numpy().copy() for k, v in layer.state_dict().items()})
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 9, cfg["hidden_size"]))
    L = x.shape[1]
    with float64_reference():
        h = torch.from_numpy(x)
        pos = torch.arange(L)[None]
        cos, sin = hf.model.rotary_emb(h, pos)
        causal = torch.full((L, L), torch.finfo(torch.float64).min).triu(1)[None, None].expand(2, 1, L, L)
        _, weights = layer(hidden_states=h, position_embeddings=(cos, sin), attention_mask=causal)
        target = weights.detach()  # (B, H, L, L): 0 off the chosen keys
        ix = layer.indexer
        q_resid = layer.q_a_layernorm(layer.q_a_proj(h))
        q = ix.wq_b(q_resid).view(2, L, ix.n_heads, ix.head_dim)
        k = ix.k_norm(ix.wk(h)).unsqueeze(2)
        dr = ix.qk_rope_head_dim
        q_rot, k_rot = M.apply_rotary_pos_emb(q[..., :dr], k[..., :dr], cos, sin, unsqueeze_dim=2)
        q = torch.cat([q_rot, q[..., dr:]], -1).transpose(1, 2)  # (B, Hi, L, D)
        k = torch.cat([k_rot, k[..., dr:]], -1).squeeze(2)  # (B, L, D)
        s = torch.relu(q @ k.transpose(-1, -2).unsqueeze(1) * ix.softmax_scale)
        w = ix.weights_proj(h) * ix.n_heads**-0.5  # (B, L, Hi)
        scores = (w.transpose(-1, -2).unsqueeze(-1) * s).sum(1)  # (B, L, L)
        chosen = target.sum(1) > 0
        p = target.sum(1) / target.sum((1, 3)).unsqueeze(-1)
        logq = torch.log_softmax(scores.masked_fill(~chosen, float("-inf")), -1)
        loss = torch.where(chosen, p * (torch.log(torch.where(chosen, p, 1.0)) - logq), 0.0).sum()
        loss.backward()
    assert chosen.sum(-1).max() == 3 and (chosen.sum(-1) < 3).any()  # top 3, fewer for early queries
    ours.zero_grad()
    got = ours.indexer_loss(x)
    assert _rel(got, loss.item()) < 1e-12
    params = dict(ours.named_parameters())
    for name, prm in ix.named_parameters():
        assert _rel(params["indexer." + name].grad, prm.grad.numpy()) < 1e-8, name
    # only the indexer learns from this loss
    assert all(not p.grad.any() for n, p in params.items() if not n.startswith("indexer."))


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(index_head_dim=2), r"config\['index_head_dim'\]: expected at least qk_rope_head_dim=4"),
        (dict(index_topk=0), r"config\['index_topk'\]: expected an integer >= 1"),
        (dict(layer_types=["indexed_attention", "full_attention"]), r"config\['layer_types'\]: 'full_attention'"),
        (dict(mlp_layer_types=["dense", "moe"]), r"config\['mlp_layer_types'\]: expected 2 entries"),
        (dict(rope_interleave=False), r"config\['rope_interleave'\] = False is not supported"),
        (dict(q_lora_rank=None), r"needs the key 'q_lora_rank'"),
        (dict(index_share_weights=True), r"config: key 'index_share_weights' is not supported"),
    ],
)
def test_config_refusals_name_the_key(changes, message):
    from npattn.models import config_from_hf
    from npattn.models.tiny import tiny_config

    with pytest.raises(ValueError, match=message):
        config_from_hf(tiny_config("deepseek_v32", **changes))


def test_module_refusals_name_the_argument():
    from npattn.nn.latent_attention import MultiHeadLatentAttention

    dims = dict(kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)
    with pytest.raises(ValueError, match="index_topk: the lightning indexer reads the low-rank query"):
        MultiHeadLatentAttention(16, 4, index_topk=2, **dims)
    with pytest.raises(ValueError, match="index_head_dim: expected at least qk_rope_head_dim=4, got 2"):
        MultiHeadLatentAttention(16, 4, q_lora_rank=8, index_topk=2, index_head_dim=2, **dims)
    dense = MultiHeadLatentAttention(16, 4, q_lora_rank=8, **dims)
    with pytest.raises(ValueError, match="index_topk: this MultiHeadLatentAttention has no lightning indexer"):
        dense.indexer_loss(np.zeros((1, 3, 16)))
    sparse = MultiHeadLatentAttention(16, 4, q_lora_rank=8, index_topk=2, index_n_heads=2, index_head_dim=4, **dims)
    with pytest.raises(ValueError, match=r"x: expected shape \(\.\.\., L, 16\)"):
        sparse.indexer_loss(np.zeros((1, 3, 15)))
    with pytest.raises(ValueError, match="reduction: expected 'sum' or 'mean'"):
        sparse.indexer_loss(np.zeros((1, 3, 16)), reduction="none")
    with pytest.raises(ValueError, match="attn_mask: expected one mask for every head"):
        sparse(np.zeros((1, 3, 16)), attn_mask=np.ones((1, 4, 3, 3), bool))


def test_scaled_config_scales_the_indexer_width():
    """The bench's sizes (``scaled_config``): the indexer's head width grows with the rotated part it
    contains (at width 128 it was left at 8 below qk_rope_head_dim = 32, a model neither library builds)."""
    from npattn.models import config_from_hf
    from npattn.models.tiny import scaled_config

    cfg = config_from_hf(scaled_config("deepseek_v32", hidden=128, layers=3, vocab=1024))
    assert (cfg.latent.index_head_dim, cfg.latent.qk_rope_head_dim, cfg.latent.index_topk) == (64, 32, 3)


def _sparse_layer(topk, seed=0):
    from npattn.nn.latent_attention import MultiHeadLatentAttention

    dims = dict(kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4, q_lora_rank=8)
    sparse = MultiHeadLatentAttention(16, 4, index_topk=topk, index_n_heads=16, index_head_dim=8, rng=seed, **dims)
    dense = MultiHeadLatentAttention(16, 4, rng=seed, **dims)
    dense.load_state_dict({k: v for k, v in sparse.state_dict().items() if not k.startswith("indexer.")})
    return sparse, dense


def test_a_choice_of_every_key_is_dense_mla_and_masks_combine(stable_choice):
    """``index_topk`` at least the sequence: every visible key chosen, dense MLA's outputs and
    gradients exactly; a float mask (0 / -inf) chooses and attends as the boolean one."""
    rng = np.random.default_rng(7)
    x, dy = rng.standard_normal((2, 6, 16)), rng.standard_normal((2, 6, 16))
    sparse, dense = _sparse_layer(6)
    np.testing.assert_array_equal(sparse(x), dense(x))
    np.testing.assert_array_equal(sparse.backward(dy), dense.backward(dy))
    sparse, _ = _sparse_layer(2)
    keep = rng.random((2, 1, 1, 6)) > 0.2
    keep[..., 0] = True
    a = sparse(x, attn_mask=keep)
    b = sparse(x, attn_mask=np.where(keep, 0.0, -np.inf))
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-15)
    assert not np.allclose(a, sparse(x))  # the mask changed the choice and the attention


def test_yarn_rotation_of_the_indexer_matches_transformers(stable_choice):
    """DeepSeek-V3.2's released configs rotate with YaRN: the indexer's rotate-half RoPE takes the
    same frequencies and attention factor on cos/sin as MLA's interleaved one (transformers passes
    both the one ``position_embeddings``), and MLA's softmax scale its mscale."""
    from _hf64 import hf_logits_and_grads

    yarn = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 4,
        "mscale": 1.0,
        "mscale_all_dim": 0.7,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    }
    hf, cfg, m = _model(8, rope_parameters=yarn)
    assert m.config.latent.rope_scaling["rope_type"] == "yarn"
    rng = np.random.default_rng(8)
    ids = rng.integers(0, cfg["vocab_size"], (2, 9))
    dlogits = rng.standard_normal(ids.shape + (cfg["vocab_size"],))
    ref, ref_grads = hf_logits_and_grads(hf, ids, dlogits)
    assert _rel(m(ids), ref) < 1e-9
    m.zero_grad()
    m.backward(dlogits)
    for n, p in m.named_parameters():
        if n in ref_grads:
            assert _rel(p.grad, ref_grads[n]) < 1e-8, n


def test_decoding_gathers_the_chosen_latents(monkeypatch, stable_choice):
    """A cached call reads each query's chosen latents only (the gathered ``sparse_attention``),
    never the dense core, with the full pass's logits."""
    import npattn.nn.latent_attention as LA

    hf, cfg, m = _model(9)
    ids = np.random.default_rng(9).integers(0, cfg["vocab_size"], (2, 8))
    with no_grad():
        full = m(ids)
    calls = []
    real = LA.sparse_attention_kernel

    def counted(q, k, v, indices, scale):
        calls.append(indices.shape)
        return real(q, k, v, indices, scale)

    monkeypatch.setattr(LA, "sparse_attention_kernel", counted)
    monkeypatch.setattr(LA.K, "scaled_dot_product_attention", None)  # the dense core is not called
    m.reset_kv_cache()
    with no_grad():
        parts = [m(ids[:, :5], use_cache=True)] + [m(ids[:, t : t + 1], use_cache=True) for t in range(5, 8)]
    assert _rel(np.concatenate(parts, axis=1), full) < 1e-12
    assert calls == [(2, 5, 3)] * 2 + [(2, 1, 3)] * 6  # two layers per call: K = 3 keys per query

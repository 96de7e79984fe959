"""Kimi Linear's KDA layer (``npattn.nn.kimi_delta.KimiDeltaAttention``) against transformers' own
``KimiLinearDeltaAttention`` in float64 (its float32 casts made float64 by ``float64_reference``):
outputs 1e-9, every parameter's gradient by its Hugging Face name and the input's 1e-8, decoding
with the cache (conv window and recurrent state) 1e-10, a left-padded batch 1e-10 at the real
tokens; the JVP against central differences; the second order by gradgradcheck."""

import functools
import os
import subprocess
import sys

import numpy as np
import pytest

from npattn.nn.kimi_delta import KimiDeltaAttention
from tests._hf64 import check_cached_decoding, check_padded_batch, float64_reference, randomize
from tests._oracles import rel_err

H, D, HIDDEN, K_TAPS = 2, 4, 12, 3


def _pair(seed=0):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.models.kimi_linear import configuration_kimi_linear as C
    from transformers.models.kimi_linear import modeling_kimi_linear as M

    cfg = C.KimiLinearConfig(
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        linear_attn_config={
            "num_heads": H,
            "head_dim": D,
            "short_conv_kernel_size": K_TAPS,
            "kda_layers": [1],
            "full_attn_layers": [2],
        },
        rms_norm_eps=1e-5,
    )
    with float64_reference():
        torch.manual_seed(seed)
        hf = M.KimiLinearDeltaAttention(cfg, 0).double().eval()
        # a bare layer skips the model's _init_weights: A_log and dt_bias (torch.empty) drawn as there
        with torch.no_grad():
            hf.forget_gate.A_log.copy_(torch.empty(1, 1, H, 1).uniform_(1.0, 16.0).log())
            dt = torch.empty(H * D).uniform_(np.log(1e-3), np.log(1e-1)).exp()
            hf.forget_gate.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        randomize(hf, seed, scale=0.3)
    ours = KimiDeltaAttention(
        HIDDEN,
        linear_num_heads=H,
        linear_head_dim=D,
        linear_conv_kernel_dim=K_TAPS,
        rms_norm_eps=1e-5,
        chunk_size=4,
        rng=0,
    )
    ours.load_state_dict({k: v.detach().numpy().copy() for k, v in hf.state_dict().items()})
    return torch, M, cfg, hf, ours


def test_forward_and_every_gradient_match_transformers():
    torch, M, cfg, hf, ours = _pair()
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 11, HIDDEN))
    dy = rng.standard_normal((2, 11, HIDDEN))
    xt = torch.from_numpy(x).requires_grad_(True)
    with float64_reference():
        yt = hf(xt)
        yt.backward(torch.from_numpy(dy))
    y = ours(x)
    np.testing.assert_allclose(y, yt.detach().numpy(), rtol=0, atol=1e-9)
    dx = ours.backward(dy)
    np.testing.assert_allclose(dx, xt.grad.numpy(), rtol=0, atol=1e-8)
    params = dict(ours.named_parameters())
    for name, p in hf.named_parameters():
        np.testing.assert_allclose(params[name].grad, p.grad.numpy(), rtol=0, atol=1e-8, err_msg=name)
    assert set(params) == {n for n, _ in hf.named_parameters()}


def test_cached_decoding_matches_transformers():
    torch, M, cfg, hf, ours = _pair(2)
    from transformers.cache_utils import DynamicCache

    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 9, HIDDEN))
    cache = DynamicCache(config=cfg)  # layer 0 is the KDA layer
    outs, ref = [], []
    with float64_reference(), torch.no_grad():
        for a, b in ((0, 5), (5, 6), (6, 7), (7, 9)):
            ref.append(hf(torch.from_numpy(x[:, a:b]), cache=cache).numpy())
    for a, b in ((0, 5), (5, 6), (6, 7), (7, 9)):
        outs.append(ours(x[:, a:b], use_cache=True))
    np.testing.assert_allclose(np.concatenate(outs, 1), np.concatenate(ref, 1), rtol=0, atol=1e-10)
    ours.reset_kv_cache()
    np.testing.assert_allclose(np.concatenate(outs, 1), ours(x), rtol=0, atol=1e-10)


def test_padded_batch_matches_each_row_alone():
    torch, M, cfg, hf, ours = _pair(4)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 8, HIDDEN))
    mask = np.ones((2, 8), np.int64)
    mask[1, :3] = 0  # left padding
    with float64_reference(), torch.no_grad():
        ref = hf(torch.from_numpy(x), attention_mask=torch.from_numpy(mask)).numpy()
    y = ours(x, attention_mask=mask)
    np.testing.assert_allclose(y[mask == 1], ref[mask == 1], rtol=0, atol=1e-10)
    np.testing.assert_allclose(y[1, 3:], ours(x[1:, 3:])[0], rtol=0, atol=1e-10)
    # backward honours the mask: the padded inputs get no gradient
    ours(x, attention_mask=mask)
    dx = ours.backward(rng.standard_normal(x.shape))
    assert np.all(dx[1, :3] == 0)


def test_jvp_matches_central_differences():
    torch, M, cfg, hf, ours = _pair(6)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 7, HIDDEN))
    tx = rng.standard_normal(x.shape)
    params = dict(ours.named_parameters())
    tangents = {n: rng.standard_normal(p.data.shape) for n, p in params.items()}
    pt = {params[n]: t for n, t in tangents.items()}
    mask = np.ones((2, 7))
    mask[0, :2] = 0
    ours(x, attention_mask=mask)
    ty = ours.jvp(tx, param_tangents=tangents)
    eps = 1e-6
    saved = {p: p.data.copy() for p in pt}

    def at(s):
        for p, t in pt.items():
            p.data = saved[p] + s * t
        return ours(x + s * tx, attention_mask=mask)

    fd = (at(eps) - at(-eps)) / (2 * eps)
    at(0.0)
    assert np.max(np.abs(ty - fd)) <= 1e-6 * max(1.0, np.max(np.abs(fd)))
    # and the jvp equals <backward, tangent> (adjoint identity)
    dy = rng.standard_normal(ty.shape)
    for p in pt:
        p.grad = None
    ours(x, attention_mask=mask)
    dx = ours.backward(dy)
    lhs = np.sum(ty * dy)
    rhs = np.sum(dx * tx) + sum(np.sum(p.grad * t) for p, t in pt.items())
    assert abs(lhs - rhs) <= 1e-9 * max(1.0, abs(lhs))


def test_second_order_by_gradgradcheck():
    """``backward_jvp`` (the chunked kimi_delta_attention_backward_jvp inside the layer's chain)
    against central differences of the backward, a left-padded batch over two chunks, and the
    Hessian's symmetry (``npattn.gradgradcheck``); ``CausalLM.loss_hvp`` is checked against
    transformers' double backward in ``tests/test_loss_hvp.py``."""
    import npattn

    rng = np.random.default_rng(8)
    kda = KimiDeltaAttention(HIDDEN, linear_num_heads=H, linear_head_dim=D, rng=0, chunk_size=3)
    x = rng.standard_normal((2, 5, HIDDEN))
    mask = np.array([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    report = npattn.gradgradcheck(kda, x, attention_mask=mask)
    assert report.ok, str(report)


# -- the family in CausalLM: transformers' KimiLinearForCausalLM from TINY_CONFIGS["kimi_linear"] ----
def _model(seed=0, **changes):
    pytest.importorskip("torch")
    T = pytest.importorskip("transformers")
    from npattn.models import CausalLM
    from npattn.models.tiny import tiny_config
    from tests._hf64 import build, state_dict

    kwargs = {k: v for k, v in tiny_config("kimi_linear", **changes).items() if k != "model_type"}
    hf, cfg = build(T.KimiLinearConfig, T.KimiLinearForCausalLM, seed=seed, **kwargs)
    return hf, cfg, CausalLM.from_hf(state_dict(hf), cfg)


# the one relative-error helper, relative to the reference tensor's largest entry
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_rel = functools.partial(rel_err, floor=1e-300, relative_to="max_b")


def test_model_mixes_kda_nope_mla_and_routed_experts():
    from npattn.nn.latent_attention import MultiHeadLatentAttention
    from npattn.nn.moe import SparseMoeBlock

    hf, cfg, m = _model()
    kinds = [type(layer.attention) for layer in m.model.layers]
    assert kinds == [KimiDeltaAttention, MultiHeadLatentAttention, KimiDeltaAttention]  # kda_layers [1, 3]: 1-indexed
    assert m.model.layers[1].attention.rope is False
    assert [type(layer.mlp) is SparseMoeBlock for layer in m.model.layers] == [False, True, True]
    assert [t for t in cfg["layer_types"]] == ["linear_attention", "full_attention", "linear_attention"]
    # the short dict (no layer_types / mlp_layer_types: linear_attn_config's 1-indexed lists and
    # first_k_dense_replace) reads as transformers' to_dict of it
    from npattn.models import config_from_hf
    from npattn.models.tiny import tiny_config

    short = config_from_hf(tiny_config("kimi_linear"))
    assert "layer_types" not in tiny_config("kimi_linear")
    assert short == m.config
    assert short.layer_types == ("linear_attention", "latent_attention", "linear_attention")


def test_model_logits_and_every_gradient_match_transformers():
    from tests._hf64 import check_logits_and_grads

    hf, cfg, m = _model()
    rng = np.random.default_rng(1)
    ids = rng.integers(0, cfg["vocab_size"], (2, 21))  # 21 steps: several KDA chunks of 16
    check_logits_and_grads(m, hf, ids, rng.standard_normal(ids.shape + (cfg["vocab_size"],)))


def _hf_logits(hf, ids, **kwargs):
    import torch

    with float64_reference(), torch.no_grad():
        return hf(input_ids=torch.from_numpy(ids), use_cache=False, **kwargs).logits.numpy()


def test_model_cached_decoding_matches_transformers():
    hf, cfg, m = _model(3)
    check_cached_decoding(m, hf, np.random.default_rng(3).integers(0, cfg["vocab_size"], (2, 9)))


def test_model_padded_batch_matches_transformers_and_each_row_alone():
    pytest.importorskip("torch")
    hf, cfg, m = _model(4)
    check_padded_batch(m, hf, cfg["vocab_size"], (7, 4, 1))


def test_checkpoint_in_kimis_own_names_round_trips(tmp_path):
    """transformers' save_pretrained writes Kimi's checkpoint names (block_sparse_moe, experts.{e}.w1/w3/w2,
    q/k/v_conv1d, the forget gate under self_attn); npattn reads them, writes them back, and transformers
    reads npattn's checkpoint with equal logits."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")

    from npattn import no_grad
    from npattn.models import CausalLM
    from npattn.models.hf import open_checkpoint

    hf, cfg, m = _model(5)
    hf.save_pretrained(tmp_path / "hf")
    theirs = set(open_checkpoint(tmp_path / "hf")[1])
    assert (
        "model.layers.0.self_attn.q_conv1d.weight" in theirs
        and "model.layers.1.block_sparse_moe.experts.0.w3.weight" in theirs
    )
    loaded = CausalLM.from_pretrained(tmp_path / "hf")
    assert loaded.config == m.config
    ids = np.random.default_rng(5).integers(0, cfg["vocab_size"], (1, 6))
    with no_grad():
        np.testing.assert_array_equal(loaded(ids), m(ids))
    m.save_pretrained(tmp_path / "ours")
    assert set(open_checkpoint(tmp_path / "ours")[1]) == theirs
    # transformers reads npattn's directory in a process of its own: its from_pretrained of a Kimi
    # directory leaves loading state behind that changed later models' logits in this process
    np.save(tmp_path / "ids.npy", ids)
    script = (
        "import sys, numpy as np, torch, transformers as T\n"
        f"sys.path.insert(0, {os.fspath(ROOT)!r})\n"
        "from tests._hf64 import float64_reference\n"
        f"d = {os.fspath(tmp_path)!r}\n"
        "with float64_reference():\n"
        "    back = T.AutoModelForCausalLM.from_pretrained(d + '/ours', attn_implementation='eager',"
        " experts_implementation='eager').eval()\n"
        "    assert back.dtype == torch.float64\n"
        "    with torch.no_grad():\n"
        "        out = back(input_ids=torch.from_numpy(np.load(d + '/ids.npy')), use_cache=False).logits\n"
        "np.save(d + '/back.npy', out.numpy())\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True)
    assert _rel(np.load(tmp_path / "back.npy"), _hf_logits(hf, ids)) < 1e-12


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"linear_attn_config": {"num_heads": 2, "head_dim": 4, "chunk": 8}}, "'chunk' is not supported"),
        (
            {"linear_attn_config": {"num_heads": 2, "head_dim": 4, "kda_layers": [1, 4], "full_attn_layers": [2]}},
            r"\['kda_layers'\]: expected layers 1..3, got 4",
        ),
        (
            {"linear_attn_config": {"num_heads": 2, "head_dim": 4, "kda_layers": [1], "full_attn_layers": [2]}},
            "layer 3 is in no list",
        ),
        ({"mlp_layer_types": ["dense", "moe", "sparse"]}, "mlp_layer_types"),
        ({"moe_renormalize": "yes"}, "moe_renormalize"),
        ({"mla_use_nope": True}, "'mla_use_nope' is not supported"),
    ],
)
def test_config_refusals_name_the_key(changes, message):
    from npattn.models import config_from_hf
    from npattn.models.tiny import tiny_config

    with pytest.raises(ValueError, match=message):
        config_from_hf(tiny_config("kimi_linear", **changes))


def test_checkpoint_without_a_conv_part_is_refused_by_name():
    from npattn.models import CausalLM
    from npattn.models.save import checkpoint_tensors
    from npattn.models.tiny import tiny_config

    m = CausalLM(tiny_config("kimi_linear"), rng=0)
    tensors = dict(checkpoint_tensors(m))
    assert "model.layers.2.self_attn.conv1d.weight" not in tensors
    del tensors["model.layers.2.self_attn.v_conv1d.weight"]
    with pytest.raises(ValueError, match="missing key 'model.layers.2.self_attn.v_conv1d.weight'"):
        CausalLM.from_hf(tensors, tiny_config("kimi_linear"))
    tensors = dict(checkpoint_tensors(m))
    tensors["model.layers.0.self_attn.k_conv1d.weight"] = tensors["model.layers.0.self_attn.k_conv1d.weight"][:-1]
    with pytest.raises(ValueError, match=r"state_dict\['model.layers.0.self_attn.k_conv1d.weight'\]: expected shape"):
        CausalLM.from_hf(tensors, tiny_config("kimi_linear"))
    back = CausalLM.from_hf(dict(checkpoint_tensors(m)), tiny_config("kimi_linear"))
    for k, v in m.state_dict().items():
        np.testing.assert_array_equal(back.state_dict()[k], v)

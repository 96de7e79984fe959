"""A NaN router score reaches the token's weights in both tiers, as in transformers: ``torch.topk``
counts NaN as larger than every number, so the NaN-scored expert is chosen first and the NaN
propagates (GPT-OSS's softmax over the chosen, DeepSeek-V3's renormalisation, Qwen3/Mixtral's
softmax over all).  numpy's sorts put NaN last: the routers used to skip the NaN expert and return
finite weights.  The oracles are transformers' own router modules, fed the logits directly."""

import numpy as np
import pytest

from npattn import functional as F
from npattn.functional import reference as R

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from _hf64 import float64_reference  # noqa: E402

E, K = 8, 3
NAN, INF = np.nan, np.inf

# rows of router logits (E = 8); the last two have more NaN-scored candidates than can be chosen
ROWS = [
    [0.3, -1.2, 0.8, 0.1, 1.5, -0.4, 0.9, -2.0],  # no NaN
    [0.3, -1.2, 0.8, 0.1, 1.5, NAN, 0.9, -2.0],  # one NaN, not among the best otherwise
    [NAN, -1.2, 0.8, 0.1, 1.5, -0.4, 0.9, NAN],  # two NaN in two groups
    [0.3, -1.2, NAN, NAN, 1.5, -0.4, 0.9, -2.0],  # two NaN in one group
    [0.3, NAN, 0.8, 0.1, -1.5, -0.4, INF, -2.0],  # NaN beside +inf
    [0.3, -1.2, 0.8, -INF, 1.5, -0.4, 0.9, -2.0],  # -inf, no NaN
    [NAN] * E,  # every score NaN: which k are chosen is unspecified (torch neither)
    [0.3, -1.2, 0.8, 0.1, NAN, NAN, NAN, NAN],  # four NaN for three places: likewise
]
TIED = {6, 7}

# (family, router class, config fields, npattn's router options)
ROUTERS = {
    "gpt_oss": (
        "gpt_oss.modeling_gpt_oss.GptOssTopKRouter",
        dict(num_local_experts=E, num_experts_per_tok=K),
        dict(variant="topk_softmax"),
    ),
    "deepseek_v3-groups": (
        "deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter",
        dict(n_routed_experts=E, num_experts_per_tok=K, n_group=4, topk_group=2, norm_topk_prob=True,
             routed_scaling_factor=2.5),
        dict(variant="sigmoid", norm_topk_prob=True, n_group=4, topk_group=2, routed_scaling_factor=2.5),
    ),
    "deepseek_v3": (
        "deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter",
        dict(n_routed_experts=E, num_experts_per_tok=K, n_group=1, topk_group=1, norm_topk_prob=False,
             routed_scaling_factor=1.0),
        dict(variant="sigmoid", norm_topk_prob=False),
    ),
    "qwen3_moe": (
        "qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter",
        dict(num_experts=E, num_experts_per_tok=K, norm_topk_prob=False),
        dict(variant="softmax_topk"),
    ),
    "qwen3_next": (
        "qwen3_next.modeling_qwen3_next.Qwen3NextTopKRouter",
        dict(num_experts=E, num_experts_per_tok=K, norm_topk_prob=True),
        dict(variant="softmax_topk", norm_topk_prob=True),
    ),
    "mixtral": (
        "mixtral.modeling_mixtral.MixtralTopKRouter",
        dict(num_local_experts=E, num_experts_per_tok=K),
        dict(variant="softmax_topk", norm_topk_prob=True),  # Mixtral always renormalises
    ),
}  # fmt: skip
CONFIGS = {
    "gpt_oss": "GptOssConfig",
    "deepseek_v3": "DeepseekV3Config",
    "qwen3_moe": "Qwen3MoeConfig",
    "qwen3_next": "Qwen3NextConfig",
    "mixtral": "MixtralConfig",
}


class _LogitsIn:
    """``torch.nn.functional`` for a transformers module whose ``F.linear`` returns its input: the
    router is then fed its logits directly (a matmul would spread one NaN over the whole row)."""

    @staticmethod
    def linear(x, weight, bias=None):
        return x

    def __getattr__(self, name):
        return getattr(torch.nn.functional, name)


def _transformers_route(family, logits, monkeypatch):
    import importlib

    path, fields, _ = ROUTERS[family]
    modname, cls = path.rsplit(".", 1)
    mod = importlib.import_module(f"transformers.models.{modname}")
    config = getattr(transformers, CONFIGS[family.split("-")[0]])(hidden_size=E, **fields)
    router = getattr(mod, cls)(config).double()
    bias = None
    if family.startswith("deepseek"):
        bias = np.linspace(-0.2, 0.3, E)  # steers the choice (not transformers' zeros)
        router.e_score_correction_bias = torch.tensor(bias)
    monkeypatch.setattr(mod, "F", _LogitsIn())
    with float64_reference(), torch.no_grad():
        out = router(torch.tensor(logits))
    _, scores, idx = (t.numpy() for t in out)
    return scores, idx, bias


def _by_expert(w, idx):
    order = np.argsort(idx, -1)
    return np.take_along_axis(w, order, -1), np.take_along_axis(idx, order, -1)


@pytest.mark.parametrize("tier", [F, R], ids=["fast", "textbook"])
@pytest.mark.parametrize("family", sorted(ROUTERS))
def test_nan_scores_reach_the_weights_as_in_transformers(family, tier, monkeypatch):
    logits = np.array(ROWS)
    want_w, want_idx, bias = _transformers_route(family, logits, monkeypatch)
    kw = dict(ROUTERS[family][2])
    if bias is not None:
        kw["correction_bias"] = bias
    (w, idx), _ = tier.topk_router(logits, K, **kw)
    softmax_all = kw["variant"] == "softmax_topk"  # one NaN logit makes the whole softmax NaN
    for n, row in enumerate(ROWS):
        nan_row = bool(np.isnan(row).any())
        assert np.isnan(want_w[n]).any() == nan_row  # the oracle does propagate it
        if n in TIED or (softmax_all and nan_row):
            # which of the NaN-scored experts fill the k places is unspecified; all of them are NaN
            assert np.isnan(w[n]).all() and np.isnan(want_w[n]).all(), (n, w[n])
            if not softmax_all:
                assert np.isnan(logits[n, idx[n]]).all(), (n, idx[n])
            continue
        (gw, gi), (ww, wi) = _by_expert(w[n], idx[n]), _by_expert(want_w[n], want_idx[n])
        np.testing.assert_array_equal(gi, wi, err_msg=f"row {n}")
        np.testing.assert_allclose(gw, ww, rtol=1e-13, atol=0, equal_nan=True, err_msg=f"row {n}")


@pytest.mark.parametrize("tier", [F, R], ids=["fast", "textbook"])
def test_nan_is_chosen_first_as_by_torch_topk(tier):
    """The choice order itself: NaN first, then +inf, then the numbers, as ``torch.topk`` sorts
    (GPT-OSS's choice is the top-k of the logits)."""
    row = np.array([[1.0, NAN, 3.0, -INF, 2.0, INF]])
    for k in range(1, 7):
        want = torch.topk(torch.tensor(row), k)[1].numpy()
        (w, idx), _ = tier.topk_router(row, k, variant="topk_softmax")
        np.testing.assert_array_equal(idx, want)
        assert np.isnan(w).all()


@pytest.mark.parametrize("tier", [F, R], ids=["fast", "textbook"])
def test_rows_without_nan_are_unaffected(tier):
    """A NaN in one token's scores changes no other token's choice or weights."""
    rng = np.random.default_rng(3)
    z = rng.standard_normal((5, E))
    for kw in (v[2] for v in ROUTERS.values()):
        (w0, i0), _ = tier.topk_router(z, K, **kw)
        z1 = z.copy()
        z1[2, 4] = NAN
        (w1, i1), _ = tier.topk_router(z1, K, **kw)
        keep = [0, 1, 3, 4]
        np.testing.assert_array_equal(i1[keep], i0[keep])
        np.testing.assert_array_equal(w1[keep], w0[keep])
        assert np.isnan(w1[2]).any()

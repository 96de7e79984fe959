"""Families as data (issue 29, item 1): the typed sub-configs of ``npattn.models.configs`` are the
only place that knows a family; the modules take plain keyword arguments, ``CausalLM`` maps each
sub-config to its module, ``hf.py`` reads the checkpoint layout; one table of tiny configs."""

import ast
import dataclasses
import functools
import os

import numpy as np
import pytest
from _families import FAMILIES

import npattn
from npattn.models import CausalLM, config_from_hf
from npattn.models import configs as C
from npattn.models.tiny import TINY_CONFIGS, scaled_config, tiny_config
from npattn.nn.delta_net import GatedDeltaNet
from npattn.nn.latent_attention import MultiHeadLatentAttention
from npattn.nn.moe import SparseMoeBlock

PKG = os.path.dirname(npattn.__file__)


@functools.lru_cache(maxsize=None)
def _sources() -> tuple:
    """``(path relative to the package, its ast)`` of every module of npattn, parsed once for the
    tests below (which only read the trees)."""
    out = []
    for d, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                out.append((os.path.relpath(path, PKG), ast.parse(open(path).read(), path)))
    return tuple(out)


def test_model_type_is_known_only_to_the_config_readers():
    """No ``"model_type"`` string or ``.model_type`` attribute outside models/configs.py (the bench
    may name families to build them): no module, CausalLM or the loader branches on a family."""
    hits = []
    for rel, tree in _sources():
        if rel == os.path.join("models", "configs.py") or rel.startswith(os.path.join("tools", "bench")):
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and node.value == "model_type") or (
                isinstance(node, ast.Attribute) and node.attr == "model_type"
            ):
                hits.append(f"{rel}:{node.lineno}")
    assert hits == []


def test_nn_imports_models_only_inside_the_compatibility_wrappers():
    for rel, tree in _sources():
        if not rel.startswith("nn" + os.sep):
            continue
        for node in tree.body:  # module level only
            if isinstance(node, ast.ImportFrom):
                assert "models" not in (node.module or ""), rel
            elif isinstance(node, ast.Import):
                assert not any("models" in a.name for a in node.names), rel


def _same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        np.testing.assert_array_equal(sa[k], sb[k], err_msg=k)


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3", "qwen3_next"])
def test_moe_wrapper_is_the_reader_then_the_constructor(family):
    cfg = FAMILIES[family]
    sub = C.moe_config(cfg)
    assert isinstance(sub, C.MoEConfig) and sub.hidden_size == cfg["hidden_size"]
    _same_state(SparseMoeBlock.from_hf_config(cfg, rng=3), SparseMoeBlock(**sub.kwargs(), rng=3))
    # CausalLM's MoE layers are built from the same arguments
    assert config_from_hf(cfg).moe == sub


def test_latent_and_delta_net_wrappers_are_the_readers_then_the_constructors():
    ds, qn = FAMILIES["deepseek_v3"], FAMILIES["qwen3_next"]
    lat = C.latent_config(ds)
    _same_state(MultiHeadLatentAttention.from_config(ds, rng=2), MultiHeadLatentAttention(**lat.kwargs(), rng=2))
    assert config_from_hf(ds).latent == lat
    dn = C.delta_net_config(qn)
    assert (dn.linear_num_key_heads, dn.linear_conv_kernel_dim, dn.rms_norm_eps) == (2, 3, 1e-6)
    _same_state(GatedDeltaNet.from_config(qn, rng=4), GatedDeltaNet(**dn.kwargs(), rng=4))
    assert config_from_hf(qn).linear_attention == dn
    # a key left out is transformers' default, which is the constructor's too
    assert C.delta_net_config({"hidden_size": 8}).linear_num_value_heads == 32 == GatedDeltaNet(8).num_v_heads


def test_sub_configs_are_typed_and_frozen():
    q3 = config_from_hf(FAMILIES["qwen3"])
    full, sliding = q3.attention_config("full_attention"), q3.attention_config("sliding_attention")
    assert (full.window, sliding.window) == (None, (2, 0))  # a causal window of sliding_window=3 keys
    assert (sliding.num_heads, sliding.num_kv_heads, sliding.head_dim, sliding.qk_norm) == (4, 2, 4, True)
    assert q3.moe is None and q3.latent is None and q3.linear_attention is None
    assert q3.layout == C.CheckpointLayout("qwen3", per_expert=False)
    assert config_from_hf(FAMILIES["deepseek_v3"]).layout.per_expert
    ds = config_from_hf(FAMILIES["deepseek_v3"])
    for sub in (ds.moe, ds.latent, ds.layout, full):
        with pytest.raises(dataclasses.FrozenInstanceError):
            sub.num_heads = 1  # type: ignore[misc]
    assert (ds.moe.router, ds.moe.shared_name, ds.moe.experts_first) == ("sigmoid", "shared_experts", True)


def _per_expert(state):
    """``state`` with the fused experts written one expert at a time, as DeepSeek's checkpoints are."""
    out = {}
    for k, v in state.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            p, inter = k[: -len("gate_up_proj")], v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{p}{e}.gate_proj.weight"], out[f"{p}{e}.up_proj.weight"] = v[e, :inter], v[e, inter:]
        elif k.endswith("mlp.experts.down_proj"):
            for e in range(v.shape[0]):
                out[f"{k[: -len('down_proj')]}{e}.down_proj.weight"] = v[e]
        else:
            out[k] = v
    return out


def test_the_loader_reads_the_checkpoint_layout():
    """Per-expert keys are merged where the config's CheckpointLayout says the family writes them
    so, and leave the fused tensors missing where it does not (the loader asks the layout, not the
    family)."""
    cfg = config_from_hf(FAMILIES["qwen3_next"])
    model = CausalLM(cfg, rng=0)
    split = _per_expert(model.state_dict())
    loaded = CausalLM.from_hf(split, cfg)
    _same_state(loaded, model)
    fused_only = cfg.replace(layout=dataclasses.replace(cfg.layout, per_expert=False))
    with pytest.raises(ValueError, match=r"missing key 'model\.layers\.0\.mlp\.experts\.gate_up_proj'"):
        CausalLM.from_hf(split, fused_only)
    _same_state(CausalLM.from_hf(model.state_dict(), fused_only), model)


def test_a_dense_family_is_one_reader_and_one_tiny_entry(monkeypatch):
    """The contributing guide's worked example: a family that is Llama with a config key of its
    own needs its reader (sharing configs.py's helpers) and its tiny entry, nothing else."""

    def _my_llama(r):
        r.only("my_option", (False,), False, "the worked example supports only false")
        return C._llama(r)

    monkeypatch.setitem(C._READERS, "my_llama", _my_llama)
    monkeypatch.setitem(TINY_CONFIGS, "my_llama", dict(TINY_CONFIGS["llama"], model_type="my_llama"))
    cfg = tiny_config("my_llama")
    ref, mine = CausalLM(FAMILIES["llama"], rng=5), CausalLM(cfg, rng=5)
    ids = np.array([[1, 2, 3, 4]])
    np.testing.assert_array_equal(mine(ids), ref(ids))
    assert repr(mine).startswith("CausalLM(model_type='my_llama'")
    _same_state(CausalLM.from_hf(ref.state_dict(), cfg), ref)
    with pytest.raises(ValueError, match=r"config\['my_option'\] = True is not supported"):
        CausalLM(dict(cfg, my_option=True))
    with pytest.raises(ValueError, match=r"model_type 'my_llama'; missing"):
        CausalLM.from_hf({}, cfg)


def test_one_table_of_tiny_configs():
    # one entry per model_type under its name, and a second one where a model_type's kinds of
    # layers are too many for one tiny model (Nemotron-H's routed experts: nemotron_h_moe)
    assert FAMILIES == TINY_CONFIGS and set(C.SUPPORTED_MODEL_TYPES) <= set(TINY_CONFIGS)
    # the public list names every family a reader reads, once, and each has its tiny entry and defaults
    supported = C.SUPPORTED_MODEL_TYPES
    assert len(set(supported)) == len(supported) and set(supported) == set(C._READERS) == set(C._DEFAULTS)
    assert set(supported) == {d["model_type"] for d in TINY_CONFIGS.values()}
    others = {name: d["model_type"] for name, d in TINY_CONFIGS.items() if name != d["model_type"]}
    assert others == {"nemotron_h_moe": "nemotron_h"}
    mine = tiny_config("gpt_oss", sliding_window=5)
    mine["rope_parameters"]["factor"] = 8.0  # a copy: the table is unchanged
    assert (
        TINY_CONFIGS["gpt_oss"]["rope_parameters"]["factor"] == 4.0 and TINY_CONFIGS["gpt_oss"]["sliding_window"] == 3
    )
    with pytest.raises(ValueError, match="model_type: expected one of"):
        tiny_config("bert")


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_scaled_configs_keep_the_options_at_other_sizes(family):
    d = scaled_config(family, hidden=32, layers=3, vocab=50)
    tiny = TINY_CONFIGS[family]
    assert d["hidden_size"] == 32 and d["num_hidden_layers"] == 3 and d["vocab_size"] == 50
    assert d.get("num_attention_heads") == tiny.get("num_attention_heads")  # (Mamba-2: none)
    for key in ("intermediate_size", "head_dim", "kv_lora_rank", "linear_key_head_dim", "moe_intermediate_size"):
        if key in tiny:
            assert d[key] == 2 * tiny[key], key
    if "layer_types" in tiny:
        assert d["layer_types"] == (tiny["layer_types"] * 2)[:3]
    m = CausalLM(d, rng=0)
    assert m(np.array([[1, 2, 3]])).shape == (1, 3, 50)
    with pytest.raises(ValueError, match="hidden: expected a multiple of 16"):
        scaled_config(family, hidden=24, layers=1, vocab=50)

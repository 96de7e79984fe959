"""CausalLM.save_pretrained: a Hugging Face directory that transformers and CausalLM.from_pretrained
read back (every family, one file and shards), sizes and shards as transformers / huggingface_hub
cut them, the config transformers expects, and an atomic write (a failed save changes nothing)."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from npattn import no_grad
from npattn.models import CausalLM
from npattn.models import save as save_mod
from npattn.models.tiny import TINY_CONFIGS, tiny_config

FAMILIES = sorted(TINY_CONFIGS)
IDS = np.array([[1, 5, 9, 2, 30, 7], [3, 3, 0, 36, 11, 4]])


def _model(name="llama", dtype=np.float64, seed=0, float32_values=False):
    """A model of family ``name`` with every weight moved (norms away from 1: every tensor
    matters); ``float32_values``: each value one of float32's (transformers keeps DeepSeek-V3's
    router in float32 whatever the model's dtype, so only such values load unchanged)."""
    m = CausalLM(tiny_config(name), rng=seed, dtype=dtype)
    rng = np.random.default_rng(seed + 1)
    for _, p in m.named_parameters():
        p.data[...] += (rng.standard_normal(p.shape) * 0.1).astype(dtype)
        if float32_values:
            p.data[...] = p.data.astype(np.float32)
    return m


def _assert_same_model(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k, v in sa.items():
        assert sb[k].dtype == v.dtype, k
        np.testing.assert_array_equal(sb[k], v, err_msg=k)


def _siblings(path):
    """Entries beside ``path`` other than itself (a leftover temporary directory would be one)."""
    return sorted(e for e in os.listdir(os.path.dirname(path)) if e != os.path.basename(path))


# -- round trips ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("dtype,shard", [(np.float64, "5GB"), (np.float32, "4KB")])
def test_round_trip_is_exact(tmp_path, name, dtype, shard):
    m = _model(name, dtype)
    m.save_pretrained(tmp_path / "m", max_shard_size=shard)
    files = sorted(os.listdir(tmp_path / "m"))
    assert ("model.safetensors.index.json" in files) == (shard == "4KB")
    loaded = CausalLM.from_pretrained(tmp_path / "m")
    assert loaded.dtype == dtype
    _assert_same_model(m, loaded)
    with no_grad():
        np.testing.assert_array_equal(loaded(IDS % 41), m(IDS % 41))


@pytest.mark.parametrize("name", FAMILIES)
def test_transformers_reads_it_with_equal_logits(tmp_path, name):
    """transformers' AutoModelForCausalLM.from_pretrained of the directory: every weight equal
    (per-expert checkpoints fused back), logits equal in float64 (transformers' float32 upcasts
    turned into float64)."""
    torch = pytest.importorskip("torch")
    T = pytest.importorskip("transformers")
    from _hf64 import float64_reference

    m = _model(name, float32_values=True)
    m.save_pretrained(tmp_path, max_shard_size="4KB" if name in ("llama", "deepseek_v3") else "5GB")
    hf = T.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager", experts_implementation="eager")
    hf.eval()
    assert hf.dtype == torch.float64 and hf.config.model_type == TINY_CONFIGS[name]["model_type"]
    _assert_same_model(m, CausalLM.from_hf(hf.state_dict(), hf.config.to_dict()))
    with torch.no_grad(), float64_reference():
        ref = hf(input_ids=torch.from_numpy(IDS)).logits.numpy()
    with no_grad():
        got = m(IDS)
    np.testing.assert_allclose(got, ref, rtol=1e-8, atol=1e-8 * np.abs(ref).max())


def test_float32_model_in_transformers(tmp_path):
    """A float32 model is written as float32 and transformers loads it as float32."""
    torch = pytest.importorskip("torch")
    T = pytest.importorskip("transformers")
    m = _model("qwen3", np.float32)
    m.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "float32"
    hf = T.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert hf.dtype == torch.float32
    with torch.no_grad():
        ref = hf(input_ids=torch.from_numpy(IDS)).logits.numpy()
    with no_grad():
        np.testing.assert_allclose(m(IDS), ref, rtol=1e-4, atol=1e-5)


def test_config_is_the_hugging_face_dict(tmp_path):
    """config.json is the dict the model was built from (transformers' defaults filled in), its
    dtype the saved one; an older torch_dtype is kept equal to it; transformers' config reads it."""
    cfg = tiny_config("gemma3_text", torch_dtype="bfloat16", architectures=["Gemma3ForCausalLM"])
    m = CausalLM(cfg, rng=0, dtype=np.float32)
    m.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written == dict(m.config.hf, dtype="float32", torch_dtype="float32")
    assert {k: written[k] for k in cfg if k != "torch_dtype"} == {k: v for k, v in cfg.items() if k != "torch_dtype"}
    T = pytest.importorskip("transformers")
    read = T.AutoConfig.from_pretrained(tmp_path)
    assert read.model_type == "gemma3_text" and read.sliding_window == 3 and read.final_logit_softcapping == 30.0


def test_per_expert_names_as_the_checkpoints(tmp_path):
    """DeepSeek-V3 and Qwen3-Next are written one expert at a time (as their checkpoints and
    transformers' save_pretrained write them); GPT-OSS keeps its fused experts."""
    from npattn.models.hf import open_checkpoint

    m = _model("deepseek_v3")
    m.save_pretrained(tmp_path / "ds")
    _, tensors = open_checkpoint(tmp_path / "ds")
    fused = m.state_dict()["model.layers.1.mlp.experts.gate_up_proj"]
    down = m.state_dict()["model.layers.1.mlp.experts.down_proj"]
    inter = fused.shape[1] // 2
    assert not any(k.endswith("experts.gate_up_proj") for k in tensors)
    for e in range(fused.shape[0]):
        p = f"model.layers.1.mlp.experts.{e}"
        np.testing.assert_array_equal(tensors[f"{p}.gate_proj.weight"].numpy(), fused[e, :inter])
        np.testing.assert_array_equal(tensors[f"{p}.up_proj.weight"].numpy(), fused[e, inter:])
        np.testing.assert_array_equal(tensors[f"{p}.down_proj.weight"].numpy(), down[e])
    _model("gpt_oss").save_pretrained(tmp_path / "oss")
    assert "model.layers.0.mlp.experts.gate_up_proj" in open_checkpoint(tmp_path / "oss")[1]


@pytest.mark.parametrize("name", FAMILIES)
def test_transformers_writes_the_same_names(tmp_path, name):
    """The tensors' names, shapes and values are those of transformers' own save_pretrained of
    the model it read from ours."""
    pytest.importorskip("torch")
    T = pytest.importorskip("transformers")
    from npattn.models.hf import open_checkpoint

    _model(name, float32_values=True).save_pretrained(tmp_path / "np")
    ours = open_checkpoint(tmp_path / "np")[1]
    hf = T.AutoModelForCausalLM.from_pretrained(tmp_path / "np", experts_implementation="eager")
    hf.save_pretrained(tmp_path / "hf")
    theirs = open_checkpoint(tmp_path / "hf")[1]
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    for k, v in theirs.items():
        np.testing.assert_array_equal(ours[k].numpy(), v.numpy(), err_msg=k)


# -- sizes and shards -------------------------------------------------------------------------
SIZES = ["5GB", "500MB", "1.5GB", "64KB", "4kb", " 2 MB ", "1TB", "0.5KB"]


def test_shard_sizes_as_transformers_parses_them():
    hub = pytest.importorskip("huggingface_hub.serialization._base")
    for s in SIZES:
        assert save_mod.parse_shard_size(s) == hub.parse_size_to_int(s), s
    assert save_mod.parse_shard_size(1000) == 1000
    assert save_mod.parse_shard_size(np.int64(7)) == 7


@pytest.mark.parametrize(
    "bad,error",
    [
        (True, TypeError),
        (1.5, TypeError),
        (None, TypeError),
        ("5GiB", ValueError),  # huggingface_hub (which transformers' save_pretrained uses) refuses it too
        ("GB", ValueError),
        ("fiveGB", ValueError),
        ("nanGB", ValueError),
        ("0KB", ValueError),
        (0, ValueError),
        (-5, ValueError),
    ],
)
def test_bad_shard_sizes_are_refused_before_writing(tmp_path, bad, error):
    with pytest.raises(error, match="max_shard_size"):
        _model().save_pretrained(tmp_path / "m", max_shard_size=bad)
    assert os.listdir(tmp_path) == []


def test_shards_and_index_as_huggingface_hub(tmp_path):
    """Which tensor goes into which shard, the shard names and the index's contents are those of
    huggingface_hub's split (transformers' save_pretrained) for the same tensors."""
    hub = pytest.importorskip("huggingface_hub.serialization._base")
    T = pytest.importorskip("transformers")
    m = _model("qwen3_next")
    tensors = save_mod.checkpoint_tensors(m)
    big = max(a.nbytes for a in tensors.values())
    for limit in (big - 1, 3000, "3KB", 10**6):
        d = tmp_path / str(limit)
        m.save_pretrained(d, max_shard_size=limit)
        split = hub.split_state_dict_into_shards_factory(
            tensors,
            get_storage_size=lambda a: a.nbytes,
            filename_pattern="model{suffix}.safetensors",
            max_shard_size=limit,
        )
        written = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
        assert written == sorted(split.filename_to_tensors)
        if not split.is_sharded:
            assert not (d / "model.safetensors.index.json").exists()
            continue
        index = json.loads((d / "model.safetensors.index.json").read_text())
        assert index["weight_map"] == split.tensor_to_filename
        assert index["metadata"]["total_size"] == split.metadata["total_size"]
        hf = T.AutoModelForCausalLM.from_pretrained(d, experts_implementation="eager")
        assert index["metadata"]["total_parameters"] == hf.num_parameters()


# -- atomic writes ------------------------------------------------------------------------------
def _failing_writer(monkeypatch, after=1, exc=OSError("disk full")):
    """The tensor writer raises on its call number ``after + 1`` (after ``after`` shards)."""
    real = save_mod.save_safetensors
    calls = []

    def writer(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) > after:
            raise exc
        real(tensors, path, metadata)

    monkeypatch.setattr(save_mod, "save_safetensors", writer)
    return calls


@pytest.mark.parametrize("exc", [OSError("disk full"), KeyboardInterrupt()])
def test_interrupted_save_keeps_the_old_directory(tmp_path, monkeypatch, exc):
    target = tmp_path / "model"
    old = _model("llama", seed=0)
    old.save_pretrained(target, max_shard_size="4KB")
    (target / "tokenizer.json").write_text("{}")
    before = {f: (target / f).read_bytes() for f in os.listdir(target)}
    calls = _failing_writer(monkeypatch, exc=exc)
    with pytest.raises(type(exc)):
        _model("llama", seed=5).save_pretrained(target, max_shard_size="4KB")
    assert len(calls) == 2  # the first shard was written, the second failed
    assert {f: (target / f).read_bytes() for f in os.listdir(target)} == before
    assert _siblings(target) == []  # the temporary directory is gone
    _assert_same_model(old, CausalLM.from_pretrained(target))


def test_interrupted_first_save_leaves_no_directory(tmp_path, monkeypatch):
    _failing_writer(monkeypatch)
    with pytest.raises(OSError, match="disk full"):
        _model().save_pretrained(tmp_path / "new" / "model", max_shard_size="4KB")
    assert os.listdir(tmp_path / "new") == []


def test_failure_of_the_last_rename_restores_the_old_directory(tmp_path, monkeypatch):
    """Where names cannot be exchanged in one step, the old directory is moved aside and the new
    one renamed in; if that rename fails, the old one is put back."""
    target = tmp_path / "model"
    old = _model(seed=0)
    old.save_pretrained(target)
    monkeypatch.setattr(save_mod, "_exchange", lambda a, b: False)
    real = os.rename
    calls = []

    def rename(a, b):
        calls.append((a, b))
        if len(calls) == 2:
            raise OSError("rename failed")
        real(a, b)

    monkeypatch.setattr(save_mod.os, "rename", rename)
    with pytest.raises(OSError, match="rename failed"):
        _model(seed=3).save_pretrained(target)
    assert _siblings(target) == []
    _assert_same_model(old, CausalLM.from_pretrained(target))


@pytest.mark.parametrize("exchange", [True, False])
def test_replacing_a_directory(tmp_path, monkeypatch, exchange):
    """The new model replaces the old one: its stale shards and index go, the files a save does
    not write (tokenizer, generation config, a folder, a symlink) stay; by an exchange of names
    or by two renames."""
    real_exchange, exchanged = save_mod._exchange, []

    def spy(a, b):
        exchanged.append(exchange and real_exchange(a, b))
        return exchanged[-1]

    monkeypatch.setattr(save_mod, "_exchange", spy)
    target = tmp_path / "model"
    _model(seed=0).save_pretrained(target, max_shard_size="4KB")
    (target / "tokenizer.json").write_text('{"x": 1}')
    (target / "extra").mkdir()
    (target / "extra" / "notes.txt").write_text("kept")
    (target / "link.json").symlink_to("tokenizer.json")
    new = _model(seed=7)
    new.save_pretrained(target)
    files = sorted(os.listdir(target))
    assert files == ["config.json", "extra", "link.json", "model.safetensors", "tokenizer.json"]
    assert (target / "tokenizer.json").read_text() == '{"x": 1}'
    assert (target / "extra" / "notes.txt").read_text() == "kept"
    assert os.readlink(target / "link.json") == "tokenizer.json"
    assert _siblings(target) == []
    assert exchanged == [exchange] or (exchange and not sys.platform.startswith("linux"))
    _assert_same_model(new, CausalLM.from_pretrained(target))


@pytest.mark.parametrize("exchange", [True, False])
@pytest.mark.parametrize("inside", [".", "extra"])
def test_saving_into_the_current_directory(tmp_path, monkeypatch, exchange, inside):
    """save_pretrained(".") (or a parent of the current directory): the process is not left in
    the replaced, deleted directory ("." would name nothing, getcwd() would fail) but at the
    same path in the new one, where "." reads the new model."""
    if not exchange:
        monkeypatch.setattr(save_mod, "_exchange", lambda a, b: False)
    target = tmp_path / "model"
    _model(seed=0).save_pretrained(target)
    (target / "extra").mkdir()
    (target / "tokenizer.json").write_text("{}")
    monkeypatch.chdir(target / inside)
    new = _model(seed=7)
    new.save_pretrained("." if inside == "." else "..")
    assert os.getcwd() == str((target / inside).resolve())
    assert os.path.samefile(".", target / inside)
    assert sorted(os.listdir(target)) == ["config.json", "extra", "model.safetensors", "tokenizer.json"]
    _assert_same_model(new, CausalLM.from_pretrained("." if inside == "." else ".."))


def test_files_are_flushed_before_the_rename(tmp_path, monkeypatch):
    order = []
    real_fsync, real_replace = save_mod._fsync, save_mod._replace
    monkeypatch.setattr(save_mod, "_fsync", lambda p: (order.append(("fsync", os.path.basename(p))), real_fsync(p)))
    monkeypatch.setattr(save_mod, "_replace", lambda a, b: (order.append(("replace", None)), real_replace(a, b)))
    _model().save_pretrained(tmp_path / "m", max_shard_size="8KB")
    shards = sorted(f for f in os.listdir(tmp_path / "m"))
    replace = order.index(("replace", None))
    flushed = {name for kind, name in order[:replace]}
    assert set(shards) <= flushed  # every file ...
    assert order[replace - 1][1].startswith(".m.tmp-")  # ... then the directory, then the rename
    assert order[replace + 1 :] == [("fsync", os.path.basename(tmp_path))]  # and the parent after it


def test_errors_before_anything_is_written(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="directory.*not a directory"):
        _model().save_pretrained(tmp_path / "file")
    assert (tmp_path / "file").read_text() == "x" and os.listdir(tmp_path) == ["file"]
    from npattn.models import config_from_hf

    bare = CausalLM(config_from_hf(tiny_config("llama")).replace(hf={}), rng=0)
    with pytest.raises(ValueError, match="Hugging Face config"):
        bare.save_pretrained(tmp_path / "m")
    m = _model()
    object.__setattr__(m, "config", m.config.replace(hf=dict(m.config.hf, initializer_range=float("nan"))))
    with pytest.raises(ValueError, match="JSON"):
        m.save_pretrained(tmp_path / "m")
    assert os.listdir(tmp_path) == ["file"]


def test_saving_does_not_change_the_model(tmp_path):
    m = _model("deepseek_v3")
    before = m.state_dict()
    m.save_pretrained(tmp_path, max_shard_size="4KB")
    _assert_same_model(m, type(m).from_hf(before, dict(m.config.hf)))


# -- a directory that no rename can replace: a mount point (a container's volume) ----------------
def _mount_point(monkeypatch, target):
    """Make ``target`` behave as a mount point: ``os.path.ismount`` says so and renaming it fails
    with EBUSY, as the kernel's does."""
    import errno

    real_ismount, real_rename = os.path.ismount, os.rename
    monkeypatch.setattr(save_mod.os.path, "ismount", lambda p: os.fspath(p) == str(target) or real_ismount(p))

    def rename(a, b):
        if str(target) in (os.fspath(a), os.fspath(b)):
            raise OSError(errno.EBUSY, "Device or resource busy", os.fspath(a))
        real_rename(a, b)

    monkeypatch.setattr(save_mod.os, "rename", rename)


@pytest.mark.parametrize("old_shard, new_shard", [("4KB", "5GB"), ("5GB", "4KB")], ids=["to_one_file", "to_shards"])
def test_a_mount_point_is_updated_in_place(tmp_path, monkeypatch, old_shard, new_shard):
    """A mount point cannot be renamed (EBUSY; the directory-replacing save failed on it): its
    files are replaced in place, the directory itself stays (the same inode), the files a save
    does not write stay, the old weights go, and nothing temporary is left inside or beside it."""
    target = tmp_path / "volume"
    _model(seed=0).save_pretrained(target, max_shard_size=old_shard)
    (target / "tokenizer.json").write_text('{"x": 1}')
    inode = os.stat(target).st_ino
    _mount_point(monkeypatch, target)
    new = _model(seed=7)
    new.save_pretrained(target, max_shard_size=new_shard)
    files = sorted(os.listdir(target))
    weights = [f for f in files if f.endswith(".safetensors") or f.endswith(".index.json")]
    assert sorted(set(files) - set(weights)) == ["config.json", "tokenizer.json"]
    assert (len(weights) > 1) == (new_shard == "4KB")
    assert (target / "tokenizer.json").read_text() == '{"x": 1}'
    assert os.stat(target).st_ino == inode and _siblings(target) == []
    _assert_same_model(new, CausalLM.from_pretrained(target))


@pytest.mark.parametrize("new_shard", ["5GB", "4KB"])
def test_an_interrupted_save_into_a_mount_point_never_loads_a_mix(tmp_path, monkeypatch, new_shard):
    """Interrupted at each removal or rename of the in-place update, the directory loads the old
    model whole, the new one whole, or nothing (refused): never a part of one or a mix of both,
    weights or config (the new model's norms have another eps); the hidden folder of the new
    files is gone."""
    old, new = _model(seed=0), CausalLM(tiny_config("llama", rms_norm_eps=1e-3), rng=7)
    real_remove, real_replace = os.remove, os.replace
    outcomes = set()
    for k in range(64):
        target = tmp_path / f"v{k}"
        old.save_pretrained(target, max_shard_size="4KB")
        with monkeypatch.context() as mp:
            _mount_point(mp, target)
            calls = []

            def failing(real):
                def call(*args):
                    calls.append(args)
                    if len(calls) == k + 1:
                        raise KeyboardInterrupt
                    return real(*args)

                return call

            mp.setattr(save_mod.os, "remove", failing(real_remove))
            mp.setattr(save_mod.os, "replace", failing(real_replace))
            try:
                new.save_pretrained(target, max_shard_size=new_shard)
                finished = True
            except KeyboardInterrupt:
                finished = False
        assert not [e for e in os.listdir(target) if e.startswith(".")]
        try:
            loaded = CausalLM.from_pretrained(target)
        except (FileNotFoundError, ValueError):
            outcomes.add("refused")
        else:
            same_as = [
                m
                for m in (old, new)
                if m.config.rms_norm_eps == loaded.config.rms_norm_eps
                and all(np.array_equal(v, loaded.state_dict()[n]) for n, v in m.state_dict().items())
            ]
            assert len(same_as) == 1, f"interrupted at step {k}: a mix"
            outcomes.add("old" if same_as[0] is old else "new")
        if finished:
            break
    assert outcomes == {"old", "refused", "new"}

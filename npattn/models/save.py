"""``CausalLM.save_pretrained``: a Hugging Face model directory, written atomically.

What transformers' ``save_pretrained`` writes, and what ``from_pretrained`` (both transformers'
and npattn's) reads::

    config.json                      the Hugging Face config the model was built from, "dtype" the saved one
    generation_config.json           the one from_pretrained read (model.generation_config), where it read one
    model.safetensors                every tensor, under the checkpoint's names     (one shard), or
    model-00001-of-0000N.safetensors ... and model.safetensors.index.json          (N shards)

The tensors are the model's state dict (a tied head once, as transformers writes it), each
family's checkpoint layout restored: where ``CheckpointLayout.per_expert`` says the family's
checkpoints keep each routed expert apart (DeepSeek-V3, Qwen3-Next), the fused
``mlp.experts.gate_up_proj (E, 2I, H)`` and ``mlp.experts.down_proj (E, H, I)`` are written as
``mlp.experts.{e}.gate_proj.weight``, ``up_proj.weight`` and ``down_proj.weight``, as
transformers' own ``save_pretrained`` reverts its fusion.  Shards are cut as huggingface_hub's
``split_state_dict_into_shards_factory`` cuts them (in state-dict order, a new shard when the next
tensor would pass ``max_shard_size``; a larger tensor alone), sizes parsed as its
``parse_size_to_int`` (``"5GB"``: decimal units TB, GB, MB, KB) or given as an int of bytes.

Atomic: everything is written into a new hidden sibling directory, every file and the directory
flushed to disk (``fsync``), and only then is it renamed into place.  An existing directory is
replaced in one step where the system can exchange two names (Linux ``renameat2``), else by two
renames (the old directory out of the way, the new one in; the old one is deleted only after).  A
save that fails or is interrupted at any point before that leaves the old directory as it was and
no new directory under the target's name; its temporary sibling is removed.  The files of an
existing directory that a save does not write (a tokenizer, a generation config, a README) are
carried over into the new one (hard links where possible), as transformers' ``save_pretrained``
leaves them in place; its old weights (``model.safetensors``, the index and the
``model-XXXXX-of-XXXXX.safetensors`` shards) are not.  A process whose current directory was the
old directory (or a folder in it: ``save_pretrained(".")``) is moved to the same path in the new
one: it would otherwise stand in a deleted directory, where ``"."`` names nothing and every
relative path fails.

A directory that no rename can replace (a mount point, such as a container's volume, or one in
a folder the process cannot write) is updated in place instead, as transformers writes it: the
new files go into a hidden folder inside it first, all flushed, and only then are they moved in
one rename each, in an order that never leaves a directory that loads a mix of the two models or
a part of one (``_move_in``): the old weights go first, so that until the new ones are all in
place ``from_pretrained`` finds none and refuses the directory; ``model.safetensors``, or the
index of the new shards, comes last.  A save that fails before that leaves the old directory as
it was; one interrupted during the moves leaves a directory that does not load.
"""

from __future__ import annotations

import ctypes
import json
import math
import numbers
import os
import re
import secrets
import shutil
import stat

import numpy as np

from ..functional._bfloat16 import BFloat16Array
from .hf import _EXPERTS_PARENT, save_safetensors

__all__ = ["parse_shard_size", "checkpoint_tensors", "save_pretrained"]

# huggingface_hub's SIZE_UNITS (serialization/_base.py), which transformers' save_pretrained uses
_SIZE_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}
_WEIGHTS = "model.safetensors"
_INDEX = "model.safetensors.index.json"
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
# the fused experts of a family whose checkpoints keep each expert apart (hf.py's _per_expert, reversed)
# (up_proj: experts that are not gated, Nemotron 3's)
_FUSED = re.compile(rf"^(?P<prefix>.*\.{_EXPERTS_PARENT}\.experts)\.(?P<proj>gate_up_proj|up_proj|down_proj)$")


def parse_shard_size(size) -> int:
    """``max_shard_size`` in bytes: an int, or a string of a number and a unit as huggingface_hub's
    ``parse_size_to_int`` reads it (what transformers' ``save_pretrained`` passes it to):
    ``"5GB"`` is ``5 * 10**9``, ``"500MB"``, ``"1.5GB"``, ``"64KB"``, ``"1TB"`` (units in any case,
    powers of 1000).

    Raises
    ------
    TypeError
        Neither an int nor a string (a bool included).
    ValueError
        A string without one of those units or without a number before it, or a size below one byte.

    Examples
    --------
    >>> from npattn.models.save import parse_shard_size
    >>> parse_shard_size("5GB"), parse_shard_size("1.5mb"), parse_shard_size(1024)
    (5000000000, 1500000, 1024)
    """
    if isinstance(size, bool) or not isinstance(size, (numbers.Integral, str)):
        raise TypeError(
            f"max_shard_size: expected an int (bytes) or a string such as '5GB', got {size!r} ({type(size).__name__})"
        )
    if isinstance(size, str):
        text = size.strip()
        unit = text[-2:].upper()
        if unit not in _SIZE_UNITS:
            raise ValueError(
                f"max_shard_size: expected a number and one of the units {list(_SIZE_UNITS)} (powers of 1000, "
                f"as transformers), e.g. '5GB' or '500MB', got {size!r}"
            )
        try:
            value = float(text[:-2].strip())
        except ValueError:
            raise ValueError(f"max_shard_size: expected a number before {unit!r}, got {size!r}") from None
        if not math.isfinite(value):
            raise ValueError(f"max_shard_size: expected a finite size, got {size!r}")
        n = int(value * _SIZE_UNITS[unit])
    else:
        n = int(size)
    if n < 1:
        raise ValueError(f"max_shard_size: expected at least 1 byte, got {size!r} ({n} bytes)")
    return n


def checkpoint_tensors(model) -> dict:
    """``{checkpoint name: array}`` of ``model`` (a ``CausalLM``), views of its parameters and
    buffers (nothing copied), in state-dict order, the routed experts written one expert at a
    time where the config's ``CheckpointLayout.per_expert`` says so.  A parameter kept as
    bfloat16 (``weights_dtype="bfloat16"``) gives ``(uint16 bits, "BF16")`` pairs, its bits as
    held; every other tensor (the norms, biases and routers such a model keeps in float32) is
    written as it is held, so that the checkpoint is the model: rounded to bfloat16, they would
    give other logits (transformers' own save of a bfloat16 model keeps its float32 modules, e.g.
    DeepSeek-V3's router, in float32 too)."""
    layout = model.config.layout
    split = layout.per_expert
    gate, up, down = layout.expert_projs
    out: dict = {}
    for key, owner, name, is_param in model._state_entries():
        arr = owner._parameters[name].data if is_param else getattr(owner, name)
        bits = isinstance(arr, BFloat16Array)
        if bits:
            arr = arr.bits
        parts: dict = {}  # this tensor's checkpoint names and arrays
        m = _FUSED.match(key) if split else None
        if layout.split_conv and key.endswith("self_attn.conv1d.weight"):  # KDA: q's, k's, v's channels
            third = arr.shape[0] // 3
            for i, part in enumerate("qkv"):
                parts[key[: -len("conv1d.weight")] + f"{part}_conv1d.weight"] = arr[i * third : (i + 1) * third]
        elif layout.per_row and key.endswith(layout.per_row):  # StableLM: one LayerNorm a head
            parts.update(row_tensors(key, arr))
        elif m is None:
            parts[key] = arr
        elif m["proj"] == "up_proj":  # (E, I, H), experts that are not gated (their layout's gate None)
            for e in range(arr.shape[0]):
                parts[f"{m['prefix']}.{e}.{up}.weight"] = arr[e]
        elif m["proj"] == "gate_up_proj":  # (E, 2I, H): expert e's gate rows, then its up rows
            half = arr.shape[1] // 2
            for e in range(arr.shape[0]):
                parts[f"{m['prefix']}.{e}.{gate}.weight"] = arr[e, :half]
                parts[f"{m['prefix']}.{e}.{up}.weight"] = arr[e, half:]
        else:  # down_proj (E, H, I)
            for e in range(arr.shape[0]):
                parts[f"{m['prefix']}.{e}.{down}.weight"] = arr[e]
        out.update({k: (a, "BF16") for k, a in parts.items()} if bits else parts)
    if layout.fused:
        out = fused_tensors(out, layout.fused, layout.fused_groups)
    if layout.transposed:  # GPT-2's Conv1D weights: (in, out) in its checkpoints
        out = {k: transposed(v) if k.endswith(layout.transposed) else v for k, v in out.items()}
    if layout.renames:
        out = {_renamed(k, layout.renames): v for k, v in out.items()}
    return out


def transposed(v):
    """A weight ``(out, in)`` as a checkpoint of transformers' ``Conv1D`` stores it, ``(in, out)``
    (``CheckpointLayout.transposed``, a contiguous copy; bfloat16 bits stay bits)."""
    if isinstance(v, tuple):  # (bits, "BF16")
        return (np.ascontiguousarray(v[0].T), v[1])
    return np.ascontiguousarray(np.asarray(v).T)


def row_tensors(key: str, arr) -> dict:
    """The model tensor ``key``'s rows as the checkpoint writes them, one tensor each
    (``CheckpointLayout.per_row``: StableLM's ``<module>.norms.{h}.weight``, views)."""
    return {key[: -len("weight")] + f"norms.{h}.weight": arr[h] for h in range(arr.shape[0])}


def fused_tensors(tensors: dict, fused: tuple, groups: int = 1) -> dict:
    """``tensors`` with each set of parts the checkpoint stacks into one tensor
    (``CheckpointLayout.fused``: Phi-3's ``qkv_proj``, ``gate_up_proj``; GPT-NeoX's
    ``query_key_value`` and its bias) written as that tensor, in the place of its first part (a
    copy: the rows of the parts, in order, or in ``groups`` groups each holding its share of every
    part's rows in order, GPT-NeoX's heads; bfloat16 bits stay bits)."""

    def stacked(vals):
        if groups == 1:
            return np.concatenate(vals)
        split = [np.asarray(a).reshape(groups, -1, *np.shape(a)[1:]) for a in vals]
        return np.concatenate(split, axis=1).reshape(-1, *np.shape(vals[0])[1:])

    out: dict = {}
    for key, v in tensors.items():
        for name, parts in fused:
            p = key.rsplit(".", 1)[-1]
            if p in ("weight", "bias") and key.endswith(f".{parts[0]}.{p}"):
                prefix = key[: -len(f"{parts[0]}.{p}")]
                vals = [tensors[f"{prefix}{part}.{p}"] for part in parts]
                if isinstance(v, tuple):  # (bits, "BF16")
                    out[f"{prefix}{name}.{p}"] = (stacked([b for b, _ in vals]), "BF16")
                else:
                    out[f"{prefix}{name}.{p}"] = stacked(vals)
                break
            if p in ("weight", "bias") and any(key.endswith(f".{part}.{p}") for part in parts[1:]):
                break  # written with its first part
        else:
            out[key] = v
    return out


def _renamed(key: str, renames: tuple) -> str:
    """``key`` as the family's checkpoint writes it (each model part replaced by the checkpoint's)."""
    for model_part, checkpoint_part in renames:
        key = key.replace(model_part, checkpoint_part)
    return key


def _shards(tensors: dict, limit: int) -> list:
    """The names of each shard, as huggingface_hub's ``split_state_dict_into_shards_factory``."""
    shards: list = []
    current: list = []
    size = 0
    for name, arr in tensors.items():
        n = _nbytes(arr)
        if n > limit:  # alone in its own shard, which is larger than the limit
            shards.append([name])
            continue
        if size + n > limit:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += n
    if current or not shards:
        shards.append(current)
    return shards


def _nbytes(value) -> int:
    """The bytes of a tensor of ``checkpoint_tensors``: an array or a ``(bits, code)`` pair."""
    return (value[0] if isinstance(value, tuple) else value).nbytes


def _tagged_floats(obj):
    """``obj`` with each infinite float written as transformers 5 writes it, ``{"__float__":
    "Infinity"}`` (JSON has no infinity; Granite 4.0's ``time_step_limit`` holds one), which its
    configs read back as the float (NaN stays refused: no config means it)."""
    if isinstance(obj, float) and math.isinf(obj):
        return {"__float__": "Infinity" if obj > 0 else "-Infinity"}
    if isinstance(obj, dict):
        return {k: _tagged_floats(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_tagged_floats(v) for v in obj]
    return obj


def _config_text(model, dtype: str) -> str:
    """``config.json``: the Hugging Face config the model was read from, with the saved dtype."""
    config = dict(model.config.hf)
    if not config:
        raise ValueError(
            "model.config: has no Hugging Face config to write (hf is empty: a CausalLMConfig not made by "
            "config_from_hf); build the model from a Hugging Face config dict"
        )
    config["dtype"] = dtype
    if "torch_dtype" in config:  # an older spelling transformers still reads: keep the two equal
        config["torch_dtype"] = dtype
    try:
        return json.dumps(_tagged_floats(config), indent=2, sort_keys=True, allow_nan=False) + "\n"
    except (TypeError, ValueError) as e:
        raise ValueError(f"model.config.hf: cannot be written as JSON ({e})") from None


def _fsync(path: str) -> None:
    """Flush a file or directory to disk (a directory's fsync is not possible everywhere)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. a directory on Windows
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - a file system that cannot
        pass
    finally:
        os.close(fd)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)


def _carry_over(old: str, new: str, written: set) -> None:
    """Bring the entries of the existing directory ``old`` that this save does not write into
    ``new``: symlinks as symlinks, files as hard links (copies across file systems), folders whole."""
    for entry in os.scandir(old):
        if entry.name in written or entry.name in (_WEIGHTS, _INDEX) or _SHARD.fullmatch(entry.name):
            continue
        dst = os.path.join(new, entry.name)
        if entry.is_dir(follow_symlinks=False):
            shutil.copytree(entry.path, dst, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(entry.path, dst)


def _exchange(a: str, b: str) -> bool:
    """Swap the two paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the
    system has no such call (the caller then renames twice)."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError, TypeError):  # pragma: no cover - not glibc
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _sibling(parent: str, base: str, what: str) -> str:
    """A new hidden name beside ``base`` in ``parent`` that nothing holds yet."""
    while True:
        path = os.path.join(parent, f".{base}.{what}-{secrets.token_hex(4)}")
        if not os.path.lexists(path):
            return path


def _replace(tmp: str, target: str) -> None:
    """Put the complete directory ``tmp`` at ``target``; an existing ``target`` goes only after."""
    if not os.path.lexists(target):
        os.rename(tmp, target)
        return
    if _exchange(tmp, target):  # target is the new directory, tmp the old one
        shutil.rmtree(tmp, ignore_errors=True)
        return
    old = _sibling(os.path.dirname(target), os.path.basename(target), "old")
    os.rename(target, old)
    try:
        os.rename(tmp, target)
    except BaseException:
        os.rename(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _replaceable(target: str) -> bool:
    """False for an existing directory that a rename cannot replace: a mount point (``EBUSY``), or
    one whose parent the process cannot write (no sibling to write into)."""
    if not os.path.isdir(target):
        return True
    return not os.path.ismount(target) and os.access(os.path.dirname(target), os.W_OK | os.X_OK)


def _move_in(tmp: str, target: str, files: list) -> None:
    """Put the complete files of ``tmp`` (a folder inside ``target``) into ``target`` one rename at
    a time: the old weights out first (the entry points, ``model.safetensors`` and the index,
    before the shards), so that the directory never loads a mix; then the new files, the one that
    makes the weights loadable (``model.safetensors`` or the index) last."""
    old = [e.name for e in os.scandir(target) if e.name in (_WEIGHTS, _INDEX) or _SHARD.fullmatch(e.name)]
    for name in sorted(old, key=lambda n: _SHARD.fullmatch(n) is not None):
        os.remove(os.path.join(target, name))
    _fsync(target)
    last = _INDEX if _INDEX in files else _WEIGHTS
    for name in [f for f in files if f != last] + [last]:
        os.replace(os.path.join(tmp, name), os.path.join(target, name))
    _fsync(target)
    os.rmdir(tmp)


def _cwd_within(target: str) -> str | None:
    """The current directory if it is ``target`` or inside it (``save_pretrained(".")``), else None."""
    try:
        cwd = os.getcwd()
        return cwd if os.path.commonpath((cwd, target)) == target else None
    except (OSError, ValueError):  # already a deleted directory; another drive (Windows)
        return None


def save_pretrained(model, directory, max_shard_size="5GB") -> None:
    """``CausalLM.save_pretrained`` (see the module docstring).

    Raises
    ------
    TypeError, ValueError
        A ``max_shard_size`` that is not a size (``parse_shard_size``), a ``directory`` that is a
        file, a config that cannot be written as JSON; before anything is written.
    OSError
        From the file system; the old directory (if any) is then as it was, or, updated in place,
        loads the old model, the new one, or none (``_move_in``).
    """
    limit = parse_shard_size(max_shard_size)
    target = os.path.realpath(os.fspath(directory))  # a symlinked directory: the one it points to
    if os.path.lexists(target) and not os.path.isdir(target):
        raise ValueError(f"directory: {os.fspath(directory)!r} exists and is not a directory")
    tensors = checkpoint_tensors(model)
    config = _config_text(model, model.weights_dtype or np.dtype(model.dtype).name)
    shards = _shards(tensors, limit)
    n = len(shards)
    names = [_WEIGHTS] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    parent, base = os.path.split(target)
    os.makedirs(parent, exist_ok=True)
    in_place = not _replaceable(target)
    tmp = _sibling(target, "npattn-save", "tmp") if in_place else _sibling(parent, base, "tmp")
    os.mkdir(tmp)  # the mode a new directory gets (mkdtemp's would be 0700)
    try:
        if os.path.isdir(target) and not in_place:
            os.chmod(tmp, stat.S_IMODE(os.stat(target).st_mode))
        files = ["config.json"]
        with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
            f.write(config)
        if getattr(model, "generation_config", None) is not None:  # as from_pretrained read it
            files.append("generation_config.json")
            with open(os.path.join(tmp, "generation_config.json"), "w", encoding="utf-8") as f:
                f.write(json.dumps(model.generation_config, indent=2, sort_keys=True) + "\n")
        for name, keys in zip(names, shards):
            save_safetensors({k: tensors[k] for k in keys}, os.path.join(tmp, name), {"format": "pt"})
            files.append(name)
        if len(shards) > 1:
            index = {
                "metadata": {
                    "total_parameters": sum(p.data.size for p in model.parameters()),
                    "total_size": sum(_nbytes(a) for a in tensors.values()),
                },
                "weight_map": {k: name for name, keys in zip(names, shards) for k in keys},
            }
            with open(os.path.join(tmp, _INDEX), "w", encoding="utf-8") as f:
                f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
            files.append(_INDEX)
        for name in files:
            _fsync(os.path.join(tmp, name))
        _fsync(tmp)
        if in_place:
            _move_in(tmp, target, files)
            return
        if os.path.isdir(target):
            _carry_over(target, tmp, set(files))
            _fsync(tmp)
        cwd = _cwd_within(target)
        _replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if cwd is not None:  # the process stood in the old directory, now deleted: into the new one, at the same path
        try:
            os.chdir(cwd)
        except OSError:  # pragma: no cover - a folder inside it that the save did not carry over
            pass
    _fsync(parent)

"""Hugging Face checkpoints without torch: safetensors files through a memory map, bfloat16 to
float32, state dicts into a ``CausalLM`` atomically.

The safetensors format (https://github.com/huggingface/safetensors) is small enough to read
directly, and its own numpy API has no bfloat16 (numpy has no such dtype)::

    8 bytes        little-endian uint64 N: the header's length
    N bytes        JSON: {name: {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, ...,
                          "__metadata__": {...}}
    the rest       raw little-endian tensor bytes; offsets count from the end of the header

DeepSeek-V3's and Qwen3-Next's checkpoints keep each routed expert's projections apart
(``mlp.experts.{e}.gate_proj.weight`` ...); they are fused while loading, as transformers does.

A bfloat16 is the upper half of a float32 (1 sign, 8 exponent, 7 mantissa bits), so widening is
exact: ``float32 bits = uint16 bits << 16``.  An ``F8_E4M3`` byte (float8 e4m3fn: 1 sign, 4
exponent bits of bias 7, 3 mantissa bits, no infinity, ``S.1111.111`` NaN) is widened through a
table of its 256 values, exact too.  Released quantized checkpoints (MXFP4, block-scaled FP8) are
dequantized by ``npattn.models.quant`` on top of these tensors.

Loading is lazy: ``open_safetensors`` maps the file and returns ``LazyTensor`` views (nothing is
read); the model is built without drawing random weights, every key and shape is checked, and
only then is each tensor converted, one at a time, into its parameter, after which its pages of
the file are released.  A checkpoint therefore loads within about the final model's own size in
memory (plus one tensor).
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
import warnings
from collections.abc import Mapping

import numpy as np

from .._validate import check_dtype, to_numpy
from ..functional._bfloat16 import BFloat16Array, to_bfloat16_bits, widened

__all__ = [
    "LazyTensor",
    "open_safetensors",
    "open_checkpoint",
    "bf16_to_float32",
    "f8_e4m3_to_float32",
    "save_safetensors",
]

_ST_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # the bits; widened by bf16_to_float32
    "F8_E4M3": np.dtype("u1"),  # the bits; widened by f8_e4m3_to_float32
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_FLOAT_CODES = ("F64", "F32", "F16", "BF16", "F8_E4M3")
_BITS_CODES = ("BF16", "F8_E4M3")  # stored as unsigned integers: their bits, widened when read
# derived buffers some older checkpoints still carry; transformers recomputes them
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
# the reference reader's limit on the header (safetensors/src/tensor.rs, MAX_HEADER_SIZE)
_MAX_HEADER = 100_000_000
_COPIED = 1 << 24  # bytes of a bfloat16 tensor copied (and their file pages released) at a time


def _short(value, limit: int = 200) -> str:
    """``repr(value)`` cut to ``limit`` characters: a header's names and shapes can be megabytes."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _StrictJSONError(ValueError):
    """JSON that Python's parser takes but the format does not (a duplicate key, NaN, Infinity)."""


def _unique_keys(pairs: list) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _StrictJSONError(f"a duplicate key {_short(key)}")
        out[key] = value
    return out


def _no_constant(name: str):
    raise _StrictJSONError(f"{name}, which is not JSON")


def _load_json(data: bytes, path: str, what: str):
    """``data`` (the ``what`` of the file ``path``) as strict JSON, as the reference reader
    (serde_json) takes it: UTF-8, no duplicate keys, no ``NaN``/``Infinity``.  Any failure is a
    ``ValueError`` naming ``path`` that quotes no byte of the file (only positions): the file may
    be any file at all."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: {what} is not UTF-8 (invalid byte at offset {e.start})") from None
    try:
        return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
    except _StrictJSONError as e:
        raise ValueError(f"{path}: {what} has {e}") from None
    except json.JSONDecodeError as e:  # its message can quote a character: give the place only
        raise ValueError(f"{path}: {what} is not valid JSON (line {e.lineno}, column {e.colno})") from None
    except RecursionError:
        raise ValueError(f"{path}: {what} nests its JSON too deeply to be read") from None
    except ValueError:  # e.g. an integer of more digits than int() converts
        raise ValueError(f"{path}: {what} is not JSON that can be read (an oversized number)") from None


def _is_size(x) -> bool:
    """A JSON non-negative integer (not a float such as 1.0, a string, or a bool)."""
    return type(x) is int and x >= 0


def _nbytes(shape: list, itemsize: int) -> int | None:
    """``prod(shape) * itemsize``, or ``None`` when it exceeds 2**64 (no file holds that; the
    product of a 100 MB shape is not computed in full)."""
    if 0 in shape:
        return 0
    n = itemsize
    for s in shape:
        n *= s
        if n > 2**64:
            return None
    return n


def _header_tensors(header: dict, path: str, data_size: int) -> list:
    """The tensors of a parsed safetensors header as ``(name, dtype code, shape, begin, end)``
    (offsets into the data buffer, header order), checked as the reference reader
    (``read_metadata`` and ``Metadata::validate`` in safetensors/src/tensor.rs) checks them:
    ``__metadata__`` maps strings to strings (or is null); every entry has a known ``dtype``, a
    ``shape`` of non-negative integers and ``data_offsets`` of two, ``end - begin`` bytes being
    ``prod(shape) * itemsize``; sorted by offset, the tensors tile the data buffer exactly (the
    first begins at 0, each where the one before ends, the last at the buffer's end)."""
    meta = header.get("__metadata__")
    if meta is not None:
        bad = [k for k, v in meta.items() if not isinstance(v, str)] if isinstance(meta, dict) else None
        if bad is None or bad:
            got = _short(meta) if bad is None else f"{_short(bad[0])}: {_short(meta[bad[0]])}"
            raise ValueError(f"{path}: '__metadata__' must map strings to strings, got {got}")
    tensors = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {_short(name)}"
        if not isinstance(info, dict):
            raise ValueError(
                f"{where} has a malformed header entry: expected an object with 'dtype', 'shape' and "
                f"'data_offsets', got {_short(info)}"
            )
        for field in ("dtype", "shape", "data_offsets"):
            if field not in info:
                raise ValueError(f"{where} has a malformed header entry: no {field!r}")
        code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(code, str) or code not in _ST_DTYPES:
            raise ValueError(f"{where} has dtype {_short(code)}, expected one of {sorted(_ST_DTYPES)}")
        if not isinstance(shape, list) or not all(_is_size(s) for s in shape):
            raise ValueError(
                f"{where} has a malformed header entry: 'shape' must be a list of non-negative integers, "
                f"got {_short(shape)}"
            )
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_size(o) for o in offsets):
            raise ValueError(
                f"{where} has a malformed header entry: 'data_offsets' must be two non-negative integers "
                f"[begin, end], got {_short(offsets)}"
            )
        begin, end = offsets
        nbytes = _nbytes(shape, _ST_DTYPES[code].itemsize)
        if end - begin != nbytes:
            needs = "more than 2**64 bytes" if nbytes is None else f"{nbytes} bytes"
            raise ValueError(
                f"{where} ({code} {_short(shape)}) needs {needs}, its data_offsets [{begin}, {end}] give {end - begin}"
            )
        tensors.append((name, code, shape, begin, end))
    reached, before = 0, None
    for name, _, _, begin, end in sorted(tensors, key=lambda t: (t[3], t[4])):
        if begin != reached:
            how = (
                f"overlap tensor {_short(before)}, which ends at byte {reached}"
                if begin < reached
                else f"leave a gap: bytes [{reached}, {begin}) of the data belong to no tensor"
            )
            raise ValueError(f"{path}: tensor {_short(name)}: its data_offsets [{begin}, {end}] {how}")
        reached, before = end, name
    if reached != data_size:
        last = "no tensors" if before is None else f"tensor {_short(before)}, the last, ends at byte {reached}"
        why = "the file is truncated" if reached > data_size else f"bytes [{reached}, {data_size}) belong to no tensor"
        raise ValueError(f"{path}: {last}, but the file has {data_size} bytes of data after the header ({why})")
    return tensors


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 values given as their ``uint16`` bit patterns -> float32 (exact)."""
    return widened(np.asarray(bits, dtype=np.uint16))


def _f8_e4m3_table() -> np.ndarray:
    """The 256 values of float8 e4m3fn (torch's ``float8_e4m3fn``, safetensors' ``F8_E4M3``) by
    bit pattern: ``(-1)**s * 2**(e - 7) * (1 + m/8)`` for an exponent field ``e`` of 1..15,
    ``(-1)**s * 2**-6 * (m/8)`` for ``e = 0`` (subnormal; ``0x80`` is -0.0), NaN for
    ``S.1111.111`` (the format has no infinity: ``S.1111.110`` is 448, the largest), its sign and
    mantissa bits moved into the float32 NaN as torch's conversion does (``0xFF -> 0xFFF00000``)."""
    b = np.arange(256)
    e, m = (b >> 3) & 0xF, (b & 0x7).astype(np.float64)
    magnitude = np.where(e == 0, m / 8 * 2.0**-6, (1 + m / 8) * np.exp2(e - 7.0))
    values = np.where(b & 0x80, -magnitude, magnitude).astype(np.float32)  # every value is exact
    nan = (b & 0x7F) == 0x7F
    values.view(np.uint32)[nan] = (b[nan].astype(np.uint32) >> 7 << 31) | 0x7FF00000
    return values


_F8_E4M3 = _f8_e4m3_table()


def f8_e4m3_to_float32(bits: np.ndarray) -> np.ndarray:
    """float8 e4m3fn values given as their ``uint8`` bit patterns -> float32 (exact, by table)."""
    return _F8_E4M3[np.asarray(bits, dtype=np.uint8)]


def _widened(code: str, raw: np.ndarray) -> np.ndarray:
    """The values of ``raw``, a tensor's data as stored (``_ST_DTYPES[code]``): bit patterns of
    bfloat16 and float8 become float32, every other dtype is itself."""
    if code == "BF16":
        return bf16_to_float32(raw)
    if code == "F8_E4M3":
        return f8_e4m3_to_float32(raw)
    return raw


def rounds_into_bits(read_into):
    """Mark a ``read_into`` that also takes ``uint16`` bfloat16 bits and rounds as it reads:
    ``_read_part`` hands such a reader a parameter's bits, and any other reader a float32 array
    (a subclass's own ``read_into``, e.g. ``quant.Dequantized``'s, is unmarked until it says so)."""
    read_into.rounds_into_bits = True
    return read_into


class LazyTensor:
    """One tensor of a safetensors file: ``name``, ``shape``, ``dtype`` (the file's code, e.g.
    ``"BF16"``); ``numpy(dtype)`` reads and converts it (the file stays mapped, nothing is kept)."""

    __slots__ = ("name", "shape", "dtype", "_mm", "_begin", "_end")

    def __init__(self, name, shape, dtype, mm, begin, end):
        self.name, self.shape, self.dtype = name, tuple(shape), dtype
        self._mm, self._begin, self._end = mm, begin, end

    def _raw(self) -> np.ndarray:
        return self._mm.array[self._begin : self._end].view(_ST_DTYPES[self.dtype]).reshape(self.shape)

    def numpy(self, dtype=None) -> np.ndarray:
        """The tensor as a new ndarray of ``dtype`` (default: its own; bfloat16 and float8 become
        float32)."""
        out = np.array(_widened(self.dtype, self._raw()), dtype=dtype, copy=True)
        self._mm.release(self._begin, self._end)
        return out

    @rounds_into_bits
    def read_into(self, out: np.ndarray) -> None:
        """Convert the tensor straight into ``out`` (a float array of its shape), without a
        temporary copy where possible: bfloat16 into float32 widens the bits in place.  ``out``
        may also be C-contiguous ``uint16`` bfloat16 bits: a ``BF16`` tensor's as stored
        (``read_bits_into``), any other's values read as float32 and rounded (``to_bfloat16_bits``)
        ``_COPIED`` bytes of float32 at a time, each part's file pages released once read: no
        float32 copy of the whole tensor (an embedding table's)."""
        if out.dtype == np.uint16 and out.flags.c_contiguous:  # bfloat16 bits: a BF16 tensor's as stored
            if self.dtype == "BF16":
                self.read_bits_into(out)
            else:
                self._round_into(out)
            return
        raw = self._raw()
        if self.dtype == "BF16" and out.dtype == np.float32 and out.flags.c_contiguous:
            bits = out.view(np.uint32)
            bits[...] = raw
            bits <<= 16
        else:
            out[...] = _widened(self.dtype, raw)
        self._mm.release(self._begin, self._end)

    def _round_into(self, out: np.ndarray) -> None:
        raw = self._raw()
        src, dst = raw.reshape(-1), out.reshape(-1)
        step, size = _COPIED // 4, raw.itemsize
        for i in range(0, src.size, step):
            part = np.asarray(_widened(self.dtype, src[i : i + step]), np.float32)  # as float32 first
            to_bfloat16_bits(part, out=dst[i : i + step])
            self._mm.release(self._begin + size * i, self._begin + size * min(src.size, i + step))

    def read_bits_into(self, out: np.ndarray) -> None:
        """A ``BF16`` tensor's bits, as stored, into ``out`` (``uint16`` of its shape), ``_COPIED``
        bytes at a time, each part's pages of the file released once copied: a large tensor (an
        embedding table) never holds its file pages and its copy at once."""
        src, dst = self._raw().reshape(-1), out.reshape(-1)
        if not np.shares_memory(dst, out):  # (out not contiguous: one copy)
            out[...] = self._raw()
            self._mm.release(self._begin, self._end)
            return
        step = _COPIED // 2
        for i in range(0, src.size, step):
            dst[i : i + step] = src[i : i + step]
            self._mm.release(self._begin + 2 * i, self._begin + 2 * min(src.size, i + step))

    def rows(self, start: int, stop: int) -> LazyTensor:
        """Rows ``start:stop`` (the first axis) as a tensor of their own: a row-major tensor's
        rows are one range of the file's bytes, read and released as any tensor's."""
        row = (self._end - self._begin) // self.shape[0] if self.shape[0] else 0
        shape = (stop - start, *self.shape[1:])
        return LazyTensor(self.name, shape, self.dtype, self._mm, self._begin + start * row, self._begin + stop * row)

    def __repr__(self):
        return f"LazyTensor({self.name!r}, shape={self.shape}, dtype={self.dtype})"


class _Mapping:
    """A read-only memory map of a file: ``array`` (its bytes as uint8) and ``release(begin, end)``,
    which tells the kernel this process is done with those pages (``MADV_DONTNEED``): they leave
    the process's resident memory at once instead of staying mapped until the file is closed, so
    loading holds the model and not the model plus the checkpoint."""

    def __init__(self, path: str, size: int):
        self.mm = None
        self.array = np.zeros(0, np.uint8)
        if size:
            with open(path, "rb") as f:
                self.mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self.array = np.frombuffer(self.mm, dtype=np.uint8)

    def release(self, begin: int, end: int) -> None:
        advice = getattr(mmap, "MADV_DONTNEED", None)
        if self.mm is None or advice is None or end <= begin:  # pragma: no cover - not Linux
            return
        page = mmap.PAGESIZE
        start = begin // page * page
        try:
            self.mm.madvise(advice, start, end - start)
        except (OSError, ValueError):  # pragma: no cover - an advice the platform refuses changes nothing
            pass


def open_safetensors(path) -> dict:
    """``{name: LazyTensor}`` of a ``.safetensors`` file, memory-mapped (read on demand).

    Raises
    ------
    FileNotFoundError
        No such file.
    ValueError
        A malformed file, refused as the format's reference reader refuses it (a header length
        beyond the file or over 100,000,000 bytes, JSON that is not one object without duplicate
        keys, an unknown dtype, a shape or offsets that are not non-negative integers, offsets
        that disagree with the shape or do not tile the data exactly, a ``__metadata__`` that is
        not strings to strings), naming the file and the tensor.  No message shows the file's
        bytes (a file that is not a safetensors file says so).
    """
    path = os.fspath(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        # the length is never printed: in a file that is not a safetensors file, those are its first 8 bytes
        n = int.from_bytes(head, "little")
        if n > _MAX_HEADER:
            raise ValueError(
                f"{path}: not a safetensors file (its header length exceeds the format's limit of "
                f"{_MAX_HEADER:,} bytes)"
            )
        if n > size - 8:
            raise ValueError(f"{path}: not a safetensors file (its header length exceeds the file's {size} bytes)")
        raw = f.read(n)
    header = _load_json(raw, path, "the header")
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a safetensors file (the header is not a JSON object)")
    start = 8 + n
    tensors = _header_tensors(header, path, size - start)
    mm = _Mapping(path, size if size > start else 0)
    return {name: LazyTensor(name, shape, code, mm, start + b, start + e) for name, code, shape, b, e in tensors}


def save_safetensors(tensors: Mapping, path, metadata: Mapping | None = None) -> None:
    """Write ``{name: ndarray}`` as a safetensors file (float64/32/16 and integer arrays; pass
    bfloat16 as ``(uint16 bits, "BF16")`` pairs and float8 as ``(uint8 bits, "F8_E4M3")``).  The
    header is made from the shapes first, then each tensor's bytes are written straight from its
    array (a contiguous one is not copied), so writing holds no second copy of the tensors."""
    codes = {v: k for k, v in _ST_DTYPES.items() if k not in _BITS_CODES}
    header: dict = {}
    arrays = []
    offset = 0
    for name, value in tensors.items():
        # np.asarray with order "C", not np.ascontiguousarray, which makes a 0-d array 1-d (xIELU's
        # beta and eps buffers are 0-d tensors in transformers' checkpoints)
        if isinstance(value, tuple):
            arr, code = np.asarray(value[0], dtype=_ST_DTYPES[value[1]], order="C"), value[1]
        else:
            arr = np.asarray(value, order="C")
            arr = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
            code = codes[arr.dtype]
        header[name] = {"dtype": code, "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        arrays.append(arr)
        offset += arr.nbytes
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # align the data to 8 bytes, as the reference writer does
    with open(os.fspath(path), "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for arr in arrays:
            if arr.nbytes:  # (a memoryview of an empty array cannot be cast to bytes)
                f.write(arr.data.cast("B"))


def _shard_roots(root: str) -> list:
    """The folders a shard of the model directory ``root`` (a real path) may resolve into:
    ``root``, and for a Hugging Face cache snapshot (``<repo>/snapshots/<revision>[/<subfolder>]``,
    whose files huggingface_hub keeps as symlinks ``-> ../../blobs/<hash>``) that repository's
    ``blobs`` folder."""
    roots = [root]
    child, parent = root, os.path.dirname(root)
    while parent != child:
        if os.path.basename(parent) == "snapshots":
            blobs = os.path.join(os.path.dirname(parent), "blobs")
            if os.path.isdir(blobs):
                roots.append(blobs)
            break
        child, parent = parent, os.path.dirname(parent)
    return roots


def _read_index(index: str, directory: str) -> tuple[dict, dict]:
    """``(weight_map, {shard name: its path})`` of ``model.safetensors.index.json``, every
    shard checked before any is opened: a file name (a non-empty string) that resolves, after
    symlinks, inside ``directory`` (see ``_shard_roots``) and exists.

    Raises ``ValueError`` naming the index and the key or shard (malformed JSON, no
    ``weight_map`` object, a value that is not a file name, a shard outside the directory) and
    ``FileNotFoundError`` for a missing shard."""
    with open(index, "rb") as f:
        obj = _load_json(f.read(), index, "the index")
    if not isinstance(obj, dict) or "weight_map" not in obj:
        got = "an object with no 'weight_map'" if isinstance(obj, dict) else _short(obj)
        raise ValueError(f"{index}: expected a JSON object with a 'weight_map', got {got}")
    weight_map = obj["weight_map"]
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: 'weight_map' must map tensor names to shard file names, got {_short(weight_map)}")
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard or "\0" in shard:
            raise ValueError(f"{index}: weight_map[{_short(name)}] must be a shard file name, got {_short(shard)}")
    root = os.path.realpath(directory)
    roots = _shard_roots(root)
    paths = {}
    for shard in sorted(set(weight_map.values())):
        real = os.path.realpath(os.path.join(root, shard))
        if not any(os.path.commonpath((r, real)) == r for r in roots):
            raise ValueError(
                f"{index}: the shard {_short(shard)} is outside the model directory {directory!r} "
                f"(it resolves to {real!r})"
            )
        paths[shard] = os.path.join(directory, shard)  # messages name the file as the index does
    for shard, path in paths.items():
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{index}: the shard {_short(shard)} is missing")
    return weight_map, paths


def open_checkpoint(directory) -> tuple[dict, dict]:
    """``(config dict, {name: LazyTensor})`` of a saved Hugging Face model directory:
    ``config.json`` and ``model.safetensors`` or the shards named by ``model.safetensors.index.json``.

    Raises
    ------
    FileNotFoundError
        No such directory, no ``config.json``, or no safetensors weights (or a missing shard).
    ValueError
        A malformed ``config.json``, index or safetensors file, or a shard the index names
        outside the directory (after symlinks), before any shard is opened.
    """
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"directory: no such directory {directory!r}")
    cfg_path = os.path.join(directory, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"directory: no config.json in {directory!r}")
    with open(cfg_path, "rb") as f:
        config = _load_json(f.read(), cfg_path, "config.json")  # strict: a duplicate key is ambiguous
    if not isinstance(config, dict):
        raise ValueError(f"{cfg_path}: expected a JSON object (the model's config), got {type(config).__name__}")
    single = os.path.join(directory, "model.safetensors")
    index = os.path.join(directory, "model.safetensors.index.json")
    tensors: dict = {}
    if os.path.isfile(single):
        tensors = open_safetensors(single)
    elif os.path.isfile(index):
        weight_map, paths = _read_index(index, directory)
        for shard, shard_path in paths.items():
            for name, t in open_safetensors(shard_path).items():
                if weight_map.get(name) == shard:
                    tensors[name] = t
        missing = [k for k in weight_map if k not in tensors]
        if missing:
            raise ValueError(f"{index}: tensor {missing[0]!r} is not in its shard {weight_map[missing[0]]!r}")
    else:
        raise FileNotFoundError(
            f"directory: no model.safetensors or model.safetensors.index.json in {directory!r} "
            "(npattn reads safetensors weights only)"
        )
    return config, tensors


# -- state dicts -> CausalLM -------------------------------------------------------------
class _Source:
    """A state-dict value's shape and float-ness without converting it (numpy, torch, lazy)."""

    __slots__ = ("value", "shape", "kind", "name")

    def __init__(self, key, value):
        self.value = value
        self.name = key
        if isinstance(value, LazyTensor):
            self.shape, self.kind = value.shape, value.dtype
        elif hasattr(value, "detach") and hasattr(value, "shape") and hasattr(value, "dtype"):  # a torch tensor
            self.shape, self.kind = tuple(value.shape), str(value.dtype).replace("torch.", "")
        else:
            arr = to_numpy(value, f"state_dict[{key!r}]")
            self.value, self.shape, self.kind = arr, arr.shape, arr.dtype.name

    @property
    def is_float(self) -> bool:
        return self.kind in ("float64", "float32", "float16", "bfloat16") or self.kind in _FLOAT_CODES

    @property
    def natural_dtype(self):
        return np.dtype(np.float64) if self.kind in ("float64", "F64") else np.dtype(np.float32)

    def read_into(self, out: np.ndarray) -> None:
        if isinstance(self.value, LazyTensor):
            self.value.read_into(out)
        else:
            out[...] = self.numpy(out.dtype)

    def numpy(self, dtype) -> np.ndarray:
        v = self.value
        if isinstance(v, LazyTensor):
            return v.numpy(dtype)
        if not isinstance(v, np.ndarray):  # torch: bfloat16/float16 have no numpy form; widen first
            v = v.detach().cpu()
            if self.kind in ("bfloat16", "float16"):
                v = v.float()
            v = v.numpy()
        return np.array(v, dtype=dtype, copy=True)


# Checkpoints of DeepSeek-V3 and Qwen3-Next (and transformers' own save_pretrained of them) keep
# each routed expert's projections apart, ``mlp.experts.{e}.{gate,up,down}_proj.weight``; the
# model holds them fused as transformers 5 does: ``gate_up_proj (E, 2I, H)`` (expert e's gate rows,
# then its up rows) and ``down_proj (E, H, I)``.  transformers merges them while loading; so do we,
# each part written straight into its slice of the fused parameter, where the config's
# ``CheckpointLayout`` says its family's checkpoints may be written so (``per_expert``).
# Nemotron 3's experts are not gated: ``mixer.experts.{e}.{up,down}_proj.weight`` stacked into
# ``up_proj (E, I, H)`` and ``down_proj (E, H, I)`` (its layout's gate None).
# the module holding the experts: ``mlp`` (LFM2-MoE's ``feed_forward``, Nemotron-H's ``mixer``, their ``layer_names``)
_EXPERTS_PARENT = "(?:mlp|feed_forward|mixer)"


def _per_expert(projs: tuple) -> re.Pattern:
    """The per-expert key pattern for the three projection names ``projs`` (gate, up, down; the
    gate None for experts that are not gated)."""
    names = "|".join(re.escape(p) for p in projs if p is not None)
    return re.compile(rf"^(?P<prefix>.*\.{_EXPERTS_PARENT}\.experts)\.(?P<e>[0-9]+)\.(?P<proj>{names})\.weight$")


def _read_part(s, out: np.ndarray) -> None:
    """``s`` (a source, or a part of a fused one) into ``out``: a float array, or ``uint16``
    bfloat16 bits — a ``BF16`` tensor's bits as stored (exact, no float32 copy), any other tensor
    read as float32 and rounded to nearest even."""
    if out.dtype != np.uint16 or isinstance(s, (_Merged, _Stacked, _Rows)):
        s.read_into(out)  # a fused tensor reads each of its parts through _read_part
        return
    v = s.value if isinstance(s, _Source) else s
    if isinstance(v, LazyTensor) and v.dtype == "BF16":
        v.read_bits_into(out)
    elif getattr(getattr(v, "read_into", None), "rounds_into_bits", False) and out.flags.c_contiguous:
        v.read_into(out)  # rounded block by block as it reads
    else:
        tmp = np.empty(out.shape, np.float32)
        s.read_into(tmp)
        to_bfloat16_bits(tmp, out=out)


class _Merged:
    """A fused experts tensor made of per-expert parts (``_Source``s): ``rows[e]`` is the list of
    parts stacked along axis 0 for expert ``e`` (gate then up, or down alone).  ``shape`` is what
    the parts make if each is like expert 0's first; ``mismatch(expected)`` says which part is not
    its share of the expected fused shape."""

    def __init__(self, name: str, prefix: str, projs: tuple, rows: list):
        self.name, self.prefix, self.projs, self.rows = name, prefix, projs, rows
        first = rows[0][0]
        self.shape = (len(rows), len(projs) * first.shape[0], *first.shape[1:])
        self.kind = first.kind

    @property
    def first_key(self) -> str:
        return self.rows[0][0].name

    def mismatch(self, expected: tuple) -> str | None:
        """None if the parts make ``expected`` (``(E, k * rows, cols)``); else the message naming
        the first part (or expert) that does not."""
        n, k = len(self.rows), len(self.projs)
        if n != expected[0]:
            e = min(n, expected[0])
            what = "unexpected" if n > expected[0] else "missing"
            return (
                f"state_dict: {what} key '{self.prefix}.{e}.{self.projs[0]}.weight' (the config has {expected[0]} "
                f"experts, the state dict {n})"
            )
        part_shape = (expected[1] // k, *expected[2:])
        for parts in self.rows:
            for part in parts:
                if tuple(part.shape) != part_shape:
                    halves = ", whose gate and up halves are equal" if k == 2 else ""
                    return (
                        f"state_dict[{part.name!r}]: expected a 2-D tensor of shape {part_shape} (its part of "
                        f"{self.name} {tuple(expected)}{halves}), got {tuple(part.shape)}"
                    )
        return None

    @property
    def is_float(self) -> bool:
        return all(p.is_float for parts in self.rows for p in parts)

    @property
    def natural_dtype(self):
        return self.rows[0][0].natural_dtype

    def read_into(self, out: np.ndarray) -> None:
        for e, parts in enumerate(self.rows):
            r = 0
            for part in parts:
                _read_part(part, out[e, r : r + part.shape[0]])
                r += part.shape[0]


class _Stacked:
    """One model tensor a checkpoint writes in parts along axis 0 (Kimi's ``q_conv1d``,
    ``k_conv1d``, ``v_conv1d`` for a KDA layer's ``conv1d.weight``), equal parts in order;
    ``new_axis``: each part is one row (StableLM's per-head norms, ``CheckpointLayout.per_row``)."""

    def __init__(self, name: str, parts: list, new_axis: bool = False):
        self.name, self.parts, self.new_axis = name, parts, new_axis
        first = parts[0]
        rows = len(parts) if new_axis else sum(p.shape[0] for p in parts)
        self.shape = (rows, *(first.shape if new_axis else first.shape[1:]))
        self.kind = first.kind

    @property
    def first_key(self) -> str:
        return self.parts[0].name

    def mismatch(self, expected: tuple) -> str | None:
        n = len(self.parts)
        if self.new_axis and n != expected[0]:
            row = self.parts[0].name[: -len("0.weight")] + f"{min(n, expected[0])}.weight"
            what = "unexpected" if n > expected[0] else "missing"
            return f"state_dict: {what} key {row!r} ({self.name} has {expected[0]} rows, the state dict {n})"
        share = tuple(expected[1:]) if self.new_axis else (expected[0] // len(self.parts), *expected[1:])
        for part in self.parts:
            if tuple(part.shape) != share:
                return (
                    f"state_dict[{part.name!r}]: expected shape {share} (its part of {self.name} "
                    f"{tuple(expected)}), got {tuple(part.shape)}"
                )
        return None

    @property
    def is_float(self) -> bool:
        return all(p.is_float for p in self.parts)

    @property
    def natural_dtype(self):
        return self.parts[0].natural_dtype

    def read_into(self, out: np.ndarray) -> None:
        r = 0
        for part in self.parts:
            if self.new_axis:
                _read_part(part, out[r])
                r += 1
                continue
            _read_part(part, out[r : r + part.shape[0]])
            r += part.shape[0]


def _row_range(name: str, fused, start: int, stop: int):
    """Rows ``start:stop`` of a fused checkpoint tensor (a ``_Source``: Phi-3's ``qkv_proj`` or
    ``gate_up_proj``) as the model tensor ``name``: a safetensors tensor's rows as a tensor of
    their own (``LazyTensor.rows``: each part reads its own bytes, BF16 widened in place), and so
    a lazy tensor's whose class reads rows its own way (a GGUF file's: each part dequantizes its
    own blocks); an array's or a torch tensor's as a view; any other (a tensor computed whole when
    read, ``quant.Dequantized``) through ``_Rows``."""
    v = fused.value
    if type(v) is LazyTensor or (isinstance(v, LazyTensor) and type(v).rows is not LazyTensor.rows):
        return _Source(name, v.rows(start, stop))
    if isinstance(v, np.ndarray) or hasattr(v, "detach"):  # a numpy array or a torch tensor: a view
        return _Source(name, v[start:stop])
    return _Rows(name, fused, start, stop)


class _Rows:
    """Rows ``start:stop`` of a fused checkpoint tensor (a ``_Source``) as one model tensor
    (``CheckpointLayout.fused``), the whole tensor read for each part (``_row_range``'s last case:
    a tensor computed whole when read)."""

    def __init__(self, name: str, fused, start: int, stop: int, index=None):
        self.name, self.fused = name, fused
        # index: the rows as an array (GPT-NeoX's per-head groups), else start:stop
        self.rows = slice(start, stop) if index is None else index
        self.shape = (stop - start if index is None else len(index), *fused.shape[1:])
        self.kind = fused.kind

    @property
    def first_key(self) -> str:
        return self.fused.name

    def mismatch(self, expected: tuple) -> str | None:
        if tuple(self.shape) == tuple(expected):
            return None
        return f"state_dict[{self.fused.name!r}]: expected {tuple(expected)} rows for {self.name}, got {self.shape}"

    @property
    def is_float(self) -> bool:
        return self.fused.is_float

    @property
    def natural_dtype(self):
        return self.fused.natural_dtype

    def numpy(self, dtype) -> np.ndarray:
        return self.fused.numpy(dtype)[self.rows].copy()

    def read_into(self, out: np.ndarray) -> None:
        if out.dtype == np.uint16:  # bfloat16 bits: the rows read as float32 (exact for a BF16 file), rounded
            to_bfloat16_bits(np.ascontiguousarray(self.fused.numpy(np.float32)[self.rows]), out=out)
        else:
            out[...] = self.fused.numpy(out.dtype)[self.rows]


def checkpoint_key(key: str, layout) -> str:
    """The checkpoint's name of the model's ``key``: the fused tensor that holds its rows
    (``CheckpointLayout.fused``), else ``key``."""
    for fused, parts in layout.fused:
        for part in parts:
            for p in ("weight", "bias"):
                if key.endswith(f".{part}.{p}"):
                    return key[: -len(f"{part}.{p}")] + f"{fused}.{p}"
    return key


def _split_fused(src: dict, cfg) -> dict:
    """``src`` with each fused checkpoint tensor (``CheckpointLayout.fused``) replaced by its
    parts' rows under the model's names, the row counts the config's.  Raises ``ValueError``
    naming the fused key when its shape is not its parts' stacked, or when a part's own key is
    given beside it; a fused key the config has no layer for is left as it is (unexpected)."""
    from .causal_lm import _state_shapes

    found = {}
    for key in list(src):
        for fused, parts in cfg.layout.fused:
            for p in ("weight", "bias"):  # GPT-NeoX's query_key_value has a bias, fused alike
                if key.endswith(f".{fused}.{p}"):
                    found[key] = [key[: -len(f"{fused}.{p}")] + f"{part}.{p}" for part in parts]
    if not found:
        return src
    wanted = {k for names in found.values() for k in names}
    shapes: dict = {}
    for key, shape in _state_shapes(cfg):
        if key in wanted:
            shapes[key] = shape
            if len(shapes) == len(wanted):
                break
    for key, names in found.items():
        if any(n not in shapes for n in names):
            continue  # no such layer: refused as unexpected
        s = src[key]
        rows = [shapes[n][0] for n in names]
        expected = (sum(rows), *shapes[names[0]][1:])
        if tuple(s.shape) != expected:
            parts = " + ".join(f"{r} ({n.rsplit('.', 2)[-2]})" for r, n in zip(rows, names))
            raise ValueError(f"state_dict[{key!r}]: expected shape {expected} (rows {parts}), got {tuple(s.shape)}")
        for n in names:
            if n in src:
                raise ValueError(f"state_dict: both {key!r} and {n!r}, one of its parts (give one or the other)")
        del src[key]
        g = cfg.layout.fused_groups
        if g > 1:  # each group holds its share of every part's rows, in order (GPT-NeoX's heads)
            per, offsets = [r // g for r in rows], np.cumsum([0] + [r // g for r in rows])
            for n, k, off in zip(names, per, offsets):
                index = (np.arange(g)[:, None] * offsets[-1] + off + np.arange(k)).ravel()
                src[n] = _Rows(n, s, 0, 0, index)
            continue
        start = 0
        for n, r in zip(names, rows):
            src[n] = _row_range(n, s, start, start + r)
            start += r
    return src


class _Transposed:
    """A checkpoint's ``(in, out)`` weight (transformers' ``Conv1D``, ``CheckpointLayout.transposed``)
    as the model's ``(out, in)``: read whole and transposed."""

    __slots__ = ("source", "name", "shape", "kind", "value")

    def __init__(self, source):
        self.source, self.name, self.kind = source, source.name, source.kind
        self.shape = tuple(reversed(source.shape))
        self.value = None  # no array or lazy tensor of its own: a fused one's rows are read through _Rows

    @property
    def natural_dtype(self):  # the model's dtype where this comes first in the state dict
        return self.source.natural_dtype

    def numpy(self, dtype) -> np.ndarray:
        return np.ascontiguousarray(self.source.numpy(dtype).T)

    def read_into(self, out: np.ndarray) -> None:  # a float array (_read_part rounds bfloat16 bits itself)
        out[...] = self.source.numpy(out.dtype).T


_CONV_PART = re.compile(r"^(?P<prefix>.*\.self_attn\.)(?P<part>[qkv])_conv1d\.weight$")


def _checkpoint_names(src: dict, layout) -> dict:
    """``src`` under the model's names where the family's checkpoints write others
    (``CheckpointLayout.renames``, ``split_conv``); a key reached two ways is refused by name."""
    out: dict = {}
    base = layout.base_prefix
    for key, s in src.items():
        new = key
        if base and not key.startswith((base, "model.", "lm_head.")):  # a bare model's checkpoint (GPT-2's h.0...)
            new = base + key
        for model_part, checkpoint_part in layout.renames:
            new = new.replace(checkpoint_part, model_part)
        if new != key and new.endswith(layout.transposed or ("\0",)):  # GPT-2's Conv1D: (in, out) as written
            s = _Transposed(s)
        if new in out:
            raise ValueError(f"state_dict: {key!r} and {out[new].name!r} are the same tensor {new!r} (give one)")
        out[new] = s
    if layout.per_row:
        out = _stacked_rows(out, layout.per_row)
    if not layout.split_conv:
        return out
    groups: dict = {}
    for key in list(out):
        m = _CONV_PART.match(key)
        if m:
            groups.setdefault(m["prefix"], {})[m["part"]] = out.pop(key)
    for prefix, parts in groups.items():
        for part in "qkv":
            if part not in parts:
                raise ValueError(f"state_dict: missing key '{prefix}{part}_conv1d.weight' (with its q, k, v parts)")
        name = prefix + "conv1d.weight"
        if name in out:
            raise ValueError(f"state_dict: both {name!r} and '{prefix}q_conv1d.weight', ... (give one or the other)")
        out[name] = _Stacked(name, [parts[p] for p in "qkv"])
    return out


_PER_ROW = re.compile(r"^(?P<prefix>.*)\.norms\.(?P<h>[0-9]+)\.weight$")


def _stacked_rows(src: dict, endings: tuple) -> dict:
    """``src`` with the one-row tensors ``<module>.norms.{h}.weight`` of a model tensor ending in
    one of ``endings`` (``CheckpointLayout.per_row``: StableLM's per-head LayerNorms) stacked into
    ``<module>.weight``; a missing row, a leading zero or both forms given are refused by name."""
    groups: dict = {}
    for key in list(src):
        m = _PER_ROW.match(key)
        if m and (m["prefix"] + ".weight").endswith(endings):
            if m["h"] != str(int(m["h"])):
                raise ValueError(f"state_dict[{key!r}]: row index {m['h']!r} has a leading zero")
            groups.setdefault(m["prefix"], {})[int(m["h"])] = src.pop(key)
    for prefix, rows in groups.items():
        n = 1 + max(rows)
        for h in range(n):
            if h not in rows:
                row = rows[n - 1].name[: -len(f"{n - 1}.weight")] + f"{h}.weight"
                raise ValueError(f"state_dict: missing key {row!r} (row {h} of {n})")
        name = prefix + ".weight"
        if name in src:
            raise ValueError(f"state_dict: both {src[name].name!r} and {rows[0].name!r}, ... (give one or the other)")
        src[name] = _Stacked(name, [rows[h] for h in range(n)], new_axis=True)
    return src


def _merge_experts(src: dict, projs: tuple = ("gate_proj", "up_proj", "down_proj")) -> dict:
    """``src`` with every complete set of per-expert projections replaced by the two fused
    tensors (keys ``<prefix>.gate_up_proj`` and ``<prefix>.down_proj``).  Raises ``ValueError``
    naming the key for an incomplete set (a missing expert or projection), an expert index
    written two ways (``experts.00`` beside ``experts.0``: any leading zero is refused), a part
    that is not 2-D, and per-expert keys beside the fused tensor they would make."""
    gate, up, down = projs
    projs = tuple(p for p in projs if p is not None)  # not gated: up and down alone
    pattern = _per_expert(projs)
    groups: dict = {}
    for key in list(src):
        m = pattern.match(key)
        if m:
            if m["e"] != str(int(m["e"])):
                raise ValueError(
                    f"state_dict[{key!r}]: expert index {m['e']!r} has a leading zero (it would name the same "
                    f"expert as '{m['prefix']}.{int(m['e'])}.{m['proj']}.weight'); expected {str(int(m['e']))!r}"
                )
            if len(src[key].shape) != 2:
                raise ValueError(f"state_dict[{key!r}]: expected a 2-D tensor, got shape {tuple(src[key].shape)}")
            groups.setdefault(m["prefix"], {})[(int(m["e"]), m["proj"])] = src.pop(key)
    for prefix, parts in groups.items():
        n = 1 + max(e for e, _ in parts)
        for e in range(n):
            for proj in projs:
                if (e, proj) not in parts:
                    raise ValueError(f"state_dict: missing key '{prefix}.{e}.{proj}.weight' (expert {e} of {n})")
        first = up if gate is None else "gate_up_proj"  # the fused tensor of the first projection(s)
        for fused in (first, "down_proj"):
            if f"{prefix}.{fused}" in src:
                raise ValueError(
                    f"state_dict: both {prefix + '.' + fused!r} and the per-expert keys "
                    f"'{prefix}.0.{projs[0]}.weight', ... it is made of (give one or the other)"
                )
        src[f"{prefix}.{first}"] = _Merged(
            f"{prefix}.{first}",
            prefix,
            projs[:-1],
            [[parts[e, p] for p in projs[:-1]] for e in range(n)],
        )
        src[f"{prefix}.down_proj"] = _Merged(
            f"{prefix}.down_proj", prefix, (down,), [[parts[e, down]] for e in range(n)]
        )
    return src


class _NoDraw(np.random.Generator):
    """A Generator whose float draws are zeros (``uniform``: its ``low``): the modules of a model about to be loaded get
    their arrays without spending time (and float64 temporaries) on random weights.  ``CausalLM``
    also releases each layer's fresh gradient buffers as it builds them when given this
    generator (``loading``), so a loaded model never holds a second model's worth of zeros."""

    loading = True
    bfloat16 = False  # CausalLM keeps its large matrices as bfloat16 bits (weights_dtype="bfloat16")

    @staticmethod
    def _zeros(size, value=0.0):
        """``value`` (zeros) of ``size`` held in one element (every stride 0)."""
        shape = () if size is None else tuple(np.atleast_1d(size))
        one = np.full(1, value, np.float32)
        return np.lib.stride_tricks.as_strided(one, shape, (0,) * len(shape), writeable=True)

    def uniform(self, low=0.0, high=1.0, size=None):
        return self._zeros(size, 0.0 if low <= 0.0 <= high else low)  # in range (GatedDeltaNet takes its log)

    def normal(self, loc=0.0, scale=1.0, size=None):
        return self._zeros(size)

    def standard_normal(self, size=None, dtype=np.float64, out=None):
        return self._zeros(size)


def _trim_heap() -> None:
    """glibc's ``malloc_trim(0)``: return the heap's free memory to the system.  Building a model
    for bfloat16 storage frees each part's float32 arrays as its bits replace them; arrays up to
    glibc's mmap threshold (raised to 32 MB as large arrays are freed) live in the heap, whose
    free chunks stay resident until trimmed.  Nothing where there is no glibc."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        pass


_LISTED = 20  # keys named in a message at most


def _check_against_config(src: dict, cfg, tied_copy) -> None:
    """Every key and shape of ``src`` against those the config gives (``_state_shapes``), before
    anything is built: the first missing key, else the first unexpected one, else the first
    tensor of the wrong shape raises ``ValueError`` naming it.  The expected keys are generated
    lazily and the walk stops at the ``_LISTED``-th missing key, so a config of a million layers
    against a checkpoint of two fails at once."""
    from .causal_lm import _state_shapes

    seen: set = set()
    missing: list = []
    wrong = None
    for key, shape in _state_shapes(cfg):
        seen.add(key)
        s = src.get(key)
        if s is None:
            missing.append(key)
            if len(missing) == _LISTED:
                break
        elif wrong is None:
            wrong = s.mismatch(shape) if isinstance(s, (_Merged, _Stacked, _Rows)) else None
            if wrong is None and tuple(s.shape) != shape:
                wrong = f"state_dict[{key!r}]: expected shape {shape}, got {tuple(s.shape)}"
    mt = cfg.layout.family
    if missing:
        more = " and more" if len(missing) == _LISTED else ""
        if cfg.layout.fused:  # a fused checkpoint's missing tensor by the name it has there
            missing = list(dict.fromkeys(checkpoint_key(k, cfg.layout) for k in missing))
        raise ValueError(f"state_dict: missing key {missing[0]!r} (model_type {mt!r}; missing: {missing}{more})")
    unexpected = [(s.first_key if isinstance(s, (_Merged, _Stacked)) else k) for k, s in src.items() if k not in seen]
    if unexpected:
        raise ValueError(
            f"state_dict: unexpected key {unexpected[0]!r} (model_type {mt!r}; unexpected: {unexpected[:_LISTED]})"
        )
    if wrong is not None:
        raise ValueError(wrong)
    embed = (cfg.vocab_size, cfg.hidden_size)
    if tied_copy is not None and tuple(tied_copy.shape) != embed:
        raise ValueError(
            f"state_dict['lm_head.weight']: expected shape {embed} (tied to model.embed_tokens.weight), "
            f"got {tuple(tied_copy.shape)}"
        )


WEIGHTS_DTYPES = (None, "bfloat16")


def check_weights_dtype(weights_dtype, dtype):
    """``(weights_dtype, dtype)`` checked: ``weights_dtype`` None or ``"bfloat16"`` (which computes
    in float32, so ``dtype`` must then be None or float32); ``ValueError`` naming the argument."""
    if isinstance(weights_dtype, str) or weights_dtype is None:
        if weights_dtype in WEIGHTS_DTYPES:
            if weights_dtype is not None and dtype is not None and check_dtype(dtype) != np.float32:
                raise ValueError(
                    f"dtype: weights_dtype='bfloat16' computes in float32; expected dtype None or float32, got "
                    f"{np.dtype(dtype).name}"
                )
            return weights_dtype, (np.float32 if weights_dtype is not None else dtype)
    raise ValueError(f"weights_dtype: expected None or 'bfloat16', got {weights_dtype!r}")


def load_into(cls, state_dict, config, dtype=None, weights_dtype=None):
    """``CausalLM.from_hf``: check every key and shape of ``state_dict`` against the config (no
    array allocated yet), build ``cls(config)`` without random draws, then convert the tensors one
    by one into the parameters (``weights_dtype="bfloat16"``: the large matrices into bfloat16
    bits, ``npattn.functional._bfloat16``)."""
    from .configs import CausalLMConfig, config_from_hf

    weights_dtype, dtype = check_weights_dtype(weights_dtype, dtype)

    if not isinstance(state_dict, Mapping) and not (hasattr(state_dict, "keys") and hasattr(state_dict, "__getitem__")):
        raise TypeError(f"state_dict: expected a mapping of names to tensors, got {type(state_dict).__name__}")
    cfg = config if isinstance(config, CausalLMConfig) else config_from_hf(config)
    mtp = cfg.layout.mtp  # a released checkpoint's multi-token-prediction layers: not the causal LM's
    unread = cfg.layout.ignored  # the family's buffers that are no weights (GPT-NeoX's attention.bias)
    src = {
        k: _Source(k, state_dict[k])
        for k in state_dict.keys()
        if not (_IGNORED.search(k) or k.startswith(mtp) or k.endswith(unread))
    }
    bad = [k for k, s in src.items() if not s.is_float]
    if bad:
        raise TypeError(f"state_dict[{bad[0]!r}]: expected a floating-point tensor, got {src[bad[0]].kind}")
    src = _checkpoint_names(src, cfg.layout)
    if cfg.layout.fused:
        src = _split_fused(src, cfg)
    if cfg.layout.per_expert:
        src = _merge_experts(src, cfg.layout.expert_projs)
    embed = f"model.{cfg.embed_name}.weight"
    if cfg.tie_word_embeddings and "lm_head.weight" in src and embed not in src:
        # the tied pair under the head's name alone (safetensors' save_model keeps the first of the
        # shared names, sorted): transformers ties the embedding to it, and so do we
        src[embed] = src.pop("lm_head.weight")
    if dtype is None:
        first = src.get(embed) or next(iter(src.values()), None)
        dtype = np.float32 if first is None else first.natural_dtype
    dtype = check_dtype(dtype)
    tied_copy = None
    if cfg.tie_word_embeddings and "lm_head.weight" in src:
        tied_copy = src.pop("lm_head.weight")  # torch's state_dict() lists the tied head twice
    _check_against_config(src, cfg, tied_copy)
    nodraw = _NoDraw(np.random.PCG64(0))
    nodraw.bfloat16 = weights_dtype == "bfloat16"
    model = cls(cfg, rng=nodraw, dtype=dtype)
    _trim_heap()  # the building's freed arrays (each part's float32 before its bfloat16 bits) back to the system
    fresh = np.random.default_rng()
    for m in model.modules():  # dropout masks must not come from the zero generator
        if isinstance(getattr(m, "rng", None), _NoDraw):
            object.__setattr__(m, "rng", fresh)
    entries = {key: (owner, name, is_param) for key, owner, name, is_param in model._state_entries()}

    def current(key):
        owner, name, is_param = entries[key]
        return owner._parameters[name].data if is_param else getattr(owner, name)

    # the config's shapes (checked above) are the built model's: a disagreement would be npattn's bug,
    # and must never put a tensor in the wrong place
    if entries.keys() != src.keys() or any(tuple(s.shape) != current(k).shape for k, s in src.items()):
        raise RuntimeError(
            f"npattn: the {cfg.layout.family} model built differs from the shapes its config gives (a bug)"
        )
    for key, s in src.items():  # everything checked: convert one tensor at a time
        owner, name, is_param = entries[key]
        if is_param:
            p = owner._parameters[name]
            _read_part(s, p.data.bits if isinstance(p.data, BFloat16Array) else p.data)
            p.bump_version()
        else:
            object.__setattr__(owner, name, s.numpy(current(key).dtype))
    table = None if tied_copy is None else current(embed)
    if isinstance(table, BFloat16Array):  # compared as stored: the copy rounded as the table was
        same = np.array_equal(to_bfloat16_bits(tied_copy.numpy(np.float32)), table.bits)
    else:
        same = table is None or np.array_equal(tied_copy.numpy(dtype), table)
    if not same:
        raise ValueError(
            f"state_dict['lm_head.weight']: differs from {embed!r} although the config ties "
            "them (tie_word_embeddings=True)"
        )
    for p in model.parameters():  # inference needs no gradient buffers; the first backward makes them
        p.grad = None
    return model


def read_generation_config(directory) -> dict | None:
    """``generation_config.json`` of a saved directory as a dict (None without one): strict JSON
    as ``config.json`` is read, an object whose ``eos_token_id`` is null, a token id or a list of
    ids, whose ``pad_token_id`` is null or a token id and whose ``repetition_penalty`` is null or a
    number > 0 (ValueError naming the file and the key otherwise).  transformers'
    ``from_pretrained`` makes it the model's ``generation_config``, whose ``eos_token_id``,
    ``pad_token_id`` and ``repetition_penalty`` ``generate`` uses (``config.json``'s only where
    there is no such file)."""
    path = os.path.join(os.fspath(directory), "generation_config.json")
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        gc = _load_json(f.read(), path, "generation_config.json")
    if not isinstance(gc, dict):
        raise ValueError(f"{path}: expected a JSON object (the generation config), got {type(gc).__name__}")
    for key, many in (("eos_token_id", True), ("pad_token_id", False)):
        value = gc.get(key)
        ids = value if many and isinstance(value, list) else [] if value is None else [value]
        if not all(_is_size(i) for i in ids):
            what = "a token id (an integer >= 0)" + (", a list of them" if many else "")
            raise ValueError(f"{path}: {key}: expected {what} or null, got {_short(value)}")
    penalty = gc.get("repetition_penalty")
    if penalty is not None and (
        isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not 0 < penalty < math.inf
    ):
        raise ValueError(f"{path}: repetition_penalty: expected a number > 0 or null, got {_short(penalty)}")
    return gc


def from_pretrained(cls, directory, dtype=None, weights_dtype=None):
    """``CausalLM.from_pretrained``: ``open_checkpoint``, the released quantized formats
    dequantized (``npattn.models.quant``), then ``load_into``; ``generation_config.json`` (where
    the directory has one) becomes the model's ``generation_config``."""
    from .configs import text_checkpoint

    check_weights_dtype(weights_dtype, dtype)  # before any file is read

    config, tensors = open_checkpoint(directory)
    generation_config = read_generation_config(directory)  # checked before any tensor is read
    config, tensors, aside = text_checkpoint(config, tensors)  # a multimodal checkpoint's text model
    if aside:
        listed = ", ".join(f"{p}* ({n} tensors)" for p, n in aside.items())
        warnings.warn(
            f"from_pretrained: {os.fspath(directory)!r} is a multimodal checkpoint; loading its text model "
            f"and leaving the other towers' tensors aside: {listed}",
            stacklevel=3,
        )
    if "quantization_config" in config:
        from .quant import dequantize_checkpoint

        config, tensors = dequantize_checkpoint(config, tensors, os.fspath(directory))
    model = load_into(cls, tensors, config, dtype, weights_dtype)
    model.generation_config = generation_config
    return model

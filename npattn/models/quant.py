"""Released quantized checkpoints, dequantized while loading exactly as their reference code does.

Two formats are read, each named by the ``quantization_config`` of ``config.json``:

``quant_method: "mxfp4"`` (GPT-OSS).  The routed experts' ``gate_up_proj`` and ``down_proj`` come
as ``<name>_blocks (E, rows, G, 16)`` (uint8: 32 FP4 values a row-group, two a byte, the low
nibble first) and ``<name>_scales (E, rows, G)`` (uint8: an e8m0 exponent per group of 32, the
scale being ``2**(byte - 127)``); every other tensor is bfloat16.  An FP4 (e2m1) nibble ``n`` is
``FP4_VALUES[n]``::

    0 0.5 1 1.5 2 3 4 6  -0 -0.5 -1 -1.5 -2 -3 -4 -6

so row ``r`` of expert ``e`` holds ``FP4_VALUES[nibble] * 2**(scale - 127)`` for its ``G * 32``
inputs, and the parameter is that ``(E, rows, G*32)`` array transposed to ``(E, G*32, rows)``
(transformers' ``convert_moe_packed_tensors`` in ``integrations/mxfp4.py``: the ``(E, H, 2I)`` and
``(E, I, H)`` tensors ``GptOssExperts`` holds), each value ``ldexp(value, byte - 127)`` in float32
as torch's ``ldexp`` computes it (exact, overflowing to infinity and rounding subnormals as it does).

``quant_method: "fp8"`` (DeepSeek-V3, block-scaled).  A linear layer's ``weight (rows, cols)`` is
float8 e4m3fn (``F8_E4M3``) beside ``weight_scale_inv (ceil(rows/bm), ceil(cols/bn))`` (float32),
one scale per block of ``weight_block_size = [bm, bn]`` (128 x 128 as released); the weight is
``float32(w) * scale_inv`` of its block (DeepSeek's ``weight_dequant`` in ``inference/kernel.py``),
the blocks of the last rows and columns being partial where the shape is not a multiple of the
block (DeepSeek-V3's ``kv_a_proj_with_mqa`` has 576 rows: 4 blocks of 128 and one of 64).  The block
comes from ``weight_block_size`` (transformers' loader divides the shape by the scale grid instead,
which is wrong for such shapes).

Tensors of the modules ``modules_to_not_convert`` names stay as written (a quantized tensor in
one is refused as contradicting the config); shards may mix quantized and bfloat16 tensors.
Nothing is converted before every pair, dtype and shape has been checked: the dequantized
tensors are lazy (``Dequantized``) and computed straight into their parameters, one at a time.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

import numpy as np

from .hf import LazyTensor, _short

__all__ = [
    "FP4_VALUES",
    "Dequantized",
    "mxfp4_dequantize",
    "fp8_block_dequantize",
    "should_convert_module",
    "dequantize_checkpoint",
]

# e2m1 by its 4 bits: sign, 2 exponent bits (bias 1), 1 mantissa bit (transformers' FP4_VALUES)
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32
)


def mxfp4_dequantize(blocks: np.ndarray, scales: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """MXFP4 experts -> float: ``blocks (E, rows, G, 16)`` and ``scales (E, rows, G)`` (uint8) give
    ``(E, G*32, rows)``, exactly transformers' ``convert_moe_packed_tensors(blocks, scales)``.

    ``out`` (float32 by default) is written one expert at a time; the values are computed in
    its dtype where that is float64 (as transformers computes them for a float64 model: no
    overflow there), else in float32.  Shapes are the caller's to check (``dequantize_checkpoint``
    does)."""
    E, rows, G, B = blocks.shape
    if out is None:
        out = np.empty((E, G * B * 2, rows), np.float32)
    values = np.empty((rows, G, B * 2), np.float64 if out.dtype == np.float64 else np.float32)
    for e in range(E):
        b = np.asarray(blocks[e], np.uint8)
        values[..., 0::2] = FP4_VALUES[b & 0x0F]  # the low nibble is the even element
        values[..., 1::2] = FP4_VALUES[b >> 4]
        exponent = np.asarray(scales[e], np.uint8).astype(np.int32)[..., None] - 127
        with np.errstate(over="ignore"):  # 6 * 2**128 is inf in float32, as in torch's float32
            np.ldexp(values, exponent, out=values)
        out[e] = values.reshape(rows, G * B * 2).T
    return out


def fp8_block_dequantize(weight: np.ndarray, scale_inv: np.ndarray, block_size, out: np.ndarray | None = None):
    """Block-scaled FP8 -> float: ``weight (..., rows, cols)`` (its float values, e.g. from
    ``f8_e4m3_to_float32``) times ``scale_inv (..., ceil(rows/bm), ceil(cols/bn))`` of its block
    of ``block_size = (bm, bn)``, the last blocks partial; the product in float32 as DeepSeek's
    ``weight_dequant`` (``out`` float32 by default, written one row of blocks at a time)."""
    bm, bn = block_size
    rows, cols = weight.shape[-2:]
    if out is None:
        out = np.empty(weight.shape, np.float32)
    for i in range(scale_inv.shape[-2]):
        r = slice(i * bm, min((i + 1) * bm, rows))
        s = np.repeat(np.asarray(scale_inv[..., i, :], np.float32), bn, axis=-1)[..., None, :cols]
        out[..., r, :] = np.asarray(weight[..., r, :], np.float32) * s
    return out


def should_convert_module(name: str, patterns) -> bool:
    """Whether the module ``name`` is quantized under ``modules_to_not_convert = patterns``, as
    transformers decides (``quantizers_utils.should_convert_module``): not when a pattern matches
    it as a regex from the start up to a module boundary (``"model.layers.*.self_attn"``,
    ``"lm_head"``; ``"mlp.gate"`` is not ``"mlp.gate_proj"``) or ends it (``"fc1"``)."""
    if patterns is None:
        return True
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return not any(re.match(rf"(?:{p}){boundary}", name) or name.endswith(p) for p in patterns)


class Dequantized(LazyTensor):
    """A float32 tensor computed from quantized parts when read: ``name``, ``shape``, ``dtype``
    (``"F32"``), ``numpy(dtype)`` and ``read_into(out)`` as a ``LazyTensor``'s."""

    __slots__ = ("_convert", "_parts")

    def __init__(self, name: str, shape, convert, parts: tuple):
        self.name, self.shape, self.dtype = name, tuple(shape), "F32"
        self._convert, self._parts = convert, parts

    def numpy(self, dtype=None) -> np.ndarray:
        out = np.empty(self.shape, np.float32 if dtype is None else dtype)
        self.read_into(out)
        return out

    def read_into(self, out: np.ndarray) -> None:
        self._convert(*(p.numpy() for p in self._parts), out=out)

    def __repr__(self):
        return f"Dequantized({self.name!r}, shape={self.shape}, from={[p.name for p in self._parts]})"


# -- quantization_config --------------------------------------------------------------------------
_KEYS = {
    "mxfp4": {"quant_method", "modules_to_not_convert", "dequantize"},
    "fp8": {
        "quant_method",
        "modules_to_not_convert",
        "dequantize",
        "activation_scheme",
        "fmt",
        "weight_block_size",
        "scale_fmt",
    },
}
# keys whose only supported value is the released one (the others change the stored format)
_FIXED = {"activation_scheme": "dynamic", "fmt": "e4m3", "scale_fmt": "float"}


def _read_config(qc, where: str) -> tuple:
    """``(quant_method, modules_to_not_convert, weight_block_size)`` of ``quantization_config``,
    every key checked; ``ValueError`` naming the key otherwise."""
    name = f"{where}: quantization_config"
    if not isinstance(qc, Mapping):
        raise ValueError(f"{name}: expected an object, got {_short(qc)}")
    method = qc.get("quant_method")
    if method not in _KEYS:
        raise ValueError(
            f"{name}['quant_method']: {_short(method)} is not supported (npattn dequantizes 'mxfp4' and 'fp8')"
        )
    unknown = sorted(set(qc) - _KEYS[method])
    if unknown:
        raise ValueError(
            f"{name}[{unknown[0]!r}]: not a {method} option npattn reads (it reads {sorted(_KEYS[method])})"
        )
    for key, value in _FIXED.items():
        if key in qc and qc[key] != value:
            raise ValueError(f"{name}[{key!r}]: only {value!r} is supported, got {_short(qc[key])}")
    if "dequantize" in qc and not isinstance(qc["dequantize"], bool):
        raise ValueError(f"{name}['dequantize']: expected true or false, got {_short(qc['dequantize'])}")
    skip = qc.get("modules_to_not_convert")
    if skip is not None:
        if not isinstance(skip, list) or not all(isinstance(p, str) for p in skip):
            raise ValueError(f"{name}['modules_to_not_convert']: expected a list of module names, got {_short(skip)}")
        for p in skip:
            try:
                re.compile(p)
            except re.error as e:
                raise ValueError(
                    f"{name}['modules_to_not_convert']: {_short(p)} is not a valid pattern ({e})"
                ) from None
    block = qc.get("weight_block_size", [128, 128])  # FineGrainedFP8Config's default
    if method == "fp8" and not (
        isinstance(block, (list, tuple)) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)
    ):
        raise ValueError(
            f"{name}['weight_block_size']: expected two positive integers [rows, cols], got {_short(block)}"
        )
    return method, skip, tuple(block)


def _quantized_in_skipped(tensor: str, module: str, skip, where: str) -> None:
    if not should_convert_module(module, skip):
        raise ValueError(
            f"{where}: tensor {tensor!r} is quantized, but its module {module!r} is in the quantization_config's "
            "modules_to_not_convert"
        )


def _mxfp4(tensors: dict, skip, where: str) -> dict:
    out = dict(tensors)
    for key in tensors:
        if key.endswith("_scales") and key[: -len("_scales")] + "_blocks" not in tensors:
            raise ValueError(f"{where}: tensor {key!r} has no {key[: -len('_scales')] + '_blocks'!r} beside it")
    for key, blocks in tensors.items():
        if not key.endswith("_blocks"):
            continue
        base = key[: -len("_blocks")]
        scales = tensors.get(base + "_scales")
        if scales is None:
            raise ValueError(f"{where}: tensor {key!r} has no {base + '_scales'!r} beside it")
        if base in tensors:
            raise ValueError(f"{where}: both {base!r} and its quantized {key!r} (give one or the other)")
        _quantized_in_skipped(key, base.rpartition(".")[0], skip, where)
        for t in (blocks, scales):
            if t.dtype != "U8":
                raise ValueError(f"{where}: tensor {t.name!r} has dtype {t.dtype}, expected U8 (MXFP4)")
        if len(blocks.shape) != 4 or blocks.shape[-1] != 16:
            raise ValueError(
                f"{where}: tensor {key!r}: expected shape (experts, rows, groups, 16) (32 FP4 values a group), "
                f"got {blocks.shape}"
            )
        if scales.shape != blocks.shape[:-1]:
            raise ValueError(
                f"{where}: tensor {scales.name!r}: expected shape {blocks.shape[:-1]} (one scale per group of "
                f"{key!r} {blocks.shape}), got {scales.shape}"
            )
        E, rows, G, _ = blocks.shape
        out[base] = Dequantized(base, (E, G * 32, rows), mxfp4_dequantize, (blocks, scales))
        del out[key], out[base + "_scales"]
    return out


_SCALE_DTYPES = ("F32", "BF16", "F16", "F64")


def _fp8(tensors: dict, skip, block: tuple, where: str) -> dict:
    out = dict(tensors)
    suffix = "_scale_inv"
    for key, weight in tensors.items():
        if key.endswith(suffix):
            if key[: -len(suffix)] not in tensors:
                raise ValueError(f"{where}: tensor {key!r} has no {key[: -len(suffix)]!r} beside it")
            continue
        scale = tensors.get(key + suffix)
        if scale is None:
            if weight.dtype == "F8_E4M3":
                raise ValueError(f"{where}: tensor {key!r} is F8_E4M3 but has no {key + suffix!r} beside it")
            continue
        _quantized_in_skipped(key, key.rpartition(".")[0], skip, where)
        if weight.dtype != "F8_E4M3":
            raise ValueError(f"{where}: tensor {key!r} has a {suffix[1:]} but dtype {weight.dtype}, expected F8_E4M3")
        if scale.dtype not in _SCALE_DTYPES:
            raise ValueError(f"{where}: tensor {scale.name!r} has dtype {scale.dtype}, expected one of {_SCALE_DTYPES}")
        shape = weight.shape
        if len(shape) < 2:
            raise ValueError(f"{where}: tensor {key!r}: expected a matrix (rows, cols), got shape {shape}")
        grid = (*shape[:-2], math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1]))
        if scale.shape != grid:
            raise ValueError(
                f"{where}: tensor {scale.name!r}: expected shape {grid} (one scale per {block[0]}x{block[1]} "
                f"block of {key!r} {shape}, the weight_block_size), got {scale.shape}"
            )
        out[key] = Dequantized(key, shape, _fp8_values(block), (weight, scale))
        del out[key + suffix]
    return out


def _fp8_values(block: tuple):
    def convert(weight, scale_inv, out):  # weight: F8_E4M3 values, already widened by LazyTensor.numpy
        fp8_block_dequantize(weight, scale_inv, block, out=out)

    return convert


def dequantize_checkpoint(config: Mapping, tensors: Mapping, where: str) -> tuple[dict, dict]:
    """``(config, tensors)`` of a quantized checkpoint -> the float model's: the config without
    its ``quantization_config``, the quantized tensors replaced by lazy ``Dequantized`` ones under
    the model's names (``<name>_blocks``/``_scales`` -> ``<name>``; ``weight``/``weight_scale_inv``
    -> ``weight``).  ``where`` names the checkpoint in messages.

    Raises
    ------
    ValueError
        An unknown ``quant_method`` or option (named), a quantized tensor without its partner
        (or the reverse), of the wrong dtype or with scales of the wrong shape, or in a module
        ``modules_to_not_convert`` names, naming the tensor; before anything is converted.
    """
    method, skip, block = _read_config(config["quantization_config"], where)
    out = _mxfp4(dict(tensors), skip, where) if method == "mxfp4" else _fp8(dict(tensors), skip, block, where)
    return {k: v for k, v in config.items() if k != "quantization_config"}, out

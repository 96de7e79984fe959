"""RoPE frequencies as models configure them: ``rope_frequencies`` and the checks of a scaling dict.

RoPE turns pair ``i`` of a head's rotated features at position ``p`` by ``p * inv_freq[i]``, with
``inv_freq[i] = base**(-2i/dim)`` (``dim`` the number of rotated features).  Long-context models
change these frequencies; Hugging Face configurations say how in a ``rope_scaling`` (older) or
``rope_parameters`` (newer) dict whose ``rope_type`` (or ``type``) is one of:

- ``"default"``: the frequencies above.
- ``"linear"`` (position interpolation, kaiokendev / Chen et al. 2023): every frequency divided by
  ``factor``, i.e. positions squeezed by ``factor``.
- ``"dynamic"`` (dynamic NTK, bloc97 / emozilla): up to ``max_position_embeddings`` the default;
  beyond, for a sequence of ``seq_len`` tokens, the base grows to
  ``base * (factor * seq_len / max_position_embeddings - (factor - 1)) ** (dim / (dim - 2))``.
  The frequencies depend on the length of the sequence seen, as Hugging Face's
  ``dynamic_rope_update`` recomputes them (``seq_len`` is the largest position + 1).
- ``"ntk_alpha"`` (NTK-aware scaling by a fixed ``alpha``, Hunyuan's dense models): the base
  stretched once to ``base * alpha ** (dim / (dim - 2))``, whatever the length
  (transformers' ``HunYuanDenseV1RotaryEmbedding.compute_ntk_alpha_rope_parameters``; the
  checkpoints say ``"dynamic"`` with an ``alpha``, which their reader names ``"ntk_alpha"``).
- ``"yarn"`` (Peng et al. 2023): low-frequency pairs (many wavelengths longer than the training
  context) are interpolated (divided by ``factor``), high-frequency ones kept, a linear ramp
  between, with bounds from ``beta_fast``/``beta_slow`` rotations over
  ``original_max_position_embeddings``; and cos/sin are multiplied by an attention factor,
  ``0.1 ln(factor) + 1`` by default, ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``
  when both are given (DeepSeek-V3; its softmax scale has a further ``mscale(factor,
  mscale_all_dim)**2``, see ``rope_softmax_scale``).
- ``"llama3"`` (Llama 3.1): wavelengths shorter than ``original / high_freq_factor`` kept, longer
  than ``original / low_freq_factor`` divided by ``factor``, a smooth blend between.
- ``"proportional"`` (Gemma 4's global layers): every pair of the head rotates, but only the first
  ``int(partial_rotary_factor * dim // 2)`` pairs at the default frequencies ``base**(-2i/dim)``
  (``dim`` the whole head, not the rotated part); the others have frequency 0 (cos 1, sin 0: the
  identity), all divided by ``factor`` (default 1).  Unlike the other types' partial rotary, which
  rotates the first features as a smaller head (pairs ``(i, i + R/2)``, frequencies over ``R``),
  the pairs stay ``(i, i + dim/2)``.
- ``"longrope"`` (LongRoPE, Ding et al. 2024; Phi-3/3.5/4-mini): pair ``i`` turns at
  ``base**(-2i/dim) / ext[i]``, ``ext`` the ``short_factor`` list (``dim/2`` numbers) for a
  sequence of at most ``original_max_position_embeddings`` tokens, the ``long_factor`` list
  beyond (``seq_len``, the largest position + 1, as Hugging Face's ``dynamic_rope_update`` picks
  them per forward call); cos and sin are multiplied by ``attention_factor``, by default
  ``sqrt(1 + ln(factor) / ln(original_max_position_embeddings))`` (1 for ``factor <= 1``) with
  ``factor`` the dict's or ``max_position_embeddings / original_max_position_embeddings``
  (``_compute_longrope_parameters``).  Like ``dynamic``, the frequencies depend on the length
  seen: keys cached by an earlier call keep their rotation.

Each mirrors the function of the same type in ``transformers.modeling_rope_utils``
(``ROPE_INIT_FUNCTIONS``), in float64.  The dict may also hold ``rope_theta`` (the base),
``partial_rotary_factor`` (the share of each head that rotates) and ``max_position_embeddings``
(the model's, which Hugging Face reads from the config beside the dict: ``dynamic`` needs it;
``yarn`` and ``llama3`` fall back on it for ``original_max_position_embeddings``).  Keys set to
``None`` count as absent, as in Hugging Face's configs.  Any other key, a missing required key or
a bad value raises ``ValueError``/``TypeError`` naming it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from .._validate import check_positive_float, check_size

__all__ = ["rope_frequencies", "rope_softmax_scale", "yarn_mscale"]
# shared with functional.rope and the attention modules (public names outside
# __all__): check_scaling, resolve_base, resolve_rotary_dim, inverse_frequencies

# the keys each rope_type reads (beside the common ones), as Hugging Face's validators list them
_TYPE_KEYS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "ntk_alpha": ("alpha",),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    ),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
    "proportional": ("factor",),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings", "attention_factor", "factor"),
}
_LISTS = ("short_factor", "long_factor")  # longrope's per-pair factors: lists of numbers > 0
_COMMON_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor", "max_position_embeddings")
# values that may be 0 (Hugging Face reads them with `or`/truthiness: 0 means "not given")
_MAY_BE_ZERO = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def check_scaling(scaling, name: str = "scaling") -> dict[str, Any]:
    """A Hugging Face RoPE dict checked and normalised: ``{"rope_type": t, key: float, ...}``, keys
    set to None dropped, ``original_max_position_embeddings`` filled from
    ``max_position_embeddings`` where Hugging Face's ``standardize_rope_params`` does.  ``None``
    gives ``{"rope_type": "default"}``."""
    if scaling is None:
        return {"rope_type": "default"}
    if not isinstance(scaling, Mapping):
        raise TypeError(
            f"{name}: expected None or a mapping (a Hugging Face rope_scaling / rope_parameters dict), "
            f"got {type(scaling).__name__}"
        )
    d = {k: v for k, v in scaling.items() if v is not None}
    for k in d:
        if not isinstance(k, str):
            raise TypeError(f"{name}: expected string keys, got {k!r}")
    kinds = [d[k] for k in ("rope_type", "type") if k in d]
    if len(kinds) == 2 and kinds[0] != kinds[1]:
        raise ValueError(f"{name}: 'rope_type'={kinds[0]!r} and 'type'={kinds[1]!r} disagree")
    kind = kinds[0] if kinds else "default"
    if not isinstance(kind, str) or kind not in _TYPE_KEYS:
        key = "rope_type" if "rope_type" in d else "type"
        raise ValueError(f"{name}[{key!r}]: unknown RoPE type {kind!r}, expected one of {list(_TYPE_KEYS)}")
    allowed = _COMMON_KEYS + _TYPE_KEYS[kind]
    out: dict[str, Any] = {"rope_type": kind}
    for k, v in d.items():
        if k not in allowed:
            raise ValueError(
                f"{name}[{k!r}]: not an option of rope_type {kind!r} (its keys: {sorted(set(allowed) - {'type'})})"
            )
        if k in ("rope_type", "type"):
            continue
        label = f"{name}[{k!r}]"
        if k in _LISTS:
            if isinstance(v, (str, bytes, Mapping)) or not hasattr(v, "__len__") or not len(v):
                raise TypeError(f"{label}: expected a non-empty list of numbers > 0, got {v!r}")
            out[k] = tuple(check_positive_float(x, f"{label}[{i}]") for i, x in enumerate(v))
        elif k == "truncate":
            if not isinstance(v, (bool, np.bool_)):
                raise TypeError(f"{label}: expected a bool, got {v!r} ({type(v).__name__})")
            out[k] = bool(v)
        else:
            out[k] = check_positive_float(v, label, allow_zero=k in _MAY_BE_ZERO)
    if "partial_rotary_factor" in out and out["partial_rotary_factor"] > 1:
        raise ValueError(
            f"{name}['partial_rotary_factor']: expected a share in (0, 1], got {out['partial_rotary_factor']}"
        )
    if kind in ("yarn", "llama3") and "original_max_position_embeddings" not in out:
        if "max_position_embeddings" not in out:
            raise ValueError(
                f"{name}: rope_type {kind!r} needs 'original_max_position_embeddings' (or 'max_position_embeddings')"
            )
        out["original_max_position_embeddings"] = out["max_position_embeddings"]
    if kind == "longrope" and "factor" not in out and "attention_factor" not in out:
        if "max_position_embeddings" not in out:
            raise ValueError(
                f"{name}: rope_type 'longrope' needs 'factor', 'attention_factor' or 'max_position_embeddings' "
                "(factor = max_position_embeddings / original_max_position_embeddings)"
            )
    required = {
        "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
        "linear": ("factor",),
        "dynamic": ("factor", "max_position_embeddings"),
        "ntk_alpha": ("alpha",),
        "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
        "yarn": ("factor",),
    }.get(kind, ())
    for k in required:
        if k not in out:
            raise ValueError(f"{name}: rope_type {kind!r} needs the key {k!r}")
    if kind == "llama3" and out["high_freq_factor"] <= out["low_freq_factor"]:
        raise ValueError(
            f"{name}['high_freq_factor']: expected more than low_freq_factor={out['low_freq_factor']}, "
            f"got {out['high_freq_factor']}"
        )
    return out


def _standardize(
    params: Mapping,
    name: str,
    *,
    rope_theta: float,
    partial_rotary_factor=None,
    max_position_embeddings=None,
) -> dict[str, Any]:
    """One RoPE dict of a Hugging Face config as transformers 5 completes it before any model
    reads it (``standardize_rope_params``): ``rope_type`` from the older ``type`` (default
    ``"default"``), ``rope_theta`` and ``partial_rotary_factor`` from beside the dict where it has
    none, and the config's ``max_position_embeddings`` as ``original_max_position_embeddings`` of
    ``yarn``, ``llama3`` and ``longrope`` where the dict has none (``longrope`` also keeps the
    config's ``max_position_embeddings``, its default ``factor`` being their ratio).  ``dynamic`` reads the config's
    ``max_position_embeddings`` too; npattn keeps it in the dict, where ``rope_frequencies`` looks.

    Returns a new dict (keys set to None count as absent), checked by ``check_scaling``.  Raises
    ``ValueError``/``TypeError`` naming ``name`` and the key: also where transformers would read
    the dict in a way npattn refuses to guess (``rope_type`` and ``type`` that disagree: transformers
    silently takes ``rope_type``; a ``max_position_embeddings`` inside the dict that differs from
    the config's: transformers ignores the inner one)."""
    if not isinstance(params, Mapping):
        raise TypeError(f"{name}: expected a mapping (a RoPE parameters dict) or null, got {type(params).__name__}")
    p = {k: v for k, v in params.items() if v is not None}
    kind, old = p.pop("rope_type", None), p.pop("type", None)
    if kind is not None and old is not None and kind != old:
        raise ValueError(
            f"{name}: 'rope_type'={kind!r} and 'type'={old!r} disagree (transformers reads 'rope_type' and "
            "ignores 'type'; give one of them)"
        )
    p["rope_type"] = kind if kind is not None else old if old is not None else "default"
    p.setdefault("rope_theta", rope_theta)
    if partial_rotary_factor is not None:
        p.setdefault("partial_rotary_factor", partial_rotary_factor)
    inner = p.get("max_position_embeddings")
    if inner is not None and max_position_embeddings is not None and inner != max_position_embeddings:
        raise ValueError(
            f"{name}['max_position_embeddings']: {inner!r} differs from the config's max_position_embeddings="
            f"{max_position_embeddings} (transformers reads the config's and ignores this one)"
        )
    needs = {"yarn": "original_max_position_embeddings", "llama3": "original_max_position_embeddings"}
    needs["dynamic"] = "max_position_embeddings"
    key = needs.get(p["rope_type"]) if isinstance(p["rope_type"], str) else None
    if p["rope_type"] == "longrope":  # factor (when not given) = max_position_embeddings / original
        if max_position_embeddings is not None:
            p.setdefault("max_position_embeddings", max_position_embeddings)
        key = "original_max_position_embeddings"
    if key is not None and key not in p:
        if max_position_embeddings is None:
            raise ValueError(f"{name}: rope_type {p['rope_type']!r} needs the config's max_position_embeddings")
        p[key] = max_position_embeddings
    check_scaling(p, name)
    return p


def resolve_base(base, params: dict, name: str = "base") -> float:
    """The base: ``params['rope_theta']`` when the dict gives one (then ``base`` must be left at its
    default 10000 or agree), else ``base``."""
    b = check_positive_float(base, name)
    theta = params.get("rope_theta")
    if theta is None:
        return b
    if b not in (10000.0, theta):
        raise ValueError(f"{name}: {b} disagrees with scaling['rope_theta']={theta} (give one, or both equal)")
    return theta


def resolve_rotary_dim(d: int, rotary_dim, params: dict, name: str = "rotary_dim") -> int:
    """The number of rotated features of a head of ``d``: ``rotary_dim``, or
    ``int(d * partial_rotary_factor)`` (Hugging Face's rule), or ``d``; even, at most ``d``.
    ``"proportional"`` rotates every pair (its ``partial_rotary_factor`` says how many turn at a
    non-zero frequency: ``inverse_frequencies``), so ``d``."""
    f = None if params["rope_type"] == "proportional" else params.get("partial_rotary_factor")
    from_factor = None if f is None else int(d * f)
    if rotary_dim is None:
        r = d if from_factor is None else from_factor
        label = name if from_factor is None else f"partial_rotary_factor ({f} of {d} features)"
    else:
        r = check_size(rotary_dim, name)
        label = name
        if from_factor is not None and from_factor != r:
            raise ValueError(f"{name}: {r} disagrees with partial_rotary_factor={f} ({from_factor} of {d} features)")
    if r < 2 or r % 2 or r > d:
        raise ValueError(f"{label}: expected an even number of rotated features in [2, {d}], got {r}")
    for k in _LISTS:
        if k in params and len(params[k]) != r // 2:
            raise ValueError(
                f"scaling[{k!r}]: expected {r // 2} numbers (one per rotated pair of {label}={r}), got {len(params[k])}"
            )
    if params["rope_type"] in ("dynamic", "ntk_alpha") and r == 2:
        raise ValueError(
            f"{label}: rope_type {params['rope_type']!r} needs more than 2 rotated features (dim / (dim - 2))"
        )
    return r


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude scale ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``), as
    ``yarn_get_mscale`` in Hugging Face's DeepSeek-V3 and ``get_mscale`` in its YaRN init.

    Parameters
    ----------
    scale : float
        The context extension factor (``factor``).
    mscale : float
        The multiplier of ``ln(scale)``.

    Returns
    -------
    float
    """
    scale = check_positive_float(scale, "scale")
    mscale = check_positive_float(mscale, "mscale", allow_zero=True)
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_softmax_scale(scale: float, scaling=None) -> float:
    """The softmax scale of a model whose RoPE is scaled, as DeepSeek-V3 computes it
    (``yarn_apply_mscale``): with a non-default ``rope_type`` and a non-zero ``mscale_all_dim``,
    ``scale * yarn_mscale(factor, mscale_all_dim)**2``; otherwise ``scale``.

    Parameters
    ----------
    scale : float
        The plain scale, e.g. ``qk_head_dim**-0.5``.
    scaling : mapping or None
        The RoPE dict (see the module's docstring).

    Returns
    -------
    float

    Raises
    ------
    ValueError, TypeError
        A bad ``scale`` or a bad dict (naming the key).
    """
    scale = check_positive_float(scale, "scale")
    params = check_scaling(scaling)
    m = params.get("mscale_all_dim", 0.0)  # a yarn key only
    if params["rope_type"] == "default" or not m:
        return scale
    return scale * yarn_mscale(params["factor"], m) ** 2


def rope_frequencies(dim: int, base: float = 10000.0, scaling=None, *, seq_len: int | None = None):
    """The inverse frequencies of RoPE and the attention factor, as Hugging Face's RoPE init
    functions (``ROPE_INIT_FUNCTIONS``, float64 here) compute them.

    Parameters
    ----------
    dim : int
        The head's size; ``int(dim * partial_rotary_factor)`` features rotate (all without that
        key), an even number >= 2.
    base : float
        The base (``rope_theta``); a ``rope_theta`` in ``scaling`` takes its place (``base`` left
        at 10000 or equal).
    scaling : mapping or None
        A Hugging Face ``rope_scaling`` / ``rope_parameters`` dict (see the module's docstring);
        None is the default RoPE.
    seq_len : int or None
        The length of the sequence seen (``dynamic`` only: the largest position + 1; None or a
        length up to ``max_position_embeddings`` gives the frequencies at that length).

    Returns
    -------
    inv_freq : ndarray
        ``(rotated / 2,)`` float64: pair ``i`` at position ``p`` turns by ``p * inv_freq[i]``.
    attention_factor : float
        The factor on cos and sin (``yarn``; 1.0 for the others).

    Raises
    ------
    ValueError, TypeError
        A bad argument, or a bad dict (an unknown ``rope_type``, an unknown or missing key, a bad
        value), naming it.

    Examples
    --------
    >>> from npattn.functional.rope_scaling import rope_frequencies
    >>> rope_frequencies(8)                                  # base 10000: 10000 ** (-2i / 8)
    (array([1.   , 0.1  , 0.01 , 0.001]), 1.0)
    >>> rope_frequencies(8, scaling={"rope_type": "linear", "factor": 2.0})[0]
    array([0.5   , 0.05  , 0.005 , 0.0005])
    """
    dim = check_size(dim, "dim")
    params = check_scaling(scaling)
    b = resolve_base(base, params)
    r = resolve_rotary_dim(dim, None, params, "dim")
    if seq_len is not None:
        seq_len = check_size(seq_len, "seq_len")
    return inverse_frequencies(r, b, params, seq_len)


def inverse_frequencies(dim: int, base: float, params: dict, seq_len: int | None = None) -> tuple[np.ndarray, float]:
    """The kernel of ``rope_frequencies``: ``dim`` the number of rotated features (even), ``base``
    resolved, ``params`` from ``check_scaling``.  Returns ``(inv_freq (dim/2,) float64, factor)``."""
    kind = params["rope_type"]
    exponent = np.arange(0, dim, 2, dtype=np.float64) / dim  # 2i / dim
    if kind == "proportional":  # the first int(f dim // 2) pairs at base**(-2i/dim), the rest at 0
        turning = int(params.get("partial_rotary_factor", 1.0) * dim // 2)
        inv_freq = np.where(np.arange(dim // 2) < turning, 1.0 / base**exponent, 0.0)
        return inv_freq / params.get("factor", 1.0), 1.0
    if kind == "dynamic":
        # NTK-aware: a longer sequence stretches the base, so that the slowest pair's angle over
        # seq_len tokens stays inside what training saw; at or below max_position_embeddings the
        # bracket is 1 and the base is unchanged.
        m = params["max_position_embeddings"]
        s = m if seq_len is None else max(seq_len, m)
        base = base * (params["factor"] * s / m - (params["factor"] - 1)) ** (dim / (dim - 2))
    if kind == "ntk_alpha":  # the same stretch of the base by a fixed alpha: no length enters
        base = base * params["alpha"] ** (dim / (dim - 2))
    if kind == "longrope":
        return _longrope(base**exponent, params, seq_len)
    inv_freq = 1.0 / base**exponent
    if kind == "linear":
        return inv_freq / params["factor"], 1.0
    if kind == "yarn":
        return _yarn(inv_freq, dim, base, params)
    if kind == "llama3":
        return _llama3(inv_freq, params), 1.0
    return inv_freq, 1.0


def _yarn(inv_freq: np.ndarray, dim: int, base: float, params: dict) -> tuple[np.ndarray, float]:
    """YaRN's frequencies and attention factor (``_compute_yarn_parameters``)."""
    original = params["original_max_position_embeddings"]
    factor = params["factor"]
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32.0
    beta_slow = params.get("beta_slow") or 1.0

    def correction_dim(rotations):
        # the pair index i whose wavelength 2 pi base^(2i/dim) fits `rotations` times in the context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    keep = 1.0 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate (divide by factor)
    return inv_freq / factor * (1.0 - keep) + inv_freq * keep, float(attention_factor)


def _longrope(powers: np.ndarray, params: dict, seq_len: int | None) -> tuple[np.ndarray, float]:
    """LongRoPE's frequencies and attention factor (``_compute_longrope_parameters``): the long
    factors for a sequence longer than ``original_max_position_embeddings``, else the short ones."""
    original = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:  # Phi-3: the ratio of the extended context to the pretrained one
        factor = params["max_position_embeddings"] / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    long = seq_len is not None and seq_len > original
    ext = np.asarray(params["long_factor" if long else "short_factor"], dtype=np.float64)
    return 1.0 / (ext * powers), float(attention_factor)


def _llama3(inv_freq: np.ndarray, params: dict) -> np.ndarray:
    """Llama 3.1's frequencies (``_compute_llama3_parameters``)."""
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    original = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > original / low, inv_freq / factor, inv_freq)  # long wavelengths: / factor
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) & ~(wavelen > original / low)
    return np.where(medium, smoothed, scaled)

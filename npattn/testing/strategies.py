"""Hypothesis strategies for property tests of attention code (the ones npattn's own tests use).

Needs hypothesis (``pip install "npattn[test]"``, or ``pip install ".[test]"`` from a clone).
Arrays are not built element by element by hypothesis: a strategy draws a *seed* and numpy
generates the values from it, which is fast, reproducible and shrinks well enough (towards seed 0
and small shapes).

The values are honestly well conditioned, so tests need no loosened tolerances: bounded
magnitudes (uniform in ``[-scale, scale]``), rows with a variance bounded away from zero for
layer norm, values bounded away from 0 for ReLU's kink.

    >>> from hypothesis import given
    >>> from npattn.testing import attention_configs
    >>> @given(attention_configs())
    ... def test_runs(cfg):
    ...     out, _ = scaled_dot_product_attention(cfg.q, cfg.k, cfg.v, **cfg.kwargs())
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Tuple, Union

import numpy as np

from .._docs import shared_doc
from .._hints import install_hint
from ._names import STRATEGIES

try:
    from hypothesis import strategies as st
except ImportError as e:  # pragma: no cover - exercised only without hypothesis
    raise ImportError(f"npattn.testing needs hypothesis; install it with: {install_hint('test')}") from e

__all__ = list(STRATEGIES)  # the names npattn.testing loads from here on first use

_SEED_MAX = 2**32 - 1


def _property_example(strategy: str, *body: str):
    """Decorator: the ``<property_example>`` of a strategy's docstring, its Examples section: a
    hypothesis test drawing ``value`` from ``testing.<strategy>`` and running the lines ``body``."""
    test = "".join(f"...     {line}\n" for line in body)
    return shared_doc(
        property_example=f"""
Examples
--------
>>> import numpy as np
>>> from hypothesis import given, settings
>>> from npattn import testing
>>> @settings(max_examples=10, deadline=None)
... @given(testing.{strategy})
... def test(value):
{test}>>> test()                                        # raises if a drawn example breaks the property
"""
    )


def seeds() -> st.SearchStrategy[int]:
    """Seeds for ``np.random.default_rng`` (shrink towards 0)."""
    return st.integers(0, _SEED_MAX)


@_property_example(
    "dtypes()",
    "assert value in (np.float32, np.float64)",
)
def dtypes(*choices) -> st.SearchStrategy[np.dtype]:
    """``np.dtype(float32)`` or ``np.dtype(float64)`` (or the given choices).

    <property_example>
    """
    choices = choices or (np.float64, np.float32)
    return st.sampled_from([np.dtype(c) for c in choices])


@_property_example(
    "shapes(min_dims=2, max_dims=3, max_side=4)",
    "assert 2 <= len(value) <= 3 and max(value) <= 4",
)
def shapes(min_dims: int = 1, max_dims: int = 3, min_side: int = 1, max_side: int = 4) -> st.SearchStrategy[tuple]:
    """Array shapes: ``min_dims..max_dims`` axes of ``min_side..max_side`` each.

    <property_example>
    """
    if not 0 <= min_dims <= max_dims or not 0 <= min_side <= max_side:
        raise ValueError(f"shapes: bad bounds dims [{min_dims}, {max_dims}], sides [{min_side}, {max_side}]")
    return st.lists(st.integers(min_side, max_side), min_size=min_dims, max_size=max_dims).map(tuple)


def _shape_strategy(shape):
    return shape if isinstance(shape, st.SearchStrategy) else st.just(tuple(shape))


@_property_example(
    "arrays((2, 3), scale=10.0)",
    "assert value.shape == (2, 3) and np.isfinite(value).all()",
)
def arrays(shape, dtype=np.float64, scale: float = 1.0) -> st.SearchStrategy[np.ndarray]:
    """Arrays uniform in ``[-scale, scale]`` (bounded, no inf/NaN, no denormals to speak of).

    ``shape`` is a tuple or a strategy of tuples (e.g. :func:`shapes`); ``dtype`` a dtype or a
    strategy of dtypes (e.g. :func:`dtypes`).

    <property_example>
    """
    dt = dtype if isinstance(dtype, st.SearchStrategy) else st.just(np.dtype(dtype))

    def build(args):
        s, d, seed = args
        return np.random.default_rng(seed).uniform(-scale, scale, s).astype(d)

    return st.tuples(_shape_strategy(shape), dt, seeds()).map(build)


@_property_example(
    "scales()",
    "assert 0.1 <= value <= 10",
)
def scales(values=(0.1, 0.3, 1.0, 3.0, 10.0)) -> st.SearchStrategy[float]:
    """Input scales to multiply test inputs by: ``gradcheck`` is proven free of false failures
    from 0.1 to 10 (``tests/test_gradcheck_props.py``).

    <property_example>
    """
    return st.sampled_from(tuple(float(v) for v in values))


@_property_example(
    "tangents((2, 3))",
    "assert value is None or value.shape == (2, 3)",
)
def tangents(shape, dtype=np.float64, allow_none: bool = True) -> st.SearchStrategy[Optional[np.ndarray]]:
    """Tangents for forward mode (``<op>_jvp``, ``Module.jvp``): standard normal arrays of
    ``shape`` (a tuple or a strategy of tuples), or, with ``allow_none``, sometimes ``None`` (zero).

    <property_example>
    """
    dt = np.dtype(dtype)

    def build(args):
        s, seed = args
        return np.random.default_rng(seed).standard_normal(s).astype(dt)

    arrs = st.tuples(_shape_strategy(shape), seeds()).map(build)
    return st.one_of(st.none(), arrs) if allow_none else arrs


@_property_example(
    "gradcheck_modes()",
    "import npattn",
    "assert npattn.gradcheck(npattn.Linear(2, 2, rng=0), np.ones((1, 2)), mode=value).ok",
)
def gradcheck_modes(modes=("rev", "fwd", "both")) -> st.SearchStrategy[str]:
    """The ``mode=`` of :func:`npattn.gradcheck`: ``"rev"`` (backward), ``"fwd"`` (JVP) or ``"both"``.

    <property_example>
    """
    return st.sampled_from(tuple(modes))


def relu_safe_arrays(
    shape, dtype=np.float64, scale: float = 1.0, margin: float = 0.05
) -> st.SearchStrategy[np.ndarray]:
    """Like :func:`arrays` but with ``|x| >= margin``: finite differences never straddle the
    ReLU kink at 0 (nor need its one-sided derivative), values of both signs still appear."""
    if not 0 < margin < scale:
        raise ValueError(f"relu_safe_arrays: expected 0 < margin < scale, got margin={margin}, scale={scale}")
    dt = dtype if isinstance(dtype, st.SearchStrategy) else st.just(np.dtype(dtype))

    def build(args):
        s, d, seed = args
        rng = np.random.default_rng(seed)
        mag = rng.uniform(margin, scale, s)
        sign = np.where(rng.random(s) < 0.5, -1.0, 1.0)
        return (mag * sign).astype(d)

    return st.tuples(_shape_strategy(shape), dt, seeds()).map(build)


@dataclass
class LayerNormCase:
    """Arguments of ``layer_norm``: ``x (..., D)``, ``weight``/``bias`` ``(D,)`` or None, ``eps``."""

    x: np.ndarray
    weight: Optional[np.ndarray]
    bias: Optional[np.ndarray]
    eps: float = 1e-5

    def args(self):
        """``(x, weight, bias, eps)``: the positional arguments of ``layer_norm``."""
        return (self.x, self.weight, self.bias, self.eps)


@_property_example(
    "layer_norm_inputs()",
    "import npattn",
    "from npattn import functional as F",
    "assert npattn.gradcheck(F.layer_norm, value.x, value.weight, value.bias, eps=value.eps).ok",
)
def layer_norm_inputs(
    min_features: int = 2,
    max_features: int = 5,
    max_lead_dims: int = 2,
    max_side: int = 3,
    dtype=np.float64,
    affine: Optional[bool] = None,
) -> st.SearchStrategy[LayerNormCase]:
    """Layer-norm inputs whose rows have a non-degenerate variance.

    Each row is standardised then given a standard deviation in ``[0.5, 2]`` and a mean in
    ``[-1, 1]``, so ``1/sqrt(var + eps)`` is well conditioned.  ``weight`` and ``bias`` are each
    present or None (``affine=True``: both present; ``False``: both None).

    <property_example>
    """
    if min_features < 2:
        raise ValueError("layer_norm_inputs: rows need at least 2 features for a non-zero variance")
    dt = dtype if isinstance(dtype, st.SearchStrategy) else st.just(np.dtype(dtype))
    use = st.booleans() if affine is None else st.just(bool(affine))

    def build(args):
        lead, d, dtp, seed, has_w, has_b = args
        rng = np.random.default_rng(seed)
        x = rng.standard_normal(lead + (d,))
        x -= x.mean(axis=-1, keepdims=True)
        x /= np.sqrt((x * x).mean(axis=-1, keepdims=True))
        x = x * rng.uniform(0.5, 2.0, lead + (1,)) + rng.uniform(-1.0, 1.0, lead + (1,))
        w = rng.uniform(0.5, 1.5, d) * np.where(rng.random(d) < 0.2, -1, 1) if has_w else None
        b = rng.uniform(-1.0, 1.0, d) if has_b else None

        def cast(a):
            return None if a is None else a.astype(dtp)

        return LayerNormCase(cast(x), cast(w), cast(b))

    return st.tuples(
        shapes(0, max_lead_dims, 1, max_side), st.integers(min_features, max_features), dt, seeds(), use, use
    ).map(build)


# ------------------------------------------------------------------------------ attention

MASK_KINDS = ("none", "causal", "padding", "random", "float", "fully_masked")


def make_mask(lq: int, lk: int, kind: str, seed: int = 0, lead: Sequence[int] = (), full: bool = False):
    """A deterministic attention mask of ``kind`` for ``Lq`` queries and ``Lk`` keys.

    * ``"none"``: None;
    * ``"causal"``: bool ``(Lq, Lk)``, ``tril`` (query i sees keys 0..i, top-left);
    * ``"padding"``: bool key padding, shape ``(lead[0], 1, ..., 1, Lk)`` (``(1, Lk)`` without
      leading dims), True = may attend, each batch keeps between 1 and Lk leading keys;
    * ``"random"``: bool, about 70 % True (rows with no True key may appear);
    * ``"float"``: additive, uniform in ``[-2, 2]`` with about 20 % ``-inf``;
    * ``"fully_masked"``: bool like ``"random"`` with at least one row entirely False.

    ``random``/``float``/``fully_masked`` have shape ``(Lq, Lk)`` or, with ``full=True``,
    ``(*lead, Lq, Lk)``.  Every mask broadcasts to ``(*lead, Lq, Lk)``.
    """
    if kind not in MASK_KINDS:
        raise ValueError(f"kind: expected one of {MASK_KINDS}, got {kind!r}")
    rng = np.random.default_rng(seed)
    lead = tuple(lead)
    shape = (lead if full else ()) + (lq, lk)
    if kind == "none":
        return None
    if kind == "causal":
        return np.tri(lq, lk, dtype=bool)
    if kind == "padding":
        nb = lead[0] if lead else 1
        lengths = rng.integers(1, lk + 1, nb)
        keep = np.arange(lk)[None, :] < lengths[:, None]  # (nb, Lk)
        if not lead:
            return keep.reshape(1, lk)
        return keep.reshape((nb,) + (1,) * len(lead[1:]) + (1, lk))
    if kind == "random":
        return rng.random(shape) < 0.7
    if kind == "float":
        m = rng.uniform(-2.0, 2.0, shape)
        m[rng.random(shape) < 0.2] = -np.inf
        return m
    # fully masked rows
    b = rng.random(shape) < 0.7
    rows = b.reshape(-1, lq, lk)
    for r in rows:
        r[rng.integers(0, lq)] = False
    return rows.reshape(shape)


def masks(lq: int, lk: int, kind: Optional[Union[str, Sequence[str]]] = None, lead: Sequence[int] = ()):
    """Strategy of masks from :func:`make_mask`: ``kind`` one kind, a list of kinds or None (any)."""
    kinds = MASK_KINDS if kind is None else ((kind,) if isinstance(kind, str) else tuple(kind))
    for k in kinds:
        if k not in MASK_KINDS:
            raise ValueError(f"kind: expected one of {MASK_KINDS}, got {k!r}")
    return st.tuples(st.sampled_from(kinds), seeds(), st.booleans()).map(
        lambda a: make_mask(lq, lk, a[0], a[1], lead, a[2])
    )


@dataclass
class AttentionConfig:
    """One ``scaled_dot_product_attention`` call: arrays and options.

    ``q (*batch, [Hq,] Lq, E)``, ``k (*batch, [Hk,] Lk, E)``, ``v (*batch, [Hk,] Lk, Ev)``;
    ``mask_kind`` says how ``attn_mask`` was built; ``seed`` feeds dropout.
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    attn_mask: Optional[np.ndarray] = None
    mask_kind: str = "none"
    is_causal: bool = False
    scale: Optional[float] = None
    enable_gqa: bool = False
    dropout_p: float = 0.0
    seed: int = 0
    batch: Tuple[int, ...] = ()
    heads: Optional[Tuple[int, int]] = None  # (Hq, Hk) or None without a head axis
    dtype: np.dtype = field(default_factory=lambda: np.dtype(np.float64))
    causal_align: str = "top_left"
    window: Optional[Tuple[int, int]] = None
    alibi_slopes: Optional[np.ndarray] = None
    softcap: Optional[float] = None
    sinks: Optional[np.ndarray] = None
    mask_grad: bool = False

    @property
    def lq(self) -> int:
        """The number of queries (``q``'s second-to-last axis)."""
        return self.q.shape[-2]

    @property
    def lk(self) -> int:
        """The number of keys (``k``'s second-to-last axis)."""
        return self.k.shape[-2]

    @property
    def groups(self) -> int:
        """Query heads per kv head (1 without grouped-query heads)."""
        return 1 if self.heads is None else self.heads[0] // self.heads[1]

    def kwargs(self, rng=None) -> dict:
        """Keyword arguments for ``scaled_dot_product_attention`` (``rng`` defaults to ``seed``:
        an int seed gives the same dropout mask at every call)."""
        kw = dict(
            attn_mask=self.attn_mask,
            is_causal=self.is_causal,
            dropout_p=self.dropout_p,
            scale=self.scale,
            rng=self.seed if rng is None else rng,
            enable_gqa=self.enable_gqa,
        )
        kw.update(self.options())
        return kw

    def options(self) -> dict:
        """The attention options (``ATTENTION_OPTIONS``) that differ from their defaults, as
        keyword arguments (empty for a config drawn without options, so it also suits cores
        that have none)."""
        kw: dict = {}
        if self.causal_align != "top_left":
            kw["causal_align"] = self.causal_align
        for name in ("window", "alibi_slopes", "softcap", "sinks"):
            if getattr(self, name) is not None:
                kw[name] = getattr(self, name)
        if self.mask_grad:
            kw["mask_grad"] = True
        return kw

    @property
    def query_positions(self) -> np.ndarray:
        """``(Lq,)``: the position of each query (``i``, or ``i + Lk - Lq`` bottom-right aligned)."""
        return np.arange(self.lq) + (self.lk - self.lq if self.causal_align == "bottom_right" else 0)

    def visible(self) -> np.ndarray:
        """Bool ``(..., Hq, Lq, Lk)``: which (query, key) pairs may attend (mask, causality with
        its alignment, window)."""
        score = self.q.shape[:-1] + (self.lk,)
        vis = np.ones(score, dtype=bool)
        pos, key = self.query_positions[:, None], np.arange(self.lk)[None, :]
        if self.is_causal:
            vis &= key <= pos
        if self.window is not None:
            left, right = self.window
            if left >= 0:
                vis &= key >= pos - left
            if right >= 0:
                vis &= key <= pos + right
        if self.attn_mask is not None:
            m = self.attn_mask
            vis &= m if m.dtype == bool else np.isfinite(m)
        return vis


@_property_example(
    "attention_configs(options=True)",
    "import npattn",
    "from npattn import functional as F",
    "out, _ = F.scaled_dot_product_attention(value.q, value.k, value.v, **value.kwargs())",
    "assert np.isfinite(out).all()",
)
@st.composite
def attention_configs(
    draw,
    max_batch_dims: int = 2,
    max_batch: int = 2,
    head_axis: Optional[bool] = None,
    max_kv_heads: int = 2,
    max_groups: int = 3,
    gqa: Optional[bool] = None,
    min_len: int = 2,
    max_len: int = 4,
    max_e: int = 4,
    max_ev: int = 4,
    mask_kinds: Optional[Sequence[str]] = None,
    causal: Optional[bool] = None,
    dropout: bool = False,
    dtype=np.float64,
    scale_range=(0.2, 1.5),
    value_scale: float = 1.0,
    options: Union[bool, Sequence[str]] = False,
) -> AttentionConfig:
    """Attention calls covering the interesting cases, at tiny sizes.

    * 0..``max_batch_dims`` batch axes of 1..``max_batch``; with or without a head axis
      (``head_axis`` None: either);
    * grouped-query heads: ``Hq = G * Hk`` with ``G`` in 1..``max_groups`` (``gqa`` None: either;
      ``enable_gqa`` is set when ``Hq != Hk`` and sometimes when they are equal);
    * ``Lq``, ``Lk`` drawn independently in ``min_len..max_len`` (so mostly ``Lq != Lk``),
      ``E`` and ``Ev`` independently;
    * ``attn_mask`` of a kind in ``mask_kinds`` (default all of :data:`MASK_KINDS`), shaped
      ``(Lq, Lk)``, full, or key padding; ``is_causal`` True or False (``causal`` None: either,
      combined with a mask too, which npattn allows);
    * ``scale``: None (``1/sqrt(E)``) or uniform in ``scale_range``;
    * ``dropout=True``: ``dropout_p`` in {0, 0.1, 0.3, 0.5} with a ``seed``;
    * q, k, v uniform in ``[-value_scale, value_scale]``, so scores stay O(E * scale);
    * ``options``: ``False`` (the default: no attention option is drawn, the draws are the same
      as without this argument), ``True`` (every name of :data:`ATTENTION_OPTIONS`) or a sequence
      of names; each named option is drawn present or absent: ``causal_align`` top-left or
      bottom-right, ``window`` from :func:`windows`, ``softcap`` from :func:`softcaps`, and with a
      head axis ``alibi_slopes`` (:func:`alibi_slopes`, shape ``(Hq,)``) and ``sinks``
      (:func:`sinks`); ``mask_grad`` is drawn only for float masks.  ``cfg.kwargs()`` includes
      the options that are set, ``cfg.visible()`` accounts for alignment and window.

    <property_example>
    """
    dt = np.dtype(draw(dtype) if isinstance(dtype, st.SearchStrategy) else dtype)
    batch = tuple(draw(st.lists(st.integers(1, max_batch), max_size=max_batch_dims)))
    has_heads = draw(st.booleans()) if head_axis is None else bool(head_axis)
    heads = None
    enable_gqa = False
    if has_heads:
        hk = draw(st.integers(1, max_kv_heads))
        use_gqa = draw(st.booleans()) if gqa is None else bool(gqa)
        g = draw(st.integers(1, max_groups)) if use_gqa else 1
        heads = (hk * g, hk)
        enable_gqa = use_gqa
    lq = draw(st.integers(min_len, max_len))
    lk = draw(st.integers(min_len, max_len))
    e = draw(st.integers(1, max_e))
    ev = draw(st.integers(1, max_ev))
    kinds = tuple(mask_kinds) if mask_kinds is not None else MASK_KINDS
    kind = draw(st.sampled_from(kinds))
    is_causal = draw(st.booleans()) if causal is None else bool(causal)
    scale = draw(st.one_of(st.none(), st.floats(*scale_range)))
    dropout_p = draw(st.sampled_from([0.0, 0.1, 0.3, 0.5])) if dropout else 0.0
    seed = draw(seeds())
    full_mask = draw(st.booleans())

    rng = np.random.default_rng(seed)
    hq_axis = (heads[0],) if heads else ()
    hk_axis = (heads[1],) if heads else ()
    q = rng.uniform(-value_scale, value_scale, batch + hq_axis + (lq, e)).astype(dt)
    k = rng.uniform(-value_scale, value_scale, batch + hk_axis + (lk, e)).astype(dt)
    v = rng.uniform(-value_scale, value_scale, batch + hk_axis + (lk, ev)).astype(dt)
    mask = make_mask(lq, lk, kind, seed + 1, batch + hq_axis, full_mask)
    if mask is not None and mask.dtype.kind == "f":
        mask = mask.astype(dt)
    cfg = AttentionConfig(q, k, v, mask, kind, is_causal, scale, enable_gqa, dropout_p, seed, batch, heads, dt)
    names = _option_names(options)
    if "causal_align" in names:
        cfg.causal_align = draw(st.sampled_from(["top_left", "bottom_right"]))
    if "window" in names:
        cfg.window = draw(st.one_of(st.none(), windows(max_left=max_len, max_right=max_len)))
    if "softcap" in names:
        cfg.softcap = draw(st.one_of(st.none(), softcaps()))
    if heads is not None and "alibi_slopes" in names:
        cfg.alibi_slopes = draw(st.one_of(st.none(), alibi_slopes(heads[0], dtype=dt)))
    if heads is not None and "sinks" in names:
        cfg.sinks = draw(st.one_of(st.none(), sinks(heads[0], dtype=dt)))
    if "mask_grad" in names and mask is not None and mask.dtype.kind == "f":
        cfg.mask_grad = draw(st.booleans())
    return cfg


# ------------------------------------------------------------------------------ attention options

ATTENTION_OPTIONS = ("causal_align", "window", "alibi_slopes", "softcap", "sinks", "mask_grad")


def _option_names(options) -> Tuple[str, ...]:
    if options is False or options is None:
        return ()
    if options is True:
        return ATTENTION_OPTIONS
    names = (options,) if isinstance(options, str) else tuple(options)
    for n in names:
        if n not in ATTENTION_OPTIONS:
            raise ValueError(f"options: expected names from {ATTENTION_OPTIONS}, got {n!r}")
    return names


@_property_example(
    "windows()",
    "left, right = value",
    "assert left >= -1 and right >= -1",
)
def windows(max_left: int = 4, max_right: int = 4, unbounded: bool = True) -> st.SearchStrategy[Tuple[int, int]]:
    """Sliding windows ``(left, right)`` for the attention cores' ``window=``: each side in
    ``0..max_<side>`` or, with ``unbounded``, ``-1`` (no limit on that side).  A window may
    leave a query row with no visible key (its output is then 0): the cores must handle it.

    <property_example>
    """
    if max_left < 0 or max_right < 0:
        raise ValueError(f"windows: expected max_left, max_right >= 0, got {max_left}, {max_right}")

    def side(n):
        s = st.integers(0, n)
        return st.one_of(st.just(-1), s) if unbounded else s

    return st.tuples(side(max_left), side(max_right))


def standard_alibi_slopes(num_heads: int) -> np.ndarray:
    """The ALiBi paper's slopes ``2**(-8 (h + 1) / num_heads)``, ``h = 0..num_heads-1``."""
    return 2.0 ** (-8.0 * (np.arange(num_heads) + 1) / num_heads)


def alibi_slopes(
    num_heads: int, batch: Sequence[int] = (), dtype=np.float64, max_slope: float = 1.0
) -> st.SearchStrategy[np.ndarray]:
    """ALiBi slopes of shape ``(*batch, num_heads)``: the standard geometric ones or positive
    values uniform in ``[1/256, max_slope]`` (a bias ``-slope |p - j|`` of a few units at the
    sizes tests use, so softmax stays far from saturation)."""
    if num_heads < 1 or not 0 < max_slope:
        raise ValueError(f"alibi_slopes: expected num_heads >= 1 and max_slope > 0, got {num_heads}, {max_slope}")
    shape = tuple(batch) + (num_heads,)

    def build(args):
        standard, seed = args
        if standard:
            return np.broadcast_to(standard_alibi_slopes(num_heads), shape).astype(dtype)
        return np.random.default_rng(seed).uniform(1.0 / 256, max_slope, shape).astype(dtype)

    return st.tuples(st.booleans(), seeds()).map(build)


def softcaps(min_value: float = 1.0, max_value: float = 30.0) -> st.SearchStrategy[float]:
    """Positive ``softcap`` values (``scores -> softcap * tanh(scores / softcap)``).  The default
    range keeps ``tanh`` out of its flat tails for scores of a few units (not ill-conditioned)."""
    if not 0 < min_value <= max_value:
        raise ValueError(f"softcaps: expected 0 < min_value <= max_value, got {min_value}, {max_value}")
    return st.floats(min_value, max_value, allow_nan=False, allow_infinity=False)


def sinks(num_heads: int, dtype=np.float64, scale: float = 2.0) -> st.SearchStrategy[np.ndarray]:
    """Attention-sink logits ``(num_heads,)`` uniform in ``[-scale, scale]``."""
    if num_heads < 1:
        raise ValueError(f"sinks: expected num_heads >= 1, got {num_heads}")
    return seeds().map(lambda seed: np.random.default_rng(seed).uniform(-scale, scale, num_heads).astype(dtype))


POSITION_KINDS = ("arange", "offset", "per_batch", "random")


def positions(
    length: int, lead: Sequence[int] = (), max_offset: int = 64, kinds: Optional[Sequence[str]] = None
) -> st.SearchStrategy[np.ndarray]:
    """Integer RoPE positions for ``x (*lead, length, D)``, broadcastable to ``(*lead, length)``:

    * ``"arange"``: ``arange(length)`` (the default positions);
    * ``"offset"``: ``arange(length) + t``, ``t`` in ``0..max_offset`` (new tokens after ``t``
      cached ones);
    * ``"per_batch"``: a different offset per sequence, shape ``(lead[0], 1, ..., 1, length)``
      (without a leading axis, one offset: as ``"offset"``);
    * ``"random"``: any non-negative positions below ``max_offset + length``.
    """
    kinds = POSITION_KINDS if kinds is None else ((kinds,) if isinstance(kinds, str) else tuple(kinds))
    for k in kinds:
        if k not in POSITION_KINDS:
            raise ValueError(f"kinds: expected names from {POSITION_KINDS}, got {k!r}")
    if length < 1 or max_offset < 0:
        raise ValueError(f"positions: expected length >= 1 and max_offset >= 0, got {length}, {max_offset}")
    lead = tuple(lead)

    def build(args):
        kind, seed = args
        rng = np.random.default_rng(seed)
        base = np.arange(length, dtype=np.int64)
        if kind == "arange":
            return base
        if kind == "offset" or (kind == "per_batch" and not lead):
            return base + int(rng.integers(0, max_offset + 1))
        if kind == "per_batch":
            nb = lead[0] if lead else 1
            offsets = rng.integers(0, max_offset + 1, nb).astype(np.int64)
            shape = (nb,) + (1,) * max(len(lead) - 1, 0) + (length,)
            return (offsets[:, None] + base[None, :]).reshape(shape)
        return rng.integers(0, max_offset + length, length).astype(np.int64)

    return st.tuples(st.sampled_from(kinds), seeds()).map(build)


# -- gated delta rule (Qwen3-Next's linear attention) ---------------------------------------------


@dataclass
class DeltaRuleCase:
    """Inputs of ``gated_delta_rule`` with upstream gradients for its backward.

    ``g`` is a log decay ``<= 0`` (``-softplus`` of a normal draw, as Qwen3-Next makes it), ``beta``
    in ``(0, 1)`` (a sigmoid); keys have norm at most 1 (or are normalised by ``use_qk_l2norm``),
    so every step's ``I - beta k k^T`` is a contraction and long sequences stay well conditioned.
    """

    q: np.ndarray  # (B..., H, L, Dk)
    k: np.ndarray
    v: np.ndarray  # (B..., H, L, Dv)
    g: np.ndarray  # (B..., H, L)
    beta: np.ndarray
    initial_state: Optional[np.ndarray]  # (B..., H, Dk, Dv) or None
    use_qk_l2norm: bool
    output_final_state: bool
    chunk_size: int
    dout: np.ndarray  # (B..., H, L, Dv)
    dfinal_state: Optional[np.ndarray]  # (B..., H, Dk, Dv) or None

    def kwargs(self) -> dict:
        """The keyword arguments of ``gated_delta_rule`` (without ``chunk_size``)."""
        return dict(
            initial_state=self.initial_state,
            output_final_state=self.output_final_state,
            use_qk_l2norm=self.use_qk_l2norm,
        )


def delta_rule_inputs(
    max_len: int = 24, max_dim: int = 5, max_heads: int = 2, dtype=np.float64
) -> st.SearchStrategy[DeltaRuleCase]:
    """:class:`DeltaRuleCase` draws: 0-2 batch axes, ``1..max_heads`` heads, ``L`` in ``1..max_len``,
    ``Dk``, ``Dv`` in ``1..max_dim``, chunk sizes from 1 to past ``L`` (so ``L`` is often not a
    multiple of the chunk), with and without an initial state, the l2 norm, the final state and
    its upstream gradient."""

    def build(args):
        lead, steps, dk, dv, chunk, flags, seed = args
        init, l2, final, dfinal = flags
        rng = np.random.default_rng(seed)
        shape = tuple(lead)
        k = rng.standard_normal(shape + (steps, dk))
        if not l2:  # norms in [0.5, 1]
            k *= rng.uniform(0.5, 1.0, shape + (steps, 1)) / np.linalg.norm(k, axis=-1, keepdims=True)
        x = rng.standard_normal(shape + (steps,))
        return DeltaRuleCase(
            q=rng.uniform(-1, 1, shape + (steps, dk)).astype(dtype),
            k=k.astype(dtype),
            v=rng.uniform(-1, 1, shape + (steps, dv)).astype(dtype),
            g=(-np.logaddexp(0.0, x)).astype(dtype),
            beta=(1.0 / (1.0 + np.exp(-rng.standard_normal(shape + (steps,))))).astype(dtype),
            initial_state=rng.uniform(-1, 1, shape + (dk, dv)).astype(dtype) if init else None,
            use_qk_l2norm=l2,
            output_final_state=final,
            chunk_size=chunk,
            dout=rng.standard_normal(shape + (steps, dv)).astype(dtype),
            dfinal_state=rng.standard_normal(shape + (dk, dv)).astype(dtype) if dfinal else None,
        )

    lead = st.tuples(st.lists(st.integers(1, 2), min_size=0, max_size=2), st.integers(1, max_heads)).map(
        lambda t: tuple(t[0]) + (t[1],)
    )
    sizes = st.integers(1, max_dim)
    return st.tuples(
        lead,
        st.integers(1, max_len),
        sizes,
        sizes,
        st.integers(1, max_len + 2),
        st.tuples(st.booleans(), st.booleans(), st.booleans(), st.booleans()),
        seeds(),
    ).map(build)


# -- mixture of experts (npattn.nn.moe) -------------------------------------------------------------


@dataclass
class MoeCase:
    """A ``SparseMoeBlock`` configuration with an input and an upstream gradient.

    ``kwargs`` are the block's keyword arguments (router variant, experts kind, shared expert...);
    ``block()`` builds it from ``seed`` (with a random ``e_score_correction_bias`` for the sigmoid
    router, so the correction changes choices).  Values are drawn from continuous distributions:
    ties in the router's choice have probability zero, but a test taking finite differences
    should still check the choice's margin."""

    hidden_size: int
    num_experts: int
    top_k: int
    intermediate_size: int
    kwargs: dict
    x: np.ndarray  # (lead..., hidden_size)
    dy: np.ndarray  # like x
    seed: int
    dtype: np.dtype = field(default=np.dtype(np.float64))

    def block(self):
        """The ``SparseMoeBlock`` of this case (parameters from ``seed``)."""
        from ..nn.moe import SparseMoeBlock

        m = SparseMoeBlock(
            self.hidden_size,
            self.num_experts,
            self.top_k,
            self.intermediate_size,
            rng=self.seed,
            dtype=self.dtype,
            **self.kwargs,
        )
        router = m.router_module
        if router.variant == "sigmoid":
            bias = np.random.default_rng(self.seed + 1).uniform(-0.3, 0.3, self.num_experts)
            router.e_score_correction_bias[...] = bias  # in place: it stays a registered buffer
        return m


def moe_configs(
    max_tokens: int = 6, max_experts: int = 8, max_hidden: int = 5, variants=None, dtype=np.float64
) -> st.SearchStrategy[MoeCase]:
    """:class:`MoeCase` draws: every router variant (or those in ``variants``), ``E`` in
    ``2..max_experts``, ``k`` in ``1..E``, group-limited choice (when ``E`` has a divisor leaving
    two experts per group), renormalised or not, a routed scaling factor, a router bias, SwiGLU
    experts (silu, gelu, tanh-gelu), GPT-OSS's clamped ones (with a small limit, so the clamps
    act) or plain ones (not gated: relu2 or silu; sometimes in a latent width, Nemotron 3's), with
    or without a shared expert and its sigmoid gate, 0-2 leading axes of tokens."""
    from ..nn.moe import ROUTER_VARIANTS

    names = tuple(variants) if variants is not None else ROUTER_VARIANTS
    dt = np.dtype(dtype)

    def build(variant, e, h, i, lead, raw, flags, seed):  # e experts, width h, an expert's width i
        k_raw, g_raw, tg_raw, act_raw, shared_raw = raw
        norm, bias, scaled, gpt_oss, gated = flags
        kw: dict = {"router": variant, "router_bias": bias, "routed_scaling_factor": 2.5 if scaled else 1.0}
        if variant != "topk_softmax":
            kw["norm_topk_prob"] = norm
        groups = [g for g in range(2, e + 1) if e % g == 0 and e // g >= 2]
        max_k = e
        if groups and g_raw % 2:
            g = groups[g_raw % len(groups)]
            tg = 1 + tg_raw % g
            kw.update(n_group=g, topk_group=tg)
            max_k = tg * (e // g)
        k = 1 + k_raw % max_k
        plain = not gpt_oss and act_raw % 5 >= 3  # Nemotron 3's experts
        if gpt_oss:
            kw.update(experts="gpt_oss", swiglu_limit=0.6, swiglu_alpha=1.702)
        elif plain:
            kw.update(experts="plain", hidden_act=("relu2", "silu")[act_raw % 5 - 3])
            if (act_raw // 5) % 2:  # the experts in a latent width, its projections biased or not
                kw.update(latent_size=1 + (act_raw // 10) % 3, latent_bias=bool((act_raw // 30) % 2))
        else:
            kw["hidden_act"] = ("silu", "gelu", "gelu_pytorch_tanh")[act_raw % 3]
        if shared_raw % 3:
            kw.update(shared_intermediate_size=shared_raw % 3 + 1, shared_expert_gate=gated)
        rng = np.random.default_rng(seed)
        x = rng.uniform(-1.5, 1.5, tuple(lead) + (h,)).astype(dt)
        dy = rng.standard_normal(x.shape).astype(dt)
        return MoeCase(h, e, k, i, kw, x, dy, seed, dt)

    small = st.integers(0, 2**16)
    return st.tuples(  # build's arguments, in its order
        st.sampled_from(names),
        st.integers(2, max_experts),
        st.integers(1, max_hidden),
        st.integers(1, 4),
        st.lists(st.integers(1, max_tokens), min_size=1, max_size=2),
        st.tuples(small, small, small, small, small),
        st.tuples(*(st.booleans(),) * 5),
        seeds(),
    ).map(lambda args: build(*args))


# -- RoPE as models configure it (npattn.functional.rope_frequencies) ------------------------------

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


@st.composite
def rope_scalings(draw, types: Sequence[str] = ROPE_TYPES, max_position_embeddings: int = 8):
    """Hugging Face RoPE dicts (``rope_scaling`` / ``rope_parameters``) for ``rope(x, scaling=)`` and
    ``MultiHeadAttention(rope_scaling=)``: one of ``types`` with its keys drawn over their useful
    range (YaRN's optional keys sometimes present, the old spelling ``type`` sometimes), with
    ``max_position_embeddings`` (``dynamic`` needs it; small, so short tests reach beyond it).
    ``"default"`` gives ``None`` or a dict with ``rope_type`` only."""
    kind = draw(st.sampled_from(tuple(types)))
    key = draw(st.sampled_from(["rope_type", "rope_type", "type"]))
    if kind == "default":
        return draw(st.sampled_from([None, {key: "default"}]))
    original = draw(st.sampled_from([2, 4, max_position_embeddings]))
    d: dict = {key: kind, "factor": draw(st.floats(1.0, 16.0)), "max_position_embeddings": max_position_embeddings}
    if kind == "yarn":
        d["original_max_position_embeddings"] = original
        for name, values in (
            ("beta_fast", st.floats(4.0, 32.0)),
            ("beta_slow", st.floats(0.5, 2.0)),
            ("mscale", st.floats(0.5, 1.0)),
            ("mscale_all_dim", st.floats(0.5, 1.0)),
            ("attention_factor", st.floats(0.5, 2.0)),
            ("truncate", st.booleans()),
        ):
            if draw(st.booleans()):
                d[name] = draw(values)
    elif kind == "llama3":
        low = draw(st.floats(0.5, 2.0))
        d.update(
            original_max_position_embeddings=original,
            low_freq_factor=low,
            high_freq_factor=low + draw(st.floats(0.5, 4.0)),
        )
    return d


# -- multi-head latent attention (npattn.nn.latent_attention) ----------------------------------------

# the RoPE dicts latent_attention_configs draws from (None: the default rotation)
LATENT_ROPE_SCALINGS: tuple = (
    None,
    {"rope_type": "linear", "factor": 2.0},
    {
        "rope_type": "yarn",
        "factor": 4.0,
        "mscale": 0.9,
        "mscale_all_dim": 0.7,
        "original_max_position_embeddings": 4,
        "beta_fast": 4.0,
        "beta_slow": 1.0,
    },
)


@dataclass
class LatentAttentionCase:
    """A ``MultiHeadLatentAttention`` configuration with an input and an upstream gradient.

    ``kwargs`` are the module's keyword arguments (the head sizes, ``q_lora_rank``,
    ``rope_interleave``, ``attention_bias``, ``rope_scaling``); ``module()`` builds it from
    ``seed``, with the two latent norms' weights drawn away from ones (so their gradients matter)."""

    hidden_size: int
    num_heads: int
    kwargs: dict
    x: np.ndarray  # (lead..., L, hidden_size)
    dy: np.ndarray  # like x
    seed: int
    dtype: np.dtype = field(default=np.dtype(np.float64))

    def module(self):
        """The ``MultiHeadLatentAttention`` of this case (parameters from ``seed``)."""
        from ..nn.latent_attention import MultiHeadLatentAttention

        m = MultiHeadLatentAttention(self.hidden_size, self.num_heads, rng=self.seed, dtype=self.dtype, **self.kwargs)
        rng = np.random.default_rng(self.seed + 1)
        for name, p in m.named_parameters():
            if "layernorm" in name:
                p.data = rng.uniform(0.5, 1.5, p.shape).astype(self.dtype)
        return m


def latent_attention_configs(
    max_len: int = 5, max_heads: int = 3, max_dim: int = 6, dtype=np.float64
) -> st.SearchStrategy[LatentAttentionCase]:
    """:class:`LatentAttentionCase` draws: ``1..max_heads`` heads; latent rank, nope, rope (even)
    and value head sizes up to ``max_dim``; the query through ``q_proj`` or a low-rank
    ``q_lora_rank``; interleaved or rotate-half RoPE, default, linear or YaRN scaling
    (``LATENT_ROPE_SCALINGS``); with or without biases; ``2..max_len`` tokens after 0-2 leading axes."""
    dt = np.dtype(dtype)

    def build(heads, hidden, sizes, q_lora, interleave, bias, scaling, lead, length, seed):
        r, dn, half_dr, dv = sizes  # the latent rank, the nope, half the rope and the value head sizes
        kw = {
            "kv_lora_rank": r,
            "qk_nope_head_dim": dn,
            "qk_rope_head_dim": 2 * half_dr,
            "v_head_dim": dv,
            "q_lora_rank": q_lora,
            "rope_interleave": interleave,
            "attention_bias": bias,
            "rope_scaling": None if scaling is None else dict(scaling),
        }
        rng = np.random.default_rng(seed)
        x = rng.standard_normal(tuple(lead) + (length, hidden)).astype(dt)
        dy = rng.standard_normal(x.shape).astype(dt)
        return LatentAttentionCase(hidden, heads, kw, x, dy, seed, dt)

    size = st.integers(1, max_dim)
    return st.tuples(  # build's arguments, in its order
        st.integers(1, max_heads),
        st.integers(1, 2 * max_dim),
        st.tuples(size, size, st.integers(1, max(1, max_dim // 2)), size),
        st.one_of(st.none(), size),
        st.booleans(),
        st.booleans(),
        st.sampled_from(LATENT_ROPE_SCALINGS),
        st.lists(st.integers(1, 2), max_size=2),
        st.integers(2, max_len),
        seeds(),
    ).map(lambda args: build(*args))

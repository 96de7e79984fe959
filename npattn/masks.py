"""Attention-mask helpers, all in the **True = may attend** polarity of
``scaled_dot_product_attention``'s ``attn_mask``.

* ``causal(Lq, Lk)``: ``(Lq, Lk)``, query ``i`` sees keys ``0..i`` (top-left aligned).
* ``padding(lengths, L)``: ``(batch, L)``, True for real tokens.
* ``sliding_window(L, window)``: causal and at most ``window`` keys back (``i - window < j <= i``).
* ``combine(*masks)``: a key may be attended only where every mask allows it (bool masks are
  AND-ed; float masks are added, bool ones entering a float combination as 0 / -inf).
* ``from_key_padding_mask(kpm)``: torch's ``key_padding_mask`` (``(batch, Lk)``, **True = padding**)
  as an ``attn_mask`` of shape ``(batch, 1, 1, Lk)`` (True = may attend), i.e. ``~kpm`` with two
  axes inserted so it broadcasts over heads and queries.  ``padding(lengths, L)`` is the
  complement of a key padding mask: ``key_padding_mask = ~padding(lengths, L)``.
"""

from __future__ import annotations

import numpy as np

from ._docs import shared_doc
from ._validate import as_index, check_additive_values, check_float_dtype, check_size, to_numpy

__all__ = ["causal", "padding", "sliding_window", "combine", "from_key_padding_mask", "to_additive"]


def _band_doc(shape: str):
    """The Returns and Raises sections of ``causal`` and ``sliding_window`` (a bool mask of ``shape``)."""
    return shared_doc(
        returns_raises=f"""
        Returns
        -------
        ndarray of bool
            ``{shape}``, True = may attend.

        Raises
        ------
        TypeError, ValueError
            A size that is not a positive integer.
        """
    )


@_band_doc("(Lq, Lk)")
def causal(Lq, Lk=None) -> np.ndarray:
    """Bool ``(Lq, Lk)`` mask, True where ``j <= i`` (as torch's ``is_causal``).

    Parameters
    ----------
    Lq : int
        The number of queries, >= 1.
    Lk : int, optional
        The number of keys (default ``Lq``).

    <returns_raises>

    Examples
    --------
    >>> from npattn import masks
    >>> masks.causal(3).astype(int)
    array([[1, 0, 0],
           [1, 1, 0],
           [1, 1, 1]])
    """
    Lq = check_size(Lq, "Lq")
    Lk = Lq if Lk is None else check_size(Lk, "Lk")
    return np.tri(Lq, Lk, dtype=bool)


def padding(lengths, L) -> np.ndarray:
    """Bool ``(batch, L)`` mask, True for the first ``lengths[b]`` positions (real tokens).

    Parameters
    ----------
    lengths : array_like of int
        ``(batch,)``, each in ``[0, L]``.
    L : int
        The padded length.

    Returns
    -------
    ndarray of bool
        ``(batch, L)``, True = a real token.

    Raises
    ------
    TypeError
        Non-integer lengths.
    ValueError
        ``lengths`` not 1-d, or a length outside ``[0, L]``.

    Examples
    --------
    >>> from npattn import masks
    >>> masks.padding([2, 3], 4).astype(int)
    array([[1, 1, 0, 0],
           [1, 1, 1, 0]])
    """
    L = check_size(L, "L")
    lengths = as_index(lengths, "lengths")
    if lengths.ndim != 1:
        raise ValueError(f"lengths: expected a 1-d array of sequence lengths, got shape {lengths.shape}")
    if lengths.size and (lengths.min() < 0 or lengths.max() > L):
        raise ValueError(f"lengths: expected values in [0, {L}], got {lengths.tolist()}")
    return np.arange(L) < lengths[:, None]


@_band_doc("(L, L)")
def sliding_window(L, window) -> np.ndarray:
    """Bool ``(L, L)`` causal band: query ``i`` sees keys ``j`` with ``i - window < j <= i``.

    Parameters
    ----------
    L : int
        The sequence length.
    window : int
        How many keys each query sees, itself included (>= 1).

    <returns_raises>

    Examples
    --------
    >>> from npattn import masks
    >>> masks.sliding_window(4, 2).astype(int)
    array([[1, 0, 0, 0],
           [1, 1, 0, 0],
           [0, 1, 1, 0],
           [0, 0, 1, 1]])
    """
    L = check_size(L, "L")
    window = check_size(window, "window")
    i = np.arange(L)[:, None]
    j = np.arange(L)[None, :]
    return (j <= i) & (j > i - window)


def to_additive(mask, dtype=np.float64) -> np.ndarray:
    """Bool (True = may attend) -> float ``0 / -inf`` of the floating ``dtype``; float masks are
    returned as they are.

    Parameters
    ----------
    mask : array_like
        Bool (True = may attend) or float.
    dtype : float32 or float64
        For a bool mask: the float dtype to return.

    Returns
    -------
    ndarray
        ``0`` where attending is allowed, ``-inf`` elsewhere (a float mask unchanged).

    Raises
    ------
    TypeError
        A mask neither bool nor float, or an unsupported dtype.

    Examples
    --------
    >>> import numpy as np
    >>> from npattn import masks
    >>> masks.to_additive(np.array([True, False]))
    array([  0., -inf])
    """
    m = to_numpy(mask, "mask")
    if m.dtype == bool:
        try:
            dt = np.dtype(dtype)
        except TypeError:
            dt = None
        if dt is None or dt not in (np.dtype(np.float32), np.dtype(np.float64)):
            raise TypeError(f"dtype: expected np.float32 or np.float64, got {dtype!r}")
        return np.where(m, 0.0, -np.inf).astype(dt)
    if m.dtype.kind != "f":
        raise TypeError(f"mask: expected a bool or float array, got dtype {m.dtype}")
    check_float_dtype(m.dtype, "mask")
    return m


def combine(*masks):
    """One mask allowing only what every given mask allows (``None`` entries are skipped).

    All bool: logical AND.  Any float: the sum of the float masks and ``to_additive`` of the bool
    ones.  Shapes broadcast.  Returns None when no mask is given.

    Parameters
    ----------
    *masks : array_like or None
        Bool (True = may attend) or float masks.

    Returns
    -------
    ndarray or None
        The combined mask (bool if all were bool, else float).

    Raises
    ------
    TypeError
        A mask neither bool nor float.
    ValueError
        Shapes that do not broadcast.

    Examples
    --------
    >>> from npattn import masks
    >>> m = masks.combine(masks.causal(3), masks.padding([2], 3)[:, None, :], None)
    >>> m.astype(int)                   # causal, and never the padded third key
    array([[[1, 0, 0],
            [1, 1, 0],
            [1, 1, 0]]])
    """
    ms = [to_numpy(m, "masks") for m in masks if m is not None]
    if not ms:
        return None
    for m in ms:
        if m.dtype != bool and m.dtype.kind != "f":
            raise TypeError(f"masks: expected bool or float arrays, got dtype {m.dtype}")
        if m.dtype.kind == "f":
            check_float_dtype(m.dtype, "masks")
    try:
        np.broadcast_shapes(*(m.shape for m in ms))
    except ValueError:
        raise ValueError(f"masks: shapes {[m.shape for m in ms]} do not broadcast together") from None
    if all(m.dtype == bool for m in ms):
        out = ms[0]
        for m in ms[1:]:
            out = out & m
        return out
    dtype = np.result_type(*[m.dtype for m in ms if m.dtype != bool])
    out = None
    for m in ms:
        a = to_additive(m, dtype)
        out = a if out is None else out + a
    return out


def from_key_padding_mask(key_padding_mask) -> np.ndarray:
    """torch-style ``key_padding_mask`` ``(..., Lk)`` (True = padding, or float additive) ->
    ``attn_mask`` ``(..., 1, 1, Lk)`` (True = may attend, or the same float values).

    Parameters
    ----------
    key_padding_mask : array_like
        ``(..., Lk)``: bool (True = padding) or float (additive).

    Returns
    -------
    ndarray
        ``(..., 1, 1, Lk)``: broadcastable to attention scores ``(..., H, Lq, Lk)``.

    Raises
    ------
    TypeError
        An integer or non-numeric mask.
    ValueError
        A 0-d mask, or ``+inf``/NaN in a float mask.

    Examples
    --------
    >>> import numpy as np
    >>> from npattn import masks
    >>> masks.from_key_padding_mask(np.array([[False, False, True]])).astype(int)
    array([[[[1, 1, 0]]]])
    """
    m = to_numpy(key_padding_mask, "key_padding_mask")
    if m.dtype.kind in "iu":
        raise TypeError(
            f"key_padding_mask: integer masks are ambiguous; pass bool (True = padding) or float, got dtype {m.dtype}"
        )
    if m.dtype == bool:
        m = ~m
    elif m.dtype.kind != "f":
        raise TypeError(f"key_padding_mask: expected a bool or float array, got dtype {m.dtype}")
    else:
        check_additive_values(m, "key_padding_mask")
    if m.ndim < 1:
        raise ValueError(f"key_padding_mask: expected shape (batch, Lk), got {m.shape}")
    return m[..., None, None, :]

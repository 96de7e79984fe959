"""Small arrays shipped with the package, so that the notebooks run outside the repository.

* ``chapter3``: the inputs, weights and outputs of chapter 3 of *Build a Large Language Model (From
  Scratch)*, as the book's seeded PyTorch code creates them (float32; remade by
  ``tests/book/make_book_weights.py``).
* ``chapter4``: two small ``GPTModel`` configurations of chapter 4 with their weights, inputs, logits
  and gradients (remade by ``tests/book/make_chapter4_weights.py``).
* ``torch_mha_reference``: ``torch.nn.MultiheadAttention`` outputs and gradients (float64) that
  notebook 07 compares against when torch is not installed (remade by that notebook).
"""

from __future__ import annotations

from importlib import resources

import numpy as np

__all__ = ["names", "load"]


def names() -> list[str]:
    """The names of the shipped data sets, sorted.

    Returns
    -------
    list of str
        Each a valid ``name`` for :func:`load`.

    Examples
    --------
    >>> from npattn import data
    >>> data.names()
    ['chapter3', 'chapter4', 'torch_mha_reference']
    """
    return sorted(p.name[: -len(".npz")] for p in resources.files(__name__).iterdir() if p.name.endswith(".npz"))


def load(name: str) -> dict[str, np.ndarray]:
    """The arrays of one shipped data set, read into memory.

    Parameters
    ----------
    name : str
        One of :func:`names`, e.g. ``"chapter3"``.

    Returns
    -------
    dict of str to numpy.ndarray
        The ``.npz`` file's arrays by key, in the file's order.

    Raises
    ------
    ValueError
        If ``name`` is not a shipped data set.
    TypeError
        If ``name`` is not a string.

    Examples
    --------
    >>> from npattn import data
    >>> book = data.load("chapter3")
    >>> book["inputs"].shape, book["inputs"].dtype
    ((6, 3), dtype('float32'))
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    known = names()
    if name not in known:
        raise ValueError(f"name must be one of {known}, got {name!r}")
    with resources.as_file(resources.files(__name__) / f"{name}.npz") as path, np.load(path) as f:
        return {k: f[k] for k in f.files}

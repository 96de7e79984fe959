"""Counter-based uniform numbers: the dropout mask of a block, regenerated from its position.

``memory_efficient_attention`` never stores an ``(Lq, Lk)`` dropout mask: it draws one ``seed``
from the caller's ``rng`` per call, and the keep-mask entry of score ``(..., h, i, j)`` is
``uniform(seed, flat index of (..., h, i, j) in the broadcast score shape) >= p``.  Any block of
the mask can then be formed on its own, in the forward and again in the backward, from the indices
of its rows and columns: the same numbers whatever the block size.  The textbook tier forms the
whole mask at once with the same function, so both tiers drop exactly the same weights.

The hash is splitmix64 (Steele, Lea, Flood 2014), applied to ``index + mix(seed)``; the top 53
bits make a double in ``[0, 1)``.  numpy's uint64 arithmetic wraps modulo 2**64, as the hash wants.
"""

from __future__ import annotations

import math

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def draw_seed(rng: np.random.Generator) -> int:
    """One draw from the caller's generator: the seed of a call's whole dropout mask."""
    return int(rng.integers(0, 2**63 - 1, dtype=np.int64))


def uniform(seed: int, index: np.ndarray) -> np.ndarray:
    """``[0, 1)`` doubles, one per entry of the integer array ``index`` (any shape), a pure
    function of ``(seed, index)``."""
    base = _mix(np.array([seed], dtype=np.uint64) + _GOLDEN)[0]
    z = np.asarray(index, dtype=np.uint64) + base + _GOLDEN
    return (_mix(z) >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)


def keep_mask(
    seed: int, p: float, score_shape: tuple, rows: slice = slice(None), cols: slice = slice(None)
) -> np.ndarray:
    """Dropout's keep-mask (True = kept) of the block ``[..., rows, cols]`` of a score array of
    shape ``score_shape`` (``(..., Lq, Lk)``): ``uniform(seed, flat index) >= p``."""
    lq, lk = score_shape[-2], score_shape[-1]
    lead = int(np.prod(score_shape[:-2], dtype=np.int64))
    r = np.arange(lq, dtype=np.uint64)[rows]
    c = np.arange(lk, dtype=np.uint64)[cols]
    m = np.arange(lead, dtype=np.uint64) * np.uint64(lq * lk)
    index = m[:, None, None] + r[None, :, None] * np.uint64(lk) + c[None, None, :]
    return (uniform(seed, index) >= p).reshape(tuple(score_shape[:-2]) + (len(r), len(c)))


def keep_into(seed: int, p: float, z: np.ndarray, work: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``uniform(seed, z) >= p`` written into the bool array ``out``, without temporaries: ``z`` (the
    uint64 flat indices) is overwritten and ``work`` (uint64, same shape) is scratch.  Bit for bit
    the test of ``keep_mask``: ``u = (h >> 11) * 2**-53 >= p`` iff ``h >= ceil(p * 2**53) * 2**11``."""
    if p >= 1.0:
        out.fill(False)
        return out
    z += (_mix(np.array([seed], dtype=np.uint64) + _GOLDEN) + _GOLDEN)[0]  # as ``uniform``: index + base + golden
    for shift, mult in ((30, _M1), (27, _M2)):
        np.right_shift(z, np.uint64(shift), out=work)
        z ^= work
        z *= mult
    np.right_shift(z, np.uint64(31), out=work)
    z ^= work
    return np.greater_equal(z, np.uint64(math.ceil(p * 2.0**53) << 11), out=out)

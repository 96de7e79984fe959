"""Key/value caches for incremental decoding: ``KVCache`` and its sliding-window form ``RollingKVCache``.

A cache holds the keys and values of the tokens seen so far, ``(..., Hk, T, hd)`` (any leading
batch axes, a head axis, the token axis, the features), in buffers whose capacity doubles as they
fill, so appending costs O(new tokens) amortised.  ``MultiHeadAttention`` keeps its projected (and
rotated) keys and values in one; ``MultiHeadLatentAttention`` keeps each token's latent
``[c, k_pe]`` as a one-head "key" with a zero-width "value".

The public surface, for every user of a cache (a module, or layers sharing one cache):

* ``append(k, v)`` -> every held key and value (views, valid until the next ``append``/``trim``);
* ``keys``, ``values``: the same views without appending;
* ``length``: tokens held; ``position``: tokens seen (the position of the next token; more than
  ``length`` once a rolling cache has dropped some); ``lead``: the batch shape (None while empty);
* ``trim()``: forget what no later query can see (nothing for ``KVCache``; a ``RollingKVCache``
  keeps the last ``keep`` tokens); call it once the views ``append`` returned are used;
* ``nbytes``: bytes of the held keys and values; ``capacity``: tokens the buffers have room for;
* ``reset()``: empty it (a new sequence);
* ``crop(n)``: forget every token from position ``n`` on, as if only the first ``n`` had been seen
  (transformers' ``DynamicCache.crop``; reusing a prompt's prefix, ``npattn.generation.PromptCache``);
  ``can_crop(n)`` says whether the cache still holds what that needs (a ``RollingKVCache`` may have
  dropped it), and ``pin(n)`` makes later ``trim()`` calls keep it until the next ``crop``/``reset``.
"""

from __future__ import annotations

from typing import cast

import numpy as np

__all__ = ["KVCache", "RollingKVCache"]

_MIN_CAPACITY = 16


class KVCache:
    """Keys and values of every token seen, ``(..., Hk, T, hd)``, in growing buffers.

    The buffers are made by the first ``append`` (in its dtype and batch shape) and regrown when
    full or when the keys' dtype changes (a module cast with ``.to()``).

    Examples
    --------
    >>> import numpy as np
    >>> from npattn.nn.kv_cache import KVCache
    >>> cache = KVCache()
    >>> k, v = cache.append(np.ones((2, 1, 3, 4)), np.zeros((2, 1, 3, 5)))
    >>> k.shape, v.shape, cache.length
    ((2, 1, 3, 4), (2, 1, 3, 5), 3)
    >>> cache.append(np.ones((2, 1, 1, 4)), np.zeros((2, 1, 1, 5)))[0].shape, cache.nbytes
    ((2, 1, 4, 4), 576)
    """

    def __init__(self) -> None:
        self.k: np.ndarray | None = None  # the buffers, (..., Hk, capacity, hd); tokens [0, length) are held
        self.v: np.ndarray | None = None
        self.length = 0
        self.position = 0

    @property
    def lead(self) -> tuple | None:
        """The batch shape of the cached calls (the axes before ``(Hk, T, hd)``), None while empty."""
        return None if self.k is None else self.k.shape[:-3]

    @property
    def capacity(self) -> int:
        """Tokens the buffers have room for before they grow."""
        return 0 if self.k is None else self.k.shape[-2]

    @property
    def keys(self) -> np.ndarray | None:
        """The held keys ``(..., Hk, length, hd)`` (a view), None while empty."""
        return None if self.k is None else self.k[..., : self.length, :]

    @property
    def values(self) -> np.ndarray | None:
        """The held values ``(..., Hk, length, hd_v)`` (a view), None while empty."""
        return None if self.v is None else self.v[..., : self.length, :]

    @property
    def nbytes(self) -> int:
        """Bytes of the held keys and values (not of the buffers' spare room)."""
        if self.k is None or self.v is None:
            return 0
        return self.length * (self.k.nbytes // self.capacity + self.v.nbytes // self.capacity)

    def append(self, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Add ``k (..., Hk, n, hd)`` and ``v (..., Hk, n, hd_v)``; return views of every held key
        and value.  The caller checks the batch shape (``lead``) beforehand."""
        n, t = k.shape[-2], self.length
        if self.k is None:
            self._grow(k, v, max(_MIN_CAPACITY, 2 * n))
        elif t + n > self.k.shape[-2] or self.k.dtype != k.dtype:
            self._grow(k, v, max(2 * self.k.shape[-2], t + n))
        buf_k, buf_v = cast(np.ndarray, self.k), cast(np.ndarray, self.v)
        buf_k[..., t : t + n, :] = k
        buf_v[..., t : t + n, :] = v
        self.length, self.position = t + n, self.position + n
        return buf_k[..., : t + n, :], buf_v[..., : t + n, :]

    def trim(self) -> None:
        """Forget what no later query can see: nothing here (see ``RollingKVCache``)."""

    def reset(self) -> None:
        """Empty the cache (a new sequence); the buffers are released."""
        self.k = self.v = None
        self.length = self.position = 0

    def can_crop(self, n: int) -> bool:
        """Whether ``crop(n)`` can keep exactly what a cache that saw only the first ``n`` tokens
        would hold for the next query: ``0 <= n <= position`` here (every key is kept)."""
        return 0 <= n <= self.position

    def crop(self, n: int) -> None:
        """Forget every token from position ``n`` on: the cache is then as after seeing only the
        first ``n`` tokens (the next ``append`` goes to position ``n``); the buffers are kept.

        Raises
        ------
        ValueError
            ``n`` outside ``[0, position]``, or (``RollingKVCache``) keys a query at ``n`` sees
            already dropped: ``can_crop(n)`` is False.

        Examples
        --------
        >>> import numpy as np
        >>> from npattn.nn.kv_cache import KVCache
        >>> cache = KVCache()
        >>> _ = cache.append(np.ones((1, 5, 4)), np.ones((1, 5, 4)))
        >>> cache.crop(3)
        >>> cache.length, cache.position, cache.keys.shape
        (3, 3, (1, 3, 4))
        """
        if not self.can_crop(n):
            raise ValueError(
                f"n: expected a position this cache can be cropped to (0 to {self.position}, the keys a query at n "
                f"sees still held: from {self.position - self.length}), got {n}"
            )
        self.length -= self.position - n
        self.position = n

    def pin(self, n: int) -> None:
        """Keep, through later ``trim()`` calls, what ``crop(n)`` needs (until the next ``crop`` or
        ``reset``): nothing to do here, every key is kept (see ``RollingKVCache``)."""

    def _buffers(self) -> tuple[np.ndarray, np.ndarray]:
        assert self.k is not None and self.v is not None
        return self.k, self.v

    def _grow(self, k: np.ndarray, v: np.ndarray, capacity: int) -> None:
        """New buffers of ``capacity`` tokens in ``k``'s dtype, holding the cached tokens."""
        shape = k.shape[:-2] + (capacity, k.shape[-1])
        nk, nv = np.empty(shape, k.dtype), np.empty(shape[:-1] + (v.shape[-1],), v.dtype)
        if self.k is not None and self.v is not None:
            nk[..., : self.length, :] = self.k[..., : self.length, :]
            nv[..., : self.length, :] = self.v[..., : self.length, :]
        self.k, self.v = nk, nv

    def __repr__(self) -> str:
        return f"{type(self).__name__}(length={self.length}, position={self.position}, lead={self.lead})"


class RollingKVCache(KVCache):
    """A ``KVCache`` for a sliding window whose queries see at most ``keep`` past tokens.

    A later query at position ``p`` sees keys ``p - keep .. p`` only, so ``trim()`` (after each
    call) drops all but the last ``keep`` tokens: memory stays O(keep + tokens per call) however
    long the sequence.  ``position`` still counts every token seen (RoPE and the masks use it);
    ``position - length`` tokens have been dropped.

    Examples
    --------
    >>> import numpy as np
    >>> from npattn.nn.kv_cache import RollingKVCache
    >>> cache = RollingKVCache(keep=2)
    >>> _ = cache.append(np.ones((1, 5, 4)), np.ones((1, 5, 4)))
    >>> cache.trim()
    >>> cache.length, cache.position
    (2, 5)
    """

    def __init__(self, keep: int) -> None:
        super().__init__()
        self.keep = keep
        self.pinned: int | None = None  # pin(n)'s n: trim() keeps what crop(n) needs

    def reset(self) -> None:
        """Empty the cache (a new sequence); the buffers are released and the pin dropped."""
        super().reset()
        self.pinned = None

    def can_crop(self, n: int) -> bool:
        """Whether the cache still holds the keys a query at ``n`` sees (the ``keep`` before it):
        ``0 <= n <= position`` and nothing dropped that a cache of the first ``n`` tokens would hold.

        Examples
        --------
        >>> import numpy as np
        >>> from npattn.nn.kv_cache import RollingKVCache
        >>> cache = RollingKVCache(keep=2)
        >>> _ = cache.append(np.ones((1, 5, 4)), np.ones((1, 5, 4)))
        >>> cache.trim()                                   # holds positions 3 and 4
        >>> cache.can_crop(5), cache.can_crop(4)           # a query at 4 would see 2 and 3
        (True, False)
        """
        dropped = self.position - self.length
        return 0 <= n <= self.position and (dropped == 0 or dropped <= n - self.keep)

    def crop(self, n: int) -> None:
        """``KVCache.crop`` (ValueError where ``can_crop(n)`` is False); the pin is dropped."""
        super().crop(n)
        self.pinned = None

    def pin(self, n: int) -> None:
        """Keep, through later ``trim()`` calls, the ``keep`` tokens before position ``n`` (what
        ``crop(n)`` needs, and a crop to any later position), until the next ``crop`` or
        ``reset``: the cache then holds at most ``keep`` more tokens than the ones after ``n``.
        Of several pins the earliest holds.

        Examples
        --------
        >>> import numpy as np
        >>> from npattn.nn.kv_cache import RollingKVCache
        >>> cache = RollingKVCache(keep=2)
        >>> _ = cache.append(np.ones((1, 3, 4)), np.ones((1, 3, 4)))
        >>> cache.pin(3)
        >>> _ = cache.append(np.ones((1, 2, 4)), np.ones((1, 2, 4)))
        >>> cache.trim()
        >>> cache.length, cache.can_crop(3)                # positions 1 to 4 held
        (4, True)
        """
        self.pinned = n if self.pinned is None else min(self.pinned, n)

    def trim(self) -> None:
        """Drop every token but the last ``keep`` (moved to the front; from ``pinned - keep`` on
        while pinned); shrink an oversized buffer."""
        keep = self.keep if self.pinned is None else max(self.keep, self.position - self.pinned + self.keep)
        if self.length <= keep:
            return
        old_k, old_v = self._buffers()
        drop = self.length - keep
        cap = max(_MIN_CAPACITY, 2 * (keep + 1))
        if self.capacity > 2 * cap:  # e.g. after a long prompt: give the memory back
            nk = np.empty(old_k.shape[:-2] + (cap, old_k.shape[-1]), old_k.dtype)
            nv = np.empty(old_v.shape[:-2] + (cap, old_v.shape[-1]), old_v.dtype)
        else:
            nk, nv = old_k, old_v  # numpy copies overlapping slices correctly
        nk[..., :keep, :] = old_k[..., drop : self.length, :]
        nv[..., :keep, :] = old_v[..., drop : self.length, :]
        self.k, self.v, self.length = nk, nv, keep

    def __repr__(self) -> str:
        return f"{type(self).__name__}(keep={self.keep}, length={self.length}, position={self.position})"


class _KeysCacheHooks:
    """What a ``npattn.generation.PromptCache`` asks of a module that keeps its keys and values in
    ``self._kv_cache`` (a ``KVCache``, or None while empty): take out and put back the cache
    (``_cache_state``, ``_set_cache_state``: what ``reset_kv_cache()`` empties), remember a point
    of a prompt (``_cache_mark(n)``: a rolling cache pins it) and go back to a position
    (``_can_rewind``, ``_rewind_cache``: the cache's ``crop``), and say whether it can go back
    anywhere without a mark (``_rewinds_anywhere``).  Every module with a decoding cache has these
    six (the recurrent layers: ``npattn.nn.delta_net.RecurrentLayer``)."""

    _kv_cache: KVCache | None

    def _cache_state(self) -> tuple:
        return (self._kv_cache,)

    def _set_cache_state(self, state: tuple) -> None:
        object.__setattr__(self, "_kv_cache", state[0])

    def _cache_mark(self, n: int) -> None:
        if self._kv_cache is not None:
            self._kv_cache.pin(n)

    def _can_rewind(self, n: int, mark) -> bool:
        return self._kv_cache is None or self._kv_cache.can_crop(n)

    def _rewind_cache(self, n: int, mark) -> None:
        if self._kv_cache is not None:
            self._kv_cache.crop(n)

    def _rewinds_anywhere(self) -> bool:
        """Whether the cache can be cut back to any position without a mark there (every key
        kept); a module whose cache is a rolling window's says False."""
        return True

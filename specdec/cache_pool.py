"""The static-cache pool: idle ``StaticCache`` s kept between calls, bounded in bytes.

A static cache is allocated per (model, batch size, cache length). Reusing one across calls
keeps its tensor addresses stable (CUDA graphs recorded on them stay valid) and saves the
allocation; keeping one that no call uses only holds memory. So the pool keeps *idle* caches
(those no call owns) up to a limit in bytes, all models together, and lets the least recently
used go first.

Invariants:

* A cache is owned by one call at a time: :meth:`CachePool.acquire` takes it out of the pool,
  :meth:`CachePool.release` puts it back; caches in use are never counted, never evicted.
* After every operation the idle caches hold at most :func:`cache_pool_limit` bytes (a cache
  larger than the limit is dropped on release rather than kept).
* The pool holds models weakly: a model that goes away takes its idle caches with it.

The knob: the environment variable ``SPECDEC_CACHE_POOL_BYTES`` (read at import; an integer
number of bytes, or with a K/M/G suffix, e.g. ``512M``; ``0`` keeps nothing), or
:func:`set_cache_pool_limit` at run time. :func:`release_caches` drops a model's idle caches
(every model's without an argument). docs/performance.md ("The static-cache pool") says how to
choose the limit.
"""

from __future__ import annotations

import os
import re
import threading
import weakref
from collections import OrderedDict

import torch
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

#: bytes of idle static caches kept for reuse when ``SPECDEC_CACHE_POOL_BYTES`` is unset
DEFAULT_POOL_BYTES = 256 << 20
POOL_ENV = "SPECDEC_CACHE_POOL_BYTES"
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_bytes(text: str, name: str = POOL_ENV) -> int:
    """``"268435456"``, ``"256M"``, ``"256MiB"``, ``"1G"`` -> bytes (binary units)."""
    found = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", str(text), flags=re.IGNORECASE)
    if found is None:
        raise ValueError(f"{name} must be a number of bytes, optionally with a K, M or G suffix "
                         f"(e.g. 268435456 or 256M), got {text!r}")
    return int(found.group(1)) * _UNITS[found.group(2).upper()]


def new_static_cache(model, batch: int, length: int) -> StaticCache:
    """A ``StaticCache`` of ``length`` slots whose layers are all full-length ``StaticLayer`` s
    (see ``specdec.kv``); its tensors are allocated by the first forward that writes to it."""
    cache = StaticCache(config=model.config, max_cache_len=length)
    cache.layers = [layer if type(layer) is StaticLayer else StaticLayer(max_cache_len=length)
                    for layer in cache.layers]
    return cache


def cache_bytes(cache) -> int:
    """Bytes held by a cache's key and value tensors."""
    total = 0
    for layer in getattr(cache, "layers", ()):
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total


def _shape(cache) -> tuple[int, int] | None:
    """(batch, length) of a cache that was written to, or None (never written: nothing to keep)."""
    layer = cache.layers[0] if cache is not None and cache.layers else None
    if layer is None or not layer.is_initialized:
        return None
    return int(layer.keys.shape[0]), int(layer.keys.shape[2])


class CachePool:
    """Idle static caches by (model, batch, length), least recently used first out, at most
    ``limit`` bytes in all (see the module doc)."""

    def __init__(self, limit: int):
        self.limit = int(limit)
        # id(cache) -> (model ref, (batch, length), cache, bytes); oldest release first
        self._idle: OrderedDict[int, tuple] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._dead = False  # a pooled model went away: drop its caches at the next operation

    def acquire(self, model, batch: int, length: int) -> StaticCache:
        """The most recently released idle cache of this model, batch size and length, or a new one."""
        with self._lock:
            self._purge()
            for key in reversed(self._idle):
                ref, shape, cache, size = self._idle[key]
                if shape == (batch, length) and ref() is model:
                    del self._idle[key]
                    self._bytes -= size
                    return cache
        return new_static_cache(model, batch, length)

    def release(self, model, cache) -> None:
        """Keep ``cache`` (no longer used by its call) for ``model``'s later calls, within the limit."""
        shape = _shape(cache) if model is not None else None
        if shape is None:
            return
        size = cache_bytes(cache)
        with self._lock:
            self._purge()
            if size > self.limit:
                return
            self._idle[id(cache)] = (weakref.ref(model, self._forget), shape, cache, size)
            self._bytes += size
            self._evict(self.limit)

    def clear(self, model=None) -> int:
        """Drop ``model``'s idle caches (every model's if None); -> the bytes dropped."""
        with self._lock:
            self._purge()
            if model is None:
                dropped, self._bytes = self._bytes, 0
                self._idle.clear()
                return dropped
            return self._drop(lambda ref: ref() is model)

    def held(self, model=None) -> int:
        """Bytes of idle caches kept (for ``model`` only, if given)."""
        with self._lock:
            self._purge()
            if model is None:
                return self._bytes
            return sum(size for ref, _, _, size in self._idle.values() if ref() is model)

    def count(self) -> int:
        """How many idle caches are kept."""
        with self._lock:
            self._purge()
            return len(self._idle)

    def set_limit(self, limit: int) -> int:
        """Bound the idle caches to ``limit`` bytes from now on (evicting at once); -> the old limit."""
        with self._lock:
            old, self.limit = self.limit, int(limit)
            self._purge()
            self._evict(self.limit)
            return old

    # -- under the lock ---------------------------------------------------------------------------
    def _evict(self, limit: int) -> None:
        while self._bytes > limit and self._idle:
            _, (_, _, _, size) = self._idle.popitem(last=False)
            self._bytes -= size

    def _drop(self, which) -> int:
        gone = [key for key, (ref, _, _, _) in self._idle.items() if which(ref)]
        dropped = 0
        for key in gone:
            dropped += self._idle.pop(key)[3]
        self._bytes -= dropped
        return dropped

    def _purge(self) -> None:
        if self._dead:
            self._dead = False
            self._drop(lambda ref: ref() is None)

    def _forget(self, ref) -> None:
        """A pooled model was collected. Called by the garbage collector, possibly while this thread
        holds the lock: only mark, and drop at once if the lock is free."""
        self._dead = True
        if self._lock.acquire(blocking=False):
            try:
                self._purge()
            finally:
                self._lock.release()


POOL = CachePool(parse_bytes(os.environ[POOL_ENV]) if os.environ.get(POOL_ENV, "").strip() else DEFAULT_POOL_BYTES)


def set_cache_pool_limit(limit) -> int:
    """Keep at most ``limit`` bytes of idle static caches (an int, or a string like ``"512M"``;
    0 keeps none), evicting the least recently used at once; -> the previous limit."""
    nbytes = parse_bytes(limit, "the cache pool limit") if isinstance(limit, str) else limit
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
        raise ValueError(f"the cache pool limit must be a non-negative number of bytes, got {limit!r}")
    return POOL.set_limit(nbytes)


def cache_pool_limit() -> int:
    """The bytes of idle static caches the pool may keep."""
    return POOL.limit


def pooled_bytes(model=None) -> int:
    """Bytes of idle static caches kept now (for ``model`` only, if given)."""
    return POOL.held(model)


def release_caches(model=None) -> int:
    """Drop the idle static caches kept for ``model`` (every model's if None), e.g. when a process
    is done with a model but keeps it; -> the bytes released. Caches in use are not touched."""
    return POOL.clear(model)

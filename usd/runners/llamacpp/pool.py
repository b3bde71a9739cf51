"""A model's llama.cpp contexts (KV caches), shared by its decoding contexts: one, and one more for each generation
that runs while all the others are busy (the server's slots), up to `max_caches`. A forward borrows one for itself:
its own if free, a new one when every cache is busy, else the free one that is cheapest to reuse, so a conversation
is not displaced by another while a cache of its own is to be had."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from .cache import CacheUser, LlamaCache, common_prefix

MAX_CACHES = 4
"""The most llama.cpp contexts (KV caches, n_ctx positions each) a model opens for generations running at once."""


class CachePool:
    def __init__(self, new_cache: Callable[[], LlamaCache], n_threads: int, max_caches: int = MAX_CACHES):
        self.new_cache = new_cache
        self.n_threads = n_threads
        self.caches = [new_cache()]
        """The first for everything done one at a time, more for generations at once."""
        self.max_caches = max_caches
        self.lock = threading.Condition(threading.RLock())
        """Guards which generation uses which cache; a cache's user decodes without it."""

    @contextlib.contextmanager
    def borrow(self, user: CacheUser) -> Iterator[LlamaCache]:
        """A cache for `user`'s forward, for it alone (`_pick`). Generations at once share the cores (llama.cpp's bits
        do not depend on the thread count: tests/test_llamacpp.py)."""
        with self.lock:
            while (cache := self._pick(user)) is None:
                self.lock.wait()
            cache.busy = True
            cache.set_threads(max(1, self.n_threads // sum(c.busy for c in self.caches)))
        try:
            yield cache
        finally:
            with self.lock:
                cache.busy = False
                self.lock.notify_all()

    def _pick(self, user: CacheUser) -> LlamaCache | None:
        """`user`'s own cache if free; a new one if none is free and there is room; else the free one that costs
        least: what it lacks of `user`'s ids, plus what it holds that they do not share (another conversation's
        positions, which it would have to re-feed). None: wait."""
        free = [c for c in self.caches if not c.busy]
        mine = next((c for c in free if c.owner is user), None)
        if mine is not None:
            return mine
        if not free and len(self.caches) < self.max_caches:
            try:
                self.caches.append(self.new_cache())
                return self.caches[-1]
            except RuntimeError:  # no memory for another: the generations take turns on those there are
                self.max_caches = len(self.caches)
        return max(free, key=lambda c: 2 * common_prefix(user.ids, c.kv, len(c.kv)) - len(c.kv), default=None)

    def release_rows(self, user: CacheUser, n: int) -> None:
        """Drop what `user`'s cache holds past n positions now, if the cache is still its own and free (else it is
        done at the next forward that claims the cache)."""
        with self.lock:
            cache = user.cache
            if cache is not None and cache.owner is user and not cache.busy:
                cache.keep_first(n)

    def forget(self) -> None:
        """Empty the caches: the next context computes everything afresh, with the bits it would get anyway.
        (Between generations: measurements, `usd bench`.)"""
        with self.lock:
            for cache in self.caches:
                cache.owner = None
                cache.keep_first(0)

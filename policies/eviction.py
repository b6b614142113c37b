"""Eviction policies: pick victims, never remove them (style.md, libCacheSim's ``to_evict``).

The cache (:class:`simulator.cache.ExpertCache`) owns the miss -> evict -> insert loop. It
tells the policy about inserts, uses and removals, and asks for ``candidates()``: every
cached key, most evictable first. The cache skips pinned keys (experts of the current layer
and transfers in flight) and evicts only when enough can be freed; otherwise it changes
nothing and reports that it could not make room.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, ClassVar

from policies.registry import NoParams, PolicyContext, Registry


class EvictionPolicy(ABC):
    """Base class: observes cache events, orders keys for eviction."""

    name: ClassVar[str]
    Params: ClassVar[type[Any]] = NoParams

    def __init__(self, params: Any, ctx: PolicyContext) -> None:
        self.params = params
        self.ctx = ctx

    @abstractmethod
    def on_insert(self, key: int, demand: bool) -> None:
        """``key`` entered the cache (its transfer was issued). ``demand=True``: a miss fetched
        for immediate use, which also counts as a use (no separate :meth:`on_access`)."""

    @abstractmethod
    def on_access(self, key: int) -> None:
        """``key`` was used by a forward pass (a hit, or a late prefetch)."""

    @abstractmethod
    def on_remove(self, key: int) -> None:
        """``key`` left the cache."""

    @abstractmethod
    def candidates(self) -> Iterator[int]:
        """Every cached key, most evictable first (the cache filters pinned keys)."""


REGISTRY: Registry[EvictionPolicy] = Registry("eviction")


@REGISTRY.register("lru")
class LRU(EvictionPolicy):
    """Least recently used: evict the expert whose last use is oldest.

    An inserted expert counts as used at insertion (a demand fetch is used at once), as in
    libCacheSim's LRU, so miss counts match it on the same access stream.
    """

    def __init__(self, params: Any, ctx: PolicyContext) -> None:
        super().__init__(params, ctx)
        self._order: OrderedDict[int, None] = OrderedDict()

    def on_insert(self, key: int, demand: bool) -> None:
        self._order[key] = None

    def on_access(self, key: int) -> None:
        self._order.move_to_end(key)

    def on_remove(self, key: int) -> None:
        del self._order[key]

    def candidates(self) -> Iterator[int]:
        return iter(self._order)

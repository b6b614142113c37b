"""S3-FIFO eviction (Yang et al., SOSP 2023), as libCacheSim defines it (``cache/eviction/S3FIFO.c``).

Three FIFO queues: a small one (10% of the capacity) where new entries start, a main one (the
rest), and a ghost queue (90% of the capacity) remembering the entries evicted from the small
one. Each entry counts its hits. Eviction takes from the main queue when it is over its size or
the small queue is empty, else from the small one: there, the oldest entry moves to the main
queue if it was hit at least twice, else it is evicted and remembered in the ghost queue; in the
main queue, the oldest entry is kept (moved to the head, its count lowered: min(count, 3) - 1)
if it was hit, else evicted. A miss on an entry the ghost queue remembers enters the main queue;
until the cache first makes room, a new entry that finds the small queue full enters the main
one (libCacheSim's version of 2024-12-04, which its Python package builds).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

from moesim.policies.eviction.base import REGISTRY, EvictionPolicy
from moesim.policies.registry import PolicyContext


@dataclass(frozen=True)
class S3FIFOParams:
    """Parameters of S3-FIFO eviction (libCacheSim's defaults)."""

    small_ratio: float = field(default=0.10, metadata={
        "help": "the small queue's share of the capacity, in (0, 1)"})
    ghost_ratio: float = field(default=0.90, metadata={
        "help": "the ghost queue's size as a share of the capacity, >= 0"})
    move_to_main: int = field(default=2, metadata={
        "help": "hits an entry of the small queue needs to move to the main queue, >= 1"})

    def __post_init__(self) -> None:
        if not 0 < self.small_ratio < 1:
            raise ValueError(f"small_ratio must be in (0, 1), got {self.small_ratio}")
        if self.ghost_ratio < 0:
            raise ValueError(f"ghost_ratio must be >= 0, got {self.ghost_ratio}")
        if self.move_to_main < 1:
            raise ValueError(f"move_to_main must be >= 1, got {self.move_to_main}")


def queue_sizes(capacity: float, params: S3FIFOParams) -> tuple[int, int, int]:
    """The small, main and ghost queues' sizes, in experts, of a cache of ``capacity`` experts
    (libCacheSim truncates the shares to whole units: ``(int64_t)(size * ratio)``)."""
    whole = int(capacity) if math.isfinite(capacity) else 1 << 62
    small = int(whole * params.small_ratio)
    return small, whole - small, int(whole * params.ghost_ratio)


@REGISTRY.register("s3-fifo")
class S3FIFO(EvictionPolicy):
    """S3-FIFO (libCacheSim's ``S3FIFO``): new entries in a small FIFO queue (10% of the
    capacity), those hit twice there kept in a main FIFO queue, the evicted ones remembered in a
    ghost queue (the module's docstring has the rules). Sizes count experts at the scenario's precision (an entry at another precision
    counts its bytes over that expert's); the queues' sizes are libCacheSim's whole shares of
    the capacity. libCacheSim's small queue admits only entries smaller than itself, so below
    20 experts (a small queue of one) it caches nothing new but ghost hits; here the small
    queue takes an entry of its size.

    Entries the cache may not evict (pinned, in flight) keep their place: the walk passes over
    them (a small-queue entry hit often enough still moves to the main queue, a main-queue entry
    hit still has its count lowered). A prefetch admission enters the small queue (and is
    forgotten by the ghost queue); a prefetcher's selection is not a hit. Statically pinned
    experts are in no queue."""

    Params = S3FIFOParams
    keeps_static = False

    def __init__(self, params: S3FIFOParams, ctx: PolicyContext) -> None:
        super().__init__(params, ctx)
        cap = ctx.capacity_bytes / ctx.expert_bytes if math.isfinite(ctx.capacity_bytes) else math.inf
        self._small_size, self._main_size, self._ghost_size = queue_sizes(cap, params)
        self._small: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._main: OrderedDict[int, None] = OrderedDict()
        self._ghost: OrderedDict[int, float] = OrderedDict()  # key -> its size
        self._freq: dict[int, int] = {}
        self._small_used = self._main_used = self._ghost_used = 0.0
        self._ghost_hit: int | None = None  # the key whose miss the ghost queue remembered
        self._has_evicted = False  # whether room was ever made (until then a full small queue fills the main one)

    def _size(self, key: int) -> float:
        ctx = self.ctx
        return ctx.precision_bytes[ctx.precision_of(key)] / ctx.expert_bytes if ctx.precision_bytes else 1.0

    def on_miss(self, key: int) -> None:
        self._ghost_hit = None
        if key in self._ghost:
            self._ghost_used -= self._ghost.pop(key)
            self._ghost_hit = key

    def on_insert(self, key: int, demand: bool) -> None:
        if key in self.ctx.static_keys:
            return
        size = self._size(key)
        if demand and self._ghost_hit == key:
            self._main[key] = None
            self._main_used += size
        else:
            if key in self._ghost:  # a prefetch of a remembered entry: forgotten
                self._ghost_used -= self._ghost.pop(key)
            if not self._has_evicted and self._small_used >= self._small_size:
                self._main[key] = None  # filling up: once the small queue is full, the main one
                self._main_used += size
            else:
                self._small[key] = None
                self._small_used += size
        self._ghost_hit = None
        self._freq[key] = 0

    def on_access(self, key: int) -> None:
        if key in self._freq:
            self._freq[key] += 1

    def _remember(self, key: int) -> None:
        """The ghost queue remembers ``key`` (libCacheSim's ``ghost->get``: a FIFO cache)."""
        size = self._size(key)
        if key in self._ghost or size > self._ghost_size:
            return
        while self._ghost and self._ghost_used + size > self._ghost_size:
            self._ghost_used -= self._ghost.popitem(last=False)[1]
        self._ghost[key] = size
        self._ghost_used += size

    def _leave(self, key: int) -> bool:
        """Take ``key`` out of its queue; whether it was in the small one."""
        del self._freq[key]
        size = self._size(key)
        if key in self._small:
            del self._small[key]
            self._small_used -= size
            return True
        del self._main[key]
        self._main_used -= size
        return False

    def on_remove(self, key: int) -> None:
        if key in self._freq and self._leave(key) and self._ghost_size > 0:
            self._remember(key)

    def on_withdraw(self, key: int) -> None:
        if key in self._freq:
            self._leave(key)

    def candidates(self) -> Iterator[int]:
        """libCacheSim's eviction as a walk: from the main queue when it is over its size or the
        small queue is empty, else from the small queue (its entries hit often enough moving to
        the main queue as they are reached, the others offered), then from the main queue (its
        entries that were hit moved to its head with a lower count, the others offered); the
        other queue last, when every entry of the first was held back."""
        self._has_evicted = True
        if self._main_used > self._main_size or self._small_used == 0:
            yield from self._walk_main()
            yield from self._walk_small()  # only when every main-queue entry was held back
        else:
            yield from self._walk_small()
            yield from self._walk_main()

    def _walk_small(self) -> Iterator[int]:
        for key in list(self._small):
            if self._freq[key] >= self.params.move_to_main:
                size = self._size(key)
                del self._small[key]
                self._small_used -= size
                self._main[key] = None
                self._main_used += size
                self._freq[key] = 0
            else:
                yield key

    def _walk_main(self) -> Iterator[int]:
        offered: set[int] = set()
        while len(offered) < len(self._main):
            key = next(k for k in self._main if k not in offered)
            freq = self._freq[key]
            if freq >= 1:
                self._main.move_to_end(key)
                self._freq[key] = min(freq, 3) - 1
            else:
                offered.add(key)
                yield key

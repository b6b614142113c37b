"""SIEVE eviction (Zhang et al., NSDI 2024), as libCacheSim defines it (``cache/eviction/Sieve.c``).

One queue, newest at its head. A hit marks the entry visited; an insert enters unvisited at the
head. The hand starts at the tail (the oldest entry) and moves toward the head, wrapping to the
tail: a visited entry it passes is unmarked and kept, the first unvisited one is the victim.
After an eviction the hand rests on the victim's newer neighbour (none: the tail next time).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from moesim.policies.eviction.base import REGISTRY, EvictionPolicy
from moesim.policies.registry import PolicyContext


@REGISTRY.register("sieve")
class Sieve(EvictionPolicy):
    """SIEVE (libCacheSim's ``Sieve``): a FIFO queue with a visited bit per entry and a hand
    that sweeps from the oldest entry to the newest, unmarking visited entries and evicting the
    first unvisited one; entries stay where they were inserted (a hit only sets the bit).

    Entries the cache may not evict (pinned, in flight) are passed over where they are, as
    their bits would be read: the hand unmarks a visited one and goes on past an unvisited one.
    A prefetch admission inserts unvisited, as a miss does; a prefetcher's selection of a
    cached expert is not a use. Statically pinned experts are not in the queue."""

    keeps_static = False

    def __init__(self, params: Any, ctx: PolicyContext) -> None:
        super().__init__(params, ctx)
        self._newer: dict[int, int | None] = {}  # key -> its neighbour toward the head
        self._older: dict[int, int | None] = {}  # key -> its neighbour toward the tail
        self._visited: dict[int, bool] = {}
        self._head: int | None = None
        self._tail: int | None = None
        self._hand: int | None = None

    def on_insert(self, key: int, demand: bool) -> None:
        if key in self.ctx.static_keys:
            return
        self._older[key] = self._head
        self._newer[key] = None
        if self._head is not None:
            self._newer[self._head] = key
        else:
            self._tail = key
        self._head = key
        self._visited[key] = False

    def on_access(self, key: int) -> None:
        if key in self._visited:
            self._visited[key] = True

    def on_remove(self, key: int) -> None:
        if key not in self._visited:
            return
        newer, older = self._newer.pop(key), self._older.pop(key)
        del self._visited[key]
        if self._hand == key:
            self._hand = newer
        if newer is None:
            self._head = older
        else:
            self._older[newer] = older
        if older is None:
            self._tail = newer
        else:
            self._newer[older] = newer

    def candidates(self) -> Iterator[int]:
        """The hand's sweep: visited entries are unmarked as it passes them, unvisited ones are
        offered in the order it reaches them, each once; it ends when every entry has been
        offered (within two turns: the first unmarks every visited entry)."""
        offered: set[int] = set()
        key = self._hand if self._hand is not None else self._tail
        while len(offered) < len(self._visited):
            assert key is not None
            self._hand = key  # where the hand stands (an eviction moves it on: on_remove)
            if self._visited[key]:
                self._visited[key] = False
            elif key not in offered:
                offered.add(key)
                yield key
            nxt = self._newer[key]
            key = nxt if nxt is not None else self._tail

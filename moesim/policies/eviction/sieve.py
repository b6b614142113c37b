"""SIEVE eviction (Zhang et al., NSDI 2024), as libCacheSim defines it (``cache/eviction/Sieve.c``).

One queue, newest at its head. A hit marks the entry visited; an insert enters unvisited at the
head. The hand starts at the tail (the oldest entry) and moves toward the head, wrapping to the
tail: a visited entry it passes is unmarked and kept, the first unvisited one is the victim.
After an eviction the hand rests on the victim's newer neighbour (none: the tail next time).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from moesim.jit import ir_inline
from moesim.kernel_state import evictable
from moesim.policies.eviction.base import (
    NEXT,
    REGISTRY,
    EvictionPolicy,
    KernelForm,
    list_append,
    list_unlink,
    new_state,
)
from moesim.policies.registry import PolicyContext

# -- the compiled form (Sieve, below, is the reference) --------------------------------------------
VISITED, OFFERED = 2, 3  # I2: the links (toward the newest: NEXT), the visited bit, the walk that offered it
HAND, GEN, COUNT, WALKED = 2, 3, 4, 5  # I1: the queue's oldest and newest (0, 1), the hand, the walk, entries, offered


@ir_inline
def _insert(key: int, demand: bool, ai: int, S: Any, IS: np.ndarray, K: Any, DI: np.ndarray, A: Any) -> None:
    list_append(key, 0, S[2], S[0])
    S[0][key, VISITED] = 0
    S[2][COUNT] += 1


@ir_inline
def _access(key: int, ai: int, S: Any, IS: np.ndarray, K: Any, DI: np.ndarray, A: Any) -> None:
    S[0][key, VISITED] = 1


@ir_inline
def _remove(key: int, evicted: int, S: Any, IS: np.ndarray, K: Any, A: Any) -> None:
    N, L = S[0], S[2]
    if L[HAND] == key:
        L[HAND] = N[key, NEXT]
    list_unlink(key, 0, L, N)
    N[key, VISITED] = 0
    L[COUNT] -= 1


@ir_inline
def _victim(for_prefetch: bool, pin_gen: int, adm_layer: int, again: int, S: Any, IS: np.ndarray, K: Any,
            A: Any) -> int:
    """The hand's sweep (:meth:`Sieve.candidates`): visited entries unmarked as it passes,
    unvisited ones offered once each, the first the cache may evict taken; a walk continued
    (``again``) goes on from where it stopped."""
    N, L = S[0], S[2]
    if not again:
        L[GEN] += 1
        L[WALKED] = 0
    gen = L[GEN]
    key = L[HAND] if L[HAND] != -1 else L[0]
    while L[WALKED] < L[COUNT]:
        L[HAND] = key
        if N[key, VISITED]:
            N[key, VISITED] = 0
        elif N[key, OFFERED] != gen:
            N[key, OFFERED] = gen
            L[WALKED] += 1
            if evictable(key, pin_gen, adm_layer, IS, K):
                return key
        key = N[key, NEXT] if N[key, NEXT] != -1 else L[0]
    return -1


class SieveQueue(KernelForm):
    """SIEVE's compiled form: one list, oldest first (the reference's tail at its head), the
    visited bits and the hand. Statically pinned experts are never in it."""

    keeps_static = False
    rare = True
    insert = staticmethod(_insert)
    access = staticmethod(_access)
    remove = staticmethod(_remove)
    victim = staticmethod(_victim)

    @classmethod
    def state(cls, policy: Any, num_keys: int) -> tuple[np.ndarray, ...]:
        I2, F2, I1, F1, P = new_state(num_keys, i2=4, i1=6)
        I2[:, VISITED] = 0
        I1[GEN] = I1[COUNT] = I1[WALKED] = 0
        return I2, F2, I1, F1, P


@REGISTRY.register("sieve")
class Sieve(EvictionPolicy):
    """SIEVE (libCacheSim's ``Sieve``): a FIFO queue with a visited bit per entry and a hand
    that sweeps from the oldest entry to the newest, unmarking visited entries and evicting the
    first unvisited one; entries stay where they were inserted (a hit only sets the bit).

    Entries the cache may not evict (pinned, in flight) are passed over where they are, as
    their bits would be read: the hand unmarks a visited one and goes on past an unvisited one.
    A prefetch admission inserts unvisited, as a miss does; a prefetcher's selection of a
    cached expert is not a use. Statically pinned experts are not in the queue. The kernel runs
    :class:`SieveQueue`."""


    form = SieveQueue

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

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
from typing import Any

import numpy as np

from moesim.jit import ir_inline
from moesim.kernel_state import entry_size, evictable, expert_size
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


# -- the compiled form (S3FIFO, below, is the reference) --------------------------------------------
FREQ, WHERE, OFFERED = 2, 3, 4  # I2: the links, the hit count, the queue (NONE ... GHOST), the walk that offered it
NONE, SMALL, MAIN, GHOST = 0, 1, 2, 3
# I1: each queue's oldest and newest (small 0-1, main 2-3, ghost 4-5), then
HAS_EVICTED, GHOST_HIT, STAGE, MAIN_FIRST, CURSOR, GEN, MAIN_WALKED, MAIN_N, THRESHOLD = range(6, 15)
# F1: the queues' use and sizes, in experts
SMALL_USED, MAIN_USED, GHOST_USED, SMALL_SIZE, MAIN_SIZE, GHOST_SIZE = range(6)


@ir_inline
def _size(key: int, IS: np.ndarray) -> float:
    return entry_size(key, IS) / expert_size(IS)


@ir_inline
def _enter(key: int, queue: int, S: Any, IS: np.ndarray) -> None:
    """``key`` joins the newest end of ``queue`` (small, main or ghost)."""
    N, L, F = S[0], S[2], S[3]
    list_append(key, 2 * (queue - 1), L, N)
    N[key, WHERE] = queue
    F[queue - 1] += _size(key, IS)  # SMALL_USED, MAIN_USED, GHOST_USED follow the queues' order
    if queue == MAIN:
        L[MAIN_N] += 1


@ir_inline
def _leave(key: int, S: Any, IS: np.ndarray) -> int:
    """``key`` leaves its queue; returns which it was."""
    N, L, F = S[0], S[2], S[3]
    queue = N[key, WHERE]
    list_unlink(key, 2 * (queue - 1), L, N)
    N[key, WHERE] = NONE
    F[queue - 1] -= _size(key, IS)
    if queue == MAIN:
        L[MAIN_N] -= 1
    return queue


@ir_inline
def _miss(key: int, S: Any, IS: np.ndarray, K: Any, A: Any) -> None:
    L = S[2]
    L[GHOST_HIT] = -1
    if S[0][key, WHERE] == GHOST:
        _leave(key, S, IS)
        L[GHOST_HIT] = key


@ir_inline
def _insert(key: int, demand: bool, ai: int, S: Any, IS: np.ndarray, K: Any, DI: np.ndarray, A: Any) -> None:
    N, L, F = S[0], S[2], S[3]
    if demand and L[GHOST_HIT] == key:
        _enter(key, MAIN, S, IS)
    else:
        if N[key, WHERE] == GHOST:  # a prefetch of a remembered entry: forgotten
            _leave(key, S, IS)
        if not L[HAS_EVICTED] and F[SMALL_USED] >= F[SMALL_SIZE]:
            _enter(key, MAIN, S, IS)
        else:
            _enter(key, SMALL, S, IS)
    L[GHOST_HIT] = -1
    N[key, FREQ] = 0


@ir_inline
def _access(key: int, ai: int, S: Any, IS: np.ndarray, K: Any, DI: np.ndarray, A: Any) -> None:
    if S[0][key, WHERE] != NONE:
        S[0][key, FREQ] += 1


@ir_inline
def _remember(key: int, S: Any, IS: np.ndarray) -> None:
    """The ghost queue remembers ``key`` (a FIFO of ``GHOST_SIZE``)."""
    L, F = S[2], S[3]
    size = _size(key, IS)
    if size > F[GHOST_SIZE]:
        return
    while L[4] != -1 and F[GHOST_USED] + size > F[GHOST_SIZE]:
        _leave(L[4], S, IS)
    _enter(key, GHOST, S, IS)


@ir_inline
def _remove(key: int, evicted: int, S: Any, IS: np.ndarray, K: Any, A: Any) -> None:
    N = S[0]
    if N[key, WHERE] == NONE:
        return
    queue = _leave(key, S, IS)
    N[key, FREQ] = 0
    if evicted and queue == SMALL and S[3][GHOST_SIZE] > 0:
        _remember(key, S, IS)


@ir_inline
def _small_step(pin_gen: int, adm_layer: int, S: Any, IS: np.ndarray, K: Any) -> int:
    """The small queue's walk from ``CURSOR``: an entry hit often enough moves to the main queue,
    the others are offered; the first the cache may evict, or -1 at the queue's end."""
    N, L = S[0], S[2]
    key = L[CURSOR]
    while key != -1:
        nxt = N[key, NEXT]
        if N[key, FREQ] >= L[THRESHOLD]:
            _leave(key, S, IS)
            _enter(key, MAIN, S, IS)
            N[key, FREQ] = 0
        elif evictable(key, pin_gen, adm_layer, IS, K):
            L[CURSOR] = nxt
            return key
        key = nxt
    L[CURSOR] = -1
    return -1


@ir_inline
def _main_step(pin_gen: int, adm_layer: int, S: Any, IS: np.ndarray, K: Any) -> int:
    """The main queue's walk: its oldest entry not yet offered in this walk is kept (moved to the
    newest end, its count lowered) if it was hit, else offered; the first the cache may evict,
    or -1 once every entry was offered."""
    N, L = S[0], S[2]
    gen = L[GEN]
    while L[MAIN_WALKED] < L[MAIN_N]:
        key = L[2]
        while N[key, OFFERED] == gen:
            key = N[key, NEXT]
        freq = N[key, FREQ]
        if freq >= 1:
            _leave(key, S, IS)
            _enter(key, MAIN, S, IS)
            N[key, FREQ] = min(freq, 3) - 1
        else:
            N[key, OFFERED] = gen
            L[MAIN_WALKED] += 1
            if evictable(key, pin_gen, adm_layer, IS, K):
                return key
    return -1


@ir_inline
def _victim(for_prefetch: bool, pin_gen: int, adm_layer: int, again: int, S: Any, IS: np.ndarray, K: Any,
            A: Any) -> int:
    """libCacheSim's eviction as a walk (:meth:`S3FIFO.candidates`): the main queue first when
    it is over its size or the small queue is empty, else the small queue; then the other. A walk
    continued (``again``) goes on where it stopped."""
    L, F = S[2], S[3]
    if not again:
        L[HAS_EVICTED] = 1
        L[MAIN_FIRST] = F[MAIN_USED] > F[MAIN_SIZE] or F[SMALL_USED] == 0
        L[STAGE] = 0
        L[CURSOR] = L[0]
        L[GEN] += 1
        L[MAIN_WALKED] = 0
    while L[STAGE] < 2:
        on_main = L[MAIN_FIRST] if L[STAGE] == 0 else not L[MAIN_FIRST]
        v = _main_step(pin_gen, adm_layer, S, IS, K) if on_main else _small_step(pin_gen, adm_layer, S, IS, K)
        if v != -1:
            return v
        L[STAGE] += 1
        L[CURSOR] = L[0]  # the small queue's walk, second, starts at its oldest as it is then
    return -1


class ThreeQueues(KernelForm):
    """S3-FIFO's compiled form: the small, main and ghost queues as lists, oldest first, each
    entry's hit count and queue. Statically pinned experts are in no queue."""

    keeps_static = False
    rare = True
    miss = staticmethod(_miss)
    insert = staticmethod(_insert)
    access = staticmethod(_access)
    remove = staticmethod(_remove)
    victim = staticmethod(_victim)

    @classmethod
    def state(cls, policy: Any, num_keys: int) -> tuple[np.ndarray, ...]:
        ctx = policy.ctx
        cap = ctx.capacity_bytes / ctx.expert_bytes if math.isfinite(ctx.capacity_bytes) else math.inf
        I2, F2, I1, F1, P = new_state(num_keys, i2=5, i1=THRESHOLD + 1, f1=GHOST_SIZE + 1)
        I2[:, FREQ] = I2[:, WHERE] = I2[:, OFFERED] = 0
        I1[HAS_EVICTED] = I1[GEN] = I1[MAIN_WALKED] = I1[MAIN_N] = I1[STAGE] = I1[MAIN_FIRST] = 0
        I1[THRESHOLD] = policy.params.move_to_main
        F1[SMALL_SIZE:GHOST_SIZE + 1] = queue_sizes(cap, policy.params)
        return I2, F2, I1, F1, P


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
    experts are in no queue. The kernel runs :class:`ThreeQueues`."""

    Params = S3FIFOParams
    form = ThreeQueues

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

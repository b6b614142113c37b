"""Belady's MIN eviction and its compiled form (next uses from the trace)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from moesim.jit import inline, kernel
from moesim.kernel_state import access_key, evictable, layer_accesses
from moesim.policies.eviction.base import (
    REGISTRY,
    EvictionPolicy,
    KernelForm,
    _access_index,
    new_state,
)
from moesim.policies.registry import PolicyContext

STAMP, MEMB = 0, 1  # I2: the tick of the key's insert, its place among the members
NEXTUSE = 0  # F2
TICK, COUNT, MEMBERS = 0, 1, 2  # I1: the insert counter, the members' count, the members
ABASE, KPOSOFF = 0, 1  # P: the piece's first access, each key's access offsets, first accesses after, accesses


@inline
def next_use(pos: np.ndarray, a: int, b: int, i: int, base: int, after: int) -> float:
    """The first access after access ``i`` of a key whose accesses in the piece being replayed
    are ``pos[a:b]`` (sorted, counted from the piece's start, ``base`` over the whole trace), or
    past them its first access after the piece, ``after`` (-1: none, ``inf``)."""
    end = b
    while a < b:  # the first position > i (searchsorted right)
        m = (a + b) >> 1
        if pos[m] <= i:
            a = m + 1
        else:
            b = m
    if a == end:
        return math.inf if after < 0 else float(after)
    return float(base + pos[a])


@kernel
def _next_use(key: int, ai: int, S: Any, IS: np.ndarray, DI: np.ndarray, A: Any) -> float:
    """The next access of ``key`` after the current one (``ai``, or the current (pass, layer)'s
    access of it, or just before the layer), as a float (inf: none). Indices count the whole
    trace's accesses: a piece's own are ``P[ABASE]`` on, and a key with none left in the piece
    has its first one after the piece (-1: none)."""
    P = S[4]
    n = S[0].shape[0]
    a, b = P[KPOSOFF + key], P[KPOSOFF + key + 1]
    i = ai
    if i < 0 and a < b:
        lo, hi = layer_accesses(IS, DI)
        i = lo - 1
        for j in range(lo, hi):
            if access_key(j, IS, A) == key:
                i = j
                break
    kpos = KPOSOFF + 2 * n + 1
    return next_use(P, kpos + a, kpos + b, i, P[ABASE], P[KPOSOFF + n + 1 + key])


@inline
def _insert(key: int, demand: bool, ai: int, S: Any, IS: np.ndarray, K: Any, DI: np.ndarray, A: Any) -> None:
    I2, I1 = S[0], S[2]
    n = I1[COUNT]
    I1[MEMBERS + n] = key
    I2[key, MEMB] = n
    I1[COUNT] = n + 1
    I1[TICK] += 1
    I2[key, STAMP] = I1[TICK]
    S[1][key, NEXTUSE] = _next_use(key, ai, S, IS, DI, A)


@inline
def _access(key: int, ai: int, S: Any, IS: np.ndarray, K: Any, DI: np.ndarray, A: Any) -> None:
    S[1][key, NEXTUSE] = _next_use(key, ai, S, IS, DI, A)


@inline
def _remove(key: int, evicted: int, S: Any, IS: np.ndarray, K: Any, A: Any) -> None:
    I2, I1 = S[0], S[2]
    i = I2[key, MEMB]
    last = I1[MEMBERS + I1[COUNT] - 1]
    I1[MEMBERS + i] = last
    I2[last, MEMB] = i
    I1[COUNT] -= 1
    I2[key, MEMB] = -1


@kernel
def _victim(for_prefetch: bool, pin_gen: int, adm_layer: int, again: int, S: Any, IS: np.ndarray, K: Any,
            A: Any) -> int:
    """The member the cache may evict whose next use is farthest, ties to the oldest stamp."""
    I2, F2, I1 = S[0], S[1], S[2]
    best, bf, bs = -1, 0.0, 0
    for j in range(I1[COUNT]):
        key = I1[MEMBERS + j]
        if not evictable(key, pin_gen, adm_layer, IS, K):
            continue
        f, st = -F2[key, NEXTUSE], I2[key, STAMP]
        if best == -1 or f < bf or (f == bf and st < bs):
            best, bf, bs = key, f, st
    return best


class FutureUses(KernelForm):
    """Belady's compiled form: at each insert and use a key's next use is set from the piece's
    sorted access indices of that key (``P``, made for each piece: :meth:`piece`), and its victim
    is the member of lowest priority, minus its next use, ties to the oldest insert (as
    :class:`Belady` sorts, stably, by next use, farthest first)."""

    pure_victim = True
    insert = staticmethod(_insert)
    access = staticmethod(_access)
    remove = staticmethod(_remove)
    victim = staticmethod(_victim)

    @classmethod
    def state(cls, policy: Any, num_keys: int) -> tuple[np.ndarray, ...]:
        I2, F2, I1, F1, P = new_state(num_keys, i2=2, f2=1, i1=MEMBERS + num_keys)
        I1[TICK] = I1[COUNT] = 0
        return I2, F2, I1, F1, P

    @classmethod
    def piece(cls, policy: Any, S: tuple[np.ndarray, ...], wl: Any, after: Any,
              num_keys: int) -> tuple[np.ndarray, ...]:
        """``P``: the piece's first access (over the whole trace), each key's access offsets
        (CSR), its first access after the piece (-1: none) and the accesses, ascending."""
        ctx = policy.ctx
        first, later = after if after is not None else (0, np.full(num_keys, -1, np.int64))
        keys = wl.cache_keys(len(ctx.precisions), ctx.default_precision)
        order = np.argsort(keys, kind="stable").astype(np.int64)
        counts = np.bincount(keys, minlength=num_keys)
        P = np.zeros(1 + (num_keys + 1) + num_keys + len(order), np.int64)
        P[ABASE] = first
        np.cumsum(counts, out=P[KPOSOFF + 1:KPOSOFF + num_keys + 1])
        P[KPOSOFF + num_keys + 1:KPOSOFF + 2 * num_keys + 1] = later
        P[KPOSOFF + 2 * num_keys + 1:] = order
        return S[0], S[1], S[2], S[3], P


@REGISTRY.register("belady")
class Belady(EvictionPolicy):
    """Belady's MIN: evict the expert whose next use is furthest in the future (never used
    again first), read from the trace. The fewest misses any eviction policy makes under the
    same pinning rules wherever each (pass, layer) routes to no more experts than the cache
    holds; the bound compare and sweeps draw. A layer routed to more (a long prefill at a small
    capacity) streams its last misses uncached, and there evicting by next use alone can miss
    more than another policy (``tests/test_eviction.py`` has such a trace). The kernel runs
    :class:`FutureUses`."""

    form = FutureUses
    reads_future = True

    def __init__(self, params: Any, ctx: PolicyContext) -> None:
        super().__init__(params, ctx)
        if ctx.workload is None:
            raise ValueError("belady needs the workload to read future accesses")
        self._wl: Any = None  # the workload the positions below are of
        self._next: dict[int, float] = {}

    def _read(self) -> None:
        """The accesses of the workload being replayed, each key's positions among them, and
        what comes after it: the whole trace, nothing; serving, a pass at a time, each key's
        first access after the pass (``PolicyContext.piece_future``), positions counted over the
        run as the compiled form counts them."""
        ctx = self.ctx
        self._wl = ctx.workload
        keys = ctx.cache_keys(ctx.workload.keys())
        self._keys = keys.tolist()
        order = np.argsort(keys, kind="stable")
        sk = keys[order]
        starts = np.flatnonzero(np.r_[True, sk[1:] != sk[:-1]])
        ends = np.r_[starts[1:], len(sk)]
        self._positions = {int(sk[s]): order[s:e] for s, e in zip(starts, ends, strict=True)}
        self._base, self._later = 0, None
        if ctx.piece_future is not None:
            n_keys = ctx.num_layers * ctx.num_experts * len(ctx.precisions)
            self._base, self._later = ctx.piece_future(ctx.workload, len(ctx.precisions), ctx.default_precision,
                                                       n_keys)

    def _next_use(self, key: int) -> float:
        ctx = self.ctx
        if ctx.workload is not self._wl:
            self._read()
        pos = self._positions.get(key)
        if pos is not None:
            i = _access_index(ctx, self._keys, key)
            if i is None:
                i = int(ctx.workload.off[(ctx.clock.pass_index - ctx.clock.pass_base) * ctx.num_layers
                                         + ctx.clock.layer]) - 1
            j = int(np.searchsorted(pos, i, side="right"))
            if j < len(pos):
                return float(self._base + pos[j])
        later = -1 if self._later is None else int(self._later[key])
        return float("inf") if later < 0 else float(later)

    def on_insert(self, key: int, demand: bool) -> None:
        self._next[key] = self._next_use(key)

    def on_access(self, key: int) -> None:
        self._next[key] = self._next_use(key)

    def on_remove(self, key: int) -> None:
        del self._next[key]

    def candidates(self) -> Iterator[int]:
        return iter(sorted(self._next, key=lambda k: -self._next[k]))

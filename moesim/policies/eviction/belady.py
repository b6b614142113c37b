"""Belady's MIN eviction and its compiled form (next uses from the trace)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from moesim.jit import inline
from moesim.policies.eviction.base import (
    REGISTRY,
    EvictionPolicy,
    _access_index,
)
from moesim.policies.registry import PolicyContext


class FutureUses:
    """Belady's compiled form: at each insert and use the kernel sets a key's next use with
    :meth:`next_use` (over the kernel's sorted access indices of that key), and its victim is
    the cached key of lowest :meth:`priority`, ties to the oldest stamp (as :class:`Belady`
    sorts, stably, by next use, farthest first)."""

    @staticmethod
    @inline
    def next_use(pos: np.ndarray, a: int, b: int, i: int, base: int, after: int) -> float:
        """The first access after access ``i`` of a key whose accesses in the piece being
        replayed are ``pos[a:b]`` (sorted, counted from the piece's start, ``base`` over the
        whole trace), or past them its first access after the piece, ``after`` (-1: none,
        ``inf``)."""
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

    @staticmethod
    @inline
    def priority(next_use: float) -> float:
        """The farthest next use goes first."""
        return -next_use


@REGISTRY.register("belady")
class Belady(EvictionPolicy):
    """Belady's MIN: evict the expert whose next use is furthest in the future (never used
    again first), read from the trace. The optimal bound every other policy is measured
    against (for the same pinning rules). The kernel runs :class:`FutureUses`."""

    def __init__(self, params: Any, ctx: PolicyContext) -> None:
        super().__init__(params, ctx)
        if ctx.workload is None:
            raise ValueError("belady needs the workload to read future accesses")
        keys = ctx.cache_keys(ctx.workload.keys())
        self._keys = keys.tolist()
        order = np.argsort(keys, kind="stable")
        sk = keys[order]
        starts = np.flatnonzero(np.r_[True, sk[1:] != sk[:-1]])
        ends = np.r_[starts[1:], len(sk)]
        self._positions = {int(sk[s]): order[s:e] for s, e in zip(starts, ends, strict=True)}
        self._next: dict[int, float] = {}

    def _next_use(self, key: int) -> float:
        ctx = self.ctx
        pos = self._positions.get(key)
        if pos is None:
            return float("inf")
        i = _access_index(ctx, self._keys, key)
        if i is None:
            i = int(ctx.workload.off[ctx.clock.pass_index * ctx.num_layers + ctx.clock.layer]) - 1
        j = int(np.searchsorted(pos, i, side="right"))
        return float(pos[j]) if j < len(pos) else float("inf")

    def on_insert(self, key: int, demand: bool) -> None:
        self._next[key] = self._next_use(key)

    def on_access(self, key: int) -> None:
        self._next[key] = self._next_use(key)

    def on_remove(self, key: int) -> None:
        del self._next[key]

    def candidates(self) -> Iterator[int]:
        return iter(sorted(self._next, key=lambda k: -self._next[k]))

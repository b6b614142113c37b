"""Least frequently used eviction and its compiled form (hooks)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import numpy as np

from moesim.policies.eviction.base import (
    REGISTRY,
    CompiledForm,
    EvictionPolicy,
)
from moesim.policies.registry import PolicyContext


class LFUCompiled(CompiledForm):
    """LFU's compiled form (the hook interface of :mod:`moesim.policies.hooks`, which the
    kernel runs): a count per key that survives eviction, raised by every use (a demand insert
    is one); the victim has the lowest count, ties the oldest stamp. Its priority reads only the
    key's own count, so it is kept between victim searches (``stable_priority``)."""

    int_fields = ("count",)
    stable_priority = True

    @staticmethod
    def insert(key: int, demand: bool, weight: float, clock: np.ndarray, si: np.ndarray, sf: np.ndarray) -> None:
        if demand:
            si[key, 0] += 1

    @staticmethod
    def access(key: int, weight: float, clock: np.ndarray, si: np.ndarray, sf: np.ndarray) -> None:
        si[key, 0] += 1

    @staticmethod
    def priority(key: int, clock: np.ndarray, si: np.ndarray, sf: np.ndarray) -> float:
        return float(si[key, 0])


@REGISTRY.register("lfu")
class LFU(EvictionPolicy):
    """Least frequently used (SpecMD appendix B): evict the expert with the lowest access
    count over the whole inference history (counts survive eviction); ties go to the expert
    that reached its count longest ago. The kernel runs :class:`LFUCompiled`."""

    compiled = LFUCompiled

    def __init__(self, params: Any, ctx: PolicyContext) -> None:
        super().__init__(params, ctx)
        self._count: dict[int, int] = {}
        self._buckets: dict[int, OrderedDict[int, None]] = {}
        self._where: dict[int, int] = {}

    def _place(self, key: int, count: int) -> None:
        old = self._where.get(key)
        if old is not None:
            bucket = self._buckets[old]
            del bucket[key]
            if not bucket:
                del self._buckets[old]
        self._buckets.setdefault(count, OrderedDict())[key] = None
        self._where[key] = count

    def _bump(self, key: int) -> None:
        c = self._count.get(key, 0) + 1
        self._count[key] = c
        self._place(key, c)

    def on_insert(self, key: int, demand: bool) -> None:
        if demand:
            self._bump(key)
        else:
            self._place(key, self._count.get(key, 0))

    def on_access(self, key: int) -> None:
        self._bump(key)

    def on_remove(self, key: int) -> None:
        c = self._where.pop(key)
        bucket = self._buckets[c]
        del bucket[key]
        if not bucket:
            del self._buckets[c]

    def candidates(self) -> Iterator[int]:
        for c in sorted(self._buckets):
            yield from list(self._buckets[c])

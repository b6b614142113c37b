"""Least high-precision used eviction and its compiled form (hooks)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from moesim.policies.eviction.base import (
    CLOCK_PRECISIONS,
    REGISTRY,
    CompiledForm,
    RecencyOrdered,
)
from moesim.policies.registry import PolicyContext


class LHUCompiled(CompiledForm):
    """Least high-precision used's compiled form (the hook interface of
    :mod:`moesim.policies.hooks`): a count per key of its uses at the highest precision
    (precision index 0: ``key % clock[CLOCK_PRECISIONS]``), which survives eviction; a
    lower-precision copy has priority 0, a highest-precision one its count plus one, ties the
    oldest stamp. The priority reads only the key, so it is kept."""

    int_fields = ("hp_uses",)
    stable_priority = True

    @staticmethod
    def insert(key: int, demand: bool, weight: float, clock: np.ndarray, si: np.ndarray, sf: np.ndarray) -> None:
        if demand and key % clock[CLOCK_PRECISIONS] == 0:
            si[key, 0] += 1

    @staticmethod
    def access(key: int, weight: float, clock: np.ndarray, si: np.ndarray, sf: np.ndarray) -> None:
        if key % clock[CLOCK_PRECISIONS] == 0:
            si[key, 0] += 1

    @staticmethod
    def priority(key: int, clock: np.ndarray, si: np.ndarray, sf: np.ndarray) -> float:
        return float(si[key, 0] + 1) if key % clock[CLOCK_PRECISIONS] == 0 else 0.0


@REGISTRY.register("lhu")
class LeastHighPrecisionUsed(RecencyOrdered):
    """Least high-precision used (HOBBIT, Tang et al. 2024; SpecMD appendix B): lower-
    precision copies go first (cheap to re-fetch, least recently used first); then
    highest-precision experts by how often they were used at that precision (fewest first,
    ties by least recent use). Pair it with a precision cascade miss policy. The kernel runs
    :class:`LHUCompiled`."""

    compiled = LHUCompiled

    def __init__(self, params: Any, ctx: PolicyContext) -> None:
        super().__init__(params, ctx)
        self._hp_uses: dict[int, int] = {}

    def _use(self, key: int) -> None:
        self._order.move_to_end(key)
        if self.ctx.precision_of(key) == 0:
            self._hp_uses[key] = self._hp_uses.get(key, 0) + 1

    def on_insert(self, key: int, demand: bool) -> None:
        super().on_insert(key, demand)
        if demand:
            self._use(key)

    def on_access(self, key: int) -> None:
        self._use(key)

    def candidates(self) -> Iterator[int]:
        rank = self._recency_rank()
        prec = self.ctx.precision_of
        return iter(sorted(self._order, key=lambda k: (
            prec(k) == 0, self._hp_uses.get(k, 0) if prec(k) == 0 else 0, rank[k])))

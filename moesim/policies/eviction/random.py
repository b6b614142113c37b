"""Random eviction (the SimPy path: it draws from numpy's Generator)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from moesim.policies.eviction.base import (
    REGISTRY,
    EvictionPolicy,
)
from moesim.policies.registry import PolicyContext


@REGISTRY.register("random")
class Random(EvictionPolicy):
    """Evict uniformly at random (the policy's own seeded generator)."""

    def __init__(self, params: Any, ctx: PolicyContext) -> None:
        super().__init__(params, ctx)
        self._keys: dict[int, None] = {}

    def on_insert(self, key: int, demand: bool) -> None:
        self._keys[key] = None

    def on_access(self, key: int) -> None:
        pass

    def on_remove(self, key: int) -> None:
        del self._keys[key]

    def candidates(self) -> Iterator[int]:
        keys = list(self._keys)
        for i in self.ctx.rng.permutation(len(keys)):
            yield keys[int(i)]

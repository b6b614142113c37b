"""Farthest layer distance eviction and its compiled form (hooks)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from moesim.policies.eviction.base import (
    CLOCK_KEYS_PER_LAYER,
    CLOCK_LAYER,
    REGISTRY,
    CompiledForm,
    RecencyOrdered,
)


class FLDCompiled(CompiledForm):
    """Farthest layer distance's compiled form (the hook interface of
    :mod:`moesim.policies.hooks`): the priority is minus the key's distance in layers from the
    clock's layer, ties the oldest stamp (least recent use). It reads the clock, so it is asked
    at every victim search. No state."""

    @staticmethod
    def priority(key: int, clock: np.ndarray, si: np.ndarray, sf: np.ndarray) -> float:
        return -float(abs(key // clock[CLOCK_KEYS_PER_LAYER] - clock[CLOCK_LAYER]))

    @staticmethod
    def priorities(keys: np.ndarray, n: int, out: np.ndarray, clock: np.ndarray, si: np.ndarray,
                   sf: np.ndarray) -> None:
        per, layer = clock[CLOCK_KEYS_PER_LAYER], clock[CLOCK_LAYER]
        for j in range(n):
            out[j] = -float(abs(keys[j] // per - layer))


@REGISTRY.register("fld")
class FarthestLayerDistance(RecencyOrdered):
    """Farthest layer distance (HOBBIT, Tang et al. 2024; SpecMD appendix B): evict experts
    whose layer is farthest, |layer - current layer|, from the layer being executed; ties by
    least recent use. The kernel runs :class:`FLDCompiled`."""

    compiled = FLDCompiled

    def candidates(self) -> Iterator[int]:
        cur = self.ctx.clock.layer
        layer_of = self.ctx.layer_of
        rank = self._recency_rank()
        return iter(sorted(self._order, key=lambda k: (-abs(layer_of(k) - cur), rank[k])))

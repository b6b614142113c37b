"""First-in first-out eviction and its compiled form, an insertion list."""

from __future__ import annotations

from typing import Any

import numpy as np

from moesim.jit import inline
from moesim.policies.eviction.base import REGISTRY, RecencyOrdered
from moesim.policies.eviction.lru import RecencyList


@inline
def _no_reorder(key: int, ai: int, S: Any, IS: np.ndarray, K: Any, DI: np.ndarray, A: Any) -> None:
    pass


class InsertionList(RecencyList):
    """FIFO's compiled form: :class:`RecencyList` whose uses do not reorder."""

    access = staticmethod(_no_reorder)


@REGISTRY.register("fifo")
class FIFO(RecencyOrdered):
    """First in, first out: evict the expert inserted longest ago; uses do not reorder. The
    kernel runs :class:`InsertionList`."""

    form = InsertionList

    def on_access(self, key: int) -> None:
        pass

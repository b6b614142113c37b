"""First-in first-out eviction and its compiled form, an insertion list."""

from __future__ import annotations

from typing import Any

import numpy as np

from moesim.jit import inline
from moesim.policies.eviction.base import (
    REGISTRY,
    RecencyOrdered,
)
from moesim.policies.eviction.lru import RecencyList


class InsertionList(RecencyList):
    """FIFO's compiled form: :class:`RecencyList` whose uses do not reorder."""

    @staticmethod
    @inline
    def access(key: int, p: int, L: np.ndarray, base: int, nl: int, K: Any) -> None:
        pass


@REGISTRY.register("fifo")
class FIFO(RecencyOrdered):
    """First in, first out: evict the expert inserted longest ago; uses do not reorder. The
    kernel runs :class:`InsertionList`."""

    lists = InsertionList

    def on_access(self, key: int) -> None:
        pass

"""Least recently used eviction and its compiled form, a recency list."""

from __future__ import annotations

from typing import Any

import numpy as np

from moesim.jit import inline
from moesim.policies.eviction.base import (
    ANY,
    REGISTRY,
    RecencyOrdered,
    list_append,
    list_unlink,
)


class RecencyList:
    """LRU's compiled form: one list, least recent first; an insert and every use move the key
    to the end (:class:`RecencyOrdered`)."""

    QUEUES = 1

    @staticmethod
    @inline
    def insert(key: int, p: int, L: np.ndarray, base: int, nl: int, K: Any) -> None:
        list_append(key, base, L, K)

    @staticmethod
    @inline
    def access(key: int, p: int, L: np.ndarray, base: int, nl: int, K: Any) -> None:
        list_unlink(key, base, L, K)
        list_append(key, base, L, K)

    @staticmethod
    @inline
    def remove(key: int, p: int, L: np.ndarray, base: int, nl: int, K: Any) -> None:
        list_unlink(key, base, L, K)

    @staticmethod
    @inline
    def select(key: int, p: int, L: np.ndarray, base: int, nl: int, K: Any) -> None:
        pass

    @staticmethod
    @inline
    def new_pass(p: int, L: np.ndarray, base: int, nl: int, K: Any) -> None:
        pass

    @staticmethod
    @inline
    def steps(nl: int, opt: int) -> int:
        return 1

    @staticmethod
    @inline
    def segment(q: int, step: int, for_prefetch: bool, layer: int, nl: int, opt: int) -> tuple[int, int]:
        return 0, ANY


@REGISTRY.register("lru")
class LRU(RecencyOrdered):
    """Least recently used: evict the expert whose last use is oldest.

    An inserted expert counts as used at insertion (a demand fetch is used at once), as in
    libCacheSim's LRU, so miss counts match it on the same access stream. The kernel runs
    :class:`RecencyList`.
    """

    lists = RecencyList

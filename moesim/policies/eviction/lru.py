"""Least recently used eviction and its compiled form, a recency list."""

from __future__ import annotations

from typing import Any

import numpy as np

from moesim.jit import inline
from moesim.kernel_state import evictable
from moesim.policies.eviction.base import (
    NEXT,
    REGISTRY,
    KernelForm,
    RecencyOrdered,
    list_append,
    list_unlink,
    new_state,
)

HEAD = 0  # the list's head (least recent) and tail in I1


@inline
def _insert(key: int, demand: bool, ai: int, S: Any, IS: np.ndarray, K: Any, DI: np.ndarray, A: Any) -> None:
    list_append(key, HEAD, S[2], S[0])


@inline
def _use(key: int, ai: int, S: Any, IS: np.ndarray, K: Any, DI: np.ndarray, A: Any) -> None:
    list_unlink(key, HEAD, S[2], S[0])
    list_append(key, HEAD, S[2], S[0])


@inline
def _remove(key: int, evicted: int, S: Any, IS: np.ndarray, K: Any, A: Any) -> None:
    list_unlink(key, HEAD, S[2], S[0])


@inline
def _first(for_prefetch: bool, pin_gen: int, adm_layer: int, again: int, S: Any, IS: np.ndarray, K: Any,
           A: Any) -> int:
    """The first key of the list, from its head, that the cache may evict."""
    N = S[0]
    key = S[2][HEAD]
    while key != -1:
        if evictable(key, pin_gen, adm_layer, IS, K):
            return key
        key = N[key, NEXT]
    return -1


class RecencyList(KernelForm):
    """LRU's compiled form: one list, least recent first (links in I2, head and tail in I1); an
    insert and every use move the key to the end; the victim is the first the cache may evict.
    Statically pinned keys are never in it."""

    keeps_static = False
    inline = True
    pure_victim = True
    insert = staticmethod(_insert)
    access = staticmethod(_use)
    remove = staticmethod(_remove)
    victim = staticmethod(_first)

    @classmethod
    def state(cls, policy: Any, num_keys: int) -> tuple[np.ndarray, ...]:
        return new_state(num_keys, i2=2, i1=2)


@REGISTRY.register("lru")
class LRU(RecencyOrdered):
    """Least recently used: evict the expert whose last use is oldest.

    An inserted expert counts as used at insertion (a demand fetch is used at once), as in
    libCacheSim's LRU, so miss counts match it on the same access stream. The kernel runs
    :class:`RecencyList`.
    """

    form = RecencyList

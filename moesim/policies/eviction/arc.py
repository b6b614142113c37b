"""ARC eviction (Megiddo and Modha, FAST 2003), as libCacheSim defines it (``cache/eviction/ARC.c``).

Two LRU lists of cached entries, T1 (seen once recently) and T2 (seen at least twice), and two
ghost lists remembering their evictions, B1 and B2. A hit moves an entry to T2's head; a miss
enters T1, or T2 when a ghost list remembered it. A ghost hit adapts the target size ``p`` of
T1: up by max(|B2| / |B1|, 1) on a B1 hit, down by max(|B1| / |B2|, 1) on a B2 hit. A victim is
T1's least recent entry when T1 is larger than ``p`` (or as large, after a B2 hit), else T2's
(REPLACE); a miss that no ghost list remembered first trims the ghosts: with |T1| + |B1| at the
capacity, B1's oldest is dropped (or, B1 empty, T1's least recent entry is evicted and not
remembered); with all four lists at twice the capacity, B2's oldest.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import numpy as np

from moesim.jit import ir_inline
from moesim.kernel_state import entry_size, evictable, expert_size
from moesim.policies.eviction.base import (
    NEXT,
    REGISTRY,
    EvictionPolicy,
    KernelForm,
    list_append,
    list_unlink,
    new_state,
)
from moesim.policies.registry import PolicyContext

# -- the compiled form (ARC, below, is the reference) -----------------------------------------------
WHERE = 2  # I2: the links, then the list (NONE, T1, T2, B1, B2)
NONE, T1, T2, B1, B2 = 0, 1, 2, 3, 4
# I1: each list's least recent and most recent (T1 0-1, T2 2-3, B1 4-5, B2 6-7), then
GHOST_KEY, GHOST_LIST, FORGET, ORDER, STAGE, CURSOR = range(8, 14)
# ORDER: the walk's lists: T1 then T2, T2 then T1, or T1 unremembered then T2
T1_FIRST, T2_FIRST, T1_FORGOTTEN = 0, 1, 2
# F1: the lists' sizes (in the order of the lists), p, the capacity, the incoming entry's size, in experts
SIZE_T1, SIZE_T2, SIZE_B1, SIZE_B2, TARGET, CAPACITY, INCOMING = range(7)


@ir_inline
def _size(key: int, IS: np.ndarray) -> float:
    return entry_size(key, IS) / expert_size(IS)


@ir_inline
def _push(key: int, which: int, S: Any, IS: np.ndarray) -> None:
    """``key`` joins list ``which`` at its most recent end."""
    list_append(key, 2 * (which - 1), S[2], S[0])
    S[0][key, WHERE] = which
    S[3][which - 1] += _size(key, IS)


@ir_inline
def _pop(key: int, S: Any, IS: np.ndarray) -> int:
    """``key`` leaves its list; returns which."""
    which = S[0][key, WHERE]
    list_unlink(key, 2 * (which - 1), S[2], S[0])
    S[0][key, WHERE] = NONE
    S[3][which - 1] -= _size(key, IS)
    return which


@ir_inline
def _miss(key: int, S: Any, IS: np.ndarray, K: Any, A: Any) -> None:
    L, F = S[2], S[3]
    L[GHOST_KEY] = -1
    F[INCOMING] = _size(key, IS)
    which = S[0][key, WHERE]
    if which == B1:
        F[TARGET] = min(F[TARGET] + max(F[SIZE_B2] / F[SIZE_B1], 1.0), F[CAPACITY])
    elif which == B2:
        F[TARGET] = max(F[TARGET] - max(F[SIZE_B1] / F[SIZE_B2], 1.0), 0.0)
    if which in (B1, B2):
        _pop(key, S, IS)
        L[GHOST_KEY] = key
        L[GHOST_LIST] = which


@ir_inline
def _insert(key: int, demand: bool, ai: int, S: Any, IS: np.ndarray, K: Any, DI: np.ndarray, A: Any) -> None:
    L = S[2]
    if demand and L[GHOST_KEY] == key:
        _push(key, T2, S, IS)
    else:
        if S[0][key, WHERE] != NONE:  # a prefetch of a remembered entry: forgotten
            _pop(key, S, IS)
        _push(key, T1, S, IS)
    L[GHOST_KEY] = -1


@ir_inline
def _access(key: int, ai: int, S: Any, IS: np.ndarray, K: Any, DI: np.ndarray, A: Any) -> None:
    which = S[0][key, WHERE]
    if which in (T1, T2):
        _pop(key, S, IS)
        _push(key, T2, S, IS)


@ir_inline
def _remove(key: int, evicted: int, S: Any, IS: np.ndarray, K: Any, A: Any) -> None:
    L = S[2]
    which = S[0][key, WHERE]
    if which in (T1, T2):
        _pop(key, S, IS)
        if evicted and not (which == T1 and L[FORGET] == key):
            _push(key, B1 if which == T1 else B2, S, IS)
    if evicted:
        L[FORGET] = -1


@ir_inline
def _victim(for_prefetch: bool, pin_gen: int, adm_layer: int, again: int, S: Any, IS: np.ndarray, K: Any,
            A: Any) -> int:
    """:meth:`ARC.candidates`: on a miss no ghost list remembered, the ghosts trimmed first; then
    REPLACE's list from its least recent entry, then the other; a walk continued (``again``)
    goes on where it stopped."""
    N, L, F = S[0], S[2], S[3]
    if not again:
        if for_prefetch:  # no ghost hit, an entry at the scenario's precision
            L[GHOST_KEY] = -1
            F[INCOMING] = 1.0
        L[FORGET] = -1
        L[ORDER] = -1
        if L[GHOST_KEY] == -1:  # case IV
            if F[SIZE_T1] + F[SIZE_B1] + F[INCOMING] > F[CAPACITY]:
                if F[SIZE_B1] > 0:
                    _pop(L[4], S, IS)
                elif L[0] != -1:
                    L[ORDER] = T1_FORGOTTEN
            elif F[SIZE_T1] + F[SIZE_B1] + F[SIZE_T2] + F[SIZE_B2] >= 2 * F[CAPACITY] and F[SIZE_B2] > 0:
                _pop(L[6], S, IS)
        if L[ORDER] == -1:
            b2_hit = L[GHOST_KEY] != -1 and L[GHOST_LIST] == B2
            t1 = F[SIZE_T1]
            t1_first = (t1 > 0 and (t1 > F[TARGET] or (t1 == F[TARGET] and b2_hit))) or F[SIZE_T2] == 0
            L[ORDER] = T1_FIRST if t1_first else T2_FIRST
        L[STAGE] = 0
        L[CURSOR] = L[2] if L[ORDER] == T2_FIRST else L[0]
    while L[STAGE] < 2:
        key = L[CURSOR]
        while key != -1:
            L[CURSOR] = N[key, NEXT]
            L[FORGET] = key if (L[ORDER] == T1_FORGOTTEN and L[STAGE] == 0) else -1
            if evictable(key, pin_gen, adm_layer, IS, K):
                return key
            key = L[CURSOR]
        L[STAGE] += 1
        L[CURSOR] = L[0] if L[ORDER] == T2_FIRST else L[2]
    L[FORGET] = -1
    return -1


class AdaptiveLists(KernelForm):
    """ARC's compiled form: T1, T2, B1 and B2 as lists, least recent first, each entry's list,
    and the sizes and target ``p`` in experts. Statically pinned experts are in no list."""

    keeps_static = False
    rare = True
    miss = staticmethod(_miss)
    insert = staticmethod(_insert)
    access = staticmethod(_access)
    remove = staticmethod(_remove)
    victim = staticmethod(_victim)

    @classmethod
    def state(cls, policy: Any, num_keys: int) -> tuple[np.ndarray, ...]:
        ctx = policy.ctx
        I2, F2, I1, F1, P = new_state(num_keys, i2=3, i1=CURSOR + 1, f1=INCOMING + 1)
        I2[:, WHERE] = NONE
        I1[STAGE] = 0
        F1[CAPACITY] = ctx.capacity_bytes / ctx.expert_bytes if math.isfinite(ctx.capacity_bytes) else math.inf
        F1[INCOMING] = 1.0
        return I2, F2, I1, F1, P


@REGISTRY.register("arc")
class ARC(EvictionPolicy):
    """ARC (libCacheSim's ``ARC``): two LRU lists, of entries seen once and seen at least twice,
    and ghost lists of their evictions; the first list's target size adapts to ghost hits (the
    module's docstring has the rules). Sizes count experts at the scenario's
    precision (an entry at another precision counts its bytes over that expert's), and ``p``
    moves by at least one expert.

    The walk offers REPLACE's list from its least recent entry toward its most recent, then the
    other list (entries the cache may not evict keep their place). A prefetch admission enters
    T1 (a ghost list forgets it, and ``p`` does not move); a prefetcher's selection is not a
    hit. Statically pinned experts are in no list. The kernel runs :class:`AdaptiveLists`."""

    form = AdaptiveLists


    def __init__(self, params: Any, ctx: PolicyContext) -> None:
        super().__init__(params, ctx)
        self._c = ctx.capacity_bytes / ctx.expert_bytes if math.isfinite(ctx.capacity_bytes) else math.inf
        self._t1: OrderedDict[int, float] = OrderedDict()  # least recent first; key -> size
        self._t2: OrderedDict[int, float] = OrderedDict()
        self._b1: OrderedDict[int, float] = OrderedDict()  # oldest first
        self._b2: OrderedDict[int, float] = OrderedDict()
        self._size = {"t1": 0.0, "t2": 0.0, "b1": 0.0, "b2": 0.0}
        self._p = 0.0
        self._ghost: tuple[int, str] | None = None  # the key a demand miss found in B1 or B2, and which
        self._forget: int | None = None  # the walk's T1 entry evicted without a ghost (case IV, B1 empty)
        self._incoming = 1.0  # the size of the entry room is made for

    def _keysize(self, key: int) -> float:
        ctx = self.ctx
        return ctx.precision_bytes[ctx.precision_of(key)] / ctx.expert_bytes if ctx.precision_bytes else 1.0

    def _lists(self) -> dict[str, OrderedDict[int, float]]:
        return {"t1": self._t1, "t2": self._t2, "b1": self._b1, "b2": self._b2}

    def _pop(self, name: str, key: int) -> float:
        size = self._lists()[name].pop(key)
        self._size[name] -= size
        return size

    def _push(self, name: str, key: int, size: float) -> None:
        self._lists()[name][key] = size
        self._size[name] += size

    def on_miss(self, key: int) -> None:
        s = self._size
        self._ghost = None
        self._incoming = self._keysize(key)
        if key in self._b1:
            self._p = min(self._p + max(s["b2"] / s["b1"], 1.0), self._c)
            self._pop("b1", key)
            self._ghost = (key, "b1")
        elif key in self._b2:
            self._p = max(self._p - max(s["b1"] / s["b2"], 1.0), 0.0)
            self._pop("b2", key)
            self._ghost = (key, "b2")

    def on_insert(self, key: int, demand: bool) -> None:
        if key in self.ctx.static_keys:
            return
        size = self._keysize(key)
        if demand and self._ghost is not None and self._ghost[0] == key:
            self._push("t2", key, size)
        else:
            for ghost in ("b1", "b2"):
                if key in self._lists()[ghost]:  # a prefetch of a remembered entry: forgotten
                    self._pop(ghost, key)
            self._push("t1", key, size)
        self._ghost = None

    def on_access(self, key: int) -> None:
        if key in self._t1:
            self._push("t2", key, self._pop("t1", key))
        elif key in self._t2:
            self._t2.move_to_end(key)

    def on_remove(self, key: int) -> None:
        if key in self._t1:
            size = self._pop("t1", key)
            if self._forget != key:
                self._push("b1", key, size)
        elif key in self._t2:
            self._push("b2", key, self._pop("t2", key))
        self._forget = None

    def on_withdraw(self, key: int) -> None:
        for name in ("t1", "t2"):
            if key in self._lists()[name]:
                self._pop(name, key)

    def _replace_t1(self) -> bool:
        """REPLACE: whether T1's least recent entry goes (else T2's)."""
        s = self._size
        b2_hit = self._ghost is not None and self._ghost[1] == "b2"
        return (s["t1"] > 0 and (s["t1"] > self._p or (s["t1"] == self._p and b2_hit))) or s["t2"] == 0

    def prefetch_candidates(self) -> Iterator[int]:
        """:meth:`candidates` for a prefetch: no ghost hit, an entry at the scenario's
        precision."""
        self._ghost = None
        self._incoming = 1.0
        return self.candidates()

    def candidates(self) -> Iterator[int]:
        s = self._size
        self._forget = None
        if self._ghost is None:  # case IV: a miss on every list trims the ghosts first
            if s["t1"] + s["b1"] + self._incoming > self._c:
                if s["b1"] > 0:
                    self._pop("b1", next(iter(self._b1)))
                elif self._t1:  # T1's entries go unremembered
                    for key in list(self._t1):
                        self._forget = key
                        yield key
                    self._forget = None
                    yield from self._t2
                    return
            elif s["t1"] + s["b1"] + s["t2"] + s["b2"] >= 2 * self._c and s["b2"] > 0:
                self._pop("b2", next(iter(self._b2)))
        first_list, then = (self._t1, self._t2) if self._replace_t1() else (self._t2, self._t1)
        yield from first_list
        yield from then

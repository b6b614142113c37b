"""GPU expert cache: owns the miss -> evict -> insert loop (style.md #2).

Entries are keyed by ``layer * num_experts + expert`` and hold bytes. An entry is either in
flight (space reserved when its transfer is issued, pinned until it completes) or resident.
The eviction policy only orders candidates; the cache skips pinned keys and evicts only when
it can free enough room, otherwise it changes nothing and returns ``None``.
"""

from __future__ import annotations

from collections.abc import Callable, Container

from policies.eviction import EvictionPolicy
from simulator.copyengine import DEMAND, CopyEngine, Transfer


class ExpertCache:
    """Byte-capacity cache of experts in HBM."""

    def __init__(self, capacity_bytes: float, policy: EvictionPolicy) -> None:
        self.capacity = capacity_bytes
        self.policy = policy
        self.used = 0
        self.resident: dict[int, int] = {}
        self.inflight: dict[int, Transfer] = {}
        self.on_evict: list[Callable[[int], None]] = []
        self.max_used = 0
        self.last_bypassed = 0

    def __contains__(self, key: int) -> bool:
        return key in self.resident or key in self.inflight

    def make_room(self, nbytes: int, pinned: Container[int]) -> list[int] | None:
        """Evict until ``nbytes`` fit; return the victims, or ``None`` (and change nothing)
        when the unpinned entries cannot free enough."""
        need = self.used + nbytes - self.capacity
        if need <= 0:
            return []
        if nbytes > self.capacity:
            return None
        victims = []
        freed = 0
        inflight = self.inflight
        resident = self.resident
        for key in self.policy.candidates():
            if key in pinned or key in inflight or key not in resident:
                continue
            victims.append(key)
            freed += resident[key]
            if freed >= need:
                break
        if freed < need:
            return None
        for key in victims:
            self.remove(key)
        return victims

    def admit_demand(self, keys: list[int], nbytes: int, pinned: Container[int],
                     copy: CopyEngine, now: float, evicted: set[int]) -> list[Transfer]:
        """Miss -> evict -> insert for a layer's blocking fetches, issued together at ``now``.

        The policy has already been told ``on_insert(key, True)`` for each key, in access
        order (so its recency order matches a one-by-one replay). Room is made for all of
        them at once (victims added to ``evicted``; current-layer keys are pinned so the
        victims are the same as one-by-one); when not all fit, the first ones in order are
        admitted and the rest go to a staging buffer (``tr.bypass``), removed again from
        the policy. Returns the transfers in order.
        """
        transfers = copy.submit_batch(keys, nbytes, DEMAND, now)
        total = nbytes * len(keys)
        admit = len(keys)
        if self.used + total > self.capacity:
            need = self.used + total - self.capacity
            victims = []
            freed = 0
            inflight = self.inflight
            resident = self.resident
            for key in self.policy.candidates():
                if key in pinned or key in inflight or key not in resident:
                    continue
                victims.append(key)
                freed += resident[key]
                if freed >= need:
                    break
            for key in victims:
                self.remove(key)
            evicted.update(victims)
            if freed < need:
                room = self.capacity - self.used
                admit = max(0, min(len(keys), int(room // nbytes))) if nbytes > 0 else len(keys)
        inflight = self.inflight
        for tr in transfers[:admit]:
            inflight[tr.key] = tr
        self.used += nbytes * admit
        if self.used > self.max_used:
            self.max_used = self.used
        self.last_bypassed = len(keys) - admit
        for tr in transfers[admit:]:
            tr.bypass = True
            self.policy.on_remove(tr.key)
        return transfers

    def remove(self, key: int) -> None:
        """Evict a resident entry."""
        self.used -= self.resident.pop(key)
        self.policy.on_remove(key)
        if self.on_evict:
            for cb in self.on_evict:
                cb(key)

    def reserve(self, tr: Transfer, demand: bool = True) -> None:
        """Record an in-flight entry for ``tr`` (room must have been made)."""
        self.inflight[tr.key] = tr
        self.used += tr.nbytes
        if self.used > self.max_used:
            self.max_used = self.used
        self.policy.on_insert(tr.key, demand)

    def complete(self, tr: Transfer) -> None:
        """``tr`` finished: its entry becomes resident."""
        if tr.bypass:
            return
        del self.inflight[tr.key]
        self.resident[tr.key] = tr.nbytes

"""GPU expert cache: owns the miss -> evict -> insert loop (style.md #2) in one method,
:meth:`ExpertCache.fetch`, for demand fetches and prefetches alike.

Entries are keyed by the policies' cache keys (an expert at a precision, see
:class:`moesim.policies.registry.PolicyContext`) and hold bytes. An entry is either in
flight (space reserved when its transfer is issued, pinned until it completes) or resident.
The eviction policy only orders candidates; the cache skips pinned keys and evicts only when
it can free enough room, otherwise it changes nothing and returns ``None``.
"""

from __future__ import annotations

from collections.abc import Callable, Container

from moesim.policies.eviction import EvictionPolicy
from moesim.simulator.copyengine import BYPASS, DEMAND, KEY, NBYTES, PREFETCH, CopyEngine, Transfer


class ExpertCache:
    """Byte-capacity cache of experts in HBM, filled through the host link's copy engine
    ``copy`` (whose completions it listens to)."""

    def __init__(self, capacity_bytes: float, policy: EvictionPolicy, copy: CopyEngine) -> None:
        self.capacity = capacity_bytes
        self.policy = policy
        self.copy = copy
        copy.on_complete.append(self.complete_many)
        self.used = 0
        self.resident: dict[int, int] = {}
        self.inflight: dict[int, Transfer] = {}
        self.evicted: set[int] = set()  # keys evicted since the owner last cleared it
        self.on_evict: list[Callable[[list[int]], None]] = []  # told the keys evicted
        self.max_used = 0
        # statically pinned keys (shared with the policy's context: a policy may leave them out)
        self.static_pinned: set[int] = policy.ctx.static_keys

    def __contains__(self, key: int) -> bool:
        """Whether ``key`` is resident or in flight."""
        return key in self.resident or key in self.inflight

    def fetch(self, key: int, nbytes: int, pinned: Container[int], demand: bool,
              now: float) -> tuple[list[int], Transfer] | None:
        """The miss -> evict -> insert loop, for a demand fetch and a prefetch alike: make room
        for ``key`` (``nbytes``) by evicting victims in the policy's eviction order (a
        prefetch walks the policy's :meth:`prefetch_candidates`: it may decline to evict some
        keys for an optional prefetch), queue its copy issued at ``now`` (demand or prefetch
        priority) and record its entry: in flight until the copy engine completes it,
        resident at once in cache-only replay (an instant engine). Entries in flight, the
        ``pinned`` keys and statically pinned keys are never victims, and victims are evicted
        only when together they free enough room. The policy is told whether the insert is
        a demand fetch (a use) or a prefetch; a demand fetch is first a miss
        (:meth:`EvictionPolicy.on_miss`). Returns the victims, in eviction order (empty when the
        entry fits), and the transfer; or ``None``, changing no entry, when no room can be made
        (a policy whose walk moves its own marks, a hand or visited bits, may have moved them)."""
        policy = self.policy
        resident = self.resident
        used = self.used
        free = self.capacity - used
        victims: list[int] = []
        if demand:
            policy.on_miss(key)
        if nbytes > free:
            if nbytes > self.capacity:
                return None
            static = self.static_pinned
            for v in (policy.candidates() if demand else policy.prefetch_candidates()):
                # entries in flight are not resident
                if v not in resident or v in pinned or (static and v in static):
                    continue
                victims.append(v)
                free += resident[v]
                if nbytes <= free:
                    break
            else:
                return None  # no entry changed (the walk may be a view of the policy)
            on_remove = policy.on_remove
            for v in victims:
                used -= resident.pop(v)
                on_remove(v)
            self.evicted.update(victims)
            for cb in self.on_evict:
                cb(victims)
        copy = self.copy
        tr = copy.submit(key, nbytes, DEMAND if demand else PREFETCH, now)
        if copy.instant:
            resident[key] = nbytes
        else:
            self.inflight[key] = tr
        used += nbytes
        self.used = used
        if used > self.max_used:
            self.max_used = used
        policy.on_insert(key, demand)
        return victims, tr

    def cancel_many(self, transfers: list[Transfer]) -> None:
        """Drop the in-flight entries of withdrawn transfers."""
        inflight, on_withdraw = self.inflight, self.policy.on_withdraw
        for tr in transfers:
            key = tr[KEY]
            del inflight[key]
            self.used -= tr[NBYTES]
            on_withdraw(key)

    def preload(self, keys: list[int], nbytes: int) -> int:
        """Make ``keys`` resident before the replay and pin them for good (static pinning);
        stops when the capacity is full. Returns how many were loaded."""
        loaded = 0
        for key in keys:
            if key in self.resident or self.used + nbytes > self.capacity:
                continue
            self.resident[key] = nbytes
            self.used += nbytes
            self.static_pinned.add(key)
            self.policy.on_insert(key, False)
            loaded += 1
        self.max_used = max(self.max_used, self.used)
        return loaded

    def complete_many(self, transfers: list[Transfer]) -> None:
        """Finished transfers (in finish order): their entries become resident (an uncached
        fetch's copy is not kept)."""
        inflight, resident = self.inflight, self.resident
        for tr in transfers:
            if not tr[BYPASS]:
                key = tr[KEY]
                del inflight[key]
                resident[key] = tr[NBYTES]

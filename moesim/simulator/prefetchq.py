"""The prefetch issuer: SpecMD appendix A.3's asynchronous prefetch queue (``docs/design.md``,
"the prefetch contract"; ``docs/concepts/execution.md``).

At a layer's routing point the prefetch policy proposes cache keys of later layers
(:meth:`PrefetchQueue.propose`). A proposal already resident or in flight is *selected* (the
eviction policy is told; nothing is pinned); an absent one joins the waiting queue in order.
Admission rounds (:meth:`PrefetchQueue.admit`) take waiting proposals from the head while the
cache can make room for them without evicting a pinned key (the caller's pins and the earlier
admissions for the same target layer) and queue their copies at prefetch priority; a round
stops at the first proposal for which no room can be made. At a layer's routing point
(:meth:`PrefetchQueue.withdraw`) proposals for it or earlier still waiting are withdrawn, its
admissions are no longer pinned for it, and its admitted copies that the layer does not need and
the host has not yet issued to the copy engine (``execution.prefetch_depth``:
:meth:`CopyEngine.handed`) are withdrawn with their room (no bytes move); an issued copy runs
to completion.

Every count lands in the pass's :class:`simulator.lookup.PassRow`, which the caller passes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from collections.abc import Set as AbstractSet

from moesim.policies.eviction import EvictionPolicy
from moesim.policies.prefetch import PrefetchPolicy
from moesim.simulator.cache import ExpertCache
from moesim.simulator.copyengine import DEMAND, KEY, PRIORITY, SEQ, Transfer
from moesim.simulator.lookup import PassRow

NO_PINS: frozenset[int] = frozenset()


class _Either:
    """Membership in either of two sets (the pins of a prefetch admission: the caller's and
    the earlier admissions for the same target layer)."""

    __slots__ = ("a", "b")

    def __init__(self, a: AbstractSet[int], b: AbstractSet[int]) -> None:
        self.a = a
        self.b = b

    def __contains__(self, key: object) -> bool:
        return key in self.a or key in self.b


class PrefetchQueue:
    """One GPU's prefetch queue (module docstring) for ``policy``, whose context gives the
    model's dimensions, the entry size, the replay's clock and workload; ``decisions`` the
    decision log, when recorded; ``depth`` the admitted copies the host keeps issued to the
    copy engine at a time (None: every one)."""

    def __init__(self, policy: PrefetchPolicy, eviction: EvictionPolicy, cache: ExpertCache,
                 decisions: list[tuple[int, int, str, int]] | None, depth: int | None = None) -> None:
        ctx = policy.ctx
        self.policy = policy
        self.eviction = eviction
        self.cache = cache
        self.ctx = ctx
        self.clock = ctx.clock
        self.num_layers = ctx.num_layers
        self.div = ctx.keys_per_layer  # key // div = the key's layer
        self.expert_bytes = ctx.expert_bytes
        self.decisions = decisions
        self.depth = depth
        self.waiting: deque[tuple[int, int]] = deque()  # (key, target layer), in order
        self.queued: set[int] = set()  # the waiting keys
        self.admitted: dict[int, set[int]] = {}  # per target layer: pinned against later admissions for it
        self.pending: dict[int, list[Transfer]] = {}  # per target layer: admitted copies maybe still queued
        self.unused: set[int] = set()  # prefetched keys not accessed yet
        self.on_withdrawn: list[Callable[[list[Transfer]], None]] = []  # told the copies withdrawn
        if policy.active:
            cache.on_evict.append(self.unused.difference_update)

    def propose(self, p: int, layer: int, now: float, row: PassRow, pinned: AbstractSet[int] | None = None) -> None:
        """Take the prefetcher's proposals at ``layer``'s routing point: those resident or in
        flight are *selected*, the absent ones join the waiting queue in order; then one
        admission round under ``pinned``. Counts prediction precision/recall against what
        each target layer really needs in this pass."""
        props = self.policy.propose(p, layer)
        pins = NO_PINS if pinned is None else pinned
        if not props:
            if self.waiting:
                self.admit(now, pins, row)
            return
        cache = self.cache
        resident, inflight = cache.resident, cache.inflight
        select = self.eviction.on_prefetch_select
        div = self.div
        lo_key, hi_key = (layer + 1) * div, self.num_layers * div
        waiting, queued = self.waiting, self.queued
        targets: dict[int, list[int]] = {}
        for key in dict.fromkeys(props):
            if key < lo_key or key >= hi_key:
                continue  # not a later layer
            t = key // div
            targets.setdefault(t, []).append(key)
            if key in resident or key in inflight:
                select(key)
            elif key not in queued:
                queued.add(key)
                waiting.append((key, t))
        if waiting:
            self.admit(now, pins, row)
        wl = self.ctx.workload
        base = p * self.num_layers
        for target, keys_t in targets.items():  # against the keys the target layer looks up
            b = base + target
            actual = set(self.ctx.layer_keys(target, wl.acc_expert[wl.off[b]:wl.off[b + 1]].tolist()))
            row.pred_hits += len(actual.intersection(keys_t))
            row.pred_total += len(keys_t)
            row.actual_total += len(actual)

    def admit(self, now: float, pinned: AbstractSet[int], row: PassRow) -> None:
        """One admission round: admit waiting proposals from the head of the queue while room
        can be made (:meth:`ExpertCache.fetch` at prefetch priority, walking the eviction
        policy's prefetch candidates); earlier admissions for the same target layer stay
        pinned. Stops at the first proposal for which no room can be made."""
        waiting, queued = self.waiting, self.queued
        cache = self.cache
        nbytes = self.expert_bytes
        instant = cache.copy.instant
        rec = self.decisions
        div = self.div
        # a waiting key is absent: it was absent when it joined the queue, and only its own
        # admission brings it in before its target layer's routing point withdraws it
        while waiting:
            key, target = waiting[0]
            mine = self.admitted.get(target)
            got = cache.fetch(key, nbytes, _Either(pinned, mine) if mine else pinned, False, now)
            if got is None:
                return
            victims, tr = got
            waiting.popleft()
            queued.discard(key)
            if victims:
                for keys in self.admitted.values():
                    keys.difference_update(victims)
            if rec is not None:
                rec.extend((self.clock.pass_index, self.clock.layer, "evict", v) for v in victims)
                rec.append((self.clock.pass_index, self.clock.layer, "prefetch", key))
            if not instant:
                self.pending.setdefault(key // div, []).append(tr)
            self.admitted.setdefault(target, set()).add(key)
            self.unused.add(key)
            row.pf_issued += 1

    def withdraw(self, layer: int, needed: list[int], row: PassRow) -> None:
        """At ``layer``'s routing point: proposals for it (or earlier) still waiting are
        withdrawn, its admissions are no longer pinned for it, and its prefetches the layer
        does not need (``needed``) that the host has not issued to the copy engine are
        withdrawn with their room (``prefetches_cancelled``; no bytes move)."""
        waiting = self.waiting
        if waiting and any(t <= layer for _, t in waiting):
            keep = [(k, t) for k, t in waiting if t > layer]
            self.queued.difference_update(k for k, t in waiting if t <= layer)
            waiting.clear()
            waiting.extend(keep)
        for t in [t for t in self.admitted if t <= layer]:
            del self.admitted[t]
        pending = self.pending
        due = [t for t in pending if t <= layer]
        if not due:
            return
        need = set(needed)
        cut = self.cache.copy.handed(self.depth)  # the copies the host has issued stay
        stale: list[Transfer] = []
        for target in due:
            stale.extend(tr for tr in pending.pop(target)
                         if tr[PRIORITY] != DEMAND and tr[KEY] not in need and tr[SEQ] > cut)
        if not stale:
            return
        gone = self.cache.copy.cancel_many(stale)
        if gone:
            for cb in self.on_withdrawn:
                cb(gone)
            self.cache.cancel_many(gone)
            self.unused.difference_update([tr[KEY] for tr in gone])
            if self.decisions is not None:
                clock = self.clock
                self.decisions.extend((clock.pass_index, clock.layer, "withdraw", tr[KEY]) for tr in gone)
            row.pf_cancelled += len(gone)

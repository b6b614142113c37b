"""Copy engines: one per direction per link, serialising their transfers.

Transfers are two-phase (issued, completed). A copy engine is a non-preemptive single
server: demand fetches (priority 0) go before queued prefetches (priority 1), first come,
first served within a priority; a transfer that has started runs to completion. Service time is the link's
``copy_time(bytes)``.

Because service times are deterministic, the engine does not need its own SimPy process:
it keeps its queue and computes when each queued transfer will finish *given what has been
submitted so far*. :meth:`CopyEngine.advance` moves it to the simulation clock (starting
queued transfers whose start time has passed and completing those whose finish time has
passed, in time order, and telling observers which finished); a waiting process reads
its transfer's projected ``done`` time (a process waits only on demand fetches, promoted
prefetches and started transfers). Each GPU's compute process is the only
submitter to its copy engines, so a projection made at a routing point is final for the
transfers already queued (later submissions of the same process queue behind them or, for a
demand fetch, ahead of prefetches that have not started). This keeps the replay to about one
SimPy event per layer.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from moesim.config.hardware import LinkConfig

DEMAND, PREFETCH = 0, 1


Transfer = list
"""One copy of one expert: a flat record (a plain list, not an object: the SimPy path makes
one per miss) read and written through the field indices below. ``START``/``DONE`` are
projections until ``STARTED``; a queued prefetch's are not kept up to date (they are set
when it starts or is promoted). ``BYPASS``: copied to a staging buffer, not kept in the
cache; ``PROMOTED``: a prefetch a layer needed while it was still queued."""

DONE, START, ISSUED, DUR, KEY, NBYTES, SEQ, PRIORITY, STARTED, CANCELLED, BYPASS, PROMOTED = range(12)


class CopyEngine:
    """A link direction's copy engine (see module docstring).

    Queued transfers wait in two first-in, first-out queues served demand first: ``_demand`` (demand
    fetches and promoted prefetches, by issue order) and ``_pf`` (prefetches). The demand
    queue's finish times are projected when it changes; a prefetch's only when
    :meth:`advance` starts it or :meth:`promote_many` moves it to the demand queue, so
    queuing, promoting and withdrawing prefetches costs no re-projection of the others. Promoted and withdrawn
    prefetches stay in ``_pf`` as tombstones until they reach its head.

    ``instant=True`` (cache-only replay): every transfer takes no time; the caller
    completes it right after reserving its cache entry.
    """

    def __init__(self, link: LinkConfig, instant: bool = False) -> None:
        self.link = link
        self.instant = instant
        self._demand: list[Transfer] = []  # queued demand, in service order
        self._pf: deque[Transfer] = deque()  # queued prefetches in issue order (with tombstones)
        self._running: deque[Transfer] = deque()  # started, not completed, in finish order
        self._busy_until = 0.0
        self._seq = 0
        self._time_cache: dict[int, float] = {}
        self.on_complete: list[Callable[[list[Transfer]], None]] = []  # told the finished, in order
        self.bytes_moved = 0
        self.busy_time = 0.0
        self.demand_submits = 0  # demand copies submitted (the host model charges each)

    def duration(self, nbytes: int) -> float:
        """Service time of a copy of ``nbytes``."""
        t = self._time_cache.get(nbytes)
        if t is None:
            t = self._time_cache[nbytes] = self.link.copy_time(nbytes)
        return t

    def submit(self, key: int, nbytes: int, priority: int, now: float) -> Transfer:
        """Queue a transfer issued at ``now`` and return it. The caller must have called
        :meth:`advance` with ``now`` (the engine does so at every routing point). A demand
        transfer is projected at once (behind the queued demand ones); a prefetch gets its
        times when :meth:`advance` starts it or it is promoted."""
        dur = self._time_cache.get(nbytes)
        if dur is None:
            dur = self.duration(nbytes)
        seq = self._seq
        self._seq = seq + 1
        self.bytes_moved += nbytes
        instant = self.instant  # started: the caller completes it at once (cache-only replay)
        start = done = now  # a prefetch's are set when it starts or is promoted
        if priority == DEMAND:
            self.demand_submits += 1
        if priority == DEMAND and not instant:
            demand = self._demand
            prev = demand[-1][DONE] if demand else self._busy_until
            start = prev if prev > now else now
            done = start + dur
        tr = [done, start, now, dur, key, nbytes, seq, priority, instant, False, False, False]
        if not instant:
            (self._demand if priority == DEMAND else self._pf).append(tr)
        return tr

    def promote(self, tr: Transfer) -> None:
        """A queued prefetch is needed now: move it to demand priority (ahead of demand
        fetches issued after it)."""
        self.promote_many([tr])

    def promote_many(self, trs: list[Transfer]) -> None:
        """:meth:`promote` for several queued prefetches, re-projecting the demand queue once."""
        once = {t[SEQ]: t for t in trs}  # each once, in first-named order
        moving = [t for t in once.values() if not t[STARTED] and t[PRIORITY] != DEMAND and not t[CANCELLED]]
        if not moving:
            return
        for t in moving:
            t[PRIORITY] = DEMAND  # its entry in the prefetch queue becomes a tombstone
            t[PROMOTED] = True
        demand = self._demand  # each goes in by issue order (seq), whatever the order of trs
        first = len(demand)
        for t in moving:
            i = len(demand)
            while i > 0 and demand[i - 1][SEQ] > t[SEQ]:
                i -= 1
            demand.insert(i, t)
            first = min(first, i)
        self._project_demand(first)

    def handed(self, depth: int | None) -> float:
        """The issue number (``SEQ``) of the last queued prefetch handed to the engine when the
        host keeps ``depth`` prefetch copies issued at a time, counting one copying (None: every
        one): those up to it cannot be withdrawn. The issued ones are the first ``depth``
        prefetches not yet done, in issue order; the caller has advanced the engine to now."""
        if depth is None:
            return float("inf")
        left = depth - sum(1 for t in self._running if t[PRIORITY] != DEMAND)
        cut = -1
        for t in self._pf:
            if left <= 0:
                break
            if not (t[CANCELLED] or t[PRIORITY] == DEMAND):
                cut = t[SEQ]
                left -= 1
        return cut

    def cancel_many(self, trs: list[Transfer]) -> list[Transfer]:
        """Withdraw the queued (not started) transfers among ``trs``; returns those withdrawn."""
        gone = []
        for t in trs:
            if not (t[STARTED] or t[CANCELLED]):
                t[CANCELLED] = True
                gone.append(t)
        if not gone:
            return gone
        self.bytes_moved -= sum(t[NBYTES] for t in gone)
        if any(t[PRIORITY] == DEMAND for t in gone):
            self._demand[:] = [t for t in self._demand if not t[CANCELLED]]
            self._project_demand(0)
        return gone

    def _project_demand(self, first: int) -> None:
        """Re-project the demand queue from position ``first`` on."""
        demand = self._demand
        prev = demand[first - 1][DONE] if first else self._busy_until
        for i in range(first, len(demand)):
            t = demand[i]
            start = prev if prev > t[ISSUED] else t[ISSUED]
            t[START] = start
            prev = t[DONE] = start + t[DUR]

    def advance(self, now: float) -> None:
        """Start transfers whose start time is before ``now``; complete those finished by
        ``now`` (observers see them in finish order)."""
        running = self._running
        demand = self._demand
        prev = self._busy_until
        busy = self.busy_time
        finished = []  # one server: transfers finish in the order they start
        if demand:
            started = 0
            for tr in demand:
                start = tr[START]
                if start >= now:
                    break
                prev = tr[DONE]
                tr[STARTED] = True
                if prev <= now and not running:
                    finished.append(tr)
                else:
                    running.append(tr)
                busy += prev - start
                started += 1
            if started:
                del demand[:started]
        if not demand:
            pf = self._pf
            while pf:
                tr = pf[0]
                if tr[CANCELLED] or tr[PRIORITY] == DEMAND:
                    pf.popleft()
                    continue
                issued = tr[ISSUED]
                start = prev if prev > issued else issued
                if start >= now:
                    break
                pf.popleft()
                tr[START] = start
                prev = tr[DONE] = start + tr[DUR]
                tr[STARTED] = True
                running.append(tr)
                busy += prev - start
        self._busy_until = prev
        self.busy_time = busy
        while running and running[0][DONE] <= now:
            finished.append(running.popleft())
        if finished:
            for cb in self.on_complete:
                cb(finished)

    def finish(self) -> None:
        """Complete all work (end of simulation), counting its busy time."""
        self.advance(float("inf"))

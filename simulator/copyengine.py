"""Copy engines: one per direction per link, serialising their transfers.

Transfers are two-phase (issued, completed). A copy engine is a non-preemptive single
server: demand fetches (priority 0) go before queued prefetches (priority 1), FIFO within a
priority; a transfer that has started runs to completion. Service time is the link's
``copy_time(bytes)``.

Because service times are deterministic, the engine does not need its own SimPy process:
it keeps its queue and computes when each queued transfer will finish *given what has been
submitted so far*. :meth:`CopyEngine.advance` moves it to the simulation clock (starting
queued transfers whose start time has passed and completing those whose finish time has
passed, in time order, notifying observers with the finish time); a waiting process reads
its transfer's projected ``done`` time. Each GPU's compute process is the only
submitter to its copy engines, so a projection made at a routing point is final for the
transfers already queued (later submissions of the same process queue behind them or, for a
demand fetch, ahead of prefetches that have not started). This keeps the replay to about one
SimPy event per layer.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable

from simulator.hardware import LinkConfig

DEMAND, PREFETCH = 0, 1


class Transfer:
    """One copy of one expert. ``done`` is projected until :attr:`started`."""

    __slots__ = ("bypass", "done", "dur", "issued", "key", "nbytes", "priority", "seq", "start", "started")

    def __init__(self, key: int, nbytes: int, priority: int, issued: float, seq: int) -> None:
        self.key = key
        self.nbytes = nbytes
        self.priority = priority
        self.issued = issued
        self.seq = seq
        self.start = issued
        self.done = issued
        self.started = False
        self.bypass = False  # copied to a staging buffer, not kept in the cache
        self.dur = 0.0


class CopyEngine:
    """A link direction's copy engine (see module docstring).

    ``instant=True`` (cache-only replay): every transfer takes no time; the caller
    completes it right after reserving its cache entry.
    """

    def __init__(self, name: str, link: LinkConfig, instant: bool = False) -> None:
        self.name = name
        self.link = link
        self.instant = instant
        self._pending: list[Transfer] = []  # not started, in service order
        self._pending_keys: list[tuple[int, int]] = []
        self._running: deque[Transfer] = deque()  # started, not completed, in finish order
        self._busy_until = 0.0
        self._seq = 0
        self._time_cache: dict[int, float] = {}
        self.on_complete: list[Callable[[Transfer], None]] = []
        self.bytes_moved = 0
        self.busy_time = 0.0
        self.transfers = 0

    def duration(self, nbytes: int) -> float:
        """Service time of a copy of ``nbytes``."""
        t = self._time_cache.get(nbytes)
        if t is None:
            t = self._time_cache[nbytes] = self.link.copy_time(nbytes)
        return t

    def submit(self, key: int, nbytes: int, priority: int, now: float) -> Transfer:
        """Queue a transfer issued at ``now`` and return it. The caller must have called
        :meth:`advance` with ``now`` (the engine does so at every routing point)."""
        tr = Transfer(key, nbytes, priority, now, self._seq)
        self._seq += 1
        self.bytes_moved += nbytes
        self.transfers += 1
        if self.instant:
            tr.started = True  # the caller completes it at once (cache-only replay)
            return tr
        sk = (priority, tr.seq)
        pending = self._pending
        if not pending or self._pending_keys[-1] <= sk:
            prev = pending[-1].done if pending else self._busy_until
            tr.start = prev if prev > now else now
            dur = self._time_cache.get(nbytes)
            if dur is None:
                dur = self.duration(nbytes)
            tr.dur = dur
            tr.done = tr.start + dur
            pending.append(tr)
            self._pending_keys.append(sk)
            return tr
        tr.dur = self.duration(nbytes)
        idx = bisect.bisect_right(self._pending_keys, sk)
        pending.insert(idx, tr)
        self._pending_keys.insert(idx, sk)
        self._reproject(idx)
        return tr

    def submit_batch(self, keys: list[int], nbytes: int, priority: int, now: float) -> list[Transfer]:
        """:meth:`submit` for several same-size transfers issued together, in order."""
        if self.instant or (self._pending and self._pending_keys[-1][0] > priority):
            return [self.submit(k, nbytes, priority, now) for k in keys]
        dur = self._time_cache.get(nbytes)
        if dur is None:
            dur = self.duration(nbytes)
        pending = self._pending
        pkeys = self._pending_keys
        prev = pending[-1].done if pending else self._busy_until
        seq = self._seq
        out = []
        for key in keys:
            tr = Transfer(key, nbytes, priority, now, seq)
            tr.dur = dur
            tr.start = prev if prev > now else now
            prev = tr.done = tr.start + dur
            pending.append(tr)
            pkeys.append((priority, seq))
            out.append(tr)
            seq += 1
        self._seq = seq
        self.bytes_moved += nbytes * len(keys)
        self.transfers += len(keys)
        return out

    def promote(self, tr: Transfer) -> None:
        """A queued prefetch is needed now: move it to demand priority (ahead of demand
        fetches issued after it)."""
        if tr.started or tr.priority == DEMAND:
            return
        idx = self._pending.index(tr)
        del self._pending[idx]
        del self._pending_keys[idx]
        tr.priority = DEMAND
        sk = (DEMAND, tr.seq)
        new = bisect.bisect_right(self._pending_keys, sk)
        self._pending.insert(new, tr)
        self._pending_keys.insert(new, sk)
        self._reproject(min(idx, new))

    def promote_many(self, trs: list[Transfer]) -> None:
        """:meth:`promote` for several queued prefetches, re-projecting the queue once."""
        trs = [t for t in trs if not t.started and t.priority != DEMAND]
        if not trs:
            return
        moving = {id(t) for t in trs}
        first = min(self._pending.index(t) for t in trs)
        rest = [t for t in self._pending if id(t) not in moving]
        for t in trs:
            t.priority = DEMAND
        pending = sorted(rest + trs, key=lambda t: (t.priority, t.seq))
        self._pending[:] = pending
        self._pending_keys[:] = [(t.priority, t.seq) for t in pending]
        self._reproject(first)

    def cancel_many(self, trs: list[Transfer]) -> list[Transfer]:
        """Withdraw the queued (not started) transfers among ``trs``; returns those withdrawn."""
        gone = [t for t in trs if not t.started]
        if not gone:
            return gone
        ids = {id(t) for t in gone}
        first = min(self._pending.index(t) for t in gone)
        keep = [t for t in self._pending if id(t) not in ids]
        self._pending[:] = keep
        self._pending_keys[:] = [(t.priority, t.seq) for t in keep]
        for t in gone:
            self.bytes_moved -= t.nbytes
            self.transfers -= 1
        if first < len(keep):
            self._reproject(first)
        return gone

    def _reproject(self, idx: int) -> None:
        pending = self._pending
        prev = pending[idx - 1].done if idx > 0 else self._busy_until
        for i in range(idx, len(pending)):
            tr = pending[i]
            issued = tr.issued
            start = prev if prev > issued else issued
            tr.start = start
            prev = tr.done = start + tr.dur

    def advance(self, now: float) -> None:
        """Start transfers whose start time is before ``now``; complete those finished by
        ``now`` (observers see them in finish order)."""
        pending = self._pending
        running = self._running
        while pending and pending[0].start < now:
            tr = pending.pop(0)
            self._pending_keys.pop(0)
            tr.started = True
            self._busy_until = tr.done
            self.busy_time += tr.done - tr.start
            running.append(tr)
        if running and running[0].done <= now:
            callbacks = self.on_complete
            single = callbacks[0] if len(callbacks) == 1 else None
            while running and running[0].done <= now:
                tr = running.popleft()
                if single is not None:
                    single(tr)
                else:
                    for cb in callbacks:
                        cb(tr)

    def finish(self) -> None:
        """Complete all work (end of simulation), counting its busy time."""
        self.advance(float("inf"))

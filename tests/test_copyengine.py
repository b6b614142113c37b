"""The copy engine against an independent reference: a plain non-preemptive priority
server that picks the lowest (priority, issue order) queued transfer each time it frees up.

Random interleavings of submits (demand and prefetch, several sizes), promotions,
withdrawals and clock advances must give the same start/finish times, the same completion
order and the same projections of queued demand work."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from moesim.config.hardware import LinkConfig
from moesim.simulator.copyengine import (
    DEMAND,
    DONE,
    KEY,
    NBYTES,
    PREFETCH,
    PRIORITY,
    SEQ,
    START,
    STARTED,
    CopyEngine,
)

LINK = LinkConfig(bandwidth_gbps=1.0, latency_us=3.0)
SIZES = (1_000, 5_000, 20_000)


@dataclass
class Ref:
    """Reference transfer state."""

    seq: int
    priority: int
    issued: float
    dur: float
    start: float | None = None
    done: float | None = None
    cancelled: bool = False


class RefServer:
    """Non-preemptive single server; queued work is served by (priority, seq)."""

    def __init__(self) -> None:
        self.items: list[Ref] = []
        self.free_at = 0.0
        self.completed: list[int] = []

    def queued(self) -> list[Ref]:
        return sorted((r for r in self.items if r.start is None and not r.cancelled),
                      key=lambda r: (r.priority, r.seq))

    def advance(self, now: float) -> None:
        while True:
            q = self.queued()
            if not q:
                break
            r = q[0]
            start = max(self.free_at, r.issued)
            if start >= now:
                break
            r.start, r.done = start, start + r.dur
            self.free_at = r.done
        for r in sorted((r for r in self.items if r.done is not None and r.done <= now
                         and r.seq not in self.completed), key=lambda r: r.done):
            self.completed.append(r.seq)

    def projection(self) -> dict[int, float]:
        """Finish times if nothing else were submitted."""
        prev, out = self.free_at, {}
        for r in self.queued():
            prev = max(prev, r.issued) + r.dur
            out[r.seq] = prev
        return out


ops = st.lists(st.tuples(st.sampled_from(["demand", "prefetch", "promote", "cancel", "advance"]),
                         st.integers(0, 2), st.floats(0.0, 40e-6), st.integers(1, 4)),
               min_size=1, max_size=60)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_copy_engine_matches_reference_server(script: list[tuple[str, int, float, int]]) -> None:
    eng = CopyEngine(LINK)
    done_order: list[int] = []
    eng.on_complete.append(lambda trs: done_order.extend(tr[SEQ] for tr in trs))
    ref = RefServer()
    trs = []
    now = 0.0
    for op, size, dt, n in script:
        if op == "advance":
            now += dt
            eng.advance(now)
            ref.advance(now)
            for tr in trs:
                r = ref.items[tr[SEQ]]
                assert tr[STARTED] == (r.start is not None), (tr[SEQ], op)
                if tr[STARTED]:
                    assert (tr[START], tr[DONE]) == (r.start, r.done)
            assert done_order == ref.completed
        elif op in ("demand", "prefetch"):
            prio = DEMAND if op == "demand" else PREFETCH
            new = [eng.submit(k, SIZES[size], prio, now) for k in range(n)]
            for tr in new:
                ref.items.append(Ref(tr[SEQ], prio, now, eng.duration(SIZES[size])))
            trs.extend(new)
        elif op == "promote" and trs:
            pick = [trs[(size * 7 + i * 3) % len(trs)] for i in range(n)]
            eng.promote_many(pick)
            for tr in pick:
                r = ref.items[tr[SEQ]]
                if r.start is None and not r.cancelled:
                    r.priority = DEMAND
        elif op == "cancel" and trs:
            pick = [trs[(size * 5 + i * 11) % len(trs)] for i in range(n)]
            gone = eng.cancel_many(pick)
            expect = {tr[SEQ] for tr in pick if ref.items[tr[SEQ]].start is None and not ref.items[tr[SEQ]].cancelled}
            assert {tr[SEQ] for tr in gone} == expect
            for s in expect:
                ref.items[s].cancelled = True
        # queued demand work is always projected
        proj = ref.projection()
        for tr in trs:
            if tr[SEQ] in proj and tr[PRIORITY] == DEMAND:
                assert tr[DONE] == proj[tr[SEQ]], (tr[SEQ], op)
    eng.finish()
    ref.advance(float("inf"))
    assert done_order == ref.completed
    assert eng.bytes_moved == sum(tr[NBYTES] for tr in trs if not ref.items[tr[SEQ]].cancelled)


def test_boundaries_of_a_demand_copy_and_a_queued_prefetch_by_hand():
    """A 1 GB/s link, no latency, full efficiency: a 786,432-byte copy takes d = 786.432 us.
    A demand copy D and a prefetch P are issued at 0: D runs [0, d], P queues behind it.
    At exactly d, D has finished (its observers are told) and P has not started yet (it
    starts at d, which is not before now), so it can still be withdrawn. Otherwise P runs
    [d, 2d]; the engine is then busy 2 d."""
    from moesim.config.hardware import LinkConfig

    link = LinkConfig(bandwidth_gbps=1.0, latency_us=0.0, efficiency=1.0, half_efficiency_bytes=0)
    d = 786_432 / 1e9
    for withdraw in (True, False):
        eng = CopyEngine(link)
        told: list[list[int]] = []
        eng.on_complete.append(lambda trs, told=told: told.append([t[KEY] for t in trs]))
        dem = eng.submit(1, 786_432, DEMAND, 0.0)
        pf = eng.submit(2, 786_432, PREFETCH, 0.0)
        assert (dem[START], dem[DONE]) == (0.0, d)
        eng.advance(d)
        assert told == [[1]]
        assert not pf[STARTED]
        if withdraw:
            assert eng.cancel_many([pf]) == [pf]
            eng.finish()
            assert eng.busy_time == d
            assert eng.bytes_moved == 786_432
        else:
            eng.finish()
            assert (pf[START], pf[DONE]) == (d, 2 * d)
            assert told == [[1], [2]]
            assert eng.busy_time == 2 * d
            assert eng.bytes_moved == 2 * 786_432


def test_the_prefetch_copies_the_host_has_issued_by_hand():
    """``CopyEngine.handed(d)``: the host keeps the first d prefetch copies not yet done issued,
    in issue order, counting one copying; the last issued one's sequence number is returned
    (-1: none; infinity: every one for d None). A copying demand transfer, promoted and
    withdrawn prefetches do not count. Copies of 1,000 bytes take 4 us on the 1 GB/s link."""
    eng = CopyEngine(LINK)
    p = [eng.submit(k, 1_000, PREFETCH, 0.0) for k in range(4)]  # seq 0..3
    assert eng.handed(None) == float("inf")
    assert [eng.handed(d) for d in (1, 2, 3, 4, 5)] == [0, 1, 2, 3, 3]  # none copying yet: the queue's head first
    eng.advance(1e-6)  # p0 copying (0 .. 4 us)
    assert p[0][STARTED]
    assert [eng.handed(d) for d in (1, 2, 3)] == [-1, 1, 2]  # p0 takes one of the d
    eng.promote(p[1])  # needed now: no longer a prefetch in the line
    assert [eng.handed(d) for d in (1, 2, 3)] == [-1, 2, 3]
    assert eng.cancel_many([p[2]]) == [p[2]]  # withdrawn: a tombstone
    assert [eng.handed(d) for d in (2, 3)] == [3, 3]
    eng.advance(4.5e-6)  # p0 done at 4 us; the promoted p1 copying (4 .. 8 us)
    assert eng._running[0] is p[1]
    assert [eng.handed(d) for d in (1, 2)] == [3, 3]  # a copying demand transfer takes none of the d
    d = eng.submit(9, 1_000, DEMAND, 4.5e-6)  # queued behind p1, before p3
    assert d[START] == p[1][DONE]
    assert eng.handed(1) == 3

"""The prefetch queue (``simulator/prefetchq.py``; SpecMD appendix A.3) by hand, driven by a
scripted prefetcher (a user's own policy: it runs on the SimPy path): proposals outside the
later layers are ignored, and a routing point where the prefetcher proposes nothing still runs
an admission round for the proposals waiting from earlier layers. Found missing by mutation
testing of ``prefetchq.py``."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from moesim.policies.eviction import REGISTRY as EVICTION
from moesim.policies.eviction.lru import LRU
from moesim.policies.prefetch import REGISTRY, PrefetchPolicy
from moesim.simulator.engine import Simulation
from moesim.simulator.workload import build_workload
from tests.helpers import datasheet_times, scenario, small_model, trace_from_array

L, E = 4, 4  # layers, experts; one token, top-1: layer l routes to expert l
GBPS = 128  # the host link: a copy is shorter than a layer (checked where it matters)


def scripted(proposals: dict[int, list[tuple[int, int]]], pinned: Sequence[tuple[int, int]] = (),
             raw: dict[int, list[int]] | None = None) -> type[PrefetchPolicy]:
    """A prefetcher proposing, at each layer of every pass, the (layer, expert) pairs of
    ``proposals`` as cache keys, followed by the raw keys of ``raw``; ``pinned`` loaded
    before the replay (the static-pin admission rule)."""

    class Scripted(PrefetchPolicy):
        def propose(self, pass_index: int, layer: int) -> Sequence[int]:
            keys = [self.ctx.key(t, e) for t, e in proposals.get(layer, [])]
            return keys + (raw or {}).get(layer, [])

        def pinned(self) -> Sequence[int]:
            return [self.ctx.key(t, e) for t, e in pinned]

    return Scripted


def run(monkeypatch: pytest.MonkeyPatch, policy: type[PrefetchPolicy], capacity: str,
        gbps: int = GBPS, tokens: int = 1, **over: object) -> tuple[Simulation, object]:
    """The scripted ``policy`` over ``tokens`` passes of layer l routing expert l; ``over``: more
    scenario keys (``execution``, ...)."""
    monkeypatch.setitem(REGISTRY._classes, "scripted", policy)
    model = small_model(layers=L, experts=E, top_k=1)
    trace = trace_from_array(model, np.tile(np.arange(L).reshape(1, 1, L, 1), (1, tokens, 1, 1)))
    sc = scenario(cache={"capacity": capacity}, policies={"prefetch": "scripted"}, **over,
                  hardware={"preset": "a100-80g-pcie4", "links": {"pcie": {"bandwidth_gbps": gbps}}})
    sim = Simulation(sc, trace=trace, record_transfers=True, record_layers=True, record_decisions=True)
    return sim, sim.run()


def times(sim: Simulation, gbps: int) -> tuple[float, float, float]:
    """Expert compute f, non-expert a (datasheet figures) and one copy c over PCIe at
    ``gbps`` (the datasheet's 80% efficiency and 10 us latency)."""
    ffn, nonexp, _ = datasheet_times(sim.model, build_workload(sim.source.trace, 1))
    h, i = sim.model.hidden_size, sim.model.expert_intermediate_size
    return float(ffn[0]), float(nonexp[0]), 10e-6 + (6 * h * i + 65_536) / (gbps * 1e9 * 0.8)


def test_proposals_outside_the_later_layers_are_ignored(monkeypatch):
    """At layer 1 the prefetcher proposes an expert of layer 0 (earlier), one of layer 1
    (this layer), the key one past the last layer's last key (no layer) and then expert 2 of
    layer 2. Only the last is a later layer's: one prefetch issued, one predicted, and it is
    the expert layer 2 routes to (a predicted hit, used). Layers 0, 1 and 3 miss; layer 2
    hits its prefetched copy (landed: the copy is shorter than a layer)."""
    sim, res = run(monkeypatch, scripted({1: [(0, 1), (1, 2)]}, raw={1: [-1]}), "inf")
    ctx = sim.eviction.ctx
    past_the_end = L * E * len(ctx.precisions)
    _, res2 = run(monkeypatch, scripted({1: [(0, 1), (1, 2)]}, raw={1: [past_the_end, ctx.key(2, 2)]}), "inf")
    row = res2.steps.iloc[0]
    assert (row.prefetches_issued, row.prefetch_predicted, row.prefetch_predicted_hits, row.prefetch_actual) == (1, 1, 1, 1)
    assert (row.prefetches_used, row.hits, row.misses) == (1, 1, 3)
    assert [(k, kind) for k, kind, *_ in res2.transfers] == [
        (ctx.key(0, 0), "demand"), (ctx.key(1, 1), "demand"), (ctx.key(2, 2), "prefetch"), (ctx.key(3, 3), "demand")]
    # the first replay's proposals are all outside the later layers (-1 is below any layer)
    row = res.steps.iloc[0]
    assert (row.prefetches_issued, row.prefetch_predicted, row.misses) == (0, 0, 4)


def test_a_routing_point_without_proposals_still_admits_what_is_waiting(monkeypatch):
    """Capacity 3 experts; experts 0:0 and 1:1 statically pinned (one slot free). Per
    layer: non-expert a, expert compute f, one copy c, with f < c < f + a (checked; PCIe at
    128 GB/s).

    Layer 0 (routing point t0): 0:0 hits. Proposals 3:3 then 2:2: 3:3 takes the free slot
    (issued t0, lands t0 + c); 2:2 finds no victim (two static pins, 3:3 in flight) and
    waits, also at the layer's end t0 + f (3:3 still in flight). Layer 1 (t1 = t0 + f + a):
    3:3 has landed; 1:1 hits; the prefetcher proposes nothing, yet the admission round runs
    under the layer's pin (1:1): 2:2 evicts 3:3 (no longer in flight, admitted for layer 3,
    not layer 2) and is issued at t1, not at the layer's end t1 + f. Layer 2 (t1 + f + a):
    2:2 has landed, a hit of a used prefetch. Layer 3: 3:3 misses, a collision miss (evicted
    in this pass), fetched in place of 2:2. Hits 3, misses 1, prefetches issued 2, used 1."""
    policy = scripted({0: [(3, 3), (2, 2)]}, pinned=[(0, 0), (1, 1)])
    sim, res = run(monkeypatch, policy, "3 experts")
    f, a, c = times(sim, GBPS)
    assert f < c < f + a
    ctx = sim.eviction.ctx
    layers = {layer: (routing, end) for _, layer, _, routing, _, end in res.extra["layers"]}
    t0, t1 = layers[0][0], layers[1][0]
    assert t1 == pytest.approx(t0 + f + a, rel=1e-9)
    issued = {(k, kind): at for k, kind, at, *_ in res.transfers}
    assert issued[(ctx.key(3, 3), "prefetch")] == t0
    assert issued[(ctx.key(2, 2), "prefetch")] == t1
    assert issued[(ctx.key(3, 3), "demand")] == layers[3][0]
    row = res.steps.iloc[0]
    assert (row.hits, row.misses, row.collision_misses, row.late_prefetches) == (3, 1, 1, 0)
    assert (row.prefetches_issued, row.prefetches_used, row.prefetches_cancelled) == (2, 1, 0)
    # the decision log the calibration executor replays; layer 3's fetch evicts 2:2, the
    # least recent entry that is not statically pinned
    k = ctx.key
    assert sim.decisions == [
        (0, 0, "hit", k(0, 0)), (0, 0, "prefetch", k(3, 3)), (0, 0, "run", -1),
        (0, 1, "hit", k(1, 1)), (0, 1, "evict", k(3, 3)), (0, 1, "prefetch", k(2, 2)), (0, 1, "run", -1),
        (0, 2, "hit", k(2, 2)), (0, 2, "run", -1),
        (0, 3, "evict", k(2, 2)), (0, 3, "fetch", k(3, 3)), (0, 3, "run", -1)]


def test_a_key_proposed_again_while_it_waits_is_queued_once(monkeypatch):
    """Capacity 4 experts; 0:0 and 1:1 statically pinned; PCIe at 512 GB/s, so that two copies
    take less than a layer (2 c < f + a, checked). Layer 0: 0:0 hits; proposals 3:3, 3:0,
    2:2: the first two take the free slots, 2:2 waits (two static pins, two copies in
    flight). Layer 1: both have landed; 1:1 hits; the prefetcher proposes 2:2 again, which
    is still waiting, so it is not queued a second time: the round admits it once, evicting
    3:3 (the least recent that is not pinned), and 3:0 stays. Layer 2: 2:2 hits. Layer 3:
    3:3 misses (a collision: evicted in this pass) and evicts 3:0. Prefetches issued 3
    (3:3, 3:0, 2:2), used 1; predicted 4 (three at layer 0, one at layer 1), of which the
    layers really needed 3 (3:3, 2:2, 2:2 again), out of 3 actual (layer 3 once, layer 2
    twice)."""
    policy = scripted({0: [(3, 3), (3, 0), (2, 2)], 1: [(2, 2)]}, pinned=[(0, 0), (1, 1)])
    sim, res = run(monkeypatch, policy, "4 experts", gbps=512)
    f, a, c = times(sim, 512)
    assert 2 * c < f + a
    ctx = sim.eviction.ctx
    assert [(k, kind) for k, kind, *_ in res.transfers] == [
        (ctx.key(3, 3), "prefetch"), (ctx.key(3, 0), "prefetch"), (ctx.key(2, 2), "prefetch"),
        (ctx.key(3, 3), "demand")]
    row = res.steps.iloc[0]
    assert (row.hits, row.misses, row.collision_misses, row.late_prefetches) == (3, 1, 1, 0)
    assert (row.prefetches_issued, row.prefetches_used) == (3, 1)
    assert (row.prefetch_predicted, row.prefetch_predicted_hits, row.prefetch_actual) == (4, 3, 3)
    assert set(sim.cache.resident) == {ctx.key(0, 0), ctx.key(1, 1), ctx.key(2, 2), ctx.key(3, 3)}


def test_a_late_prefetch_is_waited_for_and_logged_as_a_hit(monkeypatch):
    """PCIe at 32 GB/s: a copy c is longer than a layer (c > f + a, checked). Layer 0: 0:0
    misses and is fetched; the proposal 1:1 is admitted and queued behind that demand copy,
    so it lands at t0 + 2c, after layer 1's routing point t0 + c + f + a: a late prefetch,
    used, and in the decision log a hit. Layers 2 and 3 miss."""
    sim, res = run(monkeypatch, scripted({0: [(1, 1)]}), "inf", gbps=32)
    f, a, c = times(sim, 32)
    assert c > f + a
    row = res.steps.iloc[0]
    assert (row.hits, row.late_prefetches, row.misses, row.prefetches_used) == (0, 1, 3, 1)
    k = sim.eviction.ctx.key
    assert sim.decisions == [
        (0, 0, "fetch", k(0, 0)), (0, 0, "prefetch", k(1, 1)), (0, 0, "run", -1),
        (0, 1, "hit", k(1, 1)), (0, 1, "run", -1),
        (0, 2, "fetch", k(2, 2)), (0, 2, "run", -1),
        (0, 3, "fetch", k(3, 3)), (0, 3, "run", -1)]


@pytest.mark.parametrize("mode", ["layer", "per-expert"])
def test_the_clock_a_policy_reads_at_each_admission(monkeypatch, mode):
    """An eviction policy that records the clock (now, pass, layer, pending) each time an
    admission walks its prefetch candidates. Capacity 1 expert, PCIe at 128 GB/s (f < c < a,
    checked); the prefetcher proposes 1:1 then 2:2 at layer 0; layer l routes to expert l.

    ``layer``: at layer 0's routing point a, 0:0 misses and is pinned in flight, so 1:1 waits
    (record 1: a, pending {0:0}); at the layer's end a + c + f the pins are released: 1:1
    evicts 0:0 (record 2) and 2:2 finds 1:1 in flight (record 3), both with nothing pending.
    Layer 1 routes at 2a + c + f, hits 1:1 (landed at a + 2c + f) and 2:2 fails under its pin
    (record 4: pending {1:1}); at its end 2a + c + 2f, 2:2 evicts 1:1 (record 5).

    ``per-expert``: at a, 1:1 takes the empty slot and 2:2 fails (record 1: pending {0:0});
    0:0 is fetched uncached (the demand copy goes first), runs, and at a + c + f, with
    nothing pending, 2:2 finds 1:1 in flight (record 2). At layer 1's routing point
    2a + c + f, 2:2 evicts 1:1 (record 3: pending {1:1}).

    Found missing by mutation testing of ``engine.py``: a clock left at the routing point or
    still holding the layer's pending experts at the layer-end admission went unnoticed."""
    seen: list[tuple[float, int, int, frozenset[int]]] = []

    class Recording(LRU):
        def prefetch_candidates(self):
            c = self.ctx.clock
            seen.append((c.now, c.pass_index, c.layer, frozenset(c.pending)))
            return super().prefetch_candidates()

    monkeypatch.setitem(REGISTRY._classes, "scripted", scripted({0: [(1, 1), (2, 2)]}))
    monkeypatch.setitem(EVICTION._classes, "recording", Recording)
    model = small_model(layers=L, experts=E, top_k=1)
    trace = trace_from_array(model, np.arange(L).reshape(1, 1, L, 1))
    sc = scenario(cache={"capacity": "1 experts"}, expert_compute=mode,
                  policies={"prefetch": "scripted", "eviction": "recording"},
                  hardware={"preset": "a100-80g-pcie4", "links": {"pcie": {"bandwidth_gbps": GBPS}}})
    sim = Simulation(sc, trace=trace)
    sim.run()
    f, a, c = times(sim, GBPS)
    assert f < c < a
    k = sim.eviction.ctx.key
    if mode == "layer":
        want = [(a, 0, 0, {k(0, 0)}), (a + c + f, 0, 0, set()), (a + c + f, 0, 0, set()),
                (2 * a + c + f, 0, 1, {k(1, 1)}), (2 * a + c + 2 * f, 0, 1, set())]
    else:
        want = [(a, 0, 0, {k(0, 0)}), (a + c + f, 0, 0, set()), (2 * a + c + f, 0, 1, {k(1, 1)})]
    assert [(p, layer, set(pending)) for _, p, layer, pending in seen] == [(p, la, s) for _, p, la, s in want]
    assert [now for now, *_ in seen] == pytest.approx([t for t, *_ in want], rel=1e-12)


@pytest.mark.parametrize(("depth", "withdrawn", "copies_after"), [
    (1, 2, 0), (2, 1, 1), (3, 0, 2), ("all", 0, 2)])
def test_a_prefetch_issued_to_the_copy_engine_is_not_withdrawn(monkeypatch, depth, withdrawn, copies_after):
    """``execution.prefetch_depth`` d: the host keeps d admitted prefetch copies issued to the
    copy engine, counting one copying; only the rest can be withdrawn. PCIe at 32 GB/s: a copy
    c is longer than a layer (c > f + a, checked). Capacity unbounded; 0:0 statically pinned.

    Layer 0 (routing point t0): 0:0 hits; the prefetcher proposes 1:0, 1:2 and 1:3, all
    admitted at t0: 1:0 starts at once, 1:2 and 1:3 queue. Layer 1 (t0 + f + a < t0 + c): 1:0
    is still copying and the layer needs 1:1 only. Issued by then: 1:0, and as many of 1:2,
    1:3 as d allows (d - 1); the others are withdrawn (2, 1, 0, 0 for d = 1, 2, 3, all). 1:1's
    demand copy waits for 1:0 (non-preemptive) and goes before the queued prefetches: it lands
    at t0 + 2c. Each issued prefetch still to copy (0, 1, 2) then runs ahead of the demand
    copies issued after it lands at its turn, layer 2's and layer 3's demand copies each
    arriving behind one of them (each later routing point comes before the copy ahead ends:
    c > f + a):

    - d = 1: 2:2 issued at t2 = t0 + 2c + f + a onto an idle link; the pass ends at
      t0 + 4c + 3f + 2a;
    - d = 2: 1:2 copies t0 + 2c .. t0 + 3c; 2:2 lands at t0 + 4c; the pass ends at
      t0 + 5c + 2f + a;
    - d = 3 or all: 2:2 goes before the queued 1:3 (demand first) at t0 + 3c, lands t0 + 4c;
      1:3 copies t0 + 4c .. t0 + 5c; 3:3 lands at t0 + 6c; the pass ends at t0 + 6c + f.
    """
    sim, res = run(monkeypatch, scripted({0: [(1, 0), (1, 2), (1, 3)]}, pinned=[(0, 0)]), "inf", gbps=32,
                   execution={"prefetch_depth": depth})
    f, a, c = times(sim, 32)
    assert c > f + a
    layers = {layer: (routing, end) for _, layer, _, routing, _, end in res.extra["layers"]}
    t0, end = layers[0][0], layers[3][1]
    expected = {1: 4 * c + 3 * f + 2 * a, 2: 5 * c + 2 * f + a, 3: 6 * c + f, "all": 6 * c + f}[depth]
    assert end - t0 == pytest.approx(expected, rel=1e-9)
    row = res.steps.iloc[0]
    assert (row.prefetches_issued, row.prefetches_cancelled, row.prefetches_used) == (3, withdrawn, 0)
    assert (row.hits, row.misses) == (1, 3)
    k = sim.eviction.ctx.key
    gone = [key for _, _, op, key in sim.decisions if op == "withdraw"]
    assert gone == [k(1, 2), k(1, 3)][2 - withdrawn:]
    # the bytes moved: the demand copies and every prefetch not withdrawn
    assert row.bytes_h2d == (3 + 3 - withdrawn) * sim.expert_bytes
    # the issued prefetches still to copy when 1:1 lands are copied after it
    landed_11 = next(done for key, _, _, _, done, _ in res.transfers if key == k(1, 1))
    assert landed_11 - t0 == pytest.approx(2 * c, rel=1e-9)
    after = [key for key, kind, _, start, _, _ in res.transfers if kind == "prefetch" and start >= landed_11]
    assert len(after) == copies_after


def test_withdrawals_in_two_layers_of_a_pass_add_up(monkeypatch):
    """The host issuing one copy at a time (depth 1), PCIe at 32 GB/s (c > f + a, checked),
    capacity unbounded. Layer 0 proposes 1:0, 1:2, 1:3 (as in the depth test): at layer 1, 1:0 is
    copying and 1:2, 1:3 are withdrawn. Layer 1 proposes 2:0 and 2:1, queued behind 1:1's demand
    copy (t0 + c .. t0 + 2c): 2:0 copies from t0 + 2c, and layer 2's routing point
    t0 + 2c + f + a comes before it ends, so 2:1, not yet issued, is withdrawn. The pass counts
    three withdrawals, in that order."""
    policy = scripted({0: [(1, 0), (1, 2), (1, 3)], 1: [(2, 0), (2, 1)]}, pinned=[(0, 0)])
    sim, res = run(monkeypatch, policy, "inf", gbps=32, execution={"prefetch_depth": 1})
    f, a, c = times(sim, 32)
    assert c > f + a
    row = res.steps.iloc[0]
    assert (row.prefetches_issued, row.prefetches_cancelled) == (5, 3)
    k = sim.eviction.ctx.key
    assert [key for _, _, op, key in sim.decisions if op == "withdraw"] == [k(1, 2), k(1, 3), k(2, 1)]


def test_a_proposal_still_waiting_at_its_layer_is_withdrawn_not_admitted_later(monkeypatch):
    """Capacity 2 experts, 0:0 statically pinned, PCIe at 32 GB/s (c > f + a, checked). Layer 0
    (t0): 0:0 hits; the proposal 2:3 takes the free slot (copying until t0 + c), 1:2 finds no
    room (0:0 pinned, 2:3 in flight) and waits, also at the layer's end. Layer 1's routing point
    (t0 + f + a, 2:3 still in flight) withdraws 1:2: its layer has come. 1:1 finds no room either
    and is fetched uncached. At layer 1's end 2:3 has landed and could be evicted for a proposal
    of layer 1, but none is waiting: one prefetch issued in the pass, not two. Layers 2 and 3
    miss (2:3 was a wrong guess)."""
    sim, res = run(monkeypatch, scripted({0: [(2, 3), (1, 2)]}, pinned=[(0, 0)]), "2 experts", gbps=32)
    f, a, c = times(sim, 32)
    assert c > f + a
    row = res.steps.iloc[0]
    assert (row.prefetches_issued, row.prefetches_cancelled, row.uncached_fetches) == (1, 0, 1)
    assert (row.hits, row.misses) == (1, 3)
    k = sim.eviction.ctx.key
    assert [key for _, _, op, key in sim.decisions if op == "prefetch"] == [k(2, 3)]
    assert not sim.pfq.waiting
    assert not sim.pfq.queued


def test_the_last_layer_s_admissions_are_not_pinned_into_the_next_pass(monkeypatch):
    """Two passes, layer l routing expert l in both; capacity 3 experts, 0:0 statically pinned,
    PCIe at 512 GB/s (every copy lands within its layer: 2c < f + a, checked); LRU. The
    prefetcher proposes 3:2 at layer 0 and 3:1 at layer 2. Pass 0: 3:2 is admitted at layer 0,
    evicted by layer 2's demand fetch of 2:2; 3:1 is admitted at layer 2 (evicting 1:1); layer 3
    fetches 3:3 in place of 2:2. Layer 3's routing point ends 3:1's admission for layer 3. Pass 1,
    layer 0: 3:2 again needs room; 3:1 and 3:3 are unpinned and 3:1 the least recent, so it is
    the victim (still pinned as an admission for layer 3, 3:3 would be)."""
    sim, _ = run(monkeypatch, scripted({0: [(3, 2)], 2: [(3, 1)]}, pinned=[(0, 0)]), "3 experts", gbps=512, tokens=2)
    f, a, c = times(sim, 512)
    assert 2 * c < f + a
    k = sim.eviction.ctx.key
    assert [(op, key) for p, layer, op, key in sim.decisions if p == 0 and op in ("evict", "prefetch", "fetch")] == [
        ("prefetch", k(3, 2)), ("fetch", k(1, 1)), ("evict", k(3, 2)), ("fetch", k(2, 2)), ("evict", k(1, 1)),
        ("prefetch", k(3, 1)), ("evict", k(2, 2)), ("fetch", k(3, 3))]
    assert [(op, key) for p, layer, op, key in sim.decisions if (p, layer) == (1, 0)][:3] == [
        ("hit", k(0, 0)), ("evict", k(3, 1)), ("prefetch", k(3, 2))]

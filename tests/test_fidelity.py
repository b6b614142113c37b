"""Replay fidelity (issue 11): moesim equals an independent replay written from the contract
(tests/reference_replay.py, no moesim imports) exactly, on real logs and synthetic traces, in
``layer`` and ``per-expert`` execution; properties of the pinning rule in every mode; Least-
Stale's orders by hand; the prefetch contract's LRU pathology by hand."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moesim.policies.eviction import LeastStale, LeastStaleParams
from moesim.policies.registry import Clock, PolicyContext
from moesim.simulator.copyengine import NBYTES
from moesim.simulator.engine import Simulation, simulate
from moesim.traces.synth import generate, synth_from_preset
from tests import reference_replay as R
from tests.helpers import real_dir, scenario, small_model, trace_from_array

MOESIM_POLICY = {
    "lru": "lru",
    "fifo": "fifo",
    "fld": "fld",
    "least-stale": "least-stale",
    "least-stale-permissive": {"name": "least-stale", "prefetch_evicts_current": True},
    "least-stale-absolute": {"name": "least-stale", "order": "absolute"},
}


def moesim_counts(trace, policy: str, capacity: int, mode: str, prefetch="oracle") -> tuple[int, int, int]:
    sc = scenario(timing=False, expert_compute=mode, cache={"capacity": f"{capacity} experts"},
                  policies={"eviction": MOESIM_POLICY[policy], "prefetch": prefetch})
    s = simulate(sc, trace=trace).summary
    return s["hits"], s["misses"], s["collision_misses"]


def mixtral_problem0():
    from tests.helpers import mixtral_trace

    t = mixtral_trace("gsm8k")
    return t.take(t.request == 0)


def mixtral_path() -> Path:
    return real_dir() / "mixtral-8x7b-vllm" / "routing_data_collected_gsm8k_2_routing.jsonl"


# -- the issue's own figures (an independent replay that pins the whole layer) ---------------

@pytest.mark.real
def test_the_issues_mixtral_figures():
    """Issue 11: on Mixtral GSM8K problem 0, oracle prefetch, cache-only, a replay that pins
    the whole layer gives LRU at 64 experts 1,715 misses / 1,455 collision misses and
    least-stale (the absolute order moesim had) at 80 experts 259 / 0."""
    t = mixtral_problem0()
    assert moesim_counts(t, "lru", 64, "layer")[1:] == (1715, 1455)
    assert moesim_counts(t, "least-stale-absolute", 80, "layer")[1:] == (259, 0)


@pytest.mark.real
@pytest.mark.parametrize("capacity", [16, 48, 64, 80, 128])
@pytest.mark.parametrize("policy", list(MOESIM_POLICY))
def test_mixtral_oracle_equals_the_reference_replay(policy, capacity):
    passes = R.mixtral_gsm8k_passes(mixtral_path())
    ref = R.replay(passes, capacity, R.POLICIES[policy](32), "layer", R.oracle(passes))
    assert moesim_counts(mixtral_problem0(), policy, capacity, "layer") == ref.as_tuple()


@pytest.fixture(scope="module")
def flame_prefill():
    from moesim.traces.importers import import_trace

    folder = real_dir() / "flame-moe-290m" / "prefill"
    if not folder.is_dir():
        pytest.skip(f"{folder} is missing (../shared/traces/real is read-only reference data)")
    return import_trace("flame-csv", [folder], None)[0], R.flame_prefill_passes(folder)


@pytest.mark.real
@pytest.mark.parametrize("mode", ["per-expert", "layer"])
@pytest.mark.parametrize("capacity", [5, 25])  # 1% and 5% of FLAME-MoE's 512 experts
@pytest.mark.parametrize("policy", ["lru", "fld", "least-stale", "least-stale-permissive"])
def test_flame_prefill_oracle_equals_the_reference_replay(flame_prefill, policy, capacity, mode):
    trace, passes = flame_prefill
    ref = R.replay(passes, capacity, R.POLICIES[policy](8), mode, R.oracle(passes))
    assert moesim_counts(trace, policy, capacity, mode) == ref.as_tuple()


def topk_proposals(trace, passes, overfetch: float = 1.0):
    """next-gate-topk written again from SpecMD §3.1.4: at layer l each token's top
    ceil(k * overfetch) experts by predicted next-layer probability (``pred_next``), their
    union ordered by summed prediction (descending, ties by expert id)."""
    n = math.ceil(trace.model.top_k * overfetch)
    rows: dict[tuple[int, int], list[int]] = {}
    order = sorted(range(len(trace.request)), key=lambda i: (int(trace.request[i]), int(trace.step[i]),
                                                              int(trace.position[i])))
    keys = sorted({(int(trace.request[i]), int(trace.step[i])) for i in order})
    index = {k: p for p, k in enumerate(keys)}
    for i in order:
        rows.setdefault((index[(int(trace.request[i]), int(trace.step[i]))], int(trace.layer[i])), []).append(i)

    def props(p: int, layer: int) -> list[tuple[int, int]]:
        if layer + 1 >= trace.model.num_layers or (p, layer) not in rows:
            return []
        pred = [list(map(float, trace.pred_next[i])) for i in rows[(p, layer)]]
        total = [sum(col) for col in zip(*pred, strict=True)]
        chosen = set()
        for scores in pred:
            chosen.update(sorted(range(len(scores)), key=lambda e: -scores[e])[:n])
        return [(layer + 1, e) for e in sorted(chosen, key=lambda e: (-total[e], e))]

    return props


@pytest.mark.parametrize("mode", ["layer", "per-expert"])
@pytest.mark.parametrize("policy", ["lru", "fifo", "fld", "least-stale", "least-stale-absolute"])
@pytest.mark.parametrize("capacity", [6, 20, 48])
def test_next_gate_topk_equals_the_reference_replay(policy, capacity, mode):
    trace = synth_from_preset("olmoe-1b-7b", layers=4, requests=3, prompt_tokens=6, tokens=20, seed=7,
                              pred_next=True, pred_noise=0.5)
    passes = R.trace_passes(trace)
    ref = R.replay(passes, capacity, R.POLICIES[policy](4), mode, topk_proposals(trace, passes, 1.5))
    got = moesim_counts(trace, policy, capacity, mode, {"name": "next-gate-topk", "overfetch": 1.5})
    assert got == ref.as_tuple()


# -- properties of the pinning rule, in every mode -------------------------------------------

modes = st.sampled_from(["layer", "on-arrival", "per-expert"])
prefetchers = st.sampled_from(["none", "oracle", "previous-token", {"name": "lookahead", "depth": 2}])
evictions = st.sampled_from(["lru", "fifo", "fld", "least-stale", "belady", "lfu", "score"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 4), st.integers(2, 10), st.integers(1, 3), st.integers(2, 12), st.integers(0, 10**6),
       st.integers(0, 16), st.integers(1, 3), modes, prefetchers, evictions, st.booleans())
def test_pinning_properties(layers, experts, k, tokens, seed, cap, batch, mode, prefetch, eviction, timing):
    """Occupancy never exceeds capacity; no pinned entry is ever evicted (layer/on-arrival:
    an expert the layer routes to, until the layer has run; per-expert: the running expert
    and the one looked up next); every collision miss is a miss on a key evicted earlier in
    the same pass, and every such miss is a collision miss."""
    model = small_model(layers, experts, min(k, experts))
    trace = generate(model, requests=batch, prompt_tokens=seed % 4, tokens=tokens, seed=seed)
    sc = scenario(timing=timing, expert_compute=mode, cache={"capacity": f"{cap} experts"},
                  policies={"eviction": eviction, "prefetch": prefetch}, workload={"batch_size": batch})
    sim = Simulation(sc, trace=trace, record_decisions=True)
    res = sim.run()
    s = res.summary
    assert s["cache_peak_bytes"] <= cap * model.expert_bytes["bf16"]
    wl = sim.wl
    num_l = model.num_layers
    evicted: set[int] = set()
    collisions = 0
    last_pass = -1
    pinned: set[int] = set()
    cell = None
    assert sim.decisions is not None
    for p, layer, op, key in sim.decisions:
        if p != last_pass:
            evicted.clear()
            last_pass = p
        if (p, layer) != cell:
            cell = (p, layer)
            b = p * num_l + layer
            routed = set((wl.keys()[wl.off[b]:wl.off[b + 1]] * sim.num_prec + sim.default_prec).tolist())
            pinned = set(routed) if mode != "per-expert" else set()
        if op == "evict":
            assert key not in pinned, (p, layer, key)
            evicted.add(key)
        elif op in ("fetch", "bypass"):
            collisions += key in evicted
            if mode == "per-expert":
                pinned.add(key)
        elif op == "hit" and mode == "per-expert":
            pinned.add(key)
        elif op == "run":
            if key == -1:
                pinned = set()
            else:
                pinned.discard(key)
    assert collisions == s["collision_misses"]
    assert res.steps["collision_misses"].sum() == s["collision_misses"]
    cache = sim.cache  # bytes in use are those of the resident and in-flight entries
    assert cache.used == sum(cache.resident.values()) + sum(tr[NBYTES] for tr in cache.inflight.values())


# -- Least-Stale's orders, by hand -----------------------------------------------------------

def least_stale(order: str = "relative", strict: bool = True):
    clock = Clock()
    ctx = PolicyContext(num_layers=4, num_experts=4, top_k=1, expert_bytes=1, rng=np.random.default_rng(0),
                        clock=clock)
    return LeastStale(LeastStaleParams(order=order, prefetch_evicts_current=not strict), ctx), clock, ctx


def test_least_stale_relative_order_by_hand():
    """Keys (layer, expert). Pass 0 touches (0,0) (1,1) (2,2) (3,3) (3,0), all stale in pass
    1; pass 1 touches (0,1) at layer 0 and, at layer 1 with (1,2) routed and not yet run,
    (1,2): both current. Relative order at layer 1, each queue: left first - layer 0, then
    layer 1's experts not still to run - then upcoming layers farthest first (layer 3 in FIFO
    order, layer 2), layer 1's expert still to run last. Stale: (0,0) (1,1) (3,3) (3,0)
    (2,2); current: (0,1) (1,2)."""
    pol, clock, ctx = least_stale()
    for layer, e in [(0, 0), (1, 1), (2, 2), (3, 3), (3, 0)]:
        clock.layer = layer
        pol.on_insert(ctx.key(layer, e), True)
    clock.pass_index, clock.layer = 1, 0
    pol.on_insert(ctx.key(0, 1), True)
    clock.layer = 1
    clock.pending = {ctx.key(1, 2)}
    pol.on_insert(ctx.key(1, 2), True)
    k = ctx.key
    stale = [k(0, 0), k(1, 1), k(3, 3), k(3, 0), k(2, 2)]
    current = [k(0, 1), k(1, 2)]
    assert list(pol.candidates()) == stale + current
    assert list(pol.prefetch_candidates()) == stale  # never a current expert for a prefetch
    clock.pending = set()  # the layer has run: (1,2) is left now
    assert list(pol.candidates())[-2:] == [k(0, 1), k(1, 2)]
    pol_p, _clock_p, _ = least_stale(strict=False)
    assert list(pol_p.prefetch_candidates()) == list(pol_p.candidates())
    pol_a, clock_a, _ = least_stale("absolute")
    for layer, e in [(3, 3), (1, 1), (2, 2), (0, 0)]:
        clock_a.layer = layer
        pol_a.on_insert(k(layer, e), True)
    clock_a.layer = 1
    assert list(pol_a.candidates()) == [k(0, 0), k(1, 1), k(2, 2), k(3, 3)]  # layer index, layer 0 first


# -- the prefetch contract by hand: SpecMD Fig. 3's LRU pathology ----------------------------

def oracle_steps(trace, policy, capacity: int) -> list[list[int]]:
    """Per pass (hits, misses, collision misses) of a cache-only replay with oracle prefetch."""
    sc = scenario(timing=False, cache={"capacity": f"{capacity} experts"},
                  policies={"eviction": policy, "prefetch": "oracle"})
    return simulate(sc, trace=trace).steps[["hits", "misses", "collision_misses"]].values.tolist()


def test_lru_evicts_a_selected_expert_for_its_own_batch():
    """Two layers, 4 experts, top-2, room for 3, oracle prefetch, cache-only, layer
    execution. Keys written layer:expert. Pass 0 routes layer 0 -> (0, 1), layer 1 -> (2, 3);
    pass 1 routes layer 0 -> (0, 1), layer 1 -> (3, 0).

    LRU. Pass 0, layer 0: 0:0 and 0:1 miss. Proposals 1:2, 1:3 wait; 1:2 enters (free
    room); 1:3 finds every entry pinned (0:0, 0:1 by the layer, 1:2 as an admission for the
    same target) and waits until layer 0 has run, then evicts the oldest, 0:0. Layer 1: 1:2
    and 1:3 hit. LRU order: 0:1, 1:2, 1:3. Pass 1, layer 0: 0:0 misses (evicted in pass 0:
    no collision) and evicts 1:2 (0:1 is pinned); 0:1 hits. Order: 1:3, 0:0, 0:1. Proposals:
    1:3 is resident - selected, which LRU ignores - and 1:0 must evict the oldest unpinned
    entry: 1:3, the selected expert itself. Layer 1: 1:3 misses, a collision miss; 1:0 hits.
    Steps (hits, misses, collisions): (2, 2, 0), (2, 2, 1).

    Least-Stale (strict). Pass 0, layer 0: 0:0, 0:1 miss; 1:2 enters (free room); 1:3 waits,
    at the routing point and after the layer has run, for a stale entry (none: everything is
    current in pass 0) and is withdrawn at layer 1. Layer 1: 1:2 hits; 1:3 misses and evicts
    the first current entry of a left layer, 0:0. (1, 3, 0). Pass 1 (all stale), layer 0:
    0:0 misses; stale order at layer 0: nothing left, layer 1 (farthest upcoming) 1:2, 1:3,
    then layer 0's expert still to run (0:1, pinned): 1:2 goes. 0:1 hits. Proposals: 1:3
    resident - selected, marked current; 1:0 waits for a stale entry, finds none (the only
    stale one, 1:3, became current) and is withdrawn. Layer 1: 1:3 hits; 1:0 misses and
    evicts 0:0 (current, left). (2, 2, 0): one miss more than LRU in all, no collision."""
    model = small_model(layers=2, experts=4, top_k=2)
    ex = np.array([[[[0, 1], [2, 3]], [[0, 1], [3, 0]]]])  # [request, token, layer, k]
    t = trace_from_array(model, ex)

    def run(policy):
        return oracle_steps(t, policy, 3)

    assert run("lru") == [[2, 2, 0], [2, 2, 1]]
    assert run("least-stale") == [[1, 3, 0], [2, 2, 0]]


def test_strict_least_stale_turns_declined_prefetches_into_collisions():
    """Why strict Least-Stale loses to LRU when the cache can stream a pass (FLAME-MoE prefill
    at 25%, layer execution: LRU 0 collision misses, least-stale 3,895). Three layers, one
    expert each used every pass (0:0, 1:0, 2:0), room for 2, oracle prefetch, cache-only.

    LRU. Pass 0: 0:0 misses; 1:0 is admitted at layer 0 (free room) and hits; at layer 1 the
    proposal 2:0 evicts the oldest unpinned entry, 0:0, and hits at layer 2: (2, 1, 0). Pass 1:
    0:0 misses and evicts 1:0 (oldest); the proposal 1:0 evicts 2:0 (oldest unpinned) and hits;
    the proposal 2:0 evicts 0:0 and hits: (2, 1, 0). Every pass streams.

    Least-Stale, strict. Pass 0: 0:0 misses; 1:0 admitted, hits; the proposal 2:0 finds no
    stale entry (both are current) and is declined, then withdrawn at layer 2, where 2:0
    misses and evicts the current left 0:0: (1, 2, 0). Pass 1 (1:0, 2:0 stale): 0:0 misses
    and evicts the farthest upcoming stale entry, 2:0; 1:0 is selected (current) and hits;
    the proposal 2:0 is declined again (no stale entry left) and 2:0 misses at layer 2 - a
    collision miss: (1, 2, 1).

    Least-Stale with prefetch_evicts_current: the declined proposals evict the current left
    entry instead (0:0 at layer 1 in both passes), so 2:0 is prefetched back: (2, 1, 0) and
    (2, 1, 0) - evicting a stale upcoming 2:0 at layer 0 costs nothing when the prefetcher may
    bring it back."""
    model = small_model(layers=3, experts=2, top_k=1)
    t = trace_from_array(model, np.zeros((1, 2, 3, 1), dtype=np.int64))

    def run(policy):
        return oracle_steps(t, policy, 2)

    assert run("lru") == [[2, 1, 0], [2, 1, 0]]
    assert run("least-stale") == [[1, 2, 0], [1, 2, 1]]
    assert run({"name": "least-stale", "prefetch_evicts_current": True}) == [[2, 1, 0], [2, 1, 0]]


def test_a_fetched_lower_precision_copy_stays_pinned_for_its_layer():
    """One layer, top-2, fetch-lowest-bit (int4), room for exactly one int4 expert, two passes
    routing experts (0, 1). Pass 0: 0 misses and its int4 copy is fetched; 1 misses and finds
    the only entry pinned (the layer computes from it), so 1 is fetched to the staging buffer
    (uncached). Pass 1: 0 finds its int4 copy resident (a hit at low precision); 1 misses and
    is uncached again. Per pass (hits, misses, uncached): (0, 2, 1), (1, 1, 1)."""
    model = small_model(layers=1, experts=4, top_k=2)
    t = trace_from_array(model, np.array([[[[0, 1]], [[0, 1]]]]))
    sc = scenario(timing=False, cache={"capacity": f"{model.expert_bytes['int4']}B"},
                  policies={"miss": {"name": "fetch-lowest-bit", "precisions": ["bf16", "int4"]}})
    steps = simulate(sc, trace=t).steps
    assert steps[["hits", "misses", "uncached_fetches"]].values.tolist() == [[0, 2, 1], [1, 1, 1]]

"""Eviction policies against independent references: libCacheSim (LRU, FIFO), exhaustive
optimum (Belady), and Belady as a lower bound for every registered policy."""

from __future__ import annotations

import functools

import libcachesim as lcs
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from moesim.policies.eviction import REGISTRY as EVICTION
from moesim.simulator.engine import simulate
from moesim.traces.synth import generate, synth_from_preset
from tests import reference_replay as R
from tests.helpers import (
    access_stream,
    batch_access_stream,
    batch_cells,
    experts_cap,
    flame_decode_trace,
    mixtral_trace,
    scenario,
    small_model,
    trace_from_array,
)


def lcs_misses(stream: list[int], capacity: int, algo: str) -> int:
    cache = getattr(lcs, algo)(cache_size=capacity)
    req = lcs.Request()
    req.obj_size = 1
    misses = 0
    for key in stream:
        req.obj_id = key
        misses += not cache.get(req)
    return misses


def run(trace, policy, capacity: int, batch: int = 1, timing: bool = False, mode: str = "layer"):
    sc = scenario(timing=timing, cache={"capacity": experts_cap(capacity, trace.model)}, expert_compute=mode,
                  policies={"eviction": policy}, workload={"batch_size": batch})
    return simulate(sc, trace=trace).summary


def fifo_running_pinned(cells: list[list[int]], capacity: int) -> tuple[int, int]:
    """Reference FIFO in ``per-expert`` execution, where the expert running while the next
    one is looked up (the previous key of the same layer cell) cannot be evicted. ``cells``
    lists each (pass, layer)'s keys in access order. Returns (misses, conflicts): a conflict
    is a miss for which plain FIFO would have evicted the running expert (where libCacheSim,
    which knows no layers, differs)."""
    from collections import deque

    queue: deque[int] = deque()
    cached: set[int] = set()
    misses = conflicts = 0
    for keys in cells:
        for j, key in enumerate(keys):
            if key in cached:
                continue
            misses += 1
            running = keys[j - 1] if j else None
            if len(cached) >= capacity:
                if queue and queue[0] == running:
                    conflicts += 1
                victim = next((v for v in queue if v != running), None)
                if victim is None:
                    continue
                queue.remove(victim)
                cached.discard(victim)
            queue.append(key)
            cached.add(key)
    return misses, conflicts


def batch1_cells(trace) -> list[list[int]]:
    e = trace.model.num_experts
    order = np.lexsort((trace.layer, trace.step, trace.request))
    return [[int(trace.layer[i]) * e + int(x) for x in trace.experts[i]] for i in order]


def check_fifo(trace, cells, stream, capacity, batch=1) -> int:
    ref, conflicts = fifo_running_pinned(cells, capacity)
    assert run(trace, "fifo", capacity, batch, mode="per-expert")["misses"] == ref
    if conflicts == 0:
        assert ref == lcs_misses(stream, capacity, "FIFO")
    return conflicts


# The sequential stream is the physics of per-expert execution: with no prefetch and room for
# the running expert and the next, LRU is libCacheSim's LRU on the per-access stream.
@pytest.mark.parametrize("capacity", [8, 40, 120, 400])
def test_lru_per_expert_equals_libcachesim_on_synthetic(capacity):
    trace = synth_from_preset("olmoe-1b-7b", requests=2, tokens=120, seed=5)
    assert run(trace, "lru", capacity, mode="per-expert")["misses"] == lcs_misses(access_stream(trace), capacity, "LRU")


def test_fifo_per_expert_equals_libcachesim_up_to_running_conflicts_on_synthetic():
    trace = synth_from_preset("olmoe-1b-7b", requests=2, tokens=120, seed=5)
    stream = access_stream(trace)
    conflicts = {c: check_fifo(trace, batch1_cells(trace), stream, c) for c in (8, 40, 120, 400)}
    assert conflicts[8] == conflicts[40] == 0  # equal to libCacheSim there
    assert conflicts[400] > 0  # here plain FIFO would evict the running expert


@pytest.mark.parametrize("capacity", [8, 40, 120, 400])
@pytest.mark.parametrize("policy", ["lru", "fifo"])
def test_layer_execution_equals_the_reference_replay_on_synthetic(capacity, policy):
    """Layer execution pins the whole layer: LRU/FIFO then differ from libCacheSim where a
    layer's own resident expert would have been the victim; the independent replay written
    from the contract is the reference."""
    trace = synth_from_preset("olmoe-1b-7b", requests=2, tokens=120, seed=5)
    passes = R.trace_passes(trace)
    c = R.replay(passes, capacity, R.POLICIES[policy](trace.model.num_layers), "layer")
    res = run(trace, policy, capacity)
    assert (res["hits"], res["misses"], res["collision_misses"]) == c.as_tuple()


def test_layer_pinning_is_why_layer_lru_differs_from_libcachesim():
    """Hand-checked: one layer, top-2, capacity 2, stream (a b) (c a). At c the cache holds
    a and b with a older; libCacheSim's LRU evicts a, then misses a again (4 misses). Layer
    execution pins a (the layer routes to it), evicts b and hits a (3 misses); per-expert
    execution pins only the running expert (none when c is the layer's first) and takes
    libCacheSim's 4."""
    model = small_model(layers=1, experts=4, top_k=2)
    t = trace_from_array(model, np.array([[[[0, 1]], [[2, 0]]]]))
    assert lcs_misses([0, 1, 2, 0], 2, "LRU") == 4
    assert run(t, "lru", 2)["misses"] == 3
    assert run(t, "lru", 2, mode="per-expert")["misses"] == 4


@pytest.mark.real
@pytest.mark.parametrize("capacity", [2, 16, 64, 128, 200])
def test_lru_fifo_per_expert_equal_libcachesim_on_real_mixtral(capacity):
    trace = mixtral_trace("gsm8k")
    stream = access_stream(trace)
    assert run(trace, "lru", capacity, mode="per-expert")["misses"] == lcs_misses(stream, capacity, "LRU")
    check_fifo(trace, batch1_cells(trace), stream, capacity)


def flame_cells(trace, batch: int) -> list[list[int]]:
    from collections import defaultdict

    e = trace.model.num_experts
    cells: dict[tuple[int, int], list[tuple[int, list[int]]]] = defaultdict(list)
    for i in range(len(trace)):
        cells[(int(trace.step[i]), int(trace.layer[i]))].append((int(trace.request[i]), trace.experts[i].tolist()))
    out = []
    for key in sorted(cells):
        keys: list[int] = []
        for _r, ex in sorted(cells[key], key=lambda c: c[0]):
            keys.extend(key[1] * e + x for x in ex if key[1] * e + x not in keys)
        out.append(keys)
    return out


@pytest.mark.real
@pytest.mark.parametrize("capacity", [64, 128, 256, 400])
def test_lru_fifo_per_expert_equal_libcachesim_on_real_flame_batch64(capacity):
    """FLAME-MoE decode: its 64 sequences decoded as one batch (10 steps x 8 layers)."""
    trace = flame_decode_trace()
    assert trace.num_requests == 64
    assert trace.num_steps() == 640
    stream = batch_access_stream(trace, 64)
    res = run(trace, "lru", capacity, batch=64, mode="per-expert")
    assert res["expert_accesses"] == len(stream)
    assert res["misses"] == lcs_misses(stream, capacity, "LRU")
    check_fifo(trace, flame_cells(trace, 64), stream, capacity, batch=64)


# -- Belady ----------------------------------------------------------------------------------

def exhaustive_optimum(trace, capacity: int, mode: str, batch: int = 1) -> int:
    """Fewest misses over every eviction choice the pinning rule allows. ``layer``: a miss may
    evict any cached expert its (pass, layer) does not route to; ``per-expert``: any but the
    running expert (the previous one of the same (pass, layer)). A miss with no victim is not
    cached (it streams)."""
    seq = []  # (key, pinned when it is looked up)
    for keys in batch_cells(trace, batch):
        for j, k in enumerate(keys):
            seq.append((k, frozenset(keys) if mode == "layer" else frozenset(keys[j - 1:j])))

    @functools.cache
    def best(pos: int, cache: frozenset[int]) -> int:
        if pos == len(seq):
            return 0
        key, pinned = seq[pos]
        if key in cache:
            return best(pos + 1, cache)
        if len(cache) < capacity:
            return 1 + best(pos + 1, cache | {key})
        options = [v for v in cache if v not in pinned]
        if not options:
            return 1 + best(pos + 1, cache)
        return 1 + min(best(pos + 1, (cache - {v}) | {key}) for v in options)

    return best(0, frozenset())


def widest_layer(trace, batch: int) -> int:
    """The most distinct experts one (pass, layer) routes to."""
    return max(len(keys) for keys in batch_cells(trace, batch))


def batched_trace(layers: int, experts: int, k: int, tokens: int, seed: int, batch: int, routing: str = "realistic"):
    return generate(small_model(layers, experts, min(k, experts)), requests=batch, tokens=tokens, seed=seed,
                    routing=routing)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 3), st.integers(2, 6), st.integers(1, 2), st.integers(2, 7), st.integers(0, 10**6),
       st.integers(1, 3), st.integers(1, 6), st.sampled_from(["layer", "per-expert"]))
def test_belady_equals_the_exhaustive_optimum(layers, experts, k, tokens, seed, batch, capacity, mode):
    """Where every (pass, layer)'s experts fit in the cache (in ``per-expert`` execution only
    the running expert is pinned, so a miss always has a victim or no choice to make)."""
    trace = batched_trace(layers, experts, k, tokens, seed, batch, "uniform")
    assume(mode == "per-expert" or widest_layer(trace, batch) <= capacity)
    assert run(trace, "belady", capacity, batch, mode=mode)["misses"] == exhaustive_optimum(trace, capacity, mode,
                                                                                            batch)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 3), st.integers(2, 12), st.integers(1, 3), st.integers(2, 30),
       st.integers(0, 10**6), st.integers(1, 20), st.integers(1, 3))
def test_belady_is_a_lower_bound_for_every_policy(layers, experts, k, tokens, seed, capacity, batch):
    trace = batched_trace(layers, experts, k, tokens, seed, batch)
    assume(widest_layer(trace, batch) <= capacity)
    opt = run(trace, "belady", capacity, batch)["misses"]
    for name in EVICTION.names():
        assert opt <= run(trace, name, capacity, batch)["misses"], name


def test_belady_can_miss_more_where_a_layer_routes_to_more_experts_than_the_cache_holds():
    """A (pass, layer) routed to 8 experts with room for 6: its last two misses stream without
    being cached. Belady evicts by next use alone, so before that layer it keeps expert 2
    (next used first in it) over expert 6 (next used last in it, then again in the layer
    after), so 6 streams and misses again; the exhaustive optimum keeps 6, and FIFO happens
    to match it. With room for the layer, the same trace gives Belady the optimum."""
    trace = batched_trace(1, 8, 3, 12, 66531, 3)
    assert widest_layer(trace, 3) == 8
    assert exhaustive_optimum(trace, 6, "layer", 3) == run(trace, "fifo", 6, 3)["misses"] == 16
    assert run(trace, "belady", 6, 3)["misses"] == 17
    assert run(trace, "belady", 8, 3)["misses"] == exhaustive_optimum(trace, 8, "layer", 3)


@pytest.mark.parametrize("policy", EVICTION.names())
def test_timing_and_cache_only_make_the_same_decisions(policy):
    trace = synth_from_preset("olmoe-1b-7b", layers=4, requests=2, prompt_tokens=4, tokens=40, seed=2)
    a = run(trace, policy, 20, batch=2, timing=True)
    b = run(trace, policy, 20, batch=2, timing=False)
    assert (a["misses"], a["collision_misses"]) == (b["misses"], b["collision_misses"])


def test_hand_checked_orders():
    """Capacity 2, one layer, top-1: the stream a b a c b shows each policy's choice."""
    model = small_model(layers=1, experts=4, top_k=1)
    ex = np.array([[[[0]], [[1]], [[0]], [[2]], [[1]]]])  # a b a c b
    t = trace_from_array(model, ex)
    # LRU: c evicts b (a used more recently) -> b misses again: 4 misses
    assert run(t, "lru", 2)["misses"] == 4
    # FIFO: c evicts a (inserted first) -> b hits: 3 misses
    assert run(t, "fifo", 2)["misses"] == 3
    # LFU: a used twice, b once -> c evicts b: 4 misses
    assert run(t, "lfu", 2)["misses"] == 4
    # Belady: a is never used again after step 2 -> evict a: 3 misses
    assert run(t, "belady", 2)["misses"] == 3

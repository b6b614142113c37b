"""SIEVE, S3-FIFO and ARC against libCacheSim, the independent reference that defines them.

Two levels: each policy's reference form driven alone through libCacheSim's ``get`` (a hit is
a use; a miss is a miss, room made for it when the cache is full, an insert), on random access
streams; and whole moesim replays in the execution where the cache sees libCacheSim's access
stream -- one request, per-expert execution with blocking fetch, cache-only, nothing pinned but
the expert being fetched -- on synthetic and real traces, on both replay paths.
"""

from __future__ import annotations

import libcachesim as lcs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moesim.policies.eviction import REGISTRY as EVICTION
from moesim.policies.eviction.s3fifo import S3FIFOParams, queue_sizes
from moesim.policies.registry import PolicyContext
from moesim.simulator.engine import simulate
from moesim.traces.synth import synth_from_preset
from tests.helpers import access_stream, experts_cap, mixtral_trace, scenario

LCS = {"sieve": "Sieve", "s3-fifo": "S3FIFO", "arc": "ARC"}
# libCacheSim's S3-FIFO admits into its small queue only objects smaller than the queue: below
# 20 objects (a small queue of one) it caches nothing new but ghost hits (moesim's docstring)
SMALLEST = {"sieve": 1, "s3-fifo": 20, "arc": 1}


def lcs_misses(name: str, stream: list[int], capacity: int) -> int:
    cache = getattr(lcs, LCS[name])(cache_size=capacity)
    req = lcs.Request()
    req.obj_size = 1
    misses = 0
    for key in stream:
        req.obj_id = key
        misses += not cache.get(req)
    return misses


def policy_misses(name: str, stream: list[int], capacity: int) -> int:
    """The reference form alone, through libCacheSim's ``get``: hit -> a use; miss -> on_miss,
    the first candidate evicted when full, the insert (a demand fetch)."""
    cls = EVICTION.get(name)
    ctx = PolicyContext(num_layers=1, num_experts=1 << 20, top_k=1, expert_bytes=1, rng=np.random.default_rng(0),
                        capacity_bytes=float(capacity), precision_bytes=(1,))
    policy = cls(cls.Params(), ctx)
    cached: set[int] = set()
    misses = 0
    for key in stream:
        if key in cached:
            policy.on_access(key)
            continue
        misses += 1
        policy.on_miss(key)
        if len(cached) == capacity:
            victim = next(iter(policy.candidates()))
            cached.remove(victim)
            policy.on_remove(victim)
        cached.add(key)
        policy.on_insert(key, True)
    return misses


streams = st.tuples(st.integers(2, 200), st.integers(1, 2000), st.floats(0.3, 1.5), st.integers(0, 2 ** 31),
                    st.booleans())


def stream_of(n: int, length: int, skew: float, seed: int, zipf: bool) -> list[int]:
    rng = np.random.default_rng(seed)
    draws = rng.zipf(1 + skew, length) if zipf else rng.integers(0, n, length)
    return (draws % n).tolist()


@pytest.mark.parametrize("name", list(LCS))
@settings(max_examples=60, deadline=None)
@given(spec=streams, capacity=st.integers(1, 120))
def test_the_reference_form_misses_as_libcachesim(name, spec, capacity):
    capacity = max(capacity, SMALLEST[name])
    stream = stream_of(*spec)
    assert policy_misses(name, stream, capacity) == lcs_misses(name, stream, capacity)


def test_sieve_by_hand():
    """Capacity 3, stream a b c a d b e. a b c fill the queue (newest first: c b a); a hits
    (visited). d misses: the hand starts at the tail, a, unmarks it and moves toward the head to
    b, unvisited: b goes and the hand rests on its newer neighbour, c; d enters (d c a). b misses:
    c, unvisited, goes; the hand rests on d; b enters (b d a). e misses: d goes (e b a). Six
    misses, a's one hit; a is still cached at the end."""
    a, b, c, d, e = range(5)
    stream = [a, b, c, a, d, b, e]
    assert policy_misses("sieve", stream, 3) == lcs_misses("sieve", stream, 3) == 6
    # a survives every sweep: it is hit again at the end
    assert policy_misses("sieve", [*stream, a], 3) == 6


def test_arc_adapts_toward_recency_on_a_b1_hit():
    """Capacity 2. a b fill T1 (|T1| = 2 > p = 0); c: a miss on every list with |T1| + |B1| = 2
    at the capacity and B1 empty, so T1's least recent entry, a, goes unremembered. d: now
    |T1| + |B1| = 2 again, B1 still empty: b goes unremembered. So T1 is c d and nothing is
    remembered: a misses again (5 misses of 5)."""
    a, b, c, d = range(4)
    assert policy_misses("arc", [a, b, c, d, a], 2) == lcs_misses("arc", [a, b, c, d, a], 2) == 5
    # b hits while cached: T2 holds it; c then d evict from T1 (|T1| > p = 0), b survives
    stream = [a, b, b, c, d, b]
    assert policy_misses("arc", stream, 2) == lcs_misses("arc", stream, 2) == 4


def test_s3fifo_queue_sizes_are_libcachesims_whole_shares():
    assert queue_sizes(20, S3FIFOParams()) == (2, 18, 18)
    assert queue_sizes(51, S3FIFOParams()) == (5, 46, 45)
    assert queue_sizes(1024, S3FIFOParams()) == (102, 922, 921)


def replay_misses(trace, name: str, capacity: int) -> dict:
    sc = scenario(timing=False, cache={"capacity": experts_cap(capacity, trace.model)}, expert_compute="per-expert",
                  expert_fetch="blocking", policies={"eviction": name})
    return simulate(sc, trace=trace).summary


@pytest.mark.parametrize("name", list(LCS))
@pytest.mark.parametrize("capacity", [24, 64, 200, 500])
def test_per_expert_blocking_replay_misses_as_libcachesim_on_synthetic(name, capacity):
    trace = synth_from_preset("olmoe-1b-7b", requests=1, tokens=150, seed=11)
    summary = replay_misses(trace, name, capacity)
    assert summary["misses"] == lcs_misses(name, access_stream(trace), capacity)


@pytest.mark.real
@pytest.mark.parametrize("name", list(LCS))
@pytest.mark.parametrize("capacity", [24, 64, 128, 200])
def test_per_expert_blocking_replay_misses_as_libcachesim_on_real_mixtral(name, capacity):
    trace = mixtral_trace("gsm8k")
    # one request's stream: libCacheSim's cache knows no requests, moesim's keeps its state across them
    assert replay_misses(trace, name, capacity)["misses"] == lcs_misses(name, access_stream(trace), capacity)

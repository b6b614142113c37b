"""The expert cache's bookkeeping, by hand (issue 12; the survivors of mutation testing):
static preloading, victims for an entry larger than any single victim, static pins among
the candidates, withdrawn prefetches, and the demand flag the policy is told."""

from __future__ import annotations

import numpy as np

from moesim.policies.eviction import REGISTRY
from moesim.policies.registry import PolicyContext
from moesim.simulator.cache import ExpertCache
from moesim.simulator.copyengine import NBYTES, PREFETCH, PRIORITY, CopyEngine
from tests.helpers import scenario

EB = 786_432  # one bf16 expert of the tiny model


def make(capacity: float, policy: str = "lru") -> tuple[ExpertCache, CopyEngine]:
    ctx = PolicyContext(num_layers=1, num_experts=16, top_k=1, expert_bytes=EB, rng=np.random.default_rng(0))
    cls = REGISTRY.get(policy)
    copy = CopyEngine(scenario().hardware.h2d, instant=True)
    return ExpertCache(capacity, cls(cls.Params(), ctx), copy), copy


def put(cache: ExpertCache, copy: CopyEngine, key: int, nbytes: int = EB, demand: bool = True) -> None:
    """Admit ``key`` as the engine does in cache-only replay (resident at once)."""
    assert cache.fetch(key, nbytes, set(), demand, 0.0) is not None


def balanced(cache: ExpertCache) -> bool:
    return cache.used == sum(cache.resident.values()) + sum(tr[NBYTES] for tr in cache.inflight.values())


def test_preload_fills_the_cache_once_per_key_and_pins_for_good():
    """Room for 3 experts; keys 5, 6, 5 (again), 7, 8: 5, 6 and 7 are loaded (the repeated 5
    is skipped, 8 no longer fits), 3 x 786,432 bytes in use, all three statically pinned."""
    cache, _ = make(3 * EB)
    assert cache.preload([5, 6, 5, 7, 8], EB) == 3
    assert cache.resident == {5: EB, 6: EB, 7: EB}
    assert cache.used == 3 * EB
    assert balanced(cache)
    assert cache.static_pinned == {5, 6, 7}
    assert cache.max_used == 3 * EB
    assert cache.fetch(9, EB, set(), True, 0.0) is None  # nothing may be evicted
    assert cache.resident == {5: EB, 6: EB, 7: EB}
    assert cache.used == 3 * EB
    assert cache.copy.bytes_moved == 0  # nothing was queued


def test_static_pins_are_skipped_but_others_are_victims():
    """Room for 3; key 5 preloaded (static), then 1 and 2 cached by demand (LRU order 5, 1,
    2). A fourth expert evicts 1, the oldest that is not statically pinned."""
    cache, copy = make(3 * EB)
    cache.preload([5], EB)
    put(cache, copy, 1)
    put(cache, copy, 2)
    got = cache.fetch(3, EB, set(), True, 0.0)
    assert got is not None
    assert got[0] == [1]
    assert set(cache.resident) == {5, 2, 3}
    assert cache.used == 3 * EB
    assert balanced(cache)


def test_victims_free_enough_bytes_for_a_larger_entry():
    """Room for 2 bf16 experts (1,572,864 bytes). Resident, oldest first: two int4 copies of
    196,608 bytes each and one bf16 expert: 1,179,648 in use, 393,216 free. A bf16 expert
    needs 786,432: evicting the first int4 copy frees 589,824, the second 786,432: enough,
    so the victims are the two int4 copies and the bf16 expert stays."""
    def three() -> ExpertCache:
        cache, copy = make(2 * EB)
        put(cache, copy, 10, EB // 4)
        put(cache, copy, 11, EB // 4)
        put(cache, copy, 12, EB)
        assert cache.used == 1_179_648
        return cache

    cache = three()
    got = cache.fetch(13, EB, set(), True, 0.0)
    assert got is not None
    assert got[0] == [10, 11]
    assert cache.resident == {12: EB, 13: EB}
    assert cache.used == 2 * EB
    assert cache.evicted == {10, 11}
    cache = three()
    got = cache.fetch(13, EB, {10}, True, 0.0)  # 10 pinned: 11 frees 589,824, then 12
    assert got is not None
    assert got[0] == [11, 12]
    assert cache.resident == {10: EB // 4, 13: EB}
    assert cache.used == EB // 4 + EB
    cache = three()
    assert cache.fetch(13, 2 * EB + 1, set(), True, 0.0) is None  # larger than the whole cache
    assert cache.resident == {10: EB // 4, 11: EB // 4, 12: EB}
    assert cache.used == 1_179_648
    assert cache.evicted == set()


def test_a_withdrawn_prefetch_frees_exactly_its_bytes():
    """Room for 3 experts: 1 and 2 resident (1,572,864 bytes), a prefetch of 3 admitted
    (2,359,296: full). Withdrawn unstarted: back to 1,572,864 and room for one more without
    evicting anything; the copy engine no longer counts its bytes."""
    cache, _ = make(3 * EB)
    copy = CopyEngine(scenario().hardware.h2d)
    cache = ExpertCache(3 * EB, cache.policy, copy)  # a timed engine: entries in flight until done
    for key in (1, 2):
        cache.fetch(key, EB, set(), True, 0.0)
    assert set(cache.inflight) == {1, 2}
    copy.advance(1.0)  # both demand copies (43.28 us each) have landed
    assert set(cache.resident) == {1, 2}
    assert cache.used == 2 * EB
    got = cache.fetch(3, EB, set(), False, 1.0)
    assert got is not None
    pf = got[1]
    assert pf[PRIORITY] == PREFETCH
    assert cache.used == 3 * EB
    assert cache.fetch(4, EB, {1, 2}, True, 1.0) is None  # 3 is in flight, 1 and 2 pinned
    assert cache.used == 3 * EB
    gone = copy.cancel_many([pf])
    cache.cancel_many(gone)
    assert gone == [pf]
    assert cache.used == 2 * EB
    assert balanced(cache)
    assert copy.bytes_moved == 2 * EB
    got = cache.fetch(4, EB, {1, 2}, True, 1.0)
    assert got is not None
    assert got[0] == []
    assert cache.used == 3 * EB


def test_the_policy_is_told_whether_an_insert_is_a_demand_fetch():
    """LFU counts a demand fetch as a use, a prefetch not: 1 fetched on demand (count 1), then
    2 prefetched (count 0): 2 is the first candidate although it is newer."""
    cache, copy = make(4 * EB, "lfu")
    put(cache, copy, 1, demand=True)
    put(cache, copy, 2, demand=False)
    assert list(cache.policy.candidates()) == [2, 1]


def test_a_prefetch_may_find_no_victim_where_a_demand_fetch_does():
    """Least-Stale, room for one expert, 1 cached on demand in this pass (current) and still
    to run in the current layer (pending): a demand miss may evict it, an optional prefetch
    may not (issue 33: never an expert still upcoming in this pass). Once it has run it is
    left of the execution point, and a prefetch may evict it."""
    cache, copy = make(EB, "least-stale")
    put(cache, copy, 1)
    clock = cache.policy.ctx.clock
    clock.pending = {1}
    assert cache.fetch(2, EB, set(), False, 0.0) is None
    assert set(cache.resident) == {1}
    assert copy.bytes_moved == EB  # nothing was queued for the refused prefetch
    got = cache.fetch(2, EB, set(), True, 0.0)
    assert got is not None
    assert got[0] == [1]
    assert set(cache.resident) == {2}
    clock.pending = set()  # 2 has run: left of the execution point
    got = cache.fetch(3, EB, set(), False, 0.0)
    assert got is not None
    assert got[0] == [2]
    assert set(cache.resident) == {3}

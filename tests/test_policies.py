"""Contract tests inherited by every registered eviction policy, and registry behaviour."""

from __future__ import annotations

import numpy as np
import pytest

from moesim.config.hardware import LinkConfig
from moesim.errors import MoesimError
from moesim.policies import families
from moesim.policies.eviction import REGISTRY as EVICTION
from moesim.policies.registry import PolicyContext
from moesim.simulator.cache import ExpertCache
from moesim.simulator.copyengine import CopyEngine
from moesim.simulator.workload import build_workload
from moesim.traces.synth import generate
from tests.helpers import small_model

EB = 100


def make_cache(name: str, capacity_experts: int) -> tuple[ExpertCache, CopyEngine]:
    cls = EVICTION.get(name)
    model = small_model(layers=4, experts=8, top_k=2)
    wl = build_workload(generate(model, requests=1, tokens=30, seed=0), 1)
    ctx = PolicyContext(num_layers=4, num_experts=8, top_k=2, expert_bytes=EB,
                        rng=np.random.default_rng(0), workload=wl)
    copy = CopyEngine(LinkConfig(bandwidth_gbps=1.0, latency_us=0.0), instant=True)
    cache = ExpertCache(capacity_experts * EB, cls(cls.Params(), ctx), copy)
    return cache, copy


def insert(cache: ExpertCache, copy: CopyEngine, key: int, pinned: set[int]) -> list[int] | None:
    got = cache.fetch(key, EB, pinned, True, 0.0)
    return None if got is None else got[0]


@pytest.mark.parametrize("name", EVICTION.names())
def test_capacity_is_respected(name):
    cache, copy = make_cache(name, 4)
    rng = np.random.default_rng(1)
    for _ in range(200):
        key = int(rng.integers(0, 32))
        if key in cache:
            cache.policy.on_access(key)
            continue
        assert insert(cache, copy, key, {key}) is not None
        assert cache.used <= cache.capacity
        assert len(cache.resident) <= 4


@pytest.mark.parametrize("name", EVICTION.names())
def test_pinned_entries_are_never_evicted(name):
    cache, copy = make_cache(name, 3)
    for key in (0, 1, 2):
        insert(cache, copy, key, set())
    victims = insert(cache, copy, 3, {0, 1})
    assert victims == [2]
    assert {0, 1, 3} == set(cache.resident)


@pytest.mark.parametrize("name", EVICTION.names())
def test_cannot_free_room_changes_nothing_and_says_so(name):
    cache, copy = make_cache(name, 2)
    insert(cache, copy, 0, set())
    insert(cache, copy, 1, set())
    before = (dict(cache.resident), cache.used, list(cache.policy.candidates()))
    assert cache.fetch(2, EB, {0, 1}, True, 0.0) is None
    assert (dict(cache.resident), cache.used, list(cache.policy.candidates())) == before
    assert copy.bytes_moved == 2 * EB  # no copy queued for the refused fetch
    # an in-flight entry is pinned too
    cache2, _ = make_cache(name, 1)
    slow = CopyEngine(LinkConfig(bandwidth_gbps=1.0, latency_us=0.0))
    cache2 = ExpertCache(EB, cache2.policy, slow)
    assert cache2.fetch(5, EB, set(), True, 0.0) is not None
    assert cache2.fetch(6, EB, set(), True, 0.0) is None
    assert 5 in cache2.inflight


def test_lru_order():
    cache, copy = make_cache("lru", 3)
    for key in (0, 1, 2):
        insert(cache, copy, key, set())
    cache.policy.on_access(0)
    assert insert(cache, copy, 3, set()) == [1]
    assert list(cache.policy.candidates()) == [2, 0, 3]


def test_every_family_has_its_default_and_unknown_names_list_valid_ones():
    fams = families()
    assert set(fams) == {"eviction", "miss", "prefetch", "routing", "budget"}
    for fam, default in {"eviction": "lru", "miss": "fetch", "prefetch": "none", "routing": "standard",
                         "budget": "none"}.items():
        assert default in fams[fam]
    with pytest.raises(MoesimError, match=r"unknown miss policy 'fetchh' .*valid miss policies: fetch"):
        fams["miss"].get("fetchh")


def test_a_layers_cache_keys_are_one_contiguous_range():
    """Four experts a layer at three precisions: 12 keys a layer; layer 2's keys are 24 to
    35, by hand from the layout (layer * E + e) * P + q."""
    ctx = PolicyContext(num_layers=3, num_experts=4, top_k=1, expert_bytes=EB, rng=np.random.default_rng(0),
                        precisions=("bf16", "int8", "int4"))
    assert ctx.keys_per_layer == 12
    assert (ctx.key(2, 0, 0), ctx.key(2, 3, 2)) == (24, 35)
    assert [ctx.layer_of(k) for k in (23, 24, 35, 36)] == [1, 2, 2, 3]

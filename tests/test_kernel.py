"""The compiled replay kernel against the SimPy process, the reference semantics: every
per-pass column and every summary figure bit-identical, on a golden grid covering every
eviction and prefetch policy with a kernel form, the three execution modes, timed and
cache-only replay and batch 1 and 8, on hypothesis-generated scenarios, and on a real trace;
and the dispatch rule (which path runs, and why)."""

from __future__ import annotations

import functools
import math
import os
import subprocess
import sys
from importlib import import_module
from typing import Any

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moesim.policies.eviction.fifo import FIFO, InsertionList
from moesim.policies.eviction.forms import form_index, unused_hooks
from moesim.policies.routing.hooked import route_arrays
from moesim.simulator.engine import Simulation
from moesim.traces.synth import generate, synth_from_preset
from tests.helpers import Callable, experts_cap, kernel_by_hand, scenario, small_model

# the by-hand tests call the kernel's functions, whose ``A`` holds the eviction hooks: numba's
# first-class functions, which it calls experimental (``kernel.replay`` says the same)
pytestmark = pytest.mark.filterwarnings("ignore:First-class function type feature is experimental")
EVICTIONS = ["lru", "fifo", "lfu", "fld", "score", "least-stale", "belady", "lhu"]
PREFETCHERS = ["none", "static-pin", "oracle", "previous-token", "lookahead", "next-gate-topk",
               "score-percentile"]
MODES = ["layer", "on-arrival", "per-expert"]
PATH_KEYS = ("replay_path", "replay_path_reason")
# a GPU slow enough that an expert's compute time grows with every token routed to it (on the
# A100 preset it is memory-bound, the same for 1 token as for 40), so that a wrong token count
# shows in the times
COMPUTE_BOUND = {"preset": "a100-80g-pcie4", "gpu": {"peak_tflops": 2.0}}
# a GPU on which an OLMoE expert's time depends on both its token count and its weights' size
# (memory-bound below about 10 tokens at bf16, 3 at int4), so that a compute time taken at the
# wrong precision shows
BALANCED = {"preset": "a100-80g-pcie4", "gpu": {"peak_tflops": 20.0}}


@pytest.fixture(scope="module")
def olmoe_trace():
    """An OLMoE-shaped trace (16 layers, 64 experts, top-8) with next-layer predictions,
    8 requests of 8 prompt and 24 decode tokens."""
    return synth_from_preset("olmoe-1b-7b", requests=8, prompt_tokens=8, tokens=24, seed=3, pred_next=True)


def both_paths(sc: Any, trace: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    """(kernel result, SimPy result) of one scenario."""
    monkeypatch.delenv("MOESIM_NO_KERNEL", raising=False)
    fast = Simulation(sc, trace=trace).run()
    monkeypatch.setenv("MOESIM_NO_KERNEL", "1")
    ref = Simulation(sc, trace=trace).run()
    monkeypatch.delenv("MOESIM_NO_KERNEL")
    return fast, ref


def assert_identical(fast: Any, ref: Any) -> None:
    assert fast.summary["replay_path"] == "kernel", fast.summary["replay_path_reason"]
    assert ref.summary["replay_path"] == "simpy"
    pd.testing.assert_frame_equal(fast.steps, ref.steps, check_exact=True)
    pd.testing.assert_frame_equal(fast.requests, ref.requests, check_exact=True)
    a = {k: v for k, v in fast.summary.items() if k not in PATH_KEYS}
    b = {k: v for k, v in ref.summary.items() if k not in PATH_KEYS}
    assert a == b


def golden_grid() -> list[tuple[str, str, str, bool, int]]:
    """Every eviction x prefetch pair; mode, timing and batch cycle so that every combination
    of the three appears with several policies."""
    cases = []
    for i, (ev, pf) in enumerate((ev, pf) for ev in EVICTIONS for pf in PREFETCHERS):
        cases.append((ev, pf, MODES[i % 3], (i // 3) % 2 == 0, (1, 8)[(i // 6) % 2]))
    return cases


@pytest.mark.parametrize(("eviction", "prefetch", "mode", "timing", "batch"), golden_grid())
def test_kernel_equals_simpy_on_the_golden_grid(olmoe_trace, monkeypatch, eviction, prefetch, mode, timing, batch):
    sc = scenario(policies={"eviction": eviction, "prefetch": prefetch}, expert_compute=mode, timing=timing,
                  workload={"batch_size": batch}, cache={"capacity": "5%"})
    fast, ref = both_paths(sc, olmoe_trace, monkeypatch)
    assert_identical(fast, ref)
    if prefetch in ("oracle", "score-percentile") and timing:
        assert ref.summary["prefetches_issued"] > 0  # the queue was exercised


@pytest.mark.parametrize("timing", [True, False])
@pytest.mark.parametrize("fetch", ["pipelined", "blocking"])
@pytest.mark.parametrize(("eviction", "prefetch"), [
    ("lru", "oracle"), ("least-stale", "oracle"), ("least-stale", "score-percentile"), ("fld", "next-gate-topk"),
    ("belady", "lookahead"), ("lfu", "none"), ({"name": "least-stale", "order": "absolute"}, "oracle")])
def test_kernel_equals_simpy_in_both_per_expert_fetch_disciplines(olmoe_trace, monkeypatch, eviction, prefetch,
                                                                   fetch, timing):
    """``expert_fetch: pipelined | blocking`` (per-expert execution) on both paths."""
    sc = scenario(policies={"eviction": eviction, "prefetch": prefetch}, expert_compute="per-expert",
                  expert_fetch=fetch, timing=timing, workload={"batch_size": 2}, cache={"capacity": "5%"})
    fast, ref = both_paths(sc, olmoe_trace, monkeypatch)
    assert_identical(fast, ref)


@pytest.mark.parametrize("policies", [
    {"eviction": {"name": "score", "decay": 0.9}, "prefetch": "oracle"},
    {"eviction": {"name": "least-stale", "order": "absolute"}, "prefetch": "score-percentile"},
    {"eviction": "least-stale", "prefetch": "next-gate-topk"},
    {"eviction": "lru", "prefetch": {"name": "lookahead", "depth": 3}},
    {"eviction": "lfu", "prefetch": {"name": "next-gate-topk", "overfetch": 2.0}},
    {"eviction": "belady", "prefetch": {"name": "score-percentile", "percentile": 50}},
    {"eviction": "fld", "prefetch": {"name": "static-pin", "fraction": 0.8, "calibration": 0.3}},
])
@pytest.mark.parametrize("mode", MODES)
def test_kernel_equals_simpy_with_policy_parameters(olmoe_trace, monkeypatch, policies, mode):
    sc = scenario(policies=policies, expert_compute=mode, workload={"batch_size": 4}, cache={"capacity": "8%"})
    assert_identical(*both_paths(sc, olmoe_trace, monkeypatch))


@pytest.mark.parametrize("capacity", ["0 experts", "3 experts", "1%", "25%", "100%"])
@pytest.mark.parametrize("prefetch", ["none", "oracle"])
def test_kernel_equals_simpy_at_the_capacity_limits(olmoe_trace, monkeypatch, capacity, prefetch):
    """Below one layer's experts every fetch is uncached; at 100% only cold misses."""
    sc = scenario(policies={"eviction": "lru", "prefetch": prefetch}, cache={"capacity": capacity},
                  workload={"batch_size": 2})
    fast, ref = both_paths(sc, olmoe_trace, monkeypatch)
    assert_identical(fast, ref)
    if capacity == "0 experts":
        assert ref.summary["uncached_fetches"] == ref.summary["misses"] > 0


@pytest.mark.parametrize(("eviction", "mode"), [("lru", "layer"), ("least-stale", "per-expert"),
                                               ("belady", "on-arrival"), ("sieve", "layer")])
def test_kernel_equals_simpy_when_prefetches_fill_the_cache(olmoe_trace, monkeypatch, eviction, mode):
    """Score-percentile proposing a third of the next layer's experts over a 2 GB/s link into
    a cache of 5%: the prefetches in flight hold the cache, and most demand misses find no key
    to evict (the kernel skips the walk of a form that changes nothing when no key is resident,
    ``S_NRES``; SIEVE's walk moves its hand, so it is walked). After the replay that count
    equals the resident keys that are not statically pinned, counted here."""
    from moesim import kernel_state as KS
    from moesim.simulator import kernel

    counts = []
    finish = kernel._finish

    def counted(IS, K, T, FS):
        finish(IS, K, T, FS)
        counts.append((int(IS[KS.S_NRES]), int(((K["state"] == KS.RESIDENT) & (K["static"] == 0)).sum())))

    monkeypatch.setattr(kernel, "_finish", counted)
    sc = scenario(policies={"eviction": eviction, "prefetch": {"name": "score-percentile", "percentile": 66}},
                  expert_compute=mode, cache={"capacity": "5%"}, workload={"batch_size": 2},
                  hardware={"preset": "a100-80g-pcie4", "links": {"pcie": {"bandwidth_gbps": 2.0}}})
    fast, ref = both_paths(sc, olmoe_trace, monkeypatch)
    assert_identical(fast, ref)
    assert ref.summary["uncached_fetches"] > ref.summary["misses"] / 2  # the walks found no room
    assert len(counts) == 1
    assert counts[0][0] == counts[0][1] > 0


def test_kernel_equals_simpy_on_a_speculative_replay(olmoe_trace, monkeypatch):
    sc = scenario(workload={"batch_size": 2, "speculative": {"tree_size": 4, "accept_prob": 0.6}},
                  policies={"eviction": "least-stale", "prefetch": "oracle"})
    fast, ref = both_paths(sc, olmoe_trace, monkeypatch)
    assert_identical(fast, ref)
    assert ref.summary["mean_accepted_tokens"] > 1


@functools.cache
def miss_trace(probs: bool) -> Any:
    """The miss-policy tests' trace: OLMoE-shaped, 6 layers, 8 requests of 4 prompt and 12
    decode tokens, with next-layer predictions (made once per ``probs``)."""
    return synth_from_preset("olmoe-1b-7b", layers=6, requests=8, prompt_tokens=4, tokens=12, seed=5,
                             pred_next=True, probs=probs)


def miss_replay(monkeypatch: pytest.MonkeyPatch, miss: Any, probs: bool = True, hardware: Any = None,
                **over: Any) -> pd.DataFrame:
    """A miss-policy scenario on :func:`miss_trace` (on ``hardware``, by default compute-bound),
    replayed on both paths and checked bit-identical; the per-pass rows."""
    policies = {"prefetch": "none", **over.pop("policies", {}), "miss": miss}
    sc = scenario(policies=policies, hardware=hardware or COMPUTE_BOUND, **over)
    fast, ref = both_paths(sc, miss_trace(probs), monkeypatch)
    assert_identical(fast, ref)
    return ref.steps


@pytest.mark.parametrize("probs", [True, False])
@pytest.mark.parametrize(("eviction", "prefetch", "rank", "capacity"), [
    ("lru", "none", 2, "8%"), ("least-stale", "score-percentile", 1, "8%"), ("belady", "oracle", 0, "30%"),
    ("lfu", "next-gate-topk", 4, "70%")])
@pytest.mark.parametrize(("mode", "timing", "batch"), [
    ("layer", True, 1), ("layer", True, 8), ("on-arrival", True, 8), ("per-expert", True, 4), ("layer", False, 8),
    ("per-expert", False, 1)])
def test_kernel_equals_simpy_with_the_drop_miss_policy(monkeypatch, probs, eviction, prefetch, rank, capacity, mode,
                                                       timing, batch):
    """``drop`` on the kernel: misses of router rank >= ``rank`` skipped, the layer's
    computations, unique experts, gate mass (router probabilities, or top-k weights when the
    trace has none) and altered tokens as the per-token SimPy path counts them."""
    steps = miss_replay(monkeypatch, {"name": "drop", "rank": rank}, probs,
                        policies={"eviction": eviction, "prefetch": prefetch}, expert_compute=mode, timing=timing,
                        workload={"batch_size": batch}, cache={"capacity": capacity})
    assert steps.dropped_experts.sum() > 0
    assert steps.tokens_altered.sum() > 0
    if capacity == "70%":  # and some tokens keep all their experts
        assert (steps.tokens_altered < steps.tokens).any()
    assert (steps.gate_weight_computed < steps.gate_weight_total).any()


@pytest.mark.parametrize(("eviction", "prefetch", "miss", "capacity"), [
    ("lru", "none", "fetch", "60%"), ("least-stale", "score-percentile", "fetch", "60%"),
    ("belady", "oracle", {"name": "drop", "rank": 2}, "70%"), ("lfu", "next-gate-topk", "substitute", "60%"),
    ("fifo", "previous-token", "speculative", "80%"), ("lhu", "lookahead", "fetch-priority", "70%")])
@pytest.mark.parametrize(("mode", "timing", "batch"), [
    ("layer", True, 1), ("layer", True, 8), ("on-arrival", True, 8), ("per-expert", True, 4), ("layer", False, 8),
    ("per-expert", False, 1)])
def test_kernel_equals_simpy_with_cache_aware_routing(monkeypatch, eviction, prefetch, miss, capacity, mode, timing,
                                                      batch):
    """Cache-aware routing on the kernel (its compiled form chooses at each routing point from
    what is resident or in flight then, the running mean of ``|z|`` carried over the replay):
    re-routed tokens, the lookups they lead to, gate mass and every time as the SimPy path
    gives them, under each miss policy's family and execution mode. (At 20% of the keys and 8
    requests a batch a layer's experts are all evicted before it comes round again, and
    nothing is re-routed.)"""
    steps = miss_replay(monkeypatch, miss, policies={"eviction": eviction, "prefetch": prefetch,
                                                     "routing": {"name": "cache-aware", "lam": 0.3}},
                        expert_compute=mode, timing=timing, workload={"batch_size": batch},
                        cache={"capacity": capacity})
    assert steps.tokens_altered.sum() > 0
    assert (steps.gate_weight_computed < steps.gate_weight_total).any()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("miss", "lam"), [("fetch", 0.3), ("drop", 3.0), ("fetch", 3.0)])
def test_kernel_equals_simpy_with_cache_aware_routing_on_a_small_model(monkeypatch, mode, miss, lam):
    """The same on 3 layers of 8 experts, top-2 (fast enough for the kernel as plain Python,
    ``tools/mutation_compiled.py``)."""
    model = small_model(3, 8, 2)
    trace = generate(model, requests=3, prompt_tokens=3, tokens=8, seed=4, probs=True)
    sc = scenario(policies={"routing": {"name": "cache-aware", "lam": lam}, "miss": miss}, expert_compute=mode,
                  cache={"capacity": experts_cap(12, model)}, workload={"batch_size": 2})
    fast, ref = both_paths(sc, trace, monkeypatch)
    assert_identical(fast, ref)
    assert ref.steps.tokens_altered.sum() > 0


@pytest.mark.parametrize("probs", [True, False])
def test_kernel_equals_simpy_with_a_top_k_above_128(monkeypatch, probs):
    """A token's gate mass over more than 128 terms (top-160 of 256 experts, router
    probabilities summed as numpy splits a long sum in two): the drop policy's per-pass rows
    and gate mass bit for bit on both paths."""
    trace = synth_from_preset("olmoe-1b-7b", layers=2, experts=256, top_k=160, requests=3, prompt_tokens=2,
                              tokens=3, seed=7, probs=probs)
    sc = scenario(policies={"prefetch": "none", "miss": "drop"}, hardware=COMPUTE_BOUND, cache={"capacity": "30%"})
    fast, ref = both_paths(sc, trace, monkeypatch)
    assert_identical(fast, ref)
    steps = ref.steps
    assert steps.dropped_experts.sum() > 0
    assert (steps.gate_weight_computed < steps.gate_weight_total).all()


@pytest.mark.parametrize(("eviction", "prefetch", "capacity"), [
    ("lru", "none", "60%"), ("least-stale", "score-percentile", "60%"), ("belady", "oracle", "60%"),
    ("score", "next-gate-topk", "40%"), ("fld", "lookahead", "40%")])
@pytest.mark.parametrize(("mode", "timing", "batch"), [
    ("layer", True, 1), ("layer", True, 8), ("on-arrival", True, 8), ("per-expert", True, 4), ("layer", False, 8),
    ("per-expert", False, 1)])
def test_kernel_equals_simpy_with_the_substitute_miss_policy(monkeypatch, eviction, prefetch, capacity, mode, timing,
                                                             batch):
    """``substitute`` on the kernel: a missed expert's tokens compute the resident or arriving
    unrouted expert of nearest mean router probability (float32, as numpy's mean), promoted
    when queued, pinned, counted once per layer; its compute time from the tokens that finally
    compute it; gate mass and altered tokens as the per-token SimPy path counts them."""
    steps = miss_replay(monkeypatch, "substitute", policies={"eviction": eviction, "prefetch": prefetch},
                        expert_compute=mode, timing=timing, workload={"batch_size": batch},
                        cache={"capacity": capacity})
    assert steps.substituted_experts.sum() > 0
    assert (steps.gate_weight_computed != steps.gate_weight_total).any()


@pytest.mark.parametrize(("eviction", "prefetch", "capacity"), [
    ("lru", "next-gate-topk", "20%"), ("least-stale", "next-gate-topk", "30%"), ("belady", "previous-token", "20%"),
    ("lfu", "none", "40%"), ("fifo", "score-percentile", "20%"), ("score", "next-gate-topk", "30%")])
@pytest.mark.parametrize(("mode", "timing", "batch"), [
    ("layer", True, 1), ("layer", True, 8), ("on-arrival", True, 8), ("per-expert", True, 4), ("layer", False, 8),
    ("per-expert", False, 1)])
@pytest.mark.parametrize("probs", [True, False])
def test_kernel_equals_simpy_with_the_speculative_miss_policy(monkeypatch, eviction, prefetch, capacity, mode, timing,
                                                              batch, probs):
    """``speculative`` on the kernel: each token routed to a missed expert computes its
    best-predicted cached expert not already in its set (the previous layer's pred_next),
    several experts per miss, routed ones among them; compute times from the tokens that
    finally compute each expert; gate mass (probabilities, or top-k weights) and altered
    tokens as the per-token SimPy path counts them."""
    steps = miss_replay(monkeypatch, "speculative", probs, policies={"eviction": eviction, "prefetch": prefetch},
                        expert_compute=mode, timing=timing, workload={"batch_size": batch},
                        cache={"capacity": capacity})
    assert steps.substituted_experts.sum() > 0
    assert (steps.gate_weight_computed != steps.gate_weight_total).any()


CASCADES = [  # (miss policy, eviction, prefetch, capacity, the cache's precision)
    ("fetch-lowest-bit", "lru", "score-percentile", "8%", None),
    ({"name": "fetch-lowest-bit", "precisions": ["bf16", "int4"]}, "lhu", "next-gate-topk", "20%", None),
    ("fetch-priority", "lhu", "oracle", "8%", None),
    ({"name": "fetch-priority", "precisions": ["int8", "int4", "int2"], "degrade_fraction": 0.3}, "least-stale",
     "score-percentile", "20%", "int8"),
    ({"name": "fetch-priority", "degrade_fraction": 1.0}, "belady", "none", "30%", None),
    ("fetch-lowest-bit", "score", "lookahead", "30%", "int8"),
    ({"name": "fetch-priority", "precisions": ["bf16"]}, "lfu", "previous-token", "5%", None),
    ({"name": "fetch-priority", "precisions": ["int8", "int4"]}, "lru", "next-gate-topk", "10%", None),
]


@pytest.mark.parametrize(("miss", "eviction", "prefetch", "capacity", "precision"), CASCADES)
@pytest.mark.parametrize(("mode", "timing", "batch"), [
    ("layer", True, 1), ("layer", True, 8), ("on-arrival", True, 8), ("per-expert", True, 4), ("layer", False, 8),
    ("per-expert", False, 1)])
def test_kernel_equals_simpy_with_a_precision_cascade(monkeypatch, miss, eviction, prefetch, capacity, precision,
                                                      mode, timing, batch):
    """``fetch-lowest-bit`` and ``fetch-priority`` on the kernel: cache entries of several
    sizes (room made by as many victims as it takes, or none when they cannot free enough),
    a resident copy at another precision used in place of a miss, the fetch cascade with its
    uncached fallback at the last precision, compute and copy times at each entry's
    precision (on a GPU where an expert's time depends on its size), and
    ``low_precision_experts``, as the SimPy path has them."""
    steps = miss_replay(monkeypatch, miss, hardware=BALANCED, policies={"eviction": eviction, "prefetch": prefetch},
                        expert_compute=mode, timing=timing, workload={"batch_size": batch},
                        cache={"capacity": capacity, **({"precision": precision} if precision else {})})
    if miss == {"name": "fetch-priority", "precisions": ["bf16"]}:  # one level: plain fetches
        assert steps.low_precision_experts.sum() == 0
    else:
        assert steps.low_precision_experts.sum() > 0
    assert steps.misses.sum() > 0


@pytest.mark.parametrize("timing", [True, False])
def test_a_cascade_falls_back_to_a_resident_lower_copy_when_no_room_can_be_made(monkeypatch, timing):
    """fetch-priority by hand (SpecMD §3.1.2), one layer, top-3, degrade_fraction 0.7 (rank
    0 important), room for 1.5 bf16 experts (int8 is half, int4 a quarter, int2 an eighth).
    Token 1 routes A, X, C: A (important) is fetched at bf16; X and C (unimportant) at int8,
    X fits, C finds no room at int8, int4 or int2 (A and X are pinned): an uncached int2
    fetch. Token 2 routes X, A, B: X is now important, so its int8 copy is no alternative;
    bf16 needs room and only X's own int8 copy (half an expert) may be evicted, so the
    cascade goes on to int8, where X is resident: used, a low-precision miss with no
    transfer. A hits; B finds no room: uncached at int2."""
    from tests.helpers import trace_from_array

    A, X, B, C = 0, 1, 2, 3
    trace = trace_from_array(small_model(1, 4, 3), np.array([[[[A, X, C]], [[X, A, B]]]]))
    sc = scenario(policies={"eviction": "lru", "prefetch": "none",
                            "miss": {"name": "fetch-priority", "degrade_fraction": 0.7}},
                  cache={"capacity": "1.5 experts"}, timing=timing)
    fast, ref = both_paths(sc, trace, monkeypatch)
    assert_identical(fast, ref)
    steps = ref.steps
    assert steps.hits.tolist() == [0, 1]
    assert steps.misses.tolist() == [3, 2]
    assert steps.uncached_fetches.tolist() == [1, 1]
    assert steps.low_precision_experts.tolist() == [2, 2]
    eb = small_model(1, 4, 3).expert_bytes
    assert steps.bytes_h2d.tolist() == [eb["bf16"] + eb["int8"] + eb["int2"], eb["int2"]]


@pytest.mark.parametrize("miss", [{"name": "drop", "rank": 1}, "substitute", "speculative"])
@pytest.mark.parametrize("mode", ["layer", "per-expert"])
def test_kernel_equals_simpy_with_a_miss_policy_at_a_lower_precision(monkeypatch, miss, mode):
    """The re-routing miss policies with ``cache.precision: int8`` (cache keys carry the
    precision index 1, not 0)."""
    steps = miss_replay(monkeypatch, miss, policies={"eviction": "lru", "prefetch": "next-gate-topk"},
                        expert_compute=mode, workload={"batch_size": 4}, cache={"capacity": "40%", "precision": "int8"})
    assert steps.dropped_experts.sum() + steps.substituted_experts.sum() > 0


settings_kw: dict[str, Any] = {"max_examples": 100, "deadline": None, "suppress_health_check": [HealthCheck.too_slow]}


@settings(**settings_kw)
@given(layers=st.integers(1, 4), experts=st.integers(2, 12), k=st.integers(1, 3), tokens=st.integers(1, 12),
       prompt=st.integers(0, 4), requests=st.integers(1, 4), batch=st.integers(1, 4), cap=st.integers(0, 20),
       eviction=st.sampled_from(EVICTIONS), prefetch=st.sampled_from(PREFETCHERS), mode=st.sampled_from(MODES),
       timing=st.booleans(), seed=st.integers(0, 10_000), bandwidth=st.sampled_from([4.0, 32.0, 400.0]),
       miss=st.sampled_from([None, 0, 1, 2, "substitute", "speculative", "fetch-lowest-bit", "fetch-priority",
                             {"name": "fetch-priority", "degrade_fraction": 0.0},
                             {"name": "fetch-priority", "precisions": ["int8", "int2"], "degrade_fraction": 1.0}]),
       probs=st.booleans(),
       precision=st.sampled_from([None, "int8"]), depth=st.sampled_from([1, 2, 3, "all"]),
       lam=st.sampled_from([None, None, 0.3, 3.0]))
def test_kernel_equals_simpy_on_generated_scenarios(layers, experts, k, tokens, prompt, requests, batch, cap,
                                                    eviction, prefetch, mode, timing, seed, bandwidth, miss, probs,
                                                    precision, depth, lam):
    """... with cache-aware routing of strength ``lam`` (None: the router's own choice)."""
    model = small_model(layers, experts, min(k, experts))
    trace = generate(model, requests=requests, prompt_tokens=prompt, tokens=tokens, seed=seed, pred_next=True,
                     probs=probs or miss == "substitute" or lam is not None)
    policy = "fetch" if miss is None else {"name": "drop", "rank": miss} if isinstance(miss, int) else miss
    routing = "standard" if lam is None else {"name": "cache-aware", "lam": lam}
    sc = scenario(policies={"eviction": eviction, "prefetch": prefetch, "miss": policy, "routing": routing},
                  expert_compute=mode,
                  timing=timing, cache={"capacity": experts_cap(cap, model), **({"precision": precision} if precision else {})},
                  workload={"batch_size": batch}, execution={"prefetch_depth": depth},
                  hardware={"preset": "a100-80g-pcie4", "links": {"pcie": {"bandwidth_gbps": bandwidth}}})
    with pytest.MonkeyPatch.context() as mp:
        assert_identical(*both_paths(sc, trace, mp))


@pytest.mark.parametrize(("mode", "prefetch"), [("layer", "previous-token"), ("on-arrival", "lookahead"),
                                                ("per-expert", "next-gate-topk")])
def test_kernel_equals_simpy_at_every_prefetch_depth(olmoe_trace, monkeypatch, mode, prefetch):
    """Prefetches issued to the copy engine are not withdrawn (``execution.prefetch_depth``) on
    both paths alike: at a quarter of the experts cached, PCIe at 16 GB/s (copies queue), the
    mispredicting prefetchers have admitted copies withdrawn at depths 1 to 3, fewer at each
    greater depth, and none when every admitted copy is issued."""
    cancelled = []
    for depth in (1, 2, 3, "all"):
        sc = scenario(policies={"eviction": "least-stale", "prefetch": prefetch}, expert_compute=mode,
                      cache={"capacity": "25%"}, execution={"prefetch_depth": depth},
                      hardware={"preset": "a100-80g-pcie4", "links": {"pcie": {"bandwidth_gbps": 16.0}}})
        fast, ref = both_paths(sc, olmoe_trace, monkeypatch)
        assert_identical(fast, ref)
        cancelled.append(fast.summary["prefetches_cancelled"])
    assert cancelled[0] > cancelled[1] > cancelled[2] > cancelled[3] == 0


def test_kernel_equals_simpy_on_the_real_mixtral_trace(monkeypatch):
    from tests.helpers import mixtral_trace

    trace = mixtral_trace()
    for ev, pf in (("lru", "none"), ("least-stale", "previous-token"), ("belady", "none")):
        sc = scenario(policies={"eviction": ev, "prefetch": pf}, cache={"capacity": "25%"},
                      workload={"max_requests": 20})
        assert_identical(*both_paths(sc, trace, monkeypatch))


# -- dispatch ------------------------------------------------------------------------------------

def path_of(sc: Any, trace: Any, **kwargs: Any) -> tuple[str, str | None]:
    s = Simulation(sc, trace=trace, **kwargs).run().summary
    return s["replay_path"], s["replay_path_reason"]


@pytest.fixture(scope="module")
def tiny():
    return generate(small_model(2, 8, 2), requests=2, tokens=6, seed=1, pred_next=True, probs=True)


def test_the_kernel_runs_when_every_policy_has_a_kernel_form(tiny, monkeypatch):
    monkeypatch.delenv("MOESIM_NO_KERNEL", raising=False)
    assert path_of(scenario(), tiny) == ("kernel", None)
    assert path_of(scenario(policies={"budget": {"name": "lynx", "drop": 1}}), tiny) == ("kernel", None)
    assert path_of(scenario(policies={"routing": "cache-aware"}), tiny) == ("kernel", None)
    assert path_of(scenario(), tiny, record_transfers=True, record_layers=True) == ("kernel", None)


@pytest.mark.parametrize(("over", "kwargs", "why"), [
    ({"policies": {"eviction": "random"}}, {}, "eviction policy 'random' has no kernel form"),
    ({"policies": {"routing": "cache-aware", "budget": "lynx"}}, {},
     "routing policy 'cache-aware' under budget policy 'lynx' (the budget's choice follows the routing, in Python)"),
    ({"hardware": {"preset": "h100-sxm-nvlink-x2"}}, {}, "expert parallelism"),
    ({}, {"record_decisions": True}, "the replay records its decisions"),
])
def test_the_simpy_path_runs_and_says_why(tiny, monkeypatch, over, kwargs, why):
    monkeypatch.delenv("MOESIM_NO_KERNEL", raising=False)
    assert path_of(scenario(**over), tiny, **kwargs) == ("simpy", why)


def test_a_users_own_miss_policy_runs_on_the_simpy_path(tiny, monkeypatch):
    """Every built-in miss policy has a kernel form; a user's own (here a subclass of
    ``fetch`` registered as a plugin would) runs on the SimPy path, and says so."""
    from moesim.policies.miss import REGISTRY
    from moesim.policies.miss.fetch import Fetch

    monkeypatch.delenv("MOESIM_NO_KERNEL", raising=False)
    monkeypatch.setitem(REGISTRY._classes, "my-fetch", type("MyFetch", (Fetch,), {}))
    assert path_of(scenario(policies={"miss": "my-fetch"}), tiny) == (
        "simpy", "miss policy 'my-fetch' has no kernel form")


def test_a_users_own_routing_policy_runs_on_the_simpy_path(tiny, monkeypatch):
    """A routing policy other than the shipped ones (here a subclass of ``cache-aware``, as a
    plugin would register it) has no kernel form: it may route otherwise."""
    from moesim.policies.routing import REGISTRY
    from moesim.policies.routing.cache_aware import CacheAware

    monkeypatch.delenv("MOESIM_NO_KERNEL", raising=False)
    monkeypatch.setitem(REGISTRY._classes, "my-routing", type("MyRouting", (CacheAware,), {}))
    assert path_of(scenario(policies={"routing": "my-routing"}), tiny) == (
        "simpy", "routing policy 'my-routing' has no kernel form")


def test_moesim_no_kernel_forces_the_simpy_path(tiny, monkeypatch):
    monkeypatch.setenv("MOESIM_NO_KERNEL", "1")
    assert path_of(scenario(), tiny) == ("simpy", "MOESIM_NO_KERNEL is set")
    monkeypatch.setenv("MOESIM_NO_KERNEL", "0")
    assert path_of(scenario(), tiny)[0] == "kernel"


def test_a_users_own_policy_runs_on_the_simpy_path(tiny, monkeypatch):
    """A subclass of a built-in policy is the user's code: only the built-in classes
    themselves have kernel forms."""
    from moesim.policies.eviction import REGISTRY
    from moesim.policies.eviction.lru import LRU

    class MyLRU(LRU):
        def on_access(self, key: int) -> None:  # a user's change the kernel cannot know of
            pass

    monkeypatch.delenv("MOESIM_NO_KERNEL", raising=False)
    monkeypatch.setitem(REGISTRY._classes, "my-lru", MyLRU)
    assert path_of(scenario(policies={"eviction": "my-lru"}), tiny) == (
        "simpy", "eviction policy 'my-lru' has no kernel form")


def test_a_users_prefetcher_runs_compiled_only_through_a_compiled_form(olmoe_trace, monkeypatch):
    """A subclass of a built-in prefetcher that changes ``propose`` is the user's code: the
    compiled form's proposals would not be its own, so it runs on the SimPy path and says so, as
    a user's prefetcher that only ``propose``s does. A user's prefetcher that proposes nothing in the replay (``active = False``: it only pins
    experts) has nothing to compile: it runs on the kernel, its rows its SimPy run's."""
    from moesim.policies.prefetch import REGISTRY, PrefetchPolicy
    from moesim.policies.prefetch.oracle import Oracle

    class FartherOracle(Oracle):
        def propose(self, pass_index: int, layer: int) -> list[int]:
            return list(super().propose(pass_index, layer + 1)) if layer + 2 < self.ctx.num_layers else []

    class PinFirstLayer(PrefetchPolicy):
        active = False

        def propose(self, pass_index: int, layer: int) -> list[int]:
            return []

        def pinned(self) -> list[int]:
            return [int(self.ctx.cache_keys(e)) for e in range(8)]

    class NextExpertZero(PrefetchPolicy):
        def propose(self, pass_index: int, layer: int) -> list[int]:
            return [int(self.ctx.key(layer + 1, 0))] if layer + 1 < self.ctx.num_layers else []

    monkeypatch.setitem(REGISTRY._classes, "farther-oracle", FartherOracle)
    monkeypatch.setitem(REGISTRY._classes, "pin-first-layer", PinFirstLayer)
    monkeypatch.setitem(REGISTRY._classes, "next-expert-zero", NextExpertZero)
    why = "prefetch policy 'farther-oracle': it has no kernel form (it changes propose or proposals apart from its compiled form)"
    monkeypatch.delenv("MOESIM_NO_KERNEL", raising=False)
    assert path_of(scenario(policies={"prefetch": "farther-oracle"}), olmoe_trace) == ("simpy", why)
    assert path_of(scenario(policies={"prefetch": "next-expert-zero"}), olmoe_trace) == (
        "simpy", "prefetch policy 'next-expert-zero': it has no kernel form")
    fast, ref = both_paths(scenario(policies={"prefetch": "pin-first-layer"}, cache={"capacity": "25%"}), olmoe_trace,
                           monkeypatch)
    assert_identical(fast, ref)
    assert fast.summary["preloaded_experts"] == 8


def test_the_kernel_source_runs_as_plain_python(tmp_path):
    """Without numba's compiler (NUMBA_DISABLE_JIT=1 stands in for a Python without numba
    wheels) the same functions run as plain Python and give the same answer (with a plain
    fetch and with a precision cascade)."""
    code = (
        "from moesim.simulator.engine import Simulation\n"
        "from moesim.traces.synth import generate\n"
        "from tests.helpers import scenario, small_model\n"
        "import os, json\n"
        "tr = generate(small_model(3, 8, 2), requests=3, tokens=8, seed=2, pred_next=True)\n"
        "out = []\n"
        "for miss in ('fetch', 'fetch-priority'):\n"
        "    sc = scenario(policies={'eviction': 'least-stale', 'prefetch': 'score-percentile', 'miss': miss}, "
        "cache={'capacity': '5 experts'}, workload={'batch_size': 2})\n"
        "    r = Simulation(sc, trace=tr).run()\n"
        "    out += [r.steps['end_s'].tolist(), r.steps['misses'].tolist(), r.steps['low_precision_experts'].tolist()]\n"
        "from moesim.simulator import kernel\n"
        "compiled = hasattr(kernel.replay_passes, 'signatures')\n"
        "print(json.dumps([r.summary['replay_path'], compiled, *out]))\n")
    env = {**os.environ, "NUMBA_DISABLE_JIT": "1"}
    env.pop("MOESIM_NO_KERNEL", None)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    plain = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True,
                           check=True).stdout
    env["MOESIM_NO_KERNEL"] = "1"
    env.pop("NUMBA_DISABLE_JIT")
    ref = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True,
                         check=True).stdout
    import json

    p, r = json.loads(plain), json.loads(ref)
    assert p[:2] == ["kernel", False]  # the kernel ran, as plain Python functions
    assert r[0] == "simpy"
    assert p[2:] == r[2:]
    assert np.sum(p[3]) > 0
    assert np.sum(p[7]) > 0  # the precision cascade used lower precisions


def test_without_numba_the_simpy_path_runs(tiny, monkeypatch):
    """The kernel's source as plain Python is slower than the SimPy path, so a Python without
    numba wheels replays on SimPy and says so."""
    from moesim.simulator import kernel

    monkeypatch.delenv("MOESIM_NO_KERNEL", raising=False)
    monkeypatch.setattr(kernel, "HAVE_NUMBA", False)
    assert path_of(scenario(), tiny) == ("simpy", "numba is not installed")


def test_the_run_summary_names_the_replay_path(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from moesim.cli import cli

    runner = CliRunner()
    args = ["run", "quickstart", "--set", "workload.trace.synth.tokens=5", "--out"]
    monkeypatch.delenv("MOESIM_NO_KERNEL", raising=False)
    fast = runner.invoke(cli, [*args, str(tmp_path / "a")])
    monkeypatch.setenv("MOESIM_NO_KERNEL", "1")
    slow = runner.invoke(cli, [*args, str(tmp_path / "b")])
    assert fast.exit_code == slow.exit_code == 0, fast.output + slow.output
    assert "│ replay_path" in fast.output
    assert "kernel" in fast.output.split("│ replay_path")[1].splitlines()[0]
    assert "simpy (MOESIM_NO_KERNEL is set)" in slow.output.split("│ replay_path")[1].splitlines()[0]


def test_the_timeline_log_takes_records_up_to_its_room_then_stops_with_an_error():
    """``_record`` appends a tag and seven fields per record after those written; at the room
    the layout gave (``log``) it raises rather than write past it."""
    KS = Callable(import_module("moesim.kernel_state"))

    IS, FS, _, _, _ = KS._layout(num_keys=8, pool=4, pend_max=8, maxn=1, top_k=1, log=2)
    KS._record(KS.LOG_LAYER, 3, 1, 0.5, 0.75, 1.0, 2.5, 4096, IS, FS)
    KS._record(KS.LOG_WITHDRAWN, 7, 0.25, 0.75, 512, 0, 0, 0, IS, FS)
    assert IS[KS.S_LOGN] == 2
    log = KS.region(FS, KS.H_LOG, 2 * KS.LOG_WIDTH, IS).reshape(2, KS.LOG_WIDTH)
    assert log.tolist() == [[KS.LOG_LAYER, 3, 1, 0.5, 0.75, 1.0, 2.5, 4096], [KS.LOG_WITHDRAWN, 7, 0.25, 0.75, 512, 0, 0, 0]]
    with pytest.raises(RuntimeError, match="timeline log full"):
        KS._record(KS.LOG_TRANSFER, 1, 0, 0.0, 0.0, 1.0, 512, 0, IS, FS)
    assert IS[KS.S_LOGN] == 2


def test_the_prefetch_ring_drops_its_tombstones_when_full():
    """The copy engine's prefetch queue is a ring whose withdrawn entries are -1. When it is
    full, the next prefetch first drops the tombstones: the queued transfers keep their FIFO
    order from slot 0 on, each knowing its slot, and the new one comes last. (No replay in
    the tests fills the ring, so the kernel's functions are driven directly: 6 prefetches
    queued on a 6-slot pool behind a busy link, the 2nd and 5th withdrawn, one more queued.)"""
    KC = Callable(import_module("moesim.simulator.kernel_copy"))
    KS = Callable(import_module("moesim.kernel_state"))

    pool = 6
    IS, FS, _, TR, _ = KS._layout(num_keys=8, pool=pool, pend_max=8, maxn=1, top_k=1)
    tids = [KC._submit(key, KS.PREFETCH, 0.0, 0, IS, TR, FS) for key in range(pool)]
    for tid in (tids[1], tids[4]):  # withdrawn (PrefetchQueue.withdraw): tombstone, slot freed
        IS[IS[KS.H_PFQ] + TR[tid].pfslot] = -1
        KC._free(tid, IS)
    ring = IS[IS[KS.H_PFQ]:IS[KS.H_PFQ] + pool].copy()
    queued = [t for t in ring.tolist() if t != -1]  # in FIFO order
    IS[IS[KS.H_PFQ]:IS[KS.H_PFQ] + pool] = np.roll(ring, 2)  # the same queue with its head at slot 2 (it wraps)
    IS[KS.S_PFH] = 2
    for slot, t in enumerate(np.roll(ring, 2).tolist()):
        if t != -1:
            TR[t].pfslot = slot
    new = KC._submit(6, KS.PREFETCH, 0.0, 0, IS, TR, FS)
    assert IS[KS.S_PFH] == 0
    assert IS[KS.S_PFN] == len(queued) + 1 == 5
    assert IS[IS[KS.H_PFQ]:IS[KS.H_PFQ] + 5].tolist() == [*queued, new]
    assert [TR[t].pfslot for t in [*queued, new]] == list(range(5))


def test_the_copy_engine_serves_demand_first_in_order_and_completes_what_is_done_by_now():
    """The copy engine's contract (``docs/design.md``: FIFO within a priority, demand before
    prefetch, non-preemptive), worked by hand on the kernel's functions: three demand copies
    and two prefetches issued at 0 on a link where each copy takes 1 s, the second prefetch
    withdrawn (a tombstone in its ring, dropped as the ring is served). ``_advance(now)`` starts what starts before ``now``
    (one starting exactly at ``now`` waits), completes what is done by ``now`` (one done
    exactly at ``now`` is), keeps the demand queue's unstarted tail in order at its head, and
    adds each started copy's time to the busy time. (A replay rarely stops between two queued
    demand copies, so the queue's shift and the boundaries are driven here directly.)"""
    KC = Callable(import_module("moesim.simulator.kernel_copy"))
    KS = Callable(import_module("moesim.kernel_state"))

    IS, FS, K, TR, _ = KS._layout(num_keys=8, pool=8, pend_max=8, maxn=1, top_k=1)
    d0, d1, d2 = (KC._submit(key, KS.DEMAND, 0.0, 0, IS, TR, FS) for key in range(3))
    p0, gone, p1 = (KC._submit(key, KS.PREFETCH, 0.0, 0, IS, TR, FS) for key in (3, 4, 5))
    for key, t in ((0, d0), (1, d1), (2, d2), (3, p0), (4, gone), (5, p1)):
        K[key].state, K[key].tid = KS.INFLIGHT, t
    IS[IS[KS.H_PFQ] + TR[gone].pfslot] = -1  # withdrawn: a tombstone between the two prefetches
    dq = IS[KS.H_DQ]

    def queue():
        return IS[dq:dq + IS[KS.S_DQN]].tolist()

    def ring():
        size = IS[KS.H_POOL]
        return [IS[IS[KS.H_RQ] + (IS[KS.S_RH] + j) % size] for j in range(IS[KS.S_RN])]

    assert [(TR[t].start, TR[t].done) for t in (d0, d1, d2)] == [(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)]
    KC._advance(1.5, IS, K, TR, FS)  # d0 and d1 started, d2 (starts at 2) waits; d0 done
    assert queue() == [d2]
    assert [TR[t].started for t in (d0, d1, d2)] == [1, 1, 0]
    assert ring() == [d1]
    assert (K[0].state, K[1].state) == (KS.RESIDENT, KS.INFLIGHT)
    assert (FS[KS.SF_BUSY], FS[KS.SF_BUSY_UNTIL]) == (2.0, 2.0)
    KC._advance(2.0, IS, K, TR, FS)  # d2 starts exactly at 2: not yet; d1 done exactly at 2: done
    assert queue() == [d2]
    assert TR[d2].started == 0
    assert ring() == []
    assert K[1].state == KS.RESIDENT
    assert IS[KS.S_PFN] == 3  # the prefetches wait behind demand
    assert TR[p0].started == 0
    KC._advance(3.5, IS, K, TR, FS)  # d2 runs 2-3, then p0 3-4 (demand drained); d2 done
    assert queue() == []
    assert TR[d2].started == 1
    assert TR[p0].started == 1
    assert (TR[p0].start, TR[p0].done) == (3.0, 4.0)
    assert ring() == [p0]
    assert K[2].state == KS.RESIDENT
    assert K[3].state == KS.INFLIGHT
    assert (FS[KS.SF_BUSY], FS[KS.SF_BUSY_UNTIL]) == (4.0, 4.0)
    assert IS[KS.S_PFN] == 1  # the tombstone dropped, p1 at the head
    assert IS[IS[KS.H_PFQ] + IS[KS.S_PFH]] == p1
    KC._advance(4.0, IS, K, TR, FS)  # p1 would start exactly at 4: waits; p0 done exactly at 4: done
    assert IS[KS.S_PFN] == 1
    assert TR[p1].started == 0
    assert ring() == []
    assert K[3].state == KS.RESIDENT
    KC._advance(5.5, IS, K, TR, FS)
    assert IS[KS.S_PFN] == 0
    assert (TR[p1].start, TR[p1].done) == (4.0, 5.0)
    assert K[5].state == KS.RESIDENT
    assert K[4].state == KS.INFLIGHT  # the withdrawn one never completed
    assert (FS[KS.SF_BUSY], FS[KS.SF_BUSY_UNTIL]) == (5.0, 5.0)
    assert IS[KS.S_FREEN] == 8 - 1  # every slot back but the withdrawn one's (a withdrawal frees it: not here)


@settings(max_examples=300, deadline=None)
@given(values=st.lists(st.floats(0, 1e3, allow_subnormal=False) | st.floats(0, 1e-3), min_size=0, max_size=700),
       offset=st.integers(0, 3))
def test_the_kernels_pairwise_sum_is_numpys(values, offset):
    """``_pairwise_sum`` adds as numpy's ``sum`` adds a float64 array (tested bit for bit
    from 0 to 700 terms: numpy switches from one loop to eight accumulators at 8, and splits
    a run of more than 128 in two, recursively)."""
    KX = Callable(import_module("moesim.simulator.kernel_compute"))

    FS = np.full(offset + len(values) + 1, 12345.0)  # a term read outside the range shows
    FS[offset:offset + len(values)] = values
    got = KX._pairwise_sum(FS, offset, len(values))
    want = float(np.asarray(values, dtype=np.float64).sum())
    assert got == want or (math.isnan(got) and math.isnan(want))


def test_the_kernels_room_takes_as_many_victims_as_it_needs_or_changes_nothing():
    """``_room`` by hand (the cache's ``make_room``, entries of two sizes): victims in LRU
    order, pinned entries passed over, until the request fits; when the evictable entries
    cannot free enough, nothing is evicted and every pin is as it was; a request larger
    than the cache never fits; an eviction for a prefetch ends the victim's admission."""
    from moesim.policies.eviction.forms import form_index, unused_hooks
    from moesim.policies.eviction.lru import LRU, RecencyList
    KE = Callable(import_module("moesim.simulator.kernel_cache"))
    KC = Callable(import_module("moesim.simulator.kernel_copy"))
    KS = Callable(import_module("moesim.kernel_state"))

    IS, FS, KR, TR, _ = KS._layout(num_keys=8, pool=8, pend_max=4, maxn=1, nprec=2)
    IS[KS.C_L], IS[KS.C_DIV], IS[KS.C_FORM], IS[KS.C_INSTANT], IS[KS.C_MULTI] = 1, 8, form_index(LRU), 1, 1
    IS[IS[KS.H_PBYTES]:IS[KS.H_PBYTES] + 2] = [4, 1]  # key % 2 == 0: 4 bytes, else 1 byte
    FS[KS.CF_CAP] = 8.0
    S = RecencyList.state(None, 8)
    DI, A = np.zeros(1, np.int64), KS.Accesses(*(np.zeros(1, np.int64),) * 5, unused_hooks(), S)
    for key in (1, 3, 4, 7):  # least recently used first; 7 bytes in all
        KE._insert(key, KC._submit(key, KS.DEMAND, 0.0, 0, IS, TR, FS), True, -1, IS, KR, TR, DI, A)
    assert IS[KS.S_USED] == 7

    def field(key: int, f: str) -> int:
        return int(KR[key][f])

    def set_field(key: int, f: str, v: int) -> None:
        KR[key][f] = v

    def lru() -> list[int]:
        out, key = [], S[2][0]
        while key != -1:
            out.append(int(key))
            key = S[0][key, 1]
        return out

    pins = {1: 2, 3: 9, 4: 3, 7: 9}  # 3 and 7 pinned in generation 9
    for key, gen in pins.items():
        set_field(key, "pin", gen)
    assert KE._room(1, False, 9, -1, IS, KR, FS, A) == 0  # it fits: nothing evicted
    assert KE._room(9, False, 9, -1, IS, KR, FS, A) == -1  # larger than the cache
    assert KE._room(8, False, 9, -1, IS, KR, FS, A) == -1  # 1 free + 1 + 4 evictable < 8
    assert IS[KS.S_USED] == 7
    assert lru() == [1, 3, 4, 7]
    assert {key: field(key, "pin") for key in pins} == pins
    assert all(field(key, "state") == KS.RESIDENT for key in pins)
    for key in (1, 4):
        set_field(key, "adm", 5)
    IS[KS.S_PASS] = 6
    assert KE._room(6, True, 9, -1, IS, KR, FS, A) == 2  # exactly 1 free + 1 (key 1) + 4 (key 4; 3 is pinned)
    assert IS[KS.S_USED] == 2
    assert lru() == [3, 7]
    assert [field(key, "state") for key in (1, 3, 4, 7)] == [KS.ABSENT, KS.RESIDENT, KS.ABSENT, KS.RESIDENT]
    assert [field(key, "evicted") for key in (1, 4)] == [6, 6]
    assert [field(key, "adm") for key in (1, 4)] == [0, 0]  # no longer admissions
    assert field(3, "pin") == field(7, "pin") == 9
    assert KE._room(8, False, 10, -1, IS, KR, FS, A) == 2  # as large as the cache: everything goes
    assert IS[KS.S_USED] == 0
    assert lru() == []
    for key in (5, 6):  # 5 bytes: 3 free
        KE._insert(key, KC._submit(key, KS.DEMAND, 0.0, 0, IS, TR, FS), True, -1, IS, KR, TR, DI, A)
    assert KE._room(4, False, 11, -1, IS, KR, FS, A) == 1  # one victim (key 5) is enough
    assert lru() == [6]


@pytest.mark.parametrize("ev", ["lru", "fifo", "least-stale"])
def test_statically_pinned_experts_stay_out_of_the_recency_lists(ev):
    """A statically pinned expert is never a victim, so the list policies (lru, fifo,
    least-stale) keep it out of their lists: loaded by ``_preload``, then used, it never enters
    them, and the victim walk starts at the first key it may evict. (In a replay the result is
    the same either way, the victim walk passes over a pinned key; with half of a 5% cache
    pinned the LRU walk read 25 keys a miss on uniform routing and the replay took twice as
    long: 3.9 s against 1.9 s for 25.6 M accesses.) By hand: 4 single-byte keys in one layer,
    2 pinned, the other 2 demand-fetched, then every key used."""
    KE = Callable(import_module("moesim.simulator.kernel_cache"))
    KX = Callable(import_module("moesim.simulator.kernel_compute"))
    KC = Callable(import_module("moesim.simulator.kernel_copy"))
    KS = Callable(import_module("moesim.kernel_state"))

    IS, FS, KR, TR, DI, A = kernel_by_hand(ev, 8)
    FS[KS.CF_CAP] = 4.0
    assert KX._preload(np.array([5, 2], np.int64), IS, KR, FS, DI, np.zeros(1), A) == 2
    for key in (6, 1):
        KE._insert(key, KC._submit(key, KS.DEMAND, 0.0, 0, IS, TR, FS), True, -1, IS, KR, TR, DI, A)
    for key in (5, 2, 6, 1):
        KE._on_access(key, -1, IS, KR, DI, A)

    S = A.form

    def walk(head: int) -> list[int]:
        out, key = [], S[2][head]
        while key != -1:
            out.append(int(key))
            key = S[0][key, 1]
        return out

    lists = [walk(0)] if ev != "least-stale" else [walk(1 + 2 * q) for q in (0, 1)]
    assert [key for keys in lists for key in keys] == [6, 1]  # used in that order; 5 and 2 are not there
    assert IS[KS.S_USED] == 4
    assert KE._find_victim(False, 1, -1, 0, IS, KR, A) == 6  # pin generation 1: none pinned
    assert KE._room(1, False, 1, -1, IS, KR, FS, A) == 1
    assert [KR[key].state for key in (5, 2, 6, 1)] == [KS.RESIDENT] * 2 + [KS.ABSENT, KS.RESIDENT]


def test_the_pending_prefetch_list_keeps_only_live_transfers_when_compacted():
    """The pending-prefetch list (per target layer, for withdrawal) is compacted when full:
    entries whose slot was reused (sequence changed), whose transfer has started or was
    withdrawn go; the rest keep their order and fields. A list full of live entries is an
    error. (No replay in the tests fills it, so the function is driven directly.)"""
    KC = Callable(import_module("moesim.simulator.kernel_copy"))
    KP = Callable(import_module("moesim.simulator.kernel_prefetch"))
    KS = Callable(import_module("moesim.kernel_state"))

    IS, FS, _, TR, WR = KS._layout(num_keys=8, pool=16, pend_max=6, maxn=1, top_k=1)
    earlier = [KC._submit(key, KS.PREFETCH, 0.0, 0, IS, TR, FS) for key in range(5)]
    for t in earlier[::2]:  # slots reused: slots, sequence numbers and keys all differ
        KC._free(t, IS)
    tids = [KC._submit(key, KS.PREFETCH, 0.0, 0, IS, TR, FS) for key in range(6)]

    assert all(t != TR[t].seq for t in tids)
    pend = WR[IS[KS.H_PENDA]:]
    for j, t in enumerate(tids):  # (slot, sequence, key) as _admit records them
        pend[j].tid, pend[j].seq, pend[j].key = t, TR[t].seq, 10 + j
    IS[KS.S_PENDN] = 6
    TR[tids[0]].seq += 1  # the slot now holds another transfer
    TR[tids[2]].started = 1
    TR[tids[3]].cancelled = 1
    assert KP._compact_pending(IS, TR, WR) == 3
    assert IS[KS.S_PENDN] == 3
    kept = [[int(r.tid), int(r.seq), int(r.key)] for r in pend[:3]]
    assert kept == [[t, TR[t].seq, 10 + j] for j, t in ((1, tids[1]), (4, tids[4]), (5, tids[5]))]
    # full of live entries: nothing can go
    for j, t in enumerate(tids):
        TR[t].started = TR[t].cancelled = 0
        pend[j].tid, pend[j].seq, pend[j].key = t, TR[t].seq, 10 + j
    IS[KS.S_PENDN] = 6
    with pytest.raises(RuntimeError, match="pending prefetch list full"):
        KP._compact_pending(IS, TR, WR)


@pytest.mark.parametrize("probs", [True, False])
def test_the_kernels_token_mass_sums_in_the_documented_orders(probs):
    """``_token_mass`` on one token routed to experts 7, 1, 3 (rank order) with mass 1, 2^-53,
    2^-53, where the order of the sum decides the last bit: router probabilities add at
    ascending ids (numpy's order: 2^-53 + 2^-53 + 1 = 1 + 2^-52), top-k weights in rank order
    (1 + 2^-53 + 2^-53 = 1). Dropping expert 3 leaves the kept mass of 7 and 1 and alters
    the token (counted once per pass); substituting 0 (probability 2^-53) for 3 keeps the
    probabilities of 0, 1 and 7, or only the weights of 7 and 1."""
    KX = Callable(import_module("moesim.simulator.kernel_compute"))
    KS = Callable(import_module("moesim.kernel_state"))

    tiny = 2.0 ** -53
    IS, FS, _, _, _ = KS._layout(num_keys=8, pool=4, pend_max=4, maxn=3, top_k=3, fin=3)
    IS[KS.C_L], IS[KS.C_K], IS[KS.C_DIV], IS[KS.C_NPREC], IS[KS.C_DPREC] = 1, 3, 8, 1, 0
    IS[KS.C_PROBS] = probs
    FS[IS[KS.H_MSCR] - 1] = 1e9  # what lies before the scratch is never read
    experts = np.array([[7, 1, 3]], np.int16)
    if probs:
        mass = np.zeros((1, 8), np.float32)
        mass[0, [7, 1, 3, 0]] = (1.0, tiny, tiny, tiny)
        want_total, want_kept = float(np.sum(np.array([tiny, tiny, 1.0]))), float(np.sum(np.array([tiny, 1.0])))
        want_sub = want_total
        assert want_total == 1.0 + 2.0 ** -52
    else:
        mass = np.array([[1.0, tiny, tiny]], np.float32)
        want_total = want_kept = want_sub = 1.0
    M = KS.Tokens(np.array([0], np.int64), np.array([0, 1], np.int64), experts, experts, mass, np.array([0], np.int64),
                  np.array([-1], np.int64), np.zeros((1, 1), np.float32), np.zeros(1, np.int64), np.zeros(1, np.int64), (), route_arrays())

    def mass_with(final: list[int]) -> tuple[float, float, int]:
        IS[IS[KS.H_FIN]:IS[KS.H_FIN] + 3] = final
        FS[KS.SF_MTOTAL] = FS[KS.SF_MKEPT] = 0.0
        KX._token_mass(0, 0, IS, FS, M)
        return FS[KS.SF_MTOTAL], FS[KS.SF_MKEPT], IS[KS.R_ALTERED]

    assert mass_with([7, 1, 3]) == (want_total, want_total, 0)
    assert mass_with([7, 1, -1]) == (want_total, want_kept, 1)  # expert 3 dropped
    assert mass_with([7, 1, -1])[2] == 1  # the same token again in the pass: altered once
    assert M.mark[0] == 0  # marked in pass 0
    M.mark[0] = -1  # a new pass
    assert mass_with([7, 1, 0]) == (want_total, want_sub, 2)  # expert 0 computes for 3
    # a budget policy's choice: slots in its own order, experts the router did not choose
    M.mark[0] = -1
    assert mass_with([3, 7, 1]) == (want_total, want_total, 2)  # the routed set reordered: not altered
    assert mass_with([1, 5, -1]) == (want_total, tiny, 3)  # 7 and 3 gone, 5 added: 1's mass kept


def test_the_kernels_substitute_is_the_nearest_cached_unrouted_expert_lowest_id_on_a_tie():
    """Substitute's compiled ``decide`` by hand (SpecMD §3.1.2, as ``Substitute.decide``):
    expert 0 misses for both tokens; its mean probability is 0.5. Experts 1 and 2 are routed
    and 6 is absent (each scores 0.5, distance 0): not candidates. Of the cached 3 (0.25), 4
    (0.0) and 5 (0.75), 3 and 5 are equally near: the lower id wins. With 3 gone, 5; with none
    cached the miss is fetched."""
    from moesim.policies.miss.base import FETCH

    KX = Callable(import_module("moesim.simulator.kernel_compute"))
    SU = Callable(import_module("moesim.policies.miss.substitute"))
    KS = Callable(import_module("moesim.kernel_state"))

    E = 7
    IS, _, KR, _, _ = KS._layout(num_keys=E, pool=4, pend_max=4, maxn=3, top_k=2, fin=4)
    IS[KS.C_L], IS[KS.C_K], IS[KS.C_DIV], IS[KS.C_NPREC], IS[KS.C_DPREC], IS[KS.C_NE] = 1, 2, E, 1, 0, E
    IS[KS.S_LAYERGEN] = 3
    experts = np.array([[0, 1], [0, 2]], np.int16)
    probs = np.zeros((2, E), np.float32)
    probs[:, 0] = (0.25, 0.75)  # mean 0.5
    probs[:, 1] = probs[:, 2] = probs[:, 6] = 0.5
    probs[:, 3] = (0.5, 0.0)  # mean 0.25
    probs[:, 5] = (1.0, 0.5)  # mean 0.75
    M = KS.Tokens(np.array([0, 1], np.int64), np.array([0, 2], np.int64), experts, experts, probs, np.array([0, 1], np.int64),
                  np.array([-1, -1], np.int64), np.zeros((1, 1), np.float32), np.zeros(2, np.int64), np.zeros(2, np.int64), (), route_arrays())
    KX._fin_init(0, 0, 0, 0, IS, KS.Accesses(*(np.zeros(0, np.int32),) * 5, (), ()), M)
    for e in (0, 1, 2):
        IS[IS[KS.H_ROUTED] + e] = 3  # routed in this layer
    for e, state in ((1, KS.RESIDENT), (2, KS.RESIDENT), (3, KS.RESIDENT), (4, KS.INFLIGHT), (5, KS.RESIDENT)):
        KR[e].state = state
    assert SU._substitute_nearest(0, 0, 0, IS, KR, M) == 3
    KR[3].state = KS.ABSENT
    assert SU._substitute_nearest(0, 0, 0, IS, KR, M) == 5
    for e in (4, 5):
        KR[e].state = KS.ABSENT
    assert SU._nearest_resident(0, IS, KR, M) == -1
    assert SU._substitute_nearest(0, 0, 0, IS, KR, M) == FETCH


def _cache_aware_state(KS: Any, E: int) -> tuple[np.ndarray, np.ndarray]:
    """``IS`` and ``K`` of one layer of ``E`` experts, top-2, replayed under cache-aware
    routing (its form's index in ``C_ROUTE``), nothing cached."""
    from moesim.policies.routing.cache_aware import CacheAwareForm
    from moesim.policies.routing.forms import ROUTING_FORM_CLASSES

    IS, _, KR, _, _ = KS._layout(num_keys=E, pool=4, pend_max=4, maxn=3, top_k=2, fin=4)
    IS[KS.C_L], IS[KS.C_K], IS[KS.C_DIV], IS[KS.C_NPREC], IS[KS.C_DPREC], IS[KS.C_NE] = 1, 2, E, 1, 0, E
    IS[KS.C_ROUTE] = 1 + ROUTING_FORM_CLASSES.index(CacheAwareForm)
    return IS, KR


def test_the_kernels_cache_aware_routing_by_hand():
    """Cache-aware routing's compiled form and the lookups it leads to, by hand (SpecMD §3.1.1
    eq. 1): two rows of four experts, ``z = ln p``; the running mean of ``|z|`` over the
    layer's eight logits is 1.6028, so with lambda 0.5 the bias is 0.8014, on expert 0 (in
    flight) and 2 (resident). Row 0 (p 0.5, 0.3, 0.15, 0.05; the router's top-2 0, 1) scores
    0.108, -1.204, -1.096, -2.996: it takes 0 then 2. Row 1 (p 0.1, 0.2, 0.3, 0.4; router 3,
    2) scores -1.501, -1.609, -0.403, -0.916: 2 then 3. The lookups, in router order: 0 (1
    token, best rank 0), 2 (2 tokens, best rank 0: row 1's first), 3 (1 token, rank 1)."""
    KX = Callable(import_module("moesim.simulator.kernel_compute"))
    KS = Callable(import_module("moesim.kernel_state"))
    E = 4
    IS, KR = _cache_aware_state(KS, E)
    KR[0].state, KR[2].state = KS.INFLIGHT, KS.RESIDENT
    probs = np.array([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4]], np.float32)
    experts = np.array([[0, 1], [3, 2]], np.int16)
    z = np.log(probs.astype(np.float64))
    running = np.array([0.5, 0.0, 0.0])
    M = KS.Tokens(np.array([0, 1], np.int64), np.array([0, 2], np.int64), experts, experts.copy(), probs,
                  np.array([0, 1], np.int64), np.array([-1, -1], np.int64), np.zeros((1, 1), np.float32),
                  np.zeros(2, np.int64), np.zeros(2, np.int64), (), route_arrays(z=z, running=running))
    A = KS.Accesses(np.zeros(E, np.int16), np.zeros(E, np.int16), np.zeros(E, np.int32), np.zeros(E),
                    np.full(E, 9, np.int16), (), ())
    DI = np.zeros(3, np.int64)
    KX._routed_lookups(0, 1, IS, KR, DI, A, M)
    assert M.chosen.tolist() == [[0, 2], [2, 3]]
    assert experts.tolist() == [[0, 1], [3, 2]]  # the router's own, untouched
    total = 0.0
    for v in z.ravel().tolist():  # one after another
        total += abs(v)
    assert running.tolist() == [0.5, total, 8.0]
    assert total / 8 == pytest.approx(1.6028, abs=1e-4)
    assert (DI[1], DI[2]) == (0, 3)
    assert A.expert[:3].tolist() == [0, 2, 3]
    assert A.tokens[:3].tolist() == [1, 2, 1]
    assert A.rank[:3].tolist() == [0, 0, 1]
    KR[0].state = KS.ABSENT  # with nothing cached the router's own top-2, in rank order
    KR[2].state = KS.ABSENT
    KX._routed_lookups(0, 1, IS, KR, DI, A, M)
    assert M.chosen.tolist() == [[0, 1], [3, 2]]
    assert running[2] == 16.0
    assert A.expert[:4].tolist() == [0, 1, 3, 2]
    assert A.rank[:4].tolist() == [0, 1, 0, 1]
    assert (DI[1], DI[2]) == (0, 4)


def test_the_kernels_cache_aware_routing_reads_its_own_rows_and_breaks_a_tie_by_the_lower_id():
    """The second (pass, layer) of three rows (its rows 1 and 2 of the trace): its logits
    alone are summed (the first row's p = 1e-6 would add 13.8), and where two experts score the
    same the lower id ranks first: row 1 (p 0.4, 0.1, 0.4, 0.1) takes 0 then 2, row 2 (all
    0.25) 0 then 1. With 1 and 3 cached (a bias of 0.45), row 2 takes 1 then 3; row 1's
    biased 0.1s stay below its 0.4s."""
    KX = Callable(import_module("moesim.simulator.kernel_compute"))
    KS = Callable(import_module("moesim.kernel_state"))
    E = 4
    IS, KR = _cache_aware_state(KS, E)
    probs = np.array([[1e-6, 1e-6, 1e-6, 1e-6], [0.4, 0.1, 0.4, 0.1], [0.25, 0.25, 0.25, 0.25]], np.float32)
    experts = np.array([[0, 1], [0, 2], [3, 1]], np.int16)
    z = np.log(probs.astype(np.float64))
    running = np.array([0.3, 0.0, 0.0])
    M = KS.Tokens(np.array([0, 1, 2], np.int64), np.array([0, 1, 3], np.int64), experts, experts.copy(), probs,
                  np.array([0, 1, 2], np.int64), np.full(3, -1, np.int64), np.zeros((1, 1), np.float32),
                  np.zeros(3, np.int64), np.zeros(3, np.int64), (), route_arrays(z=z, running=running))
    A = KS.Accesses(np.zeros(E, np.int16), np.zeros(E, np.int16), np.zeros(E, np.int32), np.zeros(E),
                    np.zeros(E, np.int16), (), ())
    KX._routed_lookups(1, 1, IS, KR, np.zeros(3, np.int64), A, M)
    assert M.chosen[1:].tolist() == [[0, 2], [0, 1]]
    total = 0.0
    for v in z[1:].ravel().tolist():
        total += abs(v)
    assert running.tolist() == [0.3, total, 8.0]
    KR[1].state = KR[3].state = KS.RESIDENT
    KX._routed_lookups(1, 1, IS, KR, np.zeros(3, np.int64), A, M)
    assert M.chosen[1:].tolist() == [[0, 2], [1, 3]]


def test_the_kernels_substitute_waits_for_an_arriving_expert_and_promotes_it():
    """``_use_other`` by hand (the engine's ``_use_other``, for substitute and speculative): an
    expert whose prefetch is still queued is promoted to demand priority and the computation
    waits for that transfer; one resident runs at once. It is pinned each time and is new in
    the layer (told to the eviction policy) only the first time."""
    KC = Callable(import_module("moesim.simulator.kernel_copy"))
    KL = Callable(import_module("moesim.simulator.kernel_lookup"))
    KS = Callable(import_module("moesim.kernel_state"))

    E = 4
    IS, FS, KR, TR, WR = KS._layout(num_keys=E, pool=4, pend_max=4, maxn=2, top_k=2, fin=2, lrun=2)
    IS[KS.C_L], IS[KS.C_K], IS[KS.C_DIV], IS[KS.C_NPREC], IS[KS.C_DPREC], IS[KS.C_NE] = 1, 2, E, 1, 0, E
    IS[KS.C_FORM] = form_index(FIFO)
    IS[KS.S_LAYERGEN] = 1
    A = KS.Accesses(*(np.zeros(1, np.int32),) * 5, unused_hooks(), InsertionList.state(None, E))
    KC._submit(3, KS.DEMAND, 0.0, 0, IS, TR, FS)  # the link is busy until t = 1
    tid = KC._submit(2, KS.PREFETCH, 0.0, 0, IS, TR, FS)
    KR[2].state = KS.INFLIGHT
    KR[2].tid = tid
    assert TR[tid].prio == KS.PREFETCH

    def runs(buf: int) -> list[list[int]]:
        at = IS[KS.H_LRUN] + buf * 2
        return [[int(r.tid), int(r.seq), int(r.key), int(r.tokens)] for r in WR[at:at + IS[KS.S_LRUNN + buf]]]

    seq = TR[tid].seq
    KL._use_other(2, 3, 7, 0, IS, KR, TR, WR, FS, np.zeros(1, np.int64), A)
    assert TR[tid].prio == KS.DEMAND  # promoted
    assert runs(0) == [[tid, seq, 2, 3]]  # (slot, sequence, key, tokens)
    assert (KR[2].pin, IS[KS.S_NCOMP]) == (7, 1)
    KL._use_other(2, 1, 8, 0, IS, KR, TR, WR, FS, np.zeros(1, np.int64), A)
    assert runs(0)[1] == [tid, seq, 2, 1]  # the same expert again in the layer: not new
    assert (KR[2].pin, IS[KS.S_NCOMP]) == (8, 1)
    KR[3].state = KS.RESIDENT
    IS[KS.S_LRUNN + 1] = 0
    KL._use_other(3, 2, 9, -1, IS, KR, TR, WR, FS, np.zeros(1, np.int64), A)  # layer execution: the layer's list
    run = WR[IS[KS.H_RUNS] + 1]
    assert [run.tid, run.seq, run.key, run.tokens] == [-1, -1, 3, 2]  # resident: no wait
    assert IS[KS.S_NCOMP] == 2


def test_a_lookup_buffers_computations_are_all_pinned_and_no_others():
    """``_pin_buffer`` (per-expert execution: the running expert's computations, and the next
    one's, must not be evicted by the lookups made meanwhile) pins the key of every computation
    in the buffer it is given, not only the first, and nothing in the other buffer. (No test
    replay puts a second computation in a buffer where the victim search would pick it, so the
    function is driven directly.)"""
    KX = Callable(import_module("moesim.simulator.kernel_compute"))
    KS = Callable(import_module("moesim.kernel_state"))

    IS, _, KR, _, WR = KS._layout(num_keys=8, pool=4, pend_max=4, maxn=2, lrun=3)
    for buf, keys in ((0, (5, 2, 7)), (1, (1, 3))):
        at = IS[KS.H_LRUN] + buf * IS[KS.C_LRUNCAP]
        for x, key in enumerate(keys):
            WR[at + x].key = key
        IS[KS.S_LRUNN + buf] = len(keys)
    KX._pin_buffer(0, 9, IS, KR, WR)
    assert [int(KR[k].pin) for k in range(8)] == [0, 0, 9, 0, 0, 9, 0, 9]
    KX._pin_buffer(1, 10, IS, KR, WR)
    assert [int(KR[k].pin) for k in range(8)] == [0, 10, 9, 10, 0, 9, 0, 9]


def test_a_rings_slot_is_the_remainder_below_twice_its_size():
    """``_ring`` (the ring buffers' wrap: the copy engine's running and prefetch queues, the
    prefetch wait queue) is ``i % size`` for every ``i`` a ring asks for, ``0 <= i < 2 * size``:
    a head one step on, or a head plus a count of at most ``size``."""
    KS = Callable(import_module("moesim.kernel_state"))

    for size in (1, 2, 7, 1100):
        assert [KS._ring(i, size) for i in range(2 * size)] == [i % size for i in range(2 * size)]


def test_the_kernels_speculation_by_hand():
    """``_speculate`` (speculating-experts-prefetch.txt §4, as the engine's speculate branch):
    expert 0 misses for three tokens. Token 0's previous-layer prediction ranks 5 and 3 equal
    first (the lower id, 3, wins, as a stable sort), token 1's ranks 1 first but already
    computes 1, then 3 and 5 equal again, and 6 (uncached) above them all; token 2 has no row in
    the previous layer (no prediction) and loses expert 0. Expert 3 computes two tokens, one
    substitution is counted."""
    KL = Callable(import_module("moesim.simulator.kernel_lookup"))
    KS = Callable(import_module("moesim.kernel_state"))

    E = 8
    IS, FS, KR, TR, WR = KS._layout(num_keys=2 * E, pool=4, pend_max=4, maxn=3, top_k=2, fin=6, lrun=3, per_layer=E)
    IS[KS.C_L], IS[KS.C_K], IS[KS.C_NPREC], IS[KS.C_DPREC], IS[KS.C_NE] = 2, 2, 1, 0, E
    IS[KS.C_FORM] = form_index(FIFO)
    IS[KS.S_LAYER], IS[KS.S_LAYERGEN] = 1, 4
    experts = np.array([[0, 0], [0, 0], [0, 0], [0, 2], [0, 1], [0, 4]], np.int16)  # rows 3-5: layer 1
    pred = np.zeros((6, E), np.float32)
    pred[0, [5, 3]] = 0.5
    pred[1, [1, 3, 5, 6]] = (0.9, 0.4, 0.4, 1.0)
    prev_row = np.array([0, 1, 0], np.int64)
    prev_stamp = np.array([0, 0, -1], np.int64)  # token 2 has no row in (pass 0, layer 0)
    M = KS.Tokens(np.array([0, 1, 2, 3, 4, 5], np.int64), np.array([0, 3, 6], np.int64), experts, experts,
                  np.zeros((6, E), np.float32), np.array([0, 1, 2, 0, 1, 2], np.int64), np.full(3, -1, np.int64),
                  pred, prev_row, prev_stamp, (), route_arrays())
    IS[IS[KS.H_FIN]:IS[KS.H_FIN] + 6] = (0, 2, 0, 1, 0, 4)
    for e in (1, 2, 3, 4, 5):
        KR[E + e].state = KS.RESIDENT
    A = KS.Accesses(*(np.zeros(1, np.int32),) * 5, unused_hooks(), InsertionList.state(None, 2 * E))
    IS[KS.S_LRUNN] = 0
    KL._speculate(0, 9, 0, IS, KR, TR, WR, FS, np.zeros(1, np.int64), A, M)
    assert IS[IS[KS.H_FIN]:IS[KS.H_FIN] + 6].tolist() == [3, 2, 3, 1, -1, 4]
    assert IS[KS.R_SUBST] == 1
    runs = [[int(r.tid), int(r.seq), int(r.key), int(r.tokens)] for r in WR[IS[KS.H_LRUN]:IS[KS.H_LRUN] + IS[KS.S_LRUNN]]]
    assert runs == [[-1, -1, E + 3, 2]]  # (slot, sequence, key, tokens): resident, two tokens


def test_a_compiled_helper_is_compiled_once_whatever_literals_its_callers_pass():
    """moesim's ``jit``: a call from compiled code is compiled for its arguments' plain types,
    so a helper that callers pass ``-1``, ``True`` or a variable is compiled once (numba's own
    dispatcher compiles it once per literal value, each time with all that it calls); a branch
    on an argument that is None is still pruned where the function is compiled."""
    from moesim.jit import HAVE_NUMBA, jit

    if not HAVE_NUMBA or os.environ.get("NUMBA_DISABLE_JIT", "") not in ("", "0"):
        pytest.skip("numba compiles nothing here (not installed, or NUMBA_DISABLE_JIT)")

    def helper(x, flag):
        return x + 1 if flag else x - 1

    helper = jit(helper)

    def never(x):
        return x * 1000

    never = jit(never)

    def caller(n, opt):
        s = helper(n, True) + helper(-1, False) + helper(n, n > 2) + helper(7, True)
        if opt is not None:
            s += never(n)
        return s

    caller = jit(caller)
    assert caller(5, None) == 6 + (-2) + 6 + 8
    assert len(helper.signatures) == 1
    assert [str(t) for t in helper.signatures[0]] == ["int64", "bool"]
    assert never.signatures == []  # pruned: opt is None
    assert caller(5, 1) == 18 + 5000
    assert len(helper.signatures) == 1


def test_grow_rows_makes_the_per_token_regions_larger_last_in_is_and_w_and_keeps_the_rest() -> None:
    """The regions sized by a layer's tokens lie last (what each token computes, ``rows x
    top-k``; the speculative scratch, ``2 x rows``; the two lookup buffers, ``rows`` records
    each): a layer of as many tokens as there is room for changes nothing (the same arrays);
    more makes them larger with everything before them as it was."""
    KS = import_module("moesim.kernel_state")
    IS, _, _, _, W = KS._layout(num_keys=8, pool=8, pend_max=4, maxn=3, top_k=2, fin=2 * 5, lrun=5)
    fin, lrun = int(IS[KS.H_FIN]), int(IS[KS.H_LRUN])
    assert (IS[KS.H_SPEC], len(IS), len(W)) == (fin + 10, fin + 10 + 10, lrun + 10)
    IS[KS.S_PASS], IS[fin - 1] = 7, 11  # a scalar and the last entry of the region before
    W.key[:] = np.arange(len(W))
    same, work = KS.grow_rows(IS, W, 5, 2)
    assert same is IS
    assert work is W
    grown, work = KS.grow_rows(IS, W, 9, 2)
    assert grown[KS.H_SPEC] == fin + 18
    assert grown[KS.C_LRUNCAP] == 9
    assert len(grown) == fin + 18 + 2 * 9
    assert len(work) == lrun + 2 * 9
    kept = np.ones(fin, bool)
    kept[[KS.H_SPEC, KS.C_LRUNCAP]] = False
    assert (grown[:fin][kept] == IS[:fin][kept]).all()
    assert grown[KS.S_PASS] == 7
    assert grown[fin - 1] == 11
    assert work.key[:lrun].tolist() == list(range(lrun))
    assert (work.key[lrun:] == 0).all()

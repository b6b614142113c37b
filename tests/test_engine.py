"""Engine: closed forms, differential checks against libCacheSim, properties."""

from __future__ import annotations

import libcachesim as lcs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moesim.simulator.engine import Simulation, simulate
from moesim.simulator.workload import build_workload
from moesim.traces.synth import generate, synth_from_preset
from tests import reference_replay as R
from tests.helpers import (
    access_stream,
    datasheet_times,
    experts_cap,
    mixtral_trace,
    register_none_at_layer_1,
    scenario,
    small_model,
    trace_from_array,
)


def lcs_lru_hits(stream: list[int], capacity: int) -> list[bool]:
    """Per-access hit flags from libCacheSim's LRU, unit-size objects."""
    cache = lcs.LRU(cache_size=capacity)
    out = []
    for key in stream:
        req = lcs.Request()
        req.obj_id = key
        req.obj_size = 1
        out.append(bool(cache.get(req)))
    return out


def lcs_misses(stream: list[int], capacity: int, algo: str = "LRU") -> int:
    cache = getattr(lcs, algo)(cache_size=capacity)
    misses = 0
    for key in stream:
        req = lcs.Request()
        req.obj_id = key
        req.obj_size = 1
        misses += not cache.get(req)
    return misses


# -- closed forms ----------------------------------------------------------------------------

def on_demand_case(capacity: int, mode: str, fetch: str = "pipelined"):
    """A 3-layer no-prefetch replay in ``mode`` and what its closed form needs: the result,
    the workload, per-access compute and per-pass non-expert times and the copy time of one
    expert, all written from the A100 + PCIe 4.0 datasheet figures (tests/test_cost.py: HBM
    2039 GB/s, 312 TFLOPS, launches 5 us per expert and 20 us per layer; 32 GB/s x 0.8, half
    the efficiency at 64 KiB, 10 us latency), and each access's hit flag from the independent
    reference replay. Tiny model (H 256, I 512, 8 experts, 2 heads of 128): an expert is
    786,432 bytes and 786,432 FLOPs per token; the non-expert weights are 264,192 (bf16:
    528,384 bytes, 2 x 264,192 FLOPs per token) plus 1,024 bytes and 1,024 FLOPs per context
    token."""
    model = small_model(layers=3, experts=8, top_k=2)
    trace = generate(model, requests=1, prompt_tokens=4, tokens=30, seed=2)
    sc = scenario(cache={"capacity": experts_cap(capacity, model)}, expert_compute=mode, expert_fetch=fetch)
    res = simulate(sc, trace=trace)
    wl = build_workload(trace, 1)
    ffn, nonexp, copy = datasheet_times(model, wl)
    assert copy == pytest.approx(10e-6 + (786_432 + 65_536) / (32e9 * 0.8), rel=1e-15)
    ref_mode = "per-expert" if mode == "per-expert" else "layer"  # on-arrival pins as layer does
    hits = R.replay(R.trace_passes(trace), capacity, R.RefLRU(3), ref_mode, fetch=fetch).outcomes
    return res, wl, ffn, nonexp, copy, hits


def expected_durations(wl, nonexp, layer_end) -> list[float]:
    """Per pass of the 3-layer case, the duration the closed form gives: each layer starts
    with its non-expert part, and ``layer_end(t, lo, hi)`` is when its experts (accesses
    ``lo:hi``) are done from its routing point ``t``."""
    out = []
    for p in range(wl.num_passes):
        t = 0.0
        for layer in range(3):
            b = p * 3 + layer
            t = layer_end(t + nonexp[p], int(wl.off[b]), int(wl.off[b + 1]))
        out.append(t)
    return out


@pytest.mark.parametrize("capacity", [0, 3, 10, 10_000])
def test_on_demand_step_time_is_the_closed_form(capacity):
    """speculating-experts-prefetch.txt §5.1: T = sum over layers of (t_attn+gate + copy of the
    missed experts + expert compute). Hit/miss flags come from the independent reference
    replay (layer execution: the whole layer pinned)."""
    res, wl, ffn, nonexp, copy, hits = on_demand_case(capacity, "layer")

    def layer_end(t, lo, hi):
        return t + sum(not hits[i] for i in range(lo, hi)) * copy + ffn[lo:hi].sum()

    expected = expected_durations(wl, nonexp, layer_end)
    np.testing.assert_allclose(res.steps["duration_s"].to_numpy(), expected, rtol=1e-9, atol=1e-12)
    assert res.summary["misses"] == sum(not h for h in hits)


@pytest.mark.parametrize("capacity", [0, 3, 10, 48])
def test_on_arrival_step_time_is_the_closed_form(capacity):
    """``on-arrival`` execution: at the routing point t every miss is issued and the copies
    serialise, so the k-th miss of the layer (k = 1, 2, ...) arrives at t + k c; hits are
    there at t. Each expert runs as soon as it has arrived, in arrival order (hits first, in
    router order): s = t, then s = max(s, a) + f; the layer ends at s."""
    res, wl, ffn, nonexp, copy, hits = on_demand_case(capacity, "on-arrival")

    def layer_end(t, lo, hi):
        arrivals, k = [], 0
        for i in range(lo, hi):
            k += not hits[i]
            arrivals.append((t if hits[i] else t + k * copy, ffn[i]))
        s = t
        for a, f in sorted(arrivals):
            s = max(s, a) + f
        return s

    expected = expected_durations(wl, nonexp, layer_end)
    np.testing.assert_allclose(res.steps["duration_s"].to_numpy(), expected, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("capacity", [0, 3, 10, 48])
def test_per_expert_step_time_is_the_closed_form(capacity):
    """``per-expert`` execution: the layer's experts run one after another; expert j+1 is
    looked up (its copy issued) when expert j starts, so start_1 = t + c_1 and
    start_{j+1} = max(start_j + f_j, start_j + c_{j+1}), where c is the copy time of a miss
    (0 for a hit) and f the expert's compute; the layer ends at start_n + f_n. With every
    expert missing and equal f and c: c + (n - 1) max(c, f) + f. Hit flags from the
    independent reference replay in per-expert execution."""
    res, wl, ffn, nonexp, copy, hits = on_demand_case(capacity, "per-expert")

    def layer_end(t, lo, hi):
        start = t + (0.0 if hits[lo] else copy)
        for i in range(lo + 1, hi):
            start = max(start + ffn[i - 1], start + (0.0 if hits[i] else copy))
        return start + ffn[hi - 1]

    expected = expected_durations(wl, nonexp, layer_end)
    np.testing.assert_allclose(res.steps["duration_s"].to_numpy(), expected, rtol=1e-9, atol=1e-12)
    assert res.summary["misses"] == sum(not h for h in hits)
    if capacity == 0:  # every expert missing: c + (n - 1) max(c, f) + f per layer
        n = np.diff(wl.off[:4])
        f = [ffn[wl.off[i]] for i in range(3)]
        assert all(ffn[wl.off[i]:wl.off[i + 1]].max() == f[i] for i in range(3))
        first = sum(nonexp[0] + copy + (n[i] - 1) * max(copy, f[i]) + f[i] for i in range(3))
        assert res.steps["duration_s"].iloc[0] == pytest.approx(first, rel=1e-12)


@pytest.mark.parametrize("path", ["kernel", "simpy"])
@pytest.mark.parametrize("capacity", [0, 3, 10, 48])
def test_blocking_per_expert_step_time_is_the_closed_form(capacity, path, monkeypatch):
    """``per-expert`` execution with ``expert_fetch: blocking`` (SpecMD A.2: the fetch
    blocks until the expert has loaded): expert j+1 is looked up when expert j has run, so
    its copy never overlaps j's compute: start_1 = t + c_1, start_{j+1} = start_j + f_j +
    c_{j+1} (c: the copy time of a miss, 0 for a hit; f: the expert's compute); the layer
    ends at start_n + f_n. With every expert missing: n (c + f) per layer. Hit flags from
    the independent reference replay in blocking per-expert execution; on both replay
    paths."""
    if path == "simpy":
        monkeypatch.setenv("MOESIM_NO_KERNEL", "1")
    res, wl, ffn, nonexp, copy, hits = on_demand_case(capacity, "per-expert", "blocking")
    assert res.summary["replay_path"] == path

    def layer_end(t, lo, hi):
        start = t + (0.0 if hits[lo] else copy)
        for i in range(lo + 1, hi):
            start = start + ffn[i - 1] + (0.0 if hits[i] else copy)
        return start + ffn[hi - 1]

    expected = expected_durations(wl, nonexp, layer_end)
    np.testing.assert_allclose(res.steps["duration_s"].to_numpy(), expected, rtol=1e-9, atol=1e-12)
    assert res.summary["misses"] == sum(not h for h in hits)
    if capacity == 0:  # every expert missing: n (c + f) per layer
        n = np.diff(wl.off[:4])
        f = [ffn[wl.off[i]] for i in range(3)]
        first = sum(nonexp[0] + n[i] * (copy + f[i]) for i in range(3))
        assert res.steps["duration_s"].iloc[0] == pytest.approx(first, rel=1e-12)


def test_stall_is_exactly_the_copy_time_on_demand():
    model = small_model(layers=2, experts=8, top_k=2)
    trace = generate(model, requests=1, tokens=20, seed=5)
    sc = scenario(cache={"capacity": "0 experts"})
    res = simulate(sc, trace=trace)
    copy = sc.hardware.h2d.copy_time(model.expert_bytes["bf16"])
    assert res.summary["stall_s"] == pytest.approx(res.summary["misses"] * copy, rel=1e-9)
    assert res.summary["uncached_fetches"] == res.summary["misses"]


traces_st = st.builds(
    lambda layers, experts, k, tokens, seed, cap: (small_model(layers, experts, min(k, experts)), tokens, seed, cap),
    st.integers(1, 3), st.integers(2, 10), st.integers(1, 3), st.integers(1, 25),
    st.integers(0, 10_000), st.integers(0, 30))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces_st, st.integers(0, 8), st.integers(1, 3))
def test_computing_experts_on_arrival_is_never_slower(params, prompt, batch):
    model, tokens, seed, cap = params
    trace = generate(model, requests=batch, prompt_tokens=prompt, tokens=tokens, seed=seed)
    base = {"cache": {"capacity": experts_cap(cap, model)}, "workload": {"batch_size": batch}}
    layer = simulate(scenario(**base), trace=trace)
    arrival = simulate(scenario(**base, expert_compute="on-arrival"), trace=trace)
    assert arrival.summary["misses"] == layer.summary["misses"]
    assert (arrival.steps["end_s"].to_numpy() <= layer.steps["end_s"].to_numpy() * (1 + 1e-12) + 1e-15).all()
    assert arrival.summary["total_time_s"] <= layer.summary["total_time_s"] * (1 + 1e-12)


# -- E[N_a] ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("experts", "k", "batch"), [
    (64, 8, 1), (64, 8, 2), (64, 8, 4), (64, 8, 8), (64, 8, 16), (64, 8, 32), (64, 8, 64),
    (256, 8, 8), (256, 8, 32)])
def test_unique_experts_per_layer_follows_expected_active_experts(experts, k, batch):
    """xshare-batch-expert-sharing.txt §1: E[N_a] = N(1 - (1 - k/N)^B) under uniform routing
    (DeepSeek-R1 N=256, k=8: ~57 at B=8, ~163 at B=32)."""
    tokens = max(20, 4000 // batch)
    trace = synth_from_preset("olmoe-1b-7b", layers=4, experts=experts, top_k=k, routing="uniform",
                              requests=batch, tokens=tokens, seed=1)
    sc = scenario(timing=False, workload={"batch_size": batch}, cache={"capacity": "5%"})
    got = simulate(sc, trace=trace).summary["unique_experts_per_layer"]
    expected = experts * (1 - (1 - k / experts) ** batch)
    assert got == pytest.approx(expected, rel=0.02)
    if (experts, batch) == (256, 8):
        assert expected == pytest.approx(57, abs=1)
    if (experts, batch) == (256, 32):
        assert expected == pytest.approx(163, abs=1)


# -- capacity limits -------------------------------------------------------------------------

@pytest.mark.parametrize("timing", [True, False])
def test_infinite_capacity_leaves_only_compulsory_misses(timing):
    trace = synth_from_preset("olmoe-1b-7b", layers=4, requests=3, prompt_tokens=8, tokens=40, seed=3)
    for cap in ("inf", "100%"):
        res = simulate(scenario(timing=timing, cache={"capacity": cap}, workload={"batch_size": 2}), trace=trace)
        distinct = np.unique(trace.layer.astype(np.int64)[:, None] * 64 + trace.experts).size
        assert res.summary["misses"] == distinct
        assert res.summary["collision_misses"] == 0


# -- differential: libCacheSim ---------------------------------------------------------------

@pytest.mark.parametrize("capacity", [2, 8, 50, 200, 700])
@pytest.mark.parametrize("routing", ["realistic", "uniform"])
def test_lru_per_expert_misses_equal_libcachesim_on_synthetic_traces(capacity, routing):
    """Per-expert execution replays the sequential access stream (room for the running
    expert and the next is all it pins), so LRU equals libCacheSim's, timed or not."""
    trace = synth_from_preset("olmoe-1b-7b", requests=2, tokens=150, seed=11, routing=routing)
    expected = lcs_misses(access_stream(trace), capacity)
    for timing in (True, False):
        res = simulate(scenario(timing=timing, expert_compute="per-expert",
                                cache={"capacity": f"{capacity} experts"}), trace=trace)
        assert res.summary["misses"] == expected
        assert res.summary["hits"] == len(access_stream(trace)) - expected


@pytest.mark.real
@pytest.mark.parametrize("capacity", [2, 16, 64, 128, 200])
def test_lru_per_expert_misses_equal_libcachesim_on_real_mixtral_trace(capacity):
    trace = mixtral_trace("gsm8k")
    assert trace.num_tokens() == 247
    assert trace.num_requests == 2
    expected = lcs_misses(access_stream(trace), capacity)
    res = simulate(scenario(expert_compute="per-expert", cache={"capacity": f"{capacity} experts"}), trace=trace)
    assert res.summary["misses"] == expected


# -- properties ------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces_st, st.integers(1, 3), st.sampled_from(["layer", "on-arrival", "per-expert"]), st.booleans())
def test_invariants(params, batch, compute, timing):
    """Occupancy never exceeds capacity; bytes moved = misses x expert bytes; simulated time
    never goes backwards; the cache-only replay makes the same decisions."""
    model, tokens, seed, cap = params
    trace = generate(model, requests=batch, prompt_tokens=seed % 5, tokens=tokens, seed=seed)
    sc = scenario(timing=timing, expert_compute=compute, cache={"capacity": experts_cap(cap, model)},
                  workload={"batch_size": batch})
    sim = Simulation(sc, trace=trace, record_transfers=True)
    res = sim.run()
    s = res.summary
    eb = model.expert_bytes["bf16"]
    assert s["cache_peak_bytes"] <= min(cap, model.num_layers * model.num_experts) * eb
    assert s["bytes_by_link"]["pcie.h2d"] == s["misses"] * eb
    assert s["hits"] + s["misses"] == s["expert_accesses"]
    start, end = res.steps["start_s"].to_numpy(), res.steps["end_s"].to_numpy()
    assert (end >= start).all()
    assert (start[1:] >= end[:-1]).all()
    if timing:
        for _key, _kind, issued, begin, done, _nbytes in res.transfers or []:
            assert issued <= begin <= done
        begins = [b for _, _, _, b, _, _ in res.transfers or []]
        assert begins == sorted(begins)
    other = simulate(scenario(timing=not timing, expert_compute=compute,
                              cache={"capacity": experts_cap(cap, model)}, workload={"batch_size": batch}),
                     trace=trace)
    assert other.summary["misses"] == s["misses"]
    assert other.summary["collision_misses"] == s["collision_misses"]


def test_same_seed_gives_identical_results():
    sc = scenario(workload={"trace": {"synth": {"preset": "olmoe-1b-7b", "tokens": 60, "requests": 2,
                                                "prompt_tokens": 8}}})
    a, b = simulate(sc), simulate(sc)
    assert a.summary == b.summary
    assert a.steps.equals(b.steps)
    c = simulate(scenario(seed=1, workload={"trace": {"synth": {"preset": "olmoe-1b-7b", "tokens": 60,
                                                                 "requests": 2, "prompt_tokens": 8}}}))
    assert c.summary != a.summary


def test_collision_misses_counted_within_a_pass():
    """SpecMD §4.2 definition on a hand-made case: two layers, each needing experts {0, 1},
    and a cache of 2 experts, so every fetch evicts the other layer's experts."""
    model = small_model(layers=2, experts=4, top_k=2)
    # one token: layer 0 uses {0,1}, layer 1 uses {0,1}: keys 0,1 then 4,5. Capacity 2.
    ex = np.array([[[[0, 1], [0, 1]], [[0, 1], [0, 1]]]])
    res = simulate(scenario(cache={"capacity": "2 experts"}), trace=trace_from_array(model, ex))
    # pass 0: 4 compulsory misses (layer-1 misses evict layer-0 experts);
    # pass 1: layer 0 misses on keys evicted in pass 0 -> not collisions; its fetch evicts
    # layer 1's keys, which layer 1 then misses on: evicted earlier in the same pass -> 2 collisions.
    assert res.steps["misses"].tolist() == [4, 4]
    assert res.steps["collision_misses"].tolist() == [0, 2]


# -- cache-only replay -------------------------------------------------------------------------
@pytest.mark.parametrize("over", [
    {"policies": {"miss": {"name": "drop", "rank": 1}}},
    {"policies": {"miss": "substitute"}},
    {"policies": {"miss": "speculative", "prefetch": "next-gate-topk"}},
    {"policies": {"miss": "fetch-priority"}},
    {"policies": {"budget": "lynx"}},
    {"policies": {"routing": "cache-aware"}},
    {"policies": {"budget": "moe-spec"}, "hardware": {"preset": "h100-sxm-nvlink-x4"}},
    {"policies": {"prefetch": "oracle"}},
])
@pytest.mark.parametrize("mode", ["layer", "on-arrival", "per-expert"])
def test_cache_only_replay_passes_no_time_on_any_path(over, mode):
    """docs/design.md: cache-only replay makes the decisions at zero cost, so no simulated
    time passes — also on the per-token lookup path and with expert parallelism (both charged
    expert compute time before; tests/golden_grid_results.py's CHANGED)."""
    trace = synth_from_preset("olmoe-1b-7b", layers=4, experts=16, top_k=4, requests=4, prompt_tokens=3,
                              tokens=5, seed=2, probs=True, pred_next=True)
    sc = scenario(timing=False, expert_compute=mode, workload={"batch_size": 4}, cache={"capacity": "20%"},
                  **over)
    res = simulate(sc, trace=trace)
    steps = res.steps
    assert (steps.end_s == 0).all()
    assert (steps.stall_s == 0).all()
    timed = simulate(scenario(expert_compute=mode, workload={"batch_size": 4}, cache={"capacity": "20%"}, **over),
                     trace=trace).steps
    assert timed.end_s.iloc[-1] > 0  # the same scenario timed does take time
    assert steps.hits.sum() + steps.misses.sum() + steps.late_prefetches.sum() > 0


def test_the_per_token_path_runs_a_layer_in_router_order():
    """``LayerLookup.finish`` returns the layer's expert computations in the order they were
    looked up (router order: token by token, rank by rank), not in the order a Python set of
    expert ids iterates: here the token routes to 5, 2 and 9 (the set the layer kept of them
    iterates 2 first); with drop, 9 (rank 2) is dropped."""
    from moesim.simulator.lookup import LayerLookup, PassRow

    model = small_model(layers=1, experts=16, top_k=3)
    tr = trace_from_array(model, np.array([[[[5, 2, 9]]]]))
    sim = Simulation(scenario(cache={"capacity": "0 experts"}, policies={"miss": {"name": "drop", "rank": 2}}),
                     trace=tr)
    sim._prepare_costs()
    look = LayerLookup(sim, set())
    look.plan(0, 0, 0, 3, PassRow())
    assert look.experts == [5, 2, 9]
    assert list({5, 2, 9} - {9}) == [2, 5]
    runs: list = []
    for i in range(len(look)):
        look.lookup(i, set(look.keys), 0.0, runs)
    out = look.finish(runs)
    assert [sim.eviction.ctx.base_of(key) for key, _, _ in out] == [5, 2]
    assert look.row.dropped == 1
    assert look.row.unique == 2


@pytest.mark.parametrize(("passes", "expected"), [
    (3, [1, 2, 3, 3]),  # fewer than 400 passes: every pass
    (401, [*range(2, 401, 2), 401]),  # every floor(401 / 200) = 2 passes, then the end
    (600, [*range(3, 601, 3), 600]),  # every 3
])
def test_the_simpy_path_reports_progress_about_200_times(monkeypatch, passes, expected):
    """``simulate(..., progress=f)`` calls ``f(done, total)`` every ``max(1, passes // 200)``
    passes and once at the end (the CLI's progress bar). One request, one prompt token and
    ``passes - 1`` decode tokens make ``passes`` passes. Found missing by mutation testing of
    engine.py (the keyword arguments were not passed on, the period was not checked)."""
    from tests.helpers import small_model, trace_from_array

    monkeypatch.setenv("MOESIM_NO_KERNEL", "1")
    model = small_model(layers=2, experts=4, top_k=1)
    trace = trace_from_array(model, np.zeros((1, passes, 2, 1), dtype=np.int64), prompt_tokens=1)
    calls: list[tuple[int, int]] = []
    res = simulate(scenario(cache={"capacity": "2 experts"}), trace=trace,
                   progress=lambda done, total: calls.append((done, total)))
    assert res.summary["replay_path"] == "simpy"
    assert len(res.steps) == passes
    assert calls == [(d, passes) for d in expected]


@pytest.mark.parametrize("mode", ["layer", "on-arrival", "per-expert"])
def test_a_layer_whose_budget_keeps_no_expert_costs_only_its_attention(monkeypatch, mode):
    """A user's budget policy that keeps no expert at layer 1 (every token computes nothing
    there). One prompt token, top-1, routed to expert 0 at layer 0 and expert 1 at layer 1,
    A100 + PCIe 4 datasheet times (attention a, expert f, copy c): layer 0 misses its expert
    (cold cache) and computes it once arrived, layer 1 runs its attention only. The pass lasts
    a + c + f + a in every execution mode, with one miss, one expert computed and the token
    altered. Found missing by mutation testing of engine.py: per-expert execution's guard for
    a layer with no expert to look up."""
    register_none_at_layer_1(monkeypatch)
    model = small_model(layers=2, experts=4, top_k=1)
    t = trace_from_array(model, np.array([[[[0], [1]]]]), prompt_tokens=1)
    sim = Simulation(scenario(cache={"capacity": "inf"}, expert_compute=mode,
                              policies={"budget": "none-at-1"}), trace=t)
    res = sim.run()
    ffn, nonexp, copy = datasheet_times(model, sim.wl)
    assert res.summary["total_time_s"] == pytest.approx(2 * nonexp[0] + copy + ffn[0], rel=1e-9)
    row = res.steps.iloc[0]
    assert (row["hits"], row["misses"], row["unique_experts"], row["tokens_altered"]) == (0, 1, 1, 1)


def test_the_clock_an_eviction_policy_reads_when_a_demand_fetch_walks_for_victims(monkeypatch):
    """``per-expert`` execution looks expert j+1 up when expert j starts to run; the eviction
    policy asked for victims then reads that time from the clock. One prompt token, one
    layer, top-2 (experts 0 and 1), capacity 1 expert, A100 + PCIe 4 datasheet times
    (attention a, expert f, copy c > f, checked): expert 0 misses at a and lands at a + c;
    then expert 1 misses and the cache walks the policy's candidates (expert 0 is running,
    pinned: an uncached fetch) at a + c, the only walk; the pass ends at a + 2c + f. Found
    missing by mutation testing of engine.py: the clock left unset there went unnoticed."""
    from moesim.policies.eviction import REGISTRY as EVICTION
    from moesim.policies.eviction.lru import LRU

    seen: list[tuple[float, int, int]] = []

    class Recording(LRU):
        def candidates(self):
            c = self.ctx.clock
            seen.append((c.now, c.pass_index, c.layer))
            return super().candidates()

    monkeypatch.setitem(EVICTION._classes, "recording", Recording)
    model = small_model(layers=1, experts=4, top_k=2)
    t = trace_from_array(model, np.array([[[[0, 1]]]]), prompt_tokens=1)
    sim = Simulation(scenario(cache={"capacity": "1 experts"}, expert_compute="per-expert",
                              policies={"eviction": "recording"}), trace=t)
    res = sim.run()
    ffn, nonexp, c = datasheet_times(model, sim.wl)
    a, f = nonexp[0], ffn[0]
    assert c > f
    assert [(p, layer) for _, p, layer in seen] == [(0, 0)]
    assert seen[0][0] == pytest.approx(a + c, rel=1e-12)
    assert res.summary["total_time_s"] == pytest.approx(a + 2 * c + f, rel=1e-9)
    assert res.steps["uncached_fetches"].iloc[0] == 1


def test_a_trace_with_no_rows_is_refused_by_name():
    """A trace in memory with no rows (the trace reader refuses such a file) cannot be
    replayed: a MoesimError naming it, not numpy's reshape error."""
    from moesim.errors import MoesimError
    from moesim.traces.trace import Trace

    model = small_model(layers=2, experts=4, top_k=1)
    empty = Trace(model=model, request=np.zeros(0, np.int32), step=np.zeros(0, np.int32),
                  position=np.zeros(0, np.int32), phase=np.zeros(0, np.int8), layer=np.zeros(0, np.int16),
                  experts=np.zeros((0, 1), np.int16), weights=np.zeros((0, 1), np.float32), source="empty.parquet")
    with pytest.raises(MoesimError, match=r"trace empty.parquet: has no rows"):
        simulate(scenario(), trace=empty)


def test_layers_routed_counts_the_layers_a_pass_routes_tokens_through():
    """``steps.parquet``'s ``layers_routed``: per pass, the layers with at least one routed
    token. A three-layer model; the prompt token is routed at layers 0 and 2 only (top-1,
    one access each; layer 1 has no row), the decode token at all three: 2 then 3. Found
    missing by mutation testing of engine.py (the column had no test)."""
    from moesim.traces.trace import Trace

    model = small_model(layers=3, experts=4, top_k=1)
    t = Trace(model=model, request=np.zeros(5, np.int32), step=np.array([0, 0, 1, 1, 1], np.int32),
              position=np.array([0, 0, 1, 1, 1], np.int32), phase=np.array([0, 0, 1, 1, 1], np.int8),
              layer=np.array([0, 2, 0, 1, 2], np.int16), experts=np.array([[1], [2], [1], [3], [0]], np.int16),
              weights=np.ones((5, 1), np.float32))
    res = simulate(scenario(cache={"capacity": "inf"}), trace=t)
    assert res.steps["layers_routed"].tolist() == [2, 3]
    assert res.steps["unique_experts"].tolist() == [2, 3]


def test_the_scenario_s_max_requests_and_seed_shape_the_workload():
    """``workload.max_requests`` keeps the first N requests, and the scenario's ``seed`` draws
    speculative acceptance: the engine's workload is ``build_workload`` of the trace with
    both (its pass and access arrays equal), and seed 1 accepts differently from seed 0.
    The replay's ``wall_s`` (what the speed benchmarks divide by) is the time run() took.
    Found missing by mutation testing of engine.py (either could be dropped unnoticed)."""
    import time

    t = synth_from_preset("mixtral-8x7b", layers=2, requests=3, tokens=12, seed=4)
    spec = {"tree_size": 4, "accept_prob": 0.5}
    sims = {s: Simulation(scenario(seed=s, cache={"capacity": "inf"},
                                   workload={"max_requests": 2, "speculative": spec}), trace=t) for s in (0, 1)}
    for s, sim in sims.items():
        ref = build_workload(t, 1, 2, sim.scenario.workload.speculative, s)
        assert len(ref.request_ids) == 2
        for name in ("pass_tokens", "pass_generated", "pass_context", "off", "acc_expert", "request_ids"):
            assert np.array_equal(getattr(sim.wl, name), getattr(ref, name)), (s, name)
    assert not np.array_equal(sims[0].wl.pass_generated, sims[1].wl.pass_generated)
    t0 = time.perf_counter()
    sims[0].run()
    assert 0 < sims[0].wall_s <= time.perf_counter() - t0


def test_routing_budget_and_miss_policies_are_told_the_pass_and_layer(monkeypatch):
    """User routing, budget and miss policies (the plugin registries) that record the pass
    and layer they are given, on one GPU. Two passes (a prompt token, a decode token) of a
    two-layer model, top-2, capacity 0 experts, so that every expert misses: routing and
    budget see (0, 0), (0, 1), (1, 0), (1, 1) in that order; the miss policy sees each of
    them twice (two missed experts per layer). Found missing by mutation testing of
    lookup.py: the lookup could hand these policies another pass index unnoticed."""
    from moesim.policies.budget import REGISTRY as BUDGET
    from moesim.policies.budget import BudgetPolicy
    from moesim.policies.miss import REGISTRY as MISS
    from moesim.policies.miss import MissDecision, MissPolicy
    from moesim.policies.routing import REGISTRY as ROUTING
    from moesim.policies.routing import RoutingPolicy

    seen: dict[str, list[tuple[int, int]]] = {"routing": [], "budget": [], "miss": []}

    class RecordingRouting(RoutingPolicy):
        def route(self, pass_index, layer, rows, experts, cached):
            seen["routing"].append((pass_index, layer))
            return experts

    class RecordingBudget(BudgetPolicy):
        def select(self, pass_index, layer, rows, experts):
            seen["budget"].append((pass_index, layer))
            return experts.tolist()

    class RecordingMiss(MissPolicy):
        def decide(self, info):
            seen["miss"].append((info.pass_index, info.layer))
            return MissDecision("fetch")

    monkeypatch.setitem(ROUTING._classes, "recording", RecordingRouting)
    monkeypatch.setitem(BUDGET._classes, "recording", RecordingBudget)
    monkeypatch.setitem(MISS._classes, "recording", RecordingMiss)
    model = small_model(layers=2, experts=4, top_k=2)
    ex = np.array([[[[0, 1], [2, 3]], [[0, 2], [1, 3]]]])  # one request: prompt token, decode token
    res = simulate(scenario(cache={"capacity": "0 experts"},
                            policies={"routing": "recording", "budget": "recording", "miss": "recording"}),
                   trace=trace_from_array(model, ex, prompt_tokens=1))
    assert res.summary["replay_path"] == "simpy"
    order = [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert seen == {"routing": order, "budget": order, "miss": [pl for pl in order for _ in range(2)]}
    assert int(res.steps["misses"].sum()) == 8

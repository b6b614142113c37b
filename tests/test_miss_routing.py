"""Miss-handling, precision and routing policies on hand-checked examples: what they do to
gate_mass_retained, tokens_altered, bytes and precision."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from moesim.errors import MoesimError
from moesim.policies.miss import REGISTRY as MISS
from moesim.simulator.engine import Simulation, simulate
from moesim.traces.synth import synth_from_preset
from tests.helpers import scenario, small_model, trace_from_array


def tiny(experts_by_token: list[list[list[int]]], num_experts: int = 4, **probs):
    """Trace of one request: experts_by_token[t][layer] = expert ids (rank order)."""
    ex = np.array([experts_by_token])
    k = ex.shape[-1]
    t = trace_from_array(small_model(layers=ex.shape[2], experts=num_experts, top_k=k), ex)
    for name, rows in probs.items():
        setattr(t, name, np.asarray(rows, dtype=np.float32))
    return t


def test_drop_skips_low_ranks_and_loses_their_weight():
    t = tiny([[[0, 1]], [[2, 3]]])
    t.weights[:] = [[0.7, 0.3], [0.6, 0.4]]
    s = simulate(scenario(cache={"capacity": "0 experts"}, policies={"miss": {"name": "drop", "rank": 1}}),
                 trace=t).summary
    assert s["gate_mass_retained"] == pytest.approx((0.7 + 0.6) / 2.0)
    assert s["tokens_altered"] == 1.0
    assert s["dropped_experts"] == 2
    assert s["misses"] == 4  # all four missed; two fetched (streamed), two dropped
    assert s["bytes_by_link"]["pcie.h2d"] == 2 * t.model.expert_bytes["bf16"]
    keep_all = simulate(scenario(cache={"capacity": "0 experts"}, policies={"miss": {"name": "drop", "rank": 2}}),
                        trace=t).summary
    assert keep_all["gate_mass_retained"] == 1.0
    assert keep_all["tokens_altered"] == 0.0


def test_substitute_runs_the_resident_expert_with_the_nearest_score():
    probs = [[0.5, 0.3, 0.15, 0.05], [0.2, 0.25, 0.5, 0.05]]
    t = tiny([[[0]], [[2]]], probs=probs)
    s = simulate(scenario(cache={"capacity": "1 expert"}, policies={"miss": "substitute"}), trace=t).summary
    # token 0: e0 missing, nothing resident -> fetched. token 1: e2 missing, e0 resident -> runs e0.
    assert s["substituted_experts"] == 1
    assert s["gate_mass_retained"] == pytest.approx((0.5 + 0.2) / (0.5 + 0.5))
    assert s["tokens_altered"] == 0.5
    assert s["bytes_by_link"]["pcie.h2d"] == t.model.expert_bytes["bf16"]


def test_speculative_executes_the_predicted_expert_and_never_fetches_the_true_one():
    # layer 0 -> e0; the predictor (pred_next of layer 0) says layer 1 -> e1; truly e3
    probs = [[0.7, 0.1, 0.1, 0.1], [0.1, 0.3, 0.1, 0.5]]
    pred = [[0.1, 0.6, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]]
    t = tiny([[[0], [3]]], probs=probs, pred_next=pred)
    sc = scenario(cache={"capacity": "inf"}, policies={"miss": "speculative", "prefetch": "next-gate-topk"})
    s = simulate(sc, trace=t).summary
    assert s["gate_mass_retained"] == pytest.approx((0.7 + 0.3) / (0.7 + 0.5))
    assert s["tokens_altered"] == 1.0
    assert s["prefetches_issued"] == 1
    assert s["bytes_by_link"]["pcie.h2d"] == 2 * t.model.expert_bytes["bf16"]  # e0 and e1, never e3


def test_cache_aware_routing_prefers_cached_experts_with_dual_logits():
    """SpecMD eq. 1 by hand: after token 0 (probs .6 .3 .05 .05) e0 is cached;
    delta_avg = mean |log p| over both tokens = 1.7173; lambda = 0.3 adds 0.5152 to e0's
    logit: log .3 + .5152 = -0.689 > log .4 = -0.916, so token 1 runs e0 instead of e1 and
    keeps e0's original probability .3 (not the boosted one)."""
    probs = [[0.6, 0.3, 0.05, 0.05], [0.3, 0.4, 0.2, 0.1]]
    t = tiny([[[0]], [[1]]], probs=probs)
    sc = scenario(cache={"capacity": "inf"}, policies={"routing": {"name": "cache-aware", "lam": 0.3}})
    s = simulate(sc, trace=t).summary
    assert s["misses"] == 1
    assert s["hits"] == 1
    assert s["gate_mass_retained"] == pytest.approx((0.6 + 0.3) / (0.6 + 0.4))
    assert s["tokens_altered"] == 0.5
    weak = simulate(scenario(cache={"capacity": "inf"}, policies={"routing": {"name": "cache-aware", "lam": 0.05}}),
                    trace=t).summary
    assert weak["tokens_altered"] == 0.0  # 0.05 * 1.717 = 0.086 < log(.4/.3) = 0.288


def _cache_aware(probs: np.ndarray, lam: float = 0.3):
    """Cache-aware routing over a workload of ``probs`` alone (its context: the policy reads
    the workload's probabilities, the number of experts and the cache keys)."""
    from types import SimpleNamespace

    from moesim.policies.routing.cache_aware import CacheAware, CacheAwareParams

    n = probs.shape[1]
    ctx = SimpleNamespace(workload=SimpleNamespace(probs=probs), num_experts=n, key=lambda layer, e: layer * n + e)
    return CacheAware(CacheAwareParams(lam), ctx)


def test_cache_aware_routing_breaks_a_tie_by_the_lower_expert_id():
    """64 experts whose probabilities take four values, many equal, nothing cached: the top-8
    are the likeliest, the lower id first among equals (as a stable sort orders them;
    numpy's default sort would not). Two of the likeliest experts past those 8, cached, come
    first, the lower id first."""
    rng = np.random.default_rng(0)
    probs = np.array([[0.4, 0.3, 0.2, 0.1][i] for i in rng.integers(0, 4, 64)], np.float32)[None, :]
    pol = _cache_aware(probs)
    got = pol.route(0, 0, np.array([0]), np.zeros((1, 8), np.int64), lambda key: False)
    want = sorted(range(64), key=lambda e: (-float(probs[0, e]), e))[:8]
    assert got.tolist() == [want]
    tops = [e for e in range(64) if probs[0, e] == np.float32(0.4)]
    assert len(tops) >= 10
    cached = {tops[-1], tops[-2]}  # two of the likeliest past the first 8: a bias moves them to the front
    got = pol.route(0, 0, np.array([0]), np.zeros((1, 8), np.int64), lambda key: key in cached)
    assert got.tolist() == [sorted(cached) + want[:6]]


def test_cache_aware_routing_reads_the_workload_it_is_given_now():
    """Served or read in pieces, the workload changes between calls: the logits are the new
    one's, not the first's."""
    first = np.full((1, 8), 0.01, np.float32)
    first[0, 0] = 0.9
    then = np.full((1, 8), 0.01, np.float32)
    then[0, 5] = 0.9
    pol = _cache_aware(first)
    assert pol.route(0, 0, np.array([0]), np.zeros((1, 1), np.int64), lambda key: False).tolist() == [[0]]
    pol.ctx.workload = type(pol.ctx.workload)(probs=then)
    assert pol.route(1, 0, np.array([0]), np.zeros((1, 1), np.int64), lambda key: False).tolist() == [[5]]


@pytest.mark.parametrize("kernel", [False, True])
def test_cache_aware_routing_averages_every_logit_it_has_routed(monkeypatch, kernel):
    """After a replay, the running mean of ``|z|`` holds every routed logit: one per expert of
    every trace row (each row is one token at one layer), summed as an exact sum gives them."""
    import math

    t = synth_from_preset("olmoe-1b-7b", layers=3, requests=3, prompt_tokens=4, tokens=6, seed=2, probs=True)
    if kernel:
        monkeypatch.delenv("MOESIM_NO_KERNEL", raising=False)
    else:
        monkeypatch.setenv("MOESIM_NO_KERNEL", "1")
    sim = Simulation(scenario(policies={"routing": "cache-aware"}), trace=t)
    res = sim.run()
    assert res.summary["replay_path"] == ("kernel" if kernel else "simpy")
    pol = sim.routing
    total, n = (pol.running[1], pol.running[2]) if kernel else (pol._sum, pol._n)
    assert n == t.probs.size
    exact = math.fsum(abs(math.log(max(float(p), 1e-30))) for p in t.probs.ravel())
    assert total == pytest.approx(exact, rel=1e-12)
    assert pol.running[0] == 0.3


def test_cache_aware_routing_without_probabilities_says_how_to_get_them():
    t = synth_from_preset("olmoe-1b-7b", layers=2, tokens=3, seed=0)
    with pytest.raises(MoesimError) as err:
        Simulation(scenario(policies={"routing": "cache-aware"}), trace=t)
    assert str(err.value) == (
        "routing policy 'cache-aware' needs the trace's 'probs' column (full router probabilities) and this trace "
        "has none. Record it with `moesim capture`, or use workload.trace.synth.probs: true.")


def test_fetch_lowest_bit_moves_the_smallest_copies():
    t = synth_from_preset("olmoe-1b-7b", layers=2, tokens=10, seed=1)
    eb = t.model.expert_bytes
    s = simulate(scenario(cache={"capacity": "inf"},
                          policies={"miss": {"name": "fetch-lowest-bit", "precisions": ["bf16", "int4"]}}),
                 trace=t).summary
    assert s["bytes_by_link"]["pcie.h2d"] == s["misses"] * eb["int4"]
    assert s["low_precision_experts"] == s["expert_accesses"]  # every use runs the int4 copy
    assert s["gate_mass_retained"] == 1.0  # precision changes no routing
    plain = simulate(scenario(cache={"capacity": "inf"}), trace=t).summary
    assert s["total_time_s"] < plain["total_time_s"]
    # the decision log: every use of a resident int4 copy (the policy's alternative) is a hit
    # on that copy, every miss a fetch of one
    sim = Simulation(scenario(cache={"capacity": "inf"},
                              policies={"miss": {"name": "fetch-lowest-bit", "precisions": ["bf16", "int4"]}}),
                     trace=t, record_decisions=True)
    sim.run()
    ctx = sim.eviction.ctx
    int4 = ctx.precisions.index("int4")
    ops = [(op, ctx.precision_of(key)) for _, _, op, key in sim.decisions if op != "run"]
    assert ops.count(("hit", int4)) == s["hits"] > 0
    assert ops.count(("fetch", int4)) == s["misses"]
    assert len(ops) == s["hits"] + s["misses"]


def test_fetch_priority_degrades_low_ranks_and_cascades_when_short_of_room():
    t = synth_from_preset("olmoe-1b-7b", layers=1, tokens=1, seed=2, top_k=4)
    eb = t.model.expert_bytes
    pol = {"miss": {"name": "fetch-priority", "precisions": ["bf16", "int8", "int4"], "degrade_fraction": 0.5}}
    s = simulate(scenario(cache={"capacity": "inf"}, policies=pol), trace=t).summary
    # ranks 0-1 at bf16, ranks 2-3 one level lower (int8)
    assert s["bytes_by_link"]["pcie.h2d"] == 2 * eb["bf16"] + 2 * eb["int8"]
    assert s["low_precision_experts"] == 2
    # room for one int8 expert only: bf16 cannot fit, int8 can; the rest cascade to int4 or stream
    s2 = simulate(scenario(cache={"capacity": f"{eb['int8']}b"}, policies=pol), trace=t).summary
    assert s2["low_precision_experts"] == 4
    assert s2["cache_peak_bytes"] <= eb["int8"]


def test_lhu_evicts_low_precision_copies_first():
    from moesim.policies.eviction import REGISTRY as EVICTION
    from moesim.policies.registry import PolicyContext

    ctx = PolicyContext(num_layers=1, num_experts=4, top_k=1, expert_bytes=4,
                        rng=np.random.default_rng(0), precisions=("bf16", "int8"), precision_bytes=(4, 2))
    lhu = EVICTION.get("lhu")(EVICTION.get("lhu").Params(), ctx)
    hi_a, hi_b, lo_c = ctx.key(0, 0, 0), ctx.key(0, 1, 0), ctx.key(0, 2, 1)
    for key in (hi_a, hi_b, lo_c):
        lhu.on_insert(key, True)
    lhu.on_access(hi_a)
    assert list(lhu.candidates()) == [lo_c, hi_b, hi_a]


@pytest.mark.parametrize(("policies", "column"), [
    ({"miss": "substitute"}, "probs"),
    ({"miss": "speculative"}, "pred_next"),
    ({"routing": "cache-aware"}, "probs"),
])
def test_policies_name_the_column_they_need(policies, column):
    t = synth_from_preset("olmoe-1b-7b", layers=2, tokens=3, seed=0)
    with pytest.raises(MoesimError, match=f"needs the trace's '{column}' column"):
        Simulation(scenario(policies=policies), trace=t)


def test_unknown_precision_in_a_cascade_is_named():
    t = synth_from_preset("olmoe-1b-7b", layers=2, tokens=3, seed=0)
    with pytest.raises(MoesimError, match="precision 'fp4' is not among the trace's expert sizes"):
        Simulation(scenario(policies={"miss": {"name": "fetch-priority", "precisions": ["int8", "fp4"]}}), trace=t)


@pytest.mark.parametrize("name", MISS.names())
def test_every_miss_policy_keeps_the_invariants(name):
    t = synth_from_preset("olmoe-1b-7b", layers=4, requests=2, prompt_tokens=3, tokens=20, seed=3,
                          probs=True, pred_next=True)
    pol = {"miss": name, "eviction": "least-stale"}
    if name == "speculative":
        pol["prefetch"] = "next-gate-topk"
    for timing in (True, False):
        s = simulate(scenario(timing=timing, cache={"capacity": "30 experts"}, policies=pol,
                              workload={"batch_size": 2}), trace=t).summary
        assert 0 < s["gate_mass_retained"] <= 1.0 + 1e-9
        assert 0 <= s["tokens_altered"] <= 1
        assert s["cache_peak_bytes"] <= 30 * t.model.expert_bytes["bf16"]
        assert s["hits"] + s["misses"] + s["late_prefetches"] == s["expert_accesses"]


def pins(pairs: list[tuple[int, int]]) -> type:
    """A prefetcher (a user's own: the SimPy path) that proposes nothing and loads the
    (layer, expert) pairs before the replay (static pinning)."""
    from moesim.policies.prefetch import PrefetchPolicy

    class Pins(PrefetchPolicy):
        def propose(self, pass_index: int, layer: int) -> list[int]:
            return []

        def pinned(self) -> list[int]:
            return [self.ctx.key(layer, e) for layer, e in pairs]

    return Pins


SPEC_PROBS = [[0.1, 0.6, 0.1, 0.05, 0.05, 0.05, 0.05, 0.0], [0.0, 0.0, 0.0, 0.0, 0.1, 0.2, 0.3, 0.4]]
SPEC_PRED = [[0.0, 0.1, 0.1, 0.2, 0.2, 0.2, 0.2, 0.2], [0.125] * 8]


def test_speculation_takes_the_first_cached_expert_in_stable_prediction_order(monkeypatch):
    """One token: layer 0 routes to e1, layer 1 to e7. Experts 4, 5 and 6 of layer 1 are
    resident (statically pinned). Layer 0: e1 misses and is fetched (speculation starts at
    layer 1). Layer 1: e7 misses; layer 0's prediction ties e3..e7 at 0.2, so in stable
    order (ascending id among ties) the candidates are 3, 4, 5, 6, 7, ...: e3 is not cached,
    e4 is: the token computes e4 in place of e7 (numpy's default, unstable sort put e6 before e4
    on the machine this was written on). Gate mass kept (0.6 + 0.1) of (0.6 + 0.4); one substitution, one token altered;
    the decision log records e4 used as a hit."""
    from moesim.policies.prefetch import REGISTRY as PREFETCH

    monkeypatch.setitem(PREFETCH._classes, "pins", pins([(1, 4), (1, 5), (1, 6)]))
    t = tiny([[[1], [7]]], num_experts=8, probs=SPEC_PROBS, pred_next=SPEC_PRED)
    sim = Simulation(scenario(cache={"capacity": "inf"}, policies={"miss": "speculative", "prefetch": "pins"}),
                     trace=t, record_decisions=True)
    s = sim.run().summary
    k = sim.eviction.ctx.key
    assert sim.decisions == [(0, 0, "fetch", k(0, 1)), (0, 0, "run", -1), (0, 1, "hit", k(1, 4)), (0, 1, "run", -1)]
    assert s["gate_mass_retained"] == pytest.approx((0.6 + 0.1) / (0.6 + 0.4))
    assert (s["substituted_experts"], s["tokens_altered"], s["misses"]) == (1, 1.0, 2)


def test_speculation_without_a_previous_layer_row_computes_nothing(monkeypatch):
    """Two requests of the token above in one pass (batch 2), the first with its layer-0 row
    removed. Layer 0: the second token's e1 is fetched. Layer 1: e7 misses for both; the
    first token has no prediction (no row at layer 0), so its e7 is replaced by nothing; the
    second takes e4 as above. Gate mass kept 0 + (0.6 + 0.1) of 0.4 + (0.6 + 0.4); one
    substitution (the one missed expert), both tokens altered, two misses."""
    from moesim.policies.prefetch import REGISTRY as PREFETCH

    monkeypatch.setitem(PREFETCH._classes, "pins", pins([(1, 4), (1, 5), (1, 6)]))
    ex = np.array([[[[1], [7]]], [[[1], [7]]]])  # [requests, tokens, layers, k]
    t = trace_from_array(small_model(layers=2, experts=8, top_k=1), ex)
    t.probs = np.asarray(SPEC_PROBS * 2, dtype=np.float32)  # rows by request, then layer
    t.pred_next = np.asarray(SPEC_PRED * 2, dtype=np.float32)
    t = t.take(~((t.request == 0) & (t.layer == 0)))
    sc = scenario(cache={"capacity": "inf"}, policies={"miss": "speculative", "prefetch": "pins"},
                  workload={"batch_size": 2})
    sim = Simulation(sc, trace=t, record_decisions=True)
    s = sim.run().summary
    k = sim.eviction.ctx.key
    assert sim.decisions == [(0, 0, "fetch", k(0, 1)), (0, 0, "run", -1), (0, 1, "hit", k(1, 4)), (0, 1, "run", -1)]
    assert s["gate_mass_retained"] == pytest.approx((0.6 + 0.1) / (0.4 + 0.6 + 0.4))
    assert (s["substituted_experts"], s["tokens_altered"], s["misses"]) == (1, 1.0, 2)


def test_fetch_priority_falls_back_to_resident_lower_copies_twice_in_a_pass():
    """fetch-priority over bf16 and int4, degrade_fraction 0.5, top-4: ranks 0-1 important,
    2-3 degraded; capacity 2 bf16 + 2 int4 experts. Pass 0 routes 4, 5, 0, 2: 4 and 5 at
    bf16, 0 and 2 at int4 (two low-precision experts): full. Pass 1 routes 0, 2, 4, 5 (the
    layer pins the bf16 keys of all four): 0 is important, its bf16 copy absent (a miss);
    room for bf16 would need both int4 copies evicted, which frees only half an expert, so
    the cascade falls to int4, resident: used. The same for 2. Then 4 and 5 hit. Pass 1:
    2 misses, 2 hits, 2 low-precision experts, nothing copied. The kernel agrees."""
    t = tiny([[[4, 5, 0, 2]], [[0, 2, 4, 5]]], num_experts=6)
    eb = t.model.expert_bytes
    pol = {"miss": {"name": "fetch-priority", "precisions": ["bf16", "int4"], "degrade_fraction": 0.5}}
    sc = scenario(cache={"capacity": f"{2 * eb['bf16'] + 2 * eb['int4']}b"}, policies=pol)
    sim = Simulation(sc, trace=t, record_decisions=True)
    res = sim.run()
    steps = res.steps
    assert steps["low_precision_experts"].tolist() == [2, 2]
    assert (steps["misses"].tolist(), steps["hits"].tolist()) == ([4, 2], [0, 2])
    assert steps["bytes_h2d"].tolist() == [2 * eb["bf16"] + 2 * eb["int4"], 0]
    ctx = sim.eviction.ctx
    k, int4 = ctx.key, ctx.precisions.index("int4")
    assert [d for d in sim.decisions if d[0] == 1] == [
        (1, 0, "hit", k(0, 0, int4)), (1, 0, "hit", k(0, 2, int4)), (1, 0, "hit", k(0, 4)), (1, 0, "hit", k(0, 5)),
        (1, 0, "run", -1)]
    kernel = simulate(sc, trace=t)
    assert kernel.summary["replay_path"] == "kernel"
    pd.testing.assert_frame_equal(kernel.steps, steps, check_exact=True)


def test_substitute_is_logged_as_a_hit_on_the_expert_that_runs():
    """The substitute example above, its decision log: token 0 fetches e0; token 1's e2 is
    replaced by the resident e0, logged as a hit on e0 (what the calibration executor runs)."""
    probs = [[0.5, 0.3, 0.15, 0.05], [0.2, 0.25, 0.5, 0.05]]
    t = tiny([[[0]], [[2]]], probs=probs)
    sim = Simulation(scenario(cache={"capacity": "1 expert"}, policies={"miss": "substitute"}), trace=t,
                     record_decisions=True)
    sim.run()
    k = sim.eviction.ctx.key
    assert sim.decisions == [(0, 0, "fetch", k(0, 0)), (0, 0, "run", -1), (1, 0, "hit", k(0, 0)), (1, 0, "run", -1)]


def test_routing_policies_do_not_apply_under_expert_parallelism():
    """Under expert parallelism experts stay resident on their GPU and no routing policy
    applies: cache-aware routing with a strong pull changes no token (the example above
    alters one on a single GPU)."""
    probs = [[0.6, 0.3, 0.05, 0.05], [0.3, 0.4, 0.2, 0.1]]
    t = tiny([[[0]], [[1]]], probs=probs)
    s = simulate(scenario(cache={"capacity": "inf"}, hardware={"preset": "h100-sxm-nvlink-x2"},
                          policies={"routing": {"name": "cache-aware", "lam": 0.3}}), trace=t).summary
    assert s["tokens_altered"] == 0.0
    assert s["gate_mass_retained"] == 1.0


def test_an_uncached_fetch_copies_the_missed_expert():
    """No room at all (capacity 0): every missed expert is copied to a staging buffer and not
    kept (an uncached fetch), one demand copy of that expert per access, in lookup order."""
    t = tiny([[[0, 1]], [[2, 1]]])
    sim = Simulation(scenario(cache={"capacity": "0 experts"}), trace=t, record_transfers=True)
    res = sim.run()
    k = sim.eviction.ctx.key
    assert [(key, kind) for key, kind, *_ in res.transfers] == [
        (k(0, 0), "demand"), (k(0, 1), "demand"), (k(0, 2), "demand"), (k(0, 1), "demand")]
    assert res.steps["uncached_fetches"].tolist() == [2, 2]
    assert not sim.cache.resident

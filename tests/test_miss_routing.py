"""Miss-handling, precision and routing policies on hand-checked examples: what they do to
gate_mass_retained, tokens_altered, bytes and precision."""

from __future__ import annotations

import numpy as np
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

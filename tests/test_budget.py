"""Expert-budget policies (MoE-Spec, XShare, Lynx, dynamic skip, threshold skip)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moesim.errors import MoesimError
from moesim.policies.budget import REGISTRY as BUDGET
from moesim.policies.budget.xshare import greedy_select
from moesim.simulator.engine import Simulation, simulate
from moesim.traces.synth import synth_from_preset
from tests.helpers import scenario


def trace(batch=8, tokens=12, probs=True, seed=0, **kw):
    return synth_from_preset("olmoe-1b-7b", layers=3, requests=batch, tokens=tokens, seed=seed, probs=probs, **kw)


def run(t, budget, batch=8, **sc):
    return simulate(scenario(cache={"capacity": "inf"}, policies={"budget": budget},
                             workload={"batch_size": batch}, **sc), trace=t)


@settings(max_examples=80, deadline=None)
@given(st.integers(2, 8), st.integers(1, 6), st.integers(0, 10**6))
def test_greedy_is_optimal_for_the_modular_proxy(n, tokens, seed):
    """XShare Corollary 3.3: greedy by batch score solves max sum of scores s.t. |S| = m."""
    rng = np.random.default_rng(seed)
    g = rng.random((tokens, n)) * (rng.random((tokens, n)) < 0.6)
    for m in range(1, n + 1):
        chosen = greedy_select(g, set(), budget=m)
        best = max(g[:, list(c)].sum() for c in itertools.combinations(range(n), m))
        assert len(chosen) == m
        assert g[:, chosen].sum() == pytest.approx(best)


def test_moe_spec_never_loads_more_than_b_experts_per_layer():
    t = trace(batch=16)
    for coverage in ("truncation", "substitution"):
        sim = Simulation(scenario(cache={"capacity": "inf"}, workload={"batch_size": 16},
                                  policies={"budget": {"name": "moe-spec", "budget": 10, "coverage": coverage}}), trace=t)
        res = sim.run()
        for p in range(sim.wl.num_passes):
            for layer in range(3):
                rows = sim.wl.rows(p, layer)
                sets = sim.budget.select(p, layer, rows, t.experts[rows].astype(np.int64))
                assert len({e for s in sets for e in s}) <= 10
        assert (res.steps["unique_experts"] <= 10 * 3).all()
        assert res.summary["unique_experts_per_layer"] <= 10
        plain = run(t, "none", batch=16).summary["unique_experts_per_layer"]
        assert plain > 10  # the budget binds: ~38 of 64 experts per layer unbudgeted


def test_truncation_keeps_original_weights_and_substitution_gives_every_token_k():
    t = trace(batch=16)
    sim = Simulation(scenario(cache={"capacity": "inf"}, workload={"batch_size": 16},
                              policies={"budget": {"name": "moe-spec", "budget": 12, "coverage": "truncation"}}), trace=t)
    rows = sim.wl.rows(3, 1)
    ex = t.experts[rows].astype(np.int64)
    trunc = sim.budget.select(3, 1, rows, ex)
    for orig, kept in zip(ex.tolist(), trunc, strict=True):
        assert kept == [e for e in orig if e in kept]  # a subset, in the original rank order
    res = sim.run()
    # gate mass retained = kept original probabilities / original top-k probabilities
    p = t.probs[rows]
    kept_mass = sum(p[i, k].sum() for i, k in enumerate(trunc))
    assert kept_mass / p[np.arange(len(rows))[:, None], ex].sum() < 1
    # every pass: the engine's gate mass and altered tokens equal the selections' own
    check = Simulation(scenario(cache={"capacity": "inf"}, workload={"batch_size": 16},
                                policies={"budget": {"name": "moe-spec", "budget": 12, "coverage": "truncation"}}),
                       trace=t)
    for q in range(sim.wl.num_passes):
        total = kept = 0.0
        altered = set()
        for layer in range(3):
            rows_q = check.wl.rows(q, layer)
            ex_q = t.experts[rows_q].astype(np.int64)
            probs_q = t.probs[rows_q].astype(np.float64)
            for i, sel in enumerate(check.budget.select(q, layer, rows_q, ex_q)):
                total += probs_q[i, ex_q[i]].sum()
                kept += probs_q[i, sel].sum()
                if len(sel) < len(ex_q[i]):
                    altered.add((t.request[rows_q[i]], t.position[rows_q[i]]))
        step = res.steps.iloc[q]
        assert step["gate_weight_total"] == pytest.approx(total, rel=1e-12)
        assert step["gate_weight_computed"] == pytest.approx(kept, rel=1e-12)
        assert step["tokens_altered"] == len(altered)
    assert res.summary["gate_mass_retained"] < 1
    assert res.summary["tokens_altered"] > 0
    sub = Simulation(scenario(cache={"capacity": "inf"}, workload={"batch_size": 16},
                              policies={"budget": {"name": "moe-spec", "budget": 12}}), trace=t)
    for s in sub.budget.select(3, 1, rows, ex):
        assert len(s) == 8  # every token gets k experts, all inside the shortlist


def test_substitution_needs_probs_and_static_ranking_uses_calibration():
    with pytest.raises(MoesimError, match="coverage: substitution needs the trace's 'probs' column"):
        Simulation(scenario(policies={"budget": {"name": "moe-spec", "budget": 8}}), trace=trace(probs=False))
    t = trace(batch=4, tokens=30)
    sim = Simulation(scenario(workload={"batch_size": 4},
                              policies={"budget": {"name": "moe-spec", "budget": 6, "ranking": "static",
                                                   "coverage": "truncation"}}), trace=t)
    shortlist = set(np.argsort(-sim.budget._static[0], kind="stable")[:6].tolist())
    rows = sim.wl.rows(20, 0)
    for s in sim.budget.select(20, 0, rows, t.experts[rows].astype(np.int64)):
        assert set(s) <= shortlist  # the same fixed experts whatever the tokens


def test_xshare_warmup_keeps_every_tokens_top1_and_respects_the_budget():
    t = trace(batch=16)
    sim = Simulation(scenario(cache={"capacity": "inf"}, workload={"batch_size": 16},
                              policies={"budget": {"name": "xshare", "budget": 20, "k0": 1}}), trace=t)
    rows = sim.wl.rows(2, 0)
    ex = t.experts[rows].astype(np.int64)
    sets = sim.budget.select(2, 0, rows, ex)
    union = {e for s in sets for e in s}
    assert len(union) <= max(20, len(set(ex[:, 0].tolist())))
    for orig, s in zip(ex, sets, strict=True):
        assert int(orig[0]) in s
        assert len(s) == 8
    # Algorithm 1: the greedy set is the smallest prefix of experts by batch score that holds
    # tau of the batch's gating mass
    g = t.probs[rows].astype(np.float64)
    batch = g.sum(axis=0)
    for tau in (0.3, 0.5, 0.9):
        chosen = greedy_select(g, set(), threshold=tau)
        assert batch[chosen].sum() >= tau * batch.sum()
        assert batch[chosen[:-1]].sum() < tau * batch.sum()
        assert sorted(batch[chosen], reverse=True) == list(batch[chosen])


def test_lynx_and_dynamic_skip_on_hand_checked_weights():
    t = trace(batch=4, probs=False)
    sim = Simulation(scenario(workload={"batch_size": 4}, policies={"budget": {"name": "lynx", "drop": 2}}), trace=t)
    rows = sim.wl.rows(1, 0)
    ex = t.experts[rows].astype(np.int64)
    used, counts = np.unique(ex, return_counts=True)
    kept = {e for s in sim.budget.select(1, 0, rows, ex) for e in s}
    assert len(kept) == len(used) - 2
    assert all(counts[list(used).index(e)] <= min(counts[list(used).index(k)] for k in kept)
               for e in set(used.tolist()) - kept)
    mx = synth_from_preset("mixtral-8x7b", layers=2, tokens=10, seed=1)
    ds = Simulation(scenario(policies={"budget": {"name": "dynamic-skip", "beta": 0.5}}), trace=mx)
    rows = ds.wl.rows(4, 0)
    w = mx.weights[rows][0]
    out = ds.budget.select(4, 0, rows, mx.experts[rows].astype(np.int64))[0]
    assert len(out) == (1 if w[1] < 0.5 * w[0] else 2)


def test_skip_threshold_skips_for_about_half_of_the_calibration_tokens():
    t = trace(batch=1, tokens=200, probs=False)
    sim = Simulation(scenario(policies={"budget": {"name": "skip-threshold", "max_skip": 2, "calibration": 1.0}}),
                     trace=t)
    res = sim.run()
    skipped = 1 - res.summary["unique_experts_per_layer"] / 8
    assert 0.09 < skipped < 0.16  # 2 of 8 skipped for ~half the tokens (beta_m is a median): ~12.5%
    with pytest.raises(MoesimError, match="max_skip must be below top-k"):
        Simulation(scenario(policies={"budget": {"name": "skip-threshold", "max_skip": 8}}), trace=t)


@pytest.mark.parametrize("name", [n for n in BUDGET.names() if n != "none"])
def test_every_budget_composes_with_caching(name):
    t = trace(batch=4, tokens=15)
    params = {"xshare": {"budget": 16}, "moe-spec": {"budget": 16}}.get(name, {})
    capped = simulate(scenario(cache={"capacity": "20 experts"}, workload={"batch_size": 4},
                               policies={"budget": {"name": name, **params}, "eviction": "least-stale"}), trace=t).summary
    plain = simulate(scenario(cache={"capacity": "20 experts"}, workload={"batch_size": 4},
                              policies={"eviction": "least-stale"}), trace=t).summary
    assert capped["expert_accesses"] <= plain["expert_accesses"]  # a budgeted pass loads fewer experts
    assert capped["gate_mass_retained"] <= 1.0 + 1e-9
    assert capped["cache_peak_bytes"] <= 20 * t.model.expert_bytes["bf16"]


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 8), st.integers(1, 4), st.integers(1, 5), st.integers(0, 10**6),
       st.sampled_from(["contiguous", "round-robin"]))
def test_gpu_aware_greedy_keeps_the_load_balanced(gpus, per_gpu, tokens, seed, placement):
    """XShare Algorithm 5: MaxLoad(S) <= ceil(|S| / G) (from an empty warm-up)."""
    from moesim.policies.budget.xshare import gpu_aware_greedy, placement_of

    n = 32
    owner = placement_of(placement, 1, n, gpus)[0]
    g = np.random.default_rng(seed).random((tokens, n))
    chosen = gpu_aware_greedy(g, set(), owner, gpus, per_gpu)
    loads = np.bincount(owner[chosen], minlength=gpus)
    assert loads.max() <= -(-len(chosen) // gpus)
    assert len(chosen) == min(n, per_gpu * gpus) or len(chosen) >= per_gpu * gpus


def test_xshare_per_request_selection():
    t = trace(batch=4, tokens=12)
    sim = Simulation(scenario(cache={"capacity": "inf"}, workload={"batch_size": 4, "speculative": {"tree_size": 4}},
                              policies={"budget": {"name": "xshare", "per_request": 2, "k0": 1}}), trace=t)
    res = sim.run()
    # each request contributes its tokens' top-1 plus 2 more experts: at most 4 * (4 + 2)
    assert res.summary["unique_experts_per_layer"] <= 4 * (4 + 2)
    plain = Simulation(scenario(cache={"capacity": "inf"}, workload={"batch_size": 4, "speculative": {"tree_size": 4}}),
                       trace=t).run()
    assert res.summary["unique_experts_per_layer"] < plain.summary["unique_experts_per_layer"]

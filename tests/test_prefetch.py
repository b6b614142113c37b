"""Prefetch: the perfect-prefetch closed form, prediction accounting, Least-Stale's mechanism."""

from __future__ import annotations

import numpy as np
import pytest

from moesim.errors import MoesimError
from moesim.simulator.engine import Simulation, simulate
from moesim.simulator.workload import build_workload
from moesim.traces.synth import generate, synth_from_preset
from tests.helpers import datasheet_times, scenario, small_model, trace_from_array


def per_layer_costs(sc, trace):
    """Per pass: non-expert time a, and per layer expert time x_l and the copy time c_l of the
    experts that layer has never needed before (what ample capacity leaves to copy)."""
    wl = build_workload(trace, 1)
    model = trace.model
    ffn, nonexp, copy = datasheet_times(model, wl)
    keys = wl.keys()
    seen: set[int] = set()
    out = []
    num_l = model.num_layers
    for p in range(wl.num_passes):
        x, c = [], []
        for layer in range(num_l):
            lo, hi = wl.off[p * num_l + layer], wl.off[p * num_l + layer + 1]
            new = [k for k in keys[lo:hi].tolist() if k not in seen]
            seen.update(new)
            c.append(len(new) * copy)
            x.append(ffn[lo:hi].sum())
        out.append((nonexp[p], x, c))
    return wl, out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_oracle_prefetch_with_ample_capacity_is_the_closed_form(seed):
    """speculating-experts-prefetch.txt §5.1: with perfect one-layer-ahead prefetch a step
    takes the first layer's copy plus, per layer, max(compute, copy of the next layer's
    experts). Written per pass with non-expert time a, expert time x_l and copy c_l of the
    experts layer l has never needed before (ample capacity):
        T = a + c_0 + sum_{l=0}^{L-2} max(x_l + a, c_{l+1}) + x_{L-1}
    which equals the paper's sum of max(t_attn + t_expert, t_copy(next)) when a is the same
    for every layer (it is, within a pass)."""
    model = small_model(layers=4, experts=6, top_k=2)
    trace = generate(model, requests=1, tokens=25, seed=seed)
    sc = scenario(cache={"capacity": "inf"}, policies={"prefetch": "oracle"})
    res = simulate(sc, trace=trace)
    wl, costs = per_layer_costs(sc, trace)
    num_l = model.num_layers
    keys = wl.keys()
    expected = [a + c[0] + sum(max(x[i] + a, c[i + 1]) for i in range(num_l - 1)) + x[-1]
                for a, x, c in costs]
    np.testing.assert_allclose(res.steps["duration_s"].to_numpy(), expected, rtol=1e-9)
    s = res.summary
    assert s["prefetch_precision"] == 1.0
    assert s["prefetch_recall"] == 1.0
    # only layer 0 is ever demand-fetched: its experts not needed before
    demand = 0
    before: set[int] = set()
    for p in range(wl.num_passes):
        layer0 = set(keys[wl.off[p * num_l]:wl.off[p * num_l + 1]].tolist())
        demand += len(layer0 - before)
        before |= set(keys[wl.off[p * num_l]:wl.off[(p + 1) * num_l]].tolist())
    assert s["misses"] == demand


def test_prefetch_gain_is_eq1_of_the_paper():
    """§5.1 eq. (1): the step-time gain of perfect prefetch over on-demand loading is
    sum over layers of min(t_compute, t_copy(next layer)) - exactly, per pass."""
    trace = synth_from_preset("olmoe-1b-7b", layers=6, tokens=40, seed=3)
    sc = scenario(cache={"capacity": "inf"})
    on_demand = simulate(sc, trace=trace)
    pref = simulate(scenario(cache={"capacity": "inf"}, policies={"prefetch": "oracle"}), trace=trace)
    _, costs = per_layer_costs(sc, trace)
    gains = [sum(min(a + x[i], c[i + 1]) for i in range(len(x) - 1)) for a, x, c in costs]
    diff = on_demand.steps["duration_s"].to_numpy() - pref.steps["duration_s"].to_numpy()
    np.testing.assert_allclose(diff, gains, rtol=1e-9, atol=1e-15)
    assert diff[0] > 0


def test_predictors_need_pred_next():
    trace = synth_from_preset("olmoe-1b-7b", layers=2, tokens=5, seed=0)
    for name in ("next-gate-topk", "score-percentile"):
        with pytest.raises(MoesimError, match=rf"prefetch policy '{name}' needs the trace's 'pred_next' column"):
            Simulation(scenario(policies={"prefetch": name}), trace=trace)


def test_perfect_predictor_gives_perfect_topk_prefetch():
    trace = synth_from_preset("olmoe-1b-7b", layers=4, tokens=30, seed=1, pred_next=True, pred_noise=0.0)
    s = simulate(scenario(cache={"capacity": "inf"}, policies={"prefetch": "next-gate-topk"}), trace=trace).summary
    assert s["prefetch_precision"] == 1.0
    assert s["prefetch_recall"] == 1.0
    noisy = synth_from_preset("olmoe-1b-7b", layers=4, tokens=30, seed=1, pred_next=True, pred_noise=1.0)
    s2 = simulate(scenario(cache={"capacity": "inf"}, policies={"prefetch": "next-gate-topk"}), trace=noisy).summary
    assert 0.3 < s2["prefetch_precision"] < 1.0


def test_overfetch_and_percentile_counts():
    trace = synth_from_preset("olmoe-1b-7b", layers=3, tokens=10, seed=2, pred_next=True)
    sim = Simulation(scenario(policies={"prefetch": {"name": "next-gate-topk", "overfetch": 1.5}}), trace=trace)
    assert len(sim.prefetch.propose(0, 0)) == 12  # 8 x 1.5 for one token (SpecMD's OLMoE example)
    sim = Simulation(scenario(policies={"prefetch": "score-percentile"}), trace=trace)
    props = [sim.prefetch.ctx.base_of(k) for k in sim.prefetch.propose(0, 0)]
    scores = trace.pred_next[sim.wl.rows(0, 0)].mean(axis=0)
    assert sorted(props) == sorted(int(e) + 64 for e in np.flatnonzero(scores > np.percentile(scores, 80)))
    assert len(props) == 13  # above the 80th percentile of 64 distinct scores
    assert len(sim.prefetch.propose(0, 2)) == 0  # last layer: nothing after it


@pytest.mark.parametrize("policy", ["oracle", "previous-token", {"name": "lookahead", "depth": 3},
                                    "next-gate-topk", "score-percentile"])
@pytest.mark.parametrize("timing", [True, False])
def test_prefetch_accounting(policy, timing):
    trace = synth_from_preset("olmoe-1b-7b", layers=4, requests=2, prompt_tokens=3, tokens=30, seed=4,
                              pred_next=True)
    sc = scenario(timing=timing, cache={"capacity": "30 experts"},
                  policies={"prefetch": policy, "eviction": "least-stale"}, workload={"batch_size": 2})
    s = simulate(sc, trace=trace).summary
    eb = trace.model.expert_bytes["bf16"]
    moved = s["misses"] + s["prefetches_issued"] - s["prefetches_cancelled"]
    assert s["bytes_by_link"]["pcie.h2d"] == moved * eb
    assert s["prefetches_used"] <= s["prefetches_issued"] - s["prefetches_cancelled"]
    assert s["hits"] + s["misses"] + s["late_prefetches"] == s["expert_accesses"]
    assert s["cache_peak_bytes"] <= 30 * eb
    if not timing:
        assert s["late_prefetches"] == 0  # instant transfers are never late


def test_late_prefetches_on_a_slow_link():
    trace = synth_from_preset("olmoe-1b-7b", layers=4, tokens=20, seed=5)
    s = simulate(scenario(cache={"capacity": "inf"}, policies={"prefetch": "oracle"},
                          hardware={"preset": "a100-80g-pcie4", "links": {"pcie": {"bandwidth_gbps": 1}}}),
                 trace=trace).summary
    assert s["late_prefetches"] > 0
    assert s["prefetches_used"] == s["prefetches_issued"]


def test_static_pin_keeps_the_calibration_favourites():
    trace = synth_from_preset("olmoe-1b-7b", layers=4, tokens=200, seed=6)
    sim = Simulation(scenario(cache={"capacity": "40 experts"},
                              policies={"prefetch": {"name": "static-pin", "fraction": 0.5, "calibration": 0.2}}),
                     trace=trace)
    cache_pins = set(sim.prefetch.static_pins)
    pins = {sim.prefetch.ctx.base_of(k) for k in cache_pins}
    assert len(pins) == 20
    assert sim.preloaded == 20
    wl = sim.wl
    n_cal = int(np.ceil(wl.num_passes * 0.2))
    counts = np.bincount(wl.keys()[: wl.off[n_cal * 4]], minlength=256)
    assert min(counts[list(pins)]) >= max(np.delete(counts, list(pins)))
    res = sim.run()
    assert cache_pins <= set(sim.cache.resident)  # never evicted
    plain = simulate(scenario(cache={"capacity": "40 experts"}), trace=trace)
    assert res.summary["hits"] != plain.summary["hits"]


def test_least_stale_avoids_the_collision_lru_takes():
    """SpecMD Fig. 3 on a hand-checked trace (3 layers, 3 experts, top-1, room for 4).
    Tokens route (layer 0, 1, 2) to experts (0, 1, 2), (1, 1, 0), (2, 2, 2). In pass 2 at
    layer 0, LRU's oldest entry is layer 2's expert 2 (last used in pass 0): LRU evicts it and
    misses on it again at layer 2 of the same pass - a collision miss. Least-Stale evicts
    the stale layer-0 expert 1 first (FIFO by layer position) and keeps layer 2's expert."""
    model = small_model(layers=3, experts=3, top_k=1)
    ex = np.array([[[0, 1, 2], [1, 1, 0], [2, 2, 2]]])[..., None]
    t = trace_from_array(model, ex)
    runs = {pol: simulate(scenario(cache={"capacity": "4 experts"}, policies={"eviction": pol}), trace=t)
            for pol in ("lru", "least-stale")}
    assert runs["lru"].steps["collision_misses"].tolist() == [0, 0, 1]
    assert runs["least-stale"].steps["collision_misses"].tolist() == [0, 0, 0]
    assert runs["lru"].summary["misses"] == 8
    assert runs["least-stale"].summary["misses"] == 7
    assert runs["least-stale"].summary["total_time_s"] < runs["lru"].summary["total_time_s"]

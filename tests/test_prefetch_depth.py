"""Issued prefetches on the compiled kernel (``kernel_prefetch._handed``) against the SimPy
path on small scenarios, quick enough to run uncompiled: every depth of issued copies, a link
slow enough that copies queue, prefetchers that mispredict."""

from __future__ import annotations

import pytest

from moesim.simulator.engine import Simulation
from moesim.traces.synth import generate
from tests.helpers import scenario, small_model


@pytest.mark.parametrize("mode", ["layer", "per-expert"])
def test_both_paths_withdraw_the_same_unissued_prefetches(monkeypatch, mode):
    """Next-gate top-k prefetch, 6 experts cached, PCIe at 2 GB/s: per-pass rows identical on
    both paths at depths 1, 2, 3 and all; withdrawals fall as more copies are issued, none when
    every admitted copy is."""
    prefetch = "next-gate-topk"
    trace = generate(small_model(layers=3, experts=8, top_k=2), requests=2, prompt_tokens=2, tokens=10, seed=7,
                     pred_next=True)
    seen = []
    for depth in (1, 2, 3, "all"):
        sc = scenario(policies={"prefetch": prefetch, "eviction": "lru"}, expert_compute=mode,
                      cache={"capacity": "6 experts"}, execution={"prefetch_depth": depth},
                      hardware={"preset": "a100-80g-pcie4", "links": {"pcie": {"bandwidth_gbps": 2.0}}})
        monkeypatch.delenv("MOESIM_NO_KERNEL", raising=False)
        fast = Simulation(sc, trace=trace).run()
        monkeypatch.setenv("MOESIM_NO_KERNEL", "1")
        ref = Simulation(sc, trace=trace).run()
        assert fast.summary["replay_path"] == "kernel"
        assert ref.summary["replay_path"] == "simpy"
        assert fast.steps.equals(ref.steps)
        seen.append(ref.summary["prefetches_cancelled"])
    assert seen[0] > seen[1] > 0
    assert seen[1] >= seen[2] >= seen[3] == 0


@pytest.mark.parametrize("prefetch", ["next-gate-topk", "lookahead", "score-percentile"])
def test_both_paths_agree_at_small_depths_over_seeds_and_capacities(monkeypatch, prefetch):
    """The same, over seeds, cache sizes, top-k and both bandwidths at which copies queue or
    land late (late prefetches are promoted, leaving tombstones in the prefetch queue), in
    layer and per-expert execution."""
    withdrawn = 0
    for seed in range(4):
        for k, cap, bw in ((1, "3 experts", 1.0), (2, "5 experts", 4.0), (2, "9 experts", 1.0)):
            trace = generate(small_model(layers=3, experts=8, top_k=k), requests=2, prompt_tokens=1, tokens=8,
                             seed=seed, pred_next=True)
            for depth in (1, 2):
                sc = scenario(policies={"prefetch": prefetch, "eviction": "lru"},
                              expert_compute=("layer", "per-expert")[seed % 2], cache={"capacity": cap},
                              execution={"prefetch_depth": depth},
                              hardware={"preset": "a100-80g-pcie4", "links": {"pcie": {"bandwidth_gbps": bw}}})
                monkeypatch.delenv("MOESIM_NO_KERNEL", raising=False)
                fast = Simulation(sc, trace=trace).run()
                monkeypatch.setenv("MOESIM_NO_KERNEL", "1")
                ref = Simulation(sc, trace=trace).run()
                assert fast.summary["replay_path"] == "kernel"
                assert fast.steps.equals(ref.steps), (seed, k, cap, depth)
                withdrawn += ref.summary["prefetches_cancelled"]
    assert withdrawn > 0

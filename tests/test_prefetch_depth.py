"""Issued prefetches on the compiled kernel (``kernel_prefetch._handed``) against the SimPy
path on small scenarios, quick enough to run uncompiled: every depth of issued copies, a link
slow enough that copies queue, prefetchers that mispredict."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from moesim.simulator.engine import Simulation
from moesim.traces.synth import generate
from tests.helpers import scenario, small_model, trace_from_array


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


def test_the_replay_s_first_copies_prefetched_and_withdrawn_by_hand(monkeypatch):
    """One token, 3 layers, top-2, layer l routing experts 2l and 2l + 1; the router's prediction
    of layer 1 from layer 0 names experts 6 and 7 (wrong: layer 1 routes 2 and 3), of layer 2 from
    layer 1 experts 4 and 5 (right). Per-expert
    execution proposes before the layer's first lookup, so the replay's first two transfers are
    the prefetches of 1:6 and 1:7 (sequence numbers 0 and 1); 0:0 and 0:1's demand copies (2, 3)
    go first, then 1:6 copies while layer 1's routing point comes (PCIe at 1 GB/s: a copy
    outlasts the layer). With the host issuing one copy at a time, 1:7, still on the host, is
    withdrawn; with two, it is issued and copies. On both replay paths."""
    model = small_model(layers=3, experts=8, top_k=2)
    trace = trace_from_array(model, np.array([[[[0, 1], [2, 3], [4, 5]]]]))
    pred = np.full((3, 8), 0.01, dtype=np.float32)
    pred[0, 6], pred[0, 7] = 0.6, 0.3  # layer 0's row predicts layer 1
    pred[1, 4], pred[1, 5] = 0.6, 0.3  # layer 1's predicts layer 2 right
    trace = dataclasses.replace(trace, pred_next=pred)
    got = {}
    for depth in (1, 2):
        sc = scenario(policies={"prefetch": "next-gate-topk", "eviction": "lru"}, expert_compute="per-expert",
                      cache={"capacity": "inf"}, execution={"prefetch_depth": depth},
                      hardware={"preset": "a100-80g-pcie4", "links": {"pcie": {"bandwidth_gbps": 1.0}}})
        monkeypatch.delenv("MOESIM_NO_KERNEL", raising=False)
        fast = Simulation(sc, trace=trace).run()
        monkeypatch.setenv("MOESIM_NO_KERNEL", "1")
        ref = Simulation(sc, trace=trace, record_decisions=True)
        res = ref.run()
        assert fast.summary["replay_path"] == "kernel"
        assert fast.steps.equals(res.steps)
        k = ref.eviction.ctx.key
        got[depth] = ([key for _, _, op, key in ref.decisions if op == "prefetch"],
                      [key for _, _, op, key in ref.decisions if op == "withdraw"], int(res.steps["bytes_h2d"].sum()))
    k = ref.eviction.ctx.key
    assert got[1][:2] == ([k(1, 6), k(1, 7), k(2, 4), k(2, 5)], [k(1, 7)])
    assert got[2][:2] == ([k(1, 6), k(1, 7), k(2, 4), k(2, 5)], [])
    assert got[2][2] - got[1][2] == ref.expert_bytes

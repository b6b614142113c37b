"""The calibration executor in SpecMD's style (``moesim.calibration.hf_loop``, issue 37) on
the CPU: it makes the simulator's decisions, copies what they copy, and every pass lasts at
least its copies' time on the throttled link."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")


@pytest.mark.parametrize("prefetch", ["none", "next-gate-topk"])
def test_the_executor_makes_the_simulator_s_decisions_behind_a_throttled_link(prefetch):
    """Two OLMoE layers at a 0.2 GB/s link (a 4-bit expert's copy is then ~16 ms): the
    executor's hits and misses are the simulator's, it copies what the decisions copy, and
    without prefetch every pass lasts at least its copies' throttled time."""
    from moesim.calibration.validate import execute
    from moesim.config.scenario import load_scenario
    from moesim.traces.synth import synth_from_preset

    trace = synth_from_preset("olmoe-1b-7b", layers=2, requests=1, prompt_tokens=4, tokens=2, seed=0, probs=True,
                              pred_next=True, pred_noise=1.0)
    sc = load_scenario("specmd/olmoe-prefill", ["cache.capacity=0.02GB", f"policies.prefetch={prefetch}",
                                                "hardware.links.pcie.bandwidth_gbps=0.2"])
    r = execute(sc, trace, "cpu")
    s = r["predicted"].summary
    # whatever the validation asked of moesim's own executor, this one launches eagerly and prefetches
    # from its worker, as the row records
    assert (r["launch"], r["prefetch_from"]) == ("eager", "worker")
    assert r["late_withdraws"] == 0
    assert (r["hits"], r["misses"]) == (s["hits"] + s["late_prefetches"], s["misses"])
    assert r["copies"] * s["expert_bytes"] == s["bytes_by_link"]["pcie.h2d"]  # every copy the replay made
    copy_s = 3 * 2048 * 1024 / 2 / 0.2e9
    if prefetch == "none":
        assert r["copies"] == s["misses"]
        dec = r["predicted"].steps
        per_pass = dec["misses"].to_numpy()
        assert (r["pass_s"] >= per_pass * copy_s * (1 - 1e-3)).all()
        assert per_pass.sum() > 0

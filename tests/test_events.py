"""The run timeline (``moesim run --events``): copies told apart, withdrawn prefetches,
counter tracks and flow arrows on a hand-made pass; the recorded window; one track per GPU
with expert parallelism."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from moesim.cli import cli
from moesim.config.scenario import load_scenario
from moesim.output.events import chrome_trace
from moesim.simulator.engine import Simulation
from moesim.traces.synth import synth_from_preset
from tests.helpers import scenario, small_model, trace_from_array, unwrap

TINY_EXPERT = 3 * 256 * 512 * 2  # small_model's bf16 expert: 786,432 bytes


def timeline(sim: Simulation) -> tuple[dict, list[dict]]:
    res = sim.run()
    doc = chrome_trace(res, sim.link_name, sim.model.num_experts, sim.num_prec)
    return doc, doc["traceEvents"]


def test_demand_prefetch_and_promoted_copies_with_their_arrows_and_counters():
    """One pass, 2 layers, top-2, oracle prefetch, unlimited cache, a 0.01 GB/s link (a copy
    takes ~0.08 s). Layer 0 misses experts 0 and 1 (two demand fetches); at its routing point
    the oracle queues layer 1's experts 2 and 3 behind them. When layer 1 is routed, the copy
    of expert 2 is on the link (a late prefetch) and expert 3's is still queued: it is
    promoted. Four copies, in that order: demand, demand, prefetch, promoted; each made a
    layer wait: four arrows (two to layer 0, two to layer 1). The link is busy from the first
    copy's start to the last one's end without a gap; 4 experts' bytes are in flight at most,
    none at the end; the cache holds 4 experts at both routing points."""
    model = small_model(layers=2, experts=8, top_k=2)
    t = trace_from_array(model, np.array([[[[0, 1], [2, 3]]]]))
    sc = scenario(cache={"capacity": "inf"}, policies={"prefetch": "oracle"},
                  hardware={"links": {"pcie": {"bandwidth_gbps": 0.01}}})
    sim = Simulation(sc, trace=t, record_transfers=True, record_layers=True)
    _doc, ev = timeline(sim)
    copies = sorted((e for e in ev if e["ph"] == "X" and e["tid"] == 1), key=lambda e: e["ts"])
    assert [e["name"] for e in copies] == ["demand fetch", "demand fetch", "prefetch", "promoted prefetch"]
    assert [(e["args"]["layer"], e["args"]["expert"]) for e in copies] == [(0, 0), (0, 1), (1, 2), (1, 3)]
    starts = [e for e in ev if e["ph"] == "s"]
    ends = [e for e in ev if e["ph"] == "f"]
    assert len(starts) == len(ends) == 4
    experts = {e["args"]["layer"]: e["ts"] for e in ev if e["ph"] == "X" and e["name"].endswith(" experts")}
    assert sorted(e["ts"] for e in ends) == [experts[0], experts[0], experts[1], experts[1]]
    busy = [e["args"]["busy"] for e in ev if e["ph"] == "C" and e["name"] == "link busy"]
    assert max(busy) == 1
    assert busy[-1] == 0
    busy_t = sorted(e["ts"] for e in ev if e["ph"] == "C" and e["name"] == "link busy")
    assert busy_t[0] == copies[0]["ts"]
    assert busy_t[-1] == pytest.approx(copies[-1]["ts"] + copies[-1]["dur"])
    flight = [e["args"]["MB"] for e in ev if e["ph"] == "C" and e["name"] == "bytes in flight (MB)"]
    assert max(flight) == pytest.approx(4 * TINY_EXPERT / 1e6)
    assert flight[-1] == pytest.approx(0.0, abs=1e-12)
    occ = [e["args"]["GB"] for e in ev if e["ph"] == "C" and e["name"] == "cache occupancy (GB)"]
    assert occ == pytest.approx([4 * TINY_EXPERT / 1e9] * 2)
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in ev if e["ph"] == "M"}
    assert names[(0, None)] == "GPU 0"
    assert names[(0, 0)] == "compute stream"
    assert names[(0, 1)] == "copy engine pcie.h2d"


def test_withdrawn_prefetches_are_instant_events_on_the_copy_engine():
    """2 layers, top-2, room for 2 experts, previous-token prefetch, a 0.01 GB/s link. Pass 0
    routes (0, 1) then (2, 3); pass 1 routes (4, 5) then (6, 7). At pass 1 layer 0 the
    previous token's layer-1 experts 2 and 3 are proposed; they wait for room until layer 0
    has run (its experts are pinned), then go to the link: 2 starts, 3 queues, the host
    issuing one copy at a time (``execution.prefetch_depth`` 1). Layer 1 needs 6 and 7: the
    queued copy of 3, not yet issued, is withdrawn (2 is already moving). One instant event."""
    model = small_model(layers=2, experts=8, top_k=2)
    t = trace_from_array(model, np.array([[[[0, 1], [2, 3]], [[4, 5], [6, 7]]]]))
    sc = scenario(cache={"capacity": "2 experts"}, policies={"prefetch": "previous-token"},
                  hardware={"links": {"pcie": {"bandwidth_gbps": 0.01}}}, execution={"prefetch_depth": 1})
    sim = Simulation(sc, trace=t, record_transfers=True, record_layers=True)
    res = sim.run()
    ev = chrome_trace(res, sim.link_name, sim.model.num_experts, sim.num_prec)["traceEvents"]
    withdrawn = [e for e in ev if e["ph"] == "i"]
    assert res.summary["prefetches_cancelled"] == 1
    assert [(e["name"], e["tid"], e["args"]["layer"], e["args"]["expert"]) for e in withdrawn] == \
        [("withdrawn prefetch", 1, 1, 3)]
    routing_l1 = next(e["ts"] + e["dur"] for e in ev if e["ph"] == "X" and e["args"].get("pass") == 1
                      and e["name"] == "L1 attention+gate")
    assert withdrawn[0]["ts"] == pytest.approx(routing_l1)
    copies = [e for e in ev if e["ph"] == "X" and e["tid"] == 1]
    assert [e["name"] for e in copies].count("prefetch") == 1


def test_the_timeline_records_the_first_passes_only_and_says_so(tmp_path):
    t = synth_from_preset("olmoe-1b-7b", layers=3, requests=1, tokens=20, seed=1)
    sim = Simulation(scenario(), trace=t, record_transfers=True, record_layers=True, record_passes=3)
    doc, ev = timeline(sim)
    passes = {e["args"]["pass"] for e in ev if e["ph"] == "X" and e["tid"] == 0}
    assert passes == {0, 1, 2}
    assert doc["otherData"]["recorded_passes"] == 3
    end_of_pass_2 = max(e["ts"] + e["dur"] for e in ev if e["ph"] == "X" and e["tid"] == 0)
    assert all(e["ts"] <= end_of_pass_2 + 1e-6 for e in ev if e["ph"] == "X" and e["tid"] == 1)
    out = tmp_path / "e.json"
    r = CliRunner().invoke(cli, ["run", "quickstart", "--no-write", "--quiet", "--set", "workload.trace.synth.tokens=5",
                                 "--set", "workload.trace.synth.requests=1", "--events", str(out),
                                 "--events-passes", "2"])
    assert r.exit_code == 0, r.output
    assert "timeline of passes 0-1 of 6 written to" in unwrap(r.output)
    assert {e["args"]["pass"] for e in json.loads(out.read_text())["traceEvents"]
            if e["ph"] == "X" and e["tid"] == 0} == {0, 1}


OLMOE = {"preset": "olmoe-1b-7b", "requests": 8, "prompt_tokens": 8, "tokens": 24, "seed": 3, "pred_next": True}
HOST = {"graph_launch_us": 10.0, "eager_kernel_us": 2.0, "copy_submit_us": 3.0, "event_record_us": 1.0,
        "stream_wait_us": 2.0, "event_wait_us": 1.0}


def both_timelines(monkeypatch, sc, trace=None, **kwargs):
    """(result, timeline document) of the kernel's replay, then of the SimPy path's."""
    out = []
    for off in ("", "1"):
        monkeypatch.setenv("MOESIM_NO_KERNEL", off)
        sim = Simulation(sc, trace=trace, record_transfers=True, record_layers=True, **kwargs)
        res = sim.run()
        out.append((res, chrome_trace(res, sim.link_name, sim.model.num_experts, sim.num_prec)))
    monkeypatch.delenv("MOESIM_NO_KERNEL")
    assert out[0][0].summary["replay_path"] == "kernel", out[0][0].summary["replay_path_reason"]
    assert out[1][0].summary["replay_path"] == "simpy"
    return out


@pytest.mark.parametrize(("over", "passes", "kinds", "withdrawn"), [
    ({"policies": {"prefetch": "oracle"}}, 8, {"demand", "prefetch", "promoted"}, False),
    ({"policies": {"eviction": "least-stale", "prefetch": "score-percentile"}, "expert_compute": "per-expert"},
     None, {"demand", "prefetch", "promoted"}, False),
    ({"policies": {"prefetch": "previous-token"}, "expert_compute": "on-arrival", "cache": {"capacity": "25%"},
      "execution": {"prefetch_depth": 1}}, None, {"demand", "prefetch", "promoted"}, True),
    ({"policies": {"eviction": "belady", "prefetch": "lookahead"}, "expert_compute": "per-expert",
      "expert_fetch": "blocking"}, 3, {"demand", "prefetch", "promoted"}, False),
    ({"policies": {"prefetch": "oracle"}, "hardware": {"preset": "a100-80g-pcie4", "host": HOST},
      "execution": {"style": "hf-loop"}}, 5, {"demand", "prefetch"}, False),
    ({"policies": {"eviction": "fld"}, "timing": False}, None, set(), False),
])
def test_the_kernel_records_the_timeline_the_simpy_path_records(monkeypatch, over, passes, kinds, withdrawn):
    """Copies (each kind), withdrawn prefetches, each layer's times and the cache's bytes:
    the same records, in the same order, bit for bit, whichever path replays (under each
    execution mode, a host model, a recorded window and a cache-only replay, which moves no
    time and records no copies); the timeline documents are equal."""
    sc = scenario(**{"cache": {"capacity": "5%"}, "workload": {"trace": {"synth": OLMOE}}, **over})
    (fast, fast_doc), (ref, ref_doc) = both_timelines(monkeypatch, sc, record_passes=passes)
    assert fast.transfers == ref.transfers
    assert fast.extra == ref.extra
    assert fast_doc == ref_doc
    assert {kind for _, kind, *_ in ref.transfers} == kinds
    assert bool(ref.extra["withdrawn"]) == withdrawn
    shown = passes or len(ref.steps)
    assert len(ref.extra["layers"]) == shown * 16
    assert {p for p, *_ in ref.extra["layers"]} == set(range(shown))


@pytest.mark.parametrize(("transfers", "layers"), [(True, False), (False, True)])
def test_the_kernel_records_what_is_asked_for_alone(monkeypatch, transfers, layers):
    """Copies alone, or layers alone: the other part is not recorded (None), and what is asked
    for is the SimPy path's."""
    sc = scenario(cache={"capacity": "25%"}, policies={"prefetch": "previous-token"}, execution={"prefetch_depth": 1},
                  workload={"trace": {"synth": OLMOE}})
    got = []
    for off in ("", "1"):
        monkeypatch.setenv("MOESIM_NO_KERNEL", off)
        res = Simulation(sc, record_transfers=transfers, record_layers=layers).run()
        got.append((res.summary["replay_path"], res.transfers, res.extra))
        n_pass = len(res.steps)
    assert [g[0] for g in got] == ["kernel", "simpy"]
    assert got[0][1:] == got[1][1:]
    copies, extra = got[0][1:]
    assert (copies is not None, "withdrawn" in extra, "layers" in extra) == (transfers, transfers, layers)
    if transfers:
        assert copies
        assert extra["withdrawn"]
    else:
        assert len(extra["layers"]) == len(extra["occupancy"]) == n_pass * 16


def test_a_trace_read_in_pieces_and_a_served_run_record_the_timeline_on_the_kernel(monkeypatch, tmp_path):
    """A trace file read a piece at a time records the passes of every piece (numbered over
    the whole replay), and a run serving arrivals its passes, as the SimPy path does."""
    from moesim.traces.io import write_trace

    path = write_trace(synth_from_preset("olmoe-1b-7b", requests=9, prompt_tokens=4, tokens=6, seed=5,
                                         layers=4), tmp_path / "t.parquet")
    sc = load_scenario("quickstart", [f"workload.trace.path={path}", "cache.capacity=10%",
                                      "policies.prefetch=previous-token"])
    (fast, _), (ref, _) = both_timelines(monkeypatch, sc, chunk_rows=60)
    assert fast.summary["trace_pieces"] > 2
    assert fast.transfers == ref.transfers
    assert fast.extra == ref.extra
    assert len(ref.extra["layers"]) == len(ref.steps) * 4
    served = scenario(cache={"capacity": "10%"}, policies={"prefetch": "previous-token"},
                      workload={"trace": {"synth": {**OLMOE, "layers": 4, "requests": 6}},
                                "arrivals": {"process": "poisson", "rate": 40.0, "requests": 6}})
    (fast, fast_doc), (ref, ref_doc) = both_timelines(monkeypatch, served, record_passes=6)
    assert fast.transfers == ref.transfers
    assert fast.extra == ref.extra
    assert fast_doc == ref_doc
    assert len(ref.extra["layers"]) == 6 * 4


def test_a_timeline_inside_the_results_folder_survives_the_results_write(tmp_path):
    """``--events DIR/events.json --out DIR``: the timeline is written with the results (the
    folder that replaces DIR holds it), on a first run and on a rerun that replaces the folder; a
    timeline named as one of the results files is refused before any work."""
    out = tmp_path / "ev"
    args = ["run", "quickstart", "--quiet", "--set", "workload.trace.synth.tokens=5",
            "--set", "workload.trace.synth.requests=1", "--events-passes", "2", "--out", str(out)]
    for events in (out / "events.json", out / "tl" / "e.json"):
        r = CliRunner().invoke(cli, [*args, "--events", str(events)])
        assert r.exit_code == 0, r.output
        assert f"timeline of passes 0-1 of 6 written to {events}" in unwrap(r.output)
        assert {e["args"]["pass"] for e in json.loads(events.read_text())["traceEvents"]
                if e["ph"] == "X" and e["tid"] == 0} == {0, 1}
        assert (out / "summary.json").exists()
    # the second run replaced the folder: the first timeline went with the old results, as it says
    assert not (out / "events.json").exists()
    assert "they replace the results that were there" in unwrap(r.output)
    r = CliRunner().invoke(cli, [*args, "--events", str(out / "summary.json")])
    assert r.exit_code == 2
    assert r.output.startswith("error: --events")
    assert "that is where the results go" in unwrap(r.output)
    assert json.loads((out / "summary.json").read_text())["forward_passes"] == 6


def test_expert_parallel_timeline_has_a_track_per_gpu_adding_up_to_each_layer():
    """8 GPUs: a process per GPU; per layer each GPU's attention, dispatch, experts, wait for
    the slowest GPU and combine add up to the layer's time, and the layers to the pass's."""
    t = synth_from_preset("olmoe-1b-7b", layers=2, requests=8, tokens=3, seed=2)
    sc = scenario(hardware={"preset": "h100-sxm-nvlink-x8"}, workload={"batch_size": 8})
    sim = Simulation(sc, trace=t, record_transfers=True, record_layers=True)
    res = sim.run()
    ev = chrome_trace(res, sim.link_name, sim.model.num_experts, sim.num_prec)["traceEvents"]
    spans = [e for e in ev if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == set(range(8))
    assert sorted(e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "process_name") == \
        [f"GPU {g}" for g in range(8)]
    for g in range(8):
        mine = [e for e in spans if e["pid"] == g and e["args"]["pass"] == 1]
        total = sum(e["dur"] for e in mine) / 1e6
        assert total == pytest.approx(res.steps["duration_s"].iloc[1], rel=1e-9)
    slowest = [e for e in spans if e["name"].endswith("wait for slowest GPU")]
    assert slowest  # some GPU always waits for another here

"""Serving under load (``moesim.simulator.serving``, ``docs/guides/serving.md``): request arrivals,
continuous batching, per-request latencies and the SLO figures.

References are independent of the code under test: the M/D/1 mean response time and a
Lindley recursion over the same arrivals (service times from today's fixed-batch replay),
today's batch-1 replay for requests that never overlap, schedules and per-layer expert
unions worked out by hand from the trace's rows, and the SimPy reference path replaying the
schedule the kernel formed (open loop, with the same release times).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moesim.cli import cli
from moesim.config.confload import ConfigError
from moesim.config.scenario import ArrivalsConfig, scenario_from_dict
from moesim.errors import MoesimError
from moesim.simulator import serving
from moesim.simulator.engine import Simulation, simulate
from moesim.simulator.workload import Workload
from tests.helpers import unwrap

TINY = {"synth": {"preset": "olmoe-1b-7b", "requests": 3, "prompt_tokens": 4, "tokens": 4, "layers": 2,
                  "experts": 8, "top_k": 2}}
TINY_KV = 2 * 2 * 16 * 128 * 2  # KV bytes a token: keys and values, 2 layers, 16 KV heads of 128, bf16


def served(trace: dict[str, Any], arrivals: dict[str, Any], scheduler: dict[str, Any] | None = None,
           **top: Any) -> dict[str, Any]:
    data: dict[str, Any] = {"seed": 0, "workload": {"trace": copy.deepcopy(trace), "arrivals": arrivals},
                            "cache": {"capacity": "25%"}, **top}
    if scheduler is not None:
        data["scheduler"] = scheduler
    return data


def write_csv(path: Path, rows: list[tuple[Any, ...]], header: str = "arrival_time,input_tokens,output_tokens") -> Path:
    path.write_text(header + "\n" + "".join(",".join(map(str, r)) + "\n" for r in rows))
    return path


# -- queueing closed forms -------------------------------------------------------------------
ONE_EXPERT = {"synth": {"preset": "olmoe-1b-7b", "requests": 2, "prompt_tokens": 8, "tokens": 0, "layers": 1,
                        "experts": 1, "top_k": 1}}


def service_times() -> tuple[float, float]:
    """Today's fixed-batch replay of two prefill-only requests: the first pass (a cold miss)
    and the second (all resident)."""
    ref = simulate(scenario_from_dict({"workload": {"trace": ONE_EXPERT}, "cache": {"capacity": "inf"}}))
    d = ref.steps["duration_s"].to_numpy()
    assert ref.steps["misses"].tolist() == [1, 0]
    return float(d[0]), float(d[1])


def lindley(arrival: np.ndarray, first: float, rest: float) -> np.ndarray:
    """Response times of a single FCFS server: each request starts when it has arrived and
    the one before has left."""
    out = np.empty(len(arrival))
    free = 0.0
    for n, a in enumerate(arrival):
        start = max(a, free)
        free = start + (first if n == 0 else rest)
        out[n] = free - a
    return out


POLICIES = ["vllm-v1", "vllm-v0", "sarathi"]


@pytest.mark.parametrize("policy", POLICIES)
def test_deterministic_arrivals_by_hand(policy: str, tmp_path: Path) -> None:
    """Arrivals every S/2 (twice as fast as served): request n starts when n requests have
    been served, so its TTFT is first + n S - n S/2; arrivals every 2S never queue; under
    every scheduler."""
    first, s = service_times()
    for gap, expect in ((s / 2, lambda n: first + n * s - n * s / 2), (2 * first, lambda n: first if n == 0 else s)):
        rows = [(n * gap, 8, 1) for n in range(12)]
        path = write_csv(tmp_path / "det.csv", rows)
        res = simulate(scenario_from_dict(served(ONE_EXPERT, {"process": "file", "path": str(path)},
                                                 {"max_running": 1, "kv_memory": "none", "policy": policy},
                                                 cache={"capacity": "inf"})))
        want = np.array([expect(n) for n in range(12)])
        np.testing.assert_allclose(res.requests["ttft_s"].to_numpy(), want, rtol=1e-9, atol=1e-15)
        assert res.summary["kv_capacity_tokens"] is None  # no limit: JSON's null, not infinity
        assert res.summary["max_running_seen"] == 1


# -- requests that never overlap are today's batch-1 replay ----------------------------------
@pytest.mark.parametrize(("eviction", "prefetch", "mode"), [
    ("lru", "none", "layer"), ("least-stale", "oracle", "per-expert"), ("lfu", "none", "on-arrival"),
    ("fifo", "oracle", "layer")])
def test_low_rate_is_the_single_request_replay(eviction: str, prefetch: str, mode: str, tmp_path: Path) -> None:
    """Requests arriving 5 s apart (each takes about 1 s) are each alone: every pass's counts
    equal today's batch-1 replay's; the first request's durations, TTFT and TPOT bit for bit
    (its clock starts at 0, as today's), the others' within float rounding (their clock is
    at a later time: 1e-12 s at about 20 s); no request queues."""
    trace = {"synth": {"preset": "olmoe-1b-7b", "requests": 4, "prompt_tokens": 24, "tokens": 12}}
    base = {"seed": 0, "workload": {"trace": trace}, "cache": {"capacity": "25%"}, "expert_compute": mode,
            "policies": {"eviction": eviction, "prefetch": prefetch}}
    today = simulate(scenario_from_dict(base))
    sv = copy.deepcopy(base)
    path = write_csv(tmp_path / "apart.csv", [(5 * n, 24, 13) for n in range(4)])
    sv["workload"]["arrivals"] = {"process": "file", "path": str(path)}
    res = simulate(scenario_from_dict(sv))
    a, b = today.steps, res.steps
    assert len(a) == len(b)
    for col in ("tokens", "generated", "requests", "hits", "misses", "late_prefetches", "collision_misses",
                "bytes_h2d", "unique_experts", "prefetches_issued", "prefetches_used", "phase"):
        assert a[col].tolist() == b[col].tolist(), col
    first = a["group"].to_numpy() == 0
    assert b.loc[first, "duration_s"].tolist() == a.loc[first, "duration_s"].tolist()
    np.testing.assert_allclose(b["duration_s"], a["duration_s"], rtol=0, atol=1e-12)
    assert res.requests["ttft_s"].iloc[0] == today.requests["ttft_s"].iloc[0]
    np.testing.assert_allclose(res.requests["ttft_s"], today.requests["ttft_s"], rtol=0, atol=1e-12)
    # today's TPOT of a request: its decode passes' mean duration
    dec = a[a["phase"] == "decode"]
    tpot = dec.groupby("group")["duration_s"].mean().to_numpy()
    assert res.requests["tpot_s"].iloc[0] == pytest.approx(tpot[0], rel=1e-14)
    np.testing.assert_allclose(res.requests["tpot_s"], tpot, rtol=0, atol=1e-12 / 6)  # (finish - first token) / 12 at about 20 s
    assert (res.requests["queue_s"] == 0).all()
    # end to end: the request's passes, back to back from its arrival
    np.testing.assert_allclose(res.requests["e2e_s"], a.groupby("group")["duration_s"].sum(), rtol=0, atol=1e-11)
    assert b["start_s"].iloc[13] == 5.0  # idle until the second request arrives
    assert res.summary["trace_pieces"] == len(b)


# -- continuous batching by hand ---------------------------------------------------------------
def hand_trace() -> Any:
    from moesim.simulator.build import load_trace

    return load_trace(scenario_from_dict({"workload": {"trace": TINY}}))


def hand_union(trace: Any, tokens: list[tuple[int, int, int]], prompt: dict[int, int]) -> list[list[int]]:
    """Per layer, the distinct experts of a pass's tokens (request, first token, count), in
    order of first appearance over requests then positions then ranks, read from the trace
    the replay used: request r takes recorded request r % 3; its token i < prompt from the
    recorded prefill position i % P (P the recorded prompt's length), else decode step
    (i - prompt) % D + 1 (D its decode steps)."""
    df = pd.DataFrame({"r": trace.request, "s": trace.step, "p": trace.position, "ph": trace.phase,
                       "l": trace.layer})
    out: list[list[int]] = [[], []]
    for r, i0, c in sorted(tokens):
        src = r % 3
        rec = df[df.r == src]
        p0, d0 = rec[rec.ph == 0].p.nunique(), rec[rec.ph == 1].s.nunique()
        for i in range(i0, i0 + c):
            if i < prompt[r]:
                sel = (df.r == src) & (df.ph == 0) & (df.p == i % p0)
            else:
                sel = (df.r == src) & (df.s == (i - prompt[r]) % d0 + 1)
            for row in np.flatnonzero(sel.to_numpy()):
                for e in trace.experts[row]:
                    layer = int(trace.layer[row])
                    if int(e) not in out[layer]:
                        out[layer].append(int(e))
    return out


KV = {"kv_memory": f"{10 * TINY_KV}B", "kv_block_tokens": 2}  # 10 tokens of TINY's KV (16 KiB a token): 5 blocks
ROWS_KV = [(0, 4, 3), (0, 2, 4), (0, 2, 2)]
RECOMPUTED = {name: {2: 2} for name in ("vllm-v1-kv", "vllm-v0-kv", "sarathi-kv")}  # request: tokens thrown away

SCHEDULES = {
    # vllm-v0, 2 running at most: A and B prefilled together; C waits for B to finish
    "vllm-v0": ({"max_running": 2, "max_batched_tokens": 16, "policy": "vllm-v0"},
                      [[(0, 0, 4), (1, 0, 2)], [(0, 4, 1), (1, 2, 1)], [(2, 0, 3)], [(0, 5, 1), (2, 3, 1)]],
                      {0: (0, 3), 1: (0, 1), 2: (2, 3)}),
    # chunked, 4 tokens a pass: A's prompt; A's decode + B's prompt; both decode; C; C's decode
    "sarathi": ({"max_running": 2, "max_batched_tokens": 4, "policy": "sarathi"},
                [[(0, 0, 4)], [(0, 4, 1), (1, 0, 2)], [(0, 5, 1), (1, 2, 1)], [(2, 0, 3)], [(2, 3, 1)]],
                {0: (0, 2), 1: (1, 2), 2: (3, 4)}),
    # chunked prompts of at most 2 tokens: A's and C's prompts in two chunks (no token from the first);
    # B's first token in pass 0, its decode first in pass 1
    "sarathi-2": ({"max_running": 3, "max_batched_tokens": 8, "policy": "sarathi", "chunked_prefill_tokens": 2},
                  [[(0, 0, 2), (1, 0, 2), (2, 0, 2)], [(0, 2, 2), (1, 2, 1), (2, 2, 1)],
                   [(0, 4, 1), (2, 3, 1)], [(0, 5, 1)]],
                  {0: (1, 3), 1: (0, 1), 2: (1, 2)}),
    # chunked, 4 tokens a pass, 3 running: B's long prompt goes on in chunks behind A's decode token,
    # and C waits for the pass with tokens to spare (requests: A 3+3, B 8+2, C 2+2)
    "sarathi-carry": ({"max_running": 3, "max_batched_tokens": 4, "policy": "sarathi"},
                      [[(0, 0, 3), (1, 0, 1)], [(0, 3, 1), (1, 1, 3)], [(0, 4, 1), (1, 4, 3)],
                       [(1, 7, 1), (2, 0, 2)], [(1, 8, 1), (2, 2, 1)]],
                      {0: (0, 2), 1: (3, 4), 2: (3, 4)}),
    # vllm-v1, 2 running at most: A and B prefilled together and decoded; A's last decode and C's
    # prompt in one pass (V0 gives C's prompt a pass of its own)
    "vllm-v1": ({"max_running": 2, "max_batched_tokens": 16},
                [[(0, 0, 4), (1, 0, 2)], [(0, 4, 1), (1, 2, 1)], [(0, 5, 1), (2, 0, 3)], [(2, 3, 1)]],
                {0: (0, 2), 1: (0, 1), 2: (2, 3)}),
    # KV in 5 blocks of 2 tokens (A 4+3, B 2+4, C 2+2): all three prefilled (2 + 1 + 1 blocks); in
    # the next pass B's decode needs a block A's took, so C (the last admitted) is preempted and
    # B decodes; C is readmitted when A's blocks are freed and recomputes its prompt and its
    # first output token (3 tokens, 2 blocks) before making its second
    "vllm-v1-kv": ({"max_running": 3, "max_batched_tokens": 16, **KV},
                   [[(0, 0, 4), (1, 0, 2), (2, 0, 2)], [(0, 4, 1), (1, 2, 1)], [(0, 5, 1), (1, 3, 1)],
                    [(1, 4, 1), (2, 0, 3)]],
                   {0: (0, 2), 1: (0, 3), 2: (0, 3)}),
    # the same under vllm-v0: C's recompute is a prefill pass of its own, B's last decode after it
    "vllm-v0-kv": ({"max_running": 3, "max_batched_tokens": 16, "policy": "vllm-v0", **KV},
                   [[(0, 0, 4), (1, 0, 2), (2, 0, 2)], [(0, 4, 1), (1, 2, 1)], [(0, 5, 1), (1, 3, 1)],
                    [(2, 0, 3)], [(1, 4, 1)]],
                   {0: (0, 2), 1: (0, 4), 2: (0, 3)}),
    # and under sarathi: decodes first, C's recompute in the tokens left, as vllm-v1
    "sarathi-kv": ({"max_running": 3, "max_batched_tokens": 16, "policy": "sarathi", **KV},
                   [[(0, 0, 4), (1, 0, 2), (2, 0, 2)], [(0, 4, 1), (1, 2, 1)], [(0, 5, 1), (1, 3, 1)],
                    [(1, 4, 1), (2, 0, 3)]],
                   {0: (0, 2), 1: (0, 3), 2: (0, 3)}),
}

ROWS = {"sarathi-carry": [(0, 3, 3), (0, 8, 2), (0, 2, 2)], **dict.fromkeys(RECOMPUTED, ROWS_KV)}


@pytest.mark.parametrize("block", [1 << 16, 2])
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_continuous_batching_by_hand(name: str, block: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three requests at time 0 (A: prompt 4, 3 output tokens; B: 2, 2; C: 3, 2): who runs
    in each pass, what it generates, each pass's per-layer expert union, and each request's
    first token and finish at the end of the pass worked out by hand; the same when the
    kernel hands the passes' rows over two at a time (through a file on disk)."""
    from moesim.simulator import kernel

    sched, passes, times = SCHEDULES[name]
    monkeypatch.setattr(serving.Scheduler, "KEEP", True)
    monkeypatch.setattr(kernel, "BLOCK_PASSES", block)
    rows = ROWS.get(name, [(0, 4, 3), (0, 2, 2), (0, 3, 2)])
    path = write_csv(tmp_path / "three.csv", rows)
    sim = Simulation(scenario_from_dict(served(TINY, {"process": "file", "path": str(path)}, sched)))
    res = sim.run()
    steps = res.steps
    prompt = {r: p for r, (_, p, _) in enumerate(rows)}
    assert len(steps) == len(passes)
    assert steps["requests"].tolist() == [len(p) for p in passes]
    assert steps["tokens"].tolist() == [sum(c for _, _, c in p) for p in passes]
    made = [sum(1 for r, i, c in p if i + c >= max(prompt[r], 1)) for p in passes]
    assert steps["generated"].tolist() == made
    trace = sim.source.trace  # the recorded trace (made again with 8-token prompts for chunked-carry's B)
    assert sim.source.serving is not None
    assert sim.source.serving.kept is not None
    for k, (p, wl) in enumerate(zip(passes, sim.source.serving.kept, strict=True)):
        want = hand_union(trace, p, prompt)
        for layer in range(2):
            lo, hi = wl.off[layer], wl.off[layer + 1]
            assert wl.acc_expert[lo:hi].tolist() == want[layer], (k, layer)
        assert steps["unique_experts"].iloc[k] == len(want[0]) + len(want[1])
    end = steps["end_s"].to_numpy()
    for r, (f, last) in times.items():
        assert res.requests["first_token_s"].iloc[r] == end[f]
        assert res.requests["finish_s"].iloc[r] == end[last]
        assert res.requests["tpot_s"].iloc[r] == pytest.approx((end[last] - end[f]) / (rows[r][2] - 1), rel=1e-15)
    # each output token's time is the end of the pass that made it (the hand schedule's `made`):
    # a request's gaps are the differences between consecutive ones, pooled for the summary
    pooled = []
    for r in range(len(rows)):
        made_at = [end[k] for k, p in enumerate(passes) for x, i, c in p if x == r and i + c >= max(prompt[r], 1)]
        assert len(made_at) == rows[r][2]
        gaps = np.diff(made_at)
        pooled += gaps.tolist()
        got = res.requests["itl_max_s"].iloc[r]
        assert (np.isnan(got) if len(gaps) == 0 else got == gaps.max()), (r, got, gaps)
    assert res.summary["itl_p50_s"] == pytest.approx(float(np.percentile(pooled, 50)), rel=1e-15)
    assert res.summary["itl_p99_s"] == pytest.approx(float(np.percentile(pooled, 99)), rel=1e-15)
    recomputed = RECOMPUTED.get(name, {})
    assert res.requests["recomputed_tokens"].tolist() == [recomputed.get(r, 0) for r in range(3)]
    assert res.requests["preemptions"].tolist() == [int(r in recomputed) for r in range(3)]
    assert (res.summary["preemptions"], res.summary["recomputed_tokens"]) == (len(recomputed), sum(recomputed.values()))
    assert res.requests["source_request"].tolist() == [0, 1, 2]  # the recorded requests, in order
    assert res.requests["scheduled_s"].tolist() == [0.0, *[steps["start_s"].iloc[next(
        k for k, p in enumerate(passes) if any(x[0] == r for x in p))] for r in (1, 2)]]


# -- the kernel's closed loop is the reference path's open loop -------------------------------
def joined(parts: list[Workload]) -> Workload:
    """The schedule's passes as one fixed workload, accesses and all (numbered on)."""
    from dataclasses import replace

    acc = np.cumsum([0] + [int(w.off[-1]) for w in parts])
    cat = np.concatenate
    return replace(
        parts[0], pass_group=np.arange(len(parts)), pass_step=cat([w.pass_step for w in parts]),
        pass_phase=cat([w.pass_phase for w in parts]), pass_tokens=cat([w.pass_tokens for w in parts]),
        pass_context=cat([w.pass_context for w in parts]), pass_requests=cat([w.pass_requests for w in parts]),
        pass_generated=cat([w.pass_generated for w in parts]),
        off=cat([np.zeros(1, np.int64)] + [w.off[1:] + acc[i] for i, w in enumerate(parts)]),
        acc_layer=cat([w.acc_layer for w in parts]), acc_expert=cat([w.acc_expert for w in parts]),
        acc_rank=cat([w.acc_rank for w in parts]), acc_tokens=cat([w.acc_tokens for w in parts]),
        acc_weight=cat([w.acc_weight for w in parts]), request_ids=np.arange(len(parts)),
        request_group=np.arange(len(parts)), request_first_pass=np.arange(len(parts)),
        weight_total=cat([w.weight_total for w in parts]), row_order=None, row_off=None, trace=None,
        pass_release=cat([w.pass_release for w in parts]))


@pytest.mark.parametrize(("eviction", "prefetch", "mode", "execution"), [
    ("lru", "none", "layer", "none"), ("least-stale", "oracle", "per-expert", "none"),
    ("lfu", "oracle", "on-arrival", "none"), ("least-stale", "none", "per-expert", "hf-loop")])
def test_closed_loop_equals_simpy_open_loop(eviction: str, prefetch: str, mode: str, execution: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """At a load with queues and idle gaps, the passes the scheduler formed on the kernel,
    replayed as one fixed workload with their release times on the SimPy reference path,
    give every per-pass column bit for bit."""
    monkeypatch.setattr(serving.Scheduler, "KEEP", True)
    trace = {"synth": {"preset": "olmoe-1b-7b", "requests": 6, "prompt_tokens": 16, "tokens": 6, "layers": 4}}
    data = served(trace, {"process": "gamma", "rate": 2.0, "cv": 3.0, "requests": 14},
                  {"max_running": 4, "max_batched_tokens": 40, "policy": "sarathi", "chunked_prefill_tokens": 12},
                  expert_compute=mode, execution={"style": execution},
                  policies={"eviction": eviction, "prefetch": prefetch})
    sc = scenario_from_dict(data)
    sim = Simulation(sc)
    res = sim.run()
    assert res.summary["replay_path"] == "kernel"
    assert sim.source.serving is not None
    assert sim.source.serving.kept is not None
    release = np.array([float(w.pass_release[0]) for w in sim.source.serving.kept])
    assert (release > 0).sum() >= 2
    assert (res.requests["queue_s"] > 0).any()
    plain = copy.deepcopy(data)
    del plain["workload"]["arrivals"], plain["scheduler"]
    ref = Simulation(scenario_from_dict(plain), workload=joined(sim.source.serving.kept), record_decisions=True).run()
    assert ref.summary["replay_path"] == "simpy"
    for col in ("start_s", "end_s", "stall_s", "hits", "misses", "late_prefetches", "collision_misses",
                "bytes_h2d", "prefetches_issued", "prefetches_used", "prefetches_cancelled", "unique_experts"):
        assert ref.steps[col].tolist() == res.steps[col].tolist(), col


def run_served(data: dict[str, Any]) -> tuple[Any, list[Workload]]:
    """The served run (on the kernel) and the passes its scheduler formed (``Scheduler.KEEP``)."""
    sim = Simulation(scenario_from_dict(data))
    res = sim.run()
    assert res.summary["replay_path"] == "kernel"
    assert sim.source.serving is not None
    assert sim.source.serving.kept is not None
    return res, sim.source.serving.kept


def with_tokens(parts: list[Workload]) -> Workload:
    """:func:`joined`, with the passes' trace rows (one trace of the pieces' rows, each
    (pass, layer)'s rows numbered on): what a miss policy that changes what tokens compute
    reads."""
    from dataclasses import replace

    cat = np.concatenate
    rows = np.cumsum([0] + [len(w.trace) for w in parts])
    order = np.cumsum([0] + [len(w.row_order) for w in parts])
    trace = replace(parts[0].trace, **{
        f: (None if getattr(parts[0].trace, f) is None else cat([getattr(w.trace, f) for w in parts]))
        for f in ("request", "step", "position", "phase", "layer", "experts", "weights", "probs", "pred_next")})
    return replace(joined(parts), trace=trace,
                   row_order=cat([w.row_order + rows[i] for i, w in enumerate(parts)]),
                   row_off=cat([np.zeros(1, np.int64)] + [w.row_off[1:] + order[i] for i, w in enumerate(parts)]))


@pytest.mark.parametrize(("miss", "mode"), [
    ("drop", "layer"), ({"name": "drop", "rank": 1}, "per-expert"), ("substitute", "on-arrival"),
    ("substitute", "per-expert"), ("speculative", "layer"),
    ({"name": "fetch-lowest-bit", "precisions": ["bf16", "int4"]}, "per-expert"),
    ({"name": "fetch-priority", "precisions": ["bf16", "int8", "int4"], "degrade_fraction": 0.5}, "layer")])
def test_miss_policies_that_change_what_tokens_compute_serve_as_the_simpy_path_replays_the_schedule(
        miss: Any, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under load (vLLM V1, chunked prompts): the passes the scheduler formed, with their
    tokens, replayed as one fixed workload on the SimPy path give every per-pass column bit
    for bit, the miss policy's own counts and the gate mass among them. Later passes hold more
    tokens than the first (the kernel's per-token room grows as they come), and the policy
    acted (dropped, substituted or fetched at a lower precision)."""
    monkeypatch.setattr(serving.Scheduler, "KEEP", True)
    trace = {"synth": {"preset": "olmoe-1b-7b", "requests": 6, "prompt_tokens": 16, "tokens": 6, "layers": 3,
                       "pred_next": True, "probs": True}}
    data = served(trace, {"process": "gamma", "rate": 4.0, "cv": 3.0, "requests": 12},
                  {"max_running": 4, "max_batched_tokens": 48}, expert_compute=mode,
                  cache={"capacity": "10%"}, policies={"eviction": "lru", "prefetch": "none", "miss": miss})
    res, kept = run_served(data)
    rows = [int(np.diff(w.row_off).max()) for w in kept]
    assert max(rows) > rows[0]
    plain = copy.deepcopy(data)
    del plain["workload"]["arrivals"], plain["scheduler"]
    ref = Simulation(scenario_from_dict(plain), workload=with_tokens(kept), record_decisions=True).run()
    assert ref.summary["replay_path"] == "simpy"
    for col in ("start_s", "end_s", "stall_s", "hits", "misses", "late_prefetches", "collision_misses",
                "bytes_h2d", "unique_experts", "dropped_experts", "substituted_experts", "low_precision_experts",
                "tokens_altered", "gate_weight_total", "gate_weight_computed"):
        assert ref.steps[col].tolist() == res.steps[col].tolist(), col
    acted = res.steps[["dropped_experts", "substituted_experts", "low_precision_experts"]].to_numpy().sum()
    assert acted > 0


MIXED = {"synth": {"preset": "olmoe-1b-7b", "requests": 6, "prompt_tokens": 16, "tokens": 6, "layers": 3,
                   "pred_next": True, "probs": True}}
OLMOE3_KV = 2 * 3 * 16 * 128 * 2  # KV bytes a token of MIXED: keys and values, 3 layers, 16 KV heads of 128, bf16


@pytest.mark.parametrize(("policies", "mode", "kv_tokens"), [
    ({"eviction": "lru", "prefetch": "none"}, "layer", 60),
    ({"eviction": "least-stale", "prefetch": "oracle"}, "per-expert", None),
    ({"eviction": "lru", "prefetch": "previous-token"}, "layer", 60),
    ({"eviction": "lru", "prefetch": "none", "miss": "drop"}, "layer", None),
    ({"eviction": "belady", "prefetch": "none"}, "per-expert", 60)])
def test_serving_on_the_simpy_path_gives_the_kernels_rows_bit_for_bit(
        policies: dict[str, Any], mode: str, kv_tokens: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same served scenario (vLLM V1, chunked prompts, bursty arrivals; with a KV cache of
    60 tokens, preemptions) on the compiled kernel and, with ``MOESIM_NO_KERNEL``, on the SimPy
    path's own piece loop: every per-pass and per-request column bit for bit, and the summary's
    latency figures."""
    sched: dict[str, Any] = {"max_running": 4, "max_batched_tokens": 40}
    if kv_tokens is not None:
        sched.update(kv_memory=f"{OLMOE3_KV * kv_tokens}B", kv_block_tokens=4)
    data = served(MIXED, {"process": "gamma", "rate": 3.0, "cv": 3.0, "requests": 14}, sched,
                  expert_compute=mode, cache={"capacity": "30%"}, policies=policies)
    monkeypatch.delenv("MOESIM_NO_KERNEL", raising=False)
    fast = simulate(scenario_from_dict(copy.deepcopy(data)))
    monkeypatch.setenv("MOESIM_NO_KERNEL", "1")
    ref = simulate(scenario_from_dict(copy.deepcopy(data)))
    assert (fast.summary["replay_path"], ref.summary["replay_path"]) == ("kernel", "simpy")
    pd.testing.assert_frame_equal(ref.steps, fast.steps, check_exact=True)
    pd.testing.assert_frame_equal(ref.requests, fast.requests, check_exact=True)
    other = {"wall_s", "replay_path", "replay_path_reason"}
    assert {k: v for k, v in ref.summary.items() if k not in other} == {
        k: v for k, v in fast.summary.items() if k not in other}  # TTFT, ITL, preemptions, the passes served...
    assert ref.summary["trace_pieces"] == len(fast.steps)  # a piece a pass
    assert (fast.requests["queue_s"] > 0).any()
    if kv_tokens is not None:
        assert fast.summary["preemptions"] > 0


@pytest.mark.parametrize(("policies", "mode", "top"), [
    ({"budget": {"name": "moe-spec", "budget": 8}}, "layer", {}),
    ({"eviction": "least-stale", "budget": {"name": "xshare", "budget": 12}}, "per-expert", {}),
    ({"routing": "cache-aware"}, "on-arrival", {}),
    ({"budget": "lynx"}, "layer", {"hardware": {"preset": "h100-sxm-nvlink-x4"}}),
    ({"eviction": "lfu", "budget": {"name": "moe-spec", "budget": 8}}, "per-expert",
     {"hardware": {"preset": "h100-sxm-nvlink-x2"}, "cache": {"ep_offload": True}})])
def test_routing_budgets_and_expert_parallelism_serve_as_the_simpy_path_replays_the_schedule(
        policies: dict[str, Any], mode: str, top: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Under load, a budget (on the kernel, its choices made a pass at a time as the scheduler
    forms it; the same on the SimPy path), cache-aware routing (on the kernel, its running mean
    carried from pass to pass; the same on the SimPy path) and expert parallelism (4 GPUs; 2
    with offload, each GPU's LFU cache fed by its own host link; on the SimPy path):
    the passes the scheduler formed, with their tokens, replayed as one fixed workload give
    every per-pass column bit for bit; the policy acted (tokens altered; under expert
    parallelism, tokens crossed the EP link; with offload, GPUs missed)."""
    monkeypatch.setattr(serving.Scheduler, "KEEP", True)
    top = copy.deepcopy(top)
    data = served(MIXED, {"process": "gamma", "rate": 3.0, "cv": 3.0, "requests": 14},
                  {"max_running": 4, "max_batched_tokens": 40}, expert_compute=mode,
                  cache={"capacity": "30%", **top.pop("cache", {})}, policies=policies, **top)
    sim = Simulation(scenario_from_dict(data))
    res = sim.run()
    on_kernel = not top
    assert res.summary["replay_path"] == ("kernel" if on_kernel else "simpy"), res.summary["replay_path_reason"]
    if on_kernel:
        monkeypatch.setenv("MOESIM_NO_KERNEL", "1")
        simpy = Simulation(scenario_from_dict(data)).run()
        monkeypatch.delenv("MOESIM_NO_KERNEL")
        pd.testing.assert_frame_equal(simpy.steps, res.steps, check_exact=True)
        pd.testing.assert_frame_equal(simpy.requests, res.requests, check_exact=True)
    assert sim.source.serving is not None
    assert sim.source.serving.kept is not None
    plain = copy.deepcopy(data)
    del plain["workload"]["arrivals"], plain["scheduler"]
    ref = Simulation(scenario_from_dict(plain), workload=with_tokens(sim.source.serving.kept)).run()
    for col in ("start_s", "end_s", "stall_s", "hits", "misses", "late_prefetches", "collision_misses",
                "bytes_h2d", "bytes_ep", "unique_experts", "tokens_altered", "gate_weight_total",
                "gate_weight_computed", "max_experts_per_gpu"):
        assert ref.steps[col].tolist() == res.steps[col].tolist(), col
    assert (res.requests["queue_s"] > 0).any()
    assert res.steps["tokens_altered"].sum() > 0
    if top:
        assert res.steps["bytes_ep"].sum() > 0
    if data["cache"].get("ep_offload"):
        assert res.steps["misses"].sum() > 0
        assert res.steps["stall_s"].sum() > 0
        assert ref.summary["gpu_hit_rate"] == res.summary["gpu_hit_rate"]


@pytest.mark.parametrize(("mode", "kv_tokens"), [("layer", None), ("per-expert", None), ("layer", 60)])
def test_served_belady_at_its_fixed_point_is_belady_over_the_passes_it_served(
        mode: str, kv_tokens: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Belady under load reads, after each pass, the schedule of a run before it
    (:mod:`simulator.served_future`); here a run makes the schedule it read (``future_exact``),
    so its future was its own: the passes the scheduler formed, replayed as one fixed workload
    by the fixed-batch Belady (which reads the whole workload's future), give every per-pass
    column bit for bit; with a KV cache of 60 tokens requests are preempted and their tokens
    processed again. ``future_runs`` is the runs made before the reported one. Belady misses
    less than LRU on the same arrivals."""
    monkeypatch.setattr(serving.Scheduler, "KEEP", True)
    sched: dict[str, Any] = {"max_running": 4, "max_batched_tokens": 40}
    if kv_tokens is not None:
        sched.update(kv_memory=f"{OLMOE3_KV * kv_tokens}B", kv_block_tokens=4)
    data = served(MIXED, {"process": "gamma", "rate": 3.0, "cv": 3.0, "requests": 14}, sched,
                  expert_compute=mode, cache={"capacity": "20%"}, policies={"eviction": "belady"})
    runs: list[int] = []
    real_run = Simulation.run
    monkeypatch.setattr(Simulation, "run", lambda self: runs.append(1) or real_run(self))
    sim = Simulation(scenario_from_dict(copy.deepcopy(data)))
    res = sim.run()
    monkeypatch.setattr(Simulation, "run", real_run)
    assert res.summary["future_exact"] is True
    assert res.summary["future_runs"] == len(runs) - 1 >= 1
    if kv_tokens is not None:
        assert res.summary["preemptions"] > 0
    assert "future_note" not in res.summary
    assert sim.source.serving is not None
    assert sim.source.serving.kept is not None
    plain = copy.deepcopy(data)
    del plain["workload"]["arrivals"], plain["scheduler"]
    ref = Simulation(scenario_from_dict(plain), workload=with_tokens(sim.source.serving.kept)).run()
    for col in ("start_s", "end_s", "stall_s", "hits", "misses", "collision_misses", "bytes_h2d", "unique_experts"):
        assert ref.steps[col].tolist() == res.steps[col].tolist(), col
    lru = simulate(scenario_from_dict({**copy.deepcopy(data), "policies": {"eviction": "lru"}}))
    assert res.summary["misses"] < lru.summary["misses"]


def test_served_belady_without_a_fixed_point_says_its_decisions_are_not_the_optimums(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With no run allowed before the reported one, the reported run reads an empty schedule
    (no future after each pass), not its own: the summary says so."""
    from moesim.simulator import served_future

    monkeypatch.setattr(served_future, "MAX_RUNS", 1)
    data = served(MIXED, {"process": "gamma", "rate": 3.0, "cv": 3.0, "requests": 14},
                  {"max_running": 4, "max_batched_tokens": 40}, cache={"capacity": "20%"},
                  policies={"eviction": "belady"})
    s = simulate(scenario_from_dict(copy.deepcopy(data))).summary
    assert (s["future_runs"], s["future_exact"]) == (0, False)
    assert "not the optimum's" in s["future_note"]
    monkeypatch.setattr(served_future, "MAX_RUNS", 2)  # one run before: its schedule, read by the next, is its own
    s = simulate(scenario_from_dict(copy.deepcopy(data))).summary
    assert s["future_runs"] == 1


def test_served_belady_reads_the_trace_it_is_given() -> None:
    """A trace given to the replay (not the scenario's) is the one every run that finds the
    future serves: the reported run reaches the fixed point (runs serving the scenario's own
    trace would make other schedules), and its rows are not the scenario's trace's."""
    from moesim.traces.synth import synth_from_preset

    trace = synth_from_preset("olmoe-1b-7b", requests=6, prompt_tokens=16, tokens=6, layers=3, seed=7)
    data = served(MIXED, {"process": "gamma", "rate": 3.0, "cv": 3.0, "requests": 14},
                  {"max_running": 4, "max_batched_tokens": 40}, cache={"capacity": "20%"},
                  policies={"eviction": "belady"})
    given = simulate(scenario_from_dict(copy.deepcopy(data)), trace=trace)
    own = simulate(scenario_from_dict(copy.deepcopy(data)))
    assert given.summary["future_exact"] is True
    assert given.steps["misses"].tolist() != own.steps["misses"].tolist()


def test_a_pass_codes_each_token_by_request_position_and_times_processed_before() -> None:
    """A pass's tokens: request 1 and 2 at positions 0 and 5, a request 2 token twice in the
    pass (two layers' rows), each code distinct; the same tokens in three passes (a preempted
    request processes them again) are coded with 0, 1 and 2 times before; each (token, expert)
    row reaches the access of its (layer, expert)."""
    from types import SimpleNamespace

    from moesim.simulator.served_future import Pass

    model = SimpleNamespace(num_experts=4)
    trace = SimpleNamespace(request=np.array([1, 2, 2, 1]), position=np.array([5, 0, 0, 0]),
                            layer=np.array([0, 0, 1, 0]), experts=np.array([[1, 3], [1, -1], [2, 0], [0, -1]]))
    wl = SimpleNamespace(model=model, trace=trace, keys=lambda: np.array([4, 0, 1, 3, 6], np.int64))
    times: dict[int, int] = {}
    codes = [Pass(wl, times).tokens for _ in range(3)]  # type: ignore[arg-type]
    base = [(1 << 32 | 0) << 8, (1 << 32 | 5) << 8, (2 << 32 | 0) << 8]
    assert [c.tolist() for c in codes] == [[b + n for b in base] for n in range(3)]
    one = Pass(wl, {})  # type: ignore[arg-type]
    keys = one.keys[one.pair_access].tolist()
    toks = one.tokens[one.pair_token].tolist()
    assert sorted(zip(toks, keys, strict=True)) == sorted([
        (base[1], 1), (base[1], 3), (base[2], 1), (base[2], 4 + 2), (base[2], 4 + 0), (base[0], 0)])


@pytest.mark.parametrize("seed", range(6))
def test_a_reference_schedule_gives_each_keys_next_access_by_a_token_still_to_come(seed: int) -> None:
    """``Reader.after``: once a run has processed a pass's tokens, each key's next access is
    the first, in the reference schedule's order, reached by a token the run has not processed,
    as a brute-force search over the (token, access) pairs finds it; the run processes the
    tokens in another order than the schedule (and some the schedule never saw). Where the run
    stands: the end of the latest reference pass that processed one of its pass's tokens. A
    second reader starts again. A schedule is the same as itself only."""
    from moesim.simulator.served_future import Pass, Reference

    rng = np.random.default_rng(seed)
    passes, pairs, pos0 = [], [], 0  # pairs: (position in the schedule, key, token)
    codes = iter(rng.permutation(40).astype(np.int64) * 8 + rng.integers(0, 2, 40))  # each token once
    for _ in range(8):
        keys = rng.choice(10, int(rng.integers(1, 6)), replace=False).astype(np.int64)
        tokens = np.sort([next(codes) for _ in range(int(rng.integers(1, 4)))]).astype(np.int64)
        rec = Pass.__new__(Pass)
        rec.keys, rec.tokens = keys, tokens
        rec.pair_access = rng.integers(0, len(keys), 6)
        rec.pair_token = rng.integers(0, len(tokens), 6)
        passes.append(rec)
        pairs += [(pos0 + int(a), int(keys[a]), int(tokens[t])) for a, t in zip(rec.pair_access, rec.pair_token, strict=True)]
        pos0 += len(keys)
    ref = Reference(passes, 10)
    ends = np.cumsum([len(q.keys) for q in passes])
    end_of = {int(t): int(ends[q]) for q, rec in enumerate(passes) for t in rec.tokens}
    run_order = [p.tokens for p in passes[::-1]] + [np.array([999 * 8], np.int64)]
    for _ in range(2):
        reader, done = ref.reader(), set()
        for toks in run_order:
            done |= set(toks.tolist())
            want = [min((pos for pos, k, t in pairs if k == key and t not in done), default=-1) for key in range(10)]
            got, stand = reader.after(toks)
            assert got.tolist() == want
            assert stand == max((end_of[t] for t in toks.tolist() if t in end_of), default=None)
    assert ref.same(passes)
    assert not ref.same(passes[::-1])
    for field in ("keys", "tokens"):  # a pass that differs in its accesses only, or its tokens only
        other = Pass.__new__(Pass)
        other.keys, other.tokens = passes[3].keys, passes[3].tokens
        setattr(other, field, getattr(passes[3], field) + 1)
        assert not ref.same([*passes[:3], other, *passes[4:]])


def test_under_expert_parallelism_each_gpu_holds_the_kv_of_its_share_of_the_tokens() -> None:
    """Four GPUs: each holds the dense weights, a quarter of the experts and KV in what is
    left; the KV tokens are four times those of one GPU whose expert cache is that quarter.
    With offload each holds its cache (10%) in place of its quarter."""
    trace = {"synth": {"preset": "olmoe-1b-7b", "requests": 2, "prompt_tokens": 4, "tokens": 2, "layers": 2}}
    one_gpu = served(trace, {"process": "poisson", "rate": 1.0, "requests": 2},
                     hardware={"preset": "h100-sxm-nvlink-x4", "gpus": 1}, cache={"capacity": "25%"})
    four = served(trace, {"process": "poisson", "rate": 1.0, "requests": 2},
                  hardware={"preset": "h100-sxm-nvlink-x4"})
    kv_one = simulate(scenario_from_dict(one_gpu)).summary["kv_capacity_tokens"]
    kv_four = simulate(scenario_from_dict(four)).summary["kv_capacity_tokens"]
    assert kv_one > 0
    assert kv_four == 4 * kv_one
    # with offload each GPU holds its own expert cache instead of its share
    cached = {"capacity": "10%"}
    one_cache = served(trace, {"process": "poisson", "rate": 1.0, "requests": 2},
                       hardware={"preset": "h100-sxm-nvlink-x4", "gpus": 1}, cache=cached)
    four_cache = served(trace, {"process": "poisson", "rate": 1.0, "requests": 2},
                        hardware={"preset": "h100-sxm-nvlink-x4"}, cache={**cached, "ep_offload": True})
    kv_cache = simulate(scenario_from_dict(one_cache)).summary["kv_capacity_tokens"]
    assert kv_cache > kv_one
    assert simulate(scenario_from_dict(four_cache)).summary["kv_capacity_tokens"] == 4 * kv_cache


def test_a_served_scenario_the_kernel_cannot_run_serves_on_the_simpy_path_and_says_why() -> None:
    """An eviction policy without a compiled form (random): under load it serves on the SimPy
    path, which says why."""
    data = served(TINY, {"process": "poisson", "rate": 1.0, "requests": 3}, policies={"eviction": "random"})
    s = simulate(scenario_from_dict(data)).summary
    assert (s["replay_path"], s["served_requests"]) == ("simpy", 3)
    assert s["replay_path_reason"] == "eviction policy 'random' has no kernel form"


@pytest.mark.parametrize(("budget", "name"), [
    ({"name": "moe-spec", "budget": 8, "ranking": "static"}, "moe-spec"), ("skip-threshold", "skip-threshold")])
def test_a_budget_calibrated_on_leading_passes_is_refused_under_load(budget: Any, name: str) -> None:
    data = served(MIXED, {"process": "poisson", "rate": 1.0, "requests": 2}, policies={"budget": budget})
    with pytest.raises(MoesimError) as err:
        simulate(scenario_from_dict(data, where="s.yaml"))
    assert str(err.value) == (
        f"s.yaml: key 'workload.arrivals': serving under load replays one forward pass at a time, which cannot run "
        f"budget '{name}' as configured (it calibrates on the trace's leading passes, which the scheduler forms as "
        "it goes); use a budget, or a ranking, that reads each pass alone. Change that, or remove "
        "workload.arrivals for the fixed-batch replay.")


@pytest.mark.parametrize(("eviction", "prefetch", "mode"), [
    ("lru", "previous-token", "layer"), ("least-stale", {"name": "lookahead", "depth": 2}, "per-expert")])
def test_a_request_served_alone_reads_its_last_pass_as_a_fixed_batch_reads_the_pass_before(
        eviction: str, prefetch: Any, mode: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Requests 5 s apart, each alone, served on the kernel: each pass's prefetcher reads its
    request's own last pass. The same passes replayed as one fixed workload on the SimPy path,
    each in its request's batch and with the passes' release times (the idle gaps, in which a
    pass's unused prefetch copies finish), read the pass before in the batch: every per-pass
    column bit for bit, and the prefetcher proposed (and mispredicted) in both."""
    from dataclasses import replace

    monkeypatch.setattr(serving.Scheduler, "KEEP", True)
    trace = {"synth": {"preset": "olmoe-1b-7b", "requests": 4, "prompt_tokens": 24, "tokens": 12, "layers": 6}}
    path = write_csv(tmp_path / "apart.csv", [(5 * n, 24, 13) for n in range(4)])
    data = served(trace, {"process": "file", "path": str(path)}, expert_compute=mode,
                  policies={"eviction": eviction, "prefetch": prefetch})
    res, kept = run_served(data)
    assert [len(np.unique(w.trace.request)) for w in kept] == [1] * len(kept)
    group = np.array([int(w.trace.request[0]) for w in kept])
    fixed = replace(joined(kept), pass_group=group, request_ids=np.arange(4), request_group=np.arange(4),
                    request_first_pass=np.searchsorted(group, np.arange(4)))
    plain = copy.deepcopy(data)
    del plain["workload"]["arrivals"]
    ref = Simulation(scenario_from_dict(plain), workload=fixed, record_decisions=True).run()
    assert ref.summary["replay_path"] == "simpy"
    for col in ("start_s", "end_s", "stall_s", "hits", "misses", "late_prefetches", "collision_misses",
                "bytes_h2d", "prefetches_issued", "prefetches_used", "prefetches_cancelled", "unique_experts"):
        assert ref.steps[col].tolist() == res.steps[col].tolist(), col
    assert res.steps["prefetches_issued"].sum() > res.steps["prefetches_used"].sum() > 0


@pytest.mark.parametrize("prefetch", ["previous-token", {"name": "lookahead", "depth": 3}])
def test_a_served_pass_reads_each_requests_own_last_pass(prefetch: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under load (chunked prompts, queues, preemption) a prefetcher that reads the pass before
    proposes, at each served pass, the experts its requests' own last passes routed: for each
    request of the pass, the latest earlier pass whose tokens of that request end right before
    this pass's first token of it (none after a preemption's restart or for a first chunk),
    found here from the schedule (the passes kept) alone. The compiled proposals the kernel read
    are the reference ``propose``'s."""
    monkeypatch.setattr(serving.Scheduler, "KEEP", True)
    trace = {"synth": {"preset": "olmoe-1b-7b", "requests": 6, "prompt_tokens": 16, "tokens": 6, "layers": 4}}
    data = served(trace, {"process": "gamma", "rate": 4.0, "cv": 3.0, "requests": 14},
                  {"max_running": 4, "max_batched_tokens": 24, "chunked_prefill_tokens": 10, "kv_memory": "3MB",
                   "kv_block_tokens": 4}, policies={"prefetch": prefetch})
    sim = Simulation(scenario_from_dict(data))
    res = sim.run()
    assert res.summary["replay_path"] == "kernel"
    assert sim.source.serving is not None
    assert sim.source.serving.kept is not None
    assert res.requests["preemptions"].sum() > 0
    kept = sim.source.serving.kept
    ahead = 1 if prefetch == "previous-token" else 3
    layers = sim.model.num_layers
    pol = sim.prefetch
    firsts, after_restart = 0, 0
    for p, wl in enumerate(kept):
        tr = wl.trace
        want: dict[int, set[int]] = {layer: set() for layer in range(layers)}
        for r in np.unique(tr.request):
            here = tr.position[tr.request == r].min()
            src = None
            for q in range(p - 1, -1, -1):
                mine = kept[q].trace.request == r
                if mine.any():
                    if kept[q].trace.position[mine].max() == here - 1:
                        src = (kept[q].trace, mine)
                    break
            if src is None:
                firsts += 1
                after_restart += bool(any((kept[q].trace.request == r).any() for q in range(p)))
                continue
            t, mine = src
            for layer in range(layers):
                for nxt in range(layer + 1, min(layer + 1 + ahead, layers)):
                    rows = mine & (t.layer == nxt)
                    want[layer] |= {(nxt * 64 + int(e)) * len(pol.ctx.precisions) + pol.ctx.default_precision
                                    for e in t.experts[rows].ravel()}
        pol.ctx.workload = wl
        off, keys = pol.proposals(0, 1)
        for layer in range(layers):
            got = pol.propose(0, layer)
            assert set(got) == want[layer], (p, layer)
            assert keys[off[layer]:off[layer + 1]].tolist() == list(got)
    assert firsts > 0
    assert after_restart > 0  # a preempted request's recompute reads no pass before it


# -- arrivals ------------------------------------------------------------------------------------
def bank() -> serving.Bank:
    return serving.Bank(hand_trace(), "test")


@pytest.mark.parametrize(("process", "cv"), [("poisson", 1.0), ("gamma", 0.5), ("gamma", 2.5)])
def test_arrival_processes(process: str, cv: float) -> None:
    """Gaps of mean 1/rate and the asked coefficient of variation (50,000 gaps: within 3%);
    the seed decides them, the scenario's or the arrivals' own."""
    cfg = ArrivalsConfig(process=process, rate=8.0, cv=cv, requests=50_000)  # type: ignore[arg-type]
    plan = serving.plan_requests(cfg, bank(), 1, ".")
    gaps = np.diff(np.r_[0.0, plan.arrival])
    assert abs(gaps.mean() * 8 - 1) < 0.03
    assert abs(gaps.std() / gaps.mean() / cv - 1) < 0.03
    again = serving.plan_requests(cfg, bank(), 1, ".")
    assert np.array_equal(again.arrival, plan.arrival)
    other = serving.plan_requests(cfg, bank(), 2, ".")
    assert not np.array_equal(other.arrival, plan.arrival)
    own = ArrivalsConfig(process=process, rate=8.0, cv=cv, requests=50_000, seed=1)  # type: ignore[arg-type]
    assert np.array_equal(serving.plan_requests(own, bank(), 7, ".").arrival, plan.arrival)


def test_lengths_cut_and_extended() -> None:
    """Recorded lengths by default (prompt 4, 1 + 4 decode steps); asked lengths cut or
    repeat the recorded tokens in order, and the notes say so; requests cycle over the
    recorded ones."""
    b = bank()
    plan = serving.plan_requests(ArrivalsConfig(process="poisson", rate=1.0, requests=7), b, 0, ".")
    assert plan.prompt.tolist() == [4] * 7
    assert plan.output.tolist() == [5] * 7
    assert plan.source.tolist() == [0, 1, 2, 0, 1, 2, 0]
    assert any("cycling" in n for n in plan.notes)
    longer = serving.plan_requests(ArrivalsConfig(process="poisson", rate=1.0, requests=2, prompt_tokens=6,
                                                  output_tokens=9), b, 0, ".")
    assert any("longer prompt" in n for n in longer.notes)
    assert any("more output" in n for n in longer.notes)
    # token i of a request with a 6-token prompt: prompt tokens 0..3 then 0, 1; decode steps 1, 2, 3, 4, 1, ...
    src = np.zeros(14, np.int64)
    tok = b.tokens(src, np.full(14, 6), np.arange(14))
    rows = b.rows(tok)
    t = b.trace
    firsts = rows[::2]  # two layers per token
    assert t.position[firsts].tolist() == [0, 1, 2, 3, 0, 1, 4, 5, 6, 7, 4, 5, 6, 7]
    assert (t.layer[rows].reshape(-1, 2) == [0, 1]).all()


def test_arrival_file_columns_and_rate(tmp_path: Path) -> None:
    """An Azure-style file (date-time TIMESTAMP, ContextTokens, GeneratedTokens): times from
    the first row, the columns named in the notes; a rate rescales the times to that mean."""
    path = tmp_path / "azure.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:15:46.6805900,4,2\n2023-11-16 18:15:47.1805900,3,5\n"
                    "2023-11-16 18:15:48.6805900,6,1\n")
    cfg = ArrivalsConfig(process="file", path=str(path))
    plan = serving.plan_requests(cfg, bank(), 0, ".")
    np.testing.assert_allclose(plan.arrival, [0.0, 0.5, 2.0])
    assert plan.prompt.tolist() == [4, 3, 6]
    assert plan.output.tolist() == [2, 5, 1]
    assert "'TIMESTAMP'" in plan.notes[0]
    assert "'ContextTokens'" in plan.notes[0]
    fast = serving.plan_requests(ArrivalsConfig(process="file", path=str(path), rate=4.0), bank(), 0, ".")
    np.testing.assert_allclose(fast.arrival, [0.0, 0.125, 0.5])
    ms = write_csv(tmp_path / "ms.csv", [(1000, 2, 2), (1500, 2, 2)], header="timestamp_ms,input_len,output_len")
    assert serving.plan_requests(ArrivalsConfig(process="file", path=str(ms)), bank(), 0, ".").arrival.tolist() == [0, 0.5]


# -- the figures -------------------------------------------------------------------------------
def test_summary_figures_from_the_table() -> None:
    """The summary's percentiles, throughput and SLO figures recomputed from the per-request
    table with pandas (its own quantile), and the attainment counted by hand."""
    data = served(TINY, {"process": "poisson", "rate": 200.0, "requests": 30},
                  {"max_running": 4, "max_batched_tokens": 64}, slo={"ttft_s": 0.02, "tpot_s": 0.004})
    res = simulate(scenario_from_dict(data))
    req, s = res.requests, res.summary
    for col in ("ttft", "tpot"):
        assert s[f"{col}_p50_s"] == pytest.approx(req[f"{col}_s"].quantile(0.5), rel=1e-12)
        assert s[f"{col}_p99_s"] == pytest.approx(req[f"{col}_s"].quantile(0.99), rel=1e-12)
        assert s[f"{col}_mean_s"] == pytest.approx(req[f"{col}_s"].mean(), rel=1e-12)
    assert s["e2e_p99_s"] == pytest.approx(req["e2e_s"].quantile(0.99), rel=1e-12)
    span = req["finish_s"].max() - req["arrival_s"].min()
    assert s["throughput_tokens_s"] == pytest.approx(req["output_tokens"].sum() / span)
    assert s["requests_per_s"] == pytest.approx(30 / span)
    ok = sum(1 for t, p in zip(req["ttft_s"], req["tpot_s"], strict=True) if t <= 0.02 and p <= 0.004)
    assert 0 < ok < 30  # the SLO splits the requests
    assert s["slo_attainment"] == ok / 30
    assert s["goodput_requests_s"] == pytest.approx(ok / span)
    assert (req["e2e_s"] >= req["ttft_s"]).all()
    assert (req["ttft_s"] >= req["queue_s"]).all()
    assert s["max_running_seen"] <= 4
    # same scenario, same results; another seed, other arrivals
    again = simulate(scenario_from_dict(data))
    pd.testing.assert_frame_equal(again.requests, req)
    pd.testing.assert_frame_equal(again.steps, res.steps)
    other = simulate(scenario_from_dict({**data, "seed": 1}))
    assert not np.array_equal(other.requests["arrival_s"], req["arrival_s"])


def test_paged_kv_admits_by_the_blocks_held_and_preempts_the_last_admitted(tmp_path: Path) -> None:
    """15 one-token blocks, three requests of 4 + 3 at once: each holds the blocks of the tokens
    it has processed, so all three run together (a reservation of the whole 7-token context
    would admit two); when A's third token needs a block none is free, C (admitted last) is
    preempted, and it recomputes its prompt and two outputs (6 tokens) when A and B are done."""
    from moesim.traces.schema import ModelInfo

    b = bank()
    m: ModelInfo = b.trace.model
    per_token = 2 * m.num_layers * m.kv_heads * m.head_size * 2
    path = write_csv(tmp_path / "three.csv", [(0, 4, 3), (0, 4, 3), (0, 4, 3)])
    data = served(TINY, {"process": "file", "path": str(path)},
                  {"max_running": 3, "max_batched_tokens": 64, "kv_memory": f"{per_token * 15}B",
                   "kv_block_tokens": 1})
    res = simulate(scenario_from_dict(data))
    assert res.summary["kv_capacity_tokens"] == 15
    assert res.steps["requests"].tolist() == [3, 3, 2, 1]
    assert res.steps["tokens"].tolist() == [12, 3, 2, 6]
    assert res.summary["max_running_seen"] == 3
    end = res.steps["end_s"].to_numpy()
    assert res.requests["finish_s"].tolist() == [end[2], end[2], end[3]]
    assert res.requests["first_token_s"].tolist() == [end[0]] * 3
    assert res.requests["preemptions"].tolist() == [0, 0, 1]
    assert res.requests["recomputed_tokens"].tolist() == [0, 0, 5]
    assert res.requests["itl_max_s"].iloc[2] == end[3] - end[1]  # its third token waited for the recompute


# -- bad input -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("change", "words"), [
    ({"scheduler": {"max_running": 2}, "drop_arrivals": True}, "scheduler' is for serving"),
    ({"workload.batch_size": 4}, "workload.batch_size"),
    ({"policies": {"prefetch": "static-pin"}}, "static-pin"),
    ({"scheduler": {"max_running": 8, "max_batched_tokens": 4, "policy": "sarathi"}}, "at least max_running"),
    ({"scheduler": {"max_running": 8, "max_batched_tokens": 4}}, "a token of every running request in one pass"),
    ({"scheduler": {"max_running": 2, "max_batched_tokens": 3, "policy": "vllm-v0"}},
     "more than scheduler.max_batched_tokens"),
    ({"scheduler": {"policy": "vllm-v0", "chunked_prefill_tokens": 4}}, "vllm-v0 prefills whole prompts"),
    ({"scheduler": {"kv_watermark": 1.0}}, "kv_watermark is a share of the KV blocks in [0, 1)"),
    ({"scheduler": {"kv_block_tokens": 0}}, "kv_block_tokens must be >= 1"),
    ({"scheduler": {"policy": "chunked"}}, "vllm-v1, vllm-v0, sarathi"),
    ({"scheduler": {"kv_memory": "1KB"}}, "less than one token"),
    ({"cache": {"capacity": "inf"}}, "cache.capacity is infinite"),
    ({"timing": False}, "timing: true"),
    ({"arrivals": {"process": "poisson", "rate": 2.0}}, "needs 'requests'"),
    ({"arrivals": {"process": "poisson", "requests": 2, "rate": -1.0}}, "positive"),
    ({"arrivals": {"process": "poisson", "requests": 2, "rate": 1.0, "cv": 2.0}}, "cv is for process 'gamma'"),
    ({"slo": {"attainment": 0.9}}, "give ttft_s, tpot_s, itl_s or several"),
    ({"slo": {"itl_s": 0.0}}, "itl_s must be a positive number of seconds"),
])
def test_bad_serving_input(change: dict[str, Any], words: str) -> None:
    """Impossible scheduler limits and mismatched keys: one error naming the key and the fix."""
    data = served(TINY, {"process": "poisson", "rate": 5.0, "requests": 3})
    change = dict(change)
    if change.pop("drop_arrivals", False):
        del data["workload"]["arrivals"]
    if "workload.batch_size" in change:
        data["workload"]["batch_size"] = change.pop("workload.batch_size")
    if "arrivals" in change:
        data["workload"]["arrivals"] = change.pop("arrivals")
    data.update(change)
    with pytest.raises(MoesimError) as err:
        simulate(scenario_from_dict(data, where="s.yaml"))
    assert words in str(err.value)
    assert "\n" not in str(err.value).strip()


@pytest.mark.parametrize(("text", "words"), [
    ("when,input_tokens,output_tokens\n0,2,2\n", "no column for the arrival time"),
    ("arrival_time,input_tokens,output_tokens\n0,2,2\n1,-2,2\n", "line 3 (data row 2) has input_tokens = -2"),
    ("arrival_time,input_tokens,output_tokens\n0,2,0\n1,2,0\n", "every one of its 2 rows has output_tokens = 0"),
    ("arrival_time,input_tokens,output_tokens\n2,2,2\n1,2,2\n", "arrival order"),
    ("arrival_time,input_tokens,output_tokens\n", "has no rows"),
])
def test_bad_arrival_file_cli(text: str, words: str, tmp_path: Path) -> None:
    """A broken arrival file: one paragraph naming the file, the column or row and the fix,
    no traceback, nothing written."""
    path = tmp_path / "a.csv"
    path.write_text(text)
    sc = tmp_path / "s.yaml"
    sc.write_text(json.dumps(served(TINY, {"process": "file", "path": "a.csv"})))
    out = tmp_path / "out"
    r = CliRunner().invoke(cli, ["run", str(sc), "--out", str(out), "-q"])
    assert r.exit_code == 2, r.output
    assert words in unwrap(r.output)
    assert str(path) in unwrap(r.output).replace("\n", "")
    assert "Traceback" not in unwrap(r.output)
    assert not out.exists()


def test_zero_output_rows_skipped_and_counted(tmp_path: Path) -> None:
    """A BurstGPT-shaped file whose failed requests record 0 response tokens: by default those
    rows are skipped, the run says how many, and the requests served are the others with
    their own times, prompts and outputs (``requests`` counts rows kept); with
    ``skip_zero_output: false`` the first such row is refused by line, naming the key."""
    path = write_csv(tmp_path / "a.csv", [(0, 3, 0), (1, 5, 2), (2, 4, 0), (3, 6, 1), (5, 2, 0), (6, 1, 3)],
                     header="Timestamp,Request tokens,Response tokens")
    t, prompt, output, found = serving.read_arrival_file(path, None)
    assert t.tolist() == [0.0, 2.0, 5.0]  # rows 2, 4 and 6, from the first kept
    assert prompt.tolist() == [5, 6, 1]
    assert output.tolist() == [2, 1, 3]
    assert found.endswith("; skipped 3 rows with 0 output tokens (failed requests; "
                          "workload.arrivals.skip_zero_output: false refuses them)")
    t, prompt, _, found = serving.read_arrival_file(path, 2)
    assert t.tolist() == [0.0, 2.0]
    assert prompt.tolist() == [5, 6]
    one = write_csv(tmp_path / "b.csv", [(0, 3, 1), (1, 5, 0)])
    assert serving.read_arrival_file(one, None)[3].endswith("; skipped 1 row with 0 output tokens (failed "
                                                            "requests; workload.arrivals.skip_zero_output: false "
                                                            "refuses them)")
    assert "skipped" not in serving.read_arrival_file(write_csv(tmp_path / "c.csv", [(0, 3, 1)]), None)[3]
    with pytest.raises(MoesimError) as err:
        serving.read_arrival_file(path, None, skip_zero_output=False)
    assert str(err.value) == (f"arrival file {path}: line 2 (data row 1) has Response tokens = 0; it must be a whole "
                              "number of tokens >= 1. Fix or remove that row, or remove "
                              "workload.arrivals.skip_zero_output: false to skip every row of 0 output tokens "
                              "(failed requests).")
    # a bad row after skipped ones is named by its line in the file
    late = write_csv(tmp_path / "d.csv", [(0, 3, 0), (1, 5, 2), (2, -4, 1)])
    with pytest.raises(MoesimError) as err:
        serving.read_arrival_file(late, None)
    assert "line 4 (data row 3) has input_tokens = -4" in str(err.value)
    sc = tmp_path / "s.yaml"
    sc.write_text(json.dumps(served(TINY, {"process": "file", "path": "a.csv"})))
    out = tmp_path / "out"
    r = CliRunner().invoke(cli, ["run", str(sc), "--out", str(out)])
    assert r.exit_code == 0, r.output
    notes = json.loads((out / "summary.json").read_text())["arrival_notes"]
    assert any(n.endswith("skipped 3 rows with 0 output tokens (failed requests; workload.arrivals.skip_zero_output: "
                          "false refuses them)") for n in notes)
    assert "skipped 3 rows" in " ".join(r.output.replace("│", " ").split())
    req = pd.read_parquet(out / "requests.parquet")
    assert req["arrival_s"].tolist() == [0.0, 2.0, 5.0]
    assert req["output_tokens"].tolist() == [2, 1, 3]
    sc.write_text(json.dumps(served(TINY, {"process": "file", "path": "a.csv", "skip_zero_output": False})))
    r = CliRunner().invoke(cli, ["run", str(sc), "--out", str(tmp_path / "o2"), "-q"])
    assert r.exit_code == 2
    assert "line 2 (data row 1) has Response tokens = 0" in " ".join(r.output.split())
    assert not (tmp_path / "o2").exists()


def test_cli_run_writes_the_request_table(tmp_path: Path) -> None:
    """``moesim run`` on a serving scenario: requests.parquet (one row per request) beside
    steps.parquet, the serving figures in summary.json and the table."""
    sc = tmp_path / "s.yaml"
    sc.write_text(json.dumps(served(TINY, {"process": "poisson", "rate": 50.0, "requests": 9},
                                    {"max_running": 4}, slo={"ttft_s": 0.05})))
    out = tmp_path / "out"
    r = CliRunner().invoke(cli, ["run", str(sc), "--out", str(out), "-q"])
    assert r.exit_code == 0, r.output
    req = pd.read_parquet(out / "requests.parquet")
    assert len(req) == 9
    assert {"ttft_s", "tpot_s", "queue_s", "e2e_s"} <= set(req.columns)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["served_requests"] == 9
    assert 0 <= summary["slo_attainment"] <= 1
    assert "ttft_p99_s" in unwrap(r.output)
    assert "requests_per_s" in unwrap(r.output)
    resolved = (out / "scenario.resolved.yaml").read_text()
    assert "arrivals:" in resolved
    assert "scheduler:" in resolved


def test_no_arrivals_resolves_as_before() -> None:
    """Without arrivals the resolved scenario has no serving keys (fingerprints unchanged)."""
    d = scenario_from_dict({"workload": {"trace": TINY}}).to_dict()
    assert "arrivals" not in d["workload"]
    assert "scheduler" not in d
    assert "slo" not in d
    with pytest.raises(ConfigError, match="slo"):
        scenario_from_dict({"workload": {"trace": TINY}, "slo": {"ttft_s": 1.0}})


# -- compare under load ----------------------------------------------------------------------------
def test_compare_rate_needs_arrivals(tmp_path: Path) -> None:
    """--rate on a fixed-batch scenario, or a budget serving cannot run under load: one paragraph."""
    r = CliRunner().invoke(cli, ["compare", "quickstart", "--rate", "1,2", "--out", str(tmp_path / "x")])
    assert r.exit_code == 2
    assert "workload.arrivals" in unwrap(r.output)
    assert "Traceback" not in unwrap(r.output)
    sc = tmp_path / "s.yaml"
    sc.write_text(json.dumps(served(TINY, {"process": "poisson", "rate": 4.0, "requests": 5})))
    r = CliRunner().invoke(cli, ["compare", str(sc), "--budget", "none,skip-threshold", "--out", str(tmp_path / "y")])
    assert r.exit_code == 2
    assert "--budget skip-threshold: serving under load replays one forward pass at a time, which cannot run budget " \
           "'skip-threshold' as configured (it calibrates on the trace's leading passes" in unwrap(r.output)
    assert not (tmp_path / "y").exists()


def test_arrival_file_in_the_fingerprint(tmp_path: Path) -> None:
    """A sweep point reruns when its arrival file changes (the file's content is an input)."""
    from moesim.studies import fingerprint

    path = write_csv(tmp_path / "a.csv", [(0, 4, 2), (1, 4, 2)])
    sc = scenario_from_dict(served(TINY, {"process": "file", "path": "a.csv"}), base_dir=str(tmp_path))
    before = fingerprint.scenario_fingerprint(sc)
    write_csv(path, [(0, 4, 2), (2, 4, 2)])
    assert fingerprint.scenario_fingerprint(sc) != before


def test_timeline_shows_requests(tmp_path: Path) -> None:
    """``moesim run --events`` when serving: the replay records on the SimPy path (the same
    rows as without a timeline); the timeline holds the compute stream's layers and the copy
    engine's copies, the passes on the GPU's forward-pass track and each request's queueing,
    prefill and decode on its own track, at the per-pass and per-request tables' times."""
    path = write_csv(tmp_path / "three.csv", [(0, 4, 3), (0, 2, 2), (0, 3, 2)])
    sc = tmp_path / "s.yaml"
    sc.write_text(json.dumps(served(TINY, {"process": "file", "path": str(path)},
                                    {"max_running": 2, "max_batched_tokens": 16})))
    ev = tmp_path / "t.json"
    out = tmp_path / "out"
    r = CliRunner().invoke(cli, ["run", str(sc), "--events", str(ev), "--events-passes", "0", "--out", str(out), "-q"])
    assert r.exit_code == 0, r.output
    doc = json.loads(ev.read_text())["traceEvents"]
    steps = pd.read_parquet(out / "steps.parquet")
    req = pd.read_parquet(out / "requests.parquet")
    plain = simulate(scenario_from_dict(json.loads(sc.read_text())))
    assert plain.summary["replay_path"] == "kernel"
    pd.testing.assert_frame_equal(steps, plain.steps, check_exact=True)
    passes = [e for e in doc if e["ph"] == "X" and e["pid"] == 0 and e["tid"] == 2]
    assert [e["name"] for e in passes] == ["prefill", "decode", "prefill", "decode"]
    assert [e["ts"] for e in passes] == (steps["start_s"] * 1e6).tolist()
    experts = [e for e in doc if e["ph"] == "X" and e["pid"] == 0 and e["tid"] == 0 and e["name"].endswith("experts")]
    assert sorted({e["args"]["pass"] for e in experts}) == [0, 1, 2, 3]  # numbered over the run, not per pass
    end = steps["end_s"].to_numpy() * 1e6
    for e in experts:
        assert e["ts"] + e["dur"] <= end[e["args"]["pass"]] * (1 + 1e-12)
    copies = [e for e in doc if e["ph"] == "X" and e["pid"] == 0 and e["tid"] == 1]
    assert len(copies) == int(steps["misses"].sum())  # on-demand LRU: a copy per miss
    c = {e["name"]: e for e in doc if e["ph"] == "X" and e["pid"] == 1 and e["tid"] == 2}
    assert set(c) == {"queued", "prefill", "decode"}  # the third request waits for a place
    assert c["queued"]["ts"] == 0
    assert c["queued"]["dur"] == pytest.approx(req["scheduled_s"].iloc[2] * 1e6)
    assert c["decode"]["ts"] + c["decode"]["dur"] == pytest.approx(req["finish_s"].iloc[2] * 1e6)


def test_synthetic_trace_made_with_the_arrivals_lengths(tmp_path: Path) -> None:
    """A synthetic trace shorter than the arrivals ask is made again with their longest
    prompt and decode lengths (routing synthesised, not repeated; the notes say so); a trace
    file's recorded tokens repeat instead."""
    short = {"synth": {"preset": "olmoe-1b-7b", "requests": 2, "prompt_tokens": 4, "tokens": 2, "layers": 2}}
    res = simulate(scenario_from_dict(served(short, {"process": "poisson", "rate": 5.0, "requests": 3,
                                                     "prompt_tokens": 10, "output_tokens": 6})))
    notes = res.summary["arrival_notes"]
    assert any("made with 10 prompt and 5 decode tokens" in n for n in notes)
    assert not any("repeats" in n for n in notes)
    assert res.requests["output_tokens"].tolist() == [6, 6, 6]
    assert int(res.steps["tokens"].sum()) == 3 * (10 + 5)
    from moesim.simulator.build import load_trace
    from moesim.traces.io import write_trace

    path = tmp_path / "t.parquet"
    write_trace(load_trace(scenario_from_dict({"workload": {"trace": short}})), path)
    res = simulate(scenario_from_dict(served({"path": str(path)}, {"process": "poisson", "rate": 5.0,
                                                                  "requests": 3, "prompt_tokens": 10,
                                                                  "output_tokens": 6})))
    notes = res.summary["arrival_notes"]
    assert any("longer prompt" in n for n in notes)
    assert any("more output" in n for n in notes)
    # the decode tokens a request needs: output - 1 after a prompt, output without one
    for asked, made in (({"prompt_tokens": 0, "output_tokens": 6}, "4 prompt and 6 decode"),
                        ({"prompt_tokens": 1, "output_tokens": 6}, "4 prompt and 5 decode"),
                        ({"prompt_tokens": 2, "output_tokens": 6}, "4 prompt and 5 decode")):
        res = simulate(scenario_from_dict(served(short, {"process": "poisson", "rate": 5.0, "requests": 2, **asked})))
        assert any(f"made with {made} tokens" in n for n in res.summary["arrival_notes"]), asked
    for prompt_tokens in (3, 4):  # it fits (4: the recorded prompt's length exactly)
        res = simulate(scenario_from_dict(served(short, {"process": "poisson", "rate": 5.0, "requests": 2,
                                                         "prompt_tokens": prompt_tokens, "output_tokens": 3})))
        assert not any("made with" in n or "repeat" in n for n in res.summary["arrival_notes"])


@pytest.mark.parametrize(("limit", "made"), [(60, True), (59, False)])
def test_synthetic_trace_made_longer_within_a_size(limit: int, made: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The longer synthetic trace holds requests x (prompt + decode tokens) x layers rows
    (here 2 x (10 + 5) x 2 = 60); above the limit the recorded tokens repeat instead. A preset
    without a layer override counts the preset's layers (OLMoE: 16)."""
    monkeypatch.setattr(serving, "SYNTH_ROWS_MAX", limit)
    short = {"synth": {"preset": "olmoe-1b-7b", "requests": 2, "prompt_tokens": 4, "tokens": 2, "layers": 2}}
    res = simulate(scenario_from_dict(served(short, {"process": "poisson", "rate": 5.0, "requests": 2,
                                                     "prompt_tokens": 10, "output_tokens": 6})))
    notes = res.summary["arrival_notes"]
    assert any("made with 10 prompt and 5 decode" in n for n in notes) == made
    assert any("repeats" in n for n in notes) != made
    monkeypatch.setattr(serving, "SYNTH_ROWS_MAX", 2 * 15 * 16 if made else 2 * 15 * 16 - 1)
    preset = {"synth": {"preset": "olmoe-1b-7b", "requests": 2, "prompt_tokens": 4, "tokens": 2}}
    res = simulate(scenario_from_dict(served(preset, {"process": "poisson", "rate": 5.0, "requests": 2,
                                                      "prompt_tokens": 10, "output_tokens": 6})))
    assert any("made with 10 prompt" in n for n in res.summary["arrival_notes"]) == made


def test_sweep_takes_the_rate_as_an_axis(tmp_path: Path) -> None:
    """``moesim sweep --grid workload.arrivals.rate=...``: one point per rate, its serving
    figures in results.parquet, and more load never lowers p99 TTFT here."""
    sc = tmp_path / "s.yaml"
    sc.write_text(json.dumps(served(TINY, {"process": "poisson", "rate": 1.0, "requests": 12}, {"max_running": 2})))
    out = tmp_path / "sw"
    r = CliRunner().invoke(cli, ["sweep", str(sc), "--grid", "workload.arrivals.rate=1,100", "--out", str(out),
                                 "--workers", "1"])
    assert r.exit_code == 0, r.output
    res = pd.read_parquet(out / "results.parquet").sort_values("workload.arrivals.rate")
    assert res["workload.arrivals.rate"].tolist() == [1, 100]
    assert res["ttft_p99_s"].iloc[1] > res["ttft_p99_s"].iloc[0]


# -- properties over random loads -------------------------------------------------------------
@st.composite
def loads(draw: Any) -> dict[str, Any]:
    n = draw(st.integers(1, 7))
    rows = [(draw(st.sampled_from([0.0, 0.0, 0.01, 0.05, 0.3, 2.0])), draw(st.integers(0, 6)), draw(st.integers(1, 6)))
            for _ in range(n)]
    policy = draw(st.sampled_from(["vllm-v0", "sarathi", "vllm-v1"]))
    running = draw(st.integers(1, 4))
    if policy != "vllm-v0":
        sched = {"policy": policy, "max_running": running,
                 "max_batched_tokens": draw(st.integers(running, running + 8)),
                 "chunked_prefill_tokens": draw(st.sampled_from([None, 1, 2, 5]))}
    else:
        sched = {"policy": policy, "max_running": running,  # a decode pass holds every running request
                 "max_batched_tokens": draw(st.integers(max(running, *(max(p, 1) for _, p, _ in rows)), 14))}
    if sched.get("chunked_prefill_tokens") is None:
        sched.pop("chunked_prefill_tokens", None)
    kv = draw(st.sampled_from([None, 12, 12, 16]))  # tokens of KV: a request needs at most 11
    if kv is not None:
        sched.update(kv_memory=f"{kv * TINY_KV}B", kv_block_tokens=draw(st.sampled_from([1, 2, 4])))
        if policy == "vllm-v0":  # a recompute is one pass: vLLM V0 needs max_model_len in the budget
            sched["max_batched_tokens"] = max(sched["max_batched_tokens"], 12)
    return {"rows": rows, "scheduler": sched, "eviction": draw(st.sampled_from(["lru", "least-stale", "lfu"])),
            "prefetch": draw(st.sampled_from(["none", "oracle"])),
            "mode": draw(st.sampled_from(["layer", "per-expert", "on-arrival"])),
            "capacity": draw(st.sampled_from(["10%", "40%"]))}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(load=loads())
def test_schedules_keep_their_limits_and_replay_as_simpy(load: dict[str, Any], tmp_path_factory: Any,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Any small load, with and without KV pressure: every request is served in full (its
    prompt, or one decode token, then one decode token per further output token, and again
    the tokens a preemption threw away); no pass holds more than max_batched_tokens tokens or
    max_running requests, nor a prompt chunk above chunked_prefill_tokens; the KV blocks the
    requests of a pass hold never exceed the cache; with vllm-v0 a pass prefills or decodes,
    never both; first admission is first come, first served; times are in order; and the
    kernel's closed loop equals the SimPy path's open-loop replay of its schedule, bit for bit."""
    monkeypatch.setattr(serving.Scheduler, "KEEP", True)
    t, rows = 0.0, []
    for gap, p, o in load["rows"]:
        t += gap
        rows.append((round(t, 6), p, o))
    path = write_csv(tmp_path_factory.mktemp("load") / "a.csv", rows)
    sched = load["scheduler"]
    data = served(TINY, {"process": "file", "path": str(path)}, sched, expert_compute=load["mode"],
                  cache={"capacity": load["capacity"]},
                  policies={"eviction": load["eviction"], "prefetch": load["prefetch"]})
    sim = Simulation(scenario_from_dict(data))
    res = sim.run()
    req = res.requests
    assert sim.source.serving is not None
    assert sim.source.serving.kept is not None
    prompt = np.array([p for _, p, _ in rows])
    output = np.array([o for _, _, o in rows])
    done = np.zeros(len(rows), np.int64)
    for wl in sim.source.serving.kept:
        tr = wl.trace
        assert tr is not None
        toks = pd.DataFrame({"r": tr.request, "pos": tr.position, "ph": tr.phase}).drop_duplicates(["r", "pos"])
        assert len(toks) <= sched["max_batched_tokens"]
        assert toks["r"].nunique() <= sched["max_running"]
        per = toks.groupby("r").size()
        if sched["policy"] == "vllm-v0":  # all (re)admitted, from their first position, or all decoding
            first = toks.groupby("r")["pos"].min()
            assert (first == 0).all() or ((per == 1).all() and (first > 0).all())
        for r, c in per.items():
            done[r] += c
        if "kv_memory" in sched:  # the blocks of the positions each request reached, within the cache
            block = sched["kv_block_tokens"]
            reached = toks.groupby("r")["pos"].max() + 1
            assert int((-(-reached // block)).sum()) <= int(sched["kv_memory"][:-1]) // TINY_KV // block
        pre = toks[toks["ph"] == 0].groupby("r").size()
        if sched.get("chunked_prefill_tokens"):
            assert (pre <= sched["chunked_prefill_tokens"]).all()
    assert done.tolist() == (np.maximum(prompt, 1) + output - 1 + req["recomputed_tokens"].to_numpy()).tolist()
    assert (req["recomputed_tokens"] > 0).tolist() == (req["preemptions"] > 0).tolist()
    assert int(res.steps["generated"].sum()) == int(output.sum())
    assert (np.diff(req["scheduled_s"]) >= 0).all()  # first come, first served
    assert (req["scheduled_s"] >= req["arrival_s"]).all()
    assert (req["first_token_s"] > req["scheduled_s"]).all()
    assert (req["finish_s"] >= req["first_token_s"]).all()
    assert res.summary["max_running_seen"] <= sched["max_running"]
    plain = copy.deepcopy(data)
    del plain["workload"]["arrivals"], plain["scheduler"]
    ref = Simulation(scenario_from_dict(plain), workload=joined(sim.source.serving.kept), record_decisions=True).run()
    for col in ("start_s", "end_s", "stall_s", "hits", "misses", "late_prefetches", "bytes_h2d", "prefetches_issued"):
        assert ref.steps[col].tolist() == res.steps[col].tolist(), col


def test_plot_labels_the_serving_figures() -> None:
    """A sweep's serving columns and the rate axis carry their units on a figure's axes (a
    rate is not a time)."""
    from moesim.output.plots import AXIS_LABELS, metric_label

    assert metric_label("ttft_p99_s") == ("p99 TTFT (ms)", 1e3)
    assert metric_label("requests_per_s")[0] == "served (requests/s)"
    assert metric_label("goodput_requests_s")[0].startswith("goodput (requests/s")
    assert AXIS_LABELS["workload.arrivals.rate"] == "offered load (requests/s)"


def test_summary_by_hand() -> None:
    """``serving.summary`` on a request table made by hand: means, numpy's linear percentiles
    (worked out: p99 of five values is the fourth plus 0.96 of the gap to the fifth), rates
    over the span from the first arrival to the last finish, the offered rate over the
    arrivals' span, the inter-token gaps' percentiles (ten gaps: p50 between the fifth and sixth,
    p99 the ninth plus 0.91 of the gap to the tenth), and SLO attainment with each limit alone
    and both, ties meeting it."""
    from moesim.config.scenario import SloConfig

    nan = float("nan")
    req = pd.DataFrame({
        "arrival_s": [0.0, 1.0, 2.0, 4.0, 8.0], "ttft_s": [0.5, 1.0, 1.5, 2.0, 3.0],
        "tpot_s": [0.1, nan, 0.3, 0.2, 0.5], "e2e_s": [1.0, 2.0, 3.0, 4.0, 10.0],
        "queue_s": [0.0, 0.5, 1.0, 1.5, 2.0], "finish_s": [1.0, 3.0, 5.0, 8.0, 18.0],
        "output_tokens": [3, 1, 2, 4, 5], "itl_max_s": [0.2, nan, 0.3, 0.2, 0.6],
        "preemptions": [0, 0, 1, 0, 2], "recomputed_tokens": [0, 0, 5, 0, 7]})
    gaps = np.array([0.1, 0.2, 0.3, 0.1, 0.2, 0.2, 0.5, 0.4, 0.6, 0.1])  # 2, 0, 1, 3 and 4 per request
    s = serving.summary(req, SloConfig(ttft_s=1.5, tpot_s=0.3), gaps)
    want = {"ttft_mean_s": 1.6, "ttft_p50_s": 1.5, "ttft_p99_s": 2.96, "tpot_mean_s": 0.275, "tpot_p50_s": 0.25,
            "tpot_p99_s": 0.494, "e2e_p99_s": 9.76, "queue_mean_s": 1.0, "throughput_tokens_s": 15 / 18,
            "requests_per_s": 5 / 18, "served_requests": 5, "offered_rate": 0.5, "slo_attainment": 0.6,
            "goodput_requests_s": 3 / 18, "itl_p50_s": 0.2, "itl_p99_s": 0.591, "preemptions": 3,
            "recomputed_tokens": 12}
    assert set(s) == set(want)
    for k, v in want.items():
        assert s[k] == pytest.approx(v, rel=1e-12), k
    assert serving.summary(req, SloConfig(ttft_s=1.0))["slo_attainment"] == 0.4  # 0.5 and 1.0 (a tie)
    assert serving.summary(req, SloConfig(tpot_s=0.2))["slo_attainment"] == 0.6  # 0.1, none, 0.2 (a tie)
    assert serving.summary(req, SloConfig(itl_s=0.3))["slo_attainment"] == 0.8  # all but 0.6 (0.3 a tie)
    assert serving.summary(req, SloConfig(ttft_s=1.5, itl_s=0.25))["slo_attainment"] == 0.4  # TTFT 2, 3; gap 0.3
    assert serving.summary(req, None)["itl_p99_s"] is None  # no gaps given
    two = serving.summary(req.iloc[[1, 3]], None)
    assert two["offered_rate"] == pytest.approx(1 / 3)
    assert "slo_attainment" not in two
    one = serving.summary(pd.DataFrame({k: [v[0]] for k, v in {
        "arrival_s": [2.0], "ttft_s": [0.0], "tpot_s": [nan], "e2e_s": [0.0], "queue_s": [0.0], "finish_s": [2.0],
        "output_tokens": [1], "preemptions": [0], "recomputed_tokens": [0]}.items()}), SloConfig(ttft_s=1.0))
    assert one["requests_per_s"] is None
    assert one["goodput_requests_s"] is None
    assert one["offered_rate"] is None
    assert one["tpot_p99_s"] is None
    assert one["slo_attainment"] == 1.0


def test_arrival_file_paragraphs_word_for_word(tmp_path: Path) -> None:
    """Each broken arrival file's paragraph, whole: the file, the line and data row, the
    column and value, and the fix; the notes name the columns and the time unit read; a
    request limit reads the first rows only."""
    def read(text: str | bytes, limit: int | None = None) -> Any:
        path = tmp_path / "a.csv"
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text)
        return path, serving.read_arrival_file(path, limit)

    def error(text: str | bytes) -> tuple[Path, str]:
        with pytest.raises(MoesimError) as err:
            read(text)
        return tmp_path / "a.csv", str(err.value)

    missing = tmp_path / "none.csv"
    with pytest.raises(MoesimError) as err:
        serving.read_arrival_file(missing, None)
    assert str(err.value) == (f"arrival file {missing}: not found. Give workload.arrivals.path as a CSV of arrival "
                              "time, input tokens and output tokens (relative to the scenario file).")
    p, msg = error(b"\xff\xfe\x00\x81garbage")
    assert msg.startswith(f"arrival file {p}: not a readable CSV (")
    assert msg.endswith("). Give a CSV with a header row naming the arrival time, input and output token columns.")
    assert "None" not in msg
    p, msg = error("arrival_time,input_tokens,output_tokens\n")
    assert msg == f"arrival file {p}: has no rows; it needs one row per request."
    p, msg = error("when,input_tokens,output_tokens\n0,2,2\n")
    assert msg == (f"arrival file {p}: no column for the arrival time; it has when, input_tokens, output_tokens. Name "
                   "one of them 'arrival_time' or 'arrival_s' or 'arrival' or 'timestamp' (also accepted: TIMESTAMP, "
                   "Timestamp, time, arrived_at, timestamp_ms, arrival_time_ms).")
    p, msg = error("arrival_time,input_tokens,output_tokens\n0,2,2\n1,-2,2\n")
    assert msg == (f"arrival file {p}: line 3 (data row 2) has input_tokens = -2; it must be a whole number of tokens "
                   ">= 0. Fix or remove that row.")
    p, msg = error("arrival_time,input_tokens,output_tokens\n0,2,2\n1,2,0.5\n")
    assert msg == (f"arrival file {p}: line 3 (data row 2) has output_tokens = 0.5; it must be a whole number of "
                   "tokens >= 1. Fix or remove that row.")
    p, msg = error("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,2,2\nsoon,2,2\n")
    assert msg == (f"arrival file {p}: line 3 (data row 2) has TIMESTAMP = soon; it must be a time. Fix or remove "
                   "that row.")
    p, msg = error("arrival_time,input_tokens,output_tokens\n0,2,2\n2,2,2\n1.5,2,2\n")
    assert msg == (f"arrival file {p}: line 4 (data row 3) arrives at 1.5 s, before the row above it (2 s); the rows "
                   "must be in arrival order. Sort the file by arrival_time.")
    _, (t, pr, out, found) = read("timestamp_ms,input_len,output_len\n1000,2,3\n1500,4,5\n2500,6,7\n", limit=2)
    assert t.tolist() == [0.0, 0.5]
    assert pr.tolist() == [2, 4]
    assert out.tolist() == [3, 5]
    assert pr.dtype == np.int64
    assert out.dtype == np.int64
    assert found == ("arrival file a.csv: arrival time from 'timestamp_ms' (milliseconds), prompt from 'input_len', "
                     "output from 'output_len'")
    _, (t, _, _, found) = read("arrival_s,prompt_tokens,completion_tokens\n3,2,3\n4.5,4,5\n")
    assert t.tolist() == [0.0, 1.5]
    assert found == ("arrival file a.csv: arrival time from 'arrival_s' (seconds), prompt from 'prompt_tokens', "
                     "output from 'completion_tokens'")
    _, (_, _, _, found) = read("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,2,2\n")
    assert "(date-times)" in found
    # date-times written two ways in one file; token counts written as decimals
    _, (t, pr, out, _) = read("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,2.0,3.0\n"
                              "11/16/2023 18:15:48,4.0,5.0\n")
    assert t.tolist() == [0.0, 2.0]
    assert pr.dtype == np.int64
    assert out.dtype == np.int64
    p, msg = error("arrival_time,input_tokens,output_tokens\n0,many,2\n")
    assert msg == (f"arrival file {p}: line 2 (data row 1) has input_tokens = many; it must be a whole number of "
                   "tokens >= 0. Fix or remove that row.")
    for header, what, names in (("arrival_time,x,output_tokens", "the input (prompt) tokens",
                                 "'input_tokens' or 'ContextTokens' or 'context_tokens' or 'prompt_tokens' (also "
                                 "accepted: Request tokens, input_length, input_len, prompt_len, num_prefill_tokens)"),
                                ("arrival_time,input_tokens,y", "the output tokens",
                                 "'output_tokens' or 'GeneratedTokens' or 'generated_tokens' or 'completion_tokens' "
                                 "(also accepted: Response tokens, output_length, output_len, num_decode_tokens)")):
        p, msg = error(header + "\n0,2,2\n")
        assert msg == (f"arrival file {p}: no column for {what}; it has {header.replace(',', ', ')}. Name one of "
                       f"them {names}.")

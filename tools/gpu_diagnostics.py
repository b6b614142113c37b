"""GPU diagnostics of the calibration executor, run on a lent GPU machine (each also runs on the
CPU with ``--device cpu`` and small sizes, which the tests use to check it makes the simulator's
decisions). What each measured on the lent machines is committed under ``validation/`` with the
command in its ``manifest.yaml``.

    python tools/gpu_diagnostics.py cores OUT.csv [--device cuda] [--free-s 20] [--core-s 2] [--calls 100]
    python tools/gpu_diagnostics.py host-calls OUT.csv
    python tools/gpu_diagnostics.py slots OUT.csv [--device cuda] [--repeats 3] [--tokens 128] [--second]
    python tools/gpu_diagnostics.py specmd PASSES.csv MICRO.csv [--device cuda] [--repeats 2] [--requests 8]

``cores``: is the eager executor's host speed a property of the CPU core it runs on? Samples
the calibration executor's cached-expert ``hit`` + ``run`` host work
(:func:`moesim.calibration.calibrate._executor_calls`) back to back, recording the core each
sample ran on: first free to move, then pinned to each allowed core in turn. One CSV row per
sample; the last line printed is the fastest core (by median), the core to pin a validation to.

``host-calls``: the host's time per CUDA call from Python for the calls the executor makes
(:func:`moesim.calibration.calibrate.host_call_times`, what ``moesim calibrate measure --device
cuda`` records), with the per-expert sums of the executor's two paths, as the CSV ``moesim
calibrate fit --host-costs`` reads.

``slots``: why OLMoE's per-expert passes took longer with 51 cache slots than with 10 for the
same copies and launches. Per-expert execution of the validation's OLMoE trace, no prefetch,
LRU, each variant ``--repeats`` times (per-pass seconds, measured and predicted): ``cap1`` and
``cap5``, the executor at 1% (10 slots) and 5% (51 slots); ``cap1-spread5``, 1%'s decisions with
its 10 slots spread over a pool of 50 (the copies land across as much device memory as at 5%,
the launches stay 1%'s); ``cap1-eager`` and ``cap5-eager``, no CUDA graphs. ``--second``: the
variants that tell the graphs' first launches from graphs beside a second stream.

``specmd``: SpecMD's drop-in experiment measured with SpecMD's kind of executor. The shipped
``specmd/olmoe-prefill`` scenario (OLMoE-1B-7B-shaped random weights, 4-bit NF4 experts, a
5 GB/s throttled link, blocking fetches, a Hugging Face-style per-expert loop:
:mod:`moesim.calibration.hf_loop`) under LRU and Least-Stale, with the scenario's next-gate
top-k prefetch and without, at 5% and 1% of the model, each ``--repeats`` times: per-pass
seconds (measured and the simulator's prediction) with the copies each run made, and
microbenchmarks of the loop's parts (``MICRO``).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

from moesim.calibration.calibrate import SHAPES, _executor_calls, host_call_times
from moesim.calibration.executor import host_weights
from moesim.calibration.validate import execute
from moesim.config.scenario import load_scenario
from moesim.traces.io import read_trace, write_trace
from moesim.traces.synth import synth_from_preset


def core() -> int:
    """The core this thread last ran on (/proc/thread-self/stat, field 39)."""
    with open("/proc/thread-self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])


def sample(torch: object, expert: object, device: str, calls: int) -> float:
    if device == "cuda":
        torch.cuda.synchronize()  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    for _ in range(calls):
        expert()  # type: ignore[operator]
    return (time.perf_counter() - t0) / calls * 1e6


def cores(a: argparse.Namespace) -> None:
    """``cores``: the cached expert's host work sampled free to move, then pinned to each core."""
    import torch

    h, inter = SHAPES["olmoe-1b-7b"]
    _, expert = _executor_calls(torch, h, inter, a.device)
    for _ in range(200):
        expert()
    cores = sorted(os.sched_getaffinity(0))
    rows = []
    t_start = time.perf_counter()

    def run(phase: str, seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            before = core()
            us = sample(torch, expert, a.device, a.calls)
            rows.append({"t_s": time.perf_counter() - t_start, "phase": phase, "core_before": before,
                         "core_after": core(), "expert_us": us})

    run("free", a.free_s)
    for c in cores:
        os.sched_setaffinity(0, {c})
        run(f"pinned-{c}", a.core_s)
    os.sched_setaffinity(0, set(cores))
    df = pd.DataFrame(rows)
    df.to_csv(a.out, index=False)
    free = df[df.phase == "free"]
    print(f"free: {len(free)} samples, expert us p10/p50/p90 "
          f"{np.percentile(free.expert_us, [10, 50, 90]).round(1).tolist()}, cores seen {sorted(free.core_after.unique().tolist())}")
    pinned = df[df.phase != "free"].groupby("phase", sort=False).expert_us
    for name, s in pinned:
        print(f"{name}: {len(s)} samples, p10/p50/p90 {np.percentile(s, [10, 50, 90]).round(1).tolist()}")
    best = min(pinned, key=lambda kv: float(np.median(kv[1])))[0]
    print(best.split("-")[1])


def host_calls(out: str) -> None:
    """``host-calls``: the host's time per CUDA call, as CSV (``call,host_us``)."""
    import torch

    r = {name: float(np.median(t)) * 1e6 for name, t in host_call_times(torch).items()}
    rows = dict(r)
    rows["per expert, one stream (copy + graph)"] = r["h2d copy dispatch (4 KiB pinned)"] + r["graph replay"]
    rows["per expert, demand stream (2 events, switch + wait, copy, wait, graph)"] = (
        2 * r["event made + recorded"] + r["stream switch + wait_event"] + r["h2d copy dispatch (4 KiB pinned)"]
        + r["wait_event on the current stream"] + r["graph replay"])
    with open(out, "w") as f:
        f.write("call,host_us\n")
        for name, us in rows.items():
            f.write(f"{name},{us:.2f}\n")
            print(f"{name:75s} {us:8.2f} us")


ROOT = Path(__file__).resolve().parents[1]
# name -> scenario, spread, graphs, upload, one_stream (moesim.calibration.validate.execute)
SLOT_VARIANTS = {"cap1": ("cap1-nopf-lru", 1, True, False, False), "cap5": ("cap5-nopf-lru", 1, True, False, False),
            "cap1-spread5": ("cap1-nopf-lru", 5, True, False, False),
            "cap1-eager": ("cap1-nopf-lru", 1, False, False, False),
            "cap5-eager": ("cap5-nopf-lru", 1, False, False, False)}
# the second run: is it the graphs' first launches, or graphs beside a second stream?
SLOT_SECOND = {"cap1-upload": ("cap1-nopf-lru", 1, True, True, False), "cap5-upload": ("cap5-nopf-lru", 1, True, True, False),
          "cap1-one-stream": ("cap1-nopf-lru", 1, True, False, True),
          "cap1-eager-one-stream": ("cap1-nopf-lru", 1, False, False, True),
          "cap1": SLOT_VARIANTS["cap1"], "cap5": SLOT_VARIANTS["cap5"]}


def slots(out: str, device: str, repeats: int, tokens: int, layers: int | None = None,
        variants: dict[str, tuple[str, int, bool, bool, bool]] | None = None) -> pd.DataFrame:
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "olmoe.parquet"
        write_trace(synth_from_preset("olmoe-1b-7b", layers=layers, requests=1, prompt_tokens=min(64, tokens),
                                      tokens=tokens, seed=0), path)
        trace = read_trace(path)
        m = trace.model
        host = host_weights(torch, m.num_layers * m.num_experts, m.hidden_size, m.expert_intermediate_size, device)
        rows = []
        # each variant once before any is repeated (a run stopped at its limit keeps one of each)
        chosen = SLOT_VARIANTS if variants is None else variants
        for rep, (name, (scen, spread, graphs, upload, one)) in ((rep, v) for rep in range(repeats) for v in chosen.items()):
            sc = load_scenario(f"validation/{scen}", [f"hardware.profile={ROOT / 'profiles' / 'h100.yaml'}",
                                                      f"workload.trace.path={path}", "expert_compute=per-expert",
                                                      "execution.style=graph-per-expert"])
            r = execute(sc, trace, device, host, spread=spread, graphs=graphs, upload=upload, one_stream=one)
            pred = r["predicted"]
            assert (r["hits"], r["misses"]) == (pred.summary["hits"], pred.summary["misses"]), name
            steps = pred.steps
            rows.append(pd.DataFrame({"variant": name, "scenario": scen, "repeat": rep,
                                      "pass": np.arange(len(r["pass_s"])), "phase": steps["phase"].to_numpy(),
                                      "measured_s": r["pass_s"], "predicted_s": steps["duration_s"].to_numpy(),
                                      "launches": len(r["launches"]), "device": device}))
            pd.concat(rows, ignore_index=True).to_csv(out, index=False)  # kept as it goes
            print(f"{name:21s} rep {rep}: prefill {1e3 * r['pass_s'][0]:.1f} ms, decode "
                  f"{1e3 * r['pass_s'][1:].mean():.2f} ms, {len(r['launches'])} distinct launches", flush=True)
    df = pd.concat(rows, ignore_index=True)
    df.to_csv(out, index=False)
    return df


CAPACITIES = {"5%": "0.6445GB", "1%": "0.1289GB"}  # of the full model (SpecMD Table 3), as the scenario
SPECMD_VARIANTS = [(cap, ev, pf) for cap in CAPACITIES for pf in ("next-gate-topk", "none") for ev in ("lru", "least-stale")]


def specmd_micro(device: str, repeats: int = 200) -> pd.DataFrame:
    """Median seconds of the loop's parts for one OLMoE expert: the NF4 dequantisation, the
    expert's loop body on 1 and 128 tokens (dequantisation included), and one decoder layer's
    non-expert part on 1 and 128 tokens."""
    import torch

    from moesim.calibration.hf_loop import HfLoopPool, hf_host_weights, nf4_dequantise

    h, inter = 2048, 1024
    host = hf_host_weights(torch, 2, h, inter, device, quantised=True)
    counts = {0: {0: 128}, 1: {0: 1}}
    pool = HfLoopPool(torch, host, 1, device, 1, 128, 64, (h, inter), 0.0, True, 8, counts, np.array([128, 1]), 1)
    pool.prepare()
    pool.pool[0].copy_(host[0])
    pool.expert_of[0] = 0
    split = 3 * h * inter // 2
    rows = []

    def timed(name: str, fn) -> None:  # type: ignore[no-untyped-def]
        for _ in range(10):
            fn()
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        ts = []
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            ts.append(time.perf_counter() - t0)
        rows.append({"part": name, "median_s": float(np.median(ts)), "p10_s": float(np.quantile(ts, 0.1)),
                     "p90_s": float(np.quantile(ts, 0.9)), "repeats": repeats, "device": device})
        print(f"{name:40s} {1e6 * np.median(ts):9.1f} us", flush=True)

    dt = pool.x.dtype
    timed("nf4 dequantise (one expert)",
          lambda: nf4_dequantise(torch, pool.pool[0][:split], pool.pool[0][split:].view(torch.float32), pool.table, dt))
    for p, n in ((1, 1), (0, 128)):
        pool.begin_layer(p, 0)
        timed(f"expert loop body, {n} tokens", lambda: pool._expert(0))
        timed(f"layer outside experts, {n} tokens", lambda n=n: pool.dense(n))
    return pd.DataFrame(rows)


def specmd(out: str, micro_out: str | None, device: str, repeats: int, requests: int = 8, prompt: int = 128,
        layers: int | None = None, capacities: list[str] | None = None) -> pd.DataFrame:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "olmoe.parquet"
        write_trace(synth_from_preset("olmoe-1b-7b", layers=layers, requests=requests, prompt_tokens=prompt, tokens=4,
                                      probs=True, pred_next=True, pred_noise=1.0, seed=0), path)
        trace = read_trace(path)
        if micro_out is not None:  # first: a few seconds, kept even if the variants run out of time
            specmd_micro(device).to_csv(micro_out, index=False)
        rows = []
        host = None
        for rep, (cap, ev, pf) in ((rep, v) for rep in range(repeats) for v in SPECMD_VARIANTS):  # each variant once first
            if capacities is not None and cap not in capacities:
                continue
            sc = load_scenario("specmd/olmoe-prefill", [f"workload.trace.path={path}", f"cache.capacity={CAPACITIES[cap]}",
                                                        f"policies.eviction={ev}", f"policies.prefetch={pf}"])
            r = execute(sc, trace, device, host)
            host = r["host"]
            pred = r["predicted"]
            s = pred.summary
            assert (r["hits"], r["misses"]) == (s["hits"] + s["late_prefetches"], s["misses"]), (cap, ev, pf)
            steps = pred.steps
            rows.append(pd.DataFrame({
                "capacity": cap, "eviction": ev, "prefetch": pf, "repeat": rep, "pass": np.arange(len(r["pass_s"])),
                "phase": steps["phase"].to_numpy(), "tokens": r["workload"].pass_tokens,
                "measured_s": r["pass_s"], "predicted_s": steps["duration_s"].to_numpy(),
                "hits": r["hits"], "misses": r["misses"], "copies": r["copies"],
                "link_late_s": r["link_late_s"], "device": device}))
            m = r["pass_s"]
            first = (steps["phase"] != "decode").to_numpy()
            print(f"{cap} {ev:11s} {pf:14s} rep {rep}: TTFT {1e3 * m[first].mean():7.1f} ms (predicted "
                  f"{1e3 * steps['duration_s'].to_numpy()[first].mean():7.1f}), decode {1e3 * m[~first].mean():6.1f} ms, "
                  f"{r['copies']} copies, link waits late {1e3 * r['link_late_s']:.1f} ms", flush=True)
            pd.concat(rows, ignore_index=True).to_csv(out, index=False)  # kept as it goes
    return pd.concat(rows, ignore_index=True)

def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    c = sub.add_parser("cores", help="the cached expert's host work, free and pinned to each core")
    c.add_argument("out")
    c.add_argument("--device", default="cuda")
    c.add_argument("--free-s", type=float, default=20.0)
    c.add_argument("--core-s", type=float, default=2.0)
    c.add_argument("--calls", type=int, default=100)
    h = sub.add_parser("host-calls", help="the host's time per CUDA call (CSV for calibrate fit --host-costs)")
    h.add_argument("out")
    s = sub.add_parser("slots", help="per-expert passes at 1% and 5% cache in the executor's variants")
    s.add_argument("out")
    s.add_argument("--device", default="cuda")
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("--tokens", type=int, default=128)
    s.add_argument("--layers", type=int, default=None)
    s.add_argument("--second", action="store_true", help="the second run's variants (SLOT_SECOND)")
    p = sub.add_parser("specmd", help="SpecMD's drop-in experiment with SpecMD's kind of executor")
    p.add_argument("out")
    p.add_argument("micro")
    p.add_argument("--device", default="cuda")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--layers", type=int, default=None)
    a = ap.parse_args(argv)
    if a.what == "cores":
        cores(a)
    elif a.what == "host-calls":
        host_calls(a.out)
    elif a.what == "slots":
        slots(a.out, a.device, a.repeats, a.tokens, a.layers, SLOT_SECOND if a.second else None)
    else:
        specmd(a.out, a.micro, a.device, a.repeats, a.requests, a.prompt, a.layers)


if __name__ == "__main__":
    main()

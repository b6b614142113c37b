"""Issue 37's GPU part: SpecMD's drop-in experiment measured with SpecMD's kind of executor.

The shipped ``specmd/olmoe-prefill`` scenario (OLMoE-1B-7B-shaped random weights, 4-bit NF4
experts, 5% of the full model as cache, 5 GB/s throttled link, blocking fetches, a Hugging
Face-style per-expert loop: :mod:`moesim.calibration.hf_loop`) replayed on the device under
LRU and Least-Stale, with the scenario's next-gate top-k prefetch and without, at 5% and 1%
of the model; each ``--repeats`` times. Writes per-pass seconds (measured and the simulator's
prediction with the scenario's own hardware) with the copies each run made, and a few
microbenchmarks of the loop's parts (``MICRO``):

    python tools/gpu_specmd.py PASSES.csv MICRO.csv [--device cuda] [--repeats 2] [--requests 8]

On the CPU (``--device cpu --layers 2 --requests 1 --prompt 8``) it checks that every variant
runs and makes the simulator's decisions (``tests/test_hf_loop.py``).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

from moesim.calibration.validate import execute
from moesim.config.scenario import load_scenario
from moesim.traces.io import read_trace, write_trace
from moesim.traces.synth import synth_from_preset

CAPACITIES = {"5%": "0.6445GB", "1%": "0.1289GB"}  # of the full model (SpecMD Table 3), as the scenario
VARIANTS = [(cap, ev, pf) for cap in CAPACITIES for pf in ("next-gate-topk", "none") for ev in ("lru", "least-stale")]


def micro(device: str, repeats: int = 200) -> pd.DataFrame:
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


def run(out: str, micro_out: str | None, device: str, repeats: int, requests: int = 8, prompt: int = 128,
        layers: int | None = None, capacities: list[str] | None = None) -> pd.DataFrame:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "olmoe.parquet"
        write_trace(synth_from_preset("olmoe-1b-7b", layers=layers, requests=requests, prompt_tokens=prompt, tokens=4,
                                      probs=True, pred_next=True, pred_noise=1.0, seed=0), path)
        trace = read_trace(path)
        if micro_out is not None:  # first: a few seconds, kept even if the variants run out of time
            micro(device).to_csv(micro_out, index=False)
        rows = []
        host = None
        for rep, (cap, ev, pf) in ((rep, v) for rep in range(repeats) for v in VARIANTS):  # each variant once first
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("micro")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--layers", type=int, default=None)
    a = ap.parse_args()
    run(a.out, a.micro, a.device, a.repeats, a.requests, a.prompt, a.layers)


if __name__ == "__main__":
    main()

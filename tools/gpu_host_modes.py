"""Issue 37, H200: is the eager executor's host speed a property of the CPU core it runs on?

The host-beside run (``tools/gpu_issue37_host_beside.sh``) timed the executor's host work for a
cached expert before each scenario at either about 70 us or about 105 us, and identical
100%-capacity scenarios measured either about 11 ms or about 16 ms a decode pass, with the two
timings of one scenario not always in the same mode. This samples the same host work (the
calibration executor's cached-expert ``hit`` + ``run``, :func:`moesim.calibration.calibrate.
_executor_calls`) back to back, recording the CPU core each sample ran on: first free to move,
then pinned to each core in turn. It writes one CSV row per sample and prints the fastest core
(the median over its samples) as its last line.

    python tools/gpu_host_modes.py OUT.csv [--device cuda] [--free-s 20] [--core-s 2]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import pandas as pd

from moesim.calibration.calibrate import SHAPES, _executor_calls


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--free-s", type=float, default=20.0)
    ap.add_argument("--core-s", type=float, default=2.0)
    ap.add_argument("--calls", type=int, default=100)
    a = ap.parse_args()
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


if __name__ == "__main__":
    main()

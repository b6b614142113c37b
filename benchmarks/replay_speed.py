"""Replay speed of moesim against libCacheSim, measured in one run (not a test).

1. Full-timing replay of the quickstart scenario (LRU, 5% capacity, on demand) on a 100k-token
   trace (40 requests x (64 prompt + 2436 decode tokens), OLMoE-1B-7B shape: 16 layers, 64
   experts, top-8), on the compiled kernel and on the SimPy path: expert accesses per second.
2. Cache-only LRU replay (``timing: false``) of the same trace against libCacheSim's LRU on
   the same access stream, driven (a) request by request from Python and (b) by its C loop
   over an oracleGeneral binary trace file. Miss counts are checked equal; speeds are printed
   as ratios to that C loop.
3. Least-Stale eviction + score-percentile prefetch, full timing: the kernel on the same
   trace, the SimPy path on the quickstart-size one; ratios to the C loop.
4. Peak memory per expert access of a full-timing decode replay; start-up of a small replay
   in a fresh process with a warm JIT cache, kernel against SimPy path.
5. A 64-point capacity x bandwidth x eviction sweep over a 10k-token OLMoE-shaped trace file
   on 2 local workers (``--sweep``).

Usage: ``python benchmarks/replay_speed.py [--tokens N] [--sweep] [--json OUT]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from moesim.config.scenario import load_scenario
from moesim.simulator.engine import Simulation

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import provenance  # machine, software, commit, date, command


def lcs_python(keys: list[int], capacity: int) -> tuple[int, float]:
    import libcachesim as lcs

    cache = lcs.LRU(cache_size=capacity)
    req = lcs.Request()
    req.obj_size = 1
    t0 = time.perf_counter()
    misses = 0
    for key in keys:
        req.obj_id = key
        misses += not cache.get(req)
    return misses, time.perf_counter() - t0


def lcs_native(keys: np.ndarray, capacity: int) -> tuple[int, float]:
    import libcachesim as lcs

    dtype = np.dtype([("t", "<u4"), ("id", "<u8"), ("size", "<u4"), ("next", "<i8")])
    rec = np.zeros(len(keys), dtype=dtype)
    rec["t"] = np.arange(len(keys), dtype=np.uint32)
    rec["id"] = keys.astype(np.uint64) + 1
    rec["size"] = 1
    rec["next"] = -1
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "stream.oracleGeneral.bin"
        rec.tofile(path)
        reader = lcs.TraceReader(str(path), lcs.TraceType.ORACLE_GENERAL_TRACE)
        cache = lcs.LRU(cache_size=capacity)
        t0 = time.perf_counter()
        miss_ratio, _ = cache.process_trace(reader)
        dt = time.perf_counter() - t0
    return round(miss_ratio * len(keys)), dt


def peak_bytes_per_access(sets: list[str], simpy: bool = False) -> float:
    """Peak memory (tracemalloc: Python objects and numpy buffers) of building and running a
    full-timing decode replay of a tenth of the trace, from the trace in memory on, per
    expert access, on the kernel or (``simpy``) the SimPy path."""
    import tracemalloc

    from moesim.simulator.build import load_trace

    small = [s if not s.startswith("workload.trace.synth.requests=") else "workload.trace.synth.requests=4"
             for s in sets]
    sc = load_scenario("quickstart", small)
    trace = load_trace(sc)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    res = rate(sc, simpy=simpy, trace=trace)[1]
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    return peak / res.summary["expert_accesses"]


def rate(sc: Any, workload: Any = None, simpy: bool = False, trace: Any = None) -> tuple[Any, Any]:
    """(simulation, result) of one replay on the kernel or (``simpy``) the SimPy path."""
    if simpy:
        os.environ["MOESIM_NO_KERNEL"] = "1"
    try:
        sim = Simulation(sc, trace=trace, workload=workload)
        res = sim.run()
    finally:
        os.environ.pop("MOESIM_NO_KERNEL", None)
    want = "simpy" if simpy else "kernel"
    assert res.summary["replay_path"] == want, res.summary["replay_path_reason"]
    return sim, res


def startup() -> dict[str, float]:
    """Wall time of a small replay (quickstart, 20 decode tokens) in a fresh process, JIT
    cache warm: kernel and SimPy path, best of 3."""
    code = ("import moesim; moesim.simulate(moesim.load_scenario('quickstart', "
            "['workload.trace.synth.tokens=20']))")
    out = {}
    for name, env in (("kernel", {}), ("simpy", {"MOESIM_NO_KERNEL": "1"})):
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, check=True)
            best = min(best, time.perf_counter() - t0)
        out[f"{name}_s"] = best
    out["kernel_extra_s"] = out["kernel_s"] - out["simpy_s"]
    return out


def sweep_64() -> dict[str, Any]:
    """64 points (capacity x link bandwidth x eviction) over a 10k-token OLMoE-shaped trace
    file, 2 local workers."""
    from moesim.simulator.build import load_trace
    from moesim.studies.sweep import sweep
    from moesim.traces.io import write_trace

    grid = {"cache.capacity": ["2%", "5%", "10%", "25%"],
            "hardware.links.pcie.bandwidth_gbps": [16, 32, 64, 128],
            "policies.eviction": ["lru", "lfu", "least-stale", "belady"]}
    with tempfile.TemporaryDirectory() as d:
        sc = load_scenario("quickstart", ["workload.trace.synth.requests=10", "workload.trace.synth.prompt_tokens=64",
                                          "workload.trace.synth.tokens=936"])
        write_trace(load_trace(sc), Path(d) / "trace.parquet")
        (Path(d) / "scenario.yaml").write_text(
            "hardware: {preset: a100-80g-pcie4}\nworkload: {trace: {path: trace.parquet}}\n"
            "cache: {capacity: 5%}\npolicies: {eviction: lru}\n")
        t0 = time.perf_counter()
        df = sweep(str(Path(d) / "scenario.yaml"), str(Path(d) / "out"), grid, workers=2)
        dt = time.perf_counter() - t0
    assert len(df) == 64
    assert (df["status"] == "ok").all()
    return {"points": 64, "tokens": 10_000, "workers": 2, "seconds": dt,
            "replay_paths": sorted(set(df["replay_path"]))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2436, help="decode tokens per request (40 requests)")
    ap.add_argument("--sweep", action="store_true", help="also time the 64-point sweep")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    args = ap.parse_args()
    sets = ["workload.trace.synth.requests=40", "workload.trace.synth.prompt_tokens=64",
            f"workload.trace.synth.tokens={args.tokens}"]
    sc = load_scenario("quickstart", sets)
    ls = ["policies.eviction=least-stale", "policies.prefetch=score-percentile", "workload.trace.synth.pred_next=true"]
    for warm in ([], ls):  # the compiled functions are loaded from numba's cache before any timing
        rate(load_scenario("quickstart", ["workload.trace.synth.tokens=5", *warm]))
    sim, res = rate(sc)
    wl = sim.wl
    accesses = res.summary["expert_accesses"]
    kernel_rate = accesses / sim.wall_s
    sim_py, res_py = rate(sc, wl, simpy=True)
    simpy_rate = accesses / sim_py.wall_s
    pd.testing.assert_frame_equal(res.steps, res_py.steps, check_exact=True)
    sc_c = load_scenario("quickstart", [*sets, "timing=false"])
    sim_c, res_c = rate(sc_c, wl)
    cache_rate = accesses / sim_c.wall_s
    capacity = int(res.summary["cache_capacity_experts"])
    keys = wl.keys()
    # libCacheSim sees one access per (pass, layer, distinct expert): the same stream
    m_py, t_py = lcs_python(keys.tolist(), capacity)
    m_c, t_c = lcs_native(keys, capacity)
    native = len(keys) / t_c
    out: dict[str, Any] = {
        "provenance": provenance(),
        "machine": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "tokens": int(wl.pass_tokens.sum()),
        "expert_accesses": accesses,
        "cache_capacity_experts": capacity,
        "full_timing_accesses_per_s": {"kernel": kernel_rate, "simpy": simpy_rate},
        "cache_only_accesses_per_s_kernel": cache_rate,
        "libcachesim_python_loop_accesses_per_s": len(keys) / t_py,
        "libcachesim_native_accesses_per_s": native,
        "ratio_full_timing_vs_libcachesim_native": {"kernel": kernel_rate / native, "simpy": simpy_rate / native},
        "ratio_cache_only_vs_libcachesim_native": cache_rate / native,
        "misses": {"moesim_timing": res.summary["misses"], "moesim_cache_only": res_c.summary["misses"],
                   "libcachesim_python": m_py, "libcachesim_native": m_c},
    }
    assert res.summary["misses"] == res_c.summary["misses"] == m_py, out["misses"]
    # least-stale + score-percentile prefetch: the kernel on this trace, SimPy on the quickstart's
    sim_k, res_k = rate(load_scenario("quickstart", [*sets, *ls]))
    sim_p, res_p = rate(load_scenario("quickstart", ls), simpy=True)
    out["least_stale_score_percentile"] = {
        "kernel": {"expert_accesses": res_k.summary["expert_accesses"],
                   "accesses_per_s": res_k.summary["expert_accesses"] / sim_k.wall_s,
                   "prefetches_issued": res_k.summary["prefetches_issued"]},
        "simpy_quickstart": {"expert_accesses": res_p.summary["expert_accesses"],
                             "accesses_per_s": res_p.summary["expert_accesses"] / sim_p.wall_s,
                             "prefetches_issued": res_p.summary["prefetches_issued"]},
    }
    out["ratio_least_stale_score_percentile_vs_libcachesim_native"] = {
        k: v["accesses_per_s"] / native for k, v in out["least_stale_score_percentile"].items()}
    out["peak_bytes_per_access"] = peak_bytes_per_access(sets)
    out["peak_bytes_per_access_simpy"] = peak_bytes_per_access(sets, simpy=True)
    out["startup_s"] = startup()
    if args.sweep:
        out["sweep_64_points"] = sweep_64()
    print(json.dumps(out, indent=2))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()

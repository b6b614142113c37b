"""Replay speed of moesim against libCacheSim, measured in one run (not a test).

1. Full-timing replay of the quickstart scenario on a 100k-token trace (40 requests x (64
   prompt + 2436 decode tokens), OLMoE-1B-7B shape): expert accesses per second.
2. Cache-only LRU replay (``timing: false``) of the same trace against libCacheSim's LRU on
   the same access stream, driven (a) request by request from Python and (b) by its C loop
   over an oracleGeneral binary trace file. Miss counts are checked equal; speeds are printed
   as ratios.
3. Least-Stale eviction + score-percentile prefetch on the quickstart-size trace, as a ratio to
   that C loop; and the peak memory per expert access of a full-timing decode replay.

Usage: ``python benchmarks/replay_speed.py [--tokens N] [--json OUT]``. One core is used.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from moesim.config.scenario import load_scenario
from moesim.simulator.engine import Simulation


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


def peak_bytes_per_access(sets: list[str]) -> float:
    """Peak memory (tracemalloc: Python objects and numpy buffers) of building and running a
    full-timing decode replay of a tenth of the trace, from the trace in memory on, per
    expert access."""
    import tracemalloc

    from moesim.simulator.engine import load_trace

    small = [s if not s.startswith("workload.trace.synth.requests=") else "workload.trace.synth.requests=4"
             for s in sets]
    sc = load_scenario("quickstart", small)
    trace = load_trace(sc)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    res = Simulation(sc, trace=trace).run()
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    return peak / res.summary["expert_accesses"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2436, help="decode tokens per request (40 requests)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    args = ap.parse_args()
    sets = ["workload.trace.synth.requests=40", "workload.trace.synth.prompt_tokens=64",
            f"workload.trace.synth.tokens={args.tokens}"]
    sc = load_scenario("quickstart", sets)
    sim = Simulation(sc)
    tokens = int(sim.wl.pass_tokens.sum())
    res = sim.run()
    accesses = res.summary["expert_accesses"]
    timing_rate = accesses / sim.wall_s

    sc_c = load_scenario("quickstart", [*sets, "timing=false"])
    sim_c = Simulation(sc_c, workload=sim.wl)
    res_c = sim_c.run()
    cache_rate = accesses / sim_c.wall_s
    capacity = int(res.summary["cache_capacity_experts"])
    keys = sim.wl.keys()
    # libCacheSim sees one access per (pass, layer, distinct expert): the same stream
    m_py, t_py = lcs_python(keys.tolist(), capacity)
    m_c, t_c = lcs_native(keys, capacity)
    out = {
        "machine": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "tokens": tokens,
        "expert_accesses": accesses,
        "cache_capacity_experts": capacity,
        "full_timing_accesses_per_s": timing_rate,
        "cache_only_accesses_per_s": cache_rate,
        "libcachesim_python_loop_accesses_per_s": len(keys) / t_py,
        "libcachesim_native_accesses_per_s": len(keys) / t_c,
        "ratio_cache_only_vs_libcachesim_python_loop": cache_rate / (len(keys) / t_py),
        "ratio_cache_only_vs_libcachesim_native": cache_rate / (len(keys) / t_c),
        "ratio_full_timing_vs_libcachesim_native": timing_rate / (len(keys) / t_c),
        "misses": {"moesim_timing": res.summary["misses"], "moesim_cache_only": res_c.summary["misses"],
                   "libcachesim_python": m_py, "libcachesim_native": m_c},
    }
    assert res.summary["misses"] == res_c.summary["misses"] == m_py, out["misses"]
    # policy library: least-stale + score-percentile prefetch on the quickstart-size trace
    sc_p = load_scenario("quickstart", ["policies.eviction=least-stale", "policies.prefetch=score-percentile",
                                        "workload.trace.synth.pred_next=true"])
    sim_p = Simulation(sc_p)
    res_p = sim_p.run()
    sp = res_p.summary
    out["least_stale_score_percentile"] = {
        "expert_accesses": sp["expert_accesses"],
        "accesses_per_s": sp["expert_accesses"] / sim_p.wall_s,
        "prefetches_issued": sp["prefetches_issued"],
        "prefetches_cancelled": sp["prefetches_cancelled"],
        "demand_misses": sp["misses"],
        "transfers_per_access": (sp["misses"] + sp["prefetches_issued"]) / sp["expert_accesses"],
        "ratio_vs_lru_full_timing": (sp["expert_accesses"] / sim_p.wall_s) / timing_rate,
    }
    out["ratio_least_stale_score_percentile_vs_libcachesim_native"] = (
        out["least_stale_score_percentile"]["accesses_per_s"] / (len(keys) / t_c))
    out["peak_bytes_per_access"] = peak_bytes_per_access(sets)
    for key, value in out.items():
        print(f"{key:48s} {value if not isinstance(value, float) else f'{value:,.3f}'}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()

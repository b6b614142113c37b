"""End-to-end speed and peak memory of ``moesim run`` on a trace file, against libCacheSim's C
loop on the same access stream, measured in one run (not a test).

The trace: OLMoE-1B-7B's shape (16 layers, 64 experts, top-8), requests of 1,000 decode
tokens each, every token's 8 experts per layer drawn uniformly (numpy, seeded), written
request by request (row groups of 64k rows). A token's layer is 8 distinct expert accesses,
so a trace of N accesses has N / 8 rows. For each size the whole ``moesim run`` process is
timed (``--trace FILE --json --no-write -q``, LRU, 5% capacity, on-demand fetch, full timing,
so the replay reads the file in pieces) with its peak resident memory (``wait4``'s
``ru_maxrss``), and the start-up (the same command on a one-request trace) is subtracted:
the marginal rate is accesses / (time - start-up). libCacheSim's LRU runs its C loop
(``process_trace`` over an oracleGeneral binary trace of the same accesses, timed around the
call) on the same stream at the sizes given to ``--lcs``, as many times as moesim (the best of
each is kept); the ratio is taken in the same run. At those sizes the runs go in rounds — the
start-up, moesim, the C loop — and each round's ratio is kept too (``rounds``, each against its
own start-up) with their median (``ratio_median_of_rounds``): this machine's speed drifts by a
third within minutes, and a ratio of runs made minutes apart drifts with it, while one of runs
made seconds apart does not.

Usage: ``python benchmarks/end_to_end.py [--sizes 2.56e6 25.6e6 256e6] [--lcs 25.6e6]
[--policy lru|ls-sp|belady|static-pin] [--json OUT]``. ``ls-sp`` replays least-stale eviction
with score-percentile prefetch (its trace gets a ``pred_next`` column: 64 floats per row);
``belady`` Belady's MIN (a piece at a time after a first pass over the file); ``static-pin``
LRU with static pinning (its counts from a first pass over the file).
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
from processes import timed_run  # one whole `moesim run` process: wall, peak RSS, summary
from provenance import provenance  # machine, software, commit, date, command
from replay_speed import lcs_native  # libCacheSim LRU's C loop over the stream, the call timed

from moesim.traces.io import trace_to_table
from moesim.traces.synth import get_preset, grid_index
from moesim.traces.trace import Trace

LAYERS, EXPERTS, K, TOKENS = 16, 64, 8, 1000  # a request: 1,000 decode tokens x 16 layers


def write_trace(path: Path, requests: int, seed: int = 0, pred_next: bool = False) -> np.ndarray | None:
    """Write ``requests`` uniform-routing requests; returns the access stream's keys (layer *
    64 + expert, rank order) when it is small enough to keep (for libCacheSim), else None."""
    model = get_preset("olmoe-1b-7b").model
    rng = np.random.default_rng(seed)
    writer = None
    keys = []
    keep = requests * TOKENS * LAYERS * K <= 64_000_000
    per = max(1, 65536 // (TOKENS * LAYERS))  # requests per row group
    for r0 in range(0, requests, per):
        n = min(per, requests - r0)
        rows = n * TOKENS * LAYERS
        experts = np.argsort(rng.random((rows, EXPERTS), dtype=np.float32), axis=1)[:, :K].astype(np.int16)
        idx = grid_index(n, TOKENS, LAYERS, 0)
        idx["request"] = idx["request"] + r0
        weights = np.full((rows, K), 1.0 / K, np.float32)
        pred = rng.random((rows, EXPERTS), dtype=np.float32) if pred_next else None
        table = trace_to_table(Trace(model=model, **idx, experts=experts, weights=weights, pred_next=pred,
                                     capture={"source": "benchmarks/end_to_end.py", "seed": seed}))
        if writer is None:
            writer = pq.ParquetWriter(str(path), table.schema, compression="zstd")
        writer.write_table(table)
        if keep:
            keys.append(idx["layer"].astype(np.int64)[:, None] * EXPERTS + experts)
    assert writer is not None
    writer.close()
    return np.concatenate(keys).reshape(-1) if keep else None


def run_moesim(trace: Path, sets: list[str]) -> tuple[float, float, dict[str, Any]]:
    """Wall seconds and peak RSS (MB) of one whole ``moesim run`` process, and its summary."""
    return timed_run(["quickstart", "--trace", str(trace)], sets)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[2.56e6, 25.6e6, 256e6], help="expert accesses")
    ap.add_argument("--lcs", type=float, nargs="*", default=[25.6e6], help="sizes libCacheSim also replays")
    ap.add_argument("--policy", choices=["lru", "ls-sp", "belady", "static-pin"], default="lru")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of moesim per size, and of libCacheSim's C loop (the best of each is kept)")
    ap.add_argument("--dir", default=None, help="where the trace files go (default: a temporary folder)")
    ap.add_argument("--json", dest="json_out", default=None)
    args = ap.parse_args()
    sets = ["cache.capacity=5%"]
    if args.policy == "ls-sp":
        sets += ["policies.eviction=least-stale", "policies.prefetch=score-percentile"]
    elif args.policy == "belady":
        sets += ["policies.eviction=belady"]
    elif args.policy == "static-pin":
        sets += ["policies.prefetch=static-pin"]
    pred = args.policy == "ls-sp"
    out: dict[str, Any] = {"provenance": provenance(), "machine": platform.machine(), "python": platform.python_version(),
                           "policy": args.policy, "sets": sets, "sizes": []}
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        folder = Path(d)
        one = folder / "one.parquet"
        write_trace(one, 1, seed=1, pred_next=pred)
        run_moesim(one, sets)  # the kernel compiled or loaded once before anything is timed
        start = min(run_moesim(one, sets)[0] for _ in range(3))
        out["startup_s"] = start
        print(f"start-up (1 request, 128k accesses): {start:.2f} s", flush=True)
        for size in args.sizes:
            requests = max(1, round(size / (TOKENS * LAYERS * K)))
            path = folder / f"trace-{requests}.parquet"
            t0 = time.perf_counter()
            keys = write_trace(path, requests, pred_next=pred)
            made = time.perf_counter() - t0
            paired = keys is not None and any(abs(size - s) < 1 for s in args.lcs)
            runs, rounds = [], []
            for _ in range(args.repeat):  # with libCacheSim: rounds of start-up, moesim, C loop
                s_up = run_moesim(one, sets)[0] if paired else None
                runs.append(run_moesim(path, sets))
                if s_up is not None:
                    r_wall, _, r_sum = runs[-1]
                    misses, dt = lcs_native(keys, int(r_sum["cache_capacity_experts"]))
                    rounds.append({"startup_s": s_up, "wall_s": r_wall, "lcs_s": dt, "lcs_misses": misses,
                                   "ratio": (int(r_sum["expert_accesses"]) / (r_wall - s_up)) / (len(keys) / dt)})
            wall, rss, summary = min(runs, key=lambda r: r[0])
            acc = int(summary["expert_accesses"])
            rate = acc / max(wall - start, 1e-9)
            row: dict[str, Any] = {"accesses": acc, "requests": requests, "file_mb": path.stat().st_size / 1e6,
                                   "wall_s": wall, "marginal_s": wall - start, "accesses_per_s": rate,
                                   "peak_rss_mb": rss, "rss_bytes_per_access": rss * 2**20 / acc,
                                   "trace_pieces": summary.get("trace_pieces", 1), "misses": summary["misses"],
                                   "replay_path": summary["replay_path"], "made_s": made}
            if paired:
                best = min(rounds, key=lambda r: r["lcs_s"])  # best of as many as moesim's
                row.update(lcs_misses=best["lcs_misses"], lcs_s=best["lcs_s"],
                           lcs_accesses_per_s=len(keys) / best["lcs_s"],
                           ratio_vs_lcs=rate / (len(keys) / best["lcs_s"]),
                           ratio_median_of_rounds=float(np.median([r["ratio"] for r in rounds])), rounds=rounds)
            del keys
            path.unlink()
            out["sizes"].append(row)
            print(json.dumps(row), flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()

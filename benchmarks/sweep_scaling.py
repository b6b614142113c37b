"""Sweep throughput: points per minute of a 16-point sweep with 1 and 2 local workers, and the
scaling ratio, measured in one run (not a test). Usage: python benchmarks/sweep_scaling.py"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from moesim.studies.sweep import sweep

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import provenance  # machine, software, commit, date, command

GRID = {"cache.capacity": ["5%", "10%", "25%", "50%"], "policies.eviction": ["lru", "fifo", "lfu", "least-stale"]}
BASE = ("workload.trace.synth.tokens=300",)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    out: dict[str, object] = {"provenance": provenance()}
    with tempfile.TemporaryDirectory() as d:  # untimed: the first sweep of a process loads what every later one reuses
        sweep("quickstart", d, {"cache.capacity": ["5%", "10%"]}, BASE, workers=2)
    for workers in (1, 2):
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            df = sweep("quickstart", d, GRID, BASE, workers=workers)
            dt = time.perf_counter() - t0
            assert len(df) == 16
            assert (df["status"] == "ok").all()
            out[f"workers_{workers}"] = {"seconds": dt, "points_per_minute": 16 * 60 / dt}
    out["scaling"] = out["workers_2"]["points_per_minute"] / out["workers_1"]["points_per_minute"]
    print(json.dumps(out, indent=2))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()

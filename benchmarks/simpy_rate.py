"""Pure-Python (SimPy path) replay rate, for comparing two versions of the code in one window
(not a test; ``replay_speed.py`` gives the figures against libCacheSim).

Replays the quickstart scenario on a trace of 4 requests x (64 prompt + ``--tokens`` decode
tokens) with LRU + no prefetch and with least-stale + score-percentile, full timing, on the
SimPy path (``MOESIM_NO_KERNEL=1``), ``--repeat`` times each after one warm-up replay, and
prints the expert accesses per second of each replay and the best, with the step-time total
and the misses so that two versions can be checked to replay the same thing.

The engine before the ``moesim`` package (the replay-fidelity engine, commit 4a55306) had
its modules at the top level (``simulator.engine``); the script reads either layout. To
compare with a commit, run it from a worktree of that commit first on the path, alternating
with the working tree's run:

    git worktree add /tmp/old 4a55306
    PYTHONPATH=/tmp/old python benchmarks/simpy_rate.py --label old
    python benchmarks/simpy_rate.py --label new
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

os.environ["MOESIM_NO_KERNEL"] = "1"

try:  # the layout before the moesim package, when its tree is on the path
    import simulator.engine as _engine
    from simulator.scenario import load_scenario
    Simulation = _engine.Simulation
    SCENARIOS = Path(_engine.__file__).resolve().parents[1] / "scenarios"
except ImportError:
    from moesim.config.scenario import load_scenario  # type: ignore[no-redef]
    from moesim.simulator.engine import Simulation  # type: ignore[no-redef, assignment]
    SCENARIOS = Path(__file__).resolve().parents[1] / "moesim" / "scenarios"

SETUPS = {
    "lru": ["policies.eviction=lru", "policies.prefetch=none"],
    "ls+sp": ["policies.eviction=least-stale", "policies.prefetch=score-percentile",
              "workload.trace.synth.pred_next=true"],
}


def one(sc: Any, wl: Any) -> tuple[float, int, float]:
    """(expert accesses per second, misses, sum of step durations) of one SimPy replay."""
    sim = Simulation(sc, workload=wl)
    t0 = time.perf_counter()
    res = sim.run()
    wall = time.perf_counter() - t0
    path = res.summary.get("replay_path", "simpy")
    assert path == "simpy", path
    steps = res.steps
    accesses = int(steps["hits"].sum() + steps["misses"].sum() + steps["late_prefetches"].sum())
    return accesses / wall, int(steps["misses"].sum()), float(steps["duration_s"].sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=500, help="decode tokens per request (4 requests)")
    ap.add_argument("--repeat", type=int, default=3, help="timed replays of each setup")
    ap.add_argument("--label", default="", help="printed first")
    args = ap.parse_args()
    path = str(SCENARIOS / "quickstart.yaml")
    for name, sets in SETUPS.items():
        sc = load_scenario(path, [f"workload.trace.synth.tokens={args.tokens}", *sets])
        wl = Simulation(sc).wl
        one(sc, wl)  # warm-up
        runs = [one(sc, wl) for _ in range(args.repeat)]
        rates = [r for r, _, _ in runs]
        _, misses, total = runs[0]
        print(f"{args.label} {name}: " + " ".join(f"{r / 1e3:.0f}" for r in rates)
              + f" best {max(rates) / 1e3:.0f} k accesses/s (misses {misses}, time {total!r} s)")


if __name__ == "__main__":
    main()

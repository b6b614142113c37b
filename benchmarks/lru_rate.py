"""LRU full-timing rate of the compiled kernel, for comparing two versions of the code in one
window (not a test; ``replay_speed.py`` gives the figures against libCacheSim).

Replays the quickstart scenario (LRU, 5% capacity) on a trace of 40 requests x (64 prompt +
``--tokens`` decode tokens) ``--repeat`` times after one warm-up replay and prints the expert
accesses per second of each replay (in millions) and the best. To compare with a commit, run
it from a worktree of that commit with its tree first on the path, alternating with the
working tree's run:

    git worktree add /tmp/old COMMIT
    PYTHONPATH=/tmp/old python benchmarks/lru_rate.py --label old
    python benchmarks/lru_rate.py --label new
"""

from __future__ import annotations

import argparse

from moesim.config.scenario import load_scenario
from moesim.simulator.engine import Simulation


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=800, help="decode tokens per request (40 requests)")
    ap.add_argument("--repeat", type=int, default=5, help="timed replays")
    ap.add_argument("--label", default="", help="printed first")
    args = ap.parse_args()
    Simulation(load_scenario("quickstart", ["workload.trace.synth.tokens=5"])).run()  # numba's cache loaded
    sc = load_scenario("quickstart", ["workload.trace.synth.requests=40", "workload.trace.synth.prompt_tokens=64",
                                      f"workload.trace.synth.tokens={args.tokens}"])
    wl = Simulation(sc).wl
    rates = []
    for _ in range(args.repeat):
        sim = Simulation(sc, workload=wl)
        res = sim.run()
        assert res.summary["replay_path"] == "kernel", res.summary["replay_path_reason"]
        rates.append(res.summary["expert_accesses"] / sim.wall_s / 1e6)
    print(args.label, " ".join(f"{r:.1f}" for r in rates), f"best {max(rates):.1f} M accesses/s")


if __name__ == "__main__":
    main()

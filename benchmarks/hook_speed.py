"""Kernel speed of a policy written as hooks against the built-in of the same shape, measured
in one run (not a test).

A user's compiled policy should replay at >= 0.5x the speed of a built-in policy of the same
shape. The hook policies here restate built-ins exactly (``tests/test_hooks.py``
checks their rows are the built-ins'): eviction LFU (a count per key, the lowest evicted; its
priority kept between victim searches, ``stable_priority``, and asked of every candidate at each
search) and FLD (the farthest layer from the current one: asked at each search, as it reads the
clock), and SIEVE written as list-shaped hooks (``tests/test_list_hooks.py``: a queue, visited
bits and a hand in the policy's own arrays, its walk asked a key at a time); prefetch oracle (the next layer's true experts) and previous-token, with LRU (both
propose through arrays made ahead: the built-ins' compiled form, the hooks' ``select``); miss
drop (rank 2 and below fetched, the rest dropped: the built-in's compiled form, the hook's
``choose`` called at each miss, ``tests/test_miss_hooks.py``); budget dynamic skipping (the
built-in's numpy selection against a user's, written a token at a time,
``tests/test_budget_kernel.py``: both asked for each (pass, layer) ahead of the kernel's calls); routing
cache-aware (lambda 0.3: the built-in's compiled form against a hook, ``choose`` called at each
routing point with the layer's tokens, ``tests/test_routing_hooks.py``). Each pair replays the quickstart scenario's model
(OLMoE-1B-7B shape: 16 layers x 64 experts, top-8; with router probabilities) at 5% capacity,
full timing, on the compiled kernel, from a trace in memory; the replays alternate (built-in, hook, built-in, ...)
and the median of each is reported, as expert accesses per second of ``Simulation.run``.
Miss counts are checked equal. ``--policies`` measures built-ins only (for a paired run
against another commit, which has no hooks).

Usage: ``python benchmarks/hook_speed.py [--tokens N] [--repeat R] [--json OUT]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numba

from moesim.config.scenario import load_scenario
from moesim.simulator.engine import Simulation

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import provenance  # machine, software, commit, date, command


def register_hooks() -> dict[str, str]:
    """Register the tests' hook policies; returns hook policy -> the built-in it restates, each
    as ``family=name``."""
    from moesim.policies import budget, eviction, miss, prefetch, routing
    from tests.test_budget_kernel import UserSkip
    from tests.test_hooks import AskedLFU, HookFLD, HookLFU, HookOracle, HookPreviousToken
    from tests.test_list_hooks import HookSieve
    from tests.test_miss_hooks import HookDrop
    from tests.test_routing_hooks import HookCacheAware

    for name, cls in (("hook-lfu", HookLFU), ("asked-lfu", AskedLFU), ("hook-fld", HookFLD),
                      ("hook-sieve", HookSieve)):
        eviction.REGISTRY.register(name)(cls)
    for name, cls in (("hook-oracle", HookOracle), ("hook-previous-token", HookPreviousToken)):
        prefetch.REGISTRY.register(name)(cls)
    miss.REGISTRY.register("hook-drop")(HookDrop)
    budget.REGISTRY.register("user-skip")(UserSkip)
    routing.REGISTRY.register("hook-cache-aware")(HookCacheAware)
    return {"miss=hook-drop": "miss=drop", "budget=user-skip": "budget=dynamic-skip",
            "routing=hook-cache-aware": "routing=cache-aware",
            "eviction=hook-lfu": "eviction=lfu", "eviction=asked-lfu": "eviction=lfu",
            "eviction=hook-fld": "eviction=fld", "eviction=hook-sieve": "eviction=sieve",
            "prefetch=hook-oracle": "prefetch=oracle",
            "prefetch=hook-previous-token": "prefetch=previous-token"}


def replay(sc: Any, trace: Any) -> tuple[float, int, int]:
    sim = Simulation(sc, trace=trace)
    t0 = time.perf_counter()
    s = sim.run().summary
    dt = time.perf_counter() - t0
    assert s["replay_path"] == "kernel", s["replay_path_reason"]
    return dt, s["expert_accesses"], s["misses"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2500, help="decode tokens per request (10 requests)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--policies", default=None, help="built-in eviction policies only, comma-separated")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from moesim.simulator.build import load_trace

    sets = ["workload.trace.synth.requests=10", "workload.trace.synth.prompt_tokens=64", "workload.trace.synth.probs=true",
            f"workload.trace.synth.tokens={args.tokens}", "cache.capacity=5%"]
    base = load_scenario("quickstart", sets)
    trace = load_trace(base)
    pairs = ({f"eviction={p}": f"eviction={p}" for p in args.policies.split(",")} if args.policies
             else register_hooks())
    names = list(dict.fromkeys([n for h, b in pairs.items() for n in (b, h)]))
    scs = {n: load_scenario("quickstart", [*sets, f"policies.{n}"]) for n in names}
    for n in names:  # compile / load the kernel, compile the hooks
        replay(load_scenario("quickstart", [*sets[:3], "workload.trace.synth.tokens=4", f"policies.{n}"]), None)
    times: dict[str, list[float]] = {n: [] for n in names}
    seen: dict[str, tuple[int, int]] = {}
    for r in range(args.repeat):
        for n in names:
            dt, acc, miss = replay(scs[n], trace)
            times[n].append(dt)
            seen[n] = (acc, miss)
            print(f"[{r + 1}/{args.repeat}] {n}: {acc / dt / 1e6:.2f} M accesses/s", file=sys.stderr)
    out: dict[str, Any] = {"provenance": provenance(), "machine": platform.machine(), "python": platform.python_version(),
                           "numba": numba.__version__, "tokens": 10 * (64 + args.tokens), "repeat": args.repeat,
                           "accesses": {n: seen[n][0] for n in names}, "misses": {n: seen[n][1] for n in names},
                           "median_s": {n: statistics.median(times[n]) for n in names},
                           "accesses_per_s": {n: seen[n][0] / statistics.median(times[n]) for n in names}}
    if not args.policies:
        for h, b in pairs.items():
            assert seen[h] == seen[b], f"{h} and {b} disagree: {seen[h]} vs {seen[b]}"
        out["ratio_hook_vs_builtin"] = {h: statistics.median(times[b]) / statistics.median(times[h])
                                        for h, b in pairs.items()}
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()

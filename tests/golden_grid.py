"""The engine-core golden grid (issue 13): every eviction x prefetch x miss x budget policy,
with the execution mode, timing and batch size cycling over the cases, plus expert
parallelism with every budget, replayed on a small OLMoE-shaped trace. Each case is reduced
to a digest of its per-pass rows (the exact bytes of every column below), so that a change in
any count or any bit of any time changes it.

``tests/golden_grid_results.py`` holds the digests that the replay-fidelity issue's engine
(commit 4a55306, the last one before the engine-core restructure) gave. They were made by
running this file there, where the sources still lived at the repository root::

    git worktree add /tmp/fid 4a55306
    cp tests/golden_grid.py /tmp/fid/tests/
    cd /tmp/fid && python -m tests.golden_grid > golden_grid_results.py

This file therefore imports through either layout. After a deliberate change of results,
regenerate the digests with the current engine and say in the commit which cases changed
and why.
"""

from __future__ import annotations

import hashlib
import sys
from typing import Any

import numpy as np

try:
    from moesim.simulator.engine import simulate
    from moesim.traces.synth import synth_from_preset
except ImportError:  # the fidelity issue's layout (sources at the repository root)
    from simulator.engine import simulate  # type: ignore[no-redef]
    from traces.synth import synth_from_preset  # type: ignore[no-redef]

from tests.helpers import scenario

EVICTIONS = ("lru", "fifo", "lfu", "random", "fld", "score", "least-stale", "belady", "lhu", "sieve", "s3-fifo", "arc")
PREFETCHERS = ("none", "oracle", "previous-token", "lookahead", "next-gate-topk", "score-percentile",
               "static-pin")
MISSES = ("fetch", "fetch-lowest-bit", "fetch-priority", "drop", "substitute", "speculative")
BUDGETS: dict[str, Any] = {"none": "none", "moe-spec": "moe-spec", "xshare": {"name": "xshare", "budget": 6},
                           "lynx": "lynx", "dynamic-skip": "dynamic-skip", "skip-threshold": "skip-threshold"}
MODES = ("layer", "on-arrival", "per-expert")
# per-pass columns present in both engines, in this order
COLUMNS = ("start_s", "end_s", "stall_s", "hits", "misses", "late_prefetches", "collision_misses",
           "uncached_fetches", "bytes_h2d", "unique_experts", "prefetches_issued", "prefetches_used",
           "prefetches_cancelled", "prefetch_predicted_hits", "prefetch_predicted", "prefetch_actual",
           "low_precision_experts", "dropped_experts", "substituted_experts", "gate_weight_total",
           "gate_weight_computed", "tokens_altered", "max_experts_per_gpu")


def trace() -> Any:
    """4 layers of 16 experts, top-4, with router probabilities and next-layer predictions:
    8 requests of 4 prompt and 6 decode tokens."""
    return synth_from_preset("olmoe-1b-7b", layers=4, experts=16, top_k=4, requests=8, prompt_tokens=4,
                             tokens=6, seed=3, probs=True, pred_next=True)


def cases() -> dict[str, dict[str, Any]]:
    """Case name -> scenario overrides."""
    out: dict[str, dict[str, Any]] = {}
    draw = np.random.default_rng(13)  # mode, timing and batch of each case (every combination
    for ev in EVICTIONS:              # with every policy appears: tests/test_golden_grid.py)
        for pf in PREFETCHERS:
            for miss in MISSES:
                for budget, spec in BUDGETS.items():
                    mode, timing, batch = MODES[draw.integers(3)], bool(draw.integers(2)), (1, 8)[draw.integers(2)]
                    name = f"{ev}/{pf}/{miss}/{budget}/{mode}/{'timed' if timing else 'cache-only'}/b{batch}"
                    out[name] = {"policies": {"eviction": ev, "prefetch": pf, "miss": miss, "budget": spec},
                                 "expert_compute": mode, "timing": timing, "workload": {"batch_size": batch},
                                 "cache": {"capacity": "20%"}}
    for gpus in (2, 4):
        ep_budgets = {**BUDGETS, "xshare-per-gpu": {"name": "xshare", "per_gpu": 2, "gpus": gpus}}
        for budget, spec in ep_budgets.items():
            for batch in (1, 8):
                out[f"ep{gpus}/{budget}/b{batch}"] = {
                    "policies": {"budget": spec}, "workload": {"batch_size": batch},
                    "hardware": {"preset": f"h100-sxm-nvlink-x{gpus}"}}
    for ev in ("lru", "least-stale"):
        for miss in ("fetch", "drop"):
            for batch in (1, 8):
                out[f"cache-aware/{ev}/{miss}/b{batch}"] = {
                    "policies": {"eviction": ev, "miss": miss, "routing": "cache-aware", "prefetch": "oracle"},
                    "workload": {"batch_size": batch}, "cache": {"capacity": "20%"}}
    return out


def digest(steps: Any) -> str:
    """The first 16 hex digits of the SHA-256 of the columns' bytes (int64 / float64)."""
    h = hashlib.sha256()
    for c in COLUMNS:
        col = steps[c].to_numpy()
        h.update(c.encode())
        h.update(np.ascontiguousarray(col, dtype=np.float64 if col.dtype.kind == "f" else np.int64).tobytes())
    return h.hexdigest()[:16]


def compute(over: dict[str, Any], tr: Any) -> str:
    """The digest of one case's replay."""
    return digest(simulate(scenario(**over), trace=tr).steps)


def main() -> None:
    tr = trace()
    print('"""Digests of the engine-core golden grid (tests/golden_grid.py), made by '
          '`python -m tests.golden_grid`."""\n')
    print("GOLDEN_GRID = {")
    all_cases = cases()
    for n, (name, over) in enumerate(all_cases.items()):
        print(f"    {name!r}: {compute(over, tr)!r},")
        if n % 100 == 0:
            print(f"{n}/{len(all_cases)}", file=sys.stderr)
    print("}")


if __name__ == "__main__":
    main()

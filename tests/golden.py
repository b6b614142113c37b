"""Golden results of every shipped scenario on reduced lengths (issue 12).

``python -m tests.golden`` prints the current results as a Python literal; pasted into
``tests/golden_results.py`` it becomes what ``tests/test_golden.py`` holds the simulator to,
so a change of results is a deliberate update (commit it with the reason). Reduced lengths:
synthetic traces at most 2 requests of 16 prompt and 12 decode tokens (served: 8 requests
arriving, with the serving figures beside); imported logs their
first request; the calibration set (whose trace ``calibrate validate`` supplies) a 4-layer
synthetic OLMoE-like trace.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = sorted(str(p.relative_to(ROOT / "moesim" / "scenarios").with_suffix("")) for p in (ROOT / "moesim" / "scenarios").rglob("*.yaml"))
INTS = ("hits", "misses", "late_prefetches", "collision_misses", "uncached_fetches", "prefetches_issued",
        "prefetches_cancelled", "forward_passes", "tokens")
FLOATS = ("total_time_s", "ttft_s", "tpot_s", "stall_s", "gate_mass_retained", "tokens_altered",
          "unique_experts_per_layer", "max_experts_per_gpu", "speedup_vs_autoregressive")
SERVING = ("ttft_p99_s", "tpot_p99_s", "e2e_p99_s", "requests_per_s", "slo_attainment")  # with arrivals


def needs_real(name: str) -> bool:
    """Whether the scenario reads ../shared/traces/real."""
    return "shared/traces/real" in (ROOT / "moesim" / "scenarios" / f"{name}.yaml").read_text()


def compute(name: str) -> dict[str, Any]:
    """The scenario's summary figures on its reduced length."""
    from moesim.config.scenario import load_scenario
    from moesim.simulator.engine import Simulation
    from moesim.traces.synth import synth_from_preset

    path = ROOT / "moesim" / "scenarios" / f"{name}.yaml"
    sc = load_scenario(path)
    src = sc.workload.trace
    sets: list[str] = []
    trace = None
    if src.synth is not None and src.synth.preset is not None:
        s = src.synth
        sets += [f"workload.trace.synth.requests={min(s.requests, 2)}",
                 f"workload.trace.synth.tokens={min(s.tokens, 12)}",
                 f"workload.trace.synth.prompt_tokens={min(s.prompt_tokens, 16)}"]
    elif src.import_ is not None:
        sets.append("workload.max_requests=1")
        if "shared/traces/real/" in src.import_.path:  # the real traces where the tests find them
            from tests.helpers import REAL  # (MOESIM_SHARED in a copy of the tree, e.g. mutmut's)

            sets.append(f"workload.trace.import.path={REAL / src.import_.path.split('shared/traces/real/')[1]}")
    else:
        trace = synth_from_preset("olmoe-1b-7b", layers=4, requests=2, prompt_tokens=8, tokens=12, seed=0,
                                  probs=True, pred_next=True)
    if sc.workload.arrivals is not None and sc.workload.arrivals.requests is not None:  # serving: 8 requests
        sets.append(f"workload.arrivals.requests={min(sc.workload.arrivals.requests, 8)}")
    summary = Simulation(load_scenario(path, sets), trace=trace).run().summary
    out: dict[str, Any] = {k: int(summary[k]) for k in INTS}
    out["bytes_h2d"] = int(next(iter(summary["bytes_by_link"].values())))
    for k in FLOATS:
        v = summary.get(k)
        out[k] = None if v is None else float(v)
    for k in SERVING:
        if k in summary:
            out[k] = None if summary[k] is None else float(summary[k])
    return out


if __name__ == "__main__":
    print("GOLDEN = {")
    for name in SCENARIOS:
        print(f"    {name!r}: {compute(name)!r},")
    print("}")

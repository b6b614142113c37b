"""The next GPU run for issue 37: why OLMoE's per-expert passes take longer with 51 cache slots
than with 10 for the same copies and launches (``validation/h100/report.md``, "Re-predicted
with the host model").

Per-expert execution of the validation's OLMoE trace, no prefetch, LRU, each variant
``REPEATS`` times (per-pass seconds, measured and predicted, as CSV):

- ``cap1`` and ``cap5``: the shipped executor at 1% (10 slots) and 5% (51 slots);
- ``cap1-spread5``: 1%'s decisions with its 10 slots spread over a pool of 50, every fifth
  used: the copies land across as much device memory as at 5%, the launches (CUDA graphs, one
  per buffer and token count) stay 1%'s;
- ``cap1-eager`` and ``cap5-eager``: no CUDA graphs, every kernel launched eagerly.

If ``cap1-spread5`` measures like ``cap5``, the device memory the copies land in costs the
time; if like ``cap1``, it is not that (the number of distinct graphs is then the suspect,
which the eager pair checks: eager launches have no graphs to tell apart).

    python tools/gpu_perexpert_slots.py OUT.csv [--device cuda] [--repeats 3] [--tokens 128]

On the CPU (``--device cpu``, small ``--tokens``) it checks that every variant runs and makes
the simulator's decisions.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

from moesim.calibration.executor import host_weights
from moesim.calibration.validate import execute
from moesim.config.scenario import load_scenario
from moesim.traces.io import read_trace, write_trace
from moesim.traces.synth import synth_from_preset

ROOT = Path(__file__).resolve().parents[1]
# name -> scenario, spread, graphs, upload, one_stream (moesim.calibration.validate.execute)
VARIANTS = {"cap1": ("cap1-nopf-lru", 1, True, False, False), "cap5": ("cap5-nopf-lru", 1, True, False, False),
            "cap1-spread5": ("cap1-nopf-lru", 5, True, False, False),
            "cap1-eager": ("cap1-nopf-lru", 1, False, False, False),
            "cap5-eager": ("cap5-nopf-lru", 1, False, False, False)}
# the second run (issue 37, H200): is it the graphs' first launches, or graphs beside a second stream?
SECOND = {"cap1-upload": ("cap1-nopf-lru", 1, True, True, False), "cap5-upload": ("cap5-nopf-lru", 1, True, True, False),
          "cap1-one-stream": ("cap1-nopf-lru", 1, True, False, True),
          "cap1-eager-one-stream": ("cap1-nopf-lru", 1, False, False, True),
          "cap1": VARIANTS["cap1"], "cap5": VARIANTS["cap5"]}


def run(out: str, device: str, repeats: int, tokens: int, layers: int | None = None,
        variants: dict[str, tuple[str, int, bool, bool, bool]] | None = None) -> pd.DataFrame:
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "olmoe.parquet"
        write_trace(synth_from_preset("olmoe-1b-7b", layers=layers, requests=1, prompt_tokens=min(64, tokens),
                                      tokens=tokens, seed=0), path)
        trace = read_trace(path)
        m = trace.model
        host = host_weights(torch, m.num_layers * m.num_experts, m.hidden_size, m.expert_intermediate_size, device)
        rows = []
        # each variant once before any is repeated (a run stopped at its limit keeps one of each)
        chosen = VARIANTS if variants is None else variants
        for rep, (name, (scen, spread, graphs, upload, one)) in ((rep, v) for rep in range(repeats) for v in chosen.items()):
            sc = load_scenario(f"validation/{scen}", [f"hardware.profile={ROOT / 'profiles' / 'h100.yaml'}",
                                                      f"workload.trace.path={path}", "expert_compute=per-expert",
                                                      "execution.style=graph-per-expert"])
            r = execute(sc, trace, device, host, spread=spread, graphs=graphs, upload=upload, one_stream=one)
            pred = r["predicted"]
            assert (r["hits"], r["misses"]) == (pred.summary["hits"], pred.summary["misses"]), name
            steps = pred.steps
            rows.append(pd.DataFrame({"variant": name, "scenario": scen, "repeat": rep,
                                      "pass": np.arange(len(r["pass_s"])), "phase": steps["phase"].to_numpy(),
                                      "measured_s": r["pass_s"], "predicted_s": steps["duration_s"].to_numpy(),
                                      "launches": len(r["launches"]), "device": device}))
            pd.concat(rows, ignore_index=True).to_csv(out, index=False)  # kept as it goes
            print(f"{name:21s} rep {rep}: prefill {1e3 * r['pass_s'][0]:.1f} ms, decode "
                  f"{1e3 * r['pass_s'][1:].mean():.2f} ms, {len(r['launches'])} distinct launches", flush=True)
    df = pd.concat(rows, ignore_index=True)
    df.to_csv(out, index=False)
    return df


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--second", action="store_true", help="the second run's variants (SECOND)")
    a = ap.parse_args()
    run(a.out, a.device, a.repeats, a.tokens, a.layers, SECOND if a.second else None)


if __name__ == "__main__":
    main()

"""Why the executor's per-expert prefill is slower than the simulator predicts: the OLMoE
prefill pass (64 tokens, 1% capacity, no prefetch) executed three times in each of three ways —
as shipped (demand copies on their own stream, each expert's kernel waiting for its copy's
event), with every copy on the compute stream (no overlap of copy and compute, no events), and
in ``layer`` execution — printing each pass time. ``python tools/gpu_perexpert_diag.py OUT.csv``.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from moesim.calibration import validate as v
from moesim.config.scenario import load_scenario
from moesim.traces.io import read_trace, write_trace
from moesim.traces.synth import PRESETS, generate


def _one_stream(self, b: int, key: int, background: bool) -> None:
    if self.plan:
        return
    self.buffer(b).copy_(self.host[key // self.p_num], non_blocking=True)


def main(out: str) -> None:
    tmp = Path(tempfile.mkdtemp())
    write_trace(generate(PRESETS["olmoe-1b-7b"].model, requests=1, prompt_tokens=64, tokens=3, seed=0), tmp / "t.parquet")
    trace = read_trace(tmp / "t.parquet")
    m = trace.model
    host = v.host_weights(torch, m.num_layers * m.num_experts, m.hidden_size, m.expert_intermediate_size, "cuda")
    shipped = v.DevicePool._copy
    rows = ["variant,repeat,pass,measured_s,predicted_s"]
    for variant, mode, copy in (("shipped", "per-expert", shipped), ("one-stream", "per-expert", _one_stream),
                                ("shipped", "layer", shipped)):
        v.DevicePool._copy = copy
        sc = load_scenario("validation/cap1-nopf-lru", [f"workload.trace.path={tmp / 't.parquet'}",
                                                         f"expert_compute={mode}", "hardware.profile=.gpu/profile.yaml"])
        for rep in range(3):
            r = v.execute(sc, trace, "cuda", host)
            pred = r["predicted"].steps["duration_s"].to_numpy()
            for p, (ms, ps) in enumerate(zip(r["pass_s"], pred, strict=True)):
                rows.append(f"{variant}-{mode},{rep},{p},{ms:.6f},{ps:.6f}")
            print(f"{variant:10s} {mode:10s} rep {rep}: prefill {r['pass_s'][0] * 1e3:.1f} ms (predicted "
                  f"{pred[0] * 1e3:.1f}), decode {r['pass_s'][1:].mean() * 1e3:.2f} ms (predicted {pred[1:].mean() * 1e3:.2f})",
                  flush=True)
    v.DevicePool._copy = shipped
    Path(out).write_text("\n".join(rows) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])

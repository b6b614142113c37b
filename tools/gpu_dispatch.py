"""How much of an expert FFN's measured time is the host's dispatch, not the GPU's work.

For each model shape and token count, three timings of ``(silu(x @ wg) * (x @ wu)) @ wd`` in
bf16: one call between CUDA events after a synchronisation (how ``moesim calibrate measure``
times it), 50 calls back to back between two events (per call: the larger of the host's
dispatch and the GPU's work), and a CUDA graph of the call replayed (the GPU's work alone).
Prints a table and writes it as CSV: ``python tools/gpu_dispatch.py OUT.csv``.
"""

from __future__ import annotations

import sys

import torch

from moesim.calibration.torchops import cuda_graph, expert_ffn, warm_up

SHAPES = {"olmoe-1b-7b": (2048, 1024), "mixtral-8x7b": (4096, 14336)}


def _events(fn, calls: int, repeats: int = 15) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / calls)
    times.sort()
    return times[len(times) // 2]


def main(out: str) -> None:
    rows = ["shape,tokens,isolated_us,back_to_back_us,graph_us"]
    for shape, (h, inter) in SHAPES.items():
        wg = torch.randn(h, inter, dtype=torch.bfloat16, device="cuda")
        wu = torch.randn(h, inter, dtype=torch.bfloat16, device="cuda")
        wd = torch.randn(inter, h, dtype=torch.bfloat16, device="cuda")
        for n in (1, 8, 64, 512):
            x = torch.randn(n, h, dtype=torch.bfloat16, device="cuda")

            def ffn(x=x, wg=wg, wu=wu, wd=wd):
                return expert_ffn(x, wg, wu, wd)

            warm_up(ffn)
            replay = cuda_graph(ffn)
            iso, b2b, gr = _events(ffn, 1), _events(ffn, 50), _events(replay, 50)
            rows.append(f"{shape},{n},{iso * 1e6:.1f},{b2b * 1e6:.1f},{gr * 1e6:.1f}")
            print(rows[-1], flush=True)
    with open(out, "w") as f:
        f.write("\n".join(rows) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])

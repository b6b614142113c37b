"""The host's time per CUDA call from Python, for the calls the calibration executor makes per
expert (``moesim/calibration/validate.py``): a graph replay, an event made and recorded, a
stream switch with a wait on an event, a host-to-device copy dispatched (4 KiB, pinned, so
the GPU's part is negligible). Each is timed over 2,000 calls with a monotonic clock on the
host, without synchronising (what Python pays to launch, not what the GPU does), after a
warm-up; the per-expert sums of the executor's two paths follow. Prints a table and writes it
as CSV: ``python tools/gpu_host_overhead.py OUT.csv``.
"""

from __future__ import annotations

import sys
import time

import torch

from moesim.calibration.calibrate import cuda_graph, expert_ffn, warm_up

CALLS = 2000


def _host_us(fn) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(CALLS):
        fn()
    t = time.perf_counter() - t0
    torch.cuda.synchronize()
    return t / CALLS * 1e6


def main(out: str) -> None:
    h, inter = 2048, 1024
    w = torch.randn(3, h, inter, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(1, h, dtype=torch.bfloat16, device="cuda")

    def ffn() -> None:
        expert_ffn(x, w[0], w[1], w[2].T)

    warm_up(ffn)
    replay = cuda_graph(ffn)
    host = torch.empty(4096, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(4096, dtype=torch.uint8, device="cuda")
    demand = torch.cuda.Stream()
    ev = torch.cuda.Event()
    ev.record()

    def event_record() -> None:
        torch.cuda.Event().record()

    def switch_and_wait() -> None:
        with torch.cuda.stream(demand):
            demand.wait_event(ev)

    def copy() -> None:
        dev.copy_(host, non_blocking=True)

    rows = {"ffn eager (5 kernels)": _host_us(ffn), "graph replay": _host_us(replay),
            "event made + recorded": _host_us(event_record), "stream switch + wait_event": _host_us(switch_and_wait),
            "wait_event on the current stream": _host_us(lambda: torch.cuda.current_stream().wait_event(ev)),
            "h2d copy dispatch (4 KiB pinned)": _host_us(copy)}
    r = rows
    rows["per expert, one stream (copy + graph)"] = r["h2d copy dispatch (4 KiB pinned)"] + r["graph replay"]
    rows["per expert, demand stream (2 events, switch + wait, copy, wait, graph)"] = (
        2 * r["event made + recorded"] + r["stream switch + wait_event"] + r["h2d copy dispatch (4 KiB pinned)"]
        + r["wait_event on the current stream"] + r["graph replay"])
    with open(out, "w") as f:
        f.write("call,host_us\n")
        for name, us in rows.items():
            f.write(f"{name},{us:.2f}\n")
            print(f"{name:75s} {us:8.2f} us")


if __name__ == "__main__":
    main(sys.argv[1])

"""The host's time per CUDA call from Python, for the calls the calibration executor makes per
expert (``moesim/calibration/validate.py``), as ``moesim calibrate measure --device cuda``
records them (:func:`moesim.calibration.calibrate.host_call_times`); the per-expert sums of
the executor's two paths follow. Prints a table and writes it as CSV, the format
``moesim calibrate fit --host-costs`` reads: ``python tools/gpu_host_overhead.py OUT.csv``.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from moesim.calibration.calibrate import host_call_times


def main(out: str) -> None:
    r = {name: float(np.median(t)) * 1e6 for name, t in host_call_times(torch).items()}
    rows = dict(r)
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

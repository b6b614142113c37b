"""The end-to-end benchmarks' process timer (``benchmarks/processes.py``): the peak memory it
reports is the ``moesim run`` process's own, however much memory the benchmark holds."""

from __future__ import annotations

import numpy as np

from tests.helpers import load_tool


def test_the_peak_memory_is_the_replays_own_not_the_benchmarks() -> None:
    """Linux carries the peak of the memory a process replaces at ``exec`` into its
    ``ru_maxrss``: a child started by a process holding 1.2 GB reported at least 1.2 GB
    (``wait4``), which is how the 256 M-access benchmark once reported 1.6 GB for a replay of
    0.9 GB. The timer reads the process's own high-water mark instead."""
    processes = load_tool("processes", "benchmarks")
    held = np.ones(150_000_000)  # 1.2 GB, every page touched
    wall, peak_mb, summary = processes.timed_run(["quickstart"], ["workload.trace.synth.tokens=4"])
    assert 50 < peak_mb < 1000
    assert held.sum() == 150_000_000
    assert summary["replay_path"] == "kernel"
    assert wall > 0

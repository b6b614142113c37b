"""The benchmarks' memory readings: the end-to-end process timer's (``benchmarks/processes.py``)
peak is the ``moesim run`` process's own, however much memory the benchmark holds; the suite's
(``benchmarks/suite.py``) sums a command's processes, resident and proportional."""

from __future__ import annotations

import sys

import numpy as np

from tests.helpers import load_tool


def test_the_peak_memory_is_the_replays_own_not_the_benchmarks() -> None:
    """Linux carries the peak of the memory a process replaces at ``exec`` into its
    ``ru_maxrss``: a child started by a process holding 1.2 GB reported at least 1.2 GB
    (``wait4``), which is how the 256 M-access benchmark once reported 1.6 GB for a replay of
    0.9 GB. The timer reads the process's own high-water mark instead: here a replay of about
    0.32 GB started by a process holding 0.7 GB more than it did."""
    processes = load_tool("processes", "benchmarks")
    held = np.ones(87_500_000)  # 0.7 GB, every page touched
    wall, peak_mb, summary = processes.timed_run(["quickstart"], ["workload.trace.synth.tokens=4"])
    assert 50 < peak_mb < 550
    assert held.sum() == 87_500_000
    assert summary["replay_path"] == "kernel"
    assert wall > 0


def test_the_suite_s_memory_counts_a_forked_child_s_shared_pages_once_in_pss() -> None:
    """``benchmarks/suite.py`` sums the resident memory over a command's processes (a page a
    forked child shares with its parent counted in both) and their proportional set sizes
    (counted once), and records each spell over its limit with the processes at its peak: a
    parent holding 0.4 GB forks a child that only reads it."""
    suite = load_tool("suite", "benchmarks")
    program = ("import numpy as np, os, time\n"
               "a = np.ones(50_000_000)\n"
               "if os.fork() == 0:\n"
               "    assert a.sum() == 50_000_000; time.sleep(2.5); os._exit(0)\n"
               "time.sleep(3.5); os.wait()\n")
    out = suite.measure([sys.executable, "-c", program], every=0.25, limit=0.6e9)
    assert out["exit_status"] == 0
    assert out["peak_rss_sum_gb"] >= 0.8  # 0.4 GB in each of the two
    assert out["peak_pss_sum_gb"] < 0.6  # 0.4 GB once, and the interpreter's own pages
    assert len(out["spells_over"]) == 1
    spell = out["spells_over"][0]
    assert spell["peak_gb"] == out["peak_rss_sum_gb"]
    assert [line.startswith(sys.executable) for _gb, line in spell["at_peak"][:2]] == [True, True]

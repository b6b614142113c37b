"""One whole ``moesim run`` process, timed: the helper the end-to-end benchmarks share."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any


def timed_run(args: list[str], sets: list[str]) -> tuple[float, float, dict[str, Any]]:
    """Wall seconds and peak resident memory (MB, ``wait4``'s ``ru_maxrss``) of ``moesim run
    ARGS --json --no-write -q`` with each ``--set`` in ``sets``, and the summary it printed."""
    cmd = [sys.executable, "-m", "moesim", "run", *args, "--json", "--no-write", "-q"]
    for s in sets:
        cmd += ["--set", s]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out = proc.stdout.read() if proc.stdout else b""  # read before the child is reaped: wait4 reaps it
    err = proc.stderr.read() if proc.stderr else b""
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if status != 0:
        raise SystemExit(f"moesim run failed: {err.decode()[-2000:]}")
    return wall, usage.ru_maxrss / 1024, json.loads(out)

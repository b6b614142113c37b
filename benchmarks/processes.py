"""One whole ``moesim run`` process, timed: the helper the end-to-end benchmarks share."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

# runs moesim's command line as ``python -m moesim`` does, then prints the process's own peak
# resident memory (VmHWM, in kB) to stderr at exit
_PEAK = ("import atexit, sys\n"
         "def _peak():\n"
         "    for line in open('/proc/self/status'):\n"
         "        if line.startswith('VmHWM:'):\n"
         "            sys.stderr.write('\\nmoesim-peak-rss-kb ' + line.split()[1] + '\\n')\n"
         "atexit.register(_peak)\n"
         "from moesim.cli import main\n"
         "sys.argv[0] = 'moesim'\n"
         "main()\n")


def timed_run(args: list[str], sets: list[str]) -> tuple[float, float, dict[str, Any]]:
    """Wall seconds and peak resident memory (MB) of ``moesim run ARGS --json --no-write -q``
    with each ``--set`` in ``sets``, and the summary it printed. The peak is the process's own
    (``VmHWM`` of ``/proc/self/status``, read at its exit), not ``wait4``'s ``ru_maxrss``: Linux
    carries into a child's ``ru_maxrss`` the peak of the memory it replaced at ``exec``, here the
    benchmark's own (the 256 M-access trace it had just written: 1.6 GB reported for a replay
    that peaked at 0.9 GB)."""
    # -P: the working directory does not go before PYTHONPATH (a worktree of another commit named
    # there is the code that runs, wherever the benchmark is started)
    safe = ["-P"] if sys.version_info >= (3, 11) else []  # -P is new in 3.11
    cmd = [sys.executable, *safe, "-c", _PEAK, "run", *args, "--json", "--no-write", "-q"]
    for s in sets:
        cmd += ["--set", s]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate()
    status = proc.returncode
    wall = time.perf_counter() - t0
    if status != 0:
        raise SystemExit(f"moesim run failed: {err.decode()[-2000:]}")
    peak = [line.split()[1] for line in err.decode().splitlines() if line.startswith("moesim-peak-rss-kb ")]
    return wall, int(peak[-1]) / 1024, json.loads(out)

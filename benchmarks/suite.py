"""The README's second command, measured: the whole test suite's wall time and its peak
resident memory summed over the process and every process it starts (the warm-up's compilers,
Ray's workers, notebook kernels, the ``moesim`` commands the docs' examples run), sampled every
second from ``/proc``.

Run it where the suite would run, on a fresh numba cache to measure a first installation's
run (``NUMBA_CACHE_DIR`` pointing at an empty folder, or a fresh clone):

    python benchmarks/suite.py --json benchmarks/results/suite.json

``-- CMD ...`` measures another command instead of ``python -m pytest -m "" -n 2``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import ROOT, provenance

LIMIT = 4e9  # README command 2's target: the summed resident memory's spells above it are recorded


def _tree_rss(root: int) -> tuple[int, int, int, list[tuple[int, str]]]:
    """Bytes resident in process ``root`` and all its descendants, in the largest one, their
    proportional set sizes summed (a page shared by n of them counted 1/n in each: forked
    children share their parent's), and per process (bytes resident, its command line's first
    100 characters), largest first."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, frontier = {root}, [root]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p and c not in tree]
        tree.update(kids)
        frontier.extend(kids)
    total = largest = pss = 0
    each = []
    for pid in tree:
        try:
            with open(f"/proc/{pid}/status") as f:
                kb = next((int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:")), 0)
            with open(f"/proc/{pid}/smaps_rollup") as f:
                pss += next((int(ln.split()[1]) for ln in f if ln.startswith("Pss:")), 0) * 1024
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                line = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, ValueError):
            continue
        total += kb * 1024
        largest = max(largest, kb * 1024)
        each.append((kb * 1024, line[:100]))
    return total, largest, pss, sorted(each, reverse=True)


def measure(cmd: list[str], every: float = 1.0, limit: float = LIMIT) -> dict[str, Any]:
    """Run ``cmd`` in the repository's root; its wall seconds, exit status, the peaks of the
    summed and of the largest process's resident memory and of the summed proportional set
    size (GB), with when the summed resident one was reached and the processes then (GB each,
    and their command lines; a pytest-xdist worker's names the test it runs), and each spell
    over ``limit`` bytes summed: its start and end (seconds) and its peak's processes."""
    peak: dict[str, Any] = {"sum": 0, "largest": 0, "pss": 0, "at_s": 0.0, "procs": []}
    spells: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT)
    done = threading.Event()

    def sample() -> None:
        over = False
        while not done.is_set():
            total, largest, pss, each = _tree_rss(proc.pid)
            now = round(time.perf_counter() - t0)
            if total > peak["sum"]:
                peak["sum"], peak["at_s"], peak["procs"] = total, now, each
            peak["largest"], peak["pss"] = max(peak["largest"], largest), max(peak["pss"], pss)
            if total > limit:
                if not over:
                    spells.append({"from_s": now, "to_s": now, "peak_gb": 0.0, "at_peak": []})
                spell = spells[-1]
                spell["to_s"] = now
                if total / 1e9 > spell["peak_gb"]:
                    spell["peak_gb"] = round(total / 1e9, 2)
                    spell["at_peak"] = [[round(b / 1e9, 2), line] for b, line in each[:5]]
            over = total > limit
            done.wait(every)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    status = proc.wait()
    wall = time.perf_counter() - t0
    done.set()
    sampler.join()
    return {"command": shlex.join(cmd), "exit_status": status, "wall_s": round(wall, 1),
            "peak_rss_sum_gb": round(peak["sum"] / 1e9, 2), "peak_rss_largest_gb": round(peak["largest"] / 1e9, 2),
            "peak_pss_sum_gb": round(peak["pss"] / 1e9, 2), "peak_at_s": peak["at_s"], "sample_every_s": every,
            "at_peak": [[round(b / 1e9, 2), line] for b, line in peak["procs"]],
            "over_gb": limit / 1e9, "spells_over": spells}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ...: the command measured")
    args = ap.parse_args(argv)
    cmd = [c for c in args.cmd if c != "--"] or [sys.executable, "-m", "pytest", "-m", "", "-n", "2"]
    out = {**measure(cmd), "numba_cache": os.environ.get("NUMBA_CACHE_DIR", "numba's default (beside the sources)"),
           "provenance": provenance([sys.argv[0], *argv])}
    print(json.dumps(out, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0 if out["exit_status"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""What a benchmark's results file records about where and how it was made: the machine, the
software, the commit, the date and the command (``benchmarks/results/*.json``: ``provenance``),
which the rendered performance page shows beside each figure."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def provenance(argv: list[str] | None = None) -> dict[str, Any]:
    """The machine (CPU, cores, OS), Python and numba versions, the commit (and whether the
    tree had uncommitted changes), the UTC date and the command line."""
    try:
        import numba

        numba_version = numba.__version__
    except ImportError:  # pragma: no cover
        numba_version = "absent"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    argv = sys.argv if argv is None else argv
    return {
        "machine": f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}",
        "python": platform.python_version(), "numba": numba_version,
        "commit": _git("rev-parse", "--short=12", "HEAD"), "dirty": bool(_git("status", "--porcelain", "--", "moesim")),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": shlex.join(["python", os.path.relpath(argv[0], ROOT) if argv else "?", *argv[1:]]),
    }

"""The first run after an installation, measured in one run (not a test): each form of the
replay kernel compiled from an emptied numba cache (a new ``NUMBA_CACHE_DIR``), then the same
command again with the cache kept; then the first and a warm ``moesim compare`` (the
quickstart's 10 points, the machine's cores as workers). For each: wall seconds, and the
seconds until the command's first line on stderr (a new user's wait for a sign of life). A
form's compile time is its first run less its warm one. ``MOESIM_NO_JIT_HELPER=1`` times the
compiles without the helper on the other core (:mod:`moesim.jitplan`).

Usage: ``python benchmarks/first_run.py [--json OUT]``."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import provenance

FORMS = {
    "layer_fetch": [],
    "per_expert_fetch": ["--set", "expert_compute=per-expert"],
    "layer_drop": ["--set", "policies.miss=drop"],
    "per_expert_drop": ["--set", "expert_compute=per-expert", "--set", "policies.miss=drop"],
}


def timed(cmd: list[str], env: dict[str, str]) -> dict[str, float | None]:
    """Wall seconds of ``cmd`` and seconds to its first line on stderr (None if it said none)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    first = None
    for _line in proc.stderr:
        if first is None:
            first = time.perf_counter() - start
    if proc.wait() != 0:
        raise SystemExit(f"{' '.join(cmd)} failed")
    return {"wall_s": time.perf_counter() - start, "first_line_s": first}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", dest="json_out", default=None)
    args = ap.parse_args()
    moesim = [sys.executable, "-m", "moesim"]
    out: dict[str, object] = {"provenance": provenance(), "runs": {}}
    runs: dict[str, object] = out["runs"]  # type: ignore[assignment]
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in FORMS.items():
            cache = Path(tempfile.mkdtemp(dir=tmp))
            env = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}
            cmd = [*moesim, "run", "quickstart", "--no-write", *extra]
            runs[name] = {"first": timed(cmd, env), "warm": timed(cmd, env)}
            print(name, runs[name], flush=True)
        cache = Path(tempfile.mkdtemp(dir=tmp))
        env = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}
        runs["compare"] = {"first": timed([*moesim, "compare", "--out", f"{tmp}/a"], env),
                           "warm": timed([*moesim, "compare", "--out", f"{tmp}/b"], env)}
        print("compare", runs["compare"], flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()

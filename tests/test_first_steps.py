"""What a new user meets first: the shipped scenarios listed, a sweep's grid as given and
named, a compare's folder per configuration, progress in a log, a first line at once, no
leaked warnings, and every printed line within 80 columns."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner

from moesim.cli import _compare_folder, cli
from moesim.config.scenario import resolve_path
from tests.helpers import too_wide

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "moesim" / "scenarios"
SMALL = ("--set", "workload.trace.synth.tokens=12", "--set", "workload.trace.synth.requests=1")


def test_scenarios_lists_every_shipped_file_and_prints_one() -> None:
    """``moesim scenarios``: one row per YAML file under moesim/scenarios (named as ``moesim
    run`` takes it) with the first sentence of its header comment; ``--json`` the same;
    ``moesim scenarios NAME`` prints that file; a wrong name is refused with a suggestion."""
    files = sorted(SHIPPED.rglob("*.yaml"))
    names = [f.relative_to(SHIPPED).with_suffix("").as_posix() for f in files]
    assert "quickstart" in names
    assert "specmd/olmoe-config2" in names
    r = CliRunner().invoke(cli, ["scenarios", "--json"])
    assert r.exit_code == 0, r.output
    listed = json.loads(r.output)
    assert [x["name"] for x in listed] == names
    for x, f in zip(listed, files, strict=True):
        assert resolve_path(x["name"]) == f
        header = " ".join(line.lstrip("#").strip() for line in f.read_text().splitlines()
                          if line.startswith("#")).strip()
        assert x["description"], x
        assert header.startswith(x["description"]), x
        assert x["description"].endswith(".")
    by = {x["name"]: x["description"] for x in listed}
    assert by["quickstart"] == ("Quickstart: an OLMoE-like synthetic trace made in-process, replayed on an "
                                "A100-80GB behind PCIe 4.0 with an expert cache holding 5% of all expert bytes, LRU "
                                "eviction and blocking fetch on a miss.")
    r = CliRunner().invoke(cli, ["scenarios"])
    assert r.exit_code == 0
    assert not too_wide(r.output)
    for n in names:
        assert n in r.output
    r = CliRunner().invoke(cli, ["scenarios", "specmd/olmoe-config2"])
    assert r.exit_code == 0
    assert r.output.split("\n", 1)[1] == (SHIPPED / "specmd" / "olmoe-config2.yaml").read_text()
    r = CliRunner().invoke(cli, ["scenarios", "quickstrt"])
    assert r.exit_code == 2
    assert " ".join(r.output.split()) == ("error: scenario 'quickstrt' is not one moesim ships (did you mean "
                                          "'quickstart'?); `moesim scenarios` lists them.")


def test_grid_on_the_command_line_is_the_whole_grid(tmp_path: Path) -> None:
    """``--grid`` replaces the scenario's own ``sweep:`` axes (quickstart's 36-point grid is not
    added to): 2 x 2 given, 4 points run, and the command names them before running; with no
    --grid the scenario's section is the grid, and the command says so."""
    out = tmp_path / "s"
    r = CliRunner().invoke(cli, ["sweep", "quickstart", *SMALL, "--grid", "cache.capacity=5%,25%",
                                 "--grid", "policies.eviction=lru,fifo", "--out", str(out), "--workers", "1"])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert ("sweeping 4 points over cache.capacity (5%, 25%) x policies.eviction (lru, fifo) (from --grid)"
            in text)
    df = pd.read_parquet(out / "results.parquet")
    assert len(df) == 4
    assert sorted(zip(df["cache.capacity"], df["policies.eviction"], strict=True)) == [
        ("25%", "fifo"), ("25%", "lru"), ("5%", "fifo"), ("5%", "lru")]
    assert not too_wide(r.output)
    sc = tmp_path / "s.yaml"
    sc.write_text("workload:\n  trace:\n    synth: {preset: olmoe-1b-7b, requests: 1, tokens: 12}\n"
                  "cache: {capacity: 5%}\nsweep:\n  axes:\n    policies.eviction: [lru, lfu]\n")
    r = CliRunner().invoke(cli, ["sweep", str(sc), "--out", str(tmp_path / "t"), "--workers", "1"])
    assert r.exit_code == 0, r.output
    assert ("sweeping 2 points over policies.eviction (lru, lfu) (from the scenario's sweep: section)"
            in " ".join(r.output.split()))
    r = CliRunner().invoke(cli, ["sweep", str(sc), "--grid", "cache.capacity=10%", "--out", str(tmp_path / "u"),
                                 "--workers", "1"])
    assert r.exit_code == 0, r.output
    assert "sweeping 1 point over cache.capacity (10%) (from --grid)" in " ".join(r.output.split())
    assert list(pd.read_parquet(tmp_path / "u" / "results.parquet")["cache.capacity"]) == ["10%"]


def test_compare_default_folder_per_configuration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compare's default folder is ``runs/compare-<scenario>`` for the scenario as it is and
    gets a suffix per configuration of options, so a compare with other --set values keeps
    its own points and table; the first line names the folder; the same options again reuse
    every point."""
    assert _compare_folder("quickstart", (None,) * 6 + ((),)) == Path("runs/compare-quickstart")
    monkeypatch.chdir(tmp_path)
    base = ["compare", "quickstart", *SMALL, "--eviction", "lru", "--prefetch", "none", "--workers", "1"]
    a = CliRunner().invoke(cli, [*base, "--capacity", "5%"])
    b = CliRunner().invoke(cli, [*base, "--capacity", "25%"])
    assert a.exit_code == 0, a.output
    assert b.exit_code == 0, b.output
    folders = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert len(folders) == 2
    assert all(re.fullmatch(r"compare-quickstart-[0-9a-f]{8}", f) for f in folders), folders
    for r in (a, b):
        first = " ".join(" ".join(r.output.split("\n")[0:2]).split())
        assert first.startswith("moesim compare quickstart: planning the points (results in runs/compare-quickstart-")
    for f in folders:
        assert (tmp_path / "runs" / f / "compare.parquet").is_file()
    caps = {f: pd.read_parquet(tmp_path / "runs" / f / "compare.parquet").attrs for f in folders}
    assert len(caps) == 2
    again = CliRunner().invoke(cli, [*base, "--capacity", "5%"])
    assert again.exit_code == 0
    assert "; 0 run now." in " ".join(again.output.split())
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == folders
    assert not too_wide(a.output + again.output)


def test_log_progress_by_hand(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """In a log, progress is a line at most every MOESIM_PROGRESS_EVERY seconds and the last
    one once any was said; work done sooner says nothing."""
    from moesim.output import console

    clock = iter([0.0, 1.0, 4.0, 5.5, 6.0, 20.0, 21.0, 0.0, 1.0])
    monkeypatch.setattr(console.time, "monotonic", lambda: next(clock))
    monkeypatch.setenv("MOESIM_PROGRESS_EVERY", "5")
    log = console.LogProgress("sweep")  # starts at 0
    log(1, 4)  # 1 s: too soon
    log(2, 4)  # 4 s: too soon
    log(3, 4)  # 5.5 s: said
    log(3, 4)  # 6 s: same count, not said again
    log(4, 4)  # 20 s: the last
    log(4, 4)  # 21 s: said already
    quick = console.LogProgress("compare")  # starts at 0
    quick(2, 2)  # 1 s: done before any line; nothing
    assert capsys.readouterr().err.splitlines() == ["moesim sweep: 3 of 4 done (6 s)",
                                                    "moesim sweep: 4 of 4 done (20 s)"]


def test_wrapped_keeps_lines_and_long_words() -> None:
    from moesim.output.console import wrapped

    text = "a " * 50 + "\n\n" + "x" * 90 + " tail"
    lines = wrapped(text).split("\n")
    assert lines[0] == ("a " * 40).strip()
    assert lines[1] == "  " + ("a " * 10).strip()
    assert lines[2] == ""
    assert lines[3:] == ["x" * 90, "  tail"]


def test_the_command_line_loads_no_heavy_module() -> None:
    """The first line a command says comes before numpy, pandas, numba or simpy are imported:
    importing the command line pulls in none of them."""
    probe = ("import sys, moesim.cli; print(sorted(m for m in ('numpy', 'pandas', 'numba', 'simpy', 'pyarrow') "
             "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.usefixtures("no_fork_server_beside_the_children")
def test_a_first_compare_speaks_at_once_shows_compile_progress_and_leaks_no_warning(tmp_path: Path) -> None:
    """A first ``moesim compare`` after an installation (numba's cache emptied) with stderr a
    log file: the first line names the folder, the kernel's compile is announced and then
    reported every MOESIM_PROGRESS_EVERY seconds until it is done; no warning from the
    worker processes (the fork server reaping the jit helper) leaks; every line fits."""
    env = {**{k: v for k, v in os.environ.items() if k != "NUMBA_DISABLE_JIT"},
           "NUMBA_CACHE_DIR": str(tmp_path / "cache"), "MOESIM_PROGRESS_EVERY": "1"}
    cmd = [sys.executable, "-m", "moesim", "compare", "quickstart", *SMALL, "--eviction", "lru", "--prefetch", "none",
           "--out", str(tmp_path / "c"), "--workers", "1"]
    r = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert " ".join(" ".join(lines[:2]).split()) == (f"moesim compare quickstart: planning the points (results in "
                                                     f"{tmp_path / 'c'}/)")
    text = " ".join(r.stderr.split())
    assert ("moesim: compiling the replay kernel's form for layer or on-arrival execution, fetch on a miss, once "
            "for this installation.") in text
    assert re.search(r"moesim: still compiling the replay kernel \(\d+ s\)", text), r.stderr
    assert re.search(r"moesim: compiled the replay kernel in \d+ s; later runs load it from numba's cache\.", text)
    assert text.index("compiling the replay kernel's") < text.index("still compiling") < text.index("compiled the")
    assert "Warning" not in r.stderr
    assert "waitpid" not in r.stderr
    assert not too_wide(r.stderr + r.stdout)


def test_the_ticker_tells_the_seconds_so_far_from_a_daemon_thread_until_stopped(monkeypatch):
    """``Ticker``: ``tell`` is called every ``MOESIM_PROGRESS_EVERY`` seconds with the seconds
    since the step began, from a daemon thread named for it (a step that never ends cannot keep
    the process alive); ``stop`` ends the thread, and nothing is told after it."""
    import itertools
    import threading
    import time

    from moesim.output.console import Ticker

    monkeypatch.setenv("MOESIM_PROGRESS_EVERY", "0.05")
    told: list[float] = []
    began = time.monotonic()
    ticker = Ticker(told.append)
    assert ticker._thread.daemon
    assert ticker._thread.name == "moesim-progress"
    assert "moesim-progress" in [t.name for t in threading.enumerate()]
    time.sleep(0.4)
    stopper = threading.Thread(target=lambda: told.append(-ticker.stop()), daemon=True)
    stopper.start()
    stopper.join(5)
    assert not stopper.is_alive(), "stop() did not return"
    ended = time.monotonic()
    took = -told.pop()
    assert not ticker._thread.is_alive()
    assert 0.4 <= took <= ended - began
    assert len(told) >= 3
    assert told == sorted(told)
    assert told[0] >= 0.05
    assert all(0 < t <= took for t in told)
    assert all(b - a >= 0.04 for a, b in itertools.pairwise(told))
    n = len(told)
    time.sleep(0.2)
    assert len(told) == n

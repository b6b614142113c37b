"""A rerun never shows stale results (issue 36, part 2): a finished sweep or compare point is
reused only when everything that determines it matches (the resolved scenario, the content of
its input files, the plugins' sources, the hardware profile, moesim's code); ``run`` says it
replaced a folder; two writers of one folder are refused."""

from __future__ import annotations

import fcntl
import json
import subprocess
import sys
from pathlib import Path

import pytest

from moesim.config.scenario import load_scenario
from moesim.errors import MoesimError
from moesim.simulator.engine import simulate
from moesim.studies import fingerprint
from moesim.studies.compare import compare
from moesim.studies.sweep import sweep
from moesim.traces.io import write_trace
from moesim.traces.synth import synth_from_preset

ROOT = Path(__file__).resolve().parents[1]
BASE = ("workload.trace.synth.tokens=20", "workload.trace.synth.requests=1", "sweep=null")
GRID = {"cache.capacity": ["5%", "25%"]}


def tpots(df) -> dict[str, float]:
    return dict(zip(df["cache.capacity"], df["tpot_s"], strict=True))


def test_a_changed_override_reruns_every_point_and_an_unchanged_one_reuses_them(tmp_path):
    """The issue's case: the same --out after changing the PCIe bandwidth from 32 to 5 GB/s
    gives the 5 GB/s figures (each equal to a fresh single run), not the 32 GB/s ones."""
    out = tmp_path / "s"
    fast = sweep("quickstart", str(out), GRID, (*BASE, "hardware.links.pcie.bandwidth_gbps=32"))
    assert fast.attrs["reused"] == 0
    slow = sweep("quickstart", str(out), GRID, (*BASE, "hardware.links.pcie.bandwidth_gbps=5"))
    assert slow.attrs["reused"] == 0
    for cap, tpot in tpots(slow).items():
        single = simulate(load_scenario("quickstart", [*BASE, "hardware.links.pcie.bandwidth_gbps=5",
                                                       f"cache.capacity={cap}"]))
        assert tpot == single.summary["tpot_s"]
        assert tpot > 2 * tpots(fast)[cap]
    again = sweep("quickstart", str(out), GRID, (*BASE, "hardware.links.pcie.bandwidth_gbps=5"))
    assert again.attrs["reused"] == 2
    assert tpots(again) == tpots(slow)


def test_a_trace_replaced_at_the_same_path_reruns_its_points(tmp_path):
    """The trace's content, not its path, keys reuse: a new file at the same path runs again;
    the same bytes reuse."""
    trace = tmp_path / "t.parquet"
    write_trace(synth_from_preset("olmoe-1b-7b", layers=4, tokens=12, seed=1), trace)
    sc = tmp_path / "s.yaml"
    sc.write_text(f"workload: {{trace: {{path: {trace}}}}}\n")
    out = tmp_path / "out"
    first = sweep(str(sc), str(out), GRID)
    write_trace(synth_from_preset("olmoe-1b-7b", layers=4, tokens=12, seed=2), trace)
    second = sweep(str(sc), str(out), GRID)
    assert second.attrs["reused"] == 0
    assert tpots(second) != tpots(first)
    assert sweep(str(sc), str(out), GRID).attrs["reused"] == 2


def test_the_fingerprint_covers_the_profile_plugins_and_code(tmp_path, monkeypatch):
    """A hardware profile's content, a plugin's source and moesim's own code each change the
    fingerprint; the scenario's path to the same content does not matter for the trace."""
    sc = load_scenario("quickstart", ["workload.trace.synth.tokens=5"])
    base = fingerprint.scenario_fingerprint(sc)
    assert fingerprint.scenario_fingerprint(sc) == base
    plugin = tmp_path / "p.py"
    plugin.write_text("X = 1\n")
    with_plugin = fingerprint.scenario_fingerprint(sc, [str(plugin)])
    assert with_plugin != base
    plugin.write_text("X = 2\n")
    assert fingerprint.scenario_fingerprint(sc, [str(plugin)]) != with_plugin
    prof = ROOT / "profiles" / "h100.yaml"
    mine = tmp_path / "h100.yaml"
    mine.write_text(prof.read_text())
    a = fingerprint.scenario_fingerprint(load_scenario("quickstart", [f"hardware.profile={mine}"]))
    mine.write_text(prof.read_text().replace("54.76", "44.76", 1))
    assert fingerprint.scenario_fingerprint(load_scenario("quickstart", [f"hardware.profile={mine}"])) != a
    monkeypatch.setattr(fingerprint, "code_digest", lambda: "another moesim")
    assert fingerprint.scenario_fingerprint(sc) != base


def test_a_point_without_a_recorded_fingerprint_runs_again(tmp_path):
    """A folder from before fingerprints (point.json without one) is not trusted."""
    out = tmp_path / "s"
    sweep("quickstart", str(out), GRID, BASE)
    for pj in (out / "points").glob("*/point.json"):
        data = json.loads(pj.read_text())
        del data["fingerprint"]
        pj.write_text(json.dumps(data))
    assert sweep("quickstart", str(out), GRID, BASE).attrs["reused"] == 0


def test_compare_into_the_same_folder_after_a_change_shows_the_new_figures(tmp_path):
    """The issue's compare case: the table after a batch-size change is the new scenario's."""
    out = tmp_path / "c"
    args = {"eviction": ["lru"], "prefetch": ["none"], "capacity": ["5%"]}
    one, _ = compare("quickstart", out, overrides=BASE, **args)
    four, _ = compare("quickstart", out, overrides=(*BASE, "workload.batch_size=4",
                                                    "workload.trace.synth.requests=4"), **args)
    assert four.attrs["reused"] == 0
    single = simulate(load_scenario("quickstart", [*BASE, "workload.batch_size=4", "workload.trace.synth.requests=4",
                                                   "cache.capacity=5%"]))
    lru = four[four["label"] == "lru + no prefetch"].iloc[0]
    assert lru["tpot_s"] == single.summary["tpot_s"]
    assert lru["tpot_s"] != one[one["label"] == "lru + no prefetch"].iloc[0]["tpot_s"]
    assert "batch 4" in (out / "compare.md").read_text()


def test_a_second_writer_of_a_folder_is_refused(tmp_path):
    out = tmp_path / "s"
    out.mkdir()
    with (out / ".lock").open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        with pytest.raises(MoesimError, match="being written by another moesim sweep or compare"):
            sweep("quickstart", str(out), GRID, BASE)
    assert not (out / "points").exists()
    assert sweep("quickstart", str(out), GRID, BASE).attrs["reused"] == 0


def test_run_into_an_existing_folder_says_it_replaced_it(tmp_path):
    out = tmp_path / "r"
    cmd = [sys.executable, "-m", "moesim", "run", "quickstart", "--set", "workload.trace.synth.tokens=5",
           "--out", str(out), "-q"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert "replace" not in first.stderr
    second = subprocess.run([*cmd, "--set", "cache.capacity=25%"], capture_output=True, text=True, timeout=300,
                            cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    assert "they replace the results that were there" in second.stderr
    assert "25%" in (out / "scenario.resolved.yaml").read_text()

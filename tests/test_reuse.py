"""A rerun never shows stale results (issue 36, part 2): a finished sweep or compare point is
reused only when everything that determines it matches (the resolved scenario, the content of
its input files, the plugins' sources, the hardware profile, moesim's code); ``run`` says it
replaced a folder; two writers of one folder are refused."""

from __future__ import annotations

import fcntl
import json
import shutil
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
from tests.helpers import too_wide, unwrap

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
    assert "they replace the results that were there" in unwrap(second.stderr)
    assert "25%" in (out / "scenario.resolved.yaml").read_text()


# -- a reused point is whole (issue 65) ------------------------------------------------------------
def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 64] = bytes(b ^ 0xFF for b in data[mid:mid + 64])
    path.write_bytes(bytes(data))


FAULTS = {
    "flipped": (_flip, "steps.parquet is not what was written (its SHA-256 differs)"),
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:1000]), "steps.parquet is 1,000 bytes"),
    "deleted": (lambda p: p.unlink(), "steps.parquet is missing"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_point_whose_files_do_not_match_what_was_written_runs_again_saying_why(tmp_path, fault):
    """The issue's faults: a finished point's steps.parquet with 64 bytes flipped, cut to 1,000
    bytes or deleted is not reused: the rerun says which point, which file and why, writes it
    again whole, and its rows are the ones an unharmed rerun reuses."""
    from moesim.studies.sweep import check_point

    out = tmp_path / "s"
    first = sweep("quickstart", str(out), GRID, BASE)
    pid = first["point"].iloc[0]
    steps = out / "points" / pid / "steps.parquet"
    rows = steps.read_bytes()
    harm, why = FAULTS[fault]
    harm(steps)
    again = sweep("quickstart", str(out), GRID, BASE)
    runs = again.attrs["runs"]
    assert (runs.reused, runs.ran) == (1, 1)
    assert list(runs.recomputed) == [pid]
    assert why in runs.recomputed[pid]
    assert "cache.capacity=" in runs.recomputed[pid]
    assert check_point(out / "points" / pid) is None
    assert steps.read_bytes() == rows
    assert tpots(again) == tpots(first)
    assert sweep("quickstart", str(out), GRID, BASE).attrs["runs"].reused == 2


def test_large_files_are_checked_by_size_unless_verify_is_asked(tmp_path, monkeypatch):
    """Files above the digest limit are checked by size at every rerun and by digest only with
    --verify: with the limit at 0 bytes, flipped bytes of the same size are reused without it
    and found with it; a summary.json changed in place is found either way below the limit."""
    from moesim.studies import sweep as S

    out = tmp_path / "s"
    first = sweep("quickstart", str(out), GRID, BASE)
    pid = first["point"].iloc[0]
    _flip(out / "points" / pid / "steps.parquet")
    monkeypatch.setattr(S, "DIGEST_ALWAYS", 0)
    assert sweep("quickstart", str(out), GRID, BASE).attrs["runs"].reused == 2
    checked = sweep("quickstart", str(out), GRID, BASE, verify=True).attrs["runs"]
    assert list(checked.recomputed) == [pid]
    monkeypatch.setattr(S, "DIGEST_ALWAYS", 16 << 20)
    summary = out / "points" / pid / "summary.json"
    summary.write_text(summary.read_text().replace('"hits"', '"hitz"'))
    assert "summary.json is not what was written" in sweep("quickstart", str(out), GRID, BASE).attrs[
        "runs"].recomputed[pid]


def test_a_point_from_before_file_records_runs_again(tmp_path):
    """A point.json with a fingerprint but no file sizes and digests (an older moesim's) is not
    trusted: the point runs again, saying so."""
    out = tmp_path / "s"
    sweep("quickstart", str(out), GRID, BASE)
    for pj in (out / "points").glob("*/point.json"):
        data = json.loads(pj.read_text())
        del data["files"]
        pj.write_text(json.dumps(data))
    runs = sweep("quickstart", str(out), GRID, BASE).attrs["runs"]
    assert runs.reused == 0
    assert all("older moesim" in why for why in runs.recomputed.values())


def test_a_compare_point_whose_files_do_not_match_runs_again(tmp_path):
    """compare's points are sweep points: one whose steps.parquet was deleted runs again and the
    table is the unharmed one."""
    out = tmp_path / "c"
    kw = {"eviction": ["lru"], "prefetch": ["none"], "overrides": BASE}
    table, _ = compare("quickstart", out, **kw)
    pid = table["point"].iloc[0]
    (out / "points" / pid / "steps.parquet").unlink()
    again, _ = compare("quickstart", out, **kw)
    runs = again.attrs["runs"]
    assert runs.ran == 1
    assert list(runs.recomputed) == [pid]
    assert again["tpot_s"].tolist() == table["tpot_s"].tolist()


def test_points_of_another_sweep_in_the_folder_are_named_and_pruned(tmp_path):
    """Two sweeps into one folder: the second names the first's points (their values) and
    leaves them; with prune it removes them, and the folder then holds its own points only."""
    out = tmp_path / "s"
    first = sweep("quickstart", str(out), {"cache.capacity": ["5%"]}, BASE)
    second = sweep("quickstart", str(out), {"cache.capacity": ["25%", "50%"]}, BASE)
    others = second.attrs["others"]
    assert [pid for pid, _ in others] == first["point"].tolist()
    assert others[0][1] == {"cache.capacity": "5%"}
    assert (out / "points" / others[0][0]).is_dir()
    pruned = sweep("quickstart", str(out), {"cache.capacity": ["25%", "50%"]}, BASE, prune=True)
    assert pruned.attrs["runs"].reused == 2
    assert sorted(d.name for d in (out / "points").iterdir()) == sorted(second["point"])


def test_the_command_line_says_what_it_reused_ran_again_and_left_in_80_columns(tmp_path):
    """``moesim sweep``: the counts, each point run again with its reason, the folder's other
    points with the --prune hint; every line fits 80 columns."""
    from click.testing import CliRunner

    from moesim.cli import cli

    out = tmp_path / "s"
    args = ["sweep", "quickstart", "--out", str(out), "--workers", "1", *(x for b in BASE for x in ("--set", b))]
    assert CliRunner().invoke(cli, [*args, "--grid", "cache.capacity=5%"]).exit_code == 0
    r = CliRunner().invoke(cli, [*args, "--grid", "cache.capacity=25%"])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "0 of 1 points reused" in text
    assert "1 point folders of" in text
    assert "cache.capacity=5%" in text
    assert "sweep --prune removes them" in text
    first = next(d for d in (out / "points").iterdir()
                 if json.loads((d / "point.json").read_text())["values"] == {"cache.capacity": "5%"})
    r = CliRunner().invoke(cli, [*args, "--grid", "cache.capacity=25%,5%"])
    text = " ".join(r.output.split())
    assert "2 of 2 points reused" in text
    (first / "steps.parquet").unlink()
    r = CliRunner().invoke(cli, [*args, "--grid", "cache.capacity=25%,5%"])
    text = " ".join(r.output.split())
    assert "1 of 2 points reused" in text
    assert f"point {first.name} (cache.capacity=5%: steps.parquet is missing); run again." in text
    assert not too_wide(r.output)


# -- every input that determines a result is in the key (issue 65) ----------------------------------
def _profile_edit(section: str):
    """A change to one table of a hardware profile (as ``calibrate fit`` writes it): the host
    link's fit, OLMoE's expert or non-expert times, or the host's cost of a CUDA call."""
    import yaml

    def edit(data: dict) -> None:
        if section == "links":
            data["links"]["h2d_pinned"]["bandwidth_gbps"] /= 2
        elif section in ("expert_time", "nonexpert_time"):
            table = data[section]["olmoe-1b-7b"]["bfloat16"]
            table["seconds"] = [2 * t for t in table["seconds"]]
        else:
            data["host"]["eager_kernel_us"] *= 3
    return lambda path: path.write_text(yaml.safe_dump((lambda d: (edit(d), d)[1])(yaml.safe_load(path.read_text()))))


@pytest.mark.parametrize("table", ["links", "expert_time", "nonexpert_time", "host"])
def test_a_change_to_any_table_of_a_hardware_profile_recomputes_the_points(tmp_path, table):
    """The profile reaches the results only through the hardware it builds (its file name is in
    the resolved scenario, its tables are not): a point replayed with the eager per-expert host
    (whose launches the host table times) is run again when any one table changes, and its
    time changes with it."""
    prof = tmp_path / "h100.yaml"
    prof.write_text((ROOT / "profiles" / "h100.yaml").read_text())
    over = (*BASE, f"hardware.profile={prof}", "execution.style=eager-per-expert", "expert_compute=per-expert")
    out = tmp_path / "s"
    before = sweep("quickstart", str(out), GRID, over)
    assert sweep("quickstart", str(out), GRID, over).attrs["runs"].reused == 2
    _profile_edit(table)(prof)
    after = sweep("quickstart", str(out), GRID, over)
    assert after.attrs["runs"].reused == 0
    assert all(after_t != before_t for after_t, before_t in zip(tpots(after).values(), tpots(before).values(),
                                                                 strict=True))


def test_a_change_to_the_arrival_file_recomputes_the_points(tmp_path):
    """A serving scenario's arrival file is read when the point runs: new arrivals at the same
    path run its points again."""
    arrivals = tmp_path / "arr.csv"
    arrivals.write_text("arrival_time,input_tokens,output_tokens\n0.0,16,4\n0.01,16,4\n")
    sc = tmp_path / "s.yaml"
    sc.write_text(json.dumps({"workload": {"trace": {"synth": {"preset": "olmoe-1b-7b", "requests": 2,
                                                               "prompt_tokens": 16, "tokens": 4, "layers": 2}},
                                           "arrivals": {"process": "file", "path": str(arrivals)}}}))
    out = tmp_path / "s"
    grid = {"cache.capacity": ["25%"]}
    first = sweep(str(sc), str(out), grid)
    assert sweep(str(sc), str(out), grid).attrs["runs"].reused == 1
    arrivals.write_text("arrival_time,input_tokens,output_tokens\n0.0,16,4\n0.5,16,4\n")
    again = sweep(str(sc), str(out), grid)
    assert again.attrs["runs"].reused == 0
    assert again["e2e_p99_s"].iloc[0] != first["e2e_p99_s"].iloc[0]


def test_a_change_to_the_expert_placement_file_recomputes_the_points(tmp_path):
    """Expert parallelism with a placement file: another placement at the same path runs the
    point again (and loads the GPUs otherwise)."""
    place = tmp_path / "place.yaml"
    place.write_text(json.dumps([0] * 32 + [1] * 32))
    over = (*BASE, "hardware.preset=h100-sxm-nvlink-x2", f"hardware.placement={place}")
    out = tmp_path / "s"
    grid = {"workload.batch_size": [1]}
    first = sweep("quickstart", str(out), grid, over)
    assert sweep("quickstart", str(out), grid, over).attrs["runs"].reused == 1
    place.write_text(json.dumps([0, 1] * 32))
    again = sweep("quickstart", str(out), grid, over)
    assert again.attrs["runs"].reused == 0
    assert again["max_experts_per_gpu"].iloc[0] != first["max_experts_per_gpu"].iloc[0]


def test_a_change_to_a_plugins_source_or_to_moesims_code_recomputes_the_points(tmp_path, monkeypatch):
    """A loaded plugin's source and moesim's own code are in the key: an edited plugin file (the
    same policy's new code) and another moesim (its code digest) each run the points again."""
    from moesim.policies import plugins
    from moesim.policies.eviction import REGISTRY

    monkeypatch.setattr(REGISTRY, "_classes", dict(REGISTRY._classes))  # the plugin's registration goes after
    monkeypatch.setattr(plugins, "_loaded", list(plugins._loaded))
    plugin = tmp_path / "reuse_plugin.py"
    plugin.write_text("from moesim.policies.eviction import REGISTRY\nfrom moesim.policies.eviction.lru import LRU\n"
                      "REGISTRY.register('reuse-test-lru')(type('ReuseLRU', (LRU,), {}))\n")
    plugins.load_plugins([str(plugin)], installed=False)
    over = (*BASE, "policies.eviction=reuse-test-lru")
    out = tmp_path / "s"
    sweep("quickstart", str(out), GRID, over)
    assert sweep("quickstart", str(out), GRID, over).attrs["runs"].reused == 2
    plugin.write_text(plugin.read_text() + "# a new version\n")
    assert sweep("quickstart", str(out), GRID, over).attrs["runs"].reused == 0
    assert sweep("quickstart", str(out), GRID, over).attrs["runs"].reused == 2
    monkeypatch.setattr(fingerprint, "code_digest", lambda: "another moesim")
    assert sweep("quickstart", str(out), GRID, over).attrs["runs"].reused == 0


def test_compare_under_load_counts_every_bisection_probe_reused_and_run(tmp_path):
    """compare --rate with an SLO: the counts cover the bisection's probes. A second run reuses
    every point it ran; after three points' folders are lost (as a run killed and rerun leaves
    them) a rerun runs exactly those three and reuses the rest, the same table."""
    from tests.test_serving import served

    data = served({"synth": {"preset": "olmoe-1b-7b", "requests": 2, "prompt_tokens": 16, "tokens": 4, "layers": 2}},
                  {"process": "poisson", "rate": 2.0, "requests": 8}, {"max_running": 2},
                  slo={"ttft_s": 0.05, "attainment": 0.75}, cache={"capacity": "40%"})
    sc = tmp_path / "s.yaml"
    sc.write_text(json.dumps(data))
    out = tmp_path / "c"
    kw = {"eviction": ["lfu"], "prefetch": ["none"], "rates": [2.0, 64.0], "seeds": 2}
    first, _ = compare(str(sc), out, **kw)
    runs = first.attrs["runs"]
    total = runs.ran
    assert runs.reused == 0
    assert total == first.attrs["points"] > 8  # lfu and the baseline x 2 rates x 2 seeds, and the probes
    assert total == sum(1 for d in (out / "points").iterdir() if d.is_dir())
    again, _ = compare(str(sc), out, **kw)
    assert (again.attrs["runs"].reused, again.attrs["runs"].ran) == (total, 0)
    lost = sorted(d for d in (out / "points").iterdir() if d.is_dir())[:3]
    for d in lost:
        shutil.rmtree(d)
    third, _ = compare(str(sc), out, **kw)
    assert (third.attrs["runs"].reused, third.attrs["runs"].ran) == (total - 3, 3)
    assert third.attrs["others"] == []
    pd_equal = third.drop(columns=["point"]).equals(first.drop(columns=["point"]))
    assert pd_equal

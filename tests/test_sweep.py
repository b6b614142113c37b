"""Sweeps: equal to single runs, resumable, failures recorded, atomic points; plots."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from moesim.config.scenario import load_scenario
from moesim.errors import MoesimError
from moesim.simulator.engine import simulate
from moesim.studies.sweep import done_points, sweep
from moesim.traces.io import write_trace
from moesim.traces.synth import synth_from_preset
from tests.helpers import unwrap
from tests.test_plugins import isolated_registries  # noqa: F401 (a fixture)

ROOT = Path(__file__).resolve().parents[1]
GRID = {"cache.capacity": ["5%", "25%"], "hardware.links.pcie.bandwidth_gbps": [5, 32]}
BASE = ("workload.trace.synth.tokens=40", "workload.trace.synth.requests=2", "sweep=null")  # only the tests' axes


def test_a_2x2_sweep_equals_four_single_runs(tmp_path):
    df = sweep("quickstart", str(tmp_path / "s"), GRID, BASE, workers=2)
    assert len(df) == 4
    assert (df["status"] == "ok").all()
    for _, row in df.iterrows():
        single = simulate(load_scenario("quickstart", [*BASE, f"cache.capacity={row['cache.capacity']}",
                                                      f"hardware.links.pcie.bandwidth_gbps={row['hardware.links.pcie.bandwidth_gbps']}"]))
        assert row["misses"] == single.summary["misses"]
        assert row["tpot_s"] == single.summary["tpot_s"]
        assert row["bytes_by_link.pcie.h2d"] == single.summary["bytes_by_link"]["pcie.h2d"]


def test_resume_does_no_work_and_zip_axes(tmp_path):
    out = tmp_path / "s"
    sweep("quickstart", str(out), GRID, BASE, workers=1)
    stamps = {p: (out / "points" / p / "summary.json").stat().st_mtime_ns for p in done_points(out)}
    calls = []
    df = sweep("quickstart", str(out), GRID, BASE, workers=1, progress=lambda d, f, n: calls.append((d, n)))
    assert calls == [(4, 4)]  # everything was already done
    assert {p: (out / "points" / p / "summary.json").stat().st_mtime_ns for p in done_points(out)} == stamps
    assert len(df) == 4
    sc = tmp_path / "z.yaml"
    sc.write_text("workload: {trace: {synth: {preset: olmoe-1b-7b, tokens: 20}}}\n"
                  "sweep:\n  axes:\n    cache.capacity: [5%, 25%]\n    policies.eviction: [lru, fifo]\n"
                  "  zip: [[cache.capacity, policies.eviction]]\n")
    z = sweep(str(sc), str(tmp_path / "z"), workers=1)
    assert sorted(zip(z["cache.capacity"], z["policies.eviction"], strict=True)) == [("25%", "fifo"), ("5%", "lru")]


# a policy that fails only while it replays: what a point can still hit after every point's
# replay was built (a bad value fails the whole sweep before anything runs)
FAILING_PLUGIN = """from moesim.errors import MoesimError
from moesim.policies.eviction import REGISTRY
from moesim.policies.eviction.lru import LRU


@REGISTRY.register("fails-when-full")
class FailsWhenFull(LRU):
    def candidates(self):
        raise MoesimError("fails-when-full: the cache is full")
"""


@pytest.mark.usefixtures("isolated_registries")
def test_a_failing_point_is_recorded_and_the_sweep_goes_on(tmp_path):
    from moesim.policies.plugins import load_plugins

    plugin = tmp_path / "failing.py"
    plugin.write_text(FAILING_PLUGIN)
    load_plugins([str(plugin)], installed=False)
    df = sweep("quickstart", str(tmp_path / "s"), {"policies.eviction": ["lru", "fails-when-full"]}, BASE, workers=1)
    assert sorted(df["status"]) == ["error", "ok"]
    err = df[df["status"] == "error"].iloc[0]
    assert "fails-when-full: the cache is full" in err["error"]


def test_a_bad_grid_value_fails_before_any_point_runs(tmp_path):
    """A value every point's replay would refuse (a precision the trace's model has no sizes
    for) fails the sweep up front, naming the point; nothing is written."""
    with pytest.raises(MoesimError, match=r"sweep point \{'cache.precision': 'fp8'\}.*Nothing was run"):
        sweep("quickstart", str(tmp_path / "s"), {"cache.precision": ["bf16", "fp8"]}, BASE, workers=1)
    assert not (tmp_path / "s").exists()


@pytest.mark.usefixtures("no_fork_server_beside_the_children")
def test_a_sweep_with_failed_points_exits_1_naming_each_and_retries_them(tmp_path):
    """The command exits 1 and names each failed point with its values and error; a rerun
    keeps the finished point and runs the failed one again (here it fails again)."""
    out = tmp_path / "s"
    plugin = tmp_path / "failing.py"
    plugin.write_text(FAILING_PLUGIN)
    cmd = [sys.executable, "-m", "moesim", "sweep", "quickstart", "--plugin", str(plugin), "--grid",
           "policies.eviction=lru,fails-when-full", *[a for b in BASE for a in ("--set", b)], "--workers", "1",
           "--out", str(out)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr
    assert "failed point" in unwrap(r.stderr)
    assert "(policies.eviction=fails-when-full)" in unwrap(r.stderr)
    assert "fails-when-full: the cache is full" in unwrap(r.stderr)
    assert "1 of 2 points failed" in unwrap(r.stderr)
    ok_point = next(d for d in (out / "points").iterdir() if (d / "summary.json").is_file())
    stamp = (ok_point / "summary.json").stat().st_mtime_ns
    (out / "points" / ".leftover.tmp-x").mkdir()  # what a killed sweep leaves behind
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1
    assert (ok_point / "summary.json").stat().st_mtime_ns == stamp
    assert not (out / "points" / ".leftover.tmp-x").exists()


def test_sweep_from_a_script_without_a_main_guard(tmp_path):
    """The worker processes do not import the calling script (which would rerun its
    top-level sweep and break the pool)."""
    script = tmp_path / "unguarded.py"
    script.write_text("import moesim\n"
                      f"df = moesim.sweep('quickstart', {str(tmp_path / 's')!r}, {{'cache.capacity': ['5%', '25%']}}, "
                      f"{BASE!r}, workers=2)\n"
                      "print('statuses', sorted(df['status']))\n")
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "statuses ['ok', 'ok']" in r.stdout


def test_bad_axes_fail_before_running(tmp_path):
    with pytest.raises(MoesimError, match=r"key 'cache\.capacty' is not a known key"):
        sweep("quickstart", str(tmp_path / "s"), {"cache.capacty": ["5%"]}, BASE)
    assert not (tmp_path / "s").exists()


@pytest.mark.usefixtures("no_fork_server_beside_the_children")
def test_a_killed_sweep_leaves_no_half_written_point_and_resumes(tmp_path):
    out = tmp_path / "s"
    cmd = [sys.executable, "-m", "moesim", "sweep", "quickstart", "--grid", "cache.capacity=1%,5%,10%,25%,50%,100%",
           "--set", "workload.trace.synth.tokens=150", "--set", "sweep=null", "--workers", "1", "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 60
    while time.time() < deadline and len(done_points(out)) < 2:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    points = out / "points"
    for d in points.iterdir():
        if d.name.startswith("."):
            continue  # an interrupted write stays in a hidden temporary folder
        assert (d / "summary.json").is_file()
        assert (d / "steps.parquet").is_file()
        assert (d / "scenario.resolved.yaml").is_file()
    before = done_points(out)
    assert 2 <= len(before) < 6
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    df = pd.read_parquet(out / "results.parquet")
    assert len(df) == 6
    assert (df["status"] == "ok").all()


def test_plots_carry_the_swept_values(tmp_path):
    from moesim.output.plots import figure, load_results, plot

    out = tmp_path / "s"
    sweep("quickstart", str(out), {**GRID, "policies.eviction": ["lru", "belady"]}, BASE, workers=2)
    df = load_results(str(out))
    assert df.attrs["axes"] == ["cache.capacity", "hardware.links.pcie.bandwidth_gbps", "policies.eviction"]
    heat = figure(df, "heatmap", "tpot_s", x="cache.capacity", y="hardware.links.pcie.bandwidth_gbps",
                  where=["policies.eviction=lru"])
    ax = heat.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["5%", "25%"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["5", "32"]
    assert ax.get_xlabel() == "cache capacity (% of all expert bytes)"
    assert ax.get_ylabel() == "PCIe bandwidth (GB/s)"
    assert "held fixed: eviction=lru" in heat._suptitle.get_text()
    # each cell is that (capacity, bandwidth) point's TPOT in ms, not a mean over policies
    lru = df[df["policies.eviction"] == "lru"]
    cell = lru[(lru["cache.capacity"] == "5%") & (lru["hardware.links.pcie.bandwidth_gbps"] == 5)]["tpot_s"]
    assert ax.texts[0].get_text() == f"{float(cell.iloc[0]) * 1e3:.3g}"
    lines = figure(df, "lines", "hit_rate", x="cache.capacity", by="policies.eviction",
                   facet="hardware.links.pcie.bandwidth_gbps")
    assert len(lines.axes) == 2
    labels = [ln.get_label() for ln in lines.axes[0].get_lines()]
    assert set(labels) == {"lru", "belady (bound)"}
    bound = next(ln for ln in lines.axes[0].get_lines() if ln.get_label() == "belady (bound)")
    assert bound.get_linestyle() == "--"
    assert list(bound.get_xdata()) == [5.0, 25.0]  # a numeric capacity axis, not categories
    bars = figure(df, "bars", "misses", x="policies.eviction", by="cache.capacity",
                  where=["hardware.links.pcie.bandwidth_gbps=32"])
    assert [t.get_text() for t in bars.axes[0].get_xticklabels()] == ["belady", "lru"]
    for kind, kw in [("heatmap", {"x": "cache.capacity", "y": "hardware.links.pcie.bandwidth_gbps",
                                  "where": ("policies.eviction=belady",)}),
                     ("lines", {"x": "cache.capacity", "by": "policies.eviction",
                                "facet": "hardware.links.pcie.bandwidth_gbps"}),
                     ("bars", {"x": "policies.eviction", "by": "hardware.links.pcie.bandwidth_gbps",
                               "where": ("cache.capacity=5%",)})]:
        f = plot(str(out), kind, str(tmp_path / f"{kind}.png"), "hit_rate", **kw)
        assert f.stat().st_size > 1000
    with pytest.raises(MoesimError, match=r"column 'tpot' .*is not in the results"):
        figure(df, "bars", "tpot", x="cache.capacity")
    assert json.loads((out / "points" / df["point"].iloc[0] / "point.json").read_text())["id"] == df["point"].iloc[0]


def test_plot_refuses_to_average_over_an_axis_it_does_not_show(tmp_path):
    """A heatmap of capacity x bandwidth over results that also vary the eviction policy
    would mix LRU with the Belady bound in every cell: refused with exit 2, naming the
    axis, its values and the three ways out; nothing is written."""
    from click.testing import CliRunner

    from moesim.cli import cli

    out = tmp_path / "s"
    sweep("quickstart", str(out), {**GRID, "policies.eviction": ["lru", "belady"]}, BASE, workers=2)
    png = tmp_path / "h.png"
    r = CliRunner().invoke(cli, ["plot", str(out), "--kind", "heatmap", "--metric", "tpot_s", "--x", "cache.capacity",
                                 "--y", "hardware.links.pcie.bandwidth_gbps", "--out", str(png)])
    assert r.exit_code == 2
    assert "'policies.eviction' (belady, lru)" in unwrap(r.output)
    assert "--by policies.eviction" in unwrap(r.output)
    assert "--facet policies.eviction" in unwrap(r.output)
    assert "--where policies.eviction=belady" in unwrap(r.output)
    assert not png.exists()
    r = CliRunner().invoke(cli, ["plot", str(out), "--kind", "lines", "--metric", "hit_rate", "--x", "cache.capacity",
                                 "--out", str(png)])
    assert r.exit_code == 2  # lines without --by would average the policies (and the bandwidths)
    assert "'hardware.links.pcie.bandwidth_gbps' (5, 32), 'policies.eviction' (belady, lru)" in unwrap(r.output)
    r = CliRunner().invoke(cli, ["plot", str(out), "--kind", "lines", "--metric", "hit_rate", "--x", "cache.capacity",
                                 "--by", "policies.eviction", "--where", "hardware.links.pcie.bandwidth_gbps=32",
                                 "--out", str(png)])
    assert r.exit_code == 0, r.output
    assert png.stat().st_size > 1000
    r = CliRunner().invoke(cli, ["plot", str(out), "--kind", "lines", "--metric", "hit_rate", "--x", "cache.capacity",
                                 "--by", "policies.eviction", "--where", "hardware.links.pcie.bandwidth_gbps=7",
                                 "--out", str(png)])
    assert r.exit_code == 2
    assert "matches no results; values of hardware.links.pcie.bandwidth_gbps: 5, 32" in unwrap(r.output)


def test_events_export_and_timeline(tmp_path):
    from moesim.output.events import chrome_trace, write_events
    from moesim.output.plots import plot_timeline
    from moesim.simulator.engine import Simulation

    sc = load_scenario("quickstart", [*BASE, "policies.prefetch=oracle", "cache.capacity=25%"])
    sim = Simulation(sc, record_transfers=True, record_layers=True)
    res = sim.run()
    doc = chrome_trace(res, sim.link_name, sim.model.num_experts, sim.num_prec)
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    compute = sorted((e for e in spans if e["tid"] == 0), key=lambda e: e["ts"])
    copies = [e for e in spans if e["tid"] == 1]
    assert len(copies) == res.summary["misses"] + res.summary["prefetches_issued"] - res.summary["prefetches_cancelled"]
    for a, b in itertools.pairwise(compute):  # the compute stream never overlaps itself
        assert a["ts"] + a["dur"] <= b["ts"] + 1e-6
    # per pass, the compute spans add up to the pass duration
    by_pass: dict[int, float] = {}
    for e in compute:
        by_pass[e["args"]["pass"]] = by_pass.get(e["args"]["pass"], 0.0) + e["dur"] / 1e6
    assert by_pass[5] == pytest.approx(res.steps["duration_s"].iloc[5], rel=1e-9)
    path = write_events(doc, tmp_path / "ev.json")
    img = plot_timeline(str(path), str(tmp_path / "tl.png"), window_ms=(0, 50))
    assert img.stat().st_size > 1000
    # the default view: the first decode pass, from its first layer's start to its end
    from moesim.output.plots import _one_pass

    steps = res.steps
    first = int(steps.index[steps["phase"] == "decode"][0])
    window, shown = _one_pass(spans)
    assert shown == (first, "decode")
    assert window == pytest.approx((steps["start_s"].iloc[first] * 1e3, steps["end_s"].iloc[first] * 1e3), rel=1e-9)
    assert plot_timeline(str(path), str(tmp_path / "one.png")).stat().st_size > 1000
    r = subprocess.run([sys.executable, "-m", "moesim", "run", "quickstart", "--no-write", "--quiet", "--set",
                        "workload.trace.synth.tokens=5", "--events", str(tmp_path / "e2.json")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "e2.json").read_text())["traceEvents"]


@pytest.mark.usefixtures("no_fork_server_beside_the_children")
@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::ResourceWarning")
def test_ray_executor_agrees_with_local(tmp_path):
    pytest.importorskip("ray")
    grid = {"cache.capacity": ["5%", "25%"], "policies.eviction": ["lru", "fifo"]}
    ray_df = sweep("quickstart", str(tmp_path / "r"), grid, BASE, workers=2, executor="ray")
    local = sweep("quickstart", str(tmp_path / "l"), grid, BASE, workers=2)
    cols = ["point", "misses", "hits", "tpot_s", "ttft_s", "stall_s"]
    a = ray_df.sort_values("point")[cols].reset_index(drop=True)
    b = local.sort_values("point")[cols].reset_index(drop=True)
    pd.testing.assert_frame_equal(a, b)


def test_shipped_sweep_sections_plan_the_papers_grids():
    """The shipped scenarios with a sweep: section plan (every point's scenario validated)
    into the grids their comments name: quickstart 4 capacities x 3 bandwidths x 3 evictions,
    SpecMD Table 1's 3 cache sizes x {LRU, Least-Stale}, MoE-Spec's 7 OLMoE budgets."""
    from moesim.studies.sweep import plan

    expected = {"quickstart": 36, "specmd/olmoe-config5": 6, "moe-spec/olmoe-tree63-budget32": 7}
    for name, n in expected.items():
        _, points, _ = plan(name, {})
        assert len(points) == n, name
    _, points, _ = plan("moe-spec/olmoe-tree63-budget32", {})
    assert sorted(p.values["policies.budget.budget"] for p in points) == [8, 16, 24, 32, 40, 48, 56]


def test_a_plot_title_names_the_model_trace_gpu_and_link_speed(tmp_path):
    """Issue 36: the figure says what setting it holds — the model, the trace, the GPU and its
    host link's bandwidth — except a swept axis, which the figure itself shows."""
    from moesim.output.plots import load_results

    out = tmp_path / "s"
    sweep("quickstart", str(out), {"cache.capacity": ["5%", "25%"]}, BASE)
    assert load_results(str(out)).attrs["setting"] == ("synthetic olmoe-1b-7b (2 x 64+40 tokens), "
                                                       "A100-80GB, pcie 32 GB/s")
    swept = tmp_path / "b"
    sweep("quickstart", str(swept), {"hardware.links.pcie.bandwidth_gbps": [5, 16]}, BASE)
    assert load_results(str(swept)).attrs["setting"] == "synthetic olmoe-1b-7b (2 x 64+40 tokens), A100-80GB"
    trace = tmp_path / "t.parquet"  # a trace file: the model from the results, then the file's name
    write_trace(synth_from_preset("olmoe-1b-7b", layers=2, tokens=8, seed=1), trace)
    named = tmp_path / "n"
    sweep("quickstart", str(named), {"cache.capacity": ["5%", "25%"]}, ("sweep=null", f"workload.trace.path={trace}"))
    assert load_results(str(named)).attrs["setting"] == "olmoe-1b-7b, t.parquet, A100-80GB, pcie 32 GB/s"


def test_a_points_process_is_handed_the_synthetic_trace_planning_made(tmp_path, monkeypatch):
    """Planning makes each synthetic trace once and hands it to the points (a quickstart point's
    process made it again: 0.7 s of its 1.7). The point handed it writes the same rows and
    summary as one that makes its own."""
    from dataclasses import replace

    import moesim.traces.synth as synth
    from moesim.studies.sweep import plan, run_point

    data, points, _ = plan("quickstart", {"cache.capacity": ["5%"]}, BASE)
    (pt,) = points
    assert pt.trace is not None
    made: list[int] = []
    real = synth.synth_from_preset

    def counted(*args, **kwargs):
        made.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(synth, "synth_from_preset", counted)
    assert run_point(dict(data), pt, str(tmp_path / "a"))[1] == "ok"
    assert made == []
    assert run_point(dict(data), replace(pt, trace=None), str(tmp_path / "b"))[1] == "ok"
    assert made == [1]
    a, b = (tmp_path / x / "points" / pt.pid for x in "ab")
    assert json.loads((a / "summary.json").read_text()) == json.loads((b / "summary.json").read_text())
    pd.testing.assert_frame_equal(pd.read_parquet(a / "steps.parquet"), pd.read_parquet(b / "steps.parquet"),
                                  check_exact=True)

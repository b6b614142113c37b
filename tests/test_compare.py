"""``moesim compare``: the ranking arithmetic by hand, the reference rows against independent
runs of the same scenario, the files it writes, and its refusals."""

from __future__ import annotations

import pandas as pd
import pytest
import yaml
from click.testing import CliRunner

from moesim.cli import cli
from moesim.config.scenario import scenario_from_dict
from moesim.simulator.engine import simulate
from moesim.studies.compare import compare, plan_compare, rank, recommendation, terminal
from tests.helpers import unwrap

SCENARIO = {
    "seed": 0,
    "hardware": {"preset": "a100-80g-pcie4"},
    "workload": {"trace": {"synth": {"preset": "olmoe-1b-7b", "layers": 4, "requests": 1, "prompt_tokens": 8,
                                     "tokens": 30}}, "batch_size": 1},
    "cache": {"capacity": "10%"},
    "policies": {"eviction": "lru", "miss": "fetch", "prefetch": "none"},
}


@pytest.fixture
def scenario_file(tmp_path):
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(SCENARIO))
    return path


def row(point, role, label, tpot, cap="5%"):
    return {"point": point, "role": role, "label": label, "capacity": cap, "tpot_s": tpot, "ttft_s": 0.5,
            "status": "ok", "tokens_per_s": 1 / tpot, "hit_rate": 0.5, "collision_misses": 3,
            "bytes_by_link.pcie.h2d": 2_000_000_000}


def test_ranking_speedup_and_gap_closed_by_hand():
    """Baseline 10 ms, bound 6 ms; candidates 8 ms and 5 ms and 11 ms.
    Ranked: 5 (rank 1), 8 (2), 11 (3). speedup = 10 / t: 2.0, 1.25, 0.909...;
    gap closed = (10 - t) / (10 - 6): 125% (better than the bound in time), 50%, -25%."""
    results = pd.DataFrame([row("a", "", "", 0.008), row("b", "", "", 0.005), row("c", "", "", 0.011),
                            row("base", "", "", 0.010), row("bnd", "", "", 0.006)])
    plan = [{"role": "candidate", "label": "A", "capacity": "5%", "point": "a"},
            {"role": "candidate", "label": "B", "capacity": "5%", "point": "b"},
            {"role": "candidate", "label": "C", "capacity": "5%", "point": "c"},
            {"role": "baseline", "label": "baseline", "capacity": "5%", "point": "base"},
            {"role": "bound", "label": "bound", "capacity": "5%", "point": "bnd"}]
    table, metric = rank(results.drop(columns=["role", "label", "capacity"]), plan)
    assert metric == "tpot_s"
    cands = table[table["role"] == "candidate"]
    assert cands["label"].tolist() == ["B", "A", "C"]
    assert cands["rank"].tolist() == [1, 2, 3]
    assert cands["speedup"].tolist() == pytest.approx([2.0, 1.25, 10 / 11], rel=1e-12)
    assert cands["gap_closed"].tolist() == pytest.approx([1.25, 0.5, -0.25], rel=1e-12)
    assert cands["metric_ms"].tolist() == pytest.approx([5.0, 8.0, 11.0], rel=1e-12)
    assert (table["bytes_moved"] == 2_000_000_000).all()
    refs = table[table["role"] != "candidate"]
    assert refs["gap_closed"].tolist() == pytest.approx([0.0, 1.0])
    assert recommendation(table, metric) == [
        "Best at 5%: B, 2.00x as fast as on-demand LRU (TPOT), closes 125% of the gap to the bound."]


def test_the_terminal_table_fits_80_columns_and_names_a_runner_up_within_1_percent():
    """Candidates 8.0 ms, 8.05 ms (within 1% of the best: named) and 9 ms; baseline 10 ms,
    bound 6 ms: the best closes (10 - 8) / 4 = 50% at 1.25x. A policy name longer than the
    column is cut with '~'; every line is at most 80 characters."""
    long = "least-stale + score-percentile + fetch-lowest-bit + xshare"
    results = pd.DataFrame([row("a", "", "", 0.008), row("b", "", "", 0.00805), row("c", "", "", 0.009),
                            row("base", "", "", 0.010), row("bnd", "", "", 0.006)])
    plan = [{"role": "candidate", "label": "A", "capacity": "5%", "point": "a"},
            {"role": "candidate", "label": long, "capacity": "5%", "point": "b"},
            {"role": "candidate", "label": "C", "capacity": "5%", "point": "c"},
            {"role": "baseline", "label": "on-demand LRU (baseline)", "capacity": "5%", "point": "base"},
            {"role": "bound", "label": "Belady + oracle prefetch (bound)", "capacity": "5%", "point": "bnd"}]
    table, metric = rank(results.drop(columns=["role", "label", "capacity"]), plan)
    text = terminal(table, metric, "moesim compare a-scenario-with-a-long-name.yaml: " + "x" * 60)
    assert max(len(line) for line in text.splitlines()) <= 80
    row2 = next(line for line in text.splitlines() if line.startswith(" 2 "))
    assert row2[3:].split("~")[0] in long
    assert long not in row2
    assert "Belady + oracle prefetch (bound)" in text
    assert recommendation(table, metric) == [
        f"Best at 5%: A, 1.25x as fast as on-demand LRU (TPOT), closes 50% of the gap to the bound; {long} "
        "is within 1%."]


def test_plan_shares_a_point_between_a_candidate_and_the_baseline(scenario_file):
    """lru + no prefetch with the scenario's fetch and no budget is the baseline itself:
    one run, two rows. 2 evictions x 2 prefetchers x 2 capacities + 2 x (baseline, bound)
    + infinite = 13 rows on 11 points (lru + none at each capacity is the baseline)."""
    _, points, rows = plan_compare(str(scenario_file), ["lru", "lfu"], ["none", "previous-token"],
                                   capacity=["5%", "25%"])
    assert len(rows) == 13
    assert len(points) == 11
    base = {r["capacity"]: r["point"] for r in rows if r["role"] == "baseline"}
    lru_none = {r["capacity"]: r["point"] for r in rows if r["label"] == "lru + no prefetch"}
    assert base == lru_none


def test_reference_rows_equal_independent_runs_and_the_files_are_written(scenario_file, tmp_path):
    out = tmp_path / "cmp"
    table, metric = compare(str(scenario_file), out, ["lru", "least-stale"], ["none"], workers=2)
    assert metric == "tpot_s"
    data = yaml.safe_load(scenario_file.read_text())

    def run(**pol):
        d = {**data, "policies": {**data["policies"], **pol}}
        return simulate(scenario_from_dict(d, where="test", base_dir=str(tmp_path))).summary

    base = run(eviction="lru", prefetch="none")
    bound = run(eviction="belady", prefetch="oracle")
    ls = run(eviction="least-stale", prefetch="none")
    by_role = table.set_index("label")
    assert by_role.loc["on-demand LRU (baseline)", "tpot_s"] == base["tpot_s"]
    assert by_role.loc["Belady + oracle prefetch (bound)", "tpot_s"] == bound["tpot_s"]
    assert by_role.loc["least-stale + no prefetch", "tpot_s"] == ls["tpot_s"]
    assert by_role.loc["least-stale + no prefetch", "gap_closed"] == pytest.approx(
        (base["tpot_s"] - ls["tpot_s"]) / (base["tpot_s"] - bound["tpot_s"]), rel=1e-12)
    inf = by_role.loc["all experts resident (infinite cache)"]
    assert (inf["misses"], inf["late_prefetches"], inf["bytes_moved"]) == (0, 0, 0)
    assert inf["tpot_s"] < bound["tpot_s"]
    saved = pd.read_parquet(out / "compare.parquet")
    assert saved["label"].tolist() == table["label"].tolist()
    md = (out / "compare.md").read_text()
    assert "| 1 | " in md
    assert "| | on-demand LRU (baseline) |" in md.replace("|  |", "| |")  # references are not ranked
    assert "None" not in md
    assert "on-demand LRU (baseline)" in md
    assert (out / "compare.png").stat().st_size > 0


def test_compare_command_prints_the_ranked_table(scenario_file, tmp_path):
    out = tmp_path / "c"
    r = CliRunner().invoke(cli, ["compare", str(scenario_file), "--eviction", "lru,fifo", "--prefetch", "none",
                                 "--out", str(out), "--workers", "1"])
    assert r.exit_code == 0, r.output
    assert "Belady + oracle prefetch (bound)" in unwrap(r.output)
    table = pd.read_parquet(out / "compare.parquet")
    cands = table[table["role"] == "candidate"]
    assert cands["tpot_s"].is_monotonic_increasing
    assert set(cands["label"]) == {"lru + no prefetch", "fifo + no prefetch"}


@pytest.mark.parametrize(("args", "says"), [
    (["--eviction", "lru,lrv"], "lrv"),
    (["--prefetch", "orakel"], "orakel"),
    (["--capacity", "250%"], "250%"),
])
def test_compare_refuses_bad_policies_before_running(scenario_file, tmp_path, args, says):
    out = tmp_path / "c"
    r = CliRunner().invoke(cli, ["compare", str(scenario_file), "--out", str(out), *args])
    assert r.exit_code == 2, r.output
    assert says in r.output
    assert "Traceback" not in r.output
    assert not (out / "points").exists()


def test_compare_refuses_an_output_folder_that_is_a_file(scenario_file, tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    r = CliRunner().invoke(cli, ["compare", str(scenario_file), "--out", str(target / "sub")])
    assert r.exit_code == 2
    assert "is a file, not a folder" in unwrap(r.output)


def test_defaults_add_the_gate_predictors_when_the_trace_has_them(scenario_file):
    _, _, rows = plan_compare(str(scenario_file))
    labels = {r["label"] for r in rows if r["role"] == "candidate"}
    assert labels == {f"{e} + {p}" for e in ("lru", "lfu", "fld", "least-stale")
                      for p in ("no prefetch", "previous-token")}
    _, _, rows = plan_compare(str(scenario_file), overrides=("workload.trace.synth.pred_next=true",))
    prefetchers = {r["label"].split(" + ")[1] for r in rows if r["role"] == "candidate"}
    assert prefetchers == {"no prefetch", "previous-token", "next-gate-topk", "score-percentile"}


def test_a_run_that_cannot_be_built_fails_before_any_runs(scenario_file, tmp_path):
    """next-gate-topk on a trace without pred_next (the scenario itself is valid): every
    point's replay is built before any runs, so compare exits 2 naming the point and the
    missing column, and writes no point."""
    r = CliRunner().invoke(cli, ["compare", str(scenario_file), "--eviction", "lru", "--prefetch", "next-gate-topk",
                                 "--out", str(tmp_path / "c"), "--workers", "1"])
    assert r.exit_code == 2, r.output
    assert "'policies.prefetch': 'next-gate-topk'" in unwrap(r.output)
    assert "pred_next" in r.output
    assert "Nothing was run" in unwrap(r.output)
    assert not (tmp_path / "c" / "points").exists()


@pytest.mark.usefixtures("no_fork_server_beside_the_children")
@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::ResourceWarning")
def test_compare_on_ray_equals_the_local_executor(scenario_file, tmp_path):
    pytest.importorskip("ray", reason="Ray is the optional extra 'ray' (CI installs it)")
    # Ray first: the cluster is shut down before the local executor's fork server starts
    ray, _ = compare(str(scenario_file), tmp_path / "r", ["lru", "fifo"], ["none"], workers=2, executor="ray")
    local, _ = compare(str(scenario_file), tmp_path / "l", ["lru", "fifo"], ["none"], workers=2)
    cols = ["label", "tpot_s", "hits", "misses", "gap_closed"]
    pd.testing.assert_frame_equal(local[cols], ray[cols])


def test_the_title_names_the_trace_hardware_link_speed_and_execution():
    """What a figure holds fixed is in its title (issue 36, part 4): the trace (a synthetic
    preset with its shape, or the file's name), the hardware preset and its host link's
    bandwidth, the batch, the execution mode with the per-expert fetch discipline, the seed."""
    from moesim.studies.compare import describe

    data = {"hardware": {"preset": "a100-80g-pcie4", "links": {"pcie": {"bandwidth_gbps": 5}}},
            "workload": {"trace": {"synth": {"preset": "olmoe-1b-7b", "requests": 2, "prompt_tokens": 8,
                                             "tokens": 30}}, "batch_size": 2},
            "expert_compute": "per-expert", "expert_fetch": "blocking", "seed": 3, "__base_dir__": "."}
    assert describe("s.yaml", data) == ("moesim compare s.yaml: synthetic olmoe-1b-7b (2 x 8+30 tokens); "
                                        "a100-80g-pcie4, pcie 5 GB/s; batch 2, per-expert (blocking fetch) "
                                        "execution, seed 3")

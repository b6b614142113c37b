"""``compare --rate``'s glue (:func:`moesim.studies.load.compare_load`) on a stand-in replay:
each point's files are written by hand (a policy meets the SLO up to a known rate), so the
points run, the rows pooled, the capacity found, the files written and the counts are all
known in advance, with no simulation."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pandas as pd
import pytest

from moesim.studies import load
from moesim.studies.sweep import Runs, RunsFailed
from tests.helpers import unwrap
from tests.test_serving import served

LIMIT = {"lru": 2.0, "lfu": 4.0}  # each policy meets the SLO (TTFT <= 0.5 s) up to this rate
SYNTH = {"synth": {"preset": "olmoe-1b-7b", "requests": 2, "prompt_tokens": 8, "tokens": 2, "layers": 2}}


def fake_run(ran: list[list[dict]], calls: list[tuple] | None = None, fail_at: float | None = None):
    """A stand-in for ``run_points``: writes each point's summary and requests as a replay
    would (4 requests a point, TTFT 0.1 s within the policy's limit rate, 1 s above; seed s
    realises the rate times 1 + s/100) and counts what it was handed."""

    def run(data, points, out, workers, executor, address, progress, verify):
        ran.append([pt.values for pt in points])
        if calls is not None:
            calls.append((data.get("seed"), workers, executor, address, progress, verify))
        runs = Runs()
        for pt in points:
            d = Path(out) / "points" / pt.pid
            if (d / "summary.json").is_file():
                runs.reused += 1
                continue
            runs.ran += 1
            d.mkdir(parents=True, exist_ok=True)
            rate, seed = pt.values[load.RATE], pt.values.get(load.SEED, 0)
            if rate == fail_at:
                (d / "error.json").write_text(json.dumps({"error": "boom"}))
                (d / "point.json").write_text(json.dumps({"id": pt.pid, "values": pt.values}))
                continue
            ok = rate <= LIMIT[pt.values["policies.eviction"]]
            ttft = 0.1 if ok else 0.05  # above its limit a policy is fast to first token but misses TPOT
            pd.DataFrame({"arrival_s": [0.0, 1.0, 2.0, 3.0], "ttft_s": [ttft] * 4, "tpot_s": [0.01 if ok else 0.1] * 4,
                          "e2e_s": [1.0] * 4, "queue_s": [0.0] * 4, "finish_s": [1.0, 2.0, 3.0, 4.0],
                          "output_tokens": [2] * 4, "itl_max_s": [0.01] * 4, "preemptions": [0] * 4,
                          "recomputed_tokens": [0] * 4}).to_parquet(d / "requests.parquet")
            (d / "summary.json").write_text(json.dumps({
                "slo_attainment": float(ok), "ttft_p99_s": ttft, "ttft_p50_s": ttft, "tpot_p99_s": 0.01,
                "tpot_p50_s": 0.01, "itl_p99_s": 0.01, "itl_p50_s": 0.01, "requests_per_s": rate,
                "goodput_requests_s": rate * ok, "throughput_tokens_s": 2 * rate, "offered_rate": rate * (1 + seed / 100),
                "hit_rate": 0.5}))
            (d / "point.json").write_text(json.dumps({"id": pt.pid, "values": pt.values}))
        return runs

    return run


@pytest.fixture
def world(tmp_path, monkeypatch):
    ran: list[list[dict]] = []
    monkeypatch.setattr(load, "run_points", fake_run(ran))
    data = served(SYNTH, {"process": "poisson", "rate": 1.0, "requests": 4},
                  slo={"ttft_s": 0.5, "tpot_s": 0.02, "itl_s": 0.03, "attainment": 0.9})
    p = tmp_path / "s.yaml"
    p.write_text(json.dumps(data))
    return tmp_path, p, data, ran


def go(p: Path, data: dict, out: Path, seeds: int = 2, **kw):
    args = {"eviction": ["lfu", "lru"], "prefetch": ["none"], "capacity": None, "rates": [1.0, 8.0]} | kw
    return load.compare_load("s", p, copy.deepcopy(data), out, args["eviction"], args["prefetch"], args["capacity"],
                             args["rates"], False, {}, 1, "local", None, None, "T", seeds=seeds)


def test_the_capacity_search_on_a_stand_in_replay(world):
    """lfu meets up to 4 req/s and lru (the baseline too) up to 2: from rates 1 and 8 the
    search (every probe with both seeds; the baseline and the lru candidate one run) closes a
    5% bracket around each limit; the capacity table ranks lfu first against the baseline,
    with the realised rate the seeds' mean (1 + s/100 of the rate); each file written; every
    point handed out counted."""
    tmp_path, p, data, ran = world
    out = tmp_path / "c"
    calls: list[tuple] = []
    load.run_points = fake_run(ran, calls)  # the fixture's monkeypatch restores the real one
    table, metric = go(p, data, out)
    assert metric == "ttft_p99_s"
    assert table.attrs["metric"] == "ttft_p99_s"
    assert {c[-1] for c in calls} == {False}  # verify only when asked
    first = ran[0]
    assert len(first) == 8  # lfu and lru (the baseline with it) x 2 rates x 2 seeds
    assert sorted({(v["policies.eviction"], v[load.RATE], v[load.SEED]) for v in first}) == [
        (ev, r, s) for ev in ("lfu", "lru") for r in (1.0, 8.0) for s in (0, 1)]
    assert all(len(batch) % 2 == 0 for batch in ran)  # every probe with both seeds
    cap = pd.read_parquet(out / "capacity.parquet").set_index("label")
    assert cap.loc["lfu", "capacity_rps"] <= 4.0 < cap.loc["lfu", "fails_at_rps"] <= cap.loc["lfu", "capacity_rps"] * 1.05
    assert cap.loc["lru", "capacity_rps"] <= 2.0 < cap.loc["lru", "fails_at_rps"] <= cap.loc["lru", "capacity_rps"] * 1.05
    assert cap.loc["on-demand LRU (baseline)", "capacity_rps"] == cap.loc["lru", "capacity_rps"]
    assert cap.loc["lfu", "vs_baseline"] == cap.loc["lfu", "capacity_rps"] / cap.loc["lru", "capacity_rps"]
    assert cap.loc["lfu", "rank"] == 1
    assert cap.loc["lru", "rank"] == 2
    assert pd.isna(cap.loc["on-demand LRU (baseline)", "rank"])
    assert cap.loc["lfu", "realised_rps"] == pytest.approx(cap.loc["lfu", "capacity_rps"] * 1.005)
    assert (cap.loc["lfu", "capacity_low_rps"], cap.loc["lfu", "capacity_high_rps"]) == (
        cap.loc["lfu", "capacity_rps"], cap.loc["lfu", "capacity_rps"])
    assert "curve" not in cap.columns
    saved = pd.read_parquet(out / "compare.parquet")
    assert saved["rate"].tolist() == [1.0, 1.0, 1.0, 8.0, 8.0, 8.0]
    assert saved["label"].tolist()[:3] == ["lfu", "lru", "on-demand LRU (baseline)"]
    assert "values" not in saved.columns
    assert saved["seeds"].tolist() == [2] * 6
    assert saved[["label", "rate", "ttft_p99_s", "slo_attainment"]].equals(
        table[["label", "rate", "ttft_p99_s", "slo_attainment"]])
    runs = table.attrs["runs"]
    points = sum(len(b) for b in ran)
    assert (runs.reused, runs.ran) == (0, points)
    assert table.attrs["points"] == points
    assert table.attrs["capacity"]["label"].tolist() == cap.index.tolist()
    md = (out / "compare.md").read_text()
    assert md.startswith("# T\n\n## Highest request rate meeting the SLO (TTFT <= 500 ms and TPOT <= 20 ms and "
                         "every ITL <= 30 ms for 90% of requests)")
    assert (out / "compare.png").stat().st_size > 10_000
    assert "lfu serves" in table.attrs["text"]
    assert table.attrs["others"] == []
    again, _ = go(p, data, out)
    assert (again.attrs["runs"].reused, again.attrs["runs"].ran) == (points, 0)
    assert pd.read_parquet(out / "capacity.parquet").set_index("label")["capacity_rps"].equals(cap["capacity_rps"])


def test_without_an_slo_no_capacity_and_an_old_capacity_file_goes(world):
    """No slo: one round of points (no search), no capacity table; a capacity.parquet an earlier
    run with an SLO left is removed, not left to be read as this run's."""
    tmp_path, p, data, ran = world
    out = tmp_path / "c"
    out.mkdir()
    (out / "capacity.parquet").write_text("old")
    plain = {k: v for k, v in data.items() if k != "slo"}
    table, _ = go(p, plain, out, seeds=1)
    assert len(ran) == 1
    assert not (out / "capacity.parquet").exists()
    assert "capacity" not in table.attrs
    assert "Give the scenario an slo" in table.attrs["text"]
    assert table["slo_attainment"].isna().all()


def test_the_arguments_travel_the_ranking_uses_the_slo_and_a_failed_probe_is_named(tmp_path, monkeypatch):
    """The caller's workers, executor, address, progress and verify reach every round of
    runs; the plan's prefetch and cache capacity are the caller's; the trace loaded once is
    kept in the caller's dict. At 3 req/s lfu meets the SLO and lru misses it with a faster
    first token: ranked by attainment, lfu comes first. Capacities of two caches are both in
    the table, rank first, its index not written; lfu and fifo, with equal limits, tie and
    are ranked by label; the baseline's capacity below 1 req/s still divides. The figure gets
    the capacity table and the SLO. A probe whose run fails stops the search naming it; a
    stale point is listed, and removed with prune."""
    import pyarrow.parquet as pq

    ran: list[list[dict]] = []
    calls: list[tuple] = []
    monkeypatch.setitem(LIMIT, "fifo", 4.0)
    monkeypatch.setitem(LIMIT, "lru", 0.5)
    monkeypatch.setattr(load, "run_points", fake_run(ran, calls))
    seen = {}
    real_figure = load.figure_load

    def figure(table, cap_table, title, slo):
        seen.update(cap=cap_table, slo=slo)
        return real_figure(table, cap_table, title, slo)

    monkeypatch.setattr(load, "figure_load", figure)
    data = served(SYNTH, {"process": "poisson", "rate": 1.0, "requests": 4},
                  slo={"ttft_s": 0.5, "tpot_s": 0.02, "attainment": 0.9})
    p = tmp_path / "s.yaml"
    p.write_text(json.dumps(data))
    out = tmp_path / "c"
    stale = out / "points" / "old"
    stale.mkdir(parents=True)
    (stale / "point.json").write_text(json.dumps({"values": {"cache.capacity": "9%"}}))
    traces: dict = {}

    def progress(*a):
        return None

    table, _ = load.compare_load("s", p, copy.deepcopy(data), out, ["lfu", "fifo", "lru"], ["oracle"],
                                 ["40%", "10%"], [1.0, 3.0], False, traces, 3, "local", "ray://x", progress,
                                 "T", verify=True, seeds=2)
    assert {c[1:] for c in calls} == {(3, "local", "ray://x", progress, True)}
    assert len(calls) > 1
    assert len(traces) == 1
    assert {v["policies.prefetch"] for b in ran for v in b} == {"oracle", "none"}  # the baseline: none
    assert {v["cache.capacity"] for b in ran for v in b} == {"40%", "10%"}
    at3 = table[(table["rate"] == 3.0) & (table["capacity"] == "40%")]
    assert at3["label"].tolist()[:3] == ["fifo + oracle", "lfu + oracle", "lru + oracle"]
    cap = pd.read_parquet(out / "capacity.parquet")
    assert list(cap.columns[:2]) == ["rank", "role"]
    assert "__index_level_0__" not in pq.read_schema(out / "capacity.parquet").names
    assert "__index_level_0__" not in pq.read_schema(out / "compare.parquet").names
    assert cap["capacity"].tolist() == ["40%"] * 4 + ["10%"] * 4
    here = cap[cap["capacity"] == "40%"]
    assert here["label"].tolist() == ["fifo + oracle", "lfu + oracle", "lru + oracle", "on-demand LRU (baseline)"]
    base = here["capacity_rps"].iloc[3]
    assert base < 1
    assert here["vs_baseline"].iloc[0] == here["capacity_rps"].iloc[0] / base
    assert seen["cap"] is not None
    assert seen["slo"].tpot_s == 0.02
    assert table.attrs["reused"] == 0
    assert table.attrs["pruned"] is False
    assert table.attrs["title"] == "T"
    assert "TTFT <= 500 ms and TPOT <= 20 ms for 90% of requests" in unwrap(table.attrs["text"])
    assert [pid for pid, _ in table.attrs["others"]] == ["old"]
    assert stale.is_dir()
    ran.clear()
    monkeypatch.setattr(load, "run_points", fake_run(ran, None, fail_at=0.5))
    with pytest.raises(RunsFailed, match=r"^compare: a bisection run failed: boom$"):
        go(p, data, tmp_path / "d", eviction=["lru"], rates=[1.0, 2.0], seeds=1)
    pruned, _ = load.compare_load("s", p, copy.deepcopy(data), out, ["lfu"], ["oracle"], ["40%"], [1.0], False, {},
                                  1, "local", None, None, "T", prune=True, seeds=1)
    assert pruned.attrs["pruned"] is True
    assert not stale.exists()


def test_the_plan_and_the_probes_get_the_callers_trace_cache_and_predictor_flag(world, monkeypatch):
    """The caller's dict of loaded traces and its has_pred_next reach the plan, and the dict
    reaches every round of probes; an SLO of TPOT alone, or of TTFT alone, is told as such."""
    tmp_path, p, data, _ = world
    seen: dict[str, list] = {"plan": [], "probes": []}
    real_plan, real_points = load.plan_load, load.seed_points

    def plan(*a):
        seen["plan"].append((a[6], a[7]))
        return real_plan(*a[:6], False, *a[7:])

    def points(p_, data_, groups, seeds, traces):
        seen["probes"].append(traces)
        return real_points(p_, data_, groups, seeds, traces)

    monkeypatch.setattr(load, "plan_load", plan)
    traces: dict = {}
    only_tpot = {**data, "slo": {"tpot_s": 0.02, "attainment": 0.9}}
    table, _ = load.compare_load("s", p, copy.deepcopy(only_tpot), tmp_path / "c", ["lfu"], ["none"], None,
                                 [1.0, 8.0], True, traces, 1, "local", None, None, "T", seeds=1)
    assert seen["plan"] == [(True, traces)]
    assert "SLO (TPOT <= 20 ms for 90% of requests)" in unwrap(table.attrs["text"])
    monkeypatch.setattr(load, "seed_points", points)
    only_ttft = {**data, "slo": {"ttft_s": 0.5, "attainment": 0.9}}
    table, _ = load.compare_load("s", p, copy.deepcopy(only_ttft), tmp_path / "d", ["lfu"], ["none"], None,
                                 [1.0, 8.0], False, traces, 1, "local", None, None, "T", seeds=1)
    assert seen["probes"]
    assert all(t is traces for t in seen["probes"])
    assert "SLO (TTFT <= 500 ms for 90% of requests)" in unwrap(table.attrs["text"])

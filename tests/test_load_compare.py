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
from moesim.studies.sweep import Runs
from tests.test_serving import served

LIMIT = {"lru": 2.0, "lfu": 4.0}  # each policy meets the SLO (TTFT <= 0.5 s) up to this rate
SYNTH = {"synth": {"preset": "olmoe-1b-7b", "requests": 2, "prompt_tokens": 8, "tokens": 2, "layers": 2}}


def fake_run(ran: list[list[dict]]):
    """A stand-in for ``run_points``: writes each point's summary and requests as a replay
    would (4 requests a point, TTFT 0.1 s within the policy's limit rate, 1 s above; seed s
    realises the rate times 1 + s/100) and counts what it was handed."""

    def run(data, points, out, workers, executor, address, progress, verify):
        ran.append([pt.values for pt in points])
        runs = Runs()
        for pt in points:
            d = Path(out) / "points" / pt.pid
            if (d / "summary.json").is_file():
                runs.reused += 1
                continue
            runs.ran += 1
            d.mkdir(parents=True, exist_ok=True)
            rate, seed = pt.values[load.RATE], pt.values.get(load.SEED, 0)
            ok = rate <= LIMIT[pt.values["policies.eviction"]]
            ttft = 0.1 if ok else 1.0
            pd.DataFrame({"arrival_s": [0.0, 1.0, 2.0, 3.0], "ttft_s": [ttft] * 4, "tpot_s": [0.01] * 4,
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
                  slo={"ttft_s": 0.5, "attainment": 0.9})
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
    table, metric = go(p, data, out)
    assert metric == "ttft_p99_s"
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
    assert md.startswith("# T\n\n## Highest request rate meeting the SLO (TTFT <= 500 ms for 90% of requests)")
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

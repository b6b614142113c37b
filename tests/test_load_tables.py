"""``compare --rate``'s plan and tables (:mod:`moesim.studies.load`) on inputs made by hand: the
points planned for each rate and capacity, the arrival file's rate, the ranking per (capacity,
rate), and the Markdown and terminal tables, every figure worked out in advance."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from moesim.errors import MoesimError
from moesim.studies import load
from tests.helpers import unwrap
from tests.test_serving import served

SYNTH = {"synth": {"preset": "olmoe-1b-7b", "requests": 2, "prompt_tokens": 8, "tokens": 2, "layers": 2}}


def scenario(tmp_path: Path, arrivals: dict) -> tuple[Path, dict]:
    data = served(SYNTH, arrivals)
    p = tmp_path / "s.yaml"
    p.write_text("")
    return p, data


def test_plan_covers_every_policy_capacity_and_rate_with_the_baseline(tmp_path: Path) -> None:
    """Two evictions x the served prefetchers at two capacities and two rates: a candidate row
    per combination, a baseline row per (capacity, rate), rows in that order, each row's
    points one per arrival seed (the scenario's seed, 0, and the next), carrying its values;
    the baseline is the LRU candidate run once (the same resolved scenario: under load the
    miss and budget policies are always the baseline's), so 2 x 2 x 2 x 2 points."""
    p, data = scenario(tmp_path, {"process": "poisson", "rate": 1.0, "requests": 4})
    points, rows = load.plan_load(p, copy.deepcopy(data), ["lru", "lfu"], None, ["5%", "25%"], [2.0, 8.0], False, {},
                                  seeds=2)
    assert [(r["role"], r["label"], r["capacity"], r["rate"]) for r in rows] == [
        (role, label, cap, rate) for cap in ("5%", "25%") for rate in (2.0, 8.0)
        for role, label in (("candidate", "lru"), ("candidate", "lfu"), ("baseline", "on-demand LRU (baseline)"))]
    values = {pt.pid: pt.values for pt in points}
    assert len(points) == 16
    for r in rows:
        pids = r["point"].split("+")
        assert [values[pid][load.SEED] for pid in pids] == [0, 1]
        for pid in pids:
            v = values[pid]
            assert v["cache.capacity"] == r["capacity"]
            assert v[load.RATE] == r["rate"]
            assert v["policies.eviction"] in (r["label"], "lru")
            assert v["policies.prefetch"] == "none"
        if r["role"] == "baseline":
            assert r["point"] == next(x["point"] for x in rows if x["label"] == "lru" and x["capacity"] == r["capacity"]
                                      and x["rate"] == r["rate"])
    traces: dict = {}
    same, _ = load.plan_load(p, copy.deepcopy(data), ["lru", "lru"], ["none"], None, [2.0], False, traces, seeds=1)
    assert len(same) == 1  # lru twice and the baseline: one run
    assert len(traces) == 1  # the trace loaded once, kept for the caller (the bisection's points)
    picked, rows = load.plan_load(p, copy.deepcopy(data), ["lru"], ["oracle"], None, [2.0], False, {}, seeds=1)
    assert [r["label"] for r in rows] == ["lru + oracle", "on-demand LRU (baseline)"]
    assert len(picked) == 2
    with pytest.raises(MoesimError, match="--seeds must be at least 1"):
        load.plan_load(p, copy.deepcopy(data), ["lru"], ["none"], None, [2.0], False, {}, seeds=0)


def test_the_arrival_seeds_follow_the_scenarios_and_a_file_draws_once(tmp_path: Path) -> None:
    """The seeds run: the arrivals' own seed and the next ones, else the scenario's; an
    arrival file has no draw, so one run (no seed axis) whatever --seeds says."""
    assert load.seed_values({"seed": 7, "workload": {"arrivals": {"process": "poisson"}}}, 3) == [7, 8, 9]
    assert load.seed_values({"seed": 7, "workload": {"arrivals": {"process": "gamma", "seed": 40}}}, 2) == [40, 41]
    assert load.seed_values({"workload": {"arrivals": {"process": "poisson"}}}, 1) == [0]
    assert load.seed_values({"seed": 7, "workload": {"arrivals": {"process": "file"}}}, 5) == [None]


def test_plan_defaults_the_policies_capacity_and_rate_from_the_scenario(tmp_path: Path) -> None:
    """No --eviction: the served evictions; no --prefetch: none, and the predictor prefetchers
    when the trace has pred_next; no --capacity: the scenario's (5% when it gives none); no
    --rate: the scenario's arrival rate."""
    p, data = scenario(tmp_path, {"process": "poisson", "rate": 3.0, "requests": 4})
    data = {**data, "cache": {"capacity": "10%"}}
    _, rows = load.plan_load(p, copy.deepcopy(data), None, None, None, None, False, {})
    cands = [r["label"] for r in rows if r["role"] == "candidate"]
    assert cands == list(load.SERVED_EVICTION)
    assert {r["capacity"] for r in rows} == {"10%"}
    assert {r["rate"] for r in rows} == {3.0}
    pred = {k: copy.deepcopy(v) for k, v in data.items() if k != "cache"}
    pred["workload"]["trace"]["synth"]["pred_next"] = True
    _, rows = load.plan_load(p, pred, ["lru"], None, None, None, True, {})
    assert [r["label"] for r in rows if r["role"] == "candidate"] == [
        "lru", "lru + next-gate-topk", "lru + score-percentile"]
    assert {r["capacity"] for r in rows} == {"5%"}


@pytest.mark.parametrize("rate", [0.0, -1.0, float("inf"), float("nan")])
def test_plan_refuses_a_rate_that_is_not_a_positive_number(tmp_path: Path, rate: float) -> None:
    p, data = scenario(tmp_path, {"process": "poisson", "rate": 1.0, "requests": 4})
    with pytest.raises(MoesimError, match="every rate must be a positive number of requests per second"):
        load.plan_load(p, data, ["lru"], None, None, [2.0, rate], False, {})


def test_the_arrival_file_s_rate_and_its_refusal(tmp_path: Path) -> None:
    """Four arrivals over 3 s: (4 - 1) / 3 requests/s, read relative to the scenario's folder
    and rounded to 4 significant figures for the plan; one arrival spans no time: refused,
    naming the file and the fix."""
    (tmp_path / "arr.csv").write_text("timestamp,input_tokens,output_tokens\n0,8,2\n1,8,2\n2.5,8,2\n3,8,2\n")
    p, data = scenario(tmp_path, {"process": "file", "path": "arr.csv"})
    assert load.file_rate(data, str(tmp_path), "s.yaml") == 1.0
    (tmp_path / "arr.csv").write_text("timestamp,input_tokens,output_tokens\n0,8,2\n1,8,2\n7,8,2\n")
    assert load.file_rate(data, str(tmp_path), "s.yaml") == pytest.approx(2 / 7, rel=1e-15)
    points, rows = load.plan_load(p, data, ["lru"], None, None, None, False, {})
    assert {r["rate"] for r in rows} == {0.2857}
    assert len(points) == 1  # a file draws nothing: no seed axis, and the baseline is the lru candidate
    assert load.SEED not in points[0].values
    (tmp_path / "one.csv").write_text("timestamp,input_tokens,output_tokens\n5,8,2\n")
    _, one = scenario(tmp_path, {"process": "file", "path": str(tmp_path / "one.csv")})
    with pytest.raises(MoesimError, match=f"^{tmp_path / 's.yaml'}: the arrival file"):
        load.plan_load(p, copy.deepcopy(one), ["lru"], None, None, None, False, {})
    with pytest.raises(MoesimError) as err:
        load.file_rate(one, "/elsewhere", "s.yaml")
    assert "s.yaml: the arrival file" in str(err.value)
    assert "one.csv spans no time" in str(err.value)
    assert str(err.value).endswith("give --rate R1,R2,... (its timestamps are rescaled to each).")


@pytest.mark.parametrize(("times", "arrivals", "rate"), [
    ([0, 2], {}, 0.5),  # two arrivals are enough
    ([0, 0.5], {}, 2.0),  # a span under a second
    ([0, 0, 2], {}, 1.0),  # the span is the last arrival's time
    ([0, 1, 3, 9], {"requests": 3}, 2 / 3),  # the first `requests` rows only
])
def test_the_arrival_file_s_rate_over_its_rows(tmp_path: Path, times: list[float], arrivals: dict,
                                               rate: float) -> None:
    rows = "".join(f"{t},8,2\n" for t in times)
    (tmp_path / "arr.csv").write_text("timestamp,input_tokens,output_tokens\n" + rows)
    _, data = scenario(tmp_path, {"process": "file", "path": "arr.csv", **arrivals})
    assert load.file_rate(data, str(tmp_path), "s.yaml") == pytest.approx(rate, rel=1e-15)


def test_the_arrival_file_s_rate_skips_failed_requests_as_the_replay_does(tmp_path: Path) -> None:
    """A row of 0 output tokens (a failed request) is skipped by default, so the rate is over
    the rest; with skip_zero_output false the file is refused, as the replay refuses it; two
    arrivals at the same instant span no time."""
    (tmp_path / "arr.csv").write_text("timestamp,input_tokens,output_tokens\n0,8,2\n1,8,2\n2,8,0\n4,8,2\n")
    _, data = scenario(tmp_path, {"process": "file", "path": "arr.csv"})
    assert load.file_rate(data, str(tmp_path), "s.yaml") == 0.5  # 0, 1, 4: (3 - 1) / 4
    _, strict = scenario(tmp_path, {"process": "file", "path": "arr.csv", "skip_zero_output": False})
    with pytest.raises(MoesimError, match="0 output tokens"):
        load.file_rate(strict, str(tmp_path), "s.yaml")
    (tmp_path / "same.csv").write_text("timestamp,input_tokens,output_tokens\n3,8,2\n3,8,2\n")
    _, same = scenario(tmp_path, {"process": "file", "path": "same.csv"})
    with pytest.raises(MoesimError, match="spans no time"):
        load.file_rate(same, str(tmp_path), "s.yaml")


def results_by_hand() -> tuple[list[dict], pd.DataFrame]:
    """One capacity, one rate: candidates a (attainment 0.9, p99 TTFT 0.2 s), b (0.9, 0.1),
    c (1.0, 0.5) and the baseline (0.5, 0.4)."""
    rows = [{"role": "candidate", "label": x, "capacity": "5%", "rate": 2.0, "point": x} for x in "abc"]
    rows.append({"role": "baseline", "label": "on-demand LRU (baseline)", "capacity": "5%", "rate": 2.0, "point": "z"})
    res = pd.DataFrame({"point": ["a", "b", "c", "z"], "status": "ok", "slo_attainment": [0.9, 0.9, 1.0, 0.5],
                        "ttft_p99_s": [0.2, 0.1, 0.5, 0.4], "ttft_p50_s": [0.1, 0.05, 0.3, 0.2],
                        "tpot_p50_s": [0.01, 0.02, 0.03, 0.04], "tpot_p99_s": [0.011, 0.022, 0.033, 0.044],
                        "itl_p99_s": [0.012, 0.024, 0.036, 0.048], "goodput_requests_s": [1.8, 1.8, 2.0, 1.0],
                        "requests_per_s": [2.0, 2.0, 2.0, 2.0], "hit_rate": [0.5, 0.25, 0.125, 0.0]})
    return rows, res


def test_ranking_by_attainment_then_p99_ttft_with_the_baseline_last() -> None:
    """With an SLO: c (attainment 1.0) first, then b before a (same attainment, lower p99
    TTFT); without: by p99 TTFT alone (b, a, c). The baseline unranked, after them; the speedup
    is the baseline's p99 TTFT over each row's."""
    rows, res = results_by_hand()
    t = load.rank_load(res, rows, slo=True)
    assert t["label"].tolist()[:3] == ["c", "b", "a"]
    assert t["rank"].tolist()[:3] == [1, 2, 3]
    assert t["role"].iloc[3] == "baseline"
    assert pd.isna(t["rank"].iloc[3])
    assert t["speedup_ttft_p99"].tolist() == pytest.approx([0.8, 4.0, 2.0, 1.0])
    assert list(t.columns[:len(load.SHOWN) + 1]) == ["rank", *load.SHOWN]
    plain = load.rank_load(res, rows, slo=False)
    assert plain["label"].tolist() == ["b", "a", "c", "on-demand LRU (baseline)"]
    tie = res.assign(ttft_p99_s=[0.2, 0.2, 0.2, 0.4], slo_attainment=0.9)
    assert load.rank_load(tie, rows, slo=True)["label"].tolist()[:3] == ["a", "b", "c"]  # then by label


def test_the_tables_say_what_the_rows_hold() -> None:
    """The Markdown table's rows with every column's unit (ms for latencies, % for attainment),
    and the capacity table; the terminal table, every line at most 80 columns, a long label cut
    with a tilde, and the recommendation per capacity (with and without a baseline capacity,
    and when no policy met the SLO)."""
    rows, res = results_by_hand()
    rows[0]["label"] = "least-stale + score-percentile"  # 30 characters: cut in the terminal
    t = load.rank_load(res, rows, slo=True)
    md = load.markdown_load(t, None, "T", "")
    assert md.startswith("# T\n\n## Latency at each rate\n\n| rank | policy | capacity | rate (req/s) | TTFT p50 (ms) |")
    assert "| 1 | c | 5% | 2 | 300.0 | 500.0 | 30.00 | 33.00 | 36.00 | 100% | 2.00 | 2.00 | 0.125 |" in md
    assert "|  | on-demand LRU (baseline) | 5% | 2 | 200.0 | 400.0 | 40.00 | 44.00 | 48.00 | 50% | 1.00 | 2.00 | 0.000 |" in md
    assert "Highest request rate" not in md
    cap = pd.DataFrame({"rank": [1, 2, pd.NA], "role": ["candidate", "candidate", "baseline"],
                        "label": ["c", "least-stale + score-percentile", "on-demand LRU (baseline)"],
                        "capacity": "5%", "capacity_rps": [4.012, np.nan, 2.0],
                        "capacity_low_rps": [3.71, np.nan, None], "capacity_high_rps": [4.46, np.nan, 2.5],
                        "realised_rps": [4.1, np.nan, 2.05], "fails_at_rps": [4.2, 0.5, np.nan],
                        "lower_bound": [False, False, True], "seeds": [5, 5, 5],
                        "vs_baseline": [2.006, np.nan, 1.0], "probes": [5, 9, 3]})
    md = load.markdown_load(t, cap, "T", "TTFT <= 500 ms for 90% of requests")
    assert "## Highest request rate meeting the SLO (TTFT <= 500 ms for 90% of requests)" in md
    assert "| 1 | c | 5% | 4.0 | 3.7-4.5 | 4.1 | 4.20 | 2.01x | 5 | 5 |" in md
    assert "| 2 | least-stale + score-percentile | 5% | below 0.50 |  |  | 0.500 |  | 5 | 9 |" in md
    assert "|  | on-demand LRU (baseline) | 5% | at least 2.0 | <2.5 | 2.0 | none run | 1.00x | 5 | 3 |" in md
    term = load.terminal_load(t, None, "T", "")
    lines = term.splitlines()
    assert all(len(x) <= 80 for x in lines)
    assert lines[2] == " #" + " policy".ljust(25) + "   cap   req/s  TTFT p99 ms  TPOT p99 ms  ITL p99 ms"
    assert lines[3] == "-" * 80
    assert lines[4] == " 1 c" + " " * 24 + "   5%       2        500.0        33.00       36.00"
    assert lines[6].startswith(" 3 least-stale + score-per~    5%")
    assert lines[7].startswith("   on-demand LRU (baseline)")
    assert " ".join(lines[-2:]) == ("Give the scenario an slo (ttft_s, tpot_s, itl_s) to find each policy's highest "
                                    "rate within it.")
    term = load.terminal_load(t, cap, "T", "TTFT <= 500 ms for 90% of requests")
    lines = term.splitlines()
    assert all(len(x) <= 80 for x in lines)
    assert lines[2] == " # policy" + " " * 31 + "cap" + " " * 10 + "req/s  over seeds  vs base"
    assert lines[4] == " 1 c" + " " * 37 + "5%" + " " * 12 + "4.0" + " " * 5 + "3.7-4.5    2.01x"
    assert lines[5] == " 2 least-stale + score-percentile" + " " * 8 + "5%" + " " * 5 + "below 0.50"
    assert lines[6] == "   on-demand LRU (baseline)" + " " * 14 + "5%" + " " * 3 + "at least 2.0        <2.5    1.00x"
    text = unwrap("\n".join(lines[8:]))
    assert text == ("Best at 5%: c serves 4.0 requests/s (3.7-4.5 over 5 arrival seeds) within the SLO (TTFT <= 500 "
                    "ms for 90% of requests), 2.01x on-demand LRU's at least 2.0.")
    none = cap.assign(capacity_rps=np.nan)
    text = unwrap("\n".join(load.terminal_load(t, none, "T", "S").splitlines()[8:]))
    assert text == "At 5%: no policy met the SLO (S) at any rate run."
    nobase = cap.assign(vs_baseline=np.nan)
    assert unwrap(load.terminal_load(t, nobase, "T", "S")).rstrip().endswith("within the SLO (S).")


def test_pooled_figures_over_seeds_by_hand(tmp_path: Path) -> None:
    """Two seeds' runs of one (policy, rate): TTFT and TPOT percentiles and SLO attainment over
    their four requests pooled, worked out here from the four numbers; served, goodput and
    realised rates, ITL and hit rate the mean of the two runs'; each seed's attainment; a key
    shared by two rows appears once; a failed seed fails the row, with its error."""
    from moesim.config.scenario import SloConfig

    out = tmp_path
    reqs = {"p0": ([0.0, 1.0], [0.1, 0.3], [0.01, np.nan]), "p1": ([0.0, 2.0], [0.2, 0.4], [0.03, 0.02])}
    for pid, (arr, ttft, tpot) in reqs.items():
        (out / "points" / pid).mkdir(parents=True)
        pd.DataFrame({"arrival_s": arr, "ttft_s": ttft, "tpot_s": tpot, "e2e_s": [1.0, 1.0], "queue_s": [0.0, 0.0],
                      "finish_s": [1.0, 3.0], "output_tokens": [2, 1], "itl_max_s": [0.01, np.nan],
                      "preemptions": [0, 1], "recomputed_tokens": [0, 4]}).to_parquet(
            out / "points" / pid / "requests.parquet")
    results = pd.DataFrame({"point": ["p0", "p1", "p2"], "status": ["ok", "ok", "error"], "error": [None, None, "boom"],
                            "requests_per_s": [2.0, 1.0, None], "goodput_requests_s": [1.0, 0.5, None],
                            "throughput_tokens_s": [3.0, 2.0, None], "offered_rate": [1.0, 0.5, None],
                            "itl_p50_s": [0.01, 0.03, None], "itl_p99_s": [0.02, 0.04, None],
                            "hit_rate": [0.5, 0.7, None], "slo_attainment": [1.0, 0.5, None]})
    slo = SloConfig(ttft_s=0.25, tpot_s=0.025)
    got = load.pooled(out, results, ["p0+p2", "p0+p1", "p0+p1"], slo)
    assert got["point"].tolist() == ["p0+p2", "p0+p1"]
    row = got.iloc[1]
    assert row["status"] == "ok"
    assert row["seeds"] == 2
    assert row["ttft_p99_s"] == pytest.approx(0.397, rel=1e-12)  # 0.1, 0.2, 0.3, 0.4: 0.3 + 0.97 x 0.1
    assert row["ttft_p50_s"] == pytest.approx(0.25)
    assert row["tpot_p50_s"] == pytest.approx(0.02)  # 0.01, 0.02, 0.03 (one output token: none)
    assert row["slo_attainment"] == 0.25  # TTFT/TPOT 0.1/0.01 meets; 0.3 and 0.4 miss TTFT, 0.2/0.03 TPOT
    assert row["seed_attainment"] == [1.0, 0.5]
    assert row["preemptions"] == 2  # one in each seed's run
    assert row["recomputed_tokens"] == 8
    want = {"requests_per_s": 1.5, "goodput_requests_s": 0.75, "throughput_tokens_s": 2.5, "offered_rate": 0.75,
            "itl_p50_s": 0.02, "itl_p99_s": 0.03, "hit_rate": 0.6}
    assert {k: row[k] for k in want} == pytest.approx(want)
    bad = got.iloc[0]
    assert (bad["status"], bad["error"]) == ("error", "boom")
    gapless = load.pooled(out, results.assign(itl_p50_s=[0.01, None, None]), ["p0+p1"], slo).iloc[0]
    assert gapless["itl_p50_s"] is None  # a seed without gaps: no mean over seeds
    assert gapless["itl_p99_s"] == pytest.approx(0.03)
    plain = load.pooled(out, results, ["p0+p1"], None)
    assert "seed_attainment" not in plain.columns
    assert "slo_attainment" not in plain.columns


L34 = "least-stale + score-percentile-abc"  # 34 characters: shown whole in the capacity table
L35 = "least-stale + score-percentile-abcd"  # 35: cut with a tilde
TITLE = ("moesim compare s.yaml: synthetic olmoe-1b-7b (4 x 32+8 tokens); a100-80g-pcie4, pcie 32 GB/s; poisson "
         "arrivals")


def rich_tables() -> tuple[pd.DataFrame, pd.DataFrame]:
    """Two cache capacities (50% listed before 5%), three candidates (one 34 and one 35
    characters long) and the baseline at each: at 50% none met the SLO (two below the rate
    they failed at, one never run); at 5% a capacity with its interval over 5 seeds, one from
    a single seed (no interval), one below the lowest rate, and the baseline a lower bound with
    a seed failing at the lowest rate."""
    rows = []
    for cap in ("50%", "5%"):
        for lab, role in (("lru", "candidate"), (L34, "candidate"), (L35, "candidate"),
                          ("on-demand LRU (baseline)", "baseline")):
            rows.append({"role": role, "label": lab, "capacity": cap, "rate": 0.00001 if cap == "50%" else 2.0,
                         "point": lab + cap})
    res = pd.DataFrame({"point": [r["point"] for r in rows], "status": "ok",
                        "slo_attainment": [0.95, 0.9, 0.5, 0.8] * 2, "ttft_p99_s": [0.25, 0.5, 1.25, 0.4] * 2,
                        "ttft_p50_s": [0.125, 0.25, 0.5, 0.2] * 2, "tpot_p50_s": [0.0125, 0.025, 0.05, 0.02] * 2,
                        "tpot_p99_s": [0.015, 0.03, 0.06, 0.025] * 2, "itl_p99_s": [0.0175, 0.035, 0.07, np.nan] * 2,
                        "goodput_requests_s": [1.9, 1.8, 1.0, 1.6] * 2, "requests_per_s": [2.0] * 8,
                        "hit_rate": [0.5, 0.25, 0.125, 0.0] * 2})
    t = load.rank_load(res, rows, slo=True)
    cap = pd.DataFrame({"rank": [1, 2, 3, pd.NA] * 2, "role": (["candidate"] * 3 + ["baseline"]) * 2,
                        "label": ["lru", L34, L35, "on-demand LRU (baseline)"] * 2,
                        "capacity": ["50%"] * 4 + ["5%"] * 4,
                        "capacity_rps": [np.nan] * 4 + [4.012, 3.3, np.nan, 2.0],
                        "capacity_low_rps": [np.nan] * 4 + [3.71, 3.1, np.nan, None],
                        "capacity_high_rps": [np.nan] * 4 + [4.46, 3.5, np.nan, 2.5],
                        "realised_rps": [np.nan] * 4 + [4.1, 3.31, np.nan, 2.05],
                        "fails_at_rps": [0.5, 0.25, np.nan, 0.5, 4.2, 3.4, 0.5, np.nan],
                        "lower_bound": [False] * 7 + [True], "seeds": [5] * 4 + [5, 1, 5, 5],
                        "vs_baseline": [np.nan] * 4 + [2.006, 1.65, np.nan, 1.0], "probes": [9, 9, 9, 9, 5, 6, 9, 3]})
    return t, cap


MARKDOWN = (
    '# moesim compare s.yaml: synthetic olmoe-1b-7b (4 x 32+8 tokens); a100-80g-pcie4, pcie 32 GB/s; poisson arrivals\n'
    '\n'
    '## Highest request rate meeting the SLO (TTFT <= 500 ms for 90% of requests)\n'
    '\n'
    '| rank | policy | cache capacity | capacity (req/s) | over seeds (req/s) | realised (req/s) | fails at (req/s) | vs baseline | seeds | rates run |\n'
    '|---|---|---|---|---|---|---|---|---|---|\n'
    '| 1 | lru | 50% | below 0.50 |  |  | 0.500 |  | 5 | 9 |\n'
    '| 2 | least-stale + score-percentile-abc | 50% | below 0.25 |  |  | 0.250 |  | 5 | 9 |\n'
    '| 3 | least-stale + score-percentile-abcd | 50% | none run |  |  | none run |  | 5 | 9 |\n'
    '|  | on-demand LRU (baseline) | 50% | below 0.50 |  |  | 0.500 |  | 5 | 9 |\n'
    '| 1 | lru | 5% | 4.0 | 3.7-4.5 | 4.1 | 4.20 | 2.01x | 5 | 5 |\n'
    '| 2 | least-stale + score-percentile-abc | 5% | 3.3 |  | 3.3 | 3.40 | 1.65x | 1 | 6 |\n'
    '| 3 | least-stale + score-percentile-abcd | 5% | below 0.50 |  |  | 0.500 |  | 5 | 9 |\n'
    '|  | on-demand LRU (baseline) | 5% | at least 2.0 | <2.5 | 2.0 | none run | 1.00x | 5 | 3 |\n'
    '\n'
    "Capacity: the highest rate run at which the SLO's share of the seeds' pooled requests meet it (to two significant figures); over seeds: the lowest and highest of each seed's own capacity (the highest rate up to which that seed met it at every rate run; '<x': a seed failed at the lowest rate run); realised: the arrival rate the seeds drew at the capacity, their mean.\n"
    '\n'
    '## Latency at each rate\n'
    '\n'
    '| rank | policy | capacity | rate (req/s) | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p50 (ms) | TPOT p99 (ms) | ITL p99 (ms) | SLO attainment | goodput (req/s) | served (req/s) | hit rate |\n'
    '|---|---|---|---|---|---|---|---|---|---|---|---|---|\n'
    '| 1 | lru | 50% | 1e-05 | 125.0 | 250.0 | 12.50 | 15.00 | 17.50 | 95% | 1.90 | 2.00 | 0.500 |\n'
    '| 2 | least-stale + score-percentile-abc | 50% | 1e-05 | 250.0 | 500.0 | 25.00 | 30.00 | 35.00 | 90% | 1.80 | 2.00 | 0.250 |\n'
    '| 3 | least-stale + score-percentile-abcd | 50% | 1e-05 | 500.0 | 1250.0 | 50.00 | 60.00 | 70.00 | 50% | 1.00 | 2.00 | 0.125 |\n'
    '|  | on-demand LRU (baseline) | 50% | 1e-05 | 200.0 | 400.0 | 20.00 | 25.00 |  | 80% | 1.60 | 2.00 | 0.000 |\n'
    '| 1 | lru | 5% | 2 | 125.0 | 250.0 | 12.50 | 15.00 | 17.50 | 95% | 1.90 | 2.00 | 0.500 |\n'
    '| 2 | least-stale + score-percentile-abc | 5% | 2 | 250.0 | 500.0 | 25.00 | 30.00 | 35.00 | 90% | 1.80 | 2.00 | 0.250 |\n'
    '| 3 | least-stale + score-percentile-abcd | 5% | 2 | 500.0 | 1250.0 | 50.00 | 60.00 | 70.00 | 50% | 1.00 | 2.00 | 0.125 |\n'
    '|  | on-demand LRU (baseline) | 5% | 2 | 200.0 | 400.0 | 20.00 | 25.00 |  | 80% | 1.60 | 2.00 | 0.000 |\n'
    '\n'
    "Ranked per capacity and rate by SLO attainment, then p99 TTFT. A rate meets the SLO when at least the SLO's attainment share of requests meet its TTFT, TPOT and ITL limits (ITL: a request's longest gap between two output tokens); the highest such rate is found by bisection on the rate (each probe a run).\n"
)

TERMINAL = (
    'moesim compare s.yaml: synthetic olmoe-1b-7b (4 x 32+8 tokens); a100-80g-pcie4,\n'
    '  pcie 32 GB/s; poisson arrivals\n'
    '\n'
    ' # policy                               cap          req/s  over seeds  vs base\n'
    '--------------------------------------------------------------------------------\n'
    ' 1 lru                                  50%     below 0.50\n'
    ' 2 least-stale + score-percentile-abc   50%     below 0.25\n'
    ' 3 least-stale + score-percentile-ab~   50%       none run\n'
    '   on-demand LRU (baseline)             50%     below 0.50\n'
    ' 1 lru                                   5%            4.0     3.7-4.5    2.01x\n'
    ' 2 least-stale + score-percentile-abc    5%            3.3                1.65x\n'
    ' 3 least-stale + score-percentile-ab~    5%     below 0.50\n'
    '   on-demand LRU (baseline)              5%   at least 2.0        <2.5    1.00x\n'
    '\n'
    'At 50%: no policy met the SLO (TTFT <= 500 ms for 90% of requests) at any rate\n'
    '  run.\n'
    'Best at 5%: lru serves 4.0 requests/s (3.7-4.5 over 5 arrival seeds) within the\n'
    "  SLO (TTFT <= 500 ms for 90% of requests), 2.01x on-demand LRU's at least 2.0.\n"
)

TERMINAL_NO_SLO = (
    'moesim compare s.yaml: synthetic olmoe-1b-7b (4 x 32+8 tokens); a100-80g-pcie4,\n'
    '  pcie 32 GB/s; poisson arrivals\n'
    '\n'
    ' # policy                     cap   req/s  TTFT p99 ms  TPOT p99 ms  ITL p99 ms\n'
    '--------------------------------------------------------------------------------\n'
    ' 1 lru                        50%   1e-05        250.0        15.00       17.50\n'
    ' 2 least-stale + score-per~   50%   1e-05        500.0        30.00       35.00\n'
    ' 3 least-stale + score-per~   50%   1e-05       1250.0        60.00       70.00\n'
    '   on-demand LRU (baseline)   50%   1e-05        400.0        25.00\n'
    ' 1 lru                         5%       2        250.0        15.00       17.50\n'
    ' 2 least-stale + score-per~    5%       2        500.0        30.00       35.00\n'
    ' 3 least-stale + score-per~    5%       2       1250.0        60.00       70.00\n'
    '   on-demand LRU (baseline)    5%       2        400.0        25.00\n'
    '\n'
    "Give the scenario an slo (ttft_s, tpot_s, itl_s) to find each policy's highest\n"
    'rate within it.\n'
)

def test_the_whole_tables_word_for_word() -> None:
    """Every line of the Markdown and the terminal tables of :func:`rich_tables`, checked by eye
    once and held here: headers, units, the notes, the wrapped title and sentences (indented),
    the capacities in their listed order, labels whole up to 34 characters, empty cells."""
    t, cap = rich_tables()
    slo = "TTFT <= 500 ms for 90% of requests"
    assert load.markdown_load(t, cap, TITLE, slo) == MARKDOWN
    assert load.terminal_load(t, cap, TITLE, slo) == TERMINAL
    assert load.terminal_load(t, None, TITLE, "") == TERMINAL_NO_SLO


def test_the_sentence_per_capacity_names_the_seeds_only_with_an_interval() -> None:
    """The best policy's range is told when it has one: 2 seeds with an interval are named; 1
    seed, or 5 whose interval is unknown (every seed failed at the lowest rate run), are not.
    A capacity with no candidate says nothing, and the next one still speaks."""
    t, cap = rich_tables()
    slo = "S"

    def sentence(**change) -> str:
        c = cap.copy()
        for k, v in change.items():
            c.loc[4, k] = v
        return unwrap(load.terminal_load(t, c, "T", slo)).split("Best at 5%: ")[1]

    assert sentence(seeds=2).startswith("lru serves 4.0 requests/s (3.7-4.5 over 2 arrival seeds) within")
    assert sentence(seeds=1).startswith("lru serves 4.0 requests/s within the SLO (S)")
    assert sentence(capacity_low_rps=np.nan, capacity_high_rps=np.nan).startswith(
        "lru serves 4.0 requests/s within the SLO (S)")
    lone = pd.concat([cap[cap["capacity"] == "50%"].iloc[[3]], cap[cap["capacity"] == "5%"]], ignore_index=True)
    text = unwrap(load.terminal_load(t, lone, "T", slo))
    assert "At 50%" not in text
    assert "Best at 50%" not in text
    assert "Best at 5%: lru serves 4.0" in text


def test_lines_wrap_at_80_columns_exactly() -> None:
    """A title and a sentence whose first 81 characters end a word wrap before it: 80 is the
    limit, not 81."""
    t, cap = rich_tables()
    title = "x" * 76 + " abcd tail"
    assert load.terminal_load(t, cap, title, "S").splitlines()[:2] == ["x" * 76, "  abcd tail"]
    none = cap.assign(capacity_rps=np.nan)
    slo = "y" * 42  # "At 50%: no policy met the SLO (" (31) + 42 + ") at any" (8): 81 characters
    lines = load.terminal_load(t, none, "T", slo).splitlines()
    at = lines.index(next(x for x in lines if x.startswith("At 50%")))
    assert lines[at] == f"At 50%: no policy met the SLO ({slo}) at"
    assert lines[at + 1] == "  any rate run."


def test_a_label_of_25_characters_is_cut_in_the_per_rate_table() -> None:
    rows, res = results_by_hand()
    rows[0]["label"] = "a" * 25
    rows[1]["label"] = "b" * 24
    lines = load.terminal_load(load.rank_load(res, rows, slo=False), None, "T", "").splitlines()
    assert any(x.startswith(" 2 " + "a" * 23 + "~ ") for x in lines)
    assert any(x.startswith(" 1 " + "b" * 24 + " ") for x in lines)

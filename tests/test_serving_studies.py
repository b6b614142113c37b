"""Serving under load, the longer checks (``docs/guides/serving.md``): the M/D/1 closed form over
10,000 Poisson arrivals, and ``moesim compare --rate`` finding each policy's capacity by
bisection. Kept apart from ``tests/test_serving.py`` so that mutation runs of
``simulator/serving.py`` can run the quick checks per mutant and these on the survivors."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from moesim.cli import cli
from moesim.config.scenario import scenario_from_dict
from moesim.simulator.engine import simulate
from tests.helpers import unwrap
from tests.test_serving import ONE_EXPERT, POLICIES, lindley, served, service_times


@pytest.mark.parametrize(("rho", "tol", "policy"), [(0.5, 0.05, "vllm-v1"), *((0.7, 0.12, p) for p in POLICIES)])
def test_md1_mean_ttft(rho: float, tol: float, policy: str) -> None:
    """One expert, all resident after the first request, prefill-only requests, one running
    at a time, Poisson arrivals, under every scheduler: each TTFT is the Lindley recursion's
    response time (within float rounding), and the mean is S(1 + rho / (2(1 - rho))) within
    sampling error (4 standard deviations of the mean over 10,000 requests, measured over 200
    seeds)."""
    first, s = service_times()
    n = 10_000
    res = simulate(scenario_from_dict(served(ONE_EXPERT, {"process": "poisson", "rate": rho / s, "requests": n,
                                                          "output_tokens": 1},
                                             {"max_running": 1, "kv_memory": "none", "policy": policy},
                                             cache={"capacity": "inf"})))
    req = res.requests
    expect = lindley(req["arrival_s"].to_numpy(), first, s)
    np.testing.assert_allclose(req["ttft_s"].to_numpy(), expect, rtol=1e-9, atol=1e-9 * req["finish_s"].max())
    md1 = s * (1 + rho / (2 * (1 - rho)))
    assert abs(req["ttft_s"].mean() - md1) / md1 < tol
    gaps = np.diff(req["arrival_s"].to_numpy())
    assert abs(gaps.mean() * rho / s - 1) < 0.05  # the asked rate



def pooled_by_hand(point: dict, seeds: list[int]) -> pd.DataFrame:
    """The requests of each seed's run, rerun in-process, one table."""
    frames = []
    for seed in seeds:
        point["workload"]["arrivals"]["seed"] = seed
        frames.append(simulate(scenario_from_dict(point)).requests)
    return pd.concat(frames, ignore_index=True)


def attained(req: pd.DataFrame) -> float:
    """The share of requests within TTFT 0.25 s and TPOT 0.05 s (one output token: no TPOT)."""
    ok = (req["ttft_s"] <= 0.25) & (req["tpot_s"].isna() | (req["tpot_s"] <= 0.05))
    return float(ok.mean())


def test_compare_under_load_finds_each_policys_capacity(tmp_path: Path) -> None:
    """``moesim compare --rate --seeds 2`` on a serving scenario with an SLO: the per-rate rows
    are the two arrival draws' requests pooled (each draw rerun in-process: the p99 TTFT and
    the attainment worked out from the pooled table), and each policy's capacity is bracketed
    by a measured rate at which the pooled requests meet the SLO and one within 5% above it at
    which they do not (both rerun in-process); the interval over seeds holds it; the baseline
    is on-demand LRU; the figure and both tables are written."""
    data = served({"synth": {"preset": "olmoe-1b-7b", "requests": 4, "prompt_tokens": 64, "tokens": 12,
                             "layers": 4}},
                  {"process": "poisson", "rate": 4.0, "requests": 24}, {"max_running": 4},
                  slo={"ttft_s": 0.25, "tpot_s": 0.05, "attainment": 0.75}, cache={"capacity": "40%"})
    sc = tmp_path / "s.yaml"
    sc.write_text(json.dumps(data))
    out = tmp_path / "cmp"
    r = CliRunner().invoke(cli, ["compare", str(sc), "--eviction", "lru,lfu", "--rate", "2,8", "--seeds", "2",
                                 "--out", str(out), "--workers", "2"])
    assert r.exit_code == 0, r.output
    assert "arrival seeds) within the SLO" in unwrap(r.output)
    table = pd.read_parquet(out / "compare.parquet")
    cap = pd.read_parquet(out / "capacity.parquet")
    assert sorted(table["rate"].unique().tolist()) == [2.0, 8.0]
    assert set(cap["label"]) == {"lru", "lfu", "on-demand LRU (baseline)"}
    row = table[(table["label"] == "lfu") & (table["rate"] == 8.0)].iloc[0]
    point = copy.deepcopy(data)
    point["workload"]["arrivals"]["rate"] = 8.0
    point["policies"] = {"eviction": "lfu"}
    req = pooled_by_hand(point, [0, 1])
    assert len(req) == 48
    assert row["ttft_p99_s"] == float(np.percentile(req["ttft_s"], 99))
    assert row["slo_attainment"] == attained(req)
    assert row["seeds"] == 2
    for c in cap.to_dict("records"):
        ev = "lfu" if c["label"] == "lfu" else "lru"
        point["policies"] = {"eviction": ev}
        for rate, meets in ((c["capacity_rps"], True), (c["fails_at_rps"], False)):
            if rate is None or pd.isna(rate):
                continue
            point["workload"]["arrivals"]["rate"] = float(rate)
            got = attained(pooled_by_hand(point, [0, 1]))
            assert (got >= 0.75) == meets, (c["label"], rate, got)
        if pd.notna(c["capacity_rps"]) and pd.notna(c["fails_at_rps"]):
            assert c["capacity_rps"] < c["fails_at_rps"] <= c["capacity_rps"] * 1.05 + 1e-3
        if pd.notna(c["capacity_low_rps"]):
            assert c["capacity_low_rps"] <= c["capacity_high_rps"]
    md = (out / "compare.md").read_text()
    assert "Highest request rate meeting the SLO" in md
    assert "Latency at each rate" in md
    assert (out / "compare.png").stat().st_size > 10_000


def test_compare_under_load_ranks_miss_policies_and_budgets(tmp_path: Path) -> None:
    """``moesim compare --rate --miss --budget``: a candidate per (eviction, miss, budget),
    each row the pooled requests of its arrival draws, rerun in-process with those policies
    (the budget on the SimPy path, the miss policy on the kernel)."""
    data = served({"synth": {"preset": "olmoe-1b-7b", "requests": 4, "prompt_tokens": 32, "tokens": 8,
                             "layers": 3, "probs": True}},
                  {"process": "poisson", "rate": 4.0, "requests": 12}, {"max_running": 4},
                  cache={"capacity": "20%"})
    sc = tmp_path / "s.yaml"
    sc.write_text(json.dumps(data))
    out = tmp_path / "cmp"
    r = CliRunner().invoke(cli, ["compare", str(sc), "--eviction", "lru", "--miss", "fetch,drop", "--budget",
                                 "none,moe-spec", "--rate", "4", "--seeds", "2", "--out", str(out)])
    assert r.exit_code == 0, r.output
    table = pd.read_parquet(out / "compare.parquet")
    assert set(table["label"]) == {"lru", "lru + drop", "lru + moe-spec", "lru + drop + moe-spec",
                                   "on-demand LRU (baseline)"}
    for label, policies in (("lru + drop", {"eviction": "lru", "miss": "drop"}),
                            ("lru + drop + moe-spec", {"eviction": "lru", "miss": "drop", "budget": "moe-spec"})):
        point = copy.deepcopy(data)
        point["policies"] = policies
        req = pooled_by_hand(point, [0, 1])
        row = table[table["label"] == label].iloc[0]
        assert row["ttft_p99_s"] == float(np.percentile(req["ttft_s"], 99)), label
    same = table.set_index("label")["ttft_p99_s"]
    assert same["lru + moe-spec"] != same["lru"]


def test_the_interval_over_seeds_covers_a_fresh_seeds_capacity_as_often_as_order_statistics_say() -> None:
    """One expert, one request at a time, prefill-only requests (the M/D/1 queue above), 30
    Poisson arrivals a draw, SLO TTFT <= the first (cold) pass and 3 service times for 90% of
    them. The capacity search
    over seeds 0-4 gives an interval, the lowest and highest of their own capacities; each of
    40 fresh seeds' own capacity (searched alone) falls inside it about as often as the range
    of 5 exchangeable draws holds a sixth: 4 times in 6 (binomial over 40: 26.7 +/- 3; the
    bounds here are 4 standard deviations). Every run in-process."""
    from moesim.config.scenario import SloConfig
    from moesim.studies.load import RATE, bisect_capacity

    first, s = service_times()
    limit = first + 3 * s  # the first request's pass misses; the rest are served in S
    slo = SloConfig(ttft_s=limit, attainment=0.9)
    base = served(ONE_EXPERT, {"process": "poisson", "rate": 1.0, "requests": 30, "output_tokens": 1},
                  {"max_running": 1, "kv_memory": "none"}, cache={"capacity": "inf"})

    def search(seeds: list[int]) -> dict:
        def measure(combos: list[dict]) -> list[dict]:
            rows = []
            for v in combos:
                each = []
                for seed in seeds:
                    point = copy.deepcopy(base)
                    point["workload"]["arrivals"].update(rate=v[RATE], seed=seed)
                    req = simulate(scenario_from_dict(point)).requests
                    each.append(float((req["ttft_s"] <= limit).mean()))
                rows.append({"slo_attainment": float(np.mean(each)), "seed_attainment": each, "ttft_p99_s": 0.0,
                             "tpot_p99_s": 0.0})
            return rows

        lo_rate, hi_rate = 0.2 / s, 0.9 / s
        first_rows = measure([{RATE: lo_rate}, {RATE: hi_rate}])
        table = pd.DataFrame([{"role": "candidate", "label": "lru", "capacity": "inf", "rate": r,
                               "values": {RATE: r}, **row} for r, row in zip((lo_rate, hi_rate), first_rows,
                                                                            strict=True)])
        return bisect_capacity(table, slo.attainment, measure).iloc[0].to_dict()

    pooled = search([0, 1, 2, 3, 4])
    low, high = pooled["capacity_low_rps"], pooled["capacity_high_rps"]
    assert low is not None
    assert low <= high
    inside = sum(low <= search([seed])["capacity_rps"] <= high for seed in range(100, 140))
    assert 15 <= inside <= 38, inside

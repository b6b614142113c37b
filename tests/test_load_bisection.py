"""``compare --rate``'s search for each policy's highest rate within the SLO
(:func:`moesim.studies.load.bisect_capacity`), by hand: a stub replay meets the SLO up to a known
rate, so every probe and the answer are worked out in advance (4 significant figures, a bracket
closed within 5%)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from moesim.studies.load import RATE, bisect_capacity
from tests.test_serving import served

# each policy meets the SLO up to this rate (requests/s), and fails above it
LIMIT = {"a": 5.0, "b": 0.3}


def start(tmp_path: Path) -> tuple[Path, dict, pd.DataFrame]:
    """A tiny serving scenario, and the table of the rates run first (2 and 8 req/s) for two
    policies: a meets at 2 and fails at 8; b fails at both."""
    data = served({"synth": {"preset": "olmoe-1b-7b", "requests": 2, "prompt_tokens": 8, "tokens": 2, "layers": 2}},
                  {"process": "poisson", "rate": 1.0, "requests": 4})
    p = tmp_path / "s.yaml"
    p.write_text(json.dumps(data))
    rows = []
    for label, ev in (("a", "lru"), ("b", "lfu")):
        for rate in (2.0, 8.0):
            rows.append({"role": "candidate", "label": label, "capacity": "25%", "rate": rate,
                         "slo_attainment": 1.0 if rate <= LIMIT[label] else 0.0, "ttft_p99_s": rate,
                         "tpot_p99_s": rate, "itl_p99_s": rate,
                         "values": {"cache.capacity": "25%", "policies.eviction": ev, RATE: rate}})
    return p, data, pd.DataFrame(rows)


def test_the_bisection_probes_and_answer_are_those_worked_out_by_hand(tmp_path):
    """a: bracket [2, 8] -> 4 (meets), 5.657 (fails), 4.757 (meets), 5.188 (fails), 4.968
    (meets), where 5.188 / 4.968 = 1.044 <= 1.05 stops it: capacity 4.968, fails at 5.188, 7
    rates run. b: no rate met, so halving from the lowest failing rate, 2: 1, 0.5 (fail), 0.25
    (meets), then bisection: 0.3536 (fails), 0.2973 (meets), 0.3242 (fails), 0.3105 (fails):
    0.3105 / 0.2973 = 1.044 stops it: capacity 0.2973, 9 rates run. The probes of both policies
    go out together, a round at a time."""
    p, data, table = start(tmp_path)
    asked: dict[str, list[float]] = {"a": [], "b": []}
    rounds: list[int] = []

    def run(pts):
        rounds.append(len(pts))
        rows = []
        for pt in pts:
            label = "a" if pt.values["policies.eviction"] == "lru" else "b"
            rate = pt.values[RATE]
            asked[label].append(rate)
            ok = 1.0 if rate <= LIMIT[label] else 0.0
            rows.append({"point": pt.pid, "slo_attainment": ok, "ttft_p99_s": rate, "tpot_p99_s": rate, "itl_p99_s": rate})
        return pd.DataFrame(rows)

    got = bisect_capacity(p, data, table, 0.9, run, {}).set_index("label")
    assert asked["a"] == [4.0, 5.657, 4.757, 5.188, 4.968]
    assert asked["b"] == [1.0, 0.5, 0.25, 0.3536, 0.2973, 0.3242, 0.3105]
    assert rounds == [2, 2, 2, 2, 2, 1, 1]
    assert (got.loc["a", "max_rate"], got.loc["a", "fails_at"], got.loc["a", "probes"]) == (4.968, 5.188, 7)
    assert (got.loc["b", "max_rate"], got.loc["b", "fails_at"], got.loc["b", "probes"]) == (0.2973, 0.3105, 9)
    curve = got.loc["a", "curve"]
    assert [r for r, _, _ in curve] == sorted([2.0, 8.0, 4.0, 5.657, 4.757, 5.188, 4.968])


def test_a_policy_meeting_the_slo_at_every_rate_doubles_until_it_fails(tmp_path):
    """A policy meeting the SLO up to 5 req/s whose first rates (2 and 3) both meet it: 6
    (fails) bounds it after one doubling of 3, then 4.243 (meets), 5.046 (fails), 4.627 (meets),
    4.832 (meets), and 5.046 / 4.832 = 1.044 stops it."""
    p, data, table = start(tmp_path)
    table = table[table["label"] == "a"].copy()
    table["rate"] = [2.0, 3.0]
    table["slo_attainment"] = [1.0, 1.0]
    table["values"] = [{**v, RATE: r} for v, r in zip(table["values"], table["rate"], strict=True)]
    asked: list[float] = []

    def run(pts):
        asked.extend(pt.values[RATE] for pt in pts)
        return pd.DataFrame([{"point": pt.pid, "slo_attainment": float(pt.values[RATE] <= 5.0),
                              "ttft_p99_s": 0.0, "tpot_p99_s": 0.0, "itl_p99_s": 0.0} for pt in pts])

    got = bisect_capacity(p, data, table, 0.9, run, {}).iloc[0]
    assert asked == [6.0, 4.243, 5.046, 4.627, 4.832]
    assert (got["max_rate"], got["fails_at"], got["probes"]) == (4.832, 5.046, 7)

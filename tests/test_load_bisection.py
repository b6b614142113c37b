"""``compare --rate``'s search for each policy's highest rate within the SLO
(:func:`moesim.studies.load.bisect_capacity`), by hand: a stub replay meets the SLO up to a known
rate, so every probe and the answer are worked out in advance (4 significant figures, a bracket
closed within 5%)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from moesim.studies import load
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
    _, _, table = start(tmp_path)
    asked: dict[str, list[float]] = {"a": [], "b": []}
    rounds: list[int] = []

    def run(combos):
        rounds.append(len(combos))
        rows = []
        for v in combos:
            label = "a" if v["policies.eviction"] == "lru" else "b"
            rate = v[RATE]
            asked[label].append(rate)
            ok = 1.0 if rate <= LIMIT[label] else 0.0
            rows.append({"slo_attainment": ok, "ttft_p99_s": rate, "tpot_p99_s": rate, "itl_p99_s": rate})
        return rows

    got = bisect_capacity(table, 0.9, run).set_index("label")
    assert asked["a"] == [4.0, 5.657, 4.757, 5.188, 4.968]
    assert asked["b"] == [1.0, 0.5, 0.25, 0.3536, 0.2973, 0.3242, 0.3105]
    assert rounds == [2, 2, 2, 2, 2, 1, 1]
    assert (got.loc["a", "capacity_rps"], got.loc["a", "fails_at_rps"], got.loc["a", "probes"]) == (4.968, 5.188, 7)
    assert (got.loc["b", "capacity_rps"], got.loc["b", "fails_at_rps"], got.loc["b", "probes"]) == (0.2973, 0.3105, 9)
    assert not got["lower_bound"].any()
    curve = got.loc["a", "curve"]
    assert [r for r, _, _ in curve] == sorted([2.0, 8.0, 4.0, 5.657, 4.757, 5.188, 4.968])


def meeting_at_2_and_3(tmp_path) -> pd.DataFrame:
    """Policy a alone, its first rates 2 and 3 req/s, both meeting the SLO."""
    _, _, table = start(tmp_path)
    table = table[table["label"] == "a"].copy()
    table["rate"] = [2.0, 3.0]
    table["slo_attainment"] = [1.0, 1.0]
    table["values"] = [{**v, RATE: r} for v, r in zip(table["values"], table["rate"], strict=True)]
    return table


def test_a_policy_meeting_the_slo_at_every_rate_doubles_until_it_fails(tmp_path):
    """A policy meeting the SLO up to 5 req/s whose first rates (2 and 3) both meet it: 6
    (fails) bounds it after one doubling of 3, then 4.243 (meets), 5.046 (fails), 4.627 (meets),
    4.832 (meets), and 5.046 / 4.832 = 1.044 stops it."""
    table = meeting_at_2_and_3(tmp_path)
    asked: list[float] = []

    def run(combos):
        asked.extend(v[RATE] for v in combos)
        return [{"slo_attainment": float(v[RATE] <= 5.0), "ttft_p99_s": 0.0, "tpot_p99_s": 0.0, "itl_p99_s": 0.0}
                for v in combos]

    got = bisect_capacity(table, 0.9, run).iloc[0]
    assert asked == [6.0, 4.243, 5.046, 4.627, 4.832]
    assert (got["capacity_rps"], got["fails_at_rps"], got["probes"]) == (4.832, 5.046, 7)


def test_a_capacity_no_failing_rate_brackets_is_a_lower_bound(tmp_path):
    """A policy meeting the SLO at every rate: doubling from 3 eight times (6 ... 768), every
    one meeting it: capacity at least 768, nothing failed, 10 rates run."""
    table = meeting_at_2_and_3(tmp_path)
    asked: list[float] = []

    def run(combos):
        asked.extend(v[RATE] for v in combos)
        return [{"slo_attainment": 1.0, "ttft_p99_s": 0.0, "tpot_p99_s": 0.0} for _ in combos]

    got = bisect_capacity(table, 0.9, run).iloc[0]
    assert asked == [6.0, 12.0, 24.0, 48.0, 96.0, 192.0, 384.0, 768.0]
    assert (got["capacity_rps"], got["fails_at_rps"], got["lower_bound"], got["probes"]) == (768.0, None, True, 10)
    assert load.capacity_text(got) == "at least 770"


def test_each_seeds_capacity_and_the_interval_over_seeds(tmp_path):
    """Three seeds whose own limits are 4.5, 5 and 6 req/s; the pooled attainment is their
    share meeting it (0.9 needs all three). Bracket [2, 8]: 4 (all meet), 5.657 (only the
    third: fails), 4.757 (the 4.5 seed fails), 4.362 (all), 4.555 (4.5 fails), and 4.555 /
    4.362 = 1.044 stops it: capacity 4.362. Each seed's own capacity, the highest rate up to
    which it meets the SLO at every rate run (2, 4, 4.362, 4.555, 4.757, 5.657, 8): 4.362, 4.757
    and 5.657: the interval 4.362 to 5.657; the realised rate the mean of the probe's."""
    _, _, table = start(tmp_path)
    limits = [4.5, 5.0, 6.0]
    table = table[table["label"] == "a"].copy()
    table["slo_attainment"] = [1.0, 1 / 3]
    table["seed_attainment"] = [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    table["offered_rate"] = [2.1, 7.7]
    asked: list[float] = []

    def run(combos):
        rows = []
        for v in combos:
            rate = v[RATE]
            asked.append(rate)
            each = [float(rate <= lim) for lim in limits]
            rows.append({"slo_attainment": sum(each) / 3, "seed_attainment": each, "offered_rate": rate * 1.01,
                         "ttft_p99_s": 0.0, "tpot_p99_s": 0.0})
        return rows

    got = bisect_capacity(table, 0.9, run).iloc[0]
    assert asked == [4.0, 5.657, 4.757, 4.362, 4.555]
    assert (got["capacity_rps"], got["fails_at_rps"], got["seeds"]) == (4.362, 4.555, 3)
    assert load.seed_capacities({r: {"seed_attainment": [float(r <= lim) for lim in limits], "slo_attainment": 0}
                                 for r in (2.0, 4.0, 4.362, 4.555, 4.757, 5.657, 8.0)}, 0.9) == [4.362, 4.757, 5.657]
    assert (got["capacity_low_rps"], got["capacity_high_rps"]) == (4.362, 5.657)
    assert got["realised_rps"] == 4.362 * 1.01
    assert load.interval_text(got) == "4.4-5.7"
    assert load.capacity_text(got) == "4.4"


def test_a_seed_failing_at_every_rate_run_leaves_the_interval_open_below():
    assert load.seed_capacities({1.0: {"seed_attainment": [0.5, 1.0], "slo_attainment": 0.75},
                                 2.0: {"seed_attainment": [1.0, 0.0], "slo_attainment": 0.5}}, 0.9) == [None, 1.0]
    row = {"seeds": 2, "capacity_low_rps": None, "capacity_high_rps": 1.0}
    assert load.interval_text(row) == "<1.0"
    assert load.interval_text({**row, "seeds": 1}) == ""


def test_significant_figures():
    assert [load.sig(x) for x in (4.968, 0.2973, 256.0, 12.4, 1.0, 0.0449, 99.6, 0.0)] == [
        "5.0", "0.30", "260", "12", "1.0", "0.045", "100", "0"]
    assert [load.sig(x, 3) for x in (1234.0, 0.04512, 2.0, 99.96, 5.188)] == ["1230", "0.0451", "2.00", "100", "5.19"]


def test_a_policy_failing_at_every_rate_halves_eight_times_and_is_below_the_lowest(tmp_path):
    """b fails at 2 and 8 and at every halving: 1, 0.5, ..., 0.01562 (4 significant figures)
    and its half, 0.00781 (eight halvings), then stops: no capacity, fails at 0.00781, 'below
    0.0078'; its
    seeds have no capacity either. a, beside it in the same search, meets at every rate and
    doubles from 8 to 2048 (eight doublings): at least 2048, a lower bound. Both keep their
    role and cache capacity."""
    _, _, table = start(tmp_path)
    table["slo_attainment"] = [1.0, 1.0, 0.0, 0.0]
    table["seed_attainment"] = [[1.0, 1.0], [1.0, 1.0], [0.0, 0.5], [0.0, 0.0]]
    asked: dict[str, list[float]] = {"a": [], "b": []}

    def run(combos):
        rows = []
        for v in combos:
            label = "a" if v["policies.eviction"] == "lru" else "b"
            asked[label].append(v[RATE])
            ok = float(label == "a")
            rows.append({"slo_attainment": ok, "seed_attainment": [ok, ok], "ttft_p99_s": 0.0, "tpot_p99_s": 0.0})
        return rows

    got = bisect_capacity(table, 0.9, run).set_index("label")
    assert asked["b"] == [1.0, 0.5, 0.25, 0.125, 0.0625, 0.03125, 0.01562, 0.00781]
    assert asked["a"] == [16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0]
    b = got.loc["b"]
    assert b["fails_at_rps"] == 0.00781
    assert pd.isna([b["capacity_rps"], b["capacity_low_rps"], b["capacity_high_rps"], b["realised_rps"]]).all()
    assert not b["lower_bound"]
    assert load.capacity_text(b) == "below 0.0078"
    assert load.interval_text(b) == ""
    a = got.loc["a"]
    assert (a["capacity_rps"], a["lower_bound"], a["probes"]) == (2048.0, True, 10)
    assert got["role"].tolist() == ["candidate", "candidate"]
    assert got["capacity"].tolist() == ["25%", "25%"]


def test_a_bracket_exactly_five_percent_wide_is_closed(tmp_path):
    """2 meets and 2.1 fails: 2.1 / 2 = 1.05, the tolerance itself: nothing more is run."""
    _, _, table = start(tmp_path)
    table = table[table["label"] == "a"].copy()
    table["rate"] = [2.0, 2.1]
    asked: list[float] = []
    got = bisect_capacity(table, 0.9, lambda combos: asked.extend(combos) or []).iloc[0]
    assert asked == []
    assert (got["capacity_rps"], got["fails_at_rps"], got["probes"]) == (2.0, 2.1, 2)


def test_a_measure_that_answers_fewer_rows_than_asked_is_an_error(tmp_path):
    _, _, table = start(tmp_path)
    with pytest.raises(ValueError, match="zip"):
        bisect_capacity(table, 0.9, lambda combos: [])


def test_the_curve_keeps_a_missing_tpot_and_the_realised_rate_reads_nan_as_none(tmp_path):
    """A rate run whose requests made one token each has no TPOT: its point on the curve is
    NaN; a realised rate that is NaN is reported as none. An attainment equal to the target
    meets it, for the pooled requests and for a seed."""
    _, _, table = start(tmp_path)
    table = table[table["label"] == "a"].copy()
    table["rate"] = [2.0, 2.1]
    table["slo_attainment"] = [0.9, 0.0]
    table["seed_attainment"] = [[0.9, 0.9], [0.0, 0.0]]
    table["tpot_p99_s"] = [np.nan, 0.5]
    table["offered_rate"] = [np.nan, 2.2]
    got = bisect_capacity(table, 0.9, lambda combos: []).iloc[0]
    assert got["capacity_rps"] == 2.0
    (r0, t0, p0), (r1, t1, p1) = got["curve"]
    assert (r0, t0, r1, t1, p1) == (2.0, 2.0, 2.1, 8.0, 0.5)  # the table's p99 TTFTs: 2 and 8
    assert np.isnan(p0)
    assert got["realised_rps"] is None
    assert (got["capacity_low_rps"], got["capacity_high_rps"]) == (2.0, 2.0)


def test_capacity_text_when_nothing_was_run():
    assert load.capacity_text({"capacity_rps": None, "fails_at_rps": None, "lower_bound": False}) == "none run"
    assert load.capacity_text({"capacity_rps": np.nan, "fails_at_rps": np.nan, "lower_bound": False}) == "none run"


def test_a_search_that_stopped_does_not_stop_the_others(tmp_path):
    """a meets the SLO at every rate and stops after eight doublings (a lower bound); b fails
    down to 0.01562 and meets at 0.00781 after eight halvings, so its bisection goes on after
    a has stopped, until its bracket is within 5%."""
    _, _, table = start(tmp_path)
    table["slo_attainment"] = [1.0, 1.0, 0.0, 0.0]
    asked: dict[str, list[float]] = {"a": [], "b": []}

    def run(combos):
        rows = []
        for v in combos:
            label = "a" if v["policies.eviction"] == "lru" else "b"
            asked[label].append(v[RATE])
            rows.append({"slo_attainment": float(label == "a" or v[RATE] <= 0.01), "ttft_p99_s": 0.0,
                         "tpot_p99_s": None})
        return rows

    got = bisect_capacity(table, 0.9, run).set_index("label")
    assert len(asked["a"]) == 8
    assert len(asked["b"]) > 8
    b = got.loc["b"]
    assert b["capacity_rps"] <= 0.01 < b["fails_at_rps"] <= b["capacity_rps"] * 1.05
    assert all(np.isnan(p) for _, _, p in b["curve"] if _ not in (2.0, 8.0))  # no TPOT measured: NaN

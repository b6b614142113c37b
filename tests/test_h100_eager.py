"""Issue 37's H100 runs (``validation/h100/eager/``): the profile is the fit of the run's raw
microbenchmarks, the measured columns are kept as the device wrote them, the re-predictions
and the report are what ``tools/validation_reports.py h100-eager`` makes today (on both replay paths),
and what the report says of the measurements holds on the measured files."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import yaml

from moesim.calibration.calibrate import fit
from tests.helpers import load_tool

ROOT = Path(__file__).resolve().parents[1]
EAGER = ROOT / "validation" / "h100" / "eager"


@pytest.fixture(scope="module")
def tool():
    return load_tool("validation_reports")


@pytest.fixture(scope="module")
def today(tool, tmp_path_factory):
    return tool.h100_eager_repredicted(tmp_path_factory.mktemp("h100eager"))


@pytest.mark.parametrize(("call", "raw_file", "profile_file"), [("call1", "raw.parquet", "profile.yaml"), ("call3", "raw3.parquet", "profile3.yaml")])
def test_the_profiles_are_the_fits_of_the_runs_microbenchmarks(call, raw_file, profile_file):
    raw = pd.read_parquet(EAGER / call / raw_file)
    assert (raw["device_name"] == "NVIDIA H100 80GB HBM3").all()
    prof = fit(raw, raw_file)
    assert prof == yaml.safe_load((EAGER / call / profile_file).read_text())
    # the executor's own host calls were measured, and cost more than its bare kernels
    assert prof["host"]["eager_expert_us"] > 5 * prof["host"]["eager_kernel_us"]
    assert set(raw.loc[raw["kind"] == "host", "call"]) >= {"executor layer, eager", "executor expert, eager (hit + run)"}


def test_the_re_predictions_and_the_report_are_today_s(tool, today):
    committed = pd.read_parquet(EAGER / "repredicted.parquet")
    pd.testing.assert_frame_equal(today, committed, rtol=1e-9)
    assert (EAGER / "report.md").read_text() == tool.h100_eager_report(committed)
    # the measured columns are the runs' own
    for run in (*tool.H100_EAGER_RUNS, *tool.H100_EAGER_OLD_RULE):
        rec = pd.read_parquet(EAGER / run / "validation.parquet")
        got = committed[committed["run"] == run]
        assert got["tpot_measured_s"].tolist() == rec["tpot_measured_s"].tolist()
        assert got["ttft_measured_s"].tolist() == rec["ttft_measured_s"].tolist()
    # the runs made the decisions of the simulator of their day, which withdrew every prefetch not
    # yet copying: today's with the copy worker's depth (1) are those; with the main thread's two
    # issued copies, some prefetch rows' decisions move
    eager = committed[committed["run"].isin(list(tool.H100_EAGER_RUNS))]
    assert eager["same_depth1"].all()
    assert committed.loc[committed["prefetch_from"] == "worker", "same_decisions"].all()
    assert (committed.loc[~committed["same_decisions"], "prefetch"] != "none").all()
    assert set(eager["style"]) == {"eager-per-expert"}
    assert eager["prefetch_depth"].tolist() == [1 if w == "worker" else 2 for w in eager["prefetch_from"]]


def test_the_simpy_path_predicts_the_same(tool, today, monkeypatch, tmp_path):
    """The judged run's predictions on the SimPy path (the reference semantics) equal the
    compiled kernel's in all 16 rows, with the microbenchmarks' host and the held-out one."""
    monkeypatch.setenv("MOESIM_NO_KERNEL", "1")
    monkeypatch.setattr(tool, "H100_EAGER_RUNS", {"main": tool.H100_EAGER_RUNS["main"]})
    monkeypatch.setattr(tool, "H100_EAGER_OLD_RULE", ())
    got = tool.h100_eager_repredicted(tmp_path)
    want = today[today["run"] == "main"].reset_index(drop=True)
    assert len(got) == 16
    pd.testing.assert_frame_equal(got, want, rtol=1e-9)


def test_what_the_report_says_of_the_measurements_holds(tool):
    df = pd.read_parquet(EAGER / "repredicted.parquet")
    pf = df[(df["prefetch"] != "none") & df["capacity"].isin(["1%", "5%"])].pivot(
        index="scenario", columns="run", values="tpot_measured_s")
    pred = df[(df["run"] == "main")].set_index("scenario")["tpot_host_s"].loc[pf.index]
    # section 2: in the same call, the worker's rows are slower than the main thread's, every one
    assert (pf["pf-worker"] > 1.2 * pf["pf-main"]).all()
    assert (pf["pf-worker"] > 1.2 * pf["main"]).all()
    # with the worker at either switch interval, over 25% error; with the main thread at most 11%
    for run in ("eager", "eager-switch50", "pf-worker"):
        assert (1 - pred / pf[run] > 0.25).all(), run
    for run in ("main", "pf-main"):
        assert (1 - pred / pf[run] < 0.11).all(), run
    # section 1: the held-out fit uses the 100% rows only and meets issue 37's targets on the others;
    # so do the microbenchmarks alone, with the two issued prefetch copies modelled
    main = df[df["run"] == "main"]
    rest = main[main["capacity"] != "100%"]
    assert len(rest) == 12
    held = tool.errors(rest, "held")
    assert held["tpot median"] <= 0.05
    assert held["tpot p95"] <= 0.10
    assert held["ttft median"] <= 0.05
    micro = tool.errors(main, "host")
    assert micro["tpot median"] <= 0.05
    assert micro["tpot p95"] <= 0.10
    assert micro["ttft median"] <= 0.05
    # the late withdrawals are only where the simulator withdrew prefetches (prefetch below 100%)
    assert (main.loc[main["prefetch"] == "none", "late_withdraws"] == 0).all()
    assert (main.loc[main["capacity"].isin(["1%", "5%"]) & (main["prefetch"] != "none"), "late_withdraws"] > 700).all()


def test_the_old_rule_rows_are_the_committed_run_s_ten(tool):
    from tests.test_h100_calibration import OLD_RULE_ROWS

    df = pd.read_parquet(EAGER / "repredicted.parquet")
    old = df[df["run"].isin(list(tool.H100_EAGER_OLD_RULE))]
    assert set(zip(old["model"], old["expert_compute"], old["scenario"], strict=True)) == OLD_RULE_ROWS
    assert old["same_decisions"].all()
    assert set(old["style"]) == {"graph-layer", "graph-per-expert"}


def test_what_the_report_says_of_the_replicate_holds(tool):
    """Section 5: the replicate made the judged run's hits and misses, measured the same work up
    to half again as slow, its host calls from Python took 1.7-2.1 times the first call's (a graph
    replay the same), and it misses issue 37's targets even held out."""
    df = pd.read_parquet(EAGER / "repredicted.parquet")
    a = df[df["run"] == "main"].set_index("scenario")
    b = df[df["run"] == "main2"].set_index("scenario").loc[a.index]
    assert (a[["hits_exec", "misses_exec"]] == b[["hits_exec", "misses_exec"]]).all().all()
    ratio = tool.h100_eager_replicate_ratio(df)
    assert 1.5 < ratio.max() < 1.6
    assert ratio.min() > 0.99
    first, third = (pd.read_parquet(EAGER / f) for f in ("call1/raw.parquet", "call3/raw3.parquet"))
    us = [r[r["kind"] == "host"].groupby("call")["median_s"].median() for r in (first, third)]
    slow = us[1] / us[0]
    assert 0.95 < slow["graph replay"] < 1.05
    assert (slow.drop("graph replay") > 1.65).all()
    rest = b[b["capacity"] != "100%"]
    assert tool.errors(rest, "held")["tpot median"] > 0.10
    assert tool.errors(b, "host")["tpot median"] > 0.14

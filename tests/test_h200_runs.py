"""Issue 37's H200 runs (``validation/h200/``): the profile is the fit of its raw
measurements, the eager per-expert validation's measured columns are kept as they are, the
re-predictions and the report are what ``tools/validation_reports.py h200-eager`` makes today from the
committed measurements, and the report's statements hold on the measured files."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import yaml

from moesim.calibration.calibrate import fit
from tests.helpers import load_tool

ROOT = Path(__file__).resolve().parents[1]
H200 = ROOT / "validation" / "h200"


@pytest.fixture(scope="module")
def tool():
    return load_tool("validation_reports")


def test_the_h200_profile_is_the_fit_of_its_raw_measurements():
    raw = pd.read_parquet(H200 / "eager" / "run1" / "raw_olmoe.parquet")
    assert (raw["device_name"] == "NVIDIA H200").all()
    assert fit(raw, "raw_olmoe.parquet") == yaml.safe_load((ROOT / "profiles" / "h200.yaml").read_text())
    assert yaml.safe_load((H200 / "eager" / "run1" / "profile.yaml").read_text()) == yaml.safe_load(
        (ROOT / "profiles" / "h200.yaml").read_text())


def test_the_eager_validation_re_predicted_today_is_the_committed_one(tool, tmp_path):
    got = tool.h200_eager_repredicted(tmp_path)
    pd.testing.assert_frame_equal(got, pd.read_parquet(H200 / "eager" / "repredicted.parquet"))
    assert got["same_decisions"].all()
    assert set(got["style"]) == {"eager-per-expert"}
    # the rows' measured columns are the run's, untouched
    rec = pd.read_parquet(H200 / "eager" / "run1" / "validation.parquet")
    assert got["tpot_measured_s"].tolist() == rec["tpot_measured_s"].tolist()


def test_the_specmd_predictions_and_the_report_are_today_s(tool, tmp_path):
    spec = tool.h200_eager_specmd_predicted(tmp_path)
    pd.testing.assert_frame_equal(spec, pd.read_parquet(H200 / "diagnostics" / "specmd_predicted.parquet"))
    eager = pd.read_parquet(H200 / "eager" / "repredicted.parquet")
    report = (H200 / "report.md").read_text()
    for section in (tool.h200_eager_slots_section(), tool.h200_eager_section(eager), tool.h200_eager_specmd_section(spec)):
        assert section in report


def test_what_the_report_says_of_the_measurements_holds():
    """Section 1: eager launches take the same time at 1% and 5%, graphs do not; spreading 1%'s
    slots changes nothing; section 3: Least-Stale cuts the 1% TTFT with prefetch by over a
    quarter in every run, and LRU and Least-Stale make identical decisions at 1% without it."""
    runs = H200 / "diagnostics"
    s = pd.read_csv(runs / "call1" / "slots.csv")
    dec = s[s["phase"] == "decode"].groupby("variant")["measured_s"].mean()
    assert abs(dec["cap5-eager"] / dec["cap1-eager"] - 1) < 0.01
    assert dec["cap5"] / dec["cap1"] > 1.10
    assert abs(dec["cap1-spread5"] / dec["cap1"] - 1) < 0.02
    m = pd.concat([pd.read_csv(runs / "call1" / "specmd.csv"), pd.read_csv(runs / "call2" / "specmd2.csv")])
    first = m[(m["phase"] != "decode") & (m["capacity"] == "1%")]
    ttft = first.groupby(["prefetch", "eviction", "device", "repeat"])["measured_s"].mean()
    assert ttft.loc[("next-gate-topk", "least-stale")].max() < 0.75 * ttft.loc[("next-gate-topk", "lru")].min()
    none = m[(m["capacity"] == "1%") & (m["prefetch"] == "none")].groupby("eviction")[["hits", "misses", "copies"]]
    assert (none.nunique() == 1).all().all()
    assert none.first().loc["lru"].tolist() == none.first().loc["least-stale"].tolist()

"""The declared validation protocol (``docs/guides/calibration.md``, "The validation protocol";
issue 63): how a validation row was measured against it, which executor artefacts inflate a
row, the host's drift between the sentinel rows, and whether a profile's host costs are this
lease's. ``moesim calibrate validate`` labels its rows with these, and
``tools/validation_reports.py`` the committed rows from their manifests."""

from __future__ import annotations

import datetime
import time
from typing import Any

import pandas as pd

HOST_COSTS_MAX_AGE_S = 1800.0  # a lease holds a machine at most 30 minutes: older microbenchmarks are another's
SENTINEL = ["cache.capacity=100%", "policies.prefetch=none"]  # identical work pass after pass: every access a hit
GRAPHS_ARTEFACT = ("graph-per-buffer executor: a per-expert CUDA graph launched behind a wait on the demand-copy "
                   "stream costs time eager launches do not (H200: 375 ms prefill with graphs against 234 ms eager "
                   "for the same decisions; identical work measured 5.43-7.57 ms a decode pass on the H100)")
WORKER_ARTEFACT = ("copy-worker thread: prefetches issued by a Python worker the main thread waits for when it "
                   "needs one still in flight (the prefetch rows at 1% and 5% measured 1.36-1.58x the prediction)")


def protocol_columns(protocol: dict[str, Any], expert_compute: str, prefetch: str) -> dict[str, Any]:
    """A validation row's label: ``protocol`` ("declared", or "not declared: " and what differed
    from the declared protocol: eager launches, prefetches issued from the main thread, the
    process pinned to one core, host costs from ``calibrate measure`` in the same lease just
    before, sentinel rows), ``artefact`` and ``artefact_reason`` (the executor artefacts that
    inflate a row: per-expert CUDA graphs, a copy worker issuing the row's prefetches).
    ``protocol``: how the run was measured (``launch``, ``prefetch_from``, ``pinned``,
    ``host_costs_same_lease``, ``sentinels``; a committed run's manifest or
    :func:`moesim.calibration.validate.validate`'s own)."""
    off = []
    if protocol.get("launch") != "eager":
        off.append("graph launches")
    if protocol.get("prefetch_from") != "main":
        off.append("prefetches from a copy worker")
    if not protocol.get("pinned"):
        off.append("not pinned to one core")
    if not protocol.get("host_costs_same_lease"):
        off.append("host costs not measured just before in the same lease")
    if not protocol.get("sentinels"):
        off.append("no sentinel rows")
    reasons = []
    if protocol.get("launch") == "graphs" and expert_compute == "per-expert":
        reasons.append(GRAPHS_ARTEFACT)
    if protocol.get("prefetch_from") == "worker" and prefetch != "none":
        reasons.append(WORKER_ARTEFACT)
    return {"protocol": "declared" if not off else "not declared: " + "; ".join(off),
            "artefact": bool(reasons), "artefact_reason": "; ".join(reasons)}


def host_costs_age_s(profile: str, device_name: str, now: float | None = None) -> float | None:
    """Seconds since ``profile``'s microbenchmarks were measured, or None where they were measured
    on another device (by name) or the profile does not say when."""
    from moesim.config.profile import load_profile

    on = load_profile(profile, "calibrate validate").get("measured_on") or {}
    at = on.get("measured_at")
    if not at or on.get("device_name") != device_name:
        return None
    then = datetime.datetime.fromisoformat(str(at)).timestamp()
    return (time.time() if now is None else now) - then


def sentinel_tpots(rows: pd.DataFrame) -> tuple[float, float] | None:
    """The TPOT the sentinel rows measured before and after the scenarios (identical work); None
    without both."""
    if "sentinel" not in rows or not {"before", "after"} <= set(rows["sentinel"]):
        return None
    before, after = (float(rows.loc[rows["sentinel"] == k, "tpot_measured_s"].iloc[0]) for k in ("before", "after"))
    return before, after


def sentinel_drift(rows: pd.DataFrame) -> float | None:
    """The host's drift over a run: how far the sentinel row after the scenarios measured from the
    one before, relative to the one before; None without both."""
    tpots = sentinel_tpots(rows)
    if tpots is None:
        return None
    before, after = tpots
    return abs(after - before) / before

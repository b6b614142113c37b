"""Writing results atomically and printing the summary table."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from moesim.config.scenario import Scenario


@dataclass
class Result:
    """What a run produces: one row per forward pass, one per request, and the summary
    (``moesim.simulator.engine.Simulation.run``); ``transfers`` and ``extra`` carry the
    timeline when it was recorded."""

    scenario: Scenario
    steps: pd.DataFrame
    requests: pd.DataFrame
    summary: dict[str, Any]
    transfers: list[tuple[int, str, float, float, float, int]] | None = None  # key, kind, issued, start, done, bytes
    extra: dict[str, Any] = field(default_factory=dict)


def write_results(result: Result, out_dir: str | os.PathLike[str], extra: dict[str, str] | None = None) -> Path:
    """Write ``summary.json``, ``steps.parquet`` (``requests.parquet`` too when serving under
    load) and ``scenario.resolved.yaml`` into
    ``out_dir`` atomically: everything goes to a temporary sibling folder that then replaces
    ``out_dir`` in one rename, so a failure leaves the old results (or nothing)."""
    target = Path(out_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        (tmp / "summary.json").write_text(json.dumps(result.summary, indent=2, sort_keys=False) + "\n")
        result.steps.to_parquet(tmp / "steps.parquet", index=False)
        if result.scenario.workload.arrivals is not None:  # serving: one row per request served
            result.requests.to_parquet(tmp / "requests.parquet", index=False)
        (tmp / "scenario.resolved.yaml").write_text(
            yaml.safe_dump(result.scenario.to_dict(), sort_keys=False))
        for name, text in (extra or {}).items():
            (tmp / name).write_text(text)
        old = None
        if target.exists():
            old = target.parent / f".{target.name}.old-{os.getpid()}"
            os.rename(target, old)
        os.rename(tmp, target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _fmt(value: Any, key: str) -> str:
    """One unit per kind of figure: times in ms, bytes in GB, rates and counts as they are."""
    if value is None:
        return "-"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_fmt(v, key)}" for k, v in value.items())
    if key.endswith("_s") and key not in RATES and isinstance(value, int | float):
        return f"{value * 1e3:,.3f} ms"
    if key.startswith("bytes") and isinstance(value, int | float):
        return f"{value / 1e9:,.3f} GB"
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 1000 else f"{value:.4g}"
    return str(value)


RATES = ("tokens_per_s", "throughput_tokens_s", "requests_per_s", "goodput_requests_s")  # per second, not times
SERVING_ROWS = ("served_requests", "offered_rate", "requests_per_s", "throughput_tokens_s", "ttft_mean_s",
                "ttft_p50_s", "ttft_p99_s", "tpot_mean_s", "tpot_p50_s", "tpot_p99_s", "e2e_p99_s", "queue_mean_s",
                "slo_attainment", "goodput_requests_s", "max_running_seen", "kv_capacity_tokens")
SUMMARY_ROWS = ("hits", "misses", "hit_rate", "collision_misses", "late_prefetches",
                "prefetches_issued", "prefetches_used", "prefetch_precision", "prefetch_recall",
                "uncached_fetches", "bytes_by_link", "stall_s", "ttft_s", "tpot_s",
                "tokens_per_s", "mean_accepted_tokens", "speedup_vs_autoregressive", "link_utilisation", "unique_experts_per_layer",
                "unique_experts_per_layer_prefill", "gate_mass_retained", "tokens_altered",
                "low_precision_experts", "dropped_experts", "substituted_experts", "gpus", "max_experts_per_gpu",
                "total_time_s", "forward_passes", "tokens", "requests")


def summary_table(result: Result, title: str) -> Any:
    """A rich Table of the main metrics."""
    from rich.table import Table

    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in SUMMARY_ROWS:
        if key in result.summary and not (key in ("gpus", "max_experts_per_gpu") and result.summary.get("gpus", 1) == 1):
            table.add_row(key, _fmt(result.summary[key], key))
    for key in SERVING_ROWS:  # serving under load
        if key in result.summary:
            table.add_row(key, _fmt(result.summary[key], key))
    for note in result.summary.get("arrival_notes", []):
        table.add_row("arrivals", note)
    if "replay_path" in result.summary:  # which replay ran: the compiled kernel, or SimPy and why
        why = result.summary.get("replay_path_reason")
        table.add_row("replay_path", result.summary["replay_path"] + (f" ({why})" if why else ""))
    if "warning" in result.summary:
        table.add_row("warning", result.summary["warning"])
    return table

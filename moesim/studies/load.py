"""``moesim compare`` under load: which policy, at what request rate (``docs/guides/serving.md``).

For a scenario with ``workload.arrivals`` the comparison runs every candidate policy (eviction x
prefetch, as ``compare`` picks them, less the prefetchers serving cannot run) and on-demand LRU
(the baseline) at each cache capacity and each request rate asked for (``--rate``; default the
scenario's), all as sweep points (parallel, resumable, Ray). The fixed-batch references do
not apply: Belady's MIN needs the future of a schedule that depends on the replay's own
timing, and an infinite cache leaves no HBM for the KV cache.

Each (policy, capacity, rate) runs several arrival draws (``--seeds``, default :data:`SEEDS`:
the arrival seed and the next ones; one for an arrival file, which draws nothing), each a sweep
point run in parallel; runs whose inputs are identical (their fingerprints equal: the on-demand
LRU baseline is the LRU candidate when the scenario's miss and budget policies are the
baseline's) run once. The table gives per (capacity, rate) the figures over the draws'
requests pooled — p50/p99 TTFT and TPOT, SLO attainment — and the mean over the draws of the
served and goodput rates, the realised arrival rate, the p99 ITL and the hit rate; candidates
ranked by SLO attainment (with an ``slo``) then p99 TTFT. With an ``slo`` each policy's
*capacity* — the highest rate at which at least ``slo.attainment`` of the pooled requests meet
it (DistServe's definition) — is found by bisection on the rate: bracketed from the rates run
(halving or doubling, at most :data:`MAX_STEPS` times), then the geometric middle of the
bracket until it is within :data:`TOLERANCE` (a rate scales the same arrival draws, so the
probes share their randomness). Beside it, the interval over the draws: each draw's own
capacity (the highest rate run up to which that draw meets the SLO at every rate run), lowest
and highest. A capacity no failing rate brackets is a lower bound, and says so. The plot is
latency against load: p99 TTFT and p99 TPOT against the offered rate, a line per policy, the
SLO drawn.
"""

from __future__ import annotations

import itertools
import math
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from moesim.errors import MoesimError
from moesim.policies.prefetch.base import predictors
from moesim.studies.sweep import (
    Point,
    RunsFailed,
    collect,
    joined_rows,
    make_points,
    other_points,
    run_points,
)

SERVED_EVICTION = ("lru", "lfu", "fld", "least-stale")
SERVED_PREFETCH = ("none",)
BASELINE = {"policies.eviction": "lru", "policies.prefetch": "none", "policies.miss": "fetch",
            "policies.budget": "none"}
RATE = "workload.arrivals.rate"
SEED = "workload.arrivals.seed"
SEEDS = 5  # arrival draws per (policy, capacity, rate) by default
TOLERANCE = 0.05  # bisection stops when the bracket's ends are within 5% of each other
MAX_STEPS = 8  # halvings or doublings to bracket a policy's capacity from the rates run
SHOWN = ("role", "label", "capacity", "rate", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "itl_p99_s",
         "slo_attainment", "goodput_requests_s", "requests_per_s", "hit_rate")


def sig(x: float, digits: int = 2) -> str:
    """A rate to ``digits`` significant figures, without an exponent (4.968 -> 5.0, 256 ->
    260; to 3: 1,234 -> 1230, 0.0451 -> 0.0451)."""
    if not x > 0:
        return f"{x:g}"
    rounded = float(f"{x:.{digits - 1}e}")  # its magnitude after rounding: 99.96 -> 100
    decimals = digits - 1 - math.floor(math.log10(rounded))
    return f"{round(rounded, decimals):.{max(decimals, 0)}f}"


def seed_values(data: dict[str, Any], seeds: int) -> list[int | None]:
    """The arrival seeds each rate runs: the arrivals' seed (else the scenario's) and the next
    ``seeds - 1``; [None] (no seed axis) for an arrival file, whose times are given."""
    if seeds < 1:
        raise MoesimError(f"--seeds must be at least 1, got {seeds}.")
    arr = data["workload"]["arrivals"]
    if arr.get("process") == "file":
        return [None]
    base = arr.get("seed")
    base = int(data.get("seed") or 0) if base is None else int(base)
    return [base + k for k in range(seeds)]


def seed_points(p: Path, data: dict[str, Any], groups: list[dict[str, Any]], seeds: list[int | None],
                traces: dict[str, Any]) -> tuple[list[Point], list[str]]:
    """A point per group of values and seed, runs with the same fingerprint merged: the points
    to run, and per group its key (its points' ids joined by '+', in seed order)."""
    combos = [{**g, SEED: s} if s is not None else dict(g) for g in groups for s in seeds]
    pts = make_points(p, data, combos, traces)
    first: dict[str, Point] = {}
    ids = [first.setdefault(pt.fingerprint, pt).pid for pt in pts]
    k = len(seeds)
    return list(first.values()), ["+".join(ids[i * k:(i + 1) * k]) for i in range(len(groups))]


def pooled(out: Path, results: pd.DataFrame, keys: list[str], slo: Any) -> pd.DataFrame:
    """One row per key (a group's points, '+'-joined): the TTFT, TPOT and e2e figures and SLO
    attainment of the seeds' requests pooled (:func:`simulator.serving.summary`), the served,
    goodput and realised arrival rates, the ITL percentiles and the hit rate as the mean over
    the seeds, each seed's SLO attainment (``seed_attainment``) and the seeds (``seeds``); a
    failed run's status and error."""
    from moesim.simulator.serving import summary

    by = results.set_index("point")
    rows = []
    for key in dict.fromkeys(keys):
        pids = key.split("+")
        here = by.loc[pids]
        bad = here[here["status"] != "ok"]
        if len(bad):
            rows.append({"point": key, "status": "error", "error": bad["error"].iloc[0]})
            continue
        frames = [pd.read_parquet(out / "points" / pid / "requests.parquet") for pid in pids]
        row: dict[str, Any] = {"point": key, "status": "ok", "seeds": len(pids)}
        row.update(summary(pd.concat(frames, ignore_index=True), slo))
        for col in ("requests_per_s", "goodput_requests_s", "throughput_tokens_s", "offered_rate", "itl_p50_s",
                    "itl_p99_s", "hit_rate"):
            if col in here:
                v = pd.to_numeric(here[col])
                row[col] = float(v.mean()) if v.notna().all() else None
        if slo is not None:
            row["seed_attainment"] = [float(a) for a in here["slo_attainment"]]
        rows.append(row)
    return pd.DataFrame(rows)


def _round(rate: float) -> float:
    """A probe rate to 4 significant figures (stable point ids on a rerun)."""
    return float(f"{rate:.4g}")


def file_rate(data: dict[str, Any], base_dir: str, where: str) -> float:
    """The mean arrival rate of the scenario's arrival file (its own timestamps)."""
    from moesim.simulator.serving import read_arrival_file

    arr = data["workload"]["arrivals"]
    p = Path(str(arr["path"]))
    p = p if p.is_absolute() else Path(base_dir) / p
    t, _, _, _ = read_arrival_file(p, arr.get("requests"), bool(arr.get("skip_zero_output", True)))
    if len(t) < 2 or t[-1] <= 0:
        raise MoesimError(f"{where}: the arrival file {p} spans no time, so it has no rate to compare at; give "
                          "--rate R1,R2,... (its timestamps are rescaled to each).")
    return (len(t) - 1) / float(t[-1])


def plan_load(p: Path, data: dict[str, Any], eviction: Sequence[str] | None, prefetch: Sequence[str] | None,
              capacity: Sequence[str] | None, rates: Sequence[float] | None, has_pred_next: bool,
              traces: dict[str, Any], seeds: int = SEEDS, miss: Sequence[str] | None = None,
              budget: Sequence[str] | None = None) -> tuple[list[Point], list[dict[str, Any]]]:
    """The points (candidates and the baseline at every capacity and rate, each with every
    arrival seed, identical runs once) and the row plan (each row's ``point``: its points'
    ids joined by '+'). Candidates are every eviction, prefetch, miss and budget policy
    given (the scenario's own miss and budget policies when none are)."""
    arr = data["workload"]["arrivals"]
    cache = data.get("cache") or {}
    caps = list(capacity) if capacity else [str(cache.get("capacity", "5%"))]
    if rates:
        rate_list = [float(r) for r in rates]
    elif arr.get("rate") is not None:
        rate_list = [float(arr["rate"])]
    else:
        rate_list = [_round(file_rate(data, str(p.parent), str(p)))]
    if any(not (r > 0 and math.isfinite(r)) for r in rate_list):
        raise MoesimError(f"--rate: every rate must be a positive number of requests per second, got {rate_list}.")
    evs = list(eviction) if eviction else list(SERVED_EVICTION)
    pfs = list(prefetch) if prefetch else list(SERVED_PREFETCH) + (predictors() if has_pred_next else [])
    combos: dict[str, dict[str, Any]] = {}
    rows: list[dict[str, Any]] = []

    def add(role: str, label: str, cap: str, rate: float, values: dict[str, Any]) -> None:
        key = repr(sorted(values.items(), key=lambda kv: kv[0]))
        combos.setdefault(key, values)
        rows.append({"role": role, "label": label, "capacity": cap, "rate": rate, "key": key})

    misses: list[str | None] = list(miss) if miss else [None]
    budgets: list[str | None] = list(budget) if budget else [None]
    for cap, rate in itertools.product(caps, rate_list):
        for ev, pf, ms, bd in itertools.product(evs, pfs, misses, budgets):
            label = " + ".join(x for x in (ev, pf if pf != "none" else "", ms if ms not in (None, "fetch") else "",
                                           bd if bd not in (None, "none") else "") if x)
            values = {"cache.capacity": cap, "policies.eviction": ev, "policies.prefetch": pf, RATE: rate}
            values.update({k: v for k, v in (("policies.miss", ms), ("policies.budget", bd)) if v is not None})
            add("candidate", label, cap, rate, values)
        add("baseline", "on-demand LRU (baseline)", cap, rate, {"cache.capacity": cap, **BASELINE, RATE: rate})
    points, keys = seed_points(p, data, list(combos.values()), seed_values(data, seeds), traces)
    pid_of = dict(zip(combos, keys, strict=True))
    for r in rows:
        r["point"] = pid_of[r.pop("key")]
    return points, rows


def _meets(row: Any, target: float) -> bool:
    return bool(row["slo_attainment"] >= target)


def seed_capacities(measured: dict[float, Any], target: float) -> list[float | None]:
    """Each seed's own capacity from the rates run: the highest rate up to which that seed met
    the SLO at every rate run (None: it failed at the lowest)."""
    rates = sorted(measured)
    per_rate = [list(measured[r].get("seed_attainment") or [measured[r]["slo_attainment"]]) for r in rates]
    caps: list[float | None] = []
    for i in range(len(per_rate[0])):
        cap = None
        for r, att in zip(rates, per_rate, strict=True):
            if att[i] < target:
                break
            cap = r
        caps.append(cap)
    return caps


def bisect_capacity(table: pd.DataFrame, target: float,
                    measure: Callable[[list[dict[str, Any]]], list[Any]]) -> pd.DataFrame:
    """Per (policy, capacity), the highest rate measured to meet the SLO (``capacity_rps``)
    and the lowest measured not to (``fails_at_rps``), by bracketing and bisection on the rate
    (module docstring); the interval over the seeds (``capacity_low_rps``,
    ``capacity_high_rps``: :func:`seed_capacities`' lowest and highest; the low end None when
    a seed failed at every rate run), the realised arrival rate at the capacity, whether it is
    a lower bound (no rate run failed), and ``probes``, the rates run. ``measure`` runs the
    given values (a rate each) and returns a row each, in order."""
    keys = table[["role", "label", "capacity"]].drop_duplicates().to_dict("records")
    values_of: dict[tuple[str, str], dict[str, Any]] = {}
    for _, r in table.iterrows():
        values_of[(r["label"], r["capacity"])] = {k: v for k, v in r["values"].items() if k != RATE}
    state: dict[tuple[str, str], dict[str, Any]] = {}
    for k in keys:
        here = table[(table["label"] == k["label"]) & (table["capacity"] == k["capacity"])]
        ok = [float(r["rate"]) for _, r in here.iterrows() if _meets(r, target)]
        bad = [float(r["rate"]) for _, r in here.iterrows() if not _meets(r, target)]
        lo = max(ok) if ok else None
        hi = min((b for b in bad if lo is None or b > lo), default=None)
        state[(k["label"], k["capacity"])] = {"role": k["role"], "lo": lo, "hi": hi, "probes": len(here), "steps": 0,
                                              "measured": {float(r["rate"]): r for _, r in here.iterrows()}}
    while True:
        probes: dict[tuple[str, str], float] = {}
        for key, s in state.items():
            lo, hi = s["lo"], s["hi"]
            if lo is not None and hi is not None:
                if hi / lo <= 1 + TOLERANCE:
                    continue
                rate = _round(math.sqrt(lo * hi))
            elif s["steps"] >= MAX_STEPS:
                continue
            elif lo is None:
                rate = _round(hi / 2)
                s["steps"] += 1
            else:
                rate = _round(lo * 2)
                s["steps"] += 1
            probes[key] = rate
        if not probes:
            break
        rows = measure([{**values_of[key], RATE: rate} for key, rate in probes.items()])
        for (key, rate), row in zip(probes.items(), rows, strict=True):
            s = state[key]
            s["measured"][rate] = row
            s["probes"] += 1
            s["lo" if _meets(row, target) else "hi"] = rate  # every probe lies beyond lo and below hi
    out_rows = []
    for (label, cap), s in state.items():
        caps = seed_capacities(s["measured"], target)
        found = [c for c in caps if c is not None]
        realised = s["measured"][s["lo"]].get("offered_rate") if s["lo"] is not None else None
        out_rows.append({
            "role": s["role"], "label": label, "capacity": cap, "capacity_rps": s["lo"],
            "capacity_low_rps": None if len(found) < len(caps) else min(found),
            "capacity_high_rps": max(found) if found else None,
            "realised_rps": None if realised is None or pd.isna(realised) else float(realised),
            "fails_at_rps": s["hi"], "lower_bound": s["lo"] is not None and s["hi"] is None, "seeds": len(caps),
            "probes": s["probes"],
            "curve": sorted((r, float(m["ttft_p99_s"]), float(m["tpot_p99_s"] if pd.notna(m["tpot_p99_s"]) else np.nan))
                            for r, m in s["measured"].items())})
    return pd.DataFrame(out_rows)


def rank_load(results: pd.DataFrame, rows: list[dict[str, Any]], slo: bool) -> pd.DataFrame:
    """Per (capacity, rate), the candidates ranked (SLO attainment, then p99 TTFT), then the
    baseline; ``speedup_ttft_p99`` is the baseline's p99 TTFT over the candidate's."""
    table = joined_rows(rows, results)
    parts = []
    for (_cap, _rate), here in table.groupby(["capacity", "rate"], sort=False):
        here = here.copy()
        base = float(here.loc[here["role"] == "baseline", "ttft_p99_s"].iloc[0])
        here["speedup_ttft_p99"] = base / here["ttft_p99_s"]
        cands = here[here["role"] == "candidate"]
        order = ["slo_attainment", "ttft_p99_s", "label"] if slo else ["ttft_p99_s", "label"]
        asc = [False, True, True] if slo else [True, True]
        cands = cands.sort_values(order, ascending=asc, kind="stable")
        cands.insert(0, "rank", np.arange(1, len(cands) + 1))
        parts += [cands, here[here["role"] != "candidate"].assign(rank=pd.NA)]
    out = pd.concat(parts, ignore_index=True)
    for col in SHOWN:
        if col not in out.columns:
            out[col] = np.nan
    first = ["rank", *SHOWN, "speedup_ttft_p99", "point"]
    return out[first + [c for c in out.columns if c not in first]]


def _num(v: Any, spec: str, scale: float = 1.0, unit: str = "") -> str:
    return "" if v is None or pd.isna(v) else format(float(v) * scale, spec) + unit


def _sig(v: Any, digits: int = 2) -> str:
    return "" if v is None or pd.isna(v) else sig(float(v), digits)


def capacity_text(r: Any) -> str:
    """A policy's capacity in words: '4.9', 'at least 260' (no rate run failed) or 'below 0.25'
    (the lowest rate run failed)."""
    if r["capacity_rps"] is None or pd.isna(r["capacity_rps"]):
        return f"below {_sig(r['fails_at_rps'])}" if pd.notna(r["fails_at_rps"]) else "none run"
    return f"at least {_sig(r['capacity_rps'])}" if r["lower_bound"] else _sig(r["capacity_rps"])


def interval_text(r: Any) -> str:
    """The interval over seeds: 'lo-hi', '<hi' when a seed failed at every rate run, '' with
    one seed."""
    if r["seeds"] < 2 or r["capacity_high_rps"] is None or pd.isna(r["capacity_high_rps"]):
        return ""
    lo = r["capacity_low_rps"]
    return (f"{_sig(lo)}-{_sig(r['capacity_high_rps'])}" if lo is not None and pd.notna(lo)
            else f"<{_sig(r['capacity_high_rps'])}")


def markdown_load(table: pd.DataFrame, cap_table: pd.DataFrame | None, title: str, slo_text: str) -> str:
    """The tables as GitHub Markdown: the capacity per policy (with an SLO), then per rate."""
    lines = [f"# {title}", ""]
    if cap_table is not None:
        lines += [f"## Highest request rate meeting the SLO ({slo_text})", "",
                  "| rank | policy | cache capacity | capacity (req/s) | over seeds (req/s) | realised (req/s) | "
                  "fails at (req/s) | vs baseline | seeds | rates run |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in cap_table.to_dict("records"):
            lines.append(f"| {'' if pd.isna(r['rank']) else int(r['rank'])} | {r['label']} | {r['capacity']} | "
                         f"{capacity_text(r)} | {interval_text(r)} | {_sig(r['realised_rps'])} | "
                         f"{_sig(r['fails_at_rps'], 3) or 'none run'} | {_num(r['vs_baseline'], '.2f', 1.0, 'x')} | "
                         f"{r['seeds']} | {r['probes']} |")
        lines += ["", "Capacity: the highest rate run at which the SLO's share of the seeds' pooled requests meet it "
                  "(to two significant figures); over seeds: the lowest and highest of each seed's own capacity "
                  "(the highest rate up to which that seed met it at every rate run; '<x': a seed failed at the "
                  "lowest rate run); realised: the arrival rate the seeds drew at the capacity, their mean.", ""]
    head = ["rank", "policy", "capacity", "rate (req/s)", "TTFT p50 (ms)", "TTFT p99 (ms)", "TPOT p50 (ms)",
            "TPOT p99 (ms)", "ITL p99 (ms)", "SLO attainment", "goodput (req/s)", "served (req/s)", "hit rate"]
    lines += ["## Latency at each rate", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table.to_dict("records"):
        lines.append("| " + " | ".join([
            "" if pd.isna(r["rank"]) else str(int(r["rank"])), str(r["label"]), str(r["capacity"]),
            _num(r["rate"], "g"), _num(r["ttft_p50_s"], ".1f", 1e3), _num(r["ttft_p99_s"], ".1f", 1e3),
            _num(r["tpot_p50_s"], ".2f", 1e3), _num(r["tpot_p99_s"], ".2f", 1e3), _num(r["itl_p99_s"], ".2f", 1e3),
            _num(r["slo_attainment"], ".0%"),
            _sig(r["goodput_requests_s"], 3), _sig(r["requests_per_s"], 3), _num(r["hit_rate"], ".3f")]) + " |")
    lines += ["", "Ranked per capacity and rate by SLO attainment, then p99 TTFT. A rate meets the SLO when at least "
              "the SLO's attainment share of requests meet its TTFT, TPOT and ITL limits (ITL: a request's longest gap between two output tokens); the highest such rate is found by "
              "bisection on the rate (each probe a run)."]
    return "\n".join(lines) + "\n"


def terminal_load(table: pd.DataFrame, cap_table: pd.DataFrame | None, title: str, slo_text: str) -> str:
    """The capacity per policy (with an SLO) or the per-rate table, at most 80 columns, then a
    recommendation per cache capacity."""
    lines = [*textwrap.wrap(title, 80, subsequent_indent="  "), ""]
    if cap_table is not None:
        lines.append(f"{'#':>2} {'policy':<34} {'cap':>5} {'req/s':>14} {'over seeds':>11} {'vs base':>8}")
        lines.append("-" * 80)
        for r in cap_table.to_dict("records"):
            label = str(r["label"]) if len(str(r["label"])) <= 34 else str(r["label"])[:33] + "~"
            lines.append(f"{'' if pd.isna(r['rank']) else int(r['rank']):>2} {label:<34} {r['capacity']:>5} "
                         f"{capacity_text(r):>14} {interval_text(r):>11} "
                         f"{_num(r['vs_baseline'], '.2f', 1.0, 'x'):>8}".rstrip())
        lines.append("")
        for cap, here in cap_table.groupby("capacity", sort=False):
            cands = here[here["role"] == "candidate"].sort_values("rank")
            base = here[here["role"] == "baseline"].iloc[0]
            if cands.empty:
                continue
            best = cands.iloc[0]
            if pd.isna(best["capacity_rps"]):
                lines += textwrap.wrap(f"At {cap}: no policy met the SLO ({slo_text}) at any rate run.", 80,
                                       subsequent_indent="  ")
                continue
            seeds = "" if best["seeds"] < 2 or not interval_text(best) else \
                f" ({interval_text(best)} over {best['seeds']} arrival seeds)"
            vs = "" if pd.isna(best["vs_baseline"]) else f", {best['vs_baseline']:.2f}x on-demand LRU's " + \
                f"{capacity_text(base)}"
            lines += textwrap.wrap(f"Best at {cap}: {best['label']} serves {capacity_text(best)} requests/s{seeds} "
                                   f"within the SLO ({slo_text}){vs}.", 80, subsequent_indent="  ")
    else:
        lines.append(f"{'#':>2} {'policy':<24} {'cap':>5} {'req/s':>7} {'TTFT p99 ms':>12} {'TPOT p99 ms':>12} "
                     f"{'ITL p99 ms':>11}")
        lines.append("-" * 80)
        for r in table.to_dict("records"):
            label = str(r["label"]) if len(str(r["label"])) <= 24 else str(r["label"])[:23] + "~"
            lines.append(f"{'' if pd.isna(r['rank']) else int(r['rank']):>2} {label:<24} {r['capacity']:>5} "
                         f"{r['rate']:>7.3g} {_num(r['ttft_p99_s'], '.1f', 1e3):>12} "
                         f"{_num(r['tpot_p99_s'], '.2f', 1e3):>12} {_num(r['itl_p99_s'], '.2f', 1e3):>11}".rstrip())
        lines += ["", *textwrap.wrap("Give the scenario an slo (ttft_s, tpot_s, itl_s) to find each policy's highest "
                                     "rate within it.", 80)]
    return "\n".join(lines) + "\n"


def figure_load(table: pd.DataFrame, cap_table: pd.DataFrame | None, title: str, slo: Any) -> Any:
    """Latency against load: p99 TTFT and p99 TPOT (ms) against the offered rate (requests/s),
    a line per policy (the baseline red), one row of panels per cache capacity; the SLO's
    limits dashed, each policy's capacity marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    caps = list(dict.fromkeys(table["capacity"]))
    palette = [f"C{i}" for i in range(10) if i != 3]  # C3 (red) is the baseline's
    fig, axes = plt.subplots(len(caps), 2, figsize=(11, 3.6 * len(caps) + 0.8), squeeze=False, layout="constrained")
    for row, cap in zip(axes, caps, strict=True):
        here = table[table["capacity"] == cap]
        labels = list(dict.fromkeys(here.sort_values("role", key=lambda s: s != "baseline")["label"]))
        for i, label in enumerate(labels):
            if cap_table is not None:
                c = cap_table[(cap_table["label"] == label) & (cap_table["capacity"] == cap)].iloc[0]
                pts = sorted(c["curve"])
            else:
                sub = here[here["label"] == label].sort_values("rate")
                pts = list(zip(sub["rate"], sub["ttft_p99_s"], sub["tpot_p99_s"], strict=True))
            x = [p[0] for p in pts]
            base = "baseline" in label
            style = {"color": "tab:red", "linewidth": 2.5, "alpha": 0.6} if base else {
                "color": palette[(i - 1) % len(palette)], "linewidth": 1.2}
            line = row[0].plot(x, [p[1] * 1e3 for p in pts], marker="o", markersize=3, label=label, **style)[0]
            row[1].plot(x, [p[2] * 1e3 for p in pts], marker="o", markersize=3, color=line.get_color(),
                        linewidth=line.get_linewidth())
            if cap_table is not None and pd.notna(c["capacity_rps"]):
                for ax in row:
                    ax.axvline(float(c["capacity_rps"]), color=line.get_color(), linestyle=":", linewidth=0.8)
        for ax, what, limit in ((row[0], "p99 TTFT (ms)", getattr(slo, "ttft_s", None)),
                                (row[1], "p99 TPOT (ms)", getattr(slo, "tpot_s", None))):
            if limit is not None:
                ax.axhline(limit * 1e3, color="black", linestyle="--", linewidth=1, label="SLO")
            ax.set_xlabel("offered load (requests/s)")
            ax.set_ylabel(what)
            ax.set_yscale("log")
            ax.set_title(f"{what.split(' (')[0]} against load, expert cache {cap}", fontsize=9)
        row[0].legend(fontsize=7, loc="upper left")
    fig.suptitle(textwrap.fill(title + ("; dotted: each policy's highest rate within the SLO"
                                        if cap_table is not None else ""), 140), fontsize=9)
    return fig


def compare_load(scenario_path: str, p: Path, data: dict[str, Any], out: Path, eviction: Sequence[str] | None,
                 prefetch: Sequence[str] | None, capacity: Sequence[str] | None, rates: Sequence[float] | None,
                 has_pred_next: bool, traces: dict[str, Any], workers: int, executor: str,
                 ray_address: str | None, progress: Callable[[int, int, int], None] | None,
                 title: str, verify: bool = False, prune: bool = False, seeds: int = SEEDS,
                 miss: Sequence[str] | None = None, budget: Sequence[str] | None = None) -> tuple[pd.DataFrame, str]:
    """The comparison under load (module docstring): writes compare.parquet (per rate),
    capacity.parquet (with an SLO), compare.md and compare.png in ``out``."""
    from moesim.config.scenario import scenario_from_dict
    from moesim.files import save_figure_atomic, write_atomic, write_text_atomic

    points, rows = plan_load(p, data, eviction, prefetch, capacity, rates, has_pred_next, traces, seeds, miss, budget)
    seed_list = seed_values(data, seeds)
    all_points = list(points)
    runs = run_points(data, points, out, workers, executor, ray_address, progress, verify)
    sc = scenario_from_dict({k: v for k, v in data.items() if not str(k).startswith("__")}, where=str(p),
                            base_dir=str(p.parent))
    slo = sc.slo
    results = pooled(out, collect(out, points), [r["point"] for r in rows], slo)
    table = rank_load(results, rows, slo is not None)
    by_pid = {q.pid: q.values for q in points}
    values_of = {r["point"]: {k: v for k, v in by_pid[r["point"].split("+")[0]].items() if k != SEED} for r in rows}
    table["values"] = table["point"].map(values_of)
    cap_table = None
    slo_text = ""
    if slo is not None:
        parts = [f"TTFT <= {slo.ttft_s * 1e3:g} ms" if slo.ttft_s is not None else "",
                 f"TPOT <= {slo.tpot_s * 1e3:g} ms" if slo.tpot_s is not None else "",
                 f"every ITL <= {slo.itl_s * 1e3:g} ms" if slo.itl_s is not None else ""]
        slo_text = f"{' and '.join(x for x in parts if x)} for {slo.attainment:.0%} of requests"
        def measure(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
            plain_data = {k: v for k, v in data.items() if not str(k).startswith("__")}  # make_points adds them
            pts, keys = seed_points(p, plain_data, groups, seed_list, traces)
            all_points.extend(pts)
            runs.add(run_points(data, pts, out, workers, executor, ray_address, progress, verify))
            got = pooled(out, collect(out, all_points), keys, slo)
            bad = got[got["status"] != "ok"]
            if len(bad):
                raise RunsFailed(f"compare: a bisection run failed: {bad.iloc[0].get('error', '?')}")
            by = got.set_index("point")
            return [by.loc[k].to_dict() for k in keys]

        cap_table = bisect_capacity(table, slo.attainment, measure)
        parts_ = []
        for _cap, here in cap_table.groupby("capacity", sort=False):
            here = here.copy()
            base = here.loc[here["role"] == "baseline", "capacity_rps"].iloc[0]
            here["vs_baseline"] = (here["capacity_rps"] / base if base is not None and pd.notna(base) and base > 0
                                   else np.nan)
            cands = here[here["role"] == "candidate"].sort_values(["capacity_rps", "label"], ascending=[False, True],
                                                                   na_position="last", kind="stable")
            cands.insert(0, "rank", np.arange(1, len(cands) + 1))
            parts_ += [cands, here[here["role"] != "candidate"].assign(rank=pd.NA)]
        cap_table = pd.concat(parts_, ignore_index=True)
        keep = cap_table.drop(columns=["curve"])
        write_atomic(out / "capacity.parquet", lambda tmp: keep.to_parquet(tmp, index=False))
    elif (out / "capacity.parquet").exists():  # an earlier run's, with an SLO this one lacks
        (out / "capacity.parquet").unlink()
    plain = table.drop(columns=["values"])
    write_atomic(out / "compare.parquet", lambda tmp: plain.to_parquet(tmp, index=False))
    write_text_atomic(out / "compare.md", markdown_load(plain, cap_table, title, slo_text))
    save_figure_atomic(figure_load(plain, cap_table, title, slo), out / "compare.png")
    others = other_points(out, all_points, prune)
    plain.attrs.update(runs=runs, reused=runs.reused, others=others, pruned=prune, points=runs.reused + runs.ran,
                       metric="ttft_p99_s", title=title, text=terminal_load(plain, cap_table, title, slo_text))
    if cap_table is not None:
        plain.attrs["capacity"] = cap_table.drop(columns=["curve"])
    return plain, "ttft_p99_s"

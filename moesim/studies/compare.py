"""``moesim compare``: rank policy combinations on one scenario, with their reference rows.

The candidates are the product of the eviction, prefetch, miss and budget policies asked for
(defaults drawn from the papers: LRU, LFU, FLD (HOBBIT), Least-Stale (SpecMD §4.2); no
prefetch, previous-token, and the next-layer gate predictors when the trace records
``pred_next``), at each cache capacity asked for. Beside them, per capacity:

- ``baseline``: on-demand LRU — LRU eviction, no prefetch, blocking fetch, no budget;
- ``bound``: Belady's MIN with oracle prefetch (the true next layer's experts), the
  reference every policy is measured against. It is the optimum of misses for the same
  pinning rules, not of time: a policy may beat it in time (a gap closed above 100%);
- ``infinite`` (once, capacity-independent): every expert the trace uses preloaded before
  the replay (``static-pin`` over all passes at 100% capacity) — no copies at all.

Under expert parallelism with offload (``cache.ep_offload``: each GPU fetches on demand) the
bound is Belady without prefetch and ``infinite`` is every GPU holding its share of the experts.

Every row is a sweep point (``studies.sweep``: parallel, resumable, Ray). The ranking
metric (``tpot_s``, or ``ttft_s`` for a scenario without decode passes) orders the
candidates; ``speedup`` is baseline / candidate and ``gap_closed`` the share of the
baseline-to-bound difference a candidate closes: (baseline - candidate) / (baseline - bound).
"""

from __future__ import annotations

import copy
import itertools
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
    base_data,
    collect,
    folder_lock,
    joined_rows,
    make_points,
    other_points,
    run_points,
    trace_key,
    workers_started,
)

DEFAULT_EVICTION = ("lru", "lfu", "fld", "least-stale")
DEFAULT_PREFETCH = ("none", "previous-token")
BASELINE = {"policies.eviction": "lru", "policies.prefetch": "none", "policies.miss": "fetch",
            "policies.budget": "none"}
BOUND = {"policies.eviction": "belady", "policies.prefetch": "oracle", "policies.miss": "fetch",
         "policies.budget": "none"}
INFINITE = {"cache.capacity": "100%", "policies.eviction": "lru", "policies.miss": "fetch",
            "policies.budget": "none",
            "policies.prefetch": {"name": "static-pin", "fraction": 1.0, "calibration": 1.0}}
# expert parallelism with offload (cache.ep_offload) fetches on demand: its bound is Belady without
# prefetch, and its all-resident reference the GPUs holding their shares of the experts
BOUND_ON_DEMAND = {**BOUND, "policies.prefetch": "none"}
EP_RESIDENT = {**BASELINE, "cache.ep_offload": False}
KEYS = ("policies.eviction", "policies.prefetch", "policies.miss", "policies.budget")
SHOWN = ("role", "label", "capacity", "metric_ms", "tpot_s", "ttft_s", "tokens_per_s", "hit_rate",
         "collision_misses", "bytes_moved", "speedup", "gap_closed")


def _names(value: Any) -> str:
    return value["name"] if isinstance(value, dict) else str(value)


def _check_trace(data: dict[str, Any], base_dir: str, capacities: list[str], where: str,
                 traces: dict[str, Any]) -> bool:
    """Load the scenario's trace once (into ``traces``, by :func:`trace_key`, for
    :func:`make_points`): refuse capacities impossible for its model before anything runs,
    and say whether it records ``pred_next`` (for the gate predictors)."""
    from moesim.config.scenario import parse_capacity, scenario_from_dict
    from moesim.simulator.build import load_trace

    sc = scenario_from_dict(data, where=where, base_dir=base_dir)
    key = trace_key(sc)
    if key not in traces:
        traces[key] = load_trace(sc)
    trace = traces[key]
    m = trace.model
    per_expert = int(m.expert_bytes.get(sc.cache.precision or m.default_precision(),
                                        m.expert_bytes[m.default_precision()]))
    for cap in capacities:
        parse_capacity(cap, per_expert, per_expert * m.num_layers * m.num_experts, f"{where} (--capacity)")
    return trace.pred_next is not None


def plan_compare(scenario_path: str, eviction: Sequence[str] | None = None, prefetch: Sequence[str] | None = None,
                 miss: Sequence[str] | None = None, budget: Sequence[str] | None = None,
                 capacity: Sequence[str] | None = None, overrides: tuple[str, ...] = ()
                 ) -> tuple[dict[str, Any], list[Point], list[dict[str, Any]]]:
    """The base scenario data, the points to run, and one row plan per table row (its role,
    label, capacity and point id; a point that plays two roles runs once)."""
    p, data, _ = base_data(scenario_path, overrides)
    pol = data.get("policies") or {}
    cache = data.get("cache") or {}
    caps = list(capacity) if capacity else [str(cache.get("capacity", "5%"))]
    evs = list(eviction) if eviction else list(DEFAULT_EVICTION)
    traces: dict[str, Any] = {}
    has_pred_next = _check_trace(data, str(p.parent), caps, str(p), traces)
    pfs = list(prefetch) if prefetch else list(DEFAULT_PREFETCH) + (predictors() if has_pred_next else [])
    misses = list(miss) if miss else [_names(pol.get("miss", "fetch"))]
    budgets = list(budget) if budget else [_names(pol.get("budget", "none"))]
    rows: list[dict[str, Any]] = []
    combos: dict[str, dict[str, Any]] = {}
    offload = bool(cache.get("ep_offload"))

    def add(role: str, label: str, cap: str, values: dict[str, Any]) -> None:
        key = repr(sorted(values.items(), key=lambda kv: kv[0]))
        combos.setdefault(key, values)
        rows.append({"role": role, "label": label, "capacity": cap, "key": key})

    for cap in caps:
        for ev, pf, ms, bd in itertools.product(evs, pfs, misses, budgets):
            label = " + ".join(x for x in (ev, pf if pf != "none" else "no prefetch",
                                           ms if ms != "fetch" else "", bd if bd != "none" else "") if x)
            add("candidate", label, cap, {"cache.capacity": cap, **dict(zip(KEYS, (ev, pf, ms, bd), strict=True))})
        add("baseline", "on-demand LRU (baseline)", cap, {"cache.capacity": cap, **BASELINE})
        if offload:
            add("bound", "Belady, on demand (bound)", cap, {"cache.capacity": cap, **BOUND_ON_DEMAND})
        else:
            add("bound", "Belady + oracle prefetch (bound)", cap, {"cache.capacity": cap, **BOUND})
    if offload:
        add("infinite", "each GPU holds its experts (no offload)", "all", dict(EP_RESIDENT))
    else:
        add("infinite", "all experts resident (infinite cache)", "all", dict(INFINITE))
    points = make_points(p, data, list(combos.values()), traces)
    pid_of = {key: pt.pid for key, pt in zip(combos, points, strict=True)}
    for r in rows:
        r["point"] = pid_of[r.pop("key")]
    return data, points, rows


def rank(results: pd.DataFrame, rows: list[dict[str, Any]]) -> tuple[pd.DataFrame, str]:
    """The comparison table from the sweep results and the row plan: per capacity, the
    candidates ranked by the metric, then the references; and the metric's name."""
    table = joined_rows(rows, results)
    metric = "tpot_s" if table["tpot_s"].notna().all() else "ttft_s"
    if table[metric].isna().any():
        raise MoesimError("compare: the scenario has no timed decode or prefill passes to rank by "
                          "(set timing: true).")
    link_cols = [c for c in table.columns if str(c).startswith("bytes_by_link.")]
    table["bytes_moved"] = table[link_cols].sum(axis=1).astype(np.int64) if link_cols else 0
    table["metric_ms"] = table[metric] * 1e3
    inf_row = table[table["role"] == "infinite"]
    parts = []
    for cap in [c for c in dict.fromkeys(table["capacity"]) if c != "all"]:
        here = table[table["capacity"] == cap].copy()
        base = float(here.loc[here["role"] == "baseline", metric].iloc[0])
        bound = float(here.loc[here["role"] == "bound", metric].iloc[0])
        here["speedup"] = base / here[metric]
        here["gap_closed"] = (base - here[metric]) / (base - bound) if base != bound else np.nan
        cands = here[here["role"] == "candidate"].sort_values([metric, "label"], kind="stable")
        cands.insert(0, "rank", np.arange(1, len(cands) + 1))
        refs = here[here["role"] != "candidate"].assign(rank=pd.NA)
        parts += [cands, refs]
    if len(inf_row):
        parts.append(inf_row.assign(rank=pd.NA, speedup=np.nan, gap_closed=np.nan))
    out = pd.concat(parts, ignore_index=True)
    first = ["rank", *SHOWN, "point"]
    return out[first + [c for c in out.columns if c not in first]], metric


def markdown(table: pd.DataFrame, metric: str, title: str) -> str:
    """The table as GitHub Markdown (written by hand: pandas' to_markdown needs tabulate)."""
    head = ["rank", "policy", "capacity", "TPOT (ms)" if metric == "tpot_s" else "TTFT (ms, ranked)", "TTFT (ms)", "tokens/s", "hit rate",
            "collision misses", "bytes moved (GB)", "speedup", "gap closed"]

    def num(v: Any, spec: str, scale: float = 1.0, unit: str = "") -> str:
        return "" if pd.isna(v) else format(float(v) * scale, spec) + unit

    lines = [f"# {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table.to_dict("records"):
        cells = ["" if pd.isna(r["rank"]) else str(int(r["rank"])), str(r["label"]), str(r["capacity"]),
                 num(r["metric_ms"], ".3f"), num(r["ttft_s"], ".1f", 1e3), num(r["tokens_per_s"], ".1f"),
                 num(r["hit_rate"], ".3f"), num(r["collision_misses"], ".0f"), num(r["bytes_moved"], ".2f", 1e-9),
                 num(r["speedup"], ".2f", 1.0, "x"), num(r["gap_closed"], ".0f", 100.0, "%")]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Ranked by {'TPOT' if metric == 'tpot_s' else 'TTFT'}, per capacity. speedup = baseline / policy; gap closed = "
              "(baseline - policy) / (baseline - bound). The bound is Belady's MIN with oracle prefetch "
              "(on demand under expert parallelism with offload): the fewest misses where each layer's experts "
              "fit in the cache, and not the least time, so a policy may close more than 100%."]
    return "\n".join(lines) + "\n"


TERMINAL_WIDTH = 80
TIE = 0.01  # a runner-up within 1% of the best one's metric is named beside it


def terminal(table: pd.DataFrame, metric: str, title: str) -> str:
    """The table for a terminal: at most :data:`TERMINAL_WIDTH` columns (policy names cut
    with '~' when longer than fits; the whole table is in compare.md), then one line of
    recommendation per capacity (:func:`recommendation`)."""
    name = "TPOT ms" if metric == "tpot_s" else "TTFT ms"
    cols = [("#", 2, ">"), ("policy", 0, "<"), ("cap", 5, ">"), (name, 9, ">"), ("speedup", 7, ">"),
            ("gap", 5, ">"), ("hit rate", 8, ">")]
    fixed = sum(w + 1 for _, w, _ in cols if w)
    width = TERMINAL_WIDTH - fixed - 1  # the policy column takes what is left

    def cell(text: str, w: int, align: str) -> str:
        text = text if len(text) <= w else text[:w - 1] + "~"
        return format(text, f"{align}{w}")

    def num(v: Any, spec: str, scale: float = 1.0, unit: str = "") -> str:
        return "" if pd.isna(v) else format(float(v) * scale, spec) + unit

    lines = [*textwrap.wrap(title, TERMINAL_WIDTH, subsequent_indent="  "), ""]
    lines.append(" ".join(cell(h, w or width, a) for h, w, a in cols).rstrip())
    lines.append("-" * TERMINAL_WIDTH)
    for r in table.to_dict("records"):
        vals = ["" if pd.isna(r["rank"]) else str(int(r["rank"])), str(r["label"]), str(r["capacity"]),
                num(r["metric_ms"], ".3f"), num(r["speedup"], ".2f", 1.0, "x"), num(r["gap_closed"], ".0f", 100.0, "%"),
                num(r["hit_rate"], ".3f")]
        lines.append(" ".join(cell(v, w or width, a) for v, (_, w, a) in zip(vals, cols, strict=True)).rstrip())
    lines.append("")
    for line in recommendation(table, metric):
        lines += textwrap.wrap(line, TERMINAL_WIDTH, subsequent_indent="  ")
    return "\n".join(lines) + "\n"


def recommendation(table: pd.DataFrame, metric: str) -> list[str]:
    """Per capacity, one line: the best candidate, its speedup over the baseline, the share of
    the baseline-to-bound gap it closes, and the runner-up when its metric is within 1%."""
    out = []
    what = "TPOT" if metric == "tpot_s" else "TTFT"
    for cap in [c for c in dict.fromkeys(table["capacity"]) if c != "all"]:
        cands = table[(table["capacity"] == cap) & (table["role"] == "candidate")].sort_values("rank")
        if cands.empty:
            continue
        best = cands.iloc[0]
        gap = "" if pd.isna(best["gap_closed"]) else f", closes {best['gap_closed']:.0%} of the gap to the bound"
        line = f"Best at {cap}: {best['label']}, {best['speedup']:.2f}x as fast as on-demand LRU ({what}){gap}"
        if len(cands) > 1:
            second = cands.iloc[1]
            if float(second[metric]) <= float(best[metric]) * (1 + TIE):
                line += f"; {second['label']} is within 1%"
        out.append(line + ".")
    return out


def figure(table: pd.DataFrame, metric: str, title: str) -> Any:
    """Horizontal bars of the metric per policy, one panel per capacity; the baseline, the
    bound and the infinite cache drawn as vertical reference lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.transforms import ScaledTranslation

    caps = [c for c in dict.fromkeys(table["capacity"]) if c != "all"]
    n = max(len(table[(table["capacity"] == c) & (table["role"] == "candidate")]) for c in caps)
    fig, axes = plt.subplots(1, len(caps), figsize=(6 * len(caps), 2.6 + 0.35 * n), squeeze=False, sharex=True,
                             layout="constrained")  # makes room for the legends below the panels
    inf = table[table["role"] == "infinite"]
    for ax, cap in zip(axes[0], caps, strict=True):
        here = table[table["capacity"] == cap]
        cands = here[here["role"] == "candidate"].iloc[::-1]
        ax.barh(cands["label"], cands["metric_ms"], color="tab:blue")
        styles = {"baseline": ("tab:red", "-"), "bound": ("black", "--")}
        for role, (color, ls) in styles.items():
            v = float(here.loc[here["role"] == role, "metric_ms"].iloc[0])
            ax.axvline(v, color=color, linestyle=ls, label=f"{role}: {v:.2f} ms")
        if len(inf):
            v = float(inf["metric_ms"].iloc[0])
            ax.axvline(v, color="tab:green", linestyle=":", label=f"infinite cache: {v:.2f} ms")
        ax.set_xlabel("TPOT (ms per output token, lower is better)" if metric == "tpot_s"
                      else "TTFT (ms, lower is better)")
        ax.set_title(f"cache capacity {cap}", fontsize=9)
        below = ax.transAxes + ScaledTranslation(0, -0.5, fig.dpi_scale_trans)  # under the axis label
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, 0), bbox_transform=below, ncol=2)
    fig.suptitle(textwrap.fill(title, 70 * len(caps)), fontsize=9)  # about 70 characters to 6 inches
    return fig


def compare(scenario_path: str, out_dir: str | Path, eviction: Sequence[str] | None = None,
            prefetch: Sequence[str] | None = None, miss: Sequence[str] | None = None,
            budget: Sequence[str] | None = None, capacity: Sequence[str] | None = None,
            overrides: tuple[str, ...] = (), workers: int = 1, executor: str = "local",
            ray_address: str | None = None,
            progress: Callable[[int, int, int], None] | None = None,
            rates: Sequence[float] | None = None, verify: bool = False,
            prune: bool = False, seeds: int | None = None) -> tuple[pd.DataFrame, str]:
    """Run the comparison; write ``compare.parquet``, ``compare.md`` and ``compare.png`` in
    ``out_dir`` (each atomically; the runs in ``out_dir/points``, resumable). Returns the
    table and the ranking metric. A scenario with ``workload.arrivals`` is compared under
    load, at ``rates`` (:mod:`studies.load`). The table's ``attrs``: ``runs`` (reused and run,
    every bisection probe counted: :class:`studies.sweep.Runs`) and ``others``, the folder's
    points that belong to none of this comparison's (removed when ``prune``); ``verify``
    checks every finished point's files by digest; ``seeds`` is the arrival draws each rate
    runs under load (default :data:`studies.load.SEEDS`)."""
    from moesim.files import save_figure_atomic, write_atomic, write_text_atomic

    with workers_started(executor):  # the kernel loads (or compiles) while the points are planned
        p, raw, _ = base_data(scenario_path, overrides)
        if (raw.get("workload") or {}).get("arrivals") is not None:  # serving under load: studies.load
            return _compare_load(scenario_path, p, raw, Path(out_dir), eviction, prefetch, miss, budget, capacity,
                                 rates, workers, executor, ray_address, progress, verify, prune, seeds)
        if seeds is not None:
            raise MoesimError(f"{p}: --seeds runs several arrival draws at each rate, which needs requests arriving "
                              "over time: add workload.arrivals to the scenario, or leave out --seeds.")
        if rates:
            raise MoesimError(f"{p}: --rate compares policies at request rates, which needs requests arriving over time: "
                              "add workload.arrivals to the scenario (e.g. --set workload.arrivals.process=poisson "
                              "--set workload.arrivals.requests=500), or leave out --rate.")
        data, points, rows = plan_compare(scenario_path, eviction, prefetch, miss, budget, capacity, overrides)
        out = Path(out_dir)
        with folder_lock(out):
            runs = run_points(data, points, out, workers, executor, ray_address, progress, verify)
            others = other_points(out, points, prune)
            results = collect(out, points)
            table, metric = rank(results, rows)
            title = describe(scenario_path, data)
            write_atomic(out / "compare.parquet", lambda tmp: table.to_parquet(tmp, index=False))
            write_text_atomic(out / "compare.md", markdown(table, metric, title))
            save_figure_atomic(figure(table, metric, title), out / "compare.png")
        table.attrs.update(runs=runs, reused=runs.reused, others=others, pruned=prune, points=len(points),
                           metric=metric, title=title)
    return table, metric


def describe(scenario_path: str, data: dict[str, Any]) -> str:
    """What is held fixed: the scenario, the model and trace, the hardware and its host link's
    speed, the batch, the execution mode and the seed."""
    from moesim.config.confload import to_plain
    from moesim.config.scenario import describe_trace, scenario_from_dict

    plain = {k: v for k, v in data.items() if not str(k).startswith("__")}  # make_points' worker keys
    sc = scenario_from_dict(plain, where=scenario_path, base_dir=str(data.get("__base_dir__", ".")))
    trace = describe_trace(to_plain(sc.workload.trace))
    hw = sc.hardware
    link = f"{hw.host_link} {hw.h2d.bandwidth_gbps:g} GB/s"
    mode = f"per-expert ({sc.expert_fetch} fetch)" if sc.expert_compute == "per-expert" else str(sc.expert_compute)
    host = f" with the {sc.execution.style} host" if sc.execution.style != "none" else ""
    preset = (data.get("hardware") or {}).get("preset", "custom hardware")
    arr = sc.workload.arrivals
    if arr is not None:  # serving: the arrivals and the scheduler are what is held fixed
        from moesim.config.scenario import SchedulerConfig

        sch = sc.scheduler or SchedulerConfig()
        what = (f"{arr.process} arrivals" + (f" (cv {arr.cv:g})" if arr.process == "gamma" else "")
                + (f", {arr.requests} requests" if arr.requests else "")
                + (f", {arr.prompt_tokens}+{arr.output_tokens} tokens" if arr.prompt_tokens is not None
                   and arr.output_tokens is not None else ""))
        batch = (f"{what}; {sch.policy}, max {sch.max_running} running, {sch.max_batched_tokens} tokens a pass, "
                 f"KV {sch.kv_memory}")
    else:
        batch = f"batch {sc.workload.batch_size}"
    return (f"moesim compare {scenario_path}: {trace}; {preset}, {link}; {batch}, "
            f"{mode} execution{host}, seed {sc.seed}")


def _compare_load(scenario_path: str, p: Path, data: dict[str, Any], out: Path, eviction: Sequence[str] | None,
                  prefetch: Sequence[str] | None, miss: Sequence[str] | None, budget: Sequence[str] | None,
                  capacity: Sequence[str] | None, rates: Sequence[float] | None, workers: int, executor: str,
                  ray_address: str | None, progress: Callable[[int, int, int], None] | None, verify: bool = False,
                  prune: bool = False, seeds: int | None = None) -> tuple[pd.DataFrame, str]:
    """``compare`` for a scenario with arrivals (:func:`studies.load.compare_load`)."""
    from moesim.config.scenario import scenario_from_dict
    from moesim.simulator.stream import why_not_served
    from moesim.studies.load import SEEDS, compare_load

    for opt, given in (("--miss", miss), ("--budget", budget)):
        for name in given or ():
            trial = copy.deepcopy({k: v for k, v in data.items() if not str(k).startswith("__")})
            trial.setdefault("policies", {})[opt[2:]] = name
            reason = why_not_served(scenario_from_dict(trial, where=str(p), base_dir=str(p.parent)))
            if reason is not None:
                raise MoesimError(f"{p}: {opt} {name}: serving under load replays one forward pass at a time, "
                                  f"which {reason}. Leave it out of {opt}.")
    caps = list(capacity) if capacity else [str((data.get("cache") or {}).get("capacity", "5%"))]
    traces: dict[str, Any] = {}
    has_pred_next = _check_trace(data, str(p.parent), caps, str(p), traces)
    title = describe(scenario_path, {**data, "__base_dir__": str(p.parent)})
    with folder_lock(out):
        return compare_load(scenario_path, p, data, out, eviction, prefetch, capacity, rates, has_pred_next, traces,
                            workers, executor, ray_address, progress, title, verify, prune,
                            SEEDS if seeds is None else seeds, miss, budget)

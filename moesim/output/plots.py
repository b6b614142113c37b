"""``moesim plot``: figures from sweep results (matplotlib, written atomically).

Kinds: ``heatmap`` (a metric over two axes), ``lines`` (a metric against one axis, one line
per value of ``--by``; a ``belady`` line is drawn dashed as the bound), ``bars`` (a metric per
value of ``--x``, grouped by ``--by``). Axis values are taken from the results' columns, in
the order the sweep listed them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pandas as pd

from moesim.errors import MoesimError, did_you_mean
from moesim.files import save_figure_atomic

KINDS = ("heatmap", "lines", "bars")  # plus "timeline", from a run's events (plot_timeline)


SCENARIO_SECTIONS = ("hardware", "cache", "policies", "workload", "sweep")
SCENARIO_KEYS = ("seed", "timing", "expert_compute", "expert_fetch", "name")
# metric -> (label with unit, scale applied to the values)
METRIC_LABELS: dict[str, tuple[str, float]] = {
    "tpot_s": ("TPOT (ms per output token)", 1e3), "ttft_s": ("TTFT (ms)", 1e3),
    "stall_s": ("time waiting for experts (s)", 1.0), "total_time_s": ("simulated time (s)", 1.0),
    "tokens_per_s": ("throughput (tokens/s)", 1.0), "hit_rate": ("hit rate (hits / expert accesses)", 1.0),
    "misses": ("misses (expert accesses)", 1.0), "collision_misses": ("collision misses", 1.0),
    "cache_peak_bytes": ("cache peak (GB)", 1e-9),
    # serving under load (docs/guides/serving.md)
    "ttft_mean_s": ("mean TTFT (ms)", 1e3), "ttft_p50_s": ("p50 TTFT (ms)", 1e3), "ttft_p99_s": ("p99 TTFT (ms)", 1e3),
    "tpot_mean_s": ("mean TPOT (ms per output token)", 1e3), "tpot_p50_s": ("p50 TPOT (ms per output token)", 1e3),
    "tpot_p99_s": ("p99 TPOT (ms per output token)", 1e3), "e2e_p99_s": ("p99 end-to-end latency (s)", 1.0),
    "itl_p50_s": ("p50 inter-token gap (ms)", 1e3), "itl_p99_s": ("p99 inter-token gap (ms)", 1e3),
    "queue_mean_s": ("mean queueing delay (s)", 1.0), "requests_per_s": ("served (requests/s)", 1.0),
    "throughput_tokens_s": ("throughput (output tokens/s)", 1.0),
    "goodput_requests_s": ("goodput (requests/s within the SLO)", 1.0),
    "slo_attainment": ("SLO attainment (share of requests)", 1.0),
}
AXIS_LABELS = {"cache.capacity": "cache capacity", "policies.eviction": "eviction policy",
               "policies.prefetch": "prefetch policy", "policies.miss": "miss policy",
               "policies.budget": "budget policy", "policies.routing": "routing policy",
               "workload.batch_size": "batch size (requests per pass)", "expert_compute": "expert compute",
               "expert_fetch": "per-expert fetch", "hardware.gpus": "GPUs",
               "workload.arrivals.rate": "offered load (requests/s)", "scheduler.max_running": "max running requests",
               "scheduler.policy": "scheduler"}
LINK_NAMES = {"pcie": "PCIe", "nvlink": "NVLink"}
_NUM = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*(%|experts?|[kmgt]i?b|b)?\s*$", re.IGNORECASE)


def load_results(path: str) -> pd.DataFrame:
    """results.parquet of a sweep (the file, or its folder); its axes (from the sweep's
    sweep.yaml) are in ``df.attrs["axes"]`` when known."""
    p = Path(path)
    if p.is_dir():
        p = p / "results.parquet"
    if not p.is_file():
        raise MoesimError(f"plot: {path} is neither a sweep folder nor a results.parquet file; run "
                          "`moesim sweep SCENARIO --out DIR` first.")
    df = pd.read_parquet(p)
    if "status" in df:
        df = df[df["status"] == "ok"]
    if df.empty:
        raise MoesimError(f"plot: {p} has no finished points.")
    meta = p.parent / "sweep.yaml"
    if meta.is_file():
        import yaml

        info = yaml.safe_load(meta.read_text()) or {}
        df.attrs["axes"] = [str(a) for a in info.get("axes") or []]
        df.attrs["scenario"] = str(info.get("scenario", ""))
        df.attrs["setting"] = _setting(p.parent / "points" / str(df["point"].iloc[0]) / "scenario.resolved.yaml",
                                       df, df.attrs["axes"]) if "point" in df else ""
    return df


def _setting(resolved: Path, df: pd.DataFrame, axes: list[str]) -> str:
    """What a figure's title says of the setting it holds: the model, the trace,
    the GPU and its host link's bandwidth — each unless it is a swept axis, which the figure
    shows or --where fixes."""
    import yaml

    try:
        sc = yaml.safe_load(resolved.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return ""
    from moesim.config.scenario import describe_trace

    parts = []
    src = ((sc.get("workload") or {}).get("trace") or {})
    if "model" in df and df["model"].nunique() == 1 and not src.get("synth"):  # a synthetic trace names it
        parts.append(str(df["model"].iloc[0]))
    if not any(a.startswith("workload.trace") for a in axes):
        parts.append(describe_trace(src))
    hw = sc.get("hardware") or {}
    link = (hw.get("links") or {}).get(hw.get("host_link", "pcie")) or {}
    if not any(a.startswith("hardware.gpu") or a == "hardware.preset" for a in axes):
        parts.append(str((hw.get("gpu") or {}).get("name", "")))
    if not any(a.startswith("hardware.links") or a == "hardware.preset" for a in axes) and link:
        parts.append(f"{hw.get('host_link')} {float(link.get('bandwidth_gbps', 0)):g} GB/s")
    return ", ".join(p for p in parts if p)


def _column(df: pd.DataFrame, name: str | None, what: str) -> str:
    if name is None:
        raise MoesimError(f"plot: this kind needs {what}.")
    if name not in df.columns:
        raise MoesimError(f"plot: column '{name}'{did_you_mean(name, list(df.columns))} is not in the results; "
                          f"columns: {', '.join(map(str, df.columns))}.")
    return name


def _sort_key(v: Any) -> tuple[int, float, str]:
    s = str(v)
    m = re.match(r"^\s*([0-9.]+)", s)
    return (0, float(m.group(1)), s) if m else (1, 0.0, s)


def _ordered(values: Any) -> list[Any]:
    return sorted(pd.unique(values), key=_sort_key)


def _axes_of(df: pd.DataFrame) -> list[str]:
    """The sweep's axes: from sweep.yaml when loaded with the results, else the columns named
    like scenario keys (``cache.capacity``, ``policies.eviction``, ``seed``, ...)."""
    if df.attrs.get("axes"):
        return [a for a in df.attrs["axes"] if a in df.columns]
    return [str(c) for c in df.columns
            if str(c).split(".", 1)[0] in SCENARIO_SECTIONS or str(c) in SCENARIO_KEYS]


def _apply_where(df: pd.DataFrame, where: tuple[str, ...] | list[str]) -> tuple[pd.DataFrame, dict[str, str]]:
    fixed: dict[str, str] = {}
    for item in where:
        if "=" not in item:
            raise MoesimError(f"plot: --where '{item}' must look like key=value (e.g. policies.eviction=lru).")
        key, value = item.split("=", 1)
        _column(df, key, "--where")
        keep = df[key].astype(str) == value
        if not keep.any():
            raise MoesimError(f"plot: --where {item} matches no results; values of {key}: "
                              f"{', '.join(str(v) for v in _ordered(df[key]))}.")
        df = df[keep]
        fixed[key] = value
    return df, fixed


def _check_hidden(df: pd.DataFrame, shown: set[str]) -> None:
    """Refuse to average silently over an axis the figure neither shows nor filters."""
    hidden = [a for a in _axes_of(df) if a not in shown and df[a].astype(str).nunique() > 1]
    if hidden:
        parts = [f"'{a}' ({', '.join(str(v) for v in _ordered(df[a]))})" for a in hidden]
        first = hidden[0]
        raise MoesimError(
            f"plot: the results vary along {', '.join(parts)}, which this figure neither shows nor filters, "
            f"so each mark would average over it; show it (--by {first} or --facet {first}) or pick one value "
            f"(--where {first}={_ordered(df[first])[0]}).")


def _numeric(values: list[Any]) -> tuple[list[float], str] | None:
    """Axis values as numbers with one shared unit ('%', 'experts', 'GB', ...), or None."""
    nums, units = [], set()
    for v in values:
        m = _NUM.match(str(v))
        if m is None:
            return None
        nums.append(float(m.group(1)))
        unit = (m.group(2) or "").lower()
        units.add("expert" if unit.startswith("expert") else unit.upper())
    return (nums, units.pop()) if len(units) == 1 else None


def axis_label(key: str, unit: str = "") -> str:
    """A readable label with its unit for an axis column."""
    m = re.fullmatch(r"hardware\.links\.([a-z0-9_]+)\.bandwidth_gbps", key)
    if m:
        return f"{LINK_NAMES.get(m.group(1), m.group(1))} bandwidth (GB/s)"
    base = AXIS_LABELS.get(key, key)
    if key == "cache.capacity":
        return base + {"%": " (% of all expert bytes)", "expert": " (experts)"}.get(unit, f" ({unit})" if unit else "")
    return base


def metric_label(metric: str) -> tuple[str, float]:
    """(label with unit, scale) of a results column."""
    if metric in METRIC_LABELS:
        return METRIC_LABELS[metric]
    if metric.startswith("bytes_by_link."):
        return f"bytes moved over {metric.split('.', 1)[1]} (GB)", 1e-9
    if metric.startswith("link_utilisation."):
        return f"{metric.split('.', 1)[1]} busy share", 1.0
    return (f"{metric} (s)" if metric.endswith("_s") else metric), 1.0


def _short(key: str) -> str:
    return key.split(".")[-1] if key.startswith("policies.") else key


def _fixed_text(df: pd.DataFrame, shown: set[str], fixed: dict[str, str]) -> str:
    held = dict(fixed)
    for a in _axes_of(df):
        if a not in shown and a not in held:
            held[a] = str(df[a].iloc[0])
    return ", ".join(f"{_short(k)}={v}" for k, v in held.items())


def plot(path: str, kind: str, out: str, metric: str, x: str | None = None, y: str | None = None,
         by: str | None = None, title: str | None = None, where: tuple[str, ...] = (),
         facet: str | None = None) -> Path:
    """Draw ``kind`` from the results at ``path`` into ``out`` (.png, .svg or .pdf)."""

    target = Path(out)
    if target.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise MoesimError(f"plot: --out {out} must end in .png, .svg or .pdf.")
    fig = figure(load_results(path), kind, metric, x, y, by, title, where, facet)
    return save_figure_atomic(fig, target)


def figure(df: pd.DataFrame, kind: str, metric: str, x: str | None = None, y: str | None = None,
           by: str | None = None, title: str | None = None, where: tuple[str, ...] | list[str] = (),
           facet: str | None = None) -> Any:
    """The matplotlib Figure for ``kind`` (see :func:`plot`): one panel per value of
    ``facet``; refuses (exit 2) when the results vary along an axis it neither shows nor
    filters with ``where``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if kind not in KINDS:
        raise MoesimError(f"plot: unknown kind '{kind}'{did_you_mean(kind, list(KINDS))}; valid: {', '.join(KINDS)}.")
    metric = _column(df, metric, "--metric")
    x = _column(df, x, "--x (an axis)")
    if kind == "heatmap":
        y = _column(df, y, "--y (a second axis)")
    for name, what in ((by, "--by"), (facet, "--facet")):
        if name is not None:
            _column(df, name, what)
    df, fixed = _apply_where(df, where)
    shown = {c for c in (x, y if kind == "heatmap" else None, by, facet) if c} | set(fixed)
    _check_hidden(df, shown)
    mlabel, scale = metric_label(metric)
    panels = _ordered(df[facet]) if facet else [None]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels) if len(panels) > 1 else 7, 4.6),
                             squeeze=False, sharey=kind != "heatmap")
    for ax, pv in zip(axes[0], panels, strict=True):
        sub = df if pv is None else df[df[facet].astype(str) == str(pv)]
        if kind == "heatmap":
            assert y is not None
            _heatmap(fig, ax, sub, metric, x, y, scale, mlabel)
        else:
            _series(ax, sub, kind, metric, x, by, scale)
            ax.set_ylabel(mlabel)
        if pv is not None:
            ax.set_title(f"{axis_label(str(facet)).split(' (')[0]} = {pv}", fontsize=9)
    held = _fixed_text(df, shown, fixed)
    scen = df.attrs.get("scenario")
    head = title or f"{mlabel} by {axis_label(x).split(' (')[0]}" + (f" ({scen})" if scen else "")
    setting = df.attrs.get("setting")
    fig.suptitle(head + (f"\n{setting}" if setting else "") + (f"\nheld fixed: {held}" if held else ""), fontsize=9)
    fig.tight_layout()
    return fig


def _heatmap(fig: Any, ax: Any, df: pd.DataFrame, metric: str, x: str, y: str, scale: float, mlabel: str) -> None:
    import numpy as np

    table = df.pivot_table(index=y, columns=x, values=metric, aggfunc="mean") * scale
    table = table.reindex(index=_ordered(df[y]), columns=_ordered(df[x]))
    data = table.to_numpy(dtype=float)
    im = ax.imshow(data, aspect="auto", origin="lower", cmap="viridis")
    ax.set_xticks(range(len(table.columns)), [str(c) for c in table.columns])
    ax.set_yticks(range(len(table.index)), [str(i) for i in table.index])
    for i in range(table.shape[0]):
        for j in range(table.shape[1]):
            v = data[i, j]
            if np.isfinite(v):
                r, g, b, _ = im.cmap(im.norm(v))
                dark = 0.299 * r + 0.587 * g + 0.114 * b < 0.5  # text contrasting with the cell
                ax.text(j, i, f"{v:.3g}", ha="center", va="center", color="white" if dark else "black", fontsize=8)
    fig.colorbar(im, ax=ax, label=mlabel)
    xn, yn = _numeric(list(table.columns)), _numeric(list(table.index))
    ax.set_xlabel(axis_label(x, xn[1] if xn else ""))
    ax.set_ylabel(axis_label(y, yn[1] if yn else ""))


def _series(ax: Any, df: pd.DataFrame, kind: str, metric: str, x: str, by: str | None, scale: float) -> None:
    """Lines (numeric x on a numeric axis, log for capacity or bandwidth spanning 8x or more)
    or grouped bars; a Belady group is drawn dashed and black, labelled as the bound."""
    xs = _ordered(df[x])
    groups = _ordered(df[by]) if by else [None]
    num = _numeric(xs) if kind == "lines" else None
    width = 0.8 / max(len(groups), 1)
    for gi, g in enumerate(groups):
        sub = df if g is None else df[df[by].astype(str) == str(g)]
        series = sub.groupby(x)[metric].mean().reindex(xs) * scale
        bound = str(g) == "belady"
        label = f"{g} (bound)" if bound else (str(g) if g is not None else None)
        if kind == "lines":
            pos: Any = num[0] if num else [str(v) for v in xs]
            ax.plot(pos, series.to_numpy(dtype=float), "--" if bound else "-", marker="o",
                    color="black" if bound else None, label=label)
        else:
            centres = [i + (gi - (len(groups) - 1) / 2) * width for i in range(len(xs))]
            ax.bar(centres, series.to_numpy(dtype=float), width=width, label=label,
                   color="black" if bound else None)
            ax.set_xticks(range(len(xs)), [str(v) for v in xs])
    if num:
        vals = [v for v in num[0] if v > 0]
        if vals and ("capacity" in x or "bandwidth" in x) and max(vals) / min(vals) >= 8:
            ax.set_xscale("log")
        ax.set_xticks(num[0], [str(v) for v in xs])
        ax.minorticks_off()
    ax.set_xlabel(axis_label(x, num[1] if num else ""))
    if by:
        ax.legend(title=AXIS_LABELS.get(by, by), fontsize=8)
    ax.grid(True, alpha=0.3)


def _decimate(spans: list[tuple[float, float]], min_gap: float) -> list[tuple[float, float]]:
    """Merge spans (start, duration) closer than ``min_gap``: at the figure's resolution they
    are one bar, and drawing them one by one costs minutes on a long run."""
    out: list[tuple[float, float]] = []
    for start, dur in sorted(spans):
        if out and start - (out[-1][0] + out[-1][1]) < min_gap:
            s0, d0 = out[-1]
            out[-1] = (s0, max(d0, start + dur - s0))
        else:
            out.append((start, dur))
    return out


def _one_pass(spans: list[dict[str, Any]]) -> tuple[tuple[float, float] | None, tuple[int, str] | None]:
    """The window (ms) of the first decode pass on the compute stream (the first pass when
    none is a decode pass, as in a prefill-only run), and (its number, its phase)."""
    by_pass: dict[int, list[dict[str, Any]]] = {}
    phase: dict[int, str] = {}
    for e in spans:
        args = e.get("args") or {}
        if e.get("tid") == 0 and "pass" in args:
            by_pass.setdefault(int(args["pass"]), []).append(e)
            phase[int(args["pass"])] = str(args.get("phase", ""))
    if not by_pass:
        return None, None
    decode = sorted(p for p, ph in phase.items() if ph == "decode")
    p = decode[0] if decode else min(by_pass)
    es = by_pass[p]
    return (min(e["ts"] for e in es) / 1e3, max(e["ts"] + e["dur"] for e in es) / 1e3), (p, phase[p])


def plot_timeline(events_path: str, out: str, window_ms: tuple[float, float] | None = None,
                  title: str | None = None) -> Path:
    """A Gantt chart of a run's events JSON: one row per thread (each GPU's compute stream, the
    copy engine), one colour per kind of span, withdrawn prefetches as ticks. Without a
    window it shows one forward pass — the first decode pass — with each layer's start
    marked. Spans closer than 1/2000 of the window are merged (decimation); the title states
    the window."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = Path(events_path)
    try:
        doc = json.loads(p.read_text())
        all_events = doc["traceEvents"]
        spans = [e for e in all_events if e.get("ph") == "X"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise MoesimError(f"plot: {events_path} is not an events file from `moesim run --events` ({exc}).") from None
    threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in all_events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    gpus = {e["pid"]: e["args"]["name"] for e in all_events if e.get("ph") == "M" and e.get("name") == "process_name"}
    shown_pass = None
    if window_ms is None:  # one pass: the first decode pass (else the first pass), with its layers marked
        window_ms, shown_pass = _one_pass(spans)
    if window_ms is not None:
        lo, hi = window_ms[0] * 1e3, window_ms[1] * 1e3
        spans = [e for e in spans if e["ts"] + e["dur"] >= lo and e["ts"] <= hi]
    if not spans:
        raise MoesimError(f"plot: {events_path} has no events{' in that window' if window_ms else ''}.")
    t_lo = min(e["ts"] for e in spans) / 1e3
    t_hi = max(e["ts"] + e["dur"] for e in spans) / 1e3
    min_gap = (t_hi - t_lo) / 2000
    rows = sorted({(e["pid"], e["tid"]) for e in spans}, key=lambda r: (r[0], -r[1]))
    colours = {"attention+gate": "#9e9e9e", "wait for experts": "#d62728", "experts": "#1f77b4",
               "demand fetch": "#ff7f0e", "prefetch": "#2ca02c", "promoted prefetch": "#8c564b",
               "all-to-all dispatch": "#9467bd", "all-to-all combine": "#e377c2", "wait for slowest GPU": "#d62728"}
    grouped: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for e in spans:
        kind = e["name"].split(" ", 1)[1] if e["name"].startswith("L") and " " in e["name"] else e["name"]
        row = rows.index((e["pid"], e["tid"]))
        grouped.setdefault((row, kind), []).append((e["ts"] / 1e3, e["dur"] / 1e3))
    fig, ax = plt.subplots(figsize=(11, 2.0 + 0.7 * len(rows)), layout="constrained")
    seen: set[str] = set()
    for (row, kind), bars in sorted(grouped.items()):
        ax.broken_barh(_decimate(bars, min_gap), (row - 0.4, 0.8), color=colours.get(kind, "k"),
                       label=kind if kind not in seen else None)
        seen.add(kind)
    withdrawn = [e["ts"] / 1e3 for e in all_events if e.get("ph") == "i" and e.get("name") == "withdrawn prefetch"
                 and t_lo <= e["ts"] / 1e3 <= t_hi]
    if withdrawn:
        row = rows.index((0, 1)) if (0, 1) in rows else 0
        ax.plot(withdrawn, [row + 0.45] * len(withdrawn), "v", color="black", markersize=4, label="withdrawn prefetch")
    labels = [f"{gpus.get(pid, f'GPU {pid}')} {threads.get((pid, tid), str(tid))}" if len(gpus) > 1
              else threads.get((pid, tid), str(tid)) for pid, tid in rows]
    ax.set_yticks(range(len(rows)), labels)
    ax.set_xlabel("simulated time (ms)")
    if shown_pass is not None:  # layer marks: where each layer's attention+gate starts
        starts = sorted({(e["ts"] / 1e3, e["args"]["layer"]) for e in spans
                         if e.get("tid") == 0 and e["args"].get("pass") == shown_pass[0]
                         and e["name"].endswith("attention+gate")})
        for t, layer in starts:
            ax.axvline(t, color="0.75", linewidth=0.6, zorder=0)
            if len(starts) <= 64:
                ax.text(t, len(rows) - 0.5, f"L{layer}", fontsize=6, color="0.35", va="bottom")
    from matplotlib.transforms import ScaledTranslation

    below = ax.transAxes + ScaledTranslation(0, -0.5, fig.dpi_scale_trans)  # under the axis label
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, 0), bbox_transform=below, fontsize=7, ncol=5)
    recorded = (doc.get("otherData") or {}).get("recorded_passes")
    what = f"{t_lo:.2f}-{t_hi:.2f} ms" + (f", the first {recorded} passes" if recorded else "")
    if shown_pass is not None:
        what = (f"pass {shown_pass[0]} ({shown_pass[1]}), {t_lo:.2f}-{t_hi:.2f} ms, layers marked; "
                "--window START:END for another span")
    ax.set_title(f"{title or 'timeline'} ({what})", fontsize=9, pad=14 if shown_pass is not None else 6)
    return save_figure_atomic(fig, out)

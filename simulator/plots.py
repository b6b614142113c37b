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

from simulator.atomic import save_figure_atomic
from simulator.errors import MoesimError, did_you_mean

KINDS = ("heatmap", "lines", "bars")  # plus "timeline", from a run's events (plot_timeline)


def load_results(path: str) -> pd.DataFrame:
    """results.parquet of a sweep (the file, or its folder)."""
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
    return df


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


def plot(path: str, kind: str, out: str, metric: str, x: str | None = None, y: str | None = None,
         by: str | None = None, title: str | None = None) -> Path:
    """Draw ``kind`` from the results at ``path`` into ``out`` (.png, .svg or .pdf)."""

    target = Path(out)
    if target.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise MoesimError(f"plot: --out {out} must end in .png, .svg or .pdf.")
    fig = figure(load_results(path), kind, metric, x, y, by, title)
    return save_figure_atomic(fig, target)


def figure(df: pd.DataFrame, kind: str, metric: str, x: str | None = None, y: str | None = None,
           by: str | None = None, title: str | None = None) -> Any:
    """The matplotlib Figure for ``kind`` (see :func:`plot`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if kind not in KINDS:
        raise MoesimError(f"plot: unknown kind '{kind}'{did_you_mean(kind, list(KINDS))}; valid: {', '.join(KINDS)}.")
    metric = _column(df, metric, "--metric")
    x = _column(df, x, "--x (an axis)")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if kind == "heatmap":
        y = _column(df, y, "--y (a second axis)")
        table = df.pivot_table(index=y, columns=x, values=metric, aggfunc="mean")
        table = table.reindex(index=_ordered(df[y]), columns=_ordered(df[x]))
        im = ax.imshow(table.to_numpy(dtype=float), aspect="auto", origin="lower", cmap="viridis")
        ax.set_xticks(range(len(table.columns)), [str(c) for c in table.columns])
        ax.set_yticks(range(len(table.index)), [str(i) for i in table.index])
        for i in range(table.shape[0]):
            for j in range(table.shape[1]):
                v = table.iat[i, j]
                if pd.notna(v):
                    ax.text(j, i, f"{v:.3g}", ha="center", va="center", color="white", fontsize=8)
        fig.colorbar(im, ax=ax, label=metric)
        ax.set_ylabel(y)
    else:
        groups = _ordered(df[by]) if by else [None]
        if by:
            _column(df, by, "--by")
        xs = _ordered(df[x])
        width = 0.8 / max(len(groups), 1)
        for gi, g in enumerate(groups):
            sub = df if g is None else df[df[by] == g]
            series = sub.groupby(x)[metric].mean().reindex(xs)
            label = str(g) if g is not None else metric
            if kind == "lines":
                style = "--" if str(g) == "belady" else "-"
                ax.plot([str(v) for v in xs], series.to_numpy(dtype=float), style, marker="o", label=label)
            else:
                pos = [i + (gi - (len(groups) - 1) / 2) * width for i in range(len(xs))]
                ax.bar(pos, series.to_numpy(dtype=float), width=width, label=label)
                ax.set_xticks(range(len(xs)), [str(v) for v in xs])
        if by:
            ax.legend(title=by, fontsize=8)
        ax.set_ylabel(metric)
    ax.set_xlabel(x)
    ax.set_title(title or f"{metric} ({kind})")
    fig.tight_layout()
    return fig


def plot_timeline(events_path: str, out: str, window_ms: tuple[float, float] | None = None,
                  title: str | None = None) -> Path:
    """A Gantt chart of a run's compute stream and copy engine from its events JSON."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = Path(events_path)
    try:
        doc = json.loads(p.read_text())
        spans = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise MoesimError(f"plot: {events_path} is not an events file from `moesim run --events` ({exc}).") from None
    if window_ms is not None:
        lo, hi = window_ms[0] * 1e3, window_ms[1] * 1e3
        spans = [e for e in spans if e["ts"] + e["dur"] >= lo and e["ts"] <= hi]
    if not spans:
        raise MoesimError(f"plot: {events_path} has no events{' in that window' if window_ms else ''}.")
    colours = {"attention+gate": "#9e9e9e", "wait for experts": "#d62728", "experts": "#1f77b4",
               "demand fetch": "#ff7f0e", "prefetch": "#2ca02c"}
    fig, ax = plt.subplots(figsize=(10, 3))
    seen = set()
    for e in spans:
        kind = e["name"].split(" ", 1)[1] if e["name"].startswith("L") else e["name"]
        row = 1 - e["tid"]  # compute on top
        label = kind if kind not in seen else None
        seen.add(kind)
        ax.broken_barh([(e["ts"] / 1e3, e["dur"] / 1e3)], (row - 0.4, 0.8), color=colours.get(kind, "k"), label=label)
    ax.set_yticks([0, 1], ["copy engine", "compute"])
    ax.set_xlabel("simulated time (ms)")
    ax.legend(loc="upper right", fontsize=7, ncol=5)
    ax.set_title(title or "timeline")
    fig.tight_layout()
    return save_figure_atomic(fig, out)

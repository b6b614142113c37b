"""One validation report from several ``moesim calibrate validate`` runs (a model and an
execution mode each): ``validation.parquet`` (a row per scenario, with model and execution),
``passes.parquet`` (a row per forward pass), ``predicted_vs_measured.png`` (a panel per model and
execution, log axes) and ``report.md`` (the error per model and execution, then every scenario,
largest error first; the text of ``--notes`` goes between them).

    python tools/validation_summary.py --device "NVIDIA H100 80GB HBM3" --profile profiles/h100.yaml \\
        --notes notes.md --out validation/h100 RUN_DIR [RUN_DIR ...]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd


def _load(dirs: list[str]) -> tuple[pd.DataFrame, pd.DataFrame]:
    rows, passes = [], []
    for d in dirs:
        v = pd.read_parquet(Path(d) / "validation.parquet")
        p = pd.read_parquet(Path(d) / "passes.parquet")
        keys = v[["scenario", "model", "expert_compute"]]
        rows.append(v)
        passes.append(p.merge(keys, on="scenario"))
    return pd.concat(rows, ignore_index=True), pd.concat(passes, ignore_index=True)


def _plot(df: pd.DataFrame, out: Path, device: str) -> None:
    groups = list(df.groupby(["model", "expert_compute"], sort=True))
    cols = 2 if len(groups) > 1 else 1
    rows = -(-len(groups) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 4.8 * rows), squeeze=False)
    for ax in axes.flat[len(groups):]:
        ax.set_visible(False)
    for ax, ((model, mode), g) in zip(axes.flat, groups, strict=False):
        for k, marker in (("tpot", "o"), ("ttft", "s")):
            ax.scatter(g[f"{k}_measured_s"] * 1e3, g[f"{k}_predicted_s"] * 1e3, marker=marker, s=22, label=k.upper())
        vals = g[[c for c in g.columns if c.endswith(("_measured_s", "_predicted_s"))]].to_numpy() * 1e3
        lo, hi = float(np.nanmin(vals)) / 1.3, float(np.nanmax(vals)) * 1.3
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="exact")
        ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="0.88", zorder=0, label="±10%")
        ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="measured (ms per pass)",
               ylabel="predicted (ms per pass)", title=f"{model}, {mode} execution")
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(f"moesim vs the reference executor on {device}\n16 scenarios per panel (capacity 1/5/25/100%, "
                 "prefetch none/previous-token, LRU/least-stale); batch 1, bf16, 64-token prompt", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "predicted_vs_measured.png", dpi=100)
    plt.close(fig)


def _report(df: pd.DataFrame, out: Path, device: str, profile: str, notes: str) -> None:
    lines = [f"# Validation on {device} with profile `{profile}`", "",
             "| model | execution | scenarios | TPOT APE median | TPOT APE p95 | TTFT APE median | TTFT APE p95 | "
             "hits and misses identical |", "|---|---|---|---|---|---|---|---|"]
    for (model, mode), g in df.groupby(["model", "expert_compute"], sort=True):
        same = bool(((g.hits_sim == g.hits_exec) & (g.misses_sim == g.misses_exec)).all())
        lines.append(f"| {model} | {mode} | {len(g)} | {g.tpot_ape.median():.1%} | {g.tpot_ape.quantile(0.95):.1%} | "
                     f"{g.ttft_ape.median():.1%} | {g.ttft_ape.quantile(0.95):.1%} | {same} |")
    lines += ["", notes.strip(), "", "## Every scenario, largest TPOT error first", "",
              "| model | execution | scenario | TPOT measured ms | predicted ms | APE | TTFT measured ms | predicted ms | APE |",
              "|---|---|---|---|---|---|---|---|---|"]
    for _, r in df.sort_values("tpot_ape", ascending=False).iterrows():
        lines.append(f"| {r.model} | {r.expert_compute} | {r.scenario} | {1e3 * r.tpot_measured_s:.3f} | "
                     f"{1e3 * r.tpot_predicted_s:.3f} | {r.tpot_ape:.1%} | {1e3 * r.ttft_measured_s:.2f} | "
                     f"{1e3 * r.ttft_predicted_s:.2f} | {r.ttft_ape:.1%} |")
    (out / "report.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="folders written by moesim calibrate validate")
    ap.add_argument("--device", required=True)
    ap.add_argument("--profile", required=True)
    ap.add_argument("--notes", help="Markdown put between the summary table and the scenario table")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    df, passes = _load(a.runs)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    df.to_parquet(out / "validation.parquet", index=False)
    passes.to_parquet(out / "passes.parquet", index=False)
    _plot(df, out, a.device)
    _report(df, out, a.device, a.profile, Path(a.notes).read_text() if a.notes else "")
    print(f"wrote {out}/report.md, validation.parquet ({len(df)} rows), passes.parquet ({len(passes)} rows), "
          "predicted_vs_measured.png")


if __name__ == "__main__":
    main()

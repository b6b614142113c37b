"""One validation report from several ``moesim calibrate validate`` runs (a model and an
execution mode each): ``validation.parquet`` (a row per scenario, with model and execution),
``passes.parquet`` (a row per forward pass), and the report, summary and plot of
:func:`moesim.calibration.validate.write_report` (a panel per model and execution; the text of
``--notes`` goes between the error tables and the scenarios).

    python tools/validation_summary.py --device "NVIDIA H100 80GB HBM3" --profile profiles/h100.yaml \\
        --notes notes.md --out validation/h100 RUN_DIR [RUN_DIR ...]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from moesim.calibration.validate import write_report


def _load(dirs: list[str]) -> tuple[pd.DataFrame, pd.DataFrame]:
    rows, passes = [], []
    for d in dirs:
        v = pd.read_parquet(Path(d) / "validation.parquet")
        p = pd.read_parquet(Path(d) / "passes.parquet")
        rows.append(v)  # runs made before passes.parquet named the model and execution: from validation.parquet
        passes.append(p if "model" in p else p.merge(v[["scenario", "model", "expert_compute"]], on="scenario"))
    return pd.concat(rows, ignore_index=True), pd.concat(passes, ignore_index=True)


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
    write_report(df, out, a.profile, a.device, notes=Path(a.notes).read_text() if a.notes else "")
    print(f"wrote {out}/report.md, validation.parquet ({len(df)} rows), passes.parquet ({len(passes)} rows), "
          "predicted_vs_measured.png")


if __name__ == "__main__":
    main()

"""Re-predict the committed H100 validation with today's simulator and profile, the measured
columns untouched (issue 37): ``validation/h100/repredicted.parquet`` and the report's section
"Re-predicted with the host model", replaced in ``validation/h100/report.md``.

    python tools/repredict_h100.py

The traces are the validation's synthetic ones, regenerated (deterministic for their seed),
as ``tools/gpu_calibrate.sh`` made them.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pandas as pd

from moesim.calibration.validate import repredict, repredicted_section, write_validation_traces
from moesim.files import write_atomic, write_text_atomic

ROOT = Path(__file__).resolve().parents[1]
H100 = ROOT / "validation" / "h100"
HEADING = "## Re-predicted with the host model (issue 37)"
COMMAND = "python tools/repredict_h100.py"


def same_calls_evidence(table: pd.DataFrame, df: pd.DataFrame) -> str:
    """Why no cost per call can close the OLMoE per-expert gap, from the run's own rows: the
    scenarios whose every access missed (the same copies and launches in every one) measured
    different times per capacity in per-expert execution, not in layer execution."""
    all_miss = table[(table["model"] == "olmoe-1b-7b") & (table["hits_exec"] == 0)]
    lines = ["", "**The OLMoE per-expert gap does not come from what is issued.** In these rows of the run every "
             f"access missed ({int(all_miss['misses_exec'].iloc[0]):,} misses, no hits, no prefetch): the executor "
             "made the same copies and launches in each, and any model that charges a cost per call (the host "
             "model included) predicts one time for all of them. Measured:", "",
             "| execution | scenario | cache slots | TPOT measured ms | TTFT measured ms | predicted (host) ms |",
             "|---|---|---|---|---|---|"]
    host = df[df["model"] == "olmoe-1b-7b"].set_index(["expert_compute", "scenario"])
    for r in all_miss.sort_values(["expert_compute", "scenario"]).itertuples():
        slots = {"1%": 10, "5%": 51}.get(r.capacity, "")
        h = host.loc[(r.expert_compute, r.scenario)]
        lines.append(f"| {r.expert_compute} | {r.scenario} | {slots} | {1e3 * r.tpot_measured_s:.2f} | "
                     f"{1e3 * r.ttft_measured_s:.1f} | {1e3 * h.tpot_host_s:.2f} / {1e3 * h.ttft_host_s:.1f} |")
    pe = all_miss[all_miss["expert_compute"] == "per-expert"]
    moved = max((df[f"{k}_ape_host"] - df[f"{k}_ape_none"]).abs().max() for k in ("tpot", "ttft"))
    small, large = pe[pe["capacity"] == "1%"], pe[pe["capacity"] == "5%"]
    lines += ["", f"In per-expert execution a decode pass took {1e3 * (large.tpot_measured_s.mean() - small.tpot_measured_s.mean()):.1f} ms "
              f"and the prefill {1e3 * (large.ttft_measured_s.mean() - small.ttft_measured_s.mean()):.0f} ms longer with 51 "
              "cache slots than with 10, for the same calls; in layer execution the two differ by "
              f"{1e3 * abs(all_miss[(all_miss.expert_compute == 'layer') & (all_miss.capacity == '5%')].tpot_measured_s.mean() - all_miss[(all_miss.expert_compute == 'layer') & (all_miss.capacity == '1%')].tpot_measured_s.mean()):.1f} ms. "
              "What grows with the slots in per-expert execution is the device memory the copies land in and "
              "the number of distinct CUDA graphs (one per buffer and token count). On an H200 the graphs were "
              "found to cost it (`validation/h200/report.md`, section 1): the same executor launching eagerly takes "
              "the same time at both capacities, and 1%'s slots spread over 5%'s memory take 1%'s time; the "
              "per-expert graphs waiting on the demand-copy stream are an artefact of the executor, which "
              "`calibrate validate` now avoids in per-expert execution (`--launch auto`: eager). These H100 rows "
              "stay as measured; the OLMoE per-expert validation measured again on an H100 with eager launches "
              "(and the prefetches issued from the main thread) met issue 37's targets with the host cost fitted "
              "on held-out rows in one run and missed them in a replicate whose host ran slower "
              "(`validation/h100/eager/report.md`). The measured "
              "host costs are hidden behind the GPU in every row (host: 5-13 us per call against 19-24 us per "
              "expert FFN and 230 us per OLMoE expert copy): the host model moves no prediction here by more than "
              f"{100 * moved:.2f} points of error, only the first layer's launch of each pass; the OLMoE per-expert targets of issue 37 (TPOT median 5%, p95 10%, TTFT "
              "median 5%) are not met by these rows."]
    return "\n".join(lines) + "\n"


def main() -> None:
    table = pd.read_parquet(H100 / "validation.parquet")
    with tempfile.TemporaryDirectory() as tmp:
        df = repredict(table, str(ROOT / "profiles" / "h100.yaml"), write_validation_traces(Path(tmp)))
    write_atomic(H100 / "repredicted.parquet", lambda t: df.to_parquet(t, index=False))
    report = (H100 / "report.md").read_text()
    section = repredicted_section(df, COMMAND) + same_calls_evidence(table, df)
    if HEADING in report:  # replace the section, up to the next heading of its level or the end
        head, rest = report.split(HEADING, 1)
        nxt = rest.find("\n## ")
        report = head + section + (rest[nxt:] if nxt >= 0 else "")
    else:
        report = report.rstrip("\n") + "\n\n" + section
    write_text_atomic(H100 / "report.md", report)
    print(section)


if __name__ == "__main__":
    main()

"""The report of issue 37's H100 runs (``validation/h100/eager/report.md``), made from the
committed measurements and today's simulator. No measured number is edited.

    python tools/repredict_h100_eager.py

Two device calls on one lent H100 (``tools/gpu_issue37_h100.sh``, ``tools/gpu_issue37_h100_second.sh``):
the OLMoE per-expert validation with eager launches, its prefetches issued by the copy worker
(two thread switch intervals) and by the main thread, and the 10 rows the committed H100 run had
measured under the old Least-Stale rule. The profile (``profile.yaml``) is the fit of the
microbenchmarks of the first call (``raw.parquet``), disjoint from every row judged.

Writes ``validation/h100/eager/repredicted.parquet`` and the report.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from moesim.calibration.validate import repredict, write_validation_traces
from moesim.files import write_atomic, write_text_atomic

ROOT = Path(__file__).resolve().parents[1]
EAGER = ROOT / "validation" / "h100" / "eager"
PROFILE = EAGER / "profile.yaml"
COMMITTED_PROFILE = ROOT / "profiles" / "h100.yaml"  # the committed run's, for its old-rule rows
# the eager per-expert runs: folder -> (device call, what differs)
RUNS = {"main": ("second", "prefetches from the main thread (`--prefetch-from main`, now the default)"),
        "eager": ("first", "prefetches from the copy worker, Python's 5 ms thread switch interval"),
        "eager-switch50": ("first", "prefetches from the copy worker, a 50 us switch interval"),
        "pf-worker": ("second", "prefetches from the copy worker (rows with prefetch at 1% and 5%)"),
        "pf-main": ("second", "prefetches from the main thread, again (the same rows)"),
        "main2": ("third", "`main` again on a fresh machine, with that call's microbenchmarks (`profile3.yaml`)")}
PROFILES = {"main2": EAGER / "profile3.yaml"}  # a run's microbenchmarks, where not the first call's
OLD_RULE = ("oldrule-olmoe-layer", "oldrule-olmoe-per-expert", "oldrule-mixtral-layer", "oldrule-mixtral-per-expert")
TARGET = {"tpot median": 0.05, "tpot p95": 0.10, "ttft median": 0.05}  # issue 37, Build 3
LAYERS, TOP_K = 16, 8  # OLMoE: the decode pass's layers and experts a layer (a token each)


def held_out_expert_us(run: pd.DataFrame, profile: Path = PROFILE) -> float:
    """The executor's host time per cached expert fitted from the 100%-capacity rows of ``run``
    alone (every access a hit: the pass is the host's 16 layers of one non-expert launch and 8
    expert launches, by ``profile``'s ``eager_layer_us``), for judging the other rows."""
    layer = yaml.safe_load(profile.read_text())["host"]["eager_layer_us"]
    full = run[run["capacity"] == "100%"]
    return float((full["tpot_measured_s"].mean() * 1e6 / LAYERS - layer) / TOP_K)


def _executor_columns(table: pd.DataFrame) -> dict[str, object]:
    """What the executor recorded of a run beside its times. The first call's executor (commit
    a7e763d) had only the copy worker and recorded neither who issued prefetches nor late
    withdrawals (the worker has none: it cancels a withdrawn prefetch it has not begun)."""
    return {"prefetch_from": table.get("prefetch_from", "worker"),
            "late_withdraws": table.get("late_withdraws", 0),
            "switch_interval_us": table["switch_interval_us"], "hits_exec": table["hits_exec"],
            "misses_exec": table["misses_exec"]}


def repredicted(folder: Path) -> pd.DataFrame:
    """Every committed row re-predicted: the eager runs with ``profile.yaml`` and the executor's
    ``eager-per-expert`` host (``host``), and with the per-expert host time fitted from the main
    run's 100% rows (``held``, in ``tpot_held_s``/``ttft_held_s``); the old-rule rows with the
    committed run's profile and its graph styles."""
    paths = write_validation_traces(folder)
    out = []
    main = pd.read_parquet(EAGER / "main" / "validation.parquet")
    for run in RUNS:
        table = pd.read_parquet(EAGER / run / "validation.parquet")
        profile = PROFILES.get(run, PROFILE)
        # fitted on the run's own 100% rows where it has them, else on the judged run's
        own = (table["capacity"] == "100%").sum() == 4
        held = [f"execution.host_launch_us={held_out_expert_us(table if own else main, profile)!r}"]
        df = repredict(table, str(profile), paths, graphs=False, variants={"held": held})
        out.append(df.assign(run=run, **_executor_columns(table)))
    for run in OLD_RULE:
        table = pd.read_parquet(EAGER / run / "validation.parquet")
        df = repredict(table, str(COMMITTED_PROFILE), paths, graphs=True)
        out.append(df.assign(run=run, **_executor_columns(table)))
    return pd.concat(out, ignore_index=True)


def _range(ape: pd.Series) -> str:
    return f"{ape.min():.1%}-{ape.max():.1%}"


def _ms(s: float) -> str:
    return f"{1e3 * s:.1f}" if np.isfinite(s) else "-"


def errors(df: pd.DataFrame, which: str) -> dict[str, float]:
    """TPOT median and p95 and TTFT median of the absolute percentage errors in ``df``."""
    return {"tpot median": float(df[f"tpot_ape_{which}"].median()), "tpot p95": float(df[f"tpot_ape_{which}"].quantile(0.95)),
            "ttft median": float(df[f"ttft_ape_{which}"].median())}


def verdict(err: dict[str, float]) -> str:
    parts = [f"{k.upper().replace(' MEDIAN', ' median').replace(' P95', ' p95')} {v:.1%} "
             f"({'met' if v <= TARGET[k] else 'not met'}: {TARGET[k]:.0%})" for k, v in err.items()]
    return ", ".join(parts)


def validation_section(df: pd.DataFrame) -> str:
    main = df[df["run"] == "main"].sort_values("scenario")
    rest = main[main["capacity"] != "100%"]
    held_us = held_out_expert_us(main)
    prof = yaml.safe_load(PROFILE.read_text())
    lines = ["## 1. OLMoE per-expert validation: eager launches, prefetches from the main thread", "",
             "`tools/gpu_issue37_h100_second.sh` (run `main`): the committed validation's OLMoE trace (64-token "
             "prompt, 127 decode passes), the 16 validation scenarios, `calibrate validate --set "
             "expert_compute=per-expert --launch eager --prefetch-from main`. Predicted with today's simulator, "
             "`eager-per-expert`, two ways:",
             f"- **microbenchmarks** (`profile.yaml`, the first call's `calibrate measure`): the executor's host time "
             f"per non-expert launch {prof['host']['eager_layer_us']:.1f} us and per cached expert "
             f"{prof['host']['eager_expert_us']:.1f} us (its hit and run decisions: the pool's Python and 5 eager kernels; "
             f"5 bare eager kernels took {5 * prof['host']['eager_kernel_us']:.1f} us), none of them from these rows;",
             f"- **held out**: the per-expert host time fitted from the 4 rows at 100% alone ({held_us:.1f} us: "
             "every access a hit, so a decode pass is the host's 16 non-expert launches and 128 expert launches), "
             "judged on the other 12.", "",
             "| scenario | hits / misses | late withdraws | TPOT measured ms | predicted: microbench. / held out | APE | "
             "TTFT measured ms | predicted | APE |", "|---|---|---|---|---|---|---|---|---|"]
    for r in main.itertuples():
        lines.append(f"| {r.scenario} | {r.hits_exec:,} / {r.misses_exec:,} | {r.late_withdraws} | {_ms(r.tpot_measured_s)} | "
                     f"{_ms(r.tpot_host_s)} / {_ms(r.tpot_held_s)} | {r.tpot_ape_host:.1%} / {r.tpot_ape_held:.1%} | "
                     f"{_ms(r.ttft_measured_s)} | {_ms(r.ttft_host_s)} | {r.ttft_ape_host:.1%} |")
    lines += ["", f"All 16 rows make the executor's decisions today: {bool(main['same_decisions'].all())}. Issue 37's "
              "targets: TPOT APE median at most 5% and p95 at most 10%, TTFT median at most 5%.",
              f"- Microbenchmarks only, all 16 rows: {verdict(errors(main, 'host'))}.",
              f"- Held out, the 12 rows below 100%: {verdict(errors(rest, 'held'))}.",
              f"- **A replicate on a freshly started machine misses them** (section 5): the same work measured up to "
              f"{replicate_ratio(df).max() - 1:.0%} slower there, the host's speed varying between calls."]
    pf = main[(main["prefetch"] != "none") & main["capacity"].isin(["1%", "5%"])]
    copy_s = 12_582_912 / (prof["links"]["h2d_pinned"]["bandwidth_gbps"] * 1e9) + prof["links"]["h2d_pinned"]["latency_us"] * 1e-6
    extra = pf["late_withdraws"].to_numpy() * copy_s / 127
    lines += [f"- The rows with prefetch at 1% and 5% stay {pf['tpot_ape_host'].min():.1%}-{pf['tpot_ape_host'].max():.1%} "
              f"above the prediction. Part of it is copies the simulator does not make: the main thread keeps two "
              f"prefetches issued ahead, and {pf['late_withdraws'].min()}-{pf['late_withdraws'].max()} of the prefetches "
              "the simulator withdrew unstarted had been issued already (`late_withdraws`), each a 12.6 MB copy of "
              f"{1e6 * copy_s:.0f} us on the fitted link: {1e3 * extra.min():.1f}-{1e3 * extra.max():.1f} ms a decode pass, "
              f"against {1e3 * (pf['tpot_measured_s'] - pf['tpot_host_s']).min():.1f}-"
              f"{1e3 * (pf['tpot_measured_s'] - pf['tpot_host_s']).max():.1f} ms measured above the prediction.",
              f"- TTFT is predicted {1e3 * (main['ttft_host_s'] - main['ttft_measured_s']).median():.1f} ms (median) above "
              f"the measurement, in {int((main['ttft_host_s'] > main['ttft_measured_s']).sum())} of {len(main)} rows: the "
              "prefill is copy-bound (the same prediction in every row), and the host model does not change it.",
              "- Both replay paths give these predictions (`tests/test_h100_eager.py` re-predicts on the compiled "
              "kernel and on SimPy)."]
    return "\n".join(lines) + "\n"


def prefetch_section(df: pd.DataFrame) -> str:
    rows = df[df["run"].isin(list(RUNS)) & (df["prefetch"] != "none") & df["capacity"].isin(["1%", "5%"])]
    lines = ["## 2. Why the rows with prefetch were slower than predicted: the host waited for the copy worker", "",
             "The H200's eager validation left the rows with prefetch at 1% and 5% 30-37% slower than predicted, "
             "unexplained. The same rows on this H100, each run's TPOT in ms (predicted with the microbenchmarks):", "",
             "| scenario | predicted | " + " | ".join(f"{run} ({RUNS[run][0]} call)" for run in RUNS) + " |",
             "|---|---|" + "---|" * len(RUNS)]
    for sc, g in rows.groupby("scenario"):
        by = g.set_index("run")
        lines.append(f"| {sc} | {_ms(by['tpot_host_s'].iloc[0])} | " +
                     " | ".join(_ms(by.loc[run, "tpot_measured_s"]) if run in by.index else "-" for run in RUNS) + " |")
    second = rows[rows["run"].isin(["main", "pf-main"])]
    main_ape, worker_ape = second["tpot_ape_host"], rows.loc[rows["run"] == "pf-worker", "tpot_ape_host"]
    lines += ["", "Runs: " + "; ".join(f"`{run}`: {what}" for run, (_, what) in RUNS.items()) + ".", "",
              "- **With the copy worker the host waits.** The worker's thread submits a prefetch and waits for it to "
              "land; when an expert whose prefetch is still in flight runs, the main thread waits for that copy "
              "(`DevicePool._landed`), and the GPU then idles until the host has launched the expert's kernels. The "
              "simulator's executor styles model a host that never waits inside a pass. Issued from the main thread "
              "(two kept issued on the prefetch stream, the GPU waiting on a late one's event), the same decisions "
              f"measured {_range(main_ape)} above the prediction in both of the second call's runs, against "
              f"{_range(worker_ape)} with the worker in the same call (section 1 accounts for part of the rest).",
              "- **Not the interpreter's thread switching.** A 50 us switch interval (Python's is 5 ms) left the "
              "worker's rows as slow as before (`eager` against `eager-switch50`).",
              "- The main thread is now the executor's default (`calibrate validate --prefetch-from main`); the "
              "SpecMD-style executor (`hf-loop`) keeps its worker, as SpecMD's asynchronous prefetch is one."]
    return "\n".join(lines) + "\n"


def spread_section(df: pd.DataFrame) -> str:
    nopf = df[df["run"].isin(["eager", "eager-switch50", "main"]) & (df["prefetch"] == "none")]
    lines = ["## 3. The same work, three runs", "",
             "Without prefetch the main thread and the worker run the same code, so the three full runs time the "
             "same work three times (TPOT ms):", "",
             "| scenario | eager (first call) | eager-switch50 (first call) | main (second call) | predicted |",
             "|---|---|---|---|---|"]
    for sc, g in nopf.groupby("scenario"):
        by = g.set_index("run")["tpot_measured_s"]
        lines.append(f"| {sc} | {_ms(by['eager'])} | {_ms(by['eager-switch50'])} | {_ms(by['main'])} | "
                     f"{_ms(g['tpot_host_s'].iloc[0])} |")
    t = nopf.pivot(index="scenario", columns="run", values="tpot_measured_s")
    spread = (t[["eager", "eager-switch50"]].max(axis=1) / t[["eager", "eager-switch50"]].min(axis=1) - 1)
    below = int((t["main"] <= t[["eager", "eager-switch50"]].min(axis=1)).sum())
    lines += ["", f"The first call's two runs of the same work differ by up to {spread.max():.0%} ({spread.idxmax()}); "
              f"the second call's run is at or below both in {below} of {len(t)} scenarios, so the host was slower "
              "and noisier during the first call. Section 1 judges the second call's run, in which all 16 "
              "scenarios ran under one executor."]
    return "\n".join(lines) + "\n"


def old_rule_section(df: pd.DataFrame) -> str:
    old = df[df["run"].isin(OLD_RULE)]
    lines = ["## 4. The 10 rows the committed H100 run measured under the old Least-Stale rule", "",
             "`validation/h100/validation.parquet` holds 10 Least-Stale rows with prefetch measured before issue 33 "
             "changed the rule; today's simulator makes other decisions there. The first call measured them again "
             "with the committed run's executor settings (graphs, the copy worker: `oldrule-*`), predicted with "
             "`profiles/h100.yaml` as the committed rows were:", "",
             "| model | execution | scenario | today's decisions | TPOT measured ms | predicted | APE | TTFT measured ms | "
             "predicted | APE |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in old.sort_values(["model", "expert_compute", "scenario"]).itertuples():
        lines.append(f"| {r.model} | {r.expert_compute} | {r.scenario} | {r.same_decisions} | {_ms(r.tpot_measured_s)} | "
                     f"{_ms(r.tpot_host_s)} | {r.tpot_ape_host:.1%} | {_ms(r.ttft_measured_s)} | {_ms(r.ttft_host_s)} | "
                     f"{r.ttft_ape_host:.1%} |")
    lines += ["", f"Today's simulator makes the executor's decisions in all {len(old)}: {bool(old['same_decisions'].all())}. "
              "The OLMoE per-expert rows time the per-expert graphs (`validation/h200/report.md`, section 1), and the "
              "rows with prefetch at 1% and 5% the copy worker's waits (section 2), as the committed rows do."]
    return "\n".join(lines) + "\n"


def replicate_ratio(df: pd.DataFrame) -> pd.Series:
    """Per scenario, the replicate's measured TPOT over the judged run's."""
    a = df[df["run"] == "main"].set_index("scenario")["tpot_measured_s"]
    return df[df["run"] == "main2"].set_index("scenario")["tpot_measured_s"].loc[a.index] / a


def replicate_section(df: pd.DataFrame) -> str:
    a = df[df["run"] == "main"].set_index("scenario")
    b = df[df["run"] == "main2"].set_index("scenario").loc[a.index]
    rest = b[b["capacity"] != "100%"]
    ratio = replicate_ratio(df)
    same = bool(((a["hits_exec"] == b["hits_exec"]) & (a["misses_exec"] == b["misses_exec"])).all())
    calls = {}
    for name, raw in (("first", "raw.parquet"), ("third", "raw3.parquet")):
        r = pd.read_parquet(EAGER / raw)
        calls[name] = r[r["kind"] == "host"].groupby("call")["median_s"].median() * 1e6
    lines = ["## 5. A replicate on a freshly started machine", "",
             "`tools/gpu_issue37_h100_third.sh` (run `main2`): the judged run of section 1 again, on a freshly started lent "
             "H100 of the same kind, with that call's own microbenchmarks (`raw3.parquet`, `profile3.yaml`). The "
             f"executor made the same hits and misses as in `main` in every scenario: {same}. TPOT in ms:", "",
             "| scenario | main (second call) | main2 (third call) | main2 / main | late withdraws | predicted "
             "(its microbench. / held out) | APE |", "|---|---|---|---|---|---|---|"]
    for sc, r in b.iterrows():
        lines.append(f"| {sc} | {_ms(a.loc[sc, 'tpot_measured_s'])} | {_ms(r.tpot_measured_s)} | {ratio[sc]:.2f} | "
                     f"{a.loc[sc, 'late_withdraws']} / {r.late_withdraws} | {_ms(r.tpot_host_s)} / {_ms(r.tpot_held_s)} | "
                     f"{r.tpot_ape_host:.1%} / {r.tpot_ape_held:.1%} |")
    lines += ["", "The host calls the microbenchmarks time, us per call (first call / third call):", "",
              "| call | first | third | third / first |", "|---|---|---|---|"]
    for call in calls["first"].index:
        lines.append(f"| {call} | {calls['first'][call]:.1f} | {calls['third'][call]:.1f} | "
                     f"{calls['third'][call] / calls['first'][call]:.2f} |")
    slow = calls["third"] / calls["first"]
    lines += ["", f"- Microbenchmarks alone, all 16 rows: {verdict(errors(b, 'host'))}.",
              f"- Held out (fitted on this run's 100% rows), the 12 rows below 100%: {verdict(errors(rest, 'held'))}.",
              f"- **The same work measured up to {ratio.max() - 1:.0%} slower** ({ratio.idxmax()}) than in the second "
              f"call, with the same hits and misses, and the host calls made from Python took {slow.drop('graph replay').min():.1f}-"
              f"{slow.max():.1f} times as long as in the first call (a CUDA graph's replay {slow['graph replay']:.2f}). "
              "No prediction can be within 5% of both runs of such a row: on these lent machines the host's speed "
              "varies between calls, and in this call between its microbenchmarks (which predict 100% rows "
              f"{_ms(b.loc[b['capacity'] == '100%', 'tpot_host_s'].iloc[0])} ms a pass) and its rows (measured "
              f"{_ms(b.loc[b['capacity'] == '100%', 'tpot_measured_s'].min())}-"
              f"{_ms(b.loc[b['capacity'] == '100%', 'tpot_measured_s'].max())} ms). The per-expert executor with eager "
              "launches is host-bound, so its times carry the host's speed.",
              "- So section 1's figures hold for a quiet host, and issue 37's targets are met in one of two full "
              "runs. `calibrate validate --host-beside` (built after these runs) times the executor's host work before "
              "each scenario and predicts that scenario with it; on lent H200s that timing did not carry the host's "
              "speed into the scenario (`validation/h200/beside/report.md`)."]
    return "\n".join(lines) + "\n"


def report(df: pd.DataFrame) -> str:
    env = (EAGER / "env.txt").read_text().splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in env if line.startswith("Model name")), "")
    head = ["# Issue 37 on an NVIDIA H100 (2026-11-26): per-expert validation with eager launches", "",
            f"Measured on lent machines of one kind: `{env[1]}`; `{env[2]}`; host CPU {cpu} ({env[3]} cores), kernel "
            f"`{env[5]}` (Firecracker). Three device calls, about 13 minutes of device time: `tools/gpu_issue37_h100.sh` "
            "(raw output `log.txt`), `tools/gpu_issue37_h100_second.sh` (`log2.txt`) and, on a fresh machine, "
            "`tools/gpu_issue37_h100_third.sh` (`log3.txt`). The measured files are as "
            "the device wrote them (`raw.parquet`, each run's `validation.parquet` and `passes.parquet`); this "
            "report is `python tools/repredict_h100_eager.py`.", ""]
    return "\n".join(head) + "\n" + "\n".join(
        [validation_section(df), prefetch_section(df), spread_section(df), old_rule_section(df), replicate_section(df)])


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        df = repredicted(Path(tmp))
    write_atomic(EAGER / "repredicted.parquet", lambda t: df.to_parquet(t, index=False))
    text = report(df)
    write_text_atomic(EAGER / "report.md", text)
    print(text)


if __name__ == "__main__":
    main()

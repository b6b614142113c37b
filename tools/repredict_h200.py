"""The report of issue 37's H200 runs (``validation/h200/report.md``), made from the committed
measurements and today's simulator with ``profiles/h200.yaml`` (measured in the same lease,
by microbenchmarks disjoint from the rows judged). No measured number is edited.

    python tools/repredict_h200.py

Writes ``validation/h200/perexpert-eager/repredicted.parquet``,
``validation/h200/issue37/specmd_predicted.parquet`` and the report.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

from moesim.calibration.validate import repredict
from moesim.config.scenario import load_scenario
from moesim.files import write_atomic, write_text_atomic
from moesim.simulator.engine import simulate
from moesim.traces.io import write_trace
from moesim.traces.synth import synth_from_preset

ROOT = Path(__file__).resolve().parents[1]
H200 = ROOT / "validation" / "h200"
RUNS = H200 / "issue37"
EAGER = H200 / "perexpert-eager"
PROFILE = ROOT / "profiles" / "h200.yaml"
CAPACITIES = {"5%": "0.6445GB", "1%": "0.1289GB"}  # of the full model, as tools/gpu_specmd.py
SPECMD_PAPER = "10.7-34.7% (OLMoE, Table 2: Least-Stale as a drop-in, 5% of the model)"


def eager_repredicted(folder: Path) -> pd.DataFrame:
    """The eager per-expert validation re-predicted: its trace (``moesim trace synth --preset
    olmoe-1b-7b --tokens 200 --prompt-tokens 64``, as the run made it) and profiles/h200.yaml,
    without a host model and with the executor's (``eager-per-expert``)."""
    path = folder / "olmoe.parquet"
    write_trace(synth_from_preset("olmoe-1b-7b", requests=1, prompt_tokens=64, tokens=200, seed=0), path)
    table = pd.read_parquet(EAGER / "validation.parquet")
    return repredict(table, str(PROFILE), {"olmoe-1b-7b": str(path)}, graphs=False)


def specmd_predicted(folder: Path) -> pd.DataFrame:
    """moesim's TTFT for each SpecMD run (``tools/gpu_specmd.py``'s variants) with
    profiles/h200.yaml: the ``hf-loop`` style from its per-call host costs (``style``), and the
    same style with the executor's measured parts (``parts``: a layer's non-expert part and an
    expert's loop body, one token, from ``specmd_micro2.csv``, dequantisation inside them)."""
    path = folder / "specmd.parquet"
    write_trace(synth_from_preset("olmoe-1b-7b", requests=8, prompt_tokens=128, tokens=4, probs=True, pred_next=True,
                                  pred_noise=1.0, seed=0), path)
    micro = pd.read_csv(RUNS / "specmd_micro2.csv").set_index("part")["median_s"] * 1e6
    parts = [f"execution.host_launch_us={micro['expert loop body, 1 tokens']:.1f}",
             f"execution.host_layer_us={micro['layer outside experts, 1 tokens']:.1f}", "execution.dequant=false"]
    rows = []
    for cap, capacity in CAPACITIES.items():
        for pf in ("next-gate-topk", "none"):
            for ev in ("lru", "least-stale"):
                sets = [f"workload.trace.path={path}", f"cache.capacity={capacity}", f"policies.eviction={ev}",
                        f"policies.prefetch={pf}", f"hardware.profile={PROFILE}"]
                row = {"capacity": cap, "prefetch": pf, "eviction": ev}
                for name, extra in (("style", []), ("parts", parts)):
                    res = simulate(load_scenario("specmd/olmoe-prefill", sets + extra))
                    first = (res.steps["phase"] != "decode").to_numpy()
                    row[f"ttft_{name}_s"] = float(res.steps["duration_s"].to_numpy()[first].mean())
                rows.append(row)
    return pd.DataFrame(rows)


def _ms(x: float) -> str:
    return f"{1e3 * x:.1f}"


def slots_section() -> str:
    s = pd.concat([pd.read_csv(RUNS / "slots.csv").assign(run=1), pd.read_csv(RUNS / "slots2.csv").assign(run=2)])
    s["part"] = np.where(s["phase"] == "decode", "decode", "prefill")
    g = s.groupby(["run", "variant", "part"])["measured_s"].mean().unstack()
    launches = s.groupby(["run", "variant"])["launches"].first()
    lines = ["## 1. Why OLMoE per-expert passes took longer with 51 cache slots than with 10",
             "", "`tools/gpu_perexpert_slots.py` (first call: `tools/gpu_issue37.sh`; second: "
             "`tools/gpu_issue37_second.sh`): the validation's OLMoE trace (64-token prompt, 127 decode "
             "passes), LRU, no prefetch, per-expert execution, each variant twice (means below). 1% and 5% "
             "make the same decisions (every access misses).", "",
             "| run | variant | distinct launches | prefill ms | decode ms |", "|---|---|---|---|---|"]
    for (run, variant), r in g.iterrows():
        lines.append(f"| {run} | {variant} | {launches[(run, variant)]} | {_ms(r['prefill'])} | {_ms(r['decode'])} |")
    c = g.loc[1]
    d = g.loc[2]
    lines += ["", f"- **Not the memory the copies land in**: 1%'s ten slots spread over 5%'s memory "
              f"(`cap1-spread5`) took {_ms(c.loc['cap1-spread5', 'decode'])} ms a decode pass, as 1% "
              f"({_ms(c.loc['cap1', 'decode'])}), not as 5% ({_ms(c.loc['cap5', 'decode'])}).",
              f"- **The CUDA graphs**: launched eagerly, 1% and 5% take the same time "
              f"({_ms(c.loc['cap1-eager', 'decode'])} and {_ms(c.loc['cap5-eager', 'decode'])} ms a decode pass, "
              f"{_ms(c.loc['cap1-eager', 'prefill'])} and {_ms(c.loc['cap5-eager', 'prefill'])} ms the prefill); "
              "with a graph per (buffer, token count) 5% has about three times as many distinct graphs and "
              f"costs {_ms(c.loc['cap5', 'decode'] - c.loc['cap1', 'decode'])} ms more a decode pass and "
              f"{_ms(c.loc['cap5', 'prefill'] - c.loc['cap1', 'prefill'])} ms more a prefill (the H100 run: "
              "3.5 and 60 ms).",
              f"- **Not the graphs' first launches**: replaying every graph once before timing (`upload`) leaves "
              f"5% at {_ms(d.loc['cap5-upload', 'decode'])} ms against 1%'s {_ms(d.loc['cap1-upload', 'decode'])}.",
              f"- **Graphs waiting on the demand-copy stream**: with graphs, the prefill takes "
              f"{_ms(c.loc['cap1', 'prefill'])} ms with the demand copies on their own stream and "
              f"{_ms(d.loc['cap1-one-stream', 'prefill'])} ms with them on the compute stream (no overlap of copy "
              f"and compute); eager launches on two streams take {_ms(c.loc['cap1-eager', 'prefill'])} ms. A graph "
              "launched behind a wait on another stream's event costs the GPU what the same kernels launched "
              "eagerly do not (the mechanism inside the driver is not measured here: no hardware counters on this "
              "machine).",
              "", "So the committed H100 per-expert rows (`validation/h100/`) time an artefact of the executor's "
              "graph-per-buffer design that grows with the number of distinct graphs, not a cost of serving MoE. "
              "`moesim calibrate validate --launch eager` runs the executor without it (section 2)."]
    return "\n".join(lines) + "\n"


def eager_section(df: pd.DataFrame) -> str:
    lines = ["## 2. Per-expert validation with eager launches",
             "", "`tools/gpu_issue37_third.sh`: `calibrate measure --model-shapes olmoe-1b-7b` and `fit` "
             "(`profiles/h200.yaml`), then `calibrate validate --launch eager --set expert_compute=per-expert` "
             "on the OLMoE validation trace (64-token prompt, 200 decode passes), the 16 validation scenarios. "
             "Re-predicted with today's simulator (`eager-per-expert`: 5 eager kernels a layer and an expert at "
             "the profile's measured per-kernel host cost; `none`: no host model). The profile's numbers are "
             "microbenchmarks, disjoint from these rows.", "",
             "| scenario | hits / misses | TPOT measured ms | predicted (eager / none) | APE | TTFT measured ms | "
             "predicted | APE |", "|---|---|---|---|---|---|---|---|"]
    t = pd.read_parquet(EAGER / "validation.parquet").set_index("scenario")
    for r in df.itertuples():
        lines.append(f"| {r.scenario} | {t.loc[r.scenario, 'hits_exec']:,} / {t.loc[r.scenario, 'misses_exec']:,} | "
                     f"{_ms(r.tpot_measured_s)} | {_ms(r.tpot_host_s)} / {_ms(r.tpot_none_s)} | "
                     f"{r.tpot_ape_host:.1%} | {_ms(r.ttft_measured_s)} | {_ms(r.ttft_host_s)} | {r.ttft_ape_host:.1%} |")
    full = df[df["capacity"] == "100%"]
    pf = df[(df["prefetch"] != "none") & df["capacity"].isin(["1%", "5%"])]
    rest = df.drop(full.index.union(pf.index))
    lines += ["", f"All {len(df)} rows make the executor's decisions today: {bool(df['same_decisions'].all())}. "
              f"TTFT APE median {df['ttft_ape_host'].median():.1%} (max {df['ttft_ape_host'].max():.1%}); TPOT APE "
              f"median {df['tpot_ape_host'].median():.1%}, p95 {df['tpot_ape_host'].quantile(0.95):.1%}.",
              f"- The {len(rest)} rows without prefetch below 100% and with prefetch at 25%: TPOT within "
              f"{rest['tpot_ape_host'].max():.1%}.",
              f"- The {len(full)} rows at 100% make identical decisions yet measured "
              f"{_ms(full['tpot_measured_s'].min())}-{_ms(full['tpot_measured_s'].max())} ms a decode pass "
              f"(a {full['tpot_measured_s'].max() / full['tpot_measured_s'].min() - 1:.0%} spread between runs of the "
              "same work): the pass is host-bound (the eager launches), and the host's time varied that much "
              f"on this machine; predicted {_ms(full['tpot_host_s'].iloc[0])} ms (without a host model "
              f"{_ms(full['tpot_none_s'].iloc[0])}).",
              f"- The {len(pf)} rows with prefetch at 1% and 5% measured {pf['tpot_ape_host'].min():.0%}-"
              f"{pf['tpot_ape_host'].max():.0%} slower than predicted, slower even than the same capacities without "
              "prefetch, which copy more. Not explained on this machine; on an H100 the same rows measured 27-34% "
              "above the prediction with the executor's copy worker (a Python thread whose in-flight prefetches the "
              "main thread waited for) and 6-10% with the prefetches issued from the main thread, in the same call, "
              "while a 50 us thread switch interval changed nothing (`validation/h100/eager/report.md`, section 2)."]
    return "\n".join(lines) + "\n"


def specmd_section(pred: pd.DataFrame) -> str:
    meas = pd.concat([pd.read_csv(RUNS / "specmd.csv").assign(link="sleep"),
                      pd.read_csv(RUNS / "specmd2.csv").assign(link="spin")])
    first = meas[meas["phase"] != "decode"]
    ttft = first.groupby(["link", "capacity", "prefetch", "eviction", "repeat"])["measured_s"].mean()
    lines = ["## 3. SpecMD's drop-in with SpecMD's kind of executor",
             "", "`tools/gpu_specmd.py`: `specmd/olmoe-prefill` (8 prompts of 128 tokens, 4-bit NF4 experts, a "
             "Hugging Face-style per-expert loop with blocking fetches, the link throttled in software to 5 GB/s: "
             "`moesim/calibration/hf_loop.py`), LRU and Least-Stale, with the scenario's next-gate top-k prefetch "
             "and without. First call: the link's waits slept (their overshoot added 79 us a copy, `link_late_s`); "
             "second call: the waits end in a spin (overshoot 0.5-16 us a copy). TTFT in ms; each measured "
             "run listed. The copies are the executor's (the simulator's decisions with the scenario's own hardware); "
             "moesim's predictions use profiles/h200.yaml, with which the prefetch rows' decisions can differ a little "
             "(prefetch decisions depend on time).", "",
             "| capacity (of the model) | prefetch | copies LRU / LS | TTFT LRU measured (sleep; spin) | TTFT LS "
             "measured | LS saving measured | moesim LRU / LS (style; parts) | moesim saving (style; parts) |",
             "|---|---|---|---|---|---|---|---|"]
    p = pred.set_index(["capacity", "prefetch", "eviction"]).sort_index()
    copies = meas.groupby(["capacity", "prefetch", "eviction"])["copies"].first()  # the executor's (the same each run)
    for cap in CAPACITIES:
        for pf in ("next-gate-topk", "none"):
            def runs(ev: str, cap: str = cap, pf: str = pf) -> list[float]:
                return [float(ttft.loc[(link, cap, pf, ev)].mean()) if (link, cap, pf, ev) in ttft.index else np.nan
                        for link in ("sleep", "spin")]

            def each(ev: str, cap: str = cap, pf: str = pf) -> str:
                return "; ".join(" ".join(_ms(v) for v in ttft.loc[(link, cap, pf, ev)].to_numpy())
                                 for link in ("sleep", "spin") if (link, cap, pf, ev) in ttft.index)

            lru, ls = runs("lru"), runs("least-stale")
            saving = "; ".join(f"{1 - b / a:.0%}" for a, b in zip(lru, ls, strict=True) if np.isfinite(a + b))
            a, b = p.loc[(cap, pf, "lru")], p.loc[(cap, pf, "least-stale")]
            lines.append(f"| {cap} | {pf} | {copies[(cap, pf, 'lru')]:,} / {copies[(cap, pf, 'least-stale')]:,} | {each('lru')} | {each('least-stale')} | "
                         f"{saving} | {_ms(a['ttft_style_s'])} / {_ms(b['ttft_style_s'])}; {_ms(a['ttft_parts_s'])} / "
                         f"{_ms(b['ttft_parts_s'])} | {1 - b['ttft_style_s'] / a['ttft_style_s']:.0%}; "
                         f"{1 - b['ttft_parts_s'] / a['ttft_parts_s']:.0%} |")
    lines += ["", f"- **The paper's effect appears where the cache is small and prefetch thrashes it**: at 1% of the "
              "model with next-gate top-k prefetch, Least-Stale cut the measured TTFT by about a third in every run, "
              f"as moesim predicts (LRU's prefetches evict experts still to run: {copies[('1%', 'next-gate-topk', 'lru')]:,} "
              f"copies against {copies[('1%', 'next-gate-topk', 'least-stale')]:,}). SpecMD reports {SPECMD_PAPER}.",
              "- **At 5% of the model the measured differences are within the noise of the runs**: at 1% without "
              f"prefetch LRU and Least-Stale make identical decisions ({copies[('1%', 'none', 'lru')]:,} copies "
              "each), yet their measured TTFTs differ by as much as the 5% rows' LRU and Least-Stale do.",
              "- **Absolute TTFT**: moesim's `hf-loop` style from per-call host costs predicts below the "
              "measurement; with the executor's measured loop parts (`parts`: "
              "`specmd_micro2.csv`, one token) it comes closer without prefetch. The loop body measured "
              "about 340 us an expert (the NF4 dequantisation with torch ops alone 132 us; bitsandbytes' one "
              "kernel would be less), against 21 us of expert FFN."]
    return "\n".join(lines) + "\n"


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        eager = eager_repredicted(Path(tmp))
        spec = specmd_predicted(Path(tmp))
    write_atomic(EAGER / "repredicted.parquet", lambda t: eager.to_parquet(t, index=False))
    write_atomic(RUNS / "specmd_predicted.parquet", lambda t: spec.to_parquet(t, index=False))
    env = (RUNS / "env.txt").read_text().splitlines()
    head = ["# Issue 37 on an NVIDIA H200 (2026-11-26)", "",
            f"Measured on one lent machine: `{env[1]}`; `{env[2]}`; host CPU {env[4].split(':', 1)[-1].strip()} "
            f"({env[3]} cores, gVisor). Three device calls, 12.9 minutes of device time: `tools/gpu_issue37.sh`, "
            "`tools/gpu_issue37_second.sh`, `tools/gpu_issue37_third.sh` (raw output: `issue37/log.txt`, "
            "`log2.txt`, `perexpert-eager/log3.txt`). The measured files are as the device wrote them; this report "
            "is `python tools/repredict_h200.py`.", ""]
    text = "\n".join(head) + "\n" + slots_section() + "\n" + eager_section(eager) + "\n" + specmd_section(spec)
    write_text_atomic(H200 / "report.md", text)
    print(text)


if __name__ == "__main__":
    main()

"""The documentation's generated parts.

- As the site builds (``mkdocs.yml``: ``hooks``), the pages generated from the code are filled
  in, so that they are never out of step with it: the scenario-key reference and the policy
  tables (:mod:`moesim.config.reference`).
- ``python tools/docs_pages.py`` renders the parts made from results files, between
  ``<!-- rendered: NAME -->`` and ``<!-- end rendered -->`` in the README and the docs: the
  README's headline figures, the performance page (``benchmarks/results/*.json``), the
  validation page (``validation/**/manifest.yaml`` and ``repredicted.parquet``), the mutation
  table of the development page (``benchmarks/results/mutation.json``) and SpecMD's time tables
  beside moesim's on the papers page (``benchmarks/results/specmd_tables.json``, which
  ``--specmd`` first makes by replaying the shipped SpecMD scenarios). ``--check`` writes
  nothing and exits 1 when a rendered part is not what the files give (a test runs it).
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
VALIDATION = ROOT / "validation"

GENERATED = {
    "<!-- generated: scenario keys -->": "markdown",
    "<!-- generated: policies -->": "policies_markdown",
}


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """mkdocs hook: replace each placeholder with what :mod:`moesim.config.reference` generates."""
    from moesim.config import reference

    for mark, fn in GENERATED.items():
        if mark in markdown:
            markdown = markdown.replace(mark, getattr(reference, fn)())
    return markdown


# ---- results files


def _load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _made(d: dict[str, Any]) -> str:
    """Where and how a results file was made, from its ``provenance``."""
    p = d.get("provenance")
    if not p:
        return "_Made on: not recorded._"
    dirty = " (with uncommitted changes)" if p.get("dirty") else ""
    return (f"_Made on {p['machine']}, Python {p['python']}, numba {p['numba']}; commit "
            f"`{p['commit']}`{dirty}, {p['date']}; `{p['command']}`._")


def _n(x: float) -> str:
    """A count or rate with thousands separators, or in millions above ten million."""
    return f"{x / 1e6:.1f} M" if x >= 1e7 else f"{x:,.0f}"


def _end_to_end() -> str:
    out = ["### A whole `moesim run` on a trace file", "",
           "One `moesim run --trace FILE` process per size (reading the file in pieces, the replay "
           "compiled, full timing), against libCacheSim's C loop on the same accesses "
           "(`benchmarks/end_to_end.py`).", ""]
    for policy in ("lru", "static_pin", "ls_sp", "belady"):
        d = _load(f"end_to_end_{policy}")
        if d is None:
            continue
        out += [f"**{d['policy']}** ({', '.join(d['sets'])}):", "",
                "| accesses | wall s | accesses/s | peak RSS MB | libCacheSim accesses/s | moesim / libCacheSim |",
                "|---:|---:|---:|---:|---:|---:|"]
        for s in d["sizes"]:
            lcs = s.get("lcs_accesses_per_s")
            ratio = f"{s['ratio_vs_lcs']:.2f}" if lcs else "-"
            out.append(f"| {_n(s['accesses'])} | {s['wall_s']:.1f} | {_n(s['accesses_per_s'])} | "
                       f"{s['peak_rss_mb']:.0f} | {_n(lcs) if lcs else '-'} | {ratio} |")
        out += ["", _made(d), ""]
    return "\n".join(out)


def _replay() -> str:
    d = _load("replay_speed")
    if d is None:
        return ""
    full, ratio = d["full_timing_accesses_per_s"], d["ratio_full_timing_vs_libcachesim_native"]
    ls = d["least_stale_score_percentile"]["kernel"]
    return "\n".join([
        "### The replay alone", "",
        f"{_n(d['expert_accesses'])} expert accesses ({d['tokens']:,} tokens, a cache of "
        f"{d['cache_capacity_experts']} experts), in one process (`benchmarks/replay_speed.py`):", "",
        "| replay | accesses/s | against libCacheSim's C loop |", "|---|---:|---:|",
        f"| compiled kernel, LRU, full timing | {_n(full['kernel'])} | {ratio['kernel']:.2f}x |",
        f"| compiled kernel, LRU, cache only | {_n(d['cache_only_accesses_per_s_kernel'])} | "
        f"{d['ratio_cache_only_vs_libcachesim_native']:.2f}x |",
        f"| compiled kernel, Least-Stale + score-percentile prefetch | {_n(ls['accesses_per_s'])} | "
        f"{d['ratio_least_stale_score_percentile_vs_libcachesim_native']['kernel']:.2f}x |",
        f"| SimPy (reference semantics), LRU, full timing | {_n(full['simpy'])} | {ratio['simpy']:.3f}x |",
        f"| libCacheSim, C loop | {_n(d['libcachesim_native_accesses_per_s'])} | 1.00x |",
        f"| libCacheSim, Python loop | {_n(d['libcachesim_python_loop_accesses_per_s'])} | "
        f"{d['libcachesim_python_loop_accesses_per_s'] / d['libcachesim_native_accesses_per_s']:.2f}x |",
        "", f"Every replay's misses equal libCacheSim's ({_n(d['misses']['libcachesim_native'])}). A sweep of "
        f"{d['sweep_64_points']['points']} points of {d['sweep_64_points']['tokens']:,} tokens on "
        f"{d['sweep_64_points']['workers']} workers: {d['sweep_64_points']['seconds']:.1f} s.", "", _made(d), ""])


def _hooks() -> str:
    d = _load("hook_speed")
    if d is None:
        return ""
    out = ["### Policies written as hooks against the built-ins", "",
           f"The same replay ({_n(d['tokens'])} tokens, {d['repeat']} runs each, the median) with a "
           "built-in policy and with the same policy written as a plugin's hook "
           "(`benchmarks/hook_speed.py`); the misses are equal in each pair.", "",
           "| policy | accesses/s | hook / built-in |", "|---|---:|---:|"]
    for name, rate in d["accesses_per_s"].items():
        r = d["ratio_hook_vs_builtin"].get(name)
        out.append(f"| {name} | {_n(rate)} | {f'{r:.2f}x' if r is not None else '-'} |")
    return "\n".join([*out, "", _made(d), ""])


def _table(title: str, lead: str, columns: list[str], rows: list[list[str]], d: dict[str, Any],
           after: str = "") -> str:
    """A section of a heading, a lead paragraph, a table of right-aligned ``columns`` and
    ``rows``, a paragraph after it, and where the results file was made."""
    out = [f"### {title}", ""] + ([lead, ""] if lead else [])
    out += ["| " + " | ".join(columns) + " |", "|" + "|".join("---:" for _ in columns) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows] + [""] + ([after, ""] if after else [])
    return "\n".join([*out, _made(d), ""])


def _serving() -> str:
    d = _load("serving_10k")
    if d is None:
        return ""
    lead = (f"{d['requests']:,} requests arriving as a Poisson process at {d['offered_rate']:.2f} requests/s "
            f"({d['offered_share']:.0%} of the burst throughput, {d['saturation_requests_s']:.2f} requests/s), "
            f"served at {d['served_requests_s']:.2f} requests/s"
            + (": above what the server sustains, the queue grows through the run" if d["served_requests_s"]
               < 0.98 * d["offered_rate"] else "") + f" (`benchmarks/serving.py`). {d['forward_passes']:,} forward "
            f"passes, {d['simulated_s']:,.0f} simulated seconds.")
    return _table("Serving under load", lead, ["wall s", "peak RSS MB", "start-up wall s"],
                  [[f"{d['wall_s']:.1f}", f"{d['peak_rss_mb']:.0f}", f"{d['startup_wall_s']:.1f}"]], d)


def _sweep() -> str:
    d = _load("sweep_scaling")
    if d is None:
        return ""
    rows = [[str(n), f"{d[f'workers_{n}']['seconds']:.1f}", f"{d[f'workers_{n}']['points_per_minute']:.0f}"]
            for n in (1, 2)]
    return _table("A sweep on one and two workers", "", ["workers", "seconds", "points a minute"], rows, d,
                  f"Scaling: {d['scaling']:.2f}x (`benchmarks/sweep_scaling.py`).")


def _first_run() -> str:
    d = _load("first_run")
    if d is None:
        return ""
    runs = d["runs"]
    c = runs["compare"]
    out = ["### A first run on a fresh install", "",
           f"`moesim compare` with an empty compile cache: its first line after {c['first']['first_line_s']:.1f} s, "
           f"the ranking after {c['first']['wall_s']:.0f} s; with the cache kept, {c['warm']['wall_s']:.1f} s. Each "
           "form of the replay compiled from an empty cache (`moesim run quickstart`; the compile is the first "
           "run less the warm one) (`benchmarks/first_run.py`):", "",
           "| form | first run s | first line s | warm run s | compile s |", "|---|---:|---:|---:|---:|"]
    for name, r in runs.items():
        if name != "compare":
            out.append(f"| {name.replace('_', ' ')} | {r['first']['wall_s']:.1f} | {r['first']['first_line_s']:.1f} | "
                       f"{r['warm']['wall_s']:.1f} | {r['first']['wall_s'] - r['warm']['wall_s']:.0f} |")
    return "\n".join([*out, "", _made(d), ""])


def _role(cmdline: str) -> str:
    """What a process of the suite is, from its command line (a pytest-xdist worker's, where
    setproctitle is installed, names the test it runs: its file is said)."""
    # the jit helper's program, whose start is in the first 100 characters of a command line suite.py keeps
    from moesim.jitplan import _BOOT

    if cmdline.startswith("[pytest-xdist running] "):
        return f"a pytest-xdist worker in `{cmdline.split()[2].split('::')[0]}`"
    for needle, role in (("exec(eval(sys.stdin", "a pytest-xdist worker"), ("xdist", "a pytest-xdist worker"),
                         ("forkserver", "a fork server or a point forked from it"),
                         (_BOOT[:40], "the jit helper (`moesim.jitplan`)"),
                         ("moesim.jitplan", "the jit helper (`moesim.jitplan`)"),
                         ("ipykernel", "a notebook kernel"), ("-m pytest", "pytest's controller"),
                         ("ray::run_point", "a Ray worker running a point"), ("-m mkdocs", "`mkdocs build`")):
        if needle in cmdline:
            return role
    words = cmdline.split()
    i = next((i for i, w in enumerate(words) if w.rsplit("/", 1)[-1] == "moesim"), None)
    return f"`moesim {words[i + 1]}`" if i is not None and i + 1 < len(words) else "another process"


def _suite() -> str:
    d = _load("suite")
    if d is None:
        return ""
    lead = (f"`{d['command']}` as CI runs it: in a fresh clone, after installing it and running the first command "
            f"(numba's cache: {d['numba_cache']}). Resident memory summed over the suite's process and every process "
            f"it starts, sampled every {d['sample_every_s']:.0f} s (`benchmarks/suite.py`), peaked {d['peak_at_s']:,} s "
            "in; proportional set size (PSS) counts a page shared by n processes (a fork server's children share "
            "its) once in all.")
    spells = d["spells_over"]
    if spells:
        lead += (f" It was over {d['over_gb']:.0f} GB summed in {len(spells)} spell{'s' if len(spells) > 1 else ''}, "
                 f"{sum(s['to_s'] - s['from_s'] + 1 for s in spells):,} s in all, from {spells[0]['from_s']:,} s to "
                 f"{spells[-1]['to_s']:,} s.")
    else:
        lead += f" It was never over {d['over_gb']:.0f} GB summed."
    lead += " At the peak: " + ", ".join(f"{_role(line)} {gb:.2f} GB" for gb, line in d["at_peak"] if gb >= 0.1) + "."
    return _table("The test suite (the README's second command)", lead,
                  ["wall s", "peak RSS, all processes, GB", "peak PSS, all processes, GB",
                   "peak RSS, largest process, GB", "exit status"],
                  [[f"{d['wall_s']:,.0f}", f"{d['peak_rss_sum_gb']:.2f}", f"{d['peak_pss_sum_gb']:.2f}",
                    f"{d['peak_rss_largest_gb']:.2f}", str(d["exit_status"])]], d)


def performance() -> str:
    return "\n".join(p for p in (_first_run(), _end_to_end(), _replay(), _hooks(), _serving(), _sweep(), _suite())
                     if p)


# ---- validation


def _manifest(folder: Path) -> dict[str, Any]:
    import yaml

    path = folder / "manifest.yaml"
    return yaml.safe_load(path.read_text()) if path.exists() else {}


@functools.cache
def _validation_rows() -> list[dict[str, Any]]:
    """A row per measured run (and model and execution), from each suite's ``repredicted.parquet``
    and the run's manifest."""
    import pandas as pd

    rows = []
    for rep in sorted(VALIDATION.glob("*/*/repredicted.parquet")):
        suite = rep.parent
        df = pd.read_parquet(rep)
        if "run" not in df:
            runs = [p.parent.name for p in suite.glob("*/validation.parquet")]
            df = df.assign(run=runs[0])
        for (run, model, mode), g in df.groupby(["run", "model", "expert_compute"], sort=True):
            m = _manifest(suite / run)
            proto = m.get("protocol") or {}
            names = sorted({x.split(":")[0] for r in g["artefact_reason"] for x in r.split("; ") if x})
            pf = g[(g["prefetch"] != "none") & g["capacity"].isin(["1%", "5%"])]
            ratio = pf["tpot_measured_s"] / pf["tpot_host_s"]
            rows.append({
                "device": suite.parent.name.upper(), "run": f"{suite.name}/{run}", "date": m.get("date", "?"),
                "model": model, "execution": mode, "launch": proto.get("launch", "?"),
                "prefetch_from": proto.get("prefetch_from", "?"), "pinned": proto.get("pinned"),
                "rows": len(g), "tpot_median": g["tpot_ape_host"].median(),
                "tpot_p95": g["tpot_ape_host"].quantile(0.95), "ttft_median": g["ttft_ape_host"].median(),
                "pf_ratio": f"{ratio.min():.2f}-{ratio.max():.2f}x" if len(pf) else "-",
                "beside": (g["tpot_ape_beside"].median(), g["tpot_ape_beside"].quantile(0.95))
                if "tpot_ape_beside" in g else None,
                "artefact": f"{int(g['artefact'].sum())} rows: {'; '.join(names)}" if names else "-",
            })
    return rows


def _artefacts() -> str:
    """The figures behind the artefact labels, from the committed rows: identical work under the
    graph-per-buffer executor, measured/predicted TPOT of the prefetch rows by who issued the
    prefetches, and the prefetches the pinned runs' executor had issued before the simulator
    withdrew them."""
    import pandas as pd

    def ratio(rows: pd.DataFrame) -> str:
        r = rows["tpot_measured_s"] / rows["tpot_host_s"]
        return f"{r.min():.2f}–{r.max():.2f}x"

    def pf(df: pd.DataFrame) -> pd.DataFrame:
        return df[(df["prefetch"] != "none") & df["capacity"].isin(["1%", "5%"])]

    graphs = pd.read_parquet(VALIDATION / "h100" / "graphs" / "repredicted.parquet")
    full = graphs[(graphs["model"] == "olmoe-1b-7b") & (graphs["expert_compute"] == "per-expert")
                  & (graphs["capacity"] == "100%")]["tpot_measured_s"]
    h100 = pf(pd.read_parquet(VALIDATION / "h100" / "eager" / "repredicted.parquet"))
    h200 = pf(pd.read_parquet(VALIDATION / "h200" / "eager" / "repredicted.parquet"))
    beside = pd.read_parquet(VALIDATION / "h200" / "beside" / "repredicted.parquet")
    pinned = pf(beside[beside["pinned"]])
    late, fewer = pinned["late_withdraws"], pinned["withdrawn_depth1"] - pinned["withdrawn_own"]
    return "\n".join([
        f"- **graph-per-buffer**: identical work at 100% capacity measured {1e3 * full.min():.2f}–"
        f"{1e3 * full.max():.2f} ms a decode pass in the first H100 calibration's OLMoE per-expert rows.",
        f"- **copy-worker**: the rows with prefetch at 1% and 5% measured "
        f"{ratio(h100[(h100['prefetch_from'] == 'worker') & (h100['style'] == 'eager-per-expert')])} the prediction on the H100 (eager launches) and {ratio(h200)} on the "
        f"H200; issued from the main thread in the same H100 call, {ratio(h100[h100['run'].isin(['main', 'pf-main'])])}.",
        f"- In the pinned H200 runs' rows with prefetch at 1% and 5%, the executor had already issued {late.min():,}–"
        f"{late.max():,} of the prefetches the simulator of its day withdrew (`late_withdraws`); with the two copies "
        f"the main thread keeps issued modelled (`execution.prefetch_depth`), today's simulator withdraws "
        f"{fewer.min():,}–{fewer.max():,} fewer.",
    ]) + "\n"


def validation() -> str:
    out = ["| device | run | date | model | execution | launch | prefetches from | pinned | rows | "
           "TPOT APE median | TPOT APE p95 | TTFT APE median | prefetch rows at 1%/5%: measured / predicted | "
           "TPOT APE median / p95, host timed beside | artefact |",
           "|---|---|---|---|---|---|---|---|---:|---:|---:|---:|---|---|---|"]
    for r in _validation_rows():
        out.append(f"| {r['device']} | `{r['run']}` | {r['date']} | {r['model']} | {r['execution']} | {r['launch']} | "
                   f"{r['prefetch_from']} | {'yes' if r['pinned'] else 'no'} | {r['rows']} | {r['tpot_median']:.1%} | "
                   f"{r['tpot_p95']:.1%} | {r['ttft_median']:.1%} | {r['pf_ratio']} | "
                   + (f"{r['beside'][0]:.1%} / {r['beside'][1]:.1%}" if r["beside"] else "-") + f" | {r['artefact']} |")
    return "\n".join(out) + "\n"


# ---- mutation


def mutation() -> str:
    d = json.loads((RESULTS / "mutation.json").read_text())
    out = ["| module (functions) | mutants | killed | equivalent | alive |", "|---|---:|---:|---:|---:|"]
    total = alive = 0
    for name, r in sorted(d.items()):
        eq = len(r.get("equivalent", {}))
        out.append(f"| `{name}` | {r['mutants']} | {r['killed']} | {eq} | {len(r['alive'])} |")
        total += r["mutants"]
        alive += len(r["alive"])
    out += ["", f"{len(d)} runs, {total:,} mutants, {alive} alive that are not listed as equivalent."]
    return "\n".join(out) + "\n"


# ---- README


def headline() -> str:
    lines = ["| figure | value | from |", "|---|---|---|"]
    lru = _load("end_to_end_lru")
    if lru:
        s = next(s for s in lru["sizes"] if "ratio_vs_lcs" in s)
        lines.append(f"| `moesim run` on a {_n(s['accesses'])}-access trace file, LRU, full timing, against "
                     f"libCacheSim's C loop | {s['ratio_vs_lcs']:.2f}x its speed | `benchmarks/results/end_to_end_lru.json` |")
    rp = _load("replay_speed")
    if rp:
        lines.append(f"| the compiled replay against the SimPy reference (LRU, full timing) | "
                     f"{rp['full_timing_accesses_per_s']['kernel'] / rp['full_timing_accesses_per_s']['simpy']:.0f}x "
                     "as fast, the same results | `benchmarks/results/replay_speed.json` |")
    fr = _load("first_run")
    if fr:
        c = fr["runs"]["compare"]
        lines.append(f"| first `moesim compare` on a fresh install (compiles the replay) | first line after "
                     f"{c['first']['first_line_s']:.1f} s, ranking after {c['first']['wall_s']:.0f} s; later runs "
                     f"{c['warm']['wall_s']:.0f} s | `benchmarks/results/first_run.json` |")
    su = _load("suite")
    if su:
        lines.append(f"| the test suite (the second command above, after installing) | {su['wall_s'] / 60:.0f} min, "
                     f"{su['peak_rss_sum_gb']:.1f} GB peak resident memory over all its processes | "
                     "`benchmarks/results/suite.json` |")
    pinned = [r for r in _validation_rows() if "pinned" in r["run"]]
    if pinned:
        lines.append("| predicted TPOT against a lent H200 (OLMoE per-expert, eager, host pinned and timed beside "
                     "each scenario), two runs | "
                     + "; ".join(f"APE median {r['beside'][0]:.1%}, p95 {r['beside'][1]:.1%}" for r in pinned)
                     + " | `validation/h200/beside/` |")
    return "\n".join(lines) + "\n"


# ---- SpecMD's time tables beside moesim's (docs/results/papers.md)

# SpecMD (OLMoE-1B-7B, 5% of the model): Table 1's TTFT (ms) and tokens/s per configuration,
# Table 2's baselines (configurations #1-#4) with their TTFT before and after Least-Stale (ms)
PAPER_T1 = {1: (3077, 1.91), 2: (2257, 1.22), 3: (1590, 1.34), 4: (2665, 2.33), 5: (2220, 1.69)}
PAPER_T2 = {1: ("Eliseev '23", 3076.8, 2748.1), 2: ("Zhu et al. '25", 2257.2, 1473.1),
            3: ("HOBBIT '24", 1590.1, 1309.2), 4: ("MixtureCache '25", 2664.6, 2297.5)}
T1_NAMES = {1: "Spec, LRU, Fetch, Stnd", 2: "Score, ScoreE, Subs, Stnd", 3: "Spec, LHU, Cascade, Stnd",
            4: "No pref, LRU, Fetch, Mod", 5: "Score, LS, Fetch, Stnd"}


def specmd_runs() -> dict[str, dict[str, float]]:
    """moesim's side of SpecMD's Tables 1 and 2: each shipped ``specmd/olmoe-config<n>``
    scenario as it is (``n``), and #1-#4 with Least-Stale eviction (``n-ls``), all on
    configuration #1's synthetic trace: TTFT (s), tokens/s and misses."""
    from moesim.config.scenario import load_scenario
    from moesim.simulator.build import load_trace
    from moesim.simulator.engine import Simulation

    spec = ROOT / "moesim" / "scenarios" / "specmd"
    trace = load_trace(load_scenario(spec / "olmoe-config1.yaml"))
    out = {}
    for n in PAPER_T1:
        for ls in (False, True) if n in PAPER_T2 else (False,):
            sc = load_scenario(spec / f"olmoe-config{n}.yaml", ["policies.eviction=least-stale"] if ls else [])
            s = Simulation(sc, trace=trace).run().summary
            out[f"{n}-ls" if ls else str(n)] = {"ttft_s": s["ttft_s"], "tokens_per_s": s["tokens_per_s"],
                                                 "misses": int(s["misses"])}
    return out


# the collision-miss study (SpecMD §5.2): per trace, its scenario, prefetcher, how its capacity
# is stated (a share of the full model's bytes for OLMoE, as SpecMD states it; of the expert
# bytes for FLAME-MoE, which SpecMD does not size) and SpecMD's figure per capacity
COLLISION_TRACES = {
    "flame": ("flame-prefill.yaml", "oracle", None, "FLAME-MoE prefill",
              {"1%": "up to 85x (Fig. 8)", "5%": "2.6–8.6x; LS 1.6–1.9%, LRU 4.5–12.6% (§5.2)",
               "25%": "LS near zero (Fig. 8)"}),
    "olmoe": ("olmoe-prefill.yaml", "next-gate-topk", 12.89, "OLMoE synthetic prefill",
              {"1%": "up to 85x", "5%": "2.6–8.6x", "25%": "LS near zero"}),
}
COLLISION_RUNS = (("per-expert", "pipelined"), ("per-expert", "blocking"), ("layer", "pipelined"))
SHARES = ("1%", "5%", "25%")


def specmd_collision_runs(traces: tuple[str, ...] = tuple(COLLISION_TRACES)) -> dict[str, dict[str, int]]:
    """Cache-only replays of the prefill scenarios, LRU and Least-Stale, per execution, fetch
    and capacity: accesses, misses and collision misses, keyed ``trace|mode|fetch|share|eviction``."""
    from moesim.config.scenario import load_scenario
    from moesim.simulator.build import load_trace
    from moesim.simulator.engine import Simulation

    spec = ROOT / "moesim" / "scenarios" / "specmd"
    out = {}
    for name in traces:
        file, prefetch, model_gb, _, _ = COLLISION_TRACES[name]
        trace = load_trace(load_scenario(spec / file))
        for mode, fetch in COLLISION_RUNS:
            for share in SHARES:
                cap = f"{model_gb * float(share[:-1]) / 100:.4f}GB" if model_gb else share
                for ev in ("lru", "least-stale"):
                    sets = [f"expert_compute={mode}", f"expert_fetch={fetch}", f"cache.capacity={cap}",
                            f"policies.prefetch={prefetch}", f"policies.eviction={ev}", "timing=false"]
                    s = Simulation(load_scenario(spec / file, sets), trace=trace).run().summary
                    out[f"{name}|{mode}|{fetch}|{share}|{ev}"] = {
                        "accesses": int(s["expert_accesses"]), "misses": int(s["misses"]),
                        "collisions": int(s["collision_misses"])}
    return out


def _pct(x: float) -> str:
    return "0%" if x == 0 else f"{x:.2%}"


def _one_or_two(a: str, b: str) -> str:
    return a if a == b else f"{a} / {b}"


def specmd_collisions() -> str:
    """The collision-miss table (``benchmarks/results/specmd_tables.json``: ``collisions``)."""
    d = _load("specmd_tables")
    if d is None or "collisions" not in d:
        return "_No results file yet: run `python tools/docs_pages.py --specmd`._\n"
    c = d["collisions"]

    def ratio(name: str, mode: str, fetch: str, share: str) -> str:
        lru, ls = (c[f"{name}|{mode}|{fetch}|{share}|{ev}"]["collisions"] for ev in ("lru", "least-stale"))
        if ls == 0:
            return f"LS none (LRU {lru:,})" if lru else "none either"
        return f"{lru / ls:.1f}x"

    def rate(name: str, mode: str, fetch: str, share: str) -> str:
        r = c[f"{name}|{mode}|{fetch}|{share}|least-stale"]
        return _pct(r["collisions"] / r["accesses"])

    lines = ["| trace, execution, prefetch | capacity | LRU / Least-Stale collision misses | Least-Stale collision "
             "rate | SpecMD |", "|---|---|---|---|---|"]
    rows = {n: COLLISION_TRACES[n] for n in COLLISION_TRACES if f"{n}|layer|pipelined|1%|lru" in c}
    for name, (_, prefetch, model_gb, title, paper) in rows.items():
        of = " of the model" if model_gb else ""
        pf = "top-k" if prefetch == "next-gate-topk" else prefetch
        for share in SHARES:
            both = [(f(name, "per-expert", "pipelined", share), f(name, "per-expert", "blocking", share))
                    for f in (ratio, rate)]
            lines.append(f"| {title}, per-expert (pipelined / blocking fetch), {pf} | {share}{of} | "
                         f"{_one_or_two(*both[0])} | {_one_or_two(*both[1])} | {paper[share]} |")
    for name, (_, prefetch, model_gb, title, _) in rows.items():
        of = " of the model" if model_gb else ""
        pf = "top-k" if prefetch == "next-gate-topk" else prefetch
        lines.append(f"| {title}, layer, {pf} | {' / '.join(SHARES)}{of} | "
                     f"{' / '.join(ratio(name, 'layer', 'pipelined', s) for s in SHARES)} | "
                     f"{' / '.join(rate(name, 'layer', 'pipelined', s) for s in SHARES)} | — |")
    return "\n".join([*lines, "", _made(d)]) + "\n"


def _ranks(values: dict[int, float], high_first: bool) -> dict[int, int]:
    order = sorted(values, key=lambda n: -values[n] if high_first else values[n])
    return {n: order.index(n) + 1 for n in values}


def specmd_tables() -> str:
    """SpecMD's Table 1 and Table 2 beside moesim's figures (``benchmarks/results/specmd_tables.json``)."""
    d = _load("specmd_tables")
    if d is None:
        return "_No results file yet: run `python tools/docs_pages.py --specmd`._\n"
    r = d["runs"]
    ttft = {n: 1e3 * r[str(n)]["ttft_s"] for n in PAPER_T1}
    tps = {n: r[str(n)]["tokens_per_s"] for n in PAPER_T1}
    ranks = (_ranks({n: v[0] for n, v in PAPER_T1.items()}, False), _ranks(ttft, False),
             _ranks({n: v[1] for n, v in PAPER_T1.items()}, True), _ranks(tps, True))
    lines = ["Table 1 (the five configurations; rank 1 is the fastest):", "",
             "| config | paper TTFT ms | moesim TTFT ms | paper tokens/s | moesim tokens/s | TTFT rank paper / moesim "
             "| tokens/s rank paper / moesim |", "|---|---|---|---|---|---|---|"]
    for n, (p_ttft, p_tps) in PAPER_T1.items():
        lines.append(f"| #{n} {T1_NAMES[n]} | {p_ttft} | {ttft[n]:.1f} | {p_tps:.2f} | {tps[n]:.2f} | "
                     f"{ranks[0][n]} / {ranks[1][n]} | {ranks[2][n]} / {ranks[3][n]} |")
    lines += ["", "Table 2 (each baseline's eviction policy swapped for Least-Stale):", "",
              "| baseline | paper TTFT → w/ LS ms | paper saving | moesim TTFT → w/ LS ms | moesim saving "
              "| moesim misses → w/ LS |", "|---|---|---|---|---|---|"]
    for n, (name, before, after) in PAPER_T2.items():
        a, b = ttft[n], 1e3 * r[f"{n}-ls"]["ttft_s"]
        saving = f"{1 - b / a:.1%}".replace("-", "−")
        lines.append(f"| {name} (#{n}) | {before} → {after} | {1 - after / before:.1%} | {a:.1f} → {b:.1f} | "
                     f"{saving} | {r[str(n)]['misses']:,} → {r[f'{n}-ls']['misses']:,} |")
    return "\n".join([*lines, "", _made(d)]) + "\n"


H200_SPECMD = VALIDATION / "h200" / "diagnostics"


def specmd_h200() -> str:
    """The `specmd` protocol's runs on the H200 (``validation/h200/diagnostics/call*/specmd*.csv``,
    each run's mean prefill TTFT; a call's saving from its runs' means) beside moesim's prediction
    (``specmd_predicted.parquet``, the ``hf-loop`` style and the measured parts)."""
    import pandas as pd

    calls = sorted(H200_SPECMD.glob("call*/specmd*.csv"))
    runs = pd.concat([pd.read_csv(f).assign(call=f.parent.name) for f in calls if "micro" not in f.name])
    runs = runs[runs["phase"] == "prefill"]
    pred = pd.read_parquet(H200_SPECMD / "specmd_predicted.parquet").set_index(["capacity", "prefetch", "eviction"])
    per_run = runs.groupby(["capacity", "prefetch", "eviction", "call", "repeat"], sort=False)["measured_s"].mean().sort_index()
    per_call = runs.groupby(["capacity", "prefetch", "eviction", "call"])["measured_s"].mean()
    names = {"next-gate-topk": "next-gate top-k", "none": "none"}
    lines = ["| capacity (of the model) | prefetch | LRU measured | Least-Stale measured | saving measured "
             "| saving moesim | copies LRU / Least-Stale |", "|---|---|---|---|---|---|---|"]
    keys = runs[["capacity", "prefetch"]].drop_duplicates().itertuples(index=False)
    for cap, pf in keys:
        ms = {ev: ", ".join(f"{1e3 * v:.0f}" for v in per_run[cap, pf, ev]) for ev in ("lru", "least-stale")}
        saving = ", ".join(f"{1 - per_call[cap, pf, 'least-stale', c] / per_call[cap, pf, 'lru', c]:.0%}"
                           for c in per_call[cap, pf, "lru"].index).replace("-", "−")
        ttft = pred["ttft_style_s"]
        copies = runs.groupby(["capacity", "prefetch", "eviction"])["copies"].first()
        lines.append(f"| {cap} | {names[pf]} | {ms['lru']} | {ms['least-stale']} | {saving} | "
                     f"{1 - ttft[cap, pf, 'least-stale'] / ttft[cap, pf, 'lru']:.0%} | "
                     f"{copies[cap, pf, 'lru']:,} / {copies[cap, pf, 'least-stale']:,} |")
    micro = pd.concat([pd.read_csv(f) for f in calls if "micro" in f.name])
    parts = micro.groupby("part")["median_s"]
    body, deq = parts.get_group("expert loop body, 1 tokens"), parts.get_group("nf4 dequantise (one expert)")
    lru5 = per_run["5%", "none", "lru"]
    lines += ["", f"The loop body measured {1e3 * body.min():.2f}–{1e3 * body.max():.2f} ms an expert (each call's median of "
              f"{micro['repeats'].min()} repeats; the torch-op NF4 dequantisation {1e3 * deq.median():.2f} ms of "
              f"it). With the second call's measured parts (an expert's loop body, a layer's part outside the experts) "
              f"in place of the profile's per-call host costs, moesim's TTFT at 5% LRU without prefetch is {1e3 * pred['ttft_parts_s']['5%', 'none', 'lru']:,.0f} ms against "
              f"{1e3 * lru5.min():,.0f}–{1e3 * lru5.max():,.0f} ms measured.",
              "", f"_Measured on the H200 of `validation/h200/diagnostics/` ({', '.join(sorted({f.parent.name for f in calls}))}; "
              "each call's `manifest.yaml` records the device, driver, torch, date and command)._"]
    return "\n".join(lines) + "\n"


PARTS = {  # name -> (file, renderer)
    "headline": ("README.md", headline),
    "performance": ("docs/results/performance.md", performance),
    "validation": ("docs/results/validation.md", validation),
    "artefacts": ("docs/results/validation.md", _artefacts),
    "mutation": ("docs/development.md", mutation),
    "specmd-tables": ("docs/results/papers.md", specmd_tables),
    "specmd-collisions": ("docs/results/papers.md", specmd_collisions),
    "specmd-h200": ("docs/results/papers.md", specmd_h200),
}


def rendered(text: str, name: str, body: str) -> str:
    """``text`` with the part between ``<!-- rendered: name -->`` and ``<!-- end rendered -->``
    replaced by ``body``."""
    pat = re.compile(rf"(<!-- rendered: {re.escape(name)} -->\n).*?(<!-- end rendered -->)", re.S)
    if not pat.search(text):
        raise SystemExit(f"no '<!-- rendered: {name} -->' ... '<!-- end rendered -->' markers")
    return pat.sub(lambda m: m.group(1) + body.rstrip("\n") + "\n" + m.group(2), text, count=1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a rendered part is stale")
    ap.add_argument("--specmd", action="store_true",
                    help="first replay the SpecMD tables' scenarios into benchmarks/results/specmd_tables.json")
    args = ap.parse_args(argv)
    if args.specmd:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from provenance import provenance

        doc = {"provenance": provenance([__file__, "--specmd"]), "runs": specmd_runs(),
               "collisions": specmd_collision_runs()}
        (RESULTS / "specmd_tables.json").write_text(json.dumps(doc, indent=1) + "\n")
    stale = []
    for name, (file, render) in PARTS.items():
        path = ROOT / file
        old = path.read_text()
        new = rendered(old, name, render())
        if new != old:
            stale.append(f"{file} ({name})")
            if not args.check:
                path.write_text(new)
    if args.check and stale:
        print("stale: " + ", ".join(stale) + "; run python tools/docs_pages.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

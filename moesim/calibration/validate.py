"""``moesim calibrate validate``: a reference executor replays a trace on the device and the
simulator predicts the same scenarios with a calibration profile; the report gives the error.

The executor holds real-shaped expert weights (gate, up, down) for every expert in host
memory (pinned on CUDA) and a device cache pool of the scenario's capacity. Its decisions are
the simulator's: the timed replay whose times it predicts records them (hit, fetch, bypass,
evict, prefetch, withdraw, run, in order) and the executor performs them, so both make identical hits
and misses; a miss copies the
expert's weights host -> device (into a free or evicted slot), then each layer computes the
non-expert part (q/k/v/o projections and router as matmuls over the pass's tokens) and every
needed expert's FFN on its tokens. Prefetches proposed by the scenario's prefetcher are
copied by a background copy worker (a second CUDA stream's job on a GPU, a thread on the CPU)
that overlaps compute; an access to an expert whose copy has not landed waits for it. Each
forward pass is timed (CUDA synchronisation on CUDA, a monotonic clock on the CPU). Misses
and hits + late prefetches are identical; whether a prefetch was late depends on the real
timing. (A cache-only run's decisions would not do: with prefetch, which proposals are
admitted depends on when pins are released, so its hits and misses can differ from the
timed replay's.)
"""

from __future__ import annotations

import glob
import json
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from moesim.calibration.executor import DevicePool, host_weights
from moesim.calibration.protocol import (
    HOST_COSTS_MAX_AGE_S,
    SENTINEL,
    host_costs_age_s,
    protocol_columns,
    sentinel_drift,
    sentinel_tpots,
)
from moesim.config.execution import depth_key
from moesim.errors import MoesimError
from moesim.files import save_figure_atomic, write_atomic, write_text_atomic


def fastest_core(torch: Any, h: int, inter: int, device: str, repeats: int = 3) -> int | None:
    """The allowed CPU core on which the eager executor's host work for a cached expert
    (:func:`moesim.calibration.calibrate.executor_host_us`) is fastest, by the median of
    ``repeats`` timings pinned to each; the process is left pinned to it (None where the
    platform cannot pin: its affinity is left as it was)."""
    import os

    from moesim.calibration.calibrate import executor_host_us

    if not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    best, best_us = cores[0], float("inf")
    for c in cores:
        os.sched_setaffinity(0, {c})
        us = float(np.median([executor_host_us(torch, h, inter, device)["eager_expert_us"] for _ in range(repeats)]))
        if us < best_us:
            best, best_us = c, us
    os.sched_setaffinity(0, {best})
    return best


def execute(scenario: Any, trace: Any, device: str = "cpu", host: Any = None, spread: int = 1,
            graphs: bool = True, upload: bool = False, one_stream: bool = False,
            switch_us: float | None = None, prefetch_from: str = "main") -> dict[str, Any]:
    """Replay ``trace`` under ``scenario`` on ``device``; per-pass times and the decisions.
    The decisions are the simulator's own (the timed replay records them; its result is
    returned as ``predicted``), replayed op by op (:class:`DevicePool`): no second copy of the
    miss -> evict -> insert logic.
    ``host`` is :func:`host_weights` for the trace's model (made here when not given);
    ``spread``, ``graphs``, ``upload`` and ``one_stream`` are diagnostics of :class:`DevicePool` (the defaults are the
    validation's executor). ``switch_us``: Python's thread switch interval during the timed
    passes (``sys.setswitchinterval``; None leaves it, 5,000 us by default): how long the copy
    worker's thread can wait for the interpreter while the main thread launches kernels.
    ``prefetch_from``: who issues prefetch copies (:class:`DevicePool`: "main", the main thread,
    which then never waits for one, or "worker", the copy worker's thread)."""
    import sys

    import torch

    from moesim.simulator.engine import Simulation

    sim = Simulation(scenario, trace=trace, record_decisions=True)
    predicted = sim.run()
    assert sim.decisions is not None
    wl, model = sim.wl, sim.model
    h, num_l, num_e = model.hidden_size, model.num_layers, model.num_experts
    inter = model.expert_intermediate_size
    slots = int(min(sim.capacity / sim.expert_bytes, num_l * num_e)) if np.isfinite(sim.capacity) else num_l * num_e
    ops: dict[tuple[int, int], list[tuple[str, int]]] = {}
    for p, layer, op, key in sim.decisions:
        ops.setdefault((p, layer), []).append((op, key))
    keys, acc_tokens, off = sim.acc_keys.tolist(), wl.acc_tokens.tolist(), wl.off.tolist()
    counts = {b: dict(zip(keys[off[b]:off[b + 1]], acc_tokens[off[b]:off[b + 1]], strict=True))
              for b in range(len(off) - 1)}  # tokens routed to each expert of a (pass, layer)
    tokens = int(wl.pass_tokens.max())
    mem: DevicePool
    if scenario.execution.style == "hf-loop":  # SpecMD's loop (moesim.calibration.hf_loop)
        from moesim.calibration.hf_loop import HfLoopPool, hf_host_weights

        quantised = sim.expert_bytes < 6 * h * inter  # below bf16: NF4 experts
        if host is None or host.dim() != 2:
            host = hf_host_weights(torch, num_l * num_e, h, inter, device, quantised)
        mem = HfLoopPool(torch, host, slots, device, sim.num_prec, tokens, num_e, (h, inter),
                         sim.cost.copy_time(sim.expert_bytes), quantised, model.top_k, counts, wl.pass_tokens, num_l)
    else:
        if host is None:
            host = host_weights(torch, num_l * num_e, h, inter, device)
        mem = DevicePool(torch, host, slots, device, sim.num_prec, tokens, num_e, spread, graphs, upload, one_stream,
                         prefetch_from)

    def forward(p: int) -> None:
        for layer in range(num_l):
            mem.begin_layer(p, layer)
            mem.run(((-1, mem.size(int(wl.pass_tokens[p]))),))
            needed: dict[int, int] = {}
            for op, key in ops.get((p, layer), []):
                mem.perform(op, key, needed, counts[p * num_l + layer])

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    times = []
    with torch.no_grad():
        for p in range(wl.num_passes):  # the plan: which kernels and how many spares
            forward(p)
        mem.prepare()
        forward(0)  # a warm-up pass, untimed: first touches of the pool and the kernels
        for fut in mem.landing.values():
            fut.result()
        sync()
        mem.reset()
        before = sys.getswitchinterval()
        if switch_us is not None:
            sys.setswitchinterval((switch_us + 0.5) * 1e-6)  # CPython keeps whole microseconds, truncated
        switch = sys.getswitchinterval()
        try:
            for p in range(wl.num_passes):
                sync()
                t0 = time.perf_counter()
                forward(p)
                sync()
                times.append(time.perf_counter() - t0)
        finally:
            sys.setswitchinterval(before)
    mem.copier.shutdown(wait=True)
    link = getattr(mem, "link", None)
    return {"pass_s": np.asarray(times), "hits": mem.tally["hit"],
            "copies": mem.tally["fetch"] + mem.tally["bypass"] + mem.tally["prefetch"],
            "link_late_s": link.late if link is not None else 0.0,
            "misses": mem.tally["fetch"] + mem.tally["bypass"], "workload": wl, "predicted": predicted,
            "launches": mem.launches, "spares": mem.most_spares, "host": host, "switch_s": switch,
            "late_withdraws": mem.late_withdraws, "launch": "graphs" if mem.use_graphs else "eager",
            "prefetch_from": "main" if mem.main_prefetch else "worker"}


def validate(profile: str, trace_path: str, scenarios: list[str], out_dir: str, device: str = "cpu",
             progress: Any = None,
             warn: Callable[[str], None] | None = None, overrides: list[str] | None = None,
             done: Callable[[dict[str, Any]], None] | None = None, launch: str = "auto",
             switch_us: float | None = None, prefetch_from: str = "main", host_beside: bool = False,
             protocol: str = "declared") -> pd.DataFrame:
    """Measure and predict every scenario; write report.md, validation.parquet (a row per
    scenario), passes.parquet (a row per forward pass: measured and predicted seconds, so the
    error can be studied pass by pass) and a plot. ``overrides`` (``KEY=VALUE``) apply to every
    scenario (e.g. ``expert_compute=per-expert``). ``warn`` hears each :func:`shape_warnings`
    message before the measurements start (they also go into the report); ``done`` hears each
    scenario's row as it is finished. ``switch_us`` and ``prefetch_from``: :func:`execute`'s;
    each row records the interval its timed passes ran with (``switch_interval_us``), how its
    executor launched (``launch``) and who issued its prefetches (``prefetch_from``: the
    SpecMD-style executor launches eagerly and prefetches from its copy worker), and how many
    withdrawn prefetches the main thread had issued already (``late_withdraws``). ``host_beside``:
    before each scenario, time the eager executor's host work for a layer and a cached expert
    (:func:`moesim.calibration.calibrate.executor_host_us`) and predict that scenario with them
    (``execution.host_layer_us``/``host_launch_us``, recorded as ``host_layer_us`` and
    ``host_expert_us``), so the prediction has the host's speed of the moment; eager launches in
    per-expert execution only.

    ``protocol="declared"`` (``docs/guides/calibration.md``, "The validation protocol"): eager
    launches, prefetches issued from the main thread, the process pinned to the core where the
    executor's host work is fastest (:func:`fastest_core`), and a sentinel row (the first
    scenario at 100% capacity without prefetch: identical work) before and after the scenarios
    (``sentinel``: "before"/"after"), whose difference is the host's drift; whether the profile's
    host costs were measured on this device within :data:`HOST_COSTS_MAX_AGE_S` is checked, not
    enforced. ``"none"``: as the options say. Every row records its ``protocol``, ``artefact``
    and ``artefact_reason`` (:func:`protocol_columns`) and the ``core`` it was pinned to."""

    from moesim.config.scenario import load_scenario
    from moesim.traces.io import read_trace

    declared = _check_protocol(protocol, launch, prefetch_from)
    if declared:
        launch = "eager"
    trace = read_trace(trace_path)
    warnings = shape_warnings(profile, trace)
    if warn is not None:
        for w in warnings:
            warn(w)
    sets = [f"hardware.profile={profile}", f"workload.trace.path={Path(trace_path).resolve()}", *(overrides or [])]
    plain = [load_scenario(path, sets) for path in scenarios]
    for path, sc in zip(scenarios, plain, strict=True):
        if declared and sc.expert_compute != "per-expert":
            raise MoesimError(f"calibrate validate: {path} runs expert_compute={sc.expert_compute}; the declared protocol "
                              "launches eagerly, which moesim models in per-expert execution only. Add --set "
                              "expert_compute=per-expert, or --protocol none to measure outside the protocol.")
    graphs = [launch == "graphs" or (launch == "auto" and sc.expert_compute != "per-expert") for sc in plain]
    loaded = [executor_style(sc, path, sets, g, prefetch_from)
              for sc, path, g in zip(plain, scenarios, graphs, strict=True)]  # every scenario checked before any is measured
    if host_beside:
        for path, sc in zip(scenarios, loaded, strict=True):
            if sc.execution.style != "eager-per-expert":
                raise MoesimError(f"calibrate validate --host-beside: {path} is predicted in the {sc.execution.style} "
                                  "style; --host-beside times the eager executor's host work, so it needs --launch "
                                  "eager (or auto) and --set expert_compute=per-expert.")
    hosts: dict[tuple[bool, Any], Any] = {}  # the experts' host copies, made once per executor and precision
    rows, passes = [], []
    order = [(p, sc, "") for p, sc in zip(scenarios, loaded, strict=True)]
    core, same_lease = None, False
    if declared:
        core, same_lease, sentinel_sc = _declared_setup(trace, profile, device, scenarios[0], sets, warnings, warn)
        order = [(scenarios[0], sentinel_sc, "before"), *order, (scenarios[0], sentinel_sc, "after")]
        graphs = [False, *graphs, False]
    how = {"prefetch_from": prefetch_from, "pinned": core is not None, "host_costs_same_lease": same_lease,
           "sentinels": declared}  # and each row's launch
    for i, (path, sc, sentinel) in enumerate(order):
        if progress is not None:
            progress(i, len(order))
        kind = (sc.execution.style == "hf-loop", sc.cache.precision)
        beside = {"eager_layer_us": np.nan, "eager_expert_us": np.nan}
        if host_beside:
            sc, beside = _beside(sc, path, [*sets, *(SENTINEL if sentinel else [])], trace.model, device)
        meas = execute(sc, trace, device, hosts.get(kind), graphs=graphs[i], switch_us=switch_us,
                       prefetch_from=prefetch_from)
        hosts[kind] = meas["host"]
        label = protocol_columns({**how, "launch": meas["launch"]}, sc.expert_compute, sc.policies.prefetch.name)
        row = {"scenario": Path(path).stem + (f" (sentinel {sentinel})" if sentinel else ""), "sentinel": sentinel,
               **label, "core": -1 if core is None else core, **_measured_row(sc, meas, beside)}
        m, steps = meas["pass_s"], meas["predicted"].steps
        rows.append(row)
        passes.append(pd.DataFrame({"scenario": row["scenario"], "model": row["model"],
                                    "expert_compute": sc.expert_compute, "pass": np.arange(len(m)),
                                    "phase": steps["phase"].to_numpy(), "tokens": meas["workload"].pass_tokens,
                                    "measured_s": m, "predicted_s": steps["duration_s"].to_numpy()}))
        if done is not None:
            done(row)
        df = pd.DataFrame(rows)
        out = Path(out_dir)  # the rows so far, so that a run stopped early keeps what it measured
        write_atomic(out / "validation.parquet", partial(df.to_parquet, index=False))
        write_atomic(out / "passes.parquet", lambda tmp: pd.concat(passes).to_parquet(tmp, index=False))
    write_report(df, out, profile, device, warnings)
    df.attrs["warnings"] = warnings
    return df


def _measured_row(sc: Any, meas: dict[str, Any], beside: dict[str, float]) -> dict[str, Any]:
    """A validation row's scenario, executor and timing columns: ``sc`` measured (``meas``:
    :func:`execute`'s) and predicted, with the host timings taken beside it."""
    pred = meas["predicted"]
    steps = pred.steps
    dec = (steps["phase"] == "decode").to_numpy()
    first = (steps["phase"] != "decode").to_numpy()
    m = meas["pass_s"]
    row = {"capacity": sc.cache.capacity, "eviction": sc.policies.eviction.name,
           "model": pred.summary["model"], "expert_compute": sc.expert_compute,
           "prefetch": sc.policies.prefetch.name, "launch": meas["launch"],
           "switch_interval_us": round(meas["switch_s"] * 1e6, 3), "prefetch_from": meas["prefetch_from"],
           "prefetch_depth": sc.host.prefetch_depth, "late_withdraws": meas["late_withdraws"],
           "host_layer_us": beside["eager_layer_us"], "host_expert_us": beside["eager_expert_us"],
           "hits_sim": pred.summary["hits"] + pred.summary["late_prefetches"], "misses_sim": pred.summary["misses"],
           "hits_exec": meas["hits"], "misses_exec": meas["misses"],
           "tpot_measured_s": float(m[dec].mean()) if dec.any() else np.nan,
           "tpot_predicted_s": float(steps.loc[dec, "duration_s"].mean()) if dec.any() else np.nan,
           "ttft_measured_s": float(m[first].mean()) if first.any() else np.nan,
           "ttft_predicted_s": float(steps.loc[first, "duration_s"].mean()) if first.any() else np.nan}
    for k in ("tpot", "ttft"):
        row[f"{k}_ape"] = abs(row[f"{k}_predicted_s"] - row[f"{k}_measured_s"]) / row[f"{k}_measured_s"]
    return row


def _beside(sc: Any, path: str, sets: list[str], model: Any, device: str) -> tuple[Any, dict[str, float]]:
    """``--host-beside``: the eager executor's host work timed now, and ``sc`` (from ``path`` with
    ``sets``) predicted with it."""
    import torch

    from moesim.calibration.calibrate import executor_host_us
    from moesim.config.scenario import load_scenario

    beside = executor_host_us(torch, model.hidden_size, model.expert_intermediate_size, device)
    return load_scenario(path, [*sets, "execution.style=eager-per-expert",
                                f"execution.prefetch_depth={depth_key(sc.host.prefetch_depth)}",
                                f"execution.host_layer_us={beside['eager_layer_us']!r}",
                                f"execution.host_launch_us={beside['eager_expert_us']!r}"]), beside


def _check_protocol(protocol: str, launch: str, prefetch_from: str) -> bool:
    """Whether :func:`validate` runs the declared protocol; options outside it are refused with the fix."""
    if protocol not in ("declared", "none"):
        raise ValueError(f"protocol must be 'declared' or 'none', got {protocol!r}")
    if protocol == "declared" and (launch == "graphs" or prefetch_from != "main"):
        raise MoesimError("calibrate validate: the declared protocol launches eagerly and issues prefetches from the "
                          f"main thread, not with --launch {launch} --prefetch-from {prefetch_from}: leave those "
                          "options out, or add --protocol none to measure outside it (the rows are then labelled "
                          "with what differed).")
    return protocol == "declared"


def _declared_setup(trace: Any, profile: str, device: str, first: str, sets: list[str], warnings: list[str],
                    warn: Callable[[str], None] | None) -> tuple[int | None, bool, Any]:
    """The declared protocol's preparation: the process pinned to the fastest core, whether the
    profile's host costs are this lease's (else a warning, told to ``warn`` and kept in
    ``warnings``), and the sentinel scenario (``first`` at 100% capacity without prefetch)."""
    import torch

    from moesim.calibration.calibrate import environment
    from moesim.config.scenario import load_scenario

    model = trace.model
    core = fastest_core(torch, model.hidden_size, model.expert_intermediate_size, device)
    name = environment(device)["device_name"]
    age = host_costs_age_s(profile, name)
    same_lease = age is not None and 0 <= age <= HOST_COSTS_MAX_AGE_S
    if not same_lease:
        w = (f"{profile}'s host costs were not measured on this device ({name}) in the last "
             f"{HOST_COSTS_MAX_AGE_S / 60:.0f} minutes: run `moesim calibrate measure` and `fit` just before, or the "
             "rows are labelled 'not declared'.")
        warnings.append(w)
        if warn is not None:
            warn(w)
    return core, same_lease, load_scenario(first, [*sets, *SENTINEL, "execution.style=eager-per-expert"])


def executor_style(sc: Any, path: Any, sets: list[str], graphs: bool = True, prefetch_from: str = "main") -> Any:
    """``sc`` predicted with the executor's own host: a scenario without an execution style
    gets the executor's (``graph-per-expert`` in per-expert execution, else ``graph-layer``;
    with eager launches, ``eager-per-expert``, which models per-expert execution only), and the
    number of prefetch copies its issuer keeps issued (``execution.prefetch_depth``: the main
    thread's :data:`~moesim.config.execution.PREFETCH_DEPTH`, the style's; one where a copy
    worker issues them, ``prefetch_from="worker"`` or SpecMD's loop)."""
    from moesim.config.scenario import load_scenario

    if not graphs and sc.expert_compute != "per-expert":
        raise MoesimError(f"calibrate validate --launch eager: {path} runs expert_compute={sc.expert_compute}; eager "
                          "launches are modelled in per-expert execution only (execution.style=eager-per-expert). "
                          "Add --set expert_compute=per-expert, or launch graphs.")
    style = sc.execution.style
    if style == "none":
        per_expert = "graph-per-expert" if graphs else "eager-per-expert"
        style = per_expert if sc.expert_compute == "per-expert" else "graph-layer"
    one = prefetch_from == "worker" or style == "hf-loop"  # the copy worker runs one copy at a time
    if style == sc.execution.style and not one:
        return sc
    return load_scenario(path, [*sets, f"execution.style={style}", *(["execution.prefetch_depth=1"] if one else [])])


VALIDATION_TRACES = {"olmoe-1b-7b": None, "mixtral-8x7b": 4}  # model -> layers kept (None: all)


def write_validation_traces(folder: Path) -> dict[str, str]:
    """The committed validation runs' traces (``validation/``: ``moesim trace synth --preset
    MODEL --tokens 128 --prompt-tokens 64``, Mixtral with 4 of its layers, as
    ``tools/gpu_calibrate.sh`` makes them; synthetic traces are deterministic for a seed),
    written into ``folder``: model -> path."""
    from moesim.traces.io import write_trace
    from moesim.traces.synth import synth_from_preset

    out = {}
    for name, layers in VALIDATION_TRACES.items():
        path = Path(folder) / f"{name}.parquet"
        write_trace(synth_from_preset(name, layers=layers, requests=1, prompt_tokens=64, tokens=128, seed=0), path)
        out[name] = str(path)
    return out


def repredict(table: pd.DataFrame, profile: str, traces: dict[str, str], graphs: bool = True,
              variants: dict[str, list[str]] | None = None) -> pd.DataFrame:
    """Today's predictions for a committed validation run (``validation.parquet``: its
    measured and recorded columns kept as they are): per scenario, the shipped
    ``validation/SCENARIO`` on the run's trace for its model (``traces``) and ``profile``,
    predicted without host costs (``none``, its prefetch copies issued as the executor issued them) and with the executor's own style
    (:func:`executor_style`; ``graphs`` False: the executor launched eagerly), and whether today's hits and misses are the ones the executor
    performed (``same_decisions``; when not, the row measured other decisions). ``variants``
    (name -> ``KEY=VALUE`` overrides over the executor's style, e.g. a host cost fitted from
    held-out rows) add a prediction each, in ``tpot_NAME_s``, ``ttft_NAME_s`` and their errors;
    ``withdrawn_NAME``: the prefetches each prediction withdrew, ``same_NAME`` whether a variant
    makes the executor's hits and misses. The executor's style issues
    prefetch copies as the row's executor did (``prefetch_from``; the runs from before that
    column issued them from the copy worker)."""
    from moesim.config.scenario import load_scenario
    from moesim.simulator.engine import Simulation

    rows = []
    for r in table.to_dict("records"):
        sets = [f"hardware.profile={profile}", f"workload.trace.path={Path(traces[r['model']]).resolve()}",
                f"expert_compute={r['expert_compute']}"]
        path = f"validation/{r['scenario']}"
        row = {"model": r["model"], "expert_compute": r["expert_compute"], "scenario": r["scenario"],
               "capacity": r["capacity"], "eviction": r["eviction"], "prefetch": r["prefetch"],
               "tpot_measured_s": r["tpot_measured_s"], "ttft_measured_s": r["ttft_measured_s"],
               "tpot_recorded_s": r["tpot_predicted_s"], "ttft_recorded_s": r["ttft_predicted_s"]}
        issuer = r.get("prefetch_from")  # the runs before the column issued from the copy worker
        hosted = executor_style(load_scenario(path, sets), path, sets, graphs,
                                issuer if isinstance(issuer, str) else "worker")
        depth = f"execution.prefetch_depth={depth_key(hosted.host.prefetch_depth)}"
        plain = load_scenario(path, [*sets, depth])  # no host costs; prefetches issued as the executor did
        style = [f"execution.style={hosted.execution.style}", depth]
        more = [(name, load_scenario(path, [*sets, *style, *extra])) for name, extra in (variants or {}).items()]
        for name, sc in (("none", plain), ("host", hosted), *more):
            res = Simulation(sc).run()
            steps = res.steps
            dec = (steps["phase"] == "decode").to_numpy()
            row[f"tpot_{name}_s"] = float(steps.loc[dec, "duration_s"].mean())
            row[f"ttft_{name}_s"] = float(steps.loc[~dec, "duration_s"].mean())
            row[f"withdrawn_{name}"] = int(res.summary["prefetches_cancelled"])
            s = res.summary
            same = bool((s["misses"], s["hits"] + s["late_prefetches"]) == (r["misses_exec"], r["hits_exec"]))
            if name == "none":
                row["same_decisions"] = same
            elif name != "host":
                row[f"same_{name}"] = same
            else:
                row["style"] = sc.execution.style
                row["prefetch_depth"] = sc.host.prefetch_depth
        for k in ("tpot", "ttft"):
            for name in ("recorded", "none", "host", *(variants or {})):
                row[f"{k}_ape_{name}"] = abs(row[f"{k}_{name}_s"] - row[f"{k}_measured_s"]) / row[f"{k}_measured_s"]
        rows.append(row)
    return pd.DataFrame(rows)


def repredicted_section(df: pd.DataFrame, command: str) -> str:
    """The report's section on a re-prediction (:func:`repredict`): the error per model and
    execution as recorded, today without a host model and today with the executor's host,
    over the rows whose decisions today are the executor's."""
    same = df[df["same_decisions"]]
    lines = ["## Re-predicted with the host model", "",
             f"`{command}` re-predicts every row with today's simulator and `profiles/h100.yaml` refitted with the "
             "host's time per CUDA call (`diagnostics/host_overhead.csv`: data disjoint from the rows judged here). "
             "The measured columns are the run's own. "
             f"{len(df) - len(same)} rows are left out: today's simulator makes other decisions there than the "
             "executor performed. `recorded`: the prediction the run recorded; `none`: today, no host "
             "model; `host`: today, with the executor's style (`graph-layer` or `graph-per-expert`).", "",
             "| model | execution | rows | TPOT APE median recorded / none / host | TPOT APE p95 recorded / none / host | "
             "TTFT APE median recorded / none / host |", "|---|---|---|---|---|---|"]

    def trio(g: pd.DataFrame, k: str, q: float) -> str:
        return " / ".join(f"{g[f'{k}_ape_{n}'].quantile(q):.1%}" for n in ("recorded", "none", "host"))

    for (model, mode), g in same.groupby(["model", "expert_compute"], sort=True):
        lines.append(f"| {model} | {mode} | {len(g)} | {trio(g, 'tpot', 0.5)} | {trio(g, 'tpot', 0.95)} | "
                     f"{trio(g, 'ttft', 0.5)} |")
    return "\n".join(lines) + "\n"


def shape_warnings(profile: str, trace: Any) -> list[str]:
    """A profile measured on other model shapes than the trace's predicts the trace's expert
    compute from the roofline, not from measurements: say so (the prediction error then says
    little about the profile)."""
    from moesim.calibration.calibrate import load_profile

    prof = load_profile(profile, "calibrate validate")
    m = trace.model
    shapes = {(int(t.get("hidden", 0)), int(t.get("intermediate", 0)))
              for by_dtype in (prof.get("expert_time") or {}).values() for t in by_dtype.values()}
    if (m.hidden_size, m.expert_intermediate_size) in shapes:
        return []
    have = ", ".join(f"{h}x{i}" for h, i in sorted(shapes)) or "none"
    return [f"profile {profile} has no expert FFN measurements for the trace's model {m.name} "
            f"({m.hidden_size}x{m.expert_intermediate_size}; it has {have}): the simulator predicts its expert "
            f"compute from the datasheet roofline. Measure that shape: moesim calibrate measure --model-shapes "
            f"{m.hidden_size}x{m.expert_intermediate_size}."]


def _setting_order(value: Any) -> tuple[float, str]:
    """Sort key of a scenario setting: capacities by their number ("5%" before "25%"), names by name."""
    head = str(value).rstrip("%").split(" ")[0]
    return (float(head), "") if head.replace(".", "", 1).isdigit() else (float("inf"), str(value))


def _plot(df: pd.DataFrame, out: Path, device: str) -> None:
    """Predicted against measured per pass (TPOT and TTFT), a panel per model and execution,
    log axes, the ±10% band shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    varied = "; ".join(f"{col} {'/'.join(str(v) for v in sorted(df[col].unique(), key=_setting_order))}"
                       for col in ("capacity", "prefetch", "eviction"))
    fig.suptitle(f"moesim vs the reference executor on {device}\n{len(df) // len(groups)} scenarios per panel "
                 f"({varied})", fontsize=10)
    fig.tight_layout()
    save_figure_atomic(fig, out / "predicted_vs_measured.png", dpi=100)


def write_report(df: pd.DataFrame, out: Path, profile: str, device: str, warnings: list[str] | None = None,
                 notes: str = "") -> None:
    """``report.md`` (the error over all scenarios, then per model and execution, ``notes``,
    then every scenario, largest TPOT error first), ``summary.json`` and the plot, for the rows
    of one validation run or of several put together (``tools/validation_summary.py``)."""
    sentinels = df[df["sentinel"] != ""] if "sentinel" in df else df.iloc[:0]
    df = df[df["sentinel"] == ""] if "sentinel" in df else df
    apart = df[df["artefact"]] if "artefact" in df else df.iloc[:0]
    df = df[~df["artefact"]] if "artefact" in df else df
    _plot(df, out, device)

    def same(g: pd.DataFrame) -> bool:
        return bool(((g.hits_sim == g.hits_exec) & (g.misses_sim == g.misses_exec)).all())

    head = []
    if "protocol" in df:
        head += [f"Protocol: {', '.join(sorted(set(df['protocol'])))}.", ""]
    tpots = sentinel_tpots(sentinels)
    drift = sentinel_drift(sentinels)
    if tpots is not None and drift is not None:
        before, after = tpots
        verdict = ("within 5%: the host held its speed, so the rows are judged" if drift <= 0.05 else
                   "over 10%: the host's speed moved during the run, so its host-bound rows cannot be validated on "
                   "this machine" if drift > 0.10 else "between 5% and 10%: judge the host-bound rows with care")
        head += [f"Sentinels (the first scenario at 100% capacity without prefetch, before and after): TPOT "
                 f"{1e3 * before:.3f} ms and {1e3 * after:.3f} ms, a drift of {drift:.1%}, {verdict}.", ""]
    if len(apart):
        head += [f"{len(apart)} rows carry an executor artefact and are reported apart, at the end.", ""]
    lines = [f"# Validation on {device} with profile `{profile}`", "",
             *[f"**Warning:** {w}\n" for w in warnings or []], *head,
             f"TPOT absolute percentage error: median {df['tpot_ape'].median():.1%}, "
             f"p95 {df['tpot_ape'].quantile(0.95):.1%} over {len(df)} scenarios.",
             f"TTFT absolute percentage error: median {df['ttft_ape'].median():.1%}, "
             f"p95 {df['ttft_ape'].quantile(0.95):.1%}.", "",
             f"Hits and misses: executor == simulator in every scenario: {same(df)}.", "",
             "| model | execution | scenarios | TPOT APE median | TPOT APE p95 | TTFT APE median | TTFT APE p95 | "
             "hits and misses identical |", "|---|---|---|---|---|---|---|---|"]
    for (model, mode), g in df.groupby(["model", "expert_compute"], sort=True):
        lines.append(f"| {model} | {mode} | {len(g)} | {g.tpot_ape.median():.1%} | {g.tpot_ape.quantile(0.95):.1%} | "
                     f"{g.ttft_ape.median():.1%} | {g.ttft_ape.quantile(0.95):.1%} | {same(g)} |")
    lines += ["", notes.strip(), "", "## Every scenario, largest TPOT error first", "",
              "| model | execution | scenario | capacity | eviction | TPOT measured ms | predicted ms | APE | "
              "TTFT measured ms | predicted ms | APE |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for _, r in df.sort_values("tpot_ape", ascending=False).iterrows():
        lines.append(f"| {r.model} | {r.expert_compute} | {r.scenario} | {r.capacity} | {r.eviction} | "
                     f"{1e3 * r.tpot_measured_s:.3f} | {1e3 * r.tpot_predicted_s:.3f} | {r.tpot_ape:.1%} | "
                     f"{1e3 * r.ttft_measured_s:.2f} | {1e3 * r.ttft_predicted_s:.2f} | {r.ttft_ape:.1%} |")
    if len(apart):
        lines += ["", "## Rows with an executor artefact, reported apart", "",
                  "| scenario | TPOT measured / predicted | TTFT measured / predicted | artefact |", "|---|---|---|---|"]
        for _, r in apart.iterrows():
            lines.append(f"| {r.scenario} | {r.tpot_measured_s / r.tpot_predicted_s:.2f}x | "
                         f"{r.ttft_measured_s / r.ttft_predicted_s:.2f}x | {r.artefact_reason} |")
    write_text_atomic(out / "report.md", "\n".join(lines) + "\n")
    write_text_atomic(out / "summary.json", json.dumps({
        "tpot_median_ape": float(df["tpot_ape"].median()), "tpot_p95_ape": float(df["tpot_ape"].quantile(0.95)),
        "scenarios": len(df), "artefact_rows": len(apart), "sentinel_drift": drift}, indent=2))


def expand(patterns: list[str]) -> list[str]:
    """Scenario files from glob patterns; an empty match is an error."""
    out: list[str] = []
    for pat in patterns:
        hits = sorted(glob.glob(pat))
        if not hits:
            raise MoesimError(f"calibrate validate: --scenarios {pat} matches no file.")
        out.extend(hits)
    return out

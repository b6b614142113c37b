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

from moesim.calibration.calibrate import cuda_graph, expert_ffn, warm_up
from moesim.errors import MoesimError
from moesim.files import save_figure_atomic, write_atomic, write_text_atomic


class _DevicePool:
    """The executor's memory and kernels: every expert's weights (gate, up, down) in host memory
    (pinned on CUDA), a device pool of ``slots`` experts, spare buffers for uncached fetches
    (each holds its expert until it has run), a copy worker (a second CUDA stream's job on a
    GPU, a thread on the CPU) for prefetches, and the layer's kernels on a static input ``x``.

    A buffer is named by an int: ``0 .. slots-1`` the pool's slots, ``slots + j`` spare ``j``.
    :meth:`perform` first runs over a scenario's decisions in ``plan`` mode (no copies, no
    kernels), which finds every launch the replay will make (:meth:`run`: a layer's non-expert
    part, one expert, or a layer's experts together) and how many spares it needs;
    :meth:`prepare` then makes the spares and, on CUDA, captures each launch as a CUDA graph, so
    that the timed replay launches graphs instead of five kernels per expert from Python (on
    the H100 Python's dispatch took 53-91 us per OLMoE FFN, the GPU 19 us)."""

    def __init__(self, torch: Any, host: Any, slots: int, device: str, p_num: int, tokens: int,
                 num_experts: int, spread: int = 1, graphs: bool = True, upload: bool = False,
                 one_stream: bool = False) -> None:
        from concurrent.futures import ThreadPoolExecutor

        # ``spread``: the pool has slots * spread buffers and the cache uses every spread-th, so
        # the copies land in as much device memory as a cache spread times larger while the
        # decisions (and the launches) stay the same; ``graphs``: False launches eagerly
        self.torch, self.device, self.p_num, self.host = torch, device, p_num, host
        # ``upload``: every captured graph replayed once before the timed passes (a graph's
        # first launch uploads it to the device); ``one_stream``: demand copies on the compute stream
        self.spread, self.use_graphs, self.upload, self.one_stream = spread, graphs, upload, one_stream
        self.slots = slots * spread
        h, dt = self._hidden(host)
        gen = torch.Generator(device=device).manual_seed(1)
        self.pool = torch.empty(max(self.slots, 1), *host.shape[1:], dtype=host.dtype, device=device)
        self.x = torch.randn(tokens, h, generator=gen, dtype=torch.float32, device=device).to(dt)
        self.attn = (torch.randn(4, h, h, generator=gen, dtype=torch.float32, device=device) / h ** 0.5).to(dt)
        self.router = torch.randn(h, num_experts, generator=gen, dtype=torch.float32, device=device).to(dt)
        self.spares: list[Any] = []
        self.copier = ThreadPoolExecutor(max_workers=1)  # the copy engine: one copy at a time, in order
        self.side: Any = torch.cuda.Stream() if device == "cuda" else None  # prefetch copies
        self.demand: Any = torch.cuda.Stream() if device == "cuda" else None  # demand copies
        self.graphs: dict[tuple[tuple[int, int], ...], Any] = {}  # a launch (see run) -> its graph's replay
        self.launches: set[tuple[tuple[int, int], ...]] = set()  # what the plan found the replay launches
        self.plan = True
        self.most_spares = 0
        self.reset()

    def _hidden(self, host: Any) -> tuple[int, Any]:
        """The hidden size and the activations' dtype for ``host``'s experts (``experts x 3 x
        hidden x intermediate``, the weights' dtype)."""
        return host.shape[2], host.dtype

    def begin_layer(self, p: int, layer: int) -> None:
        """Pass ``p`` starts layer ``layer`` (nothing to do here; the SpecMD-style executor
        takes the layer's routing)."""

    def reset(self) -> None:
        """Empty cache, no copies in flight, tallies at zero (before the plan and the replay)."""
        self.free = list(range(0, self.slots, self.spread))
        self.spare_free: list[int] = []
        self.spare_used = 0
        self.where: dict[int, int] = {}
        self.landing: dict[int, Any] = {}
        self.arrived: dict[int, Any] = {}  # buffer -> CUDA event of its demand copy
        self.tally = {"hit": 0, "fetch": 0, "bypass": 0, "prefetch": 0}

    def buffer(self, b: int) -> Any:
        return self.pool[b] if b < self.slots else self.spares[b - self.slots]

    def _ffn_eager(self, b: int, n: int) -> None:
        w3 = self.buffer(b)
        expert_ffn(self.x[:n], w3[0], w3[1], w3[2].T)

    def _dense_eager(self, n: int) -> None:
        y = self.x[:n]
        for w in self.attn:
            y = y @ w
        _ = y @ self.router

    def run(self, kernels: tuple[tuple[int, int], ...]) -> None:
        """One launch: for each ``(b, n)`` buffer ``b``'s expert FFN on ``n`` tokens, or (``b``
        = -1) the layer's non-expert projections and router on ``n`` tokens; in the plan, noted;
        in the replay, after the demand copies of its buffers, as one CUDA graph on a GPU (a
        layer's experts in ``layer`` execution: one launch instead of one per expert; at 100%
        capacity OLMoE took twice the GPU's time with a graph per expert, Python's launches
        being the bottleneck)."""
        if not kernels:
            return
        if self.plan:
            self.launches.add(kernels)
            return
        self._launch(kernels)

    def _launch(self, kernels: tuple[tuple[int, int], ...]) -> None:
        """:meth:`run` in the replay: after the buffers' demand copies, the launch's graph (or
        its kernels eagerly)."""
        for b, _ in kernels:
            arrived = self.arrived.pop(b, None)
            if arrived is not None:
                self.torch.cuda.current_stream().wait_event(arrived)
        graph = self.graphs.get(kernels)
        if graph is not None:
            graph()
            return
        for b, n in kernels:
            if b < 0:
                self._dense_eager(n)
            else:
                self._ffn_eager(b, n)

    def size(self, n: int) -> int:
        """Tokens a kernel runs on: at least one, at most the static input's rows."""
        return max(1, min(n, self.x.shape[0]))

    def prepare(self) -> None:
        """After the plan: make the spares it needs and, on CUDA, capture each of its launches
        as a CUDA graph (warmed up on a side stream first, as capture requires)."""
        torch = self.torch
        self.spares = [torch.empty_like(self.pool[0]) for _ in range(self.most_spares)]
        self.plan = False
        if self.device == "cuda" and self.use_graphs:
            kernels = sorted({k for launch in self.launches for k in launch})

            def each_kernel() -> None:
                for k in kernels:
                    self.run((k,))

            warm_up(each_kernel, times=1)
            mempool = torch.cuda.graph_pool_handle()
            for launch in sorted(self.launches):
                self.graphs[launch] = cuda_graph(lambda launch=launch: self.run(launch), mempool)
            if self.upload:
                for replay in self.graphs.values():
                    replay()
            torch.cuda.synchronize()
        self.reset()

    def _copy(self, b: int, key: int, background: bool) -> None:
        """Copy ``key``'s weights into buffer ``b``. On CUDA a copy starts once the compute
        stream has done what was launched before it (the buffer's previous expert may still be
        running; the simulator's copy starts at the decision's time, after that work):
        a demand copy on the demand-copy stream, whose event the expert's kernel waits for, so
        the next expert's copy overlaps this one's compute in per-expert execution (on one
        stream it could not); a prefetch on the copy worker's stream."""
        if self.plan:
            return
        dst, src, torch = self.buffer(b), self.host[key // self.p_num], self.torch
        if self.device != "cuda":
            if background:
                self.landing[key] = self.copier.submit(dst.copy_, src)
            else:
                dst.copy_(src)
            return
        after = torch.cuda.Event()
        after.record()  # the compute stream's work so far
        if not background and self.one_stream:
            dst.copy_(src, non_blocking=True)
            return
        if not background:
            with torch.cuda.stream(self.demand):
                self.demand.wait_event(after)
                dst.copy_(src, non_blocking=True)
                done = torch.cuda.Event()
                done.record()
            self.arrived[b] = done
            return
        side = self.side

        def job() -> None:
            with torch.cuda.stream(side):
                side.wait_event(after)
                dst.copy_(src, non_blocking=True)
            side.synchronize()

        self.landing[key] = self.copier.submit(job)

    def _landed(self, key: int) -> None:
        fut = self.landing.pop(key, None)
        if fut is not None:
            fut.result()  # a prefetch still in flight: wait for it

    def _ran(self, b: int) -> None:
        """Buffer ``b``'s expert has run: a spare is free again."""
        if b >= self.slots:
            self.spare_free.append(b)

    def perform(self, op: str, key: int, needed: dict[int, int], tokens: dict[int, int]) -> None:
        """Carry out one recorded decision (``Simulation.decisions``); ``needed`` maps the
        layer's experts to the buffers they will run from."""
        if op in self.tally:
            self.tally[op] += 1
        if op == "evict":
            self._landed(key)
            self.free.append(self.where.pop(key))
        elif op == "hit":
            self._landed(key)
            needed[key] = self.where[key]
        elif op in ("fetch", "prefetch"):
            slot = self.where[key] = self.free.pop()
            self._copy(slot, key, background=op == "prefetch")
            if op == "fetch":
                needed[key] = slot
        elif op == "bypass":  # an uncached fetch: a spare buffer until the expert has run
            if not self.spare_free:
                self.spare_free.append(self.slots + self.spare_used)
                self.spare_used += 1
                self.most_spares = max(self.most_spares, self.spare_used)
            b = needed[key] = self.spare_free.pop()
            self._copy(b, key, background=False)
        elif op == "withdraw":  # a queued prefetch withdrawn with its room: drop it if not begun
            fut = self.landing.pop(key, None)
            if fut is not None and not fut.cancel():
                fut.result()
            self.free.append(self.where.pop(key))
        elif key == -1:  # run: the layer's experts, all at once
            self.run(tuple((b, self.size(tokens.get(k, 1))) for k, b in needed.items()))
            for b in needed.values():
                self._ran(b)
            needed.clear()
        else:  # run: one expert
            b = needed.pop(key)
            self.run(((b, self.size(tokens.get(key, 1))),))
            self._ran(b)


def host_weights(torch: Any, experts: int, h: int, inter: int, device: str) -> Any:
    """Every expert's gate, up and down weights in host memory (pinned on CUDA; bf16 on a GPU,
    float32 on the CPU), made once per validation run and shared by its scenarios. The values
    are random normal (never zeros, which can run faster than real weights); to keep a
    13-GB model's set-up in seconds, up to 8 distinct random experts are drawn on the device
    and repeated (an expert's values do not change what copying or multiplying it costs)."""
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    host = torch.empty(experts, 3, h, inter, dtype=dt, pin_memory=device == "cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    distinct = [torch.randn(3, h, inter, generator=gen, dtype=torch.float32, device=device).to(dt)
                for _ in range(min(experts, 8))]
    for e in range(experts):
        host[e].copy_(distinct[e % len(distinct)])
    return host


def execute(scenario: Any, trace: Any, device: str = "cpu", host: Any = None, spread: int = 1,
            graphs: bool = True, upload: bool = False, one_stream: bool = False) -> dict[str, Any]:
    """Replay ``trace`` under ``scenario`` on ``device``; per-pass times and the decisions.
    The decisions are the simulator's own (the timed replay records them; its result is
    returned as ``predicted``), replayed op by op (:class:`_DevicePool`): no second copy of the
    miss -> evict -> insert logic.
    ``host`` is :func:`host_weights` for the trace's model (made here when not given);
    ``spread``, ``graphs``, ``upload`` and ``one_stream`` are diagnostics of :class:`_DevicePool` (the defaults are the
    validation's executor)."""
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
    mem: _DevicePool
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
        mem = _DevicePool(torch, host, slots, device, sim.num_prec, tokens, num_e, spread, graphs, upload, one_stream)

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
        for p in range(wl.num_passes):
            sync()
            t0 = time.perf_counter()
            forward(p)
            sync()
            times.append(time.perf_counter() - t0)
    mem.copier.shutdown(wait=True)
    link = getattr(mem, "link", None)
    return {"pass_s": np.asarray(times), "hits": mem.tally["hit"],
            "copies": mem.tally["fetch"] + mem.tally["bypass"] + mem.tally["prefetch"],
            "link_late_s": link.late if link is not None else 0.0,
            "misses": mem.tally["fetch"] + mem.tally["bypass"], "workload": wl, "predicted": predicted,
            "launches": mem.launches, "spares": mem.most_spares, "host": host}


def validate(profile: str, trace_path: str, scenarios: list[str], out_dir: str, device: str = "cpu",
             progress: Any = None,
             warn: Callable[[str], None] | None = None, overrides: list[str] | None = None,
             done: Callable[[dict[str, Any]], None] | None = None, launch: str = "auto") -> pd.DataFrame:
    """Measure and predict every scenario; write report.md, validation.parquet (a row per
    scenario), passes.parquet (a row per forward pass: measured and predicted seconds, so the
    error can be studied pass by pass) and a plot. ``overrides`` (``KEY=VALUE``) apply to every
    scenario (e.g. ``expert_compute=per-expert``). ``warn`` hears each :func:`shape_warnings`
    message before the measurements start (they also go into the report); ``done`` hears each
    scenario's row as it is finished."""

    from moesim.config.scenario import load_scenario
    from moesim.traces.io import read_trace

    trace = read_trace(trace_path)
    warnings = shape_warnings(profile, trace)
    if warn is not None:
        for w in warnings:
            warn(w)
    sets = [f"hardware.profile={profile}", f"workload.trace.path={Path(trace_path).resolve()}", *(overrides or [])]
    plain = [load_scenario(path, sets) for path in scenarios]
    graphs = [launch == "graphs" or (launch == "auto" and sc.expert_compute != "per-expert") for sc in plain]
    loaded = [executor_style(sc, path, sets, g)
              for sc, path, g in zip(plain, scenarios, graphs, strict=True)]  # every scenario checked before any is measured
    hosts: dict[tuple[bool, Any], Any] = {}  # the experts' host copies, made once per executor and precision
    rows, passes = [], []
    for i, (path, sc) in enumerate(zip(scenarios, loaded, strict=True)):
        if progress is not None:
            progress(i, len(scenarios))
        kind = (sc.execution.style == "hf-loop", sc.cache.precision)
        meas = execute(sc, trace, device, hosts.get(kind), graphs=graphs[i])
        hosts[kind] = meas["host"]
        pred = meas["predicted"]
        steps = pred.steps
        dec = (steps["phase"] == "decode").to_numpy()
        first = (steps["phase"] != "decode").to_numpy()
        m = meas["pass_s"]
        row = {"scenario": Path(path).stem, "capacity": sc.cache.capacity, "eviction": sc.policies.eviction.name,
               "model": pred.summary["model"], "expert_compute": sc.expert_compute,
               "prefetch": sc.policies.prefetch.name,
               "hits_sim": pred.summary["hits"] + pred.summary["late_prefetches"], "misses_sim": pred.summary["misses"],
               "hits_exec": meas["hits"], "misses_exec": meas["misses"],
               "tpot_measured_s": float(m[dec].mean()) if dec.any() else np.nan,
               "tpot_predicted_s": float(steps.loc[dec, "duration_s"].mean()) if dec.any() else np.nan,
               "ttft_measured_s": float(m[first].mean()) if first.any() else np.nan,
               "ttft_predicted_s": float(steps.loc[first, "duration_s"].mean()) if first.any() else np.nan}
        for k in ("tpot", "ttft"):
            row[f"{k}_ape"] = abs(row[f"{k}_predicted_s"] - row[f"{k}_measured_s"]) / row[f"{k}_measured_s"]
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


def executor_style(sc: Any, path: Any, sets: list[str], graphs: bool = True) -> Any:
    """``sc`` predicted with the executor's own host: a scenario without an execution style
    gets the executor's (``graph-per-expert`` in per-expert execution, else ``graph-layer``;
    with eager launches, ``eager-per-expert``, which models per-expert execution only)."""
    from moesim.config.scenario import load_scenario

    if not graphs and sc.expert_compute != "per-expert":
        raise MoesimError(f"calibrate validate --launch eager: {path} runs expert_compute={sc.expert_compute}; eager "
                          "launches are modelled in per-expert execution only (execution.style=eager-per-expert). "
                          "Add --set expert_compute=per-expert, or launch graphs.")
    if sc.execution.style != "none":
        return sc
    style = ("graph-per-expert" if graphs else "eager-per-expert") if sc.expert_compute == "per-expert" else "graph-layer"
    return load_scenario(path, [*sets, f"execution.style={style}"])


def repredict(table: pd.DataFrame, profile: str, traces: dict[str, str], graphs: bool = True) -> pd.DataFrame:
    """Today's predictions for a committed validation run (``validation.parquet``: its
    measured and recorded columns kept as they are): per scenario, the shipped
    ``validation/SCENARIO`` on the run's trace for its model (``traces``) and ``profile``,
    predicted without a host model (``none``) and with the executor's own style
    (:func:`executor_style`; ``graphs`` False: the executor launched eagerly), and whether today's hits and misses are the ones the executor
    performed (``same_decisions``; when not, the row measured other decisions)."""
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
        plain = load_scenario(path, sets)
        for name, sc in (("none", plain), ("host", executor_style(plain, path, sets, graphs))):
            res = Simulation(sc).run()
            steps = res.steps
            dec = (steps["phase"] == "decode").to_numpy()
            row[f"tpot_{name}_s"] = float(steps.loc[dec, "duration_s"].mean())
            row[f"ttft_{name}_s"] = float(steps.loc[~dec, "duration_s"].mean())
            if name == "none":
                s = res.summary
                row["same_decisions"] = bool((s["misses"], s["hits"] + s["late_prefetches"]) == (r["misses_exec"], r["hits_exec"]))
            else:
                row["style"] = sc.execution.style
        for k in ("tpot", "ttft"):
            for name in ("recorded", "none", "host"):
                row[f"{k}_ape_{name}"] = abs(row[f"{k}_{name}_s"] - row[f"{k}_measured_s"]) / row[f"{k}_measured_s"]
        rows.append(row)
    return pd.DataFrame(rows)


def repredicted_section(df: pd.DataFrame, command: str) -> str:
    """The report's section on a re-prediction (:func:`repredict`): the error per model and
    execution as recorded, today without a host model and today with the executor's host,
    over the rows whose decisions today are the executor's."""
    same = df[df["same_decisions"]]
    lines = ["## Re-predicted with the host model (issue 37)", "",
             f"`{command}` re-predicts every row with today's simulator and `profiles/h100.yaml` refitted with the "
             "host's time per CUDA call (`diagnostics/host_overhead.csv`: data disjoint from the rows judged here). "
             "The measured columns are the run's own. "
             f"{len(df) - len(same)} rows are left out: today's simulator makes other decisions there than the "
             "executor performed (issue 33). `recorded`: the prediction the run recorded; `none`: today, no host "
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
    _plot(df, out, device)

    def same(g: pd.DataFrame) -> bool:
        return bool(((g.hits_sim == g.hits_exec) & (g.misses_sim == g.misses_exec)).all())

    lines = [f"# Validation on {device} with profile `{profile}`", "",
             *[f"**Warning:** {w}\n" for w in warnings or []],
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
    write_text_atomic(out / "report.md", "\n".join(lines) + "\n")
    write_text_atomic(out / "summary.json", json.dumps({
        "tpot_median_ape": float(df["tpot_ape"].median()), "tpot_p95_ape": float(df["tpot_ape"].quantile(0.95)),
        "scenarios": len(df)}, indent=2))


def expand(patterns: list[str]) -> list[str]:
    """Scenario files from glob patterns; an empty match is an error."""
    out: list[str] = []
    for pat in patterns:
        hits = sorted(glob.glob(pat))
        if not hits:
            raise MoesimError(f"calibrate validate: --scenarios {pat} matches no file.")
        out.extend(hits)
    return out

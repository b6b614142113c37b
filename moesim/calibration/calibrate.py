"""Calibration: measure on the device, fit a hardware profile (``docs/design.md``:
"Calibration").

``measure`` runs PyTorch microbenchmarks — copies by size (host to device and back, pageable
and, on CUDA, pinned; device to device), expert FFN time (gate, up and down projections with
SiLU) by tokens and dtype for model shapes, attention (one query over a KV cache) by context
length, and per-launch overhead — with warm-up and repeats, keeping medians and the 10th/90th
percentiles. CUDA runs are timed with CUDA events, the compute kernels (expert FFN, non-expert
projections, attention) as CUDA graphs so that the time is the GPU's work and not the host's
dispatch of its kernels (on the H100 an OLMoE expert FFN took 19 us as a graph and 65-91 us
dispatched from Python); CPU runs with a monotonic clock. Every row
records the device, driver, CUDA and torch versions. On the CPU the same code runs ("host" and
"device" are both host memory there), to test the pipeline.

``fit`` turns the raw rows into a profile: per copy kind an affine model
``time = latency + bytes / bandwidth`` fitted by least squares over the copies of 1 MiB and up
(:func:`fit_link`), with its relative RMS residual;
expert and attention time tables (medians) interpolated log-linearly by the cost model; the
launch overhead; the host's time per CUDA call (``host``: graph replay, eager kernel launch,
copy submission, event record and waits), which execution styles add up
(:mod:`moesim.config.execution`). Scenarios use it with ``hardware: {profile: FILE}``.
"""

from __future__ import annotations

import datetime
import os
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from moesim.calibration.torchops import _torch, cuda_graph, expert_ffn, warm_up
from moesim.config.profile import PROFILE_VERSION, load_profile  # noqa: F401 - re-exported
from moesim.errors import MoesimError
from moesim.files import write_atomic, write_yaml_atomic

SHAPES = {  # hidden, expert intermediate
    "olmoe-1b-7b": (2048, 1024), "mixtral-8x7b": (4096, 14336), "qwen1.5-moe-a2.7b": (2048, 1408),
    "qwen3-30b-a3b": (2048, 768), "phi-3.5-moe": (4096, 6400),
}


def environment(device: str) -> dict[str, Any]:
    """Device, driver, CUDA and torch versions for every row."""
    torch = _torch()
    env = {"device": device, "torch": torch.__version__, "cuda": torch.version.cuda or "none",
           "driver": "none", "device_name": platform.processor() or platform.machine()}
    if device == "cuda":
        env["device_name"] = torch.cuda.get_device_name()
        try:
            import subprocess

            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=10).stdout.strip() or "unknown"
        except (OSError, subprocess.SubprocessError):
            env["driver"] = "unknown"
    return env


def _timer(device: str, fn: Any, warmup: int, repeats: int, graph: bool = False) -> list[float]:
    """Seconds per call of ``fn``: CUDA events around each call on CUDA (``graph``: around a
    replay of ``fn`` captured as a CUDA graph, so the time is the GPU's work without the host's
    dispatch between kernels), a monotonic clock on the CPU."""
    torch = _torch()
    if graph and device == "cuda":
        warm_up(fn)
        fn = cuda_graph(fn)
    for _ in range(warmup):
        fn()
    out = []
    if device == "cuda":
        torch.cuda.synchronize()
        for _ in range(repeats):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / 1e3)
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return out


def measure(device: str = "cpu", shapes: list[str] | None = None, quick: bool = False,
            progress: Any = None) -> pd.DataFrame:
    """Run the microbenchmarks; one row per (kind, size) with median and spread."""
    torch = _torch()
    if device == "cuda" and not torch.cuda.is_available():
        raise MoesimError("calibrate measure: --device cuda but no CUDA device is available; use --device cpu.")
    shapes = shapes or ["olmoe-1b-7b"]
    dims: dict[str, tuple[int, int]] = {}
    for name in shapes:
        if name in SHAPES:
            dims[name] = SHAPES[name]
        elif "x" in name and all(part.isdigit() for part in name.split("x", 1)):
            hh, ii = name.split("x", 1)
            dims[name] = (int(hh), int(ii))
        else:
            raise MoesimError(f"calibrate measure: unknown model shape '{name}'; valid: {', '.join(SHAPES)}, "
                              "or HIDDENxINTERMEDIATE (e.g. 256x512).")
    env = environment(device)
    if device == "cpu":
        # one intra-op thread: a copy split over threads waits at its join for the slowest, and
        # on a shared machine a descheduled thread costs a whole scheduler tick (~8 ms, seen
        # as the median of a 64 KiB copy), so the times would be the machine's load, not the copy
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return _measure(torch, device, dims, env, quick, progress)
        finally:
            torch.set_num_threads(threads)
    return _measure(torch, device, dims, env, quick, progress)


def _measure(torch: Any, device: str, dims: dict[str, tuple[int, int]], env: dict[str, Any], quick: bool,
             progress: Any) -> pd.DataFrame:
    """:func:`measure`'s microbenchmarks over the model shapes ``dims``."""
    shapes = list(dims)
    warmup, repeats = (1, 5) if quick else (3, 15)
    rows: list[dict[str, Any]] = []

    def add(kind: str, times: list[float], **kw: Any) -> None:
        arr = np.asarray(times)
        timing = "clock" if device != "cuda" else "cuda-graph" if kind in ("expert", "dense", "attention") else "events"
        rows.append({"kind": kind, "median_s": float(np.median(arr)), "p10_s": float(np.percentile(arr, 10)),
                     "p90_s": float(np.percentile(arr, 90)), "repeats": len(arr), "timing": timing, **kw, **env})

    sizes = [2 ** e for e in range(10, 25 if quick else 31, 2)]  # 1 KiB .. 16 MiB (quick) / 1 GiB
    kinds = ["pageable"] + (["pinned"] if device == "cuda" else [])
    steps = len(sizes) * (2 * len(kinds) + 1) + len(shapes) * 2
    done = 0
    for n in sizes:
        dev = torch.empty(n, dtype=torch.uint8, device=device)
        for mem in kinds:
            host = torch.empty(n, dtype=torch.uint8, pin_memory=(mem == "pinned"))
            nb = mem == "pinned"
            add("copy", _timer(device, lambda d=dev, h=host, nb=nb: d.copy_(h, non_blocking=nb), warmup, repeats),
                direction="h2d", memory=mem, bytes=n)
            add("copy", _timer(device, lambda d=dev, h=host, nb=nb: h.copy_(d, non_blocking=nb), warmup, repeats),
                direction="d2h", memory=mem, bytes=n)
            done += 2
        other = torch.empty(n, dtype=torch.uint8, device=device)
        add("copy", _timer(device, lambda o=other, d=dev: o.copy_(d), warmup, repeats), direction="d2d",
            memory="device", bytes=n)
        done += 1
        if progress is not None:
            progress(done, steps)
    dtypes = ["float32"] if device == "cpu" else ["bfloat16", "float16"]
    tokens = [1, 4, 16, 64] if quick else [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    for shape in shapes:
        hidden, inter = dims[shape]
        if quick and shape in SHAPES:  # CI-sized: shrink a named shape, keep the ratio
            hidden, inter = max(64, hidden // 16), max(64, inter // 16)
        for dt in dtypes:
            tdt = getattr(torch, dt)
            wg = torch.randn(hidden, inter, dtype=tdt, device=device)
            wu = torch.randn(hidden, inter, dtype=tdt, device=device)
            wd = torch.randn(inter, hidden, dtype=tdt, device=device)
            for t in tokens:
                x = torch.randn(t, hidden, dtype=tdt, device=device)
                add("expert", _timer(device, lambda x=x, wg=wg, wu=wu, wd=wd: expert_ffn(x, wg, wu, wd),
                                     warmup, repeats, graph=True), shape=shape, hidden=hidden, intermediate=inter, dtype=dt,
                    tokens=t)
            # the non-expert part of a layer: q, k, v, o projections and the router
            proj = torch.randn(4, hidden, hidden, dtype=tdt, device=device) / hidden ** 0.5
            rw = torch.randn(hidden, 64, dtype=tdt, device=device)

            def dense(x: Any, proj: Any = proj, rw: Any = rw) -> Any:
                y = x
                for w in proj:
                    y = y @ w
                return y @ rw

            for t in tokens:
                x = torch.randn(t, hidden, dtype=tdt, device=device)
                add("dense", _timer(device, lambda x=x: dense(x), warmup, repeats, graph=True), shape=shape, hidden=hidden,
                    dtype=dt, tokens=t)
        done += 1
        heads, hd = max(1, hidden // 128), 128 if not quick else 32
        for ctx in ([128, 512, 2048] if quick else [128, 512, 2048, 8192, 32768]):
            q = torch.randn(1, heads, 1, hd, device=device)
            k = torch.randn(1, heads, ctx, hd, device=device)
            v = torch.randn(1, heads, ctx, hd, device=device)
            add("attention", _timer(device, lambda q=q, k=k, v=v: torch.nn.functional.scaled_dot_product_attention(q, k, v),
                                    warmup, repeats, graph=True), shape=shape, hidden=hidden, context=ctx, dtype="float32")
        done += 1
        if progress is not None:
            progress(done, steps)
    tiny = torch.zeros(1, device=device)
    add("launch", _timer(device, lambda: tiny.add_(1), warmup, repeats * 4))
    if device == "cuda":
        for name, times in host_call_times(torch, repeats=5 if quick else 9).items():
            add("host", times, call=name)
    df = pd.DataFrame(rows)
    df["measured_at"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return df


# the host's CUDA calls that execution styles add up (moesim.config.execution): the name a
# measurement carries (raw 'call' column; tools/gpu_diagnostics.py host-calls's CSV) -> the profile's
# host key and how many calls the measurement makes
HOST_CALLS = {"graph replay": ("graph_launch_us", 1), "ffn eager (5 kernels)": ("eager_kernel_us", 5),
              "h2d copy dispatch (4 KiB pinned)": ("copy_submit_us", 1),
              "event made + recorded": ("event_record_us", 1),
              "stream switch + wait_event": ("stream_wait_us", 1),
              "wait_event on the current stream": ("event_wait_us", 1)}
# the calibration executor's own Python around its eager launches (DevicePool, module
# moesim.calibration.executor), measured since the H100 eager runs; a profile without them uses
# eager_kernel_us times the kernels (moesim.config.execution)
EXECUTOR_CALLS = {"executor layer, eager": ("eager_layer_us", 1),
                  "executor expert, eager (hit + run)": ("eager_expert_us", 1)}
HOST_BATCH = 2000  # calls per timing


def _executor_calls(torch: Any, h: int, inter: int, device: str = "cuda") -> tuple[Any, Any]:
    """The calibration executor's host work at 100% capacity in per-expert execution with eager
    launches (:class:`moesim.calibration.executor.DevicePool`, as ``calibrate validate --launch
    eager`` replays it): a layer's start and its non-expert part on one token, and one cached
    expert's ``hit`` and ``run`` decisions (the pool's bookkeeping and the FFN's 5 kernels).
    ``validation/h100/eager/call1/profile.yaml`` measured them before the pool's main-thread
    prefetch queue existed, ``call3/profile3.yaml`` with it (two checks of an empty queue per
    decision)."""
    from moesim.calibration.executor import DevicePool

    host = torch.randn(1, 3, h, inter, dtype=torch.float32)  # the executor's dtype: bf16 on a GPU, float32 on the CPU
    host = host.to(torch.bfloat16) if device == "cuda" else host
    pool = DevicePool(torch, host.pin_memory() if device == "cuda" else host, 1, device, 1, 1, 64, graphs=False)
    pool.prepare()
    pool.perform("fetch", 0, {}, {})
    if device == "cuda":
        torch.cuda.synchronize()
    tokens = {0: 1}

    def layer() -> None:
        pool.begin_layer(0, 0)
        pool.run(((-1, pool.size(1)),))

    def expert() -> None:
        needed: dict[int, int] = {}
        pool.perform("hit", 0, needed, tokens)
        pool.perform("run", 0, needed, tokens)

    return layer, expert


def executor_host_us(torch: Any, h: int, inter: int, device: str, batch: int = 500,
                     repeats: int = 3) -> dict[str, float]:
    """The eager executor's host time now, microseconds: the median over ``repeats`` timings of
    up to ``batch`` calls each (as many as take about 20 ms, after a warm-up) of
    :func:`_executor_calls`' layer and cached expert, for a model of hidden size ``h`` and expert
    intermediate size ``inter`` (``calibrate validate --host-beside`` takes them before each
    scenario, so its prediction has the host's speed of that moment): ``eager_layer_us`` and
    ``eager_expert_us``."""
    layer, expert = _executor_calls(torch, h, inter, device)
    out = {}
    for key, fn in (("eager_layer_us", layer), ("eager_expert_us", expert)):
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        n = max(1, min(batch, int(0.02 / max((time.perf_counter() - t0) / 3, 1e-9))))
        for _ in range(min(n, 50)):
            fn()
        times = []
        for _ in range(repeats):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            times.append((time.perf_counter() - t0) / n)
        out[key] = float(np.median(times)) * 1e6
    if device == "cuda":
        torch.cuda.synchronize()
    return out


def host_call_times(torch: Any, repeats: int = 9) -> dict[str, list[float]]:
    """Seconds of host time per CUDA call, for each of :data:`HOST_CALLS`: ``repeats`` timings of
    2,000 calls each with a monotonic clock on the host and no synchronisation inside (what the
    thread pays to issue the call, not what the GPU does), after a warm-up. The calls are the
    calibration executor's (:mod:`moesim.calibration.validate`): a CUDA graph replay of an OLMoE
    expert FFN, the same FFN's five kernels launched eagerly, a 4 KiB host-to-device copy from
    pinned memory (the GPU's part negligible), an event made and recorded, a switch to another
    stream with a wait on an event, a wait on the current stream."""
    h, inter = SHAPES["olmoe-1b-7b"]
    w = torch.randn(3, h, inter, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(1, h, dtype=torch.bfloat16, device="cuda")

    def ffn() -> None:
        expert_ffn(x, w[0], w[1], w[2].T)

    warm_up(ffn)
    replay = cuda_graph(ffn)
    host = torch.empty(4096, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(4096, dtype=torch.uint8, device="cuda")
    other = torch.cuda.Stream()
    ev = torch.cuda.Event()
    ev.record()

    def switch_and_wait() -> None:
        with torch.cuda.stream(other):
            other.wait_event(ev)

    layer, expert = _executor_calls(torch, h, inter)
    calls = {"graph replay": replay, "ffn eager (5 kernels)": ffn,
             "executor layer, eager": layer, "executor expert, eager (hit + run)": expert,
             "h2d copy dispatch (4 KiB pinned)": lambda: dev.copy_(host, non_blocking=True),
             "event made + recorded": lambda: torch.cuda.Event().record(),
             "stream switch + wait_event": switch_and_wait,
             "wait_event on the current stream": lambda: torch.cuda.current_stream().wait_event(ev)}
    out: dict[str, list[float]] = {}
    for name, fn in calls.items():
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(HOST_BATCH):
                fn()
            times.append((time.perf_counter() - t0) / HOST_BATCH)
            torch.cuda.synchronize()
        out[name] = times
    return out


def host_section(calls: dict[str, float], source: str) -> dict[str, float]:
    """The profile's ``host`` section from microseconds per measured call (names of
    :data:`HOST_CALLS`, every one of which must be there, and of :data:`EXECUTOR_CALLS`, taken
    where measured; others, such as a tool's sums, are ignored)."""
    missing = [name for name in HOST_CALLS if name not in calls]
    if missing:
        raise MoesimError(f"calibrate fit: {source} lacks the host call(s) {', '.join(repr(m) for m in missing)}; "
                          "measure them with `moesim calibrate measure --device cuda` (or tools/gpu_diagnostics.py host-calls).")
    out = {}
    for name, (key, n) in {**HOST_CALLS, **{k: v for k, v in EXECUTOR_CALLS.items() if k in calls}}.items():
        us = float(calls[name])
        if not (np.isfinite(us) and us >= 0):
            raise MoesimError(f"calibrate fit: {source}: host call {name!r} has {us!r} us; it must be a "
                              "non-negative number. Measure again.")
        out[key] = round(us / n, 4)
    return out


def read_host_costs(path: str) -> dict[str, float]:
    """A host-cost CSV (``call,host_us``, as ``tools/gpu_diagnostics.py host-calls`` writes it):
    microseconds per call by name. A call's name may hold commas (the tool writes them
    unquoted), so each line splits at its last comma, which a CSV reader cannot do. Errors
    name the file, the line and the fix."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise MoesimError(f"calibrate fit: --host-costs {path} is not a readable text file ({exc}).") from None
    if not lines or lines[0].strip() != "call,host_us":
        raise MoesimError(f"calibrate fit: --host-costs {path} must start with the header call,host_us; "
                          "write it with tools/gpu_diagnostics.py host-calls.")
    out = {}
    for n, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        name, _, value = line.rpartition(",")
        try:
            out[name] = float(value)
        except ValueError:
            raise MoesimError(f"calibrate fit: --host-costs {path}, line {n}: {line!r} does not end in a number of "
                              "microseconds; fix or drop that line.") from None
    return out


def write_parquet_atomic(df: pd.DataFrame, path: str | os.PathLike[str]) -> Path:
    """Raw measurements as Parquet, atomically."""
    return write_atomic(path, lambda tmp: df.to_parquet(tmp, index=False), suffix=".parquet")


LINK_FIT_MIN_BYTES = 1 << 20  # copies from 1 MiB up: the sizes experts have (OLMoE's are 12.6 MB)


def fit_link(sizes: np.ndarray, seconds: np.ndarray) -> tuple[float, float, float, int]:
    """Least squares ``t = latency + bytes / bandwidth``: (bandwidth GB/s, latency us, rel. RMS,
    copies fitted), relative error, over the copies of at least :data:`LINK_FIT_MIN_BYTES` (all of them when
    fewer than three are that large). Below about 1 MiB a measured copy takes a flat ~20 us on
    an H100 (the host's dispatch of the copy, which in a replay overlaps the previous copy), so
    an affine fit through them understates the time of an expert-sized copy: on the H100 the
    fit over all sizes gave 59.6 GB/s where copies of 16 MiB-1 GiB ran at 53.3-54.8 GB/s."""
    big = sizes >= LINK_FIT_MIN_BYTES
    if int(big.sum()) >= 3:
        sizes, seconds = sizes[big], seconds[big]
    a = np.stack([np.ones_like(sizes, dtype=float), sizes.astype(float)], axis=1)
    w = 1.0 / np.maximum(seconds, 1e-12)  # relative error: a 1 MiB copy matters as much as a 1 GiB one
    coef, *_ = np.linalg.lstsq(a * w[:, None], seconds * w, rcond=None)
    latency, inv_bw = float(coef[0]), float(coef[1])
    if inv_bw <= 0:
        raise MoesimError("calibrate fit: copy times do not grow with size; the measurements are unusable.")
    pred = latency + inv_bw * sizes
    rel = float(np.sqrt(np.mean(((pred - seconds) / seconds) ** 2)))
    return 1.0 / inv_bw / 1e9, max(latency, 0.0) * 1e6, rel, len(sizes)


# the columns each kind of measurement needs (besides kind and median_s)
RAW_COLUMNS = {"copy": ("direction", "memory", "bytes"), "expert": ("shape", "dtype", "tokens", "hidden", "intermediate"),
               "dense": ("shape", "dtype", "tokens", "hidden"), "attention": ("shape", "context")}


def _check_raw(raw: pd.DataFrame, source: str) -> None:
    """Refuse a raw file with missing columns or unusable times, naming the column or row."""
    missing = [c for c in ("kind", "median_s") if c not in raw.columns]
    if missing:
        raise MoesimError(f"calibrate fit: {source} lacks column(s) {', '.join(missing)}, so it is not a "
                          "`moesim calibrate measure` file; measure again with `moesim calibrate measure`.")
    for kind, cols in RAW_COLUMNS.items():
        lack = [c for c in cols if c not in raw.columns]
        if (raw["kind"] == kind).any() and lack:
            raise MoesimError(f"calibrate fit: {source}: its {kind} rows need column(s) {', '.join(lack)}; "
                              "measure again with `moesim calibrate measure`.")
    t = pd.to_numeric(raw["median_s"], errors="coerce").to_numpy(dtype=float)
    bad = np.flatnonzero(~np.isfinite(t) | (t <= 0))
    if bad.size:
        i = int(bad[0])
        what = "NaN" if np.isnan(t[i]) else repr(raw["median_s"].iloc[i])
        raise MoesimError(f"calibrate fit: {source}: row {i} ({raw['kind'].iloc[i]}) has median_s {what}; every "
                          f"time must be a positive number ({bad.size} row(s) are not). Drop those rows or measure again.")


def fit(raw: pd.DataFrame, source: str = "<raw>", host_costs: dict[str, float] | None = None,
        host_source: str = "--host-costs") -> dict[str, Any]:
    """A profile from raw measurements (see module docstring). The ``host`` section comes from
    the raw file's host rows (median per call), else from ``host_costs`` (microseconds per
    call, :func:`read_host_costs`); without either the profile has none (scenarios then use
    the hardware's default host costs)."""
    _check_raw(raw, source)
    copies = raw[raw["kind"] == "copy"]
    if copies.empty:
        raise MoesimError(f"calibrate fit: {source} has no copy measurements.")
    links: dict[str, Any] = {}
    for (direction, mem), grp in copies.groupby(["direction", "memory"]):
        bw, lat, rel, used = fit_link(grp["bytes"].to_numpy(dtype=float), grp["median_s"].to_numpy(dtype=float))
        links[f"{direction}_{mem}"] = {"bandwidth_gbps": round(bw, 4), "latency_us": round(lat, 4),
                                       "rel_rms_residual": round(rel, 4), "points": used}
    experts: dict[str, Any] = {}
    exp_rows = raw[raw["kind"] == "expert"] if {"shape", "dtype", "tokens"} <= set(raw.columns) else raw.iloc[:0]
    for (shape, dt), grp in (exp_rows.groupby(["shape", "dtype"]) if len(exp_rows) else []):
        grp = grp.sort_values("tokens")
        experts.setdefault(shape, {})[dt] = {
            "hidden": int(grp["hidden"].iloc[0]), "intermediate": int(grp["intermediate"].iloc[0]),
            "tokens": grp["tokens"].astype(int).tolist(), "seconds": grp["median_s"].round(9).tolist()}
    dense: dict[str, Any] = {}
    dense_rows = raw[raw["kind"] == "dense"] if {"shape", "dtype", "tokens"} <= set(raw.columns) else raw.iloc[:0]
    for (shape, dt), grp in (dense_rows.groupby(["shape", "dtype"]) if len(dense_rows) else []):
        grp = grp.sort_values("tokens")
        dense.setdefault(shape, {})[dt] = {"hidden": int(grp["hidden"].iloc[0]),
                                           "tokens": grp["tokens"].astype(int).tolist(),
                                           "seconds": grp["median_s"].round(9).tolist()}
    attention: dict[str, Any] = {}
    att_rows = raw[raw["kind"] == "attention"] if {"shape", "context"} <= set(raw.columns) else raw.iloc[:0]
    for shape, grp in (att_rows.groupby("shape") if len(att_rows) else []):
        grp = grp.sort_values("context")
        attention[shape] = {"context": grp["context"].astype(int).tolist(), "seconds": grp["median_s"].round(9).tolist()}
    launch = raw[raw["kind"] == "launch"]["median_s"]
    first = raw.iloc[0]
    host_rows = raw[raw["kind"] == "host"] if "call" in raw.columns else raw.iloc[:0]
    host = None
    if len(host_rows):
        host = host_section({str(c): float(g.median()) * 1e6 for c, g in host_rows.groupby("call")["median_s"]}, source)
    elif host_costs is not None:
        host = host_section(host_costs, host_source)
    extra = {"host": host} if host is not None else {}
    return {
        "profile_version": PROFILE_VERSION,
        "measured_on": {k: str(first.get(k, "")) for k in ("device", "device_name", "driver", "cuda", "torch", "measured_at")},
        "links": links,
        "expert_time": experts,
        "nonexpert_time": dense,
        "attention_time": attention,
        "launch_overhead_us": round(float(launch.median()) * 1e6, 4) if len(launch) else None,
        **extra,
    }


RESIDUAL_LIMIT = 0.10  # a link fit whose relative RMS residual exceeds this is flagged


def fit_warnings(profile: dict[str, Any]) -> list[str]:
    """What in a fitted profile a person should not trust blindly: link fits that miss their
    points by more than 10% RMS (an affine latency + bytes/bandwidth model does not describe
    the measurements; often pageable copies with a staging buffer, or noise)."""
    out = []
    for name, link in profile["links"].items():
        if link["rel_rms_residual"] > RESIDUAL_LIMIT:
            out.append(f"link {name}: the affine fit misses the measurements by {link['rel_rms_residual']:.0%} "
                       f"(relative RMS over {link['points']} sizes), more than {RESIDUAL_LIMIT:.0%}; its bandwidth and "
                       "latency are rough. Measure again (pinned memory on a GPU, fewer other jobs), or check the "
                       "raw times by size.")
    return out


def write_profile(profile: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write a hardware profile as YAML atomically."""
    return write_yaml_atomic(profile, path)

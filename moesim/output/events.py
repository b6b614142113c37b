"""One run's timeline as a Chrome trace (``moesim run --events FILE``), which Perfetto and
chrome://tracing open. Times are in microseconds of simulated time.

- A process per GPU with a *compute stream* thread: per layer its non-expert part, the wait
  for experts and the expert compute (with ``expert_compute: on-arrival`` or ``per-expert`` a
  layer's waits are drawn as one block before its expert compute); with expert parallelism
  each GPU's attention, all-to-all dispatch, experts, wait for the slowest GPU and combine.
- A *copy engine* thread for the host link: each transfer, told apart by its name — demand
  fetch, prefetch, or promoted prefetch (a prefetch a layer needed while it was still queued)
  — and each withdrawn prefetch as an instant event.
- Counter tracks: the cache's occupancy at each routing point (GB), the link busy (0 or 1) and
  the bytes in flight (MB: issued and not yet arrived or withdrawn).
- Flow arrows from each copy a layer waited for (a demand fetch, a promoted prefetch, or a
  prefetch still in flight at the layer's routing point) to that layer's expert compute.

Only the passes the run recorded are drawn (``moesim run --events-passes``, 8 by default).

Serving under load (:func:`serving_trace`) draws the forward passes and the requests instead:
the GPU's passes (prefill or decode, with their tokens, requests, hits and misses) and a track
per request with its queueing, prefill and decode (the kernel that serves records no copies).
"""

from __future__ import annotations

import bisect
import json
import os
from pathlib import Path
from typing import Any

from moesim.output.results import Result

NAMES = {"demand": "demand fetch", "prefetch": "prefetch", "promoted": "promoted prefetch"}


def _meta(pid: int, tid: int | None, kind: str, name: str) -> dict[str, Any]:
    ev: dict[str, Any] = {"name": kind, "ph": "M", "pid": pid, "args": {"name": name}}
    if tid is not None:
        ev["tid"] = tid
    return ev


def chrome_trace(result: Result, link: str, num_experts: int, num_precisions: int) -> dict[str, Any]:
    """The ``traceEvents`` document for ``result`` (run with transfers and layers recorded)."""
    extra = result.extra
    events: list[dict[str, Any]] = []

    def span(name: str, pid: int, tid: int, start: float, end: float, args: dict[str, Any]) -> None:
        if end > start:
            events.append({"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": start * 1e6,
                           "dur": (end - start) * 1e6, "args": args})

    def where(key: int) -> dict[str, int]:
        base = key // num_precisions
        return {"layer": base // num_experts, "expert": base % num_experts}

    ep = extra.get("ep_layers") or []
    gpus = sorted({g for _, _, g, *_ in ep}) or [0]
    for g in gpus:
        events.append(_meta(g, None, "process_name", f"GPU {g}"))
        events.append(_meta(g, 0, "thread_name", "compute stream"))
    if not ep:
        events.append(_meta(0, 1, "thread_name", f"copy engine {link}"))
    layers = extra.get("layers") or []
    phase = result.steps["phase"].astype(str).tolist()
    for p, layer, t0, t_route, t_experts, t_end in layers:
        args = {"pass": p, "phase": phase[p], "layer": layer}
        span(f"L{layer} attention+gate", 0, 0, t0, t_route, args)
        span(f"L{layer} wait for experts", 0, 0, t_route, t_experts, args)
        span(f"L{layer} experts", 0, 0, t_experts, t_end, args)
    for p, layer, g, t0, t_dispatch, t_exp, t_gpu_end, t_end in ep:
        args = {"pass": p, "phase": phase[p], "layer": layer, "gpu": g}
        a2a = t_exp - t_dispatch
        span(f"L{layer} attention+gate", g, 0, t0, t_dispatch, args)
        span(f"L{layer} all-to-all dispatch", g, 0, t_dispatch, t_exp, args)
        span(f"L{layer} experts", g, 0, t_exp, t_gpu_end, args)
        span(f"L{layer} wait for slowest GPU", g, 0, t_gpu_end, t_end - a2a, args)
        span(f"L{layer} all-to-all combine", g, 0, t_end - a2a, t_end, args)
    copies = result.transfers or []
    for key, kind, issued, start, done, nbytes in copies:
        span(NAMES[kind], 0, 1, start, done, {**where(key), "kind": kind, "issued_us": issued * 1e6,
                                              "MB": nbytes / 1e6})
    for key, issued, at, _nbytes in extra.get("withdrawn") or []:
        events.append({"name": "withdrawn prefetch", "ph": "i", "s": "t", "pid": 0, "tid": 1, "ts": at * 1e6,
                       "args": {**where(key), "issued_us": issued * 1e6}})
    events.extend(_counters(extra, copies))
    events.extend(_flows(layers, copies, num_experts, num_precisions))
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"recorded_passes": extra.get("recorded_passes"), "link": link}}


def _counters(extra: dict[str, Any], copies: list[tuple[int, str, float, float, float, int]]) -> list[dict[str, Any]]:
    """Cache occupancy (GB), link busy (0/1) and bytes in flight (MB) as counter events."""
    out: list[dict[str, Any]] = []
    for t, used in extra.get("occupancy") or []:
        out.append({"name": "cache occupancy (GB)", "ph": "C", "pid": 0, "ts": t * 1e6,
                    "args": {"GB": used / 1e9}})
    busy: list[tuple[float, int]] = []
    flight: list[tuple[float, int]] = []
    for _key, _kind, issued, start, done, nbytes in copies:
        busy += [(start, 1), (done, -1)]
        flight += [(issued, nbytes), (done, -nbytes)]
    for _key, issued, at, nbytes in extra.get("withdrawn") or []:
        flight += [(issued, nbytes), (at, -nbytes)]
    for name, unit, changes, scale in (("link busy", "busy", busy, 1.0), ("bytes in flight (MB)", "MB", flight, 1e-6)):
        level = 0
        for t, d in sorted(changes, key=lambda c: (c[0], c[1])):
            level += d
            out.append({"name": name, "ph": "C", "pid": 0, "ts": t * 1e6, "args": {unit: level * scale}})
    return out


def _flows(layers: list[tuple[int, int, float, float, float, float]],
           copies: list[tuple[int, str, float, float, float, int]], num_experts: int,
           num_precisions: int) -> list[dict[str, Any]]:
    """An arrow from each copy to the layer of its expert that waited for it: the first run of
    that layer index whose experts start at or after the copy's arrival and whose routing
    point came before it (a copy that arrived before the routing point made nobody wait)."""
    by_layer: dict[int, list[tuple[float, float]]] = {}
    for _p, layer, _t0, t_route, t_experts, _t_end in layers:
        by_layer.setdefault(layer, []).append((t_experts, t_route))
    for runs in by_layer.values():
        runs.sort()
    out: list[dict[str, Any]] = []
    fid = 0
    for key, _kind, _issued, start, done, _nbytes in copies:
        layer = key // num_precisions // num_experts
        runs = by_layer.get(layer, [])
        i = bisect.bisect_left(runs, (done, float("-inf")))
        if i == len(runs) or runs[i][1] > done:
            continue
        fid += 1
        t_experts = runs[i][0]
        out.append({"name": "needed by", "cat": "copy", "ph": "s", "id": fid, "pid": 0, "tid": 1,
                    "ts": (start + done) / 2 * 1e6})
        out.append({"name": "needed by", "cat": "copy", "ph": "f", "id": fid, "pid": 0, "tid": 0,
                    "ts": t_experts * 1e6})  # binds to the next slice: the layer's expert compute
    return out


def write_events(doc: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write the trace JSON atomically."""
    from moesim.files import write_atomic

    def dump(tmp: str) -> None:
        with open(tmp, "w") as fh:
            json.dump(doc, fh, separators=(",", ":"))

    return write_atomic(path, dump)


def serving_trace(result: Result, passes: int, link: str, num_experts: int, num_precisions: int) -> dict[str, Any]:
    """The timeline of a run serving under load: :func:`chrome_trace`'s compute stream and
    copy engine, a *forward passes* track (each pass named by its phase, its tokens,
    requests, hits, misses and stall as arguments) and a track per request — *queued* from
    its arrival to its first pass, *prefill* to its first token, *decode* to its last — for
    the first ``passes`` passes (0: all; the replay recorded as many) and the requests that
    arrive before the last of them ends."""
    doc = chrome_trace(result, link, num_experts, num_precisions)
    steps, req = result.steps, result.requests
    shown = steps if not passes else steps.iloc[:passes]
    until = float(shown["end_s"].max())
    events: list[dict[str, Any]] = [_meta(0, 2, "thread_name", "forward passes"),
                                    _meta(1, None, "process_name", "requests")]
    for r in shown.to_dict("records"):
        events.append({"name": str(r["phase"]), "ph": "X", "pid": 0, "tid": 2, "ts": r["start_s"] * 1e6,
                       "dur": r["duration_s"] * 1e6,
                       "args": {k: (float(r[k]) if k == "stall_s" else int(r[k])) for k in
                                ("pass", "tokens", "requests", "generated", "hits", "misses", "stall_s")}})
    here = req[req["arrival_s"] <= until]
    for r in here.to_dict("records"):
        tid = int(r["request"])
        events.append(_meta(1, tid, "thread_name", f"request {tid}"))
        for name, a, b in (("queued", r["arrival_s"], r["scheduled_s"]), ("prefill", r["scheduled_s"], r["first_token_s"]),
                           ("decode", r["first_token_s"], r["finish_s"])):
            if b > a:
                events.append({"name": name, "ph": "X", "pid": 1, "tid": tid, "ts": a * 1e6, "dur": (b - a) * 1e6,
                               "args": {"prompt_tokens": int(r["prompt_tokens"]),
                                        "output_tokens": int(r["output_tokens"])}})
    doc["traceEvents"].extend(events)
    doc["otherData"].update(passes=len(shown), requests=len(here))
    return doc

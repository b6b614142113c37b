"""One run's timeline as a Chrome trace (``moesim run --events FILE``), which Perfetto and
chrome://tracing open: the compute stream (per layer: non-expert, waiting for experts,
expert compute) and the host link's copy engine (each transfer, demand or prefetch) as
tracks. With ``expert_compute: on-arrival`` or ``per-expert`` a layer's waits are drawn as one block before
its expert compute. Times are in microseconds of simulated time.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from simulator.engine import Result


def chrome_trace(result: Result, link: str, num_experts: int, num_precisions: int) -> dict[str, Any]:
    """The ``traceEvents`` document for ``result`` (run with transfers and layers recorded)."""
    events: list[dict[str, Any]] = [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "compute stream"}},
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": 1, "args": {"name": f"copy engine {link}"}},
    ]

    def span(name: str, tid: int, start: float, end: float, args: dict[str, Any]) -> None:
        if end > start:
            events.append({"name": name, "ph": "X", "pid": 0, "tid": tid, "ts": start * 1e6,
                           "dur": (end - start) * 1e6, "args": args})

    for p, layer, t0, t_route, t_experts, t_end in result.extra.get("layers") or []:
        args = {"pass": p, "layer": layer}
        span(f"L{layer} attention+gate", 0, t0, t_route, args)
        span(f"L{layer} wait for experts", 0, t_route, t_experts, args)
        span(f"L{layer} experts", 0, t_experts, t_end, args)
    for key, prio, issued, start, done in result.transfers or []:
        base = key // num_precisions
        span("demand fetch" if prio == 0 else "prefetch", 1, start, done,
             {"layer": base // num_experts, "expert": base % num_experts, "issued_us": issued * 1e6})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_events(doc: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write the trace JSON atomically."""
    from simulator.atomic import write_atomic

    def dump(tmp: str) -> None:
        with open(tmp, "w") as fh:
            json.dump(doc, fh)

    return write_atomic(path, dump)

"""What ``moesim trace info`` reports: model, counts, phases, per-layer expert popularity."""

from __future__ import annotations

from typing import Any

import numpy as np

from moesim.traces.schema import PHASE_CODES
from moesim.traces.stats import trace_stats
from moesim.traces.trace import Trace


def layer_popularity(trace: Trace) -> list[dict[str, Any]]:
    """Per layer: selections, experts used, top-1 share, top experts, normalised entropy."""
    num_e = trace.model.num_experts
    rows: list[dict[str, Any]] = []
    for layer in range(trace.model.num_layers):
        sel = trace.experts[trace.layer == layer].reshape(-1)
        if sel.size == 0:
            rows.append({"layer": layer, "selections": 0})
            continue
        counts = np.bincount(sel.astype(np.int64), minlength=num_e)
        share = counts / counts.sum()
        nz = share[share > 0]
        top = np.argsort(-counts, kind="stable")[:3]
        rows.append({
            "layer": layer,
            "selections": int(counts.sum()),
            "experts_used": int((counts > 0).sum()),
            "top_experts": [(int(e), float(share[e])) for e in top],
            "max_share": float(share.max()),
            "entropy": float(-(nz * np.log(nz)).sum() / np.log(num_e)) if num_e > 1 else 1.0,
        })
    return rows


def trace_info(trace: Trace) -> dict[str, Any]:
    """A dict summary of a trace (printed by the CLI, usable from notebooks)."""
    phases = {name: int((trace.phase == code).sum()) for name, code in PHASE_CODES.items()}
    per_phase_tokens = {}
    for name, code in PHASE_CODES.items():
        m = trace.phase == code
        if m.any():
            keys = np.stack([trace.request[m], trace.step[m], trace.position[m]], axis=1)
            per_phase_tokens[name] = int(np.unique(keys, axis=0).shape[0])
    stats_phase = ("decode",) if phases["decode"] else tuple(p for p, n in phases.items() if n)
    return {
        "source": trace.source,
        "model": trace.model.to_dict(),
        "capture": trace.capture,
        "rows": len(trace),
        "requests": trace.num_requests,
        "steps": trace.num_steps(),
        "tokens": trace.num_tokens(),
        "layers_present": int(np.unique(trace.layer).size),
        "rows_by_phase": phases,
        "tokens_by_phase": per_phase_tokens,
        "optional_columns": [c for c in ("node", "parent", "accepted", "probs", "pred_next", "pred_quasi")
                             if getattr(trace, c) is not None],
        "routing_stats": {"phases": list(stats_phase), **trace_stats(trace, stats_phase)},
        "layers": layer_popularity(trace),
    }

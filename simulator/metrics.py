"""Summary metrics, derived from the per-pass rows (never from parallel counters).

Definitions (names as in ``docs/design.md``; README "Metrics" repeats them):

- ``hits``: expert accesses that found the expert resident on the GPU. An *expert access*
  is one distinct expert needed by one layer of one forward pass.
- ``misses``: accesses that found the expert absent (neither resident nor in flight).
- ``late_prefetches``: accesses that found the expert's transfer still in flight.
- ``hit_rate``: hits / (hits + misses + late_prefetches).
- ``collision_misses``: misses on an expert evicted earlier in the same forward pass.
- ``prefetches_issued``: prefetch transfers queued; ``prefetches_used``: prefetched experts
  accessed (hit or late) before being evicted; ``prefetches_cancelled``: prefetches still
  queued (not started) when their target layer was reached without needing them, withdrawn
  (no bytes moved).
- ``prefetch_precision`` / ``prefetch_recall``: over the layers a prefetcher made proposals
  for, |proposed ∩ needed| / |proposed| and |proposed ∩ needed| / |needed| (prediction
  quality, independent of what was already cached).
- ``preloaded_experts``: experts loaded before the replay (static pinning), not timed.
- ``low_precision_experts``: expert computations at a precision below the scenario's
  (fetch-lowest-bit, fetch-priority, or a resident lower-precision copy used as a hit).
- ``dropped_experts`` / ``substituted_experts``: missed experts that were skipped, or
  replaced by another expert (substitute, speculative), per (pass, layer).
- ``uncached_fetches``: misses fetched to a staging buffer because the cache could not make
  room (every entry pinned, or capacity below one expert).
- ``bytes_by_link``: bytes copied per link direction (e.g. ``pcie.h2d``).
- ``stall_s``: total time the compute stream waited for transfers.
- ``ttft_s``: mean over requests of the time from the start of the request's batch to the end
  of its first forward pass (its prefill when the trace has one).
- ``tpot_s``: mean duration of a decode forward pass (each yields one token per request).
- ``tokens_per_s``: decode tokens / total duration of decode passes (all tokens / total time
  when there are no decode passes).
- ``link_utilisation``: per link direction, busy time of its copy engine / total time.
- ``unique_experts_per_layer``: distinct experts per layer per pass, mean over decode and
  verify passes; ``unique_experts_per_layer_prefill`` the same over prefill passes.
- ``gate_mass_retained``: router weight of the experts actually computed / weight of the
  original top-k, over all tokens.
- ``tokens_altered``: fraction of tokens whose expert set a routing, budget or miss policy
  changed.
- ``total_time_s``: simulated time of the whole replay.

In cache-only replay (``timing: false``) the time metrics are ``null``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

if TYPE_CHECKING:
    from simulator.engine import Simulation

TIME_METRICS = ("stall_s", "ttft_s", "tpot_s", "tokens_per_s", "total_time_s")


def _f(x: Any) -> float | None:
    x = float(x)
    return None if np.isnan(x) else x


def summarise(sim: Simulation, steps: pd.DataFrame, requests: pd.DataFrame) -> dict[str, Any]:
    """The summary dict written to ``summary.json``."""
    timing = sim.scenario.timing
    num_l = sim.model.num_layers
    hits = int(steps["hits"].sum())
    misses = int(steps["misses"].sum())
    late = int(steps["late_prefetches"].sum())
    accesses = hits + misses + late
    decode_like = steps["phase"].isin(["decode", "verify"]).to_numpy()
    prefill = (steps["phase"] == "prefill").to_numpy()
    decode = (steps["phase"] == "decode").to_numpy()
    total_time = float(steps["end_s"].max()) if len(steps) else 0.0
    total_w = float(steps["gate_weight_total"].sum())
    tokens_total = int(steps["tokens"].sum())
    out: dict[str, Any] = {
        "hits": hits,
        "misses": misses,
        "late_prefetches": late,
        "hit_rate": hits / accesses if accesses else None,
        "collision_misses": int(steps["collision_misses"].sum()),
        "uncached_fetches": int(steps["uncached_fetches"].sum()),
        "prefetches_issued": int(steps["prefetches_issued"].sum()),
        "prefetches_used": int(steps["prefetches_used"].sum()),
        "prefetches_cancelled": int(steps["prefetches_cancelled"].sum()),
        "prefetch_precision": (_f(steps["prefetch_predicted_hits"].sum() / steps["prefetch_predicted"].sum())
                               if steps["prefetch_predicted"].sum() else None),
        "prefetch_recall": (_f(steps["prefetch_predicted_hits"].sum() / steps["prefetch_actual"].sum())
                            if steps["prefetch_actual"].sum() else None),
        "preloaded_experts": sim.preloaded,
        "low_precision_experts": int(steps["low_precision_experts"].sum()),
        "dropped_experts": int(steps["dropped_experts"].sum()),
        "substituted_experts": int(steps["substituted_experts"].sum()),
        "expert_accesses": accesses,
        "bytes_by_link": {sim.link_name: int(steps["bytes_h2d"].sum())},
        "stall_s": float(steps["stall_s"].sum()),
        "ttft_s": _f(requests["ttft_s"].mean()) if len(requests) else None,
        "tpot_s": _f(steps.loc[decode, "duration_s"].mean()) if decode.any() else None,
        "tokens_per_s": None,
        "link_utilisation": {sim.link_name: sim.copy.busy_time / total_time if total_time > 0 else 0.0},
        "unique_experts_per_layer": (_f(steps.loc[decode_like, "unique_experts"].sum() / (decode_like.sum() * num_l))
                                     if decode_like.any() else None),
        "unique_experts_per_layer_prefill": (_f(steps.loc[prefill, "unique_experts"].sum() / (prefill.sum() * num_l))
                                             if prefill.any() else None),
        "gate_mass_retained": float(steps["gate_weight_computed"].sum()) / total_w if total_w else None,
        "tokens_altered": int(steps["tokens_altered"].sum()) / tokens_total if tokens_total else None,
        "total_time_s": total_time,
        "forward_passes": len(steps),
        "tokens": tokens_total,
        "decode_tokens": int(steps.loc[decode, "tokens"].sum()),
        "requests": len(requests),
        "cache_capacity_bytes": sim.capacity if np.isfinite(sim.capacity) else None,
        "cache_capacity_experts": (sim.capacity / sim.expert_bytes) if np.isfinite(sim.capacity) else None,
        "cache_peak_bytes": int(sim.cache.max_used),
        "expert_bytes": sim.expert_bytes,
        "precision": sim.precision,
        "model": sim.model.name,
        "hardware_source": sim.scenario.hardware.source,
    }
    dec_time = float(steps.loc[decode, "duration_s"].sum())
    if decode.any() and dec_time > 0:
        out["tokens_per_s"] = out["decode_tokens"] / dec_time
    elif total_time > 0:
        out["tokens_per_s"] = tokens_total / total_time
    if not timing:
        for key in TIME_METRICS:
            out[key] = None
        out["link_utilisation"] = {sim.link_name: None}
    gpu_bytes = sim.scenario.hardware.gpu.memory_gb * 1e9
    if np.isfinite(sim.capacity) and sim.capacity > gpu_bytes:
        out["warning"] = (f"cache capacity {sim.capacity / 1e9:.1f} GB exceeds the GPU's "
                          f"{gpu_bytes / 1e9:.0f} GB of HBM")
    return out

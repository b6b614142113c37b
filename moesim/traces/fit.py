"""Fit the synthetic routing model to a trace (``moesim trace fit``); profiles are read,
written and synthesised from by :mod:`traces.profile` (re-exported here).

What is estimated from the trace (decode rows when it has any, else all rows):

- **popularity** [L, N]: per-layer log-frequency of each expert's selections (add-0.5
  smoothing, centred), used as the popularity logits;
- **affinity** [L, N, N]: row ``i`` of layer ``l`` is the smoothed pointwise mutual
  information ``log P(top1_l = j | top1_{l-1} = i) - log P(top1_l = j)`` (add-1
  smoothing), the cross-layer correlation table;
- three scalar weights, found by grid search: ``reuse`` (logit bonus for the previous token's
  experts), ``corr`` (scale of the affinity table) and ``batch`` (a logit vector shared by the
  requests decoded together). The search minimises the error of the LRU hit-rate curve (at
  five cache sizes, replaying the trace's own batch) plus the errors of the top-1 repeat rate
  and set overlap, each synthetic candidate having the trace's own shape (requests, tokens,
  batch) so that cold-start effects match.

A profile is YAML: the model, the shape, the three weights, the two tables (rounded), and a
report of the fit (real and synthetic statistics and LRU curves).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np

from moesim.errors import MoesimError
from moesim.traces.profile import (
    PROFILE_VERSION,
    load_profile,
    shipped_profiles,
    synthesise,
    write_profile,
)
from moesim.traces.schema import PHASE_CODES
from moesim.traces.stats import trace_stats
from moesim.traces.trace import Trace

GRID = {"reuse": (0.0, 0.5, 1.0, 1.5, 2.5), "corr": (0.0, 0.5, 1.0), "batch": (0.0, 0.5, 1.0, 2.0)}


def _decode_or_all(trace: Trace) -> tuple[Trace, tuple[str, ...]]:
    dec = trace.phase == PHASE_CODES["decode"]
    if dec.any():
        return trace.take(dec), ("decode",)
    return trace, ("prefill", "decode", "verify")


def popularity_table(trace: Trace) -> np.ndarray:
    """[L, N] centred log-frequencies of selections (add-0.5 smoothing)."""
    num_l, num_e = trace.model.num_layers, trace.model.num_experts
    counts = np.zeros((num_l, num_e))
    np.add.at(counts, (np.repeat(trace.layer.astype(np.int64), trace.model.top_k),
                       trace.experts.reshape(-1).astype(np.int64)), 1)
    logf = np.log(counts + 0.5)
    return logf - logf.mean(axis=1, keepdims=True)


def affinity_table(trace: Trace) -> np.ndarray:
    """[L, N, N] smoothed PMI between consecutive layers' top-1 experts (layer 0: zeros)."""
    num_l, num_e = trace.model.num_layers, trace.model.num_experts
    from moesim.traces.stats import trace_sequences

    seqs = trace_sequences(trace, ("prefill", "decode", "verify"))
    joint = np.zeros((num_l, num_e, num_e))
    for s in seqs:
        top1 = s[:, :, 0]
        for layer in range(1, num_l):
            ok = (top1[:, layer - 1] >= 0) & (top1[:, layer] >= 0)
            np.add.at(joint[layer], (top1[ok, layer - 1], top1[ok, layer]), 1)
    aff = np.zeros_like(joint)
    for layer in range(1, num_l):
        j = joint[layer] + 1.0
        cond = j / j.sum(axis=1, keepdims=True)
        marg = j.sum(axis=0) / j.sum()
        aff[layer] = np.log(cond) - np.log(marg)[None, :]
    return aff


def _shape(trace: Trace) -> dict[str, int]:
    reqs = np.unique(trace.request)
    toks = [int(np.unique(trace.position[trace.request == r]).size) for r in reqs]
    return {"requests": len(reqs), "tokens": round(float(np.mean(toks))) if toks else 0}


FRACTIONS = [0.05, 0.1, 0.25, 0.5, 0.75]


def fit_profile(trace: Trace, hit_curve: Callable[[Trace, list[float], int], list[float]], batch: int = 1,
                name: str | None = None, seeds: int = 2, progress: Any = None) -> dict[str, Any]:
    """Estimate a profile from ``trace`` (see the module docstring). ``hit_curve(trace, fractions,
    batch)`` gives the LRU hit rates the fit matches (``moesim.studies.mrc.lru_curve``, a
    replay: this package does not import the engine)."""
    body, phases = _decode_or_all(trace)
    if len(body) == 0:
        raise MoesimError(f"trace {trace.source}: no rows to fit.")
    model = body.model
    pop = popularity_table(body)
    aff = affinity_table(body)
    shape = _shape(body)
    real_stats = trace_stats(body, ("decode",) if phases == ("decode",) else ("prefill",))
    real_curve = hit_curve(body, FRACTIONS, batch)
    profile: dict[str, Any] = {
        "profile_version": PROFILE_VERSION, "name": name or model.name,
        "model": model.to_dict(), "shape": shape, "batch": batch,
        "popularity": np.round(pop, 3).tolist(),
        "affinity": {str(layer): np.round(aff[layer], 3).tolist() for layer in range(1, model.num_layers)},
    }
    candidates = list(itertools.product(GRID["reuse"], GRID["corr"],
                                        GRID["batch"] if batch > 1 else (0.0,)))
    best = None
    for n, (reuse, corr, bc) in enumerate(candidates):
        profile["weights"] = {"reuse": reuse, "corr": corr, "batch": bc}
        curves, stats = [], []
        for seed in range(seeds):
            synth = synthesise(profile, seed=seed)
            curves.append(hit_curve(synth, FRACTIONS, batch))
            stats.append(trace_stats(synth))
        curve = np.mean(curves, axis=0)
        st = {k: float(np.mean([s[k] for s in stats])) for k in ("top1_repeat", "set_overlap")}
        err = float(np.abs(curve - real_curve).max())
        for k in ("top1_repeat", "set_overlap"):
            if np.isfinite(real_stats[k]) and np.isfinite(st[k]):
                err += 0.5 * abs(st[k] - real_stats[k])
        if best is None or err < best[0]:
            best = (err, (reuse, corr, bc), curve.tolist(), st)
        if progress is not None:
            progress(n + 1, len(candidates))
    assert best is not None
    reuse, corr, bc = best[1]
    profile["weights"] = {"reuse": reuse, "corr": corr, "batch": bc}
    profile["report"] = {
        "fitted_on": trace.capture.get("files", trace.source), "phases": list(phases), "cache_fractions": FRACTIONS,
        "lru_hit_rate_real": [round(x, 4) for x in real_curve],
        "lru_hit_rate_synthetic": [round(x, 4) for x in best[2]],
        "max_hit_rate_gap": round(float(np.abs(np.asarray(best[2]) - real_curve).max()), 4),
        "stats_real": {k: round(float(real_stats[k]), 4) for k in ("top1_repeat", "set_overlap")},
        "stats_synthetic": {k: round(v, 4) for k, v in best[3].items()},
    }
    return profile


__all__ = ["fit_profile", "load_profile", "shipped_profiles", "synthesise",
           "write_profile"]

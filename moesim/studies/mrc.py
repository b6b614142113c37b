"""``moesim mrc``: miss-ratio curves — misses and hit rate of a trace over cache capacities.

Demand fetching only (no prefetch), cache-only replay (no timing): what an eviction policy
alone makes of a routing trace at each capacity.

- **LRU in per-expert execution** comes from one pass over the access stream with Mattson's
  stack algorithm (Mattson et al. 1970): an access hits a cache of C experts iff fewer than
  C distinct experts were used since its expert's last use. This is exact there because
  per-expert execution (SpecMD Algorithm 1) looks experts up one at a time in the stream's
  order and the only pinned expert, the one running, is the most recently used, which LRU
  would not evict anyway — except at a capacity of one expert, where the running expert
  cannot make room for the next: that capacity is replayed.
- **LRU in layer execution** is replayed at every capacity: there all of a layer's routed
  experts are pinned from the layer's routing point until it has run (``docs/concepts/execution.md``),
  so LRU may have to pass over its least recent expert and the stack property fails.
- **Every other policy** (Belady, the bound; FIFO, LFU, Least-Stale, ...) is replayed through
  the engine, with the same pinning rules.

The table (``mrc.parquet``) has one row per (policy, capacity): capacity in experts, bytes and
% of the model's experts, misses, accesses, hit rate and how the row was computed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from moesim.errors import MoesimError
from moesim.traces.trace import Trace

MRC_COLUMNS = ("policy", "capacity_experts", "capacity_bytes", "capacity_pct", "misses", "accesses",
               "hit_rate", "method")


def lru_stack_misses(stream: Sequence[int] | np.ndarray, capacities: Sequence[int]) -> list[int]:
    """Misses of an LRU cache of each capacity (in entries) on ``stream``, from stack
    distances in one pass (Mattson's stack algorithm): the stack lists the keys most recent
    first; an access at depth d (0-based) hits every cache of more than d entries; a first
    access misses at every capacity."""
    stack: list[int] = []
    depth_counts: dict[int, int] = {}
    for key in np.asarray(stream, dtype=np.int64).tolist():
        try:
            d = stack.index(key)
        except ValueError:
            stack.insert(0, key)
            continue
        depth_counts[d] = depth_counts.get(d, 0) + 1
        if d:
            del stack[d]
            stack.insert(0, key)
    depths = np.array(sorted(depth_counts), dtype=np.int64)
    counts = np.array([depth_counts[d] for d in depths.tolist()], dtype=np.int64)
    cum = np.cumsum(counts)  # accesses at depth <= depths[i]
    out = []
    for c in capacities:
        i = int(np.searchsorted(depths, c, side="left"))  # depths < c hit
        hits = int(cum[i - 1]) if i else 0
        out.append(len(stream) - hits)
    return out


def parse_capacities(text: str | None, total: int) -> list[int]:
    """'1,2,4,8' (experts) or '1%,5%,25%' (of the model's experts) -> sorted distinct expert
    counts; None -> about 20 log-spaced counts from 1 to every expert."""
    if text is None:
        grid = np.unique(np.round(np.geomspace(1, total, 20)).astype(np.int64))
        return [int(v) for v in grid]
    out = []
    for item in (s.strip() for s in text.split(",")):
        try:
            if item.endswith("%"):
                pct = float(item[:-1])
                if not 0 < pct <= 100:
                    raise ValueError
                out.append(max(1, round(pct / 100 * total)))
            else:
                n = int(item)
                if not 1 <= n <= total:
                    raise ValueError
                out.append(n)
        except ValueError:
            raise MoesimError(f"--capacities: '{item}' is not an expert count in 1..{total} nor a percentage "
                              f"in (0, 100]; write e.g. --capacities 1,8,64 or --capacities 1%,5%,25%.") from None
    return sorted(set(out))


def _replay(trace: Trace, policy: str, capacity: int, mode: str, batch_size: int, seed: int) -> tuple[int, int]:
    from moesim.config.scenario import scenario_from_dict
    from moesim.simulator.engine import Simulation

    data: dict[str, Any] = {
        "seed": seed, "timing": False, "expert_compute": mode,
        # the trace is handed over in memory; the path only names it in messages
        "workload": {"trace": {"path": trace.source or "<trace>"}, "batch_size": batch_size},
        "cache": {"capacity": f"{capacity} experts"},
        "policies": {"eviction": policy, "prefetch": "none", "miss": "fetch"},
    }
    sc = scenario_from_dict(data, where=f"mrc ({policy} at {capacity} experts)")
    s = Simulation(sc, trace=trace).run().summary
    return int(s["misses"]), int(s["expert_accesses"])


def mrc(trace: Trace, policies: Sequence[str] = ("lru", "belady"), capacities: Sequence[int] | None = None,
        expert_compute: str = "per-expert", batch_size: int = 1, seed: int = 0,
        progress: Callable[[int, int], None] | None = None) -> pd.DataFrame:
    """The miss-ratio curve table (see the module docstring) of ``trace`` for each policy."""
    from moesim.policies.eviction import REGISTRY as EVICTION
    from moesim.simulator.workload import build_workload

    if expert_compute not in ("layer", "per-expert"):
        raise MoesimError(f"--expert-compute must be layer or per-expert, got '{expert_compute}'.")
    for p in policies:
        EVICTION.get(p)  # unknown names fail here, before any replay, naming the valid ones
    model = trace.model
    total = model.num_layers * model.num_experts
    caps = list(capacities) if capacities is not None else parse_capacities(None, total)
    expert_bytes = int(model.expert_bytes[model.default_precision()])
    # LRU points where stack distances are exact: per-expert execution, 2 experts and up
    stack_caps = [c for c in caps if c >= 2] if "lru" in policies and expert_compute == "per-expert" else []
    jobs = [(p, c) for p in policies for c in caps if not (p == "lru" and c in stack_caps)]
    rows: list[dict[str, Any]] = []
    if stack_caps:
        stream = build_workload(trace, batch_size=batch_size).keys()
        for c, m in zip(stack_caps, lru_stack_misses(stream, stack_caps), strict=True):
            rows.append({"policy": "lru", "capacity_experts": c, "misses": m, "accesses": len(stream),
                         "method": "stack-distance"})
    done = 0
    if progress is not None:
        progress(done, len(jobs))
    for p, c in jobs:
        misses, accesses = _replay(trace, p, c, expert_compute, batch_size, seed)
        rows.append({"policy": p, "capacity_experts": c, "misses": misses, "accesses": accesses, "method": "replay"})
        done += 1
        if progress is not None:
            progress(done, len(jobs))
    df = pd.DataFrame(rows)
    df["capacity_bytes"] = df["capacity_experts"].astype(np.int64) * expert_bytes
    df["capacity_pct"] = 100.0 * df["capacity_experts"] / total
    df["hit_rate"] = 1.0 - df["misses"] / df["accesses"]
    order = {p: i for i, p in enumerate(policies)}
    df = df.sort_values(["policy", "capacity_experts"], key=lambda s: s.map(order) if s.name == "policy" else s)
    return df.loc[:, list(MRC_COLUMNS)].reset_index(drop=True)


def figure(df: pd.DataFrame, title: str) -> Any:
    """Hit rate against capacity (log axis, experts; % of the model's experts on top); a
    ``belady`` curve is drawn dashed, as the bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for policy, part in df.groupby("policy", sort=False):
        bound = policy == "belady"
        ax.plot(part["capacity_experts"], part["hit_rate"], marker="o", markersize=3,
                linestyle="--" if bound else "-", color="black" if bound else None,
                label=f"{policy} (bound)" if bound else str(policy))
    ax.set_xscale("log")
    ax.set_xlabel("cache capacity (experts, log scale)")
    ax.set_ylabel("hit rate (hits / expert accesses)")
    ax.set_ylim(0, 1.02)
    pct = float(df["capacity_pct"].iloc[0] / df["capacity_experts"].iloc[0])
    def to_pct(x: Any) -> Any:
        return np.asarray(x, dtype=np.float64) * pct

    def from_pct(p: Any) -> Any:
        return np.asarray(p, dtype=np.float64) / pct

    top = ax.secondary_xaxis("top", functions=(to_pct, from_pct))
    top.set_xlabel("% of the model's experts")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(title="eviction")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig


def write_mrc(df: pd.DataFrame, out_dir: str | Path, title: str) -> tuple[Path, Path]:
    """``mrc.parquet`` and ``mrc.png`` in ``out_dir``, each written atomically."""
    from moesim.files import save_figure_atomic, write_atomic

    out = Path(out_dir)
    table = write_atomic(out / "mrc.parquet", lambda tmp: df.to_parquet(tmp, index=False))
    fig = save_figure_atomic(figure(df, title), out / "mrc.png")
    return table, fig


def describe(trace: Trace, source: str, expert_compute: str, batch_size: int) -> str:
    """The figure title: what was replayed and what was held fixed."""
    m = trace.model
    return (f"{source}: {m.name}, {m.num_layers} layers x {m.num_experts} experts, top-{m.top_k}\n"
            f"{expert_compute} execution, batch {batch_size}, demand fetch (no prefetch), cache-only replay")


__all__ = ["lru_curve", "lru_stack_misses", "mrc", "parse_capacities", "write_mrc"]


def lru_curve(trace: Trace, fractions: list[float], batch: int) -> list[float]:
    """LRU hit rate at cache sizes given as fractions of all experts (cache-only replay in
    layer execution, the scenario default): what ``moesim trace fit`` matches."""
    total = trace.model.num_layers * trace.model.num_experts
    out = []
    for f in fractions:
        misses, accesses = _replay(trace, "lru", max(1, round(f * total)), "layer", batch, 0)
        out.append((accesses - misses) / accesses if accesses else 0.0)  # no prefetch: no late hits
    return out

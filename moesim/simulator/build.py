"""Building a replay from its scenario (the engine's builder): the trace (read, imported or
synthesised in-process), the cache's sizing (the precision its entries are kept at, every
precision the model has, the capacity in bytes) and one policy of each family, each with its
own context and seeded generator. :class:`simulator.engine.Simulation` puts them together."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moesim.config.scenario import Scenario, parse_capacity
from moesim.errors import MoesimError
from moesim.policies.budget import REGISTRY as BUDGET
from moesim.policies.budget import BudgetPolicy
from moesim.policies.eviction import REGISTRY as EVICTION
from moesim.policies.eviction import EvictionPolicy
from moesim.policies.miss import REGISTRY as MISS
from moesim.policies.miss import MissPolicy
from moesim.policies.prefetch import REGISTRY as PREFETCH
from moesim.policies.prefetch import PrefetchPolicy
from moesim.policies.registry import Clock, PolicyContext
from moesim.policies.routing import REGISTRY as ROUTING
from moesim.policies.routing import RoutingPolicy
from moesim.simulator.workload import Workload, build_workload
from moesim.traces.schema import ModelInfo
from moesim.traces.trace import Trace


def _trace_file(scenario: Scenario, key: str, raw: str) -> Path:
    """The scenario's trace file (relative to the scenario's folder), or an error naming the
    key to set — saying so when a shipped scenario reads data moesim does not ship."""
    from moesim.config.scenario import shipped_dir

    p = Path(raw)
    if not p.is_absolute():
        p = Path(scenario.base_dir) / p
    if p.exists():
        return p
    # a path from a shipped file (command-line paths are made absolute: moesim.config.scenario.cli_paths)
    shipped = not Path(raw).is_absolute() and Path(scenario.base_dir).resolve().is_relative_to(shipped_dir().resolve())
    why = (" This shipped scenario reads data moesim does not ship (the real routing traces of "
           "../shared/traces/real beside a source checkout)." if shipped else "")
    raise MoesimError(f"{scenario.source}: key '{key}' is {raw!r}, which resolves to {p}: no such file or "
                      f"folder.{why} Set it to your copy: --set {key}=FILE (relative to the working directory).")


def trace_path(scenario: Scenario) -> Path:
    """The scenario's trace file (``workload.trace.path``), checked to exist."""
    raw = scenario.workload.trace.path
    assert raw is not None
    return _trace_file(scenario, "workload.trace.path", raw)


def load_trace(scenario: Scenario) -> Trace:
    """The scenario's trace: read from its path, or synthesised in-process."""
    src = scenario.workload.trace
    if src.import_ is not None:
        from moesim.traces.importers import import_trace

        imp = src.import_
        ip = _trace_file(scenario, "workload.trace.import.path", imp.path)
        return import_trace(imp.format, [ip], imp.model_preset)[0]
    if src.path is not None:
        from moesim.traces.io import read_trace

        return read_trace(trace_path(scenario))
    from moesim.traces.synth import synth_from_preset

    s = src.synth
    assert s is not None
    if s.fit is not None:
        from moesim.traces.profile import load_profile, synthesise

        fp = Path(s.fit)
        if not fp.is_absolute() and (Path(scenario.base_dir) / fp).is_file():
            fp = Path(scenario.base_dir) / fp
        return synthesise(load_profile(str(fp)), requests=s.requests, tokens=s.tokens,
                          seed=scenario.seed if s.seed is None else s.seed, prompt_tokens=s.prompt_tokens,
                          probs=s.probs, pred_next=s.pred_next, pred_noise=s.pred_noise)
    assert s.preset is not None
    return synth_from_preset(
        s.preset, layers=s.layers, experts=s.experts, top_k=s.top_k, routing=s.routing,
        requests=s.requests, prompt_tokens=s.prompt_tokens, tokens=s.tokens,
        seed=scenario.seed if s.seed is None else s.seed, probs=s.probs, pred_next=s.pred_next,
        pred_noise=s.pred_noise)


def scenario_workload(scenario: Scenario, trace: Trace) -> Workload:
    """The forward passes ``scenario``'s workload settings make of ``trace`` (batch size,
    request limit, speculative verification, the seed)."""
    w = scenario.workload
    return build_workload(trace, w.batch_size, w.max_requests, w.speculative, scenario.seed)


@dataclass(frozen=True)
class CacheSizing:
    """The cache's entry sizes and capacity. ``precisions`` runs from the largest entry to the
    smallest; a cache key is ``base * len(precisions) + index`` (``PolicyContext.key``), and
    ``default_prec`` is the index of ``precision``, the one the scenario caches at."""

    precision: str
    expert_bytes: int
    precisions: tuple[str, ...]
    default_prec: int
    capacity: float


def cache_sizing(scenario: Scenario, model: ModelInfo) -> CacheSizing:
    """``cache.precision`` (default: the model's own) and ``cache.capacity`` in bytes; an
    error names the key when the model has no sizes at that precision."""
    precision = scenario.cache.precision or model.default_precision()
    if precision not in model.expert_bytes:
        raise MoesimError(
            f"{scenario.source}: key 'cache.precision' is '{precision}', but the trace's model "
            f"({model.name}) has expert sizes for {', '.join(model.expert_bytes)} only; pick one "
            "of those.")
    expert_bytes = int(model.expert_bytes[precision])
    precisions = tuple(sorted(model.expert_bytes, key=lambda q: -model.expert_bytes[q]))
    total = model.num_layers * model.num_experts * expert_bytes
    return CacheSizing(precision, expert_bytes, precisions, precisions.index(precision),
                       parse_capacity(scenario.cache.capacity, expert_bytes, total, scenario.source))


@dataclass(frozen=True)
class Policies:
    """One policy of each family."""

    eviction: EvictionPolicy
    miss: MissPolicy
    prefetch: PrefetchPolicy
    routing: RoutingPolicy
    budget: BudgetPolicy


def make_policies(scenario: Scenario, workload: Workload, size: CacheSizing, clock: Clock,
                  trace_pieces: Callable[[], Iterator[Workload]] | None = None,
                  piece_future: Callable[[Any, int, int, int], tuple[int, Any]] | None = None) -> Policies:
    """The scenario's policies, each with its own context and generator seeded with
    ``[seed, family index]`` (eviction 0, miss 1, prefetch 2, routing 3, budget 4).
    ``trace_pieces``: the trace file's pieces read again, when ``workload`` is its first
    (``PolicyContext.trace_pieces``); ``piece_future``: each served pass's future
    (``PolicyContext.piece_future``)."""
    model = workload.model

    def ctx(family_index: int) -> PolicyContext:
        return PolicyContext(num_layers=model.num_layers, num_experts=model.num_experts,
                             top_k=model.top_k, expert_bytes=size.expert_bytes,
                             capacity_bytes=size.capacity, precisions=size.precisions,
                             default_precision=size.default_prec,
                             precision_bytes=tuple(int(model.expert_bytes[q]) for q in size.precisions),
                             rng=np.random.default_rng([scenario.seed, family_index]),
                             clock=clock, workload=workload, trace_pieces=trace_pieces,
                             piece_future=piece_future)

    pol = scenario.policies
    return Policies(eviction=EVICTION.get(pol.eviction.name)(pol.eviction.params, ctx(0)),
                    miss=MISS.get(pol.miss.name)(pol.miss.params, ctx(1)),
                    prefetch=PREFETCH.get(pol.prefetch.name)(pol.prefetch.params, ctx(2)),
                    routing=ROUTING.get(pol.routing.name)(pol.routing.params, ctx(3)),
                    budget=BUDGET.get(pol.budget.name)(pol.budget.params, ctx(4)))

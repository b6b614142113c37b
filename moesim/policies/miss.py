"""Miss-handling policies (SpecMD §3.1.2): what to do when a needed expert is absent.

The engine asks :meth:`MissPolicy.alternative` first: a policy that accepts another resident
copy of the expert (a lower precision) returns its key and the access is a hit at that
precision. Otherwise the access is a miss and :meth:`MissPolicy.decide` returns a
:class:`MissDecision` that the engine carries out:

- ``fetch``: a blocking demand transfer at ``precisions[0]`` (falling back to the next
  precision in the tuple when no room can be made for it);
- ``drop``: the expert is not computed for its tokens;
- ``substitute``: the resident expert ``substitute`` (a base key) runs instead;
- ``speculate``: each of the expert's tokens runs its best-predicted expert that is cached
  and not already in its set (dropped when there is none); the true expert is never fetched.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np

from moesim.errors import MoesimError
from moesim.policies.registry import Policy, PolicyContext, Registry


@dataclass(frozen=True)
class MissInfo:
    """The missed expert and its context. ``rows`` are the trace rows (tokens) routed to it;
    ``routed`` the layer's routed experts; ``cached(key)`` tells whether a cache key is
    resident or in flight."""

    pass_index: int
    layer: int
    expert: int
    rank: int
    rows: np.ndarray
    routed: frozenset[int]
    cached: Any


@dataclass(frozen=True)
class MissDecision:
    """What to do with one missed expert."""

    action: Literal["fetch", "drop", "substitute", "speculate"]
    precisions: tuple[int, ...] = ()  # fetch: precision indices to try, in order (() = default)
    substitute: int | None = None  # substitute: the expert id to run instead


class MissPolicy(Policy, ABC):
    """Base class of the miss family. ``always_fetch = True`` tells the engine that every
    decision is a plain fetch at the scenario's precision and no alternative is accepted,
    so it may use its fast path."""

    always_fetch: ClassVar[bool] = False

    def alternative(self, layer: int, expert: int, rank: int, resident: Any) -> int | None:
        """A resident cache key to use instead of the expert at the scenario's precision
        (e.g. a lower precision), or None. ``resident(key)`` tells residency."""
        return None

    @abstractmethod
    def decide(self, info: MissInfo) -> MissDecision:
        """Decision for a missed expert."""


REGISTRY: Registry[MissPolicy] = Registry("miss")

_FETCH = MissDecision("fetch")


@REGISTRY.register("fetch")
class Fetch(MissPolicy):
    """Blocking fetch: copy the missed expert to the GPU and wait for it (the papers'
    on-demand baseline, ``speculating-experts-prefetch.txt`` §5.1)."""

    always_fetch = True

    def decide(self, info: MissInfo) -> MissDecision:
        return _FETCH


def _precision_indices(ctx: PolicyContext, names: tuple[str, ...], who: str) -> tuple[int, ...]:
    if not names:
        return tuple(range(ctx.default_precision, len(ctx.precisions)))
    out = []
    for n in names:
        if n not in ctx.precisions:
            raise MoesimError(f"miss policy '{who}': precision '{n}' is not among the trace's "
                              f"expert sizes ({', '.join(ctx.precisions)}).")
        out.append(ctx.precisions.index(n))
    return tuple(out)


@dataclass(frozen=True)
class LowestBitParams:
    """Parameters of fetch-lowest-bit."""

    precisions: tuple[str, ...] = field(default=(), metadata={
        "help": "precisions available, e.g. [int8, int4] (default: the scenario's and all lower)"})


@REGISTRY.register("fetch-lowest-bit")
class FetchLowestBit(MissPolicy):
    """Fetch-lowest-bit (SpecMD §3.1.2, e.g. int8:4): a miss fetches the lowest available
    precision to minimise latency; any resident copy among the available precisions is used
    (the highest one resident)."""

    Params = LowestBitParams

    def __init__(self, params: LowestBitParams, ctx: PolicyContext) -> None:
        super().__init__(params, ctx)
        self.levels = sorted(_precision_indices(ctx, params.precisions, "fetch-lowest-bit"))

    def alternative(self, layer: int, expert: int, rank: int, resident: Any) -> int | None:
        for q in self.levels:
            key = self.ctx.key(layer, expert, q)
            if resident(key):
                return key
        return None

    def decide(self, info: MissInfo) -> MissDecision:
        return MissDecision("fetch", precisions=(self.levels[-1],))


@dataclass(frozen=True)
class PriorityParams:
    """Parameters of fetch-priority."""

    precisions: tuple[str, ...] = field(default=(), metadata={
        "help": "cascade from highest to lowest, e.g. [int8, int4, int2] (default: the scenario's and all lower)"})
    degrade_fraction: float = field(default=0.6, metadata={
        "help": "experts in this bottom share of the router ranks are fetched one level lower"})

    def __post_init__(self) -> None:
        if not 0 <= self.degrade_fraction <= 1:
            raise ValueError(f"degrade_fraction must be in [0, 1], got {self.degrade_fraction}")


@REGISTRY.register("fetch-priority")
class FetchPriority(MissPolicy):
    """Fetch-priority with a precision cascade (SpecMD §3.1.2 and §5.4, e.g. int8:4:2):
    important experts (router rank in the top ``1 - degrade_fraction`` of k) are fetched at
    the highest precision, the bottom ``degrade_fraction`` one level lower; when no room can
    be made at a level the next lower one is tried. Low-importance experts also use any
    resident lower-precision copy."""

    Params = PriorityParams

    def __init__(self, params: PriorityParams, ctx: PolicyContext) -> None:
        super().__init__(params, ctx)
        self.levels = _precision_indices(ctx, params.precisions, "fetch-priority")
        self.important_ranks = math.ceil((1 - params.degrade_fraction) * ctx.top_k)

    def alternative(self, layer: int, expert: int, rank: int, resident: Any) -> int | None:
        start = 0 if rank < self.important_ranks else 1
        for q in self.levels[start:] if rank >= self.important_ranks else self.levels[:1]:
            key = self.ctx.key(layer, expert, q)
            if resident(key):
                return key
        return None

    def decide(self, info: MissInfo) -> MissDecision:
        start = 0 if info.rank < self.important_ranks or len(self.levels) == 1 else 1
        return MissDecision("fetch", precisions=self.levels[start:])


@dataclass(frozen=True)
class DropParams:
    """Parameters of drop."""

    rank: int = field(default=2, metadata={
        "help": "missed experts of router rank >= this (0 = top-1) are skipped; higher ranks always fetched"})

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"rank must be >= 0, got {self.rank}")


@REGISTRY.register("drop")
class Drop(MissPolicy):
    """Drop (SpecMD §3.1.2, after Skliar et al. 2025): skip missed experts of router rank
    >= r (their tokens lose them), always fetch the top ranks. In a batch an expert's rank is
    its best rank among the tokens routed to it."""

    Params = DropParams

    def decide(self, info: MissInfo) -> MissDecision:
        return MissDecision("drop") if info.rank >= self.params.rank else _FETCH


def _needs(ctx: PolicyContext, column: str, who: str, how: str) -> None:
    if ctx.workload is None or getattr(ctx.workload, column) is None:
        raise MoesimError(f"{who} needs the trace's '{column}' column and this trace has none. {how}")


@REGISTRY.register("substitute")
class Substitute(MissPolicy):
    """Substitution (SpecMD §3.1.2, after Zhu et al. 2025): run instead the resident expert
    of the same layer whose router score is nearest to the missed expert's (scores: mean
    router probability over the tokens routed to it); fetch when no expert of the layer is
    resident."""

    def __init__(self, params: Any, ctx: PolicyContext) -> None:
        super().__init__(params, ctx)
        _needs(ctx, "probs", "miss policy 'substitute'",
               "Record full router probabilities (`moesim capture`, or workload.trace.synth.probs: true).")

    def decide(self, info: MissInfo) -> MissDecision:
        probs = self.ctx.workload.probs[info.rows]
        score = probs.mean(axis=0)
        best = None
        for e in range(self.ctx.num_experts):
            if e in info.routed or not info.cached(self.ctx.key(info.layer, e)):
                continue
            d = abs(float(score[e]) - float(score[info.expert]))
            if best is None or d < best[0]:
                best = (d, e)
        if best is None:
            return _FETCH
        return MissDecision("substitute", substitute=best[1])


@REGISTRY.register("speculative")
class Speculative(MissPolicy):
    """Speculative execution (``speculating-experts-prefetch.txt`` §4): experts predicted
    from the previous layer's hidden state (the trace's ``pred_next``) are executed in place
    of true experts that are not cached, and the true ones are never re-fetched. Each token
    routed to a missed expert runs its highest-predicted expert that is cached and not
    already in its set, or none. Layer 0 has no prediction and fetches. Pair it with a
    prefetcher that loads the predicted experts (next-gate-topk)."""

    def __init__(self, params: Any, ctx: PolicyContext) -> None:
        super().__init__(params, ctx)
        _needs(ctx, "pred_next", "miss policy 'speculative'",
               "Record it with `moesim capture --predict-next` or workload.trace.synth.pred_next: true.")

    def decide(self, info: MissInfo) -> MissDecision:
        return _FETCH if info.layer == 0 else MissDecision("speculate")

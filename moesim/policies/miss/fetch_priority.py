"""Fetch by priority: important experts at full precision (SpecMD §3.1.2, §5.4)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from moesim.jit import inline
from moesim.policies.miss.base import (
    REGISTRY,
    MissDecision,
    MissForm,
    MissInfo,
    MissPolicy,
    _precision_indices,
)
from moesim.policies.registry import PolicyContext


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


@inline
def _by_importance(rank, n, arg):
    """An important expert (router rank below ``arg``) uses its first level only and is
    fetched from it down the cascade; the others use any copy below the first and are fetched
    from the second down (the first when there is one level)."""
    if rank < arg:
        return 0, 1, 0, n
    return 1, n, 1 if n > 1 else 0, n


class PriorityForm(MissForm):
    """fetch-priority's compiled form: a fetch down its cascade by importance
    (:func:`_by_importance`, ``arg``: the important ranks)."""

    cascade = True
    search = staticmethod(_by_importance)

    @classmethod
    def arg(cls, policy: Any) -> int:
        return int(policy.important_ranks)


@REGISTRY.register("fetch-priority")
class FetchPriority(MissPolicy):
    """Fetch-priority with a precision cascade (SpecMD §3.1.2 and §5.4, e.g. int8:4:2):
    important experts (router rank in the top ``1 - degrade_fraction`` of k) are fetched at
    the highest precision, the bottom ``degrade_fraction`` one level lower; when no room can
    be made at a level the next lower one is tried. Low-importance experts also use any
    resident lower-precision copy."""

    Params = PriorityParams
    form = PriorityForm

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

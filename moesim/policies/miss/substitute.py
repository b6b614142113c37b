"""Substitute a missed expert with the resident one of nearest router score (SpecMD §3.1.2)."""

from __future__ import annotations

from typing import Any

from moesim.policies.miss.base import (
    _FETCH,
    REGISTRY,
    MissDecision,
    MissInfo,
    MissPolicy,
    _needs,
)
from moesim.policies.registry import PolicyContext


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

"""Speculative execution of predicted experts on a miss (speculating-experts-prefetch §4)."""

from __future__ import annotations

from typing import Any

from moesim.jit import inline
from moesim.kernel_state import S_LAYER
from moesim.policies.miss.base import (
    _FETCH,
    FETCH,
    REGISTRY,
    SPECULATE,
    MissDecision,
    MissForm,
    MissInfo,
    MissPolicy,
    _needs,
)
from moesim.policies.registry import PolicyContext


@inline
def _speculate_after_the_first_layer(e, rank, arg, IS, K, M):
    """Speculate, except at layer 0 (no prediction: fetch)."""
    return FETCH if IS[S_LAYER] == 0 else SPECULATE


class SpeculativeForm(MissForm):
    """speculative's compiled form: the kernel carries speculation out as the engine does."""

    reroutes = True
    decide = staticmethod(_speculate_after_the_first_layer)


@REGISTRY.register("speculative")
class Speculative(MissPolicy):
    """Speculative execution (``speculating-experts-prefetch.txt`` §4): experts predicted
    from the previous layer's hidden state (the trace's ``pred_next``) are executed in place
    of true experts that are not cached, and the true ones are never re-fetched. Each token
    routed to a missed expert runs its highest-predicted expert that is cached and not
    already in its set, or none. Layer 0 has no prediction and fetches. Pair it with a
    prefetcher that loads the predicted experts (next-gate-topk)."""

    form = SpeculativeForm

    def __init__(self, params: Any, ctx: PolicyContext) -> None:
        super().__init__(params, ctx)
        _needs(ctx, "pred_next", "miss policy 'speculative'",
               "Record it with `moesim capture --predict-next` or workload.trace.synth.pred_next: true.")

    def decide(self, info: MissInfo) -> MissDecision:
        return _FETCH if info.layer == 0 else MissDecision("speculate")

"""Substitute a missed expert with the resident one of nearest router score (SpecMD §3.1.2)."""

from __future__ import annotations

from typing import Any

import numpy as np

from moesim.jit import inline, kernel
from moesim.kernel_state import ABSENT, C_K, C_NE, S_LAYER, _here, _key_at, routed_now
from moesim.policies.miss.base import (
    _FETCH,
    FETCH,
    REGISTRY,
    MissDecision,
    MissForm,
    MissInfo,
    MissPolicy,
    _needs,
)
from moesim.policies.registry import PolicyContext


@kernel
def _nearest_resident(e, IS, K, M):
    """Among the layer's experts that are not routed and are resident or in flight, the one
    whose router score (mean probability over ``e``'s tokens, in float32 as numpy's ``mean``)
    is nearest to ``e``'s; the lowest id on a tie; -1 when there is none."""
    score_e = _mean_prob(e, e, IS, M)
    best = -1
    best_d = 0.0
    for c in range(IS[C_NE]):
        key = _key_at(IS[S_LAYER], c, IS)
        if routed_now(key, IS) or K[key].state == ABSENT:
            continue
        d = abs(np.float64(_mean_prob(e, c, IS, M)) - np.float64(score_e))
        if best < 0 or d < best_d:
            best = c
            best_d = d
    return best


@kernel
def _mean_prob(e, c, IS, M):
    """Mean router probability of expert ``c`` over the layer's tokens that chose ``e`` (routed
    to it, or left it by the budget policy: ``M.chosen``), summed row by row in float32 and
    divided in float32 (numpy's ``mean(axis=0)``)."""
    row_order, row_off, chosen, mass = M.row_order, M.row_off, M.chosen, M.mass
    k = IS[C_K]
    b = _here(IS)
    total = np.float32(0.0)
    n = 0
    for i in range(row_off[b + 1] - row_off[b]):
        r = row_order[row_off[b] + i]
        for j in range(k):
            if chosen[r, j] == e:
                v = mass[r, c]
                total = v if n == 0 else np.float32(total + v)
                n += 1
    return np.float32(total / np.float32(n))


@inline
def _substitute_nearest(e, rank, arg, IS, K, M):
    """The nearest resident expert (:func:`_nearest_resident`), or fetch when there is none."""
    e2 = _nearest_resident(e, IS, K, M)
    return e2 if e2 >= 0 else FETCH


class SubstituteForm(MissForm):
    """substitute's compiled form, :meth:`Substitute.decide` over the kernel's state."""

    reroutes = True
    decide = staticmethod(_substitute_nearest)


@REGISTRY.register("substitute")
class Substitute(MissPolicy):
    """Substitution (SpecMD §3.1.2, after Zhu et al. 2025): run instead the resident expert
    of the same layer whose router score is nearest to the missed expert's (scores: mean
    router probability over the tokens routed to it); fetch when no expert of the layer is
    resident."""

    form = SubstituteForm

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

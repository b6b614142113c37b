"""The budget family's base: restrict a layer's expert set for a whole forward pass
(MoE-Spec, XShare, sparse verification, Lynx, dynamic skipping). ``none`` applies no budget.

A budget policy sees the tokens of one (pass, layer) — their router top-k (rank order) and,
when the trace has them, their full router probabilities — and returns each token's final
expert list. The engine then loads only the experts some token still uses, so a budgeted pass
loads fewer experts into the cache, and ``gate_mass_retained`` / ``tokens_altered`` measure
what the budget cost. Router scores ``g`` are the trace's ``probs`` when present, else the
top-k mixing weights (zero outside the top-k: XShare's definition of ``g``, §2.2). Each policy
is a module of this package; this one holds what they share."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np

from moesim.policies.registry import Policy, PolicyContext, Registry


class BudgetPolicy(Policy, ABC):
    """Base class of the budget family; ``restricts = False`` means no budget."""

    restricts: ClassVar[bool] = True

    @classmethod
    def calibrates(cls, params: object) -> bool:
        """Whether the policy with ``params`` calibrates on the trace's leading passes when it
        is made (serving under load, which forms its passes as it goes, cannot give them)."""
        return False

    @abstractmethod
    def select(self, pass_index: int, layer: int, rows: np.ndarray, experts: np.ndarray) -> list[list[int]]:
        """Each token's experts (rank order) for trace ``rows`` (of ``ctx.workload``) whose
        router chose ``experts``, in forward pass ``pass_index`` (counted over the whole replay)."""

    def scores(self, rows: np.ndarray, experts: np.ndarray) -> np.ndarray:
        """Router scores ``[tokens, N]``: probabilities when the trace has them, else the top-k
        weights scattered into a zero matrix."""
        wl = self.ctx.workload
        if wl.probs is not None:
            return wl.probs[rows].astype(np.float64)
        g = np.zeros((len(rows), self.ctx.num_experts))
        np.put_along_axis(g, experts.astype(np.int64), wl.trace.weights[rows].astype(np.float64), axis=1)
        return g


REGISTRY: Registry[BudgetPolicy] = Registry("budget")


def top_in(scores: np.ndarray, allowed: np.ndarray, k: int) -> list[list[int]]:
    """Each token's top-k experts within ``allowed`` (boolean [N]) by score, positive scores only."""
    masked = np.where(allowed[None, :], scores, -np.inf)
    order = np.argsort(-masked, axis=1, kind="stable")[:, :k]
    return [[int(e) for e in row if np.isfinite(masked[t, e]) and masked[t, e] > 0] for t, row in enumerate(order)]


def truncate(experts: np.ndarray, allowed: np.ndarray) -> list[list[int]]:
    """Each token keeps its own top-k experts that are in ``allowed``, in rank order."""
    return [[int(e) for e in row if allowed[e]] for row in experts]


def _calibration_counts(ctx: PolicyContext, fraction: float) -> np.ndarray:
    """[L, N] selection counts over the first ``fraction`` of the forward passes."""
    wl = ctx.workload
    n_cal = max(1, math.ceil(wl.num_passes * fraction))
    end = int(wl.row_off[n_cal * ctx.num_layers])
    rows = wl.row_order[:end]
    counts = np.zeros((ctx.num_layers, ctx.num_experts))
    layers = np.repeat(wl.trace.layer[rows].astype(np.int64), ctx.top_k)
    np.add.at(counts, (layers, wl.trace.experts[rows].reshape(-1).astype(np.int64)), 1)
    return counts

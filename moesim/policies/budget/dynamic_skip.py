"""Dynamic skipping of low-weight experts."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moesim.policies.budget.base import (
    REGISTRY,
    BudgetPolicy,
)


@dataclass(frozen=True)
class DynamicSkipParams:
    """Parameters of dynamic skipping."""

    beta: float = field(default=0.3, metadata={"help": "skip an expert of rank >= 1 when its weight < beta * top-1 weight"})

    def __post_init__(self) -> None:
        if not 0 <= self.beta <= 1:
            raise ValueError(f"beta must be in [0, 1], got {self.beta}")


@REGISTRY.register("dynamic-skip")
class DynamicSkip(BudgetPolicy):
    """Dynamic skipping (Lu et al. 2024, as described in XShare §1 and sparse verification
    §3.5): for top-2 routing, skip the second expert when w1 < beta * w0; for k > 2 every
    expert of rank >= 1 with w_r < beta * w0 is skipped."""

    Params = DynamicSkipParams

    def select(self, pass_index: int, layer: int, rows: np.ndarray, experts: np.ndarray) -> list[list[int]]:
        w = self.ctx.workload.trace.weights[rows]
        keep = w >= self.params.beta * w[:, :1]
        keep[:, 0] = True
        return [[int(e) for e, k in zip(row, mask, strict=True) if k] for row, mask in zip(experts, keep, strict=True)]

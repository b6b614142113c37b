"""Lynx's dynamic expert reduction."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moesim.policies.budget.base import (
    REGISTRY,
    BudgetPolicy,
    truncate,
)


@dataclass(frozen=True)
class LynxParams:
    """Parameters of Lynx."""

    drop: int = field(default=1, metadata={"help": "n: least-used experts of the batch dropped per layer"})

    def __post_init__(self) -> None:
        if self.drop < 0:
            raise ValueError(f"drop must be >= 0, got {self.drop}")


@REGISTRY.register("lynx")
class Lynx(BudgetPolicy):
    """Lynx-Lat (Gupta et al. 2024, as described in XShare §1): drop the ``drop`` experts of the
    batch selected by the fewest tokens (ties: lower total weight first); their tokens lose
    them (fewer than k experts)."""

    Params = LynxParams

    def select(self, pass_index: int, layer: int, rows: np.ndarray, experts: np.ndarray) -> list[list[int]]:
        used, counts = np.unique(experts, return_counts=True)
        weights = self.ctx.workload.trace.weights[rows]
        mass = np.array([float(weights[experts == e].sum()) for e in used])
        order = np.lexsort((mass, counts))
        allowed = np.ones(self.ctx.num_experts, dtype=bool)
        allowed[used[order[: self.params.drop]]] = False
        return truncate(experts, allowed)

"""No budget."""

from __future__ import annotations

import numpy as np

from moesim.policies.budget.base import (
    REGISTRY,
    BudgetPolicy,
)


@REGISTRY.register("none")
class NoBudget(BudgetPolicy):
    """Every expert the router chose is loaded and computed."""

    restricts = False

    def select(self, pass_index: int, layer: int, rows: np.ndarray, experts: np.ndarray) -> list[list[int]]:
        return experts.tolist()

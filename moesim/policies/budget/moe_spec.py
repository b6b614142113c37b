"""MoE-Spec's per-layer expert budget for verification."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from moesim.errors import MoesimError
from moesim.policies.budget.base import (
    REGISTRY,
    BudgetPolicy,
    _calibration_counts,
    top_in,
    truncate,
)
from moesim.policies.registry import PolicyContext


@dataclass(frozen=True)
class MoESpecParams:
    """Parameters of MoE-Spec expert budgeting."""

    budget: int = field(default=32, metadata={"help": "B: experts loaded per layer per pass"})
    ranking: Literal["router", "static"] = field(default="router", metadata={
        "help": "router: sum of routing probabilities over the pass's tokens (eq. 5); static: calibration counts (eq. 4)"})
    coverage: Literal["substitution", "truncation"] = field(default="substitution", metadata={
        "help": "truncation: tokens keep their own experts inside the shortlist (eq. 7); substitution: top-k within it (eq. 8)"})
    calibration: float = field(default=0.1, metadata={"help": "static ranking: leading share of passes counted"})

    def __post_init__(self) -> None:
        if self.budget < 1:
            raise ValueError(f"budget must be >= 1, got {self.budget}")
        if not 0 < self.calibration <= 1:
            raise ValueError(f"calibration must be in (0, 1], got {self.calibration}")


@REGISTRY.register("moe-spec")
class MoESpec(BudgetPolicy):
    """MoE-Spec (``moe-spec-expert-budgeting.txt`` §3.2-3.3, Algorithm 1): a shortlist of the
    B highest-ranked experts per layer per pass; truncation keeps the original weights of the
    experts a token keeps (it may get fewer than k, or none), substitution gives every token
    its top-k within the shortlist (needs ``probs`` to rank experts outside its top-k)."""

    Params = MoESpecParams

    @classmethod
    def calibrates(cls, params: object) -> bool:
        return isinstance(params, MoESpecParams) and params.ranking == "static"

    def __init__(self, params: MoESpecParams, ctx: PolicyContext) -> None:
        super().__init__(params, ctx)
        if params.coverage == "substitution" and ctx.workload is not None and ctx.workload.probs is None:
            raise MoesimError("budget 'moe-spec' with coverage: substitution needs the trace's 'probs' column "
                              "(router probabilities over all experts) and this trace has none; use coverage: "
                              "truncation, or record probs (`moesim capture`, or synth probs: true).")
        self._static = _calibration_counts(ctx, params.calibration) if params.ranking == "static" else None

    def select(self, pass_index: int, layer: int, rows: np.ndarray, experts: np.ndarray) -> list[list[int]]:
        g = self.scores(rows, experts)
        rank = self._static[layer] if self._static is not None else g.sum(axis=0)
        shortlist = np.argsort(-rank, kind="stable")[: self.params.budget]
        allowed = np.zeros(self.ctx.num_experts, dtype=bool)
        allowed[shortlist] = True
        if self.params.coverage == "truncation":
            return truncate(experts, allowed)
        return top_in(g, allowed, self.ctx.top_k)

"""Threshold-based expert skipping (sparse verification §3)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from moesim.errors import MoesimError
from moesim.policies.budget.base import (
    REGISTRY,
    BudgetPolicy,
)
from moesim.policies.registry import PolicyContext


@dataclass(frozen=True)
class SkipThresholdParams:
    """Parameters of threshold-map skipping."""

    max_skip: int = field(default=1, metadata={"help": "m: at most this many lowest-weight experts skipped per token"})
    calibration: float = field(default=0.1, metadata={"help": "leading share of passes used to build the threshold map"})

    def __post_init__(self) -> None:
        if self.max_skip < 1:
            raise ValueError(f"max_skip must be >= 1, got {self.max_skip}")
        if not 0 < self.calibration <= 1:
            raise ValueError(f"calibration must be in (0, 1], got {self.calibration}")


@REGISTRY.register("skip-threshold")
class SkipThreshold(BudgetPolicy):
    """Threshold-map expert skipping (``sparse-verification-speculative-decoding.txt`` §3.5),
    eqs. (15)-(16) as written: with a token's weights sorted ascending w_1 <= ... <= w_k,
    r_m = sum_{j<=k-m} w_j / sum_j w_j; beta_m is the median of r_m over the calibration
    tokens of the layer; a token skips the i lowest-weight experts for the largest i <= m with
    r_i < beta_m (none when there is no such i > 0). As r_i falls with i, that i is m itself
    when r_m < beta_m; for no smaller i can r_i < beta_m hold when r_m does not."""

    Params = SkipThresholdParams

    @classmethod
    def calibrates(cls, params: object) -> bool:
        return True

    def __init__(self, params: SkipThresholdParams, ctx: PolicyContext) -> None:
        super().__init__(params, ctx)
        if params.max_skip >= ctx.top_k:
            raise MoesimError(f"budget 'skip-threshold': max_skip must be below top-k ({ctx.top_k}).")
        wl = ctx.workload
        n_cal = max(1, math.ceil(wl.num_passes * params.calibration))
        rows = wl.row_order[: int(wl.row_off[n_cal * ctx.num_layers])]
        w = np.sort(wl.trace.weights[rows].astype(np.float64), axis=1)
        layers = wl.trace.layer[rows]
        m = params.max_skip
        ratio = w[:, : ctx.top_k - m].sum(axis=1) / np.maximum(w.sum(axis=1), 1e-30)
        self.beta = np.full(ctx.num_layers, np.nan)
        for layer in range(ctx.num_layers):
            sel = ratio[layers == layer]
            if sel.size:
                self.beta[layer] = float(np.median(sel))

    def select(self, pass_index: int, layer: int, rows: np.ndarray, experts: np.ndarray) -> list[list[int]]:
        w = self.ctx.workload.trace.weights[rows].astype(np.float64)
        beta = self.beta[layer]
        k = experts.shape[1]
        out = []
        for row, wt in zip(experts, w, strict=True):
            asc = np.sort(wt)
            total = max(float(asc.sum()), 1e-30)
            # r_i = sum of the k - i lowest weights / total falls as i grows, so the largest
            # i <= m with r_i < beta_m is m when r_m < beta_m, and no i otherwise
            m = self.params.max_skip
            skip = m if np.isfinite(beta) and asc[: k - m].sum() / total < beta else 0
            keep = np.argsort(-wt, kind="stable")[: k - skip]
            out.append([int(row[j]) for j in sorted(keep)])
        return out

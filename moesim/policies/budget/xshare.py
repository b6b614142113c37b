"""XShare's batch-aware expert selection and its expert-parallel placement."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moesim.errors import MoesimError
from moesim.policies.budget.base import (
    REGISTRY,
    BudgetPolicy,
    top_in,
)
from moesim.policies.registry import PolicyContext


@dataclass(frozen=True)
class XShareParams:
    """Parameters of XShare batch-aware selection."""

    budget: int | None = field(default=None, metadata={
        "help": "m_l: experts per layer (Algorithm 2; with per_request: the batch-level top-up m of Algorithm 4)"})
    threshold: float | None = field(default=None, metadata={
        "help": "tau: add experts until they hold this share of the batch's gating mass (Algorithm 1)"})
    per_request: int | None = field(default=None, metadata={
        "help": "m_r: experts per request added after its warm-up (Algorithms 3-4, speculative batches)"})
    per_gpu: int | None = field(default=None, metadata={
        "help": "m_g: expert-parallel GPU-balanced selection up to m_g * G experts (Algorithms 5-6)"})
    gpus: int = field(default=8, metadata={"help": "G for per_gpu: GPU groups the experts are placed on"})
    placement: str = field(default="contiguous", metadata={
        "help": "for per_gpu: contiguous, round-robin, or a YAML/JSON file mapping layer -> expert -> GPU"})
    k0: int = field(default=1, metadata={"help": "warm-up: each token's top-k0 experts are always included"})

    def __post_init__(self) -> None:
        modes = [self.threshold is not None, self.per_request is not None, self.per_gpu is not None]
        if sum(modes) > 1 or (not any(modes) and self.budget is None):
            raise ValueError("give budget (Algorithm 2), threshold (Algorithm 1), per_request [+ budget] "
                             "(Algorithm 4) or per_gpu (Algorithm 6)")
        if self.per_request is not None and self.per_request < 0:
            raise ValueError(f"per_request must be >= 0, got {self.per_request}")
        if self.per_gpu is not None and self.per_gpu < 1:
            raise ValueError(f"per_gpu must be >= 1, got {self.per_gpu}")
        if self.gpus < 1:
            raise ValueError(f"gpus must be >= 1, got {self.gpus}")
        low = 0 if self.per_request is not None else 1  # Algorithm 4 allows m = 0 (no top-up)
        if self.budget is not None and self.budget < low:
            raise ValueError(f"budget must be >= {low}, got {self.budget}")
        if self.threshold is not None and not 0 < self.threshold <= 1:
            raise ValueError(f"threshold must be in (0, 1], got {self.threshold}")
        if self.k0 < 0:
            raise ValueError(f"k0 must be >= 0, got {self.k0}")


def greedy_select(scores: np.ndarray, start: set[int], budget: int | None = None,
                  threshold: float | None = None) -> list[int]:
    """XShare Algorithm 1 / the greedy step of Algorithm 2: add experts by decreasing batch
    score (sum over tokens of g) to ``start`` until ``budget`` experts, or until the set holds
    ``threshold`` of the total score. Optimal for the modular proxy (Corollary 3.3)."""
    batch = scores.sum(axis=0)
    chosen = list(start)
    have = set(chosen)
    total = float(batch.sum())
    mass = float(batch[chosen].sum()) if chosen else 0.0
    for e in np.argsort(-batch, kind="stable"):
        e = int(e)
        if budget is not None and len(chosen) >= budget:
            break
        if threshold is not None and mass >= threshold * total:
            break
        if e in have:
            continue
        chosen.append(e)
        have.add(e)
        mass += float(batch[e])
    return chosen


def placement_of(spec: str, num_layers: int, num_experts: int, gpus: int) -> np.ndarray:
    """[L, N] GPU of each expert: contiguous blocks, round-robin, or from a YAML/JSON file
    (``{layer: [gpu of expert 0, gpu of expert 1, ...]}``, or one list for every layer)."""
    if spec == "contiguous":
        row = np.arange(num_experts) * gpus // num_experts
        return np.tile(row, (num_layers, 1))
    if spec == "round-robin":
        return np.tile(np.arange(num_experts) % gpus, (num_layers, 1))
    from pathlib import Path

    from moesim.files import read_yaml

    path = Path(spec)
    data = read_yaml(path, "expert placement", "Use contiguous, round-robin or a placement YAML file.")
    out = np.zeros((num_layers, num_experts), dtype=np.int64)
    for layer in range(num_layers):
        entry: Any = data.get(layer, data.get(str(layer))) if isinstance(data, dict) else data
        if not isinstance(entry, list) or len(entry) != num_experts or not all(0 <= int(v) < gpus for v in entry):
            raise MoesimError(f"expert placement {path}: layer {layer} needs a list of {num_experts} GPU ids "
                              f"in 0..{gpus - 1}.")
        out[layer] = entry
    return out


def gpu_aware_greedy(scores: np.ndarray, start: set[int], owner: np.ndarray, gpus: int, per_gpu: int) -> list[int]:
    """XShare Algorithm 5: while |S| < m_g * G, add in turn each GPU's best remaining expert
    (by batch score); no GPU gets ahead of another by more than one expert."""
    batch = scores.sum(axis=0)
    chosen = list(start)
    have = set(chosen)
    queues = [[int(e) for e in np.argsort(-batch, kind="stable") if owner[e] == g] for g in range(gpus)]
    while len(chosen) < per_gpu * gpus:
        added = False
        for g in range(gpus):
            q = queues[g]
            while q and q[0] in have:
                q.pop(0)
            if q:
                e = q.pop(0)
                chosen.append(e)
                have.add(e)
                added = True
        if not added:
            break
    return chosen


@REGISTRY.register("xshare")
class XShare(BudgetPolicy):
    """XShare batch-aware expert selection (``xshare-batch-expert-sharing.txt``). Warm-up with
    every token's top-k0 experts, then: greedy by batch gating score up to ``budget`` m_l
    (Algorithm 2) or until ``threshold`` of the gating mass (Algorithm 1); or per request, its
    warm-up plus its ``per_request`` m_r best experts, united and topped up to ``budget`` at
    batch level (Algorithms 3-4); or GPU-balanced greedy with ``per_gpu`` m_g experts per GPU
    group (Algorithms 5-6). Each token is then routed to its top-k within the set."""

    Params = XShareParams

    def __init__(self, params: XShareParams, ctx: PolicyContext) -> None:
        super().__init__(params, ctx)
        self.owner = (placement_of(params.placement, ctx.num_layers, ctx.num_experts, params.gpus)
                      if params.per_gpu is not None else None)

    def select(self, pass_index: int, layer: int, rows: np.ndarray, experts: np.ndarray) -> list[list[int]]:
        g = self.scores(rows, experts)
        k0 = min(self.params.k0, experts.shape[1])
        start = {int(e) for row in experts[:, :k0] for e in row}
        prm = self.params
        if prm.per_gpu is not None:
            assert self.owner is not None
            chosen = gpu_aware_greedy(g, start, self.owner[layer], prm.gpus, prm.per_gpu)
        elif prm.per_request is not None:
            reqs = self.ctx.workload.trace.request[rows]
            union: set[int] = set()
            for r in np.unique(reqs):
                sel = reqs == r
                s0 = {int(e) for row in experts[sel, :k0] for e in row}
                score_r = g[sel].sum(axis=0)
                extra = [int(e) for e in np.argsort(-score_r, kind="stable") if int(e) not in s0 and score_r[e] > 0]
                union |= s0 | set(extra[: prm.per_request])
            chosen = greedy_select(g, union, max(prm.budget or 0, len(union)))
        else:
            chosen = greedy_select(g, start, prm.budget, prm.threshold)
        allowed = np.zeros(self.ctx.num_experts, dtype=bool)
        allowed[chosen] = True
        return top_in(g, allowed, self.ctx.top_k)

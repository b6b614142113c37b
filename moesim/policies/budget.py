"""Expert-budget policies: restrict a layer's expert set for a whole forward pass
(MoE-Spec, XShare, sparse verification, Lynx, dynamic skipping). ``none`` applies no budget.

A budget policy sees the tokens of one (pass, layer) — their router top-k (rank order) and,
when the trace has them, their full router probabilities — and returns each token's final
expert list. The engine then loads only the experts some token still uses, so a budgeted pass
loads fewer experts into the cache, and ``gate_mass_retained`` / ``tokens_altered`` measure
what the budget cost. Router scores ``g`` are the trace's ``probs`` when present, else the
top-k mixing weights (zero outside the top-k: XShare's definition of ``g``, §2.2).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np

from moesim.errors import MoesimError
from moesim.policies.registry import Policy, PolicyContext, Registry


class BudgetPolicy(Policy, ABC):
    """Base class of the budget family; ``restricts = False`` means no budget."""

    restricts: ClassVar[bool] = True

    @abstractmethod
    def select(self, pass_index: int, layer: int, rows: np.ndarray, experts: np.ndarray) -> list[list[int]]:
        """Each token's experts (rank order) for trace ``rows`` whose router chose ``experts``."""

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


@REGISTRY.register("none")
class NoBudget(BudgetPolicy):
    """Every expert the router chose is loaded and computed."""

    restricts = False

    def select(self, pass_index: int, layer: int, rows: np.ndarray, experts: np.ndarray) -> list[list[int]]:
        return experts.tolist()


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

"""Cache-aware routing: a logit bias toward resident experts (SpecMD appendix A.1)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moesim.errors import MoesimError
from moesim.policies.registry import PolicyContext
from moesim.policies.routing.base import REGISTRY, RoutingPolicy


@dataclass(frozen=True)
class CacheAwareParams:
    """Parameters of cache-aware routing."""

    lam: float = field(default=0.3, metadata={
        "help": "lambda of SpecMD eq. 1: bias strength (0.1..0.5 work best in the paper)"})

    def __post_init__(self) -> None:
        if self.lam < 0:
            raise ValueError(f"lam must be >= 0, got {self.lam}")


@REGISTRY.register("cache-aware")
class CacheAware(RoutingPolicy):
    """Cache-aware routing (SpecMD §3.1.1 eq. 1, after Skliar et al. 2025):
    ``z' = z + lambda * delta_avg * 1_C``, where ``z`` are the router logits (recovered as
    log-probabilities from the trace's ``probs``; softmax is shift-invariant), ``1_C`` marks
    experts cached (resident or in flight) at this layer, and ``delta_avg`` is the historical
    average logit magnitude (running mean of ``|z|`` over every token and expert routed so
    far). The top-k of ``z'`` are executed, weighted by the original probabilities."""

    Params = CacheAwareParams

    def __init__(self, params: CacheAwareParams, ctx: PolicyContext) -> None:
        super().__init__(params, ctx)
        if ctx.workload is None or ctx.workload.probs is None:
            raise MoesimError(
                "routing policy 'cache-aware' needs the trace's 'probs' column (full router "
                "probabilities) and this trace has none. Record it with `moesim capture`, or use "
                "workload.trace.synth.probs: true.")
        self._sum = 0.0
        self._n = 0

    def route(self, pass_index: int, layer: int, rows: np.ndarray, experts: np.ndarray,
              cached: Any) -> np.ndarray:
        probs = self.ctx.workload.probs[rows].astype(np.float64)
        z = np.log(np.maximum(probs, 1e-30))
        self._sum += float(np.abs(z).sum())
        self._n += z.size
        delta = self._sum / self._n
        mask = np.array([bool(cached(self.ctx.key(layer, e))) for e in range(self.ctx.num_experts)])
        zp = z + self.params.lam * delta * mask
        k = experts.shape[1]
        return np.argsort(-zp, axis=1, kind="stable")[:, :k]

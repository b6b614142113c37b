"""Cache-aware routing: a logit bias toward resident experts (SpecMD appendix A.1)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moesim.errors import MoesimError
from moesim.jit import kernel
from moesim.kernel_state import ABSENT, C_K, C_NE, S_LAYER, _key_at
from moesim.policies.registry import PolicyContext
from moesim.policies.routing.base import REGISTRY, RoutingForm, RoutingPolicy


@dataclass(frozen=True)
class CacheAwareParams:
    """Parameters of cache-aware routing."""

    lam: float = field(default=0.3, metadata={
        "help": "lambda of SpecMD eq. 1: bias strength (0.1..0.5 work best in the paper)"})

    def __post_init__(self) -> None:
        if self.lam < 0:
            raise ValueError(f"lam must be >= 0, got {self.lam}")


def log_probs(probs: np.ndarray) -> np.ndarray:
    """The router logits up to a per-token shift, ``log(max(p, 1e-30))`` in float64, of every
    row of ``probs``: both replay paths index this array, so that each logit is the same
    number however numpy's ``log`` vectorises."""
    return np.log(np.maximum(probs.astype(np.float64), 1e-30))


@kernel
def _route(b, IS, K, M):
    """The compiled ``route`` (:class:`~moesim.policies.routing.base.RoutingForm`): the running
    sum of ``|z|`` takes the layer's logits one after another, row by row and expert by expert
    (as :meth:`CacheAware.route` sums them), then each row's top-k of ``z + bias`` (``bias`` on
    the experts resident or in flight) is picked rank by rank, the lowest id on a tie (a stable
    sort's order)."""
    z, F = M.route[0], M.route[1]
    row_order, row_off, chosen = M.row_order, M.row_off, M.chosen
    k, ne, layer = IS[C_K], IS[C_NE], IS[S_LAYER]
    lo, n = row_off[b], row_off[b + 1] - row_off[b]
    s = 0.0
    for i in range(n):
        r = row_order[lo + i]
        for e in range(ne):
            s += abs(z[r, e])
    F[1] += s
    F[2] += n * ne
    bias = F[0] * (F[1] / F[2])
    for i in range(n):
        r = row_order[lo + i]
        for j in range(k):
            best = -1
            top = 0.0
            for e in range(ne):
                taken = False
                for jj in range(j):
                    taken |= chosen[r, jj] == e
                if taken:
                    continue
                v = z[r, e]
                if K[_key_at(layer, e, IS)].state != ABSENT:
                    v = v + bias
                if best < 0 or v > top:
                    best = e
                    top = v
            chosen[r, j] = best


class CacheAwareForm(RoutingForm):
    """Cache-aware routing's compiled form: its arrays are the logits of the workload's rows
    (:func:`log_probs`) and ``[lambda, sum of |z|, count]`` (the policy's, carried over the
    replay's pieces)."""

    @classmethod
    def arrays(cls, policy: Any, workload: Any) -> tuple[Any, ...]:
        from moesim.policies.routing.hooked import route_arrays

        return route_arrays(z=log_probs(workload.probs), running=policy.running)

    @classmethod
    def functions(cls) -> tuple[Any, ...]:
        return (_route,)


@REGISTRY.register("cache-aware")
class CacheAware(RoutingPolicy):
    """Cache-aware routing (SpecMD §3.1.1 eq. 1, after Skliar et al. 2025):
    ``z' = z + lambda * delta_avg * 1_C``, where ``z`` are the router logits (recovered as
    log-probabilities from the trace's ``probs``, :func:`log_probs`; softmax is
    shift-invariant), ``1_C`` marks experts cached (resident or in flight) at this layer, and
    ``delta_avg`` is the historical average logit magnitude (running mean of ``|z|`` over
    every token and expert routed so far, each layer's terms added one after another, row by
    row). The top-k of ``z'`` are executed, weighted by the original probabilities; on a tie
    the lower expert id ranks first."""

    Params = CacheAwareParams
    form = CacheAwareForm

    def __init__(self, params: CacheAwareParams, ctx: PolicyContext) -> None:
        super().__init__(params, ctx)
        if ctx.workload is None or ctx.workload.probs is None:
            raise MoesimError(
                "routing policy 'cache-aware' needs the trace's 'probs' column (full router "
                "probabilities) and this trace has none. Record it with `moesim capture`, or use "
                "workload.trace.synth.probs: true.")
        self.running = np.array([params.lam, 0.0, 0.0])  # the compiled form's lambda, sum and count
        self._sum = 0.0
        self._n = 0
        self._z: tuple[np.ndarray, np.ndarray] | None = None  # (probs, their log_probs)

    def _logits(self, rows: np.ndarray) -> np.ndarray:
        probs = self.ctx.workload.probs
        if self._z is None or self._z[0] is not probs:
            self._z = (probs, log_probs(probs))
        return self._z[1][rows]

    def route(self, pass_index: int, layer: int, rows: np.ndarray, experts: np.ndarray,
              cached: Any) -> np.ndarray:
        z = self._logits(rows)
        self._sum += float(np.cumsum(np.abs(z).ravel())[-1])  # one after another
        self._n += z.size
        delta = self._sum / self._n
        mask = np.array([bool(cached(self.ctx.key(layer, e))) for e in range(self.ctx.num_experts)])
        zp = z + self.params.lam * delta * mask
        k = experts.shape[1]
        return np.argsort(-zp, axis=1, kind="stable")[:, :k]

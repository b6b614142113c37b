"""Oracle prefetch: the true experts of the next layer."""

from __future__ import annotations

from moesim.policies.prefetch.base import REGISTRY, _Routed


@REGISTRY.register("oracle")
class Oracle(_Routed):
    """The true experts of the next layer, read from the trace: an upper bound for any
    next-layer predictor (``speculating-experts-prefetch.txt`` §5.1's perfect prefetch)."""

    piecewise = True

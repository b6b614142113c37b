"""Oracle prefetch: the true experts of the next layer."""

from __future__ import annotations

from collections.abc import Sequence

from moesim.policies.prefetch.base import (
    REGISTRY,
    PrefetchPolicy,
    _keys_of,
)


@REGISTRY.register("oracle")
class Oracle(PrefetchPolicy):
    """The true experts of the next layer, read from the trace: an upper bound for any
    next-layer predictor (``speculating-experts-prefetch.txt`` §5.1's perfect prefetch)."""

    piecewise = True

    def propose(self, pass_index: int, layer: int) -> Sequence[int]:
        if layer + 1 >= self.ctx.num_layers:
            return ()
        return _keys_of(self.ctx, pass_index, layer + 1)

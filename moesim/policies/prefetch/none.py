"""No prefetching."""

from __future__ import annotations

from collections.abc import Sequence

from moesim.policies.prefetch.base import (
    REGISTRY,
    PrefetchPolicy,
)


@REGISTRY.register("none")
class NoPrefetch(PrefetchPolicy):
    """No prefetching: experts are loaded on demand only."""

    piecewise = True

    active = False

    def propose(self, pass_index: int, layer: int) -> Sequence[int]:
        return ()

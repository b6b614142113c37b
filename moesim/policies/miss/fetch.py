"""Fetch on a miss: a blocking demand transfer."""

from __future__ import annotations

from moesim.policies.miss.base import (
    _FETCH,
    REGISTRY,
    MissDecision,
    MissForm,
    MissInfo,
    MissPolicy,
)


@REGISTRY.register("fetch")
class Fetch(MissPolicy):
    """Blocking fetch: copy the missed expert to the GPU and wait for it (the papers'
    on-demand baseline, ``speculating-experts-prefetch.txt`` §5.1)."""

    always_fetch = True
    form = MissForm

    def decide(self, info: MissInfo) -> MissDecision:
        return _FETCH

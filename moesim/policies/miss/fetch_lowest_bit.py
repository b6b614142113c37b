"""Fetch the lowest precision on a miss (SpecMD §3.1.2)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moesim.jit import inline
from moesim.policies.miss.base import (
    REGISTRY,
    MissDecision,
    MissForm,
    MissInfo,
    MissPolicy,
    _precision_indices,
)
from moesim.policies.registry import PolicyContext


@dataclass(frozen=True)
class LowestBitParams:
    """Parameters of fetch-lowest-bit."""

    precisions: tuple[str, ...] = field(default=(), metadata={
        "help": "precisions available, e.g. [int8, int4] (default: the scenario's and all lower)"})


@inline
def _any_then_lowest(rank, n, arg):
    """Any of the levels (sorted, highest precision first) is used when resident; the last,
    the lowest, is fetched."""
    return 0, n, n - 1, n


class LowestBitForm(MissForm):
    """fetch-lowest-bit's compiled form: a fetch down its cascade (:func:`_any_then_lowest`)."""

    cascade = True
    search = staticmethod(_any_then_lowest)


@REGISTRY.register("fetch-lowest-bit")
class FetchLowestBit(MissPolicy):
    """Fetch-lowest-bit (SpecMD §3.1.2, e.g. int8:4): a miss fetches the lowest available
    precision to minimise latency; any resident copy among the available precisions is used
    (the highest one resident)."""

    Params = LowestBitParams
    form = LowestBitForm

    def __init__(self, params: LowestBitParams, ctx: PolicyContext) -> None:
        super().__init__(params, ctx)
        self.levels = sorted(_precision_indices(ctx, params.precisions, "fetch-lowest-bit"))

    def alternative(self, layer: int, expert: int, rank: int, resident: Any) -> int | None:
        for q in self.levels:
            key = self.ctx.key(layer, expert, q)
            if resident(key):
                return key
        return None

    def decide(self, info: MissInfo) -> MissDecision:
        return MissDecision("fetch", precisions=(self.levels[-1],))

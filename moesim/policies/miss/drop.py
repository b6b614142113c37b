"""Drop a missed expert of low router rank (SpecMD §3.1.2)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moesim.jit import inline
from moesim.policies.miss.base import (
    _FETCH,
    DROP,
    FETCH,
    REGISTRY,
    MissDecision,
    MissForm,
    MissInfo,
    MissPolicy,
)


@dataclass(frozen=True)
class DropParams:
    """Parameters of drop."""

    rank: int = field(default=2, metadata={
        "help": "missed experts of router rank >= this (0 = top-1) are skipped; higher ranks always fetched"})

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"rank must be >= 0, got {self.rank}")


@inline
def _drop_low_ranks(e, rank, arg, IS, K, M):
    """Drop a missed expert of router rank ``arg`` or more, fetch the others."""
    return DROP if rank >= arg else FETCH


class DropForm(MissForm):
    """drop's compiled form (``arg``: the rank from which missed experts are dropped)."""

    reroutes = True
    decide = staticmethod(_drop_low_ranks)

    @classmethod
    def arg(cls, policy: Any) -> int:
        return int(policy.params.rank)


@REGISTRY.register("drop")
class Drop(MissPolicy):
    """Drop (SpecMD §3.1.2, after Skliar et al. 2025): skip missed experts of router rank
    >= r (their tokens lose them), always fetch the top ranks. In a batch an expert's rank is
    its best rank among the tokens routed to it."""

    Params = DropParams
    form = DropForm

    def decide(self, info: MissInfo) -> MissDecision:
        return MissDecision("drop") if info.rank >= self.params.rank else _FETCH

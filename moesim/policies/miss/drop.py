"""Drop a missed expert of low router rank (SpecMD §3.1.2)."""

from __future__ import annotations

from dataclasses import dataclass, field

from moesim.policies.miss.base import (
    _FETCH,
    REGISTRY,
    MissDecision,
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


@REGISTRY.register("drop")
class Drop(MissPolicy):
    """Drop (SpecMD §3.1.2, after Skliar et al. 2025): skip missed experts of router rank
    >= r (their tokens lose them), always fetch the top ranks. In a batch an expert's rank is
    its best rank among the tokens routed to it."""

    Params = DropParams

    def decide(self, info: MissInfo) -> MissDecision:
        return MissDecision("drop") if info.rank >= self.params.rank else _FETCH

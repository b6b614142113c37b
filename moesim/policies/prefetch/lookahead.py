"""Lookahead prefetch: the previous token's experts of the next layers."""

from __future__ import annotations

from dataclasses import dataclass, field

from moesim.policies.prefetch.base import REGISTRY, _Routed


@dataclass(frozen=True)
class LookaheadParams:
    """Parameters of lookahead prefetch."""

    depth: int = field(default=2, metadata={"help": "number of layers ahead to prefetch (d >= 1)"})

    def __post_init__(self) -> None:
        if self.depth < 1:
            raise ValueError(f"depth must be >= 1, got {self.depth}")


@REGISTRY.register("lookahead")
class Lookahead(_Routed):
    """Prefetch ``depth`` layers ahead: at layer l, the experts layers l+1 .. l+d used for the
    previous token, nearest layer first (previous-token prediction extended d layers)."""

    piecewise = True
    reads_previous_pass = True

    Params = LookaheadParams

    def _ahead(self) -> int:
        return self.params.depth

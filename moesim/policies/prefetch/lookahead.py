"""Lookahead prefetch: the previous token's experts of the next layers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from moesim.policies.prefetch.base import (
    REGISTRY,
    PrefetchPolicy,
    _keys_of,
    _previous_pass,
)


@dataclass(frozen=True)
class LookaheadParams:
    """Parameters of lookahead prefetch."""

    depth: int = field(default=2, metadata={"help": "number of layers ahead to prefetch (d >= 1)"})

    def __post_init__(self) -> None:
        if self.depth < 1:
            raise ValueError(f"depth must be >= 1, got {self.depth}")


@REGISTRY.register("lookahead")
class Lookahead(PrefetchPolicy):
    """Prefetch ``depth`` layers ahead: at layer l, the experts layers l+1 .. l+d used for the
    previous token, nearest layer first (previous-token prediction extended d layers)."""

    piecewise = True
    reads_previous_pass = True

    Params = LookaheadParams

    def propose(self, pass_index: int, layer: int) -> Sequence[int]:
        prev = _previous_pass(self.ctx, pass_index)
        if prev is None:
            return ()
        out: list[int] = []
        for t in range(layer + 1, min(layer + 1 + self.params.depth, self.ctx.num_layers)):
            out.extend(_keys_of(self.ctx, prev, t))
        return out

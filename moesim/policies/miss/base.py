"""The miss family's base (SpecMD §3.1.2): what to do when a needed expert is absent.

The engine asks :meth:`MissPolicy.alternative` first: a policy that accepts another resident
copy of the expert (a lower precision) returns its key and the access is a hit at that
precision. Otherwise the access is a miss and :meth:`MissPolicy.decide` returns a
:class:`MissDecision` that the engine carries out:

- ``fetch``: a blocking demand transfer at ``precisions[0]`` (falling back to the next
  precision in the tuple when no room can be made for it);
- ``drop``: the expert is not computed for its tokens;
- ``substitute``: the resident expert ``substitute`` (a base key) runs instead;
- ``speculate``: each of the expert's tokens runs its best-predicted expert that is cached
  and not already in its set (dropped when there is none); the true expert is never fetched.

Each policy is a module of this package; this one holds what they share."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np

from moesim.errors import MoesimError
from moesim.policies.registry import Policy, PolicyContext, Registry


@dataclass(frozen=True)
class MissInfo:
    """The missed expert and its context. ``rows`` are the trace rows (tokens) routed to it;
    ``routed`` the layer's routed experts; ``cached(key)`` tells whether a cache key is
    resident or in flight."""

    pass_index: int
    layer: int
    expert: int
    rank: int
    rows: np.ndarray
    routed: frozenset[int]
    cached: Any


@dataclass(frozen=True)
class MissDecision:
    """What to do with one missed expert."""

    action: Literal["fetch", "drop", "substitute", "speculate"]
    precisions: tuple[int, ...] = ()  # fetch: precision indices to try, in order (() = default)
    substitute: int | None = None  # substitute: the expert id to run instead


class MissPolicy(Policy, ABC):
    """Base class of the miss family. ``always_fetch = True`` tells the engine that every
    decision is a plain fetch at the scenario's precision and no alternative is accepted,
    so it may use its fast path."""

    always_fetch: ClassVar[bool] = False

    def alternative(self, layer: int, expert: int, rank: int, resident: Any) -> int | None:
        """A resident cache key to use instead of the expert at the scenario's precision
        (e.g. a lower precision), or None. ``resident(key)`` tells residency."""
        return None

    @abstractmethod
    def decide(self, info: MissInfo) -> MissDecision:
        """Decision for a missed expert."""


REGISTRY: Registry[MissPolicy] = Registry("miss")

_FETCH = MissDecision("fetch")


def _precision_indices(ctx: PolicyContext, names: tuple[str, ...], who: str) -> tuple[int, ...]:
    if not names:
        return tuple(range(ctx.default_precision, len(ctx.precisions)))
    out = []
    for n in names:
        if n not in ctx.precisions:
            raise MoesimError(f"miss policy '{who}': precision '{n}' is not among the trace's "
                              f"expert sizes ({', '.join(ctx.precisions)}).")
        out.append(ctx.precisions.index(n))
    return tuple(out)


def _needs(ctx: PolicyContext, column: str, who: str, how: str) -> None:
    if ctx.workload is None or getattr(ctx.workload, column) is None:
        raise MoesimError(f"{who} needs the trace's '{column}' column and this trace has none. {how}")

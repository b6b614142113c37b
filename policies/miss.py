"""Miss-handling policies (SpecMD §3.1.2): what to do when a needed expert is absent.

A miss policy returns a :class:`MissDecision`. The engine carries it out: ``fetch`` issues a
blocking demand transfer at the decision's precision and computes the expert once it has
arrived.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from policies.registry import NoParams, PolicyContext, Registry


@dataclass(frozen=True)
class MissDecision:
    """What to do with one missed expert."""

    action: Literal["fetch"]
    precision: str | None = None  # None: the scenario's precision


class MissPolicy(ABC):
    """Base class of the miss family. ``always_fetch = True`` tells the engine that every
    decision is a plain fetch at the scenario's precision, so it may skip the call."""

    name: ClassVar[str]
    Params: ClassVar[type[Any]] = NoParams
    always_fetch: ClassVar[bool] = False

    def __init__(self, params: Any, ctx: PolicyContext) -> None:
        self.params = params
        self.ctx = ctx

    @abstractmethod
    def decide(self, layer: int, expert: int, rank: int) -> MissDecision:
        """Decision for ``expert`` of ``layer`` missing at router rank ``rank`` (0 = top-1)."""


REGISTRY: Registry[MissPolicy] = Registry("miss")

_FETCH = MissDecision("fetch")


@REGISTRY.register("fetch")
class Fetch(MissPolicy):
    """Blocking fetch: copy the missed expert to the GPU and wait for it (the papers'
    on-demand baseline, ``speculating-experts-prefetch.txt`` §5.1)."""

    always_fetch = True

    def decide(self, layer: int, expert: int, rank: int) -> MissDecision:
        return _FETCH

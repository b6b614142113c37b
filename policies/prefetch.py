"""Prefetch policies: propose experts for later layers at a layer's routing point.

The engine calls :meth:`PrefetchPolicy.propose` after layer ``l``'s routing decision; the
proposed keys (``layer * num_experts + expert``) are queued on the copy engine behind
demand fetches. Policies with ``active = False`` are never called.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

from policies.registry import NoParams, PolicyContext, Registry


class PrefetchPolicy(ABC):
    """Base class of the prefetch family."""

    name: ClassVar[str]
    Params: ClassVar[type[Any]] = NoParams
    active: ClassVar[bool] = True

    def __init__(self, params: Any, ctx: PolicyContext) -> None:
        self.params = params
        self.ctx = ctx

    @abstractmethod
    def propose(self, pass_index: int, layer: int) -> Sequence[int]:
        """Cache keys to prefetch, most wanted first."""


REGISTRY: Registry[PrefetchPolicy] = Registry("prefetch")


@REGISTRY.register("none")
class NoPrefetch(PrefetchPolicy):
    """No prefetching: experts are loaded on demand only."""

    active = False

    def propose(self, pass_index: int, layer: int) -> Sequence[int]:
        return ()

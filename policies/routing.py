"""Routing policies: may change the router's choice before experts are loaded.

``standard`` keeps the router's top-k as recorded in the trace. Policies that change the
choice (cache-aware routing, SpecMD eq. 1) keep the original weights for mixing
(dual-logit semantics, SpecMD appendix A.1).
"""

from __future__ import annotations

from abc import ABC
from typing import Any, ClassVar

from policies.registry import NoParams, PolicyContext, Registry


class RoutingPolicy(ABC):
    """Base class of the routing family; ``changes_routing = False`` means identity."""

    name: ClassVar[str]
    Params: ClassVar[type[Any]] = NoParams
    changes_routing: ClassVar[bool] = True

    def __init__(self, params: Any, ctx: PolicyContext) -> None:
        self.params = params
        self.ctx = ctx


REGISTRY: Registry[RoutingPolicy] = Registry("routing")


@REGISTRY.register("standard")
class Standard(RoutingPolicy):
    """The router's own top-k, unchanged."""

    changes_routing = False

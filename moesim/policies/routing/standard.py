"""Standard routing: the router's top-k as recorded."""

from __future__ import annotations

from moesim.policies.routing.base import REGISTRY, RoutingPolicy


@REGISTRY.register("standard")
class Standard(RoutingPolicy):
    """The router's own top-k, unchanged."""

    changes_routing = False

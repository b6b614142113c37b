"""The routing family's base: may change the router's choice before experts are loaded.

``standard`` keeps the router's top-k as recorded in the trace. Policies that change the
choice keep the original weights for mixing (dual-logit semantics, SpecMD appendix A.1):
modified logits choose the experts, the router's original probabilities weight them. Each
policy is a module of this package; this one holds what they share."""

from __future__ import annotations

from abc import ABC
from typing import Any, ClassVar

import numpy as np

from moesim.policies.registry import Policy, Registry


class RoutingPolicy(Policy, ABC):
    """Base class of the routing family; ``changes_routing = False`` means identity."""

    changes_routing: ClassVar[bool] = True

    def route(self, pass_index: int, layer: int, rows: np.ndarray, experts: np.ndarray,
              cached: Any) -> np.ndarray:
        """Experts ``[tokens, k]`` (rank order) chosen for the trace rows ``rows`` whose router
        chose ``experts``; ``cached(key)`` tells whether a cache key is resident or in flight."""
        return experts


REGISTRY: Registry[RoutingPolicy] = Registry("routing")

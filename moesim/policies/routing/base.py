"""The routing family's base: may change the router's choice before experts are loaded.

``standard`` keeps the router's top-k as recorded in the trace. Policies that change the
choice keep the original weights for mixing (dual-logit semantics, SpecMD appendix A.1):
modified logits choose the experts, the router's original probabilities weight them. Each
policy is a module of this package; this one holds what they share, with the base of their
compiled forms (:class:`RoutingForm`)."""

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


class RoutingForm:
    """A routing policy's compiled form, what the replay kernel runs at each routing point.

    ``route(b, IS, K, M)``: for (pass, layer) ``b`` of the replay's arrays (the current one),
    write each of its trace rows' experts, in rank order, into ``M.chosen`` (the rows are
    ``M.row_order[M.row_off[b]:M.row_off[b + 1]]``), reading the cache through
    :mod:`moesim.kernel_state` (``K[key].state``; :func:`moesim.kernel_state._key_at`) and its
    own arrays ``M.route`` (:meth:`arrays`), as the policy's ``route`` answers the engine. The
    kernel then looks the experts up in router order, as the engine's
    :func:`simulator.lookup.router_order` orders them."""

    @classmethod
    def arrays(cls, policy: Any, workload: Any) -> tuple[Any, ...]:
        """``M.route`` for ``policy``'s replay of ``workload``: the arrays ``route`` reads and
        keeps its state in, laid out as :func:`moesim.policies.routing.hooked.route_arrays`
        makes them (one type for every form); state that runs over the whole replay lives in
        ``policy``, so that a replay in pieces carries it over."""
        raise NotImplementedError

    @classmethod
    def functions(cls) -> tuple[Any, ...]:
        """``route``, as the kernel indexes it."""
        raise NotImplementedError

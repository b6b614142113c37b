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

The compiled replay kernel asks a policy's compiled form (:class:`MissForm`, ``form`` in its
class) instead: its ``decide`` answers :data:`FETCH`, :data:`DROP`, :data:`SPECULATE` or the
expert to substitute, and the kernel carries the answer out as the engine does; a precision
cascade's ``search`` gives the precisions looked for and fetched.

Each policy is a module of this package; this one holds what they share."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np

from moesim.errors import MoesimError
from moesim.jit import inline
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

# a compiled ``decide``'s answers (:class:`MissForm`); an expert id (>= 0): substitute that expert
FETCH, DROP, SPECULATE = -1, -2, -3


@inline
def _fetch(e, rank, arg, IS, K, M):
    return FETCH


@inline
def _no_search(rank, n, arg):
    return 0, 0, 0, n


class MissForm:
    """A miss policy's compiled form, what the replay kernel asks at a miss.

    ``decide(e, rank, arg, IS, K, M)``: for missed expert ``e`` of best router rank ``rank``
    (``arg``: the policy's one integer parameter, :meth:`arg`; the kernel's state ``IS``, ``K``
    and per-token arrays ``M``, read through :mod:`moesim.kernel_state`), :data:`FETCH`,
    :data:`DROP`, :data:`SPECULATE` or the expert to substitute, as ``decide`` answers the
    engine. ``search(rank, n, arg)``: for a precision cascade (``cascade``) over the ``n``
    precisions of the policy's ``levels``, the range of them looked for resident and the range
    fetched from, in order (``alternative`` and the fetch's ``precisions``). ``reroutes``: the
    policy may change what a token computes (drop, substitute, speculate)."""

    reroutes: ClassVar[bool] = False
    cascade: ClassVar[bool] = False
    decide = staticmethod(_fetch)
    search = staticmethod(_no_search)

    @classmethod
    def arg(cls, policy: Any) -> int:
        """The policy's integer parameter ``decide`` and ``search`` read. Default: 0."""
        return 0

    @classmethod
    def functions(cls) -> tuple[Any, ...]:
        """``decide`` and ``search``, in the order the kernel indexes them."""
        return (cls.decide, cls.search)

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

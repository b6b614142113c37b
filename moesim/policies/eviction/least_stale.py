"""Least-Stale eviction (SpecMD §4.2) and its compiled form, per-layer lists in two queues."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np

from moesim.jit import inline, jit
from moesim.policies.eviction.base import (
    ANY,
    NOT_PENDING,
    PENDING,
    REGISTRY,
    SKIP,
    EvictionPolicy,
    list_append,
    list_unlink,
)
from moesim.policies.registry import PolicyContext


@dataclass(frozen=True)
class LeastStaleParams:
    """Parameters of Least-Stale eviction."""

    order: str = field(default="relative", metadata={
        "help": "order within each queue: relative (layers already passed first, then upcoming "
                "layers farthest first) or absolute (layer index, layer 0 first)"})

    def __post_init__(self) -> None:
        if self.order not in ("relative", "absolute"):
            raise ValueError(f"order must be 'relative' or 'absolute', got {self.order!r}")


@inline
def _stale_or_current(key: int, p: int, base: int, nl: int, K: Any) -> int:
    """Least-stale: the list of ``key`` (``K[key].curpass``: the pass that last touched it;
    ``K[key].layer``): its layer's in the current queue if pass ``p`` touched it, else in the
    stale queue; queue ``q``'s list of layer ``x`` is at ``base + 2 * (q * nl + x)``."""
    current = K[key].curpass == p
    return base + 2 * (current * nl + K[key].layer)


@inline
def _touch(key: int, p: int, L: np.ndarray, base: int, nl: int, K: Any) -> None:
    """Least-stale: a cached key used or selected in pass ``p`` is current."""
    if K[key].curpass != p:  # stale -> current
        list_unlink(key, _stale_or_current(key, p, base, nl, K), L, K)
        K[key].curpass = p
        list_append(key, _stale_or_current(key, p, base, nl, K), L, K)


class LeastStaleLists:
    """Least-stale's compiled form (:class:`LeastStale`): two queues, stale (0) and current (1),
    of one list per layer in insertion order. A touch (an insert, a use, a prefetcher's
    selection) moves a key to its layer's current list; a new pass appends each layer's current
    list to its stale list. The walk's order is the reference's ``candidates()`` (for a
    prefetch, ``prefetch_candidates()``) over these lists."""

    QUEUES = 2

    @staticmethod
    @inline
    def insert(key: int, p: int, L: np.ndarray, base: int, nl: int, K: Any) -> None:
        K[key].curpass = p
        list_append(key, _stale_or_current(key, p, base, nl, K), L, K)

    @staticmethod
    @inline
    def access(key: int, p: int, L: np.ndarray, base: int, nl: int, K: Any) -> None:
        _touch(key, p, L, base, nl, K)

    @staticmethod
    @inline
    def remove(key: int, p: int, L: np.ndarray, base: int, nl: int, K: Any) -> None:
        list_unlink(key, _stale_or_current(key, p, base, nl, K), L, K)

    @staticmethod
    @inline
    def select(key: int, p: int, L: np.ndarray, base: int, nl: int, K: Any) -> None:
        _touch(key, p, L, base, nl, K)

    @staticmethod
    @jit
    def new_pass(p: int, L: np.ndarray, base: int, nl: int, K: Any) -> None:
        for layer in range(nl):
            stale = base + 2 * layer
            cur = base + 2 * (nl + layer)
            first = L[cur]
            if first == -1:
                continue
            if L[stale + 1] == -1:
                L[stale] = first
            else:
                K[L[stale + 1]].next = first
                K[first].prev = L[stale + 1]
            L[stale + 1] = L[cur + 1]
            L[cur] = -1
            L[cur + 1] = -1

    @staticmethod
    @inline
    def steps(nl: int, opt: int) -> int:
        return nl + 1 if opt else nl

    @staticmethod
    @inline
    def segment(q: int, step: int, for_prefetch: bool, layer: int, nl: int, opt: int) -> tuple[int, int]:
        """Per queue (stale, then current), the layers in the policy's order: relative
        (``opt``): the layers already passed, the current layer's experts that have run,
        upcoming layers farthest first, the current layer's experts still to run; absolute:
        layer 0 first. A prefetch takes no expert of the current layer still to run and no
        current expert of a later layer."""
        x, which = step, ANY  # absolute, and relative before the current layer
        if opt and step == layer:
            which = NOT_PENDING  # the current layer's experts that have run
        elif opt and step == nl:
            x, which = layer, PENDING  # ... and last those still to run
        elif opt and step > layer:
            x = nl + layer - step  # upcoming layers, farthest first
        if for_prefetch:
            if x == layer:
                if which == PENDING:
                    return 0, SKIP  # still to run: upcoming
                which = NOT_PENDING
            elif q == 1 and x > layer:
                return 0, SKIP  # a later layer's current expert: upcoming
        return 2 * (q * nl + x), which


@REGISTRY.register("least-stale")
class LeastStale(EvictionPolicy):
    """Least-Stale (``specmd-expert-caching-least-stale.txt`` §4.2, appendix A.3).

    An expert is *current* if it was used in the ongoing forward pass or selected by the
    prefetcher during it (:meth:`on_prefetch_select`, or admitted by a prefetch), *stale*
    otherwise (last touched in an earlier pass). A demand fetch evicts from the stale queue
    first and from the current one only when no stale expert is left (§4.2: "only to
    prevent out-of-memory errors").

    Within each queue (``order: relative``, the default) the order is relative to the
    execution point: experts *left* of it first — layers already passed in this pass, and
    the current layer's experts that are not among its routed experts still to run
    (``Clock.pending``: in ``per-expert`` execution those that have run are left; an
    expert the layer's routing did not pick is not needed again in this pass) — in layer
    order (FIFO by layer position), then the *upcoming* layers, farthest first, the current
    layer's experts still to run last; FIFO within a layer. This is what
    §5.2 and the captions of Fig. 5 and 9 describe ("only evicts stale left-layer experts").
    ``order: absolute`` keeps the plain layer index (layer 0 first), which among upcoming
    layers evicts the nearest first, the LRU pathology of Fig. 3-top.

    Victims for an optional prefetch (:meth:`prefetch_candidates`, A.3: the policy
    "prioritizes removing experts from already-processed layers while protecting experts
    needed for upcoming layers"): in the same order, a stale expert or a current expert left
    of the execution point (a layer already passed, or a current-layer expert that has run
    or is not routed in this pass); never an expert still upcoming in this pass — a
    current-layer expert yet to run (in either queue: one left from an earlier pass is
    still needed by this layer), or a later-layer expert used, selected or admitted in this
    pass. With no such victim the proposal waits in the prefetch queue until room appears or
    its target layer's routing point withdraws it. (Refusing every current expert — the
    reading moesim had before — refuses every prefetch once no stale expert is left, so the
    later layers of a pass ran on demand misses that evicted the same experts; letting a
    prefetch evict any current expert evicts current-layer experts still to run.)

    Both queues are kept as per-layer buckets (insertion-ordered dicts). The kernel runs
    :class:`LeastStaleLists`.
    """

    Params = LeastStaleParams
    lists = LeastStaleLists

    def __init__(self, params: LeastStaleParams, ctx: PolicyContext) -> None:
        super().__init__(params, ctx)
        n = ctx.num_layers
        # insertion-ordered dicts: a key only ever joins at the end or leaves
        self._stale: list[dict[int, None]] = [{} for _ in range(n)]
        self._current: list[dict[int, None]] = [{} for _ in range(n)]
        self._is_current: dict[int, bool] = {}
        self._pass = 0
        self._div = ctx.keys_per_layer  # key // _div = layer
        self._clock = ctx.clock
        self._relative = params.order == "relative"

    def _roll(self) -> None:
        p = self._clock.pass_index
        if p != self._pass:
            for stale, cur in zip(self._stale, self._current, strict=True):
                stale.update(cur)
                cur.clear()
            self._is_current = dict.fromkeys(self._is_current, False)
            self._pass = p

    def _touch(self, key: int) -> None:
        if self._clock.pass_index != self._pass:
            self._roll()
        layer = key // self._div
        if self._is_current.get(key) is False:
            del self._stale[layer][key]
        self._current[layer][key] = None
        self._is_current[key] = True

    def on_insert(self, key: int, demand: bool) -> None:
        self._touch(key)

    def on_access(self, key: int) -> None:
        if self._clock.pass_index != self._pass or not self._is_current.get(key):
            self._touch(key)

    def on_prefetch_select(self, key: int) -> None:
        self.on_access(key)

    def on_remove(self, key: int) -> None:
        layer = key // self._div
        if self._is_current.pop(key):
            del self._current[layer][key]
        else:
            del self._stale[layer][key]

    def _here(self, buckets: list[dict[int, None]]) -> tuple[list[int], list[int]]:
        """The current layer's keys of one queue: (left of the execution point, still to run)."""
        here = buckets[self._clock.layer]
        pending = self._clock.pending
        if not here:
            return [], []
        if not pending:
            return list(here), []
        return [k for k in here if k not in pending], [k for k in here if k in pending]

    def _queue(self, buckets: list[dict[int, None]], upcoming: bool) -> Iterator[int]:
        """One queue's keys, most evictable first; ``upcoming=False`` leaves out the current
        layer's experts still to run (and nothing else: the caller drops later layers)."""
        cur = self._clock.layer
        if not self._relative:
            if upcoming:
                return chain.from_iterable(buckets)
            return chain(chain.from_iterable(buckets[:cur]), self._here(buckets)[0],
                         chain.from_iterable(buckets[cur + 1:]))
        left, upcoming_here = self._here(buckets)
        return chain(chain.from_iterable(buckets[:cur]), left,
                     chain.from_iterable(reversed(buckets[cur + 1:])), upcoming_here if upcoming else ())

    def candidates(self) -> Iterator[int]:
        # the cache does not change the policy while it walks the candidates, so the
        # queues are iterated in place
        if self._clock.pass_index != self._pass:
            self._roll()
        return chain(self._queue(self._stale, True), self._queue(self._current, True))

    def prefetch_candidates(self) -> Iterator[int]:
        if self._clock.pass_index != self._pass:
            self._roll()
        cur = self._current
        return chain(self._queue(self._stale, False), chain.from_iterable(cur[:self._clock.layer]),
                     self._here(cur)[0])

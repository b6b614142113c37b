"""Least-Stale eviction (SpecMD §4.2) and its compiled form, per-layer lists in two queues."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np

from moesim.jit import inline, kernel
from moesim.kernel_state import (
    current_layer,
    current_pass,
    evictable,
    key_layer,
    layer_count,
    pending,
)
from moesim.policies.eviction.base import (
    ANY,
    NEXT,
    NOT_PENDING,
    PENDING,
    PREV,
    REGISTRY,
    SKIP,
    EvictionPolicy,
    KernelForm,
    list_append,
    list_unlink,
    new_state,
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


CURPASS = 2  # I2: the links, then the pass that last touched the key (-1: none)
WIDTH, LISTS = 0, 1  # I1: the walk table's row width, then the lists (head and tail each), then the table


@inline
def _list_of(key: int, S: Any, IS: np.ndarray, K: Any) -> int:
    """Least-stale: where in I1 the list of ``key`` starts: its layer's in the current queue if
    this pass touched it, else in the stale queue (queue ``q``'s list of layer ``x`` at
    ``LISTS + 2 * (q * layers + x)``)."""
    current = S[0][key, CURPASS] == current_pass(IS)
    return LISTS + 2 * (current * layer_count(IS) + key_layer(key, K))


@inline
def _touch(key: int, S: Any, IS: np.ndarray, K: Any) -> None:
    """Least-stale: a cached key used or selected in this pass is current."""
    if S[0][key, CURPASS] != current_pass(IS):  # stale -> current
        list_unlink(key, _list_of(key, S, IS, K), S[2], S[0])
        S[0][key, CURPASS] = current_pass(IS)
        list_append(key, _list_of(key, S, IS, K), S[2], S[0])


@inline
def _insert(key: int, demand: bool, ai: int, S: Any, IS: np.ndarray, K: Any, DI: np.ndarray, A: Any) -> None:
    S[0][key, CURPASS] = current_pass(IS)
    list_append(key, _list_of(key, S, IS, K), S[2], S[0])


@inline
def _access(key: int, ai: int, S: Any, IS: np.ndarray, K: Any, DI: np.ndarray, A: Any) -> None:
    _touch(key, S, IS, K)


@inline
def _remove(key: int, evicted: int, S: Any, IS: np.ndarray, K: Any, A: Any) -> None:
    list_unlink(key, _list_of(key, S, IS, K), S[2], S[0])


@inline
def _select(key: int, S: Any, IS: np.ndarray, K: Any) -> None:
    _touch(key, S, IS, K)


@kernel
def _new_pass(S: Any, IS: np.ndarray, K: Any) -> None:
    """Each layer's current list goes to the end of its stale list."""
    L, N = S[2], S[0]
    nl = layer_count(IS)
    for layer in range(nl):
        stale = LISTS + 2 * layer
        cur = LISTS + 2 * (nl + layer)
        first = L[cur]
        if first == -1:
            continue
        if L[stale + 1] == -1:
            L[stale] = first
        else:
            N[L[stale + 1], NEXT] = first
            N[first, PREV] = L[stale + 1]
        L[stale + 1] = L[cur + 1]
        L[cur] = -1
        L[cur + 1] = -1


@kernel
def _list_first(h: int, which: int, pin_gen: int, adm_layer: int, S: Any, IS: np.ndarray, K: Any) -> int:
    """The first key of the list at ``I1[h]`` that the cache may evict and that ``which`` takes
    (``ANY``, or only the current layer's experts that have run, or only those still to run)."""
    N = S[0]
    key = S[2][h]
    while key != -1:
        if evictable(key, pin_gen, adm_layer, IS, K) and (which == ANY or pending(key, IS, K) == (which == PENDING)):
            return key
        key = N[key, NEXT]
    return -1


@kernel
def _victim(for_prefetch: bool, pin_gen: int, adm_layer: int, again: int, S: Any, IS: np.ndarray, K: Any,
            A: Any) -> int:
    """Its lists walked in the policy's order, read from the walk's table (for the current layer
    and ``for_prefetch``: the count of lists, then each list's place and which of its keys the
    walk takes). The walk reads the lists as they are: a walk continued (``again``) is the
    same walk."""
    L = S[2]
    nl = layer_count(IS)
    t = LISTS + 4 * nl + (2 * current_layer(IS) + for_prefetch) * L[WIDTH]
    for i in range(L[t]):
        v = _list_first(LISTS + L[t + 1 + 2 * i], L[t + 2 + 2 * i], pin_gen, adm_layer, S, IS, K)
        if v != -1:
            return v
    return -1


class LeastStaleLists(KernelForm):
    """Least-stale's compiled form (:class:`LeastStale`): two queues, stale (0) and current (1),
    of one list per layer in insertion order. A touch (an insert, a use, a prefetcher's
    selection) moves a key to its layer's current list; a new pass appends each layer's current
    list to its stale list. The walk's order is the reference's ``candidates()`` (for a
    prefetch, ``prefetch_candidates()``) over these lists, tabulated once per replay
    (:func:`walk_table`)."""

    QUEUES = 2
    keeps_static = False
    reads_pending = True
    inline = True
    pure_victim = True
    insert = staticmethod(_insert)
    access = staticmethod(_access)
    remove = staticmethod(_remove)
    select = staticmethod(_select)
    new_pass = staticmethod(_new_pass)
    victim = staticmethod(_victim)

    @staticmethod
    def steps(nl: int, opt: int) -> int:
        return nl + 1 if opt else nl

    @staticmethod
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

    @classmethod
    def state(cls, policy: Any, num_keys: int) -> tuple[np.ndarray, ...]:
        nl = policy.ctx.num_layers
        table = walk_table(cls, nl, int(policy.params.order == "relative"))
        I2, F2, I1, F1, P = new_state(num_keys, i2=3, i1=LISTS + 4 * nl + table.size)
        I1[WIDTH] = table.shape[-1]
        I1[LISTS + 4 * nl:] = table.ravel()
        return I2, F2, I1, F1, P


def walk_table(form: Any, nl: int, opt: int) -> np.ndarray:
    """A list form's victim walk as a table, made once for a replay from its ``segment``: row
    ``(layer, for_prefetch)`` holds the count ``n`` of lists walked, then ``n`` pairs ``(h,
    which)`` in order (the lists ``segment`` skips left out). The kernel reads its walk from
    the table (``segment`` itself, inlined into the walk's loop, made least-stale's prefetch
    admissions slower)."""
    walk = [[[(h, which) for q in range(form.QUEUES) for step in range(form.steps(nl, opt))
              for h, which in [form.segment(q, step, fp, layer, nl, opt)] if which != SKIP]
             for fp in (False, True)] for layer in range(nl)]
    width = 1 + 2 * max(len(w) for rows in walk for w in rows)
    table = np.zeros((nl, 2, width), np.int64)
    for layer, rows in enumerate(walk):
        for fp, w in enumerate(rows):
            table[layer, fp, 0] = len(w)
            table[layer, fp, 1:1 + 2 * len(w)] = np.ravel(w)
    return table


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
    form = LeastStaleLists

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

"""Eviction policies: pick victims, never remove them (style.md, libCacheSim's ``to_evict``).

The cache (:class:`simulator.cache.ExpertCache`) owns the miss -> evict -> insert loop. It
tells the policy about inserts, uses and removals, and asks for ``candidates()``: every
cached key, most evictable first (``prefetch_candidates()`` when the room is for an optional
prefetch: a policy may decline to evict some keys for one). The cache skips pinned keys
(``docs/design.md`` step 7: the current layer's experts, or in ``per-expert`` execution the
running one; transfers in flight) and evicts only when enough can be freed; otherwise it
changes nothing and reports that it could not make room.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, ClassVar

import numpy as np

from moesim.jit import inline, jit
from moesim.policies.registry import Policy, PolicyContext, Registry

# the ``clock`` a compiled form's hooks read (moesim.policies.hooks: its docstring)
CLOCK_PASS, CLOCK_LAYER, CLOCK_TICK, CLOCK_KEYS_PER_LAYER, CLOCK_PRECISIONS, CLOCK_LAYERS, CLOCK_SIZE = range(7)


class EvictionPolicy(Policy, ABC):
    """Base class: observes cache events, orders keys for eviction. A built-in's compiled form,
    which the kernel runs in its place, is beside it: ``compiled``, a class of hooks
    (:mod:`moesim.policies.hooks`) for a policy ordered by a priority, or ``lists``, a list form
    (:class:`RecencyList` and the comment above it) for one ordered by lists."""

    compiled: ClassVar[type | None] = None
    lists: ClassVar[type | None] = None

    @abstractmethod
    def on_insert(self, key: int, demand: bool) -> None:
        """``key`` entered the cache (its transfer was issued). ``demand=True``: a miss fetched
        for immediate use, which also counts as a use (no separate :meth:`on_access`)."""

    @abstractmethod
    def on_access(self, key: int) -> None:
        """``key`` was used by a forward pass (a hit, or a late prefetch)."""

    @abstractmethod
    def on_remove(self, key: int) -> None:
        """``key`` left the cache."""

    @abstractmethod
    def candidates(self) -> Iterator[int]:
        """Every cached key, most evictable first (the cache filters pinned keys). The cache
        walks the iterator before it tells the policy of any change, so it may be a view."""

    def on_prefetch_select(self, key: int) -> None:
        """The prefetcher selected ``key``, already cached (no transfer). Default: nothing
        (recency policies do not count a selection as a use)."""

    def prefetch_candidates(self) -> Iterator[int]:
        """The keys this policy lets the cache evict to admit an optional prefetch, most
        evictable first. Default: every candidate (:meth:`candidates`)."""
        return self.candidates()


REGISTRY: Registry[EvictionPolicy] = Registry("eviction")


# -- the compiled forms of the list-ordered built-ins (lru, fifo, least-stale) -------------------
# A list form keeps its order in doubly linked lists over the kernel's key records: ``K[key].prev``
# and ``K[key].next`` (-1: none) are a cached key's neighbours in its list, and a list's head and
# tail are ``L[h]`` and ``L[h + 1]`` of an int64 array (-1: empty), ``h`` counted from the form's
# ``base``. Its functions (compiled, and called by the kernel directly, so that LLVM inlines them
# as it did the kernel's own code; a first-class hook's indirect call per event would cost the
# hot LRU path, :mod:`moesim.policies.hooks`):
#
# - ``insert(key, p, L, base, nl, K)``, ``access(...)``, ``remove(...)``: ``key`` entered the cache,
#   was used by forward pass ``p`` (a hit or a late prefetch), left it; ``select(...)``: a
#   prefetcher selected ``key`` while cached (``on_prefetch_select``); ``new_pass(p, L, base, nl,
#   K)``: pass ``p`` begins (``nl``: the model's layers);
# - the victim walk: ``steps(nl, opt)`` lists per queue, over ``QUEUES`` queues, and
#   ``segment(q, step, for_prefetch, layer, nl, opt) -> (h, which)``: the list the walk reads
#   ``step``-th in queue ``q`` and which of its keys are candidates (``ANY``;
#   ``NOT_PENDING`` or ``PENDING``: only the current layer's experts that have run, or only those
#   still to run, ``Clock.pending``; ``SKIP``: none). The kernel walks the lists in that order,
#   each from its head, and takes the first key that the cache may evict (the pinning rule is the
#   cache's, not the policy's), reading the order from a table made once (:func:`walk_table`).
#   ``opt`` is the form's one integer parameter (least-stale's ``order``: 1 relative).
#
# ``tests/test_compiled_forms.py`` drives each form, compiled, through random events against its
# reference form's ``candidates()`` and ``prefetch_candidates()``.
ANY, NOT_PENDING, PENDING, SKIP = 2, 0, 1, -1


@inline
def list_append(key: int, h: int, L: np.ndarray, K: Any) -> None:
    """Append ``key`` to the list whose head and tail are ``L[h]``, ``L[h + 1]``."""
    tail = L[h + 1]
    K[key].prev = tail
    K[key].next = -1
    if tail == -1:
        L[h] = key
    else:
        K[tail].next = key
    L[h + 1] = key


@inline
def list_unlink(key: int, h: int, L: np.ndarray, K: Any) -> None:
    """Take ``key`` out of the list at ``L[h]``."""
    prv, nxt = K[key].prev, K[key].next
    if prv == -1:
        L[h] = nxt
    else:
        K[prv].next = nxt
    if nxt == -1:
        L[h + 1] = prv
    else:
        K[nxt].prev = prv


def walk_table(form: Any, nl: int, opt: int) -> np.ndarray:
    """A list form's victim walk as a table, made once for a replay from its ``segment``: row
    ``(layer, for_prefetch)`` holds the count ``n`` of lists walked, then ``n`` pairs ``(h,
    which)`` in order (the lists ``segment`` skips left out). The kernel reads its walk from
    the table (``segment`` itself, inlined into the walk's loop, made least-stale's prefetch
    admissions slower)."""
    steps, segment = (getattr(f, "py_func", f) for f in (form.steps, form.segment))  # as Python: no compile
    walk = [[[(h, which) for q in range(form.QUEUES) for step in range(steps(nl, opt))
              for h, which in [segment(q, step, fp, layer, nl, opt)] if which != SKIP]
             for fp in (False, True)] for layer in range(nl)]
    width = 1 + 2 * max(len(w) for rows in walk for w in rows)
    table = np.zeros((nl, 2, width), np.int64)
    for layer, rows in enumerate(walk):
        for fp, w in enumerate(rows):
            table[layer, fp, 0] = len(w)
            table[layer, fp, 1:1 + 2 * len(w)] = np.ravel(w)
    return table


class RecencyList:
    """LRU's compiled form: one list, least recent first; an insert and every use move the key
    to the end (:class:`RecencyOrdered`)."""

    QUEUES = 1

    @staticmethod
    @inline
    def insert(key: int, p: int, L: np.ndarray, base: int, nl: int, K: Any) -> None:
        list_append(key, base, L, K)

    @staticmethod
    @inline
    def access(key: int, p: int, L: np.ndarray, base: int, nl: int, K: Any) -> None:
        list_unlink(key, base, L, K)
        list_append(key, base, L, K)

    @staticmethod
    @inline
    def remove(key: int, p: int, L: np.ndarray, base: int, nl: int, K: Any) -> None:
        list_unlink(key, base, L, K)

    @staticmethod
    @inline
    def select(key: int, p: int, L: np.ndarray, base: int, nl: int, K: Any) -> None:
        pass

    @staticmethod
    @inline
    def new_pass(p: int, L: np.ndarray, base: int, nl: int, K: Any) -> None:
        pass

    @staticmethod
    @inline
    def steps(nl: int, opt: int) -> int:
        return 1

    @staticmethod
    @inline
    def segment(q: int, step: int, for_prefetch: bool, layer: int, nl: int, opt: int) -> tuple[int, int]:
        return 0, ANY


class InsertionList(RecencyList):
    """FIFO's compiled form: :class:`RecencyList` whose uses do not reorder."""

    @staticmethod
    @inline
    def access(key: int, p: int, L: np.ndarray, base: int, nl: int, K: Any) -> None:
        pass


class RecencyOrdered(EvictionPolicy):
    """Shared bookkeeping: cached keys in recency order (least recent first); inserts count
    as uses. Subclasses order candidates from it (plain recency by default)."""

    def __init__(self, params: Any, ctx: PolicyContext) -> None:
        super().__init__(params, ctx)
        self._order: OrderedDict[int, None] = OrderedDict()

    def on_insert(self, key: int, demand: bool) -> None:
        self._order[key] = None

    def on_access(self, key: int) -> None:
        self._order.move_to_end(key)

    def on_remove(self, key: int) -> None:
        del self._order[key]

    def candidates(self) -> Iterator[int]:
        return iter(self._order)

    def _recency_rank(self) -> dict[int, int]:
        return {k: i for i, k in enumerate(self._order)}


@REGISTRY.register("lru")
class LRU(RecencyOrdered):
    """Least recently used: evict the expert whose last use is oldest.

    An inserted expert counts as used at insertion (a demand fetch is used at once), as in
    libCacheSim's LRU, so miss counts match it on the same access stream. The kernel runs
    :class:`RecencyList`.
    """

    lists = RecencyList


@REGISTRY.register("fifo")
class FIFO(RecencyOrdered):
    """First in, first out: evict the expert inserted longest ago; uses do not reorder. The
    kernel runs :class:`InsertionList`."""

    lists = InsertionList

    def on_access(self, key: int) -> None:
        pass


class CompiledForm:
    """The hook interface's shape (:mod:`moesim.policies.hooks`, its docstring): per-key state
    named in ``int_fields``/``float_fields``, hooks that do nothing until a form defines them,
    and ``priority`` (the victim has the lowest). A built-in's compiled form derives from it, as
    :class:`moesim.policies.hooks.HookEviction` does; one whose priority is not stable also
    gives ``priorities(keys, n, out, clock, si, sf)``, its priority over ``keys[:n]`` into
    ``out`` (a loop numba caches on disk, where one made around ``priority`` could not be)."""

    int_fields: ClassVar[tuple[str, ...]] = ()
    float_fields: ClassVar[tuple[str, ...]] = ()
    stable_priority: ClassVar[bool] = False

    @staticmethod
    def insert(key: int, demand: bool, weight: float, clock: np.ndarray, si: np.ndarray, sf: np.ndarray) -> None:
        """``key`` entered the cache (``demand``: for use now)."""

    @staticmethod
    def access(key: int, weight: float, clock: np.ndarray, si: np.ndarray, sf: np.ndarray) -> None:
        """A forward pass used ``key``."""

    @staticmethod
    def remove(key: int, clock: np.ndarray, si: np.ndarray, sf: np.ndarray) -> None:
        """``key`` left the cache."""

    @staticmethod
    def initial_state(params: Any, si: np.ndarray, sf: np.ndarray) -> None:
        """A built-in's form fills its zeroed state from the policy's parameters before the
        replay (plain Python; a hook policy does so in ``init_state``). Default: nothing."""


class LFUCompiled(CompiledForm):
    """LFU's compiled form (the hook interface of :mod:`moesim.policies.hooks`, which the
    kernel runs): a count per key that survives eviction, raised by every use (a demand insert
    is one); the victim has the lowest count, ties the oldest stamp. Its priority reads only the
    key's own count, so it is kept between victim searches (``stable_priority``)."""

    int_fields = ("count",)
    stable_priority = True

    @staticmethod
    def insert(key: int, demand: bool, weight: float, clock: np.ndarray, si: np.ndarray, sf: np.ndarray) -> None:
        if demand:
            si[key, 0] += 1

    @staticmethod
    def access(key: int, weight: float, clock: np.ndarray, si: np.ndarray, sf: np.ndarray) -> None:
        si[key, 0] += 1

    @staticmethod
    def priority(key: int, clock: np.ndarray, si: np.ndarray, sf: np.ndarray) -> float:
        return float(si[key, 0])


@REGISTRY.register("lfu")
class LFU(EvictionPolicy):
    """Least frequently used (SpecMD appendix B): evict the expert with the lowest access
    count over the whole inference history (counts survive eviction); ties go to the expert
    that reached its count longest ago. The kernel runs :class:`LFUCompiled`."""

    compiled = LFUCompiled

    def __init__(self, params: Any, ctx: PolicyContext) -> None:
        super().__init__(params, ctx)
        self._count: dict[int, int] = {}
        self._buckets: dict[int, OrderedDict[int, None]] = {}
        self._where: dict[int, int] = {}

    def _place(self, key: int, count: int) -> None:
        old = self._where.get(key)
        if old is not None:
            bucket = self._buckets[old]
            del bucket[key]
            if not bucket:
                del self._buckets[old]
        self._buckets.setdefault(count, OrderedDict())[key] = None
        self._where[key] = count

    def _bump(self, key: int) -> None:
        c = self._count.get(key, 0) + 1
        self._count[key] = c
        self._place(key, c)

    def on_insert(self, key: int, demand: bool) -> None:
        if demand:
            self._bump(key)
        else:
            self._place(key, self._count.get(key, 0))

    def on_access(self, key: int) -> None:
        self._bump(key)

    def on_remove(self, key: int) -> None:
        c = self._where.pop(key)
        bucket = self._buckets[c]
        del bucket[key]
        if not bucket:
            del self._buckets[c]

    def candidates(self) -> Iterator[int]:
        for c in sorted(self._buckets):
            yield from list(self._buckets[c])


@REGISTRY.register("random")
class Random(EvictionPolicy):
    """Evict uniformly at random (the policy's own seeded generator)."""

    def __init__(self, params: Any, ctx: PolicyContext) -> None:
        super().__init__(params, ctx)
        self._keys: dict[int, None] = {}

    def on_insert(self, key: int, demand: bool) -> None:
        self._keys[key] = None

    def on_access(self, key: int) -> None:
        pass

    def on_remove(self, key: int) -> None:
        del self._keys[key]

    def candidates(self) -> Iterator[int]:
        keys = list(self._keys)
        for i in self.ctx.rng.permutation(len(keys)):
            yield keys[int(i)]


class FLDCompiled(CompiledForm):
    """Farthest layer distance's compiled form (the hook interface of
    :mod:`moesim.policies.hooks`): the priority is minus the key's distance in layers from the
    clock's layer, ties the oldest stamp (least recent use). It reads the clock, so it is asked
    at every victim search. No state."""

    @staticmethod
    def priority(key: int, clock: np.ndarray, si: np.ndarray, sf: np.ndarray) -> float:
        return -float(abs(key // clock[CLOCK_KEYS_PER_LAYER] - clock[CLOCK_LAYER]))

    @staticmethod
    def priorities(keys: np.ndarray, n: int, out: np.ndarray, clock: np.ndarray, si: np.ndarray,
                   sf: np.ndarray) -> None:
        per, layer = clock[CLOCK_KEYS_PER_LAYER], clock[CLOCK_LAYER]
        for j in range(n):
            out[j] = -float(abs(keys[j] // per - layer))


@REGISTRY.register("fld")
class FarthestLayerDistance(RecencyOrdered):
    """Farthest layer distance (HOBBIT, Tang et al. 2024; SpecMD appendix B): evict experts
    whose layer is farthest, |layer - current layer|, from the layer being executed; ties by
    least recent use. The kernel runs :class:`FLDCompiled`."""

    compiled = FLDCompiled

    def candidates(self) -> Iterator[int]:
        cur = self.ctx.clock.layer
        layer_of = self.ctx.layer_of
        rank = self._recency_rank()
        return iter(sorted(self._order, key=lambda k: (-abs(layer_of(k) - cur), rank[k])))


def _access_index(ctx: PolicyContext, keys: list[int], key: int) -> int | None:
    """Index of the access of ``key`` at the clock's (pass, layer), or None. ``keys`` are the
    workload's accesses as cache keys (``ctx.cache_keys(workload.keys()).tolist()``)."""
    wl = ctx.workload
    base = ctx.clock.pass_index * ctx.num_layers + ctx.clock.layer
    lo, hi = int(wl.off[base]), int(wl.off[base + 1])
    try:
        return int(keys.index(key, lo, hi))
    except ValueError:
        return None


def access_weight(ctx: PolicyContext, keys: list[int], key: int) -> float:
    """The summed gate weight of the access of ``key`` at the clock's (pass, layer), 0 when
    there is none (the kernel's ``_weight``); ``keys`` as for :func:`_access_index`."""
    i = _access_index(ctx, keys, key) if ctx.workload is not None else None
    return 0.0 if i is None else float(ctx.workload.acc_weight[i])


@jit
def _score_credit(key: int, weight: float, clock: np.ndarray, si: np.ndarray, sf: np.ndarray) -> None:
    """Score eviction's credit (:class:`ScoreCompiled`): at the first credit of a forward pass,
    every key's score is multiplied by ``decay`` once per pass since the last such decay (from
    pass 0 at the first); then ``key``'s score gains ``weight`` -- as :meth:`ScoreBased._credit`."""
    p = clock[CLOCK_PASS]
    decay, last = sf[key, 1], si[key, 0]
    if decay != 1.0 and p != last:
        f = math.pow(decay, float(p - max(last, 0)))
        for k in range(sf.shape[0]):
            sf[k, 0] *= f
            si[k, 0] = p
    sf[key, 0] = sf[key, 0] + weight


class ScoreCompiled(CompiledForm):
    """Score eviction's compiled form (the hook interface of :mod:`moesim.policies.hooks`):
    per key its score (``sf[:, 0]``), the policy's decay (``sf[:, 1]``, the same in every row)
    and the pass the scores were last decayed at (``si[:, 0]``, -1 before any: every row is
    decayed at once, so the rows agree). A demand insert and a use credit the key with the
    access's gate weight; the victim has the lowest score, ties the oldest stamp (least recent
    use). A decay changes every key's score, so the priority is asked at each victim search."""

    int_fields = ("decayed_at",)
    float_fields = ("score", "decay")

    @staticmethod
    def initial_state(params: Any, si: np.ndarray, sf: np.ndarray) -> None:
        si[:, 0] = -1
        sf[:, 1] = params.decay

    @staticmethod
    def insert(key: int, demand: bool, weight: float, clock: np.ndarray, si: np.ndarray, sf: np.ndarray) -> None:
        if demand:
            _score_credit(key, weight, clock, si, sf)

    @staticmethod
    def access(key: int, weight: float, clock: np.ndarray, si: np.ndarray, sf: np.ndarray) -> None:
        _score_credit(key, weight, clock, si, sf)

    @staticmethod
    def priority(key: int, clock: np.ndarray, si: np.ndarray, sf: np.ndarray) -> float:
        return sf[key, 0]

    @staticmethod
    def priorities(keys: np.ndarray, n: int, out: np.ndarray, clock: np.ndarray, si: np.ndarray,
                   sf: np.ndarray) -> None:
        for j in range(n):
            out[j] = sf[keys[j], 0]


@dataclass(frozen=True)
class ScoreParams:
    """Parameters of score-based eviction."""

    decay: float = field(default=1.0, metadata={
        "help": "multiply every accumulated score by this at each forward pass, in (0, 1] (1 = plain sum)"})

    def __post_init__(self) -> None:
        if not 0 < self.decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")


@REGISTRY.register("score")
class ScoreBased(RecencyOrdered):
    """Score-based eviction (Zhu et al. 2025; SpecMD appendix B): evict the expert with the
    lowest accumulated gate score, the running sum of the router weights its tokens gave it;
    ties by least recent use. The kernel runs :class:`ScoreCompiled`."""

    Params = ScoreParams
    compiled = ScoreCompiled

    def __init__(self, params: ScoreParams, ctx: PolicyContext) -> None:
        super().__init__(params, ctx)
        self._score: dict[int, float] = {}
        self._pass = -1
        self._keys = ctx.cache_keys(ctx.workload.keys()).tolist() if ctx.workload is not None else []

    def _credit(self, key: int) -> None:
        ctx = self.ctx
        if self.params.decay != 1.0 and ctx.clock.pass_index != self._pass:
            steps = ctx.clock.pass_index - max(self._pass, 0)
            f = self.params.decay ** steps
            for k in self._score:
                self._score[k] *= f
            self._pass = ctx.clock.pass_index
        self._score[key] = self._score.get(key, 0.0) + access_weight(ctx, self._keys, key)

    def on_insert(self, key: int, demand: bool) -> None:
        super().on_insert(key, demand)
        if demand:
            self._credit(key)

    def on_access(self, key: int) -> None:
        super().on_access(key)
        self._credit(key)

    def candidates(self) -> Iterator[int]:
        rank = self._recency_rank()
        return iter(sorted(self._order, key=lambda k: (self._score.get(k, 0.0), rank[k])))


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


class FutureUses:
    """Belady's compiled form: at each insert and use the kernel sets a key's next use with
    :meth:`next_use` (over the kernel's sorted access indices of that key), and its victim is
    the cached key of lowest :meth:`priority`, ties to the oldest stamp (as :class:`Belady`
    sorts, stably, by next use, farthest first)."""

    @staticmethod
    @inline
    def next_use(pos: np.ndarray, a: int, b: int, i: int, base: int, after: int) -> float:
        """The first access after access ``i`` of a key whose accesses in the piece being
        replayed are ``pos[a:b]`` (sorted, counted from the piece's start, ``base`` over the
        whole trace), or past them its first access after the piece, ``after`` (-1: none,
        ``inf``)."""
        end = b
        while a < b:  # the first position > i (searchsorted right)
            m = (a + b) >> 1
            if pos[m] <= i:
                a = m + 1
            else:
                b = m
        if a == end:
            return math.inf if after < 0 else float(after)
        return float(base + pos[a])

    @staticmethod
    @inline
    def priority(next_use: float) -> float:
        """The farthest next use goes first."""
        return -next_use


@REGISTRY.register("belady")
class Belady(EvictionPolicy):
    """Belady's MIN: evict the expert whose next use is furthest in the future (never used
    again first), read from the trace. The optimal bound every other policy is measured
    against (for the same pinning rules). The kernel runs :class:`FutureUses`."""

    def __init__(self, params: Any, ctx: PolicyContext) -> None:
        super().__init__(params, ctx)
        if ctx.workload is None:
            raise ValueError("belady needs the workload to read future accesses")
        keys = ctx.cache_keys(ctx.workload.keys())
        self._keys = keys.tolist()
        order = np.argsort(keys, kind="stable")
        sk = keys[order]
        starts = np.flatnonzero(np.r_[True, sk[1:] != sk[:-1]])
        ends = np.r_[starts[1:], len(sk)]
        self._positions = {int(sk[s]): order[s:e] for s, e in zip(starts, ends, strict=True)}
        self._next: dict[int, float] = {}

    def _next_use(self, key: int) -> float:
        ctx = self.ctx
        pos = self._positions.get(key)
        if pos is None:
            return float("inf")
        i = _access_index(ctx, self._keys, key)
        if i is None:
            i = int(ctx.workload.off[ctx.clock.pass_index * ctx.num_layers + ctx.clock.layer]) - 1
        j = int(np.searchsorted(pos, i, side="right"))
        return float(pos[j]) if j < len(pos) else float("inf")

    def on_insert(self, key: int, demand: bool) -> None:
        self._next[key] = self._next_use(key)

    def on_access(self, key: int) -> None:
        self._next[key] = self._next_use(key)

    def on_remove(self, key: int) -> None:
        del self._next[key]

    def candidates(self) -> Iterator[int]:
        return iter(sorted(self._next, key=lambda k: -self._next[k]))


class LHUCompiled(CompiledForm):
    """Least high-precision used's compiled form (the hook interface of
    :mod:`moesim.policies.hooks`): a count per key of its uses at the highest precision
    (precision index 0: ``key % clock[CLOCK_PRECISIONS]``), which survives eviction; a
    lower-precision copy has priority 0, a highest-precision one its count plus one, ties the
    oldest stamp. The priority reads only the key, so it is kept."""

    int_fields = ("hp_uses",)
    stable_priority = True

    @staticmethod
    def insert(key: int, demand: bool, weight: float, clock: np.ndarray, si: np.ndarray, sf: np.ndarray) -> None:
        if demand and key % clock[CLOCK_PRECISIONS] == 0:
            si[key, 0] += 1

    @staticmethod
    def access(key: int, weight: float, clock: np.ndarray, si: np.ndarray, sf: np.ndarray) -> None:
        if key % clock[CLOCK_PRECISIONS] == 0:
            si[key, 0] += 1

    @staticmethod
    def priority(key: int, clock: np.ndarray, si: np.ndarray, sf: np.ndarray) -> float:
        return float(si[key, 0] + 1) if key % clock[CLOCK_PRECISIONS] == 0 else 0.0


@REGISTRY.register("lhu")
class LeastHighPrecisionUsed(RecencyOrdered):
    """Least high-precision used (HOBBIT, Tang et al. 2024; SpecMD appendix B): lower-
    precision copies go first (cheap to re-fetch, least recently used first); then
    highest-precision experts by how often they were used at that precision (fewest first,
    ties by least recent use). Pair it with a precision cascade miss policy. The kernel runs
    :class:`LHUCompiled`."""

    compiled = LHUCompiled

    def __init__(self, params: Any, ctx: PolicyContext) -> None:
        super().__init__(params, ctx)
        self._hp_uses: dict[int, int] = {}

    def _use(self, key: int) -> None:
        self._order.move_to_end(key)
        if self.ctx.precision_of(key) == 0:
            self._hp_uses[key] = self._hp_uses.get(key, 0) + 1

    def on_insert(self, key: int, demand: bool) -> None:
        super().on_insert(key, demand)
        if demand:
            self._use(key)

    def on_access(self, key: int) -> None:
        self._use(key)

    def candidates(self) -> Iterator[int]:
        rank = self._recency_rank()
        prec = self.ctx.precision_of
        return iter(sorted(self._order, key=lambda k: (
            prec(k) == 0, self._hp_uses.get(k, 0) if prec(k) == 0 else 0, rank[k])))

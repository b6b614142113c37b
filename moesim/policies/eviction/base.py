"""The eviction family's base: pick victims, never remove them (style.md, libCacheSim's
``to_evict``).

The cache (:class:`simulator.cache.ExpertCache`) owns the miss -> evict -> insert loop. It
tells the policy about inserts, uses and removals, and asks for ``candidates()``: every
cached key, most evictable first (``prefetch_candidates()`` when the room is for an optional
prefetch: a policy may decline to evict some keys for one). The cache skips pinned keys
(``docs/design.md`` step 7: the current layer's experts, or in ``per-expert`` execution the
running one; transfers in flight) and evicts only when enough can be freed; otherwise it
changes nothing and reports that it could not make room. Each policy is a module of this
package; this one holds what they share."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np

from moesim.jit import inline
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

    def on_miss(self, key: int) -> None:
        """A demand lookup missed ``key`` (neither resident nor in flight) and the cache is about
        to make room for it: libCacheSim's ``find`` on a miss, where a policy with ghost lists
        (ARC, S3-FIFO) learns that the key was recently evicted. Called before
        :meth:`candidates`. Default: nothing."""

    def on_withdraw(self, key: int) -> None:
        """A prefetch of ``key`` was withdrawn before its copy started: it leaves the cache
        without having been evicted (a policy with ghost lists does not remember it). Default:
        :meth:`on_remove`."""
        self.on_remove(key)

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

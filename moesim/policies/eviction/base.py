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
    which the kernel runs in its place, is beside it in its module: ``form``, a
    :class:`KernelForm`; or ``compiled``, a class of hooks (:mod:`moesim.policies.hooks`) for a
    policy ordered by a priority, which the kernel runs through the hook policies' form.
    ``reads_future``: the policy reads the trace's future (Belady): a replay a piece at a time
    gives it every key's next use after the piece, and serving cannot run it."""

    form: ClassVar[type[KernelForm] | None] = None
    compiled: ClassVar[type | None] = None
    reads_future: ClassVar[bool] = False

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


# -- compiled forms -----------------------------------------------------------------------------
# A policy's compiled form (:class:`KernelForm`) is what the compiled replay runs in its place.
# The kernel reaches it only through the seven hooks below, each a compiled function the kernel
# calls directly (every built-in form is compiled into the kernel, which picks the replay's by its
# index, :mod:`moesim.policies.eviction.forms`; LLVM inlines the hooks as if they were the
# kernel's own code). ``S`` is the form's own state: five arrays it allocates
# (:meth:`KernelForm.state`), the same types for every form -- per key ints and floats ``I2``,
# ``F2``; ints and floats of its own ``I1``, ``F1``; and ``P``, ints made anew for each piece of a
# trace read in pieces (:meth:`KernelForm.piece`). ``IS``, ``K``, ``DI`` and ``A`` are the
# replay's; a form reads them through the accessors of :mod:`moesim.kernel_state`
# (``current_pass``, ``evictable``, ``access_of`` ...).
#
# - ``insert(key, demand, ai, S, IS, K, DI, A)``: ``key`` entered the cache (``demand``: a miss
#   fetched for use now, also a use; ``ai`` its access, -1 for none);
# - ``access(key, ai, S, IS, K, DI, A)``: a forward pass used ``key`` (a hit or a late prefetch);
# - ``remove(key, evicted, S, IS, K, A)``: ``key`` left the cache, evicted (1) or withdrawn (0);
# - ``select(key, S, IS, K)``: a prefetcher selected the cached ``key``;
# - ``new_pass(S, IS, K)``: a forward pass begins;
# - ``miss(key, S, IS, K, A)``: a demand lookup missed ``key`` and room is about to be made for it;
# - ``victim(for_prefetch, pin_gen, adm_layer, again, S, IS, K, A) -> key``: the policy's next
#   victim that the cache may evict (``evictable(key, pin_gen, adm_layer, IS, K)``), or -1. The
#   form walks its own order, as its reference form's ``candidates()`` (``prefetch_candidates()``
#   when ``for_prefetch``) does; ``again`` (1) continues the walk of the call before, which found
#   a victim that did not free enough room (entries of several sizes): the reference's iterator
#   goes on.
#
# ``keeps_static = False`` declares a form that never hears of the statically pinned keys (they
# are never victims: a list form's walk need not pass over them), ``reads_pending = True`` one
# whose walk reads ``pending``, ``inline = True`` one whose hooks the kernel inlines where it calls
# them (small and hot: lru, fifo, least-stale; the others are called, which keeps compiles short),
# ``rare = True`` one compiled into a kernel of its own group (:mod:`moesim.policies.eviction.forms`:
# a replay of a common form never compiles it; every form a kernel dispatches to lengthens the
# compile of each function that calls it),
# ``pure_victim = True`` one whose ``victim`` changes none of its state, so that the cache need not
# call it when no key is resident (a saturated link: every demand miss would walk the whole cache
# for nothing; SIEVE's hand and S3-FIFO's queues move as they walk, so theirs must be called).
# ``tests/test_compiled_forms.py`` drives each form against its reference form's candidates; the
# golden grid holds both replay paths to the same rows.
ANY, NOT_PENDING, PENDING, SKIP = 2, 0, 1, -1
# ``A.hooks``: ``HOOK_STATE``, the running hook form's clock and state (one set of arrays whichever
# form runs); ``HOOK_PART``, the compiled hooks of the hook form in the replay's group of forms (the
# priority-ordered hooks', :class:`moesim.policies.hooks.PriorityHooks`, among the common forms; the
# list-shaped ones', :class:`moesim.policies.list_hooks.ListHooks`, among the rare; hooks never called
# where the replay's form is another); ``FORM_GROUP``, the mark of that group, whose type picks the
# forms the kernel is compiled with (:mod:`moesim.policies.eviction.forms`). Every kernel function is
# handed ``A``: each array in it lengthens their compile.
HOOK_STATE, HOOK_PART, FORM_GROUP = 0, 1, 2
# ``A.hooks[HOOK_STATE]``: the clock, the per-key state ``si``, ``sf``, and an int64 and a float64
# vector (the priority hooks' members and their priorities; the list hooks' ``gi``, ``gf``)
HS_CLOCK, HS_SI, HS_SF, HS_INTS, HS_FLOATS = range(5)
PREV, NEXT = 0, 1  # a list form's links: columns of I2 (-1: none)


@inline
def list_append(key: int, h: int, L: np.ndarray, N: np.ndarray) -> None:
    """Append ``key`` to the list whose head and tail are ``L[h]``, ``L[h + 1]`` (links in
    ``N[:, PREV]``, ``N[:, NEXT]``)."""
    tail = L[h + 1]
    N[key, PREV] = tail
    N[key, NEXT] = -1
    if tail == -1:
        L[h] = key
    else:
        N[tail, NEXT] = key
    L[h + 1] = key


@inline
def list_unlink(key: int, h: int, L: np.ndarray, N: np.ndarray) -> None:
    """Take ``key`` out of the list at ``L[h]``."""
    prv, nxt = N[key, PREV], N[key, NEXT]
    if prv == -1:
        L[h] = nxt
    else:
        N[prv, NEXT] = nxt
    if nxt == -1:
        L[h + 1] = prv
    else:
        N[nxt, PREV] = prv


@inline
def _no_select(key: int, S: Any, IS: np.ndarray, K: Any) -> None:
    pass


@inline
def _no_new_pass(S: Any, IS: np.ndarray, K: Any) -> None:
    pass


@inline
def _no_miss(key: int, S: Any, IS: np.ndarray, K: Any, A: Any) -> None:
    pass


def new_state(num_keys: int, i2: int = 0, f2: int = 0, i1: int = 0, f1: int = 0,
              fill: int = -1) -> tuple[np.ndarray, ...]:
    """A form's state arrays (:class:`KernelForm`): ``i2`` int columns per key (``fill``ed),
    ``f2`` float ones (0), ``i1`` ints (``fill``), ``f1`` floats (0), and an empty ``P``; each at
    least one element, so that every form's arrays have the same types."""
    return (np.full((num_keys, max(1, i2)), fill, np.int64), np.zeros((num_keys, max(1, f2))),
            np.full(max(1, i1), fill, np.int64), np.zeros(max(1, f1)), np.zeros(1, np.int64))


class KernelForm:
    """A policy's compiled form: its seven hooks (the comment above) and, in Python, its state.
    ``select``, ``new_pass`` and ``miss`` do nothing until a form defines them."""

    keeps_static: ClassVar[bool] = True
    reads_pending: ClassVar[bool] = False
    inline: ClassVar[bool] = False
    pure_victim: ClassVar[bool] = False
    rare: ClassVar[bool] = False
    select = staticmethod(_no_select)
    new_pass = staticmethod(_no_new_pass)
    miss = staticmethod(_no_miss)

    @classmethod
    def state(cls, policy: Any, num_keys: int) -> tuple[np.ndarray, ...]:
        """The form's state arrays for a replay of ``policy`` over ``num_keys`` cache keys."""
        raise NotImplementedError

    @classmethod
    def piece(cls, policy: Any, S: tuple[np.ndarray, ...], wl: Any, after: Any,
              num_keys: int) -> tuple[np.ndarray, ...]:
        """The state for the piece ``wl`` of the trace (the whole trace, or a piece of a file
        read in pieces: ``after`` is then its first access and every key's first access after it,
        :func:`moesim.simulator.stream.accesses_after`, else None). Default: ``S`` as it is."""
        return S

    @classmethod
    def first_class(cls, policy: Any, S: tuple[np.ndarray, ...]) -> tuple[tuple[Any, ...], tuple[Any, ...]] | None:
        """A hook form's part of ``A.hooks`` for ``policy`` (its compiled hooks,
        :mod:`moesim.policies.hooks`) and ``A.hooks[HOOK_STATE]`` (their state); None for every
        other form. Where the replay's form is another of the hook form's group, its part holds
        hooks that are never called (``unused()``: the same types, one compiled kernel for the
        group; :func:`moesim.policies.eviction.forms.hooks_of`)."""
        return None

    @classmethod
    def functions(cls) -> tuple[Any, ...]:
        """The seven hooks, in the order the kernel indexes them."""
        return (cls.insert, cls.access, cls.remove, cls.select, cls.new_pass, cls.miss,  # type: ignore[attr-defined]
                cls.victim)  # type: ignore[attr-defined]


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
    base = (ctx.clock.pass_index - ctx.clock.pass_base) * ctx.num_layers + ctx.clock.layer
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

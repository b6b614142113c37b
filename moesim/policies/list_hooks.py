"""Eviction policies that keep an order of their own (lists, queues, a hand), written as hooks:
one definition that both replay paths run.

A priority-ordered policy (:class:`moesim.policies.hooks.HookEviction`) says how much each key
is worth; a list-shaped one (SIEVE, S3-FIFO, ARC, CLOCK, 2Q) keeps its keys in an order it
changes as they are used, and walks that order to find a victim. :class:`HookListEviction` is
that shape as libCacheSim gives it (an algorithm's ``find``, ``insert``, ``to_evict`` and
``remove``), in five functions over numbers and numpy arrays:

- ``insert(key, demand, weight, clock, si, sf, gi, gf)``: ``key`` entered the cache
  (``demand``: a miss fetched it for use now, also a use; else a prefetch did);
- ``access(key, weight, clock, si, sf, gi, gf)``: a forward pass used ``key`` (a hit, or a late
  prefetch);
- ``remove(key, evicted, clock, si, sf, gi, gf)``: ``key`` left the cache: evicted (True), or a
  prefetch withdrawn before its copy started (False; a policy with ghost lists forgets it);
- ``miss(key, clock, si, sf, gi, gf)``: a demand lookup missed ``key`` and the cache is about to
  make room for it (where a policy with ghost lists learns that ``key`` was evicted lately);
- ``candidate(first, clock, si, sf, gi, gf) -> key``: the next key of the policy's walk toward
  a victim, or -1 when the walk has offered every key it will. ``first`` is True for the first
  key of a walk. The cache takes the first key it may evict (resident, not pinned: the
  policy need not know which those are) and asks again, ``first`` False, while the victims it
  has found free too little room. A walk offers each key at most once (and so at most as many
  keys as the cache has): one that offers more ends the replay with an error.

``weight``, ``clock`` and ``si``/``sf`` (a row per cache key, a column per name in
``int_fields``/``float_fields``) are those of the priority hooks (:mod:`moesim.policies.hooks`).
``gi`` (int64) and ``gf`` (float64) hold the policy's other state, an entry per name in
``global_int_fields``/``global_float_fields``: a list's head and tail, a hand, a ghost list's
size. All four are zero at the start, or as :meth:`HookListEviction.init_state` fills them.

The SimPy path calls the functions as written; the kernel calls them compiled by numba, as
first-class functions in its part of ``A.hooks`` (:class:`ListHooks`: one compiled kernel for
every such policy). A policy whose functions numba cannot compile runs on the SimPy path, and
the replay says why in a line. Compiled hooks check their indices, as the priority hooks do.
"""

from __future__ import annotations

import functools
import warnings
from abc import abstractmethod
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np

from moesim.jit import inline, kernel
from moesim.kernel_state import access_of, current_layer, current_pass, evictable
from moesim.kernel_state import access_weight as weight_of
from moesim.policies.eviction import CLOCK_LAYER, CLOCK_PASS, CLOCK_TICK
from moesim.policies.eviction.base import (
    HOOK_PART,
    HOOK_STATE,
    HS_CLOCK,
    HS_FLOATS,
    HS_INTS,
    HS_SF,
    HS_SI,
    KernelForm,
    new_state,
)
from moesim.policies.hooks import (
    Clocked,
    _builtin,
    _first_line,
    _once,
    _raised,
    as_addresses,
    first_class_functions,
    state_arrays,
)
from moesim.policies.registry import PolicyContext

__all__ = ["HookListEviction", "ListHooks"]

HOOKS = ("insert", "access", "remove", "miss", "candidate")


class HookListEviction(Clocked):
    """An eviction policy that walks an order of its own, given as hooks (module docstring).
    Subclasses define ``candidate`` and, as they need, ``insert``, ``access``, ``remove`` and
    ``miss`` (each a ``staticmethod``), and name their state in ``int_fields``/``float_fields``
    (a row per cache key) and ``global_int_fields``/``global_float_fields``. :meth:`init_state`
    may fill the state from ``self.params`` before the replay."""

    int_fields: ClassVar[tuple[str, ...]] = ()
    float_fields: ClassVar[tuple[str, ...]] = ()
    global_int_fields: ClassVar[tuple[str, ...]] = ()
    global_float_fields: ClassVar[tuple[str, ...]] = ()

    @staticmethod
    def insert(key: int, demand: bool, weight: float, clock: np.ndarray, si: np.ndarray, sf: np.ndarray,
               gi: np.ndarray, gf: np.ndarray) -> None:
        """``key`` entered the cache (``demand``: for use now)."""

    @staticmethod
    def access(key: int, weight: float, clock: np.ndarray, si: np.ndarray, sf: np.ndarray, gi: np.ndarray,
               gf: np.ndarray) -> None:
        """A forward pass used ``key``."""

    @staticmethod
    def remove(key: int, evicted: bool, clock: np.ndarray, si: np.ndarray, sf: np.ndarray, gi: np.ndarray,
               gf: np.ndarray) -> None:
        """``key`` left the cache (``evicted``; else a prefetch withdrawn)."""

    @staticmethod
    def miss(key: int, clock: np.ndarray, si: np.ndarray, sf: np.ndarray, gi: np.ndarray, gf: np.ndarray) -> None:
        """A demand lookup missed ``key``; room is about to be made for it."""

    @staticmethod
    @abstractmethod
    def candidate(first: bool, clock: np.ndarray, si: np.ndarray, sf: np.ndarray, gi: np.ndarray,
                  gf: np.ndarray) -> int:
        """The walk's next key (``first``: a new walk), or -1 when it has offered every key."""

    def __init__(self, params: Any, ctx: PolicyContext) -> None:
        super().__init__(params, ctx)
        self.clock, self.si, self.sf = state_arrays(type(self), ctx.num_layers, ctx.keys_per_layer,
                                                    len(ctx.precisions))
        self.gi = np.zeros(max(1, len(self.global_int_fields)), np.int64)
        self.gf = np.zeros(max(1, len(self.global_float_fields)), np.float64)
        self.init_state()

    def init_state(self) -> None:
        """Fill the state before the replay (``self.si``, ``self.sf``, ``self.gi``, ``self.gf``
        are zero; ``self.params`` holds the policy's parameters). Default: nothing."""

    def reset_state(self) -> None:
        """Back to the state before any insert, as :meth:`init_state` left it, the tick at 0
        (the kernel replays from there, in the same arrays)."""
        for a in (self.si, self.sf, self.gi, self.gf):
            a[:] = 0
        self.init_state()
        self.clock[CLOCK_PASS:CLOCK_TICK + 1] = 0

    def _call(self, hook: str, *args: Any) -> Any:
        try:
            return getattr(type(self), hook)(*args, self.si, self.sf, self.gi, self.gf)
        except Exception as exc:
            raise _raised(self, hook, exc, _STATE_HINT) from None

    def on_insert(self, key: int, demand: bool) -> None:
        clock = self._at(True)
        self._call("insert", key, demand, self._weight(key) if demand else 0.0, clock)

    def on_access(self, key: int) -> None:
        clock = self._at(True)
        self._call("access", key, self._weight(key), clock)

    def on_remove(self, key: int) -> None:
        self._call("remove", key, True, self._at(False))

    def on_withdraw(self, key: int) -> None:
        self._call("remove", key, False, self._at(False))

    def on_miss(self, key: int) -> None:
        self._call("miss", key, self._at(False))

    def candidates(self) -> Iterator[int]:
        """The walk: ``candidate`` asked until it answers -1 (or the cache has its victims),
        each answer checked."""
        clock = self._at(False)
        num_keys = len(self.si)
        first = True
        offered = 0
        while True:
            key = int(self._call("candidate", first, clock))
            first = False
            if key == -1:
                return
            if not 0 <= key < num_keys:
                raise _bad_key(self, key, num_keys)
            offered += 1
            if offered > num_keys:
                raise _endless(self, num_keys)
            yield key


_STATE_HINT = ("si and sf have a row per cache key and a column per name in int_fields and float_fields; gi and gf "
               "an entry per name in global_int_fields and global_float_fields; clock has CLOCK_SIZE entries.")
_BAD_KEY = "returned a key that is not a cache key (-1 ends the walk)"
_ENDLESS = ("offered more keys in one walk than there are cache keys: return -1 once the walk has offered every key "
            "(a walk that goes round again never ends)")


def _bad_key(policy: HookListEviction, key: int, num_keys: int) -> Exception:
    from moesim.errors import MoesimError

    clock = policy.ctx.clock
    return MoesimError(f"eviction policy '{policy.name}': its candidate hook {_BAD_KEY}: {key}, where the keys are "
                       f"0 to {num_keys - 1} (forward pass {clock.pass_index}, layer {clock.layer}).")


def _endless(policy: HookListEviction, num_keys: int) -> Exception:
    from moesim.errors import MoesimError

    clock = policy.ctx.clock
    return MoesimError(f"eviction policy '{policy.name}': its candidate hook {_ENDLESS} (forward pass "
                       f"{clock.pass_index}, layer {clock.layer}; {num_keys} cache keys).")


@functools.cache
def _signatures() -> tuple[Any, ...]:
    from numba.core import types

    clock, si, sf, gi, gf = (types.int64[::1], types.int64[:, ::1], types.float64[:, ::1], types.int64[::1],
                             types.float64[::1])
    b, i, f = types.boolean, types.int64, types.float64
    return (types.void(i, b, f, clock, si, sf, gi, gf),
            types.void(i, f, clock, si, sf, gi, gf),
            types.void(i, b, clock, si, sf, gi, gf),
            types.void(i, clock, si, sf, gi, gf),
            types.int64(b, clock, si, sf, gi, gf))


def compiled_lists(cls: type) -> tuple[Any, ...] | str:
    """``cls``'s five hooks compiled by numba (a user's with its indices checked), or why one
    does not compile (a line). Made once per process and class."""
    return _once(cls, _compile)


def _compile(cls: type) -> tuple[Any, ...] | str:
    from moesim.jit import njit

    shipped = _builtin(cls)
    out = []
    for name, sig in zip(HOOKS, _signatures(), strict=True):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out.append(njit(sig, cache=shipped, boundscheck=not shipped)(getattr(cls, name)))
        except Exception as exc:  # numba's typing and lowering errors have no common base
            return f"its {name} hook does not compile with numba ({_first_line(exc)})"
    return tuple(out)


# A.hooks[HOOK_PART]: the hooks (insert, access, remove, miss, candidate), the clock and the state
L_INSERT, L_ACCESS, L_REMOVE, L_MISS, L_CANDIDATE = range(5)
# the form's I1: the tick, the keys the walk has offered, and whether the policy defines each of
# insert, access, remove and miss (one it leaves as it is does nothing: not called)
TICK, OFFERS, HAS = 0, 1, 2


def _part(fns: tuple[Any, ...], clock: np.ndarray, si: np.ndarray, sf: np.ndarray, gi: np.ndarray,
          gf: np.ndarray) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """:class:`ListHooks`' part of ``A.hooks`` (each hook a first-class function,
    :func:`moesim.policies.hooks.first_class_functions`) and the state beside it."""
    return first_class_functions(fns), (clock, si, sf, gi, gf)


@inline
def _set_clock(S: Any, IS: np.ndarray, A: Any) -> None:
    clock = A.hooks[HOOK_STATE][HS_CLOCK]
    clock[CLOCK_PASS] = current_pass(IS)
    clock[CLOCK_LAYER] = current_layer(IS)
    clock[CLOCK_TICK] = S[2][TICK]


@kernel
def _insert(key: int, demand: bool, ai: int, S: Any, IS: np.ndarray, K: Any, DI: np.ndarray, A: Any) -> None:
    S[2][TICK] += 1
    if not S[2][HAS + L_INSERT]:
        return
    w = float(weight_of(access_of(key, ai, IS, DI, A), A)) if demand else 0.0
    _set_clock(S, IS, A)
    H, St = A.hooks[HOOK_PART], A.hooks[HOOK_STATE]
    H[L_INSERT][0](key, demand != 0, w, St[HS_CLOCK], St[HS_SI], St[HS_SF], St[HS_INTS], St[HS_FLOATS])


@kernel
def _access(key: int, ai: int, S: Any, IS: np.ndarray, K: Any, DI: np.ndarray, A: Any) -> None:
    S[2][TICK] += 1
    if not S[2][HAS + L_ACCESS]:
        return
    _set_clock(S, IS, A)
    H, St = A.hooks[HOOK_PART], A.hooks[HOOK_STATE]
    H[L_ACCESS][0](key, float(weight_of(access_of(key, ai, IS, DI, A), A)), St[HS_CLOCK], St[HS_SI], St[HS_SF],
                   St[HS_INTS], St[HS_FLOATS])


@kernel
def _remove(key: int, evicted: int, S: Any, IS: np.ndarray, K: Any, A: Any) -> None:
    if not S[2][HAS + L_REMOVE]:
        return
    _set_clock(S, IS, A)
    H, St = A.hooks[HOOK_PART], A.hooks[HOOK_STATE]
    H[L_REMOVE][0](key, evicted != 0, St[HS_CLOCK], St[HS_SI], St[HS_SF], St[HS_INTS], St[HS_FLOATS])


@kernel
def _miss(key: int, S: Any, IS: np.ndarray, K: Any, A: Any) -> None:
    if not S[2][HAS + L_MISS]:
        return
    _set_clock(S, IS, A)
    H, St = A.hooks[HOOK_PART], A.hooks[HOOK_STATE]
    H[L_MISS][0](key, St[HS_CLOCK], St[HS_SI], St[HS_SF], St[HS_INTS], St[HS_FLOATS])


@kernel
def _victim(for_prefetch: bool, pin_gen: int, adm_layer: int, again: int, S: Any, IS: np.ndarray, K: Any,
            A: Any) -> int:
    """The first key of the policy's walk (its ``candidate`` hook) that the cache may evict, or
    -1; ``again``: the walk goes on. A key out of range, or more keys than the cache has in one
    walk, raise ValueError (:class:`HookListEviction.candidates` says the same)."""
    I1 = S[2]
    H, St = A.hooks[HOOK_PART], A.hooks[HOOK_STATE]
    first = again == 0
    if first:
        I1[OFFERS] = 0
    _set_clock(S, IS, A)
    num_keys = S[0].shape[0]
    while True:
        key = H[L_CANDIDATE][0](first, St[HS_CLOCK], St[HS_SI], St[HS_SF], St[HS_INTS], St[HS_FLOATS])
        first = False
        if key == -1:
            return -1
        if key < 0 or key >= num_keys:
            raise ValueError("a list policy's candidate hook returned a key that is not a cache key (-1 ends the walk)")
        I1[OFFERS] += 1
        if I1[OFFERS] > num_keys:
            raise ValueError("a list policy's candidate hook offered more keys in one walk than there are cache keys: "
                             "return -1 once the walk has offered every key")
        if evictable(key, pin_gen, adm_layer, IS, K):
            return key


class ListHooks(KernelForm):
    """The compiled form of every :class:`HookListEviction` policy: the hooks called through
    ``A.hooks[HOOK_PART]`` (first-class functions: one compiled kernel for all of them), the
    tick, the walk's count and which hooks the policy defines in its arrays."""

    rare = True
    insert = staticmethod(_insert)
    access = staticmethod(_access)
    remove = staticmethod(_remove)
    miss = staticmethod(_miss)
    victim = staticmethod(_victim)

    @classmethod
    def state(cls, policy: Any, num_keys: int) -> tuple[np.ndarray, ...]:
        I2, F2, I1, F1, P = new_state(num_keys, i1=HAS + L_CANDIDATE)
        I1[:] = 0
        for j, name in enumerate(HOOKS[:L_CANDIDATE]):
            I1[HAS + j] = getattr(type(policy), name) is not getattr(HookListEviction, name)
        return I2, F2, I1, F1, P

    @classmethod
    def first_class(cls, policy: Any, S: tuple[np.ndarray, ...]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """The policy's compiled hooks and its own arrays (so that it holds the replay's final
        state after it, as on the SimPy path), reset to before the pinned experts' inserts,
        which the kernel's preload makes again. A user's hooks go as numba's dispatchers: an
        error one raises reaches the replay."""
        policy.reset_state()
        fns = compiled_lists(type(policy))
        assert isinstance(fns, tuple), fns
        return _part(fns, policy.clock, policy.si, policy.sf, policy.gi, policy.gf)

    @classmethod
    def unused(cls) -> tuple[Any, ...]:
        """Its part of ``A.hooks`` when the replay's form is another: hooks never called, of the
        types the real ones have."""
        return first_class_functions(_addresses(_NoList))


END = -1  # a walk's end: the answer of a candidate hook that offers no more keys


class _NoList(HookListEviction):
    """The hooks of :meth:`ListHooks.unused` (never called)."""

    @staticmethod
    def candidate(first: bool, clock: np.ndarray, si: np.ndarray, sf: np.ndarray, gi: np.ndarray,
                  gf: np.ndarray) -> int:
        return END


@functools.cache
def _addresses(cls: type) -> tuple[Any, ...]:
    fns = compiled_lists(cls)
    assert isinstance(fns, tuple), fns
    return as_addresses(fns, _signatures())

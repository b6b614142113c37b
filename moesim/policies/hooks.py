"""Eviction policies written as hooks: one definition that both replay paths run.

A :class:`HookEviction` policy is four small functions over numbers and numpy arrays, the
shape libCacheSim gives a priority-ordered algorithm (its ``eviction/`` files: update on a
hit, on an insert, on a removal; the victim has the lowest priority):

- ``insert(key, demand, weight, clock, si, sf)``: ``key`` entered the cache; ``demand``: a
  miss fetched it for use now (a use as well), else a prefetch did;
- ``access(key, weight, clock, si, sf)``: a forward pass used ``key`` (a hit or a late prefetch);
- ``remove(key, clock, si, sf)``: ``key`` left the cache;
- ``priority(key, clock, si, sf) -> float``: the cached key with the lowest priority that the
  cache may evict is the victim; equal priorities go to the key inserted or used longest ago.

``weight`` is the summed gate weight the layer's tokens gave ``key`` in this access (0 for a
prefetch, or where the layer did not route it). ``si`` (int64) and ``sf`` (float64) are the
policy's own state, one row per cache key and one column per name in ``int_fields`` /
``float_fields`` (zero at the start; a row outlives its key's eviction, as LFU's counts do).
``clock`` is where the replay is, read-only: ``clock[CLOCK_PASS]``, ``clock[CLOCK_LAYER]``,
``clock[CLOCK_TICK]`` (a counter that rises by one at every insert and access: the stamp of
this event), and the key layout ``clock[CLOCK_KEYS_PER_LAYER]`` (a key's layer is ``key //
clock[CLOCK_KEYS_PER_LAYER]``), ``clock[CLOCK_PRECISIONS]`` (its precision index ``key %
clock[CLOCK_PRECISIONS]``, 0 the largest) and ``clock[CLOCK_LAYERS]``.

``stable_priority = True`` declares that a key's priority reads only that key's state: it is
then computed after each insert and access of the key and kept, instead of being asked of every
candidate at every victim search (on both paths alike, so the declaration decides the
semantics, and a wrong one shows the same on both).

The SimPy path calls the functions as written (:class:`HookEviction` is an
:class:`EvictionPolicy`); the compiled kernel calls them compiled by numba with the
signatures of :func:`_signatures` (first-class functions: the kernel is compiled once for
every such policy; a victim search asks the priorities of all its candidates in one call, to a
loop compiled around ``priority``). A policy whose functions numba cannot compile runs on the
SimPy path, and the replay says why (``replay_path_reason``; ``moesim run`` in a line).
"""

from __future__ import annotations

import functools
import warnings
from abc import abstractmethod
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import numpy as np

from moesim.policies.eviction import EvictionPolicy
from moesim.policies.registry import PolicyContext

CLOCK_PASS, CLOCK_LAYER, CLOCK_TICK, CLOCK_KEYS_PER_LAYER, CLOCK_PRECISIONS, CLOCK_LAYERS, CLOCK_SIZE = range(7)
HOOKS = ("insert", "access", "remove", "priority")


def _no_insert(key: int, demand: bool, weight: float, clock: np.ndarray, si: np.ndarray, sf: np.ndarray) -> None:
    pass


def _no_access(key: int, weight: float, clock: np.ndarray, si: np.ndarray, sf: np.ndarray) -> None:
    pass


def _no_remove(key: int, clock: np.ndarray, si: np.ndarray, sf: np.ndarray) -> None:
    pass


def _no_priority(key: int, clock: np.ndarray, si: np.ndarray, sf: np.ndarray) -> float:
    return 0.0


class HookEviction(EvictionPolicy):
    """An eviction policy given as hooks (module docstring). Subclasses define ``priority``
    and, as they need, ``insert``, ``access`` and ``remove`` (each a ``staticmethod``), and
    name their per-key state in ``int_fields`` / ``float_fields``."""

    int_fields: ClassVar[tuple[str, ...]] = ()
    float_fields: ClassVar[tuple[str, ...]] = ()
    # True: a key's priority changes only when its own hooks run (it reads that key's state,
    # not the clock or other keys'): it is computed once after each insert and access and kept,
    # rather than asked of every candidate at every victim search (on both paths)
    stable_priority: ClassVar[bool] = False
    insert: ClassVar[Callable[..., None]] = staticmethod(_no_insert)
    access: ClassVar[Callable[..., None]] = staticmethod(_no_access)
    remove: ClassVar[Callable[..., None]] = staticmethod(_no_remove)

    @staticmethod
    @abstractmethod
    def priority(key: int, clock: np.ndarray, si: np.ndarray, sf: np.ndarray) -> float:
        """The key with the lowest priority is evicted first (ties: the oldest stamp)."""

    def __init__(self, params: Any, ctx: PolicyContext) -> None:
        super().__init__(params, ctx)
        self.clock, self.si, self.sf = state_arrays(type(self), ctx.num_layers, ctx.keys_per_layer,
                                                    len(ctx.precisions))
        self._stamp: dict[int, int] = {}  # cached key -> the tick of its last insert or access
        self._prio: dict[int, float] = {}  # cached key -> its kept priority (``stable_priority``)
        self._keys = ctx.cache_keys(ctx.workload.keys()).tolist() if ctx.workload is not None else []

    def _weight(self, key: int) -> float:
        """The gate weight of the current (pass, layer)'s access of ``key`` (0: none)."""
        from moesim.policies.eviction import _access_index

        if self.ctx.workload is None:
            return 0.0
        i = _access_index(self.ctx, self._keys, key)
        return 0.0 if i is None else float(self.ctx.workload.acc_weight[i])

    def _at(self, stamp: bool) -> np.ndarray:
        clock = self.clock
        clock[CLOCK_PASS] = self.ctx.clock.pass_index
        clock[CLOCK_LAYER] = self.ctx.clock.layer
        if stamp:
            clock[CLOCK_TICK] += 1
        return clock

    def on_insert(self, key: int, demand: bool) -> None:
        clock = self._at(True)
        self._stamp[key] = int(clock[CLOCK_TICK])
        type(self).insert(key, demand, self._weight(key) if demand else 0.0, clock, self.si, self.sf)
        self._keep(key, clock)

    def on_access(self, key: int) -> None:
        clock = self._at(True)
        self._stamp[key] = int(clock[CLOCK_TICK])
        type(self).access(key, self._weight(key), clock, self.si, self.sf)
        self._keep(key, clock)

    def _keep(self, key: int, clock: np.ndarray) -> None:
        if self.stable_priority:
            self._prio[key] = float(type(self).priority(key, clock, self.si, self.sf))

    def on_remove(self, key: int) -> None:
        del self._stamp[key]
        self._prio.pop(key, None)
        type(self).remove(key, self._at(False), self.si, self.sf)

    def candidates(self) -> Iterator[int]:
        stamp = self._stamp
        if self.stable_priority:
            kept = self._prio
            return iter(sorted(stamp, key=lambda k: (kept[k], stamp[k])))
        clock = self._at(False)
        prio = type(self).priority
        si, sf = self.si, self.sf
        return iter(sorted(stamp, key=lambda k: (float(prio(k, clock, si, sf)), stamp[k])))


def state_arrays(cls: type[HookEviction], num_layers: int, keys_per_layer: int,
                 precisions: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A hook policy's ``clock`` and zeroed state ``si``, ``sf`` (at least one column each)."""
    clock = np.zeros(CLOCK_SIZE, np.int64)
    clock[CLOCK_KEYS_PER_LAYER], clock[CLOCK_PRECISIONS], clock[CLOCK_LAYERS] = keys_per_layer, precisions, num_layers
    n = num_layers * keys_per_layer
    return (clock, np.zeros((n, max(1, len(cls.int_fields))), np.int64),
            np.zeros((n, max(1, len(cls.float_fields))), np.float64))


@functools.cache
def _signatures() -> tuple[Any, ...]:
    from numba.core import types

    clock, si, sf = types.int64[::1], types.int64[:, ::1], types.float64[:, ::1]
    return (types.void(types.int64, types.boolean, types.float64, clock, si, sf),
            types.void(types.int64, types.float64, clock, si, sf),
            types.void(types.int64, clock, si, sf),
            types.float64(types.int64, clock, si, sf),
            # priorities: (keys, n, out, ...) -> out[:n], the priority of each of keys[:n]
            types.void(types.int64[::1], types.int64, types.float64[::1], clock, si, sf))


def _no_priorities(keys: np.ndarray, n: int, out: np.ndarray, clock: np.ndarray, si: np.ndarray,
                   sf: np.ndarray) -> None:
    pass


def _priorities_of(priority: Any) -> Callable[..., None]:
    """The kernel's form of ``priority``: one call for a victim search's candidates (``priority``
    is a constant of the compiled loop, so it is called directly, and inlined where numba sees
    fit), rather than an indirect call per candidate (6 ns each: LFU written as hooks ran at
    0.47x the built-in's speed that way)."""
    def priorities(keys: np.ndarray, n: int, out: np.ndarray, clock: np.ndarray, si: np.ndarray,
                   sf: np.ndarray) -> None:
        for j in range(n):
            out[j] = priority(keys[j], clock, si, sf)

    return priorities


_COMPILED: dict[type, tuple[Any, ...] | str] = {}


def compiled(cls: type) -> tuple[Any, ...] | str:
    """``cls``'s hooks compiled by numba (insert, access, remove, priority, and priorities:
    ``priority`` over an array of keys), or why one does not compile (a line); compiled once
    per process."""
    if cls not in _COMPILED:
        _COMPILED[cls] = _compile(cls)
    return _COMPILED[cls]


def _compile(cls: type) -> tuple[Any, ...] | str:
    from numba import njit

    out = []
    sigs = _signatures()
    for name, sig in zip(HOOKS, sigs[:4], strict=True):
        fn = getattr(cls, name)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out.append(njit(sig, cache=fn.__module__ == __name__)(fn))
        except Exception as exc:  # numba's typing and lowering errors have no common base
            return f"its {name} hook does not compile with numba ({_first_line(exc)})"
    # the built-ins' stand-in is cached by numba; a closure over a user's priority cannot be
    many = _no_priorities if cls is _NoHooks else _priorities_of(out[-1])
    out.append(njit(sigs[-1], cache=cls is _NoHooks)(many))
    return tuple(out)


def _first_line(exc: Exception) -> str:
    """numba's message in a line: its first line that says what failed, and where."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    what = next((ln for ln in lines if not ln.startswith("Failed in ")), type(exc).__name__)
    where = next((ln for ln in lines if ln.startswith("File ")), "")
    return f"{what.rstrip(':')}; {where.rstrip(':')}" if where else what.rstrip(":")


@functools.cache
def no_hooks() -> tuple[Any, ...]:
    """The hooks handed to the kernel when the eviction policy is a built-in (never called).

    They are handed over as addresses (numba's wrapper address protocol) rather than as
    dispatchers: the kernel's type is the same (a first-class function of each signature), but
    numba asks a dispatcher for its addresses at every kernel call (30 us each: a tenth of an
    LRU replay's time), an address object once."""
    fns = compiled(_NoHooks)
    assert isinstance(fns, tuple)
    from numba.core.dispatcher import Dispatcher

    if not isinstance(fns[0], Dispatcher):  # NUMBA_DISABLE_JIT: plain functions
        return fns
    from numba.core.types.function_type import WrapperAddressProtocol
    from numba.experimental.function_type import _get_wrapper_address

    class Address(WrapperAddressProtocol):
        def __init__(self, fn: Any, sig: Any) -> None:
            self._sig, self._addr = sig, _get_wrapper_address(fn, sig)

        def __wrapper_address__(self) -> int:
            return self._addr

        def signature(self) -> Any:
            return self._sig

    return tuple(Address(f, sig) for f, sig in zip(fns, _signatures(), strict=True))


class _NoHooks(HookEviction):
    priority = staticmethod(_no_priority)

"""Eviction and prefetch policies written as hooks: one definition that both replay paths run.

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
``float_fields`` (zero at the start, or as :meth:`HookEviction.init_state` fills them from the
policy's parameters; a row outlives its key's eviction, as LFU's counts do).
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
Compiled hooks check their indices: an index out of range ends the replay with one paragraph
(on the SimPy path naming the hook, the forward pass and the layer).

The built-in eviction policies of this shape are written so too: ``lfu``, ``fld``, ``score`` and
``lhu`` keep their compiled forms (:class:`moesim.policies.eviction.CompiledForm` subclasses, with a loop
over many keys' priorities of their own) beside their reference forms, and the kernel runs them
through the same hooks: the compiled form :class:`PriorityHooks` calls them for every such policy.
Those ordered otherwise (``lru``, ``fifo``, ``least-stale``, ``belady``, ``sieve``, ``s3-fifo``,
``arc``) have compiled forms of their own beside them (:class:`moesim.policies.eviction.KernelForm`);
a user's policy of that shape -- lists, a hand, ghosts -- is written as the hooks of
:class:`moesim.policies.list_hooks.HookListEviction`.

A :class:`HookPrefetch` policy is one function, ``select(p, layer, trace, out) -> n``, over the
trace's arrays (its docstring); the kernel takes its proposals as arrays made ahead.
"""

from __future__ import annotations

import functools
import re
import warnings
from abc import abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from moesim.jit import inline, jit, kernel
from moesim.kernel_state import access_of, current_layer, current_pass, evictable
from moesim.kernel_state import access_weight as weight_of
from moesim.policies.eviction import (
    CLOCK_KEYS_PER_LAYER,
    CLOCK_LAYER,
    CLOCK_LAYERS,
    CLOCK_PASS,
    CLOCK_PRECISIONS,
    CLOCK_SIZE,
    CLOCK_TICK,
    CompiledForm,
    EvictionPolicy,
    access_weight,
)
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
from moesim.policies.prefetch import PrefetchPolicy
from moesim.policies.registry import PolicyContext

HOOKS = ("insert", "access", "remove", "priority")


def _no_priority(key: int, clock: np.ndarray, si: np.ndarray, sf: np.ndarray) -> float:
    return 0.0


class Clocked(EvictionPolicy):
    """What the eviction policies given as hooks share on the SimPy path: the ``clock`` their
    hooks read, and the gate weight of an access."""

    clock: np.ndarray
    _keys: list[int] | None = None  # the workload's accesses as cache keys (made on first use)

    def _weight(self, key: int) -> float:
        """The gate weight of the current (pass, layer)'s access of ``key`` (0: none)."""
        if self._keys is None and self.ctx.workload is not None:  # on first use: the kernel needs none
            self._keys = self.ctx.cache_keys(self.ctx.workload.keys()).tolist()
        return access_weight(self.ctx, self._keys or [], key)

    def _at(self, stamp: bool) -> np.ndarray:
        """The clock at the replay's pass and layer; ``stamp``: an insert or access, a tick on."""
        clock = self.clock
        clock[CLOCK_PASS] = self.ctx.clock.pass_index
        clock[CLOCK_LAYER] = self.ctx.clock.layer
        if stamp:
            clock[CLOCK_TICK] += 1
        return clock


class HookEviction(CompiledForm, Clocked):
    """An eviction policy given as hooks (module docstring). Subclasses define ``priority``
    and, as they need, ``insert``, ``access`` and ``remove`` (each a ``staticmethod``), and
    name their per-key state in ``int_fields`` / ``float_fields``.

    A policy's parameters (its ``Params``, set in the scenario's YAML like a built-in's) reach
    the hooks through the state: :meth:`init_state` (plain Python) may fill ``si``/``sf`` from
    ``self.params`` before the replay, e.g. a column holding a rate for every key."""

    # int_fields, float_fields, the hooks that do nothing by default and stable_priority (True:
    # a key's priority changes only when its own hooks run -- it reads that key's state, not the
    # clock or other keys' -- so it is computed once after each insert and access and kept,
    # rather than asked of every candidate at every victim search, on both paths): CompiledForm

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
        self.init_state()

    def init_state(self) -> None:
        """Fill the state before the replay (``self.si``, ``self.sf`` are zero; ``self.params``
        holds the policy's parameters). Default: nothing."""

    def reset_state(self) -> None:
        """Back to the state before any insert: ``si``, ``sf`` as :meth:`init_state` left
        them, tick, stamps and kept priorities cleared (the kernel replays from there, in the
        same arrays)."""
        self.si[:] = 0
        self.sf[:] = 0
        self.init_state()
        self.clock[CLOCK_PASS:CLOCK_TICK + 1] = 0
        self._stamp.clear()
        self._prio.clear()

    def on_insert(self, key: int, demand: bool) -> None:
        clock = self._at(True)
        self._stamp[key] = int(clock[CLOCK_TICK])
        try:
            type(self).insert(key, demand, self._weight(key) if demand else 0.0, clock, self.si, self.sf)
        except Exception as exc:
            raise _raised(self, "insert", exc) from None
        self._keep(key, clock)

    def on_access(self, key: int) -> None:
        clock = self._at(True)
        self._stamp[key] = int(clock[CLOCK_TICK])
        try:
            type(self).access(key, self._weight(key), clock, self.si, self.sf)
        except Exception as exc:
            raise _raised(self, "access", exc) from None
        self._keep(key, clock)

    def _keep(self, key: int, clock: np.ndarray) -> None:
        if self.stable_priority:
            try:
                self._prio[key] = float(type(self).priority(key, clock, self.si, self.sf))
            except Exception as exc:
                raise _raised(self, "priority", exc) from None

    def on_remove(self, key: int) -> None:
        del self._stamp[key]
        self._prio.pop(key, None)
        try:
            type(self).remove(key, self._at(False), self.si, self.sf)
        except Exception as exc:
            raise _raised(self, "remove", exc) from None

    def candidates(self) -> Iterator[int]:
        stamp = self._stamp
        if self.stable_priority:
            kept = self._prio
            return iter(sorted(stamp, key=lambda k: (kept[k], stamp[k])))
        clock = self._at(False)
        prio = type(self).priority
        si, sf = self.si, self.sf
        try:
            return iter(sorted(stamp, key=lambda k: (float(prio(k, clock, si, sf)), stamp[k])))
        except Exception as exc:
            raise _raised(self, "priority", exc) from None


def _raised(policy: Any, hook: str, exc: Exception, hint: str | None = None) -> Exception:
    """A hook's own error, on the SimPy path, as one paragraph naming the policy, the hook and
    where the replay was; ``hint``: what the hook's arrays hold (default: the family's)."""
    from moesim.errors import MoesimError

    family = "eviction" if isinstance(policy, EvictionPolicy) else "prefetch"
    clock = policy.ctx.clock
    return MoesimError(f"{family} policy '{policy.name}': its {hook} hook raised {type(exc).__name__}: {exc} "
                       f"(forward pass {clock.pass_index}, layer {clock.layer}). Fix the hook: "
                       f"{hint or (_STATE_HINT if family == 'eviction' else _TRACE_HINT)}")


_STATE_HINT = ("si and sf have a row per cache key and a column per name in int_fields and float_fields; "
               "clock has CLOCK_SIZE entries.")
_TRACE_HINT = "out holds one entry per cache key; trace[T_OFF] has an entry per (pass, layer) and one more."


def state_arrays(cls: Any, num_layers: int, keys_per_layer: int,
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


def _once(cls: type, make: Callable[[type], tuple[Any, ...] | str]) -> tuple[Any, ...] | str:
    """``make(cls)``, made once per process and class."""
    if cls not in _COMPILED:
        _COMPILED[cls] = make(cls)
    return _COMPILED[cls]


def compiled(cls: type) -> tuple[Any, ...] | str:
    """``cls``'s hooks compiled by numba (insert, access, remove, priority, and priorities:
    ``priority`` over an array of keys), or why one does not compile (a line)."""
    return _once(cls, _compile)


def _builtin(cls: type) -> bool:
    """A form shipped with moesim (a built-in's compiled form, the kernel's stand-in): cached
    by numba on disk, its indices trusted (a user's are checked)."""
    return cls.__module__.startswith("moesim.")


def _compile(cls: type) -> tuple[Any, ...] | str:
    from moesim.jit import njit

    out = []
    sigs = _signatures()
    builtin = _builtin(cls)
    for name, sig in zip(HOOKS, sigs[:4], strict=True):
        fn = getattr(cls, name)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                # a user's hooks check their indices (an IndexError, not a write past the arrays)
                out.append(njit(sig, cache=builtin, boundscheck=not builtin)(fn))
        except Exception as exc:  # numba's typing and lowering errors have no common base
            return f"its {name} hook does not compile with numba ({_first_line(exc)})"
    # the loop over many keys' priorities: never called for a stable priority (the kept ones are
    # read); a form shipped with moesim gives its own (cached by numba); a user's gets a closure
    # around its priority, which cannot be cached
    own = cls.__dict__.get("priorities") if builtin else None
    if getattr(cls, "stable_priority", False):
        own = staticmethod(_no_priorities)
    many = own.__func__ if isinstance(own, staticmethod) else _priorities_of(out[-1])
    out.append(njit(sigs[-1], cache=isinstance(own, staticmethod))(many))
    return tuple(out)


def compiled_choose_hook(cls: type, sig: Any) -> tuple[Any, ...] | str:
    """A one-hook policy's (the miss and routing families' ``choose``) hook compiled by numba
    for signature ``sig``, as a tuple of one (a first-class function to the kernel), its
    indices checked for a user's hook; or why it does not compile (a line). Made once per
    process and class (:func:`_once`)."""
    return _once(cls, lambda c: _compile_choose(c, sig))


def _compile_choose(cls: type, sig: Any) -> tuple[Any, ...] | str:
    from moesim.jit import njit

    shipped = _builtin(cls)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return (njit(sig, cache=shipped, boundscheck=not shipped)(cls.choose),)  # type: ignore[attr-defined]
    except Exception as exc:  # numba's typing and lowering errors have no common base
        return f"its choose hook does not compile with numba ({_first_line(exc)})"


@functools.cache
def choose_addresses(cls: type, sig: Any) -> tuple[Any, ...]:
    """``cls``'s compiled ``choose`` (:func:`compiled_choose_hook`) as the kernel is handed it
    (:func:`as_addresses`)."""
    fn = compiled_choose_hook(cls, sig)
    assert isinstance(fn, tuple), fn
    return as_addresses(fn, (sig,))


def _first_line(exc: Exception) -> str:
    """numba's message in a line: its first line that says what failed, and where."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))  # numba's highlighting, in a terminal
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    what = next((ln for ln in lines if not ln.startswith("Failed in ")), type(exc).__name__)
    where = next((ln for ln in lines if ln.startswith("File ")), "")
    return f"{what.rstrip(':')}; {where.rstrip(':')}" if where else what.rstrip(":")


@functools.cache
def addresses(cls: type) -> tuple[Any, ...]:
    """A form shipped with moesim's compiled hooks (:func:`compiled`), as the kernel is handed
    them (:func:`as_addresses`)."""
    fns = compiled(cls)
    assert isinstance(fns, tuple), fns
    return as_addresses(fns, _signatures())


def as_addresses(fns: tuple[Any, ...], sigs: Sequence[Any]) -> tuple[Any, ...]:
    """Compiled functions ``fns`` of signatures ``sigs`` as the kernel is handed them: as
    addresses (numba's wrapper address protocol) rather than as dispatchers. The kernel's type
    is the same (a first-class function of each signature), but numba asks a dispatcher for its
    addresses at every kernel call (30 us each: a tenth of an LRU replay's time), an address
    object once. The dispatchers must outlive the addresses."""
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

    return tuple(Address(f, sig) for f, sig in zip(fns, sigs, strict=True))


class _NoHooks(HookEviction):
    priority = staticmethod(_no_priority)
    stable_priority = True  # its many-key loop: the one that is never called


@functools.cache
@functools.cache
def unused_state() -> tuple[np.ndarray, ...]:
    """``A.hooks[HOOK_STATE]`` when no hook form runs: arrays no hook reads, of the types the
    real ones have."""
    return (np.zeros(CLOCK_SIZE, np.int64), np.zeros((1, 1), np.int64), np.zeros((1, 1)), np.zeros(1, np.int64),
            np.zeros(1))


def first_class_functions(fns: tuple[Any, ...]) -> tuple[Any, ...]:
    """A hook form's part of ``A.hooks``: each hook in a tuple of one, which numba types as a
    first-class function (a function's address, called indirectly) rather than as that
    function (one compiled kernel for every hook policy)."""
    return tuple((f,) for f in fns)


def _first_class(fns: tuple[Any, ...], clock: np.ndarray, si: np.ndarray, sf: np.ndarray,
                 keys: np.ndarray) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """:class:`PriorityHooks`' part of ``A.hooks`` and the state beside it: the clock and state,
    the cached keys (a view of the form's member list) and the victim search's buffer of their
    priorities."""
    return first_class_functions(fns), (clock, si, sf, keys, np.zeros(max(len(si), len(keys))))


# A.hooks[HOOK_PART]: the hooks (insert, access, remove, priority, priorities)
U_INSERT, U_ACCESS, U_REMOVE, U_PRIORITY, U_PRIORITIES = range(5)
# the form's own arrays: I2 (the tick of the key's last insert or use, its place among the members),
# F2 (its kept priority), I1 (the tick, the members' count, the members), F1 (1: a stable priority)
STAMP, MEMB = 0, 1
KEPT = 0
TICK, COUNT, MEMBERS = 0, 1, 2


@inline
def _set_clock(S: Any, IS: np.ndarray, A: Any) -> None:
    """The hooks' clock at the replay's pass, layer and tick."""
    clock = A.hooks[HOOK_STATE][HS_CLOCK]
    clock[CLOCK_PASS] = current_pass(IS)
    clock[CLOCK_LAYER] = current_layer(IS)
    clock[CLOCK_TICK] = S[2][TICK]


@inline
def _touched(key: int, S: Any) -> None:
    S[2][TICK] += 1
    S[0][key, STAMP] = S[2][TICK]


@inline
def _keep(key: int, S: Any, A: Any) -> None:
    """A stable priority (``stable_priority``) is computed after the key's hooks ran and kept."""
    if S[3][0]:
        H, St = A.hooks[HOOK_PART], A.hooks[HOOK_STATE]
        S[1][key, KEPT] = H[U_PRIORITY][0](key, St[HS_CLOCK], St[HS_SI], St[HS_SF])


@inline
def _insert(key: int, demand: bool, ai: int, S: Any, IS: np.ndarray, K: Any, DI: np.ndarray, A: Any) -> None:
    I1 = S[2]
    n = I1[COUNT]
    I1[MEMBERS + n] = key
    S[0][key, MEMB] = n
    I1[COUNT] = n + 1
    _touched(key, S)
    w = float(weight_of(access_of(key, ai, IS, DI, A), A)) if demand else 0.0
    _set_clock(S, IS, A)
    H, St = A.hooks[HOOK_PART], A.hooks[HOOK_STATE]
    H[U_INSERT][0](key, demand != 0, w, St[HS_CLOCK], St[HS_SI], St[HS_SF])
    _keep(key, S, A)


@inline
def _access(key: int, ai: int, S: Any, IS: np.ndarray, K: Any, DI: np.ndarray, A: Any) -> None:
    _touched(key, S)
    _set_clock(S, IS, A)
    H, St = A.hooks[HOOK_PART], A.hooks[HOOK_STATE]
    H[U_ACCESS][0](key, float(weight_of(access_of(key, ai, IS, DI, A), A)), St[HS_CLOCK], St[HS_SI], St[HS_SF])
    _keep(key, S, A)


@inline
def _remove(key: int, evicted: int, S: Any, IS: np.ndarray, K: Any, A: Any) -> None:
    I2, I1 = S[0], S[2]
    i = I2[key, MEMB]
    last = I1[MEMBERS + I1[COUNT] - 1]
    I1[MEMBERS + i] = last
    I2[last, MEMB] = i
    I1[COUNT] -= 1
    I2[key, MEMB] = -1
    _set_clock(S, IS, A)
    H, St = A.hooks[HOOK_PART], A.hooks[HOOK_STATE]
    H[U_REMOVE][0](key, St[HS_CLOCK], St[HS_SI], St[HS_SF])


@kernel
def _victim(for_prefetch: bool, pin_gen: int, adm_layer: int, again: int, S: Any, IS: np.ndarray, K: Any,
            A: Any) -> int:
    """The member the cache may evict of lowest priority (kept, or asked now of every member in
    one call, as the SimPy path sorts them all), ties to the oldest stamp."""
    I2, F2, I1 = S[0], S[1], S[2]
    best, bf, bs = -1, 0.0, 0
    n = I1[COUNT]
    if S[3][0]:  # stable: the kept priorities
        for j in range(n):
            key = I1[MEMBERS + j]
            if not evictable(key, pin_gen, adm_layer, IS, K):
                continue
            f, st = F2[key, KEPT], I2[key, STAMP]
            if best == -1 or f < bf or (f == bf and st < bs):
                best, bf, bs = key, f, st
        return best
    H, St = A.hooks[HOOK_PART], A.hooks[HOOK_STATE]
    keys, prios = St[HS_INTS], St[HS_FLOATS]  # keys: the members (a view of I1)
    _set_clock(S, IS, A)
    H[U_PRIORITIES][0](keys, n, prios, St[HS_CLOCK], St[HS_SI], St[HS_SF])
    for j in range(n):
        key = keys[j]
        if not evictable(key, pin_gen, adm_layer, IS, K):
            continue
        f, st = prios[j], I2[key, STAMP]
        if best == -1 or f < bf or (f == bf and st < bs):
            best, bf, bs = key, f, st
    return best


class PriorityHooks(KernelForm):
    """The compiled form of every eviction policy given as hooks (:class:`HookEviction`, a user's,
    and the built-ins' ``compiled`` forms: lfu, fld, score, lhu): the members and their stamps
    and kept priorities in its arrays, the hooks called through ``A.hooks[HOOK_PART]``
    (first-class functions: one compiled kernel for all of them)."""

    insert = staticmethod(_insert)
    access = staticmethod(_access)
    remove = staticmethod(_remove)
    victim = staticmethod(_victim)

    @classmethod
    def state(cls, policy: Any, num_keys: int) -> tuple[np.ndarray, ...]:
        I2, F2, I1, F1, P = new_state(num_keys, i2=2, f2=1, i1=MEMBERS + num_keys, f1=1)
        I1[TICK] = I1[COUNT] = 0
        F1[0] = float(hook_form(type(policy)).stable_priority)
        return I2, F2, I1, F1, P

    @classmethod
    def first_class(cls, policy: Any, S: tuple[np.ndarray, ...]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """The policy's compiled hooks and their state: a hook policy's own arrays (so that it
        holds the replay's final state after it, as on the SimPy path); a built-in's compiled
        form's, made here (the kernel's alone)."""
        num_keys = S[0].shape[0]
        keys = S[2][MEMBERS:MEMBERS + num_keys]
        if isinstance(policy, HookEviction):
            # the policy's arrays as they were before the SimPy side saw the pinned experts' inserts,
            # which the kernel's preload makes again
            policy.reset_state()
            fns = compiled(type(policy))
            assert isinstance(fns, tuple)
            return _first_class(fns, policy.clock, policy.si, policy.sf, keys)
        ctx, form = policy.ctx, hook_form(type(policy))
        clock, si, sf = state_arrays(form, ctx.num_layers, ctx.keys_per_layer, len(ctx.precisions))
        form.initial_state(policy.params, si, sf)
        return _first_class(addresses(form), clock, si, sf, keys)

    @classmethod
    def unused(cls) -> tuple[Any, ...]:
        """Its part of ``A.hooks`` when the replay's form is another: hooks never called, of the
        types the real ones have (one compiled kernel serves every form)."""
        return first_class_functions(addresses(_NoHooks))


def hook_form(cls: type) -> Any:
    """The class whose hooks the kernel runs for eviction policy ``cls``: a built-in's compiled
    form (``compiled``, beside it in its module), or a hook policy itself."""
    return cls.__dict__.get("compiled") or cls


# -- prefetch ---------------------------------------------------------------------------------
# the trace as a prefetch hook sees it: a tuple of arrays (``trace[T_OFF]`` ...)
T_INFO, T_OFF, T_EXPERT, T_WEIGHT, T_GROUP, T_ROW_ORDER, T_ROW_OFF, T_PRED = range(8)
# ``trace[T_INFO]``: the model's layers, experts and precisions, the scenario's precision index,
# the trace's forward passes
INFO_LAYERS, INFO_EXPERTS, INFO_PRECISIONS, INFO_PRECISION, INFO_PASSES = range(5)


class HookPrefetch(PrefetchPolicy):
    """A prefetch policy given as one hook, ``select(p, layer, trace, out) -> n``: at the
    routing point of layer ``layer`` of forward pass ``p``, write the cache keys to prefetch,
    most wanted first and each once, to ``out[:n]`` (``out`` holds every cache key) and return
    ``n``. ``trace`` is a tuple of read-only arrays: ``trace[T_OFF]`` the offsets of each (pass,
    layer)'s expert accesses (entry ``p * layers + layer``), ``trace[T_EXPERT]`` and
    ``trace[T_WEIGHT]`` each access's expert and summed gate weight, ``trace[T_GROUP]`` each
    pass's batch group (the previous token of pass ``p`` is pass ``p - 1`` when their groups
    are equal), ``trace[T_ROW_ORDER]``/``trace[T_ROW_OFF]`` the trace rows (tokens) of each
    (pass, layer), ``trace[T_PRED]`` their predicted next-layer router probabilities (a 1 x 1
    zero array when the trace has no ``pred_next``), and ``trace[T_INFO]`` the layout
    (``INFO_*``): the key of expert ``e`` of layer ``l`` is ``(l * experts + e) * precisions +
    precision``.

    Proposals read the trace alone (not the cache or the time), so the kernel takes them as
    arrays made ahead (:meth:`PrefetchPolicy.proposals`, compiled: :func:`_drive`); the SimPy
    path calls ``select`` as written at each routing point. Compiled hooks check their indices:
    an index out of range is an error on both paths, as the hooks of :class:`HookEviction`."""

    @staticmethod
    @abstractmethod
    def select(p: int, layer: int, trace: tuple[np.ndarray, ...], out: np.ndarray) -> int:
        """Write the keys to prefetch to ``out[:n]``; return ``n``."""

    @classmethod
    def why_not_compiled(cls) -> str | None:
        made = compiled_prefetch(cls)
        return None if isinstance(made, tuple) else made

    def __init__(self, params: Any, ctx: PolicyContext) -> None:
        super().__init__(params, ctx)
        self._of: tuple[Any, tuple[np.ndarray, ...]] | None = None
        self._out = np.zeros(ctx.num_layers * ctx.keys_per_layer, np.int64)

    def trace_view(self) -> tuple[np.ndarray, ...]:
        """The ``trace`` tuple of the workload being replayed (made once per workload)."""
        wl = self.ctx.workload
        if self._of is None or self._of[0] is not wl:
            self._of = (wl, _view(self.ctx, wl))
        return self._of[1]

    def propose(self, pass_index: int, layer: int) -> Sequence[int]:
        out = self._out
        try:
            n = type(self).select(pass_index, layer, self.trace_view(), out)
        except Exception as exc:
            raise _raised(self, "select", exc) from None
        _check(self, n, out, pass_index, layer)
        return out[:n].tolist()

    def proposals(self, first: int, last: int) -> tuple[np.ndarray, np.ndarray]:
        fn = compiled_prefetch(type(self))
        assert isinstance(fn, tuple)
        num_l = self.ctx.num_layers
        groups = (last - first) * num_l
        off = np.zeros(groups + 1, np.int64)
        keys = np.empty(max(16, groups * self.ctx.top_k), np.int64)
        g = used = 0
        while g < groups:
            g, used = _drive(first, num_l, g, used, groups, fn, self.trace_view(), off, keys, self._out)
            if g < 0:  # group -g - 1's select returned a bad count (``used``) or key (in ``out``)
                _check(self, used, self._out, first + (-g - 1) // num_l, (-g - 1) % num_l)
                raise AssertionError("_drive and _check disagree")  # pragma: no cover
            if g < groups:  # out of room: twice as much
                keys = np.concatenate([keys, np.empty(len(keys), np.int64)])
        return off, keys[:used]


def _view(ctx: PolicyContext, wl: Any) -> tuple[np.ndarray, ...]:
    info = np.array([ctx.num_layers, ctx.num_experts, len(ctx.precisions), ctx.default_precision,
                     wl.num_passes], np.int64)
    pred = wl.pred_next if wl.pred_next is not None else np.zeros((1, 1), np.float32)

    def i64(a: Any) -> np.ndarray:
        return np.ascontiguousarray(a if a is not None else np.zeros(1), np.int64)

    return (info, i64(wl.off), i64(wl.acc_expert), np.ascontiguousarray(wl.acc_weight, np.float64),
            i64(wl.pass_group), i64(wl.row_order), i64(wl.row_off), np.ascontiguousarray(pred, np.float32))


def _check(policy: HookPrefetch, n: int, out: np.ndarray, p: int, layer: int) -> None:
    """A select's result must be a count of keys within ``out``, each a cache key."""
    from moesim.errors import MoesimError

    where = f"prefetch policy '{policy.name}': select(p={p}, layer={layer}, ...)"
    if not 0 <= n <= len(out):
        raise MoesimError(f"{where} returned {n}, not a number of keys from 0 to {len(out)} (the cache keys); "
                          "return how many keys it wrote to out.")
    bad = out[:n][(out[:n] < 0) | (out[:n] >= len(out))]
    if len(bad):
        raise MoesimError(f"{where} proposed {int(bad[0])}, not a cache key (0 to {len(out) - 1}); a key is "
                          "(layer * experts + expert) * precisions + precision (trace[T_INFO]).")


@jit
def _drive(first, num_l, g, used, groups, select, trace, off, keys, out):
    """Proposals of (pass, layer) groups ``g ..`` of passes ``first ..`` (``groups`` in all):
    each group's keys from ``select`` appended to ``keys``, offsets to ``off``. Returns
    (the next group, keys used): short of ``groups`` when ``keys`` is full, or ``(-g - 1,
    n)`` when group ``g``'s select returned a count ``n`` or key out of range (the caller names
    it, with that count)."""
    num_keys = out.shape[0]
    while g < groups:
        n = select[0](first + g // num_l, g % num_l, trace, out)
        if n < 0 or n > num_keys:
            return -g - 1, n
        for j in range(n):
            if out[j] < 0 or out[j] >= num_keys:
                return -g - 1, n
        if used + n > keys.shape[0]:
            return g, used
        for j in range(n):
            keys[used + j] = out[j]
        used += n
        off[g + 1] = used
        g += 1
    return g, used


@functools.cache
def _select_signature() -> Any:
    from numba.core import types

    i64 = types.int64[::1]
    trace = types.Tuple((i64, i64, i64, types.float64[::1], i64, i64, i64, types.float32[:, ::1]))
    return types.int64(types.int64, types.int64, trace, i64)


def compiled_prefetch(cls: type) -> tuple[Any, ...] | str:
    """``(select,)`` compiled by numba, with its indices checked (a tuple of one: a first-class
    function to :func:`_drive`, whose errors reach the caller), or why it does not compile (a
    line)."""
    return _once(cls, _compile_select)


def _compile_select(cls: type) -> tuple[Any, ...] | str:
    from moesim.jit import njit

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return (njit(_select_signature(), boundscheck=True)(cls.select),)  # type: ignore[attr-defined]
    except Exception as exc:  # numba's typing and lowering errors have no common base
        return f"its select hook does not compile with numba ({_first_line(exc)})"

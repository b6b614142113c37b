"""A miss policy written as one hook that both replay paths run (the miss family's
:class:`HookMiss`, as :mod:`moesim.policies.hooks` gives eviction and prefetch theirs).

``choose(p, layer, expert, rank, cached, routed, si, sf) -> int`` decides what to do with
``expert``, absent from the cache at layer ``layer`` of forward pass ``p`` (``rank``: its best
router rank among the layer's tokens, 0 the top-1). ``cached`` and ``routed`` are boolean
arrays over the layer's experts: resident or in flight at the scenario's precision, and routed
by the layer's tokens. It answers :data:`FETCH` (a demand fetch, as ``fetch``), :data:`DROP`
(the expert's tokens go without it, as ``drop``) or the id of a cached expert that is not
routed, which computes the tokens in its place (as ``substitute``). ``si`` (int64) and ``sf``
(float64) are the policy's own state, a row per expert of the model (``layer * experts +
expert``) and a column per name in ``int_fields`` / ``float_fields``, zero at the start or as
:meth:`HookMiss.init_state` fills them.

The SimPy path calls ``choose`` as written; the compiled kernel calls it compiled by numba, a
first-class function handed to the kernel in its per-token arrays (``M.hook``), so one compiled
kernel serves every such policy (:class:`HookMissForm`). A hook numba cannot compile runs on
the SimPy path, and the replay says why. An answer that is none of the three ends the replay
with one paragraph, on either path.
"""

from __future__ import annotations

import functools
from abc import abstractmethod
from typing import Any, ClassVar

import numpy as np

from moesim.errors import MoesimError
from moesim.jit import kernel
from moesim.kernel_state import ABSENT, C_K, C_NE, C_NPREC, S_LAYER, _here, _key_at, current_pass
from moesim.policies.miss.base import DROP, FETCH, MissDecision, MissForm, MissInfo, MissPolicy
from moesim.policies.registry import PolicyContext

__all__ = ["DROP", "FETCH", "HookMiss", "HookMissForm"]

# M.hook: (choose,) as a first-class function, the state si and sf, the cached and routed marks
H_CHOOSE, H_SI, H_SF, H_CACHED, H_ROUTED = range(5)


class HookMiss(MissPolicy):
    """A miss policy given as the hook ``choose`` (module docstring). Subclasses define
    ``choose`` (a ``staticmethod``) and name their per-expert state in ``int_fields`` /
    ``float_fields``; :meth:`init_state` may fill it from ``self.params`` before the replay."""

    int_fields: ClassVar[tuple[str, ...]] = ()
    float_fields: ClassVar[tuple[str, ...]] = ()

    @staticmethod
    @abstractmethod
    def choose(p: int, layer: int, expert: int, rank: int, cached: np.ndarray, routed: np.ndarray,
               si: np.ndarray, sf: np.ndarray) -> int:
        """``FETCH``, ``DROP`` or a cached expert that is not routed, to compute in its place."""

    def __init__(self, params: Any, ctx: PolicyContext) -> None:
        super().__init__(params, ctx)
        n = ctx.num_layers * ctx.num_experts
        self.si = np.zeros((n, max(1, len(self.int_fields))), np.int64)
        self.sf = np.zeros((n, max(1, len(self.float_fields))), np.float64)
        self.init_state()

    def init_state(self) -> None:
        """Fill ``self.si``, ``self.sf`` (zero) before the replay. Default: nothing."""

    def decide(self, info: MissInfo) -> MissDecision:
        ctx = self.ctx
        cached = np.array([bool(info.cached(ctx.key(info.layer, e))) for e in range(ctx.num_experts)])
        routed = np.zeros(ctx.num_experts, np.bool_)
        routed[list(info.routed)] = True
        try:
            d = int(type(self).choose(info.pass_index, info.layer, info.expert, info.rank, cached, routed,
                                      self.si, self.sf))
        except Exception as exc:
            raise MoesimError(f"miss policy '{self.name}': its choose hook raised {type(exc).__name__}: {exc} "
                              f"(forward pass {info.pass_index}, layer {info.layer}, expert {info.expert}). "
                              f"Fix the hook: {_STATE_HINT}") from None
        if d == FETCH:
            return MissDecision("fetch")
        if d == DROP:
            return MissDecision("drop")
        if 0 <= d < ctx.num_experts and cached[d] and not routed[d]:
            return MissDecision("substitute", substitute=d)
        raise MoesimError(f"miss policy '{self.name}': choose(p={info.pass_index}, layer={info.layer}, "
                          f"expert={info.expert}, ...) returned {d}. {_ANSWERS}")


_STATE_HINT = ("cached and routed have an entry per expert of the layer; si and sf a row per expert of the model "
               "(layer * experts + expert) and a column per name in int_fields and float_fields.")
_ANSWERS = ("A choose hook returns FETCH (-1), DROP (-2) or the id of an expert of the layer that is cached and "
            "not routed (cached[e] and not routed[e]).")


@kernel
def _hooked(e, rank, arg, IS, K, M):
    """The hook's answer (``M.hook``) over the layer's cached and routed marks, checked: an
    answer that is neither FETCH, DROP nor a cached expert not routed raises ValueError."""
    H = M.hook
    cached, routed = H[H_CACHED], H[H_ROUTED]
    layer = IS[S_LAYER]
    n = IS[C_NE]
    key, step = _key_at(layer, 0, IS), IS[C_NPREC]
    for c in range(n):
        cached[c] = K[key].state != ABSENT
        key += step
    routed[:] = False  # the experts the layer's tokens chose (as routed, or as a budget policy left them)
    b = _here(IS)
    row_order, row_off, chosen = M.row_order, M.row_off, M.chosen
    for i in range(row_off[b], row_off[b + 1]):
        r = row_order[i]
        for j in range(IS[C_K]):
            if chosen[r, j] >= 0:
                routed[chosen[r, j]] = True
    d = H[H_CHOOSE][0](current_pass(IS), layer, e, rank, cached, routed, H[H_SI], H[H_SF])
    if d in (FETCH, DROP):
        return d
    if d < 0 or d >= n or not cached[d] or routed[d]:
        raise ValueError("a choose hook returned neither FETCH, DROP nor a cached expert that is not routed")
    return d


class HookMissForm(MissForm):
    """The compiled form of every :class:`HookMiss` policy: the kernel calls its hook through
    ``M.hook`` (:func:`hook_arrays`)."""

    reroutes = True
    decide = staticmethod(_hooked)


@functools.cache
def _signature() -> Any:
    from numba.core import types

    b = types.boolean[::1]
    return types.int64(types.int64, types.int64, types.int64, types.int64, b, b, types.int64[:, ::1],
                       types.float64[:, ::1])


def compiled_choose(cls: type) -> tuple[Any, ...] | str:
    """``(choose,)`` compiled by numba, or why it does not compile
    (:func:`moesim.policies.hooks.compiled_choose_hook`)."""
    from moesim.policies.hooks import compiled_choose_hook

    return compiled_choose_hook(cls, _signature())


def _never(p: int, layer: int, expert: int, rank: int, cached: np.ndarray, routed: np.ndarray, si: np.ndarray,
           sf: np.ndarray) -> int:
    return FETCH


class _Unused(HookMiss):
    """The hook the kernel is handed when the replay's miss policy is not a :class:`HookMiss`
    (never called; one compiled kernel serves every miss form)."""

    choose = staticmethod(_never)


def _addresses(cls: type) -> tuple[Any, ...]:
    """``cls``'s compiled hook as the kernel is handed it (:func:`moesim.policies.hooks.choose_addresses`)."""
    from moesim.policies.hooks import choose_addresses

    return choose_addresses(cls, _signature())


def hook_arrays(policy: Any, num_experts: int) -> tuple[Any, ...]:
    """``M.hook`` for the replay of miss policy ``policy``: its compiled hook and its own
    state arrays (so that it holds the replay's final state after it, as on the SimPy path), or
    a hook never called."""
    if isinstance(policy, HookMiss):
        # a user's hook as its dispatcher: called through its address, an error it raises is lost
        fn = compiled_choose(type(policy))
        assert isinstance(fn, tuple), fn
        return fn, policy.si, policy.sf, np.zeros(num_experts, np.bool_), np.zeros(num_experts, np.bool_)
    return _addresses(_Unused), *_unused_state(), np.zeros(num_experts, np.bool_), np.zeros(num_experts, np.bool_)


@functools.cache
def _unused_state() -> tuple[np.ndarray, np.ndarray]:
    return np.zeros((1, 1), np.int64), np.zeros((1, 1))

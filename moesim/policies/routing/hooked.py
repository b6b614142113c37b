"""A routing policy written as one hook that both replay paths run (the routing family's
:class:`HookRouting`, as :mod:`moesim.policies.miss.hooked` gives the miss family its own).

``choose(p, layer, probs, experts, cached, out, si, sf)`` chooses, at the routing point of
layer ``layer`` of forward pass ``p``, the experts each of the layer's tokens computes.
``probs`` (float64 ``[tokens, experts]``) are the tokens' router probabilities (zero where the
trace has none), ``experts`` (int64 ``[tokens, k]``) the router's top-k in rank order,
``cached`` (bool ``[experts]``) whether each expert of the layer is resident or in flight at
the scenario's precision. ``out`` (int64 ``[tokens, k]``) holds the router's choice when the
hook is called; what the hook leaves there, each row ``k`` distinct experts in rank order, is
what the tokens compute (their weights stay the router's, SpecMD appendix A.1). ``si``
(int64) and ``sf`` (float64) are the policy's own state, a row per expert of the model
(``layer * experts + expert``) and a column per name in ``int_fields`` / ``float_fields``,
zero at the start or as :meth:`HookRouting.init_state` fills them.

Both paths call the hook compiled by numba when it compiles (so that its arithmetic is the
same number on both); the kernel is handed it as a first-class function in its per-token
arrays (``M.route``), so one compiled kernel serves every such policy
(:class:`HookRoutingForm`). A hook numba cannot compile runs as written on the SimPy path, and
the replay says why. A row that is not ``k`` distinct experts of the layer ends the replay with
one paragraph, on either path.
"""

from __future__ import annotations

import functools
from abc import abstractmethod
from typing import Any, ClassVar

import numpy as np

from moesim.errors import MoesimError
from moesim.jit import kernel
from moesim.kernel_state import ABSENT, C_K, C_NE, C_NPREC, C_PROBS, S_LAYER, _key_at, current_pass
from moesim.policies.registry import PolicyContext
from moesim.policies.routing.base import RoutingForm, RoutingPolicy

__all__ = ["HookRouting", "HookRoutingForm", "route_arrays"]

# M.route: the built-in forms' arrays (a float64 [rows, experts], a float64 and an int64 vector),
# then a hook's: the hook as a first-class function, its state si and sf, and the layer's
# scratch (probabilities, the router's experts, the hook's answer, the cached marks)
(R_Z, R_F, R_I, R_HOOK, R_SI, R_SF, R_PROBS, R_EXPERTS, R_OUT, R_CACHED) = range(10)


class HookRouting(RoutingPolicy):
    """A routing policy given as the hook ``choose`` (module docstring). Subclasses define
    ``choose`` (a ``staticmethod``) and name their per-expert state in ``int_fields`` /
    ``float_fields``; :meth:`init_state` may fill it from ``self.params`` before the replay."""

    int_fields: ClassVar[tuple[str, ...]] = ()
    float_fields: ClassVar[tuple[str, ...]] = ()

    @staticmethod
    @abstractmethod
    def choose(p: int, layer: int, probs: np.ndarray, experts: np.ndarray, cached: np.ndarray, out: np.ndarray,
               si: np.ndarray, sf: np.ndarray) -> None:
        """Leave each token's experts, in rank order, in ``out``."""

    def __init__(self, params: Any, ctx: PolicyContext) -> None:
        super().__init__(params, ctx)
        n = ctx.num_layers * ctx.num_experts
        self.si = np.zeros((n, max(1, len(self.int_fields))), np.int64)
        self.sf = np.zeros((n, max(1, len(self.float_fields))), np.float64)
        self.init_state()

    def init_state(self) -> None:
        """Fill ``self.si``, ``self.sf`` (zero) before the replay. Default: nothing."""

    def route(self, pass_index: int, layer: int, rows: np.ndarray, experts: np.ndarray,
              cached: Any) -> np.ndarray:
        ctx = self.ctx
        wl = ctx.workload
        n = ctx.num_experts
        probs = (np.ascontiguousarray(wl.probs[rows], np.float64) if wl.probs is not None
                 else np.zeros((len(rows), n)))
        mask = np.array([bool(cached(ctx.key(layer, e))) for e in range(n)])
        ex = np.ascontiguousarray(experts, np.int64)
        out = ex.copy()
        fn = compiled_choose(type(self))
        hook = fn[0] if isinstance(fn, tuple) else type(self).choose
        try:
            hook(pass_index, layer, probs, ex, mask, out, self.si, self.sf)
        except Exception as exc:
            raise MoesimError(f"routing policy '{self.name}': its choose hook raised {type(exc).__name__}: {exc} "
                              f"(forward pass {pass_index}, layer {layer}). Fix the hook: {_STATE_HINT}") from None
        for t in range(len(out)):
            row = out[t]
            if ((row < 0) | (row >= n)).any() or len(set(row.tolist())) != len(row):
                raise MoesimError(f"routing policy '{self.name}': choose(p={pass_index}, layer={layer}, ...) left "
                                  f"{row.tolist()} in out[{t}]. {_ANSWERS}")
        return out


_STATE_HINT = ("probs has a row per token and a column per expert, experts and out a row per token and k columns, "
               "cached an entry per expert; si and sf a row per expert of the model (layer * experts + expert) and "
               "a column per name in int_fields and float_fields.")
_ANSWERS = ("A choose hook leaves in each row of out k distinct experts of the layer (0 <= e < experts), in rank "
            "order.")


@kernel
def _route_hooked(b, IS, K, M):
    """The hook's choice (``M.route``) for (pass, layer) ``b``: the layer's probabilities,
    router choice and cached marks given it, each row of its answer checked (``k`` distinct
    experts of the layer, else ValueError) and written to ``M.chosen``."""
    R = M.route
    probs, ex, out, cached = R[R_PROBS], R[R_EXPERTS], R[R_OUT], R[R_CACHED]
    layer = IS[S_LAYER]
    n, k = IS[C_NE], IS[C_K]
    key, step = _key_at(layer, 0, IS), IS[C_NPREC]
    for c in range(n):
        cached[c] = K[key].state != ABSENT
        key += step
    row_order, row_off, experts, chosen, mass = M.row_order, M.row_off, M.experts, M.chosen, M.mass
    lo, rows = row_off[b], row_off[b + 1] - row_off[b]
    for i in range(rows):
        r = row_order[lo + i]
        for e in range(n):
            probs[i, e] = np.float64(mass[r, e]) if IS[C_PROBS] else 0.0
        for j in range(k):
            ex[i, j] = experts[r, j]
            out[i, j] = experts[r, j]
    R[R_HOOK][0](current_pass(IS), layer, probs[:rows], ex[:rows], cached, out[:rows], R[R_SI], R[R_SF])
    for i in range(rows):
        for j in range(k):
            e = out[i, j]
            if e < 0 or e >= n:
                raise ValueError("a choose hook left an expert that is not one of the layer's in out")
            for jj in range(j):
                if out[i, jj] == e:
                    raise ValueError("a choose hook left an expert twice in one row of out")
        r = row_order[lo + i]
        for j in range(k):
            chosen[r, j] = out[i, j]


class HookRoutingForm(RoutingForm):
    """The compiled form of every :class:`HookRouting` policy: the kernel calls its hook through
    ``M.route`` (:func:`route_arrays`)."""

    @classmethod
    def arrays(cls, policy: Any, workload: Any) -> tuple[Any, ...]:
        fn = compiled_choose(type(policy))
        assert isinstance(fn, tuple), fn
        return route_arrays(workload, hook=(fn, policy.si, policy.sf))

    @classmethod
    def functions(cls) -> tuple[Any, ...]:
        return (_route_hooked,)


@functools.cache
def _signature() -> Any:
    from numba.core import types

    i2, f2 = types.int64[:, ::1], types.float64[:, ::1]
    return types.none(types.int64, types.int64, f2, i2, types.boolean[::1], i2, i2, f2)


def compiled_choose(cls: type) -> tuple[Any, ...] | str:
    """``(choose,)`` compiled by numba, or why it does not compile
    (:func:`moesim.policies.hooks.compiled_choose_hook`)."""
    from moesim.policies.hooks import compiled_choose_hook

    return compiled_choose_hook(cls, _signature())


def _never(p: int, layer: int, probs: np.ndarray, experts: np.ndarray, cached: np.ndarray, out: np.ndarray,
           si: np.ndarray, sf: np.ndarray) -> None:
    return None


class _Unused(HookRouting):
    """The hook the kernel is handed when the replay's routing policy is not a
    :class:`HookRouting` (never called; one compiled kernel serves every routing form)."""

    choose = staticmethod(_never)


def _addresses(cls: type) -> tuple[Any, ...]:
    """``cls``'s compiled hook as the kernel is handed it (:func:`moesim.policies.hooks.choose_addresses`)."""
    from moesim.policies.hooks import choose_addresses

    return choose_addresses(cls, _signature())


def route_arrays(workload: Any = None, z: np.ndarray | None = None, running: np.ndarray | None = None,
                 hook: tuple[Any, np.ndarray, np.ndarray] | None = None) -> tuple[Any, ...]:
    """``M.route`` (the layout above): a built-in form's logits ``z`` and state ``running``, or
    a hook policy's ``(compiled hook, si, sf)`` with scratch for the most rows a (pass, layer)
    of ``workload`` holds; what is not given, unread stand-ins of the same types."""
    f2, i1 = np.zeros((1, 1)), np.zeros(1, np.int64)
    out: list[Any] = [np.zeros((1, 1)) if z is None else z, np.zeros(1) if running is None else running, i1]
    if hook is None:
        out += [_addresses(_Unused), np.zeros((1, 1), np.int64), f2, f2, np.zeros((1, 1), np.int64),
                np.zeros((1, 1), np.int64), np.zeros(1, np.bool_)]
    else:
        trace = workload.trace
        rows = int(np.diff(workload.row_off).max(initial=0))
        k, n = trace.experts.shape[1], workload.model.num_experts
        out += [*hook, np.zeros((rows, n)), np.zeros((rows, k), np.int64), np.zeros((rows, k), np.int64),
                np.zeros(n, np.bool_)]
    return tuple(out)

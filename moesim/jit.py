"""numba where it is installed, plain Python where it is not: the decorators of moesim's
compiled loops (the replay kernel, the workload's distinct-expert passes, score-percentile's
proposals). Every such function is also correct uncompiled (``NUMBA_DISABLE_JIT=1``; the
tests run the kernel that way)."""

from __future__ import annotations

from typing import Any

import numpy as np

try:
    from numba import njit
    from numba.core import types
    from numba.core.registry import CPUDispatcher

    HAVE_NUMBA = True

    class _PlainTypes(CPUDispatcher):
        """A dispatcher that a call from compiled code compiles for its arguments' plain types."""

        def get_call_template(self, args: Any, kws: Any) -> Any:
            return super().get_call_template(tuple(types.unliteral(a) for a in args),
                                             {k: types.unliteral(v) for k, v in kws.items()})

        _tuples: dict[int, tuple[tuple[Any, ...], Any]] | None = None

        def typeof_pyval(self, val: Any) -> Any:
            """numba types a tuple argument in Python at every call (its C fast path takes
            arrays and numbers); the replay hands the kernel the same tuples (``A``'s eviction
            hooks, ``M``) chunk after chunk and piece after piece, so the types of the last
            tuples used are kept, with the tuples (:func:`forget_tuples` lets them go), and a tuple
            is typed from its elements' types, a kept tuple's among them (a new piece's ``A``
            holds the same hooks). The hooks' first-class functions took 0.7 ms a call to
            type: a third of an LRU replay's time. A tuple with more than
            :data:`_KEEP_BYTES` of arrays (a piece's per-access arrays) is typed at each call
            and not kept, so that the pieces gone do not stay in memory."""
            if type(val) is not tuple:
                return super().typeof_pyval(val)
            kept = self._tuples
            if kept is None:
                kept = self._tuples = {}
                _KEEPING.add(self)
            hit = kept.pop(id(val), None)
            if hit is not None and hit[0] is val:
                kept[id(val)] = hit  # the most recently used last
                return hit[1]
            ty = types.BaseTuple.from_types([self.typeof_pyval(v) for v in val], tuple)
            if sum(v.nbytes for v in val if isinstance(v, np.ndarray)) > _KEEP_BYTES:
                return ty  # a piece's per-access arrays: kept, 16 pieces' would stay in memory
            if len(kept) >= 16:  # the least recently used goes (the proposals' tuple is new at every call)
                del kept[next(iter(kept))]
            kept[id(val)] = (val, ty)
            return ty

    _KEEPING: set[_PlainTypes] = set()  # the dispatchers keeping tuples (forget_tuples)
    # a tuple whose arrays hold more is typed at each call, not kept (issue 34: keeping the last 16
    # pieces' per-access tuples raised LRU's peak on the 25.6 M-access trace by 250 MB, 12212da)
    _KEEP_BYTES = 1 << 22
except ImportError:  # pragma: no cover - exercised where numba has no wheel
    HAVE_NUMBA = False

    def njit(*args: Any, **kwargs: Any) -> Any:  # type: ignore[no-redef]
        """Without numba a compiled function runs as plain Python."""
        if args and callable(args[0]):
            return args[0]
        return lambda f: f


def forget_tuples() -> None:
    """Let go of the tuple arguments every compiled loop keeps with their types
    (:meth:`_PlainTypes.typeof_pyval`; they hold a replay's arrays: the kernel's per-access
    arrays, a prefetch hook's view of the trace)."""
    if HAVE_NUMBA:
        for disp in _KEEPING:
            disp._tuples = None
        _KEEPING.clear()


# A compiled loop: compiled once per installation (numba's on-disk cache) and without
# numba's runtime (``_nrt``, not in numba's type stubs), so that arrays pass between the
# functions with no reference counting (such functions allocate nothing). ``inline``: one of a
# hot path's small functions, always inlined by LLVM into its callers. ``nogil``: a compiled
# loop lets other threads run (a trace read in pieces reads the next piece meanwhile).
_OPTIONS: dict[str, Any] = {"_nrt": False, "nogil": True}


def _compiled(**options: Any) -> Any:
    """numba's ``njit(cache=True, **options)``, except that a call from compiled code is
    compiled for its arguments' plain types: numba would compile a function once more for
    each literal argument a call passes (``-1``, ``True``, a constant), each time with all
    that it calls (the kernel's ``_add_run`` was compiled 6 times, ``_submit`` 3; the
    quickstart's first replay took a median 35.7 s that way, 28.6 s this way, in five
    interleaved pairs). A branch on an argument that is None is still pruned."""

    def wrap(func: Any) -> Any:
        disp = njit(cache=True, **options)(func)
        if HAVE_NUMBA and isinstance(disp, CPUDispatcher):  # not under NUMBA_DISABLE_JIT
            disp.__class__ = _PlainTypes
        return disp

    return wrap


jit = _compiled(**_OPTIONS)
inline = _compiled(**_OPTIONS, forceinline=True)

__all__ = ["HAVE_NUMBA", "forget_tuples", "inline", "jit", "njit"]

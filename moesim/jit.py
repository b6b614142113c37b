"""numba where it is installed, plain Python where it is not: the decorators of moesim's
compiled loops (the replay kernel, the workload's distinct-expert passes, score-percentile's
proposals). Every such function is also correct uncompiled (``NUMBA_DISABLE_JIT=1``; the
tests run the kernel that way)."""

from __future__ import annotations

from typing import Any

try:
    from numba import njit

    HAVE_NUMBA = True
except ImportError:  # pragma: no cover - exercised where numba has no wheel
    HAVE_NUMBA = False

    def njit(*args: Any, **kwargs: Any) -> Any:  # type: ignore[no-redef]
        """Without numba a compiled function runs as plain Python."""
        if args and callable(args[0]):
            return args[0]
        return lambda f: f


# A compiled loop: compiled once per installation (numba's on-disk cache) and without
# numba's runtime (``_nrt``, not in numba's type stubs), so that arrays pass between the
# functions with no reference counting (such functions allocate nothing). ``inline``: one of a
# hot path's small functions, always inlined by LLVM into its callers. ``nogil``: a compiled
# loop lets other threads run (a trace read in pieces reads the next piece meanwhile).
_OPTIONS: dict[str, Any] = {"cache": True, "_nrt": False, "nogil": True}
jit = njit(**_OPTIONS)
inline = njit(**_OPTIONS, forceinline=True)

__all__ = ["HAVE_NUMBA", "inline", "jit", "njit"]

"""numba where it is installed, plain Python where it is not: the decorators of moesim's
compiled loops (the replay kernel, the workload's distinct-expert passes, score-percentile's
proposals). Every such function is also correct uncompiled (``NUMBA_DISABLE_JIT=1``; the
tests run the kernel that way).

numba's on-disk cache keeps a compiled function until its own source file changes; the code it
compiled in from other files (the compiled functions it calls, the constants it reads) is not
watched, so a change there alone would leave it running the old code. Here a function's cache is
also stale once any source file of its package changed (:class:`PackageCache`)."""

from __future__ import annotations

import functools
import inspect
import warnings
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from moesim.files import tree_digest

_DIGESTS: dict[Path, str] = {}
_T = TypeVar("_T")


def package_root(source: str | Path) -> Path:
    """The folder of the top-level package that holds the file ``source`` (the outermost folder
    with an ``__init__.py`` on the way up), or the file's own folder outside a package."""
    folder = Path(source).resolve().parent
    root = folder
    while (folder / "__init__.py").is_file():
        root = folder
        folder = folder.parent
    return root


def package_digest(source: str | Path) -> str:
    """A digest of the names and contents of every ``.py`` file of the package that holds the file
    ``source`` (:func:`package_root`, :func:`moesim.files.tree_digest`), taken once per process."""
    root = package_root(source)
    if root not in _DIGESTS:
        _DIGESTS[root] = tree_digest(root, (".py",))
    return _DIGESTS[root]


try:
    from numba import literal_unroll
    from numba import njit as _numba_njit
    from numba.core import types
    from numba.core.caching import FunctionCache
    from numba.core.registry import CPUDispatcher

    HAVE_NUMBA = True

    class PackageCache(FunctionCache):
        """numba's on-disk cache of one function, whose entries are stale when its own file
        changed (numba's stamp: the file's time and size) or any source file of its package
        did (:func:`package_digest`): a function compiles in the compiled functions it calls and
        the constants it reads, which may live in other files of the package."""

        def __init__(self, py_func: Any) -> None:
            super().__init__(py_func)
            index = self._cache_file  # numba's index file, which compares its stamp on loading
            index._source_stamp = (index._source_stamp, package_digest(inspect.getfile(py_func)))

    def njit(sig: Any = None, *, cache: bool = False, **options: Any) -> Any:
        """numba's ``njit`` (as a decorator with options, ``njit(...)(func)``), whose on-disk
        cache (``cache=True``) is a :class:`PackageCache`; ``sig``: a signature or a list of them,
        compiled at once and no others, as numba's own does."""

        def wrap(func: Any) -> Any:
            disp = _numba_njit(**options)(func)
            if not isinstance(disp, CPUDispatcher):  # NUMBA_DISABLE_JIT: the function itself
                return disp
            if cache:
                disp._cache = PackageCache(func)  # type: ignore[attr-defined]  # what numba's enable_caching sets
            if sig is not None:
                for one in sig if isinstance(sig, list) else [sig]:
                    disp.compile(one)
                disp.disable_compile()
            return disp

        return wrap

    class _PlainTypes(CPUDispatcher):
        """A dispatcher that a call from compiled code compiles for its arguments' plain types."""

        def get_call_template(self, args: Any, kws: Any) -> Any:
            return super().get_call_template(tuple(types.unliteral(a) for a in args),
                                             {k: types.unliteral(v) for k, v in kws.items()})

        _tuples: dict[int, tuple[tuple[Any, ...], Any]] | None = None
        _large: tuple[tuple[Any, ...], Any] | None = None  # the last large tuple and its type

        def typeof_pyval(self, val: Any) -> Any:
            """numba types a tuple argument in Python at every call (its C fast path takes
            arrays and numbers); the replay hands the kernel the same tuples (``A``'s eviction
            hooks, ``M``; named tuples among them) chunk after chunk and piece after piece, so the types of the last
            tuples used are kept, with the tuples (:func:`forget_tuples` lets them go), and a tuple
            is typed from its elements' types, a kept tuple's among them (a new piece's ``A``
            holds the same hooks). The hooks' first-class functions took 0.7 ms a call to
            type: a third of an LRU replay's time. A tuple with more than
            :data:`_KEEP_BYTES` of arrays (a piece's per-access arrays, handed over at each of
            the piece's calls) is kept alone, in a place of its own, until the next such tuple
            or :func:`forget_large_tuples` (the replay calls it as a piece ends), so that the
            pieces gone do not stay in memory: typing it took 0.2 ms a call, 0.18 s of an LRU
            replay's 1.4 s on the 25.6 M-access trace (800 calls of 256 passes)."""
            if not isinstance(val, tuple):
                return super().typeof_pyval(val)
            large = self._large
            if large is not None and large[0] is val:
                return large[1]
            kept = self._tuples
            if kept is None:
                kept = self._tuples = {}
                _KEEPING.add(self)
            hit = kept.pop(id(val), None)
            if hit is not None and hit[0] is val:
                kept[id(val)] = hit  # the most recently used last
                return hit[1]
            ty = types.BaseTuple.from_types([self.typeof_pyval(v) for v in val], type(val))
            if sum(v.nbytes for v in val if isinstance(v, np.ndarray)) > _KEEP_BYTES:
                self._large = (val, ty)  # a piece's per-access arrays: kept alone (16 pieces' would stay)
                return ty
            if len(kept) >= 16:  # the least recently used goes (the proposals' tuple is new at every call)
                del kept[next(iter(kept))]
            kept[id(val)] = (val, ty)
            return ty

    _KEEPING: set[_PlainTypes] = set()  # the dispatchers keeping tuples (forget_tuples)
    # a tuple whose arrays hold more is typed at each call, not kept (keeping the last 16
    # pieces' per-access tuples raised LRU's peak on the 25.6 M-access trace by 250 MB)
    _KEEP_BYTES = 1 << 22
except ImportError:  # pragma: no cover - exercised where numba has no wheel
    HAVE_NUMBA = False

    def njit(sig: Any = None, *, cache: bool = False, **options: Any) -> Any:
        """Without numba a compiled function runs as plain Python."""
        return lambda f: f

    def literal_unroll(container: _T) -> _T:
        """Without numba the loop over a tuple is a plain loop."""
        return container


def forget_tuples() -> None:
    """Let go of the tuple arguments every compiled loop keeps with their types
    (:meth:`_PlainTypes.typeof_pyval`; they hold a replay's arrays: the kernel's per-access
    arrays, a prefetch hook's view of the trace)."""
    if HAVE_NUMBA:
        for disp in _KEEPING:
            disp._tuples = disp._large = None
        _KEEPING.clear()


def forget_large_tuples() -> None:
    """Let go of the large tuple argument each compiled loop keeps with its type (a piece's
    per-access arrays, :meth:`_PlainTypes.typeof_pyval`), the small ones' kept: a replay read
    in pieces calls it as each piece ends."""
    if HAVE_NUMBA:
        for disp in _KEEPING:
            disp._large = None


# A compiled loop: compiled once per installation (numba's on-disk cache) and without
# numba's runtime (``_nrt``, not in numba's type stubs), so that arrays pass between the
# functions with no reference counting (such functions allocate nothing). ``inline``: one of a
# hot path's functions, always inlined by LLVM into its callers (the copy engine's among them:
# called out of line, ``_submit`` and ``_advance`` took 17% and 15% of an LRU replay's kernel
# thread's profile samples).
# ``nogil``: a compiled loop lets other threads run (a trace read in pieces reads the next
# piece meanwhile).
_OPTIONS: dict[str, Any] = {"_nrt": False, "nogil": True}


def _compiled(**options: Any) -> Any:
    """numba's ``njit(cache=True, **options)``, except that a call from compiled code is
    compiled for its arguments' plain types: numba would compile a function once more for
    each literal argument a call passes (``-1``, ``True``, a constant), each time with all
    that it calls (the kernel's ``_add_run`` was compiled 6 times, ``_submit`` 3; the
    quickstart's first replay took a median 35.7 s that way, 28.6 s this way, in five
    interleaved pairs). A branch on an argument that is None is still pruned."""

    def wrap(func: Any) -> Any:
        disp = njit(cache=True, **options)(func)  # moesim's: its cache watches the whole package
        if HAVE_NUMBA and isinstance(disp, CPUDispatcher):  # not under NUMBA_DISABLE_JIT
            disp.__class__ = _PlainTypes
        return disp

    return wrap


# Compiled code only calls ``kernel``, ``inline`` and ``ir_inline`` functions: numba makes them no
# wrapper to be called from Python (``no_cpython_wrapper``) or as a C function (``no_cfunc_wrapper``),
# whose code -- unboxing the replay kernel's tuples of arrays and first-class functions -- took a
# third of the kernel's compile; :func:`entry` gives one that Python can call (the tests').
_INTERNAL: dict[str, Any] = {**_OPTIONS, "no_cpython_wrapper": True, "no_cfunc_wrapper": True}
jit = _compiled(**_OPTIONS)
kernel = _compiled(**_INTERNAL)
inline = _compiled(**_INTERNAL, forceinline=True)
# a function numba inlines into its callers' code before compiling them (``inline="always"``): it is
# never compiled on its own
ir_inline = _compiled(**_INTERNAL, inline="always")


def entry(func: Any) -> Any:
    """A twin of compiled function ``func`` that Python can call (``kernel`` and ``inline``
    functions have no wrapper for it): the same source compiled with numba's wrapper, not cached
    on disk (its cache would be the wrapperless one's); the functions it calls are the shared
    ones. Called, it compiles as the replay does, numba's "experimental" first-class function
    warning silenced (the forms' functions are first-class values; whether a call compiles or
    finds its callees compiled already must not change what it does). ``func`` itself where
    numba is off."""
    if not HAVE_NUMBA or not isinstance(func, CPUDispatcher):
        return func
    call = _ENTRIES.get(func)
    if call is None:
        from numba.core.errors import NumbaExperimentalFeatureWarning

        twin = _numba_njit(**_OPTIONS)(func.py_func)
        twin.__class__ = _PlainTypes

        @functools.wraps(func.py_func)
        def call(*args: Any) -> Any:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", NumbaExperimentalFeatureWarning)
                return twin(*args)

        call.dispatcher = twin  # type: ignore[attr-defined]
        _ENTRIES[func] = call
    return call


_ENTRIES: dict[Any, Any] = {}

if HAVE_NUMBA:  # a first compile (after an installation or a change) gets a helper on the other core
    from moesim.jitplan import watch_compiles

    watch_compiles()

__all__ = ["HAVE_NUMBA", "entry", "forget_large_tuples", "forget_tuples", "inline", "ir_inline", "jit", "kernel", "literal_unroll", "njit",
           "package_digest", "package_root"]

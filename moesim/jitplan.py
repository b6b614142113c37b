"""A first compile on two cores (a fresh install's first ``moesim compare``).

numba compiles one function at a time, depth first: a call from compiled code compiles the
function called (and all it calls) before its caller goes on, and each compiled function goes
to numba's on-disk cache as it is made. Before it compiles a function, numba looks in that
cache. So a second process that compiles the same functions, for the same argument types, in
the opposite order, makes the ones the first process would have reached last; the first finds
them in the cache when it gets there and loads them instead (8 ms each: the plan's 80 loaded
in 0.63 s from a cache the helper made), and the two
meet in the middle. On the 2-core machine, with numba's cache emptied, the first quickstart
``moesim run`` (most of it the replay kernel's compile) took 20.6 s and 16.9 s with the helper
against 25.3 s and 27.6 s without, and the first ``moesim compare`` 23.1 s and 20.7 s against
32.5 s and 31.4 s (two interleaved runs of each of ``benchmarks/first_run.sh``; README: Speed).

The plan (``jitplan.json``, beside this file) lists moesim's compiled functions with their
argument types in the order a first :mod:`moesim.studies._kernel_loaded` warm-up compiles them
(what ``moesim run`` and ``moesim compare`` compile first); ``tools/jit_plan.py`` writes it
again from a compile. When a process starts compiling one of the plan's functions for the
plan's argument types (so numba's cache lacks it: the first run after an installation or a
change), it starts the helper (:func:`main`, in a new Python process), once, on a machine with two
cores or more, unless ``MOESIM_NO_JIT_HELPER`` is set. The helper compiles the plan from its
end and stops at its start, when the process that started it is gone, or when that process
exits (which ends it); on Linux the kernel kills it the moment that process ends, mid-compile
too (killed, as a study's workers' server is when the study's planning fails). One helper runs
at a time for a moesim and a numba cache folder.

Nothing here changes what is compiled: a function loaded from the cache is the code its compile
made, and a plan that no longer matches the code (a function renamed, an argument type changed)
only makes the helper compile what nobody asks for (a test says when it is stale). The helper
writes numba's cache only, as numba writes it from any process (a file written whole, then
renamed into place)."""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import pkgutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

PLAN = Path(__file__).with_name("jitplan.json")
HELPER_ENV = "MOESIM_NO_JIT_HELPER"  # set (to anything but ""): no helper; the helper's own environment has it

_STATE: dict[str, Any] = {}  # "plan": the plan, loaded; "helper": (the helper, the pid that started it)


def encode_type(ty: Any) -> Any:
    """A numba argument type as JSON (:func:`decode_type` reads it back): arrays (records among
    their element types), tuples, first-class functions, numbers, booleans and None. Other types
    raise ``TypeError``."""
    import numpy as np
    from numba.core import types
    from numba.np.numpy_support import as_dtype

    if isinstance(ty, types.Array):
        dtype = as_dtype(ty.dtype)
        return {"array": np.lib.format.dtype_to_descr(dtype), "aligned": bool(dtype.isalignedstruct),
                "ndim": ty.ndim, "layout": ty.layout, "readonly": not ty.mutable}
    if isinstance(ty, types.BaseTuple):
        members: Any = ty  # a tuple type iterates over its members' types
        spec: dict[str, Any] = {"tuple": [encode_type(t) for t in members]}
        if isinstance(ty, (types.NamedTuple, types.NamedUniTuple)):
            spec["named"] = f"{ty.instance_class.__module__}:{ty.instance_class.__qualname__}"
        return spec
    if isinstance(ty, types.FunctionType):  # an eviction hook, handed to the kernel
        return {"function": [encode_type(t) for t in ty.signature.args], "returns": encode_type(ty.signature.return_type)}
    if ty == types.none:
        return "none"
    if isinstance(ty, (types.Integer, types.Float, types.Boolean)):
        return str(as_dtype(ty))
    raise TypeError(f"no plan form for the numba type {ty}")


def decode_type(spec: Any) -> Any:
    """The numba type :func:`encode_type` wrote as ``spec``."""
    import numpy as np
    from numba import from_dtype
    from numba.core import types
    from numba.core.typing import signature

    if spec == "none":
        return types.none
    if isinstance(spec, str):
        return from_dtype(np.dtype(spec))
    if "tuple" in spec:
        cls = pkgutil.resolve_name(spec["named"]) if "named" in spec else tuple
        return types.BaseTuple.from_types([decode_type(s) for s in spec["tuple"]], cls)
    if "function" in spec:
        return types.FunctionType(signature(decode_type(spec["returns"]), *[decode_type(s) for s in spec["function"]]))
    dtype = np.lib.format.descr_to_dtype(spec["array"])
    if spec["aligned"]:  # a record numpy laid out as C would (the descr keeps its padding, not the flag)
        names = list(dtype.names or ())
        fields: Any = {"names": names, "formats": [dtype.fields[n][0] for n in names],  # type: ignore[index]
                       "offsets": [dtype.fields[n][1] for n in names], "itemsize": dtype.itemsize,  # type: ignore[index]
                       "aligned": True}
        dtype = np.dtype(fields)
    return types.Array(from_dtype(dtype), spec["ndim"], spec["layout"], readonly=spec["readonly"])


def compiled_function(module: str, qualname: str) -> Any:
    """moesim's compiled function ``module.qualname`` (a numba dispatcher), or None where there
    is none by that name (a plan older than the code)."""
    try:
        obj = pkgutil.resolve_name(f"{module}:{qualname}")
    except (ImportError, AttributeError, ValueError):
        return None
    return obj if callable(getattr(obj, "compile", None)) else None


def load_plan(path: Path = PLAN) -> list[tuple[str, str, tuple[Any, ...]]]:
    """The plan's ``(module, qualname, argument types)``, in the order a first compile reaches
    them; empty where the file is missing or unreadable. A plan written with another numba is
    read with this one: where that numba gives some function other argument types, the helper
    compiles what nobody asks for, and the process compiles it itself."""
    try:
        from numba.core.errors import NumbaExperimentalFeatureWarning

        doc = json.loads(path.read_text())
        with warnings.catch_warnings():  # numba calls first-class function types experimental
            warnings.simplefilter("ignore", NumbaExperimentalFeatureWarning)
            kinds = [decode_type(spec) for spec in doc["types"]]
        return [(e["module"], e["function"], tuple(kinds[i] for i in e["args"])) for e in doc["compiles"]]
    except (OSError, ValueError, KeyError, IndexError, TypeError, ImportError):
        return []


def _plan() -> list[tuple[str, str, tuple[Any, ...]]]:
    if "plan" not in _STATE:
        _STATE["plan"] = load_plan()
    return _STATE["plan"]


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def _planned(dispatcher: Any, args: tuple[Any, ...]) -> bool:
    py_func = getattr(dispatcher, "py_func", None)
    if py_func is None or not str(py_func.__module__).startswith(__name__.split(".")[0] + "."):
        return False
    return (py_func.__module__, py_func.__qualname__, tuple(args)) in _plan()


def on_compile(dispatcher: Any, args: tuple[Any, ...]) -> None:
    """Told as this process starts compiling ``dispatcher`` for ``args`` (numba's compile event,
    never a load from its cache): the first time it is one of the plan's compiles, start the
    helper, once per process, where there are two cores or more."""
    if "helper" in _STATE and _STATE["helper"][1] == os.getpid():
        return
    if os.environ.get(HELPER_ENV) or _cores() < 2 or not _planned(dispatcher, args):
        return
    root = str(Path(__file__).resolve().parent.parent)  # the folder this moesim is imported from
    helper = subprocess.Popen([sys.executable, "-c", _BOOT, root, str(os.getpid())], env={**os.environ, HELPER_ENV: "1"},
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _STATE["helper"] = (helper, os.getpid())


# The helper's start: ``python -c _BOOT ROOT PID`` imports the moesim in ROOT (not one in the
# working folder: that is dropped from the path; ROOT goes first only where it is not on the
# path already, so an installed moesim's site-packages stays behind the standard library)
_BOOT = ("import sys; root = sys.argv[1]; sys.path[:] = [p for p in sys.path if p != '']; "
         "sys.path.insert(0, root) if root not in sys.path else None; "
         "from moesim.jitplan import main; sys.exit(main(sys.argv[2:]))")


def _end_helper() -> None:
    """At exit: end the helper this process started (a forked child leaves its parent's be)."""
    started = _STATE.get("helper")
    if started is None or started[1] != os.getpid():
        return
    helper = started[0]
    if helper.poll() is None:
        helper.terminate()
        helper.wait()


def watch_compiles() -> None:
    """Start the helper on this process's first compile of a planned function (numba's compile
    events); called once, as :mod:`moesim.jit` is imported, except in the helper itself."""
    if os.environ.get(HELPER_ENV) or _STATE.get("listening"):
        return
    from numba.core import event

    class _Listener(event.Listener):
        def on_start(self, ev: Any) -> None:
            with contextlib.suppress(Exception):  # the helper is only a help: a compile goes on without it
                on_compile(ev.data["dispatcher"], tuple(ev.data["args"]))

        def on_end(self, ev: Any) -> None:
            pass

    event.register("numba:compile", _Listener())
    atexit.register(_end_helper)
    _STATE["listening"] = True


def compile_from_end(plan: list[tuple[str, str, tuple[Any, ...]]], parent: int) -> int:
    """The helper's work: compile ``plan`` from its end (each a load from numba's cache where
    the process ``parent`` made it already), until its start or until ``parent`` is gone;
    returns how many it compiled or loaded."""
    done = 0
    for module, qualname, args in reversed(plan):
        if os.getppid() != parent:
            break
        dispatcher = compiled_function(module, qualname)
        if dispatcher is None:
            continue
        try:
            dispatcher.compile(args)
        except Exception:  # the process that needs it compiles it, and reports what fails
            continue
        done += 1
    return done


def _lock_path() -> Path:
    """The file a helper locks while it runs: one per moesim and numba cache folder."""
    where = f"{Path(__file__).resolve()}|{os.environ.get('NUMBA_CACHE_DIR', '')}"
    return Path(tempfile.gettempdir()) / f"moesim-jit-helper-{hashlib.sha1(where.encode()).hexdigest()[:16]}.lock"


def _die_with_parent() -> bool:
    """Linux: ask the kernel to kill this process the moment the thread that started it ends
    (``prctl(PR_SET_PDEATHSIG, SIGKILL)``), mid-compile too, so that a helper never outlives the
    process it helps (a study's workers' server stopped while it compiles: ``sweep.stop_workers``);
    elsewhere the check between compiles (:func:`compile_from_end`) is all. Returns whether it
    was set. A helper started from a thread that ends early (a compile in a reading thread) ends
    with it: only the help is lost."""
    try:
        import ctypes
        import signal

        return ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0) == 0  # 1: PR_SET_PDEATHSIG
    except (AttributeError, OSError):  # no prctl: not Linux
        return False


def main(argv: list[str]) -> int:
    """The helper of the process whose id is ``argv[0]`` (``python -m moesim.jitplan PID``, or
    :data:`_BOOT` as :func:`on_compile` starts it); it does nothing
    where another helper runs for the same moesim and numba cache (a study's planning process
    and its workers' server both compile: one helper, not two, beside them)."""
    os.environ[HELPER_ENV] = "1"
    warnings.simplefilter("ignore")  # nobody reads the helper's output
    with open(_lock_path(), "a") as lock:
        try:
            import fcntl

            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except ImportError:  # Windows: no lock
            pass
        except OSError:  # another helper has it
            return 0
        _die_with_parent()  # then the parent's check: it may have ended before this
        compile_from_end(load_plan(), int(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

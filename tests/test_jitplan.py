"""A first compile on two cores (``moesim.jitplan``): the plan, the helper and when it starts."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
import types as pytypes
import warnings
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

import moesim.jitplan as J
from moesim.jit import HAVE_NUMBA

pytestmark = pytest.mark.skipif(not HAVE_NUMBA, reason="numba is not installed")

ROOT = Path(__file__).resolve().parent.parent

# prints each compile numba starts in this process (moesim's functions), then runs ``CODE``
_RECORDER = """
import sys
import time
from numba.core import event
class Listener(event.Listener):
    def on_start(self, ev):
        d = ev.data["dispatcher"]
        if d.py_func.__module__.startswith("moesim."):
            print("COMPILED", d.py_func.__module__ + "." + d.py_func.__qualname__, file=sys.stderr)
    def on_end(self, ev):
        pass
event.register("numba:compile", Listener())
"""


def _env(cache: Path, helper: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_DISABLE_JIT", J.HELPER_ENV)}
    env.update({"NUMBA_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)})
    if not helper:
        env[J.HELPER_ENV] = "1"
    return env


def _compiled(stderr: str) -> list[str]:
    return [line.split()[1] for line in stderr.splitlines() if line.startswith("COMPILED ")]


def test_after_the_helper_a_first_warm_up_and_quickstart_compile_nothing_it_planned(tmp_path):
    """The plan is current: the helper alone, run to its end with numba's cache empty, leaves
    in the cache every function the kernel warm-up (what a study's workers' server loads) and
    the quickstart's ``moesim run`` then need, with their argument types: they compile none of
    moesim's functions but the ones the plan leaves out by name (the default hooks each replay
    makes). A plan older than the code fails here, naming what it lacks: run
    ``python tools/jit_plan.py``. With another numba than the plan's (CI installs the newest),
    a plan this numba's types do not match is skipped, with that message: it costs the first
    compile time, never an answer."""
    cache = tmp_path / "cache"
    helper = subprocess.run([sys.executable, "-c", "import os, sys; from moesim.jitplan import main; "
                             "sys.exit(main([str(os.getppid())]))"],
                            env=_env(cache, helper=True), capture_output=True, text=True)
    assert helper.returncode == 0, helper.stderr
    plan = json.loads(J.PLAN.read_text())
    import numba

    other = numba.__version__ != plan["numba"]
    if other and not any(cache.rglob("*.nbc")):
        pytest.skip(f"the plan was written with numba {plan['numba']} and this numba ({numba.__version__}) "
                    f"compiles none of it: python tools/jit_plan.py writes it again")
    assert any(cache.rglob("*.nbc")), "the helper compiled nothing"
    left = set(plan["left"])
    warm = subprocess.run([sys.executable, "-c", _RECORDER + "import moesim.studies._kernel_loaded"],
                          env=_env(cache, helper=False), capture_output=True, text=True, check=True)
    run = subprocess.run([sys.executable, "-c", _RECORDER + "import sys; from moesim.cli import main; "
                          "sys.argv = ['moesim', 'run', '--no-write', '-q']; main()"],
                         env=_env(cache, helper=False), capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    for name, proc in (("warm-up", warm), ("moesim run", run)):
        missing = [f for f in _compiled(proc.stderr) if f not in left]
        if missing and other:
            pytest.skip(f"the plan was written with numba {plan['numba']}; with numba {numba.__version__} the "
                        f"{name} compiled what it lacks ({', '.join(missing)}): python tools/jit_plan.py writes it again")
        assert missing == [], f"the {name} compiled what the plan lacks (python tools/jit_plan.py): {missing}"


def _types():
    from numba import from_dtype
    from numba.core import types
    from numba.core.typing import signature

    state = np.dtype([("state", "<i8"), ("nextuse", "<f8"), ("flag", "i1")])
    padded = np.dtype([("a", "i1"), ("b", "<f8")], align=True)
    spread = np.dtype({"names": ["a", "b"], "formats": ["i1", "<f8"], "offsets": [0, 16], "itemsize": 32,
                       "aligned": True})  # aligned, with more room than alignment asks
    arr = types.Array(types.int64, 1, "C")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hook = types.FunctionType(signature(types.none, types.int64, types.boolean, arr))
        hooks = types.UniTuple(hook, 1)
    return [arr, types.Array(types.float32, 2, "C"), types.Array(types.int16, 2, "F"),
            types.Array(types.int64, 1, "A", readonly=True), types.Array(from_dtype(state), 1, "C"),
            types.Array(from_dtype(padded), 1, "C"), types.Array(from_dtype(spread), 1, "C"), types.int64, types.int32, types.float64, types.float32,
            types.boolean, types.int8, types.none, types.Tuple((arr, types.float64)), types.UniTuple(arr, 3),
            types.Tuple((types.Tuple((arr, hooks)), types.none)), hook, hooks]


def test_every_argument_type_the_plan_writes_reads_back_as_the_same_numba_type():
    """Arrays (any dtype, dimension, layout, read-only; records packed and aligned), numbers,
    booleans, None, tuples of them (nested, uniform or not) and first-class functions come back
    equal, through JSON text; another type is refused by name."""
    from numba.core import types

    for ty in _types():
        spec = json.loads(json.dumps(J.encode_type(ty)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            back = J.decode_type(spec)
        assert back == ty, (ty, spec, back)
        assert type(back) is type(ty)
    aligned = J.encode_type(_types()[5])
    assert aligned["aligned"] is True
    assert J.encode_type(_types()[4])["aligned"] is False
    with pytest.raises(TypeError, match="no plan form for the numba type"):
        J.encode_type(types.unicode_type)


def _write_plan(path: Path, numba_version: str | None = None, function: str = "f") -> None:
    import numba

    path.write_text(json.dumps({"numba": numba_version or numba.__version__, "types": ["int64", {"tuple": ["float64"]}],
                                "compiles": [{"module": "m", "function": function, "args": [0, 1]},
                                             {"module": "m", "function": "g", "args": [1]}], "left": []}))


def test_the_plan_loads_with_its_types_and_is_empty_when_it_cannot_be_read(tmp_path):
    """A plan names its types by number; one written with another numba is read with this one;
    a missing file, broken JSON, a type number out of range or a type it cannot read give no
    plan (the helper then does nothing), never an error."""
    from numba.core import types

    path = tmp_path / "plan.json"
    _write_plan(path)
    assert J.load_plan(path) == [("m", "f", (types.int64, types.UniTuple(types.float64, 1))),
                                 ("m", "g", (types.UniTuple(types.float64, 1),))]
    loaded = J.load_plan(path)
    _write_plan(path, numba_version="0.0.1")
    assert J.load_plan(path) == loaded
    assert J.load_plan(tmp_path / "none.json") == []
    path.write_text("{not json")
    assert J.load_plan(path) == []
    _write_plan(path)
    path.write_text(path.read_text().replace('"args": [1]', '"args": [2]'))
    assert J.load_plan(path) == []
    path.write_text(path.read_text().replace('"float64"', '{"odd": 1}'))
    assert J.load_plan(path) == []


def test_the_shipped_plan_loads_and_names_compiled_functions_of_moesim():
    plan = J.load_plan()
    assert len(plan) >= 50
    names = [(m, f) for m, f, _ in plan]
    assert len(set(plan)) == len(plan)  # each compile once
    for module, function, _ in plan:
        assert J.compiled_function(module, function) is not None, (module, function)
    assert ("moesim.simulator.kernel_compute", "replay_passes") in names


def test_the_plan_of_a_common_form_holds_no_hook_of_a_rare_form():
    """The kernel is compiled per group of forms (:mod:`moesim.policies.eviction.forms`), for the
    group of the replay's form. The plan is what the warm-up (lru, a common form) compiles from an
    empty cache (the first test here keeps it current): it holds the victim walk of every common
    form and not one hook of a rare form (SIEVE, S3-FIFO, ARC, the list hooks)."""
    from moesim.policies.eviction.forms import GROUPS, NoForm

    planned = {(m, f) for m, f, _ in J.load_plan()}

    def hooks(forms):
        return {(fn.py_func.__module__, fn.py_func.__qualname__) for form in forms if form is not NoForm
                for fn in form.functions()}

    common, rare = hooks(GROUPS[0]), hooks(GROUPS[1])
    assert {"sieve", "s3fifo", "arc", "list_hooks"} == {m.rsplit(".", 1)[1] for m, _ in rare - common}
    assert not (rare - common) & planned, (rare - common) & planned
    victims = {(form.victim.py_func.__module__, form.victim.py_func.__qualname__) for form in GROUPS[0]}
    assert victims <= planned, victims - planned


def test_a_name_that_is_not_a_compiled_function_resolves_to_none():
    assert J.compiled_function("moesim.simulator.kernel_compute", "replay_passes") is not None
    assert J.compiled_function("moesim.simulator.kernel_compute", "no_such_function") is None
    assert J.compiled_function("moesim.no_such_module", "f") is None
    assert J.compiled_function("moesim.jitplan", "PLAN") is None  # there, but not compiled


class _Popen:
    started: ClassVar[list[tuple[list[str], dict[str, str]]]] = []

    def __init__(self, argv, env, **kw):
        _Popen.started.append((argv, env))
        assert kw["stdin"] == kw["stdout"] == kw["stderr"] == subprocess.DEVNULL
        self.pid = 4242


def _dispatcher(module: str, qualname: str):
    return pytypes.SimpleNamespace(py_func=pytypes.SimpleNamespace(__module__=module, __qualname__=qualname))


@pytest.fixture
def planned(monkeypatch):
    """A plan of two compiles of module ``moesim.x``, a fake ``Popen``, two cores."""
    from numba.core import types

    state = {"plan": [("moesim.x", "A.f", (types.int64,)), ("moesim.x", "g", (types.float64, types.none))]}
    monkeypatch.setattr(J, "_STATE", state)
    monkeypatch.setattr(J.subprocess, "Popen", _Popen)
    monkeypatch.setattr(J, "_cores", lambda: 2)
    monkeypatch.delenv(J.HELPER_ENV, raising=False)
    _Popen.started = []
    return state


def test_the_first_planned_compile_starts_one_helper_of_this_process(planned, monkeypatch):
    """Only a compile of a planned function for the planned argument types starts it, once per
    process; the helper runs this moesim (its folder handed to the start code) with the
    helper's flag set, and is told this process's id."""
    from numba.core import types

    J.on_compile(_dispatcher("moesim.x", "A.f"), (types.int32,))  # other argument types
    J.on_compile(_dispatcher("moesim.y", "A.f"), (types.int64,))  # another module
    J.on_compile(_dispatcher("other.x", "A.f"), (types.int64,))   # not moesim's
    J.on_compile(_dispatcher("moesim.x", "f"), (types.int64,))    # another name
    J.on_compile(pytypes.SimpleNamespace(), (types.int64,))        # no Python function
    assert _Popen.started == []
    monkeypatch.setenv("SOME_SETTING", "kept")
    J.on_compile(_dispatcher("moesim.x", "g"), (types.float64, types.none))
    assert len(_Popen.started) == 1
    argv, env = _Popen.started[0]
    assert argv == [sys.executable, "-c", J._BOOT, str(ROOT), str(os.getpid())]
    assert env[J.HELPER_ENV] == "1"
    assert env["SOME_SETTING"] == "kept"
    assert planned["helper"][1] == os.getpid()
    J.on_compile(_dispatcher("moesim.x", "A.f"), (types.int64,))
    assert len(_Popen.started) == 1  # once per process
    planned["helper"] = (planned["helper"][0], os.getpid() + 1)  # started by the parent of a fork
    J.on_compile(_dispatcher("moesim.x", "A.f"), (types.int64,))
    assert len(_Popen.started) == 2


def test_a_real_first_compile_of_a_planned_function_starts_the_helper_and_ends_it_at_exit(tmp_path):
    """Through numba's own compile event, in a process with numba's cache empty: compiling the
    plan's first function starts the helper (this process's id and the start code in its
    command line), and the process ends it as it exits; with the cache kept, a second process
    loads that function and starts none."""
    code = ("import os, moesim.jitplan as J, moesim.jit; m, f, args = J.load_plan()[0]; "
            "J.compiled_function(m, f).compile(args); h = J._STATE.get('helper'); "
            "print(h is not None and h[1] == os.getpid() and h[0].args[2] == J._BOOT "
            "and h[0].args[-1] == str(os.getpid()), h[0].pid if h else 0)")
    env = _env(tmp_path / "cache", helper=True)
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    started, pid = first.stdout.split()
    assert started == "True"
    with pytest.raises(ProcessLookupError):  # ended and reaped as its process exited
        os.kill(int(pid), 0)
    second = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    assert second.stdout.split() == ["False", "0"]


def test_the_helper_imports_the_moesim_that_started_it_not_one_in_its_working_folder(tmp_path):
    """The start code drops the working folder from the path (a ``moesim`` there, here one that
    fails as it is imported, is not the one that compiled) and puts the starting moesim's folder
    first only where it is not on the path already; told of a parent that is not its own, the
    helper stops before compiling anything."""
    decoy = tmp_path / "moesim"
    decoy.mkdir()
    (decoy / "__init__.py").write_text("raise ImportError('the decoy in the working folder')\n")
    probe = J._BOOT.replace("from moesim.jitplan import main; sys.exit(main(sys.argv[2:]))",
                            "import moesim; print(moesim.__file__); print(sys.path.index(root))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if "MUTANT_UNDER_TEST" in env:  # under mutmut: its copy's code, unmutated (it finds no settings in tmp_path)
        env["MUTANT_UNDER_TEST"] = ""
    for folder in (str(ROOT), str(tmp_path / "elsewhere")):
        out = subprocess.run([sys.executable, "-c", probe, folder], cwd=tmp_path, env=env, capture_output=True,
                             text=True)
        if folder == str(ROOT):
            assert out.returncode == 0, out.stderr
            assert out.stdout.split() == [str(ROOT / "moesim" / "__init__.py"), "0"]
        else:  # not on the path and no moesim there: the decoy is not imported either
            assert "the decoy" not in out.stderr
    (tmp_path / "other").mkdir()
    env = {**env, "PYTHONPATH": os.pathsep.join([str(tmp_path / "other"), str(ROOT)])}
    out = subprocess.run([sys.executable, "-c", probe, str(ROOT)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[1] == "1"  # on the path already (second): left where it was
    done = subprocess.run([sys.executable, "-c", J._BOOT, str(ROOT), "1"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_no_helper_in_a_helper_or_on_one_core(planned, monkeypatch):
    from numba.core import types

    monkeypatch.setenv(J.HELPER_ENV, "1")
    J.on_compile(_dispatcher("moesim.x", "A.f"), (types.int64,))
    monkeypatch.delenv(J.HELPER_ENV)
    monkeypatch.setattr(J, "_cores", lambda: 1)
    J.on_compile(_dispatcher("moesim.x", "A.f"), (types.int64,))
    assert _Popen.started == []
    assert "helper" not in planned


def test_the_cores_are_the_ones_this_process_may_run_on(monkeypatch):
    assert J._cores() == len(os.sched_getaffinity(0))
    monkeypatch.delattr(J.os, "sched_getaffinity")  # as on macOS: the machine's count, 1 where unknown
    monkeypatch.setattr(J.os, "cpu_count", lambda: 6)
    assert J._cores() == 6
    monkeypatch.setattr(J.os, "cpu_count", lambda: None)
    assert J._cores() == 1


def test_the_plan_is_read_once_per_process_when_first_needed(monkeypatch):
    from numba.core import types

    reads = []
    plan = [("moesim.x", "g", (types.int64,))]
    monkeypatch.setattr(J, "load_plan", lambda: reads.append(1) or plan)
    monkeypatch.setattr(J, "_STATE", {})
    assert J._plan() is plan
    assert J._plan() is plan
    assert reads == [1]
    assert J._planned(_dispatcher("moesim.x", "g"), (types.int64,))
    assert not J._planned(_dispatcher("moesim.x", "g"), (types.int32,))
    assert reads == [1]


class _Helper:
    def __init__(self, running: bool):
        self.running, self.calls = running, []

    def poll(self):
        self.calls.append("poll")
        return None if self.running else 0

    def terminate(self):
        self.calls.append("terminate")

    def wait(self):
        self.calls.append("wait")


def test_at_exit_the_process_ends_its_own_running_helper_and_no_other(monkeypatch):
    running, done, forked = _Helper(True), _Helper(False), _Helper(True)
    for helper, pid, calls in ((running, os.getpid(), ["poll", "terminate", "wait"]), (done, os.getpid(), ["poll"]),
                               (forked, os.getpid() + 1, [])):
        monkeypatch.setattr(J, "_STATE", {"helper": (helper, pid)})
        J._end_helper()
        assert helper.calls == calls
    monkeypatch.setattr(J, "_STATE", {})
    J._end_helper()  # none started


def test_compiles_are_watched_once_and_never_in_the_helper(monkeypatch):
    from numba.core import event

    registered, at_exit = [], []
    monkeypatch.setattr(event, "register", lambda kind, listener: registered.append((kind, listener)))
    monkeypatch.setattr(J.atexit, "register", at_exit.append)
    monkeypatch.setattr(J, "_STATE", {})
    monkeypatch.setenv(J.HELPER_ENV, "1")
    J.watch_compiles()
    assert registered == []
    monkeypatch.delenv(J.HELPER_ENV)
    J.watch_compiles()
    J.watch_compiles()
    assert [kind for kind, _ in registered] == ["numba:compile"]
    assert at_exit == [J._end_helper]
    seen = []
    monkeypatch.setattr(J, "on_compile", lambda d, a: seen.append((d, a)))
    listener = registered[0][1]
    listener.on_start(pytypes.SimpleNamespace(data={"dispatcher": "D", "args": ["x", "y"]}))
    listener.on_end(None)
    assert seen == [("D", ("x", "y"))]

    def broken(d, a):
        raise RuntimeError("no")

    monkeypatch.setattr(J, "on_compile", broken)
    listener.on_start(pytypes.SimpleNamespace(data={"dispatcher": "D", "args": []}))  # a compile goes on


def test_moesim_watches_its_compiles_as_its_compiled_code_is_imported():
    code = ("import moesim.jit, moesim.jitplan as J; from numba.core import event; "
            "print(J._STATE.get('listening'), sum(type(l).__module__ == 'moesim.jitplan' "
            "for l in event._registered['numba:compile']))")
    env = {k: v for k, v in os.environ.items() if k != J.HELPER_ENV}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "1"], out.stderr


def _fake_module(monkeypatch, order: list[str], fail: str = ""):
    mod = pytypes.ModuleType("moesim_fake_plan")

    class Compiled:
        def __init__(self, name):
            self.name = name

        def compile(self, args):
            order.append((self.name, args))
            if self.name == fail:
                raise RuntimeError("does not compile")

    mod.a, mod.b, mod.c = Compiled("a"), Compiled("b"), Compiled("c")
    mod.K = pytypes.SimpleNamespace(d=Compiled("d"))
    monkeypatch.setitem(sys.modules, "moesim_fake_plan", mod)


def test_the_helper_compiles_the_plan_from_its_end_while_its_parent_lives(monkeypatch):
    """From the end: each planned function for its planned arguments, names the code no
    longer has skipped, a compile that fails passed over (the process that needs it reports
    it); it stops as soon as the process that started it is gone."""
    order: list = []
    _fake_module(monkeypatch, order, fail="b")
    plan = [("moesim_fake_plan", "a", (1,)), ("moesim_fake_plan", "K.d", (2,)), ("moesim_fake_plan", "gone", (3,)),
            ("moesim_fake_plan", "b", (4,)), ("moesim_fake_plan", "c", (5, 6))]
    monkeypatch.setattr(J.os, "getppid", lambda: 77)
    assert J.compile_from_end(plan, 77) == 3
    assert order == [("c", (5, 6)), ("b", (4,)), ("d", (2,)), ("a", (1,))]
    order.clear()
    parents = iter([77, 77, 1, 1, 1])
    monkeypatch.setattr(J.os, "getppid", lambda: next(parents))
    assert J.compile_from_end(plan, 77) == 1
    assert order == [("c", (5, 6)), ("b", (4,))]


def test_one_helper_at_a_time_per_moesim_and_numba_cache(monkeypatch, tmp_path):
    """A helper that finds another holding the lock (a study's planning process and its
    workers' server both start one) leaves at once; the lock is one per numba cache folder."""
    ran: list[object] = []
    plan = [("m", "f", ())]
    monkeypatch.setattr(J, "compile_from_end", lambda plan, parent: ran.append((plan, parent)) or 0)
    monkeypatch.setattr(J, "load_plan", lambda: plan)
    monkeypatch.setattr(J, "_die_with_parent", lambda: ran.append("dies with its parent"))  # not this test process
    lock = tmp_path / "helper.lock"
    monkeypatch.setattr(J, "_lock_path", lambda: lock)
    monkeypatch.delenv(J.HELPER_ENV, raising=False)
    assert J.main(["11"]) == 0  # no lock file yet: made
    assert ran == ["dies with its parent", (plan, 11)]
    with open(lock, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert J.main(["12"]) == 0
        assert ran == ["dies with its parent", (plan, 11)]
    assert J.main(["12"]) == 0
    assert ran == ["dies with its parent", (plan, 11), "dies with its parent", (plan, 12)]
    assert os.environ[J.HELPER_ENV] == "1"


def test_the_lock_is_named_by_this_moesim_and_the_numba_cache_folder(monkeypatch):
    monkeypatch.setenv("NUMBA_CACHE_DIR", "/tmp/one")
    one = J._lock_path()
    assert J._lock_path() == one
    monkeypatch.setenv("NUMBA_CACHE_DIR", "/tmp/two")
    assert J._lock_path() != one
    monkeypatch.delenv("NUMBA_CACHE_DIR")
    assert J._lock_path() not in (one,)
    assert one.parent == Path(__import__("tempfile").gettempdir())
    assert one.name.startswith("moesim-jit-helper-")
    assert one.suffix == ".lock"


def _running(pid: int) -> bool:
    """The process is there and not a zombie (an orphan's zombie may wait for a reaper)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")
def test_a_helper_dies_the_moment_its_parent_does() -> None:
    """What ``_die_with_parent`` asks of the kernel: a process that called it (here one that
    would otherwise sleep a minute) is killed as its parent ends, whatever it is doing; one that
    did not call it lives on."""
    for asks in (True, False):
        child = (f"import time, moesim.jitplan as J; print(J._die_with_parent() if {asks} else 'no', flush=True); "
                 "time.sleep(60)")
        parent = (f"import subprocess, sys; c = subprocess.Popen([sys.executable, '-c', {child!r}], "
                  "stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True); "
                  "print(c.pid, c.stdout.readline().strip(), flush=True)")
        out = subprocess.run([sys.executable, "-c", parent], env=_env(Path("/nonexistent"), helper=False),
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        pid, said = out.stdout.split()
        assert said == ("True" if asks else "no")
        deadline = time.monotonic() + 5
        while _running(int(pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _running(int(pid)) is not asks
        if not asks:
            os.kill(int(pid), signal.SIGKILL)


def test_dying_with_the_parent_is_asked_of_the_kernel_with_prctl(monkeypatch):
    """``_die_with_parent`` calls ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` (1 and 9) from the C
    library the process has loaded, and says whether it took; without prctl (no such function,
    no C library to load) it says no."""
    import ctypes

    calls: list[tuple[object, ...]] = []

    class Lib:
        def __init__(self, result: int) -> None:
            self.result = result

        def prctl(self, *args: object) -> int:
            calls.append(args)
            return self.result

    opened: list[tuple[object, object]] = []
    for result, took in ((0, True), (-1, False)):
        monkeypatch.setattr(ctypes, "CDLL", lambda name, use_errno=False, r=result: opened.append((name, use_errno))
                            or Lib(r))
        calls.clear()
        opened.clear()
        assert J._die_with_parent() is took
        assert opened == [(None, True)]
        assert calls == [(1, 9, 0, 0, 0)]
        assert all(type(a) is int for a in calls[0])

    def no_library(name, use_errno=False):
        raise OSError("no C library")

    monkeypatch.setattr(ctypes, "CDLL", no_library)
    assert J._die_with_parent() is False
    monkeypatch.setattr(ctypes, "CDLL", lambda name, use_errno=False: object())  # no prctl in it
    assert J._die_with_parent() is False

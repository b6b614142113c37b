"""Before the first test, the replay kernel's eight forms (layer or per-expert execution, each
with fetch on a miss or a per-token miss policy, for the common eviction forms and for the rare
ones: the kernel is compiled per group of eviction forms, :mod:`moesim.policies.eviction.forms`)
are compiled into numba's cache by two child processes side by side, four each, so that the
test processes load them from the cache instead of compiling them. A process keeps the memory
numba's compiler took (about 1.1 GB after compiling the four common forms, against 0.35 GB
after loading them), and the machine's two cores compile at once. Where the cache already holds
them, each child loads them in about a second. Under pytest-xdist (``-n 2``, as the README's
command runs the suite) the controller warms up before it starts the workers, and the workers
do not. ``MOESIM_TEST_NO_WARM=1`` skips this (the tests then compile what they reach)."""

from __future__ import annotations

import ctypes
import fcntl
import os
import re
import select
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

RARE = "policies.eviction=sieve"  # one of the rare group's forms
PER_EXPERT, DROP = "expert_compute=per-expert", "policies.miss=drop"
FORMS = (([], [PER_EXPERT, DROP], [RARE], [PER_EXPERT, DROP, RARE]),  # a child's forms: its --set values
         ([PER_EXPERT], [DROP], [PER_EXPERT, RARE], [DROP, RARE]))
SMALL = ["workload.trace.synth.requests=1", "workload.trace.synth.prompt_tokens=4", "workload.trace.synth.tokens=4"]


def _replays(forms: tuple[list[str], ...]) -> str:
    """A child's program: a tiny quickstart replay on each of ``forms`` (its ``--set`` values)."""
    return ("from moesim.config.scenario import load_scenario\n"
            "from moesim.simulator.engine import Simulation\n"
            f"for sets in {[SMALL + f for f in forms]!r}:\n"
            "    Simulation(load_scenario('quickstart', sets)).run()\n")


def pytest_sessionstart(session: pytest.Session) -> None:
    if os.environ.get("MOESIM_TEST_NO_WARM", "") not in ("", "0"):
        return
    if hasattr(session.config, "workerinput"):  # a pytest-xdist worker: the controller warmed up before starting it
        return
    from moesim.simulator.kernel import kernel_off

    if kernel_off() is not None:
        return
    env = {**os.environ, "MOESIM_NO_JIT_HELPER": "1"}  # the two children are the helpers
    children = [subprocess.Popen([sys.executable, "-c", _replays(forms)], env=env) for forms in FORMS]
    failed = [c.args for c in children if c.wait() != 0]
    assert not failed, f"the kernel's warm-up failed: {failed}"


FIRST = ("test_notebooks.py", "test_hf_loop_executor.py")  # the tests that start the largest process trees


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The test files in the order pytest-xdist hands them to its workers (``--dist loadfile
    --no-loadscope-reorder``): first those in :data:`FIRST` (notebook kernels with their
    sweeps' fork servers, a torch model), while the workers are lean, since a worker keeps the
    memory every file before it took; then the rest with the most tests first (pytest-xdist's
    own order), a file's tests in their order."""
    count: dict[str, int] = {}
    for item in items:
        count[item.path.name] = count.get(item.path.name, 0) + 1
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: (rank.get(item.path.name, len(FIRST)), -count[item.path.name]))


# a command line that starts a study's process tree (a fork server and its points, a notebook's
# kernel with its own) or a process as large (``calibrate validate``, 1.5 GB)
_TREE = re.compile(r"moesim\s+(sweep|compare|calibrate\s+validate)\b|\b(sweep|compare)\(|ipykernel")


class _OneTree:
    """An exclusive lock on a file shared by pytest-xdist's workers (their temporary folders'
    parent), held while this process has a large process tree alive: a Ray cluster (its
    test), the local executor's fork server (until the file's tests end, or the test's when
    the other worker waits for the lock) or a child whose command line matches :data:`_TREE`
    (until it exits). So the two workers never run two such trees at once beside each other.
    A waiting worker says so in a second file (``wanted``)."""

    def __init__(self) -> None:
        self.path: Path | None = None
        self.file: Any = None
        self.holders: set[object] = set()
        self.guard = threading.Lock()

    @property
    def wanted(self) -> Path:
        assert self.path is not None
        return self.path.with_suffix(".wanted")

    def take(self, holder: object) -> None:
        with self.guard:
            self.holders.add(holder)
            if self.file is not None or self.path is None:
                return
            self.file = self.path.open("w")
            try:
                fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self.wanted.touch()
                fcntl.flock(self.file, fcntl.LOCK_EX)
                self.wanted.unlink(missing_ok=True)

    def drop(self, holder: object) -> None:
        with self.guard:
            self.holders.discard(holder)
            if not self.holders and self.file is not None:
                self.file.close()  # closing the file lets the lock go
                self.file = None

    def until_exit(self, pid: int) -> None:
        """Hold the lock until the child ``pid`` exits (read from its pidfd on a thread)."""
        fd = os.pidfd_open(pid)

        def wait() -> None:
            select.select([fd], [], [])
            os.close(fd)
            self.drop(pid)

        threading.Thread(target=wait, daemon=True).start()


_one_tree = _OneTree()
SERVER = "fork server"  # _OneTree's holder for this process's fork server


def _stop_server() -> None:
    sweep = sys.modules.get("moesim.studies.sweep")
    if sweep is not None:
        sweep.stop_workers()
    _one_tree.drop(SERVER)


@pytest.fixture(autouse=True)
def _one_tree_at_a_time(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """:class:`_OneTree` for every test: taken where a fork server starts (``multiprocessing``'s
    own ``ensure_running``, whichever caller) or a child matching :data:`_TREE` does. When
    the test ends, its fork server is stopped if the test stopped using it or the other worker
    waits."""
    from multiprocessing import forkserver

    _one_tree.path = tmp_path_factory.getbasetemp().parent / "tree.lock"
    server_method, server_alias = forkserver.ForkServer.ensure_running, forkserver.ensure_running

    def method(self: Any) -> None:
        _one_tree.take(SERVER)
        server_method(self)

    def alias() -> None:
        _one_tree.take(SERVER)
        server_alias()

    popen_init = subprocess.Popen.__init__

    def init(self: subprocess.Popen, args: Any, *rest: Any, **kw: Any) -> None:
        line = args if isinstance(args, str | bytes) else " ".join(map(str, args))
        tree = _TREE.search(str(line)) is not None
        if tree:
            _one_tree.take(self)
        try:
            popen_init(self, args, *rest, **kw)
        except BaseException:
            _one_tree.drop(self)
            raise
        if tree:
            _one_tree.until_exit(self.pid)
            _one_tree.drop(self)  # the pid holds it now

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(forkserver.ForkServer, "ensure_running", method)
        mp.setattr(forkserver, "ensure_running", alias)
        mp.setattr(subprocess.Popen, "__init__", init)
        yield
    if forkserver._forkserver._forkserver_pid is None or _one_tree.wanted.exists():
        _stop_server()


@pytest.fixture(autouse=True, scope="module")
def _no_idle_fork_server() -> Iterator[None]:
    """After each test file, the local executor's fork server (0.45 GB with the modules it
    preloads) is stopped instead of idling in its worker for the rest of the run, and the
    lock let go; the next study starts a new one. The worker then gives the memory its
    allocators hold free back (glibc's ``malloc_trim``, Arrow's pool): the file's tests took
    it and the next file's would not reuse all of it."""
    yield
    _stop_server()
    import pyarrow

    pyarrow.default_memory_pool().release_unused()
    ctypes.CDLL(None).malloc_trim(0)


@pytest.fixture
def one_cluster_at_a_time() -> Iterator[None]:
    """A test that starts a Ray cluster holds :class:`_OneTree`'s lock from its start to its
    end: a cluster (2.3 GB summed over its processes) beside another tree made the suite's
    peak."""
    _one_tree.take(one_cluster_at_a_time)
    yield
    _one_tree.drop(one_cluster_at_a_time)

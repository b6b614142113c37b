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
import os
import subprocess
import sys
from collections.abc import Iterator

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


@pytest.fixture
def one_cluster_at_a_time(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A test that starts a Ray cluster holds this lock while it runs, shared by pytest-xdist's
    workers (their temporary folders' parent): two clusters at once, beside two fork servers,
    made the suite's peak memory (6.3 GB summed over its processes, 2.3 GB of it Ray's)."""
    import fcntl

    with (tmp_path_factory.getbasetemp().parent / "ray.lock").open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


@pytest.fixture(autouse=True, scope="module")
def _after_each_file() -> Iterator[None]:
    """After each test file, the local executor's fork server (0.45 GB with the modules it
    preloads) is stopped instead of idling in its worker for the rest of the run; the next
    study starts a new one. The worker then gives the memory its allocators hold free back
    (glibc's ``malloc_trim``, Arrow's pool): the file's tests took it, and the next file's
    would not reuse all of it."""
    yield
    sweep = sys.modules.get("moesim.studies.sweep")
    if sweep is not None:
        sweep.stop_workers()
    import pyarrow

    pyarrow.default_memory_pool().release_unused()
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc's; absent elsewhere
    if trim is not None:
        trim(0)

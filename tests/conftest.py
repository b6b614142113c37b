"""Before the first test, the replay kernel's eight forms (layer or per-expert execution, each
with fetch on a miss or a per-token miss policy, for the common eviction forms and for the rare
ones: the kernel is compiled per group of eviction forms, :mod:`moesim.policies.eviction.forms`)
are compiled into numba's cache by two child processes side by side, so that the test
processes load them from the cache instead of compiling them. Per-expert execution with a
per-token miss policy compiles longest (about 63 s for the common group and 75 s for the rare
one on the 2-core machine, against 6-25 s for each other form after them), so each child
has one of the two, and the forms after it that reuse most of what it compiled. A process
keeps the memory numba's compiler took (about 1.1 GB after compiling the four common forms,
against 0.35 GB after loading them), and the machine's two cores compile at once. Where the cache already holds
them, each child loads them in about a second. Under pytest-xdist (``-n 2``, as the README's
command runs the suite) the controller warms up before it starts the workers, and the workers
do not. ``MOESIM_TEST_NO_WARM=1`` skips this (the tests then compile what they reach)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

RARE = "policies.eviction=sieve"  # one of the rare group's forms
PER_EXPERT, DROP = "expert_compute=per-expert", "policies.miss=drop"
FORMS = (([], [PER_EXPERT, DROP], [PER_EXPERT], [DROP], [DROP, RARE], [PER_EXPERT, RARE]),  # a child's: its --set values
         ([RARE], [PER_EXPERT, DROP, RARE]))
SMALL = ["workload.trace.synth.requests=1", "workload.trace.synth.prompt_tokens=4", "workload.trace.synth.tokens=4"]


def _replays(forms: tuple[list[str], ...]) -> str:
    """A child's program: a tiny quickstart replay on each of ``forms`` (its ``--set`` values),
    none where no replay runs on the kernel (:func:`moesim.simulator.kernel.kernel_off`)."""
    return ("from moesim.simulator.kernel import kernel_off\n"
            "from moesim.config.scenario import load_scenario\n"
            "from moesim.simulator.engine import Simulation\n"
            f"for sets in {[SMALL + f for f in forms]!r} if kernel_off() is None else []:\n"
            "    Simulation(load_scenario('quickstart', sets)).run()\n")


def pytest_sessionstart(session: pytest.Session) -> None:
    if os.environ.get("MOESIM_TEST_NO_WARM", "") not in ("", "0"):
        return
    if hasattr(session.config, "workerinput"):  # a pytest-xdist worker: the controller warmed up before starting it
        return
    # the controller imports no moesim (0.15 GB with numba) for the whole run: the children do
    env = {**os.environ, "MOESIM_NO_JIT_HELPER": "1"}  # the two children are the helpers
    children = [subprocess.Popen([sys.executable, "-c", _replays(forms)], env=env) for forms in FORMS]
    failed = [c.args for c in children if c.wait() != 0]
    assert not failed, f"the kernel's warm-up failed: {failed}"


# The files whose tests start process trees of 0.45 GB or more (resident memory summed over a test's
# child processes, sampled per file): a study's fork server with its points, a Ray cluster, notebook
# kernels, the docs' commands, a torch model's capture or calibration, a cold compile of the kernel.
# In the order they run: the largest trees first (1.1-1.9 GB; the peak-memory timer's test holds
# 0.7 GB in the worker), while the other worker is lean (a worker keeps the memory its earlier files took).
TREES = ("test_notebooks.py", "test_sweep.py", "test_compare.py", "test_first_steps.py", "test_plugins.py",
         "test_serving_studies.py", "test_benchmark_processes.py", "test_docs.py", "test_calibrate.py",
         "test_capture.py", "test_host.py", "test_reuse.py", "test_serving.py", "test_ep_offload.py",
         "test_workers_server.py", "test_package.py", "test_sweep_reuse_hand.py")
FIRST = ("test_hf_loop_executor.py",)  # the other worker's first: a torch model in the worker, while it is lean


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The order of the work units pytest-xdist hands its workers (:func:`pytest_xdist_make_scheduler`):
    the files in :data:`TREES` first, in its order; then the files in :data:`FIRST`; then the
    rest with the most tests first (pytest-xdist's own order); a file's tests in their order."""
    count: dict[str, int] = {}
    for item in items:
        count[item.path.name] = count.get(item.path.name, 0) + 1
    rank = {name: i for i, name in enumerate(TREES + FIRST)}
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), -count[item.path.name]))


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent without it
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist's ``--dist loadfile`` (each file's tests in one worker, its module fixtures
    once), except that the files in :data:`TREES` are one unit, so that one worker runs them
    one after another while the other runs the rest: two of them side by side (a Ray cluster
    beside the docs' sweeps) put the suite over 4 GB. (pytest-xdist's own ``--dist loadgroup``
    would do it with marks, but it renames the tests to group them, which pytest 9.2 ignores.)"""
    from xdist.scheduler import LoadScopeScheduling

    class TreesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "trees" if path.rsplit("/", 1)[-1] in TREES else path

    return TreesTogether(config, log)


def _stop_fork_server() -> None:
    """Stop the local executor's fork server in this worker, if its studies started one
    (:func:`moesim.studies.sweep.stop_workers`); the next study starts a new one."""
    sweep = sys.modules.get("moesim.studies.sweep")
    if sweep is not None:
        sweep.stop_workers()


@pytest.fixture
def no_fork_server_beside_the_children() -> None:
    """A test whose child processes start their own fork server (a ``moesim sweep`` or
    ``compare`` subprocess) or a Ray cluster stops its worker's fork server (0.4 GB with the
    modules and kernel forms it preloads, kept for the file's in-process studies) first, so
    that the two do not sit side by side; the file's next in-process study starts a new one.
    Two clusters never run at once: both such files are in :data:`TREES`, run by one worker."""
    _stop_fork_server()


@pytest.fixture(autouse=True, scope="module")
def _after_each_file() -> Iterator[None]:
    """After each test file, the local executor's fork server (0.45 GB with the modules it
    preloads) is stopped instead of idling in its worker for the rest of the run. The worker
    then gives the memory its allocators hold free back (glibc's ``malloc_trim``, Arrow's
    pool): the file's tests took it, and the next file's would not reuse all of it."""
    yield
    _stop_fork_server()
    import pyarrow

    pyarrow.default_memory_pool().release_unused()
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc's; absent elsewhere
    if trim is not None:
        trim(0)

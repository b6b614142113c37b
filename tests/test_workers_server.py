"""The local executor's fork server, the process a study's points are forked from: started before
the points are planned (so the kernel loads, or compiles, meanwhile: issue 34's first ``moesim
compare``), and stopped when the study hands it no point, so that no compile outlives a bad
input."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moesim.studies.sweep import sweep

ROOT = Path(__file__).resolve().parents[1]
BASE = ("workload.trace.synth.tokens=40", "workload.trace.synth.requests=2", "sweep=null")  # only the tests' axes


@pytest.fixture(autouse=True)
def _no_server_left():
    """Each test leaves no server of its own running (a test runner that waits for its own
    children, as mutmut's does, would otherwise reap one and fail)."""
    yield
    from moesim.studies.sweep import stop_workers

    stop_workers()


class _Planned(Exception):
    """Raised in place of planning a study's points (the test stops there)."""


@pytest.mark.parametrize("study", ["sweep", "compare"])
def test_the_workers_server_starts_before_the_points_are_planned(study: str, monkeypatch, tmp_path) -> None:
    """A study starts the local executor's fork server first, so that it loads (or compiles)
    the kernel while the points are planned (issue 34: the first ``moesim compare``)."""
    import moesim.studies.compare as compare_mod
    import moesim.studies.sweep as sweep_mod

    mod, planner = (sweep_mod, "plan") if study == "sweep" else (compare_mod, "base_data")
    calls: list[object] = []
    monkeypatch.setattr(sweep_mod, "start_workers", lambda executor: calls.append(("start", executor)))

    def plan(*args, **kwargs):
        calls.append("plan")
        raise _Planned

    monkeypatch.setattr(mod, planner, plan)
    for executor in ("local", "ray"):
        calls.clear()
        with pytest.raises(_Planned):
            getattr(mod, study)("quickstart", str(tmp_path / study), executor=executor)
        assert calls == [("start", executor), "plan"]


def test_the_fork_server_starts_once_and_only_for_the_local_executor() -> None:
    """``start_workers`` starts the fork server with the heavy modules and the kernel to preload,
    leaves a running one as it is, and starts none for Ray."""
    from multiprocessing import forkserver

    from moesim.studies.sweep import start_workers

    server = forkserver._forkserver
    before = server._forkserver_pid
    start_workers("ray")
    assert server._forkserver_pid == before
    start_workers("local")
    pid = server._forkserver_pid
    assert pid is not None
    os.kill(pid, 0)  # running
    assert "moesim.studies._kernel_loaded" in server._preload_modules
    start_workers("local")
    assert server._forkserver_pid == pid


def _server_pid() -> int | None:
    from multiprocessing import forkserver

    return forkserver._forkserver._forkserver_pid


def _gone(pid: int) -> bool:
    """The process ``pid`` has ended and been reaped (it was this process's child)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


@pytest.mark.parametrize("study", ["sweep", "compare"])
def test_a_study_whose_planning_fails_stops_the_server_it_started(study: str, monkeypatch, tmp_path) -> None:
    """A bad input found while the points are planned leaves no fork server behind to go on
    loading (on a fresh install: compiling) the kernel; a server that was running before the
    study is left as it was."""
    import moesim.studies.compare as compare_mod
    import moesim.studies.sweep as sweep_mod

    mod, planner = (sweep_mod, "plan") if study == "sweep" else (compare_mod, "base_data")
    sweep_mod.stop_workers()
    seen: list[int | None] = []

    def plan(*args, **kwargs):
        seen.append(_server_pid())
        raise _Planned

    monkeypatch.setattr(mod, planner, plan)
    with pytest.raises(_Planned):
        getattr(mod, study)("quickstart", str(tmp_path / study))
    started = seen[0]
    assert started is not None  # it was started before the planning
    assert _server_pid() is None
    assert _gone(started)
    assert sweep_mod.start_workers("local")  # one running before the study ...
    before = _server_pid()
    with pytest.raises(_Planned):
        getattr(mod, study)("quickstart", str(tmp_path / study))
    assert _server_pid() == before  # ... is left running
    with pytest.raises(_Planned):  # a study on Ray has none of its own to stop
        getattr(mod, study)("quickstart", str(tmp_path / study), executor="ray")
    assert _server_pid() == before
    assert before is not None
    assert not _gone(before)
    assert not sweep_mod.start_workers("local")


def test_a_study_with_every_point_done_stops_the_server_it_started_and_one_that_ran_points_keeps_it(tmp_path):
    """A rerun whose points are all reused hands nothing to the server it started, so stops it;
    a study that ran points leaves its server running for the next study in the process."""
    from moesim.studies.sweep import stop_workers

    out = tmp_path / "s"
    stop_workers()
    sweep("quickstart", str(out), {"cache.capacity": ["5%"]}, BASE)
    pid = _server_pid()
    assert pid is not None
    assert not _gone(pid)  # it ran the point and stays
    stop_workers()
    assert _gone(pid)
    df = sweep("quickstart", str(out), {"cache.capacity": ["5%"]}, BASE)
    assert df.attrs["reused"] == 1
    assert _server_pid() is None


@pytest.mark.usefixtures("no_fork_server_beside_the_children")
def test_a_bad_compare_leaves_no_process_behind(tmp_path) -> None:
    """``moesim compare`` with an unknown policy, on a fresh install (numba's cache empty, so
    the fork server it starts first is compiling the kernel, with the jit helper beside it),
    exits with its one-paragraph error, and no process it started outlives it by more than a
    moment (the helper dies with the server: ``jitplan._die_with_parent``)."""
    marker = f"{os.getpid()}-{time.monotonic_ns()}"
    env = {**os.environ, "MOESIM_TEST_MARKER": marker, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("MOESIM_NO_JIT_HELPER", None)
    err = tmp_path / "stderr"
    with err.open("w") as f:  # a file, not a pipe: a process left behind would hold a pipe open, and run() wait
        r = subprocess.run([sys.executable, "-m", "moesim", "compare", "quickstart", "--eviction",
                            "lru,no-such-policy", "--out", str(tmp_path / "c")], cwd=ROOT, stdout=subprocess.DEVNULL,
                           stderr=f, timeout=300, env=env)
    assert r.returncode == 2, err.read_text()
    assert "no-such-policy" in err.read_text()
    assert "Traceback" not in err.read_text()
    assert any((tmp_path / "cache").rglob("*.nbi")), "the server had not begun compiling: the test shows nothing"
    deadline = time.monotonic() + 1
    while (left := _marked(f"MOESIM_TEST_MARKER={marker}".encode())) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left == []


def _marked(entry: bytes) -> list[bytes]:
    """The command lines of the live processes whose environment holds ``entry`` (a zombie's
    environment reads empty)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and entry in (proc / "environ").read_bytes().split(b"\0"):
                found.append((proc / "cmdline").read_bytes().replace(b"\0", b" ")[:200])
        except OSError:
            continue
    return found

"""moesim as a package: the built wheel installs one top-level package and runs the quickstart
from any folder; the public API; paths given on the command line resolve against the working
directory; a shipped scenario that needs unshipped data says so and names the key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.helpers import unwrap

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh virtual environment with the built wheel installed (no dependencies from the
    network: the test environment's site-packages is added behind the fresh one by a .pth)."""
    tmp = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", str(tmp / "dist"), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (wheel,) = (tmp / "dist").glob("moesim-*.whl")
    env = tmp / "env"
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True, timeout=300)
    py = env / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    before = {p.name for p in site.iterdir()}
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    added = {p.name for p in site.iterdir()} - before
    assert added == {"moesim", wheel.name.split("-py3")[0] + ".dist-info"}, added
    (site / "zz_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return env


def test_the_wheel_runs_the_quickstart_from_another_folder(installed, tmp_path):
    bin_ = installed / "bin"
    where = subprocess.run([str(bin_ / "python"), "-c", "import moesim; print(moesim.__file__)"], cwd=tmp_path,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert str(installed) in where  # the installed copy, not the checkout
    # the installed copy compiles the kernel (numba's cache is per source path), without the jit helper
    # (moesim.jitplan: its own tests), which would compile on the core the other test worker is using
    r = subprocess.run([str(bin_ / "moesim"), "run", "quickstart", "--no-write", "--json", "--set",
                        "workload.trace.synth.tokens=10"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "MOESIM_NO_JIT_HELPER": "1"})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["forward_passes"] == 4 * 11


def test_the_wheel_ships_the_first_compile_plan(installed, tmp_path):
    """The installed moesim reads its own plan (``moesim/jitplan.json``, package data), the
    one in the checkout."""
    code = "import moesim.jitplan as J; print(J.PLAN); print(len(J.load_plan()))"
    out = subprocess.run([str(installed / "bin" / "python"), "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         check=True).stdout.split()
    assert str(installed) in out[0]
    assert Path(out[0]).read_text() == (ROOT / "moesim" / "jitplan.json").read_text()
    assert int(out[1]) == len(json.loads((ROOT / "moesim" / "jitplan.json").read_text())["compiles"]) > 0


def test_an_installed_scenario_needing_real_traces_names_the_key(installed, tmp_path):
    r = subprocess.run([str(installed / "bin" / "moesim"), "run", "specmd/mixtral-config1", "--no-write"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert "key 'workload.trace.import.path'" in unwrap(r.stderr)
    assert "reads data moesim does not ship" in unwrap(r.stderr)
    assert "--set workload.trace.import.path=FILE" in unwrap(r.stderr)
    assert "Traceback" not in r.stderr


def test_the_public_api_runs_a_scenario():
    import moesim

    sc = moesim.load_scenario("quickstart", ["workload.trace.synth.tokens=10", "cache.capacity=25%"])
    res = moesim.simulate(sc)
    assert res.summary["forward_passes"] == 4 * 11
    assert set(moesim.__all__) <= set(dir(moesim)) | set(moesim._LAZY)
    for name in moesim.__all__:
        assert getattr(moesim, name) is not None


def test_command_line_paths_resolve_against_the_working_directory(tmp_path):
    """--trace FILE and --set workload.trace={path: FILE} name a file relative to where the
    command runs, not to the shipped scenario's folder."""
    from moesim.traces.io import write_trace
    from moesim.traces.synth import synth_from_preset

    write_trace(synth_from_preset("olmoe-1b-7b", layers=2, tokens=6, seed=1), tmp_path / "t.parquet")
    for args in (["--trace", "t.parquet"], ["--set", "workload.trace={path: t.parquet}"]):
        r = subprocess.run([sys.executable, "-m", "moesim", "run", "quickstart", "--no-write", "--json", *args],
                           cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (args, r.stderr)
        assert json.loads(r.stdout)["forward_passes"] == 6

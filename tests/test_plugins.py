"""Policy plugins: the README's example, loaded from a file with --plugin, is listed by
`moesim policies`, usable in run, sweep and compare (in worker processes too), and makes the
decisions its definition says; bad plugins are refused cleanly."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from moesim.cli import cli
from tests.helpers import unwrap

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--set", "workload.trace.synth.tokens=20", "--set", "workload.trace.synth.requests=1"]


@pytest.fixture
def mru(tmp_path) -> Path:
    """The plugin example of the policies guide, written out as it stands there."""
    text = (ROOT / "docs" / "guides" / "policies.md").read_text()
    code = re.search(r"<!-- file: mru.py -->\n```python\n(.*?)```", text, re.S)
    assert code is not None, "the policies guide lost its plugin example"
    assert len(code.group(1).strip().splitlines()) <= 20
    path = tmp_path / "mru.py"
    path.write_text(code.group(1))
    return path


def moesim(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The command's result, its prose unwrapped (:func:`tests.helpers.unwrap`)."""
    r = subprocess.run([sys.executable, "-m", "moesim", *args], cwd=cwd, capture_output=True, text=True,
                       timeout=300)
    r.stderr, r.stdout = unwrap(r.stderr), unwrap(r.stdout)
    return r


@pytest.fixture
def isolated_registries():
    """Loading a plugin in this process registers its policies: undo that afterwards, so that
    tests iterating a registry do not meet them."""
    from moesim.policies import families, plugins

    saved = {fam: dict(reg._classes) for fam, reg in families().items()}
    loaded = list(plugins._loaded)
    yield
    for fam, reg in families().items():
        reg._classes.clear()
        reg._classes.update(saved[fam])
    plugins._loaded[:] = loaded


def test_the_readme_plugin_makes_mru_decisions(mru, tmp_path, isolated_registries):
    """Room for 2 experts, one layer, top-1 (one expert per layer), stream a b c a b, no
    prefetch. MRU: a, b miss; c misses and evicts b (the most recent); a hits; b misses:
    4 misses, 1 hit. LRU on the same stream: c evicts a, so a and b both miss again: 5."""
    from moesim.policies.plugins import load_plugins
    from moesim.simulator.engine import simulate
    from tests.helpers import scenario, small_model, trace_from_array

    load_plugins([str(mru)], installed=False)
    t = trace_from_array(small_model(layers=1, experts=4, top_k=1), np.array([[[[0]], [[1]], [[2]], [[0]], [[1]]]]))

    def run(policy):
        sc = scenario(timing=False, cache={"capacity": "2 experts"}, policies={"eviction": policy})
        return simulate(sc, trace=t).summary

    assert (run("mru")["misses"], run("mru")["hits"]) == (4, 1)
    assert run("mru")["replay_path"] == "kernel", run("mru")["replay_path_reason"]
    assert run("lru")["misses"] == 5


def test_the_readme_plugin_runs_compiled_and_gives_its_simpy_rows(mru, monkeypatch, isolated_registries):
    """The example is written against the eviction hooks: the kernel runs it, and its rows are
    those of the same class on the SimPy path (on an OLMoE-shaped trace with prefetching)."""
    from moesim.policies.plugins import load_plugins
    from moesim.simulator.engine import simulate
    from moesim.traces.synth import synth_from_preset
    from tests.helpers import scenario

    load_plugins([str(mru)], installed=False)
    t = synth_from_preset("olmoe-1b-7b", requests=4, prompt_tokens=8, tokens=16, seed=2, pred_next=True)
    sc = scenario(cache={"capacity": "5%"}, policies={"eviction": "mru", "prefetch": "next-gate-topk"})
    monkeypatch.delenv("MOESIM_NO_KERNEL", raising=False)
    fast = simulate(sc, trace=t)
    monkeypatch.setenv("MOESIM_NO_KERNEL", "1")
    ref = simulate(sc, trace=t)
    assert (fast.summary["replay_path"], ref.summary["replay_path"]) == ("kernel", "simpy")
    assert fast.summary["hits"] > 0
    pd.testing.assert_frame_equal(fast.steps, ref.steps, check_exact=True)


def test_plugin_policies_are_listed_and_run_from_the_command_line(mru, tmp_path):
    r = moesim("policies", "--plugin", str(mru), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert re.search(r"\bmru\b", r.stdout)
    r = moesim("run", "quickstart", "--plugin", "mru.py", "--set", "policies.eviction=mru", "--no-write", "--json",
               *SMALL, cwd=tmp_path)  # a relative path: against the working directory
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["misses"] > 0
    r = moesim("run", "quickstart", "--set", "policies.eviction=mru", "--no-write", *SMALL, cwd=tmp_path)
    assert r.returncode == 2
    assert "unknown eviction policy 'mru'" in unwrap(r.stderr)


@pytest.mark.usefixtures("no_fork_server_beside_the_children")
def test_plugin_policies_run_in_sweep_and_compare_workers(mru, tmp_path):
    r = moesim("sweep", "quickstart", "--plugin", str(mru), "--grid", "policies.eviction=lru,mru", "--set", "sweep=null",
               *SMALL, "--workers", "2", "--out", str(tmp_path / "s"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    df = pd.read_parquet(tmp_path / "s" / "results.parquet")
    assert sorted(df["policies.eviction"]) == ["lru", "mru"]
    assert (df["status"] == "ok").all()
    r = moesim("compare", "quickstart", "--plugin", str(mru), "--eviction", "lru,mru", "--prefetch", "none",
               *SMALL, "--workers", "2", "--out", str(tmp_path / "c"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "mru + no prefetch" in r.stdout


@pytest.mark.parametrize(("source", "says"), [
    (None, "no such file"),
    ("import numpy\nraise RuntimeError('boom')\n", "failed while importing: RuntimeError: boom"),
    ("from moesim.policies.eviction import REGISTRY\nfrom moesim.policies.eviction.lru import LRU\nREGISTRY.register('lru')(type('L2', (LRU,), {}))\n",
     "eviction policy 'lru' is registered twice"),
])
def test_a_bad_plugin_is_refused_in_one_paragraph(tmp_path, source, says, isolated_registries):
    path = tmp_path / "bad.py"
    if source is not None:
        path.write_text(source)
    r = CliRunner().invoke(cli, ["policies", "--plugin", str(path)])
    assert r.exit_code == 2
    assert says in unwrap(r.output)
    assert "Traceback" not in r.output


def test_an_unknown_plugin_module_is_named(isolated_registries):
    r = CliRunner().invoke(cli, ["policies", "--plugin", "no_such_moesim_plugin"])
    assert r.exit_code == 2
    assert "plugin no_such_moesim_plugin: no module named 'no_such_moesim_plugin'" in unwrap(r.output)

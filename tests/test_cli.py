"""The moesim command line, end to end, including user errors (exit 2, no traceback)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from tests.helpers import error_of, unwrap

ROOT = Path(__file__).resolve().parents[1]


def moesim(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The command's result, its prose unwrapped (:func:`tests.helpers.unwrap`; ``wrapped_*``: as printed)."""
    env = {**os.environ, "COLUMNS": "200"}
    r = subprocess.run([sys.executable, "-m", "moesim", *args], capture_output=True,
                       text=True, cwd=cwd or ROOT, env=env, timeout=300)
    r.wrapped_stderr, r.wrapped_stdout = r.stderr, r.stdout  # type: ignore[attr-defined]
    r.stderr, r.stdout = unwrap(r.stderr), unwrap(r.stdout)
    return r


def test_run_quickstart_writes_results(tmp_path):
    out = tmp_path / "q"
    r = moesim("run", "moesim/scenarios/quickstart.yaml", "--out", str(out), "--set", "workload.trace.synth.tokens=40")
    assert r.returncode == 0, r.stderr
    assert "hit_rate" in r.stdout
    assert "tpot_s" in r.stdout
    summary = json.loads((out / "summary.json").read_text())
    steps = pd.read_parquet(out / "steps.parquet")
    resolved = yaml.safe_load((out / "scenario.resolved.yaml").read_text())
    assert len(steps) == summary["forward_passes"] == 4 * 41  # 4 requests: prefill + 40 decode steps
    assert steps["misses"].sum() == summary["misses"]
    assert resolved["workload"]["trace"]["synth"]["tokens"] == 40
    assert resolved["policies"]["eviction"] == {"name": "lru"}
    assert resolved["hardware"]["links"]["pcie"]["bandwidth_gbps"] == 32.0
    # the resolved scenario replays to the same result
    r2 = moesim("run", str(out / "scenario.resolved.yaml"), "--out", str(tmp_path / "again"))
    assert r2.returncode == 0, r2.stderr
    assert json.loads((tmp_path / "again" / "summary.json").read_text()) == summary


def test_run_by_shipped_name_and_set_overrides(tmp_path):
    r = moesim("run", "quickstart", "--no-write", "--json", "--set", "cache.capacity=100%",
               "--set", "workload.trace.synth.tokens=20", "--set", "hardware.links.pcie.bandwidth_gbps=5")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["misses"] == s["expert_accesses"] - s["hits"]
    assert s["collision_misses"] == 0


def test_trace_synth_then_info(tmp_path):
    f = tmp_path / "t.parquet"
    r = moesim("trace", "synth", "--preset", "mixtral-8x7b", "--requests", "2", "--prompt-tokens", "3",
               "--tokens", "10", "--seed", "4", "--out", str(f))
    assert r.returncode == 0, r.stderr
    r = moesim("trace", "info", str(f))
    assert r.returncode == 0, r.stderr
    assert "mixtral-8x7b" in r.stdout
    assert "expert popularity per layer" in r.stdout
    r = moesim("trace", "info", str(f), "--json")
    info = json.loads(r.stdout)
    assert info["requests"] == 2
    assert info["tokens"] == 26
    assert info["steps"] == 22
    assert info["tokens_by_phase"] == {"prefill": 6, "decode": 20}
    assert len(info["layers"]) == 32
    # a scenario can name the file
    sc = tmp_path / "s.yaml"
    sc.write_text(yaml.safe_dump({"workload": {"trace": {"path": "t.parquet"}},
                                  "cache": {"capacity": "8 experts"}}))
    r = moesim("run", str(sc), "--no-write", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["forward_passes"] == 22


def test_synth_overrides_shape(tmp_path):
    f = tmp_path / "u.parquet"
    r = moesim("trace", "synth", "--preset", "olmoe-1b-7b", "--layers", "2", "--experts", "16",
               "--top-k", "4", "--routing", "uniform", "--tokens", "5", "--out", str(f))
    assert r.returncode == 0, r.stderr
    info = json.loads(moesim("trace", "info", str(f), "--json").stdout)
    assert (info["model"]["num_layers"], info["model"]["num_experts"], info["model"]["top_k"]) == (2, 16, 4)


def _scenario(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    return p


GOOD = """
workload:
  trace: {synth: {preset: olmoe-1b-7b, tokens: 10}}
cache:
  capacity: 5%
policies: {eviction: lru}
"""


@pytest.mark.parametrize(("text", "expect"), [
    (GOOD.replace("capacity: 5%", "capacity: 5%\n  capacty: 3"), r"key 'cache.capacty' is not a known key \(did you mean 'capacity'\?\); valid keys here: capacity, precision"),
    (GOOD.replace("eviction: lru", "eviction: lruu"), r"unknown eviction policy 'lruu' \(did you mean 'lru'\?\); valid eviction policies: lru"),
    (GOOD + "hardware: {preset: a100-80g-pcie4, links: {pcie: {bandwidth_gbps: -5}}}\n", r"key 'hardware.links.pcie' is invalid: bandwidth_gbps must be > 0 GB/s, got -5"),
    (GOOD + "hardware: {preset: a100}\n", r"key 'hardware.preset' is 'a100'.*valid presets: a100-80g-pcie4"),
    (GOOD.replace("capacity: 5%", "capacity: lots"), r"key 'cache.capacity' is 'lots'; write it as a percentage"),
    (GOOD.replace("tokens: 10}", "tokens: 10"), r"broken YAML at line"),
    (GOOD + "timing: maybe\n", r"key 'timing' must be true or false"),
    (GOOD.replace("olmoe-1b-7b", "olmo"), r"key 'workload.trace.synth' is invalid: preset 'olmo' .*valid presets: olmoe-1b-7b"),
    (GOOD + "expert_compute: eager\n", r"key 'expert_compute' is 'eager'.*valid choices: layer, on-arrival"),
    (GOOD.replace("policies: {eviction: lru}", "policies: {evict: lru}"), r"key 'policies.evict' is not a policy family .*valid families: eviction"),
])
def test_bad_scenarios_fail_with_one_paragraph_and_exit_2(tmp_path, text, expect):
    import re

    path = _scenario(tmp_path, text)
    out = tmp_path / "out"
    r = moesim("run", str(path), "--out", str(out))
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    assert re.search(expect, error_of(r.stderr)), r.stderr
    assert str(path) in r.stderr or "--set" in r.stderr
    assert not out.exists()


def test_bad_trace_file_fails_cleanly(tmp_path):
    bad = tmp_path / "broken.parquet"
    bad.write_bytes(b"not parquet")
    r = moesim("trace", "info", str(bad))
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert "broken.parquet" in r.stderr
    assert "not a readable Parquet file" in unwrap(r.stderr)
    sc = _scenario(tmp_path, "workload: {trace: {path: broken.parquet}}\n")
    out = tmp_path / "o"
    r = moesim("run", str(sc), "--out", str(out))
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert not out.exists()


def test_bad_set_override_is_named(tmp_path):
    r = moesim("run", "quickstart", "--no-write", "--set", "cache.capacity")
    assert r.returncode == 2
    assert "must look like dotted.key=value" in unwrap(r.stderr)
    r = moesim("run", "quickstart", "--no-write", "--set", "cache.size=3")
    assert r.returncode == 2
    assert "key 'cache.size' is not a known key" in unwrap(r.stderr)


def test_policies_and_presets_list():
    r = moesim("policies")
    assert r.returncode == 0
    for name in ("lru", "fetch", "none", "standard"):
        assert name in r.stdout
    r = moesim("presets")
    assert r.returncode == 0
    assert "gh200-c2c" in r.stdout
    assert "datasheet" in r.stdout


def test_help_lists_commands():
    r = moesim("--help")
    assert r.returncode == 0
    for cmd in ("run", "trace", "policies", "presets"):
        assert cmd in r.stdout


def test_out_of_range_expert_in_a_scenario_trace(tmp_path):
    import numpy as np

    from moesim.traces.io import write_trace
    from tests.helpers import small_model, trace_from_array

    t = trace_from_array(small_model(), np.zeros((1, 3, 2, 2), dtype=np.int64) + np.array([0, 1]))
    t.experts[3] = [2, 9]
    write_trace(t, tmp_path / "t.parquet")
    sc = _scenario(tmp_path, "workload: {trace: {path: t.parquet}}\n")
    out = tmp_path / "o"
    r = moesim("run", str(sc), "--out", str(out))
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert not out.exists()
    assert "t.parquet: column 'experts' has expert id(s) [2, 9] at row 3; ids must be 0..7" in unwrap(r.stderr)


@pytest.mark.parametrize("args", [["--top-k", "9", "--experts", "8"], ["--tokens", "-1"], ["--layers", "0"]])
def test_bad_synth_arguments_write_nothing(tmp_path, args):
    f = tmp_path / "x.parquet"
    r = moesim("trace", "synth", "--preset", "olmoe-1b-7b", *args, "--out", str(f))
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert r.stderr.startswith("error: ")
    assert not f.exists()


def test_import_formats_listed_by_the_cli_are_the_registered_ones():
    from moesim.cli import IMPORT_FORMATS
    from moesim.traces.importers import IMPORTERS

    assert sorted(IMPORT_FORMATS) == sorted(IMPORTERS)


def test_synth_with_predictor_columns(tmp_path):
    f = tmp_path / "p.parquet"
    r = moesim("trace", "synth", "--preset", "olmoe-1b-7b", "--layers", "3", "--tokens", "4", "--probs",
               "--pred-next", "--pred-noise", "0.5", "--out", str(f))
    assert r.returncode == 0, r.stderr
    info = json.loads(moesim("trace", "info", str(f), "--json").stdout)
    assert info["optional_columns"] == ["probs", "pred_next"]


def test_fit_then_synth_from_the_profile(tmp_path):
    src = tmp_path / "t.parquet"
    assert moesim("trace", "synth", "--preset", "mixtral-8x7b", "--layers", "4", "--tokens", "40",
                  "--requests", "2", "--out", str(src)).returncode == 0
    prof = tmp_path / "p.yaml"
    r = moesim("trace", "fit", str(src), "--out", str(prof))
    assert r.returncode == 0, r.stderr
    assert "LRU hit rate" in r.stdout
    out = tmp_path / "s.parquet"
    r = moesim("trace", "synth", "--fit", str(prof), "--tokens", "100", "--requests", "3", "--out", str(out))
    assert r.returncode == 0, r.stderr
    info = json.loads(moesim("trace", "info", str(out), "--json").stdout)
    assert info["requests"] == 3
    assert info["tokens"] == 300
    assert info["model"]["num_layers"] == 4
    r = moesim("trace", "synth", "--preset", "mixtral-8x7b", "--fit", str(prof), "--out", str(out))
    assert r.returncode == 2
    assert "exactly one of --preset and --fit" in unwrap(r.stderr)
    # the optional columns and the prefill, from the profile as from a preset (they were dropped)
    r = moesim("trace", "synth", "--fit", str(prof), "--tokens", "5", "--prompt-tokens", "7", "--pred-next",
               "--probs", "--out", str(out))
    assert r.returncode == 0, r.stderr
    from moesim.traces.io import read_trace

    t = read_trace(out)
    assert t.probs is not None
    assert t.pred_next is not None
    assert t.probs.shape == t.pred_next.shape == (len(t), 8)
    np.testing.assert_allclose(t.probs.sum(axis=1), 1.0, rtol=1e-5)
    assert sorted(set(t.phase.tolist())) == [0, 1]  # prefill and decode
    assert int((t.phase == 0).sum()) == 7 * 4  # 7 prompt tokens x 4 layers
    from moesim.config.scenario import load_scenario
    from moesim.simulator.build import load_trace

    sc = load_scenario("quickstart", [f"workload.trace={{synth: {{fit: {prof}, tokens: 3, pred_next: true, "
                                      "prompt_tokens: 2}}"])
    t = load_trace(sc)
    assert t.pred_next is not None
    assert int((t.phase == 0).sum()) == 2 * 4
    r = moesim("trace", "synth", "--fit", str(prof), "--layers", "2", "--out", str(out))
    assert r.returncode == 2
    assert "--layers: a fitted profile gives the shape" in unwrap(r.stderr)


def test_listings_fit_80_columns_without_cutting_names():
    import os

    from moesim.config.hardware import PRESETS as HW
    from moesim.policies import families
    from moesim.traces.synth import PRESETS as SY

    env = {**os.environ, "COLUMNS": "80"}
    pres = subprocess.run([sys.executable, "-m", "moesim", "presets"], capture_output=True, text=True, env=env)
    pol = subprocess.run([sys.executable, "-m", "moesim", "policies"], capture_output=True, text=True, env=env)
    for out in (pres.stdout, pol.stdout):
        assert max(len(line) for line in out.splitlines()) <= 80
    for name in [*HW, *SY]:
        assert re.search(rf"│{re.escape(name)}\s", pres.stdout), name
    for reg in families().values():
        for name in reg.names():
            assert re.search(rf"│{re.escape(name)}\s", pol.stdout), name
    assert "``" not in pol.stdout  # no raw reStructuredText


def test_policies_by_family_and_as_json():
    r = moesim("policies", "--family", "eviction", "--json")
    doc = json.loads(r.stdout)
    assert list(doc) == ["eviction"]
    ls = doc["eviction"]["least-stale"]
    assert [p["name"] for p in ls["parameters"]] == ["order"]
    assert ls["parameters"][0]["default"] == "relative"
    r = moesim("presets", "--json")
    doc = json.loads(r.stdout)
    assert doc["hardware"]["h100-sxm-pcie5"]["gpu"]["name"]
    assert doc["models"]["olmoe-1b-7b"]["model"]["num_experts"] == 64


def test_old_spellings_still_work_with_a_note(tmp_path):
    """--model-preset (trace import) and --batch (mrc) are accepted and say what replaces them."""
    from click.testing import CliRunner

    from moesim.cli import cli

    np.save(tmp_path / "r.npy", np.zeros((3, 16, 8), dtype=np.int64) + np.arange(8))
    r = CliRunner().invoke(cli, ["trace", "import", "--format", "routed-experts-npy", str(tmp_path / "r.npy"),
                                 "--model-preset", "olmoe-1b-7b", "--out", str(tmp_path / "t.parquet")])
    assert r.exit_code == 0, r.output
    assert "note: --model-preset is deprecated; use --preset." in unwrap(r.output)
    r = CliRunner().invoke(cli, ["mrc", str(tmp_path / "t.parquet"), "--batch", "1", "--capacities", "8,64",
                                 "--out", str(tmp_path / "m"), "--json"])
    assert r.exit_code == 0, r.output
    assert "note: --batch is deprecated; use --batch-size." in unwrap(r.output)

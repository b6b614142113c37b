"""Calibration: measure (CPU, quick), fit, profiles in scenarios, bad profiles."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from moesim.calibration.calibrate import fit, load_profile, read_host_costs, write_profile
from moesim.config.scenario import load_scenario
from moesim.errors import MoesimError
from moesim.simulator.cost import CostModel
from moesim.simulator.engine import simulate
from moesim.traces.synth import PRESETS
from tests.helpers import unwrap

ROOT = Path(__file__).resolve().parents[1]


def synthetic_raw(bw_gbps: float, lat_us: float, noise: float = 0.01, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    sizes = 2.0 ** np.arange(10, 31)
    t = lat_us * 1e-6 + sizes / (bw_gbps * 1e9)
    t = t * (1 + noise * rng.standard_normal(len(t)))
    rows = [{"kind": "copy", "direction": "h2d", "memory": "pinned", "bytes": int(n), "median_s": float(s),
             "device": "cuda", "device_name": "synthetic"} for n, s in zip(sizes, t, strict=True)]
    rows.append({"kind": "launch", "median_s": 4e-6, "device": "cuda", "device_name": "synthetic"})
    return pd.DataFrame(rows)


@pytest.mark.parametrize(("bw", "lat"), [(25.0, 10.0), (55.0, 4.0), (450.0, 2.0)])
def test_fit_recovers_bandwidth_and_latency(bw, lat):
    prof = fit(synthetic_raw(bw, lat))
    link = prof["links"]["h2d_pinned"]
    assert link["bandwidth_gbps"] == pytest.approx(bw, rel=0.02)
    assert link["latency_us"] == pytest.approx(lat, rel=0.05)
    assert link["rel_rms_residual"] < 0.03
    assert prof["launch_overhead_us"] == pytest.approx(4.0)


def test_cpu_pipeline_measure_fit_and_a_scenario_using_the_profile(tmp_path):
    pytest.importorskip("torch")
    raw = tmp_path / "raw.parquet"
    prof = tmp_path / "cpu.yaml"
    cmd = [sys.executable, "-m", "moesim", "calibrate"]
    r = subprocess.run([*cmd, "measure", "--device", "cpu", "--quick", "--out", str(raw)], capture_output=True,
                       text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    df = pd.read_parquet(raw)
    assert {"copy", "expert", "attention", "launch"} <= set(df["kind"])
    assert {"device", "driver", "cuda", "torch"} <= set(df.columns)
    assert (df["p10_s"] <= df["median_s"]).all()
    r = subprocess.run([*cmd, "fit", str(raw), "--out", str(prof)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "h2d_pageable" in r.stdout
    sc = load_scenario("quickstart", [f"hardware.profile={prof}", "workload.trace.synth.tokens=10"])
    assert sc.hardware.source.startswith("profile")
    measured = yaml.safe_load(prof.read_text())["links"]["h2d_pageable"]
    assert sc.hardware.h2d.bandwidth_gbps == measured["bandwidth_gbps"]
    assert simulate(sc).summary["hardware_source"].startswith("profile")


def test_profile_expert_table_drives_the_cost_model(tmp_path):
    m = PRESETS["olmoe-1b-7b"].model
    prof = fit(synthetic_raw(25, 10))
    prof["expert_time"] = {"olmoe-1b-7b": {"bfloat16": {
        "hidden": m.hidden_size, "intermediate": m.expert_intermediate_size,
        "tokens": [1, 4, 16, 64], "seconds": [1e-5, 2e-5, 4e-5, 8e-5]}}}
    path = write_profile(prof, tmp_path / "p.yaml")
    sc = load_scenario("quickstart", [f"hardware.profile={path}"])
    cost = CostModel(sc.hardware, m, m.expert_bytes["bf16"])
    got = cost.expert_time(np.array([1, 2, 4, 64, 256]))
    np.testing.assert_allclose(got, [1e-5, 1e-5 * 2 ** 0.5, 2e-5, 8e-5, 16e-5], rtol=1e-9)  # log-log
    # the scenario's precision costs the same when a routing, budget or miss policy asks
    # (expert_time_at); another precision stays on the roofline
    assert cost.expert_time_at(2, m.expert_bytes["bf16"]) == got[1]
    int4 = m.expert_bytes["int4"]
    assert cost.expert_time_at(2, int4) == pytest.approx(
        max(int4 / cost.hbm, cost.expert_flops_per_token * 2 / cost.peak) + sc.hardware.expert_overhead_us * 1e-6,
        rel=1e-12)


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda p: p.pop("links"), "key 'links' needs h2d_pinned or h2d_pageable"),
    (lambda p: p["links"]["h2d_pinned"].update(bandwidth_gbps=-3), r"key 'links.h2d_pinned' needs bandwidth_gbps > 0"),
    (lambda p: p.update(profile_version=9), "not a version-1 profile"),
    (lambda p: p.update(expert_time={"x": {"bfloat16": {"tokens": [4, 1], "seconds": [1e-5, 2e-5]}}}),
     r"key 'expert_time.x.bfloat16' needs increasing tokens"),
])
def test_bad_profiles_are_rejected_with_the_key(tmp_path, mutate, message):
    prof = fit(synthetic_raw(25, 10))
    mutate(prof)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(prof))
    with pytest.raises(MoesimError, match=message):
        load_profile(str(path), "<test>")
    with pytest.raises(MoesimError, match=message):
        load_scenario("quickstart", [f"hardware.profile={path}"])


def test_validate_pipeline_on_cpu_makes_the_simulators_decisions(tmp_path):
    pytest.importorskip("torch")
    from moesim.calibration.calibrate import measure
    from moesim.traces.io import write_trace
    from moesim.traces.synth import generate
    from tests.helpers import small_model

    t = generate(small_model(layers=3, experts=8, top_k=2, hidden=128, inter=256), requests=2, prompt_tokens=4,
                 tokens=8, seed=2)
    write_trace(t, tmp_path / "t.parquet")
    write_profile(fit(measure("cpu", ["128x256"], quick=True)), tmp_path / "p.yaml")
    for cap in ("10%", "50%", "100%"):
        for ev in ("lru", "least-stale", "fifo"):
            (tmp_path / f"s{cap[:-1]}{ev}.yaml").write_text(yaml.safe_dump(
                {"workload": {"trace": {"path": "t.parquet"}}, "cache": {"capacity": cap}, "policies": {"eviction": ev}}))
    for pf in ("oracle", "previous-token"):  # prefetch on: copies overlap compute on a copy worker
        (tmp_path / f"s25{pf}.yaml").write_text(yaml.safe_dump(
            {"workload": {"trace": {"path": "t.parquet"}}, "cache": {"capacity": "25%"},
             "policies": {"eviction": "least-stale", "prefetch": pf}}))
    r = subprocess.run([sys.executable, "-m", "moesim", "calibrate", "validate", "--profile", str(tmp_path / "p.yaml"),
                        "--trace", str(tmp_path / "t.parquet"), "--scenarios", str(tmp_path / "s*.yaml"), "--device", "cpu",
                        "--protocol", "none", "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=300,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr
    df = pd.read_parquet(tmp_path / "out" / "validation.parquet")
    assert len(df) == 11
    assert (df["hits_exec"] == df["hits_sim"]).all()
    assert (df["misses_exec"] == df["misses_sim"]).all()
    assert (df["tpot_measured_s"] > 0).all()
    assert (tmp_path / "out" / "predicted_vs_measured.png").stat().st_size > 1000
    assert "TPOT absolute percentage error: median" in (tmp_path / "out" / "report.md").read_text()


def test_executor_with_prefetch_makes_the_simulators_decisions():
    pytest.importorskip("torch")
    from moesim.calibration.validate import execute
    from moesim.simulator.engine import simulate
    from moesim.traces.synth import generate
    from tests.helpers import scenario, small_model

    t = generate(small_model(layers=3, experts=6, top_k=2, hidden=64, inter=128), requests=2, tokens=12, seed=3)
    sc = scenario(cache={"capacity": "8 experts"}, policies={"prefetch": "oracle", "eviction": "least-stale"})
    sim = simulate(sc, trace=t).summary
    ex = execute(sc, t)
    assert ex["misses"] == sim["misses"]
    assert ex["hits"] == sim["hits"] + sim["late_prefetches"]


def test_shipped_validation_set_covers_the_required_grid():
    from moesim.config.scenario import shipped_scenarios

    names = [n for n in shipped_scenarios() if n.startswith("validation/")]
    assert len(names) == 16
    combos = {(s.cache.capacity, s.policies.prefetch.name, s.policies.eviction.name)
              for s in (load_scenario(n) for n in names)}
    assert {c for c, _, _ in combos} == {"1%", "5%", "25%", "100%"}
    assert {p for _, p, _ in combos} == {"none", "previous-token"}
    assert {e for _, _, e in combos} == {"lru", "least-stale"}


def test_resolved_scenario_names_the_profile_not_its_tables(tmp_path):
    prof = fit(synthetic_raw(25, 10))
    prof["nonexpert_time"] = {"s": {"float32": {"hidden": 64, "tokens": [1, 4], "seconds": [1e-5, 2e-5]}}}
    path = write_profile(prof, tmp_path / "p.yaml")
    hw = load_scenario("quickstart", [f"hardware.profile={path}"]).to_dict()["hardware"]
    assert hw["profile"] == str(path)
    assert "expert_table" not in hw
    assert "nonexpert_table" not in hw


def test_broken_yaml_in_a_profile_or_a_placement_file_names_the_file_and_line(tmp_path):
    from moesim.policies.budget.xshare import placement_of

    bad = tmp_path / "broken.yaml"
    bad.write_text("links: {h2d_pinned: [1, 2\n")
    with pytest.raises(MoesimError, match=r"hardware profile .*broken.yaml: broken YAML at line 2"):
        load_profile(str(bad), "<test>")
    with pytest.raises(MoesimError, match=r"expert placement .*broken.yaml: broken YAML at line 2"):
        placement_of(str(bad), 2, 4, 2)
    with pytest.raises(MoesimError, match=r"expert placement .*nowhere.yaml: no such file. Use contiguous"):
        placement_of(str(tmp_path / "nowhere.yaml"), 2, 4, 2)


def test_a_profile_of_other_shapes_is_flagged_for_validation(tmp_path):
    """The trace's model (hidden 128, intermediate 256) against a profile measured on 256x512:
    the warning names both shapes and the measure command; a matching profile gives none."""
    from moesim.calibration.validate import shape_warnings
    from moesim.traces.synth import generate
    from tests.helpers import small_model

    t = generate(small_model(layers=2, experts=8, top_k=2, hidden=128, inter=256), requests=1, tokens=4, seed=1)
    base = {"profile_version": 1, "links": {"h2d_pageable": {"bandwidth_gbps": 10.0, "latency_us": 5.0,
                                                            "rel_rms_residual": 0.01, "points": 5}}}

    def profile(h, i):
        doc = {**base, "expert_time": {f"{h}x{i}": {"bf16": {"hidden": h, "intermediate": i, "tokens": [1, 2],
                                                              "seconds": [1e-5, 2e-5]}}}}
        path = tmp_path / f"p{h}.yaml"
        path.write_text(yaml.safe_dump(doc))
        return str(path)

    (w,) = shape_warnings(profile(256, 512), t)
    assert "(128x256; it has 256x512)" in w
    assert "moesim calibrate measure --model-shapes 128x256" in w
    assert shape_warnings(profile(128, 256), t) == []


def test_fit_flags_a_link_fit_with_large_residuals(tmp_path):
    """Copy times that an affine model cannot follow (a step at 16 MiB, among the copies the
    fit uses): the fit's relative RMS residual exceeds 10% and calibrate fit warns, naming the
    link."""
    from click.testing import CliRunner

    from moesim.cli import cli

    sizes = [2 ** e for e in range(10, 31, 2)]
    times = [1e-5 + n / 2e10 * (1 if n < 2**24 else 4) for n in sizes]
    raw = pd.DataFrame({"kind": "copy", "direction": "h2d", "memory": "pageable", "bytes": sizes, "median_s": times,
                        "device": "cpu"})
    raw.to_parquet(tmp_path / "raw.parquet")
    r = CliRunner().invoke(cli, ["calibrate", "fit", str(tmp_path / "raw.parquet"), "--out", str(tmp_path / "p.yaml")])
    assert r.exit_code == 0, r.output
    assert "warning: link h2d_pageable: the affine fit misses the measurements by" in unwrap(r.output)
    clean = raw.assign(median_s=[1e-5 + n / 2e10 for n in sizes])
    clean.to_parquet(tmp_path / "clean.parquet")
    r = CliRunner().invoke(cli, ["calibrate", "fit", str(tmp_path / "clean.parquet"), "--out", str(tmp_path / "q.yaml")])
    assert "warning" not in r.output


def test_validate_warns_on_the_command_line_and_in_the_report(tmp_path):
    """The shape warning reaches the user before the measurements and lands in report.md."""
    pytest.importorskip("torch")
    from moesim.traces.io import write_trace
    from moesim.traces.synth import generate
    from tests.helpers import small_model

    t = generate(small_model(layers=2, experts=8, top_k=2, hidden=128, inter=256), requests=1, tokens=4, seed=1)
    write_trace(t, tmp_path / "t.parquet")
    (tmp_path / "p.yaml").write_text(yaml.safe_dump({
        "profile_version": 1, "links": {"h2d_pageable": {"bandwidth_gbps": 10.0, "latency_us": 5.0,
                                                         "rel_rms_residual": 0.01, "points": 5}},
        "expert_time": {"256x512": {"bf16": {"hidden": 256, "intermediate": 512, "tokens": [1, 2],
                                             "seconds": [1e-5, 2e-5]}}}}))
    (tmp_path / "s.yaml").write_text(yaml.safe_dump({"workload": {"trace": {"path": "t.parquet"}},
                                                     "cache": {"capacity": "50%"}}))
    r = subprocess.run([sys.executable, "-m", "moesim", "calibrate", "validate", "--profile", str(tmp_path / "p.yaml"),
                        "--trace", str(tmp_path / "t.parquet"), "--scenarios", str(tmp_path / "s.yaml"),
                        "--device", "cpu", "--protocol", "none", "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "warning: profile" in unwrap(r.stderr)
    assert "(128x256; it has 256x512)" in unwrap(r.stderr)
    assert "**Warning:** profile" in (tmp_path / "out" / "report.md").read_text()


def test_the_executor_performs_withdrawn_prefetches_of_the_timed_replay():
    """A timed replay whose prefetches queue behind a slow link, the host issuing one at a time,
    withdraws some at their target layer, freeing their room without an eviction; the decision log records each as
    ``withdraw``. Replaying the log with a slot count (written here from the contract: fetch and
    prefetch take a slot, evict and withdraw give one back) never overfills the cache, and the
    executor performs it with the replay's own hits and misses (it ran out of slots before)."""
    pytest.importorskip("torch")
    from moesim.calibration.validate import execute
    from moesim.simulator.engine import Simulation
    from moesim.traces.synth import generate
    from tests.helpers import scenario, small_model

    t = generate(small_model(layers=4, experts=8, top_k=2, hidden=64, inter=128), requests=1, prompt_tokens=0,
                 tokens=40, seed=5)
    sc = scenario(cache={"capacity": "4 experts"}, policies={"prefetch": "previous-token", "eviction": "lru"},
                  hardware={"links": {"pcie": {"bandwidth_gbps": 0.05}}}, execution={"prefetch_depth": 1})
    sim = Simulation(sc, trace=t, record_decisions=True)
    res = sim.run()
    assert sim.decisions is not None
    ops = [op for _, _, op, _ in sim.decisions]
    assert ops.count("withdraw") == res.summary["prefetches_cancelled"] > 0
    used, top = 0, 0
    for op in ops:
        used += (op in ("fetch", "prefetch")) - (op in ("evict", "withdraw"))
        top = max(top, used)
    assert top <= 4
    ex = execute(sc, t)
    assert (ex["misses"], ex["hits"]) == (res.summary["misses"], res.summary["hits"] + res.summary["late_prefetches"])


def test_the_link_fit_describes_expert_sized_copies_not_the_dispatch_floor():
    """Below about 1 MiB a measured copy takes a flat time (the H100 gave ~20 us from 1 KiB to
    256 KiB: the host's dispatch). The fit uses the copies of 1 MiB and up, so it recovers the
    bandwidth and latency of those (here 54.8 GB/s, 1.5 us, by construction); through every
    size the affine fit overstates the bandwidth (the H100's raw data gave 59.6 for 54.8)."""
    raw = synthetic_raw(54.8, 1.5, noise=0.0)
    copy = raw["kind"] == "copy"
    raw.loc[copy, "median_s"] = np.maximum(raw.loc[copy, "median_s"], 20e-6)
    link = fit(raw)["links"]["h2d_pinned"]
    assert link["bandwidth_gbps"] == pytest.approx(54.8, rel=1e-3)
    assert link["latency_us"] == pytest.approx(1.5, rel=1e-2)
    assert link["rel_rms_residual"] < 1e-3


def test_the_cost_model_reads_the_bf16_tables_whatever_their_order(tmp_path):
    """A profile measured in bf16 and fp16 holds two tables per shape; the cost model prices
    the bf16 weights the executor and the scenarios use. It read the last non-expert table
    (fp16, 0.14 ms where bf16 took 0.11 on the H100) before."""
    m = PRESETS["olmoe-1b-7b"].model
    prof = fit(synthetic_raw(25, 10))
    shape = {"hidden": m.hidden_size, "intermediate": m.expert_intermediate_size}
    prof["expert_time"] = {"olmoe-1b-7b": {"float16": {**shape, "tokens": [1, 4], "seconds": [7e-5, 7e-5]},
                                           "bfloat16": {**shape, "tokens": [1, 4], "seconds": [2e-5, 2e-5]}}}
    prof["nonexpert_time"] = {"olmoe-1b-7b": {"bfloat16": {"hidden": m.hidden_size, "tokens": [1, 4],
                                                           "seconds": [3e-5, 3e-5]},
                                              "float16": {"hidden": m.hidden_size, "tokens": [1, 4],
                                                          "seconds": [9e-5, 9e-5]}}}
    path = write_profile(prof, tmp_path / "p.yaml")
    sc = load_scenario("quickstart", [f"hardware.profile={path}"])
    cost = CostModel(sc.hardware, m, m.expert_bytes["bf16"])
    assert cost.expert_time(np.array([2]))[0] == pytest.approx(2e-5, rel=1e-12)
    kv = 2 * cost.kv_width * 2 * 100 / cost.hbm
    assert cost.nonexpert_time(np.array([2]), np.array([100]))[0] == pytest.approx(3e-5 + kv, rel=1e-12)


@pytest.mark.parametrize("mode", ["layer", "per-expert"])
def test_the_executor_plans_its_launches_and_spare_buffers_from_the_decisions(mode):
    """With room for no expert every fetch is uncached, so the spare buffers the plan makes are
    the experts held at once (docs/concepts/execution.md's pinning): all of a layer's distinct routed
    experts in ``layer`` execution, the running one and the one looked up next in
    ``per-expert``. A layer's experts are one launch in ``layer`` execution (one CUDA graph on a
    GPU) and one launch each in ``per-expert``; every layer starts with its non-expert launch."""
    pytest.importorskip("torch")
    from moesim.calibration.validate import execute
    from tests.helpers import scenario, small_model, trace_from_array

    rng = np.random.default_rng(4)
    experts = np.stack([rng.choice(8, size=(3, 2), replace=False) for _ in range(2 * 6)]).reshape(2, 6, 3, 2)
    t = trace_from_array(small_model(layers=3, experts=8, top_k=2, hidden=64, inter=128), experts, prompt_tokens=2)
    sc = scenario(cache={"capacity": "0.5 experts"}, expert_compute=mode, workload={"batch_size": 2})
    ex = execute(sc, t)
    wl = ex["workload"]
    keys, off = wl.keys(), wl.off
    distinct = [len(set(keys[off[b]:off[b + 1]].tolist())) for b in range(len(off) - 1)]
    assert ex["spares"] == (max(distinct) if mode == "layer" else 2)
    expert_launches = [launch for launch in ex["launches"] if launch[0][0] >= 0]
    assert {len(launch) for launch in expert_launches} == ({d for d in distinct if d} if mode == "layer" else {1})
    assert {launch[0][1] for launch in ex["launches"] if launch[0][0] < 0} == set(wl.pass_tokens.tolist())
    assert ex["misses"] == sum(distinct)


def test_fit_warns_only_above_the_residual_limit_and_says_what_to_do():
    """A link fit warns when its residual exceeds 10% (not at exactly 10%), with the whole
    message: the link, the residual, the sizes, and what to do."""
    from moesim.calibration.calibrate import fit_warnings

    link = {"bandwidth_gbps": 50.0, "latency_us": 5.0, "points": 6}
    assert fit_warnings({"links": {"h2d_pinned": {**link, "rel_rms_residual": 0.10}}}) == []
    assert fit_warnings({"links": {"h2d_pinned": {**link, "rel_rms_residual": 0.125}}}) == [
        "link h2d_pinned: the affine fit misses the measurements by 12% (relative RMS over 6 sizes), more than "
        "10%; its bandwidth and latency are rough. Measure again (pinned memory on a GPU, fewer other jobs), or "
        "check the raw times by size."]


HOST_ROWS = {"graph replay": 9e-6, "ffn eager (5 kernels)": 50e-6, "h2d copy dispatch (4 KiB pinned)": 7e-6,
             "event made + recorded": 6e-6, "stream switch + wait_event": 11e-6, "wait_event on the current stream": 5e-6}


def test_fit_puts_the_host_calls_into_the_profile_and_a_scenario_adds_them_up(tmp_path):
    """Host rows (median seconds per call) become the profile's ``host`` section in
    microseconds (an eager kernel: the FFN's five kernels / 5), which a scenario's hardware
    reads and an execution style adds up: graph-per-expert's demand copy is 2 events + a
    stream switch and wait + the copy + a wait = 2*6 + 11 + 7 + 5 = 35 us."""
    raw = synthetic_raw(55.0, 4.0)
    for name, sec in HOST_ROWS.items():  # three repeats each, the median in the middle
        raw = pd.concat([raw, pd.DataFrame([{"kind": "host", "call": name, "median_s": s, "device": "cuda",
                                              "device_name": "synthetic"} for s in (sec * 0.9, sec, sec * 1.3)])])
    prof = fit(raw)
    assert prof["host"] == {"graph_launch_us": 9.0, "eager_kernel_us": 10.0, "copy_submit_us": 7.0,
                            "event_record_us": 6.0, "stream_wait_us": 11.0, "event_wait_us": 5.0}
    assert "host" not in fit(synthetic_raw(55.0, 4.0))
    # the executor's own calls (measured since issue 37's H100 run) join the section where present
    for name, sec in {"executor layer, eager": 71e-6, "executor expert, eager (hit + run)": 88e-6}.items():
        raw = pd.concat([raw, pd.DataFrame([{"kind": "host", "call": name, "median_s": s, "device": "cuda",
                                              "device_name": "synthetic"} for s in (sec * 0.8, sec, sec * 1.1)])])
    assert fit(raw)["host"] == {**prof["host"], "eager_layer_us": 71.0, "eager_expert_us": 88.0}
    path = tmp_path / "p.yaml"
    write_profile(prof, path)
    sc = load_scenario("quickstart", [f"hardware.profile={path}", "execution.style=graph-per-expert"])
    assert sc.host.copy_us == pytest.approx(35.0)
    assert (sc.host.layer_us, sc.host.launch_us) == (9.0, 9.0)
    hf = load_scenario("quickstart", [f"hardware.profile={path}", "execution.style=hf-loop"])
    assert (hf.host.layer_us, hf.host.launch_us, hf.host.copy_us) == (600.0, 100.0, 7.0)


def test_the_host_cost_csv_is_read_and_its_faults_named(tmp_path):
    """``calibrate fit --host-costs``: the tool's CSV, whose call names hold unquoted commas."""
    good = tmp_path / "host.csv"
    good.write_text("call,host_us\n" + "".join(f"{n},{s * 1e6:.2f}\n" for n, s in HOST_ROWS.items())
                    + "per expert, one stream (copy + graph),16.00\n")
    costs = read_host_costs(str(good))
    assert costs["per expert, one stream (copy + graph)"] == 16.0
    assert fit(synthetic_raw(55.0, 4.0), host_costs=costs)["host"]["eager_kernel_us"] == 10.0
    out = tmp_path / "prof.yaml"
    raw = tmp_path / "raw.parquet"
    synthetic_raw(55.0, 4.0).to_parquet(raw)
    done = subprocess.run([sys.executable, "-m", "moesim", "calibrate", "fit", str(raw), "--host-costs", str(good),
                           "--out", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert yaml.safe_load(out.read_text())["host"]["graph_launch_us"] == 9.0
    bad_header = tmp_path / "h.csv"
    bad_header.write_text("name,us\ngraph replay,9\n")
    with pytest.raises(MoesimError, match="must start with the header call,host_us"):
        read_host_costs(str(bad_header))
    bad_line = tmp_path / "l.csv"
    bad_line.write_text("call,host_us\ngraph replay,nine\n")
    with pytest.raises(MoesimError, match=r"line 2: 'graph replay,nine' does not end in a number"):
        read_host_costs(str(bad_line))
    short = tmp_path / "s.csv"
    short.write_text("call,host_us\ngraph replay,9\n")
    with pytest.raises(MoesimError, match="lacks the host call"):
        fit(synthetic_raw(55.0, 4.0), host_costs=read_host_costs(str(short)))


def test_the_executor_s_diagnostic_variants_make_the_same_decisions(tmp_path):
    """``tools/gpu_diagnostics.py slots``' variants: a pool spread over more memory
    and eager launches perform the simulator's decisions, the spread pool from every
    spread-th buffer only, with the same launches."""
    pytest.importorskip("torch")
    from tests.helpers import load_tool

    tool = load_tool("gpu_diagnostics")
    df = tool.slots(str(tmp_path / "slots.csv"), "cpu", repeats=1, tokens=3, layers=2)
    assert set(df["variant"]) == set(tool.SLOT_VARIANTS)
    launches = df.groupby("variant")["launches"].first()
    assert launches["cap1-spread5"] == launches["cap1"] == launches["cap1-eager"]
    assert (df["measured_s"] > 0).all()
    assert pd.read_csv(tmp_path / "slots.csv").shape == df.shape
    from moesim.calibration.validate import execute
    from moesim.traces.synth import synth_from_preset

    trace = synth_from_preset("olmoe-1b-7b", layers=2, requests=1, prompt_tokens=3, tokens=3, seed=0)
    sc = load_scenario("validation/cap5-nopf-lru", ["expert_compute=per-expert"])
    plain, spread = execute(sc, trace, "cpu"), execute(sc, trace, "cpu", spread=4)
    assert (spread["hits"], spread["misses"]) == (plain["hits"], plain["misses"])
    slots = int(sc.cache.capacity.rstrip("%")) * 128 // 100  # 5% of 128 experts: 6 slots
    used = {b for launch in spread["launches"] for b, _ in launch if 0 <= b < 4 * slots}
    assert len(used) > 1
    assert all(b % 4 == 0 for b in used)
    assert {b // 4 for b in used} == {b for launch in plain["launches"] for b, _ in launch if 0 <= b < slots}


def test_the_executor_calls_measure_does_a_layer_and_a_cached_expert_of_the_executor():
    """The host calls ``calibrate measure`` times for the executor's own eager work (issue 37):
    run on the CPU, the layer call launches the non-expert part and the expert call performs a
    cached expert's hit and run decisions, on the pool's one slot, again and again (no copy, no
    spare)."""
    import torch

    from moesim.calibration.calibrate import _executor_calls
    from moesim.calibration.executor import DevicePool

    seen: list[tuple[tuple[int, int], ...]] = []
    real = DevicePool._launch
    try:
        DevicePool._launch = lambda self, kernels: (seen.append(kernels), real(self, kernels))[1]  # type: ignore[method-assign]
        layer, expert = _executor_calls(torch, 16, 8, device="cpu")
        for _ in range(3):
            layer()
            expert()
    finally:
        DevicePool._launch = real  # type: ignore[method-assign]
    assert seen == [((-1, 1),), ((0, 1),)] * 3
    pool = expert.__closure__[[c.cell_contents.__class__.__name__ for c in expert.__closure__].index("DevicePool")].cell_contents
    assert pool.tally == {"hit": 3, "fetch": 1, "bypass": 0, "prefetch": 0}
    assert pool.where == {0: 0}
    assert pool.spare_used == 0


def test_validate_records_and_restores_the_thread_switch_interval(tmp_path):
    """``calibrate validate --switch-interval-us`` (issue 37): the timed passes run with that
    interval, each row records the one it ran with, and Python's own is back afterwards."""
    import sys

    from click.testing import CliRunner

    from moesim.calibration import validate as v
    from moesim.cli import cli
    from moesim.traces.io import write_trace
    from moesim.traces.synth import synth_from_preset

    path = tmp_path / "t.parquet"
    write_trace(synth_from_preset("olmoe-1b-7b", layers=2, requests=1, prompt_tokens=3, tokens=3, seed=0), path)
    base = ["calibrate", "validate", "--profile", str(ROOT / "profiles" / "h100.yaml"), "--trace", str(path),
            "--scenarios", str(ROOT / "moesim" / "scenarios" / "validation" / "cap5-pf-lru.yaml"), "--device", "cpu",
            "--set", "expert_compute=per-expert", "--protocol", "none"]
    before = sys.getswitchinterval()
    during: list[float] = []
    real = v.time.perf_counter

    def clock() -> float:
        during.append(sys.getswitchinterval())
        return real()

    v.time.perf_counter = clock  # type: ignore[assignment]
    try:
        r = CliRunner().invoke(cli, [*base, "--switch-interval-us", "50", "--out", str(tmp_path / "a")])
    finally:
        v.time.perf_counter = real  # type: ignore[assignment]
    assert r.exit_code == 0, r.output
    passes = len(pd.read_parquet(tmp_path / "a" / "passes.parquet"))
    assert sum(round(s * 1e6, 6) == 50 for s in during) == 2 * passes  # each timed pass: its start and its end
    assert sys.getswitchinterval() == before
    row = pd.read_parquet(tmp_path / "a" / "validation.parquet").iloc[0]
    assert (row["switch_interval_us"], row["launch"]) == (50.0, "eager")
    r = CliRunner().invoke(cli, [*base, "--launch", "graphs", "--out", str(tmp_path / "b")])
    row = pd.read_parquet(tmp_path / "b" / "validation.parquet").iloc[0]
    assert (row["switch_interval_us"], row["launch"]) == (before * 1e6, "graphs")
    r = CliRunner().invoke(cli, [*base, "--switch-interval-us", "0", "--out", str(tmp_path / "c")])
    assert r.exit_code != 0
    assert "--switch-interval-us" in r.output
    assert "Traceback" not in r.output


def test_validate_with_eager_launches_predicts_with_the_eager_executor_s_host(tmp_path):
    """``calibrate validate --launch eager`` (issue 37): the executor launches its kernels
    eagerly and the prediction uses ``eager-per-expert`` (5 eager kernels a launch); in layer
    execution, which that style does not model, it is refused with the fix, before anything
    runs."""
    from click.testing import CliRunner

    from moesim.calibration.validate import executor_style
    from moesim.cli import cli
    from moesim.traces.io import write_trace
    from moesim.traces.synth import synth_from_preset

    sets = ["expert_compute=per-expert"]
    sc = load_scenario("validation/cap5-nopf-lru", sets)
    assert executor_style(sc, "validation/cap5-nopf-lru", sets, graphs=False).execution.style == "eager-per-expert"
    assert executor_style(sc, "validation/cap5-nopf-lru", sets).execution.style == "graph-per-expert"
    # prefetch copies issued as the executor issues them: its main thread keeps 2, a copy worker
    # (or SpecMD's loop, which prefetches from one) runs one at a time
    assert executor_style(sc, "validation/cap5-nopf-lru", sets).host.prefetch_depth == 2
    assert executor_style(sc, "validation/cap5-nopf-lru", sets, prefetch_from="worker").host.prefetch_depth == 1
    hf = load_scenario("validation/cap5-nopf-lru", [*sets, "execution.style=hf-loop"])
    assert executor_style(hf, "validation/cap5-nopf-lru", sets, prefetch_from="main").host.prefetch_depth == 1
    path = tmp_path / "t.parquet"
    write_trace(synth_from_preset("olmoe-1b-7b", layers=2, requests=1, prompt_tokens=3, tokens=3, seed=0), path)
    base = ["calibrate", "validate", "--profile", str(ROOT / "profiles" / "h100.yaml"), "--trace", str(path),
            "--scenarios", str(ROOT / "moesim" / "scenarios" / "validation" / "cap5-nopf-lru.yaml"), "--device", "cpu",
            "--protocol", "none", "--launch", "eager"]
    r = CliRunner().invoke(cli, [*base, "--set", "expert_compute=layer", "--out", str(tmp_path / "a")])
    assert r.exit_code != 0
    assert "eager launches are modelled in per-expert execution only" in unwrap(r.output)
    assert "Traceback" not in r.output
    assert not (tmp_path / "a" / "validation.parquet").exists()
    r = CliRunner().invoke(cli, [*base, "--set", "expert_compute=per-expert", "--out", str(tmp_path / "b")])
    assert r.exit_code == 0, r.output
    row = pd.read_parquet(tmp_path / "b" / "validation.parquet").iloc[0]
    want = simulate(load_scenario("validation/cap5-nopf-lru", [
        f"hardware.profile={ROOT / 'profiles' / 'h100.yaml'}", f"workload.trace.path={path}", *sets,
        "execution.style=eager-per-expert"]))
    dec = (want.steps["phase"] == "decode").to_numpy()
    assert row["tpot_predicted_s"] == pytest.approx(want.steps["duration_s"].to_numpy()[dec].mean(), rel=1e-12)
    # the default (--launch auto) launches per-expert execution eagerly: the same prediction
    r = CliRunner().invoke(cli, [*base[:-2], "--set", "expert_compute=per-expert", "--out", str(tmp_path / "c")])
    assert r.exit_code == 0, r.output
    auto = pd.read_parquet(tmp_path / "c" / "validation.parquet").iloc[0]
    assert auto["tpot_predicted_s"] == row["tpot_predicted_s"]


def _distinct_host(torch, sc, trace):
    """Every expert's weights distinct (the validation's host copies repeat 8 experts), so a
    buffer holding the wrong expert shows."""
    from moesim.simulator.engine import Simulation

    m = Simulation(sc, trace=trace).model
    gen = torch.Generator().manual_seed(7)
    return torch.randn(m.num_layers * m.num_experts, 3, m.hidden_size, m.expert_intermediate_size, generator=gen)


@pytest.mark.parametrize("prefetch_from", ["worker", "main"])
def test_each_expert_runs_from_its_own_weights_whoever_issues_the_prefetches(prefetch_from, monkeypatch):
    """Issue 37: with prefetches from the copy worker or from the main thread, the executor
    performs the timed replay's hits and misses, and every expert that runs from a cache slot
    finds its own weights there (a slow link, so prefetches queue and some are withdrawn)."""
    torch = pytest.importorskip("torch")
    from moesim.calibration.executor import DevicePool
    from moesim.calibration.validate import execute
    from moesim.simulator.engine import Simulation
    from moesim.traces.synth import generate
    from tests.helpers import scenario, small_model

    t = generate(small_model(layers=4, experts=8, top_k=2, hidden=64, inter=128), requests=1, prompt_tokens=0,
                 tokens=40, seed=5)
    sc = scenario(cache={"capacity": "4 experts"}, policies={"prefetch": "previous-token", "eviction": "lru"},
                  hardware={"links": {"pcie": {"bandwidth_gbps": 0.05}}},
                  execution={"prefetch_depth": {"worker": 1, "main": 2}[prefetch_from]})  # as each issues them
    host = _distinct_host(torch, sc, t)
    checked = []
    real = DevicePool._launch

    def launch(self, kernels):
        owner = {b: k for k, b in self.where.items()}
        for b, _ in kernels:
            if 0 <= b < self.slots:
                checked.append(bool(torch.equal(self.buffer(b), host[owner[b] // self.p_num])))
        return real(self, kernels)

    monkeypatch.setattr(DevicePool, "_launch", launch)
    res = Simulation(sc, trace=t).run()
    ex = execute(sc, t, host=host, prefetch_from=prefetch_from)
    assert (ex["misses"], ex["hits"]) == (res.summary["misses"], res.summary["hits"] + res.summary["late_prefetches"])
    assert res.summary["prefetches_cancelled"] > 0
    assert len(checked) > 100
    assert all(checked)
    assert ex["late_withdraws"] == 0  # on the CPU a prefetch is copied as it is issued, at once


def test_the_main_thread_keeps_two_prefetches_issued_and_issues_in_order_what_a_kernel_needs():
    """The main thread's prefetch queue (issue 37), its three CUDA calls (an event on the compute
    stream, a copy on a stream, the compute stream's wait) replaced by fakes whose events land
    when the test says: it keeps PREFETCH_DEPTH prefetches issued and the rest queued, issuing
    the next at the first decision after one lands; a hit on a queued one issues every one
    before it and it, in order, and makes the GPU (not the host) wait for it, once; a withdrawn
    queued one is dropped unissued; a withdrawn issued one is counted late and its buffer's
    next user waits for it."""
    torch = pytest.importorskip("torch")
    from moesim.calibration.executor import PREFETCH_DEPTH, DevicePool

    class Pending:
        done = False

        def query(self):
            return self.done

    issued, waited = [], []
    events: dict[int, Pending] = {}

    class Pool(DevicePool):
        def _mark(self):
            return "compute"

        def _issue(self):
            issued.append(self.queued[0][0])
            super()._issue()

        def _stream_copy(self, stream, after, dst, src):
            assert (stream, after) == ("prefetch stream", "compute")
            events[issued[-1]] = Pending()
            return events[issued[-1]]

        def _gpu_wait(self, event):
            waited.append(next(k for k, e in events.items() if e is event))

    pool = Pool(torch, torch.zeros(16, 3, 4, 2), 12, "cpu", 1, 1, 4, graphs=False, prefetch_from="main")
    pool.prepare()
    pool.device = "cuda"  # the queue's CUDA path, on the fakes
    pool.side, pool.demand = "prefetch stream", "demand stream"
    pool.perform("prefetch", 3, {}, {})
    assert issued == [3]  # issued as it is decided
    for key in (5, 7, 9, 2):
        pool.perform("prefetch", key, {}, {})
    assert PREFETCH_DEPTH == 2
    assert issued == [3, 5]
    assert [q[0] for q in pool.queued] == [7, 9, 2]
    pool.perform("prefetch", 11, {}, {})  # nothing has landed: nothing more is issued
    assert issued == [3, 5]
    events[3].done = True  # the first has landed: the next decision, whatever it is, issues one more
    pool.perform("withdraw", 11, {}, {})  # still queued: dropped, never issued
    assert issued == [3, 5, 7]
    assert [q[0] for q in pool.queued] == [9, 2]
    assert 11 not in pool.where
    pool.perform("prefetch", 13, {}, {})
    needed: dict[int, int] = {}
    pool.perform("hit", 2, needed, {})  # behind 9 in the queue: both issued, in order
    assert issued == [3, 5, 7, 9, 2]
    assert waited == [2]
    assert needed == {2: pool.where[2]}
    pool.perform("evict", 2, {}, {})  # its copy was waited for already
    assert waited == [2]
    assert pool.late_withdraws == 0
    pool.perform("withdraw", 5, {}, {})  # issued already
    assert pool.late_withdraws == 1
    assert waited == [2, 5]
    assert 5 not in pool.where
    assert [q[0] for q in pool.queued] == [13]


def test_validate_host_beside_predicts_each_scenario_with_the_host_time_measured_before_it(tmp_path, monkeypatch):
    """``calibrate validate --host-beside`` (issue 37's H100 replicate: the host's speed moved
    between calls): before each scenario the eager executor's host work is timed, recorded in
    the row, and the scenario is predicted with it; the prediction is the simulator's with those
    two costs set, and a scenario predicted in another style is refused before anything runs."""
    from click.testing import CliRunner

    from moesim.calibration import calibrate
    from moesim.cli import cli
    from moesim.simulator.engine import simulate
    from moesim.traces.io import write_trace
    from moesim.traces.synth import synth_from_preset
    from tests.helpers import narrow

    made = iter([{"eager_layer_us": 200.0 + 10 * i, "eager_expert_us": 300.0 + 10 * i} for i in range(4)])
    seen = []

    def fake(torch, h, inter, device):
        seen.append((h, inter, device))
        return next(made)

    monkeypatch.setattr(calibrate, "executor_host_us", fake)
    path = tmp_path / "t.parquet"
    write_trace(narrow(synth_from_preset("olmoe-1b-7b", layers=2, requests=1, prompt_tokens=32, tokens=40, seed=0)),
                path)
    v = ROOT / "moesim" / "scenarios" / "validation"
    base = ["calibrate", "validate", "--profile", str(ROOT / "profiles" / "h100.yaml"), "--trace", str(path),
            "--scenarios", str(v / "cap5-nopf-lru.yaml"), "--scenarios", str(v / "cap100-nopf-lru.yaml"),
            "--device", "cpu", "--host-beside", "--protocol", "none"]
    r = CliRunner().invoke(cli, [*base, "--set", "expert_compute=per-expert", "--out", str(tmp_path / "a")])
    assert r.exit_code == 0, r.output
    assert seen == [(256, 128, "cpu")] * 2
    rows = pd.read_parquet(tmp_path / "a" / "validation.parquet")
    assert rows["host_layer_us"].tolist() == [200.0, 210.0]
    assert rows["host_expert_us"].tolist() == [300.0, 310.0]
    for row, name, (lay, exp) in zip(rows.itertuples(), ("cap5-nopf-lru", "cap100-nopf-lru"), ((200, 300), (210, 310)),
                                     strict=True):
        want = simulate(load_scenario(f"validation/{name}", [
            f"hardware.profile={ROOT / 'profiles' / 'h100.yaml'}", f"workload.trace.path={path}",
            "expert_compute=per-expert", "execution.style=eager-per-expert", f"execution.host_layer_us={lay}",
            f"execution.host_launch_us={exp}"]))
        dec = (want.steps["phase"] == "decode").to_numpy()
        assert row.tpot_predicted_s == pytest.approx(want.steps["duration_s"].to_numpy()[dec].mean(), rel=1e-12)
        if name == "cap100-nopf-lru":  # a pass whose every expert is resident is the host's: 2 x (layer + 8 experts)
            hit = want.steps[(want.steps["misses"] == 0) & (want.steps["phase"] == "decode")]
            assert len(hit) > 0
            assert ((hit["duration_s"] - 2 * (lay + 8 * exp) * 1e-6).between(0, 40e-6)).all()
    r = CliRunner().invoke(cli, [*base, "--set", "expert_compute=layer", "--out", str(tmp_path / "b")])
    assert r.exit_code != 0
    assert "--host-beside" in r.output
    assert "Traceback" not in r.output
    assert not (tmp_path / "b" / "validation.parquet").exists()
    assert len(seen) == 2


def test_executor_host_us_times_the_executor_s_layer_and_expert_calls(monkeypatch):
    """What ``--host-beside`` measures: the executor's layer and expert calls, timed per call.
    With the calls replaced by ones of known length (2 and 5 ms), it reports those lengths
    (the per-call division and which call is which), calling each as often as about 20 ms of
    timing takes; on the real calls, on the CPU, a positive time for each."""
    torch = pytest.importorskip("torch")
    import time

    from moesim.calibration import calibrate

    calls = {"layer": 0, "expert": 0}

    def made(*args):
        def call(name, s):
            def f():
                calls[name] += 1
                time.sleep(s)
            return f
        return call("layer", 0.002), call("expert", 0.005)

    monkeypatch.setattr(calibrate, "_executor_calls", made)
    got = calibrate.executor_host_us(torch, 64, 32, "cpu", batch=500, repeats=2)
    assert 2000 <= got["eager_layer_us"] < 4000  # a sleep overshoots, more on a busy machine
    assert 5000 <= got["eager_expert_us"] < 8000
    # 3 calls to size the timing, then n warm-up calls and 2 timings of n (n: about 20 ms of calls)
    assert 3 + 3 * 2 <= calls["expert"] <= 3 + 3 * 4  # n is at most 20 ms / 5 ms
    assert 3 + 3 * 5 <= calls["layer"] <= 3 + 3 * 10
    monkeypatch.undo()
    real = calibrate.executor_host_us(torch, 64, 32, "cpu", batch=20, repeats=2)
    assert set(real) == {"eager_layer_us", "eager_expert_us"}
    assert all(v > 0 for v in real.values())


def test_validate_runs_the_declared_protocol_by_default_and_labels_every_row(tmp_path):
    """``calibrate validate`` without options runs the declared protocol: eager launches, prefetches
    from the main thread, the process pinned to one allowed core, a sentinel row (the first
    scenario at 100% capacity without prefetch) before and after the scenarios; with host costs
    measured just before on this device every row says ``declared``; with a profile measured
    elsewhere (the committed H100 one) the rows say what differed and a warning says the fix.
    Outside the protocol, a copy worker's prefetch rows carry the artefact and the report puts
    them apart; asking the protocol for a copy worker is refused with the fix."""
    pytest.importorskip("torch")
    from click.testing import CliRunner

    from moesim.calibration.calibrate import measure
    from moesim.calibration.protocol import WORKER_ARTEFACT
    from moesim.cli import cli
    from moesim.traces.io import write_trace
    from moesim.traces.synth import generate
    from tests.helpers import small_model

    write_trace(generate(small_model(layers=2, experts=8, top_k=2, hidden=128, inter=256), requests=1, prompt_tokens=2,
                         tokens=6, seed=4), tmp_path / "t.parquet")
    write_profile(fit(measure("cpu", ["128x256"], quick=True)), tmp_path / "p.yaml")
    (tmp_path / "a.yaml").write_text(yaml.safe_dump({"workload": {"trace": {"path": "t.parquet"}}, "cache": {
        "capacity": "50%"}, "policies": {"eviction": "least-stale", "prefetch": "previous-token"}}))
    (tmp_path / "b.yaml").write_text(yaml.safe_dump({"workload": {"trace": {"path": "t.parquet"}}, "cache": {
        "capacity": "25%"}}))
    base = ["calibrate", "validate", "--trace", str(tmp_path / "t.parquet"), "--scenarios", str(tmp_path / "a.yaml"),
            "--scenarios", str(tmp_path / "b.yaml"), "--device", "cpu", "--set", "expert_compute=per-expert"]
    allowed = os.sched_getaffinity(0)
    try:
        r = CliRunner().invoke(cli, [*base, "--profile", str(tmp_path / "p.yaml"), "--out", str(tmp_path / "d")])
        assert os.sched_getaffinity(0) != allowed or len(allowed) == 1  # pinned to one core
        assert len(os.sched_getaffinity(0)) == 1
    finally:
        os.sched_setaffinity(0, allowed)
    assert r.exit_code == 0, r.output
    df = pd.read_parquet(tmp_path / "d" / "validation.parquet")
    assert df["scenario"].tolist() == ["a (sentinel before)", "a", "b", "a (sentinel after)"]
    assert df["sentinel"].tolist() == ["before", "", "", "after"]
    assert (df["capacity"].iloc[[0, 3]] == "100%").all()
    assert (df["prefetch"].iloc[[0, 3]] == "none").all()
    assert (df["protocol"] == "declared").all()
    assert not df["artefact"].any()
    assert (df["launch"] == "eager").all()
    assert (df["prefetch_from"] == "main").all()
    assert df["core"].nunique() == 1
    assert int(df["core"].iloc[0]) in allowed
    assert (df["hits_exec"] == df["hits_sim"]).all()
    assert (df["misses_exec"] == df["misses_sim"]).all()
    report = (tmp_path / "d" / "report.md").read_text()
    assert "Protocol: declared." in report
    drift = abs(df["tpot_measured_s"].iloc[3] - df["tpot_measured_s"].iloc[0]) / df["tpot_measured_s"].iloc[0]
    assert f"a drift of {drift:.1%}" in report
    assert "over 2 scenarios" in r.output  # the sentinels are not judged
    # host costs from another machine and day: labelled, with the fix
    try:
        r = CliRunner().invoke(cli, [*base, "--profile", str(ROOT / "profiles" / "h100.yaml"), "--out", str(tmp_path / "e")])
    finally:
        os.sched_setaffinity(0, allowed)
    assert r.exit_code == 0, r.output
    assert "run `moesim calibrate measure` and `fit` just before" in unwrap(r.output)
    df = pd.read_parquet(tmp_path / "e" / "validation.parquet")
    assert (df["protocol"] == "not declared: host costs not measured just before in the same lease").all()
    # outside the protocol: a copy worker's prefetch row is an artefact, reported apart
    r = CliRunner().invoke(cli, [*base, "--profile", str(tmp_path / "p.yaml"), "--protocol", "none",
                                 "--prefetch-from", "worker", "--out", str(tmp_path / "f")])
    assert r.exit_code == 0, r.output
    df = pd.read_parquet(tmp_path / "f" / "validation.parquet").set_index("scenario")
    assert df["artefact"].to_dict() == {"a": True, "b": False}
    assert df.loc["a", "artefact_reason"] == WORKER_ARTEFACT
    assert df.loc["b", "protocol"] == ("not declared: prefetches from a copy worker; not pinned to one core; "
                                       "host costs not measured just before in the same lease; no sentinel rows")
    report = (tmp_path / "f" / "report.md").read_text()
    assert "1 rows carry an executor artefact and are reported apart" in report
    assert "## Rows with an executor artefact, reported apart" in report
    assert "over 1 scenarios" in r.output
    r = CliRunner().invoke(cli, [*base, "--profile", str(tmp_path / "p.yaml"), "--prefetch-from", "worker",
                                 "--out", str(tmp_path / "g")])
    assert r.exit_code != 0
    assert "--protocol none" in unwrap(r.output)
    assert "Traceback" not in r.output
    assert not (tmp_path / "g").exists()


def test_a_rows_protocol_label_by_hand(tmp_path):
    """``protocol_columns``: each way a run differs from the declared protocol named, in order;
    the graph artefact only on per-expert rows launched as graphs, the copy worker's only on rows
    that prefetch. ``sentinel_drift``: |after - before| / before, None without both.
    ``host_costs_age_s``: seconds since the profile's microbenchmarks, None on another device or
    without a date."""
    from moesim.calibration.protocol import (
        GRAPHS_ARTEFACT,
        WORKER_ARTEFACT,
        host_costs_age_s,
        protocol_columns,
        sentinel_drift,
        sentinel_tpots,
    )

    ok = {"launch": "eager", "prefetch_from": "main", "pinned": True, "host_costs_same_lease": True, "sentinels": True}
    assert protocol_columns(ok, "per-expert", "previous-token") == {"protocol": "declared", "artefact": False,
                                                                     "artefact_reason": ""}
    off = {"launch": "graphs", "prefetch_from": "worker", "pinned": False, "host_costs_same_lease": False,
           "sentinels": False}
    label = protocol_columns(off, "per-expert", "previous-token")
    assert label["protocol"] == ("not declared: graph launches; prefetches from a copy worker; not pinned to one "
                                 "core; host costs not measured just before in the same lease; no sentinel rows")
    assert (label["artefact"], label["artefact_reason"]) == (True, f"{GRAPHS_ARTEFACT}; {WORKER_ARTEFACT}")
    assert protocol_columns(off, "layer", "none")["artefact"] is False
    assert protocol_columns(off, "layer", "oracle")["artefact_reason"] == WORKER_ARTEFACT
    assert protocol_columns(off, "per-expert", "none")["artefact_reason"] == GRAPHS_ARTEFACT
    for key in ok:
        one = protocol_columns({**ok, key: off[key]}, "per-expert", "none")["protocol"]
        assert one.startswith("not declared: "), key
        assert ";" not in one, key
    rows = pd.DataFrame({"sentinel": ["before", "", "after"], "tpot_measured_s": [0.010, 0.5, 0.0108]})
    assert sentinel_drift(rows) == pytest.approx(0.08)
    assert sentinel_drift(rows.assign(tpot_measured_s=[0.010, 0.5, 0.0095])) == pytest.approx(0.05)
    assert sentinel_tpots(rows) == (0.010, 0.0108)
    assert sentinel_drift(rows.iloc[:2]) is None
    assert sentinel_tpots(rows.iloc[1:]) is None
    assert sentinel_drift(rows.drop(columns="sentinel")) is None
    prof = yaml.safe_load((ROOT / "profiles" / "h100.yaml").read_text())
    prof["measured_on"] = {"device_name": "GPU X", "measured_at": "2026-12-02T10:00:00+00:00"}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(prof))
    at = 1_796_205_600.0  # 2026-12-02T10:00:00Z
    assert host_costs_age_s(str(tmp_path / "p.yaml"), "GPU X", now=at + 600) == pytest.approx(600)
    assert host_costs_age_s(str(tmp_path / "p.yaml"), "GPU Y", now=at + 600) is None
    prof["measured_on"] = {"device_name": "GPU X"}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(prof))
    assert host_costs_age_s(str(tmp_path / "p.yaml"), "GPU X", now=at) is None


def test_the_declared_protocol_pins_the_core_where_the_host_work_is_fastest(monkeypatch):
    """``fastest_core``: the executor's cached-expert host work timed pinned to each allowed core
    (replaced here by times that fall with the core's number), the process left pinned to the
    fastest, every allowed core tried."""
    from moesim.calibration import calibrate
    from moesim.calibration.validate import fastest_core

    allowed = os.sched_getaffinity(0)
    tried = []

    def timed(torch, h, inter, device):
        (core,) = os.sched_getaffinity(0)
        tried.append(core)
        return {"eager_layer_us": 1.0, "eager_expert_us": 100.0 - core}

    monkeypatch.setattr(calibrate, "executor_host_us", timed)
    try:
        assert fastest_core(None, 8, 16, "cpu", repeats=2) == max(allowed)
        assert os.sched_getaffinity(0) == {max(allowed)}
    finally:
        os.sched_setaffinity(0, allowed)
    assert sorted(set(tried)) == sorted(allowed)
    assert len(tried) == 2 * len(allowed)

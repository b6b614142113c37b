"""The host thread (docs/concepts/execution.md, "The host thread"; ``moesim.config.execution``): each
style's timeline worked by hand on a two-layer pass, the closed form of a policy change on a
saturated link, both replay paths bit-identical under every style, and the ``execution`` key's
configuration and bad input."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from moesim.config.confload import ConfigError
from moesim.config.execution import (
    EAGER_EXPERT_KERNELS,
    EAGER_LAYER_KERNELS,
    HF_EXPERT_KERNELS,
    HF_LAYER_KERNELS,
    STYLES,
)
from moesim.simulator.engine import simulate
from moesim.simulator.workload import build_workload
from moesim.traces.synth import generate
from tests.helpers import (
    datasheet_times,
    experts_cap,
    register_none_at_layer_1,
    scenario,
    small_model,
    trace_from_array,
)

# round host costs (microseconds) so that every style's sums are easy to follow by hand:
# graph styles: layer 10, launch 10, demand copy 2*1 + 2 + 3 + 1 = 8;
# hf-loop: layer 60 * 2 = 120, launch 10 * 2 = 20, copy 3, host waits before each expert;
# fused-moe: layer 10, launch 10, copy 3
HOST = {"graph_launch_us": 10.0, "eager_kernel_us": 2.0, "copy_submit_us": 3.0, "event_record_us": 1.0,
        "stream_wait_us": 2.0, "event_wait_us": 1.0}
US = 1e-6


def two_layer_case(style: str, path: str, monkeypatch, capacity: str = "0 experts", passes: int = 1):
    """A two-layer model with 4 experts, top-2, decode passes of one token routed to experts
    0 and 1 in layer 0 and 2 and 3 in layer 1; A100 + PCIe 4.0 datasheet times
    (tests/helpers.datasheet_times): non-expert ``ne``, expert ``f`` (one token), copy ``c``."""
    if path == "simpy":
        monkeypatch.setenv("MOESIM_NO_KERNEL", "1")
    model = small_model(layers=2, experts=4, top_k=2)
    routed = np.array([[[[0, 1], [2, 3]]] * passes])
    trace = trace_from_array(model, routed)
    sc = scenario(hardware={"preset": "a100-80g-pcie4", "host": HOST}, cache={"capacity": capacity},
                  execution={"style": style})
    res = simulate(sc, trace=trace)
    assert res.summary["replay_path"] == path
    wl = build_workload(trace, 1)
    ffn, nonexp, copy = datasheet_times(model, wl)
    assert len(set(ffn.tolist())) == 1
    return res, nonexp, float(ffn[0]), copy


@pytest.mark.parametrize("path", ["kernel", "simpy"])
@pytest.mark.parametrize("style", ["graph-layer", "fused-moe"])
def test_a_layer_style_s_host_delays_only_the_first_launch_when_copies_are_long(style, path, monkeypatch):
    """``layer`` execution, every expert missing. Layer 0: the host issues the non-expert part
    at 10 us, so it runs from 10 (the GPU waits) to the routing point r0 = 10 + ne; the host
    then submits two copies (8 or 3 us each) and the experts' launch (10 us), done by r0 + 26
    at the latest, long before the copies land at r0 + 2c; the experts end at r0 + 2c + 2f.
    Layer 1: the host issued its non-expert part while layer 0's copies ran, so it starts when
    layer 0 ends. Pass: 10 + 2 ne + 4 c + 4 f."""
    res, nonexp, f, c = two_layer_case(style, path, monkeypatch)
    ne = nonexp[0]
    assert 2 * c > 26 * US  # the host is ahead from layer 0's copies on
    assert res.steps["duration_s"].iloc[0] == pytest.approx(10 * US + 2 * ne + 4 * c + 4 * f, rel=1e-12)
    base, *_ = two_layer_case("none", path, monkeypatch)
    assert res.steps["duration_s"].iloc[0] - base.steps["duration_s"].iloc[0] == pytest.approx(10 * US, rel=1e-9)


@pytest.mark.parametrize("path", ["kernel", "simpy"])
def test_graph_per_expert_pipelines_its_copies_behind_the_host(path, monkeypatch):
    """``per-expert`` execution, pipelined fetch, every expert missing. Layer 0: non-expert
    from 10 to r0 = 10 + ne; expert 0's copy r0 .. r0 + c (host at 18), its launch issued at
    28; it runs at r0 + c, when expert 1's copy is submitted (host 36) and goes out behind it
    (to r0 + 2c); expert 1's launch is issued at 46 and it runs r0 + 2c .. r0 + 2c + f.
    Layer 1: issued at 56, far ahead, so it follows at once. Pass: 10 + 2 ne + 4 c + 2 f."""
    res, nonexp, f, c = two_layer_case("graph-per-expert", path, monkeypatch)
    ne = nonexp[0]
    assert res.steps["duration_s"].iloc[0] == pytest.approx(10 * US + 2 * ne + 4 * c + 2 * f, rel=1e-12)


@pytest.mark.parametrize("path", ["kernel", "simpy"])
def test_the_hf_loop_waits_for_each_fetch_and_each_expert(path, monkeypatch):
    """``hf-loop``: per-expert, blocking fetch, host waits before each expert. Layer 0: the
    host issues the non-expert part (60 kernels, 120 us): the routing point r0 = 120 + ne, where
    the host waits for the router. Expert 0: copy submitted (3 us), the host blocks until it
    lands at r0 + c, launches (10 kernels, 20 us): it runs r0 + c + 20 .. r0 + c + 20 + f; only
    then is expert 1 looked up (blocking) and copied, to r0 + 2c + 20 + f, the host having
    waited for expert 0 (r0 + c + 20 + f > its r0 + c + 23); launched at r0 + 2c + 40 + f, it
    ends at e0 = r0 + 2c + 40 + 2f. Layer 1's non-expert part is issued once expert 1's launch
    is (r0 + 2c + 40 + f) and takes the host 120 us, so it runs from there: r1 = r0 + 2c + 40
    + f + 120 + ne, then the same as layer 0. Pass: 2 * 120 + 2 ne + 4 c + 4 * 20 + 3 f."""
    res, nonexp, f, c = two_layer_case("hf-loop", path, monkeypatch)
    ne = nonexp[0]
    assert (HF_LAYER_KERNELS, HF_EXPERT_KERNELS) == (60, 10)
    assert f < 3 * US + 20 * US
    assert f < 120 * US
    want = 2 * 120 * US + 2 * ne + 4 * c + 4 * 20 * US + 3 * f
    assert res.steps["duration_s"].iloc[0] == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("path", ["kernel", "simpy"])
def test_the_hf_loop_is_host_bound_when_every_expert_is_resident(path, monkeypatch):
    """The same pass again with every expert resident (second pass, capacity for all): no
    copies, so each layer takes the host's 120 us, the non-expert part, and per expert a
    launch of 20 us after the GPU has run the one before: 2 * 120 + 2 ne + 4 * 20 + 3 f."""
    res, nonexp, f, _ = two_layer_case("hf-loop", path, monkeypatch, capacity="inf", passes=2)
    ne = nonexp[1]
    assert res.steps["hits"].tolist() == [0, 4]
    want = 2 * 120 * US + 2 * ne + 4 * 20 * US + 3 * f
    assert res.steps["duration_s"].iloc[1] == pytest.approx(want, rel=1e-12)
    assert res.steps["stall_s"].iloc[1] == 0.0  # the GPU waited for the host, not for copies


@pytest.mark.parametrize("path", ["kernel", "simpy"])
def test_the_eager_executor_is_host_bound_when_every_expert_is_resident(path, monkeypatch):
    """``eager-per-expert`` (the calibration executor launching eagerly) with a 6 us kernel:
    a layer's non-expert part costs the host 5 kernels (30 us), each expert 5 (30 us), and the
    host never waits inside a pass. Every expert resident (second pass): the host issues the
    non-expert part of layer 0 by 30, its experts by 60 and 90, layer 1's part by 120 and its
    experts by 150 and 180; the GPU, quicker than 30 us at each, runs each as it is issued, so
    the pass ends at 180 us + f."""
    monkeypatch.setitem(HOST, "eager_kernel_us", 6.0)
    res, nonexp, f, _ = two_layer_case("eager-per-expert", path, monkeypatch, capacity="inf", passes=2)
    assert (EAGER_LAYER_KERNELS, EAGER_EXPERT_KERNELS) == (5, 5)
    assert max(nonexp[1], f) < 30 * US
    assert res.steps["hits"].tolist() == [0, 4]
    assert res.steps["duration_s"].iloc[1] == pytest.approx(180 * US + f, rel=1e-12)


@pytest.mark.parametrize(("mode", "fetch", "style"), [("layer", "pipelined", "none"), ("per-expert", "blocking", "none"),
                                                     ("per-expert", "blocking", "hf-loop")])
@pytest.mark.parametrize("path", ["kernel", "simpy"])
def test_on_a_saturated_link_a_policy_change_saves_its_copies_times_the_copy_time(mode, fetch, style, path,
                                                                                   monkeypatch):
    """No prefetch, every layer waiting for its copies (``layer`` execution, or ``per-expert``
    with blocking fetches): a step is sum(ne) + copies * c + sum(f), so in every pass two
    eviction policies' step times differ by exactly their copy-count difference times c (a
    prefill included: its TTFT). In the ``hf-loop`` style too (SpecMD's setting): the host's
    costs are the same for a hit and a miss but the copy submission, which hides under the
    copy it waits for (3 us against c)."""
    if path == "simpy":
        monkeypatch.setenv("MOESIM_NO_KERNEL", "1")
    model = small_model(layers=3, experts=16, top_k=4)
    trace = generate(model, requests=1, prompt_tokens=12, tokens=30, seed=4)
    out = {}
    for ev in ("lru", "least-stale", "belady"):
        sc = scenario(cache={"capacity": experts_cap(10, model)}, expert_compute=mode, expert_fetch=fetch,
                      policies={"eviction": ev}, execution={"style": style},
                      hardware={"preset": "a100-80g-pcie4", "host": HOST})
        res = simulate(sc, trace=trace)
        assert res.summary["replay_path"] == path
        out[ev] = (res.steps["duration_s"].to_numpy(), res.steps["misses"].to_numpy())
    _, _, c = datasheet_times(model, build_workload(trace, 1))
    assert out["lru"][1].sum() > out["belady"][1].sum()
    for a, b in (("lru", "least-stale"), ("lru", "belady"), ("least-stale", "belady")):
        np.testing.assert_allclose(out[a][0] - out[b][0], (out[a][1] - out[b][1]) * c, rtol=1e-9, atol=1e-15)


@pytest.mark.parametrize("prefetch", ["none", "previous-token", "oracle"])
@pytest.mark.parametrize(("style", "mode"), [("graph-layer", None), ("graph-per-expert", None), ("hf-loop", None),
                                        ("hf-loop", "pipelined"), ("fused-moe", "on-arrival"),
                                        ("hf-loop", "on-arrival")])
def test_both_replay_paths_agree_bit_for_bit_under_every_style(style, mode, prefetch, monkeypatch):
    """Every per-pass column, kernel against SimPy, with a host that both leads and lags the
    GPU (prefetch proposals admitted while it does)."""
    model = small_model(layers=3, experts=16, top_k=4)
    trace = generate(model, requests=2, prompt_tokens=6, tokens=25, seed=9)
    over = {"expert_fetch": mode} if mode == "pipelined" else ({"expert_compute": mode} if mode else {})
    sc = scenario(cache={"capacity": experts_cap(14, model)}, execution={"style": style},
                  hardware={"preset": "a100-80g-pcie4", "host": HOST}, policies={"prefetch": prefetch},
                  workload={"batch_size": 2}, **over)
    a = simulate(sc, trace=trace)
    monkeypatch.setenv("MOESIM_NO_KERNEL", "1")
    b = simulate(sc, trace=trace)
    assert (a.summary["replay_path"], b.summary["replay_path"]) == ("kernel", "simpy")
    for col in a.steps.columns:
        if a.steps[col].dtype != object:
            np.testing.assert_array_equal(a.steps[col].to_numpy(), b.steps[col].to_numpy(), err_msg=col)
    base = simulate(scenario(cache={"capacity": experts_cap(14, model)}, policies={"prefetch": prefetch},
                             workload={"batch_size": 2}, expert_compute=sc.expert_compute,
                             expert_fetch=sc.expert_fetch), trace=trace)
    if prefetch == "none":  # the same decisions; the host only adds time
        assert a.summary["misses"] == base.summary["misses"]
        assert (a.steps["duration_s"].to_numpy() >= base.steps["duration_s"].to_numpy() * (1 - 1e-9)).all()


def test_a_style_sets_the_execution_keys_the_scenario_leaves_out():
    hf = scenario(execution={"style": "hf-loop"})
    assert (hf.expert_compute, hf.expert_fetch) == ("per-expert", "blocking")
    host = hf.hardware.host
    assert hf.host.layer_us == pytest.approx(60 * host.eager_kernel_us)
    assert hf.host.launch_us == pytest.approx(10 * host.eager_kernel_us)
    assert (hf.host.copy_us, hf.host.sync, hf.host.dequant) == (host.copy_submit_us, "expert", True)
    mine = scenario(execution={"style": "hf-loop", "host_sync": "layer", "host_launch_us": 5}, expert_fetch="pipelined")
    assert (mine.expert_compute, mine.expert_fetch, mine.host.sync, mine.host.launch_us) == (
        "per-expert", "pipelined", "layer", 5.0)
    graph = scenario(execution={"style": "graph-per-expert"})
    assert graph.host.copy_us == pytest.approx(7.28 * 2 + 10.94 + 7.34 + 5.62)  # 47.53 - 9.07 measured
    assert graph.to_dict()["execution"] == {"style": "graph-per-expert", "host_layer_us": 9.07,
                                            "host_launch_us": 9.07, "host_copy_us": graph.host.copy_us,
                                            "host_sync": "none", "dequant": False, "prefetch_depth": 2}
    mine = scenario(execution={"style": "graph-layer", "host_layer_us": 0, "host_copy_us": 0.5, "host_launch_us": 2.5})
    assert (mine.host.layer_us, mine.host.launch_us, mine.host.copy_us) == (0.0, 2.5, 0.5)
    eager = scenario(execution={"style": "eager-per-expert"})
    assert (eager.expert_compute, eager.expert_fetch, eager.host.sync) == ("per-expert", "pipelined", "none")
    assert (eager.host.layer_us, eager.host.launch_us) == (5 * host.eager_kernel_us, 5 * host.eager_kernel_us)
    assert eager.host.copy_us == graph.host.copy_us
    # where the profile measured the executor's own host time (issue 37's H100 run) it is used whole
    own = scenario(execution={"style": "eager-per-expert"},
                   hardware={"preset": "a100-80g-pcie4", "host": {**HOST, "eager_layer_us": 71.5, "eager_expert_us": 88.25}})
    assert (own.host.layer_us, own.host.launch_us, own.host.copy_us) == (71.5, 88.25, 2 * 1.0 + 2.0 + 3.0 + 1.0)
    half = scenario(execution={"style": "eager-per-expert"},
                    hardware={"preset": "a100-80g-pcie4", "host": {**HOST, "eager_expert_us": 88.25}})
    assert (half.host.layer_us, half.host.launch_us) == (5 * HOST["eager_kernel_us"], 88.25)
    # the other styles never read them
    assert scenario(execution={"style": "hf-loop"}, hardware={"preset": "a100-80g-pcie4", "host": {
        **HOST, "eager_layer_us": 71.5, "eager_expert_us": 88.25}}).host.launch_us == 10 * HOST["eager_kernel_us"]
    fused = scenario(execution={"style": "fused-moe"})
    assert (fused.expert_compute, fused.host.layer_us, fused.host.launch_us, fused.host.copy_us, fused.host.sync) == (
        "layer", host.graph_launch_us, host.graph_launch_us, host.copy_submit_us, "none")
    assert scenario(execution={"style": "graph-layer"}).host.launch_us == host.graph_launch_us
    assert not scenario().host.active
    assert not scenario(execution={"style": "hf-loop"}, timing=False).host.active



def test_each_style_issues_its_prefetch_copies_as_its_stack_does():
    """``execution.prefetch_depth``: the calibration executor's styles keep 2 admitted copies
    issued (its main thread's ``PREFETCH_DEPTH``), the others issue each when it is admitted
    (None: all); a scenario's own value, a number or ``all``, goes over the style's and into
    ``scenario.resolved.yaml``."""
    assert [scenario(execution={"style": s}).host.prefetch_depth for s in STYLES] == [None, 2, 2, 2, None, None]
    assert scenario().to_dict()["execution"]["prefetch_depth"] == "all"
    mine = scenario(execution={"style": "eager-per-expert", "prefetch_depth": "all"})
    assert (mine.host.prefetch_depth, mine.to_dict()["execution"]["prefetch_depth"]) == (None, "all")
    one = scenario(execution={"prefetch_depth": 1})
    assert (one.host.prefetch_depth, one.to_dict()["execution"]["prefetch_depth"]) == (1, 1)


@pytest.mark.parametrize(("execution", "words"), [
    ({"style": "hf"}, ["execution.style", "hf-loop"]),
    ({"host_launch_us": -1}, ["execution", "host_launch_us must be >= 0"]),
    ({"host_sync": "token"}, ["execution.host_sync", "expert"]),
    ({"threads": 2}, ["execution.threads", "host_copy_us"]),
    ({"prefetch_depth": 0}, ["execution", "prefetch_depth must be 'all' or a number of copies >= 1, got 0"]),
    ({"prefetch_depth": "some"}, ["execution.prefetch_depth", "'some'"]),
])
def test_a_bad_execution_key_is_named_with_its_fix(execution, words):
    with pytest.raises(ConfigError) as err:
        scenario(execution=execution)
    for w in words:
        assert w in str(err.value)


def test_a_negative_host_cost_in_the_hardware_is_refused():
    with pytest.raises(ConfigError, match=r"host\.graph_launch_us must be >= 0"):
        scenario(hardware={"preset": "a100-80g-pcie4", "host": {"graph_launch_us": -2}})


def test_dequantisation_adds_the_hbm_roofline_of_a_4_bit_expert(monkeypatch):
    """``dequant``: a 4-bit expert (H 256, I 512: 393,216 parameters, 196,608 bytes) is read
    and written back in bf16 (786,432 bytes) before its matmuls: 983,040 bytes at 2039 GB/s
    more per expert computation; bf16 experts are not dequantised."""
    model = small_model(layers=2, experts=4, top_k=2)
    trace = trace_from_array(model, np.array([[[[0, 1], [2, 3]]]]))
    times = {}
    for prec in ("bf16", "int4"):
        for dq in (False, True):
            sc = scenario(cache={"capacity": "inf", "precision": prec}, execution={"dequant": dq})
            times[prec, dq] = simulate(sc, trace=trace).steps["duration_s"].iloc[0]
    assert model.expert_bytes["int4"] == 196_608
    assert times["bf16", True] == times["bf16", False]
    extra = times["int4", True] - times["int4", False]
    assert extra == pytest.approx(4 * (196_608 + 786_432) / 2039e9, rel=1e-9)


def test_expert_parallelism_with_a_host_model_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"key 'execution' models the host of one GPU.*hardware.gpus: 1"):
        scenario(execution={"style": "graph-layer"},
                 hardware={"preset": "a100-80g-pcie4", "gpus": 2, "links": {"nvlink": {"bandwidth_gbps": 300}}})
    assert scenario(hardware={"preset": "a100-80g-pcie4", "gpus": 2,
                              "links": {"nvlink": {"bandwidth_gbps": 300}}}).hardware.gpus == 2


def test_the_styles_are_listed_with_their_host_costs_and_named_in_compare_s_title():
    import json
    import subprocess
    import sys

    from moesim.studies.compare import describe

    out = subprocess.run([sys.executable, "-m", "moesim", "presets", "--json"], capture_output=True, text=True,
                         check=True).stdout
    styles = json.loads(out)["execution_styles"]
    assert list(styles) == ["none", "graph-layer", "graph-per-expert", "eager-per-expert", "hf-loop", "fused-moe"]
    assert [styles[k]["execution"] for k in styles] == ["(any)", "layer", "per-expert pipelined", "per-expert pipelined",
                                                        "per-expert blocking", "layer"]
    assert (styles["eager-per-expert"]["host_layer_us"], styles["eager-per-expert"]["host_launch_us"]) == (
        "66.72", "66.72")  # 5 kernels of 13.344 us (hf-loop's 60 make 800.64)
    assert styles["hf-loop"] == {"execution": "per-expert blocking", "host_layer_us": "800.64",
                                 "host_launch_us": "133.44", "host_copy_us": "7.34", "host_sync": "expert",
                                 "dequant": "True", "prefetch_depth": "all"}
    assert styles["eager-per-expert"]["prefetch_depth"] == "2"
    sc = scenario(execution={"style": "hf-loop"})
    title = describe("s.yaml", sc.to_dict())
    assert "per-expert (blocking fetch) execution with the hf-loop host, seed 0" in title


def test_a_run_says_when_it_compiles_the_kernel_and_compiles_only_the_form_it_reaches(tmp_path):
    """The first run after an installation compiles the replay kernel: the CLI says so on
    stderr as the compile starts, naming the form (numba's cache emptied by pointing it at a
    new folder). The quickstart (layer execution, fetch on a miss) compiles one form, with
    neither the per-expert nor the per-token miss policies' code (their helpers are never
    compiled); a second run loads it and says nothing, and ``load_cached_forms`` (what a
    sweep's fork server calls) loads the one form cached."""
    import os
    import subprocess
    import sys

    # no jit helper (moesim.jitplan: its own tests): it would compile the same functions on the core the other test
    # worker is using
    env = {**{k: v for k, v in os.environ.items() if k != "NUMBA_DISABLE_JIT"}, "NUMBA_CACHE_DIR": str(tmp_path / "cache"),
           "MOESIM_NO_JIT_HELPER": "1"}
    run = [sys.executable, "-m", "moesim", "run", "quickstart", "--no-write", "-q", "--set", "workload.trace.synth.tokens=3"]
    first = subprocess.run(run, env=env, capture_output=True, text=True, check=True)
    note = ("moesim: compiling the replay kernel's form for layer or on-arrival execution, fetch on a miss, once for "
            "this installation.")
    assert first.stderr.count("moesim: compiling") == 1, first.stderr
    assert note in " ".join(first.stderr.split()), first.stderr
    probe = ("from moesim.simulator import kernel; n = kernel.load_cached_forms(); "
             "print(n, [(str(s[kernel.replay_passes.py_func.__code__.co_varnames.index('M')]), "
             "str(s[kernel.replay_passes.py_func.__code__.co_varnames.index('per_expert')])) "
             "for s in kernel.replay_passes.signatures])")
    forms = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert forms.stdout.strip() == "1 [('none', 'none')]", forms.stdout + forms.stderr
    # each compiled helper keeps its own cache entries: the pruned ones were never compiled
    helpers = ("from moesim.simulator import kernel_compute as X, kernel_lookup as L; "
               "print([len(getattr(m, f)._cache._cache_file._load_index()) for m, f in ((X, '_layer'), (L, '_lookup'), "
               "(X, '_per_expert'), (X, '_host_lookup'), (L, '_miss_policy'), (L, '_speculate'), (L, '_cascade'))])")
    compiled = subprocess.run([sys.executable, "-c", helpers], env=env, capture_output=True, text=True, check=True)
    assert compiled.stdout.strip() == "[1, 1, 0, 0, 0, 0, 0]", compiled.stdout + compiled.stderr
    second = subprocess.run(run, env=env, capture_output=True, text=True, check=True)
    assert "compiling" not in second.stderr, second.stderr


def test_the_compile_note_names_the_form_from_the_argument_types():
    from numba import types

    from moesim.simulator.kernel import compile_message, form_of, replay_passes

    names = getattr(replay_passes, "py_func", replay_passes).__code__.co_varnames
    mass = types.UniTuple(types.int64[:], 2)

    def args(m, pe):
        return tuple(m if n == "M" else pe if n == "per_expert" else types.int64 for n in names)

    assert form_of(args(types.none, types.none)) == "layer or on-arrival execution, fetch on a miss"
    assert form_of(args(mass, types.none)) == "layer or on-arrival execution, a per-token miss policy"
    assert form_of(args(types.none, types.boolean)) == "per-expert execution, fetch on a miss"
    assert form_of(args(mass, types.boolean)) == "per-expert execution, a per-token miss policy"
    assert compile_message("per-expert execution, fetch on a miss") == (
        "moesim: compiling the replay kernel's form for per-expert execution, fetch on a miss, once for this "
        "installation.")


@settings(max_examples=int(os.environ.get('MOESIM_HYPOTHESIS_EXAMPLES', 80)), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.integers(1, 3), st.integers(3, 10), st.integers(1, 3), st.integers(0, 6), st.integers(1, 12),
       st.integers(0, 10_000), st.sampled_from(["layer", "on-arrival", "per-expert"]),
       st.sampled_from(["pipelined", "blocking"]), st.sampled_from(["none", "layer", "expert"]),
       st.sampled_from(["none", "previous-token", "oracle"]),
       st.tuples(*[st.sampled_from([0.0, 0.5, 3.0, 40.0, 400.0])] * 3), st.integers(0, 40))
@example(3, 3, 3, 0, 1, 0, "per-expert", "pipelined", "none", "oracle", (400.0, 0.5, 0.0), 2)  # found by mutation
@example(3, 9, 3, 0, 4, 1, "per-expert", "pipelined", "expert", "previous-token", (0.0, 0.0, 0.0), 3)  # testing
def test_host_replays_agree_on_both_paths_and_only_add_time_without_prefetch(
        monkeypatch, layers, experts, k, prompt, tokens, seed, mode, fetch, sync, prefetch, costs, cap):
    """Random small traces, execution modes, host costs and waits: every per-pass column of the
    kernel equals the SimPy path's; without prefetch (where no decision depends on time) the
    host changes no decision and makes no pass shorter."""
    model = small_model(layers, experts, min(k, experts))
    trace = generate(model, requests=1, prompt_tokens=prompt, tokens=tokens, seed=seed)
    layer_us, launch_us, copy_us = costs
    base = {"cache": {"capacity": experts_cap(cap, model)}, "expert_compute": mode, "expert_fetch": fetch,
            "policies": {"prefetch": prefetch, "eviction": "least-stale"}}
    sc = scenario(**base, execution={"host_layer_us": layer_us, "host_launch_us": launch_us, "host_copy_us": copy_us,
                                     "host_sync": sync})
    monkeypatch.delenv("MOESIM_NO_KERNEL", raising=False)
    a = simulate(sc, trace=trace)
    monkeypatch.setenv("MOESIM_NO_KERNEL", "1")
    b = simulate(sc, trace=trace)
    for col in a.steps.columns:
        if a.steps[col].dtype != object:
            np.testing.assert_array_equal(a.steps[col].to_numpy(), b.steps[col].to_numpy(), err_msg=col)
    if prefetch == "none":  # durations are differences of absolute times: equal up to their rounding
        plain = simulate(scenario(**base), trace=trace)
        assert a.steps["misses"].tolist() == plain.steps["misses"].tolist()
        assert (a.steps["duration_s"].to_numpy() >= plain.steps["duration_s"].to_numpy() * (1 - 1e-9)).all()


@pytest.mark.parametrize("mode", ["layer", "on-arrival"])
def test_a_layer_with_nothing_to_compute_launches_no_experts(monkeypatch, mode):
    """A budget that keeps no expert at layer 1 (tests/test_engine.py's case) under a host that
    waits for each routing point and takes 20 us per expert launch: layer 0's one expert is
    launched 20 us after its routing point, long before its copy lands (c = 43 us); layer 1
    launches nothing, so the pass lasts a + c + f + a as without a host (a launch charged for
    layer 1's empty set would end the pass 20 us later)."""
    from moesim.simulator.engine import Simulation

    register_none_at_layer_1(monkeypatch)
    model = small_model(layers=2, experts=4, top_k=1)
    t = trace_from_array(model, np.array([[[[0], [1]]]]), prompt_tokens=1)
    sim = Simulation(scenario(cache={"capacity": "inf"}, expert_compute=mode, policies={"budget": "none-at-1"},
                              execution={"host_launch_us": 20, "host_sync": "layer"}), trace=t)
    res = sim.run()
    ffn, nonexp, copy = datasheet_times(model, sim.wl)
    assert copy > 20 * US
    assert res.summary["total_time_s"] == pytest.approx(2 * nonexp[0] + copy + ffn[0], rel=1e-9)


def test_an_expert_that_starts_at_once_is_launched_without_a_wait_for_its_landed_copy(monkeypatch):
    """Pipelined per-expert execution with a host ahead of the GPU: when expert i ends and
    i + 1 has landed, i + 1 starts at once and the host's launch of it does not wait for its
    copy (the host is not blocking). A case found by mutation testing (the launch made as a
    blocking one moves a pass by 89 ns on the SimPy path only): both paths agree on it."""
    model = small_model(2, 7, 4)
    trace = generate(model, requests=1, prompt_tokens=0, tokens=8, seed=0)
    sc = scenario(cache={"capacity": experts_cap(9, model)}, expert_compute="per-expert", expert_fetch="pipelined",
                  policies={"prefetch": "oracle", "eviction": "lru"},
                  execution={"host_launch_us": 4.0, "host_copy_us": 0.0})
    a = simulate(sc, trace=trace)
    monkeypatch.setenv("MOESIM_NO_KERNEL", "1")
    b = simulate(sc, trace=trace)
    assert (a.summary["replay_path"], b.summary["replay_path"]) == ("kernel", "simpy")
    np.testing.assert_array_equal(a.steps["duration_s"].to_numpy(), b.steps["duration_s"].to_numpy())


@pytest.mark.parametrize("path", ["kernel", "simpy"])
def test_a_host_slow_to_submit_copies_sets_the_pace(path, monkeypatch):
    """Per-expert pipelined execution, every expert missing, a host that takes 200 us to submit
    a copy and nothing else (c = 43 us, so the host is the bottleneck). Layer 0: expert 0's copy
    goes out at the routing point, the host done submitting at 200 us; expert 0 starts then
    (its launch costs nothing), expert 1 is looked up and its submission ends at 400 us, when it
    starts; layer 1's copies end their submissions at 600 and 800 us. Pass: 4 * 200 us + f."""
    _, _, f, c = two_layer_case("none", path, monkeypatch)
    assert c < 200 * US
    sc = scenario(cache={"capacity": "0 experts"}, expert_compute="per-expert", execution={"host_copy_us": 200})
    model = small_model(layers=2, experts=4, top_k=2)
    slow = simulate(sc, trace=trace_from_array(model, np.array([[[[0, 1], [2, 3]]]])))
    assert slow.summary["replay_path"] == path
    assert slow.steps["duration_s"].iloc[0] == pytest.approx(4 * 200 * US + f, rel=1e-12)

"""Eviction policies written as hooks (:mod:`moesim.policies.hooks`): one definition that the
SimPy path calls as plain Python and the kernel calls compiled.

References, independent of the hook machinery: the built-in policies whose decisions a hook
policy restates (LFU's counts, FLD's layer distance, score's gate weights: each built-in has
its own SimPy class), and the README's former MRU plugin (an ``OrderedDict``). Each hook
policy must give the built-in's per-pass rows bit for bit on both replay paths."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numba
import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moesim.policies import prefetch as prefetch_family
from moesim.policies.eviction import REGISTRY, EvictionPolicy
from moesim.policies.hooks import (
    CLOCK_KEYS_PER_LAYER,
    CLOCK_LAYER,
    CLOCK_TICK,
    INFO_EXPERTS,
    INFO_LAYERS,
    INFO_PRECISION,
    INFO_PRECISIONS,
    T_EXPERT,
    T_GROUP,
    T_INFO,
    T_OFF,
    T_PRED,
    T_ROW_OFF,
    T_ROW_ORDER,
    HookEviction,
    HookPrefetch,
)
from moesim.simulator.engine import Simulation
from moesim.traces.synth import synth_from_preset
from tests.helpers import registered, scenario, unwrap


class HookLFU(HookEviction):
    """LFU as hooks: a count per key that survives eviction (a key's priority is its own count,
    so it is kept between victim searches)."""

    int_fields = ("count",)
    stable_priority = True

    @staticmethod
    def insert(key, demand, weight, clock, si, sf):
        if demand:
            si[key, 0] += 1

    @staticmethod
    def access(key, weight, clock, si, sf):
        si[key, 0] += 1

    @staticmethod
    def priority(key, clock, si, sf):
        return float(si[key, 0])


class AskedLFU(HookLFU):
    """The same LFU, its priority asked of every candidate at every victim search."""

    stable_priority = False


class HookFLD(HookEviction):
    """Farthest layer distance as hooks: ties by the stamp, i.e. least recent use."""

    @staticmethod
    def priority(key, clock, si, sf):
        return -float(abs(key // clock[CLOCK_KEYS_PER_LAYER] - clock[CLOCK_LAYER]))


class KeptFLD(HookFLD):
    """FLD with its priority declared stable, wrongly (it reads the clock's layer): kept from
    each key's last insert or use."""

    stable_priority = True


class HookScore(HookEviction):
    """Score eviction (no decay) as hooks: the gate weight summed over uses."""

    float_fields = ("score",)

    @staticmethod
    def insert(key, demand, weight, clock, si, sf):
        sf[key, 0] += weight

    @staticmethod
    def access(key, weight, clock, si, sf):
        sf[key, 0] += weight

    @staticmethod
    def priority(key, clock, si, sf):
        return sf[key, 0]


class HookMRU(HookEviction):
    """Most recently used first: the README's example."""

    int_fields = ("last_use",)

    @staticmethod
    def insert(key, demand, weight, clock, si, sf):
        si[key, 0] = clock[CLOCK_TICK]

    @staticmethod
    def access(key, weight, clock, si, sf):
        si[key, 0] = clock[CLOCK_TICK]

    @staticmethod
    def priority(key, clock, si, sf):
        return -float(si[key, 0])


class DictMRU(EvictionPolicy):
    """The README's MRU plugin before hooks, an independent reference (SimPy path only)."""

    def __init__(self, params: Any, ctx: Any) -> None:
        super().__init__(params, ctx)
        self.order: OrderedDict[int, None] = OrderedDict()

    def on_insert(self, key: int, demand: bool) -> None:
        self.order[key] = None

    def on_access(self, key: int) -> None:
        self.order.move_to_end(key)

    def on_remove(self, key: int) -> None:
        del self.order[key]

    def candidates(self) -> Iterator[int]:
        return reversed(self.order)


class Mixed(HookEviction):
    """Every hook and both state arrays: uses, gate mass and removals mixed into one priority
    (for the property test; not a sensible policy)."""

    int_fields = ("uses", "removed", "tick")
    float_fields = ("mass",)

    @staticmethod
    def insert(key, demand, weight, clock, si, sf):
        si[key, 0] += 2 if demand else 1
        sf[key, 0] += weight
        si[key, 2] = clock[CLOCK_TICK]

    @staticmethod
    def access(key, weight, clock, si, sf):
        si[key, 0] += 1
        sf[key, 0] = 0.5 * sf[key, 0] + weight
        si[key, 2] = clock[CLOCK_TICK]

    @staticmethod
    def remove(key, clock, si, sf):
        si[key, 1] += 1

    @staticmethod
    def priority(key, clock, si, sf):
        return float((si[key, 0] + 3 * si[key, 1]) % 5) + sf[key, 0]


class KeptMixed(Mixed):
    stable_priority = True


class NotNumeric(HookEviction):
    """A priority numba cannot compile (a Python dict)."""

    @staticmethod
    def priority(key, clock, si, sf):
        return float({"a": key}.get("a", 0))


@numba.njit
def next_layer_keys(p, layer, trace, out):
    """The keys of the experts that layer ``layer + 1`` of pass ``p`` uses, in access order (a
    helper a hook calls: it is compiled too)."""
    info = trace[T_INFO]
    num_l, num_e = info[INFO_LAYERS], info[INFO_EXPERTS]
    if layer + 1 >= num_l:
        return 0
    off, b = trace[T_OFF], p * num_l + layer + 1
    for j in range(off[b], off[b + 1]):
        out[j - off[b]] = ((layer + 1) * num_e + trace[T_EXPERT][j]) * info[INFO_PRECISIONS] + info[INFO_PRECISION]
    return off[b + 1] - off[b]


class HookOracle(HookPrefetch):
    """The true experts of the next layer, in access order (the built-in ``oracle``)."""

    @staticmethod
    def select(p, layer, trace, out):
        return next_layer_keys(p, layer, trace, out)


class HookPreviousToken(HookPrefetch):
    """The next layer's experts of the previous token of the same batch (the built-in
    ``previous-token``)."""

    @staticmethod
    def select(p, layer, trace, out):
        group = trace[T_GROUP]
        if p == 0 or group[p - 1] != group[p]:
            return 0
        return next_layer_keys(p - 1, layer, trace, out)


class PredictedTop(HookPrefetch):
    """The 3 experts of the next layer with the largest predicted probability for the pass's
    first token (reads the predictions; for the property test)."""

    @staticmethod
    def select(p, layer, trace, out):
        info = trace[T_INFO]
        num_l, num_e = info[INFO_LAYERS], info[INFO_EXPERTS]
        r0, r1 = trace[T_ROW_OFF][p * num_l + layer], trace[T_ROW_OFF][p * num_l + layer + 1]
        if layer + 1 >= num_l or r0 == r1:
            return 0
        pred = trace[T_PRED][trace[T_ROW_ORDER][r0]]
        n = 0
        for _ in range(3):
            best = -1
            for e in range(num_e):
                taken = False
                for j in range(n):
                    taken = taken or out[j] == ((layer + 1) * num_e + e) * info[INFO_PRECISIONS] + info[INFO_PRECISION]
                if not taken and (best == -1 or pred[e] > pred[best]):
                    best = e
            out[n] = ((layer + 1) * num_e + best) * info[INFO_PRECISIONS] + info[INFO_PRECISION]
            n += 1
        return n


class NextLayer(HookPrefetch):
    """Every expert of the next layer, the last first: more keys than the proposals' first
    allocation holds (``top_k`` a (pass, layer)), so it grows."""

    @staticmethod
    def select(p, layer, trace, out):
        info = trace[T_INFO]
        num_l, num_e = info[INFO_LAYERS], info[INFO_EXPERTS]
        if layer + 1 >= num_l:
            return 0
        for e in range(num_e):
            out[e] = ((layer + 1) * num_e + num_e - 1 - e) * info[INFO_PRECISIONS] + info[INFO_PRECISION]
        return num_e


class OutOfRange(HookPrefetch):
    """Proposes a key that is not one (at pass 3, layer 1): -5, or the number of keys."""

    @staticmethod
    def select(p, layer, trace, out):
        if p == 3 and layer == 1:
            out[0] = -5
            return 1
        return 0


class OneTooFar(HookPrefetch):
    @staticmethod
    def select(p, layer, trace, out):
        if p == 3 and layer == 1:
            out[0] = out.shape[0]
            return 1
        return 0


class TooMany(HookPrefetch):
    @staticmethod
    def select(p, layer, trace, out):
        return out.shape[0] + 1 if p == 3 and layer == 1 else 0


class NotNumericSelect(HookPrefetch):
    """The oracle, with a Python object numba cannot type."""

    @staticmethod
    def select(p, layer, trace, out):
        return next_layer_keys(p, layer, trace, out) + 0 * len(object().__class__.__name__)


PREFETCHERS = {"hook-oracle": HookOracle, "hook-previous-token": HookPreviousToken, "predicted-top": PredictedTop,
               "out-of-range": OutOfRange, "one-too-far": OneTooFar, "too-many": TooMany,
               "not-numeric-select": NotNumericSelect, "next-layer": NextLayer}
HOOKED = {"hook-lfu": HookLFU, "asked-lfu": AskedLFU, "hook-fld": HookFLD, "kept-fld": KeptFLD, "kept-mixed": KeptMixed, "hook-score": HookScore, "hook-mru": HookMRU,
          "dict-mru": DictMRU, "hook-mixed": Mixed, "not-numeric": NotNumeric}


@pytest.fixture(scope="module", autouse=True)
def _registered():
    with registered(REGISTRY, HOOKED), registered(prefetch_family.REGISTRY, PREFETCHERS):
        yield


@pytest.fixture(scope="module")
def olmoe():
    """An OLMoE-shaped trace (16 layers, 64 experts, top-8) with next-layer predictions and
    router probabilities."""
    return synth_from_preset("olmoe-1b-7b", requests=4, prompt_tokens=8, tokens=16, seed=5, pred_next=True,
                             probs=True)


def run(sc: Any, trace: Any, monkeypatch: pytest.MonkeyPatch, simpy: bool) -> Any:
    if simpy:
        monkeypatch.setenv("MOESIM_NO_KERNEL", "1")
    else:
        monkeypatch.delenv("MOESIM_NO_KERNEL", raising=False)
    result = Simulation(sc, trace=trace).run()
    monkeypatch.delenv("MOESIM_NO_KERNEL", raising=False)
    assert result.summary["replay_path"] == ("simpy" if simpy else "kernel"), result.summary["replay_path_reason"]
    return result


def same_rows(a: Any, b: Any) -> None:
    pd.testing.assert_frame_equal(a.steps, b.steps, check_exact=True)
    pd.testing.assert_frame_equal(a.requests, b.requests, check_exact=True)


@pytest.mark.parametrize(("hooked", "builtin"), [("hook-lfu", "lfu"), ("asked-lfu", "lfu"), ("hook-fld", "fld"),
                                                 ("hook-score", "score")])
@pytest.mark.parametrize(("prefetch", "mode"), [("none", "layer"), ("oracle", "per-expert"),
                                                ("score-percentile", "on-arrival"), ("static-pin", "layer"),
                                                ("lookahead", "per-expert")])
def test_a_hook_policy_gives_the_builtin_rows_on_both_paths(olmoe, monkeypatch, hooked, builtin, prefetch, mode):
    """The built-in's SimPy class is the reference; the hook policy on the kernel and on the
    SimPy path give its per-pass and per-request rows exactly."""
    def sc(ev: str) -> Any:
        return scenario(policies={"eviction": ev, "prefetch": prefetch}, expert_compute=mode,
                        cache={"capacity": "12%"}, workload={"batch_size": 2})

    ref = run(sc(builtin), olmoe, monkeypatch, simpy=True)
    assert ref.summary["misses"] > 0
    assert ref.summary["hits"] > 0
    same_rows(run(sc(hooked), olmoe, monkeypatch, simpy=False), ref)
    same_rows(run(sc(hooked), olmoe, monkeypatch, simpy=True), ref)


@pytest.mark.parametrize("miss", ["drop", "substitute", "speculative", "fetch-lowest-bit"])
def test_the_gate_weight_a_hook_sees_under_a_per_token_miss_policy(olmoe, monkeypatch, miss):
    """A per-token miss policy runs experts the layer did not route (their weight is 0) and
    caches other precisions; the weights handed to the hooks are the built-in score's."""
    policy: Any = {"name": miss, "precisions": ["bf16", "int4"]} if miss == "fetch-lowest-bit" else miss

    def sc(ev: str) -> Any:
        return scenario(policies={"prefetch": "next-gate-topk", "miss": policy, "eviction": ev},
                        cache={"capacity": "8%"})

    ref = run(sc("score"), olmoe, monkeypatch, simpy=True)
    same_rows(run(sc("hook-score"), olmoe, monkeypatch, simpy=False), ref)
    same_rows(run(sc("hook-score"), olmoe, monkeypatch, simpy=True), ref)


def test_the_readme_mru_as_hooks_is_the_ordered_dict_mru(olmoe, monkeypatch):
    """``clock[CLOCK_TICK]`` stamps each insert and use in order: the most recent one is the
    last of an ``OrderedDict`` kept in use order."""
    def sc(ev: str) -> Any:
        return scenario(policies={"eviction": ev, "prefetch": "previous-token"}, cache={"capacity": "5%"})

    ref = run(sc("dict-mru"), olmoe, monkeypatch, simpy=True)
    lru = run(sc("lru"), olmoe, monkeypatch, simpy=True)
    assert ref.summary["misses"] != lru.summary["misses"]  # a different policy shows
    same_rows(run(sc("hook-mru"), olmoe, monkeypatch, simpy=False), ref)
    same_rows(run(sc("hook-mru"), olmoe, monkeypatch, simpy=True), ref)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cap=st.integers(2, 40), mode=st.sampled_from(["layer", "on-arrival", "per-expert"]),
       prefetch=st.sampled_from(["none", "oracle", "previous-token", "next-gate-topk"]),
       miss=st.sampled_from(["fetch", "drop", "speculative"]), timing=st.booleans(),
       policy=st.sampled_from(["hook-mixed", "kept-mixed"]))
def test_every_hook_on_the_kernel_equals_its_simpy_run(olmoe, monkeypatch, cap, mode, prefetch, miss, timing, policy):
    sc = scenario(policies={"eviction": policy, "prefetch": prefetch, "miss": miss}, expert_compute=mode,
                  timing=timing, cache={"capacity": f"{cap} experts"})
    same_rows(run(sc, olmoe, monkeypatch, simpy=False), run(sc, olmoe, monkeypatch, simpy=True))


def test_a_kept_priority_is_the_one_computed_after_the_keys_last_hook(olmoe, monkeypatch):
    """``stable_priority`` is honoured alike on both paths: an FLD that declares it (wrongly:
    its priority reads the clock) keeps each key's distance from its last insert or use, and
    no longer evicts as FLD does."""
    def sc(ev: str) -> Any:
        return scenario(policies={"eviction": ev}, cache={"capacity": "12%"})

    kept = run(sc("kept-fld"), olmoe, monkeypatch, simpy=True)
    assert kept.summary["misses"] != run(sc("fld"), olmoe, monkeypatch, simpy=True).summary["misses"]
    same_rows(run(sc("kept-fld"), olmoe, monkeypatch, simpy=False), kept)


@pytest.mark.parametrize("prefetch", ["none", "static-pin"])
def test_a_hook_state_after_the_replay_is_the_same_on_both_paths(olmoe, monkeypatch, prefetch):
    """Every hook's writes, the pinned experts' inserts before the replay among them (a
    prefetch's insert has no weight: on the SimPy path the first layer's pinned experts would
    otherwise get their first pass's)."""
    sc = scenario(policies={"eviction": "hook-mixed", "prefetch": prefetch}, cache={"capacity": "5%"})
    states = []
    for simpy in (False, True):
        monkeypatch.setenv("MOESIM_NO_KERNEL", "1" if simpy else "0")
        sim = Simulation(sc, trace=olmoe)
        sim.run()
        states.append((sim.eviction.si.copy(), sim.eviction.sf.copy()))
    assert states[0][0].any()
    assert states[0][1].any()
    assert (states[0][0] == states[1][0]).all()
    assert (states[0][1] == states[1][1]).all()


@pytest.mark.parametrize(("family", "name", "hook"), [("eviction", "not-numeric", "priority"),
                                                    ("prefetch", "not-numeric-select", "select")])
def test_hooks_that_do_not_compile_run_on_the_simpy_path_and_say_why(olmoe, monkeypatch, family, name, hook):
    monkeypatch.delenv("MOESIM_NO_KERNEL", raising=False)
    s = Simulation(scenario(policies={family: name}), trace=olmoe).run().summary
    assert s["replay_path"] == "simpy"
    assert s["replay_path_reason"].startswith(f"{family} policy '{name}': its {hook} hook does not compile with numba (")
    if family == "prefetch":
        assert s["prefetches_issued"] > 0


def test_a_plain_eviction_policy_still_runs_on_the_simpy_path(olmoe, monkeypatch):
    monkeypatch.delenv("MOESIM_NO_KERNEL", raising=False)
    s = Simulation(scenario(policies={"eviction": "dict-mru"}), trace=olmoe).run().summary
    assert (s["replay_path"], s["replay_path_reason"]) == ("simpy", "eviction policy 'dict-mru' has no kernel form")


def test_a_hook_policy_must_define_its_priority():
    from moesim.errors import MoesimError

    class NoPriority(HookEviction):
        @staticmethod
        def access(key, weight, clock, si, sf):
            pass

    with pytest.raises(MoesimError, match="does not define priority"):
        REGISTRY.register("no-priority")(NoPriority)


def test_hooks_run_as_plain_python_in_the_kernel_without_numba(tmp_path):
    """Under ``NUMBA_DISABLE_JIT=1`` the kernel's source and the hooks (eviction and
    prefetch) run as plain Python and give the compiled run's rows."""
    code = (
        "import sys; sys.path.insert(0, '.')\n"
        "from tests.test_hooks import HOOKED, PREFETCHERS\n"
        "from moesim.policies import eviction, prefetch\n"
        "eviction.REGISTRY.register('hook-mixed')(HOOKED['hook-mixed'])\n"
        "prefetch.REGISTRY.register('predicted-top')(PREFETCHERS['predicted-top'])\n"
        "from moesim.simulator.engine import Simulation\n"
        "from moesim.traces.synth import generate\n"
        "from tests.helpers import scenario, small_model\n"
        "tr = generate(small_model(3, 8, 2), requests=2, tokens=10, seed=2, pred_next=True)\n"
        "sc = scenario(policies={'eviction': 'hook-mixed', 'prefetch': 'predicted-top'}, cache={'capacity': '5 experts'})\n"
        "r = Simulation(sc, trace=tr).run()\n"
        "assert r.summary['replay_path'] == 'kernel', r.summary\n"
        "assert r.summary['prefetches_issued'] > 0, r.summary\n"
        f"r.steps.to_parquet({str(tmp_path / '{}.parquet')!r}.format(sys.argv[1]))\n")
    import os

    for name, off in (("plain", "1"), ("compiled", "0")):
        env = {**os.environ, "NUMBA_DISABLE_JIT": off}
        subprocess.run([sys.executable, "-c", code, name], check=True, env=env, cwd=os.getcwd())
    a, b = (pd.read_parquet(tmp_path / f"{n}.parquet") for n in ("plain", "compiled"))
    assert a["misses"].sum() > 0
    pd.testing.assert_frame_equal(a, b, check_exact=True)


def test_moesim_run_says_in_a_line_why_a_plugin_runs_on_the_simpy_path(tmp_path, monkeypatch):
    plugin = tmp_path / "slow.py"
    plugin.write_text(
        "from moesim.policies.eviction import REGISTRY\n"
        "from moesim.policies.hooks import HookEviction\n\n\n"
        "@REGISTRY.register('by-name')\n"
        "class ByName(HookEviction):\n"
        "    @staticmethod\n"
        "    def priority(key, clock, si, sf): return float({'a': key}.get('a', 0))\n")
    monkeypatch.delenv("MOESIM_NO_KERNEL", raising=False)
    r = subprocess.run([sys.executable, "-m", "moesim", "run", "quickstart", "--plugin", str(plugin), "--set",
                        "policies.eviction=by-name", "--set", "workload.trace.synth.tokens=8", "--no-write", "--json"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    note = [ln for ln in unwrap(r.stderr).splitlines() if ln.startswith("note: replayed on the SimPy path")]
    assert len(note) == 1, r.stderr
    assert "eviction policy 'by-name': its priority hook does not compile with numba (" in note[0]
    assert json.loads(r.stdout)["replay_path"] == "simpy"
    r = subprocess.run([sys.executable, "-m", "moesim", "run", "quickstart", "--set", "workload.trace.synth.tokens=8",
                        "--no-write", "--json"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert "SimPy path" not in r.stderr  # the kernel ran: nothing to say


@pytest.mark.parametrize(("hooked", "builtin"), [("hook-oracle", "oracle"), ("hook-previous-token", "previous-token")])
@pytest.mark.parametrize(("eviction", "mode", "timing"), [("lru", "layer", True), ("least-stale", "per-expert", True),
                                                          ("lfu", "on-arrival", False), ("hook-lfu", "layer", True)])
def test_a_prefetch_hook_gives_the_builtin_rows_on_both_paths(olmoe, monkeypatch, hooked, builtin, eviction, mode,
                                                              timing):
    def sc(pf: str) -> Any:
        return scenario(policies={"eviction": eviction, "prefetch": pf}, expert_compute=mode, timing=timing,
                        cache={"capacity": "10%"}, workload={"batch_size": 2})

    ref = run(sc(builtin), olmoe, monkeypatch, simpy=True)
    assert ref.summary["prefetches_issued"] > 0
    same_rows(run(sc(hooked), olmoe, monkeypatch, simpy=False), ref)
    same_rows(run(sc(hooked), olmoe, monkeypatch, simpy=True), ref)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cap=st.integers(2, 60), mode=st.sampled_from(["layer", "on-arrival", "per-expert"]),
       eviction=st.sampled_from(["lru", "least-stale", "score"]), batch=st.sampled_from([1, 3]),
       prefetch=st.sampled_from(["predicted-top", "next-layer"]))
def test_a_prefetch_hook_on_the_kernel_equals_its_simpy_run(olmoe, monkeypatch, cap, mode, eviction, batch, prefetch):
    sc = scenario(policies={"eviction": eviction, "prefetch": prefetch}, expert_compute=mode,
                  cache={"capacity": f"{cap} experts"}, workload={"batch_size": batch})
    fast = run(sc, olmoe, monkeypatch, simpy=False)
    assert fast.summary["prefetches_issued"] > 0
    same_rows(fast, run(sc, olmoe, monkeypatch, simpy=True))


@pytest.mark.parametrize("simpy", [False, True])
@pytest.mark.parametrize(("policy", "says"), [
    ("out-of-range", r"proposed -5, not a cache key \(0 to 4095\); a key is \(layer \* experts"),
    ("one-too-far", r"proposed 4096, not a cache key \(0 to 4095\)"),
    ("too-many", r"returned 4097, not a number of keys from 0 to 4096"),
])
def test_a_prefetch_hook_that_proposes_no_key_is_named_in_one_paragraph(olmoe, monkeypatch, simpy, policy, says):
    from moesim.errors import MoesimError

    sc = scenario(policies={"prefetch": policy})
    monkeypatch.setenv("MOESIM_NO_KERNEL", "1" if simpy else "0")
    with pytest.raises(MoesimError, match=rf"prefetch policy '{policy}': select\(p=3, layer=1, \.\.\.\) {says}"):
        Simulation(sc, trace=olmoe).run()


@pytest.mark.parametrize(("policy", "chunk"), [("hook-mixed", 300), ("hook-lfu", 384), ("kept-mixed", 200)])
def test_a_hook_policy_replays_a_trace_file_in_pieces_as_it_replays_it_whole(olmoe, tmp_path, monkeypatch, policy,
                                                                             chunk):
    """A compiled hook policy reads no trace of its own, so a trace file goes through the
    kernel a piece at a time (bounded memory), with the whole trace's rows and summary."""
    from moesim.config.scenario import load_scenario
    from moesim.simulator import kernel
    from moesim.traces.io import write_trace

    monkeypatch.delenv("MOESIM_NO_KERNEL", raising=False)
    monkeypatch.setattr(kernel, "BLOCK_PASSES", 40)  # rows handed over (and spooled) in blocks too
    path = write_trace(olmoe, tmp_path / "olmoe.parquet")
    sc = load_scenario("quickstart", [f"workload.trace.path={path}", f"policies.eviction={policy}",
                                      "workload.batch_size=1", "cache.capacity=5%"])
    whole = Simulation(sc, trace=olmoe).run()
    sim = Simulation(sc, chunk_rows=chunk)
    assert sim.source.pieces is not None, sim.source.whole_reason
    res = sim.run()
    assert res.summary["trace_pieces"] >= 3
    same_rows(res, whole)
    assert {k: v for k, v in res.summary.items() if k not in ("wall_s", "trace_pieces")} == {
        k: v for k, v in whole.summary.items() if k not in ("wall_s", "trace_pieces")}
    s = Simulation(load_scenario("quickstart", [f"workload.trace.path={path}", "policies.eviction=not-numeric"]),
                   chunk_rows=chunk)
    assert s.source.pieces is None
    assert s.source.whole_reason == "eviction policy 'not-numeric' reads the whole trace"


class PastItsColumns(HookEviction):
    """Writes a column its state does not have (one int field), on the third use of a key."""

    int_fields = ("uses",)

    @staticmethod
    def access(key, weight, clock, si, sf):
        si[key, 0] += 1
        if si[key, 0] == 3:
            si[key, 1] = 1

    @staticmethod
    def priority(key, clock, si, sf):
        return float(si[key, 0])


class PastItsOut(HookPrefetch):
    @staticmethod
    def select(p, layer, trace, out):
        if p == 2 and layer == 3:
            out[out.shape[0]] = 0
        return 0


@pytest.mark.parametrize("simpy", [False, True])
@pytest.mark.parametrize(("family", "name", "cls", "hook"), [("eviction", "past-its-columns", PastItsColumns, "access"),
                                                             ("prefetch", "past-its-out", PastItsOut, "select")])
def test_a_hook_that_indexes_past_its_arrays_is_one_paragraph(olmoe, monkeypatch, simpy, family, name, cls, hook):
    """Compiled hooks check their indices: an index out of range stops the replay with one
    paragraph naming the policy (and on the SimPy path the hook, pass and layer), never a
    write past the arrays."""
    from moesim.errors import MoesimError

    registry = REGISTRY if family == "eviction" else prefetch_family.REGISTRY
    monkeypatch.setitem(registry._classes, name, cls)
    cls.name = name
    monkeypatch.setenv("MOESIM_NO_KERNEL", "1" if simpy else "0")
    with pytest.raises(MoesimError) as err:
        Simulation(scenario(policies={family: name}, cache={"capacity": "20%"}), trace=olmoe).run()
    msg = str(err.value)
    assert f"{family} policy '{name}'" in msg
    assert "IndexError" in msg
    if simpy:
        assert f"its {hook} hook raised IndexError" in msg
        assert "forward pass" in msg
    else:
        assert "Run it with MOESIM_NO_KERNEL=1" in msg


@dataclass(frozen=True)
class ShareParams:
    """The share of a use's gate weight that a key keeps."""

    share: float = field(default=1.0, metadata={"help": "the share of each use's gate weight a key keeps"})


class SharedScore(HookEviction):
    """Score eviction with a parameter: each use adds ``share`` times its weight (column 1 of
    ``sf`` holds the share, filled from the parameters before the replay)."""

    Params = ShareParams
    float_fields = ("score", "share")

    def init_state(self):
        self.sf[:, 1] = self.params.share

    @staticmethod
    def insert(key, demand, weight, clock, si, sf):
        sf[key, 0] += sf[key, 1] * weight

    @staticmethod
    def access(key, weight, clock, si, sf):
        sf[key, 0] += sf[key, 1] * weight

    @staticmethod
    def priority(key, clock, si, sf):
        return sf[key, 0]


@pytest.mark.parametrize("share", [1.0, 0.5, 0.0])
def test_a_hook_policy_takes_its_parameters_from_the_scenario(olmoe, monkeypatch, share):
    """A share of 1 (or 0.5: halving every score keeps their order, exactly, in binary) is the
    built-in score; a share of 0 gives every key the same score, so the victim is the key used
    longest ago: LRU. Both paths, the parameter given in the scenario as a built-in's is."""
    monkeypatch.setitem(REGISTRY._classes, "shared-score", SharedScore)
    SharedScore.name = "shared-score"
    reference = {1.0: "score", 0.5: "score", 0.0: "lru"}[share]

    def sc(ev: Any) -> Any:
        return scenario(policies={"eviction": ev, "prefetch": "previous-token"}, cache={"capacity": "8%"})

    ref = run(sc(reference), olmoe, monkeypatch, simpy=True)
    ours = {"name": "shared-score", "share": share}
    same_rows(run(sc(ours), olmoe, monkeypatch, simpy=False), ref)
    same_rows(run(sc(ours), olmoe, monkeypatch, simpy=True), ref)


@pytest.mark.parametrize("prefetch", ["predicted-top", "past-its-out"])
def test_a_replay_leaves_no_arrays_with_the_compiled_loops(olmoe, monkeypatch, prefetch):
    """The compiled loops keep their tuple arguments' types with the tuples during a replay (the
    kernel's arrays, a prefetch hook's view of the trace); a replay lets them go when it ends,
    or fails."""
    from moesim import jit
    from moesim.errors import MoesimError

    monkeypatch.setitem(prefetch_family.REGISTRY._classes, "past-its-out", PastItsOut)
    PastItsOut.name = "past-its-out"
    monkeypatch.delenv("MOESIM_NO_KERNEL", raising=False)
    sim = Simulation(scenario(policies={"prefetch": prefetch}), trace=olmoe)
    if prefetch == "past-its-out":
        with pytest.raises(MoesimError):
            sim.run()
    else:
        assert sim.run().summary["replay_path"] == "kernel"
    assert not [d for d in jit._KEEPING if d._tuples or d._large]
    from moesim.policies.hooks import _drive
    from moesim.simulator.kernel import replay_passes

    assert replay_passes._tuples is None
    assert _drive._tuples is None


@pytest.mark.parametrize(("hooked", "builtin", "mode", "prefetch"), [
    ("hook-lfu", "lfu", "layer", "oracle"), ("asked-lfu", "lfu", "per-expert", "score-percentile"),
    ("hook-fld", "fld", "on-arrival", "none")])
def test_a_compiled_hook_policy_serves_under_load_as_the_builtin_it_mirrors(hooked, builtin, mode, prefetch,
                                                                             monkeypatch):
    """Serving under load forms each forward pass when the one before ends and replays it on
    the kernel; a compiled hook policy goes through it (as through a trace read in pieces) and
    gives the built-in's per-pass and per-request rows, queueing included, bit for bit. A hook
    policy numba cannot compile serves on the SimPy path, which says why."""
    from moesim.config.scenario import scenario_from_dict

    monkeypatch.delenv("MOESIM_NO_KERNEL", raising=False)

    def served(ev: str) -> Any:
        data = {"seed": 0, "expert_compute": mode, "cache": {"capacity": "40%"},
                "policies": {"eviction": ev, "prefetch": prefetch},
                "workload": {"trace": {"synth": {"preset": "olmoe-1b-7b", "requests": 6, "prompt_tokens": 16,
                                                 "tokens": 6, "layers": 4, "pred_next": True}},
                             "arrivals": {"process": "gamma", "rate": 2.0, "cv": 3.0, "requests": 14}},
                "scheduler": {"max_running": 4, "max_batched_tokens": 40, "policy": "sarathi",
                              "chunked_prefill_tokens": 12}}
        return Simulation(scenario_from_dict(data)).run()

    ref = served(builtin)
    assert ref.summary["replay_path"] == "kernel"
    assert ref.summary["hits"] > 0
    assert ref.summary["misses"] > 0
    assert (ref.requests["queue_s"] > 0).any()
    same_rows(served(hooked), ref)
    plain = served("not-numeric").summary
    assert plain["replay_path"] == "simpy"
    assert plain["replay_path_reason"].startswith("eviction policy 'not-numeric': its priority hook does not compile")
    assert plain["served_requests"] == 14


def test_the_compiled_loops_keep_small_tuples_types_but_not_a_pieces_arrays(monkeypatch):
    """A tuple argument's type is kept with the tuple (typing the hooks again cost a third of an
    LRU replay); a tuple whose arrays hold more than ``_KEEP_BYTES`` (a piece's per-access arrays)
    is kept alone, until the next such tuple or ``forget_large_tuples`` (a replay calls it as a
    piece ends), so that the pieces replayed do not stay in memory (issue 34: keeping the last 16
    raised LRU's peak on the 25.6 M-access trace by 250 MB) and a piece's calls do not type it
    each time (0.18 s of an LRU replay's 1.4 s)."""
    from moesim import jit
    from moesim.simulator.kernel import replay_passes

    if not isinstance(replay_passes, getattr(jit, "_PlainTypes", ())):
        pytest.skip("numba is not compiling here")
    from numba.core import types

    small = (np.zeros(10), np.zeros(3, np.int64))
    big = (np.zeros(jit._KEEP_BYTES // 8 + 1), np.zeros(3, np.int64))
    try:
        assert str(replay_passes.typeof_pyval(small)) == "Tuple(array(float64, 1d, C), array(int64, 1d, C))"
        typed = replay_passes.typeof_pyval(big)
        kept = [v for v, _ in replay_passes._tuples.values()]
        assert any(v is small for v in kept)
        assert not any(v is big for v in kept)
        assert replay_passes._large[0] is big
        made: list[int] = []
        from_types = types.BaseTuple.from_types
        monkeypatch.setattr(types.BaseTuple, "from_types",
                            classmethod(lambda cls, tys, pyclass=None: made.append(1) or from_types(tys, pyclass)))
        assert replay_passes.typeof_pyval(big) is typed  # kept: not typed again
        assert not made
        other = (np.zeros(jit._KEEP_BYTES // 8 + 1), np.zeros(3, np.int64))
        assert replay_passes.typeof_pyval(other) == typed  # another piece's: typed, and kept alone
        assert replay_passes._large[0] is other
        assert not any(v is big for v in [v for v, _ in replay_passes._tuples.values()])
        jit.forget_large_tuples()
        assert replay_passes._large is None
        assert any(v is small for v, _ in replay_passes._tuples.values())  # the small ones stay
    finally:
        jit.forget_tuples()
    assert replay_passes._large is None

"""Miss policies written as a hook (:mod:`moesim.policies.miss.hooked`): one ``choose`` that the
SimPy path calls as plain Python and the kernel calls compiled.

References, independent of the hook machinery: the built-in ``drop`` (its own SimPy class) and
miss policies written plainly against :class:`MissPolicy` (``MissInfo`` in, ``MissDecision``
out; a dict for their state), which run on the SimPy path only. Each hook policy must give its
reference's per-pass rows bit for bit on both replay paths."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moesim.errors import MoesimError
from moesim.policies.miss import REGISTRY, MissDecision, MissInfo, MissPolicy
from moesim.policies.miss.hooked import DROP, FETCH, HookMiss
from moesim.simulator.engine import Simulation
from moesim.traces.synth import synth_from_preset
from tests.helpers import registered, scenario


class HookDrop(HookMiss):
    """``drop`` with rank 2, as a hook."""

    @staticmethod
    def choose(p, layer, expert, rank, cached, routed, si, sf):
        return DROP if rank >= 2 else FETCH


class LowestCached(HookMiss):
    """Substitute the lowest-id expert of the layer that is cached and not routed; fetch when
    there is none."""

    @staticmethod
    def choose(p, layer, expert, rank, cached, routed, si, sf):
        for e in range(cached.shape[0]):
            if cached[e] and not routed[e]:
                return e
        return FETCH


class PlainLowestCached(MissPolicy):
    """LowestCached's reference, written against the family's base."""

    def decide(self, info: MissInfo) -> MissDecision:
        for e in range(self.ctx.num_experts):
            if e not in info.routed and info.cached(self.ctx.key(info.layer, e)):
                return MissDecision("substitute", substitute=e)
        return MissDecision("fetch")


class ThirdMissDrops(HookMiss):
    """Counts each expert's misses (``si[layer * experts + expert, 0]``, the number of experts in
    ``sf[0, 0]`` from ``init_state``) and drops an expert of rank 1 or more from its third
    miss on; fetches otherwise."""

    int_fields = ("misses",)
    float_fields = ("experts",)

    def init_state(self) -> None:
        self.sf[0, 0] = self.ctx.num_experts

    @staticmethod
    def choose(p, layer, expert, rank, cached, routed, si, sf):
        row = layer * int(sf[0, 0]) + expert
        si[row, 0] += 1
        return DROP if si[row, 0] >= 3 and rank >= 1 else FETCH


class PlainThirdMissDrops(MissPolicy):
    """ThirdMissDrops' reference: a dict of counts."""

    def __init__(self, params: Any, ctx: Any) -> None:
        super().__init__(params, ctx)
        self.count: dict[tuple[int, int], int] = {}

    def decide(self, info: MissInfo) -> MissDecision:
        n = self.count[(info.layer, info.expert)] = self.count.get((info.layer, info.expert), 0) + 1
        return MissDecision("drop" if n >= 3 and info.rank >= 1 else "fetch")


ANSWERS = {"fetch": FETCH}  # a module's dict: numba compiles no code that reads it


class NotNumeric(HookMiss):
    @staticmethod
    def choose(p, layer, expert, rank, cached, routed, si, sf):
        return ANSWERS["fetch"]


class Itself(HookMiss):
    """Answers the missed expert itself: routed, so not a substitute."""

    @staticmethod
    def choose(p, layer, expert, rank, cached, routed, si, sf):
        return expert


class PastItsState(HookMiss):
    @staticmethod
    def choose(p, layer, expert, rank, cached, routed, si, sf):
        si[si.shape[0], 0] = 1
        return FETCH


class NotCached(HookMiss):
    """Answers the lowest-id expert that is neither cached nor routed (not a substitute)."""

    @staticmethod
    def choose(p, layer, expert, rank, cached, routed, si, sf):
        for e in range(cached.shape[0]):
            if not cached[e] and not routed[e]:
                return e
        return FETCH


class PastTheLayer(HookMiss):
    """Answers the number of experts: one past the layer's last."""

    @staticmethod
    def choose(p, layer, expert, rank, cached, routed, si, sf):
        return cached.shape[0]


SEEN: list[tuple[Any, ...]] = []  # what Seen's hook and PlainSeen's decide were handed


class Seen(LowestCached):
    """LowestCached, recording what its hook is handed (a module's list: the SimPy path)."""

    @staticmethod
    def choose(p, layer, expert, rank, cached, routed, si, sf):
        SEEN.append((p, layer, expert, rank, cached.dtype, routed.dtype, tuple(np.flatnonzero(cached)),
                     tuple(np.flatnonzero(routed))))
        return LowestCached.choose(p, layer, expert, rank, cached, routed, si, sf)


class PlainSeen(PlainLowestCached):
    def decide(self, info: MissInfo) -> MissDecision:
        cached = tuple(e for e in range(self.ctx.num_experts) if info.cached(self.ctx.key(info.layer, e)))
        SEEN.append((info.pass_index, info.layer, info.expert, info.rank, np.dtype(np.bool_), np.dtype(np.bool_),
                     cached, tuple(sorted(info.routed))))
        return super().decide(info)


@dataclass(frozen=True)
class AfterParams:
    after: int = 3


class DropsAfter(ThirdMissDrops):
    """ThirdMissDrops with the miss it drops from as a parameter, read into ``sf[:, 1]``."""

    Params = AfterParams
    float_fields = ("experts", "after")

    def init_state(self) -> None:
        super().init_state()
        self.sf[:, 1] = self.params.after

    @staticmethod
    def choose(p, layer, expert, rank, cached, routed, si, sf):
        row = layer * int(sf[0, 0]) + expert
        si[row, 0] += 1
        return DROP if si[row, 0] >= sf[0, 1] and rank >= 1 else FETCH


POLICIES = {"hook-drop": HookDrop, "lowest-cached": LowestCached, "plain-lowest-cached": PlainLowestCached,
            "third-miss-drops": ThirdMissDrops, "plain-third-miss-drops": PlainThirdMissDrops,
            "not-numeric-choose": NotNumeric, "itself": Itself, "past-its-state": PastItsState,
            "not-cached": NotCached, "past-the-layer": PastTheLayer, "seen": Seen, "plain-seen": PlainSeen,
            "drops-after": DropsAfter}


@pytest.fixture(scope="module", autouse=True)
def _registered():
    with registered(REGISTRY, POLICIES):
        yield


@pytest.fixture(scope="module")
def olmoe():
    """An OLMoE-shaped trace (16 layers, 64 experts, top-8) with next-layer predictions."""
    return synth_from_preset("olmoe-1b-7b", requests=4, prompt_tokens=8, tokens=16, seed=5, pred_next=True)


def run(sc: Any, trace: Any, monkeypatch: pytest.MonkeyPatch, simpy: bool) -> Any:
    monkeypatch.setenv("MOESIM_NO_KERNEL", "1" if simpy else "0")
    sim = Simulation(sc, trace=trace)
    result = sim.run()
    assert result.summary["replay_path"] == ("simpy" if simpy else "kernel"), result.summary["replay_path_reason"]
    result.policy = sim.miss
    return result


def same_rows(a: Any, b: Any) -> None:
    import pandas as pd

    pd.testing.assert_frame_equal(a.steps, b.steps, check_exact=True)
    pd.testing.assert_frame_equal(a.requests, b.requests, check_exact=True)


def reference(sc: Any, trace: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("MOESIM_NO_KERNEL", "0")
    result = Simulation(sc, trace=trace).run()
    assert result.summary["replay_path"] == "simpy"  # a plain policy: no kernel form
    return result


@pytest.mark.parametrize(("prefetch", "mode"), [("none", "layer"), ("oracle", "per-expert"),
                                                ("previous-token", "on-arrival"), ("static-pin", "layer")])
def test_a_drop_hook_gives_the_builtin_drop_rows_on_both_paths(olmoe, monkeypatch, prefetch, mode):
    def sc(miss: str) -> Any:
        return scenario(policies={"miss": miss, "prefetch": prefetch}, expert_compute=mode,
                        cache={"capacity": "10%"}, workload={"batch_size": 2})

    ref = run(sc("drop"), olmoe, monkeypatch, simpy=True)
    assert ref.steps["dropped_experts"].sum() > 0
    assert ref.summary["misses"] > 0
    same_rows(run(sc("hook-drop"), olmoe, monkeypatch, simpy=False), ref)
    same_rows(run(sc("hook-drop"), olmoe, monkeypatch, simpy=True), ref)


@pytest.mark.parametrize(("hooked", "plain", "column"), [("lowest-cached", "plain-lowest-cached", "substituted_experts"),
                                                         ("third-miss-drops", "plain-third-miss-drops", "dropped_experts")])
@pytest.mark.parametrize(("prefetch", "mode", "batch"), [("none", "layer", 1), ("oracle", "per-expert", 2),
                                                         ("previous-token", "on-arrival", 4)])
def test_a_miss_hook_gives_its_plain_references_rows_on_both_paths(olmoe, monkeypatch, hooked, plain, column,
                                                                   prefetch, mode, batch):
    def sc(miss: str) -> Any:
        return scenario(policies={"miss": miss, "prefetch": prefetch}, expert_compute=mode,
                        cache={"capacity": "25%"}, workload={"batch_size": batch})

    ref = reference(sc(plain), olmoe, monkeypatch)
    assert ref.steps[column].sum() > 0  # the policy's own action shows
    fetched = run(sc("fetch"), olmoe, monkeypatch, simpy=True)
    assert not ref.steps.equals(fetched.steps)
    same_rows(run(sc(hooked), olmoe, monkeypatch, simpy=False), ref)
    same_rows(run(sc(hooked), olmoe, monkeypatch, simpy=True), ref)


def test_a_miss_hooks_state_after_the_replay_is_the_same_on_both_paths(olmoe, monkeypatch):
    sc = scenario(policies={"miss": "third-miss-drops"}, cache={"capacity": "15%"})
    a = run(sc, olmoe, monkeypatch, simpy=False).policy
    b = run(sc, olmoe, monkeypatch, simpy=True).policy
    ref = Simulation(scenario(policies={"miss": "plain-third-miss-drops"}, cache={"capacity": "15%"}), trace=olmoe)
    ref.run()
    want = np.zeros_like(a.si)
    for (layer, e), n in ref.miss.count.items():
        want[layer * 64 + e, 0] = n
    assert want.sum() > 0
    assert (a.si == want).all()
    assert (b.si == want).all()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cap=st.integers(2, 60), mode=st.sampled_from(["layer", "on-arrival", "per-expert"]),
       prefetch=st.sampled_from(["none", "oracle", "previous-token", "next-gate-topk"]),
       eviction=st.sampled_from(["lru", "least-stale", "lfu", "belady"]), timing=st.booleans(),
       miss=st.sampled_from(["hook-drop", "lowest-cached", "third-miss-drops"]))
def test_a_miss_hook_on_the_kernel_equals_its_simpy_run(olmoe, monkeypatch, cap, mode, prefetch, eviction, timing,
                                                        miss):
    sc = scenario(policies={"eviction": eviction, "prefetch": prefetch, "miss": miss}, expert_compute=mode,
                  timing=timing, cache={"capacity": f"{cap} experts"})
    same_rows(run(sc, olmoe, monkeypatch, simpy=False), run(sc, olmoe, monkeypatch, simpy=True))


def test_a_miss_hook_that_does_not_compile_runs_on_the_simpy_path_and_says_why(olmoe, monkeypatch):
    monkeypatch.setenv("MOESIM_NO_KERNEL", "0")
    s = Simulation(scenario(policies={"miss": "not-numeric-choose"}), trace=olmoe).run().summary
    assert s["replay_path"] == "simpy"
    assert s["replay_path_reason"].startswith(
        "miss policy 'not-numeric-choose': its choose hook does not compile with numba (")


def test_a_plain_miss_policy_says_it_has_no_kernel_form(olmoe, monkeypatch):
    monkeypatch.setenv("MOESIM_NO_KERNEL", "0")
    s = Simulation(scenario(policies={"miss": "plain-lowest-cached"}), trace=olmoe).run().summary
    assert s["replay_path_reason"] == "miss policy 'plain-lowest-cached' has no kernel form"


@pytest.mark.parametrize("simpy", [False, True])
@pytest.mark.parametrize(("name", "says"), [("itself", "neither FETCH, DROP nor a cached expert"),
                                            ("not-cached", "neither FETCH, DROP nor a cached expert"),
                                            ("past-the-layer", "neither FETCH, DROP nor a cached expert"),
                                            ("past-its-state", "IndexError")])
def test_a_miss_hooks_bad_answer_or_index_is_one_paragraph(olmoe, monkeypatch, simpy, name, says):
    """An answer that is not FETCH, DROP or a cached expert not routed, or an index past the
    hook's state, stops the replay with one paragraph naming the policy (on the SimPy path the
    pass, layer and expert), never a wrong replay or a write past the arrays."""
    monkeypatch.setenv("MOESIM_NO_KERNEL", "1" if simpy else "0")
    with pytest.raises(MoesimError) as err:
        Simulation(scenario(policies={"miss": name}, cache={"capacity": "10%"}), trace=olmoe).run()
    msg = str(err.value)
    assert f"miss policy '{name}'" in msg
    assert "\n" not in msg
    if not simpy:
        assert says in msg
        assert "Run it with MOESIM_NO_KERNEL=1" in msg
    elif name == "past-its-state":
        assert re.search(r"its choose hook raised IndexError: .* \(forward pass \d+, layer \d+, expert \d+\)\. "
                         r"Fix the hook: ", msg), msg
    else:
        assert re.search(r"choose\(p=\d+, layer=\d+, expert=\d+, \.\.\.\) returned (\d+)\. A choose hook returns "
                         r"FETCH \(-1\), DROP \(-2\)", msg), msg
        if name == "past-the-layer":
            assert "returned 64." in msg


def test_a_miss_hook_replays_a_trace_file_in_pieces_as_it_replays_it_whole(olmoe, tmp_path, monkeypatch):
    """A compiled miss hook reads no trace of its own and keeps its state across pieces, so a
    trace file goes through the kernel a piece at a time with the whole trace's rows, summary
    and final state."""
    from moesim.config.scenario import load_scenario
    from moesim.traces.io import write_trace

    monkeypatch.setenv("MOESIM_NO_KERNEL", "0")
    path = write_trace(olmoe, tmp_path / "olmoe.parquet")
    sc = load_scenario("quickstart", [f"workload.trace.path={path}", "policies.miss=third-miss-drops",
                                      "workload.batch_size=1", "cache.capacity=10%"])
    whole_sim = Simulation(sc, trace=olmoe)
    whole = whole_sim.run()
    assert whole.summary["dropped_experts"] > 0
    sim = Simulation(sc, chunk_rows=300)
    assert sim.source.pieces is not None, sim.source.whole_reason
    res = sim.run()
    assert res.summary["trace_pieces"] >= 3
    same_rows(res, whole)
    assert (sim.miss.si == whole_sim.miss.si).all()


def test_a_miss_hook_is_handed_what_a_plain_policy_reads_from_its_miss_info(olmoe, monkeypatch):
    """On the SimPy path the hook's arguments are the miss's: its pass, layer, expert and rank,
    the layer's cached and routed experts as boolean arrays (a plain policy's ``MissInfo``)."""
    sc = {n: scenario(policies={"miss": n, "prefetch": "previous-token"}, cache={"capacity": "25%"},
                      workload={"batch_size": 2}) for n in ("seen", "plain-seen")}
    SEEN.clear()
    ref = reference(sc["plain-seen"], olmoe, monkeypatch)
    want = list(SEEN)
    SEEN.clear()
    monkeypatch.setenv("MOESIM_NO_KERNEL", "0")
    got = Simulation(sc["seen"], trace=olmoe).run()
    assert got.summary["replay_path_reason"].startswith("miss policy 'seen': its choose hook does not compile")
    assert len(want) > 100
    assert len({w[0] for w in want}) > 10  # many passes
    assert want == SEEN
    same_rows(got, ref)


def test_a_miss_hooks_state_has_a_row_per_expert_a_column_per_field_and_its_parameters(olmoe, monkeypatch):
    sim = Simulation(scenario(policies={"miss": {"name": "drops-after", "after": 2}}), trace=olmoe)
    assert sim.miss.si.shape == (16 * 64, 1)
    assert sim.miss.sf.shape == (16 * 64, 2)
    assert (sim.miss.sf[:, 1] == 2).all()
    third = run(scenario(policies={"miss": "third-miss-drops"}), olmoe, monkeypatch, simpy=False)
    same_rows(run(scenario(policies={"miss": {"name": "drops-after", "after": 3}}), olmoe, monkeypatch, simpy=False),
              third)
    second = run(scenario(policies={"miss": {"name": "drops-after", "after": 2}}), olmoe, monkeypatch, simpy=False)
    assert second.summary["dropped_experts"] > third.summary["dropped_experts"]
    plain = Simulation(scenario(policies={"miss": "hook-drop"}), trace=olmoe).miss
    assert (plain.si.shape, plain.sf.shape) == ((16 * 64, 1), (16 * 64, 1))
    assert (plain.si.dtype, plain.sf.dtype) == (np.int64, np.float64)

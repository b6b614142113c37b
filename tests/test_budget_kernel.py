"""Budget policies on the compiled kernel: every built-in budget (and a user's own) gives the
SimPy path's per-pass rows, per-request rows and summary exactly, under every miss policy, in
every execution mode, timed and cache-only; the policy is asked for each (pass, layer) once,
in the replay's order, with the same arguments on both paths; a budget that picks experts the
router did not choose (more distinct experts than the router's) is replayed as the SimPy path
replays it; and a trace file read in pieces gives the whole replay's rows.

The golden grid (``tests/test_golden_grid.py``) holds every eviction x prefetch x miss x
budget case to the digests the SimPy path gave before budgets ran on the kernel; these tests
compare the two paths directly, on more settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moesim.config.scenario import load_scenario
from moesim.policies.budget import REGISTRY
from moesim.policies.budget.base import BudgetPolicy
from moesim.simulator.engine import Simulation
from moesim.traces.io import write_trace
from moesim.traces.synth import synth_from_preset
from tests.helpers import registered, scenario

BUDGETS: list[Any] = [
    "moe-spec", {"name": "moe-spec", "coverage": "truncation", "budget": 12},
    {"name": "moe-spec", "ranking": "static", "budget": 20},
    {"name": "xshare", "budget": 10}, {"name": "xshare", "threshold": 0.6},
    {"name": "xshare", "per_request": 2}, {"name": "xshare", "per_gpu": 3, "gpus": 4},
    "lynx", {"name": "lynx", "drop": 4}, "dynamic-skip", {"name": "dynamic-skip", "beta": 0.8},
    "skip-threshold", {"name": "skip-threshold", "max_skip": 3}, "spread", "logged"]
MISSES = ["fetch", "drop", "substitute", "speculative", "fetch-lowest-bit", "fetch-priority"]
MODES = ["layer", "on-arrival", "per-expert"]


class Spread(BudgetPolicy):
    """A user's budget that gives token ``t`` of each (pass, layer) the experts
    ``(t * k + j) % N``, ``j < k - 1`` (one fewer than the router's): at batch 8 on 64 experts
    every expert is computed, most of them chosen by no router, so the layer looks up more
    distinct experts than the router chose and keeps almost none of the routed gate mass."""

    def select(self, pass_index: int, layer: int, rows: np.ndarray, experts: np.ndarray) -> list[list[int]]:
        k, n = experts.shape[1], self.ctx.num_experts
        return [[(t * k + j) % n for j in range(k - 1)] for t in range(len(rows))]


class Logged(BudgetPolicy):
    """A user's budget that logs each call (pass, layer, the tokens' (request, position),
    router experts) and keeps the
    top half of each token's experts unless the call is an odd one of the replay: its choice
    depends on how many calls came before, so a path that called it in another order or more
    often would compute other experts."""

    calls: ClassVar[list[tuple[int, int, tuple[tuple[int, int], ...], tuple[int, ...]]]] = []

    def select(self, pass_index: int, layer: int, rows: np.ndarray, experts: np.ndarray) -> list[list[int]]:
        n = len(Logged.calls)
        trace = self.ctx.workload.trace
        tokens = tuple(zip(trace.request[rows].tolist(), trace.position[rows].tolist(), strict=True))
        Logged.calls.append((pass_index, layer, tokens, tuple(experts.reshape(-1).tolist())))
        keep = experts.shape[1] if n % 2 else experts.shape[1] // 2
        return [[int(e) for e in row[:keep]] for row in experts]


class UserSkip(BudgetPolicy):
    """Dynamic skipping as a user would write it, a token at a time (Lu et al. 2024, as
    XShare §1 describes it): an expert of rank >= 1 is skipped when its weight is below 0.3 of
    the token's top-1 weight. ``benchmarks/hook_speed.py`` times it against the built-in."""

    def select(self, pass_index: int, layer: int, rows: np.ndarray, experts: np.ndarray) -> list[list[int]]:
        w = self.ctx.workload.trace.weights[rows]
        return [[int(e) for r, e in enumerate(row) if r == 0 or w[t, r] >= 0.3 * w[t, 0]]
                for t, row in enumerate(experts)]


USERS = {"spread": Spread, "logged": Logged, "user-skip": UserSkip}


@pytest.fixture(scope="module", autouse=True)
def _registered():
    with registered(REGISTRY, USERS):
        yield


def test_a_users_dynamic_skip_gives_the_built_ins_rows_on_both_paths(olmoe, monkeypatch):
    for mode in MODES:
        built_in = run(budget_scenario("dynamic-skip", mode=mode), olmoe, monkeypatch, False)
        for simpy in (False, True):
            mine = run(budget_scenario("user-skip", mode=mode), olmoe, monkeypatch, simpy)
            pd.testing.assert_frame_equal(mine.steps, built_in.steps, check_exact=True)
    assert built_in.summary["tokens_altered"] > 0


@pytest.fixture(scope="module")
def olmoe():
    """An OLMoE-shaped trace (16 layers, 64 experts, top-8) with router probabilities and
    next-layer predictions: 6 requests of 6 prompt and 12 decode tokens."""
    return synth_from_preset("olmoe-1b-7b", requests=6, prompt_tokens=6, tokens=12, seed=11, probs=True,
                             pred_next=True)


def run(sc: Any, trace: Any, monkeypatch: pytest.MonkeyPatch, simpy: bool, **kwargs: Any) -> Any:
    monkeypatch.setenv("MOESIM_NO_KERNEL", "1" if simpy else "0")
    Logged.calls.clear()
    result = Simulation(sc, trace=trace, **kwargs).run()
    monkeypatch.delenv("MOESIM_NO_KERNEL", raising=False)
    assert result.summary["replay_path"] == ("simpy" if simpy else "kernel"), result.summary["replay_path_reason"]
    result.calls = list(Logged.calls)
    return result


def same(fast: Any, ref: Any) -> None:
    pd.testing.assert_frame_equal(fast.steps, ref.steps, check_exact=True)
    pd.testing.assert_frame_equal(fast.requests, ref.requests, check_exact=True)
    skip = ("replay_path", "replay_path_reason", "wall_s", "trace_pieces")
    assert {k: v for k, v in fast.summary.items() if k not in skip} == {
        k: v for k, v in ref.summary.items() if k not in skip}
    assert fast.calls == ref.calls


def budget_scenario(budget: Any, miss: str = "fetch", mode: str = "layer", timing: bool = True,
                    prefetch: str = "oracle", eviction: str = "lru", capacity: str = "10%", batch: int = 8) -> Any:
    policies = {"eviction": eviction, "prefetch": prefetch, "miss": miss, "budget": budget}
    if miss in ("fetch-lowest-bit", "fetch-priority"):
        policies["miss"] = {"name": miss, "precisions": ["bf16", "int8", "int4"]}
    return scenario(policies=policies, expert_compute=mode, timing=timing, workload={"batch_size": batch},
                    cache={"capacity": capacity})


@pytest.mark.parametrize("budget", BUDGETS, ids=lambda b: b if isinstance(b, str) else "-".join(map(str, b.values())))
def test_every_budget_on_the_kernel_gives_the_simpy_rows(olmoe, monkeypatch, budget):
    sc = budget_scenario(budget)
    fast, ref = run(sc, olmoe, monkeypatch, False), run(sc, olmoe, monkeypatch, True)
    same(fast, ref)
    plain = run(budget_scenario("none"), olmoe, monkeypatch, False)
    # the budget changed what was computed: tokens lost experts and gate mass, fewer or other
    # experts were looked up
    assert ref.summary["tokens_altered"] > 0
    assert ref.steps["gate_weight_computed"].sum() < ref.steps["gate_weight_total"].sum()
    assert not ref.steps["unique_experts"].equals(plain.steps["unique_experts"])


@pytest.mark.parametrize("miss", MISSES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("budget", ["moe-spec", "spread", "logged"])
def test_a_budget_with_every_miss_policy_in_every_mode(olmoe, monkeypatch, budget, miss, mode):
    sc = budget_scenario(budget, miss=miss, mode=mode, capacity="5%", prefetch="previous-token")
    same(run(sc, olmoe, monkeypatch, False), run(sc, olmoe, monkeypatch, True))


def test_a_budget_choosing_experts_no_router_chose(olmoe, monkeypatch):
    """``spread`` computes 7 experts per token, apart (more distinct experts than the router
    chose: 42 a layer at 6 tokens), weights zero for the eviction policy where the router did
    not choose them; the kept gate mass is what the router gave the few it did."""
    for ev in ("lru", "fld", "lfu"):
        sc = budget_scenario("spread", eviction=ev, capacity="30%")
        fast, ref = run(sc, olmoe, monkeypatch, False), run(sc, olmoe, monkeypatch, True)
        same(fast, ref)
    routed = run(budget_scenario("none", capacity="30%"), olmoe, monkeypatch, False)
    steps = ref.steps
    spread = [len({(t * 8 + j) % 64 for t in range(n) for j in range(7)}) for n in steps["tokens"]]
    assert steps["unique_experts"].tolist() == [s * n for s, n in zip(spread, steps["layers_routed"], strict=True)]
    many = steps["tokens"].between(4, 8)  # 28-56 experts a layer, more than the router chose
    assert many.sum() >= 10
    assert (steps["unique_experts"][many] > routed.steps["unique_experts"][many]).all()
    assert steps["gate_weight_computed"].sum() < 0.25 * steps["gate_weight_total"].sum()


def test_the_budget_is_asked_once_per_layer_in_the_replays_order(olmoe, monkeypatch):
    sc = budget_scenario("logged", batch=4)
    fast, ref = run(sc, olmoe, monkeypatch, False), run(sc, olmoe, monkeypatch, True)
    same(fast, ref)
    layers = [(p, layer) for p, layer, _, _ in ref.calls]
    assert layers == [(p, layer) for p in range(len(ref.steps)) for layer in range(16)]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(budget=st.sampled_from(BUDGETS), miss=st.sampled_from(MISSES), mode=st.sampled_from(MODES),
       timing=st.booleans(), prefetch=st.sampled_from(["none", "oracle", "previous-token", "score-percentile"]),
       eviction=st.sampled_from(["lru", "least-stale", "belady", "sieve", "arc"]),
       capacity=st.sampled_from(["0 experts", "3%", "10%", "40%"]), batch=st.sampled_from([1, 3, 8]))
def test_hypothesis_budget_kernel_equals_simpy(olmoe, monkeypatch, budget, miss, mode, timing, prefetch, eviction,
                                                capacity, batch):
    sc = budget_scenario(budget, miss, mode, timing, prefetch, eviction, capacity, batch)
    same(run(sc, olmoe, monkeypatch, False), run(sc, olmoe, monkeypatch, True))


@pytest.mark.parametrize("budget", [["dynamic-skip"], ["xshare", "policies.budget.per_request=1"], ["logged"]],
                         ids=["dynamic-skip", "xshare", "logged"])
def test_a_budget_over_a_trace_read_in_pieces_equals_the_whole_replay(tmp_path: Path, olmoe, monkeypatch, budget):
    path = write_trace(olmoe, tmp_path / "olmoe.parquet")
    name, *more = budget
    sc = load_scenario("quickstart", [f"workload.trace.path={path}", "workload.batch_size=1", "cache.capacity=10%",
                                      "policies.prefetch=previous-token", f"policies.budget={name}", *more])
    monkeypatch.setenv("MOESIM_NO_KERNEL", "0")
    Logged.calls.clear()
    sim = Simulation(sc, chunk_rows=300)
    pieces = sim.run()
    assert pieces.summary["replay_path"] == "kernel"
    assert sim.source.trace_pieces > 2
    pieces.calls = list(Logged.calls)
    monkeypatch.setenv("MOESIM_NO_KERNEL", "1")
    Logged.calls.clear()
    whole = Simulation(sc).run()
    whole.calls = list(Logged.calls)
    same(pieces, whole)
    if name == "logged":
        assert len(whole.calls) == 16 * len(whole.steps)

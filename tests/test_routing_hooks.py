"""Routing policies written as a hook (:mod:`moesim.policies.routing.hooked`): one ``choose``
per (pass, layer), compiled by numba and called so on both replay paths.

References, independent of the hook machinery: the built-in ``cache-aware`` (its own numpy
``route`` on the SimPy path), which :class:`HookCacheAware` restates, and a routing policy
written plainly against :class:`RoutingPolicy` (:class:`PlainCachedLast`, a Python loop over
the rows), which :class:`CachedLast` restates. Each hook policy must give its reference's
per-pass rows bit for bit on both replay paths."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from moesim.errors import MoesimError
from moesim.policies.routing import REGISTRY, RoutingPolicy
from moesim.policies.routing.hooked import HookRouting
from moesim.simulator.engine import Simulation
from moesim.traces.synth import synth_from_preset
from tests.helpers import registered, scenario


class HookCacheAware(HookRouting):
    """Cache-aware routing with lambda 0.3 (SpecMD §3.1.1 eq. 1) as a hook: the running sum of
    ``|log p|`` and its count in ``sf[0]``, each layer's logits added one after another, then
    each row's top-k of the biased logits picked rank by rank, the lowest id on a tie."""

    float_fields = ("abs_sum", "count")

    @staticmethod
    def choose(p, layer, probs, experts, cached, out, si, sf):
        rows, n = probs.shape
        k = out.shape[1]
        s = 0.0
        for t in range(rows):
            for e in range(n):
                s += abs(np.log(max(probs[t, e], 1e-30)))
        sf[0, 0] += s
        sf[0, 1] += rows * n
        bias = 0.3 * (sf[0, 0] / sf[0, 1])
        for t in range(rows):
            for j in range(k):
                best = -1
                top = 0.0
                for e in range(n):
                    taken = False
                    for jj in range(j):
                        taken |= out[t, jj] == e
                    if taken:
                        continue
                    v = np.log(max(probs[t, e], 1e-30))
                    if cached[e]:
                        v = v + bias
                    if best < 0 or v > top:
                        best = e
                        top = v
                out[t, j] = best


class CachedLast(HookRouting):
    """A token whose last-ranked expert is not cached takes instead the cached expert of highest
    probability that it has not chosen (the lowest id on a tie); each such swap is counted in
    ``si[layer * experts + expert, 0]`` of the expert taken."""

    int_fields = ("taken",)

    @staticmethod
    def choose(p, layer, probs, experts, cached, out, si, sf):
        rows, k = out.shape
        n = cached.shape[0]
        for t in range(rows):
            if cached[out[t, k - 1]]:
                continue
            best = -1
            for e in range(n):
                mine = False
                for j in range(k - 1):
                    mine |= out[t, j] == e
                if cached[e] and not mine and (best < 0 or probs[t, e] > probs[t, best]):
                    best = e
            if best >= 0:
                out[t, k - 1] = best
                si[layer * n + best, 0] += 1


class PlainCachedLast(RoutingPolicy):
    """CachedLast's reference, written against the family's base (no state)."""

    def route(self, pass_index: int, layer: int, rows: np.ndarray, experts: np.ndarray, cached: Any) -> np.ndarray:
        probs = self.ctx.workload.probs[rows]
        n = self.ctx.num_experts
        out = experts.copy()
        for t in range(len(rows)):
            if cached(self.ctx.key(layer, int(out[t, -1]))):
                continue
            pool = [e for e in range(n) if cached(self.ctx.key(layer, e)) and e not in out[t, :-1].tolist()]
            if pool:
                out[t, -1] = max(pool, key=lambda e: (float(probs[t, e]), -e))
        return out


class Talkative(CachedLast):
    """CachedLast that numba cannot compile (it builds a Python set)."""

    @staticmethod
    def choose(p, layer, probs, experts, cached, out, si, sf):
        seen = {("layer", layer)}
        if len(seen) > 1:
            out[0, 0] = 0


class OutOfRange(HookRouting):
    """Leaves an expert id past the layer's last in the first row."""

    @staticmethod
    def choose(p, layer, probs, experts, cached, out, si, sf):
        if p == 2:
            out[0, 0] = cached.shape[0]


class Twice(HookRouting):
    """Leaves a row's top-1 in its second place too."""

    @staticmethod
    def choose(p, layer, probs, experts, cached, out, si, sf):
        if p == 1 and layer == 3:
            out[0, 1] = out[0, 0]


POLICIES = {"hook-cache-aware": HookCacheAware, "cached-last": CachedLast, "plain-cached-last": PlainCachedLast,
            "talkative": Talkative, "out-of-range": OutOfRange, "twice": Twice}


@pytest.fixture(scope="module", autouse=True)
def _registered():
    with registered(REGISTRY, POLICIES):
        yield


@pytest.fixture(scope="module")
def olmoe():
    """An OLMoE-shaped trace (8 layers, 64 experts, top-8) with router probabilities."""
    return synth_from_preset("olmoe-1b-7b", layers=8, requests=6, prompt_tokens=6, tokens=16, seed=11, probs=True,
                             pred_next=True)


def run(sc: Any, trace: Any, monkeypatch: pytest.MonkeyPatch, simpy: bool) -> Any:
    if simpy:
        monkeypatch.setenv("MOESIM_NO_KERNEL", "1")
    else:
        monkeypatch.delenv("MOESIM_NO_KERNEL", raising=False)
    sim = Simulation(sc, trace=trace)
    res = sim.run()
    monkeypatch.delenv("MOESIM_NO_KERNEL", raising=False)
    return sim, res


def same(a: Any, b: Any) -> None:
    assert a.steps.equals(b.steps)
    assert a.requests.equals(b.requests)


CASES = [("layer", True, 1, "60%", "none"), ("on-arrival", True, 4, "70%", "next-gate-topk"),
         ("per-expert", True, 2, "60%", "oracle"), ("layer", False, 8, "80%", "previous-token")]


@pytest.mark.parametrize(("mode", "timing", "batch", "capacity", "prefetch"), CASES)
def test_a_hook_restating_cache_aware_routing_gives_the_built_ins_rows_on_both_paths(
        olmoe, monkeypatch, mode, timing, batch, capacity, prefetch):
    """The hook takes its logits with numba's ``log``; the built-in with numpy's. Where the
    two are the same number for every probability of the trace (checked first), the hook's
    rows are the built-in's on both paths, re-routed tokens among them."""
    import numba

    z = np.maximum(olmoe.probs.astype(np.float64), 1e-30)
    assert np.array_equal(numba.njit(lambda x: np.log(x))(z), np.log(z)), "numpy's log is not numba's here"
    over = {"expert_compute": mode, "timing": timing, "workload": {"batch_size": batch}, "cache": {"capacity": capacity}}
    ref = run(scenario(policies={"prefetch": prefetch, "routing": {"name": "cache-aware", "lam": 0.3}}, **over),
              olmoe, monkeypatch, simpy=True)[1]
    assert ref.steps.tokens_altered.sum() > 0
    for simpy in (True, False):
        sim, res = run(scenario(policies={"prefetch": prefetch, "routing": "hook-cache-aware"}, **over), olmoe,
                       monkeypatch, simpy)
        assert res.summary["replay_path"] == ("simpy" if simpy else "kernel"), res.summary["replay_path_reason"]
        same(res, ref)
        assert sim.routing.sf[0, 1] == ref.steps.tokens.sum() * 8 * 64  # each token's logits, at every layer


@pytest.mark.parametrize(("mode", "timing", "batch", "capacity", "prefetch"), CASES)
def test_a_hook_with_state_gives_its_plain_references_rows_on_both_paths_and_the_same_state(
        olmoe, monkeypatch, mode, timing, batch, capacity, prefetch):
    over = {"expert_compute": mode, "timing": timing, "workload": {"batch_size": batch}, "cache": {"capacity": capacity}}
    ref = run(scenario(policies={"prefetch": prefetch, "routing": "plain-cached-last"}, **over), olmoe, monkeypatch,
              simpy=True)[1]
    assert ref.steps.tokens_altered.sum() > 0
    states = []
    for simpy in (True, False):
        sim, res = run(scenario(policies={"prefetch": prefetch, "routing": "cached-last"}, **over), olmoe, monkeypatch,
                       simpy)
        assert res.summary["replay_path"] == ("simpy" if simpy else "kernel"), res.summary["replay_path_reason"]
        same(res, ref)
        states.append(sim.routing.si.copy())
    assert np.array_equal(states[0], states[1])
    assert states[0].sum() > 0


def test_a_hook_that_does_not_compile_runs_on_the_simpy_path_and_says_why(olmoe, monkeypatch):
    _sim, res = run(scenario(policies={"routing": "talkative"}), olmoe, monkeypatch, simpy=False)
    assert res.summary["replay_path"] == "simpy"
    why = res.summary["replay_path_reason"]
    assert why.startswith("routing policy 'talkative': its choose hook does not compile with numba (")
    assert "\n" not in why


@pytest.mark.parametrize("simpy", [True, False])
@pytest.mark.parametrize(("name", "says"), [("out-of-range", "an expert that is not one of the layer's"),
                                            ("twice", "an expert twice in one row")])
def test_a_row_that_is_not_k_distinct_experts_is_one_paragraph_on_either_path(olmoe, monkeypatch, simpy, name,
                                                                             says):
    with pytest.raises(MoesimError) as err:
        run(scenario(policies={"routing": name}), olmoe, monkeypatch, simpy)
    text = str(err.value)
    assert f"routing policy '{name}'" in text
    assert "\n" not in text
    if simpy:
        assert "left [" in text
        assert "k distinct experts of the layer" in text
    else:
        assert says in text
        assert "MOESIM_NO_KERNEL=1" in text

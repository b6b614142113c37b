"""Routing policies written as a hook (:mod:`moesim.policies.routing.hooked`): one ``choose``
per (pass, layer), compiled by numba and called so on both replay paths.

References, independent of the hook machinery: the built-in ``cache-aware`` (its own numpy
``route`` on the SimPy path), which :class:`HookCacheAware` restates, and a routing policy
written plainly against :class:`RoutingPolicy` (:class:`PlainCachedLast`, a Python loop over
the rows), which :class:`CachedLast` restates. Each hook policy must give its reference's
per-pass rows bit for bit on both replay paths."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from numba import njit
from numba.extending import overload

from moesim.errors import MoesimError
from moesim.policies.routing import REGISTRY, RoutingPolicy, cache_aware
from moesim.policies.routing.hooked import HookRouting
from moesim.simulator.engine import Simulation
from moesim.traces.synth import generate, synth_from_preset
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
    """CachedLast's reference, written against the family's base (no state; a trace without
    probabilities gives each expert 0)."""

    def route(self, pass_index: int, layer: int, rows: np.ndarray, experts: np.ndarray, cached: Any) -> np.ndarray:
        wl = self.ctx.workload
        probs = wl.probs[rows] if wl.probs is not None else np.zeros((len(rows), self.ctx.num_experts))
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


def in_numba() -> bool:
    """False as Python runs it; True compiled (its overload below)."""
    return False


@overload(in_numba)
def _in_numba_compiled():
    return lambda: True


class WhereRun(HookRouting):
    """Counts its calls in ``si[0, 0]`` when it runs compiled, in ``si[0, 1]`` as written."""

    int_fields = ("compiled", "as_written")

    @staticmethod
    def choose(p, layer, probs, experts, cached, out, si, sf):
        si[0, 0 if in_numba() else 1] += 1


@dataclass(frozen=True)
class SkipParams:
    rank: int = 1


class SkipRank(HookRouting):
    """The token's expert of rank ``rank`` (a parameter, put in ``si`` by ``init_state``) gives
    way to the cached expert of lowest id the token has not chosen."""

    Params = SkipParams
    int_fields = ("rank",)

    def init_state(self) -> None:
        self.si[:, 0] = self.params.rank

    @staticmethod
    def choose(p, layer, probs, experts, cached, out, si, sf):
        rows, k = out.shape
        j = si[0, 0]
        for t in range(rows):
            for e in range(cached.shape[0]):
                mine = False
                for jj in range(k):
                    mine |= out[t, jj] == e
                if cached[e] and not mine:
                    out[t, j] = e
                    break


class Divides(HookRouting):
    """Divides by the number of cached experts, which is 0 at the first layer of the replay."""

    @staticmethod
    def choose(p, layer, probs, experts, cached, out, si, sf):
        n = 0
        for e in range(cached.shape[0]):
            n += cached[e]
        si[0, 0] += 10 // n


class SumsProbs(CachedLast):
    """CachedLast that adds up the probabilities it is given in ``sf[0, 0]``."""

    float_fields = ("probs",)

    @staticmethod
    def choose(p, layer, probs, experts, cached, out, si, sf):
        sf[0, 0] += probs.sum()


POLICIES = {"hook-cache-aware": HookCacheAware, "sums-probs": SumsProbs, "cached-last": CachedLast, "plain-cached-last": PlainCachedLast,
            "talkative": Talkative, "out-of-range": OutOfRange, "twice": Twice, "where-run": WhereRun,
            "skip-rank": SkipRank, "divides": Divides}


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


@njit
def _numba_log(p):
    z = np.empty(p.shape, np.float64)
    for t in range(p.shape[0]):
        for e in range(p.shape[1]):
            z[t, e] = np.log(max(p[t, e], 1e-30))
    return z


def numba_log_probs(probs: np.ndarray) -> np.ndarray:
    """:func:`moesim.policies.routing.cache_aware.log_probs` as :class:`HookCacheAware` takes
    each logit: numba's scalar ``log`` of ``max(p, 1e-30)``."""
    return _numba_log(np.ascontiguousarray(probs))


CASES = [("layer", True, 1, "60%", "none"), ("on-arrival", True, 4, "70%", "next-gate-topk"),
         ("per-expert", True, 2, "60%", "oracle"), ("layer", False, 8, "80%", "previous-token")]


@pytest.mark.parametrize(("mode", "timing", "batch", "capacity", "prefetch"), CASES)
def test_a_hook_restating_cache_aware_routing_gives_the_built_ins_rows_on_both_paths(
        olmoe, monkeypatch, mode, timing, batch, capacity, prefetch):
    """The hook's rows are the built-in's on both paths, re-routed tokens among them. The hook
    takes its logits with numba's scalar ``log``, the built-in with numpy's vectorised one,
    which differ in the last bit on some machines (AVX-512's); so the built-in is given the
    hook's logits (:func:`numba_log_probs`), and the test compares the routing, not two
    ``log`` implementations."""
    monkeypatch.setattr(cache_aware, "log_probs", numba_log_probs)
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


def test_without_router_probabilities_a_hook_is_given_zeros_on_both_paths(monkeypatch):
    """A trace without ``probs``: the hook's ``probs`` are 0, so CachedLast takes the cached
    expert of lowest id, as its plain reference does."""
    trace = synth_from_preset("olmoe-1b-7b", layers=6, requests=4, prompt_tokens=4, tokens=12, seed=2)
    assert trace.probs is None
    over = {"cache": {"capacity": "60%"}, "workload": {"batch_size": 2}}
    ref = run(scenario(policies={"routing": "plain-cached-last"}, **over), trace, monkeypatch, simpy=True)[1]
    assert ref.steps.tokens_altered.sum() > 0
    for simpy in (True, False):
        res = run(scenario(policies={"routing": "cached-last"}, **over), trace, monkeypatch, simpy)[1]
        assert res.summary["replay_path"] == ("simpy" if simpy else "kernel")
        same(res, ref)
        sim, _ = run(scenario(policies={"routing": "sums-probs"}, **over), trace, monkeypatch, simpy)
        assert sim.routing.sf[0, 0] == 0.0


def test_both_paths_call_the_hook_compiled(olmoe, monkeypatch):
    """The SimPy path calls the compiled hook too (so that a hook's arithmetic, numpy's or
    numba's, is the same number on both paths): one call per (pass, layer), each compiled."""
    for simpy in (True, False):
        sim, res = run(scenario(policies={"routing": "where-run"}), olmoe, monkeypatch, simpy)
        layers = int((res.steps.tokens > 0).sum()) * 8
        assert sim.routing.si[0].tolist() == [layers, 0]


def test_a_hooks_parameters_reach_its_state_and_its_state_has_a_column_per_field(olmoe, monkeypatch):
    """``init_state`` reads the scenario's parameters; ``si`` and ``sf`` have a row per expert of
    the model and a column per field (one where there is none). Swapping rank 1 and rank 7
    for a cached expert change different tokens."""
    rows = {}
    for rank in (1, 7):
        sim, res = run(scenario(policies={"routing": {"name": "skip-rank", "rank": rank}}, cache={"capacity": "60%"}),
                       olmoe, monkeypatch, simpy=False)
        assert res.summary["replay_path"] == "kernel"
        assert (sim.routing.si[:, 0] == rank).all()
        assert sim.routing.si.shape == (8 * 64, 1)
        assert sim.routing.sf.shape == (8 * 64, 1)
        rows[rank] = res.steps
        assert res.steps.tokens_altered.sum() > 0
    assert not rows[1].equals(rows[7])
    sim, _ = run(scenario(policies={"routing": "hook-cache-aware"}), olmoe, monkeypatch, simpy=False)
    assert sim.routing.si.shape == (8 * 64, 1)
    assert sim.routing.sf.shape == (8 * 64, 2)


@pytest.mark.parametrize("simpy", [True, False])
def test_a_hook_that_raises_is_one_paragraph_naming_it(olmoe, monkeypatch, simpy):
    with pytest.raises(MoesimError) as err:
        run(scenario(policies={"routing": "divides"}), olmoe, monkeypatch, simpy)
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith("routing policy 'divides':")
    if simpy:
        assert "its choose hook raised ZeroDivisionError" in text
        assert "(forward pass 0, layer 0)" in text
    else:
        assert "a compiled hook raised ZeroDivisionError" in text


@pytest.mark.parametrize("name", ["cached-last", "hook-cache-aware"])
def test_hooks_on_a_small_model_give_the_same_rows_on_both_paths(monkeypatch, name):
    """3 layers of 8 experts, top-2 (fast enough for the kernel as plain Python,
    ``tools/mutation_compiled.py``)."""
    from tests.helpers import experts_cap, small_model

    model = small_model(3, 8, 2)
    trace = generate(model, requests=3, prompt_tokens=3, tokens=8, seed=4, probs=True)
    sc = scenario(policies={"routing": name}, cache={"capacity": experts_cap(12, model)}, workload={"batch_size": 2})
    ref = run(sc, trace, monkeypatch, simpy=True)[1]
    res = run(sc, trace, monkeypatch, simpy=False)[1]
    assert res.summary["replay_path"] == "kernel"
    same(res, ref)
    assert ref.steps.tokens_altered.sum() > 0

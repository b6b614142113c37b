"""Eviction policies that walk an order of their own, written as hooks
(:mod:`moesim.policies.list_hooks`): one definition that the SimPy path calls as plain Python
and the kernel calls compiled.

References, independent of the hook machinery: libCacheSim's SIEVE (the C library), the built-in
``sieve`` (its own reference form and compiled form, each held to libCacheSim), and 2Q written
as a plain :class:`EvictionPolicy` over ``OrderedDict``s from Johnson and Shasha's description.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moesim.errors import MoesimError
from moesim.policies.eviction import CLOCK_LAYER, CLOCK_PASS, CLOCK_TICK, REGISTRY, EvictionPolicy
from moesim.policies.eviction.forms import form_of
from moesim.policies.list_hooks import HookListEviction, ListHooks
from moesim.simulator.engine import Simulation
from moesim.traces.synth import synth_from_preset
from tests.helpers import access_stream, experts_cap, mixtral_trace, registered, scenario
from tests.test_compiled_forms import drive_both, kernel_events
from tests.test_sieve_s3fifo_arc import lcs_misses

# -- SIEVE as list hooks: one queue, newest at its head, a visited bit, a hand ---------------------
NEWER, OLDER, VISITED, OFFERED = range(4)
HEAD, TAIL, HAND, WALK, COUNT, WALKED = range(6)


class HookSieve(HookListEviction):
    """SIEVE (libCacheSim's ``Sieve.c``): a hit sets the visited bit; the hand goes from the
    oldest entry toward the newest, wrapping, unmarks visited entries and offers unvisited ones,
    each once a walk; after an eviction it rests on the victim's newer neighbour."""

    int_fields = ("newer", "older", "visited", "offered")
    global_int_fields = ("head", "tail", "hand", "walk", "count", "walked")

    def init_state(self):
        self.si[:, NEWER] = self.si[:, OLDER] = -1
        self.gi[HEAD] = self.gi[TAIL] = self.gi[HAND] = -1

    @staticmethod
    def insert(key, demand, weight, clock, si, sf, gi, gf):
        older = gi[HEAD]
        si[key, NEWER], si[key, OLDER], si[key, VISITED] = -1, older, 0
        if older == -1:
            gi[TAIL] = key
        else:
            si[older, NEWER] = key
        gi[HEAD] = key
        gi[COUNT] += 1

    @staticmethod
    def access(key, weight, clock, si, sf, gi, gf):
        si[key, VISITED] = 1

    @staticmethod
    def remove(key, evicted, clock, si, sf, gi, gf):
        newer, older = si[key, NEWER], si[key, OLDER]
        if gi[HAND] == key:
            gi[HAND] = newer
        if newer == -1:
            gi[HEAD] = older
        else:
            si[newer, OLDER] = older
        if older == -1:
            gi[TAIL] = newer
        else:
            si[older, NEWER] = newer
        si[key, VISITED] = 0
        gi[COUNT] -= 1

    @staticmethod
    def candidate(first, clock, si, sf, gi, gf):
        if first:
            gi[WALK] += 1
            gi[WALKED] = 0
        key = gi[HAND] if gi[HAND] != -1 else gi[TAIL]
        while gi[WALKED] < gi[COUNT]:
            gi[HAND] = key
            nxt = si[key, NEWER] if si[key, NEWER] != -1 else gi[TAIL]
            if si[key, VISITED]:
                si[key, VISITED] = 0
            elif si[key, OFFERED] != gi[WALK]:
                si[key, OFFERED] = gi[WALK]
                gi[WALKED] += 1
                return key
            key = nxt
        return -1


# -- 2Q as list hooks: a FIFO for new keys, an LRU for keys seen again, a ghost FIFO ----------------
PREV, NEXT, WHERE = range(3)
NONE, IN, MAIN, GHOST = range(4)
# globals: each list's head (oldest) and tail, its count; the key the last miss found a ghost of;
# the limits; the ghost hits so far; the walk's next key and the list it began with
G_HEADS, G_COUNTS, G_HIT, G_KIN, G_KOUT, G_HITS, G_NEXT, G_FIRST = 0, 8, 12, 13, 14, 15, 16, 17


@dataclass(frozen=True)
class TwoQParams:
    kin: int = 16
    kout: int = 400


@numba.njit
def _link(key, q, si, gi):
    h = G_HEADS + 2 * q
    tail = gi[h + 1]
    si[key, PREV], si[key, NEXT], si[key, WHERE] = tail, -1, q
    if tail == -1:
        gi[h] = key
    else:
        si[tail, NEXT] = key
    gi[h + 1] = key
    gi[G_COUNTS + q] += 1


@numba.njit
def _unlink(key, si, gi):
    q = si[key, WHERE]
    h = G_HEADS + 2 * q
    prv, nxt = si[key, PREV], si[key, NEXT]
    if prv == -1:
        gi[h] = nxt
    else:
        si[prv, NEXT] = nxt
    if nxt == -1:
        gi[h + 1] = prv
    else:
        si[nxt, PREV] = prv
    si[key, WHERE] = NONE
    gi[G_COUNTS + q] -= 1


class HookTwoQ(HookListEviction):
    """2Q (Johnson and Shasha, VLDB 1994, the full version): a key enters ``A1in``, a FIFO; a
    key evicted from ``A1in`` is remembered in ``A1out``, a FIFO of ``kout`` ghosts; a miss
    that finds a ghost enters ``Am``, an LRU. The victim is ``A1in``'s oldest while ``A1in``
    holds more than ``kin`` keys, else ``Am``'s least recent (the other list after). A
    prefetch (which 2Q does not know) enters ``A1in``, and its ghost, if any, is forgotten."""

    Params = TwoQParams
    int_fields = ("prev", "next", "where")
    global_int_fields = tuple(f"g{i}" for i in range(G_FIRST + 1))

    def init_state(self):
        self.si[:, :] = -1
        self.si[:, WHERE] = NONE
        self.gi[:G_COUNTS] = -1
        self.gi[G_HIT] = -1
        self.gi[G_KIN], self.gi[G_KOUT] = self.params.kin, self.params.kout

    @staticmethod
    def miss(key, clock, si, sf, gi, gf):
        gi[G_HIT] = -1
        if si[key, WHERE] == GHOST:
            _unlink(key, si, gi)
            gi[G_HIT] = key
            gi[G_HITS] += 1

    @staticmethod
    def insert(key, demand, weight, clock, si, sf, gi, gf):
        if si[key, WHERE] == GHOST:  # a prefetch of a key remembered: it is no ghost now
            _unlink(key, si, gi)
        _link(key, MAIN if demand and gi[G_HIT] == key else IN, si, gi)

    @staticmethod
    def access(key, weight, clock, si, sf, gi, gf):
        if si[key, WHERE] == MAIN:
            _unlink(key, si, gi)
            _link(key, MAIN, si, gi)

    @staticmethod
    def remove(key, evicted, clock, si, sf, gi, gf):
        q = si[key, WHERE]
        _unlink(key, si, gi)
        if evicted and q == IN:
            _link(key, GHOST, si, gi)
            if gi[G_COUNTS + GHOST] > gi[G_KOUT]:
                _unlink(gi[G_HEADS + 2 * GHOST], si, gi)

    @staticmethod
    def candidate(first, clock, si, sf, gi, gf):
        """The first list's keys oldest first, then the other's (``G_NEXT``: the next to
        offer, its list in ``WHERE``; -2: the walk has offered both)."""
        if first:
            q = IN if gi[G_COUNTS + IN] > gi[G_KIN] else MAIN
            gi[G_NEXT] = gi[G_HEADS + 2 * q]
            if gi[G_NEXT] == -1:
                gi[G_NEXT] = gi[G_HEADS + 2 * (MAIN + IN - q)]
            gi[G_FIRST] = q
        key = gi[G_NEXT]
        if key < 0:
            return -1
        nxt = si[key, NEXT]
        if nxt == -1 and si[key, WHERE] == gi[G_FIRST]:
            nxt = gi[G_HEADS + 2 * (MAIN + IN - si[key, WHERE])]
        gi[G_NEXT] = nxt if nxt != -1 else -2
        return key


class DictTwoQ(EvictionPolicy):
    """2Q over ``OrderedDict``s, the reference (SimPy path only)."""

    Params = TwoQParams

    def __init__(self, params: Any, ctx: Any) -> None:
        super().__init__(params, ctx)
        self.a1in: OrderedDict[int, None] = OrderedDict()
        self.am: OrderedDict[int, None] = OrderedDict()
        self.a1out: OrderedDict[int, None] = OrderedDict()
        self.hit: int | None = None
        self.ghost_hits = 0

    def on_miss(self, key: int) -> None:
        self.hit = None
        if key in self.a1out:
            del self.a1out[key]
            self.hit = key
            self.ghost_hits += 1

    def on_insert(self, key: int, demand: bool) -> None:
        self.a1out.pop(key, None)
        (self.am if demand and self.hit == key else self.a1in)[key] = None

    def on_access(self, key: int) -> None:
        if key in self.am:
            self.am.move_to_end(key)

    def on_remove(self, key: int) -> None:
        if key in self.a1in:
            del self.a1in[key]
            self.a1out[key] = None
            if len(self.a1out) > self.params.kout:
                self.a1out.popitem(last=False)
        else:
            del self.am[key]

    def on_withdraw(self, key: int) -> None:
        self.a1in.pop(key, None)
        self.am.pop(key, None)

    def candidates(self) -> Iterator[int]:
        first, second = (self.a1in, self.am) if len(self.a1in) > self.params.kin else (self.am, self.a1in)
        return iter([*first, *second])


class Endless(HookSieve):
    """Offers the key just missed, which is not cached, again and again: a walk that never ends."""

    global_int_fields = (*HookSieve.global_int_fields, "missed")

    @staticmethod
    def miss(key, clock, si, sf, gi, gf):
        gi[6] = key

    @staticmethod
    def candidate(first, clock, si, sf, gi, gf):
        return gi[6]


class PastTheKeys(HookSieve):
    """Offers a key one past the last (the number of keys: ``si``'s rows)."""

    @staticmethod
    def candidate(first, clock, si, sf, gi, gf):
        return si.shape[0]


class PastItsGlobals(HookSieve):
    """Writes an entry its globals do not have, at the first eviction."""

    @staticmethod
    def candidate(first, clock, si, sf, gi, gf):
        gi[gi.shape[0]] = 1
        return -1


class NotNumeric(HookSieve):
    @staticmethod
    def miss(key, clock, si, sf, gi, gf):
        gi[0] = len(object().__class__.__name__)


LISTS = {"hook-sieve": HookSieve, "hook-2q": HookTwoQ, "dict-2q": DictTwoQ, "endless": Endless,
         "past-the-keys": PastTheKeys, "past-its-globals": PastItsGlobals, "not-numeric-list": NotNumeric}


@pytest.fixture(scope="module", autouse=True)
def _registered():
    with registered(REGISTRY, LISTS):
        yield


@pytest.fixture(scope="module")
def olmoe():
    """An OLMoE-shaped trace (16 layers, 64 experts, top-8) with next-layer predictions."""
    return synth_from_preset("olmoe-1b-7b", requests=4, prompt_tokens=8, tokens=16, seed=5, pred_next=True)


def run(sc: Any, trace: Any, monkeypatch: pytest.MonkeyPatch, simpy: bool) -> Any:
    monkeypatch.setenv("MOESIM_NO_KERNEL", "1" if simpy else "0")
    sim = Simulation(sc, trace=trace)
    result = sim.run()
    monkeypatch.delenv("MOESIM_NO_KERNEL", raising=False)
    assert result.summary["replay_path"] == ("simpy" if simpy else "kernel"), result.summary["replay_path_reason"]
    result.policy = sim.eviction
    return result


def same_rows(a: Any, b: Any) -> None:
    pd.testing.assert_frame_equal(a.steps, b.steps, check_exact=True)
    pd.testing.assert_frame_equal(a.requests, b.requests, check_exact=True)


def test_the_kernel_runs_a_list_hook_policy_by_its_own_form():
    assert form_of(HookSieve) is ListHooks
    assert form_of(HookTwoQ) is ListHooks
    assert form_of(NotNumeric) is None
    assert form_of(DictTwoQ) is None


SETTINGS = [("none", "layer", True), ("oracle", "per-expert", True), ("static-pin", "layer", True),
            ("previous-token", "on-arrival", True), ("next-gate-topk", "per-expert", False)]


@pytest.mark.parametrize(("prefetch", "mode", "timing"), SETTINGS)
def test_sieve_as_list_hooks_gives_the_builtin_sieves_rows_on_both_paths(olmoe, monkeypatch, prefetch, mode, timing):
    """The built-in ``sieve`` (held to libCacheSim) is the reference: its per-pass and
    per-request rows, exactly, on both paths. The hook version also holds the statically
    pinned experts in its queue (the built-in keeps them out); they are never victims."""
    def sc(ev: str) -> Any:
        return scenario(policies={"eviction": ev, "prefetch": prefetch}, expert_compute=mode, timing=timing,
                        cache={"capacity": "40%"}, workload={"batch_size": 2})

    ref = run(sc("sieve"), olmoe, monkeypatch, simpy=True)
    assert ref.summary["misses"] > 0
    assert ref.summary["hits"] > 0
    same_rows(run(sc("hook-sieve"), olmoe, monkeypatch, simpy=False), ref)
    same_rows(run(sc("hook-sieve"), olmoe, monkeypatch, simpy=True), ref)


@pytest.mark.parametrize(("prefetch", "mode", "timing"), SETTINGS)
def test_2q_as_list_hooks_gives_its_ordered_dict_references_rows_on_both_paths(olmoe, monkeypatch, prefetch, mode,
                                                                                timing):
    """Its ghost list shows: ghost hits happen (the same count as the reference's), and
    without prefetch the rows are unlike LRU's and FIFO's."""
    def sc(ev: str) -> Any:
        return scenario(policies={"eviction": ev, "prefetch": prefetch}, expert_compute=mode, timing=timing,
                        cache={"capacity": "8%"}, workload={"batch_size": 2})

    ref = run(sc("dict-2q"), olmoe, monkeypatch, simpy=True)
    assert ref.policy.ghost_hits > 0
    for other in ("lru", "fifo") if prefetch == "none" else ():
        assert not run(sc(other), olmoe, monkeypatch, simpy=True).steps.equals(ref.steps)
    for simpy in (False, True):
        ours = run(sc("hook-2q"), olmoe, monkeypatch, simpy=simpy)
        same_rows(ours, ref)
        assert ours.policy.gi[G_HITS] == ref.policy.ghost_hits


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cap=st.integers(2, 60), mode=st.sampled_from(["layer", "on-arrival", "per-expert"]),
       prefetch=st.sampled_from(["none", "oracle", "previous-token", "next-gate-topk", "static-pin"]),
       miss=st.sampled_from(["fetch", "drop", "speculative"]), timing=st.booleans(),
       policy=st.sampled_from(["hook-sieve", "hook-2q"]), kin=st.integers(0, 12), kout=st.integers(0, 40))
def test_a_list_hook_policy_on_the_kernel_equals_its_simpy_run(olmoe, monkeypatch, cap, mode, prefetch, miss, timing,
                                                              policy, kin, kout):
    ev: Any = {"name": policy, "kin": kin, "kout": kout} if policy == "hook-2q" else policy
    sc = scenario(policies={"eviction": ev, "prefetch": prefetch, "miss": miss}, expert_compute=mode,
                  timing=timing, cache={"capacity": f"{cap} experts"})
    kernel, simpy = run(sc, olmoe, monkeypatch, simpy=False), run(sc, olmoe, monkeypatch, simpy=True)
    same_rows(kernel, simpy)
    for a in ("si", "sf", "gi", "gf"):  # the state after the replay
        assert (getattr(kernel.policy, a) == getattr(simpy.policy, a)).all(), a


def replay(trace: Any, name: str, capacity: int, monkeypatch: pytest.MonkeyPatch, simpy: bool) -> dict:
    """Cache-only, per-expert execution with blocking fetch, nothing pinned but the expert being
    fetched: the cache sees libCacheSim's access stream."""
    sc = scenario(timing=False, cache={"capacity": experts_cap(capacity, trace.model)}, expert_compute="per-expert",
                  expert_fetch="blocking", policies={"eviction": name})
    return run(sc, trace, monkeypatch, simpy).summary


@pytest.mark.parametrize("capacity", [24, 64, 200])
def test_sieve_as_list_hooks_misses_as_libcachesim_on_synthetic(monkeypatch, capacity):
    trace = synth_from_preset("olmoe-1b-7b", requests=1, tokens=150, seed=11)
    expected = lcs_misses("sieve", access_stream(trace), capacity)
    for simpy in (False, True):
        assert replay(trace, "hook-sieve", capacity, monkeypatch, simpy)["misses"] == expected


@pytest.mark.real
@pytest.mark.parametrize("capacity", [24, 128])
def test_sieve_as_list_hooks_misses_as_libcachesim_on_real_mixtral(monkeypatch, capacity):
    trace = mixtral_trace("gsm8k")
    assert replay(trace, "hook-sieve", capacity, monkeypatch, False)["misses"] == lcs_misses(
        "sieve", access_stream(trace), capacity)


@pytest.mark.parametrize("simpy", [False, True])
@pytest.mark.parametrize(("name", "says"), [
    ("endless", "offered more keys in one walk than there are cache keys"),
    ("past-the-keys", "returned a key that is not a cache key (-1 ends the walk)"),
    ("past-its-globals", "IndexError")])
def test_a_list_hook_that_misbehaves_is_one_paragraph(olmoe, monkeypatch, simpy, name, says):
    """A walk that never ends, a key out of range, an index past the state: the replay stops
    with one paragraph naming the policy, never a loop without end or a write past the arrays
    (on the SimPy path it names the pass and layer too)."""
    monkeypatch.setenv("MOESIM_NO_KERNEL", "1" if simpy else "0")
    with pytest.raises(MoesimError) as err:
        Simulation(scenario(policies={"eviction": name}, cache={"capacity": "10%"}), trace=olmoe).run()
    msg = str(err.value)
    assert "\n" not in msg
    assert f"eviction policy '{name}'" in msg
    assert says in msg
    if simpy:
        assert "forward pass" in msg
    else:
        assert "Run it with MOESIM_NO_KERNEL=1" in msg


def test_a_list_hook_policy_that_does_not_compile_runs_on_the_simpy_path_and_says_why(olmoe, monkeypatch):
    monkeypatch.delenv("MOESIM_NO_KERNEL", raising=False)
    s = Simulation(scenario(policies={"eviction": "not-numeric-list"}), trace=olmoe).run().summary
    assert s["replay_path"] == "simpy"
    assert s["replay_path_reason"].startswith(
        "eviction policy 'not-numeric-list': its miss hook does not compile with numba (")


def test_a_list_hook_policy_replays_a_trace_file_in_pieces_as_it_replays_it_whole(olmoe, tmp_path, monkeypatch):
    from moesim.config.scenario import load_scenario
    from moesim.traces.io import write_trace

    monkeypatch.delenv("MOESIM_NO_KERNEL", raising=False)
    path = write_trace(olmoe, tmp_path / "olmoe.parquet")
    sc = load_scenario("quickstart", [f"workload.trace.path={path}", "policies.eviction=hook-2q",
                                      "workload.batch_size=1", "cache.capacity=5%"])
    whole = Simulation(sc, trace=olmoe).run()
    sim = Simulation(sc, chunk_rows=300)
    assert sim.source.pieces is not None, sim.source.whole_reason
    res = sim.run()
    assert res.summary["trace_pieces"] >= 3
    same_rows(res, whole)
    assert res.summary["misses"] == whole.summary["misses"]
    assert (sim.eviction.gi == whole_state(sc, olmoe)).all()


def whole_state(sc: Any, trace: Any) -> np.ndarray:
    sim = Simulation(sc, trace=trace)
    sim.run()
    return sim.eviction.gi


def test_the_parameters_reach_the_state_and_change_the_replay(olmoe, monkeypatch):
    """``kin`` and ``kout`` come from the scenario (``init_state``): with no ghosts (kout 0) no
    miss finds one, and 2Q is then a FIFO for every key (nothing reaches Am): FIFO's rows."""
    def sc(ev: Any) -> Any:
        return scenario(policies={"eviction": ev}, cache={"capacity": "8%"})

    no_ghosts = run(sc({"name": "hook-2q", "kout": 0}), olmoe, monkeypatch, simpy=False)
    assert no_ghosts.policy.gi[G_KOUT] == 0
    assert no_ghosts.policy.gi[G_HITS] == 0
    same_rows(no_ghosts, run(sc("fifo"), olmoe, monkeypatch, simpy=False))


@settings(max_examples=60, deadline=None)
@given(evs=kernel_events, kin=st.integers(0, 4), kout=st.integers(0, 6))
def test_the_list_form_chooses_the_victims_its_simpy_run_chooses(evs, kin, kout):
    """Event by event (misses, prefetch admissions with any cached keys pinned, uses, prefetch
    selections, withdrawals, layer changes, passes), the kernel's form of 2Q written as hooks
    chooses the victim that 2Q's walk on the SimPy path offers first among the keys the cache
    may evict (:func:`tests.test_compiled_forms.drive_both`)."""
    drive_both("hook-2q", TwoQParams(kin=kin, kout=kout), evs)


class KeyOrder(HookListEviction):
    """The lowest cached key first: each walk offers every key in order, cached or not (the
    cache passes over what it may not evict), and ends after the last."""

    global_int_fields = ("next",)

    @staticmethod
    def candidate(first, clock, si, sf, gi, gf):
        if first:
            gi[0] = 0
        if gi[0] >= si.shape[0]:
            return -1
        gi[0] += 1
        return gi[0] - 1


class SortedKeys(EvictionPolicy):
    """The reference: every cached key, lowest first (SimPy path only)."""

    def __init__(self, params: Any, ctx: Any) -> None:
        super().__init__(params, ctx)
        self.keys: set[int] = set()

    def on_insert(self, key: int, demand: bool) -> None:
        self.keys.add(key)

    def on_access(self, key: int) -> None:
        pass

    def on_remove(self, key: int) -> None:
        self.keys.remove(key)

    def candidates(self) -> Iterator[int]:
        return iter(sorted(self.keys))


@pytest.mark.parametrize(("capacity", "mode"), [("1 experts", "layer"), ("3 experts", "layer"),
                                                ("2 experts", "per-expert"), ("10%", "on-arrival")])
def test_a_walk_may_offer_every_key_once(monkeypatch, capacity, mode):
    """A walk over every cache key, most of them not cached, is no error; with a cache too small
    for a layer's experts every walk offers them all and finds no victim (the fetch goes
    uncached), as the reference's does. (A shorter OLMoE trace than the other tests': the SimPy
    path walks all 4,096 keys at every victim search.)"""
    olmoe = synth_from_preset("olmoe-1b-7b", requests=1, prompt_tokens=4, tokens=8, seed=5, pred_next=True)
    monkeypatch.setitem(REGISTRY._classes, "key-order", KeyOrder)
    monkeypatch.setitem(REGISTRY._classes, "sorted-keys", SortedKeys)
    KeyOrder.name, SortedKeys.name = "key-order", "sorted-keys"

    def sc(ev: str) -> Any:
        return scenario(policies={"eviction": ev}, expert_compute=mode, cache={"capacity": capacity})

    ref = run(sc("sorted-keys"), olmoe, monkeypatch, simpy=True)
    assert ref.summary["misses"] > 0
    if capacity == "1 experts":
        assert ref.summary["uncached_fetches"] > 0
    same_rows(run(sc("key-order"), olmoe, monkeypatch, simpy=False), ref)
    same_rows(run(sc("key-order"), olmoe, monkeypatch, simpy=True), ref)


def test_the_state_has_a_row_per_cache_key_and_an_entry_per_name(olmoe):
    """``si``/``sf``: a row per cache key, a column per per-key name (one at least); ``gi``/``gf``:
    an entry per global name (one at least); int64 and float64; the clock's key layout."""
    from moesim.policies.eviction import (
        CLOCK_KEYS_PER_LAYER,
        CLOCK_LAYERS,
        CLOCK_PRECISIONS,
        CLOCK_SIZE,
    )

    sim = Simulation(scenario(policies={"eviction": {"name": "hook-2q", "kin": 3, "kout": 9}}), trace=olmoe)
    p = sim.eviction
    keys = 16 * 64 * 4  # layers x experts x the precisions the scenario names
    assert (p.si.shape, p.sf.shape, p.gi.shape, p.gf.shape) == ((keys, 3), (keys, 1), (G_FIRST + 1,), (1,))
    assert (p.si.dtype, p.sf.dtype, p.gi.dtype, p.gf.dtype) == (np.int64, np.float64, np.int64, np.float64)
    assert (p.gi[G_KIN], p.gi[G_KOUT]) == (3, 9)
    assert (len(p.clock), p.clock[CLOCK_KEYS_PER_LAYER], p.clock[CLOCK_PRECISIONS], p.clock[CLOCK_LAYERS]) == (
        CLOCK_SIZE, 64 * 4, 4, 16)
    sieve = Simulation(scenario(policies={"eviction": "hook-sieve"}), trace=olmoe).eviction
    assert (sieve.sf.shape, sieve.gf.shape) == ((keys, 1), (1,))


def test_reset_state_is_the_state_before_any_insert(olmoe):
    sim = Simulation(scenario(policies={"eviction": "hook-2q"}, cache={"capacity": "5%"}), trace=olmoe)
    p = sim.eviction
    fresh = [a.copy() for a in (p.si, p.sf, p.gi, p.gf)]
    p.clock[CLOCK_PASS:CLOCK_TICK + 1] = 7
    p.si[:] = 5
    p.gi[:] = 5
    p.sf[:] = 2.5
    p.gf[:] = 2.5
    p.reset_state()
    for a, b in zip((p.si, p.sf, p.gi, p.gf), fresh, strict=True):
        assert (a == b).all()
    assert (p.clock[CLOCK_PASS], p.clock[CLOCK_LAYER], p.clock[CLOCK_TICK]) == (0, 0, 0)


@pytest.mark.parametrize(("name", "expected"), [
    ("past-the-keys", r"eviction policy 'past-the-keys': its candidate hook returned a key that is not a cache key "
                      r"\(-1 ends the walk\): 4096, where the keys are 0 to 4095 \(forward pass \d+, layer \d+\)\."),
    ("endless", r"eviction policy 'endless': its candidate hook offered more keys in one walk than there are cache "
                r"keys: return -1 once the walk has offered every key \(a walk that goes round again never ends\) "
                r"\(forward pass \d+, layer \d+; 4096 cache keys\)\.")])
def test_the_simpy_paths_paragraph_names_the_key_the_range_and_where(olmoe, monkeypatch, name, expected):
    import re

    monkeypatch.setenv("MOESIM_NO_KERNEL", "1")
    with pytest.raises(MoesimError) as err:
        Simulation(scenario(policies={"eviction": name}, cache={"capacity": "10%"}), trace=olmoe).run()
    assert re.fullmatch(expected, str(err.value)), str(err.value)


class Recording(KeyOrder):
    """The lowest key first, recording what each hook is handed: per key the tick and pass of its
    last insert and use, the weights, its evictions, withdrawals and misses."""

    int_fields = ("insert_tick", "access_tick", "access_at", "evicted", "withdrawn", "missed", "demand")
    float_fields = ("insert_weight", "access_weight")
    global_float_fields = ("weights",)

    @staticmethod
    def insert(key, demand, weight, clock, si, sf, gi, gf):
        si[key, 0] = clock[CLOCK_TICK]
        si[key, 6] += demand
        sf[key, 0] += weight
        gf[0] += weight

    @staticmethod
    def access(key, weight, clock, si, sf, gi, gf):
        si[key, 1] = clock[CLOCK_TICK]
        si[key, 2] = clock[CLOCK_PASS] * 100 + clock[CLOCK_LAYER]
        sf[key, 1] += weight
        gf[0] += weight

    @staticmethod
    def remove(key, evicted, clock, si, sf, gi, gf):
        si[key, 3 if evicted else 4] += 1

    @staticmethod
    def miss(key, clock, si, sf, gi, gf):
        si[key, 5] += 1


def test_every_hook_is_handed_the_same_on_both_paths(olmoe, monkeypatch):
    """Ticks, passes, layers and gate weights, evictions told from withdrawn prefetches, and
    misses: the state a recording policy leaves is the same on both paths, and its counts are
    the replay's own (misses, prefetches withdrawn, inserts)."""
    monkeypatch.setitem(REGISTRY._classes, "recording", Recording)
    Recording.name = "recording"
    sc = scenario(policies={"eviction": "recording", "prefetch": "previous-token"}, expert_compute="on-arrival",
                  cache={"capacity": "25%"}, execution={"prefetch_depth": 1})
    kernel, simpy = run(sc, olmoe, monkeypatch, simpy=False), run(sc, olmoe, monkeypatch, simpy=True)
    same_rows(kernel, simpy)
    s = simpy.summary
    assert s["prefetches_cancelled"] > 0
    for r in (kernel, simpy):
        p = r.policy
        assert p.si[:, 4].sum() == s["prefetches_cancelled"]
        assert p.si[:, 5].sum() == p.si[:, 6].sum() == s["misses"]
        assert p.si[:, 3].sum() > 0
        assert p.gf[0] > 0
    for a in ("si", "sf", "gi", "gf"):
        assert (getattr(kernel.policy, a) == getattr(simpy.policy, a)).all(), a

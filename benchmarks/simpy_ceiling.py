"""How fast could a pure-Python replay go? The SimPy path against minimal replays of the
same access stream (not a test; a measurement for the engine-core issue's 2x target).

The setup is ``simpy_rate.py``'s LRU one: the quickstart scenario (OLMoE-like, 16 layers x 64
experts, top-8, 5% capacity, A100 + PCIe 4), LRU, fetch on a miss, no prefetch, ``layer``
execution, batch 1, full timing. Six replays of it, each timed after one warm-up:

- ``engine``: the SimPy path (``Simulation.run`` with ``MOESIM_NO_KERNEL=1``).
- ``cache+copy``: one flat loop that keeps the engine's cache and copy engine: it calls
  ``ExpertCache.fetch`` on a miss and ``CopyEngine.advance`` at each routing point, and
  replaces everything above them (the SimPy process, ``LayerLookup``, the pass rows, the
  decision-log and prefetch hooks) with local variables.
- ``structured``: the engine-core issue's structure at its leanest: a SimPy process, a lookup
  object called once per expert (as the engine's) calling a cache whose one method owns
  evict -> insert -> submit, a copy engine object, a per-pass row, with no transfer records
  and none of the engine's hooks (decision log, prefetch, timeline); ``+engine copy``: the
  same with the engine's copy engine under its cache; ``+engine cache``: with the engine's
  cache and copy engine (each through an adapter: one call more per miss; what the engine
  adds above them is the rest of the distance to ``engine``).
- ``dicts``: the ``cache+copy`` loop with the cache and the copy engine as plain dicts and one float
  (when the link is next free), calling the LRU policy object (``candidates``,
  ``on_insert``, ``on_remove``, ``on_access``) as the engine does.

The other replays are written from the replay contract (design.md: a layer's experts are looked
up at its routing point under the layer's pins, a miss evicts unpinned resident victims in
the policy's order or, when none can make room, is copied to a staging buffer, copies are
served one at a time in issue order, the layer's experts run once all have arrived), not
from the engine's code; the script checks that each gives the engine's misses and the
engine's end time bit for bit, so all six time the same replay. What the others leave out
is what the engine's structure costs. The six run in turn ``--repeat`` times; each one's best
rate is printed.

    python benchmarks/simpy_ceiling.py [--tokens 300] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import time
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any

os.environ["MOESIM_NO_KERNEL"] = "1"

from moesim.config.scenario import load_scenario
from moesim.simulator.copyengine import BYPASS, DEMAND, DONE, KEY, NBYTES, CopyEngine
from moesim.simulator.engine import Simulation


def _setup(sc: Any, wl: Any) -> tuple[Simulation, dict[str, Any]]:
    sim = Simulation(sc, workload=wl)
    table, factor = sim.costs.ffn_table()
    ctx = sim.eviction.ctx
    return sim, {
        "ctx": ctx, "nbytes": ctx.precision_bytes[ctx.default_precision], "off": wl.off.tolist(),
        "layers": sim.model.num_layers, "passes": wl.num_passes, "table": table.tolist(),
        "factor": factor.tolist(), "nonexp": sim.costs.nonexpert_times().tolist(), "experts": wl.acc_expert,
        "tokens": wl.acc_tokens,
    }


def engine(sc: Any, wl: Any) -> tuple[int, float]:
    """The SimPy path: (misses, end of the last pass)."""
    res = Simulation(sc, workload=wl).run()
    assert res.summary.get("replay_path", "simpy") == "simpy"
    return int(res.steps["misses"].sum()), float(res.steps["end_s"].iloc[-1])


def _drive(s: dict[str, Any], layer_fn: Callable[[float, list[int], list[float]], float]) -> float:
    """Replay every (pass, layer) through ``layer_fn(start, keys, compute seconds)``, which
    returns the layer's length, and return the end of the last pass. The clock moves as the
    engine's process moves it (its timeouts): a layer starts at the previous start plus (the
    previous layer's length plus its non-expert time); a pass ends at its last layer's start
    plus that layer's length; a layer with no routing is skipped."""
    off, num_l, ctx, table = s["off"], s["layers"], s["ctx"], s["table"]
    now = carry = 0.0
    for p in range(s["passes"]):
        fac, ne = s["factor"][p], s["nonexp"][p]
        for layer in range(num_l):
            now += carry + ne
            carry = 0.0
            lo, hi = off[p * num_l + layer], off[p * num_l + layer + 1]
            if lo < hi:
                keys = ctx.layer_keys(layer, s["experts"][lo:hi].tolist())
                carry = layer_fn(now, keys, [table[n] * fac for n in s["tokens"][lo:hi].tolist()])
        now += carry
        carry = 0.0
    return now


def cache_copy(sc: Any, wl: Any) -> tuple[int, float]:
    """The engine's ExpertCache and CopyEngine under a flat loop: (misses, end time)."""
    sim, s = _setup(sc, wl)
    cache, nbytes = sim.cache, s["nbytes"]
    copy = cache.copy
    resident, inflight, on_access = cache.resident, cache.inflight, sim.eviction.on_access
    misses = 0

    def layer(now: float, keys: list[int], ffn: list[float]) -> float:
        nonlocal misses
        copy.advance(now)
        pinned = set(keys)
        ready, total = now, 0.0
        for key, f in zip(keys, ffn, strict=True):
            if key in resident:
                on_access(key)
                a = now
            elif key in inflight:
                on_access(key)
                tr = inflight[key]
                a = tr[DONE] if tr[DONE] >= now else now
            else:
                misses += 1
                got = cache.fetch(key, nbytes, pinned, True, now)
                if got is None:  # no room: a staging copy
                    tr = copy.submit(key, nbytes, DEMAND, now)
                    tr[BYPASS] = True
                else:
                    tr = got[1]
                a = tr[DONE] if tr[DONE] >= now else now
            if a > ready:
                ready = a
            total += f
        return ready + total - now

    end = _drive(s, layer)
    return misses, end


def dicts(sc: Any, wl: Any) -> tuple[int, float]:
    """Cache and link as dicts and a float, the LRU policy object as in the engine."""
    sim, s = _setup(sc, wl)
    nbytes, capacity = s["nbytes"], sim.cache.capacity
    policy = sim.eviction
    on_access, on_insert, on_remove, candidates = policy.on_access, policy.on_insert, policy.on_remove, policy.candidates
    dur = sim.copy.duration(nbytes)
    resident: dict[int, int] = {}
    inflight: dict[int, float] = {}  # key -> when its copy lands
    landing: deque[tuple[float, int]] = deque()  # (done, key) in issue (= finish) order
    link_free = 0.0
    used = 0
    misses = 0

    def victims_for(pinned: set[int]) -> list[int] | None:
        """Unpinned resident keys, in the policy's order, that make room; None if they cannot."""
        victims = []
        free = capacity - used
        for v in candidates():
            if v in resident and v not in pinned:
                victims.append(v)
                free += resident[v]
                if nbytes <= free:
                    return victims
        return None

    def layer(now: float, keys: list[int], ffn: list[float]) -> float:
        nonlocal misses, link_free, used
        while landing and landing[0][0] <= now:
            _, k = landing.popleft()
            del inflight[k]
            resident[k] = nbytes
        pinned = set(keys)
        ready, total = now, 0.0
        for key, f in zip(keys, ffn, strict=True):
            if key in resident:
                on_access(key)
                a = now
            elif key in inflight:
                on_access(key)
                a = inflight[key]
            else:
                misses += 1
                victims = [] if nbytes <= capacity - used else victims_for(pinned)
                start = link_free if link_free > now else now
                link_free = a = start + dur
                if victims is not None:  # else a staging copy: it takes the link, not the cache
                    landing.append((a, key))
                    for v in victims:
                        used -= resident.pop(v)
                        on_remove(v)
                    inflight[key] = a
                    used += nbytes
                    on_insert(key, True)
            if a > ready:
                ready = a
            total += f
        return ready + total - now

    end = _drive(s, layer)
    return misses, end


class _Link:
    """A copy engine at its least: one server, transfers as (done, key, bytes) in issue order;
    a copy lands as ``done``, a float."""

    def __init__(self, dur: float) -> None:
        self.dur = dur
        self.free = 0.0  # when the link is next free
        self.landing: deque[tuple[float, int, int]] = deque()
        self.on_complete: Callable[[int, int], None] = lambda key, nbytes: None

    def submit(self, key: int, nbytes: int, now: float, keep: bool) -> float:
        start = self.free if self.free > now else now
        done = self.free = start + self.dur
        if keep:
            self.landing.append((done, key, nbytes))
        return done

    def advance(self, now: float) -> None:
        landing = self.landing
        while landing and landing[0][0] <= now:
            _, key, nbytes = landing.popleft()
            self.on_complete(key, nbytes)


class _EngineLink:
    """The engine's copy engine behind the lean link's interface: a copy is its transfer
    record (one call more per copy, this adapter's)."""

    def __init__(self, copy: CopyEngine) -> None:
        self.copy = copy
        self.advance = copy.advance
        self.on_complete: Callable[[int, int], None] = lambda key, nbytes: None
        copy.on_complete.append(self._completed)

    def submit(self, key: int, nbytes: int, now: float, keep: bool) -> Any:
        tr = self.copy.submit(key, nbytes, DEMAND, now)
        if not keep:  # a staging copy
            tr[BYPASS] = True
        return tr

    def _completed(self, trs: list[Any]) -> None:
        for tr in trs:
            if not tr[BYPASS]:
                self.on_complete(tr[KEY], tr[NBYTES])


class _Cache:
    """A cache at its least, owning miss -> evict -> insert in one method; ``fetch`` returns
    what the link's ``submit`` gives (a copy's landing time, or its record)."""

    def __init__(self, capacity: float, policy: Any, link: Any) -> None:
        self.capacity, self.policy, self.link = capacity, policy, link
        self.resident: dict[int, int] = {}
        self.inflight: dict[int, Any] = {}  # key -> its copy, as the link gives it
        self.used = 0
        self.advance = link.advance
        link.on_complete = self.complete

    def complete(self, key: int, nbytes: int) -> None:
        del self.inflight[key]
        self.resident[key] = nbytes

    def fetch(self, key: int, nbytes: int, pinned: set[int], now: float) -> Any:
        """Evict, insert, submit (a staging copy when no room)."""
        free = self.capacity - self.used
        resident = self.resident
        victims = []
        if nbytes > free:
            for v in self.policy.candidates():
                if v in resident and v not in pinned:
                    victims.append(v)
                    free += resident[v]
                    if nbytes <= free:
                        break
            else:
                return self.link.submit(key, nbytes, now, False)
        on_remove = self.policy.on_remove
        for v in victims:
            self.used -= resident.pop(v)
            on_remove(v)
        got = self.inflight[key] = self.link.submit(key, nbytes, now, True)
        self.used += nbytes
        self.policy.on_insert(key, True)
        return got


class _EngineCache:
    """The engine's cache and copy engine behind the lean cache's interface (one call more per
    miss, this adapter's)."""

    def __init__(self, cache: Any) -> None:
        self.cache, self.copy = cache, cache.copy
        self.resident, self.inflight = cache.resident, cache.inflight
        self.advance = cache.copy.advance

    def fetch(self, key: int, nbytes: int, pinned: set[int], now: float) -> Any:
        got = self.cache.fetch(key, nbytes, pinned, True, now)
        if got is not None:
            return got[1]
        tr = self.copy.submit(key, nbytes, DEMAND, now)  # no room: a staging copy
        tr[BYPASS] = True
        return tr


class _Row:
    __slots__ = ("hits", "late", "misses")

    def __init__(self) -> None:
        self.hits = self.late = self.misses = 0


def structured(sc: Any, wl: Any, pieces: str = "lean") -> tuple[int, float]:
    """The engine-core issue's structure with nothing else: a SimPy process of one timeout per
    layer, a lookup object whose method (called per expert, as the engine's) calls the cache's
    one fetch method (evict, insert, submit) on a miss, a copy engine object, a per-pass row
    object; each as lean as the replay contract allows (no transfer records, no decision log,
    no prefetch or timeline hooks, no list of computations). ``pieces``: ``copy`` puts the
    engine's copy engine under the lean cache, ``cache`` the engine's cache and copy engine
    under the lean lookup."""
    import simpy

    sim, s = _setup(sc, wl)
    policy = sim.eviction
    cache: Any
    if pieces == "cache":
        cache = _EngineCache(sim.cache)
    else:
        link = _Link(sim.copy.duration(s["nbytes"])) if pieces == "lean" else _EngineLink(CopyEngine(sim.copy.link))
        cache = _Cache(sim.cache.capacity, policy, link)
    records = pieces != "lean"  # a copy is its transfer record, landing at DONE
    nbytes, off, num_l, ctx = s["nbytes"], s["off"], s["layers"], s["ctx"]
    rows: list[_Row] = []

    class Lookup:
        def __init__(self) -> None:
            self.row = _Row()
            self.keys: list[int] = []

        def lookup(self, i: int, pinned: set[int], now: float) -> float:
            """When the layer's ``i``-th expert is on the GPU."""
            key = self.keys[i]
            if key in cache.resident:
                self.row.hits += 1
                policy.on_access(key)
                return now
            got = cache.inflight.get(key)
            if got is not None:
                self.row.late += 1
                policy.on_access(key)
            else:
                self.row.misses += 1
                got = cache.fetch(key, nbytes, pinned, now)
            done = got[DONE] if records else got
            return done if done > now else now

    look = Lookup()
    env = simpy.Environment()

    def process() -> Any:
        carry = 0.0
        for p in range(s["passes"]):
            look.row = row = _Row()
            fac, ne = s["factor"][p], s["nonexp"][p]
            for layer in range(num_l):
                delay = carry + ne
                if delay > 0:
                    yield env.timeout(delay)
                carry = 0.0
                lo, hi = off[p * num_l + layer], off[p * num_l + layer + 1]
                if lo < hi:
                    now = env.now
                    cache.advance(now)
                    look.keys = keys = ctx.layer_keys(layer, s["experts"][lo:hi].tolist())
                    ffn = [s["table"][n] * fac for n in s["tokens"][lo:hi].tolist()]
                    pinned = set(keys)
                    ready = now
                    for i in range(len(keys)):
                        a = look.lookup(i, pinned, now)
                        if a > ready:
                            ready = a
                    carry = ready + sum(ffn) - now
            if carry > 0:
                yield env.timeout(carry)
                carry = 0.0
            rows.append(row)

    env.process(process())
    env.run()
    return sum(r.misses for r in rows), env.now


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=300, help="decode tokens per request (4 requests)")
    ap.add_argument("--repeat", type=int, default=3, help="timed rounds (the three replays in turn); best kept")
    args = ap.parse_args()
    sc = load_scenario("quickstart", [f"workload.trace.synth.tokens={args.tokens}", "policies.eviction=lru",
                                      "policies.prefetch=none"])
    wl = Simulation(sc).wl
    accesses = int(wl.off[-1])
    replays: dict[str, Callable[[Any, Any], tuple[int, float]]] = {
        "engine": engine, "cache+copy": cache_copy, "structured": structured,
        "+engine copy": partial(structured, pieces="copy"), "+engine cache": partial(structured, pieces="cache"),
        "dicts": dicts,
    }
    ref = engine(sc, wl)  # also the warm-up
    best = dict.fromkeys(replays, 0.0)
    for _ in range(args.repeat):
        for name, fn in replays.items():
            t0 = time.perf_counter()
            got = fn(sc, wl)
            best[name] = max(best[name], accesses / (time.perf_counter() - t0))
            assert got == ref, f"{name} replays something else: (misses, end) {got} != engine's {ref}"
    print(f"{accesses} accesses, {ref[0]} misses, end {ref[1]!r} s; best of {args.repeat}:")
    for name, rate in best.items():
        print(f"{name:>16}: {rate / 1e3:6.0f} k accesses/s  ({rate / best['engine']:.2f}x the engine)")


if __name__ == "__main__":
    main()

"""How fast could a pure-Python replay go? The SimPy path against two minimal loops over the
same access stream (not a test; a measurement for the engine-core issue's 2x target).

The setup is ``simpy_rate.py``'s LRU one: the quickstart scenario (OLMoE-like, 16 layers x 64
experts, top-8, 5% capacity, A100 + PCIe 4), LRU, fetch on a miss, no prefetch, ``layer``
execution, batch 1, full timing. Three replays of it, each timed after one warm-up:

- ``engine``: the SimPy path (``Simulation.run`` with ``MOESIM_NO_KERNEL=1``).
- ``cache+copy``: one flat loop that keeps the engine's cache and copy engine: it calls
  ``ExpertCache.fetch`` on a miss and ``CopyEngine.advance`` at each routing point, and
  replaces everything above them (the SimPy process, ``LayerLookup``, the pass rows, the
  decision-log and prefetch hooks) with local variables.
- ``dicts``: the same loop with the cache and the copy engine as plain dicts and one float
  (when the link is next free), calling the LRU policy object (``candidates``,
  ``on_insert``, ``on_remove``, ``on_access``) as the engine does.

The two loops are written from the replay contract (design.md: a layer's experts are looked
up at its routing point under the layer's pins, a miss evicts unpinned resident victims in
the policy's order or, when none can make room, is copied to a staging buffer, copies are
served one at a time in issue order, the layer's experts run once all have arrived), not
from the engine's code; the script checks that each gives the engine's misses and the
engine's end time bit for bit, so the three time the same replay. What the loops leave out is
what the engine's structure costs.

    python benchmarks/simpy_ceiling.py [--tokens 300]
"""

from __future__ import annotations

import argparse
import os
import time
from collections import deque
from typing import Any

os.environ["MOESIM_NO_KERNEL"] = "1"

from moesim.config.scenario import load_scenario
from moesim.simulator.copyengine import DEMAND
from moesim.simulator.engine import Simulation


def _setup(sc: Any, wl: Any) -> tuple[Simulation, dict[str, Any]]:
    sim = Simulation(sc, workload=wl)
    sim._prepare_costs()
    ctx = sim.eviction.ctx
    return sim, {
        "ctx": ctx, "nbytes": ctx.precision_bytes[ctx.default_precision], "off": wl.off.tolist(),
        "layers": sim.model.num_layers, "passes": wl.num_passes, "table": sim.ffn_by_tokens,
        "factor": sim.ffn_factor, "nonexp": sim._nonexp, "experts": wl.acc_expert, "tokens": wl.acc_tokens,
    }


def engine(sc: Any, wl: Any) -> tuple[int, float]:
    """The SimPy path: (misses, end of the last pass)."""
    res = Simulation(sc, workload=wl).run()
    assert res.summary.get("replay_path", "simpy") == "simpy"
    return int(res.steps["misses"].sum()), float(res.steps["end_s"].iloc[-1])


def _layers(s: dict[str, Any]) -> Any:
    """Each (pass, layer): its non-expert seconds, keys, compute seconds and whether it ends
    the pass. The loops move the clock as the engine's process does (its timeouts): a layer
    starts at the previous start plus (the previous layer's length plus its non-expert time);
    a pass ends at its last layer's start plus that layer's length."""
    off, num_l, ctx, table = s["off"], s["layers"], s["ctx"], s["table"]
    for p in range(s["passes"]):
        fac, ne = s["factor"][p], s["nonexp"][p]
        for layer in range(num_l):
            lo, hi = off[p * num_l + layer], off[p * num_l + layer + 1]
            keys = ctx.layer_keys(layer, s["experts"][lo:hi].tolist()) if lo < hi else []
            yield ne, keys, [table[n] * fac for n in s["tokens"][lo:hi].tolist()], layer == num_l - 1


def cache_copy(sc: Any, wl: Any) -> tuple[int, float]:
    """The engine's ExpertCache and CopyEngine under a flat loop: (misses, end time)."""
    sim, s = _setup(sc, wl)
    cache, nbytes = sim.cache, s["nbytes"]
    copy = cache.copy
    resident, inflight, on_access = cache.resident, cache.inflight, sim.eviction.on_access
    now = carry = 0.0
    misses = 0
    for ne, keys, ffn, last in _layers(s):
        now += carry + ne
        carry = 0.0
        if not keys:  # no routing: the layer is skipped
            continue
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
                a = tr.done if tr.done >= now else now
            else:
                misses += 1
                got = cache.fetch(key, nbytes, pinned, True, now)
                if got is None:  # no room: a staging copy
                    tr = copy.submit(key, nbytes, DEMAND, now)
                    tr.bypass = True
                else:
                    tr = got[1]
                a = tr.done if tr.done >= now else now
            if a > ready:
                ready = a
            total += f
        carry = ready + total - now
        if last:
            now += carry
            carry = 0.0
    return misses, now


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
    now = carry = 0.0
    misses = 0
    for ne, keys, ffn, last in _layers(s):
        now += carry + ne
        carry = 0.0
        if not keys:  # no routing: the layer is skipped
            continue
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
                victims: list[int] | None = []
                free = capacity - used
                if nbytes > free:
                    for v in candidates():
                        if v in resident and v not in pinned:
                            victims.append(v)  # type: ignore[union-attr]
                            free += resident[v]
                            if nbytes <= free:
                                break
                    else:
                        victims = None
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
        carry = ready + total - now
        if last:
            now += carry
            carry = 0.0
    return misses, now


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=300, help="decode tokens per request (4 requests)")
    args = ap.parse_args()
    sc = load_scenario("quickstart", [f"workload.trace.synth.tokens={args.tokens}", "policies.eviction=lru",
                                      "policies.prefetch=none"])
    wl = Simulation(sc).wl
    accesses = int(wl.off[-1])
    ref = None
    base = None
    for name, fn in (("engine", engine), ("cache+copy", cache_copy), ("dicts", dicts)):
        fn(sc, wl)  # warm-up
        t0 = time.perf_counter()
        got = fn(sc, wl)
        rate = accesses / (time.perf_counter() - t0)
        if ref is None:
            ref, base = got, rate
        assert got == ref, f"{name} replays something else: (misses, end) {got} != engine's {ref}"
        assert base is not None
        print(f"{name:>10}: {rate / 1e3:6.0f} k accesses/s  ({rate / base:.2f}x the engine; "
              f"misses {got[0]}, end {got[1]!r} s)")


if __name__ == "__main__":
    main()

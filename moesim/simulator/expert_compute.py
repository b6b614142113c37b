"""How a layer's experts run on the SimPy process's compute stream once its routing point is
reached (``expert_compute``; ``docs/concepts/execution.md``): :func:`fused` for ``layer``
and ``on-arrival`` execution (the experts looked up all at once), :func:`per_expert` for
``per-expert`` execution (looked up and run one after another). ``sim`` is the replay
(:class:`simulator.engine.Simulation`): its pass row, clock, copy engine, prefetch queue,
host thread and decision log. The compiled kernel's ``kernel_compute`` makes the same
decisions in the same order."""

from __future__ import annotations

from typing import Any

from moesim.simulator.copyengine import DONE
from moesim.simulator.lookup import LayerLookup, Run, arrival


def fused(sim: Any, runs: list[Run], now: float, on_arrival: bool) -> float:
    """``layer`` execution: the experts run once all have arrived, back to back (a fused
    kernel): end = max(arrivals) + sum(compute). ``on-arrival``: each as soon as it has
    arrived, in arrival order: t = max(t, arrival) + compute. Stall is the time the
    compute stream waits. Returns the layer's end."""
    row = sim.row
    host = sim.host.on
    if not on_arrival:
        ready = now
        total = 0.0
        for _, tr, f in runs:  # ready >= now: a transfer done by now cannot raise it
            if tr is not None and tr[DONE] > ready:
                ready = tr[DONE]
            total += f
        row.stall += ready - now
        if host and runs:  # one launch for the layer's experts
            sim.host.t += sim.host.launch_s
            if sim.host.t > ready:
                ready = sim.host.t
        return ready + total
    t = now
    for a, f in sorted((arrival(tr, now), f) for _, tr, f in runs):
        if host:  # one launch per expert, after the GPU has run the last (host_sync: expert)
            if sim.host.sync == 2:
                sim.host.wait_until(t)
            sim.host.t += sim.host.launch_s
        if a > t:
            row.stall += a - t
            t = a
        if host and sim.host.t > t:
            t = sim.host.t
        t += f
    return t

def per_expert(sim: Any, look: LayerLookup, now: float) -> float:
    """``per-expert`` execution (SpecMD Algorithm 1, appendix A.2: a Hugging Face-style
    loop): the layer's experts run one after another in router order. Pinned are the
    running expert and the one looked up next (transfers in flight are never evicted).
    When an expert has run its pin is released and the waiting prefetch proposals are
    admitted (:meth:`simulator.prefetchq.PrefetchQueue.admit`) — after the demand lookup made at that same
    instant, if any: a freed slot goes to demand first. ``expert_fetch``:

    - ``pipelined``: expert j+1 is looked up when expert j starts to run, so its copy
      overlaps j's compute. When j ends and j+1 has arrived (j+1 starts at once), j+2's
      lookup comes first, then the admission round with j+1 and j+2 pinned; when j+1 is
      still in flight, the round (j+1 pinned) comes first and j+2 is looked up when j+1
      starts. With compute f and copy c per expert and every expert missing, n experts
      take c + (n - 1) * max(c, f) + f.
    - ``blocking`` (A.2: "fetch blocks until the expert loads from CPU"): expert j+1 is
      looked up when j ends, before the admission round, which then pins j+1; its copy
      does not overlap j's compute: n missing experts take n * (c + f).

    Returns the layer's end."""
    clock = sim.clock
    advance = sim.copy.advance
    timing = sim.scenario.timing
    blocking = sim.scenario.expert_fetch == "blocking"
    row = sim.row
    pfq = sim.pfq
    n = len(look)
    t = now
    cur: list[Run] = []
    nxt: list[Run] = []  # the computations of the expert looked up next, if any
    looked = 0  # experts looked up so far
    host = sim.host.on
    if n:
        sim.host.lookup(look, 0, set(), t, cur)
        looked = 1
    launched = False  # whether expert i's launch is issued already (it started at once)
    issued = 0.0  # when the host issued expert i's launch
    for i in range(n):
        if host and not launched:
            issued = sim.host.issue(cur, t, blocking)
        launched = False
        for _, tr, _ in cur:
            a = arrival(tr, t)
            if a > t:
                row.stall += a - t
                t = a
        if host and issued > t:  # the GPU waits for the host to launch expert i
            t = issued
        if timing:
            advance(t)
            clock.now = t
        pins = {key for key, _, _ in cur}  # the running expert
        if not blocking and looked == i + 1 and looked < n:
            nxt = []
            sim.host.lookup(look, looked, set(pins), t, nxt)
            looked += 1
        for _, _, f in cur:
            t += f
        if timing:
            advance(t)
            clock.now = t
        clock.pending.discard(look.keys[i])  # expert i has run
        if sim.decisions is not None:
            sim.decisions.extend((look.at, look.layer, "run", k) for k in pins)
        if blocking:
            nxt = []
            if looked < n:
                sim.host.lookup(look, looked, set(), t, nxt)
                looked += 1
        elif (looked == i + 2 and looked < n and all(arrival(tr, t) <= t for _, tr, _ in nxt)
              and (not host or sim.host.ready(t))):
            held = {key for key, _, _ in nxt}
            after: list[Run] = []  # expert i+1 starts now: i+2's lookup comes first
            if host:  # i+1's launch, then i+2's copies
                issued = sim.host.issue(nxt, t, False)
                launched = True
            sim.host.lookup(look, looked, set(held), t, after)
            looked += 1
            if pfq.waiting:
                pfq.admit(t, held | {key for key, _, _ in after}, row)
            cur, nxt = nxt, after
            continue
        if pfq.waiting:  # nxt: the expert looked up next, held while it waits or runs
            pfq.admit(t, {key for key, _, _ in nxt}, row)
        cur = nxt
        nxt = []
    look.finish([])
    return t

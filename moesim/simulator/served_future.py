"""The future an eviction policy that reads it (``reads_future``: Belady) sees under load.

Serving forms each pass when the one before ends, so which passes come, and with which tokens,
depends on how long the passes take, and so on the policy's own decisions: the future of a
served run is known only once it has run. :func:`settle` finds it as a fixed point. A run's
*schedule* is its passes' expert accesses, in order (the cache keys and each pass's first
access). The first run reads a future of nothing after the pass being replayed; each next run
reads, after its pass ``p``, the accesses of the schedule the run before it made, from that
schedule's pass ``p + 1`` on (:class:`Reference`); within a pass every policy sees the pass's
own accesses exactly. When a run makes the very schedule it read, the future it read was its own:
its decisions are the policy's on the realised access stream (Belady's MIN over it), as a
fixed-batch replay of that schedule makes them, bit for bit (``tests/test_serving.py``). The
summary says how many runs came before the reported one (``future_runs``) and whether the
reported one read its own future (``future_exact``); after :data:`MAX_RUNS` runs without a fixed
point it reads the last schedule made, which is not its own: its decisions are then not the
optimum's, and ``future_note`` says so. (A policy that changes the serving's pace much, as
Belady does against LRU on a loaded GPU, changes which tokens meet in a pass from run to run:
the runs agree on a longer prefix of passes each time, but may need many more runs than
:data:`MAX_RUNS` to agree on all.)"""

from __future__ import annotations

from typing import Any

import numpy as np

MAX_RUNS = 8  # runs to reach a schedule that reads its own future, the reported one included


class Reference:
    """A served run's schedule read as the future of the next run: ``keys``, its accesses as
    cache keys, and ``bounds``, each pass's first access (and the end). :meth:`after` is asked
    for the passes in order, from 0."""

    def __init__(self, keys: np.ndarray, bounds: np.ndarray, num_keys: int) -> None:
        self.keys = np.asarray(keys, np.int64)
        self.bounds = np.asarray(bounds, np.int64)
        n = len(self.keys)
        order = np.argsort(self.keys, kind="stable")
        nxt = np.full(n, -1, np.int64)  # each access's next access of the same key
        same = self.keys[order[1:]] == self.keys[order[:-1]]
        nxt[order[:-1][same]] = order[1:][same]
        self._next = nxt
        first = np.full(num_keys, -1, np.int64)  # each key's first access over the schedule
        uniq, at = np.unique(self.keys, return_index=True)
        first[uniq] = at
        self._start = first
        self._first = first.copy()  # each key's first access from pass ``_pass`` on
        self._pass = 0

    @property
    def passes(self) -> int:
        return len(self.bounds) - 1

    def equals(self, keys: np.ndarray, bounds: np.ndarray) -> bool:
        """Whether a run's schedule is this one."""
        return np.array_equal(self.keys, keys) and np.array_equal(self.bounds, bounds)

    def after(self, p: int) -> np.ndarray:
        """Each key's first access in this schedule from its pass ``p + 1`` on, counted from
        that pass's first access (-1: none, and for every key past the schedule's end). A run
        asks for its passes in order; a pass before the last one asked starts again (the next run)."""
        if p < self._pass - 1:
            self._first, self._pass = self._start.copy(), 0
        while self._pass <= p and self._pass < self.passes:  # move past pass ``_pass``
            lo, hi = self.bounds[self._pass], self.bounds[self._pass + 1]
            nxt = self._next[lo:hi]
            last = (nxt < 0) | (nxt >= hi)  # each key's last access in the pass
            self._first[self.keys[lo:hi][last]] = nxt[last]
            self._pass += 1
        if p + 1 >= self.passes:
            return np.full(len(self._first), -1, np.int64)
        start = self.bounds[p + 1]
        return np.where(self._first >= 0, self._first - start, -1)


def settle(sim: Any) -> None:
    """Find the future the served run ``sim`` (not yet run) reads: run the scenario again, each
    run reading the schedule of the one before (the first, none), until a run makes the schedule
    it read, or :data:`MAX_RUNS` - 1 runs; ``sim`` then reads the last schedule made
    (``Source.reference``), and ``Source.future_runs`` counts the runs before it."""
    from moesim.simulator.engine import Simulation

    num_keys = sim.model.num_layers * sim.model.num_experts  # a schedule's keys: layer * experts + expert
    ref = Reference(np.zeros(0, np.int64), np.zeros(1, np.int64), num_keys)
    runs = 0
    while runs < MAX_RUNS - 1:
        run = Simulation(sim.scenario, trace=sim.source.trace, keep_rows=False)
        run.source.reference = ref
        run.run()
        runs += 1
        keys, bounds = run.source.schedule()
        if ref.equals(keys, bounds):
            break
        ref = Reference(keys, bounds, num_keys)
    sim.source.reference, sim.source.future_runs = ref, runs

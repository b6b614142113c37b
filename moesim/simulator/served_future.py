"""The future an eviction policy that reads it (``reads_future``: Belady) sees under load.

Serving forms each pass when the one before ends, so which tokens meet in a pass depends on
how long the passes take, and so on the policy's own decisions: the future of a served run is
known only once it has run. What is known before is which tokens are still to come (every
request's tokens, from the trace and the arrival schedule); what is not is their order.
:func:`settle` finds it as a fixed point. A run's *schedule* is its passes, each with the tokens
it processed and its expert accesses (:class:`Pass`). The first run reads no future after the
pass being replayed; each next run reads, after each pass, each key's next access among the
tokens it has not processed yet, in the order the schedule of the run before it processed them
(:class:`Reference`); within a pass every policy sees the pass's own accesses exactly. When a
run serves the very schedule it read, its future was its own: its decisions are the policy's on
the realised access stream (Belady's MIN over it), as a fixed-batch replay of those passes makes
them, bit for bit (``tests/test_serving.py``). The summary says how many runs came before the
reported one (``future_runs``) and whether the reported one read its own future
(``future_exact``); after :data:`MAX_RUNS` runs without a fixed point it reads the last schedule
served, which is not its own: its decisions are then not the optimum's, and ``future_note``
says so. (A policy that changes the serving's pace much, as Belady does against LRU on a loaded
GPU, changes which tokens meet in a pass from run to run: the runs agree on a longer prefix of
passes each time, but may need many more runs than :data:`MAX_RUNS` to agree on all.)"""

from __future__ import annotations

from typing import Any

import numpy as np

MAX_RUNS = 8  # runs to reach a schedule that reads its own future, the reported one included


class Pass:
    """One served pass of a schedule: its accesses (``keys``: layer * experts + expert, each
    once), the tokens it processed (``tokens``: (request << 32 | position) << 8 | how many times
    the run had processed that token before, up to 255: a preempted request's tokens are
    processed again), and which token reaches which access (``pair_token``, ``pair_access``:
    indices into the two)."""

    __slots__ = ("keys", "pair_access", "pair_token", "tokens")

    def __init__(self, wl: Any, times: dict[int, int]) -> None:
        self.keys = wl.keys()
        tr = wl.trace
        num_e = wl.model.num_experts
        code = (tr.request.astype(np.int64) << 32) | tr.position.astype(np.int64)
        uniq, row_token = np.unique(code, return_inverse=True)
        again = np.array([times.get(c, 0) for c in uniq.tolist()], np.int64)
        for c in uniq.tolist():
            times[c] = times.get(c, 0) + 1
        self.tokens = (uniq << 8) | np.minimum(again, 255)
        k = tr.experts.shape[1]
        routed = tr.experts.reshape(-1).astype(np.int64)
        pair_key = np.repeat(tr.layer.astype(np.int64) * num_e, k) + routed
        keep = routed >= 0
        order = np.argsort(self.keys, kind="stable")
        at = order[np.searchsorted(self.keys[order], pair_key[keep])]
        self.pair_access = at
        self.pair_token = np.repeat(row_token, k)[keep]

    def same(self, other: Pass) -> bool:
        return np.array_equal(self.keys, other.keys) and np.array_equal(self.tokens, other.tokens)


class Reference:
    """A served run's schedule (its :class:`Pass` records, in order) read as the future of the
    next run: after a pass of that run, each key's next access is the first access, in this
    schedule's order, that a token the run has not processed yet reaches (:meth:`reader`). The
    set of tokens still to come is exact (every request's tokens from the trace and the arrival
    schedule); their order is this schedule's. When the run serves this very schedule, that is
    each key's next access in the run."""

    def __init__(self, passes: list[Pass], num_keys: int) -> None:
        self.passes = passes
        firsts = np.cumsum([0] + [len(q.keys) for q in passes])
        tok_base = np.cumsum([0] + [len(q.tokens) for q in passes])
        codes = np.concatenate([q.tokens for q in passes]) if passes else np.zeros(0, np.int64)
        key = np.concatenate([q.keys[q.pair_access] for q in passes]) if passes else np.zeros(0, np.int64)
        pos = (np.concatenate([firsts[i] + q.pair_access for i, q in enumerate(passes)]) if passes
               else np.zeros(0, np.int64))
        tok = (np.concatenate([tok_base[i] + q.pair_token for i, q in enumerate(passes)]) if passes
               else np.zeros(0, np.int64))
        # each token's pass's end in the schedule (where a run that has just processed it stands)
        self.tok_end = np.repeat(firsts[1:], [len(q.tokens) for q in passes]).astype(np.int64)
        order = np.lexsort((pos, key))  # each key's (token, access) pairs in the schedule's order
        # (and past the last pair one more position, which :meth:`Reader.after` never reads)
        self.pair_pos, self.pair_tok = np.append(pos[order], -1), tok[order]
        self.seg = np.searchsorted(key[order], np.arange(num_keys + 1))
        self.code_order = np.argsort(codes, kind="stable")
        self.codes = codes[self.code_order]

    def same(self, passes: list[Pass]) -> bool:
        """Whether a run served this schedule (the same tokens and accesses, pass by pass)."""
        return len(passes) == len(self.passes) and all(a.same(b) for a, b in zip(passes, self.passes, strict=True))

    def reader(self) -> Reader:
        """A run's reading of this schedule, from its first pass."""
        return Reader(self)


class Reader:
    """One run's place in a :class:`Reference`: the tokens it has processed, and each key's
    first pair in the schedule's order whose token it has not."""

    def __init__(self, ref: Reference) -> None:
        self.ref = ref
        self.done = np.zeros(len(ref.codes), bool)
        self.ptr = ref.seg[:-1].copy()

    def after(self, tokens: np.ndarray) -> tuple[np.ndarray, int | None]:
        """Once the run has processed ``tokens`` (a pass's, coded as :class:`Pass` codes them):
        each key's next access in the schedule, as its position there (-1: none), and where in
        the schedule the run stands: the end of the latest pass that processed one of the
        tokens (None: the schedule processed none of them)."""
        ref = self.ref
        at = np.searchsorted(ref.codes, tokens)
        found = at < len(ref.codes)
        found[found] = ref.codes[at[found]] == tokens[found]
        idx = ref.code_order[at[found]]  # (a token the schedule never processed: none)
        self.done[idx] = True
        stand = int(ref.tok_end[idx].max()) if len(idx) else None
        ptr, end = self.ptr, ref.seg[1:]
        while True:
            live = np.flatnonzero(ptr < end)
            stale = live[self.done[ref.pair_tok[ptr[live]]]]
            if not len(stale):
                break
            ptr[stale] += 1
        return np.where(ptr < end, ref.pair_pos[ptr], -1), stand


def settle(sim: Any) -> None:
    """Find the future the served run ``sim`` (a :class:`simulator.engine.Simulation`, not yet
    run) reads: run the scenario again (a replay of ``sim``'s class), each run reading the
    schedule of the one before (the first, none), until a run serves the schedule it read, or
    :data:`MAX_RUNS` - 1 runs; ``sim`` then reads the last schedule served
    (``Source.reference``), and ``Source.future_runs`` counts the runs before it."""
    num_keys = sim.model.num_layers * sim.model.num_experts  # a schedule's keys: layer * experts + expert
    ref = Reference([], num_keys)
    runs = 0
    while runs < MAX_RUNS - 1:
        run = type(sim)(sim.scenario, trace=sim.source.trace, keep_rows=False)
        run.source.reference = ref
        run.run()
        runs += 1
        if ref.same(run.source.schedule):
            break
        ref = Reference(run.source.schedule, num_keys)
    sim.source.reference, sim.source.future_runs = ref, runs

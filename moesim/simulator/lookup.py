"""The one lookup path (``docs/design.md`` steps 2-5 and 7): every routing, budget, batch and
execution mode looks a layer's experts up here, one at a time, under the pinning rule the
caller passes.

:class:`LayerLookup` plans a (pass, layer) at its routing point: the experts the layer needs
in router order (the order in which they first appear in the layer's routing, token by token
and rank by rank), after the routing policy (dual-logit semantics: original weights mix) and
the budget policy. When neither changes routing and the miss policy always fetches, the plan
is read from the workload's flat arrays with no per-token work; otherwise each token's expert
set is tracked so that ``gate_mass_retained`` and ``tokens_altered`` can be counted.

:meth:`LayerLookup.lookup` looks one expert up: resident -> *hit*; its transfer in flight ->
*late prefetch* (a queued prefetch is promoted to demand priority); absent -> *miss*, counted
as a *collision miss* when the expert was evicted earlier in the same pass, and handled by the
miss policy (fetch, at a precision with fallbacks, after the cache has made room by evicting
unpinned victims; drop; substitute; speculate). It returns the expert computations
(:class:`Run`) the lookup leads to. Every count lands in the pass's :class:`PassRow`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from moesim.policies.budget import BudgetPolicy
from moesim.policies.eviction import EvictionPolicy
from moesim.policies.miss import MissInfo, MissPolicy
from moesim.policies.registry import Clock
from moesim.policies.routing import RoutingPolicy
from moesim.simulator.cache import ExpertCache
from moesim.simulator.copyengine import (
    BYPASS,
    DEMAND,
    DONE,
    PRIORITY,
    STARTED,
    CopyEngine,
    Transfer,
)
from moesim.simulator.cost import CostModel
from moesim.simulator.workload import Workload


class Replay(Protocol):
    """What the lookup path reads of the replay it serves (a
    :class:`simulator.engine.Simulation`; named structurally so that this module does not
    import the engine that imports it)."""

    wl: Workload
    clock: Clock  # the policies' clock: ``pass_index`` numbers the passes over the whole replay
    eviction: EvictionPolicy
    miss: MissPolicy
    routing: RoutingPolicy
    budget: BudgetPolicy
    cache: ExpertCache
    copy: CopyEngine
    cost: CostModel
    general: bool  # routing, budget or miss policy may change what a token computes
    timing: bool  # False: cache-only replay (zero-cost compute, instant transfers)
    ffn_by_tokens: list[float]  # expert compute seconds by the tokens routed to it (``ffn_table``)
    ffn_factor: list[float]  # per pass: the expert-compute factor (sparse verification)
    decisions: list[tuple[int, int, str, int]] | None  # the decision log, when recorded
    pf_unused: set[int]  # prefetched keys not accessed yet

    @property
    def acc_keys(self) -> np.ndarray:
        """The cache key of every expert access."""


@dataclass
class PassRow:
    """Everything counted for one forward pass: the only place per-pass figures are kept
    until the engine writes them to ``steps.parquet``."""

    hits: int = 0
    misses: int = 0
    late: int = 0
    collisions: int = 0
    uncached: int = 0
    low_precision: int = 0
    dropped: int = 0
    substituted: int = 0
    pf_issued: int = 0
    pf_used: int = 0
    pf_cancelled: int = 0
    pred_hits: int = 0
    pred_total: int = 0
    actual_total: int = 0
    unique: int = 0
    stall: float = 0.0
    mass_total: float = 0.0
    mass_kept: float = 0.0
    altered: set[tuple[int, int]] = field(default_factory=set)
    ep_bytes: int = 0  # expert parallelism: all-to-all bytes (dispatch and combine)
    ep_loads: list[int] = field(default_factory=list)  # expert parallelism: per layer, the busiest GPU's experts

    def count_tokens(self, wl: Workload, rows: np.ndarray, orig: np.ndarray, final: list[set[int]]) -> dict[int, int]:
        """Count a layer's computed experts (``unique``), gate mass and altered tokens from
        what each token of ``rows`` finally computes; returns the tokens of each expert."""
        total, kept, altered = token_mass(wl, rows, orig, final)
        self.mass_total += total
        self.mass_kept += kept
        self.altered |= altered
        tokens_of: dict[int, int] = {}
        for fin in final:
            for e in fin:
                tokens_of[e] = tokens_of.get(e, 0) + 1
        self.unique += len(tokens_of)
        return tokens_of


Run = tuple[int, "Transfer | None", float]
"""One expert computation: its cache key, the transfer it waits for (None: resident when
looked up; it has arrived once ``done``) and its compute time in seconds. A plain tuple: the
SimPy path makes one per expert access."""


def arrival(tr: Transfer | None, now: float) -> float:
    """When a computation's weights are on the GPU: ``now`` if they were resident when looked
    up or have landed by ``now``, else when its transfer ends."""
    return now if tr is None or tr[DONE] < now else tr[DONE]


class LayerLookup:
    """The lookups of a replay's layers, one (pass, layer) at a time (module docstring): made
    once per replay, planned by :meth:`plan` at each layer's routing point."""

    def __init__(self, sim: Replay, evicted: set[int]) -> None:
        self.sim = sim
        self.evicted = evicted  # keys evicted in the current pass (the cache's; the replay clears it)
        ctx = sim.eviction.ctx
        self.ctx = ctx
        self.plain = not sim.general
        cache = sim.cache
        self.cache = cache
        self.resident = cache.resident
        self.inflight = cache.inflight
        self.cached = cache.__contains__  # whether a key is resident or in flight
        self.on_access = sim.eviction.on_access
        self.instant = sim.copy.instant
        self.pf_unused = sim.pf_unused  # prefetched keys not accessed yet
        self.default = ctx.default_precision
        self.default_levels = (ctx.default_precision,)
        self.rec = sim.decisions  # the decision log, when recorded
        self.always_fetch = sim.miss.always_fetch  # a miss is fetched at the default precision
        self.p = self.layer = 0
        self.at = 0  # the pass's number over the whole replay (the decision log's; under load p is 0)
        self.row = PassRow()
        self.experts: list[int] = []
        self.keys: list[int] = []
        self.ffn: list[float] = []
        self.ranks: list[int] | None = None
        self.toks: list[list[int]] | None = None

    def plan(self, p: int, layer: int, lo: int, hi: int, row: PassRow) -> None:
        """Plan (pass ``p``, ``layer``), whose accesses are ``lo:hi`` of the workload, at its
        routing point; its counts go to ``row``."""
        sim = self.sim
        self.p = p
        self.at = sim.clock.pass_index
        self.layer = layer
        self.row = row
        ctx = self.ctx
        if self.plain:
            experts = sim.wl.acc_expert[lo:hi].tolist()
            self.experts = experts
            table, factor = sim.ffn_by_tokens, sim.ffn_factor[p]
            self.ffn = [table[n] * factor for n in sim.wl.acc_tokens[lo:hi].tolist()]
            self.keys = ctx.layer_keys(layer, experts)
            return
        rows = sim.wl.rows(p, layer)
        self.rows = rows
        self.orig, chosen = plan(sim, self.at, layer, rows, self.cached)
        self.experts, self.ranks, self.toks = router_order(chosen)
        self.keys = ctx.layer_keys(layer, self.experts)
        self.routed = frozenset(self.experts)
        self.final = [set(map(int, c)) for c in chosen]
        self.key_for: dict[int, int] = {}  # expert computed -> the cache key it computes from
        self.pred_order: list[list[int]] | None = None
        self.scale = sim.ffn_factor[p] if sim.timing else 0.0  # cache-only: compute is free

    def __len__(self) -> int:
        return len(self.experts)

    # -- one lookup --------------------------------------------------------------------------
    def lookup(self, i: int, pinned: set[int], now: float, runs: list[Run]) -> None:
        """Look up the layer's ``i``-th expert at time ``now`` and append the expert
        computations it leads to to ``runs``; ``pinned`` holds the keys that must not be
        evicted (any key the expert is computed from is added: a fetched or lower-precision
        copy, a substitute)."""
        key = self.keys[i]
        row = self.row
        if key in self.resident:
            row.hits += 1
            self.on_access(key)
            if self.pf_unused:
                self._used_prefetch(key)
            if self.rec is not None:
                self.rec.append((self.at, self.layer, "hit", key))
            runs.append((key, None, self.ffn[i]) if self.plain else self._run(i, key, None))
            return
        tr = self.inflight.get(key)
        if tr is not None:
            row.late += 1
            self.on_access(key)
            if self.pf_unused:
                self._used_prefetch(key)
            if tr[PRIORITY] != DEMAND and not tr[STARTED]:
                self.sim.copy.promote(tr)
            if self.rec is not None:
                self.rec.append((self.at, self.layer, "hit", key))
            runs.append((key, tr, self.ffn[i]) if self.plain else self._run(i, key, tr))
            return
        if not self.plain and self._alternative(i, pinned, runs):
            return
        row.misses += 1
        if key in self.evicted:
            row.collisions += 1
        levels = self.default_levels if self.always_fetch else self._decide(i, pinned, runs)
        if levels is None:  # dropped, or computed by other experts
            return
        # fetch at the first precision that is resident or for which room can be made
        default = self.default
        for q in levels:
            if q == default:  # the key looked up: neither resident nor in flight
                kq = key
            else:
                kq = self.ctx.key(self.layer, self.experts[i], q)
                if kq in self.resident:
                    self.on_access(kq)
                    pinned.add(kq)
                    row.low_precision += 1
                    if self.rec is not None:
                        self.rec.append((self.at, self.layer, "hit", kq))
                    runs.append(self._run(i, kq, None))
                    return
            got = self.cache.fetch(kq, self.ctx.precision_bytes[q], pinned, True, now)
            if got is None:
                continue
            pinned.add(kq)
            if q != default:
                row.low_precision += 1
            if self.rec is not None:
                self.rec.extend((self.at, self.layer, "evict", v) for v in got[0])
                self.rec.append((self.at, self.layer, "fetch", kq))
            tr = None if self.instant else got[1]
            runs.append((kq, tr, self.ffn[i]) if self.plain else self._run(i, kq, tr))
            return
        runs.append(self._uncached(i, levels[-1], now))

    def _alternative(self, i: int, pinned: set[int], runs: list[Run]) -> bool:
        """A miss on a layer planned per token: the miss policy's alternative when it has one
        (a lower-precision copy that is resident: a hit); whether there was one."""
        ctx = self.ctx
        assert self.ranks is not None
        alt = self.sim.miss.alternative(self.layer, self.experts[i], self.ranks[i], self.resident.__contains__)
        if alt is None:
            return False
        self.row.hits += 1
        self.on_access(alt)
        pinned.add(alt)
        self.row.low_precision += ctx.precision_of(alt) != ctx.default_precision
        if self.rec is not None:
            self.rec.append((self.at, self.layer, "hit", alt))
        runs.append(self._run(i, alt, None))
        return True

    def _decide(self, i: int, pinned: set[int], runs: list[Run]) -> tuple[int, ...] | None:
        """A miss the miss policy decides: the precisions to fetch at, in order; or ``None``
        when it drops the expert or has its tokens computed by other experts (substitute,
        speculate), whose computations go to ``runs``."""
        sim = self.sim
        row = self.row
        ctx = self.ctx
        assert self.toks is not None
        assert self.ranks is not None
        e = self.experts[i]
        toks = self.toks[i]
        dec = sim.miss.decide(MissInfo(self.p, self.layer, e, self.ranks[i], self.rows[toks], self.routed, self.cached))
        if dec.action == "fetch":
            return dec.precisions or self.default_levels
        if dec.action == "drop":
            row.dropped += 1
            for t in toks:
                self.final[t].discard(e)
            return None
        if dec.action == "substitute":
            assert dec.substitute is not None
            e2 = dec.substitute
            row.substituted += 1
            for t in toks:
                self.final[t].discard(e)
                self.final[t].add(e2)
            runs.append(self._use_other(e2, len(toks), pinned))
            return None
        # speculate: each token takes its best-predicted expert that is cached
        if self.pred_order is None:
            self.pred_order = _predicted(sim, self.p, self.layer, self.rows)
        row.substituted += 1
        counts: dict[int, int] = {}
        for t in toks:
            self.final[t].discard(e)
            for cand in self.pred_order[t]:
                if cand in self.final[t] or not self.cached(ctx.key(self.layer, cand)):
                    continue
                self.final[t].add(cand)
                counts[cand] = counts.get(cand, 0) + 1
                break
        for cand, n in counts.items():
            runs.append(self._use_other(cand, n, pinned))
        return None

    def _used_prefetch(self, key: int) -> None:
        unused = self.pf_unused
        if key in unused:
            unused.discard(key)
            self.row.pf_used += 1

    def _run(self, i: int, key: int, tr: Transfer | None) -> Run:
        """The computation of the ``i``-th expert from ``key`` on a layer planned per token
        (a plain layer's is ``(key, tr, self.ffn[i])``, its compute time read from the plan)."""
        e = self.experts[i]
        self.key_for[e] = key
        assert self.toks is not None
        nb = self.ctx.precision_bytes[self.ctx.precision_of(key)]
        return (key, tr, self.sim.cost.expert_time_at(len(self.toks[i]), nb) * self.scale)

    def _use_other(self, e2: int, n_tokens: int, pinned: set[int]) -> Run:
        """A resident or arriving expert computes tokens of a missed one (substitute or
        speculate); a queued prefetch of it is promoted (it is needed now)."""
        sim = self.sim
        k2 = self.ctx.key(self.layer, e2)
        tr = self.inflight.get(k2)
        if tr is not None and tr[PRIORITY] != DEMAND and not tr[STARTED]:
            sim.copy.promote(tr)
        if e2 not in self.key_for:
            self.on_access(k2)
            self.key_for[e2] = k2
        pinned.add(k2)
        if self.rec is not None:
            self.rec.append((self.at, self.layer, "hit", k2))
        nb = self.ctx.precision_bytes[self.ctx.precision_of(k2)]
        return (k2, tr, sim.cost.expert_time_at(n_tokens, nb) * self.scale)

    def _uncached(self, i: int, q: int, now: float) -> Run:
        """No room at any precision: copy the ``i``-th expert at precision ``q`` to a staging
        buffer that is not kept (an *uncached fetch*)."""
        ctx = self.ctx
        row = self.row
        kq = ctx.key(self.layer, self.experts[i], q)
        tr = self.cache.copy.submit(kq, ctx.precision_bytes[q], DEMAND, now)
        tr[BYPASS] = True
        row.uncached += 1
        if q != self.default:
            row.low_precision += 1
        if self.rec is not None:
            self.rec.append((self.at, self.layer, "bypass", kq))
        done = None if self.instant else tr
        return (kq, done, self.ffn[i]) if self.plain else self._run(i, kq, done)

    # -- after the lookups -------------------------------------------------------------------
    def finish(self, runs: list[Run]) -> list[Run]:
        """Count what the layer computed (unique experts, gate mass, altered tokens) and
        return its expert computations for ``layer``/``on-arrival`` execution: ``runs`` as
        looked up, or, when tokens were re-routed, one per expert finally computed with all
        of its tokens (a fused kernel runs each expert once), in the order the lookups decided
        them (router order, a substitute where it was chosen): ``layer`` execution sums their
        compute times in this order, which the compiled kernel reproduces."""
        row = self.row
        if self.plain:
            row.unique += len(self.experts)
            return runs
        sim = self.sim
        tokens_of = row.count_tokens(sim.wl, self.rows, self.orig, self.final)
        transfer_of = {key: tr for key, tr, _ in runs}
        out = []
        for e, key in self.key_for.items():  # each keeps a token: lookups only add tokens to it
            n = tokens_of[e]
            nb = self.ctx.precision_bytes[self.ctx.precision_of(key)]
            out.append((key, transfer_of.get(key), sim.cost.expert_time_at(n, nb) * self.scale))
        return out


def plan(sim: Replay, p: int, layer: int, rows: np.ndarray,
         cached: Any | None) -> tuple[np.ndarray, list[list[int]]]:
    """A layer's routing as the trace has it (``[tokens, k]``) and each token's experts after
    the routing policy (when ``cached`` is given: it reads residency) and the budget policy,
    in rank order; ``p`` is the pass's number over the whole replay (a trace read in pieces
    or served a pass at a time numbers its passes on), ``rows`` index the workload's trace."""
    trace = sim.wl.trace
    assert trace is not None
    orig = trace.experts[rows].astype(np.int64)
    routed = sim.routing.route(p, layer, rows, orig, cached) if cached is not None and sim.routing.changes_routing else orig
    return orig, (sim.budget.select(p, layer, rows, routed) if sim.budget.restricts else routed.tolist())


def router_order(chosen: list[list[int]]) -> tuple[list[int], list[int], list[list[int]]]:
    """The experts of a layer whose tokens chose ``chosen`` (each token's experts, rank order):
    in router order (first appearance, token by token and rank by rank), each one's best
    rank, and the indices of its tokens. The kernel's lookups under a budget policy are made
    here too (:func:`moesim.simulator.kernel.budget_lookups`)."""
    first: dict[int, list[int]] = {}  # expert -> [best rank, token indices...]
    for t, toks_t in enumerate(chosen):
        for r, e in enumerate(toks_t):
            ent = first.get(int(e))
            if ent is None:
                first[int(e)] = [r, t]
            else:
                if r < ent[0]:
                    ent[0] = r
                ent.append(t)
    return list(first), [ent[0] for ent in first.values()], [ent[1:] for ent in first.values()]


def token_mass(wl: Any, rows: np.ndarray, orig: np.ndarray,
               final: list[set[int]]) -> tuple[float, float, set[tuple[int, int]]]:
    """Gate mass of the original top-k, the mass of the experts each token finally computed,
    and the (request, position) of tokens whose expert set changed. Mass is the router
    probability when the trace has ``probs``, else the top-k weight (0 outside the top-k).
    Per token, probabilities are summed as numpy sums them at ascending expert ids (pairwise
    with eight accumulators from eight terms), weights one after another in rank order; the
    compiled kernel sums in these orders too."""
    trace = wl.trace
    probs = wl.probs[rows].astype(np.float64) if wl.probs is not None else None
    weights = trace.weights[rows]
    req = trace.request[rows]
    pos = trace.position[rows]
    total = kept = 0.0
    altered: set[tuple[int, int]] = set()
    for t in range(len(rows)):
        o = orig[t].tolist()
        if probs is not None:
            total += float(probs[t, sorted(o)].sum())
            kept += float(probs[t, sorted(final[t])].sum()) if final[t] else 0.0
        else:
            w = weights[t].tolist()  # summed in rank order
            total += float(sum(w))
            kept += float(sum(w[r] for r, e in enumerate(o) if e in final[t]))
        if final[t] != set(o):
            altered.add((int(req[t]), int(pos[t])))
    return total, kept, altered


def _predicted(sim: Replay, p: int, layer: int, rows: np.ndarray) -> list[list[int]]:
    """Per token of ``rows``: experts ordered by the previous layer's prediction (pred_next)."""
    wl = sim.wl
    trace = wl.trace
    assert trace is not None
    assert wl.pred_next is not None
    prev_rows = wl.rows(p, layer - 1)
    where = {(int(trace.request[r]), int(trace.position[r])): r for r in prev_rows}
    out: list[list[int]] = []
    for r in rows:
        src = where.get((int(trace.request[r]), int(trace.position[r])))
        if src is None:
            out.append([])
            continue
        out.append(np.argsort(-wl.pred_next[src], kind="stable").tolist())
    return out

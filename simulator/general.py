"""The per-token layer path, used when a routing policy changes the router's choice or a
miss policy may do something other than a plain fetch (``docs/design.md`` steps 2 and 4).

It works on the layer's tokens rather than on its distinct experts: the routing policy may
re-choose each token's experts (dual-logit semantics: original probabilities weight them);
each distinct expert is then looked up in rank order of first appearance, and a miss is
handled by the miss policy (fetch at a precision with fallbacks, drop, substitute, or
speculate). What each token finally computes gives ``gate_mass_retained`` and
``tokens_altered``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from policies.miss import MissInfo
from simulator.copyengine import DEMAND, Transfer

if TYPE_CHECKING:
    from simulator.engine import Simulation


@dataclass
class LayerOutcome:
    """What one layer of one pass did at its routing point."""

    hits: int = 0
    misses: int = 0
    late: int = 0
    collisions: int = 0
    uncached: int = 0
    low_precision: int = 0
    dropped: int = 0
    substituted: int = 0
    pf_used: int = 0
    pinned: set[int] = field(default_factory=set)  # cache keys the layer used
    mass_total: float = 0.0
    mass_retained: float = 0.0
    altered: set[tuple[int, int]] = field(default_factory=set)
    waits: list[Transfer] = field(default_factory=list)
    computes: list[tuple[Transfer | None, float]] = field(default_factory=list)  # (arrival, ffn seconds)


def general_layer(sim: Simulation, p: int, layer: int, now: float, evicted: set[int],
                  pf_unused: set[int]) -> LayerOutcome:
    """Route, look up and handle misses for (pass ``p``, ``layer``) at time ``now``."""
    out = LayerOutcome()
    wl = sim.wl
    trace = wl.trace
    assert trace is not None
    rows = wl.rows(p, layer)
    if rows.size == 0:
        return out
    ctx = sim.eviction.ctx
    cache = sim.cache
    copy = sim.copy
    resident = cache.resident
    inflight = cache.inflight
    policy = sim.eviction
    miss = sim.miss

    def cached(key: int) -> bool:
        return key in resident or key in inflight

    def is_resident(key: int) -> bool:
        return key in resident

    orig = trace.experts[rows].astype(np.int64)
    routed_experts = (sim.routing.route(p, layer, rows, orig, cached)
                      if sim.routing.changes_routing else orig)
    chosen: list[list[int]] = (sim.budget.select(p, layer, rows, routed_experts)
                               if sim.budget.restricts else routed_experts.tolist())
    n_tok = len(chosen)
    first: dict[int, list[int]] = {}  # expert -> [best rank, token indices...]
    for t in range(n_tok):
        for r in range(len(chosen[t])):
            e = int(chosen[t][r])
            ent = first.get(e)
            if ent is None:
                first[e] = [r, t]
            else:
                if r < ent[0]:
                    ent[0] = r
                ent.append(t)
    routed = frozenset(first)
    final = [set(map(int, chosen[t])) for t in range(n_tok)]
    key_for: dict[int, tuple[int, Transfer | None]] = {}  # expert -> (cache key, transfer)
    pinned = out.pinned
    default = ctx.default_precision
    pred_order: list[list[int]] | None = None

    def waiting_for(key: int) -> Transfer | None:
        """The in-flight transfer of a resident-or-arriving substitute; a queued prefetch
        is promoted (this layer needs it now, so it must not be withdrawn)."""
        tr = inflight.get(key)
        if tr is not None and tr.priority != DEMAND and not tr.started:
            copy.promote(tr)
        return tr

    def use(e: int, key: int, tr: Transfer | None) -> None:
        key_for[e] = (key, tr)
        pinned.add(key)
        if tr is not None:
            out.waits.append(tr)

    for e, ent in first.items():
        rank, toks = ent[0], ent[1:]
        key = ctx.key(layer, e)
        pinned.add(key)
        if key in resident:
            out.hits += 1
            policy.on_access(key)
            if key in pf_unused:
                pf_unused.discard(key)
                out.pf_used += 1
            use(e, key, None)
            continue
        tr = inflight.get(key)
        if tr is not None:
            out.late += 1
            policy.on_access(key)
            if key in pf_unused:
                pf_unused.discard(key)
                out.pf_used += 1
            if tr.priority != DEMAND and not tr.started:
                copy.promote(tr)
            use(e, key, tr)
            continue
        alt = miss.alternative(layer, e, rank, is_resident)
        if alt is not None:
            out.hits += 1
            policy.on_access(alt)
            out.low_precision += ctx.precision_of(alt) != default
            use(e, alt, None)
            continue
        out.misses += 1
        if key in evicted:
            out.collisions += 1
        dec = miss.decide(MissInfo(p, layer, e, rank, rows[toks], routed, cached))
        if dec.action == "fetch":
            levels = dec.precisions or (default,)
            done = False
            for q in levels:
                kq = ctx.key(layer, e, q)
                nb = ctx.precision_bytes[q]
                if kq in resident:
                    policy.on_access(kq)
                    use(e, kq, None)
                    done = True
                    break
                room = cache.make_room(nb, pinned)
                if room is None:
                    continue
                evicted.update(room)
                tr = copy.submit(kq, nb, DEMAND, now)
                cache.reserve(tr, True)
                if copy.instant:
                    cache.complete(tr)
                    tr = None
                use(e, kq, tr)
                done = True
                break
            if not done:
                q = levels[-1]
                kq = ctx.key(layer, e, q)
                tr = copy.submit(kq, ctx.precision_bytes[q], DEMAND, now)
                tr.bypass = True
                out.uncached += 1
                use(e, kq, None if copy.instant else tr)
            out.low_precision += ctx.precision_of(key_for[e][0]) != default
        elif dec.action == "drop":
            out.dropped += 1
            for t in toks:
                final[t].discard(e)
        elif dec.action == "substitute":
            assert dec.substitute is not None
            e2 = dec.substitute
            k2 = ctx.key(layer, e2)
            out.substituted += 1
            for t in toks:
                final[t].discard(e)
                final[t].add(e2)
            if e2 not in key_for:
                policy.on_access(k2)
                use(e2, k2, waiting_for(k2))
        else:  # speculate
            if pred_order is None:
                pred_order = _predicted(sim, p, layer, rows)
            out.substituted += 1
            for t in toks:
                final[t].discard(e)
                for cand in pred_order[t]:
                    kc = ctx.key(layer, cand)
                    if cand in final[t] or not cached(kc):
                        continue
                    final[t].add(cand)
                    if cand not in key_for:
                        policy.on_access(kc)
                        use(cand, kc, waiting_for(kc))
                    break
    # what each token computed: gate mass and alteration
    out.mass_total, out.mass_retained, out.altered = token_mass(wl, rows, orig, final)
    tokens_of: dict[int, int] = {}
    for t in range(n_tok):
        for e in final[t]:
            tokens_of[e] = tokens_of.get(e, 0) + 1
    cost = sim.cost
    scale = float(sim.ffn_scale[p])
    for e, n in tokens_of.items():
        key, tr = key_for[e]
        nb = ctx.precision_bytes[ctx.precision_of(key)]
        out.computes.append((tr, cost.expert_time_at(n, nb) * scale))
    return out


def token_mass(wl: Any, rows: np.ndarray, orig: np.ndarray,
               final: list[set[int]]) -> tuple[float, float, set[tuple[int, int]]]:
    """Gate mass of the original top-k, the mass of the experts each token finally computed,
    and the (request, position) of tokens whose expert set changed. Mass is the router
    probability when the trace has ``probs``, else the top-k weight (0 outside the top-k)."""
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
            wmap = dict(zip(o, weights[t].tolist(), strict=True))
            total += float(sum(wmap.values()))
            kept += float(sum(wmap.get(e, 0.0) for e in final[t]))
        if final[t] != set(o):
            altered.add((int(req[t]), int(pos[t])))
    return total, kept, altered


def _predicted(sim: Simulation, p: int, layer: int, rows: np.ndarray) -> list[list[int]]:
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

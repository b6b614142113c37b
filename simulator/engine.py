"""The SimPy model of one GPU (``docs/design.md``: "Simulation semantics").

One SimPy process runs the forward passes on the compute stream. For each layer of a pass:

1. non-expert compute (attention, gate) for the pass's tokens;
2. at the routing point each needed expert is a *hit* (resident), a *late prefetch* (its
   transfer is in flight: wait for it) or a *miss* (absent: the miss policy decides; ``fetch``
   makes room through the cache and queues a demand transfer on the host link's copy engine);
3. the prefetch policy may propose experts for later layers (queued behind demand fetches);
4. expert compute: by default once all of the layer's experts are present (the papers'
   baseline); with ``expert_compute: on-arrival`` each expert as soon as it has arrived.

Time spent by the compute stream waiting for transfers is *stall*. A *collision miss* is a
miss on an expert evicted earlier in the same forward pass. With no prefetch the step time is
exactly ``sum over layers of (non-expert + copy of missed experts + expert compute)``
(``speculating-experts-prefetch.txt`` §5.1), which the tests check.

Cache-only replay (``timing: false``) runs the same decisions with zero-cost compute and
instant transfers, so no simulated time passes.
"""

from __future__ import annotations

import time as _time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import simpy

from policies.budget import REGISTRY as BUDGET
from policies.eviction import REGISTRY as EVICTION
from policies.miss import REGISTRY as MISS
from policies.prefetch import REGISTRY as PREFETCH
from policies.registry import Clock, PolicyContext
from policies.routing import REGISTRY as ROUTING
from simulator.cache import ExpertCache
from simulator.copyengine import DEMAND, CopyEngine, Transfer
from simulator.copyengine import PREFETCH as PREFETCH_PRIORITY
from simulator.cost import CostModel
from simulator.errors import MoesimError
from simulator.general import general_layer, token_mass
from simulator.scenario import Scenario, parse_capacity
from simulator.workload import DECODE, VERIFY, Workload, build_workload
from traces.schema import PHASES
from traces.trace import Trace

ProgressFn = Callable[[int, int], None]


@dataclass
class Result:
    """What a run produces: one row per forward pass, one per request, and the summary."""

    scenario: Scenario
    steps: pd.DataFrame
    requests: pd.DataFrame
    summary: dict[str, Any]
    transfers: list[tuple[int, int, float, float, float]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def load_trace(scenario: Scenario) -> Trace:
    """The scenario's trace: read from its path, or synthesised in-process."""
    src = scenario.workload.trace
    if src.import_ is not None:
        from traces.importers import import_trace

        imp = src.import_
        ip = Path(imp.path)
        if not ip.is_absolute():
            ip = Path(scenario.base_dir) / ip
        return import_trace(imp.format, [ip], imp.model_preset)[0]
    if src.path is not None:
        from traces.io import read_trace

        p = Path(src.path)
        if not p.is_absolute():
            p = Path(scenario.base_dir) / p
        return read_trace(p)
    from traces.synth import synth_from_preset

    s = src.synth
    assert s is not None
    if s.fit is not None:
        from traces.fit import load_profile, synthesise

        fp = Path(s.fit)
        if not fp.is_absolute() and (Path(scenario.base_dir) / fp).is_file():
            fp = Path(scenario.base_dir) / fp
        return synthesise(load_profile(str(fp)), requests=s.requests, tokens=s.tokens,
                          seed=scenario.seed if s.seed is None else s.seed)
    assert s.preset is not None
    return synth_from_preset(
        s.preset, layers=s.layers, experts=s.experts, top_k=s.top_k, routing=s.routing,
        requests=s.requests, prompt_tokens=s.prompt_tokens, tokens=s.tokens,
        seed=scenario.seed if s.seed is None else s.seed, probs=s.probs, pred_next=s.pred_next,
        pred_noise=s.pred_noise)


class Simulation:
    """Replays a workload under a scenario. Build once, call :meth:`run` once."""

    def __init__(self, scenario: Scenario, trace: Trace | None = None,
                 workload: Workload | None = None, progress: ProgressFn | None = None,
                 record_transfers: bool = False, record_layers: bool = False) -> None:
        self.scenario = scenario
        self._trace = trace
        if workload is None:
            trace = trace if trace is not None else load_trace(scenario)
            self._trace = trace
            workload = build_workload(trace, scenario.workload.batch_size,
                                      scenario.workload.max_requests, scenario.workload.speculative,
                                      scenario.seed)
        self.wl = workload
        model = workload.model
        self.model = model
        precision = scenario.cache.precision or model.default_precision()
        if precision not in model.expert_bytes:
            raise MoesimError(
                f"{scenario.source}: key 'cache.precision' is '{precision}', but the trace's model "
                f"({model.name}) has expert sizes for {', '.join(model.expert_bytes)} only; pick one "
                "of those.")
        self.precision = precision
        self.expert_bytes = int(model.expert_bytes[precision])
        # precisions from largest to smallest; cache key = base * P + index
        self.precisions = tuple(sorted(model.expert_bytes, key=lambda q: -model.expert_bytes[q]))
        self.num_prec = len(self.precisions)
        self.default_prec = self.precisions.index(precision)
        total = model.num_layers * model.num_experts * self.expert_bytes
        self.capacity = parse_capacity(scenario.cache.capacity, self.expert_bytes, total, scenario.source)
        self.cost = CostModel(scenario.hardware, model, self.expert_bytes)
        self.progress = progress
        self.clock = Clock()
        seed = scenario.seed

        def ctx(family_index: int) -> PolicyContext:
            return PolicyContext(num_layers=model.num_layers, num_experts=model.num_experts,
                                 top_k=model.top_k, expert_bytes=self.expert_bytes,
                                 capacity_bytes=self.capacity, precisions=self.precisions,
                                 default_precision=self.default_prec,
                                 precision_bytes=tuple(int(model.expert_bytes[q]) for q in self.precisions),
                                 rng=np.random.default_rng([seed, family_index]),
                                 clock=self.clock, workload=workload)

        pol = scenario.policies
        self.eviction = EVICTION.get(pol.eviction.name)(pol.eviction.params, ctx(0))
        self.miss = MISS.get(pol.miss.name)(pol.miss.params, ctx(1))
        self.prefetch = PREFETCH.get(pol.prefetch.name)(pol.prefetch.params, ctx(2))
        self.routing = ROUTING.get(pol.routing.name)(pol.routing.params, ctx(3))
        self.budget = BUDGET.get(pol.budget.name)(pol.budget.params, ctx(4))
        self.cache = ExpertCache(self.capacity, self.eviction)
        hw = scenario.hardware
        self.link_name = f"{hw.host_link}.h2d"
        self.copy = CopyEngine(self.link_name, hw.h2d, instant=not scenario.timing)
        self.copy.on_complete.append(self.cache.complete_many)
        self.transfers: list[tuple[int, int, float, float, float]] | None = None
        # (pass, layer, non-expert start, routing point, experts start, layer end)
        self.layer_log: list[tuple[int, int, float, float, float, float]] | None = [] if record_layers else None
        if record_transfers:
            self.transfers = []
            log = self.transfers
            self.copy.on_complete.append(
                lambda trs: log.extend((tr.key, tr.priority, tr.issued, tr.start, tr.done) for tr in trs))
        self.env = simpy.Environment()
        n = workload.num_passes
        self._cols = {name: np.zeros(n, dtype=np.int64) for name in
                      ("hits", "misses", "late_prefetches", "collision_misses", "uncached_fetches",
                       "bytes", "prefetches_issued", "prefetches_used", "prefetch_predicted_hits",
                       "prefetch_predicted", "prefetch_actual", "low_precision_experts",
                       "dropped_experts", "substituted_experts", "tokens_altered",
                       "prefetches_cancelled", "unique_computed")}
        self._pf_pending: dict[int, list[Transfer]] = {}
        # sparse verification factors (sparse-verification-speculative-decoding.txt Table 1):
        # attention context and expert down projections are thinned in verification passes
        spec = scenario.workload.speculative
        is_verify = workload.pass_phase == VERIFY
        self.attn_scale = np.where(is_verify, 1.0 - (spec.sparse_attention if spec else 0.0), 1.0)
        self.ffn_scale = np.where(is_verify, 1.0 - (spec.sparse_ffn if spec else 0.0) / 3.0, 1.0)
        self.general = (self.routing.changes_routing or not self.miss.always_fetch or self.budget.restricts
                        or scenario.hardware.gpus > 1)
        self._ep_max_load = np.zeros(workload.num_passes)
        self._mass_total = workload.weight_total.astype(np.float64).copy()
        self._mass_kept = workload.weight_total.astype(np.float64).copy()
        self._pf_unused: set[int] = set()
        if self.prefetch.active:
            pf_unused = self._pf_unused
            self.cache.on_evict.append(pf_unused.difference_update)
        static = getattr(self.prefetch, "static_pins", None)
        self.preloaded = 0
        if static:
            self.preloaded = self.cache.preload(static, self.expert_bytes)
        self._t_start = np.zeros(n)
        self._t_end = np.zeros(n)
        self._stall = np.zeros(n)
        self.wall_s = 0.0

    @cached_property
    def _access_keys(self) -> list[int]:
        """Cache key of every access of the workload, in replay order."""
        return (self.wl.keys() * self.num_prec + self.default_prec).tolist()

    @cached_property
    def _access_off(self) -> list[int]:
        """Access offsets of every (pass, layer) (``workload.off`` as a list)."""
        return self.wl.off.tolist()

    # -- the compute-stream process -------------------------------------------------------
    def _run(self) -> Generator[simpy.Event, Any, None]:
        env = self.env
        wl = self.wl
        timing = self.scenario.timing
        on_arrival = self.scenario.expert_compute == "on-arrival"
        num_l = self.model.num_layers
        keys, off = self._access_keys, self._access_off
        if timing:
            ffn_arr = self.cost.expert_time(wl.acc_tokens) * np.repeat(self.ffn_scale, np.diff(wl.off[::num_l]))
            nonexp = self.cost.nonexpert_time(wl.pass_tokens, wl.pass_context * self.attn_scale).tolist()
        else:
            ffn_arr = np.zeros(wl.num_accesses)
            nonexp = [0.0] * wl.num_passes
        csum = np.concatenate([[0.0], np.cumsum(ffn_arr)])
        layer_ffn = (csum[wl.off[1:]] - csum[wl.off[:-1]]).tolist()
        ffn = ffn_arr.tolist()
        cache = self.cache
        resident = cache.resident
        inflight = cache.inflight
        on_access = self.eviction.on_access
        prefetch_active = self.prefetch.active
        copy = self.copy
        advance = copy.advance
        plan = cache.plan_evictions
        admit = cache.admit
        remove_many = cache.remove_many
        make_room = cache.make_room
        reserve = cache.reserve
        submit = copy.submit
        submit_batch = copy.submit_batch
        capacity = self.capacity
        on_insert = self.eviction.on_insert
        fetch_keys: list[int] = []
        fetch_idx: list[int] = []
        complete = cache.complete
        clock = self.clock
        nbytes = self.expert_bytes
        cols = self._cols
        c_hits, c_miss, c_late, c_coll, c_unc, c_bytes = (
            cols["hits"], cols["misses"], cols["late_prefetches"], cols["collision_misses"],
            cols["uncached_fetches"], cols["bytes"])
        t_start, t_end, stall_arr = self._t_start, self._t_end, self._stall
        c_pf_issued, c_pf_used, c_pred_hits, c_pred_total, c_actual_total = (
            cols["prefetches_issued"], cols["prefetches_used"], cols["prefetch_predicted_hits"],
            cols["prefetch_predicted"], cols["prefetch_actual"])
        propose = self.prefetch.propose
        pf_unused = self._pf_unused
        general = self.general
        pf_pending = self._pf_pending
        to_promote: list[Transfer] = []
        layer_log = self.layer_log
        c_cancel = cols["prefetches_cancelled"]
        c_low, c_drop, c_sub, c_alt = (cols["low_precision_experts"], cols["dropped_experts"],
                                       cols["substituted_experts"], cols["tokens_altered"])
        mass_t, mass_k = self._mass_total, self._mass_kept
        c_uniq = cols["unique_computed"]
        evicted: set[int] = set()
        progress = self.progress
        n_pass = wl.num_passes
        report_every = max(1, n_pass // 200)
        carry = 0.0
        for p in range(n_pass):
            clock.pass_index = p
            t_start[p] = env.now
            evicted.clear()
            hits = misses = late = coll = unc = 0
            pf_issued = pf_used = pred_hits = pred_total = actual_total = 0
            low_prec = dropped = substituted = cancelled = uniq_computed = 0
            mass_total = mass_kept = 0.0
            altered: set[tuple[int, int]] = set()
            stall = 0.0
            bytes0 = copy.bytes_moved
            base = p * num_l
            ne = nonexp[p]
            for layer in range(num_l):
                delay = carry + ne
                if delay > 0:
                    yield env.timeout(delay)
                carry = 0.0
                lo = off[base + layer]
                hi = off[base + layer + 1]
                if lo == hi:
                    continue
                now = env.now
                advance(now)
                clock.now = now
                clock.layer = layer
                if general:
                    g = general_layer(self, p, layer, now, evicted, pf_unused)
                    hits += g.hits
                    misses += g.misses
                    late += g.late
                    coll += g.collisions
                    unc += g.uncached
                    pf_used += g.pf_used
                    low_prec += g.low_precision
                    dropped += g.dropped
                    substituted += g.substituted
                    mass_total += g.mass_total
                    mass_kept += g.mass_retained
                    altered |= g.altered
                    uniq_computed += len(g.computes)
                    if pf_pending:
                        cancelled += self._cancel_stale_prefetches(layer)
                    if prefetch_active:
                        props = propose(p, layer)
                        if props:
                            pf = self._prefetch(props, now, base, layer, g.pinned, evicted, pf_unused)
                            pf_issued += pf[0]
                            pred_hits += pf[1]
                            pred_total += pf[2]
                            actual_total += pf[3]
                    timed_g = sorted(((now if tr_g is None else tr_g.done), f) for tr_g, f in g.computes)
                    st0 = stall
                    if on_arrival:
                        t = now
                        for arr, f in timed_g:
                            if arr > t:
                                stall += arr - t
                                t = arr
                            t += f
                        carry = t - now
                    else:
                        ready_g = max((arr for arr, _ in timed_g), default=now)
                        stall += ready_g - now
                        carry = ready_g - now + sum(f for _, f in timed_g)
                    if layer_log is not None:
                        layer_log.append((p, layer, now - ne, now, now + stall - st0, now + carry))
                    continue
                waits: list[Transfer] = []
                ready = now
                promoted = False
                arrivals: list[tuple[Transfer | None, int]] | None = [] if on_arrival else None
                # Plan: count misses; if evictions are needed and none of them would take an
                # expert of this layer, apply the whole layer at once (fast path); otherwise
                # replay it one access at a time, pinning the experts looked up so far.
                layer_keys = keys[lo:hi]
                n_miss = len([k for k in layer_keys if k not in resident and k not in inflight])
                victims: list[int] | None = None
                if n_miss:
                    need = cache.used + n_miss * nbytes - capacity
                    victims = plan(need, set(layer_keys)) if need > 0 else []
                fast = victims is not None
                if fast and victims:
                    remove_many(victims)
                    evicted.update(victims)
                pinned: set[int] = set()
                for i in range(lo, hi):
                    key = keys[i]
                    if not fast:
                        pinned.add(key)
                    if key in resident:
                        hits += 1
                        on_access(key)
                        if pf_unused and key in pf_unused:
                            pf_unused.discard(key)
                            pf_used += 1
                        if arrivals is not None:
                            arrivals.append((None, i))
                        continue
                    tr = inflight.get(key)
                    if tr is not None:
                        late += 1
                        on_access(key)
                        if pf_unused and key in pf_unused:
                            pf_unused.discard(key)
                            pf_used += 1
                        waits.append(tr)
                        if tr.priority != DEMAND and not tr.started:
                            to_promote.append(tr)  # projected when promoted, below
                        elif tr.done > ready:
                            ready = tr.done
                        if arrivals is not None:
                            arrivals.append((tr, i))
                        continue
                    misses += 1
                    if key in evicted:
                        coll += 1
                    if fast:
                        on_insert(key, True)
                        fetch_keys.append(key)
                        fetch_idx.append(i)
                        continue
                    room = make_room(nbytes, pinned)
                    tr = submit(key, nbytes, DEMAND, now)
                    if room is None:
                        tr.bypass = True
                        unc += 1
                    else:
                        evicted.update(room)
                        reserve(tr, True)
                    if timing:
                        waits.append(tr)
                        if tr.done > ready:
                            ready = tr.done
                        if arrivals is not None:
                            arrivals.append((tr, i))
                    else:
                        complete(tr)
                        if arrivals is not None:
                            arrivals.append((None, i))
                if fetch_keys:
                    trs = submit_batch(fetch_keys, nbytes, DEMAND, now)
                    admit(trs)
                    if timing:
                        waits.extend(trs)
                        last = trs[-1].done  # same priority, issued in order: finishes last
                        if last > ready:
                            ready = last
                        if arrivals is not None:
                            arrivals.extend(zip(trs, fetch_idx, strict=True))
                    else:
                        for tr in trs:
                            complete(tr)
                        if arrivals is not None:
                            arrivals.extend((None, i) for i in fetch_idx)
                    fetch_keys = []
                    fetch_idx = []
                if to_promote:
                    copy.promote_many(to_promote)
                    to_promote = []
                    promoted = True
                if pf_pending:
                    cancelled += self._cancel_stale_prefetches(layer)
                if promoted or not fast:
                    ready = max((t.done for t in waits), default=now)
                if prefetch_active:
                    props = propose(p, layer)
                    if props:
                        pf = self._prefetch(props, now, base, layer, set(layer_keys), evicted, pf_unused)
                        pf_issued += pf[0]
                        pred_hits += pf[1]
                        pred_total += pf[2]
                        actual_total += pf[3]
                # The compute process is the only submitter to its copy engine, so the finish
                # times projected at the routing point are final: the wait for the layer's
                # experts (stall) and their compute fold into the next timeout.
                st0 = stall
                if arrivals is None:
                    if ready > now:
                        stall += ready - now
                        carry = ready - now + layer_ffn[base + layer]
                    else:
                        carry = layer_ffn[base + layer]
                else:
                    timed = sorted(((now if tr_a is None else tr_a.done), i) for tr_a, i in arrivals)
                    t = now
                    for arr, i in timed:
                        if arr > t:
                            stall += arr - t
                            t = arr
                        t += ffn[i]
                    carry = t - now
                if layer_log is not None:
                    layer_log.append((p, layer, now - ne, now, now + stall - st0, now + carry))
            if carry > 0:
                yield env.timeout(carry)
                carry = 0.0
            advance(env.now)
            t_end[p] = env.now
            c_hits[p] = hits
            c_miss[p] = misses
            c_late[p] = late
            c_coll[p] = coll
            c_unc[p] = unc
            c_bytes[p] = copy.bytes_moved - bytes0
            stall_arr[p] = stall
            c_pf_issued[p] = pf_issued
            c_pf_used[p] = pf_used
            c_pred_hits[p] = pred_hits
            c_pred_total[p] = pred_total
            c_actual_total[p] = actual_total
            c_cancel[p] = cancelled
            if general:
                c_low[p] = low_prec
                c_drop[p] = dropped
                c_sub[p] = substituted
                mass_t[p] = mass_total
                mass_k[p] = mass_kept
                c_alt[p] = len(altered)
                c_uniq[p] = uniq_computed
            if progress is not None and (p + 1) % report_every == 0:
                progress(p + 1, n_pass)
        if progress is not None:
            progress(n_pass, n_pass)

    def _cancel_stale_prefetches(self, layer: int) -> int:
        """At ``layer``'s routing point, withdraw prefetches for this layer (or earlier) that
        are still queued: the layer did not need them (a needed one was promoted to demand),
        so they can no longer help. Their room is freed and their bytes are not moved."""
        pending = self._pf_pending
        stale: list[Transfer] = []
        for target in [t for t in pending if t <= layer]:
            stale.extend(tr for tr in pending.pop(target) if tr.priority != DEMAND)
        if not stale:
            return 0
        gone = self.copy.cancel_many(stale)
        if gone:
            self.cache.cancel_many(gone)
            self._pf_unused.difference_update([tr.key for tr in gone])
        return len(gone)

    def _prefetch(self, props: Sequence[int], now: float, pass_base: int, layer: int,
                  pinned: set[int], evicted: set[int], unused: set[int]) -> tuple[int, int, int, int]:
        """Queue prefetches for ``props`` (keys of later layers, most wanted first) at the
        routing point of ``layer``. Returns (issued, predicted hits, predicted, actual):
        prediction precision/recall compare each target layer's proposals with the experts
        that layer really needs in this pass."""
        cache = self.cache
        resident, inflight = cache.resident, cache.inflight
        policy = self.eviction
        div = self.model.num_experts * self.num_prec  # key // div = layer
        num_l = self.model.num_layers
        keys, off = self._access_keys, self._access_off
        lo_key, hi_key = (layer + 1) * div, num_l * div
        wanted: list[int] = []
        targets: dict[int, list[int]] = {}  # target layer -> its proposals
        for key in dict.fromkeys(props):
            if key < lo_key or key >= hi_key:
                continue  # not a later layer
            t = key // div
            keys_t = targets.get(t)
            if keys_t is None:
                targets[t] = [key]
            else:
                keys_t.append(key)
            if key in resident or key in inflight:
                policy.on_prefetch_select(key)
                continue
            wanted.append(key)
        issued = 0
        if wanted:
            n, victims = cache.room_for(len(wanted), self.expert_bytes, pinned)
            if victims:
                cache.remove_many(victims)
                evicted.update(victims)
            admit = wanted[:n]
            if admit:
                trs = self.copy.submit_batch(admit, self.expert_bytes, PREFETCH_PRIORITY, now)
                for key in admit:
                    policy.on_insert(key, False)
                cache.admit(trs)
                if self.copy.instant:
                    cache.complete_many(trs)
                else:
                    pending = self._pf_pending
                    for tr in trs:
                        pending.setdefault(tr.key // div, []).append(tr)
                unused.update(admit)
                issued = len(trs)
        hits = predicted = actual = 0
        for target, keys_t in targets.items():
            b = pass_base + target
            actual_set = set(keys[off[b]:off[b + 1]])
            hits += len(actual_set.intersection(keys_t))
            predicted += len(keys_t)
            actual += len(actual_set)
        return issued, hits, predicted, actual

    def _run_ep(self) -> Generator[simpy.Event, Any, None]:
        """Expert parallelism (G > 1 GPUs): experts stay resident on their GPU (no host
        offload, so cache, eviction, miss and prefetch policies do not apply); attention runs
        data-parallel with the pass's tokens split across GPUs; each (token, expert) pair on
        another GPU sends the token's hidden state over the EP link and back (dispatch and
        combine all-to-all, as long as the busiest GPU's traffic); a layer waits for the
        slowest GPU's experts. Routing and budget policies apply (XShare Algorithm 6 balances
        the per-GPU load)."""
        from policies.budget import placement_of

        env, wl, hw = self.env, self.wl, self.scenario.hardware
        g_n = hw.gpus
        num_l, num_e = self.model.num_layers, self.model.num_experts
        owner = placement_of(hw.placement, num_l, num_e, g_n)
        link = hw.links[hw.ep_link]
        token_bytes = 2 * self.model.hidden_size
        trace = wl.trace
        assert trace is not None
        cols = self._cols
        mass_t, mass_k = self._mass_total, self._mass_kept
        nonexp = self.cost.nonexpert_time(np.ceil(wl.pass_tokens / g_n),
                                          np.ceil(wl.pass_context * self.attn_scale / g_n)).tolist()
        for p in range(wl.num_passes):
            self.clock.pass_index = p
            self._t_start[p] = env.now
            loads, uniq, accesses, mass_total, mass_kept = [], 0, 0, 0.0, 0.0
            altered: set[tuple[int, int]] = set()
            for layer in range(num_l):
                self.clock.layer = layer
                rows = wl.rows(p, layer)
                t_layer = nonexp[p]
                if rows.size:
                    orig = trace.experts[rows].astype(np.int64)
                    chosen = self.budget.select(p, layer, rows, orig) if self.budget.restricts else orig.tolist()
                    tok_gpu = np.arange(len(rows)) % g_n
                    per_gpu_tokens: list[dict[int, int]] = [{} for _ in range(g_n)]
                    sent = np.zeros(g_n)
                    recv = np.zeros(g_n)
                    m_total, m_kept, changed = token_mass(wl, rows, orig, [set(c) for c in chosen])
                    mass_total += m_total
                    mass_kept += m_kept
                    altered |= changed
                    for t, experts in enumerate(chosen):
                        for e in experts:
                            gpu = int(owner[layer, e])
                            per_gpu_tokens[gpu][e] = per_gpu_tokens[gpu].get(e, 0) + 1
                            if gpu != tok_gpu[t]:
                                sent[tok_gpu[t]] += token_bytes
                                recv[gpu] += token_bytes
                    load = [len(d) for d in per_gpu_tokens]
                    loads.append(max(load))
                    uniq += sum(load)
                    accesses += sum(load)
                    per_gpu_time = [float(self.cost.expert_time(np.asarray(list(d.values()))).sum()) if d else 0.0
                                    for d in per_gpu_tokens]
                    expert_t = max(per_gpu_time) * float(self.ffn_scale[p])
                    traffic = float(max(sent.max(), recv.max()))
                    a2a = link.copy_time(traffic) if traffic > 0 else 0.0
                    t_layer += 2 * a2a + expert_t
                yield env.timeout(t_layer)
            self._t_end[p] = env.now
            cols["hits"][p] = accesses
            cols["unique_computed"][p] = uniq
            cols["tokens_altered"][p] = len(altered)
            self._ep_max_load[p] = float(np.mean(loads)) if loads else 0.0
            mass_t[p] = mass_total
            mass_k[p] = mass_kept

    def run(self) -> Result:
        """Run the simulation to the end and derive the metrics."""
        from simulator.metrics import summarise

        t0 = _time.perf_counter()
        self.env.process(self._run_ep() if self.scenario.hardware.gpus > 1 else self._run())
        self.env.run()
        self.copy.finish()
        for name in ("_access_keys", "_access_off"):  # one Python int per access: free them
            self.__dict__.pop(name, None)
        self.wall_s = _time.perf_counter() - t0
        steps = self._steps_frame()
        requests = self._requests_frame()
        summary = summarise(self, steps, requests)
        if self.scenario.workload.speculative is not None and self.scenario.timing and self._trace is not None:
            from dataclasses import replace

            ar = replace(self.scenario, workload=replace(self.scenario.workload, speculative=None))
            ar_rate = Simulation(ar, trace=self._trace).run().summary["tokens_per_s"]
            summary["speedup_vs_autoregressive"] = (summary["tokens_per_s"] / ar_rate) if ar_rate else None
        return Result(self.scenario, steps, requests, summary, self.transfers,
                      extra={"layers": self.layer_log} if self.layer_log is not None else {})

    def _steps_frame(self) -> pd.DataFrame:
        wl = self.wl
        num_l = self.model.num_layers
        uniq = self._cols["unique_computed"] if self.general else wl.off[num_l::num_l] - wl.off[:-1:num_l]
        layers_routed = np.diff(wl.off).reshape(-1, num_l) > 0 if wl.num_passes else np.zeros((0, num_l), bool)
        return pd.DataFrame({
            "pass": np.arange(wl.num_passes, dtype=np.int64),
            "group": wl.pass_group,
            "step": wl.pass_step,
            "phase": pd.Categorical.from_codes(wl.pass_phase.astype(np.int64), categories=pd.Index(PHASES)),
            "tokens": wl.pass_tokens,
            "generated": wl.pass_generated if wl.pass_generated is not None else wl.pass_tokens,
            "requests": wl.pass_requests,
            "start_s": self._t_start,
            "end_s": self._t_end,
            "duration_s": self._t_end - self._t_start,
            "stall_s": self._stall,
            **{k: self._cols[k] for k in ("hits", "misses", "late_prefetches", "collision_misses",
                                          "uncached_fetches")},
            "bytes_h2d": self._cols["bytes"],
            "unique_experts": uniq,
            "layers_routed": layers_routed.sum(axis=1),
            "prefetches_issued": self._cols["prefetches_issued"],
            "prefetches_used": self._cols["prefetches_used"],
            "prefetches_cancelled": self._cols["prefetches_cancelled"],
            "prefetch_predicted_hits": self._cols["prefetch_predicted_hits"],
            "prefetch_predicted": self._cols["prefetch_predicted"],
            "prefetch_actual": self._cols["prefetch_actual"],
            "low_precision_experts": self._cols["low_precision_experts"],
            "dropped_experts": self._cols["dropped_experts"],
            "substituted_experts": self._cols["substituted_experts"],
            "gate_weight_total": self._mass_total,
            "gate_weight_computed": self._mass_kept,
            "tokens_altered": self._cols["tokens_altered"],
            "max_experts_per_gpu": self._ep_max_load,
        })

    def _requests_frame(self) -> pd.DataFrame:
        wl = self.wl
        groups = wl.request_group
        first = wl.request_first_pass
        group_start = pd.Series(self._t_start).groupby(wl.pass_group).min()
        start = group_start.reindex(groups).to_numpy() if len(groups) else np.zeros(0)
        return pd.DataFrame({
            "request": wl.request_ids,
            "group": groups,
            "first_pass": first,
            "ttft_s": self._t_end[first] - start if len(first) else np.zeros(0),
            "first_phase": [PHASES[int(c)] for c in wl.pass_phase[first]],
        })


def simulate(scenario: Scenario, trace: Trace | None = None, **kwargs: Any) -> Result:
    """Build a :class:`Simulation` and run it."""
    return Simulation(scenario, trace=trace, **kwargs).run()


__all__ = ["DECODE", "VERIFY", "Result", "Simulation", "load_trace", "simulate"]

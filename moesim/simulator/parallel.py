"""Expert parallelism (``hardware.gpus`` G > 1; ``docs/concepts/simulation.md``): the
experts of each layer are placed on the G GPUs (``hardware.placement``); attention runs
data-parallel with a pass's tokens split across the GPUs, and each layer's tokens cross the EP
link to the GPUs of their experts and back. By default every GPU holds its share of the experts
(no host offload: cache, eviction, miss and prefetch policies do not apply). With
``cache.ep_offload`` each GPU keeps ``cache.capacity`` of its experts in its own cache, under
its own instance of the eviction policy, and fetches a missed expert on demand over its own host
link (expert parallelism with offload). :class:`ExpertParallel` is the collaborator the SimPy
process (:class:`simulator.engine.Simulation`) is given for it."""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from moesim.policies.eviction import REGISTRY as EVICTION
from moesim.simulator.cache import ExpertCache
from moesim.simulator.copyengine import BYPASS, DEMAND, DONE, CopyEngine

if TYPE_CHECKING:
    from moesim.config.scenario import Scenario
    from moesim.policies.registry import Clock, PolicyContext
    from moesim.simulator.cost import CostModel, PassCosts
    from moesim.simulator.lookup import PassRow
    from moesim.simulator.recording import Recorder
    from moesim.simulator.workload import Workload
    from moesim.traces.schema import ModelInfo

# the replay's routing and budget plan of a layer (simulator.lookup.plan): (pass number over the
# replay, layer, the layer's trace rows, the residency a routing policy reads or None) ->
# (the trace's experts per token, each token's experts after the policies)
Planner = Callable[[int, int, np.ndarray, Any], tuple[np.ndarray, list[list[int]]]]


class ExpertParallel:
    """A replay's layers under expert parallelism, a collaborator of the SimPy process given
    what it reads: the scenario and model, the eviction policy's context (cache keys) and the
    expert's bytes, the cost model, the policies' clock, the timeline's recorder, the replay's
    copy engine (on which the GPUs' copies are counted) and ``planner``, the layer's routing
    and budget plan (:func:`simulator.lookup.plan` on the replay: ``planner(pass_index, layer,
    rows, cached)``). What changes as the replay runs (the workload piece, its per-pass costs,
    the pass's row, the time) is handed to each call. Over the replay it counts each GPU's
    token-expert computations (``pairs``) and, with offload, lookups (``hits``, ``misses``)."""

    def __init__(self, scenario: Scenario, model: ModelInfo, ctx: PolicyContext, capacity: float, expert_bytes: int,
                 cost: CostModel, clock: Clock, recorder: Recorder, copy: CopyEngine, planner: Planner) -> None:
        hw = scenario.hardware
        self.hw, self.model, self.ctx, self.expert_bytes = hw, model, ctx, expert_bytes
        self.cost, self.clock, self.recorder, self.copy, self.planner = cost, clock, recorder, copy, planner
        self.timing = scenario.timing
        self.mode = scenario.expert_compute
        self.link_name = f"{hw.host_link}.h2d"
        self.gpus = hw.gpus
        self.offload = self.gpus > 1 and scenario.cache.ep_offload
        self.pairs = np.zeros(self.gpus, np.int64)
        self.hits = np.zeros(self.gpus, np.int64)
        self.misses = np.zeros(self.gpus, np.int64)
        self._pass = -1  # the pass whose evictions the GPUs' caches hold (collision misses)
        # with offload, each GPU's cache of cache.capacity, its own eviction policy (sharing the
        # replay's policy context) and copy engine on its own host link
        spec = scenario.policies.eviction
        self.caches = [ExpertCache(capacity, EVICTION.get(spec.name)(spec.params, ctx),
                                   CopyEngine(hw.h2d, instant=not self.timing))
                       for _ in range(self.gpus)] if self.offload else []

    def nonexpert_times(self, wl: Workload, costs: PassCosts) -> list[float]:
        """Each pass's non-expert seconds, with the pass's tokens and context split across the
        GPUs (zero in cache-only replay, where no time passes)."""
        g_n = self.gpus
        if not self.timing:
            return [0.0] * wl.num_passes
        return self.cost.nonexpert_time(np.ceil(wl.pass_tokens / g_n),
                                        np.ceil(wl.pass_context * costs.attn_scale / g_n)).tolist()

    def step(self, p: int, layer: int, nonexp: float, now: float, wl: Workload, costs: PassCosts, row: PassRow) -> float:
        """One layer, from its start: the budget policy plans it as on one GPU
        (:func:`simulator.lookup.plan`; XShare Algorithm 6 balances the per-GPU load; with
        offload a routing policy that reads the cache sees the GPUs' caches) and the pass's row counts it as on
        one GPU (:meth:`PassRow.count_tokens`); returns its non-expert seconds plus
        :meth:`layer`'s time. ``p`` numbers the pass in ``wl``, the piece being replayed (its
        per-pass ``costs``); the layer starts at ``now`` and is counted in ``row``."""
        self.clock.layer = layer
        rows = wl.rows(p, layer)
        t_layer = nonexp
        if rows.size:
            orig, chosen = self.planner(self.clock.pass_index, layer, rows, self.cached if self.offload else None)
            row.count_tokens(wl, rows, orig, [set(c) for c in chosen])
            t_layer += self.layer(row, float(costs.ffn_scale[p]), layer, chosen, now, nonexp)
        return t_layer

    def cached(self, key: int) -> bool:
        """Whether the cache of the GPU that owns ``key`` holds it (resident or in flight)."""
        ctx = self.ctx
        base = ctx.base_of(key)
        return key in self.caches[int(self.owner[base // ctx.num_experts, base % ctx.num_experts])]

    @cached_property
    def owner(self) -> np.ndarray:
        """The GPU of each (layer, expert)."""
        from moesim.policies.budget.xshare import placement_of

        hw = self.hw
        return placement_of(hw.placement, self.model.num_layers, self.model.num_experts, hw.gpus)

    def layer(self, row: PassRow, scale: float, layer: int, chosen: list[list[int]], now: float,
              nonexp: float) -> float:
        """One layer's time from its routing point: each (token, expert) pair on another GPU
        than the token's sends the token's hidden state over the EP link and back (dispatch
        and combine all-to-all, as long as the busiest GPU's traffic); the layer waits for the
        slowest GPU's experts (:meth:`gpu_spans`; ``scale``: the pass's expert-compute factor),
        the layer having started at ``now``."""
        hw = self.hw
        g_n = self.gpus
        owner = self.owner
        token_bytes = 2 * self.model.hidden_size
        tok_gpu = np.arange(len(chosen)) % g_n
        per_gpu_tokens: list[dict[int, int]] = [{} for _ in range(g_n)]
        sent = np.zeros(g_n)
        recv = np.zeros(g_n)
        for t, experts in enumerate(chosen):
            for e in experts:
                gpu = int(owner[layer, e])
                per_gpu_tokens[gpu][e] = per_gpu_tokens[gpu].get(e, 0) + 1
                if gpu != tok_gpu[t]:
                    sent[tok_gpu[t]] += token_bytes
                    recv[gpu] += token_bytes
        row.ep_loads.append(max(len(d) for d in per_gpu_tokens))
        row.ep_bytes += int(2 * sent.sum())  # dispatch, then combine back
        self.pairs += [sum(d.values()) for d in per_gpu_tokens]
        t_route = now + nonexp
        arrive = self.lookups(row, layer, per_gpu_tokens, t_route) if self.offload else None
        if arrive is None:  # every GPU holds its share: each expert computed is a hit
            row.hits += sum(len(d) for d in per_gpu_tokens)
        if not self.timing:
            return 0.0
        traffic = float(max(sent.max(), recv.max()))
        a2a = hw.links[hw.ep_link].copy_time(traffic) if traffic > 0 else 0.0
        t_layer, spans = self.gpu_spans(row, scale, per_gpu_tokens, arrive, t_route, a2a)
        log = self.recorder.ep
        if log is not None and self.recorder.now():
            log.extend((self.clock.pass_index, layer, g, now, t_route, start, end, now + (nonexp + t_layer))
                       for g, (start, end) in enumerate(spans))
        return t_layer

    def gpu_spans(self, row: PassRow, scale: float, per_gpu_tokens: list[dict[int, int]], arrive: list[list[float]] | None,
                  t_route: float, a2a: float) -> tuple[float, list[tuple[float, float]]]:
        """The layer's seconds from the routing point (dispatch, the slowest GPU's experts,
        combine) and each GPU's experts' start and end. They start once the tokens are
        dispatched (``a2a``) and, with offload, as ``expert_compute`` says once their weights
        have arrived (``arrive``): ``layer`` all once the last has, ``per-expert`` each in lookup
        order once it has, ``on-arrival`` in arrival order. The seconds the copies add to the
        layer go to the pass's stall (``row``)."""
        times = [self.cost.expert_time(np.asarray(list(d.values()))) if d else np.zeros(0) for d in per_gpu_tokens]
        busy = [float(x.sum()) * scale for x in times]
        t_exp = t_route + a2a
        resident = 2 * a2a + max(busy)  # the layer with every GPU's experts resident
        if arrive is None:
            return resident, [(t_exp, t_exp + b) for b in busy]
        mode = self.mode
        spans = []  # each GPU's experts' start and end, from the tokens' dispatch
        for g, ready in enumerate(arrive):
            late = [r - t_exp for r in ready]  # each expert's weights after the dispatch
            if not late:
                spans.append((0.0, 0.0))
            elif mode == "layer":
                wait = max(0.0, max(late))
                spans.append((wait, wait + busy[g]))
            else:
                order = sorted(range(len(late)), key=late.__getitem__) if mode == "on-arrival" else range(len(late))
                t = 0.0
                for i in order:
                    t = max(t, late[i]) + float(times[g][i]) * scale
                spans.append((max(0.0, min(late)), t))
        t_layer = 2 * a2a + max(end for _, end in spans)
        row.stall += t_layer - resident
        return t_layer, [(t_exp + start, t_exp + end) for start, end in spans]

    def lookups(self, row: PassRow, layer: int, per_gpu_tokens: list[dict[int, int]], t_route: float) -> list[list[float]]:
        """With offload, each GPU looks up its experts of the layer at the routing point
        ``t_route``, in the order its tokens reach them, and fetches each one missed over its
        own host link (the miss -> evict -> insert loop of :meth:`ExpertCache.fetch`, the layer's
        experts on that GPU pinned; a copy to a buffer not kept when no room can be made).
        Returns when each expert's weights are on its GPU. The copies' bytes are counted on
        the replay's copy engine (idle under expert parallelism), which the pass rows read."""
        ctx, nbytes = self.ctx, self.expert_bytes
        if self.clock.pass_index != self._pass:  # a new pass: its collision misses start again
            self._pass = self.clock.pass_index
            for cache in self.caches:
                cache.evicted.clear()
        arrive = []
        for g, d in enumerate(per_gpu_tokens):
            cache = self.caches[g]
            copy = cache.copy
            copy.advance(t_route)
            moved = copy.bytes_moved
            keys = ctx.layer_keys(layer, list(d))
            pinned = set(keys)
            ready = []
            for key in keys:  # (none in flight: a layer ends after every copy it issued)
                if key in cache.resident:
                    row.hits += 1
                    self.hits[g] += 1
                    cache.policy.on_access(key)
                    ready.append(t_route)
                    continue
                row.misses += 1
                self.misses[g] += 1
                if key in cache.evicted:
                    row.collisions += 1
                got = cache.fetch(key, nbytes, pinned, True, t_route)
                if got is None:  # no room: the layer's own experts fill the cache
                    tr = copy.submit(key, nbytes, DEMAND, t_route)
                    tr[BYPASS] = True
                    row.uncached += 1
                else:
                    tr = got[1]
                ready.append(tr[DONE])  # (at once in cache-only replay: issued at t_route)
            self.copy.bytes_moved += copy.bytes_moved - moved
            arrive.append(ready)
        return arrive

    def summary(self, total_time: float) -> dict[str, Any]:
        """Per-GPU figures for the summary: each GPU's share of the token-expert computations
        (``gpu_load``) and its hit rate; with offload each GPU's host-link utilisation, the
        host link's as their mean, and the fullest GPU cache's peak bytes."""
        names = [f"gpu{g}" for g in range(self.gpus)]
        total = int(self.pairs.sum())
        looked = self.hits + self.misses
        out: dict[str, Any] = {
            "gpu_load": {n: (int(x) / total if total else None) for n, x in zip(names, self.pairs, strict=True)},
            # every computation a hit when the GPUs hold their shares
            "gpu_hit_rate": {n: (int(h) / int(k) if self.offload else 1.0) if p else None
                             for n, h, k, p in zip(names, self.hits, looked, self.pairs, strict=True)}}
        if self.offload:
            for cache in self.caches:
                cache.copy.advance(total_time)
            busy: list[float | None] = [c.copy.busy_time / total_time if total_time > 0 else None
                                        for c in self.caches]
            out["gpu_link_utilisation"] = dict(zip(names, busy, strict=True))
            out["link_utilisation"] = {self.link_name: sum(b or 0.0 for b in busy) / self.gpus
                                       if total_time > 0 else None}
            out["cache_peak_bytes"] = max(int(c.max_used) for c in self.caches)
        return out

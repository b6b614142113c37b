"""The SimPy model of one GPU (``docs/design.md``: "Simulation semantics"; ``docs/concepts/execution.md``).

One SimPy process runs the forward passes on the compute stream. For each layer of a pass:

1. non-expert compute (attention, gate) for the pass's tokens;
2. at the routing point the layer's experts are looked up through the one lookup path
   (:mod:`simulator.lookup`): a *hit* (resident), a *late prefetch* (its transfer is in
   flight: wait for it) or a *miss* (absent: the miss policy decides; ``fetch`` makes room
   through the cache and queues a demand transfer on the host link's copy engine), under one
   pinning rule;
3. the prefetch policy's proposals go into SpecMD A.3's asynchronous queue (selected,
   waiting, admitted when room can be made, withdrawn at their target layer);
4. expert compute: ``expert_compute: layer`` (default) once all of the layer's experts are
   present; ``on-arrival`` each as soon as it has arrived; ``per-expert`` one after another
   in router order, each looked up when the previous one starts.

With an execution style (``execution``, :mod:`moesim.config.execution`) a host thread issues
the work: its clock advances by the style's cost per launch and per demand copy, waits where
the style synchronises, and the GPU starts nothing before the host has issued it
(``docs/concepts/execution.md``, "The host thread"; the kernel keeps the same clock).

Time spent by the compute stream waiting for transfers is *stall*. A *collision miss* is a
miss on an expert evicted earlier in the same forward pass. With no prefetch, in ``layer``
execution, the step time is exactly ``sum over layers of (non-expert + copy of missed experts
+ expert compute)`` (``speculating-experts-prefetch.txt`` §5.1), which the tests check, as
they check the ``per-expert`` recurrence of ``docs/concepts/execution.md``.

Cache-only replay (``timing: false``) runs the same decisions with zero-cost compute and
instant transfers, so no simulated time passes.
"""

from __future__ import annotations

import time as _time
from collections.abc import Generator
from functools import cached_property
from typing import Any

import numpy as np
import simpy

from moesim.config.scenario import Scenario
from moesim.output.results import Result
from moesim.policies.registry import Clock
from moesim.simulator import expert_compute, served_future
from moesim.simulator.blocks import PassArrays, PassBlocks
from moesim.simulator.build import cache_sizing, make_policies
from moesim.simulator.cache import ExpertCache
from moesim.simulator.copyengine import (
    CopyEngine,
)
from moesim.simulator.cost import CostModel, PassCosts
from moesim.simulator.host import HostThread
from moesim.simulator.lookup import LayerLookup, PassRow, Run, plan
from moesim.simulator.parallel import ExpertParallel
from moesim.simulator.prefetchq import NO_PINS, PrefetchQueue
from moesim.simulator.recording import Recorder
from moesim.simulator.source import ProgressFn, Source
from moesim.simulator.workload import DECODE, VERIFY, Workload
from moesim.traces.trace import Trace


class Simulation:
    """Replays a workload under a scenario. Build once, call :meth:`run` once.

    It puts the parts together: the trace, cache sizing and policies from the builder
    (:mod:`simulator.build`), the host link's copy engine, the cache that fetches through it
    (:class:`simulator.cache.ExpertCache`), the prefetch queue
    (:class:`simulator.prefetchq.PrefetchQueue`) and the cost model; :meth:`run` replays on
    the compiled kernel when every policy has a kernel form, else on the SimPy compute
    process (:meth:`_run`, whose layers go through the one lookup path), and derives the
    metrics. :func:`simulate` is the facade. ``keep_rows=False``: the result carries the
    summary and the per-request rows but no per-pass rows (``moesim run --no-write``: a long
    replay then writes none to disk)."""

    def __init__(self, scenario: Scenario, trace: Trace | None = None,
                 workload: Workload | None = None, progress: ProgressFn | None = None,
                 record_transfers: bool = False, record_layers: bool = False,
                 record_decisions: bool = False, record_passes: int | None = None,
                 chunk_rows: int | None = None, keep_rows: bool = True) -> None:
        self.scenario = scenario
        # where the passes come from: the workload given, the trace whole or in pieces, serving's scheduler
        self.source = Source(scenario, progress)
        workload = self.source.first(trace, workload, record_decisions, chunk_rows, self.prepare_piece)
        self.wl = workload
        model = workload.model
        self.model = model
        # the replay's rows, a block of passes at a time (keep_rows False: only the summary is wanted)
        self.blocks = PassBlocks(model.num_layers, keep_rows, per_request=self.source.serving is None)
        size = cache_sizing(scenario, model)
        self.precision = size.precision
        self.expert_bytes = size.expert_bytes
        self.precisions = size.precisions  # largest first; cache key = base * P + index
        self.num_prec = len(size.precisions)
        self.default_prec = size.default_prec
        self.capacity = size.capacity
        self.cost = CostModel(scenario.hardware, model, self.expert_bytes, dequant=scenario.host.dequant)
        self.progress = progress
        self.clock = Clock()
        pol = make_policies(scenario, workload, size, self.clock,
                            self.source.read_again if self.source.stream_source is not None else None,
                            self.source.future_of if self.source.tracks_future else None)
        self.eviction, self.miss, self.prefetch = pol.eviction, pol.miss, pol.prefetch
        self.routing, self.budget = pol.routing, pol.budget
        hw = scenario.hardware
        self.link_name = f"{hw.host_link}.h2d"
        self.copy = CopyEngine(hw.h2d, instant=not scenario.timing)
        self.cache = ExpertCache(self.capacity, self.eviction, self.copy)
        # the timeline (``moesim run --events``)
        self.recorder = Recorder(self.clock, record_transfers, record_layers, record_passes)
        if self.recorder.transfers is not None:
            self.copy.on_complete.append(self.recorder.on_transfers)
        self.env = simpy.Environment()
        self.costs = PassCosts(self.cost, workload, scenario.timing, scenario.workload.speculative)  # per pass
        self.ep = ExpertParallel(scenario, model, self.eviction.ctx, self.capacity, self.expert_bytes, self.cost,
                                 self.clock, self.recorder, self.copy,
                                 lambda *at: plan(self, *at))  # its layers, with hardware.gpus > 1
        # (pass, layer, op, key) in decision order, op in hit/fetch/bypass/evict/prefetch/run
        # (run: the expert ``key`` runs, or with key -1 all the layer's looked-up experts);
        # the calibration executor replays them on the device
        self.decisions: list[tuple[int, int, str, int]] | None = [] if record_decisions else None
        self._init_replay_state()
        self.arrays: PassArrays  # the SimPy path's per-pass arrays, made as it runs each workload
        self.timing = scenario.timing
        self.host = HostThread(scenario.host, self.copy)  # the host thread issuing the GPU's work
        self.general = (self.routing.changes_routing or not self.miss.always_fetch or self.budget.restricts
                        or scenario.hardware.gpus > 1)
        # the prefetch family's admission rule: experts resident before the replay, never evicted
        pinned = self.prefetch.pinned()
        self.preloaded = self.cache.preload(list(pinned), self.expert_bytes) if pinned else 0
        self.wall_s = 0.0
        self.simpy_reason: str | None = None  # why the SimPy path ran (None: the kernel did)
        self.ffn_by_tokens: list[float] = []  # expert compute seconds by tokens (_prepare_costs)
        self.ffn_factor: list[float] = []  # and the per-pass factor: an access takes their product
        self._nonexp: list[float] = []

    def prepare_piece(self, workload: Workload) -> None:
        """Called on the reading thread with each piece of the trace once built: the
        prefetcher's proposals for its passes when they read that piece alone
        (``PrefetchPolicy.piece_proposals``). The pieces read before the policies exist get
        none; the kernel asks for theirs as it replays them."""
        prefetch = getattr(self, "prefetch", None)  # None until __init__ has made the policies
        if prefetch is not None:
            workload.proposals = prefetch.piece_proposals(workload)

    def bind_piece(self, workload: Workload) -> None:
        """Make ``workload`` (the trace's next piece) the one the policies and the per-pass
        costs read."""
        self.wl = workload
        self.costs = PassCosts(self.cost, workload, self.timing, self.scenario.workload.speculative)
        for pol in (self.eviction, self.miss, self.prefetch, self.routing, self.budget):
            pol.ctx.workload = workload

    @cached_property
    def acc_keys(self) -> np.ndarray:
        """The cache key of every access (made when first read: the calibration executor's; the
        SimPy path's lookups make each layer's keys with ``PolicyContext.layer_keys``)."""
        return self.wl.cache_keys(self.num_prec, self.default_prec)

    def _init_replay_state(self) -> None:
        """The compute process's state between routing points: the pass's row and the
        prefetch queue (:class:`simulator.prefetchq.PrefetchQueue`); the keys evicted in the
        pass (collision misses) are the cache's ``evicted``, cleared at each pass."""
        self.row = PassRow()  # the pass being replayed
        self.pfq = PrefetchQueue(self.prefetch, self.eviction, self.cache, self.decisions,
                                 self.scenario.host.prefetch_depth)
        self.pf_unused = self.pfq.unused  # prefetched keys not accessed yet
        if self.recorder.withdrawn is not None:
            self.pfq.on_withdrawn.append(self.recorder.on_withdrawn)

    def _prepare_costs(self) -> None:
        """Expert compute seconds by tokens and per-pass factor (an access's time is their
        product, read per layer) and the non-expert time of every pass."""
        table, scale = self.costs.ffn_table()
        self.ffn_by_tokens = table.tolist()
        self.ffn_factor = scale.tolist()
        self._nonexp = self.costs.nonexpert_times().tolist()

    # -- the compute-stream process -------------------------------------------------------
    def _run(self) -> Generator[simpy.Event, Any, None]:
        """The compute stream: the passes of the workload (:meth:`_passes`), then, serving
        under load (``Source.pieces``: the scheduler), each pass the scheduler forms when the
        one before has ended, numbered on (``Clock.pass_base``) with the cache, the copy engine
        and the prefetch queue carried over, as the kernel's piece loop does; the replay then
        adopts the joined passes."""
        from moesim.simulator.kernel import next_piece
        from moesim.simulator.workload import join, passes_of

        self.look = LayerLookup(self, self.cache.evicted)
        parts = []
        while True:
            yield from self._passes()
            self.arrays.hand_to(self.blocks)
            if self.source.pieces is None:
                return
            parts.append(passes_of(self.wl))
            nxt = next_piece(self.source.pieces, self.env.now)
            if nxt is None:
                self.wl = join(parts)
                self.source.trace_pieces = len(parts)
                return
            self.clock.pass_base += self.wl.num_passes
            self.bind_piece(nxt)
            self.arrays = PassArrays(nxt)

    def _passes(self) -> Generator[simpy.Event, Any, None]:
        """Forward passes on the compute stream. Per layer: non-expert compute, then from the
        routing point :meth:`_layer` (lookups, proposals, expert compute) or, under expert
        parallelism, :meth:`ExpertParallel.step`; per pass one row (:meth:`_end_pass`). Cache-only
        replay makes the same decisions at zero cost."""
        env = self.env
        num_l = self.model.num_layers
        off = self.wl.off.tolist()
        ep = self.scenario.hardware.gpus > 1
        if ep:
            nonexp = self.ep.nonexpert_times(self.wl, self.costs)
        else:
            self._prepare_costs()
            nonexp = self._nonexp
        n_pass = self.wl.num_passes
        report_every = max(1, n_pass // 200)
        carry = 0.0
        release = self.wl.release().tolist()
        for p in range(n_pass):
            if release[p] > env.now:  # serving: the GPU idles until the pass's requests are there
                yield env.timeout(release[p] - env.now)
                self.host.wait_until(env.now)
            self._begin_pass(p)
            bytes0 = self.copy.bytes_moved
            ne = nonexp[p]
            for layer in range(num_l):
                if ep:  # the layer in one step with its non-expert compute
                    yield env.timeout(self.ep.step(p, layer, ne, env.now, self.wl, self.costs, self.row))
                    continue
                delay = carry + ne  # the previous layer's experts, then this one's attention
                if self.host.on:  # the host issues the non-expert part; the GPU starts it once issued
                    self.host.t += self.host.layer_s
                    lag = self.host.t - env.now
                    if lag > carry:
                        delay = lag + ne
                if delay > 0:
                    yield env.timeout(delay)
                if self.host.sync:  # the host waits for the routing
                    self.host.wait_until(env.now)
                carry = 0.0
                lo, hi = off[p * num_l + layer], off[p * num_l + layer + 1]
                if lo < hi:  # else no routing for this (pass, layer): the layer is skipped
                    carry = self._layer(p, layer, lo, hi, env.now, ne) - env.now
            if carry > 0:
                yield env.timeout(carry)
                carry = 0.0
            self._end_pass(p, bytes0)
            if self.progress is not None and self.source.serving is not None:  # requests served
                self.progress(self.source.serving.finished, self.source.serving.n)
            elif self.progress is not None and (p + 1) % report_every == 0:
                self.progress(p + 1, n_pass)
        if self.progress is not None and self.source.serving is None:
            self.progress(n_pass, n_pass)

    def _layer(self, p: int, layer: int, lo: int, hi: int, now: float, ne: float) -> float:
        """One layer from its routing point ``now``: the experts are looked up
        (:class:`simulator.lookup.LayerLookup`, the one lookup path), proposals for it still
        waiting or queued are withdrawn, the prefetcher's proposals are queued
        (:meth:`PrefetchQueue.propose`) and the experts run as ``expert_compute`` says. Returns the layer's
        end."""
        clock, row = self.clock, self.row
        self.copy.advance(now)
        clock.now = now
        clock.layer = layer
        look = self.look
        look.plan(p, layer, lo, hi, row)
        clock.pending = set(look.keys)
        q = self.pfq
        if self.prefetch.active:  # else the queue stays empty
            q.withdraw(layer, look.keys, row)
        st0 = row.stall
        if self.scenario.expert_compute == "per-expert":
            if self.prefetch.active:
                q.propose(p, layer, now, row)
            end = expert_compute.per_expert(self, look, now)
        else:
            end = self._fused(look, p, layer, now)
        self.recorder.layer(layer, now - ne, now, now + row.stall - st0, end, self.cache.used)
        return end

    def _fused(self, look: LayerLookup, p: int, layer: int, now: float) -> float:
        """``layer`` and ``on-arrival`` execution: every expert looked up under the layer's
        pins, the proposals queued, the experts run (:func:`expert_compute.fused`); then the pins are
        released and waiting proposals admitted. Returns the layer's end."""
        pinned = set(look.keys)
        runs: list[Run] = []
        lookup = look.lookup
        copies = self.copy.demand_submits
        for i in range(len(look)):
            lookup(i, pinned, now, runs)
        if self.host.on:  # the host submits the layer's demand copies
            self.host.t += (self.copy.demand_submits - copies) * self.host.copy_s
        if self.prefetch.active:
            self.pfq.propose(p, layer, now, self.row, pinned)
        end = expert_compute.fused(self, look.finish(runs), now, self.scenario.expert_compute == "on-arrival")
        self.clock.pending = set()
        if self.decisions is not None:
            self.decisions.append((self.clock.pass_index, layer, "run", -1))
        if self.pfq.waiting:  # the layer's pins are released
            self.copy.advance(end)
            self.clock.now = end
            self.pfq.admit(end, NO_PINS, self.row)
        return end

    def _begin_pass(self, p: int) -> None:
        self.clock.pass_index = self.clock.pass_base + p
        self.arrays.t_start[p] = self.env.now
        self.cache.evicted.clear()
        self.row = PassRow()

    def _end_pass(self, p: int, bytes0: int) -> None:
        """The pass's row: its end, stall and counts. The host waits for the pass's end (its
        next token needs this one)."""
        self.host.wait_until(self.env.now)
        self.copy.advance(self.env.now)
        self.arrays.write(p, self.row, self.env.now, self.copy.bytes_moved - bytes0, self.general)

    def run(self) -> Result:
        """Run the simulation to the end and derive the metrics."""
        from moesim.simulator import kernel
        from moesim.simulator.metrics import summarise

        t0 = _time.perf_counter()
        if self.source.tracks_future and self.source.reference is None:  # serving Belady: the future it reads
            served_future.settle(self)
        self.simpy_reason = kernel.kernel_form(self)
        # a trace file in pieces only for replays the kernel runs (simulator.stream.why_whole); serving's
        # passes on either path
        src = self.source
        assert src.pieces is None or src.serving is not None or self.simpy_reason is None, self.simpy_reason
        if self.simpy_reason is None:
            kernel.replay(self)
        else:
            self.arrays = PassArrays(self.wl)  # the SimPy path's per-pass arrays (the kernel makes its own)
            self.env.process(self._run())
            self.env.run()
            self.copy.finish()
        self.wall_s = _time.perf_counter() - t0
        self.blocks.rows.close()
        requests = src.serving.frame() if src.serving is not None else self.blocks.requests_frame()
        summary = summarise(self, self.blocks.totals, requests)
        if src.serving is not None:
            summary.update(src.serving.report(requests, self.scenario.slo), **src.future_report())
        if self.scenario.workload.speculative is not None and self.scenario.timing and src.trace is not None:
            from dataclasses import replace

            ar = replace(self.scenario, workload=replace(self.scenario.workload, speculative=None))
            ar_rate = Simulation(ar, trace=src.trace).run().summary["tokens_per_s"]
            summary["speedup_vs_autoregressive"] = (summary["tokens_per_s"] / ar_rate) if ar_rate else None
        return Result(self.scenario, self.blocks.rows, requests, summary, self.recorder.transfers,
                      extra=self.recorder.extra(self.wl.num_passes))


def simulate(scenario: Scenario, trace: Trace | None = None, **kwargs: Any) -> Result:
    """Build a :class:`Simulation` and run it."""
    return Simulation(scenario, trace=trace, **kwargs).run()


__all__ = ["DECODE", "VERIFY", "Result", "Simulation", "simulate"]

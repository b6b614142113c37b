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
from collections.abc import Callable, Generator, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import simpy

from moesim.config.scenario import Scenario
from moesim.errors import MoesimError
from moesim.output.results import PassRows, Result
from moesim.policies.registry import Clock
from moesim.simulator.build import cache_sizing, load_trace, make_policies, scenario_workload
from moesim.simulator.cache import ExpertCache
from moesim.simulator.copyengine import (
    DEMAND,
    DONE,
    ISSUED,
    KEY,
    NBYTES,
    PRIORITY,
    PROMOTED,
    START,
    CopyEngine,
    Transfer,
)
from moesim.simulator.cost import CostModel
from moesim.simulator.lookup import LayerLookup, PassRow, Run, arrival, plan
from moesim.simulator.metrics import PassTotals
from moesim.simulator.prefetchq import NO_PINS, PrefetchQueue
from moesim.simulator.workload import DECODE, VERIFY, Workload
from moesim.traces.schema import PHASES
from moesim.traces.trace import Trace

if TYPE_CHECKING:
    from moesim.simulator.serving import Scheduler

ProgressFn = Callable[[int, int], None]


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
        self._trace = trace
        # a trace file read a piece at a time (simulator.stream): the first piece's workload now,
        # the others as the kernel replays (``self.pieces``); the reason when it is read whole
        self.pieces: Generator[Workload, float, None] | None = None
        self.trace_rows = 0  # the file's rows, when read in pieces (progress)
        self.stream_source: tuple[Path, int] | None = None  # that file and its piece size
        self._source_stamp: tuple[int, int] | None = None  # its size and modification time then
        self.trace_pieces = 1  # the pieces the replay read the trace in
        # passes over that file before the replay (next uses for a policy reading the future, counts),
        # which the progress covers with the replay, and the rows of those it has shown
        self.first_passes = self.rows_shown = 0
        self._counted = False  # the policies' pass over the file has been shown
        # the replay's rows, taken a block of passes at a time (take_block): the summary's totals,
        # the per-pass rows (on disk from the second block on), the per-request rows, and the
        # passes and batches (groups) of the blocks taken
        self.totals = PassTotals()
        self.rows = PassRows(keep_rows)  # keep_rows False: only the summary is wanted
        self._request_rows: list[dict[str, np.ndarray]] = []  # per block, the per-request columns
        self._pass_base = self._group_base = 0
        self.whole_reason: str | None = "a trace or workload was given"
        self.serving: Scheduler | None = None  # serving under load: the scheduler forming each pass
        recording = record_transfers or record_layers or record_decisions
        if scenario.workload.arrivals is not None:
            workload = self._serve(trace)
        if workload is None and trace is None:
            workload = self._first_piece(recording, chunk_rows)
        if workload is None:
            trace = trace if trace is not None else load_trace(scenario)
            self._trace = trace
            workload = scenario_workload(scenario, trace)
        self.wl = workload
        model = workload.model
        self.model = model
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
                            self._read_again if self.stream_source is not None else None)
        self.eviction, self.miss, self.prefetch = pol.eviction, pol.miss, pol.prefetch
        self.routing, self.budget = pol.routing, pol.budget
        hw = scenario.hardware
        self.link_name = f"{hw.host_link}.h2d"
        self.copy = CopyEngine(hw.h2d, instant=not scenario.timing)
        self.cache = ExpertCache(self.capacity, self.eviction, self.copy)
        # the timeline (``moesim run --events``), recorded for the passes before record_passes
        # (all when None): transfers (key, kind: demand | prefetch | promoted, issued, start,
        # done, bytes); withdrawn prefetches (key,
        # issued, withdrawn at, bytes); per layer (pass, layer, non-expert start, routing point, experts
        # start, layer end) and the cache's bytes at the routing point; with expert parallelism
        # per GPU (pass, layer, gpu, start, dispatch start, experts start, experts end, layer end)
        self.record_passes = record_passes
        self.transfers: list[tuple[int, str, float, float, float, int]] | None = None
        self.withdrawn: list[tuple[int, float, float, int]] | None = None
        self.layer_log: list[tuple[int, int, float, float, float, float]] | None = [] if record_layers else None
        self.occupancy: list[tuple[float, int]] | None = [] if record_layers else None
        self.ep_log: list[tuple[int, int, int, float, float, float, float, float]] | None = (
            [] if record_layers else None)
        if record_transfers:
            self.transfers, self.withdrawn = [], []
            self.copy.on_complete.append(self._log_transfers)
        self.env = simpy.Environment()
        self.attn_scale, self.ffn_scale = self._pass_scales(workload)  # the per-pass cost factors
        # (pass, layer, op, key) in decision order, op in hit/fetch/bypass/evict/prefetch/run
        # (run: the expert ``key`` runs, or with key -1 all the layer's looked-up experts);
        # the calibration executor replays them on the device
        self.decisions: list[tuple[int, int, str, int]] | None = [] if record_decisions else None
        self._init_replay_state()
        self.timing = scenario.timing
        # the host thread (docs/concepts/execution.md, "The host thread"): its clock, its costs in seconds
        hm = scenario.host
        self.host_on = hm.active
        self.host_t = 0.0
        self.host_layer, self.host_launch, self.host_copy = hm.layer_us * 1e-6, hm.launch_us * 1e-6, hm.copy_us * 1e-6
        self.host_sync = ("none", "layer", "expert").index(hm.sync)
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

    def _first_piece(self, recording: bool, chunk_rows: int | None) -> Workload | None:
        """The trace file's first piece when the replay can read it a piece at a time (its
        rows in request order and more of them than one piece holds), with the rest left to
        read in ``self.pieces``; else None (``self.whole_reason`` says why)."""
        from moesim.simulator import stream
        from moesim.simulator.build import trace_path
        from moesim.traces.io import requests_in_order, trace_rows

        sc = self.scenario
        self.whole_reason = stream.why_whole(sc, recording)
        if self.whole_reason is not None:
            return None
        path = trace_path(sc)
        rows = trace_rows(path)
        chunk = chunk_rows if chunk_rows is not None else stream.piece_rows(path)
        if rows <= chunk:
            self.whole_reason = "the trace fits in one piece"
            return None
        self._source_stamp = _stamp(path)  # before the first read (the reader starts on a thread)
        pieces = stream.read_ahead(stream.pieces(sc, path, chunk), self.prepare_piece)
        # the whole file's order is checked while the reader reads the first piece (the
        # check took 0.03-0.09 s of the replay's thread on the 25.6 M-access benchmark trace); a
        # file out of order is read whole, whether or not its first piece read
        with ThreadPoolExecutor(1) as checking:
            in_order = checking.submit(requests_in_order, path)
            try:
                first = next(pieces)
            except MoesimError:
                if in_order.result():
                    raise
            if not in_order.result():
                pieces.close()
                self.whole_reason = "the trace file's rows are not in request order"
                return None
        self.pieces = pieces
        self.stream_source = (path, chunk)  # read again by first passes (the future's, the counts')
        self.trace_rows = rows
        self.first_passes = stream.first_passes(sc)
        return first

    def _serve(self, trace: Trace | None) -> Workload:
        """Serving under load (:mod:`simulator.serving`): the requests' plan, the scheduler
        as the source of forward passes (``self.pieces``) and its first pass."""
        from moesim.simulator import serving, stream

        sc = self.scenario
        reason = stream.why_not_served(sc)
        if reason is not None:
            raise MoesimError(f"{sc.source}: key 'workload.arrivals': serving under load replays one forward pass "
                              f"at a time, which {reason}. Change that, or remove "
                              "workload.arrivals for the fixed-batch replay.")
        given = trace is not None
        trace = trace if trace is not None else load_trace(sc)
        arrivals = sc.workload.arrivals
        assert arrivals is not None
        bank = serving.Bank(trace, sc.source)
        plan = serving.plan_requests(arrivals, bank, sc.seed, sc.base_dir)
        longer = serving.synth_lengths(sc, plan) if not given else None
        if longer is not None:  # a synthetic trace made with the arrivals' lengths, not repeated
            trace = load_trace(longer)
            bank = serving.Bank(trace, sc.source)
            plan = serving.plan_requests(arrivals, bank, sc.seed, sc.base_dir)
            synth = longer.workload.trace.synth
            assert synth is not None
            plan.notes.append(f"the synthetic trace was made with {synth.prompt_tokens} prompt and {synth.tokens} "
                              "decode tokens per request, to cover the arrivals' lengths")
        self._trace = trace
        size = cache_sizing(sc, trace.model)
        cost = CostModel(sc.hardware, trace.model, size.expert_bytes)
        dense = serving.BF16 * cost.nonexpert_weights * trace.model.num_layers
        m = trace.model
        g = sc.hardware.gpus  # expert parallelism: each GPU holds its share of the experts
        held = size.capacity if g == 1 else m.num_layers * m.num_experts * size.expert_bytes / g
        kv = serving.kv_capacity_tokens(sc, m, held, dense)
        from moesim.simulator.stream import _classes

        self.serving = serving.Scheduler(sc, plan, bank, kv, previous=_classes(sc)[1].reads_previous_pass)
        self.pieces = self.serving.passes()
        self.whole_reason = "serving under load: one forward pass at a time"
        return next(self.pieces)

    def first_pass_progress(self) -> Callable[[int], None]:
        """The progress of a first pass over the trace file (told the rows read so far): the
        bar covers the first passes and the replay, ``(1 + first_passes)`` times the file's rows."""
        before, total = self.rows_shown, (1 + self.first_passes) * self.trace_rows
        self.rows_shown += self.trace_rows

        def shown(rows: int) -> None:
            if self.progress is not None:
                self.progress(before + rows, total)
        return shown

    def pieces_again(self, shown: Callable[[int], None] | None) -> Iterator[Workload]:
        """The trace file's pieces from its start, read again as the replay cuts them, for a
        pass over the file before the replay; ``shown`` (:meth:`first_pass_progress`, or None
        for a pass the progress does not count) is told the rows read so far."""
        from moesim.simulator import stream

        assert self.stream_source is not None, "a trace read in pieces"
        path, chunk = self.stream_source
        self.check_source()
        rows = 0
        for wl in stream.pieces(self.scenario, path, chunk):
            rows += len(wl.trace) if wl.trace is not None else 0
            if shown is not None:
                shown(rows)
            yield wl

    def check_source(self) -> None:
        """A trace file read a piece at a time, and perhaps more than once (first passes), must
        not change while it is replayed: its results would mix two files' data (static pinning's
        counts from one, the replay from another). Checked before each pass over it and after
        the replay."""
        assert self.stream_source is not None, "a trace read in pieces"
        path = self.stream_source[0]
        if _stamp(path) != self._source_stamp:
            raise MoesimError(f"trace {path}: the file changed while it was replayed a piece at a time (its size "
                              "or modification time is not what it was when the replay began), so the results "
                              "would mix two files' data. Replay it again once nothing writes it.")

    def _read_again(self) -> Iterator[Workload]:
        """:meth:`pieces_again` for a policy that counts over the whole trace before the replay
        (``PolicyContext.trace_pieces``): its first read is shown as a first pass."""
        shown = None if self._counted else self.first_pass_progress()
        self._counted = True
        return self.pieces_again(shown)

    def accesses_after(self) -> tuple[np.ndarray, np.ndarray]:
        """For an eviction policy that reads the future, a piece at a time: the first pass over
        the trace file, shown in the progress (:func:`simulator.stream.accesses_after`)."""
        from moesim.simulator import stream

        return stream.accesses_after(self.pieces_again(self.first_pass_progress()), self.num_prec, self.default_prec,
                                     self.model.num_layers * self.model.num_experts * self.num_prec)

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
        self.attn_scale, self.ffn_scale = self._pass_scales(workload)
        for pol in (self.eviction, self.miss, self.prefetch, self.routing, self.budget):
            pol.ctx.workload = workload

    def _size_passes(self, workload: Workload) -> None:
        """The per-pass arrays the SimPy path fills, one entry per forward pass of ``workload``:
        the counts, the times and the gate mass (the workload's until a policy changes it)."""
        n = workload.num_passes
        self._cols = {name: np.zeros(n, dtype=np.int64) for name in
                      ("hits", "misses", "late_prefetches", "collision_misses", "uncached_fetches",
                       "bytes", "bytes_ep", "prefetches_issued", "prefetches_used", "prefetch_predicted_hits",
                       "prefetch_predicted", "prefetch_actual", "low_precision_experts",
                       "dropped_experts", "substituted_experts", "tokens_altered",
                       "prefetches_cancelled", "unique_computed")}
        self._t_start, self._t_end, self._stall = np.zeros(n), np.zeros(n), np.zeros(n)
        self._ep_max_load = np.zeros(n)
        self._mass_total = workload.weight_total.astype(np.float64).copy()
        self._mass_kept = workload.weight_total.astype(np.float64).copy()

    def _pass_scales(self, workload: Workload) -> tuple[np.ndarray, np.ndarray]:
        """Per pass, the attention-context and expert-time factors of sparse verification
        (sparse-verification-speculative-decoding.txt Table 1): attention context and expert
        down projections are thinned in verification passes; 1 elsewhere."""
        spec = self.scenario.workload.speculative
        is_verify = workload.pass_phase == VERIFY
        return (np.where(is_verify, 1.0 - (spec.sparse_attention if spec else 0.0), 1.0),
                np.where(is_verify, 1.0 - (spec.sparse_ffn if spec else 0.0) / 3.0, 1.0))

    @cached_property
    def acc_keys(self) -> np.ndarray:
        """The cache key of every access (made when first read: the calibration executor's; the
        SimPy path's lookups make each layer's keys with ``PolicyContext.layer_keys``)."""
        return self.wl.cache_keys(self.num_prec, self.default_prec)

    def _recording(self) -> bool:
        return self.record_passes is None or self.clock.pass_index < self.record_passes

    def _log_transfers(self, trs: list[Transfer]) -> None:
        """Completed transfers, into the timeline (inside its window)."""
        if self.transfers is None or not self._recording():
            return
        for tr in trs:
            kind = "promoted" if tr[PROMOTED] else ("demand" if tr[PRIORITY] == DEMAND else "prefetch")
            self.transfers.append((tr[KEY], kind, tr[ISSUED], tr[START], tr[DONE], tr[NBYTES]))

    def _init_replay_state(self) -> None:
        """The compute process's state between routing points: the pass's row and the
        prefetch queue (:class:`simulator.prefetchq.PrefetchQueue`); the keys evicted in the
        pass (collision misses) are the cache's ``evicted``, cleared at each pass."""
        self.row = PassRow()  # the pass being replayed
        self.pfq = PrefetchQueue(self.prefetch, self.eviction, self.cache, self.decisions,
                                 self.scenario.host.prefetch_depth)
        self.pf_unused = self.pfq.unused  # prefetched keys not accessed yet
        if self.withdrawn is not None:
            self.pfq.on_withdrawn.append(self._log_withdrawn)

    def _log_withdrawn(self, gone: list[Transfer]) -> None:
        """Withdrawn prefetches, into the timeline (inside its window). A listener only when
        the timeline records withdrawals."""
        assert self.withdrawn is not None
        if self._recording():
            self.withdrawn.extend((tr[KEY], tr[ISSUED], self.clock.now, tr[NBYTES]) for tr in gone)

    def ffn_table(self, at_least: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Expert compute seconds by the number of tokens routed (index 0 unused; up to the
        most any access has, or ``at_least``) and the per-pass factor: an access's compute
        time is ``table[tokens] * factor[pass]`` on both replay paths (zero in cache-only
        replay)."""
        n = max(int(self.wl.acc_tokens.max()), at_least)  # a workload has an access (no empty trace)
        table = np.zeros(n + 1)
        if self.scenario.timing:
            table[1:] = self.cost.expert_time(np.arange(1, n + 1))
        return table, self.ffn_scale

    def nonexpert_times(self) -> np.ndarray:
        """Non-expert (attention, gate) seconds of every pass (zero in cache-only replay)."""
        wl = self.wl
        if self.scenario.timing:
            return self.cost.nonexpert_time(wl.pass_tokens, wl.pass_context * self.attn_scale)
        return np.zeros(wl.num_passes)

    def _prepare_costs(self) -> None:
        """Expert compute seconds by tokens and per-pass factor (an access's time is their
        product, read per layer) and the non-expert time of every pass."""
        table, scale = self.ffn_table()
        self.ffn_by_tokens = table.tolist()
        self.ffn_factor = scale.tolist()
        self._nonexp = self.nonexpert_times().tolist()

    # -- the compute-stream process -------------------------------------------------------
    def _run(self) -> Generator[simpy.Event, Any, None]:
        """The compute stream: the passes of the workload (:meth:`_passes`), then, serving
        under load (``self.pieces``: the scheduler), each pass the scheduler forms when the
        one before has ended, numbered on (``Clock.pass_base``) with the cache, the copy engine
        and the prefetch queue carried over, as the kernel's piece loop does; the replay then
        adopts the joined passes."""
        from moesim.simulator.kernel import next_piece
        from moesim.simulator.workload import join, passes_of

        self.look = LayerLookup(self, self.cache.evicted)
        parts = []
        while True:
            yield from self._passes()
            self.take_rows()
            if self.pieces is None:
                return
            parts.append(passes_of(self.wl))
            nxt = next_piece(self.pieces, self.env.now)
            if nxt is None:
                self.wl = join(parts)
                self.trace_pieces = len(parts)
                return
            self.clock.pass_base += self.wl.num_passes
            self.bind_piece(nxt)
            self._size_passes(nxt)

    def _passes(self) -> Generator[simpy.Event, Any, None]:
        """Forward passes on the compute stream. Per layer: non-expert compute, then from the
        routing point :meth:`_layer` (lookups, proposals, expert compute) or, under expert
        parallelism, :meth:`_ep_step`; per pass one row (:meth:`_end_pass`). Cache-only
        replay makes the same decisions at zero cost."""
        env = self.env
        num_l = self.model.num_layers
        off = self.wl.off.tolist()
        ep = self.scenario.hardware.gpus > 1
        if ep:
            nonexp = self._ep_nonexpert_times()
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
                if self.host_t < env.now:
                    self.host_t = env.now
            self._begin_pass(p)
            bytes0 = self.copy.bytes_moved
            ne = nonexp[p]
            for layer in range(num_l):
                if ep:  # the layer in one step with its non-expert compute
                    yield env.timeout(self._ep_step(p, layer, ne))
                    continue
                delay = carry + ne  # the previous layer's experts, then this one's attention
                if self.host_on:  # the host issues the non-expert part; the GPU starts it once issued
                    self.host_t += self.host_layer
                    lag = self.host_t - env.now
                    if lag > carry:
                        delay = lag + ne
                if delay > 0:
                    yield env.timeout(delay)
                if self.host_sync and self.host_t < env.now:  # the host waits for the routing
                    self.host_t = env.now
                carry = 0.0
                lo, hi = off[p * num_l + layer], off[p * num_l + layer + 1]
                if lo < hi:  # else no routing for this (pass, layer): the layer is skipped
                    carry = self._layer(p, layer, lo, hi, env.now, ne) - env.now
            if carry > 0:
                yield env.timeout(carry)
                carry = 0.0
            if ep:
                self.row.hits = self.row.unique  # every expert is resident on its GPU
            self._end_pass(p, bytes0)
            if self.progress is not None and self.serving is not None:  # requests served
                self.progress(self.serving.finished, self.serving.n)
            elif self.progress is not None and (p + 1) % report_every == 0:
                self.progress(p + 1, n_pass)
        if self.progress is not None and self.serving is None:
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
            end = self._per_expert(look, now)
        else:
            end = self._fused(look, p, layer, now)
        if self.layer_log is not None and self._recording():
            self.layer_log.append((clock.pass_index, layer, now - ne, now, now + row.stall - st0, end))
            assert self.occupancy is not None
            self.occupancy.append((now, self.cache.used))
        return end

    def _fused(self, look: LayerLookup, p: int, layer: int, now: float) -> float:
        """``layer`` and ``on-arrival`` execution: every expert looked up under the layer's
        pins, the proposals queued, the experts run (:meth:`_compute`); then the pins are
        released and waiting proposals admitted. Returns the layer's end."""
        pinned = set(look.keys)
        runs: list[Run] = []
        lookup = look.lookup
        copies = self.copy.demand_submits
        for i in range(len(look)):
            lookup(i, pinned, now, runs)
        if self.host_on:  # the host submits the layer's demand copies
            self.host_t += (self.copy.demand_submits - copies) * self.host_copy
        if self.prefetch.active:
            self.pfq.propose(p, layer, now, self.row, pinned)
        end = self._compute(look.finish(runs), now, self.scenario.expert_compute == "on-arrival")
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
        self._t_start[p] = self.env.now
        self.cache.evicted.clear()
        self.row = PassRow()

    def _end_pass(self, p: int, bytes0: int) -> None:
        """The pass's row: its end, stall and counts (the only place they are written). The
        host waits for the pass's end (its next token needs this one)."""
        row = self.row
        if self.host_t < self.env.now:
            self.host_t = self.env.now
        self.copy.advance(self.env.now)
        self._t_end[p] = self.env.now
        self._stall[p] = row.stall
        for name, value in (("hits", row.hits), ("misses", row.misses), ("late_prefetches", row.late),
                            ("collision_misses", row.collisions), ("uncached_fetches", row.uncached),
                            ("bytes", self.copy.bytes_moved - bytes0), ("prefetches_issued", row.pf_issued),
                            ("prefetches_used", row.pf_used), ("prefetch_predicted_hits", row.pred_hits),
                            ("prefetch_predicted", row.pred_total), ("prefetch_actual", row.actual_total),
                            ("prefetches_cancelled", row.pf_cancelled), ("low_precision_experts", row.low_precision),
                            ("dropped_experts", row.dropped), ("substituted_experts", row.substituted),
                            ("tokens_altered", len(row.altered)), ("unique_computed", row.unique),
                            ("bytes_ep", row.ep_bytes)):
            self._cols[name][p] = value
        self._ep_max_load[p] = float(np.mean(row.ep_loads)) if row.ep_loads else 0.0
        if self.general:
            self._mass_total[p] = row.mass_total
            self._mass_kept[p] = row.mass_kept

    def _compute(self, runs: list[Run], now: float, on_arrival: bool) -> float:
        """``layer`` execution: the experts run once all have arrived, back to back (a fused
        kernel): end = max(arrivals) + sum(compute). ``on-arrival``: each as soon as it has
        arrived, in arrival order: t = max(t, arrival) + compute. Stall is the time the
        compute stream waits. Returns the layer's end."""
        row = self.row
        host = self.host_on
        if not on_arrival:
            ready = now
            total = 0.0
            for _, tr, f in runs:  # ready >= now: a transfer done by now cannot raise it
                if tr is not None and tr[DONE] > ready:
                    ready = tr[DONE]
                total += f
            row.stall += ready - now
            if host and runs:  # one launch for the layer's experts
                self.host_t += self.host_launch
                if self.host_t > ready:
                    ready = self.host_t
            return ready + total
        t = now
        for a, f in sorted((arrival(tr, now), f) for _, tr, f in runs):
            if host:  # one launch per expert, after the GPU has run the last (host_sync: expert)
                if self.host_sync == 2 and self.host_t < t:
                    self.host_t = t
                self.host_t += self.host_launch
            if a > t:
                row.stall += a - t
                t = a
            if host and self.host_t > t:
                t = self.host_t
            t += f
        return t

    def _per_expert(self, look: LayerLookup, now: float) -> float:
        """``per-expert`` execution (SpecMD Algorithm 1, appendix A.2: a Hugging Face-style
        loop): the layer's experts run one after another in router order. Pinned are the
        running expert and the one looked up next (transfers in flight are never evicted).
        When an expert has run its pin is released and the waiting prefetch proposals are
        admitted (:meth:`PrefetchQueue.admit`) — after the demand lookup made at that same
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
        clock = self.clock
        advance = self.copy.advance
        timing = self.scenario.timing
        blocking = self.scenario.expert_fetch == "blocking"
        row = self.row
        pfq = self.pfq
        n = len(look)
        t = now
        cur: list[Run] = []
        nxt: list[Run] = []  # the computations of the expert looked up next, if any
        looked = 0  # experts looked up so far
        host = self.host_on
        if n:
            self._host_lookup(look, 0, set(), t, cur)
            looked = 1
        launched = False  # whether expert i's launch is issued already (it started at once)
        issued = 0.0  # when the host issued expert i's launch
        for i in range(n):
            if host and not launched:
                issued = self._host_issue(cur, t, blocking)
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
                self._host_lookup(look, looked, set(pins), t, nxt)
                looked += 1
            for _, _, f in cur:
                t += f
            if timing:
                advance(t)
                clock.now = t
            clock.pending.discard(look.keys[i])  # expert i has run
            if self.decisions is not None:
                self.decisions.extend((look.at, look.layer, "run", k) for k in pins)
            if blocking:
                nxt = []
                if looked < n:
                    self._host_lookup(look, looked, set(), t, nxt)
                    looked += 1
            elif (looked == i + 2 and looked < n and all(arrival(tr, t) <= t for _, tr, _ in nxt)
                  and (not host or self._host_ready(t))):
                held = {key for key, _, _ in nxt}
                after: list[Run] = []  # expert i+1 starts now: i+2's lookup comes first
                if host:  # i+1's launch, then i+2's copies
                    issued = self._host_issue(nxt, t, False)
                    launched = True
                self._host_lookup(look, looked, set(held), t, after)
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

    def _host_lookup(self, look: LayerLookup, i: int, pins: set[int], t: float, runs: list[Run]) -> None:
        """Look up expert ``i`` at ``t``; the host submits the demand copies it leads to."""
        if not self.host_on:
            look.lookup(i, pins, t, runs)
            return
        copies = self.copy.demand_submits
        look.lookup(i, pins, t, runs)
        self.host_t += (self.copy.demand_submits - copies) * self.host_copy

    def _host_issue(self, runs: list[Run], t: float, blocking: bool) -> float:
        """``per-expert`` execution: the host launches the expert whose computations are
        ``runs``, the GPU having run the experts before it by ``t``: with ``host_sync:
        expert`` it first waits for that; with a blocking fetch, for the expert's copy. Returns
        when the launch is issued."""
        if self.host_sync == 2 and self.host_t < t:
            self.host_t = t
        if blocking:
            for _, tr, _ in runs:
                a = arrival(tr, self.host_t)
                if a > self.host_t:
                    self.host_t = a
        self.host_t += self.host_launch
        return self.host_t

    def _host_ready(self, t: float) -> bool:
        """Whether the host can launch the next expert by ``t`` (pipelined ``per-expert``: the
        expert then starts when the one before it ends)."""
        h = t if self.host_sync == 2 and self.host_t < t else self.host_t
        return h + self.host_launch <= t

    # -- expert parallelism --------------------------------------------------------------
    def _ep_nonexpert_times(self) -> list[float]:
        """Expert parallelism (G > 1 GPUs): experts stay resident on their GPU (no host
        offload, so cache, eviction, miss, prefetch and routing policies do not apply);
        attention runs data-parallel with the pass's tokens split across GPUs: each pass's
        non-expert seconds (zero in cache-only replay, where no time passes)."""
        wl, g_n = self.wl, self.scenario.hardware.gpus
        if not self.timing:
            return [0.0] * wl.num_passes
        return self.cost.nonexpert_time(np.ceil(wl.pass_tokens / g_n),
                                        np.ceil(wl.pass_context * self.attn_scale / g_n)).tolist()

    def _ep_step(self, p: int, layer: int, nonexp: float) -> float:
        """One layer under expert parallelism, from its start: the budget policy plans it as
        on one GPU (:func:`simulator.lookup.plan`; XShare Algorithm 6 balances the per-GPU
        load) and the pass's row counts it as on one GPU (:meth:`PassRow.count_tokens`);
        returns its non-expert seconds plus :meth:`_ep_layer`'s time."""
        self.clock.layer = layer
        rows = self.wl.rows(p, layer)
        t_layer = nonexp
        if rows.size:
            orig, chosen = plan(self, p, layer, rows, None)
            self.row.count_tokens(self.wl, rows, orig, [set(c) for c in chosen])
            t_layer += self._ep_layer(p, layer, chosen, nonexp)
        return t_layer

    @cached_property
    def _ep_owner(self) -> np.ndarray:
        from moesim.policies.budget.xshare import placement_of

        hw = self.scenario.hardware
        return placement_of(hw.placement, self.model.num_layers, self.model.num_experts, hw.gpus)

    def _ep_layer(self, p: int, layer: int, chosen: list[list[int]], nonexp: float) -> float:
        """One layer's time from its routing point under expert parallelism: each (token,
        expert) pair on another GPU than the token's sends the token's hidden state over the
        EP link and back (dispatch and combine all-to-all, as long as the busiest GPU's
        traffic); the layer waits for the slowest GPU's experts."""
        hw = self.scenario.hardware
        g_n = hw.gpus
        owner = self._ep_owner
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
        self.row.ep_loads.append(max(len(d) for d in per_gpu_tokens))
        self.row.ep_bytes += int(2 * sent.sum())  # dispatch, then combine back
        if not self.timing:
            return 0.0
        per_gpu_time = [float(self.cost.expert_time(np.asarray(list(d.values()))).sum()) if d else 0.0
                        for d in per_gpu_tokens]
        scale = float(self.ffn_scale[p])
        expert_t = max(per_gpu_time) * scale
        traffic = float(max(sent.max(), recv.max()))
        a2a = hw.links[hw.ep_link].copy_time(traffic) if traffic > 0 else 0.0
        t_layer = 2 * a2a + expert_t
        if self.ep_log is not None and self._recording():
            t0 = self.env.now
            t_exp = t0 + nonexp + a2a
            self.ep_log.extend((self.clock.pass_index, layer, g, t0, t0 + nonexp, t_exp, t_exp + per_gpu_time[g] * scale,
                                t0 + (nonexp + t_layer)) for g in range(g_n))
        return t_layer

    def run(self) -> Result:
        """Run the simulation to the end and derive the metrics."""
        from moesim.simulator import kernel
        from moesim.simulator.metrics import summarise

        t0 = _time.perf_counter()
        self.simpy_reason = kernel.kernel_form(self)
        # a trace file in pieces only for replays the kernel runs (simulator.stream.why_whole); serving's
        # passes on either path
        assert self.pieces is None or self.serving is not None or self.simpy_reason is None, self.simpy_reason
        if self.simpy_reason is None:
            kernel.replay(self)
        else:
            self._size_passes(self.wl)  # the SimPy path's per-pass arrays (the kernel makes its own a piece at a time)
            self.env.process(self._run())
            self.env.run()
            self.copy.finish()
        self.wall_s = _time.perf_counter() - t0
        self.rows.close()
        requests = (self.serving.frame() if self.serving is not None
                    else _requests_frame(self._request_rows))
        summary = summarise(self, self.totals, requests)
        if self.serving is not None:
            from moesim.simulator import serving

            summary.update(serving.summary(requests, self.scenario.slo, self.serving.gaps()))
            summary["arrival_notes"] = self.serving.plan.notes
            summary["max_running_seen"] = self.serving.max_running_seen
            summary["kv_capacity_tokens"] = (self.serving.kv_tokens if np.isfinite(self.serving.kv_tokens)
                                             else None)
        if self.scenario.workload.speculative is not None and self.scenario.timing and self._trace is not None:
            from dataclasses import replace

            ar = replace(self.scenario, workload=replace(self.scenario.workload, speculative=None))
            ar_rate = Simulation(ar, trace=self._trace).run().summary["tokens_per_s"]
            summary["speedup_vs_autoregressive"] = (summary["tokens_per_s"] / ar_rate) if ar_rate else None
        extra: dict[str, Any] = {}
        if self.layer_log is not None:
            extra.update(layers=self.layer_log, occupancy=self.occupancy, ep_layers=self.ep_log)
        if self.withdrawn is not None:
            extra["withdrawn"] = self.withdrawn
        if self.record_passes is not None:
            extra["recorded_passes"] = min(self.record_passes, self.wl.num_passes)
        return Result(self.scenario, self.rows, requests, summary, self.transfers, extra=extra)

    def take_rows(self) -> None:
        """Turn the per-pass arrays the SimPy path filled (the passes of ``self.wl``) into
        per-pass and per-request rows (:meth:`take_block`)."""
        self.take_block(self.wl, self._cols, self._t_start, self._t_end, self._stall,
                        (self._mass_total, self._mass_kept), self._ep_max_load)

    def take_block(self, wl: Workload, cols: Mapping[str, np.ndarray], t_start: np.ndarray, t_end: np.ndarray,
                   stall: np.ndarray, mass: tuple[np.ndarray, np.ndarray] | None = None,
                   ep_max_load: np.ndarray | None = None) -> None:
        """Turn the per-pass results of the passes of ``wl`` (the whole workload, or a block
        of a trace read in pieces: :func:`simulator.kernel.replay`) into per-pass and
        per-request rows, numbered after the blocks taken before, for the summary's totals
        and the result. ``cols``: the per-pass counts by name (``bytes_ep`` may be absent: 0
        a pass, as the kernel, which runs no expert parallelism, leaves it);
        ``mass``: the gate mass, total and computed (None: the workload's, computed whole);
        ``ep_max_load``: the mean experts per GPU (None: 0). It reads nothing else of the
        replay, so that it can run on a thread of its own while the replay goes on (the
        blocks in order)."""
        if mass is None:
            total = wl.weight_total.astype(np.float64)
            mass = total, total
        steps = _steps_columns(wl, self.model.num_layers, cols, t_start, t_end, stall, mass,
                               ep_max_load if ep_max_load is not None else np.zeros(wl.num_passes),
                               self._pass_base, self._group_base)
        self.totals.add(steps)
        self.rows.add(steps)
        if self.serving is None:
            self._request_rows.append(_requests_columns(wl, t_start, t_end, self._pass_base, self._group_base))
        self._pass_base += wl.num_passes
        self._group_base += int(wl.pass_group.max()) + 1  # a workload has a pass (no empty trace)


def _steps_columns(wl: Workload, num_l: int, cols: Mapping[str, np.ndarray], t_start: np.ndarray,
                   t_end: np.ndarray, stall: np.ndarray, mass: tuple[np.ndarray, np.ndarray],
                   ep_max_load: np.ndarray, pass_base: int, group_base: int) -> dict[str, np.ndarray]:
    """The per-pass rows' columns of the passes of ``wl``, numbered from ``pass_base`` and
    ``group_base``, ``phase`` as codes into :data:`PHASES` (arguments: :meth:`Simulation.take_block`)."""
    col = {"bytes_ep": np.zeros(wl.num_passes, np.int64), **cols}.__getitem__  # any other name: KeyError
    layers_routed = np.diff(wl.off).reshape(-1, num_l) > 0  # a workload has a pass (no empty trace)
    return {
        "pass": np.arange(pass_base, pass_base + wl.num_passes, dtype=np.int64),
        "group": wl.pass_group + group_base,
        "step": wl.pass_step,
        "phase": wl.pass_phase.astype(np.int64),
        "tokens": wl.pass_tokens,
        "generated": wl.pass_generated,
        "requests": wl.pass_requests,
        "start_s": t_start,
        "end_s": t_end,
        "duration_s": t_end - t_start,
        "stall_s": stall,
        **{k: col(k) for k in ("hits", "misses", "late_prefetches", "collision_misses", "uncached_fetches")},
        "bytes_h2d": col("bytes"),
        "bytes_ep": col("bytes_ep"),  # expert parallelism: all-to-all bytes over hardware.ep_link
        "unique_experts": col("unique_computed"),
        "layers_routed": layers_routed.sum(axis=1),
        **{k: col(k) for k in ("prefetches_issued", "prefetches_used", "prefetches_cancelled",
                               "prefetch_predicted_hits", "prefetch_predicted", "prefetch_actual",
                               "low_precision_experts", "dropped_experts", "substituted_experts")},
        "gate_weight_total": mass[0],
        "gate_weight_computed": mass[1],
        "tokens_altered": col("tokens_altered"),
        "max_experts_per_gpu": ep_max_load,
    }


def _requests_columns(wl: Workload, t_start: np.ndarray, t_end: np.ndarray, pass_base: int,
                      group_base: int) -> dict[str, np.ndarray]:
    """The per-request rows' columns of the passes of ``wl`` (numbered from ``pass_base`` and
    ``group_base``), ``first_phase`` as codes into :data:`PHASES`."""
    groups = wl.request_group
    first = wl.request_first_pass
    group_start = np.full(int(wl.pass_group.max()) + 1, np.inf)  # each group's first pass start
    np.minimum.at(group_start, wl.pass_group, t_start)
    return {
        "request": wl.request_ids,
        "group": groups + group_base,
        "first_pass": first + pass_base,
        "ttft_s": t_end[first] - group_start[groups],  # a workload has a request (no empty trace)
        "first_phase": wl.pass_phase[first].astype(np.int64),
    }


def _requests_frame(blocks: list[dict[str, np.ndarray]]) -> pd.DataFrame:
    """The per-request rows of the blocks of :meth:`Simulation._requests_columns`, in order,
    as one frame (``first_phase`` by name)."""
    cols = {k: np.concatenate([b[k] for b in blocks]) for k in blocks[0]}
    cols["first_phase"] = np.asarray(PHASES, dtype=object)[cols["first_phase"]]
    return pd.DataFrame(cols)


def _stamp(path: Path) -> tuple[int, int]:
    """A file's size and modification time (ns): what :meth:`Simulation.check_source` compares."""
    st = path.stat()
    return st.st_size, st.st_mtime_ns


def simulate(scenario: Scenario, trace: Trace | None = None, **kwargs: Any) -> Result:
    """Build a :class:`Simulation` and run it."""
    return Simulation(scenario, trace=trace, **kwargs).run()


__all__ = ["DECODE", "VERIFY", "Result", "Simulation", "simulate"]

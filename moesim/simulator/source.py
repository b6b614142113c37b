"""Where a replay's forward passes come from (``docs/design.md``, "Streaming replay";
``docs/guides/serving.md``): the workload given or the trace read whole, a trace file read a
piece at a time (:mod:`simulator.stream`), or serving's scheduler forming each pass when the
one before ends (:mod:`simulator.serving`). :class:`Source` is the collaborator a
:class:`simulator.engine.Simulation` is given: it hands over the first workload, keeps the
rest in :attr:`Source.pieces` for the replay's piece loop (the kernel's or the SimPy
process's), and reads the trace file again for the passes some policies make over it first."""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from moesim.config.scenario import Scenario
from moesim.errors import MoesimError
from moesim.simulator import served_future
from moesim.simulator.build import cache_sizing, load_trace, scenario_workload
from moesim.simulator.cost import CostModel
from moesim.simulator.workload import Workload
from moesim.traces.trace import Trace

if TYPE_CHECKING:
    from moesim.simulator.serving import Scheduler

ProgressFn = Callable[[int, int], None]


class Source:
    """A replay's passes: :meth:`first` gives the first workload; the others, when there are
    any, come from :attr:`pieces` (sent the time the previous piece ended). ``progress`` is
    the replay's progress function (None: none shown), which the first passes over a trace
    file read in pieces share with the replay."""

    def __init__(self, scenario: Scenario, progress: ProgressFn | None) -> None:
        self.scenario = scenario
        self.progress = progress
        self.trace: Trace | None = None  # the trace read whole, or the one served from
        # a trace file read a piece at a time (simulator.stream): the pieces after the first, as
        # the replay goes; the reason when it is read whole
        self.pieces: Generator[Workload, float, None] | None = None
        self.whole_reason: str | None = "a trace or workload was given"
        self.trace_rows = 0  # the file's rows, when read in pieces (progress)
        self.stream_source: tuple[Path, int] | None = None  # that file and its piece size
        self._stamp: tuple[int, int] | None = None  # its size and modification time then
        self.trace_pieces = 1  # the pieces the replay read the trace in
        # passes over that file before the replay (next uses for a policy reading the future, counts),
        # which the progress covers with the replay, and the rows of those it has shown
        self.first_passes = self.rows_shown = 0
        self._counted = False  # the policies' pass over the file has been shown
        self.serving: Scheduler | None = None  # serving under load: the scheduler forming each pass
        # serving an eviction policy that reads the future (simulator.served_future): the schedule
        # this run read as its future (None until found), how many runs found it, and this run's
        # schedule as its passes are formed
        self.reference: served_future.Reference | None = None
        self.future_runs = 0
        self.schedule: list[served_future.Pass] = []  # the passes served, as a schedule
        self._times: dict[int, int] = {}  # how many times each token was processed
        self._latest: tuple[Workload, int] | None = None  # the pass formed last and its first access
        self._scheduled_accesses = 0
        self._reader: served_future.Reader | None = None
        self._shift = 0  # this run's count of accesses less the reference's, where it stands in it
        self._future: tuple[Workload, int, np.ndarray] | None = None  # the last pass's future, as future_of gave it

    def first(self, trace: Trace | None, workload: Workload | None, decisions: bool, chunk_rows: int | None,
              prepare: Callable[[Workload], None]) -> Workload:
        """The replay's first workload: serving's first pass (with ``workload.arrivals``), the
        given ``workload``, a trace file's first piece when it can be read a piece at a time
        (``prepare`` is called with each piece as it is built), or the trace (``trace``, or
        the scenario's) whole."""
        scenario = self.scenario
        self.trace = trace
        if scenario.workload.arrivals is not None:
            return self._serve(trace)
        if workload is not None:
            return workload
        if trace is None:
            first = self._first_piece(decisions, chunk_rows, prepare)
            if first is not None:
                return first
            self.trace = load_trace(scenario)
        assert self.trace is not None
        return scenario_workload(scenario, self.trace)

    def _first_piece(self, decisions: bool, chunk_rows: int | None,
                     prepare: Callable[[Workload], None]) -> Workload | None:
        """The trace file's first piece when the replay can read it a piece at a time (its
        rows in request order and more of them than one piece holds), with the rest left to
        read in ``self.pieces``; else None (``self.whole_reason`` says why)."""
        from moesim.simulator import stream
        from moesim.simulator.build import trace_path
        from moesim.traces.io import requests_in_order, trace_rows

        sc = self.scenario
        self.whole_reason = stream.why_whole(sc, decisions)
        if self.whole_reason is not None:
            return None
        path = trace_path(sc)
        rows = trace_rows(path)
        chunk = chunk_rows if chunk_rows is not None else stream.piece_rows(path)
        if rows <= chunk:
            self.whole_reason = "the trace fits in one piece"
            return None
        self._stamp = _stamp(path)  # before the first read (the reader starts on a thread)
        pieces = stream.read_ahead(stream.pieces(sc, path, chunk), prepare)
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
        self.trace = trace
        size = cache_sizing(sc, trace.model)
        cost = CostModel(sc.hardware, trace.model, size.expert_bytes)
        dense = serving.BF16 * cost.nonexpert_weights * trace.model.num_layers
        m = trace.model
        g = sc.hardware.gpus  # expert parallelism: each GPU holds its share of the experts, or its cache
        held = size.capacity if g == 1 or sc.cache.ep_offload else m.num_layers * m.num_experts * size.expert_bytes / g
        kv = serving.kv_capacity_tokens(sc, m, held, dense)
        self.serving = serving.Scheduler(sc, plan, bank, kv, previous=stream.policy_classes(sc)[1].reads_previous_pass)
        self.pieces = self.serving.passes()
        if self.tracks_future:
            self.pieces = self._scheduled(self.pieces)
        self.whole_reason = "serving under load: one forward pass at a time"
        return next(self.pieces)

    @property
    def tracks_future(self) -> bool:
        """Whether the passes served make a schedule for an eviction policy reading the future."""
        from moesim.simulator import stream

        return self.serving is not None and bool(stream.policy_classes(self.scenario)[0].reads_future)

    def _scheduled(self, passes: Generator[Workload, float, None]) -> Generator[Workload, float, None]:
        """The scheduler's passes, each added to the run's schedule as it is formed."""
        wl = next(passes)
        while True:
            self._latest = (wl, self._scheduled_accesses)
            self.schedule.append(served_future.Pass(wl, self._times))
            self._scheduled_accesses += len(self.schedule[-1].keys)
            now = yield wl
            try:
                wl = passes.send(now)
            except StopIteration:
                return

    def future_report(self) -> dict[str, object]:
        """The summary's account of the future an eviction policy read under load
        (:mod:`simulator.served_future`): the runs before this one that found it, and whether
        this run's passes are the schedule it read (its future was its own)."""
        if not self.tracks_future or self.reference is None:
            return {}
        exact = self.reference.same(self.schedule)
        out: dict[str, object] = {"future_runs": self.future_runs, "future_exact": exact}
        if not exact:
            out["future_note"] = (f"no run in {self.future_runs + 1} made the schedule it read: this one read the "
                                  "last run's passes as its future, not its own, so its eviction decisions are "
                                  "not the optimum's")
        return out

    def future_of(self, wl: Workload, num_prec: int, default_prec: int, num_keys: int) -> tuple[int, np.ndarray]:
        """The future the pass ``wl`` (the one formed last) reads, as a piece's ``after`` for a
        policy reading the future (``EvictionPolicy.reads_future``): its first access over the
        run, and each cache key's next access after the pass (-1: none), from the reference
        schedule (:class:`simulator.served_future.Reference`; none: nothing after the pass), as
        its position there moved by where the run stands in it (the end of the reference's pass
        that processed the latest of this pass's tokens is this pass's end), at least the pass's
        end: once the run serves the reference, each key's next access over the run. Asked for
        the passes in order; asked again for the same pass (each GPU's policy, under expert
        parallelism), the answer given first."""
        assert self._latest is not None, "a pass formed"
        latest, first = self._latest
        assert latest is wl, "the pass formed last"
        if self._future is not None and self._future[0] is wl:
            return self._future[1], self._future[2]
        later = np.full(num_keys, -1, np.int64)
        if self.reference is not None:
            if self._reader is None:
                self._reader = self.reference.reader()
            this = self.schedule[-1]
            end = first + len(this.keys)
            after, stand = self._reader.after(this.tokens)
            if stand is not None:  # the reference's count of accesses, moved to stand at this pass's end
                self._shift = end - stand
            seen = np.flatnonzero(after >= 0)
            later[seen * num_prec + default_prec] = np.maximum(after[seen] + self._shift, end)
        self._future = (wl, first, later)
        return first, later

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
        if _stamp(path) != self._stamp:
            raise MoesimError(f"trace {path}: the file changed while it was replayed a piece at a time (its size "
                              "or modification time is not what it was when the replay began), so the results "
                              "would mix two files' data. Replay it again once nothing writes it.")

    def read_again(self) -> Iterator[Workload]:
        """:meth:`pieces_again` for a policy that counts over the whole trace before the replay
        (``PolicyContext.trace_pieces``): its first read is shown as a first pass."""
        shown = None if self._counted else self.first_pass_progress()
        self._counted = True
        return self.pieces_again(shown)

    def piece_futures(self, num_prec: int, default_prec: int,
                      num_keys: int) -> Callable[[Workload, int], tuple[int, np.ndarray]]:
        """For an eviction policy that reads the future, a piece at a time: what gives piece
        ``k`` (``wl``) its ``after`` (its first access over the replay and every cache key's
        first access after it, -1 for none; ``KernelForm.piece``). Serving: the pass's future in
        the schedule the run reads (:meth:`future_of`). A trace file: a first pass over it now,
        shown in the progress (:func:`simulator.stream.accesses_after`), each piece checked
        against what it read there (the file may have changed since)."""
        if self.serving is not None:
            return lambda wl, k: self.future_of(wl, num_prec, default_prec, num_keys)
        from moesim.simulator import stream

        firsts, afters = stream.accesses_after(self.pieces_again(self.first_pass_progress()), num_prec, default_prec,
                                               num_keys)
        assert self.stream_source is not None, "a trace read in pieces"
        path = self.stream_source[0]

        def after(wl: Workload, k: int) -> tuple[int, np.ndarray]:
            if k + 1 >= len(firsts) or int(firsts[k + 1] - firsts[k]) != len(wl.acc_layer):
                raise MoesimError(f"trace {path}: the file changed while it was replayed (piece {k + 1} "
                                  "has other accesses than its first pass read). Replay it again once nothing writes it.")
            return int(firsts[k]), afters[k]

        return after


def _stamp(path: Path) -> tuple[int, int]:
    """A file's size and modification time (ns): what :meth:`Source.check_source` compares."""
    st = path.stat()
    return st.st_size, st.st_mtime_ns

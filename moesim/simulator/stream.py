"""Replaying a trace file a piece at a time (``docs/design.md``, "Streaming replay").

A trace file whose rows come request by request is read in pieces of whole batches of
requests (:func:`traces.io.iter_trace`, about :data:`CHUNK_ROWS` rows each), each piece made
into its own :class:`Workload` and replayed by the compiled kernel with the state carried from
the previous piece: the cache, the copy engine, the prefetch queue and the clocks. Peak memory
is then set by the piece and the cache, not by the trace. The per-pass rows are handed over
:data:`simulator.kernel.BLOCK_PASSES` passes at a time, on a thread of their own while the kernel goes
on, and, from the second block on, written to a temporary
Parquet file (:class:`output.results.PassRows`); the summary keeps its whole-number totals
and the exact sums of the few floating-point columns it adds up
(:class:`simulator.metrics.PassTotals`: memory that does not grow with the passes), and the
per-request rows stay in memory. Results are the whole-trace replay's,
bit for bit (``tests/test_stream.py``).

What a replay needs decides whether it can go a piece at a time (:func:`why_whole`): the
kernel path, a piece never straddling a batch, and policies that look no further than the
current forward pass, or, for a policy that reads the future, that read each key's next use from a first pass over
the file (:func:`accesses_after`: each piece's first access and every key's first access after
the piece, one whole number per key and piece), or, for static pinning, that count the
experts of the first share of all passes from a first pass (``PolicyContext.whole_trace``).
The whole trace is replayed at once by miss
policies that re-route tokens (their per-token arrays are sized by the largest layer of the
trace), speculative decoding (its acceptance draws run over all requests), synthesised and
imported traces (made whole in memory), and files whose rows are not in request order.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Callable, Generator, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from moesim.config.scenario import Scenario
from moesim.errors import MoesimError
from moesim.simulator.workload import Workload, build_workload

# trace rows per piece (~8 MB of trace, ~100 MB of workload and replay arrays at top-8): the peak
# memory of a replay in pieces grows with the piece, its time barely
CHUNK_ROWS = 1 << 17

# pieces read and built ahead of the one being replayed (read_ahead): up to READ_AHEAD + 1 in
# memory. Reading ahead lets quick pieces make up for slow ones; beyond three, a replay gained
# little and took more memory.
READ_AHEAD = 3

def piece_rows(path: Path | None = None) -> int:
    """Trace rows per piece: ``MOESIM_PIECE_ROWS`` when set (a positive whole number; less
    memory with smaller pieces, the same results), else :data:`CHUNK_ROWS` for a file of the
    required columns, and proportionally fewer for the file at ``path`` when it also carries
    per-expert columns (``pred_next``: 64 floats a row at OLMoE's shape, a 3.7x wider row), so
    that a piece holds about as many bytes either way (with ``pred_next`` the
    25.6 M-access benchmark peaked at 1.25 GB in pieces of the plain row count)."""
    raw = os.environ.get("MOESIM_PIECE_ROWS", "").strip()
    if not raw:
        return CHUNK_ROWS if path is None else _rows_of_plain_bytes(path)
    try:
        rows = int(raw)
    except ValueError:
        rows = 0
    if rows < 1:
        raise MoesimError(f"environment variable MOESIM_PIECE_ROWS is {raw!r}: it must be a positive whole "
                          f"number of trace rows per piece (default {CHUNK_ROWS}). Set it to one, or unset it.")
    return rows


def _rows_of_plain_bytes(path: Path) -> int:
    """The rows of the file at ``path`` that take the bytes of :data:`CHUNK_ROWS` rows of the
    required columns in memory as read: a row is request, step and position (int32), phase,
    layer (int16), top-k expert ids (int16) and weights (float32), and one float32 per expert
    for each per-expert column the file has."""
    from moesim.traces.io import trace_layout
    from moesim.traces.schema import PER_EXPERT_COLUMNS

    model, columns = trace_layout(path)
    plain = 12 + 1 + 2 + 6 * model.top_k
    wide = 4 * model.num_experts * sum(c in columns for c in PER_EXPERT_COLUMNS)
    return max(1, CHUNK_ROWS * plain // (plain + wide))


def policy_classes(scenario: Scenario) -> tuple[Any, ...]:
    """The scenario's eviction, prefetch, miss, routing and budget policy classes."""
    from moesim.policies import families

    pol, fam = scenario.policies, families()
    return tuple(fam[f].get(getattr(pol, f).name) for f in ("eviction", "prefetch", "miss", "routing", "budget"))


def _piecewise(scenario: Scenario) -> tuple[str, str] | None:
    """What keeps the scenario's policies from replaying a piece at a time, as (family, name),
    or None. Capability flags decide (each policy's class declares them): an eviction policy the
    kernel runs (whose compiled form reads no more than the current pass; ``reads_future``
    policies get their next uses from a first pass), a prefetcher the kernel runs that is
    ``piecewise`` or ``counts_whole_trace``, a miss policy the kernel runs (each piece's tokens
    are its own), routing that does not change or that the kernel runs without a budget policy
    (its state carried from piece to piece), and a budget policy that does not calibrate on
    the trace's leading passes (each (pass, layer)'s choice reads only its own rows)."""
    from moesim.simulator.kernel import eviction_form, miss_form, prefetch_form, routing_form

    ev, pf, miss, routing, budget = policy_classes(scenario)
    pol = scenario.policies
    if eviction_form(ev) is None:
        return "eviction", pol.eviction.name
    if prefetch_form(pf) is not None or not (pf.piecewise or pf.counts_whole_trace):
        return "prefetch", pol.prefetch.name
    if miss_form(miss) is None:
        return "miss", pol.miss.name
    if routing.changes_routing and (routing_form(routing) is None or budget.restricts):
        return "routing", pol.routing.name
    if budget.restricts and budget.calibrates(pol.budget.params):
        return "budget", pol.budget.name
    return None


def why_whole(scenario: Scenario, decisions: bool) -> str | None:
    """Why ``scenario`` replays its whole trace at once (None: it can go a piece at a time).
    ``decisions``: the replay records its decisions (the SimPy path)."""
    from moesim.simulator.kernel import kernel_off

    src = scenario.workload.trace
    if src.path is None:
        return "the trace is synthesised or imported in memory"
    if decisions:
        return "the replay records its decisions"
    if kernel_off() is not None:
        return "the replay runs on the SimPy path"
    if scenario.hardware.gpus > 1:
        return "expert parallelism"
    if scenario.workload.speculative is not None:
        return "speculative decoding"
    blocked = _piecewise(scenario)
    if blocked is None:
        return None
    family, name = blocked
    if family == "eviction":
        return f"eviction policy '{name}' reads the whole trace"
    if family == "prefetch":
        return f"prefetch policy '{name}' reads the whole trace"
    if family == "miss":
        return f"miss policy '{name}' has no compiled form"
    if family == "routing":
        return f"routing policy '{name}' runs on the SimPy path"
    return f"budget policy '{name}' calibrates on the trace's leading passes"


def first_passes(scenario: Scenario) -> int:
    """How many times a replay of ``scenario`` a piece at a time reads the whole trace file
    before it replays it (its progress covers them): once for the next uses of a policy that reads the future
    (:func:`accesses_after`), once for static pinning's counts."""
    ev, pf, *_ = policy_classes(scenario)
    return int(ev.reads_future) + int(pf.counts_whole_trace)


def _served_prefetch() -> list[str]:
    """The registered prefetch policies that serving can run, by their capability flags."""
    from moesim.policies import families

    return [n for n, c in families()["prefetch"].items() if c.piecewise and not c.counts_whole_trace]


def why_not_served(scenario: Scenario) -> str | None:
    """What keeps ``scenario`` from serving under load, said as the rest of a sentence
    ("... one forward pass at a time, which <reason>"); None when it can be served. Serving
    replays one forward pass at a time, each formed when the one before ends: on the compiled
    kernel's piece loop when it has a form for every policy, else on the SimPy path's
    (:meth:`simulator.engine.Simulation._run`), so what it refuses is what a pass at a time
    cannot know: counts over the whole trace or its leading passes (a timeline is recorded on
    the SimPy path). A prefetcher that reads the pass before reads each request's own last pass
    (``Workload.previous``); an eviction policy that reads the future reads the schedule of the
    run's passes, found as a fixed point (:mod:`simulator.served_future`)."""
    if not scenario.timing:
        return "needs time to pass (timing: true): arrivals and latencies are times"
    _, pf, _, _, budget = policy_classes(scenario)
    pol = scenario.policies
    if pf.counts_whole_trace or not pf.piecewise:
        return (f"cannot run prefetch policy '{pol.prefetch.name}' (it reads the whole trace, and each pass is "
                f"formed anew); use one of {', '.join(_served_prefetch())}")
    if budget.calibrates(pol.budget.params):
        return (f"cannot run budget '{pol.budget.name}' as configured (it calibrates on the trace's leading "
                "passes, which the scheduler forms as it goes); use a budget, or a ranking, that reads each pass alone")
    return None


def pieces(scenario: Scenario, path: Path, chunk_rows: int = CHUNK_ROWS) -> Iterator[Workload]:
    """The workloads of the trace file's pieces, in order (whole batches of requests, at most
    ``workload.max_requests`` requests in all). Each is numbered from 0 (its passes, groups
    and accesses); :func:`simulator.workload.join` numbers them as one."""
    from moesim.traces.io import iter_trace

    w = scenario.workload
    for piece in iter_trace(path, chunk_rows, w.batch_size, w.max_requests):
        yield build_workload(piece, w.batch_size)  # no request limit (the reader's), no speculation


def accesses_after(workloads: Iterable[Workload], num_prec: int, default_prec: int,
                   num_keys: int) -> tuple[np.ndarray, np.ndarray]:
    """For an eviction policy that reads the future (``reads_future``) a piece at a time: one
    pass over the trace file's pieces (``workloads``,
    cut as the replay cuts them: :meth:`simulator.source.Source.pieces_again`) before the
    replay. Returns
    ``firsts`` (per piece its first access, counted over the whole trace, then the number of
    accesses: ``pieces + 1`` entries) and ``after`` (pieces x cache keys: the key's first access
    after the piece, -1 when it has none), so that a piece's next uses are its own positions or
    ``after``. Memory: one piece, and 8 bytes per key and piece (1,024 keys at OLMoE's shape: 8 KB
    a piece of ~1,000,000 accesses)."""
    firsts = [0]
    heads: list[np.ndarray] = []  # per piece, each key's first access in it (-1: none)
    for wl in workloads:
        keys = wl.cache_keys(num_prec, default_prec)
        head = np.full(num_keys, -1, np.int64)
        present, first = np.unique(keys, return_index=True)
        head[present] = first + firsts[-1]
        heads.append(head)
        firsts.append(firsts[-1] + len(keys))
    after = np.full((len(heads), num_keys), -1, np.int64)
    later = np.full(num_keys, -1, np.int64)  # each key's first access in the pieces after
    for k in range(len(heads) - 1, -1, -1):
        after[k] = later
        seen = heads[k] >= 0
        later[seen] = heads[k][seen]
    return np.asarray(firsts, np.int64), after


def read_ahead(pieces: Iterator[Workload], prepare: Callable[[Workload], None] | None = None,
               depth: int = READ_AHEAD) -> Generator[Workload, float, None]:
    """``pieces``, each read and built on a second thread while the caller replays an earlier
    one (the compiled loops release the GIL, and so does the Parquet reader), up to ``depth``
    pieces ahead of the one the caller holds: ``depth + 1`` pieces in memory at most. With one
    piece ahead the reading thread stops whenever it is done before the replay, and the replay
    waits whenever the next piece takes longer to read than this one to replay; a few pieces
    ahead, the quick pieces make up for the slow ones (:data:`READ_AHEAD`). ``prepare`` is
    called on that thread with each piece once built (the
    prefetcher's proposals for it, :meth:`simulator.engine.Simulation.prepare_piece`), so that
    the replay's work beside the kernel runs on one thread, not two (on two cores, a thread of
    their own made replays slower).
    An error reading or preparing a piece is raised where that piece is asked for; pieces
    queued when the caller stops early are never read."""

    def made() -> Workload | None:
        wl = next(pieces, None)
        if wl is not None and prepare is not None:
            prepare(wl)
        return wl

    with ThreadPoolExecutor(1) as pool:
        ahead = collections.deque(pool.submit(made) for _ in range(depth))
        try:
            while True:
                wl = ahead.popleft().result()
                if wl is None:
                    return
                ahead.append(pool.submit(made))
                yield wl
        finally:
            for queued in ahead:
                queued.cancel()  # the one being read finishes; the rest never start

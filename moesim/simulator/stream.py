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
current forward pass, or, for Belady, that read each key's next use from a first pass over
the file (:func:`belady_after`: each piece's first access and every key's first access after
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

import numpy as np

from moesim.config.scenario import Scenario
from moesim.errors import MoesimError
from moesim.simulator.workload import Workload, build_workload

# trace rows per piece (~8 MB of trace, ~100 MB of workload and replay arrays at top-8). Issue 34,
# the 25.6 M-access benchmark trace, three runs each, while the compiled loops still kept 16
# pieces' arrays (moesim.jit._KEEP_BYTES; since then 708 and 582-601 MB at the first two sizes):
# LRU peaked at 1,070-1,107 MB in pieces of 262,144 rows, 851-871 MB in pieces of 131,072,
# 643-658 MB of 65,536 (times 3.25-3.73, 2.85-3.62, 2.95-3.18 s); least-stale + score-percentile
# (pieces of a quarter of those rows) 803-857, 680-690 and 553-568 MB (9.18-9.64, 10.00-10.48,
# 9.63-10.23 s)
CHUNK_ROWS = 1 << 17

# pieces read and built ahead of the one being replayed (read_ahead): up to READ_AHEAD + 1 in
# memory. Issue 34, 2026-11-28, whole `moesim run --trace FILE` processes on the 25.6 M-access
# benchmark files, three interleaved rounds: least-stale + score-percentile took 8.68, 6.91 and
# 6.72 s one piece ahead, 7.00, 6.05 and 6.04 s two ahead, 6.40, 5.63 and 5.94 s three ahead
# (peak RSS 607-628, 643-656, 634-672 MiB); LRU 3.27, 2.97 and 3.47 s one ahead, 2.89, 2.63 and
# 2.85 s three ahead (551-566, 639-669 MiB). Five ahead, two more rounds against three:
# least-stale + score-percentile 5.72-5.73 against 5.92-6.34 s, LRU 2.65-2.97 against
# 2.62-2.67 s, 21-75 MiB more.
READ_AHEAD = 3

# prefetchers whose proposals at (pass, layer) read that pass (or the one before it in its
# batch, which a piece always holds) and nothing later; eviction policies without a view of
# the future
_PIECEWISE_PREFETCH = ("none", "oracle", "previous-token", "lookahead", "next-gate-topk", "score-percentile")
# the built-ins (a user's compiled hook policy goes a piece at a time too: _compiled_hooks)
_PIECEWISE_EVICTION = ("lru", "fifo", "lfu", "fld", "score", "least-stale", "lhu")
# eviction policies that read the future: each piece gets every key's first access after it
# from a first pass over the file (belady_after; not served: a served pass's future depends on
# the replay's own timing)
_FUTURE_EVICTION = ("belady",)
# prefetchers that count over the whole trace before the replay: static pinning's first share of
# the passes, from a first pass over the file (``PolicyContext.whole_trace``)
_COUNTING_PREFETCH = ("static-pin",)


def piece_rows(path: Path | None = None) -> int:
    """Trace rows per piece: ``MOESIM_PIECE_ROWS`` when set (a positive whole number; less
    memory with smaller pieces, the same results), else :data:`CHUNK_ROWS` for a file of the
    required columns, and proportionally fewer for the file at ``path`` when it also carries
    per-expert columns (``pred_next``: 64 floats a row at OLMoE's shape, a 3.7x wider row), so
    that a piece holds about as many bytes either way (issue 34: with ``pred_next`` the
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


def _compiled_hooks(name: str) -> bool:
    """Whether eviction policy ``name`` is written as hooks that numba compiles: the kernel
    replays it, and it reads no trace of its own (its hooks are handed each access's weight),
    so it goes a piece at a time."""
    from moesim.policies.eviction import REGISTRY
    from moesim.simulator.kernel import EV_HOOK, eviction_code

    return eviction_code(REGISTRY.get(name)) == EV_HOOK


def why_whole(scenario: Scenario, recording: bool) -> str | None:
    """Why ``scenario`` replays its whole trace at once (None: it can go a piece at a time).
    ``recording``: the replay records a timeline or its decisions (the SimPy path)."""
    from moesim.simulator.kernel import kernel_off

    src = scenario.workload.trace
    if src.path is None:
        return "the trace is synthesised or imported in memory"
    if recording:
        return "the replay records its timeline or decisions"
    if kernel_off() is not None:
        return "the replay runs on the SimPy path"
    if scenario.hardware.gpus > 1:
        return "expert parallelism"
    if scenario.workload.speculative is not None:
        return "speculative decoding"
    pol = scenario.policies
    if (pol.eviction.name not in _PIECEWISE_EVICTION + _FUTURE_EVICTION
            and not _compiled_hooks(pol.eviction.name)):
        return f"eviction policy '{pol.eviction.name}' reads the whole trace"
    if pol.prefetch.name not in _PIECEWISE_PREFETCH + _COUNTING_PREFETCH:
        return f"prefetch policy '{pol.prefetch.name}' reads the whole trace"
    if pol.miss.name != "fetch":
        return f"miss policy '{pol.miss.name}' re-routes tokens"
    if pol.routing.name != "standard" or pol.budget.name != "none":
        return "a routing or budget policy"
    return None


def first_passes(scenario: Scenario) -> int:
    """How many times a replay of ``scenario`` a piece at a time reads the whole trace file
    before it replays it (its progress covers them): once for Belady's next uses
    (:func:`belady_after`), once for static pinning's counts."""
    pol = scenario.policies
    return int(pol.eviction.name in _FUTURE_EVICTION) + int(pol.prefetch.name in _COUNTING_PREFETCH)


# serving forms each pass from the requests present: a pass is a piece of its own, so a
# prefetcher reading the pass before (previous-token, lookahead) has none to read
_SERVED_PREFETCH = ("none", "oracle", "next-gate-topk", "score-percentile")


def why_not_served(scenario: Scenario, recording: bool) -> str | None:
    """What keeps ``scenario`` from serving under load, said as the rest of a sentence
    ("... on the compiled kernel, which <reason>"); None when it can be served. Serving
    replays one forward pass at a time, each formed when the one before ends, so it needs the
    kernel's piece loop and the policies that a piece at a time allows (:func:`why_whole`),
    less the prefetchers that read the pass before."""
    from moesim.simulator.kernel import kernel_off

    if not scenario.timing:
        return "needs time to pass (timing: true): arrivals and latencies are times"
    if recording:
        return "cannot record a timeline or decisions (leave out --events)"
    off = kernel_off()
    if off is not None:
        return f"is off here ({off})"
    if scenario.hardware.gpus > 1:
        return "models one GPU (set hardware.gpus: 1)"
    pol = scenario.policies
    if pol.eviction.name not in _PIECEWISE_EVICTION and not _compiled_hooks(pol.eviction.name):
        return (f"cannot run eviction policy '{pol.eviction.name}' (it reads the whole trace, or its hooks do "
                f"not compile); use one of {', '.join(_PIECEWISE_EVICTION)} or a hook policy numba compiles")
    if pol.prefetch.name not in _SERVED_PREFETCH:
        return (f"cannot run prefetch policy '{pol.prefetch.name}' (it reads the pass before, and each pass "
                f"is formed anew); use one of {', '.join(_SERVED_PREFETCH)}")
    if pol.miss.name != "fetch":
        return f"runs miss policy 'fetch' only (not '{pol.miss.name}', which re-routes tokens)"
    if pol.routing.name != "standard" or pol.budget.name != "none":
        return "runs routing 'standard' and budget 'none' only"
    return None


def pieces(scenario: Scenario, path: Path, chunk_rows: int = CHUNK_ROWS) -> Iterator[Workload]:
    """The workloads of the trace file's pieces, in order (whole batches of requests, at most
    ``workload.max_requests`` requests in all). Each is numbered from 0 (its passes, groups
    and accesses); :func:`simulator.workload.join` numbers them as one."""
    from moesim.traces.io import iter_trace

    w = scenario.workload
    for piece in iter_trace(path, chunk_rows, w.batch_size, w.max_requests):
        yield build_workload(piece, w.batch_size)  # no request limit (the reader's), no speculation


def belady_after(workloads: Iterable[Workload], num_prec: int, default_prec: int,
                 num_keys: int) -> tuple[np.ndarray, np.ndarray]:
    """Belady a piece at a time (issue 34): one pass over the trace file's pieces (``workloads``,
    cut as the replay cuts them: :meth:`simulator.engine.Simulation.pieces_again`) before the
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
    the replay's work beside the kernel runs on one thread, not two (issue 34: least-stale +
    score-percentile on the 25.6 M-access benchmark trace, five interleaved rounds of whole
    processes on two cores: 9.36 s median with the proposals made here, 10.12 s on a thread of
    their own).
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

"""A replay's rows, taken a block of passes at a time (``docs/concepts/metrics.md``):
:class:`PassBlocks` turns the per-pass results of each block — the whole workload, a block
of a trace read in pieces, or a served pass — into per-pass rows (on disk from the second
block on, :class:`output.results.PassRows`), the summary's totals
(:class:`simulator.metrics.PassTotals`) and per-request rows, numbered on from block to
block. Both replay paths hand their blocks to it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

from moesim.output.results import PassRows
from moesim.simulator.metrics import PassTotals
from moesim.simulator.workload import Workload
from moesim.traces.schema import PHASES


class PassArrays:
    """The per-pass arrays the SimPy path fills for the passes of ``wl``: the counts by name,
    the start and end times, the stall, the mean experts per GPU and the gate mass (the
    workload's until a policy changes it); :meth:`write` fills a pass from its
    :class:`simulator.lookup.PassRow` (the only place they are written)."""

    COUNTS = ("hits", "misses", "late_prefetches", "collision_misses", "uncached_fetches", "bytes", "bytes_ep",
              "prefetches_issued", "prefetches_used", "prefetch_predicted_hits", "prefetch_predicted",
              "prefetch_actual", "low_precision_experts", "dropped_experts", "substituted_experts",
              "tokens_altered", "prefetches_cancelled", "unique_computed")

    def __init__(self, wl: Workload) -> None:
        n = wl.num_passes
        self.wl = wl
        self.cols = {name: np.zeros(n, dtype=np.int64) for name in self.COUNTS}
        self.t_start, self.t_end, self.stall = np.zeros(n), np.zeros(n), np.zeros(n)
        self.ep_max_load = np.zeros(n)
        self.mass_total = wl.weight_total.astype(np.float64).copy()
        self.mass_kept = wl.weight_total.astype(np.float64).copy()

    def write(self, p: int, row: Any, end: float, nbytes: int, mass: bool) -> None:
        """Pass ``p`` ended at ``end`` having copied ``nbytes``, its counts in ``row``; with
        ``mass`` (a policy may change what tokens compute) its gate mass too."""
        self.t_end[p] = end
        self.stall[p] = row.stall
        for name, value in (("hits", row.hits), ("misses", row.misses), ("late_prefetches", row.late),
                            ("collision_misses", row.collisions), ("uncached_fetches", row.uncached),
                            ("bytes", nbytes), ("prefetches_issued", row.pf_issued),
                            ("prefetches_used", row.pf_used), ("prefetch_predicted_hits", row.pred_hits),
                            ("prefetch_predicted", row.pred_total), ("prefetch_actual", row.actual_total),
                            ("prefetches_cancelled", row.pf_cancelled), ("low_precision_experts", row.low_precision),
                            ("dropped_experts", row.dropped), ("substituted_experts", row.substituted),
                            ("tokens_altered", len(row.altered)), ("unique_computed", row.unique),
                            ("bytes_ep", row.ep_bytes)):
            self.cols[name][p] = value
        self.ep_max_load[p] = float(np.mean(row.ep_loads)) if row.ep_loads else 0.0
        if mass:
            self.mass_total[p] = row.mass_total
            self.mass_kept[p] = row.mass_kept

    def hand_to(self, blocks: PassBlocks) -> None:
        """The filled arrays, as per-pass and per-request rows (:meth:`PassBlocks.take`)."""
        blocks.take(self.wl, self.cols, self.t_start, self.t_end, self.stall, (self.mass_total, self.mass_kept),
                    self.ep_max_load)


class PassBlocks:
    """The blocks taken so far: ``totals`` (the summary's), ``rows`` (the per-pass rows; only
    the totals when ``keep_rows`` is False) and, with ``per_request`` (False when serving's
    scheduler keeps the per-request rows), the per-request columns of each block."""

    def __init__(self, num_layers: int, keep_rows: bool, per_request: bool) -> None:
        self.num_layers = num_layers
        self.per_request = per_request
        self.totals = PassTotals()
        self.rows = PassRows(keep_rows)
        self._requests: list[dict[str, np.ndarray]] = []  # per block, the per-request columns
        self._pass_base = self._group_base = 0  # the passes and batches (groups) of the blocks taken

    def take(self, wl: Workload, cols: Mapping[str, np.ndarray], t_start: np.ndarray, t_end: np.ndarray,
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
        steps = _steps_columns(wl, self.num_layers, cols, t_start, t_end, stall, mass,
                               ep_max_load if ep_max_load is not None else np.zeros(wl.num_passes),
                               self._pass_base, self._group_base)
        self.totals.add(steps)
        self.rows.add(steps)
        if self.per_request:
            self._requests.append(_requests_columns(wl, t_start, t_end, self._pass_base, self._group_base))
        self._pass_base += wl.num_passes
        self._group_base += int(wl.pass_group.max()) + 1  # a workload has a pass (no empty trace)

    def requests_frame(self) -> pd.DataFrame:
        """The per-request rows of the blocks taken, in order, as one frame."""
        return _requests_frame(self._requests)


def _steps_columns(wl: Workload, num_l: int, cols: Mapping[str, np.ndarray], t_start: np.ndarray,
                   t_end: np.ndarray, stall: np.ndarray, mass: tuple[np.ndarray, np.ndarray],
                   ep_max_load: np.ndarray, pass_base: int, group_base: int) -> dict[str, np.ndarray]:
    """The per-pass rows' columns of the passes of ``wl``, numbered from ``pass_base`` and
    ``group_base``, ``phase`` as codes into :data:`PHASES` (arguments: :meth:`PassBlocks.take`)."""
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
    """The per-request rows of the blocks of :func:`_requests_columns`, in order,
    as one frame (``first_phase`` by name)."""
    cols = {k: np.concatenate([b[k] for b in blocks]) for k in blocks[0]}
    cols["first_phase"] = np.asarray(PHASES, dtype=object)[cols["first_phase"]]
    return pd.DataFrame(cols)

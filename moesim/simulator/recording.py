"""A replay's timeline (``moesim run --events``; ``docs/guides/sweeps.md``, "A replay's
timeline"): :class:`Recorder` is the observer both replay paths report to, for the passes
before ``passes`` (all when None), numbered over the whole replay (``Clock.pass_index``). On
the SimPy path (:class:`simulator.engine.Simulation`) it listens to the copy engine (completed
transfers) and the prefetch queue (withdrawn prefetches) and is told each layer's times; the
compiled kernel writes the same records, in the same order, into its log
(:func:`moesim.kernel_state._record`), which :meth:`Recorder.take` reads after each kernel
call."""

from __future__ import annotations

from typing import Any

import numpy as np

from moesim.kernel_state import (
    LOG_DEMAND,
    LOG_LAYER,
    LOG_PREFETCH,
    LOG_PROMOTED,
    LOG_TRANSFER,
    LOG_WITHDRAWN,
)
from moesim.policies.registry import Clock
from moesim.simulator.copyengine import (
    DEMAND,
    DONE,
    ISSUED,
    KEY,
    NBYTES,
    PRIORITY,
    PROMOTED,
    START,
    Transfer,
)

_KINDS = {LOG_DEMAND: "demand", LOG_PREFETCH: "prefetch", LOG_PROMOTED: "promoted"}


class Recorder:
    """The timeline: ``transfers`` (key, kind: demand | prefetch | promoted, issued, start,
    done, bytes) and ``withdrawn`` prefetches (key, issued, withdrawn at, bytes) when
    ``transfers`` is asked for; per layer (pass, layer, non-expert start, routing point,
    experts start, layer end) in ``layers``, the cache's bytes at each routing point in
    ``occupancy`` and, under expert parallelism, per GPU (pass, layer, gpu, start, dispatch
    start, experts start, experts end, layer end) in ``ep`` when ``layers`` is asked for."""

    def __init__(self, clock: Clock, transfers: bool, layers: bool, passes: int | None) -> None:
        self.clock = clock
        self.passes = passes
        self.transfers: list[tuple[int, str, float, float, float, int]] | None = [] if transfers else None
        self.withdrawn: list[tuple[int, float, float, int]] | None = [] if transfers else None
        self.layers: list[tuple[int, int, float, float, float, float]] | None = [] if layers else None
        self.occupancy: list[tuple[float, int]] | None = [] if layers else None
        self.ep: list[tuple[int, int, int, float, float, float, float, float]] | None = [] if layers else None

    @property
    def active(self) -> bool:
        """Whether anything is recorded."""
        return self.transfers is not None or self.layers is not None

    def now(self) -> bool:
        """Whether the pass being replayed is inside the timeline's window."""
        return self.passes is None or self.clock.pass_index < self.passes

    def on_transfers(self, trs: list[Transfer]) -> None:
        """The copy engine's listener: completed transfers, into the timeline."""
        if self.transfers is None or not self.now():
            return
        for tr in trs:
            kind = "promoted" if tr[PROMOTED] else ("demand" if tr[PRIORITY] == DEMAND else "prefetch")
            self.transfers.append((tr[KEY], kind, tr[ISSUED], tr[START], tr[DONE], tr[NBYTES]))

    def on_withdrawn(self, gone: list[Transfer]) -> None:
        """The prefetch queue's listener: withdrawn prefetches, into the timeline."""
        if self.withdrawn is not None and self.now():
            self.withdrawn.extend((tr[KEY], tr[ISSUED], self.clock.now, tr[NBYTES]) for tr in gone)

    def layer(self, layer: int, start: float, route: float, experts: float, end: float, used: int) -> None:
        """A layer's times (non-expert start, routing point, experts start, end) and the
        cache's bytes at its routing point."""
        if self.layers is not None and self.now():
            assert self.occupancy is not None
            self.layers.append((self.clock.pass_index, layer, start, route, experts, end))
            self.occupancy.append((route, used))

    def take(self, log: np.ndarray) -> None:
        """The kernel's records (rows of :data:`moesim.kernel_state.LOG_WIDTH`: a tag, then
        its fields), into the timeline as the listeners above would have put them."""
        for tag, a, b, c, d, e, f, g in log.tolist():
            if tag == LOG_TRANSFER and self.transfers is not None:
                self.transfers.append((int(a), _KINDS[int(b)], c, d, e, int(f)))
            elif tag == LOG_WITHDRAWN and self.withdrawn is not None:
                self.withdrawn.append((int(a), b, c, int(d)))
            elif tag == LOG_LAYER and self.layers is not None:
                assert self.occupancy is not None
                self.layers.append((int(a), int(b), c, d, e, f))
                self.occupancy.append((d, int(g)))

    def extra(self, num_passes: int) -> dict[str, Any]:
        """What the result carries of the timeline (``Result.extra``) for a replay of
        ``num_passes`` passes."""
        out: dict[str, Any] = {}
        if self.layers is not None:
            out.update(layers=self.layers, occupancy=self.occupancy, ep_layers=self.ep)
        if self.withdrawn is not None:
            out["withdrawn"] = self.withdrawn
        if self.passes is not None:
            out["recorded_passes"] = min(self.passes, num_passes)
        return out

"""Static pinning: the most used experts loaded before the replay and never evicted."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from moesim.policies.prefetch.base import (
    REGISTRY,
    PrefetchPolicy,
)
from moesim.policies.registry import PolicyContext


@dataclass(frozen=True)
class StaticPinParams:
    """Parameters of static pinning."""

    fraction: float = field(default=0.5, metadata={
        "help": "share of the cache capacity given to pinned experts (0..1]"})
    calibration: float = field(default=0.1, metadata={
        "help": "leading share of the forward passes whose expert use decides what is pinned"})

    def __post_init__(self) -> None:
        if not 0 < self.fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {self.fraction}")
        if not 0 < self.calibration <= 1:
            raise ValueError(f"calibration must be in (0, 1], got {self.calibration}")


@REGISTRY.register("static-pin")
class StaticPin(PrefetchPolicy):
    """Keep the most frequently used experts resident: the experts used most often in the
    first ``calibration`` share of the forward passes fill ``fraction`` of the cache before
    the replay starts (loaded at start-up, outside the timed passes) and are never evicted;
    the rest of the cache works as usual. No per-layer prefetching. A trace file replayed a
    piece at a time is read for the counts before the replay (``PolicyContext.whole_trace``)."""

    counts_whole_trace = True

    Params = StaticPinParams
    active = False

    def __init__(self, params: StaticPinParams, ctx: PolicyContext) -> None:
        super().__init__(params, ctx)
        # the passes of the whole trace, then the experts of its first n_cal passes (a trace file
        # replayed a piece at a time is read for them before the replay: once whole, then up to
        # the piece where the calibration share ends)
        num_passes = sum(wl.num_passes for wl in ctx.whole_trace())
        n_cal = max(1, math.ceil(num_passes * params.calibration))
        counts = np.zeros(ctx.num_layers * ctx.num_experts, np.int64)
        with contextlib.closing(ctx.whole_trace()) as pieces:  # the file's reader goes at the break
            for wl in pieces:
                take = min(n_cal, wl.num_passes)
                counts += np.bincount(wl.keys()[:int(wl.off[take * ctx.num_layers])], minlength=len(counts))
                n_cal -= take
                if not n_cal:
                    break
        slots = ctx.capacity_bytes / ctx.expert_bytes if math.isfinite(ctx.capacity_bytes) else len(counts)
        n_pin = min(int(slots * params.fraction), int((counts > 0).sum()))
        order = np.argsort(-counts, kind="stable")[:n_pin]
        self.static_pins: list[int] = [int(k) for k in ctx.cache_keys(order)]

    def propose(self, pass_index: int, layer: int) -> Sequence[int]:
        return ()

    def pinned(self) -> Sequence[int]:
        return self.static_pins

"""Score-percentile prefetch (SpecMD): experts above a percentile of the predicted scores."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from moesim.jit import jit
from moesim.policies.prefetch.base import (
    REGISTRY,
    _key_expert,
    _key_mean,
    _need_pred_next,
    _offsets,
    _Predicted,
    _proposing,
    _row_sums,
    _score_key,
)
from moesim.policies.registry import PolicyContext


@dataclass(frozen=True)
class PercentileParams:
    """Parameters of score-percentile prefetch."""

    percentile: float = field(default=80.0, metadata={
        "help": "prefetch every expert whose predicted score is above this percentile (0..100)"})

    def __post_init__(self) -> None:
        if not 0 <= self.percentile < 100:
            raise ValueError(f"percentile must be in [0, 100), got {self.percentile}")


@REGISTRY.register("score-percentile")
class ScorePercentile(_Predicted):
    """Score-based prefetch (SpecMD §3.1.4, after Zhu et al. 2025): every expert whose
    predicted next-layer score (mean over the pass's tokens of ``pred_next``) is above the
    p-th percentile of the layer's predicted scores, highest first
    (:func:`percentile_proposals`). The count adapts to how peaked the prediction is."""

    piecewise = True

    Params = PercentileParams

    def __init__(self, params: PercentileParams, ctx: PolicyContext) -> None:
        super().__init__(params, ctx)
        _need_pred_next(ctx, "score-percentile")

    def _arrays(self, pred: np.ndarray, row_order: np.ndarray, bounds: np.ndarray,
                g0: int) -> tuple[np.ndarray, np.ndarray]:
        return percentile_proposals(pred, row_order, bounds, g0, self._num_l, self.params.percentile / 100)


def percentile_proposals(pred: np.ndarray, row_order: np.ndarray, bounds: np.ndarray, g0: int, num_l: int,
                         q: float) -> tuple[np.ndarray, np.ndarray]:
    """Score-percentile's proposals for the (pass, layer) groups ``g0 + g`` whose trace rows
    are ``row_order[bounds[g]:bounds[g + 1]]``: offsets (``off[0]`` = 0, one more than the
    groups) and the next layer's flat expert ids (``layer * num_e + e``).

    A group's score per expert is the mean of its rows' predicted next-layer scores: each
    prediction taken as float32 (the trace format's type, so that a trace made in memory
    proposes as its saved copy does), summed in row order in float32, then divided by the row
    count in float64. Its threshold is the ``q`` quantile of the means by numpy's default
    ``linear`` method (``(n - 1) * q``, interpolated as ``np.percentile`` does); the experts
    whose mean is above it are proposed, highest mean first, ties by expert index (a stable
    sort of the negated means). The last layer proposes nothing.

    Each group's experts are ordered by a whole-number key (:func:`_percentile_keys`) whose
    order is that one, all of a call's groups sorted at once by numpy's vectorised sort (SIMD
    where the machine has it). On 262,144 groups of one row (64 random float32
    predictions, 16 layers, q 0.8) 217-220 against 725-743 ns a group (each commit's own
    function, three interleaved rounds, the same proposals) for the top ``n - floor((n - 1) q)``
    means kept in order by insertion before."""
    num_e = pred.shape[1]
    which = _proposing(bounds, g0, num_l)
    keys = np.empty((len(which), num_e), dtype=np.int64)
    _percentile_keys(pred, row_order, bounds, which, np.empty(num_e, dtype=np.float32), keys)
    keys.sort(axis=1)
    v = (num_e - 1) * q
    lo_rank = math.floor(v)  # q < 1: lo_rank < n - 1, or 0 = n - 1 for one expert
    counts = np.empty(len(which), dtype=np.int64)
    out = np.empty(len(which) * (num_e - lo_rank), dtype=np.int64)  # the emission reads the top n - lo_rank keys at most
    _percentile_emit(keys, which, bounds, g0, num_l, lo_rank, v - lo_rank, counts, out)
    return _offsets(len(bounds) - 1, which, counts), out[:counts.sum()]


@jit
def _percentile_keys(pred, row_order, bounds, which, sums, keys):
    """Sorting keys of the groups ``which``, one row of ``keys`` each: :func:`_score_key` of
    each expert's float32 sum. Ordering by the float32 sum is ordering by the mean: dividing
    distinct float32 values by the same row count (at most ``2**31``) and rounding to float64
    keeps them distinct (their gap is 2**28 float64 units or more), and equal ones stay equal."""
    for i in range(which.shape[0]):
        g = which[i]
        _row_sums(pred, row_order, bounds[g], bounds[g + 1], sums)
        for e in range(sums.shape[0]):
            keys[i, e] = _score_key(sums[e], e)


@jit
def _percentile_emit(ranked, which, bounds, g0, num_l, lo_rank, gamma, counts, out):
    """The proposals of the groups ``which`` from their keys ``ranked`` sorted ascending
    (:func:`_percentile_keys`), one after another in ``out``, how many in ``counts``: the
    quantile's neighbours are the means at ranks ``lo_rank`` and ``lo_rank + 1``, and the
    experts above it are read from the top key down. Numpy's interpolation never rounds below
    its lower neighbour ``a`` (``a + d * gamma`` adds a non-negative term; ``b - d * (1 -
    gamma)`` with ``gamma >= 0.5`` subtracts at most ``d / 2``), so the mean at rank
    ``lo_rank`` is never above it: a group proposes at most ``n - 1 - lo_rank`` experts. The
    loop reads no lower than rank ``lo_rank`` (``out`` holds ``n - lo_rank`` a group), so a
    threshold below ``a`` would propose ``a`` (and show) rather than write past the buffer."""
    n = ranked.shape[1]
    o = 0
    for i in range(which.shape[0]):
        g = which[i]
        count = np.float64(bounds[g + 1] - bounds[g])
        a = _key_mean(ranked[i, lo_rank], count)
        b = _key_mean(ranked[i, lo_rank + 1], count) if lo_rank + 1 < n else a
        d = b - a
        threshold = b - d * (1 - gamma) if gamma >= 0.5 else a + d * gamma
        base = ((g0 + g) % num_l + 1) * n
        t = n - 1
        while t >= lo_rank and _key_mean(ranked[i, t], count) > threshold:
            out[o] = base + _key_expert(ranked[i, t])
            o += 1
            t -= 1
        counts[i] = n - 1 - t

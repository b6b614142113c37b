"""Prefetch policies: propose experts for later layers at a layer's routing point.

The engine calls :meth:`PrefetchPolicy.propose` after layer ``l``'s routing decision; the
proposed cache keys (:meth:`PolicyContext.key`) are queued on the copy engine behind
demand fetches. Policies with ``active = False`` are never called.
"""

from __future__ import annotations

import contextlib
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from moesim.errors import MoesimError
from moesim.jit import inline, jit
from moesim.policies.registry import Policy, PolicyContext, Registry


class PrefetchPolicy(Policy, ABC):
    """Base class of the prefetch family: per-layer proposals (``propose``; ``active = False``
    when there are none) and an admission rule (``pinned``: experts loaded before the replay
    and never evicted)."""

    active: ClassVar[bool] = True

    @abstractmethod
    def propose(self, pass_index: int, layer: int) -> Sequence[int]:
        """Cache keys to prefetch, most wanted first."""

    def pinned(self) -> Sequence[int]:
        """Cache keys admitted before the replay starts (untimed) and never evicted. Default: none."""
        return ()

    def proposals(self, first: int, last: int) -> tuple[np.ndarray, np.ndarray]:
        """The proposals of every (pass, layer) of passes ``first .. last`` as arrays (what
        the compiled replay kernel reads): offsets (``(last - first) * num_layers + 1``; the
        proposals of (pass p, layer l) are ``keys[off[i]:off[i + 1]]`` with
        ``i = (p - first) * num_layers + l``) and int64 cache keys. Default: :meth:`propose`
        for each."""
        lists = [self.propose(p, layer) for p in range(first, last) for layer in range(self.ctx.num_layers)]
        off = np.zeros(len(lists) + 1, dtype=np.int64)
        np.cumsum([len(x) for x in lists], out=off[1:])
        keys = np.fromiter((k for x in lists for k in x), dtype=np.int64, count=int(off[-1]))
        return off, keys

    def piece_proposals(self, workload: Any) -> tuple[np.ndarray, np.ndarray] | None:
        """:meth:`proposals` of all the passes of ``workload`` (a piece of a trace read in
        pieces, not yet the one replayed), for a policy whose proposals read that workload and
        nothing else, no state of the policy's included: made on the thread that reads the next
        piece while the kernel replays this one (:func:`simulator.stream.read_ahead`). Default:
        None, not made ahead (the kernel asks :meth:`proposals` as it replays the piece)."""
        return None


REGISTRY: Registry[PrefetchPolicy] = Registry("prefetch")


@REGISTRY.register("none")
class NoPrefetch(PrefetchPolicy):
    """No prefetching: experts are loaded on demand only."""

    active = False

    def propose(self, pass_index: int, layer: int) -> Sequence[int]:
        return ()


def _keys_of(ctx: PolicyContext, pass_index: int, layer: int) -> list[int]:
    """Cache keys the workload accesses at (pass, layer), in access order."""
    wl = ctx.workload
    b = pass_index * ctx.num_layers + layer
    return ctx.cache_keys(wl.acc_layer[wl.off[b]:wl.off[b + 1]].astype(np.int64) * ctx.num_experts
                          + wl.acc_expert[wl.off[b]:wl.off[b + 1]]).tolist()


def _previous_pass(ctx: PolicyContext, pass_index: int) -> int | None:
    """The previous forward pass of the same batch group (the previous token), or None."""
    wl = ctx.workload
    if pass_index == 0 or wl.pass_group[pass_index - 1] != wl.pass_group[pass_index]:
        return None
    return pass_index - 1


def _need_pred_next(ctx: PolicyContext, name: str) -> None:
    if ctx.workload is None or ctx.workload.pred_next is None:
        raise MoesimError(
            f"prefetch policy '{name}' needs the trace's 'pred_next' column (the next layer's "
            "router probabilities predicted from this layer's hidden state), and this trace has "
            "none. Record it with `moesim capture --predict-next`, make a synthetic trace with "
            "workload.trace.synth.pred_next: true, or use prefetch: previous-token, which needs "
            "no hidden state.")


@REGISTRY.register("oracle")
class Oracle(PrefetchPolicy):
    """The true experts of the next layer, read from the trace: an upper bound for any
    next-layer predictor (``speculating-experts-prefetch.txt`` §5.1's perfect prefetch)."""

    def propose(self, pass_index: int, layer: int) -> Sequence[int]:
        if layer + 1 >= self.ctx.num_layers:
            return ()
        return _keys_of(self.ctx, pass_index, layer + 1)


@REGISTRY.register("previous-token")
class PreviousToken(PrefetchPolicy):
    """Prefetch for the next layer the experts that layer used for the previous token (the
    previous decode pass of the same batch); needs no hidden state."""

    def propose(self, pass_index: int, layer: int) -> Sequence[int]:
        prev = _previous_pass(self.ctx, pass_index)
        if prev is None or layer + 1 >= self.ctx.num_layers:
            return ()
        return _keys_of(self.ctx, prev, layer + 1)


@dataclass(frozen=True)
class LookaheadParams:
    """Parameters of lookahead prefetch."""

    depth: int = field(default=2, metadata={"help": "number of layers ahead to prefetch (d >= 1)"})

    def __post_init__(self) -> None:
        if self.depth < 1:
            raise ValueError(f"depth must be >= 1, got {self.depth}")


@REGISTRY.register("lookahead")
class Lookahead(PrefetchPolicy):
    """Prefetch ``depth`` layers ahead: at layer l, the experts layers l+1 .. l+d used for the
    previous token, nearest layer first (previous-token prediction extended d layers)."""

    Params = LookaheadParams

    def propose(self, pass_index: int, layer: int) -> Sequence[int]:
        prev = _previous_pass(self.ctx, pass_index)
        if prev is None:
            return ()
        out: list[int] = []
        for t in range(layer + 1, min(layer + 1 + self.params.depth, self.ctx.num_layers)):
            out.extend(_keys_of(self.ctx, prev, t))
        return out


@dataclass(frozen=True)
class TopKParams:
    """Parameters of top-k next-gate prefetch."""

    overfetch: float = field(default=1.0, metadata={
        "help": "prefetch ceil(top_k * overfetch) experts per token (SpecMD §3.1.4)"})

    def __post_init__(self) -> None:
        if not self.overfetch > 0:
            raise ValueError(f"overfetch must be > 0, got {self.overfetch}")


class _ProposedInChunks(PrefetchPolicy):
    """A prefetcher whose proposals read the workload alone, made for many passes at once
    (:meth:`_proposals_of`, compiled): :meth:`propose` reads them from a chunk of
    :attr:`CHUNK` passes made at once, the kernel asks :meth:`proposals` for its calls, and a
    trace read in pieces makes each piece's on the reading thread (:meth:`piece_proposals`)."""

    CHUNK = 256

    def __init__(self, params: Any, ctx: PolicyContext) -> None:
        super().__init__(params, ctx)
        self._lo = self._hi = 0
        self._of: Any = None  # the workload the chunk was made from
        self._num_l = ctx.num_layers
        self._off = np.zeros(1, dtype=np.int64)
        self._keys = np.zeros(0, dtype=np.int64)

    def propose(self, pass_index: int, layer: int) -> Sequence[int]:
        wl = self.ctx.workload
        if wl is not self._of or not self._lo <= pass_index < self._hi:  # a chunk of this workload's
            self._of, self._lo, self._hi = wl, pass_index, min(pass_index + self.CHUNK, wl.num_passes)
            self._off, self._keys = self.proposals(self._lo, self._hi)
        i = (pass_index - self._lo) * self._num_l + layer
        return self._keys[self._off[i]:self._off[i + 1]].tolist()

    def proposals(self, first: int, last: int) -> tuple[np.ndarray, np.ndarray]:
        """Proposals of every (pass, layer) of passes ``first .. last`` at once."""
        return self._proposals_of(self.ctx.workload, first, last)

    def piece_proposals(self, workload: Any) -> tuple[np.ndarray, np.ndarray]:
        return self._proposals_of(workload, 0, workload.num_passes)

    def _proposals_of(self, wl: Any, first: int, last: int) -> tuple[np.ndarray, np.ndarray]:
        """The proposals of passes ``first .. last`` of workload ``wl``: they read ``wl``, the
        parameters and the layout alone (every buffer is the call's own)."""
        num_l = self._num_l
        bounds = np.ascontiguousarray(wl.row_off[first * num_l:last * num_l + 1], dtype=np.int64)
        off, out = self._arrays(wl.pred_next, wl.row_order, bounds, first * num_l)
        return off, self.ctx.cache_keys(out)

    @abstractmethod
    def _arrays(self, pred: np.ndarray, row_order: np.ndarray, bounds: np.ndarray,
                g0: int) -> tuple[np.ndarray, np.ndarray]:
        """The proposals of the (pass, layer) groups ``g0 + g`` whose rows are
        ``row_order[bounds[g]:bounds[g + 1]]``: offsets and next-layer flat expert ids."""


def _proposing(bounds: np.ndarray, g0: int, num_l: int) -> np.ndarray:
    """The groups ``g`` (pass, layer ``(g0 + g) % num_l``) that propose: those with trace
    rows, not at the last layer."""
    rows = np.diff(bounds)
    return np.flatnonzero((rows > 0) & ((g0 + np.arange(len(rows))) % num_l + 1 < num_l))


def _offsets(groups: int, which: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Proposal offsets of ``groups`` groups (``off[0]`` = 0) from the counts of the
    proposing ones, ``which``; the others propose nothing."""
    off = np.zeros(groups + 1, dtype=np.int64)
    off[which + 1] = counts
    return np.cumsum(off, out=off)


@REGISTRY.register("next-gate-topk")
class NextGateTopK(_ProposedInChunks):
    """Speculative top-k prefetch (SpecMD §3.1.4; Eliseev & Mazur 2023): the next layer's
    router applied to this layer's hidden state (the trace's ``pred_next``) gives predicted
    probabilities; each token's top ``ceil(k * overfetch)`` experts are prefetched, the union
    over the pass's tokens ordered by summed predicted probability (:func:`topk_proposals`)."""

    Params = TopKParams

    def __init__(self, params: TopKParams, ctx: PolicyContext) -> None:
        super().__init__(params, ctx)
        _need_pred_next(ctx, "next-gate-topk")
        self.count = min(ctx.num_experts, math.ceil(ctx.top_k * params.overfetch))

    def _arrays(self, pred: np.ndarray, row_order: np.ndarray, bounds: np.ndarray,
                g0: int) -> tuple[np.ndarray, np.ndarray]:
        return topk_proposals(pred, row_order, bounds, g0, self._num_l, self.count)


def topk_proposals(pred: np.ndarray, row_order: np.ndarray, bounds: np.ndarray, g0: int, num_l: int,
                   count: int) -> tuple[np.ndarray, np.ndarray]:
    """Next-gate top-k's proposals for the (pass, layer) groups ``g0 + g`` whose trace rows
    are ``row_order[bounds[g]:bounds[g + 1]]``: offsets (``off[0]`` = 0, one more than the
    groups) and the next layer's flat expert ids (``layer * num_e + e``).

    Each row (token) names its ``count`` highest predicted experts, ties by expert index; the
    union over the group's rows is proposed, ordered by the predictions summed over those rows
    (float32, added in row order), highest first, ties by index. Predictions are taken as
    float32 (the trace format's type). The last layer proposes nothing.

    Each row's experts are ordered by the whole-number keys of :func:`_score_key`, all of a
    call's rows sorted at once by numpy's vectorised sort (issue 34: the proposals were made
    in Python per (pass, layer), about 14 us a group; a next-gate-topk replay of the 5.12
    M-access benchmark trace took 2.16-2.26 s against 10.62-10.72 s, README "Speed")."""
    num_e = pred.shape[1]
    top = min(count, num_e)
    which = _proposing(bounds, g0, num_l)
    rows = np.diff(bounds)[which]
    keys = np.empty((int(rows.sum()), num_e), dtype=np.int64)
    _topk_keys(pred, row_order, bounds, which, keys)
    keys.sort(axis=1)
    counts = np.empty(len(which), dtype=np.int64)
    out = np.empty(int(np.minimum(rows * top, num_e).sum()), dtype=np.int64)
    _topk_emit(pred, row_order, bounds, which, g0, num_l, top, keys, np.empty(num_e, dtype=np.float32),
               np.zeros(num_e, dtype=np.int64), np.empty(num_e, dtype=np.int64), counts, out)
    return _offsets(len(bounds) - 1, which, counts), out[:counts.sum()]


@jit
def _topk_keys(pred, row_order, bounds, which, keys):
    """Each row of the groups ``which``, in order: its experts' :func:`_score_key` keys, one
    row of ``keys`` each."""
    n = pred.shape[1]
    i = 0
    for g in which:
        for r in range(bounds[g], bounds[g + 1]):
            row = row_order[r]
            for e in range(n):
                keys[i, e] = _score_key(np.float32(pred[row, e]), e)
            i += 1


@jit
def _topk_emit(pred, row_order, bounds, which, g0, num_l, top, ranked, total, mark, chosen, counts, out):
    """The proposals of the groups ``which`` from their rows' keys ``ranked`` sorted ascending
    (:func:`_topk_keys`), one after another in ``out``, how many in ``counts``: the union of
    each row's ``top`` highest keys, ordered by the keys of the group's summed predictions
    (insertion, highest first; a row's own order is already that of a one-row group's sums).
    ``mark`` holds, per expert, the last group (counted from 1) that chose it."""
    n = pred.shape[1]
    o = 0
    r = 0  # the group's first row in ranked
    for i in range(which.shape[0]):
        g = which[i]
        r0, r1 = bounds[g], bounds[g + 1]
        _row_sums(pred, row_order, r0, r1, total)
        c = 0
        for rr in range(r, r + r1 - r0):
            for t in range(n - 1, n - 1 - top, -1):
                e = _key_expert(ranked[rr, t])
                if mark[e] != i + 1:
                    mark[e] = i + 1
                    x = _score_key(total[e], e)
                    j = c
                    while j > 0 and chosen[j - 1] < x:
                        chosen[j] = chosen[j - 1]
                        j -= 1
                    chosen[j] = x
                    c += 1
        base = ((g0 + g) % num_l + 1) * n
        for j in range(c):
            out[o + j] = base + _key_expert(chosen[j])
        o += c
        counts[i] = c
        r += r1 - r0


@dataclass(frozen=True)
class PercentileParams:
    """Parameters of score-percentile prefetch."""

    percentile: float = field(default=80.0, metadata={
        "help": "prefetch every expert whose predicted score is above this percentile (0..100)"})

    def __post_init__(self) -> None:
        if not 0 <= self.percentile < 100:
            raise ValueError(f"percentile must be in [0, 100), got {self.percentile}")


@REGISTRY.register("score-percentile")
class ScorePercentile(_ProposedInChunks):
    """Score-based prefetch (SpecMD §3.1.4, after Zhu et al. 2025): every expert whose
    predicted next-layer score (mean over the pass's tokens of ``pred_next``) is above the
    p-th percentile of the layer's predicted scores, highest first
    (:func:`percentile_proposals`). The count adapts to how peaked the prediction is."""

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
    where the machine has it). Issue 34: on 262,144 groups of one row (64 random float32
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


@inline
def _row_sums(pred, row_order, r0, r1, sums):
    """The predictions of rows ``row_order[r0:r1]`` (``r0 < r1``) summed per expert into
    ``sums``: each taken as float32 and added in row order in float32."""
    for e in range(sums.shape[0]):
        sums[e] = np.float32(pred[row_order[r0], e])
    for r in range(r0 + 1, r1):
        for e in range(sums.shape[0]):
            sums[e] += np.float32(pred[row_order[r], e])


@inline
def _score_key(score, e):
    """A whole-number key that orders expert ``e`` by its float32 ``score``, highest last,
    then by index, lowest last: the high 32 bits hold the score's bits made
    signed-comparable (a negative float's magnitude bits flipped, after ``+ 0.0`` has made
    ``-0.0`` into ``0.0``, which compare equal as scores), the low 32 bits ``2**32 - 1 - e``, so
    that of two equal scores the lower index has the larger key."""
    bits = np.int64(np.float32(score + np.float32(0.0)).view(np.int32))
    if bits < 0:
        bits ^= 0x7FFFFFFF
    return (bits << 32) | (0xFFFFFFFF - e)


@inline
def _key_expert(key):
    """The expert index of a :func:`_score_key` key."""
    return 0xFFFFFFFF - (key & 0xFFFFFFFF)


@inline
def _key_mean(key, count):
    """The mean score a key of :func:`_percentile_keys` stands for: its float32 sum over
    ``count`` rows, in float64."""
    bits = np.int32(key >> 32)
    if bits < 0:
        bits ^= np.int32(0x7FFFFFFF)
    return np.float64(np.int32(bits).view(np.float32)) / count


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

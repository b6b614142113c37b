"""Next-gate top-k prefetch: the top experts of the predicted next-layer router."""

from __future__ import annotations

import math

import numpy as np

from moesim.jit import jit
from moesim.policies.prefetch.base import (
    REGISTRY,
    TopKParams,
    _key_expert,
    _need_pred_next,
    _offsets,
    _Predicted,
    _proposing,
    _row_sums,
    _score_key,
)
from moesim.policies.registry import PolicyContext


@REGISTRY.register("next-gate-topk")
class NextGateTopK(_Predicted):
    """Speculative top-k prefetch (SpecMD §3.1.4; Eliseev & Mazur 2023): the next layer's
    router applied to this layer's hidden state (the trace's ``pred_next``) gives predicted
    probabilities; each token's top ``ceil(k * overfetch)`` experts are prefetched, the union
    over the pass's tokens ordered by summed predicted probability (:func:`topk_proposals`)."""

    piecewise = True

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
    call's rows sorted at once by numpy's vectorised sort (the proposals were made
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

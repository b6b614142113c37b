"""Trace -> forward passes (``docs/design.md``: "Data flow", Workload).

Static batching: requests, ordered by id, are taken in groups of ``batch_size``. A group runs
its passes back to back: pass ``s`` of the group carries step ``s`` of each of its requests
that has one (step 0 is the prefill when the trace has one, so the group's prompts are
prefilled together; each decode step then carries one token of each request). Groups run one
after another.

For each (pass, layer) the workload lists the *expert accesses*: the distinct experts the
pass's tokens routed to at that layer, in order of first appearance (tokens by request then
position, experts in rank order), with the number of tokens routed to each and the sum of
their mixing weights. A batch-1 decode trace therefore gives the access stream "by step, by
layer, by rank" that libCacheSim is fed in the differential tests.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from moesim.errors import MoesimError
from moesim.jit import njit
from moesim.traces.schema import PHASE_CODES, ModelInfo
from moesim.traces.trace import Trace

PREFILL, DECODE, VERIFY = PHASE_CODES["prefill"], PHASE_CODES["decode"], PHASE_CODES["verify"]


@dataclass
class Workload:
    """Forward passes and their expert accesses as flat numpy arrays.

    Per pass ``p`` (in execution order): ``pass_group``, ``pass_step``, ``pass_phase``
    (phase code: prefill if any prefill token, else verify if any, else decode),
    ``pass_tokens`` (token occurrences), ``pass_context`` (sum over tokens of position + 1,
    the attention context), ``pass_requests``.

    Accesses of (pass ``p``, layer ``l``) are ``acc_*[off[p * L + l] : off[p * L + l + 1]]``:
    ``acc_layer``, ``acc_expert``, ``acc_rank`` (best router rank among the tokens),
    ``acc_tokens`` (tokens routed), ``acc_weight`` (sum of their mixing weights).

    ``request_ids`` lists requests in order; ``request_group`` their group;
    ``request_first_pass`` the pass that produced their first token.
    """

    model: ModelInfo
    batch_size: int
    pass_group: np.ndarray
    pass_step: np.ndarray
    pass_phase: np.ndarray
    pass_tokens: np.ndarray
    pass_context: np.ndarray
    pass_requests: np.ndarray
    pass_generated: np.ndarray  # tokens each pass produces (prefill: one per request; verify: accepted + 1)
    off: np.ndarray
    acc_layer: np.ndarray
    acc_expert: np.ndarray
    acc_rank: np.ndarray
    acc_tokens: np.ndarray
    acc_weight: np.ndarray
    request_ids: np.ndarray
    request_group: np.ndarray
    request_first_pass: np.ndarray
    weight_total: np.ndarray
    row_order: np.ndarray | None = None
    row_off: np.ndarray | None = None
    trace: Trace | None = None
    pass_release: np.ndarray | None = None  # serving: a pass starts no earlier (s); None: on the last's end
    # the prefetcher's proposals for every pass, made as the piece was read (``PrefetchPolicy.piece_proposals``,
    # simulator.stream.read_ahead); None: the kernel asks for them as it replays
    proposals: tuple[np.ndarray, np.ndarray] | None = None
    # serving, for a prefetcher that reads the pass before: one pass of the tokens each request of
    # this one-pass piece processed in its own last pass (None: no request of it had one)
    previous: Workload | None = None

    def release(self) -> np.ndarray:
        """Per pass, the time it may start at the earliest (seconds; zeros without arrivals,
        when each pass starts as the one before ends)."""
        return self.pass_release if self.pass_release is not None else np.zeros(self.num_passes)

    def rows(self, pass_index: int, layer: int) -> np.ndarray:
        """Indices into the trace's row arrays (``probs``, ``pred_next``) of the tokens of
        (pass, layer), ordered by request then position."""
        assert self.row_order is not None
        assert self.row_off is not None
        b = pass_index * self.model.num_layers + layer
        return self.row_order[int(self.row_off[b]):int(self.row_off[b + 1])]

    @property
    def probs(self) -> np.ndarray | None:
        """The trace's full router probabilities per row, when it has them."""
        return self.trace.probs if self.trace is not None else None

    @property
    def pred_next(self) -> np.ndarray | None:
        """The trace's predicted next-layer router probabilities per row, when it has them."""
        return self.trace.pred_next if self.trace is not None else None

    @property
    def num_passes(self) -> int:
        return int(self.pass_group.shape[0])

    @property
    def num_accesses(self) -> int:
        return int(self.off[-1])

    def keys(self) -> np.ndarray:
        """Cache key of every access: ``layer * num_experts + expert`` (int64, made in place:
        no temporaries of the access count)."""
        keys = self.acc_layer.astype(np.int64)
        keys *= self.model.num_experts
        keys += self.acc_expert
        return keys

    def cache_keys(self, num_prec: int, default_prec: int) -> np.ndarray:
        """The cache key of every access at the default precision (``PolicyContext.cache_keys``
        of :meth:`keys`, made in place)."""
        keys = self.keys()
        keys *= num_prec
        keys += default_prec
        return keys


def speculate(trace: Trace, tree_size: int, depth: int, accept_prob: float,
              rng: np.random.Generator) -> tuple[Trace, dict[tuple[int, int], int]]:
    """Decode rows -> verification rows (see ``docs/concepts/speculative.md``). Returns the new trace
    and the tokens each (request, verify step) produces."""
    dec = trace.phase == PHASE_CODES["decode"]
    keep = trace.take(~dec)
    parts = [keep]
    produced: dict[tuple[int, int], int] = {}
    d = trace.take(dec)
    first_step = 1 if (trace.phase == PHASE_CODES["prefill"]).any() else 0
    for r in np.unique(d.request):
        sel = np.flatnonzero(d.request == r)
        pos = d.position[sel]
        upos = np.unique(pos)
        by_pos = {int(q): sel[pos == q] for q in upos}
        c = 0
        step = first_step
        while c < len(upos):
            window = upos[c:c + tree_size]
            a = 0
            while a < min(depth, len(window) - 1) and rng.random() < accept_prob:
                a += 1
            idx = np.concatenate([by_pos[int(q)] for q in window])
            piece = d.take(idx)
            piece.step = np.full(len(idx), step, dtype=np.int32)
            piece.phase = np.full(len(idx), PHASE_CODES["verify"], dtype=np.int8)
            piece.node = np.repeat(np.arange(len(window), dtype=np.int16),
                                   [len(by_pos[int(q)]) for q in window])
            piece.parent = np.where(piece.node > 0, piece.node - 1, -1).astype(np.int16)
            piece.accepted = piece.node <= a
            parts.append(piece)
            produced[(int(r), step)] = a + 1
            c += a + 1
            step += 1
    keep.node = np.zeros(len(keep), dtype=np.int16)
    keep.parent = np.full(len(keep), -1, dtype=np.int16)
    keep.accepted = np.ones(len(keep), dtype=bool)
    merged: dict[str, Any] = {}
    for col in ("request", "step", "position", "phase", "layer", "experts", "weights", "probs", "pred_next",
                "node", "parent", "accepted"):
        arrs = [getattr(part, col) for part in parts]
        merged[col] = None if any(arr is None for arr in arrs) else np.concatenate(arrs)
    out = Trace(model=trace.model, capture=trace.capture, source=trace.source, **merged)
    return out, produced


def _generated(trace: Trace, order: np.ndarray, phase: np.ndarray, pass_of_row: np.ndarray, ridx: np.ndarray,
               pos: np.ndarray, pass_phase: np.ndarray, pass_step: np.ndarray, pass_requests: np.ndarray,
               pass_tokens: np.ndarray, req_ids: np.ndarray,
               produced: dict[tuple[int, int], int] | None) -> np.ndarray:
    """Tokens each pass generates: a prefill pass one per request, a decode pass one per
    token; a verification pass what its requests produced: the accepted (request, position,
    node) rows a captured trace records, or the counts ``produced`` by :func:`speculate`."""
    n_pass = len(pass_phase)
    generated = np.where(pass_phase == PREFILL, pass_requests, pass_tokens).astype(np.int64)
    if produced is None and trace.accepted is not None and (pass_phase == VERIFY).any():
        # verify steps recorded in the trace (moesim capture --speculative): a pass generates
        # the accepted draft tokens (a rejected step is followed by a decode step)
        acc_rows = trace.accepted[order] & (phase == VERIFY)
        node = trace.node[order] if trace.node is not None else np.zeros(len(order), dtype=np.int64)
        acc_key = np.unique(np.stack([pass_of_row[acc_rows], ridx[acc_rows], pos[acc_rows],
                                      node[acc_rows].astype(np.int64)], axis=1), axis=0)
        verify_gen = np.bincount(acc_key[:, 0], minlength=n_pass) if len(acc_key) else np.zeros(n_pass, np.int64)
        generated = np.where(pass_phase == VERIFY, verify_gen, generated).astype(np.int64)
    if produced is not None:
        generated = np.zeros(n_pass, dtype=np.int64)
        seen_pairs = np.unique(pass_of_row * (len(req_ids) + 1) + ridx)
        for key in seen_pairs.tolist():
            pidx, r = divmod(key, len(req_ids) + 1)
            if pass_phase[pidx] == VERIFY:
                generated[pidx] += produced.get((int(req_ids[r]), int(pass_step[pidx])), 0)
            else:  # prefill: the first token; decode: one token
                generated[pidx] += 1
    return generated


@njit(cache=True, nogil=True)
def _fill_accesses(pl, experts, weights, order, num_e, num_l, off, row_off, out_layer, out_expert, out_rank,
                   out_tokens, out_weight):
    """One pass over the rows ``experts[order]`` (their (pass, layer) ids ``pl``, non-decreasing):
    each (pass, layer) ``g``'s distinct experts written from ``off[g]`` on, in order of first
    appearance (rows in order, ranks in order): layer, expert, best rank, tokens routed and
    summed weight (float64, summed in row order as ``np.bincount`` sums). ``off[g]`` is the
    number of accesses before ``g`` and ``row_off[g]`` its first row (both for every ``g``,
    with none, and one entry past the last). Returns the number of accesses (at most the
    rows times top-k, the out arrays' length)."""
    seen = np.full(num_e, -1, np.int64)
    slot = np.zeros(num_e, np.int64)
    n = 0
    before = -1  # the (pass, layer) of the row before
    lay = 0
    for r in range(order.shape[0]):
        g = pl[r]
        if g != before:
            for b in range(before + 1, g + 1):  # g, and any with no rows between, start here
                off[b] = n
                row_off[b] = r
            lay = g % num_l
            before = g
        row = order[r]
        for j in range(experts.shape[1]):
            e = experts[row, j]
            w = np.float64(weights[row, j])
            if seen[e] != g:
                seen[e] = g
                slot[e] = n
                out_layer[n] = lay
                out_expert[n] = e
                out_rank[n] = j
                out_tokens[n] = 1
                out_weight[n] = w
                n += 1
            else:
                i = slot[e]
                if j < out_rank[i]:
                    out_rank[i] = j
                out_tokens[i] += 1
                out_weight[i] += w
    for b in range(before + 1, off.shape[0]):
        off[b] = n
        row_off[b] = order.shape[0]
    return n


def _accesses(pl: np.ndarray, trace: Trace, order: np.ndarray, num_e: int, num_l: int,
              n_groups: int) -> tuple[np.ndarray, ...]:
    """(off, row_off, layer, expert, best rank, tokens, summed weight) of every access, from the
    trace's rows in execution ``order`` and their (pass, layer) ids ``pl``: ``off`` and
    ``row_off`` (each (pass, layer)'s first row in ``order``) have one entry per (pass, layer)
    + 1 (see :class:`Workload`); the per-access arrays take the narrowest types that hold
    them and are written in place by one compiled pass over the rows (no per-access
    temporaries, no reordered copy of the trace) into arrays of the largest size, rows times
    top-k, of which they are the first part (the pages past it are never written, so never
    resident)."""
    ex = trace.experts.reshape(len(trace.experts), -1)
    w = trace.weights.reshape(len(trace.weights), -1)
    off = np.empty(n_groups + 1, np.int64)
    row_off = np.empty(n_groups + 1, np.int64)
    most = ex.shape[0] * ex.shape[1]
    # ranks 0 .. top-k - 1 as int16 at any top-k (a trace's experts are int16): one type, so one
    # compiled kernel for every trace
    out = (np.empty(most, np.int32), np.empty(most, np.int32), np.empty(most, np.int16), np.empty(most, np.int32),
           np.empty(most, np.float64))
    n = _fill_accesses(pl, ex, w, order, num_e, num_l, off, row_off, *out)
    return (off, row_off, *(a[:n] for a in out))


def _in_order(keys: tuple[np.ndarray, ...]) -> bool:
    """Whether the rows are already in the order ``np.lexsort(keys[::-1])`` gives (``keys``
    from the most significant): a decode trace written request by request is, and a stable
    sort would leave it as it is. A few vector passes instead of a sort."""
    if len(keys[0]) < 2:
        return True
    tied = np.ones(len(keys[0]) - 1, dtype=bool)  # rows i, i + 1 equal on the keys so far
    for k in keys:
        a, b = k[:-1], k[1:]
        if (tied & (b < a)).any():
            return False
        tied &= a == b
    return True


def _ids_and_index(request: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(request, return_inverse=True)``: the ids in order and each row's index among
    them, found by runs, with no sort, when the ids never decrease (a trace file's piece, its
    rows request by request)."""
    if (request[1:] < request[:-1]).any():
        return np.unique(request, return_inverse=True)
    start = np.r_[True, request[1:] != request[:-1]]
    return request[start], np.cumsum(start) - 1


@njit(cache=True, nogil=True)
def _count_requests(pass_of_row, ridx, pass_requests, first_pass):
    """Each pass's requests, each counted once, into ``pass_requests``, and each request's
    first pass into ``first_pass``, from the rows' passes ``pass_of_row`` (non-decreasing: the
    rows in execution order) and request indices ``ridx``: a request met again in the pass it
    was last met in is not counted again."""
    last = np.full(first_pass.shape[0], -1, np.int64)  # the pass each request was last met in
    for r in range(pass_of_row.shape[0]):
        p = pass_of_row[r]
        q = ridx[r]
        if last[q] != p:
            if last[q] < 0:
                first_pass[q] = p
            last[q] = p
            pass_requests[p] += 1


def build_workload(trace: Trace, batch_size: int = 1, max_requests: int | None = None,
                   speculative: Any = None, seed: int = 0) -> Workload:
    """Group the trace's rows into forward passes and list each pass's expert accesses.
    ``speculative`` (a :class:`simulator.scenario.SpeculativeConfig`) turns decode steps into
    verification passes first."""
    if len(trace) == 0:
        raise MoesimError(f"trace {trace.source}: has no rows; a replay needs at least one routed token.")
    produced: dict[tuple[int, int], int] | None = None
    if speculative is not None:
        depth = speculative.depth if speculative.depth is not None else speculative.tree_size - 1
        trace, produced = speculate(trace, speculative.tree_size, depth, speculative.accept_prob,
                                    np.random.default_rng([seed, 99]))
    model = trace.model
    num_l, num_e = model.num_layers, model.num_experts
    req_ids, req_idx = _ids_and_index(trace.request)
    if max_requests is not None and max_requests < len(req_ids):
        keep = req_idx < max_requests
        trace = trace.take(keep)
        req_idx = req_idx[keep]
        req_ids = req_ids[:max_requests]
    group = (req_idx // batch_size).astype(np.int64)
    step = trace.step.astype(np.int64)
    layer = trace.layer.astype(np.int64)
    pos = trace.position.astype(np.int64)
    keys = (group, step, layer, req_idx, pos)  # execution order: major to minor
    in_order = _in_order(keys)
    order = np.arange(len(pos)) if in_order else np.lexsort(keys[::-1])

    def ordered(a: np.ndarray) -> np.ndarray:
        """``a[order]``; ``a`` itself when the rows are in order (no copy of the identity)."""
        return a if in_order else a[order]

    group, step, layer, pos = ordered(group), ordered(step), ordered(layer), ordered(pos)
    ridx = ordered(req_idx)
    phase = ordered(trace.phase)

    # passes: distinct (group, step), already in execution order
    pass_key = group * (int(step.max()) + 1) + step  # the trace has a row (checked above)
    change = np.r_[True, pass_key[1:] != pass_key[:-1]]
    pass_of_row = np.cumsum(change) - 1
    n_pass = int(pass_of_row[-1] + 1)
    starts = np.flatnonzero(change)
    pass_group = group[starts]
    pass_step = step[starts]
    # phase: prefill > verify > decode
    rank_of_phase = np.array([3, 1, 2])[phase]  # prefill=3, decode=1, verify=2
    best = np.zeros(n_pass, dtype=np.int64)
    np.maximum.at(best, pass_of_row, rank_of_phase)
    pass_phase = np.array([0, DECODE, VERIFY, PREFILL], dtype=np.int8)[best]
    # tokens per pass: distinct (request, position)
    tok_key = (pass_of_row * (len(req_ids) + 1) + ridx) * (int(pos.max()) + 2) + pos
    _tok_unique, tok_first = np.unique(tok_key, return_index=True)
    tok_pass = pass_of_row[tok_first]
    pass_tokens = np.bincount(tok_pass, minlength=n_pass).astype(np.int64)
    pass_context = np.bincount(tok_pass, weights=pos[tok_first] + 1, minlength=n_pass).astype(np.int64)
    pass_requests = np.zeros(n_pass, np.int64)
    first_pass = np.full(len(req_ids), np.iinfo(np.int64).max, dtype=np.int64)
    _count_requests(pass_of_row, ridx, pass_requests, first_pass)

    del group, step, pass_key, change, rank_of_phase, tok_key, _tok_unique, tok_first, tok_pass
    # the gate weight of each pass: rows summed in float64 (a chunk of rows at a time)
    row_weight = np.empty(len(order))
    for c in range(0, len(order), 1 << 16):
        rows = slice(c, c + (1 << 16)) if in_order else order[c:c + (1 << 16)]
        row_weight[c:c + (1 << 16)] = trace.weights[rows].astype(np.float64).sum(axis=1)
    weight_total = np.bincount(pass_of_row, weights=row_weight, minlength=n_pass)
    del row_weight
    # accesses: distinct experts per (pass, layer) in order of first appearance
    pl = pass_of_row * num_l + layer  # (pass, layer) id per row, non-decreasing
    del layer
    off, row_off, acc_layer, acc_expert, acc_rank, acc_tokens, acc_weight = _accesses(pl, trace, order, num_e,
                                                                                     num_l, n_pass * num_l)

    req_group = (np.arange(len(req_ids)) // batch_size).astype(np.int64)
    generated = _generated(trace, order, phase, pass_of_row, ridx, pos, pass_phase, pass_step, pass_requests,
                           pass_tokens, req_ids, produced)
    return Workload(
        model=model, batch_size=batch_size, pass_generated=generated, pass_group=pass_group, pass_step=pass_step,
        pass_phase=pass_phase, pass_tokens=pass_tokens, pass_context=pass_context,
        pass_requests=pass_requests, off=off,
        acc_layer=acc_layer, acc_expert=acc_expert, acc_rank=acc_rank, acc_tokens=acc_tokens, acc_weight=acc_weight,
        request_ids=req_ids,
        request_group=req_group,
        request_first_pass=first_pass, weight_total=weight_total,
        row_order=order, row_off=row_off,
        trace=trace,
    )


def passes_of(wl: Workload) -> Workload:
    """``wl``'s forward passes and requests alone (the arrays shared, not copied): no
    accesses, rows or trace, so that a replayed piece keeps only what :func:`join` reads."""
    return replace(wl, acc_layer=wl.acc_layer[:0].copy(), acc_expert=wl.acc_expert[:0].copy(),
                   acc_rank=wl.acc_rank[:0].copy(), acc_tokens=wl.acc_tokens[:0].copy(),
                   acc_weight=wl.acc_weight[:0].copy(), row_order=None, row_off=None, trace=None,
                   proposals=None, previous=None)


def join(parts: list[Workload]) -> Workload:
    """One workload of the pieces' forward passes and requests, numbered as the whole trace's
    workload numbers them (passes, groups and access offsets continue from piece to piece).
    It holds no per-access arrays (the pieces' are gone): the number of accesses is its last
    offset."""
    first = passes_of(parts[0])
    pass_base = np.cumsum([0] + [w.num_passes for w in parts])
    group_base = np.cumsum([0] + [int(w.pass_group.max()) + 1 for w in parts])
    acc_base = np.cumsum([0] + [int(w.off[-1]) for w in parts])
    off = [np.zeros(1, np.int64)] + [w.off[1:] + acc_base[i] for i, w in enumerate(parts)]
    return replace(
        first,
        pass_group=np.concatenate([w.pass_group + group_base[i] for i, w in enumerate(parts)]),
        pass_step=np.concatenate([w.pass_step for w in parts]), pass_phase=np.concatenate([w.pass_phase for w in parts]),
        pass_tokens=np.concatenate([w.pass_tokens for w in parts]), pass_context=np.concatenate([w.pass_context for w in parts]),
        pass_requests=np.concatenate([w.pass_requests for w in parts]),
        pass_generated=np.concatenate([w.pass_generated for w in parts]),
        off=np.concatenate(off),
        request_ids=np.concatenate([w.request_ids for w in parts]),
        request_group=np.concatenate([w.request_group + group_base[i] for i, w in enumerate(parts)]),
        request_first_pass=np.concatenate([w.request_first_pass + pass_base[i] for i, w in enumerate(parts)]),
        weight_total=np.concatenate([w.weight_total for w in parts]),
        pass_release=(np.concatenate([w.release() for w in parts])
                      if any(w.pass_release is not None for w in parts) else None),
    )

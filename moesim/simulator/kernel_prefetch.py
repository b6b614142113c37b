"""The replay kernel's prefetch queue (SpecMD appendix A.3, :mod:`simulator.prefetchq`'s
model): proposals at a layer's routing point, waiting proposals, admission against the target
layer's earlier admissions, withdrawal at the target layer."""

from __future__ import annotations

from moesim.jit import kernel as _jit
from moesim.kernel_state import (
    ABSENT,
    C_HANDED,
    C_INSTANT,
    C_L,
    DEMAND,
    H_NKEYS,
    H_PENDMAX,
    H_POOL,
    LOG_WITHDRAWN,
    PREFETCH,
    R_ACTUAL,
    R_PFCANCEL,
    R_PFISSUED,
    R_PRED,
    R_PREDHITS,
    S_BYTES,
    S_LAYER,
    S_MARKGEN,
    S_PENDN,
    S_PFH,
    S_PFN,
    S_REC,
    S_RH,
    S_RN,
    S_TSEQ,
    S_USED,
    S_WH,
    S_WN,
    _key,
    _layer_admitted,
    _layer_gen,
    _layer_mark,
    _nbytes,
    _pending_prefetches,
    _prefetch_ring,
    _record,
    _ring,
    _row_base,
    _running_ring,
    _waiting,
)
from moesim.simulator.kernel_cache import _insert, _on_remove, _on_select, _room
from moesim.simulator.kernel_copy import _free, _submit


@_jit
def _admit(now, pin_gen, IS, K, T, W, FS, DI, A):
    """One admission round (``PrefetchQueue.admit``)."""
    size = IS[H_NKEYS]
    waiting = _waiting(IS)
    while IS[S_WN]:
        key = waiting[IS[S_WH]]  # absent (PrefetchQueue.admit)
        target = K[key].layer
        if _room(_nbytes(key, IS), True, pin_gen, target, IS, K, FS, A) == -1:
            return
        IS[S_WH] = _ring(IS[S_WH] + 1, size)
        IS[S_WN] -= 1
        K[key].queued = 0
        tid = _submit(key, PREFETCH, now, 0, IS, T, FS)
        _insert(key, tid, False, -1, IS, K, T, DI, A)
        if not IS[C_INSTANT]:
            n = IS[S_PENDN]
            if n == IS[H_PENDMAX]:
                n = _compact_pending(IS, T, W)
            pend = _pending_prefetches(IS, W)[n]
            pend.tid = tid
            pend.seq = T[tid].seq
            pend.key = key
            IS[S_PENDN] = n + 1
        K[key].adm = _layer_gen(IS)[target]
        _layer_admitted(IS)[target] = 1
        K[key].unused = 1
        IS[R_PFISSUED] += 1


@_jit
def _compact_pending(IS, T, W):
    """Drop the pending entries whose transfer has started (a withdrawal skips them)."""
    keep = 0
    pending = _pending_prefetches(IS, W)
    for j in range(IS[S_PENDN]):
        pend = pending[j]
        tid, seq = pend.tid, pend.seq
        if T[tid].seq != seq or T[tid].started or T[tid].cancelled:
            continue
        kept = pending[keep]
        kept.tid = tid
        kept.seq = seq
        kept.key = pend.key
        keep += 1
    if keep == IS[H_PENDMAX]:
        raise RuntimeError("moesim kernel: pending prefetch list full")
    IS[S_PENDN] = keep
    return keep


@_jit
def _handed(IS, T):
    """``CopyEngine.handed``: the sequence number of the last queued prefetch the host has
    issued to the copy engine (``C_HANDED`` copies at a time, counting one copying; -1: every
    one), after :func:`_advance` to now."""
    depth = IS[C_HANDED]
    if depth < 0:
        return IS[S_TSEQ]
    size = IS[H_POOL]
    left = depth
    running, pfq = _running_ring(IS), _prefetch_ring(IS)
    for j in range(IS[S_RN]):
        if T[running[_ring(IS[S_RH] + j, size)]].prio != DEMAND:
            left -= 1
    cut = -1
    h = IS[S_PFH]
    for j in range(IS[S_PFN]):
        if left <= 0:
            break
        t = pfq[_ring(h + j, size)]
        if t != -1:
            cut = T[t].seq
            left -= 1
    return cut


@_jit
def _withdraw(layer, lo, hi, now, IS, K, T, W, FS, A):
    """At ``layer``'s routing point (``PrefetchQueue.withdraw``): proposals for it or earlier still
    waiting are withdrawn, its admissions stop being pinned, and its prefetches the layer does
    not need that the host has not issued (:func:`_handed`) are withdrawn with their room (into
    the timeline at ``now`` while it records)."""
    size = IS[H_NKEYS]
    n = IS[S_WN]
    if n:
        waiting = _waiting(IS)
        h = IS[S_WH]
        m = 0
        for j in range(n):
            key = waiting[_ring(h + j, size)]
            if K[key].layer > layer:
                waiting[_ring(h + m, size)] = key
                m += 1
            else:
                K[key].queued = 0
        IS[S_WN] = m
    admitted, lgen = _layer_admitted(IS), _layer_gen(IS)
    for t in range(layer + 1):
        if admitted[t]:
            lgen[t] += 1
            admitted[t] = 0
    n = IS[S_PENDN]
    if n == 0:
        return
    IS[S_MARKGEN] += 1
    gen = IS[S_MARKGEN]
    for j in range(lo, hi):
        K[_key(j, IS, A)].mark = gen
    cut = _handed(IS, T)
    keep = 0
    pending = _pending_prefetches(IS, W)
    for j in range(n):
        pend = pending[j]
        tid, seq, key = pend.tid, pend.seq, pend.key
        if K[key].layer > layer:
            kept = pending[keep]
            kept.tid = tid
            kept.seq = seq
            kept.key = key
            keep += 1
            continue
        if (T[tid].seq != seq or T[tid].prio == DEMAND or K[key].mark == gen
                or T[tid].started or T[tid].cancelled or seq <= cut):
            continue
        # withdrawn: no bytes move, its room is given back
        T[tid].cancelled = 1
        if IS[S_REC]:
            _record(LOG_WITHDRAWN, key, T[tid].issued, now, _nbytes(key, IS), 0, 0, 0, IS, FS)
        _prefetch_ring(IS)[T[tid].pfslot] = -1
        IS[S_BYTES] -= _nbytes(key, IS)
        K[key].state = ABSENT
        K[key].tid = -1
        IS[S_USED] -= _nbytes(key, IS)
        _on_remove(key, 0, IS, K, A)
        K[key].unused = 0
        IS[R_PFCANCEL] += 1
        _free(tid, IS)
    IS[S_PENDN] = keep


@_jit
def _propose_key(key, p, IS, K, DI, A):
    """One proposal (``PrefetchQueue.propose``): counted against what its target layer needs,
    selected when cached, else queued."""
    gen = IS[S_MARKGEN]
    if K[key].mark == gen:
        return  # a repeat
    K[key].mark = gen
    target = K[key].layer
    if target <= IS[S_LAYER] or target >= IS[C_L]:
        return  # not a later layer
    IS[R_PRED] += 1
    if K[key].accpass == p:
        IS[R_PREDHITS] += 1
    marks = _layer_mark(IS)
    if marks[target] != gen:
        marks[target] = gen
        b = _row_base(p, IS) + target
        IS[R_ACTUAL] += DI[b + 1] - DI[b]
    if K[key].state != ABSENT:
        _on_select(key, IS, K, A)
    elif not K[key].queued:
        K[key].queued = 1
        size = IS[H_NKEYS]
        _waiting(IS)[_ring(IS[S_WH] + IS[S_WN], size)] = key
        IS[S_WN] += 1


@_jit
def _propose(p, layer, p0, now, pin_gen, IS, K, T, W, FS, DI, A, P):
    """The prefetcher's proposals at ``layer``'s routing point (``P``: the offsets and keys its
    compiled form made for the call's passes from ``p0``), then one admission round."""
    IS[S_MARKGEN] += 1
    poff, pkeys = P
    g = (p - p0) * IS[C_L] + layer
    for j in range(poff[g], poff[g + 1]):
        _propose_key(pkeys[j], p, IS, K, DI, A)
    if IS[S_WN]:
        _admit(now, pin_gen, IS, K, T, W, FS, DI, A)

"""The compiled replay kernel: the SimPy model's decisions and timing over flat arrays.

The SimPy process of :mod:`simulator.engine` is the reference semantics. This module replays
the same model — the lookup path (hit / late prefetch / miss, collision misses, uncached
fetches under the same pinning rule), SpecMD appendix A.3's prefetch queue (selection,
waiting proposals, admission against the target layer's earlier admissions, withdrawal at the
target layer), the copy engine (demand before prefetch, FIFO within a priority, promotion of
a queued prefetch a layer needs, non-preemptive service) and the three ``expert_compute``
modes — as numba-compiled loops over the workload's arrays, with no per-access or
per-transfer Python objects. It is bit-identical to the SimPy path on every per-pass column
(``tests/test_kernel.py`` checks a grid and hypothesis-generated scenarios).

Scope (:func:`kernel_form`): one GPU, standard routing, no budget, the ``fetch`` miss
policy; eviction ``lru``, ``fifo``, ``lfu``, ``fld``, ``score``, ``least-stale`` (both
orders), ``belady``, ``lhu``; prefetch ``none``, ``static-pin``, ``oracle``,
``previous-token``, ``lookahead``, ``next-gate-topk``, ``score-percentile`` (the last two's
proposals come as arrays, :meth:`PrefetchPolicy.proposals`). Everything else — a routing,
budget or miss policy that changes what a token computes (per-token state), random eviction
(it draws from numpy's ``Generator``), expert parallelism, a user's own policy, and a replay
that records its timeline or decisions — runs on the SimPy path.

Without numba the same functions run as plain Python (slowly); ``MOESIM_NO_KERNEL=1``
forces the SimPy path.

State lives in a few arrays: per cache key (``KI``: integer fields, ``KF``: float fields),
per transfer slot (``TI``/``TF``; slots are reused, a stored slot is checked against the
transfer's sequence number), queues (demand queue ``DQ`` in service order, the prefetch queue
``PFQ`` as a ring whose withdrawn or promoted entries are -1, the running ring ``RQ``, the
waiting proposals ``WQ``), and scalars (``S``, ``SF``). Sets that the SimPy path rebuilds
(pins, pending experts, keys evicted in this pass) are generation marks.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

try:
    from numba import njit

    HAVE_NUMBA = True
except ImportError:  # pragma: no cover - exercised where numba has no wheel
    HAVE_NUMBA = False

    def njit(*args: Any, **kwargs: Any) -> Any:  # type: ignore[no-redef]
        """Without numba the kernel runs as plain Python."""
        if args and callable(args[0]):
            return args[0]
        return lambda f: f

# eviction policies with a kernel form
EV_LRU, EV_FIFO, EV_LFU, EV_FLD, EV_SCORE, EV_LS, EV_BELADY, EV_LHU = range(8)
# prefetch proposal sources
PF_NONE, PF_ORACLE, PF_PREV, PF_LOOKAHEAD, PF_ARRAY = range(5)
MODE_LAYER, MODE_ARRIVAL, MODE_PER_EXPERT = range(3)
ABSENT, INFLIGHT, RESIDENT = 0, 1, 2
DEMAND, PREFETCH = 0, 1

# configuration (C, int64)
(C_EV, C_LS_REL, C_LS_PFCUR, C_PF, C_DEPTH, C_MODE, C_INSTANT, C_NBYTES, C_L, C_DIV, C_PREC0,
 C_PFACTIVE, C_MAXN, C_NC) = range(14)
# configuration (CF, float64)
CF_CAP, CF_DUR, CF_DECAY, CF_NCF = range(4)
# per-key integer fields (KI)
(K_STATE, K_TID, K_STATIC, K_STAMP, K_COUNT, K_CURPASS, K_PREV, K_NEXT, K_MEMB, K_PIN, K_PEND,
 K_EVICTED, K_UNUSED, K_ADM, K_QUEUED, K_MARK, K_ACCPASS, K_NKI) = range(18)
# per-key float fields (KF)
F_SCORE, F_NEXTUSE, F_NKF = range(3)
# scalars (S, int64)
(S_SEQ, S_TSEQ, S_USED, S_MAXUSED, S_BYTES, S_HEAD, S_TAIL, S_DQN, S_PFH, S_PFN, S_RH, S_RN,
 S_FREEN, S_WH, S_WN, S_PENDN, S_MEMBN, S_PINGEN, S_PENDGEN, S_PASS, S_LAYER, S_MARKGEN,
 S_SCOREPASS, S_NS) = range(24)
# scalars (SF, float64)
SF_BUSY_UNTIL, SF_BUSY, SF_NOW, SF_CARRY, SF_STALL, SF_NSF = range(6)
# transfer slots
T_KEY, T_PRIO, T_SEQ, T_STARTED, T_CANCELLED, T_BYPASS, T_PFSLOT, T_NTI = range(8)
T_ISSUED, T_START, T_DONE, T_NTF = range(4)
# per-pass columns, in engine order
COLUMNS = ("hits", "misses", "late_prefetches", "collision_misses", "uncached_fetches", "bytes",
           "prefetches_issued", "prefetches_used", "prefetch_predicted_hits", "prefetch_predicted",
           "prefetch_actual", "prefetches_cancelled", "unique_computed")
(R_HITS, R_MISSES, R_LATE, R_COLL, R_UNCACHED, R_BYTES, R_PFISSUED, R_PFUSED, R_PREDHITS,
 R_PRED, R_ACTUAL, R_PFCANCEL, R_UNIQUE, R_N) = range(14)


# -- eviction policies ----------------------------------------------------------------------
@njit(cache=True)
def _next_use(key, ai, st, C, D):  # type: ignore[no-untyped-def]
    """Belady: the next access index of ``key`` after the current one (``ai``, or the
    current (pass, layer)'s access of it, or just before the layer), as a float (inf: none)."""
    S = st[0]
    off, acc_key, kpos_off, kpos = D[0], D[1], D[4], D[5]
    a, b = kpos_off[key], kpos_off[key + 1]
    if a == b:
        return math.inf
    i = ai
    if i < 0:
        base = S[S_PASS] * C[C_L] + S[S_LAYER]
        lo, hi = off[base], off[base + 1]
        i = lo - 1
        for j in range(lo, hi):
            if acc_key[j] == key:
                i = j
                break
    # first position > i (searchsorted right)
    while a < b:
        m = (a + b) >> 1
        if kpos[m] <= i:
            a = m + 1
        else:
            b = m
    return math.inf if a == kpos_off[key + 1] else float(kpos[a])


@njit(cache=True)
def _credit(key, ai, st, C, CF, D):  # type: ignore[no-untyped-def]
    """Score eviction: add the access's gate weight (after the per-pass decay)."""
    S, KF = st[0], st[3]
    p = S[S_PASS]
    if CF[CF_DECAY] != 1.0 and p != S[S_SCOREPASS]:
        f = math.pow(CF[CF_DECAY], float(p - max(S[S_SCOREPASS], 0)))
        for k in range(KF.shape[0]):
            KF[k, F_SCORE] *= f
        S[S_SCOREPASS] = p
    w = D[2][ai] if ai >= 0 else 0.0
    KF[key, F_SCORE] = KF[key, F_SCORE] + w


@njit(cache=True)
def _list_append(key, st):  # type: ignore[no-untyped-def]
    S, KI = st[0], st[2]
    tail = S[S_TAIL]
    KI[key, K_PREV] = tail
    KI[key, K_NEXT] = -1
    if tail == -1:
        S[S_HEAD] = key
    else:
        KI[tail, K_NEXT] = key
    S[S_TAIL] = key


@njit(cache=True)
def _list_unlink(key, st):  # type: ignore[no-untyped-def]
    S, KI = st[0], st[2]
    prv, nxt = KI[key, K_PREV], KI[key, K_NEXT]
    if prv == -1:
        S[S_HEAD] = nxt
    else:
        KI[prv, K_NEXT] = nxt
    if nxt == -1:
        S[S_TAIL] = prv
    else:
        KI[nxt, K_PREV] = prv


@njit(cache=True)
def _stamp(key, st):  # type: ignore[no-untyped-def]
    S, KI = st[0], st[2]
    S[S_SEQ] += 1
    KI[key, K_STAMP] = S[S_SEQ]


@njit(cache=True)
def _on_insert(key, demand, ai, st, C, CF, D):  # type: ignore[no-untyped-def]
    """The policy's ``on_insert``: ``key`` entered the cache (``demand``: a use)."""
    S, KI, KF, MEMB = st[0], st[2], st[3], st[12]
    n = S[S_MEMBN]
    MEMB[n] = key
    KI[key, K_MEMB] = n
    S[S_MEMBN] = n + 1
    ev = C[C_EV]
    _stamp(key, st)
    if ev == EV_LRU or ev == EV_FIFO:
        _list_append(key, st)
    elif ev == EV_LFU:
        if demand:
            KI[key, K_COUNT] += 1
    elif ev == EV_SCORE:
        if demand:
            _credit(key, ai, st, C, CF, D)
    elif ev == EV_BELADY:
        KF[key, F_NEXTUSE] = _next_use(key, ai, st, C, D)
    elif ev == EV_LS:
        KI[key, K_CURPASS] = S[S_PASS]
    elif ev == EV_LHU:
        if demand and C[C_PREC0]:
            KI[key, K_COUNT] += 1


@njit(cache=True)
def _on_access(key, ai, st, C, CF, D):  # type: ignore[no-untyped-def]
    """The policy's ``on_access``: a hit or a late prefetch used ``key``."""
    S, KI, KF = st[0], st[2], st[3]
    ev = C[C_EV]
    if ev == EV_LRU:
        _list_unlink(key, st)
        _list_append(key, st)
    elif ev == EV_FIFO:
        return
    elif ev == EV_LFU:
        KI[key, K_COUNT] += 1
        _stamp(key, st)
    elif ev == EV_FLD:
        _stamp(key, st)
    elif ev == EV_SCORE:
        _stamp(key, st)
        _credit(key, ai, st, C, CF, D)
    elif ev == EV_LHU:
        _stamp(key, st)
        if C[C_PREC0]:
            KI[key, K_COUNT] += 1
    elif ev == EV_BELADY:
        KF[key, F_NEXTUSE] = _next_use(key, ai, st, C, D)
    elif ev == EV_LS:
        if KI[key, K_CURPASS] != S[S_PASS]:
            KI[key, K_CURPASS] = S[S_PASS]
            _stamp(key, st)


@njit(cache=True)
def _on_remove(key, st, C):  # type: ignore[no-untyped-def]
    S, KI, MEMB = st[0], st[2], st[12]
    i = KI[key, K_MEMB]
    last = MEMB[S[S_MEMBN] - 1]
    MEMB[i] = last
    KI[last, K_MEMB] = i
    S[S_MEMBN] -= 1
    KI[key, K_MEMB] = -1
    if C[C_EV] == EV_LRU or C[C_EV] == EV_FIFO:
        _list_unlink(key, st)


@njit(cache=True)
def _order(key, st, C):  # type: ignore[no-untyped-def]
    """The policy's candidate order of ``key`` as (float, int, stamp): smaller goes first."""
    S, KI, KF = st[0], st[2], st[3]
    ev = C[C_EV]
    stamp = KI[key, K_STAMP]
    if ev == EV_LFU:
        return 0.0, KI[key, K_COUNT], stamp
    if ev == EV_FLD:
        return -float(abs(key // C[C_DIV] - S[S_LAYER])), 0, stamp
    if ev == EV_SCORE:
        return KF[key, F_SCORE], 0, stamp
    if ev == EV_LHU:
        return 0.0, (KI[key, K_COUNT] + 1) if C[C_PREC0] else 0, stamp
    if ev == EV_BELADY:
        return -KF[key, F_NEXTUSE], 0, stamp
    # least-stale: stale queue, then current; per queue the layer order, then FIFO
    num_l = C[C_L]
    layer = key // C[C_DIV]
    queue = 1 if KI[key, K_CURPASS] == S[S_PASS] else 0
    if C[C_LS_REL]:
        cur = S[S_LAYER]
        if layer < cur:
            rank = layer
        elif layer > cur:
            rank = cur + num_l - layer
        elif KI[key, K_PEND] == S[S_PENDGEN]:
            rank = num_l + 1
        else:
            rank = cur
    else:
        rank = layer
    return 0.0, queue * (num_l + 2) + rank, stamp


@njit(cache=True)
def _eligible(key, pin_gen, adm_layer, st, C):  # type: ignore[no-untyped-def]
    KI, LGEN = st[2], st[13]
    if KI[key, K_STATE] != RESIDENT or KI[key, K_PIN] == pin_gen or KI[key, K_STATIC]:
        return False
    if adm_layer >= 0 and key // C[C_DIV] == adm_layer and KI[key, K_ADM] == LGEN[adm_layer]:
        return False
    return True


@njit(cache=True)
def _victim(for_prefetch, pin_gen, adm_layer, st, C):  # type: ignore[no-untyped-def]
    """The first candidate, in the policy's order, that the cache may evict (resident, not
    pinned, not statically pinned, not an earlier admission for ``adm_layer``), or -1."""
    S, KI, MEMB = st[0], st[2], st[12]
    ev = C[C_EV]
    if ev == EV_LRU or ev == EV_FIFO:
        key = S[S_HEAD]
        while key != -1:
            if _eligible(key, pin_gen, adm_layer, st, C):
                return key
            key = KI[key, K_NEXT]
        return -1
    stale_only = ev == EV_LS and for_prefetch and not C[C_LS_PFCUR]
    best = -1
    bf, bi, bs = 0.0, 0, 0
    for j in range(S[S_MEMBN]):
        key = MEMB[j]
        if not _eligible(key, pin_gen, adm_layer, st, C):
            continue
        if stale_only and KI[key, K_CURPASS] == S[S_PASS]:
            continue
        f, i, s = _order(key, st, C)
        if best == -1 or f < bf or (f == bf and (i < bi or (i == bi and s < bs))):
            best, bf, bi, bs = key, f, i, s
    return best


# -- the cache and the copy engine ------------------------------------------------------------
@njit(cache=True)
def _evict(key, st, C):  # type: ignore[no-untyped-def]
    S, KI = st[0], st[2]
    KI[key, K_STATE] = ABSENT
    S[S_USED] -= C[C_NBYTES]
    _on_remove(key, st, C)
    KI[key, K_UNUSED] = 0
    KI[key, K_EVICTED] = S[S_PASS]


@njit(cache=True)
def _room(for_prefetch, pin_gen, adm_layer, st, C, CF):  # type: ignore[no-untyped-def]
    """Make room for one expert (every entry of the kernel's scope has the same size, so one
    victim is enough): -2 (it fits), the victim evicted, or -1 (no room; nothing changed)."""
    S = st[0]
    nb = C[C_NBYTES]
    if nb <= CF[CF_CAP] - S[S_USED]:
        return -2
    if nb > CF[CF_CAP]:
        return -1
    v = _victim(for_prefetch, pin_gen, adm_layer, st, C)
    if v == -1:
        return -1
    _evict(v, st, C)
    return v


@njit(cache=True)
def _submit(key, prio, now, bypass, st, C, CF):  # type: ignore[no-untyped-def]
    """Queue a transfer on the copy engine; returns its slot."""
    S, SF, TI, TF, DQ, PFQ, FREE = st[0], st[1], st[4], st[5], st[6], st[7], st[9]
    if S[S_FREEN] == 0:
        raise RuntimeError("moesim kernel: transfer slots exhausted")
    S[S_FREEN] -= 1
    tid = FREE[S[S_FREEN]]
    TI[tid, T_KEY] = key
    TI[tid, T_PRIO] = prio
    TI[tid, T_SEQ] = S[S_TSEQ]
    S[S_TSEQ] += 1
    TI[tid, T_STARTED] = 0
    TI[tid, T_CANCELLED] = 0
    TI[tid, T_BYPASS] = bypass
    TI[tid, T_PFSLOT] = -1
    TF[tid, T_ISSUED] = now
    TF[tid, T_START] = now
    TF[tid, T_DONE] = now
    S[S_BYTES] += C[C_NBYTES]
    if C[C_INSTANT]:
        TI[tid, T_STARTED] = 1
    elif prio == DEMAND:
        n = S[S_DQN]
        prev = TF[DQ[n - 1], T_DONE] if n else SF[SF_BUSY_UNTIL]
        start = prev if prev > now else now
        TF[tid, T_START] = start
        TF[tid, T_DONE] = start + CF[CF_DUR]
        DQ[n] = tid
        S[S_DQN] = n + 1
    else:
        size = PFQ.shape[0]
        if S[S_PFN] == size:  # drop the tombstones
            h, n = S[S_PFH], S[S_PFN]
            keep = np.empty(size, np.int64)
            m = 0
            for j in range(n):
                t = PFQ[(h + j) % size]
                if t != -1:
                    keep[m] = t
                    m += 1
            for j in range(m):
                PFQ[j] = keep[j]
                TI[keep[j], T_PFSLOT] = j
            S[S_PFH] = 0
            S[S_PFN] = m
            if m == size:
                raise RuntimeError("moesim kernel: prefetch queue full")
        slot = (S[S_PFH] + S[S_PFN]) % size
        PFQ[slot] = tid
        TI[tid, T_PFSLOT] = slot
        S[S_PFN] += 1
    return tid


@njit(cache=True)
def _free(tid, st):  # type: ignore[no-untyped-def]
    S, FREE = st[0], st[9]
    FREE[S[S_FREEN]] = tid
    S[S_FREEN] += 1


@njit(cache=True)
def _project(first, st, CF):  # type: ignore[no-untyped-def]
    S, SF, TF, DQ = st[0], st[1], st[5], st[6]
    prev = TF[DQ[first - 1], T_DONE] if first else SF[SF_BUSY_UNTIL]
    for i in range(first, S[S_DQN]):
        t = DQ[i]
        issued = TF[t, T_ISSUED]
        start = prev if prev > issued else issued
        TF[t, T_START] = start
        prev = start + CF[CF_DUR]
        TF[t, T_DONE] = prev


@njit(cache=True)
def _promote(tid, st, CF):  # type: ignore[no-untyped-def]
    """A queued prefetch is needed now: it joins the demand queue by issue order."""
    S, TI, DQ, PFQ = st[0], st[4], st[6], st[7]
    if TI[tid, T_STARTED] or TI[tid, T_PRIO] == DEMAND or TI[tid, T_CANCELLED]:
        return
    TI[tid, T_PRIO] = DEMAND
    PFQ[TI[tid, T_PFSLOT]] = -1
    n = S[S_DQN]
    i = n
    seq = TI[tid, T_SEQ]
    while i > 0 and TI[DQ[i - 1], T_SEQ] > seq:
        DQ[i] = DQ[i - 1]
        i -= 1
    DQ[i] = tid
    S[S_DQN] = n + 1
    _project(i, st, CF)


@njit(cache=True)
def _complete(tid, st):  # type: ignore[no-untyped-def]
    KI, TI = st[2], st[4]
    if not TI[tid, T_BYPASS]:
        key = TI[tid, T_KEY]
        KI[key, K_STATE] = RESIDENT
        KI[key, K_TID] = -1
    _free(tid, st)


@njit(cache=True)
def _advance(now, st, CF):  # type: ignore[no-untyped-def]
    """Start the transfers whose start time is before ``now``; complete those done by it."""
    S, SF, TI, TF, DQ, PFQ, RQ = st[0], st[1], st[4], st[5], st[6], st[7], st[8]
    size = RQ.shape[0]
    prev = SF[SF_BUSY_UNTIL]
    n = S[S_DQN]
    started = 0
    while started < n:
        t = DQ[started]
        if TF[t, T_START] >= now:
            break
        prev = TF[t, T_DONE]
        TI[t, T_STARTED] = 1
        RQ[(S[S_RH] + S[S_RN]) % size] = t
        S[S_RN] += 1
        SF[SF_BUSY] += TF[t, T_DONE] - TF[t, T_START]
        started += 1
    if started:
        for i in range(started, n):
            DQ[i - started] = DQ[i]
        S[S_DQN] = n - started
    if S[S_DQN] == 0:
        psize = PFQ.shape[0]
        while S[S_PFN]:
            t = PFQ[S[S_PFH]]
            if t == -1:
                S[S_PFH] = (S[S_PFH] + 1) % psize
                S[S_PFN] -= 1
                continue
            issued = TF[t, T_ISSUED]
            start = prev if prev > issued else issued
            if start >= now:
                break
            S[S_PFH] = (S[S_PFH] + 1) % psize
            S[S_PFN] -= 1
            TF[t, T_START] = start
            prev = start + CF[CF_DUR]
            TF[t, T_DONE] = prev
            TI[t, T_STARTED] = 1
            RQ[(S[S_RH] + S[S_RN]) % size] = t
            S[S_RN] += 1
            SF[SF_BUSY] += prev - start
    SF[SF_BUSY_UNTIL] = prev
    while S[S_RN] and TF[RQ[S[S_RH]], T_DONE] <= now:
        t = RQ[S[S_RH]]
        S[S_RH] = (S[S_RH] + 1) % size
        S[S_RN] -= 1
        _complete(t, st)


@njit(cache=True)
def _arrival(tid, seq, now, st):  # type: ignore[no-untyped-def]
    """When a run's expert is on the GPU (``now`` if it was resident or its transfer is done)."""
    TI, TF = st[4], st[5]
    if tid < 0 or TI[tid, T_SEQ] != seq:
        return now
    done = TF[tid, T_DONE]
    return now if done < now else done


@njit(cache=True)
def _insert(key, tid, demand, ai, st, C, CF, D):  # type: ignore[no-untyped-def]
    """The cache's ``reserve``: an in-flight entry for ``key`` (room was made)."""
    S, KI = st[0], st[2]
    KI[key, K_STATE] = INFLIGHT
    KI[key, K_TID] = tid
    S[S_USED] += C[C_NBYTES]
    if S[S_USED] > S[S_MAXUSED]:
        S[S_MAXUSED] = S[S_USED]
    _on_insert(key, demand, ai, st, C, CF, D)
    if C[C_INSTANT]:
        _complete(tid, st)


# -- the lookup path ---------------------------------------------------------------------------
@njit(cache=True)
def _used_prefetch(key, row, st):  # type: ignore[no-untyped-def]
    KI = st[2]
    if KI[key, K_UNUSED]:
        KI[key, K_UNUSED] = 0
        row[R_PFUSED] += 1


@njit(cache=True)
def _lookup(ai, now, pin_gen, row, st, C, CF, D):  # type: ignore[no-untyped-def]
    """Look access ``ai`` up (engine's ``LayerLookup.lookup``, plain path); returns the slot
    of the transfer its run waits for, or -1."""
    S, KI, TI = st[0], st[2], st[4]
    key = D[1][ai]
    state = KI[key, K_STATE]
    if state == RESIDENT:
        row[R_HITS] += 1
        _on_access(key, ai, st, C, CF, D)
        _used_prefetch(key, row, st)
        return -1
    if state == INFLIGHT:
        row[R_LATE] += 1
        _on_access(key, ai, st, C, CF, D)
        _used_prefetch(key, row, st)
        tid = KI[key, K_TID]
        if TI[tid, T_PRIO] != DEMAND and not TI[tid, T_STARTED]:
            _promote(tid, st, CF)
        return tid
    row[R_MISSES] += 1
    if KI[key, K_EVICTED] == S[S_PASS]:
        row[R_COLL] += 1
    if _room(False, pin_gen, -1, st, C, CF) != -1:
        KI[key, K_PIN] = pin_gen
        tid = _submit(key, DEMAND, now, 0, st, C, CF)
        _insert(key, tid, True, ai, st, C, CF, D)
        return -1 if C[C_INSTANT] else tid
    tid = _submit(key, DEMAND, now, 1, st, C, CF)
    row[R_UNCACHED] += 1
    if C[C_INSTANT]:
        _free(tid, st)
        return -1
    return tid


# -- prefetch: SpecMD appendix A.3's queue ------------------------------------------------------
@njit(cache=True)
def _admit(now, pin_gen, row, st, C, CF, D):  # type: ignore[no-untyped-def]
    """One admission round (engine's ``_admit``)."""
    S, KI, WQ, PENDA, LGEN, LADM = st[0], st[2], st[10], st[11], st[13], st[14]
    size = WQ.shape[0]
    while S[S_WN]:
        key = WQ[S[S_WH]]
        if KI[key, K_STATE] != ABSENT:
            S[S_WH] = (S[S_WH] + 1) % size
            S[S_WN] -= 1
            KI[key, K_QUEUED] = 0
            continue
        target = key // C[C_DIV]
        v = _room(True, pin_gen, target, st, C, CF)
        if v == -1:
            return
        S[S_WH] = (S[S_WH] + 1) % size
        S[S_WN] -= 1
        KI[key, K_QUEUED] = 0
        if v >= 0:  # no longer an admission of its target layer
            KI[v, K_ADM] = 0
        tid = _submit(key, PREFETCH, now, 0, st, C, CF)
        _insert(key, tid, False, -1, st, C, CF, D)
        if not C[C_INSTANT]:
            n = S[S_PENDN]
            if n == PENDA.shape[0]:
                n = _compact_pending(st)
            PENDA[n, 0] = tid
            PENDA[n, 1] = st[4][tid, T_SEQ]
            PENDA[n, 2] = key
            S[S_PENDN] = n + 1
        KI[key, K_ADM] = LGEN[target]
        LADM[target] = 1
        KI[key, K_UNUSED] = 1
        row[R_PFISSUED] += 1


@njit(cache=True)
def _compact_pending(st):  # type: ignore[no-untyped-def]
    """Drop the pending entries whose transfer has started (a withdrawal skips them)."""
    S, TI, PENDA = st[0], st[4], st[11]
    keep = 0
    for j in range(S[S_PENDN]):
        tid, seq = PENDA[j, 0], PENDA[j, 1]
        if TI[tid, T_SEQ] != seq or TI[tid, T_STARTED] or TI[tid, T_CANCELLED]:
            continue
        PENDA[keep, 0] = tid
        PENDA[keep, 1] = seq
        PENDA[keep, 2] = PENDA[j, 2]
        keep += 1
    if keep == PENDA.shape[0]:
        raise RuntimeError("moesim kernel: pending prefetch list full")
    S[S_PENDN] = keep
    return keep


@njit(cache=True)
def _withdraw(layer, lo, hi, row, st, C, D):  # type: ignore[no-untyped-def]
    """At ``layer``'s routing point (engine's ``_withdraw``): proposals for it or earlier still
    waiting are withdrawn, its admissions stop being pinned, and its queued prefetches the
    layer does not need are withdrawn with their room."""
    S, KI, TI, PFQ, WQ, PENDA, LGEN, LADM = (st[0], st[2], st[4], st[7], st[10], st[11], st[13],
                                             st[14])
    div = C[C_DIV]
    size = WQ.shape[0]
    n = S[S_WN]
    if n:
        h = S[S_WH]
        m = 0
        for j in range(n):
            key = WQ[(h + j) % size]
            if key // div > layer:
                WQ[(h + m) % size] = key
                m += 1
            else:
                KI[key, K_QUEUED] = 0
        S[S_WN] = m
    for t in range(layer + 1):
        if LADM[t]:
            LGEN[t] += 1
            LADM[t] = 0
    n = S[S_PENDN]
    if n == 0:
        return
    S[S_MARKGEN] += 1
    gen = S[S_MARKGEN]
    acc_key = D[1]
    for j in range(lo, hi):
        KI[acc_key[j], K_MARK] = gen
    keep = 0
    for j in range(n):
        tid, seq, key = PENDA[j, 0], PENDA[j, 1], PENDA[j, 2]
        if key // div > layer:
            PENDA[keep, 0] = tid
            PENDA[keep, 1] = seq
            PENDA[keep, 2] = key
            keep += 1
            continue
        if (TI[tid, T_SEQ] != seq or TI[tid, T_PRIO] == DEMAND or KI[key, K_MARK] == gen
                or TI[tid, T_STARTED] or TI[tid, T_CANCELLED]):
            continue
        # withdrawn: no bytes move, its room is given back
        TI[tid, T_CANCELLED] = 1
        PFQ[TI[tid, T_PFSLOT]] = -1
        S[S_BYTES] -= C[C_NBYTES]
        KI[key, K_STATE] = ABSENT
        KI[key, K_TID] = -1
        S[S_USED] -= C[C_NBYTES]
        _on_remove(key, st, C)
        KI[key, K_UNUSED] = 0
        row[R_PFCANCEL] += 1
        _free(tid, st)
    S[S_PENDN] = keep


@njit(cache=True)
def _propose_key(key, p, row, st, C, CF, D):  # type: ignore[no-untyped-def]
    """One proposal (engine's ``_propose``): counted against what its target layer needs,
    selected when cached, else queued."""
    S, KI, WQ, LMARK = st[0], st[2], st[10], st[15]
    gen = S[S_MARKGEN]
    if KI[key, K_MARK] == gen:
        return  # a repeat
    KI[key, K_MARK] = gen
    div = C[C_DIV]
    target = key // div
    if target <= S[S_LAYER] or target >= C[C_L]:
        return  # not a later layer
    row[R_PRED] += 1
    if KI[key, K_ACCPASS] == p:
        row[R_PREDHITS] += 1
    if LMARK[target] != gen:
        LMARK[target] = gen
        off = D[0]
        b = p * C[C_L] + target
        row[R_ACTUAL] += off[b + 1] - off[b]
    if KI[key, K_STATE] != ABSENT:
        if C[C_EV] == EV_LS:  # a selection is a use for least-stale only
            _on_access(key, -1, st, C, CF, D)
    elif not KI[key, K_QUEUED]:
        KI[key, K_QUEUED] = 1
        size = WQ.shape[0]
        WQ[(S[S_WH] + S[S_WN]) % size] = key
        S[S_WN] += 1


@njit(cache=True)
def _propose(p, layer, p0, now, pin_gen, row, st, C, CF, D, P):  # type: ignore[no-untyped-def]
    """The prefetcher's proposals at ``layer``'s routing point, then one admission round."""
    S = st[0]
    off, acc_key, group = D[0], D[1], D[6]
    num_l = C[C_L]
    kind = C[C_PF]
    S[S_MARKGEN] += 1
    if kind == PF_ARRAY:
        poff, pkeys = P
        g = (p - p0) * num_l + layer
        for j in range(poff[g], poff[g + 1]):
            _propose_key(pkeys[j], p, row, st, C, CF, D)
    else:
        src = p
        if kind != PF_ORACLE:
            src = p - 1 if p > 0 and group[p - 1] == group[p] else -1
        last = layer + 2 if kind != PF_LOOKAHEAD else layer + 1 + C[C_DEPTH]
        if last > num_l:
            last = num_l
        if src >= 0:
            for t in range(layer + 1, last):
                b = src * num_l + t
                for j in range(off[b], off[b + 1]):
                    _propose_key(acc_key[j], p, row, st, C, CF, D)
    if S[S_WN]:
        _admit(now, pin_gen, row, st, C, CF, D)


# -- the compute stream ---------------------------------------------------------------------------
@njit(cache=True)
def _new_gen(st, which):  # type: ignore[no-untyped-def]
    S = st[0]
    S[which] += 1
    return S[which]


@njit(cache=True)
def _layer(p, layer, lo, hi, now, p0, row, runs, scr, st, C, CF, D, P):  # type: ignore[no-untyped-def]
    """``layer`` and ``on-arrival`` execution of one layer (engine's ``_run`` body and
    ``_compute``); returns the layer's end. Stall accumulates in ``SF[SF_STALL]``."""
    S, SF, KI, TI = st[0], st[1], st[2], st[4]
    acc_key, acc_ffn = D[1], D[3]
    pend = _new_gen(st, S_PENDGEN)
    for j in range(lo, hi):
        KI[acc_key[j], K_PEND] = pend
    if C[C_PFACTIVE]:
        _withdraw(layer, lo, hi, row, st, C, D)
    pins = _new_gen(st, S_PINGEN)
    for j in range(lo, hi):
        KI[acc_key[j], K_PIN] = pins
    n = hi - lo
    for i in range(n):
        tid = _lookup(lo + i, now, pins, row, st, C, CF, D)
        runs[i, 0] = tid
        runs[i, 1] = TI[tid, T_SEQ] if tid >= 0 else -1
    if C[C_PFACTIVE]:
        _propose(p, layer, p0, now, pins, row, st, C, CF, D, P)
    if C[C_MODE] == MODE_LAYER:
        ready = now
        total = 0.0
        for i in range(n):
            a = _arrival(runs[i, 0], runs[i, 1], now, st)
            if a > ready:
                ready = a
            total += acc_ffn[lo + i]
        SF[SF_STALL] += ready - now
        end = ready + total
    else:  # on-arrival: in arrival order (ties by compute time), each when it has arrived
        arr = scr[0]
        ffn = scr[1]
        for i in range(n):
            a = _arrival(runs[i, 0], runs[i, 1], now, st)
            f = acc_ffn[lo + i]
            j = i
            while j > 0 and (arr[j - 1] > a or (arr[j - 1] == a and ffn[j - 1] > f)):
                arr[j] = arr[j - 1]
                ffn[j] = ffn[j - 1]
                j -= 1
            arr[j] = a
            ffn[j] = f
        t = now
        for i in range(n):
            if arr[i] > t:
                SF[SF_STALL] += arr[i] - t
                t = arr[i]
            t += ffn[i]
        end = t
    _new_gen(st, S_PENDGEN)  # the layer's experts have run
    if S[S_WN]:
        _advance(end, st, CF)
        _admit(end, _new_gen(st, S_PINGEN), row, st, C, CF, D)
    row[R_UNIQUE] += n
    return end


@njit(cache=True)
def _per_expert(p, layer, lo, hi, now, p0, row, st, C, CF, D, P):  # type: ignore[no-untyped-def]
    """``per-expert`` execution of one layer (engine's ``_per_expert``): the experts run one
    after another in router order, expert j+1 looked up when expert j starts."""
    S, SF, KI, TI = st[0], st[1], st[2], st[4]
    acc_key, acc_ffn = D[1], D[3]
    timed = not C[C_INSTANT]
    pend = _new_gen(st, S_PENDGEN)
    for j in range(lo, hi):
        KI[acc_key[j], K_PEND] = pend
    if C[C_PFACTIVE]:
        _withdraw(layer, lo, hi, row, st, C, D)
        _propose(p, layer, p0, now, _new_gen(st, S_PINGEN), row, st, C, CF, D, P)
    n = hi - lo
    t = now
    cur = -1
    cur_seq = -1
    if n:
        cur = _lookup(lo, t, _new_gen(st, S_PINGEN), row, st, C, CF, D)
        cur_seq = TI[cur, T_SEQ] if cur >= 0 else -1
    for i in range(n):
        a = _arrival(cur, cur_seq, t, st)
        if a > t:
            SF[SF_STALL] += a - t
            t = a
        if timed:
            _advance(t, st, CF)
        nxt = -1
        nxt_seq = -1
        if i + 1 < n:
            pins = _new_gen(st, S_PINGEN)
            KI[acc_key[lo + i], K_PIN] = pins  # the running expert
            nxt = _lookup(lo + i + 1, t, pins, row, st, C, CF, D)
            nxt_seq = TI[nxt, T_SEQ] if nxt >= 0 else -1
        t += acc_ffn[lo + i]
        if timed:
            _advance(t, st, CF)
        KI[acc_key[lo + i], K_PEND] = 0  # expert i has run
        if S[S_WN]:
            pins = _new_gen(st, S_PINGEN)
            if i + 1 < n:
                KI[acc_key[lo + i + 1], K_PIN] = pins
            _admit(t, pins, row, st, C, CF, D)
        cur, cur_seq = nxt, nxt_seq
    row[R_UNIQUE] += n
    return t


@njit(cache=True)
def replay_passes(p0, p1, st, C, CF, D, P, nonexp, cols, t_start, t_end, stall):  # type: ignore[no-untyped-def]
    """Replay forward passes ``p0 .. p1`` (engine's ``_run``): per layer, non-expert compute,
    the routing point's lookups and proposals, expert compute; per pass, one row."""
    S, SF, KI = st[0], st[1], st[2]
    off, acc_key = D[0], D[1]
    num_l = C[C_L]
    runs = np.empty((max(1, C[C_MAXN]), 2), np.int64)
    scr = np.empty((2, max(1, C[C_MAXN])))
    now = SF[SF_NOW]
    carry = SF[SF_CARRY]
    for p in range(p0, p1):
        S[S_PASS] = p
        t_start[p] = now
        row = cols[p - p0]
        bytes0 = S[S_BYTES]
        SF[SF_STALL] = 0.0
        ne = nonexp[p]
        base = p * num_l
        if C[C_PFACTIVE]:
            for j in range(off[base], off[base + num_l]):
                KI[acc_key[j], K_ACCPASS] = p
        for layer in range(num_l):
            delay = carry + ne
            if delay > 0:
                now = now + delay
            carry = 0.0
            lo, hi = off[base + layer], off[base + layer + 1]
            if lo == hi:
                continue  # no routing for this (pass, layer): the layer is skipped
            _advance(now, st, CF)
            S[S_LAYER] = layer
            if C[C_MODE] == MODE_PER_EXPERT:
                end = _per_expert(p, layer, lo, hi, now, p0, row, st, C, CF, D, P)
            else:
                end = _layer(p, layer, lo, hi, now, p0, row, runs, scr, st, C, CF, D, P)
            carry = end - now
        if carry > 0:
            now = now + carry
            carry = 0.0
        _advance(now, st, CF)
        t_end[p] = now
        stall[p] = SF[SF_STALL]
        row[R_BYTES] = S[S_BYTES] - bytes0
    SF[SF_NOW] = now
    SF[SF_CARRY] = carry


@njit(cache=True)
def _preload(keys, st, C, CF, D):  # type: ignore[no-untyped-def]
    """Static pinning (the cache's ``preload``): resident before the replay, never evicted."""
    S, KI = st[0], st[2]
    nb = C[C_NBYTES]
    loaded = 0
    for key in keys:
        if KI[key, K_STATE] == RESIDENT or S[S_USED] + nb > CF[CF_CAP]:
            continue
        KI[key, K_STATE] = RESIDENT
        S[S_USED] += nb
        KI[key, K_STATIC] = 1
        _on_insert(key, False, -1, st, C, CF, D)
        loaded += 1
    if S[S_USED] > S[S_MAXUSED]:
        S[S_MAXUSED] = S[S_USED]
    return loaded


@njit(cache=True)
def _finish(st, CF):  # type: ignore[no-untyped-def]
    _advance(math.inf, st, CF)


# -- dispatch --------------------------------------------------------------------------------------
def _policy_codes() -> tuple[dict[type, int], dict[type, int]]:
    from moesim.policies import eviction as ev
    from moesim.policies import prefetch as pf

    evictions = {ev.LRU: EV_LRU, ev.FIFO: EV_FIFO, ev.LFU: EV_LFU, ev.FarthestLayerDistance: EV_FLD,
                 ev.ScoreBased: EV_SCORE, ev.LeastStale: EV_LS, ev.Belady: EV_BELADY,
                 ev.LeastHighPrecisionUsed: EV_LHU}
    prefetchers = {pf.NoPrefetch: PF_NONE, pf.StaticPin: PF_NONE, pf.Oracle: PF_ORACLE,
                   pf.PreviousToken: PF_PREV, pf.Lookahead: PF_LOOKAHEAD, pf.NextGateTopK: PF_ARRAY,
                   pf.ScorePercentile: PF_ARRAY}
    return evictions, prefetchers


def kernel_form(sim: Any) -> str | None:
    """Why ``sim`` (a :class:`simulator.engine.Simulation`) replays on the SimPy path, or
    None when the kernel has a form for every one of its policies."""
    from moesim.policies.miss import Fetch

    if os.environ.get("MOESIM_NO_KERNEL", "") not in ("", "0"):
        return "MOESIM_NO_KERNEL is set"
    if sim.transfers is not None or sim.layer_log is not None or sim.decisions is not None:
        return "the replay records its timeline or decisions"
    if sim.scenario.hardware.gpus > 1:
        return "expert parallelism"
    if sim.routing.changes_routing or sim.budget.restricts or type(sim.miss) is not Fetch:
        return "a routing, budget or miss policy that changes what tokens compute"
    evictions, prefetchers = _policy_codes()
    if type(sim.eviction) not in evictions:
        return f"eviction policy '{sim.scenario.policies.eviction.name}' has no kernel form"
    if type(sim.prefetch) not in prefetchers:
        return f"prefetch policy '{sim.scenario.policies.prefetch.name}' has no kernel form"
    return None


CHUNK = 256  # passes per kernel call (progress is reported between calls)


def _belady_positions(keys: np.ndarray, num_keys: int) -> tuple[np.ndarray, np.ndarray]:
    """Every key's access indices, ascending, as CSR arrays."""
    order = np.argsort(keys, kind="stable").astype(np.int64)
    counts = np.bincount(keys, minlength=num_keys)
    kpos_off = np.zeros(num_keys + 1, np.int64)
    np.cumsum(counts, out=kpos_off[1:])
    return kpos_off, order


def replay(sim: Any) -> None:
    """Replay ``sim`` with the kernel, filling its per-pass arrays, the copy engine's busy
    time and bytes, and the cache's high-water mark, as its SimPy process would."""
    from moesim.policies.eviction import LeastStale, ScoreBased
    from moesim.policies.prefetch import Lookahead

    evictions, prefetchers = _policy_codes()
    wl, model = sim.wl, sim.model
    num_l = model.num_layers
    div = model.num_experts * sim.num_prec
    num_keys = num_l * div
    sim._prepare_costs()
    acc_key = np.ascontiguousarray(sim.acc_keys, dtype=np.int64)
    off = np.ascontiguousarray(wl.off, dtype=np.int64)
    maxn = int(np.diff(off).max(initial=0))
    ev = evictions[type(sim.eviction)]
    pf = prefetchers[type(sim.prefetch)]
    params = sim.eviction.params
    C = np.zeros(C_NC, np.int64)
    C[C_EV] = ev
    C[C_LS_REL] = isinstance(sim.eviction, LeastStale) and params.order == "relative"
    C[C_LS_PFCUR] = isinstance(sim.eviction, LeastStale) and params.prefetch_evicts_current
    C[C_PF] = pf
    C[C_DEPTH] = sim.prefetch.params.depth if isinstance(sim.prefetch, Lookahead) else 0
    C[C_MODE] = {"layer": MODE_LAYER, "on-arrival": MODE_ARRIVAL, "per-expert": MODE_PER_EXPERT}[
        sim.scenario.expert_compute]
    C[C_INSTANT] = not sim.scenario.timing
    C[C_NBYTES] = sim.expert_bytes
    C[C_L] = num_l
    C[C_DIV] = div
    C[C_PREC0] = sim.default_prec == 0
    C[C_PFACTIVE] = sim.prefetch.active
    C[C_MAXN] = maxn
    CF = np.zeros(CF_NCF)
    CF[CF_CAP] = float(sim.capacity)
    CF[CF_DUR] = sim.copy.duration(sim.expert_bytes)
    CF[CF_DECAY] = params.decay if isinstance(sim.eviction, ScoreBased) else 1.0
    empty = np.zeros(1, np.int64)
    kpos_off, kpos = _belady_positions(acc_key, num_keys) if ev == EV_BELADY else (empty, empty)
    D = (off, acc_key, np.ascontiguousarray(wl.acc_weight, dtype=np.float64),
         np.ascontiguousarray(sim.acc_ffn, dtype=np.float64), kpos_off, kpos,
         np.ascontiguousarray(wl.pass_group, dtype=np.int64))
    pool = num_keys + maxn + 16
    S = np.zeros(S_NS, np.int64)
    S[S_HEAD] = S[S_TAIL] = -1
    S[S_PINGEN] = S[S_PENDGEN] = S[S_MARKGEN] = 1
    S[S_SCOREPASS] = -1
    S[S_FREEN] = pool
    KI = np.zeros((num_keys, K_NKI), np.int64)
    for col in (K_TID, K_CURPASS, K_PREV, K_NEXT, K_MEMB, K_EVICTED, K_ACCPASS):
        KI[:, col] = -1
    st = (S, np.zeros(SF_NSF), KI, np.zeros((num_keys, F_NKF)), np.zeros((pool, T_NTI), np.int64),
          np.zeros((pool, T_NTF)), np.zeros(pool, np.int64), np.zeros(pool, np.int64),
          np.zeros(pool, np.int64), np.arange(pool - 1, -1, -1, dtype=np.int64),
          np.zeros(num_keys, np.int64), np.zeros((num_keys + 16, 3), np.int64),
          np.zeros(num_keys, np.int64), np.ones(num_l, np.int64), np.zeros(num_l, np.int64),
          np.zeros(num_l, np.int64))
    pinned = [int(k) for k in sim.prefetch.pinned()]
    if pinned:
        _preload(np.asarray(pinned, np.int64), st, C, CF, D)
    n_pass = wl.num_passes
    nonexp = np.asarray(sim._nonexp, dtype=np.float64)
    cols = np.zeros((n_pass, R_N), np.int64)
    t_start, t_end, stall = np.zeros(n_pass), np.zeros(n_pass), np.zeros(n_pass)
    no_props = (np.zeros(1, np.int64), np.zeros(0, np.int64))
    for p0 in range(0, n_pass, CHUNK):
        p1 = min(p0 + CHUNK, n_pass)
        P = sim.prefetch.proposals(p0, p1) if pf == PF_ARRAY else no_props
        replay_passes(p0, p1, st, C, CF, D, P, nonexp, cols[p0:p1], t_start, t_end, stall)
        if sim.progress is not None:
            sim.progress(p1, n_pass)
    _finish(st, CF)
    for i, name in enumerate(COLUMNS):
        sim._cols[name][:] = cols[:, i]
    sim._t_start[:] = t_start
    sim._t_end[:] = t_end
    sim._stall[:] = stall
    sim.copy.busy_time = float(st[1][SF_BUSY])
    sim.copy.bytes_moved = int(S[S_BYTES])
    sim.cache.max_used = int(S[S_MAXUSED])

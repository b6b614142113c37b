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



def _borrow(a: np.ndarray) -> np.ndarray:
    """``a`` itself in plain Python; compiled, a view of it that carries no reference count,
    so that passing the state arrays between the kernel's functions costs no atomic
    reference-count traffic (half the run time otherwise). ``a`` must outlive the view: the
    kernel only borrows its arguments for the duration of a call."""
    return a


try:
    from numba import njit
    from numba.core import cgutils
    from numba.extending import intrinsic, overload

    HAVE_NUMBA = True

    @intrinsic
    def _unowned(typingctx: Any, arr: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            src = context.make_array(arr)(context, builder, value=args[0])
            out = context.make_array(arr)(context, builder, value=args[0])
            out.meminfo = cgutils.get_null_value(src.meminfo.type)
            out.parent = cgutils.get_null_value(src.parent.type)
            return out._getvalue()

        return arr(arr), codegen

    @overload(_borrow)
    def _borrow_compiled(a):  # type: ignore[no-untyped-def]  # (numba compares the signatures)
        return lambda a: _unowned(a)

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

# per-key integer fields (KI)
(K_STATE, K_TID, K_STATIC, K_STAMP, K_COUNT, K_CURPASS, K_PREV, K_NEXT, K_MEMB, K_PIN, K_PEND,
 K_EVICTED, K_UNUSED, K_ADM, K_QUEUED, K_MARK, K_ACCPASS, K_NKI) = range(18)
# per-key float fields (KF)
F_SCORE, F_NEXTUSE, F_NKF = range(3)
# The integer state I: scalars (S_*), configuration (C_*), the pass's row (R_*), region
# offsets (H_*), then the regions (per-key fields, transfer slots, queues, scratch).
(S_SEQ, S_TSEQ, S_USED, S_MAXUSED, S_BYTES, S_HEAD, S_TAIL, S_DQN, S_PFH, S_PFN, S_RH, S_RN,
 S_FREEN, S_WH, S_WN, S_PENDN, S_MEMBN, S_PINGEN, S_PENDGEN, S_PASS, S_LAYER, S_MARKGEN,
 S_SCOREPASS,
 C_EV, C_LS_REL, C_LS_PFCUR, C_PF, C_DEPTH, C_MODE, C_INSTANT, C_NBYTES, C_L, C_DIV, C_PREC0,
 C_PFACTIVE, C_MAXN, C_NPREC, C_DPREC,
 R_HITS, R_MISSES, R_LATE, R_COLL, R_UNCACHED, R_BYTES, R_PFISSUED, R_PFUSED, R_PREDHITS,
 R_PRED, R_ACTUAL, R_PFCANCEL, R_UNIQUE,
 H_KI, H_TI, H_DQ, H_PFQ, H_RQ, H_FREE, H_WQ, H_PENDA, H_MEMB, H_LGEN, H_LADM, H_LMARK, H_RUNS,
 H_KF, H_TF, H_SCR, H_OFF, H_GROUP, H_KPOSOFF, H_KPOS, H_TTAB, H_SCALE, H_POOL, H_NKEYS,
 H_PENDMAX, I_HEADER) = range(77)
R_FIRST, R_COUNT = R_HITS, R_UNIQUE + 1 - R_HITS
# The float state F: scalars, configuration, then per-key fields, transfer times, scratch.
SF_BUSY_UNTIL, SF_BUSY, SF_NOW, SF_CARRY, SF_STALL, CF_CAP, CF_DUR, CF_DECAY, F_HEADER = range(9)
# transfer slots
T_KEY, T_PRIO, T_SEQ, T_STARTED, T_CANCELLED, T_BYPASS, T_PFSLOT, T_NTI = range(8)
T_ISSUED, T_START, T_DONE, T_NTF = range(4)
# per-pass columns, in engine order
COLUMNS = ("hits", "misses", "late_prefetches", "collision_misses", "uncached_fetches", "bytes",
           "prefetches_issued", "prefetches_used", "prefetch_predicted_hits", "prefetch_predicted",
           "prefetch_actual", "prefetches_cancelled", "unique_computed")


# -- the workload's accesses ----------------------------------------------------------------
@njit(cache=True)
def _key(j, I, A):  # type: ignore[no-untyped-def]
    """The cache key of access ``j`` (layer, expert, the scenario's precision)."""
    return np.int64(A[0][j])


@njit(cache=True)
def _ffn(j, p, I, DF, A):  # type: ignore[no-untyped-def]
    """Compute seconds of access ``j`` in pass ``p``: the expert time of its token count
    times the pass's factor (as the engine's ``_prepare_costs``)."""
    return DF[I[H_TTAB] + A[1][j]] * DF[I[H_SCALE] + p]


# -- eviction policies ----------------------------------------------------------------------
@njit(cache=True)
def _next_use(key, ai, I, DI, A):  # type: ignore[no-untyped-def]
    """Belady: the next access index of ``key`` after the current one (``ai``, or the
    current (pass, layer)'s access of it, or just before the layer), as a float (inf: none)."""
    a, b = DI[I[H_KPOSOFF] + key], DI[I[H_KPOSOFF] + key + 1]
    if a == b:
        return math.inf
    i = ai
    if i < 0:
        base = I[S_PASS] * I[C_L] + I[S_LAYER]
        lo, hi = DI[I[H_OFF] + base], DI[I[H_OFF] + base + 1]
        i = lo - 1
        for j in range(lo, hi):
            if _key(j, I, A) == key:
                i = j
                break
    # first position > i (searchsorted right)
    while a < b:
        m = (a + b) >> 1
        if DI[I[H_KPOS] + m] <= i:
            a = m + 1
        else:
            b = m
    return math.inf if a == DI[I[H_KPOSOFF] + key + 1] else float(DI[I[H_KPOS] + a])


@njit(cache=True)
def _credit(key, ai, I, F, A):  # type: ignore[no-untyped-def]
    """Score eviction: add the access's gate weight (after the per-pass decay)."""
    p = I[S_PASS]
    if F[CF_DECAY] != 1.0 and p != I[S_SCOREPASS]:
        f = math.pow(F[CF_DECAY], float(p - max(I[S_SCOREPASS], 0)))
        for k in range(I[H_NKEYS]):
            F[I[H_KF] + k * F_NKF + F_SCORE] *= f
        I[S_SCOREPASS] = p
    w = A[2][ai] if ai >= 0 else 0.0
    F[I[H_KF] + key * F_NKF + F_SCORE] = F[I[H_KF] + key * F_NKF + F_SCORE] + w


@njit(cache=True)
def _list_append(key, I):  # type: ignore[no-untyped-def]
    tail = I[S_TAIL]
    I[I[H_KI] + key * K_NKI + K_PREV] = tail
    I[I[H_KI] + key * K_NKI + K_NEXT] = -1
    if tail == -1:
        I[S_HEAD] = key
    else:
        I[I[H_KI] + tail * K_NKI + K_NEXT] = key
    I[S_TAIL] = key


@njit(cache=True)
def _list_unlink(key, I):  # type: ignore[no-untyped-def]
    prv, nxt = I[I[H_KI] + key * K_NKI + K_PREV], I[I[H_KI] + key * K_NKI + K_NEXT]
    if prv == -1:
        I[S_HEAD] = nxt
    else:
        I[I[H_KI] + prv * K_NKI + K_NEXT] = nxt
    if nxt == -1:
        I[S_TAIL] = prv
    else:
        I[I[H_KI] + nxt * K_NKI + K_PREV] = prv


@njit(cache=True)
def _stamp(key, I):  # type: ignore[no-untyped-def]
    I[S_SEQ] += 1
    I[I[H_KI] + key * K_NKI + K_STAMP] = I[S_SEQ]


@njit(cache=True)
def _on_insert(key, demand, ai, I, F, DI, A):  # type: ignore[no-untyped-def]
    """The policy's ``on_insert``: ``key`` entered the cache (``demand``: a use)."""
    n = I[S_MEMBN]
    I[I[H_MEMB] + n] = key
    I[I[H_KI] + key * K_NKI + K_MEMB] = n
    I[S_MEMBN] = n + 1
    ev = I[C_EV]
    _stamp(key, I)
    if ev == EV_LRU or ev == EV_FIFO:
        _list_append(key, I)
    elif ev == EV_LFU:
        if demand:
            I[I[H_KI] + key * K_NKI + K_COUNT] += 1
    elif ev == EV_SCORE:
        if demand:
            _credit(key, ai, I, F, A)
    elif ev == EV_BELADY:
        F[I[H_KF] + key * F_NKF + F_NEXTUSE] = _next_use(key, ai, I, DI, A)
    elif ev == EV_LS:
        I[I[H_KI] + key * K_NKI + K_CURPASS] = I[S_PASS]
    elif ev == EV_LHU:
        if demand and I[C_PREC0]:
            I[I[H_KI] + key * K_NKI + K_COUNT] += 1


@njit(cache=True)
def _on_access(key, ai, I, F, DI, A):  # type: ignore[no-untyped-def]
    """The policy's ``on_access``: a hit or a late prefetch used ``key``."""
    ev = I[C_EV]
    if ev == EV_LRU:
        _list_unlink(key, I)
        _list_append(key, I)
    elif ev == EV_FIFO:
        return
    elif ev == EV_LFU:
        I[I[H_KI] + key * K_NKI + K_COUNT] += 1
        _stamp(key, I)
    elif ev == EV_FLD:
        _stamp(key, I)
    elif ev == EV_SCORE:
        _stamp(key, I)
        _credit(key, ai, I, F, A)
    elif ev == EV_LHU:
        _stamp(key, I)
        if I[C_PREC0]:
            I[I[H_KI] + key * K_NKI + K_COUNT] += 1
    elif ev == EV_BELADY:
        F[I[H_KF] + key * F_NKF + F_NEXTUSE] = _next_use(key, ai, I, DI, A)
    elif ev == EV_LS:
        if I[I[H_KI] + key * K_NKI + K_CURPASS] != I[S_PASS]:
            I[I[H_KI] + key * K_NKI + K_CURPASS] = I[S_PASS]
            _stamp(key, I)


@njit(cache=True)
def _on_remove(key, I):  # type: ignore[no-untyped-def]
    i = I[I[H_KI] + key * K_NKI + K_MEMB]
    last = I[I[H_MEMB] + I[S_MEMBN] - 1]
    I[I[H_MEMB] + i] = last
    I[I[H_KI] + last * K_NKI + K_MEMB] = i
    I[S_MEMBN] -= 1
    I[I[H_KI] + key * K_NKI + K_MEMB] = -1
    if I[C_EV] == EV_LRU or I[C_EV] == EV_FIFO:
        _list_unlink(key, I)


@njit(cache=True)
def _order(key, I, F):  # type: ignore[no-untyped-def]
    """The policy's candidate order of ``key`` as (float, int, stamp): smaller goes first."""
    ev = I[C_EV]
    stamp = I[I[H_KI] + key * K_NKI + K_STAMP]
    if ev == EV_LFU:
        return 0.0, I[I[H_KI] + key * K_NKI + K_COUNT], stamp
    if ev == EV_FLD:
        return -float(abs(key // I[C_DIV] - I[S_LAYER])), 0, stamp
    if ev == EV_SCORE:
        return F[I[H_KF] + key * F_NKF + F_SCORE], 0, stamp
    if ev == EV_LHU:
        return 0.0, (I[I[H_KI] + key * K_NKI + K_COUNT] + 1) if I[C_PREC0] else 0, stamp
    if ev == EV_BELADY:
        return -F[I[H_KF] + key * F_NKF + F_NEXTUSE], 0, stamp
    # least-stale: stale queue, then current; per queue the layer order, then FIFO
    num_l = I[C_L]
    layer = key // I[C_DIV]
    queue = 1 if I[I[H_KI] + key * K_NKI + K_CURPASS] == I[S_PASS] else 0
    if I[C_LS_REL]:
        cur = I[S_LAYER]
        if layer < cur:
            rank = layer
        elif layer > cur:
            rank = cur + num_l - layer
        elif I[I[H_KI] + key * K_NKI + K_PEND] == I[S_PENDGEN]:
            rank = num_l + 1
        else:
            rank = cur
    else:
        rank = layer
    return 0.0, queue * (num_l + 2) + rank, stamp


@njit(cache=True)
def _eligible(key, pin_gen, adm_layer, I):  # type: ignore[no-untyped-def]
    if I[I[H_KI] + key * K_NKI + K_STATE] != RESIDENT or I[I[H_KI] + key * K_NKI + K_PIN] == pin_gen or I[I[H_KI] + key * K_NKI + K_STATIC]:
        return False
    if adm_layer >= 0 and key // I[C_DIV] == adm_layer and I[I[H_KI] + key * K_NKI + K_ADM] == I[I[H_LGEN] + adm_layer]:
        return False
    return True


@njit(cache=True)
def _victim(for_prefetch, pin_gen, adm_layer, I, F):  # type: ignore[no-untyped-def]
    """The first candidate, in the policy's order, that the cache may evict (resident, not
    pinned, not statically pinned, not an earlier admission for ``adm_layer``), or -1."""
    ev = I[C_EV]
    if ev == EV_LRU or ev == EV_FIFO:
        key = I[S_HEAD]
        while key != -1:
            if _eligible(key, pin_gen, adm_layer, I):
                return key
            key = I[I[H_KI] + key * K_NKI + K_NEXT]
        return -1
    stale_only = ev == EV_LS and for_prefetch and not I[C_LS_PFCUR]
    best = -1
    bf, bi, bs = 0.0, 0, 0
    for j in range(I[S_MEMBN]):
        key = I[I[H_MEMB] + j]
        if not _eligible(key, pin_gen, adm_layer, I):
            continue
        if stale_only and I[I[H_KI] + key * K_NKI + K_CURPASS] == I[S_PASS]:
            continue
        f, i, s = _order(key, I, F)
        if best == -1 or f < bf or (f == bf and (i < bi or (i == bi and s < bs))):
            best, bf, bi, bs = key, f, i, s
    return best


# -- the cache and the copy engine ------------------------------------------------------------
@njit(cache=True)
def _evict(key, I):  # type: ignore[no-untyped-def]
    I[I[H_KI] + key * K_NKI + K_STATE] = ABSENT
    I[S_USED] -= I[C_NBYTES]
    _on_remove(key, I)
    I[I[H_KI] + key * K_NKI + K_UNUSED] = 0
    I[I[H_KI] + key * K_NKI + K_EVICTED] = I[S_PASS]


@njit(cache=True)
def _room(for_prefetch, pin_gen, adm_layer, I, F):  # type: ignore[no-untyped-def]
    """Make room for one expert (every entry of the kernel's scope has the same size, so one
    victim is enough): -2 (it fits), the victim evicted, or -1 (no room; nothing changed)."""
    nb = I[C_NBYTES]
    if nb <= F[CF_CAP] - I[S_USED]:
        return -2
    if nb > F[CF_CAP]:
        return -1
    v = _victim(for_prefetch, pin_gen, adm_layer, I, F)
    if v == -1:
        return -1
    _evict(v, I)
    return v


@njit(cache=True)
def _submit(key, prio, now, bypass, I, F):  # type: ignore[no-untyped-def]
    """Queue a transfer on the copy engine; returns its slot."""
    if I[S_FREEN] == 0:
        raise RuntimeError("moesim kernel: transfer slots exhausted")
    I[S_FREEN] -= 1
    tid = I[I[H_FREE] + I[S_FREEN]]
    I[I[H_TI] + tid * T_NTI + T_KEY] = key
    I[I[H_TI] + tid * T_NTI + T_PRIO] = prio
    I[I[H_TI] + tid * T_NTI + T_SEQ] = I[S_TSEQ]
    I[S_TSEQ] += 1
    I[I[H_TI] + tid * T_NTI + T_STARTED] = 0
    I[I[H_TI] + tid * T_NTI + T_CANCELLED] = 0
    I[I[H_TI] + tid * T_NTI + T_BYPASS] = bypass
    I[I[H_TI] + tid * T_NTI + T_PFSLOT] = -1
    F[I[H_TF] + tid * T_NTF + T_ISSUED] = now
    F[I[H_TF] + tid * T_NTF + T_START] = now
    F[I[H_TF] + tid * T_NTF + T_DONE] = now
    I[S_BYTES] += I[C_NBYTES]
    if I[C_INSTANT]:
        I[I[H_TI] + tid * T_NTI + T_STARTED] = 1
    elif prio == DEMAND:
        n = I[S_DQN]
        prev = F[I[H_TF] + (I[I[H_DQ] + n - 1]) * T_NTF + T_DONE] if n else F[SF_BUSY_UNTIL]
        start = prev if prev > now else now
        F[I[H_TF] + tid * T_NTF + T_START] = start
        F[I[H_TF] + tid * T_NTF + T_DONE] = start + F[CF_DUR]
        I[I[H_DQ] + n] = tid
        I[S_DQN] = n + 1
    else:
        size = I[H_POOL]
        if I[S_PFN] == size:  # drop the tombstones
            h, n = I[S_PFH], I[S_PFN]
            keep = np.empty(size, np.int64)
            m = 0
            for j in range(n):
                t = I[I[H_PFQ] + (h + j) % size]
                if t != -1:
                    keep[m] = t
                    m += 1
            for j in range(m):
                I[I[H_PFQ] + j] = keep[j]
                I[I[H_TI] + (keep[j]) * T_NTI + T_PFSLOT] = j
            I[S_PFH] = 0
            I[S_PFN] = m
            if m == size:
                raise RuntimeError("moesim kernel: prefetch queue full")
        slot = (I[S_PFH] + I[S_PFN]) % size
        I[I[H_PFQ] + slot] = tid
        I[I[H_TI] + tid * T_NTI + T_PFSLOT] = slot
        I[S_PFN] += 1
    return tid


@njit(cache=True)
def _free(tid, I):  # type: ignore[no-untyped-def]
    I[I[H_FREE] + I[S_FREEN]] = tid
    I[S_FREEN] += 1


@njit(cache=True)
def _project(first, I, F):  # type: ignore[no-untyped-def]
    prev = F[I[H_TF] + (I[I[H_DQ] + first - 1]) * T_NTF + T_DONE] if first else F[SF_BUSY_UNTIL]
    for i in range(first, I[S_DQN]):
        t = I[I[H_DQ] + i]
        issued = F[I[H_TF] + t * T_NTF + T_ISSUED]
        start = prev if prev > issued else issued
        F[I[H_TF] + t * T_NTF + T_START] = start
        prev = start + F[CF_DUR]
        F[I[H_TF] + t * T_NTF + T_DONE] = prev


@njit(cache=True)
def _promote(tid, I, F):  # type: ignore[no-untyped-def]
    """A queued prefetch is needed now: it joins the demand queue by issue order."""
    if I[I[H_TI] + tid * T_NTI + T_STARTED] or I[I[H_TI] + tid * T_NTI + T_PRIO] == DEMAND or I[I[H_TI] + tid * T_NTI + T_CANCELLED]:
        return
    I[I[H_TI] + tid * T_NTI + T_PRIO] = DEMAND
    I[I[H_PFQ] + I[I[H_TI] + tid * T_NTI + T_PFSLOT]] = -1
    n = I[S_DQN]
    i = n
    seq = I[I[H_TI] + tid * T_NTI + T_SEQ]
    while i > 0 and I[I[H_TI] + (I[I[H_DQ] + i - 1]) * T_NTI + T_SEQ] > seq:
        I[I[H_DQ] + i] = I[I[H_DQ] + i - 1]
        i -= 1
    I[I[H_DQ] + i] = tid
    I[S_DQN] = n + 1
    _project(i, I, F)


@njit(cache=True)
def _complete(tid, I):  # type: ignore[no-untyped-def]
    if not I[I[H_TI] + tid * T_NTI + T_BYPASS]:
        key = I[I[H_TI] + tid * T_NTI + T_KEY]
        I[I[H_KI] + key * K_NKI + K_STATE] = RESIDENT
        I[I[H_KI] + key * K_NKI + K_TID] = -1
    _free(tid, I)


@njit(cache=True)
def _advance(now, I, F):  # type: ignore[no-untyped-def]
    """Start the transfers whose start time is before ``now``; complete those done by it."""
    size = I[H_POOL]
    prev = F[SF_BUSY_UNTIL]
    n = I[S_DQN]
    started = 0
    while started < n:
        t = I[I[H_DQ] + started]
        if F[I[H_TF] + t * T_NTF + T_START] >= now:
            break
        prev = F[I[H_TF] + t * T_NTF + T_DONE]
        I[I[H_TI] + t * T_NTI + T_STARTED] = 1
        I[I[H_RQ] + (I[S_RH] + I[S_RN]) % size] = t
        I[S_RN] += 1
        F[SF_BUSY] += F[I[H_TF] + t * T_NTF + T_DONE] - F[I[H_TF] + t * T_NTF + T_START]
        started += 1
    if started:
        for i in range(started, n):
            I[I[H_DQ] + i - started] = I[I[H_DQ] + i]
        I[S_DQN] = n - started
    if I[S_DQN] == 0:
        psize = I[H_POOL]
        while I[S_PFN]:
            t = I[I[H_PFQ] + I[S_PFH]]
            if t == -1:
                I[S_PFH] = (I[S_PFH] + 1) % psize
                I[S_PFN] -= 1
                continue
            issued = F[I[H_TF] + t * T_NTF + T_ISSUED]
            start = prev if prev > issued else issued
            if start >= now:
                break
            I[S_PFH] = (I[S_PFH] + 1) % psize
            I[S_PFN] -= 1
            F[I[H_TF] + t * T_NTF + T_START] = start
            prev = start + F[CF_DUR]
            F[I[H_TF] + t * T_NTF + T_DONE] = prev
            I[I[H_TI] + t * T_NTI + T_STARTED] = 1
            I[I[H_RQ] + (I[S_RH] + I[S_RN]) % size] = t
            I[S_RN] += 1
            F[SF_BUSY] += prev - start
    F[SF_BUSY_UNTIL] = prev
    while I[S_RN] and F[I[H_TF] + (I[I[H_RQ] + I[S_RH]]) * T_NTF + T_DONE] <= now:
        t = I[I[H_RQ] + I[S_RH]]
        I[S_RH] = (I[S_RH] + 1) % size
        I[S_RN] -= 1
        _complete(t, I)


@njit(cache=True)
def _arrival(tid, seq, now, I, F):  # type: ignore[no-untyped-def]
    """When a run's expert is on the GPU (``now`` if it was resident or its transfer is done)."""
    if tid < 0 or I[I[H_TI] + tid * T_NTI + T_SEQ] != seq:
        return now
    done = F[I[H_TF] + tid * T_NTF + T_DONE]
    return now if done < now else done


@njit(cache=True)
def _insert(key, tid, demand, ai, I, F, DI, A):  # type: ignore[no-untyped-def]
    """The cache's ``reserve``: an in-flight entry for ``key`` (room was made)."""
    I[I[H_KI] + key * K_NKI + K_STATE] = INFLIGHT
    I[I[H_KI] + key * K_NKI + K_TID] = tid
    I[S_USED] += I[C_NBYTES]
    if I[S_USED] > I[S_MAXUSED]:
        I[S_MAXUSED] = I[S_USED]
    _on_insert(key, demand, ai, I, F, DI, A)
    if I[C_INSTANT]:
        _complete(tid, I)


# -- the lookup path ---------------------------------------------------------------------------
@njit(cache=True)
def _used_prefetch(key, I):  # type: ignore[no-untyped-def]
    if I[I[H_KI] + key * K_NKI + K_UNUSED]:
        I[I[H_KI] + key * K_NKI + K_UNUSED] = 0
        I[R_PFUSED] += 1


@njit(cache=True)
def _lookup(ai, now, pin_gen, I, F, DI, A):  # type: ignore[no-untyped-def]
    """Look access ``ai`` up (engine's ``LayerLookup.lookup``, plain path); returns the slot
    of the transfer its run waits for, or -1."""
    key = _key(ai, I, A)
    state = I[I[H_KI] + key * K_NKI + K_STATE]
    if state == RESIDENT:
        I[R_HITS] += 1
        _on_access(key, ai, I, F, DI, A)
        _used_prefetch(key, I)
        return -1
    if state == INFLIGHT:
        I[R_LATE] += 1
        _on_access(key, ai, I, F, DI, A)
        _used_prefetch(key, I)
        tid = I[I[H_KI] + key * K_NKI + K_TID]
        if I[I[H_TI] + tid * T_NTI + T_PRIO] != DEMAND and not I[I[H_TI] + tid * T_NTI + T_STARTED]:
            _promote(tid, I, F)
        return tid
    I[R_MISSES] += 1
    if I[I[H_KI] + key * K_NKI + K_EVICTED] == I[S_PASS]:
        I[R_COLL] += 1
    if _room(False, pin_gen, -1, I, F) != -1:
        I[I[H_KI] + key * K_NKI + K_PIN] = pin_gen
        tid = _submit(key, DEMAND, now, 0, I, F)
        _insert(key, tid, True, ai, I, F, DI, A)
        return -1 if I[C_INSTANT] else tid
    tid = _submit(key, DEMAND, now, 1, I, F)
    I[R_UNCACHED] += 1
    if I[C_INSTANT]:
        _free(tid, I)
        return -1
    return tid


# -- prefetch: SpecMD appendix A.3's queue ------------------------------------------------------
@njit(cache=True)
def _admit(now, pin_gen, I, F, DI, A):  # type: ignore[no-untyped-def]
    """One admission round (engine's ``_admit``)."""
    size = I[H_NKEYS]
    while I[S_WN]:
        key = I[I[H_WQ] + I[S_WH]]
        if I[I[H_KI] + key * K_NKI + K_STATE] != ABSENT:
            I[S_WH] = (I[S_WH] + 1) % size
            I[S_WN] -= 1
            I[I[H_KI] + key * K_NKI + K_QUEUED] = 0
            continue
        target = key // I[C_DIV]
        v = _room(True, pin_gen, target, I, F)
        if v == -1:
            return
        I[S_WH] = (I[S_WH] + 1) % size
        I[S_WN] -= 1
        I[I[H_KI] + key * K_NKI + K_QUEUED] = 0
        if v >= 0:  # no longer an admission of its target layer
            I[I[H_KI] + v * K_NKI + K_ADM] = 0
        tid = _submit(key, PREFETCH, now, 0, I, F)
        _insert(key, tid, False, -1, I, F, DI, A)
        if not I[C_INSTANT]:
            n = I[S_PENDN]
            if n == I[H_PENDMAX]:
                n = _compact_pending(I)
            I[I[H_PENDA] + n * 3 + 0] = tid
            I[I[H_PENDA] + n * 3 + 1] = I[I[H_TI] + tid * T_NTI + T_SEQ]
            I[I[H_PENDA] + n * 3 + 2] = key
            I[S_PENDN] = n + 1
        I[I[H_KI] + key * K_NKI + K_ADM] = I[I[H_LGEN] + target]
        I[I[H_LADM] + target] = 1
        I[I[H_KI] + key * K_NKI + K_UNUSED] = 1
        I[R_PFISSUED] += 1


@njit(cache=True)
def _compact_pending(I):  # type: ignore[no-untyped-def]
    """Drop the pending entries whose transfer has started (a withdrawal skips them)."""
    keep = 0
    for j in range(I[S_PENDN]):
        tid, seq = I[I[H_PENDA] + j * 3 + 0], I[I[H_PENDA] + j * 3 + 1]
        if I[I[H_TI] + tid * T_NTI + T_SEQ] != seq or I[I[H_TI] + tid * T_NTI + T_STARTED] or I[I[H_TI] + tid * T_NTI + T_CANCELLED]:
            continue
        I[I[H_PENDA] + keep * 3 + 0] = tid
        I[I[H_PENDA] + keep * 3 + 1] = seq
        I[I[H_PENDA] + keep * 3 + 2] = I[I[H_PENDA] + j * 3 + 2]
        keep += 1
    if keep == I[H_PENDMAX]:
        raise RuntimeError("moesim kernel: pending prefetch list full")
    I[S_PENDN] = keep
    return keep


@njit(cache=True)
def _withdraw(layer, lo, hi, I, A):  # type: ignore[no-untyped-def]
    """At ``layer``'s routing point (engine's ``_withdraw``): proposals for it or earlier still
    waiting are withdrawn, its admissions stop being pinned, and its queued prefetches the
    layer does not need are withdrawn with their room."""
    div = I[C_DIV]
    size = I[H_NKEYS]
    n = I[S_WN]
    if n:
        h = I[S_WH]
        m = 0
        for j in range(n):
            key = I[I[H_WQ] + (h + j) % size]
            if key // div > layer:
                I[I[H_WQ] + (h + m) % size] = key
                m += 1
            else:
                I[I[H_KI] + key * K_NKI + K_QUEUED] = 0
        I[S_WN] = m
    for t in range(layer + 1):
        if I[I[H_LADM] + t]:
            I[I[H_LGEN] + t] += 1
            I[I[H_LADM] + t] = 0
    n = I[S_PENDN]
    if n == 0:
        return
    I[S_MARKGEN] += 1
    gen = I[S_MARKGEN]
    for j in range(lo, hi):
        I[I[H_KI] + _key(j, I, A) * K_NKI + K_MARK] = gen
    keep = 0
    for j in range(n):
        tid, seq, key = I[I[H_PENDA] + j * 3 + 0], I[I[H_PENDA] + j * 3 + 1], I[I[H_PENDA] + j * 3 + 2]
        if key // div > layer:
            I[I[H_PENDA] + keep * 3 + 0] = tid
            I[I[H_PENDA] + keep * 3 + 1] = seq
            I[I[H_PENDA] + keep * 3 + 2] = key
            keep += 1
            continue
        if (I[I[H_TI] + tid * T_NTI + T_SEQ] != seq or I[I[H_TI] + tid * T_NTI + T_PRIO] == DEMAND or I[I[H_KI] + key * K_NKI + K_MARK] == gen
                or I[I[H_TI] + tid * T_NTI + T_STARTED] or I[I[H_TI] + tid * T_NTI + T_CANCELLED]):
            continue
        # withdrawn: no bytes move, its room is given back
        I[I[H_TI] + tid * T_NTI + T_CANCELLED] = 1
        I[I[H_PFQ] + I[I[H_TI] + tid * T_NTI + T_PFSLOT]] = -1
        I[S_BYTES] -= I[C_NBYTES]
        I[I[H_KI] + key * K_NKI + K_STATE] = ABSENT
        I[I[H_KI] + key * K_NKI + K_TID] = -1
        I[S_USED] -= I[C_NBYTES]
        _on_remove(key, I)
        I[I[H_KI] + key * K_NKI + K_UNUSED] = 0
        I[R_PFCANCEL] += 1
        _free(tid, I)
    I[S_PENDN] = keep


@njit(cache=True)
def _propose_key(key, p, I, F, DI, A):  # type: ignore[no-untyped-def]
    """One proposal (engine's ``_propose``): counted against what its target layer needs,
    selected when cached, else queued."""
    gen = I[S_MARKGEN]
    if I[I[H_KI] + key * K_NKI + K_MARK] == gen:
        return  # a repeat
    I[I[H_KI] + key * K_NKI + K_MARK] = gen
    div = I[C_DIV]
    target = key // div
    if target <= I[S_LAYER] or target >= I[C_L]:
        return  # not a later layer
    I[R_PRED] += 1
    if I[I[H_KI] + key * K_NKI + K_ACCPASS] == p:
        I[R_PREDHITS] += 1
    if I[I[H_LMARK] + target] != gen:
        I[I[H_LMARK] + target] = gen
        b = p * I[C_L] + target
        I[R_ACTUAL] += DI[I[H_OFF] + b + 1] - DI[I[H_OFF] + b]
    if I[I[H_KI] + key * K_NKI + K_STATE] != ABSENT:
        if I[C_EV] == EV_LS:  # a selection is a use for least-stale only
            _on_access(key, -1, I, F, DI, A)
    elif not I[I[H_KI] + key * K_NKI + K_QUEUED]:
        I[I[H_KI] + key * K_NKI + K_QUEUED] = 1
        size = I[H_NKEYS]
        I[I[H_WQ] + (I[S_WH] + I[S_WN]) % size] = key
        I[S_WN] += 1


@njit(cache=True)
def _propose(p, layer, p0, now, pin_gen, I, F, DI, A, P):  # type: ignore[no-untyped-def]
    """The prefetcher's proposals at ``layer``'s routing point, then one admission round."""
    num_l = I[C_L]
    kind = I[C_PF]
    I[S_MARKGEN] += 1
    if kind == PF_ARRAY:
        poff, pkeys = P
        g = (p - p0) * num_l + layer
        for j in range(poff[g], poff[g + 1]):
            _propose_key(pkeys[j], p, I, F, DI, A)
    else:
        src = p
        if kind != PF_ORACLE:
            src = p - 1 if p > 0 and DI[I[H_GROUP] + p - 1] == DI[I[H_GROUP] + p] else -1
        last = layer + 2 if kind != PF_LOOKAHEAD else layer + 1 + I[C_DEPTH]
        if last > num_l:
            last = num_l
        if src >= 0:
            for t in range(layer + 1, last):
                b = src * num_l + t
                for j in range(DI[I[H_OFF] + b], DI[I[H_OFF] + b + 1]):
                    _propose_key(_key(j, I, A), p, I, F, DI, A)
    if I[S_WN]:
        _admit(now, pin_gen, I, F, DI, A)


# -- the compute stream ---------------------------------------------------------------------------
@njit(cache=True)
def _new_gen(I, which):  # type: ignore[no-untyped-def]
    I[which] += 1
    return I[which]


@njit(cache=True)
def _layer(p, layer, lo, hi, now, p0, I, F, DI, DF, A, P):  # type: ignore[no-untyped-def]
    """``layer`` and ``on-arrival`` execution of one layer (engine's ``_run`` body and
    ``_compute``); returns the layer's end. Stall accumulates in ``F[SF_STALL]``."""
    pend = _new_gen(I, S_PENDGEN)
    for j in range(lo, hi):
        I[I[H_KI] + _key(j, I, A) * K_NKI + K_PEND] = pend
    if I[C_PFACTIVE]:
        _withdraw(layer, lo, hi, I, A)
    pins = _new_gen(I, S_PINGEN)
    for j in range(lo, hi):
        I[I[H_KI] + _key(j, I, A) * K_NKI + K_PIN] = pins
    n = hi - lo
    for i in range(n):
        tid = _lookup(lo + i, now, pins, I, F, DI, A)
        I[I[H_RUNS] + i * 2 + 0] = tid
        I[I[H_RUNS] + i * 2 + 1] = I[I[H_TI] + tid * T_NTI + T_SEQ] if tid >= 0 else -1
    if I[C_PFACTIVE]:
        _propose(p, layer, p0, now, pins, I, F, DI, A, P)
    if I[C_MODE] == MODE_LAYER:
        ready = now
        total = 0.0
        for i in range(n):
            a = _arrival(I[I[H_RUNS] + i * 2 + 0], I[I[H_RUNS] + i * 2 + 1], now, I, F)
            if a > ready:
                ready = a
            total += _ffn(lo + i, p, I, DF, A)
        F[SF_STALL] += ready - now
        end = ready + total
    else:  # on-arrival: in arrival order (ties by compute time), each when it has arrived
        for i in range(n):
            a = _arrival(I[I[H_RUNS] + i * 2 + 0], I[I[H_RUNS] + i * 2 + 1], now, I, F)
            f = _ffn(lo + i, p, I, DF, A)
            j = i
            while j > 0 and (F[I[H_SCR] + j - 1] > a or (F[I[H_SCR] + j - 1] == a and F[I[H_SCR] + I[C_MAXN] + j - 1] > f)):
                F[I[H_SCR] + j] = F[I[H_SCR] + j - 1]
                F[I[H_SCR] + I[C_MAXN] + j] = F[I[H_SCR] + I[C_MAXN] + j - 1]
                j -= 1
            F[I[H_SCR] + j] = a
            F[I[H_SCR] + I[C_MAXN] + j] = f
        t = now
        for i in range(n):
            if F[I[H_SCR] + i] > t:
                F[SF_STALL] += F[I[H_SCR] + i] - t
                t = F[I[H_SCR] + i]
            t += F[I[H_SCR] + I[C_MAXN] + i]
        end = t
    _new_gen(I, S_PENDGEN)  # the layer's experts have run
    if I[S_WN]:
        _advance(end, I, F)
        _admit(end, _new_gen(I, S_PINGEN), I, F, DI, A)
    I[R_UNIQUE] += n
    return end


@njit(cache=True)
def _per_expert(p, layer, lo, hi, now, p0, I, F, DI, DF, A, P):  # type: ignore[no-untyped-def]
    """``per-expert`` execution of one layer (engine's ``_per_expert``): the experts run one
    after another in router order, expert j+1 looked up when expert j starts."""
    timed = not I[C_INSTANT]
    pend = _new_gen(I, S_PENDGEN)
    for j in range(lo, hi):
        I[I[H_KI] + _key(j, I, A) * K_NKI + K_PEND] = pend
    if I[C_PFACTIVE]:
        _withdraw(layer, lo, hi, I, A)
        _propose(p, layer, p0, now, _new_gen(I, S_PINGEN), I, F, DI, A, P)
    n = hi - lo
    t = now
    cur = -1
    cur_seq = -1
    if n:
        cur = _lookup(lo, t, _new_gen(I, S_PINGEN), I, F, DI, A)
        cur_seq = I[I[H_TI] + cur * T_NTI + T_SEQ] if cur >= 0 else -1
    for i in range(n):
        a = _arrival(cur, cur_seq, t, I, F)
        if a > t:
            F[SF_STALL] += a - t
            t = a
        if timed:
            _advance(t, I, F)
        nxt = -1
        nxt_seq = -1
        if i + 1 < n:
            pins = _new_gen(I, S_PINGEN)
            I[I[H_KI] + _key(lo + i, I, A) * K_NKI + K_PIN] = pins  # the running expert
            nxt = _lookup(lo + i + 1, t, pins, I, F, DI, A)
            nxt_seq = I[I[H_TI] + nxt * T_NTI + T_SEQ] if nxt >= 0 else -1
        t += _ffn(lo + i, p, I, DF, A)
        if timed:
            _advance(t, I, F)
        I[I[H_KI] + _key(lo + i, I, A) * K_NKI + K_PEND] = 0  # expert i has run
        if I[S_WN]:
            pins = _new_gen(I, S_PINGEN)
            if i + 1 < n:
                I[I[H_KI] + _key(lo + i + 1, I, A) * K_NKI + K_PIN] = pins
            _admit(t, pins, I, F, DI, A)
        cur, cur_seq = nxt, nxt_seq
    I[R_UNIQUE] += n
    return t


@njit(cache=True)
def replay_passes(p0, p1, I, F, DI, DF, A, P, nonexp, cols, t_start, t_end, stall):  # type: ignore[no-untyped-def]
    """Replay forward passes ``p0 .. p1`` (engine's ``_run``): per layer, non-expert compute,
    the routing point's lookups and proposals, expert compute; per pass, one row."""
    I, F, DI, DF = _borrow(I), _borrow(F), _borrow(DI), _borrow(DF)
    A = (_borrow(A[0]), _borrow(A[1]), _borrow(A[2]))
    num_l = I[C_L]
    now = F[SF_NOW]
    carry = F[SF_CARRY]
    for p in range(p0, p1):
        I[S_PASS] = p
        t_start[p] = now
        bytes0 = I[S_BYTES]
        for r in range(R_FIRST, R_FIRST + R_COUNT):
            I[r] = 0
        F[SF_STALL] = 0.0
        ne = nonexp[p]
        base = p * num_l
        if I[C_PFACTIVE]:
            for j in range(DI[I[H_OFF] + base], DI[I[H_OFF] + base + num_l]):
                I[I[H_KI] + _key(j, I, A) * K_NKI + K_ACCPASS] = p
        for layer in range(num_l):
            delay = carry + ne
            if delay > 0:
                now = now + delay
            carry = 0.0
            lo, hi = DI[I[H_OFF] + base + layer], DI[I[H_OFF] + base + layer + 1]
            if lo == hi:
                continue  # no routing for this (pass, layer): the layer is skipped
            _advance(now, I, F)
            I[S_LAYER] = layer
            if I[C_MODE] == MODE_PER_EXPERT:
                end = _per_expert(p, layer, lo, hi, now, p0, I, F, DI, DF, A, P)
            else:
                end = _layer(p, layer, lo, hi, now, p0, I, F, DI, DF, A, P)
            carry = end - now
        if carry > 0:
            now = now + carry
            carry = 0.0
        _advance(now, I, F)
        t_end[p] = now
        stall[p] = F[SF_STALL]
        I[R_BYTES] = I[S_BYTES] - bytes0
        for r in range(R_COUNT):
            cols[p - p0, r] = I[R_FIRST + r]
    F[SF_NOW] = now
    F[SF_CARRY] = carry


@njit(cache=True)
def _preload(keys, I, F, DI, DF, A):  # type: ignore[no-untyped-def]
    """Static pinning (the cache's ``preload``): resident before the replay, never evicted."""
    nb = I[C_NBYTES]
    loaded = 0
    for key in keys:
        if I[I[H_KI] + key * K_NKI + K_STATE] == RESIDENT or I[S_USED] + nb > F[CF_CAP]:
            continue
        I[I[H_KI] + key * K_NKI + K_STATE] = RESIDENT
        I[S_USED] += nb
        I[I[H_KI] + key * K_NKI + K_STATIC] = 1
        _on_insert(key, False, -1, I, F, DI, A)
        loaded += 1
    if I[S_USED] > I[S_MAXUSED]:
        I[S_MAXUSED] = I[S_USED]
    return loaded


@njit(cache=True)
def _finish(I, F, DI, DF, A):  # type: ignore[no-untyped-def]
    _advance(math.inf, I, F)


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


def _keys32(wl: Any, div: int, num_prec: int, default_prec: int) -> np.ndarray:
    """Every access's cache key as int32, made in place (4 bytes per access)."""
    keys = wl.acc_layer.astype(np.int32)
    keys *= np.int32(div)
    keys += wl.acc_expert.astype(np.int32) * np.int32(num_prec)
    keys += np.int32(default_prec)
    return keys


def _belady_positions(keys: np.ndarray, num_keys: int) -> tuple[np.ndarray, np.ndarray]:
    """Every key's access indices, ascending, as CSR arrays."""
    order = np.argsort(keys, kind="stable").astype(np.int64)
    counts = np.bincount(keys, minlength=num_keys)
    kpos_off = np.zeros(num_keys + 1, np.int64)
    np.cumsum(counts, out=kpos_off[1:])
    return kpos_off, order


def _layout(num_keys: int, pool: int, pend_max: int, maxn: int) -> tuple[np.ndarray, np.ndarray]:
    """The state arrays, initialised: regions after the headers, their offsets in ``I``."""
    i_sizes = ((H_KI, num_keys * K_NKI), (H_TI, pool * T_NTI), (H_DQ, pool), (H_PFQ, pool), (H_RQ, pool),
               (H_FREE, pool), (H_WQ, num_keys), (H_PENDA, pend_max * 3), (H_MEMB, num_keys),
               (H_LGEN, num_keys), (H_LADM, num_keys), (H_LMARK, num_keys), (H_RUNS, 2 * max(1, maxn)))
    f_sizes = ((H_KF, num_keys * F_NKF), (H_TF, pool * T_NTF), (H_SCR, 2 * max(1, maxn)))
    n_i, n_f = I_HEADER, F_HEADER
    offsets = {}
    for h, size in i_sizes:
        offsets[h], n_i = n_i, n_i + size
    for h, size in f_sizes:
        offsets[h], n_f = n_f, n_f + size
    I = np.zeros(n_i, np.int64)
    F = np.zeros(n_f)
    for h, o in offsets.items():
        I[h] = o
    I[H_POOL], I[H_NKEYS], I[H_PENDMAX] = pool, num_keys, pend_max
    I[S_HEAD] = I[S_TAIL] = -1
    I[S_PINGEN] = I[S_PENDGEN] = I[S_MARKGEN] = 1
    I[S_SCOREPASS] = -1
    I[S_FREEN] = pool
    ki = I[I[H_KI]:I[H_KI] + num_keys * K_NKI].reshape(num_keys, K_NKI)
    for col in (K_TID, K_CURPASS, K_PREV, K_NEXT, K_MEMB, K_EVICTED, K_ACCPASS):
        ki[:, col] = -1
    I[I[H_FREE]:I[H_FREE] + pool] = np.arange(pool - 1, -1, -1)
    I[I[H_LGEN]:I[H_LGEN] + num_keys] = 1
    return I, F


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
    off = np.ascontiguousarray(wl.off, dtype=np.int64)
    maxn = int(np.diff(off).max(initial=0))
    ev = evictions[type(sim.eviction)]
    pf = prefetchers[type(sim.prefetch)]
    params = sim.eviction.params
    pool = num_keys + maxn + 16
    pend_max = num_keys + 16
    I, F = _layout(num_keys, pool, pend_max, maxn)
    I[C_EV] = ev
    I[C_LS_REL] = isinstance(sim.eviction, LeastStale) and params.order == "relative"
    I[C_LS_PFCUR] = isinstance(sim.eviction, LeastStale) and params.prefetch_evicts_current
    I[C_PF] = pf
    I[C_DEPTH] = sim.prefetch.params.depth if isinstance(sim.prefetch, Lookahead) else 0
    I[C_MODE] = {"layer": MODE_LAYER, "on-arrival": MODE_ARRIVAL, "per-expert": MODE_PER_EXPERT}[
        sim.scenario.expert_compute]
    I[C_INSTANT] = not sim.scenario.timing
    I[C_NBYTES] = sim.expert_bytes
    I[C_L] = num_l
    I[C_DIV] = div
    I[C_PREC0] = sim.default_prec == 0
    I[C_PFACTIVE] = sim.prefetch.active
    I[C_MAXN] = maxn
    F[CF_CAP] = float(sim.capacity)
    F[CF_DUR] = sim.copy.duration(sim.expert_bytes)
    F[CF_DECAY] = params.decay if isinstance(sim.eviction, ScoreBased) else 1.0
    I[C_NPREC] = sim.num_prec
    I[C_DPREC] = sim.default_prec
    # read-only data: DI = off | pass groups | (belady) each key's access indices; DF = expert
    # seconds by token count | per-pass factor; A = per access: cache key (int32), tokens and
    # summed gate weight (the workload's own arrays)
    A = (_keys32(wl, div, sim.num_prec, sim.default_prec), wl.acc_tokens, wl.acc_weight)
    parts = [off, np.asarray(wl.pass_group, np.int64)]
    if ev == EV_BELADY:
        parts.extend(_belady_positions(sim.acc_keys, num_keys))
    starts = np.cumsum([0] + [len(x) for x in parts])
    DI = np.concatenate(parts)
    del parts
    I[H_OFF], I[H_GROUP] = starts[0], starts[1]
    if ev == EV_BELADY:
        I[H_KPOSOFF], I[H_KPOS] = starts[2], starts[3]
    table, scale = sim.ffn_table()
    DF = np.concatenate([table, scale])
    I[H_TTAB], I[H_SCALE] = 0, len(table)
    pinned = [int(k) for k in sim.prefetch.pinned()]
    if pinned:
        _preload(np.asarray(pinned, np.int64), I, F, DI, DF, A)
    n_pass = wl.num_passes
    nonexp = sim.nonexpert_times()
    cols = np.zeros((n_pass, R_COUNT), np.int64)
    t_start, t_end, stall = np.zeros(n_pass), np.zeros(n_pass), np.zeros(n_pass)
    no_props = (np.zeros(1, np.int64), np.zeros(0, np.int64))
    for p0 in range(0, n_pass, CHUNK):
        p1 = min(p0 + CHUNK, n_pass)
        P = sim.prefetch.proposals(p0, p1) if pf == PF_ARRAY else no_props
        replay_passes(p0, p1, I, F, DI, DF, A, P, nonexp, cols[p0:p1], t_start, t_end, stall)
        if sim.progress is not None:
            sim.progress(p1, n_pass)
    _finish(I, F, DI, DF, A)
    for i, name in enumerate(COLUMNS):
        sim._cols[name][:] = cols[:, i]
    sim._t_start[:] = t_start
    sim._t_end[:] = t_end
    sim._stall[:] = stall
    sim.copy.busy_time = float(F[SF_BUSY])
    sim.copy.bytes_moved = int(I[S_BYTES])
    sim.cache.max_used = int(I[S_MAXUSED])

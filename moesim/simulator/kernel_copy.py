"""The replay kernel's copy engine (:mod:`simulator.copyengine`'s model): transfer slots,
the demand queue before the prefetch ring, FIFO within a priority, the promotion of a queued
prefetch a layer needs, non-preemptive service; a transfer's start, end and completion."""

from __future__ import annotations

from moesim.jit import jit as _jit
from moesim.simulator.kernel_state import (
    C_INSTANT,
    DEMAND,
    H_DQ,
    H_FREE,
    H_KI,
    H_PDUR,
    H_PFQ,
    H_PFTMP,
    H_POOL,
    H_RQ,
    H_TF,
    H_TI,
    K_NKI,
    K_STATE,
    K_TID,
    RESIDENT,
    S_BYTES,
    S_DQN,
    S_FREEN,
    S_NDEM,
    S_PFH,
    S_PFN,
    S_RH,
    S_RN,
    S_TSEQ,
    SF_BUSY,
    SF_BUSY_UNTIL,
    T_BYPASS,
    T_CANCELLED,
    T_DONE,
    T_DUR,
    T_ISSUED,
    T_KEY,
    T_NTF,
    T_NTI,
    T_PFSLOT,
    T_PRIO,
    T_SEQ,
    T_START,
    T_STARTED,
    _nbytes,
    _prec,
)


@_jit
def _submit(key, prio, now, bypass, IS, FS):
    """Queue a transfer on the copy engine; returns its slot."""
    if IS[S_FREEN] == 0:
        raise RuntimeError("moesim kernel: transfer slots exhausted")
    IS[S_FREEN] -= 1
    tid = IS[IS[H_FREE] + IS[S_FREEN]]
    ti, tf = IS[H_TI] + tid * T_NTI, IS[H_TF] + tid * T_NTF
    IS[ti + T_KEY] = key
    IS[ti + T_PRIO] = prio
    IS[ti + T_SEQ] = IS[S_TSEQ]
    IS[S_TSEQ] += 1
    IS[ti + T_STARTED] = 0
    IS[ti + T_CANCELLED] = 0
    IS[ti + T_BYPASS] = bypass
    IS[ti + T_PFSLOT] = -1
    dur = FS[IS[H_PDUR] + _prec(key, IS)]
    FS[tf + T_ISSUED] = now
    FS[tf + T_START] = now
    FS[tf + T_DONE] = now
    FS[tf + T_DUR] = dur
    IS[S_BYTES] += _nbytes(key, IS)
    if prio == DEMAND:
        IS[S_NDEM] += 1
    if IS[C_INSTANT]:
        IS[ti + T_STARTED] = 1
    elif prio == DEMAND:
        n = IS[S_DQN]
        prev = FS[IS[H_TF] + (IS[IS[H_DQ] + n - 1]) * T_NTF + T_DONE] if n else FS[SF_BUSY_UNTIL]
        start = prev if prev > now else now
        FS[tf + T_START] = start
        FS[tf + T_DONE] = start + dur
        IS[IS[H_DQ] + n] = tid
        IS[S_DQN] = n + 1
    else:
        size = IS[H_POOL]
        if IS[S_PFN] == size:  # drop the tombstones
            h, n = IS[S_PFH], IS[S_PFN]
            keep = IS[H_PFTMP]
            m = 0
            for j in range(n):
                t = IS[IS[H_PFQ] + (h + j) % size]
                if t != -1:
                    IS[keep + m] = t
                    m += 1
            for j in range(m):
                t = IS[keep + j]
                IS[IS[H_PFQ] + j] = t
                IS[IS[H_TI] + t * T_NTI + T_PFSLOT] = j
            IS[S_PFH] = 0
            IS[S_PFN] = m
            if m == size:
                raise RuntimeError("moesim kernel: prefetch queue full")
        slot = (IS[S_PFH] + IS[S_PFN]) % size
        IS[IS[H_PFQ] + slot] = tid
        IS[IS[H_TI] + tid * T_NTI + T_PFSLOT] = slot
        IS[S_PFN] += 1
    return tid


@_jit
def _free(tid, IS):
    IS[IS[H_FREE] + IS[S_FREEN]] = tid
    IS[S_FREEN] += 1


@_jit
def _project(first, IS, FS):
    prev = FS[IS[H_TF] + (IS[IS[H_DQ] + first - 1]) * T_NTF + T_DONE] if first else FS[SF_BUSY_UNTIL]
    for i in range(first, IS[S_DQN]):
        t = IS[IS[H_DQ] + i]
        issued = FS[IS[H_TF] + t * T_NTF + T_ISSUED]
        start = prev if prev > issued else issued
        FS[IS[H_TF] + t * T_NTF + T_START] = start
        prev = start + FS[IS[H_TF] + t * T_NTF + T_DUR]
        FS[IS[H_TF] + t * T_NTF + T_DONE] = prev


@_jit
def _promote(tid, IS, FS):
    """A queued prefetch is needed now: it joins the demand queue by issue order."""
    if IS[IS[H_TI] + tid * T_NTI + T_STARTED] or IS[IS[H_TI] + tid * T_NTI + T_PRIO] == DEMAND or IS[IS[H_TI] + tid * T_NTI + T_CANCELLED]:
        return
    IS[IS[H_TI] + tid * T_NTI + T_PRIO] = DEMAND
    IS[IS[H_PFQ] + IS[IS[H_TI] + tid * T_NTI + T_PFSLOT]] = -1
    n = IS[S_DQN]
    i = n
    seq = IS[IS[H_TI] + tid * T_NTI + T_SEQ]
    while i > 0 and IS[IS[H_TI] + (IS[IS[H_DQ] + i - 1]) * T_NTI + T_SEQ] > seq:
        IS[IS[H_DQ] + i] = IS[IS[H_DQ] + i - 1]
        i -= 1
    IS[IS[H_DQ] + i] = tid
    IS[S_DQN] = n + 1
    _project(i, IS, FS)


@_jit
def _complete(tid, IS):
    ti = IS[H_TI] + tid * T_NTI
    if not IS[ti + T_BYPASS]:
        k = IS[H_KI] + IS[ti + T_KEY] * K_NKI
        IS[k + K_STATE] = RESIDENT
        IS[k + K_TID] = -1
    _free(tid, IS)


@_jit
def _advance(now, IS, FS):
    """Start the transfers whose start time is before ``now``; complete those done by it."""
    size = IS[H_POOL]
    ti, tf, dq, rq, pfq = IS[H_TI], IS[H_TF], IS[H_DQ], IS[H_RQ], IS[H_PFQ]
    prev = FS[SF_BUSY_UNTIL]
    n = IS[S_DQN]
    started = 0
    while started < n:
        t = IS[dq + started]
        if FS[tf + t * T_NTF + T_START] >= now:
            break
        prev = FS[tf + t * T_NTF + T_DONE]
        IS[ti + t * T_NTI + T_STARTED] = 1
        IS[rq + (IS[S_RH] + IS[S_RN]) % size] = t
        IS[S_RN] += 1
        FS[SF_BUSY] += prev - FS[tf + t * T_NTF + T_START]
        started += 1
    if started:
        for i in range(started, n):
            IS[dq + i - started] = IS[dq + i]
        IS[S_DQN] = n - started
    if IS[S_DQN] == 0:
        while IS[S_PFN]:
            t = IS[pfq + IS[S_PFH]]
            if t == -1:
                IS[S_PFH] = (IS[S_PFH] + 1) % size
                IS[S_PFN] -= 1
                continue
            issued = FS[tf + t * T_NTF + T_ISSUED]
            start = prev if prev > issued else issued
            if start >= now:
                break
            IS[S_PFH] = (IS[S_PFH] + 1) % size
            IS[S_PFN] -= 1
            FS[tf + t * T_NTF + T_START] = start
            prev = start + FS[tf + t * T_NTF + T_DUR]
            FS[tf + t * T_NTF + T_DONE] = prev
            IS[ti + t * T_NTI + T_STARTED] = 1
            IS[rq + (IS[S_RH] + IS[S_RN]) % size] = t
            IS[S_RN] += 1
            FS[SF_BUSY] += prev - start
    FS[SF_BUSY_UNTIL] = prev
    while IS[S_RN] and FS[tf + IS[rq + IS[S_RH]] * T_NTF + T_DONE] <= now:
        t = IS[rq + IS[S_RH]]
        IS[S_RH] = (IS[S_RH] + 1) % size
        IS[S_RN] -= 1
        _complete(t, IS)


@_jit
def _arrival(tid, seq, now, IS, FS):
    """When a run's expert is on the GPU (``now`` if it was resident or its transfer is done)."""
    if tid < 0 or IS[IS[H_TI] + tid * T_NTI + T_SEQ] != seq:
        return now
    done = FS[IS[H_TF] + tid * T_NTF + T_DONE]
    return now if done < now else done

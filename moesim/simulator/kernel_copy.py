"""The replay kernel's copy engine (:mod:`simulator.copyengine`'s model): transfer slots,
the demand queue before the prefetch ring, first come, first served within a priority, the promotion of a queued
prefetch a layer needs, non-preemptive service; a transfer's start, end and completion."""

from __future__ import annotations

from moesim.jit import inline as _inline
from moesim.jit import kernel as _jit
from moesim.kernel_state import (
    C_INSTANT,
    DEMAND,
    H_DQ,
    H_FREE,
    H_PDUR,
    H_PFQ,
    H_PFTMP,
    H_POOL,
    H_RQ,
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
    _nbytes,
    _prec,
    _ring,
)


@_inline
def _submit(key, prio, now, bypass, IS, T, FS):
    """Queue a transfer on the copy engine; returns its slot."""
    if IS[S_FREEN] == 0:
        raise RuntimeError("moesim kernel: transfer slots exhausted")
    IS[S_FREEN] -= 1
    tid = IS[IS[H_FREE] + IS[S_FREEN]]
    xfer = T[tid]
    xfer.key = key
    xfer.prio = prio
    xfer.seq = IS[S_TSEQ]
    IS[S_TSEQ] += 1
    xfer.started = 0
    xfer.cancelled = 0
    xfer.bypass = bypass
    xfer.pfslot = -1
    dur = FS[IS[H_PDUR] + _prec(key, IS)]
    xfer.issued = now
    xfer.start = now
    xfer.done = now
    xfer.dur = dur
    IS[S_BYTES] += _nbytes(key, IS)
    if prio == DEMAND:
        IS[S_NDEM] += 1
    if IS[C_INSTANT]:
        xfer.started = 1
    elif prio == DEMAND:
        n = IS[S_DQN]
        prev = T[IS[IS[H_DQ] + n - 1]].done if n else FS[SF_BUSY_UNTIL]
        start = prev if prev > now else now
        xfer.start = start
        xfer.done = start + dur
        IS[IS[H_DQ] + n] = tid
        IS[S_DQN] = n + 1
    else:
        size = IS[H_POOL]
        if IS[S_PFN] == size:  # drop the tombstones
            h, n = IS[S_PFH], IS[S_PFN]
            keep = IS[H_PFTMP]
            m = 0
            for j in range(n):
                t = IS[IS[H_PFQ] + _ring(h + j, size)]
                if t != -1:
                    IS[keep + m] = t
                    m += 1
            for j in range(m):
                t = IS[keep + j]
                IS[IS[H_PFQ] + j] = t
                T[t].pfslot = j
            IS[S_PFH] = 0
            IS[S_PFN] = m
            if m == size:
                raise RuntimeError("moesim kernel: prefetch queue full")
        slot = _ring(IS[S_PFH] + IS[S_PFN], size)
        IS[IS[H_PFQ] + slot] = tid
        T[tid].pfslot = slot
        IS[S_PFN] += 1
    return tid


@_inline
def _free(tid, IS):
    IS[IS[H_FREE] + IS[S_FREEN]] = tid
    IS[S_FREEN] += 1


@_jit
def _project(first, IS, T, FS):
    prev = T[IS[IS[H_DQ] + first - 1]].done if first else FS[SF_BUSY_UNTIL]
    for i in range(first, IS[S_DQN]):
        t = IS[IS[H_DQ] + i]
        issued = T[t].issued
        start = prev if prev > issued else issued
        T[t].start = start
        prev = start + T[t].dur
        T[t].done = prev


@_jit
def _promote(tid, IS, T, FS):
    """A queued prefetch is needed now: it joins the demand queue by issue order."""
    if T[tid].started or T[tid].prio == DEMAND or T[tid].cancelled:
        return
    T[tid].prio = DEMAND
    IS[IS[H_PFQ] + T[tid].pfslot] = -1
    n = IS[S_DQN]
    i = n
    seq = T[tid].seq
    while i > 0 and T[IS[IS[H_DQ] + i - 1]].seq > seq:
        IS[IS[H_DQ] + i] = IS[IS[H_DQ] + i - 1]
        i -= 1
    IS[IS[H_DQ] + i] = tid
    IS[S_DQN] = n + 1
    _project(i, IS, T, FS)


@_inline
def _complete(tid, IS, K, T):
    if not T[tid].bypass:
        key = T[tid].key
        K[key].state = RESIDENT
        K[key].tid = -1
    _free(tid, IS)


@_inline
def _advance(now, IS, K, T, FS):
    """Start the transfers whose start time is before ``now``; complete those done by it. The
    rings' heads and counts and the busy time are kept in locals while it runs (as
    ``IS``/``FS`` entries each step waited on the last one's store)."""
    size = IS[H_POOL]
    dq, rq, pfq = IS[H_DQ], IS[H_RQ], IS[H_PFQ]
    prev = FS[SF_BUSY_UNTIL]
    busy = FS[SF_BUSY]
    rh, rn = IS[S_RH], IS[S_RN]
    n = IS[S_DQN]
    started = 0
    while started < n:
        t = IS[dq + started]
        if T[t].start >= now:
            break
        prev = T[t].done
        T[t].started = 1
        IS[rq + _ring(rh + rn, size)] = t
        rn += 1
        busy += prev - T[t].start
        started += 1
    if started:
        for i in range(started, n):
            IS[dq + i - started] = IS[dq + i]
        IS[S_DQN] = n - started
    if IS[S_DQN] == 0:
        pfh, pfn = IS[S_PFH], IS[S_PFN]
        while pfn:
            t = IS[pfq + pfh]
            if t == -1:
                pfh = _ring(pfh + 1, size)
                pfn -= 1
                continue
            issued = T[t].issued
            start = prev if prev > issued else issued
            if start >= now:
                break
            pfh = _ring(pfh + 1, size)
            pfn -= 1
            T[t].start = start
            prev = start + T[t].dur
            T[t].done = prev
            T[t].started = 1
            IS[rq + _ring(rh + rn, size)] = t
            rn += 1
            busy += prev - start
        IS[S_PFH], IS[S_PFN] = pfh, pfn
    FS[SF_BUSY_UNTIL] = prev
    FS[SF_BUSY] = busy
    while rn and T[IS[rq + rh]].done <= now:
        t = IS[rq + rh]
        rh = _ring(rh + 1, size)
        rn -= 1
        _complete(t, IS, K, T)
    IS[S_RH], IS[S_RN] = rh, rn


@_inline
def _arrival(tid, seq, now, T):
    """When a run's expert is on the GPU (``now`` if it was resident or its transfer is done)."""
    if tid < 0 or T[tid].seq != seq:
        return now
    done = T[tid].done
    return now if done < now else done

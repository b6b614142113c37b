"""The replay kernel's copy engine (:mod:`simulator.copyengine`'s model): transfer slots,
the demand queue before the prefetch ring, first come, first served within a priority, the promotion of a queued
prefetch a layer needs, non-preemptive service; a transfer's start, end and completion."""

from __future__ import annotations

from moesim.jit import inline as _inline
from moesim.jit import kernel as _jit
from moesim.kernel_state import (
    C_INSTANT,
    DEMAND,
    H_POOL,
    LOG_DEMAND,
    LOG_PREFETCH,
    LOG_PROMOTED,
    LOG_TRANSFER,
    RESIDENT,
    S_BYTES,
    S_DQN,
    S_FREEN,
    S_NDEM,
    S_NRES,
    S_PFH,
    S_PFN,
    S_REC,
    S_RH,
    S_RN,
    S_TSEQ,
    SF_BUSY,
    SF_BUSY_UNTIL,
    _demand_queue,
    _free_slots,
    _kept_scratch,
    _nbytes,
    _prec,
    _prec_seconds,
    _prefetch_ring,
    _record,
    _ring,
    _running_ring,
)


@_inline
def _submit(key, prio, now, bypass, IS, T, FS):
    """Queue a transfer on the copy engine; returns its slot."""
    if IS[S_FREEN] == 0:
        raise RuntimeError("moesim kernel: transfer slots exhausted")
    IS[S_FREEN] -= 1
    tid = _free_slots(IS)[IS[S_FREEN]]
    xfer = T[tid]
    xfer.key = key
    xfer.prio = prio
    xfer.seq = IS[S_TSEQ]
    IS[S_TSEQ] += 1
    xfer.started = 0
    xfer.cancelled = 0
    xfer.bypass = bypass
    xfer.pfslot = -1
    xfer.promoted = 0
    dur = _prec_seconds(IS, FS)[_prec(key, IS)]
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
        dq = _demand_queue(IS)
        prev = T[dq[n - 1]].done if n else FS[SF_BUSY_UNTIL]
        start = prev if prev > now else now
        xfer.start = start
        xfer.done = start + dur
        dq[n] = tid
        IS[S_DQN] = n + 1
    else:
        size = IS[H_POOL]
        pfq = _prefetch_ring(IS)
        if IS[S_PFN] == size:  # drop the tombstones
            h, n = IS[S_PFH], IS[S_PFN]
            keep = _kept_scratch(IS)
            m = 0
            for j in range(n):
                t = pfq[_ring(h + j, size)]
                if t != -1:
                    keep[m] = t
                    m += 1
            for j in range(m):
                t = keep[j]
                pfq[j] = t
                T[t].pfslot = j
            IS[S_PFH] = 0
            IS[S_PFN] = m
            if m == size:
                raise RuntimeError("moesim kernel: prefetch queue full")
        slot = _ring(IS[S_PFH] + IS[S_PFN], size)
        pfq[slot] = tid
        T[tid].pfslot = slot
        IS[S_PFN] += 1
    return tid


@_inline
def _free(tid, IS):
    _free_slots(IS)[IS[S_FREEN]] = tid
    IS[S_FREEN] += 1


@_jit
def _project(first, IS, T, FS):
    dq = _demand_queue(IS)
    prev = T[dq[first - 1]].done if first else FS[SF_BUSY_UNTIL]
    for i in range(first, IS[S_DQN]):
        t = dq[i]
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
    T[tid].promoted = 1
    _prefetch_ring(IS)[T[tid].pfslot] = -1
    dq = _demand_queue(IS)
    n = IS[S_DQN]
    i = n
    seq = T[tid].seq
    while i > 0 and T[dq[i - 1]].seq > seq:
        dq[i] = dq[i - 1]
        i -= 1
    dq[i] = tid
    IS[S_DQN] = n + 1
    _project(i, IS, T, FS)


@_inline
def _complete(tid, IS, K, T):
    if not T[tid].bypass:
        key = T[tid].key
        K[key].state = RESIDENT
        K[key].tid = -1
        IS[S_NRES] += 1  # never a statically pinned key: those are preloaded, never fetched
    _free(tid, IS)


@_jit
def _record_transfer(tid, IS, T, FS):
    """A completed transfer, into the timeline (the copy engine's ``on_complete``)."""
    xfer = T[tid]
    kind = LOG_PROMOTED if xfer.promoted else (LOG_DEMAND if xfer.prio == DEMAND else LOG_PREFETCH)
    _record(LOG_TRANSFER, xfer.key, kind, xfer.issued, xfer.start, xfer.done, _nbytes(xfer.key, IS), 0, IS, FS)


@_inline
def _advance(now, IS, K, T, FS):
    """Start the transfers whose start time is before ``now``; complete those done by it. The
    rings' heads and counts and the busy time are kept in locals while it runs (as
    ``IS``/``FS`` entries each step waited on the last one's store)."""
    size = IS[H_POOL]
    dq, rq, pfq = _demand_queue(IS), _running_ring(IS), _prefetch_ring(IS)
    prev = FS[SF_BUSY_UNTIL]
    busy = FS[SF_BUSY]
    rh, rn = IS[S_RH], IS[S_RN]
    n = IS[S_DQN]
    started = 0
    while started < n:
        t = dq[started]
        if T[t].start >= now:
            break
        prev = T[t].done
        T[t].started = 1
        rq[_ring(rh + rn, size)] = t
        rn += 1
        busy += prev - T[t].start
        started += 1
    if started:
        for i in range(started, n):
            dq[i - started] = dq[i]
        IS[S_DQN] = n - started
    if IS[S_DQN] == 0:
        pfh, pfn = IS[S_PFH], IS[S_PFN]
        while pfn:
            t = pfq[pfh]
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
            rq[_ring(rh + rn, size)] = t
            rn += 1
            busy += prev - start
        IS[S_PFH], IS[S_PFN] = pfh, pfn
    FS[SF_BUSY_UNTIL] = prev
    FS[SF_BUSY] = busy
    while rn and T[rq[rh]].done <= now:
        t = rq[rh]
        rh = _ring(rh + 1, size)
        rn -= 1
        if IS[S_REC]:
            _record_transfer(t, IS, T, FS)
        _complete(t, IS, K, T)
    IS[S_RH], IS[S_RN] = rh, rn


@_inline
def _arrival(tid, seq, now, T):
    """When a run's expert is on the GPU (``now`` if it was resident or its transfer is done)."""
    if tid < 0 or T[tid].seq != seq:
        return now
    done = T[tid].done
    return now if done < now else done

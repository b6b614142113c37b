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

Scope (:func:`kernel_form`): one GPU, standard routing, no budget, every built-in miss
policy: ``fetch``; ``drop``, ``substitute`` and ``speculative`` with the per-token path's
gate mass and altered tokens (what each token of the layer computes is kept in
``IS[H_FIN]``; a lookup's computations, none to several, go to the layer's list or, in
``per-expert`` execution, a lookup buffer); the precision cascades ``fetch-lowest-bit`` and
``fetch-priority``, whose cache entries have several sizes (a key's precision gives its
bytes, copy and compute seconds; room is made by as many victims as it takes, in
:func:`_victims`). Eviction ``lru``, ``fifo``, ``lfu``, ``fld``, ``score``, ``least-stale``
(both orders), ``belady``, ``lhu``, and a user's policy written as hooks
(:class:`policies.hooks.HookEviction`: its compiled hooks are handed to the kernel in ``A[U]``
as numba first-class functions, so one compiled kernel serves every such policy); prefetch ``none``, ``static-pin``, ``oracle``,
``previous-token``, ``lookahead``, ``next-gate-topk``, ``score-percentile`` (the last two's
proposals come as arrays, :meth:`PrefetchPolicy.proposals`). Everything else — a routing or
budget policy that changes what a token computes (each is its own Python/numpy selection:
XShare's greedy, MoE-Spec's rankings, dual-logit routing; a compiled copy would be a second
implementation of each decision), random eviction (it draws from numpy's ``Generator``),
expert parallelism, a user's own policy of another kind (or whose hooks numba cannot compile), and a replay that records its timeline or
decisions — runs on the SimPy path.

The same functions run as plain Python under ``NUMBA_DISABLE_JIT=1`` (the tests check that
they give the same answer), at about a third of the SimPy path's speed; so where numba is not
installed the SimPy path runs. ``MOESIM_NO_KERNEL=1`` forces the SimPy path.

State lives in two arrays, so that the kernel's functions pass little between them: ``IS``
(int64: scalars ``S_*``, configuration ``C_*``, the pass's counts ``R_*``, region offsets
``H_*``, then the regions) and ``FS`` (float64: scalars, configuration, then regions).
Addressing: field ``K_X`` of cache key ``k`` is ``IS[IS[H_KI] + k * K_NKI + K_X]`` (its float
fields ``FS[IS[H_KF] + k * F_NKF + F_X]``); field ``T_X`` of transfer slot ``t`` is
``IS[IS[H_TI] + t * T_NTI + T_X]`` (its times ``FS[IS[H_TF] + t * T_NTF + T_X]``); element
``i`` of a queue or list ``Q`` is ``IS[IS[H_Q] + i]``. Queues: the demand queue ``DQ`` in
service order, the prefetch queue ``PFQ`` as a ring whose withdrawn or promoted entries are
-1, the running ring ``RQ``, the waiting proposals ``WQ``, the pending prefetches ``PENDA``.
Transfer slots are reused; a slot kept past a layer is checked against its transfer's
sequence number. Sets the SimPy path rebuilds (pins, pending experts, keys evicted in this
pass) are generation marks. Read-only data: ``DI`` (offsets of each (pass, layer)'s accesses,
pass groups, Belady's access positions), ``DF`` (expert seconds by token count, per-pass
factor), ``A`` (the workload's own per-access arrays) and ``P`` (proposal arrays). The kernel
allocates nothing, so it is compiled without numba's runtime (``_nrt=False``): its
reference counting of the array arguments took 40% of the run time. The lookup path's
functions are always inlined by LLVM (``forceinline``): passing a dozen arrays to each call cost more
than half of what was left (LRU full timing went from 13 to 30M accesses/s, the one-off
compile from 12.6 to 13.2 s). The loops release the GIL (``nogil``), so that a trace read in
pieces has its next piece read and built (and, for score-percentile, its prefetch proposals
made: ``Workload.proposals``) on a second thread while this one replays
(:func:`simulator.stream.read_ahead`); the read-only arrays then hold one piece
(``S_PBASE``: the piece's first pass, where its (pass, layer) entries start).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import warnings
from collections.abc import Generator, Iterator
from typing import Any

import numpy as np

from moesim.jit import HAVE_NUMBA, forget_tuples
from moesim.jit import inline as _inline
from moesim.jit import jit as _jit
from moesim.policies.hooks import CLOCK_LAYER, CLOCK_PASS, CLOCK_TICK
from moesim.simulator.workload import join, passes_of

# eviction policies with a kernel form
EV_LRU, EV_FIFO, EV_LS, EV_BELADY, EV_HOOK = range(5)
# a hook policy's compiled hooks (each in a tuple of one) and state in ``A[U]`` (:mod:`policies.hooks`)
U = 5
U_INSERT, U_ACCESS, U_REMOVE, U_PRIORITY, U_PRIORITIES, U_CLOCK, U_SI, U_SF, U_KEYS, U_PRIOS = range(10)
# prefetch proposal sources
PF_NONE, PF_ORACLE, PF_PREV, PF_LOOKAHEAD, PF_ARRAY = range(5)
MODE_LAYER, MODE_ARRIVAL, MODE_PER_EXPERT = range(3)
ABSENT, INFLIGHT, RESIDENT = 0, 1, 2
DEMAND, PREFETCH = 0, 1

# per-key integer fields (KI)
(K_STATE, K_COMPUTED, K_TID, K_PIN, K_STATIC, K_STAMP, K_CURPASS, K_PREV, K_NEXT, K_MEMB,
 K_PEND, K_EVICTED, K_UNUSED, K_ADM, K_QUEUED, K_MARK, K_ACCPASS, K_NKI) = range(18)
# per-key float fields (KF)
F_NEXTUSE, F_PRIO, F_NKF = range(3)
# The integer state IS: scalars (S_*), configuration (C_*), the pass's row (R_*), region
# offsets (H_*), then the regions (per-key fields, transfer slots, queues, scratch).
(S_SEQ, S_TSEQ, S_USED, S_MAXUSED, S_BYTES, S_HEAD, S_TAIL, S_DQN, S_PFH, S_PFN, S_RH, S_RN,
 S_FREEN, S_WH, S_WN, S_PENDN, S_MEMBN, S_PINGEN, S_PENDGEN, S_PASS, S_LAYER, S_MARKGEN,
 S_LAYERGEN, S_LRUNN, S_LRUNN1, S_NCOMP, S_NDEM, S_PBASE, S_ABASE,
 C_EV, C_LS_REL, C_PF, C_DEPTH, C_MODE, C_INSTANT, C_NBYTES, C_L, C_DIV, C_TLEN,
 C_PFACTIVE, C_MAXN, C_NPREC, C_DPREC, C_MISS, C_DROPRANK, C_PROBS, C_K, C_NE, C_LRUNCAP,
 C_NLEV, C_IMPORTANT, C_MULTI, C_REROUTE, C_BLOCKING, C_HOST, C_HSYNC, C_STABLE,
 R_HITS, R_MISSES, R_LATE, R_COLL, R_UNCACHED, R_BYTES, R_PFISSUED, R_PFUSED, R_PREDHITS,
 R_PRED, R_ACTUAL, R_PFCANCEL, R_UNIQUE, R_DROPPED, R_ALTERED, R_SUBST, R_LOWPREC,
 H_KI, H_TI, H_DQ, H_PFQ, H_RQ, H_FREE, H_WQ, H_PENDA, H_MEMB, H_LGEN, H_LADM, H_LMARK, H_RUNS,
 H_KF, H_TF, H_SCR, H_OFF, H_GROUP, H_KPOSOFF, H_KPOS, H_KNEXT, H_TTAB, H_SCALE, H_POOL, H_NKEYS,
 H_PENDMAX, H_LSQ, H_PFTMP, H_MSCR, H_FIN, H_LRUN, H_SPEC, H_ROUTED, H_LEVELS, H_PBYTES, H_VICT,
 H_PDUR, I_HEADER) = range(112)
R_FIRST, R_COUNT = R_HITS, R_LOWPREC + 1 - R_HITS
# The float state FS: scalars, configuration, then per-key fields, transfer times, scratch.
(SF_BUSY_UNTIL, SF_BUSY, SF_NOW, SF_CARRY, SF_STALL, SF_MTOTAL, SF_MKEPT, SF_HOST, CF_CAP,
 CF_HLAYER, CF_HLAUNCH, CF_HCOPY, F_HEADER) = range(13)
# transfer slots
T_KEY, T_PRIO, T_SEQ, T_STARTED, T_CANCELLED, T_BYPASS, T_PFSLOT, T_NTI = range(8)
T_ISSUED, T_START, T_DONE, T_DUR, T_NTF = range(5)
# per-pass columns, in engine order
COLUMNS = ("hits", "misses", "late_prefetches", "collision_misses", "uncached_fetches", "bytes",
           "prefetches_issued", "prefetches_used", "prefetch_predicted_hits", "prefetch_predicted",
           "prefetch_actual", "prefetches_cancelled", "unique_computed", "dropped_experts", "tokens_altered",
           "substituted_experts", "low_precision_experts")
# miss policies with a kernel form
MISS_FETCH, MISS_DROP, MISS_SUBSTITUTE, MISS_SPECULATIVE, MISS_LOWEST_BIT, MISS_PRIORITY = range(6)


# -- the workload's accesses ----------------------------------------------------------------
@_inline
def _key_at(layer, e, IS):
    """The cache key of expert ``e`` of ``layer`` at the scenario's precision."""
    return np.int64(layer) * IS[C_DIV] + np.int64(e) * IS[C_NPREC] + IS[C_DPREC]


@_inline
def _row_base(p, IS):
    """Where pass ``p``'s (pass, layer) entries start in the replay's arrays (``DI``'s
    offsets, the per-token arrays): ``(p - S_PBASE) * layers``; ``S_PBASE`` is the first pass
    of the trace piece they hold (0 unless the trace is replayed a piece at a time)."""
    return (p - IS[S_PBASE]) * IS[C_L]


@_inline
def _here(IS):
    """The current (pass, layer)'s index in the replay's arrays."""
    return _row_base(IS[S_PASS], IS) + IS[S_LAYER]


@_jit
def _key(j, IS, A):
    """The cache key of access ``j``."""
    return _key_at(A[0][j], A[1][j], IS)


@_inline
def _prec(key, IS):
    """The precision index of ``key``: the scenario's unless a precision cascade may cache
    others (``C_MULTI``; this spares the lookup path a division per key)."""
    return key % IS[C_NPREC] if IS[C_MULTI] else IS[C_DPREC]


@_inline
def _nbytes(key, IS):
    """The size of ``key``'s entry: its precision's expert bytes (``C_NBYTES``, the
    scenario's, unless a precision cascade may cache others)."""
    return IS[IS[H_PBYTES] + key % IS[C_NPREC]] if IS[C_MULTI] else IS[C_NBYTES]


@_inline
def _ffn(key, tokens, DF, IS):
    """Compute seconds of expert ``key`` (at its precision) with ``tokens`` tokens, before
    the pass's factor: ``H_TTAB`` is the scenario's precision's row of the table, the
    other precisions' rows lie ``C_TLEN`` apart around it."""
    if IS[C_MULTI]:
        return DF[IS[H_TTAB] + (key % IS[C_NPREC] - IS[C_DPREC]) * IS[C_TLEN] + tokens]
    return DF[IS[H_TTAB] + tokens]


# -- eviction policies ----------------------------------------------------------------------
@_jit
def _next_use(key, ai, IS, DI, A):
    """Belady: the next access index of ``key`` after the current one (``ai``, or the
    current (pass, layer)'s access of it, or just before the layer), as a float (inf: none).
    Indices count the whole trace's accesses: a piece's own are ``S_ABASE`` on, and a key with
    none left in the piece has its first one after the piece (``H_KNEXT``; -1: none)."""
    a, b = DI[IS[H_KPOSOFF] + key], DI[IS[H_KPOSOFF] + key + 1]
    if a == b:
        return _after_piece(key, IS, DI)
    i = ai
    if i < 0:
        base = _here(IS)
        lo, hi = DI[IS[H_OFF] + base], DI[IS[H_OFF] + base + 1]
        i = lo - 1
        for j in range(lo, hi):
            if _key(j, IS, A) == key:
                i = j
                break
    # first position > i (searchsorted right)
    while a < b:
        m = (a + b) >> 1
        if DI[IS[H_KPOS] + m] <= i:
            a = m + 1
        else:
            b = m
    if a == DI[IS[H_KPOSOFF] + key + 1]:
        return _after_piece(key, IS, DI)
    return float(IS[S_ABASE] + DI[IS[H_KPOS] + a])


@_inline
def _after_piece(key, IS, DI):
    """Belady: ``key``'s first access after the piece being replayed (inf: none)."""
    nxt = DI[IS[H_KNEXT] + key]
    return math.inf if nxt < 0 else float(nxt)


@_jit
def _weight(key, ai, IS, DI, A):
    """The gate weight of access ``ai`` (-1: of the current (pass, layer)'s access of
    ``key``, 0 when it has none)."""
    if ai < 0:  # a speculative run of an expert the layer routes has its access's weight
        base = _here(IS)
        for j in range(DI[IS[H_OFF] + base], DI[IS[H_OFF] + base + 1]):
            if _key(j, IS, A) == key:
                ai = j
                break
    return A[3][ai] if ai >= 0 else 0.0


@_inline
def _set_clock(IS, A):
    """Set a hook policy's clock (:mod:`policies.hooks`) to the replay's pass, layer and stamp
    counter."""
    clock = A[U][U_CLOCK]
    clock[CLOCK_PASS] = IS[S_PASS]
    clock[CLOCK_LAYER] = IS[S_LAYER]
    clock[CLOCK_TICK] = IS[S_SEQ]


@_inline
def _list_append(key, head, IS):
    """Append ``key`` to the list whose head and tail are ``IS[head]``, ``IS[head + 1]``."""
    ki = IS[H_KI]
    tail = IS[head + 1]
    IS[ki + key * K_NKI + K_PREV] = tail
    IS[ki + key * K_NKI + K_NEXT] = -1
    if tail == -1:
        IS[head] = key
    else:
        IS[ki + tail * K_NKI + K_NEXT] = key
    IS[head + 1] = key


@_inline
def _list_unlink(key, head, IS):
    ki = IS[H_KI]
    prv, nxt = IS[ki + key * K_NKI + K_PREV], IS[ki + key * K_NKI + K_NEXT]
    if prv == -1:
        IS[head] = nxt
    else:
        IS[ki + prv * K_NKI + K_NEXT] = nxt
    if nxt == -1:
        IS[head + 1] = prv
    else:
        IS[ki + nxt * K_NKI + K_PREV] = prv


@_jit
def _ls_list(key, IS):
    """Least-stale: the head slot of ``key``'s queue (current if touched in this pass, else
    stale) for its layer; each such list is in insertion order."""
    current = IS[IS[H_KI] + key * K_NKI + K_CURPASS] == IS[S_PASS]
    return IS[H_LSQ] + 2 * (current * IS[C_L] + key // IS[C_DIV])


@_jit
def _ls_roll(IS):
    """Least-stale, at a new pass: every layer's current list joins the end of its stale
    list (the SimPy policy's ``_roll``)."""
    num_l = IS[C_L]
    for layer in range(num_l):
        stale = IS[H_LSQ] + 2 * layer
        cur = IS[H_LSQ] + 2 * (num_l + layer)
        first = IS[cur]
        if first == -1:
            continue
        if IS[stale + 1] == -1:
            IS[stale] = first
        else:
            IS[IS[H_KI] + IS[stale + 1] * K_NKI + K_NEXT] = first
            IS[IS[H_KI] + first * K_NKI + K_PREV] = IS[stale + 1]
        IS[stale + 1] = IS[cur + 1]
        IS[cur] = -1
        IS[cur + 1] = -1


@_jit
def _ls_first(head, pin_gen, adm_layer, pending, IS):
    """The first eligible key of a least-stale list; ``pending``: 0 only keys not pending,
    1 only pending keys, 2 any."""
    key = IS[head]
    while key != -1:
        if _eligible(key, pin_gen, adm_layer, IS) and (
                pending == 2 or (IS[IS[H_KI] + key * K_NKI + K_PEND] == IS[S_PENDGEN]) == (pending == 1)):
            return key
        key = IS[IS[H_KI] + key * K_NKI + K_NEXT]
    return -1


@_jit
def _ls_victim(for_prefetch, pin_gen, adm_layer, IS):
    """Least-stale's victim (the SimPy policy's ``candidates``, or ``prefetch_candidates``
    for an optional prefetch): the stale queue, then the current one; per queue the layers in
    the policy's order (relative: layers already passed, the current layer's experts not
    pending, upcoming layers farthest first, the current layer's pending experts; absolute:
    layer 0 first), FIFO within. A prefetch takes no pending expert of the current layer and
    no current expert of a later layer."""
    num_l = IS[C_L]
    cur = IS[S_LAYER]
    relative = IS[C_LS_REL]
    for q in range(2):
        base = IS[H_LSQ] + 2 * q * num_l
        for step in range(num_l + 1 if relative else num_l):
            layer, pending = step, 2  # absolute, and relative before the current layer
            if relative and step == cur:
                pending = 0  # the current layer's experts that have run
            elif relative and step == num_l:
                layer, pending = cur, 1  # ... and last those still to run
            elif relative and step > cur:
                layer = num_l + cur - step  # upcoming layers, farthest first
            if for_prefetch:
                if layer == cur:
                    if pending == 1:
                        continue  # still to run: upcoming
                    pending = 0
                elif q == 1 and layer > cur:
                    continue  # a later layer's current expert: upcoming
            v = _ls_first(base + 2 * layer, pin_gen, adm_layer, pending, IS)
            if v != -1:
                return v
    return -1


@_jit
def _stamp(key, IS):
    IS[S_SEQ] += 1
    IS[IS[H_KI] + key * K_NKI + K_STAMP] = IS[S_SEQ]


@_inline
def _on_insert(key, demand, ai, IS, FS, DI, A):
    """The policy's ``on_insert``: ``key`` entered the cache (``demand``: a use). Recency
    policies keep a list in order (of the keys they may evict: a statically pinned key, never
    a victim, is not in it, so that their victim walk need not pass over them); the others the
    members their victim search scans."""
    ev = IS[C_EV]
    if ev in (EV_LRU, EV_FIFO, EV_LS) and IS[IS[H_KI] + key * K_NKI + K_STATIC]:
        return
    if ev in (EV_LRU, EV_FIFO):
        _list_append(key, S_HEAD, IS)
        return
    if ev == EV_LS:
        IS[IS[H_KI] + key * K_NKI + K_CURPASS] = IS[S_PASS]
        _list_append(key, _ls_list(key, IS), IS)
        return
    n = IS[S_MEMBN]
    IS[IS[H_MEMB] + n] = key
    IS[IS[H_KI] + key * K_NKI + K_MEMB] = n
    IS[S_MEMBN] = n + 1
    _stamp(key, IS)
    if ev == EV_BELADY:
        FS[IS[H_KF] + key * F_NKF + F_NEXTUSE] = _next_use(key, ai, IS, DI, A)
    elif ev == EV_HOOK:
        w = float(_weight(key, ai, IS, DI, A)) if demand else 0.0
        _set_clock(IS, A)
        A[U][U_INSERT][0](key, demand != 0, w, A[U][U_CLOCK], A[U][U_SI], A[U][U_SF])
        _keep_priority(key, IS, FS, A)


@_inline
def _on_access(key, ai, IS, FS, DI, A):
    """The policy's ``on_access``: a hit or a late prefetch used ``key``."""
    ev = IS[C_EV]
    if ev in (EV_LRU, EV_LS) and IS[IS[H_KI] + key * K_NKI + K_STATIC]:
        return  # not in the recency lists (:func:`_on_insert`)
    if ev == EV_LRU:
        _list_unlink(key, S_HEAD, IS)
        _list_append(key, S_HEAD, IS)
    elif ev == EV_FIFO:
        return
    elif ev == EV_BELADY:
        FS[IS[H_KF] + key * F_NKF + F_NEXTUSE] = _next_use(key, ai, IS, DI, A)
    elif ev == EV_HOOK:
        _stamp(key, IS)
        _set_clock(IS, A)
        A[U][U_ACCESS][0](key, float(_weight(key, ai, IS, DI, A)), A[U][U_CLOCK], A[U][U_SI], A[U][U_SF])
        _keep_priority(key, IS, FS, A)
    elif ev == EV_LS and IS[IS[H_KI] + key * K_NKI + K_CURPASS] != IS[S_PASS]:
        _list_unlink(key, _ls_list(key, IS), IS)  # stale -> current
        IS[IS[H_KI] + key * K_NKI + K_CURPASS] = IS[S_PASS]
        _list_append(key, _ls_list(key, IS), IS)


@_inline
def _on_remove(key, IS, A):
    if IS[C_EV] in (EV_LRU, EV_FIFO):
        _list_unlink(key, S_HEAD, IS)
        return
    if IS[C_EV] == EV_LS:
        _list_unlink(key, _ls_list(key, IS), IS)
        return
    i = IS[IS[H_KI] + key * K_NKI + K_MEMB]
    last = IS[IS[H_MEMB] + IS[S_MEMBN] - 1]
    IS[IS[H_MEMB] + i] = last
    IS[IS[H_KI] + last * K_NKI + K_MEMB] = i
    IS[S_MEMBN] -= 1
    IS[IS[H_KI] + key * K_NKI + K_MEMB] = -1
    if IS[C_EV] == EV_HOOK:
        _set_clock(IS, A)
        A[U][U_REMOVE][0](key, A[U][U_CLOCK], A[U][U_SI], A[U][U_SF])


@_jit
def _order(key, IS, FS):
    """The candidate order of ``key`` for Belady, whose victim is the smallest over the cached
    experts, as (minus its next use, stamp); the other built-ins walk lists (lru, fifo,
    least-stale) or run their compiled forms through the hooks (lfu, fld, score, lhu)."""
    return -FS[IS[H_KF] + key * F_NKF + F_NEXTUSE], IS[IS[H_KI] + key * K_NKI + K_STAMP]


@_inline
def _eligible(key, pin_gen, adm_layer, IS):
    k = IS[H_KI] + key * K_NKI
    if IS[k + K_STATE] != RESIDENT or IS[k + K_PIN] == pin_gen or IS[k + K_STATIC]:
        return False
    return not (adm_layer >= 0 and key // IS[C_DIV] == adm_layer and IS[k + K_ADM] == IS[IS[H_LGEN] + adm_layer])


@_jit
def _victim(for_prefetch, pin_gen, adm_layer, IS, FS):
    """The first candidate, in the policy's order, that the cache may evict (resident, not
    pinned, not statically pinned, not an earlier admission for ``adm_layer``), or -1."""
    ev = IS[C_EV]
    if ev in (EV_LRU, EV_FIFO):
        key = IS[S_HEAD]
        while key != -1:
            if _eligible(key, pin_gen, adm_layer, IS):
                return key
            key = IS[IS[H_KI] + key * K_NKI + K_NEXT]
        return -1
    if ev == EV_LS:
        return _ls_victim(for_prefetch, pin_gen, adm_layer, IS)
    best = -1
    bf, bs = 0.0, 0
    for j in range(IS[S_MEMBN]):
        key = IS[IS[H_MEMB] + j]
        if not _eligible(key, pin_gen, adm_layer, IS):
            continue
        f, s = _order(key, IS, FS)
        if best == -1 or f < bf or (f == bf and s < bs):
            best, bf, bs = key, f, s
    return best


@_inline
def _keep_priority(key, IS, FS, A):
    """A hook policy with a stable priority (``C_STABLE``) keeps ``key``'s, computed after its
    hooks ran, in ``F_PRIO``."""
    if IS[C_STABLE]:
        FS[IS[H_KF] + key * F_NKF + F_PRIO] = A[U][U_PRIORITY][0](key, A[U][U_CLOCK], A[U][U_SI], A[U][U_SF])


@_jit
def _hook_victim(pin_gen, adm_layer, IS, FS, A):
    """A hook policy's victim: the eligible key of lowest priority (kept, or asked now of every
    cached key in one call, as the SimPy path sorts them all), ties to the oldest stamp."""
    best, bf, bs = -1, 0.0, 0
    if IS[C_STABLE]:
        for j in range(IS[S_MEMBN]):
            key = IS[IS[H_MEMB] + j]
            if not _eligible(key, pin_gen, adm_layer, IS):
                continue
            f, s = FS[IS[H_KF] + key * F_NKF + F_PRIO], IS[IS[H_KI] + key * K_NKI + K_STAMP]
            if best == -1 or f < bf or (f == bf and s < bs):
                best, bf, bs = key, f, s
        return best
    keys, prios = A[U][U_KEYS], A[U][U_PRIOS]  # keys: the cached keys (IS's H_MEMB region)
    n = IS[S_MEMBN]
    _set_clock(IS, A)
    A[U][U_PRIORITIES][0](keys, n, prios, A[U][U_CLOCK], A[U][U_SI], A[U][U_SF])
    for j in range(n):
        key = keys[j]
        if not _eligible(key, pin_gen, adm_layer, IS):
            continue
        f, s = prios[j], IS[IS[H_KI] + key * K_NKI + K_STAMP]
        if best == -1 or f < bf or (f == bf and s < bs):
            best, bf, bs = key, f, s
    return best


@_inline
def _find_victim(for_prefetch, pin_gen, adm_layer, IS, FS, A):
    """:func:`_victim`, or a hook policy's (:func:`_hook_victim`, the one that reads ``A``)."""
    if IS[C_EV] == EV_HOOK:
        return _hook_victim(pin_gen, adm_layer, IS, FS, A)
    return _victim(for_prefetch, pin_gen, adm_layer, IS, FS)


# -- the cache and the copy engine ------------------------------------------------------------
@_inline
def _evict(key, IS, A):
    k = IS[H_KI] + key * K_NKI
    IS[k + K_STATE] = ABSENT
    IS[S_USED] -= _nbytes(key, IS)
    _on_remove(key, IS, A)
    IS[k + K_UNUSED] = 0
    IS[k + K_EVICTED] = IS[S_PASS]


@_inline
def _evict_for(key, for_prefetch, IS, A):
    """Evict a victim; one evicted for a prefetch is no longer an admission."""
    _evict(key, IS, A)
    if for_prefetch:
        IS[IS[H_KI] + key * K_NKI + K_ADM] = 0


@_inline
def _room(nb, for_prefetch, pin_gen, adm_layer, IS, FS, A):
    """Make room for an entry of ``nb`` bytes (the victim walk of ``ExpertCache.fetch``):
    evict victims in the policy's order until enough is free. Returns how many were evicted
    (0: it fits), or -1 when the entries that may be evicted cannot free enough (nothing
    changed). With entries of one size one victim is always enough; several are
    :func:`_victims`'s."""
    free = FS[CF_CAP] - IS[S_USED]
    if nb <= free:
        return 0
    if nb > FS[CF_CAP]:
        return -1
    v = _find_victim(for_prefetch, pin_gen, adm_layer, IS, FS, A)
    if v == -1:
        return -1
    if nb > free + _nbytes(v, IS):
        return _victims(nb, free, v, for_prefetch, pin_gen, adm_layer, IS, FS, A)
    _evict_for(v, for_prefetch, IS, A)
    return 1


@_jit
def _victims(nb, free, v, for_prefetch, pin_gen, adm_layer, IS, FS, A):
    """:func:`_room` when the first victim ``v`` is not enough: each victim found is pinned
    for the search of the next (its pin restored after); all are evicted once they free
    enough, none when the search runs out."""
    vict = IS[H_VICT]
    n = 0
    while v != -1:
        k = IS[H_KI] + v * K_NKI
        IS[vict + 2 * n] = v
        IS[vict + 2 * n + 1] = IS[k + K_PIN]
        IS[k + K_PIN] = pin_gen
        n += 1
        free += _nbytes(v, IS)
        if nb <= free:
            break
        v = _find_victim(for_prefetch, pin_gen, adm_layer, IS, FS, A)
    for j in range(n):  # the pins as they were
        IS[IS[H_KI] + IS[vict + 2 * j] * K_NKI + K_PIN] = IS[vict + 2 * j + 1]
    if v == -1:
        return -1
    for j in range(n):
        _evict_for(IS[vict + 2 * j], for_prefetch, IS, A)
    return n


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


@_inline
def _insert(key, tid, demand, ai, IS, FS, DI, A):
    """The cache's ``reserve``: an in-flight entry for ``key`` (room was made)."""
    k = IS[H_KI] + key * K_NKI
    IS[k + K_STATE] = INFLIGHT
    IS[k + K_TID] = tid
    IS[S_USED] += _nbytes(key, IS)
    if IS[S_USED] > IS[S_MAXUSED]:
        IS[S_MAXUSED] = IS[S_USED]
    _on_insert(key, demand, ai, IS, FS, DI, A)
    if IS[C_INSTANT]:
        _complete(tid, IS)


# -- the lookup path ---------------------------------------------------------------------------
@_jit
def _used_prefetch(key, IS):
    if IS[IS[H_KI] + key * K_NKI + K_UNUSED]:
        IS[IS[H_KI] + key * K_NKI + K_UNUSED] = 0
        IS[R_PFUSED] += 1


@_jit
def _fin_replace(e, e2, IS, M):
    """The layer's tokens routed to ``e`` compute ``e2`` in its place (-1: nothing; a token
    that already computes ``e2`` computes it once)."""
    k = IS[C_K]
    fin = IS[H_FIN]
    row_order, row_off, experts = M[0], M[1], M[2]
    b = _here(IS)
    for i in range(row_off[b + 1] - row_off[b]):
        r = row_order[row_off[b] + i]
        for j in range(k):
            if experts[r, j] == e:
                has = False
                for jj in range(k):
                    has |= e2 >= 0 and IS[fin + i * k + jj] == e2
                IS[fin + i * k + j] = -1 if has else e2


@_jit
def _substitute(e, IS, M):
    """Substitution (the engine's ``Substitute.decide``, SpecMD §3.1.2): among the layer's
    experts that are not routed and are resident or in flight, the one whose router score
    (mean probability over ``e``'s tokens, in float32 as numpy's ``mean``) is nearest to
    ``e``'s; the lowest id on a tie; -1 when there is none."""
    score_e = _mean_prob(e, e, IS, M)
    best = -1
    best_d = 0.0
    for c in range(IS[C_NE]):
        key = _key_at(IS[S_LAYER], c, IS)
        if IS[IS[H_ROUTED] + key] == IS[S_LAYERGEN] or IS[IS[H_KI] + key * K_NKI + K_STATE] == ABSENT:
            continue
        d = abs(np.float64(_mean_prob(e, c, IS, M)) - np.float64(score_e))
        if best < 0 or d < best_d:
            best = c
            best_d = d
    return best


@_jit
def _mean_prob(e, c, IS, M):
    """Mean router probability of expert ``c`` over the layer's tokens routed to ``e``,
    summed row by row in float32 and divided in float32 (numpy's ``mean(axis=0)``)."""
    row_order, row_off, experts, mass = M[0], M[1], M[2], M[3]
    k = IS[C_K]
    b = _here(IS)
    total = np.float32(0.0)
    n = 0
    for i in range(row_off[b + 1] - row_off[b]):
        r = row_order[row_off[b] + i]
        for j in range(k):
            if experts[r, j] == e:
                v = mass[r, c]
                total = v if n == 0 else np.float32(total + v)
                n += 1
    return np.float32(total / np.float32(n))


@_inline
def _add_run(buf, tid, key, ntok, IS):
    """One computation a lookup leads to: the transfer it waits for (slot and sequence; -1:
    none), its key and its tokens. A key computed for the first time in the layer (the
    engine's ``key_for``) is counted (``S_NCOMP``); with ``buf`` -1 (``layer`` and
    ``on-arrival`` execution) such a computation is appended to the layer's (``H_RUNS``),
    with ``buf`` 0 or 1 (``per-expert``) every computation goes into that lookup buffer."""
    k = IS[H_KI] + key * K_NKI
    new = IS[k + K_COMPUTED] != IS[S_LAYERGEN]
    IS[k + K_COMPUTED] = IS[S_LAYERGEN]
    if buf < 0:
        if not new:
            return
        r = IS[H_RUNS] + IS[S_NCOMP] * 4
    else:
        n = IS[S_LRUNN + buf]
        r = IS[H_LRUN] + (buf * IS[C_LRUNCAP] + n) * 4
        IS[S_LRUNN + buf] = n + 1
    IS[S_NCOMP] += new
    IS[r] = tid
    IS[r + 1] = IS[IS[H_TI] + tid * T_NTI + T_SEQ] if tid >= 0 else -1
    IS[r + 2] = key
    IS[r + 3] = ntok


@_inline
def _needed_now(k, IS, FS):
    """The transfer of an in-flight key (its record at ``k``), needed now: a queued prefetch
    is promoted to demand priority. Returns its slot."""
    tid = IS[k + K_TID]
    ti = IS[H_TI] + tid * T_NTI
    if IS[ti + T_PRIO] != DEMAND and not IS[ti + T_STARTED]:
        _promote(tid, IS, FS)
    return tid


@_jit
def _use_other(e2, ntok, pin_gen, buf, IS, FS, DI, A):
    """A resident or arriving expert ``e2`` computes ``ntok`` tokens of a missed one (the
    engine's ``_use_other``; substitute, speculative): a queued prefetch of it is promoted,
    the eviction policy told when it is first computed in the layer, its key pinned."""
    k2 = _key_at(IS[S_LAYER], e2, IS)
    k = IS[H_KI] + k2 * K_NKI
    tid = _needed_now(k, IS, FS) if IS[k + K_STATE] == INFLIGHT else -1
    if IS[k + K_COMPUTED] != IS[S_LAYERGEN]:
        _on_access(k2, -1, IS, FS, DI, A)
    IS[k + K_PIN] = pin_gen
    _add_run(buf, tid, k2, ntok, IS)


@_jit
def _speculate(e, pin_gen, buf, IS, FS, DI, A, M):
    """Speculative execution (the engine's speculate branch,
    ``speculating-experts-prefetch.txt`` §4): each token routed to the missed ``e`` computes,
    in its place, its highest-predicted expert (the previous layer's ``pred_next`` for the
    same token; the lowest id on a tie, as a stable sort) that is resident or in flight and
    not already computed by the token, or nothing; each expert chosen then computes its
    tokens (:func:`_use_other`), in the order first chosen."""
    IS[R_SUBST] += 1
    row_order, row_off, experts, token, pred, prev_row, prev_stamp = M[0], M[1], M[2], M[4], M[6], M[7], M[8]
    k = IS[C_K]
    fin = IS[H_FIN]
    b = _here(IS)
    spec = IS[H_SPEC]
    n_spec = 0
    for i in range(row_off[b + 1] - row_off[b]):
        r = row_order[row_off[b] + i]
        for j in range(k):
            if experts[r, j] != e:
                continue
            IS[fin + i * k + j] = -1
            t = token[r]
            if prev_stamp[t] != b - 1:
                continue  # no prediction for this token
            src = prev_row[t]
            best = -1
            for c in range(IS[C_NE]):
                if best >= 0 and not pred[src, c] > pred[src, best]:
                    continue
                if IS[IS[H_KI] + _key_at(IS[S_LAYER], c, IS) * K_NKI + K_STATE] == ABSENT:
                    continue
                dup = False
                for jj in range(k):
                    dup |= IS[fin + i * k + jj] == c
                if not dup:
                    best = c
            if best < 0:
                continue
            IS[fin + i * k + j] = best
            s = 0
            while s < n_spec and IS[spec + 2 * s] != best:
                s += 1
            if s == n_spec:
                IS[spec + 2 * s] = best
                IS[spec + 2 * s + 1] = 0
                n_spec += 1
            IS[spec + 2 * s + 1] += 1
    for s in range(n_spec):
        _use_other(IS[spec + 2 * s], IS[spec + 2 * s + 1], pin_gen, buf, IS, FS, DI, A)


@_inline
def _lookup(ai, now, pin_gen, buf, IS, FS, DI, A, M):
    """Look access ``ai`` up (engine's ``LayerLookup.lookup``): the computations it leads to
    go into lookup buffer ``buf`` (:func:`_add_run`): one for a hit, a late prefetch, a
    resident copy at another precision or a fetch; none when the ``drop`` miss policy skips
    the expert (router rank >= its ``rank``); the substitute; each expert the tokens
    speculate on."""
    key = _key(ai, IS, A)
    k = IS[H_KI] + key * K_NKI
    state = IS[k + K_STATE]
    if buf >= 0:
        IS[S_LRUNN + buf] = 0
    ntok = np.int64(A[2][ai])
    if state == RESIDENT:
        IS[R_HITS] += 1
        _on_access(key, ai, IS, FS, DI, A)
        _used_prefetch(key, IS)
        _add_run(buf, -1, key, ntok, IS)
        return
    if state == INFLIGHT:
        IS[R_LATE] += 1
        _on_access(key, ai, IS, FS, DI, A)
        _used_prefetch(key, IS)
        _add_run(buf, _needed_now(k, IS, FS), key, ntok, IS)
        return
    if M is not None and IS[C_MULTI] and _alternative(key, A[4][ai], ntok, pin_gen, buf, IS, FS, DI, A):
        return
    IS[R_MISSES] += 1
    if IS[k + K_EVICTED] == IS[S_PASS]:
        IS[R_COLL] += 1
    if M is not None:  # a miss policy other than ``fetch`` (compiled only for one: ``M`` is None)
        kq = _miss_policy(key, ai, ntok, now, pin_gen, buf, IS, FS, DI, A, M)
    else:
        kq = -1 if _fetch_at(key, ai, ntok, now, pin_gen, buf, IS, FS, DI, A) else key
    if kq < 0:
        return
    tid = _submit(kq, DEMAND, now, 1, IS, FS)
    IS[R_UNCACHED] += 1
    IS[R_LOWPREC] += _prec(kq, IS) != IS[C_DPREC]
    if IS[C_INSTANT]:
        _free(tid, IS)
        tid = -1
    _add_run(buf, tid, kq, ntok, IS)


@_inline
def _miss_policy(key, ai, ntok, now, pin_gen, buf, IS, FS, DI, A, M):
    """A miss of access ``ai`` under a miss policy other than ``fetch`` (the rest of the
    engine's ``LayerLookup.lookup``): drop, substitute, speculate, or fetch (down a precision
    cascade). Returns -1 when the miss is dealt with, else the key to fetch uncached."""
    miss = IS[C_MISS]
    if miss == MISS_DROP and A[4][ai] >= IS[C_DROPRANK]:  # drop (SpecMD §3.1.2)
        IS[R_DROPPED] += 1
        _fin_replace(np.int64(A[1][ai]), -1, IS, M)
        return -1
    if miss == MISS_SUBSTITUTE:
        e2 = _substitute(np.int64(A[1][ai]), IS, M)
        if e2 >= 0:
            IS[R_SUBST] += 1
            _fin_replace(np.int64(A[1][ai]), e2, IS, M)
            _use_other(e2, ntok, pin_gen, buf, IS, FS, DI, A)
            return -1
    if miss == MISS_SPECULATIVE and IS[S_LAYER] > 0:  # layer 0 has no prediction: fetch
        _speculate(np.int64(A[1][ai]), pin_gen, buf, IS, FS, DI, A, M)
        return -1
    # fetch (the fetch in the engine's ``LayerLookup.lookup``): at the scenario's precision or down a precision
    # cascade; when no room can be made, an uncached fetch (at the cascade's last precision)
    if IS[C_MULTI]:
        return _cascade(key, A[4][ai], ai, ntok, now, pin_gen, buf, IS, FS, DI, A)
    return -1 if _fetch_at(key, ai, ntok, now, pin_gen, buf, IS, FS, DI, A) else key


@_inline
def _fetch_at(kq, aq, ntok, now, pin_gen, buf, IS, FS, DI, A):
    """Fetch ``kq`` (a cache key of the missed expert, ``aq`` its access or -1) when room
    can be made for it: pinned, a demand transfer, an in-flight entry. Returns whether it
    was."""
    if _room(_nbytes(kq, IS), False, pin_gen, -1, IS, FS, A) == -1:
        return False
    IS[IS[H_KI] + kq * K_NKI + K_PIN] = pin_gen
    tid = _submit(kq, DEMAND, now, 0, IS, FS)
    _insert(kq, tid, True, aq, IS, FS, DI, A)
    if IS[C_MULTI]:
        IS[R_LOWPREC] += _prec(kq, IS) != IS[C_DPREC]
    _add_run(buf, -1 if IS[C_INSTANT] else tid, kq, ntok, IS)
    return True


@_inline
def _use_copy(kq, ntok, pin_gen, buf, IS, FS, DI, A):
    """The missed expert computes from its resident copy ``kq`` at another precision (the
    absent key is never resident): a use, pinned, a low-precision computation."""
    _on_access(kq, -1, IS, FS, DI, A)  # no access of the layer has this key
    IS[IS[H_KI] + kq * K_NKI + K_PIN] = pin_gen
    IS[R_LOWPREC] += 1
    _add_run(buf, -1, kq, ntok, IS)


@_jit
def _alternative(key, rank, ntok, pin_gen, buf, IS, FS, DI, A):
    """A precision cascade's resident copy of the missed ``key`` at another precision (the
    policy's ``alternative``), used as a hit: returns whether there was one."""
    alo, ahi, _, _ = _levels(rank, IS)
    for li in range(alo, ahi):
        kq = key - IS[C_DPREC] + IS[IS[H_LEVELS] + li]
        if IS[IS[H_KI] + kq * K_NKI + K_STATE] == RESIDENT:
            IS[R_HITS] += 1
            _use_copy(kq, ntok, pin_gen, buf, IS, FS, DI, A)
            return True
    return False


@_jit
def _cascade(key, rank, ai, ntok, now, pin_gen, buf, IS, FS, DI, A):
    """A precision cascade's fetch of the missed ``key`` (the fetch in the engine's ``LayerLookup.lookup`` with
    several precisions): the first of its precisions that is resident is used, or fetched
    when room can be made for it. Returns -1, or the key of the last precision when none
    could be (for an uncached fetch)."""
    _, _, flo, fhi = _levels(rank, IS)
    for li in range(flo, fhi):
        kq = key - IS[C_DPREC] + IS[IS[H_LEVELS] + li]
        if IS[IS[H_KI] + kq * K_NKI + K_STATE] == RESIDENT:
            _use_copy(kq, ntok, pin_gen, buf, IS, FS, DI, A)
            return -1
        aq = ai if kq == key else -1  # the policies find no access of another precision's key
        if _fetch_at(kq, aq, ntok, now, pin_gen, buf, IS, FS, DI, A):
            return -1
    return key - IS[C_DPREC] + IS[IS[H_LEVELS] + fhi - 1]


@_inline
def _levels(rank, IS):
    """For a missed expert of best router rank ``rank``: the range of ``IS[H_LEVELS]`` (its
    precision indices) searched for a resident copy, and the range to fetch from. The
    ``fetch-lowest-bit`` policy (SpecMD §3.1.2) uses a copy at any of its precisions
    (highest first) and fetches the lowest; ``fetch-priority`` (§3.1.2, §5.4) uses for an
    important expert (rank below ``C_IMPORTANT``) its first precision only and fetches from
    it down the cascade, for the others any copy below the first and fetches from the second
    down."""
    n = IS[C_NLEV]
    miss = IS[C_MISS]
    if miss == MISS_LOWEST_BIT:
        return 0, n, n - 1, n
    if rank < IS[C_IMPORTANT]:  # fetch-priority
        return 0, 1, 0, n
    return 1, n, 1 if n > 1 else 0, n


# -- prefetch: SpecMD appendix A.3's queue ------------------------------------------------------
@_jit
def _admit(now, pin_gen, IS, FS, DI, A):
    """One admission round (``PrefetchQueue.admit``)."""
    size = IS[H_NKEYS]
    while IS[S_WN]:
        key = IS[IS[H_WQ] + IS[S_WH]]  # absent (PrefetchQueue.admit)
        target = key // IS[C_DIV]
        if _room(_nbytes(key, IS), True, pin_gen, target, IS, FS, A) == -1:
            return
        IS[S_WH] = (IS[S_WH] + 1) % size
        IS[S_WN] -= 1
        IS[IS[H_KI] + key * K_NKI + K_QUEUED] = 0
        tid = _submit(key, PREFETCH, now, 0, IS, FS)
        _insert(key, tid, False, -1, IS, FS, DI, A)
        if not IS[C_INSTANT]:
            n = IS[S_PENDN]
            if n == IS[H_PENDMAX]:
                n = _compact_pending(IS)
            IS[IS[H_PENDA] + n * 3 + 0] = tid
            IS[IS[H_PENDA] + n * 3 + 1] = IS[IS[H_TI] + tid * T_NTI + T_SEQ]
            IS[IS[H_PENDA] + n * 3 + 2] = key
            IS[S_PENDN] = n + 1
        IS[IS[H_KI] + key * K_NKI + K_ADM] = IS[IS[H_LGEN] + target]
        IS[IS[H_LADM] + target] = 1
        IS[IS[H_KI] + key * K_NKI + K_UNUSED] = 1
        IS[R_PFISSUED] += 1


@_jit
def _compact_pending(IS):
    """Drop the pending entries whose transfer has started (a withdrawal skips them)."""
    keep = 0
    for j in range(IS[S_PENDN]):
        tid, seq = IS[IS[H_PENDA] + j * 3 + 0], IS[IS[H_PENDA] + j * 3 + 1]
        if IS[IS[H_TI] + tid * T_NTI + T_SEQ] != seq or IS[IS[H_TI] + tid * T_NTI + T_STARTED] or IS[IS[H_TI] + tid * T_NTI + T_CANCELLED]:
            continue
        IS[IS[H_PENDA] + keep * 3 + 0] = tid
        IS[IS[H_PENDA] + keep * 3 + 1] = seq
        IS[IS[H_PENDA] + keep * 3 + 2] = IS[IS[H_PENDA] + j * 3 + 2]
        keep += 1
    if keep == IS[H_PENDMAX]:
        raise RuntimeError("moesim kernel: pending prefetch list full")
    IS[S_PENDN] = keep
    return keep


@_jit
def _withdraw(layer, lo, hi, IS, A):
    """At ``layer``'s routing point (``PrefetchQueue.withdraw``): proposals for it or earlier still
    waiting are withdrawn, its admissions stop being pinned, and its queued prefetches the
    layer does not need are withdrawn with their room."""
    div = IS[C_DIV]
    size = IS[H_NKEYS]
    n = IS[S_WN]
    if n:
        h = IS[S_WH]
        m = 0
        for j in range(n):
            key = IS[IS[H_WQ] + (h + j) % size]
            if key // div > layer:
                IS[IS[H_WQ] + (h + m) % size] = key
                m += 1
            else:
                IS[IS[H_KI] + key * K_NKI + K_QUEUED] = 0
        IS[S_WN] = m
    for t in range(layer + 1):
        if IS[IS[H_LADM] + t]:
            IS[IS[H_LGEN] + t] += 1
            IS[IS[H_LADM] + t] = 0
    n = IS[S_PENDN]
    if n == 0:
        return
    IS[S_MARKGEN] += 1
    gen = IS[S_MARKGEN]
    for j in range(lo, hi):
        IS[IS[H_KI] + _key(j, IS, A) * K_NKI + K_MARK] = gen
    keep = 0
    for j in range(n):
        tid, seq, key = IS[IS[H_PENDA] + j * 3 + 0], IS[IS[H_PENDA] + j * 3 + 1], IS[IS[H_PENDA] + j * 3 + 2]
        if key // div > layer:
            IS[IS[H_PENDA] + keep * 3 + 0] = tid
            IS[IS[H_PENDA] + keep * 3 + 1] = seq
            IS[IS[H_PENDA] + keep * 3 + 2] = key
            keep += 1
            continue
        if (IS[IS[H_TI] + tid * T_NTI + T_SEQ] != seq or IS[IS[H_TI] + tid * T_NTI + T_PRIO] == DEMAND or IS[IS[H_KI] + key * K_NKI + K_MARK] == gen
                or IS[IS[H_TI] + tid * T_NTI + T_STARTED] or IS[IS[H_TI] + tid * T_NTI + T_CANCELLED]):
            continue
        # withdrawn: no bytes move, its room is given back
        IS[IS[H_TI] + tid * T_NTI + T_CANCELLED] = 1
        IS[IS[H_PFQ] + IS[IS[H_TI] + tid * T_NTI + T_PFSLOT]] = -1
        IS[S_BYTES] -= _nbytes(key, IS)
        IS[IS[H_KI] + key * K_NKI + K_STATE] = ABSENT
        IS[IS[H_KI] + key * K_NKI + K_TID] = -1
        IS[S_USED] -= _nbytes(key, IS)
        _on_remove(key, IS, A)
        IS[IS[H_KI] + key * K_NKI + K_UNUSED] = 0
        IS[R_PFCANCEL] += 1
        _free(tid, IS)
    IS[S_PENDN] = keep


@_jit
def _propose_key(key, p, IS, FS, DI, A):
    """One proposal (``PrefetchQueue.propose``): counted against what its target layer needs,
    selected when cached, else queued."""
    gen = IS[S_MARKGEN]
    if IS[IS[H_KI] + key * K_NKI + K_MARK] == gen:
        return  # a repeat
    IS[IS[H_KI] + key * K_NKI + K_MARK] = gen
    div = IS[C_DIV]
    target = key // div
    if target <= IS[S_LAYER] or target >= IS[C_L]:
        return  # not a later layer
    IS[R_PRED] += 1
    if IS[IS[H_KI] + key * K_NKI + K_ACCPASS] == p:
        IS[R_PREDHITS] += 1
    if IS[IS[H_LMARK] + target] != gen:
        IS[IS[H_LMARK] + target] = gen
        b = _row_base(p, IS) + target
        IS[R_ACTUAL] += DI[IS[H_OFF] + b + 1] - DI[IS[H_OFF] + b]
    if IS[IS[H_KI] + key * K_NKI + K_STATE] != ABSENT:
        if IS[C_EV] == EV_LS:  # a selection is a use for least-stale only
            _on_access(key, -1, IS, FS, DI, A)
    elif not IS[IS[H_KI] + key * K_NKI + K_QUEUED]:
        IS[IS[H_KI] + key * K_NKI + K_QUEUED] = 1
        size = IS[H_NKEYS]
        IS[IS[H_WQ] + (IS[S_WH] + IS[S_WN]) % size] = key
        IS[S_WN] += 1


@_jit
def _propose(p, layer, p0, now, pin_gen, IS, FS, DI, A, P):
    """The prefetcher's proposals at ``layer``'s routing point, then one admission round."""
    num_l = IS[C_L]
    kind = IS[C_PF]
    IS[S_MARKGEN] += 1
    if kind == PF_ARRAY:
        poff, pkeys = P
        g = (p - p0) * num_l + layer
        for j in range(poff[g], poff[g + 1]):
            _propose_key(pkeys[j], p, IS, FS, DI, A)
    else:
        src = p - IS[S_PBASE]  # the pass's index in DI (a piece of the trace starts with a group)
        if kind != PF_ORACLE:
            src = src - 1 if src > 0 and DI[IS[H_GROUP] + src - 1] == DI[IS[H_GROUP] + src] else -1
        last = layer + 2 if kind != PF_LOOKAHEAD else layer + 1 + IS[C_DEPTH]
        if last > num_l:
            last = num_l
        if src >= 0:
            for t in range(layer + 1, last):
                b = src * num_l + t
                for j in range(DI[IS[H_OFF] + b], DI[IS[H_OFF] + b + 1]):
                    _propose_key(_key(j, IS, A), p, IS, FS, DI, A)
    if IS[S_WN]:
        _admit(now, pin_gen, IS, FS, DI, A)


# -- the compute stream ---------------------------------------------------------------------------
@_jit
def _new_gen(IS, which):
    IS[which] += 1
    return IS[which]


@_jit
def _mark_pending(lo, hi, IS, A):
    """The layer's experts are pending until they run (``Clock.pending``; only least-stale
    reads it)."""
    pend = _new_gen(IS, S_PENDGEN)
    if IS[C_EV] == EV_LS:
        for j in range(lo, hi):
            IS[IS[H_KI] + _key(j, IS, A) * K_NKI + K_PEND] = pend


@_inline
def _tokens_of(key, tokens, p, IS, M):
    """How many of the layer's tokens finally compute ``key``: ``tokens`` unless the miss
    policy re-routes tokens (``C_REROUTE``: drop, substitute, speculative), else counted in
    ``IS[H_FIN]``."""
    if M is None or not IS[C_REROUTE]:
        return tokens
    e = (key % IS[C_DIV]) // IS[C_NPREC]
    b = _here(IS)
    n = 0
    for i in range((M[1][b + 1] - M[1][b]) * IS[C_K]):
        n += IS[IS[H_FIN] + i] == e
    return n


@_jit
def _layer(p, layer, lo, hi, now, p0, IS, FS, DI, DF, A, P, M):
    """``layer`` and ``on-arrival`` execution of one layer (engine's ``_run`` body,
    ``LayerLookup.finish`` and ``_compute``); returns the layer's end. Stall accumulates in
    ``FS[SF_STALL]``."""
    _mark_pending(lo, hi, IS, A)
    if IS[C_PFACTIVE]:
        _withdraw(layer, lo, hi, IS, A)
    pins = _new_gen(IS, S_PINGEN)
    for j in range(lo, hi):
        IS[IS[H_KI] + _key(j, IS, A) * K_NKI + K_PIN] = pins
    IS[S_NCOMP] = 0
    copies = IS[S_NDEM]
    for i in range(hi - lo):
        _lookup(lo + i, now, pins, -1, IS, FS, DI, A, M)
    if IS[C_HOST]:  # the host submits the layer's demand copies
        FS[SF_HOST] += (IS[S_NDEM] - copies) * FS[CF_HCOPY]
    computed = IS[S_NCOMP]
    if IS[C_PFACTIVE]:
        _propose(p, layer, p0, now, pins, IS, FS, DI, A, P)
    scale = DF[IS[H_SCALE] + p - IS[S_PBASE]]
    if IS[C_MODE] == MODE_LAYER:
        ready = now
        total = 0.0
        for i in range(computed):
            r = IS[H_RUNS] + i * 4
            a = _arrival(IS[r], IS[r + 1], now, IS, FS)
            if a > ready:
                ready = a
            total += _ffn(IS[r + 2], _tokens_of(IS[r + 2], IS[r + 3], p, IS, M), DF, IS) * scale
        FS[SF_STALL] += ready - now
        if IS[C_HOST] and computed:  # one launch for the layer's experts
            FS[SF_HOST] += FS[CF_HLAUNCH]
            if FS[SF_HOST] > ready:
                ready = FS[SF_HOST]
        end = ready + total
    else:  # on-arrival: in arrival order (ties by compute time), each when it has arrived
        for i in range(computed):
            r = IS[H_RUNS] + i * 4
            a = _arrival(IS[r], IS[r + 1], now, IS, FS)
            f = _ffn(IS[r + 2], _tokens_of(IS[r + 2], IS[r + 3], p, IS, M), DF, IS) * scale
            j = i
            while j > 0 and (FS[IS[H_SCR] + j - 1] > a or (FS[IS[H_SCR] + j - 1] == a and FS[IS[H_SCR] + IS[C_MAXN] + j - 1] > f)):
                FS[IS[H_SCR] + j] = FS[IS[H_SCR] + j - 1]
                FS[IS[H_SCR] + IS[C_MAXN] + j] = FS[IS[H_SCR] + IS[C_MAXN] + j - 1]
                j -= 1
            FS[IS[H_SCR] + j] = a
            FS[IS[H_SCR] + IS[C_MAXN] + j] = f
        t = now
        for i in range(computed):
            if IS[C_HOST]:  # one launch per expert, after the GPU has run the last (sync: expert)
                if IS[C_HSYNC] == 2 and FS[SF_HOST] < t:
                    FS[SF_HOST] = t
                FS[SF_HOST] += FS[CF_HLAUNCH]
            if FS[IS[H_SCR] + i] > t:
                FS[SF_STALL] += FS[IS[H_SCR] + i] - t
                t = FS[IS[H_SCR] + i]
            if IS[C_HOST] and FS[SF_HOST] > t:
                t = FS[SF_HOST]
            t += FS[IS[H_SCR] + IS[C_MAXN] + i]
        end = t
    _new_gen(IS, S_PENDGEN)  # the layer's experts have run
    if IS[S_WN]:
        _advance(end, IS, FS)
        _admit(end, _new_gen(IS, S_PINGEN), IS, FS, DI, A)
    IS[R_UNIQUE] += computed
    return end


@_inline
def _pin_buffer(buf, pins, IS):
    """Pin the keys of lookup buffer ``buf``'s computations with generation ``pins``."""
    b = IS[H_LRUN] + buf * IS[C_LRUNCAP] * 4
    for x in range(IS[S_LRUNN + buf]):
        IS[IS[H_KI] + IS[b + x * 4 + 2] * K_NKI + K_PIN] = pins


@_inline
def _buffer_arrived(buf, t, IS, FS):
    """Whether every computation of lookup buffer ``buf`` has its expert on the GPU by ``t``."""
    b = IS[H_LRUN] + buf * IS[C_LRUNCAP] * 4
    for x in range(IS[S_LRUNN + buf]):
        if _arrival(IS[b + x * 4], IS[b + x * 4 + 1], t, IS, FS) > t:
            return False
    return True


@_inline
def _host_lookup(ai, t, pins, buf, IS, FS, DI, A, M):
    """Look up access ``ai`` at ``t`` into lookup buffer ``buf`` (engine's ``_host_lookup``):
    the host submits the demand copies it leads to."""
    copies = IS[S_NDEM]
    _lookup(ai, t, pins, buf, IS, FS, DI, A, M)
    if IS[C_HOST]:
        FS[SF_HOST] += (IS[S_NDEM] - copies) * FS[CF_HCOPY]


@_jit
def _host_issue(buf, t, blocking, IS, FS):
    """The host launches the expert of lookup buffer ``buf``, the GPU having run the ones
    before it by ``t`` (engine's ``_host_issue``); returns when the launch is issued."""
    if IS[C_HSYNC] == 2 and FS[SF_HOST] < t:
        FS[SF_HOST] = t
    if blocking:
        b = IS[H_LRUN] + buf * IS[C_LRUNCAP] * 4
        for x in range(IS[S_LRUNN + buf]):
            a = _arrival(IS[b + x * 4], IS[b + x * 4 + 1], FS[SF_HOST], IS, FS)
            if a > FS[SF_HOST]:
                FS[SF_HOST] = a
    FS[SF_HOST] += FS[CF_HLAUNCH]
    return FS[SF_HOST]


@_inline
def _host_ready(t, IS, FS):
    """Whether the host can launch the next expert by ``t`` (engine's ``_host_ready``)."""
    h = FS[SF_HOST]
    if IS[C_HSYNC] == 2 and h < t:
        h = t
    return h + FS[CF_HLAUNCH] <= t


@_jit
def _per_expert(p, layer, lo, hi, now, p0, IS, FS, DI, DF, A, P, M):
    """``per-expert`` execution of one layer (engine's ``_per_expert``, both ``expert_fetch``
    disciplines): the experts run one after another in router order; the running expert's
    computations are in lookup buffer ``cur``, the next one's in the other (a lookup made
    when an expert ends reuses the ended expert's buffer)."""
    timed = not IS[C_INSTANT]
    blocking = IS[C_BLOCKING]
    host = IS[C_HOST]
    _mark_pending(lo, hi, IS, A)
    if IS[C_PFACTIVE]:
        _withdraw(layer, lo, hi, IS, A)
        _propose(p, layer, p0, now, _new_gen(IS, S_PINGEN), IS, FS, DI, A, P)
    n = hi - lo
    t = now
    cur = 0
    looked = 0
    scale = DF[IS[H_SCALE] + p - IS[S_PBASE]]
    IS[S_LRUNN] = IS[S_LRUNN + 1] = IS[S_NCOMP] = 0
    if n:
        _host_lookup(lo, t, _new_gen(IS, S_PINGEN), cur, IS, FS, DI, A, M)
        looked = 1
    launched = False
    issued = 0.0
    for i in range(n):
        if host and not launched:
            issued = _host_issue(cur, t, blocking, IS, FS)
        launched = False
        base = IS[H_LRUN] + cur * IS[C_LRUNCAP] * 4
        for x in range(IS[S_LRUNN + cur]):
            a = _arrival(IS[base + x * 4], IS[base + x * 4 + 1], t, IS, FS)
            if a > t:
                FS[SF_STALL] += a - t
                t = a
        if host and issued > t:  # the GPU waits for the host to launch expert i
            t = issued
        if timed:
            _advance(t, IS, FS)
        nxt = 1 - cur
        if not blocking and looked == i + 1 and looked < n:
            IS[S_LRUNN + nxt] = 0
            pins = _new_gen(IS, S_PINGEN)
            _pin_buffer(cur, pins, IS)  # the running expert
            _host_lookup(lo + looked, t, pins, nxt, IS, FS, DI, A, M)
            looked += 1
        for x in range(IS[S_LRUNN + cur]):
            t += _ffn(IS[base + x * 4 + 2], IS[base + x * 4 + 3], DF, IS) * scale
        if timed:
            _advance(t, IS, FS)
        if IS[C_EV] == EV_LS:
            IS[IS[H_KI] + _key(lo + i, IS, A) * K_NKI + K_PEND] = 0  # expert i has run
        if blocking:
            IS[S_LRUNN + nxt] = 0
            if looked < n:
                _host_lookup(lo + looked, t, _new_gen(IS, S_PINGEN), nxt, IS, FS, DI, A, M)
                looked += 1
        elif (looked == i + 2 and looked < n and _buffer_arrived(nxt, t, IS, FS)
              and (not host or _host_ready(t, IS, FS))):
            # expert i+1 starts now: i+2's lookup (into the ended expert's buffer) comes first
            if host:  # i+1's launch, then i+2's copies
                issued = _host_issue(nxt, t, False, IS, FS)
                launched = True
            IS[S_LRUNN + cur] = 0
            pins = _new_gen(IS, S_PINGEN)
            _pin_buffer(nxt, pins, IS)
            _host_lookup(lo + looked, t, pins, cur, IS, FS, DI, A, M)
            looked += 1
            if IS[S_WN]:
                pins = _new_gen(IS, S_PINGEN)
                _pin_buffer(nxt, pins, IS)
                _pin_buffer(cur, pins, IS)
                _admit(t, pins, IS, FS, DI, A)
            cur = nxt
            continue
        elif looked != i + 2:
            IS[S_LRUNN + nxt] = 0  # nothing looked up next: nothing held
        if IS[S_WN]:
            pins = _new_gen(IS, S_PINGEN)
            _pin_buffer(nxt, pins, IS)
            _admit(t, pins, IS, FS, DI, A)
        cur = nxt
    IS[R_UNIQUE] += IS[S_NCOMP]
    return t


@_jit
def _pairwise_sum(FS, a, n):
    """``FS[a:a + n]`` summed as numpy sums a float64 array of up to 128 terms: one after
    another below eight, else in eight accumulators combined as a tree, then the rest."""
    if n < 8:
        res = 0.0
        for i in range(n):
            res += FS[a + i]
        return res
    r0, r1, r2, r3 = FS[a], FS[a + 1], FS[a + 2], FS[a + 3]
    r4, r5, r6, r7 = FS[a + 4], FS[a + 5], FS[a + 6], FS[a + 7]
    i = 8
    while i < n - n % 8:
        r0 += FS[a + i]
        r1 += FS[a + i + 1]
        r2 += FS[a + i + 2]
        r3 += FS[a + i + 3]
        r4 += FS[a + i + 4]
        r5 += FS[a + i + 5]
        r6 += FS[a + i + 6]
        r7 += FS[a + i + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += FS[a + i]
        i += 1
    return res


@_jit
def _insert_sorted(FS, at, n, v):
    """Insert ``v`` into the ascending ``FS[at:at + n]``."""
    i = n
    while i > 0 and FS[at + i - 1] > v:
        FS[at + i] = FS[at + i - 1]
        i -= 1
    FS[at + i] = v


@_jit
def _token_mass(p, layer, IS, FS, M):
    """With a miss policy that changes what tokens compute: the layer's gate mass (original
    top-k, and what each token finally computes, ``IS[H_FIN]``) and the pass's altered tokens,
    as the engine's ``token_mass``: per token, probabilities at ascending expert ids summed as
    numpy sums them, or top-k weights in rank order (a weight counts while its expert stays)."""
    row_order, row_off, experts, mass, token, mark = M[0], M[1], M[2], M[3], M[4], M[5]
    b = _row_base(p, IS) + layer
    k = IS[C_K]
    scr = IS[H_MSCR]
    fin = IS[H_FIN]
    total = 0.0
    kept = 0.0
    for i in range(row_off[b + 1] - row_off[b]):
        r = row_order[row_off[b] + i]
        changed = False
        n_fin = 0
        t_total = 0.0
        t_kept = 0.0
        for j in range(k):
            e = np.int64(experts[r, j])
            f = IS[fin + i * k + j]
            changed |= f != e
            if IS[C_PROBS]:  # ids, ascending: the original at FS[scr], the final after them
                _insert_sorted(FS, scr, j, e)
                if f >= 0:
                    _insert_sorted(FS, scr + k, n_fin, f)
                    n_fin += 1
            else:
                w = np.float64(mass[r, j])
                t_total += w
                if f == e:
                    t_kept += w
        if IS[C_PROBS]:
            for j in range(k):
                FS[scr + j] = np.float64(mass[r, np.int64(FS[scr + j])])
            for j in range(n_fin):
                FS[scr + k + j] = np.float64(mass[r, np.int64(FS[scr + k + j])])
            t_total = _pairwise_sum(FS, scr, k)
            t_kept = _pairwise_sum(FS, scr + k, n_fin) if n_fin else 0.0
        total += t_total
        kept += t_kept
        if changed and mark[token[r]] != p:
            mark[token[r]] = p
            IS[R_ALTERED] += 1
        M[7][token[r]] = r  # the token's row in the latest layer (speculative reads it)
        M[8][token[r]] = b
    FS[SF_MTOTAL] += total
    FS[SF_MKEPT] += kept


@_jit
def _fin_init(p, layer, lo, hi, IS, A, M):
    """At the layer's routing point: each token computes its routed experts, and the
    layer's routed experts are marked (a substitute is never one of them)."""
    row_order, row_off, experts = M[0], M[1], M[2]
    b = _row_base(p, IS) + layer
    k = IS[C_K]
    for i in range(row_off[b + 1] - row_off[b]):
        for j in range(k):
            IS[IS[H_FIN] + i * k + j] = experts[row_order[row_off[b] + i], j]
    for j in range(lo, hi):
        IS[IS[H_ROUTED] + _key(j, IS, A)] = IS[S_LAYERGEN]


@_jit
def replay_passes(p0, p1, IS, FS, DI, DF, A, P, M, per_expert, nonexp, release, cols, t_start, t_end, stall, m_total, m_kept):
    """Replay forward passes ``p0 .. p1`` (engine's ``_run``): per layer, non-expert compute,
    the routing point's lookups and proposals, expert compute; per pass, one row. A pass
    starts no earlier than its ``release`` time (serving: the GPU idles until a request
    arrives), the host thread with it.

    ``M`` (the per-token path's arrays) is None under the ``fetch`` miss policy and
    ``per_expert`` None unless the execution is ``per-expert``: numba prunes a branch on an
    argument that is None when it compiles, so a replay compiles only the code its scenario
    can reach (the quickstart's form compiled in 25-29 s, against 123 s for the whole kernel), each
    form once per installation."""
    num_l = IS[C_L]
    now = FS[SF_NOW]
    carry = FS[SF_CARRY]
    for p in range(p0, p1):
        if p > 0 and IS[C_EV] == EV_LS:
            _ls_roll(IS)
        IS[S_PASS] = p
        rel = release[p - p0]
        if rel > now:  # idle until then (as SimPy's timeout adds the delay to its clock)
            now = now + (rel - now)
            if FS[SF_HOST] < now:
                FS[SF_HOST] = now
        t_start[p - p0] = now
        bytes0 = IS[S_BYTES]
        for r in range(R_FIRST, R_FIRST + R_COUNT):
            IS[r] = 0
        FS[SF_STALL] = 0.0
        FS[SF_MTOTAL] = 0.0
        FS[SF_MKEPT] = 0.0
        ne = nonexp[p - p0]
        base = _row_base(p, IS)
        if IS[C_PFACTIVE]:
            for j in range(DI[IS[H_OFF] + base], DI[IS[H_OFF] + base + num_l]):
                IS[IS[H_KI] + _key(j, IS, A) * K_NKI + K_ACCPASS] = p
        for layer in range(num_l):
            delay = carry + ne
            if IS[C_HOST]:  # the host issues the non-expert part; the GPU starts it once issued
                FS[SF_HOST] += FS[CF_HLAYER]
                lag = FS[SF_HOST] - now
                if lag > carry:
                    delay = lag + ne
            if delay > 0:
                now = now + delay
            if IS[C_HSYNC] and FS[SF_HOST] < now:  # the host waits for the routing
                FS[SF_HOST] = now
            carry = 0.0
            lo, hi = DI[IS[H_OFF] + base + layer], DI[IS[H_OFF] + base + layer + 1]
            if lo == hi:
                continue  # no routing for this (pass, layer): the layer is skipped
            _advance(now, IS, FS)
            IS[S_LAYER] = layer
            IS[S_LAYERGEN] += 1
            if M is not None:
                _fin_init(p, layer, lo, hi, IS, A, M)
            if per_expert is None:
                end = _layer(p, layer, lo, hi, now, p0, IS, FS, DI, DF, A, P, M)
            else:
                end = _per_expert(p, layer, lo, hi, now, p0, IS, FS, DI, DF, A, P, M)
            if M is not None:
                _token_mass(p, layer, IS, FS, M)
            carry = end - now
        if carry > 0:
            now = now + carry
            carry = 0.0
        if FS[SF_HOST] < now:  # the host waits for the pass's end
            FS[SF_HOST] = now
        _advance(now, IS, FS)
        t_end[p - p0] = now
        stall[p - p0] = FS[SF_STALL]
        m_total[p - p0] = FS[SF_MTOTAL]
        m_kept[p - p0] = FS[SF_MKEPT]
        IS[R_BYTES] = IS[S_BYTES] - bytes0
        for r in range(R_COUNT):
            cols[p - p0, r] = IS[R_FIRST + r]
    FS[SF_NOW] = now
    FS[SF_CARRY] = carry


@_jit
def _preload(keys, IS, FS, DI, DF, A):
    """Static pinning (the cache's ``preload``): resident before the replay, never evicted."""
    nb = IS[C_NBYTES]
    loaded = 0
    for key in keys:
        if IS[IS[H_KI] + key * K_NKI + K_STATE] == RESIDENT or IS[S_USED] + nb > FS[CF_CAP]:
            continue
        IS[IS[H_KI] + key * K_NKI + K_STATE] = RESIDENT
        IS[S_USED] += nb
        IS[IS[H_KI] + key * K_NKI + K_STATIC] = 1
        _on_insert(key, False, -1, IS, FS, DI, A)
        loaded += 1
    if IS[S_USED] > IS[S_MAXUSED]:
        IS[S_MAXUSED] = IS[S_USED]
    return loaded


@_jit
def _finish(IS, FS, DI, DF, A):
    _advance(math.inf, IS, FS)


# -- dispatch --------------------------------------------------------------------------------------
@functools.cache
def _policy_codes() -> tuple[dict[Any, int], dict[Any, int], dict[Any, int]]:
    """The built-in policy classes with a kernel form, and their codes (made once):
    eviction, prefetch, miss."""
    from moesim.policies import eviction as ev
    from moesim.policies import miss as ms
    from moesim.policies import prefetch as pf

    # a built-in with a compiled form of its own (``compiled``, beside it in its module) runs
    # through the hooks, as a user's policy does (a subclass elsewhere does not inherit that)
    evictions = {ev.LRU: EV_LRU, ev.FIFO: EV_FIFO, ev.LeastStale: EV_LS, ev.Belady: EV_BELADY}
    evictions.update((cls, EV_HOOK) for _, cls in ev.REGISTRY.items()
                     if cls.__module__ == ev.__name__ and cls.__dict__.get("compiled") is not None)
    prefetchers = {pf.NoPrefetch: PF_NONE, pf.StaticPin: PF_NONE, pf.Oracle: PF_ORACLE,
                   pf.PreviousToken: PF_PREV, pf.Lookahead: PF_LOOKAHEAD, pf.NextGateTopK: PF_ARRAY,
                   pf.ScorePercentile: PF_ARRAY}
    misses = {ms.Fetch: MISS_FETCH, ms.Drop: MISS_DROP, ms.Substitute: MISS_SUBSTITUTE,
              ms.Speculative: MISS_SPECULATIVE, ms.FetchLowestBit: MISS_LOWEST_BIT, ms.FetchPriority: MISS_PRIORITY}
    return evictions, prefetchers, misses


def kernel_off() -> str | None:
    """Why no replay in this process runs on the kernel (None: the kernel is available)."""
    if os.environ.get("MOESIM_NO_KERNEL", "") not in ("", "0"):
        return "MOESIM_NO_KERNEL is set"
    if not HAVE_NUMBA:  # the kernel's source as plain Python is slower than the SimPy path
        return "numba is not installed"
    return None


def kernel_form(sim: Any) -> str | None:
    """Why ``sim`` (a :class:`simulator.engine.Simulation`) replays on the SimPy path, or
    None when the kernel has a form for every one of its policies."""
    off = kernel_off()
    if off is not None:
        return off
    if sim.transfers is not None or sim.layer_log is not None or sim.decisions is not None:
        return "the replay records its timeline or decisions"
    if sim.scenario.hardware.gpus > 1:
        return "expert parallelism"
    if sim.routing.changes_routing or sim.budget.restricts:
        return "a routing or budget policy that changes what tokens compute"
    misses = _policy_codes()[2]
    if type(sim.miss) not in misses:
        return f"miss policy '{sim.scenario.policies.miss.name}' has no kernel form"
    if misses[type(sim.miss)] != MISS_FETCH and sim.model.top_k > 128:
        return "top-k above 128 (the kernel sums a token's gate mass as numpy does up to 128 terms)"
    if eviction_code(type(sim.eviction)) is None:
        name = sim.scenario.policies.eviction.name
        if _is_hooked(sim.eviction):
            from moesim.policies.hooks import compiled

            return f"eviction policy '{name}': {compiled(type(sim.eviction))}"
        return f"eviction policy '{name}' has no kernel form"
    if _prefetch_code(sim.prefetch) is None:
        name = sim.scenario.policies.prefetch.name
        from moesim.policies.hooks import HookPrefetch, compiled_prefetch

        if isinstance(sim.prefetch, HookPrefetch):
            return f"prefetch policy '{name}': {compiled_prefetch(type(sim.prefetch))}"
        return f"prefetch policy '{name}' has no kernel form"
    return None


def _is_hooked(policy: Any) -> bool:
    from moesim.policies.hooks import HookEviction

    return isinstance(policy, HookEviction)


def eviction_code(cls: type) -> int | None:
    """The kernel's code of eviction policy class ``cls``: a built-in's, ``EV_HOOK`` for a hook
    policy whose hooks compile (:mod:`policies.hooks`), else None (the SimPy path)."""
    from moesim.policies.hooks import HookEviction, compiled

    code = _policy_codes()[0].get(cls)
    if code is not None or not issubclass(cls, HookEviction):
        return code
    return EV_HOOK if isinstance(compiled(cls), tuple) else None


def _prefetch_code(policy: Any) -> int | None:
    """The kernel's code of a prefetch policy: a built-in's, ``PF_ARRAY`` for a hook policy
    whose ``select`` compiles (its proposals come as arrays, :mod:`policies.hooks`), else None
    (the SimPy path)."""
    code = _policy_codes()[1].get(type(policy))
    from moesim.policies.hooks import HookPrefetch, compiled_prefetch

    if code is not None or not isinstance(policy, HookPrefetch):
        return code
    return PF_ARRAY if isinstance(compiled_prefetch(type(policy)), tuple) else None


def _hooks(policy: Any, members: np.ndarray | None = None) -> tuple[Any, ...]:
    """``A[U]``: a hook policy's compiled hooks, clock and state (the policy's own arrays, so
    that it holds the replay's final state after it, as on the SimPy path); for a built-in,
    hooks that are never called. ``members``: the kernel's list of cached keys (a view of
    ``IS``'s ``H_MEMB`` region), whose priorities a victim search asks in one call."""
    from moesim.policies import hooks

    fns: Any
    if policy is None or eviction_code(type(policy)) != EV_HOOK:
        fns, (clock, si, sf) = hooks.no_hooks(), _NO_STATE
    elif _is_hooked(policy):
        # the policy's arrays as they were before the SimPy side saw the pinned experts' inserts,
        # which the kernel's _preload makes again
        policy.reset_state()
        fns, clock, si, sf = hooks.compiled(type(policy)), policy.clock, policy.si, policy.sf
    else:  # a built-in's own compiled form: its state is the kernel's alone
        ctx, form = policy.ctx, hook_form(type(policy))
        fns = hooks.addresses(form)
        clock, si, sf = hooks.state_arrays(form, ctx.num_layers, ctx.keys_per_layer, len(ctx.precisions))
        form.initial_state(policy.params, si, sf)
    # each in a tuple of one, which numba types as a first-class function (a function's
    # address, called indirectly) rather than as that function: one compiled kernel for all;
    # then the cached keys and the victim search's buffer of their priorities
    keys = members if members is not None else np.zeros(len(si), np.int64)
    return (*((f,) for f in fns), clock, si, sf, keys, np.zeros(max(len(si), len(keys))))


def hook_form(cls: type) -> Any:
    """The class whose hooks the kernel runs for eviction policy ``cls`` (``EV_HOOK``): a
    built-in's compiled form, or a hook policy itself."""
    return cls.__dict__.get("compiled") or cls


_NO_STATE = (np.zeros(7, np.int64), np.zeros((1, 1), np.int64), np.zeros((1, 1)))
CHUNK = 256  # passes per kernel call (progress is reported between calls)
# forward passes whose per-pass rows a replay in pieces hands over at a time (_hand_over): from
# the second block on they go to disk (``output.results.PassRows``). A block's rows take about
# 1 KB a pass while they are made into a frame: LRU on the 76.8 M-access benchmark trace
# (600,000 passes, --no-write) peaked at 575-590 MiB in blocks of 65,536 passes, 517-553 of
# 16,384 and 505-526 of 8,192, in the same times (6.4-7.7, 6.1-6.9 and 6.1-7.1 s; interleaved
# runs, issue 34)
BLOCK_PASSES = 1 << 13


def _belady_positions(keys: np.ndarray, num_keys: int) -> tuple[np.ndarray, np.ndarray]:
    """Every key's access indices, ascending, as CSR arrays."""
    order = np.argsort(keys, kind="stable").astype(np.int64)
    counts = np.bincount(keys, minlength=num_keys)
    kpos_off = np.zeros(num_keys + 1, np.int64)
    np.cumsum(counts, out=kpos_off[1:])
    return kpos_off, order


def _layout(num_keys: int, pool: int, pend_max: int, maxn: int, top_k: int = 1, fin: int = 1,
            lrun: int = 1, nprec: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """The state arrays, initialised: regions after the headers, their offsets in ``IS``.
    Every precision (``nprec``) is one byte and takes one second to copy until set
    (``H_PBYTES``, ``H_PDUR``); the only precision level is the default, 0."""
    i_sizes = ((H_KI, num_keys * K_NKI), (H_TI, pool * T_NTI), (H_DQ, pool), (H_PFQ, pool), (H_RQ, pool),
               (H_FREE, pool), (H_WQ, num_keys), (H_PENDA, pend_max * 3), (H_MEMB, num_keys),
               (H_LGEN, num_keys), (H_LADM, num_keys), (H_LMARK, num_keys), (H_RUNS, 4 * max(1, maxn)),
               (H_LRUN, 2 * 4 * lrun), (H_SPEC, 2 * lrun), (H_ROUTED, num_keys), (H_LSQ, 4 * num_keys),
               (H_PFTMP, pool), (H_FIN, fin), (H_LEVELS, nprec), (H_PBYTES, nprec), (H_VICT, 2 * num_keys))
    f_sizes = ((H_KF, num_keys * F_NKF), (H_TF, pool * T_NTF), (H_SCR, 2 * max(1, maxn)), (H_MSCR, 2 * top_k),
               (H_PDUR, nprec))
    n_i, n_f = I_HEADER, F_HEADER
    offsets = {}
    for h, size in i_sizes:
        offsets[h], n_i = n_i, n_i + size
    for h, size in f_sizes:
        offsets[h], n_f = n_f, n_f + size
    IS = np.zeros(n_i, np.int64)
    FS = np.zeros(n_f)
    for h, o in offsets.items():
        IS[h] = o
    IS[H_POOL], IS[H_NKEYS], IS[H_PENDMAX] = pool, num_keys, pend_max
    IS[S_HEAD] = IS[S_TAIL] = -1
    IS[C_LRUNCAP] = lrun
    IS[S_PINGEN] = IS[S_PENDGEN] = IS[S_MARKGEN] = 1
    IS[S_FREEN] = pool
    ki = IS[IS[H_KI]:IS[H_KI] + num_keys * K_NKI].reshape(num_keys, K_NKI)
    for col in (K_TID, K_CURPASS, K_PREV, K_NEXT, K_MEMB, K_EVICTED, K_ACCPASS):
        ki[:, col] = -1
    IS[IS[H_FREE]:IS[H_FREE] + pool] = np.arange(pool - 1, -1, -1)
    IS[IS[H_LGEN]:IS[H_LGEN] + num_keys] = 1
    IS[IS[H_LSQ]:IS[H_LSQ] + 4 * num_keys] = -1
    IS[C_NPREC] = nprec
    IS[C_NLEV] = 1
    IS[C_NBYTES] = 1
    IS[IS[H_PBYTES]:IS[H_PBYTES] + nprec] = 1
    FS[IS[H_PDUR]:IS[H_PDUR] + nprec] = 1.0
    return IS, FS


_NO_MASS = (np.zeros(1, np.int64), np.zeros(2, np.int64), np.zeros((1, 1), np.int16),
            np.zeros((1, 1), np.float32), np.zeros(1, np.int64), np.zeros(1, np.int64),
            np.zeros((1, 1), np.float32), np.zeros(1, np.int64), np.zeros(1, np.int64))


def _mass_arrays(sim: Any) -> tuple[np.ndarray, ...]:
    """What the per-token functions read: the trace's rows of each (pass, layer) in order
    (CSR), its experts, the mass per row (router probabilities when the trace has them, else
    the top-k weights), each row's token (request, position) numbered, a mark per token, the
    next-layer predictions (speculative) and per token its row in the latest layer replayed
    and that layer's (pass, layer) index."""
    wl = sim.wl
    trace = wl.trace
    assert trace is not None
    assert wl.row_order is not None
    assert wl.row_off is not None
    mass = wl.probs if wl.probs is not None else trace.weights
    tok = trace.request.astype(np.int64) * (int(trace.position.max(initial=0)) + 1) + trace.position
    _, token = np.unique(tok, return_inverse=True)
    n_tok = int(token.max(initial=0)) + 1
    return (np.ascontiguousarray(wl.row_order, np.int64), np.ascontiguousarray(wl.row_off, np.int64),
            np.ascontiguousarray(trace.experts, np.int16), np.ascontiguousarray(mass, np.float32),
            token.astype(np.int64), np.full(n_tok, -1, np.int64),
            np.ascontiguousarray(wl.pred_next, np.float32) if wl.pred_next is not None else _NO_MASS[6],
            np.zeros(n_tok, np.int64), np.full(n_tok, -1, np.int64))


def _precisions(sim: Any, miss: int, max_rows: int, IS: np.ndarray, FS: np.ndarray) -> np.ndarray:
    """Per precision (largest first): entry bytes, copy seconds and the expert seconds by
    token count (another precision's as the per-token lookup path computes it; only a
    precision cascade reads those rows); the precisions the miss policy fetches at (a
    cascade's, else the scenario's). Returns ``DF``: the seconds table, then the per-pass
    factor."""
    sizes = [int(sim.model.expert_bytes[q]) for q in sim.precisions]
    cascade = miss in (MISS_LOWEST_BIT, MISS_PRIORITY)
    IS[C_NPREC], IS[C_DPREC], IS[C_NBYTES] = sim.num_prec, sim.default_prec, sim.expert_bytes
    IS[IS[H_PBYTES]:IS[H_PBYTES] + sim.num_prec] = sizes
    FS[IS[H_PDUR]:IS[H_PDUR] + sim.num_prec] = [sim.copy.duration(nb) for nb in sizes]
    levels = list(sim.miss.levels) if cascade else [sim.default_prec]
    IS[IS[H_LEVELS]:IS[H_LEVELS] + len(levels)] = levels
    IS[C_NLEV] = len(levels)
    IS[C_IMPORTANT] = sim.miss.important_ranks if miss == MISS_PRIORITY else 0
    IS[C_MULTI] = cascade  # only a cascade caches other precisions
    table, scale = sim.ffn_table(max_rows)  # a substitute computes up to all of a layer's tokens
    rows = np.zeros((sim.num_prec, len(table)))
    for q, nb in enumerate(sizes):
        if q == sim.default_prec:
            rows[q] = table
        elif cascade and sim.scenario.timing:
            rows[q, 1:] = [sim.cost.expert_time_at(n, nb) for n in range(1, len(table))]
    IS[H_TTAB], IS[H_SCALE], IS[C_TLEN] = sim.default_prec * len(table), rows.size, len(table)
    return np.concatenate([rows.ravel(), scale])


_ANNOUNCE: dict[str, Any] = {}  # "say": told when this process starts compiling a kernel form


def form_of(args: tuple[Any, ...]) -> str:
    """Which form of the kernel a compile of :func:`replay_passes` with these argument types
    makes (``M`` and ``per_expert`` are None where the scenario cannot reach their code)."""
    names = getattr(replay_passes, "py_func", replay_passes).__code__.co_varnames
    types = dict(zip(names, args, strict=False))
    mode = "layer or on-arrival" if str(types["per_expert"]) == "none" else "per-expert"
    miss = "fetch on a miss" if str(types["M"]) == "none" else "a per-token miss policy"
    return f"{mode} execution, {miss}"


def announce_compiles(say: Any) -> None:
    """Call ``say(form)`` when this process starts compiling a form of the replay kernel (a
    numba cache miss: the first replay of that form after an installation, or after an
    upgrade changed the kernel); numba's compile event fires for a compile only, never for a
    load from its cache. A later call replaces ``say``."""
    first = not _ANNOUNCE
    _ANNOUNCE["say"] = say
    if not first or not HAVE_NUMBA:
        return
    from numba.core import event

    class _Listener(event.Listener):
        def on_start(self, ev: Any) -> None:
            if ev.data["dispatcher"].py_func is getattr(replay_passes, "py_func", None):
                _ANNOUNCE["say"](form_of(tuple(ev.data["args"])))

        def on_end(self, ev: Any) -> None:
            pass

    event.register("numba:compile", _Listener())


def compile_message(form: str) -> str:
    """The line a run says as it starts compiling the kernel's ``form`` (measured on the 2-core
    CI machine with numba's cache emptied: README, Speed)."""
    return (f"moesim: compiling the replay kernel's form for {form}, once for this installation "
            f"(measured on a 2-core machine: 25-29 s for layer execution with fetch on a miss, 40-46 s "
            f"per-expert, 41-43 s with a per-token miss policy, 84-103 s both); later runs load it from numba's "
            f"cache.")


def load_cached_forms() -> int:
    """Load into this process every form of the replay kernel that numba's on-disk cache holds
    for this installation and this machine's code generator (none when the kernel changed
    since; a cache folder shared with another CPU may hold forms this one would have to
    compile); returns how many."""
    cache = getattr(replay_passes, "_cache", None)
    try:
        index = cache._cache_file._load_index() if cache is not None else {}  # numba's cache index
        magic = replay_passes.targetctx.codegen().magic_tuple() if index else None
    except (AttributeError, OSError, EOFError):  # another numba's internals, or a damaged index
        return 0
    forms = [key[0] for key in index if key[1] == magic]  # a key: (signature, codegen, source hashes)
    for sig in forms:
        replay_passes.compile(sig)  # a load from the cache
    return len(forms)


def _belady_piece(sim: Any, wl: Any, firsts: np.ndarray, afters: np.ndarray, k: int) -> tuple[int, np.ndarray]:
    """Piece ``k``'s first access and its keys' first accesses after it, from Belady's first
    pass over the file, checked against the piece now read (the file may have changed)."""
    if k + 1 >= len(firsts) or int(firsts[k + 1] - firsts[k]) != len(wl.acc_layer):
        from moesim.errors import MoesimError

        raise MoesimError(f"trace {sim.stream_source[0]}: the file changed while Belady replayed it (piece {k + 1} "
                          "has other accesses than its first pass read). Replay it again once nothing writes it.")
    return int(firsts[k]), afters[k]


def _piece(sim: Any, wl: Any, ev: int, miss: int, max_rows: int, IS: np.ndarray,
           FS: np.ndarray, hooks: tuple[Any, ...], after: tuple[int, np.ndarray] | None = None) -> tuple[Any, ...]:
    """The kernel's read-only data for the passes of ``wl`` (the whole trace's workload, or a
    piece of it): ``DI`` = access offsets | pass groups | (Belady) each key's access indices
    in ``wl`` and its first access after it (``after``: the piece's first access and that
    array, counted over the whole trace, :func:`simulator.stream.belady_after`; None: ``wl`` is
    the whole trace, which starts at 0 with nothing after it);
    ``A`` = the per-access arrays (layer, expert, tokens routed, summed gate weight, best
    router rank) and ``hooks`` (:func:`_hooks`); ``DF`` = expert seconds by token count | per-pass factor; ``M`` = the
    per-token arrays; the non-expert seconds of each pass. Region offsets go to ``IS``."""
    num_keys = IS[H_NKEYS]
    parts = [np.ascontiguousarray(wl.off, dtype=np.int64), np.asarray(wl.pass_group, np.int64)]
    if ev == EV_BELADY:
        first, later = after if after is not None else (0, np.full(num_keys, -1, np.int64))
        parts.extend(_belady_positions(wl.cache_keys(sim.num_prec, sim.default_prec), num_keys))
        parts.append(later)
        IS[S_ABASE] = first
    starts = np.cumsum([0] + [len(x) for x in parts])
    DI = np.concatenate(parts)
    del parts
    IS[H_OFF], IS[H_GROUP] = starts[0], starts[1]
    if ev == EV_BELADY:
        IS[H_KPOSOFF], IS[H_KPOS], IS[H_KNEXT] = starts[2], starts[3], starts[4]
    A = (wl.acc_layer, wl.acc_expert, wl.acc_tokens, wl.acc_weight, wl.acc_rank, hooks)
    DF = _precisions(sim, miss, max_rows, IS, FS)
    M = _mass_arrays(sim) if miss != MISS_FETCH else None
    return DI, A, DF, M, sim.nonexpert_times()


def _configure(sim: Any, IS: np.ndarray, FS: np.ndarray, ev: int, pf: int, miss: int, max_runs: int) -> None:
    """The replay's configuration (``C_*``, ``CF_*``) from ``sim``'s scenario and policies."""
    from moesim.policies.eviction import LeastStale
    from moesim.policies.prefetch import Lookahead

    model = sim.model
    params = sim.eviction.params
    reroute = miss in (MISS_DROP, MISS_SUBSTITUTE, MISS_SPECULATIVE)
    IS[C_EV] = ev
    IS[C_STABLE] = ev == EV_HOOK and hook_form(type(sim.eviction)).stable_priority
    IS[C_LS_REL] = isinstance(sim.eviction, LeastStale) and params.order == "relative"
    IS[C_PF] = pf
    IS[C_DEPTH] = sim.prefetch.params.depth if isinstance(sim.prefetch, Lookahead) else 0
    IS[C_BLOCKING] = sim.scenario.expert_fetch == "blocking"
    IS[C_HOST] = sim.host_on
    IS[C_HSYNC] = sim.host_sync
    FS[CF_HLAYER], FS[CF_HLAUNCH], FS[CF_HCOPY] = sim.host_layer, sim.host_launch, sim.host_copy
    IS[C_MODE] = {"layer": MODE_LAYER, "on-arrival": MODE_ARRIVAL, "per-expert": MODE_PER_EXPERT}[
        sim.scenario.expert_compute]
    IS[C_INSTANT] = not sim.scenario.timing
    IS[C_L] = model.num_layers
    IS[C_DIV] = model.num_experts * sim.num_prec
    IS[C_PFACTIVE] = sim.prefetch.active
    IS[C_MAXN] = max_runs
    FS[CF_CAP] = float(sim.capacity)
    IS[C_MISS] = miss
    IS[C_REROUTE] = reroute
    IS[C_DROPRANK] = sim.miss.params.rank if miss == MISS_DROP else -1
    IS[C_K] = model.top_k
    IS[C_NE] = model.num_experts
    IS[C_PROBS] = miss != MISS_FETCH and sim.wl.probs is not None


def next_piece(pieces: Generator[Any, float, None], now: float) -> Any:
    """The next piece, or None after the last. ``now`` (the simulated time the previous piece
    ended) goes to the source: a trace file's pieces ignore it; serving's scheduler
    (:mod:`simulator.serving`) forms the next forward pass from it."""
    try:
        return pieces.send(now)
    except StopIteration:
        return None


def _proposals_ahead(prefetch: Any, n_pass: int) -> Any:
    """A prefetcher's proposals (``proposals``, what the kernel reads) chunk by chunk over a
    piece's ``n_pass`` passes, the next chunk's made on a second thread while the kernel
    replays this one: they depend on the trace alone, and the kernel and score-percentile's
    compiled proposals both release the GIL (issue 34: score-percentile's proposals took a
    third of a least-stale + score-percentile replay's time on the main thread)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1) as ahead:
        nxt = ahead.submit(prefetch.proposals, 0, min(CHUNK, n_pass))
        for q0 in range(0, n_pass, CHUNK):
            q1 = min(q0 + CHUNK, n_pass)
            done = nxt.result()
            if q1 < n_pass:
                nxt = ahead.submit(prefetch.proposals, q1, min(q1 + CHUNK, n_pass))
            yield done


def _chunks_of(proposals: tuple[np.ndarray, np.ndarray], n_pass: int, num_l: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """A piece's proposals made as it was read (``Workload.proposals``), as :func:`_proposals_ahead`
    hands them over: chunk by chunk, each chunk's offsets from 0."""
    off, keys = proposals
    for q0 in range(0, n_pass, CHUNK):
        o = off[q0 * num_l:min(q0 + CHUNK, n_pass) * num_l + 1]
        yield o - o[0], keys[o[0]:o[-1]]


def _hand_over(sim: Any, parts: list[Any] | None, outs: list[tuple[Any, ...]], miss: int, n_pieces: int) -> None:
    """Give ``sim`` the per-pass columns of the pieces replayed since the last hand-over
    (``outs``; ``parts``: their passes and requests, joined here, or None for the whole
    workload ``sim`` already holds), which it turns into per-pass rows
    (:meth:`simulator.engine.Simulation.take_rows`). A trace read in pieces hands its
    passes over about :data:`BLOCK_PASSES` at a time, so that they need
    not all be in memory at once."""
    cols, t_start, t_end, stall, m_total, m_kept = (np.concatenate(x) for x in zip(*outs, strict=True))
    if parts is not None:
        sim.adopt(join(parts), n_pieces)
    for i, name in enumerate(COLUMNS):
        sim._cols[name][:] = cols[:, i]
    sim._t_start[:] = t_start
    sim._t_end[:] = t_end
    sim._stall[:] = stall
    if miss != MISS_FETCH:  # the per-token path's gate mass (else the workload's, as there)
        sim._mass_total[:] = m_total
        sim._mass_kept[:] = m_kept
    sim.take_rows()


def replay(sim: Any) -> None:
    """Replay ``sim`` with the kernel, filling its per-pass arrays, the copy engine's busy
    time and bytes, and the cache's high-water mark, as its SimPy process would. A trace read
    in pieces (``sim.pieces``, :mod:`simulator.stream`) is replayed piece after piece with
    the state carried over (the same arithmetic on the same state: ``S_PBASE`` maps a pass
    to its piece's arrays), and ``sim`` then adopts the joined passes."""
    with warnings.catch_warnings():
        if HAVE_NUMBA:  # the hooks in ``A[U]`` are numba's first-class functions, "experimental"
            from numba.core.errors import NumbaExperimentalFeatureWarning

            warnings.simplefilter("ignore", NumbaExperimentalFeatureWarning)
        try:
            _replay(sim)
        finally:
            forget_tuples()  # the replay's arrays, kept by the compiled loops with their types


@contextlib.contextmanager
def _hook_errors(sim: Any) -> Iterator[None]:
    """Around the compiled calls: an error a compiled hook raised (its index checks; the
    kernel raises none of these itself) as one paragraph naming the hook policies."""
    from moesim.policies.hooks import HookEviction, HookPrefetch

    try:
        yield
    except (IndexError, ZeroDivisionError, ValueError, OverflowError) as exc:
        hooked = [f"{family} policy '{p.name}'" for family, p in (("eviction", sim.eviction), ("prefetch", sim.prefetch))
                  if isinstance(p, (HookEviction, HookPrefetch))]
        if not hooked:
            raise
        from moesim.errors import MoesimError

        raise MoesimError(
            f"{' or '.join(hooked)}: a compiled hook raised {type(exc).__name__}: {exc} during the replay. "
            "Run it with MOESIM_NO_KERNEL=1: the SimPy path calls the hooks as written and names the hook, "
            "the forward pass and the layer.") from None


def _replay(sim: Any) -> None:
    misses = _policy_codes()[2]
    wl, model = sim.wl, sim.model
    num_l = model.num_layers
    div = model.num_experts * sim.num_prec
    num_keys = num_l * div
    streamed = sim.pieces is not None
    # a layer's distinct experts (a piece's largest is not the trace's: the bound when in pieces)
    maxn = model.num_experts if streamed else int(np.diff(wl.off).max(initial=0))
    ev = eviction_code(type(sim.eviction))
    assert ev is not None, "kernel_form"
    pf = _prefetch_code(sim.prefetch)
    assert pf is not None, "kernel_form"
    pool = num_keys + maxn + 16
    pend_max = num_keys + 16
    miss = misses[type(sim.miss)]
    assert not streamed or miss == MISS_FETCH, "simulator.stream.why_whole"
    max_rows = int(np.diff(wl.row_off).max(initial=0)) if miss != MISS_FETCH and wl.row_off is not None else 0
    reroute = miss in (MISS_DROP, MISS_SUBSTITUTE, MISS_SPECULATIVE)
    # a layer computes its routed experts and, for a miss policy that re-routes, others
    max_runs = maxn + (model.num_experts if reroute else 0)
    IS, FS = _layout(num_keys, pool, pend_max, max_runs, model.top_k, max(1, max_rows * model.top_k),
                     max(1, max_rows), sim.num_prec)
    _configure(sim, IS, FS, ev, pf, miss, max_runs)
    hooks = _hooks(sim.eviction, IS[IS[H_MEMB]:IS[H_MEMB] + num_keys])
    # Belady a piece at a time: a first pass over the file finds each piece's first access and
    # every key's first access after the piece (the progress shown covers the first passes too)
    firsts: Any = None
    if streamed and ev == EV_BELADY:
        firsts, afters = sim.belady_after()
    shown, total = sim.rows_shown, (1 + sim.first_passes) * sim.trace_rows  # after the first passes
    DI, A, DF, M, nonexp = _piece(sim, wl, ev, miss, max_rows, IS, FS, hooks,
                                  None if firsts is None else _belady_piece(sim, wl, firsts, afters, 0))
    pinned = [int(k) for k in sim.prefetch.pinned()]
    if pinned:
        with _hook_errors(sim):
            _preload(np.asarray(pinned, np.int64), IS, FS, DI, DF, A)
    no_props = (np.zeros(1, np.int64), np.zeros(0, np.int64))
    per_expert = True if IS[C_MODE] == MODE_PER_EXPERT else None  # else its code is not compiled
    outs: list[tuple[Any, ...]] = []  # the per-pass columns of the pieces not handed over yet
    parts: list[Any] = []  # and those pieces' passes and requests
    rows_done, n_pieces = 0, 0  # trace rows and pieces replayed
    base, held = 0, 0  # passes of the pieces before this one, and of those in ``outs``
    while True:
        n_pass = wl.num_passes
        release = np.ascontiguousarray(wl.release(), np.float64)
        cols = np.zeros((n_pass, R_COUNT), np.int64)
        t_start, t_end, stall = np.zeros(n_pass), np.zeros(n_pass), np.zeros(n_pass)
        m_total, m_kept = np.zeros(n_pass), np.zeros(n_pass)
        IS[S_PBASE] = base
        props = None
        if pf == PF_ARRAY:
            props = (_chunks_of(wl.proposals, n_pass, num_l) if wl.proposals is not None
                     else _proposals_ahead(sim.prefetch, n_pass))
        for q0 in range(0, n_pass, CHUNK):
            q1 = min(q0 + CHUNK, n_pass)
            with _hook_errors(sim):  # the compiled hooks run here (and make the proposals ahead)
                P = next(props) if props is not None else no_props
                replay_passes(base + q0, base + q1, IS, FS, DI, DF, A, P, M, per_expert, nonexp[q0:q1],
                              release[q0:q1], cols[q0:q1], t_start[q0:q1], t_end[q0:q1], stall[q0:q1],
                              m_total[q0:q1], m_kept[q0:q1])
            if sim.progress is not None:
                if sim.serving is not None:  # requests served
                    sim.progress(sim.serving.finished, sim.serving.n)
                elif streamed:  # the share of the file's rows replayed
                    sim.progress(shown + rows_done + len(wl.trace) * q1 // n_pass, total)
                else:
                    sim.progress(q1, n_pass)
        outs.append((cols, t_start, t_end, stall, m_total, m_kept))
        n_pieces += 1
        base += n_pass
        held += n_pass
        if not streamed:
            _hand_over(sim, None, outs, miss, n_pieces)
            break
        parts.append(passes_of(wl))  # its per-access and per-row arrays go with the piece
        rows_done += len(wl.trace)
        nxt = next_piece(sim.pieces, float(FS[SF_NOW]))  # serving: formed now the last has ended
        if nxt is None or held >= BLOCK_PASSES:
            _hand_over(sim, parts, outs, miss, n_pieces)
            outs, parts, held = [], [], 0
        if nxt is None:
            break
        del DI, A, DF, M, nonexp
        wl = nxt
        sim.bind_piece(wl)
        DI, A, DF, M, nonexp = _piece(sim, wl, ev, miss, max_rows, IS, FS, hooks,
                                      None if firsts is None else _belady_piece(sim, wl, firsts, afters, n_pieces))
    _finish(IS, FS, DI, DF, A)
    if sim.stream_source is not None:
        sim.check_source()  # the file the pieces came from is the one the first passes read
    sim.copy.busy_time = float(FS[SF_BUSY])
    sim.copy.bytes_moved = int(IS[S_BYTES])
    sim.cache.max_used = int(IS[S_MAXUSED])

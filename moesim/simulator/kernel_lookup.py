"""The replay kernel's lookup path (:mod:`simulator.lookup`'s model): hit, late prefetch or
miss per routed expert, and the miss policies (fetch; drop, substitute and speculative with the
per-token gate mass; the precision cascades). What a miss policy decides is its compiled form's
(:mod:`moesim.policies.miss.forms`, picked by its index ``IS[C_MISS]``); the kernel carries it out."""

from __future__ import annotations

import numpy as np

from moesim.jit import inline as _inline
from moesim.jit import kernel as _jit
from moesim.jit import literal_unroll
from moesim.kernel_state import (
    ABSENT,
    C_DPREC,
    C_INSTANT,
    C_K,
    C_LOOKUP,
    C_MISS,
    C_MISSARG,
    C_MULTI,
    C_NE,
    C_NLEV,
    DEMAND,
    INFLIGHT,
    R_COLL,
    R_DROPPED,
    R_HITS,
    R_LATE,
    R_LOWPREC,
    R_MISSES,
    R_SUBST,
    R_UNCACHED,
    RESIDENT,
    S_LAYER,
    S_LAYERGEN,
    S_LRUNN,
    S_NCOMP,
    S_PASS,
    _buffer,
    _final,
    _here,
    _key,
    _key_at,
    _level_precs,
    _nbytes,
    _prec,
    _runs,
    _spec_scratch,
)
from moesim.policies.miss.base import DROP, FETCH, SPECULATE
from moesim.policies.miss.forms import FORM_HOOKS
from moesim.simulator.kernel_cache import _insert, _on_access, _on_miss, _room, _used_prefetch
from moesim.simulator.kernel_copy import _free, _promote, _submit

# a miss form's hooks, in the order of MissForm.functions
_DECIDE, _SEARCH = range(2)


@_jit
def _fin_replace(e, e2, IS, M):
    """The layer's tokens that chose ``e`` (routed to it, or left it by the budget policy)
    compute ``e2`` in its place (-1: nothing; a token that already computes ``e2`` computes it
    once)."""
    k = IS[C_K]
    fin = _final(IS)
    row_order, row_off, chosen = M.row_order, M.row_off, M.chosen
    b = _here(IS)
    for i in range(row_off[b + 1] - row_off[b]):
        r = row_order[row_off[b] + i]
        for j in range(k):
            if chosen[r, j] == e:
                has = False
                for jj in range(k):
                    has |= e2 >= 0 and fin[i * k + jj] == e2
                fin[i * k + j] = -1 if has else e2


@_inline
def _add_run(buf, tid, key, ntok, IS, K, T, W):
    """One computation a lookup leads to: the transfer it waits for (slot and sequence; -1:
    none), its key and its tokens. A key computed for the first time in the layer (the
    engine's ``key_for``) is counted (``S_NCOMP``); with ``buf`` -1 (``layer`` and
    ``on-arrival`` execution) such a computation is appended to the layer's (:func:`_runs`),
    with ``buf`` 0 or 1 (``per-expert``) every computation goes into that lookup buffer."""
    new = K[key].computed != IS[S_LAYERGEN]
    K[key].computed = IS[S_LAYERGEN]
    if buf < 0:
        if not new:
            return
        run = _runs(IS, W)[IS[S_NCOMP]]
    else:
        n = IS[S_LRUNN + buf]
        run = _buffer(buf, IS, W)[n]
        IS[S_LRUNN + buf] = n + 1
    IS[S_NCOMP] += new
    run.tid = tid
    run.seq = T[tid].seq if tid >= 0 else -1
    run.key = key
    run.tokens = ntok


@_inline
def _needed_now(key, IS, K, T, FS):
    """The transfer of an in-flight key ``key``, needed now: a queued prefetch
    is promoted to demand priority. Returns its slot."""
    tid = K[key].tid
    if T[tid].prio != DEMAND and not T[tid].started:
        _promote(tid, IS, T, FS)
    return tid


@_jit
def _use_other(e2, ntok, pin_gen, buf, IS, K, T, W, FS, DI, A):
    """A resident or arriving expert ``e2`` computes ``ntok`` tokens of a missed one (the
    engine's ``_use_other``; substitute, speculative): a queued prefetch of it is promoted,
    the eviction policy told when it is first computed in the layer, its key pinned."""
    k2 = _key_at(IS[S_LAYER], e2, IS)
    tid = _needed_now(k2, IS, K, T, FS) if K[k2].state == INFLIGHT else -1
    if K[k2].computed != IS[S_LAYERGEN]:
        _on_access(k2, -1, IS, K, DI, A)
    K[k2].pin = pin_gen
    _add_run(buf, tid, k2, ntok, IS, K, T, W)


@_jit
def _speculate(e, pin_gen, buf, IS, K, T, W, FS, DI, A, M):
    """Speculative execution (the engine's speculate branch,
    ``speculating-experts-prefetch.txt`` §4): each token routed to the missed ``e`` computes,
    (or left it by the budget policy) in its place, its highest-predicted expert (the previous layer's ``pred_next`` for the
    same token; the lowest id on a tie, as a stable sort) that is resident or in flight and
    not already computed by the token, or nothing; each expert chosen then computes its
    tokens (:func:`_use_other`), in the order first chosen."""
    IS[R_SUBST] += 1
    row_order, row_off, chosen, token = M.row_order, M.row_off, M.chosen, M.token
    pred, prev_row, prev_stamp = M.pred, M.prev_row, M.prev_stamp
    k = IS[C_K]
    fin = _final(IS)
    b = _here(IS)
    spec = _spec_scratch(IS)
    n_spec = 0
    for i in range(row_off[b + 1] - row_off[b]):
        r = row_order[row_off[b] + i]
        for j in range(k):
            if chosen[r, j] != e:
                continue
            fin[i * k + j] = -1
            t = token[r]
            if prev_stamp[t] != b - 1:
                continue  # no prediction for this token
            src = prev_row[t]
            best = -1
            for c in range(IS[C_NE]):
                if best >= 0 and not pred[src, c] > pred[src, best]:
                    continue
                if K[_key_at(IS[S_LAYER], c, IS)].state == ABSENT:
                    continue
                dup = False
                for jj in range(k):
                    dup |= fin[i * k + jj] == c
                if not dup:
                    best = c
            if best < 0:
                continue
            fin[i * k + j] = best
            s = 0
            while s < n_spec and spec[2 * s] != best:
                s += 1
            if s == n_spec:
                spec[2 * s] = best
                spec[2 * s + 1] = 0
                n_spec += 1
            spec[2 * s + 1] += 1
    for s in range(n_spec):
        _use_other(spec[2 * s], spec[2 * s + 1], pin_gen, buf, IS, K, T, W, FS, DI, A)


@_inline
def _form_access(ai, IS):
    """The workload's access the eviction form is told of for lookup ``ai``: ``ai`` itself,
    or under a budget policy (whose lookups follow the workload's accesses, ``C_LOOKUP``) -1,
    so that the form finds the (pass, layer)'s access of the key, if the router chose it, as
    the SimPy path's policies do (its gate weight, Belady's position in the trace)."""
    return ai if IS[C_LOOKUP] == 0 else -1


@_inline
def _lookup(ai, now, pin_gen, buf, IS, K, T, W, FS, DI, A, M):
    """Look access ``ai`` up (engine's ``LayerLookup.lookup``): the computations it leads to
    go into lookup buffer ``buf`` (:func:`_add_run`): one for a hit, a late prefetch, a
    resident copy at another precision or a fetch; none when the ``drop`` miss policy skips
    the expert (router rank >= its ``rank``); the substitute; each expert the tokens
    speculate on."""
    key = _key(ai, IS, A)
    state = K[key].state
    if buf >= 0:
        IS[S_LRUNN + buf] = 0
    ntok = np.int64(A.tokens[ai])
    if state == RESIDENT:
        IS[R_HITS] += 1
        _on_access(key, _form_access(ai, IS), IS, K, DI, A)
        _used_prefetch(key, IS, K)
        _add_run(buf, -1, key, ntok, IS, K, T, W)
        return
    if state == INFLIGHT:
        IS[R_LATE] += 1
        _on_access(key, _form_access(ai, IS), IS, K, DI, A)
        _used_prefetch(key, IS, K)
        _add_run(buf, _needed_now(key, IS, K, T, FS), key, ntok, IS, K, T, W)
        return
    if M is not None and IS[C_MULTI] and _alternative(key, A.rank[ai], ntok, pin_gen, buf, IS, K, T, W, DI, A):
        return
    IS[R_MISSES] += 1
    if K[key].evicted == IS[S_PASS]:
        IS[R_COLL] += 1
    if M is not None:  # a miss policy other than ``fetch`` (compiled only for one: ``M`` is None)
        kq = _miss_policy(key, ai, ntok, now, pin_gen, buf, IS, K, T, W, FS, DI, A, M)
    else:
        kq = -1 if _fetch_at(key, _form_access(ai, IS), ntok, now, pin_gen, buf, IS, K, T, W, FS, DI, A) else key
    if kq < 0:
        return
    tid = _submit(kq, DEMAND, now, 1, IS, T, FS)
    IS[R_UNCACHED] += 1
    IS[R_LOWPREC] += _prec(kq, IS) != IS[C_DPREC]
    if IS[C_INSTANT]:
        _free(tid, IS)
        tid = -1
    _add_run(buf, tid, kq, ntok, IS, K, T, W)


@_inline
def _miss_policy(key, ai, ntok, now, pin_gen, buf, IS, K, T, W, FS, DI, A, M):
    """A miss of access ``ai`` under a miss policy other than ``fetch`` (the rest of the
    engine's ``LayerLookup.lookup``): drop, substitute, speculate, or fetch (down a precision
    cascade). Returns -1 when the miss is dealt with, else the key to fetch uncached."""
    e = np.int64(A.expert[ai])
    d = _decide(e, A.rank[ai], IS, K, M)
    if d == DROP:  # SpecMD §3.1.2
        IS[R_DROPPED] += 1
        _fin_replace(e, -1, IS, M)
        return -1
    if d == SPECULATE:
        _speculate(e, pin_gen, buf, IS, K, T, W, FS, DI, A, M)
        return -1
    if d >= 0:  # substitute expert d
        IS[R_SUBST] += 1
        _fin_replace(e, d, IS, M)
        _use_other(d, ntok, pin_gen, buf, IS, K, T, W, FS, DI, A)
        return -1
    # fetch (the fetch in the engine's ``LayerLookup.lookup``): at the scenario's precision or down a precision
    # cascade; when no room can be made, an uncached fetch (at the cascade's last precision)
    fa = _form_access(ai, IS)
    if IS[C_MULTI]:
        return _cascade(key, A.rank[ai], fa, ntok, now, pin_gen, buf, IS, K, T, W, FS, DI, A)
    return -1 if _fetch_at(key, fa, ntok, now, pin_gen, buf, IS, K, T, W, FS, DI, A) else key


@_inline
def _fetch_at(kq, aq, ntok, now, pin_gen, buf, IS, K, T, W, FS, DI, A):
    """Fetch ``kq`` (a cache key of the missed expert, ``aq`` its access or -1) when room
    can be made for it: pinned, a demand transfer, an in-flight entry. Returns whether it
    was. The eviction policy hears of the miss first (``on_miss``)."""
    _on_miss(kq, IS, K, A)
    if _room(_nbytes(kq, IS), False, pin_gen, -1, IS, K, FS, A) == -1:
        return False
    K[kq].pin = pin_gen
    tid = _submit(kq, DEMAND, now, 0, IS, T, FS)
    _insert(kq, tid, True, aq, IS, K, T, DI, A)
    if IS[C_MULTI]:
        IS[R_LOWPREC] += _prec(kq, IS) != IS[C_DPREC]
    _add_run(buf, -1 if IS[C_INSTANT] else tid, kq, ntok, IS, K, T, W)
    return True


@_inline
def _use_copy(kq, ntok, pin_gen, buf, IS, K, T, W, DI, A):
    """The missed expert computes from its resident copy ``kq`` at another precision (the
    absent key is never resident): a use, pinned, a low-precision computation."""
    _on_access(kq, -1, IS, K, DI, A)  # no access of the layer has this key
    K[kq].pin = pin_gen
    IS[R_LOWPREC] += 1
    _add_run(buf, -1, kq, ntok, IS, K, T, W)


@_jit
def _alternative(key, rank, ntok, pin_gen, buf, IS, K, T, W, DI, A):
    """A precision cascade's resident copy of the missed ``key`` at another precision (the
    policy's ``alternative``), used as a hit: returns whether there was one."""
    alo, ahi, _, _ = _levels(rank, IS)
    precs = _level_precs(IS)
    for li in range(alo, ahi):
        kq = key - IS[C_DPREC] + precs[li]
        if K[kq].state == RESIDENT:
            IS[R_HITS] += 1
            _use_copy(kq, ntok, pin_gen, buf, IS, K, T, W, DI, A)
            return True
    return False


@_jit
def _cascade(key, rank, ai, ntok, now, pin_gen, buf, IS, K, T, W, FS, DI, A):
    """A precision cascade's fetch of the missed ``key`` (the fetch in the engine's ``LayerLookup.lookup`` with
    several precisions): the first of its precisions that is resident is used, or fetched
    when room can be made for it. Returns -1, or the key of the last precision when none
    could be (for an uncached fetch)."""
    _, _, flo, fhi = _levels(rank, IS)
    precs = _level_precs(IS)
    for li in range(flo, fhi):
        kq = key - IS[C_DPREC] + precs[li]
        if K[kq].state == RESIDENT:
            _use_copy(kq, ntok, pin_gen, buf, IS, K, T, W, DI, A)
            return -1
        aq = ai if kq == key else -1  # the policies find no access of another precision's key
        if _fetch_at(kq, aq, ntok, now, pin_gen, buf, IS, K, T, W, FS, DI, A):
            return -1
    return key - IS[C_DPREC] + precs[fhi - 1]


@_inline
def _levels(rank, IS):
    """For a missed expert of best router rank ``rank``: the range of the cascade's levels
    (:func:`~moesim.kernel_state._level_precs`: their precision indices) searched for a resident copy, and the range to fetch from (the miss
    form's ``search``)."""
    f = IS[C_MISS]
    out = (0, 0, 0, 0)
    i = 0
    for form in literal_unroll(FORM_HOOKS):
        if i == f:
            out = form[_SEARCH](rank, IS[C_NLEV], IS[C_MISSARG])
        i += 1
    return out


@_inline
def _decide(e, rank, IS, K, M):
    """The miss form's ``decide`` for missed expert ``e`` of best router rank ``rank``:
    ``FETCH``, ``DROP``, ``SPECULATE`` or the expert to substitute."""
    f = IS[C_MISS]
    d = FETCH
    i = 0
    for form in literal_unroll(FORM_HOOKS):
        if i == f:
            d = form[_DECIDE](e, rank, IS[C_MISSARG], IS, K, M)
        i += 1
    return d

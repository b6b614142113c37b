"""The replay kernel's compute stream and its entry point: a layer's lookups, proposals and
expert compute in the three ``expert_compute`` modes (``layer``, ``on-arrival``,
``per-expert``), the host's launches, the per-token gate mass, and :func:`replay_passes`, the
compiled loop over forward passes that :func:`simulator.kernel.replay` calls."""

from __future__ import annotations

import numpy as np

from moesim.jit import inline as _inline
from moesim.jit import jit as _entry
from moesim.jit import kernel as _jit
from moesim.jit import literal_unroll
from moesim.kernel_state import (
    C_BLOCKING,
    C_DIV,
    C_HOST,
    C_HSYNC,
    C_INSTANT,
    C_K,
    C_L,
    C_LOOKUP,
    C_MODE,
    C_NBYTES,
    C_NE,
    C_NPREC,
    C_PENDING,
    C_PFACTIVE,
    C_PROBS,
    C_RECPASS,
    C_REROUTE,
    C_ROUTE,
    CF_CAP,
    CF_HCOPY,
    CF_HLAUNCH,
    CF_HLAYER,
    LOG_LAYER,
    MODE_LAYER,
    R_ALTERED,
    R_BYTES,
    R_COUNT,
    R_FIRST,
    R_UNIQUE,
    RESIDENT,
    S_BYTES,
    S_LAYER,
    S_LAYERGEN,
    S_LRUNN,
    S_MAXUSED,
    S_NCOMP,
    S_NDEM,
    S_PASS,
    S_PBASE,
    S_PENDGEN,
    S_PINGEN,
    S_REC,
    S_USED,
    S_WN,
    SF_CARRY,
    SF_HOST,
    SF_MKEPT,
    SF_MTOTAL,
    SF_NOW,
    SF_STALL,
    _buffer,
    _ffn,
    _final,
    _here,
    _key,
    _mass_scratch,
    _new_gen,
    _pass_factors,
    _ready_scratch,
    _record,
    _routed,
    _row_base,
    _runs,
    _seconds_scratch,
)
from moesim.policies.routing.forms import ROUTE_HOOKS
from moesim.simulator.kernel_cache import _kept_out, _new_pass, _on_insert
from moesim.simulator.kernel_copy import _advance, _arrival
from moesim.simulator.kernel_lookup import _lookup
from moesim.simulator.kernel_prefetch import _admit, _propose, _withdraw


@_jit
def _mark_pending(lo, hi, IS, K, A):
    """The layer's experts are pending until they run (``Clock.pending``; marked for an
    eviction form that reads it, ``C_PENDING``)."""
    pend = _new_gen(IS, S_PENDGEN)
    if IS[C_PENDING]:
        for j in range(lo, hi):
            K[_key(j, IS, A)].pend = pend


@_inline
def _tokens_of(key, tokens, p, IS, M):
    """How many of the layer's tokens finally compute ``key``: ``tokens`` unless the miss
    policy re-routes tokens (``C_REROUTE``: drop, substitute, speculative), else counted in
    :func:`~moesim.kernel_state._final`."""
    if M is None or not IS[C_REROUTE]:
        return tokens
    e = (key % IS[C_DIV]) // IS[C_NPREC]
    b = _here(IS)
    n = 0
    fin = _final(IS)
    for i in range((M.row_off[b + 1] - M.row_off[b]) * IS[C_K]):
        n += fin[i] == e
    return n


@_jit
def _layer(p, layer, lo, hi, now, p0, IS, K, T, W, FS, DI, DF, A, P, M):
    """``layer`` and ``on-arrival`` execution of one layer (engine's ``_run`` body,
    ``LayerLookup.finish`` and ``_compute``); returns the layer's end. Stall accumulates in
    ``FS[SF_STALL]``."""
    _mark_pending(lo, hi, IS, K, A)
    if IS[C_PFACTIVE]:
        _withdraw(layer, lo, hi, now, IS, K, T, W, FS, A)
    pins = _new_gen(IS, S_PINGEN)
    for j in range(lo, hi):
        K[_key(j, IS, A)].pin = pins
    IS[S_NCOMP] = 0
    copies = IS[S_NDEM]
    for i in range(hi - lo):
        _lookup(lo + i, now, pins, -1, IS, K, T, W, FS, DI, A, M)
    if IS[C_HOST]:  # the host submits the layer's demand copies
        FS[SF_HOST] += (IS[S_NDEM] - copies) * FS[CF_HCOPY]
    computed = IS[S_NCOMP]
    if IS[C_PFACTIVE]:
        _propose(p, layer, p0, now, pins, IS, K, T, W, FS, DI, A, P)
    scale = _pass_factors(IS, DF)[p - IS[S_PBASE]]
    runs = _runs(IS, W)
    if IS[C_MODE] == MODE_LAYER:
        ready = now
        total = 0.0
        for i in range(computed):
            run = runs[i]
            a = _arrival(run.tid, run.seq, now, T)
            if a > ready:
                ready = a
            total += _ffn(run.key, _tokens_of(run.key, run.tokens, p, IS, M), DF, IS) * scale
        FS[SF_STALL] += ready - now
        if IS[C_HOST] and computed:  # one launch for the layer's experts
            FS[SF_HOST] += FS[CF_HLAUNCH]
            if FS[SF_HOST] > ready:
                ready = FS[SF_HOST]
        end = ready + total
    else:  # on-arrival: in arrival order (ties by compute time), each when it has arrived
        ready, secs = _ready_scratch(IS, FS), _seconds_scratch(IS, FS)
        for i in range(computed):
            run = runs[i]
            a = _arrival(run.tid, run.seq, now, T)
            f = _ffn(run.key, _tokens_of(run.key, run.tokens, p, IS, M), DF, IS) * scale
            j = i
            while j > 0 and (ready[j - 1] > a or (ready[j - 1] == a and secs[j - 1] > f)):
                ready[j] = ready[j - 1]
                secs[j] = secs[j - 1]
                j -= 1
            ready[j] = a
            secs[j] = f
        t = now
        for i in range(computed):
            if IS[C_HOST]:  # one launch per expert, after the GPU has run the last (sync: expert)
                if IS[C_HSYNC] == 2 and FS[SF_HOST] < t:
                    FS[SF_HOST] = t
                FS[SF_HOST] += FS[CF_HLAUNCH]
            if ready[i] > t:
                FS[SF_STALL] += ready[i] - t
                t = ready[i]
            if IS[C_HOST] and FS[SF_HOST] > t:
                t = FS[SF_HOST]
            t += secs[i]
        end = t
    _new_gen(IS, S_PENDGEN)  # the layer's experts have run
    if IS[S_WN]:
        _advance(end, IS, K, T, FS)
        _admit(end, _new_gen(IS, S_PINGEN), IS, K, T, W, FS, DI, A)
    IS[R_UNIQUE] += computed
    return end


@_inline
def _pin_buffer(buf, pins, IS, K, W):
    """Pin the keys of lookup buffer ``buf``'s computations with generation ``pins``."""
    b = _buffer(buf, IS, W)
    for x in range(IS[S_LRUNN + buf]):
        K[b[x].key].pin = pins


@_inline
def _buffer_arrived(buf, t, IS, T, W):
    """Whether every computation of lookup buffer ``buf`` has its expert on the GPU by ``t``."""
    b = _buffer(buf, IS, W)
    for x in range(IS[S_LRUNN + buf]):
        run = b[x]
        if _arrival(run.tid, run.seq, t, T) > t:
            return False
    return True


@_inline
def _host_lookup(ai, t, pins, buf, IS, K, T, W, FS, DI, A, M):
    """Look up access ``ai`` at ``t`` into lookup buffer ``buf`` (engine's ``_host_lookup``):
    the host submits the demand copies it leads to."""
    copies = IS[S_NDEM]
    _lookup(ai, t, pins, buf, IS, K, T, W, FS, DI, A, M)
    if IS[C_HOST]:
        FS[SF_HOST] += (IS[S_NDEM] - copies) * FS[CF_HCOPY]


@_jit
def _host_issue(buf, t, blocking, IS, T, W, FS):
    """The host launches the expert of lookup buffer ``buf``, the GPU having run the ones
    before it by ``t`` (engine's ``_host_issue``); returns when the launch is issued."""
    if IS[C_HSYNC] == 2 and FS[SF_HOST] < t:
        FS[SF_HOST] = t
    if blocking:
        b = _buffer(buf, IS, W)
        for x in range(IS[S_LRUNN + buf]):
            run = b[x]
            a = _arrival(run.tid, run.seq, FS[SF_HOST], T)
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
def _per_expert(p, layer, lo, hi, now, p0, IS, K, T, W, FS, DI, DF, A, P, M):
    """``per-expert`` execution of one layer (engine's ``_per_expert``, both ``expert_fetch``
    disciplines): the experts run one after another in router order; the running expert's
    computations are in lookup buffer ``cur``, the next one's in the other (a lookup made
    when an expert ends reuses the ended expert's buffer)."""
    timed = not IS[C_INSTANT]
    blocking = IS[C_BLOCKING]
    host = IS[C_HOST]
    _mark_pending(lo, hi, IS, K, A)
    if IS[C_PFACTIVE]:
        _withdraw(layer, lo, hi, now, IS, K, T, W, FS, A)
        _propose(p, layer, p0, now, _new_gen(IS, S_PINGEN), IS, K, T, W, FS, DI, A, P)
    n = hi - lo
    t = now
    cur = 0
    looked = 0
    scale = _pass_factors(IS, DF)[p - IS[S_PBASE]]
    IS[S_LRUNN] = IS[S_LRUNN + 1] = IS[S_NCOMP] = 0
    if n:
        _host_lookup(lo, t, _new_gen(IS, S_PINGEN), cur, IS, K, T, W, FS, DI, A, M)
        looked = 1
    launched = False
    issued = 0.0
    for i in range(n):
        if host and not launched:
            issued = _host_issue(cur, t, blocking, IS, T, W, FS)
        launched = False
        base = _buffer(cur, IS, W)
        for x in range(IS[S_LRUNN + cur]):
            run = base[x]
            a = _arrival(run.tid, run.seq, t, T)
            if a > t:
                FS[SF_STALL] += a - t
                t = a
        if host and issued > t:  # the GPU waits for the host to launch expert i
            t = issued
        if timed:
            _advance(t, IS, K, T, FS)
        nxt = 1 - cur
        if not blocking and looked == i + 1 and looked < n:
            IS[S_LRUNN + nxt] = 0
            pins = _new_gen(IS, S_PINGEN)
            _pin_buffer(cur, pins, IS, K, W)  # the running expert
            _host_lookup(lo + looked, t, pins, nxt, IS, K, T, W, FS, DI, A, M)
            looked += 1
        for x in range(IS[S_LRUNN + cur]):
            run = base[x]
            t += _ffn(run.key, run.tokens, DF, IS) * scale
        if timed:
            _advance(t, IS, K, T, FS)
        if IS[C_PENDING]:
            K[_key(lo + i, IS, A)].pend = 0  # expert i has run
        if blocking:
            IS[S_LRUNN + nxt] = 0
            if looked < n:
                _host_lookup(lo + looked, t, _new_gen(IS, S_PINGEN), nxt, IS, K, T, W, FS, DI, A, M)
                looked += 1
        elif (looked == i + 2 and looked < n and _buffer_arrived(nxt, t, IS, T, W)
              and (not host or _host_ready(t, IS, FS))):
            # expert i+1 starts now: i+2's lookup (into the ended expert's buffer) comes first
            if host:  # i+1's launch, then i+2's copies
                issued = _host_issue(nxt, t, False, IS, T, W, FS)
                launched = True
            IS[S_LRUNN + cur] = 0
            pins = _new_gen(IS, S_PINGEN)
            _pin_buffer(nxt, pins, IS, K, W)
            _host_lookup(lo + looked, t, pins, cur, IS, K, T, W, FS, DI, A, M)
            looked += 1
            if IS[S_WN]:
                pins = _new_gen(IS, S_PINGEN)
                _pin_buffer(nxt, pins, IS, K, W)
                _pin_buffer(cur, pins, IS, K, W)
                _admit(t, pins, IS, K, T, W, FS, DI, A)
            cur = nxt
            continue
        elif looked != i + 2:
            IS[S_LRUNN + nxt] = 0  # nothing looked up next: nothing held
        if IS[S_WN]:
            pins = _new_gen(IS, S_PINGEN)
            _pin_buffer(nxt, pins, IS, K, W)
            _admit(t, pins, IS, K, T, W, FS, DI, A)
        cur = nxt
    IS[R_UNIQUE] += IS[S_NCOMP]
    return t


@_jit
def _block_sum(x, a, n):
    """``x[a:a + n]`` summed as numpy sums a block of up to 128 float64 terms: one after
    another below eight, else in eight accumulators combined as a tree, then the rest."""
    if n < 8:
        res = 0.0
        for i in range(n):
            res += x[a + i]
        return res
    r0, r1, r2, r3 = x[a], x[a + 1], x[a + 2], x[a + 3]
    r4, r5, r6, r7 = x[a + 4], x[a + 5], x[a + 6], x[a + 7]
    i = 8
    while i < n - n % 8:
        r0 += x[a + i]
        r1 += x[a + i + 1]
        r2 += x[a + i + 2]
        r3 += x[a + i + 3]
        r4 += x[a + i + 4]
        r5 += x[a + i + 5]
        r6 += x[a + i + 6]
        r7 += x[a + i + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += x[a + i]
        i += 1
    return res


@_jit
def _pairwise_sum(x, a, n):
    """``x[a:a + n]`` summed as numpy sums a float64 array (its pairwise summation): up to 128
    terms as one block (:func:`_block_sum`), more split in two, the first half rounded down to
    a multiple of eight terms, each half summed so and the two added."""
    if n <= 128:
        return _block_sum(x, a, n)
    half = n // 2
    half -= half % 8
    return _pairwise_sum(x, a, half) + _pairwise_sum(x, a + half, n - half)


@_jit
def _insert_sorted(x, at, n, v):
    """Insert ``v`` into the ascending ``x[at:at + n]``."""
    i = n
    while i > 0 and x[at + i - 1] > v:
        x[at + i] = x[at + i - 1]
        i -= 1
    x[at + i] = v


@_jit
def _token_mass(p, layer, IS, FS, M):
    """With a miss or budget policy that changes what tokens compute: the layer's gate mass
    (original top-k, and what each token finally computes, :func:`~moesim.kernel_state._final`,
    in any order) and the pass's altered tokens (whose final set is not their routed one), as
    the engine's ``token_mass``: per token, probabilities at ascending expert ids summed as
    numpy sums them, or top-k weights in rank order (a weight counts while its expert is in
    the token's final set)."""
    row_order, row_off, experts, mass, token, mark = M.row_order, M.row_off, M.experts, M.mass, M.token, M.mark
    b = _row_base(p, IS) + layer
    k = IS[C_K]
    scr = _mass_scratch(IS, FS)
    fin = _final(IS)
    total = 0.0
    kept = 0.0
    for i in range(row_off[b + 1] - row_off[b]):
        r = row_order[row_off[b] + i]
        n_fin = 0  # experts the token finally computes
        n_kept = 0  # of them, its routed ones
        t_total = 0.0
        t_kept = 0.0
        for j in range(k):
            e = np.int64(experts[r, j])
            f = fin[i * k + j]
            stays = False  # whether routed expert e is computed (anywhere in the token's final set)
            for jj in range(k):
                stays |= fin[i * k + jj] == e
            n_kept += stays
            if IS[C_PROBS]:  # ids, ascending: the original at scr[0], the final after them
                _insert_sorted(scr, 0, j, e)
                if f >= 0:
                    _insert_sorted(scr, k, n_fin, f)
            else:
                w = np.float64(mass[r, j])
                t_total += w
                if stays:
                    t_kept += w
            n_fin += f >= 0
        changed = n_kept != k or n_fin != k
        if IS[C_PROBS]:
            for j in range(k):
                scr[j] = np.float64(mass[r, np.int64(scr[j])])
            for j in range(n_fin):
                scr[k + j] = np.float64(mass[r, np.int64(scr[k + j])])
            t_total = _pairwise_sum(scr, 0, k)
            t_kept = _pairwise_sum(scr, k, n_fin) if n_fin else 0.0
        total += t_total
        kept += t_kept
        if changed and mark[token[r]] != p:
            mark[token[r]] = p
            IS[R_ALTERED] += 1
        M.prev_row[token[r]] = r  # the token's row in the latest layer (speculative reads it)
        M.prev_stamp[token[r]] = b
    FS[SF_MTOTAL] += total
    FS[SF_MKEPT] += kept


@_jit
def _routed_lookups(b, look, IS, K, DI, A, M):
    """At the routing point of (pass, layer) ``b``: the routing form (``C_ROUTE``, its index
    in :data:`moesim.policies.routing.forms.ROUTE_HOOKS` plus one) writes each row's experts
    into ``M.chosen``; the layer's lookups are then its experts in router order (first
    appearance, row by row and rank by rank), each with its best rank and its tokens, as
    :func:`simulator.lookup.router_order` makes them, in the room after the accesses
    (:func:`simulator.kernel.routing_room`), their offsets at ``DI[look]``."""
    f = IS[C_ROUTE] - 1
    i = 0
    for form in literal_unroll(ROUTE_HOOKS):
        if i == f:
            form[0](b, IS, K, M)
        i += 1  # noqa: SIM113 (numba's literal_unroll takes no enumerate)
    row_order, row_off, chosen = M.row_order, M.row_off, M.chosen
    k = IS[C_K]
    start = len(A.expert) - IS[C_NE]
    n = 0
    for t in range(row_off[b + 1] - row_off[b]):
        r = row_order[row_off[b] + t]
        for j in range(k):
            e = chosen[r, j]
            at = start
            while at < start + n and A.expert[at] != e:
                at += 1
            if at == start + n:
                A.layer[at] = IS[S_LAYER]
                A.expert[at] = e
                A.tokens[at] = 1
                A.rank[at] = j
                n += 1
            else:
                A.tokens[at] += 1
                if j < A.rank[at]:
                    A.rank[at] = j
    DI[look] = start
    DI[look + 1] = start + n


@_jit
def _fin_init(p, layer, lo, hi, IS, A, M):
    """At the layer's routing point: each token computes the experts the budget policy
    leaves it (its routed experts without one), and the layer's experts are marked (a
    substitute is never one of them)."""
    row_order, row_off, chosen = M.row_order, M.row_off, M.chosen
    b = _row_base(p, IS) + layer
    k = IS[C_K]
    fin, routed = _final(IS), _routed(IS)
    for i in range(row_off[b + 1] - row_off[b]):
        for j in range(k):
            fin[i * k + j] = chosen[row_order[row_off[b] + i], j]
    for j in range(lo, hi):
        routed[_key(j, IS, A)] = IS[S_LAYERGEN]


@_entry
def replay_passes(p0, p1, IS, K, T, W, FS, DI, DF, A, P, M, per_expert, nonexp, release, cols, t_start, t_end, stall, m_total, m_kept):
    """Replay forward passes ``p0 .. p1`` (engine's ``_run``): per layer, non-expert compute,
    the routing point's lookups and proposals, expert compute; per pass, one row. A pass
    starts no earlier than its ``release`` time (serving: the GPU idles until a request
    arrives), the host thread with it.

    ``M`` (the per-token path's arrays) is None unless a miss or budget policy changes what
    tokens compute, and ``per_expert`` None unless the execution is ``per-expert``: numba prunes a branch on an
    argument that is None when it compiles, so a replay compiles only the code its scenario
    can reach (the quickstart's form compiled in 25-29 s, against 123 s for the whole kernel), each
    form once per installation."""
    num_l = IS[C_L]
    now = FS[SF_NOW]
    carry = FS[SF_CARRY]
    for p in range(p0, p1):
        IS[S_PASS] = p
        IS[S_REC] = p < IS[C_RECPASS]
        if p > 0:
            _new_pass(IS, K, A)
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
            for j in range(DI[base], DI[base + num_l]):
                K[_key(j, IS, A)].accpass = p
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
            if DI[base + layer] == DI[base + layer + 1]:
                continue  # no routing for this (pass, layer): the layer is skipped
            look = IS[C_LOOKUP] + base + layer  # what it looks up (a budget or routing policy's choice)
            _advance(now, IS, K, T, FS)
            IS[S_LAYER] = layer
            if M is not None and IS[C_ROUTE]:  # the routing form chooses from what is cached now
                _routed_lookups(base + layer, look, IS, K, DI, A, M)
            lo, hi = DI[look], DI[look + 1]
            IS[S_LAYERGEN] += 1
            if M is not None:
                _fin_init(p, layer, lo, hi, IS, A, M)
            st0 = FS[SF_STALL]
            if per_expert is None:
                end = _layer(p, layer, lo, hi, now, p0, IS, K, T, W, FS, DI, DF, A, P, M)
            else:
                end = _per_expert(p, layer, lo, hi, now, p0, IS, K, T, W, FS, DI, DF, A, P, M)
            if IS[S_REC]:  # the layer's times, and the cache's bytes once it has run
                _record(LOG_LAYER, p, layer, now - ne, now, now + FS[SF_STALL] - st0, end, IS[S_USED], IS, FS)
            if M is not None:
                _token_mass(p, layer, IS, FS, M)
            carry = end - now
        if carry > 0:
            now = now + carry
            carry = 0.0
        if FS[SF_HOST] < now:  # the host waits for the pass's end
            FS[SF_HOST] = now
        _advance(now, IS, K, T, FS)
        t_end[p - p0] = now
        stall[p - p0] = FS[SF_STALL]
        m_total[p - p0] = FS[SF_MTOTAL]
        m_kept[p - p0] = FS[SF_MKEPT]
        IS[R_BYTES] = IS[S_BYTES] - bytes0
        for r in range(R_COUNT):
            cols[p - p0, r] = IS[R_FIRST + r]
    FS[SF_NOW] = now
    FS[SF_CARRY] = carry


@_entry
def _preload(keys, IS, K, FS, DI, DF, A):
    """Static pinning (the cache's ``preload``): resident before the replay, never evicted."""
    nb = IS[C_NBYTES]
    loaded = 0
    for key in keys:
        if K[key].state == RESIDENT or IS[S_USED] + nb > FS[CF_CAP]:
            continue
        K[key].state = RESIDENT
        IS[S_USED] += nb
        K[key].static = 1
        if not _kept_out(key, IS, K):
            _on_insert(key, False, -1, IS, K, DI, A)
        loaded += 1
    if IS[S_USED] > IS[S_MAXUSED]:
        IS[S_MAXUSED] = IS[S_USED]
    return loaded



@_entry
def _finish(IS, K, T, FS):
    """The transfers still queued or running complete (the replay's end)."""
    _advance(np.inf, IS, K, T, FS)

"""The replay kernel's cache (:mod:`simulator.cache`'s model): the eviction policies' compiled
forms called (lru, fifo, least-stale and belady's, which live beside the policies in
:mod:`policies.eviction`; a hook policy's through :mod:`policies.hooks`), the victim search under
the pinning rule (the walk of a list form's lists in its order; the lowest priority over the
cached keys), room made for an entry, insertion."""

from __future__ import annotations

from moesim.jit import inline as _inline
from moesim.jit import jit as _jit
from moesim.policies.eviction import ANY, PENDING
from moesim.policies.eviction.belady import FutureUses
from moesim.policies.eviction.fifo import InsertionList
from moesim.policies.eviction.least_stale import LeastStaleLists
from moesim.policies.eviction.lru import RecencyList
from moesim.simulator.kernel_copy import _complete
from moesim.simulator.kernel_state import (
    ABSENT,
    C_EV,
    C_INSTANT,
    C_L,
    C_LSWB,
    C_STABLE,
    CF_CAP,
    EV_BELADY,
    EV_FIFO,
    EV_HOOK,
    EV_LRU,
    EV_LS,
    H_KNEXT,
    H_KPOS,
    H_KPOSOFF,
    H_LGEN,
    H_LSQ,
    H_LSWALK,
    H_MEMB,
    H_OFF,
    H_VICT,
    INFLIGHT,
    R_PFUSED,
    RESIDENT,
    S_ABASE,
    S_HEAD,
    S_LAYER,
    S_MAXUSED,
    S_MEMBN,
    S_PASS,
    S_PENDGEN,
    S_USED,
    U_ACCESS,
    U_CLOCK,
    U_INSERT,
    U_KEYS,
    U_PRIORITIES,
    U_PRIORITY,
    U_PRIOS,
    U_REMOVE,
    U_SF,
    U_SI,
    U,
    _here,
    _key,
    _nbytes,
    _set_clock,
    _stamp,
)

# the compiled forms of lru, fifo, least-stale (lists: the comment above RecencyList) and belady
# live beside their policies in moesim.policies.eviction; the kernel calls their functions directly
_lru_access, _fifo_access = RecencyList.access, InsertionList.access
_recency_insert, _recency_remove = RecencyList.insert, RecencyList.remove
_recency_segment = RecencyList.segment
_ls_insert, _ls_access, _ls_remove, _ls_select = (LeastStaleLists.insert, LeastStaleLists.access,
                                                  LeastStaleLists.remove, LeastStaleLists.select)
_ls_new_pass = LeastStaleLists.new_pass  # its walk: a table made from its segment (kernel._walk)
_belady_next_use, _belady_priority = FutureUses.next_use, FutureUses.priority


@_jit
def _next_use(key, ai, IS, DI, A):
    """Belady (its form, :class:`moesim.policies.eviction.FutureUses`): the next access index
    of ``key`` after the current one (``ai``, or the current (pass, layer)'s access of it, or
    just before the layer), as a float (inf: none). Indices count the whole trace's accesses:
    a piece's own are ``S_ABASE`` on, and a key with none left in the piece has its first one
    after the piece (``H_KNEXT``; -1: none)."""
    a, b = DI[IS[H_KPOSOFF] + key], DI[IS[H_KPOSOFF] + key + 1]
    i = ai
    if i < 0 and a < b:
        base = _here(IS)
        lo, hi = DI[IS[H_OFF] + base], DI[IS[H_OFF] + base + 1]
        i = lo - 1
        for j in range(lo, hi):
            if _key(j, IS, A) == key:
                i = j
                break
    return _belady_next_use(DI, IS[H_KPOS] + a, IS[H_KPOS] + b, i, IS[S_ABASE], DI[IS[H_KNEXT] + key])


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
def _lists_new_pass(IS, K):
    """A list form's ``new_pass`` (least-stale's roll; the recency lists have none)."""
    if IS[C_EV] == EV_LS:
        _ls_new_pass(IS[S_PASS], IS, IS[H_LSQ], IS[C_L], K)


@_inline
def _on_select(key, IS, K):
    """A prefetcher selected the cached ``key`` (``on_prefetch_select``: a use for
    least-stale only)."""
    if IS[C_EV] == EV_LS and not _kept_out(key, IS, K):
        _ls_select(key, IS[S_PASS], IS, IS[H_LSQ], IS[C_L], K)


@_inline
def _list_first(h, which, pin_gen, adm_layer, IS, K):
    """The first key of the list at ``IS[h]`` that the cache may evict and that ``which``
    takes (``ANY``, or only the current layer's experts that have run or only those still to
    run), or -1."""
    key = IS[h]
    while key != -1:
        if _eligible(key, pin_gen, adm_layer, IS, K) and (
                which == ANY or (K[key].pend == IS[S_PENDGEN]) == (which == PENDING)):
            return key
        key = K[key].next
    return -1


@_jit
def _ls_first(h, which, pin_gen, adm_layer, IS, K):
    """:func:`_list_first` as a function of its own, as least-stale's walk called it before
    its form moved out of the kernel (LLVM may still inline it; the walk's time was measured
    this way, 71208a1)."""
    return _list_first(h, which, pin_gen, adm_layer, IS, K)


@_jit
def _ls_victim(for_prefetch, pin_gen, adm_layer, IS, K):
    """Least-stale's victim: its lists walked in its form's order, read from the walk's table
    (``H_LSWALK``: for the current layer and ``for_prefetch``, the count of lists, then each
    list's place and which of its keys the walk takes)."""
    t = IS[H_LSWALK] + (2 * IS[S_LAYER] + for_prefetch) * IS[C_LSWB]
    base = IS[H_LSQ]
    for i in range(IS[t]):
        v = _ls_first(base + IS[t + 1 + 2 * i], IS[t + 2 + 2 * i], pin_gen, adm_layer, IS, K)
        if v != -1:
            return v
    return -1


@_inline
def _kept_out(key, IS, K):
    """Whether ``key`` stays out of the policy's lists: lru, fifo and least-stale list the keys
    they may evict, and a statically pinned key is never a victim, so their victim walk need not
    pass over it (loaded by ``_preload``, it is never inserted again)."""
    return IS[C_EV] in (EV_LRU, EV_FIFO, EV_LS) and K[key].static


@_inline
def _on_insert(key, demand, ai, IS, K, DI, A):
    """The policy's ``on_insert``: ``key`` entered the cache (``demand``: a use). Recency
    policies keep a list in order; the others the members their victim search scans."""
    ev = IS[C_EV]
    if ev in (EV_LRU, EV_FIFO):
        _recency_insert(key, IS[S_PASS], IS, S_HEAD, IS[C_L], K)
        return
    if ev == EV_LS:
        _ls_insert(key, IS[S_PASS], IS, IS[H_LSQ], IS[C_L], K)
        return
    n = IS[S_MEMBN]
    IS[IS[H_MEMB] + n] = key
    K[key].memb = n
    IS[S_MEMBN] = n + 1
    _stamp(key, IS, K)
    if ev == EV_BELADY:
        K[key].nextuse = _next_use(key, ai, IS, DI, A)
    elif ev == EV_HOOK:
        w = float(_weight(key, ai, IS, DI, A)) if demand else 0.0
        _set_clock(IS, A)
        A[U][U_INSERT][0](key, demand != 0, w, A[U][U_CLOCK], A[U][U_SI], A[U][U_SF])
        _keep_priority(key, IS, K, A)


@_inline
def _on_access(key, ai, IS, K, DI, A):
    """The policy's ``on_access``: a hit or a late prefetch used ``key``."""
    if _kept_out(key, IS, K):
        return
    ev = IS[C_EV]
    if ev == EV_LRU:
        _lru_access(key, IS[S_PASS], IS, S_HEAD, IS[C_L], K)
    elif ev == EV_FIFO:
        _fifo_access(key, IS[S_PASS], IS, S_HEAD, IS[C_L], K)
    elif ev == EV_BELADY:
        K[key].nextuse = _next_use(key, ai, IS, DI, A)
    elif ev == EV_HOOK:
        _stamp(key, IS, K)
        _set_clock(IS, A)
        A[U][U_ACCESS][0](key, float(_weight(key, ai, IS, DI, A)), A[U][U_CLOCK], A[U][U_SI], A[U][U_SF])
        _keep_priority(key, IS, K, A)
    elif ev == EV_LS:
        _ls_access(key, IS[S_PASS], IS, IS[H_LSQ], IS[C_L], K)


@_inline
def _on_remove(key, IS, K, A):
    if IS[C_EV] in (EV_LRU, EV_FIFO):
        _recency_remove(key, IS[S_PASS], IS, S_HEAD, IS[C_L], K)
        return
    if IS[C_EV] == EV_LS:
        _ls_remove(key, IS[S_PASS], IS, IS[H_LSQ], IS[C_L], K)
        return
    i = K[key].memb
    last = IS[IS[H_MEMB] + IS[S_MEMBN] - 1]
    IS[IS[H_MEMB] + i] = last
    K[last].memb = i
    IS[S_MEMBN] -= 1
    K[key].memb = -1
    if IS[C_EV] == EV_HOOK:
        _set_clock(IS, A)
        A[U][U_REMOVE][0](key, A[U][U_CLOCK], A[U][U_SI], A[U][U_SF])


@_jit
def _order(key, K):
    """The candidate order of ``key`` for Belady, whose victim is the smallest over the cached
    experts, as (its form's priority, stamp); the other built-ins walk their forms' lists (lru,
    fifo, least-stale) or run their compiled forms through the hooks (lfu, fld, score, lhu)."""
    return _belady_priority(K[key].nextuse), K[key].stamp


@_inline
def _eligible(key, pin_gen, adm_layer, IS, K):
    if K[key].state != RESIDENT or K[key].pin == pin_gen or K[key].static:
        return False
    return not (adm_layer >= 0 and K[key].layer == adm_layer and K[key].adm == IS[IS[H_LGEN] + adm_layer])


@_jit
def _victim(for_prefetch, pin_gen, adm_layer, IS, K):
    """The first candidate, in the policy's order, that the cache may evict (resident, not
    pinned, not statically pinned, not an earlier admission for ``adm_layer``), or -1."""
    ev = IS[C_EV]
    if ev in (EV_LRU, EV_FIFO):  # one queue of one list (RecencyList.QUEUES, .steps)
        h, which = _recency_segment(0, 0, for_prefetch, IS[S_LAYER], IS[C_L], 0)
        return _list_first(S_HEAD + h, which, pin_gen, adm_layer, IS, K)
    if ev == EV_LS:
        return _ls_victim(for_prefetch, pin_gen, adm_layer, IS, K)
    best = -1
    bf, bs = 0.0, 0
    for j in range(IS[S_MEMBN]):
        key = IS[IS[H_MEMB] + j]
        if not _eligible(key, pin_gen, adm_layer, IS, K):
            continue
        f, s = _order(key, K)
        if best == -1 or f < bf or (f == bf and s < bs):
            best, bf, bs = key, f, s
    return best


@_inline
def _keep_priority(key, IS, K, A):
    """A hook policy with a stable priority (``C_STABLE``) keeps ``key``'s, computed after its
    hooks ran, in ``K[key].prio``."""
    if IS[C_STABLE]:
        K[key].prio = A[U][U_PRIORITY][0](key, A[U][U_CLOCK], A[U][U_SI], A[U][U_SF])


@_jit
def _hook_victim(pin_gen, adm_layer, IS, K, A):
    """A hook policy's victim: the eligible key of lowest priority (kept, or asked now of every
    cached key in one call, as the SimPy path sorts them all), ties to the oldest stamp."""
    best, bf, bs = -1, 0.0, 0
    if IS[C_STABLE]:
        for j in range(IS[S_MEMBN]):
            key = IS[IS[H_MEMB] + j]
            if not _eligible(key, pin_gen, adm_layer, IS, K):
                continue
            f, s = K[key].prio, K[key].stamp
            if best == -1 or f < bf or (f == bf and s < bs):
                best, bf, bs = key, f, s
        return best
    keys, prios = A[U][U_KEYS], A[U][U_PRIOS]  # keys: the cached keys (IS's H_MEMB region)
    n = IS[S_MEMBN]
    _set_clock(IS, A)
    A[U][U_PRIORITIES][0](keys, n, prios, A[U][U_CLOCK], A[U][U_SI], A[U][U_SF])
    for j in range(n):
        key = keys[j]
        if not _eligible(key, pin_gen, adm_layer, IS, K):
            continue
        f, s = prios[j], K[key].stamp
        if best == -1 or f < bf or (f == bf and s < bs):
            best, bf, bs = key, f, s
    return best


@_inline
def _find_victim(for_prefetch, pin_gen, adm_layer, IS, K, A):
    """:func:`_victim`, or a hook policy's (:func:`_hook_victim`, the one that reads ``A``)."""
    if IS[C_EV] == EV_HOOK:
        return _hook_victim(pin_gen, adm_layer, IS, K, A)
    return _victim(for_prefetch, pin_gen, adm_layer, IS, K)


@_inline
def _evict(key, IS, K, A):
    K[key].state = ABSENT
    IS[S_USED] -= _nbytes(key, IS)
    _on_remove(key, IS, K, A)
    K[key].unused = 0
    K[key].evicted = IS[S_PASS]


@_inline
def _evict_for(key, for_prefetch, IS, K, A):
    """Evict a victim; one evicted for a prefetch is no longer an admission."""
    _evict(key, IS, K, A)
    if for_prefetch:
        K[key].adm = 0


@_inline
def _room(nb, for_prefetch, pin_gen, adm_layer, IS, K, FS, A):
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
    v = _find_victim(for_prefetch, pin_gen, adm_layer, IS, K, A)
    if v == -1:
        return -1
    if nb > free + _nbytes(v, IS):
        return _victims(nb, free, v, for_prefetch, pin_gen, adm_layer, IS, K, A)
    _evict_for(v, for_prefetch, IS, K, A)
    return 1


@_jit
def _victims(nb, free, v, for_prefetch, pin_gen, adm_layer, IS, K, A):
    """:func:`_room` when the first victim ``v`` is not enough: each victim found is pinned
    for the search of the next (its pin restored after); all are evicted once they free
    enough, none when the search runs out."""
    vict = IS[H_VICT]
    n = 0
    while v != -1:
        IS[vict + 2 * n] = v
        IS[vict + 2 * n + 1] = K[v].pin
        K[v].pin = pin_gen
        n += 1
        free += _nbytes(v, IS)
        if nb <= free:
            break
        v = _find_victim(for_prefetch, pin_gen, adm_layer, IS, K, A)
    for j in range(n):  # the pins as they were
        K[IS[vict + 2 * j]].pin = IS[vict + 2 * j + 1]
    if v == -1:
        return -1
    for j in range(n):
        _evict_for(IS[vict + 2 * j], for_prefetch, IS, K, A)
    return n


@_inline
def _insert(key, tid, demand, ai, IS, K, T, DI, A):
    """The cache's ``reserve``: an in-flight entry for ``key`` (room was made)."""
    K[key].state = INFLIGHT
    K[key].tid = tid
    IS[S_USED] += _nbytes(key, IS)
    if IS[S_USED] > IS[S_MAXUSED]:
        IS[S_MAXUSED] = IS[S_USED]
    _on_insert(key, demand, ai, IS, K, DI, A)
    if IS[C_INSTANT]:
        _complete(tid, IS, K, T)


@_inline
def _used_prefetch(key, IS, K):
    if K[key].unused:
        K[key].unused = 0
        IS[R_PFUSED] += 1

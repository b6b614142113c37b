"""The replay kernel's state (:mod:`simulator.kernel`): its layout, the accessors of the
workload's arrays, and the list and generation primitives every part uses.

State lives in five arrays, so that the kernel's functions pass little between them: ``IS``
(int64: scalars ``S_*``, configuration ``C_*``, the pass's counts ``R_*``, region offsets
``H_*``, then the regions: queues, lists, scratch), ``FS`` (float64: scalars, configuration,
then regions), and three record arrays with named fields: ``K``, one record per cache key
(:data:`KEY`: ``K[key].state``, ``.tid``, ``.pin`` ...),
``T``, one per transfer slot (:data:`TRANSFER`: ``T[t].key``, ``.seq``, ``.start``, ``.done``
...), and ``W``, units of a layer's work (:data:`WORK`: ``.tid``, ``.seq``, ``.key``,
``.tokens``) in three regions: the layer's computations, the lookup buffers' and the pending
prefetches. Each region is reached by its name, as an array of its own (``_demand_queue(IS)[i]``,
``_pending_prefetches(IS, W)[i]``): the demand queue in service order, the prefetch queue as a
ring whose withdrawn or promoted entries are -1, the running ring, the waiting proposals, the
per-layer marks, scratch. Transfer slots are reused; a slot kept past a layer is checked against its
transfer's sequence number. Sets the SimPy path rebuilds (pins, pending experts, keys evicted
in this pass) are generation marks. Read-only data but where said: ``DI`` (offsets of each
(pass, layer)'s accesses; under a budget or routing policy followed, from ``IS[C_LOOKUP]``, by
the offsets of what each (pass, layer) looks up), ``DF`` (expert seconds by token count,
per-pass factor), ``A`` (:data:`Accesses`: the workload's own per-access arrays, under a budget
policy followed by the lookups it leaves, under a routing policy by room for one layer's
lookups, which the kernel writes at each routing point, with their offsets in ``DI``; with the
eviction form's hooks and state by name), ``M`` (:data:`Tokens`: the per-token arrays, None
unless a miss, budget or routing policy changes what tokens compute) and ``P``
(the prefetcher's proposals, arrays its compiled form made); a trace read in pieces has the
read-only arrays hold one piece (``S_PBASE``: the piece's first pass, where its (pass, layer)
entries start).
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np

from moesim.jit import inline as _inline
from moesim.jit import ir_inline as _view
from moesim.jit import kernel as _jit

# ``A``: the per-access arrays (each access's layer, expert, tokens routed, summed gate weight
# and best router rank), then the eviction form's ``hooks`` (a hook policy's compiled hooks,
# :mod:`moesim.policies.hooks`) and ``form``, the arrays the form keeps its own state in
# (``(I2, F2, I1, F1, P)``: :mod:`moesim.policies.eviction.base`)
Accesses = namedtuple("Accesses", "layer expert tokens weight rank hooks form")
# ``M``: what the per-token functions read (:func:`simulator.kernel._mass_arrays`): the trace's
# rows of each (pass, layer) in order (``row_order``, CSR offsets ``row_off``), each row's
# ``experts`` as the router chose them and ``chosen`` as the budget policy leaves them (-1 past a
# row's last; ``experts`` itself without a budget), its ``mass`` (router probabilities, or the
# top-k weights), its ``token``
# numbered; a ``mark`` per token, the next-layer predictions ``pred``, and per token its row in
# the latest layer replayed (``prev_row``) and that layer's (pass, layer) index (``prev_stamp``);
# the miss policy's ``hook`` (:func:`moesim.policies.miss.hooked.hook_arrays`) and the routing
# form's arrays, ``route`` (:func:`moesim.policies.routing.hooked.route_arrays`; without a routing
# form, stand-ins of the same types). A routing form (``C_ROUTE``) writes ``chosen`` at each
# routing point.
Tokens = namedtuple("Tokens", "row_order row_off experts chosen mass token mark pred prev_row prev_stamp hook route")
MODE_LAYER, MODE_ARRIVAL, MODE_PER_EXPERT = range(3)
ABSENT, INFLIGHT, RESIDENT = 0, 1, 2
DEMAND, PREFETCH = 0, 1

# A cache key's record (``K[key]``): its state (ABSENT, INFLIGHT, RESIDENT), the layer
# generation it was last computed in, its transfer slot, its pin generation, whether it is
# statically pinned, its pending generation, the pass it was evicted in, whether it is an unused
# prefetch, its admission generation, whether a proposal of it waits, its proposal mark, the pass
# that last routed it, its layer (the key over C_DIV, set by _layout: the prefetch path reads it
# where it divided). What an eviction policy keeps per key is in its form's own arrays (A.form).
KEY = np.dtype([(name, np.int64) for name in (
    "state", "computed", "tid", "pin", "static", "pend", "evicted", "unused", "adm", "queued", "mark", "accpass",
    "layer")])
# A transfer slot's record (``T[t]``): its key, priority (DEMAND, PREFETCH), sequence number,
# whether it started or was withdrawn, whether it bypasses the cache, its place in the prefetch
# ring, whether it was promoted (a queued prefetch a layer needed); when it was issued, starts,
# is done, and its duration. Its 96 bytes of fields take a 128-byte record (two cache lines:
# records packed at their fields' size made the kernel measurably slower)
_TRANSFER_FIELDS = ([(name, np.int64) for name in ("key", "prio", "seq", "started", "cancelled", "bypass", "pfslot",
                                                   "promoted")]
                    + [(name, np.float64) for name in ("issued", "start", "done", "dur")])
TRANSFER = np.dtype({"names": [n for n, _ in _TRANSFER_FIELDS], "formats": [f for _, f in _TRANSFER_FIELDS],
                     "itemsize": 128})
# A unit of a layer's work (``W[i]``): the transfer it waits for (slot and its sequence number:
# the slot may be reused; -1 for none), its cache key and its tokens. ``W`` holds three regions
# of them, each starting at the record that ``IS`` names: the layer's computations (``H_RUNS``,
# up to ``C_MAXN``: layer and on-arrival execution), the two lookup buffers of per-expert
# execution (``H_LRUN``, ``C_LRUNCAP`` records each) and the pending prefetches (``H_PENDA``, up to
# ``H_PENDMAX``: slot, sequence and key; their tokens unused).
WORK = np.dtype([(name, np.int64) for name in ("tid", "seq", "key", "tokens")])
# The integer state IS: scalars (S_*), configuration (C_*), the pass's row (R_*), region
# offsets (H_*), then the regions (queues, lists, scratch). ``S_NRES`` counts the resident keys
# that are not statically pinned (the only ones a victim can be); ``C_PUREVICT`` is set for a
# form whose victim walk changes nothing (``KernelForm.pure_victim``), which the cache then
# skips when that count is 0.
(S_TSEQ, S_USED, S_MAXUSED, S_BYTES, S_DQN, S_PFH, S_PFN, S_RH, S_RN,
 S_FREEN, S_WH, S_WN, S_PENDN, S_PINGEN, S_PENDGEN, S_PASS, S_LAYER, S_MARKGEN,
 S_LAYERGEN, S_LRUNN, S_LRUNN1, S_NCOMP, S_NDEM, S_PBASE, S_LOGN, S_REC, S_NRES,
 C_FORM, C_MODE, C_INSTANT, C_NBYTES, C_L, C_DIV, C_TLEN,
 C_PFACTIVE, C_MAXN, C_NPREC, C_DPREC, C_MISS, C_MISSARG, C_PROBS, C_K, C_NE, C_LRUNCAP,
 C_NLEV, C_MULTI, C_REROUTE, C_BLOCKING, C_HOST, C_HSYNC, C_PENDING, C_KEEPSTATIC,
 C_HANDED, C_RECPASS, C_LOGCAP, C_LOOKUP, C_PUREVICT, C_ROUTE,
 R_HITS, R_MISSES, R_LATE, R_COLL, R_UNCACHED, R_BYTES, R_PFISSUED, R_PFUSED, R_PREDHITS,
 R_PRED, R_ACTUAL, R_PFCANCEL, R_UNIQUE, R_DROPPED, R_ALTERED, R_SUBST, R_LOWPREC,
 H_DQ, H_PFQ, H_RQ, H_FREE, H_WQ, H_PENDA, H_LGEN, H_LADM, H_LMARK, H_RUNS,
 H_SCR, H_TTAB, H_SCALE, H_POOL, H_NKEYS,
 H_PENDMAX, H_PFTMP, H_MSCR, H_FIN, H_LRUN, H_SPEC, H_ROUTED, H_LEVELS, H_PBYTES, H_VICT,
 H_PDUR, H_LOG, I_HEADER) = range(103)
R_FIRST, R_COUNT = R_HITS, R_LOWPREC + 1 - R_HITS
# The float state FS: scalars, configuration, then scratch.
(SF_BUSY_UNTIL, SF_BUSY, SF_NOW, SF_CARRY, SF_STALL, SF_MTOTAL, SF_MKEPT, SF_HOST, CF_CAP,
 CF_HLAYER, CF_HLAUNCH, CF_HCOPY, F_HEADER) = range(13)
# The timeline (``moesim run --events``; :class:`simulator.recording.Recorder` takes it): records
# of LOG_WIDTH floats in region ``H_LOG`` of ``FS`` (``S_LOGN`` of them, at most ``C_LOGCAP``),
# written while ``S_REC`` is set (the pass is before ``C_RECPASS``), each a tag then its fields:
# LOG_TRANSFER (key, kind, issued, start, done, bytes; kind LOG_DEMAND, LOG_PREFETCH or
# LOG_PROMOTED), LOG_WITHDRAWN (key, issued, withdrawn at, bytes), LOG_LAYER (pass, layer,
# non-expert start, routing point, experts start, end, cache bytes)
LOG_TRANSFER, LOG_WITHDRAWN, LOG_LAYER = range(3)
LOG_DEMAND, LOG_PREFETCH, LOG_PROMOTED = range(3)
LOG_WIDTH = 8
# per-pass columns, in engine order
COLUMNS = ("hits", "misses", "late_prefetches", "collision_misses", "uncached_fetches", "bytes",
           "prefetches_issued", "prefetches_used", "prefetch_predicted_hits", "prefetch_predicted",
           "prefetch_actual", "prefetches_cancelled", "unique_computed", "dropped_experts", "tokens_altered",
           "substituted_experts", "low_precision_experts")


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


# -- the regions, each reached by its name as an array of its own (a view of ``IS``, ``FS``, ``W``
# or ``DF`` from the region's first element on: the layout's offsets are read here only). Inlined
# into their callers before these compile (``ir_inline``): a compiled function without numba's
# runtime may return no array but an argument ------------------------------------------------------
@_view
def _region(IS, h):
    """Region ``h`` of ``IS`` from its first element on (the one read of the layout's
    offsets into ``IS``)."""
    return IS[IS[h]:]


@_view
def _demand_queue(IS):
    """The demand transfers in service order (``S_DQN`` of them)."""
    return _region(IS, H_DQ)


@_view
def _prefetch_ring(IS):
    """The prefetch queue, a ring of ``H_POOL`` slots from ``S_PFH`` (``S_PFN`` of them; a
    withdrawn or promoted entry is -1)."""
    return _region(IS, H_PFQ)


@_view
def _running_ring(IS):
    """The transfers on the link, a ring of ``H_POOL`` slots from ``S_RH`` (``S_RN`` of them)."""
    return _region(IS, H_RQ)


@_view
def _free_slots(IS):
    """The free transfer slots, a stack (``S_FREEN`` of them)."""
    return _region(IS, H_FREE)


@_view
def _waiting(IS):
    """The waiting proposals' keys, a ring of ``H_NKEYS`` from ``S_WH`` (``S_WN`` of them)."""
    return _region(IS, H_WQ)


@_view
def _layer_gen(IS):
    """Per layer, its prefetch admission generation (:func:`evictable`)."""
    return _region(IS, H_LGEN)


@_view
def _layer_admitted(IS):
    """Per layer, whether a prefetch was admitted into it in the current generation."""
    return _region(IS, H_LADM)


@_view
def _layer_mark(IS):
    """Per layer, the proposal generation that last marked it."""
    return _region(IS, H_LMARK)


@_view
def _spec_scratch(IS):
    """The speculative miss policy's scratch: two lookup buffers' experts."""
    return _region(IS, H_SPEC)


@_view
def _routed(IS):
    """Per key, the layer generation (``S_LAYERGEN``) that last routed it."""
    return _region(IS, H_ROUTED)


@_view
def _kept_scratch(IS):
    """The prefetch ring's compaction scratch (``H_POOL`` slots)."""
    return _region(IS, H_PFTMP)


@_view
def _final(IS):
    """What each token of the layer computes: ``k`` experts per token (-1: dropped)."""
    return _region(IS, H_FIN)


@_view
def _level_precs(IS):
    """The precision cascade's levels, each a precision index (``C_NLEV`` of them)."""
    return _region(IS, H_LEVELS)


@_view
def _prec_bytes(IS):
    """Per precision index, an entry's bytes."""
    return _region(IS, H_PBYTES)


@_view
def _victims_scratch(IS):
    """The eviction's victim list scratch (``2 * H_NKEYS``)."""
    return _region(IS, H_VICT)


@_view
def _ready_scratch(IS, FS):
    """On-arrival execution's computations in order: when each one's expert is on the GPU."""
    return FS[IS[H_SCR]:]


@_view
def _seconds_scratch(IS, FS):
    """On-arrival execution's computations in order: each one's compute seconds."""
    return FS[IS[H_SCR] + IS[C_MAXN]:]


@_view
def _mass_scratch(IS, FS):
    """A token's gate masses, routed then kept (``2 * top-k``)."""
    return FS[IS[H_MSCR]:]


@_view
def _prec_seconds(IS, FS):
    """Per precision index, an entry's copy seconds."""
    return FS[IS[H_PDUR]:]


@_view
def _log(IS, FS):
    """The timeline's records (``S_LOGN`` of them, :data:`LOG_WIDTH` floats each)."""
    return FS[IS[H_LOG]:]


@_inline
def _record(tag, a, b, c, d, e, f, g, IS, FS):
    """Append a timeline record (``tag`` and its fields ``a`` .. ``g``; unused fields 0)."""
    n = IS[S_LOGN]
    if n == IS[C_LOGCAP]:
        raise RuntimeError("moesim kernel: timeline log full")
    log = _log(IS, FS)
    i = n * LOG_WIDTH
    log[i] = tag
    log[i + 1] = a
    log[i + 2] = b
    log[i + 3] = c
    log[i + 4] = d
    log[i + 5] = e
    log[i + 6] = f
    log[i + 7] = g
    IS[S_LOGN] = n + 1


@_view
def _runs(IS, W):
    """The layer's computations (layer and on-arrival execution; ``S_NCOMP`` of them)."""
    return W[IS[H_RUNS]:]


@_view
def _buffer(buf, IS, W):
    """Per-expert execution's lookup buffer ``buf`` (0 or 1; ``C_LRUNCAP`` records)."""
    return W[IS[H_LRUN] + buf * IS[C_LRUNCAP]:]


@_view
def _pending_prefetches(IS, W):
    """The prefetches pending admission (slot, sequence and key; ``S_PENDN`` of them, up to
    ``H_PENDMAX``)."""
    return W[IS[H_PENDA]:]


@_view
def _pass_factors(IS, DF):
    """The per-pass expert-compute factor of each pass of the piece."""
    return DF[IS[H_SCALE]:]


@_inline
def _ring(i, size):
    """``i % size`` for ``0 <= i < 2 * size``: a ring buffer's slot one step, or up to its
    count, past its head (``0 <= head < size``, ``count <= size``), found with a comparison
    instead of a division."""
    return i - size if i >= size else i


@_jit
def _key(j, IS, A):
    """The cache key of access ``j``."""
    return _key_at(A.layer[j], A.expert[j], IS)


@_inline
def _prec(key, IS):
    """The precision index of ``key``: the scenario's unless a precision cascade may cache
    others (``C_MULTI``; this spares the lookup path a division per key)."""
    return key % IS[C_NPREC] if IS[C_MULTI] else IS[C_DPREC]


@_inline
def _nbytes(key, IS):
    """The size of ``key``'s entry: its precision's expert bytes (``C_NBYTES``, the
    scenario's, unless a precision cascade may cache others)."""
    return _prec_bytes(IS)[key % IS[C_NPREC]] if IS[C_MULTI] else IS[C_NBYTES]


@_view
def _ffn_table(IS, DF):
    """Expert compute seconds by token count at the scenario's precision."""
    return DF[IS[H_TTAB]:]


@_view
def _ffn_tables(IS, DF):
    """Expert compute seconds by token count at each precision, largest first, one row of
    ``C_TLEN`` per precision index (the scenario's is :func:`_ffn_table`)."""
    return DF[IS[H_TTAB] - IS[C_DPREC] * IS[C_TLEN]:]


@_inline
def _ffn(key, tokens, DF, IS):
    """Compute seconds of expert ``key`` (at its precision) with ``tokens`` tokens, before
    the pass's factor."""
    if IS[C_MULTI]:
        return _ffn_tables(IS, DF)[(key % IS[C_NPREC]) * IS[C_TLEN] + tokens]
    return _ffn_table(IS, DF)[tokens]


@_jit
def _new_gen(IS, which):
    IS[which] += 1
    return IS[which]


# -- what an eviction policy's compiled form reads of the replay (its hooks get IS, K, DI and A:
# these name what they may use) ------------------------------------------------------------------
@_inline
def evictable(key, pin_gen, adm_layer, IS, K):
    """Whether the cache may evict ``key`` now (the pinning rule, ``docs/design.md`` step 7):
    resident, not pinned (``pin_gen``: the current pins), not statically pinned, and not one of
    the earlier admissions of a prefetch's target layer ``adm_layer`` (-1: none)."""
    if K[key].state != RESIDENT or K[key].pin == pin_gen or K[key].static:
        return False
    return not (adm_layer >= 0 and K[key].layer == adm_layer and K[key].adm == _layer_gen(IS)[adm_layer])


@_inline
def current_pass(IS):
    """The forward pass being replayed."""
    return IS[S_PASS]


@_inline
def current_layer(IS):
    """The layer being replayed."""
    return IS[S_LAYER]


@_inline
def layer_count(IS):
    """The model's layers."""
    return IS[C_L]


@_inline
def key_layer(key, K):
    """The layer of cache key ``key``."""
    return K[key].layer


@_inline
def pending(key, IS, K):
    """Whether ``key`` is one of the current layer's routed experts still to run
    (``Clock.pending``); marked only for a form that declares ``reads_pending``."""
    return K[key].pend == IS[S_PENDGEN]


@_inline
def routed_now(key, IS):
    """Whether ``key`` is one of the current layer's routed experts (marked for a miss policy
    that changes what tokens compute)."""
    return _routed(IS)[key] == IS[S_LAYERGEN]


@_inline
def entry_size(key, IS):
    """The bytes of ``key``'s entry (its precision's)."""
    return _nbytes(key, IS)


@_inline
def expert_size(IS):
    """The bytes of one expert at the scenario's precision."""
    return IS[C_NBYTES]


@_inline
def layer_accesses(IS, DI):
    """The current (pass, layer)'s accesses: ``lo .. hi`` (:func:`access_key`)."""
    b = _here(IS)
    return DI[b], DI[b + 1]


@_inline
def access_key(j, IS, A):
    """The cache key of access ``j``."""
    return _key(j, IS, A)


@_jit
def access_of(key, ai, IS, DI, A):
    """Access ``ai`` when it is one (``>= 0``), else the current (pass, layer)'s access of
    ``key``, or -1 when it has none."""
    if ai >= 0:
        return ai
    lo, hi = layer_accesses(IS, DI)
    for j in range(lo, hi):
        if _key(j, IS, A) == key:
            return j
    return -1


@_inline
def access_weight(ai, A):
    """The summed gate weight of access ``ai`` (0 for -1: none)."""
    return A.weight[ai] if ai >= 0 else 0.0


def region(state: np.ndarray, h: int, n: int, IS: np.ndarray) -> np.ndarray:
    """The first ``n`` elements of region ``h`` (``H_*``) of ``state`` (``IS``, ``FS``, ``W``
    or ``DF``), for Python to fill."""
    start = int(IS[h])
    return state[start:start + n]


def _layout(num_keys: int, pool: int, pend_max: int, maxn: int, top_k: int = 1, fin: int = 1,
            lrun: int = 1, nprec: int = 1, per_layer: int = 0, log: int = 0) -> tuple[np.ndarray, np.ndarray,
                                                                                      np.ndarray, np.ndarray,
                                                                    np.ndarray]:
    """The state arrays ``IS``, ``FS``, ``K``, ``T``, ``W``, initialised: regions after the
    headers, their offsets in ``IS`` (``W``'s regions' first records there too).
    Every precision (``nprec``) is one byte and takes one second to copy until set
    (``H_PBYTES``, ``H_PDUR``); the only precision level is the default, 0. ``per_layer``:
    the keys of a layer (``C_DIV``: experts times precisions; 0, all the keys in one layer),
    each key's layer (``K.layer``) its key over it. ``log``: the timeline's records a kernel
    call can write (:func:`_record`; 0: the replay records none)."""
    # the regions sized by a layer's tokens come last (:func:`grow_rows` extends them)
    i_sizes = ((H_DQ, pool), (H_PFQ, pool), (H_RQ, pool),
               (H_FREE, pool), (H_WQ, num_keys),
               (H_LGEN, num_keys), (H_LADM, num_keys), (H_LMARK, num_keys),
               (H_ROUTED, num_keys), (H_PFTMP, pool), (H_LEVELS, nprec), (H_PBYTES, nprec),
               (H_VICT, 2 * num_keys), (H_FIN, fin), (H_SPEC, 2 * lrun))
    f_sizes = ((H_SCR, 2 * max(1, maxn)), (H_MSCR, 2 * top_k),
               (H_PDUR, nprec), (H_LOG, LOG_WIDTH * log))
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
    IS[C_LRUNCAP] = lrun
    IS[C_LOGCAP] = log
    IS[S_PINGEN] = IS[S_PENDGEN] = IS[S_MARKGEN] = 1
    IS[S_FREEN] = pool
    K = np.zeros(num_keys, KEY).view(np.recarray)
    for name in ("tid", "evicted", "accpass"):
        K[name] = -1
    T = np.zeros(pool, TRANSFER).view(np.recarray)
    # W's regions: the layer's computations, the pending prefetches, the two lookup buffers
    IS[H_RUNS], IS[H_PENDA], IS[H_LRUN] = 0, max(1, maxn), max(1, maxn) + pend_max
    W = np.zeros(max(1, maxn) + pend_max + 2 * lrun, WORK).view(np.recarray)
    region(IS, H_FREE, pool, IS)[:] = np.arange(pool - 1, -1, -1)
    region(IS, H_LGEN, num_keys, IS)[:] = 1
    IS[C_DIV] = per_layer or num_keys
    K["layer"] = np.arange(num_keys) // IS[C_DIV]
    IS[C_NPREC] = nprec
    IS[C_NLEV] = 1
    IS[C_NBYTES] = 1
    region(IS, H_PBYTES, nprec, IS)[:] = 1
    region(FS, H_PDUR, nprec, IS)[:] = 1.0
    return IS, FS, K, T, W


def grow_rows(IS: np.ndarray, W: np.ndarray, rows: int, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """``IS`` and ``W`` with room for a layer of ``rows`` tokens (a trace read in pieces, or
    served, whose later passes hold more tokens than its first): the regions sized by a layer's
    tokens, last in each (what each token computes, the speculative scratch, the two lookup
    buffers), made larger, everything before them copied; or ``IS`` and ``W`` themselves when
    they have the room. Those regions hold nothing between two (pass, layer)s."""
    if rows <= IS[C_LRUNCAP]:
        return IS, W
    fin, lrun = int(IS[H_FIN]), int(IS[H_LRUN])
    grown = np.zeros(fin + rows * top_k + 2 * rows, np.int64)
    grown[:fin] = IS[:fin]
    grown[H_SPEC], grown[C_LRUNCAP] = fin + rows * top_k, rows
    work = np.zeros(lrun + 2 * rows, WORK).view(np.recarray)
    work[:lrun] = W[:lrun]
    return grown, work

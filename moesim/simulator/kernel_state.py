"""The replay kernel's state (:mod:`simulator.kernel`): its layout, the accessors of the
workload's arrays, and the list and generation primitives every part uses.

State lives in five arrays, so that the kernel's functions pass little between them: ``IS``
(int64: scalars ``S_*``, configuration ``C_*``, the pass's counts ``R_*``, region offsets
``H_*``, then the regions: queues, lists, scratch), ``FS`` (float64: scalars, configuration,
then regions), and three record arrays with named fields: ``K``, one record per cache key
(:data:`KEY`: ``K[key].state``, ``.tid``, ``.prev``/``.next`` in a list, ``.nextuse`` ...),
``T``, one per transfer slot (:data:`TRANSFER`: ``T[t].key``, ``.seq``, ``.start``, ``.done``
...), and ``W``, units of a layer's work (:data:`WORK`: ``.tid``, ``.seq``, ``.key``,
``.tokens``) in three regions: the layer's computations, the lookup buffers' and the pending
prefetches (``W[IS[H_PENDA] + i]``). Element ``i`` of a queue or list ``Q`` is
``IS[IS[H_Q] + i]``. Queues: the demand queue ``DQ`` in service order, the prefetch queue
``PFQ`` as a ring whose withdrawn or promoted entries are -1, the running ring ``RQ``, the
waiting proposals ``WQ``. Transfer slots are reused; a slot kept past a layer is checked against its
transfer's sequence number. Sets the SimPy path rebuilds (pins, pending experts, keys evicted
in this pass) are generation marks. Read-only data: ``DI`` (offsets of each (pass, layer)'s
accesses, pass groups, Belady's access positions), ``DF`` (expert seconds by token count,
per-pass factor), ``A`` (the workload's own per-access arrays) and ``P`` (proposal arrays); a
trace read in pieces has the read-only arrays hold one piece (``S_PBASE``: the piece's first
pass, where its (pass, layer) entries start).
"""

from __future__ import annotations

import numpy as np

from moesim.jit import inline as _inline
from moesim.jit import jit as _jit
from moesim.policies.hooks import CLOCK_LAYER, CLOCK_PASS, CLOCK_TICK

EV_LRU, EV_FIFO, EV_LS, EV_BELADY, EV_HOOK = range(5)
# a hook policy's compiled hooks (each in a tuple of one) and state in ``A[U]`` (:mod:`policies.hooks`)
U = 5
U_INSERT, U_ACCESS, U_REMOVE, U_PRIORITY, U_PRIORITIES, U_CLOCK, U_SI, U_SF, U_KEYS, U_PRIOS = range(10)
# prefetch proposal sources
PF_NONE, PF_ORACLE, PF_PREV, PF_LOOKAHEAD, PF_ARRAY = range(5)
MODE_LAYER, MODE_ARRIVAL, MODE_PER_EXPERT = range(3)
ABSENT, INFLIGHT, RESIDENT = 0, 1, 2
DEMAND, PREFETCH = 0, 1

# A cache key's record (``K[key]``): its state (ABSENT, INFLIGHT, RESIDENT), the layer
# generation it was last computed in, its transfer slot, its pin generation, whether it is
# statically pinned, its stamp, the pass least-stale last touched it in, its neighbours in its
# policy's list, its place among the members a victim search scans, its pending generation, the
# pass it was evicted in, whether it is an unused prefetch, its admission generation, whether a
# proposal of it waits, its proposal mark, the pass that last routed it, its layer (the key over
# C_DIV, set by _layout: the prefetch and least-stale paths read it where they divided);
# Belady's next use and a hook policy's kept priority.
KEY = np.dtype([(name, np.int64) for name in (
    "state", "computed", "tid", "pin", "static", "stamp", "curpass", "prev", "next", "memb", "pend",
    "evicted", "unused", "adm", "queued", "mark", "accpass", "layer")] + [("nextuse", np.float64), ("prio", np.float64)])
# A transfer slot's record (``T[t]``): its key, priority (DEMAND, PREFETCH), sequence number,
# whether it started or was withdrawn, whether it bypasses the cache, its place in the prefetch
# ring; when it was issued, starts, is done, and its duration. Its 88 bytes of fields take a
# 128-byte record (issue 34, at cecb79f: with records 88 bytes apart, the kernel's CPU time on the 25.6 M-access
# LRU file was 1.29-1.70 s against 1.07-1.34 s, five interleaved rounds; least-stale +
# score-percentile and per-expert execution on 5.12 M accesses 0.95-1.20 s against 0.78-1.05 s
# and 0.57-0.63 s against 0.49-0.66 s, four rounds each; the same summaries)
_TRANSFER_FIELDS = ([(name, np.int64) for name in ("key", "prio", "seq", "started", "cancelled", "bypass", "pfslot")]
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
# offsets (H_*), then the regions (queues, lists, scratch).
(S_SEQ, S_TSEQ, S_USED, S_MAXUSED, S_BYTES, S_HEAD, S_TAIL, S_DQN, S_PFH, S_PFN, S_RH, S_RN,
 S_FREEN, S_WH, S_WN, S_PENDN, S_MEMBN, S_PINGEN, S_PENDGEN, S_PASS, S_LAYER, S_MARKGEN,
 S_LAYERGEN, S_LRUNN, S_LRUNN1, S_NCOMP, S_NDEM, S_PBASE, S_ABASE,
 C_EV, C_PF, C_DEPTH, C_MODE, C_INSTANT, C_NBYTES, C_L, C_DIV, C_TLEN,
 C_PFACTIVE, C_MAXN, C_NPREC, C_DPREC, C_MISS, C_DROPRANK, C_PROBS, C_K, C_NE, C_LRUNCAP,
 C_NLEV, C_IMPORTANT, C_MULTI, C_REROUTE, C_BLOCKING, C_HOST, C_HSYNC, C_STABLE, C_LSWB,
 R_HITS, R_MISSES, R_LATE, R_COLL, R_UNCACHED, R_BYTES, R_PFISSUED, R_PFUSED, R_PREDHITS,
 R_PRED, R_ACTUAL, R_PFCANCEL, R_UNIQUE, R_DROPPED, R_ALTERED, R_SUBST, R_LOWPREC,
 H_DQ, H_PFQ, H_RQ, H_FREE, H_WQ, H_PENDA, H_MEMB, H_LGEN, H_LADM, H_LMARK, H_RUNS,
 H_SCR, H_OFF, H_GROUP, H_KPOSOFF, H_KPOS, H_KNEXT, H_TTAB, H_SCALE, H_POOL, H_NKEYS,
 H_PENDMAX, H_LSQ, H_LSWALK, H_PFTMP, H_MSCR, H_FIN, H_LRUN, H_SPEC, H_ROUTED, H_LEVELS, H_PBYTES, H_VICT,
 H_PDUR, I_HEADER) = range(109)
R_FIRST, R_COUNT = R_HITS, R_LOWPREC + 1 - R_HITS
# The float state FS: scalars, configuration, then scratch.
(SF_BUSY_UNTIL, SF_BUSY, SF_NOW, SF_CARRY, SF_STALL, SF_MTOTAL, SF_MKEPT, SF_HOST, CF_CAP,
 CF_HLAYER, CF_HLAUNCH, CF_HCOPY, F_HEADER) = range(13)
# per-pass columns, in engine order
COLUMNS = ("hits", "misses", "late_prefetches", "collision_misses", "uncached_fetches", "bytes",
           "prefetches_issued", "prefetches_used", "prefetch_predicted_hits", "prefetch_predicted",
           "prefetch_actual", "prefetches_cancelled", "unique_computed", "dropped_experts", "tokens_altered",
           "substituted_experts", "low_precision_experts")
# miss policies with a kernel form
MISS_FETCH, MISS_DROP, MISS_SUBSTITUTE, MISS_SPECULATIVE, MISS_LOWEST_BIT, MISS_PRIORITY = range(6)


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


@_inline
def _buffer(buf, IS):
    """The first record in ``W`` of per-expert execution's lookup buffer ``buf`` (0 or 1)."""
    return IS[H_LRUN] + buf * IS[C_LRUNCAP]


@_inline
def _ring(i, size):
    """``i % size`` for ``0 <= i < 2 * size``: a ring buffer's slot one step, or up to its
    count, past its head (``0 <= head < size``, ``count <= size``), found with a comparison
    instead of a division."""
    return i - size if i >= size else i


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


@_inline
def _set_clock(IS, A):
    """Set a hook policy's clock (:mod:`policies.hooks`) to the replay's pass, layer and stamp
    counter."""
    clock = A[U][U_CLOCK]
    clock[CLOCK_PASS] = IS[S_PASS]
    clock[CLOCK_LAYER] = IS[S_LAYER]
    clock[CLOCK_TICK] = IS[S_SEQ]


@_jit
def _stamp(key, IS, K):
    IS[S_SEQ] += 1
    K[key].stamp = IS[S_SEQ]


@_jit
def _new_gen(IS, which):
    IS[which] += 1
    return IS[which]


def _set_walk(IS: np.ndarray, walk: np.ndarray) -> None:
    """Install a list form's victim walk table (``H_LSWALK``, rows of ``C_LSWB``; its region
    sized ``walk.size`` by :func:`_layout`)."""
    IS[C_LSWB] = walk.shape[-1] if walk.size else 0
    IS[IS[H_LSWALK]:IS[H_LSWALK] + walk.size] = walk.ravel()


def _layout(num_keys: int, pool: int, pend_max: int, maxn: int, top_k: int = 1, fin: int = 1,
            lrun: int = 1, nprec: int = 1, per_layer: int = 0, walk: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                                                                          np.ndarray]:
    """The state arrays ``IS``, ``FS``, ``K``, ``T``, ``W``, initialised: regions after the
    headers, their offsets in ``IS`` (``W``'s regions' first records there too).
    Every precision (``nprec``) is one byte and takes one second to copy until set
    (``H_PBYTES``, ``H_PDUR``); the only precision level is the default, 0. ``per_layer``:
    the keys of a layer (``C_DIV``: experts times precisions; 0, all the keys in one layer),
    each key's layer (``K.layer``) its key over it. ``walk``: the size of a list form's walk
    table (``H_LSWALK``, rows of ``C_LSWB``: :func:`moesim.policies.eviction.walk_table`)."""
    i_sizes = ((H_DQ, pool), (H_PFQ, pool), (H_RQ, pool),
               (H_FREE, pool), (H_WQ, num_keys), (H_MEMB, num_keys),
               (H_LGEN, num_keys), (H_LADM, num_keys), (H_LMARK, num_keys),
               (H_SPEC, 2 * lrun), (H_ROUTED, num_keys), (H_LSQ, 4 * num_keys), (H_LSWALK, walk),
               (H_PFTMP, pool), (H_FIN, fin), (H_LEVELS, nprec), (H_PBYTES, nprec), (H_VICT, 2 * num_keys))
    f_sizes = ((H_SCR, 2 * max(1, maxn)), (H_MSCR, 2 * top_k),
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
    K = np.zeros(num_keys, KEY).view(np.recarray)
    for name in ("tid", "curpass", "prev", "next", "memb", "evicted", "accpass"):
        K[name] = -1
    T = np.zeros(pool, TRANSFER).view(np.recarray)
    # W's regions: the layer's computations, the two lookup buffers, the pending prefetches
    IS[H_RUNS], IS[H_LRUN], IS[H_PENDA] = 0, max(1, maxn), max(1, maxn) + 2 * lrun
    W = np.zeros(max(1, maxn) + 2 * lrun + pend_max, WORK).view(np.recarray)
    IS[IS[H_FREE]:IS[H_FREE] + pool] = np.arange(pool - 1, -1, -1)
    IS[IS[H_LGEN]:IS[H_LGEN] + num_keys] = 1
    IS[IS[H_LSQ]:IS[H_LSQ] + 4 * num_keys] = -1
    IS[C_DIV] = per_layer or num_keys
    K["layer"] = np.arange(num_keys) // IS[C_DIV]
    IS[C_NPREC] = nprec
    IS[C_NLEV] = 1
    IS[C_NBYTES] = 1
    IS[IS[H_PBYTES]:IS[H_PBYTES] + nprec] = 1
    FS[IS[H_PDUR]:IS[H_PDUR] + nprec] = 1.0
    return IS, FS, K, T, W

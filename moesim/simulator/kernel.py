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

The kernel is in modules by concern, this one the replay's driver (which form runs, the
state's set-up, the loop over a trace's pieces and the hand-over of the per-pass rows):
:mod:`simulator.kernel_state` (the state's layout in two flat arrays, ``IS`` and ``FS``, and
the accessors every part uses), :mod:`simulator.kernel_copy` (the copy engine),
:mod:`simulator.kernel_cache` (the eviction policies' compiled orders, the victim search),
:mod:`simulator.kernel_lookup` (the lookup path and the miss policies),
:mod:`simulator.kernel_prefetch` (SpecMD's prefetch queue) and
:mod:`simulator.kernel_compute` (the compute stream and :func:`replay_passes`, the compiled
loop). numba's cache of each compiled function watches the whole package's sources
(:class:`moesim.jit.PackageCache`), so that a change in one module compiles again the callers
in the others. The kernel allocates nothing, so it is compiled without numba's runtime
(``_nrt=False``): its reference counting of the array arguments took 40% of the run time. The
lookup path's functions are always inlined by LLVM (``forceinline``): passing a dozen arrays to
each call cost more than half of what was left (LRU full timing went from 13 to 30M
accesses/s, the one-off compile from 12.6 to 13.2 s). The loops release the GIL (``nogil``),
so that a trace read in pieces has its next piece read and built (and, for score-percentile,
its prefetch proposals made: ``Workload.proposals``) on a second thread while this one replays
(:func:`simulator.stream.read_ahead`).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import os
import warnings
from collections.abc import Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from moesim.jit import HAVE_NUMBA, forget_large_tuples, forget_tuples
from moesim.simulator.kernel_compute import _preload, replay_passes
from moesim.simulator.kernel_copy import _advance
from moesim.simulator.kernel_state import (
    C_BLOCKING,
    C_DEPTH,
    C_DPREC,
    C_DROPRANK,
    C_EV,
    C_HOST,
    C_HSYNC,
    C_IMPORTANT,
    C_INSTANT,
    C_K,
    C_L,
    C_MAXN,
    C_MISS,
    C_MODE,
    C_MULTI,
    C_NBYTES,
    C_NE,
    C_NLEV,
    C_NPREC,
    C_PF,
    C_PFACTIVE,
    C_PROBS,
    C_REROUTE,
    C_STABLE,
    C_TLEN,
    CF_CAP,
    CF_HCOPY,
    CF_HLAUNCH,
    CF_HLAYER,
    COLUMNS,
    EV_BELADY,
    EV_FIFO,
    EV_HOOK,
    EV_LRU,
    EV_LS,
    H_GROUP,
    H_KNEXT,
    H_KPOS,
    H_KPOSOFF,
    H_LEVELS,
    H_MEMB,
    H_NKEYS,
    H_OFF,
    H_PBYTES,
    H_PDUR,
    H_SCALE,
    H_TTAB,
    MISS_DROP,
    MISS_FETCH,
    MISS_LOWEST_BIT,
    MISS_PRIORITY,
    MISS_SPECULATIVE,
    MISS_SUBSTITUTE,
    MODE_ARRIVAL,
    MODE_LAYER,
    MODE_PER_EXPERT,
    PF_ARRAY,
    PF_LOOKAHEAD,
    PF_NONE,
    PF_ORACLE,
    PF_PREV,
    R_COUNT,
    S_ABASE,
    S_BYTES,
    S_MAXUSED,
    S_PBASE,
    SF_BUSY,
    SF_NOW,
    _layout,
    _set_walk,
)
from moesim.simulator.workload import join, passes_of


# -- dispatch --------------------------------------------------------------------------------------
@functools.cache
def _policy_codes() -> tuple[dict[Any, int], dict[Any, int], dict[Any, int]]:
    """The built-in policy classes with a kernel form, and their codes (made once):
    eviction, prefetch, miss."""
    from moesim.policies import eviction as ev
    from moesim.policies.eviction.belady import Belady
    from moesim.policies.eviction.fifo import FIFO
    from moesim.policies.eviction.least_stale import LeastStale
    from moesim.policies.eviction.lru import LRU
    from moesim.policies.miss.drop import Drop
    from moesim.policies.miss.fetch import Fetch
    from moesim.policies.miss.fetch_lowest_bit import FetchLowestBit
    from moesim.policies.miss.fetch_priority import FetchPriority
    from moesim.policies.miss.speculative import Speculative
    from moesim.policies.miss.substitute import Substitute
    from moesim.policies.prefetch.lookahead import Lookahead
    from moesim.policies.prefetch.next_gate_topk import NextGateTopK
    from moesim.policies.prefetch.none import NoPrefetch
    from moesim.policies.prefetch.oracle import Oracle
    from moesim.policies.prefetch.previous_token import PreviousToken
    from moesim.policies.prefetch.score_percentile import ScorePercentile
    from moesim.policies.prefetch.static_pin import StaticPin

    # a built-in with a compiled form of its own (``compiled``, beside it in its module) runs
    # through the hooks, as a user's policy does (a subclass elsewhere does not inherit that)
    evictions = {LRU: EV_LRU, FIFO: EV_FIFO, LeastStale: EV_LS, Belady: EV_BELADY}
    evictions.update((cls, EV_HOOK) for _, cls in ev.REGISTRY.items()
                     if cls.__module__.startswith(ev.__name__ + ".") and cls.__dict__.get("compiled") is not None)
    prefetchers = {NoPrefetch: PF_NONE, StaticPin: PF_NONE, Oracle: PF_ORACLE, PreviousToken: PF_PREV,
                   Lookahead: PF_LOOKAHEAD, NextGateTopK: PF_ARRAY, ScorePercentile: PF_ARRAY}
    misses = {Fetch: MISS_FETCH, Drop: MISS_DROP, Substitute: MISS_SUBSTITUTE, Speculative: MISS_SPECULATIVE,
              FetchLowestBit: MISS_LOWEST_BIT, FetchPriority: MISS_PRIORITY}
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
# A kernel call replays at most CHUNK passes and, past its first pass, at most CALL_ACCESSES
# expert accesses (_calls): progress is reported, and Ctrl-C is seen, between calls, so a call
# is kept short whatever the passes hold (a prefill pass of thousands of tokens), and long
# enough that the Python between calls costs little. Issue 34, LRU on the 25.6 M-access
# benchmark trace (128 accesses a pass), in-process, six interleaved rounds: calls of 256 passes
# (800 calls) took 1.263 s best and 1.388 s median, of 2,048 passes (2**18 accesses) 1.174 and
# 1.330 s.
CHUNK = 2048
CALL_ACCESSES = 1 << 18
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
    CI machine with numba's cache emptied, :mod:`moesim.jitplan`'s helper on the other core:
    ``benchmarks/results/first_run_8494561_helper_{a,b}.txt``, README: Speed)."""
    return (f"moesim: compiling the replay kernel's form for {form}, once for this installation "
            f"(measured on a 2-core machine, a helper compiling on the other core: 15-19 s for layer execution "
            f"with fetch on a miss, 26-29 s per-expert, 29-31 s with a per-token miss policy, 63-66 s both); later "
            f"runs load it from numba's cache.")


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


def _walk(sim: Any, ev: int) -> np.ndarray:
    """Least-stale's victim walk, tabulated from its list form (``eviction.walk_table``; empty
    for the other policies: the recency lists walk one list). The replay asks twice (its
    region's size, then its contents): made once per shape (:func:`_ls_walk`)."""
    if ev != EV_LS:
        return np.zeros(0, np.int64)
    return _ls_walk(sim.model.num_layers, int(sim.eviction.params.order == "relative"))


@functools.cache
def _ls_walk(num_layers: int, relative: int) -> np.ndarray:
    """``eviction.walk_table`` of least-stale's form, read-only (it is shared)."""
    from moesim.policies.eviction import walk_table
    from moesim.policies.eviction.least_stale import LeastStaleLists

    table = walk_table(LeastStaleLists, num_layers, relative)
    table.setflags(write=False)
    return table


def _configure(sim: Any, IS: np.ndarray, FS: np.ndarray, ev: int, pf: int, miss: int, max_runs: int) -> None:
    """The replay's configuration (``C_*``, ``CF_*``) from ``sim``'s scenario and policies."""
    from moesim.policies.prefetch.lookahead import Lookahead

    model = sim.model
    reroute = miss in (MISS_DROP, MISS_SUBSTITUTE, MISS_SPECULATIVE)
    IS[C_EV] = ev
    IS[C_STABLE] = ev == EV_HOOK and hook_form(type(sim.eviction)).stable_priority
    _set_walk(IS, _walk(sim, ev))
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


def _calls(off: np.ndarray, n_pass: int, num_l: int) -> list[int]:
    """Where a piece's kernel calls begin and end: pass numbers from 0 to ``n_pass``, each call
    at least one pass, at most :data:`CHUNK`, and no more passes than keep its accesses (from
    the offsets ``off``, ``num_l`` a pass) within :data:`CALL_ACCESSES`."""
    starts = np.ascontiguousarray(off[::num_l])  # each pass's first access, and the end: n_pass + 1
    bounds = [0]
    while bounds[-1] < n_pass:
        q0 = bounds[-1]
        q1 = int(np.searchsorted(starts, starts[q0] + CALL_ACCESSES, "right")) - 1  # accesses that fit
        bounds.append(min(max(q1, q0 + 1), q0 + CHUNK))  # q1 <= n_pass: starts ends there
    return bounds


def _proposals_ahead(prefetch: Any, bounds: list[int]) -> Any:
    """A prefetcher's proposals (``proposals``, what the kernel reads) call by call over a
    piece's passes (``bounds``: :func:`_calls`), the next call's made on a second thread while
    the kernel replays this one: they depend on the trace alone, and the kernel and
    score-percentile's compiled proposals both release the GIL (issue 34: score-percentile's
    proposals took a third of a least-stale + score-percentile replay's time on the main
    thread)."""
    with ThreadPoolExecutor(max_workers=1) as ahead:
        nxt = ahead.submit(prefetch.proposals, bounds[0], bounds[1])
        for i in range(1, len(bounds)):
            done = nxt.result()
            if i + 1 < len(bounds):
                nxt = ahead.submit(prefetch.proposals, bounds[i], bounds[i + 1])
            yield done


def _chunks_of(proposals: tuple[np.ndarray, np.ndarray], bounds: list[int],
               num_l: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """A piece's proposals made as it was read (``Workload.proposals``), as :func:`_proposals_ahead`
    hands them over: call by call (``bounds``), each call's offsets from 0."""
    off, keys = proposals
    for q0, q1 in itertools.pairwise(bounds):
        o = off[q0 * num_l:q1 * num_l + 1]
        yield o - o[0], keys[o[0]:o[-1]]


def _hand_over(sim: Any, wl: Any, outs: list[tuple[Any, ...]], miss: int) -> Any:
    """Give ``sim`` the per-pass columns of the passes of ``wl`` (``outs``, as the kernel
    wrote them call by call), which it turns into per-pass rows
    (:meth:`simulator.engine.Simulation.take_block`). Returns ``wl``."""
    cols, t_start, t_end, stall, m_total, m_kept = (np.concatenate(x) for x in zip(*outs, strict=True))
    named = dict(zip(COLUMNS, np.ascontiguousarray(cols.T), strict=True))
    sim.take_block(wl, named, t_start, t_end, stall, (m_total, m_kept) if miss != MISS_FETCH else None)
    return wl


def _hand_over_pieces(sim: Any, parts: list[Any], outs: list[tuple[Any, ...]], miss: int) -> Any:
    """:func:`_hand_over` for the pieces replayed since the last (``parts``: their passes and
    requests, joined here): a trace read in pieces hands its passes over about
    :data:`BLOCK_PASSES` at a time, so that they need not all be in memory at once, on a
    thread of its own while the kernel replays the next pieces (issue 34: the hand-overs took
    0.11-0.12 s of the replay's thread on the 25.6 M-access benchmark trace). Returns the
    joined workload."""
    return _hand_over(sim, join(parts), outs, miss)


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


def _pass_arrays(wl: Any) -> tuple[np.ndarray, ...]:
    """A piece's per-pass arrays for the kernel: each pass's release time (it reads), then those
    it writes the results into: the counts (``COLUMNS``), start and end times, stall, gate mass
    total and computed."""
    n_pass = wl.num_passes
    return (np.ascontiguousarray(wl.release(), np.float64), np.zeros((n_pass, R_COUNT), np.int64),
            np.zeros(n_pass), np.zeros(n_pass), np.zeros(n_pass), np.zeros(n_pass), np.zeros(n_pass))


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
    IS, FS, K, T, W = _layout(num_keys, pool, pend_max, max_runs, model.top_k, max(1, max_rows * model.top_k),
                              max(1, max_rows), sim.num_prec, div, _walk(sim, ev).size)
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
            _preload(np.asarray(pinned, np.int64), IS, K, FS, DI, DF, A)
    no_props = (np.zeros(1, np.int64), np.zeros(0, np.int64))
    per_expert = True if IS[C_MODE] == MODE_PER_EXPERT else None  # else its code is not compiled
    outs: list[tuple[Any, ...]] = []  # the per-pass columns of the pieces not handed over yet
    parts: list[Any] = []  # and those pieces' passes and requests
    rows_done, n_pieces = 0, 0  # trace rows and pieces replayed
    base, held = 0, 0  # passes of the pieces before this one, and of those in ``outs``
    handing = None  # the block of passes being handed over (a trace read in pieces)
    with ThreadPoolExecutor(1, thread_name_prefix="moesim-rows") if streamed else contextlib.nullcontext() as rows:
        while True:
            n_pass = wl.num_passes
            release, cols, t_start, t_end, stall, m_total, m_kept = _pass_arrays(wl)
            IS[S_PBASE] = base
            props = None
            bounds = _calls(wl.off, n_pass, num_l)
            if pf == PF_ARRAY:
                props = (_chunks_of(wl.proposals, bounds, num_l) if wl.proposals is not None
                         else _proposals_ahead(sim.prefetch, bounds))
            for q0, q1 in itertools.pairwise(bounds):
                with _hook_errors(sim):  # the compiled hooks run here (and make the proposals ahead)
                    P = next(props) if props is not None else no_props
                    replay_passes(base + q0, base + q1, IS, K, T, W, FS, DI, DF, A, P, M, per_expert, nonexp[q0:q1],
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
                _hand_over(sim, wl, outs, miss)
                break
            parts.append(passes_of(wl))  # its per-access and per-row arrays go with the piece
            rows_done += len(wl.trace)
            nxt = next_piece(sim.pieces, float(FS[SF_NOW]))  # serving: formed now the last has ended
            if nxt is None or held >= BLOCK_PASSES:
                if handing is not None:
                    handing.result()  # one block at a time: its errors raised here, its memory let go
                assert rows is not None
                handing = rows.submit(_hand_over_pieces, sim, parts, outs, miss)
                outs, parts, held = [], [], 0
            if nxt is None:
                break
            del DI, A, DF, M, nonexp
            forget_large_tuples()  # the piece's per-access arrays, kept by the kernel with their type
            wl = nxt
            sim.bind_piece(wl)
            DI, A, DF, M, nonexp = _piece(sim, wl, ev, miss, max_rows, IS, FS, hooks,
                                          None if firsts is None else _belady_piece(sim, wl, firsts, afters, n_pieces))
        if handing is not None:
            sim.wl = handing.result()  # the last block's passes and requests
            sim.trace_pieces = n_pieces
    _advance(math.inf, IS, K, T, FS)  # the transfers still queued or running complete
    if sim.stream_source is not None:
        sim.check_source()  # the file the pieces came from is the one the first passes read
    sim.copy.busy_time = float(FS[SF_BUSY])
    sim.copy.bytes_moved = int(IS[S_BYTES])
    sim.cache.max_used = int(IS[S_MAXUSED])

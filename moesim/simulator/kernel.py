"""The compiled replay kernel: the SimPy model's decisions and timing over flat arrays.

The SimPy process of :mod:`simulator.engine` is the reference semantics. This module replays
the same model — the lookup path (hit / late prefetch / miss, collision misses, uncached
fetches under the same pinning rule), SpecMD appendix A.3's prefetch queue (selection,
waiting proposals, admission against the target layer's earlier admissions, withdrawal at the
target layer), the copy engine (demand before prefetch, first come, first served within a priority, promotion of
a queued prefetch a layer needs, non-preemptive service) and the three ``expert_compute``
modes — as numba-compiled loops over the workload's arrays, with no per-access or
per-transfer Python objects. It is bit-identical to the SimPy path on every per-pass column
(``tests/test_kernel.py`` checks a grid and hypothesis-generated scenarios; the golden grid
holds both paths to the same digests).

The eviction policy runs as its compiled form (:class:`moesim.policies.eviction.base.KernelForm`,
beside the policy in its module; a policy given as hooks runs through
:class:`moesim.policies.hooks.PriorityHooks`, or :class:`moesim.policies.list_hooks.ListHooks`
when it walks an order of its own): the kernel is compiled once per group of the forms shipped
with moesim (the common ones and the rare ones, :mod:`moesim.policies.eviction.forms`), for the
group of the replay's form, and picks that form by its index in the group
(:mod:`simulator.kernel_cache`), so that it names none. Scope (:func:`kernel_form`): one GPU; routing that does not change what
tokens compute, with any budget policy (its choices made ahead of the kernel's calls,
:func:`budget_lookups`), or a routing policy with a compiled form
(:func:`routing_form`: it chooses each row's experts at the routing point from what is cached
then, and the kernel looks them up, :func:`simulator.kernel_compute._routed_lookups`; a user's
routing policy written as a hook, :class:`policies.routing.hooked.HookRouting`, has one when
it compiles); an eviction policy with a compiled form, a prefetcher and a miss
policy with a compiled form (:func:`miss_form`: it decides, the kernel carries the decision out), and a prefetcher with a compiled form
(:meth:`~moesim.policies.prefetch.base.PrefetchPolicy.why_not_compiled`: its proposals are arrays
made ahead of the kernel's calls from the trace alone, :func:`_proposals_ahead`; a user's
prefetcher written as a hook, :class:`policies.hooks.HookPrefetch`, has one when it compiles). The miss policies that re-route tokens
keep what each token of the layer computes (``kernel_state._final``); the precision cascades cache
entries of several sizes (a key's precision gives its bytes, copy and compute seconds; room is
made by as many victims as it takes, in :func:`simulator.kernel_cache._victims`). Everything else
— a routing policy under a budget policy (the budget's Python choice follows the routing's),
expert parallelism, a policy without a compiled form or whose hooks numba cannot
compile, and a replay that records its decisions (``Simulation.decisions``, which the
calibration executor carries out) — runs on the SimPy path, and the replay says why. A replay
that records its timeline (``moesim run --events``) writes the same records into the kernel's
log as the SimPy path gives its :class:`simulator.recording.Recorder` (:func:`_drain`).

The same functions run as plain Python under ``NUMBA_DISABLE_JIT=1`` (the tests check that
they give the same answer), at about a third of the SimPy path's speed; so where numba is not
installed the SimPy path runs. ``MOESIM_NO_KERNEL=1`` forces the SimPy path.

The kernel is in modules by concern, this one the replay's driver (which form runs, the
state's set-up, the loop over a trace's pieces and the hand-over of the per-pass rows):
:mod:`moesim.kernel_state` (the state's layout in flat arrays and the accessors every part
uses), :mod:`simulator.kernel_copy` (the copy engine), :mod:`simulator.kernel_cache` (the
eviction form's events and victims, room made, insertion), :mod:`simulator.kernel_lookup` (the
lookup path and the miss policies), :mod:`simulator.kernel_prefetch` (SpecMD's prefetch queue)
and :mod:`simulator.kernel_compute` (the compute stream and :func:`replay_passes`, the compiled
loop). numba's cache of each compiled function watches the whole package's sources
(:class:`moesim.jit.PackageCache`), so that a change in one module compiles again the callers
in the others. The kernel allocates nothing, so it is compiled without numba's runtime
(``_nrt=False``: its reference counting of the array arguments cost time), and its internal
functions without wrappers for Python (:data:`moesim.jit.kernel`); the lookup path's functions
are always inlined by LLVM (``forceinline``: passing a dozen arrays to each call cost more than
inlining). The loops release the GIL (``nogil``), so that a trace read in pieces has its next
piece read and built (and a prefetcher's proposals made: ``Workload.proposals``) on a second
thread while this one replays (:func:`simulator.stream.read_ahead`).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import warnings
from collections.abc import Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from moesim.jit import HAVE_NUMBA, forget_large_tuples, forget_tuples
from moesim.kernel_state import (
    C_BLOCKING,
    C_DPREC,
    C_FORM,
    C_HANDED,
    C_HOST,
    C_HSYNC,
    C_INSTANT,
    C_K,
    C_KEEPSTATIC,
    C_L,
    C_LOOKUP,
    C_MAXN,
    C_MISS,
    C_MISSARG,
    C_MODE,
    C_MULTI,
    C_NBYTES,
    C_NE,
    C_NLEV,
    C_NPREC,
    C_PENDING,
    C_PFACTIVE,
    C_PROBS,
    C_PUREVICT,
    C_RECPASS,
    C_REROUTE,
    C_ROUTE,
    C_TLEN,
    CF_CAP,
    CF_HCOPY,
    CF_HLAUNCH,
    CF_HLAYER,
    COLUMNS,
    H_LEVELS,
    H_LOG,
    H_NKEYS,
    H_PBYTES,
    H_PDUR,
    H_SCALE,
    H_TTAB,
    LOG_WIDTH,
    MODE_ARRIVAL,
    MODE_LAYER,
    MODE_PER_EXPERT,
    R_COUNT,
    S_BYTES,
    S_LOGN,
    S_MAXUSED,
    S_PBASE,
    SF_BUSY,
    SF_NOW,
    Accesses,
    Tokens,
    _layout,
    grow_rows,
    region,
)
from moesim.policies.eviction.base import KernelForm
from moesim.policies.miss.base import MissForm
from moesim.policies.routing.base import RoutingForm
from moesim.simulator.kernel_compute import _finish, _preload, replay_passes
from moesim.simulator.workload import join, passes_of


# -- dispatch --------------------------------------------------------------------------------------
def miss_form(cls: type) -> type[MissForm] | None:
    """The compiled form the kernel runs for miss policy class ``cls``
    (:func:`moesim.policies.miss.forms.form_of`), or None (the SimPy path)."""
    from moesim.policies.miss.forms import form_of

    return form_of(cls)


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
    if sim.decisions is not None:
        return "the replay records its decisions"
    if sim.scenario.hardware.gpus > 1:
        return "expert parallelism"
    if sim.routing.changes_routing:
        name = sim.scenario.policies.routing.name
        if routing_form(type(sim.routing)) is None:
            from moesim.policies.routing.hooked import HookRouting
            from moesim.policies.routing.hooked import compiled_choose as compiled_route

            if isinstance(sim.routing, HookRouting):
                return f"routing policy '{name}': {compiled_route(type(sim.routing))}"
            return f"routing policy '{name}' has no kernel form"
        if sim.budget.restricts:
            return (f"routing policy '{name}' under budget policy '{sim.scenario.policies.budget.name}' "
                    "(the budget's choice follows the routing, in Python)")
    if miss_form(type(sim.miss)) is None:
        name = sim.scenario.policies.miss.name
        from moesim.policies.miss.hooked import HookMiss, compiled_choose

        if isinstance(sim.miss, HookMiss):
            return f"miss policy '{name}': {compiled_choose(type(sim.miss))}"
        return f"miss policy '{name}' has no kernel form"
    if eviction_form(type(sim.eviction)) is None:
        name = sim.scenario.policies.eviction.name
        from moesim.policies.hooks import HookEviction, compiled
        from moesim.policies.list_hooks import HookListEviction, compiled_lists

        if isinstance(sim.eviction, HookEviction):
            return f"eviction policy '{name}': {compiled(type(sim.eviction))}"
        if isinstance(sim.eviction, HookListEviction):
            return f"eviction policy '{name}': {compiled_lists(type(sim.eviction))}"
        return f"eviction policy '{name}' has no kernel form"
    why = prefetch_form(type(sim.prefetch))
    if why is not None:
        return f"prefetch policy '{sim.scenario.policies.prefetch.name}': {why}"
    return None


def eviction_form(cls: type) -> type[KernelForm] | None:
    """The compiled form the kernel runs for eviction policy class ``cls``
    (:func:`moesim.policies.eviction.forms.form_of`), or None (the SimPy path)."""
    from moesim.policies.eviction.forms import form_of

    return form_of(cls)


def routing_form(cls: type) -> type[RoutingForm] | None:
    """The compiled form the kernel runs for routing policy class ``cls``
    (:func:`moesim.policies.routing.forms.form_of`), or None (the SimPy path)."""
    from moesim.policies.routing.forms import form_of

    return form_of(cls)


def prefetch_form(cls: type) -> str | None:
    """Why the kernel cannot run prefetch policy class ``cls`` (a line; the SimPy path), or
    None: it proposes through arrays its compiled form makes, or nothing in the replay
    (:meth:`~moesim.policies.prefetch.base.PrefetchPolicy.why_not_compiled`)."""
    why: str | None = cls.why_not_compiled()  # type: ignore[attr-defined]
    return why


def _form_arrays(policy: Any, num_keys: int) -> tuple[tuple[Any, ...], tuple[np.ndarray, ...]]:
    """The eviction form's ``A.hooks`` (a hook policy's compiled hooks and their state, and
    hooks never called: :func:`moesim.policies.eviction.forms.hooks_of`) and its own state
    arrays, ``A.form``."""
    from moesim.policies.eviction.forms import hooks_of

    form = eviction_form(type(policy))
    assert form is not None, "kernel_form"
    S = form.state(policy, num_keys)
    return hooks_of(policy, S), S


# A kernel call replays at most CHUNK passes and, past its first pass, at most CALL_ACCESSES
# expert accesses (_calls): progress is reported, and Ctrl-C is seen, between calls, so a call
# is kept short whatever the passes hold (a prefill pass of thousands of tokens), and long
# enough that the Python between calls costs little (calls of 256 passes were measurably
# slower than of 2,048).
CHUNK = 2048
CALL_ACCESSES = 1 << 18
# forward passes whose per-pass rows a replay in pieces hands over at a time (_hand_over): from
# the second block on they go to disk (``output.results.PassRows``). A block's rows take about
# 1 KB a pass while they are made into a frame, so smaller blocks keep the peak lower at no
# cost in time down to this size.
BLOCK_PASSES = 1 << 13


def _read_only(a: np.ndarray) -> np.ndarray:
    """``a`` as a C-contiguous view the kernel cannot write. A trace read from a file holds its
    float columns in Arrow's read-only buffers and a synthesised one in NumPy's own; numba
    types the two apart and would compile the kernel once for each, so every trace's float
    rows reach it read-only."""
    view = np.ascontiguousarray(a, np.float32).view()
    view.flags.writeable = False
    return view


_NO_PRED = _read_only(np.zeros((1, 1), np.float32))  # M.pred of a trace without next-layer predictions


def _mass_arrays(sim: Any, chosen: np.ndarray | None) -> Tokens:
    """What the per-token functions read (:data:`moesim.kernel_state.Tokens`): the trace's
    rows of each (pass, layer) in order (CSR), its experts, the experts the budget policy
    leaves each row (``chosen``; None: the experts themselves), the mass per row (router
    probabilities when the trace has them, else the top-k weights), each row's token
    (request, position) numbered, a mark per token, the next-layer predictions (speculative)
    and per token its row in the latest layer replayed and that layer's (pass, layer) index;
    the miss policy's hook; the routing form's arrays (under a routing policy that changes what
    tokens compute, ``chosen`` starts as the router's choice and the form rewrites it at each
    routing point)."""
    from moesim.policies.miss.hooked import hook_arrays
    from moesim.policies.routing.hooked import route_arrays

    wl = sim.wl
    trace = wl.trace
    assert trace is not None
    assert wl.row_order is not None
    assert wl.row_off is not None
    mass = wl.probs if wl.probs is not None else trace.weights
    tok = trace.request.astype(np.int64) * (int(trace.position.max(initial=0)) + 1) + trace.position
    _, token = np.unique(tok, return_inverse=True)
    n_tok = int(token.max(initial=0)) + 1
    experts = np.ascontiguousarray(trace.experts, np.int16)
    route = route_arrays()
    if sim.routing.changes_routing:  # its form writes each row's experts at the routing point
        form = routing_form(type(sim.routing))
        assert form is not None, "kernel_form"
        route = form.arrays(sim.routing, wl)
        chosen = experts.copy()
    return Tokens(np.ascontiguousarray(wl.row_order, np.int64), np.ascontiguousarray(wl.row_off, np.int64),
                  experts, experts if chosen is None else chosen, _read_only(mass),
                  token.astype(np.int64), np.full(n_tok, -1, np.int64),
                  _read_only(wl.pred_next) if wl.pred_next is not None else _NO_PRED,
                  np.zeros(n_tok, np.int64), np.full(n_tok, -1, np.int64),
                  hook_arrays(sim.miss, sim.model.num_experts), route)


def _precisions(sim: Any, miss: type[MissForm], max_rows: int, IS: np.ndarray, FS: np.ndarray) -> np.ndarray:
    """Per precision (largest first): entry bytes, copy seconds and the expert seconds by
    token count (another precision's as the per-token lookup path computes it; only a
    precision cascade reads those rows); the precisions the miss policy fetches at (a
    cascade's, else the scenario's). Returns ``DF``: the seconds table, then the per-pass
    factor."""
    sizes = [int(sim.model.expert_bytes[q]) for q in sim.precisions]
    cascade = miss.cascade
    IS[C_NPREC], IS[C_DPREC], IS[C_NBYTES] = sim.num_prec, sim.default_prec, sim.expert_bytes
    region(IS, H_PBYTES, sim.num_prec, IS)[:] = sizes
    region(FS, H_PDUR, sim.num_prec, IS)[:] = [sim.copy.duration(nb) for nb in sizes]
    levels = list(sim.miss.levels) if cascade else [sim.default_prec]
    region(IS, H_LEVELS, len(levels), IS)[:] = levels
    IS[C_NLEV] = len(levels)
    IS[C_MULTI] = cascade  # only a cascade caches other precisions
    table, scale = sim.costs.ffn_table(max_rows)  # a substitute computes up to all of a layer's tokens
    rows = np.zeros((sim.num_prec, len(table)))
    for q, nb in enumerate(sizes):
        if q == sim.default_prec:
            rows[q] = table
        elif cascade and sim.scenario.timing:
            rows[q, 1:] = [sim.cost.expert_time_at(n, nb) for n in range(1, len(table))]
    IS[H_TTAB], IS[H_SCALE], IS[C_TLEN] = sim.default_prec * len(table), rows.size, len(table)
    return np.concatenate([rows.ravel(), scale])


_ANNOUNCE: dict[str, Any] = {}  # "say": told of this process's kernel compiles; "ticker": the one running


def form_of(args: tuple[Any, ...]) -> str:
    """Which form of the kernel a compile of :func:`replay_passes` with these argument types
    makes (``M`` and ``per_expert`` are None where the scenario cannot reach their code)."""
    names = getattr(replay_passes, "py_func", replay_passes).__code__.co_varnames
    types = dict(zip(names, args, strict=False))
    mode = "layer or on-arrival" if str(types["per_expert"]) == "none" else "per-expert"
    miss = "fetch on a miss" if str(types["M"]) == "none" else "a per-token miss policy"
    return f"{mode} execution, {miss}"


def announce_compiles(say: Any) -> None:
    """Call ``say(text)`` when this process starts compiling a form of the replay kernel (a
    numba cache miss: the first replay of that form after an installation, or after an
    upgrade changed the kernel), every :func:`moesim.output.console.every` seconds while it
    compiles, and when it is done; numba's compile event fires for a compile only, never for
    a load from its cache. A later call replaces ``say``."""
    first = not _ANNOUNCE
    _ANNOUNCE["say"] = say
    if not first or not HAVE_NUMBA:
        return
    from numba.core import event

    from moesim.output.console import Ticker

    def ours(ev: Any) -> bool:
        return ev.data["dispatcher"].py_func is getattr(replay_passes, "py_func", None)

    class _Listener(event.Listener):
        def on_start(self, ev: Any) -> None:
            if ours(ev):
                _ANNOUNCE["say"](compile_message(form_of(tuple(ev.data["args"]))))
                _ANNOUNCE["ticker"] = Ticker(lambda s: _ANNOUNCE["say"](
                    f"moesim: still compiling the replay kernel ({s:.0f} s)"))

        def on_end(self, ev: Any) -> None:
            ticker = _ANNOUNCE.pop("ticker", None) if ours(ev) else None
            if ticker is not None:
                took = ticker.stop()
                _ANNOUNCE["say"](f"moesim: compiled the replay kernel in {took:.0f} s; later runs load it from "
                                 "numba's cache.")

    event.register("numba:compile", _Listener())


def compile_message(form: str) -> str:
    """The note a run gives as it starts compiling the kernel's ``form``."""
    return f"moesim: compiling the replay kernel's form for {form}, once for this installation."


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


def _piece(sim: Any, wl: Any, first_pass: int, miss: type[MissForm], max_rows: int, IS: np.ndarray, FS: np.ndarray,
           hooks: tuple[Any, ...], S: tuple[np.ndarray, ...],
           after: tuple[int, np.ndarray] | None = None) -> tuple[Any, ...]:
    """The kernel's read-only data for the passes of ``wl`` (the whole trace's workload, or a
    piece of it, whose first pass is the replay's ``first_pass``): ``DI`` = access offsets
    (and, under a budget policy, lookup offsets: :func:`budget_lookups`); ``A`` = the per-access arrays (layer,
    expert, tokens routed, summed gate weight, best router rank), the eviction form's ``hooks``
    and its state ``S`` as its :meth:`~moesim.policies.eviction.base.KernelForm.piece` makes it
    for ``wl`` (``after``: the piece's first access and every key's first access after it,
    counted over the whole trace or the run, ``Source.piece_futures``; None: ``wl`` is the
    whole trace, which starts at 0 with nothing after it); ``DF`` = expert seconds by token count
    | per-pass factor; ``M`` = the per-token arrays; the non-expert seconds of each pass. Region
    offsets go to ``IS``."""
    DI = np.ascontiguousarray(wl.off, dtype=np.int64)
    form = eviction_form(type(sim.eviction))
    assert form is not None
    S = form.piece(sim.eviction, S, wl, after, int(IS[H_NKEYS]))
    A = Accesses(wl.acc_layer, wl.acc_expert, wl.acc_tokens, wl.acc_weight, wl.acc_rank, hooks, S)
    DF = _precisions(sim, miss, max_rows, IS, FS)
    chosen = None
    IS[C_LOOKUP] = 0  # each (pass, layer) looks its accesses up
    if sim.budget.restricts:
        DI, A, chosen = budget_lookups(sim, wl, first_pass, DI, A)
        IS[C_LOOKUP] = len(wl.off)
    elif IS[C_ROUTE]:
        DI, A = routing_room(DI, A, sim.model.num_experts)
        IS[C_LOOKUP] = len(wl.off)
    M = _mass_arrays(sim, chosen) if sim.general else None
    return DI, A, DF, M, sim.costs.nonexpert_times()


def budget_lookups(sim: Any, wl: Any, first_pass: int, DI: np.ndarray,
                   A: Accesses) -> tuple[np.ndarray, Accesses, np.ndarray]:
    """Under a budget policy: what each (pass, layer) of ``wl`` (whose first pass is the
    replay's ``first_pass``) looks up, as the SimPy path's
    :meth:`simulator.lookup.LayerLookup.plan` does at its routing point — the budget policy's
    choice (:func:`simulator.lookup.plan`, called once per (pass, layer) with routing, in the
    replay's order, so that a policy that keeps state sees the same calls), its experts in
    router order with their best ranks and tokens (:func:`simulator.lookup.router_order`).
    A budget policy reads the trace, never the cache, so its choices can be made ahead of the
    kernel's calls. Returns ``DI`` followed by the lookups' offsets (from ``len(wl.off)``,
    ``IS[C_LOOKUP]``), ``A`` with the lookups after the workload's accesses (their weights 0
    and never read: an eviction form is told of the router's access of a key instead,
    :func:`simulator.kernel_lookup._form_access`) and each trace row's experts as the policy
    leaves them (-1 past the last)."""
    from moesim.simulator.lookup import plan, router_order

    num_l = sim.model.num_layers
    off = wl.off
    n_acc = len(A.expert)
    chosen_rows = np.full(wl.trace.experts.shape, -1, np.int16)
    look_off = np.empty(len(off), np.int64)
    layer: list[int] = []
    expert: list[int] = []
    tokens: list[int] = []
    rank: list[int] = []
    for b in range(len(off) - 1):
        look_off[b] = n_acc + len(expert)
        if off[b] == off[b + 1]:
            continue  # no routing for this (pass, layer): the replay skips the layer
        p, lay = divmod(b, num_l)
        rows = wl.rows(p, lay)
        _, chosen = plan(sim, first_pass + p, lay, rows, None)
        for t, c in enumerate(chosen):
            chosen_rows[rows[t], :len(c)] = c
        experts, ranks, toks = router_order(chosen)
        layer += [lay] * len(experts)
        expert += experts
        tokens += [len(t) for t in toks]
        rank += ranks
    look_off[-1] = n_acc + len(expert)

    def joined(a: np.ndarray, more: list[Any]) -> np.ndarray:
        return np.concatenate((a, np.asarray(more, a.dtype)))

    A = A._replace(layer=joined(A.layer, layer), expert=joined(A.expert, expert), tokens=joined(A.tokens, tokens),
                   weight=joined(A.weight, [0.0] * len(expert)), rank=joined(A.rank, rank))
    return np.concatenate((DI, look_off)), A, chosen_rows


def routing_room(DI: np.ndarray, A: Accesses, num_experts: int) -> tuple[np.ndarray, Accesses]:
    """Under a routing policy that changes what tokens compute: ``DI`` followed by room for
    the lookups' offsets of each (pass, layer) (from ``len(DI)``, ``IS[C_LOOKUP]``) and ``A``
    followed by room for one layer's lookups (``num_experts``, the last of its arrays), which
    the kernel fills at each routing point from the form's choice
    (:func:`simulator.kernel_compute._routed_lookups`), as :func:`budget_lookups` fills them
    ahead of its calls."""
    def room(a: np.ndarray) -> np.ndarray:
        return np.concatenate((a, np.zeros(num_experts, a.dtype)))

    A = A._replace(layer=room(A.layer), expert=room(A.expert), tokens=room(A.tokens), weight=room(A.weight),
                   rank=room(A.rank))
    return np.concatenate((DI, np.zeros(len(DI), DI.dtype))), A


def _configure(sim: Any, IS: np.ndarray, FS: np.ndarray, miss: type[MissForm], max_runs: int) -> None:
    """The replay's configuration (``C_*``, ``CF_*``) from ``sim``'s scenario and policies."""
    from moesim.policies.eviction.forms import form_index

    model = sim.model
    form = eviction_form(type(sim.eviction))
    assert form is not None
    IS[C_FORM] = form_index(type(sim.eviction))
    IS[C_PENDING] = form.reads_pending
    IS[C_KEEPSTATIC] = form.keeps_static
    IS[C_PUREVICT] = form.pure_victim
    IS[C_BLOCKING] = sim.scenario.expert_fetch == "blocking"
    IS[C_HOST] = sim.host.on
    IS[C_HSYNC] = sim.host.sync
    depth = sim.scenario.host.prefetch_depth
    IS[C_HANDED] = -1 if depth is None else depth  # -1: every admitted copy is issued
    FS[CF_HLAYER], FS[CF_HLAUNCH], FS[CF_HCOPY] = sim.host.layer_s, sim.host.launch_s, sim.host.copy_s
    IS[C_MODE] = {"layer": MODE_LAYER, "on-arrival": MODE_ARRIVAL, "per-expert": MODE_PER_EXPERT}[
        sim.scenario.expert_compute]
    IS[C_INSTANT] = not sim.scenario.timing
    IS[C_L] = model.num_layers
    IS[C_PFACTIVE] = sim.prefetch.active
    IS[C_MAXN] = max_runs
    FS[CF_CAP] = float(sim.capacity)
    from moesim.policies.miss.forms import form_index as miss_index

    IS[C_MISS] = miss_index(type(sim.miss))
    IS[C_MISSARG] = miss.arg(sim.miss)
    IS[C_REROUTE] = miss.reroutes
    IS[C_K] = model.top_k
    IS[C_NE] = model.num_experts
    IS[C_PROBS] = sim.general and sim.wl.probs is not None
    if sim.routing.changes_routing:  # 0: the router's own choice
        from moesim.policies.routing.forms import form_index as routing_index

        IS[C_ROUTE] = 1 + routing_index(type(sim.routing))


def next_piece(pieces: Generator[Any, float, None], now: float) -> Any:
    """The next piece, or None after the last. ``now`` (the simulated time the previous piece
    ended) goes to the source: a trace file's pieces ignore it; serving's scheduler
    (:mod:`simulator.serving`) forms the next forward pass from it."""
    try:
        return pieces.send(now)
    except StopIteration:
        return None


def _calls(off: np.ndarray, n_pass: int, num_l: int, single: int = 0) -> list[int]:
    """Where a piece's kernel calls begin and end: pass numbers from 0 to ``n_pass``, each call
    at least one pass, at most :data:`CHUNK`, and no more passes than keep its accesses (from
    the offsets ``off``, ``num_l`` a pass) within :data:`CALL_ACCESSES`; the first ``single``
    passes a call each (those the timeline records: :func:`_timeline`)."""
    starts = np.ascontiguousarray(off[::num_l])  # each pass's first access, and the end: n_pass + 1
    bounds = list(range(min(max(single, 0), n_pass) + 1))
    while bounds[-1] < n_pass:
        q0 = bounds[-1]
        q1 = int(np.searchsorted(starts, starts[q0] + CALL_ACCESSES, "right")) - 1  # accesses that fit
        bounds.append(min(max(q1, q0 + 1), q0 + CHUNK))  # q1 <= n_pass: starts ends there
    return bounds


def _proposals_ahead(prefetch: Any, bounds: list[int]) -> Any:
    """A prefetcher's proposals (``proposals``, what the kernel reads) call by call over a
    piece's passes (``bounds``: :func:`_calls`), the next call's made on a second thread while
    the kernel replays this one: they depend on the trace alone, and the kernel and the
    compiled proposals both release the GIL (made on the main thread, a prefetcher's proposals
    can take a third of the replay's time)."""
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


def _hand_over(sim: Any, wl: Any, outs: list[tuple[Any, ...]]) -> Any:
    """Give ``sim`` the per-pass columns of the passes of ``wl`` (``outs``, as the kernel
    wrote them call by call), which it turns into per-pass rows
    (:meth:`simulator.blocks.PassBlocks.take`). Returns ``wl``."""
    cols, t_start, t_end, stall, m_total, m_kept = (np.concatenate(x) for x in zip(*outs, strict=True))
    named = dict(zip(COLUMNS, np.ascontiguousarray(cols.T), strict=True))
    sim.blocks.take(wl, named, t_start, t_end, stall, (m_total, m_kept) if sim.general else None)
    return wl


def _hand_over_pieces(sim: Any, parts: list[Any], outs: list[tuple[Any, ...]]) -> Any:
    """:func:`_hand_over` for the pieces replayed since the last (``parts``: their passes and
    requests, joined here): a trace read in pieces hands its passes over about
    :data:`BLOCK_PASSES` at a time, so that they need not all be in memory at once, on a
    thread of its own while the kernel replays the next pieces (the hand-overs took
    0.11-0.12 s of the replay's thread on the 25.6 M-access benchmark trace). Returns the
    joined workload."""
    return _hand_over(sim, join(parts), outs)


def replay(sim: Any) -> None:
    """Replay ``sim`` with the kernel, filling its per-pass arrays, the copy engine's busy
    time and bytes, and the cache's high-water mark, as its SimPy process would. A trace read
    in pieces (``sim.source.pieces``, :mod:`simulator.stream`) is replayed piece after piece with
    the state carried over (the same arithmetic on the same state: ``S_PBASE`` maps a pass
    to its piece's arrays), and ``sim`` then adopts the joined passes."""
    with warnings.catch_warnings():
        if HAVE_NUMBA:  # the hooks in ``A.hooks`` are numba's first-class functions, "experimental"
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
    from moesim.policies.list_hooks import HookListEviction
    from moesim.policies.miss.hooked import HookMiss
    from moesim.policies.routing.hooked import HookRouting

    try:
        yield
    except (IndexError, ZeroDivisionError, ValueError, OverflowError) as exc:
        hooked = [f"{family} policy '{p.name}'" for family, p in (("eviction", sim.eviction), ("miss", sim.miss),
                                                                   ("prefetch", sim.prefetch), ("routing", sim.routing))
                  if isinstance(p, (HookEviction, HookListEviction, HookMiss, HookPrefetch, HookRouting))]
        if not hooked:
            raise
        from moesim.errors import MoesimError

        raise MoesimError(
            f"{' or '.join(hooked)}: a compiled hook raised {type(exc).__name__}: {exc} during the replay. "
            "Run it with MOESIM_NO_KERNEL=1: the SimPy path calls the hooks one at a time and names the hook, "
            "the forward pass and the layer.") from None


def _timeline(sim: Any, num_l: int, pool: int, max_runs: int) -> tuple[int, int]:
    """The pass the timeline stops before (``C_RECPASS``; 0: the replay records none) and the
    records a kernel call may write (``C_LOGCAP``). The passes it records are replayed a pass a
    call (:func:`_calls`); a pass writes a record per layer and one per transfer completed or
    withdrawn: those on the copy engine as it starts (at most ``pool``, the transfer slots) and
    those submitted in it, sized generously at ``max_runs`` demand copies and twice the slots of
    prefetches a layer (a call that would write more stops with an error rather than write past
    the log)."""
    rec = sim.recorder
    if not rec.active:
        return 0, 0
    return (1 << 62) if rec.passes is None else rec.passes, pool + num_l * (1 + max_runs + 2 * pool)


def _drain(sim: Any, IS: np.ndarray, FS: np.ndarray) -> None:
    """The timeline's records the last kernel call wrote, to the replay's recorder."""
    n = int(IS[S_LOGN])
    if n:
        sim.recorder.take(region(FS, H_LOG, n * LOG_WIDTH, IS).reshape(n, LOG_WIDTH))
        IS[S_LOGN] = 0


def _report(sim: Any, wl: Any, done: int, before: int, total: int) -> None:
    """Progress once the first ``done`` passes of ``wl`` are replayed: requests served
    (serving), the share of the file's rows replayed (a trace in pieces: ``before`` in the
    pieces before, of ``total``), or passes."""
    if sim.progress is None:
        return
    if sim.source.serving is not None:
        sim.progress(sim.source.serving.finished, sim.source.serving.n)
    elif sim.source.pieces is not None:
        sim.progress(before + len(wl.trace) * done // wl.num_passes, total)
    else:
        sim.progress(done, wl.num_passes)


def _pass_arrays(wl: Any) -> tuple[np.ndarray, ...]:
    """A piece's per-pass arrays for the kernel: each pass's release time (it reads), then those
    it writes the results into: the counts (``COLUMNS``), start and end times, stall, gate mass
    total and computed."""
    n_pass = wl.num_passes
    return (np.ascontiguousarray(wl.release(), np.float64), np.zeros((n_pass, R_COUNT), np.int64),
            np.zeros(n_pass), np.zeros(n_pass), np.zeros(n_pass), np.zeros(n_pass), np.zeros(n_pass))


def _layer_rows(wl: Any) -> int:
    """The most trace rows (tokens) any (pass, layer) of ``wl`` holds."""
    return int(np.diff(wl.row_off).max(initial=0)) if wl.row_off is not None else 0


def _replay(sim: Any) -> None:
    wl, model = sim.wl, sim.model
    num_l = model.num_layers
    div = model.num_experts * sim.num_prec
    num_keys = num_l * div
    streamed = sim.source.pieces is not None
    # a layer's distinct experts (a piece's largest is not the trace's: the bound when in pieces)
    maxn = model.num_experts if streamed or sim.budget.restricts else int(np.diff(wl.off).max(initial=0))
    assert prefetch_form(type(sim.prefetch)) is None, "kernel_form"
    pool = num_keys + maxn + 16
    pend_max = num_keys + 16
    miss = miss_form(type(sim.miss))
    assert miss is not None, "kernel_form"
    per_token = sim.general  # a miss or budget policy changes what tokens compute
    max_rows = _layer_rows(wl) if per_token else 0  # pieces: the most so far (grow_rows)
    # a layer computes its routed experts and, for a miss policy that re-routes, others
    max_runs = maxn + (model.num_experts if miss.reroutes else 0)
    window, log = _timeline(sim, num_l, pool, max_runs)
    IS, FS, K, T, W = _layout(num_keys, pool, pend_max, max_runs, model.top_k, max(1, max_rows * model.top_k),
                              max(1, max_rows), sim.num_prec, div, log)
    _configure(sim, IS, FS, miss, max_runs)
    IS[C_RECPASS] = window
    hooks, S = _form_arrays(sim.eviction, num_keys)
    # a policy reading the future, a piece at a time: each piece's first access and every key's first
    # access after it (a trace file's from a first pass over it, which the progress covers too)
    future = (sim.source.piece_futures(sim.num_prec, sim.default_prec, num_keys)
              if streamed and sim.eviction.reads_future else None)
    shown, total = sim.source.rows_shown, (1 + sim.source.first_passes) * sim.source.trace_rows  # after first passes
    DI, A, DF, M, nonexp = _piece(sim, wl, 0, miss, max_rows, IS, FS, hooks, S, None if future is None else future(wl, 0))
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
            bounds = _calls(wl.off, n_pass, num_l, window - base)
            if sim.prefetch.active:
                props = (_chunks_of(wl.proposals, bounds, num_l) if wl.proposals is not None
                         else _proposals_ahead(sim.prefetch, bounds))
            for q0, q1 in itertools.pairwise(bounds):
                with _hook_errors(sim):  # the compiled hooks run here (and make the proposals ahead)
                    P = next(props) if props is not None else no_props
                    replay_passes(base + q0, base + q1, IS, K, T, W, FS, DI, DF, A, P, M, per_expert, nonexp[q0:q1],
                                  release[q0:q1], cols[q0:q1], t_start[q0:q1], t_end[q0:q1], stall[q0:q1],
                                  m_total[q0:q1], m_kept[q0:q1])
                _drain(sim, IS, FS)
                _report(sim, wl, q1, shown + rows_done, total)
            outs.append((cols, t_start, t_end, stall, m_total, m_kept))
            n_pieces += 1
            base += n_pass
            held += n_pass
            if not streamed:
                _hand_over(sim, wl, outs)
                break
            parts.append(passes_of(wl))  # its per-access and per-row arrays go with the piece
            rows_done += len(wl.trace)
            nxt = next_piece(sim.source.pieces, float(FS[SF_NOW]))  # serving: formed now the last has ended
            if nxt is None or held >= BLOCK_PASSES:
                if handing is not None:
                    handing.result()  # one block at a time: its errors raised here, its memory let go
                assert rows is not None
                handing = rows.submit(_hand_over_pieces, sim, parts, outs)
                outs, parts, held = [], [], 0
            if nxt is None:
                break
            S = A.form  # the eviction form's state goes on (its per-piece part made anew)
            del DI, A, DF, M, nonexp
            forget_large_tuples()  # the piece's per-access arrays, kept by the kernel with their type
            wl = nxt
            sim.bind_piece(wl)
            if per_token:
                max_rows = max(max_rows, _layer_rows(wl))
                IS, W = grow_rows(IS, W, max_rows, model.top_k)
            DI, A, DF, M, nonexp = _piece(sim, wl, base, miss, max_rows, IS, FS, hooks, S,
                                          None if future is None else future(wl, n_pieces))
        if handing is not None:
            sim.wl = handing.result()  # the last block's passes and requests
            sim.source.trace_pieces = n_pieces
    _finish(IS, K, T, FS)  # the transfers still queued or running complete
    _drain(sim, IS, FS)
    if sim.source.stream_source is not None:
        sim.source.check_source()  # the file the pieces came from is the one the first passes read
    sim.copy.busy_time = float(FS[SF_BUSY])
    sim.copy.bytes_moved = int(IS[S_BYTES])
    sim.cache.max_used = int(IS[S_MAXUSED])

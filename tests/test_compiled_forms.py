"""The built-ins whose compiled form lives beside them (``LFU.compiled``, ``FLD``, ``score``, ``LHU``:
:mod:`moesim.policies.eviction`) against their reference forms, event by event: after any
sequence of inserts, uses, removals, layer and pass changes, the reference policy's ``candidates()``
equal the cached keys ordered by the compiled form's priority (kept after each insert and use
where the form declares it stable), ties by the oldest insert or use — this driver is written
here from the hook contract, not taken from :class:`moesim.policies.hooks.HookEviction`. The
forms' functions are checked as Python and as numba compiles them for the kernel (the
per-key ``priority`` and, for a form whose priority is not kept, the many-key ``priorities``
loop alike; a kept priority's form has none). Whole replays on both paths:
``tests/test_kernel.py``."""

from __future__ import annotations

from importlib import import_module

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moesim.jit import entry
from moesim.policies import eviction as ev
from moesim.policies.eviction import (
    CLOCK_KEYS_PER_LAYER,
    CLOCK_LAYER,
    CLOCK_LAYERS,
    CLOCK_PASS,
    CLOCK_PRECISIONS,
    CLOCK_SIZE,
)
from moesim.policies.eviction import REGISTRY as EVICTION
from moesim.policies.hooks import compiled
from moesim.policies.registry import PolicyContext
from tests.helpers import Callable, kernel_by_hand

# the kernel's functions called by hand: ``A`` holds the hook forms' first-class functions, which
# numba calls experimental
pytestmark = pytest.mark.filterwarnings("ignore:First-class function type feature is experimental")
LAYERS, EXPERTS = 3, 3
FORMS = {"lfu": (ev.lfu.LFU, 1, None), "fld": (ev.fld.FarthestLayerDistance, 1, None),
         "lhu": (ev.lhu.LeastHighPrecisionUsed, 2, None), "score": (ev.score.ScoreBased, 1, ev.score.ScoreParams(decay=0.5)),
         "score-no-decay": (ev.score.ScoreBased, 2, ev.score.ScoreParams())}


def weight(key: int, p: int) -> float:
    """The gate weight both sides are given for an access of ``key`` in pass ``p`` (the
    reference reads it where it reads the workload's, ``eviction.access_weight``): quarters
    from 0 to 1, so that scores tie too."""
    return ((key * 7 + p * 3) % 5) / 4


class Driver:
    """The compiled form's side: its state arrays, a tick, stamps and kept priorities."""

    def __init__(self, form: type, nprec: int, fns: tuple | None, params: object = None) -> None:
        self.form, self.fns = form, fns
        self.clock = np.zeros(CLOCK_SIZE, np.int64)
        self.clock[CLOCK_KEYS_PER_LAYER], self.clock[CLOCK_PRECISIONS], self.clock[CLOCK_LAYERS] = (
            EXPERTS * nprec, nprec, LAYERS)
        n = LAYERS * EXPERTS * nprec
        self.si = np.zeros((n, max(1, len(form.int_fields))), np.int64)
        self.sf = np.zeros((n, max(1, len(form.float_fields))))
        form.initial_state(params, self.si, self.sf)
        self.tick, self.stamp, self.kept = 0, {}, {}

    def call(self, i: int, name: str) -> object:
        return self.fns[i] if self.fns is not None else getattr(self.form, name)

    def _touched(self, key: int) -> None:
        self.tick += 1
        self.stamp[key] = self.tick
        if self.form.stable_priority:
            self.kept[key] = self.call(3, "priority")(key, self.clock, self.si, self.sf)

    def insert(self, key: int, demand: bool) -> None:
        w = weight(key, int(self.clock[CLOCK_PASS])) if demand else 0.0
        self.call(0, "insert")(key, demand, w, self.clock, self.si, self.sf)
        self._touched(key)

    def access(self, key: int) -> None:
        self.call(1, "access")(key, weight(key, int(self.clock[CLOCK_PASS])), self.clock, self.si, self.sf)
        self._touched(key)

    def remove(self, key: int) -> None:
        self.call(2, "remove")(key, self.clock, self.si, self.sf)
        del self.stamp[key]
        self.kept.pop(key, None)

    def order(self) -> list[int]:
        keys = np.array(sorted(self.stamp), np.int64)
        if self.form.stable_priority:
            prio = np.array([self.kept[k] for k in keys])
        else:
            prio = np.zeros(len(keys))
            self.call(4, "priorities")(keys, len(keys), prio, self.clock, self.si, self.sf)
            # the many-key loop the kernel calls agrees with the per-key priority
            one = [self.call(3, "priority")(int(k), self.clock, self.si, self.sf) for k in keys]
            assert list(prio) == one
        return [int(k) for _, _, k in sorted(zip(prio, (self.stamp[k] for k in keys), keys, strict=True))]


events = st.lists(st.tuples(st.sampled_from(["put", "use", "drop", "layer", "pass"]), st.integers(0, 10 ** 6),
                            st.booleans()), min_size=1, max_size=60)


def replay(name: str, evs: list, fns: tuple | None, monkeypatch: pytest.MonkeyPatch) -> None:
    cls, nprec, params = FORMS[name]
    ctx = PolicyContext(num_layers=LAYERS, num_experts=EXPERTS, top_k=2, expert_bytes=1,
                        rng=np.random.default_rng(0), precisions=("bf16", "int4")[:nprec],
                        precision_bytes=(2, 1)[:nprec])
    monkeypatch.setattr(ev.score, "access_weight", lambda c, keys, key: weight(key, c.clock.pass_index))
    ref, form = cls(params, ctx), Driver(cls.compiled, nprec, fns, params)
    n = LAYERS * EXPERTS * nprec
    cached: list[int] = []
    for what, x, flag in evs:
        if what == "layer":
            ctx.clock.layer = x % LAYERS
            form.clock[CLOCK_LAYER] = ctx.clock.layer
        elif what == "pass":  # forward, by one to three passes
            ctx.clock.pass_index += 1 + x % 3
            form.clock[CLOCK_PASS] = ctx.clock.pass_index
        elif what == "put":
            free = [k for k in range(n) if k not in cached]
            if free:
                key = free[x % len(free)]
                cached.append(key)
                ref.on_insert(key, flag)
                form.insert(key, flag)
        elif cached:
            key = cached[x % len(cached)]
            if what == "use":
                ref.on_access(key)
                form.access(key)
            else:
                cached.remove(key)
                ref.on_remove(key)
                form.remove(key)
        assert list(ref.candidates()) == form.order(), (what, x, flag)


@pytest.mark.parametrize("name", list(FORMS))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(evs=events)
def test_the_compiled_form_as_python_orders_as_the_reference(name, evs, monkeypatch):
    replay(name, evs, None, monkeypatch)


@pytest.mark.parametrize("name", list(FORMS))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(evs=events)
def test_the_compiled_form_compiled_orders_as_the_reference(name, evs, monkeypatch):
    fns = compiled(FORMS[name][0].compiled)
    assert isinstance(fns, tuple), fns
    replay(name, evs, fns, monkeypatch)


def test_lfu_by_hand():
    """Counts survive eviction: key 0 used twice, evicted, re-fetched on demand, has 3; key 1
    prefetched (no use) has 0 and goes first; key 2 fetched on demand has 1."""
    f = Driver(ev.lfu.LFUCompiled, 1, None)
    f.insert(0, True)
    f.access(0)
    f.remove(0)
    f.insert(0, True)
    f.insert(1, False)
    f.insert(2, True)
    assert f.si[:3, 0].tolist() == [3, 0, 1]
    assert f.order() == [1, 2, 0]


def test_lhu_by_hand():
    """Two precisions: odd keys are int4 copies (priority 0, first, oldest first); bf16 keys by
    their bf16 uses plus one."""
    f = Driver(ev.lhu.LHUCompiled, 2, None)
    for key, demand in ((0, True), (1, True), (2, True), (3, False)):
        f.insert(key, demand)
    f.access(0)
    f.access(1)
    assert f.si[:4, 0].tolist() == [2, 0, 1, 0]
    assert f.order() == [3, 1, 2, 0]  # 1 was used after 3 was prefetched


def test_score_by_hand():
    """decay 0.5, the weights of ``weight``. Pass 0: key 0 fetched on demand (weight 0), key 1
    on demand (0.5), key 2 prefetched (no credit). Pass 2: its first credit halves every score
    twice (key 1: 0.5 -> 0.125) and marks every row decayed at pass 2; key 2 gains 0, key 0
    0.25. Lowest score first: 2 (0), 1 (0.125), 0 (0.25)."""
    f = Driver(ev.score.ScoreCompiled, 1, None, ev.score.ScoreParams(decay=0.5))
    assert f.si[:, 0].tolist() == [-1] * 9
    assert f.sf[:, 1].tolist() == [0.5] * 9
    f.insert(0, True)   # weight(0, 0) = 0
    f.insert(1, True)   # weight(1, 0) = 7 % 5 / 4 = 0.5
    f.insert(2, False)
    assert f.sf[:3, 0].tolist() == [0.0, 0.5, 0.0]
    f.clock[CLOCK_PASS] = 2
    f.access(2)         # decays by 0.5 ** 2 first: 0.5 -> 0.125; weight(2, 2) = 20 % 5 / 4 = 0
    assert f.si[:, 0].tolist() == [2] * 9
    f.access(0)         # weight(0, 2) = 6 % 5 / 4 = 0.25; no second decay in pass 2
    assert f.sf[:3, 0].tolist() == [0.25, 0.125, 0.0]
    assert f.order() == [2, 1, 0]


def test_a_subclass_of_a_built_in_elsewhere_does_not_run_its_compiled_form():
    """A user's LFU variant (its own ``candidates``) inherits ``compiled`` but is not the
    built-in: the kernel has no form for it, and the replay says so."""
    from moesim.policies.eviction.forms import form_of
    from moesim.policies.hooks import PriorityHooks

    class MyLFU(ev.lfu.LFU):
        def candidates(self):
            return reversed(list(super().candidates()))

    assert form_of(MyLFU) is None
    assert all(form_of(c) is PriorityHooks for c in (ev.lfu.LFU, ev.fld.FarthestLayerDistance, ev.score.ScoreBased,
                                                     ev.lhu.LeastHighPrecisionUsed))


# -- the forms of their own (lru, fifo, least-stale, sieve, s3-fifo, arc), driven through the kernel --
# the kernel's functions are called as the replay calls them (kernel_cache's dispatch to the form);
# the reference form gets the same events as the SimPy cache gives it
OWN_FORMS = {"lru": None, "fifo": None, "least-stale": ev.least_stale.LeastStaleParams(),
             "least-stale-absolute": ev.least_stale.LeastStaleParams(order="absolute"), "sieve": None,
             "s3-fifo": None, "arc": None}
PURE = {"lru", "fifo", "least-stale", "least-stale-absolute"}  # walks that change nothing: whole orders compared
CAPACITY = 4
# (experts per layer, capacity): S3-FIFO's small queue holds a tenth of the capacity (whole experts)
SHAPES = {"s3-fifo": (10, 24)}


class KernelDriver:
    """A form as the kernel runs it (:func:`tests.helpers.kernel_by_hand`), ``LAYERS`` layers of
    ``EXPERTS`` keys, instant copies of one byte into a cache of ``CAPACITY`` bytes."""

    def __init__(self, name: str, params: object, experts: int = EXPERTS, capacity: int = CAPACITY) -> None:
        KE = Callable(import_module("moesim.simulator.kernel_cache"))
        KC = Callable(import_module("moesim.simulator.kernel_copy"))
        KS = Callable(import_module("moesim.kernel_state"))

        self.KE, self.KC, self.KS = KE, KC, KS
        self.IS, self.FS, self.K, self.T, self.DI, self.A = kernel_by_hand(
            name.removesuffix("-absolute"), LAYERS * experts, layers=LAYERS, params=params, pool=64,
            capacity=float(capacity))
        self.pin_gen = 1

    def at(self, p: int, layer: int, pending: set[int]) -> None:
        IS, KS = self.IS, self.KS
        if p != IS[KS.S_PASS]:
            IS[KS.S_PASS] = p
            self.KE._new_pass(IS, self.K, self.A)
        IS[KS.S_LAYER] = layer
        IS[KS.S_PENDGEN] += 1
        for k in pending:
            self.K[k].pend = IS[KS.S_PENDGEN]

    def pin(self, keys: set[int]) -> None:
        self.pin_gen += 1
        for k in keys:
            self.K[k].pin = self.pin_gen

    def fetch(self, key: int, demand: bool) -> int:
        """A miss of ``key`` (demand) or a prefetch's admission: the victim evicted (-1: none
        needed), the entry inserted; -2 when no room could be made."""
        KE, IS, K = self.KE, self.IS, self.K
        if demand:
            KE._on_miss(key, IS, K, self.A)
        victim = -1
        if IS[self.KS.S_USED] + 1 > self.FS[self.KS.CF_CAP]:
            victim = KE._find_victim(not demand, self.pin_gen, -1, 0, IS, K, self.A)
            if victim == -1:
                return -2
            KE._evict(victim, IS, K, self.A)
        tid = self.KC._submit(key, self.KS.DEMAND if demand else self.KS.PREFETCH, 0.0, 0, IS, self.T, self.FS)
        KE._insert(key, tid, demand, -1, IS, K, self.T, self.DI, self.A)
        return victim

    def use(self, key: int) -> None:
        self.KE._on_access(key, -1, self.IS, self.K, self.DI, self.A)

    def select(self, key: int) -> None:
        self.KE._on_select(key, self.IS, self.K, self.A)

    def withdraw(self, key: int) -> None:
        self.K[key].state = self.KS.ABSENT
        self.IS[self.KS.S_USED] -= 1
        self.KE._on_remove(key, 0, self.IS, self.K, self.A)

    def order(self, for_prefetch: bool) -> list[int]:
        """Every victim in order: each found one pinned, the walk continued (``again``)."""
        saved = {int(k): int(self.K[k].pin) for k in range(len(self.K))}
        out: list[int] = []
        v = self.KE._find_victim(for_prefetch, self.pin_gen, -1, 0, self.IS, self.K, self.A)
        while v != -1:
            out.append(int(v))
            self.K[v].pin = self.pin_gen
            v = self.KE._find_victim(for_prefetch, self.pin_gen, -1, 1, self.IS, self.K, self.A)
        for k, g in saved.items():
            self.K[k].pin = g
        return out


kernel_events = st.lists(st.tuples(st.sampled_from(["put", "pref", "use", "select", "drop", "layer", "pass"]),
                                   st.integers(0, 10 ** 6), st.integers(0, 2 ** 30)), min_size=1, max_size=120)


def drive_both(name: str, params: object, evs: list) -> None:
    """The reference form and the compiled form, given the same events; after each, the same
    victim (and for a walk that changes nothing, the same whole order)."""
    cls = EVICTION.get(name.removesuffix("-absolute"))
    experts, capacity = SHAPES.get(name, (EXPERTS, CAPACITY))
    ctx = PolicyContext(num_layers=LAYERS, num_experts=experts, top_k=2, expert_bytes=1,
                        rng=np.random.default_rng(0), capacity_bytes=float(capacity), precision_bytes=(1,))
    ref = cls(params if params is not None else cls.Params(), ctx)
    form = KernelDriver(name, params, experts, capacity)
    cached: list[int] = []
    pinned: set[int] = set()
    for what, x, bits in evs:
        if what == "layer":
            ctx.clock.layer = x % LAYERS
            mine = [k for k in cached if k // experts == ctx.clock.layer]
            ctx.clock.pending = {k for i, k in enumerate(mine) if (x >> (i + 2)) & 1}
            form.at(ctx.clock.pass_index, ctx.clock.layer, ctx.clock.pending)
        elif what == "pass":  # forward, by one to three passes
            ctx.clock.pass_index += 1 + x % 3
            ctx.clock.pending = set()
            form.at(ctx.clock.pass_index, ctx.clock.layer, set())
        elif what in ("put", "pref"):
            free = [k for k in range(LAYERS * experts) if k not in cached]
            if not free:
                continue
            key = free[x % len(free)]
            pinned = {k for i, k in enumerate(cached) if (bits >> i) & 1 and (bits >> 28) & 1}  # some of the time
            form.pin(pinned)
            demand = what == "put"
            if demand:
                ref.on_miss(key)
            want = -1
            if len(cached) + 1 > capacity:
                walk = ref.candidates() if demand else ref.prefetch_candidates()
                want = next((v for v in walk if v not in pinned), -2)
            got = form.fetch(key, demand)
            assert got == want, (what, x, bits)
            if want == -2:
                continue
            if want >= 0:
                cached.remove(want)
                ref.on_remove(want)
            cached.append(key)
            ref.on_insert(key, demand)
        elif cached:
            key = cached[x % len(cached)]
            if what == "use":
                ref.on_access(key)
                form.use(key)
            elif what == "select":
                ref.on_prefetch_select(key)
                form.select(key)
            else:
                cached.remove(key)
                ref.on_withdraw(key)
                form.withdraw(key)
        if name in PURE:
            form.pin(set())
            before = [a.copy() for a in form.A.form]
            assert list(ref.candidates()) == form.order(False), (what, x, bits)
            assert list(ref.prefetch_candidates()) == form.order(True), (what, x, bits)
            # what lets the cache skip the walk when no key is resident (``pure_victim``)
            assert all(np.array_equal(a, b) for a, b in zip(before, form.A.form, strict=True)), (what, x, bits)


@pytest.mark.parametrize("name", list(OWN_FORMS))
@settings(max_examples=80, deadline=None)
@given(evs=kernel_events)
def test_the_forms_of_their_own_choose_the_reference_victims(name, evs):
    """After any sequence of misses, prefetch admissions (any cached keys pinned), uses,
    prefetch selections, withdrawals, layer changes (with any of the layer's cached experts
    still to run) and passes, the compiled form chooses the victim its reference form's
    ``candidates()`` (``prefetch_candidates()``) gives first among the keys the cache may evict;
    a form whose walk changes nothing walks the reference's whole order, and its state is as it
    was after every walk."""
    drive_both(name, OWN_FORMS[name], evs)


def test_the_forms_that_declare_a_walk_that_changes_nothing_are_those_whose_walk_is_read_only():
    """``pure_victim`` (the cache skips such a form's walk when no key is resident) is declared
    by exactly the forms whose walks this file checks for changes (``PURE``); SIEVE's hand and
    S3-FIFO's and ARC's queues move as they walk."""
    from moesim.policies.eviction.forms import form_of

    declared = {n for n in OWN_FORMS if form_of(EVICTION.get(n.removesuffix("-absolute"))).pure_victim}
    assert declared == PURE


def _ls() -> KernelDriver:
    return KernelDriver("least-stale", ev.least_stale.LeastStaleParams())


def _ls_walk(f: KernelDriver, for_prefetch: bool) -> list[int]:
    f.pin(set())
    return f.order(for_prefetch)


def test_least_stale_lists_by_hand():
    """Two layers of the least-stale form, relative order, at layer 1 of pass 1: key 0 (layer
    0) touched in pass 0 is stale; key 3 (layer 1) inserted in pass 1 and still to run, key 4
    (layer 1) inserted in pass 1 and run, key 1 (layer 0) selected in pass 1: current. Demand
    order: stale layer 0 (0), then current: layer 0 (1), layer 1 run (4), layer 1 pending (3).
    A prefetch does not take layer 1's pending expert; a pass later all four are stale, and
    key 1, which joined layer 0's stale list behind key 0, leaves it with key 0 its tail."""
    f = _ls()
    f.fetch(0, True)
    f.fetch(1, True)
    f.at(1, 0, set())
    f.fetch(3, True)
    f.fetch(4, True)
    f.select(1)
    f.at(1, 1, {3})
    assert _ls_walk(f, False) == [0, 1, 4, 3]
    assert _ls_walk(f, True) == [0, 1, 4]
    f.at(2, 1, {3})
    assert _ls_walk(f, False) == [0, 1, 4, 3]
    f.use(4)
    assert _ls_walk(f, False) == [0, 1, 3, 4]
    f.withdraw(1)  # joined the stale list behind 0 at the pass: its neighbour is 0
    assert _ls_walk(f, False) == [0, 3, 4]
    S = f.A.form
    assert S[0][0, 1] == -1  # 0 has no next
    assert S[2][1 + 1] == 0  # layer 0's stale list ends at 0


@settings(max_examples=200, deadline=None)
@given(pos=st.lists(st.integers(0, 40), max_size=12).map(sorted), lo=st.integers(0, 3), cut=st.integers(0, 3),
       i=st.integers(-2, 45), base=st.integers(0, 1000), after=st.integers(-1, 2000))
def test_belady_next_use_is_the_first_access_after_i(pos, lo, cut, i, base, after):
    """Belady's ``next_use`` (compiled) against numpy's searchsorted: of a key's sorted
    accesses ``pos[lo:hi]`` in the piece, the first after ``i``, counted over the trace
    (``base`` on); past them its first after the piece, or inf."""
    arr = np.array([-5] * lo + pos + [99] * cut, np.int64)  # its own accesses lie between others'
    mine = arr[lo:lo + len(pos)]
    j = int(np.searchsorted(mine, i, side="right"))
    want = float(base + mine[j]) if j < len(mine) else (float(after) if after >= 0 else np.inf)
    assert entry(ev.belady.next_use)(arr, lo, lo + len(pos), i, base, after) == want


def test_least_stale_walk_table_by_hand():
    """Three layers, relative order, the current layer 1: stale queue (lists 0-5), current
    queue (lists 6-11), a layer's list at 2 x layer. Demand: layer 0, layer 1 run, layer 2,
    layer 1 to run, in each queue; a prefetch: the stale queue without layer 1's experts still
    to run, then the current queue's layer 0 and layer 1's run experts. Absolute: layers 0, 1, 2
    per queue."""
    walk_table, lists = ev.least_stale.walk_table, ev.least_stale.LeastStaleLists
    t = walk_table(lists, 3, 1)
    assert t.shape == (3, 2, 1 + 2 * 8)
    A, R, P = ev.ANY, ev.NOT_PENDING, ev.PENDING
    assert t[1, 0].tolist() == [8, 0, A, 2, R, 4, A, 2, P, 6, A, 8, R, 10, A, 8, P]
    assert t[1, 1, :1 + 2 * 5].tolist() == [5, 0, A, 2, R, 4, A, 6, A, 8, R]
    assert t[1, 1, 11:].tolist() == [0] * 6
    assert walk_table(lists, 3, 0)[1, 0, :13].tolist() == [6, 0, A, 2, A, 4, A, 6, A, 8, A, 10, A]


def test_a_new_pass_appends_each_current_list_behind_its_stale_tail():
    """Least-stale's roll: layer 0's stale list [0, 1] and current list [2] become [0, 1, 2],
    with 2 behind the stale tail 1 (not the head, not another list's end): removing 2 leaves
    [0, 1] with 1 the tail, and removing 1 then leaves [0]."""
    f = _ls()
    f.fetch(0, True)
    f.fetch(1, True)
    f.at(1, 0, set())
    f.fetch(2, True)
    f.at(2, 0, set())
    assert _ls_walk(f, False) == [0, 1, 2]
    S = f.A.form
    assert (S[0][2, 0], S[0][1, 1]) == (1, 2)
    f.withdraw(2)
    assert _ls_walk(f, False) == [0, 1]
    assert S[2][1 + 1] == 1
    f.withdraw(1)
    assert _ls_walk(f, False) == [0]
    assert S[2][1 + 1] == 0


# -- the kernel's dispatch to the replay's form within its group --
HOOK_NAMES = ("insert", "access", "remove", "select", "new_pass", "miss", "victim")


def dispatch_calls() -> list[list[object]]:
    """Under ``NUMBA_DISABLE_JIT=1`` (the dispatch's loops as plain Python): each group's forms
    replaced by hooks that record their own (group, index, hook), each form of each group
    picked in turn (``IS[C_FORM]``, the group's mark in ``A.hooks``) and told of every event
    once, a statically pinned key's use and selection with ``keeps_static`` off, then on.
    Returns each form's calls and victim."""
    import moesim.kernel_state as KS
    from moesim.policies.eviction import forms as F
    from moesim.policies.eviction.base import FORM_GROUP
    from moesim.simulator import kernel_cache as KE

    calls: list[tuple[int, int, str]] = []

    def recording(g: int, j: int) -> tuple[object, ...]:
        def hook(name: str) -> object:
            def call(*args: object) -> object:
                calls.append((g, j, name))
                return 100 * g + j if name == "victim" else None
            return call
        return tuple(hook(n) for n in HOOK_NAMES)

    KE.INLINE_FORMS = tuple(tuple(recording(g, j) for j in range(n)) for g, n in enumerate(F.INLINED))
    KE.CALLED_FORMS = tuple(tuple(recording(g, j) for j in range(n, len(grp)))
                            for g, (n, grp) in enumerate(zip(F.INLINED, F.GROUPS, strict=True)))
    IS, _, K, _, DI, A = kernel_by_hand("lru", 4)
    out: list[list[object]] = []
    for g, grp in enumerate(F.GROUPS):
        hooks = list(A.hooks)
        hooks[FORM_GROUP] = F.MARKS[g]
        Ag = A._replace(hooks=tuple(hooks))
        for f in range(len(grp)):
            IS[KS.C_FORM] = f
            calls.clear()
            K[1].static = 0
            KE._on_insert(1, 1, 0, IS, K, DI, Ag)
            KE._on_access(1, 0, IS, K, DI, Ag)
            KE._on_remove(1, 1, IS, K, Ag)
            KE._on_select(1, IS, K, Ag)
            KE._new_pass(IS, K, Ag)
            KE._on_miss(1, IS, K, Ag)
            victim = KE._find_victim(False, 1, -1, 0, IS, K, Ag)
            K[1].static = 1
            for keep in (0, 1):
                IS[KS.C_KEEPSTATIC] = keep
                KE._on_access(1, 0, IS, K, DI, Ag)
                KE._on_select(1, IS, K, Ag)
            out.append([g, f, [list(c) for c in calls], int(victim)])
    return out


def test_the_kernel_tells_the_replays_form_alone_of_each_event():
    """Whichever group and form (an inlined one or a called one), every event reaches that form's
    hook once and no other form's, and the victim is that form's; a statically pinned key's use
    and selection reach it only when it keeps the static keys (``keeps_static``). Checked with
    recording hooks in place of the forms, as plain Python."""
    import json
    import os
    import subprocess
    import sys

    from moesim.policies.eviction import forms as F

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = "import json; from tests.test_compiled_forms import dispatch_calls; print(json.dumps(dispatch_calls()))"
    env = {**os.environ, "NUMBA_DISABLE_JIT": "1"}
    got = json.loads(subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True,
                                    text=True, check=True).stdout)
    want = [[g, f, [[g, f, n] for n in (*HOOK_NAMES, "access", "select")], 100 * g + f]
            for g, grp in enumerate(F.GROUPS) for f in range(len(grp))]
    assert got == want
    assert all(0 < n < len(grp) for n, grp in zip(F.INLINED, F.GROUPS, strict=True))  # both kinds in each group

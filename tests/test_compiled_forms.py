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

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moesim.policies import eviction as ev
from moesim.policies.eviction import (
    CLOCK_KEYS_PER_LAYER,
    CLOCK_LAYER,
    CLOCK_LAYERS,
    CLOCK_PASS,
    CLOCK_PRECISIONS,
    CLOCK_SIZE,
)
from moesim.policies.hooks import compiled
from moesim.policies.registry import PolicyContext

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
    from moesim.simulator.kernel import _policy_codes, eviction_code

    class MyLFU(ev.lfu.LFU):
        def candidates(self):
            return reversed(list(super().candidates()))

    assert eviction_code(MyLFU) is None
    assert MyLFU not in _policy_codes()[0]
    assert all(eviction_code(c) is not None for c in (ev.lfu.LFU, ev.fld.FarthestLayerDistance, ev.score.ScoreBased,
                                                     ev.lhu.LeastHighPrecisionUsed))



# -- the list forms (lru, fifo, least-stale): RecencyList, InsertionList, LeastStaleLists ---------
LIST_FORMS = {"lru": (ev.lru.LRU, None), "fifo": (ev.fifo.FIFO, None),
              "least-stale": (ev.least_stale.LeastStale, ev.least_stale.LeastStaleParams()),
              "least-stale-absolute": (ev.least_stale.LeastStale, ev.least_stale.LeastStaleParams(order="absolute"))}
# the key records' fields a list form reads and writes (the kernel's records have these and more)
RECORD = np.dtype([(name, np.int64) for name in ("prev", "next", "curpass", "layer", "pend")])


class ListDriver:
    """A list form's side, written from the contract (the comment above
    ``eviction.RecencyList``): key records, the lists' heads and tails at ``BASE`` on in ``L``,
    the pending mark, and the victim walk over ``segment``'s lists."""

    BASE = 3  # the heads and tails need not start at 0

    def __init__(self, form: type, opt: int) -> None:
        self.form, self.opt = form, opt
        n = LAYERS * EXPERTS
        self.K = np.zeros(n, RECORD).view(np.recarray)
        self.K["prev"] = self.K["next"] = self.K["curpass"] = -1
        self.K["layer"] = np.arange(n) // EXPERTS
        self.L = np.full(self.BASE + 4 * LAYERS + 2, -1, np.int64)
        self.p, self.layer, self.gen = 0, 0, 1

    def call(self, name: str, key: int) -> None:
        getattr(self.form, name)(key, self.p, self.L, self.BASE, LAYERS, self.K)

    def new_pass(self, p: int) -> None:
        self.p = p
        self.form.new_pass(p, self.L, self.BASE, LAYERS, self.K)

    def pending(self, keys: set[int]) -> None:
        self.gen += 1
        for k in keys:
            self.K[k].pend = self.gen

    def walk(self, for_prefetch: bool) -> list[int]:
        """The lists in ``segment``'s order (compiled), and the same order read from
        ``walk_table``'s row for the layer, as the kernel reads it."""
        order = []
        for q in range(self.form.QUEUES):
            for step in range(self.form.steps(LAYERS, self.opt)):
                h, which = self.form.segment(q, step, for_prefetch, self.layer, LAYERS, self.opt)
                if which != ev.SKIP:
                    order.append((h, which))
        row = ev.walk_table(self.form, LAYERS, self.opt)[self.layer, int(for_prefetch)]
        assert [tuple(x) for x in row[1:1 + 2 * row[0]].reshape(-1, 2)] == order
        out = []
        for h, which in order:
            key = self.L[self.BASE + h]
            while key != -1:
                if which == ev.ANY or (self.K[key].pend == self.gen) == (which == ev.PENDING):
                    out.append(int(key))
                key = self.K[key].next
        return out


list_events = st.lists(st.tuples(st.sampled_from(["put", "use", "select", "drop", "layer", "pass"]),
                                 st.integers(0, 10 ** 6), st.booleans()), min_size=1, max_size=60)


@pytest.mark.parametrize("name", list(LIST_FORMS))
@settings(max_examples=80, deadline=None)
@given(evs=list_events)
def test_the_list_forms_walk_the_reference_order(name, evs):
    """After any sequence of inserts, uses, prefetch selections, removals, layer changes (with
    any of the layer's cached experts still to run) and passes, the compiled form's lists walked
    in its order give the reference policy's ``candidates()``, and for a prefetch its
    ``prefetch_candidates()``."""
    cls, params = LIST_FORMS[name]
    ctx = PolicyContext(num_layers=LAYERS, num_experts=EXPERTS, top_k=2, expert_bytes=1,
                        rng=np.random.default_rng(0))
    ref = cls(params, ctx)
    form = ListDriver(cls.lists, int(params is not None and params.order == "relative"))
    cached: list[int] = []
    for what, x, flag in evs:
        if what == "layer":
            ctx.clock.layer = form.layer = x % LAYERS
            mine = [k for k in cached if k // EXPERTS == form.layer]
            ctx.clock.pending = {k for i, k in enumerate(mine) if (x >> (i + 2)) & 1}
            form.pending(ctx.clock.pending)
        elif what == "pass":  # forward, by one to three passes (the kernel rolls once a pass)
            ctx.clock.pass_index += 1 + x % 3
            ctx.clock.pending = set()
            form.pending(set())
            form.new_pass(ctx.clock.pass_index)
        elif what == "put":
            free = [k for k in range(LAYERS * EXPERTS) if k not in cached]
            if free:
                key = free[x % len(free)]
                cached.append(key)
                ref.on_insert(key, flag)
                form.call("insert", key)
        elif cached:
            key = cached[x % len(cached)]
            if what == "use":
                ref.on_access(key)
                form.call("access", key)
            elif what == "select":
                ref.on_prefetch_select(key)
                form.call("select", key)
            else:
                cached.remove(key)
                ref.on_remove(key)
                form.call("remove", key)
        assert list(ref.candidates()) == form.walk(False), (what, x, flag)
        assert list(ref.prefetch_candidates()) == form.walk(True), (what, x, flag)


def test_least_stale_lists_by_hand():
    """Two layers of the least-stale form, relative order, at layer 1 of pass 1: key 0 (layer
    0) touched in pass 0 is stale; key 3 (layer 1) inserted in pass 1 and still to run, key 4
    (layer 1) inserted in pass 1 and run, key 1 (layer 0) selected in pass 1: current. Demand
    order: stale layer 0 (0), then current: layer 0 (1), layer 1 run (4), layer 1 pending (3).
    A prefetch does not take layer 1's pending expert; a pass later all four are stale, and
    key 1, which joined layer 0's stale list behind key 0, leaves it with key 0 its tail."""
    f = ListDriver(ev.least_stale.LeastStaleLists, 1)
    f.call("insert", 0)
    f.call("insert", 1)
    f.new_pass(1)
    f.call("insert", 3)
    f.call("insert", 4)
    f.call("select", 1)
    f.layer = 1
    f.pending({3})
    assert f.walk(False) == [0, 1, 4, 3]
    assert f.walk(True) == [0, 1, 4]
    f.new_pass(2)
    assert f.walk(False) == [0, 1, 4, 3]
    f.call("access", 4)
    assert f.walk(False) == [0, 1, 3, 4]
    f.call("remove", 1)  # joined the stale list behind 0 at the pass: its neighbour is 0
    assert f.walk(False) == [0, 3, 4]
    assert f.K[0].next == -1
    assert f.L[f.BASE + 1] == 0


@settings(max_examples=200, deadline=None)
@given(pos=st.lists(st.integers(0, 40), max_size=12).map(sorted), lo=st.integers(0, 3), cut=st.integers(0, 3),
       i=st.integers(-2, 45), base=st.integers(0, 1000), after=st.integers(-1, 2000))
def test_belady_next_use_is_the_first_access_after_i(pos, lo, cut, i, base, after):
    """``FutureUses.next_use`` (compiled) against numpy's searchsorted: of a key's sorted
    accesses ``pos[lo:hi]`` in the piece, the first after ``i``, counted over the trace
    (``base`` on); past them its first after the piece, or inf."""
    arr = np.array([-5] * lo + pos + [99] * cut, np.int64)  # its own accesses lie between others'
    mine = arr[lo:lo + len(pos)]
    j = int(np.searchsorted(mine, i, side="right"))
    want = float(base + mine[j]) if j < len(mine) else (float(after) if after >= 0 else np.inf)
    assert ev.belady.FutureUses.next_use(arr, lo, lo + len(pos), i, base, after) == want
    assert ev.belady.FutureUses.priority(want) == -want


def test_least_stale_walk_table_by_hand():
    """Three layers, relative order, the current layer 1: stale queue (lists 0-5), current
    queue (lists 6-11), a layer's list at 2 x layer. Demand: layer 0, layer 1 run, layer 2,
    layer 1 to run, in each queue; a prefetch: the stale queue without layer 1's experts still
    to run, then the current queue's layer 0 and layer 1's run experts. Absolute: layers 0, 1, 2
    per queue."""
    t = ev.walk_table(ev.least_stale.LeastStaleLists, 3, 1)
    assert t.shape == (3, 2, 1 + 2 * 8)
    A, R, P = ev.ANY, ev.NOT_PENDING, ev.PENDING
    assert t[1, 0].tolist() == [8, 0, A, 2, R, 4, A, 2, P, 6, A, 8, R, 10, A, 8, P]
    assert t[1, 1, :1 + 2 * 5].tolist() == [5, 0, A, 2, R, 4, A, 6, A, 8, R]
    assert t[1, 1, 11:].tolist() == [0] * 6
    assert ev.walk_table(ev.least_stale.LeastStaleLists, 3, 0)[1, 0, :13].tolist() == [6, 0, A, 2, A, 4, A, 6, A, 8, A, 10, A]
    assert ev.walk_table(ev.lru.RecencyList, 3, 0)[2].tolist() == [[1, 0, A], [1, 0, A]]


def test_a_new_pass_appends_each_current_list_behind_its_stale_tail():
    """Least-stale's roll: layer 0's stale list [0, 1] and current list [2] become [0, 1, 2],
    with 2 behind the stale tail 1 (not the head, not another list's end): removing 2 leaves
    [0, 1] with 1 the tail, and removing 1 then leaves [0]."""
    f = ListDriver(ev.least_stale.LeastStaleLists, 1)
    f.call("insert", 0)
    f.call("insert", 1)
    f.new_pass(1)
    f.call("insert", 2)
    f.new_pass(2)
    assert f.walk(False) == [0, 1, 2]
    assert (f.K[2].prev, f.K[1].next) == (1, 2)
    f.call("remove", 2)
    assert f.walk(False) == [0, 1]
    assert f.L[f.BASE + 1] == 1
    f.call("remove", 1)
    assert f.walk(False) == [0]
    assert f.L[f.BASE + 1] == 0

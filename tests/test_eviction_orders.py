"""Each eviction policy's exact candidate order after a hand-written sequence of cache events
(issue 12): the expected order is worked out in each test from the policy's paper definition.

The policies are driven directly (insert / access / remove at a given pass and layer, as the
cache and the engine call them). Cache keys are written out: the tiny model has four
precisions (bf16, int8, int4, int2), so the key of (layer, expert) at precision q is
(layer * experts + expert) * 4 + q.
"""

from __future__ import annotations

import numpy as np
import pytest

from moesim.policies.eviction.belady import Belady
from moesim.policies.eviction.least_stale import LeastStaleParams
from moesim.policies.registry import PolicyContext
from moesim.simulator.engine import Simulation
from moesim.traces.trace import Trace
from tests.helpers import scenario, small_model, trace_from_array


def key(layer: int, expert: int, q: int = 0, experts: int = 4) -> int:
    return (layer * experts + expert) * 4 + q


def policy_for(trace: Trace, spec):
    """The eviction policy a scenario builds, and the clock it reads."""
    sim = Simulation(scenario(policies={"eviction": spec}, cache={"capacity": "inf"}), trace=trace)
    return sim.eviction, sim.clock


def at(clock, p: int, layer: int = 0) -> None:
    clock.pass_index, clock.layer = p, layer


def one_layer_trace(passes: int = 6):
    model = small_model(layers=1, experts=4, top_k=1)
    return trace_from_array(model, np.zeros((1, passes, 1, 1), dtype=np.int64))


def test_lfu_counts_uses_not_prefetches_and_remembers_counts_after_eviction():
    """a: demand insert (count 1), used twice more (3). b: prefetched, never used (0).
    c: demand insert (1). LFU order (count, then the time the count was reached):
    b (0), c (1), a (3). Then b is used once (1, reached after c's): b follows c.
    a is evicted and re-prefetched: it comes back with its remembered count 3, not 0.
    Then d is demand-inserted (1, reached last among the 1s)."""
    p, _ = policy_for(one_layer_trace(), "lfu")
    a, b, c, d = key(0, 0), key(0, 1), key(0, 2), key(0, 3)
    p.on_insert(a, True)
    p.on_access(a)
    p.on_access(a)
    p.on_insert(c, True)
    p.on_insert(b, False)
    assert list(p.candidates()) == [b, c, a]  # b (0) before c (1) though inserted after it
    p.on_access(b)
    assert list(p.candidates()) == [c, b, a]
    p.on_remove(a)
    assert list(p.candidates()) == [c, b]
    p.on_insert(a, False)
    p.on_insert(d, True)
    assert list(p.candidates()) == [c, b, d, a]


def test_lfu_orders_by_count_not_by_recency():
    """a is used 3 times, then b once: LRU would evict a first; LFU evicts b (1 < 3)."""
    p, _ = policy_for(one_layer_trace(), "lfu")
    a, b = key(0, 0), key(0, 1)
    p.on_insert(a, True)
    p.on_access(a)
    p.on_access(a)
    p.on_insert(b, True)
    assert list(p.candidates()) == [b, a]


def test_lhu_evicts_low_precision_first_then_fewest_high_precision_uses():
    """HOBBIT's LHU. bf16 a: demand insert + 2 uses (3 high-precision uses); int8 b: demand
    insert; bf16 c: demand insert (1 use); int4 d: demand insert; bf16 e: prefetched, never
    used (0 uses). Low precision first, least recent first: b, d; then bf16 by uses: e (0),
    c (1), a (3). Then c is used 3 times (4 uses, more than a's 3; most recent): ..., a, c.
    Uses of a low-precision copy do not count as high-precision uses: b used 5 times stays
    first."""
    p, _ = policy_for(one_layer_trace(), "lhu")
    a, b, c, d, e = key(0, 0), key(0, 1, q=1), key(0, 2), key(0, 3, q=2), key(0, 1)
    p.on_insert(a, True)
    p.on_access(a)
    p.on_access(a)
    p.on_insert(b, True)
    p.on_insert(c, True)
    p.on_insert(d, True)
    p.on_insert(e, False)
    assert list(p.candidates()) == [b, d, e, c, a]
    for _ in range(3):
        p.on_access(c)
    for _ in range(5):
        p.on_access(b)
    assert list(p.candidates()) == [d, b, e, a, c]


def score_trace():
    """1 layer, 4 experts, top-2, one request decoding 4 tokens with these router weights:
    pass 0: experts (0, 1) weights (0.7, 0.3); pass 1: (1, 2) (0.6, 0.4);
    pass 2: (0, 2) (0.9, 0.1); pass 3: (3, 1) (0.8, 0.2)."""
    model = small_model(layers=1, experts=4, top_k=2)
    t = trace_from_array(model, np.array([[[[0, 1]], [[1, 2]], [[0, 2]], [[3, 1]]]]))
    t.weights = np.array([[0.7, 0.3], [0.6, 0.4], [0.9, 0.1], [0.8, 0.2]], dtype=np.float32)
    return t


def test_score_sums_the_router_weights_of_each_use():
    """decay 1: pass 0 inserts 0 (0.7) and 1 (0.3); pass 1 uses 1 (0.3 + 0.6 = 0.9) and
    inserts 2 (0.4); pass 2 uses 0 (0.7 + 0.9 = 1.6) and 2 (0.4 + 0.1 = 0.5), and 3 is
    prefetched (no use: 0). Lowest score first: 3 (0), 2 (0.5), 1 (0.9), 0 (1.6). A prefetch
    insert credits nothing; scores are float32 weights summed in float64."""
    p, clock = policy_for(score_trace(), "score")
    w = np.float32
    at(clock, 0)
    p.on_insert(key(0, 0), True)
    p.on_insert(key(0, 1), True)
    at(clock, 1)
    p.on_access(key(0, 1))
    p.on_insert(key(0, 2), True)
    at(clock, 2)
    p.on_access(key(0, 0))
    p.on_access(key(0, 2))
    p.on_insert(key(0, 3), False)
    assert list(p.candidates()) == [key(0, 3), key(0, 2), key(0, 1), key(0, 0)]
    assert p._score == pytest.approx({key(0, 0): float(w(0.7)) + float(w(0.9)),
                                      key(0, 1): float(w(0.3)) + float(w(0.6)),
                                      key(0, 2): float(w(0.4)) + float(w(0.1))}, rel=1e-12)


def test_score_decay_multiplies_old_scores_once_per_pass_elapsed():
    """decay 0.5: pass 0 inserts 0 (0.7) and 1 (0.3). Pass 1: scores halve (0.35, 0.15), then
    1 is used (+0.6: 0.75) and 2 inserted (0.4). Pass 3 (pass 2 has no credit here: two
    passes elapse, factor 0.25): 0 = 0.0875, 1 = 0.1875 + 0.2 = 0.3875, 2 = 0.1; and 3 is
    inserted (0.8). Ties of score fall back to recency (an unscored prefetch first).
    Lowest first: 0, 2, 1, 3."""
    p, clock = policy_for(score_trace(), {"name": "score", "decay": 0.5})
    w = [float(np.float32(x)) for x in (0.7, 0.3, 0.6, 0.4, 0.8, 0.2)]
    at(clock, 0)
    p.on_insert(key(0, 0), True)
    p.on_insert(key(0, 1), True)
    at(clock, 1)
    p.on_access(key(0, 1))
    p.on_insert(key(0, 2), True)
    assert p._score == pytest.approx({key(0, 0): w[0] / 2, key(0, 1): w[1] / 2 + w[2], key(0, 2): w[3]},
                                     rel=1e-12)
    at(clock, 3)
    p.on_insert(key(0, 3), True)
    p.on_access(key(0, 1))
    assert p._score == pytest.approx({key(0, 0): w[0] / 8, key(0, 1): (w[1] / 2 + w[2]) / 4 + w[5],
                                      key(0, 2): w[3] / 4, key(0, 3): w[4]}, rel=1e-12)
    assert list(p.candidates()) == [key(0, 0), key(0, 2), key(0, 1), key(0, 3)]


def test_score_places_an_unscored_prefetch_before_every_used_expert():
    """A prefetched expert has score 0 until used: it goes before experts whose summed
    weights exceed 1 as well as below it (pass 0: 0 at 0.7; pass 2: 0 at 1.6, 2 prefetched)."""
    p, clock = policy_for(score_trace(), "score")
    at(clock, 0)
    p.on_insert(key(0, 0), True)
    at(clock, 2)
    p.on_access(key(0, 0))
    p.on_insert(key(0, 1), True)  # not routed at pass 2: no weight, score 0
    p.on_insert(key(0, 2), False)
    assert list(p.candidates()) == [key(0, 1), key(0, 2), key(0, 0)]


def belady_trace():
    """2 layers, 4 experts, top-1; passes route (layer 0, layer 1):
    p0 (0, 1), p1 (0, 2), p2 (3, 1), p3 (0, 2). Access positions (pass * 2 + layer):
    (0, 0) at 0, 2, 6; (1, 1) at 1, 5; (1, 2) at 3, 7; (0, 3) at 4."""
    model = small_model(layers=2, experts=4, top_k=1)
    return trace_from_array(model, np.array([[[[0], [1]], [[0], [2]], [[3], [1]], [[0], [2]]]]))


def test_belady_orders_by_next_use_and_counts_the_current_layer():
    """At pass 1 layer 1: (0, 0) was used at 2, next at 6; (1, 2) is used now (3), next at 7;
    (1, 1) next at 5; (0, 3) next at 4 (prefetched now, not used at this layer); (0, 2) never
    used: first. Farthest next use first: (0, 2), (1, 2), (0, 0), (1, 1), (0, 3)."""
    p, clock = policy_for(belady_trace(), "belady")
    at(clock, 0, 0)
    p.on_insert(key(0, 0), True)
    at(clock, 0, 1)
    p.on_insert(key(1, 1), True)
    at(clock, 1, 0)
    p.on_access(key(0, 0))
    p.on_insert(key(0, 2), False)  # never used by the trace
    at(clock, 1, 1)
    p.on_insert(key(1, 2), True)
    p.on_insert(key(0, 3), False)  # a prefetch for pass 2, layer 0
    assert list(p.candidates()) == [key(0, 2), key(1, 2), key(0, 0), key(1, 1), key(0, 3)]


def test_belady_prefetch_counts_the_next_use_after_this_layer():
    """At pass 1 layer 1, (0, 0) (used at pass 1 layer 0, position 2) is evicted and
    prefetched again: its next use is position 6 (pass 3), not the past use at 2. (0, 3),
    prefetched at the same point, is next used at position 4, the very next access."""
    p, clock = policy_for(belady_trace(), "belady")
    at(clock, 1, 1)
    p.on_insert(key(0, 0), False)
    p.on_insert(key(0, 3), False)
    assert p._next == {key(0, 0): 6.0, key(0, 3): 4.0}


def test_belady_without_a_workload_says_what_it_needs():
    ctx = PolicyContext(num_layers=1, num_experts=4, top_k=1, expert_bytes=1, rng=np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"^belady needs the workload to read future accesses$"):
        Belady(None, ctx)


def test_least_stale_order_parameter_names_its_values():
    with pytest.raises(ValueError, match="order must be 'relative' or 'absolute', got 'newest'"):
        LeastStaleParams(order="newest")


@pytest.mark.parametrize("decay", [0, -0.5, 1.5])
def test_score_decay_outside_its_range_is_refused(decay):
    from moesim.errors import MoesimError

    with pytest.raises(MoesimError) as exc:
        scenario(policies={"eviction": {"name": "score", "decay": decay}})
    assert f"decay must be in (0, 1], got {decay}" in str(exc.value)


def test_random_evicts_in_the_order_of_its_own_seeded_generator():
    """Random permutes the cached keys (in insertion order) with the policy's generator,
    which the scenario seeds with (seed, family 0)."""
    p, _ = policy_for(one_layer_trace(), "random")
    keys = [key(0, e) for e in range(4)]
    for k in keys:
        p.on_insert(k, True)
    rng = np.random.default_rng([0, 0])
    assert list(p.candidates()) == [keys[i] for i in rng.permutation(4)]
    assert list(p.candidates()) == [keys[i] for i in rng.permutation(4)]


def three_layer_trace(passes: int = 4):
    model = small_model(layers=3, experts=4, top_k=1)
    return trace_from_array(model, np.zeros((1, passes, 3, 1), dtype=np.int64))


def test_least_stale_rolls_the_current_queue_when_a_new_pass_asks_first():
    """z (layer 2) enters in pass 0; y (layer 0) in pass 1, which makes z stale. In pass 2
    at layer 1, before any other event, both are stale: layers already passed first (y),
    then the upcoming ones farthest first (z). An optional prefetch may evict both (both
    stale). Without the roll y would still be current: evicted after z, and never for a
    prefetch."""
    y, z = key(0, 1), key(2, 3)

    def z_then_y():
        pol, clock = policy_for(three_layer_trace(), "least-stale")
        at(clock, 0, 2)
        pol.on_insert(z, True)
        at(clock, 1, 0)
        pol.on_insert(y, True)
        at(clock, 2, 1)
        return pol

    assert list(z_then_y().prefetch_candidates()) == [y, z]
    assert list(z_then_y().candidates()) == [y, z]


def test_least_stale_puts_the_current_layers_pending_experts_last():
    """per-expert execution at layer 1: a and b are layer 1's experts (a still to run, b
    has run), c is at layer 0 and d at layer 2, all stale. Relative order: layers passed (c),
    the current layer's experts that have run (b), upcoming layers farthest first (d), the
    current layer's experts still to run (a)."""
    pol, clock = policy_for(three_layer_trace(), "least-stale")
    a, b, c, d = key(1, 0), key(1, 1), key(0, 2), key(2, 3)
    at(clock, 0, 0)
    for k in (a, b, c, d):
        pol.on_insert(k, True)
    at(clock, 1, 1)
    clock.pending = {a}
    assert list(pol.candidates()) == [c, b, d, a]


def test_least_stale_makes_a_use_in_a_new_pass_current():
    """a then b enter layer 0's current queue in pass 0. The first event of pass 1 is a use
    of a: the queues roll (both stale), then a becomes current again. At layer 1 the stale b
    goes first, then a. (Were the use ignored because a was current in pass 0, both would
    be stale after the roll: a first.)"""
    pol, clock = policy_for(three_layer_trace(), "least-stale")
    a, b = key(0, 0), key(0, 1)
    at(clock, 0, 0)
    pol.on_insert(a, True)
    pol.on_insert(b, True)
    at(clock, 1, 0)
    pol.on_access(a)
    at(clock, 1, 1)
    assert list(pol.candidates()) == [b, a]

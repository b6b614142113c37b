"""Exact proposals of the prefetch policies on hand-made traces, and a contract every
registered prefetcher is held to (issue 12). Cache keys are written out: with the tiny
model's four precisions (bf16, int8, int4, int2) the bf16 key of (layer, expert) is
(layer * experts + expert) * 4."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moesim.policies.prefetch import REGISTRY as PREFETCH
from moesim.simulator.engine import Simulation
from moesim.traces.synth import generate
from moesim.traces.trace import Trace
from tests.helpers import scenario, small_model, trace_from_array


def key(layer: int, expert: int, experts: int = 4) -> int:
    return (layer * experts + expert) * 4


def policy(trace, spec, batch: int = 1):
    return Simulation(scenario(policies={"prefetch": spec}, workload={"batch_size": batch}), trace=trace).prefetch


def three_layer_trace():
    """One request, two decode tokens, top-1, 3 layers, 4 experts:
    token 0 routes layers (0, 1, 2) to experts (0, 1, 2); token 1 to (3, 2, 1)."""
    model = small_model(layers=3, experts=4, top_k=1)
    return trace_from_array(model, np.array([[[[0], [1], [2]], [[3], [2], [1]]]]))


def test_previous_token_proposes_the_next_layers_experts_of_the_previous_pass():
    p = policy(three_layer_trace(), "previous-token")
    assert list(p.propose(0, 0)) == []  # no previous pass
    assert list(p.propose(1, 0)) == [key(1, 1)]  # layer 1 of token 0
    assert list(p.propose(1, 1)) == [key(2, 2)]  # layer 2 of token 0
    assert list(p.propose(1, 2)) == []  # no next layer


def test_lookahead_depth_is_the_number_of_layers_ahead():
    t = three_layer_trace()
    assert list(policy(t, {"name": "lookahead", "depth": 2}).propose(1, 0)) == [key(1, 1), key(2, 2)]
    assert list(policy(t, {"name": "lookahead", "depth": 1}).propose(1, 0)) == [key(1, 1)]
    assert list(policy(t, {"name": "lookahead", "depth": 2}).propose(1, 1)) == [key(2, 2)]  # the last layer caps it


def test_oracle_proposes_the_next_layers_true_experts():
    p = policy(three_layer_trace(), "oracle")
    assert list(p.propose(1, 0)) == [key(1, 2)]
    assert list(p.propose(1, 1)) == [key(2, 1)]


def predicted_trace():
    """One pass of two tokens (batch of two one-token prefills), 2 layers, 4 experts, top-1,
    with a hand-written next-layer prediction at layer 0:
    token A: (0.1, 0.5, 0.3, 0.1), token B: (0.4, 0.0, 0.35, 0.25)."""
    model = small_model(layers=2, experts=4, top_k=1)
    base = trace_from_array(model, np.array([[[[0], [1]]], [[[2], [3]]]]), prompt_tokens=1)
    pred = np.zeros((len(base), 4), dtype=np.float32)
    rows = {(int(r), int(layer)): i for i, (r, layer) in enumerate(zip(base.request, base.layer, strict=True))}
    pred[rows[(0, 0)]] = [0.1, 0.5, 0.3, 0.1]
    pred[rows[(1, 0)]] = [0.4, 0.0, 0.35, 0.25]
    cols = {c: getattr(base, c) for c in ("request", "step", "position", "phase", "layer", "experts", "weights")}
    return Trace(model=model, pred_next=pred, **cols)


def test_next_gate_topk_unions_each_tokens_top_and_orders_by_summed_prediction():
    """overfetch 2 -> each token's top ceil(1 * 2) = 2: A {1, 2}, B {0, 2}; the union ordered
    by summed prediction: 2 (0.65), then 0 and 1 (0.5 each, by expert id). overfetch 1: A {1},
    B {0}: 1 (0.5) and 0 (0.5) tie, by id: 0, 1."""
    t = predicted_trace()
    assert list(policy(t, {"name": "next-gate-topk", "overfetch": 2.0}, 2).propose(0, 0)) == [key(1, 2), key(1, 0), key(1, 1)]
    assert list(policy(t, {"name": "next-gate-topk", "overfetch": 1.0}, 2).propose(0, 0)) == [key(1, 0), key(1, 1)]


def test_score_percentile_takes_the_experts_above_the_percentile_of_the_mean_prediction():
    """Mean prediction over the two tokens: (0.25, 0.25, 0.325, 0.175). Its 50th percentile
    is 0.25 (numpy's linear interpolation of 0.175, 0.25, 0.25, 0.325): strictly above it only
    expert 2. The 20th percentile is 0.175 + 0.6 * (0.25 - 0.175) = 0.22: experts 2, then 0
    and 1 (tied, by id)."""
    t = predicted_trace()
    assert list(policy(t, {"name": "score-percentile", "percentile": 50}, 2).propose(0, 0)) == [key(1, 2)]
    assert list(policy(t, {"name": "score-percentile", "percentile": 20}, 2).propose(0, 0)) == [key(1, 2), key(1, 0), key(1, 1)]


@pytest.mark.parametrize("name", PREFETCH.names())
def test_every_prefetcher_proposes_distinct_keys_of_later_layers(name):
    """Contract for every registered prefetch policy: at (pass, layer) its proposals are
    distinct cache keys of layers after ``layer`` (and of a valid expert)."""
    model = small_model(layers=4, experts=8, top_k=2)
    t = generate(model, requests=2, prompt_tokens=3, tokens=6, seed=4, pred_next=True, probs=True)
    sim = Simulation(scenario(policies={"prefetch": name}, workload={"batch_size": 2}), trace=t)
    ctx = sim.prefetch.ctx
    for p in range(sim.wl.num_passes):
        for layer in range(model.num_layers):
            props = list(sim.prefetch.propose(p, layer)) if sim.prefetch.active else []
            assert len(props) == len(set(props)), (name, p, layer)
            for k in props:
                assert layer < ctx.layer_of(k) < model.num_layers, (name, p, layer, k)
                assert ctx.precision_of(k) == ctx.default_precision


@pytest.mark.parametrize(("spec", "error"), [
    ({"name": "lookahead", "depth": 0}, "depth must be >= 1, got 0"),
    ({"name": "score-percentile", "percentile": 100}, "percentile must be in [0, 100), got 100"),
    ({"name": "score-percentile", "percentile": -0.5}, "percentile must be in [0, 100), got -0.5"),
    ({"name": "next-gate-topk", "overfetch": 0}, "overfetch must be > 0, got 0"),
    ({"name": "static-pin", "fraction": 0}, "fraction must be in (0, 1], got 0"),
    ({"name": "static-pin", "fraction": 1.5}, "fraction must be in (0, 1], got 1.5"),
    ({"name": "static-pin", "calibration": 0}, "calibration must be in (0, 1], got 0"),
    ({"name": "static-pin", "calibration": 1.01}, "calibration must be in (0, 1], got 1.01"),
])
def test_prefetch_parameters_out_of_range_are_refused_with_the_range(spec, error):
    from moesim.errors import MoesimError

    with pytest.raises(MoesimError) as exc:
        scenario(policies={"prefetch": spec})
    assert error in str(exc.value)


@pytest.mark.parametrize("spec", [
    {"name": "lookahead", "depth": 1}, {"name": "score-percentile", "percentile": 0},
    {"name": "score-percentile", "percentile": 99.9}, {"name": "next-gate-topk", "overfetch": 0.1},
    {"name": "static-pin", "fraction": 1, "calibration": 1}, {"name": "static-pin", "fraction": 0.01, "calibration": 0.01},
])
def test_prefetch_parameters_at_the_edges_of_their_range_are_accepted(spec):
    assert scenario(policies={"prefetch": spec}).policies.prefetch.name == spec["name"]


def test_a_predictor_without_pred_next_names_the_fixes():
    from moesim.errors import MoesimError

    with pytest.raises(MoesimError) as exc:
        policy(three_layer_trace(), "next-gate-topk")
    assert str(exc.value) == (
        "prefetch policy 'next-gate-topk' needs the trace's 'pred_next' column (the next layer's "
        "router probabilities predicted from this layer's hidden state), and this trace has "
        "none. Record it with `moesim capture --predict-next`, make a synthetic trace with "
        "workload.trace.synth.pred_next: true, or use prefetch: previous-token, which needs "
        "no hidden state.")


def test_the_predictors_are_the_prefetchers_a_trace_without_pred_next_refuses():
    """``predictors()`` (what ``compare`` adds when the trace records ``pred_next``) lists
    exactly the registered prefetchers that refuse a trace without it."""
    from moesim.errors import MoesimError
    from moesim.policies.prefetch.base import predictors

    refused, why = [], []
    for name, _ in PREFETCH.items():
        try:
            policy(three_layer_trace(), name)
        except MoesimError as exc:
            refused.append(name)
            why.append(str(exc))
    assert all("'pred_next'" in w for w in why)
    assert predictors() == refused == ["next-gate-topk", "score-percentile"]


def test_static_pin_pins_the_calibration_favourites():
    """One layer, 8 experts, top-1, four decode tokens routed to experts 3, 5, 5, 5; room for
    4 experts. calibration 0.25 -> the first ceil(4 x 0.25) = 1 pass: only expert 3 was used,
    so only 3 is pinned (fraction 0.5 would allow 2). calibration 1 -> counts 5: 3, 3: 1:
    both pinned, 5 first. With unlimited capacity and fraction 0.5 the slots are the 8
    experts' half, 4: still only the 2 used experts."""
    model = small_model(layers=1, experts=8, top_k=1)
    t = trace_from_array(model, np.array([[[[3]], [[5]], [[5]], [[5]]]]))

    def pins(cal: float, capacity: str = "4 experts") -> list[int]:
        sim = Simulation(scenario(cache={"capacity": capacity},
                                  policies={"prefetch": {"name": "static-pin", "fraction": 0.5, "calibration": cal}}),
                         trace=t)
        return sim.prefetch.static_pins

    k = lambda e: key(0, e, experts=8)  # noqa: E731
    assert pins(0.25) == [k(3)]
    assert pins(1.0) == [k(5), k(3)]
    assert pins(1.0, "inf") == [k(5), k(3)]


def test_previous_token_stays_within_its_batch_group():
    """Two requests of two decode tokens, batch 1: passes 0, 1 are request 0's, passes 2, 3
    request 1's (layer 1 experts 6 then 7). Pass 2 has no previous pass in its group; pass 3
    proposes pass 2's layer-1 expert, 6."""
    model = small_model(layers=2, experts=8, top_k=1)
    t = trace_from_array(model, np.array([[[[0], [1]], [[2], [3]]], [[[4], [6]], [[5], [7]]]]))
    p = policy(t, "previous-token")
    assert list(p.propose(2, 0)) == []
    assert list(p.propose(3, 0)) == [key(1, 6, experts=8)]
    assert list(p.propose(1, 0)) == [key(1, 1, experts=8)]


def arrays(pol, first, last, layers):
    """A policy's compiled proposals (``proposals``) as {(pass, layer): keys}, the offsets'
    shape checked."""
    off, keys = pol.proposals(first, last)
    assert off.dtype == np.int64
    assert keys.dtype == np.int64
    assert off.shape == ((last - first) * layers + 1,)
    assert off[0] == 0
    assert off[-1] == len(keys)
    return {(p, layer): keys[off[(p - first) * layers + layer]:off[(p - first) * layers + layer + 1]].tolist()
            for p in range(first, last) for layer in range(layers)}


def test_the_compiled_proposals_of_the_routed_prefetchers_by_hand():
    """What the kernel reads for oracle, previous-token and lookahead, written out: on the
    two-request trace of the test above (passes 0, 1: request 0, layer-1 experts 1 then 3;
    passes 2, 3: request 1, layer-1 experts 6 then 7), each pass's layer 0 proposes one layer-1
    expert and layer 1 nothing; previous-token reads the pass before only within its request,
    also when the range starts at that pass; on the three-layer trace (token 1 of one request)
    lookahead proposes the previous token's next ``depth`` layers, nearest first, capped at the
    last layer."""
    model = small_model(layers=2, experts=8, top_k=1)
    t = trace_from_array(model, np.array([[[[0], [1]], [[2], [3]]], [[[4], [6]], [[5], [7]]]]))
    k = lambda layer, e: key(layer, e, experts=8)  # noqa: E731
    oracle = arrays(policy(t, "oracle"), 0, 4, 2)
    assert oracle == {(0, 0): [k(1, 1)], (1, 0): [k(1, 3)], (2, 0): [k(1, 6)], (3, 0): [k(1, 7)],
                      (0, 1): [], (1, 1): [], (2, 1): [], (3, 1): []}
    prev = policy(t, "previous-token")
    assert arrays(prev, 0, 4, 2) == {(0, 0): [], (1, 0): [k(1, 1)], (2, 0): [], (3, 0): [k(1, 6)],
                                     (0, 1): [], (1, 1): [], (2, 1): [], (3, 1): []}
    assert arrays(prev, 3, 4, 2) == {(3, 0): [k(1, 6)], (3, 1): []}
    assert arrays(prev, 2, 3, 2) == {(2, 0): [], (2, 1): []}
    assert arrays(prev, 2, 2, 2) == {}
    three = three_layer_trace()
    for depth, want in ((1, [key(1, 1)]), (2, [key(1, 1), key(2, 2)]), (5, [key(1, 1), key(2, 2)])):
        got = arrays(policy(three, {"name": "lookahead", "depth": depth}), 0, 2, 3)
        assert got == {(0, 0): [], (0, 1): [], (0, 2): [], (1, 0): want, (1, 1): [key(2, 2)], (1, 2): []}


def test_score_percentile_beyond_its_first_planning_chunk():
    """The policy plans 256 passes at a time; at pass 270 (the second chunk) its proposals are
    still the experts above the percentile of that pass's mean prediction, highest first (one
    token per pass here, so the mean is the token's prediction), computed here with numpy."""
    t = generate(small_model(layers=2, experts=8, top_k=2), requests=1, tokens=300, seed=9, pred_next=True)
    p = policy(t, {"name": "score-percentile", "percentile": 60})
    order = np.lexsort((t.layer, t.step))
    for step in (0, 255, 256, 270, 299):
        row = order[2 * step]  # layer 0 of that decode step
        assert (int(t.step[row]), int(t.layer[row])) == (step, 0)
        pred = t.pred_next[row].astype(np.float32)
        thr = np.percentile(pred, 60)
        above = sorted((e for e in range(8) if pred[e] > thr), key=lambda e: (-pred[e], e))
        assert list(p.propose(step, 0)) == [key(1, e, experts=8) for e in above], step
        assert list(p.propose(step, 1)) == []  # no layer after the last


def wide_predicted_trace(pred_row: np.ndarray):
    """One token (a one-token prefill), 2 layers, 64 experts, top-2, with ``pred_row`` as the
    layer-0 prediction of layer 1's router."""
    model = small_model(layers=2, experts=64, top_k=2)
    base = trace_from_array(model, np.array([[[[0, 1], [2, 3]]]]), prompt_tokens=1)
    pred = np.full((len(base), 64), 1 / 64, dtype=np.float32)
    pred[int(np.flatnonzero(base.layer == 0)[0])] = pred_row
    cols = {c: getattr(base, c) for c in ("request", "step", "position", "phase", "layer", "experts", "weights")}
    return Trace(model=model, pred_next=pred, **cols)


def test_next_gate_topk_overfetching_every_expert_orders_all_by_prediction_ties_by_id():
    """overfetch 32 -> ceil(2 x 32) = 64 = every expert. The prediction gives the odd experts
    0.02 and the even ones 0.01125 (they sum to 1): the 32 odd experts first, in id order, then
    the 32 even ones, in id order (a stable order over 64 tied values)."""
    row = np.where(np.arange(64) % 2 == 1, 0.02, 0.01125).astype(np.float32)
    t = wide_predicted_trace(row)
    got = list(policy(t, {"name": "next-gate-topk", "overfetch": 32.0}).propose(0, 0))
    assert got == [key(1, e, experts=64) for e in [*range(1, 64, 2), *range(0, 64, 2)]]


def reference_percentile(trace, batch: int, percentile: float) -> dict[tuple[int, int], list[int]]:
    """Score-percentile written from its definition, pass by pass and layer by layer: the
    mean of the pass's pred_next rows at that layer; the experts strictly above the
    percentile of those means, highest first, ties by expert id; none for the last layer."""
    from moesim.simulator.workload import build_workload

    wl = build_workload(trace, batch_size=batch)
    n_l, n_e = trace.model.num_layers, trace.model.num_experts
    out = {}
    for p in range(wl.num_passes):
        for layer in range(n_l):
            rows = wl.row_order[wl.row_off[p * n_l + layer]:wl.row_off[p * n_l + layer + 1]]
            if len(rows) == 0 or layer + 1 == n_l:
                out[(p, layer)] = []
                continue
            mean = trace.pred_next[rows].astype(np.float64).mean(axis=0)
            cut = np.percentile(mean, percentile)
            above = sorted((e for e in range(n_e) if mean[e] > cut), key=lambda e: (-mean[e], e))
            out[(p, layer)] = [key(layer + 1, e, experts=n_e) for e in above]
    return out


def test_score_percentile_equals_its_definition_across_plan_chunks(monkeypatch):
    """Batch 2, 5 passes, 3 layers, 64 experts, random predictions rounded to a few levels
    (ties), and the last pass routed at layer 0 only. Plans of 2 passes (CHUNK = 2, and 1):
    every (pass, layer), asked for from the last pass back and from the first on (each plan's
    end then asked next), equals the reference."""
    from moesim.policies.prefetch.score_percentile import ScorePercentile

    rng = np.random.default_rng(5)
    model = small_model(layers=3, experts=64, top_k=2)
    ex = rng.integers(0, 32, size=(2, 5, 3, 1)) * 2 + np.array([0, 1])  # two distinct experts per row
    base = trace_from_array(model, ex)
    keep = ~((base.step == 4) & (base.layer > 0))
    base = base.take(keep)
    pred = (np.round(rng.random((len(base), 64)) * 4) / 4).astype(np.float32)
    cols = {c: getattr(base, c) for c in ("request", "step", "position", "phase", "layer", "experts", "weights")}
    t = Trace(model=model, pred_next=pred, **cols)
    expected = reference_percentile(t, 2, 70.0)
    assert any(len(v) for v in expected.values())
    for chunk in (2, 1):
        monkeypatch.setattr(ScorePercentile, "CHUNK", chunk)
        for asked in (sorted(expected, key=lambda pl: (-pl[0], pl[1])), sorted(expected)):
            p = policy(t, {"name": "score-percentile", "percentile": 70.0}, batch=2)
            assert {pl: list(p.propose(*pl)) for pl in asked} == expected


def test_static_pin_breaks_ties_in_use_by_expert_id():
    """One layer, 64 experts, top-2; 16 tokens route (0, 2), (4, 6), ..., (60, 62): the 32 even
    experts used once each, the odd ones never. Room for 8, fraction 1, calibration on every
    pass: the 8 lowest even ids, in id order."""
    model = small_model(layers=1, experts=64, top_k=2)
    t = trace_from_array(model, np.array([[[[4 * i, 4 * i + 2]] for i in range(16)]]))
    sim = Simulation(scenario(cache={"capacity": "8 experts"},
                              policies={"prefetch": {"name": "static-pin", "fraction": 1.0, "calibration": 1.0}}),
                     trace=t)
    assert sim.prefetch.static_pins == [key(0, e, experts=64) for e in range(0, 16, 2)]


@pytest.mark.parametrize("name", PREFETCH.names())
def test_only_static_pin_admits_experts_before_the_replay(name):
    """The prefetch family's admission rule (``pinned``): static-pin's calibration choice,
    nothing for the per-layer prefetchers; the engine preloads exactly those."""
    t = three_layer_trace()
    spec = {"name": name, "fraction": 1.0, "calibration": 1.0} if name == "static-pin" else name
    if name in ("next-gate-topk", "score-percentile"):
        pred = np.full((len(t), 4), 0.25, dtype=np.float32)
        cols = {c: getattr(t, c) for c in ("request", "step", "position", "phase", "layer", "experts", "weights")}
        t = Trace(model=t.model, pred_next=pred, **cols)
    sim = Simulation(scenario(cache={"capacity": "100%"}, policies={"prefetch": spec}), trace=t)
    pinned = list(sim.prefetch.pinned())
    if name == "static-pin":
        # used experts: layer 0 {0, 3}, layer 1 {1, 2}, layer 2 {2, 1}: 6, each once, by key
        assert pinned == sorted(key(layer, e) for layer, es in ((0, (0, 3)), (1, (1, 2)), (2, (1, 2))) for e in es)
    else:
        assert pinned == []
    assert sim.preloaded == len(pinned)


def test_proposal_arrays_equal_the_proposals_of_every_pass_and_layer():
    """What the compiled kernel reads (``PrefetchPolicy.proposals``): int64 offsets, one per
    (pass, layer) of the range + 1, and int64 keys, for ranges starting at 0, inside the
    trace and empty. Score-percentile against its pass-by-pass definition; next-gate-topk
    (the default, from ``propose``) against its proposals."""
    from moesim.policies.prefetch.score_percentile import ScorePercentile

    rng = np.random.default_rng(7)
    model = small_model(layers=3, experts=64, top_k=2)
    ex = rng.integers(0, 32, size=(2, 6, 3, 1)) * 2 + np.array([0, 1])
    base = trace_from_array(model, ex)
    pred = (np.round(rng.random((len(base), 64)) * 4) / 4).astype(np.float32)
    cols = {c: getattr(base, c) for c in ("request", "step", "position", "phase", "layer", "experts", "weights")}
    t = Trace(model=model, pred_next=pred, **cols)
    expected = reference_percentile(t, 2, 70.0)
    sp = policy(t, {"name": "score-percentile", "percentile": 70.0}, batch=2)
    topk = policy(t, {"name": "next-gate-topk", "overfetch": 1.5}, batch=2)
    assert isinstance(sp, ScorePercentile)
    for first, last in ((0, 4), (2, 6), (3, 3), (6, 6)):
        for pol, want in ((sp, lambda p, layer: expected[(p, layer)]), (topk, lambda p, layer: list(topk.propose(p, layer)))):
            off, keys = pol.proposals(first, last)
            assert off.dtype == np.int64
            assert keys.dtype == np.int64
            assert off.shape == ((last - first) * 3 + 1,)
            assert off[0] == 0
            assert off[-1] == len(keys)
            got = {(p, layer): keys[off[(p - first) * 3 + layer]:off[(p - first) * 3 + layer + 1]].tolist()
                   for p in range(first, last) for layer in range(3)}
            assert got == {(p, layer): want(p, layer) for p in range(first, last) for layer in range(3)}
    assert sum(len(v) for v in expected.values()) > 0


def numpy_by_group(pred, row_order, bounds, g0, num_l, experts_of):
    """A prefetcher's proposals by numpy, group by group: the rows taken as float32 (the trace
    format's type) and added one after another in float32; ``experts_of(scores, total)`` (the
    group's rows and their sums) gives the experts proposed for the next layer, in order. The
    last layer and empty groups propose nothing."""
    pred = pred.astype(np.float32)
    off, out = [0], []
    for g in range(len(bounds) - 1):
        r0, r1 = int(bounds[g]), int(bounds[g + 1])
        layer = (g0 + g) % num_l
        if r0 < r1 and layer + 1 < num_l:
            rows = row_order[r0:r1]
            total = pred[rows[0]].copy()
            for r in rows[1:]:
                total = total + pred[r]
            out.extend(int((layer + 1) * pred.shape[1] + e) for e in experts_of(pred[rows], total))
        off.append(len(out))
    return np.array(off), np.array(out, dtype=np.int64)


def numpy_percentile_proposals(pred, row_order, bounds, g0, num_l, percentile):
    """Score-percentile by numpy: the sums divided by the row count in float64, the threshold
    by ``np.percentile``, the order by a stable argsort of the negated means."""

    def above(scores, total):
        means = total.astype(np.float64) / len(scores)
        cut = np.percentile(means, percentile)
        return [e for e in np.argsort(-means, kind="stable") if means[e] > cut]

    return numpy_by_group(pred, row_order, bounds, g0, num_l, above)


def draw_groups(data):
    """Random predicted scores for the property tests: 1-70 experts, 1-4 layers, 0-4 rows per
    (pass, layer) group (rows out of order, three rows unused), values on 3, 16 or 2**20
    levels (so that scores tie), non-negative, of both signs, or of both signs with -0.0,
    float32 or float64. Returns ``pred, row_order, bounds, g0, num_l``."""
    n_e = data.draw(st.integers(1, 70))
    num_l = data.draw(st.integers(1, 4))
    counts = data.draw(st.lists(st.integers(0, 4), min_size=1, max_size=12))
    levels = data.draw(st.sampled_from([3, 16, 2 ** 20]))
    g0 = data.draw(st.integers(0, 5))
    seed = data.draw(st.integers(0, 2 ** 16))
    dtype = data.draw(st.sampled_from([np.float32, np.float64]))
    signs = data.draw(st.sampled_from(["non-negative", "both", "both and negative zeros"]))
    rng = np.random.default_rng(seed)
    n_rows = sum(counts)
    level = np.floor(rng.random((n_rows + 3, n_e)) * levels)
    if signs != "non-negative":
        level -= levels // 2
    pred = (level / levels * rng.random()).astype(dtype)
    if signs == "both and negative zeros":
        pred[(pred == 0) & (rng.random(pred.shape) < 0.5)] = -0.0
    row_order = rng.permutation(n_rows + 3)[:n_rows].astype(np.int64)
    bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return pred, row_order, bounds, g0, num_l


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_compiled_percentile_proposals_equal_numpys_percentile_and_stable_sort(data):
    """The compiled proposals against numpy on random float32 predictions (on a few levels, so
    that means tie and the percentile lands on tied values), 1-70 experts, 0-4 rows per
    (pass, layer), rows out of order, any percentile in [0, 100); and on float64 predictions
    (a trace made in memory), taken as float32 first. Negative scores and -0.0 too: the
    sorting keys flip a negative float's bits, and -0.0 ties with 0.0 as a mean does."""
    from moesim.policies.prefetch.score_percentile import percentile_proposals

    pred, row_order, bounds, g0, num_l = draw_groups(data)
    pct = data.draw(st.one_of(st.sampled_from([0.0, 20.0, 50.0, 80.0, 99.0]), st.floats(0, 100, exclude_max=True)))
    off, out = percentile_proposals(pred, row_order, bounds, g0, num_l, pct / 100)
    ref_off, ref_out = numpy_percentile_proposals(pred, row_order, bounds, g0, num_l, pct)
    assert off.tolist() == ref_off.tolist()
    assert out[:off[-1]].tolist() == ref_out.tolist()


def test_percentile_proposals_at_the_edges_equal_numpy():
    """Cases the property test may not draw, each against numpy: one expert (the quantile is
    its own mean: nothing above it); two experts at a percentile so close to 100 that numpy's
    interpolation rounds to the upper mean (so it is not proposed), and at 99 (it is); three
    experts where numpy's form for a fraction of 0.5 or more (``b - d * (1 - gamma)``) stays
    below the upper mean and the other form would round to it; tied
    sums of 0.0 and -0.0 above a negative quantile (ordered by index, as equal means are)."""
    from moesim.policies.prefetch.score_percentile import percentile_proposals

    def both(pred, pct, counts=(1,), num_l=2):
        pred = np.asarray(pred, np.float32)
        bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        rows = np.arange(int(bounds[-1]), dtype=np.int64)
        got = percentile_proposals(pred, rows, bounds, 0, num_l, pct / 100)
        want = numpy_percentile_proposals(pred, rows, bounds, 0, num_l, pct)
        assert got[0].tolist() == want[0].tolist()
        assert got[1].tolist() == want[1].tolist()
        return got[1].tolist()

    assert both([[0.5], [0.25]], 50.0, counts=(1, 1)) == []
    edge = 100 * (1 - 2.0 ** -53)
    assert np.percentile([0.25, 0.5], edge) == 0.5  # the interpolation rounds to the upper mean
    assert both([[0.25, 0.5]], edge) == []
    assert both([[0.25, 0.5]], 99.0) == [3]
    # numpy's other form near 1 (b - d * (1 - gamma)) stays below the upper mean where a + d * gamma would not
    assert both([[0.0, 7.99328, 16.286016]], edge) == [5]
    # over five rows the means' rounding decides: the upper mean is not above the quantile (it
    # would be, were the sums scaled the other way or by another count)
    assert both([[1, 2], [9.440246, 10.378484]] + [[0, 0]] * 4, 99.99999999999989, counts=(1, 5), num_l=3) == [3]
    assert both([[-0.0, -0.5, 0.0, -0.0, -0.5]], 25.0) == [5, 7, 8]


def numpy_topk_proposals(pred, row_order, bounds, g0, num_l, count):
    """Next-gate top-k by numpy: each row's ``count`` highest experts by a stable argsort of
    the negated scores (ties by index); their union ordered by a stable argsort of the negated
    sums over the union sorted by index."""

    def union(scores, total):
        chosen = np.array(sorted({int(e) for row in scores for e in np.argsort(-row, kind="stable")[:count]}))
        return chosen[np.argsort(-total[chosen], kind="stable")]

    return numpy_by_group(pred, row_order, bounds, g0, num_l, union)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_compiled_topk_proposals_equal_numpys_stable_sorts(data):
    """Next-gate top-k's compiled proposals against numpy on random predictions on a few
    levels (so that scores tie at a row's cut and sums tie in the order), negative and -0.0
    scores, float32 or float64 (taken as float32), 1-70 experts, 0-4 rows per (pass, layer),
    rows out of order, from one expert a row to more than there are."""
    from moesim.policies.prefetch.next_gate_topk import topk_proposals

    pred, row_order, bounds, g0, num_l = draw_groups(data)
    count = data.draw(st.integers(1, pred.shape[1] + 2))
    off, out = topk_proposals(pred, row_order, bounds, g0, num_l, count)
    ref_off, ref_out = numpy_topk_proposals(pred, row_order, bounds, g0, num_l, count)
    assert off.tolist() == ref_off.tolist()
    assert out.tolist() == ref_out.tolist()


@pytest.mark.parametrize("spec", [{"name": "next-gate-topk", "overfetch": 1.0}, {"name": "score-percentile",
                                                                             "percentile": 50.0}])
def test_a_prefetchers_chunk_of_proposals_is_of_the_workload_it_now_reads(spec):
    """``propose`` reads its proposals from a chunk made for many passes at once; when the
    policy is given another workload (a trace read in pieces binds each piece in turn), the
    same pass asks for a new chunk from that workload, never the last one's proposals."""
    from moesim.simulator.workload import build_workload

    first = predicted_trace()
    second = predicted_trace()
    second.pred_next = second.pred_next[:, ::-1].copy()  # the other experts predicted
    pol = policy(first, spec, 2)
    before = list(pol.propose(0, 0))
    pol.ctx.workload = build_workload(second, 2)
    after = list(pol.propose(0, 0))
    assert after == list(policy(second, spec, 2).propose(0, 0))
    assert after != before


@pytest.mark.parametrize("spec", [{"name": "next-gate-topk", "overfetch": 1.5},
                                  {"name": "score-percentile", "percentile": 70.0}, "oracle", "previous-token",
                                  {"name": "lookahead", "depth": 2}])
def test_a_pieces_proposals_made_ahead_are_those_of_all_its_passes(spec):
    """What the reading thread makes for a piece (``piece_proposals``, from the piece alone)
    equals the proposals of all its passes asked of a policy that reads it, and each pass's
    and layer's proposals from ``propose``."""
    from moesim.simulator.workload import build_workload

    rng = np.random.default_rng(11)
    model = small_model(layers=3, experts=16, top_k=2)
    base = trace_from_array(model, rng.integers(0, 8, size=(2, 5, 3, 1)) * 2 + np.array([0, 1]))
    cols = {c: getattr(base, c) for c in ("request", "step", "position", "phase", "layer", "experts", "weights")}
    t = Trace(model=model, pred_next=rng.random((len(base), 16)).astype(np.float32), **cols)
    pol = policy(t, spec, 2)
    wl = build_workload(t, 2)
    off, keys = pol.piece_proposals(wl)
    want_off, want_keys = pol.proposals(0, wl.num_passes)
    assert off.tolist() == want_off.tolist()
    assert keys.tolist() == want_keys.tolist()
    assert [keys[off[i]:off[i + 1]].tolist() for i in range(wl.num_passes * 3)] == [
        list(pol.propose(p, layer)) for p in range(wl.num_passes) for layer in range(3)]
    assert len(keys) > 0

"""Exact proposals of the prefetch policies on hand-made traces, and a contract every
registered prefetcher is held to (issue 12). Cache keys are written out: with the tiny
model's four precisions (bf16, int8, int4, int2) the bf16 key of (layer, expert) is
(layer * experts + expert) * 4."""

from __future__ import annotations

import numpy as np
import pytest

from policies.prefetch import REGISTRY as PREFETCH
from simulator.engine import Simulation
from tests.helpers import scenario, small_model, trace_from_array
from traces.synth import generate
from traces.trace import Trace


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

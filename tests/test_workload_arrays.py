"""The workload's per-access arrays (``build_workload``: each (pass, layer)'s distinct experts
in order of first appearance, best rank, tokens routed, summed weight) against a hand-worked
example and an independent dictionary replay of the definition on generated traces, rows
given in shuffled order."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from moesim.simulator.workload import build_workload
from moesim.traces.trace import Trace
from tests.helpers import small_model, trace_from_array


def with_weights(trace: Trace, weights: np.ndarray) -> Trace:
    cols = {c: getattr(trace, c) for c in ("request", "step", "position", "phase", "layer", "experts")}
    return Trace(model=trace.model, weights=weights.astype(np.float32), **cols)


def test_a_batch_of_two_tokens_by_hand():
    """One layer of 8 experts, top-2, two requests decoded together (batch 2), one step:
    request 0 routes (3, 1) with weights (0.5, 0.25), request 1 routes (1, 5) with
    (0.75, 0.125). The pass's accesses, in order of first appearance: expert 3 (best rank 0,
    1 token, 0.5), expert 1 (rank 0 from request 1, 2 tokens, 0.25 + 0.75), expert 5 (rank
    1, 1 token, 0.125)."""
    model = small_model(layers=1, experts=8, top_k=2)
    base = trace_from_array(model, np.array([[[[3, 1]]], [[[1, 5]]]]))
    t = with_weights(base, np.array([[0.5, 0.25], [0.75, 0.125]]))
    wl = build_workload(t, batch_size=2)
    assert wl.off.tolist() == [0, 3]
    assert wl.off.dtype == np.int64
    assert wl.acc_expert.tolist() == [3, 1, 5]
    assert wl.acc_layer.tolist() == [0, 0, 0]
    assert wl.acc_rank.tolist() == [0, 0, 1]
    assert wl.acc_tokens.tolist() == [1, 2, 1]
    assert wl.acc_weight.tolist() == [0.5, 1.0, 0.125]
    assert (wl.acc_layer.dtype, wl.acc_expert.dtype, wl.acc_rank.dtype, wl.acc_tokens.dtype, wl.acc_weight.dtype) == (
        np.int32, np.int32, np.int8, np.int32, np.float64)
    assert wl.weight_total.tolist() == [1.625]


def test_layers_and_passes_are_counted_apart():
    """Two layers, two decode steps of one request: the same expert at another layer or in
    another pass is another access; off has one entry per (pass, layer) + 1."""
    model = small_model(layers=2, experts=4, top_k=1)
    t = trace_from_array(model, np.array([[[[2], [2]], [[2], [0]]]]))
    wl = build_workload(t, batch_size=1)
    assert wl.off.tolist() == [0, 1, 2, 3, 4]
    assert wl.acc_layer.tolist() == [0, 1, 0, 1]
    assert wl.acc_expert.tolist() == [2, 2, 2, 0]


def reference(trace: Trace, batch: int) -> list[tuple[int, int, int, int, int, float]]:
    """(pass, layer, expert, best rank, tokens, weight) by the definition: passes are
    (group, step) in order, rows by request then position, ranks in order; weights summed in
    float64 in that order."""
    req_ids = sorted(set(trace.request.tolist()))
    group_of = {r: i // batch for i, r in enumerate(req_ids)}
    rows = sorted(range(len(trace.request)), key=lambda i: (
        group_of[int(trace.request[i])], int(trace.step[i]), int(trace.layer[i]), req_ids.index(int(trace.request[i])),
        int(trace.position[i])))
    passes: dict[tuple[int, int], int] = {}
    acc: dict[tuple[int, int], dict[int, list]] = {}
    for i in rows:
        pk = (group_of[int(trace.request[i])], int(trace.step[i]))
        p = passes.setdefault(pk, len(passes))
        layer_acc = acc.setdefault((p, int(trace.layer[i])), {})
        for r, e in enumerate(trace.experts[i].tolist()):
            w = float(np.float64(trace.weights[i, r]))
            if e not in layer_acc:
                layer_acc[e] = [r, 1, w]
            else:
                layer_acc[e][0] = min(layer_acc[e][0], r)
                layer_acc[e][1] += 1
                layer_acc[e][2] += w
    return [(p, layer, e, v[0], v[1], v[2]) for (p, layer), d in sorted(acc.items()) for e, v in d.items()]


@settings(max_examples=60, deadline=None)
@given(layers=st.integers(1, 3), experts=st.integers(2, 9), k=st.integers(1, 3), requests=st.integers(1, 4),
       tokens=st.integers(1, 5), prompt=st.integers(0, 3), batch=st.integers(1, 4), seed=st.integers(0, 10_000))
def test_accesses_equal_the_definition_on_shuffled_rows(layers, experts, k, requests, tokens, prompt, batch, seed):
    rng = np.random.default_rng(seed)
    k = min(k, experts)
    model = small_model(layers=layers, experts=experts, top_k=k)
    ex = np.stack([rng.permutation(experts)[:k] for _ in range(requests * tokens * layers)])
    base = trace_from_array(model, ex.reshape(requests, tokens, layers, k), prompt_tokens=min(prompt, tokens - 1))
    t = with_weights(base, rng.random(ex.shape))
    shuffled = t.take(rng.permutation(len(t)))
    wl = build_workload(shuffled, batch_size=batch)
    want = reference(t, batch)
    n_l = layers
    got = []
    for b in range(len(wl.off) - 1):
        for i in range(int(wl.off[b]), int(wl.off[b + 1])):
            got.append((b // n_l, b % n_l, int(wl.acc_expert[i]), int(wl.acc_rank[i]), int(wl.acc_tokens[i]),
                        float(wl.acc_weight[i])))
            assert wl.acc_layer[i] == b % n_l
    assert got == want

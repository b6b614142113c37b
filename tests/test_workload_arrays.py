"""The workload's per-access arrays (``build_workload``: each (pass, layer)'s distinct experts
in order of first appearance, best rank, tokens routed, summed weight) against a hand-worked
example and an independent dictionary replay of the definition on generated traces, rows
given in shuffled order."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from moesim.simulator.workload import _ids_and_index, build_workload
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
        np.int32, np.int32, np.int16, np.int32, np.float64)
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


def pass_reference(trace: Trace, batch: int) -> tuple[list[int], list[int], list[int], dict[tuple[int, int], list[int]]]:
    """By the definition: per pass its requests (distinct) and tokens (distinct (request,
    position)), per request (ids in order) its first pass, and per (pass, layer) its rows in
    execution order (by request then position)."""
    req_ids = sorted(set(trace.request.tolist()))
    group_of = {r: i // batch for i, r in enumerate(req_ids)}
    rows = sorted(range(len(trace.request)), key=lambda i: (
        group_of[int(trace.request[i])], int(trace.step[i]), int(trace.layer[i]), int(trace.request[i]),
        int(trace.position[i])))
    passes: dict[tuple[int, int], int] = {}
    requests: dict[int, set] = {}
    tokens: dict[int, set] = {}
    first: dict[int, int] = {}
    by_layer: dict[tuple[int, int], list[int]] = {}
    for i in rows:
        r = int(trace.request[i])
        p = passes.setdefault((group_of[r], int(trace.step[i])), len(passes))
        requests.setdefault(p, set()).add(r)
        tokens.setdefault(p, set()).add((r, int(trace.position[i])))
        first[r] = min(first.get(r, p), p)
        by_layer.setdefault((p, int(trace.layer[i])), []).append(i)
    n = len(passes)
    return ([len(requests[p]) for p in range(n)], [len(tokens[p]) for p in range(n)],
            [first[r] for r in req_ids], by_layer)


@settings(max_examples=60, deadline=None)
@given(layers=st.integers(1, 3), experts=st.integers(2, 9), requests=st.integers(1, 4), tokens=st.integers(1, 5),
       prompt=st.integers(0, 3), batch=st.integers(1, 4), shuffle=st.booleans(), drop=st.floats(0, 0.6),
       seed=st.integers(0, 10_000))
def test_passes_requests_and_rows_equal_the_definition(layers, experts, requests, tokens, prompt, batch, shuffle,
                                                       drop, seed):
    """Each pass's requests and tokens, each request's first pass, and each (pass, layer)'s rows
    (``Workload.rows``, ``row_off``; a (pass, layer) with no rows has none, and ``off`` gives it
    no accesses), with rows in execution order as a file's piece has them or shuffled, and some
    rows dropped (a layer or a request missing from a pass)."""
    rng = np.random.default_rng(seed)
    model = small_model(layers=layers, experts=experts, top_k=1)
    ex = rng.integers(0, experts, size=(requests, tokens, layers, 1))
    t = trace_from_array(model, ex, prompt_tokens=min(prompt, tokens - 1))
    keep = rng.random(len(t)) >= drop
    keep[rng.integers(len(t))] = True
    t = t.take(np.flatnonzero(keep))
    perm = rng.permutation(len(t)) if shuffle else np.arange(len(t))
    wl = build_workload(t.take(perm), batch_size=batch)
    want_requests, want_tokens, want_first, want_rows = pass_reference(t, batch)
    assert wl.pass_requests.tolist() == want_requests
    assert wl.pass_tokens.tolist() == want_tokens
    assert wl.request_first_pass.tolist() == want_first
    assert wl.request_ids.tolist() == sorted(set(t.request.tolist()))
    assert wl.row_off is not None
    assert len(wl.row_off) == len(want_requests) * layers + 1
    for p in range(len(want_requests)):
        for layer in range(layers):
            got = perm[wl.rows(p, layer)].tolist()
            assert got == want_rows.get((p, layer), [])
            if not got:
                assert wl.off[p * layers + layer] == wl.off[p * layers + layer + 1]


@given(st.lists(st.integers(-3, 40), min_size=1, max_size=30), st.booleans())
def test_request_ids_and_index_equal_numpys_unique(ids, ordered):
    """``_ids_and_index`` gives ``np.unique(..., return_inverse=True)``'s ids and indices, with
    their types, for ids in order (found by runs) and not."""
    a = np.array(sorted(ids) if ordered else ids, np.int32)
    got_ids, got_index = _ids_and_index(a)
    want_ids, want_index = np.unique(a, return_inverse=True)
    assert got_ids.tolist() == want_ids.tolist()
    assert got_index.tolist() == want_index.tolist()
    assert (got_ids.dtype, got_index.dtype) == (want_ids.dtype, want_index.dtype)

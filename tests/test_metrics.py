"""Summary metrics on hand-made traces whose values are worked out by hand in each test
(issue 12): the arithmetic is written in the docstrings, the datasheet figures are the A100 +
PCIe 4.0 preset's (see tests/test_cost.py)."""

from __future__ import annotations

import numpy as np
import pytest

from moesim.simulator.engine import simulate
from tests.helpers import scenario, small_model, trace_from_array

HBM = 2039e9
LINK_EFF = 32e9 * 0.8
TINY_EXPERT = 3 * 256 * 512 * 2  # small_model's bf16 expert: 786,432 bytes
COPY = 10e-6 + (TINY_EXPERT + 65_536) / LINK_EFF  # 43.28 us
FFN = TINY_EXPERT / HBM + 5e-6
NONEXP = 529_408 / HBM + 20e-6  # one token at context 1 (tests/test_cost.py)


def test_hit_rate_counts_late_prefetches_as_accesses():
    """Two layers, top-1, oracle prefetch, unlimited cache, a 0.01 GB/s link (a copy takes
    about 0.1 s, far longer than a layer's compute). Pass 0: layer 0's expert misses (demand
    copy); the proposal for layer 1 is admitted and queued behind it, so it is still in flight
    at layer 1's routing point: a late prefetch. Pass 1 uses the same experts: two hits.
    hits 2, misses 1, late 1: hit_rate = 2 / (2 + 1 + 1) = 0.5."""
    model = small_model(layers=2, experts=4, top_k=1)
    t = trace_from_array(model, np.array([[[[0], [1]], [[0], [1]]]]))
    s = simulate(scenario(cache={"capacity": "inf"}, policies={"prefetch": "oracle"},
                          hardware={"links": {"pcie": {"bandwidth_gbps": 0.01}}}), trace=t).summary
    assert (s["hits"], s["misses"], s["late_prefetches"]) == (2, 1, 1)
    assert s["hit_rate"] == 0.5
    assert s["prefetches_issued"] == 1
    assert s["prefetches_used"] == 1


def test_tpot_shares_a_pass_among_its_requests():
    """Batch 2: request A decodes 3 tokens, request B 1 token (no prompts). Pass 0 carries a
    token of each, passes 1 and 2 only A's. A request's time per output token shares a pass's
    duration among the requests in it: tpot = (2 d0 + d1 + d2) / (2 + 1 + 1) — not the mean
    pass duration (d0 + d1 + d2) / 3, nor unweighted (d0 + d1 + d2) / 4."""
    model = small_model(layers=1, experts=8, top_k=2)
    a = trace_from_array(model, np.array([[[[0, 1]], [[2, 3]], [[4, 5]]]]))
    from moesim.traces.trace import Trace

    b_rows = a.take(a.step == 0)
    b_rows.request = np.full(len(b_rows), 1, dtype=np.int32)
    cols = {c: np.concatenate([getattr(a, c), getattr(b_rows, c)])
            for c in ("request", "step", "position", "phase", "layer", "experts", "weights")}
    t = Trace(model=model, **cols)
    res = simulate(scenario(cache={"capacity": "0 experts"}, workload={"batch_size": 2}), trace=t)
    d = res.steps["duration_s"].to_numpy()
    assert res.steps["requests"].tolist() == [2, 1, 1]
    assert res.summary["tpot_s"] == pytest.approx((2 * d[0] + d[1] + d[2]) / 4, rel=1e-12)
    assert res.summary["tokens_per_s"] == pytest.approx(4 / d.sum(), rel=1e-12)


def test_link_utilisation_and_cache_peak_by_hand():
    """One decode token, 2 layers, top-2, no cache (every expert fetched to staging): the
    link is busy 4 copies = 4 x 43.28 us out of the pass's 2 (non-expert + 2 copies + 2 FFN):
    utilisation 4 c / (2 (n + 2 c + 2 f)). Nothing is cached: peak 0 bytes. With room for 3
    experts the 4 distinct experts fill it: peak 3 x 786,432 bytes."""
    model = small_model(layers=2, experts=8, top_k=2)
    t = trace_from_array(model, np.array([[[[0, 1], [2, 3]]]]))
    s = simulate(scenario(cache={"capacity": "0 experts"}), trace=t).summary
    total = 2 * (NONEXP + 2 * COPY + 2 * FFN)
    assert s["total_time_s"] == pytest.approx(total, rel=1e-12)
    assert s["link_utilisation"]["pcie.h2d"] == pytest.approx(4 * COPY / total, rel=1e-12)
    assert s["cache_peak_bytes"] == 0
    s3 = simulate(scenario(cache={"capacity": "3 experts"}), trace=t).summary
    assert s3["cache_peak_bytes"] == 3 * TINY_EXPERT


def test_prefetch_precision_and_recall_have_their_own_denominators():
    """Batch 2, 2 layers, top-2, previous-token prefetch. Request A routes (layer 0, layer 1)
    to (0, 1), (2, 3) for both tokens; request B to (4, 5), (4, 5) then (4, 5), (2, 6). Pass 0
    has no previous pass: no proposals. Pass 1 at layer 0 proposes layer 1's experts of pass
    0: {2, 3, 4, 5}; layer 1 of pass 1 needs {2, 3, 6}; both share {2, 3}.
    precision = 2 / 4, recall = 2 / 3."""
    model = small_model(layers=2, experts=8, top_k=2)
    ex = np.array([[[[0, 1], [2, 3]], [[0, 1], [2, 3]]],
                   [[[4, 5], [4, 5]], [[4, 5], [2, 6]]]])
    t = trace_from_array(model, ex)
    s = simulate(scenario(timing=False, policies={"prefetch": "previous-token"}, workload={"batch_size": 2}),
                 trace=t).summary
    assert s["prefetch_precision"] == 0.5
    assert s["prefetch_recall"] == pytest.approx(2 / 3, rel=1e-15)


def test_fld_evicts_the_farthest_layer_first():
    """FLD at layer 1 of 4: distances |layer - 1| are 3 -> 2, 0 and 2 -> 1, 1 -> 0. Keys
    inserted in the order 2:0, 0:0, 1:0, 3:0 (LRU order): candidates 3:0 (farthest), then the
    distance-1 keys by recency, 2:0 then 0:0, then 1:0."""
    from moesim.policies.eviction import REGISTRY
    from moesim.policies.registry import Clock, PolicyContext

    clock = Clock()
    ctx = PolicyContext(num_layers=4, num_experts=4, top_k=1, expert_bytes=1, rng=np.random.default_rng(0),
                        clock=clock)
    fld = REGISTRY.get("fld")(REGISTRY.get("fld").Params(), ctx)
    for layer in (2, 0, 1, 3):
        fld.on_insert(ctx.key(layer, 0), True)
    clock.layer = 1
    assert list(fld.candidates()) == [ctx.key(3, 0), ctx.key(2, 0), ctx.key(0, 0), ctx.key(1, 0)]
    clock.layer = 3  # now layer 0 is farthest
    assert next(iter(fld.candidates())) == ctx.key(0, 0)


def test_a_cache_of_one_expert_evicts_rather_than_streams():
    """Room for exactly one expert, one layer, top-1, the stream a b a (three passes), LRU:
    a misses and is cached; b misses and evicts a (an expert the size of the whole cache still
    fits once the cache is emptied); a misses and evicts b. Misses 3, hits 0, no uncached
    fetch; the cache never holds more than one expert."""
    model = small_model(layers=1, experts=4, top_k=1)
    t = trace_from_array(model, np.array([[[[0]], [[1]], [[0]]]]))
    s = simulate(scenario(timing=False, cache={"capacity": "1 experts"}), trace=t).summary
    assert (s["hits"], s["misses"], s["uncached_fetches"]) == (0, 3, 0)
    assert s["cache_peak_bytes"] == TINY_EXPERT


def _nonexp(ctx: int) -> float:
    """A tiny 8-expert model's layer non-expert time at total context ``ctx`` (memory bound:
    the projections' 2 (4 H^2 + 8 H) = 528,384 bytes plus 4 H = 1,024 bytes of KV cache per context token)."""
    return (528_384 + 1_024 * ctx) / HBM + 20e-6


def test_speculative_verification_by_hand():
    """One request decodes 4 tokens (positions 0-3, no prompt), 1 layer, top-1, routes experts
    0, 1, 0, 1; no cache (every access copies to staging). Chains of 2 (tree_size 2) with
    accept_prob 1: two verification passes, positions (0, 1) and (2, 3), each verifying 2
    tokens and generating 2 (1 accepted draft + 1).
    - each verify pass: context (p + 1) summed, experts {0, 1}: v0 = nonexp(1 + 2) + 2 copy +
      2 FFN, v1 = nonexp(3 + 4) + 2 copy + 2 FFN;
    - autoregressive: a_p = nonexp(p + 1) + copy + FFN for p = 0..3;
    mean_accepted_tokens = 4 generated / 2 verification passes = 2; tokens_per_s = 4 / (v0 +
    v1); tpot = (v0 + v1) / 4 (one request per pass); speedup_vs_autoregressive = (4 / (v0 +
    v1)) / (4 / sum a_p)."""
    model = small_model(layers=1, experts=8, top_k=1)
    t = trace_from_array(model, np.array([[[[0]], [[1]], [[0]], [[1]]]]))
    spec = {"tree_size": 2, "accept_prob": 1.0}
    res = simulate(scenario(cache={"capacity": "0 experts"}, workload={"speculative": spec}), trace=t)
    v = [_nonexp(1 + 2) + 2 * COPY + 2 * FFN, _nonexp(3 + 4) + 2 * COPY + 2 * FFN]
    a = [_nonexp(p + 1) + COPY + FFN for p in range(4)]
    st, s = res.steps, res.summary
    assert st["phase"].tolist() == ["verify", "verify"]
    assert st["tokens"].tolist() == [2, 2]
    assert st["generated"].tolist() == [2, 2]
    assert st["duration_s"].to_numpy() == pytest.approx(v, rel=1e-12)
    assert s["mean_accepted_tokens"] == 2.0
    assert s["tokens_per_s"] == pytest.approx(4 / sum(v), rel=1e-12)
    assert s["tpot_s"] == pytest.approx(sum(v) / 4, rel=1e-12)
    assert s["speedup_vs_autoregressive"] == pytest.approx(sum(a) / sum(v), rel=1e-12)
    assert s["generated_tokens"] == 4
    assert s["unique_experts_per_layer"] == 2.0  # two distinct experts per verification pass


def test_speculative_batch_of_two_generates_what_each_request_accepted():
    """Batch 2, accept_prob 0 (every draft rejected): each verification pass checks a chain of
    3 tokens per request but generates 1 token per request. Request A has 2 decode tokens,
    B 1: passes (A: 2 tokens, B: 1 token) then (A: 1 token). Generated 2 then 1;
    mean_accepted_tokens = 3 generated / 3 (request, pass) pairs = 1; tpot shares each pass
    among its requests: (2 d0 + d1) / 3."""
    model = small_model(layers=1, experts=8, top_k=1)
    a = trace_from_array(model, np.array([[[[0]], [[1]]]]))
    from moesim.traces.trace import Trace

    b_rows = a.take(a.step == 0)
    b_rows.request = np.full(len(b_rows), 1, dtype=np.int32)
    cols = {c: np.concatenate([getattr(a, c), getattr(b_rows, c)])
            for c in ("request", "step", "position", "phase", "layer", "experts", "weights")}
    t = Trace(model=model, **cols)
    spec = {"tree_size": 3, "accept_prob": 0.0}
    res = simulate(scenario(cache={"capacity": "0 experts"}, workload={"batch_size": 2, "speculative": spec}),
                   trace=t)
    st, s = res.steps, res.summary
    assert st["tokens"].tolist() == [3, 1]  # A's positions 0, 1 + B's 0; then A's 1
    assert st["requests"].tolist() == [2, 1]
    assert st["generated"].tolist() == [2, 1]
    assert s["mean_accepted_tokens"] == 1.0
    d = st["duration_s"].to_numpy()
    assert s["tpot_s"] == pytest.approx((2 * d[0] + d[1]) / 3, rel=1e-12)
    assert s["tokens_per_s"] == pytest.approx(3 / d.sum(), rel=1e-12)

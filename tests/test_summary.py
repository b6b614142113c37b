"""summary.json: its exact key set (the documented metrics), and the counts, shapes and
conditional metrics worked out by hand on small traces (issue 12)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moesim.simulator.engine import simulate
from moesim.traces.schema import PHASES
from tests.helpers import scenario, small_model, trace_from_array
from tests.test_budget_hand import one_pass

# the metrics docs/design.md and README "Metrics" list, written out here
KEYS = {
    "hits", "misses", "late_prefetches", "hit_rate", "collision_misses", "uncached_fetches", "prefetches_issued",
    "prefetches_used", "prefetches_cancelled", "prefetch_precision", "prefetch_recall", "preloaded_experts",
    "low_precision_experts", "dropped_experts", "substituted_experts", "expert_accesses", "bytes_by_link", "stall_s",
    "ttft_s", "tpot_s", "tokens_per_s", "link_utilisation", "unique_experts_per_layer",
    "unique_experts_per_layer_prefill", "gate_mass_retained", "tokens_altered", "total_time_s", "gpus",
    "max_experts_per_gpu", "forward_passes", "tokens", "decode_tokens", "requests", "cache_capacity_bytes",
    "cache_capacity_experts", "cache_peak_bytes", "expert_bytes", "precision", "model", "hardware_source",
    "generated_tokens", "replay_path", "replay_path_reason", "trace_pieces",
}
TINY_EXPERT = 3 * 256 * 512 * 2  # 786,432 bytes


def prefill_decode_trace():
    """One request, 2 layers, top-2 of 8: a prefill of 2 tokens, then 2 decode tokens.
    Prefill: token 0 routes (0, 1) / (0, 1), token 1 (1, 2) / (2, 3): distinct experts per
    layer 3 and 4. Decode: (0, 1) / (4, 5), then (6, 7) / (0, 1): 2 per layer."""
    model = small_model(layers=2, experts=8, top_k=2)
    ex = np.array([[[[0, 1], [0, 1]], [[1, 2], [2, 3]], [[0, 1], [4, 5]], [[6, 7], [0, 1]]]])
    return trace_from_array(model, ex, prompt_tokens=2)


def test_the_summary_has_exactly_the_documented_metrics():
    s = simulate(scenario(cache={"capacity": "5 experts"}), trace=prefill_decode_trace()).summary
    assert set(s) == KEYS


def test_the_readme_lists_exactly_the_steps_columns():
    """The metrics page's ``steps.parquet`` paragraph names every column of the per-pass table,
    in order."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "concepts" / "metrics.md").read_text()
    start = text.index("`steps.parquet` has one row per forward pass")
    para = text[start:text.index("Summaries are derived", start)]
    names = [n.strip() for part in re.findall(r"`([^`]*)`", para)[1:] for n in part.split(",") if n.strip()]
    steps = simulate(scenario(cache={"capacity": "5 experts"}), trace=prefill_decode_trace()).steps
    assert names == list(steps.columns)


def test_counts_shapes_and_time_metrics_by_hand():
    """3 passes (prefill of 2 tokens, then 2 decode passes), 4 tokens, 2 decode tokens, 1
    request; generated: 1 (the prefill's first token) + 2. Distinct experts per layer: 3.5
    in the prefill ((3 + 4) / 2 layers), 2.0 in decode ((2 + 2 + 2 + 2) / (2 passes x 2
    layers)). TTFT = the prefill pass's end; TPOT = (d1 + d2) / 2; tokens/s = 2 / (d1 + d2).
    Capacity 5 experts = 5 x 786,432 bytes. A single GPU: max_experts_per_gpu is null."""
    res = simulate(scenario(cache={"capacity": "5 experts"}), trace=prefill_decode_trace())
    s, d = res.summary, res.steps["duration_s"].to_numpy()
    assert (s["forward_passes"], s["tokens"], s["decode_tokens"], s["requests"], s["generated_tokens"]) == (3, 4, 2, 1, 3)
    assert s["unique_experts_per_layer_prefill"] == 3.5
    assert s["unique_experts_per_layer"] == 2.0
    assert s["ttft_s"] == pytest.approx(d[0], rel=1e-12)
    assert s["tpot_s"] == pytest.approx((d[1] + d[2]) / 2, rel=1e-12)
    assert s["tokens_per_s"] == pytest.approx(2 / (d[1] + d[2]), rel=1e-12)
    assert s["total_time_s"] == pytest.approx(d.sum(), rel=1e-12)
    assert s["cache_capacity_bytes"] == 5 * TINY_EXPERT
    assert s["cache_capacity_experts"] == 5.0
    assert (s["expert_bytes"], s["precision"], s["model"], s["gpus"]) == (TINY_EXPERT, "bf16", "tiny", 1)
    assert s["hardware_source"] == "datasheet"
    assert s["max_experts_per_gpu"] is None
    assert s["bytes_by_link"] == {"pcie.h2d": int(res.steps["bytes_h2d"].sum())}  # no all-to-all on one GPU
    assert s["expert_accesses"] == s["hits"] + s["misses"] + s["late_prefetches"] == 2 * 2 * 3 + 2 + 1
    assert "warning" not in s


def test_without_decode_passes_throughput_is_all_tokens_over_all_time():
    """Two one-token prefills in one pass (batch 2): no decode or verify pass, so tokens/s is
    all tokens / total time = 2 / d0, TPOT and the decode-only metrics are null."""
    t = one_pass([[0, 1], [2, 3]], [[0.5, 0.5], [0.5, 0.5]])
    res = simulate(scenario(workload={"batch_size": 2}), trace=t)
    s = res.summary
    assert s["tokens_per_s"] == pytest.approx(2 / res.steps["duration_s"].iloc[0], rel=1e-12)
    assert s["tpot_s"] is None
    assert s["decode_tokens"] == 0
    assert s["unique_experts_per_layer"] is None
    assert s["unique_experts_per_layer_prefill"] == 4.0


def test_a_single_decode_token_still_counts_as_decode_throughput():
    """A prefill of one token, then one decode token: tokens/s = 1 / d1, TPOT = d1."""
    model = small_model(layers=1, experts=8, top_k=2)
    res = simulate(scenario(), trace=trace_from_array(model, np.array([[[[0, 1]], [[2, 3]]]]), prompt_tokens=1))
    d = res.steps["duration_s"].to_numpy()
    assert res.summary["tokens_per_s"] == pytest.approx(1 / d[1], rel=1e-12)
    assert res.summary["tpot_s"] == pytest.approx(d[1], rel=1e-12)


def test_an_unlimited_cache_has_no_capacity_figures():
    s = simulate(scenario(cache={"capacity": "inf"}), trace=prefill_decode_trace()).summary
    assert s["cache_capacity_bytes"] is None
    assert s["cache_capacity_experts"] is None


def test_cache_only_replay_has_no_time_metrics():
    s = simulate(scenario(timing=False, cache={"capacity": "5 experts"}), trace=prefill_decode_trace()).summary
    for key in ("stall_s", "ttft_s", "tpot_s", "tokens_per_s", "total_time_s"):
        assert s[key] is None, key
    assert s["link_utilisation"] == {"pcie.h2d": None}
    assert s["misses"] == 15  # the same decisions: every access of this trace misses at 5 experts


def test_a_cache_larger_than_the_gpu_warns_and_one_equal_to_it_does_not():
    """Mixtral-8x7B: 32 layers x 8 experts x 3 x 4096 x 14336 x 2 bytes = 90,194,313,216
    bytes. 100% of them on an 80 GB A100: "cache capacity 90.2 GB exceeds the GPU's 80 GB of
    HBM". A cache of exactly 80 GB fits."""
    from moesim.traces.synth import synth_from_preset

    t = synth_from_preset("mixtral-8x7b", tokens=2, seed=0)
    s = simulate(scenario(timing=False, cache={"capacity": "100%"}), trace=t).summary
    assert s["warning"] == "cache capacity 90.2 GB exceeds the GPU's 80 GB of HBM"
    s = simulate(scenario(timing=False, cache={"capacity": "80GB"}), trace=t).summary
    assert "warning" not in s
    s = simulate(scenario(timing=False, cache={"capacity": "80.00000004GB"}), trace=t).summary
    assert s["warning"] == "cache capacity 80.0 GB exceeds the GPU's 80 GB of HBM"  # 40 bytes over


def test_gate_mass_retained_and_tokens_altered_by_hand():
    """Dynamic skipping, beta 0.5, two tokens of top-2: (0.75, 0.25) skips its second expert
    (0.25 < 0.375), (0.5, 0.5) keeps both. Mass kept (0.75 + 1.0) / 2.0 = 0.875; one of two
    tokens altered: 0.5."""
    t = one_pass([[0, 1], [2, 3]], [[0.75, 0.25], [0.5, 0.5]])
    s = simulate(scenario(workload={"batch_size": 2}, policies={"budget": {"name": "dynamic-skip", "beta": 0.5}}),
                 trace=t).summary
    assert s["gate_mass_retained"] == pytest.approx(0.875, rel=1e-12)
    assert s["tokens_altered"] == 0.5


def test_the_requests_table_and_ttft_by_hand():
    """Two requests replayed one at a time (batch 1): request A's prompt of 2 tokens, one
    decode token, then request B's prompt of 1 token, one decode token (passes 0-3). The
    per-request table: ids, batch groups 0 and 1, first passes 0 and 2 (each prefill), and
    TTFT from the start of the request's batch to the end of its first pass: A's pass 0 ends
    at d0; B's batch starts at d0 + d1 and its prefill ends at d0 + d1 + d2, so TTFT d2. The
    summary's ttft_s is their mean. Integer per-pass counts are int64 columns. Found
    missing by mutation testing of engine.py (the table had no test; with one batch every
    TTFT starts at 0)."""
    model = small_model(layers=2, experts=8, top_k=2)
    ex = np.array([[[[0, 1], [2, 3]], [[0, 1], [4, 5]], [[6, 7], [0, 1]]],
                   [[[2, 3], [4, 5]], [[0, 1], [2, 3]], [[0, 1], [2, 3]]]])
    t = trace_from_array(model, ex, prompt_tokens=2)
    keep = ~((t.request == 1) & (t.position == 0))  # B's prompt is one token: its position 1 only
    t = t.take(keep)
    res = simulate(scenario(cache={"capacity": "5 experts"}), trace=t)
    d = res.steps["duration_s"].to_numpy()
    assert res.steps["phase"].tolist() == ["prefill", "decode", "prefill", "decode"]
    req = res.requests
    assert list(req.columns) == ["request", "group", "first_pass", "ttft_s", "first_phase"]
    assert req["request"].tolist() == [0, 1]
    assert req["group"].tolist() == [0, 1]
    assert req["first_pass"].tolist() == [0, 2]
    assert req["first_phase"].tolist() == ["prefill", "prefill"]
    assert req["ttft_s"].tolist() == pytest.approx([d[0], d[2]], rel=1e-12)
    assert res.summary["ttft_s"] == pytest.approx((d[0] + d[2]) / 2, rel=1e-12)
    assert res.summary["preloaded_experts"] == 0  # no static pins
    for col in ("hits", "misses", "late_prefetches", "bytes_h2d", "unique_experts", "tokens_altered"):
        assert res.steps[col].dtype == np.int64, col


def test_a_request_that_joins_its_batch_after_its_first_pass_by_hand():
    """A batch of two: request A's prompt of 2 tokens then one decode token; request B has no
    prompt rows and decodes one token beside A's. Pass 0 is A's prefill, pass 1 both decodes.
    B's first pass is pass 1, a decode, and its TTFT runs from its batch's start (pass 0's) to
    pass 1's end: d0 + d1. Found missing by mutation testing (a request's own first pass start,
    or the first pass's phase of the block, passed every test where requests begin with their
    batch)."""
    model = small_model(layers=2, experts=8, top_k=2)
    ex = np.array([[[[0, 1], [2, 3]], [[0, 1], [4, 5]], [[6, 7], [0, 1]]],
                   [[[2, 3], [4, 5]], [[0, 1], [2, 3]], [[0, 1], [2, 3]]]])
    t = trace_from_array(model, ex, prompt_tokens=2)
    t = t.take(~((t.request == 1) & (t.position < 2)))  # B: its decode token alone
    res = simulate(scenario(cache={"capacity": "5 experts"}, workload={"batch_size": 2}), trace=t)
    assert res.steps["phase"].tolist() == ["prefill", "decode"]
    assert res.steps["requests"].tolist() == [1, 2]
    d = res.steps["duration_s"].to_numpy()
    req = res.requests
    assert req["group"].tolist() == [0, 0]
    assert req["first_pass"].tolist() == [0, 1]
    assert req["first_phase"].tolist() == ["prefill", "decode"]
    assert req["ttft_s"].tolist() == pytest.approx([d[0], d[0] + d[1]], rel=1e-12)


def test_pass_totals_by_hand_however_the_rows_are_cut() -> None:
    """Six passes (prefill, three decodes, two verifies) worked out by hand, taken whole and
    cut into blocks of 2, 0, 3 and 1 passes (the decodes and the verifies each in two blocks): the same totals either
    way."""
    from moesim.simulator.metrics import PassTotals

    steps = {k: np.asarray(v) for k, v in {
        "phase": [0, 1, 1, 1, 2, 2],  # codes into PHASES: prefill, decode, verify
        "hits": [1, 2, 3, 4, 5, 6], "misses": [10, 0, 1, 0, 2, 0], "tokens": [7, 1, 1, 1, 3, 3],
        "generated": [1, 1, 1, 1, 2, 3], "requests": [1, 1, 1, 1, 1, 2],
        "unique_experts": [9, 4, 5, 6, 7, 8],
        "end_s": [0.5, 0.75, 1.0, 1.25, 2.0, 1.5],  # the last pass is not the latest to end
        "duration_s": [0.5, 0.25, 0.25, 0.25, 0.75, 0.5],
        "stall_s": [0.125, 0.0, 0.25, 0.0, 0.5, 0.0],
        "gate_weight_total": [2.0, 1.0, 1.0, 1.0, 3.0, 3.0],
        "gate_weight_computed": [2.0, 0.5, 1.0, 1.0, 3.0, 2.5],
        "max_experts_per_gpu": [0.0, 2.0, 4.0, 3.0, 5.0, 6.0],
        **{k: [0] * 6 for k in ("late_prefetches", "collision_misses", "uncached_fetches", "prefetches_issued",
                                "prefetches_used", "prefetches_cancelled", "prefetch_predicted_hits",
                                "prefetch_predicted", "prefetch_actual", "low_precision_experts",
                                "dropped_experts", "substituted_experts", "bytes_h2d", "bytes_ep",
                                "tokens_altered")},
    }.items()}
    assert PHASES == ("prefill", "decode", "verify")
    whole, cut = PassTotals(), PassTotals()
    whole.add(steps)
    for lo, hi in ((0, 2), (2, 2), (2, 5), (5, 6)):  # an empty block among them
        cut.add({k: v[lo:hi] for k, v in steps.items()})
    for t in (whole, cut):
        assert t.passes == 6
        assert t.sums["hits"] == 21
        assert t.sums["misses"] == 13
        assert t.sums["tokens"] == 16
        assert t.sums["generated"] == 9
        assert t.count == {"decode_like": 5, "prefill": 1, "decode": 3, "verify": 2}
        assert t.unique == {"decode_like": 30, "prefill": 9}
        assert t.decode_tokens == 3
        assert t.decode_like_generated == 8
        assert t.verify_generated == 5
        assert t.verify_requests == 3
        assert t.end_s == 2.0
        assert t.total("stall_s") == 0.875
        assert t.total("gate_weight_total") == 11.0
        assert t.total("gate_weight_computed") == 10.0
        assert t.total("dec_duration") == 2.0
        assert t.total("dec_request_time") == 2.5  # 0.25 x 3 + 0.75 x 1 + 0.5 x 2
        assert t.mean("dec_max_experts_per_gpu") == 4.0  # (2 + 4 + 3 + 5 + 6) / 5


# doubles of every kind the exact sum must carry: subnormal, tiny, huge, negative, zero
_DOUBLES = st.floats(allow_nan=False, allow_infinity=False, min_value=-1e300, max_value=1e300)


@settings(max_examples=300, deadline=None)
@given(values=st.lists(_DOUBLES, max_size=60), cuts=st.lists(st.integers(0, 60), max_size=6))
def test_the_exact_sum_is_fsums_however_the_values_are_cut(values, cuts) -> None:
    """:class:`ExactSum` fed the values in blocks cut anywhere gives :func:`math.fsum` over all
    of them (the correctly rounded exact sum), and its count."""
    from moesim.simulator.metrics import ExactSum

    acc = ExactSum()
    edges = sorted({0, len(values), *(c for c in cuts if c <= len(values))})
    for lo, hi in itertools.pairwise(edges):
        acc.add(np.array(values[lo:hi], dtype=np.float64))
    assert acc.value == math.fsum(values)
    assert acc.count == len(values)


def test_the_exact_sum_by_hand() -> None:
    """Cases worked out by hand: 0.1 + 0.2 + 0.3, whose float64 terms sum exactly to
    0.6000000000000000055511151231257827 (rounded: 0.6, where adding them left to right gives
    0.6000000000000001); 1e16 + 1 + 1 (exactly 10000000000000002, where left to right loses
    both ones); the smallest subnormal twice (2 * 2**-1074); cancellations; a tie; and an
    infinity and a NaN, which make the sum theirs."""
    from moesim.simulator.metrics import ExactSum

    def exact(*blocks: list[float]) -> float:
        acc = ExactSum()
        for b in blocks:
            acc.add(np.array(b, dtype=np.float64))
        return acc.value

    assert 0.1 + 0.2 + 0.3 == 0.6000000000000001
    assert exact([0.1], [0.2, 0.3]) == 0.6
    assert exact([1e16], [1.0], [1.0]) == 1e16 + 2
    assert exact([5e-324], [5e-324]) == 1e-323
    assert exact([1e300, 1.0], [-1e300]) == 1.0
    assert exact([1.5, -1.5]) == 0.0
    # a tie goes to the even neighbour: 1 + 2**-53 is halfway between 1 and 1 + 2**-52
    assert exact([1.0], [2.0 ** -53]) == 1.0
    # cancellation inside one exponent of one block: the significands' high parts (2**26 and
    # above) sum to 0 with low parts left, or to 1 with none left
    assert exact([1 + 2.0 ** -52, -1.0]) == 2.0 ** -52
    assert exact([1 + 5 * 2.0 ** -52, -1.0]) == 5 * 2.0 ** -52
    assert exact([1 + 2.0 ** -26, -1.0]) == 2.0 ** -26
    assert exact([]) == 0.0
    assert exact([1.0], [np.inf]) == np.inf
    assert np.isnan(exact([np.inf], [1.0], [-np.inf]))
    assert np.isnan(exact([np.nan, 1.0]))


def test_the_exact_sum_carries_more_than_a_slice_at_one_exponent(monkeypatch) -> None:
    """Values of one exponent with all 53 significand bits set, in a block longer than the
    slice the per-exponent float64 totals are taken over (made 4 here): their sum is exact
    only if the slices are carried into the integer, and equals n times the value."""
    from moesim.simulator import metrics

    monkeypatch.setattr(metrics.ExactSum, "_SLICE", 4)
    v = 1.0 - 2.0 ** -53  # 0.11...1 in binary, 53 ones
    acc = metrics.ExactSum()
    acc.add(np.full(11, v))
    assert acc.value == math.fsum([v] * 11) == 11 - 11 * 2.0 ** -53

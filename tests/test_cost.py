"""The cost model against datasheet arithmetic written out here (issue 12): the expected
times come from the A100-80G + PCIe 4.0 preset's figures (2,039 GB/s HBM, 312 TFLOPS bf16,
20 us per layer and 5 us per expert launch; 32 GB/s per direction, 10 us latency, 80%
efficiency, half of it at 64 KiB), never from ``CostModel`` or ``copy_time`` themselves."""

from __future__ import annotations

import numpy as np
import pytest

from moesim.simulator.cost import CostModel
from moesim.simulator.engine import simulate
from tests.helpers import scenario, small_model, trace_from_array

HBM = 2039e9  # bytes/s
PEAK = 312e12  # FLOP/s
LAYER_US, EXPERT_US = 20e-6, 5e-6
LINK, LAT, EFF, HALF = 32e9, 10e-6, 0.8, 64 * 1024

# OLMoE-1B-7B: H = 2048, I = 1024 -> one bf16 expert is 3 * 2048 * 1024 * 2 = 12,582,912 bytes
OLMOE_EXPERT = 12_582_912


def test_a_copy_is_latency_plus_bytes_over_the_effective_bandwidth():
    """copy(n) = 10 us + n / (32 GB/s * 0.8 * n / (n + 64 KiB)) = 10 us + (n + 65,536) / 25.6e9:
    an OLMoE expert takes 10 us + 12,648,448 / 25.6e9 s = 10 + 494.08 = 504.08 us; 64 KiB take
    10 us + 131,072 / 25.6e9 s = 15.12 us (half the efficiency)."""
    sc = scenario()
    link = sc.hardware.h2d
    assert link.copy_time(OLMOE_EXPERT) == pytest.approx(504.08e-6, rel=1e-12)
    assert link.copy_time(HALF) == pytest.approx(15.12e-6, rel=1e-12)


@pytest.mark.parametrize(("tokens", "expected"), [
    (1, OLMOE_EXPERT / HBM + EXPERT_US),  # memory-bound: 6.1711 us + 5 us
    (153, OLMOE_EXPERT / HBM + EXPERT_US),  # just below the ridge: 312e12 / 2039e9 = 153.02 tokens
    (154, 6 * 2048 * 1024 * 154 / PEAK + EXPERT_US),  # compute-bound from there
    (10_000, 6 * 2048 * 1024 * 10_000 / PEAK + EXPERT_US),  # 403.3 us + 5 us
])
def test_expert_time_is_the_roofline_of_the_datasheet(tokens, expected):
    """An expert FFN reads its 3*H*I bf16 weights (6*H*I bytes) and does 6*H*I FLOPs per token,
    so it is memory-bound below peak / HBM = 153.02 tokens and compute-bound above."""
    from moesim.traces.synth import PRESETS

    model = PRESETS["olmoe-1b-7b"].model
    assert model.expert_bytes["bf16"] == OLMOE_EXPERT
    cost = CostModel(scenario().hardware, model, OLMOE_EXPERT)
    assert float(cost.expert_time(np.array([tokens]))[0]) == pytest.approx(expected, rel=1e-12)
    assert cost.expert_time_at(tokens, OLMOE_EXPERT) == pytest.approx(expected, rel=1e-12)
    # a 4-bit copy reads a quarter of the bytes
    assert cost.expert_time_at(1, OLMOE_EXPERT // 4) == pytest.approx(OLMOE_EXPERT / 4 / HBM + EXPERT_US, rel=1e-12)


def test_nonexpert_time_reads_the_projections_and_the_kv_cache():
    """Tiny model: H = 256, 8 experts, 2 heads of 128 (H / 128), as many KV heads. Weights
    q + k + v + o + router = 256*256 + 2*256*256 + 256*256 + 256*8 = 264,192; bf16 bytes
    528,384, plus the KV cache 2 (k and v) * 256 * 2 bytes = 1,024 bytes per context token.
    One token at context 1: 529,408 bytes / 2039e9 = 259.64 ns (its 529,408 FLOPs take 1.7 ns)
    plus the 20 us layer launch. A prefill of 4,096 tokens has context 1 + 2 + ... + 4,096 =
    8,390,656: FLOPs 2*264,192*4,096 + 4*256*8,390,656 and bytes 528,384 + 1,024*8,390,656."""
    model = small_model(experts=8)
    cost = CostModel(scenario().hardware, model, model.expert_bytes["bf16"])
    one = float(cost.nonexpert_time(np.array([1]), np.array([1]))[0])
    assert one == pytest.approx(529_408 / HBM + LAYER_US, rel=1e-12)
    ctx = 4096 * 4097 // 2
    big = float(cost.nonexpert_time(np.array([4096]), np.array([ctx]))[0])
    flops = 2 * 264_192 * 4096 + 4 * 256 * ctx
    nbytes = 528_384 + 1024 * ctx
    assert big == pytest.approx(max(nbytes / HBM, flops / PEAK) + LAYER_US, rel=1e-12)


def test_a_pass_with_no_cache_is_nonexpert_plus_copy_plus_compute_per_layer():
    """One decode token, 2 layers, top-2, no cache: each layer is non-expert + two copies
    (serialised on the one copy engine) + two expert FFNs of one token each. Tiny model
    experts: 3*256*512*2 = 786,432 bytes; copy = 10 us + (786,432 + 65,536) / 25.6e9 =
    43.28 us; FFN = 786,432 / 2039e9 + 5 us; non-expert at context 1 as above."""
    model = small_model(layers=2, experts=8, top_k=2)
    t = trace_from_array(model, np.array([[[[0, 1], [2, 3]]]]))
    res = simulate(scenario(cache={"capacity": "0 experts"}), trace=t)
    copy = LAT + (786_432 + HALF) / (LINK * EFF)
    assert copy == pytest.approx(43.28e-6, rel=1e-12)
    ffn = 786_432 / HBM + EXPERT_US
    nonexp = 529_408 / HBM + LAYER_US
    assert res.steps["duration_s"].iloc[0] == pytest.approx(2 * (nonexp + 2 * copy + 2 * ffn), rel=1e-12)
    assert res.summary["stall_s"] == pytest.approx(4 * copy, rel=1e-12)

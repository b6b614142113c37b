"""The calibration executor in SpecMD's style (``moesim.calibration.hf_loop``, issue 37): NF4
against an independent NumPy reference, the throttled link's windows by hand, the router
output made from the trace's counts by hand (the executor on the CPU:
``tests/test_hf_loop_executor.py``)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from moesim.calibration import hf_loop  # noqa: E402
from moesim.calibration.hf_loop import (  # noqa: E402
    NF4,
    NF4_BLOCK,
    HfLoopPool,
    Link,
    nf4_dequantise,
    nf4_quantise,
)


def numpy_nf4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """NF4 written from its definition (QLoRA §3, bitsandbytes' layout): per block of 64 the
    absmax, each weight's nearest of the 16 code values after dividing by it, two codes a
    byte (the first high); the dequantised weights are code value x absmax."""
    table = np.array(NF4, dtype=np.float64)
    blocks = w.astype(np.float64).reshape(-1, 64)
    absmax = np.abs(blocks).max(axis=1)
    codes = np.abs(blocks[:, :, None] / absmax[:, None, None] - table).argmin(axis=2).reshape(-1)
    packed = (codes[0::2] * 16 + codes[1::2]).astype(np.uint8)
    return packed, absmax, (table[codes].reshape(-1, 64) * absmax[:, None]).reshape(-1)


def test_nf4_matches_a_numpy_reference_and_its_error_bound():
    w = torch.randn(64 * 40, generator=torch.Generator().manual_seed(3))
    packed, absmax = nf4_quantise(torch, w)
    ref_packed, ref_absmax, ref_deq = numpy_nf4(w.numpy())
    assert NF4_BLOCK == 64
    np.testing.assert_array_equal(packed.numpy(), ref_packed)
    np.testing.assert_allclose(absmax.numpy(), ref_absmax, rtol=1e-7)
    deq = nf4_dequantise(torch, packed, absmax, torch.tensor(NF4), torch.float32)
    np.testing.assert_allclose(deq.numpy(), ref_deq, rtol=1e-6, atol=1e-7)
    gap = np.diff(np.array(NF4)).max() / 2  # a weight is at most half the widest gap from its code
    assert (np.abs(deq.numpy() - w.numpy()) <= gap * np.repeat(ref_absmax, 64) + 1e-6).all()
    assert len(packed) == len(w) // 2  # 4 bits a weight


def test_the_link_carries_copies_one_after_another_each_for_its_window(monkeypatch):
    """Copies of 1 ms issued at 0, 0.5 and 5 ms: the first crosses by 1, the second waits for
    it (2), the third finds the link idle (6)."""
    now = [0.0]
    monkeypatch.setattr(hf_loop.time, "perf_counter", lambda: now[0])
    link = Link()
    assert link.reserve(1e-3) == pytest.approx(1e-3)
    now[0] = 0.5e-3
    assert link.reserve(1e-3) == pytest.approx(2e-3)
    now[0] = 5e-3
    assert link.reserve(1e-3) == pytest.approx(6e-3)
    assert link.copies == 3


def test_a_wait_ends_at_its_window_not_before():
    import time

    link = Link()
    end = link.reserve(2e-3)
    link.wait(end)
    assert time.perf_counter() >= end
    assert 0.0 <= link.late < 0.05


def test_the_router_output_gives_each_expert_the_trace_s_count_of_tokens():
    """Three tokens, top-2 of 4 experts, the trace routing 3 tokens to expert 0, 2 to expert 2
    and 1 to expert 3: the six choices 0 0 0 2 2 3 go out choice by choice, token by token:
    token 0 takes 0 and 2, token 1 takes 0 and 2, token 2 takes 0 and 3. With one choice
    fewer the last is the skip index (4)."""
    pool = HfLoopPool.__new__(HfLoopPool)
    pool.p_num, pool.top_k, pool.num_layers = 1, 2, 1
    pool.router = torch.zeros(8, 4)
    pool.pass_tokens = np.array([3, 3])
    pool.counts = {0: {0: 3, 2: 2, 3: 1}, 1: {0: 3, 2: 2}}
    assert pool.top_k_index(0, 0) == [[0, 2], [0, 2], [0, 3]]
    assert pool.top_k_index(1, 0) == [[0, 2], [0, 2], [0, 4]]


def test_the_router_output_reads_its_layer_s_counts_and_each_key_s_expert():
    """Two layers, two precisions a key (key = (layer * 4 + expert) * 2 + precision): pass 1,
    layer 1 is the fourth (pass, layer) and its keys 13 and 11 are experts 2 and 1 of layer 1
    (at 8-bit and 16-bit); the trace routes 2 tokens to 13 and 1 to 11."""
    pool = HfLoopPool.__new__(HfLoopPool)
    pool.p_num, pool.top_k, pool.num_layers = 2, 2, 2
    pool.router = torch.zeros(8, 4)
    pool.pass_tokens = np.array([2, 2])
    pool.counts = {0: {0: 2}, 1: {8: 2}, 2: {2: 1}, 3: {13: 2, 11: 1}}
    assert pool.top_k_index(1, 1) == [[1, 2], [2, 4]]
    assert pool.top_k_index(0, 1) == [[0, 4], [0, 4]]

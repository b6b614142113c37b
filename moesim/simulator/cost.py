"""Roofline cost model (``docs/design.md``: "Hardware and cost model").

Each kernel takes ``max(bytes / HBM bandwidth, FLOPs / peak) + launch overhead``:

- non-expert part of a layer for a pass of ``n`` tokens whose attention contexts sum to
  ``c``: weights ``W = H*(heads*hd) + 2*H*(kv*hd) + (heads*hd)*H + H*N`` (q, k, v, o
  projections and the router) plus shared experts ``3*H*I_s`` each; bytes
  ``2*W + 2*(kv*hd)*2*c`` (bf16 weights and the KV cache read); FLOPs ``2*W*n + 4*(heads*hd)*c``;
- one expert FFN with ``n`` tokens routed: bytes = the expert's bytes at the scenario's
  precision, FLOPs ``6*H*I*n`` (gate, up and down projections).

Copy times come from the link model in :mod:`simulator.hardware`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from moesim.config.hardware import HardwareConfig
from moesim.traces.schema import ModelInfo

BF16 = 2


def _bf16_first(tables: dict[str, dict[str, dict]] | None) -> list[dict]:
    """A profile's time tables (shape -> dtype -> table), each shape's bf16 table before its
    others: the weights the scenarios and the calibration executor use are bf16."""
    return [tab for by_dtype in (tables or {}).values()
            for _, tab in sorted(by_dtype.items(), key=lambda kv: kv[0] != "bfloat16")]


class CostModel:
    """Compute times from hardware peak figures (roofline)."""

    def __init__(self, hardware: HardwareConfig, model: ModelInfo, expert_bytes: int,
                 dequant: bool = False) -> None:
        self.hw = hardware
        self.dequant = dequant
        self.model = model
        self.expert_bytes = expert_bytes
        self.hbm = hardware.gpu.hbm_bandwidth_gbps * 1e9
        self.peak = hardware.gpu.peak_tflops * 1e12
        h = model.hidden_size
        q = model.heads * model.head_size
        kv = model.kv_heads * model.head_size
        self.kv_width = kv
        self.q_width = q
        shared = 3 * h * model.shared_expert_intermediate_size * model.shared_experts
        self.nonexpert_weights = h * q + 2 * h * kv + q * h + h * model.num_experts + shared
        self.expert_flops_per_token = 6 * h * model.expert_intermediate_size
        self._table = self._measured()
        self._time_at: dict[tuple[int, int], float] = {}
        self._dense = None
        for tab in _bf16_first(hardware.nonexpert_table):
            if tab.get("hidden") == model.hidden_size:
                self._dense = (np.log(np.asarray(tab["tokens"], float)), np.log(np.asarray(tab["seconds"], float)))
                break

    @staticmethod
    def _interp(tab: tuple[np.ndarray, np.ndarray], tokens: np.ndarray) -> np.ndarray:
        lt, ls = tab
        x = np.log(np.maximum(tokens, 1.0))
        y = np.interp(x, lt, ls)
        if len(lt) > 1:  # extrapolate with the end slopes (log-log)
            y = np.where(x < lt[0], ls[0] + (ls[1] - ls[0]) / (lt[1] - lt[0]) * (x - lt[0]), y)
            y = np.where(x > lt[-1], ls[-1] + (ls[-1] - ls[-2]) / (lt[-1] - lt[-2]) * (x - lt[-1]), y)
        return np.asarray(np.exp(y))

    def nonexpert_time(self, tokens: np.ndarray, context: np.ndarray) -> np.ndarray:
        """Seconds of the non-expert part of one layer, per pass: the profile's measured
        projection + router table when it has this hidden size (plus the KV-cache read), else
        roofline."""
        tokens = np.asarray(tokens, dtype=np.float64)
        context = np.asarray(context, dtype=np.float64)
        if self._dense is not None:
            kv = 2 * self.kv_width * BF16 * context / self.hbm
            return self._interp(self._dense, tokens) + kv + self.hw.layer_overhead_us * 1e-6
        nbytes = BF16 * self.nonexpert_weights + 2 * self.kv_width * BF16 * context
        flops = 2 * self.nonexpert_weights * tokens + 4 * self.q_width * context
        return np.maximum(nbytes / self.hbm, flops / self.peak) + self.hw.layer_overhead_us * 1e-6

    def _measured(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The profile's expert-time table for this model's (hidden, intermediate) shape."""
        for tab in _bf16_first(self.hw.expert_table):
            if (tab.get("hidden"), tab.get("intermediate")) == (self.model.hidden_size,
                                                                 self.model.expert_intermediate_size):
                return np.log(np.asarray(tab["tokens"], float)), np.log(np.asarray(tab["seconds"], float))
        return None

    def expert_time(self, tokens: np.ndarray) -> np.ndarray:
        """Seconds of one expert FFN with ``tokens`` tokens routed to it: the calibration
        profile's table (log-log interpolation) when it has this model's shape, else roofline."""
        tokens = np.asarray(tokens, dtype=np.float64)
        if self._table is not None:
            return self._interp(self._table, tokens) + self.hw.expert_overhead_us * 1e-6 + self.dequant_time(
                self.expert_bytes)
        return (np.maximum(self.expert_bytes / self.hbm, self.expert_flops_per_token * tokens / self.peak)
                + self.hw.expert_overhead_us * 1e-6 + self.dequant_time(self.expert_bytes))

    def dequant_time(self, nbytes: int) -> float:
        """Seconds to dequantise one expert stored in ``nbytes`` to bf16 before its matmuls (an
        execution style's ``dequant``; 0 at 16 bits and more): HBM roofline of reading the
        quantised weights and writing bf16 ones, ``(nbytes + 2 * params) / HBM bandwidth``."""
        bf16 = self.expert_flops_per_token  # 2 bytes for each of the 3 * H * I parameters: 6 * H * I
        if not self.dequant or nbytes >= bf16:
            return 0.0
        return (nbytes + bf16) / self.hbm

    def expert_time_at(self, tokens: int, nbytes: int) -> float:
        """Seconds of one expert FFN with ``tokens`` tokens, its weights ``nbytes`` bytes: at
        the scenario's precision :meth:`expert_time` (the profile's table when it has one),
        at another precision the roofline."""
        seconds = self._time_at.get((tokens, nbytes))
        if seconds is None:  # made once per (tokens, size): the per-token lookup path asks often
            if nbytes == self.expert_bytes:
                seconds = float(self.expert_time(np.array([tokens]))[0])
            else:
                seconds = (max(nbytes / self.hbm, self.expert_flops_per_token * tokens / self.peak)
                           + self.hw.expert_overhead_us * 1e-6 + self.dequant_time(nbytes))
            self._time_at[(tokens, nbytes)] = seconds
        return seconds

    def copy_time(self, nbytes: float) -> float:
        """Seconds to copy ``nbytes`` host-to-device (no queueing)."""
        return self.hw.h2d.copy_time(nbytes)


class PassCosts:
    """The per-pass costs of one workload ``wl`` that both replay paths read: the
    attention-context and expert-time factors of sparse verification
    (``sparse-verification-speculative-decoding.txt`` Table 1: attention context and expert
    down projections are thinned in verification passes; 1 elsewhere; ``speculative`` is
    the scenario's ``workload.speculative``), the expert compute table and each pass's
    non-expert seconds, all zero in cache-only replay (``timing`` False)."""

    def __init__(self, cost: CostModel, wl: Any, timing: bool, speculative: Any) -> None:
        from moesim.simulator.workload import VERIFY

        self.cost, self.wl, self.timing = cost, wl, timing
        is_verify = wl.pass_phase == VERIFY
        spec = speculative
        self.attn_scale = np.where(is_verify, 1.0 - (spec.sparse_attention if spec else 0.0), 1.0)
        self.ffn_scale = np.where(is_verify, 1.0 - (spec.sparse_ffn if spec else 0.0) / 3.0, 1.0)

    def ffn_table(self, at_least: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Expert compute seconds by the number of tokens routed (index 0 unused; up to the
        most any access has, or ``at_least``) and the per-pass factor: an access's compute
        time is ``table[tokens] * factor[pass]`` on both replay paths."""
        n = max(int(self.wl.acc_tokens.max()), at_least)  # a workload has an access (no empty trace)
        table = np.zeros(n + 1)
        if self.timing:
            table[1:] = self.cost.expert_time(np.arange(1, n + 1))
        return table, self.ffn_scale

    def nonexpert_times(self) -> np.ndarray:
        """Non-expert (attention, gate) seconds of every pass."""
        wl = self.wl
        if self.timing:
            return self.cost.nonexpert_time(wl.pass_tokens, wl.pass_context * self.attn_scale)
        return np.zeros(wl.num_passes)

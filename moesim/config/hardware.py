"""Hardware description and presets.

Presets are built from public datasheet figures (marked ``source: datasheet``) until a
calibration profile replaces them. Bandwidths are in GB/s (1e9 bytes per second) per
direction, HBM capacity in GB (1e9 bytes), peak compute in dense bf16 TFLOPS.

A link copies ``n`` bytes in ``latency + n / (bandwidth * efficiency(n))`` seconds where
``efficiency(n) = efficiency * n / (n + half_efficiency_bytes)``: large copies reach
``efficiency`` of the nominal bandwidth, a copy of ``half_efficiency_bytes`` reaches half of
that. One copy engine per direction per link serialises its transfers.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from typing import Any

from moesim.errors import MoesimError, did_you_mean


@dataclass(frozen=True)
class LinkConfig:
    """A point-to-point link (PCIe, NVLink-C2C, NVLink)."""

    bandwidth_gbps: float = field(metadata={"help": "nominal bandwidth per direction, GB/s"})
    latency_us: float = field(default=10.0, metadata={"help": "fixed cost of one copy, microseconds"})
    efficiency: float = field(default=1.0, metadata={
        "help": "fraction of the nominal bandwidth that large copies reach (0..1]"})
    half_efficiency_bytes: float = field(default=0.0, metadata={
        "help": "copy size that reaches half of 'efficiency' (0: size-independent)"})

    def __post_init__(self) -> None:
        if not self.bandwidth_gbps > 0:
            raise ValueError(f"bandwidth_gbps must be > 0 GB/s, got {self.bandwidth_gbps}")
        if not self.latency_us >= 0:
            raise ValueError(f"latency_us must be >= 0, got {self.latency_us}")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"efficiency must be in (0, 1], got {self.efficiency}")
        if not self.half_efficiency_bytes >= 0:
            raise ValueError(f"half_efficiency_bytes must be >= 0, got {self.half_efficiency_bytes}")

    def copy_time(self, nbytes: float) -> float:
        """Seconds to copy ``nbytes`` over this link (one copy engine, no queueing)."""
        eff = self.efficiency
        if self.half_efficiency_bytes:
            eff *= nbytes / (nbytes + self.half_efficiency_bytes)
        return self.latency_us * 1e-6 + nbytes / (self.bandwidth_gbps * 1e9 * eff)


@dataclass(frozen=True)
class GpuConfig:
    """The GPU: HBM capacity and bandwidth, dense bf16 peak."""

    name: str = field(default="gpu", metadata={"help": "device name"})
    memory_gb: float = field(default=80.0, metadata={"help": "HBM capacity, GB"})
    hbm_bandwidth_gbps: float = field(default=2000.0, metadata={"help": "HBM bandwidth, GB/s"})
    peak_tflops: float = field(default=312.0, metadata={"help": "dense bf16 tensor peak, TFLOPS"})

    def __post_init__(self) -> None:
        for key in ("memory_gb", "hbm_bandwidth_gbps", "peak_tflops"):
            if not getattr(self, key) > 0:
                raise ValueError(f"gpu.{key} must be > 0, got {getattr(self, key)}")


@dataclass(frozen=True)
class HostCosts:
    """What the host thread that feeds the GPU spends per CUDA call, microseconds (the
    execution styles of :mod:`moesim.config.execution` add them up). The defaults were measured
    on the host of the H100 VM (``validation/h100/host-calls/2026-11-22/host_overhead.csv``, torch 2.11,
    CUDA 13.0, 2026-11-22); ``moesim calibrate measure`` on a GPU records this machine's and a
    profile's ``host`` section replaces them."""

    graph_launch_us: float = field(default=9.07, metadata={"help": "replay one CUDA graph, microseconds"})
    eager_kernel_us: float = field(default=13.344, metadata={
        "help": "launch one kernel from eager PyTorch (an FFN's 5 kernels took 66.72 us), microseconds"})
    copy_submit_us: float = field(default=7.34, metadata={
        "help": "submit one host-to-device copy from pinned memory, microseconds"})
    event_record_us: float = field(default=7.28, metadata={"help": "make and record one CUDA event, microseconds"})
    stream_wait_us: float = field(default=10.94, metadata={
        "help": "switch to another stream and make it wait for an event, microseconds"})
    event_wait_us: float = field(default=5.62, metadata={
        "help": "make the current stream wait for an event, microseconds"})
    eager_layer_us: float | None = field(default=None, metadata={
        "help": "the calibration executor's host time for a layer's start and non-expert part launched eagerly, "
                "its Python included, microseconds (unset: 5 eager kernels)"})
    eager_expert_us: float | None = field(default=None, metadata={
        "help": "the calibration executor's host time for one cached expert launched eagerly (its hit and run "
                "decisions, its Python included), microseconds (unset: 5 eager kernels)"})

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) is None and f.default is None:
                continue
            if not getattr(self, f.name) >= 0:
                raise ValueError(f"host.{f.name} must be >= 0 microseconds, got {getattr(self, f.name)}")


@dataclass(frozen=True)
class HardwareConfig:
    """One GPU with host memory behind a host link; optional extra links."""

    preset: str | None = field(default=None, metadata={"help": "preset the values start from"})
    source: str = field(default="datasheet", metadata={
        "help": "where the numbers come from: datasheet, or a calibration profile"})
    gpu: GpuConfig = field(default_factory=GpuConfig, metadata={"help": "the GPU"})
    host_memory_gb: float = field(default=512.0, metadata={"help": "host memory holding all experts, GB"})
    host_link: str = field(default="pcie", metadata={"help": "name of the host-to-device link in 'links'"})
    links: dict[str, LinkConfig] = field(default_factory=dict, metadata={"help": "links by name"})
    layer_overhead_us: float = field(default=20.0, metadata={
        "help": "fixed non-expert cost per layer (kernel launches, routing), microseconds"})
    expert_overhead_us: float = field(default=5.0, metadata={
        "help": "fixed cost per expert FFN launch, microseconds"})
    host: HostCosts = field(default_factory=HostCosts, metadata={
        "help": "host-side cost of CUDA calls (execution styles add them up)"})
    gpus: int = field(default=1, metadata={
        "help": "GPUs; > 1 means expert parallelism: experts placed across GPUs, all resident"})
    placement: str = field(default="contiguous", metadata={
        "help": "expert placement: contiguous, round-robin, or a YAML/JSON file layer -> [GPU per expert]"})
    ep_link: str = field(default="nvlink", metadata={"help": "link carrying the all-to-all (expert parallelism)"})
    profile: str | None = field(default=None, metadata={
        "help": "a calibration profile (`moesim calibrate fit`): its link fit and compute tables replace the datasheet"})
    expert_table: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "measured expert FFN times by shape and dtype (filled from the profile)", "internal": True})
    nonexpert_table: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "measured non-expert (projection + router) times by shape and dtype (filled from the profile)",
        "internal": True})

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise ValueError(f"gpus must be >= 1, got {self.gpus}")
        if self.gpus > 1 and self.ep_link not in self.links:
            raise ValueError(f"ep_link '{self.ep_link}' is not among links ({', '.join(self.links)})")
        if self.host_link not in self.links:
            raise ValueError(f"host_link '{self.host_link}' is not among links ({', '.join(self.links) or 'none'})")
        for key in ("host_memory_gb",):
            if not getattr(self, key) > 0:
                raise ValueError(f"{key} must be > 0, got {getattr(self, key)}")
        for key in ("layer_overhead_us", "expert_overhead_us"):
            if not getattr(self, key) >= 0:
                raise ValueError(f"{key} must be >= 0, got {getattr(self, key)}")

    @property
    def h2d(self) -> LinkConfig:
        """The host-to-device link."""
        return self.links[self.host_link]


def _pcie(gen: int) -> dict[str, Any]:
    # x16 nominal per direction: PCIe 4.0 32 GB/s, PCIe 5.0 64 GB/s; pinned copies reach ~80%.
    return {"bandwidth_gbps": 32.0 if gen == 4 else 64.0, "latency_us": 10.0, "efficiency": 0.8,
            "half_efficiency_bytes": 64 * 1024}


# Datasheet figures (NVIDIA product briefs); latency and efficiency are typical values, not
# measurements: replace them with `moesim calibrate` profiles.
PRESETS: dict[str, dict[str, Any]] = {
    "a100-80g-pcie4": {
        "gpu": {"name": "A100-80GB", "memory_gb": 80, "hbm_bandwidth_gbps": 2039, "peak_tflops": 312},
        "host_memory_gb": 512, "host_link": "pcie", "links": {"pcie": _pcie(4)},
    },
    "h100-sxm-pcie5": {
        "gpu": {"name": "H100-SXM5-80GB", "memory_gb": 80, "hbm_bandwidth_gbps": 3350, "peak_tflops": 989},
        "host_memory_gb": 1024, "host_link": "pcie", "links": {"pcie": _pcie(5)},
    },
    "gh200-c2c": {
        # NVLink-C2C: 900 GB/s total, 450 GB/s per direction.
        "gpu": {"name": "GH200-96GB", "memory_gb": 96, "hbm_bandwidth_gbps": 4000, "peak_tflops": 989},
        "host_memory_gb": 480, "host_link": "c2c",
        "links": {"c2c": {"bandwidth_gbps": 450.0, "latency_us": 5.0, "efficiency": 0.9,
                          "half_efficiency_bytes": 64 * 1024}},
    },
    "rtx4090-pcie4": {
        "gpu": {"name": "RTX-4090", "memory_gb": 24, "hbm_bandwidth_gbps": 1008, "peak_tflops": 165},
        "host_memory_gb": 128, "host_link": "pcie", "links": {"pcie": _pcie(4)},
    },
    # NVLink 4: 900 GB/s per GPU in total, 450 GB/s per direction.
    **{f"h100-sxm-nvlink-x{g}": {
        "gpu": {"name": "H100-SXM5-80GB", "memory_gb": 80, "hbm_bandwidth_gbps": 3350, "peak_tflops": 989},
        "host_memory_gb": 1024, "host_link": "pcie", "gpus": g,
        "links": {"pcie": _pcie(5), "nvlink": {"bandwidth_gbps": 450.0, "latency_us": 5.0, "efficiency": 0.9,
                                              "half_efficiency_bytes": 16 * 1024}},
    } for g in (2, 4, 8)},
    "a6000-pcie4": {
        "gpu": {"name": "RTX-A6000", "memory_gb": 48, "hbm_bandwidth_gbps": 768, "peak_tflops": 155},
        "host_memory_gb": 128, "host_link": "pcie", "links": {"pcie": _pcie(4)},
    },
}


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` merged into a copy of ``base`` (nested mappings merged key by key)."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def expand_preset(data: dict[str, Any], where: str, base_dir: str = ".") -> dict[str, Any]:
    """Hardware mapping with its ``preset`` expanded and the other keys merged over it; a
    ``profile`` replaces the host link and the compute model with measured figures."""
    from pathlib import Path

    data = dict(data)
    prof_path = data.get("profile")
    if prof_path is not None:
        from moesim.config.profile import load_profile

        p = Path(str(prof_path))
        if not p.is_absolute() and (Path(base_dir) / p).is_file():
            p = Path(base_dir) / p
        prof = load_profile(str(p), where)
        link = prof["links"].get("h2d_pinned") or prof["links"]["h2d_pageable"]
        host = data.get("host_link", "pcie")
        measured: dict[str, Any] = {
            "source": f"profile {p} ({(prof.get('measured_on') or {}).get('device_name', '')})",
            "links": {host: {"bandwidth_gbps": link["bandwidth_gbps"], "latency_us": link["latency_us"],
                             "efficiency": 1.0, "half_efficiency_bytes": 0.0}},
            "expert_table": prof.get("expert_time") or {},
            "nonexpert_table": prof.get("nonexpert_time") or {},
        }
        if prof.get("host"):
            measured["host"] = dict(prof["host"])
        if prof.get("launch_overhead_us") is not None:
            measured["expert_overhead_us"] = 0.0  # the measured FFN times include their launches
        if prof.get("nonexpert_time"):
            measured["layer_overhead_us"] = 0.0
        data["profile"] = str(p)
        name = data.get("preset")
        base = PRESETS.get(str(name), {}) if name is not None else {"host_link": host, "links": {}}
        return deep_merge(deep_merge(base, {k: v for k, v in data.items() if k != "links"} | measured),
                          {"links": data.get("links", {})})
    name = data.get("preset")
    if name is None:
        return data
    if name not in PRESETS:
        raise MoesimError(f"{where}: key 'hardware.preset' is '{name}'{did_you_mean(str(name), list(PRESETS))}; "
                          f"valid presets: {', '.join(PRESETS)}.")
    return deep_merge(PRESETS[name], data)

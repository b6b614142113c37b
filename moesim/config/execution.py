"""Execution styles: how the host thread of a serving stack feeds the GPU (``docs/concepts/execution.md``,
"The host thread").

The simulator's compute stream and copy engine model the GPU; a style adds the host thread
that issues their work. It is one of a few named presets, each a sum of the measured host
costs of CUDA calls (``hardware.host``, :class:`moesim.config.hardware.HostCosts`) over the
calls that stack makes:

- ``none`` (default): no host model; the GPU never waits for the host.
- ``graph-layer`` and ``graph-per-expert``: moesim's own calibration executor
  (``moesim calibrate validate``, :mod:`moesim.calibration.validate`) in ``layer`` and
  ``per-expert`` execution: each layer's non-expert part and each expert launch is a CUDA
  graph replay; a demand copy goes out on its own stream (two events made and recorded, a
  stream switch and wait, the copy, and the compute stream's wait for it). Its host never
  waits for the GPU inside a pass (it replays decisions it already has).
- ``eager-per-expert``: the same executor with its kernels launched eagerly
  (``calibrate validate --launch eager``): a layer's non-expert part is 5 kernels (four
  projections and the router), an expert 5 (gate, up, SiLU, product, down), each costing
  ``eager_kernel_us``, or, where the profile measured them (``calibrate measure`` since issue
  37's H100 run), the executor's own host time for a layer's non-expert part
  (``eager_layer_us``) and a cached expert (``eager_expert_us``: its hit and run decisions,
  Python included); demand copies as above. Measured on an H200 (``validation/h200/``), the
  per-expert CUDA graphs waiting on the demand-copy stream cost up to 150 us an expert that eager
  launches do not, so this is the executor the per-expert validation runs.
- ``hf-loop``: a Hugging Face-style per-expert Python loop with blocking fetches (SpecMD,
  ``speculating-experts-prefetch.txt`` appendix A.2: "fetch blocks until the expert loads
  from CPU") and bitsandbytes-quantised experts. Its kernels are launched eagerly. Counted in
  transformers 5.24's ``modeling_olmoe.py``: a decoder layer outside its experts launches 60
  kernels (four RMSNorms of 8 kernels each in bf16: the layer's two and the q and k norms; the
  q, k, v and o projections; rotary embedding 10; KV-cache update 2; attention 1; two residual
  adds; router linear, softmax, top-k and cast 4; the expert mask 5: zeros, one-hot, sum,
  greater, nonzero); each routed
  expert 10 (the ``expert_idx == num_experts`` test, ``torch.where``, the token gather, two
  linears, SiLU, the gate product, the weight gather and product, ``index_add_``), two of which
  (the test and ``torch.where``) make the host wait for the GPU: the host synchronises before
  each expert. 4- and 8-bit experts are dequantised before their matmuls.
- ``fused-moe``: a vLLM-like fused MoE kernel, one launch for a layer's experts, the
  non-expert part a CUDA graph; copies submitted from pinned memory; no host waits.

Prefetch copies handed to the copy engine (``execution.prefetch_depth``): a prefetch the
prefetch queue admits is a copy the host thread issues to the copy engine, and a copy issued
cannot be recalled. Where the target layer's routing point finds an admitted copy the layer does
not need, only one still waiting on the host is withdrawn. ``all`` (every style but the
executor's): each admitted copy is issued at once, as SpecMD's watchdog thread issues a
non-blocking transfer when space allows (``specmd-expert-caching-least-stale.txt``, appendix
A.3), so none is withdrawn. The calibration executor's main thread keeps
:data:`PREFETCH_DEPTH` copies issued at a time (counting one still copying) and holds the rest;
its copy worker (``calibrate validate --prefetch-from worker``) issues one at a time (depth 1).

Every knob can be set directly (``execution.host_layer_us`` and the rest) over the style's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from moesim.config.hardware import HostCosts

STYLES = ("none", "graph-layer", "graph-per-expert", "eager-per-expert", "hf-loop", "fused-moe")
HF_LAYER_KERNELS = 60  # a transformers 5.24 OLMoE decoder layer outside its experts (module docstring)
HF_EXPERT_KERNELS = 10  # one routed expert of its loop
EAGER_LAYER_KERNELS = 5  # the calibration executor's non-expert part: q, k, v, o projections and the router
EAGER_EXPERT_KERNELS = 5  # its expert FFN: x @ gate, x @ up, SiLU, the product, @ down
PREFETCH_DEPTH = 2  # prefetch copies the calibration executor's main thread keeps issued (module docstring)


@dataclass(frozen=True)
class ExecutionConfig:
    """The ``execution`` key: a style and, optionally, any of its knobs set directly."""

    style: Literal["none", "graph-layer", "graph-per-expert", "eager-per-expert", "hf-loop", "fused-moe"] = field(
        default="none", metadata={"help": "how the host feeds the GPU: " + ", ".join(STYLES)})
    host_layer_us: float | None = field(default=None, metadata={
        "help": "host time to issue one layer's non-expert part, microseconds (default: the style's)"})
    host_launch_us: float | None = field(default=None, metadata={
        "help": "host time to issue one expert launch (per expert in per-expert and on-arrival "
                "execution, one per layer in layer execution), microseconds (default: the style's)"})
    host_copy_us: float | None = field(default=None, metadata={
        "help": "host time to submit one demand copy, microseconds (default: the style's)"})
    host_sync: Literal["none", "layer", "expert"] | None = field(default=None, metadata={
        "help": "where the host waits for the GPU besides the pass's end: none, layer (at each routing "
                "point), expert (also before each expert) (default: the style's)"})
    dequant: bool | None = field(default=None, metadata={
        "help": "4- and 8-bit experts are dequantised before their matmuls (default: the style's)"})
    prefetch_depth: int | Literal["all"] | None = field(default=None, metadata={
        "help": "admitted prefetch copies issued to the copy engine at a time, counting one still "
                "copying; the rest wait on the host, where the target layer may withdraw them: "
                "all (every copy issued when admitted; none withdrawn) or a number >= 1 "
                f"(default: the style's: {PREFETCH_DEPTH} in the calibration executor's, else all)"})

    def __post_init__(self) -> None:
        for key in ("host_layer_us", "host_launch_us", "host_copy_us"):
            value = getattr(self, key)
            if value is not None and not value >= 0:
                raise ValueError(f"{key} must be >= 0 microseconds, got {value}")
        depth = self.prefetch_depth
        if isinstance(depth, int) and depth < 1:
            raise ValueError(f"prefetch_depth must be 'all' or a number of copies >= 1, got {depth}")


@dataclass(frozen=True)
class HostModel:
    """A style resolved against the hardware's host costs: what the replay reads."""

    layer_us: float = 0.0
    launch_us: float = 0.0
    copy_us: float = 0.0
    sync: Literal["none", "layer", "expert"] = "none"
    dequant: bool = False
    prefetch_depth: int | None = None  # admitted prefetch copies issued at a time; None: all

    @property
    def active(self) -> bool:
        """Whether the host can ever make the GPU wait (else the replay skips the host)."""
        return self.layer_us > 0 or self.launch_us > 0 or self.copy_us > 0 or self.sync != "none"


def style_defaults(style: str) -> dict[str, str]:
    """The top-level keys a style sets unless the scenario sets them."""
    return {"graph-per-expert": {"expert_compute": "per-expert", "expert_fetch": "pipelined"},
            "eager-per-expert": {"expert_compute": "per-expert", "expert_fetch": "pipelined"},
            "hf-loop": {"expert_compute": "per-expert", "expert_fetch": "blocking"},
            "graph-layer": {"expert_compute": "layer"},
            "fused-moe": {"expert_compute": "layer"}}.get(style, {})


def style_costs(style: str, host: HostCosts) -> HostModel:
    """A style's host costs, summed from the measured per-call costs (module docstring)."""
    demand_copy = 2 * host.event_record_us + host.stream_wait_us + host.copy_submit_us + host.event_wait_us
    if style in ("graph-layer", "graph-per-expert"):
        return HostModel(layer_us=host.graph_launch_us, launch_us=host.graph_launch_us, copy_us=demand_copy,
                         prefetch_depth=PREFETCH_DEPTH)
    if style == "eager-per-expert":
        layer, expert = host.eager_layer_us, host.eager_expert_us
        return HostModel(layer_us=EAGER_LAYER_KERNELS * host.eager_kernel_us if layer is None else layer,
                         launch_us=EAGER_EXPERT_KERNELS * host.eager_kernel_us if expert is None else expert,
                         copy_us=demand_copy, prefetch_depth=PREFETCH_DEPTH)
    if style == "hf-loop":
        return HostModel(layer_us=HF_LAYER_KERNELS * host.eager_kernel_us,
                         launch_us=HF_EXPERT_KERNELS * host.eager_kernel_us,
                         copy_us=host.copy_submit_us, sync="expert", dequant=True)
    if style == "fused-moe":
        return HostModel(layer_us=host.graph_launch_us, launch_us=host.graph_launch_us,
                         copy_us=host.copy_submit_us)
    return HostModel()


def resolve_host(execution: ExecutionConfig, host: HostCosts) -> HostModel:
    """The style's costs with the knobs the scenario sets over them."""
    base = style_costs(execution.style, host)

    def pick(value: Any, default: Any) -> Any:
        return default if value is None else value

    return HostModel(layer_us=float(pick(execution.host_layer_us, base.layer_us)),
                     launch_us=float(pick(execution.host_launch_us, base.launch_us)),
                     copy_us=float(pick(execution.host_copy_us, base.copy_us)),
                     sync=pick(execution.host_sync, base.sync),
                     dequant=bool(pick(execution.dequant, base.dequant)),
                     prefetch_depth=depth_value(pick(execution.prefetch_depth, base.prefetch_depth)))


def depth_value(depth: int | str | None) -> int | None:
    """``execution.prefetch_depth`` as the replay reads it: a number of copies, or None for all."""
    return None if depth is None or depth == "all" else int(depth)


def depth_key(depth: int | None) -> int | str:
    """The replay's prefetch depth as ``execution.prefetch_depth`` writes it (None: ``all``)."""
    return "all" if depth is None else depth

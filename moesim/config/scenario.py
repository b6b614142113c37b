"""Scenario YAML -> typed, frozen config objects, in this one place.

Keys (``docs/design.md``: "Scenario YAML")::

    seed: 0
    timing: true                   # false: cache-only replay (hit/miss decisions, no timeline)
    expert_compute: layer          # or on-arrival (each expert as soon as it arrives) or per-expert
                                   # (one at a time in router order, a Hugging Face-style loop)
    expert_fetch: pipelined        # per-expert only: expert j+1 looked up when j starts (its copy
                                   # overlaps j's compute), or blocking (looked up when j ends)
    execution: {style: none}       # the host thread feeding the GPU: none, graph-layer,
                                   # graph-per-expert, hf-loop or fused-moe (config/execution.py)
    hardware: {preset: a100-80g-pcie4, links: {pcie: {bandwidth_gbps: 5}}}
    workload:
      trace: {synth: {preset: olmoe-1b-7b, tokens: 2000}}   # or {path: trace.parquet}
      batch_size: 1
      arrivals: {process: poisson, rate: 4, requests: 500}   # serving under load (optional)
    scheduler: {max_running: 64, max_batched_tokens: 4096, policy: vllm-v1}
    slo: {ttft_s: 0.5, tpot_s: 0.1}
    cache: {capacity: 5%, precision: bf16}
    policies: {eviction: lru, miss: fetch, prefetch: none, routing: standard, budget: none}

Unknown keys and unknown policy names are errors naming the file, the key path and the valid
choices. ``--set dotted.key=value`` overrides any key (values parsed as YAML).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from moesim.config.confload import ConfigError, build, to_plain
from moesim.config.execution import (
    ExecutionConfig,
    HostModel,
    depth_key,
    resolve_host,
    style_defaults,
)
from moesim.config.hardware import HardwareConfig, expand_preset
from moesim.errors import MoesimError
from moesim.files import read_yaml as read_yaml_file
from moesim.policies import families


@dataclass(frozen=True)
class SynthSource:
    """An in-process synthetic trace (``moesim trace synth`` with the same options)."""

    preset: str | None = field(default=None, metadata={"help": "model preset (olmoe-1b-7b, mixtral-8x7b, ...)"})
    fit: str | None = field(default=None, metadata={
        "help": "a fitted profile instead of a preset (file from `moesim trace fit`, or a shipped name)"})
    requests: int = field(default=1, metadata={"help": "number of requests"})
    prompt_tokens: int = field(default=0, metadata={"help": "prefill tokens per request (0: none)"})
    tokens: int = field(default=2000, metadata={"help": "decode tokens per request"})
    seed: int | None = field(default=None, metadata={"help": "trace seed (default: scenario seed)"})
    routing: Literal["realistic", "uniform"] = field(default="realistic", metadata={"help": "routing model"})
    layers: int | None = field(default=None, metadata={"help": "override the preset's layer count"})
    experts: int | None = field(default=None, metadata={"help": "override experts per layer"})
    top_k: int | None = field(default=None, metadata={"help": "override top-k"})
    probs: bool = field(default=False, metadata={"help": "record full router probabilities"})
    pred_next: bool = field(default=False, metadata={
        "help": "record a predictor of the next layer's router probabilities (for prefetch)"})
    pred_noise: float = field(default=1.0, metadata={
        "help": "noise (logit std) of that predictor: 0 = perfect"})

    def __post_init__(self) -> None:
        from moesim.errors import did_you_mean
        from moesim.traces.synth import PRESETS

        if (self.preset is None) == (self.fit is None):
            raise ValueError("give exactly one of 'preset' and 'fit'")
        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(f"preset '{self.preset}'{did_you_mean(self.preset, list(PRESETS))} is not a "
                             f"synthetic preset; valid presets: {', '.join(PRESETS)}")
        for key in ("requests", "layers", "experts", "top_k"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"{key} must be >= 1, got {value}")
        for key in ("prompt_tokens", "tokens"):
            if getattr(self, key) < 0:
                raise ValueError(f"{key} must be >= 0, got {getattr(self, key)}")


@dataclass(frozen=True)
class ImportSource:
    """A routing log converted in-process (``moesim trace import`` with the same options)."""

    format: str = field(metadata={"help": "import format, e.g. expert-jsonl"})
    path: str = field(metadata={"help": "file or folder (relative to the scenario file)"})
    model_preset: str | None = field(default=None, metadata={
        "help": "synthetic preset giving the model shapes the log lacks"})


@dataclass(frozen=True)
class TraceSource:
    """Where the workload's trace comes from: exactly one of ``synth``, ``path``, ``import``."""

    synth: SynthSource | None = field(default=None, metadata={"help": "synthetic trace options"})
    path: str | None = field(default=None, metadata={"help": "a v1 Parquet trace (relative to the scenario file)"})
    import_: ImportSource | None = field(default=None, metadata={
        "help": "a routing log imported in-process (YAML key: import)", "yaml": "import"})

    def __post_init__(self) -> None:
        if sum(x is not None for x in (self.synth, self.path, self.import_)) != 1:
            raise ValueError("give exactly one of 'synth', 'path' and 'import'")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative verification built from a decode trace (``docs/concepts/speculative.md``)."""

    tree_size: int = field(metadata={
        "help": "tokens verified per request per pass (a chain of s draft tokens: s + 1; an EAGLE tree: M)"})
    depth: int | None = field(default=None, metadata={
        "help": "longest acceptable draft path (default: tree_size - 1, a chain)"})
    accept_prob: float = field(default=0.7, metadata={
        "help": "each draft token on the path is accepted with this probability, until the first rejection"})
    sparse_attention: float = field(default=0.0, metadata={
        "help": "s_a (sparse verification §3, Table 1): share of KV blocks a verification pass skips"})
    sparse_ffn: float = field(default=0.0, metadata={
        "help": "s_f: share of the experts' down-projection channels a verification pass prunes"})

    def __post_init__(self) -> None:
        if not 1 <= self.tree_size <= 1024:
            raise ValueError(f"tree_size must be in 1..1024, got {self.tree_size}")
        if self.depth is not None and not 0 <= self.depth < self.tree_size:
            raise ValueError(f"depth must be in 0..tree_size-1, got {self.depth}")
        if not 0 <= self.accept_prob <= 1:
            raise ValueError(f"accept_prob must be in [0, 1], got {self.accept_prob}")
        for key in ("sparse_attention", "sparse_ffn"):
            if not 0 <= getattr(self, key) < 1:
                raise ValueError(f"{key} must be in [0, 1), got {getattr(self, key)}")


ARRIVAL_PROCESSES = ("poisson", "gamma", "file")


@dataclass(frozen=True)
class ArrivalsConfig:
    """Requests arriving over time (``docs/guides/serving.md``): a Poisson or gamma process at
    ``rate``, or the timestamps and lengths of a serving-trace CSV."""

    process: Literal["poisson", "gamma", "file"] = field(metadata={
        "help": "poisson, gamma (bursty: cv) or file (a CSV of arrival time, input and output tokens)"})
    rate: float | None = field(default=None, metadata={
        "help": "requests per second (poisson, gamma; with a file: its timestamps rescaled to this mean rate)"})
    cv: float = field(default=1.0, metadata={"help": "gamma: coefficient of variation of the gaps (1: Poisson)"})
    requests: int | None = field(default=None, metadata={
        "help": "how many requests (poisson, gamma: required; file: the first N rows)"})
    path: str | None = field(default=None, metadata={"help": "file: the CSV (relative to the scenario file)"})
    prompt_tokens: int | None = field(default=None, metadata={
        "help": "every request's prompt length (default: the file's, else the trace request's)"})
    output_tokens: int | None = field(default=None, metadata={
        "help": "every request's output length (default: the file's, else the trace request's)"})
    skip_zero_output: bool = field(default=True, metadata={
        "help": "file: skip rows of 0 output tokens (failed requests, as BurstGPT records them), saying how many; "
                "false refuses them"})
    seed: int | None = field(default=None, metadata={"help": "arrival seed (default: the scenario's)"})

    def __post_init__(self) -> None:
        if self.process == "file":
            if self.path is None:
                raise ValueError("process 'file' needs 'path' (a CSV of arrival time, input and output tokens)")
        else:
            if self.path is not None:
                raise ValueError(f"'path' is for process 'file', not '{self.process}'; remove it or set process: file")
            if self.rate is None:
                raise ValueError(f"process '{self.process}' needs 'rate' (requests per second, e.g. rate: 4)")
            if self.requests is None:
                raise ValueError(f"process '{self.process}' needs 'requests' (how many, e.g. requests: 1000)")
        if self.rate is not None and not (0 < self.rate < float("inf")):
            raise ValueError(f"rate must be a positive number of requests per second, got {self.rate}")
        if not (0 < self.cv < float("inf")):
            raise ValueError(f"cv must be positive (1: Poisson, above 1: burstier), got {self.cv}")
        if self.cv != 1.0 and self.process != "gamma":
            raise ValueError(f"cv is for process 'gamma', not '{self.process}'")
        if self.requests is not None and self.requests < 1:
            raise ValueError(f"requests must be >= 1, got {self.requests}")
        if self.prompt_tokens is not None and self.prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be >= 0, got {self.prompt_tokens}")
        if self.output_tokens is not None and self.output_tokens < 1:
            raise ValueError(f"output_tokens must be >= 1 (the first token is the prefill's), got {self.output_tokens}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching (``docs/guides/serving.md``), scheduled as vLLM's V1 engine does
    (``vllm-v1``), its V0 engine without chunked prefill (``vllm-v0``) or Sarathi-Serve
    (``sarathi``); KV cache in blocks allocated as tokens are made, preempted by recompute."""

    max_running: int = field(default=256, metadata={"help": "requests admitted at once (vLLM max_num_seqs)"})
    max_batched_tokens: int = field(default=8192, metadata={
        "help": "tokens in one forward pass (vLLM max_num_batched_tokens)"})
    policy: Literal["vllm-v1", "vllm-v0", "sarathi"] = field(default="vllm-v1", metadata={
        "help": "vllm-v1 (running requests first, a decode token or the rest of a prompt each, then waiting ones, "
                "in one token budget), vllm-v0 (a pass of whole new prompts whenever one can be admitted, else "
                "a decode pass) or sarathi (decodes first, then prompt chunks in the tokens left)"})
    chunked_prefill_tokens: int | None = field(default=None, metadata={
        "help": "vllm-v1 and sarathi: the most prompt tokens of one request in a pass (vLLM "
                "long_prefill_token_threshold; Sarathi's chunk size; default: max_batched_tokens)"})
    kv_memory: str = field(default="auto", metadata={
        "help": "KV-cache memory: 'auto' (HBM left after the expert cache and the dense weights), "
                "a size ('20GB'), or 'none' (no limit)"})
    kv_block_tokens: int = field(default=16, metadata={"help": "tokens per KV-cache block (vLLM block_size)"})
    kv_watermark: float | None = field(default=None, metadata={
        "help": "share of KV blocks a new admission must leave free (default: 0.01 for vllm-v0 and sarathi, "
                "as vLLM V0's block manager; 0 for vllm-v1, which keeps none)"})

    def __post_init__(self) -> None:
        for key in ("max_running", "max_batched_tokens", "kv_block_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.kv_watermark is not None and not 0 <= self.kv_watermark < 1:
            raise ValueError(f"kv_watermark is a share of the KV blocks in [0, 1), got {self.kv_watermark}")
        if self.chunked_prefill_tokens is not None:
            if self.chunked_prefill_tokens < 1:
                raise ValueError(f"chunked_prefill_tokens must be >= 1, got {self.chunked_prefill_tokens}")
            if self.policy == "vllm-v0":
                raise ValueError("chunked_prefill_tokens is for policies vllm-v1 and sarathi (vllm-v0 prefills whole "
                                 "prompts); set policy: vllm-v1 or sarathi, or remove it")
        if self.max_batched_tokens < self.max_running:
            raise ValueError(f"policy '{self.policy}' can schedule a token of every running request in one pass, "
                             f"so max_batched_tokens ({self.max_batched_tokens}) must be at least max_running "
                             f"({self.max_running}), as vLLM requires; raise max_batched_tokens or lower max_running")

    @property
    def watermark(self) -> float:
        """The share of KV blocks an admission leaves free (``kv_watermark`` or the policy's)."""
        if self.kv_watermark is not None:
            return self.kv_watermark
        return 0.0 if self.policy == "vllm-v1" else 0.01


@dataclass(frozen=True)
class SloConfig:
    """A latency service-level objective per request (``docs/guides/serving.md``)."""

    ttft_s: float | None = field(default=None, metadata={"help": "time to first token, seconds"})
    tpot_s: float | None = field(default=None, metadata={"help": "time per output token after the first, seconds"})
    itl_s: float | None = field(default=None, metadata={
        "help": "the longest gap between two consecutive output tokens of a request, seconds (a streaming stall)"})
    attainment: float = field(default=0.9, metadata={
        "help": "a request rate meets the SLO when this share of requests meets every limit given (compare's capacity)"})

    def __post_init__(self) -> None:
        if self.ttft_s is None and self.tpot_s is None and self.itl_s is None:
            raise ValueError("give ttft_s, tpot_s, itl_s or several (seconds)")
        if not 0 < self.attainment <= 1:
            raise ValueError(f"attainment must be in (0, 1], got {self.attainment}")
        for key in ("ttft_s", "tpot_s", "itl_s"):
            v = getattr(self, key)
            if v is not None and not (0 < v < float("inf")):
                raise ValueError(f"{key} must be a positive number of seconds, got {v}")


@dataclass(frozen=True)
class WorkloadConfig:
    """Which tokens go through each forward pass."""

    trace: TraceSource = field(metadata={"help": "the routing trace"})
    batch_size: int = field(default=1, metadata={
        "help": "B requests decoded together: a decode step carries one token of each"})
    max_requests: int | None = field(default=None, metadata={"help": "replay only the first N requests"})
    speculative: SpeculativeConfig | None = field(default=None, metadata={
        "help": "replace decode steps by speculative verification passes"})
    arrivals: ArrivalsConfig | None = field(default=None, metadata={
        "help": "requests arriving over time, served by continuous batching (docs/guides/serving.md)", "omit_none": True})

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {self.max_requests}")


@dataclass(frozen=True)
class CacheConfig:
    """The GPU expert cache."""

    capacity: str = field(default="5%", metadata={
        "help": "'5%' of all expert bytes, '0.6GB' / '600MiB', '64 experts', or 'inf'"})
    precision: str | None = field(default=None, metadata={
        "help": "precision experts are stored and fetched at (default: bf16 or the trace's first)"})
    ep_offload: bool = field(default=False, metadata={
        "help": "expert parallelism (hardware.gpus > 1) with offload: each GPU keeps cache.capacity of its "
                "experts in its own cache, fed on demand by its own host link (false: every GPU holds its "
                "share of the experts)"})


@dataclass(frozen=True)
class PolicySpec:
    """A resolved policy choice: registered name plus its typed parameters."""

    name: str
    params: Any


@dataclass(frozen=True)
class PoliciesConfig:
    """One policy per family."""

    eviction: PolicySpec
    miss: PolicySpec
    prefetch: PolicySpec
    routing: PolicySpec
    budget: PolicySpec


POLICY_DEFAULTS = {"eviction": "lru", "miss": "fetch", "prefetch": "none",
                   "routing": "standard", "budget": "none"}


@dataclass(frozen=True)
class Scenario:
    """A whole scenario, resolved."""

    hardware: HardwareConfig
    workload: WorkloadConfig
    cache: CacheConfig
    policies: PoliciesConfig
    seed: int = 0
    timing: bool = True
    expert_compute: Literal["layer", "on-arrival", "per-expert"] = "layer"
    expert_fetch: Literal["pipelined", "blocking"] = "pipelined"
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    scheduler: SchedulerConfig | None = None
    slo: SloConfig | None = None
    source: str = "<memory>"
    base_dir: str = "."

    @property
    def host(self) -> HostModel:
        """The execution style resolved against the hardware's host costs (zero in cache-only
        replay, where no time passes)."""
        return resolve_host(self.execution, self.hardware.host) if self.timing else HostModel()

    def _execution_plain(self) -> dict[str, Any]:
        """The ``execution`` key as resolved: the style and every knob's value."""
        h = resolve_host(self.execution, self.hardware.host)
        return {"style": self.execution.style, "host_layer_us": h.layer_us, "host_launch_us": h.launch_us,
                "host_copy_us": h.copy_us, "host_sync": h.sync, "dequant": h.dequant,
                "prefetch_depth": depth_key(h.prefetch_depth)}

    def to_dict(self) -> dict[str, Any]:
        """The resolved scenario as plain data (what scenario.resolved.yaml holds)."""
        pol = {fam: {"name": spec.name, **to_plain(spec.params)}
               for fam, spec in vars(self.policies).items()}
        hw = to_plain(self.hardware)  # the profile's tables stay out: 'profile' names their file
        out = {
            "seed": self.seed, "timing": self.timing, "expert_compute": self.expert_compute,
            "expert_fetch": self.expert_fetch, "execution": self._execution_plain(),
            "hardware": hw, "workload": to_plain(self.workload), "cache": to_plain(self.cache),
            "policies": pol,
        }
        if self.workload.arrivals is not None:  # serving under load (else today's keys alone)
            out["scheduler"] = to_plain(self.scheduler or SchedulerConfig())
            if self.slo is not None:
                out["slo"] = to_plain(self.slo)
        return out


@dataclass(frozen=True)
class _TopLevel:
    """A scenario file's top-level keys (each section is built into its own class)."""

    seed: int = field(default=0, metadata={"help": "the seed of every random draw: same scenario and seed, same "
                                                   "results"})
    timing: bool = field(default=True, metadata={
        "help": "false: cache-only replay (the same hit and miss decisions, no timeline)"})
    expert_compute: Literal["layer", "on-arrival", "per-expert"] = field(default="layer", metadata={
        "help": "layer (one fused kernel per layer), on-arrival (each expert as it lands) or per-expert (a "
                "Hugging Face-style loop)"})
    expert_fetch: Literal["pipelined", "blocking"] = field(default="pipelined", metadata={
        "help": "per-expert: pipelined (copies overlap the compute) or blocking (each miss waits)"})
    execution: Any = field(default=None, metadata={"help": "the host thread that feeds the GPU", "section":
                                                   ExecutionConfig})
    hardware: Any = field(default=None, metadata={"help": "the GPU, its links and host costs (default: preset "
                                                  "a100-80g-pcie4)", "section": HardwareConfig})
    workload: Any = field(default=None, metadata={"help": "the trace and how its tokens form forward passes "
                                                  "(required)", "section": WorkloadConfig})
    cache: Any = field(default=None, metadata={"help": "the GPU expert cache", "section": CacheConfig})
    policies: Any = field(default=None, metadata={
        "help": "one policy per family: eviction, miss, prefetch, routing, budget (a name, or {name: ..., "
                "parameter: value}; `moesim policies` lists them)"})
    scheduler: Any = field(default=None, metadata={"help": "continuous batching (with workload.arrivals)",
                                                   "section": SchedulerConfig})
    slo: Any = field(default=None, metadata={"help": "the latency objective (with workload.arrivals)",
                                             "section": SloConfig})
    sweep: Any = field(default=None, metadata={
        "help": "axes: {dotted.key: [values]} and zip: [[keys advancing together]] for `moesim sweep` (used when "
                "no --grid is given)"})


def _policy(family: str, value: Any, where: str) -> PolicySpec:
    path = f"policies.{family}"
    if isinstance(value, str):
        name, params = value, {}
    elif isinstance(value, dict):
        if "name" not in value:
            raise ConfigError(f"{where}: key '{path}' needs a 'name' (e.g. {{name: lru}}).")
        params = {k: v for k, v in value.items() if k != "name"}
        name = value["name"]
    else:
        raise ConfigError(f"{where}: key '{path}' must be a policy name or a mapping with 'name', "
                          f"got {value!r}.")
    cls = families()[family].get(str(name), where=f"{where}: key '{path}'")
    return PolicySpec(str(name), build(cls.Params, params, path, where))


def parse_set(assignments: list[str] | tuple[str, ...]) -> list[tuple[list[str], Any]]:
    """``["a.b=1", ...]`` -> ``[(["a", "b"], 1), ...]`` (values parsed as YAML)."""
    out = []
    for item in assignments:
        if "=" not in item:
            raise MoesimError(f"--set '{item}' must look like dotted.key=value (e.g. cache.capacity=25%).")
        key, raw = item.split("=", 1)
        if not key or any(not part for part in key.split(".")):
            raise MoesimError(f"--set '{item}': the key '{key}' is not a dotted key path.")
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError:
            value = raw
        out.append((key.split("."), value))
    return out


TRACE_SOURCES = ("synth", "path", "import")


def describe_trace(source: dict[str, Any]) -> str:
    """A trace source as a figure's or table's title names it, from its plain form (the
    resolved scenario's ``workload.trace``): a synthetic preset with its shape, or the file."""
    if source.get("synth"):
        s = source["synth"]
        return (f"synthetic {s.get('preset') or s.get('fit')} "
                f"({s.get('requests')} x {s.get('prompt_tokens')}+{s.get('tokens')} tokens)")
    if source.get("import"):
        return f"{Path(str(source['import'].get('path'))).name} ({source['import'].get('format')})"
    return Path(str(source.get("path"))).name


def apply_overrides(data: dict[str, Any], overrides: list[tuple[list[str], Any]]) -> dict[str, Any]:
    """Set each dotted key in a copy of ``data``; a policy name becomes ``{name: ...}`` when a
    parameter is set under it; setting one trace source (``workload.trace.path``, ``.import``
    or ``.synth``, or a key under one) drops the scenario's other sources."""
    data = copy.deepcopy(data)
    for keys, value in overrides:
        if keys[:2] == ["workload", "trace"] and len(keys) > 2 and keys[2] in TRACE_SOURCES:
            # a trace source given on the command line replaces the scenario's (one source)
            trace = (data.get("workload") or {}).get("trace")
            if isinstance(trace, dict):
                for other in TRACE_SOURCES:
                    if other != keys[2]:
                        trace.pop(other, None)
        node = data
        for i, key in enumerate(keys[:-1]):
            nxt = node.get(key)
            if isinstance(nxt, str) and i == 1 and keys[0] == "policies":
                nxt = {"name": nxt}
            if not isinstance(nxt, dict):
                nxt = {}
            node[key] = nxt
            node = nxt
        node[keys[-1]] = value
    return data


def _check_ep_offload(cache: CacheConfig, hardware: HardwareConfig, specs: dict[str, PolicySpec], where: str) -> None:
    """``cache.ep_offload`` needs expert parallelism, and each GPU fetches its misses on demand:
    the prefetch and miss families stay at their defaults."""
    if not cache.ep_offload:
        return
    if hardware.gpus == 1:
        raise ConfigError(f"{where}: key 'cache.ep_offload' gives each GPU of expert parallelism its own expert "
                          "cache, but hardware.gpus is 1 (one GPU's cache is cache.capacity already). Set "
                          "hardware.gpus (or an -x8 preset), or remove cache.ep_offload.")
    for fam in ("prefetch", "miss"):
        if specs[fam].name != POLICY_DEFAULTS[fam]:
            raise ConfigError(f"{where}: key 'policies.{fam}' is '{specs[fam].name}'; with cache.ep_offload each GPU "
                              f"fetches its missed experts on demand over its own host link, and {fam} policies are "
                              f"not modelled per GPU. Set policies.{fam}: {POLICY_DEFAULTS[fam]}, or remove "
                              "cache.ep_offload.")


def scenario_from_dict(data: Any, where: str = "<scenario>", base_dir: str = ".") -> Scenario:
    """Build a :class:`Scenario` from plain data; errors name ``where`` and the key path."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: a scenario must be a YAML mapping of keys (seed, hardware, "
                          f"workload, cache, policies), got {type(data).__name__}.")
    top = build(_TopLevel, data, "", where)
    hw_raw = top.hardware if top.hardware is not None else {"preset": "a100-80g-pcie4"}
    if not isinstance(hw_raw, dict):
        raise ConfigError(f"{where}: key 'hardware' must be a mapping (e.g. {{preset: a100-80g-pcie4}}).")
    hardware = build(HardwareConfig, expand_preset(hw_raw, where, base_dir), "hardware", where)
    if top.workload is None:
        raise ConfigError(f"{where}: key 'workload' is required, e.g. "
                          "workload: {trace: {synth: {preset: olmoe-1b-7b, tokens: 2000}}}.")
    workload = build(WorkloadConfig, top.workload, "workload", where)
    cache = build(CacheConfig, top.cache, "cache", where)
    pol_raw = top.policies or {}
    if not isinstance(pol_raw, dict):
        raise ConfigError(f"{where}: key 'policies' must be a mapping of family to policy.")
    fams = families()
    unknown = [k for k in pol_raw if k not in fams]
    if unknown:
        from moesim.errors import did_you_mean
        raise ConfigError(f"{where}: key 'policies.{unknown[0]}' is not a policy family"
                          f"{did_you_mean(str(unknown[0]), list(fams))}; valid families: {', '.join(fams)}.")
    specs = {fam: _policy(fam, pol_raw.get(fam, POLICY_DEFAULTS[fam]), where) for fam in fams}
    execution = build(ExecutionConfig, top.execution, "execution", where)
    _check_ep_offload(cache, hardware, specs, where)
    if hardware.gpus > 1 and resolve_host(execution, hardware.host).active:
        raise ConfigError(f"{where}: key 'execution' models the host of one GPU; with expert parallelism "
                          f"(hardware.gpus: {hardware.gpus}) there is no host model. Remove the execution style and "
                          "host costs, or set hardware.gpus: 1.")
    scheduler = build(SchedulerConfig, top.scheduler, "scheduler", where) if top.scheduler is not None else None
    slo = build(SloConfig, top.slo, "slo", where) if top.slo is not None else None
    if workload.arrivals is None:
        for key, value in (("scheduler", scheduler), ("slo", slo)):
            if value is not None:
                raise ConfigError(f"{where}: key '{key}' is for serving under load, which needs requests arriving "
                                  "over time: add workload.arrivals (e.g. {process: poisson, rate: 4, requests: 500}) "
                                  f"or remove '{key}'.")
    elif workload.speculative is not None or workload.batch_size != 1 or workload.max_requests is not None:
        bad = ("workload.speculative" if workload.speculative is not None else
               "workload.batch_size" if workload.batch_size != 1 else "workload.max_requests")
        raise ConfigError(f"{where}: key '{bad}' is for the fixed-batch replay; with workload.arrivals the "
                          "scheduler forms the batches (scheduler.max_running) and workload.arrivals.requests says "
                          f"how many requests. Remove '{bad}'.")
    style = style_defaults(execution.style)  # what the style sets unless the scenario does
    compute = top.expert_compute if "expert_compute" in data else style.get("expert_compute", top.expert_compute)
    fetch = top.expert_fetch if "expert_fetch" in data else style.get("expert_fetch", top.expert_fetch)
    return Scenario(hardware=hardware, workload=workload, cache=cache,
                    policies=PoliciesConfig(**specs), seed=top.seed, timing=top.timing,
                    expert_compute=compute, expert_fetch=fetch,  # type: ignore[arg-type]
                    execution=execution, scheduler=scheduler, slo=slo, source=where, base_dir=base_dir)


def read_yaml(path: str | Path) -> Any:
    """Parse a scenario YAML file; errors name the file and the line."""
    return read_yaml_file(path, "scenario", f"Shipped scenarios: {', '.join(shipped_scenarios()) or 'none'}.")


def shipped_dir() -> Path:
    """Folder of the scenarios shipped with moesim (``moesim/scenarios/``)."""
    import moesim.scenarios as pkg

    return Path(next(iter(pkg.__path__)))


def shipped_scenarios() -> list[str]:
    """Names of shipped scenarios (usable as ``moesim run NAME``)."""
    base = shipped_dir()
    return sorted(str(p.relative_to(base).with_suffix("")) for p in base.rglob("*.yaml"))


def resolve_path(name_or_path: str) -> Path:
    """A scenario path, or the shipped scenario of that name."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    cand = shipped_dir() / f"{name_or_path}.yaml"
    if re.fullmatch(r"[\w./-]+", name_or_path) and cand.is_file():
        return cand
    return p


def load_scenario(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Scenario:
    """Read a scenario file (or shipped name) and apply ``--set`` overrides."""
    p = resolve_path(str(path))
    data = read_yaml(p)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: a scenario must be a YAML mapping of keys, got {type(data).__name__}.")
    data = apply_overrides(data, cli_paths(parse_set(overrides)))
    return scenario_from_dict(data, where=str(p), base_dir=str(p.parent))


# keys whose values are files: given on the command line they are relative to the working
# directory, not to the scenario's folder (which YAML-written values are relative to)
PATH_KEYS = ("workload.trace.path", "workload.trace.import.path", "workload.trace.synth.fit", "workload.arrivals.path",
             "hardware.profile", "hardware.placement")


def cli_paths(overrides: list[tuple[list[str], Any]]) -> list[tuple[list[str], Any]]:
    """Make the relative file paths in ``--set`` overrides absolute against the working
    directory (also inside a mapping value such as ``workload.trace={path: t.parquet}``)."""

    def fix(prefix: str, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: fix(f"{prefix}.{k}", v) for k, v in value.items()}
        if prefix in PATH_KEYS and isinstance(value, str) and value and not Path(value).is_absolute():
            if prefix == "hardware.placement" and value in ("contiguous", "round-robin"):
                return value
            if prefix == "workload.trace.synth.fit" and not (Path.cwd() / value).is_file():
                return value  # a shipped profile's name
            return str((Path.cwd() / value).resolve())
        return value

    return [(keys, fix(".".join(keys), value)) for keys, value in overrides]


_SIZE_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_capacity(text: str, expert_bytes: int, total_expert_bytes: int, where: str) -> float:
    """Cache capacity in bytes from '5%', '0.6GB', '600MiB', '64 experts' or 'inf'."""
    s = str(text).strip().lower()
    fix = ("write it as a percentage of all expert bytes ('5%'), a size ('0.6GB', '600MiB'), "
           "a count ('64 experts') or 'inf'")
    if s in ("inf", "infinite", "unlimited"):
        return float("inf")
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*(%|[kmgt]i?b|b|experts?)", s)
    if not m:
        raise ConfigError(f"{where}: key 'cache.capacity' is {text!r}; {fix}.")
    value, unit = float(m.group(1)), m.group(2)
    if unit == "%":
        if value > 100:
            raise ConfigError(f"{where}: key 'cache.capacity' is {text}, more than 100% of the "
                              "experts; use at most 100% (or 'inf').")
        return total_expert_bytes * value / 100.0
    if unit.startswith("expert"):
        total = round(total_expert_bytes / expert_bytes) if expert_bytes else 0
        if value > total:
            raise ConfigError(f"{where}: key 'cache.capacity' is {text}, more than the model's {total:,} experts; "
                              f"use at most '{total} experts' (or '100%', or 'inf').")
        return value * expert_bytes
    return value * _SIZE_UNITS[unit]

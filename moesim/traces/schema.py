"""Trace format, schema version 1 (``docs/design.md``: "Trace format").

A trace is one Parquet file. A row is one (token occurrence, layer). Column names and types
are a contract that other tools rely on:

=========  ================  ==========================================================
column     type              meaning
=========  ================  ==========================================================
request    int32             request id
step       int32             forward pass of the request (0 = prefill when there is one)
position   int32             token position in its sequence
phase      string            ``prefill`` | ``decode`` | ``verify``
layer      int16             MoE layer index, 0 .. num_layers-1
experts    list<int16>       top-k expert ids in rank order
weights    list<float32>     their mixing weights
node       int16 (opt.)      draft-tree node (verify)
parent     int16 (opt.)      draft-tree parent node (verify)
accepted   bool (opt.)       whether the draft token was accepted (verify)
probs      list<float> (opt) full router probability vector (length num_experts)
pred_next  list<float> (opt) next layer's router probabilities predicted from this layer
pred_quasi list<float> (opt) the same predicted from the quasi-hidden state (speculating-
                             experts-prefetch.txt §3.2)
=========  ================  ==========================================================

The Parquet key-value metadata key ``moesim`` holds JSON ``{"schema_version": 1,
"model": {...}, "capture": {...}}``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from moesim.errors import MoesimError

SCHEMA_VERSION = 1
METADATA_KEY = b"moesim"
PHASES = ("prefill", "decode", "verify")
PHASE_CODES = {name: i for i, name in enumerate(PHASES)}

REQUIRED_COLUMNS = ("request", "step", "position", "phase", "layer", "experts", "weights")
PER_EXPERT_COLUMNS = ("probs", "pred_next", "pred_quasi")  # one float32 per expert a row each
OPTIONAL_COLUMNS = ("node", "parent", "accepted", *PER_EXPERT_COLUMNS)


@dataclass(frozen=True)
class ModelInfo:
    """Shape of the MoE model a trace was recorded from (the ``model`` metadata object).

    Required by schema v1: ``name``, ``num_layers``, ``num_experts``, ``top_k``,
    ``hidden_size``, ``expert_intermediate_size``, ``expert_bytes`` and ``renormalize``.
    The attention fields are optional; the roofline cost model uses them for the
    non-expert time of a layer and falls back to multi-head attention with
    ``hidden_size / 128`` heads when they are absent.
    """

    name: str
    num_layers: int
    num_experts: int
    top_k: int
    hidden_size: int
    expert_intermediate_size: int
    expert_bytes: dict[str, int]
    renormalize: bool
    shared_experts: int = 0
    shared_expert_intermediate_size: int = 0
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        problems = []
        for key in ("num_layers", "num_experts", "top_k", "hidden_size", "expert_intermediate_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                problems.append(f"model.{key} must be a positive integer, got {value!r}")
        if isinstance(self.top_k, int) and isinstance(self.num_experts, int) and self.top_k > self.num_experts:
            problems.append(f"model.top_k ({self.top_k}) exceeds model.num_experts ({self.num_experts})")
        if not isinstance(self.expert_bytes, dict) or not self.expert_bytes:
            problems.append("model.expert_bytes must map at least one precision (e.g. bf16) to bytes, "
                            f"got {self.expert_bytes!r}")
            raise ValueError("; ".join(problems))
        for key in ("shared_experts", "shared_expert_intermediate_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                problems.append(f"model.{key} must be a non-negative integer, got {value!r}")
        for key in ("num_attention_heads", "num_key_value_heads", "head_dim"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                problems.append(f"model.{key} must be a positive integer or absent, got {value!r}")
        if not isinstance(self.renormalize, bool):
            problems.append(f"model.renormalize must be true or false, got {self.renormalize!r}")
        for prec, nbytes in self.expert_bytes.items():
            if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
                problems.append(f"model.expert_bytes.{prec} must be a positive integer, got {nbytes!r}")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def heads(self) -> int:
        """Number of attention heads (default: hidden_size / 128, at least 1)."""
        return self.num_attention_heads or max(1, self.hidden_size // 128)

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads (default: as many as attention heads)."""
        return self.num_key_value_heads or self.heads

    @property
    def head_size(self) -> int:
        """Per-head dimension (default: hidden_size / heads)."""
        return self.head_dim or max(1, self.hidden_size // self.heads)

    def default_precision(self) -> str:
        """``bf16`` when the trace knows it, else the first precision listed."""
        return "bf16" if "bf16" in self.expert_bytes else next(iter(self.expert_bytes))

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for JSON metadata (optional fields left out when unset)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "extra":
                out.update(value)
            elif value is not None:
                out[f.name] = dict(value) if isinstance(value, dict) else value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str) -> ModelInfo:
        """Build from the metadata object; ``where`` names the file in error messages."""
        if not isinstance(data, dict):
            raise MoesimError(f"{where}: metadata 'model' must be a JSON object, got {type(data).__name__}.")
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        required = ["name", "num_layers", "num_experts", "top_k", "hidden_size",
                    "expert_intermediate_size", "expert_bytes", "renormalize"]
        missing = [k for k in required if k not in data]
        if missing:
            raise MoesimError(
                f"{where}: metadata 'model' lacks {', '.join(missing)}. Schema v1 requires "
                f"{', '.join(required)}; rewrite the trace with `moesim trace synth` or an importer "
                "that records the model shape.")
        known = {k: v for k, v in data.items() if k in names}
        extra = {k: v for k, v in data.items() if k not in names}
        if isinstance(known.get("expert_bytes"), dict):
            known["expert_bytes"] = {str(k): v for k, v in known["expert_bytes"].items()}
        try:
            return cls(**known, extra=extra)
        except (TypeError, ValueError) as exc:
            raise MoesimError(f"{where}: metadata 'model' is invalid: {exc}.") from None


def expert_bytes_for(hidden: int, intermediate: int) -> dict[str, int]:
    """Bytes of one gated-FFN expert (gate, up and down projections: 3*H*I weights).

    Precisions: bf16 (2 bytes), int8 (1), int4 (0.5), int2 (0.25 bytes per weight);
    quantisation scales are ignored.
    """
    weights = 3 * hidden * intermediate
    return {
        "bf16": 2 * weights,
        "int8": weights,
        "int4": math.ceil(weights / 2),
        "int2": math.ceil(weights / 4),
    }

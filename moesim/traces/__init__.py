"""Routing traces: schema v1, read/write/validate, synthetic generator, statistics."""

from moesim.traces.schema import SCHEMA_VERSION, ModelInfo
from moesim.traces.trace import Trace

__all__ = ["SCHEMA_VERSION", "ModelInfo", "Trace"]

"""Routing traces: schema v1, read/write/validate, synthetic generator, statistics."""

from traces.schema import SCHEMA_VERSION, ModelInfo
from traces.trace import Trace

__all__ = ["SCHEMA_VERSION", "ModelInfo", "Trace"]

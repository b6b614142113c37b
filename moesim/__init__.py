"""moesim: a trace-driven discrete-event simulator of Mixture-of-Experts expert caching,
prefetch and budgeting across a GPU memory hierarchy.

The public API (everything else is internal and may change):

- run a scenario: :func:`load_scenario` (a YAML file or a shipped name, with ``--set``-style
  overrides) and :func:`simulate`, which returns a :class:`Result` (``steps``, ``requests``,
  ``summary``); :func:`write_results` writes it;
- read or make a trace: :func:`read_trace`, :func:`write_trace`, :func:`synth_from_preset`,
  :class:`Trace`;
- sweep and compare: :func:`sweep` (a grid of scenario overrides, parallel and resumable),
  :func:`compare` (a ranked table of policies with the baseline, bound and infinite cache),
  :func:`mrc` (miss-ratio curves);
- register a policy: the family registries :data:`EVICTION`, :data:`PREFETCH`, :data:`MISS`,
  :data:`ROUTING`, :data:`BUDGET` (``@EVICTION.register("name")`` on a subclass of the family's
  base class), and :func:`load_plugins` for a plugin file or module.

Example::

    import moesim
    sc = moesim.load_scenario("quickstart", ["cache.capacity=25%", "policies.eviction=least-stale"])
    print(moesim.simulate(sc).summary["tpot_s"])
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    __version__ = version("moesim")
except PackageNotFoundError:  # pragma: no cover - running from a source tree without install
    __version__ = "0+unknown"

__all__ = [
    "BUDGET", "EVICTION", "MISS", "PREFETCH", "ROUTING", "Result", "Trace", "__version__", "compare",
    "load_plugins", "load_scenario", "mrc", "read_trace", "simulate", "sweep", "synth_from_preset",
    "write_results", "write_trace",
]

_LAZY = {
    "simulate": ("moesim.simulator.engine", "simulate"),
    "Result": ("moesim.output.results", "Result"),
    "load_scenario": ("moesim.config.scenario", "load_scenario"),
    "write_results": ("moesim.output.results", "write_results"),
    "sweep": ("moesim.studies.sweep", "sweep"),
    "compare": ("moesim.studies.compare", "compare"),
    "mrc": ("moesim.studies.mrc", "mrc"),
    "read_trace": ("moesim.traces.io", "read_trace"),
    "write_trace": ("moesim.traces.io", "write_trace"),
    "synth_from_preset": ("moesim.traces.synth", "synth_from_preset"),
    "Trace": ("moesim.traces.trace", "Trace"),
    "EVICTION": ("moesim.policies.eviction", "REGISTRY"),
    "PREFETCH": ("moesim.policies.prefetch", "REGISTRY"),
    "MISS": ("moesim.policies.miss", "REGISTRY"),
    "ROUTING": ("moesim.policies.routing", "REGISTRY"),
    "BUDGET": ("moesim.policies.budget", "REGISTRY"),
    "load_plugins": ("moesim.policies.plugins", "load_plugins"),
}


def __getattr__(name: str) -> Any:
    """The public names, imported on first use (``import moesim`` stays cheap)."""
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'moesim' has no attribute {name!r}")

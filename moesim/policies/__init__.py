"""Policy plug-ins, one module per family: eviction, prefetch, miss, routing, budget.

Each family has a small abstract base class and a :class:`~policies.registry.Registry`
keyed by the name used in scenario YAML; :func:`families` maps the family names to their
registries. (It lives here rather than in ``policies.registry``, which every family module
imports, so that no module imports one that imports it back.)
"""

from __future__ import annotations

from typing import Any

from moesim.policies.registry import Registry


def families() -> dict[str, Registry[Any]]:
    """Every policy family's registry, by the scenario key under ``policies``."""
    from moesim.policies import budget, eviction, miss, prefetch, routing

    return {
        "eviction": eviction.REGISTRY,
        "miss": miss.REGISTRY,
        "prefetch": prefetch.REGISTRY,
        "routing": routing.REGISTRY,
        "budget": budget.REGISTRY,
    }

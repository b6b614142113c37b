"""Policy plug-ins, one module per family: eviction, prefetch, miss, routing, budget.

Each family has a small abstract base class and a :class:`~policies.registry.Registry`
keyed by the name used in scenario YAML. ``policies.registry.FAMILIES`` maps family names
to their registries.
"""

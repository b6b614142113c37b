"""The miss family: its base (:mod:`.base`) and one module per policy, each registering
itself under the name scenarios use when it is imported here (in this order: the order
``moesim policies`` lists them)."""

from importlib import import_module

from moesim.policies.miss.base import REGISTRY, MissDecision, MissInfo, MissPolicy

POLICY_MODULES = ('fetch', 'fetch_lowest_bit', 'fetch_priority', 'drop', 'substitute', 'speculative')
for _name in POLICY_MODULES:
    import_module(f"{__name__}.{_name}")

__all__ = ['REGISTRY', 'MissDecision', 'MissInfo', 'MissPolicy']

"""The prefetch family: its base (:mod:`.base`) and one module per policy, each registering
itself under the name scenarios use when it is imported here (in this order: the order
``moesim policies`` lists them)."""

from importlib import import_module

from moesim.policies.prefetch.base import REGISTRY, PrefetchPolicy

POLICY_MODULES = ('none', 'oracle', 'previous_token', 'lookahead', 'next_gate_topk', 'score_percentile', 'static_pin')
for _name in POLICY_MODULES:
    import_module(f"{__name__}.{_name}")

__all__ = ['REGISTRY', 'PrefetchPolicy']

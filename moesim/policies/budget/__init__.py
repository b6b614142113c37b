"""The budget family: its base (:mod:`.base`) and one module per policy, each registering
itself under the name scenarios use when it is imported here (in this order: the order
``moesim policies`` lists them)."""

from importlib import import_module

from moesim.policies.budget.base import REGISTRY, BudgetPolicy

POLICY_MODULES = ('none', 'moe_spec', 'xshare', 'lynx', 'dynamic_skip', 'skip_threshold')
for _name in POLICY_MODULES:
    import_module(f"{__name__}.{_name}")

__all__ = ['REGISTRY', 'BudgetPolicy']

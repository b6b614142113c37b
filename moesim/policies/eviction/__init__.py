"""The eviction family: its base (:mod:`.base`) and one module per policy, each registering
itself under the name scenarios use when it is imported here (in this order: the order
``moesim policies`` lists them)."""

from importlib import import_module

from moesim.policies.eviction.base import (
    ANY,
    CLOCK_KEYS_PER_LAYER,
    CLOCK_LAYER,
    CLOCK_LAYERS,
    CLOCK_PASS,
    CLOCK_PRECISIONS,
    CLOCK_SIZE,
    CLOCK_TICK,
    NOT_PENDING,
    PENDING,
    REGISTRY,
    SKIP,
    CompiledForm,
    EvictionPolicy,
    RecencyOrdered,
    access_weight,
    list_append,
    list_unlink,
)

POLICY_MODULES = ("lru", "fifo", "lfu", "random", "fld", "score", "least_stale", "belady", "lhu", "sieve", "s3fifo",
                  "arc")
for _name in POLICY_MODULES:
    import_module(f"{__name__}.{_name}")

__all__ = ["ANY", "CLOCK_KEYS_PER_LAYER", "CLOCK_LAYER", "CLOCK_LAYERS", "CLOCK_PASS", "CLOCK_PRECISIONS",
           "CLOCK_SIZE", "CLOCK_TICK", "NOT_PENDING", "PENDING", "REGISTRY", "SKIP", "CompiledForm",
           "EvictionPolicy", "RecencyOrdered", "access_weight", "list_append", "list_unlink"]

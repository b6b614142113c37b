"""Per-family policy registries keyed by the name used in scenario YAML.

A policy class declares ``Params``, a frozen dataclass whose fields carry help text, and is
registered with ``@REGISTRY.register("name")``. An unknown name is an error that lists the
valid ones; contract tests are parametrised over each registry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np

from moesim.errors import MoesimError, did_you_mean


@dataclass(frozen=True)
class NoParams:
    """A policy without parameters."""


class Clock:
    """Mutable view of where the simulation is, shared by the engine with every policy.

    The engine updates ``now`` (seconds), ``pass_index`` (forward pass number, counted over
    the whole replay), ``pass_base`` (the number of the first pass of the workload the
    policies read, ``PolicyContext.workload``: 0 but under load, where each pass is a workload
    of its own, so that pass ``pass_index`` is that workload's ``pass_index - pass_base``),
    ``layer`` (the layer being executed) and ``pending`` (cache keys of that layer's routed experts that
    have not run yet) before it consults a policy; policies read them and never write. The
    execution point lies between the experts that have run and those in ``pending``:
    ``expert_compute: per-expert`` runs a layer's experts one at a time, the other modes all
    at once (``pending`` empties when the layer's experts have run).
    """

    __slots__ = ("layer", "now", "pass_base", "pass_index", "pending")

    def __init__(self) -> None:
        self.now = 0.0
        self.pass_index = 0
        self.pass_base = 0
        self.layer = 0
        self.pending: set[int] = set()


@dataclass
class PolicyContext:
    """What a policy may use, injected at construction (no global state).

    ``rng`` is the policy's own generator, derived from the scenario seed; ``workload`` is
    the :class:`simulator.workload.Workload` being replayed (for oracle-style policies that
    read the future from the trace); ``expert_bytes`` is the size of one expert at the
    scenario's precision; ``capacity_bytes`` is the cache's capacity.

    Cache keys: an expert at a precision is ``(layer * num_experts + expert) * P + q`` where
    ``precisions`` lists the model's precisions from largest to smallest (P of them) and
    ``q`` indexes it; ``default_precision`` is the scenario's. Use :meth:`key`,
    :meth:`layer_of`, :meth:`base_of` and :meth:`precision_of` rather than arithmetic.

    ``trace_pieces``, when the replay reads a trace file a piece at a time (``workload`` is then
    the piece being replayed), gives the file's pieces from its start, read again (a pass over
    the file each time it is called): for a policy that counts over the whole trace before the
    replay (static pinning). None: ``workload`` is the whole trace. :meth:`whole_trace` gives
    either. ``static_keys`` holds the keys pinned for the whole replay (static pinning), which
    a policy is never asked to evict. ``piece_future``, serving under load with a policy that
    reads the future: ``piece_future(workload, P, default_precision, keys)`` gives the pass
    ``workload``'s first access over the run and each cache key's first access after it (-1:
    none; :meth:`simulator.source.Source.future_of`).
    """

    num_layers: int
    num_experts: int
    top_k: int
    expert_bytes: int
    rng: np.random.Generator
    clock: Clock = field(default_factory=Clock)
    capacity_bytes: float = float("inf")
    workload: Any = None
    precisions: tuple[str, ...] = ("bf16",)
    default_precision: int = 0
    precision_bytes: tuple[int, ...] = ()
    trace_pieces: Callable[[], Iterator[Any]] | None = None
    piece_future: Callable[[Any, int, int, int], tuple[int, Any]] | None = None
    static_keys: set[int] = field(default_factory=set)

    def whole_trace(self) -> Generator[Any, None, None]:
        """The whole trace's workloads in order: the file's pieces read again from its start
        (``trace_pieces``), or the one workload. Close it when stopping early."""
        if self.trace_pieces is not None:
            yield from self.trace_pieces()
        else:
            yield self.workload

    def key(self, layer: int, expert: int, precision: int | None = None) -> int:
        """Cache key of ``expert`` of ``layer`` at ``precision`` (default: the scenario's)."""
        q = self.default_precision if precision is None else precision
        return (layer * self.num_experts + expert) * len(self.precisions) + q

    def layer_keys(self, layer: int, experts: list[int]) -> list[int]:
        """:meth:`key` of each of ``experts`` of ``layer`` at the scenario's precision."""
        num_p = len(self.precisions)
        base = layer * self.num_experts * num_p + self.default_precision
        return [base + e * num_p for e in experts]

    def base_of(self, key: int) -> int:
        """``layer * num_experts + expert`` of a cache key (the workload's key)."""
        return key // len(self.precisions)

    @property
    def keys_per_layer(self) -> int:
        """How many cache keys a layer has: its keys are ``layer * keys_per_layer`` up to
        ``(layer + 1) * keys_per_layer`` (exclusive), so a key's layer is ``key //
        keys_per_layer`` (for loops that cannot afford a call per key)."""
        return len(self.precisions) * self.num_experts

    def layer_of(self, key: int) -> int:
        """The layer of a cache key."""
        return key // self.keys_per_layer

    def precision_of(self, key: int) -> int:
        """The precision index of a cache key."""
        return key % len(self.precisions)

    def cache_keys(self, base: Any) -> Any:
        """Workload keys (numpy array or int) -> cache keys at the scenario's precision."""
        return base * len(self.precisions) + self.default_precision


P = TypeVar("P")


class Policy:
    """What every policy of every family has: its registered ``name``, its ``Params`` (a
    frozen dataclass; :class:`NoParams` when it takes none), and, once built, its typed
    ``params`` and its :class:`PolicyContext`. The family base classes (eviction, miss,
    prefetch, routing, budget) add their own hooks."""

    name: ClassVar[str]
    Params: ClassVar[type[Any]] = NoParams

    def __init__(self, params: Any, ctx: PolicyContext) -> None:
        self.params = params
        self.ctx = ctx


class Registry(Generic[P]):
    """Policies of one family by name."""

    def __init__(self, family: str) -> None:
        self.family = family
        self._classes: dict[str, type[P]] = {}

    def register(self, name: str) -> Any:
        """Class decorator registering a policy under ``name``."""

        def deco(cls: type[P]) -> type[P]:
            if name in self._classes:
                raise MoesimError(f"{self.family} policy '{name}' is registered twice ({self._classes[name].__module__} "
                                  f"and {cls.__module__}); give the new one another name.")
            missing = sorted(getattr(cls, "__abstractmethods__", ()))
            if missing:
                base = next((b.__name__ for b in cls.__mro__[1:] if getattr(b, "__abstractmethods__", None)), "its base")
                raise MoesimError(f"{self.family} policy '{name}' (class {cls.__name__}) does not define "
                                  f"{', '.join(missing)}, which every {base} must; add "
                                  f"{'them' if len(missing) > 1 else 'it'} (the README's plugin section lists the "
                                  "methods of each family).")
            params = getattr(cls, "Params", NoParams)
            if not (dataclasses.is_dataclass(params) and params.__dataclass_params__.frozen):  # type: ignore[attr-defined]
                raise MoesimError(f"{self.family} policy '{name}': {cls.__name__}.Params must be a frozen dataclass "
                                  "(@dataclass(frozen=True)).")
            cls.name = name  # type: ignore[attr-defined]
            self._classes[name] = cls
            return cls

        return deco

    def names(self) -> list[str]:
        """Registered names in registration order."""
        return list(self._classes)

    def get(self, name: str, where: str = "") -> type[P]:
        """The class registered as ``name``; unknown names list the valid ones."""
        try:
            return self._classes[name]
        except KeyError:
            loc = f"{where}: " if where else ""
            raise MoesimError(
                f"{loc}unknown {self.family} policy '{name}'{did_you_mean(name, self.names())}; "
                f"valid {self.family} policies: {', '.join(self.names())}.") from None

    def __contains__(self, name: object) -> bool:
        return name in self._classes

    def items(self) -> list[tuple[str, type[P]]]:
        """(name, class) pairs."""
        return list(self._classes.items())

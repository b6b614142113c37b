"""Expert-budget policies: restrict a layer's expert set for a whole forward pass
(MoE-Spec, XShare, sparse verification). ``none`` applies no budget."""

from __future__ import annotations

from abc import ABC
from typing import Any, ClassVar

from policies.registry import NoParams, PolicyContext, Registry


class BudgetPolicy(ABC):
    """Base class of the budget family; ``restricts = False`` means no budget."""

    name: ClassVar[str]
    Params: ClassVar[type[Any]] = NoParams
    restricts: ClassVar[bool] = True

    def __init__(self, params: Any, ctx: PolicyContext) -> None:
        self.params = params
        self.ctx = ctx


REGISTRY: Registry[BudgetPolicy] = Registry("budget")


@REGISTRY.register("none")
class NoBudget(BudgetPolicy):
    """Every expert the router chose is loaded and computed."""

    restricts = False

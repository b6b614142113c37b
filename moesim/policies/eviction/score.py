"""Score-based eviction and its compiled form (hooks)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moesim.jit import jit
from moesim.policies.eviction.base import (
    CLOCK_PASS,
    REGISTRY,
    CompiledForm,
    RecencyOrdered,
    access_weight,
)
from moesim.policies.registry import PolicyContext


@jit
def _score_credit(key: int, weight: float, clock: np.ndarray, si: np.ndarray, sf: np.ndarray) -> None:
    """Score eviction's credit (:class:`ScoreCompiled`): at the first credit of a forward pass,
    every key's score is multiplied by ``decay`` once per pass since the last such decay (from
    pass 0 at the first); then ``key``'s score gains ``weight`` -- as :meth:`ScoreBased._credit`."""
    p = clock[CLOCK_PASS]
    decay, last = sf[key, 1], si[key, 0]
    if decay != 1.0 and p != last:
        f = math.pow(decay, float(p - max(last, 0)))
        for k in range(sf.shape[0]):
            sf[k, 0] *= f
            si[k, 0] = p
    sf[key, 0] = sf[key, 0] + weight


class ScoreCompiled(CompiledForm):
    """Score eviction's compiled form (the hook interface of :mod:`moesim.policies.hooks`):
    per key its score (``sf[:, 0]``), the policy's decay (``sf[:, 1]``, the same in every row)
    and the pass the scores were last decayed at (``si[:, 0]``, -1 before any: every row is
    decayed at once, so the rows agree). A demand insert and a use credit the key with the
    access's gate weight; the victim has the lowest score, ties the oldest stamp (least recent
    use). A decay changes every key's score, so the priority is asked at each victim search."""

    int_fields = ("decayed_at",)
    float_fields = ("score", "decay")

    @staticmethod
    def initial_state(params: Any, si: np.ndarray, sf: np.ndarray) -> None:
        si[:, 0] = -1
        sf[:, 1] = params.decay

    @staticmethod
    def insert(key: int, demand: bool, weight: float, clock: np.ndarray, si: np.ndarray, sf: np.ndarray) -> None:
        if demand:
            _score_credit(key, weight, clock, si, sf)

    @staticmethod
    def access(key: int, weight: float, clock: np.ndarray, si: np.ndarray, sf: np.ndarray) -> None:
        _score_credit(key, weight, clock, si, sf)

    @staticmethod
    def priority(key: int, clock: np.ndarray, si: np.ndarray, sf: np.ndarray) -> float:
        return sf[key, 0]

    @staticmethod
    def priorities(keys: np.ndarray, n: int, out: np.ndarray, clock: np.ndarray, si: np.ndarray,
                   sf: np.ndarray) -> None:
        for j in range(n):
            out[j] = sf[keys[j], 0]


@dataclass(frozen=True)
class ScoreParams:
    """Parameters of score-based eviction."""

    decay: float = field(default=1.0, metadata={
        "help": "multiply every accumulated score by this at each forward pass, in (0, 1] (1 = plain sum)"})

    def __post_init__(self) -> None:
        if not 0 < self.decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")


@REGISTRY.register("score")
class ScoreBased(RecencyOrdered):
    """Score-based eviction (Zhu et al. 2025; SpecMD appendix B): evict the expert with the
    lowest accumulated gate score, the running sum of the router weights its tokens gave it;
    ties by least recent use. The kernel runs :class:`ScoreCompiled`."""

    Params = ScoreParams
    compiled = ScoreCompiled

    def __init__(self, params: ScoreParams, ctx: PolicyContext) -> None:
        super().__init__(params, ctx)
        self._score: dict[int, float] = {}
        self._pass = -1
        self._keys = ctx.cache_keys(ctx.workload.keys()).tolist() if ctx.workload is not None else []

    def _credit(self, key: int) -> None:
        ctx = self.ctx
        if self.params.decay != 1.0 and ctx.clock.pass_index != self._pass:
            steps = ctx.clock.pass_index - max(self._pass, 0)
            f = self.params.decay ** steps
            for k in self._score:
                self._score[k] *= f
            self._pass = ctx.clock.pass_index
        self._score[key] = self._score.get(key, 0.0) + access_weight(ctx, self._keys, key)

    def on_insert(self, key: int, demand: bool) -> None:
        super().on_insert(key, demand)
        if demand:
            self._credit(key)

    def on_access(self, key: int) -> None:
        super().on_access(key)
        self._credit(key)

    def candidates(self) -> Iterator[int]:
        rank = self._recency_rank()
        return iter(sorted(self._order, key=lambda k: (self._score.get(k, 0.0), rank[k])))

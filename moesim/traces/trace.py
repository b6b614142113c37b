"""In-memory trace: numpy arrays, one entry per (token occurrence, layer) row."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moesim.traces.schema import ModelInfo


@dataclass
class Trace:
    """A validated routing trace.

    ``experts`` and ``weights`` are ``[rows, top_k]`` arrays in rank order; ``phase`` holds
    codes into :data:`traces.schema.PHASES`. Optional columns are ``None`` when absent.
    """

    model: ModelInfo
    request: np.ndarray
    step: np.ndarray
    position: np.ndarray
    phase: np.ndarray
    layer: np.ndarray
    experts: np.ndarray
    weights: np.ndarray
    node: np.ndarray | None = None
    parent: np.ndarray | None = None
    accepted: np.ndarray | None = None
    probs: np.ndarray | None = None
    pred_next: np.ndarray | None = None
    pred_quasi: np.ndarray | None = None
    capture: dict[str, Any] = field(default_factory=dict)
    source: str = "<memory>"

    def __len__(self) -> int:
        return int(self.request.shape[0])

    @property
    def num_requests(self) -> int:
        """Number of distinct request ids."""
        return int(np.unique(self.request).size)

    def num_tokens(self) -> int:
        """Distinct token occurrences (request, step, position)."""
        if len(self) == 0:
            return 0
        keys = np.stack([self.request, self.step, self.position], axis=1)
        return int(np.unique(keys, axis=0).shape[0])

    def num_steps(self) -> int:
        """Distinct forward passes (request, step)."""
        if len(self) == 0:
            return 0
        keys = np.stack([self.request, self.step], axis=1)
        return int(np.unique(keys, axis=0).shape[0])

    def take(self, mask: np.ndarray) -> Trace:
        """A new trace with the rows selected by a boolean mask or index array."""

        def sel(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else a[mask]

        return Trace(
            model=self.model, request=self.request[mask], step=self.step[mask],
            position=self.position[mask], phase=self.phase[mask], layer=self.layer[mask],
            experts=self.experts[mask], weights=self.weights[mask], node=sel(self.node),
            parent=sel(self.parent), accepted=sel(self.accepted), probs=sel(self.probs),
            pred_next=sel(self.pred_next), pred_quasi=sel(self.pred_quasi),
            capture=dict(self.capture), source=self.source,
        )

"""Importers: routing logs other tools write -> v1 traces.

``expert-jsonl``: one JSON object per (problem, decode token, layer) with ``problem_id``,
``token_idx``, ``layer``, ``experts`` (top-k ids, rank order) and ``gating_probs`` (their
weights), as in ``../shared/traces/real/mixtral-8x7b-vllm/``. Each problem becomes a
request, each token a decode step (``step = position = token_idx``: the logs do not record
the prompt length). (token, layer) cells missing from the log are reported, not invented.
Model shapes come from a synthetic preset (``--model-preset``), since the logs lack them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from simulator.errors import MoesimError, did_you_mean
from traces.schema import PHASE_CODES, ModelInfo
from traces.trace import Trace


@dataclass
class ImportReport:
    """What an importer found besides the rows: counts to show the user."""

    rows: int = 0
    missing_cells: int = 0
    notes: list[str] = field(default_factory=list)


def _model(preset: str | None, fmt: str) -> ModelInfo:
    from traces.synth import PRESETS, get_preset

    if preset is None:
        raise MoesimError(f"import format '{fmt}' records no model shapes; name one with "
                          f"--model-preset (valid: {', '.join(PRESETS)}).")
    return get_preset(preset).model


def _files(src: Path, pattern: str) -> list[Path]:
    if src.is_dir():
        files = sorted(src.glob(pattern))
        if not files:
            raise MoesimError(f"import: folder {src} has no files matching {pattern}.")
        return files
    if not src.is_file():
        raise MoesimError(f"import: {src}: no such file or folder.")
    return [src]


def import_expert_jsonl(sources: list[Path], model_preset: str | None) -> tuple[Trace, ImportReport]:
    """Read expert-jsonl logs (see module docstring)."""
    model = _model(model_preset, "expert-jsonl")
    report = ImportReport()
    rows: dict[tuple[int, int, int], tuple[list[int], list[float]]] = {}
    for src in sources:
        for path in _files(src, "*routing*.jsonl"):
            with path.open() as fh:
                for n, line in enumerate(fh, start=1):
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                        key = (int(obj["problem_id"]), int(obj["token_idx"]), int(obj["layer"]))
                        experts = [int(x) for x in obj["experts"]]
                        weights = [float(x) for x in obj["gating_probs"]]
                    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                        raise MoesimError(
                            f"import {path} line {n}: not an expert-jsonl record ({exc!r}); each line "
                            "needs problem_id, token_idx, layer, experts and gating_probs.") from None
                    if len(experts) != model.top_k or len(weights) != model.top_k:
                        raise MoesimError(
                            f"import {path} line {n}: {len(experts)} experts, but model preset "
                            f"{model.name} has top-{model.top_k}; pick the right --model-preset.")
                    if not all(0 <= e < model.num_experts for e in experts) or not 0 <= key[2] < model.num_layers:
                        raise MoesimError(
                            f"import {path} line {n}: layer {key[2]} / experts {experts} out of range for "
                            f"{model.name} ({model.num_layers} layers, {model.num_experts} experts); "
                            "pick the right --model-preset.")
                    rows[key] = (experts, weights)
    if not rows:
        raise MoesimError("import: no expert-jsonl records found.")
    keys = sorted(rows)
    tokens = {(p, t) for p, t, _ in keys}
    report.rows = len(keys)
    report.missing_cells = len(tokens) * model.num_layers - len(keys)
    if report.missing_cells:
        report.notes.append(f"{report.missing_cells} (token, layer) cells are missing from the log "
                            "and were left out, not invented")
    arr = np.array(keys, dtype=np.int64)
    trace = Trace(
        model=model,
        request=arr[:, 0].astype(np.int32), step=arr[:, 1].astype(np.int32),
        position=arr[:, 1].astype(np.int32),
        phase=np.full(len(keys), PHASE_CODES["decode"], dtype=np.int8),
        layer=arr[:, 2].astype(np.int16),
        experts=np.array([rows[k][0] for k in keys], dtype=np.int16),
        weights=np.array([rows[k][1] for k in keys], dtype=np.float32),
        capture={"source": "moesim trace import", "format": "expert-jsonl",
                 "files": [str(s) for s in sources], "missing_cells": report.missing_cells},
    )
    return trace, report


IMPORTERS: dict[str, Callable[[list[Path], str | None], tuple[Trace, ImportReport]]] = {
    "expert-jsonl": import_expert_jsonl,
}


def import_trace(fmt: str, sources: list[str | Path], model_preset: str | None = None,
                 **_: Any) -> tuple[Trace, ImportReport]:
    """Run the importer for ``fmt``; unknown formats list the valid ones."""
    if fmt not in IMPORTERS:
        raise MoesimError(f"unknown import format '{fmt}'{did_you_mean(fmt, list(IMPORTERS))}; "
                          f"valid formats: {', '.join(IMPORTERS)}.")
    return IMPORTERS[fmt]([Path(s) for s in sources], model_preset)

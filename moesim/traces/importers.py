"""Importers: routing logs other tools write -> v1 traces.

Formats (``moesim trace import --format F``):

- ``vllm-routes-jsonl``: a ``meta`` line, then ``route`` lines ``req_id, token_idx, layer,
  topk_ids, topk_weights`` (``../shared/traces/real/layer0-vllm/``). The logs record no
  forward-pass boundaries or phases: each route line's token becomes its own decode step, in
  log order, per request. ``--drop-warmup`` drops vLLM's warm-up dummies (rows whose weights
  are all equal, or whose id tuple alone makes up at least 10% of the log) and reports how
  many.
- ``expert-jsonl`` (below).
- ``flame-csv``: FLAME-MoE per-layer CSVs ``layer_id, token_id, expert_0..expert_{N-1}`` of
  top-k probabilities (0 elsewhere); a ``prefill`` folder (S sequences x T tokens, one
  prefill pass each; ``--tokens-per-sequence`` T, default 64) and/or ``decode/<k>th``
  folders (row = sequence, k-th decode token). File names carry ``layer<L>``; layers are
  renumbered from 0 in ascending order. Experts are ranked by probability.
- ``routed-experts-npy``: an int array ``[tokens, layers, k]`` (vLLM
  ``--enable-return-routed-experts``); one request, one decode step per token; the weights
  are not in the file and are set to 1/k.
- ``long-table``: CSV or Parquet with one row per (token, layer, expert); ``--columns``
  maps ``request, position, layer, expert`` (required) and ``weight, rank, step, phase``
  (optional) to the file's column names. Rows are grouped into top-k lists ordered by rank,
  else by weight (descending).

``expert-jsonl``: one JSON object per (problem, decode token, layer) with ``problem_id``,
``token_idx``, ``layer``, ``experts`` (top-k ids, rank order) and ``gating_probs`` (their
weights), as in ``../shared/traces/real/mixtral-8x7b-vllm/``. Each problem becomes a
request, each token a decode step (``step = position = token_idx``: the logs do not record
the prompt length). (token, layer) cells missing from the log are reported, not invented.
Model shapes come from a synthetic preset (``--preset``), since the logs lack them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moesim.errors import MoesimError, did_you_mean
from moesim.traces.schema import PHASE_CODES, ModelInfo
from moesim.traces.trace import Trace


@dataclass
class ImportReport:
    """What an importer found besides the rows: counts to show the user."""

    rows: int = 0
    missing_cells: int = 0
    notes: list[str] = field(default_factory=list)


def _model(preset: str | None, fmt: str) -> ModelInfo:
    from moesim.traces.synth import PRESETS, get_preset

    if preset is None:
        raise MoesimError(f"import format '{fmt}' records no model shapes; name one with "
                          f"--preset (valid: {', '.join(PRESETS)}).")
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


def _names(sources: list[Path]) -> str:
    """The import's sources for a message: up to three, then how many more."""
    names = [str(s) for s in sources]
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def import_expert_jsonl(sources: list[Path], model_preset: str | None, **_: Any) -> tuple[Trace, ImportReport]:
    """Read expert-jsonl logs (see module docstring)."""
    model = _model(model_preset, "expert-jsonl")
    report = ImportReport()
    rows: dict[tuple[int, int, int], tuple[list[int], list[float]]] = {}
    need = "each line needs problem_id, token_idx, layer, experts and gating_probs"
    for where, obj in _json_lines(sources, "*routing*.jsonl", "an expert-jsonl", need):
        try:
            key = (int(obj["problem_id"]), int(obj["token_idx"]), int(obj["layer"]))
            experts = [int(x) for x in obj["experts"]]
            weights = [float(x) for x in obj["gating_probs"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise MoesimError(f"import {where}: not an expert-jsonl record ({exc!r}); {need}.") from None
        _check_row(model, where, key[2], experts, weights)
        rows[key] = (experts, weights)
    if not rows:
        raise MoesimError(f"import {_names(sources)}: no expert-jsonl records found (lines with problem_id, "
                          "token_idx, layer, experts and gating_probs); check --format and the files.")
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


def _build(model: ModelInfo, request: list[int], step: list[int], position: list[int],
           phase: list[int], layer: list[int], experts: list[list[int]], weights: list[list[float]],
           capture: dict[str, Any]) -> Trace:
    return Trace(
        model=model, request=np.asarray(request, dtype=np.int32), step=np.asarray(step, dtype=np.int32),
        position=np.asarray(position, dtype=np.int32), phase=np.asarray(phase, dtype=np.int8),
        layer=np.asarray(layer, dtype=np.int16),
        experts=np.asarray(experts, dtype=np.int16).reshape(len(experts), model.top_k),
        weights=np.asarray(weights, dtype=np.float32).reshape(len(weights), model.top_k),
        capture=capture)


def _json_lines(sources: list[Path], pattern: str, what: str, need: str) -> Any:
    """(``"FILE line N"``, parsed object) for every non-blank line of the JSONL files."""
    for src in sources:
        for path in _files(src, pattern):
            with path.open() as fh:
                for n, line in enumerate(fh, start=1):
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise MoesimError(f"import {path} line {n}: not {what} record ({exc!r}); {need}.") from None
                    if not isinstance(obj, dict):
                        raise MoesimError(f"import {path} line {n}: not {what} record (not a JSON object); {need}.")
                    yield f"{path} line {n}", obj


def _check_row(model: ModelInfo, where: str, layer: int, experts: list[int],
               weights: list[float] | None = None) -> None:
    if len(experts) != model.top_k or (weights is not None and len(weights) != model.top_k):
        raise MoesimError(f"import {where}: {len(experts)} experts, but model {model.name} has "
                          f"top-{model.top_k}; pick the right --preset.")
    if not 0 <= layer < model.num_layers or not all(0 <= e < model.num_experts for e in experts):
        raise MoesimError(f"import {where}: layer {layer} / experts {experts} out of range for "
                          f"{model.name} ({model.num_layers} layers, {model.num_experts} experts); "
                          "pick the right --preset.")


def import_vllm_routes(sources: list[Path], model_preset: str | None, drop_warmup: bool = False,
                       **_: Any) -> tuple[Trace, ImportReport]:
    """Read vLLM route logs (see module docstring)."""
    model = _model(model_preset, "vllm-routes-jsonl")
    report = ImportReport()
    records: list[tuple[str, int, list[int], list[float], str]] = []
    meta: dict[str, Any] = {}
    need = "route lines need req_id, token_idx, layer, topk_ids and topk_weights"
    for where, obj in _json_lines(sources, "*.jsonl", "a vLLM route", need):
        if obj.get("type") == "meta":
            meta = {k: v for k, v in obj.items() if k != "type"}
            continue
        if obj.get("type") != "route":
            continue
        try:
            rec = (str(obj["req_id"]), int(obj["layer"]), [int(x) for x in obj["topk_ids"]],
                   [float(x) for x in obj["topk_weights"]], where)
        except (KeyError, TypeError, ValueError) as exc:
            raise MoesimError(f"import {where}: not a vLLM route record ({exc!r}); {need}.") from None
        _check_row(model, where, rec[1], rec[2], rec[3])
        records.append(rec)
    if not records:
        raise MoesimError(f"import {_names(sources)}: no vLLM route records found (lines with "
                          '"type": "route"); check --format and the files.')
    if meta.get("top_k") not in (None, model.top_k) or meta.get("num_experts") not in (None, model.num_experts):
        raise MoesimError(f"import: the log's meta line says top_k={meta.get('top_k')}, "
                          f"num_experts={meta.get('num_experts')}, but --preset {model.name} has "
                          f"top-{model.top_k} of {model.num_experts}; pick the matching preset.")
    from collections import Counter

    # vLLM's warm-up dummies: equal weights, or one id tuple repeated across a tenth of the log
    tuples = Counter(tuple(r[2]) for r in records)
    common = {t for t, c in tuples.items() if c >= 0.1 * len(records)}
    keep = [r for r in records if not (max(r[3]) - min(r[3]) < 1e-9 or tuple(r[2]) in common)]
    warmup = len(records) - len(keep)
    if drop_warmup:
        report.notes.append(f"dropped {warmup} warm-up rows (equal weights or a dominant repeated id tuple)")
        records = keep
    elif warmup:
        report.notes.append(f"kept {warmup} of {len(records)} rows that look like vLLM warm-up dummies (equal "
                            "weights or a dominant repeated id tuple); --drop-warmup drops them")
    req_ids: dict[str, int] = {}
    counter: dict[tuple[int, int], int] = {}
    cols: dict[str, list[Any]] = {k: [] for k in ("r", "s", "l", "e", "w")}
    for req, layer, ids, w, _where in records:
        r = req_ids.setdefault(req, len(req_ids))
        s_ = counter.get((r, layer), 0)
        counter[(r, layer)] = s_ + 1
        for k, v in zip("rslew", (r, s_, layer, ids, w), strict=True):
            cols[k].append(v)
    report.rows = len(cols["r"])
    layers = sorted(set(cols["l"]))
    report.notes.append(f"layers logged: {layers}; no pass boundaries in the log, so each token is its own decode step")
    return _build(model, cols["r"], cols["s"], cols["s"], [PHASE_CODES["decode"]] * report.rows, cols["l"],
                  cols["e"], cols["w"], {"source": "moesim trace import", "format": "vllm-routes-jsonl",
                                         "files": [str(s) for s in sources], "log_meta": meta,
                                         "layers_logged": layers}), report


def _flame_layer(path: Path) -> int:
    import re

    m = re.search(r"layer(\d+)", path.name)
    if not m:
        raise MoesimError(f"import {path}: file name does not say its layer (expected 'layer<N>').")
    return int(m.group(1))


def import_flame_csv(sources: list[Path], model_preset: str | None, tokens_per_sequence: int = 64,
                     **_: Any) -> tuple[Trace, ImportReport]:
    """Read FLAME-MoE per-layer CSVs (see module docstring)."""
    import pandas as pd

    report = ImportReport()
    prefill: list[Path] = []
    decode: list[tuple[int, Path]] = []
    import re

    for src in sources:
        for path in _files(src, "**/*.csv"):
            parts = [p.lower() for p in path.parts]
            m = next((re.fullmatch(r"(\d+)(st|nd|rd|th)", p) for p in reversed(parts[:-1])
                      if re.fullmatch(r"(\d+)(st|nd|rd|th)", p)), None)
            if m:
                decode.append((int(m.group(1)), path))
            elif "prefill" in parts or "encoder" in path.name.lower():
                prefill.append(path)
            else:
                raise MoesimError(f"import {path}: cannot tell prefill from decode (expected a "
                                  "'prefill' folder or a 'decode/<k>th' folder).")
    all_layers = sorted({_flame_layer(p) for p in prefill} | {_flame_layer(p) for _, p in decode})
    layer_index = {layer: i for i, layer in enumerate(all_layers)}
    model = None
    cols: dict[str, list[Any]] = {k: [] for k in ("r", "s", "p", "ph", "l", "e", "w")}

    def read(path: Path) -> np.ndarray:
        nonlocal model
        df = pd.read_csv(path)
        probs = df.filter(like="expert_").to_numpy(dtype=np.float64)
        nz = (probs > 0).sum(axis=1)
        if model is None:
            k = int(nz.max()) if len(nz) else 0
            model = _flame_model(model_preset, probs.shape[1], k, len(all_layers))
        bad = np.flatnonzero(nz != model.top_k)
        if bad.size:
            raise MoesimError(f"import {path}: row {int(bad[0])} has {int(nz[bad[0]])} non-zero experts, "
                              f"expected {model.top_k}.")
        return probs

    def add(r: int, s_: int, pos: int, ph: int, layer: int, row: np.ndarray) -> None:
        assert model is not None
        top = np.argsort(-row, kind="stable")[: model.top_k]
        for k, v in zip(("r", "s", "p", "ph", "l", "e", "w"),
                        (r, s_, pos, ph, layer_index[layer], top.tolist(), row[top].tolist()), strict=True):
            cols[k].append(v)

    n_prefill_seqs = 0
    for path in sorted(prefill):
        probs = read(path)
        layer = _flame_layer(path)
        if probs.shape[0] % tokens_per_sequence:
            raise MoesimError(f"import {path}: {probs.shape[0]} rows is not a multiple of "
                              f"--tokens-per-sequence {tokens_per_sequence}.")
        n_prefill_seqs = max(n_prefill_seqs, probs.shape[0] // tokens_per_sequence)
        for i, row in enumerate(probs):
            add(i // tokens_per_sequence, 0, i % tokens_per_sequence, PHASE_CODES["prefill"], layer, row)
    for k, path in sorted(decode):
        probs = read(path)
        layer = _flame_layer(path)
        for seq, row in enumerate(probs):
            # decode sequences are different from the prefill ones: ids after them
            add(n_prefill_seqs + seq, k - 1, k - 1, PHASE_CODES["decode"], layer, row)
    if model is None:
        raise MoesimError("import: no FLAME CSV files found.")
    report.rows = len(cols["r"])
    report.notes.append(f"MoE layers {all_layers} renumbered 0..{len(all_layers) - 1}")
    trace = _build(model, cols["r"], cols["s"], cols["p"], cols["ph"], cols["l"], cols["e"], cols["w"],
                   {"source": "moesim trace import", "format": "flame-csv",
                    "files": [str(s) for s in sources], "layers": all_layers})
    order = np.lexsort((trace.layer, trace.position, trace.step, trace.request))
    return trace.take(order), report


def _flame_model(preset: str | None, num_experts: int, k: int, layers: int) -> ModelInfo:
    from dataclasses import replace

    from moesim.traces.schema import expert_bytes_for

    if preset is not None:
        base = _model(preset, "flame-csv")
        if (base.num_experts, base.top_k) != (num_experts, k):
            raise MoesimError(f"import: the CSVs have {num_experts} experts, top-{k}, but preset "
                              f"{base.name} has {base.num_experts}, top-{base.top_k}.")
        return replace(base, num_layers=layers)
    # FLAME-MoE-290M shapes are not in the files: hidden 512, expert intermediate 1024 are
    # placeholders recorded as such.
    return ModelInfo(name="flame-moe-290m", num_layers=layers, num_experts=num_experts, top_k=k,
                     hidden_size=512, expert_intermediate_size=1024,
                     expert_bytes=expert_bytes_for(512, 1024), renormalize=False,
                     extra={"shapes": "placeholders: hidden and expert sizes are not in the FLAME CSVs"})


def import_routed_npy(sources: list[Path], model_preset: str | None, **_: Any) -> tuple[Trace, ImportReport]:
    """Read ``[tokens, layers, k]`` routed-expert arrays (one request per file)."""
    model = _model(model_preset, "routed-experts-npy")
    report = ImportReport()
    cols: dict[str, list[Any]] = {k: [] for k in ("r", "s", "l", "e")}
    files = [p for s in sources for p in _files(s, "*.npy")]
    for r, path in enumerate(files):
        try:
            arr = np.load(path, allow_pickle=False)
        except EOFError:  # numpy's word for a file with no bytes
            raise MoesimError(f"import {path}: the file is empty (0 bytes), not a .npy array; each file holds one "
                              "request's [tokens, layers, k] routed experts, written with numpy.save.") from None
        except (OSError, ValueError) as exc:
            raise MoesimError(f"import {path}: not a readable .npy array ({exc}); each file holds one request's "
                              "[tokens, layers, k] routed experts, written with numpy.save.") from None
        if arr.size == 0:
            raise MoesimError(f"import {path}: the array is empty (shape {arr.shape}); each file holds one "
                              "request's [tokens, layers, k] routed experts, at least one token.")
        if arr.dtype.kind not in "iu":
            raise MoesimError(f"import {path}: the array holds {arr.dtype} values; routed expert ids must be "
                              "integers (save them with an integer dtype, e.g. arr.astype(np.int16)).")
        if arr.ndim != 3 or arr.shape[2] != model.top_k or arr.shape[1] > model.num_layers:
            raise MoesimError(f"import {path}: shape {arr.shape}, expected [tokens, layers <= "
                              f"{model.num_layers}, {model.top_k}] for {model.name}.")
        if (arr.min() < 0 or arr.max() >= model.num_experts):
            t, layer, _ = np.argwhere((arr < 0) | (arr >= model.num_experts))[0]
            raise MoesimError(f"import {path}: token {t}, layer {layer} has an expert id outside "
                              f"0..{model.num_experts - 1}.")
        for t in range(arr.shape[0]):
            for layer in range(arr.shape[1]):
                cols["r"].append(r)
                cols["s"].append(t)
                cols["l"].append(layer)
                cols["e"].append(arr[t, layer].tolist())
    report.rows = len(cols["r"])
    report.notes.append("weights are not in .npy files: set to 1/k")
    w = [[1.0 / model.top_k] * model.top_k] * report.rows
    return _build(model, cols["r"], cols["s"], cols["s"], [PHASE_CODES["decode"]] * report.rows, cols["l"],
                  cols["e"], w, {"source": "moesim trace import", "format": "routed-experts-npy",
                                 "files": [str(f) for f in files]}), report


LONG_REQUIRED = ("request", "position", "layer", "expert")
LONG_OPTIONAL = ("weight", "rank", "step", "phase")


def import_long_table(sources: list[Path], model_preset: str | None, columns: dict[str, str] | None = None,
                      **_: Any) -> tuple[Trace, ImportReport]:
    """Read a long table, one row per (token, layer, expert) (see module docstring)."""
    import pandas as pd

    model = _model(model_preset, "long-table")
    mapping = {k: k for k in LONG_REQUIRED}
    for key, col in (columns or {}).items():
        if key not in LONG_REQUIRED + LONG_OPTIONAL:
            raise MoesimError(f"import long-table: --columns key '{key}'{did_you_mean(key, list(LONG_REQUIRED + LONG_OPTIONAL))} "
                              f"is not one of {', '.join(LONG_REQUIRED + LONG_OPTIONAL)}.")
        mapping[key] = col
    frames = []
    for src in sources:
        for path in _files(src, "*.*"):
            try:
                df = pd.read_parquet(path) if path.suffix == ".parquet" else pd.read_csv(path)
            except Exception as exc:
                raise MoesimError(f"import {path}: not a readable CSV or Parquet table ({exc}).") from None
            missing = [f"{k} (column '{mapping[k]}')" for k in LONG_REQUIRED if mapping[k] not in df.columns]
            if missing:
                raise MoesimError(f"import {path}: missing {', '.join(missing)}; its columns are "
                                  f"{', '.join(map(str, df.columns))}. Map them with --columns "
                                  "request=...,position=...,layer=...,expert=....")
            frames.append(df.rename(columns={v: k for k, v in mapping.items()}))
    df = pd.concat(frames, ignore_index=True)
    if "weight" not in df:
        df["weight"] = 1.0 / model.top_k
    if "step" not in df:
        df["step"] = df["position"]
    order_cols = ["request", "step", "position", "layer"]
    df = df.sort_values(order_cols + (["rank"] if "rank" in df else []),
                        ascending=[True] * 4 + ([True] if "rank" in df else []), kind="stable")
    if "rank" not in df:
        df = df.sort_values([*order_cols, "weight"], ascending=[True] * 4 + [False], kind="stable")
    groups = df.groupby(order_cols, sort=False)
    sizes = groups.size()
    bad = sizes[sizes != model.top_k]
    if len(bad):
        key = bad.index[0]
        raise MoesimError(f"import long-table: token (request {key[0]}, step {key[1]}, position {key[2]}, "
                          f"layer {key[3]}) has {int(bad.iloc[0])} expert rows, expected {model.top_k}.")
    experts = df["expert"].to_numpy().reshape(-1, model.top_k)
    weights = df["weight"].to_numpy(dtype=np.float64).reshape(-1, model.top_k)
    first = df.groupby(order_cols, sort=False).head(1)
    phase = ([PHASE_CODES.get(str(p), -1) for p in first["phase"]] if "phase" in first
             else [PHASE_CODES["decode"]] * len(first))
    if -1 in phase:
        raise MoesimError(f"import long-table: phase values must be {', '.join(PHASE_CODES)}.")
    for i, (layer, ex) in enumerate(zip(first["layer"].tolist(), experts.tolist(), strict=True)):
        _check_row(model, f"long-table token {i}", int(layer), [int(x) for x in ex])
    report = ImportReport(rows=len(first))
    return _build(model, first["request"].tolist(), first["step"].tolist(), first["position"].tolist(), phase,
                  first["layer"].tolist(), experts.tolist(), weights.tolist(),
                  {"source": "moesim trace import", "format": "long-table",
                   "files": [str(s) for s in sources], "columns": mapping}), report


IMPORTERS: dict[str, Callable[..., tuple[Trace, ImportReport]]] = {
    "vllm-routes-jsonl": import_vllm_routes,
    "expert-jsonl": import_expert_jsonl,
    "flame-csv": import_flame_csv,
    "routed-experts-npy": import_routed_npy,
    "long-table": import_long_table,
}


def import_trace(fmt: str, sources: list[str | Path], model_preset: str | None = None,
                 **options: Any) -> tuple[Trace, ImportReport]:
    """Run the importer for ``fmt``; unknown formats list the valid ones."""
    if fmt not in IMPORTERS:
        raise MoesimError(f"unknown import format '{fmt}'{did_you_mean(fmt, list(IMPORTERS))}; "
                          f"valid formats: {', '.join(IMPORTERS)}.")
    try:
        return IMPORTERS[fmt]([Path(s) for s in sources], model_preset, **options)
    except MoesimError as exc:
        names = [str(s) for s in sources]
        msg = str(exc)
        if any(n in msg or Path(n).name in msg for n in names):
            raise
        raise MoesimError(f"{msg.rstrip('.')} (importing {', '.join(names)}).") from None

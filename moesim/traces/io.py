"""Read, write and validate v1 Parquet traces (``docs/design.md``: "Trace format").

Loading validates the schema and the values (ids in range, k consistent, weights finite) and
fails with a :class:`~simulator.errors.MoesimError` that names the file, the column and the
first bad row. Writing is atomic: a temporary file in the same folder is renamed into place.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from moesim.errors import MoesimError
from moesim.traces.schema import (
    METADATA_KEY,
    OPTIONAL_COLUMNS,
    PER_EXPERT_COLUMNS,
    PHASE_CODES,
    PHASES,
    REQUIRED_COLUMNS,
    SCHEMA_VERSION,
    ModelInfo,
)
from moesim.traces.trace import Trace


def _list_column(values: np.ndarray, width: int, value_type: pa.DataType) -> pa.Array:
    flat = pa.array(values.reshape(-1), type=value_type)
    offsets = pa.array(np.arange(0, values.shape[0] * width + 1, width, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, flat)


def trace_to_table(trace: Trace) -> pa.Table:
    """Arrow table with the v1 columns and the ``moesim`` metadata."""
    k = trace.experts.shape[1]
    cols: dict[str, pa.Array] = {
        "request": pa.array(trace.request.astype(np.int32)),
        "step": pa.array(trace.step.astype(np.int32)),
        "position": pa.array(trace.position.astype(np.int32)),
        "phase": pa.array(np.asarray(PHASES, dtype=object)[trace.phase.astype(np.int64)]
                          if len(trace) else np.asarray([], dtype=object), type=pa.string()),
        "layer": pa.array(trace.layer.astype(np.int16)),
        "experts": _list_column(trace.experts.astype(np.int16), k, pa.int16()),
        "weights": _list_column(trace.weights.astype(np.float32), k, pa.float32()),
    }
    if trace.node is not None:
        cols["node"] = pa.array(trace.node.astype(np.int16))
    if trace.parent is not None:
        cols["parent"] = pa.array(trace.parent.astype(np.int16))
    if trace.accepted is not None:
        cols["accepted"] = pa.array(trace.accepted.astype(bool))
    for name in PER_EXPERT_COLUMNS:
        arr = getattr(trace, name)
        if arr is not None:
            dtype = pa.float16() if arr.dtype == np.float16 else pa.float32()
            cols[name] = _list_column(arr, arr.shape[1], dtype)
    meta = {
        "schema_version": SCHEMA_VERSION,
        "model": trace.model.to_dict(),
        "capture": trace.capture,
    }
    table = pa.table(cols)
    return table.replace_schema_metadata({METADATA_KEY: json.dumps(meta).encode()})


def write_trace(trace: Trace, path: str | os.PathLike[str]) -> Path:
    """Write ``trace`` to ``path`` atomically (temporary file + rename)."""
    from moesim.files import write_atomic

    table = trace_to_table(trace)
    return write_atomic(path, lambda tmp: pq.write_table(table, tmp, compression="zstd"), suffix=".tmp")


def _fail(path: str, message: str) -> MoesimError:
    return MoesimError(f"trace {path}: {message}")


def _unreadable(path: str, exc: Exception) -> MoesimError:
    return _fail(path, f"could not be read ({exc}). The file is corrupt; regenerate it.")


def _decreases(req: np.ndarray, last: Any) -> bool:
    """Whether request ids ``req`` (a batch read after one that ended with ``last``, None for
    the first) go down anywhere."""
    return bool((last is not None and req[0] < last) or (np.diff(req) < 0).any())


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``moesim`` metadata object of a trace file, validated for schema version."""
    p = str(path)
    if not Path(p).is_file():
        raise _fail(p, "no such file. Check the path, or make one with `moesim trace synth`.")
    try:
        schema = pq.read_schema(p)
    except (pa.ArrowException, OSError) as exc:
        raise _fail(p, f"is not a readable Parquet file ({exc}). The file is corrupt or not a "
                    "trace; regenerate it (`moesim trace synth`, `moesim capture`, "
                    "`moesim trace import`).") from None
    raw = (schema.metadata or {}).get(METADATA_KEY)
    if raw is None:
        raise _fail(p, "has no 'moesim' key in its Parquet metadata, so it is not a moesim v1 "
                    "trace. Convert it with `moesim trace import`.")
    try:
        meta = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise _fail(p, f"its 'moesim' metadata is not valid JSON ({exc}).") from None
    version = meta.get("schema_version") if isinstance(meta, dict) else None
    if version != SCHEMA_VERSION:
        hint = ("an older moesim wrote it: re-create it" if isinstance(version, int) and version < SCHEMA_VERSION
                else "a newer moesim wrote it: upgrade moesim")
        raise _fail(p, f"schema_version is {version!r}, this moesim reads version {SCHEMA_VERSION} "
                    f"only ({hint}).")
    return meta


def _fixed_lists(path: str, table: pa.Table, name: str, width: int | None, numbers: bool = False,
                 row0: int = 0) -> np.ndarray:
    """A list column of rows of equal length as a 2-D array; ``numbers``: its values must be
    integers or floats (not strings that happen to parse). Rows are named counting from
    ``row0`` (the table's first row in the file)."""
    col = table.column(name).combine_chunks()
    if not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)):
        raise _fail(path, f"column '{name}' must be a list column, found {col.type}.")
    vt = col.type.value_type
    if numbers and not (pa.types.is_floating(vt) or pa.types.is_integer(vt)):
        raise _fail(path, f"column '{name}' must hold lists of numbers (float32), found lists of {vt}. "
                    "Write the values as numbers, not text.")
    if numbers and col.flatten().null_count:
        raise _fail(path, f"column '{name}' has a null value inside a list; every value must be a number.")
    if col.null_count:
        row = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
        raise _fail(path, f"column '{name}' is null at row {row + row0}.")
    offsets = col.offsets.to_numpy()
    lengths = np.diff(offsets)
    if len(lengths) == 0:
        return np.zeros((0, width or 0), dtype=np.float32)
    expect = width if width is not None else int(lengths[0])
    bad = np.flatnonzero(lengths != expect)
    if bad.size:
        row = int(bad[0])
        raise _fail(path, f"column '{name}' has {int(lengths[row])} entries at row {row + row0}, expected "
                    f"{expect} (model top_k / num_experts). Every row must have the same length.")
    values = col.flatten().to_numpy(zero_copy_only=False)
    start = int(offsets[0])
    return values[start:start + len(lengths) * expect].reshape(len(lengths), expect)


def _finite_at_least(values: np.ndarray, lowest: float = -np.inf) -> bool:
    """Whether every value is finite and at least ``lowest``, from the array's minimum and
    maximum (a NaN makes both NaN), without the per-value masks that find the bad row (issue
    34: the masks and copies of a trace's 64 predictions a row were a fifth of its reading)."""
    if values.size == 0:
        return True
    lo, hi = values.min(), values.max()
    return bool(np.isfinite(lo) and np.isfinite(hi) and lo >= lowest)


def _int_column(path: str, table: pa.Table, name: str, dtype: type[np.integer], lowest: int = 0,
                row0: int = 0) -> np.ndarray:
    col = table.column(name).combine_chunks()
    if not pa.types.is_integer(col.type):
        raise _fail(path, f"column '{name}' must hold integers, found {col.type}.")
    if col.null_count:
        row = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
        raise _fail(path, f"column '{name}' is null at row {row + row0}.")
    arr = col.to_numpy()
    if arr.size and (arr.min() < lowest or arr.max() > np.iinfo(dtype).max):
        row = int(np.flatnonzero((arr < lowest) | (arr > np.iinfo(dtype).max))[0])
        raise _fail(path, f"column '{name}' has value {int(arr[row])} at row {row + row0}; values must be "
                    f"between {lowest} and {np.iinfo(dtype).max}.")
    return arr.astype(dtype)


def _open(p: str) -> tuple[dict[str, Any], ModelInfo, pq.ParquetFile]:
    """The file's metadata, model and Parquet reader; the columns checked against schema v1
    and the file checked to have rows."""
    meta = read_metadata(p)
    model = ModelInfo.from_dict(meta.get("model"), f"trace {p}")  # type: ignore[arg-type]
    try:
        # phase as codes + 3 names, not a string per row; no pre-buffering: its cache of the file's
        # bytes is never evicted while the reader lives (apache/arrow#39808), so a read in pieces
        # grew with the file (by 190 MB over the 256 M-access benchmark's 204 MB file)
        pf = pq.ParquetFile(p, read_dictionary=["phase"], pre_buffer=False)
    except (pa.ArrowException, OSError) as exc:
        raise _unreadable(p, exc) from None
    names = pf.schema_arrow.names
    missing = [c for c in REQUIRED_COLUMNS if c not in names]
    if missing:
        raise _fail(p, f"lacks required column(s) {', '.join(missing)}; schema v1 requires "
                    f"{', '.join(REQUIRED_COLUMNS)}.")
    unknown = [c for c in names if c not in REQUIRED_COLUMNS + OPTIONAL_COLUMNS]
    if unknown:
        raise _fail(p, f"has unknown column(s) {', '.join(unknown)}; valid columns are "
                    f"{', '.join(REQUIRED_COLUMNS + OPTIONAL_COLUMNS)}.")
    if pf.metadata.num_rows == 0:
        raise _fail(p, "has no rows: a trace holds one row per (token, layer) routed. Record it again "
                    "(moesim capture, moesim trace import) or check the program that wrote it.")
    return meta, model, pf


def read_trace(path: str | os.PathLike[str]) -> Trace:
    """Load and validate a v1 trace; raise :class:`MoesimError` naming file, column and row."""
    p = str(path)
    meta, model, pf = _open(p)
    try:
        table = pf.read()  # the footer _open read, the phase column as a dictionary
    except (pa.ArrowException, OSError) as exc:
        raise _unreadable(p, exc) from None
    return _trace_of(p, model, meta.get("capture") or {}, table)


def trace_rows(path: str | os.PathLike[str]) -> int:
    """The number of rows of a v1 trace file (from its footer, nothing else read)."""
    return int(_open(str(path))[2].metadata.num_rows)


def trace_layout(path: str | os.PathLike[str]) -> tuple[ModelInfo, list[str]]:
    """The model and the columns of a v1 trace file (from its metadata and footer)."""
    _, model, pf = _open(str(path))
    return model, list(pf.schema_arrow.names)


def requests_in_order(path: str | os.PathLike[str], batch_rows: int = 1 << 20) -> bool:
    """Whether the file's rows come request by request (request ids never decrease), which a
    chunked read needs; reads the request column alone, a batch at a time."""
    p = str(path)
    last = None
    try:
        for batch in pq.ParquetFile(p).iter_batches(batch_size=batch_rows, columns=["request"]):
            arr = batch.column(0).to_numpy(zero_copy_only=False)  # batches are never empty
            if _decreases(arr, last):
                return False
            last = arr[-1]
    except (pa.ArrowException, OSError) as exc:
        raise _unreadable(p, exc) from None
    return True


def iter_trace(path: str | os.PathLike[str], chunk_rows: int, requests_multiple: int = 1,
               max_requests: int | None = None) -> Iterator[Trace]:
    """The trace file's rows as validated :class:`Trace` pieces of whole requests, in file
    order: rows are read ``chunk_rows`` at a time, and once that many are waiting a piece is cut
    after the last whole batch of ``requests_multiple`` requests among them (a batch never
    straddles two pieces; the rest waits for the next piece); the pieces stop after
    ``max_requests`` requests. The file's request ids must never decrease (:func:`requests_in_order`); errors
    name the row counted from the file's start. Memory: about two pieces' rows."""
    p = str(path)
    meta, model, pf = _open(p)
    capture = meta.get("capture") or {}
    pending: list[pa.Table] = []
    pending_rows = 0
    row0 = 0  # the file row of pending's first row
    taken = 0  # requests yielded so far
    last_id = None

    def cut(table: pa.Table, final: bool) -> tuple[pa.Table | None, pa.Table]:
        """The leading whole batches of requests of ``table`` (None: none yet) and the rest."""
        nonlocal taken
        req = table.column("request").combine_chunks().to_numpy(zero_copy_only=False)
        starts = np.flatnonzero(np.r_[True, req[1:] != req[:-1]])  # each request's first row
        n = len(starts) if final else len(starts) - 1  # the last request may go on in the next batch
        if max_requests is not None and taken + n >= max_requests:
            n = max_requests - taken  # the last piece: its batch may be short, as the trace's last is
        elif not final:
            n -= n % requests_multiple
        if n <= 0:
            return None, table
        end = int(starts[n]) if n < len(starts) else len(req)
        taken += n
        return table.slice(0, end), table.slice(end)

    try:
        # never empty; may span row groups. Decoded on the reading thread itself, not on arrow's
        # pool as well: a replay in pieces keeps two cores busy (the kernel's thread and the one
        # reading), and arrow's threads took the kernel's core from it (on the 2-core
        # machine, ten interleaved pairs of the 25.6 M-access LRU replay, median wall 0.973x and
        # peak memory 537 against 573 MiB; least-stale + score-percentile, six pairs, 0.913x and
        # 565 against 629 MiB)
        for batch in pf.iter_batches(batch_size=chunk_rows, use_threads=False):
            req = batch.column("request").to_numpy(zero_copy_only=False)
            if _decreases(req, last_id):
                raise _fail(p, "its rows are not in request order (request ids decrease); a chunked read "
                            "needs them request by request. Sort the file by request.")
            last_id = req[-1]
            pending.append(pa.Table.from_batches([batch]))
            pending_rows += batch.num_rows
            if pending_rows < chunk_rows:
                continue
            head, rest = cut(pa.concat_tables(pending), False)
            if head is not None:
                yield _trace_of(p, model, capture, head, row0)
                row0 += head.num_rows
            pending, pending_rows = [rest], rest.num_rows
            if max_requests is not None and taken >= max_requests:
                return
        if pending_rows:
            head, _ = cut(pa.concat_tables(pending), True)
            if head is not None:
                yield _trace_of(p, model, capture, head, row0)
    except (pa.ArrowException, OSError) as exc:
        raise _unreadable(p, exc) from None


def _trace_of(p: str, model: ModelInfo, capture: dict[str, Any], table: pa.Table, row0: int = 0) -> Trace:
    """The rows of ``table`` (the file's from row ``row0``) validated as a :class:`Trace`."""
    request = _int_column(p, table, "request", np.int32, row0=row0)
    step = _int_column(p, table, "step", np.int32, row0=row0)
    position = _int_column(p, table, "position", np.int32, row0=row0)
    layer = _int_column(p, table, "layer", np.int16, row0=row0)
    bad = np.flatnonzero(layer >= model.num_layers)
    if bad.size:
        r = int(bad[0])
        raise _fail(p, f"column 'layer' has {int(layer[r])} at row {r + row0}, but the model has "
                    f"{model.num_layers} layers (valid: 0..{model.num_layers - 1}).")
    phase = _phase_codes(p, table, row0)
    experts = _fixed_lists(p, table, "experts", model.top_k, row0=row0)
    if experts.dtype.kind not in "iu":
        raise _fail(p, "column 'experts' must hold integer expert ids.")
    if experts.size and (experts.min() < 0 or experts.max() >= model.num_experts):  # then the mask names the row
        r = int(np.flatnonzero(((experts < 0) | (experts >= model.num_experts)).any(axis=1))[0])
        raise _fail(p, f"column 'experts' has expert id(s) {experts[r].tolist()} at row {r + row0}; ids must "
                    f"be 0..{model.num_experts - 1} (model {model.name} has {model.num_experts} "
                    "experts per layer). Check --preset or the trace's metadata.")
    experts = experts.astype(np.int16)
    if model.top_k > 1 and len(experts):
        dup = np.flatnonzero(_repeats(experts))
        if dup.size:
            r = int(dup[0])
            raise _fail(p, f"column 'experts' repeats an expert at row {r + row0} ({experts[r].tolist()}); "
                        "top-k ids must be distinct.")
    weights = _fixed_lists(p, table, "weights", model.top_k, numbers=True, row0=row0).astype(np.float32, copy=False)
    if not _finite_at_least(weights, 0):  # then the masks name the first bad row
        r = int(np.flatnonzero((~np.isfinite(weights) | (weights < 0)).any(axis=1))[0])
        raise _fail(p, f"column 'weights' has non-finite or negative values at row {r + row0} "
                    f"({weights[r].tolist()}).")
    optional: dict[str, np.ndarray | None] = {}
    for name, lowest in (("node", 0), ("parent", -1)):  # parent -1: a root without a parent
        optional[name] = (_int_column(p, table, name, np.int16, lowest, row0=row0)
                          if name in table.column_names else None)
    optional["accepted"] = None
    if "accepted" in table.column_names:
        acc = table.column("accepted").combine_chunks()
        if not pa.types.is_boolean(acc.type):
            raise _fail(p, f"column 'accepted' must hold booleans, found {acc.type}.")
        if acc.null_count:
            row = int(np.flatnonzero(acc.is_null().to_numpy(zero_copy_only=False))[0])
            raise _fail(p, f"column 'accepted' is null at row {row + row0}.")
        optional["accepted"] = acc.to_numpy(zero_copy_only=False).astype(bool)
    for name in PER_EXPERT_COLUMNS:
        if name in table.column_names:
            arr = _fixed_lists(p, table, name, model.num_experts, numbers=True, row0=row0).astype(np.float32, copy=False)
            if not _finite_at_least(arr):  # then the mask names the first bad row
                r = int(np.flatnonzero(~np.isfinite(arr).all(axis=1))[0])
                raise _fail(p, f"column '{name}' has non-finite values at row {r + row0}.")
            optional[name] = arr
        else:
            optional[name] = None
    return Trace(model=model, request=request, step=step, position=position, phase=phase,
                 layer=layer, experts=experts, weights=weights, capture=capture, source=p,
                 **optional)


def _repeats(experts: np.ndarray) -> np.ndarray:
    """Per row, whether an expert id occurs twice: column pairs compared (k(k-1)/2 passes
    over the rows, no sort) up to top-16, a row-wise sort beyond."""
    k = experts.shape[1]
    if k > 16:
        srt = np.sort(experts, axis=1)
        return (srt[:, 1:] == srt[:, :-1]).any(axis=1)
    out = np.zeros(len(experts), dtype=bool)
    cols = [np.ascontiguousarray(experts[:, j]) for j in range(k)]
    for i in range(k):
        for j in range(i + 1, k):
            out |= cols[i] == cols[j]
    return out


def _phase_codes(p: str, table: pa.Table, row0: int) -> np.ndarray:
    """The phase column as codes into :data:`PHASES` (through a dictionary encoding: one
    string comparison per distinct value, not per row)."""
    phase_col = table.column("phase").combine_chunks()
    if not (pa.types.is_string(phase_col.type) or pa.types.is_large_string(phase_col.type)
            or pa.types.is_dictionary(phase_col.type)):
        raise _fail(p, f"column 'phase' must hold strings ({', '.join(PHASES)}), found {phase_col.type}.")
    enc = phase_col.dictionary_encode()  # a dictionary column is its own encoding
    names = enc.dictionary.to_pylist()
    lut = np.array([PHASE_CODES.get(n, -1) for n in names] + [-1], dtype=np.int8)  # -1: not a phase, or null
    idx = enc.indices.fill_null(len(names)).to_numpy(zero_copy_only=False)
    phase = lut[idx.astype(np.int64)]
    bad = np.flatnonzero(phase < 0)
    if bad.size:
        r = int(bad[0])
        val = enc[r].as_py()
        raise _fail(p, f"column 'phase' has {val!r} at row {r + row0}; valid phases are "
                    f"{', '.join(PHASES)}.")
    return phase

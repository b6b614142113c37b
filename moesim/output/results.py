"""Writing results atomically and printing the summary table."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml

from moesim.config.scenario import Scenario
from moesim.errors import MoesimError
from moesim.traces.schema import PHASES


class PassRows:
    """A replay's per-pass rows, handed over a block of consecutive passes at a time
    (:meth:`add`). One block stays in memory as it is. From the second on, every block goes
    to a Parquet file in a temporary folder as it comes (a trace read in pieces
    kept about 1 KB a pass, 2.5 GB at 256 M expert accesses), written on a second thread
    while the replay goes on (one block in flight at most), which :attr:`Result.steps` reads
    when asked and :func:`write_results` copies; the folder goes when this goes. With
    ``keep=False`` the rows are dropped as they come (only the summary is wanted)."""

    def __init__(self, keep: bool = True) -> None:
        self.keep = keep
        self.frame: pd.DataFrame | None = None  # the first block, while it is the only one
        self.path: Path | None = None
        self._writer: Any = None
        self._pool: Any = None
        self._pending: Any = None  # the block being written

    def add(self, columns: dict[str, np.ndarray]) -> None:
        """Take a block's per-pass columns (``phase`` as codes into :data:`PHASES`), made into
        a frame only when the rows are kept."""
        if not self.keep:
            return
        steps = pd.DataFrame({**columns, "phase": pd.Categorical.from_codes(columns["phase"],
                                                                          categories=pd.Index(PHASES))})
        if self.frame is None and self.path is None:
            self.frame = steps
            return
        if self.path is None:
            self._open()
            first, self.frame = self.frame, None
            assert first is not None
            self._write(first)
        self._write(steps)

    def _open(self) -> None:
        import weakref
        from concurrent.futures import ThreadPoolExecutor

        try:
            folder = Path(tempfile.mkdtemp(prefix="moesim-steps-"))
        except OSError as exc:
            raise self._error(tempfile.gettempdir(), exc) from None
        weakref.finalize(self, shutil.rmtree, folder, True)  # the folder goes with this
        self.path = folder / "steps.parquet"
        self._pool = ThreadPoolExecutor(1)

    def _write(self, steps: pd.DataFrame) -> None:
        self._wait()  # one block in flight: memory for two blocks at most
        self._pending = self._pool.submit(self._write_now, steps)

    def _write_now(self, steps: pd.DataFrame) -> None:
        """Write a block (on the writer's thread; pyarrow lets go of the GIL)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.Table.from_pandas(steps, preserve_index=False)
        if self._writer is None:
            self._writer = pq.ParquetWriter(self.path, table.schema)
        self._writer.write_table(table)

    def _wait(self) -> None:
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        try:
            pending.result()
        except OSError as exc:
            raise self._error(self.path.parent if self.path else None, exc) from None

    @staticmethod
    def _error(where: Any, exc: OSError) -> MoesimError:
        return MoesimError(f"cannot write a long replay's per-pass rows to the temporary folder {where} "
                           f"({exc.strerror or exc}). Set TMPDIR to a writable folder with room (about 50 "
                           "bytes a forward pass).")

    def close(self) -> None:
        """Finish writing (the rows on disk are then complete)."""
        self._wait()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def read(self) -> pd.DataFrame:
        """All the rows as one DataFrame (the Parquet file read, when they went to one)."""
        if not self.keep:
            raise MoesimError("this replay kept no per-pass rows (it was asked for its summary alone: "
                              "Simulation(keep_rows=False), moesim run --no-write). Replay it with them kept "
                              "to read them.")
        if self.path is None:
            assert self.frame is not None, "no per-pass rows were handed over"
            return self.frame
        self.close()
        return pd.read_parquet(self.path)

    def copy_to(self, path: Path) -> None:
        """Write all the rows to ``path`` (the Parquet file copied, when they went to one)."""
        if self.path is None:
            self.read().to_parquet(path, index=False)
            return
        self.close()
        shutil.copyfile(self.path, path)


class Result:
    """What a run produces: one row per forward pass (``steps``), one per request, and the
    summary (``moesim.simulator.engine.Simulation.run``); ``transfers`` and ``extra`` carry
    the timeline when it was recorded. A long replay's per-pass rows wait on disk
    (:class:`PassRows`) until ``steps`` is first read."""

    def __init__(self, scenario: Scenario, steps: pd.DataFrame | PassRows, requests: pd.DataFrame,
                 summary: dict[str, Any], transfers: list[tuple[int, str, float, float, float, int]] | None = None,
                 extra: dict[str, Any] | None = None) -> None:
        self.scenario = scenario
        self._steps = steps
        self.requests = requests
        self.summary = summary
        self.transfers = transfers  # key, kind, issued, start, done, bytes
        self.extra: dict[str, Any] = extra if extra is not None else {}

    @property
    def steps(self) -> pd.DataFrame:
        """One row per forward pass (read from disk on first use when the replay put them there)."""
        if isinstance(self._steps, PassRows):
            self._steps = self._steps.read()
        return self._steps

    def _write_steps(self, path: Path) -> None:
        if isinstance(self._steps, PassRows):
            self._steps.copy_to(path)
        else:
            self._steps.to_parquet(path, index=False)

    def __getstate__(self) -> dict[str, Any]:  # pickled with its rows, not a temporary file's name
        state = dict(self.__dict__)
        state["_steps"] = self.steps
        return state


RESULT_FILES = ("summary.json", "steps.parquet", "requests.parquet", "scenario.resolved.yaml")


def write_results(result: Result, out_dir: str | os.PathLike[str], extra: dict[str, str] | None = None,
                  files: dict[str, Callable[[Path], Any]] | None = None,
                  seal: Callable[[Path], Any] | None = None) -> Path:
    """Write ``summary.json``, ``steps.parquet`` (``requests.parquet`` too when serving under
    load) and ``scenario.resolved.yaml`` into
    ``out_dir`` atomically: everything goes to a temporary sibling folder that then replaces
    ``out_dir`` in one rename, so a failure leaves the old results (or nothing). ``extra``:
    more files by name and text; ``files``: more files by path relative to ``out_dir`` and a
    function that writes one to the path it is given (a timeline asked for inside the
    folder), so that they are part of the folder that replaces the old one; ``seal`` is called
    with the temporary folder once every file is in it (a sweep point records their sizes and
    digests)."""
    target = Path(out_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        (tmp / "summary.json").write_text(json.dumps(result.summary, indent=2, sort_keys=False) + "\n")
        result._write_steps(tmp / "steps.parquet")
        if result.scenario.workload.arrivals is not None:  # serving: one row per request served
            result.requests.to_parquet(tmp / "requests.parquet", index=False)
        (tmp / "scenario.resolved.yaml").write_text(
            yaml.safe_dump(result.scenario.to_dict(), sort_keys=False))
        for name, text in (extra or {}).items():
            (tmp / name).write_text(text)
        for rel, write in (files or {}).items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            write(tmp / rel)
        if seal is not None:
            seal(tmp)
        old = None
        if target.exists():
            old = target.parent / f".{target.name}.old-{os.getpid()}"
            os.rename(target, old)
        os.rename(tmp, target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _fmt(value: Any, key: str) -> str:
    """One unit per kind of figure: times in ms, bytes in GB, rates and counts as they are."""
    if value is None:
        return "-"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_fmt(v, key)}" for k, v in value.items())
    if key.endswith("_s") and key not in RATES and isinstance(value, int | float):
        return f"{value * 1e3:,.3f} ms"
    if key.startswith("bytes") and isinstance(value, int | float):
        return f"{value / 1e9:,.3f} GB"
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 1000 else f"{value:.4g}"
    return str(value)


RATES = ("tokens_per_s", "throughput_tokens_s", "requests_per_s", "goodput_requests_s")  # per second, not times
SERVING_ROWS = ("served_requests", "offered_rate", "requests_per_s", "throughput_tokens_s", "ttft_mean_s",
                "ttft_p50_s", "ttft_p99_s", "tpot_mean_s", "tpot_p50_s", "tpot_p99_s", "itl_p50_s", "itl_p99_s", "e2e_p99_s",
                "queue_mean_s",
                "preemptions", "recomputed_tokens", "slo_attainment", "goodput_requests_s", "max_running_seen", "kv_capacity_tokens",
                "future_runs", "future_exact", "future_note")
SUMMARY_ROWS = ("hits", "misses", "hit_rate", "collision_misses", "late_prefetches",
                "prefetches_issued", "prefetches_used", "prefetch_precision", "prefetch_recall",
                "uncached_fetches", "bytes_by_link", "stall_s", "ttft_s", "tpot_s",
                "tokens_per_s", "mean_accepted_tokens", "speedup_vs_autoregressive", "link_utilisation", "unique_experts_per_layer",
                "unique_experts_per_layer_prefill", "gate_mass_retained", "tokens_altered",
                "low_precision_experts", "dropped_experts", "substituted_experts", "gpus", "max_experts_per_gpu",
                "gpu_load", "gpu_hit_rate", "gpu_link_utilisation",
                "total_time_s", "forward_passes", "tokens", "requests")


def summary_table(result: Result, title: str) -> Any:
    """A rich Table of the main metrics."""
    from rich.table import Table

    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in SUMMARY_ROWS:
        if key in result.summary and not (key in ("gpus", "max_experts_per_gpu") and result.summary.get("gpus", 1) == 1):
            table.add_row(key, _fmt(result.summary[key], key))
    for key in SERVING_ROWS:  # serving under load
        if key in result.summary:
            table.add_row(key, _fmt(result.summary[key], key))
    for note in result.summary.get("arrival_notes", []):
        table.add_row("arrivals", note)
    if "replay_path" in result.summary:  # which replay ran: the compiled kernel, or SimPy and why
        why = result.summary.get("replay_path_reason")
        table.add_row("replay_path", result.summary["replay_path"] + (f" ({why})" if why else ""))
    if "warning" in result.summary:
        table.add_row("warning", result.summary["warning"])
    return table

"""Sweeps: the cartesian product of named axes, each point run in its own worker process.

Axes come from ``--grid dotted.key=v1,v2,...`` or, when no ``--grid`` is given, from the
scenario's ``sweep:`` section (a ``--grid`` on the command line is the whole grid)::

    sweep:
      axes:
        cache.capacity: [1%, 5%, 25%]
        hardware.links.pcie.bandwidth_gbps: [5, 16, 32]
        policies.eviction: [lru, least-stale]
      zip: [[cache.capacity, policies.eviction]]   # optional: axes that advance together

Each point writes ``DIR/points/<id>/`` (summary.json, steps.parquet, scenario.resolved.yaml,
point.json) atomically, or ``error.json`` when it fails; the sweep goes on. Point ids are a
hash of the point's overrides, so they do not depend on the order of the run. A finished
point is reused on a rerun only when its fingerprint (:func:`moesim.studies.fingerprint.scenario_fingerprint`:
the fully resolved scenario, the content of the trace and other input files, the loaded
plugins' sources, the hardware as built from its profile, and moesim's code) equals the one
recorded in its ``point.json``; otherwise it runs again and replaces the folder. So rerunning
resumes an interrupted sweep and never shows results computed from other inputs.
``DIR/results.parquet`` has one row per finished point: its axis values and every summary
metric (nested ones flattened with dots). One sweep or compare at a time writes a folder: a
second one started into it is refused (``DIR/.lock``). A finished point is reused only whole:
its ``point.json`` records each file's size and SHA-256 as written, and a point whose files no
longer match is run again, saying which file and why (:func:`check_point`). Points of an
earlier sweep of other values into the same folder are named on a rerun, and removed with
``--prune``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from moesim.config.scenario import (
    apply_overrides,
    cli_paths,
    parse_set,
    read_yaml,
    resolve_path,
    scenario_from_dict,
)
from moesim.errors import MoesimError, did_you_mean
from moesim.files import write_atomic


class RunsFailed(MoesimError):
    """Some of a comparison's runs failed (exit 1: not a bad input; see their error.json)."""

    exit_code = 1


def joined_rows(rows: list[dict[str, Any]], results: pd.DataFrame) -> pd.DataFrame:
    """A comparison's row plan (each row's ``point``) joined with its points' results; a
    failed run raises :class:`RunsFailed` naming the first (its label, capacity and rate)."""
    table = pd.DataFrame(rows).merge(results, on="point", how="left", suffixes=("", "_point"))
    failed = table[table["status"] != "ok"]
    if len(failed):
        first = failed.iloc[0]
        rate = f", rate {first['rate']:g}" if "rate" in first else ""
        raise RunsFailed(f"compare: {len(failed)} of {len(table)} runs failed; the first, '{first['label']}' at "
                         f"capacity {first['capacity']}{rate}: {first.get('error', '?')}")
    return table


@dataclass(frozen=True)
class Point:
    """One grid point: its id and the dotted-key overrides that define it."""

    pid: str
    values: dict[str, Any]
    fingerprint: str  # of everything that determines its results (studies.fingerprint)
    # the synthetic trace planning made for it, handed to the point's process so that it does not
    # make it again (a quickstart point: 0.7 s of 1.7); None: the point loads its trace itself
    trace: Any = field(default=None, compare=False, repr=False)


def parse_grid(items: tuple[str, ...] | list[str]) -> dict[str, list[Any]]:
    """``["a.b=1,2", ...]`` -> ``{"a.b": [1, 2]}`` (each value parsed as YAML)."""
    axes: dict[str, list[Any]] = {}
    for item in items:
        if "=" not in item:
            raise MoesimError(f"--grid '{item}' must look like dotted.key=v1,v2,... (e.g. cache.capacity=1%,5%).")
        key, raw = item.split("=", 1)
        values = [v for v in raw.split(",") if v != ""]
        if not values:
            raise MoesimError(f"--grid '{item}' has no values.")
        axes[key] = [cli_paths(parse_set([f"{key}={v}"]))[0][1] for v in values]
    return axes


def base_data(scenario_path: str, overrides: tuple[str, ...] = ()) -> tuple[Path, dict[str, Any], Any]:
    """The scenario file, its data with ``overrides`` applied (without ``sweep:``), and its
    ``sweep:`` section."""
    p = resolve_path(scenario_path)
    data = read_yaml(p) or {}
    if not isinstance(data, dict):
        raise MoesimError(f"{p}: a scenario must be a YAML mapping.")
    data = apply_overrides(data, cli_paths(parse_set(list(overrides))))
    section = data.pop("sweep", None) or {}
    return p, data, section


def trace_key(sc: Any) -> str:
    """What a scenario's trace depends on (its source, the folder relative paths start from,
    the seed a synthetic trace defaults to): scenarios with the same key load the same trace."""
    from moesim.config.confload import to_plain

    return json.dumps([to_plain(sc.workload.trace), sc.base_dir, sc.seed], sort_keys=True, default=str)


def make_points(p: Path, data: dict[str, Any], combos: list[dict[str, Any]],
                traces: dict[str, Any] | None = None) -> list[Point]:
    """A point per set of dotted-key overrides, each point's scenario validated and its
    replay built (trace, workload, cache sizing, policies) before anything runs, so a bad
    value fails up front, naming the point; the id is a hash of the overrides, so it does
    not depend on the order of the run. ``traces`` (by :func:`trace_key`) holds traces the
    caller has loaded already; each trace is loaded and each workload built once."""
    from moesim.config.confload import to_plain
    from moesim.policies.plugins import loaded_plugins
    from moesim.simulator.build import load_trace, scenario_workload
    from moesim.simulator.engine import Simulation
    from moesim.studies.fingerprint import scenario_fingerprint

    plugins = loaded_plugins()
    traces = {} if traces is None else traces
    workloads: dict[str, Any] = {}
    points = []
    for chosen in combos:
        pid = hashlib.sha1(json.dumps(chosen, sort_keys=True, default=str).encode()).hexdigest()[:12]
        point_data = apply_overrides(data, [(k.split("."), v) for k, v in chosen.items()])
        sc = scenario_from_dict(point_data, where=f"{p} (sweep point {chosen})", base_dir=str(p.parent))
        source = trace_key(sc)
        if source not in traces:
            traces[source] = load_trace(sc)
        wl_key = json.dumps([source, to_plain(sc.workload)], sort_keys=True, default=str)
        try:  # builds the workload, cache and policies: what a point checks before it runs
            if sc.workload.arrivals is not None:  # serving forms its passes itself (and checks its limits)
                Simulation(sc, trace=traces[source])
            else:
                if wl_key not in workloads:
                    workloads[wl_key] = scenario_workload(sc, traces[source])
                Simulation(sc, trace=traces[source], workload=workloads[wl_key])
        except MoesimError as exc:
            msg = str(exc) if "(sweep point" in str(exc) else f"sweep point {chosen}: {exc}"
            raise MoesimError(f"{msg} Nothing was run: every point is checked first.") from None
        synthetic = traces[source] if sc.workload.trace.synth is not None else None
        points.append(Point(pid, chosen, scenario_fingerprint(sc, plugins), synthetic))

    data["__base_dir__"] = str(p.parent)
    data["__source__"] = str(p)
    data["__plugins__"] = loaded_plugins()  # a worker loads them before it builds its scenario
    return points


def plan(scenario_path: str, grid: dict[str, list[Any]], overrides: tuple[str, ...] = ()) -> tuple[dict[str, Any], list[Point], list[list[str]]]:
    """The base scenario data (without ``sweep:``) and the points, validating every point's
    scenario before anything runs (a bad axis value fails the sweep up front). A non-empty
    ``grid`` is the whole grid; the scenario's ``sweep:`` section gives it otherwise."""
    p, data, section = base_data(scenario_path, overrides)
    if grid:
        section = {}
    if not isinstance(section, dict) or set(section) - {"axes", "zip"}:
        bad = sorted(set(section) - {"axes", "zip"}) if isinstance(section, dict) else [repr(section)]
        raise MoesimError(f"{p}: key 'sweep.{bad[0]}' is not a known key{did_you_mean(str(bad[0]), ['axes', 'zip'])}; "
                          "valid keys here: axes, zip.")
    axes: dict[str, list[Any]] = {}
    for key, values in (section.get("axes") or {}).items():
        if not isinstance(values, list) or not values:
            raise MoesimError(f"{p}: key 'sweep.axes.{key}' must be a non-empty list of values.")
        axes[str(key)] = values
    axes.update(grid)
    if not axes:
        raise MoesimError(f"{p}: nothing to sweep: give --grid key=v1,v2 or a 'sweep: {{axes: ...}}' section.")
    zips: list[list[str]] = [list(z) for z in (section.get("zip") or [])]
    zipped = {k for z in zips for k in z}
    for z in zips:
        missing = [k for k in z if k not in axes]
        if missing:
            raise MoesimError(f"{p}: key 'sweep.zip' names {missing[0]}, which is not an axis; axes: {', '.join(axes)}.")
        if len({len(axes[k]) for k in z}) != 1:
            raise MoesimError(f"{p}: zipped axes {', '.join(z)} must have the same number of values.")
    groups: list[list[dict[str, Any]]] = []
    for z in zips:
        groups.append([dict(zip(z, vals, strict=True)) for vals in zip(*(axes[k] for k in z), strict=True)])
    for key, values in axes.items():
        if key not in zipped:
            groups.append([{key: v} for v in values])
    combos = []
    for combo in itertools.product(*groups):
        chosen: dict[str, Any] = {}
        for part in combo:
            chosen.update(part)
        combos.append(chosen)
    return data, make_points(p, data, combos), zips


def run_point(data: dict[str, Any], point: Point, out_dir: str) -> tuple[str, str, float]:
    """Run one point in this (worker) process; write its folder atomically. Returns
    (point id, 'ok' | 'error', seconds)."""
    from moesim.output.results import write_results
    from moesim.simulator.engine import Simulation

    t0 = time.perf_counter()
    target = Path(out_dir) / "points" / point.pid
    base = dict(data)
    base_dir = base.pop("__base_dir__", ".")
    source = base.pop("__source__", "<sweep>")
    plugins = base.pop("__plugins__", [])
    try:
        if plugins:
            from moesim.policies.plugins import load_plugins

            load_plugins(plugins, installed=False)
        sc_data = apply_overrides(base, [(k.split("."), v) for k, v in point.values.items()])
        sc = scenario_from_dict(sc_data, where=f"{source} (sweep point {point.values})", base_dir=base_dir)
        result = Simulation(sc, trace=point.trace).run()
        write_results(result, target, seal=lambda folder: seal_point(folder, point))
        return point.pid, "ok", time.perf_counter() - t0
    except Exception as exc:
        msg = str(exc) if isinstance(exc, MoesimError) else "".join(traceback.format_exception(exc))
        _write_error(target, point, msg)
        return point.pid, "error", time.perf_counter() - t0


def _write_error(target: Path, point: Point, message: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    (tmp / "error.json").write_text(json.dumps({"id": point.pid, "values": point.values, "error": message}, indent=2))
    (tmp / "point.json").write_text(json.dumps({"id": point.pid, "values": point.values}))
    if target.exists():
        shutil.rmtree(target)
    os.rename(tmp, target)


# a finished point's files up to this size are read for their digest at every reuse check; larger
# ones only when asked (``--verify``): their sizes are always checked
DIGEST_ALWAYS = 16 << 20


def file_digest(path: Path) -> str:
    """The SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def seal_point(folder: Path, point: Point) -> None:
    """Write the finished point's ``point.json``: its id, values and fingerprint, and each
    file's size and digest as written (reuse checks them: :func:`check_point`)."""
    files = {f.name: {"bytes": f.stat().st_size, "sha256": file_digest(f)}
             for f in sorted(folder.iterdir()) if f.is_file() and f.name != "point.json"}
    (folder / "point.json").write_text(json.dumps(
        {"id": point.pid, "values": point.values, "fingerprint": point.fingerprint, "files": files}, indent=1))


def check_point(folder: Path, verify: bool = False) -> str | None:
    """Why the finished point in ``folder`` cannot be reused as it is (None: it is whole):
    a file its ``point.json`` records is missing, of another size, or (files up to
    :data:`DIGEST_ALWAYS`, every file when ``verify``) of other content than was written; a
    ``point.json`` that records no files (written before they were recorded) is not trusted."""
    try:
        files = json.loads((folder / "point.json").read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        return "its point.json is missing or unreadable"
    if not isinstance(files, dict) or not files:
        return "its point.json records no file sizes and digests (written by an older moesim)"
    for name, rec in files.items():
        f = folder / name
        if not f.is_file():
            return f"{name} is missing"
        size = f.stat().st_size
        if size != rec.get("bytes"):
            return f"{name} is {size:,} bytes, {rec.get('bytes', 0):,} when written"
        if (verify or size <= DIGEST_ALWAYS) and file_digest(f) != rec.get("sha256"):
            return f"{name} is not what was written (its SHA-256 differs)"
    return None


def done_points(out_dir: Path) -> dict[str, str]:
    """Finished points: id -> the fingerprint recorded with them ("" when none was; a failed
    point runs again when the sweep is rerun)."""
    base = out_dir / "points"
    if not base.is_dir():
        return {}
    out = {}
    for d in base.iterdir():
        if d.is_dir() and not d.name.startswith(".") and (d / "summary.json").is_file():
            try:
                out[d.name] = str(json.loads((d / "point.json").read_text()).get("fingerprint", ""))
            except (OSError, ValueError, AttributeError):
                out[d.name] = ""
    return out


def stale_points(out_dir: Path, points: list[Point]) -> list[str]:
    """The point folders of ``out_dir`` (finished or failed) that belong to none of
    ``points``: left by an earlier sweep or compare of other values into the same folder."""
    base = out_dir / "points"
    if not base.is_dir():
        return []
    mine = {p.pid for p in points}
    return sorted(d.name for d in base.iterdir() if d.is_dir() and not d.name.startswith(".") and d.name not in mine)


def other_points(out_dir: Path, points: list[Point], remove: bool = False) -> list[tuple[str, dict[str, Any]]]:
    """The point folders of ``out_dir`` that belong to none of ``points`` (:func:`stale_points`),
    each with the values its ``point.json`` records; removed when ``remove`` (``--prune``)."""
    out = []
    for pid in stale_points(out_dir, points):
        try:
            values = json.loads((out_dir / "points" / pid / "point.json").read_text()).get("values", {})
        except (OSError, ValueError, AttributeError):
            values = {}
        out.append((pid, values if isinstance(values, dict) else {}))
        if remove:
            shutil.rmtree(out_dir / "points" / pid, ignore_errors=True)
    return out


def describe_values(values: dict[str, Any]) -> str:
    """A point's overrides in a line: ``key=value, ...`` (a policy given as a mapping by its name)."""
    def one(v: Any) -> str:
        return str(v.get("name", v)) if isinstance(v, dict) else str(v)

    return ", ".join(f"{k}={one(v)}" for k, v in values.items()) or "the scenario as it is"


@dataclass
class Runs:
    """What :func:`run_points` did: points reused from the folder, run now, and those run again
    although their fingerprint matched because their files were not whole (id -> why)."""

    reused: int = 0
    ran: int = 0
    recomputed: dict[str, str] = field(default_factory=dict)

    def add(self, other: Runs) -> None:
        """Count another call's runs too (a compare's bisection probes)."""
        self.reused += other.reused
        self.ran += other.ran
        self.recomputed.update(other.recomputed)


@contextmanager
def folder_lock(out_dir: Path) -> Iterator[None]:
    """Hold ``DIR/.lock`` while a sweep or compare writes ``DIR``; a second one started into
    the same folder is refused with an error naming it."""
    import fcntl

    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / ".lock").open("a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise MoesimError(f"{out_dir} is being written by another moesim sweep or compare (it holds "
                              f"{out_dir / '.lock'}). Wait for it to finish, or give another --out.") from None
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def clean_partial(out_dir: Path) -> list[Path]:
    """Remove the hidden temporary folders a killed sweep left in ``points/`` (a point is
    written to one, then renamed into place); returns those removed."""
    base = out_dir / "points"
    gone = [d for d in base.iterdir() if d.is_dir() and d.name.startswith(".")] if base.is_dir() else []
    for d in gone:
        shutil.rmtree(d, ignore_errors=True)
    return gone


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = value


def collect(out_dir: Path, points: list[Point]) -> pd.DataFrame:
    """One row per finished point (axis values + summary metrics); written atomically."""
    rows = []
    for pt in points:
        d = out_dir / "points" / pt.pid
        row: dict[str, Any] = {"point": pt.pid}
        row.update({k: v if not isinstance(v, list | dict) else json.dumps(v) for k, v in pt.values.items()})
        if (d / "summary.json").is_file():
            row["status"] = "ok"
            _flatten("", json.loads((d / "summary.json").read_text()), row)
        elif (d / "error.json").is_file():
            row["status"] = "error"
            row["error"] = json.loads((d / "error.json").read_text())["error"].splitlines()[0][:300]
        else:
            continue
        rows.append(row)
    df = pd.DataFrame(rows)
    write_atomic(out_dir / "results.parquet", lambda tmp: df.to_parquet(tmp, index=False))
    df.attrs["axes"] = sorted({k for pt in points for k in pt.values})  # as sweep.yaml lists them
    return df


def describe_grid(points: list[Point], zips: list[list[str]], source: str) -> str:
    """The grid a sweep runs, in words: its point count and each axis with its values, in the
    order the points vary them, and where the axes came from."""
    axes: dict[str, list[Any]] = {}
    for pt in points:
        for key, value in pt.values.items():
            if value not in axes.setdefault(key, []):
                axes[key].append(value)
    parts = [f"{key} ({', '.join(map(str, values))})" for key, values in axes.items()]
    zipped = "".join(f"; {' and '.join(z)} advance together" for z in zips)
    return f"{len(points)} point{'s' if len(points) != 1 else ''} over {' x '.join(parts)} (from {source}){zipped}"


def sweep(scenario_path: str, out_dir: str, grid: dict[str, list[Any]] | None = None,
          overrides: tuple[str, ...] = (), workers: int = 1, executor: str = "local",
          ray_address: str | None = None, progress: Callable[[int, int, int], None] | None = None,
          verify: bool = False, prune: bool = False, say: Callable[[str], None] | None = None) -> pd.DataFrame:
    """Run every point not yet done; return the results table (see module docstring). Its
    ``attrs``: ``runs`` (:class:`Runs`), ``reused``, and ``others``, the folder's points that
    belong to none of this sweep's (removed when ``prune``); ``verify`` checks every finished
    point's files by digest (:func:`check_point`). ``say`` is told the grid (:func:`describe_grid`)
    before any point runs."""
    with workers_started(executor):  # the kernel loads (or compiles) while the points are planned
        data, points, zips = plan(scenario_path, grid or {}, overrides)
        if say is not None:
            say("sweeping " + describe_grid(points, zips, "--grid" if grid else "the scenario's sweep: section"))
        out = Path(out_dir)
        with folder_lock(out):
            write_atomic(out / "sweep.yaml", lambda tmp: Path(tmp).write_text(yaml.safe_dump(
                {"scenario": str(scenario_path), "axes": sorted({k for pt in points for k in pt.values}),
                 "zip": zips, "points": [{"id": p.pid, **p.values} for p in points]}, sort_keys=False)))
            runs = run_points(data, points, out, workers, executor, ray_address, progress, verify)
            others = other_points(out, points, prune)
            df = collect(out, points)
    df.attrs.update(runs=runs, reused=runs.reused, others=others, pruned=prune)
    return df


@contextmanager
def _main_not_reimported() -> Iterator[None]:
    """Workers run moesim code only: hide the caller's main script from multiprocessing, which
    would otherwise import it in every worker ("__mp_main__") and so rerun a sweep() called at
    a script's top level without an ``if __name__ == "__main__"`` guard (BrokenProcessPool)."""
    main = sys.modules.get("__main__")
    saved: dict[str, Any] = {k: main.__dict__[k] for k in ("__file__", "__spec__")
                             if main is not None and k in main.__dict__}
    try:
        if main is not None:
            main.__dict__.pop("__file__", None)
            main.__dict__["__spec__"] = None
        yield
    finally:
        if main is not None:
            main.__dict__.pop("__spec__", None)
            main.__dict__.update(saved)


def _fork_context() -> Any:
    """The local executor's processes: one fresh process per point, forked from a server that
    has the heavy modules and the compiled kernel loaded (plain spawn would re-import
    numpy/pandas/pyarrow and reload the kernel for every point)."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["numpy", "pandas", "pyarrow", "simpy", "moesim.simulator.engine",
                                "moesim.output.results", "moesim.studies.sweep", "moesim.studies._kernel_loaded"])
    return ctx


def start_workers(executor: str) -> bool:
    """With the local executor, start the server the points are forked from now (a no-op when
    it runs), so that it imports the heavy modules and loads the replay kernel, or compiles it
    the first time after an installation, while the caller plans the points on the other core
    (the first ``moesim compare``). Returns whether this call started one."""
    if executor != "local":
        return False
    from multiprocessing import forkserver

    _fork_context()
    server = forkserver._forkserver
    before = server._forkserver_pid  # type: ignore[attr-defined]
    with _main_not_reimported():
        forkserver.ensure_running()
    return server._forkserver_pid != before  # type: ignore[attr-defined]


def stop_workers() -> None:
    """Stop the fork server now, mid-import or mid-compile: a server left to finish its
    preload would go on compiling the kernel on a fresh install for a minute after the command
    has ended (it reads its parent's exit only once its preload is done). The jit helper it may
    have started dies with it (on Linux at once: :func:`moesim.jitplan._die_with_parent`). The
    next :func:`start_workers` starts a new server."""
    import signal
    from multiprocessing import forkserver

    server = forkserver._forkserver
    pid = server._forkserver_pid  # type: ignore[attr-defined]
    if pid is None:
        return
    os.kill(pid, signal.SIGTERM)  # not SIGINT: that prints a traceback on the terminal. A child: a zombie until reaped
    server._stop()  # type: ignore[attr-defined]  # reaps it and forgets it


_forked = 0  # points this process has handed to the fork server (run_points)


@contextmanager
def workers_started(executor: str) -> Iterator[None]:
    """Start the local executor's fork server early (:func:`start_workers`) for a study's
    block; when the block ends with no point handed to a server this block started (planning
    failed on a bad input, or every point was done already), stop it (:func:`stop_workers`), so
    that no kernel load or compile outlives a study that needed none."""
    started = start_workers(executor)
    forked = _forked
    try:
        yield
    finally:
        if started and _forked == forked:
            stop_workers()


def run_points(data: dict[str, Any], points: list[Point], out: Path, workers: int = 1, executor: str = "local",
               ray_address: str | None = None, progress: Callable[[int, int, int], None] | None = None,
               verify: bool = False) -> Runs:
    """Run every point not finished with its own fingerprint and whole files yet (locally, one
    fresh process per point, or on Ray; :func:`check_point`, every file's digest when
    ``verify``); ``progress(finished, failed, total)`` after each. Returns what was reused and
    run (:class:`Runs`)."""
    clean_partial(out)
    done = done_points(out)
    runs = Runs()
    todo = []
    for p in points:
        if done.get(p.pid) != p.fingerprint:
            todo.append(p)
            continue
        why = check_point(out / "points" / p.pid, verify)
        if why is not None:
            runs.recomputed[p.pid] = f"{describe_values(p.values)}: {why}"
            todo.append(p)
    runs.reused, runs.ran = len(points) - len(todo), len(todo)
    failed = 0
    finished = len(points) - len(todo)
    if progress is not None:
        progress(finished, failed, len(points))
    if executor == "ray":
        failed = _run_ray(data, todo, out, workers, ray_address, progress, finished, len(points))
    elif executor == "local" and todo:
        global _forked
        _forked += len(todo)
        ctx = _fork_context()
        fresh: dict[str, Any] = {"max_tasks_per_child": 1} if sys.version_info >= (3, 11) else {}
        with _main_not_reimported():
            pool = ProcessPoolExecutor(workers, ctx, **fresh)  # Python 3.10 reuses worker processes
            try:
                futures = [pool.submit(run_point, data, p, str(out)) for p in todo]
                for fut in as_completed(futures):
                    _, status, _ = fut.result()
                    finished += 1
                    failed += status == "error"
                    if progress is not None:
                        progress(finished, failed, len(points))
            finally:
                pool.shutdown(wait=True, cancel_futures=True)
    elif executor != "local":
        raise MoesimError(f"unknown executor '{executor}'; valid: local, ray.")
    return runs


def _run_ray(data: dict[str, Any], todo: list[Point], out: Path, workers: int, address: str | None,
             progress: Callable[[int, int, int], None] | None, finished: int, total: int) -> int:
    try:
        import ray
    except ImportError:
        raise MoesimError("--executor ray needs Ray: pip install -e '.[ray]'.") from None
    started = False
    if not ray.is_initialized():
        ray.init(address=address, num_cpus=None if address else max(workers, 1), include_dashboard=False,
                 log_to_driver=False)
        started = True
    try:
        remote = ray.remote(num_cpus=1)(run_point)
        refs = [remote.remote(data, p, str(out)) for p in todo]
        failed = 0
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            _, status, _ = ray.get(ready[0])
            finished += 1
            failed += status == "error"
            if progress is not None:
                progress(finished, failed, total)
        return failed
    finally:
        if started:
            ray.shutdown()

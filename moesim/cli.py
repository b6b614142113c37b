"""The ``moesim`` command line.

User errors (bad files, keys, values) print a one-paragraph message and exit with code 2,
without a traceback.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import click

from moesim.errors import MoesimError

T = TypeVar("T")

IMPORT_FORMATS = ("vllm-routes-jsonl", "expert-jsonl", "flame-csv", "routed-experts-npy",
                  "long-table")  # keep in step with traces.importers.IMPORTERS (tested)


class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except MoesimError as exc:
            echo(f"error: {exc}", err=True)
            ctx.exit(exc.exit_code)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="moesim")
def cli() -> None:
    """moesim: trace-driven simulator of MoE expert caching, prefetch and budgeting.

    \b
    Typical use:
      moesim compare                      rank policies on the quickstart scenario
      moesim run quickstart --set cache.capacity=25% --out runs/q
      moesim sweep quickstart --out runs/sq
      moesim plot runs/sq --kind lines --metric tpot_s --x cache.capacity --by policies.eviction \\
          --facet hardware.links.pcie.bandwidth_gbps --out tpot.png
      moesim trace synth --preset olmoe-1b-7b --tokens 2000 --out t.parquet
      moesim mrc t.parquet --policy lru,belady --out mrc
    """
    from moesim.policies.plugins import load_plugins

    load_plugins(installed=True)



def _progress(enabled: bool, label: str) -> Any:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    if not enabled:
        return None
    return Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                    transient=True, console=_stderr_console())


def _with_progress(label: str, run: Callable[[Callable[[int, int], None] | None], T], enabled: bool = True) -> T:
    """``run(progress)`` with a progress bar on stderr when it is a terminal (``progress(done,
    total)`` moves it), else with a line now and then (:class:`~moesim.output.console.LogProgress`)."""
    from moesim.output.console import LogProgress

    if not enabled:
        return run(None)
    prog = _progress(sys.stderr.isatty(), label)
    if prog is None:
        return run(LogProgress(label))
    with prog:
        task = prog.add_task(label, total=None)
        return run(lambda done, total: prog.update(task, completed=done, total=total))


def _stderr_console() -> Any:
    from rich.console import Console

    return Console(stderr=True)


class _OutPath(click.ParamType):
    """An output location, checked when the command line is read — before any work — so that
    a run never ends by failing to write: a folder (``dir``) or a file (``file``) whose
    nearest existing ancestor is a writable folder, and which is not a file where a folder is
    wanted (or the reverse)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.name = "folder" if kind == "dir" else "file"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        p = Path(value)
        opt = f"{param.opts[0] if param is not None else 'output'} {value}"
        if self.kind == "dir" and p.exists() and not p.is_dir():
            raise MoesimError(f"{opt}: {p} is a file, not a folder; choose another folder.")
        if self.kind == "file" and p.is_dir():
            raise MoesimError(f"{opt}: {p} is a folder, not a file; name a file.")
        probe = p if self.kind == "dir" else p.parent
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        if not probe.is_dir():
            raise MoesimError(f"{opt}: {probe} is a file, not a folder; choose another location.")
        if not os.access(probe, os.W_OK | os.X_OK) or not _can_create_in(probe):
            raise MoesimError(f"{opt}: {probe} is not writable; choose a location you can write to.")
        return str(value)


def _can_create_in(folder: Path) -> bool:
    """Whether a folder can really be made in ``folder`` (``os.access`` says yes to root in a
    read-only or virtual file system such as /proc): make one, then remove it."""
    import tempfile

    try:
        os.rmdir(tempfile.mkdtemp(prefix=".moesim-probe-", dir=folder))
    except OSError:
        return False
    return True


OUT_DIR = _OutPath("dir")
OUT_FILE = _OutPath("file")

device_option = click.option(
    "--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
    help="Where to run: auto picks cuda when torch sees a GPU, else cpu.")


def _device(device: str) -> str:
    """``auto`` -> ``cuda`` when torch sees a GPU, else ``cpu``."""
    if device != "auto":
        return device
    try:
        import torch
    except ImportError:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def _deprecated(old: str, new: str, value: Any) -> Any:
    """An old spelling still accepted: say what replaces it."""
    if value is not None:
        echo(f"note: {old} is deprecated; use {new}.", err=True)
    return value


def _load_plugins(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> None:
    if value:
        from moesim.policies.plugins import load_plugins

        load_plugins(value, installed=False)


plugin_option = click.option(
    "--plugin", "plugins", multiple=True, metavar="FILE_OR_MODULE", is_eager=True, expose_value=False,
    callback=_load_plugins,
    help="Load policies from a Python file or an importable module (repeatable). Installed plugins "
         "(entry-point group moesim.plugins) load by themselves.")


@cli.command()
@plugin_option
@click.argument("scenario", required=False, default="quickstart")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a scenario key by its dotted path, e.g. --set cache.capacity=25%. Repeatable.")
@click.option("--out", "out_dir", type=OUT_DIR, default=None,
              help="Results folder (default: runs/<scenario name>). Written atomically; results already there are "
                   "replaced, and the command says so.")
@click.option("--no-write", is_flag=True, help="Print the summary only; write no files (a long replay then keeps no per-pass rows).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON instead of a table.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option("--trace", "trace_file", type=click.Path(dir_okay=False), default=None,
              help="Replay this trace file instead of the scenario's (same as --set workload.trace={path: FILE}).")
@click.option("--events", "events", type=OUT_FILE, default=None,
              help="Also write the run's timeline as a Chrome trace (JSON) that Perfetto opens.")
@click.option("--events-passes", "events_passes", type=int, default=8, show_default=True,
              help="Forward passes the timeline records, from the first (0: all; a whole long run is large).")
def run(scenario: str, overrides: tuple[str, ...], out_dir: str | None, no_write: bool,
        as_json: bool, quiet: bool, trace_file: str | None, events: str | None, events_passes: int) -> None:
    """Replay SCENARIO (a YAML file or a shipped name; default: quickstart).

    Prints a summary table and writes DIR/summary.json, DIR/steps.parquet (one row per
    forward pass) and DIR/scenario.resolved.yaml; with workload.arrivals (serving under load)
    also DIR/requests.parquet (one row per request: queueing, TTFT, TPOT, end-to-end).
    """
    from moesim.config.scenario import load_scenario, resolve_path

    overrides = _with_trace(trace_file, overrides)
    sc = load_scenario(scenario, overrides)
    if not quiet:  # before the heavy imports and the kernel's load: a first line within a second
        say(f"moesim run {scenario}: loading the trace and the replay kernel")
    from rich.console import Console

    from moesim.output.results import RESULT_FILES, summary_table, write_results
    from moesim.simulator.engine import Simulation

    if events_passes < 0:
        raise MoesimError(f"--events-passes must be >= 0 (0: all passes), got {events_passes}.")
    target = Path(out_dir) if out_dir else Path("runs") / resolve_path(scenario).stem
    if events is not None and not no_write and _inside(Path(events), target) in (*RESULT_FILES, "."):
        raise MoesimError(f"--events {events}: that is where the results go ({target}/ holds "
                          f"{', '.join(RESULT_FILES[:-1])} and {RESULT_FILES[-1]}); name another file, e.g. "
                          f"{target / 'events.json'}.")
    _compile_note()
    serving = sc.workload.arrivals is not None  # its timeline adds the passes and the requests
    rec: dict[str, Any] = {"record_transfers": events is not None, "record_layers": events is not None,
                           "record_passes": events_passes or None}

    def replay(progress: Any) -> tuple[Simulation, Any]:
        # per-pass rows only where something reads them: the results folder, the timeline
        sim = Simulation(sc, progress=progress, keep_rows=not no_write or events is not None, **rec)
        return sim, sim.run()

    sim, result = _with_progress("simulating", replay, not quiet)
    if result.summary["replay_path"] == "simpy":  # a user would ask why it took long
        echo(f"note: replayed on the SimPy path, not the compiled kernel: {result.summary['replay_path_reason']}.",
                   err=True)
    timeline: tuple[Callable[[Any], Any], str] | None = None  # the timeline's writer and what to say of it
    if events is not None and serving:
        from moesim.output.events import serving_trace, write_events

        doc = serving_trace(result, events_passes, sim.link_name, sim.model.num_experts, sim.num_prec)
        timeline = (functools.partial(write_events, doc),
                    f"timeline of {doc['otherData']['passes']} forward passes and {doc['otherData']['requests']} "
                    f"requests written to {events} (open it in Perfetto; --events-passes N records more, 0 all)")
    elif events is not None:
        from moesim.output.events import chrome_trace, write_events

        n_pass = sim.wl.num_passes
        shown = n_pass if not events_passes else min(events_passes, n_pass)
        timeline = (functools.partial(write_events, chrome_trace(result, sim.link_name, sim.model.num_experts,
                                                                 sim.num_prec)),
                    f"timeline of passes 0-{shown - 1} of {n_pass} written to {events} (open it in Perfetto; "
                    "--events-passes N records more, 0 all)")
    if as_json:
        click.echo(json.dumps(result.summary, indent=2))
    else:
        Console().print(summary_table(result, f"moesim run {scenario}"))
    inside = None if no_write or events is None else _inside(Path(events), target)
    if timeline is not None and inside is None:
        timeline[0](events)
    if not no_write:
        replaced = target.exists()
        # a timeline inside the results folder is written with it, or the folder's replacement would remove it
        write_results(result, target, files={inside: timeline[0]} if timeline is not None and inside else None)
        echo(f"results written to {target}/ (summary.json, steps.parquet, "
                   f"{'requests.parquet, ' if serving else ''}scenario.resolved.yaml"
                   f"{', ' + inside if inside else ''})"
                   + ("; they replace the results that were there" if replaced else ""), err=True)
    if timeline is not None:
        echo(timeline[1], err=True)


def _inside(path: Path, folder: Path) -> str | None:
    """``path`` relative to ``folder`` when it lies inside it (as a POSIX path), else None."""
    try:
        return path.resolve().relative_to(folder.resolve()).as_posix()
    except ValueError:
        return None


@cli.command("sweep")
@plugin_option
@click.argument("scenario")
@click.option("--grid", "grid", multiple=True, metavar="KEY=V1,V2,...",
              help="An axis: dotted key and its values. Repeatable; given, the --grid axes are the whole grid (the "
                   "scenario's sweep: section is not used).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a base scenario key.")
@click.option("--out", "out_dir", type=OUT_DIR, default=None, help="Sweep folder (default: runs/sweep-<scenario name>).")
@click.option("--executor", type=click.Choice(["local", "ray"]), default="local", show_default=True)
@click.option("--workers", type=int, default=None, help="Worker processes (default: CPU count).")
@click.option("--ray-address", default=None, help="With --executor ray: an existing cluster (default: a local instance).")
@click.option("--trace", "trace_file", type=click.Path(dir_okay=False), default=None,
              help="Replay this trace file instead of the scenario's (same as --set workload.trace={path: FILE}).")
@click.option("--verify", is_flag=True,
              help="Check every finished point's files by their digests before reusing it (files up to 16 MB are "
                   "always checked; larger ones by size unless this is given).")
@click.option("--prune", is_flag=True,
              help="Remove the folder's points that belong to none of this run's (left by a run of other values).")
def sweep_cmd(scenario: str, grid: tuple[str, ...], overrides: tuple[str, ...], out_dir: str | None,
              executor: str, workers: int | None, ray_address: str | None, trace_file: str | None, verify: bool,
              prune: bool) -> None:
    """Run SCENARIO over the cartesian product of its axes, one worker process per point;
    rerunning resumes. The axes are the --grid options when any is given, else the scenario's
    'sweep:' section. Writes DIR/points/<id>/ and DIR/results.parquet."""
    import os as _os

    from rich.console import Console

    from moesim.config.scenario import resolve_path
    from moesim.studies.sweep import parse_grid, sweep

    overrides = _with_trace(trace_file, overrides)
    n_workers = workers if workers is not None else (_os.cpu_count() or 1)
    if n_workers < 1:
        raise MoesimError(f"--workers must be >= 1, got {n_workers}.")
    target = Path(out_dir) if out_dir else Path("runs") / f"sweep-{resolve_path(scenario).stem}"
    OUT_DIR.convert(str(target), None, None)  # the default folder, checked as --out is
    _compile_note()
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    from moesim.output.console import LogProgress

    tty = sys.stderr.isatty()
    prog = Progress(TextColumn("sweep"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[failed]} failed"),
                    TimeRemainingColumn(), console=_stderr_console(), disable=not tty)
    log = LogProgress("sweep")
    say(f"moesim sweep {scenario}: planning the points (results in {target}/)")
    with prog, _interrupted_note(target, "sweep"):
        task = prog.add_task("sweep", total=None, failed=0)
        df = sweep(scenario, str(target), parse_grid(grid), overrides, n_workers, executor, ray_address,
                   progress=(lambda d, f, n: prog.update(task, completed=d, total=n, failed=f)) if tty else
                   (lambda d, f, n: log(d, n)), verify=verify, prune=prune, say=say)
    ok = int((df["status"] == "ok").sum()) if len(df) else 0
    Console().print(f"{len(df)} points ({ok} ok, {len(df) - ok} failed) -> {target}/results.parquet")
    _runs_note(df.attrs, target, "sweep")
    if ok < len(df):
        bad = df[df["status"] != "ok"]
        for row in bad.to_dict("records"):
            where = ", ".join(f"{a}={row[a]}" for a in df.attrs["axes"] if row.get(a) is not None)
            echo(f"failed point {row['point']} ({where}): {row.get('error', '?')}", err=True)
        echo(f"{len(bad)} of {len(df)} points failed; each has DIR/points/<id>/error.json. Fix the cause and "
                   "rerun the same command: finished points are kept, failed ones run again.", err=True)
        raise SystemExit(1)


@cli.command("plot")
@click.argument("results")
@click.option("--kind", type=click.Choice(["heatmap", "lines", "bars", "timeline"]), required=True)
@click.option("--metric", default=None, help="A results column, e.g. tpot_s, hit_rate (not for timeline).")
@click.option("--window", default=None, metavar="START:END", help="timeline: time window in ms.")
@click.option("--x", "x", default=None, help="The axis on the horizontal axis (a results column).")
@click.option("--y", "y", default=None, help="heatmap: the vertical axis.")
@click.option("--by", "by", default=None, help="lines/bars: one line or bar group per value of this column.")
@click.option("--facet", default=None, help="One panel per value of this column.")
@click.option("--where", "where", multiple=True, metavar="KEY=VALUE",
              help="Keep only the results with this axis value. Repeatable.")
@click.option("--title", default=None)
@click.option("--out", "out", required=True, type=OUT_FILE, help="FILE.png, .svg or .pdf")
def plot_cmd(results: str, kind: str, metric: str | None, window: str | None, x: str | None, y: str | None,
             by: str | None, facet: str | None, where: tuple[str, ...], title: str | None, out: str) -> None:
    """Plot a sweep's RESULTS (folder or results.parquet) as heatmap, lines or bars, or a run's
    events JSON (`moesim run --events`) as a timeline of the compute and copy streams.

    Every sweep axis a figure does not show (--x, --y, --by, --facet) must be fixed with
    --where: plot refuses to average over it."""
    from moesim.output.plots import plot, plot_timeline

    if kind == "timeline":
        win = None
        if window:
            try:
                a, b = (float(v) for v in window.split(":"))
            except ValueError:
                raise MoesimError(f"--window '{window}' must look like START:END (milliseconds).") from None
            win = (a, b)
        echo(f"wrote {plot_timeline(results, out, win, title)}")
        return
    if metric is None:
        raise MoesimError(f"plot --kind {kind} needs --metric.")
    echo(f"wrote {plot(results, kind, out, metric, x, y, by, title, where, facet)}")


@contextlib.contextmanager
def _interrupted_note(target: Path, what: str) -> Iterator[None]:
    """On Ctrl-C: say how many points the folder keeps and that rerunning resumes (exit 130)."""
    try:
        yield
    except KeyboardInterrupt:
        from moesim.studies.sweep import done_points

        kept = len(done_points(target))
        echo(f"\n{what} interrupted: {target}/points keeps {kept} finished point(s), each written whole; "
                   f"rerun the same command to resume (finished points with the same inputs are reused).", err=True)
        raise SystemExit(130) from None


def _compile_note() -> None:
    """Say so on stderr when this run compiles a form of the replay kernel (the first replay
    of that form after an installation, or after an upgrade changed the kernel), so a long
    first run is not a silent one. Said as the compile starts: a form in numba's cache loads
    without a word."""
    from moesim.output.console import say as note
    from moesim.simulator.kernel import announce_compiles

    announce_compiles(note)


def _with_trace(trace_file: str | None, overrides: tuple[str, ...]) -> tuple[str, ...]:
    """``--trace FILE`` as the override it stands for, before the others."""
    if trace_file is None:
        return overrides
    return (f"workload.trace={{path: {json.dumps(trace_file)}}}", *overrides)


def _runs_note(attrs: Any, target: Path, command: str) -> None:
    """Say what a sweep or compare reused and ran (every bisection probe counted), which
    finished points it ran again because their files were not whole, and which points of the
    folder belong to none of its own (removed with --prune)."""
    from moesim.studies.sweep import describe_values

    runs = attrs["runs"]
    say(f"{runs.reused} of {runs.reused + runs.ran} points reused from {target}/points (whole, with the same "
        f"resolved scenario, input files, plugins and moesim code); {runs.ran} run now.")
    for pid, why in runs.recomputed.items():
        say(f"point {pid} ({why}); run again.")
    others = attrs.get("others") or []
    if others:
        listed = "; ".join(f"{pid} ({describe_values(values)})" for pid, values in others[:5])
        more = f" and {len(others) - 5} more" if len(others) > 5 else ""
        if attrs.get("pruned"):
            say(f"removed {len(others)} point folders of {target}/points that belong to no point of this {command}: "
                f"{listed}{more}.")
        else:
            say(f"{len(others)} point folders of {target}/points belong to no point of this {command} (an earlier "
                f"{command} of other values into the folder): {listed}{more}. {command} --prune removes them.")


def say(text: str) -> None:
    """A note on stderr, wrapped at 80 columns (its continuation lines indented)."""
    echo(text, err=True)


def echo(text: str, err: bool = False) -> None:
    """A line of prose on stdout (or stderr), wrapped at 80 columns."""
    from moesim.output.console import wrapped

    click.echo(wrapped(text), err=err)


def _csv(value: str | None) -> list[str] | None:
    return [v.strip() for v in value.split(",") if v.strip()] if value else None


@cli.command("compare")
@plugin_option
@click.argument("scenario", required=False, default="quickstart")
@click.option("--eviction", default=None, metavar="A,B,...", help="Eviction policies (default: lru,lfu,fld,least-stale).")
@click.option("--prefetch", default=None, metavar="A,B,...",
              help="Prefetch policies (default: none,previous-token, plus next-gate-topk,score-percentile when "
                   "the trace has pred_next; under load (--rate) none, plus the predictors: name previous-token or "
                   "lookahead to add them).")
@click.option("--miss", default=None, metavar="A,B,...", help="Miss policies (default: the scenario's).")
@click.option("--budget", default=None, metavar="A,B,...", help="Budget policies (default: the scenario's).")
@click.option("--capacity", default=None, metavar="C1,C2,...", help="Cache capacities, e.g. 5%,25% (default: the scenario's).")
@click.option("--rate", default=None, metavar="R1,R2,...",
              help="Serving under load: request rates (requests/s) to compare at (default: the scenario's "
                   "workload.arrivals.rate). With an slo, each policy's highest rate within it is found by bisection.")
@click.option("--seeds", type=int, default=None, metavar="N",
              help="Serving under load: arrival draws run at each rate, their requests pooled (default 5: the "
                   "arrival seed and the next four; one for an arrival file).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a scenario key.")
@click.option("--out", "out_dir", type=OUT_DIR, default=None,
              help="Folder (default: runs/compare-<scenario name>, with a suffix naming the configuration when "
                   "any option sets one, so that a compare of other options has its own); rerunning resumes.")
@click.option("--executor", type=click.Choice(["local", "ray"]), default="local", show_default=True)
@click.option("--workers", type=int, default=None, help="Worker processes (default: CPU count).")
@click.option("--ray-address", default=None, help="With --executor ray: an existing cluster.")
@click.option("--trace", "trace_file", type=click.Path(dir_okay=False), default=None,
              help="Replay this trace file instead of the scenario's (same as --set workload.trace={path: FILE}).")
@click.option("--verify", is_flag=True,
              help="Check every finished point's files by their digests before reusing it (files up to 16 MB are "
                   "always checked; larger ones by size unless this is given).")
@click.option("--prune", is_flag=True,
              help="Remove the folder's points that belong to none of this run's (left by a run of other values).")
def compare_cmd(scenario: str, eviction: str | None, prefetch: str | None, miss: str | None, budget: str | None,
                capacity: str | None, rate: str | None, seeds: int | None, overrides: tuple[str, ...],
                out_dir: str | None, executor: str, workers: int | None, ray_address: str | None,
                trace_file: str | None, verify: bool, prune: bool) -> None:
    """Rank policy combinations on SCENARIO: each candidate beside on-demand LRU (the baseline),
    Belady with oracle prefetch (the bound) and an infinite cache, by TPOT (TTFT without decode
    passes), with speedup over the baseline and the share of the baseline-to-bound gap closed.
    Writes OUT/compare.parquet, OUT/compare.md and OUT/compare.png.

    A SCENARIO with workload.arrivals (serving under load) is compared at each --rate: p50/p99
    TTFT and TPOT, SLO attainment and goodput per policy over --seeds arrival draws; with an
    slo, each policy's highest rate meeting it and its range over the draws
    (OUT/capacity.parquet); OUT/compare.png plots p99 latency against load."""
    from moesim.config.scenario import resolve_path
    from moesim.studies.compare import compare, terminal

    overrides = _with_trace(trace_file, overrides)
    n_workers = workers if workers is not None else (os.cpu_count() or 1)
    if n_workers < 1:
        raise MoesimError(f"--workers must be >= 1, got {n_workers}.")
    options = (eviction, prefetch, miss, budget, capacity, rate, overrides) + ((seeds,) if seeds is not None else ())
    target = Path(out_dir) if out_dir else _compare_folder(resolve_path(scenario).stem, options)
    OUT_DIR.convert(str(target), None, None)  # the default folder, checked as --out is
    say(f"moesim compare {scenario}: planning the points (results in {target}/)")
    _compile_note()
    rates = None
    if rate:
        try:
            rates = [float(r) for r in _csv(rate) or []]
        except ValueError:
            raise MoesimError(f"--rate {rate}: give request rates as numbers, e.g. --rate 1,2,4.") from None
    args = (scenario, target, _csv(eviction), _csv(prefetch), _csv(miss), _csv(budget), _csv(capacity), overrides,
            n_workers, executor, ray_address)
    with _interrupted_note(target, "compare"):
        table, _ = _with_progress("compare", lambda progress: compare(
            *args, progress=(lambda done, _failed, total: progress(done, total)) if progress else None, rates=rates,
            verify=verify, prune=prune, seeds=seeds))
    click.echo(table.attrs.get("text") or terminal(table, table.attrs["metric"], table.attrs["title"]))
    _runs_note(table.attrs, target, "compare")
    cap = ", capacity.parquet (each policy's highest rate within the SLO)" if "capacity" in table.attrs else ""
    echo(f"wrote {target}/compare.parquet, compare.md (every column){cap} and compare.png")


def _compare_folder(stem: str, options: tuple[Any, ...]) -> Path:
    """A compare's default folder: ``runs/compare-<stem>`` for the scenario as it is, and
    ``runs/compare-<stem>-<8 hex digits>`` (a digest of the options) for each configuration
    the command line makes of it, so that one never replaces another's points and table."""
    import hashlib

    if not any(options):
        return Path("runs") / f"compare-{stem}"
    digest = hashlib.sha256(json.dumps([list(o) if isinstance(o, tuple) else o for o in options]).encode())
    return Path("runs") / f"compare-{stem}-{digest.hexdigest()[:8]}"


@cli.command("mrc")
@plugin_option
@click.argument("trace_file", metavar="TRACE")
@click.option("--policy", "policies", default="lru,belady", show_default=True, metavar="P1,P2,...",
              help="Eviction policies, comma-separated (belady is the bound, drawn dashed).")
@click.option("--capacities", default=None, metavar="C1,C2,...",
              help="Expert counts (1,8,64) or % of the model's experts (1%,5%); default: ~20 log-spaced "
                   "counts from 1 expert to all.")
@click.option("--expert-compute", type=click.Choice(["per-expert", "layer"]), default="per-expert", show_default=True,
              help="per-expert: the sequential stream (LRU from stack distances); layer: a layer's experts pinned "
                   "together (every point replayed).")
@click.option("--batch-size", "batch_size", type=int, default=1, show_default=True, help="Requests per forward pass.")
@click.option("--batch", "batch_old", type=int, default=None, hidden=True)
@click.option("--out", "out_dir", required=True, type=OUT_DIR, help="Folder for mrc.parquet and mrc.png.")
@click.option("--json", "as_json", is_flag=True, help="Print the table as JSON instead of a table.")
def mrc_cmd(trace_file: str, policies: str, capacities: str | None, expert_compute: str, batch_size: int,
            batch_old: int | None, out_dir: str, as_json: bool) -> None:
    """Miss-ratio curves of TRACE: misses and hit rate over cache capacities for each eviction
    policy, demand fetch only, cache-only replay. Writes OUT/mrc.parquet (capacity in experts,
    bytes and % of the model; misses; hit rate; method) and OUT/mrc.png (log capacity axis,
    Belady as the bound)."""
    from moesim.policies.eviction import REGISTRY as EVICTION
    from moesim.studies.mrc import describe, mrc, parse_capacities, write_mrc
    from moesim.traces.io import read_trace

    batch_size = _deprecated("--batch", "--batch-size", batch_old) or batch_size
    if batch_size < 1:
        raise MoesimError(f"--batch-size must be >= 1, got {batch_size}.")
    names = [p.strip() for p in policies.split(",") if p.strip()]
    for name in names:
        EVICTION.get(name, "--policy")
    trace = read_trace(trace_file)
    total = trace.model.num_layers * trace.model.num_experts
    caps = parse_capacities(capacities, total)
    _compile_note()
    df = _with_progress("replays", lambda progress: mrc(trace, names, caps, expert_compute, batch_size,
                                                        progress=progress))
    table, fig = write_mrc(df, out_dir, describe(trace, Path(trace_file).name, expert_compute, batch_size))
    if as_json:
        click.echo(df.to_json(orient="records", indent=1))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table("policy", "capacity (experts)", "% of model", "misses", "hit rate", "method")
    for row in df.itertuples():
        t.add_row(str(row.policy), str(row.capacity_experts), f"{row.capacity_pct:.2f}", str(row.misses),
                  f"{row.hit_rate:.4f}", str(row.method))
    Console().print(t)
    Console().print(f"wrote {table} and {fig}")


TINY_FAMILIES = ("olmoe", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "phimoe", "gpt_oss")


@cli.command("tiny-model")
@click.argument("family", type=click.Choice(TINY_FAMILIES))
@click.argument("out_dir", type=OUT_DIR)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random weights.")
def tiny_model_cmd(family: str, out_dir: str, seed: int) -> None:
    """Write a random-weight FAMILY model small enough for a CPU to OUT_DIR (config.json,
    weights and a word-level tokenizer that knows the words w0 .. w60), built from the
    transformers config class, no download: for trying `moesim capture --model OUT_DIR`.
    Needs the capture extra (torch, transformers)."""
    from moesim.traces.tiny_model import build

    try:
        folder = build(family, Path(out_dir), seed)
    except ImportError as exc:  # pragma: no cover - the capture extra is missing
        raise MoesimError(f"tiny-model needs torch and transformers ({exc}); pip install 'moesim[capture]'.") from None
    echo(f"wrote {folder}/: a 3-layer {family} model with random weights; capture its routing with "
         f"`moesim capture --model {folder} --prompts FILE --out trace.parquet --device cpu` (prompts of the "
         "words w0 .. w60).")


@cli.group()
def trace() -> None:
    """Make, inspect and validate routing traces (Parquet, schema v1)."""


@trace.command("info")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the information as JSON.")
def trace_info_cmd(file: str, as_json: bool) -> None:
    """Validate FILE and print its model, counts, phases and per-layer expert popularity."""
    from rich.console import Console
    from rich.table import Table

    from moesim.traces.info import trace_info
    from moesim.traces.io import read_trace

    info = trace_info(read_trace(file))
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    con = Console()
    m = info["model"]
    con.print(f"[bold]{file}[/bold]  model [bold]{m['name']}[/bold]: {m['num_layers']} layers x "
              f"{m['num_experts']} experts, top-{m['top_k']}, hidden {m['hidden_size']}, expert "
              f"intermediate {m['expert_intermediate_size']}, renormalize={m['renormalize']}")
    con.print("expert bytes: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in m["expert_bytes"].items()))
    con.print(f"rows {info['rows']}  requests {info['requests']}  steps {info['steps']}  tokens "
              f"{info['tokens']}  layers present {info['layers_present']}")
    con.print("tokens by phase: " + (", ".join(f"{k} {v}" for k, v in info["tokens_by_phase"].items()) or "none"))
    if info["optional_columns"]:
        con.print("optional columns: " + ", ".join(info["optional_columns"]))
    rs = info["routing_stats"]
    con.print(f"routing ({'/'.join(rs['phases'])}): top-1 repeat {rs['top1_repeat']:.3f} (uniform "
              f"{1 / m['num_experts']:.3f}), set overlap {rs['set_overlap']:.3f} (uniform "
              f"{m['top_k'] / m['num_experts']:.3f}), popularity skew {rs['popularity_skew']:.3f}, "
              f"layer MI {rs['layer_mi']:.3f}")
    if info["capture"]:
        con.print("capture: " + json.dumps(info["capture"]))
    table = Table(title="expert popularity per layer", header_style="bold")
    for col in ("layer", "selections", "experts used", "max share", "entropy", "top experts (share)"):
        table.add_column(col, justify="right" if col != "top experts (share)" else "left")
    for row in info["layers"]:
        if not row["selections"]:
            table.add_row(str(row["layer"]), "0", "-", "-", "-", "-")
            continue
        tops = "  ".join(f"{e}:{s:.3f}" for e, s in row["top_experts"])
        table.add_row(str(row["layer"]), str(row["selections"]), str(row["experts_used"]),
                      f"{row['max_share']:.3f}", f"{row['entropy']:.3f}", tops)
    con.print(table)


@trace.command("synth")
@click.option("--preset", default=None, help="Model preset: olmoe-1b-7b, mixtral-8x7b, qwen1.5-moe-a2.7b, qwen3-30b-a3b, phi-3.5-moe.")
@click.option("--fit", "fit", default=None, help="A fitted profile (file from `moesim trace fit`, or a shipped name) instead of --preset.")
@click.option("--requests", default=1, show_default=True, type=int, help="Number of requests.")
@click.option("--prompt-tokens", default=0, show_default=True, type=int, help="Prefill tokens per request (0: no prefill).")
@click.option("--tokens", default=2000, show_default=True, type=int, help="Decode tokens per request.")
@click.option("--seed", default=0, show_default=True, type=int, help="Random seed.")
@click.option("--routing", type=click.Choice(["realistic", "uniform"]), default="realistic", show_default=True,
              help="realistic: popularity skew, token reuse, cross-layer correlation; uniform: independent uniform top-k.")
@click.option("--layers", type=int, default=None, help="Override the preset's number of MoE layers.")
@click.option("--experts", type=int, default=None, help="Override experts per layer.")
@click.option("--top-k", type=int, default=None, help="Override top-k.")
@click.option("--skew", type=float, default=None, help="Popularity skew parameter (logit scale).")
@click.option("--reuse", type=float, default=None, help="Previous-token reuse bonus (logits).")
@click.option("--corr", type=float, default=None, help="Cross-layer correlation scale (logits).")
@click.option("--probs", is_flag=True, help="Record full router probabilities (for substitute, cache-aware routing).")
@click.option("--pred-next", is_flag=True, help="Record a next-layer router predictor (for next-gate-topk, score-percentile, speculative).")
@click.option("--pred-noise", type=float, default=1.0, show_default=True, help="Noise of that predictor (logit std; 0 = perfect).")
@click.option("--out", "out", required=True, type=OUT_FILE, help="Output Parquet file (written atomically).")
def trace_synth(preset: str | None, fit: str | None, requests: int, prompt_tokens: int, tokens: int, seed: int, routing: str,
                layers: int | None, experts: int | None, top_k: int | None, skew: float | None,
                reuse: float | None, corr: float | None, probs: bool, pred_next: bool,
                pred_noise: float, out: str) -> None:
    """Write a synthetic trace: REQUESTS requests, each a prefill of PROMPT_TOKENS tokens then
    TOKENS decode tokens, with the preset's shape and tuned routing statistics."""
    from moesim.traces.io import write_trace
    from moesim.traces.synth import synth_from_preset

    for name, value in (("--layers", layers), ("--experts", experts), ("--top-k", top_k)):
        if value is not None and value < 1:
            raise MoesimError(f"{name} must be >= 1, got {value}.")
    if (preset is None) == (fit is None):
        raise MoesimError("give exactly one of --preset and --fit.")
    if fit is not None:
        from moesim.traces.profile import load_profile, synthesise

        if tokens < 1 or requests < 1:
            raise MoesimError("--tokens and --requests must be >= 1.")
        shaped = [name for name, v in (("--layers", layers), ("--experts", experts), ("--top-k", top_k), ("--skew", skew),
                                       ("--reuse", reuse), ("--corr", corr)) if v is not None]
        if shaped or routing != "realistic":
            raise MoesimError(f"{', '.join(shaped) or '--routing'}: a fitted profile gives the shape and the routing "
                              "statistics; leave them out with --fit, or use --preset.")
        t = synthesise(load_profile(fit), requests=requests, tokens=tokens, seed=seed, prompt_tokens=prompt_tokens,
                       probs=probs, pred_next=pred_next, pred_noise=pred_noise)
        write_trace(t, out)
        echo(f"wrote {out}: {len(t)} rows, {t.num_requests} requests, {t.num_tokens()} tokens "
                   f"from fitted profile {fit}")
        return
    assert preset is not None
    t = synth_from_preset(preset, layers=layers, experts=experts, top_k=top_k, routing=routing,
                          skew=skew, reuse=reuse, corr=corr, requests=requests,
                          prompt_tokens=prompt_tokens, tokens=tokens, seed=seed, probs=probs,
                          pred_next=pred_next, pred_noise=pred_noise)
    write_trace(t, out)
    echo(f"wrote {out}: {len(t)} rows, {t.num_requests} requests, {t.num_tokens()} tokens, "
               f"{t.model.num_layers} layers x {t.model.num_experts} experts top-{t.model.top_k}")


@trace.command("import")
@click.option("--format", "fmt", required=True, type=click.Choice(sorted(IMPORT_FORMATS)),
              help="Log layout: vllm-routes-jsonl (layer0-vllm/), expert-jsonl (mixtral-8x7b-vllm/), "
                   "flame-csv (flame-moe-290m/), routed-experts-npy ([tokens, layers, k] arrays), "
                   "long-table (CSV/Parquet, one row per token/layer/expert).")
@click.argument("src", nargs=-1, required=True, type=click.Path())
@click.option("--out", "out", required=True, type=OUT_FILE, help="Output Parquet file (written atomically).")
@click.option("--preset", "model_preset", default=None, help="Model preset giving the shapes the log lacks (e.g. mixtral-8x7b).")
@click.option("--model-preset", "model_preset_old", default=None, hidden=True)
@click.option("--drop-warmup", is_flag=True, help="vllm-routes-jsonl: drop vLLM warm-up dummy rows and report how many.")
@click.option("--tokens-per-sequence", type=int, default=64, show_default=True, help="flame-csv: prefill tokens per sequence.")
@click.option("--columns", default=None, metavar="KEY=COL,...",
              help="long-table: map request, position, layer, expert (and weight, rank, step, phase) to column names.")
def trace_import(fmt: str, src: tuple[str, ...], out: str, model_preset: str | None, model_preset_old: str | None,
                 drop_warmup: bool, tokens_per_sequence: int, columns: str | None) -> None:
    """Convert routing logs (files or folders SRC...) written by other tools into a v1 trace."""
    model_preset = _deprecated("--model-preset", "--preset", model_preset_old) or model_preset
    from moesim.traces.importers import import_trace
    from moesim.traces.io import write_trace

    mapping = None
    if columns:
        try:
            mapping = dict(item.split("=", 1) for item in columns.split(","))
        except ValueError:
            raise MoesimError(f"--columns '{columns}' must look like request=req,position=pos,...") from None
    t, report = import_trace(fmt, list(src), model_preset, drop_warmup=drop_warmup,
                             tokens_per_sequence=tokens_per_sequence, columns=mapping)
    write_trace(t, out)
    echo(f"wrote {out}: {len(t)} rows, {t.num_requests} requests, {t.num_tokens()} tokens")
    for note in report.notes:
        echo(f"note: {note}")


@trace.command("fit")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--out", "out", required=True, type=OUT_FILE, help="Profile YAML to write.")
@click.option("--batch-size", "batch", type=int, default=1, show_default=True,
              help="Requests per forward pass the LRU curves are replayed with.")
@click.option("--batch", "batch_old", type=int, default=None, hidden=True)
@click.option("--name", default=None, help="Profile name (default: the model's).")
def trace_fit(file: str, out: str, batch: int, batch_old: int | None, name: str | None) -> None:
    """Estimate the synthetic routing model from trace FILE (per-layer popularity,
    cross-layer affinity, reuse, batch correlation) and write a profile for `synth --fit`."""
    from moesim.studies.mrc import lru_curve
    from moesim.traces.fit import fit_profile, write_profile
    from moesim.traces.io import read_trace

    batch = _deprecated("--batch", "--batch-size", batch_old) or batch
    if batch < 1:
        raise MoesimError(f"--batch-size must be >= 1, got {batch}.")
    t = read_trace(file)
    profile = _with_progress("fitting", lambda progress: fit_profile(t, lru_curve, batch=batch, name=name,
                                                                     progress=progress))
    write_profile(profile, out)
    r = profile["report"]
    echo(f"wrote {out}: weights {profile['weights']}")
    echo(f"LRU hit rate at {r['cache_fractions']} of all experts: real {r['lru_hit_rate_real']}, "
               f"synthetic {r['lru_hit_rate_synthetic']} (max gap {r['max_hit_rate_gap']})")


@cli.command("capture")
@click.option("--model", "model_path", required=True, type=click.Path(), help="Local folder of a Hugging Face MoE model (config.json + weights).")
@click.option("--prompts", required=True, type=click.Path(dir_okay=False, exists=True), help="Text file, one prompt per line (token ids when the model has no tokenizer).")
@click.option("--out", "out", required=True, type=OUT_FILE, help="Output trace (Parquet, written atomically).")
@device_option
@click.option("--precision", type=click.Choice(["bf16", "fp16", "fp32"]), default="bf16", show_default=True,
              help="Weights and activations (as cache.precision names them).")
@click.option("--dtype", "dtype_old", type=click.Choice(["bfloat16", "float16", "float32"]), default=None, hidden=True)
@click.option("--max-new-tokens", type=int, default=32, show_default=True, help="Greedy decode length per prompt.")
@click.option("--batch-size", type=int, default=1, show_default=True, help="Prompts run together (left-padded).")
@click.option("--predict-next", is_flag=True, help="Record the next layer's router applied to this layer's router input (pred_next).")
@click.option("--quasi-hidden", is_flag=True, help="Record the quasi-hidden-state prediction (pred_quasi), speculating-experts §3.")
@click.option("--speculative", is_flag=True, help="Decode by verifying depth-1 draft trees; records node, parent, accepted (batch size 1).")
@click.option("--draft-model", type=click.Path(), default=None, help="With --speculative: local draft model folder (default: the target's own top candidates).")
@click.option("--tree-width", type=int, default=4, show_default=True, help="With --speculative: candidates per draft tree.")
def capture_cmd(model_path: str, prompts: str, out: str, device: str, precision: str, dtype_old: str | None,
                max_new_tokens: int,
                batch_size: int, predict_next: bool, quasi_hidden: bool, speculative: bool,
                draft_model: str | None, tree_width: int) -> None:
    """Run a Hugging Face MoE model (OLMoE, Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3, Phi-MoE,
    GPT-OSS) with hooks on its routers and write a v1 trace. Offline: local folders only."""
    from moesim.traces.capture import capture, load_local
    from moesim.traces.io import write_trace

    if max_new_tokens < 1 or batch_size < 1:
        raise MoesimError("--max-new-tokens and --batch-size must be >= 1.")
    dtype = _deprecated("--dtype", "--precision", dtype_old) or {"bf16": "bfloat16", "fp16": "float16",
                                                                   "fp32": "float32"}[precision]
    device = _device(device)
    lines = [ln.strip() for ln in Path(prompts).read_text().splitlines() if ln.strip()]
    if not lines:
        raise MoesimError(f"capture: {prompts} has no prompts (one per line).")
    if speculative and (batch_size != 1 or quasi_hidden):
        raise MoesimError("--speculative runs one prompt at a time without --quasi-hidden: drop "
                          "--batch-size / --quasi-hidden.")
    if draft_model and not speculative:
        raise MoesimError("--draft-model needs --speculative.")
    if tree_width < 1:
        raise MoesimError(f"--tree-width must be >= 1, got {tree_width}.")
    model, tok = load_local(model_path, device, dtype)
    src = {"model_path": model_path, "prompts_file": prompts}
    if speculative:
        from moesim.traces.capture import capture_speculative

        draft = load_local(draft_model, device, dtype, any_causal_lm=True)[0] if draft_model else None

        def run(progress: Any = None) -> Any:
            return capture_speculative(model, tok, lines, max_new_tokens=max_new_tokens, width=tree_width,
                                       draft=draft, predict_next=predict_next, progress=progress, source=src)
    else:
        def run(progress: Any = None) -> Any:
            return capture(model, tok, lines, max_new_tokens=max_new_tokens, batch_size=batch_size,
                           predict_next=predict_next, quasi_hidden=quasi_hidden, progress=progress, source=src)
    res = _with_progress("capturing tokens", run)
    write_trace(res.trace, out)
    t = res.trace
    echo(f"wrote {out}: {len(t)} rows, {t.num_requests} requests, {t.num_tokens()} tokens, "
               f"{t.model.num_layers} MoE layers x {t.model.num_experts} experts top-{t.model.top_k}")


@cli.group()
def calibrate() -> None:
    """Measure the device, fit a hardware profile, validate the simulator against a reference executor."""


@calibrate.command("measure")
@device_option
@click.option("--model-shapes", default="olmoe-1b-7b", show_default=True, help="Comma-separated model shapes for the expert FFN tables.")
@click.option("--quick", is_flag=True, help="Small sizes and few repeats (CI).")
@click.option("--out", "out", required=True, type=OUT_FILE, help="Raw measurements (Parquet).")
def calibrate_measure(device: str, model_shapes: str, quick: bool, out: str) -> None:
    """Microbenchmarks with PyTorch: copies by size, expert FFN by tokens, attention by context, launch overhead."""
    from moesim.calibration.calibrate import measure, write_parquet_atomic

    device = _device(device)
    shapes = [s.strip() for s in model_shapes.split(",") if s.strip()]
    df = _with_progress("measuring", lambda progress: measure(device, shapes, quick, progress=progress))
    write_parquet_atomic(df, out)
    echo(f"wrote {out}: {len(df)} measurements on {df['device_name'].iloc[0]} ({device})")


@calibrate.command("fit")
@click.argument("raw", type=click.Path(dir_okay=False, exists=True))
@click.option("--out", "out", required=True, type=OUT_FILE, help="Profile YAML.")
@click.option("--host-costs", "host_costs", default=None, type=click.Path(dir_okay=False, exists=True),
              help="CSV of host time per CUDA call (call,host_us; tools/gpu_diagnostics.py host-calls), used when RAW "
                   "has no host rows.")
def calibrate_fit(raw: str, out: str, host_costs: str | None) -> None:
    """Fit RAW measurements into a hardware profile (links: affine latency + bytes/bandwidth;
    compute tables; launch overhead; host time per CUDA call), with fit residuals. Scenarios
    name it as hardware.profile."""
    import pandas as pd

    from moesim.calibration.calibrate import fit, fit_warnings, read_host_costs, write_profile

    try:
        df = pd.read_parquet(raw)
    except Exception as exc:
        raise MoesimError(f"calibrate fit: {raw} is not a readable Parquet file ({exc}).") from None
    prof = fit(df, raw, read_host_costs(host_costs) if host_costs else None, f"--host-costs {host_costs}")
    write_profile(prof, out)
    for name, link in prof["links"].items():
        echo(f"{name}: {link['bandwidth_gbps']:.2f} GB/s, {link['latency_us']:.2f} us "
                   f"(relative RMS residual {link['rel_rms_residual']:.1%})")
    for warning in fit_warnings(prof):
        echo(f"warning: {warning}", err=True)
    echo(f"wrote {out}")


@calibrate.command("validate")
@click.option("--profile", required=True, type=click.Path(dir_okay=False, exists=True), help="Profile from `calibrate fit`.")
@click.option("--trace", "trace_path", required=True, type=click.Path(dir_okay=False, exists=True), help="Trace replayed by both.")
@click.option("--scenarios", multiple=True, required=True, help="Scenario files (glob patterns; repeatable).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a key in every scenario, e.g. --set expert_compute=per-expert. Repeatable.")
@device_option
@click.option("--launch", type=click.Choice(["auto", "graphs", "eager"]), default="auto", show_default=True,
              help="How the executor launches its kernels on CUDA: a CUDA graph per launch, or eagerly; auto: eagerly "
                   "in per-expert execution, graphs in layer execution (validation/h200/report.md: per-expert graphs "
                   "waiting on the demand-copy stream cost up to 150 us an expert that eager launches do not, more "
                   "the more distinct graphs).")
@click.option("--switch-interval-us", "switch_us", type=click.FloatRange(min=1.0), default=None,
              help="Python's thread switch interval during the timed passes, microseconds (default: Python's, "
                   "5000): the longest the prefetch copy worker's thread waits for the interpreter while the main "
                   "thread launches kernels.")
@click.option("--prefetch-from", type=click.Choice(["main", "worker"]), default="main", show_default=True,
              help="Who issues the executor's prefetch copies: the main thread, which keeps two issued on the "
                   "prefetch stream and makes the GPU, not itself, wait for a late one (as the simulator models the "
                   "host), or a copy worker thread that waits for each to land, the main thread waiting for one still "
                   "in flight (validation/h100/eager/report.md: with prefetch at 1% and 5% the worker's rows "
                   "measured 1.36-1.52x the prediction).")
@click.option("--host-beside", is_flag=True,
              help="Before each scenario, time the eager executor's host work for a layer and a cached expert and "
                   "predict that scenario with them, so the prediction has the host's speed of that moment (on the "
                   "lent H100s the same host calls took up to twice as long in one call as in another: "
                   "validation/h100/eager/report.md). On lent H200s a timing taken just before a scenario did not "
                   "predict its speed; two runs pinned to one core (taskset -c N) met the TPOT median target, one "
                   "unpinned run on that machine did not (validation/h200/beside/report.md). Eager launches in per-expert execution only.")
@click.option("--protocol", type=click.Choice(["declared", "none"]), default="declared", show_default=True,
              help="declared: eager launches, prefetches from the main thread, the process pinned to the core where "
                   "the executor's host work is fastest, and a sentinel row (the first scenario at 100% capacity "
                   "without prefetch) before and after the scenarios to measure the host's drift; run `calibrate "
                   "measure` and `fit` just before, on the same machine. none: as the other options say. Every row "
                   "records its protocol, and any executor artefact, which the report puts apart.")
@click.option("--out", "out_dir", required=True, type=OUT_DIR, help="Report folder.")
def calibrate_validate(profile: str, trace_path: str, scenarios: tuple[str, ...], overrides: tuple[str, ...],
                       device: str, launch: str, switch_us: float | None, prefetch_from: str, host_beside: bool,
                       protocol: str, out_dir: str) -> None:
    """Replay TRACE on the device with a reference executor (same policy decisions) and with
    the simulator under PROFILE; write report.md, validation.parquet (a row per scenario),
    passes.parquet (a row per forward pass) and a plot. Prints a line per scenario as it ends.
    A scenario in the hf-loop style runs on SpecMD's kind of executor instead (a Hugging
    Face-style expert loop, blocking fetches, NF4 experts, the link throttled to the
    scenario's rate)."""
    from moesim.calibration.validate import expand, validate

    def done(r: dict[str, Any]) -> None:
        echo(f"{r['scenario']}: TPOT measured {r['tpot_measured_s'] * 1e3:.3f} ms, predicted "
                   f"{r['tpot_predicted_s'] * 1e3:.3f} ms ({r['tpot_ape']:.1%}); TTFT measured "
                   f"{r['ttft_measured_s'] * 1e3:.3f} ms, predicted {r['ttft_predicted_s'] * 1e3:.3f} ms "
                   f"({r['ttft_ape']:.1%})", err=True)

    paths = expand(list(scenarios))
    df = _with_progress("validating scenarios", lambda progress: validate(
        profile, trace_path, paths, out_dir, _device(device), progress=progress,
        warn=lambda w: echo(f"warning: {w}", err=True), overrides=list(overrides), done=done,
        launch=launch, switch_us=switch_us, prefetch_from=prefetch_from, host_beside=host_beside, protocol=protocol))
    judged = df[(df["sentinel"] == "") & ~df["artefact"]]
    echo(f"TPOT APE median {judged['tpot_ape'].median():.1%}, p95 {judged['tpot_ape'].quantile(0.95):.1%} over "
         f"{len(judged)} scenarios -> {out_dir}/report.md")


def _plain(text: str) -> str:
    from moesim.config.reference import plain

    return plain(text)


def _table(title: str, columns: list[str], rows: list[list[str]], wide: tuple[str, ...] = ()) -> Any:
    """A table that fits the terminal (80 columns if unknown) without cutting the first
    column (the name people copy): other columns wrap."""
    from rich.table import Table

    t = Table(title=title, header_style="bold", title_justify="left", pad_edge=False)
    for k, col in enumerate(columns):
        if k == 0:
            t.add_column(col, no_wrap=True, min_width=max([len(col)] + [len(r[0]) for r in rows]))
        else:
            t.add_column(col, overflow="fold", ratio=3 if col in wide else None)
    for r in rows:
        t.add_row(*r)
    return t


@cli.command("policies")
@plugin_option
@click.option("--family", type=click.Choice(["eviction", "miss", "prefetch", "routing", "budget"]), default=None,
              help="Only this family.")
@click.option("--json", "as_json", is_flag=True, help="Every policy with its parameters (type, default, help) as JSON.")
def policies_cmd(family: str | None, as_json: bool) -> None:
    """List the registered policies (your plugins' too) by family: name, parameters with their
    defaults, and what each does."""
    from rich.console import Console

    from moesim.config.confload import describe_fields
    from moesim.policies import families

    fams = {f: r for f, r in families().items() if family in (None, f)}
    if as_json:
        doc = {f: {name: {"description": _plain(cls.__doc__ or ""), "parameters": [
            {"name": n, "type": t, "default": d, "help": h} for n, t, d, h in describe_fields(cls.Params)]}
            for name, cls in reg.items()} for f, reg in fams.items()}
        click.echo(json.dumps(doc, indent=1, default=str))
        return
    con = Console()
    for fam, reg in fams.items():
        rows = [[name, ", ".join(f"{n}={d!r}" for n, _t, d, _h in describe_fields(cls.Params)) or "-",
                 _plain(cls.__doc__ or "")] for name, cls in reg.items()]
        con.print(_table(f"{fam} policies", ["name", "parameters (default)", "what it does"], rows,
                         wide=("what it does",)))
    con.print("moesim policies --json lists each parameter's type and meaning.")


def shipped_scenarios() -> list[tuple[str, str]]:
    """Each shipped scenario's name (what ``moesim run NAME`` takes) and the first sentence of
    its header comment (up to a full stop before a capital or a backquote), by name."""
    import re

    from moesim.config.scenario import shipped_dir

    root = shipped_dir()
    found = []
    for path in sorted(root.rglob("*.yaml")):
        header = []
        for line in path.read_text().splitlines():
            if not line.startswith("#"):
                break
            header.append(line.lstrip("#").strip())
        text = " ".join(header)
        first = re.split(r"(?<=\.)\s+(?=[A-Z`])", text, maxsplit=1)[0]
        found.append((path.relative_to(root).with_suffix("").as_posix(), first))
    return found


@cli.command("scenarios")
@click.argument("name", required=False)
@click.option("--json", "as_json", is_flag=True, help="The list as JSON (name and description).")
def scenarios_cmd(name: str | None, as_json: bool) -> None:
    """List the scenarios that ship with moesim (each runs as `moesim run NAME`), or print
    scenario NAME's YAML, to copy and edit."""
    from rich.console import Console

    from moesim.config.scenario import shipped_dir

    found = shipped_scenarios()
    if name is not None:
        names = [n for n, _ in found]
        if name not in names:
            from moesim.errors import did_you_mean

            raise MoesimError(f"scenario '{name}' is not one moesim ships{did_you_mean(name, names)}; "
                              "`moesim scenarios` lists them.")
        click.echo(f"# {shipped_dir() / (name + '.yaml')}")
        click.echo((shipped_dir() / f"{name}.yaml").read_text(), nl=False)
        return
    if as_json:
        click.echo(json.dumps([{"name": n, "description": d} for n, d in found], indent=1))
        return
    Console().print(_table("shipped scenarios (moesim run NAME; moesim scenarios NAME prints one)",
                           ["name", "what it replays"], [[n, d] for n, d in found]))


@cli.command("presets")
@click.option("--json", "as_json", is_flag=True, help="Every figure of every preset as JSON.")
def presets_cmd(as_json: bool) -> None:
    """List hardware presets (datasheet figures), synthetic model presets and execution styles."""
    from rich.console import Console

    from moesim.config.hardware import PRESETS as HW
    from moesim.traces.synth import PRESETS as SY

    if as_json:
        models = {name: {"model": p.model.to_dict(), "routing": {"skew": p.routing.skew, "reuse": p.routing.reuse,
                                                                  "corr": p.routing.corr}, "tuned_on": p.tuned_on}
                  for name, p in SY.items()}
        styles = {r[0]: dict(zip(("execution", "host_layer_us", "host_launch_us", "host_copy_us", "host_sync", "dequant",
                                  "prefetch_depth"), r[1:], strict=True)) for r in _style_rows()}
        click.echo(json.dumps({"hardware": HW, "models": models, "execution_styles": styles}, indent=1, default=str))
        return
    con = Console()
    rows = []
    for name, hw in HW.items():
        link = hw["links"][hw["host_link"]]
        g = hw["gpu"]
        rows.append([name, str(g["memory_gb"]), str(g["hbm_bandwidth_gbps"]), str(g["peak_tflops"]),
                     f"{hw['host_link']} {link['bandwidth_gbps']:g}", f"{link['latency_us']:g}"])
    con.print(_table("hardware presets (datasheet figures, not measurements)",
                     ["name", "HBM GB", "HBM GB/s", "bf16 TFLOPS", "host link GB/s", "latency us"], rows))
    rows = []
    for name, p in SY.items():
        m = p.model
        rows.append([name, str(m.num_layers), str(m.num_experts), str(m.top_k), f"{m.expert_bytes['bf16'] / 2**20:.1f}"])
    con.print(_table("synthetic model presets", ["name", "layers", "experts", "top-k", "expert MiB (bf16)"], rows))
    con.print(_table("execution styles (execution.style): host us per layer, per launch and per demand copy "
                     "at the default hardware.host",
                     ["style", "execution", "layer", "launch", "copy", "host waits", "dequant"],
                     [r[:-1] for r in _style_rows()],  # --json adds the prefetch copies each issues
                     wide=("execution",)))
    con.print("moesim presets --json adds the GPU names, every link, each model's routing parameters and the styles.")


def _style_rows() -> list[list[str]]:
    """Each execution style with the defaults it sets, its host costs at the default host and the
    prefetch copies it keeps issued."""
    from moesim.config.execution import STYLES, style_costs, style_defaults
    from moesim.config.hardware import HostCosts

    rows = []
    for name in STYLES:
        d, h = style_defaults(name), style_costs(name, HostCosts())
        mode = d.get("expert_compute", "(any)") + (f" {d['expert_fetch']}" if "expert_fetch" in d else "")
        rows.append([name, mode, f"{h.layer_us:.2f}", f"{h.launch_us:.2f}", f"{h.copy_us:.2f}", h.sync, str(h.dequant),
                     "all" if h.prefetch_depth is None else str(h.prefetch_depth)])
    return rows


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    try:
        cli.main(args=argv, prog_name="moesim", standalone_mode=True)
    except KeyboardInterrupt:  # pragma: no cover - interactive
        echo("interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":  # pragma: no cover
    main()

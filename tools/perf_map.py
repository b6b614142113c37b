"""Where a replay's time goes, numba's compiled functions named (issue 34; not part of the test run).

``perf`` sees numba's compiled code as bare addresses. This runs a scenario's replay once with an
emptied numba cache (so that numba compiles, and keeps each library's code in this process),
writes ``/tmp/perf-<pid>.map`` (the address and size of each compiled function: the replay
kernel's, score-percentile's proposals, the workload's passes), then records ``perf`` on this
process while it replays ``--runs`` more times, and prints ``perf report``'s functions by share of
the samples (both threads: the kernel's and the one reading the next piece).

Usage: ``python tools/perf_map.py TRACE.parquet [--set KEY=VALUE ...] [--runs 2] [--top 25]``,
e.g. ``--set policies.eviction=least-stale --set policies.prefetch=score-percentile`` (the
quickstart scenario at 5% capacity otherwise). Needs ``perf`` on the PATH, allowed to record
this user's processes (``/proc/sys/kernel/perf_event_paranoid`` at 2 or less)."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from importlib.resources import files
from typing import Any


def compiled_functions(dispatchers: list[Any]) -> list[tuple[int, int, str]]:
    """(address, size, name) of every function numba compiled for ``dispatchers`` in this process:
    the addresses from each library's engine, the sizes from the symbols of its object code."""
    out = []
    for disp in dispatchers:
        for cres in disp.overloads.values():
            lib = cres.library
            with tempfile.NamedTemporaryFile(suffix=".o") as obj:
                obj.write(lib._get_compiled_object())  # numba keeps it when it compiled (cache=True)
                obj.flush()
                nm = subprocess.run(["nm", "-S", "--defined-only", obj.name], capture_output=True, text=True,
                                    check=True).stdout
            sizes = {f[3]: int(f[1], 16) for f in (ln.split() for ln in nm.splitlines()) if len(f) == 4}
            for fn in lib._final_module.functions:
                if fn.is_declaration or fn.name not in sizes:
                    continue
                addr = lib.get_pointer_to_function(fn.name)
                if addr:
                    out.append((addr, sizes[fn.name], fn.name))
    return sorted(set(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--runs", type=int, default=2, help="replays recorded (after the one that compiles)")
    ap.add_argument("--top", type=int, default=25, help="functions printed")
    args = ap.parse_args()
    if shutil.which("perf") is None or shutil.which("nm") is None:
        sys.exit("tools/perf_map.py needs perf and nm (binutils) on the PATH.")
    # an emptied cache, so that numba compiles here and keeps each library's code (before it loads)
    os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="moesim-perf-")

    import moesim.scenarios
    from moesim.config.scenario import load_scenario
    from moesim.policies import prefetch
    from moesim.simulator import kernel, workload
    from moesim.simulator.engine import Simulation

    sets = ["cache.capacity=5%", f"workload.trace.path={args.trace}", *args.sets]
    scenario = load_scenario(str(files(moesim.scenarios) / "quickstart.yaml"), sets)
    t0 = time.perf_counter()
    Simulation(scenario, keep_rows=False).run()
    print(f"first replay (numba compiling into {os.environ['NUMBA_CACHE_DIR']}): {time.perf_counter() - t0:.1f} s",
          file=sys.stderr)
    dispatchers = [kernel.replay_passes]
    for module in (prefetch, workload):
        dispatchers += [d for d in vars(module).values() if getattr(d, "overloads", None)]
    functions = compiled_functions(dispatchers)
    mapped = f"/tmp/perf-{os.getpid()}.map"
    with open(mapped, "w") as f:
        f.writelines(f"{a:x} {n:x} {name}\n" for a, n, name in functions)
    data = os.path.join(tempfile.mkdtemp(prefix="moesim-perf-data-"), "perf.data")
    rec = subprocess.Popen(["perf", "record", "-F", "1999", "-p", str(os.getpid()), "-o", data],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # perf attaches
    if rec.poll() is not None:
        sys.exit(f"perf record could not attach: {rec.stderr.read().decode()[-500:] if rec.stderr else ''}")
    for _ in range(args.runs):
        t0 = time.perf_counter()
        Simulation(scenario, keep_rows=False).run()
        print(f"replay: {time.perf_counter() - t0:.2f} s", file=sys.stderr)
    rec.send_signal(signal.SIGINT)
    rec.wait()
    report = subprocess.run(["perf", "report", "-i", data, "--no-children", "--sort", "sym", "--stdio"],
                            capture_output=True, text=True).stdout
    rows = [ln for ln in report.splitlines() if ln.strip() and not ln.startswith("#") and "%" in ln]
    shutil.rmtree(os.environ["NUMBA_CACHE_DIR"], ignore_errors=True)  # the compiled code stays in memory
    print(f"{len(functions)} compiled functions mapped ({mapped}); perf data {data}")
    for ln in rows[:args.top]:
        print(ln[:150])


if __name__ == "__main__":
    main()

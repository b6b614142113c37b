"""Imported by the sweep's fork server (:func:`studies.sweep.run_points`): loads the
compiled replay kernel once, so that every point's process, forked from the server, starts
with it in memory instead of loading numba's cache again (about 0.5 s a point)."""

import warnings

from moesim.config.scenario import scenario_from_dict
from moesim.output.console import say
from moesim.simulator.engine import Simulation
from moesim.simulator.kernel import announce_compiles, load_cached_forms
from moesim.traces.synth import synth_from_preset


def warm() -> None:
    """Load the compiled kernel into this process: every form numba's cache holds, then tiny
    replays of the layer form with fetch on a miss (compiling it the first time after an
    installation) with every argument type it takes. A point whose form is not in the cache
    compiles it in its own process (saying so), and the next sweep's server loads it."""
    # the jit helper (moesim.jitplan) is this server's child, which the server's own loop reaps as a pid it does not know
    warnings.filterwarnings("ignore", "forkserver: waitpid returned unexpected pid", UserWarning)
    announce_compiles(say)
    load_cached_forms()
    trace = synth_from_preset("olmoe-1b-7b", layers=2, experts=8, top_k=2, requests=1, tokens=2, seed=0,
                              pred_next=True)
    for prefetch in ("static-pin", "score-percentile"):
        sc = scenario_from_dict({"hardware": {"preset": "a100-80g-pcie4"}, "cache": {"capacity": "50%"},
                                 "workload": {"trace": {"synth": {"preset": "olmoe-1b-7b"}}},
                                 "policies": {"prefetch": prefetch}}, where="<kernel warm-up>")
        Simulation(sc, trace=trace).run()


warm()

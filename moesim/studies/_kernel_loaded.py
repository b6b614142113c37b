"""Imported by the sweep's fork server (:func:`studies.sweep.run_points`): loads the
compiled replay kernel once, so that every point's process, forked from the server, starts
with it in memory instead of loading numba's cache again (about 0.5 s a point)."""

from moesim.config.scenario import scenario_from_dict
from moesim.simulator.engine import Simulation
from moesim.traces.synth import synth_from_preset


def warm() -> None:
    """Load the compiled kernel into this process (from numba's cache; compiling it the first
    time after an installation): tiny replays with every argument type the kernel takes."""
    trace = synth_from_preset("olmoe-1b-7b", layers=2, experts=8, top_k=2, requests=1, tokens=2, seed=0,
                              pred_next=True)
    for prefetch in ("static-pin", "score-percentile"):
        sc = scenario_from_dict({"hardware": {"preset": "a100-80g-pcie4"}, "cache": {"capacity": "50%"},
                                 "workload": {"trace": {"synth": {"preset": "olmoe-1b-7b"}}},
                                 "policies": {"prefetch": prefetch}}, where="<kernel warm-up>")
        Simulation(sc, trace=trace).run()


warm()

"""The host thread (``docs/concepts/execution.md``, "The host thread"): with an execution
style the host issues the GPU's work, its clock advancing by the style's cost per layer, per
launch and per demand copy; it waits where the style synchronises, and the GPU starts
nothing before the host has issued it. :class:`HostThread` is the collaborator the SimPy
process (:class:`simulator.engine.Simulation`) is given; the compiled kernel keeps the same
clock from the same figures."""

from __future__ import annotations

from typing import Any

from moesim.simulator.copyengine import CopyEngine
from moesim.simulator.lookup import Run, arrival


class HostThread:
    """The host's clock ``t`` and its costs in seconds: ``layer_s`` (a layer's non-expert
    launches), ``launch_s`` (an expert launch), ``copy_s`` (a demand copy's submission);
    ``sync`` 0, 1 or 2 for ``host_sync`` none, layer or expert; ``on`` False when there is no
    host model (every cost 0, the clock never read)."""

    def __init__(self, host: Any, copy: CopyEngine) -> None:
        self.on = bool(host.active)
        self.t = 0.0
        self.layer_s, self.launch_s, self.copy_s = host.layer_us * 1e-6, host.launch_us * 1e-6, host.copy_us * 1e-6
        self.sync = ("none", "layer", "expert").index(host.sync)
        self.copy = copy  # the copy engine whose demand copies the host submits

    def wait_until(self, t: float) -> None:
        """The host waits for the GPU to reach ``t``."""
        if self.t < t:
            self.t = t

    def lookup(self, look: Any, i: int, pins: set[int], t: float, runs: list[Run]) -> None:
        """Look up expert ``i`` of the layer ``look`` (:class:`simulator.lookup.LayerLookup`)
        at ``t``; the host submits the demand copies it leads to."""
        if not self.on:
            look.lookup(i, pins, t, runs)
            return
        copies = self.copy.demand_submits
        look.lookup(i, pins, t, runs)
        self.t += (self.copy.demand_submits - copies) * self.copy_s

    def issue(self, runs: list[Run], t: float, blocking: bool) -> float:
        """``per-expert`` execution: the host launches the expert whose computations are
        ``runs``, the GPU having run the experts before it by ``t``: with ``host_sync:
        expert`` it first waits for that; with a blocking fetch, for the expert's copy. Returns
        when the launch is issued."""
        if self.sync == 2:
            self.wait_until(t)
        if blocking:
            for _, tr, _ in runs:
                self.wait_until(arrival(tr, self.t))
        self.t += self.launch_s
        return self.t

    def ready(self, t: float) -> bool:
        """Whether the host can launch the next expert by ``t`` (pipelined ``per-expert``: the
        expert then starts when the one before it ends)."""
        h = t if self.sync == 2 and self.t < t else self.t
        return h + self.launch_s <= t

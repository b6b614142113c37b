"""Imported by the sweep's fork server (:func:`simulator.sweep.run_points`): loads the
compiled replay kernel once, so that every point's process, forked from the server, starts
with it in memory instead of loading numba's cache again (about 0.5 s a point)."""

from moesim.simulator.kernel import warm

warm()

"""Budget policies' exact selections on hand-made passes, worked out in the docstrings
(issue 12): XShare's threshold mode (Algorithm 1) and per-request mode (Algorithm 4), and
skip-threshold's choice of how many experts a token skips."""

from __future__ import annotations

import numpy as np

from moesim.simulator.engine import Simulation
from moesim.traces.schema import PHASE_CODES
from moesim.traces.trace import Trace
from tests.helpers import scenario, small_model


def one_pass(experts: list[list[int]], weights: list[list[float]], num_experts: int = 8) -> Trace:
    """One prefill pass of one token per request (requests 0, 1, ...), one layer."""
    n, k = len(experts), len(experts[0])
    model = small_model(layers=1, experts=num_experts, top_k=k)
    return Trace(model=model, request=np.arange(n, dtype=np.int32), step=np.zeros(n, dtype=np.int32),
                 position=np.zeros(n, dtype=np.int32), phase=np.full(n, PHASE_CODES["prefill"], dtype=np.int8),
                 layer=np.zeros(n, dtype=np.int16), experts=np.array(experts, dtype=np.int16),
                 weights=np.array(weights, dtype=np.float32))


def select(trace: Trace, budget: dict) -> list[list[int]]:
    sim = Simulation(scenario(policies={"budget": budget}, workload={"batch_size": len(trace)}), trace=trace)
    rows = sim.wl.rows(0, 0)
    return sim.budget.select(0, 0, rows, trace.experts[rows].astype(np.int64))


# Three tokens, top-2 of 8 experts (weights exact in binary): (0, 1) weights (0.625, 0.375);
# (2, 1) (0.75, 0.25); (3, 4) (0.5, 0.5). Batch scores: e0 0.625, e1 0.625, e2 0.75, e3 0.5,
# e4 0.5; total 3.0. Warm-up k0 = 1: {0, 2, 3}, mass 1.875.
XSHARE = ([[0, 1], [2, 1], [3, 4]], [[0.625, 0.375], [0.75, 0.25], [0.5, 0.5]])


def test_xshare_threshold_adds_experts_until_tau_of_the_mass():
    """Algorithm 1. tau = 0.625: the warm-up already holds 1.875 >= 0.625 * 3.0, so the set is
    {0, 2, 3} and each token keeps its experts in it: (0), (2), (3). tau = 0.8 needs 2.4: by
    decreasing batch score e2 (0.75, in the set), e0 and e1 (0.625 each, by index; e0 in the
    set), so e1 is added: mass 2.5, stop. Set {0, 1, 2, 3}: (0, 1), (2, 1), (3)."""
    t = one_pass(*XSHARE)
    assert select(t, {"name": "xshare", "threshold": 0.625}) == [[0], [2], [3]]
    assert select(t, {"name": "xshare", "threshold": 0.8}) == [[0, 1], [2, 1], [3]]


def test_xshare_per_request_adds_each_requests_own_best_experts():
    """Algorithm 4 (one token per request here). m_r = 1: each request's warm-up plus its own
    best other expert: request 0 {0} + 1, request 1 {2} + 1, request 2 {3} + 4 (its own score
    0.5; by the batch's scores e2 would come first). Union {0, 1, 2, 3, 4}, no top-up: every
    token keeps both experts. m_r = 0 with budget 4: the union of warm-ups {0, 2, 3} topped up
    by batch score (e2, e0 in the set; e1 next): (0, 1), (2, 1), (3)."""
    t = one_pass(*XSHARE)
    assert select(t, {"name": "xshare", "per_request": 1}) == [[0, 1], [2, 1], [3, 4]]
    assert select(t, {"name": "xshare", "per_request": 0, "budget": 4}) == [[0, 1], [2, 1], [3]]


def test_skip_threshold_skips_the_largest_i_below_beta():
    """Top-3, max_skip m = 2, calibration on the pass itself. Weights (rank order) and
    r_2 = lowest weight / total: token A (0.5, 0.3, 0.2) -> 0.2; token B (0.9, 0.06, 0.04) ->
    0.04; token C (0.4, 0.35, 0.25) -> 0.25. beta_2 = median = 0.2. Token A: r_2 = 0.2 is not
    below 0.2, r_1 = 0.5 neither: keeps 3. Token B: r_2 = 0.04 < 0.2 -> skips 2 (r_1 = 0.1 is
    below too, but the largest i wins): keeps its top-1. Token C: keeps 3."""
    t = one_pass([[0, 1, 2], [3, 4, 5], [6, 7, 0]], [[0.5, 0.3, 0.2], [0.9, 0.06, 0.04], [0.4, 0.35, 0.25]])
    got = select(t, {"name": "skip-threshold", "max_skip": 2, "calibration": 1.0})
    assert got == [[0, 1, 2], [3], [6, 7, 0]]

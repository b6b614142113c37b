"""Engine-core golden grid (issue 13): every eviction x prefetch x miss x budget policy in
every execution mode, timed and cache-only, at batch 1 and 8, and expert parallelism with
every budget, give per-pass rows bit-identical to the replay-fidelity issue's engine
(digests in tests/golden_grid_results.py, made at commit 4a55306; tests/golden_grid.py says
how), except the cases changed on purpose since (``CHANGED``, with the reason). Whichever
replay path runs (the compiled kernel or the SimPy process) is held to the same digests."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from moesim.policies.budget import REGISTRY as BUDGET
from moesim.policies.eviction import REGISTRY as EVICTION
from moesim.policies.miss import REGISTRY as MISS
from moesim.policies.prefetch import REGISTRY as PREFETCH
from tests import golden_grid as G
from tests.golden_grid_results import CHANGED, GOLDEN_GRID

GROUPS = [*G.EVICTIONS, "ep", "cache-aware"]


@pytest.fixture(scope="module")
def grid_trace():
    return G.trace()


def test_the_grid_names_every_built_in_policy_and_every_setting():
    assert set(G.EVICTIONS) == set(EVICTION.names())
    assert set(G.PREFETCHERS) == set(PREFETCH.names())
    assert set(G.MISSES) == set(MISS.names())
    assert set(G.BUDGETS) == set(BUDGET.names())
    assert sorted(G.cases()) == sorted(GOLDEN_GRID)
    assert set(CHANGED) <= set(GOLDEN_GRID)
    # the cache-only cases of the per-token path; issue 33's: with least-stale or in per-expert
    # execution, and a prefetcher (cache-aware routing's cases prefetch); issue 63's: timed, with
    # a prefetcher that can mispredict
    for name in CHANGED:
        parts = name.split("/")
        prefetch = parts[1] if len(parts) == 7 else "cache-aware"
        issued = "timed" in parts and prefetch not in ("none", "static-pin")
        assert "/cache-only/" in name or issued or (prefetch != "none" and ("least-stale" in parts or "per-expert" in parts))
    # every budget meets every mode x timing x batch; every eviction x prefetch x miss x budget
    # appears once
    single = [n.split("/") for n in GOLDEN_GRID if n.split("/")[0] in G.EVICTIONS]
    settings = collections.Counter((b, m, t, s) for _, _, _, b, m, t, s in single)
    assert len(settings) == len(G.BUDGETS) * 3 * 2 * 2
    assert len({tuple(n[:4]) for n in single}) == len(single) == len(G.EVICTIONS) * 7 * 6 * 6


@pytest.mark.parametrize("group", GROUPS)
def test_the_grid_matches_the_fidelity_engine(grid_trace, group):
    wrong = []
    for name, over in G.cases().items():
        if name.split("/")[0].rstrip("24") != group:
            continue
        got = G.compute(over, grid_trace)
        if got != CHANGED.get(name, GOLDEN_GRID[name]):
            wrong.append(name)
    assert not wrong, f"{len(wrong)} cases differ from the fidelity engine, e.g. {wrong[:5]}"


def test_a_digest_changes_with_the_last_bit_of_one_time(grid_trace):
    name, over = next(iter(G.cases().items()))
    steps = G.simulate(G.scenario(**over), trace=grid_trace).steps
    before = G.digest(steps)
    steps.loc[3, "end_s"] = np.nextafter(steps.loc[3, "end_s"], np.inf)
    assert G.digest(steps) != before
    assert before == GOLDEN_GRID[name]

"""Every shipped scenario, on reduced lengths, gives exactly its golden results
(tests/golden_results.py; ``python -m tests.golden`` prints them to paste back after a
deliberate change). Integers are compared exactly, times and ratios to 1e-9 relative."""

from __future__ import annotations

import pytest

from tests.golden import SCENARIOS, compute, needs_real
from tests.golden_results import GOLDEN
from tests.helpers import real_dir


def test_every_shipped_scenario_has_golden_results():
    assert sorted(GOLDEN) == SCENARIOS


@pytest.mark.parametrize("name", SCENARIOS)
def test_shipped_scenario_matches_its_golden_results(name):
    if needs_real(name) and not real_dir().is_dir():
        pytest.skip(f"{name} reads {real_dir()} (read-only reference data), which is absent")
    got = compute(name)
    want = GOLDEN[name]
    assert got.keys() == want.keys()
    for key, value in want.items():
        if isinstance(value, float):
            assert got[key] == pytest.approx(value, rel=1e-9), (name, key)
        else:
            assert got[key] == value, (name, key)

"""The miss policies' compiled forms (:mod:`moesim.policies.miss.forms`) by hand: what each
``decide`` answers and which precisions each cascade's ``search`` looks for and fetches, as
SpecMD §3.1.2 and each policy's reference ``decide``/``alternative`` define them; which class
the kernel runs with which form; and that the replay kernel names no policy
(``moesim/simulator/``). The kernel carrying the answers out is held to the SimPy path in
``tests/test_kernel.py``."""

from __future__ import annotations

import math
import tokenize
from importlib import import_module
from pathlib import Path

import numpy as np
import pytest

from moesim.policies import families
from moesim.policies.miss import REGISTRY
from moesim.policies.miss.base import DROP, FETCH, SPECULATE
from moesim.policies.miss.forms import MISS_FORM_CLASSES, form_index, form_of
from tests.helpers import Callable, scenario, small_model

ROOT = Path(__file__).resolve().parents[1]


def module(name: str) -> Callable:
    return Callable(import_module(f"moesim.policies.miss.{name}"))


def layer_state(layer: int) -> np.ndarray:
    from moesim.kernel_state import S_LAYER

    IS = np.zeros(S_LAYER + 1, np.int64)
    IS[S_LAYER] = layer
    return IS


NO_M = None


def test_drop_drops_a_missed_expert_of_its_rank_or_more_and_fetches_the_rest():
    """Drop with rank 2: router ranks 0 and 1 (the top two) are fetched, 2 and 7 dropped; rank 0
    drops every missed expert."""
    d = module("drop")._drop_low_ranks
    IS = layer_state(3)
    assert [d(5, rank, 2, IS, None, NO_M) for rank in (0, 1, 2, 7)] == [FETCH, FETCH, DROP, DROP]
    assert d(5, 0, 0, IS, None, NO_M) == DROP


def test_speculative_speculates_except_at_the_first_layer():
    """Layer 0 has no prediction from a layer before it: fetch; every later layer speculates."""
    s = module("speculative")._speculate_after_the_first_layer
    assert [s(1, 0, 0, layer_state(layer), None, NO_M) for layer in (0, 1, 15)] == [FETCH, SPECULATE, SPECULATE]


def test_fetch_lowest_bit_uses_any_copy_and_fetches_the_lowest():
    """Over its n levels (highest precision first): any resident copy is used, the last is
    fetched, whatever the rank."""
    s = module("fetch_lowest_bit")._any_then_lowest
    assert [tuple(s(rank, 3, 0)) for rank in (0, 5)] == [(0, 3, 2, 3), (0, 3, 2, 3)]
    assert tuple(s(0, 1, 0)) == (0, 1, 0, 1)


def test_fetch_priority_keeps_important_experts_at_the_first_level():
    """Important ranks 3 of 4 levels: rank 2 uses level 0 only and is fetched from level 0 down;
    rank 3 uses levels 1-3 and is fetched from level 1 down (of two levels, from the second);
    with one level, every expert is fetched at it (none may use a copy below it)."""
    s = module("fetch_priority")._by_importance
    assert tuple(s(2, 4, 3)) == (0, 1, 0, 4)
    assert tuple(s(3, 4, 3)) == (1, 4, 1, 4)
    assert tuple(s(3, 2, 3)) == (1, 2, 1, 2)
    assert tuple(s(3, 1, 3)) == (1, 1, 0, 1)


def test_a_form_reads_its_policys_parameter():
    """The one integer a form reads (``arg``): drop's rank; fetch-priority's important ranks,
    ceil((1 - degrade_fraction) * top_k) = ceil(0.4 * 8) = 4; 0 for the others."""
    from moesim.simulator.engine import Simulation
    from moesim.traces.synth import generate

    trace = generate(small_model(2, 8, 8), requests=1, tokens=2, seed=1, probs=True, pred_next=True)

    def arg(spec: object) -> int:
        sim = Simulation(scenario(policies={"miss": spec}), trace=trace)
        form = form_of(type(sim.miss))
        assert form is not None
        return form.arg(sim.miss)

    assert arg({"name": "drop", "rank": 3}) == 3
    assert arg({"name": "fetch-priority", "degrade_fraction": 0.6}) == math.ceil(0.4 * 8) == 4
    assert [arg(n) for n in ("fetch", "substitute", "speculative", "fetch-lowest-bit")] == [0, 0, 0, 0]


def test_every_shipped_miss_policy_has_its_own_form_and_a_users_subclass_none():
    """Each built-in class declares its form; the kernel picks it by its index. A user's
    subclass may change what it decides: no form (the SimPy path). The last form runs the
    policies written as a hook (a user's among them)."""
    from moesim.policies.miss.drop import Drop
    from moesim.policies.miss.hooked import HookMissForm

    for name, cls in REGISTRY.items():
        form = form_of(cls)
        assert form is not None, name
        assert MISS_FORM_CLASSES[form_index(cls)] is form
    assert len(set(MISS_FORM_CLASSES)) == len(MISS_FORM_CLASSES) == len(REGISTRY.items()) + 1
    assert MISS_FORM_CLASSES[-1] is HookMissForm
    assert form_of(type("MyDrop", (Drop,), {})) is None


def identifiers(path: Path) -> set[str]:
    with path.open("rb") as f:
        return {t.string for t in tokenize.tokenize(f.readline) if t.type == tokenize.NAME}


def test_the_replay_kernel_and_engine_name_no_policy():
    """No identifier in ``moesim/simulator/`` is a policy class or a policy code (``EV_*``,
    ``PF_*``, ``MISS_*``): the policies reach both replay paths through their forms and flags."""
    classes = {cls.__name__ for reg in families().values() for _, cls in reg.items()}
    assert {"LRU", "Belady", "Oracle", "Substitute", "FetchPriority"} <= classes
    found = {}
    for path in sorted((ROOT / "moesim" / "simulator").glob("*.py")):
        names = identifiers(path)
        bad = sorted((names & classes) | {n for n in names if n.startswith(("EV_", "PF_", "MISS_"))})
        if bad:
            found[path.name] = bad
    assert found == {}


@pytest.mark.parametrize("text", ["MISS_DROP = 1\n", "x = Oracle\n"])
def test_the_name_check_sees_a_code_or_a_class(tmp_path, text):
    """The check above is not vacuous: a policy code or class in a module is found."""
    p = tmp_path / "m.py"
    p.write_text(text)
    names = identifiers(p)
    classes = {cls.__name__ for reg in families().values() for _, cls in reg.items()}
    assert (names & classes) or any(n.startswith("MISS_") for n in names)

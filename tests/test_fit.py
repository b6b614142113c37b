"""Fitting the synthetic routing model to real traces (issue: traces fitted to real ones)."""

from __future__ import annotations

import numpy as np
import pytest

from moesim.errors import MoesimError
from moesim.simulator.engine import simulate
from moesim.studies.mrc import lru_curve
from moesim.traces.fit import (
    FRACTIONS,
    fit_profile,
    load_profile,
    shipped_profiles,
    synthesise,
)
from moesim.traces.importers import import_trace
from moesim.traces.synth import generate
from tests.helpers import real_dir


def mixtral():
    src = real_dir() / "mixtral-8x7b-vllm" / "routing_data_collected_gsm8k_2_routing.jsonl"
    return import_trace("expert-jsonl", [src], "mixtral-8x7b")[0]


def synth_curve(profile, seeds=3):
    return np.mean([lru_curve(synthesise(profile, seed=s), FRACTIONS, profile["batch"]) for s in range(seeds)],
                   axis=0)


@pytest.mark.real
def test_mixtral_fit_reproduces_the_lru_curve_where_uniform_does_not():
    t = mixtral()
    real = np.array(lru_curve(t, FRACTIONS, 1))
    profile = fit_profile(t, lru_curve, batch=1)
    fitted = synth_curve(profile)
    assert np.abs(fitted - real).max() <= 0.03  # within 3 points of hit rate at 5 capacities
    uniform = np.mean([lru_curve(generate(t.model, requests=2, tokens=124, seed=s, routing="uniform"),
                                 FRACTIONS, 1) for s in range(3)], axis=0)
    assert np.abs(uniform - real).max() > 0.03  # uniform routing is ~9-10 points off
    shipped = load_profile("mixtral-8x7b-gsm8k")
    assert np.abs(synth_curve(shipped) - real).max() <= 0.03


@pytest.mark.real
def test_flame_decode_fit_reproduces_the_lru_curve():
    """FLAME-MoE decode (64 sequences x 10 tokens, replayed one token at a time). Its LRU
    curve is close to uniform routing's too (within ~1.5 points): this small trace cannot
    tell the routing models apart."""
    t = import_trace("flame-csv", [real_dir() / "flame-moe-290m" / "decode"])[0]
    real = np.array(lru_curve(t, FRACTIONS, 1))
    assert np.abs(synth_curve(load_profile("flame-moe-290m-decode")) - real).max() <= 0.03


def test_shipped_profiles_load_and_drive_scenarios():
    assert {"mixtral-8x7b-gsm8k", "flame-moe-290m-decode"} <= set(shipped_profiles())
    p = load_profile("mixtral-8x7b-gsm8k")
    t = synthesise(p, requests=3, tokens=40, seed=1)
    assert t.num_requests == 3
    assert t.num_tokens() == 120
    assert t.model.name == "mixtral-8x7b"
    import copy

    from moesim.config.scenario import scenario_from_dict
    from tests.helpers import BASE

    data = copy.deepcopy(BASE)
    data["workload"]["trace"] = {"synth": {"fit": "mixtral-8x7b-gsm8k", "tokens": 30, "requests": 2}}
    s = simulate(scenario_from_dict(data, "<test>")).summary
    assert s["forward_passes"] == 60


def test_bad_profiles_are_named(tmp_path):
    with pytest.raises(MoesimError, match="fitted profile 'nope': no such file or shipped profile"):
        load_profile("nope")
    f = tmp_path / "p.yaml"
    f.write_text("profile_version: 1\nname: x\n")
    with pytest.raises(MoesimError, match="lacks 'model'"):
        load_profile(str(f))

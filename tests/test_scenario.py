"""Scenario loading: capacity forms, overrides, presets, shipped scenarios."""

from __future__ import annotations

import math

import pytest

from moesim.config.hardware import PRESETS
from moesim.config.scenario import (
    apply_overrides,
    load_scenario,
    parse_capacity,
    parse_set,
    shipped_scenarios,
)
from moesim.errors import MoesimError
from tests.helpers import scenario

EB = 12_582_912


@pytest.mark.parametrize(("text", "expected"), [
    ("5%", 0.05 * 1024 * EB), ("100%", 1024 * EB), ("0.6GB", 0.6e9), ("600MiB", 600 * 2**20),
    ("64 experts", 64 * EB), ("1 expert", EB), ("inf", math.inf), ("2.5 GB", 2.5e9),
])
def test_capacity_forms(text, expected):
    assert parse_capacity(text, EB, 1024 * EB, "<t>") == pytest.approx(expected)


@pytest.mark.parametrize("text", ["lots", "5", "-3%", "120%", "3 bananas"])
def test_bad_capacity(text):
    with pytest.raises(MoesimError, match=r"cache\.capacity"):
        parse_capacity(text, EB, 1024 * EB, "<t>")


def test_overrides_create_and_replace_nested_keys():
    data = {"policies": {"eviction": "lru"}, "cache": {"capacity": "5%"}}
    out = apply_overrides(data, parse_set(["cache.capacity=25%", "policies.eviction.name=lru",
                                            "hardware.links.pcie.bandwidth_gbps=5", "seed=3"]))
    assert out == {"policies": {"eviction": {"name": "lru"}}, "cache": {"capacity": "25%"},
                   "hardware": {"links": {"pcie": {"bandwidth_gbps": 5}}}, "seed": 3}
    assert data["cache"]["capacity"] == "5%"  # input untouched


def test_preset_with_override():
    sc = scenario(hardware={"preset": "h100-sxm-pcie5", "links": {"pcie": {"bandwidth_gbps": 5}}})
    assert sc.hardware.gpu.name == "H100-SXM5-80GB"
    assert sc.hardware.h2d.bandwidth_gbps == 5
    assert sc.hardware.h2d.latency_us == PRESETS["h100-sxm-pcie5"]["links"]["pcie"]["latency_us"]


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_hardware_preset_builds(name):
    sc = scenario(hardware={"preset": name})
    assert sc.hardware.source == "datasheet"
    assert sc.hardware.h2d.copy_time(12_582_912) > 0


def test_shipped_quickstart_is_found_and_valid():
    assert "quickstart" in shipped_scenarios()
    sc = load_scenario("quickstart")
    assert sc.cache.capacity == "5%"
    assert sc.hardware.preset == "a100-80g-pcie4"
    assert sc.policies.eviction.name == "lru"
    assert sc.policies.miss.name == "fetch"
    assert sc.policies.prefetch.name == "none"


def test_precision_must_exist_in_the_trace():
    from moesim.simulator.engine import Simulation

    sc = scenario(cache={"capacity": "5%", "precision": "fp8"})
    with pytest.raises(MoesimError, match=r"cache.precision' is 'fp8'.*bf16, int8, int4, int2"):
        Simulation(sc)

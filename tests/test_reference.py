"""The scenario-key and policy references (``moesim.config.reference``), which the docs site's
"Scenario keys" page and the policies guide are generated from."""

from __future__ import annotations

from typing import Any

from moesim.config.reference import Key, markdown, plain, policies_markdown, scenario_keys
from moesim.config.scenario import load_scenario


def flat(data: Any, prefix: str = "") -> set[str]:
    """Every dotted key path of a nested mapping (a mapping's own path too)."""
    out: set[str] = set()
    if isinstance(data, dict):
        for k, v in data.items():
            path = f"{prefix}{k}"
            out.add(path)
            out |= flat(v, path + ".")
    return out


def test_every_key_of_a_resolved_scenario_is_in_the_reference() -> None:
    """The resolved scenario (what ``scenario.resolved.yaml`` holds, written by other code)
    of a serving scenario and of one with every optional section: each of its keys is a key of
    the reference (a link's name as NAME; a policy's parameters are the policies table's)."""
    keys = {k.path for k in scenario_keys()} | {k.section for k in scenario_keys()}
    for name, sets in (("serving/olmoe-poisson", []),
                       ("quickstart", ["workload.speculative={tree_size: 4}", "execution.style=hf-loop",
                                       "workload.trace={import: {format: expert-jsonl, path: x.jsonl}}"])):
        resolved = load_scenario(name, sets).to_dict()
        resolved["hardware"]["links"] = {"NAME": next(iter(resolved["hardware"]["links"].values()))}
        paths = {p for p in flat(resolved) if not p.startswith("policies.") and p != "hardware.host_costs"}
        assert paths - keys == set(), name


def test_keys_by_hand() -> None:
    """Types, defaults and sections of keys of each kind, as a user reads them."""
    by = {k.path: k for k in scenario_keys()}
    assert by["cache.capacity"] == Key("cache.capacity", "text", "5%",
                                       "'5%' of all expert bytes, '0.6GB' / '600MiB', '64 experts', or 'inf'",
                                       "cache")
    assert by["workload.arrivals.skip_zero_output"].type == "true \\| false"
    assert by["workload.arrivals.skip_zero_output"].default == "true"
    assert by["workload.arrivals.rate"].type == "number or null"
    assert by["workload.arrivals.rate"].default == "null"
    assert by["workload.arrivals.process"].type == "poisson \\| gamma \\| file"
    assert by["workload.arrivals.process"].default == "(required)"
    assert by["workload.batch_size"].type == "integer"
    assert by["workload.trace.import.format"].section == "workload.trace.import"
    assert by["hardware.links"].type == "mapping of name to section"
    assert by["hardware.links.NAME.bandwidth_gbps"].section == "hardware.links.NAME"
    assert by["hardware.gpu"].type == "section"
    assert by["hardware.gpu.memory_gb"].default == "80.0"
    assert by["policies"].type == "mapping"
    assert by["seed"].section == ""
    assert "hardware.expert_table" not in by  # filled from a profile, not written by a user
    assert [k.path for k in scenario_keys()][:4] == ["seed", "timing", "expert_compute", "expert_fetch"]


def test_markdown_tables() -> None:
    text = markdown()
    assert text.startswith("## Top level\n\n| key | type | default | meaning |\n|---|---|---|---|\n")
    assert "| `seed` | integer | `0` | " in text
    assert "## `workload.arrivals`" in text
    assert "| `process` | poisson \\| gamma \\| file | (required) | " in text
    assert "| `gpu` | section |  | the GPU |" in text
    lines = [ln for ln in text.splitlines() if ln.startswith("| `")]
    assert len(lines) == len(scenario_keys())


def test_policy_tables() -> None:
    text = policies_markdown()
    assert "## `policies.eviction`" in text
    assert ("| `s3-fifo` | `small_ratio` (float, default `0.1`): the small queue's share of the capacity, in (0, 1)"
            "<br>`ghost_ratio`") in text
    assert "| `lru` | - | Least recently used: evict the expert whose last use is oldest. |" in text
    assert plain("First :class:`~a.B` and ``x``.\n\nSecond.") == "First a.B and x."

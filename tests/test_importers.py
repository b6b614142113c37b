"""Importers and the in-process import trace source."""

from __future__ import annotations

import json

import pytest

from simulator.engine import simulate
from simulator.errors import MoesimError
from tests.helpers import mixtral_trace, real_dir
from traces.importers import import_trace
from traces.io import read_trace, write_trace
from traces.stats import trace_stats


@pytest.mark.real
def test_mixtral_gsm8k_counts_and_missing_cells(tmp_path):
    src = real_dir() / "mixtral-8x7b-vllm" / "routing_data_collected_gsm8k_2_routing.jsonl"
    t, report = import_trace("expert-jsonl", [src], "mixtral-8x7b")
    assert t.num_requests == 2
    assert t.num_tokens() == 247  # decode tokens over 2 problems
    assert (t.model.num_layers, t.model.num_experts, t.model.top_k) == (32, 8, 2)
    assert report.missing_cells == 247 * 32 - len(t) > 0
    problem0 = t.take(t.request == 0)
    assert problem0.num_tokens() == 168
    assert 168 * 32 - len(problem0) == 10  # as documented in the traces' README
    assert trace_stats(t)["top1_repeat"] == pytest.approx(0.221, abs=0.002)
    back = read_trace(write_trace(t, tmp_path / "mx.parquet"))
    assert len(back) == len(t)
    # same routing as the test helper that reads the JSONL on its own
    ref = mixtral_trace("gsm8k")
    assert sorted(map(tuple, t.experts.tolist())) == sorted(map(tuple, ref.experts.tolist()))


def test_bad_lines_and_shapes_are_named(tmp_path):
    f = tmp_path / "routing.jsonl"
    f.write_text(json.dumps({"problem_id": 0, "token_idx": 0, "layer": 0, "experts": [1, 2],
                             "gating_probs": [0.6, 0.4]}) + "\n{broken\n")
    with pytest.raises(MoesimError, match=r"routing.jsonl line 2: not an expert-jsonl record"):
        import_trace("expert-jsonl", [f], "mixtral-8x7b")
    f.write_text(json.dumps({"problem_id": 0, "token_idx": 0, "layer": 0, "experts": [1, 9],
                             "gating_probs": [0.6, 0.4]}) + "\n")
    with pytest.raises(MoesimError, match=r"line 1: layer 0 / experts \[1, 9\] out of range for mixtral-8x7b"):
        import_trace("expert-jsonl", [f], "mixtral-8x7b")
    with pytest.raises(MoesimError, match="records no model shapes; name one with --model-preset"):
        import_trace("expert-jsonl", [f], None)
    with pytest.raises(MoesimError, match="unknown import format 'expert-json'"):
        import_trace("expert-json", [f], "mixtral-8x7b")


def test_scenario_import_source(tmp_path):
    f = tmp_path / "routing.jsonl"
    lines = [json.dumps({"problem_id": 0, "token_idx": t, "layer": layer, "experts": [t % 8, (t + 1) % 8],
                         "gating_probs": [0.7, 0.3]}) for t in range(5) for layer in range(32)]
    f.write_text("\n".join(lines) + "\n")
    import copy

    from simulator.scenario import scenario_from_dict
    from tests.helpers import BASE

    data = copy.deepcopy(BASE)
    data["workload"]["trace"] = {"import": {"format": "expert-jsonl", "path": str(f),
                                            "model_preset": "mixtral-8x7b"}}
    data["cache"] = {"capacity": "inf"}
    sc = scenario_from_dict(data, "<test>")
    s = simulate(sc).summary
    assert s["forward_passes"] == 5
    assert s["misses"] == len({(layer, e) for t in range(5) for layer in range(32) for e in (t % 8, (t + 1) % 8)})
    assert sc.to_dict()["workload"]["trace"]["import"]["format"] == "expert-jsonl"

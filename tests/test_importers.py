"""Importers and the in-process import trace source."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moesim.errors import MoesimError
from moesim.simulator.engine import simulate
from moesim.traces.importers import import_trace
from moesim.traces.io import read_trace, write_trace
from moesim.traces.stats import trace_stats
from tests.helpers import mixtral_trace, real_dir


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
    with pytest.raises(MoesimError, match="records no model shapes; name one with --preset"):
        import_trace("expert-jsonl", [f], None)
    with pytest.raises(MoesimError, match="unknown import format 'expert-json'"):
        import_trace("expert-json", [f], "mixtral-8x7b")


def test_scenario_import_source(tmp_path):
    f = tmp_path / "routing.jsonl"
    lines = [json.dumps({"problem_id": 0, "token_idx": t, "layer": layer, "experts": [t % 8, (t + 1) % 8],
                         "gating_probs": [0.7, 0.3]}) for t in range(5) for layer in range(32)]
    f.write_text("\n".join(lines) + "\n")
    import copy

    from moesim.config.scenario import scenario_from_dict
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


@pytest.mark.real
def test_vllm_route_logs_drop_warmup():
    base = real_dir() / "layer0-vllm"
    t, report = import_trace("vllm-routes-jsonl", [base / "olmoe-1b-7b" / "moe_routes.jsonl"], "olmoe-1b-7b",
                             drop_warmup=True)
    assert len(t) == 6519 - 2048  # the first 2048 rows are vLLM warm-up dummies
    assert any("dropped 2048 warm-up rows" in n for n in report.notes)
    assert set(t.layer.tolist()) == {0}
    kept, kept_report = import_trace("vllm-routes-jsonl", [base / "olmoe-1b-7b" / "moe_routes.jsonl"], "olmoe-1b-7b")
    assert len(kept) == 6519
    assert any("kept 2048 of 6519 rows that look like vLLM warm-up dummies" in n and "--drop-warmup" in n
               for n in kept_report.notes)  # said, not silently kept
    q, _rq = import_trace("vllm-routes-jsonl", [base / "qwen1.5-moe-a2.7b-chat"], "qwen1.5-moe-a2.7b",
                         drop_warmup=True)
    assert not any(tuple(row) == (43, 5, 7, 58) for row in q.experts.tolist())
    with pytest.raises(MoesimError, match="line 2: 8 experts, but model mixtral-8x7b has top-2"):
        import_trace("vllm-routes-jsonl", [base / "olmoe-1b-7b"], "mixtral-8x7b")


@pytest.mark.real
def test_flame_csv_prefill_and_decode():
    t, _report = import_trace("flame-csv", [real_dir() / "flame-moe-290m"])
    assert (t.model.num_layers, t.model.num_experts, t.model.top_k) == (8, 64, 6)
    pre = t.take(t.phase == 0)
    dec = t.take(t.phase == 1)
    assert pre.num_tokens() == 2048
    assert pre.num_requests == 32
    assert dec.num_tokens() == 640
    assert dec.num_requests == 64
    # documented fact: mean top-1 probability rises from ~0.036 (layer 2) to ~0.21 (layer 9)
    assert float(pre.weights[pre.layer == 0, 0].mean()) == pytest.approx(0.036, abs=0.005)
    assert float(pre.weights[pre.layer == 7, 0].mean()) == pytest.approx(0.21, abs=0.02)
    assert (np.diff(t.weights, axis=1) <= 0).all()  # ranked by probability


def test_routed_npy_and_long_table(tmp_path):
    import pandas as pd

    arr = np.array([[[0, 1], [2, 3]], [[1, 0], [3, 4]], [[5, 6], [7, 0]]])
    np.save(tmp_path / "r.npy", arr)
    t, report = import_trace("routed-experts-npy", [tmp_path / "r.npy"], "mixtral-8x7b")
    assert len(t) == 6
    assert t.experts.tolist() == arr.reshape(-1, 2).tolist()
    assert any("1/k" in n for n in report.notes)
    rows = [(0, tok, layer, int(e), w, r) for tok in range(3) for layer in range(2)
            for r, (e, w) in enumerate(zip(arr[tok, layer], (0.6, 0.4), strict=True))]
    df = pd.DataFrame(rows, columns=["req", "tok", "lay", "eid", "prob", "rk"]).sample(frac=1, random_state=0)
    df.to_csv(tmp_path / "long.csv", index=False)
    t2, _ = import_trace("long-table", [tmp_path / "long.csv"], "mixtral-8x7b",
                         columns={"request": "req", "position": "tok", "layer": "lay", "expert": "eid",
                                  "weight": "prob", "rank": "rk"})
    assert t2.experts.tolist() == arr.reshape(-1, 2).tolist()
    np.testing.assert_allclose(t2.weights, [[0.6, 0.4]] * 6)
    with pytest.raises(MoesimError, match=r"missing request \(column 'request'\)"):
        import_trace("long-table", [tmp_path / "long.csv"], "mixtral-8x7b")
    np.save(tmp_path / "bad.npy", np.full((2, 2, 2), 9))
    with pytest.raises(MoesimError, match=r"expert id outside 0\.\.7"):
        import_trace("routed-experts-npy", [tmp_path / "bad.npy"], "mixtral-8x7b")

"""Trace format v1: round trip, validation messages, synthetic presets and statistics."""

from __future__ import annotations

import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

from moesim.errors import MoesimError
from moesim.traces.io import read_trace, trace_to_table, write_trace
from moesim.traces.schema import METADATA_KEY
from moesim.traces.stats import trace_stats
from moesim.traces.synth import PRESETS, generate, synth_from_preset
from tests.helpers import mixtral_trace, small_model, trace_from_array


def test_round_trip_preserves_every_column(tmp_path):
    t = synth_from_preset("olmoe-1b-7b", requests=3, prompt_tokens=5, tokens=7, seed=3)
    t.probs = np.random.default_rng(0).random((len(t), 64)).astype(np.float32)
    path = write_trace(t, tmp_path / "t.parquet")
    back = read_trace(path)
    for name in ("request", "step", "position", "phase", "layer", "experts", "weights", "probs"):
        np.testing.assert_array_equal(getattr(back, name), getattr(t, name), err_msg=name)
    assert back.model == t.model
    assert back.capture["preset"] == "olmoe-1b-7b"
    schema = pq.read_schema(path)
    assert schema.field("experts").type == pa.list_(pa.int16())
    assert schema.field("request").type == pa.int32()
    assert schema.field("layer").type == pa.int16()
    assert json.loads(schema.metadata[METADATA_KEY])["schema_version"] == 1


def test_counts_of_synthetic_trace():
    t = synth_from_preset("mixtral-8x7b", requests=2, prompt_tokens=4, tokens=3, seed=1)
    assert len(t) == 2 * 7 * 32
    assert t.num_tokens() == 14
    assert t.num_steps() == 2 * (1 + 3)  # one prefill pass + 3 decode steps per request
    assert set(np.unique(t.step[t.phase == 0])) == {0}
    assert t.step[t.phase == 1].min() == 1


def test_no_prefill_means_decode_from_step_0():
    t = synth_from_preset("phi-3.5-moe", requests=1, prompt_tokens=0, tokens=4, seed=1)
    assert (t.phase == 1).all()
    assert t.step.min() == 0
    assert t.step.max() == 3


def test_presets_have_the_papers_shapes():
    m = PRESETS["olmoe-1b-7b"].model
    assert (m.num_layers, m.num_experts, m.top_k) == (16, 64, 8)
    assert 12_000_000 <= m.expert_bytes["bf16"] <= 13_000_000  # "12 MB experts"
    m = PRESETS["mixtral-8x7b"].model
    assert (m.num_layers, m.num_experts, m.top_k) == (32, 8, 2)
    assert m.expert_bytes["bf16"] == 336 * 2**20  # 336 MiB
    assert (PRESETS["qwen1.5-moe-a2.7b"].model.num_layers, PRESETS["qwen1.5-moe-a2.7b"].model.num_experts,
            PRESETS["qwen1.5-moe-a2.7b"].model.top_k) == (24, 60, 4)
    assert (PRESETS["qwen3-30b-a3b"].model.num_layers, PRESETS["qwen3-30b-a3b"].model.num_experts,
            PRESETS["qwen3-30b-a3b"].model.top_k) == (48, 128, 8)
    assert (PRESETS["phi-3.5-moe"].model.num_layers, PRESETS["phi-3.5-moe"].model.num_experts,
            PRESETS["phi-3.5-moe"].model.top_k) == (32, 16, 2)


def test_same_seed_same_trace_and_weights_are_valid():
    a = synth_from_preset("olmoe-1b-7b", requests=2, tokens=20, seed=7)
    b = synth_from_preset("olmoe-1b-7b", requests=2, tokens=20, seed=7)
    c = synth_from_preset("olmoe-1b-7b", requests=2, tokens=20, seed=8)
    np.testing.assert_array_equal(a.experts, b.experts)
    np.testing.assert_array_equal(a.weights, b.weights)
    assert not np.array_equal(a.experts, c.experts)
    srt = np.sort(a.experts, axis=1)
    assert (srt[:, 1:] != srt[:, :-1]).all()  # distinct top-k
    assert (np.diff(a.weights, axis=1) <= 1e-7).all()  # rank order = descending weight
    m = synth_from_preset("mixtral-8x7b", tokens=20, seed=1)
    np.testing.assert_allclose(m.weights.sum(axis=1), 1.0, rtol=1e-5)  # Mixtral renormalises


def test_uniform_routing_statistics_match_closed_forms():
    model = small_model(layers=4, experts=16, top_k=2)
    st = trace_stats(generate(model, requests=20, tokens=400, seed=0, routing="uniform"))
    assert st["top1_repeat"] == pytest.approx(1 / 16, abs=0.01)
    assert st["set_overlap"] == pytest.approx(2 / 16, abs=0.01)
    assert st["popularity_skew"] < 0.005
    assert st["layer_mi"] < 0.03


def test_realistic_mixtral_defaults_resemble_the_real_trace():
    """Defaults tuned on the real Mixtral GSM8K trace (docs/concepts/synthetic.md): top-1 repeat 0.221
    (uniform 0.125), set overlap 0.344, popularity skew 0.027, layer MI 0.191."""
    sts = [trace_stats(synth_from_preset("mixtral-8x7b", requests=2, tokens=124, seed=s)) for s in range(4)]
    mean = {k: float(np.mean([s[k] for s in sts])) for k in sts[0]}
    assert mean["top1_repeat"] == pytest.approx(0.221, abs=0.04)
    assert mean["set_overlap"] == pytest.approx(0.344, abs=0.06)
    assert mean["layer_mi"] == pytest.approx(0.191, abs=0.05)
    uni = trace_stats(synth_from_preset("mixtral-8x7b", requests=2, tokens=124, seed=0, routing="uniform"))
    assert uni["top1_repeat"] < 0.16


@pytest.mark.real
def test_real_mixtral_statistics_are_those_documented():
    st = trace_stats(mixtral_trace("gsm8k"))
    assert st["top1_repeat"] == pytest.approx(0.221, abs=0.002)
    assert st["set_overlap"] == pytest.approx(0.344, abs=0.002)


# -- validation ------------------------------------------------------------------------------

def _write_table(tmp_path, table):
    path = tmp_path / "bad.parquet"
    pq.write_table(table, path)
    return path


def test_corrupt_parquet_is_named(tmp_path):
    path = tmp_path / "corrupt.parquet"
    path.write_bytes(b"PAR1 this is not parquet at all")
    with pytest.raises(MoesimError, match=r"corrupt\.parquet.*not a readable Parquet file"):
        read_trace(path)


@pytest.mark.parametrize("row", [[1, 8], [-1, 2], [7, -3]])  # 8 >= 8 experts; ids below 0
def test_expert_id_out_of_range_names_column_and_row(tmp_path, row):
    t = trace_from_array(small_model(), np.zeros((1, 3, 2, 2), dtype=np.int64) + np.array([0, 1]))
    t.experts[4] = row
    t.experts[5] = [7, 0]  # the ids at the ends of the range are valid
    table = trace_to_table(t)
    path = _write_table(tmp_path, table)
    shown = re.escape(str(row))
    with pytest.raises(MoesimError, match=rf"bad\.parquet: column 'experts' has expert id\(s\) {shown} at row 4; ids must be 0..7"):
        read_trace(path)
    t.experts[4] = [1, 2]
    assert read_trace(_write_table(tmp_path, trace_to_table(t))).experts[5].tolist() == [7, 0]


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda tb: tb.drop_columns(["weights"]), "lacks required column"),
    (lambda tb: tb.set_column(tb.schema.get_field_index("phase"), "phase",
                              pa.array(["decode"] * 5 + ["sample"])), "column 'phase' has 'sample' at row 5"),
    (lambda tb: tb.set_column(tb.schema.get_field_index("layer"), "layer",
                              pa.array([0, 1, 0, 1, 0, 7], pa.int16())), "column 'layer' has 7 at row 5"),
    (lambda tb: tb.set_column(tb.schema.get_field_index("weights"), "weights",
                              pa.array([[0.5, 0.5]] * 2 + [[float("nan"), 0.5]] + [[0.5, 0.5]] * 3,
                                       pa.list_(pa.float32()))), "column 'weights' has non-finite .* at row 2"),
    (lambda tb: tb.set_column(tb.schema.get_field_index("weights"), "weights",
                              pa.array([[0.5, 0.5]] * 3 + [[0.5, -0.25]] + [[0.5, 0.5]] * 2,
                                       pa.list_(pa.float32()))), r"column 'weights' has non-finite or negative "
                                                                 r"values at row 3 \(\[0.5, -0.25\]\)"),
    (lambda tb: tb.set_column(tb.schema.get_field_index("weights"), "weights",
                              pa.array([[0.5, 0.5]] + [[float("inf"), 0.5]] + [[0.5, 0.5]] * 4,
                                       pa.list_(pa.float32()))), "column 'weights' has non-finite .* at row 1"),
    (lambda tb: tb.append_column("pred_next", pa.array([[0.1] * 8] * 4 + [[0.1] * 7 + [float("nan")]] + [[0.1] * 8],
                                                       pa.list_(pa.float32()))),
     "column 'pred_next' has non-finite values at row 4"),
    (lambda tb: tb.append_column("pred_next", pa.array([[-1.0] * 8] + [[float("-inf")] * 8] + [[0.1] * 8] * 4,
                                                       pa.list_(pa.float32()))),
     "column 'pred_next' has non-finite values at row 1"),
    (lambda tb: tb.set_column(tb.schema.get_field_index("experts"), "experts",
                              pa.array([[0, 1]] * 3 + [[0]] + [[0, 1]] * 2, pa.list_(pa.int16()))),
     "column 'experts' has 1 entries at row 3, expected 2"),
])
def test_bad_values_are_named(tmp_path, mutate, message):
    t = trace_from_array(small_model(), np.zeros((1, 3, 2, 2), dtype=np.int64) + np.array([0, 1]))
    table = trace_to_table(t)
    meta = table.schema.metadata
    path = _write_table(tmp_path, mutate(table).replace_schema_metadata(meta))
    with pytest.raises(MoesimError, match=message):
        read_trace(path)


@given(st.lists(st.sampled_from([0.0, 0.5, -0.5, -1e38, 3e38, float("inf"), float("-inf"), float("nan")]),
                max_size=12), st.sampled_from([0.0, -np.inf]))
def test_the_quick_finiteness_check_agrees_with_every_value_checked(values: list[float], lowest: float) -> None:
    from moesim.traces.io import _finite_at_least

    a = np.asarray(values, np.float32)
    assert _finite_at_least(a, lowest) == bool((np.isfinite(a) & (a >= lowest)).all())


@pytest.mark.parametrize(("version", "hint"), [(0, "older"), (2, "newer")])
def test_other_schema_versions_fail_clearly(tmp_path, version, hint):
    t = trace_from_array(small_model(), np.zeros((1, 2, 2, 2), dtype=np.int64) + np.array([0, 1]))
    table = trace_to_table(t)
    meta = json.loads(table.schema.metadata[METADATA_KEY])
    meta["schema_version"] = version
    path = _write_table(tmp_path, table.replace_schema_metadata({METADATA_KEY: json.dumps(meta)}))
    with pytest.raises(MoesimError, match=f"schema_version is {version}.*{hint}"):
        read_trace(path)


def test_missing_metadata_and_missing_model_fields(tmp_path):
    t = trace_from_array(small_model(), np.zeros((1, 2, 2, 2), dtype=np.int64) + np.array([0, 1]))
    table = trace_to_table(t)
    path = _write_table(tmp_path, table.replace_schema_metadata({}))
    with pytest.raises(MoesimError, match="no 'moesim' key"):
        read_trace(path)
    meta = json.loads(table.schema.metadata[METADATA_KEY])
    del meta["model"]["top_k"]
    path = _write_table(tmp_path, table.replace_schema_metadata({METADATA_KEY: json.dumps(meta)}))
    with pytest.raises(MoesimError, match="lacks top_k"):
        read_trace(path)

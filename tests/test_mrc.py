"""Miss-ratio curves (``moesim mrc``): LRU from stack distances against libCacheSim's LRU on
the same access stream at every capacity; layer execution against the independent replay;
Belady as the bound; the command's files and refusals."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from moesim.cli import cli
from moesim.studies.mrc import lru_stack_misses, mrc, parse_capacities
from moesim.traces.io import write_trace
from moesim.traces.synth import synth_from_preset
from tests import reference_replay as R
from tests.helpers import batch_access_stream, mixtral_trace, real_dir
from tests.test_eviction import lcs_misses


def test_stack_distances_by_hand():
    """a b c a b d a. Capacity 1 and 2: no key comes back within 2 distinct keys: 7 misses.
    Capacity 3: the second a and b are at depth 2 (two distinct keys since), the last a at
    depth 2 (d, b): 3 hits, 4 misses; capacity 4 the same (d is a first use)."""
    a, b, c, d = 0, 1, 2, 3
    assert lru_stack_misses([a, b, c, a, b, d, a], [1, 2, 3, 4]) == [7, 7, 4, 4]


@pytest.mark.parametrize("batch", [1, 4])
def test_per_expert_lru_curve_equals_libcachesim_at_every_capacity(batch):
    """The per-expert LRU curve (stack distances at 2 experts and up, a replay at 1) equals
    libCacheSim's LRU on the stream built independently from the trace, at every capacity
    from 1 expert to the whole model."""
    trace = synth_from_preset("olmoe-1b-7b", layers=3, requests=4, tokens=30, seed=7)
    total = 3 * 64
    df = mrc(trace, ["lru"], list(range(1, total + 1)), "per-expert", batch_size=batch)
    stream = batch_access_stream(trace, batch)
    expected = [lcs_misses(stream, c, "LRU") for c in range(1, total + 1)]
    assert df["misses"].tolist() == expected
    assert (df["accesses"] == len(stream)).all()
    assert df["method"].tolist() == ["replay"] + ["stack-distance"] * (total - 1)


def test_per_expert_lru_curve_equals_libcachesim_on_real_mixtral():
    real_dir()  # skips, saying so, without ../shared/traces/real
    trace = mixtral_trace()
    total = trace.model.num_layers * trace.model.num_experts
    caps = parse_capacities(None, total)
    df = mrc(trace, ["lru"], caps, "per-expert")
    stream = batch_access_stream(trace, 1)
    assert df["misses"].tolist() == [lcs_misses(stream, c, "LRU") for c in caps]


@pytest.mark.parametrize("policy", ["lru", "fifo"])
def test_layer_execution_curve_equals_the_independent_replay(policy):
    """Layer execution pins a layer's experts together, so its LRU curve is replayed; it
    equals the contract's independent replay (tests/reference_replay.py) at each capacity."""
    trace = synth_from_preset("olmoe-1b-7b", layers=3, requests=1, tokens=80, seed=2)
    caps = [8, 20, 48, 100, 192]
    df = mrc(trace, [policy], caps, "layer")
    passes = R.trace_passes(trace)
    expected = [R.replay(passes, c, R.POLICIES[policy](3), "layer").as_tuple()[1] for c in caps]
    assert df["misses"].tolist() == expected
    assert set(df["method"]) == {"replay"}


def test_belady_bounds_every_curve_and_hit_rates_are_exact():
    trace = synth_from_preset("olmoe-1b-7b", layers=2, requests=1, tokens=100, seed=3)
    caps = [2, 8, 32, 128]
    df = mrc(trace, ["lru", "fifo", "lfu", "belady"], caps, "per-expert")
    wide = df.pivot(index="capacity_experts", columns="policy", values="misses")
    for p in ("lru", "fifo", "lfu"):
        assert (wide["belady"] <= wide[p]).all()
    assert (df["hit_rate"] == 1 - df["misses"] / df["accesses"]).all()
    assert df["capacity_pct"].tolist()[:4] == [100 * c / 128 for c in caps]
    assert (df["capacity_bytes"] == df["capacity_experts"] * 3 * 2048 * 1024 * 2).all()  # OLMoE bf16 expert


def test_capacities_parse_counts_and_percentages():
    assert parse_capacities("1,8,64", 128) == [1, 8, 64]
    assert parse_capacities("1%,50%,100%", 200) == [2, 100, 200]
    grid = parse_capacities(None, 1024)
    assert (grid[0], grid[-1]) == (1, 1024)
    assert grid == sorted(set(grid))


def test_mrc_command_writes_the_table_and_the_figure(tmp_path):
    trace = synth_from_preset("olmoe-1b-7b", layers=2, requests=1, tokens=40, seed=1)
    path = tmp_path / "t.parquet"
    write_trace(trace, path)
    out = tmp_path / "mrc"
    r = CliRunner().invoke(cli, ["mrc", str(path), "--policy", "lru,belady", "--capacities", "2,16,128",
                                 "--out", str(out), "--json"])
    assert r.exit_code == 0, r.output
    df = pd.read_parquet(out / "mrc.parquet")
    assert df["policy"].tolist() == ["lru"] * 3 + ["belady"] * 3
    assert (out / "mrc.png").stat().st_size > 0
    printed = json.loads(r.output)
    assert [row["misses"] for row in printed] == df["misses"].tolist()
    stream = batch_access_stream(trace, 1)
    assert df["misses"].tolist()[:3] == [lcs_misses(stream, c, "LRU") for c in (2, 16, 128)]


@pytest.mark.parametrize(("args", "says"), [
    (["--policy", "lru,lrv"], "lrv"),
    (["--capacities", "0,4"], "--capacities"),
    (["--capacities", "4,200%"], "--capacities"),
    (["--expert-compute", "token"], "token"),
])
def test_mrc_refuses_bad_options_before_writing(tmp_path, args, says):
    trace = synth_from_preset("olmoe-1b-7b", layers=2, requests=1, tokens=10, seed=1)
    path = tmp_path / "t.parquet"
    write_trace(trace, path)
    out = tmp_path / "mrc"
    r = CliRunner().invoke(cli, ["mrc", str(path), "--out", str(out), *args])
    assert r.exit_code == 2
    assert says in r.output
    assert "Traceback" not in r.output
    assert not out.exists()


def test_mrc_refuses_a_missing_trace(tmp_path):
    r = CliRunner().invoke(cli, ["mrc", str(tmp_path / "none.parquet"), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2
    assert "none.parquet" in r.output


def test_mrc_stream_is_the_workload_order():
    """Guard for the stack pass: the stream it reads is the access order per-expert
    execution looks experts up in (the same as batch_access_stream's)."""
    from moesim.simulator.workload import build_workload

    trace = synth_from_preset("olmoe-1b-7b", layers=2, requests=3, tokens=5, seed=9)
    assert build_workload(trace, batch_size=3).keys().tolist() == batch_access_stream(trace, 3)
    assert np.array_equal(build_workload(trace).keys(), np.array(batch_access_stream(trace, 1)))

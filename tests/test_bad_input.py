"""A corpus of bad input (issue 16): every case ends with exit code 2, one paragraph that names
the file, key or row (checked by a fragment of the message), no traceback, and nothing written.
Across scenarios, traces, importers, sweeps, calibration files and output locations."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from moesim.cli import cli
from moesim.traces.io import write_trace
from moesim.traces.synth import synth_from_preset
from tests.helpers import error_of

GOOD_SCENARIO = """seed: 0
hardware: {preset: a100-80g-pcie4}
workload: {trace: {synth: {preset: olmoe-1b-7b, layers: 2, tokens: 5}}, batch_size: 1}
cache: {capacity: 5%}
policies: {eviction: lru}
"""


def good_trace(d: Path) -> Path:
    p = d / "t.parquet"
    write_trace(synth_from_preset("olmoe-1b-7b", layers=2, tokens=6, seed=1), p)
    return p


def tampered_trace(d: Path, change: Callable[[pa.Table], pa.Table]) -> Path:
    """The good trace with its table (metadata or columns) changed and written back."""
    src = good_trace(d)
    table = change(pq.read_table(src))
    bad = d / "bad.parquet"
    pq.write_table(table, bad)
    return bad


def with_meta(table: pa.Table, key: str, value: object) -> pa.Table:
    meta = dict(table.schema.metadata or {})
    for k, v in list(meta.items()):
        if k.decode().startswith("moesim"):
            doc = json.loads(v)
            target = doc.get("model", doc)
            target[key] = value
            meta[k] = json.dumps(doc).encode()
    return table.replace_schema_metadata(meta)


def scen(d: Path, text: str) -> Path:
    p = d / "s.yaml"
    p.write_text(text)
    return p


def raw_calibration(d: Path, drop: str | None = None, nan: bool = False) -> Path:
    """Copy measurements in the `moesim calibrate measure` layout (three sizes)."""
    import pandas as pd

    df = pd.DataFrame([{"kind": "copy", "direction": "h2d", "memory": "pageable", "bytes": b,
                        "median_s": 1e-5 + b / 2e10, "device": "cpu"} for b in (2**16, 2**20, 2**24)])
    if drop:
        df = df.drop(columns=[drop])
    if nan:
        df.loc[1, "median_s"] = float("nan")
    p = d / "raw.parquet"
    df.to_parquet(p)
    return p


# (name, setup(tmp) -> argv, fragment of the message, path that must not exist afterwards or None)
CASES: list[tuple[str, Callable[[Path], list[str]], str, str | None]] = [
    # scenarios
    ("broken yaml", lambda d: ["run", str(scen(d, "seed: [0\n")), "--out", str(d / "o")], "broken YAML at line", "o"),
    ("unknown key", lambda d: ["run", str(scen(d, GOOD_SCENARIO + "cahce: {}\n")), "--out", str(d / "o")], "cahce", "o"),
    ("unknown policy", lambda d: ["run", str(scen(d, GOOD_SCENARIO.replace("lru", "lruu"))), "--out", str(d / "o")],
     "unknown eviction policy 'lruu'", "o"),
    ("unknown policy parameter", lambda d: ["run", str(scen(d, GOOD_SCENARIO.replace("{eviction: lru}",
     "{eviction: {name: least-stale, ordr: relative}}"))), "--out", str(d / "o")], "ordr", "o"),
    ("parameter out of range", lambda d: ["run", str(scen(d, GOOD_SCENARIO.replace("{eviction: lru}",
     "{prefetch: {name: lookahead, depth: 0}}"))), "--out", str(d / "o")], "depth must be >= 1", "o"),
    ("bad capacity", lambda d: ["run", str(scen(d, GOOD_SCENARIO.replace("5%", "five"))), "--out", str(d / "o")],
     "cache.capacity", "o"),
    ("capacity over 100%", lambda d: ["run", str(scen(d, GOOD_SCENARIO.replace("5%", "150%"))), "--out", str(d / "o")],
     "more than 100%", "o"),
    ("negative bandwidth", lambda d: ["run", str(scen(d, GOOD_SCENARIO.replace("{preset: a100-80g-pcie4}",
     "{preset: a100-80g-pcie4, links: {pcie: {bandwidth_gbps: -5}}}"))), "--out", str(d / "o")], "bandwidth", "o"),
    ("unknown hardware preset", lambda d: ["run", str(scen(d, GOOD_SCENARIO.replace("a100-80g-pcie4", "a100-pcie"))),
     "--out", str(d / "o")], "a100-pcie", "o"),
    ("scenario is a list", lambda d: ["run", str(scen(d, "- a\n- b\n")), "--out", str(d / "o")], "mapping", "o"),
    ("missing scenario", lambda d: ["run", str(d / "none.yaml"), "--out", str(d / "o")], "none.yaml", "o"),
    ("--set without =", lambda d: ["run", "quickstart", "--set", "cache.capacity", "--out", str(d / "o")],
     "--set 'cache.capacity'", "o"),
    ("--set unknown key", lambda d: ["run", "quickstart", "--set", "cache.size=5%", "--out", str(d / "o")],
     "cache.size", "o"),
    ("batch size 0", lambda d: ["run", "quickstart", "--set", "workload.batch_size=0", "--out", str(d / "o")],
     "batch_size", "o"),
    ("bad execution mode", lambda d: ["run", "quickstart", "--set", "expert_compute=fused", "--out", str(d / "o")],
     "expert_compute", "o"),
    # traces
    ("not parquet", lambda d: (d.joinpath("x.parquet").write_bytes(b"garbage"), ["trace", "info", str(d / "x.parquet")])[1],
     "x.parquet", None),
    ("missing trace", lambda d: ["trace", "info", str(d / "none.parquet")], "none.parquet", None),
    ("trace missing a column", lambda d: ["trace", "info", str(tampered_trace(d, lambda t: t.drop_columns(["layer"])))],
     "layer", None),
    ("trace with no rows", lambda d: ["run", "quickstart", "--trace", str(tampered_trace(d, lambda t: t.slice(0, 0))),
     "--out", str(d / "o")], "has no rows", "o"),
    ("trace metadata num_layers negative", lambda d: ["trace", "info", str(tampered_trace(
        d, lambda t: with_meta(t, "num_layers", -2)))], "num_layers", None),
    ("trace metadata top_k not a number", lambda d: ["trace", "info", str(tampered_trace(
        d, lambda t: with_meta(t, "top_k", "eight")))], "top_k", None),
    ("trace metadata expert_bytes a list", lambda d: ["trace", "info", str(tampered_trace(
        d, lambda t: with_meta(t, "expert_bytes", [1, 2])))], "expert_bytes", None),
    ("trace optional column of strings", lambda d: ["trace", "info", str(tampered_trace(
        d, lambda t: t.append_column("probs", pa.array([["x"]] * len(t), pa.list_(pa.string())))))], "probs", None),
    ("trace optional column all null", lambda d: ["trace", "info", str(tampered_trace(
        d, lambda t: t.append_column("pred_next", pa.nulls(len(t), pa.list_(pa.float32())))))], "pred_next", None),
    ("trace in a scenario, experts out of range", lambda d: ["run", "quickstart", "--trace", str(tampered_trace(
        d, lambda t: with_meta(t, "num_experts", 4))), "--out", str(d / "o")], "num_experts", "o"),
    # importers
    ("jsonl without records", lambda d: (d.joinpath("e.jsonl").write_text("\n"),
     ["trace", "import", "--format", "expert-jsonl", str(d / "e.jsonl"), "--preset", "mixtral-8x7b",
      "--out", str(d / "o.parquet")])[1], "e.jsonl", "o.parquet"),
    ("vllm jsonl without records", lambda d: (d.joinpath("v.jsonl").write_text(""),
     ["trace", "import", "--format", "vllm-routes-jsonl", str(d / "v.jsonl"), "--preset", "olmoe-1b-7b",
      "--out", str(d / "o.parquet")])[1], "v.jsonl", "o.parquet"),
    ("import a missing file", lambda d: ["trace", "import", "--format", "expert-jsonl", str(d / "none.jsonl"),
     "--preset", "mixtral-8x7b", "--out", str(d / "o.parquet")], "none.jsonl", "o.parquet"),
    ("long table without its columns", lambda d: (d.joinpath("l.csv").write_text("a,b\n1,2\n"),
     ["trace", "import", "--format", "long-table", str(d / "l.csv"), "--preset", "olmoe-1b-7b",
      "--out", str(d / "o.parquet")])[1], "l.csv", "o.parquet"),
    # sweeps
    ("grid without =", lambda d: ["sweep", "quickstart", "--grid", "cache.capacity", "--out", str(d / "o")],
     "--grid 'cache.capacity'", "o"),
    ("grid unknown key", lambda d: ["sweep", "quickstart", "--grid", "cache.capacty=1%,5%", "--out", str(d / "o")],
     "cache.capacty", "o"),
    ("sweep section unknown key", lambda d: ["sweep", str(scen(d, GOOD_SCENARIO + "sweep: {axis: {}}\n")),
     "--out", str(d / "o")], "sweep.axis", "o"),
    ("zipped axes of unequal length", lambda d: ["sweep", str(scen(d, GOOD_SCENARIO + "sweep: {axes: {cache.capacity: "
     "[1%, 5%], policies.eviction: [lru]}, zip: [[cache.capacity, policies.eviction]]}\n")), "--out", str(d / "o")],
     "same number of values", "o"),
    ("workers 0", lambda d: ["sweep", "quickstart", "--workers", "0", "--out", str(d / "o")], "--workers", "o"),
    # calibration
    ("raw calibration missing a column", lambda d: ["calibrate", "fit", str(raw_calibration(d, drop="median_s")),
     "--out", str(d / "p.yaml")], "lacks column(s) median_s", "p.yaml"),
    ("raw calibration copies without sizes", lambda d: ["calibrate", "fit", str(raw_calibration(d, drop="bytes")),
     "--out", str(d / "p.yaml")], "copy rows need column(s) bytes", "p.yaml"),
    ("raw calibration with NaN times", lambda d: ["calibrate", "fit", str(raw_calibration(d, nan=True)),
     "--out", str(d / "p.yaml")], "row 1 (copy) has median_s NaN", "p.yaml"),
    ("missing profile", lambda d: ["run", "quickstart", "--set", f"hardware.profile={d / 'none.yaml'}",
     "--out", str(d / "o")], "none.yaml", "o"),
    # output locations
    ("run --out is a file", lambda d: (d.joinpath("f").write_text("x"),
     ["run", "quickstart", "--set", "workload.trace.synth.tokens=5", "--out", str(d / "f" / "o")])[1], "is a file", "f/o"),
    ("trace synth --out under a file", lambda d: (d.joinpath("f").write_text("x"),
     ["trace", "synth", "--preset", "olmoe-1b-7b", "--tokens", "5", "--out", str(d / "f" / "t.parquet")])[1],
     "is a file", "f/t.parquet"),
    ("sweep --out is a file", lambda d: (d.joinpath("f").write_text("x"),
     ["sweep", "quickstart", "--grid", "cache.capacity=5%", "--out", str(d / "f")])[1], "is a file", None),
    ("compare --out under a file", lambda d: (d.joinpath("f").write_text("x"),
     ["compare", "quickstart", "--out", str(d / "f" / "c")])[1], "is a file", "f/c"),
    ("mrc --out under a file", lambda d: (d.joinpath("f").write_text("x"),
     ["mrc", str(good_trace(d)), "--out", str(d / "f" / "m")])[1], "is a file", "f/m"),
    ("plot --out of an unknown kind", lambda d: ["plot", str(d), "--kind", "lines", "--metric", "hit_rate",
     "--x", "cache.capacity", "--out", str(d / "p.gif")], "p.gif", "p.gif"),
    ("events under a file", lambda d: (d.joinpath("f").write_text("x"),
     ["run", "quickstart", "--no-write", "--events", str(d / "f" / "e.json")])[1], "is a file", "f/e.json"),
    ("calibrate fit --out under a file", lambda d: (d.joinpath("f").write_text("x"),
     ["calibrate", "fit", str(raw_calibration(d)), "--out", str(d / "f" / "p.yaml")])[1], "is a file", "f/p.yaml"),
    # issue 36: optional trace columns of the wrong type or with nulls
    ("trace weights as strings", lambda d: ["trace", "info", str(tampered_trace(d, lambda t: t.set_column(
        t.schema.get_field_index("weights"), "weights",
        pa.array([[str(x) for x in row] for row in t.column("weights").to_pylist()]))))],
     "column 'weights' must hold lists of numbers", None),
    ("trace node ids as strings", lambda d: ["trace", "info", str(tampered_trace(d, lambda t: t.append_column(
        "node", pa.array(["1"] * t.num_rows))))], "column 'node' must hold integers, found string", None),
    ("trace node ids with a null", lambda d: ["trace", "info", str(tampered_trace(d, lambda t: t.append_column(
        "node", pa.array([None] + [0] * (t.num_rows - 1), type=pa.int16()))))], "column 'node' is null at row 0", None),
    ("trace accepted as integers", lambda d: ["trace", "info", str(tampered_trace(d, lambda t: t.append_column(
        "accepted", pa.array([1] * t.num_rows))))], "column 'accepted' must hold booleans", None),
    ("trace probs with a null inside", lambda d: ["trace", "info", str(tampered_trace(d, lambda t: t.append_column(
        "probs", pa.array([[None] + [0.0] * 63] * t.num_rows, type=pa.list_(pa.float32())))))],
     "column 'probs' has a null value", None),
    # issue 36: the .npy importer and importer errors that named no file (the corpus's earlier
    # float and empty cases had a shape the importer refused first, so they never reached these)
    ("npy of floats", lambda d: (np.save(d / "f.npy", np.zeros((2, 2, 8), dtype=np.float32)),
     ["trace", "import", "--format", "routed-experts-npy", str(d / "f.npy"), "--preset", "olmoe-1b-7b",
      "--out", str(d / "o.parquet")])[1], "f.npy: the array holds float32 values", "o.parquet"),
    ("empty npy", lambda d: (np.save(d / "e.npy", np.zeros((0, 2, 8), dtype=np.int16)),
     ["trace", "import", "--format", "routed-experts-npy", str(d / "e.npy"), "--preset", "olmoe-1b-7b",
      "--out", str(d / "o.parquet")])[1], "e.npy: the array is empty", "o.parquet"),
    ("npy of no bytes", lambda d: (d.joinpath("z.npy").write_bytes(b""),
     ["trace", "import", "--format", "routed-experts-npy", str(d / "z.npy"), "--preset", "olmoe-1b-7b",
      "--out", str(d / "o.parquet")])[1], "z.npy: the file is empty (0 bytes)", "o.parquet"),
    ("empty npy of one axis", lambda d: (np.save(d / "e1.npy", np.zeros(0, dtype=np.int64)),
     ["trace", "import", "--format", "routed-experts-npy", str(d / "e1.npy"), "--preset", "olmoe-1b-7b",
      "--out", str(d / "o.parquet")])[1], "e1.npy: the array is empty (shape (0,))", "o.parquet"),
    ("npy that is text", lambda d: (d.joinpath("t.npy").write_text("0,1,2\n"),
     ["trace", "import", "--format", "routed-experts-npy", str(d / "t.npy"), "--preset", "olmoe-1b-7b",
      "--out", str(d / "o.parquet")])[1], "t.npy: not a readable .npy array", "o.parquet"),
    ("long table with a bad phase", lambda d: (d.joinpath("ph.csv").write_text(
        "request,position,layer,expert,phase\n" + "".join(f"0,0,0,{e},later\n" for e in range(8))),
     ["trace", "import", "--format", "long-table", str(d / "ph.csv"), "--preset", "olmoe-1b-7b",
      "--out", str(d / "o.parquet")])[1], "ph.csv", "o.parquet"),
    # issue 36: found by trying moesim as a new user would
    ("run --out in an unwritable file system", lambda d: ["run", "quickstart", "--set",
     "workload.trace.synth.tokens=5", "--out", "/proc/moesim-out"], "/proc is not writable", None),
    ("capacity of more experts than the model has", lambda d: ["run", "quickstart", "--set",
     "cache.capacity=2000 experts", "--out", str(d / "o")], "more than the model's 1,024 experts", "o"),
    ("missing trace given with the suggested --set", lambda d: ["run", "quickstart", "--set",
     f"workload.trace.path={d / 'none.parquet'}", "--out", str(d / "o")], "none.parquet: no such file", "o"),
    ("compare --trace missing", lambda d: ["compare", "quickstart", "--trace", str(d / "none.parquet"), "--out",
     str(d / "c")], "none.parquet: no such file", "c"),
    ("sweep --trace missing", lambda d: ["sweep", "quickstart", "--trace", str(d / "none.parquet"), "--grid",
     "cache.capacity=5%", "--out", str(d / "s")], "none.parquet: no such file", "s/points"),
    ("plugin class missing required methods", lambda d: (d.joinpath("p.py").write_text(
        "from moesim.policies.eviction import REGISTRY, EvictionPolicy\n\n"
        "@REGISTRY.register('half')\nclass Half(EvictionPolicy):\n    def on_insert(self, key, demand): pass\n"),
     ["run", "quickstart", "--plugin", str(d / "p.py"), "--set", "policies.eviction=half", "--out", str(d / "o")])[1],
     "does not define candidates, on_access, on_remove", "o"),
]


def test_the_corpus_has_forty_cases_or_more():
    assert len(CASES) >= 40


@pytest.mark.parametrize(("name", "setup", "fragment", "absent"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused_in_one_paragraph(tmp_path, name, setup, fragment, absent):
    argv = setup(tmp_path)
    r = CliRunner().invoke(cli, argv)
    assert r.exit_code == 2, (name, r.exit_code, r.output, r.exception)
    text = error_of(r.output)
    assert fragment in text, (name, r.output)
    assert "Traceback" not in r.output
    if absent is not None:
        assert not (tmp_path / absent).exists(), (name, absent)

"""Replaying a trace file a piece at a time (``moesim.simulator.stream``, ``docs/design.md``
"Streaming replay"): the pieces the reader cuts (whole batches of requests, every row once,
errors naming the file's row), the replay in pieces equal to the whole-trace replay on every
per-pass and per-request column and every summary figure (a hypothesis property over
policies, batch sizes, execution modes, host styles and piece sizes; the real Mixtral log),
and the replays that read the whole trace, each with its reason."""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from moesim.config.scenario import load_scenario
from moesim.errors import MoesimError
from moesim.simulator import kernel
from moesim.simulator.blocks import PassBlocks
from moesim.simulator.engine import Simulation
from moesim.simulator.stream import CHUNK_ROWS, READ_AHEAD, piece_rows, read_ahead, why_whole
from moesim.simulator.workload import build_workload, join
from moesim.traces.io import iter_trace, read_trace, requests_in_order, trace_rows, write_trace
from moesim.traces.synth import synth_from_preset
from moesim.traces.trace import Trace
from tests.helpers import mixtral_trace, unwrap

COLUMNS = ("request", "step", "position", "phase", "layer", "experts", "weights", "pred_next")


def _ragged(requests: int = 9, seed: int = 3) -> Trace:
    """An OLMoE-shaped synthetic trace whose requests decode different numbers of tokens
    (12-token prompts, 5..30 decode tokens), with next-layer predictions."""
    tr = synth_from_preset("olmoe-1b-7b", requests=requests, prompt_tokens=12, tokens=30, seed=seed,
                           pred_next=True)
    keep_decode = 5 + (np.arange(requests) * 7) % 26  # decode tokens kept per request
    return tr.take(tr.position < 12 + keep_decode[tr.request])


@pytest.fixture(scope="module")
def ragged_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_trace(_ragged(), tmp_path_factory.mktemp("stream") / "ragged.parquet")


def _summary(res) -> dict:
    return {k: v for k, v in res.summary.items() if k not in ("wall_s", "trace_pieces")}


def _same(whole, pieces) -> None:
    assert pieces.steps.equals(whole.steps)
    assert pieces.requests.equals(whole.requests)
    assert _summary(pieces) == _summary(whole)


# -- the reader -------------------------------------------------------------------------------
def test_pieces_are_whole_batches_of_requests_and_every_row_once(ragged_file: Path) -> None:
    whole = read_trace(ragged_file)
    got = list(iter_trace(ragged_file, 700, requests_multiple=2))
    # rows per request in the file (the ragged lengths): 16 layers x (12 + 5 + 7r mod 26) tokens
    rows_of = {r: 16 * (12 + 5 + (r * 7) % 26) for r in range(9)}
    assert [len(p) for p in got] == [sum(rows_of[r] for r in ids) for ids in
                                    [np.unique(p.request).tolist() for p in got]]
    assert len(got) >= 5
    seen: list[int] = []
    for i, p in enumerate(got):
        ids = np.unique(p.request).tolist()
        # cut where the rows read reach 700, after the last whole batch among them
        assert len(p) <= 700 + 2 * max(rows_of.values()) * 2
        assert len(ids) % 2 == 0 or i == len(got) - 1  # a batch of two never straddles two pieces
        assert not set(ids) & set(seen)
        seen += ids
    assert seen == list(range(9))
    for col in COLUMNS:
        assert np.array_equal(np.concatenate([getattr(p, col) for p in got]), getattr(whole, col)), col


def test_pieces_stop_after_max_requests(ragged_file: Path) -> None:
    got = list(iter_trace(ragged_file, 300, requests_multiple=2, max_requests=5))
    ids = [np.unique(p.request).tolist() for p in got]
    assert [r for x in ids for r in x] == [0, 1, 2, 3, 4]
    assert [len(x) for x in ids] == [2, 2, 1]  # 300 rows hold less than a request: one batch each


def test_a_bad_row_in_a_later_piece_is_named_by_its_row_in_the_file(tmp_path: Path) -> None:
    tr = _ragged()
    tr.experts[1234, 1] = 99  # the model has 64 experts per layer
    path = write_trace(tr, tmp_path / "bad.parquet")
    with pytest.raises(MoesimError, match=r"bad\.parquet: column 'experts' has expert id\(s\) .* at row 1234;"):
        list(iter_trace(path, 500))
    with pytest.raises(MoesimError, match="at row 1234;"):
        read_trace(path)


def test_a_file_out_of_request_order_is_read_whole_with_the_same_results(tmp_path: Path) -> None:
    tr = _ragged()
    order = np.argsort(-tr.request.astype(np.int64), kind="stable")  # last request first
    path = write_trace(tr.take(order), tmp_path / "reversed.parquet")
    assert not requests_in_order(path)
    with pytest.raises(MoesimError, match="not in request order"):
        list(iter_trace(path, 500))
    sc = load_scenario("quickstart", [f"workload.trace.path={path}", "cache.capacity=10%"])
    sim = Simulation(sc, chunk_rows=500)
    assert sim.source.pieces is None
    assert sim.source.whole_reason == "the trace file's rows are not in request order"
    res = sim.run()
    assert res.summary["trace_pieces"] == 1
    in_order = write_trace(tr, tmp_path / "in-order.parquet")
    _same(Simulation(load_scenario("quickstart", [f"workload.trace.path={in_order}", "cache.capacity=10%"]),
                     chunk_rows=500).run(), res)


def test_a_file_whose_first_pieces_are_in_order_and_the_rest_not_is_read_whole(tmp_path: Path) -> None:
    """The order is checked over the whole file while the first piece is read: a file whose
    disorder starts past its first pieces is read whole too, with the same results."""
    tr = _ragged()
    req = tr.request.astype(np.int64)
    late = int(np.unique(req)[-3])  # the last three requests, in reverse
    order = np.concatenate([np.flatnonzero(req < late),
                            np.argsort(-np.where(req >= late, req, -1), kind="stable")[:int((req >= late).sum())]])
    path = write_trace(tr.take(order), tmp_path / "late-disorder.parquet")
    assert not requests_in_order(path)
    assert len(list(itertools.islice(iter_trace(path, 500), 3))) == 3  # the first pieces read
    sc = load_scenario("quickstart", [f"workload.trace.path={path}", "cache.capacity=10%"])
    sim = Simulation(sc, chunk_rows=500)
    assert sim.source.pieces is None
    assert sim.source.whole_reason == "the trace file's rows are not in request order"
    in_order = write_trace(tr, tmp_path / "in-order.parquet")
    whole = Simulation(load_scenario("quickstart", [f"workload.trace.path={in_order}", "cache.capacity=10%"]),
                       trace=read_trace(in_order)).run()
    res = sim.run()
    assert res.summary["trace_pieces"] == 1
    assert _summary(res) == _summary(whole)


# -- the replay ---------------------------------------------------------------------------------
POLICIES = st.sampled_from([("lru", "none"), ("least-stale", "score-percentile"), ("fld", "previous-token"),
                            ("lfu", "lookahead"), ("score", "next-gate-topk"), ("fifo", "oracle"),
                            ("least-stale", "previous-token"), ("lhu", "none"), ("belady", "oracle"),
                            ("belady", "none"), ("belady", "next-gate-topk"), ("belady", "score-percentile"),
                            ("lru", "static-pin"), ("belady", "static-pin"), ("least-stale", "static-pin")])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pol=POLICIES, batch=st.integers(1, 4), mode=st.sampled_from(["layer", "per-expert", "on-arrival"]),
       chunk=st.integers(200, 1500), cap=st.sampled_from(["3%", "10%", "40%"]),
       style=st.sampled_from(["none", "hf-loop", "graph-per-expert"]),
       fetch=st.sampled_from(["pipelined", "blocking"]), max_requests=st.sampled_from([None, 5, 8]),
       block=st.sampled_from([1, 40, 1 << 16]),
       miss=st.sampled_from(["fetch", "fetch", "drop", "speculative", "fetch-lowest-bit", "fetch-priority"]))
@example(pol=("least-stale", "score-percentile"), batch=2, mode="per-expert", chunk=700, cap="10%",
         style="hf-loop", fetch="blocking", max_requests=None, block=1, miss="fetch")
@example(pol=("lru", "none"), batch=3, mode="layer", chunk=200, cap="3%", style="none", fetch="pipelined",
         max_requests=5, block=1 << 16, miss="fetch")
@example(pol=("belady", "oracle"), batch=1, mode="per-expert", chunk=300, cap="3%", style="none",
         fetch="pipelined", max_requests=None, block=40, miss="fetch")
@example(pol=("belady", "score-percentile"), batch=1, mode="layer", chunk=200, cap="40%", style="none",
         fetch="pipelined", max_requests=None, block=1 << 16, miss="fetch")  # keys proposed that the piece never routes
@example(pol=("lru", "static-pin"), batch=1, mode="layer", chunk=200, cap="40%", style="none",
         fetch="pipelined", max_requests=None, block=1 << 16, miss="fetch")  # a piece a request: the share ends in the second
@example(pol=("lru", "oracle"), batch=1, mode="per-expert", chunk=200, cap="10%", style="none",
         fetch="pipelined", max_requests=None, block=40, miss="drop")
@example(pol=("least-stale", "none"), batch=2, mode="layer", chunk=300, cap="10%", style="none",
         fetch="pipelined", max_requests=None, block=1 << 16, miss="speculative")
def test_a_replay_in_pieces_equals_the_whole_trace_replay(ragged_file: Path, monkeypatch, pol, batch, mode, chunk, cap,
                                                          style, fetch, max_requests, block, miss) -> None:
    """... and so does one whose per-pass rows are handed over ``block`` passes at a time
    (from the second block on, through a file on disk), and one whose miss policy changes
    what tokens compute (each piece's tokens its own)."""
    monkeypatch.setattr(kernel, "BLOCK_PASSES", block)
    sets = [f"workload.trace.path={ragged_file}", f"policies.eviction={pol[0]}", f"policies.prefetch={pol[1]}",
            f"workload.batch_size={batch}", f"expert_compute={mode}", f"cache.capacity={cap}",
            f"execution.style={style}", f"expert_fetch={fetch}", f"policies.miss={miss}"]
    if max_requests is not None:
        sets.append(f"workload.max_requests={max_requests}")
    if style != "none":  # a style sets the execution mode and fetch discipline unless the scenario does
        sets = [s for s in sets if not s.startswith(("expert_compute", "expert_fetch"))]
    if pol[1] == "static-pin":  # a calibration share that ends past the first pieces
        sets = [s for s in sets if not s.startswith("policies.prefetch")] + [
            "policies.prefetch.name=static-pin", "policies.prefetch.calibration=0.3"]
    sc = load_scenario("quickstart", sets)
    whole = Simulation(sc, trace=read_trace(ragged_file)).run()
    sim = Simulation(sc, chunk_rows=chunk)
    assert sim.source.pieces is not None, sim.source.whole_reason
    res = sim.run()
    _same(whole, res)
    pieces = len(list(iter_trace(ragged_file, chunk, batch, max_requests)))
    assert res.summary["trace_pieces"] == pieces
    assert whole.summary["trace_pieces"] == 1


def test_a_trace_from_a_file_whole_or_in_pieces_replays_on_the_synthesised_traces_compiled_form(
        ragged_file: Path) -> None:
    """A file's float columns come in Arrow's read-only buffers and a synthesised trace's in
    NumPy's own. The kernel's per-token functions (here under a miss policy that drops
    experts) get both read-only, so the form compiled for a synthesised trace replays a trace
    file too, read whole or in pieces, with no new compile."""
    from moesim.simulator.kernel_compute import replay_passes

    sc = load_scenario("quickstart", [f"workload.trace.path={ragged_file}", "cache.capacity=10%",
                                      "policies.prefetch=previous-token", "policies.miss=drop"])
    synthesised = Simulation(sc, trace=_ragged()).run()
    assert synthesised.summary["replay_path"] == "kernel"
    forms = list(replay_passes.signatures)
    whole = Simulation(sc, trace=read_trace(ragged_file)).run()
    sim = Simulation(sc, chunk_rows=300)
    assert sim.source.pieces is not None, sim.source.whole_reason
    pieces = sim.run()
    assert replay_passes.signatures == forms
    _same(synthesised, whole)
    _same(synthesised, pieces)


@pytest.mark.parametrize(("mode", "miss", "batch", "chunk"), [
    ("layer", "fetch", 1, 300), ("per-expert", "drop", 2, 700), ("on-arrival", "speculative", 3, 200)])
def test_cache_aware_routing_in_pieces_equals_the_whole_trace_replay(tmp_path: Path, mode: str, miss: str,
                                                                    batch: int, chunk: int) -> None:
    """Cache-aware routing read a piece at a time: each piece's logits its own, the running
    mean of ``|z|`` carried over, every per-pass row and the summary as the whole trace's."""
    path = write_trace(synth_from_preset("olmoe-1b-7b", layers=4, requests=9, prompt_tokens=6, tokens=14, seed=4,
                                         pred_next=True, probs=True), tmp_path / "probs.parquet")
    sc = load_scenario("quickstart", [f"workload.trace.path={path}", "policies.routing=cache-aware",
                                      f"policies.miss={miss}", f"expert_compute={mode}",
                                      f"workload.batch_size={batch}", "cache.capacity=60%"])
    whole = Simulation(sc, trace=read_trace(path)).run()
    sim = Simulation(sc, chunk_rows=chunk)
    assert sim.source.pieces is not None, sim.source.whole_reason
    res = sim.run()
    _same(whole, res)
    assert res.summary["trace_pieces"] > 1
    assert res.summary["replay_path"] == "kernel"
    assert res.steps.tokens_altered.sum() > 0


def test_belady_in_pieces_reads_each_keys_first_access_after_the_piece_from_a_first_pass(ragged_file: Path) -> None:
    """``accesses_after`` against the whole trace's access keys, by brute force: piece ``k``
    starts at the sum of the earlier pieces' accesses, and a key's entry is the first index
    past the piece where the whole trace's keys hold it (-1: none)."""
    from moesim.simulator.stream import accesses_after, pieces

    sc = load_scenario("quickstart", [f"workload.trace.path={ragged_file}", "workload.batch_size=2"])
    whole = build_workload(read_trace(ragged_file), 2)
    keys = whole.keys() * 4 + 1  # 4 precisions, the default the second
    sizes = [len(w.acc_layer) for w in pieces(sc, ragged_file, 600)]
    assert len(sizes) >= 5
    firsts, after = accesses_after(pieces(sc, ragged_file, 600), 4, 1, 16 * 64 * 4)
    assert firsts.tolist() == np.concatenate([[0], np.cumsum(sizes)]).tolist()
    assert firsts[-1] == len(keys)
    assert after.shape == (len(sizes), 16 * 64 * 4)
    for k in range(len(sizes)):
        end = firsts[k + 1]
        for key in range(after.shape[1]):
            later = np.flatnonzero(keys[end:] == key)
            assert after[k, key] == (end + later[0] if later.size else -1), (k, key)


def test_belady_in_pieces_shows_both_passes_and_names_a_file_that_changed(ragged_file: Path, monkeypatch) -> None:
    """The progress covers the first pass and the replay (twice the file's rows), and a file whose
    pieces no longer match the first pass is named in one paragraph."""
    from moesim.simulator import stream

    sc = load_scenario("quickstart", [f"workload.trace.path={ragged_file}", "policies.eviction=belady"])
    seen: list[tuple[int, int]] = []
    sim = Simulation(sc, chunk_rows=700, progress=lambda d, t: seen.append((d, t)))
    assert sim.source.whole_reason is None
    sim.run()
    rows = len(read_trace(ragged_file))
    assert {t for _, t in seen} == {2 * rows}
    done = [d for d, _ in seen]
    assert done == sorted(done)
    assert done[-1] == 2 * rows
    assert any(d <= rows for d in done)  # the first pass
    assert rows in done  # which reads every row of the file
    assert any(d > rows for d in done)  # the replay
    real = stream.accesses_after

    def shifted(*args, **kwargs):
        firsts, after = real(*args, **kwargs)
        firsts[2:] += 1
        return firsts, after

    monkeypatch.setattr(stream, "accesses_after", shifted)
    with pytest.raises(MoesimError, match=rf"trace {ragged_file}: the file changed while it was replayed "
                                          r"\(piece 2 has other accesses than its first pass read\)"):
        Simulation(sc, chunk_rows=700).run()


@pytest.mark.parametrize("slow_check", [False, True])
def test_each_pieces_proposals_are_made_as_it_is_read_and_the_replay_is_the_whole_traces(
        ragged_file: Path, monkeypatch, slow_check: bool) -> None:
    """Score-percentile's proposals read the piece alone, so the thread that reads the next
    piece makes them too (``Simulation.prepare_piece``): the kernel replays every piece read
    after the policies were made from those (``_chunks_of``), asks the policy only for the
    pieces read before (the first, and up to ``READ_AHEAD`` queued behind it), and the replay
    is the whole trace's. The kernel takes 7 passes a call here, so that a piece's proposals
    go over in several. With a slow check of the file's order (``slow_check``: a slow
    machine), the reader fills its queue before the policies exist: the kernel asks for all
    of those pieces' proposals, and for no later one's."""
    if slow_check:
        import moesim.traces.io as tio

        in_order = tio.requests_in_order
        monkeypatch.setattr(tio, "requests_in_order", lambda path: time.sleep(1.0) or in_order(path))
    monkeypatch.setattr(kernel, "CHUNK", 7)
    made, asked = [], []
    chunks_of, ahead = kernel._chunks_of, kernel._proposals_ahead
    monkeypatch.setattr(kernel, "_chunks_of", lambda props, b, num_l: made.append(b[-1]) or chunks_of(props, b, num_l))
    monkeypatch.setattr(kernel, "_proposals_ahead", lambda pf, b: asked.append(b[-1]) or ahead(pf, b))
    sc = load_scenario("quickstart", [f"workload.trace.path={ragged_file}", "policies.eviction=least-stale",
                                      "policies.prefetch=score-percentile", "cache.capacity=10%"])
    whole = Simulation(sc, trace=read_trace(ragged_file)).run()
    assert len(asked) == 1  # a trace in memory: asked as it is replayed
    assert not made
    asked.clear()
    res = Simulation(sc, chunk_rows=500).run()
    _same(whole, res)
    # the pieces read before the policies existed: the first and up to READ_AHEAD queued
    # behind it (a slow machine's reader fills the queue before the policies are made)
    assert res.summary["trace_pieces"] >= READ_AHEAD + 2
    assert 1 <= len(asked) <= READ_AHEAD + 1
    if slow_check:
        assert len(asked) == READ_AHEAD + 1
    assert made  # the rest on the reading thread
    assert len(made) + len(asked) == res.summary["trace_pieces"]
    assert sum(made) + sum(asked) == whole.summary["forward_passes"]


def test_a_long_replays_rows_go_to_disk_and_back_the_same_and_its_folder_goes_with_it(
        ragged_file: Path, tmp_path: Path, monkeypatch) -> None:
    import gc

    import pandas as pd

    from moesim.output.results import PassRows, write_results

    sc = load_scenario("quickstart", [f"workload.trace.path={ragged_file}", "policies.eviction=least-stale",
                                      "policies.prefetch=score-percentile", "cache.capacity=10%"])
    whole = Simulation(sc, trace=read_trace(ragged_file)).run()
    monkeypatch.setattr(kernel, "BLOCK_PASSES", 25)
    res = Simulation(sc, chunk_rows=500).run()
    rows = res._steps
    assert isinstance(rows, PassRows)  # more than one block: the rows wait in a file
    assert rows.frame is None
    spool = rows.path
    assert spool is not None
    assert spool.is_file()
    assert pd.read_parquet(spool).equals(whole.steps)
    out = write_results(res, tmp_path / "run")
    assert pd.read_parquet(out / "steps.parquet").equals(whole.steps)
    assert isinstance(res._steps, PassRows)  # writing copied the file; the rows were not read in
    _same(whole, res)
    del res, rows
    gc.collect()
    assert not spool.parent.exists()


def test_a_replay_asked_for_its_summary_alone_keeps_no_rows_and_says_so(ragged_file: Path, monkeypatch) -> None:
    sc = load_scenario("quickstart", [f"workload.trace.path={ragged_file}", "cache.capacity=10%"])
    whole = Simulation(sc, trace=read_trace(ragged_file)).run()
    monkeypatch.setattr(kernel, "BLOCK_PASSES", 25)
    sim = Simulation(sc, chunk_rows=500, keep_rows=False)
    res = sim.run()
    assert _summary(res) == _summary(whole)
    assert res.requests.equals(whole.requests)
    assert sim.blocks.rows.path is None  # nothing went to disk
    assert sim.blocks.rows.frame is None
    with pytest.raises(MoesimError, match=r"kept no per-pass rows .*moesim run --no-write"):
        _ = res.steps


def test_a_replay_of_one_block_keeps_its_rows_in_memory(ragged_file: Path) -> None:
    sim = Simulation(load_scenario("quickstart", [f"workload.trace.path={ragged_file}"]), chunk_rows=500)
    res = sim.run()
    assert res.summary["trace_pieces"] > 1
    assert sim.blocks.rows.path is None  # no file
    assert res.steps is sim.blocks.rows.frame


def test_the_blocks_of_rows_are_taken_in_order_on_a_thread_beside_the_replay(ragged_file: Path, monkeypatch) -> None:
    """A replay in pieces hands its blocks of per-pass rows over on a thread of its own while
    the kernel goes on (issue 34), each block after the one before it: passes numbered on
    from the last block's, every pass once, and the summary and rows the whole replay's."""
    import threading

    sc = load_scenario("quickstart", [f"workload.trace.path={ragged_file}", "cache.capacity=10%"])
    whole = Simulation(sc, trace=read_trace(ragged_file)).run()
    monkeypatch.setattr(kernel, "BLOCK_PASSES", 25)
    taken: list[tuple[int, int, int]] = []  # (thread, first pass, passes) of each block
    take = PassBlocks.take

    def spied(self, wl, *args, **kwargs) -> None:
        taken.append((threading.get_ident(), self._pass_base, wl.num_passes))
        take(self, wl, *args, **kwargs)

    monkeypatch.setattr(PassBlocks, "take", spied)
    sim = Simulation(sc, chunk_rows=500)
    res = sim.run()
    _same(whole, res)
    assert len(taken) > 2
    assert threading.get_ident() not in {t for t, _, _ in taken}
    firsts = [first for _, first, _ in taken]
    assert firsts == np.cumsum([0] + [n for _, _, n in taken[:-1]]).tolist()
    assert firsts[-1] + taken[-1][2] == whole.summary["forward_passes"] == len(res.steps)
    assert sim.wl.num_passes == taken[-1][2]  # the replay ends holding the last block's passes


def test_an_unwritable_temporary_folder_is_one_paragraph_naming_it_and_the_fix(ragged_file: Path, tmp_path: Path,
                                                                                monkeypatch) -> None:
    import tempfile

    from click.testing import CliRunner

    from moesim.cli import cli

    monkeypatch.setattr(kernel, "BLOCK_PASSES", 25)
    monkeypatch.setenv("MOESIM_PIECE_ROWS", "500")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "missing"))
    res = CliRunner().invoke(cli, ["run", "quickstart", "--trace", str(ragged_file), "--out", str(tmp_path / "run"),
                                   "-q"])
    assert res.exit_code == 2, res.output
    assert not (tmp_path / "run").exists()  # nothing half-written
    assert f"temporary folder {tmp_path / 'missing'}" in unwrap(res.output)
    assert "Set TMPDIR to a writable folder" in unwrap(res.output)
    assert "Traceback" not in unwrap(res.output)


def test_a_full_disk_while_writing_the_rows_is_one_paragraph(ragged_file: Path, tmp_path: Path, monkeypatch) -> None:
    import pyarrow.parquet as pq
    from click.testing import CliRunner

    from moesim.cli import cli

    class Full:
        def __init__(self, *a, **k) -> None:
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(kernel, "BLOCK_PASSES", 25)
    monkeypatch.setenv("MOESIM_PIECE_ROWS", "500")
    monkeypatch.setattr(pq, "ParquetWriter", Full)
    res = CliRunner().invoke(cli, ["run", "quickstart", "--trace", str(ragged_file), "--out", str(tmp_path / "run"),
                                   "-q"])
    assert res.exit_code == 2, res.output
    assert not (tmp_path / "run").exists()
    assert "cannot write a long replay's per-pass rows to the temporary folder" in unwrap(res.output)
    assert "(No space left on device). Set TMPDIR to a writable folder" in unwrap(res.output)
    assert "Traceback" not in unwrap(res.output)


def test_a_block_that_fails_to_be_written_is_never_passed_over(ragged_file: Path, tmp_path: Path, monkeypatch) -> None:
    """The second block's write fails, later ones would succeed: the failure ends the run at
    the next block (one block in flight, each waited for before the next is sent; a writer
    that did not wait would lose it under the later blocks' results), and no results are
    written."""
    import pyarrow.parquet as pq
    from click.testing import CliRunner

    from moesim.cli import cli

    real = pq.ParquetWriter

    class SecondFails(real):
        calls = 0

        def write_table(self, table, *a, **k) -> None:
            SecondFails.calls += 1
            if SecondFails.calls == 2:
                raise OSError(5, "Input/output error")
            super().write_table(table, *a, **k)

    monkeypatch.setattr(kernel, "BLOCK_PASSES", 10)
    monkeypatch.setenv("MOESIM_PIECE_ROWS", "500")
    monkeypatch.setattr(pq, "ParquetWriter", SecondFails)
    res = CliRunner().invoke(cli, ["run", "quickstart", "--trace", str(ragged_file), "--out", str(tmp_path / "run"),
                                   "-q"])
    assert SecondFails.calls == 2
    assert res.exit_code == 2, res.output
    assert "(Input/output error). Set TMPDIR to a writable folder" in unwrap(res.output)
    assert not (tmp_path / "run").exists()


def test_the_reader_in_pieces_does_not_pre_buffer(ragged_file: Path, monkeypatch) -> None:
    """pyarrow's pre-buffering keeps every byte range of the file it read until the reader
    goes (apache/arrow#39808): reading the 256 M-access benchmark's 204 MB file in pieces,
    arrow's allocations grew by 190 MB, in 33 MB steps (its coalesced ranges), so a file
    small enough for a test shows nothing. The reader is made without it, and reads every
    row as before."""
    import pyarrow.parquet as pq

    from moesim.traces import io

    made: list[dict] = []

    class Spy(pq.ParquetFile):
        def __init__(self, *a, **k) -> None:
            made.append(k)
            super().__init__(*a, **k)

    monkeypatch.setattr(io.pq, "ParquetFile", Spy)
    rows = sum(len(p) for p in iter_trace(ragged_file, 700))
    assert rows == len(read_trace(ragged_file))
    assert made
    assert all(k.get("pre_buffer") is False for k in made)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("policy", ["lru", "least-stale"])
def test_the_real_mixtral_logs_in_pieces_equal_their_whole_replay(tmp_path: Path, batch: int, policy: str) -> None:
    gsm, hev = mixtral_trace("gsm8k"), mixtral_trace("humaneval")
    hev.request = hev.request + 2  # four problems: gsm8k's two, then humaneval's two
    tr = Trace(model=gsm.model, **{c: np.concatenate([getattr(gsm, c), getattr(hev, c)])
                                   for c in ("request", "step", "position", "phase", "layer", "experts", "weights")})
    path = write_trace(tr, tmp_path / "mixtral.parquet")
    sc = load_scenario("quickstart", [f"workload.trace.path={path}", f"policies.eviction={policy}",
                                      f"workload.batch_size={batch}", "cache.capacity=25%",
                                      "policies.prefetch=previous-token"])
    whole = Simulation(sc, trace=tr).run()
    res = Simulation(sc, chunk_rows=2000).run()  # every problem has more rows: a batch per piece
    _same(whole, res)
    assert res.summary["trace_pieces"] == 4 // batch


def test_static_pinning_in_pieces_pins_the_experts_counted_over_the_whole_trace(ragged_file: Path) -> None:
    """Static pinning a piece at a time counts the trace's passes and the experts of the first
    ``calibration`` share of them over the whole file, not the first piece: the experts pinned
    are those a count over the whole trace's workload (worked out here with numpy, apart from
    the policy) puts first, and with them the cache's preloaded experts."""

    sets = [f"workload.trace.path={ragged_file}", "policies.prefetch.name=static-pin",
            "policies.prefetch.calibration=0.5", "policies.prefetch.fraction=1.0", "cache.capacity=5%"]
    sc = load_scenario("quickstart", sets)
    sim = Simulation(sc, chunk_rows=300)
    assert sim.source.pieces is not None, sim.source.whole_reason
    first = sim.wl
    whole = build_workload(read_trace(ragged_file), 1)
    assert first.num_passes < whole.num_passes // 2  # the share ends beyond the first piece
    n_cal = -(-whole.num_passes // 2)
    counts = np.bincount(whole.keys()[:whole.off[n_cal * 16]], minlength=16 * 64)
    slots = int(sim.capacity / sim.expert_bytes)
    assert 0 < slots < np.count_nonzero(counts)
    # the slots most-counted experts, ties to the lower key; a cache key is the expert's key times
    # the model's 4 precisions plus the scenario's (bf16, the first)
    assert (sim.num_prec, sim.default_prec) == (4, 0)
    want = sorted(range(len(counts)), key=lambda k: (-counts[k], k))[:slots]
    assert sorted(sim.prefetch.pinned()) == sorted(4 * k for k in want)
    assert sim.preloaded == slots
    res = sim.run()
    assert res.summary["preloaded_experts"] == slots


@pytest.mark.parametrize("sets", [["policies.prefetch.name=static-pin"], ["policies.eviction=belady"], []])
def test_a_trace_file_that_changes_during_a_replay_in_pieces_is_named(ragged_file: Path, tmp_path: Path,
                                                                      sets: list[str]) -> None:
    """The file's modification time moved after the replay began (static pinning has read it for its
    counts; Belady's first pass and the replay read it later): one paragraph naming the file, not
    results mixing two files' data."""
    import os
    import shutil

    path = Path(shutil.copy(ragged_file, tmp_path / "changing.parquet"))
    sc = load_scenario("quickstart", [f"workload.trace.path={path}", *sets])
    sim = Simulation(sc, chunk_rows=700)
    assert sim.source.pieces is not None, sim.source.whole_reason
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    with pytest.raises(MoesimError, match=rf"trace {path}: the file changed while it was replayed a piece at a "
                                          r"time \(its size or modification time"):
        sim.run()


def test_static_pinning_and_belady_in_pieces_show_both_first_passes(ragged_file: Path) -> None:
    """Static pinning reads the file before the replay (in the constructor), Belady once more
    (in the kernel): the progress covers three times the file's rows, never going back."""
    sc = load_scenario("quickstart", [f"workload.trace.path={ragged_file}", "policies.eviction=belady",
                                      "policies.prefetch.name=static-pin", "policies.prefetch.calibration=0.5"])
    seen: list[tuple[int, int]] = []
    sim = Simulation(sc, chunk_rows=700, progress=lambda d, t: seen.append((d, t)))
    rows = len(read_trace(ragged_file))
    assert seen[-1] == (rows, 3 * rows)  # static pinning's pass, shown once
    sim.run()
    assert {t for _, t in seen} == {3 * rows}
    done = [d for d, _ in seen]
    assert done == sorted(done)
    assert done[-1] == 3 * rows
    assert any(rows < d <= 2 * rows for d in done)  # Belady's pass
    assert 2 * rows in done  # which reads every row of the file


def test_progress_counts_the_file_rows_up_to_all_of_them(ragged_file: Path) -> None:
    seen: list[tuple[int, int]] = []
    sc = load_scenario("quickstart", [f"workload.trace.path={ragged_file}"])
    Simulation(sc, chunk_rows=900, progress=lambda d, t: seen.append((d, t))).run()
    rows = len(read_trace(ragged_file))
    assert {t for _, t in seen} == {rows}
    done = [d for d, _ in seen]
    assert done == sorted(done)
    assert done[-1] == rows


@pytest.mark.parametrize(("sets", "reason"), [
    (["workload.speculative.tree_size=4"], "speculative decoding"),
    (["policies.budget=skip-threshold"], "budget policy 'skip-threshold' calibrates on the trace's leading passes"),
])
def test_replays_that_need_the_whole_trace_read_it_whole(ragged_file: Path, sets: list[str], reason: str) -> None:
    sc = load_scenario("quickstart", [f"workload.trace.path={ragged_file}", *sets])
    sim = Simulation(sc, chunk_rows=500)
    assert sim.source.pieces is None
    assert sim.source.whole_reason == reason


def test_a_synthesised_trace_recorded_decisions_and_a_file_of_one_piece_are_whole(ragged_file: Path) -> None:
    assert Simulation(load_scenario("quickstart", [])).source.whole_reason == "the trace is synthesised or imported in memory"
    sc = load_scenario("quickstart", [f"workload.trace.path={ragged_file}"])
    sim = Simulation(sc, chunk_rows=500, record_decisions=True)
    assert sim.source.pieces is None
    assert sim.source.whole_reason == "the replay records its decisions"
    for record in ("record_transfers", "record_layers"):  # the kernel records a timeline in pieces
        assert Simulation(sc, chunk_rows=500, **{record: True}).source.pieces is not None
    rows = trace_rows(ragged_file)
    sim = Simulation(sc, chunk_rows=rows)  # exactly one piece's rows
    assert sim.source.pieces is None
    assert sim.source.whole_reason == "the trace fits in one piece"
    sim = Simulation(sc, chunk_rows=rows - 1)
    assert sim.source.pieces is not None
    assert sim.source.whole_reason is None


def test_the_command_line_reads_a_long_trace_in_pieces_with_the_same_summary(ragged_file: Path, monkeypatch) -> None:
    import json

    from click.testing import CliRunner

    from moesim.cli import cli

    args = ["run", "quickstart", "--trace", str(ragged_file), "--json", "--no-write", "-q",
            "--set", "policies.eviction=least-stale", "--set", "cache.capacity=10%"]
    whole = json.loads(CliRunner().invoke(cli, args, catch_exceptions=False).output)
    monkeypatch.setenv("MOESIM_PIECE_ROWS", "600")
    pieces = json.loads(CliRunner().invoke(cli, args, catch_exceptions=False).output)
    assert whole.pop("trace_pieces") == 1
    assert pieces.pop("trace_pieces") == len(list(iter_trace(ragged_file, 600)))
    whole.pop("wall_s", None)
    pieces.pop("wall_s", None)
    assert pieces == whole


@pytest.mark.parametrize("raw", ["0", "-5", "many", "2.5"])
def test_a_bad_piece_size_is_one_paragraph_naming_the_variable(ragged_file: Path, monkeypatch, raw: str) -> None:
    from click.testing import CliRunner

    from moesim.cli import cli

    monkeypatch.setenv("MOESIM_PIECE_ROWS", raw)
    res = CliRunner().invoke(cli, ["run", "quickstart", "--trace", str(ragged_file), "--no-write", "-q"])
    assert res.exit_code == 2
    assert f"MOESIM_PIECE_ROWS is {raw!r}: it must be a positive whole number" in unwrap(res.output)
    assert "Traceback" not in unwrap(res.output)


PER_PASS = ("pass_group", "pass_step", "pass_phase", "pass_tokens", "pass_context", "pass_requests",
            "pass_generated", "weight_total", "off", "request_ids", "request_group", "request_first_pass")


@pytest.mark.parametrize(("batch", "chunk"), [(1, 400), (2, 700), (3, 2000)])
def test_the_joined_pieces_number_passes_and_requests_as_the_whole_trace_does(ragged_file: Path, batch: int,
                                                                               chunk: int) -> None:
    whole = build_workload(read_trace(ragged_file), batch)
    parts = [build_workload(p, batch) for p in iter_trace(ragged_file, chunk, batch)]
    assert len(parts) > 1
    got = join(parts)
    for name in PER_PASS:
        a, b = getattr(got, name), getattr(whole, name)
        assert a.dtype == b.dtype, name
        assert np.array_equal(a, b), name
    assert got.model == whole.model
    assert got.batch_size == batch
    assert got.num_passes == whole.num_passes
    assert got.num_accesses == whole.num_accesses  # the last offset: the pieces' accesses are gone
    for name in ("acc_layer", "acc_expert", "acc_rank", "acc_tokens", "acc_weight"):
        a, b = getattr(got, name), getattr(whole, name)
        assert a.shape == (0,), name
        assert a.dtype == b.dtype, name
    assert got.row_order is None
    assert got.row_off is None
    assert got.trace is None


def test_every_reason_to_read_the_whole_trace(ragged_file: Path, monkeypatch) -> None:
    def sc(*sets: str):
        return load_scenario("quickstart", [f"workload.trace.path={ragged_file}", *sets])

    assert why_whole(sc(), False) is None
    assert why_whole(sc(), True) == "the replay records its decisions"
    assert why_whole(sc("hardware.preset=h100-sxm-nvlink-x2"), False) == "expert parallelism"
    assert why_whole(sc("policies.routing=cache-aware"), False) is None
    assert why_whole(sc("policies.routing=cache-aware", "policies.budget=lynx"), False) == (
        "routing policy 'cache-aware' runs on the SimPy path")
    assert why_whole(sc("policies.budget=dynamic-skip"), False) is None  # a (pass, layer)'s choice reads its rows
    assert why_whole(sc("policies.budget=moe-spec"), False) is None
    assert why_whole(sc("policies.budget=moe-spec", "policies.budget.ranking=static"), False) == (
        "budget policy 'moe-spec' calibrates on the trace's leading passes")
    assert why_whole(sc("policies.miss=drop"), False) is None
    wide = write_trace(synth_from_preset("olmoe-1b-7b", layers=1, experts=130, top_k=129, requests=2, prompt_tokens=2,
                                         tokens=2, seed=0), ragged_file.parent / "wide.parquet")
    assert why_whole(load_scenario("quickstart", [f"workload.trace.path={wide}", "policies.miss=drop"]), False) is None
    assert why_whole(load_scenario("quickstart", [f"workload.trace.path={wide}"]), False) is None
    monkeypatch.setenv("MOESIM_NO_KERNEL", "0")
    assert why_whole(sc(), False) is None
    monkeypatch.setenv("MOESIM_NO_KERNEL", "1")
    assert why_whole(sc(), False) == "the replay runs on the SimPy path"


def test_the_piece_size_comes_from_the_environment_or_the_default(monkeypatch) -> None:
    monkeypatch.delenv("MOESIM_PIECE_ROWS", raising=False)
    assert piece_rows() == CHUNK_ROWS == 131_072
    for raw, rows in (("1", 1), (" 5000 ", 5000), ("", CHUNK_ROWS)):
        monkeypatch.setenv("MOESIM_PIECE_ROWS", raw)
        assert piece_rows() == rows


def test_a_file_with_wider_rows_is_read_in_pieces_of_as_many_bytes(ragged_file: Path, tmp_path: Path,
                                                                   monkeypatch) -> None:
    """An OLMoE row in memory: request, step, position (3 x 4 bytes), phase (1), layer (2),
    8 expert ids (8 x 2) and 8 weights (8 x 4): 63 bytes; with ``pred_next`` 64 floats more:
    319. A piece of such rows holds 131,072 x 63 / 319 of them."""
    monkeypatch.delenv("MOESIM_PIECE_ROWS", raising=False)
    tr = read_trace(ragged_file)
    tr.pred_next = None
    plain = write_trace(tr, tmp_path / "plain.parquet")
    assert piece_rows(plain) == 131_072
    assert piece_rows(ragged_file) == 131_072 * 63 // 319 == 25_885
    monkeypatch.setenv("MOESIM_PIECE_ROWS", "700")
    assert piece_rows(ragged_file) == 700
    monkeypatch.delenv("MOESIM_PIECE_ROWS")
    from moesim.simulator import stream

    monkeypatch.setattr(stream, "CHUNK_ROWS", 2000)  # the replay cuts this file's pieces as many bytes each
    assert piece_rows(ragged_file) == 2000 * 63 // 319 == 394
    res = Simulation(load_scenario("quickstart", [f"workload.trace.path={ragged_file}"])).run()
    assert res.summary["trace_pieces"] == len(list(iter_trace(ragged_file, 394))) > len(list(iter_trace(ragged_file, 2000)))


# -- the reader's parts, against independent references --------------------------------------
@settings(max_examples=200, deadline=None)
@given(rows=st.integers(0, 40), k=st.integers(1, 24), hi=st.integers(1, 40), seed=st.integers(0, 2**32 - 1))
def test_a_repeated_expert_is_found_in_every_row_that_has_one(rows: int, k: int, hi: int, seed: int) -> None:
    from moesim.traces.io import _repeats

    experts = np.random.default_rng(seed).integers(0, hi, size=(rows, k)).astype(np.int16)
    expect = np.array([len(set(r.tolist())) < k for r in experts], dtype=bool)
    assert np.array_equal(_repeats(experts), expect)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(req=st.lists(st.integers(0, 5), min_size=1, max_size=30), batch=st.integers(1, 7))
def test_request_order_is_checked_across_and_within_batches(tmp_path: Path, req: list[int], batch: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "req.parquet"
    pq.write_table(pa.table({"request": pa.array(req, pa.int32())}), path, row_group_size=3)
    assert requests_in_order(path, batch) == all(b >= a for a, b in itertools.pairwise(req))


def _rewrite(tr: Trace, path: Path, edit) -> Path:
    import pyarrow.parquet as pq

    from moesim.traces.io import trace_to_table

    pq.write_table(edit(trace_to_table(tr)), path)
    return path


def test_the_phase_column_read_as_names_or_dictionary_codes_with_bad_values_named(tmp_path: Path) -> None:
    import pyarrow as pa

    tr = _ragged()
    names = np.array(["prefill", "decode", "verify"], dtype=object)[tr.phase]
    i = tr.phase.size - 3
    for kind in ("string", "large_string", "dictionary"):
        def edit(tb, kind=kind, bad=COLUMNS):  # COLUMNS: no value changed
            vals = names.copy()
            if bad is not COLUMNS:
                vals[i] = bad
            arr = pa.array(vals.tolist(), pa.large_string() if kind == "large_string" else pa.string())
            if kind == "dictionary":
                arr = arr.dictionary_encode()
            return tb.set_column(tb.column_names.index("phase"), "phase", arr)

        path = _rewrite(tr, tmp_path / f"{kind}.parquet", edit)
        assert np.array_equal(read_trace(path).phase, tr.phase), kind
        assert np.array_equal(np.concatenate([p.phase for p in iter_trace(path, 500)]), tr.phase), kind
        for bad, shown in (("Decode", "'Decode'"), (None, "None")):
            bad_path = _rewrite(tr, tmp_path / f"bad-{kind}.parquet", lambda tb, b=bad, e=edit: e(tb, bad=b))
            msg = (f"trace {bad_path}: column 'phase' has {shown} at row {i}; valid phases are "
                   "prefill, decode, verify.")
            with pytest.raises(MoesimError) as err:
                read_trace(bad_path)
            assert str(err.value) == msg
            with pytest.raises(MoesimError) as err:
                list(iter_trace(bad_path, 500))
            assert str(err.value) == msg


@pytest.mark.parametrize(("edit", "tail"), [
    (lambda tb: tb.drop_columns(["weights"]),
     "lacks required column(s) weights; schema v1 requires request, step, position, phase, layer, experts, weights."),
    (lambda tb: tb.drop_columns(["weights", "layer"]),
     "lacks required column(s) layer, weights; schema v1 requires request, step, position, phase, layer, experts, "
     "weights."),
    (lambda tb: tb.append_column("colour", tb.column("layer")).append_column("size", tb.column("layer")),
     "has unknown column(s) colour, size; valid columns are request, step, position, phase, layer, experts, "
     "weights, node, parent, accepted, probs, pred_next, pred_quasi."),
    (lambda tb: tb.slice(0, 0),
     "has no rows: a trace holds one row per (token, layer) routed. Record it again (moesim capture, moesim "
     "trace import) or check the program that wrote it."),
])
def test_a_file_that_is_not_a_trace_is_named_with_the_fix_by_both_readers(tmp_path: Path, edit, tail: str) -> None:
    path = _rewrite(_ragged(requests=2), tmp_path / "t.parquet", edit)
    for read in (read_trace, lambda p: list(iter_trace(p, 100)), trace_rows):
        with pytest.raises(MoesimError) as err:
            read(path)
        assert str(err.value) == f"trace {path}: {tail}"


def test_a_corrupt_file_is_named_by_every_reader(tmp_path: Path) -> None:
    good = write_trace(_ragged(requests=2), tmp_path / "good.parquet")
    data = good.read_bytes()
    path = tmp_path / "corrupt.parquet"
    path.write_bytes(data[:4] + bytes(len(data) // 2) + data[4 + len(data) // 2:])  # footer kept, pages zeroed
    for read in (read_trace, lambda p: list(iter_trace(p, 100)), requests_in_order):
        with pytest.raises(MoesimError, match=rf"(?s)^trace {path}: could not be read \(.*\)\. The file is corrupt; "
                                              r"regenerate it\.$"):
            read(path)


def test_pieces_keep_the_files_capture_and_name_it(ragged_file: Path) -> None:
    whole = read_trace(ragged_file)
    for p in iter_trace(ragged_file, 500):
        assert p.capture == whole.capture
        assert p.capture["source"] == "moesim trace synth"
        assert p.source == str(ragged_file)


def test_rows_out_of_request_order_in_a_later_batch_are_named(tmp_path: Path) -> None:
    tr = _ragged(requests=4)
    for order in (np.r_[np.flatnonzero(tr.request != 1), np.flatnonzero(tr.request == 1)],  # across batches
                  np.r_[np.flatnonzero(tr.request == 0), np.flatnonzero(tr.request == 2),
                        np.flatnonzero(tr.request == 1), np.flatnonzero(tr.request == 3)]):
        path = write_trace(tr.take(order), tmp_path / "unordered.parquet")
        for chunk in (50, 100_000):
            with pytest.raises(MoesimError) as err:
                list(iter_trace(path, chunk))
            assert str(err.value) == (f"trace {path}: its rows are not in request order (request ids decrease); a "
                                      "chunked read needs them request by request. Sort the file by request.")


def _expected_pieces(rows_of: list[int], chunk: int, multiple: int, max_requests: int | None) -> list[list[int]]:
    """The cut rule worked from its contract: batches of ``chunk`` rows are read; each time at
    least ``chunk`` rows wait, the complete requests among them but the last one started (it
    may go on in the next batch), rounded down to whole batches of ``multiple``, make a piece;
    after the file's last batch what waits is the last piece; ``max_requests`` stops after
    that many requests (the piece that reaches it may end on a short batch)."""
    ends = np.cumsum(rows_of)
    starts = ends - np.asarray(rows_of)
    total, n_req = int(ends[-1]), len(rows_of)
    limit = n_req if max_requests is None else min(max_requests, n_req)
    out: list[list[int]] = []
    taken, read = 0, 0
    while read < total and taken < limit:
        read = min(read + chunk, total)
        if read - int(starts[taken]) < chunk:
            continue
        n = sum(1 for r in range(taken, n_req) if starts[r] < read) - 1
        if taken + n >= limit:
            n = limit - taken
        else:
            n -= n % multiple
        if n > 0:
            out.append(list(range(taken, taken + n)))
            taken += n
    if taken < limit:
        out.append(list(range(taken, limit)))
    return out


RAGGED_ROWS = [16 * (12 + 5 + (r * 7) % 26) for r in range(9)]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chunk=st.integers(1, sum(RAGGED_ROWS) + 2), multiple=st.integers(1, 4),
       max_requests=st.one_of(st.none(), st.integers(1, 10)))
@example(chunk=sum(RAGGED_ROWS) + 1, multiple=1, max_requests=None)  # a file shorter than a batch: one piece
@example(chunk=sum(RAGGED_ROWS) - 1, multiple=2, max_requests=None)
@example(chunk=1000, multiple=2, max_requests=3)  # the limit reached by whole requests, an odd count
@example(chunk=2000, multiple=2, max_requests=3)
@example(chunk=1200, multiple=2, max_requests=3)  # three whole requests reach the limit in one cut
def test_the_pieces_are_cut_where_the_contract_says(ragged_file: Path, chunk: int, multiple: int,
                                                    max_requests: int | None) -> None:
    rows_of = RAGGED_ROWS
    got = [np.unique(p.request).tolist() for p in iter_trace(ragged_file, chunk, multiple, max_requests)]
    assert got == _expected_pieces(rows_of, chunk, multiple, max_requests)


def test_small_row_groups_give_every_row_once(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    from moesim.traces.io import trace_to_table

    tr = _ragged()
    path = tmp_path / "groups.parquet"
    pq.write_table(trace_to_table(tr), path, row_group_size=97)  # batches end at row groups: fewer rows
    got = list(iter_trace(path, 500))
    assert len(got) > 3
    for col in COLUMNS:
        assert np.array_equal(np.concatenate([getattr(p, col) for p in got]), getattr(tr, col)), col


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(req=st.lists(st.integers(0, 4), min_size=1, max_size=12), chunk=st.integers(1, 5))
@example(req=[1, 3, 2], chunk=2)  # the next batch starts below the last row, above the one before
@example(req=[1, 3, 2, 4], chunk=2)
@example(req=[3, 2], chunk=2)  # two rows out of order in one batch
def test_both_readers_find_rows_out_of_request_order(tmp_path: Path, req: list[int], chunk: int) -> None:
    from tests.helpers import small_model

    n = len(req)
    tr = Trace(model=small_model(layers=1, experts=4, top_k=1), request=np.array(req, np.int32),
               step=np.arange(n, dtype=np.int32), position=np.arange(n, dtype=np.int32),
               phase=np.full(n, 1, np.int8), layer=np.zeros(n, np.int16), experts=np.zeros((n, 1), np.int16),
               weights=np.ones((n, 1), np.float32))
    path = write_trace(tr, tmp_path / f"order-{chunk}.parquet")
    ordered = all(b >= a for a, b in itertools.pairwise(req))
    assert requests_in_order(path, chunk) == ordered
    if ordered:
        assert [r for p in iter_trace(path, chunk) for r in p.request.tolist()] == req
    else:
        with pytest.raises(MoesimError, match="not in request order"):
            list(iter_trace(path, chunk))


def test_the_reader_stops_at_the_request_limit_without_reading_on(tmp_path: Path) -> None:
    tr = _ragged(requests=6)
    later = np.flatnonzero(tr.request >= 4)
    order = np.r_[np.flatnonzero(tr.request < 4), later[::-1]]  # rows after request 3 out of order
    path = write_trace(tr.take(order), tmp_path / "tail.parquet")
    got = [np.unique(p.request).tolist() for p in iter_trace(path, 300, 1, 4)]
    assert got == [[0], [1], [2], [3]]


def test_a_null_request_id_is_named_by_its_row(tmp_path: Path) -> None:
    import pyarrow as pa

    tr = _ragged(requests=2)
    vals = tr.request.astype(object)
    vals[-5] = None
    path = _rewrite(tr, tmp_path / "null.parquet",
                    lambda tb: tb.set_column(0, "request", pa.array(vals.tolist(), pa.int32())))
    for read in (read_trace, lambda p: list(iter_trace(p, 300)),
                 lambda p: Simulation(load_scenario("quickstart", [f"workload.trace.path={p}"]), chunk_rows=300).run()):
        with pytest.raises(MoesimError) as err:
            read(path)
        assert str(err.value) == f"trace {path}: column 'request' is null at row {len(tr) - 5}."


def test_phase_codes_are_bytes_and_a_phase_column_of_numbers_is_named(tmp_path: Path, ragged_file: Path) -> None:
    import pyarrow as pa

    assert read_trace(ragged_file).phase.dtype == np.int8
    assert {p.phase.dtype for p in iter_trace(ragged_file, 500)} == {np.dtype(np.int8)}
    tr = _ragged(requests=2)
    path = _rewrite(tr, tmp_path / "numbers.parquet",
                    lambda tb: tb.set_column(tb.column_names.index("phase"), "phase", pa.array(tr.phase)))
    for read in (read_trace, lambda p: list(iter_trace(p, 300))):
        with pytest.raises(MoesimError) as err:
            read(path)
        assert str(err.value) == (f"trace {path}: column 'phase' must hold strings (prefill, decode, verify), "
                                  "found int8.")


def test_a_bad_model_in_the_metadata_is_named_with_the_file(tmp_path: Path) -> None:
    import json

    import pyarrow.parquet as pq

    from moesim.traces.io import trace_to_table

    tb = trace_to_table(_ragged(requests=2))
    meta = json.loads(tb.schema.metadata[b"moesim"])
    del meta["model"]["num_experts"]
    path = tmp_path / "model.parquet"
    pq.write_table(tb.replace_schema_metadata({"moesim": json.dumps(meta)}), path)
    for read in (read_trace, lambda p: list(iter_trace(p, 300)), trace_rows):
        with pytest.raises(MoesimError, match=rf"^trace {path}"):
            read(path)


def test_the_kernel_lets_go_of_a_pieces_arrays_as_the_piece_ends(ragged_file: Path, monkeypatch) -> None:
    """The kernel keeps the type of a piece's large tuple argument (its per-access arrays) across
    the piece's calls, and lets go of it as the piece ends: when the next piece is bound, the
    compiled loops hold no piece's arrays (only two pieces are then in memory: the one read ahead
    and the one bound). Every tuple counts as large here."""
    from moesim import jit

    if not isinstance(kernel.replay_passes, getattr(jit, "_PlainTypes", ())):
        pytest.skip("numba is not compiling here")
    monkeypatch.setattr(jit, "_KEEP_BYTES", 0)
    held: list[bool] = []
    bind = Simulation.bind_piece
    replay = kernel.replay_passes

    def bound(sim: Simulation, wl) -> None:
        held.append(replay._large is not None)
        bind(sim, wl)

    monkeypatch.setattr(Simulation, "bind_piece", bound)
    calls: list[int] = []
    monkeypatch.setattr(kernel, "replay_passes", lambda *a: calls.append(1) or replay(*a))
    monkeypatch.setattr(kernel, "CHUNK", 7)
    sc = load_scenario("quickstart", [f"workload.trace.path={ragged_file}", "cache.capacity=10%"])
    res = Simulation(sc, chunk_rows=500).run()
    assert res.summary["trace_pieces"] >= 5
    assert len(calls) > res.summary["trace_pieces"]  # pieces of several calls each
    assert len(held) >= res.summary["trace_pieces"] - 1
    assert not any(held)
    assert replay._large is None


def test_a_kernel_call_holds_at_most_call_accesses_or_a_single_pass(ragged_file: Path, monkeypatch) -> None:
    """A kernel call replays at most ``CHUNK`` passes and, past its first, at most
    ``CALL_ACCESSES`` accesses, taking as many passes as fit (so that a call stays short
    whatever a pass holds: progress and Ctrl-C come between calls). The trace's prefill passes
    (12 tokens) hold several decode passes' accesses; with a limit of 600 accesses and 4 passes
    some calls stop at 4 passes, some sooner, and a pass over the limit is a call of its own. The
    calls are those of a reference written from that rule, and the replay is the one in calls of
    the defaults."""
    sc = load_scenario("quickstart", [f"workload.trace.path={ragged_file}", "cache.capacity=10%"])
    whole = Simulation(sc, trace=read_trace(ragged_file)).run()
    monkeypatch.setattr(kernel, "CALL_ACCESSES", 600)
    monkeypatch.setattr(kernel, "CHUNK", 4)
    calls: list[tuple[int, int]] = []
    replay = kernel.replay_passes
    monkeypatch.setattr(kernel, "replay_passes", lambda *a: calls.append((a[0], a[1])) or replay(*a))
    sim = Simulation(sc, trace=read_trace(ragged_file))
    num_l = sim.model.num_layers
    per_pass = [int(sim.wl.off[(p + 1) * num_l] - sim.wl.off[p * num_l]) for p in range(sim.wl.num_passes)]
    _same(whole, sim.run())
    expected, q, n = [], 0, len(per_pass)
    while q < n:
        j = q + 1
        while j < n and j - q < 4 and sum(per_pass[q:j + 1]) <= 600:
            j += 1
        expected.append((q, j))
        q = j
    assert calls == expected
    sizes = [(q1 - q0, sum(per_pass[q0:q1])) for q0, q1 in calls]
    assert any(p == 1 and a > 600 for p, a in sizes)  # a pass over the limit alone
    assert any(p == 4 for p, _ in sizes)  # the passes' limit binds
    assert any(1 < p < 4 for p, _ in sizes)  # and the accesses'


def test_the_calls_of_nine_passes_by_hand(monkeypatch) -> None:
    """``kernel._calls`` on nine passes of two layers holding 3, 2, 5, 1, 1, 1, 1, 9 and 2
    accesses, at most 5 accesses and 3 passes a call, worked out by hand: passes 0-1 (3 + 2 = 5,
    at the limit; adding pass 2 makes 10), pass 2 (5; adding pass 3 makes 6), passes 3-5 (3
    passes, the most a call takes, though pass 6 would fit: 4 accesses), pass 6 (adding pass 7
    makes 10), pass 7 alone (9, over the limit), pass 8."""
    monkeypatch.setattr(kernel, "CALL_ACCESSES", 5)
    monkeypatch.setattr(kernel, "CHUNK", 3)
    per_layer = [[1, 2], [2, 0], [0, 5], [1, 0], [0, 1], [1, 0], [0, 1], [4, 5], [1, 1]]
    off = np.concatenate([[0], np.cumsum(np.ravel(per_layer))])
    assert kernel._calls(off, 9, 2) == [0, 2, 3, 6, 7, 8, 9]
    assert kernel._calls(off[:7], 3, 2) == [0, 2, 3]  # a piece's first three passes


def test_the_proposals_ahead_are_asked_call_by_call() -> None:
    """``kernel._proposals_ahead`` asks the prefetcher for each call's passes in turn (the next
    call's while this one's are replayed) and hands them over in order."""
    asked: list[tuple[int, int]] = []

    class Prefetch:
        def proposals(self, lo: int, hi: int) -> tuple[int, int]:
            asked.append((lo, hi))
            return lo, hi

    assert list(kernel._proposals_ahead(Prefetch(), [0, 3, 5, 9])) == [(0, 3), (3, 5), (5, 9)]
    assert asked == [(0, 3), (3, 5), (5, 9)]


def _settled(pulled: list[int], n: int) -> int:
    """How many pieces the reading thread has taken from its source once it has taken ``n``
    (waiting up to 10 s for it) and then stopped for a moment."""
    deadline = time.monotonic() + 10
    while len(pulled) < n and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(0.2)  # had it read further, it would have by now (the reads queued run back to back)
    return len(pulled)


@pytest.mark.parametrize("depth", [1, 3])
def test_the_reader_works_depth_pieces_ahead_in_order_and_stops_with_its_caller(depth: int) -> None:
    """``stream.read_ahead`` hands the pieces over in order, each prepared once on the reading
    thread; it reads ``depth`` pieces ahead of the one the caller holds and no further (at most
    ``depth + 1`` in memory), and a caller that stops early leaves the queued pieces unread."""
    pulled: list[int] = []
    prepared: list[tuple[int, str]] = []

    def source():
        for i in range(10):
            pulled.append(i)
            yield i

    gen = read_ahead(source(), lambda wl: prepared.append((wl, threading.current_thread().name)), depth)
    assert next(gen) == 0
    assert _settled(pulled, 1 + depth) == 1 + depth  # the one held and depth more
    assert next(gen) == 1
    assert _settled(pulled, 2 + depth) == 2 + depth
    assert [p for p, _ in prepared] == list(range(2 + depth))
    assert all(name != threading.current_thread().name for _, name in prepared)
    gen.close()
    # read to the end: every piece once, in order
    pulled.clear()
    assert list(read_ahead(source(), None, depth)) == list(range(10))
    assert pulled == list(range(10))
    # a caller that stops while the reading thread is busy with a piece: that piece is finished,
    # the pieces queued behind it are never read
    gate = threading.Event()

    def slow():
        pulled.append(0)
        yield 0
        gate.wait(10)
        for i in range(1, 10):
            pulled.append(i)
            yield i

    pulled.clear()
    gen = read_ahead(slow(), None, depth)
    assert next(gen) == 0
    threading.Timer(0.1, gate.set).start()
    gen.close()  # waits for the piece being read
    assert _settled(pulled, 2) == min(2, 1 + depth)


@pytest.mark.parametrize("depth", [1, 3])
def test_an_error_reading_a_piece_is_raised_where_that_piece_is_asked_for(depth: int) -> None:
    """The pieces before a bad one are handed over; the error comes with the bad piece, however
    far ahead the reading thread met it."""

    def source():
        yield from range(3)
        raise MoesimError("piece 3 is bad")

    gen = read_ahead(source(), None, depth)
    assert [next(gen) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(MoesimError, match="piece 3 is bad"):
        next(gen)

"""The sweep's reuse path worked by hand on files a test writes itself (no simulation runs):
what a finished point's ``point.json`` records, when a point is whole, which folders are done,
stale or partial, how a point's values read in a line, and which points ``run_points`` hands
on to be run. Expected digests are SHA-256 test vectors (FIPS 180-2) or hashlib's, never the
function under test's."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import ClassVar

import pytest

from moesim.errors import MoesimError
from moesim.studies import sweep as S
from moesim.studies.sweep import (
    Point,
    Runs,
    check_point,
    clean_partial,
    describe_values,
    done_points,
    file_digest,
    folder_lock,
    other_points,
    run_points,
    seal_point,
    stale_points,
)

ABC = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"  # SHA-256("abc")
EMPTY = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"  # SHA-256("")


def point(pid: str, fp: str = "fp", **values) -> Point:
    return Point(pid, values or {"cache.capacity": pid}, fp)


def finished(out: Path, p: Point, files: dict[str, bytes] | None = None) -> Path:
    """A finished point folder as run_point leaves it: its files, then its point.json."""
    d = out / "points" / p.pid
    d.mkdir(parents=True)
    for name, data in (files or {"summary.json": b'{"hits": 3}', "steps.parquet": b"x" * 2000}).items():
        (d / name).write_bytes(data)
    seal_point(d, p)
    return d


def test_file_digest_is_sha256_of_the_bytes_across_read_chunks(tmp_path):
    f = tmp_path / "f"
    f.write_bytes(b"abc")
    assert file_digest(f) == ABC
    f.write_bytes(b"")
    assert file_digest(f) == EMPTY
    data = bytes(range(256)) * (3 * 4096 + 7)  # three 1 MiB reads and a part
    f.write_bytes(data)
    assert file_digest(f) == hashlib.sha256(data).hexdigest()


def test_seal_point_records_each_files_size_and_digest_in_name_order(tmp_path):
    d = tmp_path / "p"
    d.mkdir()
    (d / "steps.parquet").write_bytes(b"")
    (d / "a.json").write_bytes(b"abc")
    (d / "point.json").write_text("stale")
    (d / "sub").mkdir()
    seal_point(d, Point("p1", {"cache.capacity": "5%"}, "f00"))
    text = (d / "point.json").read_text()
    assert json.loads(text) == {
        "id": "p1", "values": {"cache.capacity": "5%"}, "fingerprint": "f00",
        "files": {"a.json": {"bytes": 3, "sha256": ABC}, "steps.parquet": {"bytes": 0, "sha256": EMPTY}}}
    assert list(json.loads(text)["files"]) == ["a.json", "steps.parquet"]
    assert text.startswith('{\n "id": "p1",')  # one space a level: readable, small


def test_a_whole_point_checks_out_and_each_fault_is_named(tmp_path):
    d = finished(tmp_path, point("p"))
    assert check_point(d) is None
    assert check_point(d, verify=True) is None
    (d / "steps.parquet").write_bytes(b"y" + b"x" * 1999)
    assert check_point(d) == "steps.parquet is not what was written (its SHA-256 differs)"
    (d / "steps.parquet").write_bytes(b"x" * 1000)
    assert check_point(d) == "steps.parquet is 1,000 bytes, 2,000 when written"
    (d / "steps.parquet").unlink()
    assert check_point(d) == "steps.parquet is missing"
    (d / "steps.parquet").mkdir()  # a folder where the file was
    assert check_point(d) == "steps.parquet is missing"


def test_the_first_file_in_the_record_that_differs_is_named(tmp_path):
    d = finished(tmp_path, point("p"), {"a": b"1", "b": b"2"})
    (d / "a").write_bytes(b"3")
    (d / "b").write_bytes(b"4")
    assert check_point(d) == "a is not what was written (its SHA-256 differs)"


def test_a_record_without_a_size_reads_as_zero_bytes(tmp_path):
    d = finished(tmp_path, point("p"), {"a": b"1234"})
    rec = json.loads((d / "point.json").read_text())
    del rec["files"]["a"]["bytes"]
    (d / "point.json").write_text(json.dumps(rec))
    assert check_point(d) == "a is 4 bytes, 0 when written"


@pytest.mark.parametrize("text", [None, "{not json", "[1, 2]", '"files"'])
def test_a_missing_or_unreadable_point_json_is_not_trusted(tmp_path, text):
    d = tmp_path / "p"
    d.mkdir()
    if text is not None:
        (d / "point.json").write_text(text)
    assert check_point(d) == "its point.json is missing or unreadable"


@pytest.mark.parametrize("files", [None, {}, [], ["a"], "a"])
def test_a_point_json_recording_no_files_is_not_trusted(tmp_path, files):
    d = tmp_path / "p"
    d.mkdir()
    (d / "a").write_bytes(b"1")
    rec = {"id": "p", "fingerprint": "fp"} | ({} if files is None else {"files": files})
    (d / "point.json").write_text(json.dumps(rec))
    assert check_point(d) == "its point.json records no file sizes and digests (written by an older moesim)"


def test_digests_of_files_up_to_the_limit_always_and_of_larger_ones_when_asked(tmp_path, monkeypatch):
    d = finished(tmp_path, point("p"), {"a": b"12345"})
    (d / "a").write_bytes(b"54321")
    monkeypatch.setattr(S, "DIGEST_ALWAYS", 5)  # the limit itself is digested
    assert check_point(d) == "a is not what was written (its SHA-256 differs)"
    monkeypatch.setattr(S, "DIGEST_ALWAYS", 4)
    assert check_point(d) is None
    assert check_point(d, verify=True) == "a is not what was written (its SHA-256 differs)"
    monkeypatch.undo()
    assert S.DIGEST_ALWAYS == 16 * 1024 * 1024


def test_done_points_are_the_visible_folders_with_a_summary_and_their_fingerprints(tmp_path):
    assert done_points(tmp_path) == {}
    finished(tmp_path, point("a", "fa"))
    finished(tmp_path, point("b", 17))  # type: ignore[arg-type]  # a fingerprint read back as text
    finished(tmp_path, point(".partial", "fp"))
    base = tmp_path / "points"
    (base / "failed").mkdir()
    (base / "failed" / "error.json").write_text("{}")
    (base / "file").write_text("x")
    for pid, text in {"nojson": None, "broken": "{", "list": "[]", "nofp": '{"id": "nofp"}'}.items():
        (base / pid).mkdir()
        (base / pid / "summary.json").write_text("{}")
        if text is not None:
            (base / pid / "point.json").write_text(text)
    assert done_points(tmp_path) == {"a": "fa", "b": "17", "nojson": "", "broken": "", "list": "", "nofp": ""}


def test_stale_and_other_points_are_the_folders_no_listed_point_owns(tmp_path):
    assert stale_points(tmp_path, []) == []
    assert other_points(tmp_path, []) == []
    mine = [point("m1"), point("m2")]
    for p in mine:
        finished(tmp_path, p)
    finished(tmp_path, Point("z-old", {"cache.capacity": "5%", "eviction": {"name": "lfu"}}, "f"))
    base = tmp_path / "points"
    (base / "b-failed").mkdir()
    (base / "b-failed" / "point.json").write_text('{"values": [1]}')
    (base / "c-bare").mkdir()
    (base / ".tmp-x").mkdir()
    (base / "a-file").write_text("x")
    assert stale_points(tmp_path, mine) == ["b-failed", "c-bare", "z-old"]
    assert other_points(tmp_path, mine) == [
        ("b-failed", {}), ("c-bare", {}), ("z-old", {"cache.capacity": "5%", "eviction": {"name": "lfu"}})]
    assert (base / "z-old").is_dir()
    assert [pid for pid, _ in other_points(tmp_path, mine, remove=True)] == ["b-failed", "c-bare", "z-old"]
    assert sorted(p.name for p in base.iterdir()) == [".tmp-x", "a-file", "m1", "m2"]


def test_describe_values_names_a_policy_mapping_by_its_name():
    assert describe_values({}) == "the scenario as it is"
    assert describe_values({"cache.capacity": "5%", "eviction": {"name": "lfu", "decay": 0.5},
                            "prefetch": {"k": 2}, "n": 3}) == (
        "cache.capacity=5%, eviction=lfu, prefetch={'k': 2}, n=3")


def test_runs_add_counts_another_calls_points_too():
    r = Runs()
    assert (r.reused, r.ran, r.recomputed) == (0, 0, {})
    assert Runs().recomputed is not r.recomputed
    r.add(Runs(2, 3, {"a": "why a"}))
    r.add(Runs(1, 0, {"b": "why b"}))
    assert (r.reused, r.ran, r.recomputed) == (3, 3, {"a": "why a", "b": "why b"})


def test_clean_partial_removes_hidden_folders_only(tmp_path):
    assert clean_partial(tmp_path) == []
    base = tmp_path / "points"
    for name in (".a.tmp-1", ".b.tmp-2", "kept"):
        (base / name / "inner").mkdir(parents=True)
    (base / ".hidden-file").write_text("x")
    assert sorted(p.name for p in clean_partial(tmp_path)) == [".a.tmp-1", ".b.tmp-2"]
    assert sorted(p.name for p in base.iterdir()) == [".hidden-file", "kept"]


def test_a_second_lock_on_a_folder_is_refused_and_freed_after(tmp_path):
    out = tmp_path / "new" / "deep"
    with folder_lock(out):
        assert (out / ".lock").is_file()
        with pytest.raises(MoesimError, match="being written by another moesim sweep or compare"), folder_lock(out):
            pass
    with folder_lock(out):
        pass


def test_run_points_hands_on_exactly_the_points_not_whole_with_their_own_fingerprint(tmp_path, monkeypatch):
    """Five points: whole with its fingerprint (reused), another fingerprint, never run, files
    harmed, and large-file harm only --verify finds; a partial folder is cleaned first. The
    executor is replaced to see what it is handed."""
    handed: list[tuple[list[str], int, int]] = []

    def fake_ray(data, todo, out_, workers, address, progress, finished_, total):
        assert (data, out_, workers, address, progress) == ({"k": 1}, out, 3, "ray://h", report)
        handed.append(([p.pid for p in todo], finished_, total))
        return 0

    monkeypatch.setattr(S, "_run_ray", fake_ray)
    out = tmp_path
    pts = [point("ok"), point("old", "new-fp"), point("never"), point("harmed"), point("big")]
    finished(out, pts[0])
    finished(out, point("old", "old-fp"))
    finished(out, pts[3])
    (out / "points" / "harmed" / "steps.parquet").unlink()
    big = finished(out, pts[4])
    (big / "steps.parquet").write_bytes(b"y" * 2000)
    (out / "points" / ".ok.tmp-9").mkdir()
    monkeypatch.setattr(S, "DIGEST_ALWAYS", 100)
    seen = []

    def report(*a):
        seen.append(a)

    runs = run_points({"k": 1}, pts, out, 3, "ray", "ray://h", report)
    assert handed == [(["old", "never", "harmed"], 2, 5)]
    assert (runs.reused, runs.ran) == (2, 3)
    assert runs.recomputed == {"harmed": "cache.capacity=harmed: steps.parquet is missing"}
    assert seen == [(2, 0, 5)]
    assert not (out / "points" / ".ok.tmp-9").exists()
    runs = run_points({"k": 1}, pts, out, 3, "ray", "ray://h", report, verify=True)
    assert handed[-1] == (["old", "never", "harmed", "big"], 1, 5)
    assert (runs.reused, runs.ran) == (1, 4)
    assert runs.recomputed["big"] == "cache.capacity=big: steps.parquet is not what was written (its SHA-256 differs)"


def test_run_points_with_nothing_to_run_forks_nothing_and_an_unknown_executor_is_named(tmp_path, monkeypatch):
    p = point("ok")
    finished(tmp_path, p)
    forked = S._forked
    monkeypatch.setattr(S, "_fork_context", lambda: pytest.fail("no point to run: no process"))
    runs = run_points({}, [p], tmp_path)
    assert (runs.reused, runs.ran, runs.recomputed, S._forked) == (1, 0, {}, forked)
    with pytest.raises(MoesimError, match="unknown executor 'slurm'; valid: local, ray"):
        run_points({}, [p], tmp_path, executor="slurm")


class Pool(S.ProcessPoolExecutor):
    """The local executor's pool, recording how it was made and shut down."""

    made: ClassVar[list[tuple]] = []
    shut: ClassVar[list[tuple]] = []

    def __init__(self, *args, **kw):
        Pool.made.append((args, kw))
        super().__init__(*args, **kw)

    def shutdown(self, wait=True, *, cancel_futures=False):
        Pool.shut.append((wait, cancel_futures))
        super().shutdown(wait, cancel_futures=cancel_futures)


def failing(pid: str) -> Point:
    """A point whose scenario is refused at once (no simulation): it runs and fails fast."""
    return Point(pid, {"eviction": "no-such-policy"}, "fp")


def test_the_local_executor_runs_each_point_in_a_fresh_process_and_counts_as_they_end(tmp_path, monkeypatch):
    """Three points to run (each refused by its scenario, so each ends in an error file) beside
    one reused: one fresh process per point, one at a time by default, progress after each."""
    Pool.made, Pool.shut = [], []
    monkeypatch.setattr(S, "ProcessPoolExecutor", Pool)
    done = point("done")
    finished(tmp_path, done)
    todo = [failing("f1"), failing("f2"), failing("f3")]
    seen = []
    forked = S._forked
    data = S.base_data("quickstart")[1]
    runs = run_points(data, [done, *todo], tmp_path, progress=lambda *a: seen.append(a))
    assert (runs.reused, runs.ran, runs.recomputed) == (1, 3, {})
    assert S._forked == forked + 3
    assert seen == [(1, 0, 4), (2, 1, 4), (3, 2, 4), (4, 3, 4)]
    (args, kw), = Pool.made
    assert args[0] == 1
    assert args[1].get_start_method() == "forkserver"
    assert kw == {"max_tasks_per_child": 1}
    assert Pool.shut == [(True, True)]
    for p in todo:
        err = json.loads((tmp_path / "points" / p.pid / "error.json").read_text())
        assert err["id"] == p.pid
        assert "no-such-policy" in err["error"]
    assert check_point(tmp_path / "points" / "done") is None



def test_a_folder_that_cannot_be_removed_does_not_stop_the_rerun(tmp_path, monkeypatch):
    """Leftovers the file system refuses to remove (another user's files, a busy NFS handle)
    are left where they are: cleaning and pruning go on."""
    real = S.shutil.rmtree

    def refusing(path, ignore_errors=False, **kw):
        if Path(path).name in (".stuck.tmp-1", "stuck-old"):
            if not ignore_errors:
                raise PermissionError(13, "Permission denied", str(path))
            return
        real(path, ignore_errors=ignore_errors, **kw)

    base = tmp_path / "points"
    for name in (".stuck.tmp-1", ".gone.tmp-2"):
        (base / name).mkdir(parents=True)
    finished(tmp_path, point("stuck-old"))
    finished(tmp_path, point("gone-old"))
    monkeypatch.setattr(S.shutil, "rmtree", refusing)
    assert sorted(p.name for p in clean_partial(tmp_path)) == [".gone.tmp-2", ".stuck.tmp-1"]
    assert [pid for pid, _ in other_points(tmp_path, [], remove=True)] == ["gone-old", "stuck-old"]
    assert sorted(p.name for p in base.iterdir()) == [".stuck.tmp-1", "stuck-old"]

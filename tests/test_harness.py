"""The test harness's own scheduling (``tests/conftest.py``): under ``-n 2`` the files in
``TREES`` run in one worker, the others each as a unit of its own (``--dist loadfile``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_files_that_start_process_trees_run_in_one_worker(tmp_path: Path) -> None:
    """Two files named as in ``TREES`` and two others, run by pytest-xdist on two workers with
    the harness's scheduler: both ``TREES`` files' tests run in one worker. Plain ``--dist
    loadfile`` hands the first two files (here the two ``TREES`` files) to different workers,
    and so does a scheduler pytest-xdist no longer calls, or a grouping pytest ignores."""
    pytest.importorskip("xdist")
    from tests.conftest import TREES

    trees, others = sorted(TREES)[:2], ["test_zz_one.py", "test_zz_two.py"]
    body = ("import json, os\n"
            "def test_where(): open(os.environ['WHERE'], 'a').write(json.dumps([__name__, os.environ["
            "'PYTEST_XDIST_WORKER']]) + '\\n')\n")
    for name in trees + others:
        (tmp_path / name).write_text(body)
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_xdist_make_scheduler  # noqa: F401\n")
    where = tmp_path / "where.jsonl"
    env = {**os.environ, "WHERE": str(where), "PYTHONPATH": str(ROOT), "PYTEST_ADDOPTS": ""}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "-p", "no:cacheprovider",
                        "-c", os.devnull, "--rootdir", str(tmp_path), str(tmp_path)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    ran = dict(json.loads(line) for line in where.read_text().splitlines())
    assert sorted(ran) == sorted(Path(n).stem for n in trees + others)
    assert ran[Path(trees[0]).stem] == ran[Path(trees[1]).stem]

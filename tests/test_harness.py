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
    the harness's scheduler and order: both ``TREES`` files' tests run in one worker, in the
    order ``TREES`` lists them (the two chosen so that it is not their names' order). Plain
    ``--dist loadfile`` hands the first two files (here the two ``TREES`` files) to different
    workers, and so does a scheduler pytest-xdist no longer calls, or a grouping pytest ignores."""
    pytest.importorskip("xdist")
    from tests.conftest import TREES

    trees = next([a, b] for i, a in enumerate(TREES) for b in TREES[i + 1:] if a > b)
    others = ["test_zz_one.py", "test_zz_two.py"]
    body = ("import json, os\n"
            "def test_where(): open(os.environ['WHERE'], 'a').write(json.dumps([__name__, os.environ["
            "'PYTEST_XDIST_WORKER']]) + '\\n')\n")
    for name in trees + others:
        (tmp_path / name).write_text(body)
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_collection_modifyitems  # noqa: F401\n"
                                          "from tests.conftest import pytest_xdist_make_scheduler  # noqa: F401\n")
    where = tmp_path / "where.jsonl"
    env = {**os.environ, "WHERE": str(where), "PYTHONPATH": str(ROOT), "PYTEST_ADDOPTS": ""}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "-p", "no:cacheprovider",
                        "-c", os.devnull, "--rootdir", str(tmp_path), str(tmp_path)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [json.loads(line) for line in where.read_text().splitlines()]
    ran = dict(lines)
    assert sorted(ran) == sorted(Path(n).stem for n in trees + others)
    assert ran[Path(trees[0]).stem] == ran[Path(trees[1]).stem]
    names = [name for name, _ in lines]
    assert names.index(Path(trees[0]).stem) < names.index(Path(trees[1]).stem)

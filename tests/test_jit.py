"""moesim's compiled loops and numba's on-disk cache (``moesim.jit``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from moesim.jit import HAVE_NUMBA, package_digest, package_root

CALLER = """
from moesim.jit import {name}
from pkg.callee import SCALE, twice

@{decorator}
def caller(x):
    return twice(x) + SCALE
"""
CALLEE = """
from moesim.jit import njit

SCALE = {scale}

@njit(cache=True)
def twice(x):
    return x * {factor}
"""


def _run(tmp: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(tmp), "NUMBA_CACHE_DIR": str(tmp / "cache")}
    env.pop("NUMBA_DISABLE_JIT", None)
    out = subprocess.run([sys.executable, "-c", "import pkg.caller as c; print(c.caller(3))"],
                         env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


@pytest.mark.skipif(not HAVE_NUMBA, reason="numba is not installed")
@pytest.mark.parametrize("decorator", ["njit(cache=True)", "jit"])
def test_a_cached_function_is_compiled_again_when_a_file_it_compiled_in_changed(tmp_path, decorator):
    """numba's cache watches a function's own file only: a caller cached with the old code of a
    callee in another file (a compiled function and a constant), whose own file did not change,
    would keep returning 3 * 2 + 1 = 7 after the callee's file changed to * 3 and 10 (numba's own
    ``njit(cache=True)`` does: checked by hand on numba 0.68.1 with the digest taken out).
    moesim's decorators key the cache on the whole package's sources as well: the second
    process, with the callee's file changed, compiles the caller again and gets 3 * 3 + 10 = 19;
    a third, with nothing changed, loads it from disk."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "caller.py").write_text(textwrap.dedent(CALLER.format(name=decorator.split("(")[0], decorator=decorator)))
    (pkg / "callee.py").write_text(textwrap.dedent(CALLEE.format(scale=1, factor=2)))
    assert _run(tmp_path) == "7"
    stamp = (pkg / "caller.py").stat().st_mtime_ns
    (pkg / "callee.py").write_text(textwrap.dedent(CALLEE.format(scale=10, factor=3)))
    assert (pkg / "caller.py").stat().st_mtime_ns == stamp
    assert _run(tmp_path) == "19"

    def cached() -> dict[str, int]:
        return {p.name: p.stat().st_mtime_ns for p in (tmp_path / "cache").rglob("caller*.nbc")}

    kept = cached()
    assert kept  # the caller's compiled code is on disk
    assert _run(tmp_path) == "19"
    assert cached() == kept  # loaded, not compiled and written again


def test_the_package_digest_covers_every_source_file_of_the_top_level_package(tmp_path):
    """The digest is of the outermost package's ``.py`` files, names and contents: a file in a
    subpackage changes it, a file beside the package, not ending in ``.py`` or under
    ``__pycache__`` does not."""
    import moesim.jit as J

    sub = tmp_path / "top" / "sub"
    sub.mkdir(parents=True)
    for folder in (tmp_path / "top", sub):
        (folder / "__init__.py").write_text("")
    (sub / "mod.py").write_text("A = 1\n")
    assert package_root(sub / "mod.py") == (tmp_path / "top").resolve()
    assert package_root(tmp_path / "script.py") == tmp_path.resolve()

    def digest() -> str:
        J._DIGESTS.clear()  # taken once per process
        return package_digest(sub / "mod.py")

    first = digest()
    (tmp_path / "beside.py").write_text("B = 2\n")
    (tmp_path / "top" / "notes.txt").write_text("not source\n")
    (sub / "__pycache__").mkdir()
    (sub / "__pycache__" / "cached.py").write_text("C = 3\n")
    assert digest() == first
    (sub / "mod.py").write_text("A = 2\n")
    assert digest() != first
    (sub / "mod.py").write_text("A = 1\n")
    assert digest() == first
    (sub / "mod.py").rename(sub / "other.py")
    assert digest() != first


def test_the_tree_digest_is_of_the_names_and_bytes_in_name_order(tmp_path):
    """``files.tree_digest`` against the digest written out from its contract: SHA-256 over each
    wanted file's relative name and bytes (each followed by a zero byte), in name order part by
    part ("a/y.py" before "a-b/c.py"), whatever order the files were made or listed in."""
    import hashlib

    from moesim.files import tree_digest

    made = {"b.py": "B", "a/z.py": "Z", "a-b/c.py": "C", "a/y.py": "Y", "a/notes.txt": "N"}
    for name, text in made.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    want = hashlib.sha256()
    for name in ("a/y.py", "a/z.py", "a-b/c.py", "b.py"):
        want.update(name.encode() + b"\0" + made[name].encode() + b"\0")
    assert tree_digest(tmp_path, (".py",)) == want.hexdigest()


@pytest.mark.skipif(not HAVE_NUMBA, reason="numba is not installed")
def test_a_kernel_function_has_no_wrapper_for_python_and_its_entry_twin_has():
    """``kernel`` functions are called from compiled code only (numba makes them no wrapper to
    be called from Python, which cost a third of the kernel's compile); ``entry`` makes one twin
    that Python can call, kept, computing the same; a ``jit`` function Python calls directly."""
    import numpy as np

    from moesim.jit import entry, jit, kernel

    def body(a, n):
        s = 0
        for i in range(n):
            s += a[i] * (i + 1)
        return s

    inner = kernel(body)
    outer = jit(lambda a, n: inner(a, n) + 1)
    a = np.arange(5, dtype=np.int64)
    assert outer(a, 5) == 0 * 1 + 1 * 2 + 2 * 3 + 3 * 4 + 4 * 5 + 1 == 41
    twin = entry(inner)
    assert twin is entry(inner)
    assert twin(a, 5) == 40
    assert entry(len) is len  # not compiled: itself

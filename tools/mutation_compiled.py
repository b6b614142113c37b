"""Operator mutation of numba-compiled functions, which mutmut leaves alone (it does not
mutate decorated functions). Not part of the test run.

Usage: ``python tools/mutation_compiled.py MODULE FIRST_FUNCTION END_MARKER TEST [TEST ...]``,
e.g. ``python tools/mutation_compiled.py moesim/policies/prefetch.py "def _percentile_proposals("
"@dataclass(frozen=True)" tests/test_proposals.py``. The source between the first function and
the end marker is mutated one operator or constant at a time (comparisons, arithmetic,
``and``/``or``, ``not``, augmented assignments, 0/1/2, ``break``/``continue``; docstrings and
comments are left alone) in a copy of the tree under a temporary directory; the tests run
there with ``NUMBA_DISABLE_JIT=1`` (a minute each at most: a mutant that hangs is killed).
Prints every survivor with its line; judge each one (a missing test or an equivalent mutant)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SWAPS = [(r"(?<![<>=!])<(?![<=])", "<="), (r"(?<![<>=!])>(?![>=])", ">="), (r"<=", "<"), (r">=", ">"),
         (r"==", "!="), (r"!=", "=="), (r"(?<![+\-*/=<>!])\+(?![=])", "-"), (r"(?<=\s)-(?=\s)", "+"),
         (r"\*(?!\*)", "/"), (r"(?<=\s)/(?=\s)", "*"), (r"\band\b", "or"), (r"\bor\b", "and"),
         (r"\bnot ", ""), (r"\+=", "-="), (r"-=", "+="), (r"\b0\b", "1"), (r"\b1\b", "0"), (r"\b1\b", "2"),
         (r"\bcontinue\b", "break"), (r"\bbreak\b", "continue")]


def mutants(body: str) -> list[tuple[int, int, str, str]]:
    """(start, end, replacement, line) of every mutation outside docstrings and comments."""
    docs = [(m.start(), m.end()) for m in re.finditer(r'"""[\s\S]*?"""', body)]
    out = []
    for pat, rep in SWAPS:
        for m in re.finditer(pat, body):
            line_start = body.rfind("\n", 0, m.start()) + 1
            line = body[line_start:body.find("\n", m.start())]
            if any(s <= m.start() < e for s, e in docs) or "#" in body[line_start:m.start()] \
                    or line.lstrip().startswith("def "):
                continue
            out.append((m.start(), m.end(), rep, line.strip()))
    return out


def main() -> None:
    module, first, end, *tests = sys.argv[1:]
    with tempfile.TemporaryDirectory(prefix="moesim-mutation-") as tmp:
        work = Path(tmp)
        for name in ("moesim", "tests"):
            shutil.copytree(ROOT / name, work / name, ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(ROOT / "pyproject.toml", work)
        src = work / module
        orig = src.read_text()
        a = orig.index(first)
        b = orig.index(end, a)
        body = orig[a:b]
        found = mutants(body)
        print(f"{len(found)} mutants", flush=True)
        env = {**os.environ, "NUMBA_DISABLE_JIT": "1", "PYTHONPATH": str(work)}
        alive = 0
        for s, e, rep, line in found:
            src.write_text(orig[:a] + body[:s] + rep + body[e:] + orig[b:])
            try:
                r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                                   cwd=work, env=env, capture_output=True, timeout=60)
                killed = r.returncode != 0
            except subprocess.TimeoutExpired:
                killed = True
            if not killed:
                alive += 1
                lineno = orig.count("\n", 0, a + s) + 1
                print(f"survived: line {lineno}: {line!r}: {body[s:e]!r} -> {rep!r}", flush=True)
        print(f"killed {len(found) - alive} of {len(found)}")


if __name__ == "__main__":
    main()

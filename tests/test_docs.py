"""The documentation stays true: every ``bash`` and ``python`` example in the README and the
docs site runs (each page's in order, in a fresh folder), an example's printed output shown
under ``<!-- output -->`` is what it prints today, the site builds with ``mkdocs build
--strict``, and the README stays a landing page.

Conventions for a page: a fenced block whose language is ``bash`` or ``python`` is run; one
preceded by ``<!-- not tested: REASON -->`` is not (installs, a GPU, ../shared); one preceded
by ``<!-- file: NAME -->`` is written to the file NAME for the blocks after it; a ``text``
block preceded by ``<!-- output -->`` is the standard output of the block run before it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RUN = ("bash", "python")


@dataclass
class Block:
    lang: str
    text: str
    line: int
    skip: str | None  # why it is not run
    output: bool  # the expected output of the block run before it
    file: str | None = None  # written to this file, not run


def blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown page, with the markers before them."""
    out: list[Block] = []
    lines = path.read_text().splitlines()
    i, marker = 0, ""
    while i < len(lines):
        line = lines[i]
        fence = re.match(r"^(```+)\s*([\w-]*)", line)
        if fence:
            start, body = i + 1, []
            i += 1
            while i < len(lines) and not lines[i].startswith(fence.group(1)):
                body.append(lines[i])
                i += 1
            skip = re.match(r"<!-- not tested: (.+) -->", marker)
            file = re.match(r"<!-- file: (\S+) -->", marker)
            out.append(Block(fence.group(2), "\n".join(body) + "\n", start, skip.group(1) if skip else None,
                             marker == "<!-- output -->", file.group(1) if file else None))
            marker = ""
        elif line.strip():
            marker = line.strip()
        i += 1
    return out


def runnable(path: Path) -> bool:
    return any(b.lang in RUN and b.skip is None and b.file is None for b in blocks(path))


def test_the_conventions_are_read(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("text\n\n<!-- not tested: installs -->\n```console\npip install x\n```\n\n```bash\necho hi\n```\n\n"
                    "<!-- output -->\n```text\nhi\n```\n\n```python\nprint(1)\n```\n\n<!-- file: a.py -->\n"
                    "```python\nX = 1\n```\n")
    got = [(b.lang, b.text, b.skip, b.output, b.file) for b in blocks(page)]
    assert got == [("console", "pip install x\n", "installs", False, None), ("bash", "echo hi\n", None, False, None),
                   ("text", "hi\n", None, True, None), ("python", "print(1)\n", None, False, None),
                   ("python", "X = 1\n", None, False, "a.py")]


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if runnable(p)], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_example_runs(page: Path, tmp_path: Path) -> None:
    """Each page's examples, in order, in one fresh folder (later blocks use earlier ones'
    files), with moesim's own Python first on PATH; every block exits 0, and a shown output is
    what the block before it printed."""
    bindir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bindir + os.pathsep + os.environ.get("PATH", ""), "MOESIM_REPO": str(ROOT),
           "COLUMNS": "80"}
    env.pop("NUMBA_DISABLE_JIT", None)
    last = None
    for b in blocks(page):
        if b.output:
            assert last is not None, f"{page.name}:{b.line}: an output block with no example before it"
            shown = [ln.rstrip() for ln in b.text.strip("\n").splitlines()]
            printed = [ln.rstrip() for ln in last.stdout.strip("\n").splitlines()]
            assert printed == shown, f"{page.name}:{b.line}: the example above prints\n" + "\n".join(printed)
            continue
        if b.file is not None:
            (tmp_path / b.file).write_text(b.text)
            continue
        if b.lang not in RUN or b.skip is not None:
            continue
        cmd = ["bash", "-euo", "pipefail", "-c", b.text] if b.lang == "bash" else [sys.executable, "-c", b.text]
        last = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert last.returncode == 0, (f"{page.name}:{b.line}: exit {last.returncode}\n{b.text}\n"
                                      f"stdout:\n{last.stdout[-3000:]}\nstderr:\n{last.stderr[-3000:]}")


@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    """``mkdocs build --strict``: every page in the navigation, every link and anchor found,
    the generated references, the CLI pages and the API from the docstrings."""
    pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-5000:]
    keys = (tmp_path / "site" / "reference" / "scenario-keys" / "index.html").read_text()
    assert "skip_zero_output" in keys
    cli = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    assert "tiny-model" in cli


def test_the_readme_is_a_landing_page() -> None:
    """At most 300 lines; no commit hashes or issue numbers (history lives in git); links into
    the docs site that exist."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    assert not re.search(r"\b[0-9a-f]{7,40}\b", text), re.search(r"\b[0-9a-f]{7,40}\b", text)
    assert not re.search(r"\bissue \d+", text, re.I)
    for link in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / link).exists(), link


def test_the_docs_hold_guides_not_history() -> None:
    """No page narrates the project's history: no commit hashes, no issue numbers (a results
    file's provenance, rendered on its own line, names the commit it was made at)."""
    for page in (ROOT / "docs").rglob("*.md"):
        text = "\n".join(line for line in page.read_text().splitlines() if not line.startswith("_Made on "))
        assert not re.search(r"\bissue \d+", text, re.I), page
        hashes = re.findall(r"(?<![\w./-])[0-9a-f]{7,12}(?![\w-])", text)
        assert not [h for h in hashes if re.search(r"[a-f]", h) and re.search(r"\d", h)], (page, hashes)


def test_the_readme_shows_what_moesim_compare_prints() -> None:
    """The README's ranking is the getting-started page's, which the examples test checks
    against what ``moesim compare`` prints today."""
    readme = next(b for b in blocks(ROOT / "README.md") if b.lang == "text")
    shown = next(b for b in blocks(ROOT / "docs" / "getting-started.md") if b.output)
    assert readme.text == shown.text


def test_the_suite_s_processes_are_named_by_their_role() -> None:
    """The performance page names each process at the suite's peak from its command line."""
    from tests.helpers import load_tool

    role = load_tool("docs_pages")._role
    assert role("/r/.venv/bin/python -u -c import sys;exec(eval(sys.stdin.readline()))") == "a pytest-xdist worker"
    assert role("[pytest-xdist running] tests/test_sweep.py::test_a[x y]") == "a pytest-xdist worker in `tests/test_sweep.py`"
    assert role("[pytest-xdist idle]") == "a pytest-xdist worker"
    from moesim.jitplan import _BOOT

    assert role(f"/tmp/ci/main/.venv/bin/python -c {_BOOT} /r 123"[:100]) == "the jit helper (`moesim.jitplan`)"
    assert role("/r/.venv/bin/python -B -c from multiprocessing.forkserver import main; main(3, 5)") == (
        "a fork server or a point forked from it")
    assert role("ray::run_point") == "a Ray worker running a point"
    assert role("/r/.venv/bin/python -m mkdocs build --strict --site-dir /t/site") == "`mkdocs build`"
    assert role("/r/.venv/bin/python /r/.venv/bin/moesim sweep quickstart --grid a=1") == "`moesim sweep`"
    assert role("/r/.venv/bin/python -m pytest -m  -n 2") == "pytest's controller"
    assert role("/usr/bin/bash -c true") == "another process"


def test_the_specmd_tables_are_today_s_replays() -> None:
    """The papers page's SpecMD tables come from ``benchmarks/results/specmd_tables.json``; its
    figures are what the shipped scenarios give today, bit for bit (``docs_pages.py --specmd``
    makes it again), and the ranks and savings the page shows are worked out from them here."""
    from tests.helpers import load_tool

    pages = load_tool("docs_pages")
    saved = json.loads((ROOT / "benchmarks" / "results" / "specmd_tables.json").read_text())
    assert saved["runs"] == pages.specmd_runs()
    text = pages.specmd_tables()
    ttft = {n: 1e3 * saved["runs"][str(n)]["ttft_s"] for n in range(1, 6)}
    fastest = min(ttft, key=ttft.__getitem__)
    row = next(line for line in text.splitlines() if line.startswith(f"| #{fastest} "))
    assert row.split(" | ")[5].endswith("/ 1")  # moesim's TTFT rank of its fastest configuration
    one = saved["runs"]["1"]["ttft_s"], saved["runs"]["1-ls"]["ttft_s"]
    assert f"{1e3 * one[0]:.1f} → {1e3 * one[1]:.1f} | {1 - one[1] / one[0]:.1%}" in text


def test_the_specmd_collision_table_is_today_s_replays() -> None:
    """The collision-miss table's counts are what the cache-only prefill replays give today
    (the FLAME-MoE rows need ../shared/traces/real), and a ratio and a rate the page shows are
    worked out from them here."""
    from tests.helpers import REAL, load_tool

    pages = load_tool("docs_pages")
    saved = json.loads((ROOT / "benchmarks" / "results" / "specmd_tables.json").read_text())["collisions"]
    traces = ("olmoe", "flame") if REAL.is_dir() else ("olmoe",)
    today = pages.specmd_collision_runs(traces)
    assert today == {k: v for k, v in saved.items() if k.split("|")[0] in traces}
    lru, ls = (saved[f"olmoe|per-expert|pipelined|1%|{ev}"] for ev in ("lru", "least-stale"))
    assert ls["collisions"] > 0
    text = pages.specmd_collisions()
    row = next(line for line in text.splitlines() if line.startswith("| OLMoE synthetic prefill, per-expert")
               and "| 1% of the model |" in line)
    assert row.split(" | ")[2].startswith(f"{lru['collisions'] / ls['collisions']:.1f}x")
    assert row.split(" | ")[3].startswith(f"{ls['collisions'] / ls['accesses']:.2%}")


def test_the_rendered_parts_are_what_the_results_files_give() -> None:
    """The README's headline table, the performance and validation pages and the mutation table
    are rendered from the committed results files (``tools/docs_pages.py``), never typed."""
    from tests.helpers import load_tool

    pages = load_tool("docs_pages")
    assert pages.main(["--check"]) == 0, "run python tools/docs_pages.py"
    body = "| a |\n"
    text = "x\n<!-- rendered: t -->\nold\n<!-- end rendered -->\ny\n"
    assert pages.rendered(text, "t", body) == "x\n<!-- rendered: t -->\n| a |\n<!-- end rendered -->\ny\n"
    with pytest.raises(SystemExit):
        pages.rendered("no markers", "t", body)

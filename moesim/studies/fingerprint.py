"""What determines a result, as one digest: reuse of a finished sweep or compare point is
keyed on it (``docs/design.md``: "Reuse of an earlier result is keyed on everything that
determined it").

:func:`scenario_fingerprint` hashes

- the fully resolved scenario (``Scenario.to_dict()``: the base file, every override and
  every default) and the hardware as built (``repr``: a calibration profile's tables and
  link fit, which ``to_dict`` names by file only);
- the content of every input file the scenario reads — the trace (a Parquet file, or the
  files of an imported log), a fitted synthetic profile, a serving trace's arrivals, an expert
  placement — never its path: a file replaced
  at the same path changes the digest, a copy at another path does not;
- the source of every plugin loaded in this process;
- moesim's version and the content of its own package files (an edited source tree is
  another simulator, whatever its version number says).
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from moesim.config.scenario import Scenario
from moesim.files import tree_digest

_CHUNK = 1 << 20


def _hash_file(h: Any, path: Path) -> None:
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)


@functools.lru_cache(maxsize=256)
def _content_digest(path: str, stamp: tuple[int, int]) -> str:
    """SHA-256 of a file's bytes, or of a folder's files (relative names and bytes, in name
    order); ``stamp`` (size, mtime) only keys the cache."""
    h = hashlib.sha256()
    p = Path(path)
    if p.is_dir():
        for f in sorted(q for q in p.rglob("*") if q.is_file()):
            h.update(str(f.relative_to(p)).encode())
            _hash_file(h, f)
    else:
        _hash_file(h, p)
    return h.hexdigest()


def content_digest(path: str | Path) -> str:
    """The digest of a file's or folder's content (see :func:`_content_digest`)."""
    p = Path(path).resolve()
    st = p.stat()
    newest = max((f.stat().st_mtime_ns for f in p.rglob("*") if f.is_file()), default=st.st_mtime_ns) \
        if p.is_dir() else st.st_mtime_ns
    return _content_digest(str(p), (st.st_size, newest))


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """moesim's version and the content of its package files (``*.py``, ``*.yaml``)."""
    import moesim

    root = Path(moesim.__file__).resolve().parent
    h = hashlib.sha256(str(getattr(moesim, "__version__", "")).encode())
    h.update(tree_digest(root, (".py", ".yaml")).encode())
    return h.hexdigest()


def input_files(scenario: Scenario) -> list[Path]:
    """The files a scenario reads besides its own YAML: its trace (or the log it imports),
    a fitted synthetic profile and a serving trace's arrival file; a missing trace raises the
    loader's error naming the key (a missing arrival file, the run's own)."""
    from moesim.simulator.build import _trace_file

    src = scenario.workload.trace
    out: list[Path] = []
    if src.import_ is not None:
        out.append(_trace_file(scenario, "workload.trace.import.path", src.import_.path))
    elif src.path is not None:
        out.append(_trace_file(scenario, "workload.trace.path", src.path))
    elif src.synth is not None and src.synth.fit is not None:
        fp = Path(src.synth.fit)
        if not fp.is_absolute() and (Path(scenario.base_dir) / fp).is_file():
            fp = Path(scenario.base_dir) / fp
        if fp.is_file():  # else a shipped profile's name, part of the code
            out.append(fp)
    arr = scenario.workload.arrivals
    if arr is not None and arr.path is not None:  # a serving trace's arrivals (read when it runs)
        ap = Path(arr.path) if Path(arr.path).is_absolute() else Path(scenario.base_dir) / arr.path
        if ap.is_file():
            out.append(ap)
    # an expert placement file (expert parallelism, and XShare's per-GPU budget), read as given
    budget = getattr(scenario.policies.budget, "params", None)
    for spec in (scenario.hardware.placement, getattr(budget, "placement", None)):
        if isinstance(spec, str) and spec not in ("contiguous", "round-robin") and Path(spec).is_file():
            out.append(Path(spec))
    return out


def plugin_sources(specs: list[str]) -> list[str]:
    """Digests of the loaded plugins' sources (a file, or an importable module's file)."""
    out = []
    for spec in specs:
        p = Path(spec)
        if not p.is_file():
            mod = sys.modules.get(spec)
            file = getattr(mod, "__file__", None)
            p = Path(file) if file else p
        out.append(content_digest(p) if p.is_file() else f"unreadable:{spec}")
    return out


def scenario_fingerprint(scenario: Scenario, plugins: list[str] | None = None) -> str:
    """The digest of everything that determines ``scenario``'s results (module docstring)."""
    h = hashlib.sha256()
    h.update(json.dumps(scenario.to_dict(), sort_keys=True, default=str).encode())
    h.update(repr(scenario.hardware).encode())
    for f in input_files(scenario):
        h.update(content_digest(f).encode())
    for d in plugin_sources(plugins or []):
        h.update(d.encode())
    h.update(code_digest().encode())
    return h.hexdigest()[:32]

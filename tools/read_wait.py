"""Which thread bounds a replay of a trace file read in pieces (issue 34; not part of the test run).

Runs ``moesim`` with its arguments (e.g. ``run quickstart --trace FILE --json --no-write -q``)
after wrapping :func:`moesim.simulator.stream.read_ahead`, and prints to stderr, as the process
ends: ``read`` (seconds the reading thread spent reading and building pieces), ``prep`` (making
each piece's prefetch proposals there), ``wait`` (seconds the replay's thread waited for a
piece), ``first`` (the part of ``wait`` spent on the first piece, before the replay starts:
its reading, and the first load of the reading side's compiled functions), ``pieces``, and
``total`` (the process from this script's start). A ``wait`` near ``first`` says the kernel's
thread is the slower one; a larger one, the reading thread.

Usage: ``python tools/read_wait.py run quickstart --trace FILE --set KEY=VALUE ... --json
--no-write -q``."""

from __future__ import annotations

import atexit
import sys
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any

import moesim.simulator.stream as stream

TIMES = {"read": 0.0, "prep": 0.0, "wait": 0.0, "first": 0.0, "pieces": 0}
START = time.perf_counter()
_read_ahead = stream.read_ahead


def _each_timed(items: Iterator[Any], key: str) -> Iterator[Any]:
    """``items``, the seconds spent waiting for each added to ``TIMES[key]``."""
    while True:
        t0 = time.perf_counter()
        item = next(items, None)
        TIMES[key] += time.perf_counter() - t0
        if item is None:
            return
        yield item


def _timed(pieces: Iterator[Any], prepare: Callable[[Any], None] | None = None) -> Generator[Any, float, None]:
    """``read_ahead`` itself, with its source, its ``prepare`` and its consumer's waits timed."""

    def prep(wl: Any) -> None:
        t0 = time.perf_counter()
        assert prepare is not None
        prepare(wl)
        TIMES["prep"] += time.perf_counter() - t0

    for wl in _each_timed(_read_ahead(_each_timed(pieces, "read"), prep if prepare is not None else None), "wait"):
        if not TIMES["pieces"]:
            TIMES["first"] = TIMES["wait"]
        TIMES["pieces"] += 1
        yield wl


def _report() -> None:
    shown = {k: round(v, 2) for k, v in TIMES.items()}
    print(f"{shown} total {time.perf_counter() - START:.2f}", file=sys.stderr)


if __name__ == "__main__":
    stream.read_ahead = _timed
    atexit.register(_report)
    from moesim.cli import main

    sys.argv = ["moesim", *sys.argv[1:]]
    main()

"""What moesim says on stderr: notes wrapped to 80 columns, and progress that shows in a
terminal and in a log alike."""

from __future__ import annotations

import os
import sys
import textwrap
import threading
import time
from collections.abc import Callable

WIDTH = 80


def wrapped(text: str) -> str:
    """``text`` wrapped to :data:`WIDTH` columns, each of its lines on its own, continuation
    lines indented two spaces (a word longer than a line, such as a long path, stays whole)."""
    return "\n".join(textwrap.fill(line, WIDTH, subsequent_indent="  ", break_on_hyphens=False,
                                   break_long_words=False) if line.strip() else line for line in text.split("\n"))


def say(text: str) -> None:
    """A note on stderr, wrapped (looked up at each call, so that a caller's redirection of
    ``sys.stderr`` holds)."""
    print(wrapped(text), file=sys.stderr, flush=True)


def every() -> float:
    """Seconds between progress lines: ``MOESIM_PROGRESS_EVERY`` (default 10)."""
    try:
        return max(0.05, float(os.environ.get("MOESIM_PROGRESS_EVERY", "10")))
    except ValueError:
        return 10.0


class Ticker:
    """While a long step runs, ``tell(seconds so far)`` every :func:`every` seconds from a
    daemon thread; :meth:`stop` ends it and returns the seconds the step took."""

    def __init__(self, tell: Callable[[float], None]) -> None:
        self.start = time.monotonic()
        self._done = threading.Event()
        self._tell = tell
        self._thread = threading.Thread(target=self._run, name="moesim-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(every()):
            self._tell(time.monotonic() - self.start)

    def stop(self) -> float:
        self._done.set()
        self._thread.join()
        return time.monotonic() - self.start


class LogProgress:
    """``progress(done, total)`` for a log (stderr not a terminal): a line at most every
    :func:`every` seconds, and at the end when one was said before (work done sooner says
    nothing)."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.start = self.last = time.monotonic()
        self.said = -1

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if done == self.said or not (now - self.last >= every() or (done == total and self.said >= 0)):
            return
        self.said, self.last = done, now
        say(f"moesim {self.label}: {done} of {total} done ({now - self.start:.0f} s)")

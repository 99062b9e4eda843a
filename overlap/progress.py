"""The progress bar of the long commands (``overlap bench``, ``overlap tune``, ``overlap demo``), on rank 0's
stderr: how far the run is, what runs now, the time so far and, where the work is counted (`ProgressBar.count`),
an estimate of the time left.

On a terminal the bar is one line redrawn in place (at most every `ProgressBar.TTY_INTERVAL_S`);
written to a file or a pipe (CI logs, ``2>log``) it is a new line at most every `interval_s`
seconds, plus the first and the last, so a log shows steady progress without thousands of lines.
Lines the caller prints through `ProgressBar.line` (one per case) are never throttled and never
overwritten. The pieces of a benchmark case report to it through a `Progress` callback (`quiet`: to nobody); the
tuner's search through `ProgressBar.count`.

Imports nothing of `overlap`: every layer that runs long work may show it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

#: progress(fraction of the case done, what runs now): rank 0's view of a case (`ProgressBar`)
Progress = Callable[[float, str], None]


def quiet(fraction: float, text: str) -> None:
    """The `Progress` that shows nothing: every rank but rank 0's, and callers without a bar (`session`)."""


def duration(seconds: float) -> str:
    """``42 s``, ``6 min 05 s``."""
    seconds = round(seconds)
    return f"{seconds} s" if seconds < 60 else f"{seconds // 60} min {seconds % 60:02d} s"


class ProgressBar:
    """``[#####.........]  35% 8/24 <text> (41 s)``: `update` with the fraction done (0..1) and what
    runs now; `line` for a line of its own; `finish` for the last, full bar. Silent when not `enabled`."""

    TTY_INTERVAL_S = 0.1

    def __init__(self, enabled: bool = True, total: int = 1, stream: TextIO | None = None, interval_s: float = 3.0,
                 width: int = 24):
        self.enabled, self.total, self.width = enabled, max(1, total), width
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval_s = self.TTY_INTERVAL_S if self.tty else interval_s
        self.start = time.perf_counter()
        self._last = -float("inf")
        self._shown = False  # a bar is on the terminal's current line

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def render(self, fraction: float, text: str, clock: bool = True, time_left: bool = False) -> str:
        fraction = min(1.0, max(0.0, fraction))
        filled = int(self.width * fraction)
        done = min(self.total, int(fraction * self.total))
        elapsed = self.elapsed()
        left = f", ~{duration(elapsed * (1 - fraction) / fraction)} left" if time_left and 0 < fraction < 1 else ""
        tail = f" ({duration(elapsed)}{left})" if clock else ""
        return f"[{'#' * filled}{'.' * (self.width - filled)}] {100 * fraction:3.0f}% {done}/{self.total} {text}{tail}"

    def count(self, text: str, done: int, total: int) -> None:
        """The bar at `done` of `total` units of work (the tuner's measurements), with an estimate of the time left
        once some are done; the last unit finishes the bar."""
        self.total = max(1, total)
        if done >= total:
            self.finish(text)
        elif self.enabled and time.perf_counter() - self._last >= self.interval_s:
            self._last = time.perf_counter()
            self._write(self.render(done / self.total, text, time_left=True))

    def update(self, fraction: float, text: str) -> None:
        """Show the bar at `fraction` done, with `text` (what runs now), unless shown too recently."""
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self._last < self.interval_s:
            return
        self._last = now
        self._write(self.render(fraction, text))

    def line(self, text: str) -> None:
        """A line of its own (the bar, on a terminal, is redrawn below it at the next update)."""
        if self.enabled:
            self.clear()  # the line takes the bar's place
            self.stream.write(text + "\n")
            self.stream.flush()

    def clear(self) -> None:
        """Erase the bar from a terminal's current line (before other output goes to the terminal)."""
        if self._shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._shown = False

    def finish(self, text: str) -> None:
        """The full bar with `text`, always shown, and the end of the bar's line."""
        if self.enabled:
            self._write(self.render(1.0, text, clock=False))
            if self._shown:  # keep the full bar, end its line
                self.stream.write("\n")
                self._shown = False
            self.stream.flush()

    def _write(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r\033[K" + text[:200])
            self._shown = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

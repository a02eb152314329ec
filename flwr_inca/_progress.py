"""The one progress display of the package (CLI commands, reproductions, the Flower example)."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import TextIO

__all__ = ["ProgressBar", "format_duration"]


def format_duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``1h02m``: short and unambiguous."""
    if not math.isfinite(seconds):
        return "?"
    s = round(max(seconds, 0.0))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class ProgressBar:
    """A progress bar on stderr: ``label [#####.....] 45% status 12s, ~15s left``.

    Redraws in place on a terminal (at most 5 times a second); elsewhere (a log file) prints a line every
    10%, and after a unit of work also when ``heartbeat`` seconds have passed since the last line, so a log
    of hours of work shows it moving. ``lines=True`` prints one line per :meth:`advance` instead (for steps
    that take seconds, or output interleaved with a framework's log lines, where redrawing in place would
    garble both).
    """

    def __init__(self, total: int, label: str, stream: TextIO | None = None, enabled: bool = True,
                 lines: bool = False, heartbeat: float = 120.0) -> None:
        self.total = max(int(total), 1)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.lines = lines
        self.done = 0
        self.status = ""
        self.start = time.perf_counter()
        self._last_draw = 0.0
        self._last_decile = -1
        self.heartbeat = float(heartbeat)
        self._last_line = self.start
        self._done_at_line = 0
        self._tty = not lines and bool(getattr(self.stream, "isatty", lambda: False)())

    def advance(self, units: int = 1, status: str | None = None) -> None:
        self.done = min(self.done + units, self.total)
        if status is not None:
            self.status = status
        self._draw(step=True)

    def set_total(self, total: int) -> None:
        """Change the work's total (units) once it is better known, e.g. when steps turn out to be done
        already or later steps' sizes become known; the done units are kept (at most the new total)."""
        self.total = max(int(total), 1)
        self.done = min(self.done, self.total)

    def set_status(self, status: str) -> None:
        self.status = status
        self._draw()

    def callback(self, units_per_call: int = 1) -> Callable[[int, int], None]:
        """A ``progress(done, total)`` callback that advances the bar one unit per call."""
        return lambda _done, _total: self.advance(units_per_call)

    @property
    def elapsed(self) -> float:
        """Seconds since the bar was created."""
        return time.perf_counter() - self.start

    def eta(self) -> float:
        """Seconds left, extrapolated from the pace so far (NaN before the first unit)."""
        frac = self.done / self.total
        return self.elapsed / frac * (1 - frac) if frac > 0 else math.nan

    def line(self) -> str:
        frac = self.done / self.total
        eta = self.eta()
        eta_s = f", ~{format_duration(eta)} left" if frac < 1 and math.isfinite(eta) else ""
        bar = "#" * int(20 * frac) + "." * (20 - int(20 * frac))
        status = f" {self.status}" if self.status else ""
        return f"{self.label} [{bar}] {100 * frac:3.0f}%{status} {format_duration(self.elapsed)}{eta_s}"

    def _draw(self, final: bool = False, step: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        line = self.line()
        if self._tty:
            if final or now - self._last_draw >= 0.2 or self.done == self.total:
                self.stream.write("\r" + line[:150].ljust(150))
                self.stream.flush()
                self._last_draw = now
        elif self.lines:
            if step or final:
                self.stream.write(line + "\n")
                self.stream.flush()
        else:
            decile = int(10 * self.done / self.total)
            slow = self.done > self._done_at_line and now - self._last_line >= self.heartbeat
            if decile > self._last_decile or slow:
                self.stream.write(line + "\n")
                self.stream.flush()
                self._last_decile = max(decile, self._last_decile)
                self._last_line, self._done_at_line = now, self.done

    def close(self) -> None:
        if self.enabled:
            self.done = self.total
            if not self.lines:
                self._draw(final=True)
            if self._tty:
                self.stream.write("\n")
                self.stream.flush()

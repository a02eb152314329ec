"""Shared pieces of the reproductions: results, CSV/PNG/table output, progress, BLAS threads."""

from __future__ import annotations

import contextlib
import csv
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

__all__ = ["Check", "FigureResult", "ProgressBar", "format_table", "single_blas_thread", "write_csv"]


@dataclass
class Check:
    """A number or ordering the paper states, next to what was measured."""

    claim: str
    paper: str
    measured: str
    holds: bool | None  # None: not comparable (explained in ``note``)
    note: str = ""


@dataclass
class FigureResult:
    """One reproduced figure: its rows (also the CSV), the paper's statements checked, how it ran."""

    figure: str
    title: str
    columns: list[str]
    rows: list[dict[str, Any]]
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    plot: Callable[[FigureResult, Path], None] | None = None

    def table(self, columns: list[str] | None = None) -> str:
        cols = columns or self.columns
        return format_table([[r.get(c, "") for c in cols] for r in self.rows], cols)

    def checks_table(self) -> str:
        rows = [[c.claim, c.paper, c.measured, {True: "yes", False: "NO", None: "-"}[c.holds], c.note]
                for c in self.checks]
        return format_table(rows, ["paper states", "paper", "measured", "holds", "note"])


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if math.isinf(value):
            return "inf"
        return f"{value:.4g}"
    return str(value)


def format_table(rows: list[list[Any]], header: list[str]) -> str:
    """A plain-text table, numbers to 4 significant digits."""
    cells = [header] + [[_cell(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_csv(result: FigureResult, path: Path) -> None:
    """The figure's rows as CSV (written to a temporary name, then renamed: no half-written file)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=result.columns, extrasaction="ignore")
        writer.writeheader()
        for row in result.rows:
            writer.writerow({k: (repr(v) if isinstance(v, float) else v) for k, v in row.items()})
    os.replace(tmp, path)


class ProgressBar:
    """A progress bar on stderr: ``label [#####.....] 45% status 12s, ~15s left``.

    Redraws in place on a terminal (at most 5 times a second); elsewhere prints a line every 10%.
    """

    def __init__(self, total: int, label: str, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.total = max(int(total), 1)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.done = 0
        self.status = ""
        self.start = time.perf_counter()
        self._last_draw = 0.0
        self._last_decile = -1
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def advance(self, units: int = 1, status: str | None = None) -> None:
        self.done = min(self.done + units, self.total)
        if status is not None:
            self.status = status
        self._draw()

    def set_status(self, status: str) -> None:
        self.status = status
        self._draw()

    def callback(self, units_per_call: int = 1) -> Callable[[int, int], None]:
        """A ``progress(done, total)`` callback that advances the bar one unit per call."""
        return lambda _done, _total: self.advance(units_per_call)

    def _draw(self, final: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        frac = self.done / self.total
        elapsed = now - self.start
        eta = elapsed / frac * (1 - frac) if frac > 0 else math.nan
        eta_s = f", ~{eta:.0f}s left" if frac < 1 and math.isfinite(eta) else ""
        bar = "#" * int(20 * frac) + "." * (20 - int(20 * frac))
        line = f"{self.label} [{bar}] {100 * frac:3.0f}% {self.status} {elapsed:.0f}s{eta_s}"
        if self._tty:
            if final or now - self._last_draw >= 0.2 or self.done == self.total:
                self.stream.write("\r" + line[:150].ljust(150))
                self.stream.flush()
                self._last_draw = now
        else:
            decile = int(10 * frac)
            if decile > self._last_decile:
                self.stream.write(line + "\n")
                self.stream.flush()
                self._last_decile = decile

    def close(self) -> None:
        if self.enabled:
            self.done = self.total
            self._draw(final=True)
            if self._tty:
                self.stream.write("\n")
                self.stream.flush()


@contextlib.contextmanager
def single_blas_thread(enabled: bool = True) -> Iterator[None]:
    """Limit BLAS/LAPACK to one thread while the reproduction runs.

    The certificates factor many small matrices (hundreds of rows); on a shared 2-core machine
    OpenBLAS's worker threads then mostly wait for each other (benchmarks/RESULTS.md has the side by
    side). Needs ``threadpoolctl`` (installed with scikit-learn); without it nothing changes.
    """
    if not enabled:
        yield
        return
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - threadpoolctl comes with the examples extra
        yield
        return
    with threadpool_limits(limits=1, user_api="blas"):
        yield

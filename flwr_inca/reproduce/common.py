"""Shared pieces of the reproductions: results, CSV/PNG/table output, progress, BLAS threads."""

from __future__ import annotations

import contextlib
import csv
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._progress import ProgressBar  # re-exported: the package's one progress display

__all__ = ["PAPER", "Check", "FigureResult", "ProgressBar", "format_table", "reproduces", "single_blas_thread",
           "write_csv"]

PAPER = "Sabater et al., PoPETs 2026"  # Sabater, Ben Mokhtar & Ramon, the IncA paper


def reproduces(figure: str) -> str:
    """The line each reproduction's plot carries: ``reproduces("Fig. 3b")`` is
    ``"Reproduces Fig. 3b of Sabater et al., PoPETs 2026"``."""
    return f"Reproduces {figure} of {PAPER}"


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
    # draws the figure to the PNG path given (and its SVG beside it, flwr_inca._plots.save_figure); returns
    # the paths written (None: only the PNG)
    plot: Callable[[FigureResult, Path], list[Path] | None] | None = None
    # writes further files into the output directory and returns their names (e.g. a markdown table)
    write_extra: Callable[[FigureResult, Path], list[str]] | None = None
    checks_heading: str = "The paper's statements, measured:"

    def table(self, columns: list[str] | None = None) -> str:
        cols = columns or self.columns
        return format_table([[r.get(c, "") for c in cols] for r in self.rows], cols)

    def checks_table(self) -> str:
        if not self.checks:  # e.g. a frontier piece without the points a statement compares
            return "(none: these settings hold no points the statements compare)"
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


@contextlib.contextmanager
def single_blas_thread(enabled: bool = True) -> Iterator[None]:
    """Limit BLAS/LAPACK to one thread while the reproduction runs.

    The certificates factor many small matrices (hundreds of rows); on a busy 2-core machine
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

"""The package's one way to draw and save a figure: a style, a figure without pyplot, PNG + SVG.

Every plot of the package (the reproductions, the MNIST study, the simulator's history, the attack
audit, the Flower example) goes through here, so they share one look and each PNG gets a vector copy
(SVG, text as paths: it renders the same everywhere and drops into a paper or a slide)::

    from flwr_inca._plots import new_figure, paper_style, save_figure

    with paper_style():
        fig, ax = new_figure(figsize=(6.4, 4.0))
        ax.errorbar(x, y, yerr=stderr, marker="o", capsize=2, label=r"IncA, $k = 1$")
        ax.set_xlabel(r"fraction of parties dropping out $\\gamma$")
        paths = save_figure(fig, out / "figure.png")  # figure.png and figure.svg

matplotlib stays optional: nothing here imports it until a figure is drawn, and
:func:`have_matplotlib` says whether it can be.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ._io import atomic_write_bytes

__all__ = ["DPI", "STYLE", "VECTOR_FORMAT", "have_matplotlib", "log_yerr", "math_number", "new_figure", "paper_style",
           "save_figure"]

DPI = 150  # PNG resolution (dots per inch of the figure size)
VECTOR_FORMAT = "svg"  # written beside every PNG
STYLE: dict[str, Any] = {
    "font.size": 9,
    "axes.titlesize": 9,
    "axes.labelsize": 9,
    "xtick.labelsize": 8,
    "ytick.labelsize": 8,
    "legend.fontsize": 7.5,
    "legend.framealpha": 0.9,
    "figure.titlesize": 10,
    "mathtext.fontset": "dejavusans",  # the symbols in the same face as the text around them
    "lines.linewidth": 1.5,
    "lines.markersize": 5,
    "errorbar.capsize": 2.5,
    "axes.grid": True,
    "axes.axisbelow": True,
    "grid.alpha": 0.3,
    "svg.fonttype": "path",
    "svg.hashsalt": "flwr-inca",  # stable element ids: the same figure gives the same SVG
}


def have_matplotlib() -> bool:
    """Whether matplotlib can be imported (it is an optional dependency)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def paper_style() -> Iterator[None]:
    """Apply :data:`STYLE` to the figures drawn inside (matplotlib's global settings are restored
    after). Raises ``ImportError`` without matplotlib."""
    import matplotlib

    with matplotlib.rc_context(STYLE):
        yield


def new_figure(nrows: int = 1, ncols: int = 1, *, figsize: tuple[float, float], layout: str | None = "constrained",
               **subplots: Any) -> tuple[Any, Any]:
    """A figure of ``figsize`` inches and its axes (``Figure.subplots(nrows, ncols, **subplots)``).

    ``layout="constrained"`` fits titles, labels and outside legends (``loc="outside ..."``) without
    overlaps; ``None`` leaves the placement to the caller (``fig.tight_layout``).

    No pyplot: no global figure list to leak into and no backend switch, so plotting is safe inside a
    program that uses matplotlib itself; the figure gets an Agg canvas (it can be drawn and measured).
    Draw inside :func:`paper_style` for the package's look.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, layout=layout)
    FigureCanvasAgg(fig)
    return fig, fig.subplots(nrows, ncols, **subplots)


def math_number(x: float) -> str:
    """``x`` for mathtext (inside ``$...$``): ``1e-05`` -> ``10^{-5}``, ``2.5e-06`` -> ``2.5 \\times 10^{-6}``,
    ``0.1`` -> ``0.1``."""
    text = f"{x:g}"
    if "e" not in text:
        return text
    mantissa, exponent = text.split("e")
    power = f"10^{{{int(exponent)}}}"
    return power if mantissa == "1" else rf"{mantissa} \times {power}"


def log_yerr(values: Any, errors: Any) -> Any:
    """Error bars of ``values ± errors`` for a log axis, shape ``(2, points)``: the lower bar stops at 5%
    of the value (a bar to zero or below has no place on a log axis), the upper one is ``errors``; a
    non-finite error (one run: no spread) draws no bar."""
    import numpy as np

    values = np.asarray(values, dtype=float)
    errors = np.nan_to_num(np.asarray(errors, dtype=float), nan=0.0, posinf=0.0, neginf=0.0)
    return np.vstack([np.minimum(errors, 0.95 * values), errors])


def save_figure(fig: Any, path: str | os.PathLike[str], *, dpi: int = DPI, vector: bool = True) -> list[Path]:
    """Write ``fig`` to ``path`` (PNG) and, with ``vector``, to the same name with ``.svg`` beside it.

    Each file is written atomically (a reader never sees half a figure); the SVG carries no date, so
    redrawing the same data gives the same file. Returns the paths written, PNG first.
    """
    png = Path(path)
    targets = [(png, "png")] + ([(png.with_suffix(f".{VECTOR_FORMAT}"), VECTOR_FORMAT)] if vector else [])
    with paper_style():
        for target, fmt in targets:
            buf = io.BytesIO()
            metadata = {"Date": None} if fmt == "svg" else None
            fig.savefig(buf, format=fmt, dpi=dpi, metadata=metadata)
            atomic_write_bytes(target, buf.getvalue(), durable=False)
    return [target for target, _ in targets]

"""The study's summary, table and plots, from its rows (``results.json``, ``table.csv``, ``table.md``,
``accuracy_vs_epsilon.png``, ``accuracy_vs_gamma.png`` and their ``.svg``)."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np

from .._io import atomic_write_text
from .._plots import math_number, new_figure, paper_style, save_figure
from .grid import METHODS, TRUSTED, StudyGrid

__all__ = ["figures", "markdown_table", "plot", "replot", "summarise", "write_table"]


def summarise(rows: list[dict], grid: StudyGrid, points: list[tuple[float, float]]) -> dict[str, Any]:
    """Mean and spread over seeds per (method, n, partition, epsilon, gamma) of the test runs."""
    table = []
    for n in grid.clients:
        for part in grid.partitions:
            for method in grid.methods:
                for eps, gamma in points:
                    sel = [r for r in rows if r["phase"] == "test" and r["method"] == method
                           and int(r["clients"]) == n and r["partition"] == part and float(r["gamma"]) == gamma
                           and (method == "fedavg" or float(r["epsilon"]) == eps)]
                    accs = [float(r["accuracy"]) for r in sel if r["accuracy"] is not None]
                    worst = [float(r["worst_node"]) for r in sel if r["worst_node"] not in (None, "")]
                    spent = [float(r["epsilon_spent"]) for r in sel if r["epsilon_spent"] not in (None, "")]
                    sent = [float(r["messages"]) for r in sel if r.get("messages") not in (None, "")]
                    table.append({
                        "method": method, "label": METHODS[method], "clients": n, "partition": part, "epsilon": eps,
                        "gamma": gamma, "runs": len(accs),
                        "accuracy": float(np.mean(accs)) if accs else None,
                        "spread": float(np.std(accs)) if len(accs) > 1 else 0.0 if accs else None,
                        "worst_node": float(np.mean(worst)) if worst else None,
                        "epsilon_spent": float(np.max(spent)) if spent else None,
                        "messages": float(np.mean(sent)) if sent else None,
                        "note": "; ".join(sorted({r["note"] for r in sel if r["note"]}))})
    return {"table": table}


def write_table(summary: dict[str, Any], out: Path) -> None:
    """``table.csv`` (one row per summary cell) and ``table.md`` (:func:`markdown_table`) in ``out``."""
    table = summary["table"]
    text = io.StringIO()
    w = csv.DictWriter(text, fieldnames=list(table[0]))
    w.writeheader()
    w.writerows(table)
    atomic_write_text(out / "table.csv", text.getvalue())
    atomic_write_text(out / "table.md", markdown_table(table))


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}"


def markdown_table(table: list[dict]) -> str:
    """Accuracy (%) per method (rows) and (epsilon, gamma) (columns), one block per (n, partition)."""
    lines = []
    for n, part in dict.fromkeys((r["clients"], r["partition"]) for r in table):
        block = [r for r in table if r["clients"] == n and r["partition"] == part]
        cols = list(dict.fromkeys((r["epsilon"], r["gamma"]) for r in block))
        lines.append(f"**n = {n}, {part}** — test accuracy (%), mean ± spread over seeds; DP gossip / Muffliato: "
                     "average model (worst node)\n")
        lines.append("| method | " + " | ".join(f"ε={e:g}, γ={g:g}" for e, g in cols) + " |")
        lines.append("|---|" + "---:|" * len(cols))
        for method in dict.fromkeys(r["method"] for r in block):
            cells = []
            for e, g in cols:
                r = next(x for x in block if x["method"] == method and x["epsilon"] == e and x["gamma"] == g)
                cell = _pct(r["accuracy"])
                if r["accuracy"] is not None and r["runs"] > 1:
                    cell += f" ± {100 * r['spread']:.1f}"
                if r["worst_node"] is not None:
                    cell += f" ({_pct(r['worst_node'])})"
                cells.append(cell)
            lines.append(f"| {METHODS[method]} | " + " | ".join(cells) + " |")
        lines.append("")
        lines.extend(_messages_block(block, cols))
    return "\n".join(lines)


def _messages_block(block: list[dict], cols: list[tuple[float, float]]) -> list[str]:
    """Messages per participant per round (mean over the runs' rounds), per method and column."""
    if all(r.get("messages") is None for r in block):
        return []
    lines = ["messages per participant per round (mean over the rounds; IncA: T k + 1 when nobody drops out)\n",
             "| method | " + " | ".join(f"ε={e:g}, γ={g:g}" for e, g in cols) + " |", "|---|" + "---:|" * len(cols)]
    for method in dict.fromkeys(r["method"] for r in block):
        cells = []
        for e, g in cols:
            r = next(x for x in block if x["method"] == method and x["epsilon"] == e and x["gamma"] == g)
            cells.append("n/a" if r.get("messages") is None else f"{r['messages']:.1f}")
        lines.append(f"| {METHODS[method]} | " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def plot(summary: dict[str, Any], grid: StudyGrid, out: Path) -> list[Path]:
    """``accuracy_vs_epsilon.png`` (at ``gamma_at_epsilon``) and ``accuracy_vs_gamma.png`` (at
    ``epsilon_at_gamma``), each with its ``.svg`` beside it: one panel per (n, partition) of the grid, rows
    n, columns partitions; error bars +-1 standard deviation over the seeds. Returns the paths written."""
    written = []
    for name, fig in figures(summary, grid):
        written += save_figure(fig, Path(out) / f"{name}.png", dpi=120)
    return written


def replot(directory: str | Path) -> list[Path]:
    """Redraw the plots of a finished study from its ``results.json`` (its summary and grid), without
    running anything; returns the paths written. Raises ``ValueError`` naming the file if it is not a
    study's results."""
    path = Path(directory) / "results.json"
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        known = {f.name for f in fields(StudyGrid)}
        grid = StudyGrid(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved["grid"].items() if k in known})
        if not saved["table"]:
            raise ValueError("no rows in its table")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not the results of a study ({exc})") from None
    return plot(saved, grid, Path(directory))


def _label(method: str) -> str:
    """A method's legend label, its symbols in mathtext (``k_PR`` -> $k_\\mathrm{PR}$)."""
    return METHODS[method].replace("k_PR", r"$k_\mathrm{PR}$")


def _axis_label(x_key: str, delta: float) -> str:
    if x_key == "epsilon":
        return rf"$\varepsilon$ (total over the rounds, $\delta = {math_number(delta)}$)"
    return r"$\gamma$ (share of dropouts, within and across rounds)"


def figures(summary: dict[str, Any], grid: StudyGrid) -> Iterator[tuple[str, Any]]:
    """Yield ``(name, figure)`` for :func:`plot` (matplotlib figures without pyplot, drawn in the
    package's style; :func:`flwr_inca._plots.save_figure` writes them)."""
    for name, x_key, fixed_key, fixed in (("accuracy_vs_epsilon", "epsilon", "gamma", grid.gamma_at_epsilon),
                                          ("accuracy_vs_gamma", "gamma", "epsilon", grid.epsilon_at_gamma)):
        with paper_style():
            fig = _figure(summary["table"], grid, x_key, fixed_key, fixed)
        yield name, fig


def _figure(table: list[dict], grid: StudyGrid, x_key: str, fixed_key: str, fixed: float) -> Any:
    rows, cols = len(grid.clients), len(grid.partitions)
    fig, axes = new_figure(rows, cols, figsize=(6.4 * cols, 4.4 * rows), squeeze=False, layout=None)
    where = rf"$\gamma = {fixed:g}$" if x_key == "epsilon" else rf"$\varepsilon = {fixed:g}$"
    seeds = max((int(r.get("runs") or 1) for r in table), default=1)
    spread = f"; bars: $\\pm 1$ std over {seeds} seeds" if seeds > 1 else ""
    for (n, part), ax in zip(((n, p) for n in grid.clients for p in grid.partitions), axes.flat):
        for method in grid.methods:
            pts = sorted((r[x_key], r["accuracy"], r["spread"] or 0.0) for r in table
                         if r["method"] == method and r["clients"] == n and r["partition"] == part
                         and r[fixed_key] == fixed and r["accuracy"] is not None)
            if not pts:
                continue
            xs, ys, sp = (np.array(v, dtype=float) for v in zip(*pts))
            style = "--" if method in TRUSTED else ":" if method == "muffliato" else "-"
            ax.errorbar(xs, 100 * ys, yerr=100 * sp, label=_label(method), linestyle=style, marker="o", ms=4)
        if x_key == "epsilon":
            ax.set_xscale("log", base=2)
        ax.set_xlabel(_axis_label(x_key, grid.delta))
        ax.set_ylabel("test accuracy (%)")
        ax.set_title(f"MNIST logistic regression, $n = {n}$, {part}, {where}{spread}")
    _legend_below(fig, axes, cols)
    return fig


def _legend_below(fig: Any, axes: Any, cols: int) -> None:
    """One legend for all panels, below them: inside a panel it covered points wherever it went."""
    handles, labels = [], []
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    # room below the panels for the legend's rows (about 0.22 in each at fontsize 9), not a fixed share
    ncol = min(len(labels), 4 if cols > 1 else 2) or 1
    legend_rows = -(-len(labels) // ncol)
    bottom = (0.22 * legend_rows + 0.12) / fig.get_figheight() if handles else 0.0
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, bottom, 1, 1))

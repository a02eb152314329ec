"""The audit's figure: the attacker's error against the certificate's promise, and the distinguisher's ROC
against the Gaussian-DP trade-off curve of the certified mu. Needs matplotlib (imported when called)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..._plots import new_figure, paper_style, save_figure
from .audit import AttackAudit
from .stats import gdp_tradeoff_tpr

__all__ = ["plot_attack"]


def plot_attack(audit: AttackAudit, prefix: str | os.PathLike[str]) -> list[Path]:
    """Write ``<prefix>.png`` and ``<prefix>.svg`` (atomically) and return their paths.

    Left: each target's measured error std divided by the certificate's promise ``sensitivity / mu``, with
    its interval (below 1: the certificate is beaten) and the attacker's computed value. Right: the ROC of
    the likelihood-ratio distinguisher (log axes, where the privacy loss shows) and, dashed, the largest
    TPR that mu-GDP allows at each FPR, ``1 - Phi(Phi^-1(1 - FPR) - mu)``.
    """
    with paper_style():
        fig, (left, right) = new_figure(1, 2, figsize=(11, 4.6), gridspec_kw={"width_ratios": [1, 1.3]})
        _ratio_panel(left, audit)
        _roc_panel(right, audit)
        fig.suptitle(f"{audit.mechanism}, {audit.adversary}: {audit.runs} fresh-noise runs, intervals "
                     f"simultaneous at {100 * audit.confidence:g}%")
        return save_figure(fig, f"{os.fspath(prefix)}.png")


def _ratio_panel(ax, audit: AttackAudit) -> None:
    x = np.arange(len(audit.targets))
    for i, t in enumerate(audit.targets):
        color = "tab:red" if t.beaten else f"C{i}"
        lo, hi = t.ratio_interval
        ax.errorbar([i], [t.ratio], yerr=[[t.ratio - lo], [hi - t.ratio]], fmt="o", color=color, capsize=5,
                    label="measured (interval)" if i == 0 else None)
        ax.plot([i], [t.predicted_std / t.promised_std], "x", color="k", ms=7,
                label="attacker's computed value" if i == 0 else None)
    ax.axhline(1.0, color="k", lw=1)
    bottom, top = ax.get_ylim()
    bottom, top = min(bottom, 0.97), max(top, 1.03)
    ax.axhspan(bottom, 1.0, color="tab:red", alpha=0.08, label="beats the certificate")
    ax.set_ylim(bottom, top)
    ax.set_xticks(x, [f"party {t.party}\n$\\mu = {t.mu:.3g}$" for t in audit.targets])
    ax.set_xlim(-0.6, len(audit.targets) - 0.4)
    ax.set_ylabel(r"attacker's error std $\times\ \mu$ / sensitivity")
    ax.set_title("reconstruction: error vs the certificate's promise (= 1)")
    ax.legend(loc="upper right")
    ax.grid(alpha=0.3)


def _roc_panel(ax, audit: AttackAudit) -> None:
    grid = np.geomspace(1e-5, 1.0, 300)
    for i, t in enumerate(audit.targets):
        fpr, tpr = t.roc
        ok = fpr > 0
        ax.plot(fpr[ok], tpr[ok], "-", color=f"C{i}", lw=1.5, label=f"party {t.party}: attack ROC")
        ax.plot(grid, gdp_tradeoff_tpr(grid, t.mu), "--", color=f"C{i}", lw=1,
                label=f"party {t.party}: $\\mu$-GDP limit, $\\mu = {t.mu:.3g}$")
        for test, marker in ((t.mu_test, "s"), (t.epsilon_test, "^")):
            if test is None or test.fpr <= 0:
                continue
            (f_lo, f_hi), (t_lo, t_hi) = test.fpr_interval, test.tpr_interval
            ax.errorbar([test.fpr], [test.tpr], xerr=[[test.fpr - f_lo], [f_hi - test.fpr]],
                        yerr=[[test.tpr - t_lo], [t_hi - test.tpr]], fmt=marker, color=f"C{i}", ms=4,
                        capsize=2, lw=0.8)
    ax.plot(grid, grid, ":", color="gray", lw=1, label="random guess")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(max(0.5 / max(audit.runs, 1), 1e-5), 1.0)
    ax.set_ylim(1e-4, 1.05)
    ax.set_xlabel("false-positive rate")
    ax.set_ylabel("true-positive rate")
    ax.set_title(r"distinguishing $x_i = 0$ from $x_i$ = sensitivity (squares: $\mu$ test, "
                 r"triangles: $\varepsilon$ test)")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3, which="both")

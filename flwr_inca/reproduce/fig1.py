"""Figure 1: MSE without dropouts vs the corrupted fraction (n = 1024, epsilon = 0.1, delta = 1e-5).

Curves: central DP and local DP (closed form), Muffliato on the hypercube under its own accounting
(paper App. B: Pairwise Network DP, a mean privacy loss over pairs, no collusion), and IncA:

* the paper's formula (Thm 4.5, sigma_delta -> inf): ``c^2 / (n_H n epsilon^2)``, and its tight
  counterpart ``1 / (n_H n mu^2)`` with the analytic Gaussian mu;
* measured runs (k = 1, T = 20) calibrated by the paper's procedure (alpha = 1.3, classic bound, so
  1.3 times the formula) and by the improved one (exact certificate, analytic conversion, alpha
  chosen), with the MSE of fresh runs.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..baselines.base import Threat
from ..baselines.calibration import measure_mse
from ..baselines.gaussian import gaussian_mu
from ..baselines.gossip import Muffliato
from ..baselines.inca import IncaBaseline
from ..privacy.conversions import classic_c
from ..privacy.views import coalition_size
from ..protocol.config import IncaConfig
from .common import Check, FigureResult, ProgressBar, reproduces
from .experiments import calibrate_and_measure, units

N, EPSILON, DELTA = 1024, 0.1, 1e-5
ITERATIONS, NEIGHBORS = 20, 1
RHOS = tuple(round(0.05 * i, 2) for i in range(15))  # 0 .. 0.7
MEASURED_RHOS = (0.0, 0.1, 0.3, 0.5, 0.7)
DIM = 32  # coordinates per measured run
PAPER = {"cdp": 0.002238, "inca_0.7": 0.00747, "ldp": 2.292, "muffliato": 0.1764}

COLUMNS = [
    "rho", "n_honest", "cdp_classic", "cdp_exact", "ldp_classic", "ldp_exact",
    "muffliato_pndp_T8", "muffliato_pndp_T17", "muffliato_T8_measured_party",
    "inca_formula_classic", "inca_formula_exact",
    "inca_paper_mse", "inca_paper_mse_stderr", "inca_paper_sigma_star", "inca_paper_sigma_delta",
    "inca_exact_mse", "inca_exact_mse_stderr", "inca_exact_sigma_star", "inca_exact_sigma_delta", "inca_exact_alpha",
    "runs",
]


def work(runs: int) -> int:
    return len(MEASURED_RHOS) * units(runs) + 2 * runs


def run(runs: int, seed: int, bar: ProgressBar) -> FigureResult:
    c2 = classic_c(DELTA) ** 2
    mu = gaussian_mu(EPSILON, DELTA)
    bar.set_status("Muffliato")
    muff = {reading: Muffliato.pndp(EPSILON, DELTA, N, "hypercube", reading=reading) for reading in ("paper", "spectral-gap")}
    muff_measured = measure_mse(muff["paper"], N, runs, seed=seed, dim=DIM, progress=bar.callback(2))
    base = IncaBaseline(IncaConfig(sigma_star=1.0, sigma_delta=1.0, iterations=ITERATIONS, neighbors=NEIGHBORS))
    measured = {}
    for i, rho in enumerate(MEASURED_RHOS):
        measured[rho] = calibrate_and_measure(base, N, EPSILON, DELTA, Threat.collusion(rho), runs=runs,
                                              seed=seed + 101 * i, bar=bar, status=f"IncA rho={rho:g}", dim=DIM)
    rows = []
    for rho in RHOS:
        n_h = N - coalition_size(rho, N)
        row = {
            "rho": rho, "n_honest": n_h,
            "cdp_classic": c2 / (EPSILON**2 * N**2), "cdp_exact": 1 / (N**2 * mu**2),
            "ldp_classic": c2 / (EPSILON**2 * N), "ldp_exact": 1 / (N * mu**2),
            "muffliato_pndp_T8": muff["paper"].sigma_star ** 2 / N,
            "muffliato_pndp_T17": muff["spectral-gap"].sigma_star ** 2 / N,
            "muffliato_T8_measured_party": muff_measured.details["party_mse"],
            "inca_formula_classic": c2 / (n_h * N * EPSILON**2), "inca_formula_exact": 1 / (n_h * N * mu**2),
            "runs": runs,
        }
        for proc in ("paper", "exact"):
            got = measured.get(rho, {}).get(proc)
            row[f"inca_{proc}_mse"] = got.measured if got else math.nan
            # standard error of the MSE over the runs (each run's squared error averaged over DIM coordinates)
            row[f"inca_{proc}_mse_stderr"] = got.mse.stderr if got and got.mse else math.nan
            row[f"inca_{proc}_sigma_star"] = got.calibration.sigma_star if got else math.nan
            row[f"inca_{proc}_sigma_delta"] = got.calibration.sigma_delta if got else math.nan
        row["inca_exact_alpha"] = measured[rho]["exact"].calibration.alpha if rho in measured else math.nan
        rows.append(row)
    result = FigureResult("fig1", "Fig. 1: MSE without dropouts vs corrupted fraction (n = 1024, eps = 0.1)",
                          COLUMNS, rows, plot=plot,
                          params={"n": N, "epsilon": EPSILON, "delta": DELTA, "T": ITERATIONS, "k": NEIGHBORS,
                                  "runs": runs, "dim": DIM, "seed": seed})
    first, last = rows[0], rows[-1]
    result.checks = [
        Check("central DP MSE c^2/(eps^2 n^2)", f"{PAPER['cdp']}", f"{first['cdp_classic']:.6f}",
              abs(first["cdp_classic"] - PAPER["cdp"]) < 5e-7,
              f"tight (analytic) central DP: {first['cdp_exact']:.6f}"),
        Check("IncA MSE at 70% corrupted, c^2/(n_H n eps^2)", f"{PAPER['inca_0.7']}",
              f"{last['inca_formula_classic']:.5f}", abs(last["inca_formula_classic"] - PAPER["inca_0.7"]) < 5e-6,
              f"n_H = {last['n_honest']}; measured: paper calibration {last['inca_paper_mse']:.5f} "
              f"(alpha = 1.3), exact {last['inca_exact_mse']:.5f} (alpha = {last['inca_exact_alpha']:.3g})"),
        Check("local DP MSE c^2/(eps^2 n)", f"{PAPER['ldp']}", f"{first['ldp_classic']:.4f}",
              abs(first["ldp_classic"] - PAPER["ldp"]) < 5e-4, f"tight: {first['ldp_exact']:.4f}"),
        Check("Muffliato (hypercube, PNDP) MSE >= 0.1764", ">= 0.1764",
              f"{first['muffliato_pndp_T8']:.4f} (T = 8)", first["muffliato_pndp_T8"] >= PAPER["muffliato"] - 5e-5,
              f"with Muffliato's own T = ceil(ln n / sqrt(spectral gap)) = 17: {first['muffliato_pndp_T17']:.4f}; "
              f"measured, each party's own estimate after 8 steps: {first['muffliato_T8_measured_party']:.4f}"),
        Check("IncA much closer to central DP than to local DP at 70% corrupted", "yes",
              f"{last['inca_exact_mse']:.4g} vs CDP {last['cdp_exact']:.4g}, LDP {last['ldp_exact']:.4g}",
              last["inca_exact_mse"] < math.sqrt(last["cdp_exact"] * last["ldp_exact"]),
              "geometric midpoint as the yardstick"),
    ]
    result.notes.append("Muffliato's PNDP numbers assume no collusion and report a mean privacy loss; under "
                        "Eavesdrop or Collusion DP a neighbour sees x_i + eta_i, so Muffliato is local DP "
                        "(its curve would be the LDP line).")
    return result


def plot(result: FigureResult, path: Path) -> list[Path]:
    """The paper's Fig. 1: MSE against the corrupted fraction rho, closed forms as lines, the measured
    IncA runs as points with +-1 standard error; PNG at ``path`` and SVG beside it."""
    from .._plots import log_yerr, math_number, new_figure, paper_style, save_figure

    rows = result.rows
    rho = np.array([r["rho"] for r in rows])
    with paper_style():
        fig, ax = new_figure(figsize=(8.2, 4.6))
        for column, style, color, width, label in _LINES:
            ax.plot(rho, [r[column] for r in rows], style, color=color, lw=width, label=label)
        for proc, marker, color, label in (("paper", "o", "tab:blue", r"paper's calibration ($\alpha = 1.3$)"),
                                           ("exact", "s", "tab:green", r"exact calibration ($\alpha$ chosen)")):
            pts = [r for r in rows if math.isfinite(r[f"inca_{proc}_mse"])]
            if pts:
                y = np.array([r[f"inca_{proc}_mse"] for r in pts])
                err = log_yerr(y, [r.get(f"inca_{proc}_mse_stderr", math.nan) for r in pts])
                ax.errorbar([r["rho"] for r in pts], y, yerr=err, fmt=marker, color=color, mfc="white", ms=6,
                            mew=1.5, zorder=4, label=f"IncA measured, {label}")
        ax.set_yscale("log")
        ax.set_xlabel(r"fraction of corrupted parties $\rho$")
        ax.set_ylabel("MSE of the average")
        ax.set_title(f"$n = {N}$, $\\varepsilon = {EPSILON:g}$, $\\delta = {math_number(DELTA)}$; IncA "
                     f"$k = {NEIGHBORS}$, $T = {ITERATIONS}$\n{result.params['runs']} runs per measured point "
                     "(bars: $\\pm 1$ standard error)", fontsize=8)
        fig.suptitle(reproduces("Fig. 1"))
        ax.grid(which="minor", alpha=0.12)
        handles, labels = ax.get_legend_handles_labels()  # the measured points next to their formulas
        cut = next((i for i, label in enumerate(labels) if label.startswith("central DP")), len(labels))
        measured = [i for i, label in enumerate(labels) if label.startswith("IncA measured")]
        order = [i for i in range(cut) if i not in measured] + measured + [
            i for i in range(cut, len(labels)) if i not in measured]
        fig.legend([handles[i] for i in order], [labels[i] for i in order], loc="outside right center")
        return save_figure(fig, path)


# the closed forms and Muffliato: (column, line style, colour, width, legend label)
_LINES = (
    ("ldp_classic", "--", "black", 1.5, r"local DP, classic bound $c^2/(n \varepsilon^2)$"),
    ("ldp_exact", "--", "gray", 1.0, r"local DP, tight $1/(n \mu^2)$"),
    ("muffliato_pndp_T17", "-", "tab:purple", 1.5, r"Muffliato PNDP, $T = 17$"),
    ("muffliato_T8_measured_party", "-.", "tab:purple", 1.0, r"Muffliato measured, a party's own estimate ($T = 8$)"),
    ("muffliato_pndp_T8", ":", "tab:purple", 1.5, r"Muffliato PNDP, $T = 8$ (paper)"),
    ("inca_formula_classic", "-", "tab:blue", 1.5, r"IncA, classic bound $c^2/(n_H n \varepsilon^2)$"),
    ("inca_formula_exact", "-", "tab:green", 1.5, r"IncA, tight $1/(n_H n \mu^2)$"),
    ("cdp_classic", "-", "black", 1.5, r"central DP, classic bound $c^2/(n^2 \varepsilon^2)$"),
    ("cdp_exact", "-", "gray", 1.0, r"central DP, tight $1/(n^2 \mu^2)$"),
)

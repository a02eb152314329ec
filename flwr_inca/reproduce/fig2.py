"""Figure 2: the iterations IncA needs for Theorem 4.5's precondition under collusion.

k = 1, no dropouts, every party picks a neighbour it has not picked before at each iteration (fresh
neighbours, as in the paper's experiment). For k = 1 the precondition (the unseen vectors a^(i,t)
span n_H - 1 dimensions) is "the graph of messages between honest parties is connected" (the messages
to corrupted parties are the observed ones), so for each run we find the first T at which it is
connected (one topology of T_max iterations; a shorter run is its prefix). The figure's number is the
smallest T that succeeds in *every* run: the maximum over runs, which grows with the number of runs.

To read our run counts against the paper's 1e5, :func:`expected_isolated` gives the expected number of
honest parties left isolated (the dominant way to fail): a party is isolated when its T fresh picks
all hit corrupted parties and no honest party picks it, so ``E = n_H * C(n_C, T)/C(n-1, T) *
(1 - T/(n-1))^(n_H - 1)``; the column ``T_for_1e5_runs`` is the smallest T with ``1e5 * E < 1``.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import scipy.sparse as sp
from scipy.sparse.csgraph import connected_components
from scipy.special import gammaln

from ..privacy.views import coalition_size, random_collusion
from ..protocol.config import IncaConfig
from ..protocol.engine import sample_trace
from ..protocol.trace import ExecutionTrace
from .common import Check, FigureResult, ProgressBar, reproduces

PARTIES = (100, 500, 1000, 5000)
RHOS = tuple(round(0.05 * i, 2) for i in range(1, 11))  # 0.05 .. 0.5
PAPER_RUNS = 100_000
T_START = 32

COLUMNS = ["n", "rho", "runs", "min_T_all_runs", "median_T", "p99_T", "T_estimate_these_runs", "T_for_1e5_runs",
           "expected_isolated_at_min_T"]


def first_connected_iteration(trace: ExecutionTrace, corrupted: np.ndarray) -> int | None:
    """The first T such that the honest-to-honest messages of iterations 1..T connect every honest
    party (Thm 4.5's precondition for k = 1 without dropouts), or None within the trace."""
    n = trace.parties
    honest = np.ones(n, dtype=bool)
    honest[corrupted] = False
    n_h = int(honest.sum())
    if n_h <= 1:
        return 1
    pos = np.cumsum(honest) - 1
    edges = []
    for step in trace.steps:
        m = step.messages
        keep = honest[m.senders] & honest[m.receivers]
        edges.append((pos[m.senders[keep]], pos[m.receivers[keep]]))

    def connected(T: int) -> bool:
        s = np.concatenate([e[0] for e in edges[:T]])
        r = np.concatenate([e[1] for e in edges[:T]])
        graph = sp.csr_matrix((np.ones(s.size), (s, r)), shape=(n_h, n_h))
        return connected_components(graph, directed=True, connection="weak", return_labels=False) == 1

    lo, hi = 0, len(edges)  # not connected at lo (T = 0), search (lo, hi]
    if not connected(hi):
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if connected(mid):
            hi = mid
        else:
            lo = mid
    return hi


def expected_isolated(n: int, rho: float, T: int) -> float:
    """Expected number of isolated honest parties after T fresh k = 1 iterations (module docstring)."""
    n_c = coalition_size(rho, n)
    n_h = n - n_c
    if T > n_c:
        all_to_corrupted = 0.0
    else:
        log_ratio = (gammaln(n_c + 1) - gammaln(n_c - T + 1)) - (gammaln(n) - gammaln(n - T))
        all_to_corrupted = math.exp(log_ratio)
    nobody_picks = (1.0 - T / (n - 1)) ** (n_h - 1)
    return n_h * all_to_corrupted * nobody_picks


def _estimate(n: int, rho: float, runs: int) -> float:
    """Smallest T at which ``runs`` runs expect less than one isolated honest party in all."""
    return next((T for T in range(1, n) if runs * expected_isolated(n, rho, T) < 1), math.inf)


def work(runs: int) -> int:
    return len(PARTIES) * runs


def run(runs: int, seed: int, bar: ProgressBar) -> FigureResult:
    rows = []
    for n_index, n in enumerate(PARTIES):
        bar.set_status(f"n = {n}")
        t_max = min(T_START, n - 1)
        firsts = {rho: [] for rho in RHOS}
        for r in range(runs):
            run_seed = int(np.random.SeedSequence([seed, n_index, r]).generate_state(1)[0])
            limit = t_max
            trace = sample_trace(n, _config(limit), run_seed)
            for i, rho in enumerate(RHOS):
                corrupted = random_collusion(trace, rho, run_seed + i + 1).corrupted
                first = first_connected_iteration(trace, corrupted)
                while first is None and limit < n - 1:  # longer run, same prefix
                    limit = min(2 * limit, n - 1)
                    trace = sample_trace(n, _config(limit), run_seed)
                    first = first_connected_iteration(trace, corrupted)
                firsts[rho].append(first if first is not None else math.inf)
            bar.advance()
        for rho in RHOS:
            t = np.array(firsts[rho], dtype=float)
            need = int(np.max(t)) if np.all(np.isfinite(t)) else math.inf
            paper_T = _estimate(n, rho, PAPER_RUNS)
            rows.append({"n": n, "rho": rho, "runs": runs, "min_T_all_runs": need,
                         "median_T": float(np.median(t)), "p99_T": float(np.quantile(t, 0.99)),
                         "T_estimate_these_runs": _estimate(n, rho, runs), "T_for_1e5_runs": paper_T,
                         "expected_isolated_at_min_T": expected_isolated(n, rho, need) if math.isfinite(need) else math.nan})
    result = FigureResult("fig2", "Fig. 2: iterations for Thm 4.5's precondition (k = 1, fresh neighbours, C-DP)",
                          COLUMNS, rows, plot=plot, params={"runs": runs, "seed": seed, "k": 1})
    worst = max(r["min_T_all_runs"] for r in rows)
    big = next(r for r in rows if r["n"] == max(PARTIES) and r["rho"] == max(RHOS))
    result.checks = [
        Check("n = 5000, 50% corrupted: slightly more than 15 iterations for 100% success in 1e5 runs",
              "slightly > 15", f"{big['min_T_all_runs']} in {runs} runs; {big['T_for_1e5_runs']} expected for 1e5",
              15 < big["T_for_1e5_runs"] <= 18,
              "the maximum over runs grows with the run count; the 1e5-run column extrapolates with the "
              "isolated-party estimate (checked against the measured runs in the tests)"),
        Check("(ours) the isolated-party estimate predicts the measured maximum within 1 iteration",
              "(not in the paper)", f"{sum(abs(r['T_estimate_these_runs'] - r['min_T_all_runs']) <= 1 for r in rows)} "
              f"of {len(rows)} cells", None, "what supports reading the 1e5-run column as the paper's number"),
        Check("communication stays low as n grows (<= ~16 messages per party for n <= 5000)", "yes",
              f"largest measured: {worst}", worst <= 17, ""),
    ]
    return result


def _config(iterations: int) -> IncaConfig:
    return IncaConfig(sigma_star=1.0, sigma_delta=1.0, iterations=iterations, neighbors=1, topology="random-fresh")


def plot(result: FigureResult, path: Path) -> list[Path]:
    """The paper's Fig. 2, one panel per n: the measured cells (the largest first-success T over our runs,
    filled markers, solid line, with the spread of the runs shaded) apart from the extrapolated ones (the
    isolated-party estimate for the paper's 1e5 runs, hollow markers, dashed); PNG and SVG."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    from .._plots import new_figure, paper_style, save_figure

    runs = result.params["runs"]
    with paper_style():
        fig, axes = new_figure(2, 2, figsize=(7.6, 6.2), sharex=True, sharey=True)
        for ax, n, color in zip(axes.flat, PARTIES, ("tab:blue", "tab:orange", "tab:green", "tab:red")):
            rows = sorted((r for r in result.rows if r["n"] == n), key=lambda r: r["rho"])
            rho = [r["rho"] for r in rows]
            ax.fill_between(rho, [r["median_T"] for r in rows], [r["p99_T"] for r in rows], color=color, alpha=0.15,
                            lw=0)
            ax.plot(rho, [r["T_estimate_these_runs"] for r in rows], ":", color="gray", lw=1)
            ax.plot(rho, [r["min_T_all_runs"] for r in rows], "o-", color=color, ms=5, zorder=3)
            ax.plot(rho, [r["T_for_1e5_runs"] for r in rows], "s--", color=color, mfc="white", ms=5, zorder=3)
            if n == 5000 and any(r["rho"] == 0.5 for r in rows):
                ax.plot([0.5], [15], "*", color="black", ms=9, zorder=4)
            ax.set_title(f"$n = {n}$")
        for ax in axes[-1]:
            ax.set_xlabel(r"fraction of corrupted parties $\rho$")
        for ax in axes[:, 0]:
            ax.set_ylabel(r"iterations $T$ (= messages per party)")
        legend = [
            Line2D([], [], color="black", marker="o", label=f"measured: smallest $T$ with all {runs} runs successful"),
            Patch(color="black", alpha=0.15, label=f"measured: spread of the {runs} runs' first success "
                  "(median to 99th percentile)"),
            Line2D([], [], color="gray", ls=":", lw=1, label=f"the isolated-party estimate for {runs} runs (the model, against the measured)"),
            Line2D([], [], color="black", marker="s", ls="--", mfc="white",
                   label="extrapolated: the estimate for the paper's $10^5$ runs"),
            Line2D([], [], color="black", marker="*", ls="none", ms=9,
                   label=r"paper: slightly more than 15 ($n = 5000$, $\rho = 0.5$)"),
        ]
        fig.legend(handles=legend, loc="outside lower center", ncol=2)
        fig.suptitle(f"{reproduces('Fig. 2')}\nTheorem 4.5's precondition under collusion ($k = 1$, fresh "
                     "neighbours, no dropouts)")
        return save_figure(fig, path)

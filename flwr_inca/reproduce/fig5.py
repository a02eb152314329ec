"""Figure 5 (App. C.1): how often Theorem 4.5's precondition holds, n = 100, no dropouts.

k in 1..5 neighbours per iteration, T in {2, 4, 6, 8, 10}; Eavesdrop DP with 50% of the messages of
each iteration observed, and Collusion DP with 30% of the parties corrupted. Success of a run: the
paper's precondition (rank of the unseen vectors >= n_H - 1, :func:`analyze_structure`), and, the
improved reading, the exact certificate's floor (sigma_delta -> inf) equals the central-DP level
``1 / (n_H sigma_star^2)`` for every honest party.

"50% of messages observed" has two readings once k > 1: the paper's, where half of the parties'
message vectors y_i^(t) are seen at each iteration (``eavesdrop``), and a network eavesdropper's,
where half of the k n copies are intercepted, any one of which reveals y_i^(t) (``eavesdrop-copies``).
"""

from __future__ import annotations

import math
from itertools import pairwise
from pathlib import Path

import numpy as np

from ..privacy.certificate import profile
from ..privacy.structure import analyze_structure
from ..privacy.views import AdversaryView, coalition_size, eavesdrop_view, random_collusion, random_eavesdrop
from ..protocol.config import IncaConfig
from ..protocol.engine import sample_trace
from ..protocol.trace import ExecutionTrace
from .common import Check, FigureResult, ProgressBar, reproduces

N = 100
KS = (1, 2, 3, 4, 5)
TS = (2, 4, 6, 8, 10)
THREATS = ("eavesdrop", "collusion", "eavesdrop-copies")
OBSERVED, CORRUPTED = 0.5, 0.3
FLOOR_TOL = 1e-4  # relative; the certificate's limit is accurate to a few 1e-6 at n = 100

COLUMNS = ["threat", "k", "T", "messages", "runs", "precondition_success", "precondition_success_stderr",
           "exact_floor_success", "exact_floor_success_stderr", "agreement"]


def eavesdrop_senders(trace: ExecutionTrace, fraction: float, seed: int | None) -> AdversaryView:
    """The paper's reading: at each iteration, ``ceil(fraction * senders)`` of the parties' message
    vectors are observed (whatever their number of copies)."""
    rng = np.random.default_rng(seed)
    intercepted = []
    for t, step in enumerate(trace.steps, start=1):
        senders = np.unique(step.messages.senders)
        for s in rng.choice(senders, size=coalition_size(fraction, senders.size), replace=False):
            intercepted.append((int(s), t))
    return eavesdrop_view(trace, intercepted)


def view_for(threat: str, trace: ExecutionTrace, seed: int) -> AdversaryView:
    if threat == "eavesdrop":
        return eavesdrop_senders(trace, OBSERVED, seed)
    if threat == "eavesdrop-copies":
        return random_eavesdrop(trace, OBSERVED, seed)
    return random_collusion(trace, CORRUPTED, seed)


def exact_floor_holds(trace: ExecutionTrace, view: AdversaryView) -> bool:
    """The certificate's sigma_delta -> inf limit is the central level for every honest party."""
    limit = profile(trace, view).mu_limit(1.0)
    return bool(np.all(limit <= (1.0 + FLOOR_TOL) / math.sqrt(view.honest.size)))


def binomial_stderr(successes: int, runs: int) -> float:
    """Standard error of a success share measured over ``runs`` independent runs, sqrt(p (1 - p) / runs)
    (0 when every run or none succeeded: the share of those runs has no spread)."""
    p = successes / runs
    return math.sqrt(p * (1.0 - p) / runs)


def work(runs: int) -> int:
    return len(KS) * len(TS) * runs


def run(runs: int, seed: int, bar: ProgressBar) -> FigureResult:
    counts = {(th, k, T): [0, 0, 0] for th in THREATS for k in KS for T in TS}
    for k in KS:
        for T in TS:
            bar.set_status(f"k = {k}, T = {T}")
            config = IncaConfig(sigma_star=1.0, sigma_delta=1.0, iterations=T, neighbors=k)
            for r in range(runs):
                run_seed = int(np.random.SeedSequence([seed, k, T, r]).generate_state(1)[0])
                trace = sample_trace(N, config, run_seed)
                for i, threat in enumerate(THREATS):
                    view = view_for(threat, trace, run_seed + i + 1)
                    pre = analyze_structure(trace, view).rank_condition
                    exact = exact_floor_holds(trace, view)
                    c = counts[(threat, k, T)]
                    c[0] += pre
                    c[1] += exact
                    c[2] += pre == exact
                bar.advance()
    rows = [{"threat": th, "k": k, "T": T, "messages": k * T, "runs": runs,
             "precondition_success": c[0] / runs, "precondition_success_stderr": binomial_stderr(c[0], runs),
             "exact_floor_success": c[1] / runs, "exact_floor_success_stderr": binomial_stderr(c[1], runs),
             "agreement": c[2] / runs}
            for (th, k, T), c in counts.items()]
    result = FigureResult("fig5", "Fig. 5: success of Thm 4.5's precondition, n = 100 (E-DP 50% observed, "
                          "C-DP 30% corrupted)", COLUMNS, rows, plot=plot, params={"n": N, "runs": runs, "seed": seed})
    result.checks = _checks(rows)
    return result


def _first_full(rows: list[dict], threat: str, k: int, column: str, by: str = "T") -> float:
    done = [r[by] for r in rows if r["threat"] == threat and r["k"] == k and r[column] >= 1.0]
    return min(done) if done else math.inf


def _checks(rows: list[dict]) -> list[Check]:
    col = "precondition_success"
    edp = {k: float(np.mean([r[col] for r in rows if r["threat"] == "eavesdrop" and r["k"] == k])) for k in KS}
    edp_T = [_first_full(rows, "eavesdrop", k, col) for k in KS]
    edp_msgs = [_first_full(rows, "eavesdrop", k, col, "messages") for k in KS]
    cdp = {k: float(np.mean([r[col] for r in rows if r["threat"] == "collusion" and r["k"] == k])) for k in KS}
    agreement = min(r["agreement"] for r in rows)
    return [
        Check("E-DP: higher k needs fewer iterations (5a)", "success grows with k",
              "mean success over T: " + ", ".join(f"k={k}: {v:.2f}" for k, v in edp.items())
              + "; first T with 100%: " + ", ".join(f"k={k}: {t}" for k, t in zip(KS, edp_T)),
              all(a <= b + 1e-12 for a, b in pairwise(edp.values())),
              "paper's reading: half of the message vectors seen per iteration"),
        Check("E-DP: lower k needs fewer messages kT in total (5b)", "k = 1 fewest",
              "first kT with 100%: " + ", ".join(f"k={k}: {m}" for k, m in zip(KS, edp_msgs)),
              edp_msgs[0] <= min(edp_msgs), ""),
        Check("C-DP: k = 1 is best (5c)", "k = 1 highest success",
              "mean success over T: " + ", ".join(f"k={k}: {v:.2f}" for k, v in cdp.items()),
              cdp[1] >= max(cdp.values()) - 1e-12, ""),
        Check("precondition <=> exact floor at the central level, run by run", "(not in the paper)",
              f"lowest agreement in a cell: {agreement:.3f}", agreement == 1.0,
              "Thm 4.5's precondition and the exact certificate's sigma_delta -> inf limit agree"),
    ]


# (threat, x axis, panel title); panels a-c are the paper's, d the other reading of "50% observed"
PANELS = (("eavesdrop", "T", "(a) E-DP, 50% of the message vectors observed"),
          ("eavesdrop", "messages", "(b) E-DP, by messages per party $kT$"),
          ("collusion", "T", "(c) C-DP, 30% of the parties corrupted"),
          ("eavesdrop-copies", "T", "(d) E-DP, 50% of the $kn$ copies observed (not in the paper)"))


def plot(result: FigureResult, path: Path) -> list[Path]:
    """The paper's Fig. 5 (a-c) and the copies reading (d), a legend in each panel: the precondition's
    success share (hollow circles, line, +-1 standard error shaded) and the exact certificate's (crosses
    on top, which sit inside the circles wherever the two agree); PNG and SVG."""
    from .._plots import new_figure, paper_style, save_figure

    with paper_style():
        fig, axes = new_figure(2, 2, figsize=(10, 7.4), sharey=True)
        for ax, (threat, by, title) in zip(axes.flat, PANELS):
            _panel(ax, [r for r in result.rows if r["threat"] == threat], by)
            ax.set_title(title)
            ax.set_xlabel(r"iterations $T$" if by == "T" else r"messages per party $kT$")
        for ax in axes[:, 0]:
            ax.set_ylabel("success (% of runs)")
        fig.suptitle(f"{reproduces('Fig. 5')} (panels a-c): success of Theorem 4.5's precondition, $n = {N}$, no "
                     f"dropouts\n{result.params['runs']} runs per point (bands: $\\pm 1$ standard error); circles: "
                     "the precondition, crosses: the exact certificate's $\\sigma_\\Delta \\to \\infty$ limit "
                     "at the central-DP level")
        return save_figure(fig, path)


def _panel(ax, rows: list[dict], by: str) -> None:
    """One panel: a curve per k, precondition and exact markers, and its legend."""
    from matplotlib.lines import Line2D

    handles = []
    for i, k in enumerate(KS):
        cell = sorted((r for r in rows if r["k"] == k), key=lambda r: r[by])
        x = np.array([r[by] for r in cell], dtype=float)
        pre = 100 * np.array([r["precondition_success"] for r in cell], dtype=float)
        se = 100 * np.array([r.get("precondition_success_stderr", 0.0) for r in cell], dtype=float)
        color = f"C{i}"
        ax.fill_between(x, np.clip(pre - se, 0, 100), np.clip(pre + se, 0, 100), color=color, alpha=0.15, lw=0)
        ax.plot(x, pre, "o-", color=color, ms=9, mfc="white", mew=1.6, zorder=3)
        ax.plot(x, [100 * r["exact_floor_success"] for r in cell], "x", color=color, ms=6, mew=1.6, zorder=4)
        handles.append(Line2D([], [], color=color, lw=2.5, label=f"$k = {k}$"))
    handles += [Line2D([], [], color="black", marker="o", ms=9, mfc="white", mew=1.6, ls="none", label="precondition"),
                Line2D([], [], color="black", marker="x", ms=6, mew=1.6, ls="none", label="exact certificate")]
    ax.set_ylim(-5, 105)
    ax.legend(handles=handles, loc="best", ncol=2, handlelength=1.6, columnspacing=1.0)

"""Figure 3: MSE under permanent dropouts (n = 200, epsilon = 0.2, delta = 1e-5, 10% corrupted).

Each protocol is calibrated twice on the same simulated executions, by the paper's procedure (alpha =
1.3, classic bound, worst case over the runs) and by the improved one (exact certificate, analytic
conversion, alpha chosen), both with the exact per-execution check; then fresh runs on values from
U[0, 1] measure the MSE (paper Sec. 5.2).

* 3a: IncA with k in {1, 3, 5} and T in {10, 20}.
* 3b: IncA (k, T) = (1, 20) vs GOPA (k_PR = 20; gamma_2 in {gamma/2, gamma/4, 1/n} of the dropouts
  happen during its roll-back) vs CorDP-DME (complete graph, no roll-back: the paper's lower bound,
  uncancelled noise only, and a full simulation), with central and local DP as references.
"""

from __future__ import annotations

import math
from itertools import product
from pathlib import Path

from ..baselines.base import Threat
from ..baselines.gaussian import gaussian_mu
from ..baselines.inca import IncaBaseline
from ..baselines.pairwise import GOPA, CorDPDME
from ..privacy.conversions import classic_c
from ..protocol.config import IncaConfig
from ..protocol.dropout import PermanentDropout
from .common import Check, FigureResult, ProgressBar, reproduces
from .experiments import Calibrated, calibrate_and_measure, units

N, EPSILON, DELTA, RHO = 200, 0.2, 1e-5, 0.1
GAMMAS = (0.05, 0.1, 0.2)
TOPOLOGIES_3A = tuple(product((1, 3, 5), (10, 20)))  # (k, T)
GOPA_NEIGHBORS = 20
GOPA_SPLITS = ("gamma/2", "gamma/4", "1/n")
DIM = 8

COLUMNS = ["figure", "protocol", "gamma", "k", "T", "gamma_2", "procedure", "sigma_star", "sigma_delta",
           "alpha", "success_fraction", "predicted_mse", "mse", "mse_stderr", "noise_lower_bound", "runs"]


def references() -> list[dict]:
    """Central and local DP, classic bound (the paper's lines) and tight conversion."""
    rows = []
    c2 = classic_c(DELTA) ** 2
    mu = gaussian_mu(EPSILON, DELTA)
    for proc, var in (("paper", c2 / EPSILON**2), ("exact", 1 / mu**2)):
        for gamma in GAMMAS:
            rows.append({"protocol": "CDP", "gamma": gamma, "procedure": proc, "mse": var / N**2})
            rows.append({"protocol": "LDP", "gamma": gamma, "procedure": proc, "mse": var / N})
    return rows


def _inca(k: int, T: int, gamma: float) -> IncaBaseline:
    return IncaBaseline(IncaConfig(sigma_star=1.0, sigma_delta=1.0, iterations=T, neighbors=k,
                                   dropout=PermanentDropout(gamma)))


def _gamma_2(split: str, gamma: float) -> float:
    return {"gamma/2": gamma / 2, "gamma/4": gamma / 4, "1/n": 1.0 / N}[split]


def _rows(figure: str, protocol: str, gamma: float, got: dict[str, Calibrated], **extra) -> list[dict]:
    rows = []
    for proc, c in got.items():
        cal = c.calibration
        rows.append({"figure": figure, "protocol": protocol, "gamma": gamma, "procedure": proc,
                     "sigma_star": cal.sigma_star, "sigma_delta": cal.sigma_delta, "alpha": cal.alpha,
                     "success_fraction": cal.success_fraction, "predicted_mse": cal.predicted_mse,
                     "mse": c.measured, "mse_stderr": c.mse.stderr if c.mse else math.nan,
                     "noise_lower_bound": math.nan, "runs": cal.runs, **extra})
    return rows


def _seed(seed: int, *key: int) -> int:
    return (seed * 1_000_003 + sum(v * 7919**i for i, v in enumerate(key, 1))) % 2**62


def _cached(cache: dict | None, key: tuple, compute, *args, **kwargs):
    """``compute(*args, **kwargs)``, once per key within one reproduction (Figs. 3a and 3b share IncA (1, 20))."""
    if cache is None:
        return compute(*args, **kwargs)
    if key not in cache:
        cache[key] = compute(*args, **kwargs)
    return cache[key]


def work(figure: str, runs: int) -> int:
    per_gamma = len(TOPOLOGIES_3A) if figure == "fig3a" else 1 + len(GOPA_SPLITS) + 1
    return len(GAMMAS) * per_gamma * units(runs)


def run_3a(runs: int, seed: int, bar: ProgressBar, cache: dict | None = None) -> FigureResult:
    rows = []
    for g, gamma in enumerate(GAMMAS):
        for k, T in TOPOLOGIES_3A:
            got = _cached(cache, ("inca", k, T, gamma, runs, seed), calibrate_and_measure,
                          _inca(k, T, gamma), N, EPSILON, DELTA, Threat.collusion(RHO), runs=runs,
                          seed=_seed(seed, g, k, T), bar=bar, status=f"IncA k={k} T={T} gamma={gamma:g}", dim=DIM)
            rows += _rows("3a", f"IncA k={k} T={T}", gamma, got, k=k, T=T)
    result = FigureResult("fig3a", "Fig. 3a: IncA's MSE vs dropouts for k in {1,3,5}, T in {10,20} "
                          "(n = 200, eps = 0.2, rho = 0.1)", COLUMNS, rows + references(), plot=plot_3a,
                          params=_params(runs, seed))
    result.checks = _checks_3a(rows)
    return result


def run_3b(runs: int, seed: int, bar: ProgressBar, cache: dict | None = None) -> FigureResult:
    rows = []
    threat = Threat.collusion(RHO)
    for g, gamma in enumerate(GAMMAS):
        got = _cached(cache, ("inca", 1, 20, gamma, runs, seed), calibrate_and_measure,
                      _inca(1, 20, gamma), N, EPSILON, DELTA, threat, runs=runs, seed=_seed(seed, g, 1, 20),
                      bar=bar, status=f"IncA gamma={gamma:g}", dim=DIM)
        rows += _rows("3b", "IncA k=1 T=20", gamma, got, k=1, T=20)
        for s, split in enumerate(GOPA_SPLITS):
            gopa = GOPA(1.0, 1.0, neighbors=GOPA_NEIGHBORS, gamma=gamma, gamma_rollback=_gamma_2(split, gamma))
            got = calibrate_and_measure(gopa, N, EPSILON, DELTA, threat, runs=runs, seed=_seed(seed, g, 100 + s),
                                        bar=bar, status=f"GOPA gamma_2={split} gamma={gamma:g}", dim=DIM)
            rows += _rows("3b", f"GOPA gamma_2={split}", gamma, got, k=GOPA_NEIGHBORS, gamma_2=_gamma_2(split, gamma))
        cordp = CorDPDME(1.0, 1.0, gamma=gamma)
        got = calibrate_and_measure(cordp, N, EPSILON, DELTA, threat, runs=runs, seed=_seed(seed, g, 200),
                                    bar=bar, status=f"CorDP-DME gamma={gamma:g}", dim=DIM)
        cordp_rows = _rows("3b", "CorDP-DME", gamma, got, k=N - 1)
        for row, c in zip(cordp_rows, got.values()):
            if math.isfinite(c.calibration.sigma_delta):
                row["noise_lower_bound"] = cordp.with_sigmas(c.calibration.sigma_star,
                                                             c.calibration.sigma_delta).noise_lower_bound(N)
        rows += cordp_rows
    result = FigureResult("fig3b", "Fig. 3b: IncA vs GOPA vs CorDP-DME under dropouts (n = 200, eps = 0.2, "
                          "rho = 0.1)", COLUMNS, rows + references(), plot=plot_3b, params=_params(runs, seed))
    result.checks = _checks_3b(rows)
    return result


def _params(runs: int, seed: int) -> dict:
    return {"n": N, "epsilon": EPSILON, "delta": DELTA, "rho": RHO, "runs": runs, "dim": DIM, "seed": seed}


def _mse(rows: list[dict], protocol: str, gamma: float, procedure: str, column: str = "mse") -> float:
    for r in rows:
        if r["protocol"] == protocol and r["gamma"] == gamma and r["procedure"] == procedure:
            return r[column]
    return math.nan


def _checks_3a(rows: list[dict]) -> list[Check]:
    checks = []
    for proc in ("paper", "exact"):
        pairs = [(k, gamma, _mse(rows, f"IncA k={k} T=20", gamma, proc), _mse(rows, f"IncA k={k} T=10", gamma, proc))
                 for k in (1, 3, 5) for gamma in GAMMAS]
        better = sum(a < b for _, _, a, b in pairs)
        worst = max(pairs, key=lambda p: p[2] / p[3])
        checks.append(Check(f"higher T lowers the MSE for the same gamma ({proc} calibration)", "all (k, gamma)",
                            f"{better} of {len(pairs)}", better == len(pairs),
                            f"closest: k={worst[0]}, gamma={worst[1]:g}: T=20 {worst[2]:.4g} vs T=10 {worst[3]:.4g}"))
        ks = [(gamma, T, [_mse(rows, f"IncA k={k} T={T}", gamma, proc) for k in (1, 3, 5)])
              for gamma in GAMMAS for T in (10, 20)]
        k1 = sum(v[0] <= min(v) for _, _, v in ks)
        checks.append(Check(f"k in {{1,3,5}} give similar MSE, smaller k smaller ({proc})", "k = 1 smallest",
                            f"k = 1 smallest in {k1} of {len(ks)}", None,
                            "largest spread: " + max((f"{max(v) / min(v):.2f}x (gamma={g:g}, T={T})"
                                                      for g, T, v in ks), key=lambda s: float(s.split("x")[0]))))
    return checks


def _checks_3b(rows: list[dict]) -> list[Check]:
    checks = []
    for proc in ("paper", "exact"):
        lines = []
        best = 0
        for gamma in GAMMAS:
            inca = _mse(rows, "IncA k=1 T=20", gamma, proc)
            others = {p: _mse(rows, p, gamma, proc) for p in [f"GOPA gamma_2={s}" for s in GOPA_SPLITS] + ["CorDP-DME"]}
            runner = min(others, key=others.get)
            best += inca < others[runner]
            lines.append(f"gamma={gamma:g}: IncA {inca:.3g}, next {runner} {others[runner]:.3g}")
        checks.append(Check(f"IncA has the lowest MSE for every gamma ({proc} calibration)", "all 3",
                            f"{best} of {len(GAMMAS)}", best == len(GAMMAS), "; ".join(lines)))
        worst = sum(_mse(rows, "CorDP-DME", g, proc, "noise_lower_bound")
                    >= max(_mse(rows, f"GOPA gamma_2={s}", g, proc) for s in GOPA_SPLITS) for g in GAMMAS)
        checks.append(Check(f"CorDP-DME worst, even its lower bound ({proc})", "all 3", f"{worst} of {len(GAMMAS)}",
                            worst == len(GAMMAS), ""))
        near = sum(_mse(rows, "GOPA gamma_2=1/n", g, proc)
                   < min(_mse(rows, "GOPA gamma_2=gamma/4", g, proc), _mse(rows, "GOPA gamma_2=gamma/2", g, proc))
                   for g in GAMMAS)
        closest = [_mse(rows, "GOPA gamma_2=1/n", g, proc) / _mse(rows, "IncA k=1 T=20", g, proc) for g in GAMMAS]
        checks.append(Check(f"GOPA is best with gamma_2 = 1/n and degrades with gamma_2 in {{gamma/4, gamma/2}} ({proc})",
                            "all 3", f"{near} of {len(GAMMAS)}", near == len(GAMMAS),
                            "GOPA(1/n) / IncA: " + ", ".join(f"{c:.2f}" for c in closest)
                            + "; gamma/2 vs gamma/4: " + ", ".join(
                                f"{_mse(rows, 'GOPA gamma_2=gamma/2', g, proc) / _mse(rows, 'GOPA gamma_2=gamma/4', g, proc):.2f}"
                                for g in GAMMAS)))
    return checks


def _label(protocol: str) -> str:
    """A protocol's legend label with symbols: ``IncA k=1 T=20`` -> IncA $k = 1$, $T = 20$."""
    if protocol.startswith("IncA "):
        k, T = (part.split("=")[1] for part in protocol.split()[1:3])
        return f"IncA $k = {k}$, $T = {T}$"
    if protocol.startswith("GOPA gamma_2="):
        split = protocol.split("=", 1)[1].replace("gamma", r"\gamma")
        return f"GOPA $\\gamma_2 = {split}$"
    return protocol


def _plot(result: FigureResult, path: Path, series: list[tuple[str, str, str]], lower_bound: bool,
          figure: str) -> list[Path]:
    """One panel per calibration procedure: MSE against gamma, +-1 standard error bars; PNG and SVG."""
    from .._plots import log_yerr, math_number, new_figure, paper_style, save_figure

    with paper_style():
        fig, axes = new_figure(1, 2, figsize=(10, 4.4), sharey=True)
        for ax, proc in zip(axes, ("paper", "exact")):
            for protocol, color, style in series:
                pts = sorted((r["gamma"], r["mse"], r.get("mse_stderr", math.nan)) for r in result.rows
                             if r["protocol"] == protocol and r["procedure"] == proc and math.isfinite(r["mse"]))
                if pts:
                    gamma, mse, stderr = zip(*pts)
                    ax.errorbar(gamma, mse, yerr=log_yerr(mse, stderr), fmt=style, color=color, label=_label(protocol))
            if lower_bound:
                pts = [(r["gamma"], r["noise_lower_bound"]) for r in result.rows if r["protocol"] == "CorDP-DME"
                       and r["procedure"] == proc and math.isfinite(r["noise_lower_bound"])]
                if pts:
                    ax.plot(*zip(*sorted(pts)), ":", color="tab:brown", label="CorDP-DME lower bound (paper's)")
            for ref, style, label in (("CDP", "k-", "central DP"), ("LDP", "k--", "local DP")):
                pts = [(r["gamma"], r["mse"]) for r in result.rows if r["protocol"] == ref and r["procedure"] == proc]
                ax.plot(*zip(*sorted(pts)), style, lw=1, label=label)
            ax.set_yscale("log")
            ax.set_xlabel(r"fraction of parties dropping out $\gamma$")
            ax.set_title({"paper": r"paper's calibration ($\alpha = 1.3$, classic bound)",
                          "exact": r"exact calibration (tight conversion, $\alpha$ chosen)"}[proc])
            ax.grid(which="minor", alpha=0.12)
        runs = result.params["runs"]
        axes[0].set_ylabel("MSE of the average")
        handles, labels = axes[1].get_legend_handles_labels()  # the protocols first, then bound and references
        rank = {"CorDP-DME lower bound (paper's)": 1, "central DP": 2, "local DP": 3}
        order = sorted(range(len(labels)), key=lambda i: (rank.get(labels[i], 0), i))
        fig.legend([handles[i] for i in order], [labels[i] for i in order], loc="outside right center")
        fig.suptitle(f"{reproduces(f'Fig. {figure}')}\n$n = {N}$, $\\varepsilon = {EPSILON:g}$, "
                     f"$\\delta = {math_number(DELTA)}$, $\\rho = {RHO:g}$ corrupted; {runs} calibration "
                     f"and {runs} MSE runs per point (bars: $\\pm 1$ standard error)")
        return save_figure(fig, path)


def plot_3a(result: FigureResult, path: Path) -> list[Path]:
    palette = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")
    ks = sorted({k for k, _ in TOPOLOGIES_3A})
    longest = max(T for _, T in TOPOLOGIES_3A)
    series = [(f"IncA k={k} T={T}", palette[ks.index(k) % len(palette)], "o-" if T == longest else "s--")
              for k, T in TOPOLOGIES_3A]
    return _plot(result, path, series, lower_bound=False, figure="3a")


def plot_3b(result: FigureResult, path: Path) -> list[Path]:
    series = [("IncA k=1 T=20", "tab:blue", "o-"), ("GOPA gamma_2=1/n", "tab:green", "^-"),
              ("GOPA gamma_2=gamma/4", "tab:olive", "^--"), ("GOPA gamma_2=gamma/2", "tab:red", "^-."),
              ("CorDP-DME", "tab:brown", "x-")]
    return _plot(result, path, series, lower_bound=True, figure="3b")

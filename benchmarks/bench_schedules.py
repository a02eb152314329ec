"""Injection schedules under dropouts: where IncA's uncancelled noise comes from, and which schedules
need less of it at equal certified privacy and equal messages.

Every comparison calibrates each schedule with the product's exact procedure (``calibrate``,
``procedure="exact"``: every simulated run certified at the target by the exact accountant, the alpha
grid, ``min_alpha = 1``) on the *same* simulated executions (same seeds: same topologies, dropouts and
colluders), at the same T and k (same messages per party). The figure of merit is the predicted MSE
of the mean of U[0, 1] values (central part + value lost with dropped parties + uncancelled noise).

Sections (each prints its figures):

* ``decompose``: the noise a party dropping out at iteration t leaves in the output, in units of
  sigma_delta^2, by noise term, for D_Inc (one party dropping, ``output_coefficients``).
* ``anatomy``: which parties set sigma_delta (D_Inc): the number of final iterations in which none of
  their messages reached an honest party ("unmixed tail"), for the most exposed parties against all.
* ``perterm``: per-term noise scales sigma_delta_t optimized against the worst case of training runs
  (cutting-plane LP on the exact certificates, which are convex in the per-term variances), then
  calibrated on fresh runs: does the optimum generalize?
* ``families``: few-parameter schedule families (value-free tail, AR(1)-correlated noise terms, a
  larger last term) against D_Inc, replicated over independent seeds.
* ``tails``: the value-free tail L over a grid of (n, T, k, gamma, epsilon), replicated: MSE ratio to
  D_Inc for every L.
* ``stability``: how the worst case over R calibration runs grows with R: each run's smallest sufficient
  sigma_delta at the central-DP level (alpha = 1), and the running maximum over the first R runs (the
  runs of ``calibrate(seed, runs=R)`` are the first R of any larger R: nested); then the distribution of
  each run's need (quantiles, the largest), how many later runs need more than the first R's worst, and
  what covering 99% of the first R runs takes (``target_success = 0.99``) at each R.
  With ``--gopa K ...`` GOPA with k_PR = K instead (gamma_2 = 1/n, the frontier's best GOPA): its exact
  calibration (alpha chosen, as in the frontier) on the first R runs, sigma_delta and predicted MSE against
  R = max.

    python benchmarks/bench_schedules.py decompose
    python benchmarks/bench_schedules.py anatomy --parties 100 --iterations 10 --runs 200
    python benchmarks/bench_schedules.py perterm --parties 100 --iterations 10
    python benchmarks/bench_schedules.py families --parties 200 --iterations 10 --runs 100 --replicates 3
    python benchmarks/bench_schedules.py tails --parties 200 --iterations 10 20 40 --neighbors 1 2 \\
        --gammas 0.05 0.1 0.2 0.3 --runs 100 --replicates 3
    python benchmarks/bench_schedules.py stability --parties 200 --iterations 10 40 --tails 0 3 --runs 800
    python benchmarks/bench_schedules.py stability --parties 1000 --gammas 0.1 0.3 --gopa 40 20 --runs 400
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import time

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np
import scipy.linalg as la
from scipy.optimize import linprog

from flwr_inca import IncaConfig, InjectionSchedule, PermanentDropout, ScheduledDropout
from flwr_inca.baselines.base import Threat
from flwr_inca.baselines.calibration import calibrate_samples, sample_views
from flwr_inca.baselines.pairwise import GOPA
from flwr_inca.privacy import calibrate, profile, random_collusion
from flwr_inca.privacy.calibration import covered_runs, simulation_seeds
from flwr_inca.privacy.conversions import mu_for_epsilon
from flwr_inca.privacy.linear_system import dense_system
from flwr_inca.protocol import sample_trace
from flwr_inca.protocol.utility import output_coefficients

DELTA = 1e-5
RHO = 0.1


# ---------------------------------------------------------------------------------------------- helpers
def predicted(schedule: InjectionSchedule | str, n: int, T: int, k: int, gamma: float, eps: float, runs: int,
              seed: int) -> dict[str, float]:
    """The exact calibration of ``schedule``: sigmas and predicted MSE (unit sensitivity, U[0, 1])."""
    cal = calibrate(eps, DELTA, n, iterations=T, neighbors=k, collusion=RHO, runs=runs, seed=seed,
                    dropout=PermanentDropout(gamma) if gamma > 0 else None, schedule=schedule)
    return {"mse": cal.predicted_mse, "sigma_star": cal.sigma_star, "sigma_delta": cal.sigma_delta,
            "alpha": cal.alpha}


def ar1_schedule(T: int, phi: float, tail: int = 0) -> InjectionSchedule:
    """D_Inc's value injection with AR(1) noise terms: outstanding S_t = phi S_{t-1} + sqrt(1-phi^2) eta.

    Every valid Z is Z_Inc M with M invertible (its columns span the zero-sum vectors): here M is the
    Cholesky factor of the AR(1) covariance phi^|a-b| of the outstanding terms."""
    M = np.zeros((T, T))
    for t in range(T):
        M[t, 0] = phi**t
        M[t, 1:t + 1] = phi ** (t - np.arange(1, t + 1)) * math.sqrt(1 - phi**2)
    base = InjectionSchedule.incremental(T, tail=tail)
    return InjectionSchedule.custom(base.c, base.Z @ M)


def scaled_schedule(T: int, scales: np.ndarray, tail: int = 0) -> InjectionSchedule:
    """D_Inc with noise term k scaled by ``scales[k-1]`` (per-term sigma_delta_k = scale * sigma_delta)."""
    base = InjectionSchedule.incremental(T, tail=tail)
    return InjectionSchedule.custom(base.c, base.Z * np.asarray(scales)[None, :])


# ---------------------------------------------------------------------------------------------- decompose
def section_decompose(args: argparse.Namespace) -> None:
    n, T = args.parties[0], args.iterations[0]
    print(f"## Uncancelled noise of one party dropping at iteration t (D_Inc, n = {n}, T = {T}, "
          f"{args.replicates * 20} topologies): E ||a||^2 in units of sigma_delta^2")
    reps = args.replicates * 20
    for k in args.neighbors:
        print(f"k = {k}")
        print("   t   total   own terms   by term k (1..T)")
        totals = []
        for td in range(1, T + 1):
            tot, own, by_term = 0.0, 0.0, np.zeros(T)
            for s in range(reps):
                mask = np.ones((T + 1, n), dtype=bool)
                mask[td:, 0] = False  # party 0 offline from iteration td on
                trace = sample_trace(n, IncaConfig(sigma_star=1.0, sigma_delta=1.0, iterations=T, neighbors=k,
                                                   dropout=ScheduledDropout(mask)), seed=s)
                _, a = output_coefficients(trace)
                tot += float((a * a).sum()) / reps
                own += float((a[0] ** 2).sum()) / reps
                by_term += (a * a).sum(axis=0) / reps
            totals.append(tot)
            print(f"  {td:2d}   {tot:.3f}   {own:.3f}       {' '.join(f'{v:.3f}' for v in by_term)}")
        print(f"  mean over a uniform drop iteration 1..T: {np.mean(totals):.3f} sigma_delta^2 per dropped party")


# ---------------------------------------------------------------------------------------------- anatomy
def unmixed_tail(trace, view, party: int) -> int:
    """Final iterations (counted back from T) in which none of ``party``'s messages reached an honest party."""
    honest = np.ones(trace.parties, dtype=bool)
    honest[view.corrupted] = False
    count = 0
    for step in reversed(trace.steps):
        m = step.messages
        if np.any(honest[m.receivers[m.senders == party]]):
            break
        count += 1
    return count


def section_anatomy(args: argparse.Namespace) -> None:
    n, T, k, gamma, eps = args.parties[0], args.iterations[0], args.neighbors[0], args.gammas[0], args.epsilons[0]
    for tail in args.tails:
        schedule = InjectionSchedule.incremental(T, tail=tail)
        cal = calibrate(eps, DELTA, n, iterations=T, neighbors=k, collusion=RHO, runs=args.runs, seed=args.seed,
                        dropout=PermanentDropout(gamma) if gamma > 0 else None, schedule=schedule)
        config = IncaConfig(sigma_star=1.0, sigma_delta=1.0, iterations=T, neighbors=k, schedule=schedule,
                            dropout=PermanentDropout(gamma) if gamma > 0 else None)
        rows = []  # (mu at the calibrated sigmas, unmixed tail) of every honest finalist
        for ts, vs in simulation_seeds(args.seed, args.runs):
            trace = sample_trace(n, config, int(ts))
            view = random_collusion(trace, RHO, int(vs))
            mu = profile(trace, view).mu(cal.sigma_star, cal.sigma_delta)
            finals = set(trace.finalists().tolist())
            rows += [(float(m), unmixed_tail(trace, view, int(i))) for i, m in zip(view.honest, mu) if int(i) in finals]
        rows.sort(key=lambda r: -r[0])
        top = rows[: args.top]
        every = np.array([r[1] for r in rows])
        print(f"## Most exposed parties, {schedule.name}, n = {n}, T = {T}, k = {k}, gamma = {gamma}, eps = {eps}, "
              f"{args.runs} runs (sigma_star = {cal.sigma_star:.4g}, sigma_delta = {cal.sigma_delta:.4g})")
        print(f"  unmixed tail of the {args.top} largest mu: {[r[1] for r in top]}")
        print(f"  share with an unmixed tail >= 1 / >= 2 / >= 3: top {args.top}: "
              f"{np.mean([r[1] >= 1 for r in top]):.2f} / {np.mean([r[1] >= 2 for r in top]):.2f} / "
              f"{np.mean([r[1] >= 3 for r in top]):.2f}; all {every.size} honest finalists: {np.mean(every >= 1):.3f} / "
              f"{np.mean(every >= 2):.3f} / {np.mean(every >= 3):.4f}")


# ---------------------------------------------------------------------------------------------- per-term
class _TermModel:
    """One run's view for per-term noise variances w (T,): Sigma = s*^2 B B^T + A diag(w (x) 1) A^T."""

    def __init__(self, trace, view) -> None:
        self.B, self.A, _ = dense_system(trace, view)  # A: column (k-1) n_H + j is term k of honest j
        self.nH, self.T = view.honest.size, trace.iterations
        self.GB = self.B @ self.B.T
        b, a = output_coefficients(trace)
        self.q = (a * a).sum(axis=0) / b.sum() ** 2  # uncancelled variance per unit w_k

    def mu2_and_gradient(self, s2: float, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """mu_j^2 (n_H,) and d mu_j^2 / d w_k (T, n_H): mu^2 = h^T Sigma^-1 h is convex in w."""
        Sigma = s2 * self.GB + (self.A * np.repeat(w, self.nH)) @ self.A.T
        V = la.cho_solve((la.cholesky(Sigma, lower=True), True), self.B)
        U = self.A.T @ V
        return np.einsum("ij,ij->j", self.B, V), -(U * U).reshape(self.T, self.nH, self.nH).sum(axis=1)


def _max_mu2(models: list[_TermModel], s2: float, w: np.ndarray) -> float:
    return max(float(m.mu2_and_gradient(s2, w)[0].max()) for m in models)


def _scale_to(models: list[_TermModel], s2: float, w: np.ndarray, mu2: float) -> float:
    lo, hi = 0.0, 1.0
    while _max_mu2(models, s2, hi * w) > mu2:
        lo, hi = hi, hi * 2
    while hi - lo > 1e-5 * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _max_mu2(models, s2, mid * w) > mu2 else (lo, mid)
    return hi


def optimize_terms(models: list[_TermModel], s2: float, mu2: float, w0: np.ndarray, iterations: int = 80) -> np.ndarray:
    """min q.w s.t. mu_j^2(w) <= mu2 for every party of every run (Kelley's cutting planes: each LP is a lower
    bound; the best scaled-feasible iterate is kept)."""
    T = w0.size
    q = np.mean([m.q for m in models], axis=0)
    cuts, rhs = [], []
    w, best = w0.copy(), None
    for _ in range(iterations):
        for m in models:
            mu2_j, grad = m.mu2_and_gradient(s2, w)
            for j in np.argsort(-mu2_j)[:3]:
                if mu2_j[j] > 0.98 * mu2:
                    cuts.append(grad[:, j])
                    rhs.append(mu2 - mu2_j[j] + grad[:, j] @ w)
        feasible = _scale_to(models, s2, w, mu2) * w
        if best is None or q @ feasible < q @ best:
            best = feasible
        lp = linprog(q, A_ub=np.array(cuts), b_ub=np.array(rhs), bounds=[(0, 50 * w0.max())] * T, method="highs")
        if lp.status != 0 or q @ best <= 1.002 * (q @ lp.x):
            break
        w = lp.x + 1e-9 * w0.max()
    return best


def section_perterm(args: argparse.Namespace) -> None:
    n, T, k, gamma, eps = args.parties[0], args.iterations[0], args.neighbors[0], args.gammas[0], args.epsilons[0]
    mu = mu_for_epsilon(eps, DELTA)
    for tail in args.tails:
        base = InjectionSchedule.incremental(T, tail=tail)
        config = IncaConfig(sigma_star=1.0, sigma_delta=1.0, iterations=T, neighbors=k, schedule=base,
                            dropout=PermanentDropout(gamma))
        models = []
        for ts, vs in simulation_seeds(args.seed + 1000, args.train_runs):
            trace = sample_trace(n, config, int(ts))
            models.append(_TermModel(trace, random_collusion(trace, RHO, int(vs))))
        s2 = 1.0 / ((1 - RHO) * (n - round(gamma * n)) * mu**2)  # alpha = 1 at about the honest finalists
        start = time.perf_counter()
        flat = _scale_to(models, s2, np.ones(T), mu**2) * np.ones(T)
        best = optimize_terms(models, s2, mu**2, flat)
        q = np.mean([m.q for m in models], axis=0)
        scales = np.sqrt(best / best[: T - 1].mean())
        print(f"## Per-term sigma_delta_t on {base.name} against the worst of {args.train_runs} training runs "
              f"(n = {n}, T = {T}, k = {k}, gamma = {gamma}, eps = {eps}; {time.perf_counter() - start:.0f} s)")
        print(f"  training runs: uncancelled variance flat {q @ flat:.5f}, optimized {q @ best:.5f} "
              f"(x{(q @ best) / (q @ flat):.2f})")
        print(f"  optimized scales s_t (terms 1..T, mean of 1..T-1 = 1): {' '.join(f'{v:.2f}' for v in scales)}")
        for name, schedule in (("flat", base), ("per-term", scaled_schedule(T, scales, tail))):
            out = predicted(schedule, n, T, k, gamma, eps, args.runs, args.seed)
            print(f"  fresh {args.runs} runs, {name:8s}: sigma_delta {out['sigma_delta']:.3f}, MSE {out['mse']:.5f}",
                  flush=True)


# ---------------------------------------------------------------------------------------------- families
def _ratios(make, n: int, T: int, k: int, gamma: float, eps: float, runs: int, seeds: list[int],
            baseline: dict[int, float]) -> tuple[list[float], list[dict[str, float]]]:
    outs = [predicted(make(), n, T, k, gamma, eps, runs, s) for s in seeds]
    return [o["mse"] / baseline[s] for o, s in zip(outs, seeds)], outs


def _cells(args: argparse.Namespace, last) -> itertools.product:
    """Every (n, T, k, gamma, x) of the command line's grid, x from ``last`` (the epsilons or the tails)."""
    return itertools.product(args.parties, args.iterations, args.neighbors, args.gammas, last)


def _fmt(ratios: list[float]) -> str:
    return f"x{statistics.fmean(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}]"


def section_families(args: argparse.Namespace) -> None:
    seeds = [args.seed + r for r in range(args.replicates)]
    for n, T, k, gamma, eps in _cells(args, args.epsilons):
        start = time.perf_counter()
        base = {s: predicted("incremental", n, T, k, gamma, eps, args.runs, s) for s in seeds}
        mse0 = {s: base[s]["mse"] for s in seeds}
        print(f"## n = {n}, T = {T}, k = {k}, gamma = {gamma}, eps = {eps}, {args.runs} runs x "
              f"{len(seeds)} seeds: D_Inc MSE {statistics.fmean(mse0.values()):.5f}, sigma_delta "
              f"{statistics.fmean(b['sigma_delta'] for b in base.values()):.3f}")
        print("  MSE / D_Inc's on the same runs: mean [min, max] over seeds")
        candidates = [(f"tail L={L}", lambda L=L: InjectionSchedule.incremental(T, tail=L))
                      for L in args.tails if L > 0]
        ar1_tail = f" + tail L={args.ar1_tail}" if args.ar1_tail else ""
        candidates += [(f"AR(1) phi={p}{ar1_tail}", lambda p=p: ar1_schedule(T, p, args.ar1_tail))
                       for p in args.phis]
        candidates += [(f"last term x{b}", lambda b=b: scaled_schedule(T, np.r_[np.ones(T - 1), b]))
                       for b in args.last_scales]
        for label, make in candidates:
            ratios, outs = _ratios(make, n, T, k, gamma, eps, args.runs, seeds, mse0)
            sd = statistics.fmean(o["sigma_delta"] for o in outs)
            print(f"  {label:26s} {_fmt(ratios)}  (sigma_delta {sd:.3f})", flush=True)
        print(f"  ({time.perf_counter() - start:.0f} s)")


# ---------------------------------------------------------------------------------------------- tails
def section_tails(args: argparse.Namespace) -> None:
    seeds = [args.seed + r for r in range(args.replicates)]
    header = "   n   T  k  gamma   eps   D_Inc MSE  " + "  ".join(f"{'L=' + str(L):>20s}" for L in args.tails if L)
    print(f"## Value-free tail L vs D_Inc: MSE ratio on the same runs, mean [min, max] over {len(seeds)} seeds of "
          f"{args.runs} runs")
    print(header)
    for n, T, k, gamma, eps in _cells(args, args.epsilons):
        mse0 = {s: predicted("incremental", n, T, k, gamma, eps, args.runs, s)["mse"] for s in seeds}
        cells = []
        for L in args.tails:
            if L == 0 or L > T:
                continue
            ratios, _ = _ratios(lambda L=L: InjectionSchedule.incremental(T, tail=L), n, T, k, gamma,
                                eps, args.runs, seeds, mse0)
            cells.append(f"{_fmt(ratios):>20s}")
        print(f"{n:4d} {T:3d} {k:2d} {gamma:6.2f} {eps:5.2f}  {statistics.fmean(mse0.values()):10.5f}  "
              + "  ".join(cells), flush=True)


# ---------------------------------------------------------------------------------------------- stability
def _checkpoints(runs: int) -> list[int]:
    return [r for r in (25, 50, 100, 200, 400, 800, 1600, 3200) if r < runs] + [runs]


def gopa_stability(args: argparse.Namespace) -> None:
    """GOPA (gamma_2 = 1/n) on R nested runs: the frontier's exact calibration (alpha chosen) on the first R
    runs, its sigma_delta and predicted MSE against those on all of them."""
    checkpoints = _checkpoints(args.runs)
    eps = args.epsilons[0]
    print(f"## GOPA, gamma_2 = 1/n: worst case over R runs relative to R = {args.runs}; eps = {eps}")
    print("   n  k_PR  gamma  quantity              " + "  ".join(f"R={r:<5d}" for r in checkpoints) + "   seconds")
    for n, k_pr, gamma in itertools.product(args.parties, args.gopa, args.gammas):
        start = time.perf_counter()
        gopa = GOPA(1.0, 1.0, neighbors=min(k_pr, n - 1), gamma=gamma, gamma_rollback=min(gamma, 1.0 / n))
        samples = sample_views(gopa, n, Threat.collusion(RHO), args.runs, args.seed)
        # not IncA's need at alpha = 1: GOPA's roll-back leaves no sigma_delta sufficient there
        cals = [calibrate_samples(samples[:r], eps, DELTA, procedure="exact", value_variance=1.0 / 12.0)
                for r in checkpoints]
        rows = {"calibrated sigma_d": [c.sigma_delta / cals[-1].sigma_delta for c in cals],
                "calibrated MSE": [c.predicted_mse / cals[-1].predicted_mse for c in cals]}
        for name, cells in rows.items():
            print(f"{n:4d}  {k_pr:4d}  {gamma:5.2f}  {name:20s}  " + "  ".join(f"{c:7.3f}" for c in cells)
                  + (f"   (sigma_delta {cals[-1].sigma_delta:.3f}, alpha {cals[-1].alpha:.2f}, MSE "
                     f"{cals[-1].predicted_mse:.3e} at R = {args.runs}; {time.perf_counter() - start:.0f})"
                     if name == "calibrated MSE" else ""), flush=True)


def section_stability(args: argparse.Namespace) -> None:
    if args.gopa:
        gopa_stability(args)
        return
    checkpoints = _checkpoints(args.runs)
    print(f"## Worst case over R runs: sigma_delta (running max of each run's need at alpha = 1, 1.1 without "
          f"dropouts), relative to R = {args.runs}; eps = {args.epsilons[0]}")
    print("   n   T  k  gamma  schedule              " + "  ".join(f"R={r:<5d}" for r in checkpoints) + "   seconds")
    per_run_lines = []
    for n, T, k, gamma, tail in _cells(args, args.tails):
        start = time.perf_counter()
        schedule = InjectionSchedule.incremental(T, tail=tail)
        config = IncaConfig(sigma_star=1.0, sigma_delta=1.0, iterations=T, neighbors=k,
                            schedule=schedule, dropout=PermanentDropout(gamma) if gamma else None)
        mu = mu_for_epsilon(args.epsilons[0], DELTA)
        profiles, finalists = [], []
        for ts, vs in simulation_seeds(args.seed, args.runs):
            trace = sample_trace(n, config, int(ts))
            view = random_collusion(trace, RHO, int(vs))
            profiles.append(profile(trace, view))
            finalists.append(np.isin(view.honest, trace.finalists()).sum())
        # alpha = 1 is below the floor without dropouts (no sigma_delta suffices there)
        alpha = 1.0 if gamma > 0 else 1.1
        s_star = math.sqrt(alpha / (np.mean(finalists) * mu**2))
        per_run = np.array([p.min_sigma_delta(s_star, mu) for p in profiles])
        need = np.maximum.accumulate(per_run)
        cells = [need[r - 1] / need[-1] for r in checkpoints]
        print(f"{n:4d} {T:3d} {k:2d} {gamma:6.2f}  {schedule.name:20s}  "
              + "  ".join(f"{c:7.3f}" for c in cells)
              + f"   (sigma_delta {need[-1]:.3f} at R = {args.runs}; {time.perf_counter() - start:.0f})",
              flush=True)
        per_run_lines.append(f"{n:4d} {T:3d} {k:2d} {gamma:6.2f}  {schedule.name:20s}  "
                             + _distribution(per_run, need, checkpoints))
    print("\n## Each run's need (sigma_delta at the same sigma_star): quantiles over the runs, the largest, and "
          "how many of the later runs need more than the worst of the first R (a calibration on R runs leaves "
          "them uncertified at the target)")
    for line in per_run_lines:
        print(line)


def _distribution(per_run: np.ndarray, need: np.ndarray, checkpoints: list[int]) -> str:
    """Median, 90% and 99% quantiles and the 5 largest of each run's need (``need``: its running maximum);
    for each checkpoint R below the last, how many of the runs after the first R need more than the worst
    of the first R."""
    q50, q90, q99 = np.quantile(per_run, [0.5, 0.9, 0.99])
    top = np.sort(per_run)[::-1][:5]
    beyond = [f"R={r}: {int((per_run[r:] > need[r - 1]).sum())} of {per_run.size - r}"
              for r in checkpoints[:-1]]
    # what a calibration covering 99% of its R runs would take (calibrate's target_success = 0.99: the
    # covered_runs(0.99, R)-th smallest need), beside the worst case: is a quantile stable where the maximum
    # is not?
    covering = [f"R={r}: {np.sort(per_run[:r])[covered_runs(0.99, r) - 1]:.3f}" for r in checkpoints]
    return (f"median {q50:.3f}, 90% {q90:.3f}, 99% {q99:.3f}; largest {', '.join(f'{v:.3f}' for v in top)}; "
            f"later runs above the first R's worst: {'; '.join(beyond)}; "
            f"covering 99% of the first R: {'; '.join(covering)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("section", choices=["decompose", "anatomy", "perterm", "families", "tails", "stability"])
    parser.add_argument("--parties", type=int, nargs="+", default=[200])
    parser.add_argument("--iterations", type=int, nargs="+", default=[10])
    parser.add_argument("--neighbors", type=int, nargs="+", default=[1])
    parser.add_argument("--gammas", type=float, nargs="+", default=[0.1])
    parser.add_argument("--epsilons", type=float, nargs="+", default=[0.5])
    parser.add_argument("--tails", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--phis", type=float, nargs="*", default=[0.3, 0.5])
    parser.add_argument("--ar1-tail", type=int, default=0, help="families: the value-free tail of the AR(1) candidates")
    parser.add_argument("--last-scales", type=float, nargs="*", default=[3.0])
    parser.add_argument("--runs", type=int, default=100, help="calibration runs per schedule and seed")
    parser.add_argument("--train-runs", type=int, default=40, help="perterm: runs the LP is trained on")
    parser.add_argument("--replicates", type=int, default=3, help="independent seeds per setting")
    parser.add_argument("--top", type=int, default=20, help="anatomy: parties listed")
    parser.add_argument("--gopa", type=int, nargs="*", default=[],
                        help="stability: GOPA with these k_PR (gamma_2 = 1/n) instead of IncA")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    start = time.perf_counter()
    {"decompose": section_decompose, "anatomy": section_anatomy, "perterm": section_perterm,
     "families": section_families, "tails": section_tails, "stability": section_stability}[args.section](args)
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()

"""Privacy accountant speed, against a dense pseudo-inverse baseline in the same run.

Setting of the paper's Fig. 3: k = 1, T = 20, collusion rho = 0.1, permanent dropouts gamma = 0.1.

* certificate: exact mu of every honest party for one execution at given sigmas;
* calibration of one run: the smallest sigma_delta meeting a target mu for a given sigma_star;
* baseline: the textbook computation, ``mu_i = ||M^+ h_i||`` with ``M = [s* B_V, s_D A_V]`` formed
  explicitly over all observed rows (corrupted parties' included) and ``np.linalg.pinv``; its
  calibration bisects sigma_delta with one pseudo-inverse per step.
* the paper's 1000-run calibration end to end (``--full``).

    python benchmarks/bench_accountant.py              # n = 200 (with baseline) and n = 1000
    python benchmarks/bench_accountant.py --full       # + calibrate(runs=1000) at n = 200
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from flwr_inca import IncaConfig, PermanentDropout
from flwr_inca.privacy import calibrate, certify, profile, random_collusion
from flwr_inca.privacy.linear_system import dense_system
from flwr_inca.protocol import sample_trace

S_STAR, S_DELTA, MU_TARGET = 1.0, 6.0, 0.0625


def baseline_matrices(trace, view):
    """B_V, A_V over all observed rows, corrupted rows included (no structure exploited)."""
    from flwr_inca.privacy.views import AdversaryView

    # honest_observed drops corrupted rows; keep them to mirror the textbook construction
    full = AdversaryView(view.threat, np.zeros(0, dtype=np.int64), view.observed)
    B_all, A_all, rows = dense_system(trace, full)
    honest = view.honest
    T = trace.iterations
    cols_a = (np.arange(T)[:, None] * trace.parties + honest[None, :]).reshape(-1)
    return B_all[:, honest], A_all[:, cols_a]


def baseline_mu(B, A, s_star, s_delta):
    M = np.hstack([s_star * B, s_delta * A])
    # corrupted parties' rows are exact combinations of others: cut the rank at 1e-12, not NumPy's
    # default 1e-15, which keeps rounding-level singular values and corrupts the result
    return np.linalg.norm(np.linalg.pinv(M, rcond=1e-12) @ B, axis=0)


def baseline_calibrate(B, A, s_star, target, steps=25):
    lo, hi = 0.0, 1.0
    while baseline_mu(B, A, s_star, hi).max() > target:
        lo, hi = hi, 4 * hi
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if baseline_mu(B, A, s_star, mid).max() > target else (lo, mid)
    return hi


def timed(fn, repeats):
    best, out = math.inf, None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, nargs="+", default=[200, 1000])
    p.add_argument("--baseline-max-n", type=int, default=200, help="run the dense baseline up to this n")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--full", action="store_true", help="also time calibrate(runs=1000) at n = 200")
    args = p.parse_args()
    print("k = 1, T = 20, rho = 0.1, gamma = 0.1; best of", args.repeats, "\n")
    header = (f"{'n':>5} {'rows m':>7} {'certificate s':>14} {'calib. 1 run s':>15} {'baseline cert s':>16} "
              f"{'baseline calib s':>17} {'max|diff|/max mu':>16}")
    print(header)
    print("-" * len(header))
    for n in args.n:
        config = IncaConfig(iterations=20, neighbors=1, sigma_star=S_STAR, sigma_delta=S_DELTA,
                            dropout=PermanentDropout(0.1))
        trace = sample_trace(n, config, seed=1)
        view = random_collusion(trace, 0.1, seed=2)
        t_cert, cert = timed(lambda: certify(trace, view), args.repeats)
        t_cal, s_need = timed(lambda: profile(trace, view).min_sigma_delta(S_STAR, MU_TARGET), args.repeats)
        rows = int(view.honest_observed().sum())
        if n <= args.baseline_max_n:
            B, A = baseline_matrices(trace, view)
            t_base, mu_base = timed(lambda: baseline_mu(B, A, S_STAR, S_DELTA), 1)
            t_base_cal, s_base = timed(lambda: baseline_calibrate(B, A, S_STAR, MU_TARGET), 1)
            ours = np.array([cert.mu[i] for i in view.honest])
            diff = np.max(np.abs(ours - mu_base)) / mu_base.max()
            base = f"{t_base:>16.3f} {t_base_cal:>17.3f} {diff:>16.1e}"
            extra = f"   (sigma_delta needed: ours {s_need:.5g}, baseline {s_base:.5g})"
        else:
            base, extra = f"{'-':>16} {'-':>17} {'-':>16}", ""
        print(f"{n:>5} {rows:>7} {t_cert:>14.3f} {t_cal:>15.3f} {base}{extra}", flush=True)
    if args.full:
        start = time.perf_counter()
        cal = calibrate(0.2, 1e-5, 200, iterations=20, neighbors=1, collusion=0.1,
                        dropout=PermanentDropout(0.1), runs=1000, procedure="paper", seed=0)
        print(f"\ncalibrate(procedure='paper', runs=1000, n=200): {time.perf_counter() - start:.1f} s "
              f"(sigma_star {cal.sigma_star:.4g}, sigma_delta {cal.sigma_delta:.4g}, "
              f"success {cal.success_fraction:.3f})")


if __name__ == "__main__":
    main()

"""mu-GDP <-> (epsilon, delta) conversions: bisection on the safe side vs the former root-finding plus
stepping one float at a time to the safe side, side by side in one process.

The former ``epsilon_for_delta`` solved with Brent's method and then stepped ``nextafter`` until
``delta(epsilon) <= delta`` held; where ``delta(epsilon)`` is flat to rounding (small mu) that took
millions of steps. Both are timed on the same cases (minimum of interleaved repeats), with the number of
``delta(epsilon)`` evaluations, and the answers are compared.

    python benchmarks/bench_conversions.py
"""

from __future__ import annotations

import math
import time

import numpy as np
from scipy.optimize import brentq

from flwr_inca.privacy import conversions

CASES = [(1e-4, 1e-5), (1e-3, 1e-5), (0.05, 1e-5), (1.0, 1e-5), (20.0, 1e-10)]


def former_epsilon_for_delta(mu: float, delta: float, counter: list[int]) -> float:
    """The implementation before bisection (flwr_inca 0.1), counting evaluations."""
    log_target = math.log(delta)

    def f(e: float) -> float:
        counter[0] += 1
        return conversions._log_delta(mu, e) - log_target

    if f(0.0) <= 0:
        return 0.0
    hi = max(1.0, mu * mu / 2 + 10 * mu)
    while f(hi) > 0:
        hi *= 2
    eps = float(brentq(f, 0.0, hi, xtol=1e-13, rtol=1e-13))
    while f(eps) > 0:
        eps = float(np.nextafter(eps, math.inf))
    return eps


def timed(fn, repeats: int = 3) -> tuple[float, float]:
    best, value = math.inf, math.nan
    for _ in range(repeats):
        start = time.perf_counter()
        value = fn()
        best = min(best, time.perf_counter() - start)
    return best, value


def main() -> None:
    original = conversions._log_delta
    print(f"{'mu':>8} {'delta':>8} {'former s':>10} {'evals':>9} {'bisection s':>12} {'evals':>6} "
          f"{'speed-up':>9} {'rel. diff':>10}")
    for mu, delta in CASES:
        former_count = [0]
        t_old, old = timed(lambda: former_epsilon_for_delta(mu, delta, former_count), repeats=1)
        new_count = [0]

        def counting(m: float, e: float) -> float:
            new_count[0] += 1
            return original(m, e)

        conversions._log_delta = counting
        try:
            t_new, new = timed(lambda: conversions.epsilon_for_delta(mu, delta), repeats=5)
        finally:
            conversions._log_delta = original
        print(f"{mu:>8g} {delta:>8g} {t_old:>10.4g} {former_count[0]:>9d} {t_new:>12.3g} "
              f"{new_count[0] // 5:>6d} {t_old / t_new:>8.0f}x {abs(new - old) / old:>10.2g}")


if __name__ == "__main__":
    main()

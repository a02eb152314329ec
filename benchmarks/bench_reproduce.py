"""How long ``flwr-inca reproduce`` takes, and what limiting BLAS to one thread buys.

* ``--calibration``: the worst case over R simulated views, found by a running maximum (one evaluation
  of mu per view, bisecting only the views that need more noise: ``calibrate_samples``) against
  bisecting every view (what ``privacy.calibrate`` does), on the same views, alternating.
* ``--figures``: times each figure at the given run count (default: its default), as the command does
  (CSV, PNG and table written to a temporary directory).
* ``--blas``: the certificates behind every calibration factor many small matrices (a few hundred
  rows). Side by side in one process, alternating, it times simulated IncA views (n = 200, k = 1,
  T = 20, 10% colluders, 10% dropouts: the views of Fig. 3) with BLAS limited to one thread (what
  ``reproduce`` does) and with the default thread count.

    python benchmarks/bench_reproduce.py --blas
    python benchmarks/bench_reproduce.py --figures fig3b --runs 1000
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import subprocess
import tempfile
import time

from threadpoolctl import threadpool_info, threadpool_limits

from flwr_inca.baselines import IncaBaseline, Threat, calibrate_samples, sample_views
from flwr_inca.protocol import IncaConfig, PermanentDropout
from flwr_inca.reproduce import DEFAULT_RUNS, reproduce


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    except OSError:  # pragma: no cover
        return "uptime unavailable"


def bench_blas(repeats: int, runs: int) -> None:
    inca = IncaBaseline(IncaConfig(sigma_star=1.0, sigma_delta=1.0, iterations=20, neighbors=1,
                                   dropout=PermanentDropout(0.1)))
    threads = max(p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas")
    times: dict[str, list[float]] = {"1 thread": [], f"{threads} threads (default)": []}
    for rep in range(repeats):
        for label in (list(times) if rep % 2 == 0 else list(times)[::-1]):
            limit = 1 if label == "1 thread" else None
            with threadpool_limits(limits=limit, user_api="blas"):
                start = time.perf_counter()
                sample_views(inca, 200, Threat.collusion(0.1), runs, seed=rep)
                times[label].append((time.perf_counter() - start) / runs)
    print(f"IncA views, n = 200, k = 1, T = 20, rho = 0.1, gamma = 0.1: {runs} views x {repeats} repeats, "
          "alternating; seconds per view (median, min, max)")
    for label, ts in times.items():
        print(f"  {label:<22} {statistics.median(ts):.4f}  {min(ts):.4f}  {max(ts):.4f}")
    a, b = (statistics.median(ts) for ts in times.values())
    print(f"  default / 1 thread: {b / a:.2f}x")


def bench_calibration(repeats: int, runs: int) -> None:
    inca = IncaBaseline(IncaConfig(sigma_star=1.0, sigma_delta=1.0, iterations=20, neighbors=1,
                                   dropout=PermanentDropout(0.1)))
    with threadpool_limits(limits=1, user_api="blas"):
        samples = sample_views(inca, 200, Threat.collusion(0.1), runs, seed=0)
        ref = calibrate_samples(samples, 0.2, 1e-5)  # the alphas and the target, untimed
        alphas = [row["alpha"] for row in ref.alternatives]
        s_stars = [row["sigma_star"] for row in ref.alternatives]

        def running_maximum() -> list[float]:
            return [r["sigma_delta"] for r in calibrate_samples(samples, 0.2, 1e-5, alphas=alphas).alternatives]

        def bisect_every_view() -> list[float]:
            return [max(s.profile.min_sigma_delta(s_star, ref.mu_target) for s in samples) for s_star in s_stars]

        funcs = {"running maximum": running_maximum, "bisect every view": bisect_every_view}
        times: dict[str, list[float]] = {k: [] for k in funcs}
        out: dict[str, list[float]] = {}
        for rep in range(repeats):
            for label in (list(funcs) if rep % 2 == 0 else list(funcs)[::-1]):
                start = time.perf_counter()
                out[label] = funcs[label]()
                times[label].append(time.perf_counter() - start)
    print(f"exact calibration of {runs} IncA views (n = 200, T = 20, rho = gamma = 0.1), {len(alphas)} alphas, "
          f"{repeats} repeats alternating; seconds (median, min, max)")
    for label, ts in times.items():
        print(f"  {label:<18} {statistics.median(ts):.3f}  {min(ts):.3f}  {max(ts):.3f}")
    a, b = (statistics.median(ts) for ts in times.values())
    diff = max(abs(x - y) / y for x, y in zip(out["running maximum"], out["bisect every view"]))
    print(f"  bisect every view / running maximum: {b / a:.1f}x; largest relative difference in sigma_delta: "
          f"{diff:.1e}")


def bench_figures(figures: list[str], runs: int | None) -> None:
    print(f"{'figure':<7} {'runs':>5} {'seconds':>8}")
    with tempfile.TemporaryDirectory() as out:
        for name in figures:
            n = runs if runs is not None else DEFAULT_RUNS[name]
            start = time.perf_counter()
            reproduce([name], runs=n, out=out, progress=False, stream=io.StringIO())
            print(f"{name:<7} {n:>5} {time.perf_counter() - start:>8.1f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--figures", nargs="*", choices=list(DEFAULT_RUNS), default=None)
    p.add_argument("--runs", type=int, default=None)
    p.add_argument("--blas", action="store_true")
    p.add_argument("--calibration", action="store_true")
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--views", type=int, default=20, help="views per timing (--blas)")
    args = p.parse_args()
    if args.runs is not None and args.runs < 1:
        p.error("--runs must be >= 1")
    print(f"before: {uptime()}  (pid {os.getpid()})")
    if args.blas:
        bench_blas(args.repeats, args.views)
    if args.calibration:
        bench_calibration(max(args.repeats // 2, 1), 10 * args.views)
    if args.figures is not None:
        bench_figures(args.figures or list(DEFAULT_RUNS), args.runs)
    print(f"after:  {uptime()}")


if __name__ == "__main__":
    main()

"""IncA engine vs its floor, side by side in one process.

One IncA run (D_Inc, k = 1, T = 20, float32, d = 7850: MNIST logistic regression) for each n, next to
the floor: the same number of Gaussian draws ((T+1) n d) and (k+2) T passes ``a += b`` over an (n, d)
array. Repeats are interleaved and the minimum is kept (shared, noisy machines). Also reports the
peak memory of the run (tracemalloc) in units of one (n, d) array.

    python benchmarks/bench_engine.py            # n in 100, 1000, 10000
    python benchmarks/bench_engine.py --n 100 1000 --repeats 2
"""

from __future__ import annotations

import argparse
import platform
import time
import tracemalloc

import numpy as np

from flwr_inca import IncaConfig, run_inca


def floor(n: int, d: int, T: int, k: int, rng: np.random.Generator) -> float:
    a = np.empty((n, d), dtype=np.float32)
    b = np.zeros((n, d), dtype=np.float32)
    start = time.perf_counter()
    for _ in range(T + 1):
        rng.standard_normal((n, d), dtype=np.float32, out=a)
    for _ in range((k + 2) * T):
        b += a
    return time.perf_counter() - start


def inca(x: np.ndarray, T: int, k: int) -> float:
    config = IncaConfig(iterations=T, neighbors=k, sigma_star=0.1, sigma_delta=1.0)
    start = time.perf_counter()
    run_inca(x, config, seed=0)
    return time.perf_counter() - start


def peak_memory(x: np.ndarray, T: int, k: int) -> float:
    tracemalloc.start()
    run_inca(x, IncaConfig(iterations=T, neighbors=k, sigma_star=0.1, sigma_delta=1.0), seed=0)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak / x.nbytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, nargs="+", default=[100, 1000, 10000])
    p.add_argument("--d", type=int, default=7850)
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--neighbors", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    T, k, d = args.iterations, args.neighbors, args.d
    print(f"machine: {platform.processor() or platform.machine()}, numpy {np.__version__}")
    print(f"d = {d}, T = {T}, k = {k}, float32, best of {args.repeats} interleaved repeats\n")
    header = f"{'n':>6} {'IncA s':>9} {'floor s':>9} {'ratio':>6} {'IncA ns/(n d T)':>16} {'peak mem (n,d)':>15}"
    print(header)
    print("-" * len(header))
    rng = np.random.default_rng(0)
    for n in args.n:
        x = rng.random((n, d), dtype=np.float32)
        t_inca, t_floor = [], []
        for _ in range(args.repeats):
            t_inca.append(inca(x, T, k))
            t_floor.append(floor(n, d, T, k, rng))
        ti, tf = min(t_inca), min(t_floor)
        mem = peak_memory(x, T, k) if n * d <= 2e7 else float("nan")
        print(f"{n:>6} {ti:>9.3f} {tf:>9.3f} {ti / tf:>6.2f} {ti / (n * d * T) * 1e9:>16.3f} {mem:>15.1f}",
              flush=True)


if __name__ == "__main__":
    main()

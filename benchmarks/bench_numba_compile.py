"""What the cascade's compiled local tier costs on its first call in a fresh environment.

numba compiles the kernels of ``flwr_inca/privacy/local_compiled.py`` on their first call and caches the
machine code on disk. This runs the same small cascade certificate (200 parties, T = 10, 10% dropouts and
colluders) in fresh processes sharing one empty numba cache directory: the first process compiles, the
next ones load the cache. Each prints its first and second certificate's time.

    python benchmarks/bench_numba_compile.py               # 2 processes
    python benchmarks/bench_numba_compile.py --processes 3
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

CHILD = """
import time
from flwr_inca import IncaConfig, PermanentDropout
from flwr_inca.privacy import certify, random_collusion
from flwr_inca.privacy.local_compiled import available
from flwr_inca.protocol import sample_trace

assert available(), "numba is not installed: pip install 'flwr-inca[scale]'"
trace = sample_trace(200, IncaConfig(iterations=10, sigma_star=1.0, sigma_delta=6.0,
                                     dropout=PermanentDropout(0.1)), seed=1)
view = random_collusion(trace, 0.1, seed=2)
times = []
for _ in range(2):
    start = time.perf_counter()
    certify(trace, view, solver="cascade")
    times.append(time.perf_counter() - start)
print(f"{times[0]:.2f} {times[1]:.2f}")
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--processes", type=int, default=2, help="fresh processes in a row (>= 1)")
    args = p.parse_args(argv)
    if args.processes < 1:
        p.error(f"--processes must be >= 1, got {args.processes}")
    with tempfile.TemporaryDirectory(prefix="numba-cache-") as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
                   MKL_NUM_THREADS="1")
        print(f"{'process':<8} {'first certificate (s)':>22} {'second (s)':>11}")
        for i in range(args.processes):
            out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True)
            if out.returncode != 0:
                print(out.stderr.strip().splitlines()[-1], file=sys.stderr)
                return 1
            first, second = out.stdout.split()
            print(f"{i + 1:<8} {first:>22} {second:>11}" + ("  (compiles)" if i == 0 else "  (cache on disk)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

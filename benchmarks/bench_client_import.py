"""What a ClientApp process pays to load flwr_inca's client side, next to Flower's own import.

Flower's deployment engine starts a ClientApp process for every message a node receives, so every mixing
iteration of every node pays the import of the app. This times fresh interpreters, interleaved so that a
change in the machine's load hits every variant alike:

* ``flower``: ``import flwr.clientapp`` (the floor: Flower itself);
* ``client``: that and ``from flwr_inca.flower import IncaClient`` (what an IncA ClientApp loads);
* ``client+scipy``: the same and ``import scipy.sparse`` (what the client side cost while the protocol
  loaded SciPy's sparse matrices at import).

It prints each variant's median wall time, the client side's share over Flower's, and the heavy packages
the client side loaded (none expected).

    python benchmarks/bench_client_import.py              # 10 interpreters per variant
    python benchmarks/bench_client_import.py --repeats 30
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

VARIANTS = {
    "flower": "import flwr.clientapp",
    "client": "import flwr.clientapp; from flwr_inca.flower import IncaClient",
    "client+scipy": "import flwr.clientapp; from flwr_inca.flower import IncaClient; import scipy.sparse",
}
HEAVY = ("scipy", "torch", "opacus", "ray", "flwr_inca.privacy")


def _time(code: str, env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=10, help="fresh interpreters per variant (>= 1)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    loaded = subprocess.run(
        [sys.executable, "-c", VARIANTS["client"] + "; import sys; print(' '.join(sorted({m for m in sys.modules "
         f"if m.startswith({HEAVY!r})}})))"], check=True, env=env, capture_output=True, text=True).stdout.split()
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for r in range(args.repeats):
        for name, code in VARIANTS.items():
            times[name].append(_time(code, env))
        print(f"\rrepeat {r + 1}/{args.repeats}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"{'variant':<14} {'median (s)':>10} {'min (s)':>8} {'max (s)':>8}")
    for name, t in times.items():
        print(f"{name:<14} {median[name]:>10.3f} {min(t):>8.3f} {max(t):>8.3f}")
    print(f"flwr_inca's client side adds {median['client'] - median['flower']:.3f} s to Flower's "
          f"{median['flower']:.3f} s; SciPy's sparse matrices would add {median['client+scipy'] - median['client']:.3f} s")
    print(f"heavy packages the client side loaded: {', '.join(loaded) if loaded else 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

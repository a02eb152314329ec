"""What a fresh process pays to load flwr_inca's part of it, next to the framework it runs in.

``--side client`` (the default): Flower's deployment engine starts a ClientApp process for every message a
node receives, so every mixing iteration of every node pays the import of the app.

* ``flower``: ``import flwr.clientapp`` (the floor: Flower itself);
* ``client``: that and ``from flwr_inca.flower import IncaClient`` (what an IncA ClientApp loads);
* ``client+scipy``: the same and ``import scipy.sparse`` (what the client side cost while the protocol
  loaded SciPy's sparse matrices at import).

``--side actor``: the simulator's Ray backend starts one actor process per cohort (and a fresh one for an
actor that died); Ray imports the actor's class, ``flwr_inca.simulation.training.CohortTrainer``.

* ``torch``: ``import torch`` (the floor: the actor trains with it);
* ``actor``: ``import flwr_inca.simulation.training`` (what an actor loads);
* ``actor+runner``: the same and the runner, the mixers and the baselines' mixers (what an actor loaded
  while the package imported every module at its import).

``--side cli``: ``flwr-inca --help`` (and any command) first builds the command line's parsers.

* ``numpy``: ``import numpy`` (the floor: the core needs it);
* ``cli``: ``import flwr_inca.cli`` and ``build_parser()`` (what ``flwr-inca --help`` loads);
* ``cli+solvers``: the same and the certificate's solvers, the attack audit and every figure's module (what
  building the parsers loaded while they imported those for the solvers' names and limits and the default
  run counts).

Fresh interpreters, interleaved so that a change in the machine's load hits every variant alike. It prints
each variant's median wall time, the difference to the floor, and the heavy packages the measured variant
loaded.

    python benchmarks/bench_client_import.py              # 10 interpreters per variant
    python benchmarks/bench_client_import.py --side actor --repeats 10
    python benchmarks/bench_client_import.py --side cli --repeats 10
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

SIDES = {
    "client": {
        "flower": "import flwr.clientapp",
        "client": "import flwr.clientapp; from flwr_inca.flower import IncaClient",
        "client+scipy": "import flwr.clientapp; from flwr_inca.flower import IncaClient; import scipy.sparse",
    },
    "actor": {
        "torch": "import torch",
        "actor": "import flwr_inca.simulation.training",
        "actor+runner": "import flwr_inca.simulation.training, flwr_inca.simulation.runner, "
                        "flwr_inca.simulation.baseline_mixers",
    },
    "cli": {
        "numpy": "import numpy",
        "cli": "import flwr_inca.cli as cli; cli.build_parser()",
        "cli+solvers": "import flwr_inca.cli as cli; cli.build_parser(); import flwr_inca.privacy.certificate, "
                       "flwr_inca.privacy.attack.audit, flwr_inca.reproduce.fig1, flwr_inca.reproduce.fig2, "
                       "flwr_inca.reproduce.fig3, flwr_inca.reproduce.fig5, flwr_inca.reproduce.frontier",
    },
}
HEAVY = ("scipy", "torch", "opacus", "ray", "numba", "flwr_inca.privacy", "flwr_inca.baselines",
         "flwr_inca.privacy.certificate", "flwr_inca.reproduce.fig1")


def _time(code: str, env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--side", choices=sorted(SIDES), default="client", help="which process to time")
    p.add_argument("--repeats", type=int, default=10, help="fresh interpreters per variant (>= 1)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    variants = SIDES[args.side]
    floor, measured, before = variants
    loaded = subprocess.run(
        [sys.executable, "-c", variants[measured] + "; import sys; print(' '.join(sorted({m for m in sys.modules "
         f"if m in {HEAVY!r}}})))"], check=True, env=env,
        capture_output=True, text=True).stdout.split()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(args.repeats):
        for name, code in variants.items():
            times[name].append(_time(code, env))
        print(f"\rrepeat {r + 1}/{args.repeats}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"{'variant':<14} {'median (s)':>10} {'min (s)':>8} {'max (s)':>8}")
    for name, t in times.items():
        print(f"{name:<14} {median[name]:>10.3f} {min(t):>8.3f} {max(t):>8.3f}")
    print(f"{measured} adds {median[measured] - median[floor]:.3f} s to {floor}'s {median[floor]:.3f} s; "
          f"{before} adds {median[before] - median[floor]:.3f} s")
    print(f"heavy packages {measured} loaded: {', '.join(loaded) if loaded else 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

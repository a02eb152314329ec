"""Estimate the wall time of a study grid (default: the full grid) from measured runs.

    python benchmarks/estimate_study.py outputs/study-default/runs.csv outputs/study-n100/runs.csv \
        --certify 1000:SECONDS 100:SECONDS

Cost model, per method and n, from the runs that were executed (not reused) in the given runs.csv
files: seconds = a + b * rounds (least squares over that method's runs at that n; one run: b only);
test runs are assumed to use the largest tuned rounds (``--eval-rounds`` to change).
IncA's certificate, taken every ``certify_every`` rounds in the measured runs (the default grid's rule
for that n, ``StudyGrid.inca_settings``: every 10th round at n = 1000, every round at n <= 300), is taken
every round in the full grid: each extra certificate is charged ``--certify n:seconds`` (measure it with
``benchmarks/bench_simulation.py certify``). n without measurements is scaled linearly from the
nearest measured n (the per-round part b; training and mixing grow about linearly; an estimate).
IncA's calibrations are added once per study process (the study caches them): one per (n, gamma) for the
improved calibration (scale-free), one per (n, gamma, per-round target) for the paper's (per target; only where
its classic bound applies, a per-round epsilon < 1), each ``runs`` simulated executions
(``StudyGrid.inca_settings``) at ``--calibration-run n:seconds`` per execution (measured now if not given).
The measured IncA runs already include the calibrations their study made (in the first run of each), so the
estimate counts those twice: it errs high. The output is an *estimate*, not a measurement.
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flwr_inca.study import DEFAULT_GRID, FULL_GRID


def fit(rows: list[dict]) -> tuple[float, float]:
    r = np.array([float(x["rounds"]) for x in rows])
    s = np.array([float(x["seconds"]) for x in rows])
    if len(set(r)) < 2:
        return 0.0, float(np.mean(s / r))
    b, a = np.polyfit(r, s, 1)
    return max(a, 0.0), max(b, 0.0)


def measure_certify(n: int, grid, repeats: int = 2) -> float:
    """Median seconds of one exact certificate of a round like the study's (0.9 n participants,
    T, k, 10% permanent dropouts, 10% colluders)."""
    import time

    from flwr_inca.privacy import certify, random_collusion
    from flwr_inca.protocol import IncaConfig, PermanentDropout
    from flwr_inca.protocol.engine import sample_trace

    m = int(0.9 * n)
    config = IncaConfig(sigma_star=1.0, sigma_delta=10.0, iterations=grid.iterations, neighbors=grid.neighbors,
                        dropout=PermanentDropout(0.1))
    times = []
    for r in range(repeats):
        trace = sample_trace(m, config, r)
        start = time.perf_counter()
        certify(trace, random_collusion(trace, grid.collusion, [r, 1]))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def measure_calibration_run(n: int, grid, repeats: int = 3) -> float:
    """Seconds of one simulated execution of IncA's calibration at 0.9 n participants (gamma = 0.1)."""
    import time

    from flwr_inca.privacy.calibration import calibrate
    from flwr_inca.protocol import PermanentDropout

    start = time.perf_counter()
    calibrate(0.5, 1e-5, int(0.9 * n), iterations=grid.iterations, neighbors=grid.neighbors,
              collusion=grid.collusion, dropout=PermanentDropout(0.1), runs=repeats, seed=0)
    return (time.perf_counter() - start) / repeats


def calibrations(grid, eval_rounds: int) -> list[tuple[int, float, str]]:
    """(n, gamma, procedure) of every calibration one study process of ``grid`` makes (methods inca and
    inca-paper; the per-round target follows the total epsilon and the rounds, as in the study)."""
    from flwr_inca.privacy.conversions import epsilon_for_delta
    from flwr_inca.privacy.plan import privacy_plan

    out = []
    budgets = {(grid.tune_epsilon, grid.tune_gamma, r) for _, _, r in grid.tuning_settings()}
    budgets |= {(e, g, eval_rounds) for e, g in grid.points()}
    for n in grid.clients:
        if "inca" in grid.methods:
            out += [(n, g, "exact") for g in sorted({g for _, g, _ in budgets})]
        if "inca-paper" in grid.methods:
            targets = set()
            for e, g, r in budgets:
                plan = privacy_plan("record", epsilon=e, delta=grid.delta, rounds=r, clip_norm=1.0, lr=1.0,
                                    batch_size=grid.batch_size, local_size=(60000 - grid.validation) / n)
                if epsilon_for_delta(plan.mu_round / 1.005 * 0.99, grid.delta) < 1:  # else it is refused at once
                    targets.add((g, round(plan.mu_round, 12)))
            out += [(n, g, "paper") for g, _ in sorted(targets)]
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("runs", nargs="+", help="runs.csv files of executed studies")
    p.add_argument("--grid", choices=["full", "default"], default="full")
    p.add_argument("--certify", nargs="*", default=[], help="n:seconds of one exact IncA certificate")
    p.add_argument("--calibration-run", nargs="*", default=[],
                   help="n:seconds of one simulated execution of IncA's calibration at 0.9 n participants")
    p.add_argument("--measured-certify-every", type=int, default=None,
                   help="IncA certified every k rounds in the measured runs (default: the default grid's rule at "
                        "the measured n)")
    p.add_argument("--eval-rounds", type=int, default=None,
                   help="rounds of each test run (default: the largest tuned rounds, as the default study chose)")
    args = p.parse_args()
    grid = FULL_GRID if args.grid == "full" else DEFAULT_GRID
    certify = {int(k): float(v) for k, v in (c.split(":") for c in args.certify)}
    for n in grid.clients:
        if n not in certify:
            certify[n] = measure_certify(n, grid)
            print(f"one exact certificate, n = {n} (0.9 n participants, gamma = 0.1): {certify[n]:.2f} s (measured now)")
    calibration_run = {int(k): float(v) for k, v in (c.split(":") for c in args.calibration_run)}
    for n in grid.clients:
        if n not in calibration_run:
            calibration_run[n] = measure_calibration_run(n, grid)
            print(f"one calibration execution, n = {n} (0.9 n participants, gamma = 0.1): {calibration_run[n]:.2f} s "
                  "(measured now)")
    by = defaultdict(list)
    for path in args.runs:
        with open(path) as f:
            for row in csv.DictReader(f):
                if "the selected tuning run" in row["note"] or row["note"].startswith("not run"):
                    continue
                by[(row["method"], int(row["clients"]))].append(row)
    models = {key: fit(rows) for key, rows in by.items()}

    def cost(method: str, n: int, rounds: int) -> float:
        measured = sorted(m for (meth, m) in models if meth == method)
        near = min(measured, key=lambda m: abs(np.log(m / n)))
        a, b = models[(method, near)]
        seconds = a + b * rounds * n / near  # per-run overhead (privacy plan, set-up) does not scale with n
        every = grid.inca_settings(n)[2]
        measured_every = args.measured_certify_every or DEFAULT_GRID.inca_settings(near)[2]
        if method.startswith("inca") and every < measured_every:
            extra = rounds * (1 / every - 1 / measured_every)
            seconds += extra * certify.get(n, certify.get(near, 0.0) * (n / near) ** 2.5)
        return seconds

    settings = grid.tuning_settings()
    points = grid.points()
    total, parts = 0.0, defaultdict(float)
    eval_rounds = args.eval_rounds or max(r for _, _, r in settings)
    for n in grid.clients:
        for _ in grid.partitions:
            for method in grid.methods:
                for _, _, rounds in settings:
                    parts[f"tuning n={n}"] += cost(method, n, rounds)
                cells = len(points) * len(grid.seeds) if method != "fedavg" else len(grid.gammas) * len(grid.seeds)
                parts[f"evaluation n={n}"] += cells * cost(method, n, eval_rounds)
    made = calibrations(grid, eval_rounds)
    for n, _, _ in made:
        runs = grid.inca_settings(n)[0]
        # measured: 60 executions took 47 s at 700 participants and 49 s at 900 (not the certificate's growth)
        parts[f"calibration n={n}"] += runs * calibration_run[n]
    print(f"IncA calibrations: {len(made)} ({sum(1 for c in made if c[2] == 'exact')} improved, "
          f"{sum(1 for c in made if c[2] == 'paper')} paper's), of {', '.join(f'{grid.inca_settings(n)[0]} executions at n = {n}' for n in grid.clients)}")
    total = sum(parts.values())
    for k, v in parts.items():
        print(f"{k:<22} {v / 3600:8.1f} h")
    print(f"{'total (estimate)':<22} {total / 3600:8.1f} h  ({args.grid} grid, test runs of {eval_rounds} rounds: "
          f"{grid.describe()})")


if __name__ == "__main__":
    main()

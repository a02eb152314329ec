"""What the simulator's pre-round budget check costs at the study's setting (docs/simulation.md, "The
pre-round budget check").

    python benchmarks/bench_budget_check.py --data-dir /path/to/mnist                      # this tree
    python benchmarks/bench_budget_check.py --data-dir /path/to/mnist --compare /other/tree # side by side

A study-like IncA run: MNIST logistic regression over ``--clients`` (1000) IID clients, record level
(lr 4, C = 1, B = 10, the budget epsilon = 1 planned for 25 rounds), T = 10, k = 1, 10% colluders,
``--gamma`` (0.1) permanent dropouts within a round and the study's Markov availability across rounds (so
the participants vary from round to round), every round certified, inline backend. The noise is calibrated
once (``--calibration-runs`` executions at the expected participants) and given to every run, so the runs
differ only in the code. ``--rounds`` rounds are timed (every round fits: the check never fires).

Printed: per run the seconds of each round and the participants; with ``--compare``, runs of the other tree
and of this one alternate (``--pairs`` each) and the median round time of each is compared (the ratio is
this tree / the other). Then, in this tree, the cost of one prediction (``Mixer.predicted_cost`` with
``--budget-check-runs`` executions) at the participants of the first rounds, and what predicting before
every round would add per round (one prediction per distinct number of participants, as IncaStrategy caches
it per n) against what the simulator's check adds (nothing, for a round whose execution fits).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _config(args, sigma_star=None, sigma_delta=None, calibration_runs=3):
    from flwr_inca.protocol.dropout import PermanentDropout
    from flwr_inca.simulation import MarkovAvailability, SimulationConfig

    g = args.gamma
    return SimulationConfig(
        rounds=args.rounds, budget_rounds=25, max_epsilon=1.0, delta=1e-5, privacy_unit="record", lr=4.0, clip_norm=1.0,
        batch_size=10, availability=MarkovAvailability(p_off=0.5 * g / (1 - g), p_on=0.5) if g > 0 else None,
        dropout=PermanentDropout(g) if g > 0 else None, iterations=10, neighbors=1, collusion=0.1, certify_every=1,
        calibration_runs=calibration_runs, sigma_star=sigma_star, sigma_delta=sigma_delta, backend="inline", seed=0,
        eval_every=args.rounds + 1)


def _data(args):
    import numpy as np

    from flwr_inca.simulation import iid, load_mnist

    data = load_mnist(args.data_dir)
    keep = np.random.default_rng(0).permutation(len(data.y_train))[6000:]  # the study's validation split held out
    return iid(data.x_train[keep], data.y_train[keep], args.clients, seed=0)


def calibrate_noise(args) -> tuple[float, float]:
    """The noise IncaMixer calibrates for the run's per-round target (at the expected participants)."""
    from flwr_inca.privacy.plan import privacy_plan
    from flwr_inca.simulation.mixers import MixContext, create_mixer
    from flwr_inca.simulation.runner import _expected_participants

    config = _config(args, calibration_runs=args.calibration_runs)
    plan = privacy_plan("record", epsilon=1.0, delta=1e-5, rounds=25, clip_norm=1.0, lr=4.0, batch_size=10,
                        local_size=54000 / args.clients)
    mixer = create_mixer(config)
    mixer.prepare(MixContext(plan.value_sensitivity, plan.mu_round / (1 + config.mu_resolution), 1e-5,
                             _expected_participants(config, args.clients), 7850, 0))
    return mixer.sigmas(mixer._calibrated_n)


def worker(args) -> dict:
    """One timed run with the flwr_inca on sys.path."""
    import torch

    import flwr_inca
    from flwr_inca.simulation import simulate

    parts = _data(args)
    config = _config(args, args.sigma_star, args.sigma_delta)
    hist = simulate(lambda: torch.nn.Linear(784, 10), parts, None, config, progress=False)
    rounds = hist.rounds
    out = {"tree": str(Path(flwr_inca.__file__).resolve().parent.parent), "seconds": [r.seconds for r in rounds],
           "certify": [r.seconds_plan for r in rounds],
           "participants": [r.participants for r in rounds], "refused": hist.rounds_refused, "stopped": hist.stopped,
           "epsilon": hist.epsilon}
    if args.predict:
        from flwr_inca.simulation.mixers import IncaMixer, MixContext

        mixer = IncaMixer(iterations=10, neighbors=1, collusion=0.1, dropout=config.dropout,
                          sigma_star=args.sigma_star, sigma_delta=args.sigma_delta)
        mixer.prepare(MixContext(hist.plan["value_sensitivity"], None, 1e-5, args.clients, 7850, 0))
        timings = []
        for n in sorted(set(out["participants"]))[:2]:
            start = time.perf_counter()
            mu = mixer.predicted_cost(n, args.budget_check_runs)
            timings.append({"n": n, "seconds": time.perf_counter() - start, "mu": mu})
        out["predictions"] = timings
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=os.environ.get("FLWR_INCA_MNIST_DIR", ""))
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--gamma", type=float, default=0.1)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calibration-runs", type=int, default=3)
    parser.add_argument("--budget-check-runs", type=int, default=10)
    parser.add_argument("--compare", default="", help="another checkout of flwr-inca, timed alternately with this one")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--sigma-star", type=float, default=None)
    parser.add_argument("--sigma-delta", type=float, default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--predict", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    sys.path.insert(0, str(ROOT))
    start = time.perf_counter()
    s_star, s_delta = calibrate_noise(args)
    print(f"noise: sigma_star = {s_star:.5g}, sigma_delta = {s_delta:.5g} (calibrated on {args.calibration_runs} "
          f"executions in {time.perf_counter() - start:.1f} s)", flush=True)
    trees = ([args.compare, str(ROOT)] * args.pairs) if args.compare else [str(ROOT)]
    results: dict[str, list[dict]] = {}
    for i, tree in enumerate(trees):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--data-dir", args.data_dir,
               "--clients", str(args.clients), "--gamma", str(args.gamma), "--rounds", str(args.rounds),
               "--budget-check-runs", str(args.budget_check_runs), "--sigma-star", repr(s_star),
               "--sigma-delta", repr(s_delta)]
        if tree == str(ROOT) and i == len(trees) - 1:
            cmd.append("--predict")
        env = {**os.environ, "PYTHONPATH": tree}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if done.returncode:
            sys.exit(f"worker on {tree} failed:\n{done.stderr[-3000:]}")
        res = json.loads(done.stdout.strip().splitlines()[-1])
        results.setdefault(tree, []).append(res)
        print(f"{res['tree']}: rounds {[f'{s:.2f}' for s in res['seconds']]} s (certify "
              f"{[f'{s:.2f}' for s in res['certify']]}), participants {res['participants']}, "
              f"refused {res['refused']}, epsilon {res['epsilon']:.4f}", flush=True)
    medians = {tree: statistics.median(s for r in runs for s in r["seconds"][1:]) for tree, runs in results.items()}
    for tree, med in medians.items():
        print(f"median seconds per round (round 1 excluded) {med:.3f}  {tree}")
    if args.compare:
        print(f"ratio this tree / {args.compare}: {medians[str(ROOT)] / medians[args.compare]:.3f}")
    last = results[str(ROOT)][-1]
    for p in last.get("predictions", []):
        print(f"one prediction at n = {p['n']} ({args.budget_check_runs} executions): {p['seconds']:.2f} s, mu = "
              f"{p['mu']:.4g}; {p['seconds'] / statistics.mean(last['certify']):.1f}x the mean time a round of the same "
              "run took to sample and certify its execution")
    if last.get("predictions"):
        per = statistics.mean(p["seconds"] for p in last["predictions"])
        distinct = len(set(last["participants"]))
        rounds = len(last["participants"])
        print(f"predicting before every round (cached per n): {distinct} distinct n in {rounds} rounds -> about "
              f"{per * distinct / rounds:.2f} s per round, {per * distinct / rounds / medians[str(ROOT)]:.0%} of a "
              f"round; the simulator's check: 0 s for a round whose execution fits")


if __name__ == "__main__":
    main()

"""How IncA's certified per-round mu spreads around its calibrated target at the study's setting, and how
many of the planned rounds then fit the budget (docs/results.md, "n = 100").

    python benchmarks/study_round_cost.py --clients 100 --runs 3 --success 1.0
    python benchmarks/study_round_cost.py --clients 100 --runs 60 --success 0.9
    python benchmarks/study_round_cost.py --clients 100 --runs 3 --success 1.0 --participants 90

The study's record-level plan (epsilon = 1, delta = 1e-5, 25 rounds, lr 4, C = 1, B = 10, 54,000 training
examples over n clients) gives the per-round target; IncA (T = 10, k = 1, 10% permanent dropouts) is
calibrated for it on ``--runs`` simulated executions of the expected 0.9 n participants at the
``--success`` share (``flwr_inca.privacy.calibrate``, the study's seed), then ``--fresh`` fresh rounds are
sampled (participants ~ Binomial(n, 0.9) unless ``--participants``; sigma_star scaled as the simulator
does) and each is certified exactly against 10% random colluders. Printed: the certified mu relative to
the plan's target (mean, quantiles, max, share above), and, for consecutive sequences of 25 fresh rounds
charged their own certificates by Opacus's PRV accountant (and, as the study charges at n = 1000, certified
every ``--certify-every`` rounds with the largest certified mu so far charged in between), how many rounds
fit epsilon = 1 and the epsilon spent.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flwr_inca.privacy.accountants import RoundCost, create_accountant
from flwr_inca.privacy.calibration import calibrate
from flwr_inca.privacy.conversions import epsilon_for_delta
from flwr_inca.privacy.plan import privacy_plan
from flwr_inca.privacy.rounds import certification_seeds, certify_round
from flwr_inca.protocol.config import IncaConfig
from flwr_inca.protocol.dropout import PermanentDropout
from flwr_inca.protocol.engine import sample_trace


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--runs", type=int, default=3, help="calibration executions")
    p.add_argument("--success", type=float, default=1.0, help="share of them the noise must certify")
    p.add_argument("--fresh", type=int, default=100, help="fresh rounds certified")
    p.add_argument("--participants", type=int, default=None, help="fix each fresh round's participants")
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--neighbors", type=int, default=1)
    p.add_argument("--gamma", type=float, default=0.1)
    p.add_argument("--epsilon", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=25)
    p.add_argument("--certify-every", type=int, default=10,
                   help="also charge as the study did at n = 1000: certified every k rounds, the largest so far between")
    args = p.parse_args()
    n, delta = args.clients, 1e-5
    plan = privacy_plan("record", epsilon=args.epsilon, delta=delta, rounds=args.rounds, clip_norm=1.0, lr=4.0,
                        batch_size=10, local_size=54000 / n)
    sens = plan.value_sensitivity
    target = plan.mu_round / 1.005 * 0.99  # the simulator's charge resolution, the mixer's 1% margin
    m = round(0.9 * n)  # the simulator's expected participants
    dropout = PermanentDropout(args.gamma) if args.gamma > 0 else None
    start = time.perf_counter()
    cal = calibrate(epsilon_for_delta(target, delta), delta, m, iterations=args.iterations, neighbors=args.neighbors,
                    collusion=0.1, dropout=dropout, runs=args.runs, seed=1414 + 7919 * m + round(args.gamma * 1000),
                    procedure="exact", value_sensitivity=sens, target_success=args.success)
    print(f"n = {n}: plan mu_round {plan.mu_round:.4f} per round at q = {plan.sample_rate:.4f}; calibrated at {m} "
          f"participants on {args.runs} executions (success {args.success:g}) in {time.perf_counter() - start:.1f} s: "
          f"alpha {cal.alpha:.3f}, sigma_star/S {cal.sigma_star / sens:.4g}, sigma_delta/S {cal.sigma_delta / sens:.4g}")
    rng = np.random.default_rng(7)
    mus, counts = [], []
    start = time.perf_counter()
    for r in range(args.fresh):
        count = args.participants or int(rng.binomial(n, 0.9))
        config = IncaConfig(sigma_star=cal.sigma_star * np.sqrt(m / count), sigma_delta=cal.sigma_delta,
                            iterations=args.iterations, neighbors=args.neighbors, dropout=dropout)
        trace = sample_trace(count, config, 10_000 + r)
        mus.append(certify_round(trace, certification_seeds(99, r + 1), 1, collusion=0.1,
                                 value_sensitivity=sens).mu)
        counts.append(count)
    rel = np.array(mus) / plan.mu_round
    print(f"{args.fresh} fresh rounds ({(time.perf_counter() - start) / args.fresh:.2f} s each): certified mu / "
          f"plan target: mean {rel.mean():.3f}, quantiles 0.5 / 0.9 {np.quantile(rel, 0.5):.3f} / "
          f"{np.quantile(rel, 0.9):.3f}, max {rel.max():.3f}; above the target: {(rel > 1).mean():.0%}")
    acc = create_accountant("opacus-prv")
    for seq in range(args.fresh // args.rounds):
        for every in (1, args.certify_every):
            spent: list[float] = []
            worst = 0.0
            for r, mu in enumerate(mus[seq * args.rounds: (seq + 1) * args.rounds]):
                if r % every == 0:  # certified; the rounds between are charged the largest certified mu so far
                    worst = max(worst, mu)
                charge = mu if every == 1 else worst
                if acc.epsilon([RoundCost(x, plan.sample_rate) for x in spent + [charge]], delta) > args.epsilon:
                    break
                spent.append(charge)
            eps = acc.epsilon([RoundCost(x, plan.sample_rate) for x in spent], delta) if spent else 0.0
            how = "each charged its certificate" if every == 1 else (
                f"certified every {every}, a prediction between")
            print(f"  rounds {seq * args.rounds + 1}-{(seq + 1) * args.rounds}, {how}: "
                  f"{len(spent)} of {args.rounds} fit, epsilon spent {eps:.3f}")
    steep = [acc.epsilon([RoundCost(plan.mu_round * f, plan.sample_rate)] * args.rounds, delta) for f in (1.0, 1.1)]
    print(f"steepness: {args.rounds} rounds at the target give epsilon {steep[0]:.3f}, at 1.1 x the target "
          f"{steep[1]:.3f}")


if __name__ == "__main__":
    main()

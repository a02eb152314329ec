"""How IncA's certified per-round mu spreads around its calibrated target at the study's setting, and how
many of the planned rounds then fit the budget (docs/results.md, "n = 100: the steep per-round budget" and
"IncA at n = 1000").

    python benchmarks/study_round_cost.py --clients 100 --runs 3 --success 1.0
    python benchmarks/study_round_cost.py --clients 100 --runs 60 --success 0.9
    python benchmarks/study_round_cost.py --clients 100 --runs 3 --success 1.0 --participants 90
    # several calibration rules on the same fresh rounds, at several epsilons (n = 1000, 30% dropouts)
    OMP_NUM_THREADS=1 python benchmarks/study_round_cost.py --clients 1000 --gamma 0.3 \
        --rule 3:1.0 10:1.0 60:0.9 --epsilons 0.5 1 2 8 --fresh 50

The study's record-level plan (``--epsilon``, delta = 1e-5, 25 rounds, lr 4, C = 1, B = 10, 54,000 training
examples over n clients) gives the per-round target; IncA (T = 10, k = 1, ``--gamma`` permanent dropouts) is
calibrated for it, as the study does, at the expected participants (round((1 - gamma) n): the stationary
share of the study's Markov availability) on RUNS simulated executions at the SUCCESS share
(``flwr_inca.privacy.calibrate``, the study's seed; ``--rule RUNS:SUCCESS``, repeatable, or ``--runs`` and
``--success``). Then ``--fresh`` fresh rounds are sampled (participants ~ Binomial(n, 1 - gamma), each
round's marginal under that availability, unless ``--participants``; sigma_star scaled as the simulator does)
and each is certified exactly against 10% random colluders, once per rule (the same traces for every rule).

Printed per rule: the calibration's time and noise, the certified mu relative to the plan's target (mean,
quantiles, max, share above), the mean seconds of one certificate (what certifying every round costs per
round), and, for consecutive sequences of 25 fresh rounds charged as the simulator's ledger charges them
(rounded up to its 0.005 resolution, composed by Opacus's PRV accountant; training stops at the first round
that does not fit, which the budget guard charges only in part), how many rounds fit and the epsilon spent:
each round charged its own certificate, and certified every ``--certify-every`` rounds with the largest
certified mu so far charged in between (a rule the study no longer uses: it let one high round's
cost be charged to the rounds after it). The exact
calibration is scale-free (a certificate is proportional to S / sigma when both sigmas scale together), so
the relative certificates of one run serve every epsilon of ``--epsilons``: only the per-round target
and so the steepness of the composition change.
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
from flwr_inca.privacy.session import charge_resolution

DELTA = 1e-5
RESOLUTION = 0.005  # SimulationConfig.mu_resolution: the ledger charges mu rounded up to this grid


def plan_for(epsilon: float, clients: int, rounds: int):
    return privacy_plan("record", epsilon=epsilon, delta=DELTA, rounds=rounds, clip_norm=1.0, lr=4.0,
                        batch_size=10, local_size=54000 / clients)


def rounds_that_fit(mus: list[float], sample_rate: float, epsilon: float, every: int, accountant) -> tuple[int, float]:
    """(rounds that fit epsilon, epsilon spent) for rounds whose certified mu are ``mus``, charged as the
    simulator charges them: certified every ``every`` rounds (1: each round its own certificate), the
    largest certified mu so far charged in between; a round that does not fit stops training."""
    charges: list[RoundCost] = []
    worst = 0.0
    for r, mu in enumerate(mus):
        if r % every == 0:
            worst = max(worst, mu)
        charges.append(RoundCost(charge_resolution(mu if every == 1 else worst, RESOLUTION), sample_rate))
    # epsilon grows with every round charged: the longest prefix that fits, by bisection
    lo, hi = 0, len(charges)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if accountant.epsilon(charges[:mid], DELTA) <= epsilon:
            lo = mid
        else:
            hi = mid - 1
    return lo, (accountant.epsilon(charges[:lo], DELTA) if lo else 0.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--runs", type=int, default=3, help="calibration executions (without --rule)")
    p.add_argument("--success", type=float, default=1.0, help="share of them the noise must certify (without --rule)")
    p.add_argument("--rule", nargs="*", default=None, metavar="RUNS:SUCCESS",
                   help="calibration rules compared on the same fresh rounds (default: --runs:--success)")
    p.add_argument("--fresh", type=int, default=100, help="fresh rounds certified")
    p.add_argument("--participants", type=int, default=None, help="fix each fresh round's participants")
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--neighbors", type=int, default=1)
    p.add_argument("--gamma", type=float, default=0.1)
    p.add_argument("--epsilon", type=float, default=1.0, help="the budget the calibration targets")
    p.add_argument("--epsilons", type=float, nargs="*", default=None,
                   help="budgets the rounds are charged against (default: --epsilon)")
    p.add_argument("--rounds", type=int, default=25)
    p.add_argument("--certify-every", type=int, default=10,
                   help="also charge as the study did at n = 1000: certified every k rounds, the largest so far between")
    args = p.parse_args()
    n = args.clients
    rules = [(int(r), float(s)) for r, s in (x.split(":") for x in args.rule)] if args.rule else [
        (args.runs, args.success)]
    epsilons = args.epsilons or [args.epsilon]
    plan = plan_for(args.epsilon, n, args.rounds)
    sens = plan.value_sensitivity
    target = plan.mu_round / (1 + RESOLUTION) * 0.99  # the simulator's charge resolution, the mixer's 1% margin
    m = round((1 - args.gamma) * n)  # the simulator's expected participants (Markov availability's stationary share)
    dropout = PermanentDropout(args.gamma) if args.gamma > 0 else None
    rng = np.random.default_rng(7)
    counts = [args.participants or int(rng.binomial(n, 1 - args.gamma)) for _ in range(args.fresh)]
    print(f"n = {n}, gamma = {args.gamma}: plan mu_round {plan.mu_round:.4f} per round at q = {plan.sample_rate:.4f} "
          f"(epsilon = {args.epsilon:g}, {args.rounds} rounds); {args.fresh} fresh rounds of {min(counts)}-{max(counts)} "
          f"participants (mean {np.mean(counts):.1f})", flush=True)
    acc = create_accountant("opacus-prv")
    for runs, success in rules:
        start = time.perf_counter()
        cal = calibrate(epsilon_for_delta(target, DELTA), DELTA, m, iterations=args.iterations,
                        neighbors=args.neighbors, collusion=0.1, dropout=dropout, runs=runs,
                        seed=1414 + 7919 * m + round(args.gamma * 1000), procedure="exact", value_sensitivity=sens,
                        target_success=success)
        print(f"\nrule: {runs} calibration executions at {m} participants, success share {success:g}: calibrated in "
              f"{time.perf_counter() - start:.1f} s: alpha {cal.alpha:.3f}, sigma_star/S {cal.sigma_star / sens:.4g}, "
              f"sigma_delta/S {cal.sigma_delta / sens:.4g}", flush=True)
        mus, seconds = [], []
        for r, count in enumerate(counts):
            config = IncaConfig(sigma_star=cal.sigma_star * np.sqrt(m / count), sigma_delta=cal.sigma_delta,
                                iterations=args.iterations, neighbors=args.neighbors, dropout=dropout)
            trace = sample_trace(count, config, 10_000 + r)
            t = time.perf_counter()
            mus.append(certify_round(trace, certification_seeds(99, r + 1), 1, collusion=0.1,
                                     value_sensitivity=sens).mu)
            seconds.append(time.perf_counter() - t)
        rel = np.array(mus) / plan.mu_round
        print(f"{args.fresh} fresh rounds ({np.mean(seconds):.2f} s per certificate, median "
              f"{np.median(seconds):.2f}): certified mu / plan target: mean {rel.mean():.3f}, quantiles 0.5 / 0.9 "
              f"{np.quantile(rel, 0.5):.3f} / {np.quantile(rel, 0.9):.3f}, max {rel.max():.3f}; above the target: "
              f"{(rel > 1).mean():.0%}", flush=True)
        for epsilon in epsilons:
            eplan = plan_for(epsilon, n, args.rounds)
            for every in dict.fromkeys((1, args.certify_every)):
                how = "each charged its certificate" if every == 1 else (
                    f"certified every {every}, a prediction between")
                fits = [rounds_that_fit(list(rel[s * args.rounds: (s + 1) * args.rounds] * eplan.mu_round),
                                        eplan.sample_rate, epsilon, every, acc)
                        for s in range(args.fresh // args.rounds)]
                print(f"  epsilon {epsilon:g}, {how}: rounds that fit " + " / ".join(str(k) for k, _ in fits)
                      + f" of {args.rounds}; epsilon spent " + " / ".join(f"{e:.3f}" for _, e in fits), flush=True)
    steep = [acc.epsilon([RoundCost(plan.mu_round * f, plan.sample_rate)] * args.rounds, DELTA) for f in (1.0, 1.1)]
    print(f"\nsteepness at epsilon = {args.epsilon:g}: {args.rounds} rounds at the target give epsilon {steep[0]:.3f}, "
          f"at 1.1 x the target {steep[1]:.3f}")


if __name__ == "__main__":
    main()

"""What the process-wide memo of Opacus's per-round curves saves when trainings repeat (a study's runs).

A record-level training asks its ledger (Opacus's PRV accountant) for a per-round share of what is left
before every round (:func:`flwr_inca.rounds.budget_share`, a search over a grid of mu) and charges the round.
Each distinct round costs Opacus's Renyi-DP curve (its fractional orders' series) and a truncated PRV mean:
up to seconds. Trainings at the same setting (a study's seeds and methods) meet the same grid points, so
with the memo shared by every ledger in the process (the default) a repeated training composes, but does not
recompute those curves. This benchmark replays ``--trainings`` trainings of ``--rounds`` rounds each,
alternating, side by side, a ledger whose accountant keeps its own memo (``shared_memo=False``, as every
ledger did before) and one on the shared memo, and prints each training's seconds and the ratio.

    python benchmarks/bench_ledger_memo.py                     # 3 trainings x 50 rounds, q = 10/540 (the study, n = 100)
"""

from __future__ import annotations

import argparse
import time
import warnings

import numpy as np


def replay(accountant, rounds: int, q: float, epsilon: float, seed: int) -> tuple[float, float]:
    """One record-level training's ledger work on ``accountant`` (a share of what is left searched before
    each round, the round charged on the 0.5% grid, a little below its share): ``(seconds, epsilon
    spent)``."""
    from flwr_inca.privacy import PrivacyLedger
    from flwr_inca.privacy.session import charge_resolution
    from flwr_inca.rounds import budget_share

    ledger = PrivacyLedger(None, delta=1e-5, max_epsilon=epsilon, accountant=accountant)
    rng, share = np.random.default_rng(seed), None
    start = time.perf_counter()
    for r in range(1, rounds + 1):
        share = budget_share(ledger, rounds - r + 1, q, guess=share, resolution=0.005)
        if share is None:
            break
        ledger.spend(charge_resolution(share * float(rng.uniform(0.9, 1.0)), 0.005), q)
    return time.perf_counter() - start, ledger.epsilon()


def train(shared: bool, rounds: int, q: float, epsilon: float, seed: int) -> tuple[float, float]:
    """One training's ledger work, its PRV accountant on the shared memo or its own."""
    from flwr_inca.privacy.accountants import OpacusPrvAccountant

    return replay(OpacusPrvAccountant(shared_memo=shared), rounds, q, epsilon, seed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainings", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--sample-rate", type=float, default=10 / 540)
    parser.add_argument("--epsilon", type=float, default=1.0)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    import opacus  # noqa: F401  (imported before any timing: the first training does not pay for it)
    print(f"q = {args.sample_rate:.4g}, epsilon {args.epsilon} over {args.rounds} rounds; each training its own "
          "rng seed (its costs differ), alternating own memo / shared memo")
    print("| training | own memo: s | shared memo: s | ratio | epsilon spent (own / shared) |")
    print("|---:|---:|---:|---:|---|")
    for t in range(args.trainings):
        own, eps_own = train(False, args.rounds, args.sample_rate, args.epsilon, seed=t)
        shared, eps_shared = train(True, args.rounds, args.sample_rate, args.epsilon, seed=t)
        print(f"| {t + 1} | {own:.1f} | {shared:.1f} | {own / shared:.2f}x | {eps_own:.6f} / {eps_shared:.6f} |",
              flush=True)


if __name__ == "__main__":
    main()

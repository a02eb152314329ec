"""What computing only the Renyi orders that can be the minimum saves the Opacus accountants.

Both accountants size or bound epsilon with Opacus's Renyi-DP curve of each kind of round, 151 orders
(Opacus's defaults; the RDP accountant 164), and the fractional orders' series cost up to tens of
milliseconds each. ``flwr_inca.privacy.accountants.base.rdp_epsilon`` computes the integer orders up to 64,
then only the orders whose lower bound (RDP is nondecreasing in the order) can reach the smallest epsilon
found; the epsilon is Opacus's to the bit either way. This benchmark replays record-level trainings (a share
of what is left searched before each round, the round charged on the 0.5% grid, each training with its own
memo), alternating, side by side, the curves computed at every order (Opacus's way, the accountant's
behaviour before) and at the orders that can be the minimum, and prints each one's seconds, the ratio and
the epsilon spent by both.

    python benchmarks/bench_rdp_orders.py                       # q = 10/540, 0.14; 2 trainings x 40 rounds
"""

from __future__ import annotations

import argparse
import warnings
from contextlib import contextmanager

import numpy as np


@contextmanager
def every_order():
    """Each curve computes all its orders whenever any is asked (what Opacus's ``compute_rdp`` does)."""
    from flwr_inca.privacy.accountants.base import RdpCurve

    only_needed = RdpCurve.values

    def values(self, which):
        everything = only_needed(self, np.ones(len(self.orders), dtype=bool))
        return np.where(which, everything, np.nan)

    RdpCurve.values = values
    try:
        yield
    finally:
        RdpCurve.values = only_needed


def train(accountant: str, rounds: int, q: float, epsilon: float, seed: int) -> tuple[float, float]:
    """One training's ledger work with a fresh memo: ``(seconds, epsilon spent)``."""
    from bench_ledger_memo import replay  # this script's folder is on sys.path when it runs

    from flwr_inca.privacy.accountants import OpacusPrvAccountant, OpacusRdpAccountant
    from flwr_inca.privacy.accountants.base import RDP_CURVES

    RDP_CURVES.clear()  # the RDP accountant's curves are in the shared memo: every training starts without
    chosen = OpacusPrvAccountant(shared_memo=False) if accountant == "opacus-prv" else OpacusRdpAccountant()
    return replay(chosen, rounds, q, epsilon, seed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainings", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--sample-rates", type=float, nargs="+", default=[10 / 540, 0.14])
    parser.add_argument("--accountants", nargs="+", default=["opacus-prv", "opacus-rdp"],
                        choices=["opacus-prv", "opacus-rdp"])
    parser.add_argument("--epsilon", type=float, default=1.0)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    import opacus  # noqa: F401  (imported before any timing: the first training does not pay for it)
    print(f"epsilon {args.epsilon} over {args.rounds} rounds, delta 1e-5; each training its own rng seed "
          "and a fresh memo; alternating every order / the orders that can be the minimum")
    print("| accountant | q | training | every order: s | needed orders: s | ratio | epsilon spent (both) |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for accountant in args.accountants:
        for q in args.sample_rates:
            for t in range(args.trainings):
                with every_order():
                    full, eps_full = train(accountant, args.rounds, q, args.epsilon, seed=t)
                needed, eps_needed = train(accountant, args.rounds, q, args.epsilon, seed=t)
                same = "same" if eps_full == eps_needed else f"DIFFER: {eps_full!r} / {eps_needed!r}"
                print(f"| {accountant} | {q:.4g} | {t + 1} | {full:.1f} | {needed:.1f} | "
                      f"{full / needed:.2f}x | {eps_needed:.6f} ({same}) |", flush=True)


if __name__ == "__main__":
    main()

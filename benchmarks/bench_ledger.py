"""The privacy ledger's composition cost in a training: what a guarded round's budget checks ask of it.

A record-level training charges its ledger through Opacus's PRV accountant, whose every query discretises
each distinct round (the truncated PRV's mean, an integral of its cdf, is most of it) and composes them. A
round whose whole ceiling does not fit is *guarded*: at its first step the session reserves the furthest
step whose ceiling fits, which takes a search over the round's ceilings. This benchmark replays such a
training twice, side by side on two ledgers charged alike (each with its own accountant, so that neither
reuses the other's compositions):

- **session**: :class:`~flwr_inca.privacy.session.RoundSession` as shipped (the search starts where the
  last guarded round reached, :func:`flwr_inca._search.last_fitting`);
- **bisection**: the same round reserved by a plain bisection over the ceilings (one composition a probe).

Each round has ``--steps`` ceilings growing like a prefix's (``sqrt(step)``), scaled so that about a sixth of
them fit what is left, and is charged a cost around the per-round share (rounded to the 0.5% grid, as the
simulator charges). Printed per block of rounds: the compositions a round asked for and its seconds, for
both, and that both reserved the same step; then the truncated PRV's mean, Opacus's class against the one
the accountant uses (bit-identical; the ratio of times).

    python benchmarks/bench_ledger.py                        # 50 rounds, 40 steps, q = 10/540 (the study, n = 100)
    python benchmarks/bench_ledger.py --rounds 30 --sample-rate 0.185   # q of the study at n = 1000
"""

from __future__ import annotations

import argparse
import math
import time
import warnings

import numpy as np


def _bisection(ledger, ceilings: list[float], charged, sample_rate: float) -> int | None:
    """The furthest ceiling that fits, by bisection over the ceilings (the reference)."""
    def fits(i):
        return ledger.epsilon_after(charged(ceilings[i]), sample_rate) <= ledger.max_epsilon

    if not fits(0):
        return None
    low, high = 0, len(ceilings) - 1
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def _counting(ledger) -> set:
    """Record the distinct compositions ``ledger``'s accountant is asked for (a repeat is remembered)."""
    asked: set = set()
    epsilon = ledger.accountant.epsilon

    def counted(rounds, delta):
        asked.add((tuple(sorted((r.mu, r.sample_rate) for r in rounds)), delta))
        return epsilon(rounds, delta)

    ledger.accountant.epsilon = counted
    return asked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--steps", type=int, default=40, help="the round's steps (IncA: its iterations T)")
    parser.add_argument("--sample-rate", type=float, default=10 / 540)
    parser.add_argument("--epsilon", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    warnings.simplefilter("ignore")

    from flwr_inca.privacy import PrivacyLedger
    from flwr_inca.privacy.accountants import OpacusPrvAccountant
    from flwr_inca.privacy.rounds import RoundCertificate
    from flwr_inca.privacy.session import RoundSession
    from flwr_inca.rounds import budget_share

    q, rng = args.sample_rate, np.random.default_rng(args.seed)
    ledgers = {name: PrivacyLedger(None, delta=1e-5, max_epsilon=args.epsilon,
                                   accountant=OpacusPrvAccountant(shared_memo=False))
               for name in ("session", "bisection")}
    session = RoundSession(ledgers["session"], sample_rate=q, resolution=0.005)
    asked = {name: _counting(ledger) for name, ledger in ledgers.items()}
    rows, share = [], None
    for r in range(1, args.rounds + 1):
        share = budget_share(ledgers["session"], args.rounds - r + 1, q, guess=share, resolution=0.005)
        if share is None:
            break
        # ceilings: a sixth of the steps fit about the share; the whole round (6x that) does not
        scale = share * 1.1 / math.sqrt(args.steps / 6)
        ceilings = [scale * math.sqrt(s) for s in range(1, args.steps + 1)]
        figures = {}
        for name, ledger in ledgers.items():
            if name == "session":
                rnd = session.open(r, ceilings=ceilings)  # its reservation of the whole round: not timed
            asked[name].clear()
            start = time.perf_counter()
            if name == "session":
                reached = None
                if rnd.may_deliver(1):
                    reached = max(i for i, c in enumerate(ceilings) if session.charged(c) <= rnd.reserved)
            else:
                reached = _bisection(ledger, ceilings, session.charged, q)
            figures[name] = (len(asked[name]), time.perf_counter() - start, reached)
        cost = share * float(rng.uniform(0.9, 1.0))
        rnd.settle(RoundCertificate(cost, ("exact",)))
        ledgers["bisection"].spend(session.charged(cost), q)
        rows.append((r, figures))

    print(f"q = {q:.4g}, {args.steps} steps a round, epsilon {args.epsilon} over {args.rounds} rounds "
          f"(spent: {ledgers['session'].epsilon():.4f} / {ledgers['bisection'].epsilon():.4f})")
    print("| rounds | compositions / round (session, bisection) | s / round (session, bisection) | same step |")
    print("|---|---:|---:|---|")
    block = max(len(rows) // 5, 1)
    for i in range(0, len(rows), block):
        part = rows[i:i + block]
        n = [np.mean([f[name][0] for _, f in part]) for name in ledgers]
        s = [np.mean([f[name][1] for _, f in part]) for name in ledgers]
        same = all(f["session"][2] == f["bisection"][2] for _, f in part)
        print(f"| {part[0][0]}-{part[-1][0]} | {n[0]:.1f} / {n[1]:.1f} | {s[0]:.3f} / {s[1]:.3f} | "
              f"{'yes' if same else 'NO'} |")

    from opacus.accountants.analysis.prv import PoissonSubsampledGaussianPRV, TruncatedPrivacyRandomVariable

    from flwr_inca.privacy.accountants.prv import _prv_classes

    ours = _prv_classes()
    times = {"opacus": 0.0, "flwr-inca": 0.0}
    for repeat in range(3):
        for name, (gaussian, truncated) in (("opacus", (PoissonSubsampledGaussianPRV, TruncatedPrivacyRandomVariable)),
                                            ("flwr-inca", ours)):
            start = time.perf_counter()
            means = [truncated(gaussian(q, sigma), -4.2, 4.2).mean() for sigma in (2.0, 5.0, 10.0, 20.0)]
            times[name] += time.perf_counter() - start
            if name == "opacus":
                reference = means
            elif means != reference:
                raise SystemExit("the truncated PRV's mean differs from Opacus's")
    print(f"truncated PRV mean, 4 rounds x 3: Opacus {times['opacus']:.3f} s, the accountant's "
          f"{times['flwr-inca']:.3f} s ({times['opacus'] / times['flwr-inca']:.1f}x; the same numbers)")


if __name__ == "__main__":
    main()

"""Adversarial choice of the corrupted set: a stress test of a recorded execution.

The paper's Collusion DP fixes the corrupted set before the random topology is drawn. An adversary
that picks C *after* seeing who talks to whom can do much worse: corrupting the parties a target sends
to observes the target's messages directly. This greedy search looks for such a set within a budget
and reports the weakest honest party it finds, certified exactly.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from ..protocol.trace import ExecutionTrace
from .certificate import Certificate, certify
from .views import AdversaryView, coalition_size, collusion_view, random_collusion, with_finals

__all__ = ["AdversarialResult", "adversarial_collusion"]


@dataclass
class AdversarialResult:
    target: int  # the honest party the search attacked
    corrupted: np.ndarray
    certificate: Certificate
    tried: int  # candidate sets evaluated

    @property
    def view(self) -> AdversaryView:
        return self.certificate.view


def _contacts(trace: ExecutionTrace) -> tuple[list[Counter], list[Counter]]:
    """Per party: how often it sent to each receiver, and received from each sender."""
    n = trace.parties
    out: list[Counter] = [Counter() for _ in range(n)]
    inc: list[Counter] = [Counter() for _ in range(n)]
    for step in trace.steps:
        for s, r in zip(step.messages.senders.tolist(), step.messages.receivers.tolist()):
            out[s][r] += 1
            inc[r][s] += 1
    return out, inc


def adversarial_collusion(
    trace: ExecutionTrace,
    fraction: float,
    *,
    sigma_star: float | None = None,
    sigma_delta: float | None = None,
    candidates: int = 8,
    seed: int | None = 0,
    value_sensitivity: float = 1.0,
    delta: float | None = None,
    finals: Iterable[int] | None = None,
) -> AdversarialResult:
    """Greedy search for a corrupted set of ``ceil(fraction * n)`` parties maximizing some honest
    party's mu.

    Targets: the ``candidates`` parties with the fewest distinct receivers (and the weakest party
    under a random corrupted set of the same size). For each target, corrupt the parties it sent the
    most messages to, then those that sent it the most, until the budget is used; certify exactly and
    keep the worst outcome. ``finals``: the parties whose final messages were observed (None: every
    party online at T; see :func:`~flwr_inca.privacy.views.with_finals`).
    """
    n = trace.parties
    f = float(fraction)
    if not (0.0 < f < 1.0):
        raise ValueError(f"collusion fraction must be in (0, 1), got {fraction!r}")
    budget = min(coalition_size(f, n), n - 1)
    if budget < 1:
        raise ValueError(f"fraction {fraction} of {n} parties corrupts nobody")
    kw = {"sigma_star": sigma_star, "sigma_delta": sigma_delta, "value_sensitivity": value_sensitivity,
          "delta": delta}
    out, inc = _contacts(trace)

    baseline = certify(trace, random_collusion(trace, f, seed, finals=finals), **kw)
    targets = sorted(range(n), key=lambda i: (len(out[i]), sum(out[i].values())))[:candidates]
    if baseline.mu:
        targets.append(baseline.weakest[0])
    best: AdversarialResult | None = None
    tried = 0
    for target in dict.fromkeys(targets):  # unique, in order
        chosen: list[int] = []
        for pool in (out[target], inc[target]):
            for party, _ in pool.most_common():
                if party != target and party not in chosen and len(chosen) < budget:
                    chosen.append(party)
        rng = np.random.default_rng([0 if seed is None else seed, target])
        rest = [p for p in rng.permutation(n).tolist() if p != target and p not in chosen]
        chosen.extend(rest[: budget - len(chosen)])
        cert = certify(trace, with_finals(collusion_view(trace, chosen), trace, finals), **kw)
        tried += 1
        if best is None or cert.max_mu > best.certificate.max_mu:
            best = AdversarialResult(cert.weakest[0], np.array(sorted(chosen)), cert, tried)
    assert best is not None
    best.tried = tried
    return best

"""Adversary views: which messages a passive adversary observes in a recorded execution (paper Sec. 4.1).

Both threat models know every ``W_t`` and every online set (they are in the trace). A view is a bool
mask ``observed`` (T+1, n): ``observed[t, i]`` means the adversary knows ``y_i^(t)``. Final messages
of parties online at T are always observed (they are the output).

* Collusion DP: a corrupted set C; the adversary knows the corrupted parties' values and noise, all
  their messages, and every message delivered to one of them.
* Eavesdrop DP: nobody is corrupted; a subset of the delivered messages is intercepted.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from ..protocol.trace import ExecutionTrace

__all__ = [
    "AdversaryView",
    "coalition_size",
    "collusion_view",
    "eavesdrop_view",
    "random_collusion",
    "random_eavesdrop",
]


@dataclass(frozen=True)
class AdversaryView:
    """What the adversary observes in one execution.

    Attributes:
        threat: ``"collusion"`` or ``"eavesdrop"``.
        corrupted: sorted indices of corrupted parties (empty under eavesdropping).
        observed: bool (T+1, n); ``observed[t, i]``: the adversary knows ``y_i^(t)``.
    """

    threat: str
    corrupted: np.ndarray
    observed: np.ndarray

    @property
    def parties(self) -> int:
        return int(self.observed.shape[1])

    @property
    def honest(self) -> np.ndarray:
        mask = np.ones(self.parties, dtype=bool)
        mask[self.corrupted] = False
        return np.flatnonzero(mask)

    def honest_observed(self) -> np.ndarray:
        """(T+1, n) mask of observed messages of honest parties (the rows of the linear system)."""
        mask = self.observed.copy()
        mask[:, self.corrupted] = False
        return mask

    def describe(self) -> str:
        obs = int(self.honest_observed().sum())
        if self.threat == "collusion":
            return f"collusion of {self.corrupted.size} parties; {obs} honest messages observed"
        return f"eavesdropping; {obs} honest messages observed"


def _finals(trace: ExecutionTrace) -> np.ndarray:
    observed = np.zeros((trace.iterations + 1, trace.parties), dtype=bool)
    observed[trace.iterations, trace.steps[-1].online] = True
    return observed


def collusion_view(trace: ExecutionTrace, corrupted: Iterable[int]) -> AdversaryView:
    """Collusion DP view for the corrupted set ``corrupted`` (paper Def. of C-DP, Sec. 4.1)."""
    n, T = trace.parties, trace.iterations
    C = np.unique(np.asarray(list(corrupted), dtype=np.int64))
    if C.size and (C.min() < 0 or C.max() >= n):
        raise ValueError(f"corrupted parties must be in [0, {n - 1}]")
    if C.size >= n:
        raise ValueError("at least one party must be honest")
    is_c = np.zeros(n, dtype=bool)
    is_c[C] = True
    observed = _finals(trace)
    observed[:, C] = True
    for t in range(T):  # y^(t) travels at iteration t+1
        m = trace.steps[t].messages
        observed[t, m.senders[is_c[m.receivers]]] = True
    return AdversaryView("collusion", C, observed)


def eavesdrop_view(trace: ExecutionTrace, intercepted: Iterable[tuple[int, int]]) -> AdversaryView:
    """Eavesdrop DP view: ``intercepted`` holds ``(sender, iteration)`` pairs, meaning the message
    ``y_sender^(iteration-1)`` sent at that iteration was observed (any one copy suffices)."""
    T = trace.iterations
    observed = _finals(trace)
    for sender, iteration in intercepted:
        if not (1 <= int(iteration) <= T):
            raise ValueError(f"intercepted message: iteration must be in [1, {T}], got {iteration}")
        m = trace.steps[int(iteration) - 1].messages
        if not np.any(m.senders == int(sender)):
            raise ValueError(
                f"intercepted message: party {sender} delivered no message at iteration {iteration}"
            )
        observed[int(iteration) - 1, int(sender)] = True
    return AdversaryView("eavesdrop", np.zeros(0, dtype=np.int64), observed)


def coalition_size(fraction: float, total: int) -> int:
    """``ceil(fraction * total)``, ignoring float noise (0.1 * 30 is 3, not 4)."""
    return min(math.ceil(fraction * total - 1e-9), total)


def random_collusion(trace: ExecutionTrace, fraction: float, seed: int | None = None) -> AdversaryView:
    """Corrupt ``ceil(fraction * n)`` parties chosen uniformly (seeded); rounding up keeps the
    certificate conservative (0.1 of 5 parties is one corrupted party, not none)."""
    f = float(fraction)
    if not (0.0 <= f < 1.0):
        raise ValueError(f"collusion fraction rho must be in [0, 1), got {fraction!r}")
    n = trace.parties
    count = min(coalition_size(f, n), n - 1)
    C = np.random.default_rng(seed).choice(n, size=count, replace=False)
    return collusion_view(trace, C)


def random_eavesdrop(trace: ExecutionTrace, fraction: float, seed: int | None = None) -> AdversaryView:
    """Intercept ``ceil(fraction * m_t)`` of the ``m_t`` delivered messages of every iteration."""
    f = float(fraction)
    if not (0.0 <= f <= 1.0):
        raise ValueError(f"observed fraction must be in [0, 1], got {fraction!r}")
    rng = np.random.default_rng(seed)
    observed = _finals(trace)
    for t, step in enumerate(trace.steps):
        m = step.messages
        count = coalition_size(f, len(m))
        if count:
            pick = rng.choice(len(m), size=count, replace=False)
            observed[t, m.senders[pick]] = True
    return AdversaryView("eavesdrop", np.zeros(0, dtype=np.int64), observed)

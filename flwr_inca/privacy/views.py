"""Adversary views: which messages a passive adversary observes in a recorded execution (paper Sec. 4.1).

Both threat models know every ``W_t`` and every online set (they are in the trace). A view is a bool
mask ``observed`` (T+1, n): ``observed[t, i]`` means the adversary knows ``y_i^(t)``. Final messages
of parties online at T are observed (they are the output): by default all of them (the *pre-final*
view, an upper bound whatever finals then arrive), or only ``finals``, the parties whose final
messages were actually revealed (``finals=()``: a round stopped before its finals).

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
    "recorded_finals",
    "with_finals",
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


def _finals(trace: ExecutionTrace, finals: Iterable[int] | None = None) -> np.ndarray:
    """(T+1, n) mask with the observed final messages: ``finals`` (default: every party online at T)."""
    observed = np.zeros((trace.iterations + 1, trace.parties), dtype=bool)
    observed[trace.iterations, _check_finals(trace, finals)] = True
    return observed


def _check_finals(trace: ExecutionTrace, finals: Iterable[int] | None) -> np.ndarray:
    online = trace.steps[-1].online
    if finals is None:
        return online
    chosen = np.unique(np.asarray(list(finals), dtype=np.int64))
    if not np.isin(chosen, online).all():
        extra = sorted(set(chosen.tolist()) - set(online.tolist()))
        raise ValueError(f"finals must be parties online at the last iteration; {extra[:10]} are not")
    return chosen


def with_finals(view: AdversaryView, trace: ExecutionTrace, finals: Iterable[int] | None) -> AdversaryView:
    """``view`` with only the final messages of ``finals`` observed (None: every party online at T).

    Build views with :func:`collusion_view` or :func:`eavesdrop_view` (all finals), then restrict them
    here; only the last row changes, the messages before it and the corrupted set are ``view``'s. Fewer
    observed finals can only lower every party's mu, so the pre-final view (``finals=None``) bounds
    the view of any subset of finals that then arrives.
    """
    if view.observed.shape != (trace.iterations + 1, trace.parties):
        raise ValueError("adversary view does not match the trace (parties or iterations differ)")
    observed = view.observed.copy()
    observed[-1] = _finals(trace, finals)[-1]
    observed[-1, view.corrupted] = True  # the colluders know their own messages
    return AdversaryView(view.threat, view.corrupted, observed)


def recorded_finals(trace: ExecutionTrace) -> np.ndarray | None:
    """The parties whose final messages a deployment recorded as revealed (``trace.meta["finalists"]``,
    written by the relay: the finals that arrived; empty for a round stopped before its finals), or None
    when the trace does not say (then every party online at T counts as revealed)."""
    recorded = trace.meta.get("finalists")
    if recorded is None:
        return None
    if not isinstance(recorded, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                 for i in recorded):
        raise ValueError("trace meta 'finalists' must be a list of party indices")
    return _check_finals(trace, recorded)


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


def random_collusion(trace: ExecutionTrace, fraction: float, seed: int | None = None, *,
                     finals: Iterable[int] | None = None) -> AdversaryView:
    """Corrupt ``ceil(fraction * n)`` parties chosen uniformly (seeded); rounding up keeps the
    certificate conservative (0.1 of 5 parties is one corrupted party, not none). The same seed draws
    the same parties whatever ``finals`` (see :func:`with_finals`) is."""
    f = float(fraction)
    if not (0.0 <= f < 1.0):
        raise ValueError(f"collusion fraction rho must be in [0, 1), got {fraction!r}")
    n = trace.parties
    count = min(coalition_size(f, n), n - 1)
    C = np.random.default_rng(seed).choice(n, size=count, replace=False)
    return with_finals(collusion_view(trace, C), trace, finals)


def random_eavesdrop(trace: ExecutionTrace, fraction: float, seed: int | None = None, *,
                     finals: Iterable[int] | None = None) -> AdversaryView:
    """Intercept ``ceil(fraction * m_t)`` of the ``m_t`` delivered messages of every iteration (the same
    ones for a seed, whatever ``finals``, see :func:`with_finals`, is)."""
    f = float(fraction)
    if not (0.0 <= f <= 1.0):
        raise ValueError(f"observed fraction must be in [0, 1], got {fraction!r}")
    rng = np.random.default_rng(seed)
    observed = _finals(trace, finals)
    for t, step in enumerate(trace.steps):
        m = step.messages
        count = coalition_size(f, len(m))
        if count:
            pick = rng.choice(len(m), size=count, replace=False)
            observed[t, m.senders[pick]] = True
    return AdversaryView("eavesdrop", np.zeros(0, dtype=np.int64), observed)

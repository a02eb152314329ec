"""The interface every round accountant implements."""

from __future__ import annotations

import importlib.util
import threading
from abc import ABC, abstractmethod
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..._checks import check_real

__all__ = ["Memo", "RdpCurve", "RoundAccountant", "RoundCost", "grouped", "rdp_curve", "rdp_epsilon",
           "require_opacus"]


@dataclass(frozen=True)
class RoundCost:
    """The privacy cost of one training round.

    Attributes:
        mu: GDP parameter of the round's release for a change of one protected unit (one party's
            update for party-level DP, one record for record-level DP).
        sample_rate: Poisson sampling probability of the protected unit in the round (1 = none).
    """

    mu: float
    sample_rate: float = 1.0

    def __post_init__(self) -> None:
        check_real("mu", self.mu, 0.0, finite=False)  # inf: an unbounded round
        check_real("sample_rate", self.sample_rate, 0.0, 1.0, low_open=True)


# Opacus's Renyi-DP curve (compute_rdp, which both accountants use) raises "The result of subtraction must
# be non-negative" for some noise multipliers between about 1e7 and 1e9 (mu 1e-9 to 1e-7: a cancellation in
# its fractional-order series) and overflows near 1e300; its bounds are flat there (at sample rate 0.5,
# epsilon at mu = 1e-6 is 4e-10 above that at 1e-9), so a smaller mu is composed as this one: never less
# than the true cost (a larger mu only costs more), and a round that certified almost nothing never stops
# the ledger
_SMALLEST_MU = 1e-6


class RoundAccountant(ABC):
    """Composes per-round costs into an (epsilon, delta) guarantee."""

    name: str = "abstract"

    @abstractmethod
    def epsilon(self, rounds: Sequence[RoundCost], delta: float) -> float:
        """Epsilon of all ``rounds`` together at ``delta`` (0 for no rounds)."""

    def check_sample_rate(self, sample_rate: float) -> None:
        """Raise ``ValueError`` if this accountant cannot account rounds with ``sample_rate`` (cheap:
        callers check before spending anything)."""


def grouped(rounds: Sequence[RoundCost]) -> list[tuple[float, float, int]]:
    """``(noise_multiplier, sample_rate, count)`` triples, identical rounds merged (order is
    irrelevant for composition). Rounds with mu = 0 cost nothing and are dropped; a positive mu below
    ``_SMALLEST_MU`` is composed as that mu."""
    counts = Counter((max(r.mu, _SMALLEST_MU), r.sample_rate) for r in rounds if r.mu > 0)
    return [(1.0 / mu, q, c) for (mu, q), c in sorted(counts.items())]


class Memo:
    """A small least-recently-used memo (bounded: a long run's history of queries is not kept), shared
    between threads: a value being computed is waited for, not computed twice (a ledger charges, and
    can be asked ahead, in a thread beside the round)."""

    def __init__(self, size: int) -> None:
        self.size, self._items = int(size), OrderedDict()
        self._lock = threading.Lock()
        self._pending: dict[Hashable, threading.Event] = {}

    def get(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        while True:
            with self._lock:
                if key in self._items:
                    self._items.move_to_end(key)
                    return self._items[key]
                running = self._pending.get(key)
                if running is None:
                    running = self._pending[key] = threading.Event()
                    break
            running.wait()  # another thread computes it; if it failed, try again here
        try:
            value = compute()
            with self._lock:
                self._items[key] = value
                if len(self._items) > self.size:
                    self._items.popitem(last=False)
            return value
        finally:
            with self._lock:
                del self._pending[key]
            running.set()

    def clear(self) -> None:
        """Forget every value (one being computed is still waited for)."""
        with self._lock:
            self._items.clear()


# Opacus's per-step Renyi-DP curve and the PRV's truncated mean are pure functions of (sample rate, noise
# multiplier, orders or domain) that cost up to seconds each (the fractional orders' series): remembered for
# the whole process, so every ledger (a study's runs, a training restarted) reuses what another computed
RDP_CURVES = Memo(4096)  # about 2 KiB a curve
PRV_MEANS = Memo(4096)

# integer orders up to this have a finite series of at most this many terms: cheap, and computed first
_CHEAP_ORDER = 64


class RdpCurve:
    """Opacus's per-step Renyi DP of the Poisson-subsampled Gaussian mechanism (``sample_rate``,
    ``noise_multiplier``) at ``orders``, each order computed the first time it is needed, by Opacus's
    ``compute_rdp`` at that one order: the value its list of orders would give, to the bit. A fractional
    order's series costs up to tens of milliseconds, and most orders never decide an epsilon
    (:func:`rdp_epsilon` computes the ones that can)."""

    def __init__(self, sample_rate: float, noise_multiplier: float, orders: tuple[float, ...]) -> None:
        self.sample_rate, self.noise_multiplier = float(sample_rate), float(noise_multiplier)
        self.orders = orders
        self._values = np.full(len(orders), np.nan)
        self._known = np.zeros(len(orders), dtype=bool)
        self._lock = threading.Lock()  # ledgers in several threads may share a curve (the memo)

    def values(self, which: np.ndarray) -> np.ndarray:
        """The per-step RDP at the orders the boolean mask ``which`` selects (computed where not yet
        known), NaN at the others; a new array."""
        from opacus.accountants.analysis.rdp import compute_rdp

        with self._lock:
            for i in np.flatnonzero(which & ~self._known):  # a float order: Opacus's scalar branch
                self._values[i] = compute_rdp(q=self.sample_rate, noise_multiplier=self.noise_multiplier,
                                              steps=1, orders=float(self.orders[i]))
                self._known[i] = True
            return np.where(which, self._values, np.nan)

    def known(self) -> np.ndarray:
        """Which orders are computed (a new boolean array)."""
        with self._lock:
            return self._known.copy()


def rdp_curve(sample_rate: float, noise_multiplier: float, orders: tuple[float, ...],
              memo: Memo = RDP_CURVES) -> RdpCurve:
    """The :class:`RdpCurve` of one round kind, from ``memo`` (by default the process-wide
    :data:`RDP_CURVES`)."""
    key = (float(sample_rate), float(noise_multiplier), orders)
    return memo.get(key, lambda: RdpCurve(sample_rate, noise_multiplier, orders))


def _epsilons(orders: np.ndarray, rdp: np.ndarray, delta: float) -> np.ndarray:
    """Opacus's ``get_privacy_spent`` conversion at every order, the same expression (Balle et al. 2020,
    Theorem 21)."""
    with np.errstate(invalid="ignore"):
        return rdp - (np.log(delta) + np.log(orders)) / (orders - 1) + np.log((orders - 1) / orders)


def rdp_epsilon(curves: Sequence[tuple[RdpCurve, int]], delta: float, *,
                within: float | None = None) -> float:
    """Opacus's ``get_privacy_spent(orders, sum(count * curve), delta)`` epsilon, to the bit, from the
    orders that can give its minimum. The integer orders up to 64 are computed first (finite series); an
    other order alpha is computed only where its lower bound, ``sum(count * rdp(beta)) + g(alpha)`` for the
    largest computed order beta <= alpha (0 below 2), is within 1e-6 (relative) of the smallest epsilon
    found: Renyi divergence is nondecreasing in the order, so an order above that bound cannot be the
    minimum, and skipping it changes neither the minimum nor where it is.

    ``within``: when the epsilon at some computed order is already at most this, return that upper bound
    instead (a caller that takes ``max(within, epsilon)`` gets the same number without the search).
    """
    from opacus.accountants.analysis.rdp import get_privacy_spent

    listed = curves[0][0].orders
    orders = np.asarray(listed, dtype=float)
    integer = (orders == np.floor(orders)) & (orders <= _CHEAP_ORDER)

    def composed(which: np.ndarray) -> np.ndarray:
        total = np.zeros(len(orders))
        for curve, count in curves:
            total += curve.values(which) * count  # c steps: c times the per-step curve
        return total

    first = composed(integer | np.logical_and.reduce([c.known() for c, _ in curves]))
    eps = _epsilons(orders, first, delta)
    smallest = np.nanmin(eps) if not np.isnan(eps).all() else np.inf
    if within is not None and smallest <= within:
        return float(smallest)
    known = ~np.isnan(first)
    below = np.zeros(len(orders))  # the composed RDP at the largest computed order below each order
    for i in np.flatnonzero(~known):
        lower = np.flatnonzero(known & (orders <= orders[i]))
        if len(lower):
            below[i] = first[lower[np.argmax(orders[lower])]]
    bound = _epsilons(orders, below, delta)
    # skipped only where the bound is finite and clearly above (an infinite or NaN one is computed)
    needed = ~known & ~(np.isfinite(bound) & (bound > smallest + 1e-6 * (1.0 + abs(smallest))))
    rdp = composed(known | needed)
    rdp[np.isnan(rdp)] = np.inf  # an order that cannot be the minimum
    eps, _ = get_privacy_spent(orders=list(listed), rdp=rdp, delta=delta)
    return float(eps)


def require_opacus(accountant: str) -> None:
    """Raise ``ImportError`` naming the extra to install if Opacus is missing (cheap: no import)."""
    try:
        found = importlib.util.find_spec("opacus") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ImportError(
            f"the {accountant!r} accountant needs Opacus, which is not installed: "
            'pip install "flwr-inca[opacus]" (or use accountant="exact" for rounds without subsampling)'
        )

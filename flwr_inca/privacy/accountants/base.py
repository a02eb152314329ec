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

__all__ = ["Memo", "RoundAccountant", "RoundCost", "grouped", "rdp_per_step", "require_opacus"]


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


# Opacus's per-step Renyi-DP curve and the PRV's truncated mean are pure functions of (sample rate, noise
# multiplier, orders or domain) that cost up to seconds each (the fractional orders' series): remembered for
# the whole process, so every ledger (a study's runs, a training restarted) reuses what another computed
RDP_CURVES = Memo(4096)  # about 1 KiB a curve
PRV_MEANS = Memo(4096)


def rdp_per_step(sample_rate: float, noise_multiplier: float, orders: tuple[float, ...],
                 memo: Memo = RDP_CURVES) -> np.ndarray:
    """Opacus's ``compute_rdp(q, sigma, steps=1, orders)`` (read-only; memoized in ``memo``, by default the
    process-wide :data:`RDP_CURVES`)."""
    from opacus.accountants.analysis.rdp import compute_rdp

    def compute() -> np.ndarray:
        rdp = np.asarray(compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier, steps=1,
                                     orders=list(orders)), dtype=float)
        rdp.setflags(write=False)
        return rdp

    return memo.get((float(sample_rate), float(noise_multiplier), orders), compute)


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

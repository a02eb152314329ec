"""The interface every round accountant implements."""

from __future__ import annotations

import importlib.util
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["RoundCost", "RoundAccountant", "grouped", "require_opacus"]


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
    irrelevant for composition). Rounds with mu = 0 cost nothing and are dropped."""
    counts = Counter((r.mu, r.sample_rate) for r in rounds if r.mu > 0)
    return [(1.0 / mu, q, c) for (mu, q), c in sorted(counts.items())]


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

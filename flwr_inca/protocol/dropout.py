"""Dropout models: which parties are online at each step.

Every model returns a bool mask ``online`` of shape (T+1, n): ``online[t, i]`` says whether party i
takes part in step t. Step 0 (initialization) has every party online (paper Sec. 3.2: ``O^(0) = P``).
A party offline at T has *permanently* dropped: its final message is not part of the output, and
the noise it injected does not cancel.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping

import numpy as np

from .._checks import check_probability

__all__ = [
    "DropoutModel",
    "NoDropout",
    "PermanentDropout",
    "TemporaryDropout",
    "MarkovDropout",
    "ScheduledDropout",
    "resolve_dropout",
]


def _probability(name: str, value: float, upper_closed: bool = False) -> float:
    return check_probability(f"{name} (a probability)", value, one=upper_closed)


class DropoutModel(ABC):
    """Samples the online mask of a run from the run's dropout stream ``rng``."""

    @abstractmethod
    def sample(self, n: int, iterations: int, rng: np.random.Generator) -> np.ndarray:
        """Return the bool mask (T+1, n) of online parties; row 0 is all True."""


class NoDropout(DropoutModel):
    """Everyone is online at every step."""

    def sample(self, n: int, iterations: int, rng: np.random.Generator) -> np.ndarray:
        return np.ones((iterations + 1, n), dtype=bool)

    def __repr__(self) -> str:
        return "NoDropout()"


class PermanentDropout(DropoutModel):
    """A fraction ``gamma`` of the parties (``round(gamma * n)``, chosen uniformly) drops out
    permanently, each at an iteration drawn uniformly from 1..T (paper Sec. 5.2)."""

    def __init__(self, gamma: float) -> None:
        self.gamma = _probability("gamma (fraction of parties that drop out)", gamma)

    def sample(self, n: int, iterations: int, rng: np.random.Generator) -> np.ndarray:
        online = np.ones((iterations + 1, n), dtype=bool)
        count = int(round(self.gamma * n))
        if count == 0:
            return online
        who = rng.choice(n, size=count, replace=False)
        when = rng.integers(1, iterations + 1, size=count)
        steps = np.arange(iterations + 1)[:, None]
        online[:, who] = steps < when[None, :]
        return online

    def __repr__(self) -> str:
        return f"PermanentDropout(gamma={self.gamma})"


class TemporaryDropout(DropoutModel):
    """Each party is offline independently with probability ``p`` at each iteration 1..T-1 and is
    back at T, so every dropout is temporary in the paper's sense (all noise cancels)."""

    def __init__(self, p: float) -> None:
        self.p = _probability("p (per-iteration offline probability)", p)

    def sample(self, n: int, iterations: int, rng: np.random.Generator) -> np.ndarray:
        online = rng.random((iterations + 1, n)) >= self.p
        online[0] = True
        online[iterations] = True
        return online

    def __repr__(self) -> str:
        return f"TemporaryDropout(p={self.p})"


class MarkovDropout(DropoutModel):
    """Correlated churn, as in decentralizepy's dropout simulator.

    A party online at t-1 is offline at t with probability ``rate``; a party offline at t-1 stays
    offline with probability ``rate + correlation * (1 - rate)``. With ``recover_by_end=True``
    every party is back at T (only temporary dropouts); otherwise a party offline at T has
    permanently dropped.
    """

    def __init__(self, rate: float, correlation: float = 0.0, recover_by_end: bool = False) -> None:
        self.rate = _probability("rate (per-iteration dropout probability)", rate)
        self.correlation = _probability("correlation", correlation, upper_closed=True)
        self.recover_by_end = bool(recover_by_end)

    def sample(self, n: int, iterations: int, rng: np.random.Generator) -> np.ndarray:
        online = np.ones((iterations + 1, n), dtype=bool)
        stay_off = self.rate + self.correlation * (1.0 - self.rate)
        u = rng.random((iterations, n))
        for t in range(1, iterations + 1):  # loop over iterations, vectorized over parties
            p_off = np.where(online[t - 1], self.rate, stay_off)
            online[t] = u[t - 1] >= p_off
        if self.recover_by_end:
            online[iterations] = True
        return online

    def __repr__(self) -> str:
        return (
            f"MarkovDropout(rate={self.rate}, correlation={self.correlation}, "
            f"recover_by_end={self.recover_by_end})"
        )


class ScheduledDropout(DropoutModel):
    """An explicit schedule: either a bool mask (T+1, n) of online parties, or a mapping
    ``{iteration: iterable of offline parties}`` for iterations 1..T."""

    def __init__(self, schedule: np.ndarray | Mapping[int, Iterable[int]]) -> None:
        self._schedule = schedule

    def sample(self, n: int, iterations: int, rng: np.random.Generator) -> np.ndarray:
        if isinstance(self._schedule, Mapping):
            online = np.ones((iterations + 1, n), dtype=bool)
            for t, offline in self._schedule.items():
                if not (1 <= int(t) <= iterations):
                    raise ValueError(f"dropout schedule: iteration must be in [1, {iterations}], got {t}")
                idx = np.asarray(list(offline), dtype=np.int64)
                if idx.size and (idx.min() < 0 or idx.max() >= n):
                    raise ValueError(f"dropout schedule: parties must be in [0, {n - 1}]")
                online[int(t), idx] = False
            return online
        mask = np.asarray(self._schedule)
        if mask.shape != (iterations + 1, n):
            raise ValueError(
                f"dropout schedule: online mask must have shape (T+1, n) = ({iterations + 1}, {n}), "
                f"got {mask.shape}"
            )
        if mask.dtype != bool:
            raise ValueError("dropout schedule: online mask must be boolean")
        if not mask[0].all():
            raise ValueError("dropout schedule: every party is online at step 0 (initialization)")
        return mask.copy()

    def __repr__(self) -> str:
        return "ScheduledDropout(...)"


def resolve_dropout(dropout: DropoutModel | None) -> DropoutModel:
    if dropout is None:
        return NoDropout()
    if isinstance(dropout, DropoutModel):
        return dropout
    raise ValueError(f"dropout: expected a DropoutModel or None, got {dropout!r}")

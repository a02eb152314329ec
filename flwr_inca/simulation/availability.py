"""Which clients can take part in each round (dropouts *across* rounds).

Within a round, parties may still drop out during IncA's mixing: that is the ``dropout`` model of the
protocol (``flwr_inca.protocol.dropout``). Across rounds, a client is available or not:

* :class:`AlwaysAvailable` (default);
* :class:`MarkovAvailability`: each client is a two-state Markov chain over rounds (on -> off with
  probability ``p_off``, off -> on with ``p_on``), started from its stationary distribution;
* :class:`AvailabilityTable`: a user-given bool table (rounds, clients).

A client that missed rounds rejoins with the current global model: clients keep no model state
between rounds, every participant starts from the model of the previous round.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from .._checks import check_probability

__all__ = ["Availability", "AlwaysAvailable", "MarkovAvailability", "AvailabilityTable"]


class Availability(ABC):
    """Samples the clients available in each round; ``rng`` is the round's own stream."""

    def reset(self, clients: int, rng: np.random.Generator) -> None:
        """Called once before round 1."""

    @abstractmethod
    def available(self, round: int, clients: int, rng: np.random.Generator) -> np.ndarray:
        """Bool (clients,) mask of the clients available in ``round`` (1-based); called in order."""


class AlwaysAvailable(Availability):
    def available(self, round: int, clients: int, rng: np.random.Generator) -> np.ndarray:
        return np.ones(clients, dtype=bool)

    def __repr__(self) -> str:
        return "AlwaysAvailable()"


class MarkovAvailability(Availability):
    """On/off availability per client, a Markov chain across rounds.

    Args:
        p_off: probability that an available client is unavailable in the next round.
        p_on: probability that an unavailable client is back in the next round (> 0).
    The stationary share of available clients is ``p_on / (p_on + p_off)``; mean offline spell
    ``1 / p_on`` rounds.
    """

    def __init__(self, p_off: float, p_on: float) -> None:
        self.p_off = check_probability("p_off", p_off)
        self.p_on = check_probability("p_on", p_on, zero=False)
        self._state: np.ndarray | None = None

    @property
    def stationary(self) -> float:
        return self.p_on / (self.p_on + self.p_off)

    def reset(self, clients: int, rng: np.random.Generator) -> None:
        self._state = rng.random(clients) < self.stationary

    def available(self, round: int, clients: int, rng: np.random.Generator) -> np.ndarray:
        if self._state is None or self._state.size != clients:
            raise RuntimeError("MarkovAvailability: reset() must be called before the first round")
        u = rng.random(clients)
        on = self._state
        self._state = np.where(on, u >= self.p_off, u < self.p_on)
        return self._state.copy()

    def __repr__(self) -> str:
        return f"MarkovAvailability(p_off={self.p_off}, p_on={self.p_on})"


class AvailabilityTable(Availability):
    """``table[r - 1, c]``: whether client c is available in round r (bool, shape (rounds, clients))."""

    def __init__(self, table: np.ndarray) -> None:
        arr = np.asarray(table)
        if arr.ndim != 2 or arr.dtype != bool:
            raise ValueError(
                f"availability table must be a bool array (rounds, clients), got {arr.dtype} {arr.shape}"
            )
        self.table = arr.copy()

    def reset(self, clients: int, rng: np.random.Generator) -> None:
        if self.table.shape[1] != clients:
            raise ValueError(
                f"availability table has {self.table.shape[1]} clients, the partitions {clients}"
            )

    def available(self, round: int, clients: int, rng: np.random.Generator) -> np.ndarray:
        if round > self.table.shape[0]:
            raise ValueError(
                f"availability table covers {self.table.shape[0]} rounds, round {round} was asked for"
            )
        return self.table[round - 1].copy()

    def __repr__(self) -> str:
        return f"AvailabilityTable({self.table.shape[0]} rounds x {self.table.shape[1]} clients)"

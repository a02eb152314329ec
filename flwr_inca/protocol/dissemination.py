"""Dissemination phase: turning the final messages into everyone's estimate.

Each final message travels with its injected weight ``omega``, and the estimate is
``sum(y) / sum(omega)`` over the parties online at T: dividing by the weight actually injected, not by
n, as the paper's Sec. 3.2 recommends when parties drop out. Final messages are public in the threat
model (they are DP already), so dissemination needs no privacy of its own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from .._checks import check_int

__all__ = ["Dissemination", "ExactDissemination", "PushSumGossip", "resolve_dissemination"]


class Dissemination(ABC):
    """Combine the finalists' ``(y, omega)`` pairs into estimates."""

    @abstractmethod
    def disseminate(
        self, final: np.ndarray, omega: np.ndarray, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Args: final (m, d) messages and omega (m,) weights of the m finalists.

        Returns ``(estimate (d,), party_estimates (m, d) or None)``.
        """


class ExactDissemination(Dissemination):
    """Finals are published; everyone computes ``sum(y) / sum(omega)`` exactly (float64 sums)."""

    def disseminate(self, final, omega, rng):
        estimate = final.sum(axis=0, dtype=np.float64) / float(omega.sum())
        return estimate, None

    def __repr__(self) -> str:
        return "ExactDissemination()"


class PushSumGossip(Dissemination):
    """Push-sum gossip among the finalists for ``iterations`` rounds (Kempe et al. 2003).

    Each round every finalist keeps half of its ``(y, omega)`` and pushes the other half to one
    finalist chosen uniformly. Weights are column stochastic, so ``sum(y)`` and ``sum(omega)`` are
    conserved and every ratio ``y_i / omega_i`` converges to ``sum(y) / sum(omega)``.
    ``estimate`` is the mean of the finalists' local estimates; ``party_estimates`` holds them.
    """

    def __init__(self, iterations: int = 20) -> None:
        self.iterations = check_int("gossip iterations (T_D)", iterations)

    def disseminate(self, final, omega, rng):
        m = final.shape[0]
        y = final.astype(np.float64)
        w = omega.astype(np.float64).copy()
        if m > 1:
            import scipy.sparse as sp  # here, not at import: a ClientApp process starts per message

            idx = np.arange(m)
            for _ in range(self.iterations):
                target = (idx + rng.integers(1, m, size=m)) % m
                P = sp.csr_matrix(
                    (np.full(2 * m, 0.5), (np.concatenate([idx, target]), np.concatenate([idx, idx]))),
                    shape=(m, m),
                )
                y = P @ y
                w = P @ w
        local = y / w[:, None]
        return local.mean(axis=0), local

    def __repr__(self) -> str:
        return f"PushSumGossip(iterations={self.iterations})"


def resolve_dissemination(dissemination: str | Dissemination) -> Dissemination:
    if isinstance(dissemination, Dissemination):
        return dissemination
    if dissemination == "exact":
        return ExactDissemination()
    if dissemination == "gossip":
        return PushSumGossip()
    if isinstance(dissemination, str) and dissemination.startswith("gossip:"):
        try:
            return PushSumGossip(int(dissemination.split(":", 1)[1]))
        except ValueError:
            pass
    raise ValueError(
        f"dissemination: expected 'exact', 'gossip', 'gossip:<T_D>' or a Dissemination, got {dissemination!r}"
    )

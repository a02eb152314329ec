"""Central DP and local DP: the two ends of the trust spectrum (paper App. D.1).

* Central DP: a trusted curator publishes ``mean(x) + N(0, sigma^2)`` with ``sigma = s / (n mu)``
  (sensitivity of the mean ``s / n`` for a change of one value by ``s``).
* Local DP: each party publishes ``x_i + N(0, sigma^2)`` with ``sigma = s / mu``; the estimate is the
  mean of what was published, with variance ``sigma^2 / n``.

``mu`` comes from the tight analytic Gaussian mechanism (``conversion="analytic"``, Balle & Wang 2018)
or from the classic bound ``mu = epsilon / c``, ``c^2 = 2 ln(1.25/delta)`` (``"classic"``, Dwork &
Roth Thm 3.22, valid for epsilon < 1), which gives the paper's numbers: central-DP MSE
``c^2 / (epsilon^2 n^2)``, local-DP MSE n times that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ..privacy.conversions import classic_mu, mu_for_epsilon
from ..privacy.linear_system import ObservationModel
from .base import (
    BaselineResult,
    LinearGaussianBaseline,
    OutputWeights,
    Threat,
    as_values,
    check_sigma,
    honest_mask,
    noise_rng,
    random_corrupted,
    shaped,
)

__all__ = ["CentralDP", "LocalDP", "gaussian_mu", "gaussian_sigma"]

_TAG_NOISE = 1


def gaussian_mu(epsilon: float, delta: float, conversion: str = "analytic") -> float:
    """The largest mu (sensitivity in units of the noise std) that is (epsilon, delta)-DP."""
    if conversion == "analytic":
        return mu_for_epsilon(epsilon, delta)
    if conversion == "classic":
        return classic_mu(epsilon, delta)
    raise ValueError(f"conversion must be 'analytic' or 'classic', got {conversion!r}")


def gaussian_sigma(epsilon: float, delta: float, sensitivity: float = 1.0, conversion: str = "analytic") -> float:
    """Noise std of the Gaussian mechanism for a query of L2 ``sensitivity`` at (epsilon, delta)."""
    if not (math.isfinite(sensitivity) and sensitivity > 0):
        raise ValueError(f"sensitivity must be a finite number > 0, got {sensitivity!r}")
    return sensitivity / gaussian_mu(epsilon, delta, conversion)


@dataclass(frozen=True)
class CentralDP:
    """A trusted curator adds Gaussian noise to the mean (the best accuracy any mechanism reaches)."""

    epsilon: float
    delta: float
    value_sensitivity: float = 1.0
    conversion: str = "analytic"
    name: ClassVar[str] = "central DP"

    def __post_init__(self) -> None:
        gaussian_sigma(self.epsilon, self.delta, self.value_sensitivity, self.conversion)  # validates

    def noise_std(self, n: int) -> float:
        """Std of the noise on the mean of n values, per coordinate."""
        return gaussian_sigma(self.epsilon, self.delta, self.value_sensitivity / n, self.conversion)

    def expected_mse(self, n: int) -> float:
        return self.noise_std(n) ** 2

    def run(self, x: Any, seed: int | None = None) -> BaselineResult:
        values, scalar = as_values(x)
        n, d = values.shape
        noise = noise_rng(seed, _TAG_NOISE).standard_normal(d) * self.noise_std(n)
        return BaselineResult(shaped(values.mean(axis=0) + noise, scalar), np.arange(n))


@dataclass(frozen=True)
class LocalDP(LinearGaussianBaseline):
    """Every party privatizes its own value before sharing it (safe against any coalition).

    Its adversary view is every noisy value, so it also fits the linear-Gaussian interface
    (``sigma_star`` = the local noise std, no second noise), and the exact certificate of each honest
    party is ``value_sensitivity / sigma_star``.
    """

    sigma_star: float
    sigma_delta: float = 0.0
    name: ClassVar[str] = "local DP"

    def __post_init__(self) -> None:
        check_sigma("sigma_star (local noise std)", self.sigma_star)
        if self.sigma_delta != 0:
            raise ValueError("local DP has a single noise (sigma_star); sigma_delta must be 0")

    @classmethod
    def calibrated(cls, epsilon: float, delta: float, value_sensitivity: float = 1.0,
                   conversion: str = "analytic") -> LocalDP:
        return cls(gaussian_sigma(epsilon, delta, value_sensitivity, conversion))

    def expected_mse(self, n: int) -> float:
        return self.sigma_star**2 / n

    def sample_execution(self, n: int, seed: int | None = None) -> int:
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 2:
            raise ValueError(f"n (number of parties) must be an integer >= 2, got {n!r}")
        return int(n)

    def execute(self, x: Any, execution: int, seed: int | None = None) -> BaselineResult:
        values, scalar = as_values(x)
        n, d = values.shape
        if n != execution:
            raise ValueError(f"x has {n} rows but the execution has {execution} parties")
        noisy = values + self.sigma_star * noise_rng(seed, _TAG_NOISE).standard_normal((n, d))
        return BaselineResult(shaped(noisy.mean(axis=0), scalar), np.arange(n))

    def adversary(self, execution: int, threat: Threat, seed: int | None = None) -> np.ndarray:
        if threat.kind == "collusion":
            return random_corrupted(execution, threat.fraction, seed)
        return np.zeros(0, dtype=np.int64)  # an eavesdropper sees what everybody sees

    def _view_size(self, execution: int, view: np.ndarray) -> tuple[int, int]:
        honest = int(honest_mask(execution, view).sum())
        return honest, honest

    def _observation_model(self, execution: int, view: np.ndarray) -> ObservationModel:
        honest = np.flatnonzero(honest_mask(execution, view))
        eye = np.eye(honest.size)
        rows = np.stack([honest, np.zeros_like(honest)], axis=1)
        return ObservationModel(honest, rows, eye, eye.copy(), np.zeros_like(eye))

    def output_weights(self, execution: int) -> OutputWeights:
        return OutputWeights(np.ones(execution), 0.0, float(execution))

    def honest_outputs(self, execution: int, view: np.ndarray) -> int:
        return int(honest_mask(execution, view).sum())

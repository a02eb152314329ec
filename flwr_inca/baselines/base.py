"""One interface for every averaging mechanism compared with IncA.

Every baseline estimates the mean of n parties' values::

    result = baseline.run(x, seed)        # x: (n, d) or (n,); result.estimate: (d,) or ()

A baseline whose adversary's view is **linear-Gaussian** (IncA, GOPA, CorDP-DME, local DP, the gossip
protocols) also exposes that view, for one execution and one adversary, as an
:class:`~flwr_inca.privacy.linear_system.ObservationModel`::

    execution = baseline.sample_execution(n, seed)     # topology and dropouts; no value, no noise
    view = baseline.adversary(execution, Threat.collusion(0.1), seed=1)
    model = baseline.observation_model(execution, view)

with the two noise scales of IncA's analysis (paper Sec. 4.1): ``x~ = x + eta*`` with
``eta* ~ N(0, sigma_star^2)`` per party, and every other noise term ``~ N(0, sigma_delta^2)`` (IncA's
cancelling terms, GOPA's pairwise terms). The same exact certificate
(:class:`~flwr_inca.privacy.certificate.SensitivityProfile`) then gives every honest party's mu for
any of them, and :func:`flwr_inca.baselines.calibration.calibrate_baseline` calibrates all of them by
one procedure.

Executions are reproducible: ``run(x, seed)`` runs exactly the execution ``sample_execution(n, seed)``
draws, so a calibration over simulated executions and the runs that measure accuracy share their
topologies and dropouts when they share seeds.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._checks import check_bytes
from ..privacy.certificate import SensitivityProfile
from ..privacy.linear_system import ObservationModel
from ..privacy.views import coalition_size
from ..protocol.engine import as_values as engine_values

__all__ = [
    "Baseline",
    "BaselineResult",
    "LinearGaussianBaseline",
    "OutputWeights",
    "Threat",
    "as_values",
    "exact_model_bytes",
    "noise_rng",
    "random_corrupted",
]


@dataclass(frozen=True)
class Threat:
    """A passive adversary: ``"collusion"`` corrupts a fraction of the parties (Collusion DP);
    ``"eavesdrop"`` intercepts a fraction of the messages of each iteration (Eavesdrop DP)."""

    kind: str
    fraction: float

    def __post_init__(self) -> None:
        if self.kind not in ("collusion", "eavesdrop"):
            raise ValueError(f"threat kind must be 'collusion' or 'eavesdrop', got {self.kind!r}")
        f = float(self.fraction)
        upper_ok = f < 1.0 if self.kind == "collusion" else f <= 1.0
        if not (math.isfinite(f) and f >= 0.0 and upper_ok):
            allowed = "[0, 1)" if self.kind == "collusion" else "[0, 1]"
            raise ValueError(f"{self.kind} fraction must be in {allowed}, got {self.fraction!r}")

    @classmethod
    def collusion(cls, fraction: float) -> Threat:
        return cls("collusion", fraction)

    @classmethod
    def eavesdrop(cls, fraction: float) -> Threat:
        return cls("eavesdrop", fraction)

    def __str__(self) -> str:
        return f"{self.kind} {self.fraction:g}"


@dataclass
class BaselineResult:
    """Outcome of one run of a baseline.

    Attributes:
        estimate: the estimate of the mean, shape (d,) (or () for scalar values).
        outputs: indices of the parties whose values enter the estimate.
        party_estimates: (n, d) each party's own estimate (gossip protocols), else None.
        details: protocol-specific facts (e.g. how many pairwise terms did not cancel).
    """

    estimate: np.ndarray
    outputs: np.ndarray
    party_estimates: np.ndarray | None = None
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class OutputWeights:
    """How the estimate depends on the noisy values and on the other noise terms of one execution:
    ``estimate = (b . x~ + a . eta) / total`` with ``a`` the coefficients of the unit noise terms that
    do not cancel (only ``sum(a^2)`` matters).

    For values drawn i.i.d. with variance V per coordinate, the expected squared error against the
    plain mean of all n values is ``V ||b/total - 1/n||^2 + (s*^2 ||b||^2 + sD^2 sum(a^2)) / total^2``.
    """

    b: np.ndarray  # (n,)
    a_squared: float
    total: float

    @property
    def value_loss(self) -> float:
        """``||b/total - 1/n||^2``: the share of the values missing from (or over-weighted in) the output."""
        if self.total <= 0:
            return math.inf
        n = self.b.size
        return float(np.sum((self.b / self.total - 1.0 / n) ** 2))

    @property
    def star_coefficient(self) -> float:
        return float(self.b @ self.b) / self.total**2 if self.total > 0 else math.inf

    @property
    def delta_coefficient(self) -> float:
        return self.a_squared / self.total**2 if self.total > 0 else math.inf

    def noise_variance(self, sigma_star: float, sigma_delta: float) -> float:
        """Per-coordinate variance of the noise in the estimate (the paper's lower bound for CorDP-DME
        when only the uncancelled noise is counted)."""
        if self.total <= 0:
            return math.inf
        delta_part = sigma_delta**2 * self.delta_coefficient if sigma_delta > 0 else 0.0
        return sigma_star**2 * self.star_coefficient + delta_part

    def expected_mse(self, sigma_star: float, sigma_delta: float, value_variance: float = 1.0 / 12.0) -> float:
        if self.total <= 0:
            return math.inf
        return value_variance * self.value_loss + self.noise_variance(sigma_star, sigma_delta)


class Baseline(ABC):
    """A mechanism that estimates the mean of n parties' values."""

    name: str = "baseline"

    @abstractmethod
    def run(self, x: Any, seed: int | None = None) -> BaselineResult:
        """Estimate the mean of the rows of ``x`` ((n, d) or (n,)); ``seed`` fixes every random draw."""


class LinearGaussianBaseline(Baseline):
    """A baseline whose adversary's view is linear-Gaussian (see the module docstring).

    Subclasses have ``sigma_star`` (std of the independent noise on each value) and ``sigma_delta``
    (std of every other noise term; 0 if there is none) in value units, and implement the abstract
    methods below (``_view_size`` says how large a view is before ``_observation_model`` builds it, so
    that an execution too large to certify is refused, not allocated); ``run`` is
    ``execute(x, sample_execution(n, seed), seed)``.
    """

    sigma_star: float
    sigma_delta: float

    @abstractmethod
    def sample_execution(self, n: int, seed: int | None = None) -> Any:
        """What happens in a run of n parties (topology, dropouts), without values or noise."""

    @abstractmethod
    def execute(self, x: Any, execution: Any, seed: int | None = None) -> BaselineResult:
        """Run ``execution`` on the values ``x`` with noise drawn from ``seed``."""

    @abstractmethod
    def adversary(self, execution: Any, threat: Threat, seed: int | None = None) -> Any:
        """A random adversary of the given threat for this execution (e.g. the corrupted set)."""

    def observation_model(self, execution: Any, view: Any) -> ObservationModel:
        """The adversary's view of the honest parties, for unit noise variances.

        Refused (:meth:`check_size`) before anything is built when it does not fit in memory."""
        self.check_size(execution, view)
        return self._observation_model(execution, view)

    def check_size(self, execution: Any, view: Any) -> None:
        """Raise ``ValueError`` (one line) if the view of ``execution`` and its exact certificate would need
        more memory than :func:`~flwr_inca._checks.memory_limit` allows; builds nothing."""
        rows, honest = self._view_size(execution, view)
        check_bytes(f"the exact certificate of one {self.name} run ({rows} observed values of {honest} honest "
                    "parties)", max(exact_model_bytes(rows, honest), self._builder_bytes(execution, rows, honest)),
                    "fewer parties")

    @abstractmethod
    def _observation_model(self, execution: Any, view: Any) -> ObservationModel:
        """:meth:`observation_model` once its size has been checked."""

    @abstractmethod
    def _view_size(self, execution: Any, view: Any) -> tuple[int, int]:
        """``(rows, honest)``: the values the adversary observes and the honest parties of the view,
        without building it."""

    def _builder_bytes(self, execution: Any, rows: int, honest: int) -> float:
        """Peak bytes of building a view of ``rows`` observed values of ``honest`` honest parties of
        ``execution``, where it needs more than its certificate (default: 0)."""
        return 0.0

    def sensitivity_profile(self, execution: Any, view: Any) -> SensitivityProfile:
        """The exact certificate of every honest party of ``execution`` against ``view`` (unit value
        sensitivity; its ``mu(sigma_star, sigma_delta)`` for any noise levels)."""
        return SensitivityProfile.from_model(self.observation_model(execution, view))

    @abstractmethod
    def output_weights(self, execution: Any) -> OutputWeights:
        """How the estimate of ``execution`` depends on the noisy values and the noise."""

    @abstractmethod
    def honest_outputs(self, execution: Any, view: Any) -> int:
        """How many honest parties' values enter the estimate (n_O of the exact calibration)."""

    def with_sigmas(self, sigma_star: float, sigma_delta: float) -> LinearGaussianBaseline:
        """A copy with other noise levels (value units)."""
        for name, v in (("sigma_star", sigma_star), ("sigma_delta", sigma_delta)):
            if not (math.isfinite(float(v)) and float(v) >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        return dataclasses.replace(self, sigma_star=float(sigma_star), sigma_delta=float(sigma_delta))

    def run(self, x: Any, seed: int | None = None) -> BaselineResult:
        values, _ = as_values(x)
        return self.execute(x, self.sample_execution(values.shape[0], seed), seed)


# ------------------------------------------------------------------------------------------- helpers
def exact_model_bytes(rows: int, honest: int) -> float:
    """Estimated peak bytes of a view of ``rows`` observed values of ``honest`` honest parties and its exact
    certificate (:meth:`SensitivityProfile.from_model`), all dense float64: the (rows, rows) Grams (one of
    them first built sparse), their sum and factor, the (rows, honest) observation and whitened targets,
    the (honest, honest) eigenbasis. Measured peaks are 0.6 to 0.95 times it (tests/test_baselines.py)."""
    m, h = float(rows), float(honest)
    return 8.0 * (6.0 * m * m + 5.0 * m * h + 3.0 * h * h)


def as_values(x: Any) -> tuple[np.ndarray, bool]:
    """(n, d) float64 values and whether the input was (n,) scalars: the checks (and errors) of
    :func:`flwr_inca.run_inca`'s input, then float64, which every baseline computes in."""
    arr, scalar = engine_values(x)
    return np.ascontiguousarray(arr, dtype=np.float64), scalar


def shaped(estimate: np.ndarray, scalar: bool) -> np.ndarray:
    return np.asarray(estimate).reshape(()) if scalar else np.asarray(estimate)


def random_corrupted(n: int, fraction: float, seed: int | None) -> np.ndarray:
    """``ceil(fraction * n)`` corrupted parties (at most n - 1), drawn exactly as
    :func:`flwr_inca.privacy.random_collusion` draws them, so that baselines compared on the same
    seeds face the same coalition."""
    Threat.collusion(fraction)
    count = min(coalition_size(float(fraction), n), n - 1)
    return np.sort(np.random.default_rng(seed).choice(n, size=count, replace=False))


def noise_rng(seed: int | None, tag: int) -> np.random.Generator:
    """An independent generator per (seed, purpose); fresh entropy when seed is None."""
    if seed is None:
        return np.random.default_rng()
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer or None, got {seed!r}")
    return np.random.default_rng([int(seed), 0x5EED, tag])


def check_positive_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def check_sigma(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    v = float(value)
    if not (math.isfinite(v) and v >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return v


def honest_mask(n: int, corrupted: np.ndarray) -> np.ndarray:
    mask = np.ones(n, dtype=bool)
    mask[np.asarray(corrupted, dtype=np.int64)] = False
    return mask

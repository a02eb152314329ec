"""The statistics of an audit by attack: confidence intervals and empirical privacy lower bounds.

* The reconstruction attack's error std, from ``N`` independent errors of an unbiased estimator:
  ``N s^2 / sigma^2 ~ chi^2_N`` (s^2 the mean squared error) gives an exact interval for sigma.
* The distinguishing attack's true- and false-positive rates, from counts: Clopper-Pearson intervals
  (exact binomial), as in the DP-auditing literature (Jagielski et al. 2020, Nasr et al. 2021).
* From the rates, two lower bounds on the privacy loss that any valid certificate must respect:
  (epsilon, delta)-DP forces ``TPR <= e^eps FPR + delta`` and ``1 - FPR <= e^eps (1 - TPR) + delta``
  for every test, so ``eps >= log((TPR - delta) / FPR)`` and ``eps >= log((1 - FPR - delta) / (1 - TPR))``;
  mu-GDP forces ``TPR <= Phi(Phi^-1(FPR) + mu)`` (the trade-off curve ``Phi(Phi^-1(1 - alpha) - mu)`` of
  Dong, Roth & Su), so ``mu >= Phi^-1(TPR) - Phi^-1(FPR)``.

Conservative ends use the interval ends that make the bound smallest (the lower end of TPR, the upper
end of FPR), so an interval's lower end is a lower bound at its confidence whatever the mechanism.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.special import betaincinv, gammaincinv, ndtr, ndtri

__all__ = [
    "Rates",
    "choose_threshold",
    "clopper_pearson",
    "epsilon_from_rates",
    "gdp_tradeoff_tpr",
    "mu_from_rates",
    "std_interval",
]


def std_interval(sum_squares: float, count: int, alpha: float) -> tuple[float, float]:
    """Two-sided ``1 - alpha`` interval for sigma from ``count`` i.i.d. N(0, sigma^2) errors whose squares
    sum to ``sum_squares`` (``sum_squares / sigma^2 ~ chi^2_count``)."""
    low = math.sqrt(sum_squares / _chi2_quantile(1 - alpha / 2, count))
    high = math.sqrt(sum_squares / _chi2_quantile(alpha / 2, count))
    return low, high


# quantiles through scipy.special: scipy.stats would add half a second to importing flwr_inca.privacy
def _chi2_quantile(q: float, dof: int) -> float:
    return 2.0 * float(gammaincinv(dof / 2.0, q))


def _beta_quantile(q, a, b):
    return betaincinv(a, b, q)


def clopper_pearson(successes: float, trials: int, alpha: float) -> tuple[float, float]:
    """Exact two-sided ``1 - alpha`` binomial interval for a rate (``successes`` of ``trials``).

    ``successes`` may be fractional (an expected count, when planning a test)."""
    k, n = float(successes), int(trials)
    low = 0.0 if k <= 0 else float(_beta_quantile(alpha / 2, k, n - k + 1))
    high = 1.0 if k >= n else float(_beta_quantile(1 - alpha / 2, k + 1, n - k))
    return low, high


def epsilon_from_rates(tpr: float, fpr: float, delta: float) -> float:
    """The smallest epsilon an (epsilon, delta)-DP mechanism may have if some test reaches these rates
    (0 when the rates force nothing; inf when no epsilon allows them)."""
    bounds = [0.0]
    for hit, miss in ((tpr - delta, fpr), (1.0 - fpr - delta, 1.0 - tpr)):
        if hit > 0:
            bounds.append(math.log(hit / miss) if miss > 0 else math.inf)
    return max(bounds)


def mu_from_rates(tpr: float, fpr: float) -> float:
    """The smallest mu a mu-GDP mechanism may have if some test reaches these rates (0 when none)."""
    if tpr <= fpr:
        return 0.0
    return float(ndtri(tpr) - ndtri(fpr))  # +inf when tpr = 1 or fpr = 0


def gdp_tradeoff_tpr(fpr: np.ndarray, mu: float) -> np.ndarray:
    """The largest TPR a mu-GDP mechanism allows at each FPR: ``1 - Phi(Phi^-1(1 - FPR) - mu)``."""
    return ndtr(ndtri(np.asarray(fpr, dtype=float)) + mu)


@dataclass(frozen=True)
class Rates:
    """The outcome of one threshold test on the runs: ``S > threshold`` guesses the larger value.

    ``tpr_interval``/``fpr_interval`` are Clopper-Pearson intervals; :meth:`epsilon` and :meth:`mu` give
    the point value and the interval of each lower bound (low end: the conservative rates)."""

    threshold: float
    true_positives: int
    positives: int
    false_positives: int
    negatives: int
    alpha: float  # two-sided level of each rate's interval

    @property
    def tpr(self) -> float:
        return self.true_positives / self.positives

    @property
    def fpr(self) -> float:
        return self.false_positives / self.negatives

    @property
    def tpr_interval(self) -> tuple[float, float]:
        return clopper_pearson(self.true_positives, self.positives, self.alpha)

    @property
    def fpr_interval(self) -> tuple[float, float]:
        return clopper_pearson(self.false_positives, self.negatives, self.alpha)

    def epsilon(self, delta: float) -> tuple[float, tuple[float, float]]:
        (t_lo, t_hi), (f_lo, f_hi) = self.tpr_interval, self.fpr_interval
        return (epsilon_from_rates(self.tpr, self.fpr, delta),
                (epsilon_from_rates(t_lo, f_hi, delta), epsilon_from_rates(t_hi, f_lo, delta)))

    def mu(self) -> tuple[float, tuple[float, float]]:
        (t_lo, t_hi), (f_lo, f_hi) = self.tpr_interval, self.fpr_interval
        return mu_from_rates(self.tpr, self.fpr), (mu_from_rates(t_lo, f_hi), mu_from_rates(t_hi, f_lo))

    @classmethod
    def count(cls, statistic: np.ndarray, labels: np.ndarray, threshold: float, alpha: float) -> Rates:
        """Rates of the test ``statistic > threshold`` on runs labelled 1 (the larger value) or 0."""
        guess = statistic > threshold
        ones = labels.astype(bool)
        return cls(float(threshold), int(np.sum(guess & ones)), int(ones.sum()),
                   int(np.sum(guess & ~ones)), int((~ones).sum()), alpha)


def choose_threshold(scale: float, shift: float, positives: int, negatives: int, alpha: float,
                     objective: str, delta: float = 0.0) -> float:
    """The threshold that maximizes the expected conservative bound of ``objective`` (``"mu"`` or
    ``"epsilon"``), for a statistic the attacker predicts to be N(0, scale^2) under the smaller value and
    N(shift, scale^2) under the larger. The choice uses the attacker's model only, never the runs it is
    evaluated on, so the Clopper-Pearson intervals of the evaluation stay valid."""
    if not (math.isfinite(scale) and scale > 0):
        return shift / 2
    separation = shift / scale
    u = np.linspace(-6.0, separation + 6.0, 1201)  # thresholds in units of the predicted std
    k_true, k_false = ndtr(separation - u) * positives, ndtr(-u) * negatives  # expected counts
    with np.errstate(divide="ignore", invalid="ignore"):
        t_low = np.where(k_true > 0, _beta_quantile(alpha / 2, k_true, positives - k_true + 1), 0.0)
        f_high = np.where(k_false < negatives, _beta_quantile(1 - alpha / 2, k_false + 1, negatives - k_false),
                          1.0)
        if objective == "mu":
            value = np.where(t_low > f_high, ndtri(t_low) - ndtri(f_high), 0.0)
        else:
            value = np.maximum(np.log(np.maximum(t_low - delta, 0.0) / f_high),
                               np.log(np.maximum(1.0 - f_high - delta, 0.0) / (1.0 - t_low)))
    value = np.where(np.isfinite(value), value, -np.inf)  # an infinite bound at the grid's end is a fluke
    return float(u[int(np.argmax(value))]) * scale

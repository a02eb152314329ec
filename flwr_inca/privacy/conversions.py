"""Conversions between mu-GDP and (epsilon, delta)-DP.

The adversary's view of an honest party in IncA is exactly a Gaussian mechanism with sensitivity
``mu`` in units of the noise (SPEC §4), so the tight (epsilon, delta) curve is the analytic Gaussian
mechanism of Balle & Wang (2018):

    delta(epsilon) = Phi(-epsilon/mu + mu/2) - e^epsilon Phi(-epsilon/mu - mu/2).

The paper's classic bound ``mu <= epsilon / c`` with ``c^2 = 2 ln(1.25/delta)`` (Dwork & Roth, valid
only for epsilon < 1) is provided for comparison; it is always at least as conservative.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.optimize import brentq
from scipy.special import log_ndtr

__all__ = [
    "log_delta_for_epsilon",
    "delta_for_epsilon",
    "epsilon_for_delta",
    "mu_for_epsilon",
    "classic_c",
    "classic_mu",
    "classic_epsilon",
]


def _check_mu(mu: float) -> float:
    m = float(mu)
    if not (m >= 0) or math.isnan(m):
        raise ValueError(f"mu must be >= 0, got {mu!r}")
    return m


def _check_delta(delta: float) -> float:
    d = float(delta)
    if not (0.0 < d < 1.0):
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    return d


def _check_epsilon(epsilon: float) -> float:
    e = float(epsilon)
    if not (e > 0) or not math.isfinite(e):
        raise ValueError(f"epsilon must be a finite number > 0, got {epsilon!r}")
    return e


def _log1mexp(x: float) -> float:
    """log(1 - e^x) for x <= 0, accurate at both ends."""
    if x >= 0.0:
        return -math.inf
    return math.log(-math.expm1(x)) if x > -math.log(2.0) else math.log1p(-math.exp(x))


def log_delta_for_epsilon(mu: float, epsilon: float) -> float:
    """``log delta(epsilon)`` of a mu-GDP mechanism, in log space so that neither ``e^epsilon`` nor
    ``Phi`` under/overflows: ``log Phi(a) + log(1 - e^(eps + log Phi(b) - log Phi(a)))``."""
    mu = _check_mu(mu)
    eps = float(epsilon)
    if eps < 0 or math.isnan(eps):
        raise ValueError(f"epsilon must be >= 0, got {epsilon!r}")
    if mu == 0:
        return -math.inf
    if math.isinf(mu):
        return 0.0
    la = float(log_ndtr(-eps / mu + mu / 2))
    lb = eps + float(log_ndtr(-eps / mu - mu / 2))
    return la + _log1mexp(lb - la)  # lb < la mathematically; rounding gives delta = 0


def delta_for_epsilon(mu: float, epsilon: float) -> float:
    """Smallest delta such that a mu-GDP mechanism is (epsilon, delta)-DP (exact)."""
    return math.exp(log_delta_for_epsilon(mu, epsilon))


def epsilon_for_delta(mu: float, delta: float) -> float:
    """Smallest epsilon >= 0 such that a mu-GDP mechanism is (epsilon, delta)-DP (exact)."""
    mu = _check_mu(mu)
    log_target = math.log(_check_delta(delta))
    if mu == 0:
        return 0.0
    if math.isinf(mu):
        return math.inf

    def f(e: float) -> float:  # decreasing in e
        return log_delta_for_epsilon(mu, e) - log_target

    if f(0.0) <= 0:
        return 0.0
    hi = max(1.0, mu * mu / 2 + 10 * mu)
    while f(hi) > 0:
        hi *= 2
    eps = float(brentq(f, 0.0, hi, xtol=1e-13, rtol=1e-13))
    while f(eps) > 0:  # make sure the returned epsilon really holds
        eps = float(np.nextafter(eps, math.inf))
    return eps


def mu_for_epsilon(epsilon: float, delta: float) -> float:
    """Largest mu such that mu-GDP implies (epsilon, delta)-DP (exact; inverse of the above)."""
    epsilon = _check_epsilon(epsilon)
    log_target = math.log(_check_delta(delta))

    def g(log_mu: float) -> float:  # increasing in mu
        return log_delta_for_epsilon(math.exp(log_mu), epsilon) - log_target

    lo, hi = math.log(1e-3), 0.0
    while g(lo) > 0:
        lo -= 2.0
    while g(hi) < 0:
        hi += 1.0
    mu = math.exp(float(brentq(g, lo, hi, xtol=1e-14, rtol=1e-14)))
    while log_delta_for_epsilon(mu, epsilon) > log_target:  # step to the safe side of the root
        mu = float(np.nextafter(mu, 0.0))
    return mu


def classic_c(delta: float) -> float:
    """``c = sqrt(2 ln(1.25/delta))`` of the classic Gaussian mechanism bound."""
    return math.sqrt(2.0 * math.log(1.25 / _check_delta(delta)))


def classic_mu(epsilon: float, delta: float) -> float:
    """The paper's Theorem 4.1 threshold ``mu <= epsilon / c`` (requires epsilon < 1)."""
    epsilon = _check_epsilon(epsilon)
    if epsilon >= 1:
        raise ValueError(f"the classic bound needs epsilon < 1, got {epsilon!r}")
    return epsilon / classic_c(delta)


def classic_epsilon(mu: float, delta: float) -> float:
    """epsilon = mu * c from the classic bound; ``inf`` when that is >= 1 (bound not valid)."""
    eps = _check_mu(mu) * classic_c(delta)
    return eps if eps < 1 else math.inf

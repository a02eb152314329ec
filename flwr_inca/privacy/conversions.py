"""Conversions between mu-GDP and (epsilon, delta)-DP.

The adversary's view of an honest party in IncA is exactly a Gaussian mechanism with sensitivity
``mu`` in units of the noise (paper Sec. 4.1-4.2; the projected Gaussian mechanism of Koskela &
Kulkarni), so the tight (epsilon, delta) curve is the analytic Gaussian mechanism of Balle & Wang (2018):

    delta(epsilon) = Phi(-epsilon/mu + mu/2) - e^epsilon Phi(-epsilon/mu - mu/2).

The paper's classic bound ``mu <= epsilon / c`` with ``c^2 = 2 ln(1.25/delta)`` (Dwork & Roth, valid
only for epsilon < 1) is provided for comparison; it is always at least as conservative.
"""

from __future__ import annotations

import math

from scipy.special import log_ndtr

from .._checks import check_real

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
    return check_real("mu", mu, 0.0, finite=False)


def _check_delta(delta: float) -> float:
    return check_real("delta", delta, 0.0, 1.0, low_open=True, high_open=True)


def _check_epsilon(epsilon: float) -> float:
    return check_real("epsilon", epsilon, 0.0, low_open=True)


def _log1mexp(x: float) -> float:
    """log(1 - e^x) for x <= 0, accurate at both ends."""
    if x >= 0.0:
        return -math.inf
    return math.log(-math.expm1(x)) if x > -math.log(2.0) else math.log1p(-math.exp(x))


def log_delta_for_epsilon(mu: float, epsilon: float) -> float:
    """``log delta(epsilon)`` of a mu-GDP mechanism, in log space so that neither ``e^epsilon`` nor
    ``Phi`` under/overflows: ``log Phi(a) + log(1 - e^(eps + log Phi(b) - log Phi(a)))``."""
    return _log_delta(_check_mu(mu), check_real("epsilon", epsilon, 0.0, finite=False))


def _log_delta(mu: float, eps: float) -> float:
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


# Bisection stops when the bracket is this narrow relative to its safe end: the answer is then within
# about one part in 10^13 of the exact one, and never on the unsafe side of it.
_RTOL = 1e-13


def epsilon_for_delta(mu: float, delta: float) -> float:
    """Smallest epsilon >= 0 such that a mu-GDP mechanism is (epsilon, delta)-DP (exact).

    Safe side: ``delta_for_epsilon(mu, result) <= delta`` holds for the returned float itself (it is
    the upper end of a bisection bracket, where the condition was evaluated).
    """
    mu = _check_mu(mu)
    log_target = math.log(_check_delta(delta))
    if mu == 0:
        return 0.0
    if math.isinf(mu):
        return math.inf
    if _log_delta(mu, 0.0) <= log_target:
        return 0.0
    lo, hi = 0.0, max(1.0, mu * mu / 2 + 10 * mu)  # log delta(eps) decreases in eps
    while _log_delta(mu, hi) > log_target:
        lo, hi = hi, 2 * hi
    while hi - lo > _RTOL * hi:
        mid = 0.5 * (lo + hi)
        if not lo < mid < hi:  # adjacent floats
            break
        if _log_delta(mu, mid) <= log_target:
            hi = mid
        else:
            lo = mid
    return hi


def mu_for_epsilon(epsilon: float, delta: float) -> float:
    """Largest mu such that mu-GDP implies (epsilon, delta)-DP (exact; inverse of the above).

    Safe side: ``delta_for_epsilon(result, epsilon) <= delta`` holds for the returned float itself.
    """
    epsilon = _check_epsilon(epsilon)
    log_target = math.log(_check_delta(delta))
    lo, hi = 1e-3, 1.0  # log delta(mu) increases in mu
    while _log_delta(lo, epsilon) > log_target:
        lo, hi = lo / 8, lo
    while _log_delta(hi, epsilon) <= log_target:
        lo, hi = hi, 2 * hi
    while hi - lo > _RTOL * lo:
        mid = math.sqrt(lo * hi)  # mu spans orders of magnitude: bisect its logarithm
        if not lo < mid < hi:
            break
        if _log_delta(mid, epsilon) <= log_target:
            lo = mid
        else:
            hi = mid
    return lo


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

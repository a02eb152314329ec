import math

import numpy as np
import pytest
from scipy.stats import norm

from flwr_inca.privacy import (
    classic_epsilon,
    classic_mu,
    delta_for_epsilon,
    epsilon_for_delta,
    mu_for_epsilon,
)


def _naive_delta(mu, eps):
    return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2)


@pytest.mark.parametrize("mu", [0.05, 0.3, 1.0, 2.5, 6.0])
@pytest.mark.parametrize("eps", [0.0, 0.1, 1.0, 4.0])
def test_delta_matches_balle_wang_formula(mu, eps):
    assert delta_for_epsilon(mu, eps) == pytest.approx(max(_naive_delta(mu, eps), 0.0), rel=1e-9, abs=1e-300)


@pytest.mark.parametrize("mu", [1e-4, 0.01, 0.2, 1.0, 3.0, 20.0, 100.0])
@pytest.mark.parametrize("delta", [1e-3, 1e-5, 1e-10, 1e-50])
def test_epsilon_round_trip_and_validity(mu, delta):
    eps = epsilon_for_delta(mu, delta)
    assert delta_for_epsilon(mu, eps) <= delta * (1 + 1e-9)
    if eps > 0:
        assert delta_for_epsilon(mu, eps * (1 - 1e-6)) > delta  # tight: a hair less is not enough
        assert mu_for_epsilon(eps, delta) == pytest.approx(mu, rel=1e-7)


def test_mu_for_epsilon_is_safe_side():
    for eps in [0.05, 0.2, 1.0, 8.0, 300.0]:
        for delta in [1e-5, 1e-9]:
            mu = mu_for_epsilon(eps, delta)
            assert delta_for_epsilon(mu, eps) <= delta


def test_agrees_with_opacus_gdp_conversion():
    gdp = pytest.importorskip("opacus.accountants.analysis.gdp")
    for mu in [0.1, 0.5, 1.0, 2.0, 5.0, 20.0]:
        assert epsilon_for_delta(mu, 1e-5) == pytest.approx(gdp.eps_from_mu(mu=mu, delta=1e-5), rel=1e-8)


def test_agrees_with_dp_accounting_gaussian_mechanism():
    dpa = pytest.importorskip("dp_accounting")
    for mu in [0.03, 0.5, 1.0, 7.0, 40.0]:
        for delta in [1e-5, 1e-12]:
            assert epsilon_for_delta(mu, delta) == pytest.approx(dpa.get_epsilon_gaussian(1 / mu, delta), rel=1e-7)
    assert mu_for_epsilon(1.0, 1e-5) == pytest.approx(1 / dpa.get_sigma_gaussian(1.0, 1e-5), rel=1e-7)


def test_agrees_with_opacus_prv_without_subsampling():
    accountants = pytest.importorskip("opacus.accountants")
    for mu in [0.5, 2.0]:
        acc = accountants.PRVAccountant()
        acc.history = [(1.0 / mu, 1.0, 1)]
        with np.errstate(divide="ignore"):
            prv = acc.get_epsilon(delta=1e-5, eps_error=1e-3)
        exact = epsilon_for_delta(mu, 1e-5)
        assert exact <= prv <= exact + 3e-3  # PRV is an upper bound within eps_error


def test_classic_bound_is_looser_as_spec_says():
    # SPEC §4: at eps = 0.2, delta = 1e-5 the classic bound allows 2.2x less variance than needed
    ratio = (mu_for_epsilon(0.2, 1e-5) / classic_mu(0.2, 1e-5)) ** 2
    assert ratio == pytest.approx(2.2, abs=0.05)
    for mu in [0.01, 0.05, 0.1]:
        assert classic_epsilon(mu, 1e-5) >= epsilon_for_delta(mu, 1e-5)
    assert classic_epsilon(1.0, 1e-5) == math.inf  # outside eps < 1 the bound says nothing
    with pytest.raises(ValueError, match="epsilon < 1"):
        classic_mu(1.5, 1e-5)


@pytest.mark.parametrize("bad", [0.0, 1.0, -1e-5, float("nan")])
def test_bad_delta_rejected(bad):
    with pytest.raises(ValueError, match=r"delta must be in \(0, 1\)"):
        epsilon_for_delta(1.0, bad)


def test_bad_mu_and_epsilon_rejected():
    with pytest.raises(ValueError, match="mu must be >= 0"):
        epsilon_for_delta(-1.0, 1e-5)
    with pytest.raises(ValueError, match="epsilon must be a finite number > 0"):
        mu_for_epsilon(0.0, 1e-5)
    assert epsilon_for_delta(0.0, 1e-5) == 0.0
    assert epsilon_for_delta(math.inf, 1e-5) == math.inf


# ------------------------------------------------------------------------------ bisection on the safe side
def _hockey_stick_delta(mu, eps, points=400_001):
    """delta(eps) of N(mu, 1) vs N(0, 1) by brute force: the hockey-stick divergence
    integral of max(0, p(x) - e^eps q(x)) dx on a fine grid (trapezoid rule)."""
    x = np.linspace(-12.0, mu + 12.0, points)
    integrand = np.maximum(0.0, norm.pdf(x, loc=mu) - math.exp(eps) * norm.pdf(x))
    return float(np.sum(integrand[1:] + integrand[:-1]) * (x[1] - x[0]) / 2)


@pytest.mark.parametrize("mu, delta", [(0.3, 1e-3), (1.0, 1e-5), (2.0, 1e-4), (4.0, 1e-6)])
def test_epsilon_for_delta_against_the_hockey_stick_integral(mu, delta):
    eps = epsilon_for_delta(mu, delta)
    # valid and tight, up to the integral's own accuracy (about 1e-9 relative here)
    assert _hockey_stick_delta(mu, eps) <= delta * (1 + 1e-6)
    assert _hockey_stick_delta(mu, eps * (1 - 1e-4)) > delta
    assert mu_for_epsilon(eps, delta) == pytest.approx(mu, rel=1e-9)


@pytest.mark.parametrize("mu", [1e-6, 1e-4, 0.01, 0.5, 3.0, 50.0, 1000.0])
@pytest.mark.parametrize("delta", [0.5, 1e-5, 1e-12, 1e-100])
def test_the_returned_float_itself_is_on_the_safe_side(mu, delta):
    from flwr_inca.privacy.conversions import log_delta_for_epsilon

    eps = epsilon_for_delta(mu, delta)
    assert log_delta_for_epsilon(mu, eps) <= math.log(delta)
    if eps > 0:  # and tight: a relative 1e-9 less is not valid any more (delta(eps) is only computed
        # to about 1e-11 relative where it is flat, so no method can promise more)
        assert log_delta_for_epsilon(mu, eps * (1 - 1e-9)) > math.log(delta)
        mu_back = mu_for_epsilon(eps, delta)
        assert log_delta_for_epsilon(mu_back, eps) <= math.log(delta)
        assert log_delta_for_epsilon(mu_back * (1 + 1e-9), eps) > math.log(delta)


def test_conversions_are_monotone():
    mus = np.geomspace(1e-5, 200.0, 60)
    for delta in (1e-3, 1e-7):
        eps = [epsilon_for_delta(m, delta) for m in mus]
        assert all(a < b or a == b == 0.0 for a, b in zip(eps, eps[1:]))  # 0 while delta(0) <= delta
        assert eps[-1] > 0
    deltas = np.geomspace(1e-14, 0.2, 40)
    eps = [epsilon_for_delta(1.0, d) for d in deltas]
    assert all(a > b for a, b in zip(eps, eps[1:]))
    epsilons = np.geomspace(1e-3, 100.0, 50)
    mus_back = [mu_for_epsilon(e, 1e-5) for e in epsilons]
    assert all(a < b for a, b in zip(mus_back, mus_back[1:]))
    assert mu_for_epsilon(1.0, 1e-3) > mu_for_epsilon(1.0, 1e-6)


@pytest.mark.parametrize("mu, delta", [(1e-4, 1e-5), (1e-6, 1e-12), (500.0, 1e-10)])
def test_conversions_need_few_evaluations_whatever_the_case(mu, delta, monkeypatch):
    # the speed of a bisection, independent of the machine: at most about a hundred evaluations of
    # delta(epsilon), where stepping one float at a time to the safe side once took 1.33 million
    from flwr_inca.privacy import conversions

    calls = []
    original = conversions._log_delta
    monkeypatch.setattr(conversions, "_log_delta", lambda m, e: (calls.append(1), original(m, e))[1])
    eps = conversions.epsilon_for_delta(mu, delta)
    assert len(calls) <= 120, len(calls)
    calls.clear()
    conversions.mu_for_epsilon(eps, delta)
    assert len(calls) <= 120, len(calls)


@pytest.mark.slow
def test_conversions_agree_with_dp_accounting_on_a_dense_grid():
    dpa = pytest.importorskip("dp_accounting")
    for mu in np.geomspace(0.02, 30.0, 80):
        for delta in (1e-3, 1e-6, 1e-9):
            theirs = dpa.get_epsilon_gaussian(1 / mu, delta)
            assert epsilon_for_delta(mu, delta) == pytest.approx(theirs, rel=1e-7)

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

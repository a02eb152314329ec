"""certify() at one pair of sigmas: the Cholesky path (certificate._FixedSigmas) agrees with the pencil
method (SensitivityProfile, every pair) and with the brute-force pseudo-inverse of tests/reference.py,
and falls back to the pencil method where the covariance is singular."""

import math

import numpy as np
import pytest
from reference import brute_force_mu
from test_bound import _case

from flwr_inca import IncaConfig
from flwr_inca.privacy import certify, profile, random_collusion
from flwr_inca.privacy.certificate import SensitivityProfile, _FixedSigmas
from flwr_inca.privacy.linear_system import build_model
from flwr_inca.protocol import sample_trace


def test_fixed_sigmas_match_the_pencil_method_on_200_random_executions():
    used = 0
    for index in range(200):
        trace, view = _case(index, seed=5)
        s_star, s_delta = trace.sigma_star, trace.sigma_delta
        model = build_model(trace, view)
        fixed = _FixedSigmas.from_model(model, s_star, s_delta)
        pencil = SensitivityProfile.from_model(model).mu(s_star, s_delta)
        if fixed is None:  # singular covariance: certify uses the pencil method
            continue
        used += 1
        got = fixed.mu(s_star, s_delta)
        finite = np.isfinite(pencil)
        assert np.all(finite), index  # an invertible covariance represents every h
        np.testing.assert_allclose(got, pencil, rtol=1e-7, atol=1e-10 / s_star, err_msg=str(index))
        cert = certify(trace, view, solver="exact")
        assert [cert.mu[int(i)] for i in view.honest] == pytest.approx(got.tolist(), rel=1e-12, abs=1e-15)
    assert used >= 150


@pytest.mark.parametrize("seed", range(4))
def test_fixed_sigmas_match_the_brute_force_pseudo_inverse(seed):
    trace = sample_trace(12, IncaConfig(iterations=5, neighbors=1, sigma_star=0.3, sigma_delta=3.0), seed=seed)
    view = random_collusion(trace, 0.25, seed=seed)
    brute = brute_force_mu(trace, view.corrupted, view.observed, 0.3, 3.0)
    fixed = _FixedSigmas.from_model(build_model(trace, view), 0.3, 3.0)
    assert fixed is not None
    got = dict(zip(fixed.honest.tolist(), fixed.mu(0.3, 3.0)))
    for i, b in brute.items():
        assert got[i] == pytest.approx(b, rel=1e-8, abs=1e-12), (i, got[i], b)


def test_singular_covariance_falls_back_to_the_pencil_method():
    trace = sample_trace(12, IncaConfig(iterations=5, neighbors=1, sigma_star=0.3, sigma_delta=3.0), seed=1)
    view = random_collusion(trace, 0.25, seed=1)
    model = build_model(trace, view)
    assert _FixedSigmas.from_model(model, 0.3, 0.0) is None  # G_B alone has rank <= n_H < m
    assert _FixedSigmas.from_model(model, 0.0, 3.0) is None
    cert = certify(trace, view, sigma_delta=0.0, solver="exact")
    exact = profile(trace, view, solver="exact")
    assert [cert.mu[int(i)] for i in view.honest] == pytest.approx(exact.mu(0.3, 0.0).tolist())
    cert = certify(trace, view, sigma_star=0.0, solver="exact")
    assert all(math.isinf(m) for m in cert.mu.values())
    with pytest.raises(ValueError, match="one pair of sigmas"):
        _FixedSigmas.from_model(model, 0.3, 3.0).mu(0.3, 2.0)

"""certify() at one pair of sigmas: the Cholesky path (certificate._FixedSigmas) agrees with the pencil
method (SensitivityProfile, every pair) and with the brute-force pseudo-inverse of tests/reference.py,
and falls back to the pencil method where the covariance is singular. Its factorization helpers
(``whiten_lower``, ``lower_solve``, ``whiten_at``) against scipy's Cholesky and triangular solve."""

import math

import numpy as np
import pytest
import scipy.linalg as la
from reference import brute_force_mu
from test_bound import _case

from flwr_inca import IncaConfig
from flwr_inca.privacy import certify, profile, random_collusion
from flwr_inca.privacy.certificate import (
    SensitivityProfile,
    _FixedSigmas,
    lower_solve,
    whiten_at,
    whiten_lower,
)
from flwr_inca.privacy.linear_system import build_model, lower_norm1
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


def _spd(rng, m, condition=1e3):
    """A random symmetric positive definite (m, m) matrix with the given condition number."""
    Q, _ = np.linalg.qr(rng.normal(size=(m, m)))
    return (Q * np.geomspace(1.0, 1.0 / condition, m)) @ Q.T


def test_whiten_lower_is_a_cholesky_factor_and_solve_in_place():
    """whiten_lower factorizes the lower triangle it is given (the upper one is never read) in place, and
    overwrites H with L^{-1} H: no (m, m) copy; the values are LAPACK's, as scipy's Cholesky gives them."""
    rng = np.random.default_rng(4)
    for m in (1, 7, 300):
        Sigma = _spd(rng, m)
        H = rng.normal(size=(m, 11))
        stored = np.tril(Sigma) + np.triu(rng.normal(size=(m, m)), 1)  # garbage above the diagonal
        H_in = H.copy()
        L, W = whiten_lower(stored, lower_norm1(stored), H_in, overwrite=True)
        assert np.shares_memory(L, stored) and np.shares_memory(W, H_in)
        ref = la.cholesky(Sigma, lower=True)
        np.testing.assert_allclose(np.tril(L), ref, rtol=0, atol=1e-12 * np.abs(ref).max())
        np.testing.assert_allclose(W, la.solve_triangular(ref, H, lower=True), rtol=1e-10, atol=1e-12)
        kept = np.tril(Sigma) + np.triu(rng.normal(size=(m, m)), 1)
        copy = kept.copy()
        L2, _ = whiten_lower(kept, lower_norm1(kept), H, clean=True)
        np.testing.assert_array_equal(kept, copy)  # not overwritten unless asked
        assert not np.triu(L2, 1).any()


def test_whiten_lower_refuses_what_whiten_at_refuses():
    """None for a matrix that is not positive definite, or whose reciprocal condition is at most rcond."""
    rng = np.random.default_rng(5)
    H = rng.normal(size=(40, 3))
    singular = _spd(rng, 40)
    singular[:, 0] = singular[0, :] = 0.0
    assert whiten_lower(singular, lower_norm1(singular), H) is None
    ill = _spd(rng, 40, condition=1e13)
    assert whiten_lower(ill, lower_norm1(ill), H) is None
    assert whiten_lower(ill, lower_norm1(ill), H, rcond=1e-16) is not None


def test_lower_solve_reads_only_the_lower_triangle_of_either_order():
    rng = np.random.default_rng(6)
    L = np.tril(rng.normal(size=(50, 50))) + 10 * np.eye(50)
    B = rng.normal(size=(50, 7))
    ref = la.solve_triangular(L, B, lower=True)
    noisy = L + np.triu(rng.normal(size=(50, 50)), 1)
    for stored in (noisy, np.asfortranarray(noisy)):
        np.testing.assert_allclose(lower_solve(stored, B), ref, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(lower_solve(stored, np.asfortranarray(B)), ref, rtol=1e-12, atol=1e-14)
    assert lower_solve(L, np.zeros((50, 0))).shape == (50, 0)


def test_whiten_at_returns_a_clean_factor_of_the_models_covariance():
    trace = sample_trace(12, IncaConfig(iterations=5, neighbors=1, sigma_star=0.3, sigma_delta=3.0), seed=2)
    model = build_model(trace, random_collusion(trace, 0.25, seed=2))
    H = model.H.copy()
    L, W = whiten_at(model, 0.3, 3.0)
    np.testing.assert_array_equal(model.H, H)  # the model is not modified
    assert not np.triu(L, 1).any()
    np.testing.assert_allclose(L @ L.T, model.covariance(0.3, 3.0), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(L @ W, model.H, rtol=1e-10, atol=1e-12)

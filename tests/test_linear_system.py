"""flwr_inca.privacy.linear_system.observed_covariance: the covariance of a view at one pair of sigmas,
propagated straight into one triangle, against the dense system (``A_V`` formed explicitly, its Grams
multiplied out) on small random executions: every schedule (D_Inc's state propagation, the others' dense
products), dropout model and threat."""

import numpy as np
import pytest
from test_bound import _case

from flwr_inca import IncaConfig, PermanentDropout
from flwr_inca.privacy import random_collusion
from flwr_inca.privacy.linear_system import build_model, lower_norm1, observed_covariance
from flwr_inca.protocol import sample_trace


@pytest.mark.timeout(120)
def test_the_covariance_is_the_dense_systems_on_random_executions():
    incremental = 0
    for index in range(120):
        trace, view = _case(index, seed=11)
        s_star, s_delta = trace.sigma_star, trace.sigma_delta
        dense = build_model(trace, view, method="dense")
        Sigma = dense.covariance(s_star, s_delta)
        got = observed_covariance(trace, view, s_star, s_delta)
        incremental += trace.schedule.is_incremental_pattern
        np.testing.assert_array_equal(got.rows, dense.rows)
        np.testing.assert_array_equal(got.honest, dense.honest)
        np.testing.assert_allclose(got.H, dense.H, rtol=0, atol=1e-15)
        if Sigma.size == 0:
            assert got.lower.shape == (0, 0)
            continue
        scale = np.abs(Sigma).max()
        lower = np.tril(got.lower)  # above the diagonal: unspecified
        np.testing.assert_allclose(lower, np.tril(Sigma), rtol=0, atol=1e-12 * scale, err_msg=str(index))
        assert got.norm1 == pytest.approx(np.abs(Sigma).sum(axis=0).max(), rel=1e-12)
    assert incremental >= 40  # D_Inc cases went through the propagation


def test_the_structured_noise_gram_is_the_dense_one_with_offline_parties():
    """``G_A`` of the state propagation (unit variance) equals the dense system's, also where parties stay
    offline for several steps (their outstanding terms keep mixing columns of Cov(y, e))."""
    for seed in range(6):
        trace = sample_trace(30, IncaConfig(iterations=8, sigma_star=0.3, sigma_delta=4.0,
                                            dropout=PermanentDropout(0.3)), seed=seed)
        view = random_collusion(trace, 0.2, seed=seed)
        structured = build_model(trace, view, method="structured")
        dense = build_model(trace, view, method="dense")
        np.testing.assert_allclose(structured.G_A, dense.G_A, rtol=0, atol=1e-13 * np.abs(dense.G_A).max())
        np.testing.assert_array_equal(structured.G_A, structured.G_A.T)


def test_the_norm_reads_only_the_lower_triangle():
    rng = np.random.default_rng(3)
    for m in (1, 5, 257, 600):
        A = rng.normal(size=(m, m))
        S = A + A.T
        stored = np.tril(S) + np.triu(rng.normal(size=(m, m)) * 1e6, 1)  # garbage above the diagonal
        assert lower_norm1(stored, chunk=64) == pytest.approx(np.abs(S).sum(axis=0).max(), rel=1e-13)
    assert lower_norm1(np.zeros((0, 0))) == 0.0


def test_a_view_that_does_not_match_the_trace_is_refused():
    config = IncaConfig(iterations=3, sigma_star=1.0, sigma_delta=1.0)
    trace, other = sample_trace(8, config, seed=1), sample_trace(9, config, seed=1)
    with pytest.raises(ValueError, match="does not match the trace"):
        observed_covariance(trace, random_collusion(other, 0.2, seed=1), 1.0, 1.0)

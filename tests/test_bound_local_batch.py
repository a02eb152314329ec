"""The cascade's local tier solved in batches (block-diagonal CGLS on a compressed system) and calibration
with one bound pass per run: the same bounds as one party at a time, never below exact."""

import math

import numpy as np
import pytest
from test_bound_cascade import _local_setting, _tier

from flwr_inca import IncaConfig, PermanentDropout
from flwr_inca.privacy import calibrate, certify, random_collusion
from flwr_inca.privacy.local_bound import _Batch, whitened_operator
from flwr_inca.protocol import sample_trace


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_a_batch_of_local_bounds_equals_one_party_at_a_time_and_is_never_below_exact(dtype):
    trace, view = _local_setting(150, seed=5)
    ms, tier = _tier(trace, view)
    tier.dtype = np.dtype(dtype)
    exact = certify(trace, view, solver="exact")
    qs = np.random.default_rng(1).choice(ms.nH, 24, replace=False)
    X, E = tier.bounds_array(qs)
    for k, q in enumerate(qs):
        x1, e1 = tier.bound(int(q))  # the same party alone
        assert X[k] == pytest.approx(x1, rel=1e-6, abs=1e-14) and E[k] == pytest.approx(e1, rel=1e-6, abs=1e-14)
        mu = exact.mu[int(ms.parties[q])]
        assert math.isfinite(X[k]) and math.sqrt(X[k] / 0.3**2 + E[k] / 3.0**2) >= mu * (1 - 1e-9)


def test_the_compressed_local_system_has_the_cost_of_the_plain_local_problem():
    # independently of LocalTier.system: the explicit L = W P Dz, dense, and the cost of (u, a)
    trace, view = _local_setting(150, seed=6)
    ms, tier = _tier(trace, view)
    w, L = whitened_operator(ms, 0.3, 3.0)
    L = L.toarray()
    LG = L @ tier.G
    qs = np.array([0, 7, 33, 64, 101])
    batch = _Batch(tier, qs)
    A, rhs, row_start = tier.system(batch)
    M0 = int(row_start[-1])
    assert M0 < batch.J.size * (ms.T + 1)  # lightly touched parties' rows were compressed
    rng = np.random.default_rng(0)
    for _ in range(3):
        z = rng.normal(size=A.shape[1])
        res = A @ z - rhs
        for b, q in enumerate(qs):
            S = batch.S[batch.Kstart[b]: batch.Kstart[b + 1]]
            u, a = z[batch.Kstart[b]: batch.Kstart[b + 1]], z[int(batch.Kstart[-1]) + b]
            target = w * ms.apply_P(ms.target(np.array([q])))[:, 0]
            plain = np.sum((a * LG + L[:, S] @ u - target) ** 2)
            block = np.sum(res[row_start[b]: row_start[b + 1]] ** 2) + res[M0 + b] ** 2
            assert block == pytest.approx(plain, rel=1e-8)


def _regenerate(parties: int, gamma: float, iterations: int, seeds: tuple[int, int]):
    config = IncaConfig(iterations=iterations, neighbors=1, sigma_star=1.0, sigma_delta=1.0,
                        dropout=PermanentDropout(gamma))
    trace = sample_trace(parties, config, seeds[0])
    return trace, random_collusion(trace, 0.1, seeds[1])


@pytest.mark.parametrize("solver", ["bound", "cascade"])
def test_one_bound_pass_per_run_calibrates_at_least_the_exact_noise_and_every_run_is_private(solver):
    kw = {"iterations": 12, "neighbors": 1, "collusion": 0.1, "dropout": PermanentDropout(0.1), "runs": 4,
          "seed": 3}
    exact = calibrate(0.5, 1e-5, 80, solver="exact", **kw)
    once = calibrate(0.5, 1e-5, 80, solver=solver, bound_passes=1, **kw)
    twice = calibrate(0.5, 1e-5, 80, solver=solver, bound_passes=2, **kw)
    assert any("bounded once" in note for note in once.notes)
    assert any("bounded twice" in note for note in twice.notes)
    for cal in (once, twice):
        assert cal.sigma_star == pytest.approx(exact.sigma_star)
        assert exact.sigma_delta <= cal.sigma_delta <= 1.1 * exact.sigma_delta
        assert cal.predicted_mse <= 1.1 * exact.predicted_mse
        # the guarantee itself: every simulated run, certified exactly at the calibrated sigmas
        for seeds in cal.run_seeds:
            trace, view = _regenerate(80, 0.1, 12, seeds)
            cert = certify(trace, view, sigma_star=cal.sigma_star, sigma_delta=cal.sigma_delta, solver="exact")
            assert cert.max_mu <= cal.mu_target * (1 + 1e-9)


def test_bound_passes_must_be_one_or_two():
    with pytest.raises(ValueError, match="bound_passes must be an integer in \\[1, 2\\]"):
        calibrate(0.5, 1e-5, 30, runs=1, bound_passes=3)

"""The compiled local tier (flwr_inca.privacy.local_compiled, numba): the twin of the NumPy local tier.
Its supports are the NumPy ones, its evaluation covers an 80-bit evaluation of the whole dy and agrees with
the NumPy evaluation, its search reaches the local problem's least-squares optimum (a dense solve, done
here independently), and interpreted and compiled kernels agree. Without numba it is a clear error."""

import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from test_bound_cascade import _check_cascade, _ld_cost, _local_setting, _tier

from flwr_inca import IncaConfig, PermanentDropout
from flwr_inca.privacy import certify, local_compiled, random_collusion
from flwr_inca.privacy.bound import BoundSettings, bound_profile
from flwr_inca.privacy.local_bound import LocalTier, _Batch, whitened_operator
from flwr_inca.protocol import sample_trace

needs_numba = pytest.mark.skipif(not local_compiled.available(), reason="numba is not installed")


def _compiled_tier(n: int, seed: int, iterations: int = 20, T: int = 10):
    trace, view = _local_setting(n, seed=seed, T=T)
    ms, tier = _tier(trace, view, iterations)
    tier.engine = "compiled"
    return trace, view, ms, tier


@needs_numba
def test_compiled_supports_are_the_numpy_supports():
    _, _, ms, tier = _compiled_tier(150, seed=5)
    qs = np.random.default_rng(0).choice(ms.nH, 30, replace=False)
    k = tier._kernel_arrays()
    S, Kstart = local_compiled.supports(qs, k["near_ptr"], k["near_idx"], k["tb_ptr"], k["tb_idx"], ms.U)
    batch = _Batch(tier, qs)
    assert np.array_equal(S, batch.S) and np.array_equal(Kstart, batch.Kstart)


@needs_numba
def test_compiled_evaluation_covers_an_extended_precision_evaluation_and_agrees_with_numpy():
    _, _, ms, tier = _compiled_tier(120, seed=2)
    rng = np.random.default_rng(0)
    qs = rng.choice(ms.nH, 6, replace=False)
    batch = _Batch(tier, qs)
    u, a = tier.solve_batch(batch)
    # off the optimum too, and one block with a non-finite search (evaluated at dy = 0 by both)
    u = u * (1 + 1e-3 * rng.normal(size=u.size))
    a = a * 1.001
    a[2] = np.nan
    X, E = tier.evaluate_compiled(qs, batch.S, batch.Kstart, u, a)
    Xn, En = tier.evaluate_batch(batch, u, a)
    # the same operations; sums in another order (margins of 1e-28 where the exact value is 0 differ)
    np.testing.assert_allclose(X, Xn, rtol=1e-12, atol=1e-24)
    np.testing.assert_allclose(E, En, rtol=1e-12, atol=1e-24)
    for b, q in enumerate(qs):
        S = batch.S[batch.Kstart[b]: batch.Kstart[b + 1]]
        ub, ab = u[batch.Kstart[b]: batch.Kstart[b + 1]], a[b]
        if not math.isfinite(ab):
            ub, ab = np.zeros(S.size), 0.0
        x_ld, e_ld = _ld_cost(ms, tier, int(q), S, ub, ab)
        assert X[b] >= x_ld and E[b] >= e_ld, (q, X[b], x_ld, E[b], e_ld)
        slack = 1e-8 * (x_ld + e_ld)  # tight: the margins are rounding-sized
        assert X[b] <= x_ld + slack and E[b] <= e_ld + slack
    # the margins themselves: inflated to 1e-3 (rounding, error scale, right-inverse defect) they dominate,
    # and both evaluations still agree: the same margin terms in the same places
    tier.gamma_v, tier.gamma_r, tier.defect = 1e-3, 2e-3, np.full(tier.defect.size, 1e-3)
    X2, E2 = tier.evaluate_compiled(qs, batch.S, batch.Kstart, u, a)
    Xn2, En2 = tier.evaluate_batch(batch, u, a)
    assert np.all(X2 > X * (1 + 1e-4)) and np.all(E2 > E * (1 + 1e-4))
    np.testing.assert_allclose(X2, Xn2, rtol=1e-10)
    np.testing.assert_allclose(E2, En2, rtol=1e-10)


@needs_numba
def test_compiled_search_reaches_the_least_squares_optimum_of_the_local_problem():
    # independently: the dense whitened operator L = W P Dz, the columns [LG, L_S], numpy's lstsq
    _, _, ms, tier = _compiled_tier(120, seed=4, iterations=400)
    w, L = whitened_operator(ms, 0.3, 3.0)
    L = L.toarray()
    LG = L @ tier.G
    checked = 0
    for q in range(0, ms.nH, 9):
        X, E, dys = tier.bounds_and_dy(np.array([q]))
        S = dys[0][0].astype(np.int64)
        target = w * ms.apply_P(ms.target(np.array([q])))[:, 0]
        A = np.column_stack([L[:, S], LG])
        z, *_ = np.linalg.lstsq(A, target, rcond=None)
        optimum = float(np.sum((A @ z - target) ** 2))
        cost = X[0] / 0.3**2 + E[0] / 3.0**2
        assert cost >= optimum * (1 - 1e-9), (q, cost, optimum)
        if optimum > 1e-9 * float(target @ target):  # (a party whose change is fully hidden has 0)
            assert cost <= optimum * (1 + 1e-6), (q, cost, optimum)
            checked += 1
    assert checked >= 8


@needs_numba
def test_compiled_bounds_are_sound_and_no_looser_than_numpy():
    trace, view, ms, tier = _compiled_tier(300, seed=7)
    exact = certify(trace, view, solver="exact")
    qs = np.arange(ms.nH)
    Xc, Ec, _ = tier.bounds_and_dy(qs)
    tier.engine, tier.dtype = "numpy", np.dtype(np.float64)
    Xn, En, _ = tier.bounds_and_dy(qs)
    mu_c, mu_n = np.sqrt(Xc / 0.3**2 + Ec / 3.0**2), np.sqrt(Xn / 0.3**2 + En / 3.0**2)
    mu_e = np.array([exact.mu[int(ms.parties[q])] for q in qs])
    assert np.all(np.isfinite(mu_c)) and np.all(mu_c >= mu_e * (1 - 1e-9))
    assert np.all(mu_c <= mu_n * (1 + 1e-3))


@needs_numba
def test_interpreted_and_compiled_kernels_agree():
    # numba compiles the same Python code the interpreter runs: both give the same numbers on a tiny case
    _, _, ms, tier = _compiled_tier(40, seed=1, T=5)
    qs = np.arange(ms.nH, dtype=np.int64)
    k = tier._kernel_arrays()
    args = (qs, k["near_ptr"], k["near_idx"], k["tb_ptr"], k["tb_idx"], ms.U)
    S, Kstart = local_compiled.supports(*args)
    S_py, K_py = local_compiled._supports_py.py_func(*args)
    assert np.array_equal(S, S_py) and np.array_equal(Kstart, K_py)
    X, E, _, _, u, a = tier._bounds_compiled(qs)
    search = (qs, S, Kstart, k["indptr"], k["indices"], k["data"], ms.row_q, ms.row_t, ms.group_of, k["Mg"],
              k["GZ"], k["MG"], k["gMg"], float(tier.LG2), tier._own_targets(qs), ms.blocked[qs],
              tier.iterations)
    u_py, a_py = local_compiled._solve_blocks_py.py_func(*search)
    np.testing.assert_allclose(u_py, u, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(a_py, a, rtol=1e-9, atol=1e-12)
    ev = (qs, S, Kstart, u, a, k["indptr"], k["indices"], k["data"], ms.row_q, ms.row_t, ms.group_of, tier.Pst,
          tier.absPst, tier.defect, k["GZ"], k["AGZ"], tier._own_targets(qs), ms.blocked[qs], tier.AX2,
          tier.AE2, float(tier.TX), float(tier.TE), float(tier.gamma_v), float(tier.gamma_r))
    X_py, E_py = local_compiled._evaluate_blocks_py.py_func(*ev)
    np.testing.assert_allclose(X_py, X, rtol=1e-12)
    np.testing.assert_allclose(E_py, E, rtol=1e-12)


@needs_numba
def test_the_local_tier_gives_the_same_bounds_on_one_or_two_threads():
    _, _, ms, tier = _compiled_tier(300, seed=7)
    parts = np.array_split(np.arange(ms.nH), 9)
    one = [tier.bounds_and_dy(p)[:2] for p in parts]
    with ThreadPoolExecutor(2) as pool:
        two = list(pool.map(lambda p: tier.bounds_and_dy(p)[:2], parts))
    for (x1, e1), (x2, e2) in zip(one, two):  # batches are independent: bit for bit
        np.testing.assert_array_equal(x1, x2)
        np.testing.assert_array_equal(e1, e2)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_cascade_with_either_engine_and_one_or_two_threads_is_sound_and_as_tight(threads):
    trace = sample_trace(300, IncaConfig(iterations=20, neighbors=1, sigma_star=0.25, sigma_delta=3.0,
                                         dropout=PermanentDropout(0.1)), seed=3)
    view = random_collusion(trace, 0.1, seed=3)
    exact = certify(trace, view, solver="exact")
    fast = bound_profile(trace, view, cascade=True, settings=BoundSettings(threads=threads, local_batch=8))
    again = bound_profile(trace, view, cascade=True, settings=BoundSettings(threads=threads, local_batch=8))
    np.testing.assert_array_equal(fast.X, again.X)  # whatever the timing of the threads
    np.testing.assert_array_equal(fast.E, again.E)
    slow = bound_profile(trace, view, cascade=True, settings=BoundSettings(local_engine="numpy", threads=1))
    mu_e = np.array([exact.mu[int(i)] for i in fast.honest])
    for prof in (fast, slow):
        assert np.all(prof.mu(0.25, 3.0) >= mu_e * (1 - 1e-9))
    assert fast.mu(0.25, 3.0).max() <= slow.mu(0.25, 3.0).max() * (1 + 1e-3)
    assert fast.mu(0.25, 3.0).max() <= mu_e.max() * 1.01


@pytest.mark.parametrize("cases", [200, pytest.param(2000, marks=pytest.mark.slow)])
def test_the_numpy_engine_is_never_below_exact_on_random_small_executions(cases):
    # the fallback without numba: both schedules, custom ones, all dropout models, both views (every
    # combination cases / 20 times)
    settings = BoundSettings(iterations=2, max_iterations=4, local_iterations=2, global_iterations=3,
                             local_engine="numpy")
    assert _check_cascade(cases, seed=3 if cases == 200 else 5, settings=settings) > 4 * cases


def test_without_numba_the_compiled_engine_is_a_clear_error_and_auto_falls_back(monkeypatch):
    trace, view = _local_setting(60, seed=1, T=5)
    ms, tier = _tier(trace, view)
    monkeypatch.setattr(local_compiled, "numba", None)
    with pytest.raises(ValueError, match="numba"):
        LocalTier(ms, tier.G, 0.3, 3.0, engine="compiled")
    assert LocalTier(ms, tier.G, 0.3, 3.0, engine="auto").engine == "numpy"
    with pytest.raises(RuntimeError, match="numba"):
        local_compiled.supports()
    with pytest.raises(ValueError, match="engine"):
        LocalTier(ms, tier.G, 0.3, 3.0, engine="gpu")


@pytest.mark.parametrize("kwargs, name", [({"local_engine": "fast"}, "local_engine"),
                                          ({"threads": 0}, "threads"),
                                          ({"threads": 1.5}, "threads")])
def test_bad_local_settings_are_named(kwargs, name):
    with pytest.raises(ValueError, match=name):
        BoundSettings(**kwargs)


def test_threads_never_exceed_the_cpus_this_process_may_use():
    # a huge request would hold one batch of the global solve in memory per thread
    from flwr_inca.privacy.bound import _threads

    every = _threads(BoundSettings())
    assert every >= 1
    assert _threads(BoundSettings(threads=10**6)) == every
    assert _threads(BoundSettings(threads=1)) == 1

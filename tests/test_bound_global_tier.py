"""The cascade's global tier (sixth attempt): a party's global solve starts from its own local dy and stops
early once the search's float32 estimate of its bound is below the charged maximum's neighbourhood. Neither
can make a bound unsound (any dy is admissible; the evaluation is the same rigorous float64 one); these
tests pin what each promises: the early stop only stops columns whose evaluated bound is at the threshold
(the others are unchanged), the local start is the local tier's own dy, and the maximum stays as tight."""

import math

import numpy as np
from test_bound_cascade import _local_setting, _tier

from flwr_inca.privacy import certify
from flwr_inca.privacy.bound import (
    BoundSettings,
    _cg,
    _evaluate,
    _local_start,
    _Operator,
    _warm_start,
    bound_profile,
)


def _cost(ms, x, part, s_star=0.3, s_delta=3.0):
    X, E = _evaluate(ms, x, part)
    return X / s_star**2 + E / s_delta**2


def test_early_stop_stops_only_columns_whose_bound_reached_the_threshold():
    trace, view = _local_setting(300, seed=4)
    ms, _ = _tier(trace, view)
    op = _Operator(ms, 0.3, 3.0, BoundSettings())
    part = np.arange(0, ms.nH, ms.nH // 24)[:24]
    b = op.w * ms.apply_P(ms.target(part))
    x0 = _warm_start(ms, part)
    plain = _cg(op, b, x0, 6)
    after2 = _cost(ms, _cg(op, b, x0, 2), part)
    # odd columns: stop once the estimate is below their cost after 2 iterations; even ones never stop early
    thr = np.where(np.arange(part.size) % 2 == 1, after2, -np.inf)
    early = _cg(op, b, x0, 6, thr)
    even = np.arange(0, part.size, 2)
    np.testing.assert_allclose(early[:, even], plain[:, even], rtol=1e-4, atol=1e-6 * np.abs(plain).max())
    c_early, c_plain = _cost(ms, early, part), _cost(ms, plain, part)
    odd = np.arange(1, part.size, 2)
    # a stopped column's rigorous bound is at its threshold (the float32 estimate is that accurate) and
    # above where the full run got; it really stopped (more iterations would have gone lower)
    assert np.all(c_early[odd] <= thr[odd] * (1 + 1e-4)), (c_early[odd] / thr[odd])
    assert np.all(c_early[odd] >= c_plain[odd] * (1 - 1e-6))
    assert np.any(c_early[odd] > c_plain[odd] * 1.01)
    # the caller's start is never modified
    np.testing.assert_array_equal(x0, _warm_start(ms, part))


def test_compacted_columns_match_each_column_solved_alone():
    trace, view = _local_setting(200, seed=5)
    ms, _ = _tier(trace, view)
    op = _Operator(ms, 0.3, 3.0, BoundSettings())
    part = np.arange(12)
    b = op.w * ms.apply_P(ms.target(part))
    x0 = _warm_start(ms, part)
    # 9 of 12 stop after one iteration (their thresholds clearly above their cost there: not a rounding
    # knife-edge), so the other 3 are compacted
    thr = np.where(part < 9, 1.05 * _cost(ms, _cg(op, b, x0, 1), part), -np.inf)
    batch = _cg(op, b, x0, 5, thr)
    for j in range(part.size):
        alone = _cg(op, b[:, [j]], x0[:, [j]], 5, thr[[j]])
        np.testing.assert_allclose(batch[:, j], alone[:, 0], rtol=1e-4, atol=1e-6 * np.abs(alone).max())


def test_local_start_is_the_local_tiers_dy():
    # the global solve's start, formed from the kept (support, u, a), costs what the local tier certified
    trace, view = _local_setting(250, seed=6)
    ms, tier = _tier(trace, view)
    part = np.arange(0, ms.nH, 7)[:20]
    X, E, dys = tier.bounds_and_dy(part)
    np.testing.assert_array_equal(np.stack([X, E]), np.stack(tier.bounds_array(part)))
    x0 = _local_start(tier.G, dict(zip(part.tolist(), dys)), part)
    assert x0.dtype == np.float32
    local = X / 0.3**2 + E / 3.0**2
    np.testing.assert_allclose(_cost(ms, x0, part), local, rtol=1e-4, atol=1e-9 * local.max())


def test_early_stopped_cascade_is_sound_and_its_maximum_as_tight():
    # n = 300: parties do stop early (looser than without the early stop), none is below exact, and the
    # charged maximum is as tight as without the early stop and as the global bound's
    trace, view = _local_setting(300, seed=7)
    exact = certify(trace, view, solver="exact")
    mu_exact = np.array([exact.mu[int(i)] for i in view.honest])
    s = (trace.sigma_star, trace.sigma_delta)
    early = bound_profile(trace, view, cascade=True).mu(*s)
    full = bound_profile(trace, view, cascade=True, settings=BoundSettings(stop_factor=0.0)).mu(*s)
    glob = bound_profile(trace, view).mu(*s)
    assert np.all(np.isfinite(early))
    assert np.all(early >= mu_exact * (1 - 1e-9))
    assert early.max() <= full.max() * (1 + 1e-3) and early.max() <= glob.max() * (1 + 1e-3)
    assert early.max() <= mu_exact.max() * 1.01
    assert np.sum(early > full * 1.01) > 0  # the early stop did stop some parties
    assert math.isclose(early.max(), max(early.max(), full.max() * 0.99), rel_tol=0.02)

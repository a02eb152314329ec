"""flwr_inca.privacy.prefix: every prefix view and every subset of finals of a view from one Cholesky
factorization, checked against independent brute force (``certify`` on each restricted view) on small
random executions: both schedules, dropouts, Collusion and Eavesdrop views."""

import itertools
import math
import tracemalloc

import numpy as np
import pytest
import scipy.linalg as la

from flwr_inca import IncaConfig, PermanentDropout, TemporaryDropout
from flwr_inca.privacy import (
    certification_seeds,
    certify,
    certify_round,
    collusion_view,
    random_collusion,
    random_eavesdrop,
    with_finals,
)
from flwr_inca.privacy.linear_system import build_model
from flwr_inca.privacy.prefinal import no_finals_bound
from flwr_inca.privacy.prefix import (
    ROUND_UP,
    PrefixProfile,
    RoundPrefix,
    padded_trace,
    prefix_ceilings,
    prefix_view,
)
from flwr_inca.privacy.views import AdversaryView
from flwr_inca.protocol import sample_trace
from flwr_inca.protocol.schedules import InjectionSchedule

REL = 1e-9


def _execution(seed):
    """A small random execution and a random adversary view of it (both schedules, both threats)."""
    rng = np.random.default_rng(seed)
    n, T = int(rng.integers(4, 10)), int(rng.integers(2, 6))
    dropout = [None, PermanentDropout(0.2), TemporaryDropout(0.3)][seed % 3]
    config = IncaConfig(iterations=T, neighbors=int(rng.integers(1, 3)), sigma_star=float(rng.uniform(0.3, 2)),
                        sigma_delta=float(rng.uniform(0.5, 30)), schedule=("incremental", "early")[seed % 2],
                        dropout=dropout)
    trace = sample_trace(n, config, seed=seed)
    if seed % 4 < 2:
        view = random_collusion(trace, float(rng.uniform(0.1, 0.4)), seed)
    else:
        view = random_eavesdrop(trace, float(rng.uniform(0.3, 1.0)), seed)
    return trace, view


def _close(got, ref):
    """1e-9 relative; values below 1e-14 are zero up to round-off (certify gives ~1e-17 for an exact 0)."""
    return abs(got - ref) <= REL * ref + 1e-14


@pytest.mark.parametrize("seed", range(12))
def test_every_prefix_and_every_subset_of_finals_matches_brute_force(seed):
    trace, view = _execution(seed)
    prof = PrefixProfile.build(trace, view, value_sensitivity=2.0)
    assert prof is not None  # these covariances are well conditioned
    T = trace.iterations
    previous = 0.0
    for t in range(T + 1):
        ref = certify(trace, prefix_view(view, t), value_sensitivity=2.0).mu
        got = dict(zip(prof.honest.tolist(), prof.mu_through(t).tolist()))
        assert got.keys() == ref.keys()
        assert all(_close(got[i], ref[i]) for i in ref), (t, got, ref)
        assert max(got.values()) >= previous - 1e-15  # more observed messages never cost less
        previous = max(got.values())
    assert prof.mu_through(0).max() == 0.0  # nothing observed
    full = certify(trace, view, value_sensitivity=2.0).max_mu
    assert _close(prof.mu_with_finals(None).max(), full) and _close(prof.mu_through(T + 1).max(), full)
    online = trace.steps[-1].online.tolist()
    subsets = [c for r in range(len(online) + 1) for c in itertools.combinations(online, r)]
    rng = np.random.default_rng(seed)
    if len(subsets) > 10:  # all of them for few finals; else none, one lost, and 8 at random
        subsets = [(), tuple(online[1:]), *(subsets[i] for i in rng.choice(len(subsets), 8, replace=False))]
    for finals in subsets:
        ref = certify(trace, with_finals(view, trace, finals), value_sensitivity=2.0).max_mu
        got = prof.mu_with_finals(finals).max()
        assert _close(got, ref), (finals, got, ref)
        assert got <= full * (1 + REL)  # the pre-final certificate bounds any subset of finals
        assert got >= prof.mu_through(T).max() * (1 - REL)  # and any subset bounds none


def test_the_round_prefix_is_certify_round_rounded_up_on_the_same_adversaries():
    trace, _ = _execution(5)
    seeds = certification_seeds(3, 2)
    for kw in ({"collusion": 0.3}, {"observed_fraction": 0.5}):
        prefix = RoundPrefix(trace, seeds, 3, value_sensitivity=2.0, **kw)
        online = trace.steps[-1].online.tolist()
        for finals in (None, online[1:], []):
            ref = certify_round(trace, seeds, 3, finals=finals, value_sensitivity=2.0, **kw).mu
            got = prefix.with_finals(finals).mu
            assert ref <= got <= ref * (1 + 2 * ROUND_UP)  # sound: never below the exact value
        assert prefix.with_finals([]).mu == prefix.through(trace.iterations).mu


@pytest.mark.parametrize("seed", range(6))
def test_the_largest_affordable_prefix_is_the_last_that_fits(seed):
    trace, _ = _execution(seed)
    prefix = RoundPrefix(trace, certification_seeds(seed, 1), 2, collusion=0.3, value_sensitivity=2.0)
    costs = [prefix.through(t).mu for t in range(trace.iterations + 1)]
    for limit in [0.0, *costs, math.inf, *(c * 1.0001 for c in costs)]:
        t, cert = prefix.largest_affordable(lambda mu, limit=limit: mu <= limit)
        expected = max(i for i, c in enumerate(costs) if c <= limit or i == 0)
        assert t == expected and cert.mu == costs[t]


def test_a_singular_covariance_falls_back_to_certify():
    """sigma_star = 0: the noise-free sums make Sigma singular; the prefix structure does not apply and
    each restricted view is certified on its own (the pseudo-inverse)."""
    trace = sample_trace(6, IncaConfig(iterations=3, sigma_star=0.0, sigma_delta=5.0), seed=1)
    view = collusion_view(trace, [0])
    assert PrefixProfile.build(trace, view) is None
    prefix = RoundPrefix(trace, certification_seeds(0, 1), 2, collusion=0.2)
    assert all(p is None for p in prefix.profiles)
    for t in range(trace.iterations + 1):
        ref = max(certify(trace, prefix_view(v, t)).max_mu for v in prefix.views)
        assert prefix.through(t).mu == pytest.approx(ref * (1 + ROUND_UP), rel=1e-15)
    assert math.isinf(prefix.with_finals(None).mu)  # the finals reveal the values


def test_prefixes_of_a_padded_trace_are_those_of_the_execution():
    """The Flower guard certifies iteration t on the trace known so far, padded with idle iterations:
    the messages of iterations 1..t depend only on iterations 1..t."""
    trace, _ = _execution(7)
    seeds = certification_seeds(1, 1)
    full = RoundPrefix(trace, seeds, 3, collusion=0.3, value_sensitivity=2.0)
    for t in range(1, trace.iterations + 1):
        padded = padded_trace(trace.parties, trace.steps[:t], trace.iterations, trace.schedule,
                              trace.sigma_star, trace.sigma_delta)
        partial = RoundPrefix(padded, seeds, 3, collusion=0.3, value_sensitivity=2.0)
        for u in range(t + 1):
            assert partial.through(u).mu == pytest.approx(full.through(u).mu, rel=1e-12)


@pytest.mark.parametrize("schedule", ["incremental", "early"])
def test_prefix_ceilings_bound_every_execution_and_end_at_the_no_finals_bound(schedule):
    T = 4
    ceilings = prefix_ceilings(InjectionSchedule.resolve(schedule, T), 1.0, 8.0, 2.0)
    assert ceilings[0] == 0 and np.all(np.diff(ceilings) >= 0)
    assert ceilings[-1] == pytest.approx(no_finals_bound(InjectionSchedule.resolve(schedule, T), 1.0, 8.0, 2.0),
                                         rel=1e-8)
    for seed in range(6):
        trace = sample_trace(8, IncaConfig(iterations=T, sigma_star=1.0, sigma_delta=8.0, schedule=schedule,
                                           dropout=TemporaryDropout(0.3)), seed=seed)
        everything = collusion_view(trace, [0])  # corrupt one party ...
        observed = everything.observed.copy()
        observed[:T] = True  # ... and observe every message: the most a view without finals can see
        view = AdversaryView("collusion", everything.corrupted, observed)
        for t in range(T + 1):  # (offline parties repeat a message: Sigma is singular, use certify)
            assert certify(trace, prefix_view(view, t), value_sensitivity=2.0).max_mu <= ceilings[t] * (1 + REL)


def test_a_view_too_large_for_the_exact_method_uses_the_bound(monkeypatch):
    from flwr_inca.privacy import certificate as module

    trace, view = _execution(3)
    assert PrefixProfile.build(trace, view) is not None
    monkeypatch.setattr(module, "EXACT_MAX_ROWS", 0)  # every view is "large"
    assert PrefixProfile.build(trace, view) is None


def test_a_view_whose_exact_matrices_exceed_the_memory_limit_uses_the_bound(monkeypatch):
    """Below the size limits but over this machine's memory limit, auto takes the sound bound (a certificate,
    not a refusal) and the round's prefix path steps aside; forcing the exact method is refused in one line."""
    from flwr_inca._checks import MEMORY_ENV
    from flwr_inca.privacy.bound import bound_bytes
    from flwr_inca.privacy.certificate import choose_solver, exact_affordable, exact_bytes

    # large enough that the exact method's dense matrices need more than the bound's batches
    trace = sample_trace(600, IncaConfig(iterations=4, sigma_star=1.0, sigma_delta=6.0,
                                         dropout=PermanentDropout(0.1)), seed=1)
    view = random_collusion(trace, 0.1, seed=2)
    assert choose_solver(trace, view) == "exact" and exact_affordable(trace, view)
    need = exact_bytes(trace.parties, int(view.honest.size), int(view.honest_observed().sum()), trace.iterations)
    room = bound_bytes(trace.parties, trace.iterations)
    assert room < need
    monkeypatch.setenv(MEMORY_ENV, str(int((room + need) / 2)))
    assert not exact_affordable(trace, view)
    assert choose_solver(trace, view) == "bound"
    assert PrefixProfile.build(trace, view) is None
    assert certify(trace, view).method == "bound"
    with pytest.raises(ValueError, match="the exact certificate of .* over the limit"):
        certify(trace, view, solver="exact")


def _dense_reference(trace, view):
    """The prefix costs from the dense system (``A_V`` formed explicitly), one scipy Cholesky and triangular
    solve of the full covariance: ``(cumulative mu^2 (T+2, n_H), L, W, condition number)``."""
    model = build_model(trace, view, method="dense")
    Sigma = model.covariance(trace.sigma_star, trace.sigma_delta)
    L = la.cholesky(Sigma, lower=True)
    W = la.solve_triangular(L, model.H, lower=True)
    offsets = np.searchsorted(model.rows[:, 1], np.arange(trace.iterations + 2))
    csum = np.concatenate([np.zeros((1, W.shape[1])), np.cumsum(W * W, axis=0)])
    return csum[offsets], L, W, np.linalg.cond(Sigma)


def _larger_execution(seed):
    rng = np.random.default_rng(100 + seed)
    dropout = [None, PermanentDropout(0.2), TemporaryDropout(0.3)][seed % 3]
    config = IncaConfig(iterations=int(rng.integers(4, 13)), neighbors=int(rng.integers(1, 3)),
                        sigma_star=float(rng.uniform(0.05, 2)), sigma_delta=float(rng.uniform(0.5, 30)),
                        schedule=("incremental", "early")[seed % 2], dropout=dropout)
    trace = sample_trace(int(rng.integers(20, 60)), config, seed=seed)
    view = (random_collusion(trace, 0.2, seed) if seed % 4 < 2 else random_eavesdrop(trace, 0.4, seed))
    return trace, view


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", ["small", "larger"])
def test_every_prefix_and_the_finals_factor_match_a_dense_cholesky(size):
    """The profile (the covariance propagated into one triangle, factorized in place) against the dense
    system's covariance factorized by scipy: every prefix's mu, the finals' factor and whitened rows agree
    to 1e-12 relative where Sigma is well conditioned, and within the rounding a solve with its condition
    number allows (4 eps cond(Sigma)) elsewhere."""
    eps = np.finfo(float).eps
    for seed in range(40 if size == "small" else 16):
        trace, view = _execution(seed) if size == "small" else _larger_execution(seed)
        prof = PrefixProfile.build(trace, view)
        cumulative, L, W, condition = _dense_reference(trace, view)
        rel = max(1e-12, 4 * eps * condition)
        for t in range(trace.iterations + 2):
            ref = np.sqrt(cumulative[t])
            np.testing.assert_allclose(prof.mu_through(t), ref, rtol=rel, atol=1e-300, err_msg=f"{seed}, {t}")
        a = L.shape[0] - prof.final_parties.size
        assert not np.triu(prof.last_factor, 1).any()  # lower triangular: mu_with_finals multiplies by it
        np.testing.assert_allclose(prof.last_factor, L[a:, a:], rtol=0, atol=rel * np.abs(L).max())
        np.testing.assert_allclose(prof.last_whitened, W[a:], rtol=0, atol=rel * max(np.abs(W).max(), 1e-300))


@pytest.mark.timeout(120)
def test_a_profile_holds_one_covariance_sized_matrix():
    """The covariance is propagated into one (m, m) triangle and factorized there: no Gram of B_V or of
    A_V, no copy of Sigma for the factorization (before: five (m, m) float64 matrices at the peak)."""
    trace = sample_trace(400, IncaConfig(iterations=30, sigma_star=0.5, sigma_delta=5.0,
                                         dropout=PermanentDropout(0.1)), seed=1)
    view = random_collusion(trace, 0.1, seed=1)
    m = int(view.honest_observed().sum())
    tracemalloc.start()
    try:
        PrefixProfile.build(trace, view)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3.5 * 8 * m * m, (peak / (8 * m * m), m)  # 1 for Sigma/L, the rest O(m n) and O(n^2)

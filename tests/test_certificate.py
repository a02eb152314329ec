import math
import zlib

import numpy as np
import pytest
from reference import brute_force_mu

from flwr_inca import (
    IncaConfig,
    InjectionSchedule,
    MarkovDropout,
    PermanentDropout,
    ScheduledDropout,
    StaticTopology,
    TemporaryDropout,
)
from flwr_inca.privacy import (
    adversarial_collusion,
    analyze_structure,
    certify,
    collusion_view,
    eavesdrop_view,
    profile,
    random_collusion,
    random_eavesdrop,
)
from flwr_inca.protocol import sample_trace

DROPOUTS = [None, PermanentDropout(0.3), TemporaryDropout(0.3), MarkovDropout(0.3, 0.5),
            ScheduledDropout({1: [0, 2]})]
CUSTOM = InjectionSchedule.custom(
    [0.1, 0.2, 0.3, 0.4],
    [[1.0, 0.5, 0.0], [-0.5, 1.0, 1.0], [0.0, -2.0, 0.5], [-0.5, 0.5, -1.5]],
)


def _trace(n, T, k, dropout, seed, schedule="incremental", s_star=0.4, s_delta=2.0):
    return sample_trace(n, IncaConfig(iterations=T, neighbors=k, sigma_star=s_star, sigma_delta=s_delta,
                                      schedule=schedule, dropout=dropout), seed=seed)


def _assert_close(cert, brute):
    assert set(cert.mu) == set(brute)
    for i, mu in cert.mu.items():
        b = brute[i]
        if math.isinf(b) or math.isinf(mu):
            assert math.isinf(b) and math.isinf(mu), (i, mu, b)
        else:
            assert mu == pytest.approx(b, rel=1e-6, abs=1e-9), (i, mu, b)


@pytest.mark.parametrize("schedule", ["incremental", "early", CUSTOM], ids=["inc", "early", "custom"])
@pytest.mark.parametrize("dropout", DROPOUTS, ids=["none", "permanent", "temporary", "markov", "scheduled"])
@pytest.mark.parametrize("threat", ["collusion", "eavesdrop"])
def test_certificate_matches_brute_force_pseudo_inverse(schedule, dropout, threat):
    # deterministic cases: the same in every process (str hashes are salted per process)
    key = f"{schedule!r}|{dropout!r}|{threat}".encode()
    rng = np.random.default_rng(zlib.crc32(key))
    methods = ["dense", "structured"] if schedule == "incremental" else ["dense"]
    for trial in range(6):
        n = int(rng.integers(4, 9))
        T = 3 if schedule is CUSTOM else int(rng.integers(1, 5))
        k = int(rng.integers(1, min(3, n - 1) + 1))
        s_star, s_delta = [(0.4, 2.0), (0.05, 40.0), (1.5, 0.2)][trial % 3]
        trace = _trace(n, T, k, dropout, trial, schedule, s_star, s_delta)
        if threat == "collusion":
            view = random_collusion(trace, 0.3, seed=trial)
        else:
            view = random_eavesdrop(trace, 0.5, seed=trial)
        brute = brute_force_mu(trace, view.corrupted, view.observed, s_star, s_delta)
        for method in methods:
            _assert_close(certify(trace, view, method=method), brute)


def test_explicit_views(rng):
    trace = _trace(8, 4, 2, TemporaryDropout(0.2), 3)
    v = collusion_view(trace, [1, 5])
    assert v.corrupted.tolist() == [1, 5] and 1 not in v.honest
    _assert_close(certify(trace, v), brute_force_mu(trace, [1, 5], v.observed, 0.4, 2.0))
    senders = [(int(trace.steps[0].messages.senders[0]), 1), (int(trace.steps[2].messages.senders[1]), 3)]
    e = eavesdrop_view(trace, senders)
    assert e.observed[0, senders[0][0]] and e.observed[2, senders[1][0]]
    _assert_close(certify(trace, e), brute_force_mu(trace, [], e.observed, 0.4, 2.0))
    offline_first = _trace(8, 4, 2, ScheduledDropout({1: [0]}), 3)
    with pytest.raises(ValueError, match="party 0 delivered no message at iteration 1"):
        eavesdrop_view(offline_first, [(0, 1)])


def test_corrupted_finals_observed_and_honest_rows_only(rng):
    trace = _trace(10, 5, 1, None, 0)
    v = collusion_view(trace, [0, 1])
    assert v.observed[:, [0, 1]].all()  # corrupted parties' messages are all known
    assert v.observed[5].all()  # finals of everyone online at T
    assert not v.honest_observed()[:, [0, 1]].any()


# ------------------------------------------------------------------------------ theory limits
def test_no_dropout_large_sigma_delta_reaches_central_dp_floor():
    n, rho = 30, 0.2
    trace = _trace(n, 14, 1, None, 5)
    view = random_collusion(trace, rho, seed=1)
    report = analyze_structure(trace, view)
    assert report.rank_condition  # Theorem 4.5's precondition holds on this execution
    nH = view.honest.size
    s_star = 0.7
    floor = 1 / math.sqrt(nH) / s_star
    prof = profile(trace, view)
    assert np.allclose(prof.mu_limit(s_star), floor, rtol=1e-8)
    cert = certify(trace, view, sigma_star=s_star, sigma_delta=1e5)
    assert max(cert.mu.values()) == pytest.approx(floor, rel=1e-4)
    assert min(cert.mu.values()) == pytest.approx(floor, rel=1e-4)


def test_temporary_dropouts_floor_is_w_max_over_norm_w():
    from flwr_inca.protocol.schedules import adapted_rows

    trace = _trace(24, 12, 1, TemporaryDropout(0.25), 8)
    view = random_collusion(trace, 0.125, seed=2)
    assert analyze_structure(trace, view).rank_condition
    c_o, _ = adapted_rows(trace.schedule, trace.online_mask())
    w = c_o.sum(axis=0)[view.honest]  # injected weights of the honest parties
    s_star = 0.5
    mu = profile(trace, view).mu_limit(s_star)
    assert np.allclose(mu, w / np.linalg.norm(w) / s_star, rtol=1e-8)


@pytest.mark.parametrize("dropout", [None, TemporaryDropout(0.3)])
def test_everything_observed_gives_local_dp(dropout):
    trace = _trace(9, 4, 2, dropout, 4)
    view = random_eavesdrop(trace, 1.0, seed=0)
    s_star = 0.6
    for s_delta in [0.5, 10.0, 1e4]:
        cert = certify(trace, view, sigma_star=s_star, sigma_delta=s_delta)
        assert np.allclose(list(cert.mu.values()), 1 / s_star, rtol=1e-7)


def test_mu_non_increasing_in_sigma_delta_and_scaling():
    trace = _trace(40, 10, 2, PermanentDropout(0.2), 9)
    view = random_collusion(trace, 0.2, seed=3)
    prof = profile(trace, view)
    grid = np.geomspace(1e-3, 1e4, 60)
    mus = np.array([prof.mu(0.3, s) for s in grid])
    assert np.all(np.diff(mus, axis=0) <= 1e-12)
    assert mus[0].max() > 5 * mus[-1].max()  # and sigma_delta matters
    # scaling both sigmas by c divides mu by c; value sensitivity multiplies it
    a = certify(trace, view, sigma_star=0.3, sigma_delta=2.0)
    b = certify(trace, view, sigma_star=0.9, sigma_delta=6.0, value_sensitivity=3.0)
    assert np.allclose(list(a.mu.values()), list(b.mu.values()), rtol=1e-9)


def test_min_sigma_delta_meets_target():
    trace = _trace(50, 12, 1, PermanentDropout(0.1), 12)
    view = random_collusion(trace, 0.1, seed=0)
    prof = profile(trace, view)
    target = 0.12
    s = prof.min_sigma_delta(1.0, target)
    assert math.isfinite(s)
    assert prof.mu(1.0, s).max() <= target
    assert prof.mu(1.0, s * 0.999).max() > target
    # independently, with the brute-force pseudo-inverse: the returned sigma_delta meets the target ...
    assert max(brute_force_mu(trace, view.corrupted, view.observed, 1.0, s).values()) <= target * (1 + 1e-6)
    # ... and without dropouts, at sigma_star = 0.3 even a huge sigma_delta leaves the honest parties
    # above the target (the central-DP floor), so no sigma_delta can be returned
    steady = _trace(50, 12, 1, None, 12)
    view = random_collusion(steady, 0.1, seed=0)
    huge = brute_force_mu(steady, view.corrupted, view.observed, 0.3, 1e6)
    assert max(huge.values()) > target
    assert profile(steady, view).min_sigma_delta(0.3, target) == math.inf
    assert math.isfinite(profile(steady, view).min_sigma_delta(1.5, target))


def test_sigma_star_zero_is_never_private():
    trace = _trace(12, 6, 1, None, 1)
    cert = certify(trace, random_collusion(trace, 0.2, seed=0), sigma_star=0.0, sigma_delta=5.0)
    assert cert.max_mu == math.inf and cert.notes


def test_certificate_epsilon_and_dict():
    trace = _trace(20, 8, 1, None, 2)
    cert = certify(trace, random_collusion(trace, 0.1, seed=0), delta=1e-5, value_sensitivity=2.0)
    from flwr_inca.privacy import epsilon_for_delta

    assert cert.epsilon == pytest.approx(epsilon_for_delta(cert.max_mu, 1e-5))
    d = cert.to_dict()
    assert d["max_mu"] == cert.max_mu and len(d["mu"]) == 18 and d["value_sensitivity"] == 2.0
    with pytest.raises(ValueError, match="delta"):
        certify(trace, random_collusion(trace, 0.1, seed=0), delta=2.0)


# ------------------------------------------------------------------------------ structure
def test_union_find_agrees_with_numerical_rank():
    for seed in range(6):
        trace = _trace(25, 6, 1, None, seed)
        view = random_collusion(trace, 0.3, seed=seed)
        report = analyze_structure(trace, view)
        assert report.connected is not None
        # independent rank of the edge vectors of the unseen honest graph
        honest = list(view.honest)
        pos = {p: j for j, p in enumerate(honest)}
        rows = []
        for t in range(trace.iterations):
            m = trace.steps[t].messages
            for s, r in zip(m.senders, m.receivers):
                if s in pos and r in pos and not view.observed[t, s]:
                    v = np.zeros(len(honest))
                    v[pos[s]], v[pos[r]] = -0.5, 0.5
                    rows.append(v)
        rank = np.linalg.matrix_rank(np.array(rows)) if rows else 0
        assert report.rank == rank
        assert report.rank_condition == (rank >= len(honest) - 1)


def test_rank_condition_fails_when_messages_are_too_few():
    trace = _trace(40, 1, 1, None, 0)
    report = analyze_structure(trace, random_collusion(trace, 0.3, seed=0))
    assert not report.rank_condition and report.components > 1
    assert "FAILS" in report.summary()


def test_theorem_4_9_negative_condition_on_static_ring():
    n = 10
    trace = sample_trace(n, IncaConfig(iterations=8, sigma_star=0.5, sigma_delta=1.0,
                                       topology=StaticTopology.ring(n)), seed=0)
    view = collusion_view(trace, [0])  # party 0 sees every message of its ring neighbours 1 and 9
    report = analyze_structure(trace, view)
    assert report.static and {1, 9} <= set(report.fully_observed)
    assert report.negative_condition
    # and indeed no sigma_delta brings the weakest party to the central-DP floor
    prof = profile(trace, view)
    assert prof.mu_limit(0.5).max() > 1.5 / math.sqrt(view.honest.size) / 0.5


def test_adversarial_search_is_worse_than_random():
    trace = _trace(60, 10, 1, None, 1, s_star=0.3, s_delta=5.0)
    random_mu = certify(trace, random_collusion(trace, 0.1, seed=0)).max_mu
    result = adversarial_collusion(trace, 0.1, candidates=4)
    assert result.corrupted.size == 6 and result.target not in result.corrupted
    assert result.certificate.max_mu > random_mu
    assert result.certificate.mu[result.target] == result.certificate.max_mu


def test_bad_views_rejected():
    trace = _trace(6, 3, 1, None, 0)
    with pytest.raises(ValueError, match="at least one party must be honest"):
        collusion_view(trace, range(6))
    with pytest.raises(ValueError, match=r"\[0, 5\]"):
        collusion_view(trace, [7])
    with pytest.raises(ValueError, match=r"rho must be in \[0, 1\)"):
        random_collusion(trace, 1.0)
    with pytest.raises(ValueError, match="observed fraction"):
        random_eavesdrop(trace, 1.5)
    with pytest.raises(ValueError, match="iteration must be in"):
        eavesdrop_view(trace, [(0, 9)])
    other = _trace(7, 3, 1, None, 0)
    with pytest.raises(ValueError, match="does not match"):
        certify(trace, random_collusion(other, 0.2))


@pytest.mark.parametrize("n, fraction, expected", [(5, 0.1, 1), (4, 0.1, 1), (25, 0.1, 3), (30, 0.1, 3),
                                                    (200, 0.1, 20), (10, 0.0, 0), (10, 0.99, 9)])
def test_random_coalitions_round_up(n, fraction, expected):
    # rounding down (or half to even) would certify against fewer colluders than the stated fraction
    trace = _trace(n, 2, 1, None, 0)
    assert random_collusion(trace, fraction, seed=0).corrupted.size == expected
    eaves = random_eavesdrop(trace, 0.25, seed=0)  # n messages at iteration 1: ceil(n/4) intercepted
    assert eaves.observed[0].sum() == -(-n // 4)

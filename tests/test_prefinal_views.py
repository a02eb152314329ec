"""Views and certificates for a subset of the final messages (a round certified before its finals).

The property the pre-final rule rests on: on any execution and against any adversary, the certificate
with every final message observed (the pre-final view) is at least the certificate with any subset of
the finals observed, including none. Checked on random small executions (all schedules, dropout
models, both threat models) against the dense brute-force reference (tests/reference.py).
"""

import math

import numpy as np
import pytest
from reference import brute_force_mu

from flwr_inca import (
    IncaConfig,
    InjectionSchedule,
    MarkovDropout,
    PermanentDropout,
    ScheduledDropout,
    TemporaryDropout,
)
from flwr_inca.privacy import certify, collusion_view, eavesdrop_view, random_collusion, random_eavesdrop
from flwr_inca.privacy.prefinal import no_finals_bound
from flwr_inca.privacy.views import recorded_finals, with_finals
from flwr_inca.protocol import sample_trace

DROPOUTS = [None, PermanentDropout(0.3), TemporaryDropout(0.3), MarkovDropout(0.3, 0.5),
            ScheduledDropout({1: [0, 2]})]
CUSTOM = InjectionSchedule.custom(
    [0.1, 0.2, 0.3, 0.4],
    [[1.0, 0.5, 0.0], [-0.5, 1.0, 1.0], [0.0, -2.0, 0.5], [-0.5, 0.5, -1.5]],
)
SIGMAS = [(0.4, 2.0), (0.05, 40.0), (1.5, 0.2)]


def _trace(n, T, k, dropout, seed, schedule, s_star, s_delta):
    return sample_trace(n, IncaConfig(iterations=T, neighbors=k, sigma_star=s_star, sigma_delta=s_delta,
                                      schedule=schedule, dropout=dropout), seed=seed)


def _subsets(online, rng, count):
    """The empty set, all of ``online``, and ``count`` random subsets in between."""
    online = [int(i) for i in online]
    out = [[], list(online)]
    for _ in range(count):
        out.append(sorted(rng.choice(online, size=int(rng.integers(0, len(online) + 1)), replace=False)))
    return out


def _close(a, b):
    if math.isinf(a) or math.isinf(b):
        return math.isinf(a) and math.isinf(b)
    return a == pytest.approx(b, rel=1e-6, abs=1e-9)


def _at_most(a, b):
    """a <= b up to the round-off of two factorizations."""
    return a <= b * (1 + 1e-7) + 1e-9


@pytest.mark.parametrize("schedule", ["incremental", "early", CUSTOM], ids=["inc", "early", "custom"])
@pytest.mark.parametrize("dropout", DROPOUTS, ids=["none", "permanent", "temporary", "markov", "scheduled"])
@pytest.mark.parametrize("threat", ["collusion", "eavesdrop"])
def test_prefinal_certificate_bounds_every_subset_of_finals(schedule, dropout, threat):
    kind = ["incremental", "early"].index(schedule) if isinstance(schedule, str) else 2
    rng = np.random.default_rng([7, kind, DROPOUTS.index(dropout), threat == "collusion"])
    checked = 0
    for trial in range(4):
        n = int(rng.integers(4, 9))
        T = 3 if schedule is CUSTOM else int(rng.integers(1, 5))
        k = int(rng.integers(1, min(3, n - 1) + 1))
        s_star, s_delta = SIGMAS[trial % 3]
        trace = _trace(n, T, k, dropout, trial, schedule, s_star, s_delta)
        if threat == "collusion":
            pre = random_collusion(trace, 0.3, seed=trial)
        else:
            pre = random_eavesdrop(trace, 0.5, seed=trial)
        cert_pre = certify(trace, pre)
        brute_pre = brute_force_mu(trace, pre.corrupted, pre.observed, s_star, s_delta)
        for i, mu in cert_pre.mu.items():
            assert _close(mu, brute_pre[i]), (i, mu, brute_pre[i])
        for finals in _subsets(trace.finalists(), rng, 3):
            view = with_finals(pre, trace, finals)
            # same adversary: only the finals differ
            assert np.array_equal(view.corrupted, pre.corrupted)
            assert np.array_equal(view.observed[:-1], pre.observed[:-1])
            expected_last = np.zeros(n, dtype=bool)
            expected_last[finals] = True
            expected_last[pre.corrupted] = True
            assert np.array_equal(view.observed[-1], expected_last)
            # the random builders draw the same adversary whatever the finals
            drawn = (random_collusion(trace, 0.3, seed=trial, finals=finals) if threat == "collusion"
                     else random_eavesdrop(trace, 0.5, seed=trial, finals=finals))
            assert np.array_equal(drawn.observed, view.observed)
            cert = certify(trace, view)
            brute = brute_force_mu(trace, view.corrupted, view.observed, s_star, s_delta)
            for i, mu in cert.mu.items():
                assert _close(mu, brute[i]), (finals, i, mu, brute[i])
                assert _at_most(brute[i], brute_pre[i]), (finals, i, brute[i], brute_pre[i])
                assert _at_most(mu, cert_pre.mu[i]), (finals, i, mu, cert_pre.mu[i])
            assert _at_most(cert.max_mu, cert_pre.max_mu)
            checked += 1
    assert checked == 4 * 5


def test_withholding_finals_lowers_the_cost_strictly_when_they_reveal_the_sum():
    """Without dropouts the finals reveal the noise-free sum: with them mu is at the central-DP level;
    without them an eavesdropper of half the messages sees only terms drowned in sigma_delta."""
    trace = _trace(12, 6, 2, None, 1, "incremental", 0.5, 50.0)
    pre = random_eavesdrop(trace, 0.5, seed=3)
    assert certify(trace, with_finals(eavesdrop_view(trace, []), trace, ())).max_mu == 0.0  # nothing seen
    none = with_finals(pre, trace, ())
    mu_pre, mu_none = certify(trace, pre).max_mu, certify(trace, none).max_mu
    assert mu_pre > 10 * mu_none > 0
    # one final is enough to leak a noisy combination: in between
    one = certify(trace, with_finals(pre, trace, [3])).max_mu
    assert mu_none < one <= mu_pre * (1 + 1e-9)


def test_explicit_views_restricted_and_bad_finals_named():
    trace = _trace(8, 3, 1, PermanentDropout(0.3), 2, "incremental", 0.4, 2.0)
    online = trace.finalists()
    offline = sorted(set(range(8)) - set(online.tolist()))
    assert offline, "the seed must leave someone offline at T"
    view = collusion_view(trace, [0, 1])
    assert np.array_equal(with_finals(view, trace, None).observed, view.observed)
    with pytest.raises(ValueError, match=r"finals must be parties online at the last iteration; \[" +
                       str(offline[0])):
        with_finals(view, trace, [offline[0]])
    with pytest.raises(ValueError, match="finals must be parties online"):
        random_collusion(trace, 0.2, seed=0, finals=[99])
    other = _trace(8, 4, 1, None, 2, "incremental", 0.4, 2.0)
    with pytest.raises(ValueError, match="does not match the trace"):
        with_finals(view, other, ())


def test_recorded_finals_read_what_the_relay_wrote():
    trace = _trace(6, 2, 1, None, 0, "incremental", 0.4, 2.0)
    assert recorded_finals(trace) is None  # not recorded: every party online at T counts
    trace.meta["finalists"] = [4, 1]
    assert recorded_finals(trace).tolist() == [1, 4]
    trace.meta["finalists"] = []  # a round stopped before its finals
    assert recorded_finals(trace).tolist() == []
    for bad in ("all", [1.5], [True], [17]):
        trace.meta["finalists"] = bad
        with pytest.raises(ValueError, match="finalists|finals"):
            recorded_finals(trace)


@pytest.mark.parametrize("schedule", ["incremental", "early", CUSTOM], ids=["inc", "early", "custom"])
def test_no_finals_bound_caps_every_view_without_finals_and_is_attained(schedule):
    rng = np.random.default_rng(11)
    for trial in range(4):
        n = int(rng.integers(4, 9))
        T = 3 if schedule is CUSTOM else int(rng.integers(1, 5))
        s_star, s_delta = SIGMAS[trial % 3]
        sched = InjectionSchedule.resolve(schedule, T)
        bound = no_finals_bound(sched, s_star, s_delta, value_sensitivity=2.0)
        assert 0 < bound < math.inf
        for dropout in DROPOUTS:
            trace = _trace(n, T, 1 + trial % 2, dropout, trial, schedule, s_star, s_delta)
            views = [random_collusion(trace, 0.3, seed=trial, finals=()),
                     random_eavesdrop(trace, 0.5, seed=trial, finals=()),
                     random_eavesdrop(trace, 1.0, seed=trial, finals=())]
            for view in views:
                assert _at_most(certify(trace, view, value_sensitivity=2.0).max_mu, bound)
        # every message before the finals observed, nobody dropped out: the bound is reached exactly
        trace = _trace(n, T, 1, None, trial, schedule, s_star, s_delta)
        everything = random_eavesdrop(trace, 1.0, seed=0, finals=())
        assert everything.observed[:-1].all()
        brute = brute_force_mu(trace, [], everything.observed, s_star, s_delta)
        assert max(brute.values()) * 2.0 == pytest.approx(bound, rel=1e-6)

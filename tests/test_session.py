"""The round session (admission, write-ahead reservation, guard, release, charge, refusals), through its
public API, on synthetic costs and on real IncA executions."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flwr_inca import IncaConfig, PermanentDropout
from flwr_inca.protocol import sample_trace
from flwr_inca.privacy import PrivacyLedger, epsilon_for_delta
from flwr_inca.privacy.prefix import RoundPrefix, prefix_ceilings
from flwr_inca.privacy.rounds import RoundCertificate, certification_seeds
from flwr_inca.privacy.session import BudgetExhausted, RoundSession, charge_resolution
from flwr_inca.protocol.schedules import InjectionSchedule

DELTA = 1e-5


def _budget(*mus):
    """A max_epsilon that exactly the rounds ``mus`` fit (and a hair more)."""
    return epsilon_for_delta(math.sqrt(sum(m * m for m in mus)), DELTA) * (1 + 1e-9)


def _cert(mu, method="exact"):
    return RoundCertificate(mu, (method,))


def test_a_round_that_fits_is_reserved_before_its_first_step_and_settled_to_its_cost(tmp_path):
    ledger = PrivacyLedger(tmp_path / "l.json", delta=DELTA, max_epsilon=10.0)
    session = RoundSession(ledger)
    session.admit(1, predicted_mu=lambda: 0.5)
    rnd = session.open(1, ceilings=[0.2, 0.4, 0.6])
    assert not rnd.guarded and ledger.entries[0].reserved and ledger.entries[0].mu == 0.6
    assert all(rnd.may_deliver(s) for s in (1, 2, 3))
    assert ledger.rounds == 1  # no write per step: the whole ceiling was reserved
    assert rnd.may_release(_cert(0.7))
    assert ledger.entries[0].mu == 0.7  # raised, durably, before the release
    charge = rnd.settle(_cert(0.55))
    assert charge.outcome == "released" and charge.mu == 0.55 and not charge.stop
    assert ledger.entries[0].status == "charged" and ledger.entries[0].mu == 0.55


def test_a_round_whose_ceiling_does_not_fit_is_guarded_step_by_step(tmp_path):
    ledger = PrivacyLedger(tmp_path / "l.json", delta=DELTA, max_epsilon=_budget(0.45))
    calls = []

    def exact(step):
        calls.append(step)
        return _cert([0.1, 0.3, 0.5][step - 1])

    session = RoundSession(ledger)
    rnd = session.open(1, ceilings=[0.2, 0.4, 0.6], certify_through=exact)
    assert rnd.guarded and ledger.rounds == 0  # nothing reserved yet: nothing left the process
    # the ceilings fit up to step 2: reserved ahead for both steps in one write
    assert rnd.may_deliver(1) and ledger.entries[0].mu == 0.4 and calls == []
    assert rnd.revealed.mu == 0.2  # what step 1 reveals is its own ceiling
    assert rnd.may_deliver(2) and ledger.entries[0].mu == 0.4
    assert not rnd.may_deliver(3)  # ceiling 0.6 and exact 0.5 both above 0.45
    assert calls == [3, 2]  # the blocked step certified, then what was delivered, exactly
    assert ledger.entries[0].mu == 0.4 and ledger.entries[0].reserved  # unchanged by the refusal
    charge = rnd.refuse()
    assert charge.outcome == "refused" and charge.delivered == 2 and charge.mu == 0.3  # exact, below ceiling
    assert ledger.entries[0].mu == 0.3 and not ledger.entries[0].reserved and not charge.stop


def test_guarded_steps_reserve_their_certificate_with_headroom_so_later_steps_need_no_write(tmp_path):
    from flwr_inca.privacy.session import EXACT_HEADROOM

    ledger = PrivacyLedger(tmp_path / "l.json", delta=DELTA, max_epsilon=_budget(0.3))
    costs = [0.1, 0.11, 0.12, 0.2, 0.29]
    session = RoundSession(ledger)
    rnd = session.open(1, ceilings=[1.0] * 5, certify_through=lambda step: _cert(costs[step - 1]))
    assert rnd.guarded
    writes = []
    for step in range(1, 6):
        assert rnd.may_deliver(step) and rnd.revealed.mu == costs[step - 1]
        writes.append(ledger.entries[0].mu)
        assert ledger.entries[0].mu >= costs[step - 1]  # never less than what was delivered
    head = 0.1 * EXACT_HEADROOM
    # steps 2 and 3 fit under step 1's headroom; step 4 takes its own; step 5's headroom does not fit
    assert writes == pytest.approx([head, head, head, 0.2 * EXACT_HEADROOM, 0.29])


def test_a_release_that_does_not_fit_is_withheld_and_the_round_charged_without_it(tmp_path):
    ledger = PrivacyLedger(tmp_path / "l.json", delta=DELTA, max_epsilon=_budget(0.65))
    session = RoundSession(ledger, max_consecutive_refusals=2)
    for rnd_no in (1, 2):
        rnd = session.open(rnd_no, ceilings=[0.2, 0.3])
        assert all(rnd.may_deliver(s) for s in (1, 2))
        assert not rnd.may_release(_cert(0.9))
        charge = rnd.refuse(_cert(0.25))  # the driver's exact no-release cost, below the reserved ceiling
        assert charge.mu == 0.25 and charge.delivered == 2 and not charge.released
    assert charge.stop and "2 round(s) in a row" in charge.stop
    err = session.stop(charge)
    assert isinstance(err, BudgetExhausted) and err.round == 2 and err.started and err.delivered == 2
    with pytest.raises(BudgetExhausted, match="training stopped at round 2"):
        session.admit(3, predicted_mu=lambda: 0.0)


def test_a_released_round_resets_the_refusal_count(tmp_path):
    ledger = PrivacyLedger(None, delta=DELTA, max_epsilon=_budget(0.3, 0.3, 0.3, 0.3))
    session = RoundSession(ledger, max_consecutive_refusals=2)
    for _ in range(3):
        rnd = session.open(1, ceilings=[0.1])
        rnd.may_deliver(1)
        assert not rnd.may_release(_cert(5.0))
        assert not rnd.refuse().stop
        rnd = session.open(2, ceilings=[0.1])
        rnd.may_deliver(1)
        rnd.may_release(_cert(0.1))
        rnd.settle(_cert(0.1))
        assert session.refusals == 0


def test_nothing_delivered_stops_training_and_a_mechanism_without_steps_records_nothing(tmp_path):
    ledger = PrivacyLedger(tmp_path / "l.json", delta=DELTA, max_epsilon=_budget(0.1))
    session = RoundSession(ledger)
    rnd = session.open(1, ceilings=[])  # e.g. central DP: nothing revealed before the release
    assert ledger.rounds == 0
    assert not rnd.may_release(_cert(0.5))
    charge = rnd.refuse()
    assert charge.mu == 0 and charge.entry is None and ledger.rounds == 0 and "nothing of it" in charge.stop


def test_admission_uses_the_prediction_only_when_needed(tmp_path):
    ledger = PrivacyLedger(None, delta=DELTA, max_epsilon=_budget(0.5))
    session = RoundSession(ledger)
    called = []

    def predicted():
        called.append(1)
        return 0.9

    session.admit(1, predicted_mu=predicted, known_mu=0.4)  # its own cost fits: no prediction
    assert not called
    with pytest.raises(BudgetExhausted, match="stopping before round 1.*predicted cost is mu = 0.9") as err:
        session.admit(1, predicted_mu=predicted, known_mu=0.6, hint=lambda: "Raise epsilon.")
    assert called and str(err.value).endswith("Raise epsilon.") and ledger.rounds == 0
    assert err.value.predicted_epsilon > err.value.max_epsilon
    RoundSession(PrivacyLedger(None, delta=DELTA)).admit(1, predicted_mu=lambda: math.inf)  # no budget


def test_a_failed_round_is_charged_its_reservation(tmp_path):
    ledger = PrivacyLedger(tmp_path / "l.json", delta=DELTA)
    session = RoundSession(ledger)
    rnd = session.open(4, ceilings=[0.2, 0.4])
    rnd.may_deliver(1)
    charge = rnd.fail("mixing failed")
    assert charge.outcome == "failed" and charge.mu == 0.4 and ledger.entries[0].status == "charged"
    assert "round 4: mixing failed" in ledger.entries[0].note


def test_charges_are_rounded_up_to_the_resolution_and_keep_the_certified_cost(tmp_path):
    ledger = PrivacyLedger(tmp_path / "l.json", delta=DELTA)
    session = RoundSession(ledger, resolution=0.005)
    rnd = session.open(1, ceilings=[0.3])
    rnd.may_deliver(1)
    rnd.may_release(_cert(0.41))
    charge = rnd.settle(_cert(0.4))
    assert charge.mu == charge_resolution(0.4, 0.005) >= 0.4 and charge.certified_mu == 0.4
    assert ledger.entries[0].certified_mu == 0.4 and ledger.entries[0].mu == charge.mu


def test_bad_settings_are_named():
    ledger = PrivacyLedger(None, delta=DELTA)
    with pytest.raises(ValueError, match="max_consecutive_refusals"):
        RoundSession(ledger, max_consecutive_refusals=0)
    with pytest.raises(ValueError, match="sample_rate"):
        RoundSession(ledger, sample_rate=0)
    with pytest.raises(ValueError, match="ledger must be a PrivacyLedger"):
        RoundSession("ledger.json")


# ---------------------------------------------------------------------------- real IncA executions
N, T = 12, 4


def _inca_round(seed, budget):
    """Drive one IncA round through the session as a deployment does: ceilings over any execution,
    the guard's exact certificates, the pre-final rule, the charge; returns (charge, prefix)."""
    config = IncaConfig(iterations=T, neighbors=1, sigma_star=1.0, sigma_delta=4.0, dropout=PermanentDropout(0.2))
    trace = sample_trace(N, config, seed=seed)
    prefix = RoundPrefix(trace, certification_seeds(7, seed), 2, collusion=0.2)
    ceilings = prefix_ceilings(InjectionSchedule.resolve("incremental", T), 1.0, 4.0, 1.0)[1:]
    session = RoundSession(PrivacyLedger(None, delta=DELTA, max_epsilon=budget))
    rnd = session.open(seed, ceilings=ceilings, certify_through=prefix.through)
    for t in range(1, T + 1):
        if not rnd.may_deliver(t):
            return rnd.refuse(), prefix, ceilings
    if not rnd.may_release(prefix.with_finals()):
        return rnd.refuse(prefix.through(T)), prefix, ceilings
    return rnd.settle(prefix.with_finals()), prefix, ceilings


@pytest.mark.parametrize("seed", range(6))
def test_on_real_executions_the_charge_is_never_below_what_was_delivered(seed):
    _, prefix, ceilings = _inca_round(seed, None)
    full = prefix.with_finals().mu
    for budget_mu in np.linspace(0.05, 1.2, 7) * max(full, ceilings[-1]):
        charge, _, _ = _inca_round(seed, _budget(budget_mu))
        exact_delivered = prefix.through(charge.delivered).mu if charge.delivered else 0.0
        assert charge.certified_mu >= exact_delivered * (1 - 1e-9)
        if charge.released:
            assert charge.certified_mu == pytest.approx(full, rel=1e-12)
        else:  # refused: what it charged fits the budget, and it stopped at the first step that did not
            assert charge.epsilon <= _budget(budget_mu)
            if charge.delivered < T:
                nxt = charge.delivered + 1
                assert min(ceilings[nxt - 1], prefix.through(nxt).mu) > budget_mu * (1 - 1e-9)


# ---------------------------------------------------------------------------- spending the budget
def test_the_budget_share_spends_exactly_what_is_left():
    from flwr_inca.rounds import budget_share

    budget = _budget(1.0)
    ledger = PrivacyLedger(None, delta=DELTA, max_epsilon=budget)
    assert budget_share(ledger, 4) == pytest.approx(0.5, rel=1e-8)  # sqrt(1 / 4)
    ledger.spend(0.3)  # a round that certified below its share: the others get more
    share = budget_share(ledger, 3)
    assert share == pytest.approx(math.sqrt((1 - 0.09) / 3), rel=1e-8) and share > 0.5
    assert ledger.epsilon_after(share, rounds=3) <= budget * (1 + 1e-9)
    ledger.spend(5.0, force=True)
    assert budget_share(ledger, 2) is None  # nothing left
    assert budget_share(PrivacyLedger(None, delta=DELTA), 2) is None  # no budget


def test_the_budget_share_of_subsampled_rounds_never_exceeds_what_is_left():
    pytest.importorskip("opacus")
    from flwr_inca.rounds import budget_share

    ledger = PrivacyLedger(None, delta=DELTA, max_epsilon=2.0, accountant="opacus-prv")
    ledger.spend(0.5, sample_rate=0.05)
    share = budget_share(ledger, 10, sample_rate=0.05)
    assert ledger.epsilon_after(share, 0.05, rounds=10) <= 2.0
    assert ledger.epsilon_after(share * 1.01, 0.05, rounds=10) > 2.0 * 0.999  # and spends (nearly) all of it


@pytest.mark.timeout(120)
def test_the_searched_budget_share_is_the_largest_grid_point_that_fits():
    """Checked on the accountant itself: the share found on the grid (1 + resolution)^k is a grid point
    that fits and the next grid point does not, whatever the starting guess."""
    pytest.importorskip("opacus")
    from flwr_inca.rounds import budget_share

    ledger = PrivacyLedger(None, delta=DELTA, max_epsilon=1.5, accountant="opacus-prv")
    ledger.spend(0.4, sample_rate=0.1)
    q, left, resolution = 0.1, 6, 0.005

    def fits(mu):
        return ledger.epsilon_after(mu, q, rounds=left) <= 1.5

    shares = set()
    # no guess, one a few grid steps away (as the last round's share is), one far below (the bracket then
    # grows past every finite epsilon: regula falsi must not divide infinities) and one far above
    for guess in (None, 0.2, 0.001, 3.0):
        share = budget_share(ledger, left, q, guess=guess, resolution=resolution)
        k = math.log(share) / math.log1p(resolution)
        assert abs(k - round(k)) < 1e-6, guess  # a grid point
        assert fits(share) and not fits(share * (1 + resolution)), guess
        shares.add(round(k))
    assert len(shares) == 1


@pytest.mark.parametrize("seed", range(60))
def test_last_fitting_finds_the_brute_force_answer(seed):
    """From any start, over an increasing excess (finite, or infinite where no finite epsilon covers a
    cost): the largest index that fits, or None when none does; no index probed twice."""
    from flwr_inca._search import last_fitting

    rng = np.random.default_rng(seed)
    size = int(rng.integers(1, 60))
    excess = np.sort(rng.normal(0.0, 1.0, size) * rng.choice([1e-3, 1.0, 1e3]))
    excess -= excess[int(rng.integers(0, size))] * rng.choice([0.0, 1.0])
    if seed % 4 == 0:
        excess[size - int(rng.integers(0, size + 1)):] = math.inf
    if seed % 5 == 0:
        excess[: int(rng.integers(0, size + 1))] = -math.inf
    lower = int(rng.integers(-5, 5))  # the indices need not start at 0
    fitting = np.flatnonzero(excess <= 0)
    expected = None if len(fitting) == 0 else lower + int(fitting[-1])
    probes = []

    def probe(i):
        probes.append(i)
        return float(excess[i - lower])

    start = lower + int(rng.integers(-3, size + 3))
    found = last_fitting(probe, start, lower, lower + size - 1, stride=int(rng.integers(1, 9)))
    assert found == expected
    assert len(probes) == len(set(probes)) and all(lower <= i < lower + size for i in probes)


def test_last_fitting_refuses_an_empty_range():
    from flwr_inca._search import last_fitting

    for lower, upper, stride in [(3, 2, 1), (0, 5, 0)]:
        with pytest.raises(ValueError, match="last_fitting needs lower <= upper and stride >= 1"):
            last_fitting(lambda i: 0.0, 0, lower, upper, stride=stride)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("spent", [0.2, 0.5, 0.8])
def test_a_guarded_round_reserves_the_furthest_ceiling_that_fits_in_few_compositions(spent):
    """On Opacus's PRV (the ledger of record-level training): the furthest step reserved at once is the
    last whose ceiling fits (brute force over every ceiling); the next round, alike, finds it with two new
    compositions (from where the last one reached; the whole round's reservation, which did not fit last
    time, is not tried), where a bisection over 40 ceilings takes five or six."""
    pytest.importorskip("opacus")
    q, budget = 0.02, 2.0
    ceilings = [0.3 * math.sqrt(s) for s in range(1, 41)]  # grows like a round's prefix ceilings
    ledger = PrivacyLedger(None, delta=DELTA, max_epsilon=budget, accountant="opacus-prv")
    for _ in range(3):
        ledger.spend(spent, sample_rate=q)
    session = RoundSession(ledger, sample_rate=q)
    queries = set()  # distinct compositions asked for (a repeated one is remembered by the accountant)
    epsilon = ledger.accountant.epsilon

    def counted(rounds, delta):
        queries.add((tuple(sorted((r.mu, r.sample_rate) for r in rounds)), delta))
        return epsilon(rounds, delta)

    asked = []
    for round in (1, 2):
        fit = [ledger.epsilon_after(c, q) <= budget for c in ceilings]
        expected = max(i for i, f in enumerate(fit) if f)
        assert 0 < expected < len(ceilings) - 1 and all(fit[: expected + 1]) and not any(fit[expected + 1:])
        ledger.accountant.epsilon, queries = counted, set()
        rnd = session.open(round, ceilings=ceilings)
        assert rnd.guarded and ledger.entries[-1].status == "charged"  # nothing reserved yet
        assert rnd.may_deliver(1)
        ledger.accountant.epsilon = epsilon
        assert ledger.entries[-1].mu == session.charged(ceilings[expected]) and ledger.entries[-1].reserved
        asked.append(len(queries))
        rnd.settle(_cert(0.01))  # a cheap round: the next one reaches as far
    assert asked[0] <= math.ceil(math.log2(len(ceilings))) + 2 and asked[1] <= 2, asked
    # a round whose whole ceiling fits again is reserved whole at its first step (then at its opening)
    for round, expect_guarded in ((3, True), (4, False)):
        rnd = session.open(round, ceilings=[c / 10 for c in ceilings])
        assert rnd.guarded == expect_guarded and rnd.may_deliver(1)
        assert ledger.entries[-1].mu == session.charged(ceilings[-1] / 10) and ledger.entries[-1].reserved
        rnd.settle(_cert(0.01))

"""The pre-final rule and the budget guard in the simulator: a round whose cost with its final messages
would exceed the budget is stopped before them and charged what its mixing revealed without them (as
IncaStrategy does in a deployment); if even that does not fit, it stops before the first iteration whose
messages would not fit and is charged what the iterations before revealed; restarts resume the ledger.
Such a round is skipped and training goes on (tests/test_refused_rounds.py), until max_consecutive_refusals
rounds in a row are refused, a refused round revealed nothing, or (guard off) the budget was overrun.
"""

import dataclasses
import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from synthetic import CLASSES, FEATURES, linear_task

from flwr_inca.privacy import PrivacyLedger, certify, random_collusion
from flwr_inca.privacy.prefix import ROUND_UP, prefix_view
from flwr_inca.protocol.trace import ExecutionTrace
from flwr_inca.simulation import IncaMixer, MixContext, SimulationConfig, iid, simulate
from flwr_inca.simulation.runner import charge_resolution

BUDGET = 1.5


X, Y = linear_task(960)
XT, YT = linear_task(300, seed=1)
MODEL = functools.partial(torch.nn.Linear, FEATURES, CLASSES)
PARTS = iid(X, Y, 24)


@pytest.fixture(autouse=True)
def _rounds_always_start(monkeypatch):
    """These tests run the rounds that the budget refuses as they run: the pre-round check, which stops training
    before a round predicted not to fit (tests/test_budget_check.py), lets every round start here (as
    tests/test_refused_strategy.py does for IncaStrategy)."""
    monkeypatch.setattr(IncaMixer, "predicted_cost", lambda self, participants, runs: 0.0)


def _config(out, **kw):
    return SimulationConfig(rounds=30, epsilon=BUDGET, sigma_star=3.0, sigma_delta=20.0, backend="inline",
                            iterations=5, privacy_unit="party", output_dir=str(out), save_traces=True,
                            **kw)


def _no_finals_mu(trace, config, rnd, value_sensitivity):
    """The stopped round's cost, recomputed independently: the same coalitions, no final observed."""
    root = np.random.SeedSequence(IncaMixer.threat_seed(config.seed), spawn_key=(0, rnd))
    keys = [int(d.generate_state(1, np.uint64)[0]) for d in root.spawn(config.threat_draws)]
    views = [random_collusion(trace, config.collusion, key, finals=()) for key in keys]
    return max(certify(trace, view, value_sensitivity=value_sensitivity).max_mu for view in views)


def test_a_round_over_budget_is_stopped_before_its_finals_and_charged_without_them(tmp_path):
    """The budget runs out: each round that no longer fits is stopped before its finals, charged what it
    revealed without them, and skipped (the model unchanged); training stops after
    max_consecutive_refusals (3) such rounds in a row."""
    config = _config(tmp_path)
    trained = {}
    hist = simulate(MODEL, PARTS, (XT, YT), config, progress=False,
                    on_round=lambda c: trained.__setitem__(c.round, c))
    refused = [r for r in hist.rounds if r.refused]
    done = [r for r in hist.rounds if not r.refused]
    assert len(refused) == config.max_consecutive_refusals == 3 and len(done) >= 1
    assert [r.round for r in refused] == [len(done) + 1, len(done) + 2, len(done) + 3]  # in a row, at the end
    assert hist.stopped.startswith("3 round(s) in a row were refused by the budget (max_consecutive_refusals = 3): "
                                   f"training stops after round {refused[-1].round}; round {refused[-1].round} "
                                   "stopped before its final messages")
    assert "max_epsilon" in hist.stopped
    assert (hist.rounds_trained, hist.rounds_refused) == (len(done), 3)
    for stopped in refused:
        assert stopped.failed.startswith("skipped, refused by the budget: stopped before its final messages")
        assert stopped.round not in trained
    assert [r.round for r in done] == sorted(trained)  # the refused rounds released nothing
    last = trained[done[-1].round]
    assert np.array_equal(hist.parameters, (last.params_before + last.update).astype(np.float32))
    ledger = PrivacyLedger(tmp_path / "ledger.json", delta=1e-5, accountant="exact")
    assert ledger.rounds == len(hist.rounds)  # every round, refused or not, was charged
    before = PrivacyLedger(None, delta=1e-5, accountant="exact")
    for stopped, entry in zip(hist.rounds, ledger.entries):
        if not stopped.refused:
            before.spend(entry.mu)
            continue
        assert entry.note == f"round {stopped.round}: stopped before its final messages"
        # charged exactly the no-finals certificate of its trace (rounded up to the charge grid) ...
        trace = ExecutionTrace.load(tmp_path / "traces" / f"round-{stopped.round:04d}.json")
        without = _no_finals_mu(trace, config, stopped.round, hist.plan["value_sensitivity"])
        assert entry.mu == charge_resolution(without, config.mu_resolution) == stopped.charged_mu
        # ... far below its cost with the finals, which would have overrun the budget; the total did not
        assert 0 < entry.mu < stopped.mu / 3
        assert before.epsilon_after(charge_resolution(stopped.mu, config.mu_resolution)) > BUDGET
        before.spend(entry.mu)
    assert hist.plan["value_sensitivity"] == 2.0  # what the ceiling test below assumes
    assert all(e.epsilon <= BUDGET for e in ledger.entries)
    assert hist.epsilon == pytest.approx(ledger.epsilon())
    # a restarted run resumes the ledger: whatever it does, the total stays within the budget
    again = simulate(MODEL, PARTS, (XT, YT), _config(tmp_path), progress=False)
    assert again.stopped and all(r.failed.startswith("skipped, refused by the budget") for r in again.rounds)
    resumed = PrivacyLedger(tmp_path / "ledger.json", delta=1e-5, accountant="exact")
    assert resumed.rounds >= ledger.rounds and resumed.epsilon() <= BUDGET


def _guarded_setup(tmp_path, config, delivered):
    """A ledger filled so that round 1 can deliver the messages of iterations 1..``delivered`` but not
    of ``delivered + 1`` (without finals); returns (trace of round 1, its RoundPrefix)."""
    mixer = IncaMixer(sigma_star=3.0, sigma_delta=20.0, iterations=5)
    mixer.prepare(MixContext(2.0, None, 1e-5, 24, FEATURES * CLASSES + CLASSES, config.seed))  # 2C, C = 1
    trace = mixer.plan(1, 24).trace  # the simulator's round 1 (same seeds)
    prefix = mixer.round_prefix(trace, 1, mixer.threat_seed(config.seed))
    low = charge_resolution(prefix.through(delivered).mu, config.mu_resolution)
    high = charge_resolution(prefix.through(delivered + 1).mu, config.mu_resolution)
    assert low < high

    def total(x, mu):
        probe = PrivacyLedger(None, delta=1e-5, accountant="exact")
        probe.spend(x)
        return probe.epsilon_after(mu)

    lo, hi = 0.0, 10.0  # the smallest first spend with which `high` no longer fits
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if total(mid, high) <= BUDGET else (lo, mid)
    x = hi
    assert total(x, low) <= BUDGET < total(x, high)
    ledger = PrivacyLedger(tmp_path / "ledger.json", delta=1e-5, max_epsilon=BUDGET, accountant="exact")
    ledger.spend(x)
    return trace, prefix


@pytest.mark.parametrize("delivered", [4, 0])
def test_the_budget_guard_stops_a_round_mid_mixing_and_charges_what_was_delivered(tmp_path, delivered):
    """Even the round's cost without finals does not fit: the round stops before the first iteration whose
    messages would not fit, and is charged exactly what iterations 1..delivered revealed."""
    config = _config(tmp_path)
    trace, prefix = _guarded_setup(tmp_path, config, delivered)
    spent = PrivacyLedger(tmp_path / "ledger.json", delta=1e-5).epsilon()
    hist = simulate(MODEL, PARTS, (XT, YT), config, progress=False)
    where = f"by the budget guard before delivering the messages of iteration {delivered + 1}"
    ledger = PrivacyLedger(tmp_path / "ledger.json", delta=1e-5, accountant="exact")
    if delivered == 0:  # nothing delivered: the budget left does not afford a round's first iteration
        assert [r.round for r in hist.rounds] == [1] and hist.stopped.startswith(f"round 1 stopped {where}")
        assert "None of its messages was delivered" in hist.stopped and ledger.rounds == 2
    else:  # skipped, and training went on: round 2 (refused too, and charged, until the budget stopped it)
        assert hist.rounds[0].refused and len(hist.rounds) >= 2 and hist.stopped
        assert all(r.refused for r in hist.rounds) and ledger.rounds == 1 + len(hist.rounds)
    assert ledger.entries[1].note == f"round 1: stopped {where}"
    # independently: the same coalitions, certified on the view restricted to iterations 1..delivered
    root = np.random.SeedSequence(IncaMixer.threat_seed(config.seed), spawn_key=(0, 1))
    keys = [int(d.generate_state(1, np.uint64)[0]) for d in root.spawn(config.threat_draws)]
    exact = max(certify(trace, prefix_view(random_collusion(trace, config.collusion, key), delivered),
                        value_sensitivity=2.0).max_mu for key in keys)
    assert (exact == 0) == (delivered == 0)
    assert ledger.entries[1].mu == hist.rounds[0].charged_mu == charge_resolution(exact * (1 + ROUND_UP),
                                                                                 config.mu_resolution)
    assert exact <= prefix.through(delivered).mu <= exact * (1 + 2e-9)
    assert ledger.epsilon() <= BUDGET and ledger.epsilon() >= spent
    assert hist.rounds[0].failed.startswith(f"skipped, refused by the budget: stopped {where}")
    # a restart resumes the ledger: it never exceeds the budget
    again = simulate(MODEL, PARTS, (XT, YT), _config(tmp_path), progress=False)
    assert again.stopped
    assert PrivacyLedger(tmp_path / "ledger.json", delta=1e-5, accountant="exact").epsilon() <= BUDGET


def test_without_the_guard_a_stopped_round_may_overrun(tmp_path):
    """reserve_stopped_round=False (the behaviour before the guard): the round is stopped only before its
    finals and charged its whole no-finals cost, which here takes the total past the budget (said)."""
    config = dataclasses.replace(_config(tmp_path), reserve_stopped_round=False)
    _guarded_setup(tmp_path, config, 4)
    hist = simulate(MODEL, PARTS, (XT, YT), config, progress=False)
    assert hist.stopped.startswith("round 1 stopped before its final messages")
    assert "was exceeded: the budget guard is off (reserve_stopped_round=False); training stops" in hist.stopped
    assert [r.round for r in hist.rounds] == [1] and hist.rounds[0].refused  # it stopped training at once
    assert PrivacyLedger(tmp_path / "ledger.json", delta=1e-5, accountant="exact").epsilon() > BUDGET
    with pytest.raises(ValueError, match="reserve_stopped_round"):
        dataclasses.replace(config, reserve_stopped_round=1)

"""The pre-final rule in the simulator: a round whose cost with its final messages would exceed the
budget is stopped before them and charged what its mixing revealed without them (as IncaStrategy does
in a deployment); a round starts only if that cannot exceed the budget; restarts resume the ledger.
"""

import dataclasses
import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from flwr_inca.privacy import PrivacyLedger, certify, random_collusion
from flwr_inca.protocol.trace import ExecutionTrace
from flwr_inca.simulation import IncaMixer, MixContext, SimulationConfig, iid, simulate
from flwr_inca.simulation.runner import charge_resolution

FEATURES, CLASSES, BUDGET = 12, 3, 1.5


def _data(n, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((FEATURES, CLASSES))
    x = rng.standard_normal((n, FEATURES)).astype(np.float32)
    y = np.argmax(x @ w + 0.3 * rng.standard_normal((n, CLASSES)), axis=1).astype(np.int64)
    return x, y


X, Y = _data(960)
XT, YT = _data(300, seed=1)
MODEL = functools.partial(torch.nn.Linear, FEATURES, CLASSES)
PARTS = iid(X, Y, 24)


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
    config = _config(tmp_path)
    trained = {}
    hist = simulate(MODEL, PARTS, (XT, YT), config, progress=False,
                    on_round=lambda c: trained.__setitem__(c.round, c))
    done, stopped = hist.rounds[:-1], hist.rounds[-1]
    assert hist.stopped.startswith(f"round {stopped.round} stopped before its final messages")
    assert stopped.failed.startswith("stopped before its final messages") and stopped.round not in trained
    assert [r.round for r in done] == sorted(trained)  # the stopped round released nothing
    last = trained[done[-1].round]
    assert np.array_equal(hist.parameters, (last.params_before + last.update).astype(np.float32))
    ledger = PrivacyLedger(tmp_path / "ledger.json", delta=1e-5, accountant="exact")
    entry = ledger.entries[-1]
    assert ledger.rounds == stopped.round
    assert entry.note == f"round {stopped.round}: stopped before its final messages"
    # charged exactly the no-finals certificate of its trace (rounded up to the charge grid) ...
    trace = ExecutionTrace.load(tmp_path / "traces" / f"round-{stopped.round:04d}.json")
    without = _no_finals_mu(trace, config, stopped.round, hist.plan["value_sensitivity"])
    assert entry.mu == charge_resolution(without, config.mu_resolution) == stopped.charged_mu
    # ... far below its cost with the finals, which would have overrun the budget; the total did not
    assert 0 < entry.mu < stopped.mu / 3
    before = PrivacyLedger(None, delta=1e-5, accountant="exact")
    for e in ledger.entries[:-1]:
        before.spend(e.mu)
    assert before.epsilon_after(charge_resolution(stopped.mu, config.mu_resolution)) > BUDGET
    assert hist.plan["value_sensitivity"] == 2.0  # what the ceiling test below assumes
    assert all(e.epsilon <= BUDGET for e in ledger.entries)
    assert hist.epsilon == pytest.approx(ledger.epsilon())
    # a restarted run resumes the ledger: whatever it does, the total stays within the budget
    again = simulate(MODEL, PARTS, (XT, YT), _config(tmp_path), progress=False)
    assert again.stopped and all(r.failed.startswith("stopped") for r in again.rounds)
    resumed = PrivacyLedger(tmp_path / "ledger.json", delta=1e-5, accountant="exact")
    assert resumed.rounds >= ledger.rounds and resumed.epsilon() <= BUDGET


def test_a_round_starts_only_if_stopping_it_before_its_finals_fits(tmp_path):
    config = _config(tmp_path)
    mixer = IncaMixer(sigma_star=3.0, sigma_delta=20.0, iterations=5)
    mixer.prepare(MixContext(2.0, None, 1e-5, 24, FEATURES * CLASSES + CLASSES, config.seed))  # 2C, C = 1
    ceiling = charge_resolution(mixer.stopped_ceiling(24), config.mu_resolution)
    # spend until the ceiling no longer fits, then nothing may start (nothing is spent either)
    ledger = PrivacyLedger(tmp_path / "ledger.json", delta=1e-5, max_epsilon=BUDGET, accountant="exact")
    while ledger.epsilon_after(ceiling) <= BUDGET:
        ledger.spend(ceiling)
    spent = ledger.epsilon()
    hist = simulate(MODEL, PARTS, (XT, YT), config, progress=False)
    assert hist.rounds == [] and hist.stopped.startswith("stopped before round 1: stopped before its final")
    assert PrivacyLedger(tmp_path / "ledger.json", delta=1e-5).epsilon() == pytest.approx(spent)


def test_without_the_reserve_the_round_the_ceiling_refuses_starts(tmp_path):
    config = dataclasses.replace(_config(tmp_path), reserve_stopped_round=False)
    mixer = IncaMixer(sigma_star=3.0, sigma_delta=20.0, iterations=5)
    mixer.prepare(MixContext(2.0, None, 1e-5, 24, FEATURES * CLASSES + CLASSES, config.seed))
    ceiling = charge_resolution(mixer.stopped_ceiling(24), config.mu_resolution)
    ledger = PrivacyLedger(tmp_path / "ledger.json", delta=1e-5, max_epsilon=BUDGET, accountant="exact")
    while ledger.epsilon_after(ceiling) <= BUDGET:
        ledger.spend(ceiling)
    hist = simulate(MODEL, PARTS, (XT, YT), config, progress=False)
    assert hist.rounds and not (hist.stopped or "").startswith("stopped before round 1: stopped before its final")
    with pytest.raises(ValueError, match="reserve_stopped_round"):
        dataclasses.replace(config, reserve_stopped_round=1)

"""IncaStrategy: one outlier execution must not stop training. A round whose certificate before its finals
does not fit the budget is stopped there, charged what it revealed, and *skipped* (the model is kept); the
next round runs its own fresh execution. Training stops after ``max_consecutive_refusals`` refused rounds in
a row, after a guarded round none of whose messages could be delivered, when (guard off) a refused round's
charge overran the budget, or when the pre-round check refuses (unchanged).

In process, with the real party code answering every exchange (as tests/test_prefinal_strategy.py); the
same through Flower's simulation engine is in tests/test_prefinal_flower.py. ``OutlierStrategy`` is the real
strategy whose chosen rounds certify ``factor`` times their real cost with their finals (an outlier
execution); without finals, what they revealed is certified as it is.
"""

import math

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import ArrayRecord, ConfigRecord
from test_prefinal_strategy import SETTINGS, D, N, Nodes, _budget_between, _Grid, _probe_prefix, _round

from flwr_inca.flower import IncaBudgetExhausted, IncaStrategy, PrivacyTarget
from flwr_inca.flower.shared import flatten_arrays
from flwr_inca.privacy import PrivacyLedger
from flwr_inca.privacy.rounds import RoundCertificate


class _Outlier:
    """A RoundPrefix whose certificate with every final is ``factor`` times the real one."""

    def __init__(self, inner, factor):
        self.inner, self.factor = inner, factor

    def with_finals(self, finals=None):
        cert = self.inner.with_finals(finals)
        return RoundCertificate(cert.mu * self.factor, cert.methods) if finals is None else cert

    def __getattr__(self, name):
        return getattr(self.inner, name)


class OutlierStrategy(IncaStrategy):
    """IncaStrategy whose rounds in ``outliers`` certify ``factor`` times their real cost with their finals."""

    def __init__(self, *args, outliers=(), factor=60.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.outliers, self.factor, self._now = set(outliers), float(factor), None

    def aggregate_train(self, server_round, replies):
        self._now = server_round
        try:
            return super().aggregate_train(server_round, replies)
        finally:
            self._now = None

    def _round_prefix(self, trace, seeds):
        prefix = super()._round_prefix(trace, seeds)
        return _Outlier(prefix, self.factor) if self._now in self.outliers else prefix


def _roomy_budget(rounds):
    """A max_epsilon that fits ``rounds`` rounds of ``Nodes()``'s cost with finals (and a margin)."""
    _, prefix = _probe_prefix()
    mu = prefix.with_finals(None).mu
    ledger = PrivacyLedger(None, delta=1e-5)
    for _ in range(rounds):
        ledger.spend(1.2 * mu)
    return ledger.epsilon(), mu


def _train(strategy, monkeypatch, rounds, model=None):
    """Rounds 1..``rounds`` as Flower's ``start`` runs them (configure, then aggregate); returns
    ``(arrays after each round (None: unchanged), the IncaBudgetExhausted that stopped training or None)``."""
    model = model or ArrayRecord([np.full(D, 0.5)])
    out = {}
    for rnd in range(1, rounds + 1):
        try:
            guarded = strategy._check_budget(rnd, N, model)
            arrays, _ = _round(strategy, monkeypatch, Nodes(rnd), model, guarded=guarded)
        except IncaBudgetExhausted as stop:
            return out, stop
        out[rnd] = arrays
        model = arrays or model
    return out, None


def test_an_outlier_round_in_the_middle_is_skipped_and_later_rounds_train(monkeypatch):
    budget, mu = _roomy_budget(6)
    strategy = OutlierStrategy(**SETTINGS, ledger_path=None, max_epsilon=budget, outliers={3})
    monkeypatch.setattr(strategy, "predicted_mu", lambda n: mu)
    arrays, stop = _train(strategy, monkeypatch, 5)
    assert stop is None and sorted(arrays) == [1, 2, 3, 4, 5]
    assert arrays[3] is None and all(arrays[r] is not None for r in (1, 2, 4, 5))
    assert (strategy.rounds_trained, strategy.rounds_refused) == (4, 1)
    record = strategy.rounds[3]
    assert record.refused and record.update is None and record.finalists == []
    assert "not collected" in record.failed and record.trace.meta["finals-collected"] is False
    # round 4 trained from the model after round 2: round 3 changed nothing
    after_2, after_4 = flatten_arrays(arrays[2])[0], flatten_arrays(arrays[4])[0]
    assert np.allclose(after_4, after_2 + strategy.rounds[4].update)
    # every round is in the ledger; the skipped one at what it revealed without its finals (the real
    # certificate, not the outlier's), the total within the budget
    entries = strategy.ledger.entries
    assert [e.note for e in entries] == ["round 1", "round 2", "round 3: stopped before its final messages",
                                         "round 4", "round 5"]
    real = strategy._round_prefix(record.trace, strategy._certify_seeds(3)).with_finals([]).mu
    assert entries[2].mu == record.mu == real and 0 < real < mu
    assert all(e.epsilon <= budget for e in entries)
    metrics = strategy.train_metrics_serverapp
    assert [metrics[r]["inca-round-refused"] for r in range(1, 6)] == [0, 0, 1, 0, 0]
    assert [metrics[r]["inca-consecutive-refusals"] for r in range(1, 6)] == [0, 0, 1, 0, 0]


def test_the_consecutive_cap_stops_training_with_a_clear_message(monkeypatch, task_identity):
    budget, mu = _roomy_budget(8)
    strategy = OutlierStrategy(**SETTINGS, ledger_path=None, max_epsilon=budget, outliers={2, 3, 4})
    monkeypatch.setattr(strategy, "predicted_mu", lambda n: mu)
    arrays, stop = _train(strategy, monkeypatch, 6)
    assert sorted(arrays) == [1, 2, 3] and stop is not None and stop.server_round == 4
    assert stop.stopped_before_finals and str(stop).endswith(
        "Training stops: 3 round(s) in a row were refused by the budget (max_consecutive_refusals = 3)")
    assert strategy.ledger.rounds == 4 and strategy.rounds_refused == 3
    assert np.array_equal(flatten_arrays(stop.arrays)[0], flatten_arrays(arrays[1])[0])  # the model of round 1
    with pytest.raises(IncaBudgetExhausted, match=r"not starting round 5: training stopped at round 4 \(3 round"):
        strategy.configure_train(5, stop.arrays, ConfigRecord(), _Grid())
    # refusals apart do not add up, even with a cap of 2
    apart = OutlierStrategy(**SETTINGS, ledger_path=None, max_epsilon=budget, outliers={2, 4},
                            max_consecutive_refusals=2)
    monkeypatch.setattr(apart, "predicted_mu", lambda n: mu)
    arrays, stop = _train(apart, monkeypatch, 5)
    assert stop is None and [r for r in arrays if arrays[r] is None] == [2, 4]


def test_the_ledger_never_exceeds_the_budget_and_every_skipped_round_is_charged(monkeypatch):
    """A budget that runs out: rounds are refused (outliers, then the budget's end), each charged what it
    revealed; the total never goes past max_epsilon."""
    budget, _ = _roomy_budget(3)
    strategy = OutlierStrategy(**SETTINGS, ledger_path=None, max_epsilon=budget, outliers={2}, factor=3.0)
    monkeypatch.setattr(strategy, "predicted_mu", lambda n: 0.0)  # rounds always start
    arrays, stop = _train(strategy, monkeypatch, 12)
    assert stop is not None and strategy.rounds_refused >= 2
    entries = strategy.ledger.entries
    assert len(entries) == len(strategy.rounds) and all(e.epsilon <= budget for e in entries)
    for rnd, record in strategy.rounds.items():
        assert record.refused == ("stopped" in entries[rnd - 1].note) == (arrays.get(rnd, None) is None)
        assert entries[rnd - 1].mu == record.mu


def test_without_the_guard_an_overrun_stops_training(monkeypatch, task_identity):
    """reserve_stopped_round=False: a refused round is charged its whole no-finals cost; when that takes the
    total past max_epsilon (said, as an error), training stops instead of skipping."""
    _, prefix = _probe_prefix()
    without = prefix.through(3).mu
    strategy = IncaStrategy(**SETTINGS, ledger_path=None, max_epsilon=_budget_between(without / 2, without),
                            reserve_stopped_round=False)
    monkeypatch.setattr(strategy, "predicted_mu", lambda n: 0.0)
    arrays, stop = _train(strategy, monkeypatch, 3)
    assert arrays == {} and stop.server_round == 1 and stop.epsilon > stop.max_epsilon
    assert "max_epsilon was exceeded with the budget guard off (reserve_stopped_round=False)" in str(stop)


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "3", None, math.inf])
def test_bad_cap_values_are_refused_naming_the_parameter(bad):
    with pytest.raises(ValueError, match=r"max_consecutive_refusals .*must be an integer >= 1, got"):
        IncaStrategy(**SETTINGS, ledger_path=None, max_consecutive_refusals=bad)
    with pytest.raises(ValueError, match=r"max_consecutive_refusals"):
        PrivacyTarget(max_consecutive_refusals=bad)


@pytest.fixture
def task_identity(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    for name, value in (("_run_id", 1), ("_node_id", 5), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)

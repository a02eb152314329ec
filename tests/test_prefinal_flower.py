"""The pre-final rule through Flower's simulation engine (Ray backend): a budget tight enough that a
round must be stopped before its final messages, and a restarted ServerApp resuming the ledger.

Ten nodes, T = 4, sigma_star = 1, sigma_delta = 20, 10% colluders. Any round's certificate with its
finals is at least the central-DP floor 2 / (sqrt(9) * sigma_star) = 0.67 (9 honest nodes, sensitivity
2C = 2), while without its finals a round costs at most ``no_finals_bound`` = 0.11. The budget (1.3,
between one round at mu = 0.3 and one at mu = 0.4) therefore fits no round with its finals. The
first strategies' prediction is made to underestimate (as a prediction from simulated executions may):
their rounds start, mix, are certified before the finals, are stopped there and skipped, until three in a
row (max_consecutive_refusals) stop training.

One outlier execution does not end training: with a roomy budget, an ``OutlierStrategy``
(tests/test_refused_strategy.py) whose round 2 certifies 60 times its real cost with its finals has that
round stopped before its finals, charged, and skipped, and trains rounds 1, 3 and 4; with rounds 1-3
outliers, the third refusal in a row stops training.

The budget guard: with a separate ledger and max_epsilon = 0.02 (about mu = 0.004, below what one
observed message of the first iterations reveals), a round predicted free starts guarded (its no-finals
ceiling does not fit) and is stopped mid-mixing, before the messages of the first iteration whose view
does not fit are delivered; a restarted ServerApp on that ledger stays within it too.
"""

import numpy as np
import pytest

pytest.importorskip("flwr")
pytest.importorskip("ray")

import flower_apps
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from test_flower_e2e import INITIAL, NODES, RecordingGrid, _simulate
from test_refused_strategy import OutlierStrategy

from flwr_inca.flower import IncaBudgetExhausted, IncaStrategy
from flwr_inca.flower.shared import END_ACTION, INCA_KEY, flatten_arrays
from flwr_inca.flower.wire import FIELD, peek_request
from flwr_inca.privacy import PrivacyLedger, certify, random_collusion
from flwr_inca.privacy.prefix import prefix_view

pytestmark = pytest.mark.flower

T, BUDGET, GUARD_BUDGET, ROOMY = 4, 1.3, 0.02, 60.0
SETTINGS = {"iterations": T, "sigma_star": 1.0, "sigma_delta": 20.0, "clip_norm": 1.0, "max_epsilon": BUDGET,
            "fraction_evaluate": 0.0, "min_available_nodes": NODES, "min_train_nodes": NODES,
            "exchange_timeout": 120, "ledger_owner": "test-prefinal"}


class UnderestimatingStrategy(IncaStrategy):
    """Predicts every round to cost no more than it would without its finals (too optimistic)."""

    def predicted_mu(self, n: int) -> float:
        return self.no_finals_mu(n)


class FreeStrategy(IncaStrategy):
    """Predicts every round to cost nothing: every round starts, guarded when its ceiling does not fit."""

    def predicted_mu(self, n: int) -> float:
        return 0.0


class CommitGrid(RecordingGrid):
    """Also records the commit of every mixing request pushed (T + 1: a request for a final)."""

    def __init__(self, grid):
        super().__init__(grid)
        self.commits: list[int] = []
        self.types: list[str] = []

    def push_messages(self, messages):
        messages = list(messages)
        for m in messages:
            self.types.append(m.metadata.message_type)
            record = m.content.config_records.get(INCA_KEY) if m.has_content() else None
            if record is not None and FIELD in record:
                self.commits.append(peek_request(record[FIELD])[1])
        return super().push_messages(messages)


def _start(strategy, grid):
    try:
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(INITIAL), num_rounds=3)
    except IncaBudgetExhausted as stop:
        return stop
    raise AssertionError(f"training did not stop at the budget: {result}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    path = tmp_path_factory.mktemp("prefinal") / "ledger.json"
    out: dict = {"ledger": path}
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        def run(name, cls):
            recording = CommitGrid(grid)
            strategy = cls(**SETTINGS, ledger_path=path, seed=len(out))
            stop = _start(strategy, recording)
            out[name] = (strategy, stop, recording, PrivacyLedger(path, delta=1e-5).entries)
            return strategy

        first = run("stopped", UnderestimatingStrategy)
        again = CommitGrid(grid)  # the same strategy asked to go on: no round after the stopped one
        out["again"] = (_start(first, again), again)
        run("restart-stopped", UnderestimatingStrategy)  # a restarted ServerApp, same ledger
        run("restart", IncaStrategy)  # restarted with an honest prediction
        for name, outliers in (("outlier", {2}), ("outliers", {1, 2, 3})):  # one outlier; three in a row
            recording = CommitGrid(grid)
            strategy = OutlierStrategy(**{**SETTINGS, "max_epsilon": ROOMY}, ledger_path=path.parent / f"{name}.json",
                                       seed=len(out), outliers=outliers)
            try:
                stop = strategy.start(grid=recording, initial_arrays=ArrayRecord(INITIAL), num_rounds=4)
            except IncaBudgetExhausted as exc:
                stop = exc
            out[name] = (strategy, stop, recording, PrivacyLedger(path.parent / f"{name}.json", delta=1e-5).entries)
        guard_path = path.parent / "guard-ledger.json"
        for name in ("guarded", "guarded-restart"):  # the budget guard, then a restart on its ledger
            recording = CommitGrid(grid)
            strategy = FreeStrategy(**{**SETTINGS, "max_epsilon": GUARD_BUDGET}, ledger_path=guard_path,
                                    seed=len(out))
            stop = _start(strategy, recording)
            out[name] = (strategy, stop, recording, PrivacyLedger(guard_path, delta=1e-5).entries)

    _simulate(app, flower_apps.client)
    assert "guarded-restart" in out, "the ServerApp failed: see the log above"
    return out


def test_rounds_over_budget_are_stopped_before_their_finals_skipped_then_training_stops(runs):
    strategy, stop, grid, entries = runs["stopped"]
    # each round was refused and skipped; the third in a row stopped training
    assert stop.stopped_before_finals and stop.server_round == 3 and sorted(strategy.rounds) == [1, 2, 3]
    assert "Training stops: 3 round(s) in a row were refused by the budget (max_consecutive_refusals = 3)" in str(stop)
    assert strategy.rounds_refused == 3 and strategy.rounds_trained == 0
    for rnd, record in strategy.rounds.items():
        assert record.refused and record.finalists == [] and record.trace.meta["finals-collected"] is False
        assert record.trace.steps[-1].online.size == NODES  # everybody could have sent one
        assert "not collected" in record.failed
        metrics = strategy.train_metrics_serverapp[rnd]
        assert metrics["inca-stopped-before-finals"] == 1 and metrics["inca-finalists"] == 0
        assert metrics["inca-consecutive-refusals"] == rnd
    # every round mixed for T iterations, then no node was asked for its final message
    assert set(grid.commits) == set(range(1, T + 1)) and T + 1 not in grid.commits
    # the model is the initial one, handed over by the exception
    assert np.array_equal(flatten_arrays(stop.arrays)[0], flatten_arrays(ArrayRecord(INITIAL))[0])
    # what the last would have cost with its finals overran the budget; what was charged did not
    assert stop.predicted_epsilon > BUDGET >= stop.epsilon > 0
    assert [e.note for e in entries] == [f"round {r}: stopped before its final messages" for r in (1, 2, 3)]
    assert all(0 < e.mu <= strategy.no_finals_mu(NODES) < 0.3 for e in entries)
    # every node answered up to T: all are told that the run is over (and remove its data)
    assert sum(t.endswith(END_ACTION) for t in grid.types) == NODES


def test_no_round_starts_after_training_stopped(runs):
    stop, grid = runs["again"]
    assert isinstance(stop, IncaBudgetExhausted) and not stop.stopped_before_finals
    assert "not starting round 1: training stopped at round 3 (3 round(s) in a row were refused" in str(stop)
    assert grid.pushed == 0


def test_the_ledger_never_exceeds_the_budget_across_restarts(runs):
    _, _, _, after_first = runs["stopped"]
    strategy, stop, grid, after_second = runs["restart-stopped"]
    # the restarted ServerApp resumed the ledger; its rounds started (the no-finals ceiling fits), and
    # were stopped before their finals again
    assert strategy.ledger.entries[:3] == after_first
    assert stop.stopped_before_finals and T + 1 not in grid.commits and len(after_second) > 3
    honest, honest_stop, honest_grid, final = runs["restart"]
    # an honest prediction does not start a round at all
    assert honest_stop.server_round == 1 and not honest_stop.stopped_before_finals
    assert honest_grid.pushed == 0 and honest.rounds == {} and final == after_second
    assert honest_stop.predicted_epsilon > BUDGET
    for entries in (after_first, after_second, final):
        assert all(e.epsilon <= BUDGET for e in entries)
    assert PrivacyLedger(runs["ledger"], delta=1e-5).epsilon() <= BUDGET


def test_one_outlier_round_is_skipped_and_training_goes_on(runs):
    strategy, result, grid, entries = runs["outlier"]
    assert not isinstance(result, IncaBudgetExhausted), result  # Flower's start returned its Result
    assert sorted(strategy.rounds) == [1, 2, 3, 4] and (strategy.rounds_trained, strategy.rounds_refused) == (3, 1)
    skipped = strategy.rounds[2]
    assert skipped.refused and skipped.update is None and skipped.finalists == []
    assert [e.note for e in entries] == ["round 1", "round 2: stopped before its final messages", "round 3", "round 4"]
    # round 2 was charged what it revealed without finals: its real certificate (not the outlier's)
    real = strategy._round_prefix(skipped.trace, strategy._certify_seeds(2)).with_finals([]).mu
    assert entries[1].mu == skipped.mu == real and 0 < real <= strategy.no_finals_mu(NODES)
    assert all(e.epsilon <= ROOMY for e in entries)
    # the final model is the initial one plus the updates of rounds 1, 3 and 4 (round 2 changed nothing)
    initial = flatten_arrays(ArrayRecord(INITIAL))[0]
    expected = initial + sum(strategy.rounds[r].update for r in (1, 3, 4))
    assert np.allclose(flatten_arrays(result.arrays)[0], expected.astype(np.float32), atol=1e-5)
    # the finals of rounds 1, 3 and 4 were asked for; round 2's never (requests are recorded in order)
    assert grid.commits.count(T + 1) >= 3


def test_three_outliers_in_a_row_stop_training(runs):
    strategy, stop, _, entries = runs["outliers"]
    assert isinstance(stop, IncaBudgetExhausted) and stop.server_round == 3 and sorted(strategy.rounds) == [1, 2, 3]
    assert "max_consecutive_refusals = 3" in str(stop) and strategy.rounds_refused == 3
    assert len(entries) == 3 and all("stopped before its final messages" in e.note for e in entries)
    assert np.array_equal(flatten_arrays(stop.arrays)[0], flatten_arrays(ArrayRecord(INITIAL))[0])


def test_the_budget_guard_stops_a_round_mid_mixing_before_what_would_not_fit(runs):
    strategy, stop, grid, entries = runs["guarded"]
    assert stop.stopped_before_finals and "stopped by the budget guard" in str(stop)
    # every round was stopped by the guard (and skipped), until training stopped
    assert sorted(strategy.rounds) == list(range(1, stop.server_round + 1)) and len(entries) == stop.server_round
    assert all(r.refused and "budget guard" in r.failed for r in strategy.rounds.values())
    assert stop.delivered_iterations == 0 or "max_consecutive_refusals = 3" in str(stop)
    record = strategy.rounds[1]
    delivered = record.trace.meta["delivered-iterations"]
    assert 0 <= delivered < T and record.finalists == []
    # exchanges committed to at most iteration delivered + 1 of each round: the one delivering the latter's
    # messages, and every later one, never happened
    last = max(r.trace.meta["delivered-iterations"] for r in strategy.rounds.values())
    assert set(grid.commits) == set(range(1, last + 2))
    assert np.array_equal(flatten_arrays(stop.arrays)[0], flatten_arrays(ArrayRecord(INITIAL))[0])
    # charged: the strategy's three coalitions, certified independently on the iterations delivered; the
    # next iteration's messages would not have fit
    draws = [int(s.generate_state(1, dtype=np.uint64)[0]) for s in strategy._certify_seeds(1).spawn(3)]

    def cost(t):
        return max(certify(record.trace, prefix_view(random_collusion(record.trace, 0.1, seed), t),
                           value_sensitivity=2.0).max_mu for seed in draws)

    assert cost(delivered) <= entries[0].mu <= cost(delivered) * (1 + 2e-9)
    assert PrivacyLedger(None, delta=1e-5).epsilon_after(cost(delivered + 1)) > GUARD_BUDGET
    assert all(e.epsilon <= GUARD_BUDGET for e in entries)
    assert strategy.train_metrics_serverapp[1]["inca-stopped-before-finals"] == 1
    # every node answered up to there: all are told that the run is over
    assert sum(t.endswith(END_ACTION) for t in grid.types) == NODES


def test_a_restart_after_the_guard_stays_within_the_budget(runs):
    _, _, _, first = runs["guarded"]
    _, stop, _, entries = runs["guarded-restart"]
    assert entries[:len(first)] == first and isinstance(stop, IncaBudgetExhausted)
    assert all(e.epsilon <= GUARD_BUDGET for e in entries)
    assert PrivacyLedger(runs["ledger"].parent / "guard-ledger.json", delta=1e-5).epsilon() <= GUARD_BUDGET

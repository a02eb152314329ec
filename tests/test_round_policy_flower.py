"""The round policy through Flower's simulation engine (Ray backend): IncaStrategy's ``start`` with ten real
ClientApp nodes, budgets that refuse rounds before their finals and mid-mixing, restarted ServerApps resuming
the ledger. Everything is read from public results: ``strategy.rounds[r].charge``, the ledger file, the
exception that stopped training, and the requests the ServerApp pushed (``CommitGrid``).

Ten nodes, T = 4, sigma_star = 1, sigma_delta = 20, 10% colluders. A round's certificate with its finals is at
least the central-DP floor 2 / (sqrt(9) sigma_star) = 0.67 (9 honest nodes, sensitivity 2C = 2), while without
its finals a round costs at most the no-finals ceiling, 0.11. The budget (1.3, between one round at mu = 0.3
and one at mu = 0.4) therefore fits no round with its finals; strategies whose prediction is scripted to be
free (``ScriptedStrategy``) start their rounds anyway, which are stopped before their finals and skipped until
three in a row stop training. A restarted ServerApp with the real prediction does not start a round. With a
roomy budget, one outlier execution (round 2 certifies 60 times its cost with its finals) is skipped and
training goes on. With max_epsilon = 0.02 (about mu = 0.004, below what the messages of the first iterations
reveal) the budget guard stops each round mid-mixing; a restart on that ledger stays within it.

The same behaviours in process, one by one: tests/test_round_policy_strategy.py.
"""

import functools

import numpy as np
import pytest
from synthetic import Outlier

pytest.importorskip("flwr")
pytest.importorskip("ray")

import flower_apps  # noqa: E402
from flwr.app import ArrayRecord, Context  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402
from test_flower_e2e import INITIAL, NODES, RecordingGrid, _simulate  # noqa: E402

from flwr_inca.flower import IncaBudgetExhausted, IncaStrategy  # noqa: E402
from flwr_inca.flower.shared import END_ACTION, INCA_KEY, flatten_arrays  # noqa: E402
from flwr_inca.flower.wire import FIELD, peek_request  # noqa: E402
from flwr_inca.privacy import PrivacyLedger  # noqa: E402
from flwr_inca.privacy.certificate import certify  # noqa: E402
from flwr_inca.privacy.prefix import prefix_view  # noqa: E402
from flwr_inca.privacy.rounds import certification_seeds, certification_views  # noqa: E402
from flwr_inca.rounds import IncaRounds  # noqa: E402

pytestmark = pytest.mark.flower

T, BUDGET, GUARD_BUDGET, ROOMY = 4, 1.3, 0.02, 60.0
SETTINGS = {"iterations": T, "sigma_star": 1.0, "sigma_delta": 20.0, "clip_norm": 1.0, "max_epsilon": BUDGET,
            "fraction_evaluate": 0.0, "min_available_nodes": NODES, "min_train_nodes": NODES,
            "exchange_timeout": 120, "ledger_owner": "test-round-policy"}


class ScriptedRounds(IncaRounds):
    """IncA's rounds with a scripted prediction (``predicted``: every round's; None: the real one) and
    outlier rounds (``outliers``: they certify 60 times their cost with their finals)."""

    def __init__(self, *args, predicted=None, outliers=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.predicted, self.outliers = predicted, set(outliers)

    def predicted_mu(self, n, runs=None):
        return super().predicted_mu(n, runs) if self.predicted is None else self.predicted

    def prefix(self, trace, round):
        real = super().prefix(trace, round)
        return Outlier(real, 60.0) if round in self.outliers else real


class ScriptedStrategy(IncaStrategy):
    """IncaStrategy whose rounds are :class:`ScriptedRounds` (the noise given, so nothing is calibrated)."""

    def __init__(self, *, predicted=None, outliers=(), **kwargs):
        super().__init__(**kwargs)
        self.script = {"predicted": predicted, "outliers": outliers}

    @functools.cached_property
    def inca(self):
        return ScriptedRounds(self.privacy, self.mixing, seed=self.seed,
                              value_sensitivity=self.privacy.sensitivity, mu_target=None, **self.script)


class CommitGrid(RecordingGrid):
    """Also records the round and commit of every mixing request pushed (commit T + 1: a request for a final)
    and the type of every message."""

    def __init__(self, grid):
        super().__init__(grid)
        self.requests: list[tuple[int, int]] = []  # (round, commit)
        self.types: list[str] = []

    def push_messages(self, messages):
        messages = list(messages)
        for m in messages:
            self.types.append(m.metadata.message_type)
            record = m.content.config_records.get(INCA_KEY) if m.has_content() else None
            if record is not None and FIELD in record:
                self.requests.append(peek_request(record[FIELD])[:2])
        return super().push_messages(messages)

    def commits(self, rnd=None):
        """The commit of every mixing request pushed (of round ``rnd`` only, if given)."""
        return [c for r, c in self.requests if rnd is None or r == rnd]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, ray_cluster):
    """One ServerApp running several strategies in a row, each recorded as (strategy, the exception that
    stopped it or Flower's Result, its CommitGrid, the ledger's entries afterwards)."""
    base = tmp_path_factory.mktemp("round-policy")
    out: dict = {"base": base}
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        def run(name, strategy, ledger, num_rounds=3):
            recording = CommitGrid(grid)
            try:
                result = strategy.start(grid=recording, initial_arrays=ArrayRecord(INITIAL),
                                        num_rounds=num_rounds)
            except IncaBudgetExhausted as stop:
                result = stop
            out[name] = (strategy, result, recording, PrivacyLedger(base / ledger, delta=1e-5).entries)
            return strategy

        free = ScriptedStrategy(**SETTINGS, ledger_path=base / "ledger.json", seed=1, predicted=0.0)
        stopped = run("stopped", free, "ledger.json")
        run("again", stopped, "ledger.json")  # the same strategy asked to go on
        run("restart", IncaStrategy(**SETTINGS, ledger_path=base / "ledger.json", seed=2), "ledger.json")
        outlier = ScriptedStrategy(**{**SETTINGS, "max_epsilon": ROOMY}, ledger_path=base / "outlier.json",
                                   seed=3, outliers={2})
        run("outlier", outlier, "outlier.json", num_rounds=4)
        for seed, name in enumerate(("guarded", "guarded-restart"), start=4):  # the guard, then a restart
            guarded = ScriptedStrategy(**{**SETTINGS, "max_epsilon": GUARD_BUDGET},
                                       ledger_path=base / "guard.json", seed=seed, predicted=0.0)
            run(name, guarded, "guard.json")

    _simulate(app, flower_apps.client, ray_cluster[0])
    assert "guarded-restart" in out, "the ServerApp failed: see the log above"
    return out


def _exact(strategy, trace, rnd, *, finals=None, through=None):
    """Round ``rnd``'s cost on ``trace``, independently (the strategy's adversaries, each view certified
    alone)."""
    priv = strategy.privacy
    views = certification_views(trace, certification_seeds(strategy.seed, rnd), priv.threat_draws,
                                collusion=priv.collusion, finals=finals)
    if through is not None:
        views = (prefix_view(v, through) for v in views)
    return max(certify(trace, v, value_sensitivity=priv.sensitivity).max_mu for v in views)


def test_rounds_over_budget_are_stopped_before_their_finals_skipped_then_training_stops(runs):
    """Every round mixes its T iterations and is stopped before its finals (no T + 1 request), charged exactly
    its no-finals certificate, and skipped; the third refusal in a row stops training with a clear message,
    handing over the initial model; every node is told that the run is over."""
    strategy, stop, grid, entries = runs["stopped"]
    assert isinstance(stop, IncaBudgetExhausted) and stop.round == 3 and sorted(strategy.rounds) == [1, 2, 3]
    assert str(stop).endswith("training stops: 3 round(s) in a row were refused by the budget "
                              "(max_consecutive_refusals = 3)")
    assert strategy.rounds_refused == 3 and strategy.rounds_trained == 0
    assert set(grid.commits()) == set(range(1, T + 1))  # no node was asked for its final message
    for rnd, record in strategy.rounds.items():
        assert record.refused and record.finalists == [] and record.trace.meta["finals-collected"] is False
        assert record.trace.steps[-1].online.size == NODES  # everybody could have sent one
        without = _exact(strategy, record.trace, rnd, finals=())
        assert without <= record.charge.certified_mu <= without * (1 + 2e-9)
        assert record.charge.certified_mu <= strategy.inca.ceilings(NODES)[-1]
        assert _exact(strategy, record.trace, rnd) > 0.6  # with its finals it would not have fit
        metrics = strategy.train_metrics_serverapp[rnd]
        assert metrics["inca-finalists"] == 0 and metrics["inca-consecutive-refusals"] == rnd
    assert np.array_equal(flatten_arrays(stop.arrays)[0], flatten_arrays(ArrayRecord(INITIAL))[0])
    assert [e.note for e in entries] == [f"round {r}: stopped before its final release" for r in (1, 2, 3)]
    assert [e.mu for e in entries] == [strategy.rounds[r].charge.mu for r in (1, 2, 3)]
    assert stop.epsilon <= BUDGET and all(e.epsilon <= BUDGET for e in entries)
    assert sum(t.endswith(END_ACTION) for t in grid.types) == NODES


def test_no_round_starts_after_training_stopped_and_a_restart_resumes_the_ledger(runs):
    """The stopped strategy asked to go on starts nothing; a restarted ServerApp resumes the ledger, and its
    real prediction does not fit what is left: it stops before round 1, contacting nobody, charging nothing.
    """
    _, again, again_grid, _ = runs["again"]
    assert isinstance(again, IncaBudgetExhausted) and again_grid.pushed == 0
    assert "not starting round 1: training stopped at round 3 (3 round(s) in a row were refused" in str(again)
    _, _, _, first = runs["stopped"]
    strategy, stop, grid, entries = runs["restart"]
    assert isinstance(stop, IncaBudgetExhausted)
    assert str(stop).startswith("stopping before round 1: it would bring")
    assert grid.pushed == 0 and strategy.rounds == {} and entries == first
    assert stop.predicted_epsilon > BUDGET >= stop.epsilon == pytest.approx(PrivacyLedger(
        runs["base"] / "ledger.json", delta=1e-5).epsilon())


def test_one_outlier_round_is_skipped_and_training_goes_on(runs):
    """Round 2's execution certifies 60 times its cost with its finals: it is stopped before them, charged its
    real no-finals certificate and skipped; rounds 1, 3 and 4 train, and Flower's Result holds the model they
    made (round 2 changed nothing)."""
    strategy, result, grid, entries = runs["outlier"]
    assert not isinstance(result, IncaBudgetExhausted), result
    assert (strategy.rounds_trained, strategy.rounds_refused) == (3, 1)
    skipped = strategy.rounds[2]
    assert skipped.refused and skipped.update is None and skipped.finalists == []
    assert [e.note for e in entries] == ["round 1", "round 2: stopped before its final release", "round 3",
                                         "round 4"]
    without = _exact(strategy, skipped.trace, 2, finals=())
    certified = entries[1].certified_mu or entries[1].mu  # None: the charge needed no rounding up
    assert without <= certified <= without * (1 + 2e-9)
    assert all(e.epsilon <= ROOMY for e in entries)
    expected = flatten_arrays(ArrayRecord(INITIAL))[0] + sum(strategy.rounds[r].update for r in (1, 3, 4))
    assert np.allclose(flatten_arrays(result.arrays)[0], expected.astype(np.float32), atol=1e-5)
    assert T + 1 not in grid.commits(2)  # round 2's finals were never asked for; the others' were
    assert all(grid.commits(r).count(T + 1) >= NODES for r in (1, 3, 4))


def test_the_budget_guard_stops_rounds_mid_mixing_before_what_would_not_fit(runs):
    """Every round runs guarded and stops before the exchange that would deliver what does not fit: the
    messages of the first iteration that does not fit (mid-mixing: the last request commits to that
    iteration), or the finals when every iteration fit (an execution whose messages reveal nothing to this
    round's colluders: the executions of a Flower simulation are random). Each is charged exactly what it
    revealed; training stops (nothing delivered, or three refusals in a row), the model the initial one,
    within the budget."""
    strategy, stop, grid, entries = runs["guarded"]
    assert isinstance(stop, IncaBudgetExhausted) and sorted(strategy.rounds) == list(range(1, stop.round + 1))
    assert stop.delivered == 0 or "max_consecutive_refusals = 3" in str(stop)
    spent = PrivacyLedger(None, delta=1e-5)
    for rnd, record in strategy.rounds.items():
        charge, delivered = record.charge, record.charge.delivered
        assert record.refused and strategy.train_metrics_serverapp[rnd]["inca-guarded"] == 1
        assert T + 1 not in grid.commits(rnd) and max(grid.commits(rnd)) == min(delivered + 1, T)
        exact = _exact(strategy, record.trace, rnd, through=delivered)
        assert exact <= charge.certified_mu <= exact * (1 + 2e-9)
        # what did not fit: the next iteration's messages, or the finals
        following = (_exact(strategy, record.trace, rnd, through=delivered + 1) if delivered < T
                     else _exact(strategy, record.trace, rnd))
        assert spent.epsilon_after(strategy.session.charged(following)) > GUARD_BUDGET
        if charge.entry is not None:
            spent.spend(entries[charge.entry - 1].mu)
    assert np.array_equal(flatten_arrays(stop.arrays)[0], flatten_arrays(ArrayRecord(INITIAL))[0])
    assert all(e.epsilon <= GUARD_BUDGET for e in entries)
    assert sum(t.endswith(END_ACTION) for t in grid.types) == NODES


def test_a_restart_after_the_guard_stays_within_the_budget(runs):
    _, _, _, first = runs["guarded"]
    _, stop, _, entries = runs["guarded-restart"]
    assert entries[:len(first)] == first and isinstance(stop, IncaBudgetExhausted)
    assert all(e.epsilon <= GUARD_BUDGET for e in entries)
    assert PrivacyLedger(runs["base"] / "guard.json", delta=1e-5).epsilon() <= GUARD_BUDGET

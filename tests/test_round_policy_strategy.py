"""IncaStrategy's round policy (flwr_inca/privacy/session.py, driven by the strategy), end to end through
Flower's hooks on an in-process grid, read from public results only.

Each round runs ``configure_train`` -> the nodes' join -> ``aggregate_train`` on ``InProcessGrid``
(tests/inprocess_grid.py: the real ClientApp of tests/flower_apps.py answers every request, about 0.2 s a
round); what the policy decided is read from ``strategy.rounds[r].charge`` (a ``RoundCharge``), the ledger,
``strategy.train_metrics_serverapp`` and ``grid.commits(r)`` (the commit of every mixing request: T + 1
means a final message was asked for). Certificates are checked against an independent computation:
the round's adversaries drawn from ``certification_seeds(strategy.seed, r)`` and each view certified with
``certify`` (no factorization shared with the strategy).

Six nodes, T = 3, sigma_star = 1, sigma_delta = 20, 30% colluders: a round costs about mu = 1.0 with its
finals, at most 0.09 without them (the no-finals ceiling over every execution), and round 1's exact
prefix costs increase strictly with the iterations delivered (the guard's tests need that). Nodes use
fixed secrets: the same round gives the same execution in every strategy of these tests.

The simulator's side of the same policy is tests/test_round_policy_simulation.py; the session alone,
tests/test_session.py; the write-ahead reservation as messages leave, tests/test_strategy.py.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from synthetic import script_outliers

pytest.importorskip("flwr")

from flwr.app import ArrayRecord, ConfigRecord  # noqa: E402

from flwr_inca.flower import IncaBudgetExhausted, IncaStrategy, PrivacyTarget  # noqa: E402
from flwr_inca.flower.shared import flatten_arrays  # noqa: E402
from flwr_inca.privacy import PrivacyLedger  # noqa: E402
from flwr_inca.privacy.budget_check import prediction_seeds  # noqa: E402
from flwr_inca.privacy.certificate import certify  # noqa: E402
from flwr_inca.privacy.prefix import prefix_view  # noqa: E402
from flwr_inca.privacy.rounds import certification_seeds, certification_views  # noqa: E402
from flwr_inca.privacy.session import RoundSession  # noqa: E402
from flwr_inca.protocol import PermanentDropout, sample_trace  # noqa: E402
from flwr_inca.rounds import IncaRounds  # noqa: E402

N, D, T = 6, 4, 3
DELTA = 1e-5
SETTINGS = {"sigma_star": 1.0, "sigma_delta": 20.0, "iterations": T, "collusion": 0.3, "threat_draws": 2,
            "seed": 0, "precision": "float64", "min_available_nodes": N, "min_train_nodes": N,
            "fraction_evaluate": 0.0}
MODEL = ArrayRecord([np.full(D, 0.5, dtype=np.float32)])


# ------------------------------------------------------------------------------ helpers
def _strategy(**kw) -> IncaStrategy:
    return IncaStrategy(**{**SETTINGS, "ledger_path": None, **kw})


def _grid(**kw):
    import flower_apps
    from inprocess_grid import InProcessGrid

    return InProcessGrid(flower_apps.client, N, **kw)


def _round(strategy, grid, rnd=1, model=MODEL):
    """One round through the strategy's Flower hooks, as ``Strategy.start`` runs it: (new arrays, metrics)."""
    replies = grid.send_and_receive(strategy.configure_train(rnd, model, ConfigRecord(), grid))
    arrays, _ = strategy.aggregate_train(rnd, replies)
    return arrays, strategy.train_metrics_serverapp[rnd]


def _train(strategy, grid, rounds, model=MODEL):
    """Rounds 1..``rounds`` as ``start`` runs them: ({round: new arrays or None}, the IncaBudgetExhausted that
    stopped training or None)."""
    out = {}
    for rnd in range(1, rounds + 1):
        try:
            arrays, _ = _round(strategy, grid, rnd, model)
        except IncaBudgetExhausted as stop:
            return out, stop
        out[rnd] = arrays
        model = arrays if arrays is not None else model
    return out, None


def _epsilon(*mus: float) -> float:
    """The ledger's epsilon after rounds of certified costs ``mus``, each charged as the strategy's session
    charges it (rounded up to the default ``mu_resolution``)."""
    ledger = PrivacyLedger(None, delta=DELTA)
    session = RoundSession(ledger, resolution=PrivacyTarget().mu_resolution)
    for mu in mus[:-1]:
        ledger.spend(session.charged(mu))
    return session.epsilon_after(mus[-1])


def _between(low: float, high: float, spent=()) -> float:
    """A max_epsilon that one more round of cost ``low`` fits after ``spent`` and one of cost ``high`` does
    not."""
    a, b = _epsilon(*spent, low), _epsilon(*spent, high)
    assert a < b
    return (a + b) / 2


def _exact(strategy, trace, rnd, *, finals=None, through=None) -> float:
    """Round ``rnd``'s cost on ``trace``, independently: its adversaries from the strategy's seed, each view
    (with the finals of ``finals``, None: all; or restricted to iterations 1..``through``) certified alone."""
    priv = strategy.privacy
    views = certification_views(trace, certification_seeds(strategy.seed, rnd), priv.threat_draws,
                                collusion=priv.collusion, finals=finals)
    if through is not None:
        views = (prefix_view(v, through) for v in views)
    return max(certify(trace, v, value_sensitivity=priv.sensitivity).max_mu for v in views)


def _script_outliers(monkeypatch, rounds, factor=1e3):
    return script_outliers(monkeypatch, rounds, factor)


def _predict(monkeypatch, factor):
    """Every round predicted at ``factor`` times the strategy's own prediction (0: predicted free, so that
    every round starts, as a prediction from simulated executions may underestimate)."""
    real = IncaRounds.predicted_mu
    monkeypatch.setattr(IncaRounds, "predicted_mu", lambda self, n, runs=None: factor * real(self, n, runs))


@pytest.fixture(scope="module")
def probe():
    """The same rounds without a budget: their traces and certified costs (nodes are deterministic)."""
    from flwr.supercore.task_identity import TaskIdentity

    with pytest.MonkeyPatch.context() as mp:
        for name, value in (("_run_id", 1), ("_node_id", 5), ("_task_id", 1)):
            mp.setattr(TaskIdentity, name, value)
        strategy = _strategy()
        arrays, stop = _train(strategy, _grid(), 3)
    assert stop is None and all(a is not None for a in arrays.values())
    return strategy


# ------------------------------------------------------------------------------ the finals
def test_within_the_budget_the_finals_are_collected_and_all_of_them_charged(tmp_path, task_identity):
    """A round that fits: every final is asked for and arrives; it is charged exactly its certificate with
    every final (the independent computation), rounded up by the session only, with the certificate method
    recorded in the ledger file."""
    path = tmp_path / "ledger.json"
    strategy, grid = _strategy(max_epsilon=50.0, ledger_path=path), _grid()
    arrays, metrics = _round(strategy, grid)
    record, charge = strategy.rounds[1], strategy.rounds[1].charge
    assert arrays is not None and record.finalists == list(range(N)) and T + 1 in grid.commits(1)
    assert (charge.outcome, charge.released, charge.delivered, charge.stop) == ("released", True, T, "")
    exact = _exact(strategy, record.trace, 1)
    assert exact <= charge.certified_mu <= exact * (1 + 2e-9)
    assert charge.certified_mu == strategy.inca.prefix(record.trace, 1).with_finals().mu
    assert charge.mu == strategy.session.charged(charge.certified_mu) >= charge.certified_mu
    (entry,) = PrivacyLedger(path, delta=DELTA).entries  # what is on disk
    assert (entry.status, entry.mu, entry.certified_mu) == ("charged", charge.mu, charge.certified_mu)
    assert entry.method == "exact"
    assert metrics["inca-mu"] == charge.mu
    assert metrics["inca-round-refused"] == 0 and metrics["inca-guarded"] == 0


def test_lost_final_messages_are_charged_exactly_below_the_prefinal_bound(task_identity):
    """Party 2's final never arrives (its requests time out): the round is charged exactly what the five
    finals that arrived reveal, below the pre-final certificate (every final counted) reserved before the
    finals were asked for."""
    lost = _grid(drop=lambda rnd, commit, party: party == 2 and commit == T + 1)
    strategy = _strategy(max_epsilon=50.0, exchange_timeout=0.3, final_retries=0,
                         max_noise_inflation=math.inf)
    arrays, _ = _round(strategy, lost)
    record, charge = strategy.rounds[1], strategy.rounds[1].charge
    assert arrays is not None and record.finalists == [0, 1, 3, 4, 5] and charge.outcome == "released"
    exact = _exact(strategy, record.trace, 1, finals=record.finalists)
    prefinal = _exact(strategy, record.trace, 1)
    assert exact <= charge.certified_mu <= exact * (1 + 2e-9) and charge.certified_mu < prefinal
    assert strategy.ledger.entries[0].mu == charge.mu == strategy.session.charged(charge.certified_mu)


def test_a_round_whose_prefinal_certificate_does_not_fit_is_stopped_before_its_finals(probe, monkeypatch,
                                                                                      task_identity):
    """The budget fits a round's no-finals ceiling, never its cost with the finals; the prediction
    underestimates, so rounds start. Each round mixes its T iterations, is certified before its finals, and
    stopped there: no final is asked for (no T + 1 request), the model is unchanged, the round is skipped and
    charged exactly its no-finals certificate ("exact" in the ledger, not the ceiling reserved), and the next
    round starts; the third refusal in a row (max_consecutive_refusals) stops training with a clear message,
    after which no round starts and no node is contacted."""
    prefinals = [probe.rounds[r].charge.certified_mu for r in (1, 2, 3)]
    budget = _between(probe.inca.ceilings(N)[-1], min(prefinals))
    _predict(monkeypatch, 0.0)
    strategy, grid = _strategy(max_epsilon=budget), _grid()
    arrays, stop = _train(strategy, grid, 5)
    assert arrays == {1: None, 2: None} and stop is not None and stop.round == 3
    assert str(stop).endswith("training stops: 3 round(s) in a row were refused by the budget "
                              "(max_consecutive_refusals = 3)")
    assert stop.arrays is MODEL and stop.started and stop.delivered == T and stop.epsilon <= budget
    assert strategy.rounds_refused == 3 and strategy.rounds_trained == 0
    for rnd, record in strategy.rounds.items():
        charge = record.charge
        assert max(grid.commits(rnd)) == T and T + 1 not in grid.commits(rnd)  # no final asked for
        assert record.refused and record.update is None and record.finalists == []
        assert record.trace.meta["finals-collected"] is False and "not collected" in record.failed
        assert (charge.outcome, charge.released, charge.delivered) == ("refused", False, T)
        without = _exact(strategy, record.trace, rnd, finals=())
        assert without <= charge.certified_mu <= without * (1 + 2e-9)
        assert charge.mu <= probe.inca.ceilings(N)[-1]
        entry = strategy.ledger.entries[rnd - 1]
        assert (entry.mu, entry.method, entry.status) == (charge.mu, "exact", "charged")
        assert entry.note == f"round {rnd}: stopped before its final release"
        metrics = strategy.train_metrics_serverapp[rnd]
        assert metrics["inca-round-refused"] == 1 and metrics["inca-consecutive-refusals"] == rnd
        assert metrics["inca-finalists"] == 0
    assert strategy.ledger.epsilon() <= budget
    pushed = len(grid.pushed)
    with pytest.raises(IncaBudgetExhausted,
                       match=r"not starting round 4: training stopped at round 3 \(3 round"):
        strategy.configure_train(4, MODEL, ConfigRecord(), grid)
    assert len(grid.pushed) == pushed


def test_an_outlier_round_is_skipped_and_the_rounds_after_it_train(probe, monkeypatch, task_identity):
    """Rounds 2 and 4 certify 1000 times their cost with their finals (outlier executions): each is stopped
    before its finals, charged what it revealed without them (its real no-finals certificate), skipped
    with the model unchanged, and the rounds between train from the model before it; refusals that are not
    in a row do not add up (max_consecutive_refusals = 2 never stops this run)."""
    real = _script_outliers(monkeypatch, {2, 4})
    strategy = _strategy(max_epsilon=60.0, max_consecutive_refusals=2)
    arrays, stop = _train(strategy, _grid(), 5)
    assert stop is None and [r for r, a in arrays.items() if a is None] == [2, 4]
    assert (strategy.rounds_trained, strategy.rounds_refused) == (3, 2)
    after_1, after_3 = flatten_arrays(arrays[1])[0], flatten_arrays(arrays[3])[0]
    assert np.allclose(after_3, (after_1 + strategy.rounds[3].update).astype(np.float32), atol=1e-6)
    for rnd in (2, 4):
        record = strategy.rounds[rnd]
        assert record.refused and record.update is None and record.charge.delivered == T
        without = real(strategy.inca, record.trace, rnd).through(T).mu
        independent = _exact(strategy, record.trace, rnd, finals=())
        assert record.charge.certified_mu == without == pytest.approx(independent, rel=2e-9)
        assert strategy.ledger.entries[rnd - 1].note == f"round {rnd}: stopped before its final release"
    refusals = [strategy.train_metrics_serverapp[r]["inca-consecutive-refusals"] for r in range(1, 6)]
    assert refusals == [0, 1, 0, 1, 0]
    assert strategy.ledger.rounds == 5 and all(e.epsilon <= 60.0 for e in strategy.ledger.entries)


# ------------------------------------------------------------------------------ the guard
@pytest.mark.parametrize("delivered", [0, 1, 2])
def test_the_budget_guard_stops_a_round_before_the_first_iteration_that_would_not_fit(
        probe, tmp_path, monkeypatch, task_identity, delivered):
    """The budget fits the messages of iterations 1..``delivered`` of round 1 and not those of the next one
    (its no-finals ceiling does not fit either: the round runs guarded). The round stops before the exchange
    that would deliver them (the last request commits to iteration ``delivered`` + 1), is charged exactly
    what iterations 1..``delivered`` revealed, and is skipped; when nothing could be delivered, nothing is
    recorded and training stops at once (``IncaBudgetExhausted``)."""
    prefix = probe.inca.prefix(probe.rounds[1].trace, 1)
    costs = [prefix.through(t).mu for t in range(T + 1)]
    budget = _between(costs[delivered], costs[delivered + 1])
    _predict(monkeypatch, 0.0)
    path = tmp_path / "ledger.json"
    strategy, grid = _strategy(max_epsilon=budget, ledger_path=path), _grid()
    if delivered == 0:
        with pytest.raises(IncaBudgetExhausted, match="nothing of it could be delivered") as info:
            _round(strategy, grid)
        stop = info.value
        assert stop.arrays is MODEL and stop.round == 1 and stop.delivered == 0
        assert strategy.ledger.rounds == 0  # nothing revealed, nothing recorded
        assert PrivacyLedger(path, delta=DELTA).epsilon() == 0
    else:
        arrays, _ = _round(strategy, grid)
        assert arrays is None
    record, charge = strategy.rounds[1], strategy.rounds[1].charge
    assert max(grid.commits(1)) == delivered + 1 and T + 1 not in grid.commits(1)
    assert record.refused and charge.delivered == delivered and not charge.released and record.update is None
    assert strategy.train_metrics_serverapp[1]["inca-guarded"] == 1
    assert strategy.train_metrics_serverapp[1]["inca-delivered-iterations"] == delivered
    exact = _exact(strategy, record.trace, 1, through=delivered)
    assert exact <= charge.certified_mu <= exact * (1 + 2e-9) and (charge.mu == 0) == (delivered == 0)
    assert _epsilon(_exact(strategy, record.trace, 1, through=delivered + 1)) > budget  # the next: no fit
    if delivered:
        (entry,) = PrivacyLedger(path, delta=DELTA).entries
        assert entry.mu == charge.mu == strategy.session.charged(charge.certified_mu)
        assert entry.status == "charged"
        assert entry.note == f"round 1: stopped by the budget guard before delivering step {delivered + 1}"
        assert entry.epsilon <= budget and not charge.stop
        assert list(strategy.configure_train(2, MODEL, ConfigRecord(), grid))  # skipped: training goes on


def test_a_guarded_round_whose_iterations_all_fit_completes_with_its_finals(probe, monkeypatch,
                                                                            task_identity):
    """No ceiling fits (scripted: unbounded), so every iteration is certified exactly and reserved before it
    is delivered; all of them fit, and so does the round with its finals: the guarded round is the same round,
    charged the same as without the guard."""
    monkeypatch.setattr(IncaRounds, "ceilings", lambda self, n: np.array([0.0] + [math.inf] * T))
    strategy, grid = _strategy(max_epsilon=50.0), _grid()
    arrays, metrics = _round(strategy, grid)
    charge = strategy.rounds[1].charge
    assert metrics["inca-guarded"] == 1 and arrays is not None and T + 1 in grid.commits(1)
    assert charge.outcome == "released" and charge.certified_mu == probe.rounds[1].charge.certified_mu
    assert strategy.rounds[1].update == pytest.approx(probe.rounds[1].update)


@pytest.mark.parametrize("where", ["final exchange", "iteration 2", "guard check"])
def test_a_round_that_fails_is_charged_what_it_may_have_revealed(probe, monkeypatch, task_identity, where):
    """An error mid-round fails it (the model is kept, training goes on), charged its reservation as it
    stands: after the finals were asked for, the pre-final certificate; mid-mixing in an unguarded round, the
    no-finals ceiling; in a guarded round whose certificate for iteration 2 raises, exactly what iteration 1
    revealed. No later request leaves."""
    fail_at = {"final exchange": T + 1, "iteration 2": 2}.get(where)

    def before_push(messages):
        from flwr_inca.flower.shared import INCA_KEY
        from flwr_inca.flower.wire import FIELD, peek_request

        for msg in messages:
            record = msg.content.config_records.get(INCA_KEY)
            if record is not None and FIELD in record and peek_request(record[FIELD])[1] == fail_at:
                raise ConnectionError("the grid went away")

    if where == "guard check":
        monkeypatch.setattr(IncaRounds, "ceilings", lambda self, n: np.array([0.0] + [math.inf] * T))
        real, calls = IncaRounds.prefix, []

        def second_fails(self, trace, rnd):
            calls.append(rnd)
            if len(calls) == 2:
                raise np.linalg.LinAlgError("SVD did not converge")
            return real(self, trace, rnd)

        monkeypatch.setattr(IncaRounds, "prefix", second_fails)
    strategy, grid = _strategy(max_epsilon=50.0), _grid(before_push=before_push)
    arrays, metrics = _round(strategy, grid)
    charge, trace = strategy.rounds[1].charge, probe.rounds[1].trace
    assert arrays is None and charge.outcome == "failed" and metrics["inca-round-failed"] == 1
    expected = {"final exchange": _exact(strategy, trace, 1), "iteration 2": strategy.inca.ceilings(N)[-1],
                "guard check": _exact(strategy, trace, 1, through=1)}[where]
    assert charge.mu == pytest.approx(strategy.session.charged(expected), rel=2e-9)
    (entry,) = strategy.ledger.entries
    assert entry.status == "charged" and "mixing failed" in entry.note
    # the batch that raised never left; after the failed certificate, no later request did
    assert max(grid.commits(1)) == {"final exchange": T, "iteration 2": 1, "guard check": 2}[where]
    assert _round(strategy, _grid(), 2)[0] is not None  # training goes on


# ------------------------------------------------------------------------------ before a round
def test_a_budget_no_round_can_fit_stops_before_round_1_with_nothing_spent(tmp_path, task_identity):
    """The prediction of round 1 does not fit the budget: ``start`` stops before any node is contacted, with
    nothing charged and no ledger written, and says why in one message."""
    path = tmp_path / "ledger.json"
    strategy, grid = _strategy(ledger_path=path, max_epsilon=1.0), _grid()
    predicted = strategy.inca.predicted_mu(N)
    assert _epsilon(predicted) > 1.0
    with pytest.raises(IncaBudgetExhausted,
                       match=r"^stopping before round 1: it would bring epsilon from 0 to about .* > "
                             r"max_epsilon = 1 .*nothing of it was released or charged"):
        strategy.start(grid=grid, initial_arrays=MODEL, num_rounds=3)
    assert grid.pushed == [] and strategy.rounds == {} and strategy.ledger.rounds == 0
    assert PrivacyLedger(path, delta=DELTA).rounds == 0


def test_a_budget_for_exactly_k_rounds_trains_k_rounds_then_stops_before_the_next(probe, task_identity):
    """With a budget for two rounds (their certified costs, then the prediction of a third, do not fit it),
    ``start`` trains rounds 1 and 2 and stops before round 3 contacts anybody; the ledger holds the two
    charges and the exception the model after round 2."""
    costs = [probe.rounds[r].charge.certified_mu for r in (1, 2)]
    predicted = probe.inca.predicted_mu(N)
    low = max(_epsilon(costs[0], predicted), _epsilon(*costs))  # round 2 is admitted and fits
    high = _epsilon(*costs, predicted)  # round 3 is not admitted
    assert low < high
    strategy, grid = _strategy(max_epsilon=(low + high) / 2), _grid()
    with pytest.raises(IncaBudgetExhausted, match="^stopping before round 3: it would bring epsilon") as info:
        strategy.start(grid=grid, initial_arrays=MODEL, num_rounds=5)
    assert sorted(strategy.rounds) == [1, 2] and strategy.rounds_trained == 2 and strategy.rounds_refused == 0
    assert [e.certified_mu or e.mu for e in strategy.ledger.entries] == costs
    assert grid.commits(3) == []
    expected = flatten_arrays(MODEL)[0] + strategy.rounds[1].update + strategy.rounds[2].update
    assert np.allclose(flatten_arrays(info.value.arrays)[0], expected, atol=1e-6)


def test_the_prediction_is_the_worst_certificate_over_the_sampled_executions_computed_only_when_needed(
        monkeypatch, task_identity):
    """``strategy.inca.predicted_mu(n)`` is the worst certificate with every final over ``budget_check_runs``
    executions sampled at the round's settings (dropout model included), each against the round's random
    coalitions, recomputed here with ``certify``; a training without a budget never computes it, one with a
    budget before its first round."""
    strategy = _strategy(dropout=PermanentDropout(0.2), budget_check_runs=4, max_epsilon=50.0)
    n, priv = 9, strategy.privacy
    config = strategy.inca.config(n)
    root = prediction_seeds(strategy.seed, n)
    # of the 4 executions, 3 with the dropout model and ceil(4 / 4) = 1 in which nobody drops out
    stay = np.random.SeedSequence(root.entropy, spawn_key=(*root.spawn_key, 1))
    worst, dropout_free = 0.0, 0.0
    for seeds, runs, model in ((root, 3, config), (stay, 1, dataclasses.replace(config, dropout=None))):
        for run in seeds.spawn(runs):
            execution, threat = run.spawn(2)
            trace = sample_trace(n, model, seed=int(execution.generate_state(1, np.uint64)[0]))
            assert model is config or trace.steps[-1].online.size == n  # nobody dropped out
            for view in certification_views(trace, threat, priv.threat_draws, collusion=priv.collusion):
                mu = certify(trace, view, value_sensitivity=priv.sensitivity).max_mu
                worst = max(worst, mu)
                dropout_free = max(dropout_free, mu) if model is not config else dropout_free
    got = strategy.inca.predicted_mu(n)
    assert worst <= got <= worst * (1 + 2e-9) and got > 0 and dropout_free > 0
    assert strategy.inca.predicted_mu(n, runs=2) <= got  # the first runs of the same executions

    calls = []
    real = IncaRounds.predicted_mu
    monkeypatch.setattr(IncaRounds, "predicted_mu",
                        lambda self, n, runs=None: calls.append(n) or real(self, n, runs))
    _round(_strategy(), _grid())
    assert calls == []  # no budget: nothing to predict
    _round(_strategy(max_epsilon=50.0), _grid())
    assert calls == [N]


@pytest.mark.timeout(120)
def test_the_prediction_covers_rounds_in_which_nobody_drops_out():
    """At n = 100 a round where every party stays costs more than the rounds the dropout model samples (the
    noise of a party that leaves is never cancelled, which hides the others): the prediction covers it, so
    a deployment whose nodes drop out less than expected does not overrun its last round's share."""
    from flwr_inca import IncaConfig
    from flwr_inca.privacy.budget_check import predicted_round_mu
    from flwr_inca.privacy.prefix import RoundPrefix

    n, runs = 100, 4
    config = IncaConfig(sigma_star=0.05, sigma_delta=0.5, iterations=20, dropout=PermanentDropout(0.1))
    root = prediction_seeds(7, n)

    def worst(seeds, count, model):
        out = 0.0
        fresh = np.random.SeedSequence(seeds.entropy, spawn_key=seeds.spawn_key)  # spawning advances seeds
        for run in fresh.spawn(count):
            execution, threat = run.spawn(2)
            trace = sample_trace(n, model, seed=int(execution.generate_state(1, np.uint64)[0]))
            out = max(out, RoundPrefix(trace, threat, 1, collusion=0.1).with_finals().mu)
        return out

    with_model = worst(root, runs - 1, config)  # 3 with the model, 1 without dropouts
    dropout_free = worst(np.random.SeedSequence(root.entropy, spawn_key=(*root.spawn_key, 1)), 1,
                         dataclasses.replace(config, dropout=None))
    assert dropout_free > with_model  # the case the prediction must cover
    got = predicted_round_mu(n, config, root, runs, collusion=0.1)
    assert got == pytest.approx(dropout_free, rel=1e-12)
    # without a dropout model there is nothing more to cover
    assert predicted_round_mu(n, dataclasses.replace(config, dropout=None), root, runs, collusion=0.1) == \
        pytest.approx(worst(root, runs, dataclasses.replace(config, dropout=None)), rel=1e-12)


def test_a_prediction_serves_nearby_party_counts_and_no_farther(monkeypatch, task_identity):
    """Rounds whose participants vary a little (clients available or not) reuse one prediction: made at
    100 parties, it serves 95..105 (PREDICTION_REUSE_WITHIN), and 106 gets its own."""
    from flwr_inca import rounds as rounds_module
    from flwr_inca.privacy.budget_check import PREDICTION_REUSE_WITHIN

    made = []
    real = rounds_module.predicted_round_mu
    monkeypatch.setattr(rounds_module, "predicted_round_mu", lambda n, *a, **k: made.append(n) or real(n, *a, **k))
    strategy = _strategy(dropout=PermanentDropout(0.2), budget_check_runs=2, max_epsilon=50.0)
    first = strategy.inca.predicted_mu(100)
    assert PREDICTION_REUSE_WITHIN == 0.05
    assert [strategy.inca.predicted_mu(n) for n in (95, 103, 105)] == [first] * 3 and made == [100]
    assert strategy.inca.predicted_mu(106) > 0 and made == [100, 106]
    assert strategy.inca.predicted_mu(102) == first and made == [100, 106]  # the nearest: 100
    strategy.inca.predicted_mu(100, runs=1)
    assert made == [100, 106, 100]  # another number of runs is another prediction


@pytest.mark.parametrize("seed", range(6))
def test_the_ledger_never_exceeds_max_epsilon_whatever_the_prediction(monkeypatch, task_identity, seed):
    """Property: a random budget (log-uniform from below one iteration's cost to a few rounds), a prediction
    off by a random factor (as low as 0: every round starts) and nodes missing random exchanges (timeouts):
    whatever the policy then does (admit, guard, refuse before the finals, release), every ledger entry and
    the total stay within max_epsilon, and every charged round has its entry."""
    rng = np.random.default_rng(seed)
    budget = float(np.exp(rng.uniform(np.log(0.03), np.log(12.0))))
    _predict(monkeypatch, float(rng.choice([0.0, 0.3, 1.0])))
    missed = rng.random((8, T + 2, N)) < 0.1
    grid = _grid(drop=lambda rnd, commit, party: bool(missed[rnd, commit, party]))
    strategy = _strategy(seed=seed, max_epsilon=budget, exchange_timeout=0.05, final_retries=1,
                         min_finalists=1, max_noise_inflation=math.inf)
    try:
        strategy.start(grid=grid, initial_arrays=MODEL, num_rounds=6)
    except IncaBudgetExhausted as stop:
        assert stop.epsilon <= budget
    entries = strategy.ledger.entries
    assert all(e.epsilon <= budget and e.status == "charged" for e in entries)
    assert strategy.ledger.epsilon() <= budget
    assert len(entries) == sum(1 for r in strategy.rounds.values() if r.charge is not None and r.charge.entry)


def test_certificate_methods_are_recorded_in_the_ledger_file(tmp_path, monkeypatch, task_identity):
    """Each entry names the certificate that charged it: "exact" for round 1; "bound" for round 2, whose
    views are certified by the bound (scripted: as for a view too large for the exact method)."""
    from flwr_inca.privacy import prefix as prefix_module

    path = tmp_path / "ledger.json"
    strategy, grid = _strategy(ledger_path=path), _grid()
    _round(strategy, grid, 1)
    real = prefix_module.certify
    monkeypatch.setattr(prefix_module.PrefixProfile, "build", classmethod(lambda cls, *a, **k: None))
    monkeypatch.setattr(prefix_module, "certify",
                        lambda *a, **k: dataclasses.replace(real(*a, **k), method="bound"))
    _round(strategy, grid, 2)
    assert [e.method for e in PrivacyLedger(path, delta=DELTA).entries] == ["exact", "bound"]
    assert [strategy.rounds[r].charge.method for r in (1, 2)] == ["exact", "bound"]


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "3", None, math.inf])
def test_bad_cap_values_are_refused_naming_the_parameter(bad):
    with pytest.raises(ValueError, match=r"max_consecutive_refusals .*must be an integer in \[1, 100000\], got"):
        _strategy(max_consecutive_refusals=bad)
    with pytest.raises(ValueError, match="max_consecutive_refusals"):
        PrivacyTarget(max_consecutive_refusals=bad)

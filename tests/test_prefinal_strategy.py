"""IncaStrategy's pre-final rule, in process: the strategy's own mixing loop (``_mix``) with the real
party code answering each exchange (no Flower engine), so every exchange the strategy makes is seen.

A round is certified before its final messages; if charging that would exceed ``max_epsilon`` the
finals are never asked for, the round is charged what was observed without them, the model is kept
and the round is skipped (training stops after ``max_consecutive_refusals`` such rounds in a row);
otherwise the finals are collected and the round charged for those that arrived.
"""

import itertools
import math
import time

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import ArrayRecord, ConfigRecord

from flwr_inca.flower import IncaBudgetExhausted, IncaStrategy
from flwr_inca.flower.node import MemoryStore, RoundSecrets, handle_exchange
from flwr_inca.flower.strategy import _PendingRound
from flwr_inca.privacy import PrivacyLedger, certify, random_collusion
from flwr_inca.privacy.prefinal import no_finals_bound
from flwr_inca.privacy.prefix import prefix_view
from flwr_inca.protocol.schedules import InjectionSchedule

N, D, T = 6, 4, 3
SETTINGS = {"sigma_star": 1.0, "sigma_delta": 20.0, "iterations": T, "clip_norm": 1.0, "seed": 5,
            "precision": "float64", "min_available_nodes": N, "min_train_nodes": N}


class Nodes:
    """N nodes answering the strategy's exchanges in process; ``lost(party, commit)`` drops a reply."""

    def __init__(self, round_=1, lost=None):
        self.round, self.lost = round_, lost
        self.roster = [500 + 3 * i for i in range(N)]
        self.secrets = [RoundSecrets.generate(round_, fixed_seed=9, node=node) for node in self.roster]
        self.stores = [MemoryStore() for _ in range(N)]
        values = np.random.default_rng(round_).normal(0, 0.2, (N, D))
        for store, value in zip(self.stores, values):
            store.save_value(round_, value)
        self.commits: list[int] = []  # the commit of every exchange the strategy made

    def join_replies(self):
        from types import SimpleNamespace

        replies = []
        for node, secret in zip(self.roster, self.secrets):
            inca = ConfigRecord({"public-key": secret.public_key, "dim": D})
            content = SimpleNamespace(config_records={"inca": inca}, metric_records={})
            replies.append(SimpleNamespace(metadata=SimpleNamespace(src_node_id=node),
                                           has_error=lambda: False, error=None, content=content))
        return replies

    def exchange(self, grid, params, roster, requests, counters, has_roster):
        commit = requests[0].commit if requests else -1
        self.commits.append(commit)
        replies = {}
        for req in requests:
            if self.lost is not None and self.lost(req.party, req.commit):
                continue
            replies[req.party] = handle_exchange(req, params, req.party, self.secrets[req.party],
                                                 self.stores[req.party])
        return replies


def _round(strategy, monkeypatch, nodes, model=None, guarded=None):
    """One ``aggregate_train`` of round ``nodes.round``, mixing among ``nodes``; returns (arrays, metrics).
    ``guarded``: as ``configure_train`` decided (None: ask the strategy's budget check)."""
    model = model or ArrayRecord([np.full(D, 0.5)])
    monkeypatch.setattr(strategy, "_mix_exchange", nodes.exchange)
    if guarded is None:
        guarded = strategy._check_budget(nodes.round, N, model)
    strategy._pending[nodes.round] = _PendingRound(None, model, time.time(), guarded)
    return strategy.aggregate_train(nodes.round, nodes.join_replies())


def _budget_between(low_mu, high_mu, delta=1e-5):
    """A max_epsilon that one round of cost low_mu fits and one of cost high_mu does not."""
    ledger = PrivacyLedger(None, delta=delta)
    low, high = ledger.epsilon_after(low_mu), ledger.epsilon_after(high_mu)
    assert low < high
    return (low + high) / 2


def test_within_budget_the_finals_are_collected_and_all_of_them_charged(monkeypatch):
    strategy = IncaStrategy(**SETTINGS, ledger_path=None)
    nodes = Nodes()
    arrays, _ = _round(strategy, monkeypatch, nodes)
    record = strategy.rounds[1]
    assert arrays is not None and not record.failed and record.finalists == list(range(N))
    assert T + 1 in nodes.commits  # the finals were asked for
    # all finals arrived: the charge is the pre-final certificate, the same adversaries as before
    seeds = strategy._certify_seeds(1)
    assert record.mu == strategy._certify(record.trace, seeds) > 0
    assert strategy.ledger.entries[0].mu == record.mu and strategy.ledger.entries[0].note == "round 1"
    assert strategy.train_metrics_serverapp[1]["inca-stopped-before-finals"] == 0


def test_lost_finals_are_charged_exactly_below_the_prefinal_bound(monkeypatch):
    strategy = IncaStrategy(**SETTINGS, ledger_path=None, max_noise_inflation=math.inf)
    nodes = Nodes(lost=lambda party, commit: party == 2 and commit == T + 1)  # its final never arrives
    _round(strategy, monkeypatch, nodes)
    record = strategy.rounds[1]
    assert record.finalists == [0, 1, 3, 4, 5] and record.trace.meta["finalists"] == record.finalists
    prefinal = strategy._certify(record.trace, strategy._certify_seeds(1))
    # independently: the worst of the same three random coalitions, seeing five finals
    draws = [int(s.generate_state(1, dtype=np.uint64)[0]) for s in strategy._certify_seeds(1).spawn(3)]
    exact = max(certify(record.trace, random_collusion(record.trace, 0.1, seed, finals=record.finalists),
                        value_sensitivity=2.0).max_mu for seed in draws)
    assert exact <= record.mu <= exact * (1 + 2e-9) and record.mu < prefinal  # rounded up, never down
    assert strategy.ledger.entries[0].note == f"round 1: {N - 1} of {N} final messages revealed"


def test_a_round_over_budget_before_its_finals_is_stopped_and_charged_without_them(monkeypatch, tmp_path,
                                                                                    task_identity):
    # the round's pre-final cost, from the same deterministic round without a budget
    probe = IncaStrategy(**SETTINGS, ledger_path=None)
    _round(probe, monkeypatch, Nodes())
    prefinal = probe.rounds[1].mu
    ceiling = probe.no_finals_mu(N)
    assert ceiling < prefinal / 3  # withholding the finals is much cheaper
    budget = _budget_between(ceiling, prefinal)
    path = tmp_path / "ledger.json"
    strategy = IncaStrategy(**SETTINGS, ledger_path=path, max_epsilon=budget, max_consecutive_refusals=1)
    monkeypatch.setattr(strategy, "predicted_mu", lambda n: ceiling)  # a prediction that underestimates
    nodes = Nodes()
    model = ArrayRecord([np.full(D, 0.5)])
    with pytest.raises(IncaBudgetExhausted, match="stopped before its final messages") as info:
        _round(strategy, monkeypatch, nodes, model, guarded=False)
    stop = info.value
    assert stop.stopped_before_finals and stop.server_round == 1 and stop.arrays is model
    assert "Training stops: 1 round(s) in a row were refused by the budget (max_consecutive_refusals = 1)" in str(stop)
    assert T + 1 not in nodes.commits and max(nodes.commits) == T  # no final was asked for
    record = strategy.rounds[1]
    assert record.refused and record.update is None and strategy.rounds_refused == 1
    assert record.finalists == [] and record.trace.meta["finalists"] == []
    assert record.trace.meta["finals-collected"] is False and "not collected" in record.failed
    # charged exactly what was observed without finals: below the ceiling, within the budget
    draws = [int(s.generate_state(1, dtype=np.uint64)[0]) for s in strategy._certify_seeds(1).spawn(3)]
    without = max(certify(record.trace, random_collusion(record.trace, 0.1, seed, finals=()),
                          value_sensitivity=2.0).max_mu for seed in draws)
    assert without <= record.mu <= without * (1 + 2e-9) and 0 < record.mu <= ceiling
    ledger = PrivacyLedger(path, delta=1e-5)  # what is on disk
    assert ledger.rounds == 1 and ledger.entries[0].mu == record.mu
    assert ledger.epsilon() == pytest.approx(stop.epsilon) and ledger.epsilon() <= budget
    assert ledger.entries[0].note == "round 1: stopped before its final messages"
    assert stop.predicted_epsilon == pytest.approx(PrivacyLedger(None, delta=1e-5).epsilon_after(prefinal))
    assert stop.predicted_epsilon > budget
    assert strategy.train_metrics_serverapp[1]["inca-stopped-before-finals"] == 1
    # training stopped (max_consecutive_refusals = 1): the next round does not start, and contacts nobody
    grid = _Grid()
    with pytest.raises(IncaBudgetExhausted, match=r"not starting round 2: training stopped at round 1 \(1 round"):
        strategy.configure_train(2, model, ConfigRecord(), grid)
    assert grid.pushed == 0 and strategy.ledger.rounds == 1
    # with the default cap (3) the same round is only skipped: the model is kept, and the next round starts
    skipping = IncaStrategy(**SETTINGS, ledger_path=None, max_epsilon=budget)
    monkeypatch.setattr(skipping, "predicted_mu", lambda n: ceiling)
    arrays, _ = _round(skipping, monkeypatch, Nodes(), model, guarded=False)
    assert arrays is None and skipping.rounds[1].refused and skipping.ledger.entries[0].mu == record.mu
    metrics = skipping.train_metrics_serverapp[1]
    assert metrics["inca-round-refused"] == 1 and metrics["inca-consecutive-refusals"] == 1
    assert list(skipping.configure_train(2, model, ConfigRecord(), _Grid()))


def test_a_round_whose_no_finals_ceiling_does_not_fit_runs_guarded(monkeypatch, task_identity):
    ceiling = no_finals_bound(InjectionSchedule.incremental(T), 1.0, 20.0, 2.0)
    strategy = IncaStrategy(**SETTINGS, ledger_path=None, max_epsilon=_budget_between(ceiling / 2, ceiling))
    # the last prefix ceiling, rounded up by ROUND_UP: never below the exact no-finals ceiling
    assert ceiling <= strategy.no_finals_mu(N) == strategy.prefix_ceilings(N)[-1] <= ceiling * (1 + 2e-9)
    monkeypatch.setattr(strategy, "predicted_mu", lambda n: 0.0)  # a round predicted to fit
    messages = list(strategy.configure_train(1, ArrayRecord([np.ones(D)]), ConfigRecord(), _Grid()))
    assert messages and strategy._pending[1].guarded
    # with the ceiling fitting, the same round is not guarded
    roomy = IncaStrategy(**SETTINGS, ledger_path=None, max_epsilon=_budget_between(ceiling, 2 * ceiling))
    monkeypatch.setattr(roomy, "predicted_mu", lambda n: 0.0)
    list(roomy.configure_train(1, ArrayRecord([np.ones(D)]), ConfigRecord(), _Grid()))
    assert not roomy._pending[1].guarded


def test_without_the_reserve_only_the_predicted_cost_is_checked(monkeypatch, task_identity):
    ceiling = no_finals_bound(InjectionSchedule.incremental(T), 1.0, 20.0, 2.0)
    budget = _budget_between(ceiling / 2, ceiling)
    strategy = IncaStrategy(**SETTINGS, ledger_path=None, max_epsilon=budget, reserve_stopped_round=False)
    assert strategy.privacy.reserve_stopped_round is False
    monkeypatch.setattr(strategy, "predicted_mu", lambda n: 0.0)
    grid = _Grid()
    messages = list(strategy.configure_train(1, ArrayRecord([np.ones(D)]), ConfigRecord(), grid))
    assert messages  # the round the reserve refuses (test above) starts
    with pytest.raises(ValueError, match="reserve_stopped_round"):
        IncaStrategy(**SETTINGS, ledger_path=None, reserve_stopped_round="no")


def test_a_failed_final_exchange_is_charged_the_prefinal_bound(monkeypatch):
    strategy = IncaStrategy(**SETTINGS, ledger_path=None)
    nodes = Nodes()
    inner = nodes.exchange

    def exchange(grid, params, roster, requests, counters, has_roster):
        if requests and requests[0].commit == T + 1:
            raise ConnectionError("the grid went away")
        return inner(grid, params, roster, requests, counters, has_roster)

    nodes.exchange = exchange
    with pytest.raises(ConnectionError):
        _round(strategy, monkeypatch, nodes)
    entry = strategy.ledger.entries[0]
    assert "final exchange failed" in entry.note
    probe = IncaStrategy(**SETTINGS, ledger_path=None)
    _round(probe, monkeypatch, Nodes())
    assert entry.mu == probe.rounds[1].mu  # the pre-final certificate of the same round


def test_a_round_not_certifiable_before_its_finals_is_charged_unbounded_and_asks_for_no_final(monkeypatch):
    strategy = IncaStrategy(**SETTINGS, ledger_path=None)
    nodes = Nodes()

    def broken(trace, seeds):
        raise np.linalg.LinAlgError("SVD did not converge")

    monkeypatch.setattr(strategy, "_round_prefix", broken)
    with pytest.raises(np.linalg.LinAlgError):
        _round(strategy, monkeypatch, nodes)
    assert T + 1 not in nodes.commits
    assert strategy.ledger.rounds == 1 and math.isinf(strategy.ledger.epsilon())


@pytest.fixture
def task_identity(monkeypatch):
    """Flower sets these in a running app; messages cannot be created without them."""
    from flwr.supercore.task_identity import TaskIdentity

    for name, value in (("_run_id", 1), ("_node_id", 5), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)


class _Grid:
    """Enough of a Grid for configure_train: ten nodes, and a count of what was pushed."""

    def __init__(self):
        self.pushed = 0

    def get_node_ids(self):
        return list(range(1, N + 1))

    def push_messages(self, messages):
        self.pushed += len(list(messages))
        return []

    def pull_messages(self, ids):
        return []


def test_every_certification_of_a_round_draws_the_same_adversaries():
    """The pre-final certificate bounds a subset's only against the same adversaries: certifying twice
    from one SeedSequence must not draw new ones (spawning advances a SeedSequence)."""
    from flwr_inca import IncaConfig, PermanentDropout
    from flwr_inca.protocol import sample_trace

    strategy = IncaStrategy(**SETTINGS, ledger_path=None, threat_draws=4, collusion=0.3)
    trace = sample_trace(30, IncaConfig(iterations=4, neighbors=1, sigma_star=1.0, sigma_delta=20.0,
                                        dropout=PermanentDropout(0.1)), seed=2)
    seeds = strategy._certify_seeds(1)
    online = trace.steps[-1].online.tolist()
    first = strategy._certify(trace, seeds)
    assert strategy._certify(trace, seeds) == first
    for finals in (online[1:], online[::2], []):
        assert strategy._certify(trace, seeds, finals=finals) <= first * (1 + 1e-9)
    # and the charge with lost finals, from one call, is below the pre-final certificate
    mu, _ = strategy._certify_and_spend(trace, 1, None, online[1:])
    assert mu <= first * (1 + 1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_the_ledger_never_exceeds_max_epsilon_whatever_the_prediction(monkeypatch, task_identity, seed):
    """Random budgets and predictions off by a random factor (as low as 0): rounds run until training
    stops, and no ledger entry ever exceeds max_epsilon (with dropouts: nodes miss random exchanges)."""
    rng = np.random.default_rng(seed)
    budget = float(rng.uniform(0.3, 3.0))
    strategy = IncaStrategy(**{**SETTINGS, "seed": seed}, ledger_path=None, max_epsilon=budget,
                            max_noise_inflation=math.inf, min_finalists=1)
    factor = float(rng.choice([0.0, 0.3, 1.0]))
    true_prediction = strategy.predicted_mu
    monkeypatch.setattr(strategy, "predicted_mu", lambda n: factor * true_prediction(n))
    model = ArrayRecord([np.full(D, 0.5)])
    stopped = None
    for rnd in range(1, 30):
        try:
            strategy.configure_train(rnd, model, ConfigRecord(), _Grid())
            missed = rng.random((N, T + 3)) < 0.1  # a node misses an exchange (errors, timeouts)
            nodes = Nodes(rnd, lost=lambda party, commit, m=missed: m[party, commit])
            arrays, _ = _round(strategy, monkeypatch, nodes, model)
        except IncaBudgetExhausted as stop:
            stopped = stop
            break
        model = arrays or model
    assert stopped is not None
    assert all(e.epsilon <= budget for e in strategy.ledger.entries)
    assert strategy.ledger.epsilon() <= budget


def _probe_prefix():
    """The deterministic round of ``Nodes()`` without a budget: its trace and its RoundPrefix."""
    probe = IncaStrategy(**SETTINGS, ledger_path=None)
    with pytest.MonkeyPatch.context() as mp:
        _round(probe, mp, Nodes())
    trace = probe.rounds[1].trace
    return trace, probe._round_prefix(trace, probe._certify_seeds(1))


@pytest.mark.parametrize("delivered", [0, 1, 2])
def test_the_budget_guard_stops_a_round_before_the_messages_that_would_not_fit(monkeypatch, tmp_path,
                                                                                task_identity, delivered):
    """A guarded round is stopped before delivering the messages of the first iteration whose view does
    not fit; it is charged exactly what the iterations before revealed, and nothing later is exchanged."""
    trace, prefix = _probe_prefix()
    costs = [prefix.through(t).mu for t in range(T + 1)]
    assert costs[0] == 0 and all(a < b for a, b in itertools.pairwise(costs))
    budget = _budget_between(costs[delivered], costs[delivered + 1])
    path = tmp_path / "ledger.json"
    strategy = IncaStrategy(**SETTINGS, ledger_path=path, max_epsilon=budget)
    monkeypatch.setattr(strategy, "predicted_mu", lambda n: 0.0)  # an underestimating prediction
    nodes = Nodes()
    model = ArrayRecord([np.full(D, 0.5)])
    if delivered == 0:  # nothing could be delivered: the budget left does not afford a round; training stops
        with pytest.raises(IncaBudgetExhausted, match="stopped by the budget guard") as info:
            _round(strategy, monkeypatch, nodes, model)
        stop = info.value
        assert stop.stopped_before_finals and stop.delivered_iterations == 0 and stop.arrays is model
        assert "none of its messages could be delivered" in str(stop)
    else:  # skipped: the model is kept, training goes on
        arrays, _ = _round(strategy, monkeypatch, nodes, model)
        assert arrays is None and strategy.rounds[1].refused
    # the exchange committing to delivered + 1 ran; the next (which would deliver its messages) did not
    assert max(nodes.commits) == delivered + 1 and T + 1 not in nodes.commits
    # charged: the same three coalitions, certified independently on the view through `delivered`
    draws = [int(s.generate_state(1, dtype=np.uint64)[0]) for s in strategy._certify_seeds(1).spawn(3)]
    exact = max(certify(trace, prefix_view(random_collusion(trace, 0.1, seed), delivered),
                        value_sensitivity=2.0).max_mu for seed in draws)
    record = strategy.rounds[1]
    assert exact <= record.mu <= exact * (1 + 2e-9) and (record.mu == 0) == (delivered == 0)
    ledger = PrivacyLedger(path, delta=1e-5)
    assert ledger.rounds == 1 and ledger.epsilon() <= budget and ledger.entries[0].mu == record.mu
    assert ledger.entries[0].note == (f"round 1: stopped by the budget guard before delivering the messages "
                                      f"of iteration {delivered + 1}")
    assert record.trace.meta["delivered-iterations"] == delivered and record.finalists == []
    assert strategy.train_metrics_serverapp[1]["inca-stopped-before-finals"] == 1
    # after delivered = 0 the next round does not start; a restarted strategy on the same ledger (or the
    # same strategy going on) never exceeds the budget
    grid = _Grid()
    if delivered == 0:
        with pytest.raises(IncaBudgetExhausted, match="not starting round 2: training stopped at round 1"):
            strategy.configure_train(2, model, ConfigRecord(), grid)
        assert grid.pushed == 0
    else:
        with pytest.raises(IncaBudgetExhausted, match="Training stops") as info:
            for rnd in (2, 3, 4):  # refused again and again (the budget left shrinks): training stops
                _round(strategy, monkeypatch, Nodes(rnd), model)
        assert ("max_consecutive_refusals = 3" in str(info.value)) == (strategy.rounds_refused == 3)
        assert strategy.rounds_refused >= 2 and PrivacyLedger(path, delta=1e-5).epsilon() <= budget
    again = IncaStrategy(**SETTINGS, ledger_path=path, max_epsilon=budget)
    monkeypatch.setattr(again, "predicted_mu", lambda n: 0.0)
    with pytest.raises(IncaBudgetExhausted):
        again.configure_train(1, model, ConfigRecord(), _Grid())
        _round(again, monkeypatch, Nodes(2), model)
    assert PrivacyLedger(path, delta=1e-5).epsilon() <= budget


def test_a_guarded_round_that_fits_completes_with_its_finals(monkeypatch, task_identity):
    """The guard costs nothing but checks: a guarded round whose messages all fit is the same round."""
    _, prefix = _probe_prefix()
    full = prefix.with_finals(None).mu
    budget = _budget_between(full, 2 * full)
    strategy = IncaStrategy(**SETTINGS, ledger_path=None, max_epsilon=budget)
    arrays, _ = _round(strategy, monkeypatch, Nodes(), guarded=True)
    assert arrays is not None and strategy.rounds[1].mu == full
    assert strategy.ledger.epsilon() <= budget


def test_a_failing_guard_check_charges_what_was_delivered(monkeypatch):
    """An error while certifying a guarded iteration: what was delivered until then (certified, or under
    a ceiling that fit) is charged before the error surfaces, and no later exchange is made."""
    _, prefix = _probe_prefix()
    costs = [prefix.through(t).mu for t in range(T + 1)]
    strategy = IncaStrategy(**SETTINGS, ledger_path=None, max_epsilon=_budget_between(costs[1], costs[2]))
    real = strategy._round_prefix

    def fails_on_iteration_two(trace, seeds):
        if strategy._calls == 1:  # the second check (iteration 2)
            raise np.linalg.LinAlgError("boom")
        strategy._calls += 1
        return real(trace, seeds)

    strategy._calls = 0
    monkeypatch.setattr(strategy, "_round_prefix", fails_on_iteration_two)
    monkeypatch.setattr(strategy, "prefix_ceilings", lambda n: np.full(T + 1, np.inf))  # check every one
    nodes = Nodes()
    with pytest.raises(np.linalg.LinAlgError):
        _round(strategy, monkeypatch, nodes, guarded=True)
    assert max(nodes.commits) == 2 and strategy.ledger.rounds == 1
    entry = strategy.ledger.entries[0]
    assert "mixing failed" in entry.note and entry.mu == pytest.approx(costs[1], rel=1e-12)


def test_a_failed_mixing_exchange_is_charged_what_it_may_have_delivered(monkeypatch):
    """An unguarded round whose mixing fails mid-way has delivered messages: it is charged the most they
    can reveal on any execution (the no-finals ceiling) before the error surfaces."""
    strategy = IncaStrategy(**SETTINGS, ledger_path=None)
    nodes = Nodes()
    inner = nodes.exchange

    def exchange(grid, params, roster, requests, counters, has_roster):
        if requests and requests[0].commit == 2:
            raise ConnectionError("the grid went away")
        return inner(grid, params, roster, requests, counters, has_roster)

    nodes.exchange = exchange
    with pytest.raises(ConnectionError):
        _round(strategy, monkeypatch, nodes, guarded=False)
    entry = strategy.ledger.entries[0]
    assert strategy.ledger.rounds == 1 and "mixing failed" in entry.note
    assert entry.mu == strategy.no_finals_mu(N) > 0

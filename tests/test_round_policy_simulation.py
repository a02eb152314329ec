"""The simulator's round policy (flwr_inca/privacy/session.py, driven by ``simulate`` through
``IncaMixer.charge``), read from public results only: the ``History`` (its records, ``stopped``, its
files), the ledger file, the traces saved in ``trace_dir``, and ``on_round`` (called for every round whose
update was applied). Certificates are checked against an independent computation: the round's adversaries
drawn from ``certification_seeds(IncaMixer.threat_seed(seed), r)`` and each view certified with
``certify`` (no factorization shared with the simulator).

24 clients at party level (value sensitivity 2C = 2), T = 5, sigma_star = 3, sigma_delta = 20, 10%
colluders: a round costs about mu = 0.16 with its finals and at most 0.12 without them (the no-finals
ceiling), about 0.04 exactly; an inline simulated round takes about 0.4 s.

The same policy in IncaStrategy is tests/test_round_policy_strategy.py; GOPA's charge,
tests/test_gopa_mixer.py.
"""

from __future__ import annotations

import csv
import functools
import math

import numpy as np
import pytest
from synthetic import script_outliers

torch = pytest.importorskip("torch")

from synthetic import CLASSES, FEATURES, linear_task  # noqa: E402

from flwr_inca.privacy import PrivacyLedger  # noqa: E402
from flwr_inca.privacy.certificate import certify  # noqa: E402
from flwr_inca.privacy.prefix import prefix_view  # noqa: E402
from flwr_inca.privacy.rounds import certification_seeds, certification_views  # noqa: E402
from flwr_inca.privacy.session import RoundSession, charge_resolution  # noqa: E402
from flwr_inca.protocol import PermanentDropout  # noqa: E402
from flwr_inca.protocol.trace import ExecutionTrace  # noqa: E402
from flwr_inca.rounds import IncaRounds  # noqa: E402
from flwr_inca.settings import MixingConfig, PrivacyTarget  # noqa: E402
from flwr_inca.simulation import (  # noqa: E402
    History,
    IncaMixer,
    MixContext,
    SimulationConfig,
    create_mixer,
    iid,
    simulate,
)

X, Y = linear_task(960)
XT, YT = linear_task(300, seed=1)
MODEL = functools.partial(torch.nn.Linear, FEATURES, CLASSES)
PARTS = iid(X, Y, 24)
D = FEATURES * CLASSES + CLASSES
DELTA = 1e-5
NOISE = {"sigma_star": 3.0, "sigma_delta": 20.0, "iterations": 5}
RESOLUTION = PrivacyTarget().mu_resolution


def _config(out, **kw) -> SimulationConfig:
    return SimulationConfig(**{"rounds": 8, "max_epsilon": 3.0, **NOISE, "backend": "inline",
                               "privacy_unit": "party", "output_dir": None if out is None else str(out),
                               "trace_dir": "traces", **kw})


def _run(out, *, progress=False, **kw):
    """``simulate`` on the synthetic task: (history, {round: RoundContext of the rounds applied}, ledger
    file)."""
    trained = {}
    hist = simulate(MODEL, PARTS, (XT, YT), _config(out, **kw), progress=progress,
                    on_round=lambda c: trained.__setitem__(c.round, c))
    return hist, trained, PrivacyLedger(out / "inca_ledger.json", delta=DELTA, accountant="exact")


def _mixer(config: SimulationConfig) -> IncaMixer:
    """The simulation's IncaMixer, prepared as ``simulate`` prepares it (2C = 2, 24 participants)."""
    mixer = create_mixer(config)
    mixer.prepare(MixContext(2.0, None, DELTA, 24, D, config.seed))
    return mixer


def _trace(out, rnd) -> ExecutionTrace:
    return ExecutionTrace.load(out / "traces" / f"round-{rnd:04d}.json")


def _epsilon(*mus: float) -> float:
    """The ledger's epsilon after rounds of certified costs ``mus``, each charged as the run's session charges
    it (rounded up to ``mu_resolution``)."""
    ledger = PrivacyLedger(None, delta=DELTA, accountant="exact")
    session = RoundSession(ledger, resolution=RESOLUTION)
    for mu in mus[:-1]:
        ledger.spend(session.charged(mu))
    return session.epsilon_after(mus[-1])


def _exact(trace, rnd, *, seed=0, finals=None, through=None, collusion=0.1, draws=1) -> float:
    """Round ``rnd``'s cost on ``trace``, independently: the simulation's adversaries for ``seed``, each view
    (with the finals of ``finals``, None: all; or restricted to iterations 1..``through``) certified alone."""
    views = certification_views(trace, certification_seeds(IncaMixer.threat_seed(seed), rnd), draws,
                                collusion=collusion, finals=finals)
    if through is not None:
        views = (prefix_view(v, through) for v in views)
    return max(certify(trace, v, value_sensitivity=2.0).max_mu for v in views)


def _script_outliers(monkeypatch, rounds, factor=60.0):
    return script_outliers(monkeypatch, rounds, factor)


def _predict(monkeypatch, factor, calls=None):
    """Every round predicted at ``factor`` times the mixer's prediction (0: predicted free, every round is
    admitted); ``calls`` records each prediction asked for."""
    real = IncaMixer.predicted_cost

    def predicted(self, participants, runs):
        if calls is not None:
            calls.append(participants)
        return factor * real(self, participants, runs)

    monkeypatch.setattr(IncaMixer, "predicted_cost", predicted)


@pytest.fixture(scope="module")
def roomy(tmp_path_factory):
    """Six rounds with a budget none of them comes near: (history, trained, ledger, output directory)."""
    out = tmp_path_factory.mktemp("roomy")
    return (*_run(out, rounds=6, max_epsilon=100.0), out)


# ------------------------------------------------------------------------------ the finals
def test_within_the_budget_every_round_collects_its_finals_and_is_charged_its_certificate(roomy):
    """Rounds that fit are released: each is applied and charged exactly its certificate with every final
    (the independent computation on its saved trace), rounded up to the resolution only; the ledger records
    "exact" and the certified cost beside the charge."""
    hist, trained, ledger, out = roomy
    assert not hist.stopped and sorted(trained) == [1, 2, 3, 4, 5, 6] and hist.rounds_refused == 0
    assert ledger.rounds == 6
    for record, entry in zip(hist.rounds, ledger.entries):
        exact = _exact(_trace(out, record.round), record.round)
        assert exact <= record.mu <= exact * (1 + 2e-9) and record.certified
        assert entry.mu == record.charged_mu == charge_resolution(record.mu, RESOLUTION)
        assert (entry.certified_mu or entry.mu) == record.mu and entry.method == "exact"
        assert entry.note == f"round {record.round}" and entry.status == "charged"


def test_a_round_whose_prefinal_certificate_does_not_fit_is_stopped_before_its_finals(tmp_path, monkeypatch):
    """The budget runs out (predictions made free, so every round is admitted): each round that no longer fits
    with its finals is stopped before them, charged exactly its no-finals certificate (independently
    recomputed on its saved trace), skipped with the model unchanged; training goes on until three refusals in
    a row (max_consecutive_refusals) stop it, said in ``History.stopped``."""
    _predict(monkeypatch, 0.0)
    hist, trained, ledger = _run(tmp_path, rounds=12, max_epsilon=1.5)
    refused = [r for r in hist.rounds if r.refused]
    done = [r for r in hist.rounds if not r.refused]
    assert [r.round for r in refused] == [len(done) + 1, len(done) + 2, len(done) + 3] and len(done) >= 1
    last_refused = refused[-1].round
    assert hist.stopped.startswith(f"round {last_refused} skipped, refused by the budget: stopped before its "
                                   "final messages")
    assert hist.stopped.endswith("Training stops: 3 round(s) in a row were refused by the budget "
                                 "(max_consecutive_refusals = 3)")
    assert [r.round for r in done] == sorted(trained)  # the refused rounds released nothing
    last = trained[done[-1].round]
    assert np.array_equal(hist.parameters, (last.params_before + last.update).astype(np.float32))
    assert ledger.rounds == len(hist.rounds)
    spent = []
    for record, entry in zip(hist.rounds, ledger.entries):
        if record.refused:
            without = _exact(_trace(tmp_path, record.round), record.round, finals=())
            assert entry.mu == record.charged_mu == charge_resolution(without, RESOLUTION) > 0
            assert entry.note == f"round {record.round}: stopped before its final release"
            assert entry.method == "exact"
            assert record.failed.startswith("skipped, refused by the budget: stopped before its final "
                                            "messages")
            assert _epsilon(*spent, record.mu) > 1.5 and entry.mu < record.mu / 2  # with its finals: no fit
        spent.append(entry.certified_mu or entry.mu)
    assert all(e.epsilon <= 1.5 for e in ledger.entries) and hist.epsilon == pytest.approx(ledger.epsilon())


def test_an_outlier_round_is_skipped_and_the_rounds_after_it_train(tmp_path, monkeypatch, capsys):
    """Rounds 2 and 4 certify 60 times their cost with their finals (outlier executions, scripted): each is
    stopped before its finals, charged its real no-finals certificate, skipped with the model unchanged (the
    next round trains from the model before it), said in the progress line and the history's files; the
    rounds between train, and refusals that are not in a row do not add up (a cap of 2 never stops it)."""
    _script_outliers(monkeypatch, {2, 4})
    hist, trained, ledger = _run(tmp_path, rounds=5, max_consecutive_refusals=2, progress=True)
    assert not hist.stopped and [r.round for r in hist.rounds] == [1, 2, 3, 4, 5]
    assert sorted(trained) == [1, 3, 5] and [r.round for r in hist.rounds if r.refused] == [2, 4]
    after_1 = (trained[1].params_before + trained[1].update).astype(np.float32)
    assert np.array_equal(trained[3].params_before, after_1)
    for rnd in (2, 4):
        record, entry = hist.rounds[rnd - 1], ledger.entries[rnd - 1]
        without = _exact(_trace(tmp_path, rnd), rnd, finals=())
        assert entry.mu == record.charged_mu == charge_resolution(without, RESOLUTION)
        assert 0 < entry.mu < record.mu / 3
        assert entry.note == f"round {rnd}: stopped before its final release"
    assert ledger.rounds == 5 and all(e.epsilon <= 3.0 for e in ledger.entries)
    with (tmp_path / "history.csv").open() as f:
        refused = [row["refused"] for row in csv.DictReader(f)]  # round 0 first
    assert refused == ["False", "False", "True", "False", "True", "False"]
    assert History.load(tmp_path / "history.json").rounds_refused == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "round    2/5" in line]
    assert lines and "SKIPPED (refused by the budget" in lines[-1]
    assert "stopped before its final messages" in lines[-1]


def test_the_consecutive_cap_stops_training_with_a_clear_message(tmp_path, monkeypatch):
    """Rounds 2, 3 and 4 are outliers: the third refusal in a row ends training after round 4 (each charged);
    the model is the one after round 1."""
    _script_outliers(monkeypatch, {2, 3, 4})
    hist, trained, ledger = _run(tmp_path, rounds=6)
    assert [r.round for r in hist.rounds] == [1, 2, 3, 4] and sorted(trained) == [1]
    charged = hist.rounds[3].charged_mu
    assert hist.stopped == (
        "round 4 skipped, refused by the budget: stopped before its final messages, charged what it revealed "
        f"(mu = {charged:.4g}); the model is unchanged. Training stops: 3 round(s) in a row were refused by "
        "the budget (max_consecutive_refusals = 3)")
    assert ledger.rounds == 4 and [e.note for e in ledger.entries[1:]] == [
        f"round {r}: stopped before its final release" for r in (2, 3, 4)]
    assert np.array_equal(hist.parameters, (trained[1].params_before + trained[1].update).astype(np.float32))


# ------------------------------------------------------------------------------ the guard
@pytest.mark.parametrize("delivered", [0, 1, 4])
def test_the_budget_guard_stops_a_round_before_the_first_iteration_that_would_not_fit(tmp_path, monkeypatch,
                                                                                       delivered):
    """The budget fits the messages of round 1's iterations 1..``delivered`` and not the next one's (nor the
    no-finals ceiling: the round runs guarded; predictions made free). The round is charged exactly what
    iterations 1..``delivered`` revealed and skipped; when nothing could be delivered, nothing is recorded and
    training stops at once."""
    config = _config(tmp_path)
    prefix = _mixer(config).plan(1, 24).info["prefix"]  # the simulation's round 1 (the same seeds)
    costs = [prefix.through(t).mu for t in range(NOISE["iterations"] + 1)]
    budget_low, budget_high = _epsilon(costs[delivered]), _epsilon(costs[delivered + 1])
    assert budget_low < budget_high
    budget = (budget_low + budget_high) / 2
    _predict(monkeypatch, 0.0)
    hist, trained, ledger = _run(tmp_path, rounds=3, max_epsilon=budget)
    record = hist.rounds[0]
    where = f"by the budget guard before delivering step {delivered + 1}"
    assert record.refused and 1 not in trained
    assert record.failed.startswith(f"skipped, refused by the budget: stopped {where}")
    exact = _exact(_trace(tmp_path, 1), 1, through=delivered)
    assert exact <= record.charged_mu <= charge_resolution(exact * (1 + 2e-9), RESOLUTION)
    assert _epsilon(_exact(_trace(tmp_path, 1), 1, through=delivered + 1)) > budget  # the next would not fit
    assert ledger.epsilon() <= budget and all(e.epsilon <= budget for e in ledger.entries)
    if delivered == 0:
        assert [r.round for r in hist.rounds] == [1] and record.charged_mu == 0 and ledger.rounds == 0
        assert hist.stopped.endswith("Training stops: nothing of it could be delivered: the budget left does "
                                     "not afford the first step of a round")
    else:
        assert record.cost == f"stopped {where}: charged the certificate of iterations 1..{delivered}"
        assert ledger.entries[0].note == f"round 1: stopped {where}"
        assert ledger.entries[0].mu == record.charged_mu
        assert len(hist.rounds) >= 2  # skipped: training went on


def test_a_guarded_round_whose_iterations_all_fit_completes_as_without_the_guard(roomy, tmp_path,
                                                                                 monkeypatch):
    """No ceiling fits (scripted: unbounded), so every iteration is certified exactly and reserved before it
    is delivered; all fit, and so do the finals: the guarded rounds are released, charged and applied exactly
    as the same rounds without the guard."""
    unbounded = np.array([0.0] + [math.inf] * NOISE["iterations"])
    monkeypatch.setattr(IncaRounds, "ceilings", lambda self, n: unbounded)
    hist, trained, ledger = _run(tmp_path, rounds=3, max_epsilon=100.0)
    _, unguarded_trained, unguarded_ledger, _ = roomy
    assert sorted(trained) == [1, 2, 3] and hist.rounds_refused == 0
    assert [e.mu for e in ledger.entries] == [e.mu for e in unguarded_ledger.entries[:3]]
    assert all(np.array_equal(trained[r].update, unguarded_trained[r].update) for r in (1, 2, 3))


# ------------------------------------------------------------------------------ before a round
def test_a_budget_no_round_can_fit_stops_before_round_1_with_nothing_spent(tmp_path):
    """Every round costs mu >= 0.15; a budget for mu = 0.05: the run stops before round 1 (its own cost and
    its prediction do not fit), nothing charged, no ledger written, the initial model evaluated, and the
    message says what to change."""
    config = _config(tmp_path)
    predicted = _mixer(config).predicted_cost(24, config.privacy.budget_check_runs)
    budget = _epsilon(0.05)
    hist, trained, ledger = _run(tmp_path, max_epsilon=budget)
    assert hist.rounds == [] and trained == {} and hist.epsilon == 0 and ledger.rounds == 0
    assert not (tmp_path / "inca_ledger.json").exists()
    assert hist.stopped.startswith(
        f"stopping before round 1: it would bring epsilon from 0 to about {_epsilon(predicted):.4g} > "
        f"max_epsilon = {budget:.4g} (delta = 1.0e-05); its predicted cost is mu = {predicted:.4g}; nothing "
        "of it was released or charged. Not even one round at this noise fits the budget: raise max_epsilon, "
        "or add noise")
    with torch.random.fork_rng():
        torch.manual_seed(config.seed)
        initial = np.concatenate([p.detach().numpy().ravel() for p in MODEL().parameters()])
    assert np.array_equal(hist.parameters, initial) and hist.records[0].accuracy is not None


def test_a_budget_for_exactly_k_rounds_trains_k_rounds_then_stops_before_the_next(roomy, tmp_path,
                                                                                   monkeypatch):
    """A budget the first three rounds fit and the fourth does not (neither its own cost nor the
    prediction): three rounds train, the same as without a budget, and the run stops before round 4 with
    nothing of it charged, the final model evaluated. The prediction is asked for only where the round's
    own cost does not fit: once, for round 4."""
    k = 3
    unlimited, unlimited_trained, _, _ = roomy
    costs = [r.mu for r in unlimited.rounds]
    config = _config(tmp_path)
    predicted = _mixer(config).predicted_cost(24, config.privacy.budget_check_runs)
    spent = _epsilon(*costs[:k])
    limit = min(_epsilon(*costs[:k + 1]), _epsilon(*costs[:k], predicted))
    assert spent < limit
    calls = []
    _predict(monkeypatch, 1.0, calls)
    hist, trained, ledger = _run(tmp_path, max_epsilon=(spent + limit) / 2, eval_every=50)
    assert [r.round for r in hist.rounds] == [1, 2, 3] and sorted(trained) == [1, 2, 3]
    assert [r.accuracy is None for r in hist.rounds] == [True, True, False]  # the final model is evaluated
    assert hist.stopped.startswith(f"stopping before round 4: it would bring epsilon from {spent:.4g} to "
                                   f"about {_epsilon(*costs[:k], predicted):.4g}")
    assert "Not even one round" not in hist.stopped and hist.rounds_refused == 0
    assert [e.mu for e in ledger.entries] == [r.charged_mu for r in unlimited.rounds[:k]]
    assert calls == [24]  # predicted for round 4 only: the other rounds' own costs fit
    last = unlimited_trained[k]
    assert np.array_equal(hist.parameters, (last.params_before + last.update).astype(np.float32))


def test_a_round_whose_own_cost_fits_trains_even_if_its_prediction_would_not(roomy, tmp_path, monkeypatch):
    """The simulator knows a round's execution before it starts: a round whose own certified cost fits
    trains, whatever the prediction (scripted far above the budget), and the prediction is never asked."""
    unlimited = roomy[0]
    costs = [r.mu for r in unlimited.rounds[:3]]
    calls = []
    _predict(monkeypatch, 1e3, calls)
    hist, trained, _ = _run(tmp_path, rounds=3, max_epsilon=_epsilon(*costs) * (1 + 1e-6))
    assert sorted(trained) == [1, 2, 3] and not hist.stopped and calls == []


@pytest.mark.parametrize("seed", range(6))
def test_the_ledger_never_exceeds_max_epsilon_whatever_the_prediction(tmp_path, monkeypatch, seed):
    """Property: a random budget (log-uniform, from below one iteration's cost to several rounds), random
    outlier rounds (1.5 to 60 times their cost with their finals), a prediction off by a random factor (0:
    every round admitted) and a random refusal cap: every ledger entry and the total stay within max_epsilon,
    every round charged has its entry, and a refused round released nothing."""
    rng = np.random.default_rng(seed)
    budget = float(np.exp(rng.uniform(np.log(0.03), np.log(2.5))))
    _script_outliers(monkeypatch, set(rng.choice(np.arange(1, 9), size=3, replace=False).tolist()),
                     float(rng.choice([1.5, 4.0, 60.0])))
    _predict(monkeypatch, float(rng.choice([0.0, 0.5, 1.0])))
    cap = int(rng.integers(1, 4))
    hist, trained, ledger = _run(tmp_path, max_epsilon=budget, max_consecutive_refusals=cap)
    assert all(e.epsilon <= budget and e.status == "charged" for e in ledger.entries)
    assert ledger.epsilon() <= budget and hist.epsilon == pytest.approx(ledger.epsilon())
    assert [e.mu for e in ledger.entries] == [r.charged_mu for r in hist.rounds if r.charged_mu > 0]
    for record in hist.rounds:
        assert (record.round in trained) == (not record.refused)
        assert record.charged_mu <= charge_resolution(record.mu, RESOLUTION)  # never more than its whole cost
    assert len(hist.rounds) == 8 or hist.stopped  # it trained every round, or says why it stopped


# ------------------------------------------------------------------------------ one policy, two drivers
def test_the_strategy_and_the_simulator_certify_the_same_execution_the_same():
    """With the same settings, and the strategy seeded with ``IncaMixer.threat_seed(seed)``, IncaStrategy and
    the simulator draw the same adversaries: the same certificates of any execution (with every final, some,
    or none; every prefix), the same ceilings and the same prediction, bit for bit. Another seed draws others.
    """
    pytest.importorskip("flwr")
    from flwr_inca.flower import IncaStrategy

    privacy = PrivacyTarget(collusion=0.2, threat_draws=2, budget_check_runs=4)
    mixing = MixingConfig(**NOISE, dropout=PermanentDropout(0.15))
    config = SimulationConfig(privacy=privacy, mixing=mixing, seed=5, backend="inline", privacy_unit="party")
    mixer = _mixer(config)
    strategy = IncaStrategy(privacy=privacy, mixing=mixing, seed=IncaMixer.threat_seed(5), ledger_path=None)
    other = IncaStrategy(privacy=privacy, mixing=mixing, seed=5, ledger_path=None)
    assert strategy.privacy.sensitivity == 2.0
    differs = []
    for rnd in (1, 2, 9):
        trace = mixer.plan(rnd, 24).trace
        ours, theirs = strategy.inca.prefix(trace, rnd), mixer.rounds.prefix(trace, rnd)
        online = trace.steps[-1].online.tolist()
        for finals in (None, online[2:], []):
            assert ours.with_finals(finals) == theirs.with_finals(finals)
            assert ours.with_finals(finals).mu <= ours.with_finals().mu  # fewer finals never cost more
        assert [ours.through(t) for t in range(6)] == [theirs.through(t) for t in range(6)]
        differs.append(other.inca.prefix(trace, rnd).with_finals().mu != ours.with_finals().mu)
    assert any(differs)
    assert np.array_equal(strategy.inca.ceilings(24), mixer.rounds.ceilings(24))
    assert strategy.inca.predicted_mu(24) == mixer.predicted_cost(24, 4)


# ------------------------------------------------------------------------------ settings
def test_with_the_local_bound_the_prediction_is_the_bound_every_round_is_charged():
    mixer = _mixer(_config(None, certification="local-bound"))
    assert mixer.predicted_cost(24, 10) == 2.0 / 3.0 == mixer.plan(1, 24).mu
    assert mixer.predicted_cost(12, 10) == mixer.plan(2, 12).mu


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "10", None])
def test_bad_policy_settings_are_refused_naming_the_parameter(bad):
    with pytest.raises(ValueError, match=r"budget_check_runs .*must be an integer in \[1, 100000\], got"):
        SimulationConfig(budget_check_runs=bad)
    with pytest.raises(ValueError, match=r"max_consecutive_refusals .*must be an integer in \[1, 100000\], got"):
        SimulationConfig(max_consecutive_refusals=bad)


def test_a_tiny_budget_that_no_noise_can_reach_names_max_epsilon(tmp_path):
    config = SimulationConfig(rounds=5, max_epsilon=1e-4, backend="inline", output_dir=str(tmp_path), **NOISE)
    with pytest.raises(ValueError, match=r"^max_epsilon = 0.0001 is too small for 5 round\(s\) at delta = "
                                         r"1e-05: .*raise max_epsilon, or plan fewer rounds"):
        simulate(MODEL, PARTS, (XT, YT), config, progress=False)


def test_a_prediction_at_the_papers_calibration_scales_when_the_target_moves(monkeypatch):
    """The paper's procedure is calibrated per target but keeps sigma_star / sigma_delta fixed (to ~1e-6):
    after a retarget, the prediction made at the old target, scaled by the sigmas (no execution simulated
    again), is what a fresh prediction at the new target gives."""
    import flwr_inca.rounds
    from flwr_inca.privacy.calibration import NoiseCalibrator

    predictions = []
    predict = flwr_inca.rounds.predicted_round_mu

    def counted(*args, **kwargs):
        predictions.append(args[0])
        return predict(*args, **kwargs)

    monkeypatch.setattr(flwr_inca.rounds, "predicted_round_mu", counted)

    calibrator = NoiseCalibrator(iterations=8, neighbors=1, collusion=0.1, dropout=PermanentDropout(0.1), runs=6,
                                 seed=2, procedure="paper")
    privacy = PrivacyTarget(collusion=0.1, budget_check_runs=4)
    mixing = MixingConfig(iterations=8, dropout=PermanentDropout(0.1))

    def rounds(target):
        return IncaRounds(privacy, mixing, seed=3, value_sensitivity=1.0, mu_target=target, calibrator=calibrator)

    moving = rounds(0.05)
    first = moving.predicted_mu(40)
    for target in (0.08, 0.03):
        moving.retarget(target)
        predictions.clear()
        scaled = moving.predicted_mu(40)
        assert predictions == []  # scaled, not simulated again
        assert scaled == pytest.approx(rounds(target).predicted_mu(40), rel=1e-5) and predictions == [40]
        assert scaled != pytest.approx(first, rel=1e-2)
        predictions.clear()
        assert moving.predicted_mu(38) == scaled and predictions == []  # it serves a nearby party count too


def test_the_papers_calibration_never_takes_a_share_its_classic_bound_cannot_serve():
    """Spending what is left can ask a round for a per-round epsilon above 1 (the last rounds of a budget
    left largely unspent); the paper's procedure (classic bound, epsilon < 1) is then retargeted to the
    largest share it can serve, and the rest of the budget stays unspent, instead of failing the run."""
    from flwr_inca.privacy.calibration import NoiseCalibrator
    from flwr_inca.privacy.conversions import epsilon_for_delta

    privacy = PrivacyTarget(collusion=0.1, budget_check_runs=2, max_epsilon=4.0)
    mixing = MixingConfig(iterations=8, dropout=PermanentDropout(0.1))
    paper = NoiseCalibrator(iterations=8, neighbors=1, collusion=0.1, dropout=PermanentDropout(0.1), runs=4, seed=2,
                            procedure="paper")
    rounds = IncaRounds(privacy, mixing, seed=3, value_sensitivity=1.0, mu_target=0.05, calibrator=paper)
    ledger = PrivacyLedger(None, delta=privacy.delta, max_epsilon=4.0)
    target = rounds.spend_what_is_left(ledger, rounds_left=1, n=30)  # all of epsilon = 4 in one round
    assert target == rounds.largest_target() < math.inf
    served = target * (1.0 - privacy.calibration_margin)
    assert 0.999 < epsilon_for_delta(served, privacy.delta) < 1.0
    assert all(s > 0 for s in rounds.sigmas(30))  # calibrated: the classic bound holds there
    exact = IncaRounds(privacy, mixing, seed=3, value_sensitivity=1.0, mu_target=0.05,
                       calibrator=NoiseCalibrator(iterations=8, neighbors=1, collusion=0.1,
                                                  dropout=PermanentDropout(0.1), runs=4, seed=2))
    assert exact.largest_target() == math.inf and exact.spend_what_is_left(ledger, rounds_left=1, n=30) > 2 * target

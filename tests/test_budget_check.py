"""The pre-round budget check (flwr_inca.privacy.budget_check), one rule for IncaStrategy and the simulator.

Before a round, its cost is predicted (the worst certified mu over ``budget_check_runs`` simulated
executions); if the ledger's epsilon after it exceeds the budget, training stops before the round with
nothing charged. The simulator evaluates it for a round whose own execution does not fit (the only rounds
where it can differ from a run without it), so a budget that no round can fit stops before round 1 with
nothing spent (it used to make up to max_consecutive_refusals no-finals charges), a budget for k rounds
trains k rounds and stops cleanly, and a run in which every round fits is unchanged.
"""

import functools
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from synthetic import CLASSES, FEATURES, linear_task

from flwr_inca.privacy import PrivacyLedger, certification_views, certify
from flwr_inca.privacy.budget_check import (
    RoundBudgetCheck,
    check_round_budget,
    predicted_round_mu,
    prediction_seeds,
)
from flwr_inca.privacy.plan import privacy_plan
from flwr_inca.protocol.config import IncaConfig
from flwr_inca.protocol.dropout import PermanentDropout
from flwr_inca.protocol.engine import sample_trace
from flwr_inca.simulation import IncaMixer, MixContext, SimulationConfig, iid, simulate
from flwr_inca.simulation.baseline_mixers import GOPAMixer
from flwr_inca.simulation.runner import _pre_round_stop, charge_resolution

X, Y = linear_task(960)
XT, YT = linear_task(300, seed=1)
MODEL = functools.partial(torch.nn.Linear, FEATURES, CLASSES)
PARTS = iid(X, Y, 24)
NOISE = {"sigma_star": 3.0, "sigma_delta": 20.0, "iterations": 5}  # a round certifies at mu = 0.16-0.18 here
D = FEATURES * CLASSES + CLASSES


def _config(out, **kw):
    return SimulationConfig(**{"rounds": 8, "epsilon": 3.0, **NOISE, "backend": "inline", "privacy_unit": "party",
                               "output_dir": str(out), **kw})


def _run(out, **kw):
    trained = {}
    hist = simulate(MODEL, PARTS, (XT, YT), _config(out, **kw), progress=False,
                    on_round=lambda c: trained.__setitem__(c.round, c))
    return hist, trained, PrivacyLedger(out / "ledger.json", delta=1e-5, accountant="exact")


def _mixer(seed=0, **kw):
    """The simulator's IncaMixer for these runs (value sensitivity 2C = 2 at party level)."""
    mixer = IncaMixer(**{**NOISE, **kw})
    mixer.prepare(MixContext(2.0, None, 1e-5, 24, D, seed))
    return mixer


def _after(charges, mu):
    """epsilon (exact GDP composition, delta = 1e-5) after ``charges`` and one more round of ``mu``."""
    probe = PrivacyLedger(None, delta=1e-5, accountant="exact")
    for c in charges:
        probe.spend(c)
    return probe.epsilon_after(mu)


def _initial_params():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = MODEL()
    return np.concatenate([p.detach().numpy().ravel() for p in model.parameters()]).astype(np.float32)


# ------------------------------------------------------------------------------------------ the simulator
@pytest.mark.parametrize("guard", [True, False])
def test_a_budget_no_round_can_fit_stops_before_round_1_with_nothing_spent(tmp_path, guard):
    """Was: round 1 refused and charged what it revealed, then again, up to three charges."""
    predicted = charge_resolution(_mixer().predicted_cost(24, 10), 0.005)
    budget = _after([], 0.05)  # every round certifies at mu >= 0.16
    hist, trained, ledger = _run(tmp_path, epsilon=budget, reserve_stopped_round=guard)
    assert hist.rounds == [] and trained == {} and hist.epsilon == 0
    assert ledger.rounds == 0 and not (tmp_path / "ledger.json").exists()  # nothing charged
    assert hist.stopped.startswith(
        f"stopping before round 1: it would bring epsilon from 0 to about {_after([], predicted):.4g} > "
        f"max_epsilon = {budget:.4g} (delta = 1.0e-05): its predicted cost, the worst certified mu over 10 "
        "simulated execution(s) of its 24 participants")
    assert "nothing of round 1 was released or charged. Not even one round at this noise fits the budget: raise " \
           "epsilon, or add noise" in hist.stopped
    assert np.array_equal(hist.parameters, _initial_params())  # the model is the initial one, evaluated
    assert hist.records[0].accuracy is not None


def test_a_budget_for_exactly_k_rounds_trains_k_rounds_then_stops_before_the_next(tmp_path):
    """Was: round k + 1 refused and charged its no-finals certificate, then k + 2 and k + 3."""
    k = 3
    roomy, roomy_trained, _ = _run(tmp_path / "roomy", rounds=k + 1, epsilon=100.0)
    charged = [r.charged_mu for r in roomy.rounds]
    predicted = charge_resolution(_mixer().predicted_cost(24, 10), 0.005)
    spent = _after(charged[: k - 1], charged[k - 1])
    limit = min(_after(charged[:k], charged[k]), _after(charged[:k], predicted))  # round k + 1 fits neither way
    budget = spent + (limit - spent) / 2
    hist, trained, ledger = _run(tmp_path / "k", rounds=8, epsilon=budget, eval_every=50)
    assert [r.round for r in hist.rounds] == list(range(1, k + 1)) and sorted(trained) == list(range(1, k + 1))
    assert [r.accuracy is None for r in hist.rounds] == [True] * (k - 1) + [False]  # the final model is evaluated
    assert hist.rounds_refused == 0 and hist.rounds_trained == k
    assert hist.stopped.startswith(f"stopping before round {k + 1}: it would bring epsilon from {spent:.4g} to about "
                                   f"{_after(charged[:k], predicted):.4g} > max_epsilon = {budget:.4g}")
    assert "Not even one round" not in hist.stopped  # this run trained rounds: no hint needed
    assert [e.mu for e in ledger.entries] == charged[:k] and ledger.epsilon() == pytest.approx(spent)
    last = roomy_trained[k]  # the same k rounds as the roomy run, and the model after them
    assert np.array_equal(hist.parameters, (last.params_before + last.update).astype(np.float32))


def test_a_round_whose_execution_fits_is_trained_as_before_even_if_the_prediction_would_not_fit(tmp_path):
    """The simulator checks only rounds whose execution does not fit: a run changes only where the run without
    the check would have charged a refused round (IncaStrategy, which cannot see the execution before it
    runs, would stop before such a round)."""
    roomy, _, _ = _run(tmp_path / "roomy", rounds=8, epsilon=100.0)
    charged = [r.charged_mu for r in roomy.rounds]
    predicted = charge_resolution(_mixer().predicted_cost(24, 10), 0.005)
    j = next(j for j in range(1, 8) if charged[j] < predicted)  # 0-based: round j + 1 certifies below the prediction
    low, high = _after(charged[:j], charged[j]), _after(charged[:j], predicted)
    budget = (low + high) / 2  # round j + 1's execution fits, its prediction does not
    hist, trained, ledger = _run(tmp_path / "b", rounds=j + 1, epsilon=budget)
    assert sorted(trained) == list(range(1, j + 2)) and not hist.stopped and hist.rounds_refused == 0
    assert [e.mu for e in ledger.entries] == charged[: j + 1]


def test_an_outlier_execution_the_prediction_fits_is_still_refused_and_skipped(tmp_path):
    """The prediction fits, the round's execution does not (an outlier): it starts, is refused as it runs,
    charged what it revealed and skipped, and training goes on (tests/test_refused_rounds.py)."""

    class Outlier(IncaMixer):
        def plan(self, round, participants):
            plan = super().plan(round, participants)
            if round == 2:
                plan.mu *= 60
            return plan

    trained = {}
    hist = simulate(MODEL, PARTS, (XT, YT), _config(tmp_path, rounds=4), mixer=Outlier(**NOISE), progress=False,
                    on_round=lambda c: trained.__setitem__(c.round, c))
    assert not hist.stopped and hist.rounds_refused == 1 and hist.rounds[1].refused and sorted(trained) == [1, 3, 4]


def test_gopa_stops_before_a_round_it_cannot_afford_with_nothing_spent(tmp_path):
    """Without the guard a refused GOPA round is charged what it published; the pre-round check stops first."""
    options = {"neighbors": 4, "gamma": 0.25, "gamma_rollback": 0.125}
    mixer = GOPAMixer(sigma_star=3.0, sigma_delta=8.0, **options)
    mixer.prepare(MixContext(2.0, None, 1e-5, 24, D, 0))
    predicted = mixer.predicted_cost(24, 10)
    assert predicted == mixer.predicted_cost(24, 10) > 0
    budget = _after([], predicted / 3)
    config = SimulationConfig(rounds=5, mode="gopa", epsilon=budget, sigma_star=3.0, sigma_delta=8.0, backend="inline",
                              privacy_unit="party", output_dir=str(tmp_path), mixer_options=options,
                              reserve_stopped_round=False)
    hist = simulate(MODEL, PARTS, (XT, YT), config, progress=False)
    assert hist.rounds == [] and hist.stopped.startswith("stopping before round 1: it would bring epsilon from 0")
    assert not (tmp_path / "ledger.json").exists()


def test_with_the_local_bound_the_prediction_is_the_bound_every_round_is_charged():
    mixer = _mixer(certification="local-bound")
    assert mixer.predicted_cost(24, 10) == 2.0 / 3.0 == mixer.plan(1, 24).mu
    assert mixer.predicted_cost(12, 10) == mixer.plan(2, 12).mu


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "10", None])
def test_bad_budget_check_runs_are_refused_naming_the_parameter(bad):
    with pytest.raises(ValueError, match=r"budget_check_runs .*must be an integer >= 1, got"):
        SimulationConfig(budget_check_runs=bad)


def test_a_tiny_epsilon_that_no_noise_can_reach_names_epsilon(tmp_path):
    config = SimulationConfig(rounds=5, epsilon=1e-4, backend="inline", output_dir=str(tmp_path), **NOISE)
    with pytest.raises(ValueError, match=r"^epsilon = 0.0001 is too small for 5 round\(s\) at delta = 1e-05: .*raise "
                                         r"epsilon, or plan fewer rounds"):
        simulate(MODEL, PARTS, (XT, YT), config, progress=False)


# ------------------------------------------------------------------------------------------ one rule, two adapters
@pytest.mark.parametrize("side", [-1, 1])
def test_the_strategy_and_the_simulator_decide_alike_on_the_same_ledger(tmp_path, side):
    """The same settings and seed give the same prediction, and on the same ledger the same decision and
    numbers: IncaStrategy's configure_train check and the simulator's, through the shared function."""
    pytest.importorskip("flwr")
    from flwr.app import ArrayRecord

    from flwr_inca.flower import IncaBudgetExhausted, IncaStrategy

    mixer = _mixer(seed=5, dropout=PermanentDropout(0.1), threat_draws=2)
    strategy_seed = IncaMixer.threat_seed(5)  # the simulator draws its adversaries and predictions from it
    path = tmp_path / "ledger.json"
    spends = PrivacyLedger(path, delta=1e-5, accountant="exact")
    for mu in (0.17, 0.16):
        spends.spend(mu)
    predicted = mixer.predicted_cost(24, 10)
    threshold = spends.epsilon_after(predicted)
    budget = threshold * (1 + side * 1e-6)  # just below (the round does not fit) or just above (it does)
    strategy = IncaStrategy(sigma_star=3.0, sigma_delta=20.0, iterations=5, neighbors=1, collusion=0.1,
                            threat_draws=2, budget_check_runs=10, calibration_dropout=PermanentDropout(0.1),
                            value_sensitivity=2.0, max_epsilon=budget, ledger_path=str(path), seed=strategy_seed)
    assert strategy.predicted_mu(24) == predicted  # bit for bit
    config = _config(tmp_path, epsilon=budget, mu_resolution=0.0, budget_check_runs=10)
    plan = privacy_plan("party", epsilon=budget, delta=1e-5, rounds=8, clip_norm=1.0)
    ledger = PrivacyLedger(path, delta=1e-5, max_epsilon=budget, accountant="exact")
    simulator = _pre_round_stop(3, 24, mixer, ledger, plan, config, resumed=2)
    shared = check_round_budget(ledger, 3, lambda: predicted)
    try:
        strategy._check_budget(3, 24, ArrayRecord())
        stop = None
    except IncaBudgetExhausted as exc:
        stop = exc
    assert shared.fits == (side > 0) == (stop is None) == (simulator == "")
    if stop is not None:
        assert str(stop) == f"IncA: {shared.reason}" and simulator.startswith(f"{shared.reason}: its predicted cost")
        assert stop.predicted_epsilon == shared.predicted_epsilon == threshold and stop.epsilon == shared.epsilon
        assert "The ledger" in simulator and "holds the privacy spent by earlier runs" in simulator


# ------------------------------------------------------------------------------------------ the shared function
def test_the_prediction_is_the_worst_certificate_over_the_sampled_executions():
    """Recomputed independently: each run's trace sampled from its seed, certified with certify() on the
    round's adversaries (certification_views), the worst kept."""
    config = IncaConfig(sigma_star=1.5, sigma_delta=9.0, iterations=4, neighbors=2,
                        dropout=PermanentDropout(0.2))
    seeds = prediction_seeds(11, 15)
    got = predicted_round_mu(15, config, seeds, 5, threat_draws=2, collusion=0.2, value_sensitivity=0.5)
    worst = 0.0
    for run in np.random.SeedSequence(11, spawn_key=(1, 15)).spawn(5):
        execution, threat = run.spawn(2)
        trace = sample_trace(15, config, seed=int(execution.generate_state(1, np.uint64)[0]))
        for view in certification_views(trace, threat, 2, collusion=0.2):
            worst = max(worst, certify(trace, view, value_sensitivity=0.5).max_mu)
    assert got == pytest.approx(worst, rel=1e-8) and got >= worst
    assert predicted_round_mu(15, config, seeds, 5, threat_draws=2, collusion=0.2, value_sensitivity=0.5) == got
    fewer = predicted_round_mu(15, config, seeds, 2, threat_draws=2, collusion=0.2, value_sensitivity=0.5)
    assert 0 < fewer <= got  # the first runs of the same seeds


def test_check_round_budget_predicts_only_when_needed_and_decides_by_the_ledger():
    calls = []

    def predict(mu):
        return lambda: calls.append(mu) or mu

    unlimited = PrivacyLedger(None, delta=1e-5, accountant="exact")
    assert check_round_budget(unlimited, 1, predict(5.0)).fits and calls == []
    ledger = PrivacyLedger(None, delta=1e-5, max_epsilon=2.0, accountant="exact")
    ledger.spend(0.3)
    for mu in (0.1, 0.5, 1.0, 3.0):
        check = check_round_budget(ledger, 2, predict(mu))
        assert check.predicted_epsilon == ledger.epsilon_after(mu) and check.predicted_mu == mu
        assert check.fits == (ledger.epsilon_after(mu) <= 2.0)
        assert (check.reason == "") == check.fits
    assert calls == [0.1, 0.5, 1.0, 3.0]
    ledger.spend(5.0, force=True)  # overrun (guard off): no prediction needed, training stops
    over = check_round_budget(ledger, 3, predict(0.1))
    assert not over.fits and math.isinf(over.predicted_epsilon) and calls == [0.1, 0.5, 1.0, 3.0]
    assert over.reason.startswith("stopping before round 3: the certified cost of the rounds so far brought epsilon")
    assert RoundBudgetCheck(1, 0.0, 0.2, 1.5, 1.5, 1e-5).fits and not RoundBudgetCheck(1, 0.0, 0.2, 1.5, 1.4, 1e-5).fits

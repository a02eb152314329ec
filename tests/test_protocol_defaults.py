"""The drivers' protocol defaults: ``iterations="auto"`` (T chosen for the expected dropouts) and the
``"auto"`` schedule (D_Inc with a value-free tail), in the rule itself, the simulator, ``IncaStrategy``
and the command line."""

from __future__ import annotations

import functools
import re
from dataclasses import replace

import numpy as np
import pytest

from flwr_inca import IncaConfig, InjectionSchedule, PermanentDropout, replay
from flwr_inca.privacy.conversions import mu_for_epsilon
from flwr_inca.protocol import sample_trace
from flwr_inca.protocol.dropout import NoDropout
from flwr_inca.protocol.schedules import recommended_tail
from flwr_inca.rounds import (
    ITERATION_CANDIDATES,
    SCREEN_MARGIN,
    IncaRounds,
    choose_iterations,
    dropout_noise_share,
    noise_calibrator,
    sampled_executions,
)
from flwr_inca.settings import MixingConfig, PrivacyTarget

PRIVACY = PrivacyTarget(round_epsilon=1.0, calibration_runs=2, collusion=0.1)
DROPOUT = PermanentDropout(0.2)
MU = mu_for_epsilon(1.0, 1e-5)


def test_the_auto_schedule_is_the_value_free_tail_of_recommended_length():
    assert [recommended_tail(T) for T in range(1, 13)] == [0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 3]
    for T in (1, 4, 10, 40):
        auto = InjectionSchedule.resolve("auto", T)
        tail = InjectionSchedule.incremental(T, tail=recommended_tail(T))
        assert np.array_equal(auto.c, tail.c) and np.array_equal(auto.Z, tail.Z) and auto.name == tail.name
    auto = InjectionSchedule.resolve("auto", 10)
    assert auto.name == "incremental:tail=3" and np.all(auto.c[-3:] == 0) and auto.c.sum() == pytest.approx(1.0)
    assert MixingConfig().schedule == "auto" and MixingConfig().iterations == "auto"
    config = IncaConfig(iterations=10, schedule=MixingConfig().schedule, sigma_star=1.0, sigma_delta=1.0)
    assert config.resolved_schedule().name == auto.name


@pytest.mark.timeout(60)
def test_the_uncancelled_share_is_what_the_engine_leaves_in_its_output():
    """Independent check: the engine's output on zero values, its noise measured over 20,000 coordinates,
    once with only the central terms and once with only the cancelling ones."""
    config = IncaConfig(iterations=6, neighbors=1, sigma_star=0.3, sigma_delta=2.0, dropout=PermanentDropout(0.25))
    trace = next(t for s in range(50) if (t := sample_trace(24, config, seed=s)).steps[-1].online.size < 24)
    zeros = np.zeros((trace.parties, 20_000))
    central = np.var(replay(replace(trace, sigma_delta=0.0), zeros, seed=1).estimate)
    uncancelled = np.var(replay(replace(trace, sigma_star=0.0), zeros, seed=2).estimate)
    assert uncancelled > 0
    assert dropout_noise_share([trace]) == pytest.approx(uncancelled / central, rel=0.05)
    no_dropout = sample_trace(24, replace(config, dropout=None), seed=0)
    assert dropout_noise_share([no_dropout]) == pytest.approx(0.0, abs=1e-20)


@pytest.mark.timeout(120)
def test_auto_takes_the_fewest_candidate_within_its_aim_else_the_largest_allowed():
    n = 30
    mixing = MixingConfig(dropout=DROPOUT, max_iterations=40)
    choice = choose_iterations(PRIVACY, mixing, n, mu_target=MU, value_sensitivity=1.0, seed=4)
    assert list(choice.shares) == [t for t in ITERATION_CANDIDATES if t <= 40][: len(choice.shares)]
    # each share is that of the rounds a training at that T runs (its own calibration, its own executions),
    # or for a screened T that of a calibration over its first runs, which already misses the aim
    for T, share in choice.shares.items():
        rounds = IncaRounds(PRIVACY, replace(mixing, iterations=T), seed=4, value_sensitivity=1.0, mu_target=MU)
        full = dropout_noise_share(sampled_executions(rounds.config(n), n, 4))
        if T in choice.screened:
            assert share > SCREEN_MARGIN * mixing.dropout_noise_share and full > mixing.dropout_noise_share
        else:
            assert full == pytest.approx(share, rel=1e-12)
    unscreened = choose_iterations(PRIVACY, mixing, n, mu_target=MU, value_sensitivity=1.0, seed=4, screen=False)
    assert unscreened.iterations == choice.iterations and not unscreened.screened
    within = [T for T, share in choice.shares.items() if share <= mixing.dropout_noise_share]
    assert choice.iterations == (within[0] if within else 40) and (not within or within[0] == max(choice.shares))
    # the chosen T's calibrator holds the calibration made for the choice (a training reuses it)
    assert any(key[0] == n for key in choice.calibrator.calibrations)
    assert choice.calibrator.settings["iterations"] == choice.iterations
    generous = choose_iterations(PRIVACY, replace(mixing, dropout_noise_share=1e6), n, mu_target=MU,
                                 value_sensitivity=1.0, seed=4)
    assert generous.iterations == 10 and list(generous.shares) == [10]
    strict = choose_iterations(PRIVACY, replace(mixing, dropout_noise_share=1e-9, max_iterations=20), n,
                               mu_target=MU, value_sensitivity=1.0, seed=4)
    assert strict.iterations == 20 and list(strict.shares) == [10, 20]
    assert "aim is not reached within max_iterations = 20" in strict.describe(1)
    assert "T = 20 (21 messages per party per round)" in strict.describe(1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("gamma", [0.1, 0.3])
def test_screening_chooses_what_full_calibrations_of_every_candidate_choose(gamma, monkeypatch):
    from flwr_inca.privacy import calibration

    privacy = replace(PRIVACY, calibration_runs=10)
    mixing = MixingConfig(dropout=PermanentDropout(gamma), max_iterations=40)
    screened = choose_iterations(privacy, mixing, 60, mu_target=MU, value_sensitivity=1.0, seed=7)
    full = choose_iterations(privacy, mixing, 60, mu_target=MU, value_sensitivity=1.0, seed=7, screen=False)
    assert screened.screened, "this setting is meant to pass a candidate over on its screen"
    assert screened.iterations == full.iterations
    assert all(T not in screened.shares or screened.shares[T] == full.shares[T]
               for T in set(full.shares) - set(screened.screened))
    assert "screened over 2 of the calibration runs" in screened.describe(1)
    # the chosen T's calibrator is the full one (every run), whatever was screened
    assert screened.calibrator.settings["runs"] == 10
    # shared calibrators (a study's) keep their screens: a second choice calibrates nothing new
    shared: dict[int, object] = {}

    def calibrators(T):
        return shared.setdefault(T, noise_calibrator(privacy, mixing, T, seed=7))

    first = choose_iterations(privacy, mixing, 60, mu_target=MU, value_sensitivity=1.0, seed=7,
                              calibrators=calibrators)
    made = []
    monkeypatch.setattr(calibration, "calibrate", lambda *a, **k: made.append(k) or pytest.fail("calibrated again"))
    again = choose_iterations(privacy, mixing, 60, mu_target=MU, value_sensitivity=1.0, seed=7,
                              calibrators=calibrators)
    assert again == first and again.screened == screened.screened and not made


def test_auto_without_dropouts_or_with_given_noise_is_ten_iterations_without_calibrating(monkeypatch):
    import flwr_inca.rounds as rounds_module

    def fail(*args, **kwargs):
        raise AssertionError("nothing should be calibrated")

    monkeypatch.setattr(rounds_module, "noise_calibrator", fail)
    quiet = choose_iterations(PRIVACY, MixingConfig(), 50, mu_target=MU, value_sensitivity=1.0, seed=0)
    assert quiet.iterations == 10 and quiet.shares == {} and "no dropouts expected" in quiet.describe(1)
    none = choose_iterations(PRIVACY, MixingConfig(dropout=NoDropout()), 50, mu_target=MU, value_sensitivity=1.0,
                             seed=0)
    assert none.iterations == 10 and none.shares == {} and "no dropouts expected" in none.describe(1)
    given = choose_iterations(PRIVACY, MixingConfig(sigma_star=1.0, sigma_delta=3.0, dropout=DROPOUT), 50,
                              mu_target=None, value_sensitivity=1.0, seed=0)
    assert given.iterations == 10 and "the noise is given" in given.describe(2)
    assert choose_iterations(PRIVACY, MixingConfig(max_iterations=5), 50, mu_target=MU, value_sensitivity=1.0,
                             seed=0).iterations == 5


@pytest.mark.timeout(120)
def test_the_simulator_chooses_once_notes_it_and_counts_each_rounds_messages():
    torch = pytest.importorskip("torch")
    from synthetic import CLASSES, FEATURES, linear_task

    from flwr_inca.simulation import SimulationConfig, iid, simulate

    x, y = linear_task(600)
    config = SimulationConfig(rounds=2, backend="inline", calibration_runs=2, max_epsilon=2.0, lr=2.0,
                              dropout=DROPOUT, max_iterations=20, dropout_noise_share=1e-9)
    history = simulate(functools.partial(torch.nn.Linear, FEATURES, CLASSES), iid(x[:480], y[:480], 24),
                       (x[480:], y[480:]), config, progress=False)
    note = next(n for n in history.notes if n.startswith("iterations='auto' chose"))
    assert "T = 20 (21 messages per party per round)" in note
    for record in history.rounds:
        # T k messages from those online at each iteration, and the finals: at most T + 1 each, fewer with dropouts
        assert 1.0 < record.messages < 21.0
    again = simulate(functools.partial(torch.nn.Linear, FEATURES, CLASSES), iid(x[:480], y[:480], 24),
                     (x[480:], y[480:]), config.replace(dropout=None), progress=False)
    assert any("chose T = 10" in n for n in again.notes)
    assert all(r.messages == pytest.approx(11.0) for r in again.rounds)  # nobody drops out: T k + 1


@pytest.mark.timeout(120)
def test_incastrategy_chooses_by_the_same_rule_at_its_first_round(task_identity):
    pytest.importorskip("flwr")
    from flwr.app import ArrayRecord, ConfigRecord

    import flower_apps
    from inprocess_grid import InProcessGrid

    from flwr_inca.flower import IncaStrategy

    nodes = 6
    strategy = IncaStrategy(round_epsilon=1.0, calibration_runs=2, dropout=DROPOUT, max_iterations=20,
                            dropout_noise_share=1e-9, seed=3, ledger_path=None, min_available_nodes=nodes,
                            min_train_nodes=nodes, fraction_evaluate=0.0, precision="float64")
    grid = InProcessGrid(flower_apps.client, nodes)
    model = ArrayRecord([np.full(4, 0.5, dtype=np.float32)])
    replies = list(grid.send_and_receive(strategy.configure_train(1, model, ConfigRecord(), grid)))
    strategy.aggregate_train(1, replies)
    expected = choose_iterations(strategy.privacy, replace(strategy.mixing, iterations="auto"), nodes,
                                 mu_target=mu_for_epsilon(1.0, 1e-5), value_sensitivity=strategy.privacy.sensitivity,
                                 seed=3)
    assert strategy.mixing.iterations == expected.iterations == 20
    assert max(grid.commits(1)) == 21  # the finals of T = 20 were asked for
    assert strategy.rounds[1].trace.schedule.name == "incremental:tail=3"


def test_the_command_line_takes_auto_or_a_number():
    from flwr_inca.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["simulate"])
    assert (args.iterations, args.schedule, args.max_iterations) == ("auto", "auto", 40)
    args = parser.parse_args(["simulate", "--iterations", "20", "--schedule", "incremental:tail=2"])
    assert (args.iterations, args.schedule) == (20, "incremental:tail=2")
    assert re.search(r"auto", parser.parse_args(["calibrate"]).schedule)

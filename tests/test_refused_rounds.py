"""One outlier execution must not stop training (the simulator): a round the budget refuses is skipped.

A fresh IncA execution now and then certifies far above the others (the n = 100 study at gamma = 0.3: round
18 at mu = 1.36 against 0.78-0.98). The pre-final rule / budget guard refuses it and charges what its mixing
revealed (its no-finals certificate); then the round is skipped, the model is unchanged, and training
goes on with the next round's fresh execution. Training stops only after ``max_consecutive_refusals``
refused rounds in a row, when none of a refused round's messages was delivered, or when the guard is off
and the charge went past the budget.

``OutlierInca`` is the real IncaMixer (traces, noise, certificates, guard) whose chosen rounds certify
``factor`` times their real cost: what an outlier execution looks like to the runner.
"""

import csv
import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from synthetic import CLASSES, FEATURES, linear_task

from flwr_inca.privacy import PrivacyLedger, certify, random_collusion
from flwr_inca.protocol.trace import ExecutionTrace
from flwr_inca.simulation import History, IncaMixer, SimulationConfig, iid, simulate
from flwr_inca.simulation.runner import charge_resolution

X, Y = linear_task(960)
XT, YT = linear_task(300, seed=1)
MODEL = functools.partial(torch.nn.Linear, FEATURES, CLASSES)
PARTS = iid(X, Y, 24)
NOISE = {"sigma_star": 3.0, "sigma_delta": 20.0, "iterations": 5}  # a round certifies at mu = 0.16-0.18 here


class OutlierInca(IncaMixer):
    """IncaMixer whose rounds in ``outliers`` certify ``factor`` times their real cost."""

    def __init__(self, outliers=(), factor=60.0, **kw):
        super().__init__(**{**NOISE, **kw})
        self.outliers, self.factor = set(outliers), float(factor)

    def plan(self, round, participants):
        plan = super().plan(round, participants)
        if round in self.outliers:
            plan.mu *= self.factor
        return plan


def _config(out, **kw):
    return SimulationConfig(**{"rounds": 8, "epsilon": 3.0, **NOISE, "backend": "inline", "privacy_unit": "party",
                               "output_dir": str(out), "save_traces": True, **kw})


def _run(out, outliers, factor=60.0, **kw):
    trained = {}
    hist = simulate(MODEL, PARTS, (XT, YT), _config(out, **kw), mixer=OutlierInca(outliers, factor), progress=False,
                    on_round=lambda c: trained.__setitem__(c.round, c))
    return hist, trained, PrivacyLedger(out / "ledger.json", delta=1e-5, accountant="exact")


def _no_finals_mu(trace, config, rnd):
    """A refused round's cost, recomputed independently: the same coalitions, no final observed (S = 2)."""
    root = np.random.SeedSequence(IncaMixer.threat_seed(config.seed), spawn_key=(0, rnd))
    keys = [int(d.generate_state(1, np.uint64)[0]) for d in root.spawn(config.threat_draws)]
    views = [random_collusion(trace, config.collusion, key, finals=()) for key in keys]
    return max(certify(trace, view, value_sensitivity=2.0).max_mu for view in views)


def test_an_outlier_round_in_the_middle_is_skipped_and_later_rounds_train(tmp_path):
    hist, trained, ledger = _run(tmp_path, {3})
    config = _config(tmp_path)
    # every round ran; round 3 was refused, skipped and charged; the others trained
    assert [r.round for r in hist.rounds] == list(range(1, 9)) and not hist.stopped
    assert (hist.rounds_trained, hist.rounds_refused) == (7, 1)
    skipped = hist.rounds[2]
    assert skipped.refused and skipped.failed.startswith("skipped, refused by the budget: stopped before its final")
    assert sorted(trained) == [1, 2, 4, 5, 6, 7, 8] and all(not r.refused for r in hist.rounds if r.round != 3)
    # the model is unchanged by round 3: round 4 trained from the model after round 2
    after_2 = (trained[2].params_before + trained[2].update).astype(np.float32)
    assert np.array_equal(trained[4].params_before, after_2)
    last = trained[8]
    assert np.array_equal(hist.parameters, (last.params_before + last.update).astype(np.float32))
    # every round is in the ledger; the skipped one at exactly its no-finals certificate
    assert ledger.rounds == 8
    entry = ledger.entries[2]
    assert entry.note == "round 3: stopped before its final messages"
    trace = ExecutionTrace.load(tmp_path / "traces" / "round-0003.json")
    without = _no_finals_mu(trace, config, 3)
    assert entry.mu == skipped.charged_mu == charge_resolution(without, config.mu_resolution)
    assert 0 < entry.mu < skipped.mu / 3
    for record, e in zip(hist.rounds, ledger.entries):
        assert e.epsilon == pytest.approx(record.epsilon) and e.epsilon <= 3.0
    assert hist.epsilon == pytest.approx(ledger.epsilon())
    # the history's files say it too
    with (tmp_path / "history.csv").open() as f:
        saved = list(csv.DictReader(f))
    assert [row["refused"] for row in saved] == ["False"] * 3 + ["True"] + ["False"] * 5  # round 0 first
    assert History.load(tmp_path / "history.json").rounds_refused == 1


def test_the_consecutive_cap_stops_training_with_a_clear_message(tmp_path):
    hist, trained, ledger = _run(tmp_path / "a", {3, 4, 5})
    assert [r.round for r in hist.rounds] == [1, 2, 3, 4, 5] and sorted(trained) == [1, 2]
    assert hist.stopped.startswith("3 round(s) in a row were refused by the budget (max_consecutive_refusals = 3): "
                                   "training stops after round 5; round 5 stopped before its final messages")
    assert ledger.rounds == 5 and [e.note for e in ledger.entries[2:]] == [
        f"round {r}: stopped before its final messages" for r in (3, 4, 5)]
    # refusals that are not in a row do not add up; a larger cap lets the same run go on
    apart, trained, _ = _run(tmp_path / "b", {2, 4, 6, 7})
    assert not apart.stopped and apart.rounds_refused == 4 and sorted(trained) == [1, 3, 5, 8]
    roomy, trained, _ = _run(tmp_path / "c", {3, 4, 5}, max_consecutive_refusals=4)
    assert not roomy.stopped and roomy.rounds_refused == 3 and sorted(trained) == [1, 2, 6, 7, 8]
    # 1: the behaviour before skipping (training stops at the first refused round)
    first, trained, _ = _run(tmp_path / "d", {3}, max_consecutive_refusals=1)
    assert [r.round for r in first.rounds] == [1, 2, 3] and "max_consecutive_refusals = 1" in first.stopped


@pytest.mark.parametrize("seed", range(4))
def test_with_the_guard_the_ledger_never_exceeds_the_budget_and_every_skipped_round_is_charged(tmp_path, seed):
    """Random outliers (some far beyond the budget, some just above the round's share) and a random budget:
    the ledger never goes past it, holds one entry per round recorded, and each skipped round's entry is
    what it revealed (never more than its full cost)."""
    rng = np.random.default_rng(seed)
    budget = float(rng.uniform(0.8, 2.5))
    outliers = set(rng.choice(np.arange(1, 13), size=4, replace=False).tolist())
    factor = float(rng.choice([1.5, 4.0, 60.0]))
    hist, trained, ledger = _run(tmp_path, outliers, factor, rounds=12, epsilon=budget,
                                 max_consecutive_refusals=int(rng.integers(1, 4)))
    assert all(e.epsilon <= budget for e in ledger.entries) and ledger.epsilon() <= budget
    assert ledger.rounds == len(hist.rounds)
    for record, entry in zip(hist.rounds, ledger.entries):
        assert entry.epsilon == pytest.approx(record.epsilon)
        assert entry.mu == record.charged_mu
        if record.refused:
            assert record.round not in trained and entry.note.startswith(f"round {record.round}: stopped")
            assert entry.mu <= charge_resolution(record.mu, 0.005)
        else:
            assert record.round in trained and entry.note.startswith(f"round {record.round}:")
    assert hist.rounds_trained + hist.rounds_refused == len(hist.rounds)
    assert bool(hist.stopped) == (len(hist.rounds) < 12)


def test_a_refusal_before_anything_was_delivered_stops_training_at_once(tmp_path):
    """central DP reveals nothing before its release: a refused round spent nothing and training stops
    (its cost is the same every round: the next one could not fit either)."""
    config = SimulationConfig(rounds=30, mode="central-dp", epsilon=1.0, budget_rounds=3, backend="inline",
                              privacy_unit="party", output_dir=str(tmp_path))
    hist = simulate(MODEL, PARTS, (XT, YT), config, progress=False)
    assert hist.stopped.startswith(f"stopped before round {len(hist.rounds) + 1}: its cost would exceed the budget "
                                   "(nothing of it was released or spent)")
    assert hist.rounds_refused == 0 and hist.rounds_trained == len(hist.rounds) >= 2
    assert PrivacyLedger(tmp_path / "ledger.json", delta=1e-5).rounds == len(hist.rounds)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "3", None])
def test_bad_cap_values_are_refused_naming_the_parameter(bad):
    with pytest.raises(ValueError, match=r"max_consecutive_refusals .*must be an integer >= 1, got"):
        SimulationConfig(max_consecutive_refusals=bad)


def test_the_progress_line_says_a_round_was_skipped(tmp_path, capsys):
    simulate(MODEL, PARTS, (XT, YT), _config(tmp_path, rounds=4), mixer=OutlierInca({2}), progress=True)
    lines = [line for line in capsys.readouterr().err.splitlines() if "round    2/4" in line]
    assert lines and "SKIPPED (refused by the budget" in lines[-1] and "stopped before its final messages" in lines[-1]

"""A trace saved by training carries what its certificate needs: ``reproduce_charge`` (what ``flwr-inca
audit TRACE`` prints without options) recomputes exactly the mu and epsilon training charged, for rounds
that released their finals and rounds the budget refused, from either driver."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest

from flwr_inca.privacy import PrivacyLedger
from flwr_inca.privacy.accountants import RoundCost, create_accountant
from flwr_inca.protocol.trace import ExecutionTrace
from flwr_inca.rounds import reproduce_charge


def _audit_json(path) -> dict:
    """``flwr-inca audit TRACE --json``, no other option, in process."""
    import contextlib
    import io
    import json

    from flwr_inca.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["audit", str(path), "--json"]) == 0
    return json.loads(out.getvalue())


def _check(traces, ledger: PrivacyLedger) -> list[bool]:
    """Each saved trace's recomputed charge is its ledger entry's, bit for bit, through the API and through
    ``flwr-inca audit TRACE`` without options; returns which rounds were refused."""
    entries = {int(e.note.split(":")[0].split()[1]): e for e in ledger.entries}
    refused = []
    for path in traces:
        again = reproduce_charge(ExecutionTrace.load(path))
        printed = _audit_json(path)
        assert (printed["charged_mu"], printed["epsilon"], printed["agrees"]) == (again.charged_mu,
                                                                                 again.epsilon_round, True)
        entry = entries[again.round]
        assert again.agrees and again.charged_mu == entry.mu, (path.name, again, entry)
        certified = entry.mu if entry.certified_mu is None else entry.certified_mu
        assert again.certified_mu == certified
        alone = create_accountant(ledger.accountant.name).epsilon([RoundCost(entry.mu, entry.sample_rate)],
                                                                  ledger.delta)
        assert again.epsilon_round == alone
        refused.append(again.refused)
    return refused


def test_a_flower_rounds_trace_reproduces_its_charge(tmp_path, task_identity):
    pytest.importorskip("flwr")
    import flower_apps
    from flwr.app import ArrayRecord
    from inprocess_grid import InProcessGrid

    from flwr_inca.flower import IncaBudgetExhausted, IncaStrategy

    settings = dict(iterations=3, sigma_star=0.3, sigma_delta=3.0, collusion=0.2, threat_draws=2, budget_check_runs=1,
                    min_available_nodes=6, min_train_nodes=6, fraction_evaluate=0.0)
    initial = ArrayRecord([np.zeros(4, np.float32)])
    for seed in range(1, 40):  # a seed whose first round costs more than its one-execution prediction
        probe = IncaStrategy(**settings, seed=seed, ledger_path=None)
        probe.start(InProcessGrid(flower_apps.client, 6), initial, num_rounds=1)
        cost, predicted = probe.rounds[1].charge.mu, probe.session.charged(probe.inca.predicted_mu(6))
        if cost > predicted * 1.01:
            break
    else:
        pytest.fail("no seed gave a round costlier than its prediction")
    empty = PrivacyLedger(None, delta=1e-5)
    budget = (empty.epsilon_after(predicted) + empty.epsilon_after(cost)) / 2  # admitted, then refused
    strategy = IncaStrategy(**settings, seed=seed, ledger_path=tmp_path / "ledger.json", trace_dir=tmp_path / "traces",
                            max_epsilon=budget, max_consecutive_refusals=1)
    with pytest.raises(IncaBudgetExhausted):
        strategy.start(InProcessGrid(flower_apps.client, 6), initial, num_rounds=3)
    traces = sorted((tmp_path / "traces").iterdir())
    refused = _check(traces, strategy.ledger)
    assert refused == [True] and strategy.rounds[1].refused
    # and rounds that released their finals, one of them lost (the charge counts the finals that arrived)
    lost = IncaStrategy(**settings, seed=seed, ledger_path=tmp_path / "l2.json", trace_dir=tmp_path / "t2",
                        max_noise_inflation=math.inf, exchange_timeout=0.3)  # the silent node's exchanges time out
    lost.start(InProcessGrid(flower_apps.client, 6, drop=lambda rnd, commit, party: party == 2 and commit == 4),
               initial, num_rounds=2)
    assert _check(sorted((tmp_path / "t2").iterdir()), lost.ledger) == [False, False]
    assert len(lost.rounds[1].finalists) == 5


def test_a_simulated_rounds_trace_reproduces_its_charge(tmp_path):
    torch = pytest.importorskip("torch")
    from synthetic import CLASSES, FEATURES, linear_task

    from flwr_inca.simulation import SimulationConfig, iid, simulate

    x, y = linear_task(600)
    config = SimulationConfig(rounds=3, max_epsilon=3.0, privacy_unit="party", iterations=4, calibration_runs=2,
                              backend="inline", output_dir=str(tmp_path / "out"), trace_dir="traces", lr=0.5,
                              collusion=0.2, threat_draws=2)
    history = simulate(functools.partial(torch.nn.Linear, FEATURES, CLASSES), iid(x, y, 12), None, config,
                       progress=False)
    traces = sorted((tmp_path / "out" / "traces").iterdir())
    assert len(traces) == len(history.rounds) == 3
    ledger = PrivacyLedger(tmp_path / "out" / "inca_ledger.json", delta=1e-5)
    _check(traces, ledger)
    assert math.isfinite(ledger.epsilon())


def test_an_edited_trace_is_reported_as_disagreeing(tmp_path, capsys):
    import json

    from flwr_inca.cli import main

    pytest.importorskip("torch")
    test_a_simulated_rounds_trace_reproduces_its_charge(tmp_path)
    path = sorted((tmp_path / "out" / "traces").iterdir())[0]
    data = json.loads(path.read_text())
    data["meta"]["privacy"]["charged_mu"] *= 0.5  # what a hand edit of the record would look like
    path.write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["audit", str(path)]) == 1
    out, err = capsys.readouterr()
    assert "DIFFERENT" in out and "differs from the recorded" in err and err.count("\n") == 1


def test_a_trace_without_training_settings_says_what_to_give(tmp_path):
    from flwr_inca import IncaConfig
    from flwr_inca.protocol import sample_trace

    trace = sample_trace(6, IncaConfig(iterations=2, sigma_star=1.0, sigma_delta=1.0), seed=1)
    with pytest.raises(ValueError, match="give the threat and the sensitivity"):
        reproduce_charge(trace)

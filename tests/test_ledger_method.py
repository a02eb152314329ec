"""The ledger records which certificate method (exact or bound) charged each round."""

import dataclasses
import json

import pytest

pytest.importorskip("flwr")

from flwr_inca import IncaConfig, TemporaryDropout
from flwr_inca.flower import IncaStrategy
from flwr_inca.privacy import PrivacyLedger
from flwr_inca.privacy import prefix as rounds_module  # the strategy certifies through RoundPrefix
from flwr_inca.protocol import sample_trace

SIGMAS = {"sigma_star": 1.0, "sigma_delta": 5.0, "seed": 0}


def _trace(seed=1, dropout=None):
    return sample_trace(8, IncaConfig(iterations=4, neighbors=1, sigma_star=1.0, sigma_delta=5.0,
                                      dropout=dropout), seed=seed)


def test_each_round_records_its_certificate_method_on_disk(tmp_path, monkeypatch):
    path = tmp_path / "ledger.json"
    strategy = IncaStrategy(**SIGMAS, ledger_path=path)
    strategy._certify_and_spend(_trace(), 1)  # small: certified exactly
    real = rounds_module.certify

    def as_bound(*args, **kwargs):  # a round too large for the exact method gets the bound
        return dataclasses.replace(real(*args, **kwargs), method="bound")

    monkeypatch.setattr(rounds_module.PrefixProfile, "build", classmethod(lambda cls, *a, **k: None))
    monkeypatch.setattr(rounds_module, "certify", as_bound)
    strategy._certify_and_spend(_trace(seed=2), 2)
    assert [e.method for e in strategy.ledger.entries] == ["exact", "bound"]
    on_disk = json.loads(path.read_text())["rounds"]
    assert [r["method"] for r in on_disk] == ["exact", "bound"]
    assert [e.method for e in PrivacyLedger(path, delta=1e-5).entries] == ["exact", "bound"]


def test_a_round_without_its_finals_records_the_method_of_the_charged_certificate(monkeypatch):
    strategy = IncaStrategy(**SIGMAS, ledger_path=None)
    trace = _trace(seed=3, dropout=TemporaryDropout(0.2))
    online = trace.steps[-1].online.tolist()
    real = rounds_module.certify

    def bound_without_a_final(trace, view, **kwargs):  # only the certificate of fewer finals is a bound
        cert = real(trace, view, **kwargs)
        return dataclasses.replace(cert, method="bound") if view.observed[-1].sum() < len(online) else cert

    monkeypatch.setattr(rounds_module.PrefixProfile, "build", classmethod(lambda cls, *a, **k: None))
    monkeypatch.setattr(rounds_module, "certify", bound_without_a_final)
    prefinal = strategy._certify(trace, strategy._certify_seeds(1))
    mu, _ = strategy._certify_and_spend(trace, 1, prefinal, [], prefinal_method="exact")  # stopped round
    assert 0 < mu < prefinal  # the certificate without finals is charged, and it is the bound here
    assert strategy.ledger.entries[0].mu == mu and strategy.ledger.entries[0].method == "bound"
    # when every final arrived, the pre-final certificate (exact) is charged
    strategy._certify_and_spend(trace, 2, prefinal, online, prefinal_method="exact")
    assert strategy.ledger.entries[1].mu == prefinal and strategy.ledger.entries[1].method == "exact"


def test_a_ledger_written_before_methods_were_recorded_still_loads(tmp_path):
    path = tmp_path / "old.json"
    ledger = PrivacyLedger(path, delta=1e-5)
    ledger.spend(0.3, note="round 1")
    data = json.loads(path.read_text())
    assert "method" not in data["rounds"][0]  # nothing recorded when nobody says
    ledger.spend(0.2, note="round 2", method="exact")
    again = PrivacyLedger(path, delta=1e-5)
    assert [e.method for e in again.entries] == [None, "exact"] and again.rounds == 2

"""The one derivation of a round's certification adversaries (flwr_inca.privacy.rounds), checked against
an independent recomputation: SeedSequence(seed, spawn_key=(0, round)), one spawned child per draw."""

import math

import numpy as np
import pytest

from flwr_inca import IncaConfig, PermanentDropout
from flwr_inca.privacy import (
    certification_seeds,
    certification_views,
    certify,
    certify_round,
    random_collusion,
    random_eavesdrop,
)
from flwr_inca.protocol import sample_trace


@pytest.fixture(scope="module")
def trace():
    return sample_trace(12, IncaConfig(iterations=4, sigma_star=0.4, sigma_delta=2.0,
                                       dropout=PermanentDropout(0.2)), seed=3)


def _keys(seed, round, draws):
    root = np.random.SeedSequence(seed, spawn_key=(0, round))
    return [int(child.generate_state(1, dtype=np.uint64)[0]) for child in root.spawn(draws)]


@pytest.mark.parametrize("observed_fraction", [None, 0.4])
def test_round_adversaries_match_an_independent_derivation(trace, observed_fraction):
    finals = trace.steps[-1].online.tolist()[1:]
    seeds = certification_seeds(7, 5)
    got = certify_round(trace, seeds, 3, collusion=0.2, observed_fraction=observed_fraction, finals=finals,
                        value_sensitivity=2.0)
    views = [random_collusion(trace, 0.2, k, finals=finals) if observed_fraction is None
             else random_eavesdrop(trace, observed_fraction, k, finals=finals) for k in _keys(7, 5, 3)]
    certs = [certify(trace, v, value_sensitivity=2.0) for v in views]
    assert got.mu == max(c.max_mu for c in certs) > 0
    assert got.methods == tuple(c.method for c in certs) and got.method == "exact"
    # the same seeds draw the same adversaries on every call (spawning must not advance them)
    again = list(certification_views(trace, seeds, 3, collusion=0.2, observed_fraction=observed_fraction,
                                     finals=finals))
    assert all(np.array_equal(a.observed, b.observed) for a, b in zip(again, views))
    assert certify_round(trace, seeds, 3, collusion=0.2, observed_fraction=observed_fraction,
                         finals=finals, value_sensitivity=2.0) == got


def test_a_nan_certificate_counts_as_unbounded(trace, monkeypatch):
    from flwr_inca.privacy import rounds

    real = rounds.certify

    def nan_once(*args, **kwargs):
        cert = real(*args, **kwargs)
        cert.mu[next(iter(cert.mu))] = math.nan
        return cert

    monkeypatch.setattr(rounds, "certify", nan_once)
    assert certify_round(trace, certification_seeds(0, 1), 2, collusion=0.1).mu == math.inf

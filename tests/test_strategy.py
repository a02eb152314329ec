"""IncaStrategy without a simulation: parameter checks and the round's privacy bookkeeping."""

import math

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr_inca import IncaConfig  # noqa: E402
from flwr_inca.protocol import sample_trace  # noqa: E402
from flwr_inca.flower import IncaStrategy  # noqa: E402

SIGMAS = {"sigma_star": 1.0, "sigma_delta": 5.0, "ledger_path": None}


@pytest.mark.parametrize("kwargs, name", [
    ({"clip_norm": 0.0}, "clip_norm"),
    ({"sample_rate": 1.5}, "sample_rate"),
    ({"collusion": 1.0}, "collusion"),
    ({"observed_fraction": -0.1}, "observed_fraction"),
    ({"min_finalists": 0}, "min_finalists"),
    ({"exchange_timeout": 0}, "exchange_timeout"),
    ({"precision": "float16"}, "precision"),
    ({"threat_draws": 0}, "threat_draws"),
    ({"iterations": 0}, "iterations"),
    ({"sigma_star": -1.0}, "sigma_star"),
    ({"delta": 1.0}, "delta"),
    ({"max_noise_inflation": 0.5}, "max_noise_inflation"),
])
def test_bad_parameters_are_named(kwargs, name):
    with pytest.raises(ValueError, match=name):
        IncaStrategy(**{**SIGMAS, **kwargs})


def test_accountant_that_cannot_handle_subsampling_is_refused_before_any_round():
    with pytest.raises(ValueError, match="sample_rate"):
        IncaStrategy(**SIGMAS, sample_rate=0.1, accountant="gdp")
    assert IncaStrategy(**SIGMAS, sample_rate=0.1).ledger.accountant.name == "prv"


def _trace(n=8, T=4):
    return sample_trace(n, IncaConfig(iterations=T, neighbors=1, sigma_star=1.0, sigma_delta=5.0), seed=1)


def test_a_round_that_cannot_be_certified_is_recorded_as_unbounded(monkeypatch):
    strategy = IncaStrategy(**SIGMAS)

    def broken(trace, server_round):
        raise np.linalg.LinAlgError("SVD did not converge")

    monkeypatch.setattr(strategy, "_certify", broken)
    with pytest.raises(np.linalg.LinAlgError):
        strategy._certify_and_spend(_trace(), 1)
    assert strategy.ledger.rounds == 1 and math.isinf(strategy.ledger.epsilon())


def test_certified_round_is_spent_in_the_ledger():
    strategy = IncaStrategy(**SIGMAS, collusion=0.2, threat_draws=2)
    mu, eps = strategy._certify_and_spend(_trace(), 1)
    assert 0 < mu < math.inf and strategy.ledger.rounds == 1
    assert eps == pytest.approx(strategy.ledger.epsilon())


def test_lost_final_messages_fail_the_round_when_they_leave_noise_uncancelled():
    from flwr_inca.protocol.utility import noise_std

    strategy = IncaStrategy(**SIGMAS, max_noise_inflation=2.0)
    trace = _trace(n=8, T=4)
    everyone = trace.steps[-1].online.tolist()
    roster = [100 + i for i in range(8)]
    noise, why = strategy._noise_check(trace, everyone, roster)
    assert why == "" and noise == pytest.approx(noise_std(trace))
    noise, why = strategy._noise_check(trace, everyone[1:], roster)  # one final lost
    assert noise > 2.0 * noise_std(trace)  # sigma_delta = 5 sigma_star: the lost share is large
    assert f"[{roster[everyone[0]]}]" in why and "max_noise_inflation" in why
    # a tolerant setting accepts the same round
    lenient = IncaStrategy(**SIGMAS, max_noise_inflation=noise / noise_std(trace) * 1.01)
    assert lenient._noise_check(trace, everyone[1:], roster)[1] == ""


def test_integer_arrays_are_neither_clipped_nor_averaged():
    from flwr.app import Array, ArrayRecord

    from flwr_inca.flower.client import clip, flatten_arrays, unflatten_arrays

    old = ArrayRecord({"w": Array(np.zeros(4, dtype=np.float32)), "count": Array(np.array(7, dtype=np.int64))})
    new = ArrayRecord({"w": Array(np.full(4, 0.05, dtype=np.float32)),
                       "count": Array(np.array(107, dtype=np.int64))})
    v_old, spec = flatten_arrays(old)
    v_new, _ = flatten_arrays(new)
    assert v_old.size == 4  # the counter is not part of the private vector
    update = clip(v_new - v_old, 1.0)
    assert np.allclose(update, 0.05, atol=1e-8)  # the counter's +100 does not eat the clipping norm
    out = unflatten_arrays(v_old + update, spec, keep=old)
    assert out["count"].numpy() == 7 and out["count"].numpy().dtype == np.int64
    assert np.allclose(out["w"].numpy(), 0.05)
    with pytest.raises(ValueError, match="count"):
        unflatten_arrays(v_old, spec)


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_inca_client_rejects_a_bad_noise_ahead_budget(value):
    from flwr.clientapp import ClientApp

    from flwr_inca.flower import IncaClient

    with pytest.raises(ValueError, match="noise_ahead_bytes"):
        IncaClient(ClientApp(), noise_ahead_bytes=value)

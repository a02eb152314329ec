"""`flwr-inca audit` certifies what a trace records as observed: the final messages that arrived (none for
a round stopped before its finals), not every party online at the last iteration."""

import json

import numpy as np
import pytest

from flwr_inca import IncaConfig, PermanentDropout, run_inca
from flwr_inca.cli import main
from flwr_inca.privacy import (
    adversarial_collusion,
    certify,
    collusion_view,
    random_collusion,
    random_eavesdrop,
    with_finals,
)
from flwr_inca.protocol import ExecutionTrace


def _saved(tmp_path, finalists, collected=None):
    """A recorded round whose relay wrote ``finalists`` (``collected=False``: stopped before its finals)."""
    result = run_inca(np.random.default_rng(0).random((20, 2)),
                      IncaConfig(iterations=6, sigma_star=0.5, sigma_delta=3.0, dropout=PermanentDropout(0.1)),
                      seed=1)
    trace = result.trace
    trace.meta["finalists"] = finalists(trace) if callable(finalists) else finalists
    if collected is not None:
        trace.meta["finals-collected"] = collected
    path = tmp_path / "round.json"
    trace.save(path)
    return path, ExecutionTrace.load(path)


def _audit(capsys, path, *flags):
    assert main(["audit", str(path), *flags, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_stopped_round_is_audited_without_its_finals(tmp_path, capsys):
    path, trace = _saved(tmp_path, [], collected=False)
    out = _audit(capsys, path, "--collusion", "0.1", "--seed", "3")
    without = certify(trace, random_collusion(trace, 0.1, 3, finals=()))
    every = certify(trace, random_collusion(trace, 0.1, 3))  # what audit used to certify
    assert out["max_mu"] == pytest.approx(without.max_mu, rel=1e-12) and out["max_mu"] < every.max_mu
    assert out["finals"] == [] and out["finals_recorded"] is True
    assert main(["audit", str(path), "--collusion", "0.1", "--seed", "3"]) == 0
    assert "final messages counted: none of" in capsys.readouterr().out


@pytest.mark.parametrize("flags, view", [
    (["--corrupted", "3,7"], lambda t, f: collusion_view(t, [3, 7])),
    (["--observed-fraction", "0.5", "--seed", "2"], lambda t, f: random_eavesdrop(t, 0.5, 2, finals=f)),
])
def test_lost_finals_are_not_counted(tmp_path, capsys, flags, view):
    path, trace = _saved(tmp_path, lambda t: t.steps[-1].online.tolist()[::2])
    finals = trace.meta["finalists"]
    assert 0 < len(finals) < trace.steps[-1].online.size
    out = _audit(capsys, path, *flags)
    expected = certify(trace, with_finals(view(trace, finals), trace, finals))
    assert out["max_mu"] == pytest.approx(expected.max_mu, rel=1e-12)
    assert out["finals"] == sorted(finals)
    assert main(["audit", str(path), *flags]) == 0
    assert f"{len(finals)} of {trace.steps[-1].online.size} recorded as arrived" in capsys.readouterr().out


def test_adversarial_search_sees_only_the_recorded_finals(tmp_path, capsys):
    path, trace = _saved(tmp_path, [], collected=False)
    out = _audit(capsys, path, "--adversarial", "0.1")
    res = adversarial_collusion(trace, 0.1, seed=0, finals=())
    assert out["max_mu"] == pytest.approx(res.certificate.max_mu, rel=1e-12)
    assert out["max_mu"] < adversarial_collusion(trace, 0.1, seed=0).certificate.max_mu


def test_a_trace_without_the_record_counts_every_final_and_says_so(tmp_path, capsys):
    path, trace = _saved(tmp_path, None)
    raw = json.loads(path.read_text())
    raw.get("meta", {}).pop("finalists", None)
    path.write_text(json.dumps(raw))
    trace = ExecutionTrace.load(path)
    out = _audit(capsys, path, "--collusion", "0.1")
    assert out["max_mu"] == pytest.approx(certify(trace, random_collusion(trace, 0.1, 0)).max_mu, rel=1e-12)
    assert out["finals"] == trace.steps[-1].online.tolist() and out["finals_recorded"] is False
    assert main(["audit", str(path)]) == 0
    assert "the trace does not record which finals arrived" in capsys.readouterr().out


def test_a_bad_finals_record_is_named(tmp_path, capsys):
    path, _ = _saved(tmp_path, [99])
    assert main(["audit", str(path)]) == 2
    assert "finals" in capsys.readouterr().err

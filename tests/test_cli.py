import argparse
import json
import math

import numpy as np
import pytest

from flwr_inca import IncaConfig, PermanentDropout, run_inca
from flwr_inca.cli import main, parse_dropout
from flwr_inca.privacy import certify, collusion_view


@pytest.fixture
def trace_file(tmp_path):
    result = run_inca(np.random.default_rng(0).random((30, 2)),
                      IncaConfig(iterations=8, sigma_star=0.5, sigma_delta=3.0, dropout=PermanentDropout(0.1)),
                      seed=1)
    path = tmp_path / "trace.json"
    result.trace.save(path)
    return path, result.trace


def test_audit_json_with_corrupted_set(trace_file, capsys):
    path, trace = trace_file
    assert main(["audit", str(path), "--corrupted", "3,7,9", "--delta", "1e-5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    cert = certify(trace, collusion_view(trace, [3, 7, 9]), delta=1e-5)
    assert set(out) >= {"mu", "max_mu", "epsilon"}
    assert set(out["mu"]) == {str(i) for i in range(30) if i not in (3, 7, 9)}
    assert out["max_mu"] == pytest.approx(cert.max_mu) and out["epsilon"] == pytest.approx(cert.epsilon)


@pytest.mark.parametrize("flags", [["--collusion", "0.2", "--seed", "4"], ["--observed-fraction", "0.5"],
                                   ["--adversarial", "0.1"]])
def test_audit_threat_models(trace_file, capsys, flags):
    path, _ = trace_file
    assert main(["audit", str(path), *flags, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert math.isfinite(out["max_mu"]) and out["max_mu"] == max(out["mu"].values())


def test_audit_human_output_explains_weakest(trace_file, capsys):
    path, _ = trace_file
    assert main(["audit", str(path), "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "weakest honest party" in out and "Thm 4.5 rank condition" in out and "messages observed" in out


def test_audit_errors(tmp_path, trace_file, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "inca-trace/1", "parties": 3}')
    assert main(["audit", str(bad)]) == 2
    assert "missing field" in capsys.readouterr().err
    path, _ = trace_file
    assert main(["audit", str(path), "--corrupted", "3,99"]) == 2
    assert "[0, 29]" in capsys.readouterr().err
    assert main(["audit", str(path), "--delta", "2"]) == 2


def test_calibrate_json(capsys):
    assert main(["calibrate", "-n", "40", "-T", "8", "--epsilon", "0.5", "--runs", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    procs = [c["procedure"] for c in out["calibrations"]]
    assert procs == ["paper", "exact"]
    exact = out["calibrations"][1]
    assert exact["success_fraction"] == 1.0 and exact["sigma_star"] > 0 and out["mse_central_dp"] > 0


def test_calibrate_table(capsys):
    assert main(["calibrate", "-n", "30", "-T", "6", "--epsilon", "2", "--runs", "2",
                 "--dropout", "none"]) == 0
    out = capsys.readouterr()
    assert "exact" in out.out and "central DP" in out.out and "epsilon < 1" in out.err


def test_mean_demo(capsys):
    assert main(["mean", "-n", "40", "-d", "5", "--runs", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mse_local_dp"] == pytest.approx(40 * out["mse_central_dp"])
    assert out["certified_epsilon"] > 0 and out["finalists"] == 36
    assert main(["mean", "-n", "20", "-d", "3", "--sigma-star", "0.1"]) == 2


def test_parse_dropout():
    assert parse_dropout("permanent:0.2").gamma == 0.2
    assert parse_dropout("markov:0.1,0.4").correlation == 0.4
    assert parse_dropout("temporary:0.3").p == 0.3 and type(parse_dropout("none")).__name__ == "NoDropout"
    for bad, match in [("sometimes", "dropout must be none, permanent"),
                       ("temporary", "dropout must be none, permanent"),
                       ("permanent:x", "bad dropout spec 'permanent:x'"),
                       ("permanent:2", r"must be in \[0, 1\), got 2.0")]:
        with pytest.raises(argparse.ArgumentTypeError, match=match):
            parse_dropout(bad)


def test_bad_numbers_are_named_on_the_command_line(capsys):
    assert main(["mean", "-n", "20", "--epsilon", "-1"]) == 2
    assert "--epsilon must be a finite number > 0, got -1.0" in capsys.readouterr().err
    assert main(["calibrate", "--delta", "1"]) == 2
    assert "--delta must be in (0, 1), got 1.0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["mean", "-n", "0"])
    assert "must be an integer >= 1, got 0" in capsys.readouterr().err


def test_audit_json_writes_an_unbounded_party_as_inf(tmp_path, capsys):
    # a party whose every message the adversary sees has no guarantee: mu = inf, written "inf"
    result = run_inca(np.random.default_rng(0).random((4, 1)),
                      IncaConfig(iterations=2, sigma_star=0.0, sigma_delta=1.0), seed=0)
    path = tmp_path / "t.json"
    result.trace.save(path)
    assert main(["audit", str(path), "--corrupted", "0,1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)  # standard JSON: no Infinity
    assert out["max_mu"] == "inf" and out["epsilon"] == "inf" and "inf" in out["mu"].values()

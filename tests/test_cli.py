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


def _commands():
    from flwr_inca.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return parser, sub.choices


def test_every_command_explains_every_option():
    parser, commands = _commands()
    assert set(commands) == {"mean", "calibrate", "audit", "simulate", "reproduce"}
    assert "``" not in parser.format_help() and "Thin" not in parser.format_help()  # no RST, no internal note
    for name, command in commands.items():
        assert command.description, name
        assert f"flwr-inca {name} " in (command.epilog or ""), f"{name}: no example line"
        text = " ".join(command.format_help().split())  # line breaks of the wrapped help ignored
        for action in command._actions:
            assert action.help and action.help != argparse.SUPPRESS, f"{name} {action.option_strings}: no help"
            for choice in action.choices or []:
                assert str(choice) in text
            shown = action.default not in (None, False, argparse.SUPPRESS) and action.option_strings
            if shown:
                assert f"(default: {action.default})" in text, f"{name} {action.option_strings[0]}: no default"


def test_help_and_version_exit_cleanly(capsys):
    from flwr_inca import __version__

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and f"flwr-inca {__version__}" in capsys.readouterr().out
    for name in ["mean", "calibrate", "audit", "simulate", "reproduce"]:
        with pytest.raises(SystemExit) as info:
            main([name, "--help"])
        out = capsys.readouterr().out
        assert info.value.code == 0 and out.startswith(f"usage: flwr-inca {name}") and "example" in out


def test_mean_table_is_tidy(capsys):
    assert main(["mean", "-n", "30", "-d", "3", "--runs", "2", "--dropout", "none"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rule = next(i for i, line in enumerate(lines) if set(line) <= {"-", " "} and line)
    table = lines[rule - 1: rule + 4]  # header, rule, 3 rows
    assert [row.split()[0] for row in table[2:]] == ["IncA", "central", "local"]
    assert max(len(row) for row in table) == len(table[1]) <= 100  # no column padded past its content
    # the numbers line up on the right edge of their column
    assert len({row.rstrip().rfind(row.split()[-1]) + len(row.split()[-1]) for row in table[2:]}) == 1

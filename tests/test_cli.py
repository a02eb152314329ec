import argparse
import json
import math
import os
import re

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
    # The keys the README documents, no more, no less.
    assert set(out) == {"mu", "max_mu", "epsilon", "delta", "method", "threat", "corrupted", "finals",
                        "finals_recorded"}
    assert out["method"] == cert.method and out["corrupted"] == [3, 7, 9] and out["delta"] == 1e-5
    recorded = trace.meta.get("finalists")
    assert out["finals_recorded"] is (recorded is not None)
    assert sorted(out["finals"]) == (sorted(recorded) if recorded is not None else trace.steps[-1].online.tolist())
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
    with pytest.raises(SystemExit) as info:
        main(["audit", str(path), "--delta", "2"])
    assert info.value.code == 2 and "argument --delta: must be in (0, 1), got 2.0" in capsys.readouterr().err


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


def test_mean_and_calibrate_choose_iterations_by_the_drivers_rule(capsys):
    """--iterations auto (mean's default) is the rule IncaStrategy and the simulator use, noted on stderr."""
    from flwr_inca.privacy import mu_for_epsilon
    from flwr_inca.rounds import choose_iterations
    from flwr_inca.settings import MixingConfig, PrivacyTarget

    assert main(["mean", "-n", "40", "-d", "3", "--runs", "4", "--epsilon", "0.5", "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    chosen = out["iterations"]
    rule = choose_iterations(PrivacyTarget(round_epsilon=0.5, calibration_runs=4),
                             MixingConfig(dropout=PermanentDropout(0.1)), 40,
                             mu_target=mu_for_epsilon(0.5, 1e-5), value_sensitivity=2.0, seed=0)
    assert chosen == rule.iterations > 10  # 10% dropouts at n = 40: T = 10 leaves too much noise
    assert f"chose T = {chosen} ({chosen + 1} messages per party per round)" in captured.err
    # its noise is the chosen T's calibration the choice made (the drivers' calibrator), not a second one
    sigmas = rule.calibrator.sigmas(40, mu_for_epsilon(0.5, 1e-5), 1e-5, 2.0)
    assert (out["sigma_star"], out["sigma_delta"]) == sigmas
    # --max-iterations caps it; without dropouts, or with the noise given, the fewest (nothing calibrated)
    for extra, words in [(["--max-iterations", "10"], "chose T = 10 "),
                         (["--dropout", "none"], "no dropouts expected"),
                         (["--sigma-star", "0.5", "--sigma-delta", "1"], "the noise is given")]:
        assert main(["mean", "-n", "40", "-d", "3", "--runs", "4", "--json", *extra]) == 0
        captured = capsys.readouterr()
        assert json.loads(captured.out)["iterations"] == 10 and words in captured.err
    assert main(["calibrate", "-n", "40", "-T", "auto", "--runs", "3", "--procedure", "exact",
                 "--dropout", "none"]) == 0
    captured = capsys.readouterr()
    assert "n = 40, T = 10," in captured.out and "chose T = 10" in captured.err
    with pytest.raises(SystemExit) as info:
        main(["mean", "--iterations", "automatic"])
    assert info.value.code == 2 and "argument --iterations/-T: must be 'auto' or an integer" in capsys.readouterr().err


def test_mean_and_calibrate_simulate_the_runs_of_the_chosen_iterations_once(monkeypatch, capsys):
    """--iterations auto calibrates the chosen T in full to choose it (the others at most on a screening
    share of the runs); mean and calibrate (its exact procedure) then take that calibration: no run of the
    chosen T is simulated twice."""
    from flwr_inca.privacy import calibration

    real, simulated = calibration.simulate_runs, []

    def counted(parties, base, seeds, **kwargs):
        simulated.append((base.iterations, len(seeds)))
        return real(parties, base, seeds, **kwargs)

    monkeypatch.setattr(calibration, "simulate_runs", counted)
    assert main(["mean", "-n", "40", "-d", "3", "--runs", "5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert simulated.count((out["iterations"], 5)) == 1 and out["sigmas"] == "calibrated over 5 runs to choose T"
    simulated.clear()
    assert main(["mean", "-n", "40", "-d", "3", "--runs", "5", "--json", "-T", str(out["iterations"])]) == 0
    assert simulated == [(out["iterations"], 5)]  # a given T: calibrated once, by calibrate()
    assert json.loads(capsys.readouterr().out)["sigmas"] == "calibrated over 5 runs"
    simulated.clear()
    assert main(["calibrate", "-n", "40", "-T", "auto", "--runs", "5", "--procedure", "both", "--epsilon", "0.5",
                 "--json"]) == 0
    paper, exact = json.loads(capsys.readouterr().out)["calibrations"]
    chosen = exact["iterations"]
    assert paper["iterations"] == chosen and simulated.count((chosen, 5)) == 2  # the paper's own runs, and the choice's
    assert paper["run_seeds"] == exact["run_seeds"]  # both procedures on the same executions
    assert exact["notes"][-1] == "the calibration made to choose T (its runs are not simulated again)"
    assert exact["parties"] == 40 and exact["epsilon"] == 0.5 and exact["predicted_mse"] == pytest.approx(
        min(r["predicted_mse"] for r in exact["alternatives"] if r["success_fraction"] == 1), rel=1e-12)
    # --target-success reaches the choice's calibration: its most accurate row certifying half the runs
    assert main(["calibrate", "-n", "50", "-T", "auto", "--runs", "5", "--procedure", "exact", "--json",
                 "--target-success", "0.5"]) == 0
    (half,) = json.loads(capsys.readouterr().out)["calibrations"]
    assert 0.5 <= half["success_fraction"] < 1 and half["predicted_mse"] == pytest.approx(
        min(r["predicted_mse"] for r in half["alternatives"] if r["success_fraction"] >= 0.5), rel=1e-12)


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
    for argv, words in [(["mean", "-n", "20", "--epsilon", "-1"], "argument --epsilon: must be in [1e-06, 1e+06], got -1.0"),
                        (["calibrate", "--delta", "1"], "argument --delta: must be in (0, 1), got 1.0"),
                        (["mean", "-n", "0"], "argument --parties/-n: must be an integer in [2, 10000000], got 0")]:
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2 and words in capsys.readouterr().err


def test_audit_json_writes_an_unbounded_party_as_inf(tmp_path, capsys):
    # a party whose every message the adversary sees has no guarantee: mu = inf, written "inf"
    result = run_inca(np.random.default_rng(0).random((4, 1)),
                      IncaConfig(iterations=2, sigma_star=0.0, sigma_delta=1.0), seed=0)
    path = tmp_path / "t.json"
    result.trace.save(path)
    assert main(["audit", str(path), "--corrupted", "0,1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)  # standard JSON: no Infinity
    assert out["max_mu"] == "inf" and out["epsilon"] == "inf" and "inf" in out["mu"].values()


# ------------------------------------------------------------------------------ crafted files and bad arguments
def _crafted_traces():
    """Small files that each claim something huge or are malformed in a way JSON allows."""
    base = run_inca(np.random.default_rng(0).random((4, 1)),
                    IncaConfig(iterations=2, sigma_star=0.5, sigma_delta=1.0), seed=0).trace.to_dict()

    def variant(**changes):
        return json.dumps({**base, **changes})

    deep = "[" * 200_000 + "]" * 200_000
    step = base["steps"][0]
    return {
        "iterations 1e9": variant(iterations=10**9),
        "iterations 1e9 float": variant(iterations=1e9),
        "parties 1e12": variant(parties=10**12),
        "parties 1e30": variant(parties=10**30),
        "parties 1e30 float": variant(parties=1e30),
        "parties true": variant(parties=True),
        "negative iterations": variant(iterations=-1),
        "deeply nested document": deep,
        "deeply nested steps": json.dumps(base)[:-1] + ', "extra": ' + deep + "}",
        "deeply nested meta": variant(meta={"a": 1}).replace('{"a": 1}', deep),
        "online index 1e30": variant(steps=[{**step, "online": [10**30]}, base["steps"][1]]),
        "online index -1": variant(steps=[{**step, "online": [-1]}, base["steps"][1]]),
        "sender 1e30": variant(steps=[{**step, "messages": [[10**30, 1, 0.5]]}, base["steps"][1]]),
        "weight NaN": variant(steps=[{**step, "messages": [[0, 1, float("nan")]]}, base["steps"][1]]),
        "weight Infinity": variant(steps=[{**step, "messages": [[0, 1, float("inf")]]}, base["steps"][1]]),
        "steps not a list": variant(steps={"1": step}),
        "too few steps": variant(steps=base["steps"][:1]),
        "custom schedule of another length": variant(schedule={"c": [0.5, 0.5], "Z": [[1.0], [-1.0]]}),
        "sigma_star inf": variant(sigma_star="inf"),
        "empty file": "",
        "not UTF-8": b"\xff\xfe\x00garbage",
        "not an object": "[1, 2, 3]",
    }


_AUDIT_ALL = """
import contextlib, io, json, sys
from flwr_inca.cli import main
from flwr_inca.protocol import ExecutionTrace
out = {}
for path in sys.argv[1:]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(["audit", path])
        except BaseException as exc:
            code = f"raised {type(exc).__name__}"
    try:
        ExecutionTrace.load(path)
        loader = "loaded"
    except ValueError as exc:
        loader = "ValueError" if "\\n" not in str(exc) else "multi-line ValueError"
    except BaseException as exc:
        loader = f"raised {type(exc).__name__}"
    out[path] = [code, err.getvalue(), loader]
print(json.dumps(out))
"""


def test_crafted_traces_get_a_one_line_error_and_exit_2_within_2_gib(tmp_path):
    # in a child process whose address space is capped at 2 GiB: a file claiming 10^9 iterations must be
    # refused before anything of that size is allocated
    import resource
    import subprocess
    import sys

    files = {}
    for k, (name, text) in enumerate(_crafted_traces().items()):
        path = tmp_path / f"crafted-{k}.json"
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        files[str(path)] = name

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (2 * 2**30, 2 * 2**30))

    done = subprocess.run([sys.executable, "-c", _AUDIT_ALL, *files], capture_output=True, text=True,
                          preexec_fn=cap, timeout=300, check=False, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(done.stdout)
    assert len(results) == len(files) == 22
    wrong = [f"{files[path]}: exit {code}, loader {loader}, stderr {err[-200:]!r}"
             for path, (code, err, loader) in results.items()
             if code != 2 or loader != "ValueError" or not err.startswith("error: cannot read trace")
             or err.count("\n") != 1]
    assert not wrong, "\n".join(wrong)


def test_calibrate_paper_procedure_needs_epsilon_below_one(capsys):
    assert main(["calibrate", "--procedure", "paper", "--epsilon", "1.5", "--json", "-n", "20", "--runs", "2"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "epsilon < 1" in captured.err and "--procedure exact" in captured.err
    assert captured.err.count("\n") == 1


@pytest.mark.parametrize("argv, words", [
    (["audit", "TRACE", "--top", "-1"], "--top"),
    (["audit", "TRACE", "--top", "0"], "--top"),
    (["audit", "TRACE", "--top", "x"], "--top"),
])
def test_bad_audit_arguments_are_rejected(trace_file, capsys, argv, words):
    path, _ = trace_file
    with pytest.raises(SystemExit) as info:
        main([str(path) if a == "TRACE" else a for a in argv])
    assert info.value.code == 2 and words in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["mean", "-n", "10", "--seed", "-1"], "argument --seed: must be an integer >= 0"),
    (["audit", "TRACE", "--seed", "-1"], "argument --seed: must be an integer >= 0"),
    (["mean", "-n", "10", "--dim", "100000000000"], "--parties x --dim = 10 x 100000000000 values would need"),
    (["audit", "TRACE", "--corrupted", "a,b"], "--corrupted must be comma-separated party indices"),
])
def test_more_bad_arguments_name_the_option(trace_file, capsys, argv, words):
    path, _ = trace_file
    try:
        code = main([str(path) if a == "TRACE" else a for a in argv])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and words in err and "Traceback" not in err


def _commands():
    from flwr_inca.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return parser, sub.choices


def test_every_command_explains_every_option():
    parser, commands = _commands()
    assert set(commands) == {"mean", "calibrate", "audit", "attack", "simulate", "reproduce", "study"}
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


def test_progress_bar_times_from_its_creation_not_from_the_first_report(capsys):
    # calibrate reports after each simulated run: the first run's work must count in the elapsed time
    import time

    from flwr_inca.cli import _progress

    report = _progress("runs")
    time.sleep(1.2)
    report(1, 2)
    report(2, 2)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("runs")]
    assert lines and re.search(r"100% [1-9]\d*s$", lines[-1]), lines

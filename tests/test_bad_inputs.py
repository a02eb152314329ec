"""Bad files and arguments never crash with a traceback or allocate without limit.

Each bad command line runs in this process (``flwr_inca.cli.main``): exit status 2, one line on stderr naming
the parameter (and its range, or the limit), no traceback. Each bad API setting raises ``ValueError`` naming
it. Sizes that would need gigabytes are refused before anything of that size is allocated: those tests run
with the memory limit set to 1 GiB (``FLWR_INCA_MAX_BYTES``, so that they mean the same on every machine)
and under an address-space cap (``memory_cap``), so that a size the code failed to refuse fails the test
with a ``MemoryError`` instead of filling the machine.
"""

from __future__ import annotations

import csv
import json
import math
import re
import resource
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from flwr_inca import IncaConfig, run_inca
from flwr_inca._checks import MEMORY_ENV, memory_limit
from flwr_inca.cli import main
from flwr_inca.privacy import BoundSettings, calibrate, certify, collusion_view, random_collusion
from flwr_inca.protocol import ExecutionTrace, InjectionSchedule, TraceStep
from flwr_inca.protocol.engine import sample_trace
from flwr_inca.protocol.topology import Messages
from flwr_inca.protocol.utility import output_coefficients

LIMIT = 2**30  # the memory limit of every test here (FLWR_INCA_MAX_BYTES)


@pytest.fixture(autouse=True)
def _one_gib_and_one_blas_thread(monkeypatch):
    monkeypatch.setenv(MEMORY_ENV, str(LIMIT))
    with threadpool_limits(1):
        yield


@pytest.fixture
def memory_cap():
    """This process's address space capped at what it maps now plus 3 GiB while the test runs."""
    try:
        with open("/proc/self/statm") as f:
            mapped = int(f.read().split()[0]) * resource.getpagesize()
    except OSError:  # not Linux: no cap (the limits are still checked)
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = mapped + 3 * 2**30 if hard == resource.RLIM_INFINITY else min(mapped + 3 * 2**30, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _trace_dict(parties: int, iterations: int, **changes) -> dict:
    """A small trace file's content: ``parties`` parties, every one offline after initialization."""
    return {"format": "inca-trace/1", "parties": parties, "iterations": iterations, "schedule": "incremental",
            "sigma_star": 1.0, "sigma_delta": 1.0, "steps": [{"online": [], "messages": []}] * iterations,
            **changes}


@pytest.fixture
def files(tmp_path) -> dict[str, Path]:
    """Trace files named by the ``{name}`` placeholders of the command lines below."""
    good = run_inca(np.random.default_rng(0).random((12, 1)),
                    IncaConfig(iterations=3, sigma_star=0.5, sigma_delta=2.0), seed=0).trace
    out = {"good": tmp_path / "good.json", "missing": tmp_path / "missing.json", "dir": tmp_path,
           "file": tmp_path / "a-file"}
    good.save(out["good"])
    out["file"].write_text("x")
    text = json.dumps(good.to_dict())
    step = good.to_dict()["steps"][0]
    contents = {
        # the files: 170 bytes claiming 30,000 or 10^7 parties, 30,000 iterations, sigma 1e308
        "n30000": json.dumps(_trace_dict(30000, 1)),
        "n1e7": json.dumps(_trace_dict(10**7, 1)),
        "T30000": json.dumps(_trace_dict(10, 30000)),
        "sigma1e308": json.dumps({**good.to_dict(), "sigma_star": 1e308}),
        "empty": "",
        "truncated": text[: len(text) // 2],
        "offline sender": json.dumps({**good.to_dict(), "steps": [{**step, "online": [1, 2]}] + good.to_dict()["steps"][1:]}),
        "not stochastic": json.dumps({**good.to_dict(), "steps": [{**step, "messages": [[0, 1, 0.7], [0, 2, 0.7]]}]
                                      + good.to_dict()["steps"][1:]}),
        "parties below an index": json.dumps({**good.to_dict(), "parties": 11}),
    }
    for name, content in contents.items():
        out[name] = tmp_path / f"{name.replace(' ', '-')}.json"
        out[name].write_text(content)
    out["huge"] = tmp_path / "huge.json"
    with out["huge"].open("wb") as f:  # 64 MiB claimed, nothing written (a sparse file)
        f.truncate(64 * 2**20)
    return out


def _run(argv: list[str], files: dict[str, Path], capsys) -> tuple[int, str, str]:
    argv = [str(files[a[1:-1]]) if a.startswith("{") else a for a in argv]
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


# (command line, words the one line must hold); {name}: a file of the ``files`` fixture
TINY_STUDY = ["study", "mnist", "--grid", "tiny", "--out", "{missing}"]  # a study that would write to a new path

BAD_COMMAND_LINES = [
    # the issue's
    (["calibrate", "--epsilon", "1e-300", "-n", "20", "--runs", "1"], "--epsilon: must be in [1e-06, 1e+06]"),
    (["calibrate", "--value-sensitivity", "1e308", "-n", "20", "--runs", "1"], "--value-sensitivity: must be in"),
    (["mean", "--sigma-star", "1e308", "--sigma-delta", "1e308"], "--sigma-star: must be in [0, 1e+100]"),
    (["mean", "--iterations", "1000000000"], "--iterations/-T: must be 'auto' or an integer in [1, 1000]"),
    (["simulate", "--rounds", "1000000000", "--backend", "inline"], "--rounds/-R: must be an integer in [1, 100000]"),
    (["simulate", "--iterations", "30000", "--backend", "inline"],
     "--iterations/-T: must be 'auto' or an integer in [1, 1000], got 30000"),
    (["simulate", "--iterations", "abc", "--backend", "inline"],
     "--iterations/-T: must be 'auto' or an integer in [1, 1000], got 'abc'"),
    (["audit", "{sigma1e308}"], "sigma_star must be in [0, 1e+100], got 1e+308"),
    (["audit", "{T30000}"], "iterations must be an integer in [1, 1000], got 30000"),
    (["audit", "{n1e7}"], "over the limit of 1 GiB"),
    # mean
    (["mean", "--parties", "1"], "--parties/-n: must be an integer in [2, 10000000]"),
    (["mean", "--parties", "100000000"], "--parties/-n"),
    (["mean", "--parties", "1e3"], "--parties/-n"),
    (["mean", "--parties", "9" * 5000], "--parties/-n"),
    (["mean", "-n", "10", "--dim", "100000000000"], "--parties x --dim = 10 x 100000000000 values would need"),
    (["mean", "--dim", "0"], "--dim/-d"),
    (["mean", "--clip", "nan"], "--clip"),
    (["mean", "--clip", "-1"], "--clip"),
    (["mean", "--clip", "1e308"], "--clip"),
    (["mean", "--epsilon", "nan"], "--epsilon"),
    (["mean", "--epsilon", "inf"], "--epsilon"),
    (["mean", "--epsilon", "0"], "--epsilon"),
    (["mean", "--delta", "nan"], "--delta: must be in (0, 1)"),
    (["mean", "--collusion", "1"], "--collusion: must be in [0, 1)"),
    (["mean", "--collusion", "-0.1"], "--collusion"),
    (["mean", "--runs", "0"], "--runs"),
    (["mean", "--runs", "1000000000"], "--runs: must be an integer in [1, 100000]"),
    (["mean", "--seed", "-1"], "--seed"),
    (["mean", "--neighbors", "0"], "--neighbors/-k"),
    (["mean", "-n", "10", "--neighbors", "10", "--runs", "1"], "neighbors must be in [1, n-1] = [1, 9]"),
    (["mean", "--dropout", "permanent:nan"], "--dropout"),
    (["mean", "--dropout", "markov:2"], "--dropout"),
    (["mean", "--sigma-star", "-1", "--sigma-delta", "1"], "--sigma-star"),
    (["mean", "--iterations", "x"], "--iterations/-T"),
    # calibrate
    (["calibrate", "--observed-fraction", "2"], "--observed-fraction: must be in [0, 1]"),
    (["calibrate", "--target-success", "0"], "--target-success: must be in (0, 1]"),
    (["calibrate", "--value-sensitivity", "0"], "--value-sensitivity"),
    (["calibrate", "--epsilon", "1e300"], "--epsilon"),
    (["calibrate", "-n", "10", "-k", "10", "--runs", "1"], "neighbors must be in [1, n-1]"),
    # audit
    (["audit", "{good}", "--collusion", "1"], "--collusion"),
    (["audit", "{good}", "--observed-fraction", "nan"], "--observed-fraction"),
    (["audit", "{good}", "--adversarial", "2"], "--adversarial"),
    (["audit", "{good}", "--value-sensitivity", "inf"], "--value-sensitivity"),
    (["audit", "{good}", "--delta", "0"], "--delta"),
    (["audit", "{good}", "--top", "0"], "--top"),
    (["audit", "{good}", "--corrupted", "0,1,2,3,4,5,6,7,8,9,10,11"], "--corrupted: at least one party must be honest"),
    (["audit", "{good}", "--corrupted", "-1"], "--corrupted"),
    (["audit", "{good}", "--corrupted", "3," + "9" * 30], "--corrupted: party indices must be in [0, 11]"),
    (["audit", "{missing}"], "cannot read trace"),
    (["audit", "{dir}"], "cannot read trace"),
    (["audit", "{empty}"], "not valid JSON"),
    (["audit", "{truncated}"], "not valid JSON"),
    (["audit", "{offline sender}"], "involves an offline party"),
    (["audit", "{not stochastic}"], "cannot read trace"),
    (["audit", "{parties below an index}"], "party indices in [0, 10]"),
    (["audit", "{huge}"], "trace: a file of 67108864 bytes would need about 1.56 GiB"),
    # simulate: refused before any data is loaded
    (["simulate", "--clients", "1"], "--clients/-n"),
    (["simulate", "--fraction", "0"], "--fraction: must be in (0, 1]"),
    (["simulate", "--fraction", "nan"], "--fraction"),
    (["simulate", "--lr", "nan"], "--lr"),
    (["simulate", "--clip-norm", "1e308"], "--clip-norm"),
    (["simulate", "--batch-size", "0"], "--batch-size"),
    (["simulate", "--local-steps", "1000000000"], "--local-steps"),
    (["simulate", "--epsilon", "x"], "--epsilon"),
    (["simulate", "--epsilon", "0"], "--epsilon"),
    (["simulate", "--delta", "1"], "--delta"),
    (["simulate", "--noise-multiplier", "0"], "--noise-multiplier"),
    (["simulate", "--num-actors", "0"], "--num-actors"),
    (["simulate", "--threat-draws", "1000000000"], "--threat-draws"),
    (["simulate", "--calibration-runs", "1000000000"], "--calibration-runs"),
    (["simulate", "--certify-every", "0"], "--certify-every"),
    (["simulate", "--seed", "-1"], "--seed"),
    (["simulate", "--partition", "dirichlet:nan"], "--partition: the Dirichlet alpha must be in (0, 1e+100]"),
    (["simulate", "--partition", "shards"], "--partition"),
    (["simulate", "--availability", "markov:2,0", "--backend", "inline"], "--availability"),
    (["simulate", "--mode", "bogus", "--backend", "inline"], "mode must be one of"),
    # reproduce
    (["reproduce", "fig1", "--runs", "0"], "--runs"),
    (["reproduce", "fig1", "--runs", "1000000000"], "--runs: must be an integer in [1, 100000]"),
    (["reproduce", "fig1", "--seed", "-1"], "--seed"),
    (["reproduce", "fig9"], "figure"),
    (["reproduce", "fig1", "--out", "{file}"], "out (--out) must be a directory"),
    # the frontier at a size whose certificates would not fit: refused before the first run is certified
    (["reproduce", "frontier", "--parties", "20000", "--protocols", "gopa", "--gammas", "0.1", "--runs", "1",
      "--out", "{dir}"], "the exact certificate of one GOPA run (16202 observed values of 18000 honest parties)"),
    (["reproduce", "frontier", "--parties", "20000", "--protocols", "cordp-dme", "--gammas", "0.1", "--runs", "1",
      "--out", "{dir}"], "the complete graph of 20000 parties (199990000 pairs) would need about 8.94 GiB"),
    (["reproduce", "frontier", "--parties", "1000000", "--protocols", "inca", "--runs", "1", "--out", "{dir}"],
     "the bound on the certificate of a simulated run of 1000000 parties over 10 iterations"),
    # study
    (["study", "mnist", "--clients", "2", "--out", "{dir}"], "clients (each) must be an integer in [3, 10000000]"),
    (["study", "mnist", "--clients", "x"], "--clients"),
    (["study", "mnist", "--epsilons", "nan", "--out", "{dir}"], "epsilons"),
    (["study", "mnist", "--gammas", "1", "--out", "{dir}"], "gammas"),
    (["study", "mnist", "--seeds", "-1", "--out", "{dir}"], "seeds"),
    (["study", "mnist", "--partitions", "dirichlet:0", "--out", "{dir}"], "partition"),
    (["study", "cifar"], "dataset"),
    # study: each option checked as it is parsed, before anything runs
    ([*TINY_STUDY, "--iterations", "0"],
     "error: argument --iterations: must be 'auto' or an integer in [1, 1000], got 0 (see"),
    ([*TINY_STUDY, "--max-iterations", "-3"],
     "error: argument --max-iterations: must be an integer in [1, 1000], got -3 (see"),
    ([*TINY_STUDY, "--epsilons", "1,abc"],
     "error: argument --epsilons: must be a finite number, got 'abc' (item 2 of '1,abc') (see"),
    ([*TINY_STUDY, "--seeds", "1.5"], "error: argument --seeds: must be an integer, got '1.5' (see"),
    ([*TINY_STUDY, "--tune-gamma", "2"], "error: argument --tune-gamma: must be in [0, 1), got 2.0 (see"),
    ([*TINY_STUDY, "--tune-epsilon", "0"], "error: argument --tune-epsilon: must be in [1e-06, 1e+06], got 0.0 (see"),
    ([*TINY_STUDY, "--tune-lr", ","], "error: argument --tune-lr: expected a comma-separated list, got ',' (see"),
    # the command itself
    (["bogus"], "invalid choice"),
    ([], "required"),
]


@pytest.mark.parametrize("argv, words", BAD_COMMAND_LINES, ids=[" ".join(a)[:60] for a, _ in BAD_COMMAND_LINES])
def test_a_bad_command_line_gets_one_line_and_exit_status_2(argv, words, files, capsys, memory_cap):
    code, out, err = _run(argv, files, capsys)
    assert code == 2, (code, out[-300:], err[-300:])
    assert len(err.strip().splitlines()) == 1, err
    assert words in err and "Traceback" not in err, err
    assert not files["missing"].exists()  # nothing written where a refused command line named a new path


def test_a_trace_of_30000_parties_and_no_message_is_audited_without_a_dense_matrix(files, capsys, memory_cap):
    """The issue's 170-byte file: the adversary observes no honest message, so every mu is 0 -- found without
    the exact method's (n, n_H) matrix (6.5 GB), and the solver is chosen by n as well."""
    code, out, err = _run(["audit", "{n30000}", "--json"], files, capsys)
    assert code == 0, err
    result = json.loads(out)
    assert result["max_mu"] == 0.0 and len(result["mu"]) == 27000 and result["method"] == "exact"


def _all_online(parties: int, iterations: int) -> ExecutionTrace:
    """Every party online at every step, no message: every final is observed."""
    everyone = np.arange(parties)
    empty = Messages(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0))
    return ExecutionTrace(parties, iterations, InjectionSchedule.incremental(iterations), 1.0, 1.0,
                          [TraceStep(everyone, empty)] * iterations)


def test_the_solver_is_chosen_by_parties_too_and_sizes_are_refused_before_allocating(memory_cap):
    from flwr_inca.privacy import choose_solver
    from flwr_inca.privacy.certificate import EXACT_MAX_PARTIES, EXACT_MAX_ROWS

    big = _all_online(EXACT_MAX_PARTIES + 1, 1)
    colluders = max(1, big.parties - EXACT_MAX_ROWS + 1)  # the other finals seen: fewer than EXACT_MAX_ROWS
    few = collusion_view(big, np.arange(colluders))
    assert int(few.honest_observed().sum()) < EXACT_MAX_ROWS
    assert choose_solver(big, few) == "bound"  # by n: the exact method would keep (n, n) matrices
    wide = _all_online(30000, 1)
    view = random_collusion(wide, 0.1, seed=0)
    with pytest.raises(ValueError, match="too large for the exact method"):
        certify(wide, view, solver="exact")
    long = _all_online(1000, 1000)  # T = 1000: the (T+1, n, T) dropout-adapted schedule is 8 GB
    with pytest.raises(ValueError, match=r"exact certificate of 1000 parties .* over the limit of 1 GiB .*"
                                         r"solver='bound'"):
        certify(long, random_collusion(long, 0.1, seed=0), solver="exact")
    # auto: the exact method does not fit the limit, so the bound is tried, and it does not fit either
    for solver in ("auto", "bound"):
        with pytest.raises(ValueError, match="the bound on the certificate of 1000 parties over 1000 iterations"):
            certify(long, random_collusion(long, 0.1, seed=0), solver=solver)
    with pytest.raises(ValueError, match="output coefficients of 1000 parties over 1000 iterations"):
        output_coefficients(long)


def _config(**changes) -> IncaConfig:
    return IncaConfig(**{"sigma_star": 1.0, "sigma_delta": 1.0, **changes})


def _small_trace() -> ExecutionTrace:
    return sample_trace(12, _config(iterations=3), seed=0)


# (call, words the ValueError must hold)
BAD_API_CALLS = [
    (lambda: _config(iterations=10**9), "iterations must be an integer in [1, 1000]"),
    (lambda: _config(iterations=2.5), "iterations"),
    (lambda: _config(neighbors=True), "neighbors"),
    (lambda: _config(sigma_star=1e308), "sigma_star must be in [0, 1e+100]"),
    (lambda: _config(sigma_delta=math.nan), "sigma_delta"),
    (lambda: _config().check(10**8), "number of parties n must be an integer in [2, 10000000]"),
    (lambda: _config(topology="complete").check(10**5), "the trace of 100000 parties over 10 iterations would need"),
    (lambda: sample_trace(10**6, _config(iterations=1000)), "over the limit of 1 GiB"),
    (lambda: calibrate(1e-300, 1e-5, 20), "epsilon must be in [1e-06, 1e+06]"),
    (lambda: calibrate(1.0, 1e-5, 20, value_sensitivity=1e308), "value_sensitivity must be in (0, 1e+100]"),
    (lambda: calibrate(1.0, 0.0, 20), "delta"),
    (lambda: calibrate(1.0, 1e-5, 20, runs=10**9), "runs must be an integer in [1, 100000]"),
    (lambda: calibrate(1.0, 1e-5, 10**8), "parties must be an integer in [2, 10000000]"),
    (lambda: calibrate(1.0, 1e-5, 20, alphas=(math.nan,)), "alphas"),
    (lambda: calibrate(1.0, 1e-5, 20, min_alpha=math.inf), "min_alpha"),
    (lambda: calibrate(1.0, 1e-5, 20, solver="fast"), "solver must be one of"),
    (lambda: calibrate(1.0, 1e-5, 20, bound_settings="fast"), "bound_settings"),
    (lambda: calibrate(1.0, 1e-5, 20, observed_fraction=math.nan), "observed_fraction"),
    (lambda: calibrate(1.0, 1e-5, 10**6, iterations=20), "the bound on the certificate of a simulated run of 1000000"),
    (lambda: certify(_small_trace(), random_collusion(_small_trace(), 0.1, 0), sigma_star=1e308), "sigma_star"),
    (lambda: certify(_small_trace(), random_collusion(_small_trace(), 0.1, 0), value_sensitivity=0), "value_sensitivity"),
    (lambda: certify(_small_trace(), random_collusion(_small_trace(), 0.1, 0), delta=1.0), "delta"),
    (lambda: certify("trace.json", random_collusion(_small_trace(), 0.1, 0)), "trace must be an ExecutionTrace"),
    (lambda: ExecutionTrace.from_dict(_trace_dict(10, 30000)), "iterations must be an integer in [1, 1000]"),
    (lambda: ExecutionTrace.from_dict(_trace_dict(10**8, 1)), "parties must be an integer in [2, 10000000]"),
    (lambda: ExecutionTrace.from_dict(_trace_dict(10, 1, sigma_delta=1e308)), "sigma_delta must be in [0, 1e+100]"),
    (lambda: ExecutionTrace.from_json(b" " * (2**30 // 16)), "trace: a file of 67108864 bytes"),
    (lambda: BoundSettings(batch=0), "BoundSettings.batch"),
    (lambda: BoundSettings(batch=10**9), "BoundSettings.batch"),
    (lambda: BoundSettings(iterations=-1), "BoundSettings.iterations"),
    (lambda: BoundSettings(tolerance=math.nan), "BoundSettings.tolerance"),
    (lambda: _round_cost(-1.0), "mu must be >= 0"),
    # the baselines' exact certificates and executions, refused before they are built
    (lambda: _baseline_model("GOPA", 20000), "the exact certificate of one GOPA run"),
    (lambda: _baseline_model("local DP", 20000), "the exact certificate of one local DP run"),
    (lambda: _baseline_model("DP gossip", 3000), "the exact certificate of one DP gossip run"),
    (lambda: _baseline_model("IncA", 20000), "the exact certificate of one IncA run"),
    (lambda: _baseline_model("CorDP-DME", 20000), "the complete graph of 20000 parties"),
    (lambda: _baseline_run("CorDP-DME", 2000, 200), "the pairwise terms of CorDP-DME's 1999000 edges x 200 coordinates"),
    (lambda: _round_cost(0.1, 1.5), "sample_rate must be in (0, 1]"),
]


def _baseline(name: str):
    from flwr_inca.baselines import GOPA, CorDPDME, DPGossip, IncaBaseline, LocalDP

    return {"GOPA": lambda: GOPA(1.0, 1.0, 0.1), "CorDP-DME": lambda: CorDPDME(1.0, 1.0, 0.1),
            "local DP": lambda: LocalDP(1.0), "DP gossip": lambda: DPGossip(1.0, iterations=20),
            "IncA": lambda: IncaBaseline(_config())}[name]()


def _baseline_model(name: str, n: int):
    from flwr_inca.baselines import Threat

    baseline = _baseline(name)
    execution = baseline.sample_execution(n, 0)
    return baseline.observation_model(execution, baseline.adversary(execution, Threat.collusion(0.1), 1))


def _baseline_run(name: str, n: int, dim: int):
    baseline = _baseline(name)
    return baseline.execute(np.zeros((n, dim)), baseline.sample_execution(n, 0), seed=0)


def _round_cost(mu: float, sample_rate: float = 1.0):
    from flwr_inca.privacy.accountants import RoundCost

    return RoundCost(mu, sample_rate)


@pytest.mark.parametrize("call, words", BAD_API_CALLS, ids=[w[:50] for _, w in BAD_API_CALLS])
def test_a_bad_api_setting_raises_a_value_error_naming_it(call, words, memory_cap):
    with pytest.raises(ValueError) as info:
        call()
    assert words in str(info.value) and "\n" not in str(info.value)


def test_the_planning_and_accounting_limits_name_the_setting(monkeypatch):
    from flwr_inca.privacy.plan import privacy_plan
    from flwr_inca.reproduce import reproduce
    from flwr_inca.study import StudyGrid

    # the issue: rounds = 10^9 at party level said "epsilon must be > 0, got 0.0"
    with pytest.raises(ValueError, match=r"rounds must be an integer in \[1, 100000\]"):
        privacy_plan("party", epsilon=1.0, delta=1e-5, rounds=10**9, clip_norm=1.0)
    for kwargs, words in [({"runs": 10**9}, "runs (--runs)"), ({"runs": True}, "runs (--runs)"),
                          ({"seed": -1}, "seed (--seed)")]:
        with pytest.raises(ValueError, match=re.escape(words)):
            reproduce(["fig1"], **kwargs)
    for kwargs, words in [({"clients": (10**8,)}, "clients"), ({"epsilons": (math.nan,)}, "epsilons"),
                          ({"tune_lr": (math.nan,)}, "tune_lr"), ({"seeds": (-1,)}, "seeds"),
                          ({"tune_rounds": (10**9,)}, "tune_rounds")]:
        with pytest.raises(ValueError, match=words):
            StudyGrid(**kwargs)
    monkeypatch.setenv(MEMORY_ENV, "plenty")
    with pytest.raises(ValueError, match=MEMORY_ENV):
        memory_limit()


def test_the_prv_accountant_refuses_a_grid_that_would_not_fit(monkeypatch):
    pytest.importorskip("opacus")
    from flwr_inca.privacy.accountants import OpacusPrvAccountant, OpacusRdpAccountant, RoundCost

    with pytest.raises(ValueError, match="eps_error"):
        OpacusPrvAccountant(eps_error=math.nan)
    with pytest.raises(ValueError, match="delta"):
        OpacusPrvAccountant().epsilon([RoundCost(0.1, 0.01)], delta=0.0)
    with pytest.raises(ValueError, match="delta"):  # it gave a negative epsilon at delta = 2
        OpacusRdpAccountant().epsilon([RoundCost(0.1, 0.1)], delta=2.0)
    with pytest.raises(ValueError, match=r"orders \(each\) must be a finite number > 1"):
        OpacusRdpAccountant(orders=[0.5])
    # mu = 1e-300 (noise multiplier 1e300) overflowed inside Opacus; composed as the smallest mu: the same
    # epsilon (one accountant: the second query is the first one's, remembered)
    prv = OpacusPrvAccountant()
    tiny = [prv.epsilon([RoundCost(mu, 0.5)] * 3, 1e-5) for mu in (1e-300, 1e-100)]
    assert tiny[0] == tiny[1] and math.isfinite(tiny[0])
    monkeypatch.setenv(MEMORY_ENV, str(2**20))
    with pytest.raises(ValueError, match="PRV accountant's grid for 1000 rounds .* over the limit of 1 MiB"):
        OpacusPrvAccountant().epsilon([RoundCost(0.1, 0.01)] * 1000, delta=1e-5)


@pytest.mark.parametrize("mu, sample_rate", [(10**-7.75, 1e-5), (10**-7.75, 1e-4), (10**-7.75, 1e-3), (1e-8, 0.01)])
def test_a_round_of_almost_no_cost_never_stops_the_opacus_accountants(mu, sample_rate):
    """Opacus's Renyi-DP curve raises for these noise multipliers (found by a scan of mu in [1e-10, 10]):
    such a round is composed as the smallest mu, never below what Opacus gives at a smaller mu it can
    compute, and with a history of real rounds the tiny one adds (almost) nothing."""
    pytest.importorskip("opacus")
    import warnings

    from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

    from flwr_inca.privacy.accountants import OpacusPrvAccountant, OpacusRdpAccountant, RoundCost
    from flwr_inca.privacy.accountants.rdp import ORDERS

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="non-negative"):  # Opacus itself, on the round as it is
            compute_rdp(q=sample_rate, noise_multiplier=1 / mu, steps=1, orders=list(ORDERS))
        tiny, real = RoundCost(mu, sample_rate), RoundCost(0.5, sample_rate)
        for accountant, slack in ((OpacusRdpAccountant(), 1e-6), (OpacusPrvAccountant(), 0.01)):
            eps = accountant.epsilon([tiny] * 3, 1e-5)
            assert math.isfinite(eps) and eps > 0, accountant.name
            # the PRV's grid depends on the number of rounds: within its eps_error, not monotone
            alone, both = accountant.epsilon([real], 1e-5), accountant.epsilon([real, tiny], 1e-5)
            assert alone - slack <= both <= alone + slack, accountant.name
        # never below Opacus at a smaller mu it can compute (the RDP accountant: its own orders)
        smaller = compute_rdp(q=sample_rate, noise_multiplier=1e10, steps=3, orders=list(ORDERS))
        assert get_privacy_spent(orders=list(ORDERS), rdp=smaller, delta=1e-5)[0] <= \
            OpacusRdpAccountant().epsilon([tiny] * 3, 1e-5)


# ------------------------------------------------------------------------------------------ study --resume
def _key(row: dict) -> tuple:
    """A run's identity in runs.csv, as the study's run_one receives it."""
    return (row["phase"], row["method"], int(row["clients"]), row["partition"], float(row["epsilon"]),
            float(row["gamma"]), int(row["seed"]), float(row["lr"]), float(row["clip"]), int(row["rounds"]))


def _study(tmp_path, monkeypatch):
    """A one-method study whose runs are recorded instead of trained (the resume logic is under test)."""
    from flwr_inca.simulation.data import Dataset
    from flwr_inca.study import TINY_GRID, mnist

    grid = replace(TINY_GRID, methods=("fedavg", "central-dp"), epsilons=(1.0,), gammas=(0.0,), tune_lr=(0.5, 1.0),
                   tune_clip=(1.0,), tune_rounds=(2,), validation=50, train_examples=None, test_examples=None)
    rng = np.random.default_rng(0)
    x, y = rng.random((300, 4), dtype=np.float32), rng.integers(0, 3, 300)
    data = Dataset(x[:200], y[:200], x[200:], y[200:], "random")
    ran: list[tuple] = []

    def run_one(data, grid, method, n, part, eps, gamma, seed, lr, clip, rnds, phase, cache):
        ran.append((phase, method, n, part, float(eps), float(gamma), seed, float(lr), float(clip), int(rnds)))
        return mnist.RunResult(phase, method, n, part, eps, gamma, seed, lr, clip, rnds, accuracy=0.5 + lr / 10,
                               test_accuracy=0.5, rounds_done=rnds, seconds=0.1, note="a note, with a comma")

    monkeypatch.setattr(mnist, "run_one", run_one)
    return lambda **kw: mnist.run_study(data, grid, tmp_path, **kw), ran


def test_study_resume_skips_a_torn_last_row_with_a_warning_and_redoes_that_run(tmp_path, monkeypatch):
    study, ran = _study(tmp_path, monkeypatch)
    study(log=lambda line: None)
    every = list(ran)
    with (tmp_path / "runs.csv").open(newline="") as f:
        lines = f.read().splitlines(keepends=True)
    rows = list(csv.DictReader(lines))
    assert len(rows) == len(lines) - 1 >= 3 and len(every) >= 3
    reused = {_key(row) for row in rows[:2]}
    assert reused <= set(every) and _key(rows[2]) in every
    # a study killed while appending its third run: two complete rows, the third cut after its "rounds" field
    torn = ",".join(lines[3].split(",")[:10])
    with (tmp_path / "runs.csv.partial").open("w", newline="") as f:
        f.write("".join(lines[:3]) + torn)
    (tmp_path / "runs.csv").unlink()
    ran.clear()
    log: list[str] = []
    study(resume=True, log=log.append)
    warnings = [line for line in log if "warning" in line]
    assert len(warnings) == 1 and "runs.csv.partial, line 4" in warnings[0] and "done again" in warnings[0]
    assert sorted(ran) == sorted(k for k in every if k not in reused)  # the torn row's run is redone
    final = list(csv.DictReader((tmp_path / "runs.csv").open(newline="")))
    assert sorted(_key(row) for row in final) == sorted(_key(row) for row in rows)
    assert all(None not in row and None not in row.values() for row in final)
    assert not (tmp_path / "runs.csv.partial").exists()


def test_study_resume_removes_a_partial_file_whose_header_was_cut(tmp_path, monkeypatch):
    study, ran = _study(tmp_path, monkeypatch)
    (tmp_path / "runs.csv.partial").write_text("phase,method,cli")  # killed while writing the first run
    log: list[str] = []
    study(resume=True, log=log.append)
    assert any("only a cut header line" in line for line in log) and ran
    assert list(csv.DictReader((tmp_path / "runs.csv").open(newline="")))[0]["phase"] == "tune"


def test_study_resume_refuses_a_damaged_row_that_is_not_the_last_naming_the_file_and_line(tmp_path, monkeypatch):
    study, _ = _study(tmp_path, monkeypatch)
    study(log=lambda line: None)
    with (tmp_path / "runs.csv").open(newline="") as f:
        lines = f.read().splitlines(keepends=True)
    lines[2] = "tune,fedavg,8,iid\r\n"  # a row edited by hand, not a torn append
    with (tmp_path / "runs.csv.partial").open("w", newline="") as f:
        f.write("".join(lines))
    with pytest.raises(ValueError, match=r"runs\.csv\.partial, line 3: not a complete run"):
        study(resume=True, log=lambda line: None)

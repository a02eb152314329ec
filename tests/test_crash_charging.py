"""Charged before released, whatever happens to the process: ``kill -9`` at random points of real rounds,
a disk that fills up, two runs on one ledger.

The ServerApp is tests/crash_app.py, run as a child process; it logs every mixing request durably before
the grid delivers it, so the log is an upper bound of what was released. The nodes draw their randomness
from fixed seeds and nobody drops out, so a round's execution is the same in every run: a reference run
gives each round's trace, and from it the exact cost of what any logged prefix released (its messages
of iterations 1..t, or with its finals). After a kill, a process opening the ledger (which charges the
reservations the killed run left) must find every released round charged at least that much.
"""

from __future__ import annotations

import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from flwr_inca.privacy import PrivacyLedger  # noqa: E402

HERE = Path(__file__).parent
APP = HERE / "crash_app.py"
ROUNDS = 3


def _run(ledger: Path, log: Path, *, rounds=ROUNDS, max_epsilon=None, engine="inprocess", traces=None,
         preexec=None, timeout=300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    if traces is not None:
        env["CRASH_TRACE_DIR"] = str(traces)
    return subprocess.run([sys.executable, str(APP), str(ledger), str(log), str(rounds),
                           "none" if max_epsilon is None else repr(max_epsilon), engine], env=env,
                          capture_output=True, text=True, timeout=timeout, preexec_fn=preexec, check=False)


def _start(ledger: Path, log: Path, engine: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, str(APP), str(ledger), str(log), str(ROUNDS), "none", engine],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)


def _released(log: Path) -> dict[int, int]:
    """The largest commit logged per round (T + 1: the finals were asked for)."""
    out: dict[int, int] = {}
    if log.exists():
        for line in log.read_text().split("\n"):
            if line.strip():
                rnd, commit = map(int, line.split())
                out[rnd] = max(out.get(rnd, 0), commit)
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An undisturbed run: each round's trace, the rounds' certifier, the time a run takes."""
    sys.path.insert(0, str(HERE))
    import crash_app

    from flwr_inca.protocol.trace import ExecutionTrace

    tmp = tmp_path_factory.mktemp("reference")
    start = time.monotonic()
    done = _run(tmp / "ledger.json", tmp / "log", traces=tmp / "traces")
    assert done.returncode == 0 and "finished" in done.stdout, done.stderr[-3000:]
    traces = {r: ExecutionTrace.load(tmp / "traces" / f"round-{r:04d}.json") for r in range(1, ROUNDS + 1)}
    rounds = crash_app.strategy(None, None).inca
    charged = [e.mu for e in PrivacyLedger(tmp / "ledger.json", delta=1e-5).entries]
    return {"traces": traces, "rounds": rounds, "seconds": time.monotonic() - start, "charged": charged}


def _cost(reference, rnd: int, commit: int) -> float:
    """The exact cost of what a round released once its requests up to ``commit`` left: the messages of
    iterations 1..commit-1, and the finals when commit is T + 1 (all of them: an upper bound)."""
    prefix = reference["rounds"].prefix(reference["traces"][rnd], rnd)
    T = reference["traces"][rnd].iterations
    return prefix.with_finals().mu if commit > T else prefix.through(commit - 1).mu


def _check_nothing_released_uncharged(reference, ledger_path: Path, log: Path, exact: bool = True) -> tuple[int, int]:
    """Every round the log says released is charged in the ledger as the next process reads it (after it
    charged the reservations of the killed run): at least its exact cost (``exact``: the run's executions are
    the reference's), or else at least the no-finals ceiling of what it delivered, which bounds it whatever
    the execution (an engine whose node ids, hence executions, differ from run to run). Returns (rounds
    released, reservations recovered)."""
    released = _released(log)
    ledger = PrivacyLedger(ledger_path, delta=1e-5) if ledger_path.exists() else None
    by_round: dict[int, float] = {}
    for entry in ledger.entries if ledger is not None else []:
        rnd = int(entry.note.split(":")[0].split()[1])
        by_round[rnd] = max(by_round.get(rnd, 0.0), entry.mu)
        assert entry.status == "charged"  # nothing is left reserved once a reader opened it
    ceilings = reference["rounds"].ceilings(6)
    T = len(ceilings) - 1
    recovered = {int(e.note.split(":")[0].split()[1]) for e in (ledger.recovered if ledger is not None else [])}
    for rnd, commit in released.items():
        assert rnd in by_round, (rnd, commit, by_round)  # a released round is never missing
        if exact:
            cost = _cost(reference, rnd, commit)
        elif rnd in recovered:  # the killed run's reservation: at least the ceiling of what it delivered
            cost = ceilings[min(commit - 1, T)]
        else:  # charged by the training itself, on the execution that happened
            continue
        assert by_round[rnd] >= cost * (1 - 1e-9), (rnd, commit, by_round, cost)
    if ledger is not None and exact:
        truth = PrivacyLedger(None, delta=1e-5)
        for rnd, commit in released.items():
            truth.spend(_cost(reference, rnd, commit))
        assert ledger.epsilon() >= truth.epsilon() * (1 - 1e-9)
    return len(released), len(ledger.recovered) if ledger is not None else 0


def _wait_for_first_release(proc: subprocess.Popen, log: Path, deadline_s: float = 240.0) -> None:
    """Until the app logged its first mixing request (the engine is up and training) or ended."""
    end = time.monotonic() + deadline_s
    while not log.exists() and proc.poll() is None and time.monotonic() < end:
        time.sleep(0.05)


def _kill_trials(reference, tmp_path, engine: str, trials: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    outcomes = []
    for trial in range(trials):
        ledger, log = tmp_path / f"ledger-{trial}.json", tmp_path / f"log-{trial}"
        proc = _start(ledger, log, engine)
        try:
            assert proc.stdout.readline().strip() == "started"  # imports done; the training begins now
            if engine != "inprocess":  # the engine's start-up (Ray, its workers) takes long on a loaded machine
                _wait_for_first_release(proc, log)
            time.sleep(rng.uniform(0.0, reference["seconds"]))
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=60)
        outcomes.append(_check_nothing_released_uncharged(reference, ledger, log, exact=engine == "inprocess"))
    return outcomes


@pytest.mark.timeout(300)
def test_kill_9_at_random_points_never_leaves_a_released_round_uncharged(reference, tmp_path):
    outcomes = _kill_trials(reference, tmp_path, "inprocess", 8, seed=1)
    assert any(released for released, _ in outcomes)  # some kills came after messages left


@pytest.mark.slow
@pytest.mark.timeout(3000)
@pytest.mark.parametrize("engine, trials", [("inprocess", 40), ("simulation", 20)])
def test_kill_9_many_times_under_each_engine(reference, tmp_path, engine, trials):
    outcomes = _kill_trials(reference, tmp_path, engine, trials, seed=2)
    recovered = sum(r for _, r in outcomes)
    print(f"{engine}: {trials} kills, {sum(1 for r, _ in outcomes if r)} mid-training, "
          f"{recovered} reservation(s) recovered")
    assert any(released for released, _ in outcomes)


def _file_size_limit(limit: int):
    import resource

    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG), as ENOSPC
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


@pytest.mark.timeout(300)
def test_restarts_on_a_full_disk_release_nothing_uncharged(reference, tmp_path):
    """The review's scenario: after a first run, the ledger cannot grow (the disk is full: every write fails
    with EFBIG), and the ServerApp is restarted again and again. No round starts (its reservation cannot be
    written), so nothing leaves uncharged; once space is back, training resumes and is charged."""
    ledger, log = tmp_path / "ledger.json", tmp_path / "log"
    first = _run(ledger, log, rounds=1)
    assert first.returncode == 0, first.stderr[-2000:]
    spent = PrivacyLedger(ledger, delta=1e-5).epsilon()
    full = _file_size_limit(ledger.stat().st_size + 64)
    for restart in range(3):
        again = _run(ledger, log, rounds=2, preexec=full)
        assert again.returncode == 0, again.stderr[-2000:]
        assert "cannot be written" in again.stderr and "the round was not started" in again.stderr
    assert sorted(_released(log)) == [1]  # the restarts released nothing
    assert PrivacyLedger(ledger, delta=1e-5).epsilon() == spent
    _check_nothing_released_uncharged(reference, ledger, log)
    freed = _run(ledger, tmp_path / "log-after", rounds=1)
    assert freed.returncode == 0 and PrivacyLedger(ledger, delta=1e-5).epsilon() > spent


@pytest.mark.timeout(300)
def test_two_runs_on_one_ledger_reserve_against_one_budget(reference, tmp_path):
    """Two ServerApps of the same app (the same default owner) on one ledger at the same time: each round
    is reserved atomically against the budget both share, so together they never exceed it."""
    ledger, go = tmp_path / "ledger.json", tmp_path / "go"
    budget = PrivacyLedger(None, delta=1e-5)
    for cost in reference["charged"] * 2:  # room for about eight rounds of the ten the two runs want
        budget.spend(cost)
    max_epsilon = budget.epsilon()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "CRASH_START_FILE": str(go)}
    procs = [subprocess.Popen([sys.executable, str(APP), str(ledger), str(tmp_path / f"log-{k}"), "5",
                               repr(max_epsilon), "inprocess"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**env, "FLWR_INCA_STATE_DIR": str(tmp_path / f"nodes-{k}")})
             for k in range(2)]  # the nodes of each run keep their data apart (as distinct runs do)
    assert [p.stdout.readline().strip() for p in procs] == ["ready", "ready"]  # both imported, waiting
    go.touch()
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    final = PrivacyLedger(ledger, delta=1e-5)
    assert final.epsilon() <= max_epsilon * (1 + 1e-12)
    tokens = {e.run["token"] for e in final.entries}
    assert len(tokens) == 2, [o[0][-500:] for o in outs]  # both ran, and each entry says which run wrote it
    assert not final.reservations() and math.isfinite(final.epsilon())


# ---------------------------------------------------------------------------- Flower's deployment engine
def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _alive(pid: int) -> bool:
    """Running (not a zombie its parent has yet to reap, not gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _serverapp_pids(ancestor: int) -> list[int]:
    """The live ServerApp processes (``flwr-serverapp``) descending from process ``ancestor`` (the SuperLink:
    it starts them through its SuperExec)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "flwr-serverapp" not in cmdline:
            continue
        pid, hops = int(entry), 0
        while pid > 1 and pid != ancestor and hops < 20:
            pid, hops = _parent(pid), hops + 1
        if pid == ancestor:
            pids.append(int(entry))
    return pids


@pytest.mark.deployment
@pytest.mark.flower
@pytest.mark.timeout(1800)
# slow only: a SuperLink, 3 SuperNodes and flwr run per kill (35 s for one); the default suite kills the
# ServerApp in process (the same session, ledger and recovery) and kills a SuperNode on the deployment engine
@pytest.mark.slow
@pytest.mark.parametrize("trials", [pytest.param(1, id="1"), pytest.param(20, id="20")])
def test_kill_9_of_the_serverapp_on_the_deployment_engine(tmp_path, trials):
    """A real SuperLink and three SuperNodes; ``flwr run`` of the test app, and the ServerApp process the
    SuperLink started killed with SIGKILL at a random moment of its rounds, ``trials`` times: every round whose
    requests had left is charged in the ledger as the next process reads it (the killed run's reservation at
    least the no-finals ceiling of what it delivered)."""
    from test_deployment import NODES, Deployment, _settings, _wait_for

    from flwr_inca.flower import IncaStrategy

    reference = {"rounds": IncaStrategy(**{**_settings(), "iterations": 3}).inca}
    rng = random.Random(7)
    deployment = Deployment(tmp_path)
    kills = recovered = 0
    try:
        deployment.superlink()
        for partition in range(NODES):
            deployment.supernode(partition)
        for trial in range(trials):
            out, log, ledger = tmp_path / f"out-{trial}", tmp_path / f"log-{trial}", tmp_path / f"ledger-{trial}.json"
            out.mkdir()
            deployment.flwr_run(out, **{"out-dir": str(out), "ledger-path": str(ledger), "release-log": str(log),
                                        "num-server-rounds": 3, "iterations": 3})
            _wait_for("the first mixing request", log.exists, time.monotonic() + 600, deployment)
            time.sleep(rng.uniform(0.0, 8.0))
            pids = _serverapp_pids(deployment.procs["superlink"].pid)
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            _wait_for("the killed ServerApp to die", lambda: not any(map(_alive, pids)), time.monotonic() + 60,
                      deployment)
            kills += bool(pids)
            _, again = _check_nothing_released_uncharged(reference, ledger, log, exact=False)
            recovered += again
    finally:
        deployment.stop_all()
    print(f"deployment engine: {trials} run(s), {kills} ServerApp(s) killed mid-training, {recovered} "
          "reservation(s) recovered")
    assert kills >= 1

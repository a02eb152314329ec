"""End-to-end on Flower's deployment engine: a ``flower-superlink`` and three ``flower-supernode`` processes
(separate OS processes, insecure mode, distinct non-default ports, a temporary FLWR_HOME), the app of
``tests/deploy_app`` submitted with ``flwr run``, one SuperNode killed with SIGKILL in the middle of a
round's mixing, and a second ``flwr run`` that resumes the privacy ledger.

Every wait is on an event, with a deadline far beyond what a loaded machine needs: the node of partition
0 writes a marker file when it receives the mixing request of (round 1, commit 2) and blocks there; the
test then SIGKILLs its SuperNode's process group (the SuperNode and the ClientApp process it started),
reaps it, and says so in a second file, on which the ServerApp's grid answers the killed node's messages
with the error Flower's SuperLink returns for a node whose heartbeats lapsed (the SuperLink itself would
wait 30-60 s). The live nodes are never timed out (300 s exchange deadline): under load they answer
late, not never, so the round's outcome does not depend on the machine's speed. Every process started
here is stopped by its process group id in a ``finally``.

It runs in the default suite; alone with ``python -m pytest -m deployment``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr")

# most of its time is Flower starting a ClientApp process per message; the deadline covers both runs (the
# module's fixture runs in the first test's setup) on a heavily loaded machine
pytestmark = [pytest.mark.deployment, pytest.mark.flower, pytest.mark.timeout(600)]

APP = Path(__file__).parent / "deploy_app"
NODES, ITERATIONS, KILL_ROUND, KILL_COMMIT = 3, 2, 1, 2
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Deployment:
    """The processes of one local deployment; each in its own session, so that its process group
    (the SuperNode and the app processes it spawns) can be signalled as one."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.home = root / "flwr-home"
        self.home.mkdir()
        self.logs = root / "logs"
        self.logs.mkdir()
        self.port = _free_port()
        self.env = {**os.environ, "FLWR_HOME": str(self.home), "FLWR_TELEMETRY_ENABLED": "0",
                    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
                    "FLWR_INCA_STATE_DIR": str(root / "node-state"),
                    "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
        (self.home / "config.toml").write_text(
            '[superlink]\ndefault = "inca-test"\n\n'
            f'[superlink.inca-test]\naddress = "127.0.0.1:{self.port}"\ninsecure = true\n')
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, *args: str) -> subprocess.Popen:
        with open(self.logs / f"{name}.log", "wb") as log:
            proc = subprocess.Popen([str(BIN / args[0]), *args[1:]], stdout=log, stderr=subprocess.STDOUT,
                                    env=self.env, cwd=self.root, start_new_session=True)
        self.procs[name] = proc
        return proc

    def superlink(self) -> None:
        self.start("superlink", "flower-superlink", "--insecure", "--host", "127.0.0.1",
                   "--port", str(self.port), "--database", str(self.root / "state.db"))
        _wait_for("the SuperLink's port", self._listening, time.monotonic() + 120, self)

    def _listening(self) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def supernode(self, partition: int) -> subprocess.Popen:
        return self.start(f"supernode-{partition}", "flower-supernode", "--insecure",
                          "--superlink", f"127.0.0.1:{self.port}", "--host", "127.0.0.1",
                          "--port", str(_free_port()),
                          "--node-config", f"partition-id={partition} num-partitions={NODES}")

    def kill(self, name: str) -> None:
        """SIGKILL the process group of ``name`` (started by us: its group id is its pid), and reap it."""
        proc = self.procs[name]
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=60)

    def stop_all(self) -> None:
        for name, proc in reversed(list(self.procs.items())):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait(timeout=10)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    pass
            try:  # the group's other processes (app processes), if any are left
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=30)

    def flwr_run(self, out: Path, **config) -> int:
        """Submit the app with ``flwr run``; the run id."""
        overrides = " ".join(f"{k}={json.dumps(v)}" for k, v in config.items())
        done = subprocess.run([str(BIN / "flwr"), "run", str(APP), "inca-test", "--format", "json",
                               "--run-config", overrides], env=self.env, cwd=self.root, capture_output=True,
                              text=True, timeout=300, check=False)
        assert done.returncode == 0, f"flwr run failed:\n{done.stdout}\n{done.stderr}"
        payload = json.loads(done.stdout[done.stdout.index("{"):])
        assert payload["success"], payload
        return int(payload["run-id"])

    def tail(self) -> str:
        out = []
        for log in sorted([*self.logs.iterdir(), *self.root.glob("out/server-*.log")]):
            lines = log.read_text(errors="replace").splitlines()
            out.append(f"--- {log.name} (last 30 lines)\n" + "\n".join(lines[-30:]))
        return "\n".join(out)



def _wait_for(what: str, check, deadline: float, deployment: Deployment, poll: float = 0.1):
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        for name, proc in deployment.procs.items():
            if name == "superlink" and proc.poll() is not None:
                raise AssertionError(f"the SuperLink exited while waiting for {what}\n{deployment.tail()}")
        time.sleep(poll)
    raise AssertionError(f"timed out waiting for {what}\n{deployment.tail()}")


def _settings() -> dict:
    """The strategy settings of deploy_app's ServerApp (to predict its budget check)."""
    return {"iterations": ITERATIONS, "sigma_star": 0.5, "sigma_delta": 2.0, "clip_norm": 1.0, "seed": 1,
            "ledger_path": None}


@pytest.fixture(scope="module")
def deployment_runs(tmp_path_factory):
    if shutil.which("flower-superlink", path=str(BIN)) is None:
        pytest.skip("flower-superlink is not installed in this environment")
    root = tmp_path_factory.mktemp("deploy")
    out, ledger = root / "out", root / "ledger.json"
    out.mkdir()
    dep = Deployment(root)
    started = time.monotonic()
    common = {"iterations": ITERATIONS, "ledger-path": str(ledger), "out-dir": str(out)}
    try:
        dep.superlink()
        for partition in range(NODES):
            dep.supernode(partition)
        first = dep.flwr_run(out, **common, **{"num-server-rounds": 1, "nodes": NODES, "kill-partition": 0,
                                               "kill-round": KILL_ROUND, "kill-commit": KILL_COMMIT})
        deadline = time.monotonic() + 400
        (reached,) = _wait_for("node 0 to reach the mixing exchange",
                               lambda: list(out.glob("reached-node-*")), deadline, dep)
        dep.kill("supernode-0")
        (out / reached.name.replace("reached-", "dead-")).touch()  # the ServerApp's grid: it is gone
        summary1 = _wait_for("the first run's summary", lambda: _read(out / f"run-{first}.json"), deadline, dep)
        first_seconds = time.monotonic() - started
        # a new run of the same app on the same ledger, with a budget that one more round would exceed only
        # on top of what the first run spent: it must stop before contacting any node
        # it samples exactly NODES - 1 nodes (a small fraction_train, min_train_nodes = NODES - 1): the
        # SuperLink forgets the killed node only when its heartbeats are overdue (30-60 s), so "all the
        # nodes" could be 3 or 4, and the budget check depends on the number
        budget = _budget_between_fresh_and_resumed(ledger, NODES - 1)
        second = dep.flwr_run(out, **common, **{"num-server-rounds": 1, "nodes": NODES - 1,
                                                "fraction-train": 0.01, "max-epsilon": budget["max_epsilon"]})
        summary2 = _wait_for("the second run's summary", lambda: _read(out / f"run-{second}.json"),
                             time.monotonic() + 300, dep)
        alive = {name: proc.poll() is None for name, proc in dep.procs.items()}
    finally:
        dep.stop_all()
    yield {"first": summary1, "second": summary2, "ledger": json.loads(ledger.read_text()), "budget": budget,
           "alive": alive, "seconds": time.monotonic() - started, "first_seconds": first_seconds,
           "root": root}


def _budget_between_fresh_and_resumed(ledger_path: Path, n: int) -> dict:
    from flwr_inca.flower import IncaStrategy
    from flwr_inca.privacy import PrivacyLedger

    strategy = IncaStrategy(**_settings())
    predicted = strategy.session.charged(strategy.inca.predicted_mu(n))  # deploy_app's admission for n nodes
    spent = PrivacyLedger(ledger_path, delta=1e-5)
    fresh = PrivacyLedger(None, delta=1e-5).epsilon_after(predicted)
    resumed = spent.epsilon_after(predicted)
    assert fresh < resumed
    return {"max_epsilon": (fresh + resumed) / 2, "resumed": resumed, "spent": spent.epsilon()}


def _read(path: Path):
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def test_a_node_killed_during_mixing_is_a_dropout_and_the_round_completes(deployment_runs):
    first = deployment_runs["first"]
    assert sorted(first["rounds"]) == ["1"]
    one = first["rounds"]["1"]
    assert one["failed"] == "" and sorted(one["roster"]) == list(range(NODES))
    killed = one["roster"].index(0)  # party index of partition 0
    online = one["online"]  # (T + 1) x n
    assert [row[killed] for row in online] == [1] * KILL_COMMIT + [0] * (ITERATIONS + 1 - KILL_COMMIT)
    assert sorted(one["finalists"]) == list(range(1, NODES))
    # the killed node's exchange of commit 2 ended with the SuperLink's error (offline at T, it is asked
    # for no final); no live node was timed out, however slowly it answered
    assert one["metrics"]["inca-errors"] == 1 and one["metrics"]["inca-timeouts"] == 0
    assert all(math.isfinite(v) for v in first["model"]) and any(v != 0 for v in first["model"])
    assert not deployment_runs["alive"]["supernode-0"]
    assert all(alive for name, alive in deployment_runs["alive"].items() if name != "supernode-0")
    print(f"deployment: first run {deployment_runs['first_seconds']:.0f} s, all {deployment_runs['seconds']:.0f} s")


def test_the_round_with_the_dropout_is_charged_and_a_restarted_run_resumes_the_ledger(deployment_runs):
    first, second, ledger = deployment_runs["first"], deployment_runs["second"], deployment_runs["ledger"]
    assert [e["note"] for e in first["ledger"]] == ["round 1"] and ledger["rounds"] == first["ledger"]
    assert first["ledger"][0]["mu"] == pytest.approx(first["rounds"]["1"]["mu"]) and first["ledger"][0]["mu"] > 0
    assert first["resumed"] == 0 and second["resumed"] == 1
    # the restarted run found the first run's charge: with it, one more round exceeds the budget (without
    # it, the round would have fitted); it stopped before round 1 and contacted no node
    budget = deployment_runs["budget"]
    assert second["stopped"]["round"] == 1 and second["rounds"] == {}
    assert second["stopped"]["epsilon"] == pytest.approx(budget["spent"])
    assert second["stopped"]["predicted"] == pytest.approx(budget["resumed"])

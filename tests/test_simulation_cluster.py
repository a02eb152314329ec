"""A real Ray cluster: ``ray start --head --num-cpus 2`` as a separate process (non-default ports, its
own temp dir), a simulation that joins it with ``ray_address="auto"`` from another process, and the
same history as the run in this process. The cluster is stopped through its process group (all of
its processes were started by it), also when the test fails."""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("ray")
pytest.importorskip("torch")

import test_simulation as sim  # noqa: E402  (its synthetic data and model)

from flwr_inca.simulation import SimulationConfig, simulate  # noqa: E402

CONFIG = dict(rounds=2, max_epsilon=2.0, calibration_runs=2, iterations=5, lr=2.0, fraction=0.75)


def _free_port_block(size: int) -> int:
    """A base port with ``size`` free ports above it (checked by binding each)."""
    rng = np.random.default_rng()
    for _ in range(50):
        base = int(rng.integers(20_000, 60_000 - size))
        try:
            for p in range(base, base + size):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no free block of ports")


def _wait_for(port: int, proc: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ray start exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError("the Ray head did not come up")


@pytest.fixture
def ray_cluster():
    base = _free_port_block(80)
    temp = tempfile.mkdtemp(prefix="rw10-", dir="/tmp")  # short: Ray's socket paths have a length limit
    ray_bin = str(Path(sys.executable).parent / "ray")
    cmd = [
        ray_bin,
        "start",
        "--head",
        "--block",
        "--num-cpus",
        "2",
        "--node-ip-address",
        "127.0.0.1",
        "--port",
        str(base),
        "--node-manager-port",
        str(base + 1),
        "--object-manager-port",
        str(base + 2),
        "--ray-client-server-port",
        str(base + 3),
        "--dashboard-agent-listen-port",
        str(base + 4),
        "--dashboard-agent-grpc-port",
        str(base + 5),
        "--runtime-env-agent-port",
        str(base + 6),
        "--metrics-export-port",
        str(base + 7),
        "--dashboard-port",
        str(base + 8),
        "--min-worker-port",
        str(base + 20),
        "--max-worker-port",
        str(base + 79),
        "--include-dashboard=false",
        "--disable-usage-stats",
        "--temp-dir",
        temp,
    ]
    log = open(Path(temp) / "ray-start.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_for(base, proc)
        yield f"127.0.0.1:{base}", temp
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)  # the session ray start leads: only its processes
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    sys.path.insert(0, {tests!r})
    import ray
    import test_simulation as sim
    from flwr_inca.simulation import SimulationConfig, simulate
    hist = simulate(sim.MODEL, sim.PARTS, (sim.XT, sim.YT),
                    SimulationConfig(backend="ray", ray_address="auto", num_actors=2, **{config!r}),
                    progress=False)
    out = {{"gcs": ray.get_runtime_context().gcs_address, "backend": hist.backend,
            "params": hist.parameters.tolist(), "accuracy": hist.column("accuracy"),
            "mu": hist.column("mu"), "epsilon": hist.column("epsilon")}}
    print("RESULT" + json.dumps(out))
""")


def test_cluster_run_matches_the_in_process_run(ray_cluster):
    address, _ = ray_cluster
    env = dict(os.environ, RAY_ADDRESS=address)  # what "auto" finds (not a cluster of someone else)
    code = SCRIPT.format(tests=str(Path(__file__).parent), config=CONFIG)
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    remote = json.loads(run.stdout.split("RESULT", 1)[1])
    assert remote["gcs"].rsplit(":", 1)[1] == address.rsplit(":", 1)[1]  # it ran on that cluster
    assert "2 actor(s)" in remote["backend"]
    local = simulate(
        sim.MODEL, sim.PARTS, (sim.XT, sim.YT), SimulationConfig(backend="inline", **CONFIG), progress=False
    )
    assert np.array_equal(np.array(remote["params"], dtype=np.float32), local.parameters)
    assert remote["accuracy"] == local.column("accuracy")
    assert remote["mu"] == local.column("mu") and remote["epsilon"] == local.column("epsilon")

"""A real Ray cluster: ``ray start --head --num-cpus 2`` as a separate process (non-default ports, its
own temp dir), shared by the tests of this module: a simulation that joins it with ``ray_address="auto"``
from another process gives the same history as the run in this process, and ``flwr-inca simulate`` joins
the cluster that ``RAY_ADDRESS`` names, as ``ray.init`` does. The cluster is stopped through its process
group (all of its processes were started by it), also when a test fails."""

import gzip
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


def _wait_for(port: int, proc: subprocess.Popen, log: Path, timeout: float = 240) -> None:
    """Until the head's GCS accepts connections (the event), or ``ray start`` exits; ``timeout`` is only
    a generous deadline for a machine under load."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ray start exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"the Ray head did not come up in {timeout:.0f} s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
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
    log_path = Path(temp) / "ray-start.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_for(base, proc, log_path)
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


@pytest.mark.timeout(300)
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


def _write_idx(directory: Path, rng: np.random.Generator) -> None:
    """A tiny MNIST-shaped IDX dataset (the command's --data-dir), so that nothing is downloaded."""
    for split, n in [("train", 120), ("t10k", 40)]:
        images = rng.integers(0, 256, (n, 784)).astype(np.uint8)
        labels = rng.integers(0, 10, n).astype(np.uint8)
        with gzip.open(directory / f"{split}-images-idx3-ubyte.gz", "wb") as fh:
            fh.write((2051).to_bytes(4, "big") + n.to_bytes(4, "big") + (28).to_bytes(4, "big")
                     + (28).to_bytes(4, "big") + images.tobytes())
        with gzip.open(directory / f"{split}-labels-idx1-ubyte.gz", "wb") as fh:
            fh.write((2049).to_bytes(4, "big") + n.to_bytes(4, "big") + labels.tobytes())


@pytest.mark.timeout(300)
def test_simulate_joins_the_cluster_that_RAY_ADDRESS_names(ray_cluster, tmp_path):
    """``RAY_ADDRESS=host:port flwr-inca simulate`` (no --ray-address) joins that cluster, as ``ray.init``
    does, instead of asking Ray for a local one of --num-actors CPUs (which Ray refuses)."""
    address, _ = ray_cluster
    data, out = tmp_path / "mnist", tmp_path / "out"
    data.mkdir()
    _write_idx(data, np.random.default_rng(0))
    env = dict(os.environ, RAY_ADDRESS=address)
    command = ["simulate", "--clients", "4", "--rounds", "1", "--data-dir", str(data), "--sigma-star", "0.5",
               "--sigma-delta", "2", "--max-epsilon", "none", "--iterations", "3", "--num-actors", "2",
               "--out", str(out), "--json"]
    run = subprocess.run([str(Path(sys.executable).parent / "flwr-inca"), *command], env=env,
                         capture_output=True, text=True, timeout=280, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    history = json.loads((out / "history.json").read_text())
    port = address.rsplit(":", 1)[1]
    assert history["backend"].endswith(f":{port})"), history["backend"]  # it ran on that cluster


def test_an_unreachable_RAY_ADDRESS_is_named_before_ray_starts(monkeypatch):
    from flwr_inca.simulation.backend import connect_ray

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    message = rf"RAY_ADDRESS='127.0.0.1:{port}': no Ray cluster answers there"
    with pytest.raises(ConnectionError, match=message):
        connect_ray(None, num_cpus=2)

"""A real Ray cluster, ``ray start --head --num-cpus 2`` as a separate process (conftest's ``ray_cluster``):
a simulation that joins it with ``ray_address="auto"`` from another process gives the same history as the
run in this process, and ``flwr-inca simulate`` joins the cluster that ``RAY_ADDRESS`` names, as
``ray.init`` does."""

import gzip
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("ray")
pytest.importorskip("torch")

import test_simulation as sim  # noqa: E402  (its synthetic data and model)

from flwr_inca.simulation import SimulationConfig, simulate  # noqa: E402

CONFIG = dict(rounds=2, max_epsilon=2.0, calibration_runs=2, iterations=5, lr=2.0, fraction=0.75)


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

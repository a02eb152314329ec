"""A real Ray cluster, ``ray start --head --num-cpus 2`` as a separate process (conftest's ``ray_cluster``):
``flwr-inca simulate``, run in another process with ``RAY_ADDRESS`` naming the cluster (no --ray-address),
joins it, as ``ray.init`` does, and its run there gives the same model and history as the same command run
inline in this process."""

import gzip
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("ray")
pytest.importorskip("torch")

from flwr_inca import cli  # noqa: E402
from flwr_inca.simulation.backend import ray_address_to_join  # noqa: E402


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


def _outcome(out: Path) -> tuple[np.ndarray, list]:
    history = json.loads((out / "history.json").read_text())
    rounds = [(r["round"], r["accuracy"], r["mu"], r["epsilon"]) for r in history["rounds"]]
    return np.load(out / "model.npy"), rounds


@pytest.mark.timeout(300)
def test_simulate_joins_the_cluster_that_RAY_ADDRESS_names_and_runs_as_inline(ray_cluster, tmp_path, capsys):
    """``RAY_ADDRESS=host:port flwr-inca simulate`` (no --ray-address) joins that cluster, as ``ray.init``
    does, instead of asking Ray for a local one of --num-actors CPUs (which Ray refuses); two actors there,
    driven from another process, give the model and the rounds of the same command run inline here (3 of the 4
    clients sampled each round, under a permanent-dropout model)."""
    address, _ = ray_cluster
    data = tmp_path / "mnist"
    data.mkdir()
    _write_idx(data, np.random.default_rng(0))
    command = ["simulate", "--clients", "4", "--rounds", "2", "--data-dir", str(data), "--sigma-star", "0.5",
               "--sigma-delta", "2", "--max-epsilon", "none", "--iterations", "3",
               "--fraction", "0.75", "--dropout", "permanent:0.1", "--json"]
    env = dict(os.environ, RAY_ADDRESS=address)
    run = subprocess.run([str(Path(sys.executable).parent / "flwr-inca"), *command, "--num-actors", "2",
                          "--out", str(tmp_path / "cluster")], env=env, capture_output=True, text=True,
                         timeout=280, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    history = json.loads((tmp_path / "cluster" / "history.json").read_text())
    port = address.rsplit(":", 1)[1]
    assert history["backend"].endswith(f":{port})"), history["backend"]  # it ran on that cluster
    assert "2 actor(s)" in history["backend"]
    assert cli.main([*command, "--backend", "inline", "--out", str(tmp_path / "inline")]) == 0
    capsys.readouterr()
    (cluster_model, cluster_rounds), (inline_model, inline_rounds) = (
        _outcome(tmp_path / "cluster"), _outcome(tmp_path / "inline"))
    assert np.array_equal(cluster_model, inline_model) and cluster_rounds == inline_rounds
    assert [r[0] for r in cluster_rounds] == [0, 1, 2] and all(r[2] > 0 for r in cluster_rounds[1:])


def test_ray_address_auto_or_none_joins_what_RAY_ADDRESS_names(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    for given in (None, "auto"):
        assert ray_address_to_join(given) == ("10.0.0.1:6379", "RAY_ADDRESS")
    assert ray_address_to_join("10.0.0.2:1") == ("10.0.0.2:1", "ray_address")
    assert ray_address_to_join("local") == (None, "ray_address")
    monkeypatch.delenv("RAY_ADDRESS")
    assert ray_address_to_join("auto") == ("auto", "ray_address") and ray_address_to_join(None) == (None, "ray_address")


def test_an_unreachable_RAY_ADDRESS_is_named_before_ray_starts(monkeypatch):
    from flwr_inca.simulation.backend import connect_ray

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    message = rf"RAY_ADDRESS='127.0.0.1:{port}': no Ray cluster answers there"
    with pytest.raises(ConnectionError, match=message):
        connect_ray(None, num_cpus=2)

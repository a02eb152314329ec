"""The MNIST logistic-regression example: task unit tests and end-to-end runs through Flower."""

import gzip
import json
import math
import os
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("opacus")

EXAMPLE = Path(__file__).parent.parent / "examples" / "mnist_logreg"
sys.path.insert(0, str(EXAMPLE))
MNIST = Path(os.environ.get("FLWR_INCA_MNIST_DIR") or Path(__file__).parent.parent.parent / "shared" / "data" / "mnist")

from mnist_logreg import task  # noqa: E402


def _write_idx(path, array, magic):
    header = struct.pack(">II", magic, array.shape[0])
    if magic == 2051:
        header += struct.pack(">II", 28, 28)
    with gzip.open(path, "wb") as fh:
        fh.write(header + array.astype(np.uint8).tobytes())


def test_idx_reader_and_partitions(tmp_path):
    rng = np.random.default_rng(0)
    for split, n in [("train", 60), ("t10k", 20)]:
        _write_idx(tmp_path / f"{split}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 784)), 2051)
        _write_idx(tmp_path / f"{split}-labels-idx1-ubyte.gz", rng.integers(0, 10, n), 2049)
    task.load_data.cache_clear()
    data = task.load_data(str(tmp_path))
    assert data.x_train.shape == (60, 784) and data.y_test.shape == (20,) and data.features == 784
    parts = [task.partition(data, i, 4) for i in range(4)]
    assert sum(len(y) for _, y in parts) == 60
    # IID split: disjoint and covering
    rows = np.concatenate([x for x, _ in parts])
    assert len({r.tobytes() for r in rows}) == len({r.tobytes() for r in data.x_train})
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    task.load_data.cache_clear()
    with pytest.raises(FileNotFoundError, match="t10k-labels"):
        task.load_data(str(tmp_path))


def test_offline_fallback_to_digits(monkeypatch, capsys):
    monkeypatch.delenv("FLWR_INCA_MNIST_DIR", raising=False)
    monkeypatch.setitem(sys.modules, "datasets", None)  # flwr-datasets unavailable
    task.load_data.cache_clear()
    data = task.load_data("")
    assert data.features == 64 and "digits" in data.name
    assert "falling back to scikit-learn" in capsys.readouterr().err


def test_record_sensitivity_bound_by_brute_force():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((30, 12)).astype(np.float32) * 3
    y = rng.integers(0, 10, 30)
    lr, clip, B = 0.7, 0.5, 10

    def step(rows):
        torch.manual_seed(0)
        m = task.make_model(12)
        before = torch.cat([p.detach().reshape(-1) for p in m.parameters()]).clone()
        task.clipped_step(m, x[rows], y[rows], lr, clip, B)
        return torch.cat([p.detach().reshape(-1) for p in m.parameters()]) - before

    base = np.arange(12)
    for extra in range(12, 30):  # add one example: the step moves by at most lr * clip / B
        diff = (step(np.append(base, extra)) - step(base)).norm().item()
        assert diff <= lr * clip / B * (1 + 1e-5)
    big = (step(np.arange(30)) - step(np.arange(29))).norm().item()
    assert big > 0.5 * lr * clip / B  # large gradients are clipped to exactly the bound


def test_privacy_plan_record_level_composes_to_the_budget():
    from opacus.accountants import PRVAccountant

    cfg = task.load_config({"epsilon": 2.0, "num-server-rounds": 25, "batch-size": 40, "lr": 3.0, "clip-norm": 0.8})
    plan = task.privacy_plan(cfg, 2000)
    assert plan["sample_rate"] == pytest.approx(0.02)
    assert plan["value_sensitivity"] == pytest.approx(3.0 * 0.8 / 40)
    acc = PRVAccountant()
    acc.history = [(1 / plan["mu_round"], 0.02, 25)]
    assert acc.get_epsilon(delta=1e-5) == pytest.approx(2.0, abs=0.02)


def test_privacy_plan_party_level():
    from flwr_inca.privacy import epsilon_for_delta

    plan = task.privacy_plan(task.load_config({"privacy-unit": "party", "epsilon": 4.0, "num-server-rounds": 16}), 1)
    assert plan["value_sensitivity"] == 2.0 and plan["sample_rate"] == 1.0
    assert epsilon_for_delta(plan["mu_round"] * 4, 1e-5) == pytest.approx(4.0, rel=1e-6)
    with pytest.raises(ValueError, match="privacy-unit"):
        task.load_config({"privacy-unit": "household"})


def _run_example(tmp_path, monkeypatch, **config):
    from mnist_logreg import run

    monkeypatch.setenv("FLWR_TELEMETRY_ENABLED", "0")
    monkeypatch.setenv(task.ENV_CONFIG, "{}")  # run.main overwrites it; monkeypatch restores it
    args = ["--num-supernodes", "10", "--output-dir", str(tmp_path)]
    for key, value in config.items():
        args += [f"--{key}", str(value)]
    task.load_data.cache_clear()
    run.main(args)
    unit = config.get("privacy-unit", "record")
    return json.loads((tmp_path / f"mnist_logreg-{unit}" / "results.json").read_text())


@pytest.mark.flower
def test_example_runs_offline_on_digits(tmp_path, monkeypatch):
    monkeypatch.delenv("FLWR_INCA_MNIST_DIR", raising=False)
    monkeypatch.setitem(sys.modules, "datasets", None)
    out = _run_example(tmp_path, monkeypatch, **{"num-server-rounds": 5, "epsilon": 2.0, "batch-size": 20})
    history = out["history"]
    assert "digits" in out["dataset"] and len(history) == 6
    # learns: 3x chance after 5 private rounds (8 seeds of the same setting offline: 63% to 89%)
    assert history[-1]["accuracy"] > 0.3
    eps = [h["epsilon"] for h in history[1:]]
    assert eps == sorted(eps) and 0 < eps[-1] <= 2.0 + 0.02
    assert (tmp_path / "mnist_logreg-record" / "accuracy_epsilon.png").exists()
    assert len(list((tmp_path / "mnist_logreg-record" / "traces").iterdir())) == 5


@pytest.mark.flower
@pytest.mark.skipif(not MNIST.exists(), reason="MNIST IDX files not available (../shared/data/mnist)")
def test_example_runs_on_mnist(tmp_path, monkeypatch):
    out = _run_example(tmp_path, monkeypatch, **{"num-server-rounds": 2, "data-dir": MNIST,
                                                 "privacy-unit": "party", "epsilon": 8.0})
    assert out["dataset"].startswith("MNIST") and out["nodes"] == 10
    assert out["history"][-1]["epsilon"] <= 8.0 + 1e-9
    assert out["plan"]["value_sensitivity"] == 2.0

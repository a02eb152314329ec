"""Data, model, local training and configuration of the MNIST logistic-regression example.

Data, in order of preference:
1. a local directory with the four original MNIST IDX files (``*-idx?-ubyte.gz``), given as
   ``data-dir`` in the run config or the ``FLWR_INCA_MNIST_DIR`` environment variable;
2. MNIST from Hugging Face through ``flwr-datasets`` (needs ``pip install flwr-datasets`` and network);
3. scikit-learn's bundled 8x8 digits (offline fallback, announced on stderr).
"""

from __future__ import annotations

import gzip
import json
import math
import os
import struct
import sys
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

DEFAULTS: dict[str, Any] = {
    "num-server-rounds": 40,
    "num-partitions": 20,  # used by the plain Python entry point; `flwr run` uses the federation's nodes
    "privacy-unit": "record",  # "record" (DP-SGD-like, per example) or "party" (a node's whole update)
    "epsilon": 1.0,  # total budget over all rounds
    "delta": 1e-5,
    "iterations": 10,  # IncA mixing iterations per round
    "neighbors": 1,
    "collusion": 0.1,  # fraction of colluding nodes the guarantee holds against
    "lr": 6.0,
    "clip-norm": 1.0,  # record-level: per-example clip; party-level: clip of a node's update
    "batch-size": 50,  # record-level: expected Poisson batch per node and round
    "local-epochs": 1,  # party-level local training
    "data-dir": "",
    "output-dir": "outputs",
    "seed": 0,
}
ENV_CONFIG = "FLWR_INCA_EXAMPLE_CONFIG"  # JSON overrides, used by the plain Python entry point


def load_config(run_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Defaults, overridden by ``$FLWR_INCA_EXAMPLE_CONFIG`` (JSON), overridden by the run config."""
    cfg = dict(DEFAULTS)
    cfg.update(json.loads(os.environ.get(ENV_CONFIG, "{}")))
    cfg.update(dict(run_config or {}))
    if cfg["privacy-unit"] not in ("record", "party"):
        raise ValueError(f"privacy-unit must be 'record' or 'party', got {cfg['privacy-unit']!r}")
    return cfg


# ----------------------------------------------------------------------------------------- data
@dataclass(frozen=True)
class Dataset:
    x_train: np.ndarray  # (N, features) float32, standardized
    y_train: np.ndarray  # (N,) int64
    x_test: np.ndarray
    y_test: np.ndarray
    name: str

    @property
    def features(self) -> int:
        return int(self.x_train.shape[1])


def _read_idx(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") as fh:
        data = fh.read()
    magic, count = struct.unpack_from(">II", data)
    if magic == 2049:
        return np.frombuffer(data, dtype=np.uint8, offset=8).astype(np.int64)
    if magic == 2051:
        rows, cols = struct.unpack_from(">II", data, 8)
        return np.frombuffer(data, dtype=np.uint8, offset=16).reshape(count, rows * cols)
    raise ValueError(f"{path}: not an MNIST IDX file (magic {magic})")


def _standardize(x: np.ndarray) -> np.ndarray:
    return ((x.astype(np.float32) / 255.0) - 0.1307) / 0.3081


def _from_idx(directory: Path) -> Dataset:
    files = {k: directory / f"{k}.gz" for k in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                                                  "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
    missing = [str(p) for p in files.values() if not p.exists()]
    if missing:
        raise FileNotFoundError(f"MNIST IDX files missing: {', '.join(missing)}")
    return Dataset(_standardize(_read_idx(files["train-images-idx3-ubyte"])),
                   _read_idx(files["train-labels-idx1-ubyte"]),
                   _standardize(_read_idx(files["t10k-images-idx3-ubyte"])),
                   _read_idx(files["t10k-labels-idx1-ubyte"]), f"MNIST ({directory})")


def _from_hub() -> Dataset:
    from datasets import load_dataset  # flwr-datasets' dependency; needs network

    ds = load_dataset("ylecun/mnist")

    def arrays(split):
        x = np.stack([np.asarray(im, dtype=np.uint8).reshape(-1) for im in split["image"]])
        return _standardize(x), np.asarray(split["label"], dtype=np.int64)

    xtr, ytr = arrays(ds["train"])
    xte, yte = arrays(ds["test"])
    return Dataset(xtr, ytr, xte, yte, "MNIST (Hugging Face ylecun/mnist)")


def _from_sklearn() -> Dataset:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = ((digits.data / 16.0) - 0.5).astype(np.float32) / 0.5
    y = digits.target.astype(np.int64)
    perm = np.random.default_rng(0).permutation(len(y))
    x, y = x[perm], y[perm]
    cut = int(0.8 * len(y))
    return Dataset(x[:cut], y[:cut], x[cut:], y[cut:], "scikit-learn digits (8x8)")


@lru_cache(maxsize=4)
def load_data(data_dir: str = "") -> Dataset:
    """The dataset (cached per process); see the module docstring for the order of sources."""
    directory = data_dir or os.environ.get("FLWR_INCA_MNIST_DIR", "")
    if directory:
        return _from_idx(Path(directory))
    try:
        return _from_hub()
    except Exception as exc:  # offline, or flwr-datasets not installed
        print(f"[mnist_logreg] no MNIST directory given (data-dir / FLWR_INCA_MNIST_DIR) and the "
              f"Hugging Face download failed ({type(exc).__name__}: {str(exc)[:120]}); "
              "falling back to scikit-learn's 8x8 digits", file=sys.stderr)
        return _from_sklearn()


def partition(data: Dataset, partition_id: int, num_partitions: int) -> tuple[np.ndarray, np.ndarray]:
    """IID split of the training set: partition ``partition_id`` of ``num_partitions``."""
    idx = np.random.default_rng(12345).permutation(len(data.y_train))
    part = np.array_split(idx, num_partitions)[partition_id]
    return data.x_train[part], data.y_train[part]


# ----------------------------------------------------------------------------------------- model
def make_model(features: int) -> nn.Module:
    return nn.Linear(features, 10)


def accuracy(model: nn.Module, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    with torch.no_grad():
        logits = model(torch.from_numpy(x))
        loss = nn.functional.cross_entropy(logits, torch.from_numpy(y)).item()
        acc = (logits.argmax(1).numpy() == y).mean()
    return float(loss), float(acc)


def train_party_level(model: nn.Module, x: np.ndarray, y: np.ndarray, epochs: int, lr: float,
                      seed: int) -> None:
    """Plain local SGD (minibatches of 32); the node's whole update is clipped by IncaClient."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    for _ in range(epochs):
        for batch in torch.randperm(len(y), generator=gen).split(32):
            opt.zero_grad()
            nn.functional.cross_entropy(model(xt[batch]), yt[batch]).backward()
            opt.step()


def dp_step_record_level(model: nn.Module, x: np.ndarray, y: np.ndarray, lr: float, clip: float,
                         batch_size: int, rng: np.random.Generator) -> int:
    """One local DP-SGD step without local noise (IncA adds the noise, across nodes).

    Poisson-samples each local example with rate ``batch_size / len(y)``, then
    :func:`clipped_step`. Returns the sampled batch size.
    """
    q = min(1.0, batch_size / len(y))
    mask = rng.random(len(y)) < q
    if mask.any():
        clipped_step(model, x[mask], y[mask], lr, clip, batch_size)
    return int(mask.sum())


def clipped_step(model: nn.Module, x: np.ndarray, y: np.ndarray, lr: float, clip: float,
                 batch_size: int) -> None:
    """``-lr * sum_i clip(grad_i) / batch_size`` over the given examples, per-example gradients from
    Opacus. Adding or removing one example changes the step by at most ``lr * clip / batch_size``."""
    from opacus import GradSampleModule

    gsm = GradSampleModule(model)
    gsm.zero_grad()
    loss = nn.functional.cross_entropy(gsm(torch.from_numpy(x)), torch.from_numpy(y), reduction="sum")
    with warnings.catch_warnings():  # Opacus's hook on a model whose inputs need no gradient: harmless
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        loss.backward()
    params = [p for p in model.parameters() if p.requires_grad]
    per_example = torch.cat([p.grad_sample.reshape(p.grad_sample.shape[0], -1) for p in params], dim=1)
    factor = (clip / (per_example.norm(dim=1) + 1e-12)).clamp(max=1.0)
    with torch.no_grad():
        for p in params:
            summed = torch.einsum("i,i...->...", factor, p.grad_sample)
            p -= lr * summed / batch_size
            p.grad_sample = None
    gsm._close()


# ----------------------------------------------------------------------------------------- privacy
def privacy_plan(cfg: dict[str, Any], local_size: int) -> dict[str, float]:
    """Per-round target and sensitivities for a total (epsilon, delta) over the rounds.

    record: each round is a Poisson-subsampled Gaussian mechanism with sample rate q = B / N_local
    and sensitivity lr * C / B per example; the per-round mu is 1 / z for the noise multiplier z
    that Opacus's PRV accountant finds for (epsilon, delta, q, rounds).
    party: rounds compose as GDP, mu_round = mu_total / sqrt(rounds); sensitivity 2 C (replace-one).
    """
    from flwr_inca.privacy import epsilon_for_delta, mu_for_epsilon

    rounds, eps, delta = int(cfg["num-server-rounds"]), float(cfg["epsilon"]), float(cfg["delta"])
    if cfg["privacy-unit"] == "record":
        from opacus.accountants.utils import get_noise_multiplier

        q = min(1.0, int(cfg["batch-size"]) / local_size)
        z = get_noise_multiplier(target_epsilon=eps, target_delta=delta, sample_rate=q, steps=rounds,
                                 accountant="prv", epsilon_tolerance=0.01)
        mu_round = 1.0 / z
        sensitivity = float(cfg["lr"]) * float(cfg["clip-norm"]) / int(cfg["batch-size"])
        # a node's update is at most lr * C * (sampled batch) / B; clip it far above that
        party_clip = sensitivity * 4 * int(cfg["batch-size"])
    else:
        q = 1.0
        mu_round = mu_for_epsilon(eps, delta) / math.sqrt(rounds)
        sensitivity = 2 * float(cfg["clip-norm"])
        party_clip = float(cfg["clip-norm"])
    return {"sample_rate": q, "mu_round": mu_round, "epsilon_round": epsilon_for_delta(mu_round, delta),
            "value_sensitivity": sensitivity, "party_clip": party_clip}

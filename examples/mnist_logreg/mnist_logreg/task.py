"""Data, model, local training and configuration of the MNIST logistic-regression example.

Data (``flwr_inca.simulation.data``, shared with ``flwr-inca simulate``), in order of preference:
1. a local directory with the four original MNIST IDX files (``*-idx?-ubyte.gz``), given as
   ``data-dir`` in the run config or the ``FLWR_INCA_MNIST_DIR`` environment variable;
2. MNIST from Hugging Face through ``flwr-datasets`` (needs ``pip install flwr-datasets`` and network);
3. scikit-learn's bundled 8x8 digits (offline fallback, announced on stderr).

The privacy plan (per-round target from the total budget) is ``flwr_inca.privacy.plan``, also shared
with the simulator.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

import numpy as np
import torch
from torch import nn

from flwr_inca.privacy.plan import privacy_plan as _privacy_plan
from flwr_inca.simulation.data import Dataset
from flwr_inca.simulation.data import load_mnist as load_data  # noqa: F401  (cached; .cache_clear())
from flwr_inca.simulation.partitions import iid

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


def partition(data: Dataset, partition_id: int, num_partitions: int) -> tuple[np.ndarray, np.ndarray]:
    """IID split of the training set: partition ``partition_id`` of ``num_partitions`` (the same split
    as ``flwr_inca.simulation.iid`` with its default seed)."""
    part = iid(data.x_train, data.y_train, num_partitions).indices[partition_id]
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
    """Per-round target and sensitivities for a total (epsilon, delta) over the rounds
    (``flwr_inca.privacy.plan.privacy_plan``; record level: PRV accountant, party level: GDP)."""
    plan = _privacy_plan(cfg["privacy-unit"], epsilon=float(cfg["epsilon"]), delta=float(cfg["delta"]),
                         rounds=int(cfg["num-server-rounds"]), clip_norm=float(cfg["clip-norm"]),
                         lr=float(cfg["lr"]), batch_size=int(cfg["batch-size"]), local_size=local_size)
    return {"sample_rate": plan.sample_rate, "mu_round": plan.mu_round, "epsilon_round": plan.epsilon_round,
            "value_sensitivity": plan.value_sensitivity, "party_clip": plan.party_clip}
